//! Which member should own each shard. Pure: the coordinator feeds it what
//! etcd holds and publishes what it returns.

use std::collections::BTreeMap;

use crate::records::{ClusterConfig, ShardMap, ShardMove};

/// The map the coordinator should publish, or none when nothing needs to
/// change. `live` are the ids of the members whose records exist, each
/// with its zone, `draining` those of them that are leaving; `new_secret`
/// makes the secret of a move.
///
/// - No map yet: one is made once `initial_members` have joined, the
///   shards dealt round-robin over them (sorted, so any coordinator deals
///   the same way); with replicas, each shard's group as [`deal_groups`]
///   makes them.
/// - With replicas, failover changes the map first (see [`failover`]);
///   then a shard short of copies gets one more (see [`restore_copies`]).
///   No shard changes owners by a move: a move copies one region and its
///   backups would not follow.
/// - A move under way is waited for, or dropped if its source is no
///   longer live or its target no longer takes shards (it cannot finish;
///   the source keeps the shard).
/// - A shard without an owner goes to the member that owns fewest.
/// - A shard whose owner is not live keeps it (one copy): its region is
///   on that server, which brings it back when it restarts.
/// - A draining member's shards move away first, then, while two members'
///   shard counts differ by more than one, a shard of the one with most
///   moves to the one with fewest: one move at a time. Ties go to the
///   lowest id, so that any coordinator picks alike.
pub fn next_map(
    config: &ClusterConfig,
    map: Option<&ShardMap>,
    live: &[(String, Option<String>)],
    draining: &[String],
    new_secret: impl FnOnce() -> String,
) -> Option<ShardMap> {
    let members = Members {
        live,
        draining,
        held_back: &[],
    };
    next_map_avoiding(config, map, &members, new_secret)
}

/// As [`next_map`], proposing no copy of a replicated cluster's shard to
/// a member paired with it in `held_back` (a copy there failed lately):
/// the next member or shard goes first.
pub fn next_map_avoiding(
    config: &ClusterConfig,
    map: Option<&ShardMap>,
    members: &Members<'_>,
    new_secret: impl FnOnce() -> String,
) -> Option<ShardMap> {
    let Members { live, draining, .. } = *members;
    let mut takers: Vec<&String> = live
        .iter()
        .map(|(id, _)| id)
        .filter(|m| !draining.contains(m))
        .collect();
    takers.sort();
    takers.dedup();
    let Some(map) = map else {
        if takers.is_empty() || takers.len() < config.initial_members as usize {
            return None;
        }
        let zoned: Vec<(String, Option<String>)> = live
            .iter()
            .filter(|(id, _)| !draining.contains(id))
            .cloned()
            .collect();
        return first_map(config, &zoned);
    };
    if config.replicas > 1 {
        let ids: Vec<&str> = live.iter().map(|(id, _)| id.as_str()).collect();
        return failover(map, &ids)
            .or_else(|| restore_copies(config.replicas, map, members, new_secret));
    }
    let live: Vec<String> = live.iter().map(|(id, _)| id.clone()).collect();
    let live = live.as_slice();
    let count = |map: &ShardMap, m: &str| map.shards_of(m).count();
    let fewest = takers.iter().min_by_key(|m| (count(map, m), **m))?;
    let mut next = map.clone();
    next.epoch += 1;
    if let Some(m) = &map.moving {
        let source_live = map
            .owner(m.shard)
            .is_some_and(|o| live.iter().any(|l| l == o));
        if source_live && takers.contains(&&m.to) {
            return None;
        }
        next.moving = None;
        return Some(next);
    }
    if map.owners.iter().any(Option::is_none) {
        for shard in 0..next.owners.len() {
            if next.owners[shard].is_none() {
                let fewest = takers.iter().min_by_key(|m| (count(&next, m), **m));
                next.owners[shard] = fewest.map(|m| (*m).clone());
            }
        }
        return Some(next);
    }
    let mut leaving: Vec<&String> = draining.iter().collect();
    leaving.sort();
    let shard = match leaving.iter().find_map(|d| map.shards_of(d).last()) {
        Some(shard) => shard,
        None => {
            let most = takers
                .iter()
                .min_by_key(|m| (std::cmp::Reverse(count(map, m)), **m))?;
            if count(map, most) <= count(map, fewest) + 1 {
                return None;
            }
            map.shards_of(most).last()?
        }
    };
    next.moving = Some(ShardMove {
        shard,
        to: (*fewest).clone(),
        secret: new_secret(),
    });
    Some(next)
}

