//! Reading a key's place in the index: its two windows of candidate
//! buckets (one READ each), the CAS on one of its slots, and the scan that
//! reads the blocks of the slots whose fingerprint matches.

use std::ops::Range;
use std::time::Duration;

use kv_common::layout::{
    decode_block, set_bits, CounterState, KeyHash, Payload, Slot, SlotPos, CANDIDATE_SLOTS,
    EPOCH_OFFSET,
};
use kv_common::transport::{read_u64, Verb};
use smallvec::SmallVec;

use crate::clock::OpClock;
use crate::local::WINDOW_BYTES;
use crate::{Client, Result};

pub type Slots = [Slot; CANDIDATE_SLOTS];

/// How much of a key's copies a scan must find. Readers do not see a
/// counter that is not settled (its insert may still lose to another
/// copy, see `counter`); writers do, and treat it as any copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScanMode {
    /// The lowest copy a reader sees, and its value: what a GET returns.
    Lowest,
    /// Every copy a reader sees, lowest first.
    Readable,
    /// Every copy, lowest first: what a writer must know. A slot equal to
    /// `known` is taken to hold the key without reading its block (the
    /// writer's own copy, published within the deadline).
    AllCopies { known: Option<Slot> },
}

impl ScanMode {
    fn skips_pending(self) -> bool {
        !matches!(self, ScanMode::AllCopies { .. })
    }
}

/// A key's value as a scan found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    /// Bytes at this place in the local buffer.
    Bytes(Range<usize>),
    /// A counter's value as its block was read.
    Counter(i64),
}

/// What a copy's block held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Bytes,
    Counter {
        value: i64,
        state: CounterState,
        /// The state word as read (a settled counter's lock and generation).
        state_word: u64,
    },
    /// The writer's own copy, taken as the key's without reading it (or
    /// a hinted one: hints name only copies a reader sees). Never a
    /// counter: writers read a counter's block (see `counter`).
    Known,
}

impl Kind {
    /// Whether a reader sees this copy.
    pub fn is_readable(self) -> bool {
        !matches!(self, Kind::Counter { state, .. } if state != CounterState::Settled)
    }

    /// A settled counter's value: a copy that only the writer holding its
    /// lock may unlink (see `counter`).
    pub fn settled_counter(self) -> Option<i64> {
        match self {
            Kind::Counter {
                value,
                state: CounterState::Settled,
                ..
            } => Some(value),
            _ => None,
        }
    }

    /// What a block that holds the key holds.
    pub fn of(payload: &Payload) -> Kind {
        match *payload {
            Payload::Bytes(_) => Kind::Bytes,
            Payload::Counter {
                value,
                state,
                state_word,
                ..
            } => Kind::Counter {
                value,
                state,
                state_word,
            },
        }
    }
}

/// What reading a key's candidate blocks found.
pub enum Scan {
    /// Saw something inconsistent: start again from the buckets. Names the
    /// slot whose block failed validation, if that was the reason (None: the
    /// reads took too long to be trusted).
    Retry(Option<(SlotPos, Slot)>),
    Found(Copies),
    /// The geometry changed since the buckets were read: they may be stale.
    Moved,
}

/// The copies of a key a scan found.
pub struct Copies {
    /// Slots holding the key, lowest position first.
    pub slots: SmallVec<[(SlotPos, Slot); 2]>,
    /// What each of `slots` holds.
    pub kinds: SmallVec<[Kind; 2]>,
    /// The lowest copy's value.
    pub value: Option<Value>,
    /// Every other slot that could hold the key was read and holds another
    /// key: `slots` is all there is.
    pub exact: bool,
}

impl Copies {
    /// The lowest copy a reader sees: the key's value.
    pub fn visible(&self) -> Option<usize> {
        self.kinds.iter().position(|k| k.is_readable())
    }

    /// Puts the copies in position order. The blocks were read in slot
    /// order, which is position order, so only a `known` copy can be out
    /// of place; the value stays the lowest read copy's.
    fn sort(&mut self) {
        let mut order: SmallVec<[usize; 4]> = (0..self.slots.len()).collect();
        order.sort_by_key(|&i| self.slots[i].0);
        self.slots = order.iter().map(|&i| self.slots[i]).collect();
        self.kinds = order.iter().map(|&i| self.kinds[i]).collect();
    }
}

/// Whether the index read of an operation shows a resize under way.
pub fn meets_resize(slots: &Slots) -> bool {
    // One OR over all slots (no early exit): it compiles to vector ORs.
    Slot(slots.iter().fold(0, |all, s| all | s.0)).is_frozen()
}

