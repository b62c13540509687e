//! The rdma backend: RC queue pairs over libibverbs. Queue-pair numbers,
//! PSNs and GIDs are exchanged over a short TCP handshake; after it, control
//! messages are Send/Recv on the queue pair and data is one-sided READ,
//! WRITE, CAS and FETCH-AND-ADD on the server's registered region. The
//! region takes READ and atomics under one key; a client's WRITEs go through
//! the windows of its own leases (`leases`).
//!
//! The TCP socket stays open for the connection's life: the server watches
//! it to learn that a client has gone (an RC queue pair only notices a dead
//! peer when it next sends).
//!
//! Device and GID: the handshake's TCP connection gets its local address
//! from the kernel's route to the peer, and the device and GID holding that
//! address carry the queue pair (see `transport::gid`), as rdma_cm would
//! choose them. `ONEKV_RDMA_DEVICE` and `ONEKV_RDMA_GID_INDEX` override
//! either. A server listening on an unspecified address
//! (`rdma://0.0.0.0:PORT`) serves every device if there is one, or if all
//! of them have global atomics (see `RdmaListener::bind`), and serves each
//! connection from the device its address belongs to.

mod leases;
mod verbs;
#[cfg(test)]
mod window_tests;

use std::io::Read;
use std::net::{IpAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use leases::{Grants, WriteKeys};
use verbs::{
    Completion, Completions, Cq, Device, Endpoint, Gid, Mr, Op, Pd, Qp, QueueDepths, SendWr,
    LOCAL_ONLY, REMOTE_ALL, REMOTE_ATOMIC, REMOTE_READ,
};

use rdma_sys::ibv_atomic_cap;

use super::check;
use super::connection::{
    ConnectOptions, Connection, ControlListener, ControlPeer, Fenced, Received,
};
use super::cutoff::Cutoff;
use super::error::TransportError;
use super::framing::{read_frame, write_frame, FrameReader};
use super::gid::{self, GidEntry};
use super::verb::{ReadOrder, Verb, VerbStats, MAX_BATCH_VERBS};
use crate::mapping::SharedRegion;
use crate::protocol::{self, Extent, RemoteRegion, Request, Response, MAX_MESSAGE};

/// Receive buffers posted per connection, each MAX_MESSAGE long.
const RECV_SLOTS: usize = 4;
/// Work requests one batch may hold: the send queue's depth.
const MAX_BATCH: usize = MAX_BATCH_VERBS;
const SEND_WR_ID: u64 = u64::MAX;
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest wait for the device to complete a batch.
const COMPLETION_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest the server waits for a client to take one reply.
const PEER_SEND_TIMEOUT: Duration = Duration::from_secs(2);

/// What the operator chose by hand; each wins over what the route picks.
struct Overrides {
    device: Option<String>,
    gid_index: Option<u8>,
}

impl Overrides {
    fn from_env() -> Result<Overrides, TransportError> {
        let gid_index = match std::env::var("ONEKV_RDMA_GID_INDEX") {
            Ok(v) if !v.is_empty() => Some(v.parse().map_err(|_| {
                TransportError::Unsupported(format!(
                    "ONEKV_RDMA_GID_INDEX={v} is not a GID index (0-255)"
                ))
            })?),
            _ => None,
        };
        Ok(Overrides {
            device: std::env::var("ONEKV_RDMA_DEVICE")
                .ok()
                .filter(|d| !d.is_empty()),
            gid_index,
        })
    }
}

/// Whether a server confines each client's writes to its leases: unless
/// `ONEKV_RDMA_WRITES=open` makes the region writable by every admitted
/// client (for devices without memory windows, and to measure what
/// confining costs).
fn writes_confined() -> Result<bool, TransportError> {
    match std::env::var("ONEKV_RDMA_WRITES").as_deref() {
        Ok("open") => Ok(false),
        Ok("leases") | Ok("") | Err(_) => Ok(true),
        Ok(other) => Err(TransportError::Unsupported(format!(
            "ONEKV_RDMA_WRITES={other}: say leases (the default: a client writes only \
             into its own leases) or open (anywhere in the region)"
        ))),
    }
}

/// The GID tables of `devices`, one after the other.
fn gid_tables(devices: &[&Device]) -> Result<Vec<GidEntry>, TransportError> {
    let mut all = Vec::new();
    for d in devices {
        all.extend(d.gid_table().map_err(|e| {
            TransportError::Io(std::io::Error::new(
                e.kind(),
                format!("reading the GID table of {}: {e}", d.name),
            ))
        })?);
    }
    Ok(all)
}

/// The device that carries traffic from `local`: the operator's, else the
/// one whose GID table holds `local` (see `gid::choose`).
fn device_for(local: IpAddr, o: &Overrides) -> Result<Arc<Device>, TransportError> {
    let names = match &o.device {
        Some(d) => vec![d.clone()],
        None => Device::names()?,
    };
    if names.len() <= 1 {
        return Device::open(names.first().map(String::as_str)).map_err(TransportError::Io);
    }
    // A device that cannot be opened carries nothing.
    let mut opened: Vec<Arc<Device>> = names
        .iter()
        .filter_map(|n| Device::open(Some(n)).ok())
        .collect();
    if opened.is_empty() {
        return Device::open(None).map_err(TransportError::Io);
    }
    let table = gid_tables(&opened.iter().map(|d| &**d).collect::<Vec<_>>())?;
    let chosen = gid::choose(&table, None, local).map(|e| e.device.as_str());
    let at = opened
        .iter()
        .position(|d| Some(d.name.as_str()) == chosen)
        .unwrap_or(0);
    Ok(opened.swap_remove(at))
}

/// The GID on `device` that traffic from `local` leaves from.
fn source_gid(device: &Device, local: IpAddr, o: &Overrides) -> Result<Gid, TransportError> {
    let index = match o.gid_index {
        Some(i) => i,
        None => gid::choose(&gid_tables(&[device])?, None, local)
            .map(|e| e.index)
            .ok_or_else(|| {
                TransportError::Unsupported(format!(
                    "the GID table of {} is empty; set ONEKV_RDMA_GID_INDEX",
                    device.name
                ))
            })?,
    };
    Ok(device.gid(index)?)
}

fn completion_error(c: &Completion) -> TransportError {
    let text = c.status_text();
    if c.is_remote_access_error() {
        TransportError::RemoteAccess(format!(
            "{text} (bad rkey or range: the server re-registered its region)"
        ))
    } else if c.is_rnr() {
        TransportError::Disconnected(format!("{text}: the peer posted no receive"))
    } else if c.is_retry_exceeded() {
        TransportError::Disconnected(format!("{text}: the peer is unreachable"))
    } else if c.is_flushed() {
        TransportError::Disconnected(format!("{text}: the queue pair is in error"))
    } else {
        TransportError::Io(std::io::Error::other(format!("work completion: {text}")))
    }
}

/// The error of a batch's failed completion `c` (work request `i` posts
/// verb `i`). A remote access error at its first work request is a
/// refusal of the whole batch: the queue pair went to error there, in
/// order, so none of it ran and the rest was flushed (`window_tests`).
fn batch_error(c: &Completion) -> TransportError {
    match completion_error(c) {
        TransportError::RemoteAccess(why) if c.wr_id == 0 => TransportError::TurnedAway(why),
        e => e,
    }
}

/// `e`, the error of a batch (or of a part of one) whose first verb is
/// `first`, as known to have run nothing only where it is: not after
/// earlier parts ran (`ran_before`), nor when the first verb is a READ,
/// which a lost response has the device run again, later verbs having
/// run the first time, and a replayed READ is checked against the
/// registration again.
fn refusal_of(e: TransportError, first: Option<&Verb>, ran_before: bool) -> TransportError {
    let replayable = matches!(first, Some(Verb::Read { .. }));
    match e {
        TransportError::TurnedAway(why) if ran_before || replayable => {
            TransportError::RemoteAccess(why)
        }
        e => e,
    }
}

/// Which end of a connection a channel is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Client,
    Server,
}

