//! What a client remembers about where a key lives, and when it may act on
//! that without reading the buckets first.
//!
//! A hint is a slot position `pos`, the slot value `slot` last seen there
//! (it names the key's block), and two times, each the start of a batch (or
//! earlier): `held_since`, from when `pos` has held the key without a
//! break, and `confirmed`, when `pos` last held `slot`.
//!
//! **Fresh hints cannot name a reused block.** Space is reused only a grace
//! period after the server found it unreferenced (a collection's scan, or
//! the check of a client's report that it unlinked it), and a block is never
//! linked again once unlinked. The slot held `slot` after `confirmed`, so
//! `slot`'s block cannot be rewritten before `confirmed + G`, and no slot
//! can hold the value `slot` again before then either (that needs the block
//! rewritten and published anew). A batch posted less than `G − D` after
//! `confirmed` executes before `confirmed + G` (it runs within `D`); hints
//! are used for `G − 2D` (`Timing::hint_life`), a deadline of margin. So:
//!
//! - a READ of the block returns `slot`'s block, in whatever order the
//!   batch's READs reach memory. If a READ of the buckets in the same batch
//!   shows `slot` at `pos`, the block was current then; nothing depends on
//!   the order of the two READs (see `ReadOrder` in the transport);
//! - a CAS expecting `slot` succeeds only if `pos` has held `slot` since
//!   `confirmed`: no ABA. Every confirming sighting and every successful CAS
//!   starts a new window.
//!
//! **Where READs run in the order posted (shm), a hint past its life
//! still guides a reader.** The batch reads the windows, then the block:
//! if the windows show `slot` at `pos`, the block was linked then, and it
//! cannot be reused before a grace period after that (it is unlinked
//! later, and reuse waits `G` after the unlink), longer than the batch
//! runs. So the block read is the one `slot` named: exactly what reading
//! the buckets and then the block in two batches would find. Nothing else
//! the hint said holds (the slot may have lost the key and got it back
//! since): it is read as an unsettled hint (`Hint::reread`), and what the
//! read finds is a new sighting.
//!
//! **Settled hints allow a blind CAS.** Readers take the lowest copy of a
//! key, so a CAS on a hinted slot that is not the lowest copy, or that
//! leaves another copy behind, can be lost or undone (see `dedup`). A second
//! copy of a key appears only from an insert that read the buckets before
//! the first copy existed; it checks the deadline before its CAS, so it
//! lands within `2D` of the first copy appearing (`Timing::settle` is `3D`,
//! a deadline of margin). A
//! sighting at least that long after `held_since` that finds no other copy
//! of the key therefore proves that none exists or can appear while `pos`
//! holds the key: the hint is `sole`. A sole, fresh hint lets an update
//! write its block and CAS the slot in one batch, and a delete CAS the slot
//! empty, with no read at all, unless it names a counter: a counter's
//! writers seal it before they unlink it (see `counter`), so they read it.
//! A hint that names a settled counter (its key's only copy readers see)
//! lets an increment or a compare-and-set post its atomic with no read
//! while it is fresh with a deadline to spare: an increment that finds the
//! counter sealed is taken back in a second batch (see `counter`).

use kv_common::layout::{Slot, SlotPos};

use crate::clock::{self, Instant, OpClock, Timing};
use crate::Client;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hint {
    pub pos: SlotPos,
    /// The slot value last seen at `pos`; it names the key's block.
    pub slot: Slot,
    held_since: Instant,
    confirmed: Instant,
    /// No other copy of the key exists, nor can one appear while `pos`
    /// holds the key.
    sole: bool,
    /// `slot` names a settled counter (which stays one while linked), and
    /// not plain bytes. Only a counter's writers may unlink it (they seal
    /// it first, see `counter`), so a blind CAS on its slot is not allowed.
    counter: bool,
    /// The counter's value was last seen far from the limits: an increment
    /// may be a blind FETCH-AND-ADD (see `counter::FAA_ZONE`).
    far_from_limits: bool,
    /// Past its life, taken for one read whose READs run in the order
    /// posted (`Hint::reread`): a sighting by it is a new one.
    reread: bool,
}

