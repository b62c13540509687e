//! A replicated write's two steps at its shard's primary (see
//! `replicated` for why they are split): observe the key as it is, then,
//! once the backups have the new value, commit it there by a CAS that
//! succeeds only if the key is still as observed.

use kv_common::layout::{KeyHash, Slot};
use kv_common::transport::Verb;
use smallvec::SmallVec;

use crate::clock::OpClock;
use crate::corrupt::CorruptSlot;
use crate::geometry::Ask;
use crate::get::value_bytes;
use crate::hint::{Hint, Seen};
use crate::index::Copies;
use crate::locate::{Located, Need};
use crate::{Client, Error, Result, Step};

/// The key at the primary, as a replicated write saw it before it wrote
/// the backups.
pub(crate) struct Observed {
    seen: Sight,
    /// The geometry the observation was made under: a commit under another
    /// finds the key elsewhere, so it observes again.
    epoch: u64,
    /// The value readers see (when asked for, and the key is there).
    pub value: Option<Vec<u8>>,
}

enum Sight {
    /// A fresh, sole hint: the slot as last seen, no read at all.
    Hinted(Hint),
    /// The copies a read found, and its clock.
    Found { copies: Copies, clock: OpClock },
    /// No copy a reader sees, as a read of the key's windows found (still
    /// in the local buffer: `Client::slots`).
    Absent { kh: KeyHash, clock: OpClock },
}

/// A key's windows, read with an insert lock's CAS
/// ([`Client::lock_with_windows`]).
pub(crate) struct WindowsRead {
    kh: KeyHash,
    clock: OpClock,
    /// The geometry they were read under.
    epoch: u64,
}

/// How a commit ended.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Commit {
    Done,
    /// The key changed since it was observed (or the observation is too old
    /// to act on): nothing was published; observe again.
    Changed,
}

impl Observed {
    /// No copy of the key a reader would see.
    pub fn is_absent(&self) -> bool {
        match &self.seen {
            Sight::Absent { .. } => true,
            Sight::Found { copies, .. } => copies.visible().is_none(),
            Sight::Hinted(_) => false,
        }
    }
}

impl Client {
    /// Observes `key`, as much of it as `need` says (`Need::Value`: the
    /// value readers see too, so no blind hint). `inserting`: the write
    /// would insert an absent key, so an absent key whose buckets are full
    /// has the index grown first. Read-only: redone across resizes and a
    /// lost connection like any read.
    pub(crate) fn observe(&mut self, key: &[u8], need: Need, inserting: bool) -> Result<Observed> {
        crate::check_key(key)?;
        self.run(|c| c.observe_once(key, (need, inserting)))
    }

    /// As [`Self::observe`], for a PUT at a replicated shard's primary:
    /// what a GET of the key just found stands for the observation, while
    /// its read is in time (`hint::LastRead`, which says why only there).
    pub(crate) fn observe_for_put(&mut self, key: &[u8]) -> Result<Observed> {
        crate::check_key(key)?;
        match self.last_read(key) {
            // What a hinted `locate` would find, read by the GET.
            Some(Seen { pos, slot, clock }) => Ok(Observed {
                seen: Sight::Found {
                    copies: Copies::known(pos, slot),
                    clock,
                },
                epoch: self.info.geometry.epoch,
                value: None,
            }),
            None => self.observe(key, Need::Lowest, true),
        }
    }

    fn observe_once(
        &mut self,
        key: &[u8],
        (need, inserting): (Need, bool),
    ) -> Result<Step<Observed>> {
        let epoch = self.info.geometry.epoch;
        if need != Need::Value {
            if let Some(hint) = self.blind_hint(key) {
                let seen = Sight::Hinted(hint);
                return Ok(Step::Done(Observed {
                    seen,
                    epoch,
                    value: None,
                }));
            }
        }
        let kh = KeyHash::new(key, self.info.geometry.bucket_count);
        let mut corrupt = CorruptSlot::default();
        for _ in 0..self.options.max_attempts {
            // Retries may outlast a read lease (see `read_lease`).
            self.keep_read_lease()?;
            match self.locate(key, &kh, None, need)? {
                Located::Retry(suspect) => corrupt.saw(key, suspect)?,
                located => {
                    let observation =
                        self.observation((key, kh), located, epoch, (need, inserting));
                    return Ok(observation);
                }
            }
        }
        Err(Error::Contended(self.options.max_attempts))
    }

