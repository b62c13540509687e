//! The registered region: header, index of buckets of 8-byte slots, and a heap
//! of key-value blocks. Everything a client reaches with one-sided verbs is
//! described here, so server and client agree on it byte for byte.
//!
//! ```text
//! 0        4096                36864                                        region_len
//! | header | key table: 4096×8 | heap: the index (buckets × 64 B), chunks of blocks |
//! ```
//!
//! The index is a contiguous run of the heap: a new region's starts at the
//! heap's start, and a resize builds a larger one elsewhere in the heap and
//! switches the header to it. The region grows at its end. The header holds
//! two geometry records, each with its own checksum; the valid one with the
//! higher epoch is current, so a switch is one record written in full
//! (checksum last) and a crash in the middle leaves the previous one in
//! force. The word at [`EPOCH_OFFSET`] repeats the current epoch for clients,
//! who read it with one READ to learn whether the geometry has changed.
//! It is written after the record it names, and then the other record gets
//! the same geometry: once a switch is complete both records hold it, and
//! the previous one (whose index may since have become heap) is gone. A
//! valid record older than the epoch word is therefore never in force: the
//! newer one was damaged after its switch completed (see
//! [`Geometry::decode_header`]).
//!
//! The header page past the records and the epoch word holds a replicated
//! shard's insert locks ([`INSERT_LOCKS_OFFSET`]), which clients CAS.
//!
//! The key table holds one access key per connected client of the shm
//! backend (a client's verbs check its own word, so one client can be cut
//! off without touching the others, as a NIC does by moving its queue pair
//! to the error state). The rdma backend does not use it.
//!
//! Every number here may come from an untrusted file or message: geometry
//! arithmetic is checked, and a slot's size class is validated before it is
//! turned into a length.

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// "ONEKVRG1" read as a little-endian word.
pub const MAGIC: u64 = u64::from_le_bytes(*b"ONEKVRG1");
/// Bumped whenever the byte layout of the region changes (2: key table;
/// 3: two header records, the index inside the heap, two-bucket windows).
pub const FORMAT_VERSION: u64 = 3;
pub const HEADER_SIZE: u64 = 4096;
/// Words of a header record covered by its checksum (the checksum is word 9).
const HEADER_WORDS: usize = 9;
/// Words between the starts of the two header records.
const RECORD_STRIDE: usize = 16;
/// Words of a header record, its checksum included.
pub const RECORD_WORDS: usize = HEADER_WORDS + 1;
/// Byte offsets of the two header records.
pub const RECORD_OFFSETS: [u64; 2] = [0, RECORD_STRIDE as u64 * 8];
/// Header words a reader needs to see both records.
pub const HEADER_READ_WORDS: usize = RECORD_STRIDE + HEADER_WORDS + 1;
/// The current epoch, for clients (outside both records' checksums).
pub const EPOCH_OFFSET: u64 = 256;
/// The shm backend's per-client access keys, one word each, right after the
/// header. Outside the header checksum: every connect and fence changes it.
pub const KEY_TABLE_OFFSET: u64 = HEADER_SIZE;
pub const KEY_TABLE_ENTRIES: u64 = 4096;
/// Where the heap starts, and in it a new region's first index.
pub const HEAP_OFFSET: u64 = KEY_TABLE_OFFSET + KEY_TABLE_ENTRIES * 8;
/// Largest bucket count a header may claim (2^40 buckets = 64 TiB of index).
pub const MAX_BUCKETS: u64 = 1 << 40;

pub const SLOTS_PER_BUCKET: usize = 8;
/// One bucket is one 64-byte cache line: one READ fetches it.
pub const BUCKET_BYTES: u64 = (SLOTS_PER_BUCKET * 8) as u64;

/// Block header: checksum word, then a word of lengths.
pub const BLOCK_HEADER: usize = 16;
pub const MAX_KEY: usize = 1024;
pub const MAX_VALUE: usize = 1 << 20;
/// Every size class is a multiple of this, so blocks stay 8-byte aligned.
pub const BLOCK_ALIGN: u64 = 16;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    #[error("not a onekv region (bad magic number)")]
    BadMagic,
    #[error("region has format version {found}, this build reads version {expected}")]
    UnsupportedVersion { found: u64, expected: u64 },
    #[error("region header checksum mismatch (corrupt header)")]
    BadHeaderChecksum,
    #[error("bad region geometry: {0}")]
    BadGeometry(String),
    /// The record in force is damaged and the valid one is older than the
    /// epoch the region published: its index may have become heap since.
    #[error(
        "the header's record in force is damaged: the valid record is of epoch {valid}, \
         but the region had published epoch {published}, and starting on the older \
         record would lose every write since"
    )]
    RecordInForceDamaged { valid: u64, published: u64 },
}

impl LayoutError {
    /// Damage to a header that was once a region's (not another file, nor
    /// another format version): what `kv-server check --repair` rebuilds.
    pub fn is_header_damage(&self) -> bool {
        matches!(
            self,
            LayoutError::BadHeaderChecksum | LayoutError::RecordInForceDamaged { .. }
        )
    }
}

/// Where everything is inside the region; the server writes it into the
/// header and hands it to every client at connect. `epoch` counts the
/// changes (index resizes, heap growth) since the region was created.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Geometry {
    /// Bytes of the region (header, key table, heap).
    pub region_len: u64,
    /// Where the index in force starts (it is a run of the heap).
    pub index_offset: u64,
    /// Buckets of the index (eight slots each, a power of two).
    pub bucket_count: u64,
    /// Where the heap starts.
    pub heap_offset: u64,
    /// Bytes of the heap.
    pub heap_size: u64,
    /// The unit the server leases heap space in; the largest value fits in
    /// one chunk.
    pub chunk_size: u64,
    /// Changes of the geometry (resizes, growth) since the region was made.
    pub epoch: u64,
}

impl Geometry {
    /// Lays out a region of `memory` bytes: an index of `buckets` buckets
    /// (by default [`DEFAULT_BUCKETS`]) at the start of the heap; chunks are
    /// 1/16 of the heap, between 64 KiB and 4 MiB.
    pub fn for_memory(memory: u64, buckets: Option<u64>) -> Result<Self, LayoutError> {
        let region_len = memory / 4096 * 4096;
        if region_len < 1 << 20 {
            return Err(LayoutError::BadGeometry(format!(
                "{memory} bytes is too small; a region needs at least 1 MiB"
            )));
        }
        if region_len > Slot::OFFSET_MASK {
            return Err(LayoutError::BadGeometry(format!(
                "{memory} bytes is more than a slot can address ({} bytes)",
                Slot::OFFSET_MASK
            )));
        }
        let bucket_count = match buckets {
            Some(b) if (MIN_BUCKETS..=MAX_BUCKETS).contains(&b) && b.is_power_of_two() => b,
            Some(b) => {
                return Err(LayoutError::BadGeometry(format!(
                    "bucket count {b} must be a power of two from {MIN_BUCKETS} to {MAX_BUCKETS}"
                )))
            }
            // Small: the index doubles online as keys arrive.
            None => DEFAULT_BUCKETS,
        };
        let heap_offset = HEAP_OFFSET;
        // bucket_count ≤ 2^40, so neither product nor sum can overflow.
        let index_end = heap_offset + index_bytes(bucket_count);
        if index_end.saturating_add(256 << 10) > region_len {
            return Err(LayoutError::BadGeometry(format!(
                "{bucket_count} buckets leave less than 256 KiB of heap in {region_len} bytes"
            )));
        }
        let heap_size = region_len - heap_offset;
        let chunk_size = (heap_size / 16).clamp(64 << 10, 4 << 20) / 4096 * 4096;
        let g = Geometry {
            region_len,
            index_offset: heap_offset,
            bucket_count,
            heap_offset,
            heap_size,
            chunk_size,
            epoch: 1,
        };
        g.validate()?;
        Ok(g)
    }

