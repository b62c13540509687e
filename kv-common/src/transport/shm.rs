//! The shared-memory backend: the region is a file mapped by the server and
//! by every client; verbs are word-wise atomic copies and CPU atomics on the
//! mapping; the control channel is a Unix-domain socket beside the file.
//!
//! Accesses to the mapping never form data races in Rust's memory model:
//! every word is an `AtomicU64`, read and written whole (see `words`). A
//! WRITE is a Release fence followed by relaxed stores, a READ word loads
//! followed by an Acquire fence, and CAS/FETCH-AND-ADD are SeqCst
//! read-modify-writes. So a block written before the CAS that publishes its
//! slot is visible to any reader that saw the slot. (DESIGN.md has READs as
//! relaxed atomic loads; on x86-64 with AVX they are aligned 16-byte loads,
//! which read each word just as whole with half the instructions.)
//!
//! Speed: a READ is a copy out of memory, so what it costs is cache and TLB
//! misses. A batch's READs (16 verbs at a time) fetch all their cache lines
//! at once before any copy, and the server backs the region with huge pages
//! where the kernel can, in mappings aligned to take them whole.
//!
//! Access keys: each admitted client gets a word of the region's key table
//! holding a key of its own, and every batch checks that word first (as a NIC
//! checks the rkey and the queue pair's state). Fencing a client zeroes its
//! word; registering the region zeroes them all, so clients of an earlier
//! server are cut off before the new one looks at the index.

use std::fs::{File, OpenOptions};
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::words::{compare_and_swap, fetch_and_add, load_words, prefetch_lines, store_words};
use super::{
    frame_call, write_frame, ConnectOptions, Connection, ControlListener, ControlPeer, Fenced,
    FrameReader, ReadOrder, Received, RemoteRegion, TransportError, Verb, VerbStats,
};
use crate::layout::{KEY_TABLE_ENTRIES, KEY_TABLE_OFFSET};
use crate::protocol::{Request, Response};
use crate::Address;

/// A mapped region file, accessed only through atomics. The server's
/// mapping can grow in place: it reserves address space for the largest
/// size the region may reach and maps the file into its start, so the
/// region's address (which an RDMA registration names) never changes.
pub struct SharedRegion {
    base: *mut u8,
    /// Bytes mapped (and of the file); only grows.
    len: AtomicU64,
    /// Bytes of address space reserved at `base`.
    reserved: u64,
    /// The reservation as made, to unmap it: `base` is its first huge-page
    /// boundary.
    reservation: (*mut libc::c_void, usize),
    file: File,
    path: PathBuf,
    /// One growth at a time.
    growing: Mutex<()>,
}

// SAFETY: the mapping is only touched through `&[AtomicU64]`, which is Sync,
// and it stays mapped (never moves) for as long as the value lives.
unsafe impl Send for SharedRegion {}
// SAFETY: as for Send.
unsafe impl Sync for SharedRegion {}

impl SharedRegion {
    /// Maps an open region file (the server creates, locks and sizes it),
    /// with room to grow in place up to `max_len` bytes.
    pub fn from_file(file: &File, path: &Path, max_len: u64) -> std::io::Result<Self> {
        Self::map(file.try_clone()?, path, max_len)
    }

    pub fn open(path: &Path) -> std::io::Result<Self> {
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        Self::map(file, path, 0)
    }

    /// A client's mapping of the region file at `path`, at least `min_len`
    /// bytes long: one per process and file, shared by its connections, so
    /// that each page is faulted in once per process rather than once per
    /// connection. A longer file (the region grew) or another file at the
    /// same path (a new region) gets a new mapping.
    pub fn for_client(path: &Path, min_len: u64) -> std::io::Result<Arc<Self>> {
        static MAPPINGS: Mutex<Vec<std::sync::Weak<SharedRegion>>> = Mutex::new(Vec::new());
        use std::os::unix::fs::MetadataExt;
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        let meta = file.metadata()?;
        let mut mappings = MAPPINGS.lock().unwrap_or_else(|e| e.into_inner());
        mappings.retain(|m| m.strong_count() > 0);
        let same = |r: &SharedRegion| {
            r.file
                .metadata()
                .is_ok_and(|m| (m.dev(), m.ino()) == (meta.dev(), meta.ino()))
        };
        let found = mappings
            .iter()
            .filter_map(std::sync::Weak::upgrade)
            .find(|r| r.len() >= min_len && same(r));
        if let Some(region) = found {
            return Ok(region);
        }
        let region = Arc::new(Self::map(file, path, 0)?);
        mappings.push(Arc::downgrade(&region));
        Ok(region)
    }

