//! Dropping a client never holds its thread for long: against a server
//! that stops answering, the goodbye gives up within a fraction of a
//! second, where it used to wait out the whole reply timeout (10 s by
//! default). `close` still waits for the answer, and says none came.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_client::{Client, ClientOptions, Error};
use kv_common::Address;
use kv_server::{Server, ServerConfig};

/// A relay in front of a server's control socket that can be told to go
/// silent: from then on it swallows every request, as a hung server would,
/// while the connection stays open. The region is reached through a
/// symbolic link named for the relay's socket.
struct Relay {
    address: String,
    silent: Arc<AtomicBool>,
}

impl Relay {
    fn start(dir: &Path, region: &Path) -> Relay {
        let front = dir.join("front");
        std::os::unix::fs::symlink(region, &front).expect("link to the region");
        let listener = UnixListener::bind(Address::shm_socket(&front)).expect("relay socket");
        let back = Address::shm_socket(region);
        let silent = Arc::new(AtomicBool::new(false));
        let quiet = Arc::clone(&silent);
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let (Ok(client), Ok(server)) = (client, UnixStream::connect(&back)) else {
                    return;
                };
                let (Ok(mut replies), Ok(mut to_client)) = (server.try_clone(), client.try_clone())
                else {
                    return;
                };
                std::thread::spawn(move || std::io::copy(&mut replies, &mut to_client));
                let quiet = Arc::clone(&quiet);
                std::thread::spawn(move || forward_until_silent(client, server, &quiet));
            }
        });
        Relay {
            address: format!("shm://{}", front.display()),
            silent,
        }
    }
}

/// Copies requests to the server until `silent`; after that, drops them.
fn forward_until_silent(mut client: UnixStream, mut server: UnixStream, silent: &AtomicBool) {
    let mut buf = [0u8; 4096];
    while let Ok(n @ 1..) = client.read(&mut buf) {
        if !silent.load(Ordering::SeqCst) && server.write_all(&buf[..n]).is_err() {
            return;
        }
    }
}

#[test]
fn dropping_a_client_of_a_server_that_stopped_answering_returns_at_once() {
    let dir = tempfile::tempdir().expect("dir");
    let region = dir.path().join("region");
    let mut config = ServerConfig::new(Address::Shm {
        region: region.clone(),
    });
    config.memory = 16 << 20;
    let _server = Server::start(config).expect("server starts");
    let relay = Relay::start(dir.path(), &region);

    let slow = ClientOptions::default().with_reply_timeout(Duration::from_secs(10));
    let mut dropped = Client::connect_with(&relay.address, slow).expect("connect");
    dropped.put("through", "the relay").expect("put");
    let quick = ClientOptions::default().with_reply_timeout(Duration::from_millis(500));
    let closed = Client::connect_with(&relay.address, quick).expect("connect");

    relay.silent.store(true, Ordering::SeqCst);
    let started = Instant::now();
    drop(dropped);
    let took = started.elapsed();
    // The bound is about 2 × 100 ms; 3 s leaves room for a loaded machine
    // and still fails the old wait of the whole 10 s reply timeout.
    assert!(took < Duration::from_secs(3), "drop took {took:?}");

    match closed.close() {
        Err(Error::Transport(e)) => assert!(e.is_connection_lost(), "{e:?}"),
        other => panic!("close had no answer to report, yet returned {other:?}"),
    }
}
