#!/usr/bin/env bash
# Run a command under a memory cgroup (v1) that caps its RAM *including its page cache*, then remove
# the cgroup. The disk tier's measurements (README, "Experts on disk") run each arm this way.
#
#   scripts/memcap.sh run LIMIT COMMAND [ARG ...]   e.g. scripts/memcap.sh run 2G python bench.py
#   scripts/memcap.sh clean                          remove every cgroup this script made (left by a kill -9)
#
# After the command: one line on stderr with the cgroup's peak usage (RSS + page cache,
# memory.max_usage_in_bytes), the limit and how often it was hit (failcnt). Needs root and
# /sys/fs/cgroup/memory (cgroup v1). The exit status is the command's.
set -euo pipefail
ROOT=/sys/fs/cgroup/memory
PREFIX=moespec-memcap-

case "${1:-}" in
  clean)
    for d in "$ROOT"/"$PREFIX"*; do [ -d "$d" ] && rmdir "$d" && echo "removed $d"; done
    exit 0 ;;
  run) shift ;;
  *) echo "usage: $0 run LIMIT COMMAND [ARG ...] | $0 clean" >&2; exit 2 ;;
esac
[ $# -ge 2 ] || { echo "usage: $0 run LIMIT COMMAND [ARG ...]" >&2; exit 2; }
[ -d "$ROOT" ] || { echo "error: $ROOT missing (needs cgroup v1 with the memory controller)" >&2; exit 2; }
LIMIT=$1; shift
CG="$ROOT/$PREFIX$$"
mkdir "$CG"
cleanup() {
  # the command has ended: move anything left back to the root, then remove the group
  if [ -d "$CG" ]; then
    for p in $(cat "$CG/cgroup.procs" 2>/dev/null); do echo "$p" > "$ROOT/cgroup.procs" 2>/dev/null || true; done
    echo 0 > "$CG/memory.force_empty" 2>/dev/null || true
    rmdir "$CG" 2>/dev/null || echo "warning: could not remove $CG" >&2
  fi
}
trap cleanup EXIT
echo "$LIMIT" > "$CG/memory.limit_in_bytes"
set +e
sh -c 'echo $$ > "$1/cgroup.procs" && shift && exec "$@"' memcap "$CG" "$@"
rc=$?
set -e
peak=$(cat "$CG/memory.max_usage_in_bytes"); lim=$(cat "$CG/memory.limit_in_bytes"); fails=$(cat "$CG/memory.failcnt")
echo "memcap: peak $((peak / 1048576)) MiB (RSS + page cache) of a $((lim / 1048576)) MiB cap; limit hit $fails times; rc $rc" >&2
exit $rc
