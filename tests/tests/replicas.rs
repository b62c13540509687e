//! A cluster that keeps three copies of each shard: groups on distinct
//! servers and zones, every write on every copy before it returns, copies
//! that end alike under concurrent writers of the same keys (inserts,
//! updates, deletes and increments, with linearizable histories at the
//! primary), and a writer killed between its copies, whose copies the
//! key's next write brings back together, and an increment stalled past
//! its key's lock that never sets an older sum on a backup. Failover: a
//! primary killed under load is replaced by a backup with every
//! acknowledged write, its server never serves the old copies again, the
//! copy count is restored (through a second kill, and the kill of a
//! copy's source), histories stay linearizable across the kill, a frozen
//! one is fenced and serves no read past its read lease, and an etcd
//! outage pauses the copies, and a client busy at a frozen primary
//! follows its failover in seconds. Online: a member that joins takes its
//! share of copies and leads, one back after a failover takes its share
//! of leads with its copies, and one told to stop has each copy replaced
//! (its leads handed over) before it leaves, no shard a copy short.

use std::collections::BTreeMap;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Barrier, Mutex};
use std::time::{Duration, Instant};

use kv_client::{Client, ClientOptions, ClusterClient, Error};
use kv_cluster::etcd::BlockingEtcd;
use kv_cluster::{shard_address, ClusterState, ClusterUrl, ShardMap};
use kv_common::layout::KeyHash;
use onekv_tests::cluster::{
    cluster_status, create_cluster_with, start_member, start_member_with_env, EtcdServer,
};
use onekv_tests::histories::{check_owner, check_rounds, end_round, Event};
use onekv_tests::{
    eventually, eventually_ok, or_abort, region_dir, tagged_value, wait_or_abort, workspace_bin,
    xorshift, Daemon,
};
use stateright::semantics::register::{RegisterOp, RegisterRet};

const SHARDS: u32 = 4;
/// The members and their zones: a group takes one of m0 and m3.
const MEMBERS: [(&str, &str); 4] = [("m0", "a"), ("m1", "b"), ("m2", "c"), ("m3", "a")];

/// Four servers in three zones.
fn start(name: &str) -> (EtcdServer, String, tempfile::TempDir, Vec<Daemon>) {
    start_with(name, &[], &[])
}

/// As [`start`], the servers started with `args` and `env` (a test hook).
fn start_with(
    name: &str,
    args: &[&str],
    env: &[(&str, &str)],
) -> (EtcdServer, String, tempfile::TempDir, Vec<Daemon>) {
    let etcd = EtcdServer::start();
    let url = etcd.url(name);
    let dir = region_dir();
    create_cluster_with(&url, SHARDS, 4, &["--replicas", "3"]);
    let members = MEMBERS
        .iter()
        .map(|(m, zone)| {
            let args = [&["--zone", zone][..], args].concat();
            start_member_with_env(&url, dir.path(), m, &args, env)
        })
        .collect();
    let warm = || -> Result<(), Error> {
        let mut kv = ClusterClient::connect(&url)?;
        (0..SHARDS * 8).try_for_each(|i| kv.put(format!("warm{i}"), b"w"))
    };
    let status = || cluster_status(&url);
    eventually_ok("every copy served", Duration::from_secs(120), warm, status);
    (etcd, url, dir, members)
}

/// The servers [`start`] started, by member name.
fn by_name(members: Vec<Daemon>) -> BTreeMap<String, Daemon> {
    MEMBERS
        .iter()
        .map(|(m, _)| m.to_string())
        .zip(members)
        .collect()
}

/// The cluster as etcd holds it.
fn cluster_state(url: &str) -> ClusterState {
    let url = ClusterUrl::parse(url).expect("a cluster URL");
    BlockingEtcd::connect(&url)
        .and_then(|mut e| e.state())
        .expect("the cluster's state")
}

/// Where member `id` of `state` serves `shard`.
fn copy_address(state: &ClusterState, id: &str, shard: u32) -> Option<String> {
    let listen = kv_common::Address::parse(&state.member(id)?.listen).ok()?;
    Some(shard_address(&listen, shard).ok()?.to_string())
}

/// Connections to each copy of each shard, the primary first, as the map
/// in etcd says (under the group epoch it gives each shard).
fn try_copies(url: &str) -> Result<Vec<Vec<(String, Client)>>, String> {
    let state = cluster_state(url);
    let map = state.shard_map().ok_or("no map")?;
    (0..SHARDS)
        .map(|shard| {
            let mut group = vec![map.owner(shard).ok_or("no owner")?.to_string()];
            group.extend(map.backups(shard).iter().cloned());
            let options = ClientOptions::default().with_group_epoch(map.group_epoch(shard));
            group
                .into_iter()
                .map(|id| {
                    let at = copy_address(&state, &id, shard).ok_or("not a live member")?;
                    let client = Client::connect_with(&at, options.clone())
                        .map_err(|e| format!("{id}: {e}"))?;
                    Ok((id, client))
                })
                .collect()
        })
        .collect()
}

/// As [`try_copies`], once every copy admits clients.
fn copies(url: &str) -> Vec<Vec<(String, Client)>> {
    let mut got = None;
    eventually("every copy serving", Duration::from_secs(60), || {
        got = try_copies(url).ok();
        got.is_some()
    });
    got.expect("copies")
}

/// `key`'s value at each copy of its shard, the primary's first.
fn values_of(
    copies: &mut [Vec<(String, Client)>],
    kv: &ClusterClient,
    key: &str,
) -> Vec<Option<Vec<u8>>> {
    or_abort(try_values_of(copies, kv, key), "read a copy")
}

/// As [`values_of`], the first error if a copy cannot be read.
fn try_values_of(
    copies: &mut [Vec<(String, Client)>],
    kv: &ClusterClient,
    key: &str,
) -> Result<Vec<Option<Vec<u8>>>, Error> {
    let shard = kv.shard_of(key) as usize;
    copies[shard].iter_mut().map(|(_, c)| c.get(key)).collect()
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
    assert_values_alike(key, values)
}

/// As [`assert_alike`], the copies read again from the map at `url` if
/// they turn the reads away (a member slow to renew its lease on a busy
/// host was failed over, and its copies restored, meanwhile).
fn assert_alike_following(
    url: &str,
    copies: &mut Vec<Vec<(String, Client)>>,
    kv: &ClusterClient,
    key: &str,
) -> Option<Vec<u8>> {
    for _ in 0..10 {
        match try_values_of(copies, kv, key) {
            Ok(values) => return assert_values_alike(key, values),
            Err(e) => {
                eprintln!("reading the copies of {key}: {e}; reading the map again");
                *copies = self::copies(url);
            }
        }
    }
    let values = values_of(copies, kv, key);
    assert_values_alike(key, values)
}

