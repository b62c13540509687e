#![deny(missing_docs)]
//! The onekv client. It reaches the server's region with one-sided verbs
//! only. Each operation is a module that reads as its protocol:
//!
//! - `get`: the key's two windows of buckets in one batch, the
//!   matching block in a second; one batch for both with a fresh hint;
//! - `put`: the block written out of place, published by a CAS on the slot
//!   (`locate` → update in place or insert, then `dedup`); one batch for
//!   the WRITE and the CAS with a settled hint;
//! - `delete`: the slot CASed empty, extra copies first;
//! - `hint`: what a remembered slot allows, and why it needs no ordering
//!   of the READs in a batch;
//! - `lease` and `alloc`: heap space; `geometry`: resizes and growth.
//!
//! ```no_run
//! let mut kv = kv_client::Client::connect("shm:///dev/shm/onekv")?;
//! kv.put(b"user1", b"hello")?;
//! assert_eq!(kv.get(b"user1")?.as_deref(), Some(&b"hello"[..]));
//! kv.delete(b"user1")?;
//! # Ok::<(), kv_client::Error>(())
//! ```
//!
//! A [`Client`] is one connection; give each thread its own, or share a
//! [`ClientPool`] between threads.
//!
//! The types a caller meets are re-exported here: [`Address`],
//! [`Geometry`], [`VerbStats`], [`ServerStats`], [`TransportError`]; the
//! `examples/` folder holds complete programs.

use std::sync::Arc;
use std::time::Duration;

use kv_common::layout::counter_sealed;
pub use kv_common::layout::{Geometry, COUNTER_MAX, MAX_KEY};
use kv_common::protocol::{ConnectInfo, Request, Response, PROTOCOL_VERSION};
pub use kv_common::protocol::{KeyDigest, KeysPage, ServerStats};
/// Test hook (feature `test-hooks`): see [`ClientOptions::with_read_order`].
#[cfg(feature = "test-hooks")]
pub use kv_common::transport::ReadOrder;
use kv_common::transport::{self, ConnectOptions, Connection};
pub use kv_common::transport::{TransportError, VerbStats};
pub use kv_common::Address;

mod alloc;
mod batch;
mod candidates;
mod clock;
mod cluster;
mod corrupt;
mod counter;
mod dedup;
mod delete;
mod error;
mod geometry;
mod get;
mod hint;
mod index;
mod insert_lock;
mod lease;
mod local;
mod locate;
mod map_source;
mod pool;
mod primary;
mod put;
mod read_lease;
mod replicated;
mod slot_cache;
mod stepped_put;
mod values;

use alloc::BlockAllocator;
use clock::Timing;
pub use cluster::ClusterClient;
use counter::CounterOp;
pub use error::Error;
use geometry::{Ask, StrayFrozenWait};
use index::Value;
use local::{LocalLayout, BATCH_KEYS};
pub use pool::ClusterPool;
pub use pool::{Borrowed, ClientPool, Connect, Pool, PooledClient};
use read_lease::ReadLease;
pub use replicated::level_copies;
use slot_cache::SlotCache;
pub use values::Values;

impl Client {
    /// A pseudo-random number (xorshift; not for secrets).
    pub(crate) fn random(&mut self) -> u64 {
        self.jitter ^= self.jitter << 13;
        self.jitter ^= self.jitter >> 7;
        self.jitter ^= self.jitter << 17;
        self.jitter
    }
}

/// A seed for the client's pseudo-random numbers, apart in every client.
fn seed() -> u64 {
    kv_common::random::u64() | 1
}

/// What every call returns.
pub type Result<T> = std::result::Result<T, Error>;

/// How long a writer waits for a resize to publish the new index (the
/// server answers meanwhile that it is resizing; doubling an index of 10^8
/// keys, or a large one over a slow fabric, takes minutes).
const RESIZE_WAIT: Duration = Duration::from_secs(600);
/// Declined resize requests one operation sees (each after finding no room
/// for its key again) before it reports the index full.
const MAX_DECLINED_RESIZES: u32 = 3;
/// How long a PUT waits for heap space while the server reclaims or grows.
const SPACE_WAIT: Duration = Duration::from_secs(30);

/// Keys whose slot a client remembers unless told otherwise, per transport.
pub struct SlotCacheEntries {
    /// Over rdma a round trip costs microseconds: 65 536 keys (about 6 MiB
    /// of table at its full size).
    pub rdma: usize,
    /// Over shm a round trip costs about what two cache misses do: a table
    /// that stays in the core's cache (4 096 keys, ~400 KiB), which keeps
    /// the hot keys' hints and costs a key it misses next to nothing (a
    /// 65 536-key table made YCSB-C over 1 M keys 18% slower).
    pub shm: usize,
}

/// See [`SlotCacheEntries`].
pub const DEFAULT_SLOT_CACHE_ENTRIES: SlotCacheEntries = SlotCacheEntries {
    rdma: 65_536,
    shm: 4_096,
};
/// How long a dropped [`Client`] waits for each step of its goodbye
/// (sending it, then the server's reply) before leaving without one; the
/// server then reclaims the client's space once it notices the closed
/// connection. [`Client::close`] waits the full reply timeout instead.
const DROP_GOODBYE_WAIT: Duration = Duration::from_millis(100);

