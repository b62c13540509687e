//! Many clients hammer a few keys with PUT, GET and DELETE while freed blocks
//! are recycled within milliseconds (and, in the second test, while the index
//! is resized again and again). Every history is checked with stateright's
//! LinearizabilityTester, one register per key.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Barrier, Mutex};

use std::time::Duration;

use kv_client::{Client, ClientOptions, ReadOrder};
use kv_common::protocol::ServerStats;
use onekv_tests::histories::{check_owner, check_rounds, end_round, Event};
use onekv_tests::{
    aggressive_reuse, or_abort, parse_tagged, tagged_value, wait_or_abort, xorshift, TestServer,
};
use stateright::semantics::register::{RegisterOp, RegisterRet};

const THREADS: usize = 4;
const KEYS: usize = 6;
const OPS_PER_ROUND: usize = 6;
const ROUNDS: usize = 400;
/// Freed blocks are reused within milliseconds.
const REUSE_DEADLINE: Duration = Duration::from_millis(2);
/// Longest any worker waits for the others: past it they are stuck, and
/// the test fails rather than hangs.
const WAIT_LIMIT: Duration = Duration::from_secs(600);

fn key(k: usize) -> String {
    format!("lin-{k}")
}

/// How one run of `check_histories` differs from the plain one.
struct Workload<'a> {
    /// Rounds at whose start the index is resized.
    resize_at: &'a [usize],
    /// The order in which clients' transports execute a batch's READs.
    read_order: ReadOrder,
    /// The server's operation deadline; freed space is reused four of these
    /// later.
    deadline: Duration,
    /// Each key is written by one client only (all clients read every key),
    /// so that writers' hints settle and their updates and deletes go blind.
    owned_writes: bool,
}

impl Default for Workload<'_> {
    fn default() -> Self {
        Workload {
            resize_at: &[],
            read_order: ReadOrder::Posted,
            deadline: REUSE_DEADLINE,
            owned_writes: false,
        }
    }
}

#[test]
fn histories_are_linearizable_under_aggressive_reuse() {
    check_histories(Workload::default());
}

#[test]
fn histories_stay_linearizable_when_the_reads_of_a_batch_run_backwards() {
    // A NIC may read host memory for the READs of one batch in any order:
    // here every client's hinted block is read before the buckets that
    // vouch for it, with a pause between them.
    // (Over rdma the READs are posted last to first in one doorbell: with a
    // pause, each verb would be a round trip of its own.)
    let pause = match onekv_tests::rdma_host() {
        Some(_) => Duration::ZERO,
        None => Duration::from_micros(100),
    };
    // Writers' hints settle (no other writer, and a deadline long enough for
    // a hint to stay fresh between a thread's visits to its keys), so their
    // updates and deletes go blind: one batch, no read, while other clients
    // read the key: a hundred or more of each per run on shm (a loaded
    // machine lets more hints age past use; at least 20 are asserted).
    let run = check_histories(Workload {
        read_order: ReadOrder::Reversed { pause },
        deadline: Duration::from_millis(20),
        owned_writes: true,
        ..Workload::default()
    });
    if onekv_tests::rdma_host().is_none() {
        assert!(
            run.blind_puts >= 20 && run.blind_deletes >= 20,
            "too few blind writes: {} puts, {} deletes",
            run.blind_puts,
            run.blind_deletes
        );
    }
}