    fn map(file: File, path: &Path, max_len: u64) -> std::io::Result<Self> {
        let len = file.metadata()?.len();
        if len < 4096 || len % 8 != 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("{}: {len} bytes cannot be a onekv region", path.display()),
            ));
        }
        let reserved = max_len.max(len).next_multiple_of(4096);
        let too_big = || std::io::Error::other(format!("{reserved} bytes cannot be mapped"));
        // One huge page more than needed, so that the mapping can start on
        // a huge-page boundary: only then can the kernel map the file's huge
        // pages whole (one TLB entry per 2 MiB instead of 512).
        let reserved_len = usize::try_from(reserved)
            .ok()
            .and_then(|r| r.checked_add(HUGE_PAGE))
            .ok_or_else(too_big)?;
        // SAFETY: a fresh anonymous reservation; nothing else refers to it.
        let reservation = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                reserved_len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if reservation == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let skip = (reservation as usize).next_multiple_of(HUGE_PAGE) - reservation as usize;
        let region = SharedRegion {
            // SAFETY: `skip` < HUGE_PAGE, inside the reservation.
            base: unsafe { (reservation as *mut u8).add(skip) },
            len: AtomicU64::new(0),
            reserved,
            reservation: (reservation, reserved_len),
            file,
            path: path.to_path_buf(),
            growing: Mutex::new(()),
        };
        region.map_part(0, len)?;
        region.len.store(len, Ordering::Release);
        Ok(region)
    }

    /// Maps file bytes `[from, to)` over the reservation at the same offsets.
    fn map_part(&self, from: u64, to: u64) -> std::io::Result<()> {
        // SAFETY: [base+from, base+to) lies inside our reservation (checked
        // by the callers against `reserved`), which MAP_FIXED replaces.
        let p = unsafe {
            libc::mmap(
                self.base.add(from as usize) as *mut libc::c_void,
                (to - from) as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                self.file.as_raw_fd(),
                from as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// Grows the file to `new_len` bytes (allocating them, so a full file
    /// system fails here rather than with SIGBUS later) and maps the new
    /// part in place. Readers see the new length only once it is mapped.
    /// The new part keeps small pages: collapsing it would copy it while
    /// clients are served, and a restart that collapsed grown parts would
    /// keep clients waiting (see `make_huge`).
    pub fn grow(&self, new_len: u64) -> std::io::Result<()> {
        let _one = self
            .growing
            .lock()
            .map_err(|_| std::io::Error::other("poisoned"))?;
        let len = self.len();
        if new_len <= len {
            return Ok(());
        }
        if new_len > self.reserved || !new_len.is_multiple_of(4096) {
            return Err(std::io::Error::other(format!(
                "cannot grow to {new_len} bytes: at most {} (page multiples)",
                self.reserved
            )));
        }
        // SAFETY: posix_fallocate on a descriptor we own.
        let rc = unsafe {
            libc::posix_fallocate(
                self.file.as_raw_fd(),
                len as libc::off_t,
                (new_len - len) as libc::off_t,
            )
        };
        if rc != 0 {
            return Err(std::io::Error::from_raw_os_error(rc));
        }
        self.map_part(len, new_len)?;
        self.len.store(new_len, Ordering::Release);
        Ok(())
    }

    /// Asks the kernel to back the whole huge pages of file bytes
    /// `[from, to)` with huge pages (MADV_COLLAPSE, Linux ≥ 6.1), which cuts
    /// a TLB miss on every random access to a large region. It works on
    /// tmpfs whatever its `huge=` option (unless `shmem_enabled` is
    /// `deny`); where it cannot, the region keeps small pages, which is
    /// only slower. It copies the bytes (0.4 s to several seconds per GiB,
    /// depending on how much memory the kernel must compact), so the server
    /// calls it once, on a region it has just created, before any client
    /// or device sees it; clients map the same huge pages.
    pub fn make_huge(&self, from: u64, to: u64) -> std::io::Result<()> {
        let huge = HUGE_PAGE as u64;
        let (start, end) = (
            from.next_multiple_of(huge),
            to.min(self.len()) / huge * huge,
        );
        if start >= end {
            return Ok(());
        }
        // SAFETY: advice on mapped bytes of our own mapping; MADV_COLLAPSE
        // keeps their contents.
        let rc = unsafe {
            libc::madvise(
                self.base.add(start as usize) as *mut libc::c_void,
                (end - start) as usize,
                libc::MADV_COLLAPSE,
            )
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// Largest size this mapping can grow to.
    pub fn max_len(&self) -> u64 {
        self.reserved
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn len(&self) -> u64 {
        self.len.load(Ordering::Acquire)
    }

    /// Start of the mapping, for registering it with an RDMA device.
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.base
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The words covering `[offset, offset + len)`, or why that range is not
    /// accessible (the checks a NIC does against a memory region).
    pub fn span(&self, offset: u64, len: usize) -> Result<&[AtomicU64], TransportError> {
        if let Some(words) = self.span_within(offset, len, u64::MAX) {
            return Ok(words);
        }
        Err(if !offset.is_multiple_of(8) || !len.is_multiple_of(8) {
            TransportError::RemoteAccess(format!(
                "offset {offset} length {len}: shm verbs need 8-byte alignment"
            ))
        } else {
            TransportError::RemoteAccess(format!(
                "range {offset}+{len} outside the {}-byte region",
                self.len()
            ))
        })
    }

    /// The words covering `[offset, offset + len)` if that range is
    /// aligned and ends within both `limit` and the mapping: `span` without
    /// its messages, for the data path.
    #[inline]
    fn span_within(&self, offset: u64, len: usize, limit: u64) -> Option<&[AtomicU64]> {
        let limit = limit.min(self.len());
        let aligned = (offset | len as u64).is_multiple_of(8);
        let inside = (len as u64) <= limit && offset <= limit - len as u64;
        (aligned && inside).then(|| {
            // SAFETY: the range is 8-byte aligned (and so is `base`, a
            // mapping's start) and lies within the first `len()` bytes,
            // which are mapped before that length is published and stay
            // mapped for as long as self lives; they are only ever accessed
            // atomically, by this and every other process.
            unsafe {
                std::slice::from_raw_parts(
                    self.base.add(offset as usize) as *const AtomicU64,
                    len / 8,
                )
            }
        })
    }

    pub fn load(&self, offset: u64) -> Result<u64, TransportError> {
        Ok(self.span(offset, 8)?[0].load(Ordering::Acquire))
    }

    pub fn store(&self, offset: u64, value: u64) -> Result<(), TransportError> {
        self.span(offset, 8)?[0].store(value, Ordering::Release);
        Ok(())
    }

    pub fn read(&self, offset: u64, dst: &mut [u64]) -> Result<(), TransportError> {
        let src = self.span(offset, dst.len() * 8)?;
        prefetch_lines(src);
        load_words(src, dst);
        Ok(())
    }

    /// Starts fetching `[offset, offset + len)` into the cache, so that
    /// the READs of one batch wait for their misses together rather than
    /// one READ after another. Nothing for a range it cannot access.
    pub fn prefetch(&self, offset: u64, len: usize) {
        let Some(len) = len.checked_next_multiple_of(8) else {
            return;
        };
        if let Ok(words) = self.span(offset & !7, len) {
            prefetch_lines(words);
        }
    }

    pub fn write(&self, offset: u64, src: &[u64]) -> Result<(), TransportError> {
        store_words(src, self.span(offset, src.len() * 8)?);
        Ok(())
    }

    /// Returns the old value; the swap happened iff it equals `expect`.
    pub fn cas(&self, offset: u64, expect: u64, swap: u64) -> Result<u64, TransportError> {
        Ok(compare_and_swap(&self.span(offset, 8)?[0], expect, swap))
    }

    pub fn fetch_add(&self, offset: u64, add: u64) -> Result<u64, TransportError> {
        Ok(fetch_and_add(&self.span(offset, 8)?[0], add))
    }

    /// Writes dirty pages back to the file (meaningful for on-disk regions).
    pub fn flush(&self) -> std::io::Result<()> {
        // SAFETY: msync of the mapped part of our own mapping.
        let rc = unsafe {
            libc::msync(
                self.base as *mut libc::c_void,
                self.len() as usize,
                libc::MS_SYNC,
            )
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }
}

impl Drop for SharedRegion {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the reservation made in `map`; nothing
        // borrowed from it outlives self.
        unsafe {
            libc::munmap(self.reservation.0, self.reservation.1);
        }
    }
}

/// The huge-page size a mapping is aligned to (x86-64's and arm64's PMD).
const HUGE_PAGE: usize = 2 << 20;

/// A client connection over shm.
pub struct ShmConnection {
    stream: UnixStream,
    region_path: PathBuf,
    region: Option<(Arc<SharedRegion>, RemoteRegion)>,
    local: Vec<u64>,
    stats: VerbStats,
    /// Set once the control stream failed: a reply may still be in flight,
    /// so the stream is never used again (the client reconnects).
    broken: Option<String>,
    reply_timeout: Duration,
    read_order: ReadOrder,
}

impl ShmConnection {
    pub fn connect(region_path: &Path, options: &ConnectOptions) -> Result<Self, TransportError> {
        let reply_timeout = options.reply_timeout;
        let socket = Address::shm_socket(region_path);
        let stream =
            UnixStream::connect(&socket).map_err(|source| TransportError::Unreachable {
                address: format!(
                    "shm://{} (socket {})",
                    region_path.display(),
                    socket.display()
                ),
                source,
            })?;
        stream.set_read_timeout(Some(reply_timeout))?;
        stream.set_write_timeout(Some(reply_timeout))?;
        Ok(ShmConnection {
            stream,
            region_path: region_path.to_path_buf(),
            region: None,
            local: Vec::new(),
            stats: VerbStats::default(),
            broken: None,
            reply_timeout,
            read_order: options.read_order,
        })
    }
}

/// A local buffer's bytes.
fn as_bytes(words: &[u64]) -> &[u8] {
    // SAFETY: any u64 slice is a valid, aligned u8 slice of 8× the length.
    unsafe { std::slice::from_raw_parts(words.as_ptr() as *const u8, words.len() * 8) }
}

/// A local buffer's bytes, to write.
fn as_bytes_mut(words: &mut [u64]) -> &mut [u8] {
    // SAFETY: as in `as_bytes`; every byte pattern is a valid u64.
    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr() as *mut u8, words.len() * 8) }
}

/// The words of a local buffer covering `[at, at + len)`.
fn local_words(local: &mut [u64], at: usize, len: usize) -> Result<&mut [u64], TransportError> {
    let local_len = local.len() * 8;
    if !at.is_multiple_of(8)
        || !len.is_multiple_of(8)
        || at.checked_add(len).is_none_or(|e| e > local_len)
    {
        return Err(TransportError::LocalAccess(format!(
            "local range {at}+{len} outside the {local_len}-byte buffer or unaligned"
        )));
    }
    Ok(&mut local[at / 8..(at + len) / 8])
}

impl Connection for ShmConnection {
    fn call(&mut self, request: &Request) -> Result<Response, TransportError> {
        if let Some(why) = &self.broken {
            return Err(TransportError::Disconnected(why.clone()));
        }
        match frame_call(&mut self.stream, request) {
            Ok(reply) => Ok(reply),
            Err(TransportError::Io(e)) => {
                // A reset, a closed socket or a reply that never came: this
                // stream is gone, whatever the server's state.
                let why = match e.kind() {
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                        format!("no reply within {:?}", self.reply_timeout)
                    }
                    _ => format!("control socket: {e}"),
                };
                self.broken = Some(why.clone());
                Err(TransportError::Disconnected(why))
            }
            Err(e) => {
                if matches!(e, TransportError::Disconnected(_)) {
                    self.broken = Some(e.to_string());
                }
                Err(e)
            }
        }
    }

    fn set_reply_timeout(&mut self, limit: Duration) -> Result<(), TransportError> {
        // A zero timeout means "none" to the socket: wait at least 1 ms.
        let limit = limit.max(Duration::from_millis(1));
        self.stream.set_read_timeout(Some(limit))?;
        self.stream.set_write_timeout(Some(limit))?;
        self.reply_timeout = limit;
        Ok(())
    }

    fn attach(&mut self, remote: &RemoteRegion, local_len: usize) -> Result<(), TransportError> {
        let region = SharedRegion::for_client(&self.region_path, remote.len)?;
        if region.len() < remote.len {
            return Err(TransportError::RemoteAccess(format!(
                "{} is {} bytes, the server registered {}",
                self.region_path.display(),
                region.len(),
                remote.len
            )));
        }
        self.region = Some((region, *remote));
        self.local = vec![0u64; local_len.div_ceil(8)];
        Ok(())
    }

    fn local(&self) -> &[u8] {
        as_bytes(&self.local)
    }

    fn local_mut(&mut self) -> &mut [u8] {
        as_bytes_mut(&mut self.local)
    }

    fn post(&mut self, verbs: &[Verb]) -> Result<(), TransportError> {
        let Some((region, remote)) = &self.region else {
            return Err(TransportError::NotAttached);
        };
        execute(region, remote, self.read_order, &mut self.local, verbs)?;
        self.stats.record_batch(verbs, as_bytes(&self.local));
        Ok(())
    }

    fn stats(&self) -> &VerbStats {
        &self.stats
    }

    fn batches_cost_round_trips(&self) -> bool {
        false
    }
}

/// Executes a batch as a NIC would: the access key first, then each verb
/// in turn, each checked against the registered range before it runs.
fn execute(
    region: &SharedRegion,
    remote: &RemoteRegion,
    read_order: ReadOrder,
    local: &mut [u64],
    verbs: &[Verb],
) -> Result<(), TransportError> {
    if verbs.len() > super::MAX_BATCH_VERBS {
        return Err(TransportError::LocalAccess(format!(
            "batch of {} verbs exceeds {}",
            verbs.len(),
            super::MAX_BATCH_VERBS
        )));
    }
    // As a NIC checks the rkey and the queue pair's state: a client the
    // server cut off, or one of an earlier registration, is refused.
    let key = region.span_within(key_word(remote.key_slot)?, 8, u64::MAX);
    if key.is_none_or(|word| word[0].load(Ordering::Acquire) != remote.rkey as u64) {
        return Err(TransportError::RemoteAccess(format!(
            "rkey {:#x} is not registered (the server restarted, shut down or cut this client off)",
            remote.rkey
        )));
    }
    match read_order {
        // The data path: nothing to do between verbs.
        ReadOrder::Posted => run_verbs(region, remote, local, verbs, |_| {}),
        ReadOrder::Reversed { .. } => {
            let mut reads = 0;
            let pause = |verb: &Verb| {
                if let Some(pause) = read_order.pause_before(verb, reads) {
                    std::thread::sleep(pause);
                }
                reads += usize::from(matches!(verb, Verb::Read { .. }));
            };
            run_verbs(region, remote, local, &read_order.arrange(verbs), pause)
        }
    }
}

/// Runs the verbs of a batch in order, `before` each one. A chunk's verbs
/// are all checked against the registered range (and their words found)
/// before any of them runs; a verb out of range fails the batch where it
/// stands, those before it having run, as on a NIC.
#[inline]
fn run_verbs(
    region: &SharedRegion,
    remote: &RemoteRegion,
    local: &mut [u64],
    verbs: &[Verb],
    mut before: impl FnMut(&Verb),
) -> Result<(), TransportError> {
    for chunk in verbs.chunks(PREFETCH_VERBS) {
        // Every verb is checked first and the lines the READs need are all
        // asked for, so that the first copy waits for one round of misses.
        let mut spans = [const { MaybeUninit::<&[AtomicU64]>::uninit() }; PREFETCH_VERBS];
        let mut refused = None;
        let mut checked = 0;
        for (verb, span) in chunk.iter().zip(&mut spans) {
            match verb_span(region, remote, verb) {
                Ok(words) => {
                    if matches!(verb, Verb::Read { .. }) {
                        prefetch_lines(words);
                    }
                    span.write(words);
                    checked += 1;
                }
                Err(e) => {
                    refused = Some(e);
                    break;
                }
            }
        }
        for (verb, span) in chunk[..checked].iter().zip(&spans) {
            before(verb);
            // SAFETY: the first `checked` spans were written above.
            let span = unsafe { span.assume_init() };
            match *verb {
                Verb::Read { local: at, len, .. } => load_words(span, local_words(local, at, len)?),
                Verb::Write { local: at, len, .. } => {
                    store_words(local_words(local, at, len)?, span)
                }
                Verb::Cas {
                    local: at,
                    expect,
                    swap,
                    ..
                } => {
                    // The local word first: a verb that cannot complete
                    // must not change the region.
                    let old = local_words(local, at, 8)?;
                    old[0] = compare_and_swap(&span[0], expect, swap);
                }
                Verb::FetchAdd { local: at, add, .. } => {
                    let old = local_words(local, at, 8)?;
                    old[0] = fetch_and_add(&span[0], add);
                }
            }
        }
        if let Some(e) = refused {
            return Err(e);
        }
    }
    Ok(())
}

/// Verbs checked, and their READs' lines prefetched, before any of them
/// runs. 16 READs (a multi-key batch's windows are three lines each, a
/// block up to tens) are already more lines than a core has misses in
/// flight, so a longer batch waiting for its misses a chunk at a time
/// should lose little; GET's batches fit in one chunk.
const PREFETCH_VERBS: usize = 16;

/// The words a verb touches, if they lie within the registered range; or
/// why not.
#[inline(always)]
fn verb_span<'r>(
    region: &'r SharedRegion,
    remote: &RemoteRegion,
    verb: &Verb,
) -> Result<&'r [AtomicU64], TransportError> {
    let (off, len) = verb.remote_range();
    match region.span_within(off, len, remote.len) {
        Some(words) => Ok(words),
        None => checked_span(region, remote, off, len),
    }
}

