//! The control plane: one thread per client connection answering connect,
//! lease, give-back, stats and disconnect. Nothing here touches a slot or a
//! block; clients do that themselves with one-sided verbs.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kv_common::layout::Geometry;
use kv_common::protocol::{
    self, ConnectInfo, ErrorKind, Request, Response, ServerStats, PROTOCOL_VERSION,
};
use kv_common::transport::shm::SharedRegion;
use kv_common::transport::{ControlPeer, RemoteRegion, TransportError};

use crate::heap::HeapPool;

#[derive(Default)]
pub struct Counters {
    pub connected: AtomicU64,
    pub connects: AtomicU64,
    pub rejected: AtomicU64,
    pub leases: AtomicU64,
    pub give_backs: AtomicU64,
    pub stats_requests: AtomicU64,
    pub disconnects: AtomicU64,
    pub malformed: AtomicU64,
    pub cpu_us: AtomicU64,
}

pub struct Shared {
    pub geometry: Geometry,
    pub region: Arc<SharedRegion>,
    pub remote: RemoteRegion,
    pub secret: Option<Vec<u8>>,
    pub op_deadline: Duration,
    pub pool: Mutex<HeapPool>,
    pub counters: Counters,
    pub next_client: AtomicU64,
    pub stopping: AtomicBool,
}

impl Shared {
    pub fn stats(&self) -> ServerStats {
        let c = &self.counters;
        let mut live_slots = 0;
        let _ = crate::region::for_each_slot(&self.region, &self.geometry, |_, _| live_slots += 1);
        ServerStats {
            clients_connected: c.connected.load(Relaxed),
            connects: c.connects.load(Relaxed),
            rejected_connects: c.rejected.load(Relaxed),
            leases: c.leases.load(Relaxed),
            give_backs: c.give_backs.load(Relaxed),
            stats_requests: c.stats_requests.load(Relaxed),
            disconnects: c.disconnects.load(Relaxed),
            malformed: c.malformed.load(Relaxed),
            heap_size: self.geometry.heap_size,
            heap_free: self.pool.lock().map(|p| p.free_bytes()).unwrap_or(0),
            bucket_count: self.geometry.bucket_count,
            live_slots,
            server_cpu_us: c.cpu_us.load(Relaxed),
        }
    }
}

fn error(kind: ErrorKind, message: impl Into<String>) -> Response {
    Response::Error {
        kind,
        message: message.into(),
    }
}

/// Compares secrets in time independent of where they differ.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Serves one client until it disconnects, misbehaves, or the server stops.
pub fn serve(shared: Arc<Shared>, mut peer: Box<dyn ControlPeer>) {
    let c = &shared.counters;
    let mut client: Option<u64> = None;
    let mut cpu_mark = thread_cpu_us();
    loop {
        let bytes = match peer.recv() {
            Ok(Some(b)) => b,
            Ok(None) => break,
            Err(TransportError::Codec(e)) => {
                // The framing itself is broken: say why, then hang up.
                c.malformed.fetch_add(1, Relaxed);
                tracing::warn!(client, "closing control connection: {e}");
                let _ = send(&mut *peer, &error(ErrorKind::Malformed, e.to_string()));
                break;
            }
            Err(_) => break,
        };
        if shared.stopping.load(Relaxed) {
            break;
        }
        let (reply, close, observing) = match protocol::decode::<Request>(&bytes) {
            Ok(request) => {
                let observing = request == Request::Stats;
                let (reply, close) = handle(&shared, &mut client, request);
                (reply, close, observing)
            }
            Err(e) => {
                c.malformed.fetch_add(1, Relaxed);
                (error(ErrorKind::Malformed, e.to_string()), false, false)
            }
        };
        let sent = send(&mut *peer, &reply);
        let now = thread_cpu_us();
        // Stats requests scan the index; counting them would make every
        // measurement of the server's CPU time perturb itself.
        if !observing {
            c.cpu_us.fetch_add(now.saturating_sub(cpu_mark), Relaxed);
        }
        cpu_mark = now;
        if close || sent.is_err() {
            break;
        }
    }
    if client.is_some() {
        c.connected.fetch_sub(1, Relaxed);
    }
}

