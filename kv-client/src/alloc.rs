//! The client's block allocator: it carves new blocks out of the heap
//! extents the server leased to it, front to back, and never reuses a block.
//! A block this client unlinks (by an update or a delete), wherever it
//! lives, is simply forgotten: the server finds it unreferenced and reuses
//! it after a grace period. So no client ever holds space another needs,
//! and a client that dies holds nothing but its leases.

use kv_common::layout::class_size;
use kv_common::protocol::Extent;

#[derive(Default)]
pub struct BlockAllocator {
    /// Each leased extent, and the offset in it that is carved next.
    leases: Vec<(Extent, u64)>,
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
        while let Some((e, next)) = self.leases.get_mut(self.current) {
            if e.offset + e.len - *next >= size {
                let offset = *next;
                *next += size;
                return Some(offset);
            }
            self.current += 1;
        }
        None
    }

    pub fn add_extents(&mut self, extents: &[Extent]) {
        self.leases.extend(extents.iter().map(|e| (*e, e.offset)));
    }

    /// Everything this client holds, whole leases, for giving back: when no
    /// extent has room for the next block, or at disconnect. The server
    /// keeps the blocks in them that the index references and reclaims the
    /// rest.
    pub fn drain(&mut self) -> Vec<Extent> {
        self.current = 0;
        self.leases.drain(..).map(|(e, _)| e).collect()
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
        assert_eq!(all.iter().map(|e| e.len).sum::<u64>(), 128 + 1000);
        assert_eq!(a.take(0), None);
    }
}
