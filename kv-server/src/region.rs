//! The server's side of the region file: create it (private, locked, its
//! space allocated up front), or reopen and validate an existing one (never
//! overwriting a file it does not understand), switch its geometry, and
//! scan the index.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;

use kv_common::layout::{
    decode_block, is_counter, lengths_of, CounterState, Geometry, KeyHash, Payload, Slot, SlotPos,
    BLOCK_HEADER, BUCKET_BYTES, HEADER_READ_WORDS, KEY_TABLE_ENTRIES, KEY_TABLE_OFFSET, MAX_KEY,
    RECORD_OFFSETS, RECORD_WORDS, SLOTS_PER_BUCKET,
};
use kv_common::mapping::{check_room, Pages, SharedRegion};
use kv_common::protocol::KeyDigest;
use kv_common::transport::TransportError;
use xxhash_rust::xxh3::{xxh3_128_with_seed, xxh3_64};

use crate::header;
use crate::units::UnitMap;
use crate::ServerError;

pub struct OpenedRegion {
    pub region: SharedRegion,
    pub geometry: Geometry,
    pub created: bool,
    /// The open file, holding an exclusive `flock` for as long as it lives:
    /// a second server on the same file, through any path, is refused.
    pub lock: File,
}

/// Permission bits of a new region file: the owner only, or its group too.
pub fn file_mode(group_access: bool) -> u32 {
    if group_access {
        0o660
    } else {
        0o600
    }
}

fn region_error(path: &Path, reason: impl std::fmt::Display) -> ServerError {
    ServerError::Region {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    }
}

/// Opens the region at `path`, or creates it with `geometry` (and `mode`)
/// when there is no file or an empty one; either way mapped with room to
/// grow to `max_len` bytes.
pub fn open_or_create(
    path: &Path,
    geometry: &Geometry,
    mode: u32,
    max_len: u64,
) -> Result<OpenedRegion, ServerError> {
    // A device, a pipe or a directory there is someone else's: a region
    // is a plain file, and nothing else is touched (opened, emptied,
    // removed) in its place.
    let existed = match std::fs::metadata(path) {
        Ok(m) if m.is_file() => true,
        Ok(_) => {
            return Err(region_error(
                path,
                "not a plain file, so not a region: refusing to touch it (pick another path)",
            ))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
        Err(e) => return Err(region_error(path, e)),
    };
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .mode(mode)
        .open(path)
        .map_err(|e| region_error(path, e))?;
    lock_exclusive(&file, path)?;
    let len = file.metadata().map_err(|e| region_error(path, e))?.len();
    if len == 0 || unfinished_create(&file) {
        return create(file, (path, existed), geometry, mode, max_len);
    }
    let region =
        SharedRegion::from_file(&file, path, max_len).map_err(|e| region_error(path, e))?;
    let found = header::read_geometry(&region).map_err(|e| {
        let way_out = if e.is_damage() {
            format!(
                "`kv-server check --repair {}` rebuilds the record by locating the index",
                path.display()
            )
        } else {
            "refusing to use it (move it away or pick another path)".to_string()
        };
        region_error(path, format!("{e}; {way_out}"))
    })?;
    // Longer is a growth that died before its header switch: the header
    // rules. The tail is cut off (the growth may have died before it was
    // all allocated, and nobody uses it) and the file mapped again.
    let region = if found.region_len < region.len() {
        drop(region);
        file.set_len(found.region_len)
            .map_err(|e| region_error(path, format!("cannot cut its unused tail: {e}")))?;
        SharedRegion::from_file(&file, path, max_len).map_err(|e| region_error(path, e))?
    } else {
        region
    };
    if found.region_len > region.len() {
        return Err(region_error(
            path,
            format!(
                "header says {} bytes, file has {}",
                found.region_len,
                region.len()
            ),
        ));
    }
    Ok(OpenedRegion {
        region,
        geometry: found,
        created: false,
        lock: file,
    })
}

/// Logs what backs a part of the region just allocated.
fn say_pages(pages: &Pages, path: &Path) {
    match pages {
        Pages::Huge | Pages::Unchanged => {
            tracing::debug!(path = %path.display(), "region on huge pages")
        }
        Pages::SmallFrom(small, e) => tracing::info!(
            path = %path.display(),
            error = %e,
            "region keeps small pages from byte {small} on (huge pages need Linux 6.1 or later, free 2 MiB blocks of memory, and shmem_enabled other than deny)"
        ),
    }
}

/// A file that holds nothing but zeros where a region keeps its header, key
/// table and index (the index of a default geometry for its size, and at
/// least 64 MiB): a create that died between sizing the file and writing the
/// header. A region whose header alone was damaged still has slots there,
/// and is refused rather than recreated. (Read only on this rare path.)
fn unfinished_create(file: &File) -> bool {
    use std::os::unix::fs::FileExt;
    let size = file.metadata().map_or(0, |m| m.len());
    let index_end =
        Geometry::for_memory(size, None).map_or(0, |g| g.index_offset + g.index_bytes());
    let len = size.min(index_end.max(64 << 20));
    let mut buf = vec![0u8; 1 << 20];
    let mut at = 0;
    while at < len {
        let n = (len - at).min(buf.len() as u64) as usize;
        if file.read_exact_at(&mut buf[..n], at).is_err() || buf[..n].iter().any(|&b| b != 0) {
            return false;
        }
        at += n as u64;
    }
    true
}

/// Makes the region in `file` at `path`, which `existed` before this
/// start (empty, or an unfinished create).
fn create(
    file: File,
    (path, existed): (&Path, bool),
    geometry: &Geometry,
    mode: u32,
    max_len: u64,
) -> Result<OpenedRegion, ServerError> {
    // Exactly `mode`, whatever the umask took away at open.
    file.set_permissions(std::fs::Permissions::from_mode(mode))
        .map_err(|e| region_error(path, e))?;
    let len = geometry.region_len;
    // Allocate every page now: a region larger than its file system fails
    // here with a clear error, not later with SIGBUS in a client. Then
    // huge pages: nobody has the region yet, so they cost no copy.
    let refused = |reason: String| {
        // Ours to remove if this start made it; else left empty, as found
        // (or as an unfinished create was): we hold its lock.
        let _ = match existed {
            false => std::fs::remove_file(path),
            true => file.set_len(0),
        };
        region_error(path, reason)
    };
    let cannot_allocate =
        |e: std::io::Error| refused(format!("cannot allocate {len} bytes for the region: {e}"));
    // Emptied first: an unfinished create's pages count as used.
    file.set_len(0).map_err(|e| refused(e.to_string()))?;
    check_room(&file, len).map_err(cannot_allocate)?;
    file.set_len(len).map_err(|e| refused(e.to_string()))?;
    let region =
        SharedRegion::from_file(&file, path, max_len).map_err(|e| refused(e.to_string()))?;
    let pages = region.allocate_all().map_err(cannot_allocate)?;
    say_pages(&pages, path);
    header::write_geometry(&region, geometry).map_err(|e| region_error(path, e))?;
    Ok(OpenedRegion {
        region,
        geometry: *geometry,
        created: true,
        lock: file,
    })
}

fn lock_exclusive(file: &File, path: &Path) -> Result<(), ServerError> {
    // SAFETY: flock on a descriptor we own.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        let reason = if e.kind() == std::io::ErrorKind::WouldBlock {
            "another server (or `kv-server check`) has it open".to_string()
        } else {
            format!("cannot lock it: {e}")
        };
        return Err(region_error(path, reason));
    }
    Ok(())
}