/// The resources of one end of a connection: a queue pair with its
/// completion queues and the registered control buffers.
struct Channel {
    qp: Qp,
    ctrl_send: Mr,
    ctrl_recv: Mr,
    tcp: TcpStream,
    /// Set once a completion failed: the queue pair is in error state and
    /// is not reused (the client reconnects).
    broken: Option<String>,
}

impl Channel {
    /// A queue pair on `pd`'s device, sending from the GID that holds the
    /// handshake socket's local address. A server's receives are signalled:
    /// its event loop waits for requests.
    fn new(pd: &Arc<Pd>, tcp: TcpStream, side: Side) -> Result<Channel, TransportError> {
        let device = &pd.device;
        let source = source_gid(device, tcp.local_addr()?.ip(), &Overrides::from_env()?)?;
        let receives = match side {
            Side::Client => Completions::Polled,
            Side::Server => Completions::Signalled,
        };
        let send_cq = Cq::new(device, MAX_BATCH as i32 * 2, Completions::Polled)?;
        let recv_cq = Cq::new(device, RECV_SLOTS as i32 * 2, receives)?;
        let depths = QueueDepths {
            send: MAX_BATCH as u32,
            recv: RECV_SLOTS as u32,
        };
        let qp = Qp::new(pd, send_cq, recv_cq, depths, source)?;
        let ctrl_send = Mr::alloc(pd, MAX_MESSAGE, LOCAL_ONLY)?;
        let ctrl_recv = Mr::alloc(pd, MAX_MESSAGE * RECV_SLOTS, LOCAL_ONLY)?;
        // Receives go up before our endpoint is sent, so the peer can never
        // Send into an empty receive queue.
        for slot in 0..RECV_SLOTS {
            qp.post_recv(slot as u64, &ctrl_recv, slot * MAX_MESSAGE, MAX_MESSAGE)?;
        }
        Ok(Channel {
            qp,
            ctrl_send,
            ctrl_recv,
            tcp,
            broken: None,
        })
    }

