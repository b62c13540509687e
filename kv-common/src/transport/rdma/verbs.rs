//! A small safe layer over libibverbs (through rdma-sys): device, protection
//! domain, memory regions, completion queues and RC queue pairs. This is the
//! only `unsafe` code of the rdma backend; every pointer it holds is owned by
//! one of these types and released in its Drop, after what depends on it.

use std::ffi::CStr;
use std::io;
use std::os::fd::RawFd;
use std::sync::Arc;

use rdma_sys::*;
use serde::{Deserialize, Serialize};

use crate::mapping::SharedRegion;
use crate::transport::gid::{GidEntry, GidKind};
use crate::words::{as_bytes, as_bytes_mut};

extern "C" {
    // libibverbs (rdma-core 32 and later) behind the inline
    // `ibv_query_gid_table`, which bindgen cannot bind.
    fn _ibv_query_gid_table(
        context: *mut ibv_context,
        entries: *mut ibv_gid_entry,
        max_entries: usize,
        flags: u32,
        entry_size: usize,
    ) -> isize;
}

fn os_error(what: &str) -> io::Error {
    let e = io::Error::last_os_error();
    io::Error::new(e.kind(), format!("{what}: {e}"))
}

/// Checks what a destroy or free call returned. Such a call fails only when
/// the object is still in use (a bug here) or the device has gone; the
/// object then leaks, which is said rather than ignored. Whether it was
/// released.
fn released(rc: i32, what: &str) -> bool {
    if rc != 0 {
        let e = io::Error::from_raw_os_error(rc.abs());
        eprintln!("onekv: {what} failed ({e}); its resources leak");
    }
    rc == 0
}

/// An opened RDMA device and its port 1.
pub struct Device {
    ctx: *mut ibv_context,
    pub name: String,
    pub port: u8,
    pub lid: u16,
    /// Entries the GID tables of all its ports may hold (the table query
    /// returns every port's, and fails if they do not fit).
    gid_table_len: usize,
    pub mtu: ibv_mtu::Type,
    /// Outstanding RDMA READs/atomics per QP the device allows.
    pub max_rd_atomic: u8,
    pub atomic_cap: ibv_atomic_cap::Type,
    /// Whether it has type-2 memory windows (bound by a work request on
    /// one queue pair, usable only through it).
    pub memory_windows: bool,
}

// SAFETY: libibverbs' calls on a context are thread-safe; the struct's own
// fields are only read after `open`.
unsafe impl Send for Device {}
// SAFETY: as for Send: shared use only reads fields and calls thread-safe
// verbs on the context.
unsafe impl Sync for Device {}

/// The host's device list, freed when dropped: a device found in it is
/// usable (opened) only while the list lives.
struct DeviceList {
    list: *mut *mut ibv_device,
    len: usize,
}

impl DeviceList {
    fn get() -> io::Result<DeviceList> {
        let mut n = 0;
        // SAFETY: `n` is a valid out-parameter; the list returned is owned
        // by the DeviceList made of it, which frees it.
        let list = unsafe { ibv_get_device_list(&mut n) };
        if list.is_null() {
            return Err(os_error("ibv_get_device_list"));
        }
        Ok(DeviceList {
            list,
            len: n.max(0) as usize,
        })
    }

    /// The devices with their names; the pointers live as long as self.
    fn devices(&self) -> impl Iterator<Item = (*mut ibv_device, String)> + '_ {
        (0..self.len).map(|i| {
            // SAFETY: i < len entries of the live list.
            let dev = unsafe { *self.list.add(i) };
            // SAFETY: the device's name is NUL-terminated and lives as long
            // as the list; it is copied out here.
            let name = unsafe { CStr::from_ptr(ibv_get_device_name(dev)) }
                .to_string_lossy()
                .into_owned();
            (dev, name)
        })
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: returned by ibv_get_device_list and freed only here; an
        // opened context does not depend on it.
        unsafe { ibv_free_device_list(self.list) };
    }
}

impl Device {
    /// The names of this host's RDMA devices.
    pub fn names() -> io::Result<Vec<String>> {
        Ok(DeviceList::get()?.devices().map(|(_, name)| name).collect())
    }

