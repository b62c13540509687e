//! The Prometheus endpoint: scraped over loopback HTTP, its numbers follow
//! what clients do.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use kv_client::{Client, ClientOptions, Error};
use onekv_tests::{eventually, Daemon, TestServer};

/// One `GET path` over HTTP/1.0: the status line, the headers and the body.
fn http_get(at: SocketAddr, path: &str) -> (String, String) {
    let mut s = TcpStream::connect(at).expect("metrics endpoint accepts");
    s.set_read_timeout(Some(Duration::from_secs(30)))
        .expect("read timeout");
    write!(s, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").expect("request sent");
    let mut reply = String::new();
    s.read_to_string(&mut reply).expect("reply read");
    let (head, body) = reply.split_once("\r\n\r\n").expect("headers end");
    (head.to_string(), body.to_string())
}

/// The samples of a Prometheus text exposition, by name with labels.
fn scrape(at: SocketAddr) -> HashMap<String, f64> {
    let (head, body) = http_get(at, "/metrics");
    assert!(
        head.starts_with("HTTP/1.0 200") || head.starts_with("HTTP/1.1 200"),
        "{head}"
    );
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: text/plain; version=0.0.4"),
        "{head}"
    );
    body.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (name, value) = l.rsplit_once(' ').expect("sample has a value");
            (
                name.to_string(),
                value.parse().expect("sample value is a number"),
            )
        })
        .collect()
}

fn sample(m: &HashMap<String, f64>, name: &str) -> f64 {
    *m.get(name)
        .unwrap_or_else(|| panic!("no sample {name} in {m:?}"))
}

#[test]
fn the_metrics_follow_clients_leases_refusals_and_the_index() {
    let t = TestServer::start(|c| {
        c.metrics_listen = Some("127.0.0.1:0".parse().expect("address"));
        c.secret = Some(b"sesame".to_vec());
    });
    let at = t.server.metrics_address().expect("metrics endpoint on");
    let before = scrape(at);
    assert_eq!(sample(&before, "onekv_clients_connected"), 0.0);
    assert_eq!(sample(&before, "onekv_connects_total"), 0.0);
    assert_eq!(sample(&before, "onekv_index_slots_used"), 0.0);
    assert!(sample(&before, "onekv_heap_size_bytes") > 0.0);
    assert!(sample(&before, "onekv_region_size_bytes") >= 16.0 * 1024.0 * 1024.0);

    let options = ClientOptions::default().with_secret(b"sesame".to_vec());
    let mut kv = Client::connect_with(&t.address, options).expect("client connects");
    for i in 0..200 {
        kv.put(format!("key{i}").as_bytes(), [7u8; 100])
            .expect("put");
    }
    let wrong = ClientOptions::default().with_secret(b"open up".to_vec());
    assert!(matches!(
        Client::connect_with(&t.address, wrong),
        Err(Error::Refused(_))
    ));

    let during = scrape(at);
    assert_eq!(sample(&during, "onekv_clients_connected"), 1.0);
    assert_eq!(sample(&during, "onekv_connects_total"), 1.0);
    assert_eq!(
        sample(&during, "onekv_connects_refused_total{reason=\"secret\"}"),
        1.0
    );
    assert_eq!(
        sample(
            &during,
            "onekv_connects_refused_total{reason=\"max_clients\"}"
        ),
        0.0
    );
    assert!(sample(&during, "onekv_leases_total") >= 1.0);
    assert!(sample(&during, "onekv_heap_leased_bytes") > 0.0);
    assert!(sample(&during, "onekv_control_cpu_seconds_total") >= 0.0);
    // The scrape asked for a fresh index scan; the next ones show it.
    eventually(
        "the scan counts the 200 keys",
        Duration::from_secs(30),
        || sample(&scrape(at), "onekv_index_slots_used") == 200.0,
    );
    let m = scrape(at);
    let occupancy = sample(&m, "onekv_index_occupancy_ratio");
    assert!(
        (occupancy - 200.0 / sample(&m, "onekv_index_slots")).abs() < 1e-9,
        "{occupancy}"
    );

    kv.close().expect("goodbye");
    eventually("the client is gone", Duration::from_secs(30), || {
        let m = scrape(at);
        sample(&m, "onekv_clients_connected") == 0.0 && sample(&m, "onekv_disconnects_total") == 1.0
    });

    let (head, _) = http_get(at, "/elsewhere");
    assert!(head.contains(" 404"), "{head}");
}

