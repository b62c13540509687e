//! The verbs model every backend implements, after RDMA RC queue pairs:
//! a remote region named by (base, length, rkey), a local registered buffer
//! that READs land in and WRITEs come from, batches of verbs posted with one
//! doorbell (one round trip), and a two-sided control channel.

use serde::{Deserialize, Serialize};

use crate::protocol::{CodecError, Request, Response};
use crate::Address;

#[cfg(feature = "rdma")]
pub mod rdma;
pub mod shm;

/// A region registered by the server, as a client names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteRegion {
    /// Address of byte 0 on the server (an RDMA virtual address; 0 on shm).
    pub base: u64,
    pub len: u64,
    /// Access key handed out at connect; it changes at every registration.
    pub rkey: u32,
}

/// One work request. `remote` is an offset inside the region, `local` an
/// offset inside the connection's local buffer.
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

/// What a connection has done on the data path.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VerbStats {
    pub round_trips: u64,
    pub verbs: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    pub atomics: u64,
    pub cas_failures: u64,
}

impl VerbStats {
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

/// A client's connection to one server: control channel plus data path.
pub trait Connection: Send {
    /// Sends a control request and waits for its reply (two-sided).
    fn call(&mut self, request: &Request) -> Result<Response, TransportError>;
    /// Makes the remote region reachable by verbs and sets up a local
    /// registered buffer of `local_len` bytes.
    fn attach(&mut self, region: &RemoteRegion, local_len: usize) -> Result<(), TransportError>;
    fn local(&self) -> &[u8];
    fn local_mut(&mut self) -> &mut [u8];
    /// Posts the verbs with one doorbell and returns when all completed.
    fn post(&mut self, verbs: &[Verb]) -> Result<(), TransportError>;
    fn stats(&self) -> &VerbStats;
}

/// The server's end of one client's control channel.
pub trait ControlPeer: Send {
    /// The next request's bytes, or None when the client has gone.
    fn recv(&mut self) -> Result<Option<Vec<u8>>, TransportError>;
    fn send(&mut self, bytes: &[u8]) -> Result<(), TransportError>;
}

/// The server's side of a backend: it registers the region and accepts
/// clients' control channels.
pub trait ControlListener: Send + Sync {
    /// Registers the region for one-sided access and says how clients name
    /// it. Every registration has a new access key.
    fn register(
        &mut self,
        region: std::sync::Arc<shm::SharedRegion>,
    ) -> Result<RemoteRegion, TransportError>;
    /// Revokes the registration: verbs with its key fail from now on.
    fn deregister(&self);
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

/// Opens a control channel to the server at `address`.
pub fn connect(address: &Address) -> Result<Box<dyn Connection>, TransportError> {
    match address {
        Address::Shm { region } => Ok(Box::new(shm::ShmConnection::connect(region)?)),
        #[cfg(feature = "rdma")]
        Address::Rdma { host, port } => Ok(Box::new(rdma::RdmaConnection::connect(host, *port)?)),
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
    write_frame(stream, &bytes)?;
    match read_frame(stream)? {
        Some(reply) => Ok(crate::protocol::decode(&reply)?),
        None => Err(TransportError::Disconnected(
            "server closed the connection".into(),
        )),
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
