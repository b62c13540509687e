//! Fixed-size loops of each operation, cold (the client reads the buckets
//! first) and warm (it remembers the key's slot from a recent operation),
//! with the raw verbs they are built of as the baseline: one 1-KiB READ and
//! one CAS per round trip. Only the timed operation counts towards the
//! round trips and bytes per op (a warm DELETE's preceding GET does not).
//!
//! On shm, `GET-bound` is what memory allows: a GET that does only what it
//! must (hash, read both windows, read the block, check its xxh3, copy the
//! value) straight on the mapping, with the transport's copy. `GET-batchN`
//! reads N keys per `get_many` (ops count keys; latency is per call).
//! `INCR` has every thread add 1 to one counter and checks the sum.

use std::sync::Barrier;
use std::time::Duration;

// Every operation reads the clock two or three times: the TSC where it is
// invariant (as the client's deadline clock does), not a system call.
use quanta::Instant;

use clap::Args;
use hdrhistogram::Histogram;
use kv_client::Client;
use kv_common::layout::{
    decode_block, set_bits, Geometry, KeyHash, Payload, Slot, CANDIDATE_SLOTS, EPOCH_OFFSET,
};
use kv_common::mapping::SharedRegion;
use kv_common::protocol::{Request, Response, PROTOCOL_VERSION};
use kv_common::transport::{self, Connection, Verb, VerbStats};
use kv_common::Address;

use crate::target::Target;

#[derive(Args)]
pub struct MicroArgs {
    /// Server address; by default an embedded server on a temporary shm region.
    #[arg(long)]
    server: Option<String>,
    /// Distinct keys (loaded before the timed loops).
    #[arg(long, default_value_t = 100_000)]
    keys: u64,
    /// Key length in bytes (keys are zero-padded numbers).
    #[arg(long, default_value_t = 8)]
    key_size: usize,
    /// Value length in bytes.
    #[arg(long, default_value_t = 1024)]
    value_size: usize,
    /// Seconds each loop runs.
    #[arg(long, default_value_t = 2.0)]
    seconds: f64,
    /// Thread counts to run each loop with.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    threads: Vec<usize>,
    /// Keys each thread works on in the warm loops (and inserts ahead of
    /// the DELETE loops): all of them are revisited well within a hint's
    /// life (two operation deadlines).
    #[arg(long, default_value_t = 64)]
    warm_keys: usize,
    /// Initial size of the embedded server's region (default: the server's;
    /// it grows as the keys are loaded).
    #[arg(long, value_parser = kv_common::size::parse_size)]
    memory: Option<u64>,
    /// Keys per `get_many` in the GET-batch loop.
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// Run only these loops (names as in the first column, e.g.
    /// GET-bound,GET-cold); default: all.
    #[arg(long, value_delimiter = ',')]
    ops: Vec<String>,
}

#[derive(Clone, Copy, PartialEq)]
enum Op {
    RawRead,
    RawCas,
    GetBound,
    Get { warm: bool },
    GetBatch,
    Update { warm: bool },
    Insert,
    Delete { warm: bool },
    Incr,
}

impl Op {
    const ALL: [Op; 12] = [
        Op::RawRead,
        Op::RawCas,
        Op::GetBound,
        Op::Get { warm: false },
        Op::Get { warm: true },
        Op::GetBatch,
        Op::Update { warm: false },
        Op::Update { warm: true },
        Op::Insert,
        Op::Delete { warm: false },
        Op::Delete { warm: true },
        Op::Incr,
    ];

    /// One word, so that scripts can pick a line by its first field.
    fn name(self) -> &'static str {
        match self {
            Op::RawRead => "raw-READ-1KiB",
            Op::RawCas => "raw-CAS",
            Op::GetBound => "GET-bound",
            Op::Get { warm: false } => "GET-cold",
            Op::Get { warm: true } => "GET-warm",
            Op::GetBatch => "GET-batch",
            Op::Update { warm: false } => "UPDATE-cold",
            Op::Update { warm: true } => "UPDATE-warm",
            Op::Insert => "INSERT",
            Op::Delete { warm: false } => "DELETE-cold",
            Op::Delete { warm: true } => "DELETE-warm",
            Op::Incr => "INCR",
        }
    }

    fn warm(self) -> bool {
        matches!(
            self,
            Op::Get { warm: true }
                | Op::Update { warm: true }
                | Op::Delete { warm: true }
                | Op::Incr
        )
    }
}

