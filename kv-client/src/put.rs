//! PUT: write the new block out of place, then publish it with a CAS on
//! the key's slot. With a sole, fresh hint (see `hint`) the WRITE and the
//! CAS share one batch. Otherwise: locate the key, then update the copy
//! readers see (a counter under its lock, see `counter`), or insert into
//! an empty slot and check for a concurrent insert of the same key
//! (`dedup`).
//!
//! A WRITE and a CAS posted after it may share a batch: an RC responder
//! executes requests in the order they were sent (IBA spec vol. 1, §9.5
//! "Transaction ordering"; only work requests after an RDMA READ or an
//! atomic need `IBV_SEND_FENCE`, ibv_post_send(3)), so a reader that sees
//! the new slot finds the block written, as Sherman's combined write-back
//! and unlock relies on. On shm the verbs of a batch run in order.

use crossbeam::utils::Backoff;
use kv_common::layout::{block_len, class_for, encode_block, KeyHash, Slot, SlotPos};
use kv_common::transport::Verb;
use smallvec::SmallVec;

use crate::clock::OpClock;
use crate::corrupt::CorruptSlot;
use crate::hint::{Hint, Seen};
use crate::index::Copies;
use crate::locate::{Located, Need};
use crate::{Client, Error, Result, Step};

/// Where an insert goes (`Client::insert_at`).
pub(crate) enum InsertAt {
    /// The empty slot it takes.
    Empty(SlotPos),
    /// None of the key's slots is empty: the index must grow.
    Full,
    /// The windows were read too long ago to act on: read them again.
    Late,
}

impl Client {
    pub(crate) fn put_once(&mut self, key: &[u8], value: &[u8]) -> Result<Step<()>> {
        let (kh, new, write) = self.new_block(key, value)?;
        // A block that is never published is garbage the server reclaims.
        let mut unwritten = Some(write);
        if let Some(hint) = self.blind_hint(key) {
            unwritten = None;
            if self.update_blind(key, (hint.pos, hint.slot), (write, &mut None), new)? {
                return Ok(Step::Done(()));
            }
        }
        let mut corrupt = CorruptSlot::default();
        let backoff = Backoff::new();
        for _ in 0..self.options.max_attempts {
            match self.locate(key, &kh, unwritten.take(), Need::Lowest)? {
                Located::Found { copies, clock } => {
                    if self.update(key, &copies, new, clock)? {
                        return Ok(Step::Done(()));
                    }
                }
                Located::Absent { clock } => {
                    if let Some(step) = self.insert(key, &kh, (new, None, &mut None), clock)? {
                        return Ok(step);
                    }
                }
                Located::Retry(suspect) => corrupt.saw(key, suspect)?,
                Located::Moved => return Ok(Step::Moved),
            }
            backoff.snooze();
        }
        Err(Error::Contended(self.options.max_attempts))
    }

    /// Takes a block for `key`'s new `value` and encodes it locally: the
    /// key's hash (under the geometry after the lease, which may have
    /// taught this client a new one), the slot value that will link the
    /// block, and the WRITE that puts it in place.
    pub(crate) fn new_block(&mut self, key: &[u8], value: &[u8]) -> Result<(KeyHash, Slot, Verb)> {
        let used = block_len(key.len(), value.len());
        let class = class_for(used).ok_or(Error::ValueTooLarge {
            len: value.len(),
            max: self.max_value,
        })?;
        let offset = self.take_block(class)?;
        let kh = KeyHash::new(key, self.info.geometry.bucket_count);
        encode_block(key, value, &mut self.conn.local_mut()[self.layout.block..]);
        let write = Verb::Write {
            remote: offset,
            local: self.layout.block,
            len: used.div_ceil(8) as usize * 8,
        };
        Ok((kh, Slot::new(kh.fingerprint, class, offset), write))
    }

    /// One round trip: the block's WRITE and the CAS of the key's copy
    /// (`pos` holding `old`, as a sole hint or a read in time says) in one
    /// batch, and after it `then`, taken (another word's CAS: a replicated
    /// write's insert lock let go). False if the slot changed (the block is
    /// written; locate).
    pub(crate) fn update_blind(
        &mut self,
        key: &[u8],
        (pos, old): (SlotPos, Slot),
        (write, then): (Verb, &mut Option<Verb>),
        new: Slot,
    ) -> Result<bool> {
        let clock = self.timing.start();
        let cas = self.cas_verb(pos, old, new);
        match then.take() {
            Some(then) => self.conn.post(&[write, cas, then])?,
            None => self.conn.post(&[write, cas])?,
        }
        Ok(self.swapped(key, Seen::new((pos, old), clock), new))
    }

