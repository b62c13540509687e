//! A cluster of `kv-server` processes over one etcd: keys spread over the
//! members' shards, a dead member fails only its own shards (and brings
//! them back, with every write, when it restarts), a member that cannot
//! renew its lease stops serving until it rejoins, and racing map writers
//! cannot both win.

use std::collections::BTreeMap;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kv_client::{Client, ClusterClient, ClusterPool, Error};
use kv_cluster::etcd::BlockingEtcd;
use kv_cluster::follow::Follower;
use kv_cluster::{shard_address, ClusterConfig, ClusterState, ClusterUrl, MemberRecord, ShardMap};
use kv_server::directory::Directory;
use kv_server::Server;
use onekv_tests::cluster::{
    cluster_status, create_cluster, create_cluster_with, member_address, members_url, start_member,
    start_member_with_env, EtcdServer,
};
use onekv_tests::{eventually, region_dir, workspace_bin};

const KEYS: usize = 300;

fn key(i: usize) -> String {
    format!("user{i}")
}

/// Puts every key once the cluster serves all its shards.
fn load(url: &str) -> ClusterClient {
    let mut kv = None;
    eventually(
        "the cluster serves every shard",
        Duration::from_secs(60),
        || {
            let Ok(mut client) = ClusterClient::connect(url) else {
                return false;
            };
            let all = (0..KEYS).all(|i| client.put(key(i), format!("v{i}")).is_ok());
            kv = Some(client);
            all
        },
    );
    kv.expect("a connected client")
}

#[test]
fn keys_spread_over_three_servers_and_a_dead_one_fails_only_its_shards() {
    let etcd = EtcdServer::start();
    let url = etcd.url("spread");
    let dir = region_dir();
    create_cluster(&url, 6, 3);
    let metrics_at = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port");
    let listen = metrics_at.to_string();
    let _m0 = start_member(&url, dir.path(), "m0", &["--metrics-listen", &listen]);
    let m1 = start_member(&url, dir.path(), "m1", &[]);
    let _m2 = start_member(&url, dir.path(), "m2", &[]);
    let kv = load(&url);

    let mut keys_per_member = BTreeMap::new();
    for i in 0..KEYS {
        let owner = kv.owner(kv.shard_of(key(i))).expect("every shard owned");
        *keys_per_member.entry(owner.to_string()).or_insert(0) += 1;
    }
    assert_eq!(keys_per_member.len(), 3, "{keys_per_member:?}");
    let status = cluster_status(&url);
    for m in ["m0", "m1", "m2"] {
        assert!(status.contains(&format!("member {m} ")), "{status}");
        assert!(status.contains(": 2 shards"), "{status}");
    }
    the_kv_tool_works_on_the_cluster(&url, "tool-counter");
    the_kv_tool_works_on_the_cluster(&members_url(dir.path(), &["m2"]), "by-members");
    let of_m0: Vec<u32> = (0..kv.shards())
        .filter(|&s| kv.owner(s) == Some("m0"))
        .collect();
    metrics_by_shard(metrics_at, &of_m0);
    batches_span_shards(&url);
    a_pool_shares_cluster_clients(&url);

    m1.kill_9();
    // A client that connects now: m1's shards fail, naming shard and
    // server; every other key reads back.
    let mut fresh = ClusterClient::connect(&url).expect("connect");
    let (mut served, mut failed) = (0, 0);
    for i in 0..KEYS {
        let shard = fresh.shard_of(key(i));
        match fresh.get(key(i)) {
            Ok(value) => {
                assert_ne!(fresh.owner(shard), Some("m1"), "{}", key(i));
                assert_eq!(value.as_deref(), Some(format!("v{i}").as_bytes()));
                served += 1;
            }
            Err(Error::ShardUnavailable {
                shard: s, server, ..
            }) => {
                assert_eq!((s, server.as_str()), (shard, "m1"));
                failed += 1;
            }
            Err(e) => panic!("{}: {e}", key(i)),
        }
    }
    assert_eq!(failed, keys_per_member["m1"]);
    assert_eq!(served, KEYS - failed);
    // A batch over every shard fails on m1's, naming it.
    let all: Vec<String> = (0..KEYS).map(key).collect();
    match fresh.get_many(&all) {
        Err(Error::ShardUnavailable { server, .. }) => assert_eq!(server, "m1"),
        other => panic!("a batch with m1's keys: {other:?}"),
    }

    let _m1 = start_member(&url, dir.path(), "m1", &[]);
    eventually(
        "m1's shards back, with every write",
        Duration::from_secs(60),
        || {
            (0..KEYS).all(|i| {
                fresh.get(key(i)).ok().flatten().as_deref() == Some(format!("v{i}").as_bytes())
            })
        },
    );
    let values = fresh.get_many(&all).expect("a batch over every shard");
    for (i, value) in values.iter().enumerate() {
        assert_eq!(value.as_deref(), Some(format!("v{i}").as_bytes()));
    }
}