/// The value of `key` at every copy (`values`), which must be alike.
fn assert_values_alike(key: &str, values: Vec<Option<Vec<u8>>>) -> Option<Vec<u8>> {
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
                        if !one_op(&mut kv, log, t, rng, seq) {
                            or_abort::<(), _>(Err("no server was killed"), "an unknown outcome");
                        }
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

/// A read, a put or a delete of a key by thread `t`, logged as invoked
/// and, unless its outcome is unknown (a write cut by a kill), returned:
/// false then (its invocation stays open: it may or may not have taken
/// effect), and the thread goes on under another id.
fn one_op(kv: &mut ClusterClient, log: &Mutex<Vec<Event>>, t: usize, rng: u64, seq: u64) -> bool {
    let k = (rng % KEYS as u64) as usize;
    let name = hist_key(k);
    let op = match (rng >> 8) % 8 {
        0..=2 => RegisterOp::Read,
        3..=5 => RegisterOp::Write(Some(tagged_value(&name, &format!("t{t}"), seq, 64))),
        _ => RegisterOp::Write(None),
    };
    log.lock().unwrap().push(Event::Invoke(k, t, op.clone()));
    let written = |done: Result<(), Error>, what| match done {
        Ok(()) => Some(RegisterRet::WriteOk),
        Err(Error::OutcomeUnknown(_)) => None,
        Err(e) => or_abort(Err(e), what),
    };
    let ret = match op {
        RegisterOp::Read => {
            let v = or_abort(kv.get(&name), "get");
            check_owner(&name, &v);
            Some(RegisterRet::ReadOk(v))
        }
        RegisterOp::Write(Some(v)) => written(kv.put(&name, &v), "put"),
        RegisterOp::Write(None) => written(kv.delete(&name).map(drop), "delete"),
    };
    let Some(ret) = ret else {
        return false;
    };
    log.lock().unwrap().push(Event::Return(k, t, ret));
    true
}

/// The round after which the primary is killed (while the next one
/// runs), and how many rounds run after the failover is published.
const KILL_AFTER: usize = 4;
const ROUNDS_AFTER_FAILOVER: usize = 6;

/// Linearizable histories through a failover: threads read, write and
/// delete keys of every shard, round by round (each write's steps spread
/// by pauses), while the primary of one key's shard is killed (kill -9)
/// in the middle of a round, and on for rounds after its shards failed
/// over. A write the kill cut (its outcome unknown) may count or not;
/// everything else reads as if one server had served it all.
#[test]
fn histories_stay_linearizable_while_a_primary_is_killed() {
    let (_etcd, url, _dir, mut members) = start("histkill");
    let map = cluster_state(&url).shard_map().expect("a map").clone();
    let shard = ClusterClient::connect(&url)
        .expect("connect")
        .shard_of(hist_key(0));
    let victim = map.owner(shard).expect("an owner").to_string();
    let daemon = members.remove(member_index(&victim));
    let log = Mutex::new(Vec::new());
    let barrier = Barrier::new(THREADS);
    let rounds = AtomicUsize::new(0);
    // The round under way when the failover was seen published.
    let failed_over_in = Mutex::new(None);
    let keep_going = AtomicBool::new(true);
    let unknown = AtomicUsize::new(0);
    std::thread::scope(|s| {
        let (url, rounds, failed_over_in) = (&url, &rounds, &failed_over_in);
        let victim = victim.as_str();
        s.spawn(move || {
            let at = |n: usize| rounds.load(Ordering::SeqCst) >= n;
            wait_or_abort("the first rounds", Duration::from_secs(300), || {
                at(KILL_AFTER)
            });
            // Into the next round's operations.
            std::thread::sleep(Duration::from_millis(3));
            daemon.kill_9();
            wait_or_abort("the failover", Duration::from_secs(120), || {
                cluster_state(url)
                    .shard_map()
                    .is_some_and(|m| m.owner(shard) != Some(victim))
            });
            *failed_over_in.lock().unwrap() = Some(rounds.load(Ordering::SeqCst));
        });
        for t in 0..THREADS {
            let (log, barrier, keep_going, unknown) = (&log, &barrier, &keep_going, &unknown);
            s.spawn(move || {
                let options =
                    ClientOptions::default().with_pause_after_index_read(Duration::from_millis(2));
                let mut kv = or_abort(ClusterClient::connect_with(url, options), "connect");
                let mut rng = 0x9e37_79b9_7f4a_7c15u64.wrapping_mul(t as u64 + 1);
                // Never THREADS, the final reader's.
                let mut id = t;
                let mut round = 0;
                while keep_going.load(Ordering::SeqCst) {
                    barrier.wait();
                    for i in 0..OPS_PER_ROUND {
                        xorshift(&mut rng);
                        let seq = (round * OPS_PER_ROUND + i) as u64;
                        if !one_op(&mut kv, log, id, rng, seq) {
                            unknown.fetch_add(1, Ordering::SeqCst);
                            id += THREADS + 1;
                        }
                    }
                    barrier.wait();
                    if t == 0 {
                        end_round(log, KEYS, THREADS, |k| or_abort(kv.get(hist_key(k)), "get"));
                        round = rounds.fetch_add(1, Ordering::SeqCst) + 1;
                        let seen = *failed_over_in.lock().unwrap();
                        if seen.is_some_and(|r| round >= r + ROUNDS_AFTER_FAILOVER) {
                            keep_going.store(false, Ordering::SeqCst);
                        }
                    } else {
                        round += 1;
                    }
                    barrier.wait();
                }
            });
        }
    });
    let checked = check_rounds(&log.into_inner().unwrap(), KEYS, THREADS, hist_key);
    assert_eq!(checked, rounds.load(Ordering::SeqCst));
    assert!(checked >= KILL_AFTER + ROUNDS_AFTER_FAILOVER);
    eprintln!(
        "{checked} rounds linearizable across the kill of {victim}; {} writes of unknown outcome",
        unknown.load(Ordering::SeqCst)
    );
}

/// `kv --server URL ARGS...` killed once every backup has its write,
/// before the primary does.
fn killed_kv(url: &str, args: &[&str]) {
    killed_kv_at(url, "replica-backups-set", args);
}

/// `kv --server URL ARGS...` killed at fault point `step`.
fn killed_kv_at(url: &str, step: &str, args: &[&str]) {
    let out = Command::new(workspace_bin("kv"))
        .args(["--server", url])
        .args(args)
        .env("ONEKV_CLIENT_FAULT", step)
        .output()
        .expect("run kv");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("ONEKV_CLIENT_FAULT"),
        "kv {args:?} was not killed at its fault point: {stderr}"
    );
}

/// `kv --server URL ARGS...` started with the hooks `env` sets
/// (`ONEKV_CLIENT_PAUSE`, `ONEKV_CLIENT_FAULT`), and its stderr's lines.
fn paused_kv(url: &str, args: &[&str], env: &[(&str, &str)]) -> (std::process::Child, StderrLines) {
    let mut child = Command::new(workspace_bin("kv"))
        .args(["--server", url])
        .args(args)
        .envs(env.iter().copied())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run kv");
    let stderr = child.stderr.take().expect("its stderr");
    (
        child,
        std::io::BufRead::lines(std::io::BufReader::new(stderr)),
    )
}

type StderrLines = std::io::Lines<std::io::BufReader<std::process::ChildStderr>>;

/// Waits until `kv` says it sleeps at pause point `at`.
fn pausing(lines: &mut StderrLines, at: &str) {
    let line = format!("pausing at {at}");
    let seen = lines.find(|l| l.as_ref().is_ok_and(|l| l.contains(&line)));
    assert!(seen.is_some(), "kv never paused at {at}");
}

#[test]
fn a_writer_killed_between_its_copies_leaves_them_to_the_keys_next_write() {
    let (_etcd, url, _dir, _members) = start("killed");
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
    // value, the primary not): the next insert of the key waits a whole
    // life of the lock (20 operation deadlines, 1 s by default, from when
    // it first finds the dead writer's hold), then lands on every copy.
    let started = std::time::Instant::now();
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
    kv.put("fresh", "found").expect("put after the lock lapsed");
    assert!(
        started.elapsed() > Duration::from_millis(950),
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
}

/// A replicated shard's insert locks are words of its primary's region,
/// which writers CAS: a hold planted in the word of a key (as a writer
/// that died holding it leaves one) makes the next insert of that key wait
/// a whole life from when it first finds the hold (20 operation deadlines:
/// 6 s here, longer than a write's attempts last, so the wait must be
/// counted in time), then take it over and let it go, each a step of the
/// word. With locks kept by the server, the planted word would delay
/// nothing.
#[test]
fn an_insert_lock_is_a_word_of_the_primary_a_dead_holders_for_one_life() {
    use std::os::unix::fs::FileExt;
    let (_etcd, url, dir, _members) = start_with("lockword", &["--op-deadline-ms", "300"], &[]);
    let mut groups = copies(&url);
    let mut kv = ClusterClient::connect(&url).expect("connect");
    let key = "planted";
    let shard = kv.shard_of(key);
    let map = cluster_state(&url).shard_map().expect("a map").clone();
    let primary = map.owner(shard).expect("an owner");
    let region = dir.path().join(format!("{primary}.shard-{shard}"));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&region)
        .expect("the primary's region");
    let at = kv_common::layout::insert_lock_offset(key.as_bytes());
    let word = || {
        let mut bytes = [0u8; 8];
        file.read_exact_at(&mut bytes, at).expect("read the word");
        u64::from_le_bytes(bytes)
    };
    // Odd: held, by nobody alive.
    let planted = (word() | 1) + 0x1000;
    file.write_all_at(&planted.to_le_bytes(), at)
        .expect("plant a hold");

    let started = Instant::now();
    kv.put(key, "past the hold").expect("an insert");
    let life = Duration::from_millis(20 * 300);
    assert!(
        started.elapsed() >= life - Duration::from_millis(50),
        "the insert did not wait for the planted hold: {:?}",
        started.elapsed()
    );
    // Taken over (+2; renewed by +2 if the writer was slow), let go (+1).
    let after = word();
    assert!(
        after > planted && after % 2 == 0,
        "{planted:#x} then {after:#x}"
    );
    assert_eq!(
        assert_alike(&mut groups, &kv, key).as_deref(),
        Some(&b"past the hold"[..])
    );
    // The next insert takes the free word and lets it go.
    kv.delete(key).expect("delete");
    kv.put(key, "again").expect("an insert");
    let last = word();
    assert!(last > after && last % 2 == 0, "{after:#x} then {last:#x}");
}

#[test]
fn an_insert_takes_its_lock_in_its_observation_and_lets_it_go_in_its_commit() {
    let (_etcd, url, _dir, _members) = start("insertrt");
    let mut kv = ClusterClient::connect(&url).expect("connect");
    let mut written = Vec::new();
    // Round trips and waits of `write` on fresh keys of shard 0 (so every
    // copy's lock word is one this client guesses right), the fewest round
    // trips of five: a stall past a deadline adds some.
    let mut fewest =
        |kv: &mut ClusterClient, prefix: &str, write: &dyn Fn(&mut ClusterClient, &str)| {
            (0..5)
                .map(|i| {
                    let key = key_of(kv, 0, &format!("{prefix}{i}-"));
                    let at = kv.verb_stats();
                    write(kv, &key);
                    written.push(key);
                    let used = kv.verb_stats().since(&at);
                    (used.round_trips, used.waits)
                })
                .min()
                .expect("five writes")
        };
    let (insert, _) = fewest(&mut kv, "ins", &|kv, key| kv.put(key, "v").expect("insert"));
    let (increment, increment_waits) = fewest(&mut kv, "ctr", &|kv, key| {
        assert_eq!(kv.incr(key, 5).expect("increment"), 5);
    });
    // An insert of a key this client has not seen: at the primary, an
    // observation that carries the lock's CAS, then the commit (block,
    // CAS, the lock's release and the duplicate check's reads in one
    // batch); at each backup, its windows with the block, then its CAS
    // with the check. Observing without the lock first, and letting it go
    // in a batch of its own, made it 8; taking the lock and writing the
    // block in batches of their own, 10.
    assert!(insert <= 6, "an insert at R=3 took {insert} round trips");
    // An increment: its one observation carries the lock's CAS; each
    // backup is read, then set by a CAS; then the commit with the release
    // (7 with the release on its own, 12 before).
    assert!(
        increment <= 6,
        "an increment at R=3 took {increment} round trips"
    );
    // The backups' reads are waited for together, and so are their CASes
    // (each posted while the lock holds): 4 waits, where one backup after
    // the other took 6.
    assert!(
        increment_waits + 2 <= increment,
        "an increment at R=3 waited {increment_waits} times for {increment} round trips"
    );
    // A warm increment (the key's slots remembered on every copy): at the
    // primary, the observation (the lock's CAS with the windows, then the
    // value) and the commit (the block's WRITE, the CAS and the release in
    // one batch); at each backup, its windows with its hinted block, then
    // its CAS: 7 round trips, 5 waits (9 and 7 when the commit's WRITE,
    // CAS and release went in batches of their own).
    let warm = key_of(&kv, 0, "hotcount");
    for _ in 0..3 {
        kv.incr(&warm, 1).expect("increment");
    }
    let (warm_trips, warm_waits) = (0..5)
        .map(|_| {
            let at = kv.verb_stats();
            kv.incr(&warm, 1).expect("increment");
            let used = kv.verb_stats().since(&at);
            (used.round_trips, used.waits)
        })
        .min()
        .expect("five increments");
    assert!(
        warm_trips <= 7 && warm_waits <= 5,
        "a warm increment at R=3 took {warm_trips} round trips, {warm_waits} waits"
    );
    let mut groups = copies(&url);
    for key in &written {
        let value = assert_alike(&mut groups, &kv, key);
        assert!(
            matches!(value.as_deref(), Some(b"v" | b"5")),
            "{key}: {value:?}"
        );
    }
}