/// Whether any candidate other than `at` has the key's fingerprint (and so
/// could hold the key); only those before `at` with `lower_only`.
pub fn others_match(kh: &KeyHash, slots: &Slots, at: usize, lower_only: bool) -> bool {
    let others = kh.matches(slots) & !(1 << at);
    let below = if lower_only { (1 << at) - 1 } else { u64::MAX };
    others & below != 0
}

impl Client {
    /// The READs of the key's two windows of buckets.
    pub(crate) fn window_reads(&self, kh: &KeyHash) -> [Verb; 2] {
        let g = &self.info.geometry;
        std::array::from_fn(|w| Verb::Read {
            remote: g.bucket_offset(kh.windows[w]),
            local: self.layout.window(w),
            len: WINDOW_BYTES,
        })
    }

    /// Reads the key's windows in one batch (after `first`, a WRITE that
    /// travels with them); the clock starts before it.
    pub(crate) fn read_windows(&mut self, kh: &KeyHash, first: Option<Verb>) -> Result<OpClock> {
        let clock = self.timing.start();
        let [a, b] = self.window_reads(kh);
        match first {
            Some(first) => self.conn.post(&[first, a, b])?,
            None => self.conn.post(&[a, b])?,
        }
        Ok(clock)
    }

    /// The key's candidate slots as the last READ of its windows left them.
    pub(crate) fn slots(&self) -> Slots {
        let at = self.layout.windows;
        let words = &self.conn.local()[at..at + CANDIDATE_SLOTS * 8];
        let mut slots = [Slot::EMPTY; CANDIDATE_SLOTS];
        for (slot, word) in slots.iter_mut().zip(words.chunks_exact(8)) {
            *slot = Slot(u64::from_le_bytes(word.try_into().unwrap_or_default()));
        }
        slots
    }

    pub(crate) fn cas_verb(&self, pos: SlotPos, expect: Slot, swap: Slot) -> Verb {
        Verb::Cas {
            remote: self.info.geometry.slot_offset(pos),
            local: self.layout.cas,
            expect: expect.0,
            swap: swap.0,
        }
    }

    /// Whether the last CAS posted found the value it expected.
    pub(crate) fn cas_held(&self, expect: Slot) -> bool {
        read_u64(self.conn.local(), self.layout.cas) == expect.0
    }

    pub(crate) fn cas(&mut self, pos: SlotPos, expect: Slot, swap: Slot) -> Result<bool> {
        self.conn.post(&[self.cas_verb(pos, expect, swap)])?;
        Ok(self.cas_held(expect))
    }

