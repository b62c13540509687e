//! What etcd holds for a cluster, under `/onekv/<name>/`, as JSON (so that
//! `etcdctl get --prefix /onekv/` is readable by an operator):
//!
//! - `config`: the shard count, fixed at creation;
//! - `op_deadline_ms`: the `--op-deadline-ms` every member runs, set once:
//!   by `cluster create --op-deadline-ms`, or else by the first member to
//!   join (see `Etcd::agree_op_deadline`);
//! - `members/<id>`: one record per live server, on that server's etcd
//!   lease (it vanishes when the server stops renewing);
//! - `map`: which member owns each shard (its primary) and which hold its
//!   backups, with an epoch; changed only by a transaction that compares
//!   the map's revision (see `etcd`);
//! - `coordinator`: the election that picks who changes the map.

use kv_common::layout::MAX_SHARDS;
use kv_common::Address;
use serde::{Deserialize, Serialize};

/// Shards of a cluster when `cluster create` is not told.
pub const DEFAULT_SHARDS: u32 = 64;
/// The most copies of a shard a cluster keeps.
pub const MAX_REPLICAS: u32 = 3;

/// Set once, by `cluster create`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterConfig {
    pub shards: u32,
    /// Members that must have joined before the first map is made, so that
    /// a cluster started with several servers spreads its shards over all
    /// of them from the start.
    pub initial_members: u32,
    /// Copies of each shard, on as many distinct members (and zones, where
    /// members name theirs): a primary and `replicas - 1` backups.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub replicas: u32,
}

fn one() -> u32 {
    1
}

fn is_one(n: &u32) -> bool {
    *n == 1
}

impl ClusterConfig {
    pub fn validate(&self) -> Result<(), String> {
        if self.shards == 0 || self.shards > MAX_SHARDS {
            return Err(format!(
                "{} shards: a cluster has 1 to {MAX_SHARDS}",
                self.shards
            ));
        }
        if self.initial_members == 0 {
            return Err("--initial-members must be at least 1".into());
        }
        if self.replicas == 0 || self.replicas > MAX_REPLICAS {
            return Err(format!(
                "--replicas {}: a shard has 1 to {MAX_REPLICAS} copies",
                self.replicas
            ));
        }
        if self.initial_members < self.replicas {
            return Err(format!(
                "--initial-members {} is fewer than --replicas {}: each copy of a shard needs a server of its own",
                self.initial_members, self.replicas
            ));
        }
        Ok(())
    }
}

/// A live server, as it announced itself.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberRecord {
    /// Stable across restarts (the map names owners by it), unique in the
    /// cluster.
    pub id: String,
    /// Its `--listen` address; each shard it owns is served at
    /// [`shard_address`] of it.
    pub listen: String,
    /// Changes each time the server (re)joins: its etcd lease.
    pub incarnation: i64,
    /// Leaving: its shards are being moved to the others.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub draining: bool,
    /// Its failure domain (`--zone`): no two copies of a shard share one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zone: Option<String>,
    /// Its version ends a copy that replaces another's
    /// (`ShardMove::replaces`) as such: an older one would add it as one
    /// copy more, a group its clients refuse. Only such a member's copies
    /// are drained or balanced (see `ClusterState::can_send`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub replaces_copies: bool,
}

