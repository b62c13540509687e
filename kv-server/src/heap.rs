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
//! - **settled**: none of the above — space that held blocks the index
//!   referenced when it was last looked at.
//!
//! Clients never hand freed blocks to each other or back to the server: an
//! update unlinks the old block, wherever it lives, and forgets it. Garbage
//! is found by reachability instead: a collection scans the index, marks the
//! blocks it references, marks everything that must stay (free, aging,
//! leased, and space retired after the scan began), and what is left
//! unmarked becomes aging. This is safe because nobody writes into settled or
//! retired space: its client gave it back (having finished every PUT into
//! it) or was fenced, and a block, once unlinked, is never linked again. So a
//! block the scan did not see referenced was unreferenced for good when the
//! scan read its slot, and every reader that could still hold its offset
//! started before that.
//!
//! Space retired by a departed client becomes eligible a grace period after
//! the client was fenced, so that a verb it had in flight lands first.
//!
//! The server believes no client about any of this: a give-back is accepted
//! only for space leased to that client, all of one message or none of it,
//! and each client holds a bounded number of extents.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::Instant;

use kv_common::protocol::Extent;

use crate::units::{UnitMap, UNIT};

pub type ClientId = u64;

/// Most extents one client may hold at once (an honest one holds one or two).
pub const MAX_CLIENT_EXTENTS: usize = 256;

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
    /// Nothing free and nothing being reclaimed.
    Full,
    /// Nothing free now, but space is aging or waiting for a collection.
    Busy,
    /// The client already holds too many extents.
    TooManyExtents,
}

#[derive(Debug, Clone, Copy)]
struct Lease {
    len: u64,
    client: ClientId,
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
    free_bytes: u64,
    /// (leasable from, extent), in the order they were found.
    aging: VecDeque<(Instant, Extent)>,
    aging_bytes: u64,
    /// offset → lease; leases never overlap each other or free space.
    leases: BTreeMap<u64, Lease>,
    leased_bytes: u64,
    extents_held: HashMap<ClientId, usize>,
    retired: Vec<Retired>,
    /// When a lease last failed for want of space, if no collection began
    /// since.
    wanted_since: Option<Instant>,
}

impl HeapPool {
    /// A pool over `[start, end)` in which nothing is known yet: all of it is
    /// settled until the first [`HeapPool::collect`].
    pub fn new(start: u64, end: u64, chunk: u64) -> Self {
        HeapPool {
            start,
            end,
            chunk,
            free: BTreeMap::new(),
            free_bytes: 0,
            aging: VecDeque::new(),
            aging_bytes: 0,
            leases: BTreeMap::new(),
            leased_bytes: 0,
            extents_held: HashMap::new(),
            retired: Vec::new(),
            wanted_since: None,
        }
    }

    /// Leases space of at least `min_len` bytes to `client`: a whole chunk
    /// while space is plentiful, less as it runs short (so that clients
    /// share what is left instead of one holding it all).
    pub fn lease(&mut self, client: ClientId, min_len: u64) -> Result<Extent, LeaseRefusal> {
        self.mature(Instant::now());
        if self.extents_held.get(&client).copied().unwrap_or(0) >= MAX_CLIENT_EXTENTS {
            return Err(LeaseRefusal::TooManyExtents);
        }
        let min_len = min_len.next_multiple_of(UNIT);
        let share = (self.free_bytes / 4).next_multiple_of(4096);
        let want = self.chunk.min(share).max(min_len);
        let found = self
            .free
            .iter()
            .find(|(_, &len)| len >= want)
            .or_else(|| self.free.iter().find(|(_, &len)| len >= min_len))
            .map(|(&offset, &len)| (offset, len));
        let Some((offset, len)) = found else {
            self.wanted_since.get_or_insert(Instant::now());
            return Err(if self.aging.is_empty() && self.retired.is_empty() {
                LeaseRefusal::Full
            } else {
                LeaseRefusal::Busy
            });
        };
        self.free.remove(&offset);
        let take = len.min(want);
        if take < len {
            self.free.insert(offset + take, len - take);
        }
        self.free_bytes -= take;
        self.add_lease(offset, take, client);
        Ok(Extent { offset, len: take })
    }

