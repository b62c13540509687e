//! The control plane's answers: connect, lease, give-back, geometry and
//! resize, stats and disconnect, one flat match on (request, session).
//! Nothing here touches a slot or a block; clients do that themselves with
//! one-sided verbs, and resizes and growth are the `kv-grow` thread's.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::{Duration, Instant};

use kv_common::layout::{Geometry, SLOTS_PER_BUCKET};
use kv_common::mapping::SharedRegion;
use kv_common::protocol::{
    ConnectInfo, ErrorKind, Extent, GeometryInfo, KeysPage, Request, Response, ServerStats, Spent,
    Unlinked, PROTOCOL_VERSION,
};
use kv_common::transport::{ControlListener, ControlPeer, Fenced};
use kv_common::Address;

use crate::heap::{ClientId, HeapPool, LeaseRefusal, MAX_CONFINED_LEASE_EXTENTS};
use crate::index_load::{self, ResizePolicy};

/// Bad give-backs or malformed messages one client may send before it is
/// disconnected.
pub const MAX_OFFENCES: u32 = 3;

#[derive(Default)]
pub struct Counters {
    pub connected: AtomicU64,
    pub connections: AtomicU64,
    pub connects: AtomicU64,
    /// Connects refused, by [`Refusal`].
    pub refused: [AtomicU64; Refusal::ALL.len()],
    pub leases: AtomicU64,
    pub give_backs: AtomicU64,
    pub refused_give_backs: AtomicU64,
    pub report_messages: AtomicU64,
    pub reported_blocks: AtomicU64,
    pub freed_on_report: AtomicU64,
    pub refused_reports: AtomicU64,
    pub stats_requests: AtomicU64,
    pub disconnects: AtomicU64,
    pub departures: AtomicU64,
    pub malformed: AtomicU64,
    pub cpu_us: AtomicU64,
    pub index_scans: AtomicU64,
    pub live_slots: AtomicU64,
    pub live_bytes: AtomicU64,
    pub corrupt_slots: AtomicU64,
    pub geometry_requests: AtomicU64,
    pub declined_resizes: AtomicU64,
    pub frozen_slots: AtomicU64,
    pub thawed_slots: AtomicU64,
    pub header_repairs: AtomicU64,
    pub faulted_clients: AtomicU64,
    pub write_grant_failures: AtomicU64,
    pub resizes: AtomicU64,
    pub growths: AtomicU64,
}

impl Counters {
    pub fn refuse(&self, why: Refusal) {
        self.refused[why as usize].fetch_add(1, Relaxed);
    }

    pub fn refused(&self, why: Refusal) -> u64 {
        self.refused[why as usize].load(Relaxed)
    }
}

/// Why a connection was refused (the metrics count each reason apart).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The client speaks another protocol version.
    Version,
    /// A wrong or missing secret.
    Secret,
    /// `max_clients` are connected.
    Clients,
    /// Twice `max_clients` control connections are open.
    Connections,
    /// The transport could not admit it (no free access key or queue pair).
    Admission,
    /// It routes by another group epoch (a failover it has not seen, or
    /// one this copy has not seen yet).
    Group,
}

impl Refusal {
    pub const ALL: [Refusal; 6] = [
        Refusal::Version,
        Refusal::Secret,
        Refusal::Clients,
        Refusal::Connections,
        Refusal::Admission,
        Refusal::Group,
    ];

    /// The metrics label.
    pub fn label(self) -> &'static str {
        match self {
            Refusal::Version => "version",
            Refusal::Secret => "secret",
            Refusal::Clients => "max_clients",
            Refusal::Connections => "max_connections",
            Refusal::Admission => "admission",
            Refusal::Group => "group_epoch",
        }
    }
}

/// What the `kv-grow` thread is asked to do.
#[derive(Debug, Default)]
pub struct GrowRequests {
    /// Resize the index while it has this many buckets (a client found no
    /// room, or an operator asked).
    pub resize: Option<u64>,
    /// Grow the heap, if the region is still this long (a request made
    /// before a growth is answered by it).
    pub heap: Option<u64>,
    /// Frozen slots were seen with no resize under way: thaw them.
    pub thaw: bool,
    /// Freeze the index for good: the shard is moving away (see
    /// [`Handover`]).
    pub hand_over: bool,
}

