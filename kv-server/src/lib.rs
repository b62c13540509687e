//! The onekv server: creates (or reopens) the region, registers it, and
//! answers control messages. It is never on the data path: clients read and
//! write the region with one-sided verbs.
//!
//! Embed it with [`Server::start`]; the `kv-server` binary is a thin daemon
//! around the same call.

use std::fs::File;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kv_common::layout::{Geometry, KEY_TABLE_ENTRIES};
use kv_common::protocol::ServerStats;
use kv_common::transport::{self, ControlListener, ControlPeer, TransportError};
use kv_common::Address;
use polling::Poller;

mod control;
mod event_loop;
pub mod heap;
mod reclaim;
pub mod region;
mod units;

pub use control::thread_cpu_us;
use control::{Counters, Shared};
pub use event_loop::Timeouts;

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
    /// A new region file is readable by its owner only, or by its group too.
    pub group_access: bool,
    /// Longest a client's one-sided operation may take before it retries;
    /// freed space is reused only after four of these.
    pub op_deadline: Duration,
    /// Most clients connected at once (each holds a key and leased space).
    pub max_clients: u64,
    /// How long a control connection may take to connect, and may stay
    /// silent once connected. Open connections, connected or not, are capped
    /// at twice `max_clients`.
    pub timeouts: Timeouts,
}

/// Open control connections allowed per client slot: room for clients that
/// are still connecting, without letting idle sockets pile up unbounded.
const CONNECTIONS_PER_CLIENT: u64 = 2;

impl ServerConfig {
    pub fn new(address: Address) -> Self {
        ServerConfig {
            address,
            memory: 1 << 30,
            buckets: None,
            secret: None,
            region_file: None,
            group_access: false,
            op_deadline: Duration::from_millis(50),
            max_clients: 1024,
            timeouts: Timeouts {
                handshake: Duration::from_secs(10),
                idle: None,
            },
        }
    }

    /// How long freed space waits before anyone may reuse it.
    pub fn grace(&self) -> Duration {
        self.op_deadline * 4
    }

    fn check(&self) -> Result<(), ServerError> {
        if self.op_deadline.is_zero() {
            return Err(ServerError::Config("op deadline must be positive".into()));
        }
        if self.max_clients == 0 || self.max_clients > KEY_TABLE_ENTRIES {
            return Err(ServerError::Config(format!(
                "max clients must be from 1 to {KEY_TABLE_ENTRIES}"
            )));
        }
        if self.timeouts.handshake.is_zero() || self.timeouts.idle.is_some_and(|d| d.is_zero()) {
            return Err(ServerError::Config("timeouts must be positive".into()));
        }
        Ok(())
    }
}

/// A running server. Dropping it shuts it down.
pub struct Server {
    shared: Arc<Shared>,
    listener: Arc<dyn ControlListener>,
    poller: Arc<Poller>,
    address: Address,
    threads: Vec<JoinHandle<()>>,
    created: bool,
    /// Holds the region file's lock for the server's life.
    _lock: File,
}