/// The map after the copies of members not in `live` are given up (their
/// leases expired): a gone backup leaves its group; a shard whose primary
/// is gone is led by its last live backup alone, under a new group epoch
/// (the new map's epoch). A shard with no live copy keeps its group: its
/// copies' servers hold its only state and serve it again when they
/// return. None when nothing changes.
///
/// Why the backup holds every acknowledged write: a write commits at the
/// primary only after it set every backup, and a backup's value is the
/// last committed write or a set that landed after it from a writer never
/// answered (see kv-client's `replicated`), which may take effect now.
/// Why alone: two such writers' sets may reach two backups in opposite
/// orders, so the backups left could disagree with the new primary in a
/// way that a second failover would show readers as a value going back.
/// They are dropped (their servers delete them) until copies made from the
/// new primary restore the count.
fn failover(map: &ShardMap, live: &[&str]) -> Option<ShardMap> {
    let mut next = map.clone();
    next.epoch += 1;
    let mut changed = false;
    for shard in 0..map.owners.len() {
        let Some(primary) = map.owners[shard].as_deref() else {
            continue;
        };
        let backups = map.backups(shard as u32);
        let mut kept: Vec<String> = backups
            .iter()
            .filter(|b| live.contains(&b.as_str()))
            .cloned()
            .collect();
        if live.contains(&primary) {
            if kept.len() != backups.len() {
                next.backups[shard] = kept;
                changed = true;
            }
            continue;
        }
        let Some(promoted) = kept.pop() else {
            continue;
        };
        next.owners[shard] = Some(promoted);
        next.backups[shard] = Vec::new();
        next.group_epochs.resize(map.owners.len(), 0);
        next.group_epochs[shard] = next.epoch;
        changed = true;
    }
    // A copy under way ends with its source (its target's end is
    // `restore_copies`' to see).
    if let Some(m) = &map.moving {
        if next.owner(m.shard) != map.owner(m.shard) {
            next.moving = None;
            changed = true;
        }
    }
    changed.then_some(next)
}

/// Who may take shards: the live members with their zones, those of them
/// leaving, and (shard, member) pairs not to copy to now.
#[derive(Clone, Copy)]
pub struct Members<'a> {
    pub live: &'a [(String, Option<String>)],
    pub draining: &'a [String],
    pub held_back: &'a [(u32, String)],
}