impl Hint {
    /// `pos` was seen holding the key as `slot` by the batch timed by
    /// `sighting`, which has completed (and no earlier sighting is known to
    /// be of the same copy). The copy existed by now: settling counts from
    /// here.
    pub fn seen(pos: SlotPos, slot: Slot, sighting: OpClock) -> Hint {
        Hint::held_since(pos, slot, clock::now(), sighting)
    }

    /// As `seen`, for a copy known to exist since `since`.
    pub fn held_since(pos: SlotPos, slot: Slot, since: Instant, sighting: OpClock) -> Hint {
        Hint {
            pos,
            slot,
            held_since: since,
            confirmed: sighting.started(),
            sole: false,
            counter: false,
            far_from_limits: false,
            reread: false,
        }
    }

    /// A hint past its life, as a reader whose READs run in the order
    /// posted may still use it: its slot and value, read windows first.
    /// Nothing it said about other copies holds, nor about a counter's
    /// value; a counter's hint still asks that the block read as one
    /// (writers leave such keys to the full path).
    pub fn reread(self) -> Hint {
        Hint {
            sole: false,
            far_from_limits: false,
            reread: true,
            ..self
        }
    }

    /// Whether this is a hint past its life (`Hint::reread`).
    pub fn is_reread(&self) -> bool {
        self.reread
    }

    /// The hinted block is a settled counter, whose value was last seen as
    /// `value`.
    pub fn of_counter(self, value: i64) -> Hint {
        Hint {
            counter: true,
            far_from_limits: crate::counter::far_from_limits(value),
            ..self
        }
    }

    pub fn is_counter(&self) -> bool {
        self.counter
    }

    /// A counter whose value was last seen far from the limits.
    pub fn allows_blind_add(&self) -> bool {
        self.counter && self.far_from_limits
    }

    /// A batch posted now may use the hint in place of reading the buckets.
    pub fn is_fresh(&self, timing: &Timing) -> bool {
        clock::since(self.confirmed) < timing.hint_life()
    }

    /// A batch posted up to a deadline from now may use the hint.
    pub fn is_fresh_after_a_deadline(&self, timing: &Timing) -> bool {
        clock::since(self.confirmed) + timing.deadline() < timing.hint_life()
    }

    /// A CAS on the hinted slot needs no read of the buckets (not for a
    /// counter: its writers seal it first).
    pub fn allows_blind_cas(&self, timing: &Timing) -> bool {
        self.sole && !self.counter && self.is_fresh(timing)
    }

    /// A lone sighting now would make the hint sole.
    pub fn may_settle(&self, timing: &Timing) -> bool {
        clock::since(self.held_since) >= timing.settle()
    }

    pub fn is_sole(&self) -> bool {
        self.sole
    }

    /// A batch that started `at` saw `pos` still hold `slot` (or this client's
    /// CAS replace it with `now_holds`); `alone`: whether that batch saw no
    /// other slot that could hold the key. Only for a hint that was fresh
    /// when the batch was posted: the slot then held the key throughout.
    pub fn confirmed(self, now_holds: Slot, at: Instant, alone: Alone, timing: &Timing) -> Hint {
        let settled = at.saturating_duration_since(self.held_since) >= timing.settle();
        Hint {
            slot: now_holds,
            confirmed: at,
            sole: self.sole || (alone == Alone::Proven && settled),
            counter: self.counter && now_holds == self.slot,
            ..self
        }
    }
}

/// Whether the read that saw a copy proved it the key's only one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Alone {
    Proven,
    Unknown,
}

impl Alone {
    pub fn proven_if(proven: bool) -> Alone {
        match proven {
            true => Alone::Proven,
            false => Alone::Unknown,
        }
    }
}

/// A copy of a key where a read found it (or a CAS put it): its slot's
/// position and value, and the clock of that batch, whose deadline bounds
/// what may be concluded from it.
#[derive(Debug, Clone, Copy)]
pub struct Seen {
    pub pos: SlotPos,
    pub slot: Slot,
    pub clock: OpClock,
}

