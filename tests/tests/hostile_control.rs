//! A client that lies on the control channel: it gives back space it never
//! leased (another client's live blocks), the same space twice, overlapping
//! extents, floods of give-backs, and hoards space then vanishes. Each lie is
//! refused whole (or the hoard reclaimed), the liar is cut off after a few,
//! honest clients keep their data, and the server's bookkeeping stays put.

use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use kv_client::{Client, Error};
use kv_common::protocol::{ErrorKind, Extent, Request, Response, ServerStats, Spent};
use onekv_tests::{control_call as call, TestServer};

/// A raw control connection that has sent Connect.
fn liar(srv: &TestServer) -> UnixStream {
    onekv_tests::connected_control(srv)
}

fn lease(s: &mut UnixStream) -> Extent {
    match call(s, &Request::Lease { min_len: 64 }) {
        Some(Response::Leased { extents: es, .. }) if es.len() == 1 => es[0],
        other => panic!("lease refused: {other:?}"),
    }
}

fn give_back(s: &mut UnixStream, extents: Vec<Extent>) -> Option<Response> {
    let spent = extents.into_iter().map(Spent::undeclared).collect();
    call(
        s,
        &Request::GiveBack {
            spent,
            unlinked: vec![],
        },
    )
}

fn is_refused(r: &Option<Response>) -> bool {
    matches!(
        r,
        Some(Response::Error {
            kind: ErrorKind::BadExtent,
            ..
        })
    )
}

fn honest_value(i: usize) -> Vec<u8> {
    format!("value {i} {}", "x".repeat(i)).into_bytes()
}

/// A well-behaved client that has stored 300 keys.
fn honest_client(srv: &TestServer) -> Client {
    let mut kv = Client::connect(&srv.address).unwrap();
    for i in 0..300 {
        kv.put(format!("honest-{i}").as_bytes(), honest_value(i))
            .unwrap();
    }
    kv
}

/// Every key of the honest client reads back as written.
fn honest_data(kv: &mut Client) {
    for i in 0..300 {
        let key = format!("honest-{i}");
        assert_eq!(
            kv.get(key.as_bytes()).unwrap(),
            Some(honest_value(i)),
            "{key}"
        );
    }
}

fn consistent(s: &ServerStats) {
    assert!(
        s.heap_free + s.heap_leased <= s.heap_size,
        "space counted twice: {s:?}"
    );
}

#[test]
fn give_backs_of_space_a_client_does_not_hold_are_refused_whole() {
    let srv = TestServer::start(|c| c.op_deadline = Duration::from_millis(5));
    let g = srv.server.geometry();
    let mut honest = honest_client(&srv);
    // The honest client leased first: its blocks start at the heap.
    let theirs = Extent {
        offset: g.heap_offset,
        len: 4096,
    };

    let mut s = liar(&srv);
    let mine = lease(&mut s);
    assert!(is_refused(&give_back(&mut s, vec![theirs])));
    // All or nothing: a message with one bad extent changes nothing...
    assert!(is_refused(&give_back(&mut s, vec![mine, theirs])));
    // ...so its good extent is still ours to give back, once.
    assert_eq!(give_back(&mut s, vec![mine]), Some(Response::GivenBack));
    assert!(is_refused(&give_back(&mut s, vec![mine])));
    // Third offence: cut off.
    assert_eq!(call(&mut s, &Request::Stats), None);

    let mut s = liar(&srv);
    let e = lease(&mut s);
    let overlapping = vec![
        Extent {
            offset: e.offset,
            len: 128,
        },
        Extent {
            offset: e.offset + 64,
            len: 128,
        },
    ];
    assert!(is_refused(&give_back(&mut s, overlapping)));
    let empty_and_wrapping = vec![Extent {
        offset: u64::MAX - 63,
        len: 128,
    }];
    assert!(is_refused(&give_back(&mut s, empty_and_wrapping)));
    for absurd in [0, u64::MAX, g.chunk_size + 1] {
        let r = call(&mut s, &Request::Lease { min_len: absurd });
        assert!(
            matches!(
                r,
                Some(Response::Error {
                    kind: ErrorKind::Malformed,
                    ..
                }) | None
            ),
            "lease of {absurd}: {r:?}"
        );
    }

    // The liars hurt nobody: reclaim everything that can be, then read.
    std::thread::sleep(Duration::from_millis(50));
    srv.server.collect_now();
    honest_data(&mut honest);
    let stats = srv.server.stats();
    assert!(stats.refused_give_backs >= 4, "{stats:?}");
    consistent(&stats);
    honest.close().unwrap();
}

fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

#[test]
fn a_flood_of_give_backs_is_cut_off_and_grows_nothing() {
    let srv = TestServer::start(|c| c.max_memory = Some(c.memory));
    let g = srv.server.geometry();
    let mut honest = honest_client(&srv);
    let before = srv.server.stats();
    let rss_before = rss_kib();
    // Each message as large as the protocol allows: ~3 600 extents.
    let flood: Vec<Extent> = (0..3600)
        .map(|i| Extent {
            offset: g.heap_offset + i * 64,
            len: 64,
        })
        .collect();
    let mut cut_off = 0;
    for _ in 0..200 {
        let mut s = liar(&srv);
        loop {
            match give_back(&mut s, flood.clone()) {
                Some(r) => assert!(is_refused(&Some(r))),
                None => {
                    cut_off += 1;
                    break;
                }
            }
        }
    }
    assert_eq!(cut_off, 200, "a flooding client was never disconnected");
    let after = srv.server.stats();
    assert_eq!(after.heap_free, before.heap_free, "{after:?}");
    assert_eq!(after.heap_leased, before.heap_leased, "{after:?}");
    assert!(after.refused_give_backs >= 600);
    // 200 × 3 messages × 58 KiB went by; the server kept none of it.
    let grown = rss_kib().saturating_sub(rss_before);
    assert!(grown < 32 << 10, "memory grew by {grown} KiB under a flood");
    honest_data(&mut honest);
    honest.close().unwrap();
}

#[test]
fn space_a_client_hoards_comes_back_when_it_vanishes() {
    // A region that cannot grow, so hoarding can exhaust it.
    let srv = TestServer::start(|c| {
        c.op_deadline = Duration::from_millis(5);
        c.max_memory = Some(c.memory);
    });
    let total = srv.server.stats().heap_free;
    let mut s = liar(&srv);
    let mut hoard = 0;
    while let Some(Response::Leased { extents: es, .. }) =
        call(&mut s, &Request::Lease { min_len: 64 })
    {
        hoard += es.iter().map(|e| e.len).sum::<u64>();
    }
    assert_eq!(hoard, total, "the hoarder did not get everything");
    let mut honest = Client::connect(&srv.address).unwrap();
    match honest.put(b"k", b"v") {
        Err(Error::RegionFull { .. }) => {}
        other => panic!("expected RegionFull while space is hoarded, got {other:?}"),
    }
    // The hoarder vanishes without a word (as a killed process would).
    drop(s);
    let deadline = Instant::now() + Duration::from_secs(10);
    while srv.server.stats().heap_free < total {
        assert!(
            Instant::now() < deadline,
            "hoarded space never came back: {:?}",
            srv.server.stats()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    honest.put(b"k", b"v").unwrap();
    assert_eq!(honest.get(b"k").unwrap().as_deref(), Some(&b"v"[..]));
    assert_eq!(srv.server.stats().departures, 1);
}

/// Resize requests one after another (with and without a key said to have
/// found no room): the index doubles only while it is small, then every
/// request is declined and counted, and the index keeps its size.
#[test]
fn resize_requests_do_not_balloon_an_index_that_is_not_full() {
    let srv = TestServer::start(|_| {});
    let mut kv = honest_client(&srv);
    let mut declined = 0;
    for _ in 0..14 {
        match kv.resize() {
            Ok(_) => {}
            Err(Error::ResizeDeclined) => declined += 1,
            Err(e) => panic!("resize: {e}"),
        }
    }
    let buckets = srv.server.geometry().bucket_count;
    // Up to an index of 1 MiB (16 Ki buckets) a doubling costs nothing.
    assert!(
        buckets <= 1 << 14,
        "the index ballooned to {buckets} buckets"
    );
    assert!(declined >= 6, "{declined} declined");
    // A raw request naming a key whose buckets have room is declined too.
    let mut s = liar(&srv);
    for _ in 0..10 {
        let epoch = srv.server.geometry().epoch;
        let ask = Request::Resize {
            epoch,
            full_key: Some(b"honest-1".to_vec()),
        };
        match call(&mut s, &ask) {
            Some(Response::Geometry(info)) => assert!(!info.resizing),
            other => panic!("{other:?}"),
        }
    }
    let stats = srv.server.stats();
    assert_eq!(stats.bucket_count, buckets);
    assert!(stats.declined_resizes >= declined + 10, "{stats:?}");
    honest_data(&mut kv);
}
