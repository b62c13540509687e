//! Levelling the backups a failover kept beside the one it promoted
//! (kv-cluster's `placement::failover`), run by the new primary's member.
//!
//! Such a backup holds every acknowledged write, but, for a key whose
//! writers were never answered, maybe an older value than the one the new
//! primary serves (two writers' sets can reach two backups in opposite
//! orders): promoted as it is, it could show readers a value going back.
//! Every write made under the new group sets it before it commits at the
//! primary, so a key written since the failover is level on it (kv-client's
//! `replicated`: a backup then holds the last committed value, or a set in
//! flight after it). What is left are the keys nobody wrote since.
//!
//! The leveller lists the keys of each such backup, then of the primary,
//! with digests of their values (`Request::Keys`, seeded at random so that
//! no client can make two values collide). A key listed on one side only,
//! with another digest, twice, or as a counter, is read again at every
//! copy (under load, most keys listed apart were written between the
//! listings), and one still apart is written again: the primary's value
//! set on the backups and committed over itself at the primary, or the
//! key removed from the backups under its insert lock where the primary
//! has none (`kv_client::level_copies`), a write ordered like any other,
//! after which the key is level. A key found alike is level already: the
//! two sides were read at different moments, but if no write committed
//! between them the primary's value was the same at both, and if one did,
//! it levelled the key.
//!
//! Only the backups being levelled are written: a levelling that stops
//! (an error, its member's death) between a set and its commit may leave
//! there an older value than a later commit's, which on a backup that may
//! be promoted would be an acknowledged write lost; on these it lasts
//! only until the next levelling, since none is promoted before one
//! succeeds. Once every key is level, the map says so while the same
//! member leads (`ShardMap::levelled`), and a failover may promote them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};

use kv_client::{Client, ClientOptions, KeysPage};
use kv_cluster::etcd::BlockingEtcd;
use kv_cluster::{shard_address, ClusterUrl};
use kv_common::Address;

/// What to level: backups `members` of `shard`, in group `group_epoch`,
/// whose primary this member serves at `primary`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Levelling {
    pub shard: u32,
    pub group_epoch: u64,
    pub members: Vec<String>,
    pub primary: Address,
}

/// What a levelling found and did.
#[derive(Debug)]
pub struct Levelled {
    /// Keys the primary holds.
    pub keys: usize,
    /// Keys the listings showed apart (or could not compare).
    pub listed_apart: usize,
    /// How long listing and comparing took.
    pub listed: std::time::Duration,
    /// Of those, keys still apart when read again, written again (or
    /// removed from the backups).
    pub written: usize,
    /// Whether the map took it (it still showed them unlevelled, this
    /// member leading).
    pub published: bool,
}

/// Levels `what`'s backups and says so on the map, as `member`. Stops
/// early, with an error, when `quit` is set.
pub fn level(
    url: &ClusterUrl,
    member: &str,
    what: &Levelling,
    quit: &AtomicBool,
) -> Result<Levelled, String> {
    let started = std::time::Instant::now();
    let seed = kv_common::random::u64();
    let connect = |address: &Address| -> Result<Client, String> {
        let options = ClientOptions::default().with_group_epoch(what.group_epoch);
        Client::connect_with(&address.to_string(), options).map_err(|e| format!("{address}: {e}"))
    };
    let mut primary = connect(&what.primary)?;
    let mut backups = backup_addresses(url, what)?
        .iter()
        .map(connect)
        .collect::<Result<Vec<Client>, String>>()?;
    let mut listings = Vec::with_capacity(backups.len());
    for backup in &mut backups {
        listings.push(listing(backup, seed)?);
    }
    // After the backups: either order would do (see the module's comment).
    let at_primary = listing(&mut primary, seed)?;
    let keys = at_primary.keys.len();
    let listed_apart = differing_keys(&at_primary, &listings);
    drop((at_primary, listings));
    let listed = started.elapsed();
    let mut written = 0;
    // Keys written since their listing are most of those listed apart
    // under load: read again, side by side, before each is written.
    for batch in listed_apart.chunks(READ_BATCH) {
        if quit.load(Ordering::SeqCst) {
            return Err("called off".into());
        }
        let read = |c: &mut Client| {
            c.get_many(batch)
                .map_err(|e| format!("{}: {e}", c.address()))
        };
        let values = read(&mut primary)?;
        let mut apart = vec![false; batch.len()];
        for backup in &mut backups {
            for (i, value) in read(backup)?.into_iter().enumerate() {
                apart[i] |= value != values[i];
            }
        }
        for (key, _) in batch.iter().zip(apart).filter(|(_, apart)| *apart) {
            kv_client::level_copies(&mut primary, &mut backups, key)
                .map_err(|e| format!("levelling {:?}: {e}", String::from_utf8_lossy(key)))?;
            written += 1;
        }
    }
    let published = publish(url, what, member, quit)?;
    Ok(Levelled {
        keys,
        listed_apart: listed_apart.len(),
        listed,
        written,
        published,
    })
}