impl Server {
    /// Opens (or creates) the region and serves it. On a reopened region,
    /// clients of the previous server are cut off first, and the heap's free
    /// space is rebuilt from the index only once their verbs have landed:
    /// a block they publish is never handed out again.
    pub fn start(config: ServerConfig) -> Result<Server, ServerError> {
        config.check()?;
        let path = region_path(&config)?;
        let wanted = Geometry::for_memory(config.memory, config.buckets)
            .map_err(|e| ServerError::Config(e.to_string()))?;
        let mut listener = transport::bind(&config.address)?;
        let opened =
            region::open_or_create(&path, &wanted, region::file_mode(config.group_access))?;
        let geometry = opened.geometry;
        let region = Arc::new(opened.region);
        // Revokes every key of an earlier registration.
        listener.register(region.clone())?;
        if !opened.created {
            // Verbs of the previous server's clients that were under way
            // when their keys were revoked land within a grace period.
            std::thread::sleep(config.grace());
        }
        let scan_started = Instant::now();
        let scan = region::scan_index(&region, &geometry)?;
        let mut pool = heap::HeapPool::new(
            geometry.heap_offset,
            geometry.region_len,
            geometry.chunk_size,
        );
        // Nobody can write now: what the index does not reference is free.
        pool.collect(scan_started, scan.live, Instant::now());
        let counters = Counters::default();
        counters.index_scans.store(1, Ordering::Relaxed);
        counters
            .live_slots
            .store(scan.live_slots, Ordering::Relaxed);
        counters
            .live_bytes
            .store(scan.live_bytes, Ordering::Relaxed);
        counters
            .corrupt_slots
            .store(scan.corrupt_slots, Ordering::Relaxed);
        tracing::info!(
            address = %config.address,
            created = opened.created,
            region_bytes = geometry.region_len,
            buckets = geometry.bucket_count,
            heap_bytes = geometry.heap_size,
            chunk_bytes = geometry.chunk_size,
            live_slots = scan.live_slots,
            corrupt_slots = scan.corrupt_slots,
            "serving"
        );
        let listener: Arc<dyn ControlListener> = Arc::from(listener);
        let shared = Arc::new(Shared {
            geometry,
            region,
            secret: config.secret.clone(),
            op_deadline: config.op_deadline,
            max_clients: config.max_clients,
            pool: Mutex::new(pool),
            counters,
            next_client: AtomicU64::new(1),
            stopping: AtomicBool::new(false),
            reclaim: (Mutex::new(false), Condvar::new()),
            collecting: Mutex::new(()),
            stats_wanted: AtomicBool::new(false),
        });
        let poller = Arc::new(Poller::new().map_err(TransportError::Io)?);
        let (to_loop, incoming) = mpsc::channel();
        let max_channels = (config.max_clients * CONNECTIONS_PER_CLIENT) as usize;
        let event_loop = event_loop::EventLoop::new(
            shared.clone(),
            poller.clone(),
            incoming,
            max_channels,
            config.timeouts,
        );
        let mut threads = Vec::new();
        let spawn = |name: &str, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(name.into())
                .spawn(f)
                .map_err(|e| ServerError::Config(format!("cannot start threads: {e}")))
        };
        threads.push(spawn("kv-control", Box::new(move || event_loop.run()))?);
        {
            let shared = shared.clone();
            threads.push(spawn("kv-reclaim", Box::new(move || reclaim::run(shared)))?);
        }
        {
            let (shared, listener, poller) = (shared.clone(), listener.clone(), poller.clone());
            threads.push(spawn(
                "kv-accept",
                Box::new(move || accept_loop(shared, listener, to_loop, poller)),
            )?);
        }
        Ok(Server {
            shared,
            listener,
            poller,
            address: config.address,
            threads,
            created: opened.created,
            _lock: opened.lock,
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

    /// Scans the index and reclaims unreferenced space now (what the
    /// reclaimer does when space runs short), so that `stats` is exact.
    pub fn collect_now(&self) {
        reclaim::collect(&self.shared);
    }

    /// How many index slots hold `key` (see [`region::slots_of`]).
    pub fn slots_holding(&self, key: &[u8]) -> Result<usize, TransportError> {
        Ok(self.slots_of(key)?.len())
    }

    /// The index slots that hold `key`, with their positions.
    pub fn slots_of(
        &self,
        key: &[u8],
    ) -> Result<Vec<(kv_common::layout::SlotPos, kv_common::layout::Slot)>, TransportError> {
        region::slots_of(&self.shared.region, &self.shared.geometry, key)
    }

    /// Stops accepting clients, revokes the access keys (so clients' verbs
    /// fail cleanly) and writes the region back.
    pub fn shutdown(mut self) -> ServerStats {
        self.stop();
        self.shared.stats()
    }

    fn stop(&mut self) {
        if self.threads.is_empty() {
            return;
        }
        self.shared.stopping.store(true, Ordering::SeqCst);
        self.listener.wake();
        let _ = self.poller.notify();
        self.shared.wake_reclaimer();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        self.listener.deregister();
        if let Err(e) = self.shared.region.flush() {
            tracing::warn!("flushing the region: {e}");
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

/// Accepts control channels and hands them to the event loop. (Accepting
/// an rdma channel includes its handshake, which must not hold up the loop.)
fn accept_loop(
    shared: Arc<Shared>,
    listener: Arc<dyn ControlListener>,
    to_loop: Sender<Box<dyn ControlPeer>>,
    poller: Arc<Poller>,
) {
    let mut last_warning: Option<Instant> = None;
    loop {
        let peer = listener.accept();
        if shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        match peer {
            Ok(peer) => {
                if to_loop.send(peer).is_err() {
                    return;
                }
                let _ = poller.notify();
            }
            Err(e) => {
                // Out of descriptors, most likely: say so now and then, and
                // let the event loop's timeouts free some.
                if last_warning.is_none_or(|t| t.elapsed() > Duration::from_secs(5)) {
                    tracing::warn!("accept failed: {e}");
                    last_warning = Some(Instant::now());
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}