/// The map after one more copy of a shard short of `replicas` is started
/// (a `moving` of a replicated cluster adds its target to the group; see
/// kv-server's `shard_host`), or the copy under way dropped when it can no
/// longer finish; none when nothing changes. One copy at a time, to the
/// shard with fewest copies (then the lowest), from its live primary, to
/// the live member that takes shards, holds none of the group and shares
/// no zone with it, and holds fewest copies (ties to the lowest id).
fn restore_copies(
    replicas: u32,
    map: &ShardMap,
    members: &Members<'_>,
    new_secret: impl FnOnce() -> String,
) -> Option<ShardMap> {
    let Members {
        live,
        draining,
        held_back,
    } = *members;
    let is_live = |id: &str| live.iter().any(|(l, _)| l == id);
    let takes = |id: &str| is_live(id) && !draining.iter().any(|d| d == id);
    if let Some(m) = &map.moving {
        let source_live = map.owner(m.shard).is_some_and(is_live);
        if source_live && takes(&m.to) {
            return None;
        }
        let mut next = map.clone();
        next.epoch += 1;
        next.moving = None;
        return Some(next);
    }
    let zone_of = |id: &str| {
        let zone = live
            .iter()
            .find(|(l, _)| l == id)
            .and_then(|(_, z)| z.clone());
        zone.map_or_else(|| format!("member:{id}"), |z| format!("zone:{z}"))
    };
    let group = |shard: u32| {
        let backups = map.backups(shard).iter().map(String::as_str);
        map.owner(shard).into_iter().chain(backups)
    };
    // The member a copy of `shard` would go to, if one can take it.
    let target = |shard: u32| {
        let zones: Vec<String> = group(shard).map(zone_of).collect();
        live.iter()
            .map(|(id, _)| id.as_str())
            .filter(|id| takes(id) && !group(shard).any(|g| g == *id))
            .filter(|id| !held_back.iter().any(|(s, to)| *s == shard && to == id))
            .filter(|id| !zones.contains(&zone_of(id)))
            .min_by_key(|id| (map.copies_of(id).count(), *id))
    };
    let mut short: Vec<(usize, u32)> = (0..map.owners.len() as u32)
        .filter(|&s| map.owner(s).is_some_and(is_live))
        .map(|s| (group(s).count(), s))
        .filter(|&(copies, _)| copies < replicas as usize)
        .collect();
    short.sort_unstable();
    let (shard, to) = short.into_iter().find_map(|(_, s)| Some((s, target(s)?)))?;
    let mut next = map.clone();
    next.epoch += 1;
    next.moving = Some(ShardMove {
        shard,
        to: to.to_string(),
        secret: new_secret(),
    });
    Some(next)
}

/// The first map, over `members` (each with its zone).
fn first_map(config: &ClusterConfig, members: &[(String, Option<String>)]) -> Option<ShardMap> {
    let (owners, backups) = match config.replicas {
        1 => {
            let mut ids: Vec<&String> = members.iter().map(|(id, _)| id).collect();
            ids.sort();
            ids.dedup();
            let owners = (0..config.shards as usize)
                .map(|s| ids[s % ids.len()].clone())
                .collect();
            (owners, Vec::new())
        }
        r => deal_groups(config.shards, r, members)?,
    };
    Some(ShardMap {
        epoch: 1,
        owners: owners.into_iter().map(Some).collect(),
        backups,
        moving: None,
        group_epochs: Vec::new(),
    })
}

/// Deals each of `shards` a group of `replicas` members: its primary and
/// its backups, all distinct, and in distinct zones where members name
/// theirs (a member without a zone is a zone of its own). Primaries go
/// round-robin, so no member leads more than its share ±1; each backup
/// goes to the eligible member that holds fewest copies so far (ties to
/// the lowest id), so copies are spread as evenly as the zones allow.
/// None when the members cannot give every shard `replicas` zones.
pub fn deal_groups(
    shards: u32,
    replicas: u32,
    members: &[(String, Option<String>)],
) -> Option<(Vec<String>, Vec<Vec<String>>)> {
    let mut members: Vec<(String, String)> = members
        .iter()
        .map(|(id, zone)| {
            let zone = zone
                .clone()
                .map_or_else(|| format!("member:{id}"), |z| format!("zone:{z}"));
            (id.clone(), zone)
        })
        .collect();
    members.sort();
    members.dedup();
    let zones: std::collections::BTreeSet<&String> = members.iter().map(|(_, z)| z).collect();
    if replicas == 0 || zones.len() < replicas as usize {
        return None;
    }
    let mut copies: BTreeMap<&str, usize> =
        members.iter().map(|(id, _)| (id.as_str(), 0)).collect();
    let mut owners = Vec::with_capacity(shards as usize);
    let mut backups = Vec::with_capacity(shards as usize);
    // Primaries by round-robin over the members taken a zone at a time
    // (the first of each zone, then the second of each...), so that
    // consecutive shards lead from different zones.
    let rank = |(id, zone): &(String, String)| {
        members
            .iter()
            .filter(|(other, z)| z == zone && other < id)
            .count()
    };
    let mut by_zone: Vec<&(String, String)> = members.iter().collect();
    by_zone.sort_by_key(|m| (rank(m), &m.1, &m.0));
    for shard in 0..shards as usize {
        let (primary, primary_zone) = by_zone[shard % by_zone.len()];
        *copies.entry(primary.as_str()).or_default() += 1;
        let mut used = vec![primary_zone];
        let mut group = Vec::new();
        for _ in 1..replicas {
            let (id, zone) = members
                .iter()
                .filter(|(_, z)| !used.contains(&z))
                .min_by_key(|(id, _)| (copies[id.as_str()], id.as_str()))?;
            *copies.entry(id.as_str()).or_default() += 1;
            used.push(zone);
            group.push(id.clone());
        }
        owners.push(primary.clone());
        backups.push(group);
    }
    Some((owners, backups))
}

