//! Moving a shard, the source's side, in two passes through an ordinary
//! client connection to the fresh region that the target serves only to
//! this copier (`ShardMove::secret`):
//!
//! 1. **While the shard is served here**, every key is copied as read from
//!    the live region: clients keep reading and writing meanwhile, so what
//!    is copied may be out of date, and what was sent is remembered. Then
//!    again, sending only what differs from what was sent (changed keys
//!    put, keys gone deleted), while that shrinks (`LIVE_PASSES`).
//! 2. **Once this server has stopped serving the shard** (every client's
//!    key revoked, the verbs under way landed), the region is read a last
//!    time and what differs from what was sent goes.
//!
//! The target then holds exactly the last pass's content, whatever the
//! earlier ones copied. Clients wait only during the last pass, whose
//! length is the reading of the region plus the writes made during the
//! pass before it: the
//! shard's readers and writers (the cluster client retries while the map
//! shows the shard moving) — other shards never notice. The target becomes
//! the owner only when the source publishes the map (see `ShardHost`),
//! after the copy: no write is taken by both, and none acknowledged here
//! is missing there.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use kv_client::{Client, ClientOptions};
use kv_common::layout::{Payload, COUNTER_SEAL};
use kv_common::Address;
use xxhash_rust::xxh3::xxh3_128;

use crate::region;

/// What a move needs of the source.
pub struct Outgoing {
    pub shard: u32,
    /// What the target asks of the copier.
    pub secret: Vec<u8>,
    /// The shard's region file here.
    pub region: PathBuf,
    /// How long verbs posted before the revocation may still land.
    pub grace: Duration,
}

/// How long the copier waits for the target to serve the fresh region.
const TARGET_WAIT: Duration = Duration::from_secs(30);

/// Most passes made while the source serves: later ones send only what
/// changed during the one before, until that no longer halves.
const LIVE_PASSES: u8 = 4;

/// What a move copied.
#[derive(Debug, Default)]
pub struct Copied {
    /// Keys at the target when the source stopped serving.
    pub at_stop: u64,
    /// Keys the last pass put or deleted: what changed after the passes
    /// made while serving read them.
    pub changed: u64,
    /// How long the last pass took: clients of the shard waited as long.
    pub stopped: Duration,
}

/// Copies the keys of the shard to the target at `to`: passes while this
/// server still serves it, `stop_serving()`, then what changed. The target
/// must be a fresh region (only this copy writes it).
pub fn send(out: &Outgoing, to: &Address, stop_serving: impl FnOnce()) -> Result<Copied, String> {
    let started = Instant::now();
    let mut copier = Copier::new(connect(out, to)?);
    // Sized as the source before the keys come: no doubling under way
    // while they do.
    let buckets = region::bucket_count(&out.region).map_err(|e| e.to_string())?;
    while copier.target.geometry().bucket_count < buckets {
        copier.target.resize().map_err(|e| e.to_string())?;
    }
    // Passes while serving, each sending what changed since the one
    // before, for as long as that shrinks. One that fails (the region
    // grew under it) only leaves more for the last.
    let mut before = 0;
    for pass in 0..LIVE_PASSES {
        copier.begin_pass(pass);
        let read = region::read_entries_live(&out.region, |key, payload| copier.copy(key, payload))
            .map_err(|e| e.to_string())
            .and_then(|_| copier.flush())
            .and_then(|()| copier.delete_unseen());
        if let Err(e) = read {
            tracing::warn!(shard = out.shard, pass, "a copy while serving stopped: {e}");
            break;
        }
        tracing::debug!(
            shard = out.shard,
            pass,
            changed = copier.changed,
            put_ms = copier.put_time.as_millis() as u64,
            "copied while serving"
        );
        let settled = copier.changed <= (copier.sent.len() as u64 / 100).max(1000);
        let shrank = copier.changed.saturating_mul(2) <= before || pass == 0;
        before = copier.changed;
        if settled || !shrank {
            break;
        }
    }
    let at_stop = copier.sent.len() as u64;
    let stopped = Instant::now();
    stop_serving();
    copier.begin_pass(LIVE_PASSES);
    let damaged = region::read_entries(&out.region, out.grace, |key, payload| {
        copier.copy(key, payload)
    })
    .map_err(|e| e.to_string())?;
    copier.flush()?;
    copier.delete_unseen()?;
    if damaged > 0 {
        tracing::error!(
            shard = out.shard,
            damaged,
            "blocks that fail validation were not moved"
        );
    }
    let copied = Copied {
        at_stop,
        changed: copier.changed,
        stopped: stopped.elapsed(),
    };
    copier.target.close().map_err(|e| e.to_string())?;
    tracing::info!(
        shard = out.shard,
        keys = copier.sent.len(),
        at_stop,
        changed = copied.changed,
        stopped_ms = copied.stopped.as_millis() as u64,
        put_ms = copier.put_time.as_millis() as u64,
        ms = started.elapsed().as_millis() as u64,
        "copied to {to}"
    );
    Ok(copied)
}