/// How a [`Client`] connects and behaves; `Default` suits most programs,
/// and the `with_…` methods change one setting each.
///
/// ```no_run
/// let options = kv_client::ClientOptions::default()
///     .with_secret(std::fs::read("/etc/onekv/secret")?)
///     .with_reply_timeout(std::time::Duration::from_secs(2));
/// let kv = kv_client::Client::connect_with("shm:///dev/shm/onekv", options)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// The fields can be read; new ones may be added in a minor release, so
/// the struct is built with `default()` and the `with_…` methods.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ClientOptions {
    /// Presented at connect when the server requires a secret.
    pub secret: Option<Vec<u8>>,
    /// Attempts of one operation under contention before giving up.
    pub max_attempts: u32,
    /// Keys whose slot is remembered, so that an operation on a key seen
    /// recently takes one round trip: a GET reads the buckets and the block
    /// in one batch, an update writes and publishes in one, a delete is one
    /// CAS, an increment one atomic (0 turns it off; PUT and DELETE over a
    /// counter read it first). None: on every transport, sized for it
    /// ([`DEFAULT_SLOT_CACHE_ENTRIES`]; a lookup costs a hash of the key and
    /// no allocation, and the table grows to this as keys are seen). A
    /// `ClusterClient` shares this count among its shards' connections.
    pub slot_cache_entries: Option<usize>,
    /// How long to wait for the server's reply to a control message
    /// (connect, lease, stats, the goodbye of [`Client::close`]) before
    /// giving the connection up.
    pub reply_timeout: Duration,
    /// The group epoch presented at connect: a `ClusterClient` sets the
    /// one its map gives the shard (a copy admits only clients that route
    /// by its own, see kv-cluster's `ShardMap::group_epochs`); 0 for a
    /// single server.
    pub group_epoch: u64,
    /// How long the connect waits for the server's reply, when less than
    /// `reply_timeout`: a `ClusterClient` bounds it at a replicated shard's
    /// copies, so that a reconnect to a frozen server (one whose lease may
    /// be expiring) gives up in time to follow the map to the new primary.
    pub(crate) connect_timeout: Option<Duration>,
    /// Cuts this client's connections off from another thread: a
    /// `ClusterClient`'s map follower does, at a replicated shard's copy
    /// once a map drops it from the shard's group.
    pub(crate) cutoff: Option<Arc<transport::Cutoff>>,
    /// Test hook (feature `test-hooks`): see
    /// [`ClientOptions::with_pause_after_index_read`].
    #[cfg(feature = "test-hooks")]
    pub pause_after_index_read: Option<Duration>,
    /// Test hook (feature `test-hooks`): see
    /// [`ClientOptions::with_read_order`].
    #[cfg(feature = "test-hooks")]
    pub read_order: ReadOrder,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            secret: None,
            max_attempts: 10_000,
            slot_cache_entries: None,
            reply_timeout: transport::DEFAULT_REPLY_TIMEOUT,
            group_epoch: 0,
            connect_timeout: None,
            cutoff: None,
            #[cfg(feature = "test-hooks")]
            pause_after_index_read: None,
            #[cfg(feature = "test-hooks")]
            read_order: ReadOrder::Posted,
        }
    }
}

impl ClientOptions {
    /// Presents `secret` at connect (for a server started with a secret
    /// file; see `kv_common::secret::read_secret_file`).
    #[must_use]
    pub fn with_secret(mut self, secret: impl Into<Vec<u8>>) -> Self {
        self.secret = Some(secret.into());
        self
    }

    /// Gives up an operation with [`Error::Contended`] after losing this
    /// many races against other writers of its key (default 10 000).
    #[must_use]
    pub fn with_max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts;
        self
    }

    /// Remembers the slots of up to `entries` keys (0 turns the cache off;
    /// None, the default, chooses by transport: see
    /// [`ClientOptions::slot_cache_entries`]).
    #[must_use]
    pub fn with_slot_cache_entries(mut self, entries: impl Into<Option<usize>>) -> Self {
        self.slot_cache_entries = entries.into();
        self
    }

    /// Presents `epoch` as the group epoch at connect (see
    /// [`ClientOptions::group_epoch`]): to reach one copy of a replicated
    /// shard directly, as a cluster's tools do.
    #[must_use]
    pub fn with_group_epoch(mut self, epoch: u64) -> Self {
        self.group_epoch = epoch;
        self
    }

    /// Waits this long for the server's reply to a control message
    /// (default 10 s).
    #[must_use]
    pub fn with_reply_timeout(mut self, timeout: Duration) -> Self {
        self.reply_timeout = timeout;
        self
    }

    /// Test hook (fault injection, feature `test-hooks`): after reading the
    /// index, before reading the blocks it points at (and so before any CAS
    /// based on it), and before a counter's atomic through a remembered
    /// slot, sleep as a client on a slow or preempted host would: one time
    /// in four `pause`, otherwise up to a quarter of it. None: no pause.
    #[cfg(feature = "test-hooks")]
    #[must_use]
    pub fn with_pause_after_index_read(mut self, pause: impl Into<Option<Duration>>) -> Self {
        self.pause_after_index_read = pause.into();
        self
    }

    /// Test hook (feature `test-hooks`): the order in which the transport
    /// executes the READs of a batch (a NIC may read host memory for them
    /// in any order).
    #[cfg(feature = "test-hooks")]
    #[must_use]
    pub fn with_read_order(mut self, order: ReadOrder) -> Self {
        self.read_order = order;
        self
    }

    /// The fault hook's pause; always None without the `test-hooks` feature.
    #[inline]
    pub(crate) fn pause_after_index_read(&self) -> Option<Duration> {
        #[cfg(feature = "test-hooks")]
        return self.pause_after_index_read;
        #[cfg(not(feature = "test-hooks"))]
        None
    }

    /// What the transport is asked for.
    fn connect_options(&self) -> ConnectOptions {
        #[cfg_attr(not(feature = "test-hooks"), allow(unused_mut))]
        let mut connect = ConnectOptions {
            reply_timeout: self.reply_timeout,
            ..ConnectOptions::default()
        };
        #[cfg(feature = "test-hooks")]
        {
            connect.read_order = self.read_order;
        }
        connect
    }
}

/// One connection to a onekv server. Every call is a few one-sided verbs
/// on the server's region; none involves the server's CPU. Operations on
/// one key are linearizable across all clients.
///
/// A lost connection (the server restarted, or cut this client off) is
/// replaced at the next call, which is then redone. [`Client::close`] says
/// goodbye, so the server reclaims the client's leased space at once;
/// dropping the client tries the same but waits at most a fraction of a
/// second for a server that does not answer.
///
/// # Errors of every call
///
/// Besides those each call lists: [`Error::Unreachable`] or
/// [`Error::Transport`] when the connection is lost and a new one cannot be
/// made, [`Error::Protocol`] when the server answers what this client does
/// not expect, [`Error::Stalled`] when the server's index stays mid-resize
/// too long, [`Error::Internal`] for a bug in this client
/// ([`Error::is_retryable`] tells which may succeed later).
pub struct Client {
    address: Address,
    options: ClientOptions,
    conn: Box<dyn Connection>,
    info: ConnectInfo,
    timing: Timing,
    layout: LocalLayout,
    max_value: usize,
    alloc: BlockAllocator,
    /// Blocks this client unlinked and has not reported yet.
    unlinked: Vec<kv_common::protocol::Unlinked>,
    /// Unlinks not to report (the server said it wants no more for now).
    reports_held_back: u32,
    /// Verb counters of connections replaced after a server restart.
    retired_stats: VerbStats,
    /// Round trips of this client's that completed while its caller waited
    /// on another client's (a replicated write's copies, `stepped_put`):
    /// not counted as waits.
    waited_together: u64,
    jitter: u64,
    cache: SlotCache,
    /// The copy the last GET found, for a write that follows it.
    last_read: hint::LastRead,
    reconnects: u64,
    /// A counter lock this client waits on (see `Client::wait_on_lock`).
    lock_watch: Option<counter::LockWatch>,
    /// What this client last found in each insert lock word.
    lock_words: insert_lock::LockWords,
    /// Whether this client's PUTs of keys it has not seen have lately been
    /// inserts (as a replicated shard's primary, see `replicated`).
    unseen_puts: replicated::UnseenPuts,
    /// On a copy of a replicated shard: until when it may read (see
    /// `read_lease`).
    read_lease: Option<ReadLease>,
}

