//! The region's header on the server's side: which record is in force,
//! how a switch writes it, finishing a switch a crash interrupted, and
//! rebuilding a record lost to damage by locating the index in the heap.
//!
//! # Switching
//!
//! A switch writes the new geometry into the record the current one does
//! not use (checksum reset, body, checksum last: a crash at any point
//! leaves one of the two geometries valid), then the epoch word (clients
//! learn of the switch from it), then the same record into the other slot.
//! After that nothing in the header names the previous geometry, whose
//! index may become heap: a flipped byte in either record leaves its twin
//! in force. A record older than the epoch word is never taken
//! ([`Geometry::decode_header`]); a region whose newest valid record is
//! older is refused, and `kv-server check --repair` rebuilds the record.
//!
//! # Rebuilding
//!
//! Nothing else in the region says where the index is, but the index says
//! so itself: each occupied slot points at a block whose key hashes to the
//! slot's bucket. [`locate`] finds every heap word that points at a valid
//! block carrying the word's fingerprint, lets each vote, for every index
//! size, for the index start that would put it in one of its key's
//! buckets, and checks the best start of each size: nearly every non-zero
//! word of its run must be such a slot in its right bucket. Indexes only
//! grow, so of the well-supported runs the largest is the newest; a
//! released older index may still hold stale slots, but fewer of them
//! check out, as their blocks get reused.

use kv_common::layout::{
    decode_block, index_bytes, Geometry, KeyHash, LayoutError, Slot, BUCKET_BYTES, DEFAULT_BUCKETS,
    EPOCH_OFFSET, HEADER_READ_WORDS, HEAP_OFFSET, MAX_BUCKETS, MIN_BUCKETS, RECORD_OFFSETS,
};
use kv_common::mapping::{AccessError, SharedRegion};

/// The geometry in force: the header's newest valid record, unless the
/// region published a newer epoch (then the record in force is damaged).
pub fn read_geometry(region: &SharedRegion) -> Result<Geometry, HeaderError> {
    let mut words = [0u64; HEADER_READ_WORDS];
    region.read(0, &mut words)?;
    let published = region.load(EPOCH_OFFSET)?;
    Ok(Geometry::decode_header(&words, published)?)
}

