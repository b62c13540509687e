//! Heap space, as the server tracks it.
//!
//! # Who owns what
//!
//! Every byte of the heap is in exactly one of these states:
//!
//! - **free**: may be leased now;
//! - **aging**: found unreferenced by a collection, leasable once a grace
//!   period has passed (a slow reader may still be reading a block that was
//!   unlinked just before the collection looked at its slot);
//! - **leased** to one client, which alone writes new blocks into it;
//! - **retired**: given back by its client, or left by one that departed,
//!   and not yet looked at by a collection;
//! - **reserved** for an index: the current one, one a resize is building,
//!   or an old one a client may still read; never leased or collected;
//! - **settled**: none of the above — space that held blocks the index
//!   referenced when it was last looked at.
//!
//! Clients never hand freed blocks to each other: an update unlinks the old
//! block, wherever it lives, and reports it to the server. Two ways turn
//! settled or retired space into aging space, and both rest on the same
//! facts: nobody writes into settled or retired space (its client gave it
//! back, having finished every PUT into it, or was fenced), and a block,
//! once unlinked, is never linked again. So a block seen unreferenced there
//! is unreferenced for good, and every reader that could still hold its
//! offset started before it was seen.
//!
//! - **Reports**, at a cost proportional to the garbage: a reported block is
//!   counted dead once its space is given back, the block is one its writer
//!   declared (`registry.rs`), and no slot of its key's windows references
//!   it (`unlinked.rs`); a declared extent whose blocks are all dead is
//!   freed whole. A report of a block in space still leased waits with that
//!   lease.
//! - **Collections**, for what no report names (blocks unlinked by clients
//!   that died before reporting, space departed clients left, a reopened
//!   region): a scan of the index marks the blocks it references, marks
//!   everything that must stay (free, aging, leased, and space retired after
//!   the scan began), and what is left unmarked becomes aging.
//!
//! Space retired by a departed client becomes eligible a grace period after
//! the client was fenced, so that a verb it had in flight lands first.
//!
//! The server believes no client about any of this: a give-back is accepted
//! only for space leased to that client, all of one message or none of it,
//! and each client holds a bounded number of extents.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::time::Instant;

use kv_common::layout::{class_size, BUCKET_BYTES};
use kv_common::protocol::{Extent, Spent, Unlinked, START_GRANULE};

use crate::registry::BlockRegistry;
use crate::units::{UnitMap, UNIT};

pub type ClientId = u64;

/// Most extents one lease hands out: when free space is fragmented (a
/// collection frees the holes between live blocks), a lease gathers up to a
/// chunk's worth of holes in one reply instead of one hole per round trip.
pub const MAX_LEASE_EXTENTS: usize = 1024;
/// Most extents one client may hold at once (an honest one holds one lease's
/// worth: it gives everything back before leasing again).
pub const MAX_CLIENT_EXTENTS: usize = 4 * MAX_LEASE_EXTENTS;
/// Most extents one lease hands a client whose writes are confined to its
/// leases (over rdma): each costs a registration and a memory window, made
/// on the thread that serves every client.
pub const MAX_CONFINED_LEASE_EXTENTS: usize = 16;
/// Most reports waiting to be checked (16 MiB of them); beyond, reports
/// are dropped and what they named is left to a collection.
pub const MAX_READY_REPORTS: usize = 1 << 20;

/// How much a collection is wanted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    Now,
    Soon,
    No,
}

/// Why a lease was not granted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseRefusal {
    /// Nothing free, nothing being reclaimed, and a collection that began
    /// after space ran short found nothing more.
    Full,
    /// Nothing free now, but space is aging, or waiting for a collection
    /// (deletes unlink blocks no collection has seen yet).
    Busy,
    /// The client already holds too many extents.
    TooManyExtents,
}

#[derive(Debug, Clone)]
struct Lease {
    len: u64,
    client: ClientId,
    /// Reports of blocks in this lease: checked once it is given back (a
    /// block in leased space may not be published yet).
    reports: Vec<Unlinked>,
    /// A client departed while this lease was out: blocks it unlinked in
    /// this lease may never be reported, so a scan looks once it is back.
    outlived_departure: bool,
}

impl Lease {
    /// At most one report per smallest block: duplicates cannot crowd
    /// out the reports that matter past that.
    fn has_room(&self) -> bool {
        (self.reports.len() as u64) < self.len / class_size(0)
    }
}

#[derive(Debug, Clone, Copy)]
struct Retired {
    extent: Extent,
    /// A collection that starts after this may reclaim it.
    eligible: Instant,
}

pub struct HeapPool {
    start: u64,
    end: u64,
    chunk: u64,
    /// offset → length, never overlapping or touching (touching ones merge).
    free: BTreeMap<u64, u64>,
    /// The same extents as (length, offset), for best fit.
    free_by_size: BTreeSet<(u64, u64)>,
    free_bytes: u64,
    /// (leasable from, extent), in the order they were found.
    aging: VecDeque<(Instant, Extent)>,
    /// The same extents by offset, to tell whether a block overlaps one.
    aging_at: BTreeMap<u64, u64>,
    aging_bytes: u64,
    /// offset → lease; leases never overlap each other or free space.
    leases: BTreeMap<u64, Lease>,
    leased_bytes: u64,
    extents_held: HashMap<ClientId, usize>,
    retired: Vec<Retired>,
    /// offset → length of index space.
    reserved: BTreeMap<u64, u64>,
    /// Where the blocks of given-back space begin.
    registry: BlockRegistry,
    /// Reports whose space is given back, to be checked.
    ready: VecDeque<Unlinked>,
    /// Bytes carved out of space given back since the pool was made (the
    /// reclaimer derives the write rate from it; space leased and given
    /// back unused does not count).
    leased_total: u64,
    /// When the space of each departed client in `retired` becomes
    /// eligible (few: `retired` itself holds every give-back since the last
    /// scan, too many to look through at every turn).
    departed_eligible: Vec<Instant>,
    /// From when a scan should look for blocks a departed client unlinked
    /// and never reported: the last return of a lease it outlived (see
    /// `Lease::outlived_departure`), or its fence settling.
    orphans_retired: Option<Instant>,
    /// When a lease last failed for want of space, if no collection began
    /// since.
    wanted_since: Option<Instant>,
    /// When leases began to fail for want of space, if none has been
    /// granted (nor the heap called full) since: the heap is full only once
    /// a collection that began after this has found nothing.
    short_since: Option<Instant>,
    /// When the last lease was granted, and when the last collection's scan
    /// began. Updates make garbage only as they write new blocks, which
    /// takes leased space: with no lease since the last scan began, a
    /// collection ahead of need would find little new (deletes make garbage
    /// too, but a lease that then finds no room asks for one itself).
    last_lease: Option<Instant>,
    last_scan: Option<Instant>,
    /// When the last collection finished.
    last_scan_done: Option<Instant>,
}

/// Extents maturing at once from which the free maps are rebuilt rather
/// than added to one by one, if they are also an eighth of the extents
/// already free or more (a rebuild costs a pass over both and a sort of
/// the result by size, an insert a tree's descent or two).
const BULK_FREES: usize = 256;

/// How recent a collection must be for a lease it did not help to be told
/// the heap is full.
const FRESH_SCAN: std::time::Duration = std::time::Duration::from_secs(1);