    /// Reads the blocks of the slots whose fingerprint matches and keeps
    /// those that pass the checksum and hold `key` (in one batch where
    /// batches cost round trips; for `Lowest` over shm, one block at a
    /// time until one holds the key).
    ///
    /// A slot that cannot point at a block, or whose block fails validation,
    /// is skipped; if the key is not found elsewhere the scan asks for a
    /// retry, naming that slot (see [`crate::corrupt::CorruptSlot`]).
    ///
    /// Frozen slots (a resize is migrating these buckets) are followed as
    /// usual, and so may a slot pointing past the region this client knows
    /// (it grew): both are trusted only if the epoch word, read in the same
    /// batch as the blocks and so after the buckets, shows no newer geometry
    /// — the buckets were then read before the new index was published.
    pub(crate) fn scan(
        &mut self,
        key: &[u8],
        kh: &KeyHash,
        slots: &Slots,
        clock: OpClock,
        mode: ScanMode,
    ) -> Result<Scan> {
        let g = self.info.geometry;
        let (reads_at, room) = (self.layout.reads, self.layout.read_room());
        let known = match mode {
            ScanMode::AllCopies { known } => known,
            ScanMode::Lowest | ScanMode::Readable => None,
        };
        let mut copies = Copies {
            slots: SmallVec::new(),
            kinds: SmallVec::new(),
            value: None,
            exact: true,
        };
        let mut suspect: Option<(SlotPos, Slot)> = None;
        let mut candidates: SmallVec<[(usize, Slot, u64, usize); 4]> = SmallVec::new();
        let mut check_epoch = meets_resize(slots);
        for i in set_bits(kh.matches(slots)) {
            let s = slots[i];
            let live = s.thawed();
            if Some(s) == known {
                copies.slots.push((kh.slot_pos(i), s));
                copies.kinds.push(Kind::Known);
                continue;
            }
            // No client writes a block larger than `max_block` (< room).
            match g.block_span(live).filter(|&(_, len)| len <= room) {
                Some((offset, len)) => candidates.push((i, s, offset, len)),
                None => {
                    // Past the region this client knows: it may have grown.
                    check_epoch |= live
                        .block_len()
                        .is_some_and(|len| live.offset().saturating_add(len) > g.region_len);
                    suspect.get_or_insert((kh.slot_pos(i), s));
                }
            }
        }
        self.pause_if_slow();
        let epoch_read = Verb::Read {
            remote: EPOCH_OFFSET,
            local: self.layout.epoch,
            len: 8,
        };
        if candidates.is_empty() && check_epoch {
            self.conn.post(&[epoch_read])?;
            if read_u64(self.conn.local(), self.layout.epoch) != g.epoch {
                return Ok(Scan::Moved);
            }
        }
        // A GET needs only the lowest copy: where batches are free, the next
        // candidate's block is read only if this one's did not hold the key.
        let one_at_a_time = mode == ScanMode::Lowest && !self.conn.batches_cost_round_trips();
        let mut next = 0;
        while next < candidates.len() {
            let mut verbs: SmallVec<[Verb; 8]> = SmallVec::new();
            if check_epoch {
                verbs.push(epoch_read);
            }
            let first = verbs.len();
            let mut at = reads_at;
            while let Some(&(_, _, remote, len)) = candidates.get(next) {
                if verbs.len() > first && (one_at_a_time || at + len > reads_at + room) {
                    break;
                }
                verbs.push(Verb::Read {
                    remote,
                    local: at,
                    len,
                });
                at += len;
                next += 1;
            }
            self.conn.post(&verbs)?;
            if check_epoch && read_u64(self.conn.local(), self.layout.epoch) != g.epoch {
                return Ok(Scan::Moved);
            }
            if !clock.in_time() {
                // Too slow to trust anything read: a block may have been
                // freed and rewritten (even for another key) since the slot
                // was read, so not even "not found" can be concluded.
                return Ok(Scan::Retry(None));
            }
            let local = self.conn.local();
            let mut at = reads_at;
            let batch = verbs.len() - first;
            let mut sealed = None;
            for &(i, slot, _, len) in &candidates[next - batch..next] {
                let block = &local[at..at + len];
                let block_at = at;
                at += len;
                // Read within the deadline, a block its slot still referenced
                // when the buckets were read cannot have been reused yet: a
                // failure here is damage, or a race a retry resolves.
                let Ok(view) = decode_block(block) else {
                    suspect.get_or_insert((kh.slot_pos(i), slot));
                    continue;
                };
                if view.key != key {
                    continue;
                }
                let (kind, value) = match view.payload {
                    Payload::Counter {
                        sealed: true,
                        state_word,
                        ..
                    } => {
                        // A writer is unlinking it: neither its value nor
                        // its absence is the key's yet.
                        sealed = Some((slot, state_word));
                        break;
                    }
                    Payload::Counter { value, state, .. } => {
                        if state != CounterState::Settled && mode.skips_pending() {
                            // Not there for a reader, but it may yet be.
                            copies.exact = false;
                            continue;
                        }
                        (Kind::of(&view.payload), Value::Counter(value))
                    }
                    Payload::Bytes(bytes) => {
                        let start = block_at + (bytes.as_ptr() as usize - block.as_ptr() as usize);
                        (Kind::Bytes, Value::Bytes(start..start + bytes.len()))
                    }
                };
                if copies.slots.is_empty() {
                    copies.value = Some(value);
                }
                copies.slots.push((kh.slot_pos(i), slot));
                copies.kinds.push(kind);
                if mode == ScanMode::Lowest {
                    copies.exact = false;
                    return Ok(Scan::Found(copies));
                }
            }
            if let Some((slot, state_word)) = sealed {
                self.wait_on_lock(key, slot, state_word, clock)?;
                return Ok(Scan::Retry(None));
            }
        }
        if suspect.is_some() {
            if copies.slots.is_empty() {
                return Ok(Scan::Retry(suspect));
            }
            copies.exact = false;
        }
        copies.sort();
        Ok(Scan::Found(copies))
    }

    /// The fault hook `pause_after_index_read`: sleeps as a client on a slow
    /// or preempted host would, one time in four the whole pause, otherwise
    /// up to a quarter of it.
    pub(crate) fn pause_if_slow(&mut self) {
        if let Some(max) = self.options.pause_after_index_read {
            let r = self.random();
            let pause = match r % 4 {
                0 => max,
                _ => Duration::from_micros(r % (max.as_micros() as u64 / 4 + 1)),
            };
            std::thread::sleep(pause);
        }
    }
}
