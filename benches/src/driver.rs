//! Runs a workload's load or run phase on a store with N threads: picks
//! operations and keys with YCSB's generators, throttles to a target rate,
//! stops at maxexecutiontime, and measures every operation.

use std::collections::BTreeMap;
use std::collections::BTreeSet;
use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use kv_common::transport::VerbStats;

use crate::generator::{write_key_name, KeyChooser, Rng};
use crate::store::{Store, StoreFactory};
use crate::workload::{build_record, replace_field, FieldLengths, Workload};

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

    /// Why a load phase left records out (its first failed insert, or
    /// maxexecutiontime before `records` were stored): a run on what it
    /// stored would read missing keys, cheaply, and look fast.
    pub fn load_cut_short(&self, records: u64) -> Option<String> {
        let stored = self.ops.get(&OpKind::Insert).map_or(0, |s| s.ok);
        match &self.first_error {
            Some(e) => Some(format!(
                "stopped at its first failed insert, with {stored} of {records} records stored: {e}"
            )),
            None if stored < records => Some(format!(
                "reached maxexecutiontime with {stored} of {records} records stored (it bounds \
                 each phase: raise it, or lower recordcount)"
            )),
            None => None,
        }
    }
}

/// State the worker threads share.
struct Shared {
    /// Next key number to insert.
    next_insert: AtomicU64,
    /// Key number below which every insert has completed (YCSB's
    /// acknowledged counter): reads never pick a key from here on.
    acked_end: AtomicU64,
    /// The inserts completed from `acked_end` on, waiting for those before
    /// them.
    acked_above: Mutex<BTreeSet<u64>>,
    /// Workers still running: progress is watched until none is (one that
    /// panicked or could not connect does not hold the phase open).
    live: AtomicUsize,
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
    fn new(w: &Workload, phase: Phase) -> Shared {
        let loaded_end = w.insertstart + w.insertcount;
        Shared {
            next_insert: AtomicU64::new(match phase {
                Phase::Load => w.insertstart,
                Phase::Run => loaded_end,
            }),
            acked_end: AtomicU64::new(loaded_end),
            acked_above: Mutex::new(BTreeSet::new()),
            live: AtomicUsize::new(w.threadcount),
            done: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            errors: AtomicU64::new(0),
            first_error: OnceLock::new(),
            stop_at_error: phase == Phase::Load,
        }
    }

    /// The insert of key number `keynum` completed (or failed, as YCSB
    /// counts it): `acked` moves past it once every insert before it has.
    fn acknowledge(&self, keynum: u64) {
        // The end only grows: a key below it (a load's) stays below.
        if keynum < self.acked_end.load(Ordering::Relaxed) {
            return;
        }
        let mut above = self.acked_above.lock().unwrap_or_else(|p| p.into_inner());
        let mut end = self.acked_end.load(Ordering::Relaxed);
        // A load's keys lie below the end it starts from.
        if keynum < end {
            return;
        }
        if keynum > end {
            above.insert(keynum);
            return;
        }
        end += 1;
        while above.remove(&end) {
            end += 1;
        }
        self.acked_end.store(end, Ordering::Relaxed);
    }

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
        Phase::Run => w.run_operations(),
    };
    let shared = Shared::new(w, phase);
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
    // Built before the clock starts (zeta over a million terms, for other
    // constants than YCSB's), once: each worker takes a copy.
    let generators = (w.key_chooser(), w.field_lengths());
    let run = PhaseRun {
        w,
        phase,
        total,
        threads,
        shared,
        generators,
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
    generators: (KeyChooser, FieldLengths),
    start: Instant,
}

/// Counts a worker out of `Shared::live` when it ends, however it ends.
struct LiveWorker<'a>(&'a AtomicUsize);

