//! What `kv` talks to: one server, or a cluster, each key at its shard's
//! server.

use kv_client::{Client, ClientOptions, Result};

/// Boxed: the two differ much in size.
pub enum Store {
    Server(Box<Client>),
    Cluster(Box<kv_client::ClusterClient>),
}

/// The same call on either kind of store.
macro_rules! either {
    ($store:expr, $kv:ident => $call:expr) => {
        match $store {
            Store::Server($kv) => $call,
            Store::Cluster($kv) => $call,
        }
    };
}

impl Store {
    /// A cluster for an etcd:// or cluster+ address, else one server.
    pub fn connect(address: &str, options: ClientOptions) -> std::result::Result<Store, String> {
        if kv_cluster::ClusterSource::is_cluster(address) {
            return kv_client::ClusterClient::connect_with(address, options)
                .map(|kv| Store::Cluster(Box::new(kv)))
                .map_err(|e| e.to_string());
        }
        Client::connect_with(address, options)
            .map(|kv| Store::Server(Box::new(kv)))
            .map_err(|e| e.to_string())
    }

    pub fn get(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        either!(self, kv => kv.get(key))
    }

    pub fn put(&mut self, key: &[u8], value: &[u8]) -> Result<()> {
        either!(self, kv => kv.put(key, value))
    }

    pub fn delete(&mut self, key: &[u8]) -> Result<bool> {
        either!(self, kv => kv.delete(key))
    }

    pub fn incr(&mut self, key: &[u8], n: i64) -> Result<i64> {
        either!(self, kv => kv.incr(key, n))
    }

    /// The server for what is per server: the one, or a cluster's `shard`'s.
    pub fn server(&mut self, shard: Option<u32>) -> std::result::Result<&mut Client, String> {
        match (self, shard) {
            (Store::Server(kv), None) => Ok(kv),
            (Store::Server(_), Some(_)) => {
                Err("--shard is for a cluster (an etcd:// or cluster+ address)".into())
            }
            (Store::Cluster(kv), Some(shard)) => kv.shard_client(shard).map_err(|e| e.to_string()),
            (Store::Cluster(kv), None) => Err(format!(
                "a cluster's servers are per shard: give --shard (0 to {})",
                kv.shards() - 1
            )),
        }
    }

    /// Lines describing the cluster.
    pub fn cluster_status(&mut self) -> std::result::Result<Vec<String>, String> {
        match self {
            Store::Server(kv) => Err(format!(
                "{} is one server, not a cluster (an etcd:// or cluster+ address)",
                kv.address()
            )),
            Store::Cluster(kv) => {
                let status = kv.status().map_err(|e| e.to_string())?;
                Ok(status.lines().map(str::to_string).collect())
            }
        }
    }

    /// Says goodbye. A connection the server already closed (it cut an
    /// idle client off, or stopped) has nothing left to say: every
    /// command was answered.
    pub fn close(self) -> Result<()> {
        match self {
            Store::Server(kv) => match (*kv).close() {
                Err(kv_client::Error::Transport(e)) if e.is_connection_lost() => Ok(()),
                said => said,
            },
            // Its connections close as it drops.
            Store::Cluster(_) => Ok(()),
        }
    }
}
