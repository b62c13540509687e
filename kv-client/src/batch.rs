//! Multi-key GET: the windows of up to `BATCH_KEYS` keys in one batch, the
//! blocks their fingerprints point at in the next — two round trips for
//! the lot, one when every key has a settled hint (its slot word and block
//! take the place of its windows). Each key is judged exactly as a single
//! GET judges it (the lowest copy a reader sees, read within the deadline
//! of the batch that read its windows); a key the batch cannot settle (a
//! block failing validation, reads too slow, a resize under way, more
//! blocks than fit) is read again on its own by the single-key path.

use kv_common::layout::EPOCH_OFFSET;
use kv_common::layout::{decode_block, CounterState, KeyHash, Payload, Slot, CANDIDATE_SLOTS};
use kv_common::transport::{read_u64, Verb, MAX_BATCH_VERBS};
use smallvec::SmallVec;

use crate::get::copy_out;
use crate::hint::Hint;
use crate::index::{meets_resize, Value};
use crate::local::{BATCH_KEYS, WINDOW_BYTES};
use crate::{Client, Result};

/// One block a batch reads for a key.
#[derive(Clone, Copy)]
struct Candidate {
    key: usize,
    index: usize,
    slot: Slot,
    read: Verb,
}

/// What the first batch read for a key.
#[derive(Clone, Copy)]
enum First {
    Windows,
    /// A settled hint's slot word and block.
    Hinted(Hint, Verb),
}