/// A server started under a member's name without the member's regions
/// (here: at another --listen, as a typo or another host would start it)
/// stops, saying where the member made them, rather than serve its shards
/// from empty regions, which would answer "not found" for every key they
/// held; the member started where its regions are serves them all again.
/// With --recreate-missing-regions the operator accepts the loss, and the
/// shards are served empty.
#[test]
fn a_member_started_without_its_regions_does_not_serve_its_shards_empty() {
    let etcd = EtcdServer::start();
    let url = etcd.url("lost");
    let (dir, elsewhere) = (region_dir(), region_dir());
    create_cluster(&url, 2, 1);
    let m0 = start_member(&url, dir.path(), "m0", &[]);
    let mut kv = load(&url);
    m0.kill_9();
    // It joins once m0's lease has run out, and finds no region.
    let stray = start_member(&url, elsewhere.path(), "m0", &[]);
    let (status, log) = stray.wait_exit(Duration::from_secs(60));
    assert!(
        !status.success() && log.contains("is missing") && log.contains("made it at"),
        "{log}"
    );
    match kv.get(key(0)) {
        Err(Error::ShardUnavailable { .. }) => {}
        other => panic!("{}: {other:?}", key(0)),
    }
    let m0 = start_member(&url, dir.path(), "m0", &[]);
    eventually("m0's keys back", Duration::from_secs(60), || {
        (0..KEYS).all(|i| kv.get(key(i)).ok().flatten() == Some(format!("v{i}").into_bytes()))
    });
    m0.kill_9();
    let recreate = ["--recreate-missing-regions"];
    let _stray = start_member(&url, elsewhere.path(), "m0", &recreate);
    eventually("m0's shards served empty", Duration::from_secs(60), || {
        (0..KEYS).all(|i| matches!(kv.get(key(i)), Ok(None)))
    });
}

/// A copy whose region's record could not be written when its server
/// started (etcd did not answer: `ONEKV_REGION_RECORD_FAULT` fails the
/// first two writes, one per shard) has it written later, while it is
/// served, so that a server started without the region still refuses to
/// serve it empty.
#[test]
fn a_region_whose_record_failed_is_recorded_later_and_never_served_empty() {
    let etcd = EtcdServer::start();
    let url = etcd.url("unrecorded");
    let (dir, elsewhere) = (region_dir(), region_dir());
    create_cluster(&url, 2, 1);
    let fault = [("ONEKV_REGION_RECORD_FAULT", "2")];
    let m0 = start_member_with_env(&url, dir.path(), "m0", &[], &fault);
    let mut kv = load(&url);
    let mut etcd_client =
        BlockingEtcd::connect(&ClusterUrl::parse(&url).expect("url")).expect("etcd");
    eventually("both regions recorded", Duration::from_secs(60), || {
        let made = etcd_client.regions_made_by("m0").unwrap_or_default();
        (0..2).all(|shard| made.contains_key(&shard))
    });
    m0.kill_9();
    let stray = start_member(&url, elsewhere.path(), "m0", &[]);
    let (status, log) = stray.wait_exit(Duration::from_secs(60));
    assert!(!status.success() && log.contains("is missing"), "{log}");
    assert!(
        matches!(kv.get(key(0)), Err(Error::ShardUnavailable { .. })),
        "{}",
        key(0)
    );
}

/// A member's one metrics endpoint shows each shard it serves, labelled.
fn metrics_by_shard(at: std::net::SocketAddr, shards: &[u32]) {
    use std::io::{Read, Write};
    let mut http = std::net::TcpStream::connect(at).expect("the metrics endpoint");
    http.write_all(b"GET /metrics HTTP/1.0\r\n\r\n")
        .expect("ask");
    let mut reply = String::new();
    http.read_to_string(&mut reply).expect("the figures");
    assert_eq!(
        reply.matches("# TYPE onekv_connects_total counter").count(),
        1,
        "{reply}"
    );
    for shard in shards {
        let sample = format!("onekv_connects_total{{shard=\"{shard}\"}} ");
        let line = reply
            .lines()
            .find(|l| l.starts_with(&sample))
            .unwrap_or_else(|| panic!("no {sample} in {reply}"));
        let connects: u64 = line[sample.len()..].trim().parse().expect("a count");
        assert!(connects >= 1, "{line}");
    }
    assert_eq!(
        reply.matches("onekv_clients_connected{shard=").count(),
        shards.len(),
        "{reply}"
    );
}

/// Threads borrow cluster clients from a pool, fewer than they are.
fn a_pool_shares_cluster_clients(url: &str) {
    let pool = ClusterPool::new(url, Default::default(), 2).expect("a pool");
    std::thread::scope(|s| {
        for t in 0..4 {
            let pool = &pool;
            s.spawn(move || {
                for i in 0..20 {
                    let mut kv = pool.get().expect("a pooled client");
                    let key = format!("pooled-{t}-{i}");
                    kv.put(&key, b"from a pool").expect("put");
                    assert_eq!(
                        kv.get(&key).expect("get").as_deref(),
                        Some(&b"from a pool"[..])
                    );
                }
            });
        }
    });
    assert!(pool.idle() <= 2 && pool.idle() >= 1, "{} idle", pool.idle());
}

