#!/usr/bin/env bash
# A replicated shard's primary killed under load, and its copies restored,
# measured: a one-shard cluster of three copies on members a, b, c (zones
# a, b, c), RECORDS records of 100 bytes loaded, member d (zone d) joined,
# then YCSB-A run by kv-bench (1-second status lines) while the primary is
# killed with -9. The failover promotes one backup and keeps the other,
# which the new primary's member levels (see docs/design.md, failover),
# and a third copy is made on d. Prints the levelling's and the copy's log
# lines (keys, how long each took, how long the index was frozen: the
# shard's writers waited as long) and kv-bench's per-second throughput
# and errors.
#
# With FREEZE_BACKUP=S, a backup is frozen (SIGSTOP) for S seconds instead
# of the primary's kill, then let go: the shard's writers wait for it until
# the map drops it (its lease expires) and a copy on d takes its place.
#
#   scripts/restore-bench.sh [RECORDS]      (default 1000000)
#
# Needs etcd (Debian: etcd-server) and release builds of kv-server and
# kv-bench (cargo build --release -p kv-server -p kv-bench).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/etcd-here.sh
records=${1:-1000000}
bin=${BIN_DIR:-target/release}
need_etcd_and "$bin" kv-server kv-bench

port=${ETCD_PORT:-23892}
bench_start restore "$port"
declare -A member_pid=()
url="etcd://127.0.0.1:$port/restore"
create_cluster_when_up "$bin/kv-server" "$url" --shards 1 --initial-members 3 --replicas 3

member() {
  "$bin/kv-server" --cluster "$url" --member-name "$1" --listen "shm://$work/$1" \
    --zone "$1" --lease-ttl 2 >"$work/$1.log" 2>&1 &
  pids+=($!)
  member_pid[$1]=$!
}
for m in a b c; do member "$m"; done
sleep 2
workload=(--server "$url" --workload benches/workloads/workloada -p "recordcount=$records"
  -p fieldcount=1 -p fieldlength=100)
"$bin/kv-bench" load "${workload[@]}" --threads 2 --status-interval 10 | grep -E "Throughput|RunTime"
member d
sleep 2
"$bin/kv-bench" run "${workload[@]}" -p operationcount=1000000000 \
  -p maxexecutiontime=60 --threads 2 --status-interval 1 >"$work/run.log" 2>&1 &
bench=$!
sleep 10
if [ -n "${FREEZE_BACKUP:-}" ]; then
  backup=$("$bin/kv-server" cluster status "$url" | awk '/backups of \[0\]/ {print $2; exit}')
  echo "--- freezing backup $backup 10 s into the run, at $(date +%T.%N)"
  kill -STOP "${member_pid[$backup]}"
  sleep "$FREEZE_BACKUP"
  echo "--- letting it go at $(date +%T.%N)"
  kill -CONT "${member_pid[$backup]}"
else
  primary=$("$bin/kv-server" cluster status "$url" | awk '/shards \[0\]/ {print $2}')
  echo "--- killing the primary, $primary, 10 s into the run, at $(date +%T.%N)"
  kill -9 "${member_pid[$primary]}"
fi
wait "$bench" || true
echo "--- the failover, the levelling and the copy (the members' logs)"
grep -hE "copied to|a new group|levell|failed" "$work"/[abcd].log | sed 's/\x1b\[[0-9;]*m//g' | sort
"$bin/kv-server" cluster status "$url"
echo "--- kv-bench, 1-second windows"
grep -E "sec:|Throughput|Return|first error" "$work/run.log"
