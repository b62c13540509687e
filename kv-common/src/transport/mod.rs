//! The verbs model every backend implements, after RDMA RC queue pairs:
//! a remote region named by (base, length, rkey), a local registered buffer
//! that READs land in and WRITEs come from, batches of verbs posted with one
//! doorbell (one round trip), and a two-sided control channel.
//!
//! Layers, each importing only those above it: [`verb`] and [`error`] (the
//! model), [`check`] (the rules both backends apply to a batch),
//! [`connection`] (the traits a backend implements) and [`cutoff`] (a
//! client's connections cut off from another thread), [`framing`], the
//! backends [`shm`] and `rdma`, and [`dial`] (a backend by address).

pub mod check;
pub mod connection;
pub mod cutoff;
pub mod dial;
pub mod error;
pub mod framing;
pub mod gid;
#[cfg(feature = "rdma")]
pub mod rdma;
pub mod shm;
pub mod verb;

pub use connection::{
    Closed, ConnectOptions, Connection, ControlListener, ControlPeer, Fenced, Received,
    DEFAULT_REPLY_TIMEOUT,
};
pub use cutoff::Cutoff;
pub use dial::{bind, connect};
pub use error::TransportError;
pub use framing::{read_frame, write_frame, FrameReader};
pub use verb::{read_u64, ReadOrder, Verb, VerbStats, MAX_BATCH_VERBS};
