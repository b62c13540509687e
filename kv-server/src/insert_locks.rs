//! Insert locks of a replicated shard's primary: a writer that found a key
//! absent holds the key's lock while it writes the backups and inserts the
//! key here, so that no two inserts of one key are under way at once (the
//! argument is in kv-client's `replicated`). A lock lapses on its own after
//! `ttl`: a writer that died holding one delays that key's next insert by
//! at most that long, and a writer acts on its lock only while a deadline
//! of it is left by its own clock, started before it asked. (A client that
//! leaves keeps its locks until they lapse: one cut off for being slow may
//! still be inserting.)

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::heap::ClientId;

/// Locks held at most at once: beyond, the oldest lapsed ones are dropped
/// first, and a request that finds every lock live is refused (the writer
/// waits and asks again), so no client can grow the table without bound.
pub const MAX_INSERT_LOCKS: usize = 1 << 16;

pub struct InsertLocks {
    ttl: Duration,
    held: HashMap<u64, (ClientId, Instant)>,
}

impl InsertLocks {
    pub fn new(ttl: Duration) -> InsertLocks {
        InsertLocks {
            ttl,
            held: HashMap::new(),
        }
    }

    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Gives `key`'s lock to `client` (again, if it is already its own):
    /// true, unless another client holds it and it has not lapsed.
    pub fn take(&mut self, key: u64, client: ClientId, now: Instant) -> bool {
        if let Some(&(holder, until)) = self.held.get(&key) {
            if holder != client && until > now {
                return false;
            }
        } else if self.held.len() >= MAX_INSERT_LOCKS {
            self.held.retain(|_, (_, until)| *until > now);
            if self.held.len() >= MAX_INSERT_LOCKS {
                return false;
            }
        }
        self.held.insert(key, (client, now + self.ttl));
        true
    }

    /// Lets `key`'s lock go, if `client` holds it.
    pub fn release(&mut self, key: u64, client: ClientId) {
        if self
            .held
            .get(&key)
            .is_some_and(|&(holder, _)| holder == client)
        {
            self.held.remove(&key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lock_is_one_clients_until_released_or_lapsed() {
        let ttl = Duration::from_millis(100);
        let mut locks = InsertLocks::new(ttl);
        let t = Instant::now();
        assert!(locks.take(7, 1, t));
        assert!(locks.take(7, 1, t), "its holder may take it again");
        assert!(!locks.take(7, 2, t + ttl / 2));
        assert!(locks.take(8, 2, t), "another key is another lock");
        locks.release(7, 2);
        assert!(!locks.take(7, 2, t), "only the holder lets it go");
        locks.release(7, 1);
        assert!(locks.take(7, 2, t));
        assert!(locks.take(7, 1, t + ttl * 2), "a lapsed lock is anyone's");
    }

    #[test]
    fn the_table_is_bounded() {
        let ttl = Duration::from_millis(100);
        let mut locks = InsertLocks::new(ttl);
        let t = Instant::now();
        for key in 0..MAX_INSERT_LOCKS as u64 {
            assert!(locks.take(key, 1, t));
        }
        assert!(!locks.take(u64::MAX, 2, t), "every lock is live");
        assert!(
            locks.take(u64::MAX, 2, t + ttl * 2),
            "lapsed ones make room"
        );
        assert!(locks.held.len() <= 2);
    }
}
