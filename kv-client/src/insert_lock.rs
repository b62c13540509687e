//! A replicated shard's insert locks, taken one-sidedly at its primary (why
//! inserts and increments need one is in `replicated`).
//!
//! A lock is one word of the primary's header page
//! (`layout::insert_lock_offset`), even while free and odd while held.
//! Every take, takeover and release steps it by CAS, so a word found with
//! one value twice has been one hold all along. A writer takes a free word
//! by a CAS to the next (odd) value and acts on its hold only while the
//! lock's life, less three deadlines, has not passed by its own clock
//! started before it posted that CAS: an insert's CAS is posted within a
//! deadline of its observation and lands within another. A waiter asks
//! again by a CAS from the value the hold's release leaves (so it takes
//! the lock once let go), and one that has found the same odd value for a
//! whole life, counted from when it first found it (after that hold was
//! taken), takes it over by a CAS to the value after it: the holder's last
//! write has landed by then, or it died.
//! No server is asked: a lock costs a CAS, and its release travels as
//! another. A hold left by a writer that died delays that key's next
//! insert by at most a life from when the next writer finds it.
//!
//! Keys whose hash picks one word wait for each other; nothing else is
//! shared (see `layout::INSERT_LOCKS`).

use std::time::{Duration, Instant};

use kv_common::layout::{insert_lock_offset, INSERT_LOCKS};
use kv_common::transport::{read_u64, Verb};

use crate::{Client, Result};

/// A lock's life, in operation deadlines: long enough for a writer to set
/// a shard's backups and commit at its primary (each a few round trips, a
/// lease now and then) with deadlines to spare.
pub const LIFE_DEADLINES: u32 = 20;

/// A hold on a key's lock.
#[derive(Debug, Clone, Copy)]
pub struct Hold {
    /// The word's value while this writer holds it (odd).
    word: u64,
    /// The last moment an observation may start that a write acts on.
    until: Instant,
    /// The primary connection it was taken over (see [`KeyLock::holds`]).
    connection: u64,
}

/// What one writer knows of one key's lock.
#[derive(Debug, Clone, Copy)]
pub struct KeyLock {
    /// The word's value as last found (or guessed), and since when this
    /// writer has found it so.
    seen: (u64, Instant),
    /// This writer's hold, if it has one.
    held: Option<Hold>,
}

impl KeyLock {
    /// Before any look at the word: its value is guessed free at `guess`,
    /// the value this client last found there (the next even value, if
    /// that was a hold: one a writer has not watched is never taken over).
    pub fn new(guess: u64, now: Instant) -> KeyLock {
        KeyLock {
            seen: (guess.wrapping_add(guess & 1), now),
            held: None,
        }
    }

    /// Whether this writer's hold lets it act now: it has not outlived its
    /// margin, and was taken over `primary`'s connection as it is (a
    /// connection made anew may reach a server under another group).
    pub fn holds(&self, primary: &Client) -> bool {
        self.held
            .is_some_and(|h| Instant::now() < h.until && primary.reconnects() == h.connection)
    }

    /// Whether this writer took the lock (and has not let it go).
    pub fn is_held(&self) -> bool {
        self.held.is_some()
    }

    /// The next CAS, from, to: a free word to the next value; a hold of
    /// this writer's own, or one found unchanged for a whole `life` since
    /// `seen`, to the one after (a renewal, or a takeover); any other hold
    /// from the value its release leaves, so that the CAS takes the lock
    /// if it was let go meanwhile, and otherwise shows it still held.
    pub fn next(&self, life: Duration, now: Instant) -> (u64, u64) {
        if let Some(h) = self.held {
            return (h.word, h.word.wrapping_add(2));
        }
        let (word, since) = self.seen;
        let from = match word & 1 == 0 || now.saturating_duration_since(since) >= life {
            true => word,
            false => word.wrapping_add(1),
        };
        (from, from.wrapping_add(1 + (from & 1)))
    }

    /// A CAS of the word from `from` to `to`, posted at `asked`, found
    /// `found` (and so swapped if that is `from`) by `now`; the hold lets a
    /// write act until `life` less `margin` after `asked`.
    pub fn found(
        &mut self,
        (from, to, found): (u64, u64, u64),
        (asked, now): (Instant, Instant),
        (life, margin): (Duration, Duration),
        connection: u64,
    ) {
        if found == from {
            self.held = Some(Hold {
                word: to,
                until: asked + life.saturating_sub(margin),
                connection,
            });
            self.seen = (to, now);
            return;
        }
        // Someone else's, or free at another value than guessed: a hold's
        // life is counted from this first sighting of it, which is after
        // it was taken.
        self.held = None;
        if found != self.seen.0 {
            self.seen = (found, now);
        }
    }

    /// The release of this writer's hold: a CAS from, to.
    pub fn release(&mut self) -> Option<(u64, u64)> {
        let h = self.held.take()?;
        Some((h.word, h.word.wrapping_add(1)))
    }
}