impl HeapPool {
    /// A pool over `[start, end)` in which nothing is known yet: all of it is
    /// settled until the first [`HeapPool::collect`].
    pub fn new(start: u64, end: u64, chunk: u64) -> Self {
        HeapPool {
            start,
            end,
            chunk,
            free: BTreeMap::new(),
            free_by_size: BTreeSet::new(),
            free_bytes: 0,
            aging: VecDeque::new(),
            aging_at: BTreeMap::new(),
            aging_bytes: 0,
            leases: BTreeMap::new(),
            leased_bytes: 0,
            extents_held: HashMap::new(),
            retired: Vec::new(),
            reserved: BTreeMap::new(),
            registry: BlockRegistry::new(start, end),
            ready: VecDeque::new(),
            leased_total: 0,
            orphans_retired: None,
            departed_eligible: Vec::new(),
            wanted_since: None,
            short_since: None,
            last_lease: None,
            last_scan: None,
            last_scan_done: None,
        }
    }

    /// Leases space to `client`: about a chunk while space is plentiful,
    /// less as it runs short (so that clients share what is left instead of
    /// one holding it all). The first extent holds at least `min_len`; when
    /// no single extent holds the whole share, more are added (holes a
    /// collection freed), lowest offsets first, at most `max_extents` in
    /// all.
    pub fn lease(
        &mut self,
        client: ClientId,
        min_len: u64,
        max_extents: usize,
    ) -> Result<Vec<Extent>, LeaseRefusal> {
        self.mature(Instant::now());
        let held = self.extents_held.get(&client).copied().unwrap_or(0);
        if held >= MAX_CLIENT_EXTENTS {
            return Err(LeaseRefusal::TooManyExtents);
        }
        let min_len = min_len.next_multiple_of(UNIT);
        let share = (self.free_bytes / 4).next_multiple_of(4096);
        let want = self.chunk.min(share).max(min_len);
        // Best fit: the smallest extent that holds the whole share.
        if let Some(&(_, offset)) = self.free_by_size.range((want, 0)..).next() {
            self.short_since = None;
            self.last_lease = Some(Instant::now());
            let e = self.take_free(offset, want);
            self.lease_out(e, client);
            return Ok(vec![e]);
        }
        let Some(&(len, offset)) = self.free_by_size.range((min_len, 0)..).next() else {
            let now = Instant::now();
            self.wanted_since.get_or_insert(now);
            let short_since = *self.short_since.get_or_insert(now);
            // A collection that began after the shortage, and is recent:
            // an old one says nothing of deletes since.
            let collected_since = self.last_scan.is_some_and(|scan| scan >= short_since)
                && self
                    .last_scan_done
                    .is_some_and(|done| now.saturating_duration_since(done) <= FRESH_SCAN);
            if !collected_since && self.last_scan_done.is_some_and(|d| d > short_since) {
                // The streak outlived its collection (its client went
                // away, or waited long): a new one must look.
                self.short_since = Some(now);
            }
            if collected_since && self.aging.is_empty() && self.retired.is_empty() {
                // Said once per collection: deletes may free space after
                // it, and the next shortage waits for a new one.
                self.short_since = None;
                return Err(LeaseRefusal::Full);
            }
            return Err(LeaseRefusal::Busy);
        };
        self.short_since = None;
        self.last_lease = Some(Instant::now());
        let mut out = vec![self.take_free(offset, len)];
        let mut total = len;
        let most = MAX_LEASE_EXTENTS
            .min(max_extents)
            .min(MAX_CLIENT_EXTENTS - held);
        while total < want && out.len() < most {
            let Some((&offset, &len)) = self.free.iter().next() else {
                break;
            };
            out.push(self.take_free(offset, len));
            total += len;
        }
        for &e in &out {
            self.lease_out(e, client);
        }
        Ok(out)
    }

    /// Leases free space `e` to `client`: what was declared of its earlier
    /// life no longer holds.
    fn lease_out(&mut self, e: Extent, client: ClientId) {
        self.registry.forget_range(e);
        self.add_lease(e.offset, e.len, client, Vec::new());
    }

    /// A scan should look for orphans once `from` has passed (the latest
    /// such time wins: a scan that began before it may have missed some).
    fn look_for_orphans(&mut self, from: Instant) {
        self.orphans_retired = self.orphans_retired.max(Some(from));
    }

    /// Bytes clients wrote into the space they gave back (as they declare
    /// it: the rate the reclaimer paces the heap by).
    pub fn leased_total(&self) -> u64 {
        self.leased_total
    }

    /// Removes `[offset, offset + len)` from the front of the free extent
    /// that starts at `offset`.
    fn take_free(&mut self, offset: u64, len: u64) -> Extent {
        let whole = self.free.remove(&offset).unwrap_or(0);
        self.free_by_size.remove(&(whole, offset));
        let take = len.min(whole);
        if take < whole {
            self.free.insert(offset + take, whole - take);
            self.free_by_size.insert((whole - take, offset + take));
        }
        self.free_bytes -= take;
        Extent { offset, len: take }
    }

    /// Takes back space `client` will not write into again, with where its
    /// blocks begin. Each extent must lie inside one of its leases, and no
    /// two may overlap; otherwise the whole message is refused and nothing
    /// changes. What the client says it never carved is free from
    /// `uncarved_ready` (at once, unless a WRITE it had begun may still be
    /// landing there); reports waiting on the space are now checked.
    /// Returns how many waiting reports were dropped (the queue was full).
    pub fn give_back(
        &mut self,
        client: ClientId,
        spent: &[Spent],
        uncarved_ready: Instant,
    ) -> Result<u64, String> {
        let mut sorted: Vec<&Spent> = spent.iter().collect();
        sorted.sort_by_key(|s| s.extent.offset);
        let mut splits = 0usize;
        for (i, e) in sorted.iter().map(|s| s.extent).enumerate() {
            let end = e
                .offset
                .checked_add(e.len)
                .filter(|_| e.len > 0)
                .ok_or_else(|| format!("extent {}+{} is empty or wraps", e.offset, e.len))?;
            if let Some(next) = sorted.get(i + 1).map(|s| s.extent) {
                if next.offset < end {
                    return Err(format!(
                        "extents {}+{} and {}+{} overlap",
                        e.offset, e.len, next.offset, next.len
                    ));
                }
            }
            let (lo, len, holder) = self.lease_containing(e.offset).ok_or_else(|| {
                format!("extent {}+{} is not leased to this client", e.offset, e.len)
            })?;
            if holder != client || end > lo + len {
                return Err(format!(
                    "extent {}+{} is not leased to this client",
                    e.offset, e.len
                ));
            }
            if e.offset > lo && end < lo + len {
                splits += 1;
            }
        }
        let held = self.extents_held.get(&client).copied().unwrap_or(0);
        if held + splits > MAX_CLIENT_EXTENTS {
            return Err(format!(
                "giving these back would split this client's space into more than {MAX_CLIENT_EXTENTS} extents"
            ));
        }
        let now = Instant::now();
        let mut dropped = 0;
        for s in sorted {
            let e = s.extent;
            let reports = self.remove_lease_part(e);
            dropped += self.queue_ready(reports);
            self.registry.declare(s);
            let carved = s
                .carved
                .min(e.len)
                .next_multiple_of(START_GRANULE)
                .min(e.len);
            if carved < e.len {
                let uncarved = Extent {
                    offset: e.offset + carved,
                    len: e.len - carved,
                };
                if uncarved_ready > now {
                    self.push_aging(uncarved_ready, uncarved);
                } else {
                    self.insert_free(uncarved);
                }
            }
            self.leased_total += carved;
            if carved > 0 {
                self.retired.push(Retired {
                    extent: Extent {
                        offset: e.offset,
                        len: carved,
                    },
                    eligible: now,
                });
            }
        }
        Ok(dropped)
    }