    /// A CAS of the copy `old` to `new` completed: whether it held (the old
    /// block is then unlinked, and the hint follows the new one, or is
    /// forgotten with the key: `new` empty); if not, the key's hint is
    /// forgotten.
    pub(crate) fn swapped(&mut self, key: &[u8], old: Seen, new: Slot) -> bool {
        if self.cas_held(old.slot) {
            self.unlinked(old.slot);
            match new {
                Slot::EMPTY => self.cache.forget(key),
                _ => self.replaced(key, old, new),
            }
            return true;
        }
        self.cache.forget(key);
        false
    }

    /// Publishes `new` over the copy readers see (the lowest readable one,
    /// else the lowest), after clearing away the copies below it, which no
    /// reader sees (counters not settled). False if one changed meanwhile
    /// or the reads are too old to act on: locate again.
    pub(crate) fn update(
        &mut self,
        key: &[u8],
        copies: &Copies,
        new: Slot,
        clock: OpClock,
    ) -> Result<bool> {
        if copies.slots.is_empty() {
            return Ok(false);
        }
        let target = copies.visible().unwrap_or(0);
        let (pos, old) = copies.slots[target];
        let swapped = self.remove_duplicates(key, copies, 0..target, clock)?
            && self.unlink(key, Seen::new((pos, old), clock), copies.kinds[target], new)?;
        if !swapped {
            self.cache.forget(key);
            return Ok(false);
        }
        self.replaced(key, Seen::new((pos, old), clock), new);
        // Copies above ours belong to inserts still in flight, which remove
        // them themselves; trying here only helps.
        let above = target + 1..copies.slots.len();
        self.remove_duplicates(key, copies, above, clock)?;
        Ok(true)
    }

    /// Inserts `new` into an empty slot of the windows `locate` just read:
    /// the CAS and a new read of the windows in one batch (after `write`,
    /// the new block's WRITE if it is not yet posted; and with `then`, if
    /// the CAS is posted: see `insert_verbs`), where the duplicate check
    /// starts. None if the slot was taken meanwhile or the reads are too
    /// old to act on: locate again.
    pub(crate) fn insert(
        &mut self,
        key: &[u8],
        kh: &KeyHash,
        (new, write, then): (Slot, Option<Verb>, &mut Option<Verb>),
        clock: OpClock,
    ) -> Result<Option<Step<()>>> {
        let pos = match self.insert_at(kh, clock) {
            InsertAt::Empty(pos) => pos,
            InsertAt::Full => return Ok(Some(Step::Full(key.to_vec()))),
            InsertAt::Late => return Ok(None),
        };
        let published = self.timing.start();
        self.conn
            .post(&self.insert_verbs(kh, (pos, new), (write, then.take())))?;
        if !self.cas_held(Slot::EMPTY) {
            return Ok(None);
        }
        self.inserted(key, kh, Seen::new((pos, new), published))?;
        Ok(Some(Step::Done(())))
    }

    /// Where an insert goes in the windows `locate` just read (by the
    /// batch timed by `clock`).
    pub(crate) fn insert_at(&self, kh: &KeyHash, clock: OpClock) -> InsertAt {
        let Some(empty) = KeyHash::insert_choice(&self.slots()) else {
            return InsertAt::Full;
        };
        // An insert lands within two deadlines of the read that found no
        // copy: what lets a hint settle (`Timing::settle`).
        if !clock.in_time() {
            return InsertAt::Late;
        }
        InsertAt::Empty(kh.slot_pos(empty))
    }

    /// An insert's batch: the CAS of the empty slot at `pos` to `new` and
    /// a new read of the windows, after `write` (the new block's WRITE, if
    /// it is not yet posted). `then`, another word's CAS, goes right after
    /// the insert's, before the READs, which so see both.
    pub(crate) fn insert_verbs(
        &self,
        kh: &KeyHash,
        (pos, new): (SlotPos, Slot),
        (write, then): (Option<Verb>, Option<Verb>),
    ) -> SmallVec<[Verb; 5]> {
        let [a, b] = self.window_reads(kh);
        let cas = self.cas_verb(pos, Slot::EMPTY, new);
        write
            .into_iter()
            .chain([cas])
            .chain(then)
            .chain([a, b])
            .collect()
    }

    /// This client's insert CAS published `mine` (its windows read again
    /// in the same batch): remembered as the key's hint, and checked
    /// against a concurrent insert of the same key (`dedup`).
    pub(crate) fn inserted(&mut self, key: &[u8], kh: &KeyHash, mine: Seen) -> Result<()> {
        // A hint even if this copy is resolved away: it is checked on use.
        self.cache
            .remember(key, Hint::seen(mine.pos, mine.slot, mine.clock));
        self.resolve_insert(key, kh, mine)
    }
}
