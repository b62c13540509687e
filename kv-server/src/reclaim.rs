//! The reclaimer: a thread that turns unreferenced heap space back into
//! leasable space (see the ownership argument in `heap.rs`). Each time it
//! wakes it deals with the blocks clients reported unlinked — it checks
//! them (`unlinked.rs`), or, when a scan frees more space per second of
//! work (as measured: checks that cost much get a scan made to measure
//! scans against them) and space runs short, scans instead — then paces the
//! heap against the rate at which clients write it:
//!
//! - it keeps a **headroom** of free space (aging included) worth two grace
//!   periods of writing plus two chunks: space a writer unlinks comes back
//!   a grace period later, so less than that and writers run dry;
//! - short of it, it **grows** the heap, unless the space neither free nor
//!   leased holds much more than the last scan found live — garbage nobody
//!   reported (clients that died, a reopened region), which a **scan**
//!   reclaims instead — and starts no such growth past twice the live
//!   data and the headroom (`Shared::may_grow_for_headroom`), so that
//!   reclamation that falls behind cannot make the region grow without
//!   end (a step doubles the region, so it ends within twice that bound:
//!   see `grow::grow_heap`).
//!
//! It also scans when a lease went wanting or a departed client's space
//! has settled, and after a scan that finds more than half the heap live it
//! grows the heap. The scan reads the region without the pool's lock, and
//! so does the sweep that finds the unit map's unmarked runs; the lock is
//! taken to mark what the pool holds, then to age the runs (in bulk: a
//! collection frees tens of thousands of holes).

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::control::{self, Shared};
use crate::heap::Need;
use crate::{region, unlinked};

/// How the reclaimer turns reported garbage into free space this turn.
#[derive(Debug, PartialEq, Eq)]
enum Reclaim {
    /// Reports wait: none is waiting, or none is due.
    Wait,
    /// Check each waiting report (`unlinked.rs`).
    Check,
    /// Scan the index instead, which frees what the reports would (and all
    /// else dead), and drops them.
    Scan,
}

/// What to do with `ready` reports: check them every grace period
/// (`due`) while checking frees space at least as fast per second of work
/// as a scan does, or while either is unmeasured; when space runs `short`,
/// whichever of the two frees more per second of work. When checks cost
/// much and scans are unmeasured or measured long ago (`measure_scans`),
/// the next due turn scans, to measure them: checks that keep space from
/// running short never let a scan run otherwise, so a region that never
/// ran short (a fresh copy of a replicated shard, filled by its copier)
/// would check every report for good, at a good part of a core, where
/// scans cost little — and one scan that found nothing (asked for by a
/// stats request before there was garbage) would say so for good. Checks free a declared extent only once all of it is dead, so
/// under updates scattered over many keys they free little and scans win;
/// under a hot set of keys whole extents die and checks win. (Measured, not assumed: which one
/// wins also depends on the index's size against the garbage's.)
fn reclaim_by(ready: usize, short: bool, due: bool, known: Known) -> Reclaim {
    if ready == 0 {
        return Reclaim::Wait;
    }
    if known.measure_scans && (short || due) {
        return Reclaim::Scan;
    }
    let checks_win = match (known.checks, known.scans) {
        (Some(c), Some(s)) => c >= s,
        _ => true,
    };
    match (short, checks_win) {
        (true, false) => Reclaim::Scan,
        (_, true) if short || due => Reclaim::Check,
        _ => Reclaim::Wait,
    }
}

/// What the reclaimer knows of the two ways of reclaiming: the bytes each
/// frees per second of its work, and whether scans should be measured
/// (anew) against checks that cost much.
#[derive(Clone, Copy)]
struct Known {
    checks: Option<f64>,
    scans: Option<f64>,
    measure_scans: bool,
}

/// Bytes one way of reclaiming frees per second of its work, as measured
/// (a running average).
#[derive(Default)]
struct Yield {
    rate: Option<f64>,
}

impl Yield {
    fn record(&mut self, freed: u64, took: Duration) {
        let secs = took.as_secs_f64();
        if secs <= 0.0 {
            return;
        }
        let rate = freed as f64 / secs;
        self.rate = Some(match self.rate {
            Some(before) => 0.75 * before + 0.25 * rate,
            None => rate,
        });
    }
}

/// How long checks are watched for what they cost, and the share of it
/// (one part in this many) from which they cost enough that a scan is
/// made to measure scans against them: long enough that a short burst of
/// updates (or a slow debug build's) does not count.
const CHECK_LOAD_WINDOW: Duration = Duration::from_secs(5);
const CHECK_LOAD_COSTLY: u32 = 10;
/// How old the last scan may be for its yield to stand against checks that
/// cost much: at most one scan this often, while they do.
const SCANS_STALE: Duration = Duration::from_secs(30);

