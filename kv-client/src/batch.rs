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
    block_head_len, block_len, class_for, counter_block_len, counter_words, encode_block,
    encode_counter_block, Geometry, KeyHash, Slot, SlotPos, COUNTER_GENERATION, COUNTER_SETTLED,
};
use kv_common::transport::{read_u64, Verb, MAX_BATCH_VERBS};
use smallvec::SmallVec;

use crate::candidates::CandidateReads;
use crate::clock::OpClock;
use crate::get::{copy_out, SoleRead};
use crate::hint::{Alone, Hint, Seen};
use crate::index::{meets_resize, Holds, Kind, ScanMode, Slots, Value};
use crate::local::{BATCH_KEYS, WINDOW_BYTES};
use crate::{Client, Error, Result};

type Verbs = SmallVec<[Verb; MAX_BATCH_VERBS]>;
type Hashes = SmallVec<[KeyHash; BATCH_KEYS]>;
/// Keys of a batch, by their place in it, that the single-key path settles.
pub(crate) type Unsettled = SmallVec<[usize; 4]>;

/// The batch with its READs after every other verb (stable otherwise): each
/// READ of a writer's batch must see its own key's WRITE or CAS, and no
/// WRITE or atomic needs to follow a READ (see `Verb` for the order a batch
/// keeps).
fn reads_last(mut verbs: Verbs) -> Verbs {
    verbs.sort_by_key(|v| matches!(v, Verb::Read { .. }));
    verbs
}

/// The keys' hashes for an index of `buckets` buckets.
fn hash_keys<'k>(keys: impl Iterator<Item = &'k [u8]>, buckets: u64) -> Hashes {
    keys.map(|k| KeyHash::new(k, buckets)).collect()
}

/// A key's copies as a writer sees them: candidate index, slot, contents.
type WriterCopies = SmallVec<[(usize, Slot, Kind); 2]>;

/// What the first batch of a multi-key GET read for a key.
#[derive(Clone, Copy)]
enum First {
    Windows,
    /// A settled hint's slot word and block.
    Sole(SoleRead),
}

/// What a key's candidates, as a batch read them, show a reader.
enum Lowest {
    /// The lowest copy: candidate `index`, slot, contents and value.
    Found(usize, Slot, Kind, Value),
    Absent,
    /// A block failed validation or is being unlinked: the single path
    /// retries (and reports damage).
    Suspect,
}

/// A multi-key GET of one connection, between its batches: started by
/// [`Client::get_started`], carried on by [`Client::get_second`] and ended
/// by [`Client::get_done`], each of which waits for the batch the one
/// before started. A client of several servers starts each server's, then
/// waits for all (see `ClusterClient::get_many`).
pub(crate) struct GetBatch {
    hashes: Hashes,
    firsts: SmallVec<[First; BATCH_KEYS]>,
    /// Where the hinted blocks end in the local buffer.
    at: usize,
    clock: OpClock,
    /// The second batch: the candidates it reads, how many slots of each
    /// key matched, the keys it reads, whether it checks the epoch.
    reads: Option<CandidateReads>,
    matching: [usize; BATCH_KEYS],
    read: SmallVec<[usize; BATCH_KEYS]>,
    check_epoch: bool,
    /// The keys the single path settles: known after the first batch for
    /// some, after the second for all.
    pub(crate) unsettled: Unsettled,
}

impl Client {
    /// Reads up to `BATCH_KEYS` keys into `values` (each cleared and
    /// filled), setting `found`; returns the keys it could not settle, for
    /// the single-key path.
    pub(crate) fn get_batch(
        &mut self,
        keys: &[&[u8]],
        values: &mut [Vec<u8>],
        found: &mut [bool],
    ) -> Result<Unsettled> {
        let mut batch = self.get_started(keys)?;
        self.get_second(&mut batch, keys, values, found)?;
        self.get_done(&mut batch, keys, values, found)
    }

