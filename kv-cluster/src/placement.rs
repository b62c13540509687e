//! Which member should own each shard. Pure: the coordinator feeds it what
//! etcd holds and publishes what it returns.

use crate::records::{ClusterConfig, ShardMap, ShardMove};

/// The map the coordinator should publish, or none when nothing needs to
/// change. `live` are the ids of the members whose records exist,
/// `draining` those of them that are leaving; `new_secret` makes the
/// secret of a move.
///
/// - No map yet: one is made once `initial_members` have joined, the
///   shards dealt round-robin over them (sorted, so any coordinator deals
///   the same way).
/// - A move under way is waited for, or dropped if its source is no
///   longer live or its target no longer takes shards (it cannot finish;
///   the source keeps the shard).
/// - A shard without an owner goes to the member that owns fewest.
/// - A shard whose owner is not live keeps it: its region is on that
///   server, which brings it back when it restarts.
/// - A draining member's shards move away first, then, while two members'
///   shard counts differ by more than one, a shard of the one with most
///   moves to the one with fewest: one move at a time. Ties go to the
///   lowest id, so that any coordinator picks alike.
pub fn next_map(
    config: &ClusterConfig,
    map: Option<&ShardMap>,
    live: &[String],
    draining: &[String],
    new_secret: impl FnOnce() -> String,
) -> Option<ShardMap> {
    let mut takers: Vec<&String> = live.iter().filter(|m| !draining.contains(m)).collect();
    takers.sort();
    takers.dedup();
    let Some(map) = map else {
        if takers.is_empty() || takers.len() < config.initial_members as usize {
            return None;
        }
        let owners = (0..config.shards as usize)
            .map(|s| Some(takers[s % takers.len()].clone()))
            .collect();
        return Some(ShardMap {
            epoch: 1,
            owners,
            moving: None,
        });
    };
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
        }
    }

    fn secret() -> String {
        "s".into()
    }

    fn ids(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn the_first_map_waits_for_the_initial_members_then_deals_evenly() {
        let c = config(8, 3);
        assert_eq!(next_map(&c, None, &ids(&["b", "a"]), &[], secret), None);
        let map = next_map(&c, None, &ids(&["c", "b", "a"]), &[], secret).unwrap();
        assert_eq!(map.epoch, 1);
        let counts: Vec<usize> = ["a", "b", "c"]
            .iter()
            .map(|m| map.shards_of(m).count())
            .collect();
        assert_eq!(counts, [3, 3, 2]);
        // Any coordinator deals the same way.
        assert_eq!(
            next_map(&c, None, &ids(&["a", "c", "b"]), &[], secret),
            Some(map)
        );
    }

    #[test]
    fn owned_shards_stay_and_unowned_ones_go_to_the_least_loaded() {
        let c = config(4, 1);
        let map = ShardMap {
            epoch: 7,
            owners: vec![Some("gone".into()), None, Some("a".into()), None],
            moving: None,
        };
        let next = next_map(&c, Some(&map), &ids(&["a", "b"]), &[], secret).unwrap();
        assert_eq!(next.epoch, 8);
        assert_eq!(next.owner(0), Some("gone"));
        assert_eq!(next.owner(1), Some("b"));
        assert_eq!(next.owner(2), Some("a"));
        assert!(next.owner(3).is_some());
        assert_eq!(
            next_map(&c, Some(&next), &ids(&["a", "b"]), &[], secret),
            None
        );
    }

    #[test]
    fn a_member_that_joins_gets_shards_one_move_at_a_time_until_balanced() {
        let c = config(6, 2);
        let mut map = next_map(&c, None, &ids(&["a", "b"]), &[], secret).unwrap();
        let members = ids(&["a", "b", "c"]);
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
            moving: Some(ShardMove {
                shard: 1,
                to: "b".into(),
                secret: "s".into(),
            }),
        };
        assert_eq!(
            next_map(&c, Some(&map), &ids(&["a", "b"]), &[], secret),
            None
        );
        let dropped = next_map(&c, Some(&map), &ids(&["a"]), &[], secret).unwrap();
        assert_eq!(dropped.moving, None);
        assert_eq!(dropped.owners, map.owners);
    }

    #[test]
    fn a_draining_member_hands_every_shard_over() {
        let c = config(4, 2);
        let mut map = next_map(&c, None, &ids(&["a", "b"]), &[], secret).unwrap();
        let (live, draining) = (ids(&["a", "b"]), ids(&["b"]));
        while let Some(next) = next_map(&c, Some(&map), &live, &draining, secret) {
            let m = next.moving.clone().expect("a move");
            assert_eq!((map.owner(m.shard), m.to.as_str()), (Some("b"), "a"));
            map = next;
            map.owners[m.shard as usize] = Some(m.to);
            map.moving = None;
        }
        assert_eq!(map.shards_of("a").count(), 4);
    }
}
