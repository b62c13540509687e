//! The data path is one-sided: during a steady GET/PUT/DELETE loop the
//! server's control plane handles no message except heap leases, and each
//! operation takes the round trips the design promises.

use kv_client::{Client, ClientOptions};
use onekv_tests::TestServer;

#[test]
fn steady_loop_sends_no_control_messages_beyond_leases() {
    let srv = TestServer::start(|_| {});
    let mut kv = Client::connect(&srv.address).unwrap();
    for i in 0..200 {
        kv.put(format!("warm-{i}").as_bytes(), &[7u8; 1024])
            .unwrap();
    }
    let before = srv.server.stats();
    let mut value = Vec::new();
    for i in 0..20_000u32 {
        let key = format!("warm-{}", i % 200);
        match i % 4 {
            0 => kv
                .put(key.as_bytes(), &i.to_le_bytes().repeat(256))
                .unwrap(),
            3 if i % 40 == 3 => {
                kv.delete(key.as_bytes()).unwrap();
            }
            _ => {
                kv.get_into(key.as_bytes(), &mut value).unwrap();
            }
        }
    }
    let after = srv.server.stats();
    let messages = after.messages() - before.messages();
    let leases = after.leases - before.leases;
    let heap = leases + after.give_backs - before.give_backs;
    assert_eq!(
        messages, heap,
        "control messages other than heap leases: {before:?} → {after:?}"
    );
    assert!(
        leases < 20,
        "{leases} leases for a bounded working set: space is not being reused"
    );
}

/// Clients with slot hints on (the default over rdma, off over shm).
fn hinted(address: &str) -> Client {
    let options = ClientOptions {
        slot_cache_entries: Some(1024),
        ..ClientOptions::default()
    };
    Client::connect_with(address, options).unwrap()
}

#[test]
fn operations_take_the_promised_round_trips() {
    let srv = TestServer::start(|_| {});
    let mut kv = hinted(&srv.address);
    kv.put(b"warm", b"up").unwrap(); // takes the first lease
    let rt = |kv: &Client| kv.verb_stats().round_trips;

    let at = rt(&kv);
    kv.put(b"k", &[1u8; 1024]).unwrap();
    assert_eq!(
        rt(&kv) - at,
        3,
        "insert: write+buckets, CAS, duplicate check"
    );

    let at = rt(&kv);
    kv.put(b"k", &[2u8; 1024]).unwrap();
    assert_eq!(rt(&kv) - at, 2, "warm update: write+buckets+block, CAS");

    let at = rt(&kv);
    assert_eq!(kv.get(b"k").unwrap(), Some(vec![2u8; 1024]));
    assert_eq!(rt(&kv) - at, 1, "warm get: buckets and block in one batch");

    // A client that has not seen the key: buckets, then block; then warm.
    let mut other = hinted(&srv.address);
    let at = rt(&other);
    assert_eq!(other.get(b"k").unwrap(), Some(vec![2u8; 1024]));
    assert_eq!(rt(&other) - at, 2, "cold get: buckets, block");
    let at = rt(&other);
    assert_eq!(other.get(b"k").unwrap(), Some(vec![2u8; 1024]));
    assert_eq!(rt(&other) - at, 1, "warm get");

    // Its hint goes stale when another client updates the key: the slot
    // no longer matches, so it falls back to a full GET and sees the update.
    kv.put(b"k", &[3u8; 1024]).unwrap();
    let at = rt(&other);
    other.put(b"cold", &[1u8; 64]).unwrap();
    other.put(b"cold", &[2u8; 64]).unwrap();
    assert_eq!(rt(&other) - at, 3 + 2, "insert, then warm update");
    let at = rt(&other);
    assert_eq!(other.get(b"k").unwrap(), Some(vec![3u8; 1024]));
    assert_eq!(
        rt(&other) - at,
        3,
        "stale hint: one batch, then buckets and block"
    );

    let at = rt(&kv);
    assert!(kv.delete(b"k").unwrap());
    assert_eq!(rt(&kv) - at, 3, "delete: buckets, block, CAS");

    let at = rt(&kv);
    assert_eq!(kv.get(b"k").unwrap(), None);
    assert!(
        rt(&kv) - at <= 2,
        "missing key: buckets (and a fingerprint false positive at most)"
    );
}