/// Which member owns each shard.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardMap {
    /// Raised by every change.
    pub epoch: u64,
    /// `owners[shard]`: a member id, or none yet. The owner is the shard's
    /// primary: clients read there, and a write is done when it is
    /// published there (after its backups: see kv-client's `replicated`).
    pub owners: Vec<Option<String>>,
    /// `backups[shard]`: the members that hold the shard's other copies;
    /// empty for every shard of a cluster of one replica, or once failovers
    /// left each shard one live copy (and then not written at all).
    #[serde(default, skip_serializing_if = "no_backups")]
    pub backups: Vec<Vec<String>>,
    /// The shard being moved or copied, if one is (one at a time).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moving: Option<ShardMove>,
    /// `group_epochs[shard]`: the map epoch at which the shard's primary
    /// last changed by a failover (0, or absent: never). Every copy admits
    /// only clients that route by it, so a writer that still knows the
    /// old primary cannot touch the copies once they serve the new one.
    #[serde(default, skip_serializing_if = "all_zero")]
    pub group_epochs: Vec<u64>,
    /// `unlevelled[shard]`: backups a failover kept beside the backup it
    /// promoted that may still differ from it on keys whose writers were
    /// never answered. Written like any backup, but never promoted until
    /// the primary's member has brought them level (kv-server's `level`).
    #[serde(default, skip_serializing_if = "no_backups")]
    pub unlevelled: Vec<Vec<String>>,
    /// `lead_epochs[shard]`: the map epoch from which the shard's owner
    /// has led it without a break (0, or absent: not known, as after a
    /// member of an older version published the map). Set where the map is
    /// published (`stamp_leads`), so that no change of owner escapes it: a
    /// client whose write to a replicated shard was cut before its commit
    /// may write again only while the lead it wrote under still holds
    /// (kv-client's `cluster`, which argues why).
    #[serde(default, skip_serializing_if = "all_zero")]
    pub lead_epochs: Vec<u64>,
}

/// A shard on its way from its owner to another member (see `shard_move`
/// in kv-server): the owner copies it into a fresh region the target
/// serves only to the copier (who presents `secret`). Then, in a cluster
/// of one copy, the owner stops serving it and publishes the target as
/// owner; in a replicated cluster, the owner keeps it and publishes the
/// target as its last backup, under a new group epoch (a copy restoring
/// the replica count, or replacing a draining member's backup), or, when
/// the copy replaces the owner itself, stops serving it and publishes the
/// target as the primary of the same backups, under a new group epoch; or,
/// when the copy takes the lead (`leads`), stops serving it likewise and
/// publishes the target as the primary, itself its last backup.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardMove {
    pub shard: u32,
    pub to: String,
    /// What the copier presents to the target's fresh region (hex); no
    /// client that routes by an older map can know it.
    pub secret: String,
    /// A replicated cluster's copy made to take the place of this member's
    /// copy (a draining member's), which leaves the group as it joins.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replaces: Option<String>,
    /// A copy restoring a replicated shard's replica count that takes the
    /// lead from the owner, which stays in the group as a backup: how the
    /// lead comes back to a member that lost it in a failover, where every
    /// member already holds a copy of every shard (no copy can go
    /// elsewhere with it). A source of an older version adds the copy as a
    /// backup instead.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub leads: bool,
}

impl ShardMove {
    /// Whether the copy takes over as primary from `owner`, the source
    /// (which stops serving before the last pass, as a plain move's does).
    pub fn hands_over(&self, owner: Option<&str>) -> bool {
        self.replaces.is_some() && self.replaces.as_deref() == owner
    }

    /// Whether the source stops serving before the last pass and the
    /// target ends as the primary: a handover, or a copy that takes the
    /// lead.
    pub fn takes_lead(&self, owner: Option<&str>) -> bool {
        self.leads || self.hands_over(owner)
    }
}

fn no_backups(backups: &[Vec<String>]) -> bool {
    backups.iter().all(Vec::is_empty)
}

/// Epochs that say nothing: no shard failed over, or no lead is known.
fn all_zero(epochs: &[u64]) -> bool {
    epochs.iter().all(|&e| e == 0)
}

impl ShardMap {
    /// Whether `shard` is being moved.
    pub fn is_moving(&self, shard: u32) -> bool {
        self.moving.as_ref().is_some_and(|m| m.shard == shard)
    }

    pub fn owner(&self, shard: u32) -> Option<&str> {
        self.owners.get(shard as usize)?.as_deref()
    }

