//! What a transport reports.

use crate::mapping::AccessError;
use crate::protocol::CodecError;

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
    /// A batch refused whole, before any of its verbs ran: the
    /// connection's access key is no longer registered (the server
    /// restarted, shut down or cut this client off; shm checks it before
    /// a batch's first verb), or the batch's first work request, not a
    /// READ (which the device may run again after later ones), met a
    /// remote access error. A lost connection known to have changed
    /// nothing.
    #[error("turned away before any verb ran: {0}")]
    TurnedAway(String),
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
            TransportError::Disconnected(_)
                | TransportError::RemoteAccess(_)
                | TransportError::TurnedAway(_)
        )
    }

    /// Whether the batch that failed is known to have run none of its
    /// verbs: an atomic in it did not take effect.
    pub fn ran_nothing(&self) -> bool {
        matches!(self, TransportError::TurnedAway(_))
    }
}

/// The region's own refusal is what a NIC reports as a remote access error.
impl From<AccessError> for TransportError {
    fn from(e: AccessError) -> Self {
        TransportError::RemoteAccess(e.to_string())
    }
}
