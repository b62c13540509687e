//! The `kv-grow` thread: every change of the region's geometry happens here,
//! one at a time — the heap growing at the region's end, and the index
//! being resized while clients keep reading and writing.
//!
//! # Resizing the index
//!
//! 1. A new index of twice the buckets is reserved in the heap (growing the
//!    region if no free run is long enough).
//! 2. **Freeze**: every slot of the old index, empty or not, gets its frozen
//!    bit by CAS, through a client connection to this server: over rdma the
//!    slots are changed by RDMA atomics on a loopback queue pair, the domain
//!    in which clients CAS them (a CPU store or atomic would not be atomic
//!    against the NIC's). A client CAS either lands before the freeze (and
//!    is carried over with the slot) or fails on the frozen value; a writer
//!    that meets a frozen slot waits for the new geometry and redoes its
//!    operation there. Readers keep following frozen slots: until the new
//!    index is published, their blocks are the keys' values.
//! 3. **Copy**: each frozen slot is placed in the new index (its key read
//!    from its block, so its new buckets are known), in position order; a
//!    key already placed — two copies of a key that concurrent inserts left
//!    and the freeze caught before they were resolved — keeps the first,
//!    the lowest position, which is the copy readers were returning.
//!    Nobody else knows the new index yet: plain stores build it.
//! 4. **Publish**: the header's spare record gets the new geometry (the
//!    switch is that record becoming valid), then the epoch word. A client
//!    that read an old slot checks the epoch after it (in its next batch):
//!    unchanged means its read came before the switch and stands.
//! 5. The old index is kept until every connected client has asked for a
//!    geometry at least this new (an idle client keeps it), then ages for
//!    a grace period like any freed space.
//!
//! A crash before step 4 leaves the old index in force with frozen slots:
//! the next server thaws them before admitting anyone. After step 4, the new
//! index is complete.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_common::layout::{
    decode_block, index_bytes, CounterState, Geometry, KeyHash, Payload, Slot, BUCKET_BYTES,
    CANDIDATE_SLOTS, SLOTS_PER_BUCKET,
};
use kv_common::mapping::Pages;
use kv_common::protocol::{Extent, Request, Response, PROTOCOL_VERSION};
use kv_common::transport::{self, read_u64, Connection, TransportError, Verb};

use crate::control::{self, GrowRequests, Shared};
use crate::{header, index_load, region};

/// Growth steps: the region's size, at least 64 MiB and at most 1 GiB (so
/// one step's allocation takes well under a second).
const MIN_GROWTH: u64 = 64 << 20;
const MAX_GROWTH: u64 = 1 << 30;
/// How often the index's occupancy is sampled.
const SAMPLE_EVERY: Duration = Duration::from_millis(500);
/// Least time between two passes that thaw stray frozen slots.
const THAW_GAP: Duration = Duration::from_secs(1);

pub fn run(shared: Arc<Shared>) {
    let mut cpu_mark = control::thread_cpu_us();
    // Old indexes and the epoch that replaced each.
    let mut old_indexes: Vec<(Extent, u64)> = Vec::new();
    // The epoch of the last growth whose earlier registrations remain.
    let mut registrations_since: Option<u64> = None;
    let mut last_thaw = None;
    loop {
        let Some(wanted) = next_requests(&shared) else {
            return;
        };
        if shared.stopping.load(Relaxed) {
            return;
        }
        if let Some(why) = region_cut_short(&shared) {
            tracing::error!("{why}");
            if let Ok(mut failure) = shared.failure.lock() {
                *failure = Some(why);
            }
            return;
        }
        let growths_before = shared.counters.growths.load(Relaxed);
        if wanted.heap == Some(shared.geometry().region_len) {
            if let Err(e) = grow_heap(&shared, 0) {
                tracing::warn!("the heap cannot grow: {e}");
            }
        }
        if wanted.hand_over {
            hand_over(&shared);
        }
        // A handed-over index stays as the move's last copy reads it.
        if shared.handed_over() {
            control::account_cpu(&shared.counters, &mut cpu_mark);
            continue;
        }
        repair_header(&shared);
        if wanted.thaw {
            // At most one pass a second: a client that keeps freezing
            // slots and reporting them must not keep this thread scanning.
            if let Some(wait) = last_thaw.map(|t: Instant| THAW_GAP.saturating_sub(t.elapsed())) {
                std::thread::sleep(wait);
            }
            thaw_stray(&shared);
            last_thaw = Some(Instant::now());
        }
        resize_if_due(&shared, wanted.resize, &mut old_indexes);
        release_old_indexes(&shared, &mut old_indexes);
        if shared.counters.growths.load(Relaxed) > growths_before {
            registrations_since = Some(shared.geometry().epoch);
        }
        forget_earlier_registrations(&shared, &mut registrations_since);
        control::account_cpu(&shared.counters, &mut cpu_mark);
    }
}

