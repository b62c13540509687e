//! Finding a key's copies for a writer: one fresh read of its windows (with
//! a fresh hint, the hinted block in the same batch), then the blocks of the
//! slots whose fingerprint matches.

use kv_common::layout::{KeyHash, Slot, SlotPos};
use kv_common::transport::Verb;

use crate::clock::OpClock;
use crate::get::{BlockRead, Sighting};
use crate::hint::{Alone, Seen};
use crate::index::{meets_resize, Copies, Scan, ScanMode, Value, WindowsRead};
use crate::{Client, Result};

/// What a writer needs to know about the key's copies. Unless it needs
/// the value, their blocks are read only as far as their heads
/// (`ScanMode::Keys`): a PUT or DELETE replaces whatever value they hold,
/// and a byte block's value is most of its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// The lowest copy (an update).
    Lowest,
    /// Every copy (a delete must remove them all).
    Every,
    /// The lowest copy and the value readers see (an increment computes
    /// its sum from it).
    Value,
}

impl Need {
    /// How much of a candidate block the writer reads.
    pub(crate) fn extent(self) -> BlockRead {
        match self {
            Need::Value => BlockRead::Whole,
            Need::Lowest | Need::Every => BlockRead::Head,
        }
    }
}

pub enum Located {
    /// Copies of the key, lowest first, as read by the attempt timed by
    /// `clock`.
    Found { copies: Copies, clock: OpClock },
    /// No copy among the key's candidate slots, as read (they are still
    /// in the local buffer: `Client::slots`).
    Absent { clock: OpClock },
    /// A block failed validation (named, if one did) or the reads were
    /// too slow: read again.
    Retry(Option<(SlotPos, Slot)>),
    /// A resize is moving these buckets, or moved them: writing waits for
    /// the new index.
    Moved,
}

impl Client {
    /// Locates the key's copies. `first` (the WRITE of a new block) travels
    /// in the first batch.
    pub(crate) fn locate(
        &mut self,
        key: &[u8],
        kh: &KeyHash,
        first: Option<Verb>,
        need: Need,
    ) -> Result<Located> {
        let mut held = None;
        // A counter's block must be read: its writers lock it first.
        let clock = match self.hint_to_read(key).filter(|h| !h.is_counter()) {
            Some(hint) => match self.read_hinted(key, kh, (hint, need.extent()), first)? {
                Sighting::Held {
                    value: Some(Value::Counter(_)),
                    ..
                } => {
                    // (Hints say which blocks are counters: not this one.)
                    self.cache.forget(key);
                    self.read_windows(kh, None)?
                }
                Sighting::Held {
                    clock,
                    alone,
                    value,
                } => {
                    held = Some((hint, alone, value));
                    clock
                }
                Sighting::WindowsOnly(clock) => clock,
                // The WRITE went in that batch.
                Sighting::Stale => self.read_windows(kh, None)?,
            },
            None => self.read_windows(kh, first)?,
        };
        // The hinted slot still held its value (not frozen): its copy can
        // be updated whatever else a resize has frozen. (A sole hint's batch
        // read no windows.)
        if let Some((hint, alone, value)) = held {
            let copies = Copies::held(&hint, alone, value);
            if need != Need::Every || copies.exact {
                return Ok(Located::Found { copies, clock });
            }
        }
        self.locate_in_windows(key, kh, (clock, need))
    }

    /// Locates the key's copies from its windows, just read (in the local
    /// buffer: `Client::slots`) by the batch timed by `clock`.
    pub(crate) fn locate_in_windows(
        &mut self,
        key: &[u8],
        kh: &KeyHash,
        (clock, need): (OpClock, Need),
    ) -> Result<Located> {
        let slots = self.slots();
        if meets_resize(&slots) {
            return Ok(Located::Moved);
        }
        let mode = match need.extent() {
            BlockRead::Whole => ScanMode::AllCopies { known: None },
            BlockRead::Head => ScanMode::Keys,
        };
        let scan = self.scan(key, kh, &WindowsRead::new(&slots, clock), mode)?;
        Ok(self.located(key, scan, clock))
    }

    /// What a writer's scan of the key's windows, read by the batch timed
    /// by `clock`, found; the key's hint kept or dropped as it says.
    pub(crate) fn located(&mut self, key: &[u8], scan: Scan, clock: OpClock) -> Located {
        match scan {
            Scan::Found(copies) => match copies.slots.first() {
                Some(&(pos, slot)) => {
                    // Hints name only copies a reader sees.
                    if copies.kinds[0].is_readable() {
                        let alone = copies.exact && copies.slots.len() == 1;
                        let counter = copies.kinds[0].settled_counter();
                        self.saw(
                            key,
                            Seen::new((pos, slot), clock),
                            Alone::proven_if(alone),
                            counter,
                        );
                    } else {
                        self.cache.forget(key);
                    }
                    Located::Found { copies, clock }
                }
                None => {
                    self.cache.forget(key);
                    Located::Absent { clock }
                }
            },
            Scan::Retry(suspect) => Located::Retry(suspect),
            Scan::Moved => Located::Moved,
        }
    }
}