/// What the target holds of a key: as sent, and in which pass it was
/// last seen at the source.
struct Sent {
    what: Content,
    pass: u8,
}

#[derive(Clone, Copy, PartialEq)]
enum Content {
    /// A value, by its hash (a 128-bit xxh3: two values with one hash
    /// would have to be written between the passes).
    Value(u128),
    Counter(i64),
}

/// Puts keys into the target in batches, remembering what it sent so
/// that a later pass sends only what differs.
struct Copier {
    target: Client,
    sent: HashMap<Vec<u8>, Sent>,
    /// Keys waiting for a batch, in the order seen.
    pending: Vec<(Vec<u8>, Pending)>,
    pass: u8,
    /// Keys put or deleted in this pass.
    changed: u64,
    /// Time spent putting in this pass.
    put_time: Duration,
}

enum Pending {
    Value(Vec<u8>),
    Counter(i64),
}

impl Copier {
    fn new(target: Client) -> Copier {
        Copier {
            target,
            sent: HashMap::new(),
            pending: Vec::with_capacity(BATCH),
            pass: 0,
            changed: 0,
            put_time: Duration::ZERO,
        }
    }

    /// Makes the target hold `payload` for `key` (unless it does).
    fn copy(&mut self, key: &[u8], payload: &Payload<'_>) -> Result<(), String> {
        let (what, pending) = match *payload {
            Payload::Bytes(value) => (
                Content::Value(xxh3_128(value)),
                Pending::Value(value.to_vec()),
            ),
            // A seal left by a writer whose client was revoked: its
            // unlink never happened, so the counter is the open value.
            Payload::Counter { value, sealed, .. } => {
                let value = if sealed {
                    (value as u64 ^ COUNTER_SEAL) as i64
                } else {
                    value
                };
                (Content::Counter(value), Pending::Counter(value))
            }
        };
        let pass = self.pass;
        let before = self.sent.insert(key.to_vec(), Sent { what, pass });
        if before.is_some_and(|b| b.what == what) {
            return Ok(());
        }
        self.changed += 1;
        self.pending.push((key.to_vec(), pending));
        if self.pending.len() == BATCH {
            self.flush()?;
        }
        Ok(())
    }

    /// Starts a pass: nothing changed or seen in it yet.
    fn begin_pass(&mut self, pass: u8) {
        self.put_time = Duration::ZERO;
        self.pass = pass;
        self.changed = 0;
    }

    /// Sends the keys waiting: runs of values by `put_many`, runs of
    /// counters by `restore_counters` (settled at once: this copier is the
    /// target's only writer), in the order seen.
    fn flush(&mut self) -> Result<(), String> {
        let started = Instant::now();
        let pending = std::mem::take(&mut self.pending);
        let err = |e: kv_client::Error| e.to_string();
        for run in pending.chunk_by(|a, b| {
            matches!(
                (&a.1, &b.1),
                (Pending::Value(_), Pending::Value(_)) | (Pending::Counter(_), Pending::Counter(_))
            )
        }) {
            match run[0].1 {
                Pending::Value(_) => {
                    let values: Vec<(&[u8], &[u8])> = run
                        .iter()
                        .filter_map(|(k, p)| match p {
                            Pending::Value(v) => Some((&k[..], &v[..])),
                            Pending::Counter(_) => None,
                        })
                        .collect();
                    self.target.put_many(&values).map_err(err)?;
                }
                Pending::Counter(_) => {
                    let counters: Vec<(&[u8], i64)> = run
                        .iter()
                        .filter_map(|(k, p)| match p {
                            Pending::Counter(v) => Some((&k[..], *v)),
                            Pending::Value(_) => None,
                        })
                        .collect();
                    self.target.restore_counters(&counters).map_err(err)?;
                }
            }
        }
        self.pending = pending;
        self.pending.clear();
        self.put_time += started.elapsed();
        Ok(())
    }

    /// Deletes at the target the keys this pass did not see.
    fn delete_unseen(&mut self) -> Result<(), String> {
        let pass = self.pass;
        let gone: Vec<Vec<u8>> = self
            .sent
            .iter()
            .filter(|(_, s)| s.pass != pass)
            .map(|(k, _)| k.clone())
            .collect();
        for keys in gone.chunks(BATCH) {
            self.target.delete_many(keys).map_err(|e| e.to_string())?;
            for key in keys {
                self.sent.remove(key);
            }
        }
        self.changed += gone.len() as u64;
        Ok(())
    }
}

/// Keys put per batch.
const BATCH: usize = 64;

fn connect(out: &Outgoing, to: &Address) -> Result<Client, String> {
    let options = ClientOptions::default().with_secret(out.secret.clone());
    let deadline = Instant::now() + TARGET_WAIT;
    loop {
        match Client::connect_with(&to.to_string(), options.clone()) {
            Ok(client) => return Ok(client),
            Err(e) if Instant::now() > deadline => {
                return Err(format!("the target {to} of shard {}: {e}", out.shard))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}