    /// Takes reports of unlinked blocks: those in leased space wait with
    /// their lease, the others are queued to be checked. Returns how many
    /// were dropped (a lease's or the queue's share was full, or the block
    /// cannot be in the heap).
    pub fn report(&mut self, blocks: &[Unlinked]) -> u64 {
        let mut dropped = 0;
        for &u in blocks {
            let size = class_size(u.class);
            let in_heap = u.offset >= self.start
                && u.offset
                    .checked_add(size)
                    .is_some_and(|end| end <= self.end);
            if !in_heap {
                dropped += 1;
                continue;
            }
            match self.lease_containing(u.offset) {
                Some((lo, _, _)) => match self.leases.get_mut(&lo) {
                    Some(lease) if lease.has_room() => lease.reports.push(u),
                    _ => dropped += 1,
                },
                None => dropped += self.queue_ready(Some(u)),
            }
        }
        dropped
    }

    /// Queues reports to be checked; returns how many found no room.
    fn queue_ready(&mut self, reports: impl IntoIterator<Item = Unlinked>) -> u64 {
        let mut dropped = 0;
        for u in reports {
            if self.ready.len() < MAX_READY_REPORTS {
                self.ready.push_back(u);
            } else {
                dropped += 1;
            }
        }
        dropped
    }

    /// Up to `n` reports to check, oldest first.
    pub fn take_ready(&mut self, n: usize) -> Vec<Unlinked> {
        let n = n.min(self.ready.len());
        self.ready.drain(..n).collect()
    }

    pub fn ready_reports(&self) -> usize {
        self.ready.len()
    }

    /// The block a report names, if the report may count it dead: a block
    /// its writer declared in space it gave back (a declaration lasts only
    /// while nothing else holds any of its extent). The caller then checks
    /// that no slot references it, and counts it with
    /// [`HeapPool::free_reported`].
    pub fn reported_block(&self, u: Unlinked) -> Option<Extent> {
        let e = Extent {
            offset: u.offset,
            len: class_size(u.class),
        };
        self.registry.is_block(e.offset, e.len).then_some(e)
    }

    /// Counts dead the reported blocks that [`HeapPool::reported_block`]
    /// named and that were found unreferenced (a block named twice counts
    /// once); a declared extent dead whole is freed, leasable from
    /// `ready_at`. Returns the blocks counted and the bytes freed.
    pub fn free_reported(&mut self, blocks: &[Extent], ready_at: Instant) -> (u64, u64) {
        let (mut count, mut freed) = (0, 0);
        for &e in blocks {
            if !self.registry.is_block(e.offset, e.len) {
                continue;
            }
            count += 1;
            if let Some(whole) = self.registry.dead(e.offset, e.len) {
                // Nothing else may hold any of it (a writer's declaration
                // is believed only about its own space).
                if self.settled(whole) {
                    freed += whole.len;
                    self.push_aging(ready_at, whole);
                }
            }
        }
        (count, freed)
    }

    /// Whether nothing but settled or retired space lies in `e`: no free,
    /// aging, leased or reserved byte.
    fn settled(&self, e: Extent) -> bool {
        let end = e.offset + e.len;
        let overlaps = |map: &BTreeMap<u64, u64>| {
            map.range(..end)
                .next_back()
                .is_some_and(|(&o, &len)| o + len > e.offset)
        };
        let leased = self
            .leases
            .range(..end)
            .next_back()
            .is_some_and(|(&o, l)| o + l.len > e.offset);
        !(leased || overlaps(&self.free) || overlaps(&self.aging_at) || overlaps(&self.reserved))
    }

    fn push_aging(&mut self, ready_at: Instant, e: Extent) {
        self.aging.push_back((ready_at, e));
        self.aging_at.insert(e.offset, e.len);
        self.aging_bytes += e.len;
    }

    /// [`Self::push_aging`] for a collection's `runs` (ascending, apart
    /// from each other and from all else the pool holds); returns their
    /// bytes. The offsets are built into a map of their own and merged in,
    /// in time linear in both: a collection frees tens of thousands of
    /// holes at once, and a tree insert each, under the pool's lock, kept
    /// leases waiting 5-25 ms (merged: 1-5 ms; YCSB-A, 100 k keys, R=3).
    fn push_aging_runs(&mut self, ready_at: Instant, runs: Vec<Extent>) -> u64 {
        let bytes = runs.iter().map(|e| e.len).sum();
        // A merge rebuilds the whole map: not for a few runs into many.
        if runs.len() * 8 < self.aging_at.len() {
            self.aging_at.extend(runs.iter().map(|e| (e.offset, e.len)));
        } else {
            let mut at: BTreeMap<u64, u64> = runs.iter().map(|e| (e.offset, e.len)).collect();
            self.aging_at.append(&mut at);
        }
        self.aging.extend(runs.into_iter().map(|e| (ready_at, e)));
        self.aging_bytes += bytes;
        bytes
    }

    /// Retires everything `client` holds: it disconnected or died, and was
    /// fenced. Its space becomes eligible for collection at `eligible` (a
    /// grace period after the fence, unless it said goodbye). One that did
    /// not say goodbye may have unlinked blocks it never reported, in any
    /// space: the leases out now are scanned once they come back.
    pub fn depart(&mut self, client: ClientId, eligible: Instant, announced: bool) {
        if !announced {
            for l in self.leases.values_mut() {
                l.outlived_departure |= l.client != client;
            }
            // And in space already given back.
            self.look_for_orphans(eligible);
        }
        let mine: Vec<Extent> = self
            .leases
            .iter()
            .filter(|(_, l)| l.client == client)
            .map(|(&offset, l)| Extent { offset, len: l.len })
            .collect();
        for e in mine {
            // Nothing is declared of its space: a collection reclaims it,
            // and whatever the reports waiting on it named.
            self.remove_lease_part(e);
            self.registry.forget_range(e);
            self.retired.push(Retired {
                extent: e,
                eligible,
            });
            self.departed_eligible.push(eligible);
        }
        self.extents_held.remove(&client);
    }

    /// Completes a collection whose index scan began at `scan_started` and
    /// marked the live blocks in `live`. Unmarked space that nothing else
    /// holds becomes leasable at `ready_at`; returns its size in bytes.
    pub fn collect(&mut self, scan_started: Instant, mut live: UnitMap, ready_at: Instant) -> u64 {
        self.mark_held(scan_started, &mut live);
        self.free_runs(scan_started, live.unmarked_runs(), ready_at)
    }

    /// The first half of [`Self::collect`]: marks in `live` all the pool
    /// holds (free, aging, leased, reserved, retired since the scan began,
    /// and past its end). What is left unmarked is settled space that no
    /// slot the scan read references; the caller finds its runs without
    /// the pool's lock (over a large heap that takes milliseconds, which
    /// leases would wait) and hands them to [`Self::free_runs`]. Only a
    /// collection or a check of reports turns settled space into anything
    /// else (and [`Self::reserve_at`], at open, before any collection), so
    /// the caller holds both off between the halves (`Shared::collecting`);
    /// a lease takes free space, a give-back retires leased space, a
    /// growth adds space past the end, a release ages reserved space: all
    /// marked here.
    pub fn mark_held(&mut self, scan_started: Instant, live: &mut UnitMap) {
        self.mature(Instant::now());
        for (&offset, &len) in &self.free {
            live.mark(offset, len);
        }
        for (_, e) in &self.aging {
            live.mark(e.offset, e.len);
        }
        for (&offset, l) in &self.leases {
            live.mark(offset, l.len);
        }
        // Retired after the scan began: it may hold blocks the scan missed.
        // The rest stays retired until its runs age (`free_runs`): a lease
        // refused meanwhile must see the heap busy, not full.
        for r in self.retired.iter().filter(|r| r.eligible > scan_started) {
            live.mark(r.extent.offset, r.extent.len);
        }
        for (&offset, &len) in &self.reserved {
            live.mark(offset, len);
        }
        // Space past the pool's end is not the pool's yet: a growth publishes
        // the longer region before it hands the pool the new space, and a
        // collection whose map already covers it must not free it too (it
        // would be counted free twice and leased over live blocks).
        live.mark(self.end, u64::MAX - self.end);
    }

