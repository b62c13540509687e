//! Multi-key operations.
//!
//! GET: the windows of up to `BATCH_KEYS` keys in one batch, the blocks
//! their fingerprints point at in the next — two round trips for the lot,
//! one when every key has a settled hint (its slot word and block take the
//! place of its windows).
//!
//! PUT: every new block and every key's windows in one batch (with a
//! settled hint: the block and the CAS, which is then all), the matching
//! blocks in a second, the CASes in a third (with the windows of inserted
//! keys, where their duplicate check starts) — three round trips for up to
//! 21 keys, one warm.
//!
//! DELETE: the same three batches (one with settled hints), the last
//! emptying each key's copy (a key with extra copies, left by concurrent
//! inserts, goes to the single path).
//!
//! Each key is judged exactly as the single-key call judges it (the lowest
//! copy, read within the deadline of the batch that read its windows, a
//! CAS posted only within it); a key the batch cannot settle (a block
//! failing validation, reads too slow, a resize under way, a CAS that
//! lost, more blocks than fit) goes to the single-key path.

use kv_common::layout::{
    block_len, class_for, decode_block, encode_block, CounterState, KeyHash, Payload, Slot,
    CANDIDATE_SLOTS,
};
use kv_common::transport::{read_u64, Verb, MAX_BATCH_VERBS};
use smallvec::SmallVec;

use crate::get::copy_out;
use crate::hint::Hint;
use crate::index::{meets_resize, Kind, Value};
use crate::local::{BATCH_KEYS, WINDOW_BYTES};
use crate::{Client, Error, Result};

/// One block a batch reads for a key.
#[derive(Clone, Copy)]
struct Candidate {
    key: usize,
    index: usize,
    slot: Slot,
    read: Verb,
}

/// The batch with its READs after every other verb (stable otherwise): each
/// READ of a writer's batch must see its own key's WRITE or CAS, and no
/// WRITE or atomic needs to follow a READ (see `Verb` for the order a batch
/// keeps).
fn reads_last(mut verbs: SmallVec<[Verb; MAX_BATCH_VERBS]>) -> SmallVec<[Verb; MAX_BATCH_VERBS]> {
    verbs.sort_by_key(|v| matches!(v, Verb::Read { .. }));
    verbs
}