/// A hint older than the grace period may name a block that was freed and
/// rewritten since, for the same key at the same slot: the slot then holds
/// the hinted value again. A reader whose READ of that block reaches memory
/// before its READ of the buckets would take the block's old contents for
/// the current value; only the hint's age tells. Here the reader's READs
/// run last to first with pauses, and a writer recycles a heap of about a
/// dozen blocks, so the same slot value comes back every few milliseconds.
#[test]
fn a_reader_whose_reads_run_backwards_never_returns_an_overwritten_value() {
    // Over emulated rdma (the Soft-RoCE VM), where a round trip takes a
    // good part of a millisecond: a longer deadline, fewer reads.
    let (deadline, reads) = match onekv_tests::rdma_host() {
        Some(_) => (Duration::from_millis(40), 60),
        None => (Duration::from_millis(8), 300),
    };
    let srv = TestServer::start(|c| {
        c.op_deadline = deadline;
        c.memory = 1 << 20;
        c.max_memory = Some(1 << 20);
        c.buckets = Some(8);
    });
    let acked = AtomicU64::new(0);
    let stop = AtomicBool::new(false);
    let name = "recycled";
    std::thread::scope(|s| {
        let (acked, stop, address) = (&acked, &stop, &srv.address);
        s.spawn(move || {
            let mut kv = or_abort(Client::connect(address), "connect");
            let pad = kv.max_value() - 64;
            let mut seq = 1;
            while !stop.load(Ordering::SeqCst) {
                let value = tagged_value(name, "w", seq, pad);
                or_abort(kv.put(name.as_bytes(), &value), "put");
                acked.store(seq, Ordering::SeqCst);
                seq += 1;
            }
        });
        let options = ClientOptions::default()
            .with_slot_cache_entries(16)
            .with_read_order(ReadOrder::Reversed {
                pause: deadline / 4,
            });
        let mut kv = or_abort(Client::connect_with(address, options), "connect");
        wait_or_abort("the first write", WAIT_LIMIT, || {
            acked.load(Ordering::SeqCst) > 0
        });
        for i in 0..reads {
            let floor = acked.load(Ordering::SeqCst);
            let value = or_abort(kv.get(name.as_bytes()), "get");
            let seq = value
                .as_deref()
                .and_then(parse_tagged)
                .map(|(_, _, seq)| seq);
            if seq.is_none_or(|seq| seq < floor) {
                stop.store(true, Ordering::SeqCst);
                panic!("read {seq:?} after write {floor} was acknowledged");
            }
            // Every other read comes after the hint has aged past its use,
            // when its block may have come round again.
            let idle = match i % 2 {
                0 => deadline * (4 + i % 9),
                _ => deadline / 8,
            };
            std::thread::sleep(idle);
        }
        stop.store(true, Ordering::SeqCst);
    });
    let stats = srv.server.stats();
    assert!(
        stats.index_scans > 1 || stats.freed_on_report > 0,
        "no space was reclaimed: {stats:?}"
    );
}

/// A batch reader that stalls between reading the windows and reading the
/// blocks, for longer than the grace period, while two keys' blocks are
/// recycled for each other: what it read late must not count (here, a block
/// reused by the other key would make the key look absent).
#[test]
fn a_slow_batch_reader_never_takes_a_recycled_block_for_the_key() {
    let (deadline, reads) = match onekv_tests::rdma_host() {
        Some(_) => (Duration::from_millis(40), 4),
        None => (Duration::from_millis(4), 20),
    };
    let srv = TestServer::start(|c| {
        c.op_deadline = deadline;
        c.memory = 1 << 20;
        c.max_memory = Some(1 << 20);
        c.buckets = Some(8);
    });
    let acked = [AtomicU64::new(0), AtomicU64::new(0)];
    let stop = AtomicBool::new(false);
    let names = ["recycled-a", "recycled-b"];
    std::thread::scope(|s| {
        let (acked, stop, address) = (&acked, &stop, &srv.address);
        s.spawn(move || {
            let mut kv = or_abort(Client::connect(address), "connect");
            let pad = kv.max_value() / 2 - 64;
            let mut seq = 1;
            while !stop.load(Ordering::SeqCst) {
                for (k, name) in names.iter().enumerate() {
                    let value = tagged_value(name, "w", seq, pad);
                    or_abort(kv.put(name.as_bytes(), &value), "put");
                    acked[k].store(seq, Ordering::SeqCst);
                }
                seq += 1;
            }
        });
        let options = ClientOptions::default().with_pause_after_index_read(deadline * 25);
        let mut kv = or_abort(Client::connect_with(address, options), "connect");
        wait_or_abort("the first writes", WAIT_LIMIT, || {
            acked[1].load(Ordering::SeqCst) > 0
        });
        // (Each late batch sends its keys to the single-key path, which
        // retries until a read is in time: a few hundred milliseconds.)
        for _ in 0..reads {
            let floors = [0, 1].map(|k| acked[k].load(Ordering::SeqCst));
            let values = or_abort(kv.get_many(&names), "get_many");
            for (k, value) in values.iter().enumerate() {
                let read = value.as_deref().and_then(parse_tagged);
                if read
                    .as_ref()
                    .is_none_or(|(owner, _, seq)| owner != names[k] || *seq < floors[k])
                {
                    stop.store(true, Ordering::SeqCst);
                    panic!(
                        "{} read {read:?} after write {} was acknowledged",
                        names[k], floors[k]
                    );
                }
            }
        }
        stop.store(true, Ordering::SeqCst);
    });
}

#[test]
fn histories_stay_linearizable_through_resizes() {
    // The index doubles five times while the keys are hammered: writers meet
    // frozen slots and move to the new index, readers cross the switch.
    let resized_at = [60, 140, 220, 300, 380];
    let stats = check_histories(Workload {
        resize_at: &resized_at,
        ..Workload::default()
    })
    .stats;
    assert!(stats.resizes >= 3, "too few resizes: {stats:?}");
    assert_eq!(stats.bucket_count, 8 << resized_at.len());
}