/// Where a shard's move stands with this server's index. A move's last
/// copy freezes every slot, as a resize does, so that writers wait while
/// readers go on; the index then stays frozen until the server stops (a
/// server that opens the region again thaws it).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Handover {
    #[default]
    None,
    Asked,
    /// Frozen: no resize or thaw changes the index again.
    Frozen,
    Failed(String),
}

/// How far the region may grow, and when the index grows on its own.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_region: u64,
    pub max_buckets: u64,
    pub resize: ResizePolicy,
}

/// What the control plane's threads share.
pub struct Shared {
    /// Changed only by the `kv-grow` thread, after the header says so.
    pub geometry: RwLock<Geometry>,
    pub region: Arc<SharedRegion>,
    pub listener: Arc<dyn ControlListener>,
    /// Where clients reach this server (the resize mover is one of them).
    pub address: Address,
    pub limits: Limits,
    /// A resize is migrating the index (or a move has frozen it: writers
    /// wait either way).
    pub resizing: AtomicBool,
    pub handover: Mutex<Handover>,
    pub grow: (Mutex<GrowRequests>, Condvar),
    /// The epoch of the geometry each connected client last learned: an
    /// old index is reused once every client has moved past it.
    pub client_epochs: Mutex<HashMap<ClientId, u64>>,
    /// Why the last resize was refused (no room for the new index), at
    /// which epoch and when: clients asking again soon after get the reason
    /// instead of another attempt.
    pub refused_resize: Mutex<Option<(u64, String, Instant)>>,
    /// When header repairs were last logged (see `grow::repair_header`).
    pub header_repair_warned: Mutex<Option<Instant>>,
    /// What the server's own resize connection presents (see `grow.rs`).
    pub mover_token: [u8; 32],
    pub secret: Option<Vec<u8>>,
    /// The group epoch clients must route by (see `ServerConfig`).
    pub group_epoch: u64,
    /// Clients are admitted only before it passes (see `ServerConfig`).
    pub lease: Option<kv_cluster::member::LeaseDeadline>,
    pub op_deadline: Duration,
    pub max_clients: u64,
    pub pool: Mutex<HeapPool>,
    pub counters: Counters,
    pub next_client: AtomicU64,
    pub stopping: AtomicBool,
    /// Wakes the reclaimer early (a lease went wanting, a client left).
    pub reclaim: (Mutex<bool>, Condvar),
    /// Held from a collection's scan to its sweep: two collections whose
    /// scans overlap could each free space the other's scan saw in use.
    pub collecting: Mutex<()>,
    /// Someone asked for stats: refresh the scan's figures (at most once a
    /// second), so they do not go stale while nothing else scans.
    pub stats_wanted: AtomicBool,
    /// The region file (to notice it shrinking under the server).
    pub region_file: std::fs::File,
    /// Why the server cannot go on serving, once it cannot.
    pub failure: Mutex<Option<String>>,
    /// Free heap bytes (aging included) the reclaimer keeps for the rate
    /// at which clients write (see `reclaim.rs`).
    pub headroom: AtomicU64,
    /// Whether checking reports frees space at less cost than scanning
    /// does (see `reclaim.rs`); while not, reports are not taken and
    /// clients are told to hold them back.
    pub reports_pay: AtomicBool,
}

