//! Counters: FETCH-AND-ADD and CAS in place. Concurrent increments from many
//! clients all count; with deletes, compare-and-sets and PUTs of the same
//! keys mixed in, every history is linearizable; a late atomic never lands
//! on reused space; a writer killed while it holds a counter's seal loses
//! nothing; values stay within their range; and GET, PUT and DELETE of a
//! counter key do what the API says.

use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Barrier, Mutex};
use std::time::{Duration, Instant};

use kv_client::{Client, ClientOptions, Error, COUNTER_MAX};
use kv_common::Address;
use kv_server::{Server, ServerConfig};
use onekv_tests::{
    aggressive_reuse, or_abort, parse_tagged, tagged_value, workspace_bin, xorshift, TestServer,
};
use stateright::semantics::{ConsistencyTester, LinearizabilityTester, SequentialSpec};

/// An operation deadline of `shm_ms` on shm; over emulated rdma (the
/// Soft-RoCE VM), where a round trip takes a good part of a millisecond,
/// ten times that.
fn deadline(shm_ms: u64) -> Duration {
    match onekv_tests::rdma_host() {
        Some(_) => Duration::from_millis(shm_ms * 10),
        None => Duration::from_millis(shm_ms),
    }
}

fn hinted(address: &str, entries: usize) -> Client {
    let options = ClientOptions::default().with_slot_cache_entries(entries);
    or_abort(Client::connect_with(address, options), "connect")
}

#[test]
fn concurrent_increments_all_count() {
    let srv = TestServer::start(|c| c.op_deadline = deadline(10));
    const THREADS: usize = 4;
    const INCRS: usize = 400;
    let returned = Mutex::new(Vec::new());
    let sum = AtomicI64::new(0);
    let barrier = Barrier::new(THREADS);
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (returned, sum, barrier, address) = (&returned, &sum, &barrier, &srv.address);
            s.spawn(move || {
                // Half the clients go through hints (one round trip), half
                // read the buckets every time.
                let mut kv = hinted(address, if t % 2 == 0 { 1024 } else { 0 });
                barrier.wait();
                let mut mine = Vec::new();
                for i in 0..INCRS {
                    // All start at once: the first increments race to
                    // create the counter.
                    mine.push(or_abort(kv.incr(b"hits", 1), "incr"));
                    let delta = (i % 7) as i64 + 2;
                    or_abort(kv.incr(b"weighted", delta), "incr");
                    sum.fetch_add(delta, Ordering::SeqCst);
                }
                returned.lock().unwrap().extend(mine);
            });
        }
    });
    let mut kv = Client::connect(&srv.address).unwrap();
    let n = (THREADS * INCRS) as i64;
    assert_eq!(kv.get_counter(b"hits").unwrap(), Some(n));
    assert_eq!(
        kv.get_counter(b"weighted").unwrap(),
        Some(sum.load(Ordering::SeqCst))
    );
    // Each increment by one saw a value no other did: exactly 1..=n.
    let mut returned = returned.into_inner().unwrap();
    returned.sort_unstable();
    assert_eq!(returned, (1..=n).collect::<Vec<_>>());
}

/// A key's value, as the API defines it: absent, a counter, or bytes a
/// PUT stored (counter calls on those fail with `NotACounter`).
#[derive(Clone, Debug, Default, PartialEq)]
enum Counter {
    #[default]
    Absent,
    Value(i64),
    Bytes,
}

#[derive(Clone, Debug)]
enum Op {
    Incr(i64),
    Get,
    Swap(i64, i64),
    Delete,
    Put,
}

/// `Err(())`: the call failed with `NotACounter`.
#[derive(Clone, Debug, PartialEq)]
enum Ret {
    Incr(Result<i64, ()>),
    Get(Result<Option<i64>, ()>),
    Swap(Result<Option<i64>, ()>),
    Delete(bool),
    Put,
}

impl Counter {
    fn value(&self) -> Result<Option<i64>, ()> {
        match *self {
            Counter::Absent => Ok(None),
            Counter::Value(v) => Ok(Some(v)),
            Counter::Bytes => Err(()),
        }
    }
}