    /// The client's half of the handshake: sends its endpoint over the
    /// handshake socket, then connects the queue pair to the server's.
    fn exchange(&mut self) -> Result<(), TransportError> {
        // A server killed mid-handshake resets the socket rather than
        // closing it: that, too, is a peer gone (retried on a new
        // connection), not an error of this client's.
        let left = |e: TransportError| match e {
            TransportError::Io(e) => {
                TransportError::Disconnected(format!("peer left during the handshake: {e}"))
            }
            e => e,
        };
        let mine = protocol::encode(&self.qp.endpoint())?;
        write_frame(&mut self.tcp, &mine).map_err(left)?;
        let theirs = read_frame(&mut self.tcp)
            .map_err(left)?
            .ok_or_else(|| TransportError::Disconnected("peer left during the handshake".into()))?;
        self.qp.connect(&protocol::decode(&theirs)?)?;
        Ok(())
    }

    /// The server's half, once the client's endpoint (`theirs`) came: the
    /// queue pair is connected before the client learns ours, so its first
    /// Send finds it ready.
    fn answer(&mut self, theirs: &[u8]) -> Result<(), TransportError> {
        self.qp.connect(&protocol::decode::<Endpoint>(theirs)?)?;
        let mine = protocol::encode(&self.qp.endpoint())?;
        // A few dozen bytes into a fresh socket's empty buffer: this write
        // does not block, though the socket does not block either.
        write_frame(&mut self.tcp, &mine)
    }

    fn check(&self) -> Result<(), TransportError> {
        match &self.broken {
            Some(why) => Err(TransportError::Disconnected(why.clone())),
            None => Ok(()),
        }
    }

    fn fail<T>(&mut self, e: TransportError) -> Result<T, TransportError> {
        if matches!(
            e,
            TransportError::Disconnected(_)
                | TransportError::RemoteAccess(_)
                | TransportError::TurnedAway(_)
                | TransportError::Io(_)
        ) {
            self.broken = Some(e.to_string());
        }
        Err(e)
    }

    /// Posts work requests and busy-waits for all their completions, for at
    /// most `limit`.
    fn run(&mut self, wrs: &[SendWr], limit: Duration) -> Result<(), TransportError> {
        self.post_only(wrs)?;
        self.wait_for(wrs.len(), limit)
    }

    /// Posts work requests without waiting for them.
    fn post_only(&mut self, wrs: &[SendWr]) -> Result<(), TransportError> {
        self.check()?;
        if let Err(e) = self.qp.post_send(wrs) {
            return self.fail(TransportError::Io(e));
        }
        Ok(())
    }

    /// Busy-waits for the completions of `posted` work requests, for at
    /// most `limit`.
    fn wait_for(&mut self, posted: usize, limit: Duration) -> Result<(), TransportError> {
        let mut done = Vec::with_capacity(posted);
        let deadline = Instant::now() + limit;
        while done.len() < posted {
            let missing = posted - done.len();
            if self.qp.send_cq.poll(&mut done, missing)? == 0 && Instant::now() > deadline {
                return self.fail(TransportError::Disconnected(
                    "no completion from the device".into(),
                ));
            }
        }
        if let Some(bad) = done.iter().find(|c| !c.ok()) {
            let e = batch_error(bad);
            return self.fail(e);
        }
        Ok(())
    }

    /// Sends one message; fails (and breaks the channel) if the peer has
    /// not taken it within `limit`.
    fn send(&mut self, bytes: &[u8], limit: Duration) -> Result<(), TransportError> {
        if bytes.len() > MAX_MESSAGE {
            return Err(protocol::CodecError::TooLarge(bytes.len()).into());
        }
        self.ctrl_send.bytes_mut()[..bytes.len()].copy_from_slice(bytes);
        let wr = SendWr {
            wr_id: SEND_WR_ID,
            op: Op::Send,
            local_addr: self.ctrl_send.addr(),
            len: bytes.len() as u32,
            lkey: self.ctrl_send.lkey(),
        };
        self.run(&[wr], limit)
    }

