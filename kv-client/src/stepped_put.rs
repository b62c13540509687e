//! A PUT driven one batch at a time by its caller, so that a writer of
//! several copies of a key (a replicated shard's backups, see
//! `replicated`) has a batch in flight on every copy before it waits for
//! any: over rdma their round trips overlap, and setting two backups costs
//! the round trips of one. (Over shm a batch completes as it is started:
//! the same work as a PUT on each.)
//!
//! The steps are those of a PUT (`put`) in its usual cases:
//! - with a sole hint, the block's WRITE and the CAS of the hinted copy;
//! - otherwise the block's WRITE with the READs of the key's windows (and
//!   of the head of a hinted block, which saves the next step if the
//!   hint holds), then the heads of the candidate blocks, then either the
//!   CAS of the key's one copy, or an insert's CAS with the windows read
//!   again (and its check for a concurrent insert of the key, `dedup`,
//!   done in place).
//!
//! A DELETE steps the same way, as a PUT of the empty slot with no block:
//! a sole hint's CAS, or the reads, then the CAS of the key's one copy; an
//! absent key is done. What a DELETE does in more steps (several copies, a
//! counter) is left to the DELETE itself.
//!
//! A PUT may be begun *over* a value ([`Expect`]): it then replaces only a
//! copy that holds that value (or, expecting none, only an absent key),
//! reading the key's blocks whole to compare a value, and otherwise stops
//! ([`Progress::Apart`]). A replicated increment sets its sums so (see
//! `replicated`).
//!
//! A PUT may also be begun to publish nothing in its first batch
//! ([`First::ReadsOnly`]): a replicated write begins its backups' PUTs that
//! way while it observes the key at the primary, and may then have their
//! reads thrown away ([`SteppedPut::read_again`]).
//!
//! Each step acts on its reads as the PUT does, through the same code
//! (`hinted_sighting`, `scan`, `located`, `swapped`, `update`,
//! `inserted`). What a PUT does in more steps (a damaged or sealed block,
//! candidates that do not fit one batch, a resize, a full index, a read
//! too old to act on too often) is left to the PUT itself
//! ([`Progress::Serial`]; an increment's sum, to `replicated::set_while`):
//! it starts over, which is safe since
//! every step of a PUT may be redone, and the block written here and
//! never published is garbage the server reclaims.

use crossbeam::utils::Backoff;
use kv_common::layout::{KeyHash, Slot};
use kv_common::transport::Verb;
use smallvec::SmallVec;

use crate::clock::OpClock;
use crate::get::{value_bytes, BlockRead, Sighting};
use crate::hint::{Hint, Seen};
use crate::index::{meets_resize, Copies, Kind, Scan, ScanMode, Value};
use crate::locate::Located;
use crate::put::InsertAt;
use crate::{Client, Result};

/// A PUT (or a DELETE) in flight: the batch it started last, and what it
/// then does.
pub(crate) struct SteppedPut {
    kh: KeyHash,
    /// The slot value that links the new block; empty for a DELETE.
    new: Slot,
    stage: Option<Stage>,
    /// What the batch in flight reads is not to be acted on: the next step
    /// reads the windows again (`Self::read_again`).
    stale: bool,
    /// What the copy it replaces must hold.
    expect: Expect,
    /// Times the windows were read again, and the pause before the next
    /// time (as a PUT's attempts back off).
    rereads: u32,
    backoff: Backoff,
}

/// What a PUT's first batch may do besides the block's WRITE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum First {
    /// Publish it at once (with a sole hint's CAS), or read the windows.
    MayPublish,
    /// Only read the windows (and a hinted block's head): the caller
    /// publishes nothing before it has learnt something elsewhere.
    ReadsOnly,
}

/// What a PUT may replace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Expect {
    /// Whatever the key holds.
    Any,
    /// Nothing: the key must be absent.
    Absent,
    /// A copy holding exactly this value (as a GET returns it).
    Holds(Vec<u8>),
}

impl Expect {
    /// What a key observed as `value` (None: absent) holds.
    pub fn of(value: Option<Vec<u8>>) -> Expect {
        value.map_or(Expect::Absent, Expect::Holds)
    }

    /// Whether a key holding `held` is what this expects.
    pub fn admits(&self, held: &Expect) -> bool {
        matches!(self, Expect::Any) || self == held
    }
}

/// The batch a PUT has in flight.
enum Stage {
    /// The block's WRITE and the CAS of the sole hint's copy (as seen).
    Blind(Seen),
    /// The READs of the windows (after the block's WRITE, the first time),
    /// timed by the clock.
    Windows(OpClock),
    /// As `Windows`, with the READ of the block of a hint (not sole) that
    /// is candidate `at` of the key's slots.
    Hinted(Hint, (usize, Verb, OpClock)),
    /// The READs of the candidate blocks' heads the windows read by the
    /// clock show (still in the local buffer: the heads land elsewhere).
    Heads(OpClock),
    /// The CAS of the key's one copy, as the windows' read found it.
    Swap(Seen),
    /// An insert's CAS (of the new copy, as seen) and the windows' READs.
    Insert(Seen),
}

