//! A shard move's copy (`kv_server::shard_move::send`): the first pass runs
//! while the source still serves the shard and its clients write, and the
//! target ends with exactly what the source held when it stopped — values
//! changed, deleted, turned into counters and back between the passes
//! included — while the last pass sends only what changed. During the
//! last pass the shard's index is frozen: reads and increments go on,
//! puts wait (and fail once the source stops).

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

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
    let mut kv = or_abort(Client::connect(&source.address), "connect to the source");
    let model = fill(&mut kv);
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
    // index freezes.
    let (writing, stopped) = (AtomicBool::new(true), AtomicBool::new(false));
    let wrote = AtomicBool::new(false);
    let server = RefCell::new(Some(server));
    let (kv, model) = (RefCell::new(kv), RefCell::new(model));
    let frozen_put = RefCell::new(None);
    let (copied, written, late) = std::thread::scope(|s| {
        let writer = s.spawn(|| write_until_told(&address, &writing, &wrote, &stopped));
        // Its keys exist before the first pass reads the region.
        wait_for(&wrote);
        let mut source = Frozen {
            writing: &writing,
            stopped: &stopped,
            kv: &kv,
            model: &model,
            server: &server,
            address: &address,
            late_put: &frozen_put,
        };
        let copied = shard_move::send(&outgoing, &target_address, &mut source);
        let written = or_abort(
            writer.join().map_err(|_| "the writer panicked"),
            "the writer",
        );
        let late = frozen_put.borrow_mut().take().map(|t| t.join());
        (copied, written, late)
    });
    let copied = or_abort(copied, "the copy");
    let mut model = model.into_inner();
    model.extend(written);
    let late = late
        .and_then(Result::ok)
        .ok_or("no late put, or it panicked");
    assert!(
        or_abort(late, "the late put").is_err(),
        "a put against the frozen index succeeded"
    );

    // 2000 + 8 keys before the writer began; it added its 50.
    assert_eq!(
        copied.at_freeze, 2058,
        "keys copied while the source served"
    );
    // 10 deletes, 10 updates, 10 kinds changed, 10 inserts, 8 counters,
    // and the writer's keys changed after the last pass before read them.
    assert!(
        (48..=98).contains(&copied.changed),
        "the last pass sent {} changes",
        copied.changed
    );
    check_target(&target.address, &model);
}

/// The source of the first test's move: what happens when it freezes and
/// when it stops.
struct Frozen<'a> {
    writing: &'a AtomicBool,
    stopped: &'a AtomicBool,
    kv: &'a RefCell<Client>,
    model: &'a RefCell<BTreeMap<String, Held>>,
    server: &'a RefCell<Option<kv_server::Server>>,
    address: &'a str,
    late_put: &'a RefCell<Option<std::thread::JoinHandle<kv_client::Result<()>>>>,
}

impl shard_move::Source for Frozen<'_> {
    fn go_on(&self) -> bool {
        true
    }

    fn freeze(&mut self) -> Result<(), String> {
        // Between the passes: the source still serves, and these changes
        // reach the target only through the last pass.
        self.writing.store(false, Ordering::SeqCst);
        wait_for(self.stopped);
        let (mut kv, mut model) = (self.kv.borrow_mut(), self.model.borrow_mut());
        change_between_passes(&mut kv, &mut model);
        let server = self.server.borrow();
        let frozen = server
            .as_ref()
            .map(|s| s.hand_over().wait(Duration::from_secs(60)));
        frozen.unwrap_or(Err("no server".into()))?;
        // Frozen: reads go on (values and counters), a put waits.
        for (key, held) in model.iter().step_by(97) {
            assert_eq!(read(&mut kv, key, held).as_ref(), Some(held), "{key}");
        }
        let address = self.address.to_string();
        *self.late_put.borrow_mut() = Some(std::thread::spawn(move || {
            // The Soft-RoCE VM once left this connect unanswered for more
            // than the default 10 s: it waits longer, and a connect that
            // fails in the end is a put that did not land either.
            let options = ClientOptions::default().with_reply_timeout(Duration::from_secs(120));
            Client::connect_with(&address, options)
                .and_then(|mut late| late.put("key-1", "put while frozen"))
        }));
        Ok(())
    }

    fn stop_serving(&mut self) {
        let waiting = self.late_put.borrow();
        let finished = waiting.as_ref().is_some_and(|t| t.is_finished());
        assert!(!finished, "a put finished while the index was frozen");
        // After the values' step, before the stop: an increment lands in
        // place, and only the counters' step sees it.
        or_abort(self.kv.borrow_mut().incr("counter-0", 1000), "incr");
        let mut model = self.model.borrow_mut();
        model.insert("counter-0".into(), Held::Counter(1105));
        if let Some(server) = self.server.borrow_mut().take() {
            server.shutdown();
        }
    }
}

