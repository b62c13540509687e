//! Writes to a replicated shard: a primary, which readers read, and
//! backups, each a region of its own on another server. A write returns
//! once every copy has it.
//!
//! **The write.** A writer
//! 1. *observes* the key at the primary: the slot that links the copy
//!    readers see (a fresh, sole hint counts: no read at all; so does what
//!    a GET of the key found just before, while its read is in time, see
//!    `hint::LastRead`), or that there is none;
//! 2. *sets* the key on every backup (a PUT or DELETE there, redone as
//!    often as it takes; they run in steps, every backup's started
//!    before any is waited for: `stepped_put`);
//! 3. *commits* at the primary by a CAS from exactly what it observed
//!    (`Client::commit`): the slot it saw, or, for a key that was absent,
//!    an empty slot, under the key's *insert lock* (below). If the CAS
//!    fails, the key changed: the writer starts again from 1.
//!
//! A PUT of a key the primary has not seen lately, from a client whose
//! such PUTs were lately inserts (a load), overlaps these steps where that
//! is safe: it asks for the lock
//! in its first observation; its backups' blocks are written and their
//! windows read while it observes (`Group::begin_early` argues when those
//! reads may be acted on); and the lock is let go in the batch of the
//! commit's CAS. A plain insert then waits three times.
//!
//! **Why every copy ends alike.** Call a write *committed* when its CAS
//! succeeds; commits of one key follow each other at the primary. Take two
//! in a row, W then W'. W' observed the slot W's CAS installed (or W's
//! deletion left empty), so W' observed after W committed, and W' sets
//! the backups after it observed: W's sets all happened before W's commit,
//! so they are over before any of W''s begins (W' may read a backup
//! earlier, and then acts on that read only as `Group::begin_early`
//! argues). Each backup therefore
//! receives the committed writes in commit order, and after the last of
//! them holds what the primary holds. (No ABA: a slot value names a block
//! that is not reused before a grace period, and the CAS is posted within
//! the deadline of the read or the life of the hint, as for any update;
//! see `hint`.)
//!
//! Sets of writes that do not commit (their CAS failed, and they start
//! again) may land on a backup after a later commit's: the backup then
//! differs from the primary until that writer's next round sets the
//! backups again, or, if its client died, until the key's next committed
//! write. Such a value is of a write still in flight, or whose outcome its
//! caller could not learn: every failure after a backup was touched is
//! [`Error::OutcomeUnknown`] (but an increment's, once its backups are
//! levelled, see below). So a backup holds, for every key, the last
//! committed write or one in flight after it, never an older one: what a
//! failover needs, since a backup promoted holds every acknowledged write
//! (reads go to the primary, which has nothing the backups lack). Two
//! backups may still disagree (two writers' sets reaching them in
//! opposite orders), so a failover marks the backups it keeps beside the
//! promoted one unlevelled until the new primary's member has levelled
//! them (see kv-cluster's `placement::failover`, kv-server's `level`).
//!
//! **Why inserts need a lock.** A key that is absent has no slot to CAS
//! from: two writers that both found it absent insert into two empty slots
//! and both succeed; the lowest copy wins at the primary (see `dedup`),
//! while the backups keep whichever set came last. So a writer that finds
//! the key absent first takes the key's insert lock at the primary (a word
//! of its region, taken by CAS: see `insert_lock`), then observes again
//! (in the CAS's own batch, its READs after it: `lock_with_windows`; a
//! PUT of a key the primary has not seen lately asks for the lock in its
//! first observation, the key then likely absent), and
//! commits its insert only while the lock, by its own clock started
//! before it posted that CAS, has three deadlines of its life left.
//! Inserts of one key then never overlap, and the observation "absent" is
//! as good as a slot: nobody else can fill it. A hold found unchanged for
//! a whole life (20 operation deadlines) is taken over, so a writer that
//! died holding it delays that key's next insert by at most that long.
//!
//! **Counters** are plain values here, the decimal text of the number
//! (what a GET of a counter returns anyway): an increment observes the
//! value and commits the sum, through the same steps. A FETCH-AND-ADD on
//! each copy could not be: one applied on a backup and not on the primary
//! would leave them apart for good. But a sum set on a backup by an
//! increment that then dies is computed from an older state; were another
//! increment to commit meanwhile, the backup would hold a value without
//! it. So increments, too, run under the key's lock (taken with their
//! first observation, since they always need it): none commits while
//! another is between its observation and its commit, and a dead one's
//! sum is overwritten by the next write (it stays an increment whose
//! outcome is unknown, counted once or not at all). A sum is set on each
//! backup by a CAS from what a read made while the lock still holds found
//! there, not by a PUT that reads again for as long as it takes: a
//! stalled increment's sum could otherwise land after a later
//! increment's, older than what the primary acknowledged (see
//! `Group::set_backups_locked`). And only over the value the sum was
//! computed from (`SumGuard`): PUTs and DELETEs of a present key take no
//! lock, so one may set a backup and commit while an increment holds it;
//! an increment that finds a backup holding anything else observes again
//! (such a write may have committed), and if it finds one apart again,
//! levels the backups with the primary first. An increment that fails
//! after setting the backups brings them back to the primary's value
//! before it returns (`level`, under the key's lock); if no commit of it
//! took effect (a PUT made the key plain meanwhile, or every commit lost
//! its race) it is then known not to have taken effect. What this leaves
//! open: a failover's levelling (`level_copies`, without the lock) sets a
//! present value by PUTs, which a stalled client could land after a later
//! increment.

