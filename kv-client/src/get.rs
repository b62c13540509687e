//! GET: read the key's two windows of buckets in one batch, then the
//! blocks of the slots whose fingerprint matches; the lowest slot holding
//! the key is its value. Over rdma those blocks are one batch (a round trip
//! each would cost more than the bytes); over shm, where a batch costs
//! only its copies, they are read one at a time, lowest first, until one
//! holds the key. With a fresh hint, the windows and the remembered
//! block are read in one batch (see `hint` for why their order does not
//! matter; where READs run in the order posted, a hint past its life is
//! used too); if the slot changed, the windows just read go on to the
//! scan, so a stale hint costs nothing. A sole hint needs no other slot: the
//! batch reads the slot's word and the block, two READs instead of three.

use crossbeam::utils::Backoff;
use kv_common::layout::{block_head_len, KeyHash, Slot};
use kv_common::transport::{read_u64, Verb};

use crate::clock::OpClock;
use crate::corrupt::CorruptSlot;
use crate::hint::{Alone, Hint, Seen};
use crate::index::{
    others_match, Holds, Kind, LowestCopy, Others, ReaderScan, ScanMode, Value, WindowsRead,
};
use crate::{Client, Result, Step};

/// What one batch of a key's windows and its hinted block showed.
pub enum Sighting {
    /// The hinted slot still holds the key, as its lowest copy, with this
    /// value (None: the block was read only as far as its head, see
    /// `BlockRead`). `alone`: no other slot could hold a copy.
    Held {
        value: Option<Value>,
        clock: OpClock,
        alone: bool,
    },
    /// The windows were read (the clock started before them), but the hint
    /// did not hold.
    WindowsOnly(OpClock),
    /// The sole hint's slot changed: nothing read is of use.
    Stale,
}

/// How much of a hinted block a read takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BlockRead {
    /// The whole block: its value is wanted (a GET, an increment).
    Whole,
    /// Its head (`ScanMode::Keys`): a PUT or DELETE, which replaces the
    /// value, only needs to know the block is the key's.
    Head,
}

/// A sole hint's reads: its slot's word and its block, in one batch.
#[derive(Clone, Copy)]
pub(crate) struct SoleRead {
    pub hint: Hint,
    pub word: Verb,
    pub block: Verb,
    pub extent: BlockRead,
}

impl SoleRead {
    #[inline(always)]
    pub fn verbs(&self) -> [Verb; 2] {
        [self.word, self.block]
    }
}

impl Client {
    /// The value a GET of `key` returns, as it lies in the local buffer
    /// until the next batch.
    pub(crate) fn get_once(&mut self, key: &[u8]) -> Result<Step<Option<Value>>> {
        let kh = KeyHash::new(key, self.info.geometry.bucket_count);
        let mut read_already = None;
        if let Some(hint) = self.hint_to_read(key) {
            match self.read_hinted(key, &kh, (hint, BlockRead::Whole), None)? {
                Sighting::Held {
                    value: Some(value),
                    clock,
                    ..
                } => {
                    // Held: no lower slot could hold a copy.
                    let seen = Seen::new((hint.pos, hint.slot), clock);
                    self.found_by_get(key, seen, || matches!(value, Value::Bytes(_)));
                    return Ok(Step::Done(Some(value)));
                }
                // (A whole block read always gives its value.)
                Sighting::Held { clock, .. } | Sighting::WindowsOnly(clock) => {
                    read_already = Some(clock)
                }
                Sighting::Stale => {}
            }
        }
        let mut corrupt = CorruptSlot::default();
        let backoff = Backoff::new();
        for attempt in 0..self.options.max_attempts {
            // Retries may outlast a read lease (see `read_lease`).
            self.keep_read_lease()?;
            // After a hint that did not hold, every copy: proving there is
            // only one lets the hint settle.
            let (clock, mode) = match read_already.take() {
                Some(clock) => (clock, ReaderScan::Readable),
                // Only a first attempt starts at the thread's last reading:
                // a retry follows pauses (backoff, waits) that must not
                // count against it.
                None if attempt == 0 => (
                    self.read_windows_from_last_reading(&kh)?,
                    ReaderScan::Lowest,
                ),
                None => (self.read_windows(&kh, None)?, ReaderScan::Lowest),
            };
            let slots = self.slots();
            let read = WindowsRead::new(&slots, clock);
            match self.lowest_copy(key, &kh, &read, mode)? {
                LowestCopy::Found {
                    pos,
                    slot,
                    kind,
                    value,
                    alone,
                } => {
                    let seen = Seen::new((pos, slot), clock);
                    self.saw(key, seen, Alone::proven_if(alone), kind.settled_counter());
                    // As `read_hinted` holds a hint: no lower slot could
                    // hold a copy.
                    let lowest = |at| !others_match(&kh, &slots, at, Others::Lower);
                    self.found_by_get(key, seen, || {
                        kind == Kind::Bytes && kh.slot_index(pos).is_some_and(lowest)
                    });
                    return Ok(Step::Done(Some(value)));
                }
                LowestCopy::Absent => {
                    self.cache.forget(key);
                    return Ok(Step::Done(None));
                }
                LowestCopy::Retry(suspect) => corrupt.saw(key, suspect)?,
                LowestCopy::Moved => return Ok(Step::Moved),
            }
            backoff.snooze();
        }
        Err(crate::Error::Contended(self.options.max_attempts))
    }

