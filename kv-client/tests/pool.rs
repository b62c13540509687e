//! `ClientPool`: many threads share a few connections, each used by one
//! thread at a time.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use kv_client::{ClientOptions, ClientPool, Error};
use kv_common::Address;
use kv_server::{Server, ServerConfig};

fn server(dir: &tempfile::TempDir) -> (Server, String) {
    let region = dir.path().join("region");
    let mut config = ServerConfig::new(Address::Shm { region });
    config.memory = 16 << 20;
    let server = Server::start(config).expect("server starts");
    let address = server.address().to_string();
    (server, address)
}

#[test]
fn threads_share_the_pools_connections_one_at_a_time() {
    let dir = tempfile::tempdir_in("/dev/shm")
        .or_else(|_| tempfile::tempdir())
        .expect("dir");
    let (server, address) = server(&dir);
    const THREADS: usize = 6;
    const TASKS: usize = 40;
    let pool = ClientPool::new(&address, ClientOptions::default(), THREADS).expect("pool");
    // Which connection (by the server's id for it) each running task
    // holds: no two running tasks may hold the same one.
    let in_use = Mutex::new(Vec::<u64>::new());
    let most_at_once = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (pool, in_use, most_at_once) = (&pool, &in_use, &most_at_once);
            s.spawn(move || {
                for i in 0..TASKS {
                    let mut kv = pool.get().expect("a pooled client");
                    let me = kv.client_id();
                    {
                        let mut held = in_use.lock().expect("lock");
                        assert!(!held.contains(&me), "one client handed to two threads");
                        held.push(me);
                        most_at_once.fetch_max(held.len(), Ordering::Relaxed);
                    }
                    let key = format!("t{t}-{i}");
                    kv.put(key.as_bytes(), key.as_bytes()).expect("put");
                    assert_eq!(kv.get(key.as_bytes()).expect("get"), Some(key.into_bytes()));
                    in_use.lock().expect("lock").retain(|&c| c != me);
                }
            });
        }
    });
    // Every task found its own value, and the pool never opened more
    // connections than threads ran at once.
    let stats = server.stats();
    assert!(
        stats.connects as usize <= THREADS,
        "{} connects",
        stats.connects
    );
    assert!(most_at_once.load(Ordering::Relaxed) <= THREADS);
    assert_eq!(pool.idle(), stats.connects as usize);
    let mut kv = pool.get().expect("a pooled client");
    for t in 0..THREADS {
        for i in 0..TASKS {
            let key = format!("t{t}-{i}");
            assert_eq!(kv.get(key.as_bytes()).expect("get"), Some(key.into_bytes()));
        }
    }
}

#[test]
fn a_pool_returns_connections_beyond_its_size_to_the_server() {
    let dir = tempfile::tempdir_in("/dev/shm")
        .or_else(|_| tempfile::tempdir())
        .expect("dir");
    let (server, address) = server(&dir);
    let pool = ClientPool::new(&address, ClientOptions::default(), 2).expect("pool");
    let held: Vec<_> = (0..4)
        .map(|_| pool.get().expect("a pooled client"))
        .collect();
    assert_eq!(server.stats().clients_connected, 4);
    drop(held);
    // Two stay for reuse; the other two said goodbye.
    assert_eq!(pool.idle(), 2);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while server.stats().clients_connected != 2 {
        assert!(std::time::Instant::now() < deadline, "{:?}", server.stats());
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

#[test]
fn a_pool_with_a_wrong_address_fails_when_made() {
    let dir = tempfile::tempdir().expect("dir");
    let address = format!("shm://{}", dir.path().join("nobody").display());
    assert!(matches!(
        ClientPool::new(&address, ClientOptions::default(), 4),
        Err(Error::Unreachable(_))
    ));
}