/// How one attempt at an operation ended.
#[derive(Debug)]
enum Step<T> {
    Done(T),
    /// The index is being resized or was replaced (a frozen slot, a newer
    /// epoch): learn the new geometry, then redo the operation.
    Moved,
    /// No room for this key: ask for a resize, then redo it.
    Full(Vec<u8>),
}

impl<T> Step<T> {
    fn map<U>(self, f: impl FnOnce(T) -> U) -> Step<U> {
        match self {
            Step::Done(v) => Step::Done(f(v)),
            Step::Moved => Step::Moved,
            Step::Full(key) => Step::Full(key),
        }
    }
}

impl Client {
    /// Connects to the server at `address` (`shm:///dev/shm/NAME` or
    /// `rdma://HOST:PORT`) with default options.
    ///
    /// # Errors
    ///
    /// As [`Client::connect_with`].
    pub fn connect(address: &str) -> Result<Client> {
        Client::connect_with(address, ClientOptions::default())
    }

    /// Connects with `options` (a secret, the slot hint cache, timeouts).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidAddress`] when the address is malformed;
    /// [`Error::Unreachable`] when no server answers at it; [`Error::Refused`] for a wrong secret or too many clients;
    /// [`Error::VersionMismatch`] for a server of another protocol version;
    /// [`Error::Transport`] when the device or the mapping fails.
    pub fn connect_with(address: &str, options: ClientOptions) -> Result<Client> {
        if kv_cluster::ClusterSource::is_cluster(address) {
            return Err(Error::InvalidAddress(format!(
                "'{address}' names a cluster: connect to it with kv_client::ClusterClient (or ClusterPool)"
            )));
        }
        let address = Address::parse(address).map_err(Error::InvalidAddress)?;
        let (conn, info, layout, read_lease) = open(&address, &options)?;
        let cache_entries = options.slot_cache_entries.unwrap_or(match address {
            Address::Rdma { .. } => DEFAULT_SLOT_CACHE_ENTRIES.rdma,
            Address::Shm { .. } => DEFAULT_SLOT_CACHE_ENTRIES.shm,
        });
        Ok(Client {
            address,
            options,
            conn,
            timing: timing(&info, read_lease),
            max_value: info.geometry.max_value(),
            info,
            layout,
            alloc: BlockAllocator::default(),
            unlinked: Vec::new(),
            reports_held_back: 0,
            retired_stats: VerbStats::default(),
            waited_together: 0,
            // Seeded apart in every client: settled counters take their
            // lock generations from it.
            jitter: seed(),
            cache: SlotCache::new(cache_entries),
            last_read: hint::LastRead::default(),
            reconnects: 0,
            lock_watch: None,
            lock_words: insert_lock::LockWords::default(),
            unseen_puts: replicated::UnseenPuts::default(),
            read_lease,
        })
    }

    /// The number the server gave this connection (a new one after each
    /// reconnect); the server's logs name clients by it.
    pub fn client_id(&self) -> u64 {
        self.info.client_id
    }

    /// The server's address.
    pub fn address(&self) -> &Address {
        &self.address
    }

    /// The region's layout as this client last learned it (it follows
    /// resizes and growth by itself).
    pub fn geometry(&self) -> &Geometry {
        &self.info.geometry
    }

    /// The server's operation deadline: reads older than this are not
    /// trusted, and hints settle two of these after a key's copy appeared.
    pub fn op_deadline(&self) -> Duration {
        Duration::from_micros(self.info.op_deadline_us)
    }

    /// Largest value this server accepts.
    pub fn max_value(&self) -> usize {
        self.max_value
    }

    /// Verbs, round trips and bytes this client has used so far.
    ///
    /// ```no_run
    /// # let mut kv = kv_client::Client::connect("shm:///dev/shm/onekv")?;
    /// let before = kv.verb_stats();
    /// kv.get(b"user1")?;
    /// let used = kv.verb_stats().since(&before);
    /// println!("{} round trips, {} bytes read", used.round_trips, used.bytes_read);
    /// # Ok::<(), kv_client::Error>(())
    /// ```
    pub fn verb_stats(&self) -> VerbStats {
        let mut s = self.retired_stats;
        s.add(self.conn.stats());
        s.waits = s.waits.saturating_sub(self.waited_together);
        s
    }

    /// How many times this client replaced a lost connection (a server
    /// restart, a fence, a broken control channel) and redid an operation.
    pub fn reconnects(&self) -> u64 {
        self.reconnects
    }

    /// The server's counters (a control message, not the data path).
    ///
    /// # Errors
    ///
    /// Only [those of every call](Client#errors-of-every-call).
    pub fn server_stats(&mut self) -> Result<ServerStats> {
        match self.call(&Request::Stats)? {
            Response::Stats(s) => Ok(s),
            other => Err(unexpected(other)),
        }
    }

