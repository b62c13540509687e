//! Counters: a key whose block holds an 8-byte value that FETCH-AND-ADD and
//! CAS change in place: one round trip with a fresh hint (the atomic, and
//! a READ of the slot that keeps the hint fresh), three without. PUT and
//! DELETE of a counter take two round trips more (its lock and its seal).
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
//! (`Client::restore_counters` inserts counters settled at once: for a
//! writer alone with the keys, as a shard move's copier is, no other copy
//! can appear.)
//!
//! **Why an atomic's own result tells whether it took effect.** A writer
//! unlinks a settled counter (a PUT over it, a DELETE) only under its
//! *lock*: it CASes the state word to locked (`COUNTER_LOCKED`; one writer
//! at a time), *seals* the value word by adding its top bit
//! (`COUNTER_SEAL`), and CASes the slot; the dead block stays sealed. So an
//! atomic that returns an open word landed on a live counter: it took
//! effect, whatever the slot shows. One that returns a sealed word did
//! not: a FETCH-AND-ADD is taken back at once (within the deadline of its
//! batch) and the call starts over from the buckets, where readers and
//! writers wait while a sealed counter is still linked. The slot's CAS is
//! the PUT's or DELETE's moment. If it fails (a resize froze the slot),
//! the writer unseals the word (by a CAS of its exact sealed value) and
//! unlocks it, stepping the lock's generation. The writer takes each step
//! only within the deadline of its read, so a lock seen unchanged for
//! `Timing::lock_timeout` (two settle periods and two deadlines) is a dead
//! writer's, or one so late that it gave up (one that runs out of time
//! after sealing, or loses its connection, leaves the key locked that
//! long): a client that waits on it takes it over, unseals and unlocks it
//! (`lock::wait_on_lock`). By then every late increment that found the
//! seal has been taken back (they come from hints seen within a deadline,
//! or from reads within one), so the value is the counter's again; one
//! whose client could not take it back in time ended with
//! `Error::OutcomeUnknown`, and counts from then on.
//!
//! **Why values stay within ±2^61.** The seal is the word's top bit, so an
//! open word's value must never reach ±2^62 by itself. An increment is a
//! blind FETCH-AND-ADD only for a delta of at most 2^32 on a counter last
//! seen within ±2^60 (`FAA_ZONE`); otherwise it is a CAS of the value read,
//! refused with `Error::CounterOverflow` if the result lies beyond ±2^61,
//! as is a compare-and-set to such a value. A client sees the value its
//! increment returns, so it lands at most one blind increment beyond 2^60
//! before it reads the counter again: the value stays within ±2^61 plus
//! 2^32 per connected client.
//!
//! **Lost connections.** Once an atomic that may take effect has been
//! posted, a lost connection ends the call with `Error::OutcomeUnknown`
//! rather than redoing it, which could apply it twice. An increment's
//! batch turned away whole (its connection's key no longer registered,
//! `TransportError::TurnedAway`) ran nothing, and is redone.
//!
//! **Why a late atomic changes no live data.** An atomic is posted only
//! within the operation deadline of the read that saw the slot link the
//! counter's block, or while a hint that names it is fresh with a deadline
//! to spare (so that its undo is too, see `hint`).
//! A block unlinked after that is not reused before a grace period has
//! passed, so the atomic lands on the counter or on its dead, sealed block.
//!
//! A plain GET of a counter returns its decimal text; PUT replaces it with
//! plain bytes; DELETE removes it. `incr` on a plain value is an error.

mod lock;

use crossbeam::utils::Backoff;
use kv_common::layout::{
    class_for, counter_block_len, counter_sealed, encode_counter_block, CounterState, KeyHash,
    Slot, SlotPos, COUNTER_ABANDONED, COUNTER_GENERATION, COUNTER_MAX, COUNTER_PENDING,
    COUNTER_SETTLED,
};
use kv_common::transport::{read_u64, Verb};

use crate::clock::{self, Instant, OpClock};
use crate::corrupt::CorruptSlot;
use crate::hint::{Alone, Hint, Seen};
use crate::index::{meets_resize, Copies, Kind, Scan, ScanMode, WindowsRead};
use crate::{Client, Error, Result, Step};
use lock::word_offsets;
pub use lock::LockWatch;

/// An increment is a blind FETCH-AND-ADD only on a counter last seen
/// within this magnitude (see "Why values stay within ±2^61")...
const FAA_ZONE: u64 = 1 << 60;
/// ...and only for a delta at most this large.
const FAA_MAX_DELTA: u64 = 1 << 32;

/// Whether an increment of a counter last seen holding `value` may be a
/// FETCH-AND-ADD (given a small enough delta).
pub(crate) fn far_from_limits(value: i64) -> bool {
    value.unsigned_abs() < FAA_ZONE
}

/// A value a counter may be set to.
fn in_range(value: i128) -> Result<i64> {
    match value.unsigned_abs() <= COUNTER_MAX as u128 {
        true => Ok(value as i64),
        false => Err(Error::CounterOverflow(value)),
    }
}