/// Batches whose keys fall in every shard: each key at its shard, in the
/// caller's order.
fn batches_span_shards(url: &str) {
    let mut kv = ClusterClient::connect(url).expect("connect");
    let pairs: Vec<(String, String)> = (0..100)
        .map(|i| (format!("batch{i}"), format!("b{i}")))
        .collect();
    kv.put_many(&pairs).expect("put_many");
    let shards: std::collections::BTreeSet<u32> =
        pairs.iter().map(|(k, _)| kv.shard_of(k)).collect();
    assert_eq!(
        shards.len() as u32,
        kv.shards(),
        "the batch spans every shard"
    );
    for (k, v) in &pairs {
        assert_eq!(kv.get(k).expect("get").as_deref(), Some(v.as_bytes()));
    }
    let keys: Vec<String> = (0..100).map(|i| format!("batch{}", i * 2)).collect();
    let values = kv.get_many(&keys).expect("get_many");
    for (i, value) in values.iter().enumerate() {
        let expected = (i * 2 < 100).then(|| format!("b{}", i * 2).into_bytes());
        assert_eq!(value, &expected, "{}", keys[i]);
    }
    let deleted = kv.delete_many(&keys).expect("delete_many");
    assert_eq!(deleted, (0..100).map(|i| i * 2 < 100).collect::<Vec<_>>());
    let after = kv.get_many(&pairs.iter().map(|(k, _)| k).collect::<Vec<_>>());
    let present = after
        .expect("get_many")
        .iter()
        .filter(|v| v.is_some())
        .count();
    assert_eq!(present, 50, "the odd keys stay");

    // Several batches per shard; with slot hints settled (a settle period
    // after they were first seen), a warm batch is its first step only.
    let options = kv_client::ClientOptions::default().with_slot_cache_entries(4096);
    let mut warm = ClusterClient::connect_with(url, options).expect("connect");
    let many: Vec<(String, String)> = (0..300)
        .map(|i| (format!("many{i}"), format!("m{i}")))
        .collect();
    for round in 0..2 {
        if round == 1 {
            std::thread::sleep(Duration::from_millis(400));
            let keys: Vec<&str> = many.iter().map(|(k, _)| k.as_str()).collect();
            warm.get_many(&keys).expect("get_many");
        }
        let pairs: Vec<(&str, String)> = many
            .iter()
            .map(|(k, v)| (k.as_str(), format!("{v}.{round}")))
            .collect();
        warm.put_many(&pairs).expect("put_many");
        let keys: Vec<&str> = many.iter().map(|(k, _)| k.as_str()).collect();
        let values = warm.get_many(&keys).expect("get_many");
        for ((k, v), read) in pairs.iter().zip(&values) {
            assert_eq!(read.as_deref(), Some(v.as_bytes()), "{k}, round {round}");
        }
    }
    let keys: Vec<String> = (0..400).map(|i| format!("many{i}")).collect();
    let deleted = warm.delete_many(&keys).expect("delete_many");
    assert_eq!(deleted, (0..400).map(|i| i < 300).collect::<Vec<_>>());
    let after = kv.get_many(&keys).expect("get_many");
    assert!(after.iter().all(Option::is_none), "deleted keys read back");
}

/// `kv --server etcd://...` (or `cluster+...`) reads and writes keys
/// at their shards, shows the cluster, and gives a server's statistics by
/// shard; `counter` is a key not used before.
fn the_kv_tool_works_on_the_cluster(url: &str, counter: &str) {
    let kv = |args: &[&str]| {
        let out = Command::new(workspace_bin("kv"))
            .args(["--server", url])
            .args(args)
            .output()
            .expect("run kv");
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        (out.status.code(), text(&out.stdout), text(&out.stderr))
    };
    assert_eq!(kv(&["put", "from-the-tool", "hello"]).0, Some(0));
    assert_eq!(kv(&["get", "from-the-tool"]).1, "hello");
    assert_eq!(kv(&["get", "user7"]).1, "v7");
    assert_eq!(kv(&["incr", counter, "5"]).1, "5\n");
    let (code, status, _) = kv(&["cluster"]);
    assert_eq!(code, Some(0));
    for m in ["m0", "m1", "m2"] {
        assert!(status.contains(&format!("member {m} ")), "{status}");
    }
    assert!(status.contains("map epoch: "), "{status}");
    // etcd records the deadline its members run; their maps do not.
    assert_eq!(
        status.contains("every member runs --op-deadline-ms 50"),
        url.starts_with("etcd://"),
        "{status}"
    );
    let (code, _, err) = kv(&["stats"]);
    assert_eq!(code, Some(2));
    assert!(err.contains("give --shard"), "{err}");
    let (code, stats, _) = kv(&["stats", "--shard", "5"]);
    assert_eq!(code, Some(0));
    assert!(stats.contains("buckets "), "{stats}");
}

/// A replicated write's lock margins count in the primary's deadlines
/// while its CASes on the backups run under theirs: members of one cluster
/// must keep one `--op-deadline-ms`. The first to join sets it (unless
/// `cluster create` did), and a server started with another exits at once,
/// saying which to use.
#[test]
fn every_member_of_a_cluster_keeps_one_op_deadline() {
    let etcd = EtcdServer::start();
    let dir = region_dir();
    let refused = |url: &str, name: &str, ms: &str, recorded: &str| {
        let member = start_member(url, dir.path(), name, &["--op-deadline-ms", ms]);
        let (status, log) = member.wait_exit(Duration::from_secs(60));
        assert_eq!(status.code(), Some(1), "{log}");
        let hint = format!("start it with --op-deadline-ms {recorded}");
        assert!(log.contains(&hint), "{log}");
    };

    // Set by the first member to join.
    let url = etcd.url("deadline");
    create_cluster(&url, 2, 1);
    assert!(
        cluster_status(&url).contains("set by the first member to join"),
        "{}",
        cluster_status(&url)
    );
    let _m0 = start_member(&url, dir.path(), "m0", &["--op-deadline-ms", "70"]);
    eventually("m0 sets the deadline", Duration::from_secs(60), || {
        cluster_status(&url).contains("every member runs --op-deadline-ms 70")
    });
    refused(&url, "m1", "50", "70");
    let _m1 = start_member(&url, dir.path(), "m1", &["--op-deadline-ms", "70"]);
    eventually("m1 joins", Duration::from_secs(60), || {
        cluster_status(&url).contains("member m1 ")
    });

    // Set by `cluster create`: even the first member is held to it.
    let url = etcd.url("created");
    create_cluster_with(&url, 2, 1, &["--op-deadline-ms", "90"]);
    refused(&url, "c0", "50", "90");
    let _c0 = start_member(&url, dir.path(), "c0", &["--op-deadline-ms", "90"]);
    eventually("c0 serves", Duration::from_secs(60), || {
        ClusterClient::connect(&url).is_ok_and(|mut kv| kv.put("k", "v").is_ok())
    });
}