use std::borrow::Cow;
use std::time::{Duration, Instant};

use kv_common::layout::{insert_lock_index, COUNTER_MAX};
use smallvec::SmallVec;

use crate::insert_lock::KeyLock;
use crate::locate::Need;
use crate::primary::{Commit, Observed};
use crate::stepped_put::{Expect, First, Progress, SteppedPut};
use crate::{Client, Error, Result};

/// CASes a writer posts in a row on an insert lock word it keeps finding
/// free at another value than it asked from.
const FREE_RETRIES: usize = 4;
/// How long a writer waits before asking again for an insert lock that
/// another writer holds.
const LOCK_WAIT: Duration = Duration::from_micros(200);

/// A replicated shard's connections: to its primary and to each backup.
pub(crate) struct Group<'c> {
    pub primary: &'c mut Client,
    pub backups: &'c mut [Client],
    /// The write under way has posted a commit at the primary (or a
    /// levelling's commit over the primary's own value) not known to have
    /// lost its race: one that may have taken effect.
    pub commit_posted: bool,
    /// The last write failed as [`Error::OutcomeUnknown`] because a copy
    /// was cut off (its connection lost or refused: its server went, or
    /// the group changed) once some backup may have been set, but before
    /// any commit was posted: no reader can have seen its value, which
    /// only a backup promoted by a failover could show (see
    /// `ClusterClient::on_group`).
    pub cut_before_commit: bool,
}

impl<'c> Group<'c> {
    pub fn new(primary: &'c mut Client, backups: &'c mut [Client]) -> Self {
        Group {
            primary,
            backups,
            commit_posted: false,
            cut_before_commit: false,
        }
    }
}

/// What a write does to its key.
#[derive(Clone, Copy)]
enum Change<'v> {
    Put(&'v [u8]),
    Delete,
    Add(i64),
}

/// What a committed write did.
enum Done {
    /// Stored; an increment's new value.
    Stored(Option<i64>),
    /// A delete: whether the key was there.
    Deleted(bool),
}

/// Brings each of `backups`, copies of a replicated shard connected under
/// its group epoch, to what `primary` holds for `key`: the primary's value
/// set on them and committed again over itself at the primary (so that no
/// commit came between its observation and the sets), or, for a key the
/// primary lacks, removed from them under the key's insert lock. Only
/// these copies are set: a stale set that lands after a later commit's,
/// from a levelling that then stops, is harmless on a backup nobody may
/// promote before a levelling of it succeeded, and would not be on one
/// that may (kv-server's `level`).
///
/// # Errors
///
/// As a write to the shard: the first error of a copy.
pub fn level_copies(primary: &mut Client, backups: &mut [Client], key: &[u8]) -> Result<()> {
    Group::new(primary, backups).level_copies(key)
}