/// The counter every thread of the INCR loop adds to.
const COUNTER: &[u8] = b"micro-counter";

struct LoopResult {
    ops: u64,
    /// Increments whose outcome a lost connection left unknown.
    unknown: u64,
    elapsed: Duration,
    latency: Histogram<u64>,
    verbs: VerbStats,
}

/// Nanosecond latencies from 1 ns to a minute, 3 significant digits.
fn new_histogram() -> Result<Histogram<u64>, String> {
    Histogram::new_with_bounds(1, 60_000_000_000, 3).map_err(|e| e.to_string())
}

fn key(i: u64, size: usize) -> Vec<u8> {
    format!("{i:0size$}").into_bytes()
}

pub fn run(args: MicroArgs) -> Result<(), String> {
    check(&args)?;
    let target = Target::open(args.server.as_deref(), args.memory, None)?;
    let mut loader = Client::connect(&target.address).map_err(|e| e.to_string())?;
    let value = vec![0xabu8; args.value_size];
    for i in 0..args.keys {
        loader
            .put(key(i, args.key_size), &value)
            .map_err(|e| e.to_string())?;
    }
    print_header(&args, &target);
    let server_before = target.server.as_ref().map(|s| s.stats());
    let mut baselines = Baselines::default();
    let on_shm = matches!(Address::parse(&target.address)?, Address::Shm { .. });
    for &threads in &args.threads {
        for op in Op::ALL {
            let chosen = args.ops.is_empty() || args.ops.iter().any(|o| o == op.name());
            if !chosen || (op == Op::GetBound && !on_shm) {
                continue;
            }
            if op == Op::Incr {
                loader.delete(COUNTER).map_err(|e| e.to_string())?;
            }
            let r = run_loop(&target.address, op, threads, &args)?;
            let note = match op {
                Op::Incr => check_counter(&mut loader, &r)?,
                Op::GetBatch => format!("  {} keys per call; latency per call", args.batch),
                _ => String::new(),
            };
            let ratio = baselines.compare(op, r.latency.value_at_quantile(0.5));
            print_line(op, threads, &r, &format!("{ratio}{note}"));
        }
    }
    if let (Some(before), Some(server)) = (server_before, &target.server) {
        let after = server.stats();
        println!(
            "server during the loops: {} control messages ({} heap leases), {} us of CPU, {} index resizes",
            after.messages() - before.messages(),
            after.leases - before.leases,
            after.server_cpu_us - before.server_cpu_us,
            after.resizes - before.resizes
        );
    }
    Ok(())
}

/// Refuses arguments no loop can run with.
fn check(args: &MicroArgs) -> Result<(), String> {
    if args.key_size == 0
        || args.keys == 0
        || args.warm_keys == 0
        || args.batch == 0
        || args.threads.is_empty()
    {
        return Err(
            "--keys, --key-size, --warm-keys, --batch and --threads must be positive".into(),
        );
    }
    let most = crate::workload::MAX_THREADS;
    if args.threads.iter().any(|&t| t > most) {
        return Err(format!("--threads: at most {most}"));
    }
    if let Some(unknown) = args
        .ops
        .iter()
        .find(|o| Op::ALL.iter().all(|op| op.name() != *o))
    {
        let names: Vec<&str> = Op::ALL.iter().map(|op| op.name()).collect();
        return Err(format!(
            "--ops: no loop named {unknown}; the loops are {}",
            names.join(", ")
        ));
    }
    if !(args.seconds.is_finite() && args.seconds > 0.0) {
        return Err("--seconds must be a positive number".into());
    }
    Ok(())
}

fn print_header(args: &MicroArgs, target: &Target) {
    println!(
        "onekv micro-benchmark: {} keys of {} B, values of {} B, {} s per loop, server {}",
        args.keys, args.key_size, args.value_size, args.seconds, target.address
    );
    println!(
        "{:<14} {:>7} {:>11} {:>8} {:>8} {:>9} {:>8} {:>10} {:>10}",
        "operation",
        "threads",
        "ops/s",
        "p50 us",
        "p99 us",
        "p999 us",
        "rt/op",
        "read B/op",
        "write B/op"
    );
}