/// A deadline record that does not decode, or is 0, cannot be mended by
/// waiting: a server refuses to join and exits, saying how to repair it,
/// and joins once an operator has.
#[test]
fn a_damaged_op_deadline_record_refuses_members_until_repaired() {
    let etcd = EtcdServer::start();
    let dir = region_dir();
    let url = etcd.url("damaged");
    create_cluster(&url, 2, 1);
    let record = kv_cluster::etcd::Keys::new("damaged").op_deadline();
    let repair = format!("etcdctl put {record} 50");
    for (damage, why) in [
        (&b"fifty"[..], "the op deadline record in etcd is damaged"),
        (b"0", "the op deadline record in etcd is 0"),
    ] {
        etcd.put(&record, damage);
        let member = start_member(&url, dir.path(), "m0", &[]);
        let (status, log) = member.wait_exit(Duration::from_secs(60));
        assert_eq!(status.code(), Some(1), "{log}");
        assert!(log.contains(why) && log.contains(&repair), "{log}");
        // What is wrong, shown with the rest of the cluster.
        let status = cluster_status(&url);
        assert!(
            status.contains("shards: 2") && status.contains(why),
            "{status}"
        );
        assert!(status.contains(&repair), "{status}");
    }
    // Repaired as the message says.
    etcd.put(&record, b"50");
    let _m0 = start_member(&url, dir.path(), "m0", &[]);
    eventually("m0 joins", Duration::from_secs(60), || {
        cluster_status(&url).contains("member m0 ")
    });
}

#[test]
fn a_member_paused_past_its_lease_serves_nothing_until_it_joins_again() {
    let etcd = EtcdServer::start();
    let url = etcd.url("fence");
    let dir = region_dir();
    create_cluster(&url, 2, 1);
    let member = start_member(&url, dir.path(), "solo", &[]);
    let mut kv = load(&url);
    let cluster = ClusterUrl::parse(&url).expect("url");
    let incarnation =
        |etcd: &mut BlockingEtcd| etcd.state().ok()?.member("solo").map(|m| m.incarnation);
    let mut reader = BlockingEtcd::connect(&cluster).expect("etcd");
    let first = incarnation(&mut reader).expect("solo is a member");

    // Paused for twice its lease (2 s): etcd lets the lease expire, and
    // the member, once it runs again, learns so and stops serving.
    member.signal(libc::SIGSTOP);
    eventually("the lease expires", Duration::from_secs(30), || {
        incarnation(&mut reader).is_none()
    });
    member.signal(libc::SIGCONT);

    // It joins again under a new lease, and serves its shards with every
    // write they held.
    eventually("the member rejoins", Duration::from_secs(30), || {
        incarnation(&mut reader).is_some_and(|i| i != first)
    });
    eventually("its shards served again", Duration::from_secs(30), || {
        (0..KEYS)
            .all(|i| kv.get(key(i)).ok().flatten().as_deref() == Some(format!("v{i}").as_bytes()))
    });
    let (_, log) = member.terminate();
    let fenced = log
        .find("serving nothing until joined again")
        .unwrap_or_else(|| panic!("never fenced: {log}"));
    assert!(
        log[..fenced].contains("etcd says the lease expired"),
        "{log}"
    );
    assert!(
        log[fenced..].contains("member of the cluster"),
        "served again before joining again: {log}"
    );
}

/// A client that writes and reads every key in turn on a thread of its
/// own, until stopped.
struct BusyClient {
    stop: Arc<AtomicBool>,
    /// Operations made so far.
    ops: Arc<AtomicU64>,
    /// The errors it met (text), and the last value of each key.
    thread: std::thread::JoinHandle<(Vec<String>, BTreeMap<usize, String>)>,
}

impl BusyClient {
    /// Starts one on the cluster at `url`, and waits until it runs.
    fn start(url: &str) -> BusyClient {
        let (stop, ops) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicU64::new(0)),
        );
        let (url, stopped, made) = (url.to_string(), stop.clone(), ops.clone());
        let thread = std::thread::spawn(move || {
            let mut kv = ClusterClient::connect(&url).expect("connect");
            let (mut errors, mut last) = (Vec::new(), BTreeMap::new());
            let mut n = 0usize;
            while !stopped.load(Ordering::SeqCst) {
                let i = n % KEYS;
                let value = format!("w{n}");
                match kv.put(key(i), &value).and_then(|()| kv.get(key(i))) {
                    Ok(Some(read)) if read == value.as_bytes() => {
                        last.insert(i, value);
                    }
                    Ok(other) => errors.push(format!("{}: read {other:?} after {value}", key(i))),
                    Err(e) => errors.push(format!("{}: {e}", key(i))),
                }
                made.fetch_add(1, Ordering::SeqCst);
                n += 1;
            }
            (errors, last)
        });
        let busy = BusyClient { stop, ops, thread };
        eventually("the client runs", Duration::from_secs(30), || {
            busy.ops() > 100
        });
        busy
    }

    fn ops(&self) -> u64 {
        self.ops.load(Ordering::SeqCst)
    }
}