    /// Reads the key's windows and its hinted block (as far as `extent`
    /// says) in one batch (after `first`, a WRITE that travels with it).
    /// The value is the key's if the slot still holds the hinted value, no
    /// other slot could hold a lower copy (none can once the hint is sole),
    /// the block is the key's, and it was all read within the deadline:
    /// exactly what reading the buckets and then the block would have
    /// concluded. The hint is confirmed, or dropped.
    pub(crate) fn read_hinted(
        &mut self,
        key: &[u8],
        kh: &KeyHash,
        (hint, extent): (Hint, BlockRead),
        first: Option<Verb>,
    ) -> Result<Sighting> {
        let Some((at, block)) = self.hinted_block(key, kh, (hint, extent)) else {
            return Ok(Sighting::WindowsOnly(self.read_windows(kh, first)?));
        };
        if hint.is_sole() {
            let sole = SoleRead {
                extent,
                ..self.sole_read(hint, block, self.layout.slot)
            };
            return self.read_sole(key, sole, first);
        }
        let clock = self.timing.start();
        // The windows before the block: a hint past its life needs it.
        let [a, b] = self.window_reads(kh);
        match first {
            Some(first) => self.conn.post(&[first, a, b, block])?,
            None => self.conn.post(&[a, b, block])?,
        }
        Ok(self.hinted_sighting(key, kh, (hint, extent), (at, block, clock)))
    }

    /// The hinted slot's index among the key's candidates, and the READ of
    /// its block (as far as `extent`) into the read area; None, the hint
    /// dropped, if the slot is not one of the key's or cannot name a block
    /// this client can read.
    pub(crate) fn hinted_block(
        &mut self,
        key: &[u8],
        kh: &KeyHash,
        (hint, extent): (Hint, BlockRead),
    ) -> Option<(usize, Verb)> {
        let at = kh.slot_index(hint.pos);
        let (Some(at), Some((remote, len))) = (at, self.readable_span(hint.slot)) else {
            self.cache.forget(key);
            return None;
        };
        let len = match extent {
            BlockRead::Whole => len,
            BlockRead::Head => len.min(block_head_len(key.len())),
        };
        let local = self.layout.reads;
        Some((at, Verb::Read { remote, local, len }))
    }

    /// What a batch that read the key's windows, then its hinted block
    /// (`block`, the hinted slot being candidate `at`), timed by `clock`,
    /// shows (see `read_hinted`). The hint is confirmed, or dropped.
    pub(crate) fn hinted_sighting(
        &mut self,
        key: &[u8],
        kh: &KeyHash,
        (hint, extent): (Hint, BlockRead),
        (at, block, clock): (usize, Verb, OpClock),
    ) -> Sighting {
        let slots = self.slots();
        let alone = !others_match(kh, &slots, at, Others::Any);
        // A counter's hint is confirmed only by its value read open: one
        // sealed by a writer must not look recently seen (see `counter`).
        let counter = match hint.is_counter() {
            true => match self.held_in(key, block, extent) {
                Some(value @ Some(Value::Counter(_))) => Some(value),
                _ => {
                    self.cache.forget(key);
                    return Sighting::WindowsOnly(clock);
                }
            },
            false => None,
        };
        if !clock.in_time() || slots[at] != hint.slot {
            self.cache.forget(key);
            return Sighting::WindowsOnly(clock);
        }
        // A hint past its life is remembered anew below, once the block
        // shows what it holds.
        if !hint.is_reread() {
            // The same copy, seen again (whatever else the batch shows).
            let seen = hint.confirmed(
                hint.slot,
                clock.started(),
                Alone::proven_if(alone),
                &self.timing,
            );
            self.cache.remember(key, seen);
            if !seen.is_sole() && !alone && seen.may_settle(&self.timing) {
                // Only reading the other slots' blocks tells whether they
                // hold copies: the caller's scan does, once, and the hint
                // settles.
                return Sighting::WindowsOnly(clock);
            }
        }
        if !hint.is_sole() && others_match(kh, &slots, at, Others::Lower) {
            // A lower slot might hold a copy: the scan decides.
            return Sighting::WindowsOnly(clock);
        }
        match counter.or_else(|| self.held_in(key, block, extent)) {
            Some(value) => {
                if hint.is_reread() {
                    // A new sighting, as a scan of these windows makes.
                    let counter = match value {
                        Some(Value::Counter(n)) => Some(n),
                        Some(Value::Bytes(_)) | None => None,
                    };
                    let seen = Seen::new((hint.pos, hint.slot), clock);
                    self.saw(key, seen, Alone::proven_if(alone), counter);
                }
                Sighting::Held {
                    value,
                    clock,
                    alone,
                }
            }
            None => {
                // A fresh hint's block is the key's: this is damage, which
                // the scan reports, or a counter being unlinked, which it
                // waits on. (A hint past its life may name another key's
                // block now: the scan finds the key's.)
                self.cache.forget(key);
                Sighting::WindowsOnly(clock)
            }
        }
    }

