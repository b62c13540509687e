//! A cluster's map as its members hand it out, for clients built without
//! etcd: a member's view of etcd cut into pages that each fit one control
//! message ([`kv_common::protocol::MAX_MESSAGE`]), and put back together by
//! the client, which keeps the newest view any member gave it.

use kv_common::protocol::{self, MapPage, MemberAddress, NO_OWNER};

use crate::records::{ClusterConfig, ClusterState, MemberRecord, ShardMap, ShardMove};

/// Owners a page holds at most (each a varint of at most 5 bytes).
const PAGE_SHARDS: usize = 4096;
/// Times a map that changed while its pages were read is read again.
const REREADS: usize = 3;

/// The page of `state` (cluster `cluster`) from shard `first` on: as many
/// owners as fit one message.
///
/// # Errors
///
/// When `first` is past the last shard, or the members alone overflow a
/// message.
pub fn page(cluster: &str, state: &ClusterState, first: u32) -> Result<MapPage, String> {
    let shards = state.config.shards;
    if first > shards || (first == shards && shards > 0 && state.map.is_some()) {
        return Err(format!("shard {first}: the cluster has {shards}"));
    }
    let map = state.shard_map();
    let mut names: Vec<String> = Vec::new();
    let mut name_of = |id: &str| -> u32 {
        let at = names.iter().position(|n| n == id).unwrap_or_else(|| {
            names.push(id.to_string());
            names.len() - 1
        });
        at as u32
    };
    let owners: Vec<u32> = map
        .map(|m| {
            m.owners
                .iter()
                .map(|o| o.as_deref().map_or(NO_OWNER, &mut name_of))
                .collect()
        })
        .unwrap_or_default();
    let backups: Vec<Vec<u32>> = map
        .filter(|m| !m.backups.is_empty())
        .map(|m| {
            (0..shards)
                .map(|s| m.backups(s).iter().map(|b| name_of(b)).collect())
                .collect()
        })
        .unwrap_or_default();
    let group_epochs: Vec<u64> = map
        .filter(|m| m.group_epochs.iter().any(|&e| e != 0))
        .map(|m| (0..shards).map(|s| m.group_epoch(s)).collect())
        .unwrap_or_default();
    let moving = map
        .and_then(|m| m.moving.as_ref())
        .map(|mv| (mv.shard, name_of(&mv.to)));
    let members = state
        .members
        .iter()
        .map(|m| MemberAddress {
            id: m.id.clone(),
            listen: m.listen.clone(),
            incarnation: m.incarnation,
            draining: m.draining,
        })
        .collect();
    let mut page = MapPage {
        cluster: cluster.to_string(),
        shards,
        initial_members: state.config.initial_members,
        revision: state.revision,
        epoch: map.map(|m| m.epoch),
        members,
        names,
        first,
        owners: Vec::new(),
        moving,
        replicas: state.config.replicas,
        backups: Vec::new(),
        group_epochs: Vec::new(),
    };
    let rest = owners.get(first as usize..).unwrap_or_default();
    let rest_backups = backups.get(first as usize..).unwrap_or_default();
    let rest_epochs = group_epochs.get(first as usize..).unwrap_or_default();
    let mut take = rest.len().min(PAGE_SHARDS);
    loop {
        page.owners = rest[..take].to_vec();
        page.backups = rest_backups[..take.min(rest_backups.len())].to_vec();
        page.group_epochs = rest_epochs[..take.min(rest_epochs.len())].to_vec();
        match protocol::encode(&protocol::Response::ClusterMap(page.clone())) {
            Ok(_) => return Ok(page),
            Err(_) if take > 1 => take /= 2,
            Err(e) => return Err(format!("the cluster's map does not fit a message: {e}")),
        }
    }
}

/// A cluster as one member saw it: its name and state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemberView {
    pub cluster: String,
    pub state: ClusterState,
}