impl Shared {
    /// The read lease a client of this copy may hold from now, in
    /// microseconds: None when the region is no replicated copy (reads
    /// need no lease), Some(None) when the member's own lease may be lost.
    /// It ends two operation deadlines before the member's lease may: a
    /// read the client checked against it executes within one.
    pub fn read_lease(&self) -> Option<Option<u64>> {
        let member = self.lease.as_ref()?;
        let granted = member
            .remaining()
            .and_then(|left| left.checked_sub(self.op_deadline * 2))
            .map(|d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
            .filter(|&us| us > 0);
        Some(granted)
    }

    pub fn grace(&self) -> Duration {
        self.op_deadline * kv_common::protocol::GRACE_DEADLINES
    }

    pub fn geometry(&self) -> Geometry {
        match self.geometry.read() {
            Ok(g) => *g,
            Err(poisoned) => *poisoned.into_inner(),
        }
    }

    /// The geometry to tell client `id`, recording that it knows it: both
    /// under one lock, which releasing an old index takes too, so no client
    /// is ever told about an index already released. Callers fetch the
    /// region's key after this, so a client at an epoch holds a key at least
    /// as new as that epoch's registration.
    pub fn tell_geometry(&self, id: ClientId) -> Geometry {
        match self.client_epochs.lock() {
            Ok(mut epochs) => {
                let g = self.geometry();
                epochs.insert(id, g.epoch);
                g
            }
            Err(_) => self.geometry(),
        }
    }

    /// Why a resize of the index of `epoch` was refused lately, if it was:
    /// for a second (collections and departures may free room meanwhile).
    pub fn resize_refusal(&self, epoch: u64) -> Option<String> {
        let refused = self.refused_resize.lock().ok()?.clone()?;
        let (at_epoch, why, when) = refused;
        (at_epoch == epoch && when.elapsed() < Duration::from_secs(1)).then_some(why)
    }

    /// Client `id` is gone: it holds back no old index or registration.
    pub fn forget_client(&self, id: ClientId) {
        if let Ok(mut epochs) = self.client_epochs.lock() {
            epochs.remove(&id);
        }
    }

    /// The oldest epoch a connected client knows (None: no clients).
    pub fn oldest_client_epoch(&self) -> Option<u64> {
        self.client_epochs
            .lock()
            .map_or(Some(0), |e| e.values().copied().min())
    }

    /// Asks the `kv-grow` thread for a resize or more heap.
    /// Whether a move has frozen the index for good.
    pub fn handed_over(&self) -> bool {
        self.handover.lock().is_ok_and(|h| *h == Handover::Frozen)
    }

    pub fn want_growth(&self, f: impl FnOnce(&mut GrowRequests)) {
        let (wanted, cv) = &self.grow;
        if let Ok(mut w) = wanted.lock() {
            f(&mut w);
            cv.notify_one();
        }
    }

    /// The geometry and how this client reaches the region, noting that
    /// the client now knows this epoch.
    fn geometry_info(
        &self,
        id: ClientId,
        peer: &mut dyn ControlPeer,
    ) -> Result<GeometryInfo, String> {
        let geometry = self.tell_geometry(id);
        let region = peer.region().map_err(|e| e.to_string())?;
        Ok(GeometryInfo {
            geometry,
            region,
            resizing: self.resizing.load(Relaxed),
        })
    }

    /// Whether the heap may grow to keep its headroom: the region is under
    /// its cap, and the heap under twice the live data (as of the last
    /// scan) and the headroom: under a steady load the heap ends within
    /// twice that, a growth step doubling the region.
    pub fn may_grow_for_headroom(&self, g: &Geometry) -> bool {
        let live = self.counters.live_bytes.load(Relaxed);
        let headroom = self.headroom.load(Relaxed);
        g.region_len < self.limits.max_region
            && g.heap_size < live.saturating_add(headroom).saturating_mul(2)
    }

    pub fn wake_reclaimer(&self) {
        let (flag, cv) = &self.reclaim;
        if let Ok(mut f) = flag.lock() {
            *f = true;
            cv.notify_one();
        }
    }

    /// The counters, the pool's totals and the last index scan's findings;
    /// cheap enough to answer any number of stats requests.
    pub fn stats(&self) -> ServerStats {
        let c = &self.counters;
        let g = self.geometry();
        let (heap_free, heap_leased) = self
            .pool
            .lock()
            .map(|p| (p.free_bytes(), p.leased_bytes()))
            .unwrap_or_default();
        ServerStats {
            clients_connected: c.connected.load(Relaxed),
            connections: c.connections.load(Relaxed),
            connects: c.connects.load(Relaxed),
            rejected_connects: Refusal::ALL.iter().map(|&r| c.refused(r)).sum(),
            leases: c.leases.load(Relaxed),
            give_backs: c.give_backs.load(Relaxed),
            refused_give_backs: c.refused_give_backs.load(Relaxed),
            report_messages: c.report_messages.load(Relaxed),
            reported_blocks: c.reported_blocks.load(Relaxed),
            freed_on_report: c.freed_on_report.load(Relaxed),
            refused_reports: c.refused_reports.load(Relaxed),
            stats_requests: c.stats_requests.load(Relaxed),
            disconnects: c.disconnects.load(Relaxed),
            departures: c.departures.load(Relaxed),
            malformed: c.malformed.load(Relaxed),
            heap_size: g.heap_size,
            heap_free,
            heap_leased,
            bucket_count: g.bucket_count,
            live_slots: c.live_slots.load(Relaxed),
            live_bytes: c.live_bytes.load(Relaxed),
            index_scans: c.index_scans.load(Relaxed),
            corrupt_slots: c.corrupt_slots.load(Relaxed),
            server_cpu_us: c.cpu_us.load(Relaxed),
            epoch: g.epoch,
            resizes: c.resizes.load(Relaxed),
            resizing: self.resizing.load(Relaxed),
            growths: c.growths.load(Relaxed),
            region_bytes: g.region_len,
            max_region_bytes: self.limits.max_region,
            index_slots: g.index_buckets() * SLOTS_PER_BUCKET as u64,
            geometry_requests: c.geometry_requests.load(Relaxed),
            declined_resizes: c.declined_resizes.load(Relaxed),
            frozen_slots: c.frozen_slots.load(Relaxed),
            thawed_slots: c.thawed_slots.load(Relaxed),
            header_repairs: c.header_repairs.load(Relaxed),
            faulted_clients: c.faulted_clients.load(Relaxed),
            write_grant_failures: c.write_grant_failures.load(Relaxed),
        }
    }
}

/// One control channel's state.
#[derive(Default)]
pub struct Session {
    /// Set once the client connected (and so was admitted to the data path).
    pub client: Option<ClientId>,
    pub offences: u32,
}

/// What to do with the channel after replying.
#[derive(Debug, PartialEq, Eq)]
pub enum After {
    Stay,
    Close,
}

pub fn error(kind: ErrorKind, message: impl Into<String>) -> Response {
    Response::Error {
        kind,
        message: message.into(),
    }
}

/// Compares secrets in time independent of where they differ.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Counts one offence; a client past the limit is disconnected.
pub fn offence(session: &mut Session) -> After {
    session.offences += 1;
    if session.offences >= MAX_OFFENCES {
        After::Close
    } else {
        After::Stay
    }
}

/// Answers one request.
pub fn handle(
    shared: &Shared,
    session: &mut Session,
    peer: &mut dyn ControlPeer,
    request: Request,
) -> (Response, After) {
    let c = &shared.counters;
    match (request, session.client) {
        (
            Request::Connect {
                protocol_version,
                secret,
                group,
            },
            None,
        ) => connect(shared, session, peer, (protocol_version, group), &secret),
        (Request::Connect { .. }, Some(_)) => {
            c.malformed.fetch_add(1, Relaxed);
            let after = offence(session);
            (error(ErrorKind::Malformed, "already connected"), after)
        }
        (Request::ClusterMap { .. }, _) => (
            error(
                ErrorKind::NoMap,
                "this address serves one region, not a cluster's map: a cluster is read at a member's own --listen address",
            ),
            After::Close,
        ),
        (_, None) => {
            c.malformed.fetch_add(1, Relaxed);
            (
                error(ErrorKind::NotConnected, "send Connect first"),
                After::Close,
            )
        }
        (Request::Lease { min_len }, Some(id)) => lease(shared, session, peer, id, min_len),
        (Request::GiveBack { spent, unlinked }, Some(id)) => {
            report(shared, &unlinked);
            give_back(shared, session, peer, id, spent)
        }
        (Request::Unlinked { blocks }, Some(_)) => {
            c.report_messages.fetch_add(1, Relaxed);
            report(shared, &blocks);
            let more = shared.reports_pay.load(Relaxed);
            (Response::Noted { more }, After::Stay)
        }
        (Request::Geometry, Some(id)) => {
            c.geometry_requests.fetch_add(1, Relaxed);
            geometry_reply(shared, id, peer)
        }
        (Request::Resize { epoch, full_key }, Some(id)) => {
            c.geometry_requests.fetch_add(1, Relaxed);
            if let Err(why) = consider_resize(shared, epoch, full_key.as_deref()) {
                return (error(ErrorKind::IndexFull, why), After::Stay);
            }
            geometry_reply(shared, id, peer)
        }
        (Request::StrayFrozen { epoch }, Some(id)) => {
            c.geometry_requests.fetch_add(1, Relaxed);
            if epoch == shared.geometry().epoch && !shared.resizing.load(Relaxed) {
                shared.want_growth(|w| w.thaw = true);
            }
            geometry_reply(shared, id, peer)
        }
        (Request::Stats, Some(_)) => {
            c.stats_requests.fetch_add(1, Relaxed);
            shared.stats_wanted.store(true, Relaxed);
            shared.wake_reclaimer();
            (Response::Stats(shared.stats()), After::Stay)
        }
        (Request::ReadLease, Some(_)) => read_lease(shared),
        (Request::Keys { from, seed }, Some(_)) => (keys_page(shared, from, seed), After::Stay),
        (Request::Disconnect, Some(id)) => {
            c.disconnects.fetch_add(1, Relaxed);
            tracing::debug!(client = id, "disconnected");
            (Response::Goodbye, After::Close)
        }
    }
}

/// A page of the region's keys with digests of their values (see
/// `Request::Keys`), from the index in force.
fn keys_page(shared: &Shared, from: u64, seed: u64) -> Response {
    let g = shared.geometry();
    let resizing = shared.resizing.load(Relaxed);
    match crate::region::keys_page(&shared.region, &g, from, seed) {
        Ok((keys, next, damaged)) => Response::Keys(KeysPage {
            epoch: g.epoch,
            // One begun, or begun and ended, while the page was read.
            resizing: resizing
                || shared.resizing.load(Relaxed)
                || shared.geometry().epoch != g.epoch,
            next,
            damaged,
            keys,
        }),
        // The server's own mapping failed it: nothing the client did.
        Err(e) => error(ErrorKind::Malformed, format!("cannot read the index: {e}")),
    }
}

/// A `ReadLease`: reads granted for as long as the member's lease is sure
/// to last (see `Shared::read_lease`), unbounded on a region that is no
/// replicated copy; refused, and the client cut off, once it may be lost.
fn read_lease(shared: &Shared) -> (Response, After) {
    match shared.read_lease() {
        Some(Some(valid_us)) => (Response::ReadLease { valid_us }, After::Stay),
        None => (Response::ReadLease { valid_us: u64::MAX }, After::Stay),
        Some(None) => {
            shared.counters.refuse(Refusal::Group);
            (
                error(ErrorKind::StaleGroup, LEASE_UNCONFIRMED),
                After::Close,
            )
        }
    }
}

/// Why a copy whose member cannot confirm its lease turns clients away.
const LEASE_UNCONFIRMED: &str =
    "this copy's server cannot confirm its lease: it may have been failed over";

/// A `Connect` on a fresh channel: checks the version, the secret and the
/// client limit, then admits the client to the data path.
fn connect(
    shared: &Shared,
    session: &mut Session,
    peer: &mut dyn ControlPeer,
    (protocol_version, group): (u32, u64),
    secret: &[u8],
) -> (Response, After) {
    let c = &shared.counters;
    if protocol_version != PROTOCOL_VERSION {
        c.refuse(Refusal::Version);
        let m = format!("client speaks protocol {protocol_version}, server {PROTOCOL_VERSION}");
        return (error(ErrorKind::VersionMismatch, m), After::Close);
    }
    // The server's own resize connection: admitted past the limit.
    let mover = same_secret(&shared.mover_token, secret);
    if let Some(expected) = shared.secret.as_ref().filter(|_| !mover) {
        if !same_secret(expected, secret) {
            c.refuse(Refusal::Secret);
            tracing::warn!("refused a client with a wrong secret");
            return (error(ErrorKind::BadSecret, "wrong secret"), After::Close);
        }
    }
    if shared.lease.as_ref().is_some_and(|l| l.passed()) && !mover {
        c.refuse(Refusal::Group);
        return (
            error(ErrorKind::StaleGroup, LEASE_UNCONFIRMED),
            After::Close,
        );
    }
    if group != shared.group_epoch && !mover {
        c.refuse(Refusal::Group);
        let m = format!(
            "this copy serves group epoch {}, the client routes by {group}: read the map again",
            shared.group_epoch
        );
        return (error(ErrorKind::StaleGroup, m), After::Close);
    }
    if !mover && c.connected.load(Relaxed) >= shared.max_clients {
        c.refuse(Refusal::Clients);
        let m = format!("the server serves at most {} clients", shared.max_clients);
        return (error(ErrorKind::TooManyClients, m), After::Close);
    }
    // The epoch first: the key admit hands out is then at least as
    // new as the geometry (see `tell_geometry`).
    let id = shared.next_client.fetch_add(1, Relaxed);
    let geometry = shared.tell_geometry(id);
    let region = match peer.admit() {
        Ok(r) => r,
        Err(e) => {
            shared.forget_client(id);
            c.refuse(Refusal::Admission);
            return (
                error(ErrorKind::TooManyClients, e.to_string()),
                After::Close,
            );
        }
    };
    session.client = Some(id);
    c.connects.fetch_add(1, Relaxed);
    c.connected.fetch_add(1, Relaxed);
    tracing::debug!(client = id, "connected");
    let info = ConnectInfo {
        client_id: id,
        region,
        geometry,
        op_deadline_us: shared.op_deadline.as_micros() as u64,
        // The mover is this process's own: frozen with it.
        read_lease_us: match mover {
            true => None,
            false => shared.read_lease().map(|granted| granted.unwrap_or(0)),
        },
    };
    (Response::Connected(info), After::Stay)
}

/// A `Lease`: heap extents for client `id`, or why there are none now.
fn lease(
    shared: &Shared,
    session: &mut Session,
    peer: &mut dyn ControlPeer,
    id: ClientId,
    min_len: u64,
) -> (Response, After) {
    let c = &shared.counters;
    c.leases.fetch_add(1, Relaxed);
    let chunk_size = shared.geometry().chunk_size;
    if min_len == 0 || min_len > chunk_size {
        let m = format!("lease of {min_len} bytes; chunks are {chunk_size}");
        let after = offence(session);
        return (error(ErrorKind::Malformed, m), after);
    }
    let (leased, held) = match shared.pool.lock() {
        Ok(mut p) => {
            let most = match peer.confines_writes() {
                true => MAX_CONFINED_LEASE_EXTENTS,
                false => usize::MAX,
            };
            let leased = p.lease(id, min_len, most);
            let held = leased
                .is_err()
                .then(|| (p.retired_bytes(), p.aging_bytes(), p.leased_bytes()));
            (leased, held)
        }
        Err(_) => (Err(LeaseRefusal::Full), None),
    };
    // Where the heap is, for a refusal.
    let held = || {
        let (retired, aging, leased) = held.unwrap_or_default();
        format!(
            "{} bytes live at the last collection, {retired} awaiting a collection, \
             {aging} awaiting their grace period, {leased} leased to clients",
            c.live_bytes.load(Relaxed)
        )
    };
    match grow_instead_of_collecting(shared, leased) {
        Ok(extents) => {
            tracing::trace!(client = id, extents = extents.len(), "leased");
            match grant_writes(shared, peer, id, &extents) {
                Ok(write_keys) => (
                    Response::Leased {
                        extents,
                        write_keys,
                    },
                    After::Stay,
                ),
                // Closing ends the session: the lease is retired with the
                // rest of what the client held.
                Err(m) => (error(ErrorKind::WriteGrant, m), After::Close),
            }
        }
        Err(LeaseRefusal::Busy) => {
            shared.wake_reclaimer();
            let m = format!(
                "no free heap space right now; space is being reclaimed ({})",
                held()
            );
            (error(ErrorKind::HeapBusy, m), After::Stay)
        }
        Err(LeaseRefusal::Full) => {
            shared.wake_reclaimer();
            let m = format!(
                "no free heap space left after a collection, and the region is at its cap of \
                 {} bytes (--max-memory): {}",
                shared.limits.max_region,
                held()
            );
            (error(ErrorKind::HeapFull, m), After::Stay)
        }
        Err(LeaseRefusal::TooManyExtents) => {
            let m = "this client holds too many extents; give some back first";
            (error(ErrorKind::BadExtent, m), After::Stay)
        }
    }
}

/// Makes each of `extents`, newly leased to client `id`, writable by it:
/// the keys its WRITEs there carry (none where writes are not confined).
fn grant_writes(
    shared: &Shared,
    peer: &mut dyn ControlPeer,
    id: ClientId,
    extents: &[Extent],
) -> Result<Vec<u32>, String> {
    let mut keys = Vec::new();
    for &e in extents {
        match peer.grant_writes(e) {
            Ok(Some(key)) => keys.push(key),
            Ok(None) => {}
            Err(why) => {
                shared.counters.write_grant_failures.fetch_add(1, Relaxed);
                tracing::warn!(client = id, "could not make a lease writable: {why}");
                return Err(format!("could not make the lease writable: {why}"));
            }
        }
    }
    Ok(keys)
}

/// Reports of unlinked blocks, from any client: queued for the reclaimer
/// to check (a report is never an offence: a client may report a block
/// another unlinked first, and nothing is freed without a check).
fn report(shared: &Shared, blocks: &[Unlinked]) {
    if blocks.is_empty() {
        return;
    }
    let c = &shared.counters;
    c.reported_blocks.fetch_add(blocks.len() as u64, Relaxed);
    if !shared.reports_pay.load(Relaxed) {
        // Scans reclaim space at less cost now: these are theirs.
        c.refused_reports.fetch_add(blocks.len() as u64, Relaxed);
        return;
    }
    let (dropped, ready) = match shared.pool.lock() {
        Ok(mut p) => (p.report(blocks), p.ready_reports()),
        Err(_) => (blocks.len() as u64, 0),
    };
    c.refused_reports.fetch_add(dropped, Relaxed);
    if ready > 0 {
        shared.wake_reclaimer();
    }
}

/// A `GiveBack`: the pool takes back what client `id` no longer writes
/// into; naming space it does not hold is an offence.
fn give_back(
    shared: &Shared,
    session: &mut Session,
    peer: &mut dyn ControlPeer,
    id: ClientId,
    mut spent: Vec<Spent>,
) -> (Response, After) {
    let c = &shared.counters;
    c.give_backs.fetch_add(1, Relaxed);
    // Before the pool may lease the space again (a give-back it refuses
    // loses them all the same: it named them).
    for s in &spent {
        if let Err(why) = peer.revoke_writes(s.extent) {
            c.write_grant_failures.fetch_add(1, Relaxed);
            tracing::warn!(client = id, "could not revoke a lease's window: {why}");
            let m = format!("could not end writes into a given-back lease: {why}");
            return (error(ErrorKind::WriteGrant, m), After::Close);
        }
    }
    // A WRITE the client began before its window went may still be landing
    // in space it never carved (a window's key is checked when a WRITE
    // begins): that space waits a grace period.
    let uncarved_ready = match peer.confines_writes() {
        true => Instant::now() + shared.grace(),
        false => Instant::now(),
    };
    if !shared.reports_pay.load(Relaxed) {
        // Scans reclaim this space: where its blocks begin would only
        // cost keeping.
        spent.iter_mut().for_each(|s| s.starts = Vec::new());
    }
    let result = match shared.pool.lock() {
        Ok(mut p) => p.give_back(id, &spent, uncarved_ready),
        Err(_) => Err("heap pool unavailable".into()),
    };
    match result {
        Ok(dropped) => {
            c.refused_reports.fetch_add(dropped, Relaxed);
            shared.wake_reclaimer();
            (Response::GivenBack, After::Stay)
        }
        Err(m) => {
            c.refused_give_backs.fetch_add(1, Relaxed);
            tracing::warn!(client = id, "refused give-back: {m}");
            let after = offence(session);
            (error(ErrorKind::BadExtent, m), after)
        }
    }
}

/// A refused lease, where the region may still grow, asks the `kv-grow`
/// thread for more heap: when most of the heap is live (collecting cannot
/// help), or when the heap is under what the write rate calls for (the
/// reclaimer grows it ahead of need; this is for a burst it did not see
/// coming). A full heap is only busy while it grows.
fn grow_instead_of_collecting<T>(
    shared: &Shared,
    leased: Result<T, LeaseRefusal>,
) -> Result<T, LeaseRefusal> {
    let g = shared.geometry();
    let can_grow = g.region_len < shared.limits.max_region;
    let wanted = || {
        shared.counters.live_bytes.load(Relaxed) >= g.heap_size / 2
            || shared.may_grow_for_headroom(&g)
    };
    match leased {
        Err(LeaseRefusal::Busy) if can_grow && wanted() => {
            shared.want_growth(|w| w.heap = Some(g.region_len));
            Err(LeaseRefusal::Busy)
        }
        Err(LeaseRefusal::Full) if can_grow => {
            shared.want_growth(|w| w.heap = Some(g.region_len));
            Err(LeaseRefusal::Busy)
        }
        other => other,
    }
}

/// A `Resize` of the index of `epoch`: declined when the index is not
/// loaded enough, refused (Err: why the index is full) when there is no
/// room or the cap is reached, else handed to the `kv-grow` thread. A
/// resize already under way, or an epoch already past, asks nothing.
fn consider_resize(shared: &Shared, epoch: u64, full_key: Option<&[u8]>) -> Result<(), String> {
    let current = shared.geometry();
    if epoch != current.epoch || shared.resizing.load(Relaxed) {
        return Ok(());
    }
    if !index_load::resize_warranted(&shared.region, &current, shared.limits.resize, full_key) {
        // Answered with the geometry, not resizing: the client
        // redoes its operation, or reports the refusal.
        shared.counters.declined_resizes.fetch_add(1, Relaxed);
        return Ok(());
    }
    if let Some(why) = shared.resize_refusal(epoch) {
        return Err(why);
    }
    if current.bucket_count * 2 > shared.limits.max_buckets {
        let m = format!(
            "the index has {} buckets, the cap (--max-buckets) is {}",
            current.bucket_count, shared.limits.max_buckets
        );
        return Err(m);
    }
    // Said before the reply, so the client sees it resizing;
    // under the grow lock, which the grow thread clears it under.
    shared.want_growth(|w| {
        shared.resizing.store(true, Relaxed);
        w.resize = Some(current.bucket_count);
    });
    Ok(())
}

/// The geometry as a reply; a client whose channel cannot say how it
/// reaches the region is hung up on.
fn geometry_reply(shared: &Shared, id: ClientId, peer: &mut dyn ControlPeer) -> (Response, After) {
    match shared.geometry_info(id, peer) {
        Ok(info) => (Response::Geometry(info), After::Stay),
        Err(m) => (error(ErrorKind::NotConnected, m), After::Close),
    }
}

/// How a channel came to close.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// The client said goodbye, or the server is shutting down: nothing to
    /// count as a departure.
    Goodbye,
    /// The channel broke, timed out or was hung up on: a departure, whose
    /// verbs may still be in flight.
    Unannounced,
}

