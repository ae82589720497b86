#!/usr/bin/env bash
# Issue 27's hold: the disk tier's arms on one model, each its own process in ONE v1 memory cgroup
# (RSS + page cache capped; removed on exit, Ctrl-C or error), the page cache dropped before each arm.
# Run it under the exclusive lock, one round (<= 8 min) per hold; ratios are quoted within a hold.
#
#   scripts/disk_hold.sh MODEL CAP HOST OFFLOAD OUT.jsonl      e.g. /tmp/q30 2G 1GiB /tmp/q30-acc hold.jsonl
#   ROUND=2 ... (the arms in the opposite order)   ARMS="router none router#2" ... (these, in this order)
#   python scripts/disk_hold_table.py OUT.jsonl     (the table: TPOT, floor, shares, peaks)
#
# Arms: reader (the store file read alone, 8 reads in flight: the O_DIRECT GB/s of the disk floor),
# router (router prefetch), router-np / router-nc (the same without promoting kept prefetches /
# without cutting started wrong ones), router-l2 (router + layer l+2's predicted rows read below
# every other read, once the lookahead's recall >= AHEAD_RECALL, 0.5: runtime/layer/ahead.py),
# router-r32 / none-r32 (32 reader threads), none (on-demand reads), router-nv / none-nv (the rows'
# checksums not checked), router-t1 / none-t1 (decode on one core: no spinning worker beside the
# readers), mmap (rows through the page cache, no prediction, as llama.cpp), accelerate
# (transformers + accelerate's disk offload of the experts; its folder written once by
# `disk_tier_bench.py accelerate-prep MODEL --offload OFFLOAD`, outside the cap).
# Each arm's JSON line goes to OUT with its name, round, hold id, the cgroup's peak and limit hits.
# env: TOKENS (12), ACC_TOKENS (3), EMBED_SCALE (100: predictable routing), MMAP_ROWS (144MiB: 2K rows),
# EXPERT_DTYPE (auto: the checkpoint's bf16; int8 / int4: the store's rows quantised, written once),
# FLOOR_S (3: each decode arm runs the reader this many seconds in its own process just before its
# prefill and just after its decode, the floor of that arm; 0: off).
set -euo pipefail
[ $# -eq 5 ] || { sed -n 2,9p "$0" >&2; exit 2; }
MODEL=$1 CAP=$2 HOST=$3 OFFLOAD=$4 OUT=$5
TOKENS=${TOKENS:-12} ACC_TOKENS=${ACC_TOKENS:-3} SCALE=${EMBED_SCALE:-100} MMAP_ROWS=${MMAP_ROWS:-144MiB}
DTYPE=${EXPERT_DTYPE:-auto} ROUND=${ROUND:-1} FLOOR_S=${FLOOR_S:-3} ARMS=${ARMS:-reader router router-np none mmap accelerate}
HERE=$(cd "$(dirname "$0")" && pwd)
export PYTHONPATH="$(dirname "$HERE")${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's moespec, not an install's
ROOT=/sys/fs/cgroup/memory
[ -d "$ROOT" ] || { echo "error: $ROOT missing (needs cgroup v1 with the memory controller)" >&2; exit 2; }
CG="$ROOT/moespec-hold-$$"
HOLD="$(date -u +%H%M%S)-$$"
mkdir "$CG"
cleanup() {
  if [ -d "$CG" ]; then
    for p in $(cat "$CG/cgroup.procs" 2>/dev/null); do kill "$p" 2>/dev/null || true; done
    sleep 0.2
    for p in $(cat "$CG/cgroup.procs" 2>/dev/null); do echo "$p" > "$ROOT/cgroup.procs" 2>/dev/null || true; done
    echo 0 > "$CG/memory.force_empty" 2>/dev/null || true
    rmdir "$CG" 2>/dev/null || echo "warning: could not remove $CG" >&2
  fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM
echo "$CAP" > "$CG/memory.limit_in_bytes"

arm_args() {  # the bench's arguments of arm $1
  local common=(--host-memory "$HOST" --tokens "$TOKENS" --embed-scale "$SCALE" --expert-dtype "$DTYPE"
                --floor-seconds "$FLOOR_S")
  case "${1%%#*}" in  # router#2: router again, its own row
    reader) echo reader "$MODEL" --inflight 8 --seconds 5 --expert-dtype "$DTYPE" ;;
    router) echo arm "$MODEL" --predictor router "${common[@]}" ;;
    router-np) echo arm "$MODEL" --predictor router --no-kept-promote "${common[@]}" ;;
    router-nc) echo arm "$MODEL" --predictor router --no-cut "${common[@]}" ;;
    router-l2) echo arm "$MODEL" --predictor router --ahead "${AHEAD_RECALL:-0.5}" "${common[@]}" ;;
    none) echo arm "$MODEL" --predictor none "${common[@]}" ;;
    router-t1) echo arm "$MODEL" --predictor router --torch-threads 1 "${common[@]}" ;;
    none-t1) echo arm "$MODEL" --predictor none --torch-threads 1 "${common[@]}" ;;
    router-nv) echo arm "$MODEL" --predictor router --no-verify "${common[@]}" ;;
    none-nv) echo arm "$MODEL" --predictor none --no-verify "${common[@]}" ;;
    router-r32) echo arm "$MODEL" --predictor router --readers 32 "${common[@]}" ;;
    none-r32) echo arm "$MODEL" --predictor none --readers 32 "${common[@]}" ;;
    reader-32) echo reader "$MODEL" --inflight 32 --seconds 5 --expert-dtype "$DTYPE" ;;
    mmap) echo arm "$MODEL" --predictor none --host-memory "$MMAP_ROWS" --disk-reads mmap --tokens "$TOKENS" \
            --embed-scale "$SCALE" --expert-dtype "$DTYPE" ;;
    accelerate) echo accelerate "$MODEL" --offload "$OFFLOAD" --tokens "$ACC_TOKENS" ;;
    *) echo "error: unknown arm $1 (reader reader-32 router router-np router-nc router-l2 router-r32 router-nv router-t1 none none-r32 none-nv none-t1 mmap accelerate)" >&2; return 2 ;;
  esac
}