    /// Opens the device named `name` (or the first one) and its port 1.
    pub fn open(name: Option<&str>) -> io::Result<Arc<Device>> {
        let list = DeviceList::get()?;
        let Some((dev, dev_name)) = list
            .devices()
            .find(|(_, dev_name)| name.is_none_or(|want| want == dev_name))
        else {
            let what = match name {
                Some(name) => format!("no RDMA device named {name:?}"),
                None => "no RDMA device found".to_string(),
            };
            return Err(io::Error::new(io::ErrorKind::NotFound, what));
        };
        // SAFETY: dev comes from the live list; the context outlives it.
        let ctx = unsafe { ibv_open_device(dev) };
        drop(list);
        if ctx.is_null() {
            return Err(os_error("ibv_open_device"));
        }
        let mut device = Device {
            ctx,
            name: dev_name,
            port: 1,
            lid: 0,
            gid_table_len: 0,
            mtu: ibv_mtu::IBV_MTU_1024,
            max_rd_atomic: 1,
            atomic_cap: ibv_atomic_cap::IBV_ATOMIC_NONE,
            memory_windows: false,
        };
        // SAFETY: plain-old-data out-parameters, zero is a valid start.
        let mut dattr: ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: a live context and an out-parameter of the right type.
        if unsafe { ibv_query_device(ctx, &mut dattr) } != 0 {
            return Err(os_error("ibv_query_device"));
        }
        device.max_rd_atomic = dattr.max_qp_rd_atom.clamp(1, 16) as u8;
        device.atomic_cap = dattr.atomic_cap;
        let type_2 = ibv_device_cap_flags::IBV_DEVICE_MEM_WINDOW_TYPE_2A.0
            | ibv_device_cap_flags::IBV_DEVICE_MEM_WINDOW_TYPE_2B.0;
        device.memory_windows = dattr.device_cap_flags & type_2 != 0 && dattr.max_mw > 0;
        // SAFETY: plain-old-data out-parameter, zero is a valid start.
        let mut pattr: ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: a live context and an out-parameter of the right type.
        if unsafe { ___ibv_query_port(ctx, device.port, &mut pattr) } != 0 {
            return Err(os_error("ibv_query_port"));
        }
        device.lid = pattr.lid;
        device.mtu = pattr.active_mtu;
        device.gid_table_len =
            pattr.gid_tbl_len.max(0) as usize * usize::from(dattr.phys_port_cnt.max(1));
        Ok(Arc::new(device))
    }

    /// The valid entries of port 1's GID table, in one query.
    pub fn gid_table(&self) -> io::Result<Vec<GidEntry>> {
        let len = self.gid_table_len.max(1);
        // SAFETY: zeroed entries are valid plain data; the call writes at
        // most `len` of them and returns how many.
        let mut raw: Vec<ibv_gid_entry> = (0..len).map(|_| unsafe { std::mem::zeroed() }).collect();
        // SAFETY: a live context, `len` writable entries of the size given.
        let n = unsafe {
            _ibv_query_gid_table(
                self.ctx,
                raw.as_mut_ptr(),
                len,
                0,
                std::mem::size_of::<ibv_gid_entry>(),
            )
        };
        if n < 0 {
            return Err(io::Error::from_raw_os_error((-n) as i32));
        }
        raw.truncate(n as usize);
        Ok(raw
            .iter()
            .filter(|e| u32::from(self.port) == e.port_num && e.gid_index <= u8::MAX.into())
            .map(|e| GidEntry {
                device: self.name.clone(),
                index: e.gid_index as u8,
                // SAFETY: both union views are 16 plain bytes.
                gid: unsafe { e.gid.raw },
                kind: match e.gid_type {
                    IBV_GID_TYPE_ROCE_V2 => GidKind::RoceV2,
                    _ => GidKind::IbOrRoceV1,
                },
            })
            .collect())
    }

    /// GID `index` of port 1.
    pub fn gid(&self, index: u8) -> io::Result<Gid> {
        // SAFETY: a plain-old-data out-parameter.
        let mut gid: ibv_gid = unsafe { std::mem::zeroed() };
        // SAFETY: a live context and an out-parameter of the right type.
        if unsafe { ibv_query_gid(self.ctx, self.port, index as i32, &mut gid) } != 0 {
            return Err(os_error(&format!(
                "ibv_query_gid {} port {} index {index}",
                self.name, self.port
            )));
        }
        Ok(Gid {
            index,
            // SAFETY: both union views are 16 plain bytes.
            raw: unsafe { gid.raw },
        })
    }
}

/// The source GID of a queue pair: its index in the port's table, and its
/// value (which the peer addresses).
#[derive(Debug, Clone, Copy)]
pub struct Gid {
    pub index: u8,
    pub raw: [u8; 16],
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: opened in `open`; everything using it holds an Arc to us.
        released(unsafe { ibv_close_device(self.ctx) }, "ibv_close_device");
    }
}

pub struct Pd {
    pd: *mut ibv_pd,
    pub device: Arc<Device>,
}

