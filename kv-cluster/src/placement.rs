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
///   then a shard short of copies gets one more, and then a draining
///   member's copies are replaced one by one (see [`copy_where_needed`]).
///   No shard changes owners by a plain move: a move copies one region and
///   its backups would not follow; a draining primary hands over to a
///   fresh copy of it instead.
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
            .or_else(|| copy_where_needed(config.replicas, map, members, new_secret));
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
        replaces: None,
        leads: false,
    });
    Some(next)
}

/// The map after the copies of members not in `live` are given up (their
/// leases expired): a gone backup leaves its group; a shard whose primary
/// is gone is led by its last live backup that is level with the old
/// primary, under a new group epoch (the new map's epoch), the other live
/// backups kept beside it as *unlevelled*. A shard with no such backup
/// keeps its group: its copies' servers hold its only state (or the only
/// one readers may have seen), and serve it again when they return. None
/// when nothing changes.
///
/// Why the backup holds every acknowledged write: a write commits at the
/// primary only after it set every backup, and a backup's value is the
/// last committed write or a set that landed after it from a writer never
/// answered (see kv-client's `replicated`), which may take effect now.
/// Why the others are unlevelled: two such writers' sets may reach two
/// backups in opposite orders, so a backup kept could hold an older value
/// than one readers see at the new primary, which a second failover would
/// show them as a value going back. It holds every acknowledged write all
/// the same, and every write from now on sets it; the new primary's
/// member levels it (kv-server's `level`: each key that may differ is
/// written again from the primary's value), and only then may a failover
/// promote it.
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
        let unlevelled = map.unlevelled(shard as u32);
        let Some(at) = kept.iter().rposition(|b| !unlevelled.contains(b)) else {
            continue;
        };
        next.owners[shard] = Some(kept.remove(at));
        next.unlevelled.resize(map.owners.len(), Vec::new());
        next.unlevelled[shard].clone_from(&kept);
        next.backups[shard] = kept;
        next.group_epochs.resize(map.owners.len(), 0);
        next.group_epochs[shard] = next.epoch;
        changed = true;
    }
    next.forget_unlevelled_outside_groups();
    // A copy under way ends with its source (its target's end is
    // `copy_where_needed`' to see).
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

/// The map after one more copy of a replicated shard is started (a
/// `moving` of a replicated cluster adds its target to the group; see
/// kv-server's `shard_host`), or the copy under way dropped when it can no
/// longer finish; none when nothing changes. One copy at a time, from the
/// shard's live primary, to the live member that takes shards, holds none
/// of the group and shares no zone with the copies that stay, and holds
/// fewest copies (ties to the lowest id):
///
/// 1. to the shard with fewest copies (then the lowest), if one has fewer
///    than `replicas`;
/// 2. else to replace a draining member's copy (the lowest shard of the
///    first such member), which leaves the group as the new copy joins: a
///    backup simply, the primary by handing over to the new copy, made
///    from its frozen index (see `ShardMove::replaces`). So a drain never
///    takes a shard below `replicas` copies, nor fails anything over;
/// 3. else, the same way, to replace a copy of the member that holds most
///    with one at a member that holds fewer, until the copies held differ
///    by one at most (and the shards led too, where a copy can move).
fn copy_where_needed(
    replicas: u32,
    map: &ShardMap,
    members: &Members<'_>,
    new_secret: impl FnOnce() -> String,
) -> Option<ShardMap> {
    let copies = Copies {
        replicas: replicas as usize,
        map,
        members,
    };
    if let Some(m) = &map.moving {
        let source_live = map.owner(m.shard).is_some_and(|o| copies.is_live(o));
        if source_live && copies.takes(&m.to) {
            return None;
        }
        let mut next = map.clone();
        next.epoch += 1;
        next.moving = None;
        return Some(next);
    }
    let (shard, to, replaces) = copies
        .restore()
        .or_else(|| copies.drain())
        .or_else(|| copies.balance())?;
    let leads = replaces.is_none() && copies.lead_goes_with(shard, to);
    let mut next = map.clone();
    next.epoch += 1;
    next.moving = Some(ShardMove {
        shard,
        to: to.to_string(),
        secret: new_secret(),
        replaces: replaces.map(str::to_string),
        leads,
    });
    Some(next)
}

