//! How long a client may read a copy of a replicated shard (protocol 12).
//!
//! A failover promotes a backup once the old primary's member lease has
//! expired in etcd. Over shm the new primary's member revokes the old
//! region's keys; over rdma a primary that is only frozen (SIGSTOP) keeps
//! its registration, so a client that has not yet seen the new map could
//! read there a value that a write at the new primary has already
//! replaced. So a copy grants reads for a bounded time, and a client
//! renews before it reads past it:
//!
//! - the server grants no more than its member counts the etcd lease the
//!   copy started under as held (¾ TTL after its last acknowledged renewal
//!   was sent, before etcd could expire it), less two operation deadlines;
//!   a member that cannot confirm that lease grants nothing (kv-server's
//!   `Shared::read_lease`);
//! - the client counts a grant from when it sent the request, before the
//!   server read its clock, so its lease ends before the server's does;
//!   and it trusts an attempt's reads only if the attempt started within
//!   the lease (`OpClock::in_time`), so they executed within a deadline
//!   after it, still before the member's lease may end;
//! - a new primary takes writes only after the old member's lease expired
//!   in etcd. Every read at the old primary precedes every write at the
//!   new one.
//!
//! The clocks involved are monotonic and differ in rate only, which the
//! margins cover. A clock that stops while the process is frozen (a
//! virtual machine paused with its guest clock held) is outside this
//! argument.
//!
//! A client renews halfway through its lease, so a live copy never makes a
//! reader wait; a renewal not answered by the end of the lease (at least
//! `MIN_RENEWAL_WAIT`) fails as a lost connection: the caller reconnects,
//! and a cluster client follows the map to the new primary. Every other
//! control call at a copy (a chunk lease, a report) waits at most
//! `COPY_CALL_WAIT` (`Client::call`), and a cluster client's connect to a
//! copy less (`COPY_CONNECT_WAIT`): a writer busy at a frozen primary
//! would otherwise wait out the reply timeout (10 s) after its failover.
//! Sooner still, a cluster client's map follower cuts off every
//! connection to a copy once a map drops it from its group (`Board`,
//! `transport::Cutoff`): a writer waiting on a frozen backup goes on as
//! soon as the map has replaced it.

use std::time::Duration;

use crate::clock;

/// How long a renewal may wait for its answer even when the lease has
/// (nearly) run out: a live server on a busy host answers well within it.
pub(crate) const MIN_RENEWAL_WAIT: Duration = Duration::from_secs(1);

/// How long any other control call at a copy waits for its answer, when
/// the lease would end sooner: a chunk lease cut short on a live server
/// slow under load can leave a write's outcome unknown (a backup set
/// before it), so such calls get more than a renewal does; but well short
/// of the reply timeout, so that a writer busy at a frozen primary
/// follows its failover.
pub(crate) const COPY_CALL_WAIT: Duration = Duration::from_secs(5);

/// A lease, in raw readings of the client's clock.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ReadLease {
    until: u64,
    renew_at: u64,
}

impl ReadLease {
    /// A grant of `valid_us` answering a request sent at raw reading
    /// `sent`.
    pub fn granted(sent: u64, valid_us: u64) -> ReadLease {
        let valid = Duration::from_micros(valid_us);
        ReadLease {
            until: sent.saturating_add(clock::ticks_within(valid)),
            renew_at: sent.saturating_add(clock::ticks_within(valid / 2)),
        }
    }

    /// The raw reading from which no read counts.
    pub fn until(&self) -> u64 {
        self.until
    }

    /// Whether it is time to renew (halfway through, or past the end).
    pub fn due(&self, now: u64) -> bool {
        now >= self.renew_at
    }

    /// Whether it has run out.
    pub fn over(&self, now: u64) -> bool {
        now >= self.until
    }

    /// How long the renewal may wait for its answer.
    pub fn renewal_wait(&self, now: u64) -> Duration {
        clock::raw_interval(now, self.until).max(MIN_RENEWAL_WAIT)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_is_renewed_from_halfway_and_waits_at_least_the_minimum() {
        let sent = clock::raw();
        let lease = ReadLease::granted(sent, 4_000_000);
        let at = |d: Duration| sent + clock::ticks_within(d);
        assert!(!lease.due(sent));
        assert!(!lease.due(at(Duration::from_millis(1990))));
        assert!(lease.due(at(Duration::from_millis(2010))));
        assert!(!lease.over(at(Duration::from_millis(3990))));
        assert!(lease.over(at(Duration::from_millis(4010))));
        let wait = lease.renewal_wait(sent);
        assert!(wait > Duration::from_millis(3990) && wait <= Duration::from_secs(4));
        assert_eq!(
            lease.renewal_wait(at(Duration::from_secs(10))),
            MIN_RENEWAL_WAIT
        );
        let none = ReadLease::granted(sent, 0);
        assert!(none.due(sent) && none.over(sent));
        let huge = ReadLease::granted(sent, u64::MAX);
        assert!(!huge.over(at(Duration::from_secs(600))));
    }
}
