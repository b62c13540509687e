//! DELETE: CAS the key's slot to empty. With a sole, fresh hint (see
//! `hint`) that is the whole operation. Otherwise locate every copy and
//! remove the extra ones, highest first, before the lowest: a copy left
//! behind would become the lowest and bring back an older value. Counters
//! that have not settled stay; a settled one goes under its lock (see
//! `counter`).

use crossbeam::utils::Backoff;
use kv_common::layout::{KeyHash, Slot};
use smallvec::SmallVec;

use crate::corrupt::CorruptSlot;
use crate::hint::Seen;
use crate::locate::{Located, Need};
use crate::{Client, Error, Result, Step};

impl Client {
    /// `unlinked` survives a redo: if an attempt unlinked the key before its
    /// connection was lost, the redo finds nothing but the key was there.
    pub(crate) fn delete_once(&mut self, key: &[u8], unlinked: &mut bool) -> Result<Step<bool>> {
        let kh = KeyHash::new(key, self.info.geometry.bucket_count);
        if let Some(hint) = self.blind_hint(key) {
            self.cache.forget(key);
            if self.cas(hint.pos, hint.slot, Slot::EMPTY)? {
                *unlinked = true;
                return Ok(Step::Done(true));
            }
        }
        let mut corrupt = CorruptSlot::default();
        let backoff = Backoff::new();
        for _ in 0..self.options.max_attempts {
            match self.locate(key, &kh, None, Need::Every)? {
                Located::Found { copies, clock } => {
                    self.cache.forget(key);
                    // A counter that has not settled is not there for
                    // readers: its creator may still settle it (after this
                    // delete), or it was given up and counter calls clear
                    // it away. Left alone, creators are not starved by
                    // deletes.
                    let readable = |i: &usize| copies.kinds[*i].is_readable();
                    let targets: SmallVec<[usize; 2]> =
                        (0..copies.slots.len()).filter(readable).collect();
                    let Some((&lowest, extra)) = targets.split_first() else {
                        return Ok(Step::Done(*unlinked));
                    };
                    let (copy, kind) = (copies.slots[lowest], copies.kinds[lowest]);
                    if self.remove_duplicates(key, &copies, extra.iter().copied(), clock)?
                        && self.unlink(key, Seen::new(copy, clock), kind, Slot::EMPTY)?
                    {
                        *unlinked = true;
                        return Ok(Step::Done(true));
                    }
                }
                Located::Absent { .. } => return Ok(Step::Done(*unlinked)),
                Located::Retry(suspect) => corrupt.saw(key, suspect)?,
                Located::Moved => return Ok(Step::Moved),
            }
            backoff.snooze();
        }
        Err(Error::Contended(self.options.max_attempts))
    }
}