    /// Takes back space `client` will not write into again. Each extent must
    /// lie inside one of its leases, and no two may overlap; otherwise the
    /// whole message is refused and nothing changes.
    pub fn give_back(&mut self, client: ClientId, extents: &[Extent]) -> Result<(), String> {
        let mut sorted = extents.to_vec();
        sorted.sort_by_key(|e| e.offset);
        let mut splits = 0usize;
        for (i, e) in sorted.iter().enumerate() {
            let end = e
                .offset
                .checked_add(e.len)
                .filter(|_| e.len > 0)
                .ok_or_else(|| format!("extent {}+{} is empty or wraps", e.offset, e.len))?;
            if let Some(next) = sorted.get(i + 1) {
                if next.offset < end {
                    return Err(format!(
                        "extents {}+{} and {}+{} overlap",
                        e.offset, e.len, next.offset, next.len
                    ));
                }
            }
            let (lo, lease) = self.lease_containing(e.offset).ok_or_else(|| {
                format!("extent {}+{} is not leased to this client", e.offset, e.len)
            })?;
            if lease.client != client || end > lo + lease.len {
                return Err(format!(
                    "extent {}+{} is not leased to this client",
                    e.offset, e.len
                ));
            }
            if e.offset > lo && end < lo + lease.len {
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
        for e in sorted {
            self.remove_lease_part(e);
            self.retired.push(Retired {
                extent: e,
                eligible: now,
            });
        }
        Ok(())
    }

    /// Retires everything `client` holds: it disconnected or died, and was
    /// fenced. Its space becomes eligible for collection at `eligible` (a
    /// grace period after the fence, unless it said goodbye).
    pub fn depart(&mut self, client: ClientId, eligible: Instant) {
        let mine: Vec<Extent> = self
            .leases
            .iter()
            .filter(|(_, l)| l.client == client)
            .map(|(&offset, l)| Extent { offset, len: l.len })
            .collect();
        for e in mine {
            self.remove_lease_part(e);
            self.retired.push(Retired {
                extent: e,
                eligible,
            });
        }
        self.extents_held.remove(&client);
    }

    /// Completes a collection whose index scan began at `scan_started` and
    /// marked the live blocks in `live`. Unmarked space that nothing else
    /// holds becomes leasable at `ready_at`; returns its size in bytes.
    pub fn collect(&mut self, scan_started: Instant, mut live: UnitMap, ready_at: Instant) -> u64 {
        let now = Instant::now();
        self.mature(now);
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
        self.retired.retain(|r| r.eligible > scan_started);
        for r in &self.retired {
            live.mark(r.extent.offset, r.extent.len);
        }
        let mut freed = 0;
        for e in live.unmarked_runs() {
            freed += e.len;
            self.aging.push_back((ready_at, e));
            self.aging_bytes += e.len;
        }
        if self.wanted_since.is_some_and(|t| t <= scan_started) {
            self.wanted_since = None;
        }
        self.mature(now);
        freed
    }

    /// Whether a collection would help: now, when a lease went wanting or
    /// retired space is eligible; soon, when free space is merely low.
    pub fn need(&self, now: Instant) -> Need {
        if self.wanted_since.is_some() || self.retired.iter().any(|r| r.eligible <= now) {
            Need::Now
        } else if self.free_bytes + self.aging_bytes < (self.end - self.start) / 8 {
            Need::Soon
        } else {
            Need::No
        }
    }

    /// Free bytes, counting those still waiting out their grace period.
    pub fn free_bytes(&self) -> u64 {
        self.free_bytes + self.aging_bytes
    }

    pub fn leased_bytes(&self) -> u64 {
        self.leased_bytes
    }

    /// Moves aged space whose grace period is over to the free map.
    pub fn mature(&mut self, now: Instant) {
        while let Some(&(ready, e)) = self.aging.front() {
            if ready > now {
                break;
            }
            self.aging.pop_front();
            self.aging_bytes -= e.len;
            self.insert_free(e);
        }
    }

    fn lease_containing(&self, offset: u64) -> Option<(u64, Lease)> {
        let (&lo, &l) = self.leases.range(..=offset).next_back()?;
        (offset < lo + l.len).then_some((lo, l))
    }

    fn add_lease(&mut self, offset: u64, len: u64, client: ClientId) {
        self.leases.insert(offset, Lease { len, client });
        self.leased_bytes += len;
        *self.extents_held.entry(client).or_default() += 1;
    }

    /// Removes `e`, which lies inside one lease, from it, keeping the parts
    /// of the lease on either side.
    fn remove_lease_part(&mut self, e: Extent) {
        let Some((lo, lease)) = self.lease_containing(e.offset) else {
            return;
        };
        self.leases.remove(&lo);
        self.leased_bytes -= lease.len;
        if let Some(n) = self.extents_held.get_mut(&lease.client) {
            *n -= 1;
        }
        let end = e.offset + e.len;
        if e.offset > lo {
            self.add_lease(lo, e.offset - lo, lease.client);
        }
        if end < lo + lease.len {
            self.add_lease(end, lo + lease.len - end, lease.client);
        }
    }

    fn insert_free(&mut self, e: Extent) {
        self.free_bytes += e.len;
        let mut offset = e.offset;
        let mut end = e.offset + e.len;
        if let Some((&o, &l)) = self.free.range(..offset).next_back() {
            if o + l == offset {
                self.free.remove(&o);
                offset = o;
            }
        }
        if let Some(&l) = self.free.get(&end) {
            self.free.remove(&end);
            end += l;
        }
        self.free.insert(offset, end - offset);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn ext(offset: u64, len: u64) -> Extent {
        Extent { offset, len }
    }

    /// A pool over [0, len) whose first collection found `live` in use.
    fn pool(len: u64, chunk: u64, live: &[Extent]) -> HeapPool {
        let mut p = HeapPool::new(0, len, chunk);
        let mut map = UnitMap::new(0, len);
        for e in live {
            map.mark(e.offset, e.len);
        }
        let now = Instant::now();
        p.collect(now, map, now);
        p
    }

    /// A collection whose freed space ages for `grace`.
    fn collect(p: &mut HeapPool, grace: Duration, live: &[Extent]) -> u64 {
        let mut map = UnitMap::new(p.start, p.end);
        for e in live {
            map.mark(e.offset, e.len);
        }
        let now = Instant::now();
        p.collect(now, map, now + grace)
    }

    #[test]
    fn leases_chunks_then_shares_what_is_left() {
        let mut p = pool(64 << 10, 4096, &[]);
        assert_eq!(p.lease(1, 64), Ok(ext(0, 4096)));
        // Plenty left: whole chunks.
        assert_eq!(p.lease(2, 64).unwrap().len, 4096);
        let mut got = 8192;
        while let Ok(e) = p.lease(3, 64) {
            assert!(e.len <= 4096);
            got += e.len;
        }
        assert_eq!(got, 64 << 10, "space left unleased");
        assert_eq!(p.lease(4, 64), Err(LeaseRefusal::Full));
        assert_eq!(p.free_bytes(), 0);
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
        let a = p.lease(1, 64).unwrap();
        let b = p.lease(2, 64).unwrap();
        // Another client's lease, free space, outside the heap, the same
        // extent twice, overlapping extents, an empty one: all refused.
        assert!(p.give_back(1, &[b]).is_err());
        assert!(p.give_back(1, &[ext(32 << 10, 64)]).is_err());
        assert!(p.give_back(1, &[ext(u64::MAX - 63, 64)]).is_err());
        assert!(p.give_back(1, &[a, a]).is_err());
        assert!(p
            .give_back(1, &[ext(a.offset, 128), ext(a.offset + 64, 128)])
            .is_err());
        assert!(p.give_back(1, &[ext(a.offset, 0)]).is_err());
        // All or nothing: one bad extent spoils the message.
        assert!(p.give_back(1, &[ext(a.offset, 64), b]).is_err());
        assert_eq!(p.leased_bytes(), 8192);
        // Its own space, in pieces, is fine -- once.
        p.give_back(1, &[ext(a.offset, 64), ext(a.offset + 64, a.len - 64)])
            .unwrap();
        assert!(p.give_back(1, &[ext(a.offset, 64)]).is_err());
        assert_eq!(p.leased_bytes(), 4096);
    }

    #[test]
    fn a_flood_of_splitting_give_backs_is_bounded() {
        let mut p = pool(1 << 20, 1 << 20, &[]);
        let a = p.lease(1, 64).unwrap();
        // Every other unit: each splits the lease once more.
        let mut refused = false;
        for i in 0..2000u64 {
            let e = ext(a.offset + 64 + i * 128, 64);
            if p.give_back(1, &[e]).is_err() {
                refused = true;
                break;
            }
        }
        assert!(refused, "a client split its space without bound");
        assert!(p.leases.len() <= MAX_CLIENT_EXTENTS + 1);
    }

    #[test]
    fn collection_frees_unreferenced_retired_space_after_grace() {
        let grace = Duration::from_millis(30);
        let mut p = pool(64 << 10, 4096, &[]);
        let a = p.lease(1, 64).unwrap();
        p.give_back(1, &[a]).unwrap();
        let before = p.free_bytes();
        // One block of the extent is still referenced by the index.
        let freed = collect(&mut p, grace, &[ext(a.offset + 128, 64)]);
        assert_eq!(freed, a.len - 64);
        assert_eq!(p.free_bytes(), before + a.len - 64);
        // Aging: not leasable before the grace period has passed.
        let free_now = p.free_bytes;
        std::thread::sleep(grace + Duration::from_millis(10));
        p.mature(Instant::now());
        assert_eq!(p.free_bytes, free_now + a.len - 64);
        // Once the block is unlinked, the next collection gets it too.
        assert_eq!(collect(&mut p, grace, &[]), 64);
    }

    #[test]
    fn a_departed_clients_space_waits_a_grace_period_then_comes_back() {
        let grace = Duration::from_millis(40);
        let mut p = pool(64 << 10, 4096, &[]);
        let total = p.free_bytes();
        let a = p.lease(7, 64).unwrap();
        p.depart(7, Instant::now() + grace);
        assert_eq!(p.leased_bytes(), 0);
        assert_eq!(
            collect(&mut p, grace, &[]),
            0,
            "reclaimed before the fence settled"
        );
        std::thread::sleep(grace + Duration::from_millis(10));
        assert_eq!(p.need(Instant::now()), Need::Now);
        assert_eq!(collect(&mut p, grace, &[ext(a.offset, 64)]), a.len - 64);
        assert_eq!(p.free_bytes(), total - 64);
    }

    #[test]
    fn space_retired_during_a_scan_is_left_for_the_next_collection() {
        let grace = Duration::ZERO;
        let mut p = pool(64 << 10, 4096, &[]);
        let a = p.lease(1, 64).unwrap();
        let scan_started = Instant::now();
        std::thread::sleep(Duration::from_millis(2));
        // Given back while the scan ran: blocks published into it just
        // before may have been missed by the scan.
        p.give_back(1, &[a]).unwrap();
        let map = UnitMap::new(0, 64 << 10);
        assert_eq!(p.collect(scan_started, map, Instant::now()), 0);
        assert_eq!(collect(&mut p, grace, &[]), a.len);
    }

    #[test]
    fn a_failed_lease_is_busy_while_space_is_being_reclaimed() {
        let grace = Duration::from_secs(60);
        let mut p = pool(8192, 4096, &[]);
        let a = p.lease(1, 4096).unwrap();
        let _b = p.lease(1, 4096).unwrap();
        p.give_back(1, &[a]).unwrap();
        assert_eq!(p.lease(2, 64), Err(LeaseRefusal::Busy));
        assert_eq!(p.need(Instant::now()), Need::Now);
        collect(&mut p, grace, &[]);
        // Aging for a minute: still busy, not full.
        assert_eq!(p.lease(2, 64), Err(LeaseRefusal::Busy));
        let mut q = pool(4096, 4096, &[]);
        q.lease(1, 64).unwrap();
        assert_eq!(q.lease(2, 64), Err(LeaseRefusal::Full));
    }
}