/// `verb_span` off the data path: why the range is refused (or its words,
/// if the mapping has just grown to take it).
#[cold]
#[inline(never)]
fn checked_span<'r>(
    region: &'r SharedRegion,
    remote: &RemoteRegion,
    off: u64,
    len: usize,
) -> Result<&'r [AtomicU64], TransportError> {
    if off.checked_add(len as u64).is_none_or(|e| e > remote.len) {
        return Err(TransportError::RemoteAccess(format!(
            "range {off}+{len} outside the registered {} bytes",
            remote.len
        )));
    }
    region.span(off, len)
}

/// Byte offset of key-table entry `slot`.
fn key_word(slot: u32) -> Result<u64, TransportError> {
    if u64::from(slot) >= KEY_TABLE_ENTRIES {
        return Err(TransportError::RemoteAccess(format!(
            "key slot {slot} outside the key table"
        )));
    }
    Ok(KEY_TABLE_OFFSET + u64::from(slot) * 8)
}

/// The region's key table as the server manages it: which entries are free,
/// and the keys it hands out.
struct KeyTable {
    region: Arc<SharedRegion>,
    free: Mutex<Vec<u32>>,
    /// Keys are this counter's successive values, so no two admissions of one
    /// registration share a key; it starts at a random value, so keys of
    /// successive servers differ too.
    next_key: AtomicU32,
}