    /// The map that ends move `m`, which this map shows: when `copied`,
    /// the target as owner, or for a replicated cluster's `copy` as the
    /// group's last backup under a new group epoch (the copy it replaces,
    /// if any, leaving the group), or, when it replaces the owner (a
    /// handover), as the primary of the same backups under a new group
    /// epoch, or, when it takes the lead, as the primary of the same
    /// backups and the old owner, last, under a new group epoch; else the
    /// source keeps the shard. Published by the source (kv-server's
    /// `shard_host`, which argues the handover).
    pub fn ended_move(&self, m: &ShardMove, copied: bool, copy: bool) -> ShardMap {
        let mut next = self.clone();
        next.epoch += 1;
        next.moving = None;
        let shard = m.shard as usize;
        let new_group = |next: &mut ShardMap| {
            next.group_epochs.resize(next.owners.len(), 0);
            next.group_epochs[shard] = next.epoch;
        };
        if copied && copy {
            next.backups.resize(next.owners.len(), Vec::new());
            next.backups[shard].retain(|b| Some(b) != m.replaces.as_ref());
            next.backups[shard].push(m.to.clone());
            next.forget_unlevelled_outside_groups();
            new_group(&mut next);
        } else if copied {
            let owner = self.owner(m.shard);
            if m.takes_lead(owner) {
                new_group(&mut next);
            }
            if m.leads && !m.hands_over(owner) {
                next.backups.resize(next.owners.len(), Vec::new());
                next.backups[shard].extend(owner.map(str::to_string));
            }
            next.owners[shard] = Some(m.to.clone());
        }
        next
    }

    /// The shards `member` owns.
    pub fn shards_of<'a>(&'a self, member: &'a str) -> impl Iterator<Item = u32> + 'a {
        self.owners
            .iter()
            .enumerate()
            .filter(move |(_, o)| o.as_deref() == Some(member))
            .map(|(s, _)| s as u32)
    }

    /// The members that hold backups of `shard`.
    pub fn backups(&self, shard: u32) -> &[String] {
        self.backups.get(shard as usize).map_or(&[], Vec::as_slice)
    }

    /// The backups of `shard` that are not yet level with its primary
    /// (see `unlevelled`).
    pub fn unlevelled(&self, shard: u32) -> &[String] {
        self.unlevelled
            .get(shard as usize)
            .map_or(&[], Vec::as_slice)
    }

    /// Keeps in `unlevelled` only members that still back their shard up
    /// (a copy that left its group, or became its primary, is no longer
    /// one to level).
    pub fn forget_unlevelled_outside_groups(&mut self) {
        for shard in 0..self.unlevelled.len() {
            let backups = self.backups(shard as u32).to_vec();
            self.unlevelled[shard].retain(|m| backups.contains(m));
        }
        if no_backups(&self.unlevelled) {
            self.unlevelled.clear();
        }
    }

    /// The map once `members`, backups of `shard`, are level with its
    /// primary `primary`, as levelled from group epoch `group_epoch` on
    /// (those of them still waiting); None when the map no longer has any
    /// of them to level there: another primary since (a failover, or a
    /// handover), an older group.
    ///
    /// A copy added since (a newer group, the same primary) leaves them
    /// level: the primary's region is the same, and every write from the
    /// levelling on set them before it committed there.
    pub fn levelled(
        &self,
        shard: u32,
        primary: &str,
        group_epoch: u64,
        members: &[String],
    ) -> Option<ShardMap> {
        let waiting = self.unlevelled(shard);
        let same = self.owner(shard) == Some(primary) && self.group_epoch(shard) >= group_epoch;
        if !same || !members.iter().any(|m| waiting.contains(m)) {
            return None;
        }
        let mut next = self.clone();
        next.epoch += 1;
        next.unlevelled[shard as usize].retain(|m| !members.contains(m));
        next.forget_unlevelled_outside_groups();
        Some(next)
    }

