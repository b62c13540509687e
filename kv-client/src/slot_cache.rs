//! Where this client last saw each key: a table of [`Hint`]s keyed by the
//! key's hash, cheap enough to consult on every operation. What a hint
//! allows, and when, is `hint`'s business.
//!
//! A key has one set of [`WAYS`] entries (bits of its hash pick it): a
//! lookup compares the set's four tags, which share a cache line, and
//! reads the one entry whose tag matches; an insert takes a free way of the
//! set or the next in turn — no probing, no allocation per key, no recency
//! to track (a CLOCK, tried, kept no more useful hints under YCSB's
//! distributions). An entry holds either the key itself (up to [`INLINE_KEY`]
//! bytes, compared byte for byte) or, for a longer key, a second hash of
//! it keyed with a secret of this table (SipHash), so that nobody can
//! choose two long keys that the table takes for one: a hint is never
//! taken for another key's. The table starts small and doubles as it
//! fills, or as a key's set is full, up to its capacity: below it, no
//! hint is evicted (one evicted costs a hot key its read-free writes for
//! a settle time), and a client with few keys pays for few (a table of 4
//! to 16 entries per key held, as its hashes fall).

use std::hash::{BuildHasher, RandomState};

use xxhash_rust::xxh3::xxh3_64;

use crate::hint::Hint;

/// Keys up to this long are kept whole in their entry.
pub const INLINE_KEY: usize = 24;
/// Entries a table starts with.
const FIRST_SIZE: usize = 256;
/// Entries of one set (two hot keys whose hashes share low bits do not
/// take turns evicting each other).
const WAYS: usize = 4;

/// A set's tags: each way's key hash with its low bit set, 0 where the
/// way is empty. Aligned so that a lookup's compares touch one line.
#[derive(Clone, Copy)]
#[repr(align(32))]
struct Tags([u64; WAYS]);

#[derive(Clone, Copy)]
struct Entry {
    key_len: u16,
    /// The key, or its second hash in the first eight bytes.
    key: [u8; INLINE_KEY],
    /// None only in a way whose tag is 0.
    hint: Option<Hint>,
}

const EMPTY: Entry = Entry {
    key_len: 0,
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
    fn of(key: &[u8], keyed: &RandomState) -> Tag {
        let mut tag = Tag {
            hash: xxh3_64(key) | 1,
            key_len: key.len().min(usize::from(u16::MAX)) as u16,
            key: [0; INLINE_KEY],
        };
        if key.len() <= INLINE_KEY {
            tag.key[..key.len()].copy_from_slice(key);
        } else {
            tag.key[..8].copy_from_slice(&keyed.hash_one(key).to_le_bytes());
        }
        tag
    }

    fn matches(&self, e: &Entry) -> bool {
        e.key_len == self.key_len && e.key == self.key
    }
}

pub struct SlotCache {
    tags: Vec<Tags>,
    /// `WAYS` per set, in the order of its tags.
    entries: Vec<Entry>,
    /// Per set, the way its next eviction takes.
    victims: Vec<u8>,
    /// Entries in use.
    used: usize,
    capacity: usize,
    /// The secret of long keys' second hash.
    keyed: RandomState,
}

