//! Moving a shard, the source's side, in passes through an ordinary
//! client connection to the fresh region that the target serves only to
//! this copier (`ShardMove::secret`):
//!
//! 1. **While the shard is served here**, every key is copied as read from
//!    the live region: clients keep reading and writing meanwhile, so what
//!    is copied may be out of date, and what reached the target is
//!    remembered. Then again, sending only what differs (changed keys put,
//!    keys gone deleted), until the changes are few (1% of the keys, or a
//!    thousand) or stop halving, at most `LIVE_PASSES` times.
//! 2. **The last pass**, in two steps. With the shard's index frozen for
//!    good ([`Source::freeze`], as a resize freezes it), writers wait and
//!    readers go on; the slots no longer change, nor the values they link,
//!    so every value read now is final, and what differs from what was
//!    sent goes. Then the server stops serving the shard (every client's
//!    key revoked, the verbs under way landed) and the counters, which
//!    increments changed in place until then, are read and sent; keys
//!    this pass did not see are deleted.
//!
//! The target then holds exactly the stopped region's content, whatever
//! the earlier passes copied. Only the shard's clients wait: its writers
//! for the last pass (the frozen index, as during a resize), its readers
//! for the counters' step only (the cluster client retries while the map
//! shows the shard moving). Other shards never notice. The target becomes
//! the owner only when the source publishes the map (see `ShardHost`),
//! after the copy: no write is taken by both, and none acknowledged here
//! is missing there. A move called off before the last pass (`go_on`)
//! leaves the shard served here throughout; one that fails after the
//! freeze stops serving the shard, and the server that serves it again
//! thaws the index as it opens the region.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use kv_client::{Client, ClientOptions};
use kv_common::layout::{Payload, COUNTER_SEAL};
use kv_common::Address;
use xxhash_rust::xxh3::xxh3_128_with_seed;

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
    /// Keys at the target when the source froze the shard's index.
    pub at_freeze: u64,
    /// Keys the last pass put or deleted: what changed after the passes
    /// made while serving read them.
    pub changed: u64,
    /// How long the last pass took: the shard's writers waited as long.
    pub frozen: Duration,
    /// How long its counters' step took: the shard's readers waited as
    /// long.
    pub stopped: Duration,
}

/// What a move needs of the server that serves the shard here.
pub trait Source {
    /// Whether the move may still stop the shard (the map shows it, the
    /// lease is held).
    fn go_on(&self) -> bool;
    /// Freezes the shard's index for good (`Server::hand_over`): writers
    /// wait from now on, readers go on. After an error the move stops
    /// serving the shard all the same.
    fn freeze(&mut self) -> Result<(), String>;
    /// Stops serving the shard: every client's access revoked. (A copy
    /// that restores a replicated shard's replica count leaves it served,
    /// frozen: its counters are values, which the frozen index fixes.)
    fn stop_serving(&mut self);
}

/// Copies the keys of the shard to the target at `to`: passes while this
/// server still serves it, then the last pass around `source.freeze()`
/// and `source.stop_serving()`. The target must be a fresh region (only
/// this copy writes it).
pub fn send(out: &Outgoing, to: &Address, source: &mut dyn Source) -> Result<Copied, String> {
    let started = Instant::now();
    let mut copier = Copier::new(connect(out, to, source)?);
    fresh(&mut copier.target, out.shard, to)?;
    // Sized as the source before the keys come: no doubling under way
    // while they do.
    let buckets = region::bucket_count(&out.region).map_err(|e| e.to_string())?;
    while copier.target.geometry().bucket_count < buckets {
        copier.target.resize().map_err(|e| e.to_string())?;
    }
    live_passes(&mut copier, out, source)?;
    // What was sent is known only over one connection: a target that
    // restarted may hold less (a new region, after a reboot).
    if copier.target.reconnects() > 0 {
        return Err("the target's connection was made anew during the copy".into());
    }
    pause_before_last_pass();
    if !source.go_on() {
        return Err(CALLED_OFF.into());
    }
    let copied = last_pass(&mut copier, out, source)?;
    copier.target.close().map_err(|e| e.to_string())?;
    tracing::info!(
        shard = out.shard,
        keys = copier.sent.len(),
        at_freeze = copied.at_freeze,
        changed = copied.changed,
        frozen_ms = copied.frozen.as_millis() as u64,
        stopped_ms = copied.stopped.as_millis() as u64,
        put_ms = copier.put_time.as_millis() as u64,
        ms = started.elapsed().as_millis() as u64,
        "copied to {to}"
    );
    Ok(copied)
}