impl SequentialSpec for Counter {
    type Op = Op;
    type Ret = Ret;
    fn invoke(&mut self, op: &Op) -> Ret {
        match *op {
            Op::Incr(d) => Ret::Incr(self.value().map(|v| {
                let v = v.unwrap_or(0) + d;
                *self = Counter::Value(v);
                v
            })),
            Op::Get => Ret::Get(self.value()),
            Op::Swap(expect, new) => Ret::Swap(self.value().inspect(|&old| {
                if old == Some(expect) {
                    *self = Counter::Value(new);
                }
            })),
            Op::Delete => Ret::Delete(std::mem::take(self) != Counter::Absent),
            Op::Put => {
                *self = Counter::Bytes;
                Ret::Put
            }
        }
    }
}

/// A counter call's result, with `NotACounter` as `Err(())`.
fn counted<T>(result: Result<T, Error>, what: &str) -> Result<T, ()> {
    match result {
        Err(Error::NotACounter) => Err(()),
        other => Ok(or_abort(other, what)),
    }
}

enum Event {
    Invoke(usize, usize, Op),
    Return(usize, usize, Ret),
}

#[test]
#[allow(clippy::too_many_lines)] // one scenario, read top to bottom
fn counter_histories_with_deletes_and_puts_are_linearizable_under_aggressive_reuse() {
    const THREADS: usize = 4;
    const KEYS: usize = 2;
    const OPS: usize = 5;
    // A short deadline (a new counter settles three of these after its
    // insert) and a small region whose freed space is reused at once.
    let srv = TestServer::start(|c| {
        aggressive_reuse(c);
        c.op_deadline = deadline(3);
        c.memory = 4 << 20;
        c.max_memory = Some(4 << 20);
        c.buckets = Some(8);
    });
    let rounds = if onekv_tests::rdma_host().is_some() {
        30
    } else {
        80
    };
    let name = |k: usize| format!("ctr-{k}");
    let log = Mutex::new(Vec::new());
    let barrier = Barrier::new(THREADS);
    let starts = Mutex::new(vec![[Counter::Absent, Counter::Absent]]);
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (log, barrier, starts, address) = (&log, &barrier, &starts, &srv.address);
            s.spawn(move || {
                let options = ClientOptions::default()
                    .with_slot_cache_entries(if t % 2 == 0 { 1024 } else { 0 })
                    // One client at times stalls between reading the index
                    // and acting on it for longer than the grace period.
                    .with_pause_after_index_read((t == 1).then_some(deadline(20)));
                let mut kv = or_abort(Client::connect_with(address, options), "connect");
                let mut rng = 0x9e37_79b9_7f4a_7c15u64.wrapping_mul(t as u64 + 1);
                for _ in 0..rounds {
                    barrier.wait();
                    for _ in 0..OPS {
                        xorshift(&mut rng);
                        let k = (rng % KEYS as u64) as usize;
                        let key = name(k);
                        let op = match (rng >> 8) % 20 {
                            0..=10 => Op::Incr((rng >> 16) as i64 % 5 + 1),
                            11..=14 => Op::Get,
                            15 | 16 => Op::Swap((rng >> 16) as i64 % 8, (rng >> 24) as i64 % 100),
                            17 | 18 => Op::Delete,
                            _ => Op::Put,
                        };
                        log.lock().unwrap().push(Event::Invoke(k, t, op.clone()));
                        let ret = match op {
                            Op::Incr(d) => Ret::Incr(counted(kv.incr(key.as_bytes(), d), "incr")),
                            Op::Get => Ret::Get(counted(kv.get_counter(key.as_bytes()), "get")),
                            Op::Swap(e, n) => Ret::Swap(counted(
                                kv.compare_and_set(key.as_bytes(), e, n),
                                "compare_and_set",
                            )),
                            Op::Delete => {
                                Ret::Delete(or_abort(kv.delete(key.as_bytes()), "delete"))
                            }
                            Op::Put => {
                                or_abort(kv.put(key.as_bytes(), b"bytes"), "put");
                                Ret::Put
                            }
                        };
                        log.lock().unwrap().push(Event::Return(k, t, ret));
                    }
                    // Churn plain values through the heap meanwhile, so
                    // freed counter blocks are reused for other data.
                    for n in 0..4 {
                        let churn = format!("churn-{t}-{n}");
                        let v = tagged_value(&churn, "churn", n, 700);
                        or_abort(kv.put(churn.as_bytes(), &v), "put");
                    }
                    barrier.wait();
                    if t == 0 {
                        let mut at = [Counter::Absent, Counter::Absent];
                        for (k, v) in at.iter_mut().enumerate() {
                            *v = match counted(kv.get_counter(name(k).as_bytes()), "get") {
                                Ok(Some(n)) => Counter::Value(n),
                                Ok(None) => Counter::Absent,
                                Err(()) => Counter::Bytes,
                            };
                        }
                        starts.lock().unwrap().push(at);
                        log.lock()
                            .unwrap()
                            .push(Event::Invoke(usize::MAX, 0, Op::Get));
                    }
                }
            });
        }
    });
    // Split the log into rounds (marked by thread 0's read of every key)
    // and check each key's history in each round from the value the round
    // started with.
    let starts = starts.into_inner().unwrap();
    let mut round = 0;
    let mut testers: Vec<LinearizabilityTester<usize, Counter>> = (0..KEYS)
        .map(|k| LinearizabilityTester::new(starts[0][k].clone()))
        .collect();
    let mut checked = 0;
    for event in log.into_inner().unwrap() {
        match event {
            Event::Invoke(usize::MAX, ..) => {
                for (k, tester) in testers.iter().enumerate() {
                    assert!(
                        tester.is_consistent(),
                        "round {round}, key {k}: not linearizable: {tester:?}"
                    );
                    checked += tester.len();
                }
                round += 1;
                testers = (0..KEYS)
                    .map(|k| LinearizabilityTester::new(starts[round][k].clone()))
                    .collect();
            }
            Event::Invoke(k, t, op) => {
                testers[k].on_invoke(t, op).unwrap();
            }
            Event::Return(k, t, ret) => {
                testers[k].on_return(t, ret).unwrap();
            }
        }
    }
    assert_eq!(round, rounds);
    assert!(
        checked >= rounds * THREADS * OPS,
        "{checked} operations checked"
    );
    // The churned values are intact: no late atomic landed on them.
    let mut kv = Client::connect(&srv.address).unwrap();
    for t in 0..THREADS {
        for n in 0..4 {
            let churn = format!("churn-{t}-{n}");
            let v = kv.get(churn.as_bytes()).unwrap().unwrap();
            assert_eq!(parse_tagged(&v).map(|p| p.0), Some(churn));
        }
    }
}

