//! Reading a key's place in the index: its two windows of candidate
//! buckets (one READ each), the CAS on one of its slots, and the scan that
//! reads the blocks of the slots whose fingerprint matches.

use std::ops::Range;
use std::time::Duration;

use kv_common::layout::{
    block_head_len, decode_block, decode_block_head, set_bits, BlockHead, CounterState, KeyHash,
    Payload, Slot, SlotPos, CANDIDATE_SLOTS, EPOCH_OFFSET,
};
use kv_common::transport::{read_u64, Verb};
use smallvec::SmallVec;

use crate::clock::OpClock;
use crate::hint::Hint;
use crate::local::WINDOW_BYTES;
use crate::{Client, Result};

pub type Slots = [Slot; CANDIDATE_SLOTS];

/// The blocks a single-key scan reads: candidate index, slot, offset and
/// length of its block.
pub(crate) type ScanCandidates = SmallVec<[(usize, Slot, u64, usize); 4]>;

/// What a scan finds among its slots before it reads a block, and then
/// in the blocks it read.
pub(crate) struct ScanStart {
    /// The writer's own copy, known without reading it; then the copies
    /// the blocks read hold.
    copies: Copies,
    /// The blocks to read.
    pub candidates: ScanCandidates,
    /// The first slot whose block cannot be read whole, or failed
    /// validation.
    pub suspect: Option<(SlotPos, Slot)>,
    /// Whether a slot points past the region this client knows.
    pub past_region: bool,
}

impl ScanStart {
    /// What the scan found, every candidate judged.
    pub fn end(mut self) -> Scan {
        if self.suspect.is_some() {
            if self.copies.slots.is_empty() {
                return Scan::Retry(self.suspect);
            }
            self.copies.exact = false;
        }
        self.copies.sort();
        Scan::Found(self.copies)
    }
}

/// A key's candidate slots as one READ of its windows showed them, and the
/// clock of that read.
#[derive(Debug, Clone, Copy)]
pub struct WindowsRead<'s> {
    pub slots: &'s Slots,
    pub clock: OpClock,
}

impl<'s> WindowsRead<'s> {
    pub fn new(slots: &'s Slots, clock: OpClock) -> WindowsRead<'s> {
        WindowsRead { slots, clock }
    }
}

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
    /// Every copy, lowest first, each block read only as far as its head
    /// (`block_head_len`): what a writer that replaces the value (a PUT, a
    /// DELETE) must know. A byte copy's value is not read (a counter's
    /// block is its head, so its value is).
    Keys,
}

impl ScanMode {
    fn skips_pending(self) -> bool {
        matches!(self, ScanMode::Lowest | ScanMode::Readable)
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

/// What a reader's scan must find (`Client::lowest_copy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReaderScan {
    /// The lowest copy a reader sees.
    Lowest,
    /// Every copy a reader sees, to learn whether the lowest is alone.
    Readable,
}

/// The lowest copy of a key a reader sees, as `Client::lowest_copy` found
/// it.
pub enum LowestCopy {
    Found {
        pos: SlotPos,
        slot: Slot,
        kind: Kind,
        value: Value,
        /// Proven to be the key's only copy (false: not known).
        alone: bool,
    },
    Absent,
    /// As `Scan::Retry`.
    Retry(Option<(SlotPos, Slot)>),
    /// As `Scan::Moved`.
    Moved,
}

/// What a candidate's block, as read, holds for the key looked for.
pub(crate) enum Holds {
    /// Not a valid block.
    Damaged,
    OtherKey,
    /// The key's counter, sealed by a writer unlinking it.
    Sealed {
        state_word: u64,
    },
    /// The key's counter, not settled, where the scan skips those.
    Pending,
    Copy(Kind, Value),
    /// The key's byte block, read only as far as its head
    /// (`ScanMode::Keys`): a copy whose value was not read.
    Key,
}

/// The copies of a key a scan found.
#[derive(Default)]
pub struct Copies {
    /// Slots holding the key, lowest position first.
    pub slots: SmallVec<[(SlotPos, Slot); 2]>,
    /// What each of `slots` holds.
    pub kinds: SmallVec<[Kind; 2]>,
    /// The lowest copy's value; None when its block was read only as far
    /// as its head (`ScanMode::Keys`, a byte copy).
    pub value: Option<Value>,
    /// Every other slot that could hold the key was read and holds another
    /// key: `slots` is all there is.
    pub exact: bool,
}

impl Copies {
    /// The copy at `pos`, holding `slot`, known to be the key's lowest (a
    /// hint that held, a GET's sighting): what an update acts on.
    pub fn known(pos: SlotPos, slot: Slot) -> Copies {
        Copies {
            slots: smallvec::smallvec![(pos, slot)],
            kinds: smallvec::smallvec![Kind::Known],
            value: None,
            exact: false,
        }
    }