impl Group<'_> {
    pub fn put(&mut self, key: &[u8], value: &[u8]) -> Result<()> {
        let max = self.primary.max_value();
        if value.len() > max {
            return Err(Error::ValueTooLarge {
                len: value.len(),
                max,
            });
        }
        self.write(key, Change::Put(value)).map(drop)
    }

    pub fn delete(&mut self, key: &[u8]) -> Result<bool> {
        match self.write(key, Change::Delete)? {
            Done::Deleted(was) => Ok(was),
            Done::Stored(_) => Err(Error::Internal("a delete stored a value".into())),
        }
    }

    pub fn incr(&mut self, key: &[u8], delta: i64) -> Result<i64> {
        match self.write(key, Change::Add(delta))? {
            Done::Stored(Some(now)) => Ok(now),
            _ => Err(Error::Internal("an increment stored no number".into())),
        }
    }

    /// Brings every copy of `key` to what the primary holds (see `level`).
    fn level_copies(&mut self, key: &[u8]) -> Result<()> {
        crate::check_key(key)?;
        let mut lock = KeyLock::default();
        let done = self.level(key, &mut lock, false);
        self.release(key, &mut lock);
        done
    }

    /// Runs the write's rounds; a failure once a backup may have it is an
    /// unknown outcome. The insert lock is let go however it ends.
    fn write(&mut self, key: &[u8], change: Change) -> Result<Done> {
        crate::check_key(key)?;
        let mut touched = false;
        let mut lock = KeyLock::default();
        self.commit_posted = false;
        self.cut_before_commit = false;
        let ran = self.rounds(key, change, &mut touched, &mut lock);
        // Every commit lost its race (not an error out of one).
        let ran_out = matches!(ran, Ok(None));
        let attempts = self.primary.options.max_attempts;
        let mut done = ran.and_then(|done| done.ok_or(Error::Contended(attempts)));
        self.cut_before_commit = touched
            && !self.commit_posted
            && done.as_ref().is_err_and(|e| {
                matches!(e, Error::Unreachable(_) | Error::Refused(_)) || e.is_connection_lost()
            });
        // Known not to have taken effect, the copies being level again.
        let mut unapplied = false;
        if let (Err(e), Change::Add(_), true) = (&done, change, touched) {
            // The backups may hold a sum the primary will never have.
            match self.level(key, &mut lock, true) {
                // No commit of it succeeded (the key stopped being a
                // counter, the sum left its range, or every commit lost
                // its race), and its sums, all set and waited for under
                // the lock, are gone from every backup.
                Ok(()) => {
                    unapplied =
                        ran_out || matches!(e, Error::NotACounter | Error::CounterOverflow(_));
                }
                Err(why) => {
                    done = Err(Error::OutcomeUnknown(format!(
                        "{e}; and its copies could not be brought back together: {why}"
                    )));
                }
            }
        }
        self.release(key, &mut lock);
        // A group left with no backup sets none: its commit alone may
        // have taken effect.
        let posted = self.commit_posted;
        done.map_err(|e| match e {
            Error::OutcomeUnknown(_) => e,
            e if touched && !unapplied => Error::OutcomeUnknown(format!(
                "the write reached some copies of its shard before it failed: {e}"
            )),
            e if posted && !unapplied => Error::OutcomeUnknown(format!(
                "the write's commit may have taken effect before it failed: {e}"
            )),
            e => e,
        })
    }

    /// The write, attempt after attempt: None when every attempt lost its
    /// race (no commit took effect).
    fn rounds(
        &mut self,
        key: &[u8],
        change: Change,
        touched: &mut bool,
        lock: &mut KeyLock,
    ) -> Result<Option<Done>> {
        let attempts = self.primary.options.max_attempts;
        // The backups were found apart from an increment's observation in
        // its last round.
        let mut apart = false;
        for attempt in 0..attempts {
            // A PUT of a key the primary has not seen lately (no hint of
            // it, no GET just before), from a client whose such PUTs were
            // lately inserts (a load), is most likely an insert.
            let not_seen = matches!(change, Change::Put(_)) && !self.primary.has_seen(key);
            let unseen = not_seen && self.primary.unseen_puts.insert_likely();
            let mut early = match change {
                Change::Put(value) if unseen && attempt == 0 => self.begin_early(key, value),
                _ => None,
            };
            if early.is_some() {
                crate::pause_point("replica-backups-begun");
            }
            let observing = (change, unseen);
            let Some(observed) = self.observe_or_abandon(key, observing, lock, &mut early)? else {
                continue;
            };
            let absent = observed.is_absent();
            if not_seen {
                self.primary.unseen_puts.found(absent);
            }
            if absent && matches!(change, Change::Delete) {
                return Ok(Some(Done::Deleted(false)));
            }
            let locks = absent || matches!(change, Change::Add(_));
            let (value, number) = match change {
                Change::Put(value) => (Some(Cow::Borrowed(value)), None),
                Change::Delete => (None, None),
                Change::Add(delta) => {
                    if !absent && observed.value.is_none() {
                        return Err(Error::Internal("an increment observed no value".into()));
                    }
                    let now = add(observed.value.as_deref(), delta)?;
                    (Some(Cow::Owned(now.to_string().into_bytes())), Some(now))
                }
            };
            crate::pause_point("replica-before-backups");
            match (change, value.as_deref()) {
                (Change::Add(_), Some(sum)) => {
                    let over = Expect::of(observed.value.clone());
                    match self.set_backups_locked(key, (&over, sum), lock, touched)? {
                        Ran::Done => apart = false,
                        Ran::Lapsed => continue,
                        // A backup holds something else than what the sum
                        // was computed from: a write in flight, which may
                        // commit meanwhile (observed again), or left
                        // there (levelled, if found apart again).
                        Ran::Apart => {
                            if std::mem::replace(&mut apart, true) {
                                self.level(key, lock, true)?;
                            }
                            continue;
                        }
                    }
                }
                (_, value) => {
                    // Acted on only as argued at `begin_early`.
                    if let Some(puts) = early.as_mut() {
                        if !(absent && lock.holds(self.primary)) {
                            puts.read_again();
                        }
                    }
                    self.set_backups(key, value, touched, early)?;
                }
            }
            crate::fault_point("replica-backups-set");
            crate::pause_point("replica-backups-set");
            if locks && !lock.holds(self.primary) {
                continue;
            }
            if self.commit(key, value.as_deref(), &observed, lock)? == Commit::Done {
                return Ok(Some(match change {
                    Change::Delete => Done::Deleted(true),
                    Change::Put(_) | Change::Add(_) => Done::Stored(number),
                }));
            }
            // An increment's sums are on the backups, and the primary will
            // not have them: observing again cannot bring them together.
            apart |= matches!(change, Change::Add(_));
        }
        Ok(None)
    }
}

