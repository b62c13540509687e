//! A onekv cluster: a fixed number of shards, each one region as a single
//! server's, spread over servers. etcd holds the truth (members on leases,
//! the shard map, the coordinator's election); etcd is never on the data
//! path. This crate holds the records and the rules that place shards, and,
//! with the `etcd` feature, reads and writes them.

pub mod directory;
pub mod placement;
pub mod records;
pub mod url;

#[cfg(feature = "etcd")]
pub mod etcd;
#[cfg(feature = "etcd")]
pub mod follow;
#[cfg(feature = "etcd")]
pub mod member;

pub use records::{
    shard_address, ClusterConfig, ClusterState, MemberRecord, ShardMap, ShardMove, DEFAULT_SHARDS,
};
pub use url::{ClusterSource, ClusterUrl};

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("etcd: {0}")]
    Etcd(String),
    #[error("no cluster at {0}: create it with `kv-server cluster create`")]
    NoSuchCluster(String),
    #[error("a cluster already exists at {0}")]
    Exists(String),
    #[error("{0}")]
    Config(String),
    #[error("{0}")]
    Damaged(String),
    #[error("membership lost: {0}")]
    LeaseLost(String),
    /// This member may not join as it is configured: joining again will
    /// not help.
    #[error("{0}")]
    Refused(String),
}

impl From<String> for ClusterError {
    fn from(damage: String) -> Self {
        ClusterError::Damaged(damage)
    }
}
