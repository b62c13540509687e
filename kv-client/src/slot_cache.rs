//! Where this client last saw each key: a bounded map from key to
//! [`Hint`]. What a hint allows, and when, is `hint`'s business.

use std::collections::HashMap;

use crate::hint::Hint;

pub struct SlotCache {
    entries: HashMap<Vec<u8>, Hint>,
    capacity: usize,
}

impl SlotCache {
    pub fn new(capacity: usize) -> SlotCache {
        SlotCache {
            entries: HashMap::new(),
            capacity,
        }
    }

    /// Whether hints are kept at all (on shm they are off by default).
    pub fn is_enabled(&self) -> bool {
        self.capacity > 0
    }

    pub fn get(&self, key: &[u8]) -> Option<Hint> {
        // Hashing a key costs more than a whole GET's bookkeeping: not
        // when there is nothing to find.
        if self.entries.is_empty() {
            return None;
        }
        self.entries.get(key).copied()
    }

    pub fn remember(&mut self, key: &[u8], hint: Hint) {
        if self.capacity == 0 {
            return;
        }
        if let Some(e) = self.entries.get_mut(key) {
            *e = hint;
            return;
        }
        if self.entries.len() >= self.capacity {
            // Cheaper than tracking recency, and entries refill on use.
            self.entries.clear();
        }
        self.entries.insert(key.to_vec(), hint);
    }

    pub fn forget(&mut self, key: &[u8]) {
        if !self.entries.is_empty() {
            self.entries.remove(key);
        }
    }

    pub fn clear(&mut self) {
        self.entries.clear();
    }
}

#[cfg(test)]
mod tests {

    use kv_common::layout::{Slot, SlotPos};

    use super::*;
    use std::time::Duration;

    use crate::clock::Timing;

    #[test]
    fn remembers_forgets_and_stays_bounded() {
        let pos = SlotPos {
            bucket: 3,
            index: 1,
        };
        let timing = Timing::new(Duration::from_millis(50));
        let hint = |s| Hint::seen(pos, Slot(s), timing.start());
        let mut c = SlotCache::new(2);
        c.remember(b"a", hint(7));
        c.remember(b"a", hint(8));
        assert_eq!(c.get(b"a").map(|h| h.slot), Some(Slot(8)));
        c.remember(b"b", hint(9));
        c.remember(b"c", hint(10));
        assert!(c.entries.len() <= 2);
        assert_eq!(c.get(b"c").map(|h| h.slot), Some(Slot(10)));
        c.forget(b"c");
        assert_eq!(c.get(b"c"), None);
        let mut off = SlotCache::new(0);
        off.remember(b"a", hint(1));
        assert_eq!(off.get(b"a"), None);
    }
}
