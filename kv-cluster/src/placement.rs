//! Which member should own each shard. Pure: the coordinator feeds it what
//! etcd holds and publishes what it returns.

use crate::records::{ClusterConfig, ShardMap};

/// The map the coordinator should publish, or none when nothing needs to
/// change. `live` are the ids of the members whose records exist.
///
/// - No map yet: one is made once `initial_members` have joined, the
///   shards dealt round-robin over them (sorted, so any coordinator deals
///   the same way).
/// - A shard without an owner goes to the live member that owns fewest.
/// - A shard whose owner is not live keeps it: its region is on that
///   server, which brings it back when it restarts. (Moving shards needs
///   their contents copied: rebalancing, not placement.)
pub fn next_map(
    config: &ClusterConfig,
    map: Option<&ShardMap>,
    live: &[String],
) -> Option<ShardMap> {
    let mut live: Vec<&String> = live.iter().collect();
    live.sort();
    live.dedup();
    let Some(map) = map else {
        if live.is_empty() || live.len() < config.initial_members as usize {
            return None;
        }
        let owners = (0..config.shards as usize)
            .map(|s| Some(live[s % live.len()].clone()))
            .collect();
        return Some(ShardMap { epoch: 1, owners });
    };
    if live.is_empty() || map.owners.iter().all(Option::is_some) {
        return None;
    }
    let mut next = map.clone();
    next.epoch += 1;
    for shard in 0..next.owners.len() {
        if next.owners[shard].is_some() {
            continue;
        }
        let fewest = live
            .iter()
            .min_by_key(|m| next.shards_of(m).count())
            .map(|m| (*m).clone());
        next.owners[shard] = fewest;
    }
    Some(next)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(shards: u32, initial_members: u32) -> ClusterConfig {
        ClusterConfig {
            shards,
            initial_members,
        }
    }

    fn ids(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn the_first_map_waits_for_the_initial_members_then_deals_evenly() {
        let c = config(8, 3);
        assert_eq!(next_map(&c, None, &ids(&["b", "a"])), None);
        let map = next_map(&c, None, &ids(&["c", "b", "a"])).unwrap();
        assert_eq!(map.epoch, 1);
        let counts: Vec<usize> = ["a", "b", "c"]
            .iter()
            .map(|m| map.shards_of(m).count())
            .collect();
        assert_eq!(counts, [3, 3, 2]);
        // Any coordinator deals the same way.
        assert_eq!(next_map(&c, None, &ids(&["a", "c", "b"])), Some(map));
    }

    #[test]
    fn owned_shards_stay_and_unowned_ones_go_to_the_least_loaded() {
        let c = config(4, 1);
        let map = ShardMap {
            epoch: 7,
            owners: vec![Some("gone".into()), None, Some("a".into()), None],
        };
        let next = next_map(&c, Some(&map), &ids(&["a", "b"])).unwrap();
        assert_eq!(next.epoch, 8);
        assert_eq!(next.owner(0), Some("gone"));
        assert_eq!(next.owner(1), Some("b"));
        assert_eq!(next.owner(2), Some("a"));
        assert!(next.owner(3).is_some());
        assert_eq!(next_map(&c, Some(&next), &ids(&["a", "b"])), None);
    }
}
