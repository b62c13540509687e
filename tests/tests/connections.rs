//! The control plane under many connections: one thread serves them all,
//! limits refuse clearly, connections that never connect time out, and a
//! client facing a silent server fails with a timeout instead of hanging.

use std::io::Read;
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::{Duration, Instant};

use kv_client::{Client, ClientOptions, Error, TransportError};
use kv_common::Address;
use onekv_tests::{eventually, raise_descriptor_limit, region_dir, threads_named, TestServer};

#[test]
fn thousands_of_idle_connections_neither_add_threads_nor_lock_clients_out() {
    let limit = raise_descriptor_limit();
    let srv = TestServer::start(|c| {
        c.max_clients = 1024; // at most 2048 open control connections
        c.timeouts.handshake = Duration::from_secs(1);
    });
    let socket = Address::shm_socket(&srv.region_path());
    // A server runs kv-control, kv-reclaim, kv-accept and kv-grow, each
    // naming itself once it runs.
    const SERVER_THREADS: usize = 4;
    eventually(
        "the server's threads to start",
        Duration::from_secs(10),
        || threads_named("kv-") >= SERVER_THREADS,
    );
    let threads_before = threads_named("kv-");
    // Each connection costs this process two descriptors: ours and the
    // in-process server's.
    let wanted = ((limit as usize).saturating_sub(256) / 2).min(3000);
    let mut idle = Vec::new();
    while idle.len() < wanted {
        match UnixStream::connect(&socket) {
            Ok(s) => idle.push(s),
            Err(_) => break,
        }
    }
    assert!(
        idle.len() >= 380,
        "only {} connections (fd limit {limit})",
        idle.len()
    );
    // Let the accept thread hand them all to the event loop.
    let deadline = Instant::now() + Duration::from_secs(10);
    let open = idle.len().min(2048) as u64;
    while srv.server.stats().connections < open {
        assert!(Instant::now() < deadline, "{:?}", srv.server.stats());
        std::thread::sleep(Duration::from_millis(10));
    }
    // Other tests in this binary may start or stop servers meanwhile: the
    // claim is that this many connections add no thread of their own.
    let threads_after = threads_named("kv-");
    assert!(
        threads_after <= threads_before + SERVER_THREADS,
        "{} idle connections made the server start threads ({threads_before} → {threads_after})",
        idle.len(),
    );
    // A new client is served, or refused with a reason, at once.
    let started = Instant::now();
    match Client::connect(&srv.address) {
        Ok(mut kv) => kv.put(b"k", b"v").unwrap(),
        Err(Error::Refused(why)) => assert!(why.contains("limit"), "{why}"),
        Err(e) => panic!("neither served nor clearly refused: {e}"),
    }
    assert!(started.elapsed() < Duration::from_secs(5));
    // Connections that never sent Connect are closed after the handshake
    // timeout; then a client gets in.
    let deadline = Instant::now() + Duration::from_secs(20);
    while srv.server.stats().connections > 0 {
        assert!(
            Instant::now() < deadline,
            "idle connections were never closed"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut closed = [0u8; 1];
    assert_eq!(idle[0].read(&mut closed).unwrap_or(0), 0);
    drop(idle);
    let mut kv = Client::connect(&srv.address).unwrap();
    kv.put(b"after", b"idle").unwrap();
    assert_eq!(kv.get(b"after").unwrap().as_deref(), Some(&b"idle"[..]));
}

#[test]
fn clients_beyond_max_clients_are_refused_with_the_limit() {
    let srv = TestServer::start(|c| c.max_clients = 4);
    let mut clients: Vec<Client> = (0..4)
        .map(|_| Client::connect(&srv.address).unwrap())
        .collect();
    match Client::connect(&srv.address) {
        Err(Error::Refused(why)) => assert!(why.contains("at most 4 clients"), "{why}"),
        other => panic!("a fifth client was not refused: {:?}", other.map(|_| ())),
    }
    clients.pop().unwrap().close().unwrap();
    let mut fifth = Client::connect(&srv.address).unwrap();
    fifth.put(b"room", b"again").unwrap();
    clients[0].put(b"first", b"still").unwrap();
}

/// A raw connection to a test server's control endpoint, over either
/// transport, that never says anything.
enum Silent {
    Shm(UnixStream),
    Rdma(std::net::TcpStream),
}

impl Silent {
    fn connect(address: &str) -> Silent {
        match Address::parse(address).unwrap() {
            Address::Shm { region } => {
                Silent::Shm(UnixStream::connect(Address::shm_socket(&region)).unwrap())
            }
            Address::Rdma { host, port } => {
                Silent::Rdma(std::net::TcpStream::connect((host.as_str(), port)).unwrap())
            }
        }
    }

    /// Whether the server still holds it open.
    fn open(&mut self) -> bool {
        let mut byte = [0u8; 1];
        let read = match self {
            Silent::Shm(s) => s.set_nonblocking(true).and_then(|()| s.read(&mut byte)),
            Silent::Rdma(s) => s.set_nonblocking(true).and_then(|()| s.read(&mut byte)),
        };
        matches!(read, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
    }
}

/// A connection that never speaks is closed only at the server's handshake
/// timeout; meanwhile other clients connect as if it were not there (over
/// rdma its handshake is taken by the event loop, not by the accept).
#[test]
fn a_client_that_connects_and_stays_silent_holds_up_no_other() {
    let srv = TestServer::start(|c| c.timeouts.handshake = Duration::from_secs(300));
    let mut silent = Silent::connect(&srv.address);
    let mut kv = Client::connect(&srv.address).unwrap();
    kv.put(b"past", b"the silent one").unwrap();
    assert_eq!(
        kv.get(b"past").unwrap().as_deref(),
        Some(&b"the silent one"[..])
    );
    // Nobody waited for it: it is still open.
    assert!(silent.open());
}

/// Past the cap on open connections (twice `max_clients`), a client is
/// refused with the reason, over rdma too (where the reply has to wait for
/// its handshake).
#[test]
fn beyond_the_connection_cap_a_client_is_refused_with_the_reason() {
    let srv = TestServer::start(|c| {
        c.max_clients = 1;
        c.timeouts.handshake = Duration::from_secs(300);
    });
    let mut silent: Vec<Silent> = (0..2).map(|_| Silent::connect(&srv.address)).collect();
    eventually(
        "both silent connections open",
        Duration::from_secs(30),
        || srv.server.stats().connections == 2,
    );
    match Client::connect(&srv.address) {
        Err(Error::Refused(why)) => assert!(why.contains("its limit"), "{why}"),
        other => panic!("not refused with the reason: {:?}", other.map(|_| ())),
    }
    assert!(silent.iter_mut().all(Silent::open));
}

#[test]
fn a_silent_server_makes_connect_time_out_instead_of_hanging() {
    let dir = region_dir();
    let region = dir.path().join("silent");
    // Something listens on the control socket but never answers.
    let listener = UnixListener::bind(Address::shm_socket(&region)).unwrap();
    let holder = std::thread::spawn(move || listener.accept().map(|(s, _)| s));
    let options = ClientOptions::default().with_reply_timeout(Duration::from_millis(300));
    let started = Instant::now();
    let result = Client::connect_with(&format!("shm://{}", region.display()), options);
    let took = started.elapsed();
    match result {
        Err(Error::Transport(TransportError::Disconnected(why))) => {
            assert!(why.contains("no reply within"), "{why}")
        }
        Err(e) => panic!("not a timeout: {e:?}"),
        Ok(_) => panic!("connected to a server that never answered"),
    }
    assert!(took < Duration::from_secs(5), "took {took:?}");
    drop(holder.join());
}

/// A daemon whose descriptor limit (128, soft and hard) is far below what
/// `--max-clients` (1024) would need: idle connections fill what it can
/// open, and the next client is refused with the reason and counted — not
/// left in the listen backlog until its reply timeout.
#[test]
fn at_the_descriptor_limit_new_clients_are_refused_not_left_waiting() {
    raise_descriptor_limit();
    let dir = region_dir();
    let region = dir.path().join("region");
    let address = Address::Shm {
        region: region.clone(),
    };
    let daemon = onekv_tests::Daemon::start_limited(&address, &region, &[], 128);
    let socket = Address::shm_socket(&region);
    // More than 128 descriptors' worth, fewer than the listen backlog.
    let idle: Vec<UnixStream> = (0..150)
        .map(|_| UnixStream::connect(&socket).unwrap())
        .collect();
    let options = ClientOptions::default().with_reply_timeout(Duration::from_secs(30));
    match Client::connect_with(&address.to_string(), options.clone()) {
        Err(Error::Refused(why)) => assert!(why.contains("limit"), "{why}"),
        Err(e) => panic!("not refused with a reason: {e}"),
        Ok(_) => panic!("admitted beyond the descriptor limit"),
    }
    drop(idle);
    let mut kv = None;
    eventually("a client to get in", Duration::from_secs(20), || {
        kv = Client::connect_with(&address.to_string(), options.clone()).ok();
        kv.is_some()
    });
    let stats = kv.unwrap().server_stats().unwrap();
    assert!(stats.rejected_connects >= 1, "{stats:?}");
    drop(daemon);
}
