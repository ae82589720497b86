#!/usr/bin/env bash
# The one command for the lent GPU machine (device README: one H200, Python 3.12, torch 2.11.0+cu130,
# transformers 5.17.0, nothing installable). Fail-fast: a failing step stops the rest. Each step has
# its own timeout; together they stay under 300 s (290 s of limits):
#   1 preflight   15 s  versions, CUDA, free host RAM and disk; stops on a mismatch
#   2 cuda tests  65 s  pytest -m cuda
#   3 bandwidth   20 s  pinned (exact-size and caching allocator) vs pageable H2D GB/s; demand-copy priority
#   4 build       40 s  a random bf16 Qwen3-30B-A3B-shaped slice (4 layers, ~6.2 GB) after a free-space check
#   5 profile    100 s  moespec profile: none / router / oracle, and misses computed on the real CPU
#                       (none+host, none+auto, router+auto: fetch vs host vs auto), --gpu-memory = two
#                       layers of experts, 12 decode tokens
#   6 syncs       40 s  host syncs per decode token (torch.cuda.set_sync_debug_mode)
#   7 report      10 s  gpu-check-report.json + .txt (with router+auto x none+auto TPOT, issue 17)
# Peak host memory, stated truthfully: the checkpoint (~6.2 GB, in RAM when the scratch folder is on
# /dev/shm) + the largest process (~5 GB pinned store + ~2-3 GB of Python/torch/CUDA): ~14 GB; the
# report gives the measured RSS. Scratch files live in one folder that a trap removes on exit, error,
# INT or TERM; a SIGKILL cannot be trapped, so each run first removes what an earlier run left.
# Results ($OUT, else profiles/): gpu-check-report.{json,txt}, gpu-check-profile.{json,trace.json,png},
# gpu-check-cuda-tests.txt (6 files: the device tool returns at most 8).
#
# Usage (repository root):  bash scripts/gpu_check.sh          SMOKE=1 bash scripts/gpu_check.sh (CPU)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-profiles}"
LAYERS="${LAYERS:-4}"
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 COLUMNS=120
# The machine has 128 GiB; a microVM's MemAvailable may start low and grow (device H200.md).
[ -z "${SMOKE:-}" ] && export MOESPEC_HOST_RAM_BYTES="${MOESPEC_HOST_RAM_BYTES:-$(( 120 * 2**30 ))}"
SMOKE_FLAG=${SMOKE:+--smoke}
SCRATCH_ROOT=/dev/shm
[ -d "$SCRATCH_ROOT" ] && [ -w "$SCRATCH_ROOT" ] || SCRATCH_ROOT="${TMPDIR:-/tmp}"
rm -rf "$SCRATCH_ROOT"/moespec-gpu-check.* 2>/dev/null  # left by a run that was SIGKILLed
WORK="$(mktemp -d "$SCRATCH_ROOT/moespec-gpu-check.XXXXXX")"
STEPS=""
cleanup() { rm -rf "$WORK"; }
trap cleanup EXIT
CHILD=""
on_signal() {  # steps run in the background and are waited for, so a signal is handled at once
  echo "gpu_check: interrupted"
  [ -n "$CHILD" ] && kill -TERM "$CHILD" 2>/dev/null && wait "$CHILD" 2>/dev/null
  exit 130  # the EXIT trap removes $WORK
}
trap on_signal INT TERM
# The GPU image's interpreter is python3 (/opt/torch/.venv); PYTHON overrides.
PYBIN="${PYTHON:-$(command -v python3 || command -v python)}"
PY=("$PYBIN" scripts/gpu_check.py --work "$WORK" --out-dir "$OUT_DIR" --layers "$LAYERS" $SMOKE_FLAG)

report() {  # best effort, also after a failure: what ran is reported
  timeout -k 2 10 "${PY[@]}" report --step-seconds "${STEPS# }" || true
}

# SMOKE runs on a slow shared CPU: its limits are scaled (TIME_SCALE), the GPU run's are not.
TIME_SCALE="${TIME_SCALE:-${SMOKE:+10}}"
TIME_SCALE="${TIME_SCALE:-1}"

step() {  # step NAME LIMIT_S CMD...: run with its own timeout; on failure report and stop
  local name=$1 limit=$(( $2 * TIME_SCALE )) t0=$SECONDS rc=0
  shift 2
  echo "== $name (limit ${limit} s)"
  timeout -k 5 "$limit" "$@" &
  CHILD=$!
  wait "$CHILD" || rc=$?
  CHILD=""
  STEPS="$STEPS $name=$(( SECONDS - t0 ))"
  if [ "$rc" -ne 0 ]; then
    [ "$rc" -eq 124 ] && echo "gpu_check: $name ran past ${limit} s"
    echo "gpu_check: step $name failed (exit $rc); stopping"
    report
    exit "$rc"
  fi
}

STEM="$OUT_DIR/gpu-check-profile"
if [ -n "${SMOKE:-}" ]; then
  DEVICE=(--device cpu --link-gbps 1 --threads 1)
else
  DEVICE=(--device cuda:0)
fi
step preflight 15 "${PY[@]}" preflight
if [ -z "${SMOKE:-}" ]; then
  step cuda-tests 65 bash -c "'$PYBIN' -m pytest -m cuda -q -x -p no:cacheprovider tests 2>&1 \
    | tee '$OUT_DIR/gpu-check-cuda-tests.txt'; exit \${PIPESTATUS[0]}"
  step bandwidth 20 "${PY[@]}" bandwidth
fi
step build 40 "${PY[@]}" build
EXPERTS_BYTES=$("$PYBIN" -c "import json,sys; b=json.load(open('$WORK/build.json')); print(2*b['num_experts']*b['expert_bytes'])")
PLOT=()
"$PYBIN" -c "import matplotlib" 2>/dev/null && PLOT=(--plot "$STEM.png")
step profile 100 "$PYBIN" -m moespec profile "$WORK/qwen3-30b-a3b-slice" "${DEVICE[@]}" --dtype bfloat16 \
  --gpu-memory "$EXPERTS_BYTES" --strategies none,router,oracle,none+host,none+auto,router+auto \
  --prompt-len 128 --gen 12 --repeats 2 \
  --warmup 1 --out "$STEM.json" --trace "$STEM.trace.json" "${PLOT[@]}" --force
step syncs 40 "${PY[@]}" syncs
report
echo "gpu_check: all steps passed ($STEPS ) -> $OUT_DIR/gpu-check-report.txt"