/// A key's copies as a writer sees them: candidate index, slot, contents.
type WriterCopies = SmallVec<[(usize, Slot, Kind); 2]>;

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
                    verbs.extend(self.batch_window_reads(i, &hashes[i]));
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
            let slots = self.batch_slots(i);
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
            verbs.push(self.epoch_read());
        }
        verbs.extend(candidates.iter().map(|c| c.read));
        if !verbs.is_empty() {
            self.conn.post(&verbs)?;
        }
        let moved = check_epoch && self.epoch_changed();
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
                    Payload::Counter { sealed: true, .. } => {
                        // Being unlinked: the single path waits on it.
                        found = None;
                        suspect = true;
                        break;
                    }
                    Payload::Counter {
                        value,
                        state: CounterState::Settled,
                        ..
                    } => Value::Counter(value),
                    Payload::Counter { .. } => continue,
                };
                found = Some((c.index, c.slot, value));
                break;
            }
            match found {
                Some((index, slot, value)) => {
                    let counter = match value {
                        Value::Counter(n) => Some(n),
                        Value::Bytes(_) => None,
                    };
                    copy_out(self.conn.local(), value, out[i].insert(Vec::new()));
                    let alone = matching[i] == 1;
                    let pos = hashes[i].slot_pos(index);
                    self.saw(key, pos, slot, clock, alone, counter);
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

/// How one key of a multi-key PUT is being written.
#[derive(Clone, Copy)]
enum Publish {
    /// A settled hint: WRITE and CAS went in the first batch.
    Blind(Hint),
    /// Its copies are being read.
    Located,
    /// CAS over the lowest copy at candidate `index`.
    Update {
        index: usize,
        old: Slot,
    },
    /// CAS into the empty candidate `index`.
    Insert {
        index: usize,
    },
    /// The batch cannot settle it: the single-key path does.
    Single,
    Done,
}

impl Client {
    /// Writes the leading pairs of `pairs` that one batch holds: every
    /// block and every key's windows in one batch (a key with a settled
    /// hint: its block and the CAS instead), the matching blocks in the
    /// next, the CASes (and inserted keys' windows, for the duplicate check)
    /// in a third. Returns how many pairs it took; a key it could not
    /// settle has been written by the single-key path.
    pub(crate) fn put_batch(&mut self, pairs: &[(&[u8], &[u8])]) -> Result<usize> {
        // Blocks, staged in the candidate area: the first may lease (and
        // give back spent space, which is why later ones may not: a block
        // taken but not yet published must stay this client's).
        let mut blocks: SmallVec<[(u64, u8, usize); BATCH_KEYS]> = SmallVec::new();
        let mut staged = self.layout.reads;
        for (i, (key, value)) in pairs.iter().enumerate().take(MAX_BATCH_VERBS / 3) {
            let used = block_len(key.len(), value.len());
            let class = class_for(used).ok_or(Error::ValueTooLarge {
                len: value.len(),
                max: self.max_value,
            })?;
            let len = used.div_ceil(8) as usize * 8;
            let repeated = pairs[..i].iter().any(|(k, _)| k == key);
            if repeated || staged + len > self.layout.len {
                break;
            }
            let offset = match i {
                0 => self.take_block(class)?,
                _ => match self.alloc.take(class) {
                    Some(offset) => offset,
                    None => break,
                },
            };
            encode_block(key, value, &mut self.conn.local_mut()[staged..]);
            blocks.push((offset, class, staged));
            staged += len;
        }
        let n = blocks.len();
        let pairs = &pairs[..n];
        let g = self.info.geometry;
        let hashes: SmallVec<[KeyHash; BATCH_KEYS]> = pairs
            .iter()
            .map(|(k, _)| KeyHash::new(k, g.bucket_count))
            .collect();
        let news: SmallVec<[Slot; BATCH_KEYS]> = (0..n)
            .map(|i| Slot::new(hashes[i].fingerprint, blocks[i].1, blocks[i].0))
            .collect();

        // First batch.
        let mut verbs: SmallVec<[Verb; MAX_BATCH_VERBS]> = SmallVec::new();
        let mut plan: SmallVec<[Publish; BATCH_KEYS]> = SmallVec::new();
        for (i, (key, value)) in pairs.iter().enumerate() {
            let (offset, _, local) = blocks[i];
            verbs.push(Verb::Write {
                remote: offset,
                local,
                len: block_len(key.len(), value.len()).div_ceil(8) as usize * 8,
            });
            match self.blind_hint(key) {
                Some(hint) => {
                    verbs.push(Verb::Cas {
                        remote: g.slot_offset(hint.pos),
                        local: self.layout.batch_word(i),
                        expect: hint.slot.0,
                        swap: news[i].0,
                    });
                    plan.push(Publish::Blind(hint));
                }
                None => {
                    verbs.extend(self.batch_window_reads(i, &hashes[i]));
                    plan.push(Publish::Located);
                }
            }
        }
        let clock = self.timing.start();
        self.conn.post(&reads_last(verbs))?;
        self.pause_if_slow();

        // The blind ones are done; the others' copies are read in a second
        // batch (the staged blocks are written: their space is free again).
        let mut located: SmallVec<[bool; BATCH_KEYS]> = SmallVec::new();
        for (i, (key, _)) in pairs.iter().enumerate() {
            if let Publish::Blind(hint) = plan[i] {
                if read_u64(self.conn.local(), self.layout.batch_word(i)) == hint.slot.0 {
                    self.replaced(key, hint.pos, hint.slot, news[i], clock);
                    plan[i] = Publish::Done;
                } else {
                    self.cache.forget(key);
                    plan[i] = Publish::Single;
                }
            }
            located.push(matches!(plan[i], Publish::Located));
        }
        let keys: SmallVec<[&[u8]; BATCH_KEYS]> = pairs.iter().map(|p| p.0).collect();
        let copies = self.writer_copies(&keys, &hashes, &located)?;
        let mut taken: SmallVec<[(u64, usize); BATCH_KEYS]> = SmallVec::new();
        for i in 0..n {
            if !located[i] {
                continue;
            }
            plan[i] = match copies[i].as_ref().map(|c| c.first()) {
                None => Publish::Single,
                // The lowest copy is updated; copies above it belong to
                // inserts still in flight, which remove them themselves.
                Some(Some(&(index, old, _))) => Publish::Update { index, old },
                Some(None) => {
                    // An empty slot no other key of this batch takes.
                    let mut slots = self.batch_slots(i);
                    for &(bucket, index) in &taken {
                        for (c, s) in slots.iter_mut().enumerate() {
                            let pos = hashes[i].slot_pos(c);
                            if (pos.bucket, pos.index) == (bucket, index) {
                                *s = Slot::FROZEN_EMPTY;
                            }
                        }
                    }
                    match KeyHash::insert_choice(&slots) {
                        Some(index) => {
                            let pos = hashes[i].slot_pos(index);
                            taken.push((pos.bucket, pos.index));
                            Publish::Insert { index }
                        }
                        None => Publish::Single,
                    }
                }
            };
        }

        // Third batch: the CASes, each with its key's windows for the
        // duplicate check of an insert; posted only while the reads that
        // chose them are in time.
        let mut verbs: SmallVec<[Verb; MAX_BATCH_VERBS]> = SmallVec::new();
        let in_time = clock.in_time();
        let published = self.timing.start();
        for i in 0..n {
            let (index, expect) = match plan[i] {
                Publish::Update { index, old } => (index, old),
                Publish::Insert { index } => (index, Slot::EMPTY),
                _ => continue,
            };
            if !in_time {
                plan[i] = Publish::Single;
                continue;
            }
            verbs.push(Verb::Cas {
                remote: g.slot_offset(hashes[i].slot_pos(index)),
                local: self.layout.batch_word(i),
                expect: expect.0,
                swap: news[i].0,
            });
            if let Publish::Insert { .. } = plan[i] {
                verbs.extend(self.batch_window_reads(i, &hashes[i]));
            }
        }
        if !verbs.is_empty() {
            self.conn.post(&reads_last(verbs))?;
        }
        // Every outcome is taken from the buffer before anything else is
        // posted: a duplicate check or a single-path redo may follow a
        // resize or growth, which replaces the buffer.
        let held: SmallVec<[bool; BATCH_KEYS]> = (0..n)
            .map(|i| {
                let word = read_u64(self.conn.local(), self.layout.batch_word(i));
                match plan[i] {
                    Publish::Update { old, .. } => word == old.0,
                    Publish::Insert { .. } => word == Slot::EMPTY.0,
                    _ => false,
                }
            })
            .collect();
        for (i, (key, _)) in pairs.iter().enumerate() {
            if !held[i] {
                continue;
            }
            // A resize since (met by an earlier key's duplicate check)
            // carried the copy over, keeping the lowest as a duplicate check
            // would; its position here is no hint.
            let moved = (
                self.info.geometry.index_offset,
                self.info.geometry.bucket_count,
            ) != (g.index_offset, g.bucket_count);
            match plan[i] {
                Publish::Update { index, old } => {
                    plan[i] = Publish::Done;
                    if !moved {
                        self.replaced(key, hashes[i].slot_pos(index), old, news[i], clock);
                    }
                }
                Publish::Insert { index } => {
                    plan[i] = Publish::Done;
                    if moved {
                        continue;
                    }
                    let pos = hashes[i].slot_pos(index);
                    self.cache
                        .remember(key, Hint::seen(pos, news[i], published));
                    // The duplicate check starts from the windows read with
                    // the CAS, as a single insert's does (if the buffer was
                    // replaced meanwhile, it reads them again).
                    let from = self.layout.batch_window(i, 0);
                    let to = self.layout.window(0);
                    self.conn
                        .local_mut()
                        .copy_within(from..from + 2 * WINDOW_BYTES, to);
                    self.resolve_insert(key, &hashes[i], pos, news[i], published)?;
                }
                _ => {}
            }
        }
        for (i, &(key, value)) in pairs.iter().enumerate() {
            if !matches!(plan[i], Publish::Done) {
                self.put(key, value)?;
            }
        }
        Ok(n)
    }

    /// Deletes up to `BATCH_KEYS` keys: each key's windows in one batch (a
    /// key with a settled hint: the CAS that empties its slot, which is
    /// then all), the blocks found in a second, the CASes that empty each
    /// key's copy in a third. `out[i]` says whether key `i` was there;
    /// returns the keys the batch could not settle.
    pub(crate) fn delete_batch(
        &mut self,
        keys: &[&[u8]],
        out: &mut [bool],
    ) -> Result<SmallVec<[usize; 4]>> {
        let g = self.info.geometry;
        let hashes: SmallVec<[KeyHash; BATCH_KEYS]> = keys
            .iter()
            .map(|k| KeyHash::new(k, g.bucket_count))
            .collect();
        let mut verbs: SmallVec<[Verb; MAX_BATCH_VERBS]> = SmallVec::new();
        let mut blind: SmallVec<[Option<Hint>; BATCH_KEYS]> = SmallVec::new();
        for (i, key) in keys.iter().enumerate() {
            let hint = self.blind_hint(key);
            self.cache.forget(key);
            match hint {
                Some(hint) => verbs.push(Verb::Cas {
                    remote: g.slot_offset(hint.pos),
                    local: self.layout.batch_word(i),
                    expect: hint.slot.0,
                    swap: Slot::EMPTY.0,
                }),
                None => {
                    verbs.extend(self.batch_window_reads(i, &hashes[i]));
                }
            }
            blind.push(hint);
        }
        let clock = self.timing.start();
        self.conn.post(&reads_last(verbs))?;
        self.pause_if_slow();

        let mut unsettled = SmallVec::new();
        let mut located: SmallVec<[bool; BATCH_KEYS]> = SmallVec::new();
        for (i, hint) in blind.iter().enumerate() {
            if let Some(hint) = hint {
                match read_u64(self.conn.local(), self.layout.batch_word(i)) == hint.slot.0 {
                    true => out[i] = true,
                    false => unsettled.push(i),
                }
            }
            located.push(hint.is_none());
        }
        let copies = self.writer_copies(keys, &hashes, &located)?;

        // Third batch: per key, a CAS that empties the one copy a reader
        // sees (a counter that has not settled is left to its creator). A
        // key with extra copies goes to the single path, which removes them
        // before the lowest, only once each is gone (a copy left behind
        // would become the lowest and bring back an older value).
        let mut verbs: SmallVec<[Verb; MAX_BATCH_VERBS]> = SmallVec::new();
        let mut cases: SmallVec<[(usize, Slot); BATCH_KEYS]> = SmallVec::new();
        let in_time = clock.in_time();
        for i in (0..keys.len()).filter(|&i| located[i]) {
            let Some(copies) = &copies[i] else {
                unsettled.push(i);
                continue;
            };
            let mut readable = copies.iter().filter(|c| c.2.is_readable());
            match (readable.next(), readable.next()) {
                // Read in time, no copy: the key was not there.
                (None, _) if in_time => out[i] = false,
                (Some(&(index, slot, _)), None) if in_time => {
                    verbs.push(Verb::Cas {
                        remote: g.slot_offset(hashes[i].slot_pos(index)),
                        local: self.layout.batch_word(i),
                        expect: slot.0,
                        swap: Slot::EMPTY.0,
                    });
                    cases.push((i, slot));
                }
                _ => unsettled.push(i),
            }
        }
        if !verbs.is_empty() {
            self.conn.post(&verbs)?;
        }
        let mut failed: SmallVec<[usize; 4]> = SmallVec::new();
        for &(i, slot) in &cases {
            match read_u64(self.conn.local(), self.layout.batch_word(i)) == slot.0 {
                true => out[i] = true,
                false => failed.push(i),
            }
        }
        unsettled.extend(failed);
        Ok(unsettled)
    }

    /// Every copy of each `located` key, as a writer sees them, lowest
    /// first, from the windows the last batch read: the blocks of the
    /// matching slots are read in one batch. None for a key that batch
    /// cannot settle: a resize under way, a block past the region, failing
    /// validation, not fitting, or a counter copy (the single path locks a
    /// settled counter, and gives up a pending one, before unlinking it).
    fn writer_copies(
        &mut self,
        keys: &[&[u8]],
        hashes: &[KeyHash],
        located: &[bool],
    ) -> Result<SmallVec<[Option<WriterCopies>; BATCH_KEYS]>> {
        let g = self.info.geometry;
        let mut candidates: SmallVec<[Candidate; BATCH_KEYS]> = SmallVec::new();
        let mut settles: SmallVec<[bool; BATCH_KEYS]> = located.iter().copied().collect();
        let mut at = self.layout.reads;
        for i in (0..keys.len()).filter(|&i| located[i]) {
            let slots = self.batch_slots(i);
            if meets_resize(&slots) {
                settles[i] = false;
                continue;
            }
            for (index, &slot) in slots.iter().enumerate() {
                if slot.is_empty() || slot.fingerprint() != hashes[i].fingerprint {
                    continue;
                }
                let span = g.block_span(slot);
                match span.filter(|&(_, len)| at + len <= self.layout.len) {
                    Some((remote, len)) if candidates.len() < MAX_BATCH_VERBS => {
                        let read = Verb::Read {
                            remote,
                            local: at,
                            len,
                        };
                        candidates.push(Candidate {
                            key: i,
                            index,
                            slot,
                            read,
                        });
                        at += len;
                    }
                    _ => settles[i] = false,
                }
            }
        }
        let reads: SmallVec<[Verb; MAX_BATCH_VERBS]> = candidates.iter().map(|c| c.read).collect();
        if !reads.is_empty() {
            self.conn.post(&reads)?;
        }
        let mut copies: SmallVec<[Option<WriterCopies>; BATCH_KEYS]> = SmallVec::new();
        for (i, key) in keys.iter().enumerate() {
            let mut found = WriterCopies::new();
            if !settles[i] {
                copies.push(None);
                continue;
            }
            for c in candidates.iter().filter(|c| c.key == i) {
                let Verb::Read { local, len, .. } = c.read else {
                    continue;
                };
                match decode_block(&self.conn.local()[local..local + len]) {
                    Ok(view) if view.key == *key => {
                        let kind = Kind::of(&view.payload);
                        // A counter is unlinked under its lock (or, not
                        // settled, given up first): the single path does.
                        if let Kind::Counter { .. } = kind {
                            settles[i] = false;
                        }
                        found.push((c.index, c.slot, kind));
                    }
                    Ok(_) => {}
                    // Damage or a race: the single path retries and reports.
                    Err(_) => settles[i] = false,
                }
            }
            copies.push(settles[i].then_some(found));
        }
        Ok(copies)
    }

    /// The READs of key `k`'s two windows in a multi-key batch.
    fn batch_window_reads(&self, k: usize, kh: &KeyHash) -> [Verb; 2] {
        let g = &self.info.geometry;
        std::array::from_fn(|w| Verb::Read {
            remote: g.bucket_offset(kh.windows[w]),
            local: self.layout.batch_window(k, w),
            len: WINDOW_BYTES,
        })
    }

    /// Key `k`'s candidate slots as its windows in a multi-key batch left
    /// them.
    fn batch_slots(&self, k: usize) -> [Slot; CANDIDATE_SLOTS] {
        let local = self.conn.local();
        std::array::from_fn(|c| Slot(read_u64(local, self.layout.batch_window(k, 0) + 8 * c)))
    }
}