// SAFETY: a protection domain is used only through thread-safe verbs, and
// its pointer never changes after `new`.
unsafe impl Send for Pd {}
// SAFETY: as for Send.
unsafe impl Sync for Pd {}

impl Pd {
    pub fn new(device: Arc<Device>) -> io::Result<Arc<Pd>> {
        // SAFETY: the context is live while `device` is.
        let pd = unsafe { ibv_alloc_pd(device.ctx) };
        if pd.is_null() {
            return Err(os_error("ibv_alloc_pd"));
        }
        Ok(Arc::new(Pd { pd, device }))
    }
}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: allocated in `new`; every Mr and Qp using it holds an Arc
        // to it, so none is left.
        released(unsafe { ibv_dealloc_pd(self.pd) }, "ibv_dealloc_pd");
    }
}

enum Memory {
    Owned(Vec<u64>),
    /// Held so that the mapping outlives its registration.
    Region(#[allow(dead_code)] Arc<SharedRegion>),
}

/// Registered memory: a buffer this process owns, or the server's region.
pub struct Mr {
    mr: *mut ibv_mr,
    memory: Memory,
    _pd: Arc<Pd>,
}

// SAFETY: the registration and the memory it covers are owned by the Mr;
// its fields are only read after `register`.
unsafe impl Send for Mr {}
// SAFETY: as for Send; `bytes_mut` needs `&mut self`.
unsafe impl Sync for Mr {}

pub const LOCAL_ONLY: u32 = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
pub const REMOTE_READ: u32 = ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
pub const REMOTE_WRITE: u32 = ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
pub const REMOTE_ATOMIC: u32 = ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC.0;
/// Memory windows may be bound over the registration.
pub const MW_BIND: u32 = ibv_access_flags::IBV_ACCESS_MW_BIND.0;
pub const REMOTE_ALL: u32 = LOCAL_ONLY | REMOTE_READ | REMOTE_WRITE | REMOTE_ATOMIC;

impl Mr {
    /// A zeroed, 8-byte aligned buffer of `len` bytes, registered.
    pub fn alloc(pd: &Arc<Pd>, len: usize, access: u32) -> io::Result<Mr> {
        let mut words = vec![0u64; len.div_ceil(8).max(1)];
        let ptr = words.as_mut_ptr() as *mut std::ffi::c_void;
        Self::register(pd, ptr, words.len() * 8, access, Memory::Owned(words))
    }

    /// Registers the server's region mapping.
    pub fn region(pd: &Arc<Pd>, region: Arc<SharedRegion>, access: u32) -> io::Result<Mr> {
        let len = region.len();
        Self::range(pd, region, 0, len, access)
    }

    /// Registers `len` bytes of the server's region from `offset` (a
    /// lease's extent, over which its window is bound: on Soft-RoCE a
    /// window bounds accesses only by its registration's range).
    pub fn range(
        pd: &Arc<Pd>,
        region: Arc<SharedRegion>,
        offset: u64,
        len: u64,
        access: u32,
    ) -> io::Result<Mr> {
        let end = offset.checked_add(len).filter(|&e| e <= region.len());
        let (Some(_), Ok(at), Ok(len)) = (end, usize::try_from(offset), usize::try_from(len))
        else {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{len} bytes at {offset} outside a {}-byte region",
                    region.len()
                ),
            ));
        };
        // SAFETY: offset + len lies inside the mapping, checked above.
        let ptr = unsafe { region.as_mut_ptr().add(at) } as *mut std::ffi::c_void;
        Self::register(pd, ptr, len, access, Memory::Region(region))
    }

    fn register(
        pd: &Arc<Pd>,
        ptr: *mut std::ffi::c_void,
        len: usize,
        access: u32,
        memory: Memory,
    ) -> io::Result<Mr> {
        // SAFETY: ptr..ptr+len is owned by `memory`, which the Mr keeps.
        let mr = unsafe { ibv_reg_mr(pd.pd, ptr, len, access as i32) };
        if mr.is_null() {
            return Err(os_error("ibv_reg_mr"));
        }
        Ok(Mr {
            mr,
            memory,
            _pd: pd.clone(),
        })
    }

    pub fn addr(&self) -> u64 {
        // SAFETY: `mr` is the live registration this Mr owns.
        unsafe { (*self.mr).addr as u64 }
    }
    pub fn len(&self) -> usize {
        // SAFETY: `mr` is the live registration this Mr owns.
        unsafe { (*self.mr).length }
    }
    pub fn lkey(&self) -> u32 {
        // SAFETY: `mr` is the live registration this Mr owns.
        unsafe { (*self.mr).lkey }
    }
    pub fn rkey(&self) -> u32 {
        // SAFETY: `mr` is the live registration this Mr owns.
        unsafe { (*self.mr).rkey }
    }

    /// The bytes of an owned buffer (empty for the region). Only read them
    /// when no posted work request is writing into them.
    pub fn bytes(&self) -> &[u8] {
        match &self.memory {
            Memory::Owned(w) => as_bytes(w),
            Memory::Region(_) => &[],
        }
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        match &mut self.memory {
            Memory::Owned(w) => as_bytes_mut(w),
            Memory::Region(_) => &mut [],
        }
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: registered in `register`; its memory is still owned here
        // and dropped only after this.
        if !released(unsafe { ibv_dereg_mr(self.mr) }, "ibv_dereg_mr") {
            // Still registered: the device may reach the memory, which must
            // then never be freed or reused.
            std::mem::forget(std::mem::replace(
                &mut self.memory,
                Memory::Owned(Vec::new()),
            ));
        }
    }
}