impl Client {
    /// Reads up to `BATCH_KEYS` keys into `out`; returns the keys it could
    /// not settle, for the single-key path.
    pub(crate) fn get_batch(
        &mut self,
        keys: &[&[u8]],
        out: &mut [Option<Vec<u8>>],
    ) -> Result<SmallVec<[usize; 4]>> {
        debug_assert!(keys.len() <= BATCH_KEYS && keys.len() == out.len());
        let g = self.info.geometry;
        let hashes: SmallVec<[KeyHash; BATCH_KEYS]> = keys
            .iter()
            .map(|k| KeyHash::new(k, g.bucket_count))
            .collect();
        let mut unsettled = SmallVec::new();

        // First batch: each key's windows, or its settled hint's slot word
        // and block.
        let mut verbs: SmallVec<[Verb; MAX_BATCH_VERBS]> = SmallVec::new();
        let mut firsts: SmallVec<[First; BATCH_KEYS]> = SmallVec::new();
        let mut at = self.layout.reads;
        for (i, key) in keys.iter().enumerate() {
            let hinted = self
                .fresh_hint(key)
                .filter(Hint::is_sole)
                .and_then(|h| Some((h, g.block_span(h.slot)?)))
                .filter(|&(_, (_, len))| at + len <= self.layout.len);
            match hinted {
                Some((hint, (remote, len))) => {
                    let block = Verb::Read {
                        remote,
                        local: at,
                        len,
                    };
                    at += len;
                    verbs.push(Verb::Read {
                        remote: g.slot_offset(hint.pos),
                        local: self.layout.batch_word(i),
                        len: 8,
                    });
                    verbs.push(block);
                    firsts.push(First::Hinted(hint, block));
                }
                None => {
                    for w in 0..2 {
                        verbs.push(Verb::Read {
                            remote: g.bucket_offset(hashes[i].windows[w]),
                            local: self.layout.batch_window(i, w),
                            len: WINDOW_BYTES,
                        });
                    }
                    firsts.push(First::Windows);
                }
            }
        }
        let clock = self.timing.start();
        self.conn.post(&verbs)?;
        self.pause_if_slow();

        // Hinted keys are done (or go to the single path); the others'
        // matching slots become the second batch.
        let mut candidates: SmallVec<[Candidate; BATCH_KEYS]> = SmallVec::new();
        // Slots whose fingerprint matches, per key: one means a copy found
        // there is the only one (what lets a hint settle).
        let mut matching = [0usize; BATCH_KEYS];
        let mut check_epoch = false;
        for (i, key) in keys.iter().enumerate() {
            let local = self.conn.local();
            if let First::Hinted(hint, block) = firsts[i] {
                let now = Slot(read_u64(local, self.layout.batch_word(i)));
                let value = (clock.in_time() && now == hint.slot)
                    .then(|| self.value_in(key, block))
                    .flatten();
                match value {
                    Some(value) => {
                        copy_out(self.conn.local(), value, out[i].insert(Vec::new()));
                        let seen = hint.confirmed(hint.slot, clock.started(), true, &self.timing);
                        self.cache.remember(key, seen);
                    }
                    None => {
                        self.cache.forget(key);
                        unsettled.push(i);
                    }
                }
                continue;
            }
            let slots: [Slot; CANDIDATE_SLOTS] = std::array::from_fn(|c| {
                Slot(read_u64(local, self.layout.batch_window(i, 0) + 8 * c))
            });
            check_epoch |= meets_resize(&slots);
            for (index, &slot) in slots.iter().enumerate() {
                let live = slot.thawed();
                if live.is_empty() || live.fingerprint() != hashes[i].fingerprint {
                    continue;
                }
                matching[i] += 1;
                let span = g.block_span(live);
                match span.filter(|&(_, len)| at + len <= self.layout.len) {
                    Some((remote, len)) if candidates.len() + 1 < MAX_BATCH_VERBS => {
                        candidates.push(Candidate {
                            key: i,
                            index,
                            slot,
                            read: Verb::Read {
                                remote,
                                local: at,
                                len,
                            },
                        });
                        at += len;
                    }
                    // Past the region this client knows, or no room: the
                    // single path follows it.
                    _ => {
                        if unsettled.last() != Some(&i) {
                            unsettled.push(i);
                        }
                    }
                }
            }
        }

        let mut verbs: SmallVec<[Verb; MAX_BATCH_VERBS]> = SmallVec::new();
        if check_epoch {
            verbs.push(Verb::Read {
                remote: EPOCH_OFFSET,
                local: self.layout.epoch,
                len: 8,
            });
        }
        verbs.extend(candidates.iter().map(|c| c.read));
        if !verbs.is_empty() {
            self.conn.post(&verbs)?;
        }
        let moved = check_epoch && read_u64(self.conn.local(), self.layout.epoch) != g.epoch;
        let trusted = clock.in_time() && !moved;
        for (i, key) in keys.iter().enumerate() {
            if matches!(firsts[i], First::Hinted(..)) || unsettled.contains(&i) {
                continue;
            }
            if !trusted {
                unsettled.push(i);
                continue;
            }
            // The key's candidates, lowest first (they were read in slot
            // order): the first a reader sees is its value.
            let mut suspect = false;
            let mut found = None;
            for c in candidates.iter().filter(|c| c.key == i) {
                let Verb::Read { local, len, .. } = c.read else {
                    continue;
                };
                let bytes = &self.conn.local()[local..local + len];
                let Ok(view) = decode_block(bytes) else {
                    suspect = true;
                    continue;
                };
                if view.key != *key {
                    continue;
                }
                let value = match view.payload {
                    Payload::Bytes(v) => {
                        let start = local + (v.as_ptr() as usize - bytes.as_ptr() as usize);
                        Value::Bytes(start..start + v.len())
                    }
                    Payload::Counter {
                        value,
                        state: CounterState::Settled,
                    } => Value::Counter(value),
                    Payload::Counter { .. } => continue,
                };
                found = Some((c.index, c.slot, value));
                break;
            }
            match found {
                Some((index, slot, value)) => {
                    copy_out(self.conn.local(), value, out[i].insert(Vec::new()));
                    let alone = matching[i] == 1;
                    self.saw(key, hashes[i].slot_pos(index), slot, clock, alone);
                }
                // A block that failed validation may have been the key's:
                // the single path retries and reports damage.
                None if suspect => unsettled.push(i),
                None => {
                    out[i] = None;
                    self.cache.forget(key);
                }
            }
        }
        Ok(unsettled)
    }
}