/// Where a PUT (or DELETE) stands after a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Progress {
    /// A batch is in flight: step again.
    Going,
    /// Stored (or removed).
    Done,
    /// Not done: do it as a plain PUT (or DELETE; an increment's sum, as
    /// `replicated::set_while`).
    Serial,
    /// Not done: the key does not hold what the PUT expected.
    Apart,
}

/// What a step leads to.
enum Next {
    Then(Stage),
    Done,
    /// Read the windows again (a CAS lost, a read too old).
    Reread,
    Serial,
    Apart,
}

impl SteppedPut {
    /// Whether a batch of it is in flight.
    pub fn in_flight(&self) -> bool {
        self.stage.is_some()
    }

    /// Whether it is a DELETE.
    fn removes(&self) -> bool {
        self.new == Slot::EMPTY
    }

    /// How far it reads the key's blocks: whole when it must compare a
    /// copy's value with what it expects (that a copy is there, its head
    /// tells).
    fn extent(&self) -> BlockRead {
        match self.expect {
            Expect::Any | Expect::Absent => BlockRead::Head,
            Expect::Holds(_) => BlockRead::Whole,
        }
    }

    fn scan_mode(&self) -> ScanMode {
        match self.extent() {
            BlockRead::Head => ScanMode::Keys,
            BlockRead::Whole => ScanMode::AllCopies { known: None },
        }
    }

    /// What this PUT's batch in flight reads may be older than what it
    /// must act on: its next step reads the windows again instead (its
    /// block stays written). Only for a PUT that publishes nothing in that
    /// batch (begun with [`First::ReadsOnly`], not stepped since).
    pub fn read_again(&mut self) {
        debug_assert!(matches!(
            self.stage,
            Some(Stage::Windows(_) | Stage::Hinted(..))
        ));
        self.stale = true;
    }
}

impl Client {
    /// Starts a PUT of `value` (within the value limit) under `key`, over
    /// what `expect` says the key holds: the block's WRITE, in a batch with
    /// its sole hint's CAS (if `first` allows, and it expects nothing: a
    /// hint does not say what its block holds) or the READs of the key's
    /// windows.
    pub(crate) fn put_begin(
        &mut self,
        key: &[u8],
        value: &[u8],
        begin: (First, Expect),
    ) -> Result<SteppedPut> {
        self.before_steps()?;
        let (kh, new, write) = self.new_block(key, value)?;
        self.step_begin(key, (kh, new, Some(write)), begin)
    }

    /// Starts a DELETE of `key`: its sole hint's CAS, or the READs of its
    /// windows.
    pub(crate) fn delete_begin(&mut self, key: &[u8]) -> Result<SteppedPut> {
        self.before_steps()?;
        let kh = KeyHash::new(key, self.info.geometry.bucket_count);
        self.step_begin(
            key,
            (kh, Slot::EMPTY, None),
            (First::MayPublish, Expect::Any),
        )
    }

    /// As `run` before an operation.
    fn before_steps(&mut self) -> Result<()> {
        self.lock_watch = None;
        self.keep_read_lease()
    }

    /// Starts the first batch of a write of `new` (after `write`, its
    /// block's WRITE, if any).
    fn step_begin(
        &mut self,
        key: &[u8],
        (kh, new, write): (KeyHash, Slot, Option<Verb>),
        (first, expect): (First, Expect),
    ) -> Result<SteppedPut> {
        let mut put = SteppedPut {
            kh,
            new,
            stage: None,
            stale: false,
            expect,
            rereads: 0,
            backoff: Backoff::new(),
        };
        let blind = match (first, &put.expect) {
            (First::MayPublish, Expect::Any) => self.blind_hint(key),
            _ => None,
        };
        let stage = match blind {
            Some(hint) => {
                let clock = self.timing.start();
                let cas = self.cas_verb(hint.pos, hint.slot, new);
                let verbs: SmallVec<[Verb; 2]> = write.into_iter().chain([cas]).collect();
                self.conn.start(&verbs)?;
                Stage::Blind(Seen::new((hint.pos, hint.slot), clock))
            }
            None => self.start_locate(key, &put, write)?,
        };
        put.stage = Some(stage);
        Ok(put)
    }

