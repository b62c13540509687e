//! A settled counter's lock and seal: how a writer unlinks a counter (a
//! PUT over it, a DELETE), and how clients that wait on a dead writer's
//! lock take it over (see the `counter` module doc for why).

use kv_common::layout::{
    counter_sealed, counter_settled, counter_words, CounterState, Slot, COUNTER_ABANDONED,
    COUNTER_GENERATION, COUNTER_LOCKED, COUNTER_SEAL,
};
use kv_common::transport::{read_u64, Verb};

use crate::clock::{self, Instant, OpClock};
use crate::fault_point;
use crate::hint::Seen;
use crate::index::Kind;
use crate::{Client, Result};

/// A counter lock a client waits on, and since when it has seen it
/// unchanged.
#[derive(Debug, Clone, Copy)]
pub struct LockWatch {
    /// The state word's offset, the state word, the slot that links it.
    lock: (u64, u64, Slot),
    since: Instant,
}

impl Client {
    /// Unlinks a copy of `key` that a writer found (`copy`, holding
    /// `kind`) by a CAS of its slot to `to`: a settled counter under its
    /// lock, a pending one given up first (so that it cannot settle
    /// meanwhile and then be unlinked unsealed). False if that could not be
    /// done: read again.
    pub(crate) fn unlink(&mut self, key: &[u8], copy: Seen, kind: Kind, to: Slot) -> Result<bool> {
        if !copy.clock.in_time() {
            return Ok(false);
        }
        match kind {
            Kind::Counter {
                state: CounterState::Settled,
                value,
                state_word,
            } => self.unlink_settled(key, copy, (value, state_word), to),
            Kind::Counter {
                state: CounterState::Pending,
                ..
            } => self.unlink_unsettled(key, copy, to),
            _ => self.cas(copy.pos, copy.slot, to),
        }
    }

    /// Unlinks a counter copy that has not settled, found by the read
    /// timed by `clock`, by a CAS of its slot to `to`: given up through its
    /// state first, so that its creator's settling CAS and this one cannot
    /// both succeed. False if it settled meanwhile (it is then a copy like
    /// any other), its slot changed, or the read is too old to act on.
    pub(crate) fn unlink_unsettled(&mut self, key: &[u8], copy: Seen, to: Slot) -> Result<bool> {
        let Seen { pos, slot, clock } = copy;
        if !clock.in_time() {
            return Ok(false);
        }
        let state_at = word_offsets(key, slot).0;
        if counter_settled(self.set_state(state_at, COUNTER_ABANDONED)?) {
            return Ok(false);
        }
        Ok(clock.in_time() && self.cas(pos, slot, to)?)
    }

    /// Unlinks the settled counter that the read timed by `clock` found at
    /// `pos` as `slot`, holding `value` under the state word `state`, by a
    /// CAS of the slot to `to`, under the counter's lock: lock it (its
    /// state word), seal its value word, CAS the slot. Each step is taken
    /// only within the read's deadline, so a lock held longer is a dead (or
    /// hopelessly late) writer's (`wait_on_lock`). If the slot changed (a
    /// resize froze it), the seal and the lock are lifted. False if the
    /// counter was not unlinked: read again.
    fn unlink_settled(
        &mut self,
        key: &[u8],
        copy: Seen,
        (value, state): (i64, u64),
        to: Slot,
    ) -> Result<bool> {
        let Seen { pos, slot, clock } = copy;
        let (state_at, value_at) = word_offsets(key, slot);
        if state & COUNTER_LOCKED != 0 {
            self.wait_on_lock(key, slot, state, clock)?;
            return Ok(false);
        }
        if !clock.in_time() {
            return Ok(false);
        }
        let locked = state | COUNTER_LOCKED;
        let found = self.cas_word(state_at, state, locked)?;
        if found != state {
            // Another writer's lock, or one let go since the read.
            if found & COUNTER_LOCKED != 0 {
                self.wait_on_lock(key, slot, found, clock)?;
            }
            return Ok(false);
        }
        fault_point("counter-locked");
        // Letting go is safe at any time while nothing is sealed.
        let unlock = next_generation(locked);
        if !clock.in_time() {
            self.cas_word(state_at, locked, unlock)?;
            return Ok(false);
        }
        // The seal: a CAS from the value read, or if increments changed it
        // since, an add of the top bit, which none can make fail.
        let read = value as u64;
        let found = self.cas_word(value_at, read, read ^ COUNTER_SEAL)?;
        let open = if found == read {
            read
        } else if counter_sealed(found) || !clock.in_time() {
            // Out of time with nothing sealed; or a seal without its lock,
            // which only a writer far past its deadline leaves (waiters
            // lift it).
            self.cas_word(state_at, locked, unlock)?;
            return Ok(false);
        } else {
            let open = self.fetch_add_word(value_at, COUNTER_SEAL)?;
            if counter_sealed(open) {
                // Such a seal came in between: the add lifted it. Put it
                // back and let go.
                self.fetch_add_word(value_at, COUNTER_SEAL)?;
                self.cas_word(state_at, locked, unlock)?;
                return Ok(false);
            }
            open
        };
        fault_point("counter-sealed");
        if !clock.in_time() {
            return Ok(false);
        }
        if self.cas(pos, slot, to)? {
            return Ok(true);
        }
        // The slot changed under the lock: a resize froze it. The unseal
        // fails while an increment that found the seal is still to be
        // taken back (within its deadline): try until this read's.
        while clock.in_time() {
            if self.cas_word(value_at, open ^ COUNTER_SEAL, open)? == open ^ COUNTER_SEAL {
                self.cas_word(state_at, locked, unlock)?;
                break;
            }
            std::thread::yield_now();
        }
        Ok(false)
    }

