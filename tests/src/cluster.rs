//! Clusters for tests: an etcd of their own (a temporary data directory,
//! free ports) and `kv-server` members as processes.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kv_common::Address;

use crate::{workspace_bin, Daemon};

/// An etcd server on loopback, stopped (and its data removed) on drop.
pub struct EtcdServer {
    child: Child,
    port: u16,
    peer: u16,
    data: tempfile::TempDir,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind(("127.0.0.1", 0))
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// The etcd binary; installed from Debian's `etcd-server` when missing and
/// the tests run as root, else the test fails naming the package.
fn etcd_binary() -> std::path::PathBuf {
    let found = || {
        std::env::var_os("PATH")
            .into_iter()
            .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
            .map(|d| d.join("etcd"))
            .find(|p| p.is_file())
    };
    if let Some(path) = found() {
        return path;
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        let _ = Command::new("apt-get")
            .args(["install", "-y", "-qq", "etcd-server"])
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status();
    }
    found()
        .expect("etcd is not installed: install Debian's etcd-server (apt-get install etcd-server)")
}

impl EtcdServer {
    pub fn start() -> EtcdServer {
        // A port found free may be taken before etcd binds it (by another
        // test's etcd, or an outgoing connection): etcd then exits, and is
        // started again, afresh, on other ports.
        for _ in 0..5 {
            let data = tempfile::tempdir().expect("etcd data directory");
            let (port, peer) = (free_port(), free_port());
            let child = spawn_etcd(data.path(), port, peer);
            let mut etcd = EtcdServer {
                child,
                port,
                peer,
                data,
            };
            if etcd.wait_listening() {
                return etcd;
            }
        }
        panic!("etcd exited at start five times: are ports free on 127.0.0.1?");
    }

    /// Whether this etcd listens at its port (waited for); false when it
    /// exited first. A connection alone could reach whoever took the
    /// port.
    fn wait_listening(&mut self) -> bool {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if !matches!(self.child.try_wait(), Ok(None)) {
                return false;
            }
            if listens(self.child.id(), self.port) {
                return true;
            }
            assert!(Instant::now() < deadline, "etcd did not start listening");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Kills etcd (SIGKILL): its data stays for [`Self::start_again`].
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts etcd again on its data and ports, after [`Self::kill`].
    pub fn start_again(&mut self) {
        self.child = spawn_etcd(self.data.path(), self.port, self.peer);
        assert!(
            self.wait_listening(),
            "etcd did not start again on port {}",
            self.port
        );
    }

    /// The URL of cluster `name` in this etcd.
    pub fn url(&self, name: &str) -> String {
        format!("etcd://127.0.0.1:{}/{name}", self.port)
    }

    /// Compacts etcd's history up to `revision`: watches from before it
    /// are cancelled.
    pub fn compact(&self, revision: i64) {
        let body = format!("{{\"revision\": \"{revision}\", \"physical\": true}}");
        self.gateway("/v3/kv/compaction", &body);
    }

    /// Puts `value` at `key`, as an operator's `etcdctl put` would (or
    /// damage).
    pub fn put(&self, key: &str, value: &[u8]) {
        let body = format!(
            "{{\"key\": \"{}\", \"value\": \"{}\"}}",
            base64(key.as_bytes()),
            base64(value)
        );
        self.gateway("/v3/kv/put", &body);
    }

    /// Posts `body` to etcd's JSON gateway at `path`: the tests need no
    /// etcdctl.
    fn gateway(&self, path: &str, body: &str) {
        use std::io::{Read, Write};
        let mut stream = std::net::TcpStream::connect(("127.0.0.1", self.port)).expect("etcd");
        let request = format!(
            "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: \
             application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        stream.write_all(request.as_bytes()).expect("send");
        let mut reply = String::new();
        stream.read_to_string(&mut reply).expect("etcd's reply");
        assert!(reply.starts_with("HTTP/1.1 200"), "{path}: {reply}");
    }

    /// Sends `signal` (SIGSTOP, SIGCONT) to etcd.
    pub fn signal(&self, signal: i32) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, signal) };
    }
}

/// `bytes` in base64 (with padding), as etcd's JSON gateway takes keys and
/// values.
fn base64(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for group in bytes.chunks(3) {
        let word = group
            .iter()
            .enumerate()
            .fold(0u32, |w, (i, &b)| w | u32::from(b) << (16 - 8 * i));
        for i in 0..4 {
            out.push(match i <= group.len() {
                true => char::from(DIGITS[(word >> (18 - 6 * i) & 63) as usize]),
                false => '=',
            });
        }
    }
    out
}

/// Whether process `pid` holds a socket that listens on TCP `port` of
/// 127.0.0.1 (its sockets' inodes among the listeners of /proc/net/tcp).
fn listens(pid: u32, port: u16) -> bool {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    let sockets: Vec<String> = fds
        .filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
        .filter_map(|target| {
            let target = target.to_string_lossy();
            let inode = target.strip_prefix("socket:[")?.strip_suffix(']')?;
            Some(inode.to_string())
        })
        .collect();
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    let local = format!("0100007F:{port:04X}");
    table.lines().skip(1).any(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        // local address, state (0A: LISTEN), inode
        fields.len() > 9
            && fields[1] == local
            && fields[3] == "0A"
            && sockets.iter().any(|s| s == fields[9])
    })
}