impl KeyTable {
    /// Takes over the region's table, revoking every key in it.
    fn new(region: Arc<SharedRegion>) -> Result<KeyTable, TransportError> {
        for slot in 0..KEY_TABLE_ENTRIES as u32 {
            region.store(key_word(slot)?, 0)?;
        }
        Ok(KeyTable {
            region,
            free: Mutex::new((0..KEY_TABLE_ENTRIES as u32).rev().collect()),
            next_key: AtomicU32::new(random_u32()),
        })
    }

    fn admit(&self) -> Result<RemoteRegion, TransportError> {
        let slot = self
            .free
            .lock()
            .map_err(|_| TransportError::Unsupported("key table poisoned".into()))?
            .pop()
            .ok_or_else(|| {
                TransportError::Unsupported(format!(
                    "all {KEY_TABLE_ENTRIES} client keys are in use"
                ))
            })?;
        let rkey = loop {
            let k = self.next_key.fetch_add(1, Ordering::Relaxed);
            if k != 0 {
                break k;
            }
        };
        self.region.store(key_word(slot)?, rkey as u64)?;
        Ok(RemoteRegion {
            base: 0,
            len: self.region.len(),
            rkey,
            key_slot: slot,
        })
    }

    fn fence(&self, slot: u32) {
        if let Ok(word) = key_word(slot) {
            let _ = self.region.store(word, 0);
        }
        if let Ok(mut free) = self.free.lock() {
            free.push(slot);
        }
    }