/// Whether each copy `id` holds has somewhere to go were `id` to drain:
/// a live member that does not drain, outside the shard's group and the
/// zones of its other copies. A drain that cannot place one would wait
/// for nothing (kv-server leaves at once then).
pub fn copies_can_move(map: &ShardMap, members: &Members<'_>, id: &str) -> bool {
    // A target does not depend on the replica count.
    let copies = Copies {
        replicas: 0,
        map,
        members,
    };
    map.copies_of(id)
        .all(|s| copies.target(s, Some(id)).is_some())
}

/// The copies of a replicated cluster's map, as `copy_where_needed` sees
/// them: each step proposes (shard, target, the member whose copy the new
/// one replaces).
struct Copies<'a> {
    replicas: usize,
    map: &'a ShardMap,
    members: &'a Members<'a>,
}

type Proposal<'a> = (u32, &'a str, Option<&'a str>);

impl<'a> Copies<'a> {
    fn is_live(&self, id: &str) -> bool {
        self.members.live.iter().any(|(l, _)| l == id)
    }

    /// Live and not draining.
    fn takes(&self, id: &str) -> bool {
        self.is_live(id) && !self.members.draining.iter().any(|d| d == id)
    }

    /// A member's zone, or the member as a zone of its own.
    fn zone_of(&self, id: &str) -> String {
        let zone = self.members.live.iter().find(|(l, _)| l == id);
        match zone.and_then(|(_, z)| z.as_ref()) {
            Some(z) => format!("zone:{z}"),
            None => format!("member:{id}"),
        }
    }