/// What the thread is asked to do next: waits for a request, or at most
/// until the occupancy is due to be sampled again. None: the server is
/// going down (a poisoned lock).
fn next_requests(shared: &Shared) -> Option<GrowRequests> {
    let (wanted, cv) = &shared.grow;
    let mut w = wanted.lock().ok()?;
    if w.resize.is_none() && w.heap.is_none() && !w.thaw && !w.hand_over {
        w = cv.wait_timeout(w, SAMPLE_EVERY).ok()?.0;
    }
    Some(std::mem::take(&mut *w))
}

/// Resizes the index if a client asked for it at its present size
/// (`asked_at`, in buckets), or if it is full enough; the old index joins
/// `old_indexes`. Afterwards `resizing` is cleared, unless another request
/// came meanwhile.
fn resize_if_due(shared: &Shared, asked_at: Option<u64>, old_indexes: &mut Vec<(Extent, u64)>) {
    let g = shared.geometry();
    let asked = asked_at == Some(g.bucket_count);
    if asked || should_resize(shared, &g) {
        shared.resizing.store(true, Relaxed);
        let started = Instant::now();
        match resize(shared) {
            Ok((old, new, copied)) => {
                old_indexes.push((old, new.epoch));
                let slots = g.index_buckets() * SLOTS_PER_BUCKET as u64;
                tracing::info!(
                    occupancy = format!("{:.3}", copied as f64 / slots as f64),
                    keys = copied,
                    buckets = new.bucket_count,
                    epoch = new.epoch,
                    took_ms = started.elapsed().as_millis() as u64,
                    "index resized"
                );
            }
            Err(ResizeError::Refused(e)) => {
                tracing::warn!("index resize refused: {e}");
                if let Ok(mut f) = shared.refused_resize.lock() {
                    *f = Some((shared.geometry().epoch, e, Instant::now()));
                }
            }
            Err(ResizeError::Failed(e)) => tracing::warn!("index resize failed: {e}"),
        }
    }
    // A request for an index that has grown since needs nothing more;
    // one that came meanwhile keeps it said.
    if let Ok(w) = shared.grow.0.lock() {
        if w.resize.is_none() && !w.hand_over {
            shared.resizing.store(false, Relaxed);
        }
    }
}

/// Drops the registrations of the region's earlier sizes (those before the
/// growth at epoch `since`), once every client holds the newest key (it
/// asked for a geometry since the growth).
fn forget_earlier_registrations(shared: &Shared, since: &mut Option<u64>) {
    if let Some(epoch) = *since {
        if shared
            .oldest_client_epoch()
            .is_none_or(|oldest| oldest >= epoch)
        {
            shared.listener.forget_earlier();
            *since = None;
        }
    }
}

/// Why the region can no longer be served, if its file has become
/// shorter than the region (truncated under the server by its own user or
/// root: nothing can keep a writable file from shrinking, and its pages
/// past the new end are gone).
fn region_cut_short(shared: &Shared) -> Option<String> {
    let len = shared.region_file.metadata().ok()?.len();
    let region_len = shared.geometry().region_len;
    (len < region_len).then(|| {
        format!(
            "the region file was truncated to {len} bytes under the server (the region is \
             {region_len}): what lay past that is lost, and touching it raises SIGBUS; stop the \
             server, restore the file, and run `kv-server check`"
        )
    })
}

/// Whether the index is past its load threshold and may grow.
fn should_resize(shared: &Shared, g: &Geometry) -> bool {
    if g.bucket_count * 2 > shared.limits.max_buckets {
        return false;
    }
    shared.resize_refusal(g.epoch).is_none()
        && index_load::occupancy(&shared.region, g)
            .is_ok_and(|o| o >= shared.limits.resize.resize_at)
}

