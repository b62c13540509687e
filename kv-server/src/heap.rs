//! Free heap space, as the server tracks it: a coalescing map of free
//! extents from which clients lease chunks, and space given back by clients
//! that waits out a grace period before it is leased again (a slow reader may
//! still be reading a block that was freed just before it was given back).

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use kv_common::protocol::Extent;

pub struct HeapPool {
    /// offset → length, never overlapping or touching (touching ones merge).
    free: BTreeMap<u64, u64>,
    aging: VecDeque<(Instant, Extent)>,
    grace: Duration,
    start: u64,
    end: u64,
    chunk: u64,
}

impl HeapPool {
    /// A pool over `[start, end)` in which the `live` extents are in use.
    pub fn new(start: u64, end: u64, chunk: u64, grace: Duration, mut live: Vec<Extent>) -> Self {
        let mut pool = HeapPool {
            free: BTreeMap::new(),
            aging: VecDeque::new(),
            grace,
            start,
            end,
            chunk,
        };
        live.sort_by_key(|e| e.offset);
        let mut cursor = start;
        for e in live {
            if e.offset > cursor {
                pool.insert_free(Extent {
                    offset: cursor,
                    len: e.offset - cursor,
                });
            }
            cursor = cursor.max(e.offset + e.len);
        }
        if cursor < end {
            pool.insert_free(Extent {
                offset: cursor,
                len: end - cursor,
            });
        }
        pool
    }

    /// Leases a whole chunk when one is free (fewer leases), else the first
    /// free extent that holds `min_len`.
    pub fn lease(&mut self, min_len: u64) -> Option<Extent> {
        self.mature();
        let want = min_len.max(self.chunk);
        let (&offset, &len) = self
            .free
            .iter()
            .find(|(_, &len)| len >= want)
            .or_else(|| self.free.iter().find(|(_, &len)| len >= min_len))?;
        self.free.remove(&offset);
        let take = len.min(want);
        if take < len {
            self.free.insert(offset + take, len - take);
        }
        Some(Extent { offset, len: take })
    }

    /// Takes back extents a client no longer needs. Extents outside the heap,
    /// unaligned, or overlapping free space (a double give-back) are refused
    /// whole, before any is taken.
    pub fn give_back(&mut self, extents: &[Extent]) -> Result<(), String> {
        for e in extents {
            let end = e.offset.saturating_add(e.len);
            if e.len == 0 || e.offset < self.start || end > self.end {
                return Err(format!("extent {}+{} is outside the heap", e.offset, e.len));
            }
            if e.offset % 8 != 0 || e.len % 8 != 0 {
                return Err(format!(
                    "extent {}+{} is not 8-byte aligned",
                    e.offset, e.len
                ));
            }
            if self.overlaps_free(e) {
                return Err(format!("extent {}+{} is already free", e.offset, e.len));
            }
        }
        let now = Instant::now();
        self.aging.extend(extents.iter().map(|e| (now, *e)));
        Ok(())
    }

    /// Free bytes, counting those still waiting out their grace period.
    pub fn free_bytes(&self) -> u64 {
        self.free.values().sum::<u64>() + self.aging.iter().map(|(_, e)| e.len).sum::<u64>()
    }

    fn mature(&mut self) {
        while let Some((at, e)) = self.aging.front().copied() {
            if at.elapsed() < self.grace {
                break;
            }
            self.aging.pop_front();
            if !self.overlaps_free(&e) {
                self.insert_free(e);
            }
        }
    }

    fn overlaps_free(&self, e: &Extent) -> bool {
        let end = e.offset + e.len;
        if let Some((&o, &l)) = self.free.range(..=e.offset).next_back() {
            if o + l > e.offset {
                return true;
            }
        }
        self.free.range(e.offset..end).next().is_some()
    }

    fn insert_free(&mut self, e: Extent) {
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

    fn ext(offset: u64, len: u64) -> Extent {
        Extent { offset, len }
    }

    #[test]
    fn leases_chunks_until_full() {
        let mut p = HeapPool::new(4096, 4096 + 4 * 1024, 1024, Duration::ZERO, vec![]);
        let leased: Vec<_> = (0..4).map(|_| p.lease(64).unwrap()).collect();
        assert_eq!(leased[0], ext(4096, 1024));
        assert_eq!(leased[3], ext(4096 + 3072, 1024));
        assert_eq!(p.lease(64), None);
        assert_eq!(p.free_bytes(), 0);
    }

    #[test]
    fn reopened_pool_skips_live_blocks() {
        let p = HeapPool::new(
            0,
            1000,
            100,
            Duration::ZERO,
            vec![ext(100, 50), ext(500, 100)],
        );
        assert_eq!(
            p.free.iter().map(|(&o, &l)| (o, l)).collect::<Vec<_>>(),
            vec![(0, 100), (150, 350), (600, 400)]
        );
    }

    #[test]
    fn given_back_space_waits_for_grace_then_coalesces() {
        let mut p = HeapPool::new(0, 2048, 1024, Duration::from_millis(30), vec![]);
        let a = p.lease(16).unwrap();
        let b = p.lease(16).unwrap();
        assert_eq!(p.lease(16), None);
        p.give_back(&[ext(a.offset, 512), ext(a.offset + 512, 512), b])
            .unwrap();
        assert_eq!(p.lease(16), None, "space reused before its grace period");
        std::thread::sleep(Duration::from_millis(40));
        assert_eq!(
            p.lease(2048),
            Some(ext(0, 2048)),
            "adjacent extents did not merge"
        );
    }

    #[test]
    fn refuses_bad_or_double_give_back() {
        let mut p = HeapPool::new(4096, 8192, 1024, Duration::ZERO, vec![]);
        assert!(p.give_back(&[ext(0, 64)]).is_err());
        assert!(p.give_back(&[ext(8192 - 8, 16)]).is_err());
        assert!(p.give_back(&[ext(4100, 8)]).is_err());
        assert!(p.give_back(&[ext(u64::MAX - 7, 8)]).is_err());
        let e = p.lease(64).unwrap();
        // Free space (not leased) cannot be given back.
        assert!(p.give_back(&[ext(e.offset + e.len, 64)]).is_err());
        assert!(p.give_back(&[e]).is_ok());
    }
}
