//! The onekv server: creates (or reopens) the region, registers it, and
//! answers control messages. It is never on the data path: clients read and
//! write the region with one-sided verbs.
//!
//! Embed it with [`Server::start`]; the `kv-server` binary is a thin daemon
//! around the same call.

use std::collections::HashMap;
use std::fs::File;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kv_common::layout::{Geometry, Slot, KEY_TABLE_ENTRIES, MAX_BUCKETS};
use kv_common::mapping::SharedRegion;
use kv_common::protocol::{Extent, ServerStats};
use kv_common::transport::{self, ControlListener, ControlPeer, TransportError};
use kv_common::Address;
use polling::Poller;

mod control;
mod descriptors;
pub mod directory;
mod event_loop;
mod grow;
pub mod header;
pub mod heap;
mod http;
mod index_load;
mod level;
mod metrics;
mod reclaim;
pub mod region;
pub mod regions_made;
mod registry;
pub mod shard_host;
pub mod shard_move;
mod units;
mod unlinked;

pub use control::thread_cpu_us;
use control::{Counters, GrowRequests, Limits, Shared};
pub use descriptors::raise_limit as raise_descriptor_limit;
pub use event_loop::Timeouts;
pub use metrics::MetricsEndpoint;

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("region {path}: {reason}")]
    Region { path: PathBuf, reason: String },
    #[error("bad configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// The region refused an access (a range outside it: a damaged record).
    #[error("region access: {0}")]
    Access(#[from] kv_common::mapping::AccessError),
}

/// A freeze asked for by [`Server::hand_over`].
pub struct HandingOver {
    shared: Arc<Shared>,
}

impl HandingOver {
    /// Waits for the index to be frozen.
    ///
    /// # Errors
    ///
    /// When the freeze failed or took longer than `limit`. The index may
    /// yet freeze after that: the caller then stops the server (one that
    /// opens the region again thaws it).
    pub fn wait(&self, limit: Duration) -> Result<(), String> {
        use control::Handover;
        let give_up = Instant::now() + limit;
        loop {
            let now = self.shared.handover.lock().map(|h| h.clone());
            match now {
                Ok(Handover::Frozen) => return Ok(()),
                Ok(Handover::Failed(e)) => return Err(e),
                Err(_) => return Err("the server's state is poisoned".into()),
                Ok(_) if Instant::now() > give_up => {
                    return Err(format!("freezing the index took over {limit:?}"))
                }
                Ok(_) => std::thread::sleep(Duration::from_millis(1)),
            }
        }
    }
}

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub address: Address,
    /// Size of a new region (an existing one keeps its own); it grows from
    /// there as its heap fills.
    pub memory: u64,
    /// Largest size the region may grow to; by default the size of the file
    /// system that holds it.
    pub max_memory: Option<u64>,
    /// Index buckets of a new region (default `DEFAULT_BUCKETS`; it doubles
    /// as it fills).
    pub buckets: Option<u64>,
    /// Most buckets the index may grow to (default: no cap short of 2^40).
    pub max_buckets: Option<u64>,
    /// Fraction of the index's slots in use at which it doubles (clients
    /// that find a key's buckets full ask for a resize earlier).
    pub resize_at: f64,
    /// Bytes up to which any client's request doubles the index; beyond,
    /// a request is honoured only when the index is at least half as full
    /// as `resize_at` (or the key that found no room shows it full and the
    /// index is a quarter as full), so that no client can balloon it.
    pub resize_on_request_up_to: u64,
    /// When set, clients must present it to connect.
    pub secret: Option<Vec<u8>>,
    /// The group epoch a client must route by to connect: a cluster's
    /// copy of a replicated shard serves the epoch of the map's last
    /// failover of that shard (0 elsewhere).
    pub group_epoch: u64,
    /// A replicated cluster's copy admits clients only while its member's
    /// lease counts as held (see kv-cluster's `LeaseDeadline`).
    pub lease: Option<kv_cluster::member::LeaseDeadline>,
    /// File backing the region of an rdma server (a shm address names its
    /// own); by default /dev/shm/onekv-rdma-PORT.
    pub region_file: Option<PathBuf>,
    /// A new region file is readable by its owner only, or by its group too.
    pub group_access: bool,
    /// Longest a client's one-sided operation may take before it retries;
    /// freed space is reused only after four of these.
    pub op_deadline: Duration,
    /// Most clients connected at once (each holds a key and leased space),
    /// at most 4095: the server's own resize connection needs a key too.
    pub max_clients: u64,
    /// How long a control connection may take to connect, and may stay
    /// silent once connected. Open connections, connected or not, are capped
    /// at twice `max_clients`.
    pub timeouts: Timeouts,
    /// Serve Prometheus metrics over HTTP here (`GET /metrics`); off when
    /// None.
    pub metrics_listen: Option<std::net::SocketAddr>,
}