/// Why the header gave no geometry.
#[derive(Debug, thiserror::Error)]
pub enum HeaderError {
    #[error(transparent)]
    Layout(#[from] LayoutError),
    #[error(transparent)]
    Access(#[from] AccessError),
}

impl HeaderError {
    /// Damage `check --repair` can rebuild from (see [`LayoutError::is_header_damage`]).
    pub fn is_damage(&self) -> bool {
        matches!(self, HeaderError::Layout(e) if e.is_header_damage())
    }
}

/// Makes `g` the region's geometry (see the module doc): its record and
/// the epoch word ([`switch`]), then its twin ([`write_twin`]).
pub fn write_geometry(region: &SharedRegion, g: &Geometry) -> Result<(), AccessError> {
    switch(region, g)?;
    write_twin(region, g)
}

/// The switch itself: `g`'s record, then the epoch word that tells clients.
pub fn switch(region: &SharedRegion, g: &Geometry) -> Result<(), AccessError> {
    write_record(region, g.record_offset(), g)?;
    region.store(EPOCH_OFFSET, g.epoch)
}

/// The other record gets `g` too, once the epoch word names it: the
/// previous geometry is then nowhere in the header.
pub fn write_twin(region: &SharedRegion, g: &Geometry) -> Result<(), AccessError> {
    write_record(region, g.twin_record_offset(), g)
}

/// Finishes a switch to `g` (the geometry in force) that a crash
/// interrupted, or that a damaged record undid: the epoch word and both
/// records name `g` afterwards. Returns whether anything was rewritten.
/// Before anyone is admitted, or by the thread that switches geometries
/// (between its switches).
pub fn finish_switch(region: &SharedRegion, g: &Geometry) -> Result<bool, AccessError> {
    let mut words = [0u64; HEADER_READ_WORDS];
    region.read(0, &mut words)?;
    let records = Geometry::decode_records(&words);
    let mut rewrote = false;
    for (record, at) in records.iter().zip(RECORD_OFFSETS) {
        if record.as_ref().ok() != Some(g) {
            write_record(region, at, g)?;
            rewrote = true;
        }
    }
    if region.load(EPOCH_OFFSET)? != g.epoch {
        region.store(EPOCH_OFFSET, g.epoch)?;
        rewrote = true;
    }
    Ok(rewrote)
}

/// One record written whole, its checksum word reset first so that no
/// moment has a stale checksum matching a half-written body.
fn write_record(region: &SharedRegion, at: u64, g: &Geometry) -> Result<(), AccessError> {
    let words = g.encode_header();
    let (body, checksum) = words.split_at(words.len() - 1);
    region.store(at + body.len() as u64 * 8, 0)?;
    region.write(at, body)?;
    region.store(at + body.len() as u64 * 8, checksum[0])
}

/// A slot found in the heap: where it lies, and its key's hashes.
struct FoundSlot {
    at: u64,
    hashes: [u64; 2],
}

/// Slots a located index must have before a larger one is preferred over
/// a better-supported smaller one: fewer could agree with a doubled index
/// by chance (each with probability 1/2).
const CONVINCING_SLOTS: u64 = 16;

/// Slots that vote for an index's start (a sample of them, evenly spread).
const VOTERS: usize = 1 << 16;

/// The geometry of a region whose record in force is lost, from the index
/// found in its heap (see the module doc), under an epoch newer than any
/// the region has named. The region's length is the file's; the chunk size
/// is the surviving record's (it never changes), or the one a region of
/// this size is made with.
pub fn locate(region: &SharedRegion) -> Result<Geometry, String> {
    let mut words = [0u64; HEADER_READ_WORDS];
    region.read(0, &mut words).map_err(|e| e.to_string())?;
    let published = region.load(EPOCH_OFFSET).map_err(|e| e.to_string())?;
    let older = Geometry::decode_records(&words)
        .into_iter()
        .filter_map(Result::ok)
        .max_by_key(|g| g.epoch);
    let region_len = region.len().min(Slot::OFFSET_MASK) / 4096 * 4096;
    let chunk_size = match older {
        Some(g) => g.chunk_size,
        None => {
            Geometry::for_memory(region_len, Some(MIN_BUCKETS))
                .map_err(|e| e.to_string())?
                .chunk_size
        }
    };
    let frame = Geometry {
        region_len,
        index_offset: HEAP_OFFSET,
        bucket_count: MIN_BUCKETS,
        heap_offset: HEAP_OFFSET,
        heap_size: region_len.saturating_sub(HEAP_OFFSET),
        chunk_size,
        // The epoch word is unchecked: one past any count of switches is
        // damage.
        epoch: (if published < 1 << 48 { published } else { 0 })
            .max(older.map_or(0, |g| g.epoch))
            .saturating_add(1),
    };
    frame.validate().map_err(|e| e.to_string())?;
    let slots = find_slots(region, &frame).map_err(|e| e.to_string())?;
    // Indexes only grow: the surviving record's is the smallest possible.
    let smallest = older.map_or(MIN_BUCKETS, |g| g.bucket_count);
    if slots.is_empty() {
        // Nothing stored: any index will do, and `--repair` empties
        // whatever its run holds (no word of it can be a slot).
        tracing::info!("no slot found in the heap: the region holds no key");
        return Ok(Geometry {
            bucket_count: older.map_or(DEFAULT_BUCKETS, |g| g.bucket_count),
            ..frame
        });
    }
    let mut found: Vec<(u64, u64, u64)> = Vec::new();
    let mut buckets = smallest;
    while buckets <= MAX_BUCKETS && index_bytes(buckets) <= frame.heap_size {
        if let Some((offset, support)) = best_start(region, &frame, &slots, buckets)? {
            found.push((buckets, offset, support));
        }
        buckets *= 2;
    }
    // Few slots: the best supported; of two alike, the larger index (the
    // newer) unless both start at one place (the same index seen at two
    // sizes, where the smaller is its own).
    let chosen = found
        .iter()
        .rev()
        .find(|f| f.2 >= CONVINCING_SLOTS)
        .or_else(|| {
            found.iter().max_by(|a, b| {
                let by_size = if a.1 == b.1 {
                    b.0.cmp(&a.0)
                } else {
                    a.0.cmp(&b.0)
                };
                a.2.cmp(&b.2).then(by_size)
            })
        });
    let Some(&(bucket_count, index_offset, support)) = chosen else {
        return Err(format!(
            "{} slots were found in the heap, but no run of it holds an index",
            slots.len()
        ));
    };
    tracing::info!(bucket_count, index_offset, support, "index located");
    let g = Geometry {
        index_offset,
        bucket_count,
        ..frame
    };
    g.validate().map_err(|e| e.to_string())?;
    Ok(g)
}

/// Every heap word that can be an occupied slot: it points at a whole
/// block outside itself that passes its checksum and whose key carries the
/// word's fingerprint.
fn find_slots(region: &SharedRegion, frame: &Geometry) -> Result<Vec<FoundSlot>, AccessError> {
    const CHUNK: u64 = 1 << 20;
    let mut words = vec![0u64; CHUNK as usize / 8];
    let mut block = Vec::new();
    let mut found = Vec::new();
    let mut start = frame.heap_offset;
    while start < frame.region_len {
        let n = (frame.region_len - start).min(CHUNK);
        let run = &mut words[..n as usize / 8];
        region.read(start, run)?;
        for (i, &w) in run.iter().enumerate() {
            let at = start + i as u64 * 8;
            let slot = Slot(w).thawed();
            if slot.is_empty() {
                continue;
            }
            let Some((offset, len)) = frame.block_span(slot) else {
                continue;
            };
            // No block is larger than a chunk; nor can a slot be in its own.
            if len as u64 > frame.chunk_size || (offset..offset + len as u64).contains(&at) {
                continue;
            }
            block.resize(len / 8, 0u64);
            region.read(offset, &mut block)?;
            let bytes: Vec<u8> = block.iter().flat_map(|w| w.to_le_bytes()).collect();
            if let Ok(view) = decode_block(&bytes) {
                let hashes = KeyHash::hashes(view.key);
                if KeyHash::from_hashes(hashes, MIN_BUCKETS).fingerprint == slot.fingerprint() {
                    found.push(FoundSlot { at, hashes });
                }
            }
        }
        start += n;
    }
    Ok(found)
}

/// For an index of `buckets`: the start most slots vote for, if its run
/// checks out (at most one non-zero word in twenty is anything but a slot
/// in one of its key's buckets), and how many slots it holds.
fn best_start(
    region: &SharedRegion,
    frame: &Geometry,
    slots: &[FoundSlot],
    buckets: u64,
) -> Result<Option<(u64, u64)>, String> {
    let run_len = index_bytes(buckets);
    let fits = |start: u64| start >= frame.heap_offset && start + run_len <= frame.region_len;
    // A sample votes (the index in force holds most slots, so it shows in
    // any even sample); every slot is counted for the start it chose.
    let stride = (slots.len() / VOTERS).max(1);
    let mut votes: Vec<u64> = Vec::with_capacity(slots.len().min(VOTERS) * 6);
    for s in slots.iter().step_by(stride) {
        let line = s.at / BUCKET_BYTES * BUCKET_BYTES;
        for b in KeyHash::from_hashes(s.hashes, buckets).buckets() {
            if let Some(start) = line.checked_sub(b * BUCKET_BYTES).filter(|&o| fits(o)) {
                votes.push(start);
            }
        }
    }
    votes.sort_unstable();
    let Some((start, _)) = votes
        .chunk_by(|a, b| a == b)
        .map(|run| (run[0], run.len()))
        .max_by_key(|&(start, n)| (n, std::cmp::Reverse(start)))
    else {
        return Ok(None);
    };
    let first = slots.partition_point(|s| s.at < start);
    let last = slots.partition_point(|s| s.at < start + run_len);
    let support = slots[first..last]
        .iter()
        .filter(|s| {
            let bucket = (s.at - start) / BUCKET_BYTES;
            KeyHash::from_hashes(s.hashes, buckets)
                .buckets()
                .contains(&bucket)
        })
        .count() as u64;
    let occupied = occupied_words(region, start, run_len).map_err(|e| e.to_string())?;
    Ok(
        (support > 0 && (occupied - support.min(occupied)) * 20 <= occupied)
            .then_some((start, support)),
    )
}

/// Words of `[start, start + len)` that hold a slot (frozen or not), read
/// a megabyte at a time.
fn occupied_words(region: &SharedRegion, start: u64, len: u64) -> Result<u64, AccessError> {
    const CHUNK: u64 = 1 << 20;
    let mut words = vec![0u64; (CHUNK.min(len) / 8) as usize];
    let (mut at, mut occupied) = (start, 0);
    while at < start + len {
        let n = (start + len - at).min(CHUNK);
        let part = &mut words[..(n / 8) as usize];
        region.read(at, part)?;
        occupied += part
            .iter()
            .filter(|&&w| !Slot(w).thawed().is_empty())
            .count() as u64;
        at += n;
    }
    Ok(occupied)
}
