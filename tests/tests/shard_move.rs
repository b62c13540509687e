//! A shard move's copy (`kv_server::shard_move::send`): the first pass runs
//! while the source still serves the shard and its clients write, and the
//! target ends with exactly what the source held when it stopped — values
//! changed, deleted, turned into counters and back between the passes
//! included — while the second pass sends only what changed.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};

use kv_client::{Client, ClientOptions};
use kv_server::shard_move::{self, Outgoing};
use onekv_tests::{or_abort, test_config, TestServer};

/// What a key holds, as the test expects it.
#[derive(Debug, Clone, PartialEq)]
enum Held {
    Value(Vec<u8>),
    Counter(i64),
}

const SECRET: &[u8] = b"this move's secret";

#[test]
fn the_target_ends_with_what_the_source_held_when_it_stopped() {
    let source = TestServer::start(|_| {});
    let target = TestServer::start(|c| {
        c.secret = Some(SECRET.to_vec());
        c.resize_on_request_up_to = u64::MAX;
    });
    let mut model: BTreeMap<String, Held> = BTreeMap::new();
    let mut kv = or_abort(Client::connect(&source.address), "connect to the source");
    for i in 0..2000 {
        let key = format!("key-{i}");
        let value = format!("first {i}").repeat(1 + i % 7).into_bytes();
        or_abort(kv.put(&key, &value), "put");
        model.insert(key, Held::Value(value));
    }
    for i in 0..8 {
        let key = format!("counter-{i}");
        or_abort(kv.incr(&key, 100 + i), "incr");
        model.insert(key, Held::Counter(100 + i));
    }
    let outgoing = Outgoing {
        shard: 0,
        secret: SECRET.to_vec(),
        region: source.region_path(),
        grace: test_config(&source.region_path()).grace(),
    };
    let target_address = or_abort(
        kv_common::Address::parse(&target.address),
        "the target's address",
    );
    let TestServer {
        server,
        address,
        dir: _source_dir,
    } = source;

    // A writer keeps changing its own keys during the passes made while
    // the source serves; it stops (every write acknowledged) before the
    // server does.
    let (writing, stopped) = (AtomicBool::new(true), AtomicBool::new(false));
    let wrote = AtomicBool::new(false);
    let (copied, written) = std::thread::scope(|s| {
        let writer = s.spawn(|| write_until_told(&address, &writing, &wrote, &stopped));
        // Its keys exist before the first pass reads the region.
        while !wrote.load(Ordering::SeqCst) {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let copied = shard_move::send(&outgoing, &target_address, &|| true, || {
            // Between the passes: the source still serves, and these
            // changes reach the target only through the second pass.
            writing.store(false, Ordering::SeqCst);
            while !stopped.load(Ordering::SeqCst) {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            change_between_passes(&mut kv, &mut model);
            or_abort(kv.close(), "close");
            server.shutdown();
        });
        let written = or_abort(
            writer.join().map_err(|_| "the writer panicked"),
            "the writer",
        );
        (copied, written)
    });
    let copied = or_abort(copied, "the copy");
    model.extend(written);

    // 2000 + 8 keys before the writer began; it added its 50.
    assert_eq!(copied.at_stop, 2058, "keys copied while the source served");
    // 10 deletes, 10 updates, 10 kinds changed, 10 inserts, 8 counters,
    // and the writer's keys changed after the last pass before read them.
    assert!(
        (48..=98).contains(&copied.changed),
        "the second pass sent {} changes",
        copied.changed
    );
    check_target(&target.address, &model);
}

/// Changes made between the passes: every kind of change a key can take.
fn change_between_passes(kv: &mut Client, model: &mut BTreeMap<String, Held>) {
    for i in 0..40 {
        let key = format!("key-{i}");
        match i % 4 {
            0 => {
                or_abort(kv.delete(&key), "delete");
                model.remove(&key);
            }
            1 => {
                let value = format!("second {i}").into_bytes();
                or_abort(kv.put(&key, &value), "update");
                model.insert(key, Held::Value(value));
            }
            2 => {
                or_abort(kv.delete(&key), "delete before a counter");
                or_abort(kv.incr(&key, -7), "a counter where a value was");
                model.insert(key, Held::Counter(-7));
            }
            _ => {
                let key = format!("new-{i}");
                or_abort(kv.put(&key, b"born between the passes"), "insert");
                model.insert(key, Held::Value(b"born between the passes".to_vec()));
            }
        }
    }
    for i in 0..8 {
        let key = format!("counter-{i}");
        if i % 2 == 0 {
            or_abort(kv.incr(&key, 5), "incr");
            model.insert(key, Held::Counter(105 + i));
        } else {
            or_abort(kv.put(&key, b"a value where a counter was"), "put");
            model.insert(key, Held::Value(b"a value where a counter was".to_vec()));
        }
    }
}

/// Puts keys of its own until `writing` goes false (three rounds at
/// least), setting `wrote` after the first round and `stopped` at the
/// end; what it wrote last.
fn write_until_told(
    address: &str,
    writing: &AtomicBool,
    wrote: &AtomicBool,
    stopped: &AtomicBool,
) -> BTreeMap<String, Held> {
    let mut kv = or_abort(Client::connect(address), "the writer connects");
    let mut last = BTreeMap::new();
    let mut round = 0u64;
    while writing.load(Ordering::SeqCst) || round < 3 {
        for i in 0..50 {
            let key = format!("live-{i}");
            let value = format!("round {round} of {i}").into_bytes();
            or_abort(kv.put(&key, &value), "the writer's put");
            last.insert(key, Held::Value(value));
        }
        wrote.store(true, Ordering::SeqCst);
        round += 1;
    }
    stopped.store(true, Ordering::SeqCst);
    last
}

/// The target holds exactly `model`, and none of the keys deleted between
/// the passes.
fn check_target(address: &str, model: &BTreeMap<String, Held>) {
    let options = ClientOptions::default().with_secret(SECRET.to_vec());
    let mut moved = or_abort(
        Client::connect_with(address, options),
        "connect to the target",
    );
    for (key, held) in model {
        let found = match held {
            Held::Value(_) => or_abort(moved.get(key), "get").map(Held::Value),
            Held::Counter(_) => or_abort(moved.get_counter(key), "get_counter").map(Held::Counter),
        };
        assert_eq!(found.as_ref(), Some(held), "key {key} at the target");
    }
    for i in (0..40).step_by(4) {
        let key = format!("key-{i}");
        assert_eq!(
            or_abort(moved.get(&key), "get"),
            None,
            "{key}, deleted between the passes, is at the target"
        );
    }
}

#[test]
fn a_move_called_off_leaves_the_source_serving() {
    let source = TestServer::start(|_| {});
    let target = TestServer::start(|c| c.secret = Some(SECRET.to_vec()));
    let mut kv = or_abort(Client::connect(&source.address), "connect");
    or_abort(kv.put(b"stays", b"here"), "put");
    let outgoing = Outgoing {
        shard: 0,
        secret: SECRET.to_vec(),
        region: source.region_path(),
        grace: test_config(&source.region_path()).grace(),
    };
    let to = or_abort(kv_common::Address::parse(&target.address), "address");
    let stopped = AtomicBool::new(false);
    let copied = shard_move::send(&outgoing, &to, &|| false, || {
        stopped.store(true, Ordering::SeqCst);
    });
    assert!(copied.is_err(), "a move called off reports it");
    assert!(!stopped.load(Ordering::SeqCst), "the source was stopped");
    assert_eq!(
        or_abort(kv.get(b"stays"), "get").as_deref(),
        Some(&b"here"[..])
    );
}
