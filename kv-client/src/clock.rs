//! Time as the protocol counts it. Every bound a client keeps derives from
//! the server's operation deadline `D`:
//!
//! - reads are trusted only if the batch that read the buckets started less
//!   than `D` before they completed (`OpClock::in_time`);
//! - space found unreferenced is reused only a grace period `G` later
//!   (`GRACE_DEADLINES` × `D`);
//! - a batch posted executes within `D` of being posted. The grace period's
//!   margin over the deadline covers it, and every bound below leans on it.
//!
//! An attempt's clock may start earlier than the attempt does: every
//! conclusion drawn from it is then only more cautious (`in_time` fails
//! sooner; a sighting dated earlier makes a hint stale sooner and settle
//! later). So the first attempt of a GET over shm, where a late clock costs
//! only a re-read, starts its clock at the thread's last reading instead of
//! reading the clock again (`Timing::start_at_last_reading`). Like every
//! clock here, that assumes the TSCs of all cores agree (quanta uses the
//! TSC only where it is invariant); a thread moved to a core whose counter
//! lags would see its clock start late by that lag.

use std::cell::Cell;
use std::sync::LazyLock;
use std::time::Duration;

use kv_common::protocol::GRACE_DEADLINES;
// The TSC where it is invariant (calibrated against the monotonic clock),
// the monotonic clock where it is not: a read costs nanoseconds, not a
// system call.
pub use quanta::Instant;

/// The clock every protocol bound is measured on. An attempt's clock
/// keeps the raw reading and compares raw ticks against the deadline in
/// ticks: no scaling on the data path; `OpClock::started` scales the raw
/// reading on this clock, so it compares with `now`.
static CLOCK: LazyLock<quanta::Clock> = LazyLock::new(quanta::Clock::new);

thread_local! {
    /// The last raw reading this thread took: never later than now.
    static LAST_READING: Cell<u64> = const { Cell::new(0) };
}

/// A raw reading, remembered as the thread's last.
fn read_raw() -> u64 {
    let now = CLOCK.raw();
    LAST_READING.set(now);
    now
}

/// A raw reading of the clock (remembered as the thread's last): what
/// raw bounds, such as a read lease's end, compare with.
pub fn raw() -> u64 {
    read_raw()
}

/// The time from raw reading `from` to raw reading `to`; zero if `to` is
/// not later.
pub fn raw_interval(from: u64, to: u64) -> Duration {
    Duration::from_nanos(CLOCK.delta_as_nanos(from, to.max(from)))
}

/// Takes a reading as the thread's last: an attempt that starts at the
/// last reading (`Timing::start_at_last_reading`) then starts no earlier
/// than this.
pub fn touch() {
    read_raw();
}

/// Now, on the client's clock.
pub fn now() -> Instant {
    CLOCK.now()
}

/// Time passed since `earlier` (an instant of `now`), zero if none.
pub fn since(earlier: Instant) -> Duration {
    now().saturating_duration_since(earlier)
}

/// The most raw ticks that measure no more than `limit` (up to about 18
/// minutes): a raw interval is within `limit` exactly when it is at most
/// this many ticks.
pub fn ticks_within(limit: Duration) -> u64 {
    // A longer limit is taken as this one (stricter, never looser): it
    // keeps every interval below far from overflowing.
    const LONGEST_NS: u64 = 1 << 40;
    let limit = u64::try_from(limit.as_nanos()).map_or(LONGEST_NS, |ns| ns.min(LONGEST_NS));
    // `delta_as_nanos` grows with the interval, and a tick of any clock
    // quanta reads is longer than 1/64 ns: the answer lies in [0, 64 limit].
    // Bisection keeps `lo` within the limit throughout.
    let (mut lo, mut hi) = (0u64, limit * 64);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if CLOCK.delta_as_nanos(0, mid) <= limit {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    lo
}

/// The client's time bounds, from the deadline the server announced.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    deadline: Duration,
    /// The deadline in the clock's raw ticks.
    deadline_ticks: u64,
    grace: Duration,
    /// The raw reading from which no attempt's reads count: the end of
    /// the client's read lease on a replicated shard's copy (see
    /// `read_lease`); never, elsewhere.
    reads_until: u64,
}

impl Timing {
    pub fn new(deadline: Duration) -> Timing {
        Timing {
            deadline,
            deadline_ticks: ticks_within(deadline),
            grace: deadline * GRACE_DEADLINES,
            reads_until: u64::MAX,
        }
    }

