//! What a benchmark runs against: a server given by address, or an embedded
//! one on a temporary shm region that lives as long as the benchmark. The
//! embedded one starts at the server's default size (or `memory`) and grows
//! with the data, as a real deployment does (up to `max_memory`, if given).

use kv_common::Address;
use kv_server::{Server, ServerConfig};

pub struct Target {
    pub address: String,
    /// The embedded server, when there is one (its CPU time is reported).
    pub server: Option<Server>,
    _dir: Option<tempfile::TempDir>,
}

impl Target {
    pub fn open(
        address: Option<&str>,
        memory: Option<u64>,
        max_memory: Option<u64>,
    ) -> Result<Target, String> {
        if let Some(a) = address {
            return Ok(Target {
                address: a.to_string(),
                server: None,
                _dir: None,
            });
        }
        let base = std::path::Path::new("/dev/shm");
        let dir = if base.is_dir() {
            tempfile::tempdir_in(base)
        } else {
            tempfile::tempdir()
        }
        .map_err(|e| format!("cannot create a temporary region directory: {e}"))?;
        let region = dir.path().join("bench");
        let mut config = ServerConfig::new(Address::Shm {
            region: region.clone(),
        });
        if let Some(m) = memory {
            config.memory = m;
        }
        config.max_memory = max_memory;
        let server = Server::start(config).map_err(|e| e.to_string())?;
        Ok(Target {
            address: format!("shm://{}", region.display()),
            server: Some(server),
            _dir: Some(dir),
        })
    }

    /// YCSB-style lines about the embedded server's growth, if there is one.
    pub fn growth_report(&self) -> Option<String> {
        let s = self.server.as_ref()?.stats();
        Some(format!(
            "[SERVER], Resizes, {}\n[SERVER], Buckets, {}\n[SERVER], Occupancy, {:.3}\n\
             [SERVER], Growths, {}\n[SERVER], RegionBytes, {}",
            s.resizes,
            s.bucket_count,
            s.occupancy(),
            s.growths,
            s.region_bytes
        ))
    }
}