/// Waits until member m2 has joined and taken shards, with no move under
/// way, then stops `client`, which must have met no error; the last value
/// it wrote to each key.
fn m2_joins_under(url: &str, client: BusyClient) -> BTreeMap<usize, String> {
    eventually("m2 joins and takes shards", Duration::from_secs(90), || {
        let status = cluster_status(url);
        status.contains("member m2 ")
            && !status.contains(": 0 shards")
            && !status.contains("moving")
    });
    client.stop.store(true, Ordering::SeqCst);
    let (errors, last) = client.thread.join().expect("the client");
    assert!(
        errors.is_empty(),
        "{} errors: {:?}",
        errors.len(),
        &errors[..errors.len().min(5)]
    );
    last
}

#[test]
fn while_etcd_is_down_the_data_path_carries_on_and_membership_waits() {
    let mut etcd = EtcdServer::start();
    let url = etcd.url("outage");
    let dir = region_dir();
    create_cluster(&url, 4, 2);
    let m0 = start_member(&url, dir.path(), "m0", &[]);
    let _m1 = start_member(&url, dir.path(), "m1", &[]);
    drop(load(&url));
    let client = BusyClient::start(&url);

    // Down for three lease TTLs (2 s each): no lease can expire meanwhile,
    // and the members serve on. A server started now waits to join.
    etcd.kill();
    let at_kill = client.ops();
    let _m2 = start_member(&url, dir.path(), "m2", &[]);
    std::thread::sleep(Duration::from_secs(6));
    let during = client.ops() - at_kill;
    etcd.start_again();
    assert!(during > 100, "{during} operations while etcd was down");

    // Back: the new server joins and gets its share while the client runs.
    let last = m2_joins_under(&url, client);
    let mut kv = ClusterClient::connect(&url).expect("connect");
    for (i, value) in last {
        assert_eq!(
            kv.get(key(i)).expect("get").as_deref(),
            Some(value.as_bytes())
        );
    }
    let (_, log) = m0.terminate();
    assert!(log.contains("etcd cannot be reached"), "{log}");
    assert!(!log.contains("serving nothing until joined again"), "{log}");
}

/// A stop signal while etcd is down: a drain cannot move anything, so
/// once etcd has been silent for 10 s (three lease TTLs if longer), the
/// server leaves without one, rather than wait out the drain limit (five
/// minutes) with the operator's stop. Its shards stay its own, and are
/// served again, every key kept, when it returns.
#[test]
fn a_server_told_to_stop_while_etcd_is_down_leaves_without_a_drain() {
    let mut etcd = EtcdServer::start();
    let url = etcd.url("stop-in-outage");
    let dir = region_dir();
    create_cluster(&url, 4, 2);
    let _m0 = start_member(&url, dir.path(), "m0", &[]);
    let m1 = start_member(&url, dir.path(), "m1", &[]);
    drop(load(&url));

    etcd.kill();
    m1.signal(libc::SIGTERM);
    let (status, log) = m1.wait_exit(Duration::from_secs(60));
    assert!(status.success(), "{log}");
    assert!(log.contains("draining"), "{log}");
    assert!(log.contains("etcd has not confirmed"), "{log}");

    etcd.start_again();
    let _m1 = start_member(&url, dir.path(), "m1", &[]);
    eventually("every key read back", Duration::from_secs(60), || {
        let Ok(mut kv) = ClusterClient::connect(&url) else {
            return false;
        };
        (0..KEYS).all(|i| {
            kv.get(key(i))
                .is_ok_and(|v| v.as_deref() == Some(format!("v{i}").as_bytes()))
        })
    });
}