/// A type-2 memory window: remote access to a range of a registration
/// (one with [`MW_BIND`]), granted by a bind posted on one queue pair and
/// usable only by that queue pair's peer, until it is invalidated or the
/// queue pair is gone.
pub struct Mw {
    mw: *mut ibv_mw,
    /// The registration it was last bound over: kept while the window may
    /// reach its memory (a registration is refused deregistration while a
    /// window is bound, and its memory must not be freed under it).
    parent: Option<Arc<Mr>>,
    _pd: Arc<Pd>,
}

// SAFETY: a window is used only through thread-safe verbs; its pointer
// never changes after `alloc`.
unsafe impl Send for Mw {}
// SAFETY: as for Send; binding needs `&mut self`.
unsafe impl Sync for Mw {}

impl Mw {
    pub fn alloc(pd: &Arc<Pd>) -> io::Result<Mw> {
        // SAFETY: a live protection domain.
        let mw = unsafe { ibv_alloc_mw(pd.pd, ibv_mw_type::IBV_MW_TYPE_2) };
        match mw {
            Some(mw) if !mw.is_null() => Ok(Mw {
                mw,
                parent: None,
                _pd: pd.clone(),
            }),
            Some(_) => Err(os_error("ibv_alloc_mw")),
            None => Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "the RDMA provider has no memory windows",
            )),
        }
    }
}

impl Drop for Mw {
    fn drop(&mut self) {
        // SAFETY: allocated in `alloc`; a window still bound is unbound by
        // its deallocation.
        if !released(unsafe { ibv_dealloc_mw(self.mw) }, "ibv_dealloc_mw") {
            // Possibly still bound: its registration stays.
            std::mem::forget(self.parent.take());
        }
    }
}

/// A completion, as much of it as the transport needs.
#[derive(Debug, Clone, Copy)]
pub struct Completion {
    pub wr_id: u64,
    pub status: u32,
    pub byte_len: u32,
}

impl Completion {
    pub fn ok(&self) -> bool {
        self.status == ibv_wc_status::IBV_WC_SUCCESS
    }

    pub fn status_text(&self) -> String {
        // SAFETY: returns a static string for any status.
        unsafe { CStr::from_ptr(ibv_wc_status_str(self.status)) }
            .to_string_lossy()
            .into_owned()
    }

    pub fn is_remote_access_error(&self) -> bool {
        self.status == ibv_wc_status::IBV_WC_REM_ACCESS_ERR
    }
    pub fn is_rnr(&self) -> bool {
        self.status == ibv_wc_status::IBV_WC_RNR_RETRY_EXC_ERR
    }
    pub fn is_retry_exceeded(&self) -> bool {
        self.status == ibv_wc_status::IBV_WC_RETRY_EXC_ERR
    }
    pub fn is_flushed(&self) -> bool {
        self.status == ibv_wc_status::IBV_WC_WR_FLUSH_ERR
    }
}

pub struct Cq {
    cq: *mut ibv_cq,
    channel: *mut ibv_comp_channel,
    _device: Arc<Device>,
}

// SAFETY: a completion queue and its channel are used only through
// thread-safe verbs, and their pointers never change after `new`.
unsafe impl Send for Cq {}
// SAFETY: as for Send.
unsafe impl Sync for Cq {}

/// How the completions of a queue are noticed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Completions {
    /// By polling the queue.
    Polled,
    /// Also by an event on a completion channel, which an event loop waits
    /// on.
    Signalled,
}

