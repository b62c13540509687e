//! Counters: a key whose block holds an 8-byte value that FETCH-AND-ADD and
//! CAS change in place, one verb once the counter is found (two round trips
//! with a settled hint: the slot's word, then the atomic).
//!
//! **Why a new counter starts pending.** Two clients may insert the same
//! key at once; the lowest copy wins and the others are removed (`dedup`).
//! For plain values that is an ordinary overwrite, but increments that
//! landed on a losing copy would be lost. So a counter is inserted
//! *pending*: readers do not see it and nothing adds to it. Its creator
//! waits `Timing::settle` (no other copy can appear after that, see
//! `hint`), reads the key's copies again, and, if its copy is the only one
//! a reader could see and the lowest one not given up, CASes the block's
//! state to *settled*: that is when the increment takes effect. Otherwise it
//! drops its copy and starts over. Only the creator settles a counter; a
//! client that meets a pending copy whose creator seems gone (unchanged for
//! two settle periods) CASes its state to *abandoned*, so the two cannot
//! both win, and empties its slot. PUT treats a pending copy as any copy
//! (replacing one makes its creator start over), so that a settled counter
//! really is the only copy, except that a PUT's new copy never loses to one
//! (its duplicate check gives the pending copy up instead); DELETE leaves
//! it to its creator, so that deletes cannot starve creators (the counter
//! then appears after the delete). A resize drops abandoned copies and
//! carries pending ones only where no copy readers see exists.
//!
//! **Lost connections.** Once an atomic that may take effect has been
//! posted, a lost connection ends the call with `Error::OutcomeUnknown`
//! rather than redoing it, which could apply it twice.
//!
//! **Why a late FETCH-AND-ADD changes no live data.** An atomic is posted
//! only within the operation deadline of the read that saw the slot link
//! the counter's block (the clock is checked before posting, or the batch
//! reads the slot before the atomic with a fresh hint). A block unlinked
//! after that read is not reused before a grace period has passed, so the
//! atomic lands on the counter or on its dead block; in the latter case the
//! operation is ordered just before the write that unlinked it, which was
//! still in flight. A hinted atomic whose slot changed is redone.
//!
//! A plain GET of a counter returns its decimal text; PUT replaces it with
//! plain bytes; DELETE removes it. `incr` on a plain value is an error.

use quanta::Instant;

use crossbeam::utils::Backoff;
use kv_common::layout::{
    class_for, counter_block_len, counter_words, encode_counter_block, CounterState, KeyHash, Slot,
    SlotPos, COUNTER_ABANDONED, COUNTER_PENDING, COUNTER_SETTLED, EPOCH_OFFSET,
};
use kv_common::transport::{read_u64, Verb};

use crate::clock::OpClock;
use crate::corrupt::CorruptSlot;
use crate::hint::Hint;
use crate::index::{meets_resize, Copies, Kind, Scan, ScanMode};
use crate::{Client, Error, Result, Step};

/// What a counter operation does to a settled counter's value word.
#[derive(Debug, Clone, Copy)]
pub enum CounterOp {
    Add(i64),
    Swap { expect: i64, new: i64 },
}

impl CounterOp {
    fn verb(self, remote: u64, local: usize) -> Verb {
        match self {
            CounterOp::Add(delta) => Verb::FetchAdd {
                remote,
                local,
                add: delta as u64,
            },
            CounterOp::Swap { expect, new } => Verb::Cas {
                remote,
                local,
                expect: expect as u64,
                swap: new as u64,
            },
        }
    }

    /// What the operation returns, given the word's old value: the new
    /// value of an increment, the old value of a compare-and-set.
    fn result(self, old: i64) -> i64 {
        match self {
            CounterOp::Add(delta) => old.wrapping_add(delta),
            CounterOp::Swap { .. } => old,
        }
    }
}

/// How a counter this client inserted ended.
enum Created {
    /// Settled: the increment took effect.
    Settled,
    /// Dropped or given up (or the index moved): start over.
    Lost,
    Full,
}

/// A pending copy this client is waiting on, and since when.
type Watch = Option<(SlotPos, Slot, Instant)>;