/// The time checking reports took over the last whole window.
struct CheckLoad {
    since: Instant,
    busy: Duration,
    costly: bool,
}

impl CheckLoad {
    fn new(now: Instant) -> CheckLoad {
        CheckLoad {
            since: now,
            busy: Duration::ZERO,
            costly: false,
        }
    }

    fn add(&mut self, took: Duration) {
        self.busy += took;
    }

    /// Whether checks took a tenth of the last whole window or more.
    fn costly(&mut self, now: Instant) -> bool {
        let window = now.saturating_duration_since(self.since);
        if window >= CHECK_LOAD_WINDOW {
            self.costly = self.busy * CHECK_LOAD_COSTLY >= window;
            self.since = now;
            self.busy = Duration::ZERO;
        }
        self.costly
    }
}

/// Grace periods of writing the heap keeps free: what writers lease while
/// what they unlinked waits out its grace period, and as much again for
/// the reclaimer's own pace.
const HEADROOM_GRACES: u32 = 2;

/// The rate at which clients lease heap space, and the headroom it calls
/// for. The rate follows a rise at once and a fall slowly, so that a burst
/// is met at its start and a pause does not shrink what the next needs.
struct Pace {
    at: Instant,
    leased: u64,
    bytes_per_sec: f64,
}

impl Pace {
    fn new(at: Instant) -> Pace {
        Pace {
            at,
            leased: 0,
            bytes_per_sec: 0.0,
        }
    }

    /// Free bytes (aging included) to keep, given that `leased_total`
    /// bytes have been leased by `now`.
    fn headroom(&mut self, now: Instant, leased_total: u64, grace: Duration, chunk: u64) -> u64 {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        // Samples closer than a tenth of a second say little about a rate
        // that moves in chunks.
        if elapsed >= 0.1 {
            let rate = leased_total.saturating_sub(self.leased) as f64 / elapsed;
            self.bytes_per_sec = if rate >= self.bytes_per_sec {
                rate
            } else {
                0.8 * self.bytes_per_sec + 0.2 * rate
            };
            self.at = now;
            self.leased = leased_total;
        }
        let writing = self.bytes_per_sec * (grace * HEADROOM_GRACES).as_secs_f64();
        writing as u64 + 2 * chunk
    }
}

pub fn run(shared: Arc<Shared>) {
    let grace = shared.grace();
    // Often enough that space aging for a grace period is not kept waiting
    // long after it, rarely enough to cost nothing when idle.
    let tick = (grace / 4).clamp(Duration::from_millis(2), Duration::from_millis(250));
    let mut cpu_mark = control::thread_cpu_us();
    let mut r = Reclaimer {
        grace,
        pace: Pace::new(Instant::now()),
        checks: Yield::default(),
        scans: Yield::default(),
        check_load: CheckLoad::new(Instant::now()),
        last_check: Instant::now(),
        last_scan: None,
        reports_off_since: None,
    };
    while wait_for_work(&shared, tick) {
        r.deal_with_reports(&shared);
        let Some(need) = r.pace_heap(&shared) else {
            return;
        };
        if r.scan_due(&shared, need) {
            r.scan(&shared);
        }
        control::account_cpu(&shared.counters, &mut cpu_mark);
    }
}

/// Waits until woken (a lease went wanting, a client left, reports came)
/// or `tick` passed; false once the server stops.
fn wait_for_work(shared: &Shared, tick: Duration) -> bool {
    let (flag, cv) = &shared.reclaim;
    let Ok(mut woken) = flag.lock() else {
        return false;
    };
    if !*woken {
        woken = match cv.wait_timeout(woken, tick) {
            Ok((w, _)) => w,
            Err(_) => return false,
        };
    }
    *woken = false;
    !shared.stopping.load(Relaxed)
}

/// The reclaimer's own state from one turn to the next.
struct Reclaimer {
    grace: Duration,
    pace: Pace,
    checks: Yield,
    scans: Yield,
    check_load: CheckLoad,
    last_check: Instant,
    /// When the last scan began, and how long it took.
    last_scan: Option<(Instant, Duration)>,
    /// Since when reports have not been taken (scans paid better).
    reports_off_since: Option<Instant>,
}

/// How long reports stay unwanted before they are measured again.
const REPORTS_RETRY: Duration = Duration::from_secs(10);

