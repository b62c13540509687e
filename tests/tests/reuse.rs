//! Overwritten and deleted blocks are reused after their grace period, so
//! update-heavy workloads run in bounded memory, whatever the value sizes.

use kv_client::Client;
use std::time::Duration;

use onekv_tests::{aggressive_reuse, eventually, or_abort, TestServer};

#[test]
fn update_only_workload_runs_in_bounded_memory() {
    // 2 MiB region; the clients write about 30 MiB of values through it.
    let srv = TestServer::start(|c| {
        aggressive_reuse(c);
        c.memory = 2 << 20;
    });
    std::thread::scope(|s| {
        for t in 0..2 {
            let address = &srv.address;
            s.spawn(move || {
                let mut kv = or_abort(Client::connect(address), "connect");
                for i in 0..15_000u32 {
                    let key = format!("t{t}-{}", i % 64);
                    or_abort(kv.put(key.as_bytes(), [i as u8; 1024]), "put");
                }
            });
        }
    });
    let mut kv = Client::connect(&srv.address).unwrap();
    // The last write of t0-63 was i = 14_975 (14_975 % 64 == 63).
    assert_eq!(kv.get(b"t0-63").unwrap(), Some(vec![14_975u32 as u8; 1024]));
}

#[test]
fn mixed_sizes_and_deletes_do_not_strand_space() {
    let srv = TestServer::start(|c| {
        aggressive_reuse(c);
        c.memory = 2 << 20;
    });
    let mut kv = Client::connect(&srv.address).unwrap();
    let sizes = [10usize, 200, 900, 3000, 12_000];
    for i in 0..6_000usize {
        let key = format!("k{}", i % 40);
        if i % 7 == 0 {
            kv.delete(key.as_bytes()).unwrap();
        } else {
            // Each phase favours one size, so freed blocks of the other
            // sizes must be given back and merged to be useful.
            let size = sizes[(i / 1200 + i % 2) % sizes.len()];
            kv.put(key.as_bytes(), vec![b'v'; size]).unwrap();
        }
    }
    kv.close().unwrap();
    // Everything the client held comes back to the server when it leaves:
    // only live blocks (at most 16 KiB each) are not free.
    let back = || {
        srv.server.collect_now();
        let s = srv.server.stats();
        s.live_slots > 0 && s.heap_free >= s.heap_size - s.live_slots * 16 * 1024
    };
    eventually(
        "the client's space to come back",
        Duration::from_secs(10),
        back,
    );
}
