//! The region's key table: a word per admitted client holding its access
//! key, which every batch checks first (as a NIC checks the rkey).

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use crate::layout::{KEY_TABLE_ENTRIES, KEY_TABLE_OFFSET};
use crate::mapping::SharedRegion;
use crate::protocol::RemoteRegion;
use crate::transport::error::TransportError;

/// Byte offset of key-table entry `slot`.
pub(super) fn key_word(slot: u32) -> Result<u64, TransportError> {
    if u64::from(slot) >= KEY_TABLE_ENTRIES {
        return Err(TransportError::RemoteAccess(format!(
            "key slot {slot} outside the key table"
        )));
    }
    Ok(KEY_TABLE_OFFSET + u64::from(slot) * 8)
}

/// The region's key table as the server manages it: which entries are free,
/// and the keys it hands out.
pub(super) struct KeyTable {
    pub(super) region: Arc<SharedRegion>,
    free: Mutex<Vec<u32>>,
    /// Keys are this counter's successive values, so no two admissions of one
    /// registration share a key; it starts at a random value, so keys of
    /// successive servers differ too.
    next_key: AtomicU32,
}

impl KeyTable {
    /// Takes over the region's table, revoking every key in it.
    pub(super) fn new(region: Arc<SharedRegion>) -> Result<KeyTable, TransportError> {
        for slot in 0..KEY_TABLE_ENTRIES as u32 {
            region.store(key_word(slot)?, 0)?;
        }
        Ok(KeyTable {
            region,
            free: Mutex::new((0..KEY_TABLE_ENTRIES as u32).rev().collect()),
            // Random, so that the keys of successive servers differ.
            next_key: AtomicU32::new(crate::random::u64() as u32),
        })
    }

    pub(super) fn admit(&self) -> Result<RemoteRegion, TransportError> {
        let slot = self
            .free
            .lock()
            .map_err(|_| TransportError::Unsupported("key table poisoned".into()))?
            .pop()
            .ok_or_else(|| {
                TransportError::Unsupported(format!(
                    "all {KEY_TABLE_ENTRIES} client keys are in use"
                ))
            })?;
        let rkey = loop {
            let k = self.next_key.fetch_add(1, Ordering::Relaxed);
            if k != 0 {
                break k;
            }
        };
        self.region.store(key_word(slot)?, rkey as u64)?;
        Ok(RemoteRegion {
            base: 0,
            len: self.region.len(),
            rkey,
            key_slot: slot,
        })
    }

    pub(super) fn fence(&self, slot: u32) {
        if let Ok(word) = key_word(slot) {
            let _ = self.region.store(word, 0);
        }
        if let Ok(mut free) = self.free.lock() {
            free.push(slot);
        }
    }

    pub(super) fn revoke_all(&self) {
        for slot in 0..KEY_TABLE_ENTRIES as u32 {
            if let Ok(word) = key_word(slot) {
                let _ = self.region.store(word, 0);
            }
        }
    }
}