/// A FETCH-AND-ADD must never land on space that was reused since the
/// client last saw the counter: neither after a stall between reading its
/// slot and posting the atomic, nor through a remembered slot whose counter
/// was deleted and whose space was rewritten. Here the counter is deleted
/// and its space rewritten with other values all the while, and the
/// incrementing client stalls for up to twice the grace period.
#[test]
fn a_late_increment_never_lands_on_reused_space() {
    let srv = TestServer::start(|c| {
        aggressive_reuse(c);
        c.op_deadline = deadline(2);
        c.memory = 1 << 20;
        c.max_memory = Some(1 << 20);
        c.buckets = Some(8);
    });
    let done = AtomicBool::new(false);
    std::thread::scope(|s| {
        let (done, address) = (&done, &srv.address);
        s.spawn(move || {
            let options = ClientOptions::default()
                .with_slot_cache_entries(64)
                .with_pause_after_index_read(deadline(12));
            let mut kv = or_abort(Client::connect_with(address, options), "connect");
            for i in 0..200u64 {
                // Eight counters in turn: each one's remembered slot is old
                // by the time it comes round again.
                let key = format!("late-{}", i % 8);
                or_abort(kv.incr(key.as_bytes(), 1_000_000_007), "incr");
                std::thread::sleep(deadline(2) * (i % 5) as u32 * 2);
                // Space of its own, used up fast: its chunks go back to the
                // server, dead counters in them with it.
                for n in 0..4 {
                    let key = format!("mine-{n}");
                    let v = tagged_value(&key, "i", i, 1000);
                    or_abort(kv.put(key.as_bytes(), &v), "put");
                }
            }
            done.store(true, Ordering::SeqCst);
        });
        let mut kv = or_abort(Client::connect(address), "connect");
        let mut round = 0u64;
        while !done.load(Ordering::SeqCst) {
            kv.delete(format!("late-{}", round % 8).as_bytes()).unwrap();
            for n in 0..6u64 {
                let key = format!("p{n}");
                let v = tagged_value(&key, "w", round * 10 + n, 1000);
                kv.put(key.as_bytes(), &v).unwrap();
            }
            for n in 0..6u64 {
                let key = format!("p{n}");
                let v = kv.get(key.as_bytes()).unwrap().unwrap();
                assert_eq!(
                    parse_tagged(&v),
                    Some((key, "w".to_string(), round * 10 + n)),
                    "round {round}"
                );
            }
            round += 1;
        }
    });
}