    /// The copy `hint` names, found still holding its slot by a read that
    /// saw it `alone` (no other slot could hold the key) and its `value`
    /// (if the block was read whole): all there is if alone or the hint is
    /// sole.
    pub fn held(hint: &Hint, alone: bool, value: Option<Value>) -> Copies {
        Copies {
            value,
            exact: alone || hint.is_sole(),
            ..Copies::known(hint.pos, hint.slot)
        }
    }

    /// The one copy, if it holds plain bytes (read, or `known`): an update
    /// CASes it and nothing else (`Client::update`; a counter's copy is
    /// unlinked through its lock, see `counter`).
    pub fn only_bytes(&self) -> Option<(SlotPos, Slot)> {
        match (&self.slots[..], &self.kinds[..]) {
            ([copy], [Kind::Bytes | Kind::Known]) => Some(*copy),
            _ => None,
        }
    }

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

/// Which candidates besides one `others_match` looks at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Others {
    /// Every other candidate.
    Any,
    /// Only those before it (which would hold a lower copy).
    Lower,
}

/// Whether any candidate other than `at` (among `which`) has the key's
/// fingerprint, and so could hold the key.
pub fn others_match(kh: &KeyHash, slots: &Slots, at: usize, which: Others) -> bool {
    let others = kh.matches(slots) & !(1 << at);
    let among = match which {
        Others::Lower => (1 << at) - 1,
        Others::Any => u64::MAX,
    };
    others & among != 0
}

impl Client {
    /// The READs of the key's two windows of buckets.
    pub(crate) fn window_reads(&self, kh: &KeyHash) -> [Verb; 2] {
        self.window_reads_to(kh, self.layout.windows)
    }

    /// The READs of the key's two windows, landing one after the other at
    /// `local` (a single-key operation's place, or a key's in a batch).
    pub(crate) fn window_reads_to(&self, kh: &KeyHash, local: usize) -> [Verb; 2] {
        let g = &self.info.geometry;
        std::array::from_fn(|w| Verb::Read {
            remote: g.bucket_offset(kh.windows[w]),
            local: local + w * WINDOW_BYTES,
            len: WINDOW_BYTES,
        })
    }

    /// Reads the key's windows in one batch (after `first`, a WRITE or a
    /// CAS that travels ahead of them); the clock starts before it.
    pub(crate) fn read_windows(&mut self, kh: &KeyHash, first: Option<Verb>) -> Result<OpClock> {
        let clock = self.timing.start();
        self.post_windows(kh, first)?;
        Ok(clock)
    }

    /// As `read_windows` with no WRITE, for a GET's first attempt: where a
    /// batch costs only its copies, the clock starts at the thread's last
    /// reading (`Timing::start_at_last_reading`).
    pub(crate) fn read_windows_from_last_reading(&mut self, kh: &KeyHash) -> Result<OpClock> {
        if self.conn.batches_cost_round_trips() {
            return self.read_windows(kh, None);
        }
        let clock = self.timing.start_at_last_reading();
        self.post_windows(kh, None)?;
        Ok(clock)
    }

    fn post_windows(&mut self, kh: &KeyHash, first: Option<Verb>) -> Result<()> {
        let [a, b] = self.window_reads(kh);
        match first {
            Some(first) => self.conn.post(&[first, a, b])?,
            None => self.conn.post(&[a, b])?,
        }
        Ok(())
    }

    /// The key's candidate slots as the last READ of its windows left them.
    pub(crate) fn slots(&self) -> Slots {
        self.slots_at(self.layout.windows)
    }