    fn revoke_all(&self) {
        for slot in 0..KEY_TABLE_ENTRIES as u32 {
            if let Ok(word) = key_word(slot) {
                let _ = self.region.store(word, 0);
            }
        }
    }
}

/// The server's control socket, and the registration of its region.
pub struct ShmListener {
    listener: UnixListener,
    socket: PathBuf,
    keys: Option<Arc<KeyTable>>,
}

impl ShmListener {
    /// Binds the control socket beside the region file. A stale socket left
    /// by a dead server is replaced; a live one is refused.
    pub fn bind(region_path: &Path) -> Result<Self, TransportError> {
        let socket = Address::shm_socket(region_path);
        if socket.exists() {
            if UnixStream::connect(&socket).is_ok() {
                return Err(TransportError::Io(std::io::Error::new(
                    std::io::ErrorKind::AddrInUse,
                    format!("a server is already listening on {}", socket.display()),
                )));
            }
            std::fs::remove_file(&socket)?;
        }
        let listener = UnixListener::bind(&socket)?;
        Ok(ShmListener {
            listener,
            socket,
            keys: None,
        })
    }
}

/// A random 32-bit value (clock and pid through SplitMix64): enough to make
/// keys of successive servers differ.
fn random_u32() -> u32 {
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
        ^ (std::process::id() as u64) << 32;
    let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (z ^ (z >> 31)) as u32
}

