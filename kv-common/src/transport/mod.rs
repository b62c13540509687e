//! The verbs model every backend implements, after RDMA RC queue pairs:
//! a remote region named by (base, length, rkey), a local registered buffer
//! that READs land in and WRITEs come from, batches of verbs posted with one
//! doorbell (one round trip), and a two-sided control channel.

use serde::{Deserialize, Serialize};

use crate::protocol::{CodecError, Request, Response};
use crate::Address;

pub mod gid;
#[cfg(feature = "rdma")]
pub mod rdma;
pub mod shm;
mod words;

/// A region registered by the server, as a client names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteRegion {
    /// Address of byte 0 on the server (an RDMA virtual address; 0 on shm).
    pub base: u64,
    pub len: u64,
    /// Access key handed out at connect; it changes at every registration
    /// (and on shm at every connect).
    pub rkey: u32,
    /// shm only: the key-table entry that holds this connection's key, so
    /// the server can cut off one client (rdma does that per queue pair).
    pub key_slot: u32,
}

/// One work request. `remote` is an offset inside the region, `local` an
/// offset inside the connection's local buffer.
///
/// Order within a batch, as on an RC queue pair: a WRITE or an atomic
/// executes after the WRITEs posted before it, and a READ sees the effect
/// of the WRITEs and atomics posted before it. Nothing may count on a WRITE
/// or an atomic executing after an earlier READ or atomic of the same batch
/// (an RC queue pair orders that only with the fence indicator), nor on
/// the order in which the READs of a batch read memory (see [`ReadOrder`]).
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
}

/// What a connection has done on the data path.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VerbStats {
    /// Batches posted and completed (one doorbell and one wait each).
    pub round_trips: u64,
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
    }

    pub fn add(&mut self, other: &VerbStats) {
        self.round_trips += other.round_trips;
        self.verbs += other.verbs;
        self.bytes_read += other.bytes_read;
        self.bytes_written += other.bytes_written;
        self.atomics += other.atomics;
        self.cas_failures += other.cas_failures;
    }
}

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    #[error("cannot reach server at {address}: {source}")]
    Unreachable {
        address: String,
        source: std::io::Error,
    },
    #[error("control channel closed: {0}")]
    Disconnected(String),
    /// What a NIC reports as a remote access error: bad rkey or out of range.
    #[error("remote access error: {0}")]
    RemoteAccess(String),
    #[error("local buffer access error: {0}")]
    LocalAccess(String),
    #[error("no region attached to this connection yet")]
    NotAttached,
    #[error(transparent)]
    Codec(#[from] CodecError),
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Unsupported(String),
}

impl TransportError {
    /// Whether this connection is gone for good (the peer closed it or
    /// stopped answering, the server restarted or cut this client off) while
    /// the server may still be reachable on a new one.
    pub fn is_connection_lost(&self) -> bool {
        matches!(
            self,
            TransportError::Disconnected(_) | TransportError::RemoteAccess(_)
        )
    }
}

/// Verbs one batch may hold (over rdma, the send queue's depth; shm keeps
/// the same limit so that a client that is right on one is right on both).
pub const MAX_BATCH_VERBS: usize = 64;

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
    fn stats(&self) -> &VerbStats;
    /// Whether a batch costs a round trip of its own (a network's), so
    /// that reads which may prove unneeded are worth posting together. Over
    /// shm a batch costs only what its verbs copy, and such reads are best
    /// posted one at a time.
    fn batches_cost_round_trips(&self) -> bool {
        true
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
            verbs: 0,
            bytes_read: 0,
            bytes_written: 0,
            atomics: 0,
            cas_failures: 0,
        };
        &NONE
    }
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
}