impl Client {
    /// One CAS of `key`'s insert lock word at this server, from `from` to
    /// `to`; the word it found there.
    pub(crate) fn cas_insert_lock(&mut self, key: &[u8], from: u64, to: u64) -> Result<u64> {
        let verb = Verb::Cas {
            remote: insert_lock_offset(key),
            local: self.layout.cas,
            expect: from,
            swap: to,
        };
        self.conn.post(&[verb])?;
        let found = read_u64(self.conn.local(), self.layout.cas);
        self.lock_words
            .saw(key, if found == from { to } else { found });
        Ok(found)
    }

    /// What this client last found in `key`'s lock word (0 before it has
    /// looked): a writer's first guess.
    pub(crate) fn insert_lock_guess(&self, key: &[u8]) -> u64 {
        self.lock_words.guess(key)
    }

    /// How long a hold lasts, and the margin a holder keeps before its end.
    pub(crate) fn insert_lock_life(&self) -> (Duration, Duration) {
        let deadline = self.op_deadline();
        (deadline * LIFE_DEADLINES, deadline * 3)
    }
}

/// The values a client last found in the lock words, one per word: a
/// first CAS from the right value takes a free lock in one round trip.
/// Kept only once the client has used a lock (at a primary).
#[derive(Default)]
pub struct LockWords(Option<Box<[u64]>>);

impl LockWords {
    fn index(key: &[u8]) -> usize {
        kv_common::layout::insert_lock_index(key) as usize
    }

    fn saw(&mut self, key: &[u8], word: u64) {
        let words = self
            .0
            .get_or_insert_with(|| vec![0; INSERT_LOCKS as usize].into_boxed_slice());
        words[Self::index(key)] = word;
    }

    fn guess(&self, key: &[u8]) -> u64 {
        self.0.as_ref().map_or(0, |words| words[Self::index(key)])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIFE: Duration = Duration::from_millis(1000);
    const MARGIN: Duration = Duration::from_millis(150);

    #[test]
    fn a_free_word_is_taken_and_released_each_step_changing_it() {
        let t = Instant::now();
        let mut lock = KeyLock::new(6, t);
        assert_eq!(lock.next(LIFE, t), (6, 7));
        lock.found((6, 7, 6), (t, t), (LIFE, MARGIN), 1);
        assert!(lock.is_held());
        // Renewed by its holder, then let go.
        assert_eq!(lock.next(LIFE, t), (7, 9));
        assert_eq!(lock.release(), Some((7, 8)));
        assert!(!lock.is_held());
        assert_eq!(lock.release(), None);
    }

    #[test]
    fn a_guess_that_was_a_hold_is_never_taken_over_unwatched() {
        let t = Instant::now();
        // Last found held at 5: guessed released at 6, not taken over.
        assert_eq!(KeyLock::new(5, t).next(LIFE, t), (6, 7));
    }

    #[test]
    fn a_hold_is_taken_over_only_after_a_whole_life_unchanged() {
        let t = Instant::now();
        let mut lock = KeyLock::new(0, t);
        // Found held at 11 (by another writer): asked again as let go.
        lock.found((0, 1, 11), (t, t), (LIFE, MARGIN), 1);
        assert!(!lock.is_held());
        assert_eq!(lock.next(LIFE, t + LIFE / 2), (12, 13));
        // Found at 11 again: still counted from the first sighting.
        let half = t + LIFE / 2;
        lock.found((12, 13, 11), (half, half), (LIFE, MARGIN), 1);
        assert_eq!(lock.next(LIFE, t + LIFE - MARGIN), (12, 13));
        assert_eq!(lock.next(LIFE, t + LIFE), (11, 13));
        // Changed to another hold (renewed, or taken over): counted anew.
        lock.found((11, 13, 15), (t + LIFE, t + LIFE), (LIFE, MARGIN), 1);
        assert_eq!(lock.next(LIFE, t + LIFE * 3 / 2), (16, 17));
        assert_eq!(lock.next(LIFE, t + LIFE * 2), (15, 17));
        // Let go meanwhile: the CAS from the released value took it.
        let later = t + LIFE * 2;
        lock.found((16, 17, 16), (later, later), (LIFE, MARGIN), 1);
        assert!(lock.is_held());
        assert_eq!(lock.release(), Some((17, 18)));
    }

    #[test]
    fn a_hold_lets_its_writer_act_for_its_life_less_the_margin_from_the_ask() {
        let t = Instant::now();
        let mut lock = KeyLock::new(0, t);
        lock.found((0, 1, 0), (t, t + LIFE / 4), (LIFE, MARGIN), 1);
        let h = lock.held.expect("held");
        assert_eq!((h.word, h.until), (1, t + LIFE - MARGIN));
        // A word a hostile client left at the top wraps, and stays odd.
        let mut lock = KeyLock::new(0, t);
        lock.found((0, 1, u64::MAX), (t, t), (LIFE, MARGIN), 1);
        assert_eq!(lock.next(LIFE, t + LIFE), (u64::MAX, 1));
    }
}