impl ControlListener for ShmListener {
    fn register(&mut self, region: Arc<SharedRegion>) -> Result<(), TransportError> {
        self.keys = Some(Arc::new(KeyTable::new(region)?));
        Ok(())
    }

    fn extend(&self) -> Result<(), TransportError> {
        // Clients map the whole file when they learn its new length.
        Ok(())
    }

    fn forget_earlier(&self) {}

    fn deregister(&self) {
        if let Some(keys) = &self.keys {
            keys.revoke_all();
        }
    }

    fn accept(&self) -> Result<Box<dyn ControlPeer>, TransportError> {
        let keys = self.keys.clone().ok_or(TransportError::NotAttached)?;
        let (stream, _) = self.listener.accept()?;
        stream.set_nonblocking(true)?;
        let process = peer_process(&stream);
        Ok(Box::new(ShmPeer {
            stream,
            reader: FrameReader::default(),
            keys,
            slot: None,
            remote: None,
            process,
        }))
    }

    fn wake(&self) {
        let _ = UnixStream::connect(&self.socket);
    }
}

impl Drop for ShmListener {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.socket);
    }
}

pub struct ShmPeer {
    stream: UnixStream,
    reader: FrameReader,
    keys: Arc<KeyTable>,
    /// The key-table entry of an admitted client.
    slot: Option<u32>,
    /// What it was told at admission.
    remote: Option<RemoteRegion>,
    /// A pidfd of the client's process (it maps the region itself), which
    /// becomes readable when that process has exited.
    process: Option<OwnedFd>,
}