/// A new region's size: small, since it grows.
pub const DEFAULT_MEMORY: u64 = 64 << 20;

/// Index size up to which any client may have it doubled: 128 Ki slots,
/// next to nothing beside the region.
pub const DEFAULT_RESIZE_ON_REQUEST: u64 = 1 << 20;

/// Open control connections allowed per client slot: room for clients that
/// are still connecting, without letting idle sockets pile up unbounded.
const CONNECTIONS_PER_CLIENT: u64 = 2;

impl ServerConfig {
    pub fn new(address: Address) -> Self {
        ServerConfig {
            address,
            memory: DEFAULT_MEMORY,
            max_memory: None,
            buckets: None,
            max_buckets: None,
            resize_at: 0.8,
            resize_on_request_up_to: DEFAULT_RESIZE_ON_REQUEST,
            secret: None,
            group_epoch: 0,
            lease: None,
            region_file: None,
            group_access: false,
            op_deadline: Duration::from_millis(50),
            max_clients: 1024,
            timeouts: Timeouts {
                handshake: Duration::from_secs(10),
                idle: None,
            },
            metrics_listen: None,
        }
    }

    /// How long freed space waits before anyone may reuse it.
    pub fn grace(&self) -> Duration {
        self.op_deadline * kv_common::protocol::GRACE_DEADLINES
    }

    fn check(&self) -> Result<(), ServerError> {
        if self.op_deadline.is_zero() {
            return Err(ServerError::Config("op deadline must be positive".into()));
        }
        // One key-table entry stays for the server's own resize connection.
        if self.max_clients == 0 || self.max_clients >= KEY_TABLE_ENTRIES {
            return Err(ServerError::Config(format!(
                "max clients must be from 1 to {}",
                KEY_TABLE_ENTRIES - 1
            )));
        }
        if self.timeouts.handshake.is_zero() || self.timeouts.idle.is_some_and(|d| d.is_zero()) {
            return Err(ServerError::Config("timeouts must be positive".into()));
        }
        if self.max_memory.is_some_and(|m| m < self.memory) {
            return Err(ServerError::Config(
                "max memory must be at least the initial memory".into(),
            ));
        }
        if !(self.resize_at > 0.0 && self.resize_at <= 1.0) {
            return Err(ServerError::Config(
                "the resize threshold must be a fraction in (0, 1]".into(),
            ));
        }
        Ok(())
    }
}