/// Releases the old indexes every connected client has moved past. Under
/// the client-epoch lock, which a client's epoch is recorded under together
/// with the geometry it is told (so none can be told about an index
/// released meanwhile), and the collection lock (so no scan still reading an
/// old index as the index can free what it does not see there).
fn release_old_indexes(shared: &Shared, old: &mut Vec<(Extent, u64)>) {
    if old.is_empty() {
        return;
    }
    let Ok(_no_scan) = shared.collecting.lock() else {
        return;
    };
    let Ok(epochs) = shared.client_epochs.lock() else {
        return;
    };
    let oldest_known = epochs.values().copied().min().unwrap_or(u64::MAX);
    let ready_at = Instant::now() + shared.grace();
    old.retain(|&(extent, replaced_at)| {
        if oldest_known < replaced_at {
            return true;
        }
        if let Ok(mut p) = shared.pool.lock() {
            p.release(extent, ready_at);
        }
        false
    });
}

/// Grows the region at its end by a step (and by at least `at_least`
/// bytes), up to the cap. The new geometry is published before the pool
/// leases any of the new space, so a client handed some can learn where it
/// is.
pub fn grow_heap(shared: &Shared, at_least: u64) -> Result<(), String> {
    let g = shared.geometry();
    let cap = shared.limits.max_region;
    // The step doubles the region even where the reclaimer's bound
    // (`Shared::may_grow_for_headroom`) is nearer: steps that stopped at
    // it kept YCSB-A's copies at 620-690 MB instead of 1 GiB for 128 MB
    // live, but scans came twice as often, and at R=3 on a 2-core host the
    // three servers' scans cost the clients 15% of their throughput.
    let step = g
        .region_len
        .clamp(MIN_GROWTH, MAX_GROWTH)
        .max(at_least.next_multiple_of(4096));
    let new_len = g.region_len.saturating_add(step).min(cap) / 4096 * 4096;
    if new_len < g.region_len + at_least.max(1) {
        return Err(format!(
            "the region is {} bytes, its cap (--max-memory) {cap}",
            g.region_len
        ));
    }
    let pages = shared
        .region
        .grow(new_len)
        .map_err(|e| format!("growing the region file to {new_len} bytes: {e}"))?;
    // Nobody has the new part yet (not the device, not a client): it is on
    // huge pages now where the kernel could (see `SharedRegion::allocate`),
    // so that writes streaming through it do not miss the TLB every few
    // blocks (UPDATE-warm's p99 at the default size: 3.8 → 1.3 us). Where
    // it could not, the small pages are zeroed here (~0.3 s/GiB), not by
    // the faults of the clients that first write each page (their system
    // time per 1 M YCSB-A operations at R=3 after the heaps grew: 1.1–1.2 s
    // → 0.5 s). The growth is published that much later.
    if let Pages::SmallFrom(small, e) = pages {
        tracing::info!("the grown region keeps small pages from byte {small} on: {e}");
        if let Err(e) = shared.region.populate(small, new_len) {
            tracing::debug!("the grown part is zeroed as clients first write it: {e}");
        }
    }
    shared.listener.extend().map_err(|e| e.to_string())?;
    let new = Geometry {
        region_len: new_len,
        heap_size: new_len - g.heap_offset,
        epoch: g.epoch + 1,
        ..g
    };
    publish(shared, &new)?;
    if let Ok(mut p) = shared.pool.lock() {
        p.grow(new_len);
    }
    shared.counters.growths.fetch_add(1, Relaxed);
    tracing::info!(region_bytes = new_len, epoch = new.epoch, "heap grew");
    Ok(())
}

/// Makes `g` the geometry: in the header first (what a restart finds and
/// what clients' epoch checks read), then for the control plane, then in
/// the header's twin record.
fn publish(shared: &Shared, g: &Geometry) -> Result<(), String> {
    header::switch(&shared.region, g).map_err(|e| e.to_string())?;
    match shared.geometry.write() {
        Ok(mut current) => *current = *g,
        Err(poisoned) => *poisoned.into_inner() = *g,
    }
    fault_point("switched");
    // The switch stands; a twin not written is written at the next start.
    if let Err(e) = header::write_twin(&shared.region, g) {
        tracing::warn!("writing the header's twin record: {e}");
    }
    Ok(())
}

/// Why a resize did not happen.
#[derive(Debug)]
enum ResizeError {
    /// It cannot, at this size: no memory or a cap. Clients asking again for
    /// the same epoch are told so.
    Refused(String),
    /// Something transient (the mover could not connect, a verb failed):
    /// the next request tries again.
    Failed(String),
}

