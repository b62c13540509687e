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
//! taken; a client keeps its sightings across its writes), takes it over
//! by a CAS to the value after it: the holder's last write has landed by
//! then, or it died. A write waits for a lock at most two lives, by time
//! rather than by attempts, so that a dead writer's hold is always taken
//! over whatever the deadline.
//! No server is asked: a lock costs a CAS, and its release travels as
//! another. A hold left by a writer that died delays that key's next
//! insert by at most a life from when the next writer finds it.
//!
//! Keys whose hash picks one word wait for each other; nothing else is
//! shared (see `layout::INSERT_LOCKS`).

use std::time::{Duration, Instant};

use kv_common::layout::{insert_lock_word_offset, INSERT_LOCKS};
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

/// What a client last found in a lock word, and since when it has found
/// that value there (every sighting is a CAS's answer, so a hold found
/// twice at one value has been one hold all along).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sighting {
    pub word: u64,
    pub since: Instant,
}

/// One writer's hold on one key's lock, if it has one.
#[derive(Debug, Clone, Copy, Default)]
pub struct KeyLock {
    held: Option<Hold>,
}

impl KeyLock {
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

    /// The next CAS over primary connection `connection`, from, to, given
    /// the client's last sighting of the word: a free word to the next
    /// value; a hold of this writer's own (taken over this connection: a
    /// connection made anew may reach another region, where the same value
    /// could be another writer's hold), or one found unchanged for a whole
    /// `life`, to the one after (a renewal, or a takeover); any other hold
    /// from the value its release leaves, so that the CAS takes the lock if
    /// it was let go meanwhile, and otherwise shows it still held.
    pub fn next(
        &self,
        seen: Sighting,
        life: Duration,
        now: Instant,
        connection: u64,
    ) -> (u64, u64) {
        if let Some(h) = self.held.filter(|h| h.connection == connection) {
            return (h.word, h.word.wrapping_add(2));
        }
        let word = seen.word;
        let from = match word & 1 == 0 || now.saturating_duration_since(seen.since) >= life {
            true => word,
            false => word.wrapping_add(1),
        };
        (from, from.wrapping_add(1 + (from & 1)))
    }

    /// A CAS of the word from `from` to `to`, posted at `asked`, found
    /// `found` (and so swapped if that is `from`); the hold lets a write
    /// act until `life` less `margin` after `asked`.
    pub fn found(
        &mut self,
        (from, to, found): (u64, u64, u64),
        asked: Instant,
        (life, margin): (Duration, Duration),
        connection: u64,
    ) {
        self.held = (found == from).then(|| Hold {
            word: to,
            until: asked + life.saturating_sub(margin),
            connection,
        });
    }

    /// The release of this writer's hold over primary connection
    /// `connection`: a CAS from, to; none for a hold taken over another
    /// connection (see [`Self::next`]), which lapses.
    pub fn release(&mut self, connection: u64) -> Option<(u64, u64)> {
        let release = self.releasing(connection);
        self.held = None;
        release
    }

    /// What [`Self::release`] would post, the hold kept: for a release
    /// that rides in another batch, made with [`Self::let_go`] once it went.
    pub fn releasing(&self, connection: u64) -> Option<(u64, u64)> {
        let h = self.held.filter(|h| h.connection == connection)?;
        Some((h.word, h.word.wrapping_add(1)))
    }

    /// The hold's release (as [`Self::releasing`] made it) was posted.
    pub fn let_go(&mut self) {
        self.held = None;
    }
}

impl Client {
    /// One CAS of insert lock word `word` (`layout::insert_lock_index`) at
    /// this server, from `from` to `to`; the value it found there.
    pub(crate) fn cas_insert_lock(&mut self, word: u64, from: u64, to: u64) -> Result<u64> {
        self.conn.post(&[self.insert_lock_cas(word, from, to)])?;
        Ok(self.insert_lock_found(word, from, to))
    }

    /// The verb of a CAS of lock word `word` from `from` to `to`; what it
    /// found is [`Self::insert_lock_found`], read before any other CAS.
    pub(crate) fn insert_lock_cas(&self, word: u64, from: u64, to: u64) -> Verb {
        lock_cas(word, (from, to), self.layout.cas)
    }

    /// What the CAS of lock word `word` from `from` to `to`, just done,
    /// found there, remembered as this client's latest sighting.
    pub(crate) fn insert_lock_found(&mut self, word: u64, from: u64, to: u64) -> u64 {
        self.lock_found_at(word, (from, to), self.layout.cas)
    }

    /// The verb of the CAS that lets lock word `word` go, from, to, in the
    /// batch of another CAS and after it (which may then be posted with it
    /// since it has a word of its own: `LocalLayout::release`); once done,
    /// [`Self::insert_lock_released`].
    pub(crate) fn insert_lock_release(&self, word: u64, (from, to): (u64, u64)) -> Verb {
        lock_cas(word, (from, to), self.layout.release)
    }

    /// The release by [`Self::insert_lock_release`] was done: what it
    /// found is remembered as this client's latest sighting.
    pub(crate) fn insert_lock_released(&mut self, word: u64, (from, to): (u64, u64)) {
        self.lock_found_at(word, (from, to), self.layout.release);
    }

    fn lock_found_at(&mut self, word: u64, (from, to): (u64, u64), local: usize) -> u64 {
        let found = read_u64(self.conn.local(), local);
        let now_there = if found == from { to } else { found };
        self.lock_words.saw(word, now_there, Instant::now());
        found
    }

    /// What this client last found in lock word `word`, and since when (a
    /// word it has not looked at: free at 0).
    pub(crate) fn insert_lock_sighting(&self, word: u64) -> Sighting {
        self.lock_words.sighting(word)
    }