    /// The first step of an observation made under insert lock word
    /// `word`: a CAS of the word from, to, in the batch that reads the
    /// key's windows, before the READs. They see memory after it
    /// (read-after-atomic order on one queue pair, see `dedup`; nothing
    /// here checks it, so the lock's exclusion rests on it), so once the
    /// CAS took the lock, what they show was there under it. The value the
    /// CAS found, and the windows for [`Self::observed_in`].
    pub(crate) fn lock_with_windows(
        &mut self,
        key: &[u8],
        (word, from, to): (u64, u64, u64),
    ) -> Result<(u64, WindowsRead)> {
        crate::check_key(key)?;
        self.keep_read_lease()?;
        // A counter lock seen by an earlier call may be let go since (as
        // `run` forgets at each operation's start).
        self.lock_watch = None;
        let epoch = self.info.geometry.epoch;
        let kh = KeyHash::new(key, self.info.geometry.bucket_count);
        let clock = self.read_windows(&kh, Some(self.insert_lock_cas(word, from, to)))?;
        let found = self.insert_lock_found(word, from, to);
        Ok((found, WindowsRead { kh, clock, epoch }))
    }

    /// The observation the windows `read` by [`Self::lock_with_windows`]
    /// make (they are still in the local buffer: no other batch came
    /// between); none where the key must be observed again (a resize,
    /// reads too slow or a block that failed validation, an index too full
    /// to insert into).
    pub(crate) fn observed_in(
        &mut self,
        key: &[u8],
        read: WindowsRead,
        (need, inserting): (Need, bool),
    ) -> Result<Option<Observed>> {
        let located = self.locate_in_windows(key, &read.kh, (read.clock, need))?;
        Ok(
            match self.observation((key, read.kh), located, read.epoch, (need, inserting)) {
                Step::Done(observed) => Some(observed),
                Step::Moved | Step::Full(_) => None,
            },
        )
    }

    /// The observation `located` makes: for `Need::Value`, the value
    /// readers see; `inserting`, an absent key whose buckets are full has
    /// the index grown first, before any copy is written, not after the
    /// backups have it. Moved for a block that failed validation too.
    fn observation(
        &self,
        (key, kh): (&[u8], KeyHash),
        located: Located,
        epoch: u64,
        (need, inserting): (Need, bool),
    ) -> Step<Observed> {
        let (seen, value) = match located {
            Located::Found { copies, clock } => {
                let value = (copies.value.clone())
                    .filter(|_| need == Need::Value)
                    .map(|value| value_bytes(self.conn.local(), value));
                (Sight::Found { copies, clock }, value)
            }
            Located::Absent { clock } => {
                if inserting && KeyHash::insert_choice(&self.slots()).is_none() {
                    return Step::Full(key.to_vec());
                }
                (Sight::Absent { kh, clock }, None)
            }
            Located::Retry(_) | Located::Moved => return Step::Moved,
        };
        Step::Done(Observed { seen, epoch, value })
    }

    /// Publishes `value` (None: removes the key) over exactly what
    /// `observed` saw. `then`, another word's CAS (the key's insert lock
    /// let go), is taken where it rides in the batch of the publishing CAS,
    /// after it: a value's CAS of one copy, or an insert's. Nothing is
    /// redone here: once a CAS may have been posted, a lost connection is
    /// an unknown outcome.
    pub(crate) fn commit(
        &mut self,
        key: &[u8],
        value: Option<&[u8]>,
        observed: &Observed,
        then: &mut Option<Verb>,
    ) -> Result<Commit> {
        let block = match value {
            Some(value) if observed.epoch == self.info.geometry.epoch => {
                Some(self.block_for(key, value)?)
            }
            _ => None,
        };
        self.commit_made(key, block, observed, then)
    }

