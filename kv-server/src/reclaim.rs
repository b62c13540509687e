//! The reclaimer: a thread that turns unreferenced heap space back into
//! leasable space (see the ownership argument in `heap.rs`). Each time it
//! wakes it frees the blocks clients reported unlinked (`unlinked.rs`),
//! then paces the heap against the rate at which clients lease it:
//!
//! - it keeps a **headroom** of free space (aging included) worth two grace
//!   periods of writing plus two chunks: space a writer unlinks comes back
//!   a grace period later, so less than that and writers run dry;
//! - short of it, it **grows** the heap, unless the space neither free nor
//!   leased holds much more than the last scan found live — garbage nobody
//!   reported (clients that died, a reopened region), which a **scan**
//!   reclaims instead — and never past twice the live data and the
//!   headroom (`Shared::may_grow_for_headroom`), so that reclamation that
//!   falls behind cannot make the region grow without end.
//!
//! It also scans when a lease went wanting or a departed client's space
//! has settled, and after a scan that finds more than half the heap live it
//! grows the heap. The scan reads the region without the pool's lock; only
//! the short sweep over the unit map takes it.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::control::{self, Shared};
use crate::heap::Need;
use crate::{region, unlinked};

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
    let mut last_scan: Option<(Instant, Duration)> = None;
    let mut pace = Pace::new(Instant::now());
    loop {
        {
            let (flag, cv) = &shared.reclaim;
            let Ok(mut woken) = flag.lock() else {
                return;
            };
            if !*woken {
                woken = match cv.wait_timeout(woken, tick) {
                    Ok((w, _)) => w,
                    Err(_) => return,
                };
            }
            *woken = false;
        }
        if shared.stopping.load(Relaxed) {
            return;
        }
        unlinked::free_reported(&shared);
        let now = Instant::now();
        let g = shared.geometry();
        let live = shared.counters.live_bytes.load(Relaxed);
        let (need, grow) = match shared.pool.lock() {
            Ok(mut p) => {
                p.mature(now);
                let headroom = pace.headroom(now, p.leased_total(), grace, g.chunk_size);
                shared.headroom.store(headroom, Relaxed);
                let grow = p.short_of(headroom)
                    && !p.unreported_garbage(headroom, live)
                    && shared.may_grow_for_headroom(&g);
                (p.need(now, headroom, live), grow)
            }
            Err(_) => return,
        };
        if grow {
            shared.want_growth(|w| w.heap = Some(g.region_len));
        }
        let took = last_scan.map_or(Duration::ZERO, |(_, took)| took);
        let stats_due = shared.stats_wanted.swap(false, Relaxed);
        // Back-to-back scans would only burn CPU: leave a gap of a few
        // scans' time when space is wanted now, more when it merely runs
        // low, and for fresh stats a second or eight scans' time (start to
        // start), so that stats requests and scrapes, however many, cost at
        // most an eighth of a core.
        let gap = match need {
            Need::Now => took * 4,
            Need::Soon => (took * 8).max(grace),
            Need::No if stats_due => (took * 8).max(Duration::from_secs(1)),
            Need::No => {
                control::account_cpu(&shared.counters, &mut cpu_mark);
                continue;
            }
        };
        if last_scan.is_some_and(|(at, _)| at.elapsed() < gap) {
            if stats_due {
                shared.stats_wanted.store(true, Relaxed);
            }
            continue;
        }
        let started = Instant::now();
        collect(&shared);
        last_scan = Some((started, started.elapsed()));
        control::account_cpu(&shared.counters, &mut cpu_mark);
    }
}

/// One collection: scan the index, then free what nothing holds.
pub fn collect(shared: &Shared) {
    let Ok(_one_at_a_time) = shared.collecting.lock() else {
        return;
    };
    let started = Instant::now();
    let g = shared.geometry();
    let scan = match region::scan_index(&shared.region, &g) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!("index scan failed: {e}");
            return;
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
    // and free ever less. Grow instead (the heap stays under ~2x the data).
    if scan.live_bytes > g.heap_size / 2 && g.region_len < shared.limits.max_region {
        shared.want_growth(|w| w.heap = Some(g.region_len));
    }
    let ready_at = Instant::now() + shared.grace();
    let freed = match shared.pool.lock() {
        Ok(mut p) => p.collect(started, scan.live, ready_at),
        Err(_) => return,
    };
    tracing::debug!(
        freed,
        live_slots = scan.live_slots,
        took_us = started.elapsed().as_micros() as u64,
        "collected"
    );
}
