//! The region file mapped into this process: the server's mapping, which
//! grows in place, and the clients' shared ones. Both backends and the
//! server reach the region's words only through it, and only atomically
//! (the memory-ordering contract of the verbs built on it is at the top of
//! `transport/shm/mod.rs`).

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::words::{compare_and_swap, fetch_and_add, load_words, prefetch_lines, store_words};

/// Why a range of the region cannot be accessed: the checks a NIC makes
/// against a memory region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AccessError {
    #[error("offset {offset} length {len}: shm verbs need 8-byte alignment")]
    Misaligned { offset: u64, len: usize },
    #[error("range {offset}+{len} outside the {region_len}-byte region")]
    OutOfRange {
        offset: u64,
        len: usize,
        region_len: u64,
    },
}

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

    /// Grows the file to `new_len` bytes, allocated (see `allocate`), and
    /// maps the new part in place. Readers see the new length only once it
    /// is mapped. On an error the file keeps its length.
    pub fn grow(&self, new_len: u64) -> std::io::Result<Pages> {
        let _one = self
            .growing
            .lock()
            .map_err(|_| std::io::Error::other("poisoned"))?;
        let len = self.len();
        if new_len <= len {
            return Ok(Pages::Unchanged);
        }
        if new_len > self.reserved || !new_len.is_multiple_of(4096) {
            return Err(std::io::Error::other(format!(
                "cannot grow to {new_len} bytes: at most {} (page multiples)",
                self.reserved
            )));
        }
        let grown = self
            .file
            .set_len(new_len)
            .and_then(|()| self.map_part(len, new_len))
            .and_then(|()| self.allocate((len, new_len), COLLAPSE_BUDGET_PER_GIB));
        match grown {
            Ok(pages) => {
                self.len.store(new_len, Ordering::Release);
                Ok(pages)
            }
            Err(e) => {
                // Frees what was allocated; nobody reads past `len`.
                let _ = self.file.set_len(len);
                Err(e)
            }
        }
    }

    /// Allocates every byte of a region just created, a sparse file
    /// nobody else has mapped (see `allocate`).
    pub fn allocate_all(&self) -> std::io::Result<Pages> {
        self.allocate((0, self.len()), COLLAPSE_BUDGET_PER_GIB)
    }

    /// Allocates file bytes `[from, to)`, mapped and used by nobody yet: a
    /// full file system fails here, not with SIGBUS in a client later.
    /// Their whole huge pages are put on huge pages where the kernel can (a
    /// TLB miss less on every random access to a large region; clients map
    /// the same huge pages). The cheap way: one small page allocated per
    /// huge page, then MADV_COLLAPSE (Linux ≥ 6.1, any tmpfs `huge=` unless
    /// `shmem_enabled` is `deny`), which then zeroes fresh huge pages
    /// instead of copying 512 small ones each (on this project's idle
    /// machine 0.1–0.2 s per GiB, where every page allocated and then
    /// collapsed took 0.6–1.9 s). It collapses a chunk at a time and stops
    /// at the first chunk the kernel refuses, or once it has spent its
    /// budget, `budget_per_gib` of CPU time (memory short of free 2 MiB
    /// blocks is compacted first, which can take seconds) or four times
    /// that of waiting: the rest is allocated on small pages, which tmpfs
    /// zeroes at their first touch.
    fn allocate(&self, (from, to): (u64, u64), budget_per_gib: Duration) -> std::io::Result<Pages> {
        if from > to || to > self.reserved {
            return Err(std::io::Error::other(format!(
                "cannot allocate bytes {from}..{to} of a {}-byte mapping",
                self.reserved
            )));
        }
        // A collapse charges whole huge pages: on a file system too small
        // for the whole, collapsing would fill it before posix_fallocate
        // said so.
        check_room(&self.file, to - from)?;
        let huge = HUGE_PAGE as u64;
        let (start, end) = (from.next_multiple_of(huge), to / huge * huge);
        for seed in (start..end).step_by(HUGE_PAGE) {
            self.fallocate(seed, 4096)?;
        }
        let budget = budget_per_gib
            .mul_f64((end.saturating_sub(start)) as f64 / (1u64 << 30) as f64)
            .max(budget_per_gib / 8);
        let pages = match self.collapse((start, end), budget) {
            // Nothing collapsed: small pages from the first byte (which
            // the caller zeroes ahead of clients).
            Pages::SmallFrom(at, e) if at == start => Pages::SmallFrom(from, e),
            pages => pages,
        };
        self.fallocate(from, to - from)?;
        Ok(pages)
    }

    /// MADV_COLLAPSE over `[start, end)` (whole huge pages), a chunk at a
    /// time, until `budget` of this thread's CPU time (or four times that
    /// of waiting) is spent.
    fn collapse(&self, (start, end): (u64, u64), budget: Duration) -> Pages {
        let (cpu, wall) = (thread_cpu_time(), Instant::now());
        let mut at = start;
        while at < end {
            if thread_cpu_time().saturating_sub(cpu) >= budget || wall.elapsed() >= budget * 4 {
                let e = std::io::Error::other(format!("collapsing took over {budget:?}"));
                return Pages::SmallFrom(at, e);
            }
            let chunk = (at, (at + COLLAPSE_CHUNK).min(end));
            // EAGAIN: a page was busy for a moment (locked, on its way to
            // an LRU list); once more usually takes it.
            let done = self.advise(chunk, libc::MADV_COLLAPSE).or_else(|e| {
                if e.raw_os_error() == Some(libc::EAGAIN) {
                    self.advise(chunk, libc::MADV_COLLAPSE)
                } else {
                    Err(e)
                }
            });
            if let Err(e) = done {
                return Pages::SmallFrom(at, e);
            }
            at = chunk.1;
        }
        Pages::Huge
    }

    /// Allocates file bytes `[from, from + len)` (posix_fallocate).
    fn fallocate(&self, from: u64, len: u64) -> std::io::Result<()> {
        // SAFETY: posix_fallocate on a descriptor we own.
        let rc = unsafe {
            libc::posix_fallocate(
                self.file.as_raw_fd(),
                from as libc::off_t,
                len as libc::off_t,
            )
        };
        if rc != 0 {
            return Err(std::io::Error::from_raw_os_error(rc));
        }
        Ok(())
    }

    /// Has the kernel allocate and zero the pages of file bytes `[from, to)`
    /// now (MADV_POPULATE_WRITE, Linux ≥ 5.14), in this thread: tmpfs
    /// leaves the pages `posix_fallocate` reserved unzeroed until their
    /// first touch, which would otherwise fault and clear them in the
    /// write path of whichever client writes there first. It changes no
    /// byte.
    pub fn populate(&self, from: u64, to: u64) -> std::io::Result<()> {
        self.advise(
            (from / 4096 * 4096, to.min(self.len())),
            libc::MADV_POPULATE_WRITE,
        )
    }

    /// `advice` (one that keeps the bytes) on file bytes `[start, end)`,
    /// `start` page-aligned, mapped (a part not mapped yet fails the call);
    /// nothing if the range is empty.
    fn advise(&self, (start, end): (u64, u64), advice: libc::c_int) -> std::io::Result<()> {
        if start >= end {
            return Ok(());
        }
        if end > self.reserved {
            return Err(std::io::Error::other(format!(
                "bytes {start}..{end} lie outside the mapping"
            )));
        }
        // SAFETY: [start, end) lies inside our reservation (checked above),
        // which only this value unmaps; the callers' advice keeps contents.
        let rc = unsafe {
            libc::madvise(
                self.base.add(start as usize) as *mut libc::c_void,
                (end - start) as usize,
                advice,
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
    pub fn span(&self, offset: u64, len: usize) -> Result<&[AtomicU64], AccessError> {
        if let Some(words) = self.span_within(offset, len, u64::MAX) {
            return Ok(words);
        }
        Err(if !offset.is_multiple_of(8) || !len.is_multiple_of(8) {
            AccessError::Misaligned { offset, len }
        } else {
            AccessError::OutOfRange {
                offset,
                len,
                region_len: self.len(),
            }
        })
    }

    /// The words covering `[offset, offset + len)` if that range is
    /// aligned and ends within both `limit` and the mapping: `span` without
    /// its messages, for the data path.
    #[inline]
    pub(crate) fn span_within(&self, offset: u64, len: usize, limit: u64) -> Option<&[AtomicU64]> {
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

    pub fn load(&self, offset: u64) -> Result<u64, AccessError> {
        Ok(self.span(offset, 8)?[0].load(Ordering::Acquire))
    }

    pub fn store(&self, offset: u64, value: u64) -> Result<(), AccessError> {
        self.span(offset, 8)?[0].store(value, Ordering::Release);
        Ok(())
    }

    pub fn read(&self, offset: u64, dst: &mut [u64]) -> Result<(), AccessError> {
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

    pub fn write(&self, offset: u64, src: &[u64]) -> Result<(), AccessError> {
        store_words(src, self.span(offset, src.len() * 8)?);
        Ok(())
    }

    /// Returns the old value; the swap happened iff it equals `expect`.
    pub fn cas(&self, offset: u64, expect: u64, swap: u64) -> Result<u64, AccessError> {
        Ok(compare_and_swap(&self.span(offset, 8)?[0], expect, swap))
    }

    pub fn fetch_add(&self, offset: u64, add: u64) -> Result<u64, AccessError> {
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
        let rc = unsafe { libc::munmap(self.reservation.0, self.reservation.1) };
        // Only a bad argument fails munmap, and these are the reservation's own.
        debug_assert_eq!(rc, 0, "munmap of the region's reservation");
    }
}

/// The huge-page size a mapping is aligned to (x86-64's and arm64's PMD).
const HUGE_PAGE: usize = 2 << 20;

/// Fails with ENOSPC when the file system of `file` has fewer than `bytes`
/// free (one with no size limit reports none and passes). A check ahead of
/// allocating, which still fails on its own if others took the space.
pub fn check_room(file: &File, bytes: u64) -> std::io::Result<()> {
    let (size, free) = file_system_bytes(file)?;
    if size > 0 && free < bytes {
        return Err(std::io::Error::from_raw_os_error(libc::ENOSPC));
    }
    Ok(())
}

/// The size of the file system that holds `file`, and the bytes of it an
/// unprivileged user may still take (a server run as root does not eat a
/// disk's reserve either); tmpfs with no size limit says 0 and 0.
fn file_system_bytes(file: &File) -> std::io::Result<(u64, u64)> {
    let mut fs = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: fstatvfs fills the struct we pass, on a descriptor we own.
    let rc = unsafe { libc::fstatvfs(file.as_raw_fd(), fs.as_mut_ptr()) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fstatvfs succeeded, so it filled the struct.
    let fs = unsafe { fs.assume_init() };
    Ok((
        fs.f_blocks.saturating_mul(fs.f_frsize),
        fs.f_bavail.saturating_mul(fs.f_frsize),
    ))
}

/// Bytes collapsed into huge pages in one call.
const COLLAPSE_CHUNK: u64 = 64 << 20;
/// CPU time collapsing may take per GiB before the rest is left on small
/// pages: about twice what it takes here while clients load the machine
/// (1.0–1.2 s; 0.1–0.2 s on an idle one), so only a kernel that must
/// compact memory for every huge page runs out of it.
const COLLAPSE_BUDGET_PER_GIB: Duration = Duration::from_secs(2);

/// CPU time this thread has used: what collapsing takes from the clients
/// (compaction included), however long a busy machine keeps the thread
/// waiting for a core.
fn thread_cpu_time() -> Duration {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime fills the timespec we pass.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    if rc != 0 {
        return Duration::ZERO;
    }
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

/// What backs a part of the region just allocated.
#[derive(Debug)]
pub enum Pages {
    /// Its whole huge pages are huge pages.
    Huge,
    /// Huge pages up to the byte given, small ones from there on, for the
    /// reason given.
    SmallFrom(u64, std::io::Error),
    /// Nothing was allocated: the file was that long already.
    Unchanged,
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A 64 KiB region in `dir`, with no room to grow.
    pub(crate) fn region(dir: &tempfile::TempDir) -> SharedRegion {
        let path = dir.path().join("r");
        let file = File::create_new(&path).unwrap();
        file.set_len(1 << 16).unwrap();
        SharedRegion::from_file(&file, &path, 0).unwrap()
    }

    /// The sum of smaps `fields` over the mappings of `region`'s
    /// reservation (a grown part may be a mapping of its own), in bytes.
    fn smaps_bytes(region: &SharedRegion, fields: &[&str]) -> u64 {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let (base, end) = (
            region.base as usize,
            region.base as usize + region.max_len() as usize,
        );
        let mut ours = false;
        let mut kib = 0;
        for line in smaps.lines() {
            let first = line.split_whitespace().next().unwrap_or("");
            if let Some((from, _)) = first.split_once('-').filter(|_| !first.ends_with(':')) {
                let from = usize::from_str_radix(from, 16).unwrap();
                ours = (base..end).contains(&from);
            } else if ours && fields.iter().any(|f| first.strip_suffix(':') == Some(f)) {
                kib += line
                    .split_whitespace()
                    .nth(1)
                    .and_then(|n| n.parse::<u64>().ok())
                    .unwrap();
            }
        }
        kib * 1024
    }

    /// Bytes of `region`'s mapping that the kernel maps with huge pages.
    fn huge_mapped_bytes(region: &SharedRegion) -> u64 {
        smaps_bytes(region, &["ShmemPmdMapped", "FilePmdMapped"])
    }

    /// A region of `len` bytes (growing to 16 MiB) on tmpfs, where regions
    /// live in production; its directory goes when dropped.
    fn region_on_tmpfs(len: u64) -> (tempfile::TempDir, std::path::PathBuf, SharedRegion) {
        let dir = tempfile::tempdir_in("/dev/shm").unwrap();
        let path = dir.path().join("r");
        let file = File::create_new(&path).unwrap();
        file.set_len(len).unwrap();
        let region = SharedRegion::from_file(&file, &path, 16 << 20).unwrap();
        (dir, path, region)
    }

    #[test]
    fn allocated_parts_are_on_huge_pages_and_growth_keeps_the_bytes() {
        let (_dir, path, region) = region_on_tmpfs(8 << 20);
        assert_eq!(
            region.base as usize % HUGE_PAGE,
            0,
            "aligned for huge pages"
        );
        let pages = region.allocate_all().unwrap();
        assert!(allocated_bytes(&path) >= 8 << 20, "every byte allocated");
        for at in (0..8 << 20).step_by(4096) {
            assert_eq!(region.load(at).unwrap(), 0);
            region.store(at, at ^ 0x5a5a).unwrap();
        }
        let grown = region.grow(12 << 20).unwrap();
        assert_eq!(region.len(), 12 << 20);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 12 << 20);
        assert!(allocated_bytes(&path) >= 12 << 20, "every byte allocated");
        assert!(matches!(region.grow(12 << 20), Ok(Pages::Unchanged)));
        for at in (8 << 20..12 << 20).step_by(4096) {
            assert_eq!(region.load(at).unwrap(), 0);
        }
        for at in (0..8 << 20).step_by(4096) {
            assert_eq!(region.load(at).unwrap(), at ^ 0x5a5a);
        }
        match (pages, grown) {
            (Pages::Huge, Pages::Huge) => {
                // Every whole huge page of the file: all six.
                assert_eq!(huge_mapped_bytes(&region), 12 << 20);
                // A client's mapping of the same file maps them whole too.
                let client = SharedRegion::open(&path).unwrap();
                assert_eq!(client.base as usize % HUGE_PAGE, 0);
                for at in (0..12 << 20).step_by(4096) {
                    let want = if at < 8 << 20 { at ^ 0x5a5a } else { 0 };
                    assert_eq!(client.load(at).unwrap(), want);
                }
                assert_eq!(huge_mapped_bytes(&client), 12 << 20);
            }
            // A kernel before 6.1, one told to deny them, or no free 2 MiB
            // blocks of memory: the bytes are allocated all the same.
            (p, g) => eprintln!("no huge pages here: {p:?}, {g:?}"),
        }
    }

    /// Bytes of the file at `path` that its file system has allocated.
    fn allocated_bytes(path: &Path) -> u64 {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(path).unwrap().blocks() * 512
    }

    #[test]
    fn what_collapsing_leaves_out_is_allocated_on_small_pages() {
        let (_dir, path, region) = region_on_tmpfs(16 << 20);
        // No budget: nothing is collapsed, from the first byte on.
        match region.allocate((4096, 16 << 20), Duration::ZERO).unwrap() {
            Pages::SmallFrom(from, e) => {
                assert_eq!(from, 4096, "{e}");
                assert!(e.to_string().contains("collapsing took over"), "{e}");
            }
            other => panic!("{other:?}"),
        }
        assert!(
            allocated_bytes(&path) >= (16 << 20) - 4096,
            "every byte allocated"
        );
        assert_eq!(huge_mapped_bytes(&region), 0);
        for at in (0..16 << 20).step_by(4096) {
            assert_eq!(region.load(at).unwrap(), 0);
        }
    }

    #[test]
    fn a_growth_beyond_the_file_system_fails_and_leaves_the_file_as_it_was() {
        let dir = tempfile::tempdir_in("/dev/shm").unwrap();
        let path = dir.path().join("r");
        let file = File::create_new(&path).unwrap();
        file.set_len(4 << 20).unwrap();
        let (fs_bytes, _) = file_system_bytes(&file).unwrap();
        if fs_bytes == 0 {
            eprintln!("/dev/shm has no size limit: nothing to exceed");
            return;
        }
        let too_big = (fs_bytes + (64 << 20)).next_multiple_of(4096);
        let region = SharedRegion::from_file(&file, &path, too_big).unwrap();
        let e = region.grow(too_big).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "{e}");
        assert_eq!(region.len(), 4 << 20);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 4 << 20);
        // The region still grows within what there is.
        region.grow(8 << 20).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 8 << 20);
    }

    #[test]
    fn a_populated_part_is_mapped_before_anyone_touches_it() {
        // Small pages allocated and not touched: what a part the kernel
        // could not put on huge pages holds.
        let (_dir, _, region) = region_on_tmpfs(12 << 20);
        region.fallocate(0, 12 << 20).unwrap();
        let before = smaps_bytes(&region, &["Rss"]);
        if let Err(e) = region.populate(4 << 20, 12 << 20) {
            // A kernel before 5.14.
            eprintln!("no MADV_POPULATE_WRITE here: {e}");
            return;
        }
        let after = smaps_bytes(&region, &["Rss"]);
        assert!(
            after >= before + (8 << 20),
            "{before} -> {after} bytes resident"
        );
        for at in (4 << 20..12 << 20).step_by(4096) {
            assert_eq!(region.load(at).unwrap(), 0);
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
