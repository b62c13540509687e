//! A batch run on the mapping as a NIC runs it on a queue pair: the access
//! key first, then each verb, checked against the registration before it
//! runs.

use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicU64, Ordering};

use super::keys::key_word;
use crate::mapping::SharedRegion;
use crate::protocol::RemoteRegion;
use crate::transport::check;
use crate::transport::error::TransportError;
use crate::transport::verb::{ReadOrder, Verb};
use crate::words::{compare_and_swap, fetch_and_add, load_words, prefetch_lines, store_words};

/// The words of a local buffer covering `[at, at + len)`.
#[inline]
fn local_words(local: &mut [u64], at: usize, len: usize) -> Result<&mut [u64], TransportError> {
    let local_len = local.len() * 8;
    let aligned = (at | len).is_multiple_of(8);
    if aligned && at.checked_add(len).is_some_and(|end| end <= local_len) {
        return Ok(&mut local[at / 8..(at + len) / 8]);
    }
    Err(local_refusal(local_len, at, len))
}

/// Why `local_words` refused a range: the transports' range check, or
/// the alignment shm's word copies need.
#[cold]
#[inline(never)]
fn local_refusal(local_len: usize, at: usize, len: usize) -> TransportError {
    match check::local_range(local_len, at, len) {
        Err(e) => e,
        Ok(()) => TransportError::LocalAccess(format!(
            "local range {at}+{len} is not 8-byte aligned (shm copies whole words)"
        )),
    }
}

/// Executes a batch as a NIC would: the access key first, then each verb
/// in turn, each checked against the registered range before it runs.
#[inline]
pub(super) fn execute(
    region: &SharedRegion,
    remote: &RemoteRegion,
    read_order: ReadOrder,
    local: &mut [u64],
    verbs: &[Verb],
) -> Result<(), TransportError> {
    check::batch_len(verbs)?;
    // As a NIC checks the rkey and the queue pair's state: a client the
    // server cut off, or one of an earlier registration, is refused.
    let key = region.span_within(key_word(remote.key_slot)?, 8, u64::MAX);
    if key.is_none_or(|word| word[0].load(Ordering::Acquire) != remote.rkey as u64) {
        return Err(TransportError::TurnedAway(format!(
            "rkey {:#x} is not registered (the server restarted, shut down or cut this client off)",
            remote.rkey
        )));
    }
    check::run_batch(read_order, verbs, |verbs| {
        run_verbs(region, remote, local, verbs)
    })
}

/// Runs the verbs of a batch in order. A chunk's verbs
/// are all checked against the registered range (and their words found)
/// before any of them runs; a verb out of range fails the batch where it
/// stands, those before it having run, as on a NIC.
#[inline]
fn run_verbs(
    region: &SharedRegion,
    remote: &RemoteRegion,
    local: &mut [u64],
    verbs: &[Verb],
) -> Result<(), TransportError> {
    for chunk in verbs.chunks(PREFETCH_VERBS) {
        // Every verb is checked first and the lines the READs need are all
        // asked for, so that the first copy waits for one round of misses.
        let mut spans = [const { MaybeUninit::<&[AtomicU64]>::uninit() }; PREFETCH_VERBS];
        let mut refused = None;
        let mut checked = 0;
        for (verb, span) in chunk.iter().zip(&mut spans) {
            match verb_span(region, remote, verb) {
                Ok(words) => {
                    if matches!(verb, Verb::Read { .. }) {
                        prefetch_lines(words);
                    }
                    span.write(words);
                    checked += 1;
                }
                Err(e) => {
                    refused = Some(e);
                    break;
                }
            }
        }
        for (verb, span) in chunk[..checked].iter().zip(&spans) {
            // SAFETY: the first `checked` spans were written above.
            let span = unsafe { span.assume_init() };
            match *verb {
                Verb::Read { local: at, len, .. } => load_words(span, local_words(local, at, len)?),
                Verb::Write { local: at, len, .. } => {
                    store_words(local_words(local, at, len)?, span)
                }
                Verb::Cas {
                    local: at,
                    expect,
                    swap,
                    ..
                } => {
                    // The local word first: a verb that cannot complete
                    // must not change the region.
                    let old = local_words(local, at, 8)?;
                    old[0] = compare_and_swap(&span[0], expect, swap);
                }
                Verb::FetchAdd { local: at, add, .. } => {
                    let old = local_words(local, at, 8)?;
                    old[0] = fetch_and_add(&span[0], add);
                }
            }
        }
        if let Some(e) = refused {
            return Err(e);
        }
    }
    Ok(())
}