/// A test hook: `ONEKV_MOVE_PAUSE=MILLISECONDS` stalls every move of this
/// process that long before its last pass, as the passes of a large shard
/// would take, so that a test can act while one is under way.
fn pause_before_last_pass() {
    let pause = std::env::var("ONEKV_MOVE_PAUSE").ok();
    if let Some(ms) = pause.and_then(|ms| ms.parse().ok()) {
        std::thread::sleep(Duration::from_millis(ms));
    }
}

const CALLED_OFF: &str = "called off (the map dropped it, or the lease is unconfirmed)";

/// Passes while serving, each sending what changed since the one before,
/// for as long as that shrinks. One that fails (the region grew under it)
/// only leaves more for the last.
fn live_passes(copier: &mut Copier, out: &Outgoing, source: &dyn Source) -> Result<(), String> {
    let mut before = 0;
    for pass in 0..LIVE_PASSES {
        if !source.go_on() {
            return Err(CALLED_OFF.into());
        }
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
    Ok(())
}

/// The last pass: values with the index frozen, then counters with the
/// shard stopped, then the deletes.
fn last_pass(
    copier: &mut Copier,
    out: &Outgoing,
    source: &mut dyn Source,
) -> Result<Copied, String> {
    let at_freeze = copier.sent.len() as u64;
    let frozen = Instant::now();
    if let Err(e) = source.freeze() {
        // It may yet freeze: a server that serves the shard again thaws it.
        source.stop_serving();
        return Err(format!("freezing the shard's index: {e}"));
    }
    copier.begin_pass(LIVE_PASSES);
    let values = region::read_frozen_values(&out.region, |key, payload| copier.copy(key, payload))
        .map_err(|e| e.to_string())
        .and_then(|read| copier.flush().map(|()| read));
    // Stopped whatever happened: a frozen shard serves no writer.
    let stopped = Instant::now();
    source.stop_serving();
    let (mut damaged, counters) = values?;
    // None in a replicated shard (its counters are values), whose server
    // goes on serving, frozen, while its copy ends.
    if !counters.is_empty() {
        damaged += region::read_counters_at(&out.region, out.grace, &counters, |key, payload| {
            copier.copy(key, payload)
        })
        .map_err(|e| e.to_string())?;
    }
    copier.flush()?;
    copier.delete_unseen()?;
    if copier.target.reconnects() > 0 {
        return Err("the target's connection was made anew during the copy".into());
    }
    if damaged > 0 {
        tracing::error!(
            shard = out.shard,
            damaged,
            "blocks that fail validation were not moved"
        );
    }
    Ok(Copied {
        at_freeze,
        changed: copier.changed,
        frozen: frozen.elapsed(),
        stopped: stopped.elapsed(),
    })
}

/// What the target holds of a key: as sent, and in which pass it was
/// last seen at the source.
struct Sent {
    what: Content,
    pass: u8,
}

#[derive(Clone, Copy, PartialEq)]
enum Content {
    /// A value, by its hash (128 bits, seeded per move: two values with
    /// one hash would have to be written between the passes).
    Value(u128),
    Counter(i64),
    /// A batch that failed may or may not have reached the target: sent
    /// again whatever the source holds.
    Unknown,
}

/// Puts keys into the target in batches, remembering what reached it so
/// that a later pass sends only what differs. A batch holds values or
/// counters, not both, so that the keys go in the order seen.
struct Copier {
    target: Client,
    sent: HashMap<Vec<u8>, Sent>,
    seed: u64,
    values: Vec<(Vec<u8>, Vec<u8>, u128)>,
    counters: Vec<(Vec<u8>, i64)>,
    pass: u8,
    /// Keys put or deleted in this pass.
    changed: u64,
    /// Time spent putting in this pass.
    put_time: Duration,
}

impl Copier {
    fn new(target: Client) -> Copier {
        Copier {
            target,
            sent: HashMap::new(),
            // Random: no client can know it in advance.
            seed: kv_common::random::u64(),
            values: Vec::with_capacity(BATCH),
            counters: Vec::with_capacity(BATCH),
            pass: 0,
            changed: 0,
            put_time: Duration::ZERO,
        }
    }

    /// Makes the target hold `payload` for `key` (unless it does).
    fn copy(&mut self, key: &[u8], payload: &Payload<'_>) -> Result<(), String> {
        let what = match *payload {
            Payload::Bytes(value) => Content::Value(xxh3_128_with_seed(value, self.seed)),
            // A seal left by a writer whose client was revoked: its
            // unlink never happened, so the counter is the open value.
            Payload::Counter { value, sealed, .. } => Content::Counter(if sealed {
                (value as u64 ^ COUNTER_SEAL) as i64
            } else {
                value
            }),
        };
        if let Some(sent) = self.sent.get_mut(key).filter(|s| s.what == what) {
            sent.pass = self.pass;
            return Ok(());
        }
        self.changed += 1;
        match (what, payload) {
            (Content::Value(hash), Payload::Bytes(value)) => {
                if !self.counters.is_empty() {
                    self.flush()?;
                }
                self.values.push((key.to_vec(), value.to_vec(), hash));
            }
            (Content::Counter(value), _) => {
                if !self.values.is_empty() {
                    self.flush()?;
                }
                self.counters.push((key.to_vec(), value));
            }
            _ => return Err("a payload that is not what it was read as".into()),
        }
        if self.values.len() + self.counters.len() >= BATCH {
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

    /// Sends the keys waiting: values by `put_many`, counters by
    /// `restore_counters` (settled at once: this copier is the target's
    /// only writer). What reached the target is remembered; after an
    /// error, what may have is marked unknown.
    fn flush(&mut self) -> Result<(), String> {
        let started = Instant::now();
        let values = std::mem::take(&mut self.values);
        let counters = std::mem::take(&mut self.counters);
        let sent: Result<(), kv_client::Error> = if values.is_empty() {
            let batch: Vec<(&[u8], i64)> = counters.iter().map(|(k, v)| (&k[..], *v)).collect();
            self.target.restore_counters(&batch)
        } else {
            let batch: Vec<(&[u8], &[u8])> =
                values.iter().map(|(k, v, _)| (&k[..], &v[..])).collect();
            self.target.put_many(&batch)
        };
        let pass = self.pass;
        let ok = sent.is_ok();
        let known = |what| if ok { what } else { Content::Unknown };
        for (key, _, hash) in values {
            let what = known(Content::Value(hash));
            self.sent.insert(key, Sent { what, pass });
        }
        for (key, value) in counters {
            let what = known(Content::Counter(value));
            self.sent.insert(key, Sent { what, pass });
        }
        self.put_time += started.elapsed();
        sent.map_err(|e| e.to_string())
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
            if let Err(e) = self.target.delete_many(keys) {
                // Unseen, they go at the next pass; seen again, they are
                // sent again.
                for key in keys {
                    if let Some(sent) = self.sent.get_mut(key) {
                        sent.what = Content::Unknown;
                    }
                }
                return Err(e.to_string());
            }
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

/// Checks that the region the copier reached holds no key: the fresh one
/// the target makes for the move. A server at the target's address that
/// admits the copier without knowing the move (no secret is configured,
/// and it serves a copy under no group yet) serves an old region, whose
/// keys the copy would mix with the shard's and which its member deletes
/// once it sees the move.
fn fresh(target: &mut Client, shard: u32, to: &Address) -> Result<(), String> {
    let listed = target.key_digests(0).map_err(|e| e.to_string())?;
    match listed.keys.len() as u64 + listed.damaged {
        0 => Ok(()),
        held => Err(format!(
            "the server at {to} already holds keys ({held}) for shard {shard}: not the \
             fresh region a move makes (an old copy served there)"
        )),
    }
}

/// Connects to the target's fresh region, waiting for it to be served for
/// up to `TARGET_WAIT`, and no longer once the move is called off (its
/// target left, say: the member that comes back is sent a new one).
fn connect(out: &Outgoing, to: &Address, source: &dyn Source) -> Result<Client, String> {
    let options = ClientOptions::default().with_secret(out.secret.clone());
    let deadline = Instant::now() + TARGET_WAIT;
    loop {
        match Client::connect_with(&to.to_string(), options.clone()) {
            Ok(client) => return Ok(client),
            Err(e) if Instant::now() > deadline => {
                return Err(format!("the target {to} of shard {}: {e}", out.shard))
            }
            Err(_) if !source.go_on() => return Err(CALLED_OFF.into()),
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}