/// A running server. Dropping it shuts it down.
pub struct Server {
    shared: Arc<Shared>,
    metrics: Option<MetricsEndpoint>,
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
        // A cap below the index it starts with would show only as "index
        // full" at some later write.
        if let Some(cap) = config.max_buckets.filter(|&m| m < wanted.bucket_count) {
            return Err(ServerError::Config(format!(
                "--max-buckets {cap} is below the {} buckets the index starts with",
                wanted.bucket_count
            )));
        }
        let max_memory = match config.max_memory {
            Some(m) => m,
            None => file_system_size(&path)?.max(config.memory),
        }
        .min(MAX_REGION);
        let listener = transport::bind(&config.address)?;
        restrict_control_socket(&config)?;
        let opened = region::open_or_create(
            &path,
            &wanted,
            region::file_mode(config.group_access),
            max_memory,
        )?;
        let created = opened.created;
        Server::serve(config, listener, opened, max_memory).inspect_err(|_| {
            // A region this start made, left behind, would be taken for
            // one that held data.
            if created {
                let _ = std::fs::remove_file(&path);
            }
        })
    }

    /// Serves the region just opened (the rest of `start`).
    fn serve(
        config: ServerConfig,
        mut listener: Box<dyn ControlListener>,
        opened: region::OpenedRegion,
        max_memory: u64,
    ) -> Result<Server, ServerError> {
        let geometry = opened.geometry;
        let region = Arc::new(opened.region);
        // Revokes every key of an earlier registration.
        listener.register(region.clone())?;
        if !opened.created {
            settle_previous_server(&region, &geometry, config.grace())?;
        }
        let (pool, counters) = rebuild_heap(&region, &geometry)?;
        let found = Found {
            geometry,
            limits: limits(&config, max_memory, &geometry, &region),
            pool,
            counters,
            region_file: opened.lock.try_clone().map_err(TransportError::Io)?,
        };
        let listener: Arc<dyn ControlListener> = Arc::from(listener);
        let shared = Arc::new(new_shared(&config, region, listener.clone(), found));
        // Bound before any thread starts, so a taken port fails the start.
        let metrics = match config.metrics_listen {
            Some(at) => {
                let alone = shared.clone();
                let servers = Box::new(move || vec![(None, alone.clone())]);
                Some(MetricsEndpoint::start(at, servers)?)
            }
            None => None,
        };
        let poller = Arc::new(Poller::new().map_err(TransportError::Io)?);
        let threads = start_threads(&config, &shared, &listener, &poller)?;
        log_serving(&config, opened.created, &geometry, &shared.counters);
        Ok(Server {
            shared,
            metrics,
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

    /// The geometry in force now (it changes as the region grows and the
    /// index is resized).
    pub fn geometry(&self) -> Geometry {
        self.shared.geometry()
    }

    /// Whether this start created the region (false: it was reopened).
    pub fn created(&self) -> bool {
        self.created
    }

    pub fn stats(&self) -> ServerStats {
        self.shared.stats()
    }

    /// Where the Prometheus endpoint listens, if it was asked for.
    pub fn metrics_address(&self) -> Option<std::net::SocketAddr> {
        self.metrics.as_ref().map(MetricsEndpoint::address)
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
        region::slots_of(&self.shared.region, &self.shared.geometry(), key)
    }

    /// Asks for every index slot to be frozen for a shard's move (see
    /// `shard_move`): from then on writers wait, readers go on, and the
    /// index stays as it is until this server stops.
    /// [`HandingOver::wait`] waits for the freeze.
    pub fn hand_over(&self) -> HandingOver {
        if let Ok(mut now) = self.shared.handover.lock() {
            *now = control::Handover::Asked;
        }
        self.shared.want_growth(|w| w.hand_over = true);
        HandingOver {
            shared: self.shared.clone(),
        }
    }

    /// Why the server can no longer serve, if it cannot: its region file
    /// was truncated under it (pages past the new end are gone, and
    /// touching them raises SIGBUS). An embedder polls this (the daemon
    /// does, every second) and stops the server when it says so; the
    /// server stops resizing and growing meanwhile.
    pub fn failure(&self) -> Option<String> {
        self.shared.failure.lock().ok()?.clone()
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
        self.metrics = None;
        self.shared.stopping.store(true, Ordering::SeqCst);
        self.listener.wake();
        let _ = self.poller.notify();
        self.shared.wake_reclaimer();
        self.shared.want_growth(|_| {});
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        self.listener.deregister();
        // What a client wrote over the header since the grow thread's last
        // pass must not make the next start refuse the region.
        if !self.shared.handed_over() {
            grow::repair_header(&self.shared);
        }
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

/// Connecting to a Unix socket takes write permission on it: a shm
/// server's control socket gets the same users as may map the region.
fn restrict_control_socket(config: &ServerConfig) -> Result<(), ServerError> {
    use std::os::unix::fs::PermissionsExt;
    let Address::Shm { region } = &config.address else {
        return Ok(());
    };
    let socket = Address::shm_socket(region);
    let mode = std::fs::Permissions::from_mode(region::file_mode(config.group_access));
    std::fs::set_permissions(&socket, mode).map_err(|e| ServerError::Region {
        path: socket.clone(),
        reason: format!("cannot set the control socket's permissions: {e}"),
    })
}

/// Makes a reopened region safe to serve: the previous server's clients
/// are waited out, and what a crash left half done is finished or undone.
fn settle_previous_server(
    region: &SharedRegion,
    geometry: &Geometry,
    grace: Duration,
) -> Result<(), ServerError> {
    // Verbs of the previous server's clients that were under way
    // when their keys were revoked land within a grace period.
    std::thread::sleep(grace);
    // Nobody is admitted yet: a resize that died unpublished is
    // undone with plain stores.
    let thawed = region::thaw_index(region, geometry)?;
    // The epoch word or the twin record may lag a header switch
    // the crash interrupted.
    if header::finish_switch(region, geometry)? {
        tracing::info!(epoch = geometry.epoch, "finished the header's last switch");
    }
    if thawed > 0 {
        tracing::warn!(
            thawed,
            "thawed an index left frozen (by a resize cut short, or by a shard's move or copy): it is in force again"
        );
    }
    Ok(())
}

/// The heap's free space, rebuilt from a scan of the index, and the
/// counters starting from that scan's findings.
fn rebuild_heap(
    region: &SharedRegion,
    geometry: &Geometry,
) -> Result<(heap::HeapPool, Counters), ServerError> {
    let scan_started = Instant::now();
    let scan = region::scan_index(region, geometry, || *geometry)?;
    let mut pool = heap::HeapPool::new(
        geometry.heap_offset,
        geometry.region_len,
        geometry.chunk_size,
    );
    pool.reserve_at(Extent {
        offset: geometry.index_offset,
        len: geometry.index_bytes(),
    });
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
    Ok((pool, counters))
}

fn log_serving(config: &ServerConfig, created: bool, geometry: &Geometry, counters: &Counters) {
    tracing::info!(
        address = %config.address,
        created,
        region_bytes = geometry.region_len,
        buckets = geometry.bucket_count,
        heap_bytes = geometry.heap_size,
        chunk_bytes = geometry.chunk_size,
        live_slots = counters.live_slots.load(Ordering::Relaxed),
        corrupt_slots = counters.corrupt_slots.load(Ordering::Relaxed),
        "serving"
    );
}

/// How far the region may grow (within what it was mapped for), and when
/// the index grows on its own.
fn limits(
    config: &ServerConfig,
    max_memory: u64,
    geometry: &Geometry,
    region: &SharedRegion,
) -> Limits {
    Limits {
        max_region: max_memory.max(geometry.region_len).min(region.max_len()),
        max_buckets: config.max_buckets.unwrap_or(MAX_BUCKETS),
        resize: index_load::ResizePolicy {
            resize_at: config.resize_at,
            on_request_up_to: config.resize_on_request_up_to,
        },
    }
}

/// What the server found in its region at the start, to serve from.
struct Found {
    geometry: Geometry,
    limits: Limits,
    pool: heap::HeapPool,
    counters: Counters,
    /// A second handle on the (locked) region file.
    region_file: File,
}

/// The control plane's shared state, with no client and nothing asked yet.
fn new_shared(
    config: &ServerConfig,
    region: Arc<SharedRegion>,
    listener: Arc<dyn ControlListener>,
    found: Found,
) -> Shared {
    Shared {
        geometry: RwLock::new(found.geometry),
        region,
        listener,
        address: config.address.clone(),
        limits: found.limits,
        resizing: AtomicBool::new(false),
        handover: Mutex::new(control::Handover::None),
        grow: (Mutex::new(GrowRequests::default()), Condvar::new()),
        client_epochs: Mutex::new(HashMap::new()),
        refused_resize: Mutex::new(None),
        header_repair_warned: Mutex::new(None),
        mover_token: grow::mover_token(),
        secret: config.secret.clone(),
        group_epoch: config.group_epoch,
        lease: config.lease.clone(),
        op_deadline: config.op_deadline,
        max_clients: config.max_clients,
        pool: Mutex::new(found.pool),
        counters: found.counters,
        next_client: AtomicU64::new(1),
        stopping: AtomicBool::new(false),
        reclaim: (Mutex::new(false), Condvar::new()),
        collecting: Mutex::new(()),
        stats_wanted: AtomicBool::new(false),
        region_file: found.region_file,
        failure: Mutex::new(None),
        headroom: AtomicU64::new(0),
        reports_pay: AtomicBool::new(true),
    }
}

/// The server's threads: the control event loop, the reclaimer, the
/// grower and the acceptor that feeds the event loop.
fn start_threads(
    config: &ServerConfig,
    shared: &Arc<Shared>,
    listener: &Arc<dyn ControlListener>,
    poller: &Arc<Poller>,
) -> Result<Vec<JoinHandle<()>>, ServerError> {
    let (to_loop, incoming) = mpsc::channel();
    let max_channels = channel_cap(config.max_clients);
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
        let shared = shared.clone();
        threads.push(spawn("kv-grow", Box::new(move || grow::run(shared)))?);
    }
    {
        let (shared, listener, poller) = (shared.clone(), listener.clone(), poller.clone());
        threads.push(spawn(
            "kv-accept",
            Box::new(move || accept_loop(shared, listener, to_loop, poller)),
        )?);
    }
    Ok(threads)
}

/// Largest region a slot's offset can address.
const MAX_REGION: u64 = Slot::OFFSET_MASK + 1;

/// Bytes of the file system that holds `path` (the default growth cap).
fn file_system_size(path: &std::path::Path) -> Result<u64, ServerError> {
    use std::os::unix::ffi::OsStrExt;
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(std::path::Path::new("."));
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| ServerError::Config(format!("{}: NUL in path", dir.display())))?;
    // SAFETY: statvfs is plain data; zero is a valid start.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: statvfs fills the struct we own from a NUL-terminated path.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(ServerError::Region {
            path: path.to_path_buf(),
            reason: format!(
                "cannot size its file system: {}",
                std::io::Error::last_os_error()
            ),
        });
    }
    Ok((st.f_blocks as u64).saturating_mul(st.f_frsize as u64))
}