/// A member behind the others (its watch made again after an etcd outage,
/// say) does not hide a move: when the shard's old owner no longer serves
/// it, the client asks that owner, whose view shows where it went, and
/// not only the member that answered last; an idle client's follower asks
/// the members in turn.
#[test]
fn a_client_asks_the_owner_that_dropped_a_shard_where_it_went() {
    let dir = region_dir();
    let listen = |id: &str| member_address(dir.path(), id);
    let state = |owner: &str, revision: i64| ClusterState {
        config: ClusterConfig {
            shards: 1,
            initial_members: 1,
            replicas: 1,
        },
        members: ["m0", "m1", "m2"]
            .map(|id| MemberRecord {
                id: id.into(),
                listen: listen(id).to_string(),
                incarnation: 1,
                draining: false,
                zone: None,
                replaces_copies: true,
            })
            .to_vec(),
        map: Some((
            ShardMap {
                group_epochs: Vec::new(),
                unlevelled: Vec::new(),
                lead_epochs: Vec::new(),
                epoch: revision as u64,
                owners: vec![Some(owner.into())],
                backups: Vec::new(),
                moving: None,
            },
            revision,
        )),
        revision,
    };
    // m0 handed shard 0 over to m2 and saw the map that says so; m1 has
    // not seen it yet.
    let m0 = Directory::serve(&listen("m0"), "m0", "lagging").expect("m0's directory");
    m0.show(Some(&state("m2", 20)));
    let m1 = Directory::serve(&listen("m1"), "m1", "lagging").expect("m1's directory");
    m1.show(Some(&state("m0", 10)));
    let at_m2 = shard_address(&listen("m2"), 0).expect("an address");
    let mut config = onekv_tests::test_config(&dir.path().join("m2.shard-0"));
    config.address = at_m2;
    let _m2 = Server::start(config).expect("m2 serves shard 0");

    let mut kv = ClusterClient::connect(&members_url(dir.path(), &["m1"])).expect("connect");
    assert_eq!(kv.owner(0), Some("m0"), "the lagging member's map");
    kv.put("moved", "found")
        .expect("put at the shard's new owner");
    assert_eq!(kv.owner(0), Some("m2"));
    assert_eq!(
        kv.get("moved").expect("get").as_deref(),
        Some(&b"found"[..])
    );
    drop(kv);

    // A client that makes no operation learns the newer map too: its
    // follower asks the members in turn, not only the one that answered.
    let mut idle = ClusterClient::connect(&members_url(dir.path(), &["m1"])).expect("connect");
    assert_eq!(idle.owner(0), Some("m0"), "the lagging member's map");
    eventually("an idle client follows", Duration::from_secs(10), || {
        idle.map_epoch() == 20
    });
}

#[test]
fn a_client_without_etcd_reads_the_map_from_the_members_through_an_outage_and_a_join() {
    let mut etcd = EtcdServer::start();
    let url = etcd.url("members");
    let dir = region_dir();
    create_cluster(&url, 4, 2);
    let _m0 = start_member(&url, dir.path(), "m0", &[]);
    let _m1 = start_member(&url, dir.path(), "m1", &[]);
    let mut by_etcd = load(&url);
    // The first address given is no member's: the next one answers.
    let members = members_url(dir.path(), &["nobody", "m1"]);
    let mut kv = ClusterClient::connect(&members).expect("the map from a member");
    for shard in 0..kv.shards() {
        assert_eq!(kv.owner(shard), by_etcd.owner(shard), "shard {shard}");
    }
    for i in 0..KEYS {
        let value = kv.get(key(i)).expect("get");
        assert_eq!(value.as_deref(), Some(format!("v{i}").as_bytes()));
    }
    // Addresses of the wrong kind say what they are.
    let m0 = member_address(dir.path(), "m0");
    let member = Client::connect(&m0.to_string()).err();
    assert!(
        matches!(&member, Some(Error::InvalidAddress(m)) if m.contains("cluster+")),
        "{member:?}"
    );
    let owner = by_etcd.owner(0).expect("shard 0 owned");
    let shard_0 = shard_address(&member_address(dir.path(), owner), 0).expect("an address");
    let region = ClusterClient::connect(&format!("cluster+{shard_0}"));
    let region = region.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(region.contains("serves one region"), "{region}");

    let client = BusyClient::start(&members);

    // With etcd down a client still connects: the members hand out the
    // map they last saw.
    etcd.kill();
    let mut during = ClusterClient::connect(&members).expect("connect while etcd is down");
    during.put("in-the-outage", "yes").expect("put");
    let _m2 = start_member(&url, dir.path(), "m2", &[]);
    std::thread::sleep(Duration::from_secs(3));
    etcd.start_again();

    // m2 joins and shards move to it while the client runs; the client
    // follows the moves through the members alone.
    let last = m2_joins_under(&url, client);
    // Clients that made no operation since before the outage have followed
    // the map (etcd's watch through its restart; the members' map).
    let newest = BlockingEtcd::connect(&ClusterUrl::parse(&url).expect("url"))
        .and_then(|mut etcd| etcd.state())
        .expect("etcd's state");
    let epoch = newest.shard_map().expect("a map").epoch;
    for idle in [&mut kv, &mut by_etcd] {
        eventually(
            "an idle client follows the map",
            Duration::from_secs(10),
            || idle.map_epoch() >= epoch,
        );
        assert!((0..idle.shards()).any(|s| idle.owner(s) == Some("m2")));
    }
    let mut after = ClusterClient::connect(&members).expect("connect");
    assert!((0..after.shards()).any(|s| after.owner(s) == Some("m2")));
    for (i, value) in last {
        let read = after.get(key(i)).expect("get");
        assert_eq!(read.as_deref(), Some(value.as_bytes()));
    }
    let outage = after.get("in-the-outage").expect("get");
    assert_eq!(outage.as_deref(), Some(&b"yes"[..]));
}