    /// Checks a geometry that came from a file or a message; no arithmetic
    /// on its numbers can overflow once this passed.
    pub fn validate(&self) -> Result<(), LayoutError> {
        let bad = |m: &str| Err(LayoutError::BadGeometry(m.to_string()));
        if !self.bucket_count.is_power_of_two()
            || !(MIN_BUCKETS..=MAX_BUCKETS).contains(&self.bucket_count)
        {
            return bad("bucket count is not a power of two from 8 to 2^40");
        }
        if self.region_len > Slot::OFFSET_MASK {
            return bad("region larger than a slot can address");
        }
        if self.heap_offset != HEAP_OFFSET
            || self.heap_offset.checked_add(self.heap_size) != Some(self.region_len)
        {
            return bad("heap does not run from the key table to the region end");
        }
        let index_end = self.index_offset.checked_add(self.index_bytes());
        if self.index_offset < self.heap_offset
            || !self.index_offset.is_multiple_of(BUCKET_BYTES)
            || index_end.is_none_or(|e| e > self.region_len)
        {
            return bad("index does not lie inside the heap");
        }
        if self.chunk_size < 4096
            || self.chunk_size > self.heap_size
            || !self.chunk_size.is_multiple_of(4096)
        {
            return bad("chunk size out of range or not a multiple of 4096");
        }
        Ok(())
    }

    /// Where the block a slot points at lies, if that is a whole block inside
    /// the heap: a slot read from the region is untrusted (torn, recycled or
    /// damaged), and its class and offset are checked before any use.
    pub fn block_span(&self, slot: Slot) -> Option<(u64, usize)> {
        let len = slot.block_len()?;
        let end = slot.offset().checked_add(len)?;
        (slot.offset() >= self.heap_offset
            && end <= self.region_len
            && slot.offset().is_multiple_of(8))
        .then_some((slot.offset(), len as usize))
    }

    /// Largest block the allocator hands out: the biggest size class that
    /// fits in one chunk.
    pub fn max_block(&self) -> u64 {
        let mut best = 0;
        for c in 0..=MAX_CLASS {
            let s = class_size(c);
            if s <= self.chunk_size {
                best = s;
            }
        }
        best
    }

    /// Largest value a client may store (keys up to MAX_KEY always fit).
    pub fn max_value(&self) -> usize {
        let room = self.max_block() as usize - BLOCK_HEADER - MAX_KEY;
        room.min(MAX_VALUE)
    }

    /// Bytes of the index: `bucket_count` buckets, and the few more that
    /// only the windows of the last buckets reach.
    pub fn index_bytes(&self) -> u64 {
        index_bytes(self.bucket_count)
    }

    /// Buckets in the index, the extra ones included.
    pub fn index_buckets(&self) -> u64 {
        self.bucket_count + WINDOW_BUCKETS as u64 - 1
    }

    pub fn bucket_offset(&self, bucket: u64) -> u64 {
        self.index_offset + bucket * BUCKET_BYTES
    }

    pub fn slot_offset(&self, pos: SlotPos) -> u64 {
        self.bucket_offset(pos.bucket) + pos.index as u64 * 8
    }

    /// This geometry as a header record; the checksum covers words 0..9.
    pub fn encode_header(&self) -> [u64; HEADER_WORDS + 1] {
        let mut w = [
            MAGIC,
            FORMAT_VERSION,
            self.region_len,
            self.index_offset,
            self.bucket_count,
            self.heap_offset,
            self.heap_size,
            self.chunk_size,
            self.epoch,
            0,
        ];
        w[HEADER_WORDS] = words_checksum(&w[..HEADER_WORDS]);
        w
    }

    /// Byte offset of the header record that holds this geometry: the two
    /// records alternate, so writing a new epoch never touches the current
    /// one (epoch 1 is in the first).
    pub fn record_offset(&self) -> u64 {
        RECORD_OFFSETS[((self.epoch + 1) % 2) as usize]
    }

    /// Byte offset of the other record, which gets the same geometry once
    /// the epoch word names it.
    pub fn twin_record_offset(&self) -> u64 {
        RECORD_OFFSETS[(self.epoch % 2) as usize]
    }

    /// Each header record decoded on its own (the first `HEADER_READ_WORDS`
    /// words of the region).
    pub fn decode_records(w: &[u64]) -> [Result<Self, LayoutError>; 2] {
        RECORD_OFFSETS.map(|at| {
            let at = at as usize / 8;
            w.get(at..at + HEADER_WORDS + 1)
                .map_or(Err(LayoutError::BadMagic), Self::decode_record)
        })
    }

    /// The geometry in force, from the header's records and the epoch word
    /// (`published`): the valid record of the higher epoch, unless that is
    /// older than `published`. The word is written after the record it
    /// names, so a valid record of the published epoch or newer is the one
    /// a switch completed (one newer by a step: a crash came between record
    /// and word). An older one is the record the switch replaced, whose
    /// index may be heap by now: refused. Two valid records that agree
    /// outrank the word, which no checksum covers (a complete switch leaves
    /// them alike, and an incomplete one cannot have moved the word past
    /// both). With no record valid, the error of the one that looks most
    /// like a region's.
    pub fn decode_header(w: &[u64], published: u64) -> Result<Self, LayoutError> {
        let newest = match Self::decode_records(w) {
            [Ok(a), Ok(b)] if a == b => return Ok(a),
            [Ok(a), Ok(b)] => {
                if b.epoch > a.epoch {
                    b
                } else {
                    a
                }
            }
            [Ok(g), Err(_)] | [Err(_), Ok(g)] => g,
            [Err(LayoutError::BadMagic), Err(e)] | [Err(e), Err(_)] => return Err(e),
        };
        if newest.epoch < published {
            return Err(LayoutError::RecordInForceDamaged {
                valid: newest.epoch,
                published,
            });
        }
        Ok(newest)
    }

    fn decode_record(w: &[u64]) -> Result<Self, LayoutError> {
        if w[0] != MAGIC {
            return Err(LayoutError::BadMagic);
        }
        if w[1] != FORMAT_VERSION {
            return Err(LayoutError::UnsupportedVersion {
                found: w[1],
                expected: FORMAT_VERSION,
            });
        }
        if words_checksum(&w[..HEADER_WORDS]) != w[HEADER_WORDS] {
            return Err(LayoutError::BadHeaderChecksum);
        }
        let g = Geometry {
            region_len: w[2],
            index_offset: w[3],
            bucket_count: w[4],
            heap_offset: w[5],
            heap_size: w[6],
            chunk_size: w[7],
            epoch: w[8],
        };
        g.validate()?;
        Ok(g)
    }
}

/// Buckets of a new region's index unless told otherwise: 1 024 slots, as
/// small as a hash table starts (it doubles when it fills).
pub const DEFAULT_BUCKETS: u64 = 128;