    /// Every key the server's region holds, each once with a digest of
    /// its value as readers see it (xxh3-128 seeded by `seed`; none for a
    /// counter), read page by page over the control channel: one
    /// [`KeysPage`] of the whole index, `next` None. The pages come from
    /// one index: a resize under way is waited out, and one between two
    /// pages starts the listing again. Writers may change keys meanwhile:
    /// each key is as it was when its page was read. For comparing copies
    /// of a replicated shard (kv-server's leveller); `damaged` counts the
    /// slots whose block failed validation, whose keys are not listed.
    ///
    /// # Errors
    ///
    /// [`Error::Stalled`] when the index resized under every one of
    /// `max_attempts` tries; and [those of every
    /// call](Client#errors-of-every-call).
    pub fn key_digests(&mut self, seed: u64) -> Result<KeysPage> {
        for _ in 0..self.options.max_attempts {
            let mut all: Option<KeysPage> = None;
            let mut from = 0;
            loop {
                let page = match self.call(&Request::Keys { from, seed })? {
                    Response::Keys(page) => page,
                    other => return Err(unexpected(other)),
                };
                let same = all.as_ref().is_none_or(|a| a.epoch == page.epoch);
                if page.resizing || !same {
                    all = None;
                    std::thread::sleep(Duration::from_millis(10));
                    break;
                }
                let next = page.next;
                match &mut all {
                    None => all = Some(page),
                    Some(a) => {
                        a.damaged += page.damaged;
                        a.keys.extend(page.keys);
                    }
                }
                match next {
                    Some(n) if n > from => from = n,
                    Some(_) => {
                        return Err(Error::Protocol(
                            "a page of keys that ends where it began".into(),
                        ))
                    }
                    None => break,
                }
            }
            if let Some(mut listing) = all {
                listing.next = None;
                return Ok(listing);
            }
        }
        Err(Error::Stalled(
            "the index resized during every listing of its keys".into(),
        ))
    }

    /// The value of `key`, or None: two round trips (the key's buckets,
    /// then its block), one for a key with a fresh slot hint. (A counter
    /// that a PUT or DELETE has sealed is waited on: a round trip or two,
    /// or two settle periods and two deadlines if that writer died.)
    ///
    /// ```no_run
    /// # let mut kv = kv_client::Client::connect("shm:///dev/shm/onekv")?;
    /// match kv.get(b"user1")? {
    ///     Some(value) => println!("{}", String::from_utf8_lossy(&value)),
    ///     None => println!("no such key"),
    /// }
    /// # Ok::<(), kv_client::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::EmptyKey`], [`Error::KeyTooLarge`]; [`Error::Corrupt`] when
    /// the key's slot points at a block that fails validation every time;
    /// [`Error::Contended`] after too many lost races.
    pub fn get(&mut self, key: impl AsRef<[u8]>) -> Result<Option<Vec<u8>>> {
        let mut out = Vec::new();
        Ok(self.get_into_bytes(key.as_ref(), &mut out)?.then_some(out))
    }

    /// Reads the value of `key` into `out` (reusing its allocation); false if
    /// there is no such key. The call for loops that read many values.
    ///
    /// ```no_run
    /// # let mut kv = kv_client::Client::connect("shm:///dev/shm/onekv")?;
    /// let mut value = Vec::new();
    /// for key in [&b"user1"[..], b"user2"] {
    ///     if kv.get_into(key, &mut value)? {
    ///         assert!(!value.is_empty());
    ///     }
    /// }
    /// # Ok::<(), kv_client::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// As [`Client::get`].
    pub fn get_into(&mut self, key: impl AsRef<[u8]>, out: &mut Vec<u8>) -> Result<bool> {
        self.get_into_bytes(key.as_ref(), out)
    }

    fn get_into_bytes(&mut self, key: &[u8], out: &mut Vec<u8>) -> Result<bool> {
        check_key(key)?;
        self.run(|c| {
            Ok(c.get_once(key)?.map(|value| match value {
                Some(value) => {
                    get::copy_out(c.conn.local(), value, out);
                    true
                }
                None => false,
            }))
        })
    }

    /// The values of many keys, in order: the windows of up to 32 keys in
    /// one batch, the blocks they point at in the next (two round trips for
    /// the lot; one if every key has a settled hint). Each key is read
    /// exactly as [`Client::get`] reads it.
    ///
    /// ```no_run
    /// # let mut kv = kv_client::Client::connect("shm:///dev/shm/onekv")?;
    /// let values = kv.get_many(&[b"user1", b"user2"])?;
    /// assert_eq!(values.len(), 2);
    /// # Ok::<(), kv_client::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// The first error any key meets, as [`Client::get`]'s.
    pub fn get_many<K: AsRef<[u8]>>(&mut self, keys: &[K]) -> Result<Vec<Option<Vec<u8>>>> {
        let mut values = Values::new();
        self.get_many_into(keys, &mut values)?;
        Ok(values.iter().map(|v| v.map(<[u8]>::to_vec)).collect())
    }

    /// [`Client::get_many`] into buffers the caller keeps: `values` is
    /// cleared and refilled, one buffer per key, each keeping its capacity,
    /// so that a loop of batches allocates nothing once the buffers have
    /// grown to the values' sizes.
    ///
    /// ```no_run
    /// # let mut kv = kv_client::Client::connect("shm:///dev/shm/onekv")?;
    /// let mut values = kv_client::Values::new();
    /// for _ in 0..3 {
    ///     kv.get_many_into(&[b"user1", b"user2"], &mut values)?;
    ///     assert_eq!(values.len(), 2);
    ///     if let Some(v) = values.get(0) {
    ///         println!("user1: {} bytes", v.len());
    ///     }
    /// }
    /// # Ok::<(), kv_client::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// The first error any key meets, as [`Client::get`]'s; `values` then
    /// holds what was read before it.
    pub fn get_many_into<K: AsRef<[u8]>>(&mut self, keys: &[K], values: &mut Values) -> Result<()> {
        for key in keys {
            check_key(key.as_ref())?;
        }
        values.reset(keys.len());
        for (n, chunk) in keys.chunks(BATCH_KEYS).enumerate() {
            let first = n * BATCH_KEYS;
            let keys: smallvec::SmallVec<[&[u8]; BATCH_KEYS]> =
                chunk.iter().map(AsRef::as_ref).collect();
            let (bufs, found) = values.slice_mut(first..first + keys.len());
            let unsettled = match self.get_batch(&keys, bufs, found) {
                Ok(unsettled) => unsettled,
                // The single path reconnects, as every call does.
                Err(e) if e.is_connection_lost() => (0..keys.len()).collect(),
                Err(e) => return Err(e),
            };
            for i in unsettled {
                let (bufs, found) = values.slice_mut(first + i..first + i + 1);
                found[0] = self.get_into_bytes(keys[i], &mut bufs[0])?;
            }
        }
        Ok(())
    }