/// The server's side of a backend: it registers the region and accepts
/// clients' control channels.
pub trait ControlListener: Send + Sync {
    /// Registers the region for one-sided access. Every registration has new
    /// access keys: verbs of clients of an earlier registration (a server
    /// that ran on this region before) fail from now on.
    fn register(&mut self, region: std::sync::Arc<shm::SharedRegion>)
        -> Result<(), TransportError>;
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

/// Starts listening at `address`. This comes before the region is opened,
/// so that a second server on the same address fails before it can
/// re-register (and so cut off) the first one's clients.
pub fn bind(address: &Address) -> Result<Box<dyn ControlListener>, TransportError> {
    match address {
        Address::Shm { region } => Ok(Box::new(shm::ShmListener::bind(region)?)),
        #[cfg(feature = "rdma")]
        Address::Rdma { host, port } => Ok(Box::new(rdma::RdmaListener::bind(host, *port)?)),
        #[cfg(not(feature = "rdma"))]
        Address::Rdma { .. } => Err(no_rdma(address)),
    }
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

/// Opens a control channel to the server at `address`.
pub fn connect(
    address: &Address,
    options: &ConnectOptions,
) -> Result<Box<dyn Connection>, TransportError> {
    match address {
        Address::Shm { region } => Ok(Box::new(shm::ShmConnection::connect(region, options)?)),
        #[cfg(feature = "rdma")]
        Address::Rdma { host, port } => Ok(Box::new(rdma::RdmaConnection::connect(
            host, *port, options,
        )?)),
        #[cfg(not(feature = "rdma"))]
        Address::Rdma { .. } => Err(no_rdma(address)),
    }
}

#[cfg(not(feature = "rdma"))]
fn no_rdma(address: &Address) -> TransportError {
    TransportError::Unsupported(format!(
        "{address}: this build has no rdma backend (build with --features rdma)"
    ))
}

/// Reads a little-endian u64 out of a local buffer.
pub fn read_u64(buf: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&buf[at..at + 8]);
    u64::from_le_bytes(b)
}

/// Sends a request over any connection and decodes the reply.
pub(crate) fn frame_call<S: std::io::Read + std::io::Write>(
    stream: &mut S,
    request: &Request,
) -> Result<Response, TransportError> {
    let bytes = crate::protocol::encode(request)?;
    let written = write_frame(stream, &bytes);
    // A server that refuses a connection says why and hangs up, possibly
    // before our request arrived: its reply is read even if the write failed.
    match (read_frame(stream), written) {
        (Ok(Some(reply)), _) => Ok(crate::protocol::decode(&reply)?),
        (_, Err(e)) => Err(e),
        (Err(e), Ok(())) => Err(e),
        (Ok(None), Ok(())) => Err(TransportError::Disconnected(
            "server closed the connection".into(),
        )),
    }
}

/// Reassembles length-prefixed frames from a non-blocking stream, however
/// the bytes arrive: a frame sent a byte at a time costs the server nothing
/// but this buffer, which never exceeds one maximal frame.
#[derive(Default)]
pub struct FrameReader {
    buf: Vec<u8>,
}

impl FrameReader {
    /// Reads what is available and returns one whole frame if there is one.
    pub fn poll<R: std::io::Read>(&mut self, r: &mut R) -> Result<Received, TransportError> {
        loop {
            if let Some(frame) = self.take_frame()? {
                return Ok(Received::Message(frame));
            }
            let have = self.buf.len();
            let want = self.wanted();
            self.buf.resize(want, 0);
            match r.read(&mut self.buf[have..]) {
                Ok(0) => {
                    self.buf.truncate(have);
                    return Ok(Received::Closed);
                }
                Ok(n) => self.buf.truncate(have + n),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    self.buf.truncate(have);
                    return Ok(Received::Nothing);
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {
                    self.buf.truncate(have);
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Bytes the buffer should hold to make progress: the length prefix,
    /// then the whole frame.
    fn wanted(&self) -> usize {
        if self.buf.len() < 4 {
            return 4;
        }
        4 + u32::from_le_bytes([self.buf[0], self.buf[1], self.buf[2], self.buf[3]]) as usize
    }

    fn take_frame(&mut self) -> Result<Option<Vec<u8>>, TransportError> {
        if self.buf.len() < 4 {
            return Ok(None);
        }
        let len = self.wanted() - 4;
        if len > crate::protocol::MAX_MESSAGE {
            return Err(CodecError::TooLarge(len).into());
        }
        if self.buf.len() < 4 + len {
            return Ok(None);
        }
        let frame = self.buf[4..4 + len].to_vec();
        self.buf.drain(..4 + len);
        Ok(Some(frame))
    }
}

/// Length-prefixed frames for stream transports (the shm control socket).
pub fn write_frame<W: std::io::Write>(w: &mut W, bytes: &[u8]) -> Result<(), TransportError> {
    let len = u32::try_from(bytes.len()).map_err(|_| CodecError::TooLarge(bytes.len()))?;
    let mut out = Vec::with_capacity(4 + bytes.len());
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(bytes);
    w.write_all(&out)?;
    w.flush()?;
    Ok(())
}

/// Reads one frame; None on a clean end of stream. A length above
/// MAX_MESSAGE is refused before anything is allocated.
pub fn read_frame<R: std::io::Read>(r: &mut R) -> Result<Option<Vec<u8>>, TransportError> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > crate::protocol::MAX_MESSAGE {
        return Err(CodecError::TooLarge(len).into());
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)?;
    Ok(Some(body))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stream that hands out its bytes a few at a time, then would block.
    struct Trickle {
        bytes: Vec<u8>,
        at: usize,
        step: usize,
    }

    impl std::io::Read for Trickle {
        fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
            if self.at == self.bytes.len() {
                return Err(std::io::ErrorKind::WouldBlock.into());
            }
            let n = self.step.min(out.len()).min(self.bytes.len() - self.at);
            out[..n].copy_from_slice(&self.bytes[self.at..self.at + n]);
            self.at += n;
            Ok(n)
        }
    }

    #[test]
    fn frame_reader_reassembles_trickled_frames_and_refuses_huge_ones() {
        let mut wire = Vec::new();
        write_frame(&mut wire, b"hello").unwrap();
        write_frame(&mut wire, b"").unwrap();
        write_frame(&mut wire, &[7; 300]).unwrap();
        for step in [1, 3, 1000] {
            let mut s = Trickle {
                bytes: wire.clone(),
                at: 0,
                step,
            };
            let mut r = FrameReader::default();
            let mut got = Vec::new();
            loop {
                match r.poll(&mut s).unwrap() {
                    Received::Message(m) => got.push(m),
                    Received::Nothing => break,
                    Received::Closed => unreachable!(),
                }
            }
            assert_eq!(got, vec![b"hello".to_vec(), vec![], vec![7; 300]]);
        }
        let mut huge = Trickle {
            bytes: u32::MAX.to_le_bytes().to_vec(),
            at: 0,
            step: 4,
        };
        assert!(FrameReader::default().poll(&mut huge).is_err());
        let mut closed: &[u8] = b"\x05\x00";
        assert_eq!(
            FrameReader::default().poll(&mut closed).unwrap(),
            Received::Closed
        );
    }

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