impl Seen {
    /// The copy at `(pos, slot)` as the read timed by `clock` found it.
    pub fn new((pos, slot): (SlotPos, Slot), clock: OpClock) -> Seen {
        Seen { pos, slot, clock }
    }
}

/// The copy this client's last GET found, kept on a replicated shard's
/// primary for the write that may follow (a read-modify-write): the
/// write's observation (`primary`) takes it instead of reading the key
/// again, and commits by the block's WRITE and the CAS in one batch.
///
/// That is sound only where no second copy of a key can appear: then a
/// GET that found the key at its lowest candidate slot with its
/// fingerprint found what the write's own read would find, while the
/// CAS, posted within that read's deadline (`OpClock::in_time`, so the
/// slot's value cannot have come back after a reuse) and under the same
/// geometry, says the slot still holds it. On a primary, inserts run under
/// the key's insert lock and never overlap (see `replicated`), so no
/// insert can land a lower copy after the GET. On a single server one can
/// (an insert that read the buckets before the first copy existed lands up
/// to two deadlines later, see `dedup`): a CAS on the copy the GET found
/// could then publish a value no reader sees, after a reader had seen the
/// other insert's, so a single server's writes read the key themselves.
/// Kept only for a sighting `locate`'s hinted path would act on (not
/// frozen, plain bytes: a counter's writers read it), and used once.
#[derive(Default)]
pub(crate) struct LastRead {
    /// Whether GETs are remembered: this connection is a replicated
    /// shard's primary (a write has asked for what its last GET found).
    kept: bool,
    key: Vec<u8>,
    /// The copy, and the geometry epoch of the read.
    seen: Option<(Seen, u64)>,
}

impl LastRead {
    /// `key`'s copy `seen`, found as its lowest under geometry `epoch`.
    pub fn remember(&mut self, key: &[u8], seen: Seen, epoch: u64) {
        if seen.slot.is_frozen() {
            self.seen = None;
            return;
        }
        self.key.clear();
        self.key.extend_from_slice(key);
        self.seen = Some((seen, epoch));
    }

    /// The copy of `key` the last GET found, if a CAS posted now under
    /// geometry `epoch` may act on it; forgotten either way. From now on,
    /// GETs are remembered: only a replicated shard's primary asks.
    pub fn take(&mut self, key: &[u8], epoch: u64) -> Option<Seen> {
        self.kept = true;
        let (seen, at) = self.seen.take()?;
        (at == epoch && self.key == key && seen.clock.in_time()).then_some(seen)
    }

    /// Whether a copy of `key` is kept (usable or not).
    pub fn has(&self, key: &[u8]) -> bool {
        self.seen.is_some() && self.key == key
    }

    pub fn clear(&mut self) {
        self.seen = None;
    }
}

impl Client {
    /// A GET found `key`'s copy `seen`; `updatable`: whether as its
    /// lowest, of plain bytes (see `LastRead`), asked only where GETs are
    /// remembered.
    pub(crate) fn found_by_get(
        &mut self,
        key: &[u8],
        seen: Seen,
        updatable: impl FnOnce() -> bool,
    ) {
        if !self.last_read.kept {
            return;
        }
        match self.cache.is_enabled() && updatable() {
            true => self.last_read.remember(key, seen, self.info.geometry.epoch),
            false => self.last_read.clear(),
        }
    }

    /// The copy of `key` the last GET found, if a replicated write's
    /// update posted now may publish over it (see `LastRead`; only the
    /// primary of a replicated shard may ask: `observe_for_put`).
    pub(crate) fn last_read(&mut self, key: &[u8]) -> Option<Seen> {
        self.last_read.take(key, self.info.geometry.epoch)
    }

    /// Whether this client has seen `key`'s copy lately: it has a hint of
    /// it, or kept what a GET of it just found.
    pub(crate) fn has_seen(&self, key: &[u8]) -> bool {
        self.last_read.has(key) || self.cache.get(key).is_some()
    }

    /// The key's hint, if it allows a CAS with no read (`Hint::allows_blind_cas`).
    pub(crate) fn blind_hint(&self, key: &[u8]) -> Option<Hint> {
        self.cache
            .get(key)
            .filter(|h| h.allows_blind_cas(&self.timing))
    }