    /// The second half of [`Self::collect`]: `runs`, the runs left unmarked
    /// by [`Self::mark_held`] (ascending), become leasable at `ready_at`.
    /// Returns their size in bytes.
    pub fn free_runs(
        &mut self,
        scan_started: Instant,
        runs: Vec<Extent>,
        ready_at: Instant,
    ) -> u64 {
        let now = Instant::now();
        for &e in &runs {
            self.registry.forget_freed_run(e);
        }
        let freed = self.push_aging_runs(ready_at, runs);
        // What was retired before the scan began is collected now; what
        // was retired since (between the halves too) waits for the next.
        self.retired.retain(|r| r.eligible > scan_started);
        self.departed_eligible.retain(|&t| t > scan_started);
        if self.wanted_since.is_some_and(|t| t <= scan_started) {
            self.wanted_since = None;
        }
        if self.orphans_retired.is_some_and(|t| t <= scan_started) {
            self.orphans_retired = None;
        }
        self.last_scan = Some(scan_started);
        self.last_scan_done = Some(now);
        self.mature(now);
        freed
    }

    /// Whether a collection would help: now, when a lease went wanting or a
    /// departed client's space has settled; soon, when free space (aging
    /// included) is under `headroom` and written since the last scan, and
    /// the space neither free nor leased holds much more than `live` (what
    /// that scan found live): reports free what clients unlink, so a scan
    /// only pays when garbage nobody reported has piled up.
    pub fn need(&self, now: Instant, headroom: u64, live: u64) -> Need {
        let departed_settled = self.departed_eligible.iter().any(|&t| t <= now);
        let orphans = self.orphans_retired.is_some_and(|t| t <= now);
        if self.wanted_since.is_some() || departed_settled || orphans {
            Need::Now
        } else if self.last_lease > self.last_scan
            && self.short_of(headroom)
            && self.unreported_garbage(headroom, live)
        {
            Need::Soon
        } else {
            Need::No
        }
    }

    /// Whether free space, aging included, is under `headroom`.
    pub fn short_of(&self, headroom: u64) -> bool {
        self.free_bytes + self.aging_bytes < headroom
    }

    /// Whether settled space exceeds twice `live` by more than `headroom`:
    /// more garbage than reports account for.
    pub fn unreported_garbage(&self, headroom: u64, live: u64) -> bool {
        self.settled_bytes() > live.saturating_mul(2).saturating_add(headroom)
    }

    /// Bytes neither free, aging, leased nor reserved: live blocks, and
    /// garbage not yet reclaimed.
    pub fn settled_bytes(&self) -> u64 {
        let reserved: u64 = self.reserved.values().sum();
        (self.end - self.start)
            .saturating_sub(self.free_bytes + self.aging_bytes + self.leased_bytes + reserved)
    }

    /// Free bytes, counting those still waiting out their grace period.
    pub fn free_bytes(&self) -> u64 {
        self.free_bytes + self.aging_bytes
    }

    pub fn leased_bytes(&self) -> u64 {
        self.leased_bytes
    }

    /// Bytes waiting out their grace period before they are free.
    pub fn aging_bytes(&self) -> u64 {
        self.aging_bytes
    }

    /// Bytes given back or left by departed clients that no collection has
    /// looked at yet.
    pub fn retired_bytes(&self) -> u64 {
        self.retired.iter().map(|r| r.extent.len).sum()
    }

    /// Moves aged space whose grace period is over to the free map.
    pub fn mature(&mut self, now: Instant) {
        // In the order they were found: one not ready holds back those
        // behind it (as it always has), so the ready times need no order.
        let due = self
            .aging
            .iter()
            .take_while(|&&(ready, _)| ready <= now)
            .count();
        if due < BULK_FREES || due * 8 < self.free.len() {
            for _ in 0..due {
                let Some((_, e)) = self.aging.pop_front() else {
                    break;
                };
                self.aging_at.remove(&e.offset);
                self.aging_bytes -= e.len;
                self.insert_free(e);
            }
            return;
        }
        let started = Instant::now();
        let mut matured: Vec<Extent> = self.aging.drain(..due).map(|(_, e)| e).collect();
        matured.sort_unstable_by_key(|e| e.offset);
        if self.aging.is_empty() {
            self.aging_at.clear();
        } else if due * 8 < self.aging_at.len() {
            for e in &matured {
                self.aging_at.remove(&e.offset);
            }
        } else {
            self.aging_at
                .retain(|o, _| matured.binary_search_by_key(o, |e| e.offset).is_err());
        }
        let bytes: u64 = matured.iter().map(|e| e.len).sum();
        self.aging_bytes -= bytes;
        self.insert_free_sorted(&matured);
        tracing::debug!(
            extents = due,
            free_extents = self.free.len(),
            took_us = started.elapsed().as_micros() as u64,
            "matured"
        );
    }

    /// Adds `sorted` (ascending, apart from each other and from the free
    /// extents) to the free maps as [`Self::insert_free`] would one by one,
    /// touching extents merged, by rebuilding both maps from one merged
    /// pass: a collection's worth of holes (60-90 k under YCSB-A) maturing
    /// one tree insert each kept a lease waiting for the pool's lock 18-37
    /// ms; rebuilt, 4-12 ms.
    fn insert_free_sorted(&mut self, sorted: &[Extent]) {
        let old = std::mem::take(&mut self.free);
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(old.len() + sorted.len());
        let mut add = |offset: u64, len: u64| match merged.last_mut() {
            Some((o, l)) if *o + *l == offset => *l += len,
            _ => merged.push((offset, len)),
        };
        let mut new = sorted.iter().peekable();
        for (offset, len) in old {
            while let Some(e) = new.next_if(|e| e.offset < offset) {
                add(e.offset, e.len);
            }
            add(offset, len);
        }
        for e in new {
            add(e.offset, e.len);
        }
        self.free_bytes += sorted.iter().map(|e| e.len).sum::<u64>();
        self.free_by_size = merged.iter().map(|&(o, l)| (l, o)).collect();
        self.free = merged.into_iter().collect();
    }

    /// Reserves `e` for an index: space no lease or free extent holds (the
    /// index of a reopened region, before the first collection).
    pub fn reserve_at(&mut self, e: Extent) {
        self.reserved.insert(e.offset, e.len);
    }

    /// Reserves `len` contiguous free bytes for a new index, starting on a
    /// bucket boundary (in the smallest free extent that holds them), if
    /// there are any.
    pub fn reserve(&mut self, len: u64) -> Option<Extent> {
        self.mature(Instant::now());
        let len = len.next_multiple_of(UNIT);
        let aligned = |(whole, offset): (u64, u64)| {
            let start = offset.next_multiple_of(BUCKET_BYTES);
            (start + len <= offset + whole).then_some((offset, start))
        };
        let (offset, start) = self
            .free_by_size
            .range((len, 0)..)
            .find_map(|&e| aligned(e))?;
        if start > offset {
            // The unaligned head stays free.
            self.take_free(offset, start - offset);
        }
        let e = self.take_free(start, len);
        if start > offset {
            self.insert_free(Extent {
                offset,
                len: start - offset,
            });
        }
        self.reserved.insert(e.offset, e.len);
        Some(e)
    }

    /// Ends the reservation of an index nobody reads any more: its space is
    /// leasable from `ready_at` (a verb a departed client had in flight may
    /// still read it until then).
    pub fn release(&mut self, e: Extent, ready_at: Instant) {
        if self.reserved.remove(&e.offset).is_some() {
            self.push_aging(ready_at, e);
        }
    }

    /// The heap now ends at `new_end`: the new space is free.
    pub fn grow(&mut self, new_end: u64) {
        if new_end > self.end {
            let e = Extent {
                offset: self.end,
                len: new_end - self.end,
            };
            self.end = new_end;
            self.registry.grow(new_end);
            self.insert_free(e);
        }
    }

