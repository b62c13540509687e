//! Reclamation by report: the blocks clients unlink are freed without an
//! index scan; a forged or repeated report frees nothing anyone references;
//! and a client killed before it reported what it unlinked leaks nothing
//! once it is gone, without anyone asking for a collection.

use std::os::unix::net::UnixStream;
use std::process::{Command, Stdio};
use std::time::Duration;

use kv_client::Client;
use kv_common::layout::class_size;
use kv_common::protocol::{Request, Response, Spent, Unlinked, START_GRANULE};
use kv_server::Server;
use onekv_tests::{
    aggressive_reuse, control_call as call, eventually, or_abort, region_dir, test_config,
    workspace_bin, TestServer,
};

#[test]
fn unlinked_blocks_are_reclaimed_without_anyone_asking() {
    let srv = TestServer::start(aggressive_reuse);
    std::thread::scope(|s| {
        for t in 0..2 {
            let address = &srv.address;
            s.spawn(move || {
                let mut kv = or_abort(Client::connect(address), "connect");
                for i in 0..20_000u32 {
                    let key = format!("k{t}-{}", i % 50);
                    or_abort(kv.put(key.as_bytes(), [i as u8; 1000]), "put");
                }
                or_abort(kv.close(), "close");
            });
        }
    });
    // Every update unlinked the block before it: 2 × (20 000 − 50), about
    // 50 MB through a 64 MiB region. All of it comes back but the extents
    // that hold the 100 live blocks (each client's last, at most).
    let unlinked = 2 * (20_000 - 50);
    let chunk = srv.server.geometry().chunk_size;
    eventually("the garbage to be freed", Duration::from_secs(20), || {
        let s = srv.server.stats();
        s.reported_blocks == unlinked && s.heap_free + 2 * chunk + (1 << 20) >= s.heap_size
    });
    let mut kv = Client::connect(&srv.address).unwrap();
    assert_eq!(
        kv.get(b"k1-49").unwrap(),
        Some(vec![(19_999u32) as u8; 1000])
    );
}

/// A raw control connection that has sent Connect.
fn liar(srv: &TestServer) -> UnixStream {
    onekv_tests::connected_control(srv)
}

fn value(i: usize, round: usize) -> Vec<u8> {
    format!("value {i} {round} {}", "x".repeat(i * 7 % 900)).into_bytes()
}

/// The block a key's one slot names, as a report would name it.
fn block_of(srv: &TestServer, key: &str) -> Unlinked {
    let slots = srv.server.slots_of(key.as_bytes()).unwrap();
    assert_eq!(slots.len(), 1, "{key}");
    let slot = slots[0].1;
    Unlinked {
        offset: slot.offset(),
        class: slot.class(),
    }
}

/// Reports of blocks the index references (`live`), of parts of them, of
/// blocks already freed (`old`, three times over), and of no block at all.
fn forged_reports(live: &[Unlinked], old: &[Unlinked]) -> Vec<Unlinked> {
    let mut forged = Vec::new();
    for u in live {
        // The live block itself, with other classes, and starting inside it.
        forged.push(*u);
        forged.push(Unlinked {
            class: u.class + 1,
            ..*u
        });
        forged.push(Unlinked {
            class: u.class.saturating_sub(1),
            ..*u
        });
        for inside in [START_GRANULE, 64, class_size(u.class) / 2] {
            forged.push(Unlinked {
                offset: u.offset + inside / START_GRANULE * START_GRANULE,
                class: 0,
            });
        }
    }
    // Blocks already unlinked and freed, three times over.
    for _ in 0..3 {
        forged.extend_from_slice(old);
    }
    // Nowhere near a block.
    for offset in [0, 8, 4096, u64::MAX - 64, 1 << 46] {
        forged.push(Unlinked { offset, class: 0 });
        forged.push(Unlinked {
            offset,
            class: u8::MAX,
        });
    }
    forged
}

/// Leases space, writes nothing, gives it back declared full of blocks,
/// and reports them all (nothing there reads as a block).
fn declare_a_lease_full_of_blocks(s: &mut UnixStream) {
    let mine = match call(s, &Request::Lease { min_len: 64 }) {
        Some(Response::Leased { extents: es, .. }) => es[0],
        other => panic!("lease refused: {other:?}"),
    };
    let fake: Vec<Unlinked> = (0..mine.len / 64)
        .map(|k| Unlinked {
            offset: mine.offset + k * 64,
            class: 0,
        })
        .collect();
    let spent = Spent {
        extent: mine,
        carved: mine.len,
        starts: vec![0xff; (mine.len / START_GRANULE / 8) as usize],
    };
    let reply = call(
        s,
        &Request::GiveBack {
            spent: vec![spent],
            unlinked: fake.into_iter().take(2000).collect(),
        },
    );
    assert_eq!(reply, Some(Response::GivenBack));
}