impl Cq {
    /// A completion queue of `entries` entries.
    pub fn new(
        device: &Arc<Device>,
        entries: i32,
        completions: Completions,
    ) -> io::Result<Arc<Cq>> {
        let channel = if completions == Completions::Signalled {
            // SAFETY: the context is live while `device` is.
            let ch = unsafe { ibv_create_comp_channel(device.ctx) };
            if ch.is_null() {
                return Err(os_error("ibv_create_comp_channel"));
            }
            // SAFETY: the channel's descriptor is valid while the channel is.
            // Non-blocking: an event loop consumes events without waiting.
            let nonblocking = unsafe {
                let fd = (*ch).fd;
                let flags = libc::fcntl(fd, libc::F_GETFL);
                flags >= 0 && libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) == 0
            };
            if !nonblocking {
                let e = os_error("fcntl on a completion channel");
                // SAFETY: created above; no queue uses it.
                released(
                    unsafe { ibv_destroy_comp_channel(ch) },
                    "ibv_destroy_comp_channel",
                );
                return Err(e);
            }
            ch
        } else {
            std::ptr::null_mut()
        };
        // SAFETY: a live context; `channel` is null or a live channel.
        let cq = unsafe { ibv_create_cq(device.ctx, entries, std::ptr::null_mut(), channel, 0) };
        if cq.is_null() {
            if !channel.is_null() {
                // SAFETY: created above; no queue uses it.
                released(
                    unsafe { ibv_destroy_comp_channel(channel) },
                    "ibv_destroy_comp_channel",
                );
            }
            return Err(os_error("ibv_create_cq"));
        }
        Ok(Arc::new(Cq {
            cq,
            channel,
            _device: device.clone(),
        }))
    }

    /// Takes up to `max` completions without waiting.
    pub fn poll(&self, out: &mut Vec<Completion>, max: usize) -> io::Result<usize> {
        // SAFETY: ibv_wc is plain data; poll fills at most `max` entries.
        let mut wcs: Vec<ibv_wc> = (0..max).map(|_| unsafe { std::mem::zeroed() }).collect();
        // SAFETY: a live queue and `max` writable entries.
        let n = unsafe { ibv_poll_cq(self.cq, max as i32, wcs.as_mut_ptr()) };
        if n < 0 {
            return Err(io::Error::other("ibv_poll_cq failed"));
        }
        out.extend(wcs[..n as usize].iter().map(|w| Completion {
            wr_id: w.wr_id,
            status: w.status,
            byte_len: w.byte_len,
        }));
        Ok(n as usize)
    }

    /// The file descriptor of this queue's event channel: readable once a
    /// completion arrived after [`Cq::arm`]. The channel is non-blocking.
    pub fn event_fd(&self) -> io::Result<RawFd> {
        if self.channel.is_null() {
            return Err(io::Error::other("completion queue has no event channel"));
        }
        // SAFETY: a live channel created by ibv_create_comp_channel.
        Ok(unsafe { (*self.channel).fd })
    }

    /// Asks for an event at the next completion. The caller polls the queue
    /// again after arming: a completion that arrived between its last poll
    /// and the arming raises no event.
    pub fn arm(&self) -> io::Result<()> {
        // SAFETY: a live completion queue.
        if unsafe { ibv_req_notify_cq(self.cq, 0) } != 0 {
            return Err(os_error("ibv_req_notify_cq"));
        }
        Ok(())
    }

    /// Consumes the pending event, if any (never blocks: the channel's
    /// descriptor is non-blocking), so the descriptor stops being readable.
    pub fn take_event(&self) {
        if self.channel.is_null() {
            return;
        }
        let mut cq = std::ptr::null_mut();
        let mut ctx = std::ptr::null_mut();
        // SAFETY: a live, non-blocking channel; an event names our cq.
        if unsafe { ibv_get_cq_event(self.channel, &mut cq, &mut ctx) } == 0 {
            // SAFETY: the event just taken names a live queue (ours).
            unsafe { ibv_ack_cq_events(cq, 1) };
        }
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: created in `new`; every queue pair using it holds an Arc
        // to it, so none is left.
        released(unsafe { ibv_destroy_cq(self.cq) }, "ibv_destroy_cq");
        if !self.channel.is_null() {
            // SAFETY: created in `new`; its queue was destroyed just above.
            released(
                unsafe { ibv_destroy_comp_channel(self.channel) },
                "ibv_destroy_comp_channel",
            );
        }
    }
}

/// What the peer needs to connect its queue pair to ours.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct Endpoint {
    pub qpn: u32,
    pub psn: u32,
    pub lid: u16,
    pub gid: [u8; 16],
}

pub enum Op {
    Read {
        remote_addr: u64,
        rkey: u32,
    },
    Write {
        remote_addr: u64,
        rkey: u32,
    },
    Cas {
        remote_addr: u64,
        rkey: u32,
        expect: u64,
        swap: u64,
    },
    FetchAdd {
        remote_addr: u64,
        rkey: u32,
        add: u64,
    },
    Send,
}

