//! Where the blocks of given-back space begin, as their writers declared.
//!
//! A report of an unlinked block names an offset and a size class, and the
//! server frees that block once it has checked that no slot references it
//! (`unlinked.rs`) — but the bounds of a block cannot be read from the
//! region: a value may hold bytes that look like a block, and a report of
//! such a "block" inside a live one would free part of it. So the bounds
//! come from the only client that wrote the space: the one it was leased
//! to, which declares where each of its blocks starts when it gives the
//! space back (a client lying there misleads the server only about its own
//! blocks). A report counts a block dead only if the block lies inside one
//! declared extent, starts where a start was declared, and covers no other
//! declared start; the start is then forgotten, so a second report of it
//! counts nothing.
//!
//! A declared extent is freed whole, once every byte carved in it is dead:
//! one free per extent rather than one per block keeps the free map from
//! shattering into holes the size of a block (which a write-heavy load with
//! scattered keys would otherwise make by the million, each costing every
//! lease and free a few tree lookups). An extent in which some blocks live
//! on is left to a scan, which frees all the dead blocks between them at
//! once; a scan that frees part of a declared extent drops its declaration.

use std::collections::BTreeMap;

use kv_common::protocol::{Extent, Spent, START_GRANULE};

pub struct BlockRegistry {
    start: u64,
    /// One bit per granule of the heap from `start`: a declared block
    /// begins there and has not been freed.
    starts: Vec<u64>,
    /// Declared extents by offset; never overlapping.
    declared: BTreeMap<u64, Declared>,
}

#[derive(Debug, Clone, Copy)]
struct Declared {
    end: u64,
    /// Carved bytes not yet reported dead.
    live: u64,
}

impl BlockRegistry {
    /// A registry of `[start, end)` that knows no block.
    pub fn new(start: u64, end: u64) -> BlockRegistry {
        let mut r = BlockRegistry {
            start,
            starts: Vec::new(),
            declared: BTreeMap::new(),
        };
        r.grow(end);
        r
    }

    /// The heap now ends at `end`.
    pub fn grow(&mut self, end: u64) {
        let granules = end.saturating_sub(self.start) / START_GRANULE;
        let words = granules.div_ceil(64) as usize;
        if words > self.starts.len() {
            self.starts.resize(words, 0);
        }
    }

    /// Records what the writer of `spent.extent` says of it (the extent is
    /// its own, given back just now): the starts inside what it carved.
    /// Declarations of space since reused are dropped first.
    pub fn declare(&mut self, spent: &Spent) {
        let e = spent.extent;
        self.forget_range(e);
        let carved = spent.carved.min(e.len);
        let granules = (carved / START_GRANULE) as usize;
        let mut any = false;
        for (byte_at, &byte) in spent.starts.iter().enumerate().take(granules.div_ceil(8)) {
            let mut bits = byte;
            while bits != 0 {
                let i = byte_at * 8 + bits.trailing_zeros() as usize;
                bits &= bits - 1;
                if i < granules {
                    self.set(e.offset + i as u64 * START_GRANULE, true);
                    any = true;
                }
            }
        }
        if any {
            let end = e.offset + granules as u64 * START_GRANULE;
            let live = end - e.offset;
            self.declared.insert(e.offset, Declared { end, live });
        }
    }

    /// Whether `[offset, offset + len)` is one declared block: inside one
    /// declared extent, starting at a declared start, covering no other.
    pub fn is_block(&self, offset: u64, len: u64) -> bool {
        let Some(end) = offset.checked_add(len) else {
            return false;
        };
        let inside = self.extent_of(offset).is_some_and(|(_, d)| end <= d.end);
        inside
            && offset.is_multiple_of(START_GRANULE)
            && self.get(offset)
            && !self.any_set(offset + START_GRANULE, end)
    }

    /// The block `[offset, offset + len)`, which [`BlockRegistry::is_block`]
    /// names, is dead (checked unreferenced): its start is forgotten. Returns
    /// its declared extent if that is now dead whole (and forgets it).
    pub fn dead(&mut self, offset: u64, len: u64) -> Option<Extent> {
        self.set(offset, false);
        let (at, d) = self.extent_of(offset)?;
        let live = d.live.saturating_sub(len);
        if live > 0 {
            self.declared.insert(at, Declared { live, ..d });
            return None;
        }
        self.declared.remove(&at);
        Some(Extent {
            offset: at,
            len: d.end - at,
        })
    }

    /// A scan freed `run`: the blocks that begin in it are free now (a
    /// unit is a granule, so no block reaches into a run from outside), and
    /// no declared extent it touches can be freed whole any more.
    pub fn forget_freed_run(&mut self, run: Extent) {
        self.clear(run.offset, run.offset + run.len);
        self.drop_declared(run);
    }

    /// Space that is leased again, or left by a client that departed: no
    /// declaration of its earlier life holds.
    pub fn forget_range(&mut self, e: Extent) {
        self.clear(e.offset, e.offset + e.len);
        self.drop_declared(e);
    }

