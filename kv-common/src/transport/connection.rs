//! The two sides of a backend: a client's [`Connection`] (control channel
//! plus data path), and the server's [`ControlListener`] and [`ControlPeer`].

use std::sync::Arc;

use super::cutoff::Cutoff;
use super::error::TransportError;
use super::verb::{ReadOrder, Verb, VerbStats};
use crate::mapping::SharedRegion;
use crate::protocol::{Extent, RemoteRegion, Request, Response};

/// A client's connection to one server: control channel plus data path.
pub trait Connection: Send {
    /// Sends a control request and waits for its reply (two-sided).
    fn call(&mut self, request: &Request) -> Result<Response, TransportError>;
    /// Bounds each later [`call`](Connection::call) by `limit` (sending the
    /// request and waiting for its reply) in place of the connection's
    /// reply timeout: a client dropped with a server that does not answer
    /// says a goodbye that waits only this long.
    fn set_reply_timeout(&mut self, limit: std::time::Duration) -> Result<(), TransportError>;
    /// Makes the remote region reachable by verbs and sets up a local
    /// registered buffer of `local_len` bytes.
    fn attach(&mut self, region: &RemoteRegion, local_len: usize) -> Result<(), TransportError>;
    fn local(&self) -> &[u8];
    fn local_mut(&mut self) -> &mut [u8];
    /// Posts the verbs with one doorbell and returns when all completed.
    fn post(&mut self, verbs: &[Verb]) -> Result<(), TransportError>;
    /// Posts the verbs with one doorbell and returns without waiting for
    /// them: [`Connection::finish`] does, before the local buffer is read
    /// or any other call is made on this connection. A client of several
    /// servers starts a batch on each, then waits for all: one round trip
    /// for the lot. Where verbs complete as they are posted (shm), this is
    /// all of [`Connection::post`].
    fn start(&mut self, verbs: &[Verb]) -> Result<(), TransportError> {
        self.post(verbs)
    }
    /// Waits for the verbs [`Connection::start`] posted (nothing if none).
    fn finish(&mut self) -> Result<(), TransportError> {
        Ok(())
    }
    fn stats(&self) -> &VerbStats;
    /// Fails every control call once `cutoff` is cut, the one waiting then
    /// included (see [`Cutoff`]).
    fn cut_by(&mut self, cutoff: Arc<Cutoff>);
    /// The server granted writes into `extent` (a lease) under `key`: the
    /// WRITEs that land in it carry that key from now on. Backends whose
    /// writes need no key of their own ignore it.
    fn allow_writes(&mut self, _extent: Extent, _key: u32) {}
    /// The lease of `extent` is given back: no more WRITEs land in it.
    fn forget_writes(&mut self, _extent: Extent) {}
    /// Whether a batch costs a round trip of its own (a network's), so
    /// that reads which may prove unneeded are worth posting together. Over
    /// shm a batch costs only what its verbs copy, and such reads are best
    /// posted one at a time.
    fn batches_cost_round_trips(&self) -> bool {
        true
    }
    /// Whether the READs of a batch read remote memory in the order they
    /// were posted (see [`ReadOrder`]), each seeing memory no older than
    /// the one before it saw. Over rdma they need not: the NIC's DMA reads
    /// may pass each other.
    fn reads_in_posted_order(&self) -> bool {
        false
    }
}

/// What cutting a client off established.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fenced {
    /// The client's process has exited: nothing it started can still land.
    Exited,
    /// Its access is revoked; a verb it had already begun may still land,
    /// within the grace period.
    Revoked,
}

/// What a non-blocking receive found.
#[derive(Debug, PartialEq, Eq)]
pub enum Received {
    /// One whole request.
    Message(Vec<u8>),
    /// Nothing complete yet: wait until a file descriptor is readable.
    Nothing,
    /// The client has gone.
    Closed,
    /// The client's data path broke on something it did (over rdma, an
    /// access it had no right to, which puts its queue pair in error): why.
    /// The channel is as good as closed.
    Faulted(String),
}

/// A connection that has been closed: every call fails as disconnected (a
/// client holds one between losing its connection and making a new one).
pub struct Closed;

