//! A cluster that keeps three copies of each shard: groups on distinct
//! servers and zones, every write on every copy before it returns, copies
//! that end alike under concurrent writers of the same keys (inserts,
//! updates, deletes and increments, with linearizable histories at the
//! primary), and a writer killed between its copies, whose copies the
//! key's next write brings back together.

use std::collections::BTreeMap;
use std::process::Command;
use std::sync::{Barrier, Mutex};
use std::time::Duration;

use kv_client::{Client, ClientOptions, ClusterClient, Error};
use kv_cluster::etcd::BlockingEtcd;
use kv_cluster::{shard_address, ClusterUrl};
use onekv_tests::cluster::{cluster_status, create_cluster_with, start_member, EtcdServer};
use onekv_tests::histories::{check_owner, check_rounds, end_round, Event};
use onekv_tests::{
    eventually, or_abort, region_dir, tagged_value, workspace_bin, xorshift, Daemon,
};
use stateright::semantics::register::{RegisterOp, RegisterRet};

const SHARDS: u32 = 4;

/// Four servers in three zones: a group takes one of m0 and m3.
fn start(name: &str) -> (EtcdServer, String, tempfile::TempDir, Vec<Daemon>) {
    let etcd = EtcdServer::start();
    let url = etcd.url(name);
    let dir = region_dir();
    create_cluster_with(&url, SHARDS, 4, &["--replicas", "3"]);
    let members = [("m0", "a"), ("m1", "b"), ("m2", "c"), ("m3", "a")]
        .iter()
        .map(|(m, zone)| start_member(&url, dir.path(), m, &["--zone", zone]))
        .collect();
    eventually("every copy served", Duration::from_secs(60), || {
        ClusterClient::connect(&url)
            .is_ok_and(|mut kv| (0..SHARDS * 8).all(|i| kv.put(format!("warm{i}"), b"w").is_ok()))
    });
    (etcd, url, dir, members)
}

/// Connections to each copy of each shard, the primary first, as the map
/// in etcd says.
fn copies(url: &str) -> Vec<Vec<(String, Client)>> {
    let url = ClusterUrl::parse(url).expect("a cluster URL");
    let state = BlockingEtcd::connect(&url)
        .and_then(|mut e| e.state())
        .expect("the cluster's state");
    let map = state.shard_map().expect("a map");
    (0..SHARDS)
        .map(|shard| {
            let mut group = vec![map.owner(shard).expect("an owner").to_string()];
            group.extend(map.backups(shard).iter().cloned());
            group
                .into_iter()
                .map(|id| {
                    let listen = state.member(&id).expect("a live member").listen.clone();
                    let listen = kv_common::Address::parse(&listen).expect("an address");
                    let at = shard_address(&listen, shard).expect("a shard address");
                    (
                        id,
                        Client::connect(&at.to_string()).expect("connect to a copy"),
                    )
                })
                .collect()
        })
        .collect()
}

/// `key`'s value at each copy of its shard, the primary's first.
fn values_of(
    copies: &mut [Vec<(String, Client)>],
    kv: &ClusterClient,
    key: &str,
) -> Vec<Option<Vec<u8>>> {
    let shard = kv.shard_of(key) as usize;
    copies[shard]
        .iter_mut()
        .map(|(_, c)| or_abort(c.get(key), "read a copy"))
        .collect()
}

/// `key`'s value, the same at every copy (else the test fails; from a
/// thread among others, the process aborts, as a panic would leave them
/// waiting at a barrier).
fn assert_alike(
    copies: &mut [Vec<(String, Client)>],
    kv: &ClusterClient,
    key: &str,
) -> Option<Vec<u8>> {
    let values = values_of(copies, kv, key);
    if values.iter().any(|v| *v != values[0]) {
        let shown: Vec<_> = values
            .iter()
            .map(|v| v.as_deref().map(String::from_utf8_lossy))
            .collect();
        or_abort(
            Err(format!("{key}: the copies differ: {shown:?}")),
            "compare copies",
        )
    }
    values[0].clone()
}