    /// Takes one received message, if there is one, and reposts its buffer.
    fn take_received(&mut self) -> Result<Option<Vec<u8>>, TransportError> {
        let mut got = Vec::new();
        if self.qp.recv_cq.poll(&mut got, 1)? == 0 {
            return Ok(None);
        }
        let c = got[0];
        if !c.ok() {
            let e = completion_error(&c);
            return self.fail(e);
        }
        let slot = c.wr_id as usize;
        let at = slot * MAX_MESSAGE;
        let bytes = self.ctrl_recv.bytes()[at..at + c.byte_len as usize].to_vec();
        self.qp
            .post_recv(c.wr_id, &self.ctrl_recv, at, MAX_MESSAGE)?;
        Ok(Some(bytes))
    }
}

/// A client's connection to an rdma server.
pub struct RdmaConnection {
    pd: Arc<Pd>,
    channel: Channel,
    /// Verbs posted by `start` whose completions `finish` waits for.
    started: Vec<Verb>,
    local: Option<Mr>,
    remote: Option<RemoteRegion>,
    /// The keys of the leases this client may write into.
    write_keys: WriteKeys,
    stats: VerbStats,
    reply_timeout: Duration,
    /// How long a control message may take to be sent (a completion).
    send_timeout: Duration,
    read_order: ReadOrder,
    cutoff: Option<Arc<Cutoff>>,
}

impl RdmaConnection {
    pub fn connect(
        host: &str,
        port: u16,
        options: &ConnectOptions,
    ) -> Result<RdmaConnection, TransportError> {
        let address = format!("rdma://{host}:{port}");
        let unreachable = |source| TransportError::Unreachable {
            address: address.clone(),
            source,
        };
        let addr = (host, port)
            .to_socket_addrs()
            .map_err(unreachable)?
            .next()
            .ok_or_else(|| unreachable(std::io::Error::other("no address")))?;
        let tcp = TcpStream::connect_timeout(&addr, HANDSHAKE_TIMEOUT).map_err(unreachable)?;
        tcp.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
        let device = device_for(tcp.local_addr()?.ip(), &Overrides::from_env()?)?;
        let pd = Pd::new(device)?;
        let mut channel = Channel::new(&pd, tcp, Side::Client)?;
        channel.exchange()?;
        channel.tcp.set_read_timeout(None)?;
        Ok(RdmaConnection {
            pd,
            channel,
            started: Vec::new(),
            local: None,
            remote: None,
            write_keys: WriteKeys::default(),
            stats: VerbStats::default(),
            reply_timeout: options.reply_timeout,
            // As `set_reply_timeout` sets it: setting the reply timeout back
            // to the options' restores the connection as made.
            send_timeout: COMPLETION_TIMEOUT.min(options.reply_timeout),
            read_order: options.read_order,
            cutoff: None,
        })
    }

    /// Fails (and breaks the channel) once this connection's cutoff is cut.
    fn check_cutoff(&mut self) -> Result<(), TransportError> {
        match self.cutoff.as_ref().and_then(|c| c.error()) {
            Some(e) => self.channel.fail(e),
            None => Ok(()),
        }
    }

    /// The work requests for verbs of a checked batch, each verb's ranges
    /// checked against the registration and the local buffer.
    fn wrs(&self, verbs: &[Verb]) -> Result<Vec<SendWr>, TransportError> {
        let (local, remote) = match (&self.local, &self.remote) {
            (Some(l), Some(r)) => (l, r),
            _ => return Err(TransportError::NotAttached),
        };
        let mut wrs = Vec::with_capacity(verbs.len());
        for (i, v) in verbs.iter().enumerate() {
            let (off, len) = v.remote_range();
            let loc = v.local_offset();
            check::remote_range(remote, off, len)?;
            check::local_range(local.len(), loc, len)?;
            let remote_addr = remote.base + off;
            let rkey = remote.rkey;
            let op = match *v {
                Verb::Read { .. } => Op::Read { remote_addr, rkey },
                Verb::Write { .. } => Op::Write {
                    remote_addr,
                    rkey: self.write_keys.for_write(off, len).unwrap_or(rkey),
                },
                Verb::Cas { expect, swap, .. } => Op::Cas {
                    remote_addr,
                    rkey,
                    expect,
                    swap,
                },
                Verb::FetchAdd { add, .. } => Op::FetchAdd {
                    remote_addr,
                    rkey,
                    add,
                },
            };
            wrs.push(SendWr {
                wr_id: i as u64,
                op,
                local_addr: local.addr() + loc as u64,
                len: len as u32,
                lkey: local.lkey(),
            });
        }
        Ok(wrs)
    }
}