    /// Stores many key-value pairs, each as [`Client::put`] does (not
    /// atomically as a group; a key given twice ends with its last value):
    /// the blocks and the keys' windows of up to 21 pairs in one batch,
    /// the blocks found in a second, the CASes in a third (one batch when
    /// every key has a settled hint).
    ///
    /// ```no_run
    /// # let mut kv = kv_client::Client::connect("shm:///dev/shm/onekv")?;
    /// kv.put_many(&[("user1", "alice"), ("user2", "bob")])?;
    /// assert_eq!(kv.delete_many(&["user1", "user3"])?, [true, false]);
    /// # Ok::<(), kv_client::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// The first error any pair meets, as [`Client::put`]'s; some of the
    /// other pairs may have been stored (the call is not atomic).
    pub fn put_many<K: AsRef<[u8]>, V: AsRef<[u8]>>(&mut self, pairs: &[(K, V)]) -> Result<()> {
        let pairs: Vec<(&[u8], &[u8])> = pairs
            .iter()
            .map(|(k, v)| (k.as_ref(), v.as_ref()))
            .collect();
        for &(key, value) in &pairs {
            check_key(key)?;
            if value.len() > self.max_value {
                return Err(Error::ValueTooLarge {
                    len: value.len(),
                    max: self.max_value,
                });
            }
        }
        let mut rest = &pairs[..];
        while !rest.is_empty() {
            let took = match self.put_batch(rest, batch::Blocks::Values) {
                Ok((took, unsettled)) => {
                    for i in unsettled {
                        self.put(rest[i].0, rest[i].1)?;
                    }
                    took
                }
                // The single path reconnects, as every call does (a redone
                // PUT is safe: see `run`).
                Err(e) if e.is_connection_lost() => {
                    self.put_bytes(rest[0].0, rest[0].1)?;
                    1
                }
                Err(e) => return Err(e),
            };
            rest = &rest[took..];
        }
        Ok(())
    }

    /// Stores counters as [`Client::put_many`] stores values (up to 32
    /// blocks and their CASes in three round trips), each settled from the
    /// start: for filling a store that no other client writes meanwhile (a
    /// shard move's target, a restore from a backup). A key that holds a
    /// value is replaced; one that holds a counter is set by
    /// compare-and-set.
    ///
    /// Why only then: a counter that [`Client::incr`] creates waits a settle
    /// period before it counts, because another client may insert the same
    /// key at once and increments on the copy that loses would be lost
    /// (`counter.rs` has the argument). With no other writer no such copy
    /// appears, so a batch of counters costs what a batch of values does;
    /// with concurrent writers of the same keys, an increment may be lost.
    ///
    /// ```no_run
    /// # let mut kv = kv_client::Client::connect("shm:///dev/shm/onekv")?;
    /// kv.restore_counters(&[("visits", 41), ("stock", 7)])?;
    /// assert_eq!(kv.incr(b"visits", 1)?, 42);
    /// # Ok::<(), kv_client::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::CounterOverflow`] for a value no counter can hold (beyond
    /// ±2^62); the first error any key meets, as [`Client::put`]'s.
    pub fn restore_counters<K: AsRef<[u8]>>(&mut self, counters: &[(K, i64)]) -> Result<()> {
        for (key, value) in counters {
            check_key(key.as_ref())?;
            // Any open word: a counter may have gone past COUNTER_MAX by
            // late blind increments (see counter.rs), and is restored so.
            if counter_sealed(*value as u64) {
                return Err(Error::CounterOverflow(i128::from(*value)));
            }
        }
        let words: Vec<[u8; 8]> = counters.iter().map(|(_, v)| v.to_le_bytes()).collect();
        let pairs: Vec<(&[u8], &[u8])> = counters
            .iter()
            .zip(&words)
            .map(|((k, _), w)| (k.as_ref(), &w[..]))
            .collect();
        let mut at = 0;
        while at < pairs.len() {
            let rest = &pairs[at..];
            let (took, unsettled) = match self.put_batch(rest, batch::Blocks::SettledCounters) {
                Ok(done) => done,
                // Set on the single path, which reconnects.
                Err(e) if e.is_connection_lost() => (1, std::iter::once(0).collect()),
                Err(e) => return Err(e),
            };
            // The batch remembers its keys as values: a blind PUT over a
            // counter would skip its lock.
            for &(key, _) in &rest[..took] {
                self.cache.forget(key);
            }
            for i in unsettled {
                self.set_counter(rest[i].0, counters[at + i].1)?;
            }
            at += took;
        }
        Ok(())
    }

    /// Makes `key` the counter `value`, whatever it holds now.
    fn set_counter(&mut self, key: &[u8], value: i64) -> Result<()> {
        loop {
            let now = match self.incr(key, 0) {
                Ok(now) => now,
                Err(Error::NotACounter) => {
                    self.delete(key)?;
                    continue;
                }
                Err(e) => return Err(e),
            };
            if now == value || self.compare_and_set(key, now, value)? == Some(now) {
                return Ok(());
            }
        }
    }

    /// Removes many keys, each as [`Client::delete`] does, and says for
    /// each whether it was there: the windows of up to 32 keys in one
    /// batch, the blocks found in a second, the CASes in a third (one
    /// batch when every key has a settled hint).
    ///
    /// # Errors
    ///
    /// The first error any key meets, as [`Client::delete`]'s.
    pub fn delete_many<K: AsRef<[u8]>>(&mut self, keys: &[K]) -> Result<Vec<bool>> {
        let keys: Vec<&[u8]> = keys.iter().map(AsRef::as_ref).collect();
        for key in &keys {
            check_key(key)?;
        }
        let mut out = vec![false; keys.len()];
        for (keys, out) in keys.chunks(BATCH_KEYS).zip(out.chunks_mut(BATCH_KEYS)) {
            let unsettled = match self.delete_batch(keys, out) {
                Ok(unsettled) => unsettled,
                Err(e) if e.is_connection_lost() => (0..keys.len()).collect(),
                Err(e) => return Err(e),
            };
            for i in unsettled {
                // A copy the batch removed counts even if the redo finds
                // none left.
                out[i] |= self.delete_bytes(keys[i])?;
            }
        }
        Ok(out)
    }