#[test]
fn every_copy_has_each_write_and_concurrent_writers_leave_them_alike() {
    let (_etcd, url, _dir, _members) = start("replicas");
    let status = cluster_status(&url);
    assert!(status.contains("replicas: 3"), "{status}");
    assert!(
        status.contains("(zone a)") && status.contains("backups of ["),
        "{status}"
    );
    let mut groups = copies(&url);
    for (shard, group) in groups.iter().enumerate() {
        let ids: Vec<&str> = group.iter().map(|(id, _)| id.as_str()).collect();
        assert_eq!(ids.len(), 3, "shard {shard}: {ids:?}");
        let in_a = ids.iter().filter(|id| ["m0", "m3"].contains(id)).count();
        assert_eq!(in_a, 1, "shard {shard}: one copy in zone a: {ids:?}");
    }

    // Each write is on every copy once it returns.
    let mut kv = ClusterClient::connect(&url).expect("connect");
    for i in 0..60 {
        let key = format!("key{i}");
        kv.put(&key, format!("v{i}")).expect("put");
        assert_eq!(
            assert_alike(&mut groups, &kv, &key).as_deref(),
            Some(format!("v{i}").as_bytes())
        );
    }
    for i in 0..20 {
        let key = format!("key{i}");
        kv.put(&key, format!("again{i}")).expect("update");
        assert!(kv.delete(format!("key{}", i + 20)).expect("delete"));
        assert!(!kv.delete(format!("absent{i}")).expect("delete absent"));
    }
    assert_eq!(kv.incr("hits", 5).expect("incr"), 5);
    assert_eq!(kv.incr("hits", -2).expect("incr"), 3);
    assert_eq!(kv.get_counter("hits").expect("get_counter"), Some(3));
    assert_eq!(kv.get("hits").expect("get").as_deref(), Some(&b"3"[..]));
    // An increment of a plain value is refused before any copy changes.
    kv.put("plain", "text").expect("put");
    assert!(matches!(kv.incr("plain", 1), Err(Error::NotACounter)));
    assert_eq!(
        assert_alike(&mut groups, &kv, "plain").as_deref(),
        Some(&b"text"[..])
    );
    let pairs: Vec<(String, String)> = (60..80)
        .map(|i| (format!("key{i}"), format!("v{i}")))
        .collect();
    kv.put_many(&pairs).expect("put_many");
    let gone: Vec<String> = (70..80).map(|i| format!("key{i}")).collect();
    assert!(kv
        .delete_many(&gone)
        .expect("delete_many")
        .iter()
        .all(|&was| was));
    for i in 0..80 {
        let key = format!("key{i}");
        let expected = match i {
            0..20 => Some(format!("again{i}")),
            20..40 | 70..80 => None,
            _ => Some(format!("v{i}")),
        };
        assert_eq!(
            assert_alike(&mut groups, &kv, &key),
            expected.map(String::into_bytes),
            "{key}"
        );
        assert_eq!(
            kv.get(&key).expect("get"),
            assert_alike(&mut groups, &kv, &key)
        );
    }
    assert_eq!(
        assert_alike(&mut groups, &kv, "hits").as_deref(),
        Some(&b"3"[..])
    );

    concurrent_writers_leave_every_copy_alike(&url, &mut groups);
}

const THREADS: usize = 3;
const KEYS: usize = 6;
const ROUNDS: usize = 40;
const OPS_PER_ROUND: usize = 6;

fn hist_key(k: usize) -> String {
    format!("hist-{k}")
}

/// Threads write a few keys at once, each round's history checked for
/// linearizability (reads at the primary), with deletes that make the
/// next writes inserts again, half the clients with slot hints and half
/// without; then every copy of every key is the same, and counters that
/// every thread increments sum every increment on every copy.
fn concurrent_writers_leave_every_copy_alike(url: &str, groups: &mut [Vec<(String, Client)>]) {
    let groups = Mutex::new(groups);
    let log = Mutex::new(Vec::new());
    let barrier = Barrier::new(THREADS);
    let increments = Mutex::new(BTreeMap::<String, i64>::new());
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (log, barrier, increments, groups) = (&log, &barrier, &increments, &groups);
            s.spawn(move || {
                // Pauses after index reads (up to 2 ms, at random) spread
                // each write's steps, so that writers of one key overlap.
                let entries = if t % 2 == 0 { 4096 } else { 0 };
                let options = ClientOptions::default()
                    .with_slot_cache_entries(entries)
                    .with_pause_after_index_read(Duration::from_millis(2));
                let mut kv = or_abort(ClusterClient::connect_with(url, options), "connect");
                let mut rng = 0x2545_f491_4f6c_dd1du64.wrapping_mul(t as u64 + 1);
                for round in 0..ROUNDS {
                    barrier.wait();
                    for i in 0..OPS_PER_ROUND {
                        xorshift(&mut rng);
                        let seq = (round * OPS_PER_ROUND + i) as u64;
                        one_op(&mut kv, log, t, rng, seq);
                        let counter = format!("count-{}", rng % 3);
                        let delta = (rng >> 40) as i64 % 7 - 3;
                        or_abort(kv.incr(&counter, delta), "incr");
                        *increments.lock().unwrap().entry(counter).or_default() += delta;
                    }
                    barrier.wait();
                    if t == 0 {
                        // Every copy alike once the round's writers are
                        // done, whatever order their sets came in.
                        let mut groups = groups.lock().unwrap();
                        for k in 0..KEYS {
                            assert_alike(&mut groups, &kv, &hist_key(k));
                        }
                        end_round(log, KEYS, THREADS, |k| or_abort(kv.get(hist_key(k)), "get"));
                    }
                    barrier.wait();
                }
            });
        }
    });
    let checked = check_rounds(&log.into_inner().unwrap(), KEYS, THREADS, hist_key);
    assert_eq!(checked, ROUNDS);
    let groups = groups.into_inner().unwrap();
    let kv = ClusterClient::connect(url).expect("connect");
    for k in 0..KEYS {
        assert_alike(groups, &kv, &hist_key(k));
    }
    for (counter, sum) in increments.into_inner().unwrap() {
        let value = assert_alike(groups, &kv, &counter);
        assert_eq!(value, Some(sum.to_string().into_bytes()), "{counter}");
    }
}

