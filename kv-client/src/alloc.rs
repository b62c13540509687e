//! The client's block allocator. Space comes from heap extents the server
//! leases; blocks freed by this client (the one whose CAS unlinked them) are
//! reused only after a grace period, so no reader that could still hold the
//! old offset sees it rewritten. Ownership of a freed block passes to
//! whoever unlinked it, whichever client first wrote it.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use kv_common::layout::class_size;
use kv_common::protocol::Extent;

pub struct BlockAllocator {
    extents: Vec<Extent>,
    freed: BTreeMap<u8, VecDeque<(u64, Instant)>>,
    grace: Duration,
}

impl BlockAllocator {
    pub fn new(grace: Duration) -> Self {
        BlockAllocator {
            extents: Vec::new(),
            freed: BTreeMap::new(),
            grace,
        }
    }

    /// A block of `class`: a freed one past its grace period, or fresh space.
    pub fn take(&mut self, class: u8) -> Option<u64> {
        let size = class_size(class);
        if let Some(q) = self.freed.get_mut(&class) {
            if let Some(&(offset, at)) = q.front() {
                if at.elapsed() >= self.grace {
                    q.pop_front();
                    return Some(offset);
                }
            }
        }
        let i = self.extents.iter().position(|e| e.len >= size)?;
        let e = &mut self.extents[i];
        let offset = e.offset;
        e.offset += size;
        e.len -= size;
        if e.len == 0 {
            self.extents.swap_remove(i);
        }
        Some(offset)
    }

    pub fn add_extent(&mut self, e: Extent) {
        self.extents.push(e);
    }

    /// Records a block this client unlinked (or never published).
    pub fn release(&mut self, offset: u64, class: u8) {
        self.freed
            .entry(class)
            .or_default()
            .push_back((offset, Instant::now()));
    }

    /// Takes every freed block, for giving back to the server.
    pub fn drain_freed(&mut self) -> Vec<Extent> {
        let mut out = Vec::new();
        for (class, q) in std::mem::take(&mut self.freed) {
            out.extend(q.into_iter().map(|(offset, _)| Extent {
                offset,
                len: class_size(class),
            }));
        }
        out
    }

    /// Takes everything (unused extents and freed blocks), at disconnect.
    pub fn drain_all(&mut self) -> Vec<Extent> {
        let mut out = self.drain_freed();
        out.append(&mut self.extents);
        out
    }

    /// Forgets all space: after a server restart it belongs to the new server.
    pub fn reset(&mut self) {
        self.extents.clear();
        self.freed.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn carves_extents_and_reuses_only_after_grace() {
        let mut a = BlockAllocator::new(Duration::from_millis(30));
        assert_eq!(a.take(0), None);
        a.add_extent(Extent {
            offset: 4096,
            len: 128,
        });
        assert_eq!(a.take(0), Some(4096));
        assert_eq!(a.take(0), Some(4096 + 64));
        assert_eq!(a.take(0), None);
        a.release(4096, 0);
        assert_eq!(
            a.take(0),
            None,
            "freed block reused inside its grace period"
        );
        std::thread::sleep(Duration::from_millis(40));
        assert_eq!(a.take(0), Some(4096));
        assert_eq!(a.take(0), None);
    }

    #[test]
    fn drains_everything_it_holds() {
        let mut a = BlockAllocator::new(Duration::ZERO);
        a.add_extent(Extent {
            offset: 0,
            len: 1000,
        });
        let b = a.take(1).unwrap();
        a.release(b, 1);
        let all = a.drain_all();
        assert_eq!(all.iter().map(|e| e.len).sum::<u64>(), 1000);
        assert_eq!(a.take(0), None);
    }
}
