#!/usr/bin/env bash
# A onekv cluster on this machine: etcd on a temporary directory, a cluster
# of SHARDS shards, and three kv-server members over shm, until Ctrl-C.
#
#   scripts/local-cluster.sh [SHARDS]      (default 12)
#   REPLICAS=3 scripts/local-cluster.sh    (three copies of each shard,
#                                           the members in zones a, b, c)
#
# Needs etcd (Debian: etcd-server) and a build of kv-server (cargo build
# --release -p kv-server; protoc, Debian protobuf-compiler, to build it).
# Clients then connect with kv_client::ClusterClient::connect(URL), or
# without etcd through the members (the address it prints last), and
# `kv-server cluster status URL` shows who serves which shards.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/etcd-here.sh
shards=${1:-12}
server=${KV_SERVER:-target/release/kv-server}
command -v etcd >/dev/null || { echo "etcd not found: apt-get install etcd-server" >&2; exit 1; }
[ -x "$server" ] || { echo "$server not built: cargo build --release -p kv-server" >&2; exit 1; }

work=$(mktemp -d /dev/shm/onekv-cluster.XXXXXX)
pids=()
cleanup() {
  # A first signal drains a server (its shards move away); a second leaves.
  kill "${pids[@]}" 2>/dev/null || true
  sleep 0.2
  kill "${pids[@]}" 2>/dev/null || true
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT INT TERM

port=${ETCD_PORT:-23790}
etcd_here "$work" "$port"
pids+=($!)
url="etcd://127.0.0.1:$port/local"
create_cluster_when_up "$server" "$url" --shards "$shards" --initial-members 3 --replicas "${REPLICAS:-1}"

for m in a b c; do
  "$server" --cluster "$url" --member-name "$m" --listen "shm://$work/$m" --zone "$m" >"$work/$m.log" 2>&1 &
  pids+=($!)
done
sleep 2
"$server" cluster status "$url"
echo "cluster $url is up (logs in $work); Ctrl-C stops it"
echo "its members, for clients without etcd: cluster+shm://$work/a,$work/b,$work/c"
wait