/// Reads a whole map with `fetch(first)` (one page each call). A map
/// whose revision changed between pages is read again from its start.
///
/// # Errors
///
/// `fetch`'s, or a description of a page that makes no sense.
pub fn assemble(
    mut fetch: impl FnMut(u32) -> Result<MapPage, String>,
) -> Result<MemberView, String> {
    let mut changed = 0;
    'read: loop {
        let head = fetch(0)?;
        check(&head, 0)?;
        let mut owners = head.owners.clone();
        let mut backups = head.backups.clone();
        let mut group_epochs = head.group_epochs.clone();
        while head.epoch.is_some() && owners.len() < head.shards as usize {
            let next = fetch(owners.len() as u32)?;
            if next.revision != head.revision {
                changed += 1;
                if changed > REREADS {
                    return Err("the map changed while it was read, again and again".into());
                }
                continue 'read;
            }
            check(&next, owners.len() as u32)?;
            let same = MapPage {
                first: head.first,
                owners: head.owners.clone(),
                backups: head.backups.clone(),
                group_epochs: head.group_epochs.clone(),
                ..next.clone()
            };
            if same != head || next.owners.is_empty() {
                return Err("a member sent pages of one revision that disagree".into());
            }
            owners.extend_from_slice(&next.owners);
            backups.extend_from_slice(&next.backups);
            group_epochs.extend_from_slice(&next.group_epochs);
        }
        if !group_epochs.is_empty() && group_epochs.len() != owners.len() {
            return Err("a member sent group epochs for only some shards".into());
        }
        let view = view(head, owners, backups, group_epochs);
        if let Some(map) = view.state.shard_map() {
            map.check_groups(view.state.config.replicas)
                .map_err(|e| format!("a member sent a map whose copies make no sense: {e}"))?;
        }
        return Ok(view);
    }
}

/// Whether `page` can be the page from `first` on.
fn check(page: &MapPage, first: u32) -> Result<(), String> {
    let bad = |why: &str| Err(format!("a member sent a damaged map page: {why}"));
    if page.first != first {
        return bad("it starts at the wrong shard");
    }
    if page.shards == 0 || page.shards > kv_common::layout::MAX_SHARDS {
        return bad("its shard count");
    }
    let end = first as usize + page.owners.len();
    if end > page.shards as usize {
        return bad("more owners than shards");
    }
    if page.epoch.is_none() && !page.owners.is_empty() {
        return bad("owners without a map");
    }
    if page.epoch.is_some() && page.owners.is_empty() && end < page.shards as usize {
        return bad("an empty page before the last shard");
    }
    let names = page.names.len() as u32;
    if page.owners.iter().any(|&o| o != NO_OWNER && o >= names) {
        return bad("an owner it does not name");
    }
    if page
        .moving
        .is_some_and(|(shard, to)| shard >= page.shards || to >= names)
    {
        return bad("a move it does not name");
    }
    if page.replicas == 0 || page.replicas > crate::records::MAX_REPLICAS {
        return bad("its replica count");
    }
    let group = page.replicas as usize - 1;
    if !page.backups.is_empty()
        && (page.backups.len() != page.owners.len()
            || page
                .backups
                .iter()
                .any(|b| b.len() > group || b.iter().any(|&m| m >= names)))
    {
        return bad("backups it does not name, or too many");
    }
    if !page.group_epochs.is_empty() && page.group_epochs.len() != page.owners.len() {
        return bad("group epochs of the wrong count");
    }
    Ok(())
}