/// Every increment acknowledged is in the counter's sum, and each one a
/// lost connection left unknown may be: the note that says so, or why not.
fn check_counter(loader: &mut Client, r: &LoopResult) -> Result<String, String> {
    let sum = loader.get_counter(COUNTER).map_err(|e| e.to_string())?;
    let range = r.ops as i64..=(r.ops + r.unknown) as i64;
    if !sum.is_some_and(|s| range.contains(&s)) {
        return Err(format!(
            "INCR: {} increments (+{} unknown), the counter holds {sum:?}",
            r.ops, r.unknown
        ));
    }
    Ok(match r.unknown {
        0 => format!("  sum {} = increments", r.ops),
        u => format!("  sum {sum:?}: {} increments, {u} outcomes unknown", r.ops),
    })
}

/// The median latencies the other loops are compared with (0: not run).
#[derive(Default)]
struct Baselines {
    raw_read: u64,
    get_bound: u64,
}

impl Baselines {
    /// Notes `p50` if `op` is a baseline; else how it compares with one.
    fn compare(&mut self, op: Op, p50: u64) -> String {
        match op {
            Op::RawRead => self.raw_read = p50,
            Op::GetBound => self.get_bound = p50,
            _ => {}
        }
        match op {
            Op::RawRead | Op::RawCas | Op::GetBound => String::new(),
            Op::Get { .. } if self.get_bound > 0 => format!(
                "  p50 = {:.2}x GET-bound",
                p50 as f64 / self.get_bound as f64
            ),
            _ if self.raw_read > 0 => {
                format!("  p50 = {:.1}x raw READ", p50 as f64 / self.raw_read as f64)
            }
            _ => String::new(),
        }
    }
}

fn print_line(op: Op, threads: usize, r: &LoopResult, notes: &str) {
    let per = |v: u64| v as f64 / r.ops.max(1) as f64;
    println!(
        "{:<14} {:>7} {:>11.0} {:>8.2} {:>8.2} {:>9.2} {:>8.2} {:>10.0} {:>10.0}{notes}",
        op.name(),
        threads,
        r.ops as f64 / r.elapsed.as_secs_f64(),
        r.latency.value_at_quantile(0.5) as f64 / 1000.0,
        r.latency.value_at_quantile(0.99) as f64 / 1000.0,
        r.latency.value_at_quantile(0.999) as f64 / 1000.0,
        per(r.verbs.round_trips),
        per(r.verbs.bytes_read),
        per(r.verbs.bytes_written),
    );
}

fn run_loop(address: &str, op: Op, threads: usize, args: &MicroArgs) -> Result<LoopResult, String> {
    let barrier = Barrier::new(threads);
    let results: Vec<Result<LoopResult, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let th = LoopThread {
                    address,
                    op,
                    t,
                    barrier: &barrier,
                    args,
                    duration: Duration::from_secs_f64(args.seconds),
                };
                s.spawn(move || worker(&th))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("worker panicked".into())))
            .collect()
    });
    let mut total = LoopResult {
        ops: 0,
        unknown: 0,
        elapsed: Duration::ZERO,
        latency: new_histogram()?,
        verbs: VerbStats::default(),
    };
    for r in results {
        let r = r?;
        total.ops += r.ops;
        total.unknown += r.unknown;
        total.elapsed = total.elapsed.max(r.elapsed);
        total.latency.add(&r.latency).map_err(|e| e.to_string())?;
        total.verbs.add(&r.verbs);
    }
    Ok(total)
}

/// What each thread of a loop is given.
struct LoopThread<'a> {
    address: &'a str,
    op: Op,
    /// The thread's number.
    t: usize,
    /// Every thread of the loop starts timing together.
    barrier: &'a Barrier,
    args: &'a MicroArgs,
    /// How long the loop runs.
    duration: Duration,
}

/// One thread of a loop. Throughput counts the timed operations' time
/// only, in every loop, so that they compare.
fn worker(th: &LoopThread) -> Result<LoopResult, String> {
    let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ (th.t as u64 + 1).wrapping_mul(0x2545_f491_4f6c_dd1d);
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    match th.op {
        Op::Get { .. }
        | Op::GetBatch
        | Op::Update { .. }
        | Op::Insert
        | Op::Delete { .. }
        | Op::Incr => kv_worker(th, &mut next),
        Op::GetBound => bound_worker(th, &mut next),
        Op::RawRead | Op::RawCas => raw_worker(th, &mut next),
    }
}

