//! Moving a shard, the source's side: stop serving it (every client's key
//! is revoked, so nobody reads or writes it here any more), let the verbs
//! under way land, then copy every key into the fresh region the target
//! serves only to this copier (`ShardMove::secret`), through an ordinary
//! client connection. The target becomes the owner only when the source
//! publishes the map (see `ShardHost`), after the copy: no write is ever
//! taken by both, and none acknowledged here is missing there.
//!
//! Readers and writers of the shard wait meanwhile (the cluster client
//! retries while the map shows the shard moving); other shards never
//! notice. Copying while readers keep reading (freezing slots as a resize
//! does, sealing counters) would keep GETs working during a move; that is
//! left for later.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use kv_client::{Client, ClientOptions};
use kv_common::layout::{Payload, COUNTER_SEAL};
use kv_common::Address;

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

/// Copies the keys of the shard, which no server here serves any more,
/// to the target at `to`; how many it copied. Copying again into the same
/// target gives the same result (values are put, counters set).
pub fn send(out: &Outgoing, to: &Address) -> Result<u64, String> {
    let started = Instant::now();
    let mut target = connect(out, to)?;
    // Sized as the source before the keys come: no doubling under way
    // while they do.
    let buckets = region::bucket_count(&out.region).map_err(|e| e.to_string())?;
    while target.geometry().bucket_count < buckets {
        target.resize().map_err(|e| e.to_string())?;
    }
    let mut values: Vec<(Vec<u8>, Vec<u8>)> = Vec::with_capacity(BATCH);
    let mut counters = Vec::new();
    let mut copied = 0u64;
    let damaged = region::read_entries(&out.region, out.grace, |key, payload| {
        match *payload {
            Payload::Bytes(value) => {
                values.push((key.to_vec(), value.to_vec()));
                if values.len() == BATCH {
                    target.put_many(&values).map_err(|e| e.to_string())?;
                    values.clear();
                }
            }
            Payload::Counter { value, sealed, .. } => {
                // A seal left by a writer whose client was revoked: its
                // unlink never happened, so the counter is the open value.
                let value = if sealed {
                    (value as u64 ^ COUNTER_SEAL) as i64
                } else {
                    value
                };
                counters.push((key.to_vec(), value));
            }
        }
        copied += 1;
        Ok(())
    })
    .map_err(|e| e.to_string())?;
    target.put_many(&values).map_err(|e| e.to_string())?;
    for (key, value) in counters {
        set_counter(&mut target, &key, value)?;
    }
    if damaged > 0 {
        tracing::error!(
            shard = out.shard,
            damaged,
            "blocks that fail validation were not moved"
        );
    }
    target.close().map_err(|e| e.to_string())?;
    tracing::info!(
        shard = out.shard,
        copied,
        ms = started.elapsed().as_millis() as u64,
        "copied to {to}"
    );
    Ok(copied)
}

/// Keys put per batch.
const BATCH: usize = 64;

/// Makes the counter `key` hold `value`, whatever it holds now.
fn set_counter(target: &mut Client, key: &[u8], value: i64) -> Result<(), String> {
    loop {
        let now = target.incr(key, 0).map_err(|e| e.to_string())?;
        if now == value {
            return Ok(());
        }
        // It returns what it found: `now` when it swapped.
        let found = target
            .compare_and_set(key, now, value)
            .map_err(|e| e.to_string())?;
        if found == Some(now) {
            return Ok(());
        }
    }
}

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