    /// The key's hint, if a reader's batch posted now may use it: a fresh
    /// one, or, where READs run in the order posted, one past its life
    /// ([`Hint::reread`]; the batch must read the windows before the block).
    pub(crate) fn hint_to_read(&mut self, key: &[u8]) -> Option<Hint> {
        let hint = self.cache.get(key)?;
        if hint.is_fresh(&self.timing) {
            Some(hint)
        } else if self.conn.reads_in_posted_order() {
            Some(hint.reread())
        } else {
            self.cache.forget(key);
            None
        }
    }

    /// The key's hint, if a batch posted now may use it.
    pub(crate) fn fresh_hint(&mut self, key: &[u8]) -> Option<Hint> {
        let hint = self.cache.get(key)?;
        if hint.is_fresh(&self.timing) {
            Some(hint)
        } else {
            self.cache.forget(key);
            None
        }
    }

    /// Remembers that a read saw the key's copy (`seen`); `alone`: whether
    /// it proved no other slot holds the key; `counter`: the value, if the
    /// block is a counter. A hint still fresh for the same slot value is the
    /// same copy seen again.
    pub(crate) fn saw(&mut self, key: &[u8], seen: Seen, alone: Alone, counter: Option<i64>) {
        let Seen { pos, slot, clock } = seen;
        if !self.cache.is_enabled() {
            return;
        }
        if slot.is_frozen() {
            self.cache.forget(key);
            return;
        }
        let timing = self.timing;
        self.cache.update(key, |held| {
            let hint = match held {
                Some(h) if h.pos == pos && h.slot == slot && h.is_fresh(&timing) => {
                    h.confirmed(slot, clock.started(), alone, &timing)
                }
                _ => Hint::seen(pos, slot, clock),
            };
            match counter {
                Some(value) => hint.of_counter(value),
                None => hint,
            }
        });
    }

    /// This client's CAS replaced the copy `old` (its slot's position and
    /// value) with `new`, in a batch timed by `old.clock` that was posted
    /// while a hint for it was fresh (or the read that found it was in
    /// time): the copy lives on.
    pub(crate) fn replaced(&mut self, key: &[u8], old: Seen, new: Slot) {
        let Seen {
            pos,
            slot: old,
            clock,
        } = old;
        if !self.cache.is_enabled() {
            return;
        }
        let timing = self.timing;
        self.cache.update(key, |held| match held {
            Some(h) if h.pos == pos && h.slot == old => {
                h.confirmed(new, clock.started(), Alone::Unknown, &timing)
            }
            _ => Hint::seen(pos, new, clock),
        });
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_hint_settles_only_after_a_later_lone_sighting_and_goes_stale() {
        // Hints live for two deadlines (grace less two): a long deadline, so
        // that the first is still fresh however slow the machine.
        let timing = Timing::new(Duration::from_secs(10));
        let pos = SlotPos {
            bucket: 1,
            index: 2,
        };
        let sighting = timing.start();
        let at = sighting.started();
        let h = Hint::seen(pos, Slot(1), sighting);
        assert!(h.is_fresh(&timing) && !h.allows_blind_cas(&timing));
        // Alone, but too soon after the copy was first seen.
        let h = h.confirmed(
            Slot(2),
            at + Duration::from_millis(1),
            Alone::Proven,
            &timing,
        );
        assert!(!h.is_sole());
        // Later, but another slot might hold the key.
        let later = clock::now() + timing.settle();
        assert!(!h
            .confirmed(Slot(2), later, Alone::Unknown, &timing)
            .is_sole());
        let h = h.confirmed(Slot(3), later, Alone::Proven, &timing);
        assert!(h.is_sole() && h.slot == Slot(3));
        let short = Timing::new(Duration::from_millis(5));
        let old = short.start();
        std::thread::sleep(short.hint_life() + short.deadline());
        let stale = Hint::seen(pos, Slot(1), old);
        assert!(!stale.is_fresh(&short) && !stale.allows_blind_cas(&short));
    }
}