/// Calls `f` for every occupied slot of the index, frozen or not (server-side
/// reads only; a frozen empty slot is empty).
pub fn for_each_slot(
    region: &SharedRegion,
    g: &Geometry,
    mut f: impl FnMut(SlotPos, Slot),
) -> Result<(), TransportError> {
    for_each_word(region, g, |pos, slot| {
        if !slot.thawed().is_empty() {
            f(pos, slot)
        }
    })
}

/// Calls `f` for every non-zero word of the index: the occupied slots and
/// the frozen empty ones.
pub fn for_each_word(
    region: &SharedRegion,
    g: &Geometry,
    mut f: impl FnMut(SlotPos, Slot),
) -> Result<(), TransportError> {
    // A thousand buckets per read: one bounds check and one fence per
    // 64 KiB instead of per bucket.
    const BATCH: u64 = 1024;
    let mut words = vec![0u64; (BATCH as usize) * SLOTS_PER_BUCKET];
    let mut first = 0;
    while first < g.index_buckets() {
        let n = BATCH.min(g.index_buckets() - first);
        let batch = &mut words[..n as usize * SLOTS_PER_BUCKET];
        region.read(g.bucket_offset(first), batch)?;
        for (i, &w) in batch.iter().enumerate() {
            if w != 0 {
                let pos = SlotPos {
                    bucket: first + (i / SLOTS_PER_BUCKET) as u64,
                    index: i % SLOTS_PER_BUCKET,
                };
                f(pos, Slot(w));
            }
        }
        first += n;
    }
    Ok(())
}

/// What one scan of the index found.
pub struct IndexScan {
    /// The heap units that referenced blocks occupy.
    pub live: UnitMap,
    pub live_slots: u64,
    pub live_bytes: u64,
    /// Slots whose class or offset cannot be a block.
    pub corrupt_slots: u64,
    /// Slots with the frozen bit, empty or not.
    pub frozen_slots: u64,
}

/// Marks the block of every occupied slot; slots that cannot point at a
/// block are counted and skipped. A slot past `g`'s end whose block fits
/// the geometry `published` gives when the slot is met is a block in
/// space a growth published during the scan, which clients were then
/// handed (after the publication: so the geometry read after the slot
/// shows it): live, not marked (this scan frees nothing there), and not
/// damage. Space a growth has mapped but not published is damage there,
/// as anywhere past the region.
pub fn scan_index(
    region: &SharedRegion,
    g: &Geometry,
    published: impl Fn() -> Geometry,
) -> Result<IndexScan, TransportError> {
    let mut scan = IndexScan {
        live: UnitMap::new(g.heap_offset, g.region_len),
        live_slots: 0,
        live_bytes: 0,
        corrupt_slots: 0,
        frozen_slots: 0,
    };
    let mut first_corrupt = None;
    for_each_word(region, g, |pos, slot| {
        scan.frozen_slots += u64::from(slot.is_frozen());
        if slot.thawed().is_empty() {
            return;
        }
        let span = g.block_span(slot.thawed());
        if let Some((offset, len)) = span {
            scan.live.mark(offset, len as u64);
        }
        match span.or_else(|| published().block_span(slot.thawed())) {
            Some((_, len)) => {
                scan.live_slots += 1;
                scan.live_bytes += len as u64;
            }
            None => {
                scan.corrupt_slots += 1;
                first_corrupt.get_or_insert((pos, slot));
            }
        }
    })?;
    if let Some((pos, slot)) = first_corrupt {
        // One line per scan, however many: damage must not flood the log.
        tracing::warn!(
            corrupt_slots = scan.corrupt_slots,
            first_bucket = pos.bucket,
            first_index = pos.index,
            first_slot = format!("{:#x}", slot.0),
            "slots that cannot point at a block (`kv-server check --repair` unlinks them)"
        );
    }
    Ok(scan)
}

/// Thaws every frozen slot of an index: a resize was migrating it when its
/// server died, and the new index was never switched to. Only for a server
/// that has not admitted anyone (plain stores into slots clients CAS would
/// race with them). Returns how many slots were frozen.
pub fn thaw_index(region: &SharedRegion, g: &Geometry) -> Result<u64, TransportError> {
    let mut frozen = Vec::new();
    for_each_word(region, g, |pos, slot| {
        if slot.is_frozen() {
            frozen.push((pos, slot));
        }
    })?;
    for &(pos, slot) in &frozen {
        region.store(g.slot_offset(pos), slot.thawed().0)?;
    }
    if frozen.iter().any(|(_, slot)| !slot.thawed().is_empty()) {
        remove_duplicates(region, g)?;
    }
    Ok(frozen.len() as u64)
}