/// What a run of [`check_histories`] did besides being linearizable.
struct Run {
    /// The server's final stats.
    stats: ServerStats,
    /// Single-key puts and deletes that took one round trip: blind, on a
    /// settled hint.
    blind_puts: usize,
    blind_deletes: usize,
}

/// Runs the workload and checks every round's history.
#[allow(clippy::too_many_lines)] // one scenario, read top to bottom
fn check_histories(workload: Workload) -> Run {
    let Workload {
        resize_at,
        read_order,
        deadline,
        owned_writes,
    } = workload;
    // A 4 MiB region that cannot grow, with a tiny index: the values written
    // (tens of MiB) do not fit unless freed blocks are reused, and keys
    // share buckets.
    let srv = TestServer::start(|c| {
        aggressive_reuse(c);
        c.op_deadline = deadline;
        c.memory = 4 << 20;
        c.max_memory = Some(4 << 20);
        c.buckets = Some(8);
    });
    let log = Mutex::new(Vec::new());
    let barrier = Barrier::new(THREADS);
    let done = AtomicUsize::new(0);
    let (blind_puts, blind_deletes) = (AtomicUsize::new(0), AtomicUsize::new(0));
    std::thread::scope(|s| {
        if !resize_at.is_empty() {
            let (done, address) = (&done, &srv.address);
            s.spawn(move || {
                let mut kv = or_abort(Client::connect(address), "connect");
                for &round in resize_at {
                    wait_or_abort("the round to resize at", WAIT_LIMIT, || {
                        done.load(Ordering::SeqCst) >= round * THREADS
                    });
                    or_abort(kv.resize(), "resize");
                }
            });
        }
        for t in 0..THREADS {
            let (log, barrier, done, address) = (&log, &barrier, &done, &srv.address);
            let (blind_puts, blind_deletes) = (&blind_puts, &blind_deletes);
            s.spawn(move || {
                // One client reads slowly, at times for longer than the grace
                // period: it holds old offsets while their blocks are freed
                // and rewritten, and must notice it was too slow.
                // Half the clients use slot hints (1-round-trip GETs), half not.
                let options = ClientOptions::default()
                    .with_slot_cache_entries(if t % 2 == 0 { 4096 } else { 0 })
                    .with_pause_after_index_read((t == 1).then_some(Duration::from_millis(12)))
                    .with_read_order(read_order);
                let mut kv = or_abort(Client::connect_with(address, options), "connect");
                let mut rng = 0x2545_f491_4f6c_dd1du64.wrapping_mul(t as u64 + 1);
                for round in 0..ROUNDS {
                    barrier.wait();
                    for i in 0..OPS_PER_ROUND {
                        xorshift(&mut rng);
                        let mut k = (rng % KEYS as u64) as usize;
                        let write = (rng >> 8) % 8 >= 4;
                        if owned_writes && write {
                            // This thread's keys: t, t + THREADS, ...
                            let own = (KEYS - t).div_ceil(THREADS);
                            k = t + THREADS * ((rng >> 24) as usize % own);
                        }
                        let name = key(k);
                        let op = match (rng >> 8) % 8 {
                            0..=3 => RegisterOp::Read,
                            4..=6 => {
                                let pad = [0, 100, 700, 2000][(rng >> 16) as usize % 4];
                                let seq = (round * OPS_PER_ROUND + i) as u64;
                                RegisterOp::Write(Some(tagged_value(
                                    &name,
                                    &format!("t{t}"),
                                    seq,
                                    pad,
                                )))
                            }
                            _ => RegisterOp::Write(None),
                        };
                        log.lock().unwrap().push(Event::Invoke(k, t, op.clone()));
                        // Half the reads read a second key with it, in one
                        // get_many: each is a read of its key within the
                        // call.
                        // Half the puts and deletes (where any client may
                        // write any key) write a second key with it, in one
                        // put_many or delete_many.
                        let pair = (rng >> 20).is_multiple_of(2)
                            && match &op {
                                RegisterOp::Read => true,
                                RegisterOp::Write(_) => !owned_writes,
                            };
                        let k2 = (k + 1) % KEYS;
                        let op2 = match &op {
                            RegisterOp::Write(Some(v)) => {
                                let seq = (round * OPS_PER_ROUND + i) as u64;
                                let pad = v.len() % 1000;
                                RegisterOp::Write(Some(tagged_value(
                                    &key(k2),
                                    &format!("t{t}"),
                                    seq,
                                    pad,
                                )))
                            }
                            RegisterOp::Write(None) => RegisterOp::Write(None),
                            RegisterOp::Read => RegisterOp::Read,
                        };
                        if pair {
                            log.lock().unwrap().push(Event::Invoke(k2, t, op2.clone()));
                        }
                        let ret = match op {
                            RegisterOp::Read if pair => {
                                let names = [name.clone(), key(k2)];
                                let mut vs = or_abort(kv.get_many(&names), "get_many");
                                let v2 = vs.pop().flatten();
                                let v = vs.pop().flatten();
                                check_owner(&names[1], &v2);
                                log.lock().unwrap().push(Event::Return(
                                    k2,
                                    t,
                                    RegisterRet::ReadOk(v2),
                                ));
                                check_owner(&name, &v);
                                RegisterRet::ReadOk(v)
                            }
                            RegisterOp::Read => {
                                let v = or_abort(kv.get(name.as_bytes()), "get");
                                check_owner(&name, &v);
                                RegisterRet::ReadOk(v)
                            }
                            RegisterOp::Write(Some(v)) if pair => {
                                let RegisterOp::Write(Some(v2)) = op2 else {
                                    unreachable!("a paired put writes both keys")
                                };
                                let pairs = [(name.clone(), v), (key(k2), v2)];
                                or_abort(kv.put_many(&pairs), "put_many");
                                log.lock().unwrap().push(Event::Return(
                                    k2,
                                    t,
                                    RegisterRet::WriteOk,
                                ));
                                RegisterRet::WriteOk
                            }
                            RegisterOp::Write(Some(v)) => {
                                let before = kv.verb_stats().round_trips;
                                or_abort(kv.put(name.as_bytes(), &v), "put");
                                if kv.verb_stats().round_trips == before + 1 {
                                    blind_puts.fetch_add(1, Ordering::Relaxed);
                                }
                                RegisterRet::WriteOk
                            }
                            RegisterOp::Write(None) if pair => {
                                or_abort(kv.delete_many(&[name.clone(), key(k2)]), "delete_many");
                                log.lock().unwrap().push(Event::Return(
                                    k2,
                                    t,
                                    RegisterRet::WriteOk,
                                ));
                                RegisterRet::WriteOk
                            }
                            RegisterOp::Write(None) => {
                                let before = kv.verb_stats().round_trips;
                                or_abort(kv.delete(name.as_bytes()), "delete");
                                if kv.verb_stats().round_trips == before + 1 {
                                    blind_deletes.fetch_add(1, Ordering::Relaxed);
                                }
                                RegisterRet::WriteOk
                            }
                        };
                        log.lock().unwrap().push(Event::Return(k, t, ret));
                    }
                    // Until everyone is done, keep writing other keys: this
                    // recycles the blocks this round freed while the slow
                    // reader may still be about to read them.
                    done.fetch_add(1, Ordering::SeqCst);
                    let mut n = 0;
                    let give_up = std::time::Instant::now() + WAIT_LIMIT;
                    while done.load(Ordering::SeqCst) < THREADS * (round + 1) {
                        if std::time::Instant::now() > give_up {
                            or_abort::<(), _>(Err("the other workers are stuck"), "round");
                        }
                        let churn = format!("churn-{t}-{}", n % 4);
                        let pad = [0, 100, 700, 2000][n % 4];
                        or_abort(
                            kv.put(
                                churn.as_bytes(),
                                tagged_value(&churn, "churn", n as u64, pad),
                            ),
                            "put",
                        );
                        n += 1;
                    }
                    barrier.wait();
                    if t == 0 {
                        // A read after everyone finished fixes each key's value
                        // at the end of the round (the next round's start).
                        end_round(log, KEYS, THREADS, |k| {
                            or_abort(kv.get(key(k).as_bytes()), "get")
                        });
                    }
                }
            });
        }
    });

    let rounds_checked = check_rounds(&log.into_inner().unwrap(), KEYS, THREADS, key);
    assert_eq!(rounds_checked, ROUNDS);
    // Tens of MiB went through a 4 MiB heap: the server reclaimed
    // overwritten blocks (by scans, or on the clients' reports), and never
    // counted space twice.
    let stats = srv.server.stats();
    assert!(
        stats.index_scans > 1 || stats.freed_on_report > 0,
        "no space was reclaimed: {stats:?}"
    );
    assert!(
        stats.heap_free + stats.heap_leased <= stats.heap_size,
        "space counted twice: {stats:?}"
    );
    Run {
        stats,
        blind_puts: blind_puts.into_inner(),
        blind_deletes: blind_deletes.into_inner(),
    }
}
