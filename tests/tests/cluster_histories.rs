//! Linearizable histories across a cluster's shards while a server joins
//! and another drains: clients read, write and delete a few keys spread
//! over the shards (singly and in batches that span shards) while the
//! shards they use move from server to server. Every round's history is
//! checked with stateright's LinearizabilityTester, one register per key.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Barrier, Mutex};
use std::time::Duration;

use kv_client::{ClientOptions, ClusterClient};
use onekv_tests::cluster::{cluster_status, create_cluster, start_member, EtcdServer};
use onekv_tests::histories::{check_owner, check_rounds, end_round, Event};
use onekv_tests::{eventually, or_abort, region_dir, tagged_value, wait_or_abort, xorshift};
use stateright::semantics::register::{RegisterOp, RegisterRet};

const THREADS: usize = 3;
const KEYS: usize = 8;
const OPS_PER_ROUND: usize = 4;
/// Rounds run at least, and on until both changes of membership are done.
const MIN_ROUNDS: usize = 30;
/// Longest a worker waits for the others.
const WAIT_LIMIT: Duration = Duration::from_secs(300);

fn key(k: usize) -> String {
    format!("hist-{k}")
}

#[test]
fn histories_stay_linearizable_while_a_server_joins_and_another_drains() {
    let etcd = EtcdServer::start();
    let url = etcd.url("histories");
    let dir = region_dir();
    create_cluster(&url, 4, 2);
    let m0 = start_member(&url, dir.path(), "m0", &[]);
    let _m1 = start_member(&url, dir.path(), "m1", &[]);
    eventually("every shard served", Duration::from_secs(60), || {
        ClusterClient::connect(&url).is_ok_and(|mut kv| (0..KEYS).all(|k| kv.get(key(k)).is_ok()))
    });

    let log = Mutex::new(Vec::new());
    let barrier = Barrier::new(THREADS);
    let rounds = AtomicUsize::new(0);
    let (changed, keep_going) = (AtomicBool::new(false), AtomicBool::new(true));
    let joined = Mutex::new(None);
    std::thread::scope(|s| {
        // Once the clients run: m2 joins and takes its share; then m0
        // drains (its shards move away) and leaves.
        s.spawn(|| {
            let past = |n: usize| rounds.load(Ordering::SeqCst) >= n;
            wait_or_abort("the first rounds", WAIT_LIMIT, || past(5));
            *joined.lock().unwrap() = Some(start_member(&url, dir.path(), "m2", &[]));
            eventually("m2 takes shards", WAIT_LIMIT, || {
                let status = cluster_status(&url);
                status.contains("member m2 ") && !status.contains(": 0 shards")
            });
            let at = rounds.load(Ordering::SeqCst);
            wait_or_abort("rounds after the join", WAIT_LIMIT, || past(at + 5));
            m0.signal(libc::SIGTERM);
            let (status, log) = m0.wait_exit(WAIT_LIMIT);
            assert!(status.success(), "m0 left badly: {log}");
            assert!(log.contains("moved to"), "m0 left without moving: {log}");
            changed.store(true, Ordering::SeqCst);
        });
        for t in 0..THREADS {
            let (log, barrier, rounds, url) = (&log, &barrier, &rounds, &url);
            let (changed, keep_going) = (&changed, &keep_going);
            s.spawn(move || {
                // Half the clients use slot hints, half not.
                let options = ClientOptions::default().with_slot_cache_entries(if t % 2 == 0 {
                    4096
                } else {
                    0
                });
                let mut kv = or_abort(ClusterClient::connect_with(url, options), "connect");
                let mut rng = 0x9e37_79b9_7f4a_7c15u64.wrapping_mul(t as u64 + 1);
                let mut round = 0;
                while keep_going.load(Ordering::SeqCst) {
                    barrier.wait();
                    for i in 0..OPS_PER_ROUND {
                        xorshift(&mut rng);
                        let seq = (round * OPS_PER_ROUND + i) as u64;
                        one_op(&mut kv, log, t, rng, seq);
                    }
                    barrier.wait();
                    if t == 0 {
                        // The reads that fix each key's value at the
                        // round's end, and whether another round runs.
                        end_round(log, KEYS, THREADS, |k| or_abort(kv.get(key(k)), "get"));
                        let n = rounds.fetch_add(1, Ordering::SeqCst) + 1;
                        let more = n < MIN_ROUNDS || !changed.load(Ordering::SeqCst);
                        keep_going.store(more, Ordering::SeqCst);
                        // Rounds a few milliseconds apart: the moves
                        // happen within tens of rounds, not thousands.
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    barrier.wait();
                    round += 1;
                }
            });
        }
    });
    let checked = check_rounds(&log.into_inner().unwrap(), KEYS, THREADS, key);
    assert!(checked >= MIN_ROUNDS, "{checked} rounds");
    let status = cluster_status(&url);
    assert!(!status.contains("member m0 "), "{status}");
    assert!(status.contains("member m2 "), "{status}");
}

/// One operation of thread `t`, chosen by `rng`, logged as invoked and
/// returned: a read, a put or a delete of a key, half of them with the
/// next key in the same batch (which may lie in another shard).
fn one_op(kv: &mut ClusterClient, log: &Mutex<Vec<Event>>, t: usize, rng: u64, seq: u64) {
    let k = (rng % KEYS as u64) as usize;
    let k2 = (k + 1) % KEYS;
    let pair = (rng >> 20).is_multiple_of(2);
    let (name, name2) = (key(k), key(k2));
    let value = |name: &str| tagged_value(name, &format!("t{t}"), seq, (rng >> 24) as usize % 900);
    let (op, op2) = match (rng >> 8) % 8 {
        0..=3 => (RegisterOp::Read, RegisterOp::Read),
        4..=6 => (
            RegisterOp::Write(Some(value(&name))),
            RegisterOp::Write(Some(value(&name2))),
        ),
        _ => (RegisterOp::Write(None), RegisterOp::Write(None)),
    };
    let invoke = |k: usize, op: &RegisterOp<_>| {
        log.lock().unwrap().push(Event::Invoke(k, t, op.clone()));
    };
    let ret = |k: usize, ret: RegisterRet<_>| log.lock().unwrap().push(Event::Return(k, t, ret));
    invoke(k, &op);
    if pair {
        invoke(k2, &op2);
    }
    match (op, op2) {
        (RegisterOp::Read, _) if pair => {
            let names = [name.clone(), name2.clone()];
            let mut vs = or_abort(kv.get_many(&names), "get_many");
            let (v2, v) = (vs.pop().flatten(), vs.pop().flatten());
            check_owner(&name2, &v2);
            check_owner(&name, &v);
            ret(k2, RegisterRet::ReadOk(v2));
            ret(k, RegisterRet::ReadOk(v));
        }
        (RegisterOp::Read, _) => {
            let v = or_abort(kv.get(&name), "get");
            check_owner(&name, &v);
            ret(k, RegisterRet::ReadOk(v));
        }
        (RegisterOp::Write(Some(v)), RegisterOp::Write(Some(v2))) if pair => {
            or_abort(kv.put_many(&[(name, v), (name2, v2)]), "put_many");
            ret(k2, RegisterRet::WriteOk);
            ret(k, RegisterRet::WriteOk);
        }
        (RegisterOp::Write(Some(v)), _) => {
            or_abort(kv.put(&name, &v), "put");
            ret(k, RegisterRet::WriteOk);
        }
        (RegisterOp::Write(None), _) if pair => {
            or_abort(kv.delete_many(&[name, name2]), "delete_many");
            ret(k2, RegisterRet::WriteOk);
            ret(k, RegisterRet::WriteOk);
        }
        (RegisterOp::Write(None), _) => {
            or_abort(kv.delete(&name), "delete");
            ret(k, RegisterRet::WriteOk);
        }
    }
}