impl Client {
    pub(crate) fn counter_once(&mut self, key: &[u8], op: CounterOp) -> Result<Step<Option<i64>>> {
        if let Some(hint) = self.blind_hint(key).filter(Hint::is_counter) {
            if let Some(old) = self.apply_hinted(key, hint, op)? {
                return Ok(Step::Done(Some(op.result(old))));
            }
        }
        let mut corrupt = CorruptSlot::default();
        let backoff = Backoff::new();
        let mut watch: Watch = None;
        for _ in 0..self.options.max_attempts {
            let kh = KeyHash::new(key, self.info.geometry.bucket_count);
            let clock = self.read_windows(&kh, None)?;
            let slots = self.slots();
            let mode = ScanMode::AllCopies { known: None };
            let copies = match self.scan(key, &kh, &slots, clock, mode)? {
                Scan::Found(copies) => copies,
                Scan::Retry(suspect) => {
                    corrupt.saw(key, suspect)?;
                    backoff.snooze();
                    continue;
                }
                Scan::Moved => return Ok(Step::Moved),
            };
            // The lowest copy a reader sees is the key's value.
            let visible = (0..copies.slots.len()).find(|&i| copies.kinds[i].is_readable());
            match visible.map(|i| (copies.slots[i], copies.kinds[i])) {
                Some((_, Kind::Bytes | Kind::Known)) => return Err(Error::NotACounter),
                Some(((pos, slot), Kind::Counter { .. })) => {
                    if clock.in_time() {
                        let word = slot.thawed().offset() + counter_words(key.len()).1 as u64;
                        self.conn
                            .post(&[op.verb(word, self.layout.cas)])
                            .map_err(|e| outcome_unknown(e.into()))?;
                        let old = read_u64(self.conn.local(), self.layout.cas) as i64;
                        let alone = copies.exact && copies.slots.len() == 1;
                        self.saw(key, pos, slot, clock, alone);
                        if let Some(h) = self.cache.get(key) {
                            self.cache.remember(key, h.of_counter());
                        }
                        return Ok(Step::Done(Some(op.result(old))));
                    }
                }
                None => {
                    let CounterOp::Add(delta) = op else {
                        return Ok(Step::Done(None));
                    };
                    if copies.slots.is_empty() {
                        match self.create_counter(key, &kh, delta, clock)? {
                            Created::Settled => return Ok(Step::Done(Some(delta))),
                            Created::Full => return Ok(Step::Full),
                            Created::Lost => {}
                        }
                    } else {
                        // Only copies not yet settled: wait for their
                        // creator, or give up on one that seems gone.
                        self.tend_unsettled(key, &copies, clock, Some(&mut watch))?;
                        std::thread::sleep(self.timing.space_poll());
                    }
                }
            }
            backoff.snooze();
        }
        Err(Error::Contended(self.options.max_attempts))
    }

    /// Two round trips with a settled counter hint: the slot's word and the
    /// epoch word, then (once they are known) the atomic. It is posted only
    /// if the slot still linked the block when it was read (frozen or not,
    /// while no new index had been published: a resize moves the slot, not
    /// the block), so it takes effect before anything that unlinks the
    /// block later; None if it was not posted: redo it from the buckets.
    /// (One batch would need the NIC to hold the atomic until the READs
    /// complete, the fence indicator, which Soft-RoCE was seen to hang on.)
    fn apply_hinted(&mut self, key: &[u8], hint: Hint, op: CounterOp) -> Result<Option<i64>> {
        let clock = self.timing.start();
        let g = self.info.geometry;
        let slot_word = Verb::Read {
            remote: g.slot_offset(hint.pos),
            local: self.layout.slot,
            len: 8,
        };
        let epoch_word = Verb::Read {
            remote: EPOCH_OFFSET,
            local: self.layout.epoch,
            len: 8,
        };
        self.conn.post(&[slot_word, epoch_word])?;
        let local = self.conn.local();
        let now = Slot(read_u64(local, self.layout.slot));
        let epoch = read_u64(local, self.layout.epoch);
        let holds = now == hint.slot || (now == hint.slot.frozen() && epoch == g.epoch);
        if !holds || !hint.is_fresh(&self.timing) {
            self.cache.forget(key);
            return Ok(None);
        }
        let word = hint.slot.offset() + counter_words(key.len()).1 as u64;
        self.conn
            .post(&[op.verb(word, self.layout.cas)])
            .map_err(|e| outcome_unknown(e.into()))?;
        let old = read_u64(self.conn.local(), self.layout.cas) as i64;
        if now == hint.slot {
            let seen = hint.confirmed(hint.slot, clock.started(), true, &self.timing);
            self.cache.remember(key, seen);
        } else {
            self.cache.forget(key);
        }
        Ok(Some(old))
    }

