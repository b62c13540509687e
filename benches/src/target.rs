//! What a benchmark runs against: a server given by address, or an embedded
//! one on a temporary shm region that lives as long as the benchmark.

use kv_common::Address;
use kv_server::{Server, ServerConfig};

pub struct Target {
    pub address: String,
    /// The embedded server, when there is one (its CPU time is reported).
    pub server: Option<Server>,
    _dir: Option<tempfile::TempDir>,
}

impl Target {
    pub fn open(address: Option<&str>, memory: u64) -> Result<Target, String> {
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
        config.memory = memory;
        let server = Server::start(config).map_err(|e| e.to_string())?;
        Ok(Target {
            address: format!("shm://{}", region.display()),
            server: Some(server),
            _dir: Some(dir),
        })
    }
}