/// Fewest buckets an index has: a key's two windows must not overlap.
pub const MIN_BUCKETS: u64 = 8;

/// Bytes of an index of `bucket_count` buckets (see [`Geometry::index_bytes`]).
pub fn index_bytes(bucket_count: u64) -> u64 {
    (bucket_count + WINDOW_BUCKETS as u64 - 1) * BUCKET_BYTES
}

fn words_checksum(words: &[u64]) -> u64 {
    let mut bytes = Vec::with_capacity(words.len() * 8);
    for w in words {
        bytes.extend_from_slice(&w.to_le_bytes());
    }
    xxh3_64(&bytes)
}

/// Size classes: four steps per power of two (≤ 25% waste), 64 B upwards.
/// The class fits in a slot, so a reader fetches a whole block in one READ.
pub const MAX_CLASS: u8 = 120;

/// Bytes of a block of `class`; a class above MAX_CLASS (only a damaged slot
/// has one) has no size: u64::MAX, which fits nowhere.
pub fn class_size(class: u8) -> u64 {
    if class > MAX_CLASS {
        return u64::MAX;
    }
    let group = (class >> 2) as u32;
    let step = (class & 3) as u64;
    (4 + step) << (group + 4)
}

/// Smallest class whose blocks hold `len` bytes.
pub fn class_for(len: u64) -> Option<u8> {
    if len <= 64 {
        return Some(0);
    }
    // Start from the power of two below len and walk at most five classes.
    let group = (63 - (len - 1).leading_zeros()).saturating_sub(6);
    let first = (group as u8).saturating_mul(4);
    (first..=MAX_CLASS).find(|&c| class_size(c) >= len)
}

/// Position of a slot: bucket number and index inside the bucket. Ordered,
/// because duplicate inserts of one key are resolved to the lowest position.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SlotPos {
    pub bucket: u64,
    pub index: usize,
}

/// An index slot, the unit of CAS: `fingerprint:8 | class:8 | frozen:1 | offset:47`.
/// Zero means empty (no block lives at offset 0, the header does).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub struct Slot(pub u64);

impl Slot {
    pub const EMPTY: Slot = Slot(0);
    pub const OFFSET_MASK: u64 = (1 << 47) - 1;
    pub const FROZEN: u64 = 1 << 47;
    /// An empty slot a resize has frozen: nothing may be inserted into it.
    pub const FROZEN_EMPTY: Slot = Slot(Self::FROZEN);

    pub fn new(fingerprint: u8, class: u8, offset: u64) -> Slot {
        debug_assert!(offset > 0 && offset <= Self::OFFSET_MASK);
        Slot((fingerprint as u64) << 56 | (class as u64) << 48 | offset)
    }
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }
    pub fn fingerprint(self) -> u8 {
        (self.0 >> 56) as u8
    }
    pub fn class(self) -> u8 {
        (self.0 >> 48) as u8
    }
    /// Set by a resize that is migrating this slot: writers must not CAS it
    /// (readers still follow it: its block is the key's value until the new
    /// index is published).
    pub fn is_frozen(self) -> bool {
        self.0 & Self::FROZEN != 0
    }
    pub fn frozen(self) -> Slot {
        Slot(self.0 | Self::FROZEN)
    }
    /// The slot as it was before a resize froze it.
    pub fn thawed(self) -> Slot {
        Slot(self.0 & !Self::FROZEN)
    }
    pub fn offset(self) -> u64 {
        self.0 & Self::OFFSET_MASK
    }
    /// Bytes of the block, or None for a class no block has (a damaged slot).
    pub fn block_len(self) -> Option<u64> {
        (self.class() <= MAX_CLASS).then(|| class_size(self.class()))
    }
}

/// Where a key may live: two windows of three adjacent buckets (each window
/// one 192-byte READ) and an 8-bit fingerprint. An insert takes the least
/// loaded of the six buckets, which fills the index to ~88% before a key
/// finds them all full (windows of two: ~85% and less as the index grows;
/// two single buckets: ~75%; the first free slot of the first bucket: ~30%).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyHash {
    /// First buckets of the two windows, ascending and not overlapping.
    pub windows: [u64; 2],
    pub fingerprint: u8,
}

const SECOND_BUCKET_SEED: u64 = 0x6f6e_656b_765f_6232;

/// Most shards a cluster may have (see [`shard_of`]).
pub const MAX_SHARDS: u32 = 1 << 16;

/// Where a replicated shard's primary keeps its insert locks (kv-client's
/// `insert_lock`): words of the header page past the epoch word, outside
/// both records' checksums, zero in a new region (free). Clients CAS them;
/// the server never touches them.
pub const INSERT_LOCKS_OFFSET: u64 = 2048;
/// Insert lock words: keys whose hash picks one word wait for each other,
/// which only a writer inserting (or incrementing) keys that meet on one
/// notices.
pub const INSERT_LOCKS: u64 = 256;

/// Which insert lock word is `key`'s: from a seeded hash, so that it shares
/// no bits with the key's buckets or shard.
pub fn insert_lock_index(key: &[u8]) -> u64 {
    xxh3_64_with_seed(key, KEY_LOCK_SEED) % INSERT_LOCKS
}

/// The offset of `key`'s insert lock word.
pub fn insert_lock_offset(key: &[u8]) -> u64 {
    insert_lock_word_offset(insert_lock_index(key))
}

/// The offset of insert lock word `index` (below [`INSERT_LOCKS`]).
pub fn insert_lock_word_offset(index: u64) -> u64 {
    INSERT_LOCKS_OFFSET + index % INSERT_LOCKS * 8
}

// The lock words lie between the epoch word and the key table.
const _: () = assert!(
    INSERT_LOCKS_OFFSET >= EPOCH_OFFSET + 8
        && INSERT_LOCKS_OFFSET + INSERT_LOCKS * 8 <= HEADER_SIZE
);

/// Seeds [`insert_lock_index`].
const KEY_LOCK_SEED: u64 = 0x6b65_792d_6c6f_636b;

/// Which of a cluster's `shards` holds `key`. It is read from bits 40..56
/// of the key's first hash: the buckets use at most the low 40
/// (`MAX_BUCKETS`) and the fingerprint the top 8, so the keys of one shard
/// still spread over all of its buckets, and their fingerprints over all
/// values.
#[inline]
pub fn shard_of(key: &[u8], shards: u32) -> u32 {
    debug_assert!(shards > 0 && shards <= MAX_SHARDS);
    let bits = (xxh3_64(key) >> 40) & 0xffff;
    // Scaling rather than a remainder keeps every shard within one key in
    // 2^16 of its share for any count.
    ((bits * u64::from(shards)) >> 16) as u32
}

/// Buckets one window covers.
pub const WINDOW_BUCKETS: usize = 3;
/// Slots a key may occupy: two windows.
pub const CANDIDATE_SLOTS: usize = 2 * WINDOW_BUCKETS * SLOTS_PER_BUCKET;

impl KeyHash {
    /// Where `key` lives in an index of `bucket_count` (≥ MIN_BUCKETS, a
    /// power of two) buckets. The fingerprint does not depend on it.
    pub fn new(key: &[u8], bucket_count: u64) -> KeyHash {
        Self::from_hashes(Self::hashes(key), bucket_count)
    }