    /// Since when `shard`'s owner has led it (see `lead_epochs`): 0 when
    /// not known.
    pub fn lead_epoch(&self, shard: u32) -> u64 {
        self.lead_epochs.get(shard as usize).copied().unwrap_or(0)
    }

    /// Stamps each shard whose owner differs from `before`'s (the map this
    /// one replaces; none for the first) with this map's epoch; the others
    /// keep `before`'s stamp, unknown (0) included.
    pub fn stamp_leads(&mut self, before: Option<&ShardMap>) {
        let stamps = (0..self.owners.len() as u32)
            .map(|shard| match before {
                Some(b) if b.owner(shard) == self.owner(shard) => b.lead_epoch(shard),
                _ if self.owner(shard).is_some() => self.epoch,
                _ => 0,
            })
            .collect();
        self.lead_epochs = stamps;
    }

    /// The epoch of `shard`'s group: what its copies ask of a client at
    /// connect (see `group_epochs`).
    pub fn group_epoch(&self, shard: u32) -> u64 {
        self.group_epochs.get(shard as usize).copied().unwrap_or(0)
    }

    /// Whether every shard has at most `replicas - 1` backups, distinct
    /// and none its owner (fewer once a failover dropped a dead copy).
    pub fn check_groups(&self, replicas: u32) -> Result<(), String> {
        if self.backups.is_empty() {
            return Ok(());
        }
        if self.backups.len() != self.owners.len() {
            return Err(format!(
                "{} shards but backups for {}",
                self.owners.len(),
                self.backups.len()
            ));
        }
        for (shard, group) in self.backups.iter().enumerate() {
            let mut all: Vec<&str> = group.iter().map(String::as_str).collect();
            all.extend(self.owners[shard].as_deref());
            let count = all.len();
            all.sort_unstable();
            all.dedup();
            if group.len() + 1 > replicas as usize || all.len() != count {
                return Err(format!(
                    "shard {shard} has backups {group:?}: a cluster of {replicas} copies has at most {} distinct others",
                    replicas.saturating_sub(1)
                ));
            }
        }
        Ok(())
    }

    /// The shards `member` holds a copy of: those it owns and those it
    /// backs up.
    pub fn copies_of<'a>(&'a self, member: &'a str) -> impl Iterator<Item = u32> + 'a {
        (0..self.owners.len() as u32).filter(move |&s| {
            self.owner(s) == Some(member) || self.backups(s).iter().any(|b| b == member)
        })
    }
}

/// Everything etcd holds for a cluster, as of one revision (or as a
/// member handed it out: see `directory`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterState {
    pub config: ClusterConfig,
    pub members: Vec<MemberRecord>,
    /// The map and the revision it was last written at (what a change
    /// must compare against); none before the first.
    pub map: Option<(ShardMap, i64)>,
    /// The store's revision when this was read: watch from the next one.
    pub revision: i64,
}

impl ClusterState {
    /// Whether `next`, a map proposed after the current one, starts no
    /// move its source would end otherwise than meant: a copy that
    /// replaces another's goes only from a member that says it ends it so
    /// (`MemberRecord::replaces_copies`; members of older versions, in a
    /// rolling upgrade, do not).
    pub fn can_send(&self, next: &ShardMap) -> bool {
        let Some(m) = &next.moving else {
            return true;
        };
        let started = self.shard_map().and_then(|now| now.moving.as_ref()) != Some(m);
        let source = next.owner(m.shard).and_then(|o| self.member(o));
        !started || m.replaces.is_none() || source.is_some_and(|r| r.replaces_copies)
    }

