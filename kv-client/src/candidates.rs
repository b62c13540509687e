//! The blocks a multi-key batch reads: for each key, those of its candidate
//! slots whose fingerprint matches, placed one after another in the local
//! buffer. The slots are chosen by the rule the single-key scan uses
//! (`KeyHash::matches`), and what each block holds is judged by its
//! `Client::holds`; only where the blocks land differs.

use std::ops::Range;

use kv_common::layout::{set_bits, Geometry, KeyHash, Slot};
use kv_common::transport::Verb;
use smallvec::SmallVec;

use crate::index::Slots;
use crate::local::BATCH_KEYS;

/// One block a batch reads for a key.
#[derive(Clone, Copy)]
pub(crate) struct Candidate {
    /// The key's place in the batch.
    pub key: usize,
    /// The slot's place among the key's candidate slots.
    pub index: usize,
    /// The slot as read (frozen or not).
    pub slot: Slot,
    pub read: Verb,
}

impl Candidate {
    /// Where the block lands in the local buffer.
    pub fn local(&self) -> Range<usize> {
        let at = self.read.local_offset();
        at..at + self.read.remote_range().1
    }
}

/// The candidates of a batch's keys, lowest slot first within each key.
pub(crate) struct CandidateReads {
    list: SmallVec<[Candidate; BATCH_KEYS]>,
    /// Where the next block lands.
    at: usize,
    /// The end of the room for blocks.
    end: usize,
    /// READs the batch may hold.
    max: usize,
}

impl CandidateReads {
    /// Room for blocks at `[at, end)` of the local buffer, and for `max`
    /// READs.
    pub fn new(at: usize, end: usize, max: usize) -> CandidateReads {
        CandidateReads {
            list: SmallVec::new(),
            at,
            end,
            max,
        }
    }

    /// Adds the blocks of key `key`'s slots whose fingerprint matches, each
    /// read as far as `cap` bytes at most (a writer's: their heads, see
    /// `ScanMode::Keys`), and returns how many matched; None, adding
    /// nothing, if one of them cannot be read here (past the region this
    /// client knows, or no room left): the batch cannot settle that key.
    pub fn add_key(
        &mut self,
        g: &Geometry,
        (key, cap): (usize, usize),
        kh: &KeyHash,
        slots: &Slots,
    ) -> Option<usize> {
        let (len_before, at_before) = (self.list.len(), self.at);
        for index in set_bits(kh.matches(slots)) {
            let slot = slots[index];
            let fits = g
                .block_span(slot.thawed())
                .map(|(remote, len)| (remote, len.min(cap)))
                .filter(|&(_, len)| self.at + len <= self.end && self.list.len() < self.max);
            let Some((remote, len)) = fits else {
                self.list.truncate(len_before);
                self.at = at_before;
                return None;
            };
            let read = Verb::Read {
                remote,
                local: self.at,
                len,
            };
            self.list.push(Candidate {
                key,
                index,
                slot,
                read,
            });
            self.at += len;
        }
        Some(self.list.len() - len_before)
    }

    /// The READs, in the order they were added.
    pub fn reads(&self) -> impl Iterator<Item = Verb> + '_ {
        self.list.iter().map(|c| c.read)
    }

    /// Key `key`'s candidates, lowest slot first.
    pub fn of_key(&self, key: usize) -> impl Iterator<Item = &Candidate> + '_ {
        self.list.iter().filter(move |c| c.key == key)
    }

    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }
}