impl Drop for LiveWorker<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
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
                    let _live = LiveWorker(&run.shared.live);
                    // One that cannot connect ends the phase: it fails.
                    let mut handle = store.open().inspect_err(|_| {
                        run.shared.stop.store(true, Ordering::Relaxed);
                    })?;
                    let mut worker = Worker::new(&run.generators, t, options.seed);
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
        // A run bounded by maxexecutiontime alone has no count to reach.
        let (bar, template) = match total {
            u64::MAX => (
                indicatif::ProgressBar::no_length(),
                "{prefix} [{elapsed_precise}] {pos} ops, {per_sec}",
            ),
            _ => (
                indicatif::ProgressBar::new(total),
                "{prefix} [{elapsed_precise}] {wide_bar} {pos}/{len} ops, {per_sec}, eta {eta}",
            ),
        };
        bar.set_style(
            indicatif::ProgressStyle::with_template(template)
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        bar.set_prefix(if phase == Phase::Load { "load" } else { "run" });
        bar
    });
    let mut last_status = (Instant::now(), 0u64);
    let mut error_shown = false;
    loop {
        let done = shared.done.load(Ordering::Relaxed);
        let ended = shared.live.load(Ordering::Relaxed) == 0;
        if done >= total || ended || shared.stop.load(Ordering::Relaxed) {
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

/// Sleeps until `at` seconds after `start`, or until `stop` is set (checked
/// every 50 ms): a throttled phase ends at maxexecutiontime too.
fn wait_until(start: Instant, at: f64, stop: &AtomicBool) {
    // Beyond any phase's time (a tiny target): until stopped.
    let due = Duration::try_from_secs_f64(at)
        .ok()
        .and_then(|d| start.checked_add(d));
    loop {
        let now = Instant::now();
        let left = due.map_or(Duration::MAX, |d| d.saturating_duration_since(now));
        if left.is_zero() || stop.load(Ordering::Relaxed) {
            return;
        }
        std::thread::sleep(left.min(Duration::from_millis(50)));
    }
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
    fn new((chooser, lengths): &(KeyChooser, FieldLengths), thread: usize, seed: u64) -> Worker {
        Worker {
            rng: Rng::new(
                seed.wrapping_mul(0x100_0000_01b3)
                    .wrapping_add(thread as u64),
            ),
            chooser: chooser.clone(),
            lengths: lengths.clone(),
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
            if let Some(rate) = per_thread_rate {
                wait_until(start, i as f64 / rate, &shared.stop);
            }
            if shared.stop.load(Ordering::Relaxed) {
                break;
            }
            let n = match phase {
                Phase::Load => {
                    self.one(store, w, OpKind::Insert, shared);
                    1
                }
                Phase::Run => self.next_operations(store, w, shared, share - i),
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

    /// The run phase's next operation, or with batchsize > 1 its next
    /// batchsize (at most `left`): each drawn from the mix, the reads among
    /// them issued together as one batch, after the others. How many.
    fn next_operations(
        &mut self,
        store: &mut dyn Store,
        w: &Workload,
        shared: &Shared,
        left: u64,
    ) -> u64 {
        let n = (w.batchsize as u64).min(left);
        let mut reads = 0;
        for _ in 0..n {
            match self.choose_op(w) {
                OpKind::Read if w.batchsize > 1 => reads += 1,
                kind => self.one(store, w, kind, shared),
            }
        }
        if reads > 0 {
            self.read_batch(store, w, reads, shared);
        }
        n
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

    /// A key number that has been inserted (YCSB's nextKeynum); None if
    /// the phase is told to stop while drawing (a zipfian space sized for
    /// many inserts may take long to hit one).
    fn existing_key(&mut self, shared: &Shared) -> Option<u64> {
        let latest = shared.acked_end.load(Ordering::Relaxed).saturating_sub(1);
        for draw in 1u64.. {
            let k = self.chooser.next(latest, &mut self.rng);
            if k <= latest {
                return Some(k);
            }
            if draw % 1024 == 0 && shared.stop.load(Ordering::Relaxed) {
                break;
            }
        }
        None
    }

    fn one(&mut self, store: &mut dyn Store, w: &Workload, kind: OpKind, shared: &Shared) {
        let keynum = match kind {
            OpKind::Insert => shared.next_insert.fetch_add(1, Ordering::Relaxed),
            _ => match self.existing_key(shared) {
                Some(k) => k,
                None => return,
            },
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
            shared.acknowledge(keynum);
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
            let Some(keynum) = self.existing_key(shared) else {
                return;
            };
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
    use std::collections::HashMap;
    use std::sync::Arc;

    fn workload(text: &str) -> Workload {
        Workload::from_properties(&Properties::parse(text))
            .expect("workload")
            .0
    }

    /// Records in a map: the driver's own figures are what is tested.
    #[derive(Clone, Default)]
    struct MapStore(Arc<Mutex<HashMap<Vec<u8>, Vec<u8>>>>);

    impl Store for MapStore {
        fn read(&mut self, key: &[u8], out: &mut Vec<u8>) -> Result<bool, String> {
            let map = self.0.lock().map_err(|e| e.to_string())?;
            let Some(value) = map.get(key) else {
                return Ok(false);
            };
            out.clone_from(value);
            Ok(true)
        }

        fn write(&mut self, key: &[u8], value: &[u8]) -> Result<(), String> {
            let mut map = self.0.lock().map_err(|e| e.to_string())?;
            map.insert(key.to_vec(), value.to_vec());
            Ok(())
        }
    }

    impl StoreFactory for MapStore {
        fn open(&self) -> Result<Box<dyn Store>, String> {
            Ok(Box::new(self.clone()))
        }
    }

    /// A store no thread can open.
    struct Unreachable;

    impl StoreFactory for Unreachable {
        fn open(&self) -> Result<Box<dyn Store>, String> {
            Err("unreachable".into())
        }
    }

    fn quiet() -> RunOptions {
        RunOptions {
            seed: 7,
            progress_bar: false,
            status_interval: Duration::from_secs(3600),
            quiet: true,
        }
    }

    #[test]
    fn a_batched_run_keeps_the_operation_mix() {
        let w = workload(
            "recordcount=100\noperationcount=20000\nreadproportion=0.5\nupdateproportion=0.5\n\
             batchsize=10\nfieldcount=1\nfieldlength=10\n",
        );
        let store = MapStore::default();
        run_phase(&store, &w, Phase::Load, &quiet()).expect("load");
        let run = run_phase(&store, &w, Phase::Run, &quiet()).expect("run");
        let reads = run.ops[&OpKind::Read].operations() as f64;
        let updates = run.ops[&OpKind::Update].operations() as f64;
        assert_eq!(reads + updates, 20000.0);
        assert!(
            (reads / 20000.0 - 0.5).abs() < 0.02,
            "{reads} reads, {updates} updates"
        );
    }

    #[test]
    fn a_phase_whose_workers_cannot_start_ends_with_their_error() {
        let w = workload("recordcount=100\nthreadcount=2\n");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(run_phase(&Unreachable, &w, Phase::Load, &quiet()).map(|_| ()));
        });
        let ended = rx.recv_timeout(Duration::from_secs(60));
        assert_eq!(ended, Ok(Err("unreachable".to_string())));
    }

    #[test]
    fn a_load_short_of_its_records_says_why() {
        let w = workload("recordcount=10\n");
        let mut result = run_phase(&MapStore::default(), &w, Phase::Load, &quiet()).expect("load");
        assert_eq!(result.load_cut_short(10), None);
        if let Some(inserts) = result.ops.get_mut(&OpKind::Insert) {
            inserts.ok = 4;
        }
        let why = result.load_cut_short(10).expect("cut short");
        assert!(why.contains("maxexecutiontime with 4 of 10"), "{why}");
        result.first_error = Some("full".into());
        let why = result.load_cut_short(10).expect("cut short");
        assert!(
            why.contains("first failed insert") && why.ends_with("full"),
            "{why}"
        );
    }

    #[test]
    fn reads_pick_only_keys_every_insert_up_to_which_completed() {
        let w = workload(
            "recordcount=10\nreadproportion=0.5\nupdateproportion=0\ninsertproportion=0.5\n",
        );
        let shared = Shared::new(&w, Phase::Run);
        shared.acknowledge(3);
        assert_eq!(shared.acked_end.load(Ordering::Relaxed), 10);
        shared.acknowledge(12);
        assert_eq!(shared.acked_end.load(Ordering::Relaxed), 10);
        shared.acknowledge(10);
        assert_eq!(shared.acked_end.load(Ordering::Relaxed), 11);
        shared.acknowledge(11);
        assert_eq!(shared.acked_end.load(Ordering::Relaxed), 13);
    }

    #[test]
    fn a_key_drawn_from_a_space_mostly_not_inserted_yet_gives_way_to_a_stop() {
        let w = workload(
            "recordcount=10\noperationcount=1000000000000\nreadproportion=0.5\n\
             updateproportion=0\ninsertproportion=0.5\nrequestdistribution=zipfian\n",
        );
        let shared = Shared::new(&w, Phase::Run);
        shared.stop.store(true, Ordering::Relaxed);
        let mut worker = Worker::new(&(w.key_chooser(), w.field_lengths()), 0, 42);
        assert_eq!(worker.existing_key(&shared), None);
    }

    #[test]
    fn a_throttled_wait_ends_at_a_stop() {
        let stop = AtomicBool::new(true);
        wait_until(Instant::now(), 1e20, &stop);
        wait_until(Instant::now(), f64::INFINITY, &stop);
    }

    #[test]
    fn operation_mix_follows_the_proportions() {
        let props = Properties::parse(
            "recordcount=10\nreadproportion=0.5\nupdateproportion=0.3\ninsertproportion=0.1\nreadmodifywriteproportion=0.1\n",
        );
        let (w, _) = Workload::from_properties(&props).unwrap();
        let mut worker = Worker::new(&(w.key_chooser(), w.field_lengths()), 0, 42);
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