run_arm() {
  local name=$1 args line rc
  args=$(arm_args "$name")
  sync; echo 1 > /proc/sys/vm/drop_caches  # every arm starts with a cold page cache
  echo 0 > "$CG/memory.max_usage_in_bytes"; echo 0 > "$CG/memory.failcnt"
  set +e
  # shellcheck disable=SC2086  # the arguments are words without spaces
  line=$(sh -c 'echo $$ > "$1/cgroup.procs" && shift && exec "$@"' hold "$CG" python "$HERE/disk_tier_bench.py" $args \
         2> >(grep -v -e torchao -e _pytree >&2) | tail -n 1)
  rc=$?
  set -e
  python - "$line" "$name" "$ROUND" "$HOLD" "$rc" "$(cat "$CG/memory.max_usage_in_bytes")" \
           "$(cat "$CG/memory.limit_in_bytes")" "$(cat "$CG/memory.failcnt")" >> "$OUT" <<'PY'
import json, sys
line, arm, rnd, hold, rc, peak, limit, fails = sys.argv[1:]
try:
    row = json.loads(line)
except ValueError:
    row = {"error": line[-200:]}
row.update(arm=arm, round=int(rnd), hold=hold, rc=int(rc), peak_mib=int(peak) >> 20, cap_mib=int(limit) >> 20,
           limit_hits=int(fails))
print(json.dumps(row))
PY
  tail -n 1 "$OUT" | cut -c1-160
}

set -- $ARMS
order=("$@")
if [ "$ROUND" = 2 ]; then order=(); for a in "$@"; do order=("$a" "${order[@]}"); done; fi
for a in "${order[@]}"; do arm_args "$a" > /dev/null; done  # unknown names fail before anything runs
for a in "${order[@]}"; do run_arm "$a"; done