/// Ends a session: a connected client is cut off the data path, and what
/// it still holds is retired (reclaimed once the fence has settled).
pub fn end_session(shared: &Shared, session: &Session, peer: &mut dyn ControlPeer, ending: Ending) {
    let Some(id) = session.client else {
        return;
    };
    let fenced = peer.fence();
    // A client that said goodbye, or whose process has exited, has no verb
    // in flight; any other may have one, which lands within a grace period.
    let eligible = if ending == Ending::Goodbye || fenced == Fenced::Exited {
        Instant::now()
    } else {
        Instant::now() + shared.grace()
    };
    if let Ok(mut p) = shared.pool.lock() {
        p.depart(id, eligible, ending == Ending::Goodbye);
    }
    shared.forget_client(id);
    // It may have been the last holding back an old index.
    shared.want_growth(|_| {});
    let c = &shared.counters;
    c.connected.fetch_sub(1, Relaxed);
    if ending == Ending::Unannounced {
        c.departures.fetch_add(1, Relaxed);
        tracing::info!(
            client = id,
            "client left without goodbye; its space will be reclaimed"
        );
    }
    shared.wake_reclaimer();
}

/// CPU time this thread has used, in microseconds.
pub fn thread_cpu_us() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we own.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return 0;
    }
    ts.tv_sec as u64 * 1_000_000 + ts.tv_nsec as u64 / 1_000
}

/// Adds the CPU time this thread used since `mark` to the shared counter.
pub fn account_cpu(counters: &Counters, mark: &mut u64) {
    let now = thread_cpu_us();
    counters
        .cpu_us
        .fetch_add(now.saturating_sub(*mark), Relaxed);
    *mark = now;
}