impl Group<'_> {
    /// The key at the primary as `change` acts on it: observed under the
    /// key's lock where the write needs it (an increment always, a PUT of
    /// an absent key), the lock asked for in the observation's own batch.
    /// A PUT of a key the primary has not seen lately (`unseen`: a load,
    /// mostly inserts) asks for it in its first observation, rather than
    /// in a second one once the key is found absent; it goes on without
    /// the lock if the key is there. None: observe again (the lock was
    /// taken, or waited for, without an observation to go with it).
    fn observe(
        &mut self,
        key: &[u8],
        (change, unseen): (Change, bool),
        lock: &mut KeyLock,
    ) -> Result<Option<Observed>> {
        let increment = matches!(change, Change::Add(_));
        let (need, inserting) = match change {
            Change::Put(_) => (Need::Lowest, true),
            Change::Delete => (Need::Every, false),
            Change::Add(_) => (Need::Value, true),
        };
        if !(increment || unseen) || lock.holds(self.primary) {
            let observed = match change {
                Change::Put(_) => self.primary.observe_for_put(key)?,
                _ => self.primary.observe(key, need, inserting)?,
            };
            let locks = increment || observed.is_absent() && inserting;
            if !locks || lock.holds(self.primary) {
                return Ok(Some(observed));
            }
        }
        self.lock_and_observe(key, (change, (need, inserting)), lock)
    }

    /// [`Self::observe`]; the backups' PUTs begun `early` are left
    /// (`CopySets::abandon`) unless there is an observation to act on.
    fn observe_or_abandon(
        &mut self,
        key: &[u8],
        observing: (Change, bool),
        lock: &mut KeyLock,
        early: &mut Option<CopySets>,
    ) -> Result<Option<Observed>> {
        let observed = self.observe(key, observing, lock);
        if !matches!(observed, Ok(Some(_))) {
            if let Some(puts) = early.take() {
                puts.abandon(self.backups, key, true);
            }
        }
        observed
    }

    /// Asks for `key`'s lock (as `relock`) by a CAS in the batch that
    /// observes it. A word found free at another value than asked from is
    /// asked for again at once, as in `relock`; a hold of another writer
    /// is waited for there, unless `change` is a PUT and the key is there
    /// (the lock is then not needed).
    fn lock_and_observe(
        &mut self,
        key: &[u8],
        (change, observing): (Change, (Need, bool)),
        lock: &mut KeyLock,
    ) -> Result<Option<Observed>> {
        let word = insert_lock_index(key);
        for _ in 0..FREE_RETRIES {
            // Recorded before locating, so that the hold is let go however
            // the write ends.
            let (found, read) = self.ask(word, lock, |p, cas| p.lock_with_windows(key, cas))?;
            if lock.is_held() {
                return self.primary.observed_in(key, read, observing);
            }
            if matches!(change, Change::Put(_)) {
                let observed = self.primary.observed_in(key, read, observing)?;
                if observed.as_ref().is_some_and(|o| !o.is_absent()) {
                    return Ok(observed);
                }
            }
            if found & 1 == 1 {
                break;
            }
        }
        self.relock(key, lock)?;
        Ok(None)
    }

    /// Begins a PUT of `value` on every backup that publishes nothing yet:
    /// the block's WRITE and the READs of the key's windows, in flight
    /// while the primary observes the key, so that the backups' first
    /// round trip costs no wait of its own. None when the fault hook must
    /// see the copies set one after the other (`set_backups`).
    ///
    /// **Why reads made before the observation may be acted on** (and
    /// only in one case: the primary's observation, under the key's
    /// lock taken by this writer, finds the key absent; otherwise the
    /// backups read again, `CopySets::read_again`). Every write of the key
    /// committed before this one then committed before the lock was taken
    /// (an update needs the key present, an insert the lock, and a hold
    /// taken over from a writer has outlived the time that writer may act),
    /// and the last of them is a delete, whose removals on each backup
    /// were done before it committed. So from the observation on, no copy
    /// of a committed write is on a backup, and none comes before this
    /// write commits: the copies a backup may still hold are of writes in
    /// flight, which the argument at the top allows. A backup's CAS from
    /// what it read before the observation is posted after it, within
    /// the read's deadline (no slot value comes back); if a removal
    /// changed the slot since, the CAS fails and the windows are read
    /// again. An insert into an empty slot then never hides a committed
    /// copy behind it, since there is none. (After a failover, a backup
    /// kept beside the promoted one may still hold a copy of a committed
    /// write the new primary lacks, until it is levelled; that copy was
    /// there before this write began, so the early read saw it, and the
    /// CAS or a levelling, which takes the lock, covers it.)
    ///
    /// What it costs a PUT of a key that is there after all (the client
    /// had no hint of it): the lock is held while the backups are set
    /// (inserts and increments of keys on its word wait), and each
    /// backup reads its windows once more: a round trip more on each,
    /// waited for together, so the write waits as often as before. A
    /// client whose such PUTs keep finding their keys there stops taking
    /// them for inserts (`UnseenPuts`).
    fn begin_early(&mut self, key: &[u8], value: &[u8]) -> Option<CopySets> {
        if crate::fault_armed("replica-first-backup-set") {
            return None;
        }
        let puts = CopySets::begin(
            self.backups,
            key,
            Some(value),
            (First::ReadsOnly, &Expect::Any),
        );
        if puts.failed.is_some() {
            // Left to the write's own sets, where the error counts.
            puts.abandon(self.backups, key, false);
            return None;
        }
        Some(puts)
    }

    /// Sets `key` to `value` (None: removes it) on every backup (the PUTs
    /// begun `early`, if they were).
    fn set_backups(
        &mut self,
        key: &[u8],
        value: Option<&[u8]>,
        touched: &mut bool,
        early: Option<CopySets>,
    ) -> Result<()> {
        *touched |= !self.backups.is_empty();
        if let Some(sets) = early {
            return sets.run(self.backups, key, value, (true, None)).map(drop);
        }
        // The fault hook that kills a writer between its copies sets the
        // first before the others start: overlapped, that moment comes
        // only by timing.
        if crate::fault_armed("replica-first-backup-set") && !self.backups.is_empty() {
            let (first, rest) = self.backups.split_at_mut(1);
            set_on_each(first, key, value)?;
            crate::fault_point("replica-first-backup-set");
            return set_on_each(rest, key, value);
        }
        set_on_each(self.backups, key, value)
    }

    /// Sets an increment's `sum` on every backup by a CAS from what it
    /// observes there, each CAS posted while the key's lock is held (with
    /// its margin of deadlines): the sum was computed from the primary's
    /// value under the lock, so it must not land once the lock may have
    /// passed to the next increment (a plain PUT, redone until it lands,
    /// could set a stale sum over a later one's, which a failover would
    /// then serve). The backups' PUTs step together, the lock checked
    /// before each round (`CopySets::run`): each CAS acting on a read goes
    /// out within a deadline of a check that found the lock held (the
    /// margin is three of the primary's deadlines: the members of a
    /// cluster share one `--op-deadline-ms`, which they are held to as
    /// they join, see kv-cluster's `Etcd::agree_op_deadline`). Each CAS
    /// acts on a read of the backup's value that found what the sum was
    /// computed from, `over` (no blind CAS from a hint, which does not say
    /// what its block holds); a backup holding anything else ends the sets
    /// `Apart`. `Lapsed` when the lock lapsed first. With `over` any value
    /// (`level`'s sets), a backup's sole hint may be CASed blind as its
    /// PUT begins, which may go out later than a deadline after the check
    /// (a block's lease may ask the server): it lands only if the slot
    /// still holds what this client last saw there, and any later write's
    /// set on that backup replaces that.
    fn set_backups_locked(
        &mut self,
        key: &[u8],
        (over, sum): (&Expect, &[u8]),
        lock: &KeyLock,
        touched: &mut bool,
    ) -> Result<Ran> {
        let primary = &*self.primary;
        let holds = || lock.holds(primary);
        if !holds() {
            return Ok(Ran::Lapsed);
        }
        *touched |= !self.backups.is_empty();
        let guard = SumGuard {
            holds: &holds,
            over,
        };
        let sets = CopySets::begin(self.backups, key, Some(sum), (First::MayPublish, over));
        sets.run(self.backups, key, Some(sum), (false, Some(guard)))
    }

    /// After an increment failed having set the backups (the key became
    /// something else than a counter meanwhile), or found them apart from
    /// the primary: brings the backups back to what the primary holds. A
    /// value is committed again over itself, a write ordered like any
    /// other. `under_lock` (an increment's): each pass holds the key's
    /// lock, taken again if it lapsed or a failed commit let it go, and
    /// its sets are guarded by it as the sums are (`set_backups_locked`);
    /// otherwise (a failover's levelling, `level_copies`) a present value
    /// is set by plain PUTs (see the top: what this leaves open). An
    /// absent key is removed from the backups, which counts only if the
    /// key's lock held from before the observation until the removals were
    /// done (no insert can fill the key meanwhile); otherwise the lock is
    /// taken again and it is redone.
    fn level(&mut self, key: &[u8], lock: &mut KeyLock, under_lock: bool) -> Result<()> {
        let mut touched = true;
        let attempts = self.primary.options.max_attempts;
        for _ in 0..attempts {
            // A commit that failed may have let the lock go too (the
            // release rides in its batch when that was a single CAS: one
            // known copy, or an insert).
            if under_lock && !lock.holds(self.primary) {
                self.relock(key, lock)?;
            }
            let held = lock.holds(self.primary);
            let observed = self.primary.observe(key, Need::Value, false)?;
            if !observed.is_absent() {
                let Some(value) = observed.value.clone() else {
                    return Err(Error::Internal("a present key observed no value".into()));
                };
                // Under the key's lock, set as a sum is: a set stalled
                // past the lock cannot land over a later increment's sum.
                if !held {
                    self.set_backups(key, Some(&value), &mut touched, None)?;
                } else if self.set_backups_locked(
                    key,
                    (&Expect::Any, &value),
                    lock,
                    &mut touched,
                )? != Ran::Done
                {
                    continue;
                }
                if self.commit(key, Some(&value), &observed, lock)? == Commit::Done {
                    return Ok(());
                }
                continue;
            }
            if !held {
                self.relock(key, lock)?;
                continue;
            }
            self.set_backups(key, None, &mut touched, None)?;
            if lock.holds(self.primary) {
                return Ok(());
            }
        }
        Err(Error::Contended(attempts))
    }

    /// Commits at the primary (`Client::commit`). The key's lock, if this
    /// writer holds it, is let go in the commit's batch where it can ride
    /// there, after the commit's CAS, saving the release its round trip.
    /// The next holder must observe what this commit left: the release is
    /// an atomic posted after the commit's on one queue pair, which
    /// executes after it (atomics in the order posted, see
    /// `kv_common::transport::Verb`). A commit that then fails takes the
    /// lock again if it needs it.
    fn commit(
        &mut self,
        key: &[u8],
        value: Option<&[u8]>,
        observed: &Observed,
        lock: &mut KeyLock,
    ) -> Result<Commit> {
        let word = insert_lock_index(key);
        // A control call in taking the block that fails leaves nothing
        // published: the write is cut before its commit.
        let block = match value {
            Some(value) => Some(self.primary.block_for(key, value)?),
            None => None,
        };
        crate::pause_point("replica-commit-ready");
        self.commit_posted = true;
        let releasing = lock.releasing(self.primary.reconnects());
        let mut then = releasing.map(|r| self.primary.insert_lock_release(word, r));
        let atomics = self.primary.verb_stats().atomics;
        let committed = self.primary.commit_made(key, block, observed, &mut then);
        // A commit that lost its race took no effect, nor did one turned
        // away before any of its atomics ran (the primary started its copy
        // again under a new group): a cut in a later round, or this one,
        // is still a cut before the write's commit. A commit may be several
        // batches (an insert and its duplicate check), and only the last
        // was turned away: an earlier one's atomics, counted as it
        // completed, say it may have taken effect (every error in
        // `commit_made` ends it, so no batch of it after a failed one ran).
        let ran_none = |e: &Error| e.ran_nothing() && self.primary.verb_stats().atomics == atomics;
        match &committed {
            Ok(Commit::Changed) => self.commit_posted = false,
            Err(e) if ran_none(e) => self.commit_posted = false,
            _ => {}
        }
        // After an error the hold is kept, to be let go by a CAS of its own
        // (which fails, harmlessly, if this one went).
        if let (Some(release), None, Ok(_)) = (releasing, then, &committed) {
            lock.let_go();
            self.primary.insert_lock_released(word, release);
        }
        committed
    }

    /// Takes `key`'s lock at the primary (again: a hold renewed; or let go
    /// by another writer since it was last found), or takes it over from a
    /// writer that held it a whole life. Waits while another writer holds
    /// it, for at most two lives: time enough to take over a dead writer's
    /// hold, which a busy word (held again and again) may not leave.
    fn relock(&mut self, key: &[u8], lock: &mut KeyLock) -> Result<()> {
        let (life, _) = self.primary.insert_lock_life();
        let word = insert_lock_index(key);
        let give_up = Instant::now() + life * 2;
        let mut asks = 0;
        loop {
            // A word found free at another value than guessed (other
            // writers took and let it go since this client last looked) is
            // asked for again at once.
            for _ in 0..FREE_RETRIES {
                let (found, ()) = self.ask(word, lock, |p, (word, from, to)| {
                    Ok((p.cas_insert_lock(word, from, to)?, ()))
                })?;
                asks += 1;
                if lock.is_held() || found & 1 == 1 {
                    break;
                }
            }
            if lock.is_held() {
                return Ok(());
            }
            if Instant::now() >= give_up {
                return Err(Error::Contended(asks));
            }
            std::thread::sleep(LOCK_WAIT);
        }
    }

    /// Asks once for lock word `word`: the next CAS from this client's
    /// sighting of it (`KeyLock::next`), posted by `post` (alone, or ahead
    /// of the key's windows), its answer recorded in `lock`. The value the
    /// CAS found, and what else `post` read.
    fn ask<T>(
        &mut self,
        word: u64,
        lock: &mut KeyLock,
        post: impl FnOnce(&mut Client, (u64, u64, u64)) -> Result<(u64, T)>,
    ) -> Result<(u64, T)> {
        let (life, margin) = self.primary.insert_lock_life();
        let seen = self.primary.insert_lock_sighting(word);
        let connection = self.primary.reconnects();
        let (from, to) = lock.next(seen, life, Instant::now(), connection);
        let asked = Instant::now();
        let (found, read) = post(self.primary, (word, from, to))?;
        lock.found((from, to, found), asked, (life, margin), connection);
        Ok((found, read))
    }

    /// Lets `key`'s lock go, if this writer holds it. A hold lapses anyway,
    /// so a release that fails costs nothing.
    fn release(&mut self, key: &[u8], lock: &mut KeyLock) {
        if let Some((from, to)) = lock.release(self.primary.reconnects()) {
            let _ = self
                .primary
                .cas_insert_lock(insert_lock_index(key), from, to);
        }
    }
}

