//! Telling damage from a race when a block fails validation.

use kv_common::layout::{Slot, SlotPos};

use crate::{Error, Result};

/// Attempts in a row that must meet the same slot value with an invalid
/// block before the key is reported corrupt.
const CORRUPT_AFTER: u32 = 3;

/// Tells damage from a race. A block that its slot references, read within
/// the deadline, cannot be mid-rewrite (space is reused only a grace period
/// after it was unreferenced), so the same slot value failing validation
/// on fresh reads of the buckets, again and again, is damage: reported as
/// [`Error::Corrupt`] after a few attempts instead of spinning until the
/// attempt limit. A slot that changes in between resets the count.
#[derive(Default)]
pub struct CorruptSlot {
    last: Option<(SlotPos, Slot)>,
    times: u32,
}

impl CorruptSlot {
    pub fn saw(&mut self, key: &[u8], suspect: Option<(SlotPos, Slot)>) -> Result<()> {
        let Some(s) = suspect else {
            return Ok(());
        };
        if self.last == Some(s) {
            self.times += 1;
        } else {
            self.last = Some(s);
            self.times = 1;
        }
        if self.times >= CORRUPT_AFTER {
            return Err(Error::Corrupt {
                key: String::from_utf8_lossy(key).into_owned(),
                bucket: s.0.bucket,
                slot: s.0.index,
                offset: s.1.offset(),
            });
        }
        std::thread::yield_now();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_invalid_slot_three_times_is_corrupt_a_changing_one_is_not() {
        let pos = SlotPos {
            bucket: 5,
            index: 2,
        };
        let (a, b) = (Slot::new(1, 0, 8192), Slot::new(1, 0, 8256));
        let mut t = CorruptSlot::default();
        assert!(t.saw(b"k", Some((pos, a))).is_ok());
        assert!(t.saw(b"k", None).is_ok(), "a slow read is no evidence");
        assert!(t.saw(b"k", Some((pos, a))).is_ok());
        // The slot changed (a writer at work): start counting again.
        assert!(t.saw(b"k", Some((pos, b))).is_ok());
        assert!(t.saw(b"k", Some((pos, b))).is_ok());
        match t.saw(b"k", Some((pos, b))) {
            Err(Error::Corrupt {
                key,
                bucket,
                slot,
                offset,
            }) => assert_eq!((key.as_str(), bucket, slot, offset), ("k", 5, 2, 8256)),
            other => panic!("expected Corrupt, got {other:?}"),
        }
    }
}