    /// The candidate slots of windows read to `at` (see `window_reads_to`).
    pub(crate) fn slots_at(&self, at: usize) -> Slots {
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

    /// CASes the slot at `pos`; true if it held `expect`, whose block (if
    /// any) this client has then unlinked and reports.
    pub(crate) fn cas(&mut self, pos: SlotPos, expect: Slot, swap: Slot) -> Result<bool> {
        self.conn.post(&[self.cas_verb(pos, expect, swap)])?;
        let held = self.cas_held(expect);
        if held {
            self.unlinked(expect);
        }
        Ok(held)
    }

    /// Reads the blocks of the slots whose fingerprint matches (only their
    /// heads in `ScanMode::Keys`) and keeps those that pass validation and
    /// hold `key`, in as few batches as the
    /// local buffer allows (a GET over shm reads them one at a time: see
    /// `lowest_copy`).
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
        read: &WindowsRead,
        mode: ScanMode,
    ) -> Result<Scan> {
        let (slots, clock) = (read.slots, read.clock);
        let mut start = self.scan_start(key.len(), kh, slots, mode);
        let check_epoch = meets_resize(slots) || start.past_region;
        self.pause_if_slow();
        if start.candidates.is_empty() && check_epoch && self.read_epoch_changed()? {
            return Ok(Scan::Moved);
        }
        let mut next = 0;
        while next < start.candidates.len() {
            let epoch = check_epoch.then(|| self.epoch_read());
            let (verbs, batch) = self.candidate_reads(&start.candidates[next..], epoch);
            self.conn.post(&verbs)?;
            next += batch;
            if check_epoch && self.epoch_changed() {
                return Ok(Scan::Moved);
            }
            if let Some(early) =
                self.judge_candidates(key, kh, (&mut start, next - batch..next), (mode, clock))?
            {
                return Ok(early);
            }
        }
        Ok(start.end())
    }

    /// What a scan of the key's `slots` (of a key `key_len` bytes long)
    /// reads: the blocks of the slots whose fingerprint matches, each only
    /// as far as `mode` needs. (Inlined: the struct is too large to return
    /// cheaply.)
    #[inline(always)]
    pub(crate) fn scan_start(
        &self,
        key_len: usize,
        kh: &KeyHash,
        slots: &Slots,
        mode: ScanMode,
    ) -> ScanStart {
        let known = match mode {
            ScanMode::AllCopies { known } => known,
            ScanMode::Lowest | ScanMode::Readable | ScanMode::Keys => None,
        };
        let mut start = ScanStart {
            copies: Copies {
                slots: SmallVec::new(),
                kinds: SmallVec::new(),
                value: None,
                exact: true,
            },
            candidates: ScanCandidates::new(),
            suspect: None,
            past_region: false,
        };
        self.scan_candidates(kh, slots, known, &mut start);
        if mode == ScanMode::Keys {
            let head = block_head_len(key_len);
            for candidate in &mut start.candidates {
                candidate.3 = candidate.3.min(head);
            }
        }
        start
    }

    /// Judges the `batch` of `start`'s candidates whose blocks were just
    /// read (into the read area, one after the other) for the scan whose
    /// windows read `clock` timed. Some: what the scan found without
    /// looking further (a retry, or a reader's lowest copy).
    pub(crate) fn judge_candidates(
        &mut self,
        key: &[u8],
        kh: &KeyHash,
        (start, batch): (&mut ScanStart, Range<usize>),
        (mode, clock): (ScanMode, OpClock),
    ) -> Result<Option<Scan>> {
        if !clock.in_time() {
            // Too slow to trust anything read: a block may have been
            // freed and rewritten (even for another key) since the slot
            // was read, so not even "not found" can be concluded.
            return Ok(Some(Scan::Retry(None)));
        }
        let mut at = self.layout.reads;
        for &(i, slot, _, len) in &start.candidates[batch] {
            let holds = self.holds(key, at..at + len, mode);
            at += len;
            match holds {
                Holds::Damaged => {
                    start.suspect.get_or_insert((kh.slot_pos(i), slot));
                }
                Holds::OtherKey => {}
                Holds::Pending => start.copies.exact = false,
                Holds::Sealed { state_word } => {
                    self.wait_on_lock(key, slot, state_word, clock)?;
                    return Ok(Some(Scan::Retry(None)));
                }
                Holds::Copy(kind, value) => {
                    if start.copies.slots.is_empty() {
                        start.copies.value = Some(value);
                    }
                    start.copies.slots.push((kh.slot_pos(i), slot));
                    start.copies.kinds.push(kind);
                    if mode == ScanMode::Lowest {
                        start.copies.exact = false;
                        return Ok(Some(Scan::Found(std::mem::take(&mut start.copies))));
                    }
                }
                Holds::Key => {
                    start.copies.slots.push((kh.slot_pos(i), slot));
                    start.copies.kinds.push(Kind::Bytes);
                }
            }
        }
        Ok(None)
    }