    /// Waits for `put`'s batch, acts on it, and starts the next one.
    /// `together`: the caller has just waited for another client's batch,
    /// in flight with this one, so that this wait costs no round trip of its
    /// own (see `VerbStats::waits`).
    pub(crate) fn put_step(
        &mut self,
        key: &[u8],
        put: &mut SteppedPut,
        together: bool,
    ) -> Result<Progress> {
        let Some(stage) = put.stage.take() else {
            return Ok(Progress::Done);
        };
        self.conn.finish()?;
        self.waited_together += u64::from(together);
        if std::mem::take(&mut put.stale) {
            self.keep_read_lease()?;
            put.stage = Some(self.start_locate(key, put, None)?);
            return Ok(Progress::Going);
        }
        let next = match stage {
            Stage::Blind(old) | Stage::Swap(old) => match self.swapped(key, old, put.new) {
                true => Next::Done,
                false => Next::Reread,
            },
            Stage::Windows(clock) => self.windows_read(key, put, clock)?,
            Stage::Hinted(hint, read) => self.hinted_read(key, put, hint, read)?,
            Stage::Heads(clock) => self.heads_read(key, put, clock)?,
            Stage::Insert(mine) => match self.cas_held(Slot::EMPTY) {
                true => {
                    self.inserted(key, &put.kh, mine)?;
                    Next::Done
                }
                false => Next::Reread,
            },
        };
        let stage = match next {
            Next::Then(stage) => stage,
            Next::Done => return Ok(Progress::Done),
            Next::Serial => return Ok(Progress::Serial),
            Next::Apart => return Ok(Progress::Apart),
            Next::Reread if put.rereads >= self.options.max_attempts => {
                return Ok(Progress::Serial)
            }
            Next::Reread => {
                put.rereads += 1;
                put.backoff.snooze();
                // As `run` before an attempt.
                self.keep_read_lease()?;
                self.start_locate(key, put, None)?
            }
        };
        put.stage = Some(stage);
        Ok(Progress::Going)
    }

    /// Waits for the batch `put` has in flight, if any (`together`: as in
    /// [`Self::put_step`]), and leaves the PUT there, starting nothing
    /// more. A CAS that batch posted is accounted for as a step would (the
    /// block it unlinked reported, the hint kept; an insert checked for a
    /// concurrent one, `dedup`). A block written and never published is
    /// garbage the server reclaims.
    pub(crate) fn put_abandon(
        &mut self,
        key: &[u8],
        put: SteppedPut,
        together: bool,
    ) -> Result<()> {
        let Some(stage) = put.stage else {
            return Ok(());
        };
        self.conn.finish()?;
        self.waited_together += u64::from(together);
        match stage {
            Stage::Blind(old) | Stage::Swap(old) => {
                self.swapped(key, old, put.new);
            }
            Stage::Insert(mine) if self.cas_held(Slot::EMPTY) => {
                self.inserted(key, &put.kh, mine)?;
            }
            _ => {}
        }
        Ok(())
    }

    /// Starts the READs of the key's windows, after `first`, and, as
    /// `locate` does with a hint to read (not a counter's, whose writers
    /// read it whole), of the hinted block's head (whole, for a PUT over a
    /// value).
    fn start_locate(&mut self, key: &[u8], put: &SteppedPut, first: Option<Verb>) -> Result<Stage> {
        let kh = &put.kh;
        // A sole hint goes blind (`step_begin`), unless the PUT must see
        // what its block holds.
        let hinted = self
            .hint_to_read(key)
            .filter(|h| !h.is_counter() && (!h.is_sole() || put.expect != Expect::Any))
            .and_then(|hint| {
                let (at, block) = self.hinted_block(key, kh, (hint, put.extent()))?;
                Some((hint, at, block))
            });
        let clock = self.timing.start();
        let [a, b] = self.window_reads(kh);
        let reads = [a, b].into_iter().chain(hinted.map(|(_, _, block)| block));
        let verbs: SmallVec<[Verb; 4]> = first.into_iter().chain(reads).collect();
        self.conn.start(&verbs)?;
        Ok(match hinted {
            Some((hint, at, block)) => Stage::Hinted(hint, (at, block, clock)),
            None => Stage::Windows(clock),
        })
    }

    /// The windows and the hinted block's head were read: acts on the
    /// copy if the hint held (as `locate`), else on the windows.
    fn hinted_read(
        &mut self,
        key: &[u8],
        put: &SteppedPut,
        hint: Hint,
        read: (usize, Verb, OpClock),
    ) -> Result<Next> {
        match self.hinted_sighting(key, &put.kh, (hint, put.extent()), read) {
            Sighting::Held {
                value: Some(Value::Counter(_)),
                ..
            } => {
                // (Hints say which blocks are counters: not this one.)
                self.cache.forget(key);
                Ok(Next::Reread)
            }
            Sighting::Held {
                clock,
                alone,
                value,
            } => {
                let copies = Copies::held(&hint, alone, value);
                // A DELETE must see every copy (as `locate` for it).
                if put.removes() && !copies.exact {
                    return self.windows_read(key, put, clock);
                }
                self.act(key, put, Located::Found { copies, clock })
            }
            Sighting::WindowsOnly(clock) => self.windows_read(key, put, clock),
            Sighting::Stale => Ok(Next::Reread),
        }
    }