#[test]
fn a_write_right_after_a_read_of_its_key_reads_nothing_more_at_the_primary() {
    // A longer deadline (within what the members' 2 s leases allow: a read
    // lease ends two deadlines before its member's may): a GET's read
    // stays in time for 300 ms, a copy settles (its updates then go blind
    // at the backups) 900 ms after it appeared.
    let (_etcd, url, _dir, _members) = start_with("rmw", &["--op-deadline-ms", "300"], &[]);
    let mut kv = ClusterClient::connect(&url).expect("connect");
    let (k, other) = (key_of(&kv, 0, "rmw"), key_of(&kv, 0, "other"));
    kv.put(&other, "x").expect("put");
    kv.put(&k, "a").expect("put");
    // Round trips of a write of `k` right after a read of `read`.
    let write_after = |kv: &mut ClusterClient, read: &str, value: &str| {
        kv.get(read).expect("get");
        let at = kv.verb_stats().round_trips;
        kv.put(&k, value).expect("put");
        kv.verb_stats().round_trips - at
    };
    // Pairs of writes, each after a read of another key, then of its own:
    // the same at the backups; at the primary, the read's sighting is the
    // observation (no read of the key), then the block and the CAS. A
    // stall past a deadline, or a copy settling between the two, changes a
    // pair: one pair in five must show it.
    let pairs: Vec<(u64, u64)> = (0..5)
        .map(|i| {
            let after_another = write_after(&mut kv, &other, "b");
            let after_its_own = write_after(&mut kv, &k, &format!("c{i}"));
            (after_its_own, after_another)
        })
        .collect();
    assert!(
        pairs.iter().any(|&(own, another)| own + 1 == another),
        "round trips of writes after a read of the key, and of another: {pairs:?}"
    );
    let mut groups = copies(&url);
    assert_eq!(
        assert_alike(&mut groups, &kv, &k).as_deref(),
        Some(&b"c4"[..])
    );
}

/// A write to a replicated shard has a batch in flight on every backup at
/// once, waited for together: a round trip of each counts as one wait
/// (`VerbStats::waits`). Once the key's hints have settled (every copy
/// then updated by a blind CAS, see kv-client's `hint`), an update waits
/// twice: for both backups' blocks and CASes, then for the primary's. An
/// insert waits three times: for the primary's lock and observation
/// together with both backups' blocks and windows, for the backups'
/// CASes, then for the primary's commit, the lock let go in its batch. A
/// delete removes the key from both backups together, too.
#[test]
fn every_copys_batch_is_in_flight_at_once_and_a_settled_update_waits_twice() {
    // As in the test above: a read stays in time for 300 ms, hints live
    // 600 ms and settle 900 ms after the copy appeared.
    let (_etcd, url, _dir, _members) = start_with("together", &["--op-deadline-ms", "300"], &[]);
    let mut kv = ClusterClient::connect(&url).expect("connect");
    let fresh: Vec<String> = (0..8)
        .map(|i| key_of(&kv, 0, &format!("fresh{i}-")))
        .collect();
    let k = key_of(&kv, 0, "together");
    let mut write = |key: &str, value: &str| {
        let at = kv.verb_stats();
        kv.put(key, value).expect("put");
        kv.verb_stats().since(&at)
    };
    // Three waits, for six round trips at least; more where another key's
    // slot shows a key's fingerprint (its head is read too).
    let inserts: Vec<_> = fresh.iter().map(|key| write(key, "v0")).collect();
    assert!(
        inserts.iter().all(|s| s.waits + 3 <= s.round_trips),
        "{inserts:?}"
    );
    assert_eq!(
        inserts.iter().map(|s| s.waits).min(),
        Some(3),
        "{inserts:?}"
    );
    let mut write = |value: &str| write(&k, value);
    let insert = write("v0");
    assert!(insert.waits + 3 <= insert.round_trips, "{insert:?}");
    // Updates 100 ms apart, each within its hints' life, until one finds
    // every copy's hint settled: three round trips in all, one per copy.
    let mut settled = None;
    let give_up = Instant::now() + Duration::from_secs(20);
    for i in 1.. {
        std::thread::sleep(Duration::from_millis(100));
        let used = write(&format!("v{i}"));
        assert!(used.waits < used.round_trips, "update {i}: {used:?}");
        if used.round_trips == 3 {
            settled = Some(used);
            break;
        }
        if Instant::now() > give_up {
            break;
        }
    }
    let settled = settled.expect("an update of settled hints within 20 s");
    assert_eq!(settled.waits, 2, "{settled:?}");
    let mut groups = copies(&url);
    assert!(assert_alike(&mut groups, &kv, &k).is_some());
    // Each backup's removal (a blind CAS; or its reads, then its CAS) runs
    // beside the other's: at least their first round trips are waited for
    // together. One after the other, a delete waits for every round trip.
    for key in fresh.iter().chain([&k]) {
        let at = kv.verb_stats();
        assert!(kv.delete(key).expect("delete"), "{key} was there");
        let used = kv.verb_stats().since(&at);
        assert!(used.waits < used.round_trips, "delete of {key}: {used:?}");
        assert_eq!(assert_alike(&mut groups, &kv, key), None, "{key}");
    }
}

/// A PUT of a key its client has not seen begins its backups' PUTs (the
/// blocks and the windows' READs) before it observes the key at the
/// primary. Stalled right there (`kv put` paused by `ONEKV_CLIENT_PAUSE`)
/// while another client inserts the key and commits, it must act on the
/// backups as they are once it observed, not as it read them. Here the
/// other insert takes a lower slot than the one the stalled writer read as
/// the key's (a filler held it, and was deleted meanwhile): acting on its
/// early read, the stalled writer would insert a second copy above it,
/// find the other's lower and remove its own (see `dedup`), then commit
/// its value at the primary, the backups keeping the other's.
#[test]
fn a_put_stalled_after_reading_its_backups_early_leaves_every_copy_alike() {
    // The stalled writer's reads stay in time across its pause (200 ms of
    // a 300 ms deadline), so that nothing but the rule keeps it from
    // acting on them.
    let (_etcd, url, _dir, _members) = start_with("early", &["--op-deadline-ms", "300"], &[]);
    let mut kv = ClusterClient::connect(&url).expect("connect");
    let mut groups = copies(&url);
    let key = key_of(&kv, 0, "early");
    // A key of the same shard whose first window of buckets is the key's
    // on every copy: with the buckets around empty, an insert of either
    // takes the first slot of that window's first bucket.
    let buckets: Vec<u64> = groups[0]
        .iter()
        .map(|(_, copy)| copy.geometry().bucket_count)
        .collect();
    let first_window = |k: &str, n: u64| KeyHash::new(k.as_bytes(), n).windows[0];
    let filler = (0..)
        .map(|i| format!("filler{i}"))
        .find(|f| {
            kv.shard_of(f) == 0
                && buckets
                    .iter()
                    .all(|&n| first_window(f, n) == first_window(&key, n))
        })
        .expect("a filler");
    kv.put(&filler, "filler").expect("put the filler");
    let (mut child, mut lines) = paused_kv(
        &url,
        &["put", &key, "stalled"],
        &[("ONEKV_CLIENT_PAUSE", "replica-backups-begun:200")],
    );
    pausing(&mut lines, "replica-backups-begun");
    // While it sleeps, having read the filler where the key would go.
    assert!(kv.delete(&filler).expect("delete the filler"));
    kv.put(&key, "first").expect("put");
    let rest: Vec<String> = lines.map_while(std::result::Result::ok).collect();
    let status = child.wait().expect("wait for kv");
    assert!(status.success(), "kv put: {}", rest.join("\n"));
    let value = assert_alike(&mut groups, &kv, &key);
    assert!(
        matches!(value.as_deref(), Some(b"stalled" | b"first")),
        "{value:?}"
    );
}

/// A key of `shard`, named from `prefix`.
fn key_of(kv: &ClusterClient, shard: u32, prefix: &str) -> String {
    (0..)
        .map(|i| format!("{prefix}{i}"))
        .find(|k| kv.shard_of(k) == shard)
        .expect("a key of the shard")
}

