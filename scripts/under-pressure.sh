#!/usr/bin/env bash
# What an operator or an attacker leaning on a kv-server sees (issue 22):
# - a Prometheus scrape while 300 idle and 10 trickling connections are
#   held on the metrics port;
# - the index after 14 `kv resize` requests in a row on an empty store;
# - a new client while the server runs under `ulimit -n 128` with 150 idle
#   control connections held;
# - `kv-server check --repair` rebuilding a lost header record by locating
#   the index of RECORDS keys (YCSB load).
#
# usage: scripts/under-pressure.sh [BIN_DIR [RECORDS]]
#        (default target/release and 1000000; BIN_DIR needs kv-server, kv
#        and kv-bench; python3 and prlimit)
set -uo pipefail
cd "$(dirname "$0")/.."
B=${1:-target/release}
RECORDS=${2:-1000000}
D=$(mktemp -d /dev/shm/onekv-pressure.XXXX)
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$D"' EXIT
serve() { # NAME [kv-server args...]: starts a server, waits for its socket
  local name=$1; shift
  "$@" --listen "shm://$D/$name" --stats-interval 0 2>/dev/null &
  pid=$!
  while [ ! -S "$D/$name.sock" ]; do sleep 0.05; done
}

port=$((20000 + RANDOM % 10000))
serve m "$B/kv-server" --metrics-listen "127.0.0.1:$port"
python3 - "$port" <<'PY'
import socket, sys, threading, time
port = int(sys.argv[1])
idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(300)]
slow = [socket.create_connection(("127.0.0.1", port)) for _ in range(10)]
stop = False
def trickle():
    while not stop:
        for s in slow:
            try: s.send(b"G")
            except OSError: pass
        time.sleep(0.1)
t = threading.Thread(target=trickle); t.start()
took = []
try:
    for _ in range(5):
        t0 = time.time()
        s = socket.create_connection(("127.0.0.1", port)); s.settimeout(60)
        s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        while s.recv(65536): pass
        took.append(f"{time.time() - t0:.3f}")
    print("scrape seconds with 300 idle and 10 trickling connections:", " ".join(took))
except socket.timeout:
    print("scrape: no answer within 60 s with 300 idle and 10 trickling connections")
stop = True; t.join()
PY

serve r "$B/kv-server"
for _ in $(seq 14); do timeout 60 "$B/kv" --server "shm://$D/r" resize >/dev/null 2>&1; done
echo "after 14 resize requests: $("$B/kv" --server "shm://$D/r" stats | grep '^buckets')"

serve l prlimit --nofile=128:128 "$B/kv-server"
python3 - "$D" "$B" <<'PY'
import socket, subprocess, sys, time
d, b = sys.argv[1], sys.argv[2]
idle = []
for _ in range(150):
    s = socket.socket(socket.AF_UNIX); s.connect(d + "/l.sock"); idle.append(s)
t0 = time.time()
r = subprocess.run([b + "/kv", "--server", "shm://" + d + "/l", "stats"], capture_output=True, text=True)
print(f"a new client under ulimit -n 128 with 150 idle connections: {time.time() - t0:.2f} s: "
      + (r.stderr or r.stdout).strip().splitlines()[0][:120])
PY

serve h "$B/kv-server"
"$B/kv-bench" load --workload benches/workloads/workloada --server "shm://$D/h" -p recordcount="$RECORDS" >/dev/null
kill "$pid"; wait "$pid" 2>/dev/null
python3 - "$D/h" <<'PY'
import sys
with open(sys.argv[1], "r+b") as f:          # both header records: one byte each
    for at in (0, 128):
        f.seek(at + 32); b = f.read(1); f.seek(at + 32); f.write(bytes([b[0] ^ 0x5a]))
PY
start=$(date +%s%N)
"$B/kv-server" check --repair "$D/h" | grep -E '^header|slots checked'
echo "check --repair of $RECORDS keys: $(( ($(date +%s%N) - start) / 1000000 )) ms"
