//! A cluster member's shards: one [`Server`] per shard the map gives this
//! member, each on its own region and control endpoint
//! ([`kv_cluster::shard_address`]), exactly as a single server.

use std::collections::BTreeMap;
use std::path::PathBuf;

use kv_cluster::{shard_address, ShardMap};
use kv_common::Address;

use crate::{Server, ServerConfig, ServerError};

pub struct ShardHost {
    /// Settings every shard's server starts with; its address, region file
    /// and metrics endpoint are the shard's own.
    template: ServerConfig,
    member: String,
    serving: BTreeMap<u32, Server>,
}

impl ShardHost {
    /// `template.address` is the member's `--listen` address.
    pub fn new(template: ServerConfig, member: String) -> ShardHost {
        ShardHost {
            template,
            member,
            serving: BTreeMap::new(),
        }
    }

    pub fn member(&self) -> &str {
        &self.member
    }

    pub fn listen(&self) -> &Address {
        &self.template.address
    }

    /// Serves exactly the shards `map` gives this member: starts the new
    /// ones (reopening their regions when they exist, with every write
    /// they held) and stops the ones it no longer owns.
    /// A shard that cannot start is logged and tried again at the next
    /// map; the others serve meanwhile.
    /// Starting stops as soon as `held` says the lease may be lost.
    pub fn follow(&mut self, map: &ShardMap, held: impl Fn() -> bool) {
        let owned: Vec<u32> = map.shards_of(&self.member).collect();
        let gone: Vec<u32> = self
            .serving
            .keys()
            .copied()
            .filter(|s| !owned.contains(s))
            .collect();
        for shard in gone {
            if let Some(server) = self.serving.remove(&shard) {
                tracing::info!(shard, "no longer this member's: stopping it");
                server.shutdown();
            }
        }
        for shard in owned {
            if !held() {
                return;
            }
            if self.serving.contains_key(&shard) {
                continue;
            }
            match self.config_of(shard).and_then(Server::start) {
                Ok(server) => {
                    tracing::info!(shard, address = %server.address(), epoch = map.epoch, "serving");
                    self.serving.insert(shard, server);
                }
                Err(e) => tracing::error!(shard, "cannot serve: {e}"),
            }
        }
    }

    fn config_of(&self, shard: u32) -> Result<ServerConfig, ServerError> {
        let mut config = self.template.clone();
        config.address =
            shard_address(&self.template.address, shard).map_err(ServerError::Config)?;
        config.region_file = self.template.region_file.as_ref().map(|f| {
            let mut name = f.as_os_str().to_owned();
            name.push(format!(".shard-{shard}"));
            PathBuf::from(name)
        });
        // One HTTP endpoint per process would need metrics labelled by
        // shard; until then a member serves none.
        config.metrics_listen = None;
        Ok(config)
    }

    /// Stops serving every shard (the member may no longer hold its lease).
    pub fn stop_all(&mut self) {
        for (shard, server) in std::mem::take(&mut self.serving) {
            tracing::info!(shard, "stopping");
            server.shutdown();
        }
    }

    /// The first shard server that failed, and why.
    pub fn failure(&self) -> Option<String> {
        self.serving
            .iter()
            .find_map(|(shard, s)| s.failure().map(|why| format!("shard {shard}: {why}")))
    }

    pub fn serving(&self) -> impl Iterator<Item = u32> + '_ {
        self.serving.keys().copied()
    }
}

impl Drop for ShardHost {
    fn drop(&mut self) {
        self.stop_all();
    }
}
