#!/usr/bin/env bash
# The disk tier's paired arms on one model, each in its own process under a memory cgroup cap,
# the page cache dropped before each (README, "Experts on disk"). Run it under the exclusive lock:
#   scripts/disk_tier_bench.sh /tmp/q30 2G 1GiB 2     (EMBED_SCALE=100: predictable routing)
# Arms per round: the reader alone with 8 reads in flight (the disk floor's GB/s), then decode with
# the router predictor, then on-demand reads (--predictor none), at the same --host-memory and cap,
# then the mmap baseline (rows through the page cache, no prediction).
set -euo pipefail
MODEL=$1 CAP=${2:-2G} HOST=${3:-1GiB} ROUNDS=${4:-1} TOKENS=${TOKENS:-12} SCALE=${EMBED_SCALE:-1}
HERE=$(cd "$(dirname "$0")" && pwd)
drop() { sync; echo 1 > /proc/sys/vm/drop_caches; }
for r in $(seq "$ROUNDS"); do
  drop; "$HERE/memcap.sh" run "$CAP" python "$HERE/disk_tier_bench.py" reader "$MODEL" --inflight 8 --seconds 5
  drop; "$HERE/memcap.sh" run "$CAP" python "$HERE/disk_tier_bench.py" arm "$MODEL" --predictor router \
          --host-memory "$HOST" --tokens "$TOKENS" --embed-scale "$SCALE"
  drop; "$HERE/memcap.sh" run "$CAP" python "$HERE/disk_tier_bench.py" arm "$MODEL" --predictor none \
          --host-memory "$HOST" --tokens "$TOKENS" --embed-scale "$SCALE"
  # the mmap baseline: the fewest RAM rows (2K), the page cache (under the same cap) as the cache
  drop; "$HERE/memcap.sh" run "$CAP" python "$HERE/disk_tier_bench.py" arm "$MODEL" --predictor none \
          --host-memory "${MMAP_ROWS:-144MiB}" --disk-reads mmap --tokens "$TOKENS" --embed-scale "$SCALE"
done