    fn group(&self, shard: u32) -> impl Iterator<Item = &'a str> {
        let backups = self.map.backups(shard).iter().map(String::as_str);
        self.map.owner(shard).into_iter().chain(backups)
    }

    /// Whether `shard`'s primary lives to send a copy.
    fn sourced(&self, shard: u32) -> bool {
        self.map.owner(shard).is_some_and(|o| self.is_live(o))
    }

    fn copies(&self, id: &str) -> usize {
        self.map.copies_of(id).count()
    }

    fn leads(&self, id: &str) -> usize {
        self.map.shards_of(id).count()
    }

    /// The member a copy of `shard` would go to, if one can take it, the
    /// copy on `replaced` leaving as it joins.
    fn target(&self, shard: u32, replaced: Option<&str>) -> Option<&'a str> {
        let zones: Vec<String> = self
            .group(shard)
            .filter(|g| Some(*g) != replaced)
            .map(|g| self.zone_of(g))
            .collect();
        let held_back = |id: &str| {
            let mut held = self.members.held_back.iter();
            held.any(|(s, to)| *s == shard && to == id)
        };
        self.members
            .live
            .iter()
            .map(|(id, _)| id.as_str())
            .filter(|id| self.takes(id) && !self.group(shard).any(|g| g == *id))
            .filter(|id| !held_back(id) && !zones.contains(&self.zone_of(id)))
            .min_by_key(|id| (self.copies(id), *id))
    }

    /// Whether a copy of `shard` restoring its replica count at `to` takes
    /// the lead: when the shard's primary leads two more than `to`. A
    /// failover gives a dead member's leads to the others, and the member
    /// that comes back (or a new one) gets its copies back this way; else,
    /// with as many members as copies (every member holds every shard),
    /// no later move could spread the leads again.
    fn lead_goes_with(&self, shard: u32, to: &str) -> bool {
        self.map
            .owner(shard)
            .is_some_and(|owner| self.leads(owner) > self.leads(to) + 1)
    }

    /// Step 1: the shard with fewest copies, if short.
    fn restore(&self) -> Option<Proposal<'a>> {
        let mut short: Vec<(usize, u32)> = (0..self.map.owners.len() as u32)
            .filter(|&s| self.sourced(s))
            .map(|s| (self.group(s).count(), s))
            .filter(|&(copies, _)| copies < self.replicas)
            .collect();
        short.sort_unstable();
        short
            .into_iter()
            .find_map(|(_, s)| Some((s, self.target(s, None)?, None)))
    }

    /// Step 2: a draining member's copy.
    fn drain(&self) -> Option<Proposal<'a>> {
        let mut leaving: Vec<&'a str> = self.members.draining.iter().map(String::as_str).collect();
        leaving.sort_unstable();
        leaving.into_iter().find_map(|d| {
            self.map
                .copies_of(d)
                .filter(|&s| self.sourced(s))
                .find_map(|s| Some((s, self.target(s, Some(d))?, Some(d))))
        })
    }

    /// Step 3: a copy of a member that holds more than another moves
    /// there: one that holds two more, or one more and leads two more (the
    /// copy of a shard it leads, handed over). Each such move lowers the
    /// sum of the squares of the copies held, or keeps it and lowers that
    /// of the shards led: balancing ends.
    fn balance(&self) -> Option<Proposal<'a>> {
        let live = self.members.live.iter().map(|(id, _)| id.as_str());
        let mut loaded: Vec<&'a str> = live.filter(|id| self.takes(id)).collect();
        loaded
            .sort_unstable_by_key(|id| (std::cmp::Reverse((self.copies(id), self.leads(id))), *id));
        loaded.into_iter().find_map(|from| {
            // The shards it leads first: a new member takes some lead too.
            // A shard short of copies is not moved about: it waits for
            // a copy (a place in a zone it lacks).
            let mut held: Vec<u32> = self
                .map
                .copies_of(from)
                .filter(|&s| self.sourced(s) && self.group(s).count() >= self.replicas)
                .collect();
            held.sort_by_key(|&s| self.map.owner(s) != Some(from));
            held.into_iter().find_map(|s| {
                let to = self.target(s, Some(from))?;
                let led = self.map.owner(s) == Some(from);
                let (copies, leads) = (
                    [from, to].map(|id| self.copies(id)),
                    [from, to].map(|id| self.leads(id)),
                );
                // A lead goes only to a member that leads fewer.
                let worth = (copies[0] > copies[1] + 1 && (!led || leads[0] > leads[1]))
                    || (led && copies[0] > copies[1] && leads[0] > leads[1] + 1);
                worth.then_some((s, to, Some(from)))
            })
        })
    }
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
        unlevelled: Vec::new(),
        lead_epochs: Vec::new(),
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
            unlevelled: Vec::new(),
            lead_epochs: Vec::new(),
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
            unlevelled: Vec::new(),
            lead_epochs: Vec::new(),
            moving: Some(ShardMove {
                shard: 1,
                to: "b".into(),
                secret: "s".into(),
                replaces: None,
                leads: false,
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
    fn a_gone_primary_is_followed_by_its_last_level_backup_and_the_others_kept_unlevelled() {
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
                assert_eq!(failed.backups(shard), &old_backups[..1]);
                assert_eq!(failed.unlevelled(shard), &old_backups[..1]);
                assert_eq!(failed.group_epoch(shard), failed.epoch);
            } else {
                assert_eq!(now, was);
                let kept: Vec<String> = old_backups.iter().filter(|b| *b != "a").cloned().collect();
                assert_eq!(failed.backups(shard), kept.as_slice());
                assert!(failed.unlevelled(shard).is_empty());
                assert_eq!(failed.group_epoch(shard), 0);
            }
            assert_eq!(failed.copies_of("a").count(), 0);
        }
        failed.check_groups(3).unwrap();
        // Unlevelled, a backup is never promoted: a shard with no other
        // copy keeps its group for its primary's return.
        let gone_b = next_map(&c, Some(&failed), &live(&["c"]), &[], secret).unwrap();
        for shard in 0..6 {
            let waits = failed.owner(shard) == Some("b") && failed.unlevelled(shard) == ["c"];
            if waits {
                assert_eq!(gone_b.owner(shard), Some("b"));
                assert_eq!(gone_b.backups(shard), ["c"]);
            } else {
                assert_eq!(gone_b.owner(shard), Some("c"), "shard {shard}");
                assert!(gone_b.backups(shard).is_empty());
            }
            assert!(gone_b.unlevelled(shard).is_empty() || waits);
        }
        // Levelled (by the primary's member, in the same group), it is.
        let waiting = (0..6).find(|&s| !failed.unlevelled(s).is_empty()).unwrap();
        let (epoch, members) = (failed.group_epoch(waiting), failed.unlevelled(waiting));
        let primary = failed.owner(waiting).unwrap();
        assert_eq!(
            failed.levelled(waiting, primary, epoch + 1, members),
            None,
            "a newer group"
        );
        assert_eq!(
            failed.levelled(waiting, &members[0], epoch, members),
            None,
            "another primary"
        );
        assert_eq!(failed.levelled(waiting, primary, epoch, &[]), None);
        let stranger = ids(&["x"]);
        assert_eq!(failed.levelled(waiting, primary, epoch, &stranger), None);
        let level = levelled(&failed);
        assert!(level.unlevelled.is_empty());
        let last = next_map(&c, Some(&level), &live(&["c"]), &[], secret).unwrap();
        for shard in 0..6 {
            assert_eq!(last.owner(shard), Some("c"));
            assert!(last.backups(shard).is_empty());
        }
        // A map of lone primaries stores no backups at all, and reads back
        // whole.
        let stored: ShardMap = serde_json::from_slice(&crate::records::encode(&last)).unwrap();
        assert_eq!(stored.backups(0), last.backups(0));
        assert_eq!(stored.owners, last.owners);
        stored.check_groups(3).unwrap();
        // With none of a group's copies live, the group stays for its
        // servers' return.
        let none = next_map(&c, Some(&last), &live(&[]), &[], secret);
        assert_eq!(none, None);
    }

    /// What the source of a replicated cluster's copy publishes once it
    /// is done (kv-server's `shard_host`): the target joins the group, or
    /// takes over from the primary it replaces, or takes the lead.
    fn copied(map: &ShardMap) -> ShardMap {
        let m = map.moving.clone().expect("a copy under way");
        let copy = !m.takes_lead(map.owner(m.shard));
        map.ended_move(&m, true, copy)
    }

    /// `map` once the primaries' members levelled every backup.
    fn levelled(map: &ShardMap) -> ShardMap {
        let mut level = map.clone();
        for shard in 0..map.owners.len() as u32 {
            let waiting = level.unlevelled(shard).to_vec();
            if !waiting.is_empty() {
                let (epoch, primary) = (level.group_epoch(shard), level.owner(shard).unwrap());
                level = level.levelled(shard, primary, epoch, &waiting).unwrap();
            }
        }
        level
    }

    #[test]
    fn copies_restore_every_group_one_at_a_time_fewest_copies_first() {
        let c = ClusterConfig {
            shards: 6,
            initial_members: 3,
            replicas: 3,
        };
        let map = next_map(&c, None, &live(&["a", "b", "c"]), &[], secret).unwrap();
        // Two members left, each shard's two copies on them: nowhere to
        // copy to. A shard a led keeps its other backup, unlevelled.
        let after_a = next_map(&c, Some(&map), &live(&["b", "c"]), &[], secret).unwrap();
        assert_eq!(
            next_map(&c, Some(&after_a), &live(&["b", "c"]), &[], secret),
            None
        );
        let mut now = levelled(&after_a);
        for shard in 0..6 {
            assert_eq!(now.backups(shard).len(), 1);
        }
        // A shard left alone gets a copy at the other, fewest copies first,
        // nothing else proposed while it runs.
        let mut lone = now.clone();
        lone.backups[1].clear();
        lone.backups[4].clear();
        let mut copies = 0;
        while let Some(next) = next_map(&c, Some(&lone), &live(&["b", "c"]), &[], secret) {
            let m = next.moving.clone().expect("a copy");
            assert_eq!(lone.backups(m.shard).len(), 0, "fewest copies first");
            assert_ne!(lone.owner(m.shard), Some(m.to.as_str()));
            assert_eq!(
                next_map(&c, Some(&next), &live(&["b", "c"]), &[], secret),
                None
            );
            lone = copied(&next);
            copies += 1;
        }
        assert_eq!(copies, 2, "{lone:?}");
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
        // d holds every shard, and took the lead of those b and c led
        // beyond their share (a's, which its failover gave them) with it:
        // the old owner stays, the last backup.
        for shard in 0..6 {
            assert_eq!(now.backups(shard).len(), 2);
            let kept = now.owner(shard) == after_a.owner(shard);
            let last = now.backups(shard).last().map(String::as_str);
            match kept {
                true => assert_eq!(last, Some("d")),
                false => {
                    assert_eq!(now.owner(shard), Some("d"));
                    assert_eq!(last, after_a.owner(shard));
                }
            }
        }
        for m in ["b", "c", "d"] {
            assert_eq!(now.shards_of(m).count(), 2, "{m} leads its share: {now:?}");
        }
    }

    /// As many members as copies: each holds every shard, so no copy can
    /// carry a lead elsewhere. The leads a failover gave away come back to
    /// the member that returns, with its copies.
    #[test]
    fn a_member_back_after_a_failover_takes_its_share_of_lead_with_its_copies() {
        let c = ClusterConfig {
            shards: 4,
            initial_members: 3,
            replicas: 3,
        };
        let all = live(&["a", "b", "c"]);
        let mut now = next_map(&c, None, &all, &[], secret).unwrap();
        // One member dies, then another once the first is back.
        for gone in ["a", "b"] {
            let rest: Vec<_> = all.iter().filter(|(id, _)| id != gone).cloned().collect();
            now = levelled(&next_map(&c, Some(&now), &rest, &[], secret).unwrap());
            assert_eq!(now.shards_of(gone).count(), 0);
            let mut moves = 0;
            while let Some(next) = next_map(&c, Some(&now), &all, &[], secret) {
                let m = next.moving.as_ref().expect("a copy");
                assert_eq!((m.to.as_str(), m.replaces.as_deref()), (gone, None));
                now = levelled(&copied(&next));
                moves += 1;
            }
            assert_eq!(moves, 4, "every shard's copy restored, one at a time");
            now.check_groups(3).unwrap();
            for m in ["a", "b", "c"] {
                let leads = now.shards_of(m).count();
                assert!((1..=2).contains(&leads), "after {gone}: {m}: {now:?}");
                assert_eq!(now.copies_of(m).count(), 4);
            }
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

    #[test]
    fn a_draining_member_of_a_replicated_cluster_has_each_copy_replaced_one_at_a_time() {
        let c = ClusterConfig {
            shards: 6,
            initial_members: 4,
            replicas: 3,
        };
        let zones = zoned(&[("a", "z1"), ("b", "z2"), ("c", "z3"), ("d", "z1")]);
        let map = next_map(&c, None, &zones, &[], secret).unwrap();
        let held: Vec<u32> = map.copies_of("a").collect();
        let led: Vec<u32> = map.shards_of("a").collect();
        assert!(!led.is_empty() && held.len() > led.len(), "{map:?}");
        let draining = ["a".to_string()];
        let can_move = |map: &ShardMap, id: &str| {
            let members = Members {
                live: &zones,
                draining: &[],
                held_back: &[],
            };
            copies_can_move(map, &members, id)
        };
        // a and d take each other's place; nobody shares b's zone or c's.
        assert!(can_move(&map, "a") && can_move(&map, "d"));
        assert!(!can_move(&map, "b") && !can_move(&map, "c"));
        let mut now = map.clone();
        let mut replaced = Vec::new();
        while let Some(next) = next_map(&c, Some(&now), &zones, &draining, secret) {
            let m = next.moving.clone().expect("a copy");
            // Only d can take a's place: b and c are in every group, and d
            // shares only a's zone, which leaves with it.
            assert_eq!((m.to.as_str(), m.replaces.as_deref()), ("d", Some("a")));
            assert_eq!(
                next_map(&c, Some(&next), &zones, &draining, secret),
                None,
                "one at a time"
            );
            let hands_over = m.hands_over(next.owner(m.shard));
            assert_eq!(hands_over, led.contains(&m.shard));
            now = copied(&next);
            now.check_groups(3).unwrap();
            assert_eq!(now.group_epoch(m.shard), now.epoch);
            let group = |map: &ShardMap, s: u32| {
                let mut g: Vec<String> = map.owner(s).into_iter().map(str::to_string).collect();
                g.extend(map.backups(s).iter().cloned());
                g
            };
            assert_eq!(group(&now, m.shard).len(), 3, "never fewer copies");
            assert!(!group(&now, m.shard).contains(&"a".to_string()));
            if hands_over {
                // The new copy leads the same backups.
                assert_eq!(now.owner(m.shard), Some("d"));
                assert_eq!(now.backups(m.shard), map.backups(m.shard));
            } else {
                assert_eq!(now.owner(m.shard), map.owner(m.shard));
                assert_eq!(now.backups(m.shard).last().map(String::as_str), Some("d"));
            }
            replaced.push(m.shard);
        }
        replaced.sort_unstable();
        assert_eq!(replaced, held, "each of a's copies replaced once");
        assert_eq!(now.copies_of("a").count(), 0);
        // With no member outside a group to take a copy, nothing moves.
        let three = &zones[..3];
        let c3 = ClusterConfig {
            initial_members: 3,
            ..c
        };
        let of_three = next_map(&c3, None, three, &[], secret).unwrap();
        assert_eq!(
            next_map(&c, Some(&of_three), three, &draining, secret),
            None
        );
        // A shard short of copies is restored before a drain goes on.
        let after_b = next_map(
            &c,
            Some(&map),
            &[zones[0].clone(), zones[2].clone(), zones[3].clone()],
            &[],
            secret,
        )
        .unwrap();
        let short: Vec<u32> = (0..6).filter(|&s| after_b.backups(s).len() < 2).collect();
        let first = next_map(&c, Some(&after_b), &zones, &draining, secret).unwrap();
        let m = first.moving.clone().unwrap();
        assert!(short.contains(&m.shard) && m.replaces.is_none(), "{m:?}");
    }

    /// Runs `next_map` with `members` until it proposes nothing, each copy
    /// ended as its source would end it: the moves made, checked one at a
    /// time, none taking a group below `replicas` copies.
    fn settle(
        c: &ClusterConfig,
        map: &mut ShardMap,
        members: &[(String, Option<String>)],
    ) -> usize {
        let mut moves = 0;
        while let Some(next) = next_map(c, Some(map), members, &[], secret) {
            let m = next.moving.clone().expect("a copy");
            assert!(m.replaces.is_some(), "{m:?}");
            assert_eq!(next_map(c, Some(&next), members, &[], secret), None);
            *map = copied(&next);
            map.check_groups(c.replicas).unwrap();
            for shard in 0..c.shards {
                assert_eq!(1 + map.backups(shard).len(), c.replicas as usize);
            }
            moves += 1;
            assert!(moves < 100, "balancing does not end: {map:?}");
        }
        moves
    }

    #[test]
    fn members_that_join_a_replicated_cluster_take_their_share_of_copies_and_of_lead() {
        let c = ClusterConfig {
            shards: 6,
            initial_members: 3,
            replicas: 3,
        };
        let mut map = next_map(&c, None, &live(&["a", "b", "c"]), &[], secret).unwrap();
        let all = live(&["a", "b", "c", "d"]);
        let moves = settle(&c, &mut map, &all);
        let counts = |map: &ShardMap, m: &str| (map.copies_of(m).count(), map.shards_of(m).count());
        // 18 copies over four: 5, 5, 4, 4; d leads one at least.
        assert_eq!(moves, 4, "{map:?}");
        for m in ["a", "b", "c", "d"] {
            let (copies, leads) = counts(&map, m);
            assert!(
                (4..=5).contains(&copies) && (1..=2).contains(&leads),
                "{m}: {map:?}"
            );
        }
        // Two clusters of two copies grow from two members to four.
        let c = ClusterConfig {
            shards: 8,
            initial_members: 2,
            replicas: 2,
        };
        let mut map = next_map(&c, None, &live(&["a", "b"]), &[], secret).unwrap();
        settle(&c, &mut map, &live(&["a", "b", "c", "d"]));
        for m in ["a", "b", "c", "d"] {
            assert_eq!(counts(&map, m), (4, 2), "{m}: {map:?}");
        }
        // Zones bound it: a member of a zone every group has takes nothing.
        let c = ClusterConfig {
            shards: 4,
            initial_members: 2,
            replicas: 2,
        };
        let zones = zoned(&[("a", "z1"), ("b", "z2")]);
        let mut map = next_map(&c, None, &zones, &[], secret).unwrap();
        let with_c = zoned(&[("a", "z1"), ("b", "z2"), ("c", "z1")]);
        settle(&c, &mut map, &with_c);
        // c replaces a's copies only: a zone-mate's.
        assert_eq!(map.copies_of("b").count(), 4);
        assert_eq!(map.copies_of("a").count() + map.copies_of("c").count(), 4);
        assert!(map.copies_of("c").count() >= 1);
    }
}