    pub fn end(&self) -> u64 {
        self.end
    }

    /// Whether leases are failing for want of space (and no collection has
    /// begun since).
    pub fn short_of_space(&self) -> bool {
        self.wanted_since.is_some()
    }

    /// The lease that holds `offset`: its start, length and client.
    fn lease_containing(&self, offset: u64) -> Option<(u64, u64, ClientId)> {
        let (&lo, l) = self.leases.range(..=offset).next_back()?;
        (offset < lo + l.len).then_some((lo, l.len, l.client))
    }

    fn add_lease(&mut self, offset: u64, len: u64, client: ClientId, reports: Vec<Unlinked>) {
        self.leases.insert(
            offset,
            Lease {
                len,
                client,
                reports,
                outlived_departure: false,
            },
        );
        self.leased_bytes += len;
        *self.extents_held.entry(client).or_default() += 1;
    }

    /// Removes `e`, which lies inside one lease, from it, keeping the parts
    /// of the lease on either side (with their reports). Returns the
    /// reports of blocks in `e`.
    fn remove_lease_part(&mut self, e: Extent) -> Vec<Unlinked> {
        let Some((lo, _, _)) = self.lease_containing(e.offset) else {
            return Vec::new();
        };
        let Some(lease) = self.leases.remove(&lo) else {
            return Vec::new();
        };
        self.leased_bytes -= lease.len;
        if let Some(n) = self.extents_held.get_mut(&lease.client) {
            *n -= 1;
        }
        let end = e.offset + e.len;
        let (mut inside, mut before, mut after) = (Vec::new(), Vec::new(), Vec::new());
        for u in lease.reports {
            match u.offset {
                o if o < e.offset => before.push(u),
                o if o >= end => after.push(u),
                _ => inside.push(u),
            }
        }
        let mut kept = Vec::new();
        if e.offset > lo {
            self.add_lease(lo, e.offset - lo, lease.client, before);
            kept.push(lo);
        }
        if end < lo + lease.len {
            self.add_lease(end, lo + lease.len - end, lease.client, after);
            kept.push(end);
        }
        for part in kept {
            if let Some(l) = self.leases.get_mut(&part) {
                l.outlived_departure = lease.outlived_departure;
            }
        }
        if lease.outlived_departure {
            self.look_for_orphans(Instant::now());
        }
        inside
    }