/// The file that holds the region: named by a shm address, or given for
/// an rdma one (`region_file`), or a default in /dev/shm.
pub(crate) fn region_path(config: &ServerConfig) -> Result<PathBuf, ServerError> {
    match (&config.address, &config.region_file) {
        (_, Some(path)) => Ok(path.clone()),
        (Address::Shm { region }, None) => Ok(region.clone()),
        (Address::Rdma { port, .. }, None) => {
            Ok(PathBuf::from(format!("/dev/shm/onekv-rdma-{port}")))
        }
    }
}

/// Open control connections allowed: twice `max_clients`, or fewer if the
/// descriptor limit (raised to its hard limit first) has room for fewer,
/// so that a connection beyond the cap can still be accepted and refused
/// with a reason rather than left waiting in the backlog.
fn channel_cap(max_clients: u64) -> usize {
    let wanted = max_clients * CONNECTIONS_PER_CLIENT;
    let limit = descriptors::raise_limit();
    let budget = descriptors::connection_budget(limit).max(1);
    if budget < wanted {
        tracing::warn!(
            descriptor_limit = limit,
            connections = budget,
            "the descriptor limit leaves room for fewer control connections than --max-clients \
             wants ({wanted}); raise `ulimit -n` (LimitNOFILE= under systemd) to serve more"
        );
    }
    budget.min(wanted) as usize
}

/// Accepts control channels and hands them to the event loop, which also
/// takes an rdma channel's handshake (accepting it only makes its queue
/// pair).
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