/// Empties every slot holding a copy of a key other than the one readers
/// get: the lowest copy they see (bytes, a settled counter), or where there
/// is none, the lowest pending counter; counters given up go too (the
/// rules a resize's copy keeps). Inserts that the freeze caught before they
/// had resolved their duplicates left them for the resize's copy to drop;
/// a thawed index keeps them otherwise. Only for a server that has not
/// admitted anyone.
fn remove_duplicates(region: &SharedRegion, g: &Geometry) -> Result<u64, TransportError> {
    let slots = possible_duplicates(region, g)?;
    // Per copy, its key and rank (0: readers see it, 1: pending, 2:
    // abandoned); per key, the copy kept: the first of the best rank in
    // position order, which is the lowest.
    let mut copies = Vec::new();
    let mut kept: std::collections::HashMap<Vec<u8>, (u8, SlotPos)> = Default::default();
    for (pos, slot) in slots {
        let Some(block) = read_block(region, g, slot) else {
            continue;
        };
        let Ok(view) = decode_block(&block) else {
            continue;
        };
        let rank = match view.payload {
            Payload::Counter {
                state: CounterState::Pending,
                ..
            } => 1,
            Payload::Counter {
                state: CounterState::Abandoned,
                ..
            } => 2,
            _ => 0,
        };
        let best = kept.entry(view.key.to_vec()).or_insert((rank, pos));
        if rank < best.0 {
            *best = (rank, pos);
        }
        copies.push((pos, view.key.to_vec(), rank));
    }
    let mut removed = 0;
    for (pos, key, rank) in copies {
        if rank == 2 || kept.get(&key).is_some_and(|&(_, at)| at != pos) {
            region.store(g.slot_offset(pos), 0)?;
            removed += 1;
        }
    }
    if removed > 0 {
        tracing::warn!(
            removed,
            "removed duplicate copies an interrupted resize left"
        );
    }
    Ok(removed)
}

/// The slots `remove_duplicates` must read whole: those whose key's hash
/// another slot's key shares (a key's copies share it; two keys rarely
/// do), and counters (one given up goes even alone). The rest cost a read
/// of their key, not of their value: after a copy of a shard froze its
/// whole index, a thaw of a million keys took 1.5 s when every block was
/// read and decoded, and the shard waited as long.
fn possible_duplicates(
    region: &SharedRegion,
    g: &Geometry,
) -> Result<Vec<(SlotPos, Slot)>, TransportError> {
    let mut keys: Vec<(u64, SlotPos, Slot, bool)> = Vec::new();
    let mut key = [0u8; MAX_KEY];
    for_each_slot(region, g, |pos, slot| {
        let Some((offset, _)) = g.block_span(slot) else {
            return;
        };
        // Unreadable: skipped whole too.
        if let Some((lengths, key)) = block_key(region, offset, &mut key) {
            keys.push((xxh3_64(key), pos, slot, is_counter(lengths)));
        }
    })?;
    keys.sort_unstable_by_key(|&(hash, pos, ..)| (hash, pos));
    let mut suspects = Vec::new();
    for same in keys.chunk_by(|a, b| a.0 == b.0) {
        if same.len() > 1 || same.iter().any(|&(.., counter)| counter) {
            suspects.extend(same.iter().map(|&(_, pos, slot, _)| (pos, slot)));
        }
    }
    suspects.sort_unstable_by_key(|&(pos, _)| pos);
    Ok(suspects)
}

/// The lengths word and the key of the block at `offset`, the key read into
/// `key` (None if unreadable, or longer than a key may be): a block's key
/// without its value.
pub(crate) fn block_key<'k>(
    region: &SharedRegion,
    offset: u64,
    key: &'k mut [u8; MAX_KEY],
) -> Option<(u64, &'k [u8])> {
    let mut head = [0u64; 2];
    region.read(offset, &mut head).ok()?;
    let (key_len, _) = lengths_of(head[1]);
    if key_len > MAX_KEY {
        return None;
    }
    let mut words = [0u64; MAX_KEY / 8];
    let words = &mut words[..key_len.div_ceil(8)];
    region.read(offset + BLOCK_HEADER as u64, words).ok()?;
    for (chunk, w) in key.chunks_mut(8).zip(words.iter()) {
        chunk.copy_from_slice(&w.to_le_bytes());
    }
    Some((head[1], &key[..key_len]))
}

/// A region file no server uses, locked while this lives, and its header.
struct Offline {
    _lock: File,
    region: SharedRegion,
    g: Geometry,
    header: Option<HeaderDamage>,
}

impl Offline {
    fn open(path: &Path) -> Result<Offline, ServerError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| region_error(path, e))?;
        lock_exclusive(&file, path)?;
        let region = SharedRegion::from_file(&file, path, 0).map_err(|e| region_error(path, e))?;
        let (g, header) = check_header(&region).map_err(|e| region_error(path, e))?;
        if g.region_len > region.len() {
            return Err(region_error(
                path,
                "the header says the region is larger than its file",
            ));
        }
        Ok(Offline {
            _lock: file,
            region,
            g,
            header,
        })
    }

    /// Opens the region and revokes its clients (see [`revoke_clients`]):
    /// a server that died keeps its clients' keys valid, and none may read
    /// or write what is then read (a clean shutdown revoked them already).
    fn stopped(path: &Path, settle: std::time::Duration) -> Result<Offline, ServerError> {
        let offline = Offline::open(path)?;
        revoke_clients(&offline.region, path, settle)?;
        Ok(offline)
    }
}

/// Zeroes every client key of a region no server uses, then waits
/// `settle` for the verbs its clients had under way to land.
fn revoke_clients(
    region: &SharedRegion,
    path: &Path,
    settle: std::time::Duration,
) -> Result<(), ServerError> {
    zero_keys(region, path)?;
    std::thread::sleep(settle);
    Ok(())
}

