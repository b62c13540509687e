//! A daemon's log (its stderr), kept as it comes so that a failing test
//! shows what its servers said: a panic through the daemon's drop
//! ([`DaemonLog::tail`]), an abort through [`write_live_tails`]. Without
//! it a cluster test that timed out waiting for a shard told only that it
//! had waited.

use std::io::{Read, Write};
use std::process::ChildStderr;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Lines of each log a failure shows: enough for the last map changes and
/// copies of a cluster member, short enough for a CI log of four members.
pub const TAIL_LINES: usize = 80;

struct Buffer {
    label: String,
    bytes: Mutex<Vec<u8>>,
}

impl Buffer {
    fn tail(&self, lines: usize) -> String {
        let bytes = self.bytes.lock().unwrap_or_else(PoisonError::into_inner);
        let text = String::from_utf8_lossy(&bytes);
        let all: Vec<&str> = text.lines().collect();
        let skipped = all.len().saturating_sub(lines);
        let mut out = format!("---- log of {} ", self.label);
        if skipped > 0 {
            out.push_str(&format!("(last {lines} of {} lines) ", all.len()));
        }
        out.push_str("----\n");
        for line in &all[skipped..] {
            out.push_str(line);
            out.push('\n');
        }
        out
    }
}

/// The logs of this process's daemons not yet dropped.
static LIVE: Mutex<Vec<Weak<Buffer>>> = Mutex::new(Vec::new());

/// One daemon's log, drained by a thread of its own so that a chatty
/// daemon never blocks on a full pipe.
pub struct DaemonLog {
    buffer: Arc<Buffer>,
    reader: Option<JoinHandle<()>>,
}

impl DaemonLog {
    /// Drains `stderr` of the daemon called `label` from now on.
    pub fn drain(mut stderr: ChildStderr, label: String) -> DaemonLog {
        let buffer = Arc::new(Buffer {
            label,
            bytes: Mutex::new(Vec::new()),
        });
        {
            let mut live = LIVE.lock().unwrap_or_else(PoisonError::into_inner);
            live.retain(|b| b.strong_count() > 0);
            live.push(Arc::downgrade(&buffer));
        }
        let sink = Arc::clone(&buffer);
        let reader = std::thread::spawn(move || {
            let mut chunk = [0u8; 4096];
            while let Ok(n @ 1..) = stderr.read(&mut chunk) {
                let mut bytes = sink.bytes.lock().unwrap_or_else(PoisonError::into_inner);
                bytes.extend_from_slice(&chunk[..n]);
            }
        });
        DaemonLog {
            buffer,
            reader: Some(reader),
        }
    }

    /// Everything logged, once the daemon has exited (its stderr closed).
    pub fn finish(&mut self) -> String {
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
        self.so_far()
    }

    /// Waits at most `limit` for the log's end (the daemon's stderr
    /// closed): a failing test must not hang on a pipe something else
    /// holds open.
    pub fn wait_for_end(&mut self, limit: Duration) {
        let deadline = Instant::now() + limit;
        while self.reader.as_ref().is_some_and(|r| !r.is_finished()) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn so_far(&self) -> String {
        let bytes = self
            .buffer
            .bytes
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// The last `lines` lines logged so far, under a header naming the
    /// daemon.
    pub fn tail(&self, lines: usize) -> String {
        self.buffer.tail(lines)
    }
}

/// Writes the last [`TAIL_LINES`] of every log not yet dropped to the
/// real stderr (which the test harness does not capture): for a test about
/// to abort the process.
pub fn write_live_tails() {
    let live: Vec<Arc<Buffer>> = LIVE
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .iter()
        .filter_map(Weak::upgrade)
        .collect();
    let mut stderr = std::io::stderr().lock();
    for buffer in live {
        let _ = stderr.write_all(buffer.tail(TAIL_LINES).as_bytes());
    }
}