/// One work request over one local scatter/gather element.
pub struct SendWr {
    pub wr_id: u64,
    pub op: Op,
    pub local_addr: u64,
    pub len: u32,
    pub lkey: u32,
}

/// A reliable-connected queue pair.
pub struct Qp {
    qp: *mut ibv_qp,
    pd: Arc<Pd>,
    pub send_cq: Arc<Cq>,
    pub recv_cq: Arc<Cq>,
    psn: u32,
    /// Where this queue pair's packets come from.
    source: Gid,
}

// SAFETY: a queue pair is used only through thread-safe verbs (posting,
// modifying), and its pointer never changes after `new`.
unsafe impl Send for Qp {}
// SAFETY: as for Send.
unsafe impl Sync for Qp {}

/// How many work requests a queue pair's send and receive queues hold.
#[derive(Debug, Clone, Copy)]
pub struct QueueDepths {
    pub send: u32,
    pub recv: u32,
}

impl Qp {
    pub fn new(
        pd: &Arc<Pd>,
        send_cq: Arc<Cq>,
        recv_cq: Arc<Cq>,
        depths: QueueDepths,
        source: Gid,
    ) -> io::Result<Qp> {
        // SAFETY: zeroed init attributes, then the fields RC needs.
        let mut init: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = send_cq.cq;
        init.recv_cq = recv_cq.cq;
        init.cap.max_send_wr = depths.send;
        init.cap.max_recv_wr = depths.recv;
        init.cap.max_send_sge = 1;
        init.cap.max_recv_sge = 1;
        init.qp_type = ibv_qp_type::IBV_QPT_RC;
        // SAFETY: a live protection domain and queues, and filled attributes.
        let qp = unsafe { ibv_create_qp(pd.pd, &mut init) };
        if qp.is_null() {
            return Err(os_error("ibv_create_qp"));
        }
        // Random, so that nobody off the path can inject packets into the
        // connection by guessing where its sequence starts (24 bits).
        let psn = (crate::random::u64() & 0xff_ffff) as u32;
        let qp = Qp {
            qp,
            pd: pd.clone(),
            send_cq,
            recv_cq,
            psn,
            source,
        };
        qp.init()?;
        Ok(qp)
    }

    pub fn endpoint(&self) -> Endpoint {
        let d = &self.pd.device;
        Endpoint {
            // SAFETY: `qp` is the live queue pair this Qp owns.
            qpn: unsafe { (*self.qp).qp_num },
            psn: self.psn,
            lid: d.lid,
            gid: self.source.raw,
        }
    }

    fn modify(&self, attr: &mut ibv_qp_attr, mask: ibv_qp_attr_mask, what: &str) -> io::Result<()> {
        // SAFETY: attr is fully initialised for the fields `mask` names.
        let rc = unsafe { ibv_modify_qp(self.qp, attr, mask.0 as i32) };
        if rc != 0 {
            let e = io::Error::from_raw_os_error(rc);
            return Err(io::Error::new(
                e.kind(),
                format!("ibv_modify_qp to {what}: {e}"),
            ));
        }
        Ok(())
    }

    /// RESET → INIT: from here on receives may be posted (a queue pair in
    /// RESET refuses them).
    fn init(&self) -> io::Result<()> {
        let d = &self.pd.device;
        // SAFETY: zeroed attributes, then the fields the mask names.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_INIT;
        a.pkey_index = 0;
        a.port_num = d.port;
        a.qp_access_flags = REMOTE_ALL;
        self.modify(
            &mut a,
            ibv_qp_attr_mask::IBV_QP_STATE
                | ibv_qp_attr_mask::IBV_QP_PKEY_INDEX
                | ibv_qp_attr_mask::IBV_QP_PORT
                | ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS,
            "INIT",
        )
    }