#[test]
fn a_stalled_scraper_neither_blocks_other_scrapes_nor_the_shutdown() {
    let t = TestServer::start(|c| {
        c.metrics_listen = Some("127.0.0.1:0".parse().expect("address"));
    });
    let at = t.server.metrics_address().expect("metrics endpoint on");
    // One connects and says nothing; another trickles a request and never
    // finishes it.
    let _silent = TcpStream::connect(at).expect("connects");
    let mut trickle = TcpStream::connect(at).expect("connects");
    trickle.write_all(b"GET /met").expect("partial request");
    let m = scrape(at);
    assert_eq!(sample(&m, "onekv_clients_connected"), 0.0);
    // A request that is not a GET is refused, not served.
    let mut post = TcpStream::connect(at).expect("connects");
    post.set_read_timeout(Some(Duration::from_secs(30)))
        .expect("read timeout");
    post.write_all(b"POST /metrics HTTP/1.0\r\n\r\n")
        .expect("sent");
    let mut reply = String::new();
    post.read_to_string(&mut reply).expect("reply");
    assert!(reply.starts_with("HTTP/1.1 405"), "{reply}");
    // The stalled connections are still open: the server stops anyway
    // (with an endpoint that waited for them, this would hang).
    drop(t);
}

#[test]
fn the_daemon_serves_metrics_when_asked() {
    let dir = onekv_tests::region_dir();
    let region = dir.path().join("region");
    let address = kv_common::Address::Shm {
        region: region.clone(),
    };
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let listen = format!("127.0.0.1:{port}");
    let daemon = Daemon::start(&address, &region, &["--metrics-listen", &listen]);
    let at: SocketAddr = listen.parse().expect("address");
    let mut kv = Client::connect(&address.to_string()).expect("client connects");
    kv.put(b"k", b"v").expect("put");
    eventually("a scrape shows the client", Duration::from_secs(30), || {
        TcpStream::connect(at).is_ok() && sample(&scrape(at), "onekv_clients_connected") == 1.0
    });
    drop(kv);
    let (status, log) = daemon.terminate();
    assert!(status.success(), "{log}");
}

/// Three hundred idle connections and ten that trickle a byte of their
/// request every 100 ms: scrapes are answered all the same, not after
/// each held connection has timed out in turn (Prometheus gives up on a
/// scrape after 10 s by default).
#[test]
fn scrapes_are_answered_while_slow_and_idle_connections_are_held() {
    onekv_tests::raise_descriptor_limit();
    let t = TestServer::start(|c| {
        c.metrics_listen = Some("127.0.0.1:0".parse().expect("address"));
    });
    let at = t.server.metrics_address().expect("metrics endpoint on");
    let idle: Vec<TcpStream> = (0..300)
        .map(|_| TcpStream::connect(at).expect("connects"))
        .collect();
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut slow: Vec<TcpStream> = (0..10)
                .map(|_| TcpStream::connect(at).expect("connects"))
                .collect();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for c in &mut slow {
                    let _ = c.write_all(b"G");
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        for _ in 0..3 {
            let started = std::time::Instant::now();
            let m = scrape(at);
            assert!(sample(&m, "onekv_control_connections") >= 0.0);
            let took = started.elapsed();
            assert!(took < Duration::from_secs(5), "a scrape took {took:?}");
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    drop(idle);
}