/// Verbs checked, and their READs' lines prefetched, before any of them
/// runs. 16 READs (a multi-key batch's windows are three lines each, a
/// block up to tens) are already more lines than a core has misses in
/// flight, so a longer batch waiting for its misses a chunk at a time
/// should lose little; GET's batches fit in one chunk.
const PREFETCH_VERBS: usize = 16;

/// The words a verb touches, if they lie within the registered range; or
/// why not.
#[inline(always)]
fn verb_span<'r>(
    region: &'r SharedRegion,
    remote: &RemoteRegion,
    verb: &Verb,
) -> Result<&'r [AtomicU64], TransportError> {
    let (off, len) = verb.remote_range();
    match region.span_within(off, len, remote.len) {
        Some(words) => Ok(words),
        None => checked_span(region, remote, off, len),
    }
}

/// `verb_span` off the data path: why the range is refused (or its words,
/// if the mapping has just grown to take it).
#[cold]
#[inline(never)]
fn checked_span<'r>(
    region: &'r SharedRegion,
    remote: &RemoteRegion,
    off: u64,
    len: usize,
) -> Result<&'r [AtomicU64], TransportError> {
    check::remote_range(remote, off, len)?;
    Ok(region.span(off, len)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mapping::tests::region;
    use crate::protocol::RemoteRegion;
    use crate::transport::shm::keys::key_word;

    /// A registration of all of `r` under key 77, as `admit` would make.
    fn registered(r: &SharedRegion) -> RemoteRegion {
        r.store(key_word(0).unwrap(), 77).unwrap();
        RemoteRegion {
            base: 0,
            len: r.len(),
            rkey: 77,
            key_slot: 0,
        }
    }

    #[test]
    fn a_batch_under_a_revoked_key_is_turned_away_having_run_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let r = region(&dir);
        let remote = registered(&r);
        let word = 40_960u64;
        r.store(word, 5).unwrap();
        // As the server revokes a client's key: its word zeroed.
        r.store(key_word(0).unwrap(), 0).unwrap();
        let mut local = vec![0u64; 4];
        let verbs = [
            Verb::Write {
                remote: word + 8,
                local: 0,
                len: 8,
            },
            Verb::Cas {
                remote: word,
                local: 8,
                expect: 5,
                swap: 6,
            },
        ];
        let e = execute(&r, &remote, ReadOrder::Posted, &mut local, &verbs).unwrap_err();
        assert!(e.ran_nothing() && e.is_connection_lost(), "{e}");
        assert_eq!(r.load(word).unwrap(), 5);
    }

    #[test]
    fn a_batch_stops_at_the_verb_out_of_range_having_run_those_before_it() {
        let dir = tempfile::tempdir().unwrap();
        let r = region(&dir);
        let remote = registered(&r);
        let data = 40_960u64;
        let mut local = vec![0u64; 64];
        // More verbs than are checked and prefetched at a time, the bad one
        // in the second chunk.
        let (count, bad) = (PREFETCH_VERBS as u64 + 4, PREFETCH_VERBS + 2);
        let mut verbs: Vec<Verb> = (0..count)
            .map(|i| Verb::FetchAdd {
                remote: data + 8 * i,
                local: 8 * i as usize,
                add: 1,
            })
            .collect();
        verbs[bad] = Verb::Read {
            remote: r.len() - 8,
            local: 0,
            len: 16,
        };
        let e = execute(&r, &remote, ReadOrder::Posted, &mut local, &verbs).unwrap_err();
        assert!(
            matches!(e, TransportError::RemoteAccess(_)) && !e.ran_nothing(),
            "{e}"
        );
        for i in 0..count {
            let want = u64::from(i < bad as u64);
            assert_eq!(r.load(data + 8 * i).unwrap(), want, "verb {i}");
        }
    }

    #[test]
    fn an_atomic_with_no_room_for_its_result_leaves_the_region_alone() {
        let dir = tempfile::tempdir().unwrap();
        let r = region(&dir);
        let remote = registered(&r);
        let word = 40_960u64;
        r.store(word, 5).unwrap();
        let mut local = vec![0u64; 4];
        let beyond = 8 * local.len();
        for verb in [
            Verb::Cas {
                remote: word,
                local: beyond,
                expect: 5,
                swap: 6,
            },
            Verb::FetchAdd {
                remote: word,
                local: beyond,
                add: 1,
            },
        ] {
            let e = execute(&r, &remote, ReadOrder::Posted, &mut local, &[verb]).unwrap_err();
            assert!(matches!(e, TransportError::LocalAccess(_)), "{e}");
            assert_eq!(r.load(word).unwrap(), 5);
        }
    }
}