impl Connection for RdmaConnection {
    fn call(&mut self, request: &Request) -> Result<Response, TransportError> {
        self.finish()?;
        // A connection already cut asks nothing more (as shm's, whose
        // socket is shut down): no lease for a client that will not use it.
        self.check_cutoff()?;
        let bytes = protocol::encode(request)?;
        self.channel.send(&bytes, self.send_timeout)?;
        let deadline = Instant::now() + self.reply_timeout;
        loop {
            if let Some(reply) = self.channel.take_received()? {
                return Ok(protocol::decode(&reply)?);
            }
            if Instant::now() > deadline {
                return self.channel.fail(TransportError::Disconnected(
                    "no reply from the server".into(),
                ));
            }
            self.check_cutoff()?;
            std::thread::yield_now();
        }
    }

    fn set_reply_timeout(&mut self, limit: Duration) -> Result<(), TransportError> {
        self.reply_timeout = limit;
        self.send_timeout = COMPLETION_TIMEOUT.min(limit);
        Ok(())
    }

    fn attach(&mut self, region: &RemoteRegion, local_len: usize) -> Result<(), TransportError> {
        // No READ may land in a buffer being replaced.
        self.finish()?;
        self.local = Some(Mr::alloc(&self.pd, local_len, LOCAL_ONLY)?);
        self.remote = Some(*region);
        Ok(())
    }

    fn local(&self) -> &[u8] {
        self.local.as_ref().map_or(&[], Mr::bytes)
    }

    fn local_mut(&mut self) -> &mut [u8] {
        match &mut self.local {
            Some(mr) => mr.bytes_mut(),
            None => &mut [],
        }
    }

    fn post(&mut self, verbs: &[Verb]) -> Result<(), TransportError> {
        self.finish()?;
        check::batch_len(verbs)?;
        // One doorbell per part (the whole batch but in the paused test
        // order); an RC queue pair executes in posting order.
        let mut ran_before = false;
        check::run_batch(self.read_order, verbs, |part| {
            let wrs = self.wrs(part)?;
            let ran = self.channel.run(&wrs, COMPLETION_TIMEOUT);
            let ran = ran.map_err(|e| refusal_of(e, part.first(), ran_before));
            ran_before = true;
            ran
        })?;
        let local = self.local.as_ref().map_or(&[][..], Mr::bytes);
        self.stats.record_batch(verbs, local);
        Ok(())
    }

    fn start(&mut self, verbs: &[Verb]) -> Result<(), TransportError> {
        self.finish()?;
        // The test hook's orders post in parts, each waited for.
        if self.read_order != ReadOrder::Posted {
            return self.post(verbs);
        }
        check::batch_len(verbs)?;
        let wrs = self.wrs(verbs)?;
        self.channel.post_only(&wrs)?;
        self.started.extend_from_slice(verbs);
        Ok(())
    }

    fn finish(&mut self) -> Result<(), TransportError> {
        if self.started.is_empty() {
            return Ok(());
        }
        let waited = self
            .channel
            .wait_for(self.started.len(), COMPLETION_TIMEOUT)
            .map_err(|e| refusal_of(e, self.started.first(), false));
        if waited.is_ok() {
            let local = self.local.as_ref().map_or(&[][..], Mr::bytes);
            self.stats.record_batch(&self.started, local);
        }
        // Kept for its capacity: a batch is started per operation.
        self.started.clear();
        waited
    }

    fn stats(&self) -> &VerbStats {
        &self.stats
    }

    fn cut_by(&mut self, cutoff: Arc<Cutoff>) {
        self.cutoff = Some(cutoff);
    }

    fn allow_writes(&mut self, extent: Extent, key: u32) {
        self.write_keys.allow(extent, key);
    }

    fn forget_writes(&mut self, extent: Extent) {
        self.write_keys.forget(extent);
    }
}

/// The server's listener: a TCP socket for handshakes, and the devices on
/// which the region is registered (one, or every device when it listens on
/// an unspecified address).
pub struct RdmaListener {
    tcp: TcpListener,
    devices: Vec<Served>,
    /// Whether clients write only into their leases (see `leases`): the
    /// region is then registered without remote write.
    confined: bool,
}

/// A device the region is registered on.
struct Served {
    pd: Arc<Pd>,
    mr: Arc<Mutex<Option<Registration>>>,
}