#[test]
fn forged_and_repeated_reports_free_nothing_referenced() {
    // A small region that cannot grow: whatever is freed is soon reused.
    let srv = TestServer::start(|c| {
        aggressive_reuse(c);
        c.memory = 4 << 20;
        c.max_memory = Some(4 << 20);
    });
    let mut honest = Client::connect(&srv.address).unwrap();
    for i in 0..300 {
        honest.put(format!("h{i}").as_bytes(), value(i, 0)).unwrap();
    }
    // A hundred updates: their old blocks are unlinked, reported, freed.
    let old: Vec<Unlinked> = (0..100).map(|i| block_of(&srv, &format!("h{i}"))).collect();
    for i in 0..100 {
        honest.put(format!("h{i}").as_bytes(), value(i, 1)).unwrap();
    }
    honest.close().unwrap();
    let live: Vec<Unlinked> = (0..300).map(|i| block_of(&srv, &format!("h{i}"))).collect();

    let forged = forged_reports(&live, &old);
    let mut s = liar(&srv);
    for part in forged.chunks(1000) {
        let reply = call(
            &mut s,
            &Request::Unlinked {
                blocks: part.to_vec(),
            },
        );
        assert!(matches!(reply, Some(Response::Noted { .. })), "{reply:?}");
    }
    declare_a_lease_full_of_blocks(&mut s);

    // Fill the region to the last hole: space freed wrongly is written
    // over.
    let mut filler = Client::connect(&srv.address).unwrap();
    let mut filled = 0;
    loop {
        match filler.put(format!("f{filled}").as_bytes(), [7u8; 100]) {
            Ok(()) => filled += 1,
            Err(kv_client::Error::RegionFull { .. }) => break,
            Err(e) => panic!("filling: {e}"),
        }
    }
    assert!(filled > 10_000, "only {filled} keys fit");
    let mut reader = Client::connect(&srv.address).unwrap();
    for i in 0..300 {
        let round = usize::from(i < 100);
        assert_eq!(
            reader.get(format!("h{i}").as_bytes()).unwrap(),
            Some(value(i, round)),
            "h{i}"
        );
    }
    let stats = srv.server.stats();
    assert!(
        stats.heap_free + stats.heap_leased <= stats.heap_size,
        "{stats:?}"
    );
    assert!(
        stats.refused_reports >= forged.len() as u64,
        "{} forged reports, {} refused: {stats:?}",
        forged.len(),
        stats.refused_reports
    );
}

#[test]
fn a_client_killed_before_reporting_leaks_nothing_once_gone() {
    let dir = region_dir();
    let path = dir.path().join("region");
    let mut config = test_config(&path);
    config.op_deadline = Duration::from_millis(10);
    config.memory = 16 << 20;
    let address = config.address.to_string();
    let server = Server::start(config.clone()).unwrap();
    // A live client holds a lease the whole time: blocks the killed one
    // unlinked in it are never reported.
    let mut bystander = Client::connect(&address).unwrap();
    bystander.put(b"bystander", b"here").unwrap();
    for round in 0..3 {
        let connects = server.stats().connects;
        let mut child = Command::new(workspace_bin("kv-churn"))
            .args([&address, &format!("k{round}"), "40"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start kv-churn");
        // On a loaded machine the process may take a while to start.
        eventually("the churner connected", Duration::from_secs(60), || {
            server.stats().connects > connects
        });
        // The bystander writes the churner's keys meanwhile, into its own
        // lease: the churner unlinks blocks there, and then dies.
        for i in 0..2000 {
            bystander
                .put(format!("k{round}-{}", i % 40).as_bytes(), vec![7; 900])
                .unwrap();
        }
        std::thread::sleep(Duration::from_millis(100));
        // Its departure must come after the scans counted here.
        if let Ok(Some(status)) = child.try_wait() {
            let mut why = String::new();
            if let Some(mut stderr) = child.stderr.take() {
                let _ = std::io::Read::read_to_string(&mut stderr, &mut why);
            }
            panic!("kv-churn ended before it was killed ({status}): {why}");
        }
        let scans = server.stats().index_scans;
        child.kill().unwrap();
        child.wait().unwrap();
        // The scan its departure calls for comes and goes while the
        // bystander's lease is still out (a scan does not look into one).
        // Generous: on a loaded 2-core machine the churner's death and the
        // scan wait their turn (20 s was once too short in a full run).
        eventually("the departure's scan", Duration::from_secs(60), || {
            server.stats().index_scans > scans
        });
        bystander.put(b"bystander", b"still here").unwrap();
    }
    // Its lease comes back: only a scan after that finds what the dead
    // clients unlinked there and never reported.
    bystander.close().unwrap();
    // Nobody asks for a collection: the server must see to it.
    eventually(
        "the departed clients' space",
        Duration::from_secs(60),
        || {
            let s = server.stats();
            s.clients_connected == 0 && s.departures >= 3 && s.heap_leased == 0
        },
    );
    std::thread::sleep(config.grace() * 4 + Duration::from_millis(500));
    let running = server.stats();
    drop(server);
    let fresh = onekv_tests::reopen(config).stats();
    assert_eq!(
        running.heap_free, fresh.heap_free,
        "space lost: running {running:?}, reopened {fresh:?}"
    );
}

#[test]
fn space_a_client_gives_back_uncarved_is_free_at_once() {
    let srv = TestServer::start(|_| {});
    let mut s = liar(&srv);
    let before = srv.server.stats().heap_free;
    let Some(Response::Leased { extents: es, .. }) = call(&mut s, &Request::Lease { min_len: 64 })
    else {
        panic!("no lease");
    };
    let spent: Vec<Spent> = es
        .iter()
        .map(|&extent| Spent {
            extent,
            carved: 0,
            starts: vec![],
        })
        .collect();
    let reply = call(
        &mut s,
        &Request::GiveBack {
            spent,
            unlinked: vec![],
        },
    );
    assert_eq!(reply, Some(Response::GivenBack));
    assert_eq!(srv.server.stats().heap_free, before);
}