/// Keys of shard 0 that writers killed between its backups leave apart,
/// the primary (which readers read) as before: `k` old at the first
/// backup, new at the last; `fresh` at the first only; `gone` at the last
/// only.
fn leave_copies_apart(url: &str, kv: &mut ClusterClient) -> [String; 3] {
    let (k, fresh, gone) = (
        key_of(kv, 0, "k"),
        key_of(kv, 0, "fresh"),
        key_of(kv, 0, "gone"),
    );
    kv.put(&k, "old").expect("put");
    kv.put(&gone, "here").expect("put");
    killed_kv(url, &["put", &k, "new"]);
    killed_kv_at(url, "replica-first-backup-set", &["put", &k, "old"]);
    killed_kv_at(url, "replica-first-backup-set", &["put", &fresh, "lost"]);
    killed_kv_at(url, "replica-first-backup-set", &["del", &gone]);
    let mut groups = copies(url);
    let apart = |groups: &mut [Vec<(String, Client)>], key: &str| {
        let values = values_of(groups, kv, key);
        values
            .iter()
            .map(|v| {
                v.as_deref()
                    .map(|v| String::from_utf8_lossy(v).into_owned())
            })
            .collect::<Vec<_>>()
    };
    let some = |v: &str| Some(v.to_string());
    assert_eq!(
        apart(&mut groups, &k),
        [some("old"), some("old"), some("new")]
    );
    assert_eq!(apart(&mut groups, &fresh), [None, some("lost"), None]);
    assert_eq!(
        apart(&mut groups, &gone),
        [some("here"), None, some("here")]
    );
    [k, fresh, gone]
}

#[test]
fn a_failover_keeps_the_other_backup_and_levels_it_before_it_may_be_promoted() {
    let (_etcd, url, _dir, members) = start("levelled");
    let mut members = by_name(members);
    let old = cluster_state(&url).shard_map().expect("a map").clone();
    let (victim, backups) = (old.owner(0).expect("an owner"), old.backups(0));
    let (first, last) = (backups[0].clone(), backups[1].clone());
    let mut kv = ClusterClient::connect(&url).expect("connect");
    let [k, fresh, gone] = leave_copies_apart(&url, &mut kv);
    let counted = kv.verb_stats();

    // The primary dies: the last backup leads, serving the writes in
    // flight it holds; the first stays, unlevelled until its primary's
    // member has levelled it.
    let victim = victim.to_string();
    members.remove(&victim).expect("the victim").kill_9();
    eventually("shard 0 failed over", Duration::from_secs(60), || {
        let state = cluster_state(&url);
        let map = state.shard_map().expect("a map");
        map.owner(0) == Some(last.as_str()) && map.backups(0).contains(&first)
    });
    assert_eq!(kv.get(&k).expect("get").as_deref(), Some(&b"new"[..]));
    // The client dropped its connections to the old group, and still
    // counts their verbs: `since` measures what an operation over the
    // failover used (it underflowed when the total shrank).
    let used = kv.verb_stats();
    assert!(
        used.round_trips > counted.round_trips && used.waits >= counted.waits,
        "verb counts went back over a failover: {counted:?} then {used:?}"
    );
    restored(&url, 3);
    let map = cluster_state(&url).shard_map().expect("a map").clone();
    assert_eq!(map.owner(0), Some(last.as_str()), "{map:?}");
    assert!(map.backups(0).contains(&first), "kept: {map:?}");
    let mut groups = copies(&url);
    for (key, value) in [
        (&k, Some(&b"new"[..])),
        (&fresh, None),
        (&gone, Some(b"here")),
    ] {
        assert_eq!(
            assert_alike(&mut groups, &kv, key).as_deref(),
            value,
            "{key}"
        );
    }

    // Levelled, the kept backup may lead in turn once the others are
    // gone (the copy made since first): no read goes back.
    let copy = map
        .backups(0)
        .iter()
        .find(|b| **b != first)
        .expect("a copy");
    members.remove(copy).expect("the copy").kill_9();
    eventually("the copy left the group", Duration::from_secs(60), || {
        let state = cluster_state(&url);
        !state.shard_map().expect("a map").backups(0).contains(copy)
    });
    members.remove(&last).expect("the new primary").kill_9();
    eventually(
        "shard 0 led by the levelled backup",
        Duration::from_secs(60),
        || {
            let state = cluster_state(&url);
            state.shard_map().expect("a map").owner(0) == Some(first.as_str())
        },
    );
    assert_eq!(kv.get(&k).expect("get").as_deref(), Some(&b"new"[..]));
    assert_eq!(kv.get(&gone).expect("get").as_deref(), Some(&b"here"[..]));
    assert_eq!(kv.get(&fresh).expect("get"), None);
}

/// The key and value of writer `t`'s `i`th key (`seq` its write's number).
fn own_key(t: usize, i: usize) -> String {
    format!("own-{t}-{i}")
}

/// What a writer of its own keys knows: per key, the last write answered
/// and those whose outcome it never learned; per counter, the increments
/// answered and those not.
#[derive(Default)]
struct Known {
    acked: BTreeMap<String, u64>,
    unknown: BTreeMap<String, Vec<u64>>,
    counted: i64,
    uncounted: i64,
}

/// Writes its own keys (increasing numbers, so that a reader can tell an
/// older value) and increments its counter until `stop`; an error other
/// than an unknown outcome (a write cut by the kill) fails the test.
fn own_writer(url: &str, t: usize, stop: &AtomicBool) -> Known {
    let mut kv = or_abort(ClusterClient::connect(url), "connect");
    let mut known = Known::default();
    let mut seq = 0u64;
    while !stop.load(Ordering::SeqCst) {
        for i in 0..16 {
            seq += 1;
            let key = own_key(t, i);
            match kv.put(&key, seq.to_string()) {
                Ok(()) => {
                    known.acked.insert(key, seq);
                }
                Err(Error::OutcomeUnknown(_)) => known.unknown.entry(key).or_default().push(seq),
                Err(e) => or_abort(Err(e), "put during a failover"),
            }
        }
        match kv.incr(format!("own-count-{t}"), 1) {
            Ok(_) => known.counted += 1,
            Err(Error::OutcomeUnknown(_)) => known.uncounted += 1,
            Err(e) => or_abort(Err(e), "incr during a failover"),
        }
    }
    known
}

/// `writers` of their own keys (`own_writer`) and a reader of theirs
/// (`own_reader`) at `url` in scope `s`, until `stop`.
fn load<'s>(
    s: &'s std::thread::Scope<'s, '_>,
    url: &'s str,
    writers: usize,
    stop: &'s AtomicBool,
) -> (
    Vec<std::thread::ScopedJoinHandle<'s, Known>>,
    std::thread::ScopedJoinHandle<'s, usize>,
) {
    let writing = (0..writers)
        .map(|t| s.spawn(move || own_writer(url, t, stop)))
        .collect();
    (writing, s.spawn(move || own_reader(url, writers, stop)))
}

/// Stops the load [`load`] started: what its writers know, and how many
/// reads its reader checked.
fn end_load(
    stop: &AtomicBool,
    writers: Vec<std::thread::ScopedJoinHandle<'_, Known>>,
    reader: std::thread::ScopedJoinHandle<'_, usize>,
) -> (Vec<Known>, usize) {
    stop.store(true, Ordering::SeqCst);
    let known = writers
        .into_iter()
        .map(|w| w.join().expect("writer"))
        .collect();
    (known, reader.join().expect("reader"))
}

/// Reads writer `t`'s keys until `stop`: a key's number never goes down
/// (each key has one writer, whose numbers grow), across the failover too.
fn own_reader(url: &str, writers: usize, stop: &AtomicBool) -> usize {
    let mut kv = or_abort(ClusterClient::connect(url), "connect");
    let mut seen: BTreeMap<String, u64> = BTreeMap::new();
    let mut reads = 0;
    while !stop.load(Ordering::SeqCst) {
        for t in 0..writers {
            for i in 0..16 {
                let key = own_key(t, i);
                let Some(v) = or_abort(kv.get(&key), "get during a failover") else {
                    continue;
                };
                let n: u64 = or_abort(
                    String::from_utf8_lossy(&v)
                        .parse()
                        .map_err(|e| format!("{e}")),
                    "a number",
                );
                let last = seen.entry(key.clone()).or_default();
                if n < *last {
                    or_abort::<(), _>(Err(format!("{key} went back from {last} to {n}")), "read");
                }
                *last = n;
                reads += 1;
            }
        }
    }
    reads
}

/// Index of member `id` in MEMBERS (and in `start`'s daemons).
fn member_index(id: &str) -> usize {
    MEMBERS
        .iter()
        .position(|(m, _)| *m == id)
        .expect("a member")
}