/// What clients may do to the region through its own key: read and
/// atomics, and write too unless writes are confined to leases.
fn region_access(confined: bool) -> u32 {
    if confined {
        LOCAL_ONLY | REMOTE_READ | REMOTE_ATOMIC
    } else {
        REMOTE_ALL
    }
}

/// The registered region and how clients name it. After growth, the
/// registrations of its earlier sizes stay until every client has learned
/// the new key (`forget_earlier`).
struct Registration {
    region: Arc<SharedRegion>,
    mr: Mr,
    remote: RemoteRegion,
    earlier: Vec<Mr>,
}

impl RdmaListener {
    pub fn bind(host: &str, port: u16) -> Result<RdmaListener, TransportError> {
        let tcp = TcpListener::bind((host, port))?;
        let at = tcp.local_addr()?.ip();
        let o = Overrides::from_env()?;
        let opened = if at.is_unspecified() && o.device.is_none() {
            // Devices that cannot be opened serve nothing; the others do.
            let all: Vec<Arc<Device>> = Device::names()?
                .iter()
                .filter_map(|name| Device::open(Some(name)).ok())
                .collect();
            if all.is_empty() {
                return Err(TransportError::Unsupported(
                    "no RDMA device could be opened".into(),
                ));
            }
            all
        } else {
            vec![device_for(at, &o)?]
        };
        if let Some(d) = opened
            .iter()
            .find(|d| d.atomic_cap == ibv_atomic_cap::IBV_ATOMIC_NONE)
        {
            return Err(TransportError::Unsupported(format!(
                "RDMA device {} does not support atomics; onekv needs CAS \
                 (name another with ONEKV_RDMA_DEVICE or listen on its address)",
                d.name
            )));
        }
        // Atomics are atomic against each other only within one adapter
        // unless it says they are global: a CAS through one device and a
        // CAS through another on the same slot could both succeed.
        if opened.len() > 1
            && opened
                .iter()
                .any(|d| d.atomic_cap != ibv_atomic_cap::IBV_ATOMIC_GLOB)
        {
            let names: Vec<&str> = opened.iter().map(|d| d.name.as_str()).collect();
            return Err(TransportError::Unsupported(format!(
                "{} RDMA devices ({}) whose atomics are atomic only within one \
                 adapter: clients on different ones could race on a slot. \
                 Serve one: listen on its address, or set ONEKV_RDMA_DEVICE",
                names.len(),
                names.join(", ")
            )));
        }
        let confined = writes_confined()?;
        if let Some(d) = opened.iter().find(|d| confined && !d.memory_windows) {
            return Err(TransportError::Unsupported(format!(
                "RDMA device {} has no type-2 memory windows, by which onekv lets each \
                 client write only into its own leases; to serve it with the region \
                 writable by every admitted client, set ONEKV_RDMA_WRITES=open",
                d.name
            )));
        }
        let devices = opened
            .into_iter()
            .map(|device| {
                Ok(Served {
                    pd: Pd::new(device)?,
                    mr: Arc::new(Mutex::new(None)),
                })
            })
            .collect::<Result<Vec<_>, TransportError>>()?;
        Ok(RdmaListener {
            tcp,
            devices,
            confined,
        })
    }

    /// The device a connection arriving at `local` is served from: the one
    /// holding that address, else the first.
    fn serving(&self, local: IpAddr) -> Result<&Served, TransportError> {
        if self.devices.len() == 1 {
            return Ok(&self.devices[0]);
        }
        let devices: Vec<&Device> = self.devices.iter().map(|s| &*s.pd.device).collect();
        let table = gid_tables(&devices)?;
        let name = gid::choose(&table, None, local).map(|e| e.device.as_str());
        Ok(self
            .devices
            .iter()
            .find(|s| Some(s.pd.device.name.as_str()) == name)
            .unwrap_or(&self.devices[0]))
    }
}

impl ControlListener for RdmaListener {
    fn register(&mut self, region: Arc<SharedRegion>) -> Result<(), TransportError> {
        for served in &self.devices {
            let mr = Mr::region(&served.pd, region.clone(), region_access(self.confined))?;
            let remote = remote_of(&mr);
            if let Ok(mut slot) = served.mr.lock() {
                *slot = Some(Registration {
                    region: region.clone(),
                    mr,
                    remote,
                    earlier: Vec::new(),
                });
            }
        }
        Ok(())
    }