/// A secret for a move: 128 bits from the OS's randomness, as hex.
pub fn random_secret() -> String {
    format!(
        "{:016x}{:016x}",
        kv_common::random::u64(),
        kv_common::random::u64()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(shards: u32, initial_members: u32) -> ClusterConfig {
        ClusterConfig {
            shards,
            initial_members,
            replicas: 1,
        }
    }

    fn secret() -> String {
        "s".into()
    }

    fn ids(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    /// Members as `next_map` takes them: without zones.
    fn live(names: &[&str]) -> Vec<(String, Option<String>)> {
        names.iter().map(|s| (s.to_string(), None)).collect()
    }

    #[test]
    fn the_first_map_waits_for_the_initial_members_then_deals_evenly() {
        let c = config(8, 3);
        assert_eq!(next_map(&c, None, &live(&["b", "a"]), &[], secret), None);
        let map = next_map(&c, None, &live(&["c", "b", "a"]), &[], secret).unwrap();
        assert_eq!(map.epoch, 1);
        let counts: Vec<usize> = ["a", "b", "c"]
            .iter()
            .map(|m| map.shards_of(m).count())
            .collect();
        assert_eq!(counts, [3, 3, 2]);
        // Any coordinator deals the same way.
        assert_eq!(
            next_map(&c, None, &live(&["a", "c", "b"]), &[], secret),
            Some(map)
        );
    }

    #[test]
    fn owned_shards_stay_and_unowned_ones_go_to_the_least_loaded() {
        let c = config(4, 1);
        let map = ShardMap {
            group_epochs: Vec::new(),
            epoch: 7,
            owners: vec![Some("gone".into()), None, Some("a".into()), None],
            backups: Vec::new(),
            moving: None,
        };
        let next = next_map(&c, Some(&map), &live(&["a", "b"]), &[], secret).unwrap();
        assert_eq!(next.epoch, 8);
        assert_eq!(next.owner(0), Some("gone"));
        assert_eq!(next.owner(1), Some("b"));
        assert_eq!(next.owner(2), Some("a"));
        assert!(next.owner(3).is_some());
        assert_eq!(
            next_map(&c, Some(&next), &live(&["a", "b"]), &[], secret),
            None
        );
    }

    #[test]
    fn a_member_that_joins_gets_shards_one_move_at_a_time_until_balanced() {
        let c = config(6, 2);
        let mut map = next_map(&c, None, &live(&["a", "b"]), &[], secret).unwrap();
        let members = live(&["a", "b", "c"]);
        let mut moves = 0;
        while let Some(next) = next_map(&c, Some(&map), &members, &[], secret) {
            assert_eq!(next.epoch, map.epoch + 1);
            // Each step proposes one move, or completes it (as the source
            // would), never both.
            let m = next.moving.clone().expect("a move");
            assert_eq!(next.owners, map.owners);
            assert_eq!(m.to, "c");
            assert_eq!(
                next_map(&c, Some(&next), &members, &[], secret),
                None,
                "one at a time"
            );
            map = next;
            map.owners[m.shard as usize] = Some(m.to);
            map.moving = None;
            map.epoch += 1;
            moves += 1;
        }
        assert_eq!(moves, 2);
        for m in ["a", "b", "c"] {
            assert_eq!(map.shards_of(m).count(), 2, "{map:?}");
        }
    }

    #[test]
    fn a_move_whose_target_dies_is_dropped() {
        let c = config(2, 1);
        let map = ShardMap {
            epoch: 3,
            owners: vec![Some("a".into()), Some("a".into())],
            backups: Vec::new(),
            group_epochs: Vec::new(),
            moving: Some(ShardMove {
                shard: 1,
                to: "b".into(),
                secret: "s".into(),
            }),
        };
        assert_eq!(
            next_map(&c, Some(&map), &live(&["a", "b"]), &[], secret),
            None
        );
        let dropped = next_map(&c, Some(&map), &live(&["a"]), &[], secret).unwrap();
        assert_eq!(dropped.moving, None);
        assert_eq!(dropped.owners, map.owners);
    }

    #[test]
    fn a_draining_member_hands_every_shard_over() {
        let c = config(4, 2);
        let mut map = next_map(&c, None, &live(&["a", "b"]), &[], secret).unwrap();
        let (members, draining) = (live(&["a", "b"]), ids(&["b"]));
        while let Some(next) = next_map(&c, Some(&map), &members, &draining, secret) {
            let m = next.moving.clone().expect("a move");
            assert_eq!((map.owner(m.shard), m.to.as_str()), (Some("b"), "a"));
            map = next;
            map.owners[m.shard as usize] = Some(m.to);
            map.moving = None;
        }
        assert_eq!(map.shards_of("a").count(), 4);
    }

    /// Members with zones, as `next_map` takes them.
    fn zoned(members: &[(&str, &str)]) -> Vec<(String, Option<String>)> {
        members
            .iter()
            .map(|(id, zone)| (id.to_string(), Some(zone.to_string())))
            .collect()
    }

    #[test]
    fn replica_groups_are_distinct_members_in_distinct_zones_with_primaries_spread() {
        let c = ClusterConfig {
            shards: 16,
            initial_members: 3,
            replicas: 3,
        };
        // Two servers in zone x: a group takes at most one of them.
        let members = zoned(&[("a", "x"), ("b", "x"), ("c", "y"), ("d", "z")]);
        let map = next_map(&c, None, &members, &[], secret).unwrap();
        assert_eq!(map.backups.len(), 16);
        let zone = |id: &str| members.iter().find(|(m, _)| m == id).unwrap().1.clone();
        for shard in 0..16 {
            let mut group = vec![map.owner(shard).unwrap().to_string()];
            group.extend(map.backups(shard).iter().cloned());
            assert_eq!(group.len(), 3);
            let mut zones: Vec<_> = group.iter().map(|m| zone(m)).collect();
            zones.sort();
            zones.dedup();
            assert_eq!(zones.len(), 3, "shard {shard}: {group:?}");
        }
        let leads: Vec<usize> = ["a", "b", "c", "d"]
            .iter()
            .map(|m| map.shards_of(m).count())
            .collect();
        assert_eq!(leads, [4, 4, 4, 4]);
        // c and d are the only servers of their zones: every shard has a
        // copy on each.
        assert_eq!(map.copies_of("c").count(), 16);
        assert_eq!(map.copies_of("d").count(), 16);
        assert_eq!(map.copies_of("a").count() + map.copies_of("b").count(), 16);
        // Any coordinator deals the same way; the map then stays.
        let again = next_map(
            &c,
            None,
            &members.iter().rev().cloned().collect::<Vec<_>>(),
            &[],
            secret,
        );
        assert_eq!(again.as_ref(), Some(&map));
        assert_eq!(next_map(&c, Some(&map), &members, &[], secret), None);
    }

    #[test]
    fn members_without_zones_are_zones_of_their_own_and_too_few_zones_wait() {
        let c = ClusterConfig {
            shards: 5,
            initial_members: 3,
            replicas: 3,
        };
        let map = next_map(&c, None, &live(&["a", "b", "c", "d", "e"]), &[], secret).unwrap();
        for shard in 0..5 {
            let mut group = vec![map.owner(shard).unwrap()];
            group.extend(map.backups(shard).iter().map(String::as_str));
            let mut distinct = group.clone();
            distinct.sort();
            distinct.dedup();
            assert_eq!(distinct.len(), 3, "{group:?}");
            assert_eq!(map.shards_of(group[0]).count(), 1);
        }
        // Every member holds 3 copies: 15 spread over 5.
        for m in ["a", "b", "c", "d", "e"] {
            assert_eq!(map.copies_of(m).count(), 3, "{m}: {map:?}");
        }
        let two_zones = zoned(&[("a", "x"), ("b", "x"), ("c", "y")]);
        assert_eq!(next_map(&c, None, &two_zones, &[], secret), None);
    }

    #[test]
    fn a_gone_primary_is_followed_by_its_last_live_backup_and_a_gone_backup_leaves() {
        let c = ClusterConfig {
            shards: 6,
            initial_members: 3,
            replicas: 3,
        };
        let all = live(&["a", "b", "c"]);
        let map = next_map(&c, None, &all, &[], secret).unwrap();
        let failed = next_map(&c, Some(&map), &live(&["b", "c"]), &[], secret).unwrap();
        assert_eq!(failed.epoch, map.epoch + 1);
        for shard in 0..6 {
            let (was, now) = (map.owner(shard).unwrap(), failed.owner(shard).unwrap());
            let old_backups = map.backups(shard);
            if was == "a" {
                assert_eq!(now, old_backups.last().unwrap());
                assert!(failed.backups(shard).is_empty());
                assert_eq!(failed.group_epoch(shard), failed.epoch);
            } else {
                assert_eq!(now, was);
                let kept: Vec<String> = old_backups.iter().filter(|b| *b != "a").cloned().collect();
                assert_eq!(failed.backups(shard), kept.as_slice());
                assert_eq!(failed.group_epoch(shard), 0);
            }
            assert_eq!(failed.copies_of("a").count(), 0);
        }
        failed.check_groups(3).unwrap();
        // A map of lone primaries stores no backups at all, and reads back
        // whole.
        let last = next_map(&c, Some(&failed), &live(&["c"]), &[], secret).unwrap();
        let stored: ShardMap = serde_json::from_slice(&crate::records::encode(&last)).unwrap();
        assert_eq!(stored.backups(0), last.backups(0));
        stored.check_groups(3).unwrap();
        // With none of a group's copies live, the group stays for its
        // servers' return.
        let none = next_map(&c, Some(&last), &live(&[]), &[], secret);
        assert_eq!(none, None);
        for shard in 0..6 {
            assert_eq!(last.owner(shard), Some("c"));
            assert!(last.backups(shard).is_empty());
        }
    }

    /// What the source of a replicated cluster's copy publishes once it
    /// is done (kv-server's `shard_host`): the target joins the group.
    fn copied(map: &ShardMap) -> ShardMap {
        let m = map.moving.clone().expect("a copy under way");
        let mut next = map.clone();
        next.epoch += 1;
        next.moving = None;
        next.backups.resize(next.owners.len(), Vec::new());
        next.backups[m.shard as usize].push(m.to);
        next.group_epochs.resize(next.owners.len(), 0);
        next.group_epochs[m.shard as usize] = next.epoch;
        next
    }

    #[test]
    fn copies_restore_every_group_one_at_a_time_fewest_copies_first() {
        let c = ClusterConfig {
            shards: 6,
            initial_members: 3,
            replicas: 3,
        };
        let map = next_map(&c, None, &live(&["a", "b", "c"]), &[], secret).unwrap();
        let after_a = next_map(&c, Some(&map), &live(&["b", "c"]), &[], secret).unwrap();
        // Two members left: a shard a led, now alone at b or c, gets a
        // copy at the other; one that kept two copies has nowhere to go.
        let mut now = after_a.clone();
        let mut copies = 0;
        while let Some(next) = next_map(&c, Some(&now), &live(&["b", "c"]), &[], secret) {
            let m = next.moving.clone().expect("a copy");
            assert_eq!(now.backups(m.shard).len(), 0, "fewest copies first");
            assert_ne!(now.owner(m.shard), Some(m.to.as_str()));
            // Nothing else is proposed while it runs.
            assert_eq!(
                next_map(&c, Some(&next), &live(&["b", "c"]), &[], secret),
                None
            );
            now = copied(&next);
            copies += 1;
        }
        assert_eq!(copies, 2, "{now:?}");
        for shard in 0..6 {
            assert_eq!(now.backups(shard).len(), 1);
        }
        // A member joins: every group gets its third copy there. A copy
        // held back (it failed lately) leaves the next shard to go first.
        let all = live(&["b", "c", "d"]);
        let first = next_map(&c, Some(&now), &all, &[], secret).unwrap();
        let m = first.moving.clone().unwrap();
        let held = [(m.shard, m.to.clone())];
        let members = Members {
            live: &all,
            draining: &[],
            held_back: &held,
        };
        let other = next_map_avoiding(&c, Some(&now), &members, secret).unwrap();
        assert_ne!(other.moving.as_ref().map(|o| o.shard), Some(m.shard));
        // Its source dies: it fails over (to a backup), and the copy goes.
        let source = first.owner(m.shard).unwrap();
        let rest: Vec<_> = all.iter().filter(|(id, _)| id != source).cloned().collect();
        let failed = next_map(&c, Some(&first), &rest, &[], secret).unwrap();
        assert_ne!(failed.owner(m.shard), Some(source));
        assert_eq!(failed.moving, None);
        while let Some(next) = next_map(&c, Some(&now), &all, &[], secret) {
            assert_eq!(next.moving.as_ref().map(|m| m.to.as_str()), Some("d"));
            now = copied(&next);
        }
        now.check_groups(3).unwrap();
        for shard in 0..6 {
            assert_eq!(now.backups(shard).len(), 2);
            assert_eq!(now.backups(shard).last().map(String::as_str), Some("d"));
            assert_eq!(now.owner(shard), after_a.owner(shard), "no owner changes");
        }
    }

    #[test]
    fn a_copy_goes_only_to_a_new_zone_and_ends_with_its_source_or_target() {
        let c = ClusterConfig {
            shards: 2,
            initial_members: 2,
            replicas: 2,
        };
        let zones = zoned(&[("a", "z1"), ("b", "z2"), ("c", "z1")]);
        let map = next_map(&c, None, &zones[..2], &[], secret).unwrap();
        // b dies: a's shard is short, but c shares a's zone; b's shard,
        // now led by a, likewise.
        let after_b = next_map(
            &c,
            Some(&map),
            &[zones[0].clone(), zones[2].clone()],
            &[],
            secret,
        )
        .unwrap();
        assert_eq!(
            next_map(
                &c,
                Some(&after_b),
                &[zones[0].clone(), zones[2].clone()],
                &[],
                secret
            ),
            None
        );
        // d, in a zone of its own, takes the copies; draining, it does not.
        let with_d = [
            zones[0].clone(),
            zones[2].clone(),
            ("d".to_string(), Some("z3".to_string())),
        ];
        let draining = ["d".to_string()];
        assert_eq!(
            next_map(&c, Some(&after_b), &with_d, &draining, secret),
            None
        );
        let copying = next_map(&c, Some(&after_b), &with_d, &[], secret).unwrap();
        let m = copying.moving.clone().unwrap();
        assert_eq!((m.shard, m.to.as_str()), (0, "d"));
        // Its target dies: dropped. Its source dies: failed over, and
        // dropped with it.
        let dropped = next_map(&c, Some(&copying), &with_d[..2], &[], secret).unwrap();
        assert_eq!(dropped.moving, None);
        assert_eq!(dropped.owners, copying.owners);
        let source = copying.owner(m.shard).unwrap();
        let rest: Vec<_> = with_d
            .iter()
            .filter(|(id, _)| id != source)
            .cloned()
            .collect();
        let failed = next_map(&c, Some(&copying), &rest, &[], secret).unwrap();
        assert_eq!(failed.moving, None);
    }
}
