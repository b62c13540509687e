//! Helpers shared by the end-to-end tests: servers in temporary regions,
//! and the paths of the workspace's binaries.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kv_common::protocol::ServerStats;
use kv_common::Address;
use kv_server::{Server, ServerConfig};

pub mod cluster;
pub mod daemon_log;
pub mod histories;

use daemon_log::DaemonLog;

/// A directory for regions: /dev/shm when the machine has it.
pub fn region_dir() -> tempfile::TempDir {
    let base = Path::new("/dev/shm");
    if base.is_dir() {
        tempfile::tempdir_in(base).expect("temporary directory in /dev/shm")
    } else {
        tempfile::tempdir().expect("temporary directory")
    }
}

/// A server on a fresh region in its own temporary directory.
pub struct TestServer {
    pub server: Server,
    pub address: String,
    pub dir: tempfile::TempDir,
}

/// Set (to this host's RDMA-capable address) to run the tests that use
/// [`TestServer`] over the rdma backend instead of shm; the Soft-RoCE VM
/// harness does.
pub fn rdma_host() -> Option<String> {
    std::env::var("ONEKV_TEST_RDMA_HOST")
        .ok()
        .filter(|h| !h.is_empty())
}

/// Where a test server listens: the shm region itself, or (under the
/// Soft-RoCE harness) a free port on the rdma host, with the region in
/// `region`.
pub fn test_address(region: &Path) -> Address {
    match rdma_host() {
        Some(host) => {
            let port = std::net::TcpListener::bind((host.as_str(), 0))
                .and_then(|l| l.local_addr())
                .expect("a free port")
                .port();
            Address::Rdma { host, port }
        }
        None => Address::Shm {
            region: region.to_path_buf(),
        },
    }
}

/// A 16 MiB server configuration on `region`, over [`test_address`].
pub fn test_config(region: &Path) -> ServerConfig {
    let mut config = ServerConfig::new(test_address(region));
    config.region_file = Some(region.to_path_buf());
    config.memory = 16 << 20;
    config
}

impl TestServer {
    pub fn start(tune: impl FnOnce(&mut ServerConfig)) -> TestServer {
        let dir = region_dir();
        let mut config = test_config(&dir.path().join("region"));
        tune(&mut config);
        let address = config.address.to_string();
        let server = Server::start(config).expect("server starts");
        TestServer {
            server,
            address,
            dir,
        }
    }

    pub fn region_path(&self) -> PathBuf {
        self.dir.path().join("region")
    }
}

/// Configuration that recycles freed blocks within milliseconds, so that
/// tests exercise reuse while slow readers may still hold old offsets.
pub fn aggressive_reuse(config: &mut ServerConfig) {
    config.op_deadline = Duration::from_millis(2);
}

/// A binary of this workspace (built by `cargo test --workspace`), or in
/// `ONEKV_BIN_DIR` when set (the Soft-RoCE VM keeps them in /bin).
pub fn workspace_bin(name: &str) -> PathBuf {
    if let Some(dir) = std::env::var_os("ONEKV_BIN_DIR") {
        return PathBuf::from(dir).join(name);
    }
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test> → target/<profile>/<name>
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target directory");
    let bin = dir.join(name);
    assert!(
        bin.exists(),
        "{} is not built; run the tests with `cargo test --workspace` (or `cargo build --bins` first)",
        bin.display()
    );
    bin
}

/// A value that says which key and which write it belongs to, so any
/// foreign, torn or stale value is recognisable.
pub fn tagged_value(key: &str, writer: &str, seq: u64, pad: usize) -> Vec<u8> {
    let mut v = format!("{key}|{writer}|{seq}|").into_bytes();
    v.extend(std::iter::repeat_n(b'.', pad));
    v
}

/// Splits a tagged value into (key, writer, seq), checking the padding.
pub fn parse_tagged(value: &[u8]) -> Option<(String, String, u64)> {
    let text = std::str::from_utf8(value).ok()?;
    let mut parts = text.splitn(4, '|');
    let key = parts.next()?.to_string();
    let writer = parts.next()?.to_string();
    let seq = parts.next()?.parse().ok()?;
    let pad = parts.next()?;
    pad.bytes().all(|b| b == b'.').then_some((key, writer, seq))
}