    /// A sole hint: one batch reads the hinted slot's word and its block.
    /// No other slot can hold a copy, so the slot still holding the hinted
    /// value is all the block needs.
    fn read_sole(&mut self, key: &[u8], sole: SoleRead, first: Option<Verb>) -> Result<Sighting> {
        let clock = self.timing.start();
        match first {
            Some(first) => self.conn.post(&[first, sole.word, sole.block])?,
            None => self.conn.post(&sole.verbs())?,
        }
        Ok(match self.sole_value(key, &sole, clock) {
            Some(value) => Sighting::Held {
                value,
                clock,
                alone: true,
            },
            None => Sighting::Stale,
        })
    }

    /// The reads a sole hint needs, its slot's word landing at `word_at`.
    #[inline(always)]
    pub(crate) fn sole_read(&self, hint: Hint, block: Verb, word_at: usize) -> SoleRead {
        let word = Verb::Read {
            remote: self.info.geometry.slot_offset(hint.pos),
            local: word_at,
            len: 8,
        };
        SoleRead {
            hint,
            word,
            block,
            extent: BlockRead::Whole,
        }
    }

    /// What a `SoleRead` timed by `clock` shows: the key's value (None if
    /// only the block's head was read) if the slot still held the hinted
    /// value, in time, and the block holds the key. The hint is confirmed,
    /// or dropped.
    #[inline(always)]
    pub(crate) fn sole_value(
        &mut self,
        key: &[u8],
        sole: &SoleRead,
        clock: OpClock,
    ) -> Option<Option<Value>> {
        let hint = sole.hint;
        let now = Slot(read_u64(self.conn.local(), sole.word.local_offset()));
        let value = (clock.in_time() && now == hint.slot)
            .then(|| self.held_in(key, sole.block, sole.extent))
            .flatten();
        match value {
            Some(_) => {
                let seen = hint.confirmed(hint.slot, clock.started(), Alone::Proven, &self.timing);
                self.cache.remember(key, seen);
            }
            None => self.cache.forget(key),
        }
        value
    }

    /// The value a reader sees in the block `read` brought back (as far
    /// as `extent`: None for a byte block read only to its head), if it is
    /// valid and holds `key` (a pending counter is not there yet, a sealed
    /// one may be gone).
    pub(crate) fn held_in(
        &self,
        key: &[u8],
        read: Verb,
        extent: BlockRead,
    ) -> Option<Option<Value>> {
        let Verb::Read { local, len, .. } = read else {
            return None;
        };
        let mode = match extent {
            BlockRead::Whole => ScanMode::Lowest,
            BlockRead::Head => ScanMode::Keys,
        };
        // A sealed counter's value is not the key's: the scan waits. (A
        // head read, as a writer's, sees a pending counter too: not yet
        // there for a reader, so not here.)
        match self.holds(key, local..local + len, mode) {
            Holds::Copy(kind, value) if kind.is_readable() => Some(Some(value)),
            Holds::Key => Some(None),
            _ => None,
        }
    }
}

/// A value as a GET returns it, on its own.
pub(crate) fn value_bytes(local: &[u8], value: Value) -> Vec<u8> {
    let mut out = Vec::new();
    copy_out(local, value, &mut out);
    out
}

/// A value as a GET returns it: a counter as its decimal text.
pub(crate) fn copy_out(local: &[u8], value: Value, out: &mut Vec<u8>) {
    out.clear();
    match value {
        Value::Bytes(range) => out.extend_from_slice(&local[range]),
        Value::Counter(n) => out.extend_from_slice(n.to_string().as_bytes()),
    }
}