fn send(peer: &mut dyn ControlPeer, reply: &Response) -> Result<(), TransportError> {
    peer.send(&protocol::encode(reply)?)
}

/// Answers one request; the flag says whether to close the connection.
fn handle(shared: &Shared, client: &mut Option<u64>, request: Request) -> (Response, bool) {
    let c = &shared.counters;
    match (request, *client) {
        (
            Request::Connect {
                protocol_version,
                secret,
            },
            None,
        ) => {
            if protocol_version != PROTOCOL_VERSION {
                c.rejected.fetch_add(1, Relaxed);
                let m =
                    format!("client speaks protocol {protocol_version}, server {PROTOCOL_VERSION}");
                return (error(ErrorKind::VersionMismatch, m), true);
            }
            if let Some(expected) = &shared.secret {
                if !same_secret(expected, &secret) {
                    c.rejected.fetch_add(1, Relaxed);
                    tracing::warn!("refused a client with a wrong secret");
                    return (error(ErrorKind::BadSecret, "wrong secret"), true);
                }
            }
            let id = shared.next_client.fetch_add(1, Relaxed);
            *client = Some(id);
            c.connects.fetch_add(1, Relaxed);
            c.connected.fetch_add(1, Relaxed);
            tracing::debug!(client = id, "connected");
            let info = ConnectInfo {
                client_id: id,
                region: shared.remote,
                geometry: shared.geometry,
                op_deadline_us: shared.op_deadline.as_micros() as u64,
            };
            (Response::Connected(info), false)
        }
        (Request::Connect { .. }, Some(_)) => {
            c.malformed.fetch_add(1, Relaxed);
            (error(ErrorKind::Malformed, "already connected"), false)
        }
        (_, None) => {
            c.malformed.fetch_add(1, Relaxed);
            (error(ErrorKind::NotConnected, "send Connect first"), true)
        }
        (Request::Lease { min_len }, Some(id)) => {
            c.leases.fetch_add(1, Relaxed);
            if min_len == 0 || min_len > shared.geometry.chunk_size {
                let m = format!(
                    "lease of {min_len} bytes; chunks are {}",
                    shared.geometry.chunk_size
                );
                return (error(ErrorKind::Malformed, m), false);
            }
            let leased = shared
                .pool
                .lock()
                .map(|mut p| p.lease(min_len))
                .unwrap_or(None);
            match leased {
                Some(extent) => {
                    tracing::trace!(client = id, ?extent, "leased");
                    (Response::Leased(extent), false)
                }
                None => (error(ErrorKind::HeapFull, "no free heap space left"), false),
            }
        }
        (Request::GiveBack { extents }, Some(id)) => {
            c.give_backs.fetch_add(1, Relaxed);
            let result = match shared.pool.lock() {
                Ok(mut p) => p.give_back(&extents),
                Err(_) => Err("heap pool unavailable".into()),
            };
            match result {
                Ok(()) => (Response::GivenBack, false),
                Err(m) => {
                    tracing::warn!(client = id, "refused give-back: {m}");
                    (error(ErrorKind::BadExtent, m), false)
                }
            }
        }
        (Request::Stats, Some(_)) => {
            c.stats_requests.fetch_add(1, Relaxed);
            (Response::Stats(shared.stats()), false)
        }
        (Request::Disconnect, Some(id)) => {
            c.disconnects.fetch_add(1, Relaxed);
            tracing::debug!(client = id, "disconnected");
            (Response::Goodbye, true)
        }
    }
}

/// CPU time this thread has used, in microseconds.
pub fn thread_cpu_us() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we own.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return 0;
    }
    ts.tv_sec as u64 * 1_000_000 + ts.tv_nsec as u64 / 1_000
}