/// Kills (`kill -9`) under load, with two writers of their own keys and
/// counters and a reader that checks no value goes back: a primary, whose
/// shards fail over and whose copies are then restored at the others; it
/// comes back and deletes its old copies (the map gives it none); then a
/// second server, whose copies the first is given, and while one of them
/// is being made, the copy's source. Every acknowledged write is kept
/// throughout, and the copies end alike.
#[test]
fn killed_primaries_fail_over_and_their_copies_are_restored_with_every_acknowledged_write() {
    // Each copy lasts a second at least, so that one can be killed while
    // under way.
    let (_etcd, url, dir, members) = start_with("failover", &[], &[("ONEKV_MOVE_PAUSE", "1000")]);
    let mut members = by_name(members);
    let before = cluster_state(&url);
    let old = before.shard_map().expect("a map").clone();
    let victim = old.owner(0).expect("an owner").to_string();
    let led: Vec<u32> = old.shards_of(&victim).collect();
    let held = copy_files(dir.path(), &victim, &old);
    let mut kv = ClusterClient::connect(&url).expect("connect");
    let probe = (0..)
        .map(|i| format!("probe{i}"))
        .find(|k| led.contains(&kv.shard_of(k)))
        .expect("a key of a shard the victim leads");
    kv.put(&probe, "before").expect("put");

    const WRITERS: usize = 2;
    let stop = AtomicBool::new(false);
    let (known, reads) = std::thread::scope(|s| {
        let (writers, reader) = load(s, &url, WRITERS, &stop);
        std::thread::sleep(Duration::from_millis(500));
        // kill -9 under load: writes in flight at its copies are cut.
        members.remove(&victim).expect("the victim").kill_9();
        let killed_at = Instant::now();
        eventually("shard 0 failed over", Duration::from_secs(60), || {
            cluster_state(&url)
                .shard_map()
                .is_some_and(|m| m.owner(0) != Some(victim.as_str()))
        });
        let mapped = killed_at.elapsed();
        // Its old primary's keys are revoked (shm) or gone with it (rdma):
        // the put finds the new primary, waiting for it to open.
        kv.put(&probe, "after").expect("a put once failed over");
        let served = killed_at.elapsed();
        // The three left span the three zones: every group is whole again.
        restored(&url, 3);
        assert_failed_over(&url, &old, &victim);
        eprintln!(
            "failover: the map {mapped:?} after the kill, a write served {served:?} after it \
             (lease TTL 2 s); every copy restored {:?} after it",
            killed_at.elapsed()
        );
        let status = cluster_status(&url);
        assert!(!status.contains("short of copies"), "{status}");

        // The killed server comes back: it serves none of its old copies
        // (the map, whole without it, gives it none) and deletes them.
        let zone = MEMBERS[member_index(&victim)].1;
        members.insert(
            victim.clone(),
            start_member(&url, dir.path(), &victim, &["--zone", zone]),
        );
        copies_deleted(&held);
        let back = cluster_state(&url);
        assert!(back.member(&victim).is_some(), "it joined again");
        let map = back.shard_map().expect("a map");
        assert_eq!(map.copies_of(&victim).count(), 0);

        kill_the_zone_mate_then_a_copy_source(&url, &mut members, &victim, zone);
        // Left: the one that came back and one other, in two zones.
        restored(&url, 2);
        std::thread::sleep(Duration::from_millis(500));
        end_load(&stop, writers, reader)
    });
    eprintln!("{reads} reads never went back");
    assert!(reads > 0);

    assert_eq!(kv.get(&probe).expect("get").as_deref(), Some(&b"after"[..]));
    assert_each_acknowledged_write_kept(&mut kv, &known);
    assert_copies_alike(&url, &mut kv, WRITERS);
}

/// Three servers, each holding every shard (as many servers as copies):
/// one that led is killed (`kill -9`) under load, its leads fail over to
/// the other two, and started again it gets its copies back, taking its
/// share of the leads with them (no copy could carry a lead elsewhere:
/// every server holds every shard). Every acknowledged write is kept, no
/// read goes back, and the copies end alike.
#[test]
fn a_server_back_after_a_failover_takes_its_share_of_the_leads_again() {
    let etcd = EtcdServer::start();
    let url = etcd.url("leadsback");
    let dir = region_dir();
    create_cluster_with(&url, SHARDS, 3, &["--replicas", "3"]);
    let mut members: BTreeMap<String, Daemon> = ["m0", "m1", "m2"]
        .into_iter()
        .map(|m| (m.to_string(), start_member(&url, dir.path(), m, &[])))
        .collect();
    let warm = || -> Result<(), Error> {
        let mut kv = ClusterClient::connect(&url)?;
        (0..SHARDS * 8).try_for_each(|i| kv.put(format!("warm{i}"), b"w"))
    };
    eventually_ok("every copy served", Duration::from_secs(120), warm, || {
        cluster_status(&url)
    });
    let leads = |id: &str| {
        let state = cluster_state(&url);
        state.shard_map().map_or(0, |m| m.shards_of(id).count())
    };
    let victim = cluster_state(&url)
        .shard_map()
        .and_then(|m| m.owner(0))
        .expect("an owner")
        .to_string();

    const WRITERS: usize = 2;
    let stop = AtomicBool::new(false);
    let (known, reads) = std::thread::scope(|s| {
        let (writers, reader) = load(s, &url, WRITERS, &stop);
        std::thread::sleep(Duration::from_millis(500));
        members.remove(&victim).expect("the victim").kill_9();
        eventually("its leads failed over", Duration::from_secs(60), || {
            cluster_state(&url).member(&victim).is_none() && leads(&victim) == 0
        });
        members.insert(victim.clone(), start_member(&url, dir.path(), &victim, &[]));
        restored(&url, 3);
        std::thread::sleep(Duration::from_millis(500));
        end_load(&stop, writers, reader)
    });
    let map = cluster_state(&url).shard_map().expect("a map").clone();
    for m in ["m0", "m1", "m2"] {
        // Four shards over three: each leads one or two.
        let led = map.shards_of(m).count();
        assert!((1..=2).contains(&led), "{m} leads {led}: {map:?}");
    }
    assert!(reads > 0);
    let mut kv = ClusterClient::connect(&url).expect("connect");
    assert_each_acknowledged_write_kept(&mut kv, &known);
    assert_copies_alike(&url, &mut kv, WRITERS);
}

/// The fewest copies any shard has in the map at `url`.
fn fewest_copies(url: &str) -> usize {
    let state = cluster_state(url);
    let map = state.shard_map().expect("a map");
    (0..SHARDS)
        .map(|s| map.owner(s).iter().count() + map.backups(s).len())
        .min()
        .unwrap_or(0)
}

/// Whether the map at `url` has no copy under way and its live members
/// hold as many copies as each other, give or take one.
fn balanced(url: &str) -> bool {
    let state = cluster_state(url);
    let map = state.shard_map().expect("a map");
    let held: Vec<usize> = state
        .members
        .iter()
        .map(|m| map.copies_of(&m.id).count())
        .collect();
    let (most, least) = (held.iter().max(), held.iter().min());
    map.moving.is_none() && most.zip(least).is_some_and(|(m, l)| m - l <= 1)
}

/// Stops member `id` with a signal, as an operator would; its log once it
/// has left, which it did by itself, drained.
fn drain(members: &mut BTreeMap<String, Daemon>, id: &str) -> String {
    let member = members.remove(id).expect("a member");
    member.signal(libc::SIGTERM);
    let (status, log) = member.wait_exit(Duration::from_secs(240));
    assert!(status.success(), "{log}");
    assert!(log.contains("draining"), "{log}");
    assert!(!log.contains("leaving without a drain"), "{log}");
    assert!(!log.contains("leaving before the drain finished"), "{log}");
    log
}

/// Starts m4 in a zone of its own; returns once it holds copies and the
/// copies are balanced.
fn join_until_balanced(url: &str, dir: &std::path::Path, members: &mut BTreeMap<String, Daemon>) {
    let joined = Instant::now();
    members.insert("m4".into(), start_member(url, dir, "m4", &["--zone", "d"]));
    eventually("the copies balanced", Duration::from_secs(120), || {
        let state = cluster_state(url);
        let took = state
            .shard_map()
            .is_some_and(|m| m.copies_of("m4").next().is_some());
        took && balanced(url)
    });
    eprintln!("m4 took its share under load in {:?}", joined.elapsed());
}

/// Drains a member other than m4 that leads a shard (so one handover at
/// least); returns once its copies are deleted and the rest balanced.
fn drain_a_leader(url: &str, dir: &std::path::Path, members: &mut BTreeMap<String, Daemon>) {
    let map = cluster_state(url).shard_map().expect("a map").clone();
    let leaving = map
        .owners
        .iter()
        .flatten()
        .find(|o| o.as_str() != "m4")
        .expect("a leader")
        .clone();
    let held = copy_files(dir, &leaving, &map);
    let started = Instant::now();
    let log = drain(members, &leaving);
    assert!(
        log.contains("moved to"),
        "a shard it led handed over: {log}"
    );
    eprintln!("{leaving} drained under load in {:?}", started.elapsed());
    copies_deleted(&held);
    eventually("the copies balanced", Duration::from_secs(120), || {
        balanced(url)
    });
}

/// Under load, with two writers of their own keys and counters and a
/// reader that checks no value goes back, and a thousand keys written
/// before: a member that joins takes its share of the copies, each a
/// fresh copy replacing one of a member that holds more; then a stop
/// signal drains a member, each of its copies replaced at another, a
/// shard it led handed over to the new copy with the same backups. No
/// shard ever has fewer than three copies (nothing fails over); the
/// drained member deletes its copies; every acknowledged write is kept,
/// and the copies end alike. With three servers left, a stop signal
/// cannot drain (a replacement needs a server outside the group): it
/// leaves at once.
#[test]
fn members_join_and_drain_a_replicated_cluster_online_without_a_failover() {
    let (_etcd, url, dir, members) = start("drain");
    let mut members = by_name(members);
    let mut kv = ClusterClient::connect(&url).expect("connect");
    for i in 0..1000 {
        kv.put(format!("before{i}"), format!("v{i}")).expect("put");
    }

    const WRITERS: usize = 2;
    let (stop, watched) = (AtomicBool::new(false), AtomicBool::new(false));
    let (known, reads, fewest) = std::thread::scope(|s| {
        let (writers, reader) = load(s, &url, WRITERS, &stop);
        // The fewest copies a shard had in any map seen meanwhile.
        let watcher = s.spawn(|| {
            let mut fewest = usize::MAX;
            while !watched.load(Ordering::SeqCst) {
                fewest = fewest.min(fewest_copies(&url));
                std::thread::sleep(Duration::from_millis(50));
            }
            fewest
        });
        std::thread::sleep(Duration::from_millis(300));
        join_until_balanced(&url, dir.path(), &mut members);
        drain_a_leader(&url, dir.path(), &mut members);
        std::thread::sleep(Duration::from_millis(300));
        watched.store(true, Ordering::SeqCst);
        let (known, reads) = end_load(&stop, writers, reader);
        (known, reads, watcher.join().expect("watcher"))
    });
    assert_eq!(fewest, 3, "a shard had fewer copies meanwhile");
    eprintln!("{reads} reads never went back");
    assert!(reads > 0);
    let state = cluster_state(&url);
    let map = state.shard_map().expect("a map");
    for m in &state.members {
        assert!(map.copies_of(&m.id).count() > 0, "{}: {map:?}", m.id);
    }
    for i in 0..1000 {
        let v = kv.get(format!("before{i}")).expect("get");
        assert_eq!(v, Some(format!("v{i}").into_bytes()));
    }
    assert_each_acknowledged_write_kept(&mut kv, &known);
    assert_copies_alike(&url, &mut kv, WRITERS);

    // Four left: one more drains; then three servers for three copies,
    // and nowhere to put a replacement.
    let next = members.keys().next().expect("a member").clone();
    drain(&mut members, &next);
    let last = members.keys().next().expect("a member").clone();
    let member = members.remove(&last).expect("a member");
    member.signal(libc::SIGTERM);
    let (status, log) = member.wait_exit(Duration::from_secs(60));
    assert!(status.success(), "{log}");
    assert!(log.contains("leaving without a drain"), "{log}");
}