/// A thread of a key-value operation's loop, through a client.
fn kv_worker(th: &LoopThread, next: &mut impl FnMut() -> u64) -> Result<LoopResult, String> {
    let mut latency = new_histogram()?;
    let mut ops = 0u64;
    let mut kv = KvLoop::connect(th.address, th.op, th.t, th.args)?;
    // Hints settle after every thread is ready, so none waits long
    // enough here for its hints to go stale.
    th.barrier.wait();
    kv.settle_hints()?;
    th.barrier.wait();
    let start = Instant::now();
    while start.elapsed() < th.duration {
        ops += kv.step(next, &mut latency)?;
    }
    // Throughput counts the timed operations' time only: a warm
    // DELETE's set-up waits for hints to settle.
    Ok(LoopResult {
        ops,
        unknown: kv.unknown,
        elapsed: kv.busy,
        latency,
        verbs: kv.timed,
    })
}

/// A thread of the GET-bound loop, on the mapping itself.
fn bound_worker(th: &LoopThread, next: &mut impl FnMut() -> u64) -> Result<LoopResult, String> {
    let args = th.args;
    let mut latency = new_histogram()?;
    let mut ops = 0u64;
    let (mut conn, g) = raw_connection(th.address)?;
    let Address::Shm { region } = Address::parse(th.address)? else {
        return Err("GET-bound runs on shm only".into());
    };
    let region = SharedRegion::for_client(&region, g.region_len).map_err(|e| e.to_string())?;
    let mut bound = BoundGet::new(&g, args.value_size);
    th.barrier.wait();
    let start = Instant::now();
    let mut missed = 0u64;
    let mut busy = Duration::ZERO;
    while start.elapsed() < th.duration {
        let k = key(next() % args.keys, args.key_size);
        let t0 = Instant::now();
        missed += u64::from(!bound.get(&region, &k)?);
        let took = t0.elapsed();
        latency.saturating_record(took.as_nanos() as u64);
        busy += took;
        ops += 1;
    }
    if missed > 0 {
        // Only a resize after the geometry was read does that.
        return Err(format!("GET-bound missed {missed} of {ops} keys"));
    }
    let _ = conn.call(&Request::Disconnect);
    Ok(LoopResult {
        ops,
        unknown: 0,
        elapsed: busy,
        latency,
        verbs: VerbStats::default(),
    })
}

/// A thread of a raw verb's loop: a READ of 1 KiB, or a CAS.
fn raw_worker(th: &LoopThread, next: &mut impl FnMut() -> u64) -> Result<LoopResult, String> {
    let mut latency = new_histogram()?;
    let mut ops = 0u64;
    let (mut conn, g) = raw_connection(th.address)?;
    let before = *conn.stats();
    th.barrier.wait();
    let start = Instant::now();
    let mut busy = Duration::ZERO;
    while start.elapsed() < th.duration {
        let verb = if th.op == Op::RawRead {
            let bucket = next() % g.bucket_count;
            // 16 buckets = 1 KiB, like a 1 KiB value.
            let first = bucket.min(g.bucket_count.saturating_sub(16));
            Verb::Read {
                remote: g.bucket_offset(first),
                local: 0,
                len: 1024,
            }
        } else {
            // On the epoch word, expecting a value it never holds:
            // the CAS compares and never writes.
            Verb::Cas {
                remote: EPOCH_OFFSET,
                local: 2048,
                expect: u64::MAX,
                swap: u64::MAX,
            }
        };
        let t0 = Instant::now();
        conn.post(&[verb]).map_err(|e| e.to_string())?;
        let took = t0.elapsed();
        latency.saturating_record(took.as_nanos() as u64);
        busy += took;
        ops += 1;
    }
    let _ = conn.call(&Request::Disconnect);
    Ok(LoopResult {
        ops,
        unknown: 0,
        elapsed: busy,
        latency,
        verbs: conn.stats().since(&before),
    })
}

