//! The server's side of shm: the control socket beside the region file, and
//! one peer per client, which fences the client when it goes.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::keys::KeyTable;
use crate::mapping::SharedRegion;
use crate::protocol::RemoteRegion;
use crate::transport::connection::{ControlListener, ControlPeer, Fenced, Received};
use crate::transport::error::TransportError;
use crate::transport::framing::{write_frame, FrameReader};
use crate::Address;

/// The server's control socket, and the registration of its region.
pub struct ShmListener {
    listener: UnixListener,
    socket: PathBuf,
    keys: Option<Arc<KeyTable>>,
}

impl ShmListener {
    /// Binds the control socket beside the region file. A stale socket left
    /// by a dead server is replaced; a live one is refused, and so is
    /// anything else at that path (a file someone keeps there is not ours
    /// to remove).
    pub fn bind(region_path: &Path) -> Result<Self, TransportError> {
        use std::os::unix::fs::FileTypeExt;
        let socket = Address::shm_socket(region_path);
        if let Ok(found) = std::fs::symlink_metadata(&socket) {
            if !found.file_type().is_socket() {
                return Err(TransportError::Io(std::io::Error::new(
                    std::io::ErrorKind::AlreadyExists,
                    format!(
                        "{} (the control socket's path) exists and is not a socket: \
                         move it away or serve another region",
                        socket.display()
                    ),
                )));
            }
            if UnixStream::connect(&socket).is_ok() {
                return Err(TransportError::Io(std::io::Error::new(
                    std::io::ErrorKind::AddrInUse,
                    format!("a server is already listening on {}", socket.display()),
                )));
            }
            std::fs::remove_file(&socket)?;
        }
        let listener = UnixListener::bind(&socket)?;
        Ok(ShmListener {
            listener,
            socket,
            keys: None,
        })
    }
}

/// A random 32-bit value (clock and pid through SplitMix64): enough to make
impl ControlListener for ShmListener {
    fn register(&mut self, region: Arc<SharedRegion>) -> Result<(), TransportError> {
        self.keys = Some(Arc::new(KeyTable::new(region)?));
        Ok(())
    }

    fn extend(&self) -> Result<(), TransportError> {
        // Clients map the whole file when they learn its new length.
        Ok(())
    }

    fn forget_earlier(&self) {}

    fn deregister(&self) {
        if let Some(keys) = &self.keys {
            keys.revoke_all();
        }
    }

    fn accept(&self) -> Result<Box<dyn ControlPeer>, TransportError> {
        // Without a registration (a cluster member's own address, which
        // serves only its map) peers are accepted but never admitted.
        let keys = self.keys.clone();
        let (stream, _) = self.listener.accept()?;
        stream.set_nonblocking(true)?;
        let process = peer_process(&stream);
        Ok(Box::new(ShmPeer {
            stream,
            reader: FrameReader::default(),
            keys,
            slot: None,
            remote: None,
            process,
        }))
    }

    fn wake(&self) {
        // Not by a connect to the socket's path: someone may have removed
        // it, and the accepting thread would then wait forever. A listening
        // socket shut down fails its `accept` at once (Linux).
        // SAFETY: shutdown(2) on a descriptor this listener owns.
        unsafe { libc::shutdown(self.listener.as_raw_fd(), libc::SHUT_RDWR) };
    }
}

impl Drop for ShmListener {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.socket);
    }
}

pub struct ShmPeer {
    stream: UnixStream,
    reader: FrameReader,
    keys: Option<Arc<KeyTable>>,
    /// The key-table entry of an admitted client.
    slot: Option<u32>,
    /// What it was told at admission.
    remote: Option<RemoteRegion>,
    /// A pidfd of the client's process (it maps the region itself), which
    /// becomes readable when that process has exited.
    process: Option<OwnedFd>,
}

/// A pidfd for the process at the other end of `stream`, where the kernel
/// can tell (SO_PEERCRED, pidfd_open: Linux 5.3 and later).
fn peer_process(stream: &UnixStream) -> Option<OwnedFd> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cred`, ours.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 || cred.pid <= 0 {
        return None;
    }
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, cred.pid, 0) };
    // SAFETY: a non-negative result is a descriptor that we now own.
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Whether the process behind a pidfd has exited.
fn has_exited(pidfd: &OwnedFd) -> bool {
    let mut p = libc::pollfd {
        fd: pidfd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, no waiting.
    unsafe { libc::poll(&mut p, 1, 0) == 1 && p.revents & libc::POLLIN != 0 }
}

impl ControlPeer for ShmPeer {
    fn fds(&self) -> Vec<RawFd> {
        vec![self.stream.as_raw_fd()]
    }

    fn try_recv(&mut self) -> Result<Received, TransportError> {
        self.reader.poll(&mut self.stream)
    }

    fn send(&mut self, bytes: &[u8]) -> Result<(), TransportError> {
        // Non-blocking: a client that lets its replies pile up until the
        // socket buffer is full gets disconnected, not waited for.
        write_frame(&mut self.stream, bytes)
    }

    fn admit(&mut self) -> Result<RemoteRegion, TransportError> {
        if self.slot.is_some() {
            return Err(TransportError::Unsupported(
                "client already admitted".into(),
            ));
        }
        let keys = self.keys.as_ref().ok_or(TransportError::NotAttached)?;
        let remote = keys.admit()?;
        self.slot = Some(remote.key_slot);
        self.remote = Some(remote);
        Ok(remote)
    }

    fn region(&mut self) -> Result<RemoteRegion, TransportError> {
        // The same key; the mapping a client makes covers the whole file.
        let (remote, keys) = match (self.remote, &self.keys) {
            (Some(r), Some(k)) => (r, k),
            _ => return Err(TransportError::NotAttached),
        };
        Ok(RemoteRegion {
            len: keys.region.len(),
            ..remote
        })
    }

    fn fence(&mut self) -> Fenced {
        if let (Some(slot), Some(keys)) = (self.slot.take(), &self.keys) {
            keys.fence(slot);
        }
        // A live process may be between its key check and its stores (a
        // check-then-act no key can close); a dead one stores nothing more.
        match &self.process {
            Some(p) if has_exited(p) => Fenced::Exited,
            _ => Fenced::Revoked,
        }
    }
}

impl Drop for ShmPeer {
    fn drop(&mut self) {
        self.fence();
    }
}
