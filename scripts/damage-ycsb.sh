#!/usr/bin/env bash
# YCSB-C throughput before and after bytes are flipped at random in the heap
# of a running kv-server: damaged keys must fail fast with Corrupt, the
# others keep their speed; `kv-server check` then lists the damage.
#
# usage: scripts/damage-ycsb.sh [BYTES]     (default 2000; needs a release build)
set -euo pipefail
cd "$(dirname "$0")/.."
B=target/release
R=/dev/shm/onekv-damage-$$
FLIPS=${1:-2000}
trap 'kill $SP 2>/dev/null || true; rm -f $R $R.sock' EXIT
$B/kv-server --listen shm://$R --memory 256MiB --stats-interval 0 2>/dev/null &
SP=$!
while [ ! -S $R.sock ]; do sleep 0.05; done
$B/kv-bench load --workload benches/workloads/workloadc --server shm://$R -p recordcount=100000 >/dev/null
run() {
  $B/kv-bench run --workload benches/workloads/workloadc --server shm://$R \
    -p recordcount=100000 -p operationcount=1000000 --threads 2 2>&1 |
    awk -F', ' '/OVERALL\], Throughput/{t=$3} /READ\], Return=OK/{ok=$3} /READ\], Return=ERROR/{e=$3}
                /READ\], MaxLatency/{m=$3} END{printf "ops/s %s, ok %s, errors %s, max read latency %s us\n", t, ok, e+0, m}'
}
echo "before: $(run)"
buckets=$($B/kv --server shm://$R stats | awk '$1=="buckets"{print $2}')
python3 - "$R" "$buckets" "$FLIPS" <<'PY'
import random, sys
path, buckets, flips = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
heap = (36864 + buckets * 64 + 4095) // 4096 * 4096   # header + key table + index
rnd = random.Random(7)
with open(path, "r+b") as f:
    for _ in range(flips):
        off = heap + rnd.randrange(115 << 20)             # where the records were loaded
        f.seek(off); b = f.read(1); f.seek(off); f.write(bytes([b[0] ^ 0x5a]))
PY
echo "after flipping $FLIPS bytes: $(run)"
kill $SP; wait $SP 2>/dev/null || true
$B/kv-server check $R | tail -1 || true