impl SlotCache {
    /// A table of at most `capacity` entries (rounded down to a power of
    /// two); 0 keeps no hints.
    pub fn new(capacity: usize) -> SlotCache {
        let capacity = match capacity {
            0 => 0,
            c => 1usize.checked_shl(c.ilog2()).unwrap_or(0).max(WAYS),
        };
        SlotCache {
            tags: Vec::new(),
            entries: Vec::new(),
            victims: Vec::new(),
            used: 0,
            capacity,
            keyed: RandomState::new(),
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
        let tag = Tag::of(key, &self.keyed);
        self.find(&tag).and_then(|at| self.entries[at].hint)
    }

    pub fn remember(&mut self, key: &[u8], hint: Hint) {
        self.update(key, |_| hint);
    }

    pub fn forget(&mut self, key: &[u8]) {
        if self.used == 0 {
            return;
        }
        let tag = Tag::of(key, &self.keyed);
        if let Some(at) = self.find(&tag) {
            self.tags[at / WAYS].0[at % WAYS] = 0;
            self.used -= 1;
        }
    }

    /// Sets the key's hint to what `next` makes of the one held (the key
    /// hashed once for both).
    pub fn update(&mut self, key: &[u8], next: impl FnOnce(Option<Hint>) -> Hint) {
        if self.capacity == 0 {
            return;
        }
        let tag = Tag::of(key, &self.keyed);
        let at = match self.used {
            0 => None,
            _ => self.find(&tag),
        };
        let hint = next(at.and_then(|at| self.entries[at].hint));
        match at {
            Some(at) => self.entries[at].hint = Some(hint),
            None => {
                if self.entries.len() < self.capacity && self.used >= self.entries.len() / 2 {
                    self.double();
                }
                // A doubling splits the set by one more bit of the hash,
                // which the keys held there may all share.
                while self.entries.len() < self.capacity && self.set_is_full(tag.hash) {
                    self.double();
                }
                self.insert(&tag, hint);
            }
        }
    }

    pub fn clear(&mut self) {
        self.tags.fill(Tags([0; WAYS]));
        self.used = 0;
    }

    /// The set `hash` belongs to (by the bits above the one every tag sets).
    fn set_of(&self, hash: u64) -> usize {
        (hash >> 1) as usize & (self.tags.len() - 1)
    }

    /// Whether `hash`'s set has no free way (a table not yet made has none).
    fn set_is_full(&self, hash: u64) -> bool {
        self.tags.is_empty() || !self.tags[self.set_of(hash)].0.contains(&0)
    }

    /// The entry that holds `tag`'s key.
    fn find(&self, tag: &Tag) -> Option<usize> {
        let set = self.set_of(tag.hash);
        let tags = &self.tags[set].0;
        (0..WAYS)
            .map(|w| set * WAYS + w)
            .find(|&at| tags[at % WAYS] == tag.hash && tag.matches(&self.entries[at]))
    }

    /// Puts the hint of a key the table does not hold in `tag`'s set: in a
    /// free way, else over the set's next victim.
    fn insert(&mut self, tag: &Tag, hint: Hint) {
        let set = self.set_of(tag.hash);
        let way = match self.tags[set].0.iter().position(|&t| t == 0) {
            Some(w) => {
                self.used += 1;
                w
            }
            None => {
                let v = &mut self.victims[set];
                let w = usize::from(*v);
                *v = ((w + 1) % WAYS) as u8;
                w
            }
        };
        self.tags[set].0[way] = tag.hash;
        self.entries[set * WAYS + way] = Entry {
            key_len: tag.key_len,
            key: tag.key,
            hint: Some(hint),
        };
    }

    /// Twice the entries (the first table at first use), each kept entry
    /// moved to its set in the new one.
    fn double(&mut self) {
        let size = (self.entries.len() * 2).clamp(FIRST_SIZE.min(self.capacity), self.capacity);
        let sets = size / WAYS;
        let old_tags = std::mem::replace(&mut self.tags, vec![Tags([0; WAYS]); sets]);
        let old = std::mem::replace(&mut self.entries, vec![EMPTY; size]);
        self.victims = vec![0; sets];
        self.used = 0;
        let kept = old_tags.iter().flat_map(|t| t.0).zip(old);
        for (hash, e) in kept.filter(|&(hash, _)| hash != 0) {
            let tag = Tag {
                hash,
                key_len: e.key_len,
                key: e.key,
            };
            if let Some(hint) = e.hint {
                self.insert(&tag, hint);
            }
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
        c.update(b"a", |held| hint(held.map_or(0, |h| h.slot.0 + 1)));
        assert_eq!(c.get(b"a").map(|h| h.slot), Some(Slot(9)));
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
    fn keys_spread_over_every_set() {
        // A quarter as many keys as entries: the table holds them all.
        let mut c = SlotCache::new(256);
        for i in 0..64u64 {
            c.remember(format!("key{i}").as_bytes(), hint(i));
        }
        let sets_used = c.tags.iter().filter(|t| t.0 != [0; WAYS]).count();
        assert!(sets_used > c.tags.len() / 2, "{sets_used} sets in use");
        for i in 0..64u64 {
            let got = c.get(format!("key{i}").as_bytes()).map(|h| h.slot);
            assert_eq!(got, Some(Slot(i)), "key{i} was evicted");
        }
    }

    #[test]
    fn below_its_capacity_the_table_evicts_nothing() {
        // A thousand hot keys of each naming: some of their sets overflow
        // in a table twice their number, and more than once.
        for name in ["user", "user_", "obj", "key", "k:"] {
            let mut c = SlotCache::new(1 << 16);
            let key = |i: u64| format!("{name}{i}").into_bytes();
            for i in 0..1_000 {
                c.remember(&key(i), hint(i));
            }
            for i in 0..1_000 {
                let got = c.get(&key(i)).map(|h| h.slot);
                assert_eq!(got, Some(Slot(i)), "{name}{i} was evicted");
            }
            assert!(c.entries.len() <= 16_384, "{} entries", c.entries.len());
        }
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