    fn insert_free(&mut self, e: Extent) {
        self.free_bytes += e.len;
        let mut offset = e.offset;
        let mut end = e.offset + e.len;
        if let Some((&o, &l)) = self.free.range(..offset).next_back() {
            if o + l == offset {
                self.free.remove(&o);
                self.free_by_size.remove(&(l, o));
                offset = o;
            }
        }
        if let Some(&l) = self.free.get(&end) {
            self.free.remove(&end);
            self.free_by_size.remove(&(l, end));
            end += l;
        }
        self.free.insert(offset, end - offset);
        self.free_by_size.insert((end - offset, offset));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn ext(offset: u64, len: u64) -> Extent {
        Extent { offset, len }
    }

    /// Gives `extents` back with nothing declared of them.
    fn give_back(p: &mut HeapPool, client: ClientId, extents: &[Extent]) -> Result<(), String> {
        let spent: Vec<Spent> = extents.iter().map(|&e| Spent::undeclared(e)).collect();
        p.give_back(client, &spent, Instant::now()).map(|_| ())
    }

    /// A pool over [0, len) whose first collection found `live` in use.
    fn pool(len: u64, chunk: u64, live: &[Extent]) -> HeapPool {
        let mut p = HeapPool::new(0, len, chunk);
        let now = Instant::now();
        p.collect(now, map(len, live), now);
        p
    }

    fn map(len: u64, live: &[Extent]) -> UnitMap {
        let mut m = UnitMap::new(0, len);
        for e in live {
            m.mark(e.offset, e.len);
        }
        m
    }

    /// A lease that must be granted as one extent.
    fn lease1(p: &mut HeapPool, client: ClientId, min_len: u64) -> Extent {
        let got = p.lease(client, min_len, usize::MAX).unwrap();
        assert_eq!(got.len(), 1, "{got:?}");
        got[0]
    }

    /// A collection at `at` whose freed space is leasable at once.
    fn collect_at(p: &mut HeapPool, at: Instant, live: &[Extent]) -> u64 {
        p.collect(at, map(p.end, live), at)
    }

    const HOUR: Duration = Duration::from_secs(3600);

    /// The free extents `live` (ascending, apart) leaves in a pool over
    /// [0, len), touching ones one extent.
    fn holes_between(len: u64, live: &[Extent]) -> Vec<(u64, u64)> {
        let mut holes = Vec::new();
        let mut at = 0;
        for e in live {
            if e.offset > at {
                holes.push((at, e.offset - at));
            }
            at = e.offset + e.len;
        }
        if at < len {
            holes.push((at, len - at));
        }
        holes
    }

    /// The free maps hold exactly `holes`, and nothing is aging but `aging`.
    fn assert_free_maps(p: &HeapPool, holes: &[(u64, u64)], aging: &[(u64, u64)]) {
        let free: Vec<(u64, u64)> = p.free.iter().map(|(&o, &l)| (o, l)).collect();
        assert_eq!(free, holes);
        let by_size: BTreeSet<(u64, u64)> = holes.iter().map(|&(o, l)| (l, o)).collect();
        assert_eq!(p.free_by_size, by_size);
        assert_eq!(p.free_bytes, holes.iter().map(|h| h.1).sum::<u64>());
        let aging_at: Vec<(u64, u64)> = p.aging_at.iter().map(|(&o, &l)| (o, l)).collect();
        assert_eq!(aging_at, aging);
        assert_eq!(p.aging.len(), aging.len());
        assert_eq!(p.aging_bytes, aging.iter().map(|a| a.1).sum::<u64>());
    }

    /// Every extent the pool holds (free, aging, leased, reserved, retired)
    /// overlaps no other.
    fn assert_disjoint(p: &HeapPool) {
        let mut all: Vec<(u64, u64, &str)> = Vec::new();
        all.extend(p.free.iter().map(|(&o, &l)| (o, l, "free")));
        all.extend(p.aging.iter().map(|(_, e)| (e.offset, e.len, "aging")));
        all.extend(p.leases.iter().map(|(&o, l)| (o, l.len, "leased")));
        all.extend(p.reserved.iter().map(|(&o, &l)| (o, l, "reserved")));
        all.extend(
            p.retired
                .iter()
                .map(|r| (r.extent.offset, r.extent.len, "retired")),
        );
        all.sort_unstable();
        for pair in all.windows(2) {
            assert!(pair[0].0 + pair[0].1 <= pair[1].0, "overlap: {pair:?}");
        }
    }

    /// A collection lets the pool's lock go between marking what the pool
    /// holds and freeing what is left: leases, give-backs and a growth
    /// meanwhile change only what was marked, so nothing it frees is held
    /// by anyone.
    #[test]
    fn what_a_collection_frees_after_letting_the_lock_go_is_nobodys() {
        let u = UNIT;
        let len = u * 8 * 512;
        // A 5-unit block every 8 units; the holes between are free.
        let live: Vec<Extent> = (0..512).map(|i| ext(i * u * 8, u * 5)).collect();
        let mut p = pool(len, u * 64, &live);
        let first = p.lease(1, u, 64).unwrap();
        let started = Instant::now();
        std::thread::sleep(Duration::from_millis(1));
        let half: Vec<Extent> = live.iter().step_by(2).copied().collect();
        let mut marks = map(len, &half);
        p.mark_held(started, &mut marks);
        // Meanwhile: another lease, the first given back, a growth.
        let second = p.lease(2, u, 64).unwrap();
        give_back(&mut p, 1, &first).unwrap();
        p.grow(len * 2);
        let freed = p.free_runs(started, marks.unmarked_runs(), Instant::now());
        assert_eq!(freed, u * 5 * 256, "the blocks that died, no more");
        assert_disjoint(&p);
        assert!(second.iter().all(|e| p.leases.contains_key(&e.offset)));
    }

    /// A lease refused between a collection's halves, for space that
    /// collection is about to free, is told to wait, not that the heap is
    /// full (the space retired before the scan stays retired until its
    /// runs age).
    #[test]
    fn a_lease_between_a_collections_halves_waits_for_what_it_frees() {
        let u = UNIT;
        let len = u * 64;
        let mut p = pool(len, u * 16, &[ext(0, u * 32)]);
        let (a, b) = (lease1(&mut p, 1, u), lease1(&mut p, 3, u));
        give_back(&mut p, 1, &[a]).unwrap();
        assert_eq!(p.lease(2, u, usize::MAX), Err(LeaseRefusal::Busy));
        // A collection after the shortage finds a's blocks live.
        std::thread::sleep(Duration::from_millis(1));
        collect_at(&mut p, Instant::now(), &[ext(0, u * 48)]);
        std::thread::sleep(Duration::from_millis(1));
        give_back(&mut p, 3, &[b]).unwrap();
        assert_eq!(p.lease(2, u, usize::MAX), Err(LeaseRefusal::Busy));
        // The next finds b's dead.
        std::thread::sleep(Duration::from_millis(1));
        let started = Instant::now();
        let mut marks = map(len, &[ext(0, u * 48)]);
        p.mark_held(started, &mut marks);
        assert_eq!(p.lease(2, u, usize::MAX), Err(LeaseRefusal::Busy));
        assert_eq!(p.free_runs(started, marks.unmarked_runs(), started), u * 16);
        assert_eq!(p.lease(2, u, usize::MAX), Ok(vec![b]));
    }

    /// `insert_free_sorted` leaves the free maps as `insert_free` one by
    /// one does, on random extents that touch each other, free ones on
    /// either side, or none, before, between and after the free ones.
    #[test]
    fn a_rebuild_of_the_free_maps_is_inserting_one_by_one() {
        let mut next = crate::units::tests::numbers_from(0x2545_f491_4f6c_dd1d);
        for round in 0..200 {
            // Cut [0, 64 units) into pieces: each free, added, or neither.
            let (mut free, mut added) = (Vec::new(), Vec::new());
            let mut at = 0;
            while at < 64 {
                let len = 1 + next(4);
                let piece = ext(at * UNIT, len.min(64 - at) * UNIT);
                match next(3) {
                    0 => free.push(piece),
                    1 => added.push(piece),
                    _ => {}
                }
                at += len;
            }
            let mut one_by_one = HeapPool::new(0, 64 * UNIT, 4096);
            for &e in free.iter().chain(&added) {
                one_by_one.insert_free(e);
            }
            let mut rebuilt = HeapPool::new(0, 64 * UNIT, 4096);
            for &e in &free {
                rebuilt.insert_free(e);
            }
            rebuilt.insert_free_sorted(&added);
            assert_eq!(rebuilt.free, one_by_one.free, "round {round}");
            assert_eq!(rebuilt.free_by_size, one_by_one.free_by_size);
            assert_eq!(rebuilt.free_bytes, one_by_one.free_bytes);
        }
    }

    /// Collections free thousands of holes at once, and they mature at
    /// once: the free maps are rebuilt, not added to one by one, and must
    /// come out as if they had been, holes that touch free space or each
    /// other merged; a batch maturing while a later one ages leaves the
    /// later one aging.
    #[test]
    fn thousands_of_holes_maturing_at_once_merge_as_one_by_one() {
        let u = UNIT;
        let len = u * 8 * 8192;
        // A 5-unit block every 8 units: 8192 holes of 3 units.
        let live: Vec<Extent> = (0..8192).map(|i| ext(i * u * 8, u * 5)).collect();
        let mut p = HeapPool::new(0, len, 4096);
        let t0 = Instant::now();
        p.collect(t0, map(len, &live), t0 + HOUR);
        p.mature(t0);
        let first = holes_between(len, &live);
        assert_free_maps(&p, &[], &first);
        // Every other block dies: 4096 more holes, each touching two free
        // ones, found before the first batch matured.
        let half: Vec<Extent> = live.iter().step_by(2).copied().collect();
        let died: Vec<(u64, u64)> = live
            .iter()
            .skip(1)
            .step_by(2)
            .map(|e| (e.offset, e.len))
            .collect();
        p.collect(t0, map(len, &half), t0 + HOUR * 3);
        p.mature(t0 + HOUR * 2);
        assert_free_maps(&p, &first, &died);
        p.mature(t0 + HOUR * 4);
        assert_free_maps(&p, &holes_between(len, &half), &[]);
    }

    /// A lease that finds no room is busy until a collection has looked;
    /// one that then finds `live` as it was leaves the heap full.
    fn full_after_a_collection(p: &mut HeapPool, min_len: u64, live: &[Extent]) {
        assert_eq!(p.lease(9, min_len, usize::MAX), Err(LeaseRefusal::Busy));
        std::thread::sleep(Duration::from_millis(1));
        collect_at(p, Instant::now(), live);
        assert_eq!(p.lease(9, min_len, usize::MAX), Err(LeaseRefusal::Full));
        // Space deleted since that collection is looked for again.
        assert_eq!(p.lease(9, min_len, usize::MAX), Err(LeaseRefusal::Busy));
    }

    #[test]
    fn leases_chunks_then_shares_what_is_left() {
        let mut p = pool(64 << 10, 4096, &[]);
        assert_eq!(p.lease(1, 64, usize::MAX), Ok(vec![ext(0, 4096)]));
        // Plenty left: whole chunks.
        assert_eq!(lease1(&mut p, 2, 64).len, 4096);
        let mut got = 8192;
        while let Ok(es) = p.lease(3, 64, usize::MAX) {
            for e in es {
                assert!(e.len <= 4096);
                got += e.len;
            }
        }
        assert_eq!(got, 64 << 10, "space left unleased");
        full_after_a_collection(&mut p, 64, &[]);
        assert_eq!(p.free_bytes(), 0);
    }

    #[test]
    fn fragmented_space_is_leased_as_many_holes_at_once() {
        // Live 64-byte blocks every 256 bytes: free space is 192-byte holes.
        let live: Vec<Extent> = (0..1024).map(|i| ext(i * 256, 64)).collect();
        let mut p = pool(256 << 10, 64 << 10, &live);
        let got = p.lease(1, 128, usize::MAX).unwrap();
        assert!(got.len() > 1 && got.len() <= MAX_LEASE_EXTENTS);
        assert!(got[0].len >= 128);
        let total: u64 = got.iter().map(|e| e.len).sum();
        assert!(
            total >= 16 << 10,
            "only {total} bytes in {} holes",
            got.len()
        );
        // A block bigger than every hole: no space, however much is free.
        full_after_a_collection(&mut p, 256, &live);
    }

    #[test]
    fn a_lease_gathers_no_more_holes_than_its_client_takes() {
        let live: Vec<Extent> = (0..1024).map(|i| ext(i * 256, 64)).collect();
        let mut p = pool(256 << 10, 64 << 10, &live);
        let got = p.lease(1, 128, 16).unwrap();
        assert_eq!(got.len(), 16);
        let more = p.lease(2, 128, 16).unwrap();
        assert!(more.iter().all(|e| !got.contains(e)));
    }

    #[test]
    fn low_space_asks_for_a_collection_only_after_new_writes() {
        // 80% live: free space is low, but nothing was written since the
        // scan, so scanning again would find nothing new.
        let mut p = pool(64 << 10, 4096, &[ext(0, 52 << 10)]);
        assert_eq!(p.need(Instant::now(), p.end / 4, 0), Need::No);
        p.lease(1, 64, usize::MAX).unwrap();
        assert_eq!(p.need(Instant::now(), p.end / 4, 0), Need::Soon);
        collect_at(&mut p, Instant::now(), &[ext(0, 52 << 10)]);
        assert_eq!(p.need(Instant::now(), p.end / 4, 0), Need::No);
    }

    #[test]
    fn reopened_pool_skips_live_blocks() {
        let p = pool(1024, 128, &[ext(128, 50), ext(512, 128)]);
        assert_eq!(
            p.free.iter().map(|(&o, &l)| (o, l)).collect::<Vec<_>>(),
            vec![(0, 128), (192, 320), (640, 384)]
        );
    }

    #[test]
    fn refuses_give_backs_of_space_the_client_does_not_hold() {
        let mut p = pool(64 << 10, 4096, &[]);
        let a = lease1(&mut p, 1, 64);
        let b = lease1(&mut p, 2, 64);
        // Another client's lease, free space, outside the heap, the same
        // extent twice, overlapping extents, an empty one: all refused.
        assert!(give_back(&mut p, 1, &[b]).is_err());
        assert!(give_back(&mut p, 1, &[ext(32 << 10, 64)]).is_err());
        assert!(give_back(&mut p, 1, &[ext(u64::MAX - 63, 64)]).is_err());
        assert!(give_back(&mut p, 1, &[a, a]).is_err());
        assert!(give_back(&mut p, 1, &[ext(a.offset, 128), ext(a.offset + 64, 128)]).is_err());
        assert!(give_back(&mut p, 1, &[ext(a.offset, 0)]).is_err());
        // All or nothing: one bad extent spoils the message.
        assert!(give_back(&mut p, 1, &[ext(a.offset, 64), b]).is_err());
        assert_eq!(p.leased_bytes(), 8192);
        // Its own space, in pieces, is fine -- once.
        give_back(
            &mut p,
            1,
            &[ext(a.offset, 64), ext(a.offset + 64, a.len - 64)],
        )
        .unwrap();
        assert!(give_back(&mut p, 1, &[ext(a.offset, 64)]).is_err());
        assert_eq!(p.leased_bytes(), 4096);
    }

    #[test]
    fn a_flood_of_splitting_give_backs_is_bounded() {
        let mut p = pool(4 << 20, 4 << 20, &[]);
        let a = lease1(&mut p, 1, 64);
        // Every other unit: each splits the lease once more.
        let refused = (0..a.len / 128 - 1)
            .map(|i| ext(a.offset + 64 + i * 128, 64))
            .any(|e| give_back(&mut p, 1, &[e]).is_err());
        assert!(refused, "a client split its space without bound");
        assert!(p.leases.len() <= MAX_CLIENT_EXTENTS + 1);
    }

    #[test]
    fn collection_frees_unreferenced_retired_space_after_grace() {
        let mut p = pool(64 << 10, 4096, &[]);
        let a = lease1(&mut p, 1, 64);
        give_back(&mut p, 1, &[a]).unwrap();
        let before = p.free_bytes();
        // One block of the extent is still referenced by the index; what is
        // freed ages for an hour (the grace period, here).
        let now = Instant::now() + Duration::from_millis(1);
        let freed = p.collect(now, map(64 << 10, &[ext(a.offset + 128, 64)]), now + HOUR);
        assert_eq!(freed, a.len - 64);
        assert_eq!(p.free_bytes(), before + a.len - 64);
        let free_now = p.free_bytes;
        p.mature(now + HOUR / 2);
        assert_eq!(p.free_bytes, free_now, "leasable before its grace period");
        p.mature(now + HOUR);
        assert_eq!(p.free_bytes, free_now + a.len - 64);
        // Once the block is unlinked, the next collection gets it too.
        assert_eq!(collect_at(&mut p, now + HOUR, &[]), 64);
    }

    #[test]
    fn a_collection_that_sees_the_grown_region_first_leaves_the_new_space_to_growth() {
        let mut p = pool(64 << 10, 4096, &[]);
        let before = p.free_bytes();
        // The region grew to 128 KiB and a collection scanned it before
        // the pool was told.
        let now = Instant::now();
        assert_eq!(p.collect(now, map(128 << 10, &[]), now), 0);
        p.grow(128 << 10);
        p.mature(now + HOUR);
        assert_eq!(
            p.free_bytes(),
            before + (64 << 10),
            "new space counted twice"
        );
    }

    #[test]
    fn a_departed_clients_space_waits_until_its_fence_settled() {
        let mut p = pool(64 << 10, 4096, &[]);
        let total = p.free_bytes();
        let a = lease1(&mut p, 7, 64);
        let fenced = Instant::now();
        p.depart(7, fenced + HOUR, false);
        assert_eq!(p.leased_bytes(), 0);
        assert_eq!(p.need(fenced, 0, 0), Need::No);
        assert_eq!(
            collect_at(&mut p, fenced, &[]),
            0,
            "reclaimed before the fence settled"
        );
        assert_eq!(p.need(fenced + HOUR, 0, 0), Need::Now);
        let freed = collect_at(&mut p, fenced + HOUR, &[ext(a.offset, 64)]);
        assert_eq!(freed, a.len - 64);
        assert_eq!(p.free_bytes(), total - 64);
    }

    #[test]
    fn space_retired_during_a_scan_is_left_for_the_next_collection() {
        let mut p = pool(64 << 10, 4096, &[]);
        let a = lease1(&mut p, 1, 64);
        let scan_started = Instant::now();
        // Given back while the scan ran (after it started): blocks
        // published into it just before may have been missed by the scan.
        give_back(&mut p, 1, &[a]).unwrap();
        let before = scan_started - Duration::from_millis(1);
        assert_eq!(collect_at(&mut p, before, &[]), 0);
        assert_eq!(collect_at(&mut p, Instant::now() + HOUR, &[]), a.len);
    }

    #[test]
    fn a_failed_lease_is_busy_while_space_is_being_reclaimed() {
        let mut p = pool(8192, 4096, &[]);
        let a = lease1(&mut p, 1, 4096);
        let _b = lease1(&mut p, 1, 4096);
        give_back(&mut p, 1, &[a]).unwrap();
        assert_eq!(p.lease(2, 64, usize::MAX), Err(LeaseRefusal::Busy));
        assert_eq!(p.need(Instant::now(), p.end / 4, 0), Need::Now);
        let now = Instant::now() + Duration::from_millis(1);
        p.collect(now, map(8192, &[]), now + HOUR);
        // Aging for an hour: still busy, not full.
        assert_eq!(p.lease(2, 64, usize::MAX), Err(LeaseRefusal::Busy));
        let mut q = pool(4096, 4096, &[]);
        q.lease(1, 64, usize::MAX).unwrap();
        // Full only once a collection that began after the shortage found
        // nothing.
        assert_eq!(q.lease(2, 64, usize::MAX), Err(LeaseRefusal::Busy));
        let now = Instant::now() + Duration::from_millis(1);
        q.collect(now, map(4096, &[]), now);
        assert_eq!(q.lease(2, 64, usize::MAX), Err(LeaseRefusal::Full));
    }

    /// A collection long past says nothing of deletes since: a lease that
    /// fails after it is busy until a new one has looked.
    #[test]
    fn a_stale_collection_does_not_make_the_heap_full() {
        let mut p = pool(8192, 4096, &[ext(0, 8192)]);
        assert_eq!(p.lease(1, 64, usize::MAX), Err(LeaseRefusal::Busy));
        std::thread::sleep(Duration::from_millis(1));
        collect_at(&mut p, Instant::now(), &[ext(0, 8192)]);
        // Its client gave up; deletes come; a lease long after.
        std::thread::sleep(FRESH_SCAN + Duration::from_millis(50));
        assert_eq!(p.lease(2, 64, usize::MAX), Err(LeaseRefusal::Busy));
        std::thread::sleep(Duration::from_millis(1));
        collect_at(&mut p, Instant::now(), &[ext(0, 4096)]);
        assert_eq!(p.lease(2, 64, usize::MAX).map(|es| es[0].offset), Ok(4096));
    }

    /// Deletes unlink blocks in settled space, which no pool state shows:
    /// a lease that finds nothing free is busy until a collection has
    /// looked, and that collection finds the space.
    #[test]
    fn space_deletes_unlinked_is_collected_before_the_heap_is_full() {
        // All settled: the index referenced every block at the last scan.
        let mut p = pool(8192, 4096, &[ext(0, 8192)]);
        let now = Instant::now();
        p.collect(now, map(8192, &[ext(0, 8192)]), now);
        assert_eq!(p.free_bytes(), 0);
        assert_eq!(p.lease(1, 64, usize::MAX), Err(LeaseRefusal::Busy));
        assert_eq!(p.need(Instant::now(), p.end / 4, 0), Need::Now);
        // Half of it deleted since.
        std::thread::sleep(Duration::from_millis(1));
        collect_at(&mut p, Instant::now(), &[ext(0, 4096)]);
        assert_eq!(p.lease(1, 64, usize::MAX).map(|es| es[0].offset), Ok(4096));
    }

    #[test]
    fn reserved_index_space_is_never_leased_or_collected_until_released() {
        let mut p = pool(1 << 20, 64 << 10, &[]);
        let index = p.reserve(300 << 10).unwrap();
        let before = p.free_bytes();
        let now = Instant::now();
        p.collect(now, map(1 << 20, &[]), now);
        assert_eq!(p.free_bytes(), before, "a collection freed index space");
        while let Ok(es) = p.lease(1, 4096, usize::MAX) {
            for e in es {
                assert!(e.offset + e.len <= index.offset || e.offset >= index.offset + index.len);
            }
        }
        p.release(index, now);
        p.mature(now);
        assert_eq!(p.free_bytes(), index.len);
    }

    #[test]
    fn growth_adds_free_space_at_the_end() {
        let mut p = pool(1 << 20, 64 << 10, &[ext(0, 1 << 20)]);
        assert_eq!(p.free_bytes(), 0);
        p.grow(3 << 20);
        assert_eq!((p.free_bytes(), p.end()), (2 << 20, 3 << 20));
        assert_eq!(p.reserve(2 << 20), Some(ext(1 << 20, 2 << 20)));
    }

    /// `extent` carved into `n` blocks of `size`, declared.
    fn carved(extent: Extent, size: u64, n: u64) -> Spent {
        let mut starts = vec![0u8; (extent.len / START_GRANULE).div_ceil(8) as usize];
        for k in 0..n {
            let g = (k * size / START_GRANULE) as usize;
            starts[g / 8] |= 1 << (g % 8);
        }
        Spent {
            extent,
            carved: n * size,
            starts,
        }
    }

    fn report(at: u64, size: u64) -> Unlinked {
        let class = kv_common::layout::class_for(size).unwrap();
        assert_eq!(class_size(class), size);
        Unlinked { offset: at, class }
    }

    #[test]
    fn uncarved_space_given_back_is_free_from_when_it_is_told() {
        let mut p = pool(1 << 20, 64 << 10, &[]);
        let a = lease1(&mut p, 1, 64);
        let later = Instant::now() + std::time::Duration::from_secs(3600);
        p.give_back(1, &[carved(a, 128, 2)], later).unwrap();
        assert_eq!(p.aging_bytes(), a.len - 256, "waits out its grace period");
        p.mature(Instant::now());
        assert_eq!(p.aging_bytes(), a.len - 256);
        p.mature(later);
        assert_eq!(p.aging_bytes(), 0);
        // Told nothing may still land there: free at once.
        let b = lease1(&mut p, 2, 64);
        p.give_back(2, &[carved(b, 128, 2)], Instant::now())
            .unwrap();
        assert_eq!(p.aging_bytes(), 0);
    }

    #[test]
    fn a_report_in_leased_space_waits_for_the_give_back() {
        let mut p = pool(1 << 20, 64 << 10, &[]);
        let a = lease1(&mut p, 1, 64);
        // Client 2 unlinked a block client 1 wrote: it waits with the lease.
        assert_eq!(p.report(&[report(a.offset + 128, 128)]), 0);
        assert!(p.take_ready(10).is_empty());
        p.give_back(1, &[carved(a, 128, 2)], Instant::now())
            .unwrap();
        let ready = p.take_ready(10);
        assert_eq!(ready, vec![report(a.offset + 128, 128)]);
        let e = p
            .reported_block(ready[0])
            .expect("a declared block in given-back space");
        let free = p.free_bytes();
        let now = Instant::now();
        // Named twice in one batch: counted once; its extent still holds a
        // live block.
        assert_eq!(p.free_reported(&[e, e], now), (1, 0));
        assert_eq!(p.reported_block(ready[0]), None, "counted dead twice");
        // The other block dies: the extent is free whole.
        let other = p.reported_block(report(a.offset, 128)).unwrap();
        assert_eq!(p.free_reported(&[other], now), (1, 256));
        p.mature(now);
        assert_eq!(p.free_bytes(), free + 256);
    }

    #[test]
    fn only_declared_blocks_of_settled_space_may_be_freed() {
        let mut p = pool(1 << 20, 64 << 10, &[]);
        let a = lease1(&mut p, 1, 64);
        let b = lease1(&mut p, 2, 64);
        p.give_back(1, &[carved(a, 128, 4)], Instant::now())
            .unwrap();
        // What was not carved is free at once.
        assert_eq!(p.reported_block(report(a.offset + 512, 128)), None);
        // Inside a block, two blocks as one, leased space, outside the
        // heap. (A smaller class than the block's is the region check's to
        // refuse: see `unlinked.rs`.)
        for u in [
            report(a.offset + 64, 64),
            report(a.offset, 256),
            report(b.offset, 128),
        ] {
            assert_eq!(p.reported_block(u), None, "{u:?}");
        }
        assert_eq!(p.report(&[report(1 << 30, 64)]), 1);
        // A departed client's space is scanned, never freed on report.
        p.report(&[report(b.offset, 128)]);
        p.depart(2, Instant::now(), false);
        assert!(p.take_ready(10).is_empty());
        assert_eq!(p.reported_block(report(b.offset, 128)), None);
        // Its departure makes the leases out then worth a scan once back.
        let c = lease1(&mut p, 3, 64);
        assert_eq!(p.need(Instant::now() + HOUR, 0, 0), Need::Now);
        let now = Instant::now() + Duration::from_millis(1);
        collect_at(&mut p, now, &[]);
        assert_eq!(p.need(now + HOUR, 0, 0), Need::No);
        assert!(c.len > 0);
    }

    #[test]
    fn a_scan_forgets_the_blocks_it_frees() {
        let mut p = pool(1 << 20, 64 << 10, &[]);
        let a = lease1(&mut p, 1, 64);
        p.give_back(1, &[carved(a, 128, 8)], Instant::now())
            .unwrap();
        let u = report(a.offset + 256, 128);
        assert!(p.reported_block(u).is_some());
        let now = Instant::now() + Duration::from_millis(1);
        collect_at(&mut p, now, &[ext(a.offset, 256)]);
        assert_eq!(p.reported_block(u), None, "freed twice");
        // Its extent is no longer freed whole: the blocks the scan left
        // live are for the next scan.
        assert!(p.reported_block(report(a.offset + 128, 128)).is_none());
    }
}