    /// Inserts a pending counter holding `delta` into an empty slot of the
    /// windows just read (timed by `clock`), then settles it.
    fn create_counter(
        &mut self,
        key: &[u8],
        kh: &KeyHash,
        delta: i64,
        clock: OpClock,
    ) -> Result<Created> {
        let used = counter_block_len(key.len());
        let class = class_for(used).ok_or(Error::Protocol("no size class for a counter".into()))?;
        let index = (
            self.info.geometry.index_offset,
            self.info.geometry.bucket_count,
        );
        let offset = self.take_block(class)?;
        if (
            self.info.geometry.index_offset,
            self.info.geometry.bucket_count,
        ) != index
        {
            // Leasing taught this client a new index: read it.
            return Ok(Created::Lost);
        }
        let Some(empty) = KeyHash::insert_choice(&self.slots()) else {
            return Ok(Created::Full);
        };
        // Inserts land within two deadlines of the read that found no copy.
        if !clock.in_time() {
            return Ok(Created::Lost);
        }
        encode_counter_block(key, delta, &mut self.conn.local_mut()[self.layout.block..]);
        let new = Slot::new(kh.fingerprint, class, offset);
        let pos = kh.slot_pos(empty);
        let write = Verb::Write {
            remote: offset,
            local: self.layout.block,
            len: used as usize,
        };
        let published = self.timing.start();
        self.conn
            .post(&[write, self.cas_verb(pos, Slot::EMPTY, new)])?;
        if !self.cas_held(Slot::EMPTY) {
            return Ok(Created::Lost);
        }
        let since = Instant::now();
        let settled = self.settle(key, kh, empty, new, since)?;
        if let Some(check) = settled {
            // The check that settled it saw it alone, late enough.
            let hint = Hint::held_since(pos, new, since, published);
            let hint = hint.confirmed(new, check.started(), true, &self.timing);
            self.cache.remember(key, hint.of_counter());
            return Ok(Created::Settled);
        }
        Ok(Created::Lost)
    }

    /// Settles this client's pending copy at candidate `mine` (slot value
    /// `new`, in place since `since`) once no other copy can appear. Returns
    /// the clock of the read that found it alone, or None if it was dropped
    /// or given up.
    fn settle(
        &mut self,
        key: &[u8],
        kh: &KeyHash,
        mine: usize,
        new: Slot,
        since: Instant,
    ) -> Result<Option<OpClock>> {
        let state_word = new.offset() + counter_words(key.len()).0 as u64;
        let my_pos = kh.slot_pos(mine);
        let mut corrupt = CorruptSlot::default();
        for _ in 0..self.options.max_attempts {
            let wait = (since + self.timing.settle()).saturating_duration_since(Instant::now());
            std::thread::sleep(wait);
            let clock = self.read_windows(kh, None)?;
            let slots = self.slots();
            if slots[mine].thawed() != new {
                // Replaced or removed by a writer, or given up by another
                // client; it never settled (only this client settles it).
                return Ok(None);
            }
            let copies = match meets_resize(&slots) {
                // A frozen slot cannot be emptied: give the copy up through
                // its state (a resize drops abandoned counters), and start
                // over on the new index.
                true => None,
                false => match self.scan(
                    key,
                    kh,
                    &slots,
                    clock,
                    ScanMode::AllCopies { known: Some(new) },
                )? {
                    Scan::Found(copies) => Some(copies),
                    Scan::Retry(suspect) => {
                        corrupt.saw(key, suspect)?;
                        continue;
                    }
                    Scan::Moved => None,
                },
            };
            if !clock.in_time() {
                // Too slow to act on what was read: read again.
                continue;
            }
            let Some(copies) = copies else {
                self.set_state(state_word, COUNTER_ABANDONED)?;
                return Ok(None);
            };
            let beaten = copies
                .slots
                .iter()
                .zip(&copies.kinds)
                .any(|(&(pos, _), &kind)| {
                    pos != my_pos && (kind.is_readable() || (pos < my_pos && !abandoned(kind)))
                });
            if beaten {
                // Another copy is the key's (or will be): drop ours, through
                // its state first (only this client settles it; the slot is
                // emptied only while the read is in time).
                self.set_state(state_word, COUNTER_ABANDONED)?;
                if clock.in_time() {
                    self.cas(my_pos, new, Slot::EMPTY)?;
                }
                return Ok(None);
            }
            // The increment takes effect here: a lost connection now leaves
            // its outcome unknown, and the call must not be redone.
            let state = self
                .set_state(state_word, COUNTER_SETTLED)
                .map_err(outcome_unknown)?;
            if state != COUNTER_PENDING {
                // Given up by another client, which empties the slot.
                let _ = self.cas(my_pos, new, Slot::EMPTY);
                return Ok(None);
            }
            // Ours is the key's: the copies left are pending ones above it,
            // which can no longer settle, or abandoned ones. Clearing them
            // only helps; the increment is done whatever happens here.
            let _ = self.tend_unsettled(key, &copies, clock, None);
            return Ok(Some(clock));
        }
        Err(Error::Contended(self.options.max_attempts))
    }