/// Zeroes every client key of the region file at `path`, whoever serves
/// it: each client's next batch there fails (over shm, every batch checks
/// its key first).
pub fn revoke_keys(path: &Path) -> Result<(), ServerError> {
    let region = SharedRegion::open(path).map_err(|e| region_error(path, e))?;
    zero_keys(&region, path)
}

fn zero_keys(region: &SharedRegion, path: &Path) -> Result<(), ServerError> {
    for i in 0..KEY_TABLE_ENTRIES {
        region
            .store(KEY_TABLE_OFFSET + i * 8, 0)
            .map_err(|e| region_error(path, e))?;
    }
    Ok(())
}

/// The index size in force in the region file at `path`.
pub fn bucket_count(path: &Path) -> Result<u64, ServerError> {
    let region = SharedRegion::open(path).map_err(|e| region_error(path, e))?;
    let (g, _) = check_header(&region).map_err(|e| region_error(path, e))?;
    Ok(g.bucket_count)
}

/// Revokes every client key of the region at `path` (which no server may
/// be serving: the file is locked), waits `settle` for their verbs under
/// way to land, then calls `f` with every key and its payload as readers
/// see it (see [`for_each_entry`]). Returns how many slots pointed at
/// blocks that fail validation (skipped). Stops at the first error `f`
/// returns.
pub fn read_entries(
    path: &Path,
    settle: std::time::Duration,
    f: impl FnMut(&[u8], &Payload<'_>) -> Result<(), String>,
) -> Result<u64, ServerError> {
    let Offline {
        _lock, region, g, ..
    } = Offline::stopped(path, settle)?;
    for_each_entry(&region, &g, f).map_err(|e| region_error(path, e))
}

/// As [`read_entries`], of a region a server is serving while clients
/// write: a key changed meanwhile may be passed with an earlier value, or
/// missed (a block reused under the read fails validation and is counted
/// as damaged). What it gives is a first copy, to be checked against a
/// [`read_entries`] once the server has stopped.
pub fn read_entries_live(
    path: &Path,
    f: impl FnMut(&[u8], &Payload<'_>) -> Result<(), String>,
) -> Result<u64, ServerError> {
    let region = SharedRegion::open(path).map_err(|e| region_error(path, e))?;
    let g = header::read_geometry(&region).map_err(|e| region_error(path, e))?;
    for_each_entry(&region, &g, f).map_err(|e| region_error(path, e))
}

/// As [`read_entries_live`], of an index a move has frozen for good (see
/// `Server::hand_over`): its slots no longer change, nor the values they
/// link, so each value passed is final. Counters still do (increments land
/// in place, pending ones settle): they are left out, and the positions of
/// their slots returned for [`read_counters_at`] once the server stopped.
pub fn read_frozen_values(
    path: &Path,
    f: impl FnMut(&[u8], &Payload<'_>) -> Result<(), String>,
) -> Result<(u64, Vec<SlotPos>), ServerError> {
    let region = SharedRegion::open(path).map_err(|e| region_error(path, e))?;
    let g = header::read_geometry(&region).map_err(|e| region_error(path, e))?;
    let mut entries = Entries::new(f);
    entries.counters = Some(Vec::new());
    for_each_slot(&region, &g, |pos, slot| {
        entries.visit(&region, &g, pos, slot)
    })
    .map_err(|e| region_error(path, e))?;
    let counters = entries.counters.take().unwrap_or_default();
    let damaged = entries.end().map_err(|e| region_error(path, e))?;
    Ok((damaged, counters))
}

/// The counters at `positions` of a frozen index (from
/// [`read_frozen_values`]), once its server has stopped: as
/// [`read_entries`] would pass them.
pub fn read_counters_at(
    path: &Path,
    settle: std::time::Duration,
    positions: &[SlotPos],
    f: impl FnMut(&[u8], &Payload<'_>) -> Result<(), String>,
) -> Result<u64, ServerError> {
    let Offline {
        _lock, region, g, ..
    } = Offline::stopped(path, settle)?;
    let mut entries = Entries::new(f);
    for &pos in positions {
        let word = region
            .load(g.slot_offset(pos))
            .map_err(|e| region_error(path, e))?;
        let slot = Slot(word);
        if !slot.thawed().is_empty() {
            entries.visit(&region, &g, pos, slot);
        }
    }
    entries.end().map_err(|e| region_error(path, e))
}

/// Calls `f` with every key of the index `g` and its payload as readers
/// see it: each key once, from its lowest visible copy (a copy with a
/// visible one below it among the key's candidate slots is skipped);
/// pending and abandoned counters are not visible. Returns how many slots
/// pointed at blocks that fail validation.
fn for_each_entry(
    region: &SharedRegion,
    g: &Geometry,
    f: impl FnMut(&[u8], &Payload<'_>) -> Result<(), String>,
) -> Result<u64, String> {
    let mut entries = Entries::new(f);
    for_each_slot(region, g, |pos, slot| entries.visit(region, g, pos, slot))
        .map_err(|e| e.to_string())?;
    entries.end()
}

/// Bytes of keys and digests in one [`keys_page`]: a page stays within a
/// control message whatever its last key's length.
const PAGE_BYTES: usize = kv_common::protocol::MAX_MESSAGE / 2;

/// Buckets one [`keys_page`] looks at, and value bytes it hashes, at
/// most: a sparse index, or one of large values, still answers quickly,
/// other clients' control messages waiting meanwhile.
const PAGE_BUCKETS: u64 = 4096;
const PAGE_VALUE_BYTES: usize = 4 << 20;

/// The keys of index `g` from bucket `from` on, each once with a digest
/// of its value as readers see it (xxh3-128 seeded by `seed`; none for a
/// counter): as many buckets as fit in a control message. Where the next
/// page starts (None: the index ended), and how many slots named blocks
/// that fail validation.
pub fn keys_page(
    region: &SharedRegion,
    g: &Geometry,
    from: u64,
    seed: u64,
) -> Result<(Vec<KeyDigest>, Option<u64>, u64), TransportError> {
    const BATCH: u64 = 64;
    let mut keys = Vec::new();
    let bytes = std::cell::Cell::new(0);
    let hashed = std::cell::Cell::new(0);
    let mut entries = Entries::new(|key: &[u8], payload: &Payload<'_>| {
        let digest = match payload {
            Payload::Bytes(value) => {
                hashed.set(hashed.get() + value.len());
                Some(xxh3_128_with_seed(value, seed))
            }
            Payload::Counter { .. } => None,
        };
        bytes.set(bytes.get() + key.len() + 24);
        keys.push(KeyDigest {
            key: key.to_vec(),
            digest,
        });
        Ok(())
    });
    let end = g.index_buckets().min(from.saturating_add(PAGE_BUCKETS));
    let mut words = vec![0u64; BATCH as usize * SLOTS_PER_BUCKET];
    let mut bucket = from;
    // Ends between buckets, once the keys fill a page.
    'page: while bucket < end {
        let n = BATCH.min(end - bucket);
        let batch = &mut words[..n as usize * SLOTS_PER_BUCKET];
        region.read(g.bucket_offset(bucket), batch)?;
        for slots in batch.chunks(SLOTS_PER_BUCKET) {
            for (index, &word) in slots.iter().enumerate() {
                let slot = Slot(word);
                if !slot.thawed().is_empty() {
                    entries.visit(region, g, SlotPos { bucket, index }, slot);
                }
            }
            bucket += 1;
            if bytes.get() > PAGE_BYTES || hashed.get() > PAGE_VALUE_BYTES {
                break 'page;
            }
        }
    }
    let damaged = entries.damaged;
    drop(entries);
    let next = (bucket < g.index_buckets()).then_some(bucket);
    Ok((keys, next, damaged))
}

/// Slots visited one at a time, each key passed to `f` from its lowest
/// visible copy.
struct Entries<F> {
    f: F,
    block: BlockBuf,
    other: BlockBuf,
    damaged: u64,
    failed: Option<String>,
    /// Some: counters are not passed, their positions are noted here.
    counters: Option<Vec<SlotPos>>,
}

impl<F: FnMut(&[u8], &Payload<'_>) -> Result<(), String>> Entries<F> {
    fn new(f: F) -> Self {
        Entries {
            f,
            block: BlockBuf::default(),
            other: BlockBuf::default(),
            damaged: 0,
            failed: None,
            counters: None,
        }
    }

    fn visit(&mut self, region: &SharedRegion, g: &Geometry, pos: SlotPos, slot: Slot) {
        if self.failed.is_some() {
            return;
        }
        let Some(view) = self.block.read(region, g, slot.thawed()) else {
            self.damaged += 1;
            return;
        };
        if let (Some(counters), Payload::Counter { .. }) = (&mut self.counters, &view.payload) {
            counters.push(pos);
            return;
        }
        if visible(&view.payload) && !lower_copy(region, g, view.key, pos, &mut self.other) {
            self.failed = (self.f)(view.key, &view.payload).err();
        }
    }

    /// How many slots named damaged blocks, or the first error of `f`.
    fn end(self) -> Result<u64, String> {
        match self.failed {
            Some(e) => Err(e),
            None => Ok(self.damaged),
        }
    }
}

/// Whether readers see a block with this payload (not a pending or
/// abandoned counter).
fn visible(payload: &Payload<'_>) -> bool {
    !matches!(
        payload,
        Payload::Counter {
            state: CounterState::Pending | CounterState::Abandoned,
            ..
        }
    )
}

/// Whether a copy of `key` that readers see lies at a lower position than
/// `pos` (readers take that one). Only slots with the key's fingerprint are
/// read, so this costs a block read for about one key in a hundred.
fn lower_copy(
    region: &SharedRegion,
    g: &Geometry,
    key: &[u8],
    pos: SlotPos,
    buf: &mut BlockBuf,
) -> bool {
    let h = KeyHash::new(key, g.bucket_count);
    (0..kv_common::layout::CANDIDATE_SLOTS)
        .map(|i| h.slot_pos(i))
        .take_while(|p| *p < pos)
        .any(|p| {
            let Ok(word) = region.load(g.slot_offset(p)) else {
                return false;
            };
            let slot = Slot(word).thawed();
            !slot.is_empty()
                && slot.fingerprint() == h.fingerprint
                && buf
                    .read(region, g, slot)
                    .is_some_and(|v| v.key == key && visible(&v.payload))
        })
}

/// A block read into buffers that are reused from one block to the next.
#[derive(Default)]
struct BlockBuf {
    words: Vec<u64>,
    bytes: Vec<u8>,
}

impl BlockBuf {
    /// The valid block `slot` points at, if any.
    fn read(
        &mut self,
        region: &SharedRegion,
        g: &Geometry,
        slot: Slot,
    ) -> Option<kv_common::layout::BlockView<'_>> {
        let (offset, len) = g.block_span(slot)?;
        self.words.resize(len / 8, 0);
        region.read(offset, &mut self.words).ok()?;
        // Word by word: a byte iterator would cost more than the read.
        self.bytes.resize(len, 0);
        for (bytes, word) in self.bytes.chunks_exact_mut(8).zip(&self.words) {
            bytes.copy_from_slice(&word.to_le_bytes());
        }
        decode_block(&self.bytes).ok()
    }
}

/// Reads the block a slot points at, if the slot can point at one.
pub(crate) fn read_block(region: &SharedRegion, g: &Geometry, slot: Slot) -> Option<Vec<u8>> {
    let (offset, len) = g.block_span(slot)?;
    let mut words = vec![0u64; len / 8];
    region.read(offset, &mut words).ok()?;
    Some(words.iter().flat_map(|w| w.to_le_bytes()).collect())
}

/// The index slots that hold a block of `key`, lowest position first (an
/// inspection for operators and tests: after concurrent inserts of one key
/// there must be exactly one).
pub fn slots_of(
    region: &SharedRegion,
    g: &Geometry,
    key: &[u8],
) -> Result<Vec<(SlotPos, Slot)>, TransportError> {
    let h = KeyHash::new(key, g.bucket_count);
    let mut found = Vec::new();
    for bucket in h.buckets() {
        let mut words = [0u64; SLOTS_PER_BUCKET];
        region.read(g.index_offset + bucket * BUCKET_BYTES, &mut words)?;
        for (index, w) in words.into_iter().enumerate() {
            let slot = Slot(w).thawed();
            if slot.is_empty() || slot.fingerprint() != h.fingerprint {
                continue;
            }
            let block = read_block(region, g, slot);
            if block.is_some_and(|b| decode_block(&b).is_ok_and(|v| v.key == key)) {
                found.push((SlotPos { bucket, index }, slot));
            }
        }
    }
    Ok(found)
}

/// One damaged slot `check` found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Damage {
    pub pos: SlotPos,
    pub slot: Slot,
    pub what: String,
}

/// Damage `check` found in the header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderDamage {
    pub what: String,
    /// The geometry of the index found in the heap, when the record in
    /// force was lost (the slots were checked against it, and `--repair`
    /// writes it).
    pub located: Option<Geometry>,
}

