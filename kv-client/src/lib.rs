//! The onekv client. It reaches the server's region with one-sided verbs
//! only: a GET reads the key's two windows of candidate buckets in one batch
//! and the matching block in a second (one batch for both, for a key whose
//! slot it has seen, when slot hints are on); a PUT writes its block out of
//! place in the same batch as the bucket reads and publishes it with a CAS on
//! the slot. When the server resizes the index or grows the region, the
//! client notices (a frozen slot, a block past the region it knows) and
//! learns the new geometry before going on.
//!
//! ```no_run
//! let mut kv = kv_client::Client::connect("shm:///dev/shm/onekv")?;
//! kv.put(b"user1", b"hello")?;
//! assert_eq!(kv.get(b"user1")?.as_deref(), Some(&b"hello"[..]));
//! kv.delete(b"user1")?;
//! # Ok::<(), kv_client::Error>(())
//! ```
//!
//! A `Client` is one connection; give each thread its own.

use std::time::{Duration, Instant};

use kv_common::layout::{
    block_len, class_for, class_size, decode_block, encode_block, Geometry, KeyHash, Slot, SlotPos,
    BUCKET_BYTES, CANDIDATE_SLOTS, EPOCH_OFFSET, MAX_KEY, WINDOW_BUCKETS,
};
use kv_common::protocol::{
    ConnectInfo, ErrorKind, Extent, GeometryInfo, Request, Response, ServerStats, PROTOCOL_VERSION,
};
use kv_common::transport::{self, read_u64, Connection, Verb, VerbStats};
use kv_common::Address;

mod alloc;
mod corrupt;
mod error;
mod slot_cache;

use alloc::BlockAllocator;
use corrupt::CorruptSlot;
pub use error::Error;
use slot_cache::SlotCache;

pub type Result<T> = std::result::Result<T, Error>;

/// Local buffer layout: both windows of buckets, the region's epoch word, a
/// CAS result, the block being written, then room for candidate blocks.
const BUCKETS_AT: usize = 0;
const WINDOW_BYTES: usize = WINDOW_BUCKETS * BUCKET_BYTES as usize;
const EPOCH_AT: usize = 2 * WINDOW_BYTES;
const CAS_AT: usize = EPOCH_AT + 8;
const BLOCK_AT: usize = 512;
const SLOTS: usize = CANDIDATE_SLOTS;
/// How long a writer waits for a resize to publish the new index (the
/// server answers meanwhile that it is resizing; doubling an index of 10^8
/// keys, or a large one over a slow fabric, takes minutes).
const RESIZE_WAIT: Duration = Duration::from_secs(600);
/// How long a PUT waits for heap space while the server reclaims or grows.
const SPACE_WAIT: Duration = Duration::from_secs(30);

#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// Presented at connect when the server requires a secret.
    pub secret: Option<Vec<u8>>,
    /// Attempts of one operation under contention before giving up.
    pub max_attempts: u32,
    /// Fault injection for tests: after reading the index, before reading the
    /// blocks it points at (and so before any CAS based on it), sleep as a
    /// client on a slow or preempted host would: one time in four this long,
    /// otherwise up to a quarter of it.
    pub pause_after_index_read: Option<Duration>,
    /// Keys whose slot position is remembered, so that a GET of a key seen
    /// before takes one round trip instead of two and an update two instead
    /// of three (0 turns it off). None: 65 536 over rdma, where a round trip
    /// costs microseconds; off over shm, where it costs about what the
    /// lookup does (measured with `kv-bench micro --slot-cache-entries`).
    pub slot_cache_entries: Option<usize>,
    /// How long to wait for the server's reply to a control message
    /// (connect, lease, stats) before giving the connection up.
    pub reply_timeout: Duration,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            secret: None,
            max_attempts: 10_000,
            pause_after_index_read: None,
            slot_cache_entries: None,
            reply_timeout: transport::DEFAULT_REPLY_TIMEOUT,
        }
    }
}

pub struct Client {
    address: Address,
    options: ClientOptions,
    conn: Box<dyn Connection>,
    info: ConnectInfo,
    deadline: Duration,
    max_block: usize,
    max_value: usize,
    alloc: BlockAllocator,
    /// Verb counters of connections replaced after a server restart.
    retired_stats: VerbStats,
    jitter: u64,
    cache: SlotCache,
    reconnects: u64,
}

/// A remembered slot of a key, and the READ of its block.
struct Hint {
    pos: SlotPos,
    slot: Slot,
    read: Verb,
}