/// Whether a client's PUTs of keys it has not seen have lately been inserts,
/// so that the next one is likely to be one too (`Group::begin_early`): a
/// two-bit saturating count, up for an insert, down for an update, the way
/// a branch predictor follows a branch. A load keeps it up; updates of keys
/// whose hints were forgotten bring it down in two, and they then go the
/// way that costs an update least.
#[derive(Debug, Clone, Copy)]
pub(crate) struct UnseenPuts(u8);

impl Default for UnseenPuts {
    /// A new client's first such PUTs are taken for inserts.
    fn default() -> Self {
        UnseenPuts(3)
    }
}

impl UnseenPuts {
    pub fn insert_likely(self) -> bool {
        self.0 >= 2
    }

    /// Such a PUT found the key `absent` (an insert) or there.
    pub fn found(&mut self, absent: bool) {
        self.0 = match absent {
            true => (self.0 + 1).min(3),
            false => self.0.saturating_sub(1),
        };
    }
}

/// Sets `key` to `value` (None: removes it) on each of `copies`, each PUT
/// or DELETE run a step at a time with a batch in flight on every copy at
/// once (`stepped_put`).
fn set_on_each(copies: &mut [Client], key: &[u8], value: Option<&[u8]>) -> Result<()> {
    CopySets::begin(copies, key, value, (First::MayPublish, &Expect::Any))
        .run(copies, key, value, (false, None))
        .map(drop)
}

