//! Many clients insert the same new key at the same moment: afterwards
//! exactly one index slot holds it, and every client reads the same value.

use std::sync::{Barrier, Mutex};

use std::time::Duration;

use kv_client::{Client, ClientOptions};
use onekv_tests::{abort_saying, or_abort, parse_tagged, tagged_value, TestServer};

const CLIENTS: usize = 6;
const ROUNDS: usize = 400;

#[test]
fn concurrent_inserts_of_one_key_leave_exactly_one_slot() {
    // The smallest index: every key's six buckets overlap every other's.
    let srv = TestServer::start(|c| c.buckets = Some(8));
    let barrier = Barrier::new(CLIENTS);
    let seen = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for t in 0..CLIENTS {
            let (barrier, seen, srv) = (&barrier, &seen, &srv);
            s.spawn(move || {
                // Inserters pause between reading the buckets and their CAS,
                // widening the window in which they race.
                let options = ClientOptions::default()
                    .with_pause_after_index_read((t > 0).then_some(Duration::from_micros(400)));
                let mut kv = or_abort(Client::connect_with(&srv.address, options), "connect");
                for round in 0..ROUNDS {
                    let key = format!("fresh-{round}");
                    if t == 0 && round > 0 {
                        let old = format!("fresh-{}", round - 1);
                        or_abort(kv.delete(old.as_bytes()), "delete");
                    }
                    barrier.wait();
                    if t == 0 {
                        // Open and fill slots while the others insert, so
                        // they may find different first-empty slots.
                        for i in 0..8 {
                            let filler = format!("filler-{}", (round + i) % 6);
                            if i % 2 == 0 {
                                or_abort(kv.put(filler.as_bytes(), b"x"), "put");
                            } else {
                                or_abort(kv.delete(filler.as_bytes()), "delete");
                            }
                        }
                    } else {
                        let value = tagged_value(&key, &format!("c{t}"), round as u64, t * 10);
                        or_abort(kv.put(key.as_bytes(), &value), "put");
                    }
                    barrier.wait();
                    let got = or_abort(kv.get(key.as_bytes()), "get");
                    seen.lock().unwrap().push(got);
                    barrier.wait();
                    if t == 0 {
                        let slots = or_abort(srv.server.slots_holding(key.as_bytes()), "inspect");
                        let mut seen = seen.lock().unwrap();
                        let first = seen[0].clone();
                        let agreed = seen.iter().all(|v| *v == first);
                        let valid = first
                            .as_deref()
                            .and_then(parse_tagged)
                            .is_some_and(|(k, w, _)| k == key && w.starts_with('c'));
                        if slots != 1 || !agreed || !valid {
                            abort_saying(&format!(
                                "{key}: {slots} slots, reads agree: {agreed}, valid: {valid}"
                            ));
                        }
                        seen.clear();
                    }
                }
            });
        }
    });
    // Deleted keys are gone from the index entirely.
    for old in 0..ROUNDS - 1 {
        assert_eq!(
            srv.server
                .slots_holding(format!("fresh-{old}").as_bytes())
                .unwrap(),
            0
        );
    }
}