/// An increment whose batch the server turns away whole (the client's key
/// revoked, as a server that restarts its region does) ran nothing: the
/// client connects again and applies it once, where it used to end with
/// an unknown outcome. Over shm, where every batch checks its key first
/// and a key can be revoked under a live server (over rdma the device
/// refuses the first work request of such a batch the same way).
#[test]
fn an_increment_turned_away_whole_is_applied_once_on_a_new_connection() {
    let dir = onekv_tests::region_dir();
    let region = dir.path().join("region");
    let mut config = ServerConfig::new(Address::Shm {
        region: region.clone(),
    });
    config.region_file = Some(region.clone());
    config.memory = 16 << 20;
    let address = config.address.to_string();
    let _server = Server::start(config).expect("server starts");
    let mut kv = or_abort(Client::connect(&address), "connect");
    assert_eq!(kv.incr("n", 1).expect("incr"), 1);
    for round in 0..3 {
        // The keys revoked just before the atomic's batch is posted.
        let revoked = std::rc::Rc::new(std::cell::Cell::new(false));
        let (said, region) = (revoked.clone(), region.clone());
        kv_client::on_step_in_this_thread("counter-atomic", move || {
            kv_server::region::revoke_keys(&region).expect("revoke the keys");
            said.set(true);
        });
        let reconnects = kv.reconnects();
        let now = kv.incr("n", 1).expect("an increment turned away whole");
        assert!(revoked.get(), "the increment posted no atomic");
        assert_eq!(now, 2 + round);
        assert_eq!(kv.reconnects(), reconnects + 1);
    }
    assert_eq!(kv.get_counter("n").expect("get"), Some(4));
}

#[test]
fn get_put_and_delete_of_a_counter_key_do_what_the_api_says() {
    let srv = TestServer::start(|_| {});
    let mut kv = Client::connect(&srv.address).unwrap();
    assert_eq!(kv.get_counter(b"c").unwrap(), None);
    assert_eq!(kv.compare_and_set(b"c", 0, 5).unwrap(), None);
    assert_eq!(kv.incr(b"c", 5).unwrap(), 5);
    assert_eq!(kv.incr(b"c", -7).unwrap(), -2);
    assert_eq!(kv.get(b"c").unwrap().as_deref(), Some(&b"-2"[..]));
    assert_eq!(kv.compare_and_set(b"c", 3, 9).unwrap(), Some(-2));
    assert_eq!(kv.compare_and_set(b"c", -2, 9).unwrap(), Some(-2));
    assert_eq!(kv.get_counter(b"c").unwrap(), Some(9));
    // Values stay within ±2^61: an increment or a compare-and-set beyond
    // fails and changes nothing; large deltas within it are fine.
    fn overflow<T>(r: Result<T, Error>) -> bool {
        matches!(r, Err(Error::CounterOverflow(_)))
    }
    assert!(overflow(kv.incr(b"c", i64::MAX)));
    assert!(overflow(kv.incr(b"c", COUNTER_MAX - 8)));
    assert_eq!(kv.incr(b"c", COUNTER_MAX - 9).unwrap(), COUNTER_MAX);
    assert!(overflow(kv.incr(b"c", 1)));
    assert_eq!(kv.incr(b"c", -COUNTER_MAX - 1).unwrap(), -1);
    assert!(overflow(kv.compare_and_set(b"c", -1, COUNTER_MAX + 1)));
    assert!(overflow(kv.incr(b"new", i64::MIN)));
    assert_eq!(kv.get_counter(b"new").unwrap(), None);
    // No counter holds a value beyond ±2^62: nothing to swap.
    assert_eq!(kv.compare_and_set(b"c", i64::MIN, 5).unwrap(), Some(-1));
    assert_eq!(kv.compare_and_set(b"c", -1, 9).unwrap(), Some(-1));
    assert_eq!(kv.get_counter(b"c").unwrap(), Some(9));
    // PUT replaces the counter with bytes; counter calls then refuse it.
    kv.put(b"c", b"12").unwrap();
    assert!(matches!(kv.incr(b"c", 1), Err(Error::NotACounter)));
    assert!(matches!(kv.get_counter(b"c"), Err(Error::NotACounter)));
    assert!(matches!(
        kv.compare_and_set(b"c", 12, 1),
        Err(Error::NotACounter)
    ));
    // DELETE removes it; the next increment starts from 0.
    assert!(kv.delete(b"c").unwrap());
    assert_eq!(kv.incr(b"c", 1).unwrap(), 1);
    assert!(kv.delete(b"c").unwrap());
    assert_eq!(kv.get(b"c").unwrap(), None);
}