/// A pidfd for the process at the other end of `stream`, where the kernel
/// can tell (SO_PEERCRED, pidfd_open: Linux 5.3 and later).
fn peer_process(stream: &UnixStream) -> Option<OwnedFd> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cred`, ours.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 || cred.pid <= 0 {
        return None;
    }
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, cred.pid, 0) };
    // SAFETY: a non-negative result is a descriptor that we now own.
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Whether the process behind a pidfd has exited.
fn has_exited(pidfd: &OwnedFd) -> bool {
    let mut p = libc::pollfd {
        fd: pidfd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, no waiting.
    unsafe { libc::poll(&mut p, 1, 0) == 1 && p.revents & libc::POLLIN != 0 }
}

impl ControlPeer for ShmPeer {
    fn fds(&self) -> Vec<RawFd> {
        vec![self.stream.as_raw_fd()]
    }

    fn try_recv(&mut self) -> Result<Received, TransportError> {
        self.reader.poll(&mut self.stream)
    }

    fn send(&mut self, bytes: &[u8]) -> Result<(), TransportError> {
        // Non-blocking: a client that lets its replies pile up until the
        // socket buffer is full gets disconnected, not waited for.
        write_frame(&mut self.stream, bytes)
    }

    fn admit(&mut self) -> Result<RemoteRegion, TransportError> {
        if self.slot.is_some() {
            return Err(TransportError::Unsupported(
                "client already admitted".into(),
            ));
        }
        let remote = self.keys.admit()?;
        self.slot = Some(remote.key_slot);
        self.remote = Some(remote);
        Ok(remote)
    }

    fn region(&mut self) -> Result<RemoteRegion, TransportError> {
        // The same key; the mapping a client makes covers the whole file.
        let remote = self.remote.ok_or(TransportError::NotAttached)?;
        Ok(RemoteRegion {
            len: self.keys.region.len(),
            ..remote
        })
    }

    fn fence(&mut self) -> Fenced {
        if let Some(slot) = self.slot.take() {
            self.keys.fence(slot);
        }
        // A live process may be between its key check and its stores (a
        // check-then-act no key can close); a dead one stores nothing more.
        match &self.process {
            Some(p) if has_exited(p) => Fenced::Exited,
            _ => Fenced::Revoked,
        }
    }
}

impl Drop for ShmPeer {
    fn drop(&mut self) {
        self.fence();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region(dir: &tempfile::TempDir) -> SharedRegion {
        let path = dir.path().join("r");
        let file = File::create_new(&path).unwrap();
        file.set_len(1 << 16).unwrap();
        SharedRegion::from_file(&file, &path, 0).unwrap()
    }

    /// Bytes of `region`'s mapping that the kernel maps with huge pages.
    fn huge_mapped_bytes(region: &SharedRegion) -> u64 {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let start = format!("{:x}-", region.base as usize);
        let mut lines = smaps.lines().skip_while(|l| !l.starts_with(&start));
        lines.next().expect("the mapping is in smaps");
        let is_header = |l: &str| {
            l.split_whitespace()
                .next()
                .is_some_and(|range| range.contains('-') && !range.ends_with(':'))
        };
        lines
            .take_while(|l| !is_header(l))
            .filter(|l| l.starts_with("ShmemPmdMapped:") || l.starts_with("FilePmdMapped:"))
            .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
            .sum::<u64>()
            * 1024
    }

    #[test]
    fn a_region_on_huge_pages_keeps_its_bytes_and_is_mapped_huge() {
        // On tmpfs, where the region lives in production.
        let dir = tempfile::tempdir_in("/dev/shm").unwrap();
        let path = dir.path().join("r");
        let file = File::create_new(&path).unwrap();
        file.set_len(8 << 20).unwrap();
        let region = SharedRegion::from_file(&file, &path, 16 << 20).unwrap();
        assert_eq!(
            region.base as usize % HUGE_PAGE,
            0,
            "aligned for huge pages"
        );
        for at in (0..8 << 20).step_by(4096) {
            region.store(at, at ^ 0x5a5a).unwrap();
        }
        match region.make_huge(0, region.len()) {
            Ok(()) => {
                // Every whole huge page of the file: all four.
                assert_eq!(huge_mapped_bytes(&region), 8 << 20);
                // A client's mapping of the same file maps them whole too.
                let client = SharedRegion::open(&path).unwrap();
                assert_eq!(client.base as usize % HUGE_PAGE, 0);
                for at in (0..8 << 20).step_by(4096) {
                    assert_eq!(client.load(at).unwrap(), at ^ 0x5a5a);
                }
                assert_eq!(huge_mapped_bytes(&client), 8 << 20);
            }
            // A kernel before 6.1, or one told to deny them.
            Err(e) => eprintln!("no huge pages here: {e}"),
        }
        for at in (0..8 << 20).step_by(4096) {
            assert_eq!(region.load(at).unwrap(), at ^ 0x5a5a);
        }
        // A grown part keeps small pages (no copy while serving); the
        // huge ones keep their bytes.
        let huge = huge_mapped_bytes(&region);
        region.grow(12 << 20).unwrap();
        assert_eq!(region.load((12 << 20) - 8).unwrap(), 0);
        region.store((12 << 20) - 8, 7).unwrap();
        assert_eq!(region.load((12 << 20) - 8).unwrap(), 7);
        assert_eq!(huge_mapped_bytes(&region), huge);
        for at in (0..8 << 20).step_by(4096) {
            assert_eq!(region.load(at).unwrap(), at ^ 0x5a5a);
        }
    }

    #[test]
    fn verbs_check_bounds_alignment_and_atomics() {
        let dir = tempfile::tempdir().unwrap();
        let r = region(&dir);
        assert!(r.span(1 << 16, 8).is_err());
        assert!(r.span((1 << 16) - 8, 16).is_err());
        assert!(r.span(4, 8).is_err());
        assert!(r.span(u64::MAX - 3, 8).is_err());
        r.write(4096, &[1, 2, 3]).unwrap();
        let mut out = [0u64; 3];
        r.read(4096, &mut out).unwrap();
        assert_eq!(out, [1, 2, 3]);
        assert_eq!(r.cas(4096, 1, 9).unwrap(), 1);
        assert_eq!(r.cas(4096, 1, 10).unwrap(), 9);
        assert_eq!(r.fetch_add(4104, 5).unwrap(), 2);
        assert_eq!(r.load(4104).unwrap(), 7);
    }

    #[test]
    fn a_read_up_to_the_end_of_the_region_stays_inside_it() {
        let dir = tempfile::tempdir().unwrap();
        let r = region(&dir);
        let words: Vec<u64> = (1..=24).collect();
        let end = r.len();
        r.write(end - 8 * 24, &words).unwrap();
        // What lies past the mapped length is not mapped: a copy that read
        // beyond its range would fault here.
        for n in 1..=24usize {
            let mut dst = vec![0u64; n];
            r.read(end - 8 * n as u64, &mut dst).unwrap();
            assert_eq!(dst, words[24 - n..], "last {n} words");
        }
    }

    /// A registration of all of `r` under key 77, as `admit` would make.
    fn registered(r: &SharedRegion) -> RemoteRegion {
        r.store(key_word(0).unwrap(), 77).unwrap();
        RemoteRegion {
            base: 0,
            len: r.len(),
            rkey: 77,
            key_slot: 0,
        }
    }

    #[test]
    fn a_batch_stops_at_the_verb_out_of_range_having_run_those_before_it() {
        let dir = tempfile::tempdir().unwrap();
        let r = region(&dir);
        let remote = registered(&r);
        let data = 40_960u64;
        let mut local = vec![0u64; 64];
        // More verbs than are checked and prefetched at a time, the bad one
        // in the second chunk.
        let (count, bad) = (PREFETCH_VERBS as u64 + 4, PREFETCH_VERBS + 2);
        let mut verbs: Vec<Verb> = (0..count)
            .map(|i| Verb::FetchAdd {
                remote: data + 8 * i,
                local: 8 * i as usize,
                add: 1,
            })
            .collect();
        verbs[bad] = Verb::Read {
            remote: r.len() - 8,
            local: 0,
            len: 16,
        };
        let e = execute(&r, &remote, ReadOrder::Posted, &mut local, &verbs).unwrap_err();
        assert!(matches!(e, TransportError::RemoteAccess(_)), "{e}");
        for i in 0..count {
            let want = u64::from(i < bad as u64);
            assert_eq!(r.load(data + 8 * i).unwrap(), want, "verb {i}");
        }
    }

    #[test]
    fn an_atomic_with_no_room_for_its_result_leaves_the_region_alone() {
        let dir = tempfile::tempdir().unwrap();
        let r = region(&dir);
        let remote = registered(&r);
        let word = 40_960u64;
        r.store(word, 5).unwrap();
        let mut local = vec![0u64; 4];
        let beyond = 8 * local.len();
        for verb in [
            Verb::Cas {
                remote: word,
                local: beyond,
                expect: 5,
                swap: 6,
            },
            Verb::FetchAdd {
                remote: word,
                local: beyond,
                add: 1,
            },
        ] {
            let e = execute(&r, &remote, ReadOrder::Posted, &mut local, &[verb]).unwrap_err();
            assert!(matches!(e, TransportError::LocalAccess(_)), "{e}");
            assert_eq!(r.load(word).unwrap(), 5);
        }
    }

    #[test]
    fn concurrent_fetch_add_loses_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r");
        let _r = region(&dir);
        std::thread::scope(|s| {
            for _ in 0..4 {
                let path = path.clone();
                s.spawn(move || {
                    // Each thread maps the file itself, as another process would.
                    let mine = SharedRegion::open(&path).unwrap();
                    for _ in 0..10_000 {
                        mine.fetch_add(4096, 1).unwrap();
                    }
                });
            }
        });
        assert_eq!(
            SharedRegion::open(&path).unwrap().load(4096).unwrap(),
            40_000
        );
    }
}