    /// The block of `key` and `value`, written to this client's buffer for
    /// [`Self::commit_made`]: its slot, and its WRITE. Taking it may cost
    /// control calls (a lease given back, another taken), which fail
    /// before anything is published; publishing never calls.
    pub(crate) fn block_for(&mut self, key: &[u8], value: &[u8]) -> Result<(Slot, Verb)> {
        let (_, new, write) = self.new_block(key, value)?;
        Ok((new, write))
    }

    /// As [`Self::commit`], with the value's block made (None: removes the
    /// key). The buffer holds the block still: no other verb came between.
    pub(crate) fn commit_made(
        &mut self,
        key: &[u8],
        block: Option<(Slot, Verb)>,
        observed: &Observed,
        then: &mut Option<Verb>,
    ) -> Result<Commit> {
        // Leasing the block may have taught this client a new geometry.
        if observed.epoch != self.info.geometry.epoch {
            return Ok(Commit::Changed);
        }
        let step = match block {
            Some(block) => self.commit_value(key, block, observed, then)?,
            None => Step::Done(self.commit_removal(key, observed)?),
        };
        Ok(match step {
            Step::Done(true) => Commit::Done,
            Step::Done(false) | Step::Moved => Commit::Changed,
            Step::Full(key) => {
                // The key's buckets are full: the index must grow before
                // it can go in (a declined resize only means room was made
                // meanwhile).
                self.follow_geometry(Ask::Resize {
                    full_key: Some(&key),
                })?;
                Commit::Changed
            }
        })
    }

    fn commit_value(
        &mut self,
        key: &[u8],
        (new, write): (Slot, Verb),
        observed: &Observed,
        then: &mut Option<Verb>,
    ) -> Result<Step<bool>> {
        match &observed.seen {
            Sight::Hinted(hint) => {
                if !hint.allows_blind_cas(&self.timing) {
                    return Ok(Step::Done(false));
                }
                self.update_blind(key, (hint.pos, hint.slot), (write, then), new)
                    .map(Step::Done)
            }
            Sight::Found { copies, clock } => match copies.only_bytes() {
                // One byte copy: `update` would only CAS it, so the block's
                // WRITE goes with the CAS (and `then` after it).
                Some(copy) if clock.in_time() => self
                    .update_blind(key, copy, (write, then), new)
                    .map(Step::Done),
                Some(_) => Ok(Step::Done(false)),
                None => {
                    self.conn.post(&[write])?;
                    self.update(key, copies, new, *clock).map(Step::Done)
                }
            },
            // The block's WRITE goes in the insert's batch, before its CAS.
            Sight::Absent { kh, clock } => Ok(
                match self.insert(key, kh, (new, Some(write), then), *clock)? {
                    Some(Step::Done(())) => Step::Done(true),
                    Some(Step::Full(key)) => Step::Full(key),
                    Some(Step::Moved) => Step::Moved,
                    None => Step::Done(false),
                },
            ),
        }
    }

    /// Removes every copy readers see, as observed; true if done (or there
    /// was none).
    fn commit_removal(&mut self, key: &[u8], observed: &Observed) -> Result<bool> {
        self.cache.forget(key);
        match &observed.seen {
            Sight::Hinted(hint) => {
                if !hint.allows_blind_cas(&self.timing) {
                    return Ok(false);
                }
                self.cas(hint.pos, hint.slot, Slot::EMPTY)
            }
            Sight::Found { copies, clock } => {
                let readable: SmallVec<[usize; 2]> = (0..copies.slots.len())
                    .filter(|&i| copies.kinds[i].is_readable())
                    .collect();
                let Some((&lowest, extra)) = readable.split_first() else {
                    return Ok(true);
                };
                let (copy, kind) = (copies.slots[lowest], copies.kinds[lowest]);
                Ok(
                    self.remove_duplicates(key, copies, extra.iter().copied(), *clock)?
                        && self.unlink(key, Seen::new(copy, *clock), kind, Slot::EMPTY)?,
                )
            }
            Sight::Absent { .. } => Ok(true),
        }
    }
}
