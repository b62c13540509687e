//! Runs a workload's load or run phase on a store with N threads: picks
//! operations and keys with YCSB's generators, throttles to a target rate,
//! stops at maxexecutiontime, and measures every operation.

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use kv_common::transport::VerbStats;

use crate::generator::{write_key_name, Rng};
use crate::store::{Store, StoreFactory};
use crate::workload::{build_record, replace_field, Workload};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum OpKind {
    Read,
    Update,
    Insert,
    ReadModifyWrite,
}

impl OpKind {
    pub fn ycsb_name(self) -> &'static str {
        match self {
            OpKind::Read => "READ",
            OpKind::Update => "UPDATE",
            OpKind::Insert => "INSERT",
            OpKind::ReadModifyWrite => "READ-MODIFY-WRITE",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Phase {
    Load,
    Run,
}

/// Measurements of one kind of operation.
pub struct OpStats {
    /// Latency in nanoseconds.
    pub latency: Histogram<u64>,
    pub ok: u64,
    pub not_found: u64,
    pub errors: u64,
    pub verbs: VerbStats,
}

impl OpStats {
    fn new() -> OpStats {
        OpStats {
            latency: Histogram::new_with_bounds(1, 600_000_000_000, 3)
                .expect("valid histogram bounds"),
            ok: 0,
            not_found: 0,
            errors: 0,
            verbs: VerbStats::default(),
        }
    }

    pub fn operations(&self) -> u64 {
        self.ok + self.not_found + self.errors
    }

    fn merge(&mut self, other: &OpStats) {
        let _ = self.latency.add(&other.latency);
        self.ok += other.ok;
        self.not_found += other.not_found;
        self.errors += other.errors;
        self.verbs.add(&other.verbs);
    }
}

pub struct PhaseResult {
    pub phase: Phase,
    pub runtime: Duration,
    pub ops: BTreeMap<OpKind, OpStats>,
    pub server_cpu_us: Option<u64>,
    pub first_error: Option<String>,
    /// Operations completed by each moment of the phase (seconds since its
    /// start), sampled every [`TIMELINE_STEP`].
    pub timeline: Vec<(f64, u64)>,
}

/// Operations completed by each moment of a phase (seconds since its start).
type Timeline = Vec<(f64, u64)>;

/// How often the progress of a phase is sampled for its timeline.
const TIMELINE_STEP: Duration = Duration::from_millis(100);

impl PhaseResult {
    pub fn operations(&self) -> u64 {
        self.ops.values().map(OpStats::operations).sum()
    }

    pub fn throughput(&self) -> f64 {
        self.operations() as f64 / self.runtime.as_secs_f64().max(1e-9)
    }
}

/// State the worker threads share.
struct Shared {
    /// Next key number to insert.
    next_insert: AtomicU64,
    /// Highest key number whose insert has completed (YCSB's acknowledged
    /// counter, approximated by a maximum): reads never pick a key above it.
    acked: AtomicU64,
    done: AtomicU64,
    stop: AtomicBool,
    /// Failed operations so far, and the first one's error (the phase's,
    /// in its report): shown while the phase runs too.
    errors: AtomicU64,
    first_error: OnceLock<String>,
    /// A load stops at its first failed insert: the records it would leave
    /// out make a run's reads miss, and a store that refused one (full, or
    /// gone) mostly refuses the rest, each after its own wait.
    stop_at_error: bool,
}

impl Shared {
    /// `n` operations failed with `e`.
    fn failed(&self, e: &str, n: u64) {
        self.errors.fetch_add(n, Ordering::Relaxed);
        if self.first_error.get().is_none() {
            let _ = self.first_error.set(e.to_owned());
        }
        if self.stop_at_error {
            self.stop.store(true, Ordering::Relaxed);
        }
    }
}

pub struct RunOptions {
    pub seed: u64,
    /// Draw a progress bar (true) or print status lines.
    pub progress_bar: bool,
    /// How often status lines (operations, current ops/s) are printed.
    pub status_interval: Duration,
    pub quiet: bool,
}

impl RunOptions {
    /// A progress bar on a terminal; else, or with `status_interval`,
    /// YCSB-style status lines (every 10 s by default).
    pub fn for_terminal(seed: u64, status_interval: Option<Duration>) -> RunOptions {
        RunOptions {
            seed,
            progress_bar: status_interval.is_none() && std::io::stdout().is_terminal(),
            status_interval: status_interval.unwrap_or(Duration::from_secs(10)),
            quiet: false,
        }
    }
}

pub fn run_phase(
    store: &dyn StoreFactory,
    w: &Workload,
    phase: Phase,
    options: &RunOptions,
) -> Result<PhaseResult, String> {
    let total = match phase {
        Phase::Load => w.insertcount,
        Phase::Run => w.operationcount,
    };
    let loaded_end = w.insertstart + w.insertcount;
    let shared = Shared {
        next_insert: AtomicU64::new(if phase == Phase::Load {
            w.insertstart
        } else {
            loaded_end
        }),
        acked: AtomicU64::new(loaded_end.saturating_sub(1)),
        done: AtomicU64::new(0),
        stop: AtomicBool::new(false),
        errors: AtomicU64::new(0),
        first_error: OnceLock::new(),
        stop_at_error: phase == Phase::Load,
    };
    let threads = w.threadcount;
    // A run that starts while the load's index resize still migrates slots
    // would charge the load's work to the run.
    let settled = store.settle()?;
    if settled > Duration::from_millis(100) && !options.quiet {
        eprintln!(
            "waited {:.1} s for the store's background work (an index resize) to finish",
            settled.as_secs_f64()
        );
    }
    let cpu_before = store.server_cpu_us();
    let run = PhaseRun {
        w,
        phase,
        total,
        threads,
        shared,
        start: Instant::now(),
    };
    let (results, mut timeline) = run_workers(store, &run, options);
    let Merged { runtime, ops } = merge_workers(results, run.start)?;
    let first_error = run.shared.first_error.get().cloned();
    timeline.push((
        runtime.as_secs_f64(),
        run.shared.done.load(Ordering::Relaxed),
    ));
    let server_cpu_us = match (cpu_before, store.server_cpu_us()) {
        (Some(a), Some(b)) => Some(b.saturating_sub(a)),
        _ => None,
    };
    Ok(PhaseResult {
        phase,
        runtime,
        ops,
        server_cpu_us,
        first_error,
        timeline,
    })
}

/// One phase as every thread sees it.
struct PhaseRun<'a> {
    w: &'a Workload,
    phase: Phase,
    /// Operations in the whole phase.
    total: u64,
    threads: usize,
    shared: Shared,
    start: Instant,
}

/// Runs the workers, each on its own handle and its share of the
/// operations, while this thread reports progress: their results, and the
/// progress timeline.
fn run_workers(
    store: &dyn StoreFactory,
    run: &PhaseRun,
    options: &RunOptions,
) -> (Vec<Result<Worker, String>>, Timeline) {
    let (total, threads) = (run.total, run.threads);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let share = total / threads as u64 + u64::from((t as u64) < total % threads as u64);
                s.spawn(move || {
                    let mut handle = store.open()?;
                    let mut worker = Worker::new(run.w, t, options.seed);
                    worker.run(&mut *handle, run, share);
                    Ok(worker)
                })
            })
            .collect();
        let timeline = report_progress(run, options);
        let results: Vec<_> = handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("worker panicked".into())))
            .collect();
        (results, timeline)
    })
}