/// While `guard` holds: sets an increment's `sum` on `backup` by a CAS
/// from what it observes there, if that is what the sum was computed from,
/// observing again until one lands.
fn set_while(backup: &mut Client, key: &[u8], sum: &[u8], guard: &SumGuard) -> Result<Ran> {
    let attempts = backup.options.max_attempts;
    for _ in 0..attempts {
        let observed = backup.observe(key, Need::Value, true)?;
        if !(guard.holds)() {
            return Ok(Ran::Lapsed);
        }
        if !guard.over.admits(&Expect::of(observed.value.clone())) {
            return Ok(Ran::Apart);
        }
        if backup.commit(key, Some(sum), &observed, &mut None)? == Commit::Done {
            return Ok(Ran::Done);
        }
    }
    Err(Error::Contended(attempts))
}

/// An increment's sums (and its levelling's sets, `over` any value): each
/// CAS posted only while `holds` (the key's lock does), and only over a
/// copy holding `over`, the value the sum was computed from. A PUT or DELETE of the key does not take the lock: one
/// that set a backup before the increment read it, and commits at the
/// primary after the increment observed it there, would otherwise have
/// its value replaced by a sum the primary never gets if the increment's
/// client dies before its commit, and a failover to that backup would
/// lose the acknowledged PUT. Over the value it was computed from, a sum
/// left by a dead increment is that increment applied after whatever set
/// the value (its outcome unknown to its caller): a write in flight, as
/// the argument at the top allows.
struct SumGuard<'g> {
    holds: &'g dyn Fn() -> bool,
    over: &'g Expect,
}