/// Result of reading a key's candidate blocks.
enum Scan {
    /// Saw something inconsistent: start again from the buckets. Names the
    /// slot whose block failed validation, if that was the reason (None: the
    /// reads took too long to be trusted).
    Retry(Option<(SlotPos, Slot)>),
    /// Slots holding the key, lowest position first.
    Found(Vec<(SlotPos, Slot)>),
    /// The geometry changed since the buckets were read: they may be stale.
    Moved,
}

/// How one attempt at an operation ended.
enum Step<T> {
    Done(T),
    /// The index is being resized or was replaced (a frozen slot, a newer
    /// epoch): learn the new geometry, then redo the operation.
    Moved,
    /// No room for the key: ask for a resize, then redo it.
    Full,
}

/// What the index read of an operation shows about the geometry.
fn meets_resize(slots: &[Slot; SLOTS]) -> bool {
    slots.iter().any(|s| s.is_frozen())
}

impl Client {
    pub fn connect(address: &str) -> Result<Client> {
        Client::connect_with(address, ClientOptions::default())
    }

    pub fn connect_with(address: &str, options: ClientOptions) -> Result<Client> {
        let address = Address::parse(address).map_err(Error::Unreachable)?;
        let (conn, info) = open(&address, &options)?;
        let cache_entries = options.slot_cache_entries.unwrap_or(match address {
            Address::Rdma { .. } => 65_536,
            Address::Shm { .. } => 0,
        });
        let g = info.geometry;
        let max_value = g.max_value();
        let max_block = max_block(&g);
        let deadline = Duration::from_micros(info.op_deadline_us);
        Ok(Client {
            address,
            options,
            conn,
            info,
            deadline,
            max_block,
            max_value,
            alloc: BlockAllocator::default(),
            retired_stats: VerbStats::default(),
            jitter: 0x853c_49e6_748f_ea9b,
            cache: SlotCache::new(cache_entries),
            reconnects: 0,
        })
    }

    pub fn address(&self) -> &Address {
        &self.address
    }

    pub fn geometry(&self) -> &Geometry {
        &self.info.geometry
    }

    /// Largest value this server accepts.
    pub fn max_value(&self) -> usize {
        self.max_value
    }

    /// Verbs, round trips and bytes this client has used so far.
    pub fn verb_stats(&self) -> VerbStats {
        let mut s = self.retired_stats;
        s.add(self.conn.stats());
        s
    }

    /// How many times this client replaced a lost connection (a server
    /// restart, a fence, a broken control channel) and redid an operation.
    pub fn reconnects(&self) -> u64 {
        self.reconnects
    }

    /// The server's counters (a control message, not the data path).
    pub fn server_stats(&mut self) -> Result<ServerStats> {
        match self.conn.call(&Request::Stats)? {
            Response::Stats(s) => Ok(s),
            other => Err(unexpected(other)),
        }
    }

    /// The value of `key`, or None.
    pub fn get(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        let mut out = Vec::new();
        Ok(self.get_into(key, &mut out)?.then_some(out))
    }

    /// Reads the value of `key` into `out` (reusing its allocation); false if
    /// there is no such key.
    pub fn get_into(&mut self, key: &[u8], out: &mut Vec<u8>) -> Result<bool> {
        self.check_key(key)?;
        self.run(|c| c.get_once(key, out))
    }

    /// Stores `value` under `key`, replacing any earlier value.
    pub fn put(&mut self, key: &[u8], value: &[u8]) -> Result<()> {
        self.check_key(key)?;
        if value.len() > self.max_value {
            return Err(Error::ValueTooLarge {
                len: value.len(),
                max: self.max_value,
            });
        }
        self.run(|c| c.put_once(key, value))
    }

    /// Removes `key`; false if it was not there.
    pub fn delete(&mut self, key: &[u8]) -> Result<bool> {
        self.check_key(key)?;
        // Survives a redo: if the first attempt unlinked the key before its
        // connection was lost, the redo finds nothing but the key was there.
        let mut unlinked = false;
        self.run(|c| c.delete_once(key, &mut unlinked))
    }

    /// Asks the server to double the index now (it also does so by itself
    /// when the index fills) and waits until the new one is in force.
    pub fn resize(&mut self) -> Result<Geometry> {
        let before = self.info.geometry.bucket_count;
        // The heap growing meanwhile is a newer epoch too: ask again.
        while self.info.geometry.bucket_count == before {
            self.follow_geometry(true)?;
        }
        Ok(self.info.geometry)
    }