    /// Sorts the slots of a scan whose fingerprint matches into `start`
    /// (filled in place: it is too large to return cheaply): the writer's
    /// own copy (`known`) goes straight into its copies, a block this client
    /// can read whole becomes a candidate, any other slot is suspect.
    #[inline]
    fn scan_candidates(
        &self,
        kh: &KeyHash,
        slots: &Slots,
        known: Option<Slot>,
        start: &mut ScanStart,
    ) {
        for i in set_bits(kh.matches(slots)) {
            let s = slots[i];
            if Some(s) == known {
                start.copies.slots.push((kh.slot_pos(i), s));
                start.copies.kinds.push(Kind::Known);
                continue;
            }
            match self.readable_span(s) {
                Some((offset, len)) => start.candidates.push((i, s, offset, len)),
                None => {
                    start.past_region |= self.past_region(s);
                    start.suspect.get_or_insert((kh.slot_pos(i), s));
                }
            }
        }
    }

    /// The READs of the leading `candidates` whose blocks fit the read area
    /// (at least one), after `first` (the epoch word's READ, where the scan
    /// checks it), and how many candidates they read.
    #[inline(always)]
    pub(crate) fn candidate_reads(
        &self,
        candidates: &[(usize, Slot, u64, usize)],
        first: Option<Verb>,
    ) -> (SmallVec<[Verb; 8]>, usize) {
        let (reads_at, room) = (self.layout.reads, self.layout.read_room());
        let mut verbs: SmallVec<[Verb; 8]> = first.into_iter().collect();
        let first = verbs.len();
        let mut at = reads_at;
        for &(_, _, remote, len) in candidates {
            if verbs.len() > first && at + len > reads_at + room {
                break;
            }
            verbs.push(Verb::Read {
                remote,
                local: at,
                len,
            });
            at += len;
        }
        let read = verbs.len() - first;
        (verbs, read)
    }

    /// The lowest copy a reader sees (a GET's answer), as `scan` would find
    /// it. Where batches are free (shm), `Lowest` reads one candidate's
    /// block at a time, lowest first, until one holds the key.
    pub(crate) fn lowest_copy(
        &mut self,
        key: &[u8],
        kh: &KeyHash,
        read: &WindowsRead,
        seek: ReaderScan,
    ) -> Result<LowestCopy> {
        let mode = match seek {
            ReaderScan::Lowest if !self.conn.batches_cost_round_trips() => {
                return self.scan_lowest(key, kh, read);
            }
            ReaderScan::Lowest => ScanMode::Lowest,
            ReaderScan::Readable => ScanMode::Readable,
        };
        Ok(match self.scan(key, kh, read, mode)? {
            // A reader's scan reads every copy it keeps: the lowest one's
            // value is there whenever a copy is.
            Scan::Found(copies) => match (copies.slots.first(), copies.value) {
                (Some(&(pos, slot)), Some(value)) => LowestCopy::Found {
                    pos,
                    slot,
                    kind: copies.kinds[0],
                    value,
                    alone: copies.exact && copies.slots.len() == 1,
                },
                _ => LowestCopy::Absent,
            },
            Scan::Retry(suspect) => LowestCopy::Retry(suspect),
            Scan::Moved => LowestCopy::Moved,
        })
    }

    /// `lowest_copy` one block at a time. The checks are `scan`'s, but for
    /// the epoch word: read with every block once a slot calls for it (a
    /// frozen one from the start, one past the known region when met), and
    /// alone at the end if none was read with it. So it guards every
    /// conclusion that the slots it concerns take part in; a copy found
    /// below a slot past the region is the key's whatever that slot holds,
    /// as the lowest copy wins.
    fn scan_lowest(&mut self, key: &[u8], kh: &KeyHash, read: &WindowsRead) -> Result<LowestCopy> {
        let (slots, clock) = (read.slots, read.clock);
        let mut check_epoch = meets_resize(slots);
        let mut epoch_read = false;
        self.pause_if_slow();
        let at = self.layout.reads;
        let mut suspect: Option<(SlotPos, Slot)> = None;
        for i in set_bits(kh.matches(slots)) {
            let slot = slots[i];
            let Some((remote, len)) = self.readable_span(slot) else {
                check_epoch |= self.past_region(slot);
                suspect.get_or_insert((kh.slot_pos(i), slot));
                continue;
            };
            let block = Verb::Read {
                remote,
                local: at,
                len,
            };
            match check_epoch {
                true => self.conn.post(&[self.epoch_read(), block])?,
                false => self.conn.post(&[block])?,
            }
            epoch_read |= check_epoch;
            if check_epoch && self.epoch_changed() {
                return Ok(LowestCopy::Moved);
            }
            if !clock.in_time() {
                // As in `scan`.
                return Ok(LowestCopy::Retry(None));
            }
            match self.holds(key, at..at + len, ScanMode::Lowest) {
                // (`Key` is only the answer of a head read: never here.)
                Holds::Damaged | Holds::Key => {
                    suspect.get_or_insert((kh.slot_pos(i), slot));
                }
                Holds::OtherKey | Holds::Pending => {}
                Holds::Sealed { state_word } => {
                    self.wait_on_lock(key, slot, state_word, clock)?;
                    return Ok(LowestCopy::Retry(None));
                }
                Holds::Copy(kind, value) => {
                    return Ok(LowestCopy::Found {
                        pos: kh.slot_pos(i),
                        slot,
                        kind,
                        value,
                        alone: false,
                    })
                }
            }
        }
        if check_epoch && !epoch_read && self.read_epoch_changed()? {
            return Ok(LowestCopy::Moved);
        }
        Ok(match suspect {
            Some(_) => LowestCopy::Retry(suspect),
            None => LowestCopy::Absent,
        })
    }