/// A read, a put or a delete of a key, logged as invoked and returned.
fn one_op(kv: &mut ClusterClient, log: &Mutex<Vec<Event>>, t: usize, rng: u64, seq: u64) {
    let k = (rng % KEYS as u64) as usize;
    let name = hist_key(k);
    let op = match (rng >> 8) % 8 {
        0..=2 => RegisterOp::Read,
        3..=5 => RegisterOp::Write(Some(tagged_value(&name, &format!("t{t}"), seq, 64))),
        _ => RegisterOp::Write(None),
    };
    log.lock().unwrap().push(Event::Invoke(k, t, op.clone()));
    let ret = match op {
        RegisterOp::Read => {
            let v = or_abort(kv.get(&name), "get");
            check_owner(&name, &v);
            RegisterRet::ReadOk(v)
        }
        RegisterOp::Write(Some(v)) => {
            or_abort(kv.put(&name, &v), "put");
            RegisterRet::WriteOk
        }
        RegisterOp::Write(None) => {
            or_abort(kv.delete(&name), "delete");
            RegisterRet::WriteOk
        }
    };
    log.lock().unwrap().push(Event::Return(k, t, ret));
}

/// `kv --server URL ARGS...` killed where `ONEKV_CLIENT_FAULT` says.
fn killed_kv(url: &str, args: &[&str]) {
    let out = Command::new(workspace_bin("kv"))
        .args(["--server", url])
        .args(args)
        .env("ONEKV_CLIENT_FAULT", "replica-backups-set")
        .output()
        .expect("run kv");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("ONEKV_CLIENT_FAULT"),
        "kv {args:?} was not killed at its fault point: {stderr}"
    );
}

#[test]
fn a_writer_killed_between_its_copies_leaves_them_to_the_keys_next_write() {
    let (_etcd, url, _dir, mut members) = start("killed");
    let mut groups = copies(&url);
    let mut kv = ClusterClient::connect(&url).expect("connect");
    kv.put("k", "old").expect("put");
    kv.incr("n", 10).expect("incr");

    // Killed after its backups had the value, before the primary did:
    // readers (at the primary) still see the old one, and the copies
    // differ only by a write whose caller never learned its outcome.
    killed_kv(&url, &["put", "k", "new"]);
    let values = values_of(&mut groups, &kv, "k");
    assert_eq!(values[0].as_deref(), Some(&b"old"[..]), "the primary");
    assert!(
        values[1..]
            .iter()
            .all(|v| v.as_deref() == Some(&b"new"[..])),
        "{values:?}"
    );
    assert_eq!(kv.get("k").expect("get").as_deref(), Some(&b"old"[..]));
    // The next write brings every copy to it.
    kv.put("k", "next").expect("put");
    assert_eq!(
        assert_alike(&mut groups, &kv, "k").as_deref(),
        Some(&b"next"[..])
    );

    // An increment killed the same way is counted nowhere once the next
    // one lands: never twice.
    killed_kv(&url, &["incr", "n", "5"]);
    assert_eq!(kv.get_counter("n").expect("get_counter"), Some(10));
    assert_eq!(kv.incr("n", 1).expect("incr"), 11);
    assert_eq!(
        assert_alike(&mut groups, &kv, "n").as_deref(),
        Some(&b"11"[..])
    );

    // An insert killed holding the key's insert lock (its backups have the
    // value, the primary not): the next insert of the key waits for the
    // lock to lapse (20 operation deadlines, 1 s by default), then lands
    // on every copy.
    killed_kv(&url, &["put", "fresh", "lost"]);
    let values = values_of(&mut groups, &kv, "fresh");
    assert_eq!(values[0], None, "the primary");
    assert!(
        values[1..]
            .iter()
            .all(|v| v.as_deref() == Some(&b"lost"[..])),
        "{values:?}"
    );
    assert_eq!(kv.get("fresh").expect("get"), None);
    let started = std::time::Instant::now();
    kv.put("fresh", "found").expect("put after the lock lapsed");
    assert!(
        started.elapsed() > Duration::from_millis(500),
        "the insert did not wait for the dead writer's lock: {:?}",
        started.elapsed()
    );
    assert_eq!(
        assert_alike(&mut groups, &kv, "fresh").as_deref(),
        Some(&b"found"[..])
    );
    // And a delete killed between copies: the key is still there at the
    // primary; the next delete removes it everywhere.
    killed_kv(&url, &["del", "k"]);
    assert_eq!(kv.get("k").expect("get").as_deref(), Some(&b"next"[..]));
    assert!(kv.delete("k").expect("delete"));
    assert_eq!(assert_alike(&mut groups, &kv, "k"), None);

    // A stop signal: nothing would move the copies a server holds, so it
    // leaves at once rather than wait out a drain.
    let m3 = members.pop().expect("m3");
    m3.signal(libc::SIGTERM);
    let (status, log) = m3.wait_exit(Duration::from_secs(60));
    assert!(status.success(), "{log}");
    assert!(log.contains("leaving without a drain"), "{log}");
}