    /// INIT → RTR → RTS, connected to `remote`.
    pub fn connect(&self, remote: &Endpoint) -> io::Result<()> {
        let d = &self.pd.device;
        // SAFETY: ibv_qp_attr is plain data; zero is a valid start.
        let zeroed = || -> ibv_qp_attr { unsafe { std::mem::zeroed() } };

        let mut a = zeroed();
        a.qp_state = ibv_qp_state::IBV_QPS_RTR;
        a.path_mtu = d.mtu;
        a.dest_qp_num = remote.qpn;
        a.rq_psn = remote.psn;
        a.max_dest_rd_atomic = d.max_rd_atomic;
        // 12 = 0.64 ms: how long the peer waits before retrying a Send that
        // found no receive posted (RNR NAK).
        a.min_rnr_timer = 12;
        a.ah_attr.is_global = 1;
        a.ah_attr.dlid = remote.lid;
        a.ah_attr.port_num = d.port;
        a.ah_attr.grh.dgid = ibv_gid { raw: remote.gid };
        a.ah_attr.grh.sgid_index = self.source.index;
        a.ah_attr.grh.hop_limit = 64;
        self.modify(
            &mut a,
            ibv_qp_attr_mask::IBV_QP_STATE
                | ibv_qp_attr_mask::IBV_QP_AV
                | ibv_qp_attr_mask::IBV_QP_PATH_MTU
                | ibv_qp_attr_mask::IBV_QP_DEST_QPN
                | ibv_qp_attr_mask::IBV_QP_RQ_PSN
                | ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC
                | ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER,
            "RTR",
        )?;

        let mut a = zeroed();
        a.qp_state = ibv_qp_state::IBV_QPS_RTS;
        a.timeout = 14; // 4.096 us * 2^14 = 67 ms per transport retry
        a.retry_cnt = 7;
        // 7 = retry forever on RNR. Every control message has a receive
        // posted before the peer can send it (strict request/reply), so an
        // RNR can only be the short race of a receive being reposted; a dead
        // peer is caught by the transport retry count above instead.
        a.rnr_retry = 7;
        a.sq_psn = self.psn;
        a.max_rd_atomic = d.max_rd_atomic;
        self.modify(
            &mut a,
            ibv_qp_attr_mask::IBV_QP_STATE
                | ibv_qp_attr_mask::IBV_QP_TIMEOUT
                | ibv_qp_attr_mask::IBV_QP_RETRY_CNT
                | ibv_qp_attr_mask::IBV_QP_RNR_RETRY
                | ibv_qp_attr_mask::IBV_QP_SQ_PSN
                | ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC,
            "RTS",
        )
    }

    /// Moves the queue pair to the error state: the peer's verbs on it fail
    /// from now on (how a server cuts off a departed client).
    pub fn set_error(&self) -> io::Result<()> {
        // SAFETY: zeroed attributes, then the state the mask names.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_ERR;
        self.modify(&mut a, ibv_qp_attr_mask::IBV_QP_STATE, "ERR")
    }

    /// Posts the work requests as one linked list: one doorbell. Every one
    /// is signalled, so each produces a completion.
    pub fn post_send(&self, wrs: &[SendWr]) -> io::Result<()> {
        if wrs.is_empty() {
            return Ok(());
        }
        let mut sges: Vec<ibv_sge> = wrs
            .iter()
            .map(|w| ibv_sge {
                addr: w.local_addr,
                length: w.len,
                lkey: w.lkey,
            })
            .collect();
        // SAFETY: zeroed work requests, then filled; sges and the list live
        // until ibv_post_send returns (the device copies what it needs).
        let mut list: Vec<ibv_send_wr> = (0..wrs.len())
            .map(|_| unsafe { std::mem::zeroed() })
            .collect();
        for (i, w) in wrs.iter().enumerate() {
            let wr = &mut list[i];
            wr.wr_id = w.wr_id;
            wr.sg_list = &mut sges[i];
            wr.num_sge = 1;
            wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
            match w.op {
                Op::Read { remote_addr, rkey } => {
                    wr.opcode = ibv_wr_opcode::IBV_WR_RDMA_READ;
                    wr.wr.rdma = rdma_t { remote_addr, rkey };
                }
                Op::Write { remote_addr, rkey } => {
                    wr.opcode = ibv_wr_opcode::IBV_WR_RDMA_WRITE;
                    wr.wr.rdma = rdma_t { remote_addr, rkey };
                }
                Op::Cas {
                    remote_addr,
                    rkey,
                    expect,
                    swap,
                } => {
                    wr.opcode = ibv_wr_opcode::IBV_WR_ATOMIC_CMP_AND_SWP;
                    wr.wr.atomic = atomic_t {
                        remote_addr,
                        compare_add: expect,
                        swap,
                        rkey,
                    };
                }
                Op::FetchAdd {
                    remote_addr,
                    rkey,
                    add,
                } => {
                    wr.opcode = ibv_wr_opcode::IBV_WR_ATOMIC_FETCH_AND_ADD;
                    wr.wr.atomic = atomic_t {
                        remote_addr,
                        compare_add: add,
                        swap: 0,
                        rkey,
                    };
                }
                Op::Send => wr.opcode = ibv_wr_opcode::IBV_WR_SEND,
            }
        }
        for i in 0..list.len() - 1 {
            let next: *mut ibv_send_wr = &mut list[i + 1];
            list[i].next = next;
        }
        let mut bad = std::ptr::null_mut();
        // SAFETY: a live queue pair and a linked list whose entries and
        // scatter/gather elements live until the call returns. The memory
        // the elements name must stay registered until the completions:
        // the transport keeps its buffers' Mr for the connection's life.
        let rc = unsafe { ibv_post_send(self.qp, list.as_mut_ptr(), &mut bad) };
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
        Ok(())
    }