    /// Adds `delta` to the counter `key` (creating it at 0 first) and
    /// returns its new value. The NIC's FETCH-AND-ADD does the addition in
    /// place: concurrent increments from any number of clients all count.
    /// A new counter's first increment takes about three operation deadlines
    /// (see the `counter` module); later ones one round trip with a slot
    /// hint seen within a deadline (hints are the default over rdma), three
    /// without, or for a delta beyond 2^32 or a value beyond ±2^60. Fails with
    /// [`Error::NotACounter`] if `key` holds a value PUT stored, and with
    /// [`Error::CounterOverflow`] (changing nothing) if the result would lie
    /// beyond ±[`COUNTER_MAX`] (2^61). A GET of a counter returns its
    /// decimal text.
    ///
    /// ```no_run
    /// # let mut kv = kv_client::Client::connect("shm:///dev/shm/onekv")?;
    /// assert_eq!(kv.incr(b"visits", 1)?, 1);
    /// assert_eq!(kv.incr(b"visits", 41)?, 42);
    /// assert_eq!(kv.get(b"visits")?.as_deref(), Some(&b"42"[..]));
    /// # Ok::<(), kv_client::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::NotACounter`], [`Error::CounterOverflow`] as above;
    /// [`Error::OutcomeUnknown`] when the connection was lost after the
    /// atomic was posted (read the counter to find out; one whose batch
    /// the server turned away whole, having run none of it, is made again
    /// on a new connection);
    /// [`Error::RegionFull`] or [`Error::IndexFull`] when a new counter finds
    /// no room; the key errors of [`Client::get`].
    pub fn incr(&mut self, key: impl AsRef<[u8]>, delta: i64) -> Result<i64> {
        self.incr_bytes(key.as_ref(), delta)
    }

    fn incr_bytes(&mut self, key: &[u8], delta: i64) -> Result<i64> {
        check_key(key)?;
        let new = self.run(|c| c.counter_once(key, CounterOp::Add(delta)))?;
        new.ok_or(Error::Internal("an increment found no counter".into()))
    }

    /// The value of the counter `key`, or None if there is none.
    ///
    /// # Errors
    ///
    /// [`Error::NotACounter`] if `key` holds a value PUT stored; otherwise as
    /// [`Client::get`].
    pub fn get_counter(&mut self, key: impl AsRef<[u8]>) -> Result<Option<i64>> {
        self.get_counter_bytes(key.as_ref())
    }

    fn get_counter_bytes(&mut self, key: &[u8]) -> Result<Option<i64>> {
        check_key(key)?;
        self.run(|c| {
            let found = c.get_once(key)?;
            Ok(match found {
                Step::Done(Some(Value::Counter(n))) => Step::Done(Some(n)),
                Step::Done(Some(Value::Bytes(_))) => return Err(Error::NotACounter),
                other => other.map(|_| None),
            })
        })
    }

    /// Sets the counter `key` to `new` if it holds `expected` (one CAS on
    /// its word). Returns the value it held, which equals `expected` if and
    /// only if it was swapped; None if there is no such counter. A `new`
    /// beyond ±[`COUNTER_MAX`] fails with [`Error::CounterOverflow`].
    ///
    /// ```no_run
    /// # let mut kv = kv_client::Client::connect("shm:///dev/shm/onekv")?;
    /// kv.incr(b"stock", 3)?;
    /// assert_eq!(kv.compare_and_set(b"stock", 3, 2)?, Some(3)); // swapped
    /// assert_eq!(kv.compare_and_set(b"stock", 3, 1)?, Some(2)); // not: it held 2
    /// assert_eq!(kv.get_counter(b"stock")?, Some(2));
    /// # Ok::<(), kv_client::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::NotACounter`], [`Error::CounterOverflow`];
    /// [`Error::OutcomeUnknown`] when the connection was lost after the CAS
    /// was posted (not when the server turned its batch away whole); the
    /// key errors of [`Client::get`].
    pub fn compare_and_set(
        &mut self,
        key: impl AsRef<[u8]>,
        expected: i64,
        new: i64,
    ) -> Result<Option<i64>> {
        self.compare_and_set_bytes(key.as_ref(), expected, new)
    }

    fn compare_and_set_bytes(
        &mut self,
        key: &[u8],
        expected: i64,
        new: i64,
    ) -> Result<Option<i64>> {
        check_key(key)?;
        if kv_common::layout::counter_sealed(expected as u64) {
            // Beyond ±2^62: no counter holds it (a CAS expecting it could
            // match a sealed word), so nothing is swapped.
            if new.unsigned_abs() > COUNTER_MAX as u64 {
                return Err(Error::CounterOverflow(new.into()));
            }
            return self.get_counter_bytes(key);
        }
        self.run(|c| {
            c.counter_once(
                key,
                CounterOp::Swap {
                    expect: expected,
                    new,
                },
            )
        })
    }

    /// Stores `value` under `key`, replacing any earlier value: the block
    /// is written out of place and published by one CAS on the key's slot
    /// (two round trips for a new key, three for an update, one with a
    /// settled slot hint, five over a counter: its lock and seal). Once it
    /// returns, every later GET sees it.
    ///
    /// # Errors
    ///
    /// [`Error::EmptyKey`], [`Error::KeyTooLarge`], [`Error::ValueTooLarge`];
    /// [`Error::RegionFull`] when the heap has no room and the region is at
    /// its cap (after a collection was tried); [`Error::IndexFull`] when the
    /// key's buckets are full and the index cannot grow; [`Error::Corrupt`],
    /// [`Error::Contended`] as for [`Client::get`].
    pub fn put(&mut self, key: impl AsRef<[u8]>, value: impl AsRef<[u8]>) -> Result<()> {
        self.put_bytes(key.as_ref(), value.as_ref())
    }

    fn put_bytes(&mut self, key: &[u8], value: &[u8]) -> Result<()> {
        check_key(key)?;
        if value.len() > self.max_value {
            return Err(Error::ValueTooLarge {
                len: value.len(),
                max: self.max_value,
            });
        }
        self.run(|c| c.put_once(key, value))
    }

    /// Removes `key`; false if it was not there.
    ///
    /// # Errors
    ///
    /// [`Error::EmptyKey`], [`Error::KeyTooLarge`]; [`Error::Corrupt`],
    /// [`Error::Contended`] as for [`Client::get`].
    pub fn delete(&mut self, key: impl AsRef<[u8]>) -> Result<bool> {
        self.delete_bytes(key.as_ref())
    }

    fn delete_bytes(&mut self, key: &[u8]) -> Result<bool> {
        check_key(key)?;
        let mut unlinked = false;
        self.run(|c| c.delete_once(key, &mut unlinked))
    }

