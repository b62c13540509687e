use kv_common::protocol::ErrorKind;
use kv_common::transport::TransportError;

/// Why a call failed. [`Error::is_retryable`] tells the errors worth trying
/// again from those about the request or the region.
///
/// Match on the variants, never on the text: the messages are for people
/// and may change. New variants may be added in a minor release.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Keys are 1 to [`MAX_KEY`](crate::MAX_KEY) bytes.
    #[error("key is empty")]
    EmptyKey,
    /// A key longer than [`MAX_KEY`](crate::MAX_KEY).
    #[error("key of {len} bytes exceeds the {max}-byte limit")]
    KeyTooLarge {
        /// The key's length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A value longer than [`Client::max_value`](crate::Client::max_value).
    #[error("value of {len} bytes exceeds this server's {max}-byte limit")]
    ValueTooLarge {
        /// The value's length.
        len: usize,
        /// This server's limit.
        max: usize,
    },
    /// The address is not a onekv address (`shm:///ABSOLUTE/PATH` or
    /// `rdma://HOST:PORT`); the message says what is wrong with it.
    #[error("invalid address: {0}")]
    InvalidAddress(String),
    /// No server answers at the address; [`source`](std::error::Error::source)
    /// is the transport's error, and its source the operating system's.
    #[error("server unreachable: {0}")]
    Unreachable(#[source] TransportError),
    /// The server turned the connection down: a wrong secret, or too many
    /// clients (the message says which).
    #[error("server refused the connection: {0}")]
    Refused(String),
    /// The server speaks another protocol version.
    #[error("protocol or version mismatch: {0}")]
    VersionMismatch(String),
    /// The heap has no room and the region cannot grow (the server's
    /// message names its cap).
    #[error("region full: no free heap space for a {size}-byte block: {reason}")]
    RegionFull {
        /// The block that found no room.
        size: u64,
        /// The server's explanation.
        reason: String,
    },
    /// The server declined to double its index on request: it is not full
    /// enough to warrant it.
    #[error(
        "the server declined to resize its index: it is not full enough to warrant a doubling"
    )]
    ResizeDeclined,
    /// A key's buckets are full and the index cannot grow.
    #[error("index full: no room for this key, and the index cannot grow: {0}")]
    IndexFull(String),
    /// A slot of this key's buckets points at a block that fails validation
    /// on every read while the slot does not change: the region is damaged
    /// there (`kv-server check` reports it, `--repair` unlinks it).
    #[error("corrupt data for key {key:?}: slot {slot} of bucket {bucket} points at an unreadable block at offset {offset}")]
    Corrupt {
        /// The key (lossily as text).
        key: String,
        /// The bucket holding the slot.
        bucket: u64,
        /// The slot's index in its bucket.
        slot: usize,
        /// Where the block it points at starts in the region.
        offset: u64,
    },
    /// The connection was lost (or the counter moved in a way that cannot
    /// be told apart) after a counter's atomic was posted, or a write to a
    /// replicated shard failed after some of its copies had it: it may or
    /// may not have taken effect, and the call was not redone, which could
    /// have applied it twice. Read the key to find out.
    #[error("an update may or may not have taken effect: {0}")]
    OutcomeUnknown(String),
    /// A counter operation on a key that holds plain bytes.
    #[error("the key holds a value that is not a counter")]
    NotACounter,
    /// An increment whose result, or a compare-and-set whose new value,
    /// lies beyond ±2^61 ([`COUNTER_MAX`](crate::COUNTER_MAX)); the counter
    /// is unchanged.
    #[error("counter out of range: {0} is beyond ±2^61")]
    CounterOverflow(i128),
    /// The operation lost every one of
    /// [`ClientOptions::max_attempts`](crate::ClientOptions::max_attempts)
    /// races against other writers of the key.
    #[error("gave up after {0} attempts under contention")]
    Contended(u32),
    /// The server kept its index mid-change longer than this client waits:
    /// a resize that did not finish, or slots left frozen with no resize
    /// under way (the message says which).
    #[error("the server's index did not settle: {0}")]
    Stalled(String),
    /// The server answered something this client does not expect, or
    /// described a region it cannot use.
    #[error("unexpected reply from server: {0}")]
    Protocol(String),
    /// A bug in this client: an invariant it relies on did not hold. Not
    /// caused by the request or the server; please report it.
    #[error("internal error in kv-client (a bug): {0}")]
    Internal(String),
    /// A cluster's shard has no server that answers: its owner is down
    /// (or not yet assigned); the other shards keep working.
    #[error("shard {shard} (on server {server}) is unavailable: {reason}")]
    ShardUnavailable {
        /// The key's shard.
        shard: u32,
        /// The member that owns it in the map, or "none".
        server: String,
        /// What was tried.
        reason: String,
    },
    /// The cluster's records could not be read (etcd unreachable, no such
    /// cluster, damaged records); the message says which.
    #[error("cluster: {0}")]
    Cluster(String),
    /// The transport failed (a verb was refused, the device reported an
    /// error, the connection was lost) and reconnecting did not help;
    /// [`source`](std::error::Error::source) is the transport's error.
    #[error("transport: {0}")]
    Transport(#[source] TransportError),
}

impl From<TransportError> for Error {
    fn from(e: TransportError) -> Self {
        match e {
            TransportError::Unreachable { .. } => Error::Unreachable(e),
            TransportError::Codec(c) => Error::Protocol(c.to_string()),
            other => Error::Transport(other),
        }
    }
}

impl Error {
    pub(crate) fn from_server(kind: ErrorKind, message: String) -> Self {
        match kind {
            ErrorKind::BadSecret | ErrorKind::TooManyClients | ErrorKind::StaleGroup => {
                Error::Refused(message)
            }
            ErrorKind::VersionMismatch => Error::VersionMismatch(message),
            ErrorKind::IndexFull => Error::IndexFull(message),
            ErrorKind::ClusterMember => Error::InvalidAddress(message),
            // The server closes the channel: a lost connection, which the
            // client makes again (and leases anew).
            ErrorKind::WriteGrant => Error::Transport(TransportError::Disconnected(message)),
            other => Error::Protocol(format!("{other:?}: {message}")),
        }
    }

    /// Whether the same call may succeed if simply tried again later: the
    /// server was unreachable or the connection was lost (and reconnecting
    /// failed too). Errors about the request itself, or a corrupt or full
    /// region, are not.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Error::Unreachable(_) | Error::Contended(_)) || self.is_connection_lost()
    }

    /// True when this connection is gone but the server may be reachable
    /// on a new one: the operation can be redone after reconnecting.
    pub(crate) fn is_connection_lost(&self) -> bool {
        matches!(self, Error::Transport(t) if t.is_connection_lost())
    }

    /// True when the batch that failed ran none of its verbs (see
    /// [`TransportError::ran_nothing`]).
    pub(crate) fn ran_nothing(&self) -> bool {
        matches!(self, Error::Transport(t) if t.ran_nothing())
    }
}