    /// Starts the first batch of a GET of `keys` (up to `BATCH_KEYS`).
    pub(crate) fn get_started(&mut self, keys: &[&[u8]]) -> Result<GetBatch> {
        debug_assert!(keys.len() <= BATCH_KEYS);
        self.keep_read_lease()?;
        let hashes = hash_keys(keys.iter().copied(), self.info.geometry.bucket_count);
        let mut verbs = Verbs::new();
        let mut firsts = SmallVec::new();
        let at = self.get_first_batch(keys, &hashes, &mut verbs, &mut firsts);
        let clock = self.timing.start();
        self.conn.start(&verbs)?;
        Ok(GetBatch {
            hashes,
            firsts,
            at,
            clock,
            reads: None,
            matching: [0; BATCH_KEYS],
            read: SmallVec::new(),
            check_epoch: false,
            unsettled: Unsettled::new(),
        })
    }

    /// Waits for the first batch; keys with a sole hint are done (or go to
    /// the single path), and the others' matching blocks are the second
    /// batch, started here.
    pub(crate) fn get_second(
        &mut self,
        b: &mut GetBatch,
        keys: &[&[u8]],
        values: &mut [Vec<u8>],
        found: &mut [bool],
    ) -> Result<()> {
        debug_assert!(keys.len() == values.len());
        self.conn.finish()?;
        self.pause_if_slow();
        let mut windows: SmallVec<[usize; BATCH_KEYS]> = SmallVec::new();
        for (i, first) in b.firsts.iter().enumerate() {
            match *first {
                // (A whole block read always gives its value.)
                First::Sole(sole) => match self.sole_value(keys[i], &sole, b.clock).flatten() {
                    Some(value) => {
                        copy_out(self.conn.local(), value, &mut values[i]);
                        found[i] = true;
                    }
                    None => b.unsettled.push(i),
                },
                First::Windows => windows.push(i),
            }
        }
        let g = self.info.geometry;
        let mut reads = CandidateReads::new(b.at, self.layout.len, MAX_BATCH_VERBS - 1);
        // Slots whose fingerprint matches, per key: one means a copy found
        // there is the only one (what lets a hint settle).
        for i in windows {
            let slots = self.batch_slots(i);
            b.check_epoch |= meets_resize(&slots);
            match reads.add_key(&g, (i, usize::MAX), &b.hashes[i], &slots) {
                Some(n) => {
                    b.matching[i] = n;
                    b.read.push(i);
                }
                // Past the region this client knows, or no room.
                None => b.unsettled.push(i),
            }
        }
        let mut verbs = Verbs::new();
        if b.check_epoch {
            verbs.push(self.epoch_read());
        }
        verbs.extend(reads.reads());
        b.reads = Some(reads);
        if !verbs.is_empty() {
            self.conn.start(&verbs)?;
        }
        Ok(())
    }

    /// Waits for the second batch and reads each key's lowest copy;
    /// returns the keys the single path settles.
    pub(crate) fn get_done(
        &mut self,
        b: &mut GetBatch,
        keys: &[&[u8]],
        values: &mut [Vec<u8>],
        found: &mut [bool],
    ) -> Result<Unsettled> {
        self.conn.finish()?;
        let (hashes, clock, matching) = (&b.hashes, b.clock, &b.matching);
        let mut unsettled = std::mem::take(&mut b.unsettled);
        let read = std::mem::take(&mut b.read);
        let moved = b.check_epoch && self.epoch_changed();
        let Some(reads) = b.reads.as_ref().filter(|_| clock.in_time() && !moved) else {
            unsettled.extend(read);
            return Ok(unsettled);
        };
        for i in read {
            match self.lowest_candidate(keys[i], reads, i) {
                Lowest::Found(index, slot, kind, value) => {
                    copy_out(self.conn.local(), value, &mut values[i]);
                    found[i] = true;
                    let alone = matching[i] == 1;
                    let pos = hashes[i].slot_pos(index);
                    self.saw(
                        keys[i],
                        Seen::new((pos, slot), clock),
                        Alone::proven_if(alone),
                        kind.settled_counter(),
                    );
                }
                Lowest::Suspect => unsettled.push(i),
                Lowest::Absent => {
                    found[i] = false;
                    self.cache.forget(keys[i]);
                }
            }
        }
        Ok(unsettled)
    }