#[test]
fn a_warm_increment_takes_one_round_trip() {
    let deadline = Duration::from_millis(600);
    let srv = TestServer::start(|c| c.op_deadline = deadline);
    let mut kv = hinted(&srv.address, 64);
    let rt = |kv: &Client| kv.verb_stats().round_trips;
    kv.put(b"warm", b"up").unwrap(); // takes the first lease
                                     // The creator's hint names the settled counter.
    assert_eq!(kv.incr(b"n", 1).unwrap(), 1);
    let at = rt(&kv);
    assert_eq!(kv.incr(b"n", 1).unwrap(), 2);
    assert_eq!(
        rt(&kv) - at,
        1,
        "warm increment: FETCH-AND-ADD and slot word"
    );
    let at = rt(&kv);
    assert_eq!(kv.compare_and_set(b"n", 2, 10).unwrap(), Some(2));
    assert_eq!(kv.compare_and_set(b"n", 2, 20).unwrap(), Some(10));
    assert_eq!(rt(&kv) - at, 2, "warm compare-and-sets");
    // Another client: buckets, block, then the atomic.
    let mut other = hinted(&srv.address, 64);
    let at = rt(&other);
    assert_eq!(other.incr(b"n", 1).unwrap(), 11);
    assert_eq!(rt(&other) - at, 3, "cold increment");
    // A delta beyond 2^32 is a CAS of the value read: no blind atomic.
    let at = rt(&other);
    assert_eq!(other.incr(b"n", 1 << 40).unwrap(), 11 + (1 << 40));
    assert_eq!(rt(&other) - at, 3, "large increment");
    // A delete seals the counter before it unlinks it: the hinted client's
    // blind increment finds it sealed, is taken back, and is redone on a
    // new counter (its insert and its settling: two atomics more).
    assert!(other.delete(b"n").unwrap());
    let atomics = kv.verb_stats().atomics;
    assert_eq!(kv.incr(b"n", 1).unwrap(), 1);
    assert_eq!(
        kv.verb_stats().atomics - atomics,
        4,
        "increment, undo, insert, settle"
    );
    assert_eq!(other.get_counter(b"n").unwrap(), Some(1));
}

/// A writer killed while it holds a counter's lock (a DELETE, then a PUT,
/// by the `kv` command with the client's fault hook): after sealing it,
/// and before. Sealed, the counter is out of reach: a client with a fresh
/// hint increments it meanwhile (the `kv` run takes less than the
/// deadline), and its atomic finds the seal and is taken back. Clients wait on the lock, and after `Timing::lock_timeout` one takes
/// it over and lets it go: the counter is as it was, with that increment
/// counted once. Locked but not sealed, readers and increments go on; the
/// next writer waits out the lock.
#[test]
fn a_writer_killed_holding_a_counters_lock_loses_nothing() {
    let deadline = deadline(300);
    let srv = TestServer::start(|c| c.op_deadline = deadline);
    let mut kv = hinted(&srv.address, 64);
    let mut other = Client::connect(&srv.address).unwrap();
    let rounds = [
        ("counter-sealed", &["del", "c"][..]),
        ("counter-sealed", &["put", "c", "bytes"]),
        ("counter-locked", &["put", "c", "bytes"]),
    ];
    for (fault, command) in rounds {
        assert_eq!(kv.incr(b"c", 41).unwrap(), 41);
        let out = Command::new(workspace_bin("kv"))
            .arg("--server")
            .arg(&srv.address)
            .args(command)
            .env("ONEKV_CLIENT_FAULT", fault)
            .output()
            .expect("run kv");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && stderr.contains("ONEKV_CLIENT_FAULT"),
            "{command:?}: {:?} {stderr}",
            out.status
        );
        let killed_at = Instant::now();
        assert_eq!(kv.incr(b"c", 1).unwrap(), 42, "{fault} {command:?}");
        if fault == "counter-sealed" {
            // Nobody could act on the counter until the lock was let go
            // (`Timing::lock_timeout`: two settle periods, two deadlines).
            assert!(killed_at.elapsed() >= deadline * 8, "{command:?}");
        }
        assert_eq!(other.get_counter(b"c").unwrap(), Some(42));
        assert!(other.delete(b"c").unwrap());
        assert_eq!(kv.get_counter(b"c").unwrap(), None);
    }
}