/// What an offline check of a region found.
#[derive(Debug, Default)]
pub struct CheckReport {
    pub header: Option<HeaderDamage>,
    /// Whether `--repair` rewrote the header.
    pub header_repaired: bool,
    pub slots: u64,
    pub damaged: Vec<Damage>,
    /// Slots emptied by `--repair`.
    pub repaired: u64,
    /// Slots with the frozen bit (thawed by `--repair`).
    pub frozen: u64,
    /// Frozen slots `--repair` thawed.
    pub thawed: u64,
}

impl CheckReport {
    pub fn is_clean(&self) -> bool {
        self.header.is_none() && self.damaged.is_empty() && self.frozen == 0
    }
}

/// What `check` does besides reporting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckMode {
    Report,
    /// Revoke every client key, wait `settle` (at least the grace period of
    /// the server that last ran, so that verbs of its clients land first),
    /// then empty the damaged slots.
    Repair {
        settle: std::time::Duration,
    },
}

/// Checks a region no server is using. Its header: both records must be
/// valid (or one never written), and the one in force not older than the
/// published epoch; when that record is lost, the index is located in the
/// heap instead. Every occupied slot: its block must lie in the heap, pass
/// its checksum, hold a key that hashes to this bucket with this
/// fingerprint, and not overlap another slot's block. With `repair`, the
/// header is rewritten and damaged slots are emptied (the file is locked,
/// so no server can be using it).
pub fn check(path: &Path, mode: CheckMode) -> Result<CheckReport, ServerError> {
    let Offline {
        _lock,
        region,
        g,
        header,
    } = Offline::open(path)?;
    if let CheckMode::Repair { settle } = mode {
        // Clients of a server that died still hold valid keys: revoke them
        // and let their verbs in flight land before looking at any slot.
        revoke_clients(&region, path, settle)?;
    }
    let mut report = CheckReport {
        header_repaired: header.is_some() && mode != CheckMode::Report,
        header,
        ..CheckReport::default()
    };
    if report.header_repaired {
        header::finish_switch(&region, &g).map_err(|e| region_error(path, e))?;
    }
    let spans = check_slots(&region, &g, &mut report).map_err(|e| region_error(path, e))?;
    report.damaged.extend(overlaps(spans));
    if let CheckMode::Repair { .. } = mode {
        repair_slots(&region, &g, &mut report).map_err(|e| region_error(path, e))?;
    }
    Ok(report)
}