/// Doubles the index (see the module doc). Returns the old index's space,
/// the new geometry and how many keys moved.
fn resize(shared: &Shared) -> Result<(Extent, Geometry, u64), ResizeError> {
    let old = shared.geometry();
    let mut mover =
        Mover::connect(shared).map_err(|e| ResizeError::Failed(format!("mover: {e}")))?;
    let mut buckets = old.bucket_count * 2;
    let mut new_index = reserve_index(shared, buckets).map_err(ResizeError::Refused)?;
    let freezing = Instant::now();
    if let Err(e) = mover.freeze(&old) {
        release_now(shared, new_index);
        thaw(shared, &old, mover);
        return Err(ResizeError::Failed(format!("freezing the index: {e}")));
    }
    let freeze_ms = freezing.elapsed().as_millis() as u64;
    fault_point("frozen");
    // The frozen index, as it lies in the region now: the heap may have
    // grown since the resize began (reserving the new index, say), and the
    // slots frozen last may point into the new space.
    let frozen = Geometry {
        index_offset: old.index_offset,
        bucket_count: old.bucket_count,
        ..shared.geometry()
    };
    // Twice the buckets hold the same keys at under half the load; a key
    // finding no room there is so unlikely that doubling again is enough.
    let (slots, copied) = loop {
        match copy(shared, &frozen, buckets, new_index.offset) {
            Ok(Some(done)) => break done,
            Ok(None) if buckets * 2 <= shared.limits.max_buckets => {
                release_now(shared, new_index);
                buckets *= 2;
                new_index = match reserve_index(shared, buckets) {
                    Ok(e) => e,
                    Err(e) => {
                        thaw(shared, &old, mover);
                        return Err(ResizeError::Refused(e));
                    }
                };
            }
            Ok(None) => {
                release_now(shared, new_index);
                thaw(shared, &old, mover);
                return Err(ResizeError::Refused(format!(
                    "a key finds no room in {buckets} buckets, the cap (--max-buckets)"
                )));
            }
            Err(e) => {
                release_now(shared, new_index);
                thaw(shared, &old, mover);
                return Err(ResizeError::Failed(format!("copying the index: {e}")));
            }
        }
    };
    // The heap may have grown meanwhile (a newer epoch): build on that.
    let current = shared.geometry();
    let new = Geometry {
        index_offset: new_index.offset,
        bucket_count: buckets,
        epoch: current.epoch + 1,
        ..current
    };
    let published = shared
        .region
        .write(new.index_offset, &slots)
        .map_err(|e| e.to_string())
        .and_then(|()| {
            fault_point("copied");
            publish(shared, &new)
        });
    if let Err(e) = published {
        release_now(shared, new_index);
        thaw(shared, &old, mover);
        return Err(ResizeError::Failed(e));
    }
    fault_point("published");
    shared.counters.resizes.fetch_add(1, Relaxed);
    mover.close();
    let old_extent = Extent {
        offset: old.index_offset,
        len: old.index_bytes(),
    };
    tracing::debug!(freeze_ms, copied, "index published");
    Ok((old_extent, new, copied))
}

/// Freezes the index for a move's last copy (see [`control::Handover`]).
/// Writers see a resize under way and wait for a geometry that never comes;
/// the server stopping ends their wait.
fn hand_over(shared: &Shared) {
    let g = shared.geometry();
    shared.resizing.store(true, Relaxed);
    let frozen = Mover::connect(shared).and_then(|mut mover| {
        let frozen = mover.freeze(&g);
        if frozen.is_err() {
            let _ = mover.thaw(&g);
        }
        mover.close();
        frozen
    });
    let outcome = match frozen {
        Ok(()) => control::Handover::Frozen,
        Err(e) => {
            shared.resizing.store(false, Relaxed);
            control::Handover::Failed(format!("freezing the index: {e}"))
        }
    };
    if let Ok(mut h) = shared.handover.lock() {
        *h = outcome;
    }
}