    pub fn member(&self, id: &str) -> Option<&MemberRecord> {
        self.members.iter().find(|m| m.id == id)
    }
    pub fn live_ids(&self) -> Vec<String> {
        self.members.iter().map(|m| m.id.clone()).collect()
    }
    /// The live members, each with its zone.
    pub fn live_zones(&self) -> Vec<(String, Option<String>)> {
        self.members
            .iter()
            .map(|m| (m.id.clone(), m.zone.clone()))
            .collect()
    }
    /// The live members that are leaving.
    pub fn draining_ids(&self) -> Vec<String> {
        self.members
            .iter()
            .filter(|m| m.draining)
            .map(|m| m.id.clone())
            .collect()
    }
    pub fn shard_map(&self) -> Option<&ShardMap> {
        self.map.as_ref().map(|(m, _)| m)
    }
}

/// Where a member that listens at `listen` serves `shard`: each shard is
/// one region as a single server's, with its own control endpoint.
/// shm: the region file `NAME.shard-S` (socket `NAME.shard-S.sock`);
/// rdma: port `PORT + 1 + S`. The member's own address serves the map
/// (kv-server's `directory`).
pub fn shard_address(listen: &Address, shard: u32) -> Result<Address, String> {
    match listen {
        Address::Shm { region } => {
            let mut name = region.as_os_str().to_owned();
            name.push(format!(".shard-{shard}"));
            Ok(Address::Shm {
                region: name.into(),
            })
        }
        Address::Rdma { host, port } => {
            let port = u32::from(*port) + 1 + shard;
            let port = u16::try_from(port).map_err(|_| {
                format!("{listen}: shard {shard} would need port {port}; listen on a lower port")
            })?;
            Ok(Address::Rdma {
                host: host.clone(),
                port,
            })
        }
    }
}

/// What a move under way does, as `cluster status` says it.
fn describe_move(config: &ClusterConfig, map: &ShardMap, m: &ShardMove) -> String {
    match (config.replicas > 1, m.replaces.as_deref()) {
        (false, _) => "moving".to_string(),
        (true, None) if m.leads => {
            "copying (restoring its replica count, to lead: the owner stays a backup)".to_string()
        }
        (true, None) => "copying (restoring its replica count)".to_string(),
        (true, Some(r)) if m.hands_over(map.owner(m.shard)) => {
            format!("copying (to lead in place of {r})")
        }
        (true, Some(r)) => format!("copying (to replace {r}'s copy)"),
    }
}

/// What `cluster status` prints: members, the shards each owns, and the
/// shards in trouble.
pub fn describe(
    config: &ClusterConfig,
    members: &[MemberRecord],
    map: Option<&ShardMap>,
) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(out, "shards: {}", config.shards);
    if config.replicas > 1 {
        let _ = writeln!(out, "replicas: {}", config.replicas);
    }
    let Some(map) = map else {
        let _ = writeln!(
            out,
            "map: none yet (dealt once {} servers have joined; {} have)",
            config.initial_members,
            members.len()
        );
        return out;
    };
    let _ = writeln!(out, "map epoch: {}", map.epoch);
    if let Some(m) = &map.moving {
        let from = map.owner(m.shard).unwrap_or("nobody");
        let what = describe_move(config, map, m);
        let _ = writeln!(out, "{what}: shard {} from {from} to {}", m.shard, m.to);
    }
    for m in members {
        let shards: Vec<String> = map.shards_of(&m.id).map(|s| s.to_string()).collect();
        let backed: Vec<String> = map
            .copies_of(&m.id)
            .filter(|&s| map.owner(s) != Some(m.id.as_str()))
            .map(|s| s.to_string())
            .collect();
        let _ = write!(
            out,
            "member {}{}{} at {} (incarnation {:x}): {} shards [{}]",
            m.id,
            m.zone
                .as_ref()
                .map(|z| format!(" (zone {z})"))
                .unwrap_or_default(),
            if m.draining { " (draining)" } else { "" },
            m.listen,
            m.incarnation,
            shards.len(),
            shards.join(" ")
        );
        let _ = match backed.is_empty() {
            true => writeln!(out),
            false => writeln!(out, ", backups of [{}]", backed.join(" ")),
        };
    }
    describe_trouble(&mut out, config, members, map);
    out
}

