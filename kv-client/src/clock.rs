//! Time as the protocol counts it. Every bound a client keeps derives from
//! the server's operation deadline `D`:
//!
//! - reads are trusted only if the batch that read the buckets started less
//!   than `D` before they completed (`OpClock::in_time`);
//! - space found unreferenced is reused only a grace period `G` later
//!   (`GRACE_DEADLINES` × `D`);
//! - a batch posted executes within `D` of being posted. The grace period's
//!   margin over the deadline covers it, and every bound below leans on it.

use std::time::Duration;

use kv_common::protocol::GRACE_DEADLINES;
// Two clock reads per operation: the TSC where it is invariant (calibrated
// against the monotonic clock), the monotonic clock where it is not.
use quanta::Instant;

/// The client's time bounds, from the deadline the server announced.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    deadline: Duration,
    grace: Duration,
}

impl Timing {
    pub fn new(deadline: Duration) -> Timing {
        Timing {
            deadline,
            grace: deadline * GRACE_DEADLINES,
        }
    }

    /// The server's operation deadline `D`.
    pub fn deadline(&self) -> Duration {
        self.deadline
    }

    /// Starts the clock of one attempt, just before its first batch.
    pub fn start(&self) -> OpClock {
        OpClock {
            started: Instant::now(),
            deadline: self.deadline,
        }
    }

    /// How long after a sighting a remembered slot may be used without
    /// reading the buckets first: a batch posted before then executes before
    /// a grace period has passed, so the block it names cannot have been
    /// reused, nor the slot have come back to the same value. That needs
    /// G − D; G − 2D leaves the same deadline of margin for a thread
    /// preempted between its check and its post that a CAS after a read
    /// has.
    pub fn hint_life(&self) -> Duration {
        self.grace.saturating_sub(self.deadline * 2)
    }

    /// How long after a copy of a key appears another insert of the key can
    /// still land: one that read the buckets just before the copy appeared
    /// publishes within a deadline of that read (it checks before its CAS),
    /// and its CAS executes within another; one more deadline is the margin
    /// for a thread preempted between its check and its post, as in
    /// `hint_life`.
    pub fn settle(&self) -> Duration {
        self.deadline * 3
    }

    /// How long a counter's lock must be seen unchanged before it is taken
    /// for a dead writer's. Its writer's steps execute within `3D` of the
    /// read that started them (a deadline to check, one of preemption, one
    /// to execute), and an increment that found the seal is taken back
    /// within `4D` of the seal (see `counter`); the waiter may first see the lock
    /// up to `3D` before the seal. Two settle periods and two deadlines
    /// leave a deadline of margin.
    pub fn lock_timeout(&self) -> Duration {
        self.settle() * 2 + self.deadline * 2
    }

    /// A pause that lets the server's reclaimer make progress.
    pub fn space_poll(&self) -> Duration {
        (self.grace / 8).max(Duration::from_millis(1))
    }
}

/// The clock of one attempt at an operation.
#[derive(Debug, Clone, Copy)]
pub struct OpClock {
    started: Instant,
    deadline: Duration,
}

impl OpClock {
    /// When the attempt's first batch was posted: what it read was in the
    /// region at this time or later.
    pub fn started(&self) -> Instant {
        self.started
    }

    /// Whether what this attempt has read can still be trusted: a block
    /// that a slot referenced when the buckets were read cannot have been
    /// reused yet. Also checked before a CAS based on those reads.
    pub fn in_time(&self) -> bool {
        self.started.elapsed() <= self.deadline
    }
}

#[cfg(test)]
impl OpClock {
    /// A clock that started at `started`.
    pub fn at(started: Instant) -> OpClock {
        OpClock {
            started,
            deadline: Duration::ZERO,
        }
    }
}
