//! The onekv server: creates (or reopens) the region, registers it, and
//! answers control messages. It is never on the data path: clients read and
//! write the region with one-sided verbs.
//!
//! Embed it with [`Server::start`]; the `kv-server` binary is a thin daemon
//! around the same call.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use kv_common::layout::Geometry;
use kv_common::protocol::ServerStats;
use kv_common::transport::{self, ControlListener, TransportError};
use kv_common::Address;

mod control;
pub mod heap;
pub mod region;

pub use control::thread_cpu_us;
use control::{Counters, Shared};

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("region {path}: {reason}")]
    Region { path: PathBuf, reason: String },
    #[error("bad configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Transport(#[from] TransportError),
}

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub address: Address,
    /// Size of a new region (an existing one keeps its own).
    pub memory: u64,
    /// Index buckets of a new region; by default the index takes ~1/16.
    pub buckets: Option<u64>,
    /// When set, clients must present it to connect.
    pub secret: Option<Vec<u8>>,
    /// File backing the region of an rdma server (a shm address names its
    /// own); by default /dev/shm/onekv-rdma-PORT.
    pub region_file: Option<PathBuf>,
    /// Longest a client's one-sided operation may take before it retries;
    /// freed space is reused only after four of these.
    pub op_deadline: Duration,
}

impl ServerConfig {
    pub fn new(address: Address) -> Self {
        ServerConfig {
            address,
            memory: 1 << 30,
            buckets: None,
            secret: None,
            region_file: None,
            op_deadline: Duration::from_millis(50),
        }
    }

    /// How long freed space waits before anyone may reuse it.
    pub fn grace(&self) -> Duration {
        self.op_deadline * 4
    }
}

/// A running server. Dropping it shuts it down.
pub struct Server {
    shared: Arc<Shared>,
    listener: Arc<dyn ControlListener>,
    address: Address,
    accept: Option<JoinHandle<()>>,
    created: bool,
}

impl Server {
    pub fn start(config: ServerConfig) -> Result<Server, ServerError> {
        let path = region_path(&config)?;
        if config.op_deadline.is_zero() {
            return Err(ServerError::Config("op deadline must be positive".into()));
        }
        let wanted = Geometry::for_memory(config.memory, config.buckets)
            .map_err(|e| ServerError::Config(e.to_string()))?;
        let mut listener = transport::bind(&config.address)?;
        let opened = region::open_or_create(&path, &wanted)?;
        let geometry = opened.geometry;
        let live = if opened.created {
            Vec::new()
        } else {
            region::live_blocks(&opened.region, &geometry)?
        };
        let live_count = live.len();
        let pool = heap::HeapPool::new(
            geometry.heap_offset,
            geometry.heap_offset + geometry.heap_size,
            geometry.chunk_size,
            config.grace(),
            live,
        );
        let region = Arc::new(opened.region);
        let remote = listener.register(region.clone())?;
        let listener: Arc<dyn ControlListener> = Arc::from(listener);
        if !opened.created {
            // Clients of a previous server may have a verb in flight into
            // space that is free again now; let them fail on the new key first.
            std::thread::sleep(config.grace());
        }
        tracing::info!(
            address = %config.address,
            created = opened.created,
            region_bytes = geometry.region_len,
            buckets = geometry.bucket_count,
            heap_bytes = geometry.heap_size,
            chunk_bytes = geometry.chunk_size,
            live_blocks = live_count,
            "serving"
        );
        let shared = Arc::new(Shared {
            geometry,
            remote,
            region,
            secret: config.secret.clone(),
            op_deadline: config.op_deadline,
            pool: Mutex::new(pool),
            counters: Counters::default(),
            next_client: AtomicU64::new(1),
            stopping: AtomicBool::new(false),
        });
        let accept = {
            let shared = shared.clone();
            let listener = listener.clone();
            std::thread::Builder::new()
                .name("kv-accept".into())
                .spawn(move || accept_loop(shared, listener))
                .map_err(|e| ServerError::Config(format!("cannot start threads: {e}")))?
        };
        Ok(Server {
            shared,
            listener,
            address: config.address,
            accept: Some(accept),
            created: opened.created,
        })
    }

    pub fn address(&self) -> &Address {
        &self.address
    }

    pub fn geometry(&self) -> Geometry {
        self.shared.geometry
    }

    /// Whether this start created the region (false: it was reopened).
    pub fn created(&self) -> bool {
        self.created
    }

    pub fn stats(&self) -> ServerStats {
        self.shared.stats()
    }

    /// How many index slots hold `key` (see [`region::slots_holding`]).
    pub fn slots_holding(&self, key: &[u8]) -> Result<usize, TransportError> {
        region::slots_holding(&self.shared.region, &self.shared.geometry, key)
    }

    /// Stops accepting clients, revokes the access key (so clients' verbs
    /// fail cleanly) and writes the region back.
    pub fn shutdown(mut self) -> ServerStats {
        self.stop();
        self.shared.stats()
    }

    fn stop(&mut self) {
        if let Some(accept) = self.accept.take() {
            self.shared.stopping.store(true, Ordering::SeqCst);
            self.listener.wake();
            let _ = accept.join();
            self.listener.deregister();
            if let Err(e) = self.shared.region.flush() {
                tracing::warn!("flushing the region: {e}");
            }
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The file that holds the region: named by a shm address, or given for
/// an rdma one (`region_file`), or a default in /dev/shm.
fn region_path(config: &ServerConfig) -> Result<PathBuf, ServerError> {
    match (&config.address, &config.region_file) {
        (_, Some(path)) => Ok(path.clone()),
        (Address::Shm { region }, None) => Ok(region.clone()),
        (Address::Rdma { port, .. }, None) => {
            Ok(PathBuf::from(format!("/dev/shm/onekv-rdma-{port}")))
        }
    }
}

fn accept_loop(shared: Arc<Shared>, listener: Arc<dyn ControlListener>) {
    loop {
        let peer = listener.accept();
        if shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        match peer {
            Ok(peer) => {
                let shared = shared.clone();
                let spawned = std::thread::Builder::new()
                    .name("kv-control".into())
                    .spawn(move || control::serve(shared, peer));
                if let Err(e) = spawned {
                    tracing::error!("cannot start a control thread: {e}");
                }
            }
            Err(e) => {
                tracing::warn!("accept failed: {e}");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}
