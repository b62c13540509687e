//! Checking reported blocks: the reclaimer's work in the steady state, at a
//! cost proportional to the garbage rather than to the index. A block that
//! passes is counted dead, and its declared extent freed once all of it is
//! (see `registry.rs`). A report is checked in three steps, the first
//! before the region is read:
//!
//! 1. the pool: the block lies in space given back (nobody writes there
//!    any more, so nobody will publish it again) and is one its writer
//!    declared (`registry.rs`);
//! 2. the block: its size class is the one its lengths call for, and its
//!    key is the key it was published under (nobody has written there
//!    since);
//! 3. the index: no slot of that key's two windows references it — the
//!    only slots a reader of the key follows.
//!
//! The first step comes first because it is what makes the third final: a
//! block in space still leased may be published after the index was read.
//! Checks run under the collection lock, so no scan frees the space between
//! the steps and no old index is released while it is read.

use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

use kv_common::layout::{
    class_for, class_size, lengths_of, Geometry, KeyHash, Slot, BUCKET_BYTES, MAX_KEY,
    SLOTS_PER_BUCKET,
};
use kv_common::mapping::SharedRegion;
use kv_common::protocol::Extent;

use crate::control::Shared;
use crate::region;

/// Reports checked per turn of the pool's lock.
const BATCH: usize = 512;

/// Checks the reports waiting in the pool, freeing what they show dead;
/// returns the bytes freed.
pub fn free_reported(shared: &Shared) -> u64 {
    let Ok(_no_scan) = shared.collecting.lock() else {
        return 0;
    };
    let mut freed = 0;
    let c = &shared.counters;
    // What was queued on entry, and no more: reports arriving meanwhile (a
    // flood of them) wait for the next turn, so that scans, growth and the
    // release of old indexes, which take the same lock, are not held off.
    let mut left = shared.pool.lock().map_or(0, |p| p.ready_reports());
    while left > 0 {
        let (taken, mut candidates): (usize, Vec<Extent>) = match shared.pool.lock() {
            Ok(mut p) => {
                let taken = p.take_ready(BATCH.min(left));
                left -= taken.len();
                let may = taken.iter().filter_map(|&u| p.reported_block(u)).collect();
                (taken.len(), may)
            }
            Err(_) => return freed,
        };
        if taken == 0 {
            break;
        }
        // Ascending, each once (a block reported twice is checked once).
        candidates.sort_by_key(|e| e.offset);
        candidates.dedup();
        let g = shared.geometry();
        let unreferenced: Vec<Extent> = candidates
            .into_iter()
            .filter(|&e| unreferenced(&shared.region, &g, e))
            .collect();
        let ready_at = Instant::now() + shared.grace();
        let Ok(mut p) = shared.pool.lock() else {
            return freed;
        };
        // Step 1 still holds: under the collection lock, space given back
        // stays so and its declared starts are cleared only here.
        let (blocks, bytes) = p.free_reported(&unreferenced, ready_at);
        freed += bytes;
        c.freed_on_report.fetch_add(blocks, Relaxed);
        c.refused_reports.fetch_add(taken as u64 - blocks, Relaxed);
    }
    freed
}

/// Steps 2 and 3: whether `block` holds a block of its class whose key's
/// windows (in the index of `g`) hold no slot that references it. Only the
/// header and the key are read: the block lies in space its writer gave
/// back, so its bytes are the ones it published (a block damaged since
/// could not be read by anyone anyway).
fn unreferenced(region: &SharedRegion, g: &Geometry, block: Extent) -> bool {
    let mut key = [0u8; MAX_KEY];
    let Some((lengths, key)) = region::block_key(region, block.offset, &mut key) else {
        return false;
    };
    let (_, used) = lengths_of(lengths);
    if key.is_empty() || class_for(used).map(class_size) != Some(block.len) {
        return false;
    }
    let h = KeyHash::new(key, g.bucket_count);
    let mut words = [0u64; SLOTS_PER_BUCKET];
    for bucket in h.buckets() {
        if region
            .read(g.index_offset + bucket * BUCKET_BYTES, &mut words)
            .is_err()
        {
            return false;
        }
        let names_it = |w: &u64| {
            let slot = Slot(*w).thawed();
            !slot.is_empty() && slot.offset() == block.offset
        };
        if words.iter().any(names_it) {
            return false;
        }
    }
    true
}
