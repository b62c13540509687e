//! The client's block allocator: it carves new blocks out of the heap
//! extents the server leased to it, front to back, and never reuses a block.
//! It notes where each block starts, which it declares when it gives the
//! extent back: that is what lets the server free a block reported unlinked
//! without scanning the index (see `kv-server`'s `registry`). A block this
//! client unlinks (by an update or a delete), wherever it lives, is
//! reported and forgotten; so no client ever holds space another needs,
//! and a client that dies holds nothing but its leases.

use kv_common::layout::class_size;
use kv_common::protocol::{Extent, Spent, START_GRANULE};

/// A leased extent, carved up to `next`, with a bit set where each block
/// carved so far starts (the declaration of [`Spent`]).
struct Carving {
    extent: Extent,
    next: u64,
    starts: Vec<u8>,
}

#[derive(Default)]
pub struct BlockAllocator {
    leases: Vec<Carving>,
    /// Extents before this one are used up (or too small for a block that
    /// was wanted): allocation only moves forward, so each costs O(1).
    current: usize,
}

impl BlockAllocator {
    /// A block of `class` from leased space, if an extent from the current
    /// one on has room. The tail of an extent passed over is not used again
    /// by this client; it comes back to the server with the extent.
    pub fn take(&mut self, class: u8) -> Option<u64> {
        let size = class_size(class);
        while let Some(c) = self.leases.get_mut(self.current) {
            if c.extent.offset + c.extent.len - c.next >= size {
                let offset = c.next;
                let granule = ((offset - c.extent.offset) / START_GRANULE) as usize;
                if let Some(byte) = c.starts.get_mut(granule / 8) {
                    *byte |= 1 << (granule % 8);
                }
                c.next += size;
                return Some(offset);
            }
            self.current += 1;
        }
        None
    }

    pub fn add_extents(&mut self, extents: &[Extent]) {
        self.leases.extend(extents.iter().map(|&extent| Carving {
            extent,
            next: extent.offset,
            starts: vec![0; (extent.len / START_GRANULE).div_ceil(8) as usize],
        }));
    }

    /// Everything this client holds, whole leases with what was carved of
    /// them, for giving back: when no extent has room for the next block,
    /// or at disconnect. The server keeps the blocks in them that the index
    /// references and reclaims the rest.
    pub fn drain(&mut self) -> Vec<Spent> {
        self.current = 0;
        self.leases
            .drain(..)
            .map(|c| {
                let carved = c.next - c.extent.offset;
                let mut starts = c.starts;
                starts.truncate((carved / START_GRANULE).div_ceil(8) as usize);
                Spent {
                    extent: c.extent,
                    carved,
                    starts,
                }
            })
            .collect()
    }

    /// Forgets all space: the connection that leased it is gone, and the
    /// server reclaims it as a departed client's.
    pub fn reset(&mut self) {
        self.leases.clear();
        self.current = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn carves_extents_front_to_back_and_never_reuses() {
        let mut a = BlockAllocator::default();
        assert_eq!(a.take(0), None);
        a.add_extents(&[Extent {
            offset: 4096,
            len: 128,
        }]);
        assert_eq!(a.take(0), Some(4096));
        assert_eq!(a.take(0), Some(4096 + 64));
        assert_eq!(a.take(0), None);
        a.add_extents(&[Extent {
            offset: 8192,
            len: 1000,
        }]);
        assert_eq!(a.take(1), Some(8192));
        let all = a.drain();
        assert_eq!(all.iter().map(|s| s.extent.len).sum::<u64>(), 128 + 1000);
        assert_eq!(a.take(0), None);
    }

    #[test]
    fn declares_where_each_carved_block_starts() {
        let mut a = BlockAllocator::default();
        let extent = Extent {
            offset: 1 << 20,
            len: 4096,
        };
        a.add_extents(&[extent]);
        // 80-byte blocks (class 1) start every fifth granule.
        for _ in 0..3 {
            a.take(1);
        }
        let spent = a.drain();
        assert_eq!(spent.len(), 1);
        assert_eq!((spent[0].extent, spent[0].carved), (extent, 240));
        assert_eq!(spent[0].starts, vec![0b0010_0001, 0b0000_0100]);
    }
}