    fn extend(&self) -> Result<(), TransportError> {
        for served in &self.devices {
            let mut slot = served
                .mr
                .lock()
                .map_err(|_| TransportError::Unsupported("registration poisoned".into()))?;
            let Some(r) = slot.as_mut() else {
                return Err(TransportError::NotAttached);
            };
            if r.region.len() > r.remote.len {
                let mr = Mr::region(&served.pd, r.region.clone(), region_access(self.confined))?;
                r.remote = remote_of(&mr);
                r.earlier.push(std::mem::replace(&mut r.mr, mr));
            }
        }
        Ok(())
    }

    fn forget_earlier(&self) {
        for served in &self.devices {
            if let Ok(mut slot) = served.mr.lock() {
                if let Some(r) = slot.as_mut() {
                    r.earlier.clear();
                }
            }
        }
    }

    fn deregister(&self) {
        for served in &self.devices {
            if let Ok(mut slot) = served.mr.lock() {
                slot.take();
            }
        }
    }

    /// Accepts the handshake socket and makes the queue pair; the client's
    /// endpoint is taken later, by whoever serves the channel (see
    /// [`RdmaPeer::try_recv`]), so a client that connects and stays silent
    /// holds up no other client's accept.
    fn accept(&self) -> Result<Box<dyn ControlPeer>, TransportError> {
        let (tcp, _) = self.tcp.accept()?;
        tcp.set_nonblocking(true)?;
        let served = self.serving(tcp.local_addr()?.ip())?;
        let channel = Channel::new(&served.pd, tcp, Side::Server)?;
        channel.qp.recv_cq.arm()?;
        let mut fds = vec![channel.tcp.as_raw_fd()];
        fds.extend(channel.qp.recv_cq.event_fd().ok());
        Ok(Box::new(RdmaPeer {
            channel: Some(channel),
            fds,
            pd: served.pd.clone(),
            registration: served.mr.clone(),
            confined: self.confined,
            grants: Grants::default(),
            handshake: Handshake::Reading(FrameReader::default()),
        }))
    }

    fn wake(&self) {
        if let Ok(addr) = self.tcp.local_addr() {
            let _ = TcpStream::connect_timeout(&addr, Duration::from_secs(1));
        }
    }
}

fn remote_of(mr: &Mr) -> RemoteRegion {
    RemoteRegion {
        base: mr.addr(),
        len: mr.len() as u64,
        rkey: mr.rkey(),
        key_slot: 0,
    }
}

pub struct RdmaPeer {
    /// The windows of this client's leases, bound on the channel's queue
    /// pair: declared first, so that they go before it (`Drop` ends them
    /// first anyway, by fencing).
    grants: Grants,
    /// None while a thread of its own answers the handshake.
    channel: Option<Channel>,
    /// The channel's descriptors, from accept on.
    fds: Vec<RawFd>,
    pd: Arc<Pd>,
    registration: Arc<Mutex<Option<Registration>>>,
    /// Whether this client writes only through the windows of its leases.
    confined: bool,
    handshake: Handshake,
}

/// The server's half of a handshake, taken by whoever serves the channel.
enum Handshake {
    /// The client's endpoint, as far as it has come.
    Reading(FrameReader),
    /// Connecting the queue pair to it and sending ours, on a thread of its
    /// own: the kernel may take a second to resolve the client's address,
    /// and a hostile endpoint must not hold up the thread that serves every
    /// channel. The channel comes back with the outcome.
    Answering(JoinHandle<(Channel, Result<(), TransportError>)>),
    Done,
}

impl RdmaPeer {
    /// Moves the handshake on as far as it goes without waiting: Nothing
    /// while it goes on, Closed if it failed, None once done.
    fn handshake(&mut self) -> Option<Received> {
        match &mut self.handshake {
            Handshake::Done => None,
            Handshake::Reading(reader) => {
                let channel = self.channel.as_mut()?;
                let theirs = match reader.poll(&mut channel.tcp) {
                    Ok(Received::Message(theirs)) => theirs,
                    Ok(waiting) => return Some(waiting),
                    Err(_) => return Some(Received::Closed),
                };
                let mut channel = self.channel.take()?;
                let answering = std::thread::Builder::new()
                    .name("kv-handshake".into())
                    .spawn(move || {
                        let answered = channel.answer(&theirs);
                        (channel, answered)
                    });
                match answering {
                    Ok(thread) => {
                        self.handshake = Handshake::Answering(thread);
                        Some(Received::Nothing)
                    }
                    Err(_) => Some(Received::Closed),
                }
            }
            // The client sends only once it has our endpoint, which the
            // thread sends last: a Send that wakes us finds it all but done.
            Handshake::Answering(thread) if !thread.is_finished() => Some(Received::Nothing),
            Handshake::Answering(_) => {
                let Handshake::Answering(thread) =
                    std::mem::replace(&mut self.handshake, Handshake::Done)
                else {
                    return Some(Received::Closed);
                };
                match thread.join() {
                    Ok((channel, answered)) => {
                        self.channel = Some(channel);
                        answered.is_err().then_some(Received::Closed)
                    }
                    Err(_) => Some(Received::Closed),
                }
            }
        }
    }