    /// The two hashes of `key` that every index size's [`KeyHash`] derives
    /// from (for placing one key in many sizes of index).
    #[inline]
    pub fn hashes(key: &[u8]) -> [u64; 2] {
        [xxh3_64(key), xxh3_64_with_seed(key, SECOND_BUCKET_SEED)]
    }

    /// [`KeyHash::new`] from the key's [`KeyHash::hashes`].
    #[inline]
    pub fn from_hashes([h, h2]: [u64; 2], bucket_count: u64) -> KeyHash {
        let mask = bucket_count - 1;
        let a = h & mask;
        let mut b = h2 & mask;
        if a.abs_diff(b) < WINDOW_BUCKETS as u64 {
            b = (a + bucket_count / 2) & mask;
        }
        KeyHash {
            windows: [a.min(b), a.max(b)],
            fingerprint: (h >> 56) as u8,
        }
    }

    /// The candidate buckets in ascending order, so slot positions compare
    /// the same way for every client.
    pub fn buckets(&self) -> [u64; 2 * WINDOW_BUCKETS] {
        std::array::from_fn(|i| self.windows[i / WINDOW_BUCKETS] + (i % WINDOW_BUCKETS) as u64)
    }

    /// Position of candidate slot `i` (0..CANDIDATE_SLOTS), in bucket order.
    pub fn slot_pos(&self, i: usize) -> SlotPos {
        SlotPos {
            bucket: self.buckets()[i / SLOTS_PER_BUCKET],
            index: i % SLOTS_PER_BUCKET,
        }
    }

    /// Which candidate slot `pos` is, if it is one of this key's.
    pub fn slot_index(&self, pos: SlotPos) -> Option<usize> {
        let b = self.buckets().iter().position(|&b| b == pos.bucket)?;
        (pos.index < SLOTS_PER_BUCKET).then_some(b * SLOTS_PER_BUCKET + pos.index)
    }

    /// Which candidate slots (in `slot_pos` order) may hold this key: bit
    /// `i` is set when slot `i`, frozen or not, is in use and has the key's
    /// fingerprint. Every lookup runs it over all 48 slots, so on x86-64
    /// it compares 16 fingerprint bytes per instruction.
    pub fn matches(&self, slots: &[Slot; CANDIDATE_SLOTS]) -> u64 {
        // A zero fingerprint must also tell empty slots apart.
        #[cfg(target_arch = "x86_64")]
        if self.fingerprint != 0 {
            return matches_sse2(slots, self.fingerprint);
        }
        matches_scalar(slots, self.fingerprint)
    }

    /// Where an insert goes among the candidate slots `slots` (in
    /// `slot_pos` order): the first empty slot of the least loaded bucket,
    /// the lower bucket on a tie; None if all are full.
    pub fn insert_choice(slots: &[Slot; CANDIDATE_SLOTS]) -> Option<usize> {
        slots
            .chunks(SLOTS_PER_BUCKET)
            .enumerate()
            .map(|(b, bucket)| (bucket.iter().filter(|s| !s.is_empty()).count(), b))
            .filter(|&(used, _)| used < SLOTS_PER_BUCKET)
            .min()
            .and_then(|(_, b)| {
                let first = b * SLOTS_PER_BUCKET;
                (first..first + SLOTS_PER_BUCKET).find(|&i| slots[i].is_empty())
            })
    }
}

fn matches_scalar(slots: &[Slot; CANDIDATE_SLOTS], fingerprint: u8) -> u64 {
    let mut mask = 0u64;
    for (i, s) in slots.iter().enumerate() {
        let live = s.thawed();
        let hit = !live.is_empty() && live.fingerprint() == fingerprint;
        mask |= u64::from(hit) << i;
    }
    mask
}

/// `matches_scalar` for a fingerprint other than zero, which only a slot in
/// use can have: compares every byte of eight slots with the fingerprint,
/// and keeps the comparisons of their top bytes (byte 7 of each
/// little-endian word).
#[cfg(target_arch = "x86_64")]
fn matches_sse2(slots: &[Slot; CANDIDATE_SLOTS], fingerprint: u8) -> u64 {
    use std::arch::x86_64::{
        __m128i, _mm_cmpeq_epi8, _mm_loadu_si128, _mm_movemask_epi8, _mm_set1_epi8,
    };
    const TOP_BYTES: u64 = 0x0101_0101_0101_0101;
    // Gathers bit 8j of a word into bit 56 + j (no two products overlap).
    const GATHER: u64 = 0x0102_0408_1020_4080;
    let mut mask = 0u64;
    for (group, eight) in slots.chunks_exact(8).enumerate() {
        let mut equal = 0u64;
        for quarter in 0..4 {
            // SAFETY: SSE2 is part of x86-64; `Slot` is a transparent u64,
            // so slots 2q and 2q+1 of this group are 16 readable bytes.
            let bits = unsafe {
                let v = _mm_loadu_si128(eight.as_ptr().add(quarter * 2) as *const __m128i);
                _mm_movemask_epi8(_mm_cmpeq_epi8(v, _mm_set1_epi8(fingerprint as i8)))
            };
            equal |= u64::from(bits as u16) << (quarter * 16);
        }
        let tops = (equal >> 7) & TOP_BYTES;
        mask |= (tops.wrapping_mul(GATHER) >> 56) << (group * 8);
    }
    mask
}