/// The next number of a xorshift generator (`state` not zero): the
/// tests' cheap, seeded choices.
pub fn xorshift(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

/// Unwraps a result inside a test's worker thread, aborting the whole test
/// process on error: a panicking worker would leave the others waiting at a
/// barrier forever instead of failing the test.
pub fn or_abort<T, E: std::fmt::Display>(result: Result<T, E>, what: &str) -> T {
    match result {
        Ok(v) => v,
        Err(e) => abort_saying(&format!("{what} failed: {e}")),
    }
}

/// Aborts the test process after writing `why` to the real stderr: the
/// test harness captures `eprintln!` of a test and its threads and would
/// drop it with the process, leaving only "Aborted" in the log.
/// The running daemons' logs follow, so that the abort can be explained.
pub fn abort_saying(why: &str) -> ! {
    use std::io::Write;
    let why = format!("{why} (at {})", utc_time_of_day());
    let _ = writeln!(std::io::stderr(), "{why}");
    daemon_log::write_live_tails();
    // Again after the logs, where a log's tail in CI ends.
    let _ = writeln!(std::io::stderr(), "aborting: {why}");
    // No destructor runs: the daemons would serve on, holding their ports
    // and regions, beside the tests that come after.
    kill_children();
    std::process::abort();
}

/// Kills (SIGKILL) every child process of this one: the daemons, etcds and
/// clients its tests started. Found by their parent in `/proc`, so that a
/// child already waited for (whose pid may be another process's by now)
/// is never named.
pub fn kill_children() {
    let me = std::process::id();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return;
    };
    for entry in entries.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        let parent = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        if parent == Some(me) {
            // SAFETY: kill(2) on a child of this process.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}

/// Now as `HH:MM:SS.mmm` UTC, the clock the daemons' log lines carry.
pub fn utc_time_of_day() -> String {
    let since_epoch = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let secs = since_epoch.as_secs() % 86_400;
    format!(
        "{:02}:{:02}:{:02}.{:03}Z",
        secs / 3600,
        secs / 60 % 60,
        secs % 60,
        since_epoch.subsec_millis()
    )
}

/// Waits until `done` holds (checking every millisecond) inside a test's
/// worker threads, aborting the whole test process if it does not within
/// `limit`: a wait that cannot end would hang the test instead of failing
/// it, and a panic would leave the other workers waiting.
pub fn wait_or_abort(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !done() {
        if Instant::now() > deadline {
            abort_saying(&format!("timed out after {limit:?} waiting for {what}"));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A `kv-server` process, killed if a test ends without stopping it. Its
/// log (stderr) is drained as it comes, and shown if the test fails while
/// the daemon runs.
pub struct Daemon {
    pub child: Option<Child>,
    pub address: Address,
    log: Option<DaemonLog>,
}

impl Daemon {
    /// Starts `kv-server` on `address` (the region in `region`) and waits
    /// until it accepts control connections.
    pub fn start(address: &Address, region: &Path, extra: &[&str]) -> Daemon {
        Daemon::start_with_env(address, region, extra, &[])
    }

    /// As [`Daemon::start`], with these environment variables set.
    pub fn start_with_env(
        address: &Address,
        region: &Path,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Daemon {
        let mut command = Daemon::command(address, region, extra);
        command.envs(env.iter().copied());
        Daemon::spawn(command, address)
    }

    /// As [`Daemon::start`], with its descriptor limit (soft and hard)
    /// lowered to `max_fds`.
    pub fn start_limited(address: &Address, region: &Path, extra: &[&str], max_fds: u64) -> Daemon {
        use std::os::unix::process::CommandExt;
        let mut command = Daemon::command(address, region, extra);
        // SAFETY: setrlimit is async-signal-safe; nothing else runs
        // between fork and exec.
        unsafe {
            command.pre_exec(move || {
                let lim = libc::rlimit {
                    rlim_cur: max_fds,
                    rlim_max: max_fds,
                };
                if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) == 0 {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            });
        }
        Daemon::spawn(command, address)
    }

    fn command(address: &Address, region: &Path, extra: &[&str]) -> Command {
        let mut command = Command::new(workspace_bin("kv-server"));
        command
            .arg("--listen")
            .arg(address.to_string())
            .arg("--region-file")
            .arg(region)
            .args(extra);
        command
    }

    /// Starts `command` and waits until it accepts control connections.
    fn spawn(command: Command, address: &Address) -> Daemon {
        let daemon = Daemon::spawn_unwaited(command, address);
        let deadline = Instant::now() + Duration::from_secs(30);
        while !daemon.listening() {
            assert!(
                Instant::now() < deadline,
                "kv-server did not start listening"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        daemon
    }

    /// Starts `command` (a `kv-server`), its log drained as it comes.
    pub fn spawn_unwaited(mut command: Command, address: &Address) -> Daemon {
        let mut child = command
            .stderr(Stdio::piped())
            .spawn()
            .expect("start kv-server");
        let label = daemon_label(&command, address);
        let log = child
            .stderr
            .take()
            .map(|stderr| DaemonLog::drain(stderr, label));
        Daemon {
            child: Some(child),
            address: address.clone(),
            log,
        }
    }

    fn listening(&self) -> bool {
        match &self.address {
            Address::Shm { region } => {
                std::os::unix::net::UnixStream::connect(Address::shm_socket(region)).is_ok()
            }
            Address::Rdma { host, port } => {
                std::net::TcpStream::connect((host.as_str(), *port)).is_ok()
            }
        }
    }

    /// Sends `signal` (SIGSTOP, SIGCONT) to the daemon.
    pub fn signal(&self, signal: i32) {
        if let Some(child) = &self.child {
            signal_child(child, signal);
        }
    }

    /// `kill -9`: no clean-up of any kind.
    pub fn kill_9(mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Waits (at most `limit`) for the daemon to exit by itself; its exit
    /// status and log.
    pub fn wait_exit(mut self, limit: Duration) -> (std::process::ExitStatus, String) {
        let mut child = self.child.take().expect("running daemon");
        let deadline = Instant::now() + limit;
        let status = loop {
            if let Some(status) = child.try_wait().expect("wait for kv-server") {
                break status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("kv-server did not exit within {limit:?}");
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        (status, self.take_log())
    }

    /// Everything the daemon logged (once it has exited).
    fn take_log(&mut self) -> String {
        self.log
            .take()
            .map(|mut log| log.finish())
            .unwrap_or_default()
    }

    /// SIGTERM; its exit status and log once it has stopped.
    pub fn terminate(mut self) -> (std::process::ExitStatus, String) {
        let mut child = self.child.take().expect("running daemon");
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let status = child.wait().expect("daemon exits");
        (status, self.take_log())
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        // A failing test shows what its servers said (the harness prints
        // a failed test's captured output).
        if std::thread::panicking() {
            if let Some(log) = self.log.as_mut() {
                log.wait_for_end(Duration::from_secs(1));
                eprint!("{}", log.tail(daemon_log::TAIL_LINES));
            }
        }
    }
}

/// What a daemon's log is called: its member name in a cluster, else its
/// address; and the test that started it (libtest names each test's
/// thread after the test, and an abort shows every test's daemons).
fn daemon_label(command: &Command, address: &Address) -> String {
    let args: Vec<_> = command.get_args().collect();
    let daemon = args
        .windows(2)
        .find(|pair| pair[0] == "--member-name")
        .map(|pair| format!("member {} ({address})", pair[1].to_string_lossy()))
        .unwrap_or_else(|| format!("kv-server {address}"));
    match std::thread::current().name() {
        Some(test) => format!("{daemon} of {test}"),
        None => daemon,
    }
}

/// Waits until `done` holds (calling it every 10 ms), for at most `limit`;
/// panics naming `what` otherwise. For effects that follow asynchronously
/// (a departed client's space is retired after its goodbye was sent, and
/// collected by the reclaimer thread).
pub fn eventually(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let not_yet = || if done() { Ok(()) } else { Err("not yet") };
    eventually_ok(what, limit, not_yet, String::new);
}

/// As [`eventually`], for a step that fails with a reason: the panic gives
/// the last reason and `context()` (what the system looked like then).
pub fn eventually_ok<E: std::fmt::Display>(
    what: &str,
    limit: Duration,
    mut step: impl FnMut() -> Result<(), E>,
    context: impl FnOnce() -> String,
) {
    let deadline = Instant::now() + limit;
    while let Err(e) = step() {
        if Instant::now() >= deadline {
            panic!(
                "timed out after {limit:?} waiting for {what} (at {}): {e}\n{}",
                utc_time_of_day(),
                context()
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Once every client has left and its space has settled (a grace period
/// after its fence), the heap space the running server holds in use must be
/// exactly what a fresh server computes from the index alone: nothing
/// leaked. (In use, not free: a growth the load asked for may still land
/// between the last figures and the stop, adding only free space.) Consumes the
/// server (it is stopped and the region reopened); returns the running
/// server's final stats for further checks.
pub fn assert_no_space_lost(server: Server, config: ServerConfig, what: &str) -> ServerStats {
    let settled = || {
        server.collect_now();
        let s = server.stats();
        s.clients_connected == 0 && s.heap_leased == 0
    };
    eventually(
        &format!("{what}: space to settle"),
        Duration::from_secs(10),
        settled,
    );
    // Everything retired is eligible a grace period after its fence.
    std::thread::sleep(config.grace());
    server.collect_now();
    let running = server.stats();
    drop(server);
    let fresh = reopen(config).stats();
    let in_use = |s: &ServerStats| s.heap_size - s.heap_free;
    assert_eq!(
        in_use(&running),
        in_use(&fresh),
        "{what}: space lost: running {running:?}, reopened {fresh:?}"
    );
    running
}

/// Starts a server on the region a dropped one served. Another test of
/// this process that forks a client just then hands the child the dropped
/// server's mapping, and with it the region's lock, until the child execs:
/// a start refused for the lock is tried again for a few seconds.
pub fn reopen(config: ServerConfig) -> Server {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match Server::start(config.clone()) {
            Ok(server) => return server,
            Err(e) if Instant::now() < deadline && e.to_string().contains("has it open") => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => panic!("the server does not reopen: {e}"),
        }
    }
}

/// Raises this process's descriptor limit to its hard limit (for tests
/// that open thousands of connections); returns the new soft limit.
pub fn raise_descriptor_limit() -> u64 {
    kv_server::raise_descriptor_limit()
}

/// Sends one control request on a raw control stream and reads the reply;
/// None once the server has closed the connection.
pub fn control_call<S: std::io::Read + std::io::Write>(
    stream: &mut S,
    request: &kv_common::protocol::Request,
) -> Option<kv_common::protocol::Response> {
    use kv_common::protocol;
    use kv_common::transport::{read_frame, write_frame};
    write_frame(stream, &protocol::encode(request).ok()?).ok()?;
    let reply = read_frame(stream).ok()??;
    Some(protocol::decode(&reply).expect("the server's reply decodes"))
}

/// A raw control connection to a shm test server that has sent Connect
/// (for tests that speak the protocol as a hostile client would).
pub fn connected_control(srv: &TestServer) -> std::os::unix::net::UnixStream {
    use kv_common::protocol::{Request, Response, PROTOCOL_VERSION};
    let socket = Address::shm_socket(&srv.region_path());
    let mut s = std::os::unix::net::UnixStream::connect(socket).expect("control socket");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("read timeout");
    let hello = Request::Connect {
        protocol_version: PROTOCOL_VERSION,
        secret: vec![],
        group: 0,
    };
    assert!(matches!(
        control_call(&mut s, &hello),
        Some(Response::Connected(_))
    ));
    s
}

/// Threads of this process whose name starts with `prefix` (the server's
/// are all named `kv-…`), so that other tests' threads do not count.
pub fn threads_named(prefix: &str) -> usize {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|name| name.starts_with(prefix))
        .count()
}

/// Sends `signal` (SIGSTOP, SIGCONT) to `child`, a process this test
/// started.
pub fn signal_child(child: &std::process::Child, signal: i32) {
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(child.id() as i32, signal) };
}