/// Gives a resize's frozen index back to the writers, who wait meanwhile;
/// through new connections if the mover's broke (until the server stops).
fn thaw(shared: &Shared, g: &Geometry, mover: Mover) {
    let mut mover = Some(mover);
    loop {
        if let Some(mut m) = mover.take() {
            match m.thaw(g) {
                Ok(()) => return m.close(),
                // Dropped: its session ends before the next connects.
                Err(e) => tracing::error!("thawing the index after a failed resize: {e}"),
            }
        }
        if shared.stopping.load(Relaxed) {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
        mover = Mover::connect(shared).ok();
    }
}

/// Least time between two warnings of header repairs: a client that keeps
/// writing there must not flood the log (the metric counts each).
const REPAIR_WARN_GAP: Duration = Duration::from_secs(60);

/// Writes the header back where it differs from the geometry in force:
/// at each pass of this thread, and at stop. Only this thread switches
/// geometries, so between its switches the header must say what it holds;
/// anything else is damage, or a client that wrote there (over shm a
/// client maps the header; over rdma the region is one registration). A
/// bumped epoch word would send every client that meets a frozen slot to
/// ask for a geometry that does not exist, and a restart would refuse the
/// region as one whose record in force is damaged; a scribbled record
/// would leave a restart to rebuild.
pub(crate) fn repair_header(shared: &Shared) {
    match header::finish_switch(&shared.region, &shared.geometry()) {
        Ok(false) => {}
        Ok(true) => {
            let repairs = shared.counters.header_repairs.fetch_add(1, Relaxed) + 1;
            let mut warned = shared
                .header_repair_warned
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            if warned.is_none_or(|at| at.elapsed() >= REPAIR_WARN_GAP) {
                *warned = Some(Instant::now());
                tracing::warn!(
                    repairs,
                    "the header had changed (damage, or a client wrote there): written back"
                );
            }
        }
        Err(e) => tracing::warn!("repairing the header: {e}"),
    }
}

/// Thaws the frozen slots of the index in force. Only a resize freezes
/// slots, and none is under way (this thread runs them, one at a time), so
/// these are stray bits — damage, or a client that set them — that would
/// stall every writer of their buckets. Through the mover, in the clients'
/// atomicity domain; a failure is tried again at the next report or scan.
fn thaw_stray(shared: &Shared) {
    let g = shared.geometry();
    let (mut found, mut groups) = (0u64, Vec::new());
    let scanned = region::for_each_word(&shared.region, &g, |pos, slot| {
        if slot.is_frozen() {
            found += 1;
            let group = pos.bucket / FREEZE_BUCKETS * FREEZE_BUCKETS;
            if groups.last() != Some(&group) {
                groups.push(group);
            }
        }
    });
    if let Err(e) = scanned {
        tracing::warn!("looking for stray frozen slots: {e}");
        return;
    }
    if groups.is_empty() {
        return;
    }
    let thawed = Mover::connect(shared).and_then(|mut mover| {
        // A client changing them as fast as they are thawed is left for
        // the next pass rather than holding this thread.
        let thawed = groups
            .iter()
            .try_for_each(|&first| mover.change_group(&g, first, thaw_change, Some(16)));
        mover.close();
        thawed
    });
    match thawed {
        Ok(()) => {
            shared.counters.thawed_slots.fetch_add(found, Relaxed);
            tracing::warn!(
                slots = found,
                "thawed frozen slots with no resize under way (damage, or a client that set them)"
            );
        }
        Err(e) => tracing::warn!("thawing stray frozen slots: {e}"),
    }
}

/// Space for an index of `buckets` buckets, from free heap or new space.
fn reserve_index(shared: &Shared, buckets: u64) -> Result<Extent, String> {
    let len = index_bytes(buckets);
    let reserve = || shared.pool.lock().ok().and_then(|mut p| p.reserve(len));
    if let Some(e) = reserve() {
        return Ok(e);
    }
    grow_heap(shared, len)?;
    reserve().ok_or_else(|| format!("no {len}-byte run of free heap for the new index"))
}

/// Returns an index reservation nobody has seen to the free space.
fn release_now(shared: &Shared, e: Extent) {
    if let Ok(mut p) = shared.pool.lock() {
        p.release(e, Instant::now());
    }
}

/// What the copy does with a counter whose creation has not settled.
enum Unsettled<'a> {
    /// Put it off into this list (the first pass).
    PutOff(&'a mut Vec<Slot>),
    /// Place it now (the last pass).
    Place,
}

/// Builds the new index (in memory) from the frozen old one: the slots to
/// store and how many were carried over, or None if some key found its
/// buckets full.
fn copy(
    shared: &Shared,
    old: &Geometry,
    buckets: u64,
    at: u64,
) -> Result<Option<(Vec<u64>, u64)>, TransportError> {
    let region = &shared.region;
    let new = Geometry {
        index_offset: at,
        bucket_count: buckets,
        ..*old
    };
    let mut occupied = Vec::new();
    region::for_each_slot(region, old, |_, s| occupied.push(s.thawed()))?;
    let mut slots = vec![0u64; (new.index_buckets() as usize) * SLOTS_PER_BUCKET];
    let at_slot =
        |pos: kv_common::layout::SlotPos| pos.bucket as usize * SLOTS_PER_BUCKET + pos.index;
    let mut blocks = KeyReader::new(region, old);
    let (mut copied, mut duplicates, mut damaged) = (0u64, 0u64, 0u64);
    let halfway = occupied.len() / 2;
    // Counters that have not settled come last, so that a copy readers see
    // wins over them (their creators start over); given-up ones are dropped.
    let mut unsettled = Vec::new();
    // Places one old slot; false if its key's buckets are full.
    let mut place = |slot: Slot, unsettled: Unsettled<'_>| -> bool {
        let Some((k, state)) = blocks.key(slot) else {
            damaged += 1;
            return true;
        };
        match state {
            Some(CounterState::Abandoned) => return true,
            Some(CounterState::Pending) => {
                if let Unsettled::PutOff(later) = unsettled {
                    later.push(slot);
                    return true;
                }
            }
            _ => {}
        }
        let key = k.to_vec();
        let h = KeyHash::new(&key, buckets);
        let candidates: [Slot; CANDIDATE_SLOTS] =
            std::array::from_fn(|i| Slot(slots[at_slot(h.slot_pos(i))]));
        let placed = candidates.iter().any(|&c| {
            !c.is_empty()
                && c.fingerprint() == h.fingerprint
                && blocks.key(c).is_some_and(|(k, _)| k == &key[..])
        });
        if placed {
            duplicates += 1;
            return true;
        }
        let Some(i) = KeyHash::insert_choice(&candidates) else {
            return false;
        };
        slots[at_slot(h.slot_pos(i))] = slot.0;
        copied += 1;
        true
    };
    for (n, slot) in occupied.into_iter().enumerate() {
        if n == halfway {
            fault_point("copying");
        }
        if !place(slot, Unsettled::PutOff(&mut unsettled)) {
            return Ok(None);
        }
    }
    for slot in std::mem::take(&mut unsettled) {
        if !place(slot, Unsettled::Place) {
            return Ok(None);
        }
    }
    if duplicates > 0 {
        tracing::info!(
            duplicates,
            "resize kept the lowest copy of keys inserted twice"
        );
    }
    if damaged > 0 {
        tracing::error!(
            damaged,
            "resize dropped slots whose block fails validation (damage; `kv-server check` names such slots)"
        );
        shared.counters.corrupt_slots.fetch_add(damaged, Relaxed);
    }
    Ok(Some((slots, copied)))
}