/// A new counter and a PUT of the same key racing to insert it: whichever
/// goes first, the PUT's value is what stays (an increment after it fails,
/// one before it is overwritten). A pending counter's copy must never win
/// over the PUT's, nor settle under it.
#[test]
fn a_put_racing_a_new_counter_is_never_lost() {
    // A tiny index whose buckets other keys keep filling and emptying, so
    // that the two inserts see different free slots and can both land.
    let srv = TestServer::start(|c| {
        c.op_deadline = deadline(3);
        c.buckets = Some(8);
    });
    let barrier = Barrier::new(2);
    let done = AtomicBool::new(false);
    let rounds = if onekv_tests::rdma_host().is_some() {
        40
    } else {
        300
    };
    std::thread::scope(|s| {
        let (barrier, done, address) = (&barrier, &done, &srv.address);
        s.spawn(move || {
            let mut kv = or_abort(Client::connect(address), "connect");
            let mut n = 0u64;
            while !done.load(Ordering::SeqCst) {
                let key = format!("other-{}", n % 40);
                match n % 3 {
                    2 => or_abort(kv.delete(key.as_bytes()), "delete"),
                    _ => or_abort(kv.put(key.as_bytes(), b"x").map(|_| true), "put"),
                };
                n += 1;
            }
        });
        s.spawn(move || {
            let mut kv = hinted(address, 64);
            for r in 0..rounds {
                barrier.wait();
                let key = format!("race-{r}");
                let _ = counted(kv.incr(key.as_bytes(), 1), "incr");
                barrier.wait();
                // The PUT's value stays: no later increment (a hinted one
                // least of all) may land on a counter it replaced.
                if let Ok(n) = counted(kv.incr(key.as_bytes(), 1), "incr") {
                    or_abort(
                        Err(format!("round {r}: an increment after the PUT gave {n}")),
                        "incr",
                    )
                }
            }
        });
        let mut kv = or_abort(Client::connect(address), "connect");
        for r in 0..rounds {
            barrier.wait();
            let key = format!("race-{r}");
            or_abort(kv.put(key.as_bytes(), b"bytes"), "put");
            barrier.wait();
            let got = or_abort(kv.get(key.as_bytes()), "get");
            if got.as_deref() != Some(&b"bytes"[..]) {
                or_abort(
                    Err(format!(
                        "round {r}: {got:?} after the PUT and the increment returned"
                    )),
                    "get",
                )
            }
        }
        done.store(true, Ordering::SeqCst);
    });
}

#[test]
fn restored_counters_count_at_once_and_replace_what_their_keys_held() {
    let srv = TestServer::start(|_| {});
    let mut kv = or_abort(Client::connect(&srv.address), "connect");
    or_abort(kv.put(b"was-a-value", b"plain"), "put");
    or_abort(kv.incr(b"was-a-counter", 5), "incr");
    let mut counters: Vec<(String, i64)> = (0..30)
        .map(|i| (format!("restored-{i}"), i * 1000 - 7))
        .collect();
    counters.push(("was-a-value".into(), 11));
    counters.push(("was-a-counter".into(), -12));
    let before = kv.verb_stats().round_trips;
    or_abort(kv.restore_counters(&counters), "restore_counters");
    // One batch for 31 keys (blocks and windows, copies, CASes and the
    // duplicate checks: a value is replaced there); the counter that
    // exists takes the single path. A counter created by incr would wait
    // its settle period, one by one.
    let taken = kv.verb_stats().round_trips - before;
    assert!(taken <= 12, "{taken} round trips for 32 counters");
    for (key, value) in &counters {
        assert_eq!(
            or_abort(kv.get_counter(key), "get_counter"),
            Some(*value),
            "{key}"
        );
    }
    // They count from now on, for this client and any other.
    let mut other = or_abort(Client::connect(&srv.address), "connect");
    assert_eq!(or_abort(other.incr(b"restored-3", 1), "incr"), 2994);
    assert_eq!(or_abort(kv.incr(b"restored-3", 1), "incr"), 2995);
    assert!(matches!(
        kv.restore_counters(&[("too-large", COUNTER_MAX)]),
        Ok(())
    ));
    assert!(matches!(
        kv.restore_counters(&[("too-large", i64::MAX)]),
        Err(Error::CounterOverflow(_))
    ));
}