/// How a write's sets on a shard's copies ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ran {
    /// Every copy has it.
    Done,
    /// The increment's lock stopped holding first.
    Lapsed,
    /// A copy does not hold what an increment's sum was computed from.
    Apart,
}

/// One write's PUTs (or DELETEs) on each of a shard's copies, begun and not
/// yet done.
struct CopySets {
    sets: SmallVec<[CopySet; 2]>,
    /// The first error of a copy other than a lost connection.
    failed: Option<Error>,
}

impl CopySets {
    /// Begins the PUT of `value` (None: the DELETE) on each of `copies`, a
    /// PUT as `first` allows (a DELETE always may publish: only PUTs begin
    /// early); after an error, no copy's begins.
    fn begin(
        copies: &mut [Client],
        key: &[u8],
        value: Option<&[u8]>,
        (first, over): (First, &Expect),
    ) -> CopySets {
        let mut failed = None;
        let mut sets = SmallVec::new();
        for copy in copies.iter_mut() {
            sets.push(match failed {
                Some(_) => CopySet::Over,
                None => {
                    let begun = match value {
                        Some(value) => copy.put_begin(key, value, (first, over.clone())),
                        None => copy.delete_begin(key),
                    };
                    CopySet::after(begun, &mut failed)
                }
            });
        }
        CopySets { sets, failed }
    }

