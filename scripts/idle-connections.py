#!/usr/bin/env python3
"""Idle control connections against a kv-server daemon: its threads and RSS
before and with N idle connections open, and how long a new client takes
meanwhile (served, or refused with a reason beyond the connection cap).

usage: scripts/idle-connections.py BIN_DIR N [kv-server options...]
  e.g. scripts/idle-connections.py target/release 10000 --max-clients 4096
"""
import os, socket, subprocess, sys, time, resource

soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
binpath = sys.argv[1]; n = int(sys.argv[2]); extra = sys.argv[3:]
region = "/dev/shm/idle-measure"
for f in (region, region + ".sock"):
    try: os.remove(f)
    except FileNotFoundError: pass
srv = subprocess.Popen([binpath + "/kv-server", "--listen", "shm://" + region, "--memory", "64MiB", "--stats-interval", "0"] + extra, stderr=subprocess.DEVNULL)
while not os.path.exists(region + ".sock"): time.sleep(0.02)
time.sleep(0.3)
def status(pid):
    d = dict(l.split(":", 1) for l in open(f"/proc/{pid}/status"))
    return int(d["Threads"]), int(d["VmRSS"].split()[0])
print("before: threads %d rss %d KiB" % status(srv.pid))
socks = []
for i in range(n):
    s = socket.socket(socket.AF_UNIX); s.connect(region + ".sock"); socks.append(s)
time.sleep(1.0)
t, r = status(srv.pid)
print("with %d idle connections: threads %d rss %d KiB" % (n, t, r))
t0 = time.time()
out = subprocess.run([binpath + "/kv", "--server", "shm://" + region, "stats"], capture_output=True, text=True)
print("new client `kv stats`: %.1f ms, exit %d, %s" % ((time.time() - t0) * 1000, out.returncode, (out.stderr.strip() or [l for l in out.stdout.splitlines() if "control_connections" in l or "clients_connected" in l])))
srv.terminate(); srv.wait()
for f in (region, region + ".sock"):
    try: os.remove(f)
    except FileNotFoundError: pass