#[test]
fn of_two_coordinators_publishing_against_one_map_exactly_one_wins() {
    let etcd = EtcdServer::start();
    let url = ClusterUrl::parse(&etcd.url("race")).expect("url");
    create_cluster(&url.to_string(), 4, 1);
    let mut a = BlockingEtcd::connect(&url).expect("etcd");
    let mut b = BlockingEtcd::connect(&url).expect("etcd");
    let map = |owner: &str, epoch| ShardMap {
        group_epochs: Vec::new(),
        unlevelled: Vec::new(),
        lead_epochs: Vec::new(),
        epoch,
        owners: vec![Some(owner.to_string()); 4],
        backups: Vec::new(),
        moving: None,
    };

    // No map yet: both try to write the first.
    let first = [
        a.publish_map(&map("a", 1), None),
        b.publish_map(&map("b", 1), None),
    ];
    let won: Vec<bool> = first
        .into_iter()
        .map(|r| r.expect("etcd answers"))
        .collect();
    assert_eq!(won.iter().filter(|w| **w).count(), 1, "{won:?}");

    // Both read the same map and race their next epoch.
    let state = a.state().expect("state");
    let (current, revision) = state.map.clone().expect("a map");
    let next = [
        a.publish_map(&map("a", current.epoch + 1), Some((&current, revision))),
        b.publish_map(&map("b", current.epoch + 1), Some((&current, revision))),
    ];
    let won: Vec<bool> = next.into_iter().map(|r| r.expect("etcd answers")).collect();
    assert_eq!(won.iter().filter(|w| **w).count(), 1, "{won:?}");
    let winner = if won[0] { "a" } else { "b" };
    let after = b.state().expect("state").map.expect("a map").0;
    // Published with each shard's lead stamped against the map it replaced.
    let mut expected = map(winner, current.epoch + 1);
    expected.stamp_leads(Some(&current));
    assert_eq!(after, expected);
}

#[test]
fn a_map_follower_reads_the_state_whole_after_etcd_compacts_what_it_would_watch() {
    let etcd = EtcdServer::start();
    let url = ClusterUrl::parse(&etcd.url("follow")).expect("url");
    create_cluster(&url.to_string(), 4, 1);
    let mut writer = BlockingEtcd::connect(&url).expect("etcd");
    let map = |epoch| ShardMap {
        group_epochs: Vec::new(),
        unlevelled: Vec::new(),
        lead_epochs: Vec::new(),
        epoch,
        owners: vec![Some(format!("m{epoch}")); 4],
        backups: Vec::new(),
        moving: None,
    };
    assert!(writer.publish_map(&map(1), None).expect("etcd answers"));
    let old = writer.state().expect("state");
    // Changed twice, and the history compacted up to the second change: a
    // watch from `old` on is cancelled, so only a whole read finds epoch 3.
    let mut revision = old.map.as_ref().expect("a map").1;
    for epoch in [2, 3] {
        assert!(writer
            .publish_map(&map(epoch), Some((&map(epoch - 1), revision)))
            .expect("etcd answers"));
        revision = writer.state().expect("state").map.expect("a map").1;
    }
    etcd.compact(revision);

    let (sender, seen) = std::sync::mpsc::channel();
    let _follower = Follower::start(&url, old, move |s: &ClusterState| {
        let _ = sender.send(s.clone());
    })
    .expect("a follower");
    let epoch_of = |s: ClusterState| s.map.expect("a map").0.epoch;
    let next = || seen.recv_timeout(Duration::from_secs(30)).expect("a state");
    assert_eq!(epoch_of(next()), 3);
    // Then followed change by change, as the watch reports them.
    assert!(writer
        .publish_map(&map(4), Some((&map(3), revision)))
        .expect("etcd answers"));
    let fourth = next();
    let whole = writer.state().expect("state");
    let revision = fourth.revision;
    assert_eq!(fourth, ClusterState { revision, ..whole });
    assert_eq!(epoch_of(fourth), 4);
}

#[test]
fn when_the_coordinator_dies_another_member_takes_over() {
    let etcd = EtcdServer::start();
    let url = etcd.url("takeover");
    let dir = region_dir();
    // The first member is elected but cannot deal the shards alone.
    create_cluster(&url, 4, 2);
    let first = start_member(&url, dir.path(), "first", &[]);
    eventually("first is coordinator", Duration::from_secs(30), || {
        cluster_status(&url).contains("map: none yet")
    });
    std::thread::sleep(Duration::from_millis(500));
    first.kill_9();
    // Its lease runs out; one of the two that join now must coordinate.
    let _a = start_member(&url, dir.path(), "a", &[]);
    let _b = start_member(&url, dir.path(), "b", &[]);
    let kv = load(&url);
    for shard in 0..4 {
        assert!(matches!(kv.owner(shard), Some("a" | "b")), "{shard}");
    }
}

/// The version a value of the move test carries.
fn version(value: &[u8]) -> u64 {
    std::str::from_utf8(value)
        .ok()
        .and_then(|v| v.strip_prefix('v'))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("a foreign value {value:?}"))
}

const HOT: usize = 60;
const COUNTERS: usize = 6;

/// The latest version of each hot key whose put returned.
type Acked = Arc<Vec<AtomicU64>>;

/// Increments of each counter that returned, and that ended with their
/// outcome unknown (the connection lost after the atomic was posted, as a
/// move's revocation may do).
type Counted = [(i64, i64); COUNTERS];

