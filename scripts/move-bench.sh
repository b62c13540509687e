#!/usr/bin/env bash
# Moving one shard under load, measured: a one-shard cluster on member a,
# RECORDS records loaded, then YCSB-A run by kv-bench (1-second status
# lines) while member b joins and a drains, which moves the shard to b.
# Prints the move's log lines (keys, first pass, changes, how long the
# shard was stopped) and kv-bench's per-second throughput and max latency.
#
#   scripts/move-bench.sh [RECORDS]      (default 1000000)
#   TARGET=20000 scripts/move-bench.sh   (kv-bench held to 20 000 ops/s)
#   WORKLOAD=workloadc scripts/move-bench.sh   (reads only: they go on
#                                          while the last pass copies)
#
# Needs etcd (Debian: etcd-server) and release builds of kv-server and
# kv-bench (cargo build --release -p kv-server -p kv-bench).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/etcd-here.sh
records=${1:-1000000}
bin=${BIN_DIR:-target/release}
need_etcd_and "$bin" kv-server kv-bench

port=${ETCD_PORT:-23890}
bench_start move "$port"
url="etcd://127.0.0.1:$port/move"
create_cluster_when_up "$bin/kv-server" "$url" --shards 1 --initial-members 1

member() {
  "$bin/kv-server" --cluster "$url" --member-name "$1" --listen "shm://$work/$1" \
    --memory 1GiB >"$work/$1.log" 2>&1 &
  pids+=($!)
}
member a
a=$!
sleep 2
workload=(--server "$url" --workload "benches/workloads/${WORKLOAD:-workloada}" -p "recordcount=$records")
"$bin/kv-bench" load "${workload[@]}" --threads 2 --status-interval 10 | grep -E "Throughput|RunTime"
throttle=()
[ -n "${TARGET:-}" ] && throttle=(-p "target=$TARGET")
"$bin/kv-bench" run "${workload[@]}" "${throttle[@]}" -p operationcount=1000000000 \
  -p maxexecutiontime=40 --threads 1 --status-interval 1 >"$work/run.log" 2>&1 &
bench=$!
sleep 8
member b
sleep 2
kill -TERM "$a"  # drains: the shard moves to b
wait "$bench" || true
echo "--- the move (member a's log)"
grep -E "shard_move|moved to|failed" "$work/a.log" | sed 's/\x1b\[[0-9;]*m//g'
echo "--- kv-bench, 1-second windows"
grep -E "sec:|MaxLatency|Throughput|Return" "$work/run.log"