    /// Runs the sets to their end, a step on each copy per round. One that
    /// leaves its steps, or whose connection was lost, is done again as a
    /// plain PUT or DELETE (which reconnects; under a `guard`, by
    /// `set_while`). Any other error is the write's: the sets under way are
    /// finished first, so that no batch is left in flight. `overlapped`:
    /// the caller has waited for a round trip while the first batches were
    /// in flight (see `VerbStats::waits`). Under a `guard`, checked before
    /// each round: a step posts its CAS once its batch in flight is
    /// done, and only while what that batch read is in time (within a
    /// deadline of its start, before the check), so within a deadline of
    /// the check; and only over the value the guard names (the sets were
    /// begun over it), else that copy stops and the sets end `Apart`.
    fn run(
        self,
        copies: &mut [Client],
        key: &[u8],
        value: Option<&[u8]>,
        (overlapped, guard): (bool, Option<SumGuard>),
    ) -> Result<Ran> {
        let CopySets {
            mut sets,
            mut failed,
        } = self;
        let mut first = overlapped;
        let mut going = true;
        let mut apart = false;
        while going {
            if guard.as_ref().is_some_and(|g| !(g.holds)()) {
                let failed = CopySets { sets, failed }.abandon(copies, key, first);
                return failed.map_or(Ok(Ran::Lapsed), Err);
            }
            going = false;
            // The batches in flight are waited for together: the first
            // wait is the round's round trip.
            let mut waited = std::mem::take(&mut first);
            for (copy, set) in copies.iter_mut().zip(&mut sets) {
                let CopySet::Stepping(stepped) = set else {
                    continue;
                };
                let together = wait_together(&mut waited, stepped.in_flight());
                match copy.put_step(key, stepped, together) {
                    Ok(Progress::Going) => going = true,
                    Ok(Progress::Done) => *set = CopySet::Over,
                    Ok(Progress::Serial) => *set = CopySet::Plain,
                    Ok(Progress::Apart) => {
                        apart = true;
                        *set = CopySet::Over;
                    }
                    Err(e) => *set = CopySet::after(Err(e), &mut failed),
                }
            }
            if guard.is_some() {
                crate::pause_point("replica-sum-round");
            }
        }
        if let Some(e) = failed {
            return Err(e);
        }
        if apart {
            return Ok(Ran::Apart);
        }
        for (copy, set) in copies.iter_mut().zip(&sets) {
            if !matches!(set, CopySet::Plain) {
                continue;
            }
            match (value, &guard) {
                (Some(sum), Some(guard)) => {
                    let ran = set_while(copy, key, sum, guard)?;
                    if ran != Ran::Done {
                        return Ok(ran);
                    }
                }
                (Some(value), None) => copy.put(key, value)?,
                (None, _) => {
                    copy.delete(key)?;
                }
            }
        }
        Ok(Ran::Done)
    }

    /// The reads of the batches in flight are not to be acted on (see
    /// `SteppedPut::read_again`).
    fn read_again(&mut self) {
        for set in &mut self.sets {
            if let CopySet::Stepping(stepped) = set {
                stepped.read_again();
            }
        }
    }

    /// Leaves the sets, once their batches in flight are done, waited for
    /// together (`overlapped`: the caller waited for a round trip while
    /// they were in flight, as for its observation), and what they
    /// published accounted for (`Client::put_abandon`); a copy whose wait
    /// fails is left as it is (its connection is made anew on its next
    /// use). The first error a copy's set had met before, if any.
    fn abandon(self, copies: &mut [Client], key: &[u8], overlapped: bool) -> Option<Error> {
        let mut waited = overlapped;
        for (copy, set) in copies.iter_mut().zip(self.sets) {
            if let CopySet::Stepping(stepped) = set {
                let together = wait_together(&mut waited, stepped.in_flight());
                let _ = copy.put_abandon(key, stepped, together);
            }
        }
        self.failed
    }
}

/// Whether a copy's wait, in a round whose batches in flight are waited
/// for together, costs no round trip of its own (`waited`: one of them
/// was waited for before; see `VerbStats::waits`); notes this one's.
fn wait_together(waited: &mut bool, in_flight: bool) -> bool {
    let together = *waited && in_flight;
    *waited |= in_flight;
    together
}

/// Where one copy's PUT or DELETE stands in `CopySets`.
enum CopySet {
    Stepping(SteppedPut),
    /// To be done as a plain PUT or DELETE.
    Plain,
    /// Done, failed, or not begun after another copy's failed.
    Over,
}

impl CopySet {
    /// A copy's set after a step that returned `result`; an error other
    /// than a lost connection is kept in `failed` (the first one).
    fn after(result: Result<SteppedPut>, failed: &mut Option<Error>) -> CopySet {
        match result {
            Ok(stepped) => CopySet::Stepping(stepped),
            Err(e) if e.is_connection_lost() => CopySet::Plain,
            Err(e) => {
                failed.get_or_insert(e);
                CopySet::Over
            }
        }
    }
}

/// The counter `value` (its decimal text; none: 0) plus `delta`.
fn add(value: Option<&[u8]>, delta: i64) -> Result<i64> {
    let now = match value {
        None => 0,
        Some(text) => std::str::from_utf8(text)
            .ok()
            .and_then(|t| t.parse::<i64>().ok())
            .ok_or(Error::NotACounter)?,
    };
    let sum = i128::from(now) + i128::from(delta);
    match sum.unsigned_abs() <= COUNTER_MAX as u128 {
        true => Ok(sum as i64),
        false => Err(Error::CounterOverflow(sum)),
    }
}

/// The counter a replicated shard holds as `value`.
pub(crate) fn counter(value: Option<Vec<u8>>) -> Result<Option<i64>> {
    value.map(|v| add(Some(&v), 0)).transpose()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unseen_puts_are_taken_for_inserts_until_two_in_a_row_were_updates() {
        let mut puts = UnseenPuts::default();
        assert!(puts.insert_likely(), "a new client's are");
        puts.found(false);
        assert!(puts.insert_likely(), "one update does not turn it");
        puts.found(false);
        assert!(!puts.insert_likely());
        puts.found(false);
        puts.found(true);
        assert!(!puts.insert_likely(), "one insert after many updates");
        puts.found(true);
        assert!(puts.insert_likely());
        for _ in 0..10 {
            puts.found(true);
        }
        puts.found(false);
        assert!(
            puts.insert_likely(),
            "saturated: one update does not turn it"
        );
    }
}