/// The lines of `cluster status` that name shards in trouble: without a
/// live owner, short of copies, or with backups not yet level.
fn describe_trouble(
    out: &mut String,
    config: &ClusterConfig,
    members: &[MemberRecord],
    map: &ShardMap,
) {
    use std::fmt::Write;
    let down: Vec<String> = (0..map.owners.len() as u32)
        .filter(|&s| {
            map.owner(s)
                .is_none_or(|o| !members.iter().any(|m| m.id == o))
        })
        .map(|s| format!("{s}@{}", map.owner(s).unwrap_or("nobody")))
        .collect();
    if !down.is_empty() {
        let _ = writeln!(
            out,
            "unavailable shards (owner not live): {}",
            down.join(" ")
        );
    }
    let short: Vec<String> = (0..map.owners.len() as u32)
        .map(|s| (s, map.backups(s).len() + 1))
        .filter(|&(_, copies)| copies < config.replicas as usize)
        .map(|(s, copies)| format!("{s} ({copies} of {})", config.replicas))
        .collect();
    if !short.is_empty() {
        let _ = writeln!(
            out,
            "shards short of copies (a failover dropped a dead server's): {}",
            short.join(", ")
        );
    }
    let unlevelled: Vec<String> = (0..map.owners.len() as u32)
        .filter(|&s| !map.unlevelled(s).is_empty())
        .map(|s| format!("{s} ({})", map.unlevelled(s).join(" ")))
        .collect();
    if !unlevelled.is_empty() {
        let _ = writeln!(
            out,
            "backups being levelled after a failover (not promoted until then): {}",
            unlevelled.join(", ")
        );
    }
}

pub fn encode<T: Serialize>(record: &T) -> Vec<u8> {
    // The records are plain structs of strings and numbers: nothing in
    // them can fail to serialize.
    serde_json::to_vec(record).unwrap_or_default()
}