    /// Where a slot's block lies, if this client can read it whole. No
    /// client writes a block larger than `max_block` (< the read room).
    pub(crate) fn readable_span(&self, slot: Slot) -> Option<(u64, usize)> {
        let room = self.layout.read_room();
        self.info
            .geometry
            .block_span(slot.thawed())
            .filter(|&(_, len)| len <= room)
    }

    /// Whether a slot points past the region this client knows: it may
    /// have grown.
    fn past_region(&self, slot: Slot) -> bool {
        let live = slot.thawed();
        live.block_len()
            .is_some_and(|len| live.offset().saturating_add(len) > self.info.geometry.region_len)
    }

    /// The READ of the region's epoch word.
    pub(crate) fn epoch_read(&self) -> Verb {
        Verb::Read {
            remote: EPOCH_OFFSET,
            local: self.layout.epoch,
            len: 8,
        }
    }

    /// Whether the epoch word last read shows a newer geometry.
    pub(crate) fn epoch_changed(&self) -> bool {
        read_u64(self.conn.local(), self.layout.epoch) != self.info.geometry.epoch
    }

    /// Reads the epoch word alone: whether a newer geometry is in force.
    fn read_epoch_changed(&mut self) -> Result<bool> {
        self.conn.post(&[self.epoch_read()])?;
        Ok(self.epoch_changed())
    }

    /// What the block read into `range` of the local buffer holds for
    /// `key`. Read within the deadline, a block its slot still referenced
    /// when the buckets were read cannot have been reused yet: an invalid
    /// one is damage, or a race a retry resolves.
    pub(crate) fn holds(&self, key: &[u8], range: Range<usize>, mode: ScanMode) -> Holds {
        let block = &self.conn.local()[range.clone()];
        let decoded = match mode {
            ScanMode::Keys => decode_block_head(block, key.len()),
            _ => decode_block(block).map(|view| {
                Some(BlockHead {
                    key: view.key,
                    payload: Some(view.payload),
                })
            }),
        };
        let BlockHead { key: read, payload } = match decoded {
            Ok(Some(head)) => head,
            // A key of another length.
            Ok(None) => return Holds::OtherKey,
            Err(_) => return Holds::Damaged,
        };
        if read != key {
            return Holds::OtherKey;
        }
        let Some(payload) = payload else {
            return Holds::Key;
        };
        match payload {
            // A writer is unlinking it: neither its value nor its absence
            // is the key's yet.
            Payload::Counter {
                sealed: true,
                state_word,
                ..
            } => Holds::Sealed { state_word },
            // Not there for a reader, but it may yet be.
            Payload::Counter { state, .. }
                if state != CounterState::Settled && mode.skips_pending() =>
            {
                Holds::Pending
            }
            Payload::Counter { value, .. } => {
                Holds::Copy(Kind::of(&payload), Value::Counter(value))
            }
            Payload::Bytes(bytes) => {
                let start = range.start + (bytes.as_ptr() as usize - block.as_ptr() as usize);
                Holds::Copy(Kind::Bytes, Value::Bytes(start..start + bytes.len()))
            }
        }
    }

    /// The fault hook `pause_after_index_read`: sleeps as a client on a slow
    /// or preempted host would, one time in four the whole pause, otherwise
    /// up to a quarter of it.
    pub(crate) fn pause_if_slow(&mut self) {
        if let Some(max) = self.options.pause_after_index_read() {
            let r = self.random();
            let pause = match r % 4 {
                0 => max,
                _ => Duration::from_micros(r % (max.as_micros() as u64 / 4 + 1)),
            };
            std::thread::sleep(pause);
        }
    }
}