fn wait_for(flag: &AtomicBool) {
    while !flag.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Puts 2000 values and 8 counters; what the source then holds.
fn fill(kv: &mut Client) -> BTreeMap<String, Held> {
    let mut model = BTreeMap::new();
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
    model
}

/// What `kv` holds for `key`, read as `like` is (a value or a counter).
fn read(kv: &mut Client, key: &str, like: &Held) -> Option<Held> {
    match like {
        Held::Value(_) => or_abort(kv.get(key), "get").map(Held::Value),
        Held::Counter(_) => or_abort(kv.get_counter(key), "get_counter").map(Held::Counter),
    }
}

/// A source whose map no longer shows the move: it notes what it is
/// asked to do.
#[derive(Default)]
struct CalledOff {
    frozen: bool,
    stopped: bool,
}

impl shard_move::Source for CalledOff {
    fn go_on(&self) -> bool {
        false
    }
    fn freeze(&mut self) -> Result<(), String> {
        self.frozen = true;
        Ok(())
    }
    fn stop_serving(&mut self) {
        self.stopped = true;
    }
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
        let found = read(&mut moved, key, held);
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
    let mut source = CalledOff::default();
    let copied = shard_move::send(&outgoing, &to, &mut source);
    assert!(copied.is_err(), "a move called off reports it");
    assert!(!source.frozen, "the source was frozen");
    assert!(!source.stopped, "the source was stopped");
    assert_eq!(
        or_abort(kv.get(b"stays"), "get").as_deref(),
        Some(&b"here"[..])
    );
}

/// A server at the target's address that admits the copier without
/// knowing the move (it asks no secret) and holds keys is an old copy
/// served there, not the fresh region a move makes: nothing is sent into
/// it, and the source goes on serving.
#[test]
fn a_target_that_holds_keys_is_not_sent_into() {
    let source = TestServer::start(|_| {});
    let stale = TestServer::start(|_| {});
    let mut kv = or_abort(Client::connect(&source.address), "connect");
    or_abort(kv.put(b"stays", b"here"), "put");
    let mut old = or_abort(Client::connect(&stale.address), "connect to the old copy");
    or_abort(old.put(b"old", b"copy"), "put");
    let outgoing = Outgoing {
        shard: 0,
        secret: SECRET.to_vec(),
        region: source.region_path(),
        grace: test_config(&source.region_path()).grace(),
    };
    let to = or_abort(kv_common::Address::parse(&stale.address), "address");
    let mut moving = CalledOff::default();
    let copied = shard_move::send(&outgoing, &to, &mut moving);
    let why = copied.err().unwrap_or_default();
    assert!(why.contains("already holds keys (1)"), "{why}");
    assert!(!moving.frozen && !moving.stopped);
    assert_eq!(or_abort(old.get(b"stays"), "get"), None, "sent into it");
    assert_eq!(
        or_abort(old.get(b"old"), "get").as_deref(),
        Some(&b"copy"[..])
    );
}

/// A copy whose target does not serve yet waits for it only while the
/// move stands: called off (its target left, say), it gives up at once,
/// not after the wait for a target (30 s), so that the member that comes
/// back is sent a new copy.
#[test]
fn a_copy_waiting_for_its_target_gives_up_once_called_off() {
    let source = TestServer::start(|_| {});
    let dir = onekv_tests::region_dir();
    let nobody = format!("shm://{}", dir.path().join("gone").display());
    let outgoing = Outgoing {
        shard: 0,
        secret: SECRET.to_vec(),
        region: source.region_path(),
        grace: test_config(&source.region_path()).grace(),
    };
    let to = or_abort(kv_common::Address::parse(&nobody), "address");
    let mut moving = CalledOff::default();
    let why = shard_move::send(&outgoing, &to, &mut moving)
        .err()
        .unwrap_or_default();
    assert!(why.contains("called off"), "{why}");
    assert!(!moving.frozen && !moving.stopped);
}