/// The positions of the bits set in `mask` (a [`KeyHash::matches`]),
/// lowest first.
pub fn set_bits(mut mask: u64) -> impl Iterator<Item = usize> {
    std::iter::from_fn(move || {
        let i = mask.trailing_zeros() as usize;
        mask &= mask.wrapping_sub(1);
        (i < 64).then_some(i)
    })
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BlockError {
    #[error("block lengths run past the block")]
    BadLength,
    #[error("block checksum mismatch")]
    BadChecksum,
}

/// Bytes a block of this key and value occupies before class rounding.
pub fn block_len(key_len: usize, value_len: usize) -> u64 {
    (BLOCK_HEADER + key_len + value_len) as u64
}

/// Writes a block (checksum, lengths, key, value) into `out`, which must be
/// at least `block_len` long. Returns the bytes used.
pub fn encode_block(key: &[u8], value: &[u8], out: &mut [u8]) -> usize {
    let used = BLOCK_HEADER + key.len() + value.len();
    let lengths = (key.len() as u64) | (value.len() as u64) << 32;
    out[8..16].copy_from_slice(&lengths.to_le_bytes());
    out[16..16 + key.len()].copy_from_slice(key);
    out[16 + key.len()..used].copy_from_slice(value);
    let sum = xxh3_64(&out[8..used]);
    out[0..8].copy_from_slice(&sum.to_le_bytes());
    used
}

/// Marks a counter block in the lengths word (no value is 2^31 bytes long).
const COUNTER_FLAG: u64 = 1 << 63;

/// A counter's state word while its insert may still lose to another copy
/// of the key: readers do not see it, and nothing adds to it.
pub const COUNTER_PENDING: u64 = u64::from_le_bytes(*b"pending\0");
/// A counter's state word once no other copy of its key can appear (only
/// its creator stores it, by CAS from pending). A settled state word keeps
/// this low byte; above it, `COUNTER_LOCKED` and a generation.
pub const COUNTER_SETTLED: u64 = 1;
/// Set in a settled counter's state word by the one writer that may seal
/// and unlink it (a PUT over it, a DELETE), by CAS; cleared (with the
/// generation stepped on) only once the value word is open again.
pub const COUNTER_LOCKED: u64 = 1 << 8;
/// One step of a settled counter's lock generation: every unlock and every
/// takeover of a dead writer's lock steps it, so a state word seen twice
/// is the same lock, held all along.
pub const COUNTER_GENERATION: u64 = 1 << 16;

/// Whether a state word is a settled counter's (locked or not).
pub fn counter_settled(state: u64) -> bool {
    state & (COUNTER_GENERATION - 1) & !COUNTER_LOCKED == COUNTER_SETTLED
}
/// A pending counter given up for dead by another client (by CAS from
/// pending): it never settles, and its slot may be emptied.
pub const COUNTER_ABANDONED: u64 = u64::from_le_bytes(*b"deadctr\0");

/// A counter's value word is *open* while its two top bits agree: it holds
/// the value, and FETCH-AND-ADD and CAS change it. A writer about to unlink
/// a settled counter (a PUT over it, a DELETE) first locks it
/// (`COUNTER_LOCKED`), then *seals* it by a FETCH-AND-ADD of this bit,
/// which flips the top bit, and the word stays sealed after the unlink.
/// The word an atomic returns thus tells whether it landed on a live
/// counter: no atomic changes a sealed word's value as readers see it (a
/// FETCH-AND-ADD that finds it sealed is undone by its client, and no CAS
/// expecting an open value matches it). Clients keep values within
/// `±COUNTER_MAX` (see `kv-client`'s counter module), far from where the
/// bits would disagree by themselves.
pub const COUNTER_SEAL: u64 = 1 << 63;

/// The largest magnitude an increment or a compare-and-set may store.
pub const COUNTER_MAX: i64 = 1 << 61;

/// Whether a counter's value word is sealed (see `COUNTER_SEAL`).
pub fn counter_sealed(word: u64) -> bool {
    ((word >> 63) ^ (word >> 62)) & 1 == 1
}

/// Where a counter is in its life (see the state words).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CounterState {
    Pending,
    Settled,
    Abandoned,
}

/// Where a counter block keeps its two words, from the block's start: the
/// state (pending or settled) and the value, both 8-byte aligned (blocks
/// are) so that the NIC's CAS and FETCH-AND-ADD can reach them.
pub fn counter_words(key_len: usize) -> (usize, usize) {
    let state = (BLOCK_HEADER + key_len).next_multiple_of(8);
    (state, state + 8)
}

/// Bytes a counter block of this key occupies before class rounding.
pub fn counter_block_len(key_len: usize) -> u64 {
    counter_words(key_len).1 as u64 + 8
}

/// Writes a pending counter block holding `value` into `out`. The checksum
/// covers the lengths and the key only: the two words change in place.
/// Returns the bytes used.
pub fn encode_counter_block(key: &[u8], value: i64, out: &mut [u8]) -> usize {
    let (state, word) = counter_words(key.len());
    let lengths = key.len() as u64 | COUNTER_FLAG;
    out[8..16].copy_from_slice(&lengths.to_le_bytes());
    out[16..16 + key.len()].copy_from_slice(key);
    out[16 + key.len()..state].fill(0);
    out[state..word].copy_from_slice(&COUNTER_PENDING.to_le_bytes());
    out[word..word + 8].copy_from_slice(&value.to_le_bytes());
    let sum = xxh3_64(&out[8..16 + key.len()]);
    out[0..8].copy_from_slice(&sum.to_le_bytes());
    word + 8
}

/// What a block holds besides its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Payload<'a> {
    Bytes(&'a [u8]),
    /// A counter: its value word and state as read (`state_word` raw). A
    /// sealed word's value is not the counter's (see `COUNTER_SEAL`).
    Counter {
        value: i64,
        state: CounterState,
        state_word: u64,
        sealed: bool,
    },
}

/// A block read as far as its head (`decode_block_head`): its key, and a
/// counter's payload (None for a byte block, whose value was not read).
#[derive(Debug, PartialEq, Eq)]
pub struct BlockHead<'a> {
    pub key: &'a [u8],
    pub payload: Option<Payload<'a>>,
}

/// A block that passed its checksum.
#[derive(Debug, PartialEq, Eq)]
pub struct BlockView<'a> {
    pub key: &'a [u8],
    pub payload: Payload<'a>,
}

/// Whether a block's lengths word (its second word) is a counter's.
pub fn is_counter(lengths: u64) -> bool {
    lengths & COUNTER_FLAG != 0
}

/// The key length a block's lengths word (its second word) gives, and the
/// bytes the block occupies before class rounding: what a reader of only
/// the header needs to find the key.
pub fn lengths_of(lengths: u64) -> (usize, u64) {
    let key_len = (lengths & 0xffff_ffff) as usize;
    if is_counter(lengths) {
        (key_len, counter_block_len(key_len))
    } else {
        (key_len, block_len(key_len, (lengths >> 32) as usize))
    }
}

/// The bytes of a block that tell a writer whether it is a copy of a key of
/// `key_len` bytes: the header and the key, and a counter's two words (a
/// counter block of that key is this long).
pub fn block_head_len(key_len: usize) -> usize {
    counter_block_len(key_len) as usize
}

/// A block read only as far as its head (`block_head_len(key_len)`, or the
/// whole block if shorter) by a writer looking for a key of `key_len`
/// bytes: None if the block's key has another length (so it is another
/// key's block, or one whose lengths are damaged: either way not a copy
/// of this key); else its key, and a counter's payload, its block being
/// whole there (None for a byte block, whose value was not read). A
/// counter is checked as `decode_block` checks it; a byte block's checksum
/// covers its value, so only its key length is, and that the key fits in
/// what was read: a writer that replaces the
/// value (a PUT, a DELETE) needs no more than the key, as the slot named
/// the block within the read's deadline (the grace period, not the
/// checksum, is what keeps a linked block from being rewritten under a
/// read in time).
pub fn decode_block_head(
    bytes: &[u8],
    key_len: usize,
) -> Result<Option<BlockHead<'_>>, BlockError> {
    if bytes.len() < BLOCK_HEADER {
        return Err(BlockError::BadLength);
    }
    let lengths = u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes"));
    if (lengths & 0xffff_ffff) as usize != key_len {
        return Ok(None);
    }
    if is_counter(lengths) {
        return decode_block(bytes).map(|v| {
            Some(BlockHead {
                key: v.key,
                payload: Some(v.payload),
            })
        });
    }
    if BLOCK_HEADER + key_len > bytes.len() {
        return Err(BlockError::BadLength);
    }
    Ok(Some(BlockHead {
        key: &bytes[BLOCK_HEADER..BLOCK_HEADER + key_len],
        payload: None,
    }))
}