/// The workers' measurements as one.
struct Merged {
    /// Until the last worker finished.
    runtime: Duration,
    ops: BTreeMap<OpKind, OpStats>,
}

fn merge_workers(results: Vec<Result<Worker, String>>, start: Instant) -> Result<Merged, String> {
    let mut runtime = Duration::ZERO;
    let mut ops: BTreeMap<OpKind, OpStats> = BTreeMap::new();
    for r in results {
        let worker = r?;
        runtime = runtime.max(worker.finished.saturating_duration_since(start));
        for (kind, stats) in &worker.ops {
            ops.entry(*kind).or_insert_with(OpStats::new).merge(stats);
        }
    }
    Ok(Merged { runtime, ops })
}

/// Shows progress until the workers are done, and returns its timeline;
/// ends the run at maxexecutiontime.
fn report_progress(run: &PhaseRun, o: &RunOptions) -> Timeline {
    let PhaseRun {
        w,
        phase,
        total,
        ref shared,
        start,
        ..
    } = *run;
    let mut timeline = vec![(0.0, 0)];
    let mut next_sample = start + TIMELINE_STEP;
    let bar = (o.progress_bar && !o.quiet).then(|| {
        let bar = indicatif::ProgressBar::new(total);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{prefix} [{elapsed_precise}] {wide_bar} {pos}/{len} ops, {per_sec}, eta {eta}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        bar.set_prefix(if phase == Phase::Load { "load" } else { "run" });
        bar
    });
    let mut last_status = (Instant::now(), 0u64);
    let mut error_shown = false;
    loop {
        let done = shared.done.load(Ordering::Relaxed);
        if done >= total || shared.stop.load(Ordering::Relaxed) {
            break;
        }
        if Instant::now() >= next_sample {
            timeline.push((start.elapsed().as_secs_f64(), done));
            // After a stall, the next sample is a step away again, not
            // bunched up to catch up.
            next_sample = Instant::now() + TIMELINE_STEP;
        }
        if w.maxexecutiontime.is_some_and(|m| start.elapsed() >= m) {
            shared.stop.store(true, Ordering::Relaxed);
            break;
        }
        if let Some(e) = shared
            .first_error
            .get()
            .filter(|_| !error_shown && !o.quiet)
        {
            let line = format!("first error: {e}");
            match &bar {
                Some(bar) => bar.println(line),
                None => eprintln!("{line}"),
            }
            error_shown = true;
        }
        if let Some(bar) = &bar {
            bar.set_position(done);
        } else if !o.quiet && last_status.0.elapsed() >= o.status_interval {
            let rate = (done - last_status.1) as f64 / last_status.0.elapsed().as_secs_f64();
            let errors = match shared.errors.load(Ordering::Relaxed) {
                0 => String::new(),
                n => format!("; {n} errors"),
            };
            eprintln!(
                "{:.1} sec: {done} operations; {rate:.1} current ops/sec{errors}",
                start.elapsed().as_secs_f64()
            );
            last_status = (Instant::now(), done);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    if let Some(bar) = bar {
        bar.set_position(shared.done.load(Ordering::Relaxed));
        bar.finish();
    }
    timeline
}

/// Operations a worker does between updates of the shared progress count.
const PROGRESS_STEP: u64 = 64;

/// What a read-modify-write writes back.
#[derive(Debug, Clone, Copy)]
enum Rewrite {
    /// The record it read, with this field new.
    Field(usize),
    /// The whole new record built before the clock started (writeallfields).
    Record,
}

/// One thread's generators and measurements.
struct Worker {
    rng: Rng,
    chooser: crate::generator::KeyChooser,
    lengths: crate::workload::FieldLengths,
    ops: BTreeMap<OpKind, OpStats>,
    record: Vec<u8>,
    read_buf: Vec<u8>,
    key: String,
    /// A batch's keys and values (batchsize > 1).
    batch_keys: Vec<String>,
    batch_out: Vec<Vec<u8>>,
    finished: Instant,
    /// The store's verb counters after the last operation (they only
    /// grow), which the next one's are counted from.
    verbs_seen: Option<VerbStats>,
}

impl Worker {
    fn new(w: &Workload, thread: usize, seed: u64) -> Worker {
        Worker {
            rng: Rng::new(
                seed.wrapping_mul(0x100_0000_01b3)
                    .wrapping_add(thread as u64),
            ),
            chooser: w.key_chooser(),
            lengths: w.field_lengths(),
            ops: BTreeMap::new(),
            record: Vec::new(),
            read_buf: Vec::new(),
            key: String::new(),
            batch_keys: Vec::new(),
            batch_out: Vec::new(),
            finished: Instant::now(),
            verbs_seen: None,
        }
    }

    /// Does `share` of the phase's operations, at the thread's part of the
    /// target rate, until done or told to stop.
    fn run(&mut self, store: &mut dyn Store, run: &PhaseRun, share: u64) {
        let (w, phase, shared, threads) = (run.w, run.phase, &run.shared, run.threads);
        let per_thread_rate = w.target.map(|t| t / threads as f64);
        let start = Instant::now();
        let mut unreported = 0;
        let mut i = 0;
        self.verbs_seen = store.verb_stats();
        while i < share {
            if shared.stop.load(Ordering::Relaxed) {
                break;
            }
            if let Some(rate) = per_thread_rate {
                let due = start + Duration::from_secs_f64(i as f64 / rate);
                let now = Instant::now();
                if due > now {
                    std::thread::sleep(due - now);
                }
            }
            let kind = match phase {
                Phase::Load => OpKind::Insert,
                Phase::Run => self.choose_op(w),
            };
            let n = match kind {
                OpKind::Read if w.batchsize > 1 => {
                    let n = (w.batchsize as u64).min(share - i);
                    self.read_batch(store, w, n as usize, shared);
                    n
                }
                _ => {
                    self.one(store, w, kind, shared);
                    1
                }
            };
            i += n;
            // Progress is shared by every thread: counted in steps, so the
            // loop does not bounce a cache line between them on every op.
            unreported += n;
            if unreported >= PROGRESS_STEP {
                shared.done.fetch_add(unreported, Ordering::Relaxed);
                unreported = 0;
            }
        }
        shared.done.fetch_add(unreported, Ordering::Relaxed);
        self.finished = Instant::now();
    }

    fn choose_op(&mut self, w: &Workload) -> OpKind {
        let mut u = self.rng.next_f64();
        for (p, kind) in [
            (w.readproportion, OpKind::Read),
            (w.updateproportion, OpKind::Update),
            (w.insertproportion, OpKind::Insert),
            (w.readmodifywriteproportion, OpKind::ReadModifyWrite),
        ] {
            if u < p {
                return kind;
            }
            u -= p;
        }
        OpKind::Read
    }

    /// A key number that has been inserted (YCSB's nextKeynum).
    fn existing_key(&mut self, shared: &Shared) -> u64 {
        let acked = shared.acked.load(Ordering::Relaxed);
        loop {
            let k = self.chooser.next(acked, &mut self.rng);
            if k <= acked {
                return k;
            }
        }
    }

    fn one(&mut self, store: &mut dyn Store, w: &Workload, kind: OpKind, shared: &Shared) {
        let keynum = match kind {
            OpKind::Insert => shared.next_insert.fetch_add(1, Ordering::Relaxed),
            _ => self.existing_key(shared),
        };
        let mut key = std::mem::take(&mut self.key);
        write_key_name(keynum, w.insertorder, &mut key);
        // Records are generated before the clock starts, as YCSB does.
        let whole_write = kind == OpKind::Insert || (kind != OpKind::Read && w.writeallfields);
        if whole_write {
            build_record(
                w.fieldcount,
                &mut self.lengths,
                &mut self.rng,
                &mut self.record,
            );
        }
        let field = self.rng.below(w.fieldcount) as usize;
        // The TSC where it is invariant: a clock read per operation costs
        // every target, and less is more of each target's own time.
        let started = quanta::Instant::now();
        let result = match kind {
            OpKind::Insert => store.write(key.as_bytes(), &self.record).map(|()| true),
            // A record is one block, fetched whole by one READ, so
            // readallfields=false reads the same bytes.
            OpKind::Read => store.read(key.as_bytes(), &mut self.read_buf),
            OpKind::Update | OpKind::ReadModifyWrite => {
                if whole_write && kind == OpKind::Update {
                    store.write(key.as_bytes(), &self.record).map(|()| true)
                } else {
                    let rewrite = if whole_write {
                        Rewrite::Record
                    } else {
                        Rewrite::Field(field)
                    };
                    self.read_then_write(store, key.as_bytes(), rewrite)
                }
            }
        };
        let elapsed = started.elapsed();
        let verbs = self.verbs_used(store);
        let stats = self.ops.entry(kind).or_insert_with(OpStats::new);
        stats.latency.saturating_record(elapsed.as_nanos() as u64);
        match result {
            Ok(true) => stats.ok += 1,
            Ok(false) => stats.not_found += 1,
            Err(e) => {
                stats.errors += 1;
                shared.failed(&e, 1);
            }
        }
        if let Some(verbs) = verbs {
            stats.verbs.add(&verbs);
        }
        if kind == OpKind::Insert {
            shared.acked.fetch_max(keynum, Ordering::Relaxed);
        }
        self.key = key;
    }

    /// `n` reads issued as one multi-key read: each counts as a READ whose
    /// latency is the whole call's.
    fn read_batch(&mut self, store: &mut dyn Store, w: &Workload, n: usize, shared: &Shared) {
        if self.batch_keys.len() < n {
            self.batch_keys.resize_with(n, String::new);
            self.batch_out.resize_with(n, Vec::new);
        }
        for k in 0..n {
            let keynum = self.existing_key(shared);
            write_key_name(keynum, w.insertorder, &mut self.batch_keys[k]);
        }
        let keys: Vec<&[u8]> = self.batch_keys[..n].iter().map(|k| k.as_bytes()).collect();
        // The TSC where it is invariant: a clock read per operation costs
        // every target, and less is more of each target's own time.
        let started = quanta::Instant::now();
        let result = store.read_many(&keys, &mut self.batch_out[..n]);
        let elapsed = started.elapsed();
        let verbs = self.verbs_used(store);
        let stats = self.ops.entry(OpKind::Read).or_insert_with(OpStats::new);
        stats
            .latency
            .saturating_record_n(elapsed.as_nanos() as u64, n as u64);
        match result {
            Ok(found) => {
                stats.ok += found as u64;
                stats.not_found += (n - found) as u64;
            }
            Err(e) => {
                stats.errors += n as u64;
                shared.failed(&e, n as u64);
            }
        }
        if let Some(verbs) = verbs {
            stats.verbs.add(&verbs);
        }
    }

    /// The verbs the store posted since the last operation: its counters
    /// read once per operation (summing a cluster client's over its
    /// connections cost 1% of a replicated YCSB-A run when read twice).
    fn verbs_used(&mut self, store: &dyn Store) -> Option<VerbStats> {
        let now = store.verb_stats()?;
        let used = self.verbs_seen.map(|seen| now.since(&seen));
        self.verbs_seen = Some(now);
        used
    }

    /// Read the record, then write it back with one field (or, with
    /// writeallfields, every field) new.
    fn read_then_write(
        &mut self,
        store: &mut dyn Store,
        key: &[u8],
        rewrite: Rewrite,
    ) -> Result<bool, String> {
        if !store.read(key, &mut self.read_buf)? {
            return Ok(false);
        }
        if let Rewrite::Field(field) = rewrite {
            let mut updated = Vec::with_capacity(self.read_buf.len());
            if replace_field(
                &self.read_buf,
                field,
                &mut self.lengths,
                &mut self.rng,
                &mut updated,
            )
            .is_none()
            {
                return Err(format!(
                    "{}: value is not a record",
                    String::from_utf8_lossy(key)
                ));
            }
            self.record = updated;
        }
        store.write(key, &self.record).map(|()| true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::properties::Properties;

    #[test]
    fn operation_mix_follows_the_proportions() {
        let props = Properties::parse(
            "recordcount=10\nreadproportion=0.5\nupdateproportion=0.3\ninsertproportion=0.1\nreadmodifywriteproportion=0.1\n",
        );
        let (w, _) = Workload::from_properties(&props).unwrap();
        let mut worker = Worker::new(&w, 0, 42);
        let mut counts: BTreeMap<OpKind, u32> = BTreeMap::new();
        let n = 200_000;
        for _ in 0..n {
            *counts.entry(worker.choose_op(&w)).or_default() += 1;
        }
        for (kind, want) in [
            (OpKind::Read, 0.5),
            (OpKind::Update, 0.3),
            (OpKind::Insert, 0.1),
            (OpKind::ReadModifyWrite, 0.1),
        ] {
            let got = counts[&kind] as f64 / n as f64;
            assert!((got - want).abs() < 0.01, "{kind:?}: {got}");
        }
    }
}