/// What a counter call does.
#[derive(Debug, Clone, Copy)]
pub enum CounterOp {
    Add(i64),
    Swap { expect: i64, new: i64 },
}

/// The atomic that carries out a counter call on a settled counter.
#[derive(Debug, Clone, Copy)]
enum Atomic {
    FetchAdd(i64),
    Cas { expect: i64, new: i64 },
}

impl Atomic {
    /// The atomic for `op` on a counter last seen holding `known`, or
    /// blind (None: only a small increment has one).
    fn plan(op: CounterOp, known: Option<i64>) -> Result<Option<Atomic>> {
        Ok(match op {
            CounterOp::Add(delta) => {
                let small = delta.unsigned_abs() <= FAA_MAX_DELTA;
                match known {
                    None if small => Some(Atomic::FetchAdd(delta)),
                    None => None,
                    Some(v) if small && far_from_limits(v) => Some(Atomic::FetchAdd(delta)),
                    Some(v) => {
                        let new = v as i128 + delta as i128;
                        // (A value left beyond the range by racing blind
                        // increments may still move back towards zero.)
                        Some(Atomic::Cas {
                            expect: v,
                            new: match new.abs() > (v as i128).abs() {
                                true => in_range(new)?,
                                false => new as i64,
                            },
                        })
                    }
                }
            }
            CounterOp::Swap { expect, new } => Some(Atomic::Cas {
                expect,
                new: in_range(new as i128)?,
            }),
        })
    }

    fn verb(self, remote: u64, local: usize) -> Verb {
        match self {
            Atomic::FetchAdd(delta) => Verb::FetchAdd {
                remote,
                local,
                add: delta as u64,
            },
            Atomic::Cas { expect, new } => Verb::Cas {
                remote,
                local,
                expect: expect as u64,
                swap: new as u64,
            },
        }
    }

    /// What `op` returns, and the counter's value after it, given the open
    /// word this atomic found; None if an increment made by CAS found the
    /// value changed (it took no effect).
    fn outcome(self, op: CounterOp, found: i64) -> Option<(i64, i64)> {
        match (self, op) {
            (Atomic::FetchAdd(delta), _) => {
                let now = found.wrapping_add(delta);
                Some((now, now))
            }
            (Atomic::Cas { expect, new }, CounterOp::Swap { .. }) => {
                Some((found, if found == expect { new } else { found }))
            }
            (Atomic::Cas { expect, new }, CounterOp::Add(_)) => {
                (found == expect).then_some((new, new))
            }
        }
    }
}