/// Reads the keys of blocks, reusing its buffers (a resize reads one per key).
struct KeyReader<'a> {
    region: &'a kv_common::mapping::SharedRegion,
    g: &'a Geometry,
    words: Vec<u64>,
    bytes: Vec<u8>,
}

impl<'a> KeyReader<'a> {
    fn new(region: &'a kv_common::mapping::SharedRegion, g: &'a Geometry) -> Self {
        KeyReader {
            region,
            g,
            words: Vec::new(),
            bytes: Vec::new(),
        }
    }

    /// The key of the block `slot` points at, if it is a valid block, and
    /// its state if it is a counter.
    fn key(&mut self, slot: Slot) -> Option<(&[u8], Option<CounterState>)> {
        let (offset, len) = self.g.block_span(slot)?;
        self.words.resize(len / 8, 0);
        self.region.read(offset, &mut self.words).ok()?;
        self.bytes.clear();
        self.bytes
            .extend(self.words.iter().flat_map(|w| w.to_le_bytes()));
        let view = decode_block(&self.bytes).ok()?;
        let state = match view.payload {
            Payload::Counter { state, .. } => Some(state),
            Payload::Bytes(_) => None,
        };
        Some((view.key, state))
    }
}

/// Stops the server here when the fault-injection variable names this step
/// (tests kill it in the middle of a migration or a header switch this way).
pub(crate) fn fault_point(step: &str) {
    if std::env::var("ONEKV_RESIZE_FAULT").is_ok_and(|s| s == step) {
        tracing::error!(
            step,
            "ONEKV_RESIZE_FAULT: aborting in the middle of a resize"
        );
        std::process::abort();
    }
}