    /// How long a hold lasts, and the margin a holder keeps before its end.
    pub(crate) fn insert_lock_life(&self) -> (Duration, Duration) {
        let deadline = self.op_deadline();
        (deadline * LIFE_DEADLINES, deadline * 3)
    }
}

/// A CAS of lock word `word` from, to, its answer landing at `local`.
fn lock_cas(word: u64, (from, to): (u64, u64), local: usize) -> Verb {
    Verb::Cas {
        remote: insert_lock_word_offset(word),
        local,
        expect: from,
        swap: to,
    }
}

/// What a client last found in each lock word, and since when: a first
/// CAS from the right value takes a free lock in one round trip, and a
/// hold's life is counted from its first sighting across this client's
/// writes (each of which gives up waiting after two lives). Kept only once
/// the client has used a lock (at a primary), and forgotten when its
/// connection is made anew: a sighting counts only for the region it was
/// made in.
#[derive(Default)]
pub struct LockWords(Option<Box<[Sighting]>>);

impl LockWords {
    fn saw(&mut self, index: u64, word: u64, now: Instant) {
        let words = self.0.get_or_insert_with(|| {
            let free = Sighting {
                word: 0,
                since: now,
            };
            vec![free; INSERT_LOCKS as usize].into_boxed_slice()
        });
        let seen = &mut words[(index % INSERT_LOCKS) as usize];
        if seen.word != word {
            *seen = Sighting { word, since: now };
        }
    }

    fn sighting(&self, index: u64) -> Sighting {
        match &self.0 {
            Some(words) => words[(index % INSERT_LOCKS) as usize],
            None => Sighting {
                word: 0,
                since: Instant::now(),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIFE: Duration = Duration::from_millis(1000);
    const MARGIN: Duration = Duration::from_millis(150);

    fn seen(word: u64, since: Instant) -> Sighting {
        Sighting { word, since }
    }

    #[test]
    fn a_free_word_is_taken_and_released_each_step_changing_it() {
        let t = Instant::now();
        let mut lock = KeyLock::default();
        assert_eq!(lock.next(seen(6, t), LIFE, t, 1), (6, 7));
        lock.found((6, 7, 6), t, (LIFE, MARGIN), 1);
        assert!(lock.is_held());
        // Renewed by its holder, then let go.
        assert_eq!(lock.next(seen(7, t), LIFE, t, 1), (7, 9));
        assert_eq!(lock.release(1), Some((7, 8)));
        assert!(!lock.is_held());
        assert_eq!(lock.release(1), None);
    }

    #[test]
    fn a_hold_is_asked_for_as_let_go_and_taken_over_after_a_whole_life() {
        let t = Instant::now();
        let mut lock = KeyLock::default();
        assert_eq!(lock.next(seen(11, t), LIFE, t + LIFE / 2, 1), (12, 13));
        assert_eq!(lock.next(seen(11, t), LIFE, t + LIFE - MARGIN, 1), (12, 13));
        assert_eq!(lock.next(seen(11, t), LIFE, t + LIFE, 1), (11, 13));
        lock.found((12, 13, 11), t, (LIFE, MARGIN), 1);
        assert!(!lock.is_held(), "still held by another");
        // Let go meanwhile: the CAS from the released value took it.
        lock.found((12, 13, 12), t, (LIFE, MARGIN), 1);
        assert!(lock.is_held());
        assert_eq!(lock.release(1), Some((13, 14)));
    }

    #[test]
    fn a_release_that_rides_in_another_batch_keeps_the_hold_until_it_went() {
        let t = Instant::now();
        let mut lock = KeyLock::default();
        lock.found((6, 7, 6), t, (LIFE, MARGIN), 1);
        assert_eq!(lock.releasing(1), Some((7, 8)));
        assert!(lock.is_held(), "kept while the release is only made");
        assert_eq!(lock.releasing(2), None, "not over another connection");
        lock.let_go();
        assert!(!lock.is_held());
        assert_eq!(lock.release(1), None, "nothing left to let go");
    }

    #[test]
    fn a_hold_taken_over_another_connection_is_neither_renewed_nor_released() {
        let t = Instant::now();
        let mut lock = KeyLock::default();
        lock.found((6, 7, 6), t, (LIFE, MARGIN), 1);
        // Over connection 2 the word may be another writer's hold at 7:
        // asked for as anyone's, from its release.
        assert_eq!(lock.next(seen(7, t), LIFE, t, 2), (8, 9));
        assert_eq!(lock.release(2), None);
        assert!(!lock.is_held());
    }

    #[test]
    fn a_sighting_counts_from_the_first_time_its_value_was_found() {
        let t = Instant::now();
        let key = 7;
        let mut words = LockWords::default();
        assert_eq!(words.sighting(key).word, 0, "free before any look");
        words.saw(key, 11, t);
        words.saw(key, 11, t + LIFE / 2);
        assert_eq!(words.sighting(key), seen(11, t), "one hold all along");
        words.saw(key, 13, t + LIFE);
        assert_eq!(words.sighting(key), seen(13, t + LIFE), "another hold");
    }

    #[test]
    fn a_hold_lets_its_writer_act_for_its_life_less_the_margin_from_the_ask() {
        let t = Instant::now();
        let mut lock = KeyLock::default();
        lock.found((0, 1, 0), t, (LIFE, MARGIN), 1);
        let h = lock.held.expect("held");
        assert_eq!((h.word, h.until), (1, t + LIFE - MARGIN));
        // A word a hostile client left at the top wraps, and stays odd.
        let lock = KeyLock::default();
        assert_eq!(
            lock.next(seen(u64::MAX, t), LIFE, t + LIFE, 1),
            (u64::MAX, 1)
        );
    }
}