    /// The windows were read (by the batch timed by `clock`): starts the
    /// READs of the candidates' heads, all in one batch, or acts at once
    /// when there are none.
    fn windows_read(&mut self, key: &[u8], put: &SteppedPut, clock: OpClock) -> Result<Next> {
        let slots = self.slots();
        if meets_resize(&slots) {
            return Ok(Next::Serial);
        }
        let start = self.scan_start(key.len(), &put.kh, &slots, put.scan_mode());
        if start.suspect.is_some() || start.past_region {
            return Ok(Next::Serial);
        }
        self.pause_if_slow();
        if start.candidates.is_empty() {
            let located = self.located(key, start.end(), clock);
            return self.act(key, put, located);
        }
        let (reads, read) = self.candidate_reads(&start.candidates, None);
        if read < start.candidates.len() {
            return Ok(Next::Serial);
        }
        self.conn.start(&reads)?;
        Ok(Next::Then(Stage::Heads(clock)))
    }

    /// The candidates' heads were read: acts on the copies they hold.
    fn heads_read(&mut self, key: &[u8], put: &SteppedPut, clock: OpClock) -> Result<Next> {
        // The candidates `windows_read` read, sorted out again (cheaper
        // than keeping them).
        let mode = put.scan_mode();
        let mut start = self.scan_start(key.len(), &put.kh, &self.slots(), mode);
        let every = 0..start.candidates.len();
        let judged = (mode, clock);
        match self.judge_candidates(key, &put.kh, (&mut start, every), judged)? {
            // Too late to act on, or a sealed counter waited on.
            Some(Scan::Retry(None)) => Ok(Next::Reread),
            Some(_) => Ok(Next::Serial),
            None => {
                let located = self.located(key, start.end(), clock);
                self.act(key, put, located)
            }
        }
    }

    /// Acts on the key's copies as located: starts the CAS of its one
    /// byte copy or an insert; updates over several copies or a counter as
    /// a PUT does (in steps of its own); leaves a DELETE of those to the
    /// DELETE, and is done with one of an absent key.
    fn act(&mut self, key: &[u8], put: &SteppedPut, located: Located) -> Result<Next> {
        if !self.as_expected(&put.expect, &located) {
            return Ok(Next::Apart);
        }
        match located {
            Located::Found { copies, clock } => match (&copies.slots[..], &copies.kinds[..]) {
                (&[(pos, old)], [Kind::Bytes | Kind::Known]) if clock.in_time() => {
                    self.conn.start(&[self.cas_verb(pos, old, put.new)])?;
                    Ok(Next::Then(Stage::Swap(Seen::new((pos, old), clock))))
                }
                // Read too long ago to act on (as `update` would find).
                (&[_], [Kind::Bytes | Kind::Known]) => {
                    self.cache.forget(key);
                    Ok(Next::Reread)
                }
                _ if put.removes() => Ok(Next::Serial),
                _ => Ok(match self.update(key, &copies, put.new, clock)? {
                    true => Next::Done,
                    false => Next::Reread,
                }),
            },
            Located::Absent { .. } if put.removes() => Ok(Next::Done),
            Located::Absent { clock } => {
                let pos = match self.insert_at(&put.kh, clock) {
                    InsertAt::Empty(pos) => pos,
                    InsertAt::Full => return Ok(Next::Serial),
                    InsertAt::Late => return Ok(Next::Reread),
                };
                let published = self.timing.start();
                self.conn
                    .start(&self.insert_verbs(&put.kh, (pos, put.new), (None, None)))?;
                Ok(Next::Then(Stage::Insert(Seen::new(
                    (pos, put.new),
                    published,
                ))))
            }
            Located::Retry(_) | Located::Moved => Ok(Next::Serial),
        }
    }

    /// Whether the key's copies as `located` hold what `expect` says. A
    /// read that cannot be acted on counts (too late, a retry, a resize):
    /// the PUT reads again, or leaves it to the plain PUT, as it would.
    fn as_expected(&self, expect: &Expect, located: &Located) -> bool {
        let late = |clock: &OpClock| !clock.in_time();
        match (expect, located) {
            (Expect::Any, _) | (_, Located::Retry(_) | Located::Moved) => true,
            (_, Located::Found { clock, .. } | Located::Absent { clock }) if late(clock) => true,
            (Expect::Absent, located) => matches!(located, Located::Absent { .. }),
            (Expect::Holds(_), Located::Absent { .. }) => false,
            (Expect::Holds(value), Located::Found { copies, .. }) => {
                let held = copies.value.clone();
                held.is_some_and(|held| value_bytes(self.conn.local(), held) == *value)
            }
        }
    }
}
