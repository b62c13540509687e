//! Two clients may insert the same key at once, each into an empty slot it
//! found when no copy existed. The rule that resolves it: **the lowest slot
//! position wins.** Readers return the lowest copy, writers update it, a
//! resize keeps it, and inserts whose copy is higher remove their own.
//!
//! An insert does not return until it has seen at most one copy left: a
//! copy that changed under the removing CAS, or an update that landed on
//! its slot meanwhile, is read again. So extra copies exist only while the
//! PUTs that made them are in flight (or after their client died, until a
//! later writer removes them). A client that saw a higher copy but not the
//! lowest read before the lowest was inserted, so its operation is
//! concurrent with that insert and ordered before it. If a resize freezes
//! the buckets first, its copy keeps the lowest copy (the insert waits
//! until it is published); if the resize is undone, the check goes on here.
//!
//! The check starts from the READs of the windows that went in the insert's
//! own batch, after its CAS. That relies on read-after-write order on one
//! queue pair: a READ posted after an atomic (or a WRITE) sees its effect.
//! The responder executes requests in order (IBA vol. 1, §9.5), the atomic's
//! store reaches host memory as a posted write that a later DMA read may not
//! pass (PCIe ordering), and libfabric's verbs provider advertises it for RC
//! (`FI_ORDER_RAW`, `FI_ORDER_ATOMIC_RAW`); only write-after-read needs
//! `IBV_SEND_FENCE`. Unlike two READs, whose DMA reads may pass each other,
//! this is an ordering the hardware promises, and the `ReadOrder` test hook
//! keeps it. As a check, if the READ of the insert's own window does not
//! show its copy (or the copy was updated since), the windows are read
//! again.

use crossbeam::utils::Backoff;
use kv_common::layout::{KeyHash, Slot};

use crate::clock::OpClock;
use crate::corrupt::CorruptSlot;
use crate::hint::Seen;
use crate::index::{meets_resize, Copies, Scan, ScanMode, WindowsRead};
use crate::{Client, Error, Result};

impl Client {
    /// Resolves this client's insert (`mine`: where, the new slot value,
    /// and the clock of the batch that published it, which also read the
    /// windows).
    pub(crate) fn resolve_insert(&mut self, key: &[u8], kh: &KeyHash, mine: Seen) -> Result<()> {
        let Seen {
            pos: mine,
            slot: new,
            clock: published,
        } = mine;
        let Some(my_index) = kh.slot_index(mine) else {
            return Err(Error::Internal("inserted outside the key's buckets".into()));
        };
        let mut corrupt = CorruptSlot::default();
        let backoff = Backoff::new();
        let mut read_with_cas = Some(published);
        let mut stray = None;
        for _ in 0..self.options.max_attempts {
            let clock = match read_with_cas.take() {
                Some(clock) if self.slots()[my_index] == new => clock,
                _ => self.read_windows(kh, None)?,
            };
            let slots = self.slots();
            if meets_resize(&slots) {
                if self.follow_to_new_index()? {
                    return Ok(());
                }
                self.wait_out_stray_frozen(&mut stray)?;
                continue;
            }
            // Our own block cannot have been unlinked and reused for another
            // key sooner than a grace period after we published it.
            let known = published.in_time().then_some(new);
            let mode = ScanMode::AllCopies { known };
            let copies = match self.scan(key, kh, &WindowsRead::new(&slots, clock), mode)? {
                Scan::Retry(suspect) => {
                    corrupt.saw(key, suspect)?;
                    continue;
                }
                Scan::Found(copies) => copies,
                Scan::Moved => {
                    if self.follow_to_new_index()? {
                        return Ok(());
                    }
                    continue;
                }
            };
            // A counter readers cannot see yet never wins: it is given up
            // (its creator starts over and finds this value).
            let unseen_below = copies
                .slots
                .iter()
                .zip(&copies.kinds)
                .find(|(&(pos, _), kind)| pos < mine && !kind.is_readable());
            if let Some((&(pos, slot), _)) = unseen_below {
                self.unlink_unsettled(key, Seen::new((pos, slot), clock), Slot::EMPTY)?;
                backoff.snooze();
                continue;
            }
            let ours_is_higher = slots[my_index] == new
                && copies
                    .slots
                    .first()
                    .is_some_and(|&(lowest, _)| lowest != mine);
            if ours_is_higher {
                if clock.in_time() && self.cas(mine, new, Slot::EMPTY)? {
                    self.cache.forget(key);
                    return Ok(());
                }
            } else if self.remove_duplicates(key, &copies, 1..copies.slots.len(), clock)? {
                return Ok(());
            }
            backoff.snooze();
        }
        Err(Error::Contended(self.options.max_attempts))
    }

    /// Empties the slots of `copies` at `which` (extra copies of `key`,
    /// found by the attempt timed by `clock`), highest first, each as its
    /// kind requires (`Client::unlink`). False if any could not be removed:
    /// it changed since it was read, or the reads are too old to act on.
    pub(crate) fn remove_duplicates(
        &mut self,
        key: &[u8],
        copies: &Copies,
        which: impl DoubleEndedIterator<Item = usize>,
        clock: OpClock,
    ) -> Result<bool> {
        for i in which.rev() {
            let (copy, kind) = (copies.slots[i], copies.kinds[i]);
            if !self.unlink(key, Seen::new(copy, clock), kind, Slot::EMPTY)? {
                return Ok(false);
            }
        }
        Ok(true)
    }
}