/// Keys read at a time from each copy when checking them again.
const READ_BATCH: usize = 64;

/// The keys of the region `client` is connected to, digests seeded by
/// `seed`; an error when some cannot be read.
fn listing(client: &mut Client, seed: u64) -> Result<KeysPage, String> {
    let listed = client
        .key_digests(seed)
        .map_err(|e| format!("{}: {e}", client.address()))?;
    if listed.damaged > 0 {
        return Err(format!(
            "{}: {} slots name blocks that fail validation (see `kv-server check`)",
            client.address(),
            listed.damaged
        ));
    }
    Ok(listed)
}

/// Where each backup to level serves the shard: from its member record.
fn backup_addresses(url: &ClusterUrl, what: &Levelling) -> Result<Vec<Address>, String> {
    let mut etcd = BlockingEtcd::connect(url).map_err(|e| e.to_string())?;
    let state = etcd.state().map_err(|e| e.to_string())?;
    what.members
        .iter()
        .map(|id| {
            let member = state
                .member(id)
                .ok_or_else(|| format!("the backup {id} is not a live member"))?;
            shard_address(&Address::parse(&member.listen)?, what.shard)
        })
        .collect()
}

/// The keys on which a backup may differ from the primary (see the
/// module's comment), each once.
fn differing_keys(primary: &KeysPage, backups: &[KeysPage]) -> Vec<Vec<u8>> {
    let at_primary = digests(primary);
    let mut differing: Vec<&[u8]> = Vec::new();
    for backup in backups {
        let at_backup = digests(backup);
        for (key, digest) in &at_primary {
            if digest.is_none() || at_backup.get(key) != Some(digest) {
                differing.push(key);
            }
        }
        differing.extend(at_backup.keys().filter(|k| !at_primary.contains_key(*k)));
    }
    differing.sort_unstable();
    differing.dedup();
    differing.into_iter().map(<[u8]>::to_vec).collect()
}

/// Each key of a listing with its digest; none for a counter, or for a key
/// listed twice (two copies of it in the index: compared by nobody).
fn digests(listing: &KeysPage) -> HashMap<&[u8], Option<u128>> {
    let mut digests = HashMap::with_capacity(listing.keys.len());
    for k in &listing.keys {
        digests
            .entry(k.key.as_slice())
            .and_modify(|d| *d = None)
            .or_insert(k.digest);
    }
    digests
}

/// Says on the map that the backups are level, if it still shows them
/// unlevelled, led by `member` (see `ShardMap::levelled`). Whether it
/// took it.
fn publish(
    url: &ClusterUrl,
    what: &Levelling,
    member: &str,
    quit: &AtomicBool,
) -> Result<bool, String> {
    let mut etcd = BlockingEtcd::connect(url).map_err(|e| e.to_string())?;
    for _ in 0..100 {
        // The member no longer leads the shard, or lost its lease.
        if quit.load(Ordering::SeqCst) {
            return Err("called off".into());
        }
        let state = etcd.state().map_err(|e| e.to_string())?;
        let Some((map, revision)) = state.map else {
            return Err("the map is gone".into());
        };
        let Some(next) = map.levelled(what.shard, member, what.group_epoch, &what.members) else {
            return Ok(false);
        };
        if etcd
            .publish_map(&next, Some((&map, revision)))
            .map_err(|e| e.to_string())?
        {
            return Ok(true);
        }
    }
    Err("the map kept changing".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_client::KeyDigest;

    fn listing(keys: &[(&str, Option<u128>)]) -> KeysPage {
        KeysPage {
            epoch: 1,
            resizing: false,
            next: None,
            damaged: 0,
            keys: keys
                .iter()
                .map(|(k, d)| KeyDigest {
                    key: k.as_bytes().to_vec(),
                    digest: *d,
                })
                .collect(),
        }
    }

    #[test]
    fn every_key_a_backup_may_hold_otherwise_is_written_again() {
        let primary = listing(&[
            ("same", Some(1)),
            ("changed", Some(2)),
            ("only-here", Some(3)),
            ("counter", None),
            ("twice", Some(5)),
            ("twice", Some(5)),
        ]);
        let first = listing(&[
            ("same", Some(1)),
            ("changed", Some(9)),
            ("counter", None),
            ("twice", Some(5)),
            ("only-there", Some(4)),
        ]);
        let second = listing(&[
            ("same", Some(1)),
            ("changed", Some(2)),
            ("only-here", Some(3)),
            ("twice", Some(5)),
            ("counter", None),
        ]);
        let differing = differing_keys(&primary, &[first, second]);
        let names: Vec<&str> = differing
            .iter()
            .map(|k| std::str::from_utf8(k).unwrap())
            .collect();
        assert_eq!(
            names,
            ["changed", "counter", "only-here", "only-there", "twice"]
        );
        assert!(differing_keys(&primary, &[]).is_empty());
    }
}