impl Reclaimer {
    /// Checks the waiting reports, or scans instead, or lets them wait
    /// (see `reclaim_by`).
    fn deal_with_reports(&mut self, shared: &Shared) {
        let now = Instant::now();
        let g = shared.geometry();
        let (short, ready) = match shared.pool.lock() {
            Ok(mut p) => {
                p.mature(now);
                let headroom = self.headroom(now, p.leased_total(), g.chunk_size);
                (p.short_of(headroom), p.ready_reports())
            }
            Err(_) => return,
        };
        self.ask_for_reports_while_they_pay(shared);
        let due = self.last_check.elapsed() >= self.grace;
        let known = Known {
            checks: self.checks.rate,
            scans: self.scans.rate,
            measure_scans: self.check_load.costly(now)
                && self
                    .last_scan
                    .is_none_or(|(at, _)| now.saturating_duration_since(at) >= SCANS_STALE),
        };
        match reclaim_by(ready, short, due, known) {
            Reclaim::Wait => {}
            Reclaim::Check => {
                let started = Instant::now();
                let freed = unlinked::free_reported(shared);
                let took = started.elapsed();
                self.checks.record(freed, took);
                self.check_load.add(took);
                self.last_check = Instant::now();
            }
            Reclaim::Scan => {
                self.scan(shared);
                self.last_check = Instant::now();
            }
        }
    }

    /// Keeps the headroom: asks for growth where it is short and growing
    /// is what helps. Returns how much a scan is wanted (None: the server
    /// is going down).
    fn pace_heap(&mut self, shared: &Shared) -> Option<Need> {
        let now = Instant::now();
        let g = shared.geometry();
        let live = shared.counters.live_bytes.load(Relaxed);
        let mut p = shared.pool.lock().ok()?;
        p.mature(now);
        let headroom = self.headroom(now, p.leased_total(), g.chunk_size);
        shared.headroom.store(headroom, Relaxed);
        let grow = p.short_of(headroom)
            && !p.unreported_garbage(headroom, live)
            && shared.may_grow_for_headroom(&g);
        let need = p.need(now, headroom, live);
        drop(p);
        if grow {
            shared.want_growth(|w| w.heap = Some(g.region_len));
        }
        Some(need)
    }

    /// Whether to scan now for `need`. Back-to-back scans would only burn
    /// CPU: it leaves a gap of a few scans' time when space is wanted now,
    /// more when it merely runs low, and for fresh stats a second or eight
    /// scans' time (start to start), so that stats requests and scrapes,
    /// however many, cost at most an eighth of a core.
    fn scan_due(&self, shared: &Shared, need: Need) -> bool {
        let took = self.last_scan.map_or(Duration::ZERO, |(_, took)| took);
        let stats_due = shared.stats_wanted.swap(false, Relaxed);
        let gap = match need {
            Need::Now => took * 4,
            Need::Soon => (took * 8).max(self.grace),
            Need::No if stats_due => (took * 8).max(Duration::from_secs(1)),
            Need::No => return false,
        };
        let due = self.last_scan.is_none_or(|(at, _)| at.elapsed() >= gap);
        if !due && stats_due {
            shared.stats_wanted.store(true, Relaxed);
        }
        due
    }

    /// Tells the control plane whether reports are worth taking: not while
    /// scans have freed more per second of work than checks (their intake
    /// alone costs the server a lookup per block). After a while without,
    /// it asks again, to measure them anew.
    fn ask_for_reports_while_they_pay(&mut self, shared: &Shared) {
        let scans_win = matches!((self.checks.rate, self.scans.rate), (Some(c), Some(s)) if c < s);
        match self.reports_off_since {
            None if scans_win => {
                shared.reports_pay.store(false, Relaxed);
                self.reports_off_since = Some(Instant::now());
            }
            Some(since) if since.elapsed() >= REPORTS_RETRY => {
                shared.reports_pay.store(true, Relaxed);
                self.reports_off_since = None;
                self.checks = Yield::default();
            }
            _ => {}
        }
    }

    fn scan(&mut self, shared: &Shared) {
        let started = Instant::now();
        let freed = collect(shared);
        let took = started.elapsed();
        self.scans.record(freed, took);
        self.last_scan = Some((started, took));
    }

    fn headroom(&mut self, now: Instant, leased_total: u64, chunk: u64) -> u64 {
        self.pace.headroom(now, leased_total, self.grace, chunk)
    }
}