impl Connection for Closed {
    fn call(&mut self, _: &Request) -> Result<Response, TransportError> {
        Err(TransportError::Disconnected("connection closed".into()))
    }
    fn set_reply_timeout(&mut self, _: std::time::Duration) -> Result<(), TransportError> {
        Ok(())
    }
    fn attach(&mut self, _: &RemoteRegion, _: usize) -> Result<(), TransportError> {
        Err(TransportError::Disconnected("connection closed".into()))
    }
    fn local(&self) -> &[u8] {
        &[]
    }
    fn local_mut(&mut self) -> &mut [u8] {
        &mut []
    }
    fn post(&mut self, _: &[Verb]) -> Result<(), TransportError> {
        Err(TransportError::Disconnected("connection closed".into()))
    }
    fn stats(&self) -> &VerbStats {
        const NONE: VerbStats = VerbStats {
            round_trips: 0,
            waits: 0,
            verbs: 0,
            bytes_read: 0,
            bytes_written: 0,
            atomics: 0,
            cas_failures: 0,
        };
        &NONE
    }

    fn cut_by(&mut self, _cutoff: Arc<Cutoff>) {}
}

/// The server's end of one client's control channel. It is driven by one
/// event loop for all clients: it never blocks waiting for the client.
pub trait ControlPeer: Send {
    /// File descriptors whose readability means `try_recv` has work.
    fn fds(&self) -> Vec<std::os::fd::RawFd>;
    /// The next request, if one has arrived whole.
    fn try_recv(&mut self) -> Result<Received, TransportError>;
    /// Sends one reply; fails rather than wait long for a client that does
    /// not read its replies.
    fn send(&mut self, bytes: &[u8]) -> Result<(), TransportError>;
    /// Lets this client onto the data path: how it names the region, with
    /// a key of its own where the backend has per-client keys.
    fn admit(&mut self) -> Result<RemoteRegion, TransportError>;
    /// How this admitted client names the region now: after the region
    /// grew, a longer length (and over rdma the newest registration's key).
    fn region(&mut self) -> Result<RemoteRegion, TransportError>;
    /// Cuts this client off the data path: from now on its verbs fail. Done
    /// before any space it held is reused.
    fn fence(&mut self) -> Fenced;
    /// Whether this client WRITEs only into its leases, each made writable
    /// by [`grant_writes`](ControlPeer::grant_writes). Not on shm, which
    /// is one trust domain (see `docs/rdma.md`, "Protection").
    fn confines_writes(&self) -> bool {
        false
    }
    /// Lets this client WRITE into `extent`, newly leased to it: the key
    /// its WRITEs there carry, or None where writes are not confined.
    fn grant_writes(&mut self, _extent: Extent) -> Result<Option<u32>, TransportError> {
        Ok(None)
    }
    /// Ends the grants that overlap `extent` (given back): once this
    /// returns Ok, no WRITE of this client begins there. On an error its
    /// data path may still reach the space: cut it off (`fence`) before the
    /// space is reused.
    fn revoke_writes(&mut self, _extent: Extent) -> Result<(), TransportError> {
        Ok(())
    }
}

/// The server's side of a backend: it registers the region and accepts
/// clients' control channels.
pub trait ControlListener: Send + Sync {
    /// Registers the region for one-sided access. Every registration has new
    /// access keys: verbs of clients of an earlier registration (a server
    /// that ran on this region before) fail from now on.
    fn register(&mut self, region: Arc<SharedRegion>) -> Result<(), TransportError>;
    /// The region grew: makes its new part reachable. Keys handed out
    /// before stay valid for the part they covered.
    fn extend(&self) -> Result<(), TransportError>;
    /// Every client holds the newest key: earlier registrations may go.
    fn forget_earlier(&self);
    /// Revokes the registration: verbs with its keys fail from now on.
    fn deregister(&self);
    /// Blocks for the next control channel (a connection not yet admitted).
    fn accept(&self) -> Result<Box<dyn ControlPeer>, TransportError>;
    /// Unblocks a thread waiting in `accept` (used at shutdown).
    fn wake(&self);
}

/// How long a client waits for a control reply by default: the server
/// answers at once, so silence this long means it is gone.
pub const DEFAULT_REPLY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// How a client connection is opened.
#[derive(Debug, Clone, Copy)]
pub struct ConnectOptions {
    /// A control call that gets no reply within this fails, and the
    /// connection is then unusable.
    pub reply_timeout: std::time::Duration,
    /// The order the verbs of a batch execute in (a test hook).
    pub read_order: ReadOrder,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            reply_timeout: DEFAULT_REPLY_TIMEOUT,
            read_order: ReadOrder::Posted,
        }
    }
}