    /// Asks the server to double the index now (it also does so by itself
    /// when the index fills) and waits until the new one is in force.
    ///
    /// # Errors
    ///
    /// [`Error::ResizeDeclined`] when the index is not full enough to
    /// warrant a doubling (beyond a small size, at least half as full as
    /// the server's resize threshold); [`Error::IndexFull`] when it cannot
    /// grow; [`Error::Stalled`] when the resize does not finish within ten
    /// minutes; connection errors as for any call.
    pub fn resize(&mut self) -> Result<Geometry> {
        let before = self.info.geometry.bucket_count;
        // The heap growing meanwhile is a newer epoch too: ask again.
        while self.info.geometry.bucket_count == before {
            if !self.follow_geometry(Ask::Resize { full_key: None })? {
                return Err(Error::ResizeDeclined);
            }
        }
        Ok(self.info.geometry)
    }

    /// Runs an operation until it is done. After a resize or growth it
    /// learns the new geometry and runs it again; if its connection is gone
    /// (the server restarted, cut this client off, or the control channel
    /// broke), it reconnects once and runs it again from the start. Every
    /// step of an operation is safe to redo: a block written but not
    /// published is garbage, and a PUT published before the failure is found
    /// and updated (or deduplicated).
    fn run<T>(&mut self, mut op: impl FnMut(&mut Self) -> Result<Step<T>>) -> Result<T> {
        // A lock seen in an earlier call may have been let go since.
        self.lock_watch = None;
        let mut reconnected = false;
        let mut stray: Option<StrayFrozenWait> = None;
        let mut declined = 0;
        loop {
            let step = match self.keep_read_lease() {
                Ok(()) => op(self),
                Err(e) => Err(e),
            };
            match step {
                Ok(Step::Done(v)) => return Ok(v),
                Ok(Step::Moved) => {
                    if self.follow_geometry(Ask::Geometry)? {
                        stray = None;
                    } else {
                        self.wait_out_stray_frozen(&mut stray)?;
                    }
                }
                Ok(Step::Full(key)) => {
                    let full_key = Some(key.as_slice());
                    if !self.follow_geometry(Ask::Resize { full_key })? {
                        // The server saw room for the key (a delete made
                        // some), or judged the index too empty to double.
                        declined += 1;
                        if declined > MAX_DECLINED_RESIZES {
                            return Err(Error::IndexFull(
                                "no room for the key, and the server declines to resize an index this empty".into(),
                            ));
                        }
                    }
                }
                Err(e) if e.is_connection_lost() && !reconnected => {
                    reconnected = true;
                    self.reconnect()?;
                }
                Err(e) => return Err(e),
            }
            // The redo follows waits that must not count against a clock
            // started at the thread's last reading.
            clock::touch();
        }
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
        self.last_read.clear();
        // Another region may lie behind the address now, its words at
        // values this client saw in the old one's.
        self.lock_words = insert_lock::LockWords::default();
        let (conn, info, layout, read_lease) = open(&self.address, &self.options)?;
        if info.geometry.chunk_size != self.info.geometry.chunk_size {
            return Err(Error::Protocol(
                "the region's chunk size changed across a restart".into(),
            ));
        }
        self.reconnects += 1;
        self.conn = conn;
        self.timing = timing(&info, read_lease);
        self.info = info;
        self.layout = layout;
        self.read_lease = read_lease;
        Ok(())
    }

    /// Sends a control request and waits for its reply. At a copy of a
    /// replicated shard the wait ends with the read lease for its renewal
    /// (at least `MIN_RENEWAL_WAIT`), and for any other call at most
    /// `COPY_CALL_WAIT` past it: a server that does not answer by then may
    /// be frozen and failed over, and the caller, finding the connection
    /// lost, reconnects and follows the map, rather than wait out the
    /// reply timeout.
    pub(crate) fn call(&mut self, request: &Request) -> Result<Response> {
        let Some(lease) = self.read_lease else {
            return Ok(self.conn.call(request)?);
        };
        let mut wait = lease.renewal_wait(clock::raw());
        if !matches!(request, Request::ReadLease) {
            wait = wait.max(read_lease::COPY_CALL_WAIT);
        }
        let wait = wait.min(self.options.reply_timeout);
        Ok(call_within(
            self.conn.as_mut(),
            request,
            wait,
            self.options.reply_timeout,
        )?)
    }

    /// Renews the read lease on a copy of a replicated shard once it is
    /// due (see `read_lease`); nothing to do elsewhere. Called before every
    /// attempt that reads.
    pub(crate) fn keep_read_lease(&mut self) -> Result<()> {
        let Some(lease) = self.read_lease else {
            return Ok(());
        };
        let sent = clock::raw();
        if !lease.due(sent) {
            return Ok(());
        }
        // A frozen server never answers: the wait ends with the lease.
        match self.call(&Request::ReadLease)? {
            Response::ReadLease { valid_us } => {
                let lease = ReadLease::granted(sent, valid_us);
                self.read_lease = Some(lease);
                self.timing.reads_until(lease.until());
                match lease.over(clock::raw()) {
                    false => Ok(()),
                    // Answered after what it granted had passed: as if
                    // not answered.
                    true => Err(Error::Transport(TransportError::Disconnected(
                        "the read lease's renewal was answered too late".into(),
                    ))),
                }
            }
            Response::Error { kind, message } => Err(Error::from_server(kind, message)),
            other => Err(unexpected(other)),
        }
    }

    /// Says goodbye and waits for the server's answer (up to
    /// [`ClientOptions::reply_timeout`]): the server reclaims what this
    /// client held at once. Dropping a client does the same but waits only
    /// a fraction of a second, and cannot report a failure.
    ///
    /// # Errors
    ///
    /// Only [those of every call](Client#errors-of-every-call): the goodbye
    /// could not be sent or was not answered (the server reclaims the space
    /// anyway once it notices the connection closed).
    pub fn close(mut self) -> Result<()> {
        let said = self.disconnect();
        // Drop has nothing left to say.
        self.conn = Box::new(transport::Closed);
        said
    }

    /// Gives back what this client holds, with what it has not reported,
    /// so that the server frees its garbage without a scan; then says
    /// goodbye.
    fn disconnect(&mut self) -> Result<()> {
        let spent = self.alloc.drain();
        self.give_back(spent)?;
        match self.conn.call(&Request::Disconnect)? {
            Response::Goodbye => Ok(()),
            other => Err(unexpected(other)),
        }
    }
}