/// What an atomic found in the value word.
enum Landed {
    /// Sealed: it took no effect (an increment was undone).
    Sealed,
    /// Open: it landed on the live counter, which held this.
    Open(i64),
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
        if let Some(hint) = self.fresh_hint(key).filter(Hint::is_counter) {
            if let Some(result) = self.apply_hinted(key, hint, op)? {
                return Ok(Step::Done(Some(result)));
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
            let copies = match self.scan(key, &kh, &WindowsRead::new(&slots, clock), mode)? {
                Scan::Found(copies) => copies,
                Scan::Retry(suspect) => {
                    corrupt.saw(key, suspect)?;
                    backoff.snooze();
                    continue;
                }
                Scan::Moved => return Ok(Step::Moved),
            };
            match copies.visible().map(|i| (copies.slots[i], copies.kinds[i])) {
                Some((_, Kind::Bytes | Kind::Known)) => return Err(Error::NotACounter),
                Some(((pos, slot), Kind::Counter { value, .. })) => {
                    let word = word_offsets(key, slot).1;
                    let mut known = value;
                    // Within the read's deadline the block is this counter
                    // (live, or sealed and dead): a CAS that lost to another
                    // change goes again with the value it returned.
                    while clock.in_time() {
                        let Some(atomic) = Atomic::plan(op, Some(known))? else {
                            break;
                        };
                        let Landed::Open(found) = self.apply(atomic, word, (clock, None), None)?
                        else {
                            break;
                        };
                        match atomic.outcome(op, found) {
                            Some((result, now)) => {
                                let alone = copies.exact && copies.slots.len() == 1;
                                self.saw(
                                    key,
                                    Seen::new((pos, slot), clock),
                                    Alone::proven_if(alone),
                                    Some(now),
                                );
                                return Ok(Step::Done(Some(result)));
                            }
                            None => known = found,
                        }
                    }
                }
                None => {
                    let CounterOp::Add(delta) = op else {
                        return Ok(Step::Done(None));
                    };
                    if copies.slots.is_empty() {
                        in_range(delta as i128)?;
                        match self.create_counter(key, &kh, delta, clock)? {
                            Created::Settled => return Ok(Step::Done(Some(delta))),
                            Created::Full => return Ok(Step::Full(key.to_vec())),
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

    /// One round trip with a fresh hint naming a settled counter: the
    /// atomic on its value word, and a READ of its slot, which keeps the
    /// hint fresh if it still holds the same value. The atomic's result
    /// alone says whether it took effect (see the module doc). None if the
    /// call must go through the buckets: it took no effect, or an
    /// increment needs the counter's value first (a large delta, or a value
    /// near the limits).
    fn apply_hinted(&mut self, key: &[u8], hint: Hint, op: CounterOp) -> Result<Option<i64>> {
        self.pause_if_slow();
        // An increment that finds the seal is taken back up to a deadline
        // after it was posted: the hint must still be fresh then.
        if !hint.is_fresh_after_a_deadline(&self.timing) {
            return Ok(None);
        }
        let atomic = match op {
            CounterOp::Add(_) if !hint.allows_blind_add() => return Ok(None),
            op => match Atomic::plan(op, None)? {
                Some(atomic) => atomic,
                None => return Ok(None),
            },
        };
        let word = word_offsets(key, hint.slot).1;
        let slot_word = Verb::Read {
            remote: self.info.geometry.slot_offset(hint.pos),
            local: self.layout.slot,
            len: 8,
        };
        let clock = self.timing.start();
        let landed = self.apply(atomic, word, (clock, Some(hint)), Some(slot_word))?;
        let now = Slot(read_u64(self.conn.local(), self.layout.slot));
        let outcome = match landed {
            Landed::Open(found) => atomic.outcome(op, found),
            Landed::Sealed => None,
        };
        // (A blind atomic is a FETCH-AND-ADD or a compare-and-set: it is
        // done unless it found the word sealed.)
        let Some((result, value)) = outcome else {
            self.cache.forget(key);
            return Ok(None);
        };
        if now == hint.slot {
            let seen = hint.confirmed(hint.slot, clock.started(), Alone::Proven, &self.timing);
            self.cache.remember(key, seen.of_counter(value));
        } else {
            self.cache.forget(key);
        }
        Ok(Some(result))
    }

    /// Posts `atomic` on the value word at `word` (with `read` in the same
    /// batch), within the deadline of the read timed by `clock` (and while
    /// `hint`, if any, is fresh), and tells what it found; an increment
    /// that found the word sealed is taken back, within the same bounds.
    fn apply(
        &mut self,
        atomic: Atomic,
        word: u64,
        (clock, hint): (OpClock, Option<Hint>),
        read: Option<Verb>,
    ) -> Result<Landed> {
        let verb = atomic.verb(word, self.layout.cas);
        crate::pause_point("counter-atomic");
        match read {
            Some(read) => self.conn.post(&[verb, read]),
            None => self.conn.post(&[verb]),
        }
        .map_err(|e| match e.ran_nothing() {
            // Turned away whole: the atomic did not run, and the call
            // can be redone on a new connection.
            true => e.into(),
            false => outcome_unknown(e.into()),
        })?;
        let found = read_u64(self.conn.local(), self.layout.cas);
        if counter_sealed(found) {
            if let Atomic::FetchAdd(delta) = atomic {
                // Landed on a sealed word: take it back before anyone may
                // lift the seal (`Timing::lock_timeout`).
                let fresh = hint.is_none_or(|h| h.is_fresh(&self.timing));
                if !(clock.in_time() && fresh) {
                    return Err(Error::OutcomeUnknown(
                        "an increment landed on a counter being replaced or deleted and could \
                         not be taken back within the operation deadline"
                            .into(),
                    ));
                }
                self.fetch_add_word(word, delta.wrapping_neg() as u64)
                    .map_err(outcome_unknown)?;
            }
            return Ok(Landed::Sealed);
        }
        Ok(Landed::Open(found as i64))
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
        let class = class_for(used).ok_or(Error::Internal("no size class for a counter".into()))?;
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
        let since = clock::now();
        let settled = self.settle(key, kh, (empty, new), since)?;
        if let Some(check) = settled {
            // The check that settled it saw it alone, late enough.
            let hint = Hint::held_since(pos, new, since, published);
            let hint = hint.confirmed(new, check.started(), Alone::Proven, &self.timing);
            self.cache.remember(key, hint.of_counter(delta));
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
        (mine, new): (usize, Slot),
        since: Instant,
    ) -> Result<Option<OpClock>> {
        let state_word = word_offsets(key, new).0;
        let my_pos = kh.slot_pos(mine);
        let mut corrupt = CorruptSlot::default();
        for _ in 0..self.options.max_attempts {
            let wait = (since + self.timing.settle()).saturating_duration_since(clock::now());
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
                    &WindowsRead::new(&slots, clock),
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
            // A generation of its own: a lock watched on a dead counter is
            // not taken for one on a new counter in the same space.
            let settled = COUNTER_SETTLED | (self.random() & !(COUNTER_GENERATION - 1));
            let state = self
                .set_state(state_word, settled)
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

    /// CASes a counter's state word from pending to `to`; returns what it
    /// held.
    fn set_state(&mut self, state_word: u64, to: u64) -> Result<u64> {
        self.cas_word(state_word, COUNTER_PENDING, to)
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
                            clock::since(since) >= 2 * self.timing.settle()
                        }
                        _ => {
                            *watch = Some((pos, slot, clock::now()));
                            false
                        }
                    }
                }
                (CounterState::Pending, Some(_)) => false,
            };
            if give_up {
                self.unlink_unsettled(key, Seen::new((pos, slot), clock), Slot::EMPTY)?;
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