    /// Gives up a counter copy that has not settled, found by the read
    /// timed by `clock`, and empties its slot: through its state first, so
    /// that its creator's settling CAS and this one cannot both succeed.
    /// False if it settled meanwhile (it is then a copy like any other), its
    /// slot changed, or the read is too old to act on.
    pub(crate) fn give_up_unsettled(
        &mut self,
        key: &[u8],
        pos: SlotPos,
        slot: Slot,
        clock: OpClock,
    ) -> Result<bool> {
        if !clock.in_time() {
            return Ok(false);
        }
        let state_word = slot.thawed().offset() + counter_words(key.len()).0 as u64;
        if self.set_state(state_word, COUNTER_ABANDONED)? == COUNTER_SETTLED {
            return Ok(false);
        }
        self.cas(pos, slot, Slot::EMPTY)
    }

    /// CASes a counter's state word from pending to `to`; returns what it
    /// held.
    fn set_state(&mut self, state_word: u64, to: u64) -> Result<u64> {
        self.conn.post(&[Verb::Cas {
            remote: state_word,
            local: self.layout.cas,
            expect: COUNTER_PENDING,
            swap: to,
        }])?;
        Ok(read_u64(self.conn.local(), self.layout.cas))
    }

    /// Clears away copies no reader sees, found by the read timed by
    /// `clock`: abandoned ones are unlinked. With a `watch` (no copy has
    /// settled), the lowest pending one is watched, and given up if it stays
    /// unchanged for two settle periods (its creator is gone or stalled:
    /// settling would by now have succeeded or dropped it); the others are
    /// left to their creators. Without one (this client's copy just settled,
    /// below them all), every pending copy is given up: none can settle.
    fn tend_unsettled(
        &mut self,
        key: &[u8],
        copies: &Copies,
        clock: OpClock,
        mut watch: Option<&mut Watch>,
    ) -> Result<()> {
        let mut lowest_pending = true;
        for (&(pos, slot), &kind) in copies.slots.iter().zip(&copies.kinds) {
            if !clock.in_time() {
                return Ok(());
            }
            let Kind::Counter { state, .. } = kind else {
                continue;
            };
            let give_up = match (state, watch.as_deref_mut()) {
                (CounterState::Abandoned, _) => {
                    self.cas(pos, slot, Slot::EMPTY)?;
                    false
                }
                (CounterState::Settled, _) => false,
                (CounterState::Pending, None) => true,
                (CounterState::Pending, Some(watch)) if lowest_pending => {
                    lowest_pending = false;
                    match *watch {
                        Some((p, s, since)) if (p, s) == (pos, slot) => {
                            since.elapsed() >= 2 * self.timing.settle()
                        }
                        _ => {
                            *watch = Some((pos, slot, Instant::now()));
                            false
                        }
                    }
                }
                (CounterState::Pending, Some(_)) => false,
            };
            if give_up {
                self.give_up_unsettled(key, pos, slot, clock)?;
            }
        }
        Ok(())
    }
}

/// What a failure to post an atomic means: if the connection was lost, the
/// atomic may or may not have executed, and redoing the call could apply
/// it twice.
fn outcome_unknown(e: Error) -> Error {
    match e.is_connection_lost() {
        true => Error::OutcomeUnknown(format!("the connection was lost: {e}")),
        false => e,
    }
}

fn abandoned(kind: Kind) -> bool {
    matches!(
        kind,
        Kind::Counter {
            state: CounterState::Abandoned,
            ..
        }
    )
}
