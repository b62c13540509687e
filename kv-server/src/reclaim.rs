//! The reclaimer: a thread that turns unreferenced heap space back into
//! leasable space (see the ownership argument in `heap.rs`). It scans the
//! index when a lease went wanting, when a departed client's space has
//! settled, or (at most once a second) when free space runs low; when it
//! finds more than half the heap live, it asks for the heap to grow. The scan
//! reads the region without the pool's lock; only the short sweep over the
//! unit map takes it.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::control::{self, Shared};
use crate::heap::Need;
use crate::region;

pub fn run(shared: Arc<Shared>) {
    let grace = shared.grace();
    // Often enough that space aging for a grace period is not kept waiting
    // long after it, rarely enough to cost nothing when idle.
    let tick = (grace / 4).clamp(Duration::from_millis(2), Duration::from_millis(250));
    let mut cpu_mark = control::thread_cpu_us();
    let mut last_scan: Option<(Instant, Duration)> = None;
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
        let now = Instant::now();
        let need = match shared.pool.lock() {
            Ok(mut p) => {
                p.mature(now);
                p.need(now)
            }
            Err(_) => return,
        };
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
        shared.want_growth(|w| w.heap = true);
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