/// A record read back from etcd; `what` names it in the error.
pub fn decode<T: for<'de> Deserialize<'de>>(what: &str, bytes: &[u8]) -> Result<T, String> {
    serde_json::from_slice(bytes).map_err(|e| format!("{what} in etcd is damaged: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_get_addresses_of_their_own() {
        let shm = Address::parse("shm:///dev/shm/a").unwrap();
        assert_eq!(
            shard_address(&shm, 3).unwrap().to_string(),
            "shm:///dev/shm/a.shard-3"
        );
        let rdma = Address::parse("rdma://10.0.0.1:7000").unwrap();
        assert_eq!(
            shard_address(&rdma, 0).unwrap().to_string(),
            "rdma://10.0.0.1:7001"
        );
        let high = Address::parse("rdma://h:65500").unwrap();
        assert!(shard_address(&high, 63).unwrap_err().contains("lower port"));
    }

    /// A member record of an older version (no `replaces_copies`) is read
    /// as one that does not replace copies: none of its copies is drained
    /// or balanced, while other moves go on.
    #[test]
    fn copies_replacing_others_start_only_from_members_that_end_them_so() {
        let old: MemberRecord = decode(
            "member",
            br#"{"id":"a","listen":"shm:///dev/shm/a","incarnation":1}"#,
        )
        .unwrap();
        assert!(!old.replaces_copies);
        let new = MemberRecord {
            id: "b".into(),
            replaces_copies: true,
            ..old.clone()
        };
        let map = ShardMap {
            group_epochs: Vec::new(),
            unlevelled: Vec::new(),
            lead_epochs: Vec::new(),
            epoch: 4,
            owners: vec![Some("a".into()), Some("b".into())],
            backups: vec![vec!["c".into()], vec!["c".into()]],
            moving: None,
        };
        let state = ClusterState {
            config: ClusterConfig {
                shards: 2,
                initial_members: 2,
                replicas: 2,
            },
            members: vec![old, new],
            map: Some((map.clone(), 7)),
            revision: 7,
        };
        let moving = |shard: u32, replaces: Option<&str>| ShardMap {
            epoch: 5,
            moving: Some(ShardMove {
                shard,
                to: "d".into(),
                secret: "00".into(),
                replaces: replaces.map(str::to_string),
                leads: false,
            }),
            ..map.clone()
        };
        assert!(!state.can_send(&moving(0, Some("c"))), "from a, older");
        assert!(state.can_send(&moving(0, None)), "a restore");
        assert!(state.can_send(&moving(1, Some("c"))), "from b");
        assert!(state.can_send(&map), "no move");
    }

    /// A lead is stamped with the epoch of the map that gave it, and keeps
    /// its stamp while its owner stays, an unknown one (0: the map came
    /// from a member of an older version) included.
    #[test]
    fn a_lead_is_stamped_when_its_owner_changes_and_keeps_its_stamp_after() {
        let map = |epoch, owners: [&str; 3]| ShardMap {
            group_epochs: Vec::new(),
            unlevelled: Vec::new(),
            lead_epochs: Vec::new(),
            epoch,
            owners: owners
                .iter()
                .map(|o| (!o.is_empty()).then(|| o.to_string()))
                .collect(),
            backups: Vec::new(),
            moving: None,
        };
        let mut first = map(1, ["a", "b", ""]);
        first.stamp_leads(None);
        assert_eq!(first.lead_epochs, [1, 1, 0]);
        let mut next = map(2, ["a", "c", "c"]);
        next.stamp_leads(Some(&first));
        assert_eq!(next.lead_epochs, [1, 2, 2]);
        assert_eq!(decode::<ShardMap>("map", &encode(&next)).unwrap(), next);
        // Republished by an older member, which knows no stamps: gone.
        let mut older = next.clone();
        older.epoch = 3;
        let older = String::from_utf8(encode(&older)).unwrap();
        let older = older.replace(r#","lead_epochs":[1,2,2]"#, "");
        let older = decode::<ShardMap>("map", older.as_bytes()).unwrap();
        assert!(older.lead_epochs.is_empty(), "{older:?}");
        let mut after = map(4, ["a", "c", "b"]);
        after.stamp_leads(Some(&older));
        assert_eq!(after.lead_epochs, [0, 0, 4]);
        assert_eq!(after.lead_epoch(7), 0);
    }

    #[test]
    fn records_round_trip_and_damage_is_named() {
        let map = ShardMap {
            group_epochs: Vec::new(),
            unlevelled: Vec::new(),
            lead_epochs: Vec::new(),
            epoch: 4,
            owners: vec![Some("a".into()), None],
            backups: Vec::new(),
            moving: None,
        };
        assert_eq!(decode::<ShardMap>("map", &encode(&map)).unwrap(), map);
        assert_eq!(map.shards_of("a").collect::<Vec<_>>(), [0]);
        assert!(decode::<ShardMap>("map", b"{").unwrap_err().contains("map"));
        let bad = ClusterConfig {
            shards: 0,
            initial_members: 1,
            replicas: 1,
        };
        assert!(bad.validate().is_err());
        let good = ClusterConfig {
            shards: 4,
            initial_members: 3,
            replicas: 3,
        };
        assert!(good.validate().is_ok());
        for (initial_members, replicas) in [(2, 3), (4, 4), (1, 0)] {
            let bad = ClusterConfig {
                initial_members,
                replicas,
                ..good.clone()
            };
            assert!(bad.validate().is_err(), "{bad:?}");
        }
        // A config written before replicas existed reads as one copy.
        let old: ClusterConfig = decode("config", br#"{"shards":4,"initial_members":1}"#).unwrap();
        assert_eq!(old.replicas, 1);
        assert!(!String::from_utf8(encode(&old))
            .unwrap()
            .contains("replicas"));
    }
}
