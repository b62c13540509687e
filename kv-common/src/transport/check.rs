//! The rules both backends apply to a batch, as a NIC checks a work
//! request: the batch's length, each verb's remote range against the
//! registration and its local range against the buffer, and the order in
//! which the verbs run. Each rule and its message is written here once.

use super::error::TransportError;
use super::verb::{ReadOrder, Verb, MAX_BATCH_VERBS};
use crate::protocol::RemoteRegion;

/// Runs a batch of verbs in `order` through `run`, which executes the verbs
/// it is given in turn (all of them in one go where it can).
///
/// `Posted` hands `run` the batch as it is. The test order `Reversed` hands
/// it the batch with its READs last to first; with a pause, one verb at a
/// time, sleeping before each READ after the first as a slow PCIe path
/// would (it is still one batch to whoever counts them).
///
/// # Errors
///
/// Whatever `run` returns, at the first verb that fails.
#[inline]
pub(crate) fn run_batch(
    order: ReadOrder,
    verbs: &[Verb],
    mut run: impl FnMut(&[Verb]) -> Result<(), TransportError>,
) -> Result<(), TransportError> {
    match order {
        // The data path.
        ReadOrder::Posted => run(verbs),
        ReadOrder::Reversed { pause } if pause.is_zero() => run(&order.arrange(verbs)),
        ReadOrder::Reversed { .. } => {
            let mut reads = 0;
            for verb in order.arrange(verbs).iter() {
                if let Some(pause) = order.pause_before(verb, reads) {
                    std::thread::sleep(pause);
                }
                run(std::slice::from_ref(verb))?;
                reads += usize::from(matches!(verb, Verb::Read { .. }));
            }
            Ok(())
        }
    }
}

/// Whether a batch fits a send queue: checked before anything else of it,
/// as posting it would fail.
///
/// # Errors
///
/// `LocalAccess` for a batch of more than [`MAX_BATCH_VERBS`].
#[inline]
pub(crate) fn batch_len(verbs: &[Verb]) -> Result<(), TransportError> {
    if verbs.len() > MAX_BATCH_VERBS {
        return Err(batch_too_long(verbs.len()));
    }
    Ok(())
}

#[cold]
fn batch_too_long(len: usize) -> TransportError {
    TransportError::LocalAccess(format!("batch of {len} verbs exceeds {MAX_BATCH_VERBS}"))
}

/// Whether `[offset, offset + len)` lies within the registered range.
///
/// # Errors
///
/// `RemoteAccess` naming the range when it does not.
#[inline]
pub(crate) fn remote_range(
    remote: &RemoteRegion,
    offset: u64,
    len: usize,
) -> Result<(), TransportError> {
    if offset
        .checked_add(len as u64)
        .is_none_or(|end| end > remote.len)
    {
        return Err(TransportError::RemoteAccess(format!(
            "range {offset}+{len} outside the registered {} bytes",
            remote.len
        )));
    }
    Ok(())
}

/// Whether `[at, at + len)` lies within a local buffer of `local_len`
/// bytes.
///
/// # Errors
///
/// `LocalAccess` naming the range when it does not.
#[inline]
pub(crate) fn local_range(local_len: usize, at: usize, len: usize) -> Result<(), TransportError> {
    if at.checked_add(len).is_none_or(|end| end > local_len) {
        return Err(TransportError::LocalAccess(format!(
            "local range {at}+{len} outside the {local_len}-byte buffer"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn read(remote: u64) -> Verb {
        Verb::Read {
            remote,
            local: 0,
            len: 8,
        }
    }

    /// The verbs `run_batch` hands over, call by call.
    fn calls(order: ReadOrder, verbs: &[Verb]) -> Vec<Vec<Verb>> {
        let mut calls = Vec::new();
        run_batch(order, verbs, |part| {
            calls.push(part.to_vec());
            Ok(())
        })
        .unwrap();
        calls
    }

    #[test]
    fn a_batch_runs_as_posted_or_reversed_and_paused_one_verb_at_a_time() {
        let batch = [read(1), read(2)];
        assert_eq!(calls(ReadOrder::Posted, &batch), vec![batch.to_vec()]);
        let reversed = ReadOrder::Reversed {
            pause: Duration::ZERO,
        };
        assert_eq!(calls(reversed, &batch), vec![vec![read(2), read(1)]]);
        let paused = ReadOrder::Reversed {
            pause: Duration::from_millis(1),
        };
        assert_eq!(calls(paused, &batch), vec![vec![read(2)], vec![read(1)]]);
    }

    #[test]
    fn a_batch_too_long_and_ranges_outside_are_refused() {
        let long = vec![read(0); MAX_BATCH_VERBS + 1];
        assert!(batch_len(&long[1..]).is_ok());
        let e = batch_len(&long).unwrap_err();
        assert!(matches!(e, TransportError::LocalAccess(_)), "{e}");
        let remote = RemoteRegion {
            base: 0,
            len: 64,
            rkey: 1,
            key_slot: 0,
        };
        assert!(remote_range(&remote, 56, 8).is_ok());
        assert!(remote_range(&remote, 57, 8).is_err());
        assert!(remote_range(&remote, u64::MAX - 3, 8).is_err());
        assert!(local_range(16, 8, 8).is_ok());
        assert!(local_range(16, 9, 8).is_err());
        assert!(local_range(16, usize::MAX, 2).is_err());
    }
}