/// The copies made since the cluster at `url` started hold what was
/// written before them, and one more write of each of `writers`' keys
/// leaves every copy alike.
fn assert_copies_alike(url: &str, kv: &mut ClusterClient, writers: usize) {
    let mut groups = copies(url);
    for i in 0..SHARDS * 8 {
        let warm = assert_alike_following(url, &mut groups, kv, &format!("warm{i}"));
        assert_eq!(warm.as_deref(), Some(&b"w"[..]));
    }
    for t in 0..writers {
        for i in 0..16 {
            let key = own_key(t, i);
            kv.put(&key, "last").expect("put");
            assert_eq!(
                assert_alike_following(url, &mut groups, kv, &key).as_deref(),
                Some(&b"last"[..])
            );
        }
    }
}

/// Kills the other member of `victim`'s zone (`victim` is back, empty):
/// its copies are made again at `victim`, and during one of them, its
/// source is killed too.
fn kill_the_zone_mate_then_a_copy_source(
    url: &str,
    members: &mut BTreeMap<String, Daemon>,
    victim: &str,
    zone: &str,
) {
    let map = cluster_state(url).shard_map().expect("a map").clone();
    // The other server of its zone goes: its copies are made again at
    // the one that came back, and during one of them, its source goes
    // (a source with a backup level with it: a shard failed over is led
    // by its last backup, the other unlevelled until that primary's
    // member has levelled it, and a copy of it has no other to go on
    // from before that).
    let second = MEMBERS
        .iter()
        .find(|(m, z)| *z == zone && *m != victim)
        .map(|(m, _)| m.to_string())
        .expect("a second server in the zone");
    assert!(map.shards_of(&second).next().is_some(), "{second} leads");
    members.remove(&second).expect("the second").kill_9();
    let mut copying = None;
    eventually("a copy under way", Duration::from_secs(60), || {
        let state = cluster_state(url);
        let map = state.shard_map().expect("a map");
        let m = map.moving.as_ref();
        // Every shard the source leads has another copy to fail over to,
        // level with it (a copy to a shard led alone may have failed and
        // be held back while this one runs).
        let backed = |o: &str| {
            (0..SHARDS).all(|s| {
                let promotable = |b: &String| !map.unlevelled(s).contains(b);
                map.owner(s) != Some(o) || map.backups(s).iter().any(promotable)
            })
        };
        let source = m
            .and_then(|m| map.owner(m.shard))
            .filter(|o| *o != second && backed(o));
        copying = source.zip(m).map(|(o, m)| (o.to_string(), m.clone()));
        copying.is_some()
    });
    let (third, m) = copying.expect("a copy");
    members.remove(&third).expect("the copy's source").kill_9();
    let map = cluster_state(url).shard_map().expect("a map").clone();
    assert_eq!(
        map.moving.as_ref(),
        Some(&m),
        "the copy ended before the kill"
    );
    eprintln!(
        "killed {third}, the source of a copy of shard {} to {}",
        m.shard, m.to
    );
}

/// Waits until every shard of the cluster at `url` has `copies` copies,
/// each level with its primary, and no copy is under way.
fn restored(url: &str, copies: usize) {
    eventually("every group restored", Duration::from_secs(120), || {
        let state = cluster_state(url);
        let map = state.shard_map().expect("a map");
        map.moving.is_none()
            && map.unlevelled.is_empty()
            && (0..SHARDS).all(|s| {
                let live = |id: &str| state.member(id).is_some();
                map.owner(s).is_some_and(live)
                    && map.backups(s).iter().all(|b| live(b))
                    && 1 + map.backups(s).len() == copies
            })
    });
}

/// The map after `victim` failed over from `old`: it is in no group;
/// each shard it led is led by its last backup, under a new group epoch,
/// whose copies turn away a client that routes by the old group.
fn assert_failed_over(url: &str, old: &ShardMap, victim: &str) {
    let after = cluster_state(url);
    let map = after.shard_map().expect("a map");
    assert_eq!(map.copies_of(victim).count(), 0, "{map:?}");
    for shard in old.shards_of(victim) {
        let last_backup = old.backups(shard).last().expect("a backup");
        assert_eq!(
            map.owner(shard),
            Some(last_backup.as_str()),
            "shard {shard}"
        );
        assert!(map.group_epoch(shard) > old.epoch, "shard {shard}: {map:?}");
        let at = copy_address(&after, last_backup, shard).expect("its address");
        let stale = Client::connect(&at);
        assert!(
            matches!(stale, Err(Error::Refused(_))),
            "shard {shard}: {:?}",
            stale.err()
        );
    }
}

/// Member `id`'s region files in `dir` of the shards it holds copies of
/// in `map`, each with its inode.
fn copy_files(dir: &std::path::Path, id: &str, map: &ShardMap) -> Vec<(std::path::PathBuf, u64)> {
    use std::os::unix::fs::MetadataExt;
    map.copies_of(id)
        .map(|s| dir.join(format!("{id}.shard-{s}")))
        .map(|path| {
            let inode = std::fs::metadata(&path).expect("a copy's region").ino();
            (path, inode)
        })
        .collect()
}

/// Waits until each of `files` (a member's old copies) is gone: deleted,
/// or made anew for a copy made since.
fn copies_deleted(files: &[(std::path::PathBuf, u64)]) {
    use std::os::unix::fs::MetadataExt;
    eventually("the old copies deleted", Duration::from_secs(60), || {
        files
            .iter()
            .all(|(path, inode)| std::fs::metadata(path).map_or(true, |m| m.ino() != *inode))
    });
}

/// Every write the writers were answered is there; beyond it, at most a
/// write whose writer never learned its outcome.
fn assert_each_acknowledged_write_kept(kv: &mut ClusterClient, known: &[Known]) {
    for (t, k) in known.iter().enumerate() {
        for i in 0..16 {
            let key = own_key(t, i);
            // None: no write of the key was answered (its first one may
            // be unknown, and then absent).
            let acked = k.acked.get(&key).copied();
            let v = kv.get(&key).expect("get").map(|v| {
                String::from_utf8_lossy(&v)
                    .parse::<u64>()
                    .expect("a number")
            });
            let unknown = k.unknown.get(&key).cloned().unwrap_or_default();
            let later = |v: u64| acked.is_none_or(|a| v > a) && unknown.contains(&v);
            let fine = v == acked || v.is_some_and(later);
            assert!(
                fine,
                "{key}: {v:?}, acknowledged {acked:?}, unknown {unknown:?}"
            );
        }
        let count = kv
            .get_counter(format!("own-count-{t}"))
            .expect("get_counter")
            .unwrap_or(0);
        assert!(
            (k.counted..=k.counted + k.uncounted).contains(&count),
            "own-count-{t}: {count}, {} answered, {} unknown",
            k.counted,
            k.uncounted
        );
    }
}

/// A primary frozen (SIGSTOP) past its lease: its shards fail over, the
/// new primary's server revokes every key of the frozen one's region (on
/// shm, one host, it can), so a client that still routes by the old map
/// reads nothing stale there; woken, the frozen server admits nobody (its
/// lease has passed), finds its lease gone, stops and deletes its old
/// copies.
#[test]
fn a_frozen_primary_is_fenced_and_drops_its_copies_when_it_wakes() {
    let (_etcd, url, dir, members) = start("frozen");
    let state = cluster_state(&url);
    let old = state.shard_map().expect("a map").clone();
    let victim = old.owner(1).expect("an owner").to_string();
    let mut kv = ClusterClient::connect(&url).expect("connect");
    let key = (0..)
        .map(|i| format!("frozen{i}"))
        .find(|k| kv.shard_of(k) == 1)
        .expect("a key of shard 1");
    kv.put(&key, "before").expect("put");
    let at = copy_address(&state, &victim, 1).expect("its address");
    let mut stale = Client::connect(&at).expect("connect to the old primary");
    assert_eq!(
        stale.get(&key).expect("get").as_deref(),
        Some(&b"before"[..])
    );

    let held = copy_files(dir.path(), &victim, &old);
    let daemon = &members[member_index(&victim)];
    daemon.signal(libc::SIGSTOP);
    eventually("shard 1 failed over", Duration::from_secs(60), || {
        cluster_state(&url)
            .shard_map()
            .is_some_and(|m| m.owner(1) != Some(victim.as_str()))
    });
    kv.put(&key, "after").expect("a put at the new primary");
    // Over shm the new primary's member revoked the old region; over rdma
    // its registration lives on, but the client's read lease has run out
    // and the frozen server renews none.
    let read = stale.get(&key);
    assert!(
        read.is_err(),
        "the frozen primary's region still serves: {read:?}"
    );

    // A client that connects to the frozen server (a stale client's
    // reconnect) waits in its queue; woken, the server refuses it before
    // its own loop has noticed anything: its lease has passed.
    let queued = std::thread::spawn({
        let (at, key) = (at.clone(), key.clone());
        move || Client::connect(&at).and_then(|mut c| c.get(&key))
    });
    std::thread::sleep(Duration::from_millis(300));
    daemon.signal(libc::SIGCONT);
    let got = queued.join().expect("the queued client");
    assert!(got.is_err(), "the woken server admitted a client: {got:?}");
    copies_deleted(&held);
    assert!(
        Client::connect(&at).is_err(),
        "it serves its old copy again"
    );
    assert_eq!(kv.get(&key).expect("get").as_deref(), Some(&b"after"[..]));
}