/// One collection: scan the index, then free what nothing holds. Returns
/// the bytes freed.
pub fn collect(shared: &Shared) -> u64 {
    let Ok(_one_at_a_time) = shared.collecting.lock() else {
        return 0;
    };
    let started = Instant::now();
    // Reports waiting now name space given back before the scan began: it
    // frees what they would, so they are done with.
    let subsumed = shared.pool.lock().map_or(0, |p| p.ready_reports());
    let g = shared.geometry();
    let scan = match region::scan_index(&shared.region, &g, || shared.geometry()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!("index scan failed: {e}");
            return 0;
        }
    };
    let c = &shared.counters;
    c.index_scans.fetch_add(1, Relaxed);
    c.live_slots.store(scan.live_slots, Relaxed);
    c.live_bytes.store(scan.live_bytes, Relaxed);
    c.corrupt_slots.store(scan.corrupt_slots, Relaxed);
    c.frozen_slots.store(scan.frozen_slots, Relaxed);
    // Only a resize freezes slots, and it works on the index it found in
    // force: frozen slots there with none under way are stray bits.
    if scan.frozen_slots > 0 && !shared.resizing.load(Relaxed) {
        shared.want_growth(|w| w.thaw = true);
    }
    // More than half the heap live: collections would come ever more often
    // and free ever less. Grow instead (a doubling: the heap stays under
    // ~4x the data).
    if scan.live_bytes > g.heap_size / 2 && g.region_len < shared.limits.max_region {
        shared.want_growth(|w| w.heap = Some(g.region_len));
    }
    let mut live = scan.live;
    let marking = match shared.pool.lock() {
        Ok(mut p) => {
            let at = Instant::now();
            p.take_ready(subsumed);
            p.mark_held(started, &mut live);
            at.elapsed()
        }
        Err(_) => return 0,
    };
    // Without the pool's lock: this collection holds `collecting`, so what
    // is unmarked stays settled until it is freed (see `mark_held`).
    let runs = live.unmarked_runs();
    let ready_at = Instant::now() + shared.grace();
    let (freed, locked) = match shared.pool.lock() {
        Ok(mut p) => {
            let at = Instant::now();
            let freed = p.free_runs(started, runs, ready_at);
            (freed, marking + at.elapsed())
        }
        Err(_) => return 0,
    };
    tracing::debug!(
        freed,
        live_slots = scan.live_slots,
        took_us = started.elapsed().as_micros() as u64,
        // Leases wait while the pool is locked.
        locked_us = locked.as_micros() as u64,
        "collected"
    );
    freed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks_cost_much_once_they_took_a_tenth_of_a_whole_window() {
        let start = Instant::now();
        let mut load = CheckLoad::new(start);
        load.add(CHECK_LOAD_WINDOW);
        // Not before the window is whole: a burst does not count.
        assert!(!load.costly(start + CHECK_LOAD_WINDOW / 2));
        let end = start + CHECK_LOAD_WINDOW;
        assert!(load.costly(end));
        // Until the next window is whole, the last one's verdict stands.
        assert!(load.costly(end + CHECK_LOAD_WINDOW / 2));
        load.add(CHECK_LOAD_WINDOW / 20);
        assert!(!load.costly(end + CHECK_LOAD_WINDOW));
        load.add(CHECK_LOAD_WINDOW / 10);
        assert!(load.costly(end + 2 * CHECK_LOAD_WINDOW));
    }

    #[test]
    fn reports_are_checked_while_checks_free_space_as_fast_as_scans() {
        use Reclaim::*;
        let (slow, fast) = (Some(1e6), Some(1e9));
        let known = |checks, scans, measure_scans| Known {
            checks,
            scans,
            measure_scans,
        };
        let by = |ready, short, due, checks, scans| {
            reclaim_by(ready, short, due, known(checks, scans, false))
        };
        // Nothing waiting: wait.
        assert_eq!(by(0, true, true, fast, slow), Wait);
        // Unmeasured, or checks at least as good: checked when due or short.
        assert_eq!(by(10, false, true, None, None), Check);
        assert_eq!(by(10, false, false, None, None), Wait);
        assert_eq!(by(10, true, false, fast, slow), Check);
        assert_eq!(by(10, false, true, fast, None), Check);
        // Scans better: they run only when space is short; till then the
        // reports wait (a scan frees what they name).
        assert_eq!(by(10, false, true, slow, fast), Wait);
        assert_eq!(by(10, true, true, slow, fast), Scan);
        // Checks that cost much with scans unmeasured, or measured long
        // ago: the next due turn scans, to measure them (checks that keep
        // up never let one run).
        let costly = |short, due, scans| reclaim_by(10, short, due, known(fast, scans, true));
        assert_eq!(costly(false, true, None), Scan);
        assert_eq!(costly(true, false, None), Scan);
        assert_eq!(costly(false, false, None), Wait);
        assert_eq!(costly(false, true, Some(0.0)), Scan);
        assert_eq!(by(10, false, true, fast, Some(0.0)), Check);
    }
}
