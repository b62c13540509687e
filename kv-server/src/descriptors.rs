//! File descriptors: what the process may open, and how many control
//! connections that leaves room for. A server that accepted connections
//! until `accept` failed would leave the next client waiting in the
//! listen backlog for its whole reply timeout; one that stops short of the
//! limit can always accept a connection to refuse it with a reason.

/// Descriptors kept back from control connections: the region file and
/// its lock, the listeners, the pollers, the metrics endpoint and its 32
/// connections, the server's own resize connection, logs, and one spare to
/// accept a connection in order to refuse it.
const RESERVED: u64 = 64;

/// Descriptors a control connection may hold (shm: its socket; rdma: its
/// handshake socket and completion channel).
const PER_CONNECTION: u64 = 2;

/// Raises the soft descriptor limit to the hard one (the soft one is often
/// 1024 while the hard one is far higher); returns the soft limit now.
pub fn raise_limit() -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a struct we own.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return 1024;
        }
        if lim.rlim_cur < lim.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: lim.rlim_max,
                rlim_max: lim.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                lim = raised;
            }
        }
    }
    lim.rlim_cur
}

/// Descriptors this process has open now.
fn open_now() -> u64 {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as u64)
}

/// How many control connections fit in `limit` descriptors beside those
/// open now and the reserve.
pub fn connection_budget(limit: u64) -> u64 {
    limit.saturating_sub(open_now() + RESERVED) / PER_CONNECTION
}