/// A connection that posts verbs of its own, with a 4 KiB local buffer.
fn raw_connection(address: &str) -> Result<(Box<dyn Connection>, Geometry), String> {
    let mut conn = transport::connect(&Address::parse(address)?, &Default::default())
        .map_err(|e| e.to_string())?;
    let info = match conn.call(&Request::Connect {
        protocol_version: PROTOCOL_VERSION,
        secret: vec![],
        group: 0,
    }) {
        Ok(Response::Connected(info)) => info,
        other => return Err(format!("connect for raw verbs: {other:?}")),
    };
    conn.attach(&info.region, 4096).map_err(|e| e.to_string())?;
    let g = info.geometry;
    g.validate().map_err(|e| e.to_string())?;
    Ok((conn, g))
}

/// A GET that does only what it must, on the mapping itself: hash the key,
/// read both windows, read the first block whose fingerprint matches and
/// holds the key, check its xxh3, copy the value out. No deadline, no
/// retries, no transport: the floor a GET over shm can reach.
struct BoundGet {
    g: Geometry,
    windows: Vec<u64>,
    block: Vec<u64>,
    out: Vec<u8>,
}

impl BoundGet {
    fn new(g: &Geometry, value_size: usize) -> BoundGet {
        BoundGet {
            g: *g,
            windows: vec![0; CANDIDATE_SLOTS],
            block: vec![0; g.max_block() as usize / 8],
            out: Vec::with_capacity(value_size),
        }
    }

    fn get(&mut self, region: &SharedRegion, key: &[u8]) -> Result<bool, String> {
        let kh = KeyHash::new(key, self.g.bucket_count);
        let per_window = CANDIDATE_SLOTS / 2;
        for w in 0..2 {
            // Both windows' misses at once, as a batch of their READs does.
            region.prefetch(self.g.bucket_offset(kh.windows[w]), per_window * 8);
        }
        for w in 0..2 {
            let dst = &mut self.windows[w * per_window..(w + 1) * per_window];
            region
                .read(self.g.bucket_offset(kh.windows[w]), dst)
                .map_err(|e| e.to_string())?;
        }
        let slots = std::array::from_fn(|i| Slot(self.windows[i]));
        for i in set_bits(kh.matches(&slots)) {
            let Some((offset, len)) = self.g.block_span(slots[i]) else {
                continue;
            };
            let words = &mut self.block[..len / 8];
            region.read(offset, words).map_err(|e| e.to_string())?;
            // SAFETY: any u64 slice is a valid u8 slice of 8x the length.
            let bytes = unsafe { std::slice::from_raw_parts(words.as_ptr() as *const u8, len) };
            if let Ok(view) = decode_block(bytes) {
                if let (true, Payload::Bytes(value)) = (view.key == key, view.payload) {
                    self.out.clear();
                    self.out.extend_from_slice(value);
                    return Ok(true);
                }
            }
        }
        Ok(false)
    }
}

/// One thread's loop of a key-value operation. Warm loops first make every
/// key's hint settle (a sighting three deadlines after the first), so that
/// each timed operation meets a fresh, settled hint, as a client revisiting
/// its working set does.
struct KvLoop<'a> {
    kv: Client,
    op: Op,
    args: &'a MicroArgs,
    /// This thread's working set (warm loops) or the keys it deletes next.
    keys: Vec<Vec<u8>>,
    value: Vec<u8>,
    out: Vec<u8>,
    /// The keys of one GET-batch call, and the buffers it reads into.
    batch: Vec<Vec<u8>>,
    values: kv_client::Values,
    /// Names keys this loop creates.
    prefix: String,
    made: u64,
    /// Verbs of the timed operations only, and the time they took.
    timed: VerbStats,
    busy: Duration,
    /// INCR only: increments whose outcome is unknown.
    unknown: u64,
}

impl<'a> KvLoop<'a> {
    fn connect(address: &str, op: Op, t: usize, args: &'a MicroArgs) -> Result<Self, String> {
        let entries = if op.warm() { 65_536 } else { 0 };
        let options = kv_client::ClientOptions::default().with_slot_cache_entries(entries);
        let kv = Client::connect_with(address, options).map_err(|e| e.to_string())?;
        let threads = args.threads.iter().max().copied().unwrap_or(1);
        let mut l = KvLoop {
            kv,
            op,
            args,
            keys: Vec::new(),
            value: vec![t as u8; args.value_size],
            out: Vec::with_capacity(args.value_size),
            batch: Vec::new(),
            values: kv_client::Values::new(),
            prefix: format!("micro-{}-{t}-{}", op.name(), std::process::id()),
            made: 0,
            timed: VerbStats::default(),
            busy: Duration::ZERO,
            unknown: 0,
        };
        if let Op::Get { warm: true } | Op::Update { warm: true } = op {
            let per = (args.keys / threads as u64).max(1);
            let set =
                (0..args.warm_keys as u64).map(|i| key(t as u64 * per + i % per, args.key_size));
            l.keys = set.collect();
        }
        Ok(l)
    }

