#!/usr/bin/env bash
# What replication costs the foreground load: the load itself (inserts),
# YCSB-A (run twice: right after the load, while the copies' heaps grow,
# then again), YCSB-C and YCSB-D (5% inserts) against a one-shard cluster
# of three members (zones a, b, c) created with one copy and with three,
# alternated ROUNDS times on the same machine. Prints each run's
# throughput and round trips per operation (and of those, how many were
# waited for one after the other; the load's insert p50), then
# the medians and the ratios R=3 / R=1.
#
#   scripts/replicas-bench.sh [RECORDS] [OPERATIONS] [ROUNDS]
#                                      (default 100000 2000000 3)
#
# THREADS sets the client threads (default 2); BENCH_ARGS adds kv-bench
# options to every run, split at spaces (so no value may hold one): e.g.
# BENCH_ARGS="--slot-cache-entries 16384", slot hints for every key of a
# 10 k-record run.
#
# Needs etcd (Debian: etcd-server) and release builds of kv-server,
# kv-bench and kv (cargo build --release --bins).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/etcd-here.sh
records=${1:-100000}
operations=${2:-2000000}
rounds=${3:-3}
threads=${THREADS:-2}
bin=${BIN_DIR:-target/release}
read -ra bench_args <<<"${BENCH_ARGS:-}"
need_etcd_and "$bin" kv-server kv-bench kv

port=${ETCD_PORT:-23894}
bench_start replicas "$port"

# `one_run R ROUND`: a fresh cluster of R copies; prints
# "R WORKLOAD OPS_PER_S READ_RT UPDATE_RT" for A, then C.
one_run() {
  local r=$1 round=$2 url="etcd://127.0.0.1:$port/r$1-$2" m members=()
  create_cluster_when_up "$bin/kv-server" "$url" --shards 1 --initial-members 3 --replicas "$r"
  for m in a b c; do
    mkdir -p "$work/r$r-$round"
    "$bin/kv-server" --cluster "$url" --member-name "$m" --listen "shm://$work/r$r-$round/$m" \
      --zone "$m" >"$work/r$r-$round/$m.log" 2>&1 &
    members+=($!)
  done
  pids+=("${members[@]}")
  # Until the shard is dealt and served.
  for _ in $(seq 150); do
    "$bin/kv" --server "$url" stats --shard 0 >/dev/null 2>&1 && break
    sleep 0.2
  done
  local common=(--server "$url" -p "recordcount=$records" --threads "$threads" "${bench_args[@]}")
  "$bin/kv-bench" load --workload benches/workloads/workloada "${common[@]}" >"$work/out" 2>&1 ||
    { cat "$work/out" >&2; return 1; }
  awk -v r="$r" -F', ' '
    /^\[OVERALL\], Throughput/ {t = $3}
    /^\[INSERT\], 50thPercentileLatency/ {p = $3}
    /^\[INSERT\], RoundTripsPerOp/ {rt = $3}
    /^\[INSERT\], WaitsPerOp/ {w = $3}
    END {printf "R=%s YCSB-load %8.0f ops/s  INSERT p50 %s us, %s rt/op (%s waited for)\n", r, t, p, rt, (w == "" ? "-" : w)}
  ' "$work/out"
  # YCSB-A twice: the first run after the load grows each copy's heap to
  # what the updates' garbage needs (page faults on fresh memory, on
  # every copy); the second measures the steady state.
  for run in a:A a:A-again c:C d:D; do
    "$bin/kv-bench" run --workload "benches/workloads/workload${run%%:*}" "${common[@]}" \
      -p "operationcount=$operations" >"$work/out" 2>&1 || { cat "$work/out" >&2; return 1; }
    awk -v r="$r" -v w="${run#*:}" -F', ' '
      /^\[OVERALL\], Throughput/ {t = $3}
      /^\[READ\], RoundTripsPerOp/ {rd = $3}
      /^\[UPDATE\], RoundTripsPerOp/ {up = $3}
      /^\[UPDATE\], WaitsPerOp/ {uw = $3}
      /first error/ {err = $0}
      END {printf "R=%s YCSB-%s %8.0f ops/s  READ %s rt/op  UPDATE %s rt/op (%s waited for) %s\n", r, w, t, rd, (up == "" ? "-" : up), (uw == "" ? "-" : uw), err}
    ' "$work/out"
  done
  kill -9 "${members[@]}" 2>/dev/null || true
  wait "${members[@]}" 2>/dev/null || true
  rm -rf "${work:?}/r$r-$round"
}

# Not in a pipeline: one_run's members must reach `pids` (and cleanup).
for round in $(seq "$rounds"); do
  for r in 1 3; do one_run "$r" "$round" >>"$work/all"; tail -5 "$work/all"; done
done
echo "--- medians of $rounds (R=3 / R=1)"
for w in load A A-again C D; do
  one=$(awk -v w="YCSB-$w" '$1 == "R=1" && $2 == w {print $3}' "$work/all" | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')
  three=$(awk -v w="YCSB-$w" '$1 == "R=3" && $2 == w {print $3}' "$work/all" | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')
  awk -v w="$w" -v a="$one" -v b="$three" 'BEGIN {printf "YCSB-%s: R=1 %.0f ops/s, R=3 %.0f ops/s: %.2fx\n", w, a, b, b / a}'
done