    /// Posts one receive of `len` bytes at `offset` in `mr`.
    pub fn post_recv(&self, wr_id: u64, mr: &Mr, offset: usize, len: usize) -> io::Result<()> {
        if offset.checked_add(len).is_none_or(|end| end > mr.len()) || len > u32::MAX as usize {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "receive of {offset}+{len} outside a {}-byte buffer",
                    mr.len()
                ),
            ));
        }
        let mut sge = ibv_sge {
            addr: mr.addr() + offset as u64,
            length: len as u32,
            lkey: mr.lkey(),
        };
        let mut wr = ibv_recv_wr {
            wr_id,
            next: std::ptr::null_mut(),
            sg_list: &mut sge,
            num_sge: 1,
        };
        let mut bad = std::ptr::null_mut();
        // SAFETY: the range lies in `mr` (checked above), which outlives the
        // queue pair's use of it.
        let rc = unsafe { ibv_post_recv(self.qp, &mut wr, &mut bad) };
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
        Ok(())
    }
}

/// Memory windows, bound and invalidated through a queue pair's send queue.
impl Qp {
    /// Binds `mw` over `range` (byte offsets) of `mr` for this queue
    /// pair's peer, with `access` (remote flags), under a key whose low
    /// byte is fresh and random: a peer that knew the window's last key
    /// cannot use it. Its completion carries the new key as its id; the
    /// window serves from then on. Returns the new key. A bind that
    /// completes in error leaves the window unusable: deallocate it.
    pub fn bind(
        &self,
        mw: &mut Mw,
        mr: &Arc<Mr>,
        range: std::ops::Range<u64>,
        access: u32,
    ) -> io::Result<u32> {
        if range.start > range.end || range.end > mr.len() as u64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "window of {range:?} outside a {}-byte registration",
                    mr.len()
                ),
            ));
        }
        // SAFETY: the window this Mw owns; only binds (which take it
        // `&mut`) change its key.
        let current = unsafe { (*mw.mw).rkey };
        let mut key = (crate::random::u64() & 0xff) as u32;
        if key == current & 0xff {
            key ^= 1;
        }
        let rkey = (current & !0xff) | key;
        // SAFETY: a zeroed work request, then the fields a bind reads.
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = u64::from(rkey);
        wr.opcode = ibv_wr_opcode::IBV_WR_BIND_MW;
        wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
        wr.bind_mw_tso_union.bind_mw = bind_mw_t {
            mw: mw.mw,
            rkey,
            bind_info: ibv_mw_bind_info {
                mr: mr.mr,
                addr: mr.addr() + range.start,
                length: range.end - range.start,
                mw_access_flags: access,
            },
        };
        self.post_one(&mut wr)?;
        mw.parent = Some(mr.clone());
        // The provider names the window by the key it holds now in the next
        // bind (and refuses the key it was allocated with once rebound).
        // SAFETY: as above; read by the provider only while posting.
        unsafe { (*mw.mw).rkey = rkey };
        Ok(rkey)
    }

    /// Invalidates the window of key `rkey` bound on this queue pair: from
    /// its completion (whose id is `rkey`) on, the peer's accesses through
    /// it fail.
    pub fn invalidate(&self, rkey: u32) -> io::Result<()> {
        // SAFETY: a zeroed work request, then the fields an invalidate reads.
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = u64::from(rkey);
        wr.opcode = ibv_wr_opcode::IBV_WR_LOCAL_INV;
        wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
        wr.imm_data_invalidated_rkey_union.invalidated_rkey = rkey;
        self.post_one(&mut wr)
    }

    fn post_one(&self, wr: &mut ibv_send_wr) -> io::Result<()> {
        let mut bad = std::ptr::null_mut();
        // SAFETY: a live queue pair and one work request with no local
        // memory; the window and registration it names outlive the call.
        // Afterwards a bound window holds its registration (`Mw::parent`),
        // and a registration that cannot be deregistered leaks its memory.
        let rc = unsafe { ibv_post_send(self.qp, wr, &mut bad) };
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
        Ok(())
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: created in `new`; destroyed once, before the queues and
        // the protection domain it holds Arcs to.
        released(unsafe { ibv_destroy_qp(self.qp) }, "ibv_destroy_qp");
    }
}
