//! Where this client last saw each key: its slot position and slot value.
//! A hint only: a GET through it re-reads the buckets and the block in one
//! batch and uses the block only if the slot still holds that value, so a
//! stale entry costs a round trip, never a wrong answer.

use std::collections::HashMap;

use kv_common::layout::{Slot, SlotPos};

pub struct SlotCache {
    entries: HashMap<Vec<u8>, (SlotPos, Slot)>,
    capacity: usize,
}

impl SlotCache {
    pub fn new(capacity: usize) -> SlotCache {
        SlotCache {
            entries: HashMap::new(),
            capacity,
        }
    }

    pub fn get(&self, key: &[u8]) -> Option<(SlotPos, Slot)> {
        self.entries.get(key).copied()
    }

    pub fn remember(&mut self, key: &[u8], pos: SlotPos, slot: Slot) {
        if self.capacity == 0 {
            return;
        }
        if let Some(e) = self.entries.get_mut(key) {
            *e = (pos, slot);
            return;
        }
        if self.entries.len() >= self.capacity {
            // Cheaper than tracking recency, and entries refill on use.
            self.entries.clear();
        }
        self.entries.insert(key.to_vec(), (pos, slot));
    }

    pub fn forget(&mut self, key: &[u8]) {
        self.entries.remove(key);
    }

    pub fn clear(&mut self) {
        self.entries.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remembers_forgets_and_stays_bounded() {
        let pos = SlotPos {
            bucket: 3,
            index: 1,
        };
        let mut c = SlotCache::new(2);
        c.remember(b"a", pos, Slot(7));
        c.remember(b"a", pos, Slot(8));
        assert_eq!(c.get(b"a"), Some((pos, Slot(8))));
        c.remember(b"b", pos, Slot(9));
        c.remember(b"c", pos, Slot(10));
        assert!(c.entries.len() <= 2);
        assert_eq!(c.get(b"c"), Some((pos, Slot(10))));
        c.forget(b"c");
        assert_eq!(c.get(b"c"), None);
        let mut off = SlotCache::new(0);
        off.remember(b"a", pos, Slot(1));
        assert_eq!(off.get(b"a"), None);
    }
}
