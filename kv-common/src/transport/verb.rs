//! The verbs a client posts: READ, WRITE, CAS and FETCH-AND-ADD on the
//! region, in batches of up to [`MAX_BATCH_VERBS`], and what they did.

use serde::{Deserialize, Serialize};

/// One work request. `remote` is an offset inside the region, `local` an
/// offset inside the connection's local buffer.
///
/// Order within a batch, as on an RC queue pair: a WRITE or an atomic
/// executes after the WRITEs posted before it, an atomic after the atomics
/// posted before it, and a READ sees the effect of the WRITEs and atomics
/// posted before it. Nothing may count on a WRITE executing after an
/// earlier READ or atomic of the same batch, nor an atomic after an earlier
/// READ (an RC queue pair orders those only with the fence indicator), nor
/// on the order in which the READs of a batch read memory (see
/// [`ReadOrder`]). Atomics after atomics: the responder executes requests
/// in the order sent (IBA vol. 1, §9.5), a retried atomic is answered from
/// its cache rather than executed again, and the stores of two atomics
/// reach host memory as posted writes, in order; libfabric's verbs
/// provider advertises it for RC (`FI_ORDER_ATOMIC_WAW`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verb {
    Read {
        remote: u64,
        local: usize,
        len: usize,
    },
    Write {
        remote: u64,
        local: usize,
        len: usize,
    },
    /// Compare-and-swap an 8-byte aligned word; the old value lands at `local`.
    Cas {
        remote: u64,
        local: usize,
        expect: u64,
        swap: u64,
    },
    /// Fetch-and-add on an 8-byte aligned word; the old value lands at `local`.
    FetchAdd { remote: u64, local: usize, add: u64 },
}

impl Verb {
    /// The remote bytes the verb touches: offset and length.
    #[inline]
    pub fn remote_range(&self) -> (u64, usize) {
        match *self {
            Verb::Read { remote, len, .. } | Verb::Write { remote, len, .. } => (remote, len),
            Verb::Cas { remote, .. } | Verb::FetchAdd { remote, .. } => (remote, 8),
        }
    }

    /// Where in the local buffer the verb's data or old value lands.
    #[inline]
    pub fn local_offset(&self) -> usize {
        match *self {
            Verb::Read { local, .. }
            | Verb::Write { local, .. }
            | Verb::Cas { local, .. }
            | Verb::FetchAdd { local, .. } => local,
        }
    }
}

/// What a connection has done on the data path.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VerbStats {
    /// Batches posted and completed (one doorbell and one wait each).
    pub round_trips: u64,
    /// Of `round_trips`, those the caller waited for one after the other:
    /// a client of a replicated shard that has a batch in flight on
    /// several copies at once waits for them together, and they count
    /// once (kv-client's `Client::verb_stats`). A connection alone counts
    /// each of its round trips. (Over shm, where a batch completes as it is
    /// started, these are the round trips a network would wait for.)
    pub waits: u64,
    /// READs, WRITEs and atomics.
    pub verbs: u64,
    /// Bytes the READs fetched.
    pub bytes_read: u64,
    /// Bytes the WRITEs stored.
    pub bytes_written: u64,
    /// CASes and FETCH-AND-ADDs.
    pub atomics: u64,
    /// CASes that found another value than expected.
    pub cas_failures: u64,
}

impl VerbStats {
    /// What was done between `earlier` and `self`.
    pub fn since(&self, earlier: &VerbStats) -> VerbStats {
        VerbStats {
            round_trips: self.round_trips - earlier.round_trips,
            waits: self.waits - earlier.waits,
            verbs: self.verbs - earlier.verbs,
            bytes_read: self.bytes_read - earlier.bytes_read,
            bytes_written: self.bytes_written - earlier.bytes_written,
            atomics: self.atomics - earlier.atomics,
            cas_failures: self.cas_failures - earlier.cas_failures,
        }
    }

