# Sourced by the cluster scripts. `etcd_here DIR PORT` starts a one-node
# etcd on loopback (client port PORT, peer port PORT+1), its data and log
# in DIR, in the background; its pid is then in $!.
etcd_here() {
  local dir=$1 port=$2
  etcd --name here --data-dir "$dir/etcd" \
    --listen-client-urls "http://127.0.0.1:$port" --advertise-client-urls "http://127.0.0.1:$port" \
    --listen-peer-urls "http://127.0.0.1:$((port + 1))" \
    --initial-advertise-peer-urls "http://127.0.0.1:$((port + 1))" \
    --initial-cluster "here=http://127.0.0.1:$((port + 1))" >"$dir/etcd.log" 2>&1 &
}

# `create_cluster_when_up KV_SERVER URL ARGS...` makes the cluster once etcd
# answers (it takes a moment to start).
create_cluster_when_up() {
  local server=$1 url=$2
  shift 2
  for _ in $(seq 100); do
    "$server" cluster create "$url" "$@" 2>/dev/null && return 0
    sleep 0.1
  done
  echo "could not create $url (etcd's log is beside it)" >&2
  return 1
}

# `need_etcd_and BIN_DIR PROGRAMS...` stops the script, saying what to do,
# unless etcd is installed and each program is built in BIN_DIR.
need_etcd_and() {
  local bin=$1 b
  shift
  command -v etcd >/dev/null || { echo "etcd not found: apt-get install etcd-server" >&2; exit 1; }
  for b in "$@"; do
    [ -x "$bin/$b" ] || { echo "$bin/$b not built: cargo build --release --bins" >&2; exit 1; }
  done
}

# `bench_start NAME PORT` (the bench scripts): a work directory on
# /dev/shm in $work, an array `pids` whose processes are killed (-9) and
# the directory removed when the script ends, and etcd started there on
# PORT (its pid the first of `pids`).
bench_start() {
  work=$(mktemp -d "/dev/shm/onekv-$1.XXXXXX")
  pids=()
  trap bench_cleanup EXIT INT TERM
  etcd_here "$work" "$2"
  pids+=($!)
}

bench_cleanup() {
  kill -9 "${pids[@]}" 2>/dev/null || true
  wait 2>/dev/null || true
  rm -rf "$work"
}