    /// Reads every key of the working set now and then a deadline apart,
    /// until their copies are three deadlines old: they then can have no
    /// concurrent insert left, and each sighting came while the one before
    /// was fresh (two deadlines). Nothing for loops that need no hints.
    fn settle_hints(&mut self) -> Result<(), String> {
        if !self.op.warm() || self.keys.is_empty() {
            return Ok(());
        }
        let deadline = self.kv.op_deadline();
        let last = deadline + deadline / 10;
        for pause in [Duration::ZERO, deadline, deadline, last] {
            std::thread::sleep(pause);
            for k in &self.keys {
                self.kv
                    .get_into(k, &mut self.out)
                    .map_err(|e| e.to_string())?;
            }
        }
        Ok(())
    }

    fn fresh_key(&mut self) -> Vec<u8> {
        self.made += 1;
        format!("{}-{}", self.prefix, self.made).into_bytes()
    }

    /// One timed operation, after whatever untimed set-up it needs; says
    /// how many keys it covered.
    fn step(
        &mut self,
        next: &mut impl FnMut() -> u64,
        latency: &mut Histogram<u64>,
    ) -> Result<u64, String> {
        let err = |e: kv_client::Error| e.to_string();
        let key = match self.op {
            Op::Get { warm: true } | Op::Update { warm: true } => {
                // Round robin: every key is revisited after the same time.
                self.made += 1;
                self.keys[(self.made % self.keys.len() as u64) as usize].clone()
            }
            Op::Delete { .. } => {
                if self.keys.is_empty() {
                    self.refill_deletes()?;
                }
                self.keys.pop().unwrap_or_default()
            }
            Op::Insert => self.fresh_key(),
            Op::GetBatch => {
                self.batch.clear();
                for _ in 0..self.args.batch {
                    self.batch
                        .push(key(next() % self.args.keys, self.args.key_size));
                }
                Vec::new()
            }
            Op::Incr => COUNTER.to_vec(),
            _ => key(next() % self.args.keys, self.args.key_size),
        };
        let before = self.kv.verb_stats();
        let t0 = Instant::now();
        match self.op {
            Op::Get { .. } => {
                self.kv.get_into(&key, &mut self.out).map_err(err)?;
            }
            Op::Update { .. } | Op::Insert => self.kv.put(&key, &self.value).map_err(err)?,
            Op::Delete { .. } => {
                self.kv.delete(&key).map_err(err)?;
            }
            Op::GetBatch => {
                self.kv
                    .get_many_into(&self.batch, &mut self.values)
                    .map_err(err)?;
            }
            Op::Incr => match self.kv.incr(&key, 1) {
                Ok(_) => {}
                // A lost connection after the atomic was posted: counted
                // apart, and the loop goes on with a new connection.
                Err(kv_client::Error::OutcomeUnknown(_)) => {
                    self.unknown += 1;
                    return Ok(0);
                }
                Err(e) => return Err(err(e)),
            },
            Op::RawRead | Op::RawCas | Op::GetBound => {}
        }
        let took = t0.elapsed();
        latency.saturating_record(took.as_nanos() as u64);
        self.busy += took;
        self.timed.add(&self.kv.verb_stats().since(&before));
        Ok(match self.op {
            Op::GetBatch => self.args.batch as u64,
            _ => 1,
        })
    }

    /// Inserts the next keys to delete (untimed); for warm deletes, lets
    /// their hints settle.
    fn refill_deletes(&mut self) -> Result<(), String> {
        for _ in 0..self.args.warm_keys.max(1) {
            let k = self.fresh_key();
            self.kv.put(&k, &self.value).map_err(|e| e.to_string())?;
            self.keys.push(k);
        }
        // Nothing for cold deletes, which need no hints.
        self.settle_hints()
    }
}