/// Where a sound block lies, and the slot that references it: (offset,
/// length, position, slot).
type Span = (u64, u64, SlotPos, Slot);

/// Checks every slot on its own, counting slots and frozen bits and noting
/// damage in `report`; the spans of the sound blocks are left to check
/// against each other.
fn check_slots(
    region: &SharedRegion,
    g: &Geometry,
    report: &mut CheckReport,
) -> Result<Vec<Span>, TransportError> {
    let mut spans: Vec<Span> = Vec::new();
    for_each_word(region, g, |pos, slot| {
        // A frozen slot is an interrupted resize's, or a stray bit: the
        // next server thaws it, and so does `--repair`.
        report.frozen += u64::from(slot.is_frozen());
        let live = slot.thawed();
        if live.is_empty() {
            return;
        }
        report.slots += 1;
        let damage = |what: &str| Damage {
            pos,
            slot,
            what: what.to_string(),
        };
        let Some((offset, len)) = g.block_span(live) else {
            report
                .damaged
                .push(damage("class or offset outside the heap"));
            return;
        };
        let Some(bytes) = read_block(region, g, live) else {
            report.damaged.push(damage("unreadable"));
            return;
        };
        match decode_block(&bytes) {
            Err(e) => report.damaged.push(damage(&e.to_string())),
            Ok(view) => {
                let h = KeyHash::new(view.key, g.bucket_count);
                if h.fingerprint != live.fingerprint() || !h.buckets().contains(&pos.bucket) {
                    report
                        .damaged
                        .push(damage("key does not belong in this bucket"));
                } else {
                    spans.push((offset, len as u64, pos, slot));
                }
            }
        }
    })?;
    Ok(spans)
}

/// The slots whose blocks overlap an earlier one's.
fn overlaps(mut spans: Vec<Span>) -> Vec<Damage> {
    let mut damaged = Vec::new();
    // Sorted by offset, a block overlaps an earlier one iff it starts before
    // the furthest end seen so far (not only the previous block's end).
    spans.sort_by_key(|s| s.0);
    let mut furthest: Option<(u64, SlotPos)> = None;
    for &(offset, len, pos, slot) in &spans {
        match furthest {
            Some((end, owner)) if offset < end => damaged.push(Damage {
                pos,
                slot,
                what: format!(
                    "block overlaps the block of bucket {} slot {}",
                    owner.bucket, owner.index
                ),
            }),
            _ => {}
        }
        if furthest.is_none_or(|(end, _)| offset + len > end) {
            furthest = Some((offset + len, pos));
        }
    }
    damaged
}