fn view(
    head: MapPage,
    owners: Vec<u32>,
    backups: Vec<Vec<u32>>,
    group_epochs: Vec<u64>,
) -> MemberView {
    let name = |at: u32| head.names.get(at as usize).cloned();
    let map = head.epoch.map(|epoch| ShardMap {
        epoch,
        owners: owners.iter().map(|&o| name(o)).collect(),
        backups: backups
            .iter()
            .map(|b| b.iter().filter_map(|&m| name(m)).collect())
            .collect(),
        group_epochs,
        // A client writes every backup alike: which are level is the
        // members' concern.
        unlevelled: Vec::new(),
        // Not on the page: such a client does not write again a write cut
        // before its commit (kv-client's `cluster`).
        lead_epochs: Vec::new(),
        moving: head.moving.and_then(|(shard, to)| {
            Some(ShardMove {
                shard,
                to: name(to)?,
                // Only the members know it.
                secret: String::new(),
                replaces: None,
                leads: false,
            })
        }),
    });
    let members = head
        .members
        .iter()
        .map(|m| MemberRecord {
            id: m.id.clone(),
            listen: m.listen.clone(),
            incarnation: m.incarnation,
            draining: m.draining,
            zone: None,
            replaces_copies: false,
        })
        .collect();
    MemberView {
        cluster: head.cluster.clone(),
        state: ClusterState {
            config: ClusterConfig {
                shards: head.shards,
                initial_members: head.initial_members,
                replicas: head.replicas,
            },
            members,
            // A client never writes the map: the revision a change would
            // compare against is not handed out.
            map: map.map(|m| (m, 0)),
            revision: head.revision,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(shards: u32, members: usize) -> ClusterState {
        let ids: Vec<String> = (0..members).map(|i| format!("member-{i}")).collect();
        ClusterState {
            config: ClusterConfig {
                shards,
                initial_members: 2,
                replicas: 3,
            },
            members: ids
                .iter()
                .map(|id| MemberRecord {
                    id: id.clone(),
                    listen: format!("rdma://10.0.0.1:{}", 7000 + id.len()),
                    incarnation: 5,
                    draining: false,
                    zone: None,
                    replaces_copies: false,
                })
                .collect(),
            map: Some((
                ShardMap {
                    // Some shards failed over, at various epochs.
                    group_epochs: (0..u64::from(shards)).map(|s| (s % 5) * 2).collect(),
                    unlevelled: Vec::new(),
                    lead_epochs: Vec::new(),
                    epoch: 9,
                    owners: (0..shards)
                        .map(|s| (s % 7 != 3).then(|| ids[s as usize % members].clone()))
                        .collect(),
                    backups: (0..shards as usize)
                        .map(|s| {
                            vec![
                                ids[(s + 1) % members].clone(),
                                ids[(s + 2) % members].clone(),
                            ]
                        })
                        .collect(),
                    moving: Some(ShardMove {
                        shard: 1,
                        to: ids[0].clone(),
                        secret: "members only".into(),
                        replaces: None,
                        leads: false,
                    }),
                },
                77,
            )),
            revision: 123,
        }
    }

    #[test]
    fn a_map_of_the_most_shards_comes_back_whole_over_pages_without_its_secret() {
        let full = state(kv_common::layout::MAX_SHARDS, 5);
        let mut calls = 0;
        let got = assemble(|first| {
            calls += 1;
            page("prod", &full, first)
        })
        .unwrap();
        assert!(calls > 1, "{calls} pages");
        assert_eq!(got.cluster, "prod");
        let mut expected = full.clone();
        if let Some((map, revision)) = &mut expected.map {
            *revision = 0;
            map.moving.as_mut().unwrap().secret.clear();
        }
        assert_eq!(got.state, expected);
    }

    #[test]
    fn a_cluster_without_a_map_is_one_page() {
        let mut none = state(8, 1);
        none.map = None;
        let got = assemble(|first| page("c", &none, first)).unwrap();
        assert_eq!(got.state, none);
    }

    #[test]
    fn a_map_that_changes_between_pages_is_read_again() {
        let (old, mut new) = (state(10_000, 3), state(10_000, 3));
        new.revision += 1;
        let mut calls = 0;
        let got = assemble(|first| {
            calls += 1;
            page("c", if calls == 1 { &old } else { &new }, first)
        })
        .unwrap();
        assert_eq!(got.state.revision, new.revision);
    }

    #[test]
    fn damaged_pages_are_refused() {
        let s = state(16, 3);
        let mut damaged = page("c", &s, 0).unwrap();
        damaged.owners[3] = 7;
        assert!(assemble(|_| Ok(damaged.clone())).is_err());
        for change in [
            |p: &mut MapPage| p.backups[2][1] = 9,
            |p: &mut MapPage| p.backups[2].push(0),
            |p: &mut MapPage| p.replicas = 4,
            |p: &mut MapPage| p.group_epochs.truncate(3),
        ] {
            let mut damaged = page("c", &s, 0).unwrap();
            change(&mut damaged);
            assert!(assemble(|_| Ok(damaged.clone())).is_err());
        }
        // Later pages must agree with the first, and hold owners.
        let big = state(10_000, 3);
        for change in [
            |p: &mut MapPage| p.epoch = None,
            |p: &mut MapPage| p.owners.clear(),
            |p: &mut MapPage| p.shards += 1,
            |p: &mut MapPage| p.members.clear(),
        ] {
            let got = assemble(|first| {
                let mut p = page("c", &big, first)?;
                if first > 0 {
                    change(&mut p);
                }
                Ok(p)
            });
            assert!(got.is_err(), "{got:?}");
        }
        let mut wrong_start = page("c", &s, 0).unwrap();
        wrong_start.first = 2;
        assert!(assemble(|_| Ok(wrong_start.clone())).is_err());
        assert!(page("c", &s, 17).is_err());
    }
}