fn spawn_etcd(data: &Path, port: u16, peer: u16) -> Child {
    let client_url = format!("http://127.0.0.1:{port}");
    let peer_url = format!("http://127.0.0.1:{peer}");
    Command::new(etcd_binary())
        .args(["--name", "onekv-test", "--data-dir"])
        .arg(data)
        .args(["--listen-client-urls", &client_url])
        .args(["--advertise-client-urls", &client_url])
        .args(["--listen-peer-urls", &peer_url])
        .args(["--initial-advertise-peer-urls", &peer_url])
        .arg("--initial-cluster")
        .arg(format!("onekv-test={peer_url}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start etcd")
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.signal(libc::SIGCONT);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `kv-server cluster create URL --shards S --initial-members M`.
pub fn create_cluster(url: &str, shards: u32, initial_members: u32) {
    create_cluster_with(url, shards, initial_members, &[]);
}

/// As [`create_cluster`], with `extra` arguments (`--replicas R`).
pub fn create_cluster_with(url: &str, shards: u32, initial_members: u32, extra: &[&str]) {
    let out = Command::new(workspace_bin("kv-server"))
        .args(["cluster", "create", url, "--shards"])
        .arg(shards.to_string())
        .arg("--initial-members")
        .arg(initial_members.to_string())
        .args(extra)
        .output()
        .expect("run kv-server cluster create");
    assert!(
        out.status.success(),
        "cluster create failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `kv-server cluster status URL`'s output.
pub fn cluster_status(url: &str) -> String {
    let out = Command::new(workspace_bin("kv-server"))
        .args(["cluster", "status", url])
        .output()
        .expect("run kv-server cluster status");
    if out.status.success() {
        String::from_utf8_lossy(&out.stdout).into_owned()
    } else {
        format!(
            "kv-server cluster status failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )
    }
}

/// A member `name` of the cluster at `url`, listening at
/// [`member_address`]; not waited for (it serves once the map gives it
/// shards). Its shards' regions are `dir/name.shard-S` either way, so a
/// member started again under its name finds them.
pub fn start_member(url: &str, dir: &Path, name: &str, extra: &[&str]) -> Daemon {
    start_member_with_env(url, dir, name, extra, &[])
}

/// As [`start_member`], with `env` set for the daemon (a test hook).
pub fn start_member_with_env(
    url: &str,
    dir: &Path,
    name: &str,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Daemon {
    let listen = member_address(dir, name);
    let mut command = Command::new(workspace_bin("kv-server"));
    command.envs(env.iter().copied());
    command
        .args(["--cluster", url, "--member-name", name, "--listen"])
        .arg(listen.to_string())
        .args(["--memory", "8MiB", "--lease-ttl", "2"])
        .args(extra);
    if let Address::Rdma { .. } = listen {
        command.arg("--region-file").arg(dir.join(name));
    }
    Daemon::spawn_unwaited(command, &listen)
}

/// Shards a test cluster may have: an rdma member needs their ports free.
const MEMBER_PORTS: u16 = 16;

/// Where member `name` of a test cluster in `dir` listens: `dir/name` on
/// shm; under the Soft-RoCE harness, a port on the rdma host whose next
/// `MEMBER_PORTS` ports (its shards') are free too, the same for every
/// start of the member (it is kept in `dir/name.port`).
pub fn member_address(dir: &Path, name: &str) -> Address {
    let Some(host) = crate::rdma_host() else {
        return Address::Shm {
            region: dir.join(name),
        };
    };
    let kept = dir.join(format!("{name}.port"));
    if let Some(port) = std::fs::read_to_string(&kept)
        .ok()
        .and_then(|p| p.trim().parse().ok())
    {
        return Address::Rdma { host, port };
    }
    let port = free_run_of_ports(&host);
    std::fs::write(&kept, port.to_string()).expect("keep the member's port");
    Address::Rdma { host, port }
}

/// The runs of ports this process handed to members: a member binds its
/// shards' ports only once it serves them, so a run found free may be
/// another member's already.
static HANDED_OUT: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());

/// A port of `host` free with its next `MEMBER_PORTS`, overlapping no run
/// handed out before, and below the kernel's ephemeral range (which the
/// clients' own sockets take ports from).
fn free_run_of_ports(host: &str) -> u16 {
    let ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let (low, high) = (10_000, ephemeral.saturating_sub(MEMBER_PORTS + 1));
    assert!(low < high, "no ports below the ephemeral range {ephemeral}");
    let free = |port: u16| std::net::TcpListener::bind((host, port)).is_ok();
    let mut handed = HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner());
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut seed = (now ^ u64::from(std::process::id()) << 32) | 1;
    let base = (0..1000)
        .map(|_| low + (crate::xorshift(&mut seed) % u64::from(high - low)) as u16)
        .find(|&base| {
            handed.iter().all(|&b| base.abs_diff(b) > MEMBER_PORTS)
                && (base..=base + MEMBER_PORTS).all(free)
        })
        .expect("a free run of ports");
    handed.push(base);
    base
}

/// The cluster read from these members (`cluster+shm://...` or
/// `cluster+rdma://...`).
pub fn members_url(dir: &Path, names: &[&str]) -> String {
    let members = names.iter().map(|n| member_address(dir, n)).collect();
    kv_cluster::ClusterSource::Members(members).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_of_member_ports_never_overlap() {
        let runs: Vec<u16> = (0..12).map(|_| free_run_of_ports("127.0.0.1")).collect();
        for (i, a) in runs.iter().enumerate() {
            for b in &runs[i + 1..] {
                assert!(a.abs_diff(*b) > MEMBER_PORTS, "{runs:?}");
            }
        }
    }
}