    /// Waits a little for the writer that holds the lock on the counter
    /// `slot` links (its state word read as `state` by the read timed by
    /// `clock`) to unlink it or let it go, which takes that writer a round
    /// trip or two. A writer acts only within a deadline of its read, so a
    /// lock seen unchanged for `Timing::lock_timeout` (the generation steps
    /// on at every unlock and takeover) is a dead or hopelessly late
    /// writer's: this client takes it over (stepping the generation, so
    /// that only one client does), lifts the seal if there is one, and
    /// unlocks it. A seal left without a lock is lifted the same way.
    pub(crate) fn wait_on_lock(
        &mut self,
        key: &[u8],
        slot: Slot,
        state: u64,
        clock: OpClock,
    ) -> Result<()> {
        let (state_at, value_at) = word_offsets(key, slot);
        let lock = (state_at, state, slot.thawed());
        let since = match self.lock_watch {
            Some(watch) if watch.lock == lock => watch.since,
            _ => {
                let since = clock::now();
                self.lock_watch = Some(LockWatch { lock, since });
                since
            }
        };
        let waited = clock::since(since);
        if waited >= self.timing.lock_timeout() && clock.in_time() {
            self.lock_watch = None;
            let taken = (state | COUNTER_LOCKED).wrapping_add(COUNTER_GENERATION);
            if self.cas_word(state_at, state, taken)? != state {
                return Ok(());
            }
            let word = self.fetch_add_word(value_at, 0)?;
            let open = !counter_sealed(word)
                || (clock.in_time() && self.cas_word(value_at, word, word ^ COUNTER_SEAL)? == word);
            if open {
                self.cas_word(state_at, taken, next_generation(taken))?;
            }
            return Ok(());
        }
        // A lock is normally held for a round trip or two; a long wait
        // polls more slowly (and so within `max_attempts`).
        let settle = self.timing.settle();
        std::thread::sleep((waited / 4).clamp(settle / 1000, self.timing.deadline() / 2));
        Ok(())
    }

    /// CASes the word at `remote` from `expect` to `swap`; returns what it
    /// held.
    pub(super) fn cas_word(&mut self, remote: u64, expect: u64, swap: u64) -> Result<u64> {
        self.conn.post(&[Verb::Cas {
            remote,
            local: self.layout.cas,
            expect,
            swap,
        }])?;
        Ok(read_u64(self.conn.local(), self.layout.cas))
    }

    /// Adds `add` to the word at `remote`; returns what it held.
    pub(super) fn fetch_add_word(&mut self, remote: u64, add: u64) -> Result<u64> {
        self.conn.post(&[Verb::FetchAdd {
            remote,
            local: self.layout.cas,
            add,
        }])?;
        Ok(read_u64(self.conn.local(), self.layout.cas))
    }
}

/// Where the counter block `slot` links keeps its state and value words.
pub(super) fn word_offsets(key: &[u8], slot: Slot) -> (u64, u64) {
    let (state, value) = counter_words(key.len());
    let at = slot.thawed().offset();
    (at + state as u64, at + value as u64)
}

/// A locked settled state word, unlocked in the next generation.
fn next_generation(locked: u64) -> u64 {
    (locked & !COUNTER_LOCKED).wrapping_add(COUNTER_GENERATION)
}