impl Drop for Client {
    /// A best-effort goodbye that never holds the dropping thread long:
    /// sending each of its messages (the give-back, the goodbye) and
    /// waiting for each answer are bounded by `DROP_GOODBYE_WAIT` (the
    /// transport's bound replaces the reply timeout), so a server that is
    /// stopped or overloaded costs a fraction of a second, not the reply
    /// timeout.
    fn drop(&mut self) {
        if self.conn.set_reply_timeout(DROP_GOODBYE_WAIT).is_ok() {
            let _ = self.disconnect();
        }
    }
}

fn check_key(key: &[u8]) -> Result<()> {
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

/// A connection, what the server said at connect, the local buffer's
/// layout, and the read lease granted (on a replicated shard's copy).
type Opened = (
    Box<dyn Connection>,
    ConnectInfo,
    LocalLayout,
    Option<ReadLease>,
);

/// Connects, presents the secret, and attaches the region with a local
/// buffer laid out for its geometry.
fn open(address: &Address, options: &ClientOptions) -> Result<Opened> {
    if let Some(e) = options.cutoff.as_ref().and_then(|c| c.error()) {
        return Err(e.into());
    }
    let mut conn = transport::connect(address, &options.connect_options())?;
    if let Some(cutoff) = &options.cutoff {
        conn.cut_by(cutoff.clone());
    }
    let secret = options.secret.clone().unwrap_or_default();
    let sent = clock::raw();
    let connect = Request::Connect {
        protocol_version: PROTOCOL_VERSION,
        secret,
        group: options.group_epoch,
    };
    let wait = options.connect_timeout.unwrap_or(options.reply_timeout);
    let info = match call_within(conn.as_mut(), &connect, wait, options.reply_timeout)? {
        Response::Connected(info) => info,
        Response::Error { kind, message } => return Err(Error::from_server(kind, message)),
        other => return Err(unexpected(other)),
    };
    let g = info.geometry;
    g.validate().map_err(|e| Error::Protocol(e.to_string()))?;
    let layout = LocalLayout::for_geometry(&g);
    conn.attach(&info.region, layout.len)?;
    let read_lease = info
        .read_lease_us
        .map(|valid_us| ReadLease::granted(sent, valid_us));
    Ok((conn, info, layout, read_lease))
}

/// Calls `request` waiting at most `wait` for the reply, then sets the
/// connection's reply timeout back to `usual`.
fn call_within(
    conn: &mut dyn Connection,
    request: &Request,
    wait: Duration,
    usual: Duration,
) -> std::result::Result<Response, TransportError> {
    if wait >= usual {
        return conn.call(request);
    }
    conn.set_reply_timeout(wait)?;
    let answer = conn.call(request);
    // The call's own failure (a lost connection) is the one to report.
    let restored = conn.set_reply_timeout(usual);
    let answer = answer?;
    restored?;
    Ok(answer)
}

/// The time bounds of a connection: its server's operation deadline, and
/// the end of its read lease if it has one.
fn timing(info: &ConnectInfo, read_lease: Option<ReadLease>) -> Timing {
    let mut timing = Timing::new(Duration::from_micros(info.op_deadline_us));
    if let Some(lease) = read_lease {
        timing.reads_until(lease.until());
    }
    timing
}

/// Test hook (fault injection): aborts the process at `step` when the
/// environment variable `ONEKV_CLIENT_FAULT` names it, as a client killed
/// there would stop. The variable is read once.
pub(crate) fn fault_point(step: &str) {
    if fault_armed(step) {
        eprintln!("ONEKV_CLIENT_FAULT: aborting at {step}");
        std::process::abort();
    }
}

/// Whether the fault hook `ONEKV_CLIENT_FAULT` names `step`.
pub(crate) fn fault_armed(step: &str) -> bool {
    static FAULT: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    let fault = FAULT.get_or_init(|| std::env::var("ONEKV_CLIENT_FAULT").ok());
    fault.as_deref() == Some(step)
}

/// Test hook (fault injection): the first time the process reaches
/// `step`, sleeps for as long as the environment variable
/// `ONEKV_CLIENT_PAUSE` (`STEP:MILLISECONDS`, or several such, separated
/// by commas) says, as a client stalled there once (descheduled, swapped
/// out) would, and says so on stderr (so that a test can act while it
/// sleeps). Read once.
pub(crate) fn pause_point(step: &str) {
    type Pause = (String, Duration, std::sync::atomic::AtomicBool);
    static PAUSES: std::sync::OnceLock<Vec<Pause>> = std::sync::OnceLock::new();
    let pauses = PAUSES.get_or_init(|| {
        let spec = std::env::var("ONEKV_CLIENT_PAUSE").unwrap_or_default();
        spec.split(',')
            .filter_map(|one| {
                let (at, ms) = one.split_once(':')?;
                let pause = Duration::from_millis(ms.parse().ok()?);
                Some((at.to_string(), pause, Default::default()))
            })
            .collect()
    });
    for (at, pause, paused) in pauses {
        if at == step && !paused.swap(true, std::sync::atomic::Ordering::SeqCst) {
            eprintln!("ONEKV_CLIENT_PAUSE: pausing at {step}");
            std::thread::sleep(*pause);
        }
    }
    #[cfg(feature = "test-hooks")]
    if let Some(act) = STEP_ACTION.with(|a| a.borrow_mut().take_if(|(at, _)| *at == step)) {
        (act.1)();
    }
}

/// What a test does when its thread reaches a pause point.
#[cfg(feature = "test-hooks")]
type StepAction = Option<(&'static str, Box<dyn FnOnce()>)>;

#[cfg(feature = "test-hooks")]
thread_local! {
    static STEP_ACTION: std::cell::RefCell<StepAction> = const { std::cell::RefCell::new(None) };
}

/// Test hook (feature `test-hooks`): runs `act` the first time this thread
/// reaches pause point `step` (see `pause_point`), as a server or another
/// process acting at that moment would; in the test's own process, with
/// no timing to race (unlike `ONEKV_CLIENT_PAUSE`'s sleep, during which
/// the operation's deadline runs out).
#[cfg(feature = "test-hooks")]
pub fn on_step_in_this_thread(step: &'static str, act: impl FnOnce() + 'static) {
    STEP_ACTION.with(|a| *a.borrow_mut() = Some((step, Box::new(act))));
}

fn unexpected(r: Response) -> Error {
    match r {
        Response::Error { kind, message } => Error::from_server(kind, message),
        other => Error::Protocol(format!("unexpected reply {other:?}")),
    }
}