    /// The first batch of a multi-key GET: each key's windows, or its
    /// settled hint's slot word and block, into `verbs`, and what it reads
    /// for each key into `firsts` (both filled in place: they are large to
    /// move). Returns where the hinted blocks end.
    fn get_first_batch(
        &mut self,
        keys: &[&[u8]],
        hashes: &Hashes,
        verbs: &mut Verbs,
        firsts: &mut SmallVec<[First; BATCH_KEYS]>,
    ) -> usize {
        let g = self.info.geometry;
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
                    let sole = self.sole_read(hint, block, self.layout.batch_word(i));
                    verbs.extend_from_slice(&sole.verbs());
                    firsts.push(First::Sole(sole));
                }
                None => {
                    verbs.extend_from_slice(&self.batch_window_reads(i, &hashes[i]));
                    firsts.push(First::Windows);
                }
            }
        }
        at
    }

    /// The lowest of key `k`'s candidates that holds it, as a reader
    /// judges a block (`holds`), in slot order.
    fn lowest_candidate(&self, key: &[u8], reads: &CandidateReads, k: usize) -> Lowest {
        let mut suspect = false;
        for c in reads.of_key(k) {
            match self.holds(key, c.local(), ScanMode::Lowest) {
                // (`Key` is only the answer of a head read: never here.)
                Holds::Damaged | Holds::Key => suspect = true,
                Holds::OtherKey | Holds::Pending => {}
                // Being unlinked: the single path waits on it.
                Holds::Sealed { .. } => return Lowest::Suspect,
                Holds::Copy(kind, value) => return Lowest::Found(c.index, c.slot, kind, value),
            }
        }
        match suspect {
            true => Lowest::Suspect,
            false => Lowest::Absent,
        }
    }
}

/// A multi-key DELETE under way (see [`Client::delete_batch`]): the keys'
/// hashes, their settled hints (whose CAS the first batch posted), the
/// first batch's clock; then the copies read and the CASes that empty
/// them.
pub(crate) struct DeleteBatch {
    hashes: Hashes,
    blind: SmallVec<[Option<Hint>; BATCH_KEYS]>,
    clock: OpClock,
    /// Which keys' windows the first batch read.
    located: SmallVec<[bool; BATCH_KEYS]>,
    copies: Option<CopyReads>,
    /// Each CAS of the third batch: key, position, the slot it empties.
    cases: Option<SmallVec<[(usize, SlotPos, Slot); BATCH_KEYS]>>,
    unsettled: Unsettled,
}

/// The second batch of a multi-key write: the blocks its keys' windows
/// point at, and which keys it can settle.
struct CopyReads {
    reads: CandidateReads,
    settles: SmallVec<[bool; BATCH_KEYS]>,
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

/// A multi-key PUT under way: its pairs (those one batch holds), their
/// hashes, the slots that publish their new blocks, and each key's plan;
/// between [`Client::put_started`] and [`Client::put_finished`], the clock
/// of its first batch.
pub(crate) struct PutBatch<'p> {
    clock: Option<OpClock>,
    /// The second batch (the located keys' copies), and the third's clock.
    copies: Option<CopyReads>,
    published: Option<OpClock>,
    /// The geometry the batch started under.
    g: Geometry,
    /// Keys and values; with `Blocks::SettledCounters`, each value is the
    /// counter's 8 bytes (little-endian).
    pairs: &'p [(&'p [u8], &'p [u8])],
    hashes: Hashes,
    news: SmallVec<[Slot; BATCH_KEYS]>,
    plan: SmallVec<[Publish; BATCH_KEYS]>,
}

/// A batch step taken out of its order (a bug, said rather than assumed).
fn out_of_order(what: &str) -> Error {
    Error::Internal(format!("a {what} batch's steps out of order"))
}

/// A block staged for a multi-key PUT: where it goes, its class, where it
/// lies in the local buffer, its length (whole words).
type Staged = (u64, u8, usize, usize);

/// What a multi-key PUT writes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Blocks {
    Values,
    /// Counters, settled from the start (`Client::restore_counters`).
    SettledCounters,
}

impl Client {
    /// Writes the leading pairs of `pairs` that one batch holds: every
    /// block and every key's windows in one batch (a key with a settled
    /// hint: its block and the CAS instead), the matching blocks in the
    /// next, the CASes (and inserted keys' windows, for the duplicate check)
    /// in a third. Returns how many pairs it took, and those it could not
    /// settle, which the caller writes by the single-key path.
    ///
    /// Each batch is also a step of its own ([`Client::put_started`],
    /// [`Client::put_second`], [`Client::put_third`], [`Client::put_done`]),
    /// each starting its batch and the next waiting for it, so that a
    /// cluster client takes each step on every server before the next.
    pub(crate) fn put_batch(
        &mut self,
        pairs: &[(&[u8], &[u8])],
        kind: Blocks,
    ) -> Result<(usize, Unsettled)> {
        let mut put = self.put_started(pairs, kind)?;
        self.put_second(&mut put)?;
        self.put_third(&mut put)?;
        self.put_done(&mut put)
    }

