//! Measures what increments see while their server restarts: two threads
//! increment 20 counters while a `kv-server` daemon on shm is stopped
//! (SIGTERM) and started again on its region every 1.5 s, RESTARTS times.
//! Prints the increments acknowledged, those whose outcome is unknown and
//! the other errors (the server unreachable: nothing applied), and checks
//! every counter: acknowledged ≤ final ≤ acknowledged + unknown.
//!
//! usage: cargo run --release -p onekv-tests --example restart_counters [RESTARTS]
//! (after `cargo build --release --bins`, for the daemon)

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kv_client::{Client, Error};
use kv_common::Address;
use onekv_tests::Daemon;

const KEYS: usize = 20;
const UPTIME: Duration = Duration::from_millis(1500);

/// What the incrementing threads saw, per counter.
struct Seen {
    acked: Vec<i64>,
    unknown: Vec<i64>,
    other: u64,
}

impl Seen {
    fn new() -> Seen {
        Seen {
            acked: vec![0; KEYS],
            unknown: vec![0; KEYS],
            other: 0,
        }
    }
}

fn main() {
    let restarts: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(5);
    let dir = onekv_tests::region_dir();
    let region = dir.path().join("region");
    let address = Address::Shm {
        region: region.clone(),
    };
    let url = address.to_string();
    let extra = ["--memory", "64MiB", "--stats-interval", "0"];
    let mut daemon = Daemon::start(&address, &region, &extra);
    // Created first: a new counter waits three deadlines to settle.
    let mut kv = onekv_tests::or_abort(Client::connect(&url), "connect");
    for k in 0..KEYS {
        onekv_tests::or_abort(kv.incr(format!("c{k}"), 0), "create a counter");
    }
    let stop = AtomicBool::new(false);
    let seen = Mutex::new(Seen::new());
    let began = Instant::now();
    // The daemon is handed back by the scope that restarts it, and stops
    // when the count is over.
    let _daemon = std::thread::scope(|s| {
        for t in 0..2 {
            let (stop, seen, url) = (&stop, &seen, &url);
            s.spawn(move || increment(url, t, stop, seen));
        }
        for _ in 0..restarts {
            std::thread::sleep(UPTIME);
            let (status, log) = daemon.terminate();
            assert!(status.success(), "kv-server: {log}");
            daemon = Daemon::start(&address, &region, &extra);
        }
        std::thread::sleep(UPTIME);
        stop.store(true, Ordering::Relaxed);
        daemon
    });
    let seen = seen.into_inner().expect("the threads' counts");
    let mut out_of_bounds = 0;
    for k in 0..KEYS {
        let now = onekv_tests::or_abort(kv.get_counter(format!("c{k}")), "read a counter");
        let now = now.unwrap_or(0);
        if now < seen.acked[k] || now > seen.acked[k] + seen.unknown[k] {
            out_of_bounds += 1;
        }
    }
    println!(
        "{restarts} restarts in {:.1} s: {} increments acknowledged, {} unknown, {} other errors; \
         {out_of_bounds} counters out of bounds",
        began.elapsed().as_secs_f64(),
        seen.acked.iter().sum::<i64>(),
        seen.unknown.iter().sum::<i64>(),
        seen.other
    );
}

/// Increments random counters until `stop`, adding what it saw to `seen`.
fn increment(url: &str, thread: u64, stop: &AtomicBool, seen: &Mutex<Seen>) {
    let mut kv = onekv_tests::or_abort(Client::connect(url), "connect");
    let mut mine = Seen::new();
    let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ thread;
    while !stop.load(Ordering::Relaxed) {
        let k = (onekv_tests::xorshift(&mut rng) % KEYS as u64) as usize;
        match kv.incr(format!("c{k}"), 1) {
            Ok(_) => mine.acked[k] += 1,
            Err(Error::OutcomeUnknown(_)) => mine.unknown[k] += 1,
            Err(_) => {
                mine.other += 1;
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
    let mut all = seen.lock().expect("the counts");
    for k in 0..KEYS {
        all.acked[k] += mine.acked[k];
        all.unknown[k] += mine.unknown[k];
    }
    all.other += mine.other;
}