/// A secret only this server process knows: the mover presents it instead
/// of the configured secret, and is admitted even when `--max-clients` are
/// connected (a full server must still be able to resize).
pub fn mover_token() -> [u8; 32] {
    let mut token = [0u8; 32];
    kv_common::random::fill(&mut token);
    token
}

/// The server's own client connection, through which it changes slots that
/// clients CAS: in their atomicity domain (RDMA atomics on a loopback queue
/// pair; CPU atomics on shm).
struct Mover {
    conn: Box<dyn Connection>,
}

/// Buckets frozen per batch: 64 slots, one CAS each at most, within a
/// queue pair's batch limit.
const FREEZE_BUCKETS: u64 = 8;
const CAS_AT: usize = (FREEZE_BUCKETS * BUCKET_BYTES) as usize;

/// The first bucket of every group of `g`'s index.
fn all_groups(g: &Geometry) -> impl Iterator<Item = u64> {
    (0..g.index_buckets()).step_by(FREEZE_BUCKETS as usize)
}

/// A frozen word's thawed value.
fn thaw_change(w: u64) -> Option<u64> {
    Slot(w).is_frozen().then(|| Slot(w).thawed().0)
}

impl Mover {
    fn connect(shared: &Shared) -> Result<Mover, TransportError> {
        let mut conn = transport::connect(&shared.address, &transport::ConnectOptions::default())?;
        let reply = conn.call(&Request::Connect {
            protocol_version: PROTOCOL_VERSION,
            secret: shared.mover_token.to_vec(),
            group: 0,
        })?;
        let Response::Connected(info) = reply else {
            return Err(TransportError::Unsupported(format!(
                "the server refused its own mover: {reply:?}"
            )));
        };
        conn.attach(&info.region, 2 * CAS_AT)?;
        Ok(Mover { conn })
    }

    /// Sets the frozen bit of every slot of `g`'s index.
    fn freeze(&mut self, g: &Geometry) -> Result<(), TransportError> {
        let halfway = g.index_buckets() / 2;
        let freeze = |w| (!Slot(w).is_frozen()).then(|| Slot(w).frozen().0);
        for first in all_groups(g) {
            self.change_group(g, first, freeze, None)?;
            if first >= halfway && first < halfway + FREEZE_BUCKETS {
                fault_point("freezing");
            }
        }
        Ok(())
    }

    /// Clears the frozen bits again (a resize that could not finish).
    fn thaw(&mut self, g: &Geometry) -> Result<(), TransportError> {
        all_groups(g).try_for_each(|first| self.change_group(g, first, thaw_change, None))
    }

    /// For the group of `FREEZE_BUCKETS` buckets from `first`: read it, CAS
    /// every word `change` maps to a new value, and repeat while a CAS
    /// failed (a client CAS landed between the read and ours), at most
    /// `rounds` times if given: two round trips when none did.
    fn change_group(
        &mut self,
        g: &Geometry,
        first: u64,
        change: impl Fn(u64) -> Option<u64>,
        rounds: Option<usize>,
    ) -> Result<(), TransportError> {
        let n = FREEZE_BUCKETS.min(g.index_buckets() - first);
        let remote = g.bucket_offset(first);
        for _ in 0..rounds.unwrap_or(usize::MAX) {
            self.conn.post(&[Verb::Read {
                remote,
                local: 0,
                len: (n * BUCKET_BYTES) as usize,
            }])?;
            let local = self.conn.local();
            let cas: Vec<Verb> = (0..n as usize * SLOTS_PER_BUCKET)
                .filter_map(|i| {
                    let w = read_u64(local, i * 8);
                    change(w).map(|swap| Verb::Cas {
                        remote: remote + i as u64 * 8,
                        local: CAS_AT + i * 8,
                        expect: w,
                        swap,
                    })
                })
                .collect();
            if cas.is_empty() {
                break;
            }
            self.conn.post(&cas)?;
            let local = self.conn.local();
            let all_swapped = cas.iter().all(|v| match *v {
                Verb::Cas {
                    local: at, expect, ..
                } => read_u64(local, at) == expect,
                _ => true,
            });
            if all_swapped {
                break;
            }
        }
        Ok(())
    }

    fn close(mut self) {
        let _ = self.conn.call(&Request::Disconnect);
    }
}