/// A client busy at a primary when it freezes (SIGSTOP) follows the
/// failover without waiting out its reply timeout (a minute here): a
/// control call at the frozen server (a report, a chunk lease, its read
/// lease's renewal) gives up within seconds, and its reconnect there after
/// a moment, so it goes back to the map and finds the new primary within
/// seconds of the failover.
#[test]
fn a_client_busy_at_a_frozen_primary_follows_its_failover() {
    let (_etcd, url, _dir, members) = start("busyfrozen");
    let victim = cluster_state(&url)
        .shard_map()
        .and_then(|m| m.owner(1))
        .expect("an owner")
        .to_string();
    let stop = AtomicBool::new(false);
    let last_done = Mutex::new(Instant::now());
    let daemon = &members[member_index(&victim)];
    let stalled = std::thread::scope(|s| {
        let writer = s.spawn(|| {
            let options = ClientOptions::default().with_reply_timeout(Duration::from_secs(60));
            let mut kv = or_abort(ClusterClient::connect_with(&url, options), "connect");
            let key = key_of(&kv, 1, "busy");
            let mut longest = Duration::ZERO;
            for i in 0u64.. {
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                let started = Instant::now();
                // One may fail through the failover (its outcome unknown,
                // the shard unavailable for a while): it is timed all the same.
                let done = kv.put(&key, i.to_le_bytes()).and_then(|()| kv.get(&key));
                longest = longest.max(started.elapsed());
                if done.is_ok() {
                    *last_done.lock().expect("lock") = Instant::now();
                }
            }
            longest
        });
        std::thread::sleep(Duration::from_millis(500));
        daemon.signal(libc::SIGSTOP);
        eventually("shard 1 failed over", Duration::from_secs(60), || {
            cluster_state(&url)
                .shard_map()
                .is_some_and(|m| m.owner(1) != Some(victim.as_str()))
        });
        let failed_over = Instant::now();
        eventually("the writer goes on", Duration::from_secs(90), || {
            *last_done.lock().expect("lock") > failed_over
        });
        stop.store(true, Ordering::SeqCst);
        writer.join().expect("the writer")
    });
    daemon.signal(libc::SIGCONT);
    eprintln!("the longest operation took {stalled:?}");
    // The longest operation spans the freeze: the lease (¾ of the 2 s TTL)
    // and the failover, and a few reconnects; not the reply timeout.
    assert!(
        stalled < Duration::from_secs(30),
        "an operation waited {stalled:?} on the frozen primary"
    );
}

/// Puts `key` = "value" through the cluster at `url` and reads it back
/// from the primary's copy directly: the map, the primary's id, and that
/// client of its copy.
fn put_and_read_at_the_primary(url: &str, key: &str) -> (ShardMap, String, Client) {
    let state = cluster_state(url);
    let map = state.shard_map().expect("a map").clone();
    let mut kv = ClusterClient::connect(url).expect("connect");
    kv.put(key, "value").expect("put");
    let shard = kv.shard_of(key);
    let primary = map.owner(shard).expect("an owner").to_string();
    let at = copy_address(&state, &primary, shard).expect("its address");
    let mut direct = Client::connect(&at).expect("connect to the primary's copy");
    assert_eq!(
        direct.get(key).expect("get").as_deref(),
        Some(&b"value"[..])
    );
    (map, primary, direct)
}

/// A copy serves reads only for a lease its server renews: a primary
/// frozen (SIGSTOP) while etcd is down, so that nothing fails it over and
/// nobody revokes its region, stops serving a connected client once the
/// lease runs out, though its region is still mapped (shm) or registered
/// (rdma); woken, with etcd back, it serves that client again.
#[test]
fn a_frozen_primary_serves_no_read_past_its_read_lease() {
    let (mut etcd, url, _dir, members) = start("readlease");
    let (map, primary, mut direct) = put_and_read_at_the_primary(&url, "leased");
    let value = Some(&b"value"[..]);

    let daemon = &members[member_index(&primary)];
    daemon.signal(libc::SIGSTOP);
    let stopped = Instant::now();
    etcd.kill();
    // The last read served ends within the lease the member held when it
    // froze: ¾ of the members' 2 s TTL from a renewal sent before then.
    let mut last_served = stopped;
    eventually(
        "reads at the frozen copy stop",
        Duration::from_secs(90),
        || {
            let served = direct.get("leased").is_ok();
            if served {
                last_served = Instant::now();
            }
            !served
        },
    );
    let served_for = last_served - stopped;
    assert!(
        served_for < Duration::from_millis(1500),
        "the frozen copy served reads for {served_for:?}"
    );

    daemon.signal(libc::SIGCONT);
    etcd.start_again();
    eventually("the copy serves again", Duration::from_secs(60), || {
        direct.get("leased").is_ok_and(|v| v.as_deref() == value)
    });
    assert_eq!(
        cluster_state(&url).shard_map().expect("a map"),
        &map,
        "no failover: etcd was down while the primary was frozen"
    );
}

/// With copies, a server whose lease cannot be confirmed stops serving
/// them before the lease could expire (they may be failed over then): an
/// etcd outage pauses them, and they serve again, with every write, once
/// etcd is back and says the leases live (no failover happened).
#[test]
fn an_etcd_outage_pauses_the_copies_until_the_leases_are_confirmed() {
    let (mut etcd, url, _dir, _members) = start("outage");
    let (map, _, mut direct) = put_and_read_at_the_primary(&url, "kept");
    let mut kv = ClusterClient::connect(&url).expect("connect");

    etcd.kill();
    eventually("the copies stop", Duration::from_secs(30), || {
        direct.get("kept").is_err()
    });
    etcd.start_again();
    eventually("the copies serve again", Duration::from_secs(60), || {
        kv.get("kept")
            .is_ok_and(|v| v.as_deref() == Some(&b"value"[..]))
    });
    kv.put("kept", "again").expect("a put after the outage");
    assert_eq!(
        cluster_state(&url).shard_map().expect("a map"),
        &map,
        "no failover: every lease lived"
    );
}

/// An increment that stalls past its key's lock (`kv incr` paused by
/// `ONEKV_CLIENT_PAUSE`, longer than the lock lives), between its
/// observation and its backups or between two rounds of its backups'
/// steps, never sets its stale sum on a backup once other increments have
/// passed it: with increments of +1 only, no backup ever holds less than
/// the primary (what a failover relies on), and the sum counts each.
#[test]
fn a_stalled_increment_never_sets_an_older_sum_on_a_backup() {
    let (_etcd, url, _dir, _members) = start("stalled");
    for (i, pause) in ["replica-before-backups", "replica-sum-round"]
        .into_iter()
        .enumerate()
    {
        stalled_increment(&url, &format!("slow-count{i}"), pause);
    }
}

/// Increments `key` from a `kv incr` paused at `pause` while another
/// client takes the lock over and increments it three times; the paused
/// one, once its backups are set again (paused there too), must have left
/// no backup below the primary.
fn stalled_increment(url: &str, key: &str, pause: &str) {
    const FAST: i64 = 3;
    let mut kv = ClusterClient::connect(url).expect("connect");
    kv.incr(key, 1).expect("incr");
    let mut groups = copies(url);
    let pauses = format!("{pause}:1500,replica-backups-set:1000");
    let (mut child, mut lines) =
        paused_kv(url, &["incr", key, "1"], &[("ONEKV_CLIENT_PAUSE", &pauses)]);
    pausing(&mut lines, pause);
    // While it sleeps holding the lock: these wait a whole life of it (1 s
    // of its 1.5 s pause), take it over, and are done before it wakes.
    let mut other = ClusterClient::connect(url).expect("connect");
    for _ in 0..FAST {
        other.incr(key, 1).expect("incr");
    }
    pausing(&mut lines, "replica-backups-set");
    // Its backups set, before its commit: none holds less than the primary
    // (an older sum set over the three increments would).
    let values: Vec<i64> = values_of(&mut groups, &kv, key)
        .into_iter()
        .map(|v| {
            let text = v.expect("a value");
            String::from_utf8_lossy(&text).parse().expect("a number")
        })
        .collect();
    assert!(
        values[1..].iter().all(|&b| b >= values[0]),
        "{pause}: the copies, the primary's first: {values:?}"
    );
    let rest: Vec<String> = lines.map_while(std::result::Result::ok).collect();
    let status = child.wait().expect("wait for kv");
    assert!(status.success(), "kv incr: {}", rest.join("\n"));
    let total = 2 + FAST;
    assert_eq!(kv.get_counter(key).expect("get_counter"), Some(total));
    assert_eq!(
        assert_alike(&mut groups, &kv, key),
        Some(total.to_string().into_bytes())
    );
}