pub fn decode_block(bytes: &[u8]) -> Result<BlockView<'_>, BlockError> {
    if bytes.len() < BLOCK_HEADER {
        return Err(BlockError::BadLength);
    }
    let word = |i: usize| u64::from_le_bytes(bytes[i..i + 8].try_into().expect("8 bytes"));
    let lengths = word(8);
    let key_len = (lengths & 0xffff_ffff) as usize;
    if lengths & COUNTER_FLAG != 0 {
        let (state, value) = counter_words(key_len);
        if key_len > MAX_KEY || lengths != key_len as u64 | COUNTER_FLAG || value + 8 > bytes.len()
        {
            return Err(BlockError::BadLength);
        }
        if xxh3_64(&bytes[8..16 + key_len]) != word(0) {
            return Err(BlockError::BadChecksum);
        }
        let state_word = word(state);
        let state = match state_word {
            COUNTER_PENDING => CounterState::Pending,
            COUNTER_ABANDONED => CounterState::Abandoned,
            w if counter_settled(w) => CounterState::Settled,
            _ => return Err(BlockError::BadChecksum),
        };
        return Ok(BlockView {
            key: &bytes[16..16 + key_len],
            payload: Payload::Counter {
                value: word(value) as i64,
                state,
                state_word,
                sealed: counter_sealed(word(value)),
            },
        });
    }
    let value_len = (lengths >> 32) as usize;
    let used = BLOCK_HEADER
        .checked_add(key_len)
        .and_then(|n| n.checked_add(value_len))
        .ok_or(BlockError::BadLength)?;
    if key_len > MAX_KEY || used > bytes.len() {
        return Err(BlockError::BadLength);
    }
    if xxh3_64(&bytes[8..used]) != word(0) {
        return Err(BlockError::BadChecksum);
    }
    Ok(BlockView {
        key: &bytes[16..16 + key_len],
        payload: Payload::Bytes(&bytes[16 + key_len..used]),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_spread_keys_and_do_not_steer_buckets_or_fingerprints() {
        let shards = 7;
        let mut per_shard = [0u32; 7];
        let mut buckets_of_shard0 = std::collections::HashSet::new();
        let mut fingerprints_of_shard0 = std::collections::HashSet::new();
        for i in 0..70_000u32 {
            let key = format!("user{i}");
            let shard = shard_of(key.as_bytes(), shards);
            per_shard[shard as usize] += 1;
            if shard == 0 {
                let hash = KeyHash::new(key.as_bytes(), 1024);
                buckets_of_shard0.extend(hash.windows);
                fingerprints_of_shard0.insert(hash.fingerprint);
            }
        }
        for count in per_shard {
            assert!((9_000..11_000).contains(&count), "{per_shard:?}");
        }
        // One shard's keys still reach (nearly) every bucket and fingerprint.
        assert!(
            buckets_of_shard0.len() > 1000,
            "{}",
            buckets_of_shard0.len()
        );
        assert_eq!(fingerprints_of_shard0.len(), 256);
        assert_eq!(shard_of(b"any", 1), 0);
    }

    #[test]
    fn fingerprint_matches_are_the_slots_in_use_with_the_fingerprint() {
        // Slots drawn from few fingerprints, empty, frozen and frozen-empty
        // ones, against the definition, slot by slot.
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for round in 0..2000 {
            let slots: [Slot; CANDIDATE_SLOTS] = std::array::from_fn(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let fp = [0u8, 1, 0x80, 0xff][(x % 4) as usize];
                match (x >> 8) % 5 {
                    0 => Slot::EMPTY,
                    1 => Slot::FROZEN_EMPTY,
                    2 => Slot::new(fp, 3, 64 + (x >> 20) % 4096 * 8).frozen(),
                    _ => Slot::new(fp, (x >> 12) as u8, 64 + (x >> 20) % 4096 * 8),
                }
            });
            let fingerprint = [0u8, 1, 0x80, 0xff][round % 4];
            let kh = KeyHash {
                windows: [0, 8],
                fingerprint,
            };
            let mask = kh.matches(&slots);
            for (i, s) in slots.iter().enumerate() {
                let live = s.thawed();
                let expected = !live.is_empty() && live.fingerprint() == fingerprint;
                assert_eq!(
                    mask >> i & 1 == 1,
                    expected,
                    "slot {i} {s:?} fp {fingerprint}"
                );
            }
            assert_eq!(set_bits(mask).count(), mask.count_ones() as usize);
            assert!(set_bits(mask).all(|i| mask >> i & 1 == 1));
        }
    }

    #[test]
    fn header_round_trips_and_rejects_damage() {
        let g = Geometry::for_memory(64 << 20, None).unwrap();
        let w = g.encode_header();
        assert_eq!(Geometry::decode_header(&w, 1), Ok(g));
        assert_eq!(g.record_offset(), 0);

        let mut bad = w;
        bad[4] ^= 1;
        assert_eq!(
            Geometry::decode_header(&bad, 1),
            Err(LayoutError::BadHeaderChecksum)
        );
        let mut other = w;
        other[1] = 7;
        assert_eq!(
            Geometry::decode_header(&other, 1),
            Err(LayoutError::UnsupportedVersion {
                found: 7,
                expected: FORMAT_VERSION
            })
        );
        assert_eq!(
            Geometry::decode_header(&[0; 10], 0),
            Err(LayoutError::BadMagic)
        );
    }

    #[test]
    fn geometry_fits_region() {
        for mem in [1u64 << 20, 16 << 20, 1 << 30, 3 << 30] {
            let g = Geometry::for_memory(mem, None).unwrap();
            assert!(g.heap_offset + g.heap_size == g.region_len);
            assert!(g.max_value() >= 16 << 10, "{g:?}");
        }
        assert!(Geometry::for_memory(1000, None).is_err());
        assert!(Geometry::for_memory(1 << 20, Some(3)).is_err());
        assert!(Geometry::for_memory(1 << 20, Some(4)).is_err());
        assert!(Geometry::for_memory(1 << 20, Some(1 << 20)).is_err());
        assert!(Geometry::for_memory(1 << 30, Some(1 << 63)).is_err());
        assert!(Geometry::for_memory(u64::MAX, None).is_err());
        assert_eq!(
            Geometry::for_memory(1 << 30, None).unwrap().max_value(),
            MAX_VALUE
        );
    }

    #[test]
    fn untrusted_geometry_and_slots_never_overflow() {
        let g = Geometry::for_memory(16 << 20, None).unwrap();
        // A header claiming 2^58 buckets (its index would wrap) is refused.
        for buckets in [1u64 << 58, 1 << 41, 3, 4, 0] {
            let forged = Geometry {
                bucket_count: buckets,
                ..g
            };
            assert!(forged.validate().is_err(), "{buckets} buckets accepted");
        }
        let wrapping = Geometry {
            heap_size: u64::MAX - g.heap_offset + 1,
            ..g
        };
        assert!(wrapping.validate().is_err());
        // Size classes a block never has: no shift overflow, no length.
        for class in [MAX_CLASS + 1, 240, 255] {
            assert_eq!(class_size(class), u64::MAX);
            let slot = Slot(((class as u64) << 48) | g.heap_offset);
            assert_eq!(slot.block_len(), None);
            assert_eq!(g.block_span(slot), None);
        }
        let inside = Slot::new(1, 0, g.heap_offset);
        assert_eq!(g.block_span(inside), Some((g.heap_offset, 64)));
        let past_end = Slot::new(1, 0, g.region_len - 32);
        assert_eq!(g.block_span(past_end), None);
        let in_key_table = Slot::new(1, 0, KEY_TABLE_OFFSET);
        assert_eq!(g.block_span(in_key_table), None);
    }

    #[test]
    fn slot_fields_round_trip() {
        let s = Slot::new(0xab, 17, 0x0012_3456_789a);
        assert_eq!(
            (s.fingerprint(), s.class(), s.offset()),
            (0xab, 17, 0x0012_3456_789a)
        );
        assert!(!s.is_empty() && !s.is_frozen());
        assert!(s.frozen().is_frozen());
        assert_eq!(s.frozen().offset(), s.offset());
        assert_eq!(s.frozen().thawed(), s);
        assert!(
            Slot::EMPTY.frozen() == Slot::FROZEN_EMPTY && Slot::FROZEN_EMPTY.thawed().is_empty()
        );
    }

    #[test]
    fn size_classes_are_tight_and_aligned() {
        for len in 1..200_000u64 {
            let c = class_for(len).unwrap();
            let size = class_size(c);
            assert!(size >= len && size.is_multiple_of(BLOCK_ALIGN));
            assert!(
                c == 0 || class_size(c - 1) < len,
                "class {c} not smallest for {len}"
            );
            assert!(
                len <= 64 || size * 4 <= len * 5 + 64,
                "waste too high at {len}"
            );
        }
        assert!(class_size(MAX_CLASS) >= 1 << 36);
    }

    #[test]
    fn key_hash_picks_two_windows_that_do_not_overlap() {
        for buckets in [8u64, 16, 64, 1 << 20] {
            for i in 0..1000u32 {
                let h = KeyHash::new(&i.to_le_bytes(), buckets);
                let [a, b] = h.windows;
                assert!(a + 3 <= b && b < buckets, "{buckets}: {a} {b}");
                let all = h.buckets();
                assert!(all.windows(2).all(|w| w[0] < w[1]));
                assert!(
                    all[5]
                        < Geometry::for_memory(1 << 30, Some(buckets))
                            .unwrap()
                            .index_buckets()
                );
                for i in 0..CANDIDATE_SLOTS {
                    assert_eq!(h.slot_index(h.slot_pos(i)), Some(i));
                }
            }
        }
    }

    /// What the less-loaded choice buys: uniform keys fill ≥ 85% of an
    /// index's slots before the first of them finds all its buckets full.
    #[test]
    fn inserts_fill_the_index_past_85_percent() {
        for buckets in [1u64 << 10, 1 << 14, 1 << 16] {
            let g = Geometry::for_memory(64 << 20, Some(buckets)).unwrap();
            let mut index = vec![Slot::EMPTY; (g.index_buckets() as usize) * SLOTS_PER_BUCKET];
            let mut stored = 0u64;
            for i in 0u64.. {
                let h = KeyHash::new(format!("user{i}").as_bytes(), buckets);
                let slots: [Slot; CANDIDATE_SLOTS] = std::array::from_fn(|c| {
                    let p = h.slot_pos(c);
                    index[p.bucket as usize * SLOTS_PER_BUCKET + p.index]
                });
                let Some(c) = KeyHash::insert_choice(&slots) else {
                    break;
                };
                let p = h.slot_pos(c);
                index[p.bucket as usize * SLOTS_PER_BUCKET + p.index] = Slot::new(1, 0, 4096);
                stored += 1;
            }
            let occupancy = stored as f64 / (g.index_buckets() * SLOTS_PER_BUCKET as u64) as f64;
            assert!(occupancy >= 0.85, "{buckets} buckets: {occupancy:.3}");
        }
    }

    /// The header's words up to the epoch word, and the switches a server
    /// makes in them (record, epoch word, twin record: the order
    /// `kv-server`'s `header::write_geometry` keeps).
    struct Header([u64; EPOCH_OFFSET as usize / 8 + 1]);

    impl Header {
        fn created(g: &Geometry) -> Header {
            let mut h = Header([0; EPOCH_OFFSET as usize / 8 + 1]);
            h.switch(g, 3);
            h
        }
        /// The first `steps` of the switch to `g`.
        fn switch(&mut self, g: &Geometry, steps: usize) {
            let record = |w: &mut [u64], at: u64| {
                let at = at as usize / 8;
                w[at..at + HEADER_WORDS + 1].copy_from_slice(&g.encode_header());
            };
            record(&mut self.0, g.record_offset());
            if steps > 1 {
                self.0[EPOCH_OFFSET as usize / 8] = g.epoch;
            }
            if steps > 2 {
                record(&mut self.0, g.twin_record_offset());
            }
        }
        fn decode(&self) -> Result<Geometry, LayoutError> {
            Geometry::decode_header(
                &self.0[..HEADER_READ_WORDS],
                self.0[EPOCH_OFFSET as usize / 8],
            )
        }
    }

    /// Epoch 1, then a resize, a growth and another resize.
    fn history() -> Vec<Geometry> {
        let g1 = Geometry::for_memory(64 << 20, None).unwrap();
        let g2 = Geometry {
            epoch: 2,
            bucket_count: g1.bucket_count * 2,
            index_offset: g1.index_offset + g1.index_bytes(),
            ..g1
        };
        let g3 = Geometry {
            epoch: 3,
            region_len: g2.region_len + (64 << 20),
            heap_size: g2.heap_size + (64 << 20),
            ..g2
        };
        let g4 = Geometry {
            epoch: 4,
            bucket_count: g3.bucket_count * 2,
            index_offset: g2.index_offset + g2.index_bytes(),
            ..g3
        };
        vec![g1, g2, g3, g4]
    }

    #[test]
    fn the_newer_valid_header_record_is_current() {
        let gs = history();
        let mut h = Header::created(&gs[0]);
        assert_eq!(h.decode(), Ok(gs[0]));
        for pair in gs.windows(2) {
            let (old, new) = (pair[0], pair[1]);
            // Record written, the crash before the epoch word: either
            // holds every acknowledged write (none was acknowledged on the
            // new geometry yet), and the complete record is taken.
            h.switch(&new, 1);
            assert_eq!(h.decode(), Ok(new));
            // That record torn by the crash: the old one rules.
            let mut torn = Header(h.0);
            torn.0[new.record_offset() as usize / 8 + HEADER_WORDS] ^= 1;
            assert_eq!(torn.decode(), Ok(old));
            h.switch(&new, 3);
            assert_eq!(h.decode(), Ok(new));
        }
    }

    /// Every byte of either record flipped, at every epoch of a history and
    /// at every step of each switch: the geometry decoded is the one in
    /// force (or, before the epoch word moved, the one it replaces), or the
    /// header is refused as damaged — never a record the region had left.
    #[test]
    fn a_damaged_header_never_yields_a_record_older_than_the_published_epoch() {
        let gs = history();
        let mut base = Header::created(&gs[0]);
        let mut states = vec![(Header(base.0), vec![gs[0]])];
        for pair in gs.windows(2) {
            for steps in 1..=3 {
                let mut h = Header(base.0);
                h.switch(&pair[1], steps);
                let acceptable = if steps == 1 {
                    vec![pair[0], pair[1]]
                } else {
                    vec![pair[1]]
                };
                states.push((h, acceptable));
            }
            base.switch(&pair[1], 3);
        }
        let mut refused = 0;
        for (h, acceptable) in &states {
            for record in 0..2 {
                for byte in 0..(HEADER_WORDS + 1) * 8 {
                    for flip in [0x01u8, 0x80, 0xff] {
                        let mut damaged = Header(h.0);
                        let word = record * RECORD_STRIDE + byte / 8;
                        damaged.0[word] ^= (flip as u64) << (byte % 8 * 8);
                        match damaged.decode() {
                            Ok(g) => assert!(
                                acceptable.contains(&g),
                                "record {record} byte {byte}: decoded epoch {} of {acceptable:?}",
                                g.epoch
                            ),
                            Err(e) => {
                                assert!(
                                    e.is_header_damage()
                                        || matches!(e, LayoutError::UnsupportedVersion { .. }),
                                    "{e}"
                                );
                                refused += 1;
                            }
                        }
                    }
                }
            }
        }
        // Only the states between a switch's record and its twin refuse
        // (a damaged record whose twin is older): the rest start.
        assert!(refused > 0);
    }

    #[test]
    fn a_record_in_force_damaged_after_its_switch_is_refused_until_its_twin_is_written() {
        let gs = history();
        let mut h = Header::created(&gs[0]);
        h.switch(&gs[1], 2);
        let mut damaged = Header(h.0);
        damaged.0[gs[1].record_offset() as usize / 8 + 4] ^= 1;
        assert_eq!(
            damaged.decode(),
            Err(LayoutError::RecordInForceDamaged {
                valid: 1,
                published: 2
            })
        );
        // Once the twin holds it, the same damage leaves the twin in force.
        h.switch(&gs[1], 3);
        let mut damaged = Header(h.0);
        damaged.0[gs[1].record_offset() as usize / 8 + 4] ^= 1;
        assert_eq!(damaged.decode(), Ok(gs[1]));
        // A damaged epoch word is outranked by two records that agree.
        let mut word = Header(h.0);
        word.0[EPOCH_OFFSET as usize / 8] = 99;
        assert_eq!(word.decode(), Ok(gs[1]));
    }

    #[test]
    fn a_counter_word_is_sealed_exactly_when_its_top_bits_differ() {
        for v in [
            0,
            1,
            -1,
            COUNTER_MAX,
            -COUNTER_MAX,
            (1 << 62) - 1,
            -(1 << 62),
        ] {
            assert!(!counter_sealed(v as u64), "{v}");
            assert!(counter_sealed(v as u64 ^ COUNTER_SEAL), "{v}");
            // Increments that land on a sealed word keep it sealed.
            let late = (v as u64 ^ COUNTER_SEAL).wrapping_add((1u64 << 40).wrapping_neg());
            assert!(v.abs() > COUNTER_MAX || counter_sealed(late), "{v}");
        }
        assert!(counter_sealed(1 << 62) && counter_sealed((-(1i64 << 62) - 1) as u64));
    }

    #[test]
    fn counter_blocks_keep_aligned_words_outside_the_checksum() {
        for key in [&b"k"[..], b"counter-7", &[9u8; 16]] {
            let mut buf = vec![0u8; 128];
            let used = encode_counter_block(key, -5, &mut buf);
            assert_eq!(used as u64, counter_block_len(key.len()));
            let (state, value) = counter_words(key.len());
            assert!(state % 8 == 0 && value == state + 8 && used == value + 8);
            let v = decode_block(&buf).unwrap();
            assert_eq!(v.key, key);
            let pending = Payload::Counter {
                value: -5,
                state: CounterState::Pending,
                state_word: COUNTER_PENDING,
                sealed: false,
            };
            assert_eq!(v.payload, pending);
            // The words change in place (FETCH-AND-ADD, CAS) and stay valid.
            buf[state..value].copy_from_slice(&COUNTER_SETTLED.to_le_bytes());
            buf[value..used].copy_from_slice(&40i64.to_le_bytes());
            let settled = Payload::Counter {
                value: 40,
                state: CounterState::Settled,
                state_word: COUNTER_SETTLED,
                sealed: false,
            };
            assert_eq!(decode_block(&buf).unwrap().payload, settled);
            // Locked, and in any generation, it is still settled.
            let locked = COUNTER_SETTLED | COUNTER_LOCKED | (7 * COUNTER_GENERATION);
            buf[state..value].copy_from_slice(&locked.to_le_bytes());
            assert!(matches!(
                decode_block(&buf).unwrap().payload,
                Payload::Counter { state: CounterState::Settled, state_word, .. } if state_word == locked
            ));
            // Sealed by flipping the top bit, the word decodes as sealed.
            let sealed = (40 ^ COUNTER_SEAL).to_le_bytes();
            buf[value..used].copy_from_slice(&sealed);
            assert!(matches!(
                decode_block(&buf).unwrap().payload,
                Payload::Counter { sealed: true, .. }
            ));
            buf[value..used].copy_from_slice(&40i64.to_le_bytes());
            // The key and lengths are covered; a state word no writer
            // stores is damage; a block cut short is refused.
            for i in 8..16 + key.len() {
                let mut damaged = buf.clone();
                damaged[i] ^= 1;
                assert!(decode_block(&damaged).is_err(), "flip at byte {i}");
            }
            let mut odd = buf.clone();
            odd[state] = 7;
            assert!(decode_block(&odd).is_err());
            assert_eq!(decode_block(&buf[..used - 1]), Err(BlockError::BadLength));
            // A counter's head is its whole block: checked as a whole.
            let head = &buf[..block_head_len(key.len())];
            let whole = decode_block(&buf).unwrap().payload;
            let counter = BlockHead {
                key,
                payload: Some(whole),
            };
            assert_eq!(decode_block_head(head, key.len()), Ok(Some(counter)));
            let mut damaged = buf.clone();
            damaged[16] ^= 1;
            assert!(decode_block_head(&damaged[..head.len()], key.len()).is_err());
            // Another key's counter, cut at a shorter key's head.
            assert_eq!(decode_block_head(&buf[..block_head_len(0)], 0), Ok(None));
        }
    }

    #[test]
    fn block_round_trips_and_detects_any_flipped_byte() {
        let mut buf = vec![0u8; 128];
        let used = encode_block(b"key-1", b"some value bytes", &mut buf);
        assert_eq!(used as u64, block_len(5, 16));
        let v = decode_block(&buf).unwrap();
        assert_eq!(
            (v.key, v.payload),
            (&b"key-1"[..], Payload::Bytes(&b"some value bytes"[..]))
        );
        for i in 0..used {
            for bit in [0x01u8, 0x80] {
                let mut damaged = buf.clone();
                damaged[i] ^= bit;
                assert!(
                    decode_block(&damaged).is_err(),
                    "flip at byte {i} not caught"
                );
            }
        }
        // Its head gives the key, whatever follows it; a writer of a key
        // of another length, shorter or longer, learns only that.
        let head = &buf[..block_head_len(5)];
        let key_only = BlockHead {
            key: b"key-1",
            payload: None,
        };
        assert_eq!(decode_block_head(head, 5), Ok(Some(key_only)));
        assert_eq!(decode_block_head(&buf, 5).unwrap().unwrap().key, b"key-1");
        assert_eq!(decode_block_head(&buf[..20], 5), Err(BlockError::BadLength));
        assert_eq!(decode_block_head(&buf[..block_head_len(1)], 1), Ok(None));
        assert_eq!(decode_block_head(&buf[..block_head_len(1)], 64), Ok(None));
        // An all-zero (never written) block never validates.
        assert!(decode_block(&[0u8; 64]).is_err());
        // Lengths that run past the buffer are refused, not trusted.
        let mut huge = buf.clone();
        huge[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(decode_block(&huge), Err(BlockError::BadLength));
    }
}
