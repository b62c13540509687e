#!/usr/bin/env bash
# A backup frozen (SIGSTOP) under load, measured: a one-shard cluster of
# three copies on members a, b, c (zones a, b, c), 100 k records of 100
# bytes loaded, member d (zone d) joined, then YCSB-A run by kv-bench
# (1-second status lines) while one backup is stopped for FROZEN seconds
# (default 8) and then let go. The shard's writers wait for the frozen
# copy until the map drops it (its lease expires: --lease-ttl 2 here) and
# a copy on d takes its place. Prints when the backup was stopped, the
# members' log lines about the new group, and kv-bench's per-second
# throughput and errors.
#
#   scripts/frozen-backup-bench.sh [FROZEN]
#
# Needs etcd (Debian: etcd-server) and release builds of kv-server and
# kv-bench (cargo build --release -p kv-server -p kv-bench).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/etcd-here.sh
frozen=${1:-8}
bin=${BIN_DIR:-target/release}
need_etcd_and "$bin" kv-server kv-bench

port=${ETCD_PORT:-23896}
bench_start frozen "$port"
declare -A member_pid=()
url="etcd://127.0.0.1:$port/frozen"
create_cluster_when_up "$bin/kv-server" "$url" --shards 1 --initial-members 3 --replicas 3

member() {
  "$bin/kv-server" --cluster "$url" --member-name "$1" --listen "shm://$work/$1" \
    --zone "$1" --lease-ttl 2 >"$work/$1.log" 2>&1 &
  pids+=($!)
  member_pid[$1]=$!
}
for m in a b c; do member "$m"; done
sleep 2
workload=(--server "$url" --workload benches/workloads/workloada -p recordcount=100000
  -p fieldcount=1 -p fieldlength=100)
"$bin/kv-bench" load "${workload[@]}" --threads 2 --status-interval 10 | grep -E "Throughput"
member d
sleep 2
"$bin/kv-bench" run "${workload[@]}" -p operationcount=1000000000 \
  -p maxexecutiontime=30 --threads 2 --status-interval 1 >"$work/run.log" 2>&1 &
bench=$!
sleep 8
backup=$("$bin/kv-server" cluster status "$url" | awk '/backups of \[0\]/ {print $2; exit}')
echo "--- stopping backup $backup 8 s into the run, at $(date +%T.%N)"
kill -STOP "${member_pid[$backup]}"
sleep "$frozen"
echo "--- letting it go at $(date +%T.%N)"
kill -CONT "${member_pid[$backup]}"
wait "$bench" || true
echo "--- the new group (the members' logs)"
grep -hE "copied to|a new group|lease" "$work"/[abcd].log | sed 's/\x1b\[[0-9;]*m//g' | sort
echo "--- kv-bench, 1-second windows"
grep -E "sec:|Throughput|Return|first error" "$work/run.log"
