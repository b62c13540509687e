//! The shared-memory backend: the region is a file mapped by the server and
//! by every client; verbs are word-wise atomic copies and CPU atomics on the
//! mapping; the control channel is a Unix-domain socket beside the file.
//!
//! Accesses to the mapping (`crate::mapping`) never form data races in Rust's memory model:
//! every word is an `AtomicU64`, read and written whole (see `words`). A
//! WRITE is a Release fence followed by word stores (non-temporal on
//! x86-64, fenced on both sides), a READ word loads
//! followed by an Acquire fence, and CAS/FETCH-AND-ADD are SeqCst
//! read-modify-writes. So a block written before the CAS that publishes its
//! slot is visible to any reader that saw the slot. (DESIGN.md has READs as
//! relaxed atomic loads; on x86-64 with AVX they are aligned 16-byte loads,
//! which read each word just as whole with half the instructions.)
//!
//! Speed: a READ is a copy out of memory, so what it costs is cache and TLB
//! misses. A batch's READs (16 verbs at a time) fetch all their cache lines
//! at once before any copy, and the server backs the region with huge pages
//! where the kernel can, in mappings aligned to take them whole.
//!
//! Access keys: each admitted client gets a word of the region's key table
//! holding a key of its own, and every batch checks that word first (as a NIC
//! checks the rkey and the queue pair's state). Fencing a client zeroes its
//! word; registering the region zeroes them all, so clients of an earlier
//! server are cut off before the new one looks at the index.
//!
//! Its parts: this module is a client's connection; `executor` runs a
//! batch on the mapping; `keys` is the key table; `listener` the server's
//! control socket and its peers.

mod executor;
mod keys;
mod listener;

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

pub use listener::{ShmListener, ShmPeer};

use super::connection::{ConnectOptions, Connection};
use super::cutoff::Cutoff;
use super::error::TransportError;
use super::framing::frame_call;
use super::verb::{ReadOrder, Verb, VerbStats};
use crate::mapping::SharedRegion;
use crate::protocol::{RemoteRegion, Request, Response};
use crate::words::{as_bytes, as_bytes_mut};
use crate::Address;

/// A client connection over shm.
pub struct ShmConnection {
    stream: UnixStream,
    region_path: PathBuf,
    region: Option<(Arc<SharedRegion>, RemoteRegion)>,
    local: Vec<u64>,
    stats: VerbStats,
    /// Set once the control stream failed: a reply may still be in flight,
    /// so the stream is never used again (the client reconnects).
    broken: Option<String>,
    reply_timeout: Duration,
    read_order: ReadOrder,
    cutoff: Option<Arc<Cutoff>>,
}

impl ShmConnection {
    pub fn connect(region_path: &Path, options: &ConnectOptions) -> Result<Self, TransportError> {
        let reply_timeout = options.reply_timeout;
        let socket = Address::shm_socket(region_path);
        let stream =
            UnixStream::connect(&socket).map_err(|source| TransportError::Unreachable {
                address: format!(
                    "shm://{} (socket {})",
                    region_path.display(),
                    socket.display()
                ),
                source,
            })?;
        stream.set_read_timeout(Some(reply_timeout))?;
        stream.set_write_timeout(Some(reply_timeout))?;
        Ok(ShmConnection {
            stream,
            region_path: region_path.to_path_buf(),
            region: None,
            local: Vec::new(),
            stats: VerbStats::default(),
            broken: None,
            reply_timeout,
            read_order: options.read_order,
            cutoff: None,
        })
    }
}

impl Drop for ShmConnection {
    fn drop(&mut self) {
        if let Some(cutoff) = &self.cutoff {
            cutoff.forget_socket();
        }
    }
}

impl Connection for ShmConnection {
    fn call(&mut self, request: &Request) -> Result<Response, TransportError> {
        if let Some(why) = &self.broken {
            return Err(TransportError::Disconnected(why.clone()));
        }
        let cut = || self.cutoff.as_ref().and_then(|c| c.error());
        if let Some(e) = cut() {
            return Err(e);
        }
        let answer = frame_call(&mut self.stream, request);
        // A cut shuts the socket down under the call: say so.
        let answer = match (answer, cut()) {
            (Err(_), Some(e)) => Err(e),
            (answer, _) => answer,
        };
        match answer {
            Ok(reply) => Ok(reply),
            Err(TransportError::Io(e)) => {
                // A reset, a closed socket or a reply that never came: this
                // stream is gone, whatever the server's state.
                let why = match e.kind() {
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                        format!("no reply within {:?}", self.reply_timeout)
                    }
                    _ => format!("control socket: {e}"),
                };
                self.broken = Some(why.clone());
                Err(TransportError::Disconnected(why))
            }
            Err(e) => {
                if matches!(e, TransportError::Disconnected(_)) {
                    self.broken = Some(e.to_string());
                }
                Err(e)
            }
        }
    }

    fn set_reply_timeout(&mut self, limit: Duration) -> Result<(), TransportError> {
        // A zero timeout means "none" to the socket: wait at least 1 ms.
        let limit = limit.max(Duration::from_millis(1));
        self.stream.set_read_timeout(Some(limit))?;
        self.stream.set_write_timeout(Some(limit))?;
        self.reply_timeout = limit;
        Ok(())
    }

    fn attach(&mut self, remote: &RemoteRegion, local_len: usize) -> Result<(), TransportError> {
        let region = SharedRegion::for_client(&self.region_path, remote.len)?;
        if region.len() < remote.len {
            return Err(TransportError::RemoteAccess(format!(
                "{} is {} bytes, the server registered {}",
                self.region_path.display(),
                region.len(),
                remote.len
            )));
        }
        self.region = Some((region, *remote));
        self.local = vec![0u64; local_len.div_ceil(8)];
        Ok(())
    }

    fn local(&self) -> &[u8] {
        as_bytes(&self.local)
    }

    fn local_mut(&mut self) -> &mut [u8] {
        as_bytes_mut(&mut self.local)
    }

    fn post(&mut self, verbs: &[Verb]) -> Result<(), TransportError> {
        let Some((region, remote)) = &self.region else {
            return Err(TransportError::NotAttached);
        };
        executor::execute(region, remote, self.read_order, &mut self.local, verbs)?;
        self.stats.record_batch(verbs, as_bytes(&self.local));
        Ok(())
    }

    fn stats(&self) -> &VerbStats {
        &self.stats
    }

    fn cut_by(&mut self, cutoff: Arc<Cutoff>) {
        cutoff.watch_socket(&self.stream);
        self.cutoff = Some(cutoff);
    }

    fn batches_cost_round_trips(&self) -> bool {
        false
    }

    /// Each READ's copy ends with an acquire fence (`load_words`), so the
    /// next one's loads come after it; unless a test reverses them.
    fn reads_in_posted_order(&self) -> bool {
        self.read_order == ReadOrder::Posted
    }
}