/// Empties the damaged slots, thaws the index and writes the region back.
fn repair_slots(
    region: &SharedRegion,
    g: &Geometry,
    report: &mut CheckReport,
) -> Result<(), TransportError> {
    for d in &report.damaged {
        // Only the value that was found damaged is removed.
        if matches!(region.cas(g.slot_offset(d.pos), d.slot.0, 0), Ok(old) if old == d.slot.0) {
            report.repaired += 1;
        }
    }
    // After the damaged slots went (their frozen values are what they
    // were found with).
    report.thawed = thaw_index(region, g)?;
    region.flush()?;
    Ok(())
}

/// The geometry to check the slots against, and what is wrong with the
/// header: a record that fails its checks (other than one never written),
/// or a record in force lost (then the geometry is the located index's).
fn check_header(region: &SharedRegion) -> Result<(Geometry, Option<HeaderDamage>), String> {
    match header::read_geometry(region) {
        Ok(g) => {
            let mut words = [0u64; HEADER_READ_WORDS];
            region.read(0, &mut words).map_err(|e| e.to_string())?;
            let written = |at: u64| {
                let at = at as usize / 8;
                words[at..at + RECORD_WORDS].iter().any(|&w| w != 0)
            };
            let damaged = Geometry::decode_records(&words)
                .into_iter()
                .zip(RECORD_OFFSETS)
                .find_map(|(record, at)| record.err().filter(|_| written(at)));
            let header = damaged.map(|e| HeaderDamage {
                what: format!("a header record is damaged ({e}); its twin is in force"),
                located: None,
            });
            Ok((g, header))
        }
        Err(e) if e.is_damage() => {
            let located = header::locate(region)
                .map_err(|why| format!("{e}; the index could not be located: {why}"))?;
            let what = format!(
                "{e}; the index was located at offset {} with {} buckets",
                located.index_offset, located.bucket_count
            );
            Ok((
                located,
                Some(HeaderDamage {
                    what,
                    located: Some(located),
                }),
            ))
        }
        Err(e) => Err(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use kv_common::layout::{
        class_for, class_size, counter_words, encode_block, encode_counter_block,
        COUNTER_ABANDONED, COUNTER_SETTLED, MIN_BUCKETS,
    };

    use super::*;

    /// A growth that died after lengthening the file and before allocating
    /// its pages leaves holes past the header's length; a restart cuts
    /// them off, so no client meets one later.
    #[test]
    fn a_pipe_at_the_path_is_left_alone() {
        use std::os::unix::ffi::OsStrExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fifo");
        let name = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
        // SAFETY: a NUL-terminated path that outlives the call.
        assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o644) }, 0);
        let g = Geometry::for_memory(4 << 20, None).unwrap();
        let Err(e) = open_or_create(&path, &g, 0o600, 16 << 20) else {
            panic!("a pipe taken for a region");
        };
        assert!(e.to_string().contains("not a plain file"), "{e}");
        let kind = std::fs::metadata(&path).unwrap().file_type();
        assert!(!kind.is_file(), "the pipe replaced");
    }

    #[test]
    fn a_tail_left_by_a_growth_that_died_is_cut_off_at_open() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir_in("/dev/shm").unwrap();
        let path = dir.path().join("r");
        let g = Geometry::for_memory(4 << 20, None).unwrap();
        let created = open_or_create(&path, &g, 0o600, 16 << 20).unwrap();
        let len = created.geometry.region_len;
        drop(created);
        let blocks = |path: &Path| std::fs::metadata(path).unwrap().blocks() * 512;
        assert!(blocks(&path) >= len, "a new region is allocated");
        // What `SharedRegion::grow` does first.
        let file = OpenOptions::new().write(true).open(&path).unwrap();
        file.set_len(len + (4 << 20)).unwrap();
        drop(file);
        assert!(blocks(&path) < len + (4 << 20), "a tail of holes");
        let opened = open_or_create(&path, &g, 0o600, 16 << 20).unwrap();
        assert!(!opened.created);
        assert_eq!(opened.geometry.region_len, len, "the header rules");
        assert_eq!(opened.region.len(), len);
        assert_eq!(
            std::fs::metadata(&path).unwrap().len(),
            len,
            "the tail cut off"
        );
        assert!(blocks(&path) >= len, "what is left is allocated");
    }

    /// A scan that began before a growth was published meets blocks
    /// clients wrote in the grown part: live, and not damage, once the
    /// growth is published (as it is before clients get any of it); a
    /// slot in space mapped but not published, or past the region, is.
    #[test]
    fn a_block_in_space_grown_during_a_scan_is_live_and_not_damage() {
        let dir = tempfile::tempdir_in("/dev/shm").unwrap();
        let g = Geometry::for_memory(4 << 20, None).unwrap();
        let opened = open_or_create(&dir.path().join("r"), &g, 0o600, 16 << 20).unwrap();
        let (region, g) = (&opened.region, opened.geometry);
        region.grow(g.region_len + (2 << 20)).unwrap();
        let grown = Geometry {
            region_len: region.len(),
            heap_size: region.len() - g.heap_offset,
            epoch: g.epoch + 1,
            ..g
        };
        let class = class_for(1000).unwrap();
        let link = |i: usize, offset: u64| {
            let kh = KeyHash::new(format!("k{i}").as_bytes(), g.bucket_count);
            let pos = (0..kv_common::layout::CANDIDATE_SLOTS)
                .map(|c| kh.slot_pos(c))
                .find(|p| region.load(g.slot_offset(*p)).unwrap() == 0)
                .expect("a free candidate");
            let slot = Slot::new(kh.fingerprint, class, offset);
            region.store(g.slot_offset(pos), slot.0).unwrap();
        };
        link(0, g.heap_offset + g.index_bytes());
        link(1, g.region_len);
        let counts = |scan: IndexScan| (scan.live_slots, scan.live_bytes, scan.corrupt_slots);
        let block = class_size(class);
        // Published while the scan ran: the scan's geometry is the old one.
        let scan = scan_index(region, &g, || grown).unwrap();
        assert_eq!(counts(scan), (2, 2 * block, 0));
        // Mapped, but no growth published.
        let scan = scan_index(region, &g, || g).unwrap();
        assert_eq!(counts(scan), (1, block, 1));
        link(2, grown.region_len);
        let scan = scan_index(region, &g, || grown).unwrap();
        assert_eq!(counts(scan), (2, 2 * block, 1));
    }

    /// Keys listed a page at a time: every key once, with its value's
    /// digest, each page within a control message.
    #[test]
    fn pages_of_keys_list_every_key_once_each_within_a_message() {
        let dir = tempfile::tempdir().unwrap();
        let g = Geometry::for_memory(4 << 20, Some(MIN_BUCKETS << 4)).unwrap();
        let opened = open_or_create(&dir.path().join("r"), &g, 0o600, 4 << 20).unwrap();
        let (region, g) = (&opened.region, &opened.geometry);
        let mut next = g.heap_offset + g.index_bytes();
        // Keys of the largest size: a page holds a few dozen.
        let keys: Vec<Vec<u8>> = (0..100)
            .map(|i| format!("{i:04}").repeat(MAX_KEY / 4).into_bytes())
            .collect();
        for (i, key) in keys.iter().enumerate() {
            let mut block = vec![0u8; 2048];
            let used = encode_block(key, format!("v{i}").as_bytes(), &mut block);
            for (n, word) in block[..used.next_multiple_of(8)].chunks(8).enumerate() {
                let word = u64::from_le_bytes(word.try_into().unwrap());
                region.store(next + 8 * n as u64, word).unwrap();
            }
            let kh = KeyHash::new(key, g.bucket_count);
            let pos = (0..kv_common::layout::CANDIDATE_SLOTS)
                .map(|c| kh.slot_pos(c))
                .find(|p| region.load(g.slot_offset(*p)).unwrap() == 0)
                .expect("a free candidate");
            let slot = Slot::new(kh.fingerprint, class_for(used as u64).unwrap(), next);
            region.store(g.slot_offset(pos), slot.0).unwrap();
            next += 2048;
        }
        let mut listed = std::collections::HashMap::new();
        let (mut from, mut pages) = (Some(0), 0);
        while let Some(at) = from {
            let (page, after, damaged) = keys_page(region, g, at, 7).unwrap();
            assert_eq!(damaged, 0);
            let reply = kv_common::protocol::Response::Keys(kv_common::protocol::KeysPage {
                epoch: g.epoch,
                resizing: false,
                next: after,
                damaged,
                keys: page.clone(),
            });
            kv_common::protocol::encode(&reply).expect("a page within a message");
            for k in page {
                assert!(listed.insert(k.key, k.digest).is_none(), "listed twice");
            }
            assert!(after.is_none_or(|a| a > at));
            (from, pages) = (after, pages + 1);
        }
        assert!(pages > 2, "{pages} pages");
        assert_eq!(listed.len(), keys.len());
        for (i, key) in keys.iter().enumerate() {
            let value = format!("v{i}");
            let digest = xxh3_128_with_seed(value.as_bytes(), 7);
            assert_eq!(listed[key], Some(digest));
        }
    }

    /// What a thawed index keeps of a key's copies: the one readers get.
    #[test]
    fn a_thawed_index_keeps_the_copy_readers_get() {
        let dir = tempfile::tempdir().unwrap();
        // Enough buckets that the keys' candidates do not overlap.
        let g = Geometry::for_memory(4 << 20, Some(MIN_BUCKETS << 7)).unwrap();
        let opened = open_or_create(&dir.path().join("r"), &g, 0o600, 4 << 20).unwrap();
        let (region, g) = (&opened.region, &opened.geometry);
        let mut next = g.heap_offset + g.index_bytes();
        // Writes a block (bytes, or a counter in `state`) for `key` and
        // links it at the key's candidate `i`.
        let mut put = |key: &[u8], i: usize, counter: Option<u64>| {
            let mut block = vec![0u8; 256];
            let used = match counter {
                Some(state) => {
                    let used = encode_counter_block(key, 7, &mut block);
                    let at = counter_words(key.len()).0;
                    block[at..at + 8].copy_from_slice(&state.to_le_bytes());
                    used
                }
                None => encode_block(key, b"bytes", &mut block),
            };
            for (n, word) in block[..used.next_multiple_of(8)].chunks(8).enumerate() {
                let word = u64::from_le_bytes(word.try_into().unwrap());
                region.store(next + 8 * n as u64, word).unwrap();
            }
            let kh = KeyHash::new(key, g.bucket_count);
            let slot = Slot::new(kh.fingerprint, class_for(used as u64).unwrap(), next);
            region.store(g.slot_offset(kh.slot_pos(i)), slot.0).unwrap();
            next += 256;
            kh.slot_pos(i)
        };
        let pending = Some(kv_common::layout::COUNTER_PENDING);
        // Below the copy readers see: a counter given up, a pending one.
        let a = [put(b"a", 0, Some(COUNTER_ABANDONED)), put(b"a", 1, None)];
        let b = [put(b"b", 0, pending), put(b"b", 1, Some(COUNTER_SETTLED))];
        // No copy readers see: the lowest pending one.
        let c = [put(b"c", 0, pending), put(b"c", 1, pending)];
        // Plain duplicates: the lowest.
        let d = [put(b"d", 0, None), put(b"d", 1, None)];
        // A counter given up goes even alone; a lone key stays.
        let e = put(b"e", 0, Some(COUNTER_ABANDONED));
        let f = put(b"f", 1, None);
        let mut all: Vec<SlotPos> = [a, b, c, d, [e, f]].concat();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 10, "the keys' candidates overlap");
        assert_eq!(remove_duplicates(region, g).unwrap(), 5);
        let linked = |pos: SlotPos| region.load(g.slot_offset(pos)).unwrap() != 0;
        for (copies, kept) in [(a, 1), (b, 1), (c, 0), (d, 0), ([e, f], 1)] {
            for (i, &pos) in copies.iter().enumerate() {
                assert_eq!(linked(pos), i == kept, "{pos:?}");
            }
        }
    }
}