/// Puts a new version of every hot key and increments a counter after
/// each, round after round (three at least) until `stop`; any error but an
/// unknown outcome fails the test.
fn writer(
    url: String,
    acked: Acked,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<(u64, Counted)> {
    std::thread::spawn(move || {
        let mut kv = ClusterClient::connect(&url).expect("connect");
        let (mut round, mut counted) = (0, [(0i64, 0i64); COUNTERS]);
        while round < 3 || !stop.load(Ordering::SeqCst) {
            round += 1;
            for (i, acked) in acked.iter().enumerate() {
                kv.put(key(i), format!("v{round}"))
                    .expect("a put during moves");
                acked.store(round, Ordering::SeqCst);
                let c = i % COUNTERS;
                match kv.incr(format!("hits{c}"), 1) {
                    Ok(_) => counted[c].0 += 1,
                    Err(Error::OutcomeUnknown(_)) => counted[c].1 += 1,
                    Err(e) => panic!("an increment during moves: {e}"),
                }
            }
        }
        (round, counted)
    })
}

/// Reads every hot key until `stop`: never an error, never a version older
/// than one acknowledged before the read began.
fn reader(url: String, acked: Acked, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        let mut kv = ClusterClient::connect(&url).expect("connect");
        let mut reads = 0u64;
        while !stop.load(Ordering::SeqCst) {
            for (i, acked) in acked.iter().enumerate() {
                let floor = acked.load(Ordering::SeqCst);
                let value = kv
                    .get(key(i))
                    .expect("a get during moves")
                    .expect("present");
                let seen = version(&value);
                assert!(
                    seen >= floor,
                    "{} read v{seen} after v{floor} was acknowledged",
                    key(i)
                );
                reads += 1;
            }
        }
        reads
    })
}

#[test]
fn a_server_that_joins_takes_its_share_while_clients_write_and_read() {
    let etcd = EtcdServer::start();
    let url = etcd.url("join");
    let dir = region_dir();
    create_cluster(&url, 6, 2);
    let _m0 = start_member(&url, dir.path(), "m0", &[]);
    let _m1 = start_member(&url, dir.path(), "m1", &[]);
    let mut kv = load(&url);
    for i in 0..HOT {
        kv.put(key(i), "v0").expect("put");
    }
    for c in 0..COUNTERS {
        kv.incr(format!("hits{c}"), 0).expect("a counter");
    }
    let acked: Acked = Arc::new((0..HOT).map(|_| AtomicU64::new(0)).collect());
    let stop = Arc::new(AtomicBool::new(false));
    let writes = writer(url.clone(), Arc::clone(&acked), Arc::clone(&stop));
    let reads = reader(url.clone(), Arc::clone(&acked), Arc::clone(&stop));

    let _m2 = start_member(&url, dir.path(), "m2", &[]);
    eventually(
        "every member serves two shards",
        Duration::from_secs(120),
        || {
            let status = cluster_status(&url);
            !status.contains("moving") && status.matches(": 2 shards").count() == 3
        },
    );
    stop.store(true, Ordering::SeqCst);
    let (rounds, counted) = writes.join().expect("the writer saw no error");
    let reads = reads
        .join()
        .expect("the reader saw no error or stale value");
    assert!(rounds > 1 && reads > 0, "{rounds} rounds, {reads} reads");

    let mut fresh = ClusterClient::connect(&url).expect("connect");
    for (i, acked) in acked.iter().enumerate() {
        let value = fresh.get(key(i)).expect("get").expect("present");
        assert_eq!(version(&value), acked.load(Ordering::SeqCst), "{}", key(i));
    }
    for i in HOT..KEYS {
        let value = fresh.get(key(i)).expect("get");
        assert_eq!(value.as_deref(), Some(format!("v{i}").as_bytes()));
    }
    for (c, (done, unknown)) in counted.iter().enumerate() {
        let name = format!("hits{c}");
        let value = fresh.get_counter(&name).expect("get").unwrap_or(0);
        assert!(
            (*done..=done + unknown).contains(&value),
            "{name}: {value}, {done} done, {unknown} unknown"
        );
    }
}

#[test]
fn a_server_told_to_stop_hands_its_shards_over_before_it_leaves() {
    let etcd = EtcdServer::start();
    let url = etcd.url("drain");
    let dir = region_dir();
    create_cluster(&url, 6, 3);
    let metrics_at = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port");
    let listen = metrics_at.to_string();
    let _m0 = start_member(&url, dir.path(), "m0", &["--metrics-listen", &listen]);
    let _m1 = start_member(&url, dir.path(), "m1", &[]);
    let m2 = start_member(&url, dir.path(), "m2", &[]);
    let mut kv = load(&url);

    // SIGTERM: it drains, then exits by itself.
    let (status, log) = m2.terminate();
    assert!(status.success(), "{log}");
    assert!(log.contains("draining"), "{log}");
    let after = cluster_status(&url);
    assert!(!after.contains("member m2"), "{after}");
    assert_eq!(after.matches(": 3 shards").count(), 2, "{after}");
    assert!(!after.contains("unavailable"), "{after}");
    for i in 0..KEYS {
        assert_eq!(
            kv.get(key(i)).expect("every shard served").as_deref(),
            Some(format!("v{i}").as_bytes())
        );
    }
}

/// A member whose etcd is not there tries to join every half second, and
/// says why once, not twice each try.
#[test]
fn a_member_without_etcd_says_so_once() {
    let dir = region_dir();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let url = format!("etcd://127.0.0.1:{port}/nowhere");
    let member = start_member(&url, dir.path(), "m0", &[]);
    // Six tries at least.
    std::thread::sleep(Duration::from_secs(3));
    member.signal(libc::SIGTERM);
    let (_, log) = member.wait_exit(Duration::from_secs(60));
    let said = log
        .lines()
        .filter(|l| l.contains("WARN") && l.contains(&format!("127.0.0.1:{port}")))
        .count();
    assert_eq!(said, 1, "{log}");
}