    /// Counts one completed batch (one round trip); CAS results are read
    /// back from the local buffer to count failures.
    #[inline]
    pub fn record_batch(&mut self, verbs: &[Verb], local: &[u8]) {
        for v in verbs {
            match *v {
                Verb::Read { len, .. } => self.bytes_read += len as u64,
                Verb::Write { len, .. } => self.bytes_written += len as u64,
                Verb::Cas {
                    local: at, expect, ..
                } => {
                    self.atomics += 1;
                    if read_u64(local, at) != expect {
                        self.cas_failures += 1;
                    }
                }
                Verb::FetchAdd { .. } => self.atomics += 1,
            }
        }
        self.verbs += verbs.len() as u64;
        self.round_trips += 1;
        self.waits += 1;
    }

    pub fn add(&mut self, other: &VerbStats) {
        self.round_trips += other.round_trips;
        self.waits += other.waits;
        self.verbs += other.verbs;
        self.bytes_read += other.bytes_read;
        self.bytes_written += other.bytes_written;
        self.atomics += other.atomics;
        self.cas_failures += other.cas_failures;
    }
}

/// Verbs one batch may hold (over rdma, the send queue's depth; shm keeps
/// the same limit so that a client that is right on one is right on both).
pub const MAX_BATCH_VERBS: usize = 64;

/// The order in which the READs of a batch read remote memory. An RC queue
/// pair returns READ responses in order, but the NIC's DMA reads of host
/// memory for them may be served in either order (PCIe lets read requests
/// pass each other), so the client must not depend on it. `Reversed` makes
/// that visible: the READs of a batch execute last to first, pausing between
/// them as a slow PCIe path would; every other verb keeps its place (an
/// atomic or a WRITE executes after the verbs posted before it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ReadOrder {
    #[default]
    Posted,
    Reversed {
        pause: std::time::Duration,
    },
}

impl ReadOrder {
    /// The verbs in the order they execute: READs take the places READs
    /// had, last to first.
    pub fn arrange(self, verbs: &[Verb]) -> std::borrow::Cow<'_, [Verb]> {
        if self == ReadOrder::Posted {
            return std::borrow::Cow::Borrowed(verbs);
        }
        let mut reads = verbs
            .iter()
            .rev()
            .filter(|v| matches!(v, Verb::Read { .. }));
        let arranged = verbs
            .iter()
            .map(|v| match v {
                Verb::Read { .. } => *reads.next().unwrap_or(v),
                other => *other,
            })
            .collect();
        std::borrow::Cow::Owned(arranged)
    }

    /// How long to wait before executing `verb` when `earlier_read` READs
    /// of the batch have executed already.
    pub fn pause_before(self, verb: &Verb, earlier_reads: usize) -> Option<std::time::Duration> {
        match self {
            ReadOrder::Reversed { pause } if earlier_reads > 0 => {
                matches!(verb, Verb::Read { .. }).then_some(pause)
            }
            _ => None,
        }
    }
}

/// Reads a little-endian u64 out of a local buffer.
pub fn read_u64(buf: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&buf[at..at + 8]);
    u64::from_le_bytes(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reversed_reads_take_the_read_places_last_to_first() {
        let read = |remote| Verb::Read {
            remote,
            local: 0,
            len: 8,
        };
        let cas = Verb::Cas {
            remote: 0,
            local: 0,
            expect: 1,
            swap: 2,
        };
        let batch = [read(1), cas, read(2), read(3)];
        let order = ReadOrder::Reversed {
            pause: std::time::Duration::ZERO,
        };
        assert_eq!(&*order.arrange(&batch), &[read(3), cas, read(2), read(1)]);
        assert_eq!(&*ReadOrder::Posted.arrange(&batch), &batch);
        assert_eq!(order.pause_before(&read(2), 0), None);
        assert!(order.pause_before(&read(2), 1).is_some());
        assert_eq!(order.pause_before(&cas, 1), None);
    }
}
