//! How long a client may read a copy of a replicated shard (protocol 12).
//!
//! A failover promotes a backup once the old primary's member lease has
//! expired in etcd. Over shm the new primary's member revokes the old
//! region's keys; over rdma a primary that is only frozen (SIGSTOP, a VM
//! pause) keeps its registration, so a client that has not yet seen the
//! new map could read there a value that a write at the new primary has
//! already replaced. So a copy grants reads for a bounded time, and a
//! client renews before it reads past it:
//!
//! - the server grants no more than its member counts its own lease as
//!   held (¾ TTL after its last acknowledged renewal was sent, before etcd
//!   could expire it), less two operation deadlines; a member that cannot
//!   confirm its lease grants nothing (kv-server's `Shared::read_lease`);
//! - the client counts a grant from when it sent the request, before the
//!   server read its clock, so its lease ends before the server's does,
//!   and a read it checked against the lease executes within a deadline,
//!   still before the member's lease may end;
//! - a new primary takes writes only after the old member's lease expired
//!   in etcd. Every read at the old primary precedes every write at the
//!   new one (the clocks involved differ in rate only, which the margins
//!   cover).
//!
//! A client renews halfway through its lease, so a live copy never makes a
//! reader wait; a renewal not answered by the end of the lease (at least
//! `MIN_RENEWAL_WAIT`) fails as a lost connection: the caller reconnects,
//! and a cluster client follows the map to the new primary.

use std::time::Duration;

use crate::clock::Instant;

/// How long a renewal may wait for its answer even when the lease has
/// (nearly) run out: a live server on a busy host answers well within it.
pub(crate) const MIN_RENEWAL_WAIT: Duration = Duration::from_secs(1);

/// No grant is taken as longer: a region that needs no lease is not asked.
const LONGEST: Duration = Duration::from_secs(3600);

#[derive(Debug, Clone, Copy)]
pub(crate) struct ReadLease {
    until: Instant,
    renew_at: Instant,
}

impl ReadLease {
    /// A grant of `valid_us` answering a request sent at `sent`.
    pub fn granted(sent: Instant, valid_us: u64) -> ReadLease {
        let valid = Duration::from_micros(valid_us).min(LONGEST);
        ReadLease {
            until: sent + valid,
            renew_at: sent + valid / 2,
        }
    }

    /// Whether it is time to renew (halfway through, or past the end).
    pub fn due(&self, now: Instant) -> bool {
        now >= self.renew_at
    }

    /// How long the renewal may wait for its answer.
    pub fn renewal_wait(&self, now: Instant) -> Duration {
        self.until
            .saturating_duration_since(now)
            .max(MIN_RENEWAL_WAIT)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_is_renewed_from_halfway_and_waits_at_least_the_minimum() {
        let sent = crate::clock::now();
        let lease = ReadLease::granted(sent, 4_000_000);
        assert!(!lease.due(sent));
        assert!(!lease.due(sent + Duration::from_millis(1999)));
        assert!(lease.due(sent + Duration::from_secs(2)));
        assert_eq!(lease.renewal_wait(sent), Duration::from_secs(4));
        assert_eq!(
            lease.renewal_wait(sent + Duration::from_secs(10)),
            MIN_RENEWAL_WAIT
        );
        let none = ReadLease::granted(sent, 0);
        assert!(none.due(sent));
        let huge = ReadLease::granted(sent, u64::MAX);
        assert!(!huge.due(sent + Duration::from_secs(1799)));
    }
}