    /// Drops the declared extents that overlap `e` (the starts left in them
    /// name no declared extent, so they free nothing).
    fn drop_declared(&mut self, e: Extent) {
        let end = e.offset + e.len;
        // Declared extents never overlap: those that overlap `e` are the
        // last ones starting before its end, in a row.
        while let Some((&at, d)) = self.declared.range(..end).next_back() {
            if d.end <= e.offset {
                break;
            }
            self.declared.remove(&at);
        }
    }

    /// The declared extent that holds `offset`.
    fn extent_of(&self, offset: u64) -> Option<(u64, Declared)> {
        let (&at, &d) = self.declared.range(..=offset).next_back()?;
        (offset < d.end).then_some((at, d))
    }

    fn index(&self, offset: u64) -> Option<(usize, u64)> {
        let g = offset.checked_sub(self.start)? / START_GRANULE;
        let w = (g / 64) as usize;
        (w < self.starts.len()).then_some((w, g % 64))
    }

    fn get(&self, offset: u64) -> bool {
        self.index(offset)
            .is_some_and(|(w, b)| self.starts[w] & (1 << b) != 0)
    }

    fn set(&mut self, offset: u64, on: bool) {
        if let Some((w, b)) = self.index(offset) {
            if on {
                self.starts[w] |= 1 << b;
            } else {
                self.starts[w] &= !(1 << b);
            }
        }
    }

    /// Whether a start is declared in `[from, to)`.
    fn any_set(&self, from: u64, to: u64) -> bool {
        granules(self.start, self.starts.len(), from, to)
            .any(|(w, mask)| self.starts[w] & mask != 0)
    }

    /// Clears the starts of `[from, to)` (on every lease: no allocation).
    fn clear(&mut self, from: u64, to: u64) {
        for (w, mask) in granules(self.start, self.starts.len(), from, to) {
            self.starts[w] &= !mask;
        }
    }
}

/// The words and bit masks that cover the granules of `[from, to)` in a
/// map of `words` words from `start` (clipped to the map).
fn granules(start: u64, words: usize, from: u64, to: u64) -> impl Iterator<Item = (usize, u64)> {
    let first = from.saturating_sub(start).div_ceil(START_GRANULE);
    let last = (to.saturating_sub(start).div_ceil(START_GRANULE)).min(words as u64 * 64);
    let mut g = first;
    std::iter::from_fn(move || {
        if g >= last {
            return None;
        }
        let w = g / 64;
        let b = g % 64;
        let n = (64 - b).min(last - g);
        let mask = if n == 64 {
            u64::MAX
        } else {
            ((1u64 << n) - 1) << b
        };
        g += n;
        Some((w as usize, mask))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ext(offset: u64, len: u64) -> Extent {
        Extent { offset, len }
    }

    /// `extent` carved into blocks of the given sizes, front to back.
    fn spent(extent: Extent, sizes: &[u64]) -> Spent {
        let mut starts = vec![0u8; (extent.len / START_GRANULE).div_ceil(8) as usize];
        let mut at = 0;
        for &s in sizes {
            let i = (at / START_GRANULE) as usize;
            starts[i / 8] |= 1 << (i % 8);
            at += s;
        }
        Spent {
            extent,
            carved: at,
            starts,
        }
    }

    #[test]
    fn only_declared_blocks_whole_and_once() {
        let mut r = BlockRegistry::new(4096, 1 << 20);
        r.declare(&spent(ext(8192, 4096), &[80, 80, 256]));
        assert!(r.is_block(8192, 80));
        assert!(r.is_block(8272, 80));
        assert!(r.is_block(8352, 256));
        // Inside a block, across two, past what was carved, undeclared.
        assert!(!r.is_block(8192 + 16, 64));
        assert!(!r.is_block(8192, 160));
        assert!(!r.is_block(8352, 512));
        assert!(!r.is_block(16384, 64));
        assert_eq!(r.dead(8272, 80), None);
        assert!(!r.is_block(8272, 80), "a dead block is counted once");
        assert!(r.is_block(8192, 80));
        // The extent is freed whole, once everything carved is dead.
        assert_eq!(r.dead(8192, 80), None);
        assert_eq!(r.dead(8352, 256), Some(ext(8192, 416)));
        assert!(!r.is_block(8192, 80));
    }

    #[test]
    fn reuse_and_scans_drop_what_they_cover() {
        let mut r = BlockRegistry::new(0, 1 << 20);
        r.declare(&spent(ext(0, 4096), &[64; 64]));
        r.declare(&spent(ext(8192, 4096), &[64; 64]));
        // Leased again in part: that declaration is gone whole.
        r.forget_range(ext(1024, 1024));
        assert!(!r.is_block(960, 64) && !r.is_block(2048, 64));
        assert!(r.is_block(8192, 64));
        // A scan that frees part of one: the same.
        r.forget_freed_run(ext(8192 + 64, 64));
        assert!(!r.is_block(8192, 64));
    }

    #[test]
    fn a_lie_about_the_carved_length_is_clipped_to_the_extent() {
        let mut r = BlockRegistry::new(0, 1 << 20);
        let mut s = spent(ext(0, 128), &[64, 64]);
        s.carved = 1 << 30;
        s.starts = vec![0xff; 1024];
        r.declare(&s);
        assert!(!r.is_block(128, 64), "declared past its extent");
        assert!(r.is_block(112, 16) && !r.is_block(112, 32));
    }
}