    /// Reads count only from attempts started before raw reading `until`.
    pub fn reads_until(&mut self, until: u64) {
        self.reads_until = until;
    }

    /// The server's operation deadline `D`.
    pub fn deadline(&self) -> Duration {
        self.deadline
    }

    /// Starts the clock of one attempt, just before its first batch.
    pub fn start(&self) -> OpClock {
        OpClock {
            started: read_raw(),
            deadline_ticks: self.deadline_ticks,
            reads_until: self.reads_until,
        }
    }

    /// As `start`, at the thread's last reading of the clock: one clock
    /// read fewer, at the price of a failed `in_time` (a retry) when the
    /// thread has not read the clock (in any operation) for more than a
    /// deadline. For an attempt whose reads cost little to redo.
    pub fn start_at_last_reading(&self) -> OpClock {
        OpClock {
            started: LAST_READING.get(),
            deadline_ticks: self.deadline_ticks,
            reads_until: self.reads_until,
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
    /// The clock's raw reading at the start.
    started: u64,
    deadline_ticks: u64,
    reads_until: u64,
}

impl OpClock {
    /// When the attempt's first batch was posted, or earlier: what it read
    /// was in the region at this time or later.
    pub fn started(&self) -> Instant {
        CLOCK.scaled(self.started)
    }

    /// Whether what this attempt has read can still be trusted: a block
    /// that a slot referenced when the buckets were read cannot have been
    /// reused yet; and, on a replicated shard's copy, that the attempt
    /// started within the client's read lease, so its reads executed
    /// before a new primary could take a write. Also checked before a CAS
    /// based on those reads.
    pub fn in_time(&self) -> bool {
        // A reading before the start (raw counters of two cores a little
        // apart) wraps to a huge interval: late, never early.
        self.started < self.reads_until
            && read_raw().wrapping_sub(self.started) <= self.deadline_ticks
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_deadline_in_ticks_measures_no_more_than_the_deadline() {
        for ms in [1, 50, 3_000] {
            let limit = Duration::from_millis(ms);
            let ticks = ticks_within(limit);
            let ns = u64::try_from(limit.as_nanos()).unwrap_or(u64::MAX);
            assert!(CLOCK.delta_as_nanos(0, ticks) <= ns);
            assert!(
                CLOCK.delta_as_nanos(0, ticks + 1) > ns,
                "{ms} ms: the largest such"
            );
        }
        // An absurd deadline is taken as a long one, never as none.
        let longest = ticks_within(Duration::MAX);
        assert!(longest > ticks_within(Duration::from_secs(60)));
        assert!(CLOCK.delta_as_nanos(0, longest) <= 1 << 40);
    }

    // "In time" is checked against a deadline no stall of a loaded machine
    // reaches, "late" against a short one slept past: the thread's last
    // reading is shared by both.
    const LONG: Duration = Duration::from_secs(30);
    const SHORT: Duration = Duration::from_millis(2);

    #[test]
    fn an_attempt_is_in_time_within_its_deadline_and_late_after_it() {
        let (long, short) = (Timing::new(LONG), Timing::new(SHORT));
        let (a, b) = (long.start(), short.start());
        std::thread::sleep(SHORT * 5);
        assert!(a.in_time());
        assert!(!b.in_time());
    }

    #[test]
    fn a_clock_started_at_the_last_reading_is_never_later_and_late_after_a_pause() {
        let (long, short) = (Timing::new(LONG), Timing::new(SHORT));
        long.start();
        let lazy = long.start_at_last_reading();
        assert!(lazy.started() <= now() && lazy.in_time());
        // A thread idle for longer than the deadline: the attempt is late,
        // and the reading it took to find out makes the next one start then.
        let before = short.start_at_last_reading();
        std::thread::sleep(SHORT * 5);
        let stale = short.start_at_last_reading();
        assert!(!stale.in_time());
        assert!(long.start_at_last_reading().started() > before.started());
        // So does `touch`.
        std::thread::sleep(SHORT * 5);
        touch();
        let touched = long.start_at_last_reading();
        assert!(touched.started() > stale.started() + SHORT * 4);
        // A thread that never read the clock starts at the beginning of time.
        let never = std::thread::spawn(move || short.start_at_last_reading().in_time());
        assert_eq!(never.join().ok(), Some(false));
    }
}