    fn channel(&mut self) -> Result<&mut Channel, TransportError> {
        done(&self.handshake, &mut self.channel).ok_or_else(|| {
            TransportError::Disconnected("the client's handshake has not finished".into())
        })
    }
}

/// The channel once its handshake is done.
fn done<'a>(handshake: &Handshake, channel: &'a mut Option<Channel>) -> Option<&'a mut Channel> {
    match handshake {
        Handshake::Done => channel.as_mut(),
        _ => None,
    }
}

impl ControlPeer for RdmaPeer {
    fn fds(&self) -> Vec<RawFd> {
        self.fds.clone()
    }

    fn try_recv(&mut self) -> Result<Received, TransportError> {
        if let Some(waiting) = self.handshake() {
            return Ok(waiting);
        }
        let Ok(channel) = self.channel() else {
            return Ok(Received::Closed);
        };
        // A queue pair this end broke (a reply that failed, a fence) says
        // nothing of what the client did.
        let sound = channel.broken.is_none();
        let faulted = |e: TransportError| match sound {
            true => Received::Faulted(format!("its queue pair failed: {e}")),
            false => Received::Closed,
        };
        // Nothing is ever sent on the handshake socket after the handshake:
        // readable means the client closed it or died. A request it left
        // is not served (the reply could only time out), but a queue pair
        // it broke first is told apart.
        let mut probe = [0u8; 1];
        match channel.tcp.read(&mut probe) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            _ => {
                return Ok(match channel.take_received() {
                    Err(e) => faulted(e),
                    Ok(_) => Received::Closed,
                })
            }
        }
        channel.qp.recv_cq.take_event();
        let received = match channel.take_received() {
            Ok(Some(bytes)) => return Ok(Received::Message(bytes)),
            Ok(None) => Received::Nothing,
            Err(e) => return Ok(faulted(e)),
        };
        // Re-arm, then look once more: a receive that completed before the
        // arming raises no event.
        channel.qp.recv_cq.arm()?;
        match channel.take_received() {
            Ok(Some(bytes)) => Ok(Received::Message(bytes)),
            Ok(None) => Ok(received),
            Err(e) => Ok(faulted(e)),
        }
    }

    fn send(&mut self, bytes: &[u8]) -> Result<(), TransportError> {
        // One server thread serves every client: a client that does not
        // take its reply (no receive posted) is dropped, not waited for.
        self.channel()?.send(bytes, PEER_SEND_TIMEOUT)
    }

    fn admit(&mut self) -> Result<RemoteRegion, TransportError> {
        self.region()
    }

    fn region(&mut self) -> Result<RemoteRegion, TransportError> {
        self.registration
            .lock()
            .ok()
            .and_then(|r| r.as_ref().map(|r| r.remote))
            .ok_or(TransportError::NotAttached)
    }

    fn fence(&mut self) -> Fenced {
        // A channel still answering its handshake is dropped with it (its
        // thread ends, and the queue pair goes with the channel).
        if let Some(channel) = self.channel.as_mut() {
            channel.broken = Some(match channel.qp.set_error() {
                Ok(()) => "fenced".into(),
                Err(e) => format!("fencing failed: {e}"),
            });
        }
        self.grants.revoke_all();
        Fenced::Revoked
    }

    fn grant_writes(&mut self, extent: Extent) -> Result<Option<u32>, TransportError> {
        if !self.confined {
            return Ok(None);
        }
        let region = self
            .registration
            .lock()
            .ok()
            .and_then(|r| r.as_ref().map(|r| r.region.clone()))
            .ok_or(TransportError::NotAttached)?;
        let Some(channel) = done(&self.handshake, &mut self.channel) else {
            return Err(TransportError::Disconnected(
                "the client's handshake has not finished".into(),
            ));
        };
        let key = self.grants.grant(&self.pd, channel, region, extent)?;
        Ok(Some(key))
    }

    fn confines_writes(&self) -> bool {
        self.confined
    }

    fn revoke_writes(&mut self, extent: Extent) -> Result<(), TransportError> {
        match done(&self.handshake, &mut self.channel) {
            Some(channel) => self.grants.revoke(channel, extent),
            // No windows before the handshake is done.
            None => Ok(()),
        }
    }
}

impl Drop for RdmaPeer {
    fn drop(&mut self) {
        self.fence();
    }
}