    fn check_key(&self, key: &[u8]) -> Result<()> {
        if key.is_empty() {
            return Err(Error::EmptyKey);
        }
        if key.len() > MAX_KEY {
            return Err(Error::KeyTooLarge {
                len: key.len(),
                max: MAX_KEY,
            });
        }
        Ok(())
    }

    /// Runs an operation until it is done. After a resize or growth it
    /// learns the new geometry and runs it again; if its connection is gone
    /// (the server restarted, cut this client off, or the control channel
    /// broke), it reconnects once and runs it again from the start. Every
    /// step of an operation is safe to redo: a block written but not
    /// published is garbage, and a PUT published before the failure is found
    /// and updated (or deduplicated).
    fn run<T>(&mut self, mut op: impl FnMut(&mut Self) -> Result<Step<T>>) -> Result<T> {
        let mut reconnected = false;
        let mut stalled: Option<Instant> = None;
        loop {
            match op(self) {
                Ok(Step::Done(v)) => return Ok(v),
                Ok(Step::Moved) => {
                    if self.follow_geometry(false)? {
                        stalled = None;
                        continue;
                    }
                    // Frozen slots but no resize under way: the server is
                    // undoing a failed one. Wait for it, not forever.
                    let since = *stalled.get_or_insert_with(Instant::now);
                    if since.elapsed() > RESIZE_WAIT {
                        return Err(Error::Protocol(
                            "index slots stay frozen with no resize under way".into(),
                        ));
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                Ok(Step::Full) => {
                    self.follow_geometry(true)?;
                }
                Err(e) if e.is_connection_lost() && !reconnected => {
                    reconnected = true;
                    self.reconnect()?;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Learns the server's current geometry; with `resize`, first asks for a
    /// resize of the index this client knows. Waits while a resize is under
    /// way for it to publish the new index. Returns once the geometry is newer
    /// than the one this client had (true), or (without `resize`) nothing
    /// newer is coming (false).
    fn follow_geometry(&mut self, resize: bool) -> Result<bool> {
        let epoch = self.info.geometry.epoch;
        let give_up = Instant::now() + RESIZE_WAIT;
        let backoff = crossbeam::utils::Backoff::new();
        loop {
            let request = if resize {
                Request::Resize { epoch }
            } else {
                Request::Geometry
            };
            let info = match self.conn.call(&request)? {
                Response::Geometry(info) => info,
                other => return Err(unexpected(other)),
            };
            if info.geometry.epoch != epoch {
                self.adopt(info)?;
                return Ok(true);
            }
            if !info.resizing && !resize {
                return Ok(false);
            }
            if Instant::now() > give_up {
                return Err(Error::Protocol(format!(
                    "the server's index resize did not finish within {RESIZE_WAIT:?}"
                )));
            }
            // Spin briefly, then sleep: a resize takes milliseconds to seconds.
            if backoff.is_completed() {
                std::thread::sleep(Duration::from_millis(2));
            } else {
                backoff.snooze();
            }
        }
    }

    /// Waits out a resize met in the middle of an insert's duplicate check:
    /// true if a new index was published (its copy kept the lowest copy),
    /// false if the index is the same (the heap grew, or the resize was
    /// undone) and the check goes on here.
    fn follow_to_new_index(&mut self) -> Result<bool> {
        let before = (
            self.info.geometry.index_offset,
            self.info.geometry.bucket_count,
        );
        self.follow_geometry(false)?;
        let g = &self.info.geometry;
        Ok((g.index_offset, g.bucket_count) != before)
    }

    /// Switches to a new geometry: what was remembered about slots is
    /// dropped, and a grown region is mapped (or its new key taken).
    fn adopt(&mut self, info: GeometryInfo) -> Result<()> {
        info.geometry
            .validate()
            .map_err(|e| Error::Protocol(e.to_string()))?;
        if info.geometry.chunk_size != self.info.geometry.chunk_size {
            return Err(Error::Protocol("the region's chunk size changed".into()));
        }
        if info.region != self.info.region {
            let local_len = self.conn.local().len();
            self.conn.attach(&info.region, local_len)?;
            self.info.region = info.region;
        }
        self.info.geometry = info.geometry;
        self.cache.clear();
        Ok(())
    }

    /// Replaces the connection. The old one's leases are dropped: the
    /// server reclaims them once it has fenced the old connection.
    fn reconnect(&mut self) -> Result<()> {
        // Close the old channel first: the server then frees its client slot
        // (and its space) sooner, and the new connect is not refused for
        // the old one still counting against the limit.
        self.retired_stats.add(self.conn.stats());
        self.conn = Box::new(transport::Closed);
        self.alloc.reset();
        self.cache.clear();
        let (conn, info) = open(&self.address, &self.options)?;
        if info.geometry.chunk_size != self.info.geometry.chunk_size {
            return Err(Error::Protocol(
                "the region's chunk size changed across a restart".into(),
            ));
        }
        self.reconnects += 1;
        self.conn = conn;
        self.info = info;
        Ok(())
    }

    fn get_once(&mut self, key: &[u8], out: &mut Vec<u8>) -> Result<Step<bool>> {
        let kh = KeyHash::new(key, self.info.geometry.bucket_count);
        if self.get_cached(key, &kh, out)? {
            return Ok(Step::Done(true));
        }
        let mut corrupt = CorruptSlot::default();
        for _ in 0..self.options.max_attempts {
            let started = Instant::now();
            self.conn.post(&self.bucket_reads(&kh))?;
            let slots = self.bucket_slots();
            let scan = self.scan(key, &kh, &slots, started, true, None, |v| {
                out.clear();
                out.extend_from_slice(v);
            })?;
            match scan {
                Scan::Found(found) => {
                    match found.first() {
                        Some(&(pos, slot)) if !slot.is_frozen() => {
                            self.cache.remember(key, pos, slot)
                        }
                        _ => self.cache.forget(key),
                    }
                    return Ok(Step::Done(!found.is_empty()));
                }
                Scan::Retry(suspect) => corrupt.saw(key, suspect)?,
                Scan::Moved => return Ok(Step::Moved),
            }
        }
        Err(Error::Contended(self.options.max_attempts))
    }

    /// A GET in one round trip for a key whose slot this client has seen:
    /// one batch reads both windows and, after them, the remembered block
    /// (see [`Client::hinted_block`]); on a stale hint, false and a full GET.
    fn get_cached(&mut self, key: &[u8], kh: &KeyHash, out: &mut Vec<u8>) -> Result<bool> {
        let Some(hint) = self.usable_hint(key) else {
            return Ok(false);
        };
        let started = Instant::now();
        let [a, b] = self.bucket_reads(kh);
        self.conn.post(&[a, b, hint.read])?;
        let slots = self.bucket_slots();
        match self.hinted_block(key, kh, &slots, &hint, started) {
            Some(value) => {
                out.clear();
                out.extend_from_slice(value);
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// The remembered slot of `key` and the READ of its block, if the block
    /// fits the heap and the local buffer.
    fn usable_hint(&mut self, key: &[u8]) -> Option<Hint> {
        let (pos, slot) = self.cache.get(key)?;
        let local = BLOCK_AT + self.max_block;
        let span = self.info.geometry.block_span(slot);
        let Some((remote, len)) = span.filter(|&(_, len)| local + len <= self.conn.local().len())
        else {
            self.cache.forget(key);
            return None;
        };
        let read = Verb::Read { remote, local, len };
        Some(Hint { pos, slot, read })
    }

    /// After a batch that read both windows and then the hinted block (the
    /// READs of a batch execute in order, on an RC queue pair as on shm):
    /// the key's value, if the slot still holds the remembered value, no
    /// lower slot could hold the key, the block is the key's and it was all
    /// read within the deadline -- exactly what reading the buckets and then
    /// the block would have concluded. Otherwise the hint is dropped.
    fn hinted_block(
        &mut self,
        key: &[u8],
        kh: &KeyHash,
        slots: &[Slot; SLOTS],
        hint: &Hint,
        started: Instant,
    ) -> Option<&[u8]> {
        let Some(at) = kh.slot_index(hint.pos) else {
            self.cache.forget(key);
            return None;
        };
        let lower_candidate = slots[..at]
            .iter()
            .any(|s| !s.is_empty() && s.fingerprint() == kh.fingerprint);
        let Verb::Read { local, len, .. } = hint.read else {
            return None;
        };
        let in_time = started.elapsed() <= self.deadline;
        let value = if in_time && slots[at] == hint.slot && !lower_candidate {
            let block = &self.conn.local()[local..local + len];
            decode_block(block).ok().filter(|v| v.key == key).map(|v| {
                let start = local + (v.value.as_ptr() as usize - block.as_ptr() as usize);
                start..start + v.value.len()
            })
        } else {
            None
        };
        match value {
            Some(range) => Some(&self.conn.local()[range]),
            None => {
                if in_time {
                    self.cache.forget(key);
                }
                None
            }
        }
    }

    fn put_once(&mut self, key: &[u8], value: &[u8]) -> Result<Step<()>> {
        let used = block_len(key.len(), value.len());
        let class = class_for(used).ok_or(Error::ValueTooLarge {
            len: value.len(),
            max: self.max_value,
        })?;
        // First: leasing may teach this client a new geometry.
        let offset = self.take_block(class)?;
        let kh = KeyHash::new(key, self.info.geometry.bucket_count);
        encode_block(key, value, &mut self.conn.local_mut()[BLOCK_AT..]);
        let new = Slot::new(kh.fingerprint, class, offset);
        let write = Verb::Write {
            remote: offset,
            local: BLOCK_AT,
            len: used.div_ceil(8) as usize * 8,
        };
        // A block that is never published is garbage the server reclaims.
        self.publish(key, &kh, new, write)
    }

    /// Writes the block (with the first bucket read) and CASes it into the
    /// key's slot, or an empty one.
    fn publish(&mut self, key: &[u8], kh: &KeyHash, new: Slot, write: Verb) -> Result<Step<()>> {
        let mut pending_write = Some(write);
        // With a hint, the first batch also reads the key's current block,
        // so an update takes two round trips instead of three.
        let mut hint = self.usable_hint(key);
        let mut corrupt = CorruptSlot::default();
        for _ in 0..self.options.max_attempts {
            let started = Instant::now();
            let [a, b] = self.bucket_reads(kh);
            let mut verbs = Vec::with_capacity(4);
            verbs.extend(pending_write.take());
            verbs.extend([a, b]);
            verbs.extend(hint.as_ref().map(|h| h.read));
            self.conn.post(&verbs)?;
            let slots = self.bucket_slots();
            // A resize is moving these buckets: writing waits for the new index.
            if meets_resize(&slots) {
                return Ok(Step::Moved);
            }
            let confirmed = match hint.take() {
                Some(h) => self
                    .hinted_block(key, kh, &slots, &h, started)
                    .is_some()
                    .then_some(h),
                None => None,
            };
            let found = match confirmed {
                Some(h) => vec![(h.pos, h.slot)],
                None => match self.scan(key, kh, &slots, started, false, None, |_| {})? {
                    Scan::Retry(suspect) => {
                        corrupt.saw(key, suspect)?;
                        continue;
                    }
                    Scan::Found(found) => found,
                    Scan::Moved => return Ok(Step::Moved),
                },
            };
            if let Some(&(pos, old)) = found.first() {
                if started.elapsed() > self.deadline {
                    continue;
                }
                if self.cas(pos, old, new)? {
                    self.cache.remember(key, pos, new);
                    // Copies above ours belong to inserts still in flight,
                    // which remove them themselves; trying here only helps.
                    self.remove_duplicates(&found[1..], started)?;
                    return Ok(Step::Done(()));
                }
                continue;
            }
            let Some(empty) = KeyHash::insert_choice(&slots) else {
                return Ok(Step::Full);
            };
            let pos = kh.slot_pos(empty);
            if self.cas(pos, Slot::EMPTY, new)? {
                // A hint even if this copy is resolved away: GETs check it.
                self.cache.remember(key, pos, new);
                self.resolve_insert(key, kh, pos, new)?;
                return Ok(Step::Done(()));
            }
        }
        Err(Error::Contended(self.options.max_attempts))
    }

    /// After inserting into an empty slot: another client may have inserted
    /// the same key elsewhere at the same time. The lowest slot position
    /// wins. This insert does not return until it has seen at most one copy
    /// left: a copy that changed under the removing CAS, or an update that
    /// landed on our slot meanwhile, is read again. So extra copies exist
    /// only while the PUTs that made them are in flight. (A client that saw
    /// a higher copy but not the lowest read before the lowest was inserted,
    /// so its operation is concurrent with that insert and ordered before it.)
    /// If a resize freezes the buckets first, its copy keeps the lowest copy
    /// (this waits until it is published); if the resize is undone, the
    /// resolution goes on here.
    fn resolve_insert(&mut self, key: &[u8], kh: &KeyHash, mine: SlotPos, new: Slot) -> Result<()> {
        let inserted = Instant::now();
        let mut corrupt = CorruptSlot::default();
        let Some(my_index) = kh.slot_index(mine) else {
            return Err(Error::Protocol("inserted outside the key's buckets".into()));
        };
        for _ in 0..self.options.max_attempts {
            let started = Instant::now();
            self.conn.post(&self.bucket_reads(kh))?;
            let slots = self.bucket_slots();
            if meets_resize(&slots) {
                if self.follow_to_new_index()? {
                    return Ok(());
                }
                std::thread::sleep(Duration::from_millis(1));
                continue;
            }
            // Our own block cannot have been unlinked and reused for another
            // key sooner than a grace period after we published it.
            let known = (inserted.elapsed() < self.deadline).then_some(new);
            let found = match self.scan(key, kh, &slots, started, false, known, |_| {})? {
                Scan::Retry(suspect) => {
                    corrupt.saw(key, suspect)?;
                    continue;
                }
                Scan::Found(found) => found,
                Scan::Moved => {
                    if self.follow_to_new_index()? {
                        return Ok(());
                    }
                    continue;
                }
            };
            let ours_is_higher =
                slots[my_index] == new && found.first().is_some_and(|&(lowest, _)| lowest != mine);
            if ours_is_higher {
                if started.elapsed() <= self.deadline && self.cas(mine, new, Slot::EMPTY)? {
                    return Ok(());
                }
            } else if self.remove_duplicates(found.get(1..).unwrap_or(&[]), started)? {
                return Ok(());
            }
        }
        Err(Error::Contended(self.options.max_attempts))
    }

    fn delete_once(&mut self, key: &[u8], unlinked: &mut bool) -> Result<Step<bool>> {
        let kh = KeyHash::new(key, self.info.geometry.bucket_count);
        self.cache.forget(key);
        let mut corrupt = CorruptSlot::default();
        for _ in 0..self.options.max_attempts {
            let started = Instant::now();
            self.conn.post(&self.bucket_reads(&kh))?;
            let slots = self.bucket_slots();
            if meets_resize(&slots) {
                return Ok(Step::Moved);
            }
            let found = match self.scan(key, &kh, &slots, started, false, None, |_| {})? {
                Scan::Retry(suspect) => {
                    corrupt.saw(key, suspect)?;
                    continue;
                }
                Scan::Found(found) => found,
                Scan::Moved => return Ok(Step::Moved),
            };
            let Some(&(pos, old)) = found.first() else {
                return Ok(Step::Done(*unlinked));
            };
            // Extra copies first, the lowest (the one readers return) last:
            // a copy left behind would become the lowest and bring back an
            // older value. One that changed or froze meanwhile: read again.
            if !self.remove_duplicates(&found[1..], started)? {
                continue;
            }
            if started.elapsed() > self.deadline {
                continue;
            }
            if self.cas(pos, old, Slot::EMPTY)? {
                *unlinked = true;
                return Ok(Step::Done(true));
            }
        }
        Err(Error::Contended(self.options.max_attempts))
    }

    /// Empties slots that hold extra copies of a key (verified by `scan`
    /// within the deadline that began at `started`), highest first. False if
    /// any could not be removed: it changed since it was read, or time ran
    /// out.
    fn remove_duplicates(&mut self, dups: &[(SlotPos, Slot)], started: Instant) -> Result<bool> {
        for &(pos, slot) in dups.iter().rev() {
            if started.elapsed() > self.deadline || !self.cas(pos, slot, Slot::EMPTY)? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// The READs of the key's two windows of buckets (one each).
    fn bucket_reads(&self, kh: &KeyHash) -> [Verb; 2] {
        let g = &self.info.geometry;
        std::array::from_fn(|w| Verb::Read {
            remote: g.bucket_offset(kh.windows[w]),
            local: BUCKETS_AT + w * WINDOW_BYTES,
            len: WINDOW_BYTES,
        })
    }

    fn bucket_slots(&self) -> [Slot; SLOTS] {
        let local = self.conn.local();
        std::array::from_fn(|i| Slot(read_u64(local, BUCKETS_AT + i * 8)))
    }

    fn cas(&mut self, pos: SlotPos, expect: Slot, swap: Slot) -> Result<bool> {
        let remote = self.info.geometry.slot_offset(pos);
        self.conn.post(&[Verb::Cas {
            remote,
            local: CAS_AT,
            expect: expect.0,
            swap: swap.0,
        }])?;
        Ok(read_u64(self.conn.local(), CAS_AT) == expect.0)
    }

    /// Reads the blocks of slots whose fingerprint matches and keeps those
    /// that pass the checksum and hold `key`. `on_value` sees the value of
    /// the lowest match; with `first_only` the scan stops there. A slot equal
    /// to `known` is taken to hold the key without reading its block.
    ///
    /// A slot that cannot point at a block, or whose block fails validation,
    /// is skipped; if the key is not found elsewhere the scan asks for a
    /// retry, naming that slot (see [`CorruptSlot`]).
    ///
    /// Frozen slots (a resize is migrating these buckets) are followed as
    /// usual, and so may a slot pointing past the region this client knows
    /// (it grew): both are trusted only if the epoch word, read in the same
    /// batch as the blocks and so after the buckets, shows no newer geometry
    /// — the buckets were then read before the new index was published.
    #[allow(clippy::too_many_arguments)]
    fn scan(
        &mut self,
        key: &[u8],
        kh: &KeyHash,
        slots: &[Slot; SLOTS],
        started: Instant,
        first_only: bool,
        known: Option<Slot>,
        mut on_value: impl FnMut(&[u8]),
    ) -> Result<Scan> {
        let g = self.info.geometry;
        let reads_at = BLOCK_AT + self.max_block;
        let room = self.conn.local().len() - reads_at;
        let mut found = Vec::new();
        let mut suspect: Option<(SlotPos, Slot)> = None;
        let mut candidates: Vec<(usize, Slot, u64, usize)> = Vec::new();
        let mut check_epoch = meets_resize(slots);
        for (i, &s) in slots.iter().enumerate() {
            let live = s.thawed();
            if live.is_empty() || live.fingerprint() != kh.fingerprint {
                continue;
            }
            if Some(s) == known {
                found.push((kh.slot_pos(i), s));
                continue;
            }
            // No client writes a block larger than `max_block` (< room).
            match g.block_span(live).filter(|&(_, len)| len <= room) {
                Some((offset, len)) => candidates.push((i, s, offset, len)),
                None => {
                    // Past the region this client knows: it may have grown.
                    check_epoch |= live
                        .block_len()
                        .is_some_and(|len| live.offset().saturating_add(len) > g.region_len);
                    suspect.get_or_insert((kh.slot_pos(i), s));
                }
            }
        }
        self.pause_if_slow();
        let epoch_read = Verb::Read {
            remote: EPOCH_OFFSET,
            local: EPOCH_AT,
            len: 8,
        };
        if candidates.is_empty() && check_epoch {
            self.conn.post(&[epoch_read])?;
            if read_u64(self.conn.local(), EPOCH_AT) != g.epoch {
                return Ok(Scan::Moved);
            }
        }
        let mut next = 0;
        while next < candidates.len() {
            let mut verbs = Vec::new();
            if check_epoch {
                verbs.push(epoch_read);
            }
            let first = verbs.len();
            let mut at = reads_at;
            while let Some(&(_, _, remote, len)) = candidates.get(next) {
                if verbs.len() > first && at + len > reads_at + room {
                    break;
                }
                verbs.push(Verb::Read {
                    remote,
                    local: at,
                    len,
                });
                at += len;
                next += 1;
            }
            self.conn.post(&verbs)?;
            if check_epoch && read_u64(self.conn.local(), EPOCH_AT) != g.epoch {
                return Ok(Scan::Moved);
            }
            if started.elapsed() > self.deadline {
                // Too slow to trust anything read: a block may have been
                // freed and rewritten (even for another key) since the slot
                // was read, so not even "not found" can be concluded.
                return Ok(Scan::Retry(None));
            }
            let local = self.conn.local();
            let mut at = reads_at;
            let batch = verbs.len() - first;
            for &(i, slot, _, len) in &candidates[next - batch..next] {
                let block = &local[at..at + len];
                at += len;
                // Read within the deadline, a block its slot still referenced
                // when the buckets were read cannot have been reused yet: a
                // failure here is damage, or a race a retry resolves.
                let Ok(view) = decode_block(block) else {
                    suspect.get_or_insert((kh.slot_pos(i), slot));
                    continue;
                };
                if view.key != key {
                    continue;
                }
                if found.is_empty() {
                    on_value(view.value);
                }
                found.push((kh.slot_pos(i), slot));
                if first_only {
                    return Ok(Scan::Found(found));
                }
            }
        }
        if found.is_empty() && suspect.is_some() {
            return Ok(Scan::Retry(suspect));
        }
        found.sort_by_key(|&(pos, _)| pos);
        Ok(Scan::Found(found))
    }

    fn pause_if_slow(&mut self) {
        if let Some(max) = self.options.pause_after_index_read {
            self.jitter ^= self.jitter << 13;
            self.jitter ^= self.jitter >> 7;
            self.jitter ^= self.jitter << 17;
            let pause = match self.jitter % 4 {
                0 => max,
                _ => Duration::from_micros(self.jitter % (max.as_micros() as u64 / 4 + 1)),
            };
            std::thread::sleep(pause);
        }
    }

    /// A block of `class`. When no leased extent has room, what this client
    /// holds is given back (the server keeps the blocks in it that the index
    /// references) and a new extent is leased. While the server is
    /// reclaiming space it waits; it fails only when the heap is full.
    fn take_block(&mut self, class: u8) -> Result<u64> {
        if let Some(offset) = self.alloc.take(class) {
            return Ok(offset);
        }
        let spent = self.alloc.drain();
        if !spent.is_empty() {
            self.give_back(spent)?;
        }
        let size = class_size(class);
        let grace = self.deadline * 4;
        let give_up = Instant::now() + SPACE_WAIT;
        loop {
            match self.conn.call(&Request::Lease { min_len: size })? {
                Response::Leased(extents) => {
                    self.alloc.add_extents(&extents);
                    // Space the region grew by: learn its geometry first.
                    let end = extents.iter().map(|e| e.offset + e.len).max();
                    if end.is_some_and(|end| end > self.info.geometry.region_len) {
                        self.follow_geometry(false)?;
                    }
                    if let Some(offset) = self.alloc.take(class) {
                        return Ok(offset);
                    }
                    return Err(Error::Protocol(format!(
                        "leased {extents:?}, no room for a {size}-byte block"
                    )));
                }
                Response::Error {
                    kind: ErrorKind::HeapBusy,
                    ..
                } if Instant::now() < give_up => {
                    std::thread::sleep((grace / 8).max(Duration::from_millis(1)));
                }
                Response::Error {
                    kind: ErrorKind::HeapFull | ErrorKind::HeapBusy,
                    message,
                } => {
                    return Err(Error::RegionFull {
                        size,
                        reason: message,
                    })
                }
                other => return Err(unexpected(other)),
            }
        }
    }

    fn give_back(&mut self, extents: Vec<Extent>) -> Result<()> {
        // Stay well inside the control message size limit.
        for part in extents.chunks(2048) {
            match self.conn.call(&Request::GiveBack {
                extents: part.to_vec(),
            })? {
                Response::GivenBack => {}
                other => return Err(unexpected(other)),
            }
        }
        Ok(())
    }

    /// Says goodbye: the server reclaims what this client held (also done
    /// on drop).
    pub fn close(mut self) -> Result<()> {
        self.disconnect()
    }

    fn disconnect(&mut self) -> Result<()> {
        self.alloc.reset();
        match self.conn.call(&Request::Disconnect)? {
            Response::Goodbye => Ok(()),
            other => Err(unexpected(other)),
        }
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        let _ = self.disconnect();
    }
}

/// Connects, presents the secret, and attaches the region.
fn open(address: &Address, options: &ClientOptions) -> Result<(Box<dyn Connection>, ConnectInfo)> {
    let mut conn = transport::connect(address, options.reply_timeout)?;
    let secret = options.secret.clone().unwrap_or_default();
    let info = match conn.call(&Request::Connect {
        protocol_version: PROTOCOL_VERSION,
        secret,
    })? {
        Response::Connected(info) => info,
        Response::Error { kind, message } => return Err(Error::from_server(kind, message)),
        other => return Err(unexpected(other)),
    };
    let g = info.geometry;
    g.validate().map_err(|e| Error::Protocol(e.to_string()))?;
    // Room for the block being written and at least two candidate blocks.
    let local_len = BLOCK_AT + 3 * max_block(&g);
    conn.attach(&info.region, local_len)?;
    Ok((conn, info))
}

/// The largest block a client writes: a maximal key and value.
fn max_block(g: &Geometry) -> usize {
    let largest = block_len(MAX_KEY, g.max_value());
    class_for(largest).map_or(g.max_block(), class_size) as usize
}

fn unexpected(r: Response) -> Error {
    match r {
        Response::Error { kind, message } => Error::from_server(kind, message),
        other => Error::Protocol(format!("unexpected reply {other:?}")),
    }
}