    /// Stages the blocks of the leading pairs one batch holds and starts
    /// the first batch (see [`Client::put_batch`]). The other steps must
    /// follow, in order, on this client, before any other call on it.
    pub(crate) fn put_started<'p>(
        &mut self,
        pairs: &'p [(&'p [u8], &'p [u8])],
        kind: Blocks,
    ) -> Result<PutBatch<'p>> {
        let blocks = self.stage_blocks(pairs, kind)?;
        let pairs = &pairs[..blocks.len()];
        let g = self.info.geometry;
        let hashes = hash_keys(pairs.iter().map(|p| p.0), g.bucket_count);
        let news = (0..pairs.len())
            .map(|i| Slot::new(hashes[i].fingerprint, blocks[i].1, blocks[i].0))
            .collect();
        let mut put = PutBatch {
            clock: None,
            copies: None,
            published: None,
            g,
            pairs,
            hashes,
            news,
            plan: SmallVec::new(),
        };
        put.clock = Some(self.put_first_batch(&mut put, &blocks)?);
        Ok(put)
    }

    /// Waits for the first batch; settles the blind CASes, and starts the
    /// second batch: the located keys' copies.
    pub(crate) fn put_second(&mut self, put: &mut PutBatch) -> Result<()> {
        self.conn.finish()?;
        self.pause_if_slow();
        let clock = put.clock.ok_or_else(|| out_of_order("PUT"))?;
        let located = self.settle_blind(put, clock);
        let keys: SmallVec<[&[u8]; BATCH_KEYS]> = put.pairs.iter().map(|p| p.0).collect();
        put.copies = Some(self.copies_started(&keys, &put.hashes, &located)?);
        Ok(())
    }

    /// Waits for the copies; plans each located key's CAS and starts the
    /// third batch: the CASes.
    pub(crate) fn put_third(&mut self, put: &mut PutBatch) -> Result<()> {
        self.conn.finish()?;
        let (clock, copies) = match (put.clock, put.copies.take()) {
            (Some(clock), Some(copies)) => (clock, copies),
            _ => return Err(out_of_order("PUT")),
        };
        self.plan_publishes(put, &copies);
        put.published = Some(self.publish(put, clock)?);
        Ok(())
    }

    /// Waits for the CASes and settles what they did. Returns how many
    /// pairs the batch took, and those it could not settle.
    pub(crate) fn put_done(&mut self, put: &mut PutBatch) -> Result<(usize, Unsettled)> {
        self.conn.finish()?;
        let (Some(clock), Some(published)) = (put.clock, put.published) else {
            return Err(out_of_order("PUT"));
        };
        self.resolve_published(put, clock, published)?;
        let unsettled = (0..put.pairs.len())
            .filter(|&i| !matches!(put.plan[i], Publish::Done))
            .collect();
        Ok((put.pairs.len(), unsettled))
    }

    /// Encodes the leading pairs' blocks into the candidate area, as many
    /// as one batch holds. The first may lease (and give back spent space,
    /// which is why later ones may not: a block taken but not yet published
    /// must stay this client's).
    fn stage_blocks(
        &mut self,
        pairs: &[(&[u8], &[u8])],
        kind: Blocks,
    ) -> Result<SmallVec<[Staged; BATCH_KEYS]>> {
        let mut blocks: SmallVec<[Staged; BATCH_KEYS]> = SmallVec::new();
        let mut staged = self.layout.reads;
        for (i, (key, value)) in pairs.iter().enumerate().take(MAX_BATCH_VERBS / 3) {
            let used = match kind {
                Blocks::Values => block_len(key.len(), value.len()),
                Blocks::SettledCounters => counter_block_len(key.len()),
            };
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
            match kind {
                Blocks::Values => {
                    encode_block(key, value, &mut self.conn.local_mut()[staged..]);
                }
                Blocks::SettledCounters => {
                    let mut word = [0u8; 8];
                    word.copy_from_slice(value);
                    let out = &mut self.conn.local_mut()[staged..];
                    encode_counter_block(key, i64::from_le_bytes(word), out);
                    // Settled as its creator would settle it (see
                    // `Client::restore_counters` for why it may be at once).
                    let state = COUNTER_SETTLED | (self.random() & !(COUNTER_GENERATION - 1));
                    let (at, _) = counter_words(key.len());
                    self.conn.local_mut()[staged + at..staged + at + 8]
                        .copy_from_slice(&state.to_le_bytes());
                }
            }
            blocks.push((offset, class, staged, len));
            staged += len;
        }
        Ok(blocks)
    }

    /// Starts the first batch: every block's WRITE, and each key's settled
    /// hint's CAS or its windows. Returns its clock.
    fn put_first_batch(&mut self, put: &mut PutBatch, blocks: &[Staged]) -> Result<OpClock> {
        let g = put.g;
        let mut verbs = Verbs::new();
        for (i, (key, _)) in put.pairs.iter().enumerate() {
            let (offset, _, local, len) = blocks[i];
            verbs.push(Verb::Write {
                remote: offset,
                local,
                len,
            });
            match self.blind_hint(key) {
                Some(hint) => {
                    verbs.push(Verb::Cas {
                        remote: g.slot_offset(hint.pos),
                        local: self.layout.batch_word(i),
                        expect: hint.slot.0,
                        swap: put.news[i].0,
                    });
                    put.plan.push(Publish::Blind(hint));
                }
                None => {
                    verbs.extend_from_slice(&self.batch_window_reads(i, &put.hashes[i]));
                    put.plan.push(Publish::Located);
                }
            }
        }
        let clock = self.timing.start();
        self.conn.start(&reads_last(verbs))?;
        Ok(clock)
    }

    /// The blind CASes' outcomes: done, or for the single path. Returns
    /// which keys' windows were read.
    fn settle_blind(&mut self, put: &mut PutBatch, clock: OpClock) -> SmallVec<[bool; BATCH_KEYS]> {
        let mut located = SmallVec::new();
        for (i, (key, _)) in put.pairs.iter().enumerate() {
            if let Publish::Blind(hint) = put.plan[i] {
                if read_u64(self.conn.local(), self.layout.batch_word(i)) == hint.slot.0 {
                    self.unlinked(hint.slot);
                    self.replaced(key, Seen::new((hint.pos, hint.slot), clock), put.news[i]);
                    put.plan[i] = Publish::Done;
                } else {
                    self.cache.forget(key);
                    put.plan[i] = Publish::Single;
                }
            }
            located.push(matches!(put.plan[i], Publish::Located));
        }
        located
    }

    /// Each located key's CAS, from its copies the second batch read (into
    /// the staged blocks' space: they are written, so it is free again).
    fn plan_publishes(&mut self, put: &mut PutBatch, read: &CopyReads) {
        let keys: SmallVec<[&[u8]; BATCH_KEYS]> = put.pairs.iter().map(|p| p.0).collect();
        let copies = self.copies_done(&keys, read);
        let mut taken: SmallVec<[SlotPos; BATCH_KEYS]> = SmallVec::new();
        let located: SmallVec<[usize; BATCH_KEYS]> = (0..put.pairs.len())
            .filter(|&i| matches!(put.plan[i], Publish::Located))
            .collect();
        for i in located {
            put.plan[i] = match copies[i].as_ref().map(|c| c.first()) {
                None => Publish::Single,
                // The lowest copy is updated; copies above it belong to
                // inserts still in flight, which remove them themselves.
                Some(Some(&(index, old, _))) => Publish::Update { index, old },
                Some(None) => match self.insert_choice(i, &put.hashes[i], &taken) {
                    Some(index) => {
                        taken.push(put.hashes[i].slot_pos(index));
                        Publish::Insert { index }
                    }
                    None => Publish::Single,
                },
            };
        }
    }

    /// Where key `k` of the batch inserts: an empty slot no other key of
    /// the batch has `taken`.
    fn insert_choice(&self, k: usize, kh: &KeyHash, taken: &[SlotPos]) -> Option<usize> {
        let mut slots = self.batch_slots(k);
        for (c, s) in slots.iter_mut().enumerate() {
            if taken.contains(&kh.slot_pos(c)) {
                *s = Slot::FROZEN_EMPTY;
            }
        }
        KeyHash::insert_choice(&slots)
    }

    /// The third batch: the CASes, each with its key's windows for the
    /// duplicate check of an insert; posted only while the reads that chose
    /// them are in time. Returns its clock.
    fn publish(&mut self, put: &mut PutBatch, clock: OpClock) -> Result<OpClock> {
        let g = put.g;
        let mut verbs = Verbs::new();
        let in_time = clock.in_time();
        let published = self.timing.start();
        for i in 0..put.pairs.len() {
            let (index, expect) = match put.plan[i] {
                Publish::Update { index, old } => (index, old),
                Publish::Insert { index } => (index, Slot::EMPTY),
                _ => continue,
            };
            if !in_time {
                put.plan[i] = Publish::Single;
                continue;
            }
            verbs.push(Verb::Cas {
                remote: g.slot_offset(put.hashes[i].slot_pos(index)),
                local: self.layout.batch_word(i),
                expect: expect.0,
                swap: put.news[i].0,
            });
            if let Publish::Insert { .. } = put.plan[i] {
                verbs.extend_from_slice(&self.batch_window_reads(i, &put.hashes[i]));
            }
        }
        if !verbs.is_empty() {
            self.conn.start(&reads_last(verbs))?;
        }
        Ok(published)
    }

    /// The CASes' outcomes: an update that held is done, an insert that
    /// held goes on to its duplicate check; the rest are for the single
    /// path.
    fn resolve_published(
        &mut self,
        put: &mut PutBatch,
        clock: OpClock,
        published: OpClock,
    ) -> Result<()> {
        let g = put.g;
        // Every outcome is taken from the buffer before anything else is
        // posted: a duplicate check or a single-path redo may follow a
        // resize or growth, which replaces the buffer.
        let held: SmallVec<[bool; BATCH_KEYS]> = (0..put.pairs.len())
            .map(|i| {
                let word = read_u64(self.conn.local(), self.layout.batch_word(i));
                match put.plan[i] {
                    Publish::Update { old, .. } => word == old.0,
                    Publish::Insert { .. } => word == Slot::EMPTY.0,
                    _ => false,
                }
            })
            .collect();
        for (i, &(key, _)) in put.pairs.iter().enumerate() {
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
            match put.plan[i] {
                Publish::Update { index, old } => {
                    put.plan[i] = Publish::Done;
                    self.unlinked(old);
                    if !moved {
                        let pos = put.hashes[i].slot_pos(index);
                        self.replaced(key, Seen::new((pos, old), clock), put.news[i]);
                    }
                }
                Publish::Insert { index } => {
                    put.plan[i] = Publish::Done;
                    if !moved {
                        let pos = put.hashes[i].slot_pos(index);
                        self.resolve_batch_insert(put, i, pos, published)?;
                    }
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// The duplicate check of key `k`'s insert at `pos`, which starts from
    /// the windows read with the CAS, as a single insert's does (if the
    /// buffer was replaced meanwhile, it reads them again).
    fn resolve_batch_insert(
        &mut self,
        put: &PutBatch,
        k: usize,
        pos: SlotPos,
        published: OpClock,
    ) -> Result<()> {
        let (key, new) = (put.pairs[k].0, put.news[k]);
        self.cache.remember(key, Hint::seen(pos, new, published));
        let from = self.layout.batch_window(k, 0);
        let to = self.layout.window(0);
        self.conn
            .local_mut()
            .copy_within(from..from + 2 * WINDOW_BYTES, to);
        self.resolve_insert(key, &put.hashes[k], Seen::new((pos, new), published))
    }

    /// Deletes up to `BATCH_KEYS` keys: each key's windows in one batch (a
    /// key with a settled hint: the CAS that empties its slot, which is
    /// then all), the blocks found in a second, the CASes that empty each
    /// key's copy in a third. `out[i]` says whether key `i` was there;
    /// returns the keys the batch could not settle.
    ///
    /// Each batch is a step of its own, as [`Client::put_batch`]'s.
    pub(crate) fn delete_batch(&mut self, keys: &[&[u8]], out: &mut [bool]) -> Result<Unsettled> {
        let mut delete = self.delete_started(keys)?;
        self.delete_second(&mut delete, keys, out)?;
        self.delete_third(&mut delete, keys, out)?;
        self.delete_done(&mut delete, out)
    }

    /// Starts the first batch of a DELETE of `keys` (see
    /// [`Client::delete_batch`]). The other steps must follow, in order,
    /// with the same keys, on this client, before any other call on it.
    pub(crate) fn delete_started(&mut self, keys: &[&[u8]]) -> Result<DeleteBatch> {
        let hashes = hash_keys(keys.iter().copied(), self.info.geometry.bucket_count);
        let mut verbs = Verbs::new();
        let mut blind: SmallVec<[Option<Hint>; BATCH_KEYS]> = SmallVec::new();
        for (i, key) in keys.iter().enumerate() {
            let hint = self.blind_hint(key);
            self.cache.forget(key);
            match hint {
                Some(hint) => verbs.push(self.batch_cas(i, hint.pos, hint.slot, Slot::EMPTY)),
                None => verbs.extend_from_slice(&self.batch_window_reads(i, &hashes[i])),
            }
            blind.push(hint);
        }
        let clock = self.timing.start();
        self.conn.start(&reads_last(verbs))?;
        Ok(DeleteBatch {
            hashes,
            blind,
            clock,
            located: SmallVec::new(),
            copies: None,
            cases: None,
            unsettled: Unsettled::new(),
        })
    }

    /// Waits for the first batch: a blind CAS that held removed its key.
    /// Starts the second batch: the located keys' copies.
    pub(crate) fn delete_second(
        &mut self,
        d: &mut DeleteBatch,
        keys: &[&[u8]],
        out: &mut [bool],
    ) -> Result<()> {
        debug_assert_eq!(keys.len(), d.blind.len());
        self.conn.finish()?;
        self.pause_if_slow();
        for (i, hint) in d.blind.iter().enumerate() {
            if let Some(hint) = hint {
                match self.batch_cas_won(i, hint.slot) {
                    true => out[i] = true,
                    false => d.unsettled.push(i),
                }
            }
            d.located.push(hint.is_none());
        }
        d.copies = Some(self.copies_started(keys, &d.hashes, &d.located)?);
        Ok(())
    }

    /// Waits for the copies. Starts the third batch: per key, a CAS that
    /// empties the one copy a reader sees (a counter that has not settled
    /// is left to its creator). A key with extra copies goes to the single
    /// path, which removes them before the lowest, only once each is gone
    /// (a copy left behind would become the lowest and bring back an older
    /// value).
    pub(crate) fn delete_third(
        &mut self,
        d: &mut DeleteBatch,
        keys: &[&[u8]],
        out: &mut [bool],
    ) -> Result<()> {
        self.conn.finish()?;
        let read = d.copies.take().ok_or_else(|| out_of_order("DELETE"))?;
        let copies = self.copies_done(keys, &read);
        let in_time = d.clock.in_time();
        let mut cases = SmallVec::new();
        for i in (0..keys.len()).filter(|&i| d.located[i]) {
            let Some(copies) = &copies[i] else {
                d.unsettled.push(i);
                continue;
            };
            let mut readable = copies.iter().filter(|c| c.2.is_readable());
            match (readable.next(), readable.next()) {
                // Read in time, no copy: the key was not there.
                (None, _) if in_time => out[i] = false,
                (Some(&(index, slot, _)), None) if in_time => {
                    cases.push((i, d.hashes[i].slot_pos(index), slot));
                }
                _ => d.unsettled.push(i),
            }
        }
        let verbs: Verbs = cases
            .iter()
            .map(|&(k, pos, slot)| self.batch_cas(k, pos, slot, Slot::EMPTY))
            .collect();
        if !verbs.is_empty() {
            self.conn.start(&verbs)?;
        }
        d.cases = Some(cases);
        Ok(())
    }

    /// Waits for the CASes: `out[key]` is set where one held. Returns the
    /// keys the single path settles.
    pub(crate) fn delete_done(
        &mut self,
        d: &mut DeleteBatch,
        out: &mut [bool],
    ) -> Result<Unsettled> {
        self.conn.finish()?;
        let cases = d.cases.take().ok_or_else(|| out_of_order("DELETE"))?;
        let mut unsettled = std::mem::take(&mut d.unsettled);
        for (k, _, slot) in cases {
            match self.batch_cas_won(k, slot) {
                true => out[k] = true,
                false => unsettled.push(k),
            }
        }
        Ok(unsettled)
    }

    /// Starts the batch that reads every copy of each `located` key, as a
    /// writer sees them, from the windows the last batch read: the heads of
    /// the matching slots' blocks (`ScanMode::Keys`). A key that batch
    /// cannot settle is left out: a resize under way, a block past the
    /// region, or not fitting.
    fn copies_started(
        &mut self,
        keys: &[&[u8]],
        hashes: &[KeyHash],
        located: &[bool],
    ) -> Result<CopyReads> {
        let g = self.info.geometry;
        let mut reads = CandidateReads::new(self.layout.reads, self.layout.len, MAX_BATCH_VERBS);
        let mut settles: SmallVec<[bool; BATCH_KEYS]> = located.iter().copied().collect();
        for i in (0..keys.len()).filter(|&i| located[i]) {
            let slots = self.batch_slots(i);
            // Writers read each block's head only (`ScanMode::Keys`).
            let cap = block_head_len(keys[i].len());
            settles[i] =
                !meets_resize(&slots) && reads.add_key(&g, (i, cap), &hashes[i], &slots).is_some();
        }
        if !reads.is_empty() {
            self.conn.start(&reads.reads().collect::<Verbs>())?;
        }
        Ok(CopyReads { reads, settles })
    }

    /// Each key's copies as [`Client::copies_started`]'s batch read them,
    /// lowest first, once it is finished. None for a key the batch cannot
    /// settle: left out of it, failing validation, or a counter copy (the
    /// single path locks a settled counter, and gives up a pending one,
    /// before unlinking it).
    fn copies_done(
        &self,
        keys: &[&[u8]],
        read: &CopyReads,
    ) -> SmallVec<[Option<WriterCopies>; BATCH_KEYS]> {
        (0..keys.len())
            .map(|i| {
                read.settles[i]
                    .then(|| self.writer_copies_of(keys[i], &read.reads, i))
                    .flatten()
            })
            .collect()
    }

    /// Key `k`'s copies as a writer judges its candidates' blocks
    /// (`holds`), lowest first; None if the batch cannot settle the key.
    fn writer_copies_of(
        &self,
        key: &[u8],
        reads: &CandidateReads,
        k: usize,
    ) -> Option<WriterCopies> {
        let mut found = WriterCopies::new();
        for c in reads.of_key(k) {
            match self.holds(key, c.local(), ScanMode::Keys) {
                Holds::OtherKey => {}
                // A counter (the only copy a head read gives whole) is
                // unlinked under its lock (or, not settled, given up
                // first): the single path does.
                Holds::Copy(..) | Holds::Sealed { .. } | Holds::Pending => return None,
                Holds::Key => found.push((c.index, c.slot, Kind::Bytes)),
                // Damage or a race: the single path retries and reports.
                Holds::Damaged => return None,
            }
        }
        Some(found)
    }

    /// The READs of key `k`'s two windows in a multi-key batch.
    fn batch_window_reads(&self, k: usize, kh: &KeyHash) -> [Verb; 2] {
        self.window_reads_to(kh, self.layout.batch_window(k, 0))
    }

    /// Key `k`'s candidate slots as its windows in a multi-key batch left
    /// them.
    fn batch_slots(&self, k: usize) -> Slots {
        self.slots_at(self.layout.batch_window(k, 0))
    }

    /// The CAS of key `k` of a multi-key batch, its old value landing in
    /// the key's word.
    fn batch_cas(&self, k: usize, pos: SlotPos, expect: Slot, swap: Slot) -> Verb {
        Verb::Cas {
            remote: self.info.geometry.slot_offset(pos),
            local: self.layout.batch_word(k),
            expect: expect.0,
            swap: swap.0,
        }
    }

    /// Whether key `k`'s CAS found the value it expected (whose block this
    /// client has then unlinked, and reports).
    fn batch_cas_won(&mut self, k: usize, expect: Slot) -> bool {
        let held = read_u64(self.conn.local(), self.layout.batch_word(k)) == expect.0;
        if held {
            self.unlinked(expect);
        }
        held
    }
}