/// A PUT of a present key does not take the key's lock, so it may set the
/// backups and commit while an increment of the key holds the lock,
/// between the increment's observation and its sums. That increment
/// (`kv incr` paused there, and killed once its backups are set, before
/// its commit) must not set its sum, computed from the value before the
/// PUT, over the PUT's value on a backup: a failover to that backup would
/// lose the acknowledged PUT. It finds the backups holding something else
/// than what it observed, levels them and observes again, and the PUT's
/// value is no counter.
#[test]
fn an_increment_never_sets_its_sum_over_a_put_that_passed_it() {
    let (_etcd, url, _dir, _members) = start("passed");
    let mut kv = ClusterClient::connect(&url).expect("connect");
    let key = key_of(&kv, 0, "passed");
    kv.incr(&key, 1).expect("incr");
    let mut groups = copies(&url);
    // The pause is half the lock's life (20 deadlines, 1 s by default):
    // the increment wakes holding it, with its margin to spare.
    let (mut child, mut lines) = paused_kv(
        &url,
        &["incr", &key, "5"],
        &[
            ("ONEKV_CLIENT_PAUSE", "replica-before-backups:500"),
            ("ONEKV_CLIENT_FAULT", "replica-backups-set"),
        ],
    );
    pausing(&mut lines, "replica-before-backups");
    kv.put(&key, "replaced").expect("put");
    let rest: Vec<String> = lines.map_while(std::result::Result::ok).collect();
    child.wait().expect("wait for kv");
    assert_eq!(
        assert_alike(&mut groups, &kv, &key).as_deref(),
        Some(&b"replaced"[..]),
        "kv incr: {}",
        rest.join("\n")
    );
    assert!(
        rest.iter().any(|l| l.contains("not a counter")),
        "kv incr: {}",
        rest.join("\n")
    );
}

/// An increment that runs out of attempts after setting its sums on the
/// backups (`kv --max-attempts 1 incr`, paused once they are set, while a
/// PUT of the key passes it: its commit then loses) levels the backups
/// with the primary before it gives up. It is then known not to have taken
/// effect, and says it gave up under contention, not that its outcome is
/// unknown.
#[test]
fn an_increment_out_of_attempts_after_setting_its_sums_is_known_not_applied() {
    let (_etcd, url, _dir, _members) = start("gave-up");
    let mut kv = ClusterClient::connect(&url).expect("connect");
    let key = key_of(&kv, 0, "gave-up");
    kv.incr(&key, 1).expect("incr");
    let mut groups = copies(&url);
    let (mut child, mut lines) = paused_kv(
        &url,
        &["--max-attempts", "1", "incr", &key, "5"],
        &[("ONEKV_CLIENT_PAUSE", "replica-backups-set:1000")],
    );
    pausing(&mut lines, "replica-backups-set");
    kv.put(&key, "40").expect("put");
    let rest: Vec<String> = lines.map_while(std::result::Result::ok).collect();
    let status = child.wait().expect("wait for kv");
    let said = rest.join("\n");
    assert_eq!(status.code(), Some(2), "kv incr: {said}");
    assert!(
        said.contains("gave up after 1 attempts under contention")
            && !said.contains("may or may not"),
        "kv incr: {said}"
    );
    assert_eq!(
        assert_alike(&mut groups, &kv, &key).as_deref(),
        Some(&b"40"[..]),
        "kv incr: {said}"
    );
}

/// A write cut off by a copy added under the same lead, stopped at `at`.
fn cut_under_the_same_lead(name: &str, at: &str) {
    let (_etcd, url, _dir, members) = start(name);
    let map = cluster_state(&url).shard_map().expect("a map").clone();
    // A backup whose zone has another member to take its copies.
    let (shard, victim) = (0..SHARDS)
        .find_map(|s| {
            let zone_a = |b: &&String| ["m0", "m3"].contains(&b.as_str());
            map.backups(s).iter().find(zone_a).map(|b| (s, b.clone()))
        })
        .expect("a shard backed up in zone a");
    let mut members = by_name(members);
    let (said, kv, key) = cut_put(&url, &mut members, shard, (&victim, at));
    assert!(said.is_ok(), "kv put: {}", said.unwrap_err());
    let after = cluster_state(&url).shard_map().expect("a map").clone();
    assert_eq!(after.owner(shard), map.owner(shard), "{after:?}");
    assert_eq!(
        assert_alike(&mut copies(&url), &kv, &key).as_deref(),
        Some(&b"after"[..])
    );
}

/// A write cut off after it observed the primary and before its commit, by
/// a change of its group that keeps the lead: one of the shard's backups
/// killed, and a copy added in its place under a new group epoch, which
/// every copy then admits alone. The write (`kv put`, stopped by SIGSTOP
/// before it sets its backups, let go once the copy is added) finds its
/// copies turned away; nothing it did can have reached a reader, so it is
/// run again under the new group and succeeds, where it used to end as an
/// unknown outcome.
#[test]
fn a_write_cut_off_by_a_copy_added_under_the_same_lead_is_run_again() {
    cut_under_the_same_lead("cut", "replica-before-backups");
}

/// The same, stopped once its backups are set: the primary, which starts
/// its copy again under the new group, turns the write away as it takes
/// the block it would commit (a control call, before anything is
/// published there), which is a cut before the commit too.
#[test]
fn a_write_cut_off_after_its_backups_are_set_is_run_again() {
    cut_under_the_same_lead("cut-set", "replica-backups-set");
}

/// A write whose commit the primary turns away whole, before any of its
/// verbs ran: the keys of the primary's region revoked as the write is
/// about to post its commit, its block taken and its backups set, as a
/// primary that starts its copy again under a new group does (a copy
/// added takes longer than an operation deadline, so a write stopped
/// there finds its observation out of time instead). Nothing of it was
/// published, so it is run again on new connections and succeeds, where
/// it used to end as an unknown outcome. The revocation is made in the
/// test's process, at the client's step; over shm, where a region's keys
/// are words of its file (the suite's rdma run leaves this test out).
#[test]
fn a_commit_turned_away_whole_is_run_again() {
    let (_etcd, url, _dir, _members) = start("turned");
    let state = cluster_state(&url);
    let shard = 0;
    let owner = state
        .shard_map()
        .and_then(|m| m.owner(shard))
        .expect("a primary");
    let mut kv = ClusterClient::connect(&url).expect("connect");
    let key = key_of(&kv, shard, "turned");
    kv.put(&key, "before").expect("put");
    let at = copy_address(&state, owner, shard).expect("the primary's address");
    let region = match kv_common::Address::parse(&at) {
        Ok(kv_common::Address::Shm { region }) => region,
        other => panic!("the members serve over shm, not {other:?}"),
    };
    let revoked = std::rc::Rc::new(std::cell::Cell::new(false));
    let said = revoked.clone();
    kv_client::on_step_in_this_thread("replica-commit-ready", move || {
        kv_server::region::revoke_keys(&region).expect("revoke the primary's keys");
        said.set(true);
    });
    kv.put(&key, "after")
        .expect("a put whose commit was turned away");
    assert!(revoked.get(), "the put never reached its commit");
    assert_eq!(
        assert_alike(&mut copies(&url), &kv, &key).as_deref(),
        Some(&b"after"[..])
    );
}

/// The same write cut off by a failover of its primary: a backup the cut
/// run may have set is promoted, so the write is not run again, and ends
/// as an unknown outcome.
#[test]
fn a_write_cut_off_by_a_failover_stays_an_unknown_outcome() {
    let (_etcd, url, _dir, members) = start("cut-lead");
    let map = cluster_state(&url).shard_map().expect("a map").clone();
    // A primary whose zone has another member to take its copies.
    let (shard, owner) = (0..SHARDS)
        .find_map(|s| {
            map.owner(s)
                .filter(|o| ["m0", "m3"].contains(o))
                .map(|o| (s, o))
        })
        .expect("a shard led in zone a");
    let mut members = by_name(members);
    let (said, kv, key) = cut_put(&url, &mut members, shard, (owner, "replica-before-backups"));
    let said = said.expect_err("kv put succeeded after a failover");
    assert!(said.contains("may or may not"), "kv put: {said}");
    let value = assert_alike(&mut copies(&url), &kv, &key);
    assert!(
        [&b"before"[..], b"after"].contains(&value.as_deref().unwrap_or_default()),
        "{value:?}"
    );
}

/// Runs `kv put KEY after` on a key of `shard` (which holds `before`),
/// stopped (SIGSTOP) at pause point `at` (after it observed the primary,
/// before its commit), while `victim` is killed and the cluster restores
/// every group to three copies; then lets it go. Its outcome (what it said
/// on stderr when it failed), a client, and the key.
fn cut_put(
    url: &str,
    members: &mut BTreeMap<String, Daemon>,
    shard: u32,
    (victim, at): (&str, &str),
) -> (Result<(), String>, ClusterClient, String) {
    let before = cluster_state(url).shard_map().expect("a map").clone();
    let mut kv = ClusterClient::connect(url).expect("connect");
    let key = key_of(&kv, shard, "cut");
    kv.put(&key, "before").expect("put");
    let (mut child, mut lines) = paused_kv(
        url,
        &["put", &key, "after"],
        &[("ONEKV_CLIENT_PAUSE", &format!("{at}:300"))],
    );
    pausing(&mut lines, at);
    onekv_tests::signal_child(&child, libc::SIGSTOP);
    members.remove(victim).expect("the victim").kill_9();
    eventually(
        "the victim's copies replaced",
        Duration::from_secs(60),
        || {
            let state = cluster_state(url);
            let map = state.shard_map().expect("a map");
            map.copies_of(victim).count() == 0 && map.group_epoch(shard) > before.epoch
        },
    );
    restored(url, 3);
    // Stopped before its commit, and so not visible yet.
    assert_eq!(kv.get(&key).expect("get").as_deref(), Some(&b"before"[..]));
    onekv_tests::signal_child(&child, libc::SIGCONT);
    let rest: Vec<String> = lines.map_while(std::result::Result::ok).collect();
    let status = child.wait().expect("wait for kv");
    let said = match status.success() {
        true => Ok(()),
        false => Err(rest.join("\n")),
    };
    (said, kv, key)
}
