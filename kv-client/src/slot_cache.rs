//! Where this client last saw each key: a table of [`Hint`]s keyed by the
//! key's hash, cheap enough to consult on every operation. What a hint
//! allows, and when, is `hint`'s business.
//!
//! Each entry is found at one place (the hash's low bits) and overwrites
//! whatever was there: no probing, no allocation per key, no recency to
//! track. An entry holds the key's hash and either the key itself (up to
//! [`INLINE_KEY`] bytes, compared byte for byte) or, for a longer key, a
//! second, independent hash of it: a hint is never taken for another key's
//! (a 128-bit collision is as likely as a memory error). The table starts
//! small and doubles as it fills, up to its capacity, so that a client with
//! few keys pays for few.

use kv_common::layout::KeyHash;

use crate::hint::Hint;

/// Keys up to this long are kept whole in their entry.
pub const INLINE_KEY: usize = 24;
/// Entries a table starts with.
const FIRST_SIZE: usize = 256;

#[derive(Clone, Copy)]
struct Entry {
    /// 0: the entry is empty (no key is empty).
    key_len: u16,
    hash: u64,
    /// The key, or its second hash in the first eight bytes.
    key: [u8; INLINE_KEY],
    hint: Option<Hint>,
}

const EMPTY: Entry = Entry {
    key_len: 0,
    hash: 0,
    key: [0; INLINE_KEY],
    hint: None,
};

/// A key as the table compares it.
struct Tag {
    hash: u64,
    key_len: u16,
    key: [u8; INLINE_KEY],
}

impl Tag {
    fn of(key: &[u8]) -> Tag {
        let [hash, second] = KeyHash::hashes(key);
        let mut tag = Tag {
            hash,
            key_len: key.len().min(usize::from(u16::MAX)) as u16,
            key: [0; INLINE_KEY],
        };
        if key.len() <= INLINE_KEY {
            tag.key[..key.len()].copy_from_slice(key);
        } else {
            tag.key[..8].copy_from_slice(&second.to_le_bytes());
        }
        tag
    }

    fn matches(&self, e: &Entry) -> bool {
        e.hash == self.hash && e.key_len == self.key_len && e.key == self.key
    }
}

pub struct SlotCache {
    entries: Vec<Entry>,
    /// Entries in use.
    used: usize,
    capacity: usize,
}

impl SlotCache {
    /// A table of at most `capacity` entries (rounded down to a power of
    /// two); 0 keeps no hints.
    pub fn new(capacity: usize) -> SlotCache {
        let capacity = match capacity {
            0 => 0,
            c => 1 << c.ilog2(),
        };
        SlotCache {
            entries: Vec::new(),
            used: 0,
            capacity,
        }
    }

    /// Whether hints are kept at all.
    pub fn is_enabled(&self) -> bool {
        self.capacity > 0
    }

    pub fn get(&self, key: &[u8]) -> Option<Hint> {
        if self.used == 0 {
            return None;
        }
        let tag = Tag::of(key);
        let e = &self.entries[self.index(tag.hash)];
        if tag.matches(e) {
            e.hint
        } else {
            None
        }
    }

    pub fn remember(&mut self, key: &[u8], hint: Hint) {
        if self.capacity == 0 {
            return;
        }
        if self.entries.len() < self.capacity && self.used >= self.entries.len() / 2 {
            self.double();
        }
        let tag = Tag::of(key);
        let i = self.index(tag.hash);
        let e = &mut self.entries[i];
        if e.key_len == 0 {
            self.used += 1;
        }
        *e = Entry {
            key_len: tag.key_len,
            hash: tag.hash,
            key: tag.key,
            hint: Some(hint),
        };
    }

    pub fn forget(&mut self, key: &[u8]) {
        if self.used == 0 {
            return;
        }
        let tag = Tag::of(key);
        let i = self.index(tag.hash);
        if tag.matches(&self.entries[i]) {
            self.entries[i] = EMPTY;
            self.used -= 1;
        }
    }

    pub fn clear(&mut self) {
        self.entries.fill(EMPTY);
        self.used = 0;
    }

    fn index(&self, hash: u64) -> usize {
        (hash as usize) & (self.entries.len() - 1)
    }

    /// Twice the entries (the first table at first use), each kept entry
    /// at its place in the new one.
    fn double(&mut self) {
        let size = (self.entries.len() * 2).clamp(FIRST_SIZE.min(self.capacity), self.capacity);
        let old = std::mem::replace(&mut self.entries, vec![EMPTY; size]);
        self.used = 0;
        for e in old.into_iter().filter(|e| e.key_len != 0) {
            let i = self.index(e.hash);
            if self.entries[i].key_len == 0 {
                self.used += 1;
            }
            self.entries[i] = e;
        }
    }
}

#[cfg(test)]
mod tests {

    use kv_common::layout::{Slot, SlotPos};

    use super::*;
    use std::time::Duration;

    use crate::clock::Timing;

    fn hint(s: u64) -> Hint {
        let pos = SlotPos {
            bucket: 3,
            index: 1,
        };
        let timing = Timing::new(Duration::from_millis(50));
        Hint::seen(pos, Slot(s), timing.start())
    }

    #[test]
    fn remembers_forgets_and_stays_bounded() {
        let mut c = SlotCache::new(300);
        c.remember(b"a", hint(7));
        c.remember(b"a", hint(8));
        assert_eq!(c.get(b"a").map(|h| h.slot), Some(Slot(8)));
        c.forget(b"a");
        assert_eq!(c.get(b"a"), None);
        for i in 0..10_000u64 {
            c.remember(format!("key{i}").as_bytes(), hint(i));
        }
        assert_eq!(
            c.entries.len(),
            256,
            "capacity rounded down to a power of two"
        );
        assert_eq!(c.get(b"key9999").map(|h| h.slot), Some(Slot(9999)));
        let mut off = SlotCache::new(0);
        off.remember(b"a", hint(1));
        assert_eq!(off.get(b"a"), None);
    }

    #[test]
    fn a_hint_is_never_taken_for_another_keys() {
        let mut c = SlotCache::new(1 << 16);
        let long = |i: u32| format!("{i:0>40}").into_bytes();
        for i in 0..20_000u32 {
            c.remember(&long(i), hint(u64::from(i)));
            c.remember(format!("k{i}").as_bytes(), hint(u64::from(i) + 1_000_000));
        }
        // Whatever was evicted, what is found is the key's own.
        for i in 0..20_000u32 {
            if let Some(h) = c.get(&long(i)) {
                assert_eq!(h.slot, Slot(u64::from(i)));
            }
            if let Some(h) = c.get(format!("k{i}").as_bytes()) {
                assert_eq!(h.slot, Slot(u64::from(i) + 1_000_000));
            }
        }
        // A key that shares a long key's prefix, or its first hash's
        // entry, is another key.
        assert_eq!(c.get(&long(20_001)), None);
        assert_eq!(c.get(b"k20001"), None);
        c.clear();
        assert_eq!(c.get(b"k1"), None);
    }
}
