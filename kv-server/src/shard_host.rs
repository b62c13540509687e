//! A cluster member's shards: one [`Server`] per shard the map gives this
//! member, each on its own region and control endpoint
//! ([`kv_cluster::shard_address`]), exactly as a single server; and its
//! part in moving a shard (see `shard_move`):
//!
//! - as the **target**, it serves a fresh region for the shard, open only
//!   to the copier (the move's secret), and once the map names it owner,
//!   serves that region to everyone;
//! - as the **source**, it copies the shard to the target while serving
//!   it, stops serving it, copies what changed meanwhile, and publishes
//!   the target as owner by a transaction on the map it read (or, if the
//!   copy failed, drops the move and serves the shard again). A source
//!   that no longer serves the shard when the move reaches it (it
//!   restarted) drops the move too: the target may hold a first pass of a
//!   copy this process did not make, so the coordinator proposes the move
//!   again later, to a fresh region.
//!
//! In a replicated cluster a move is a **copy** that restores a shard's
//! replica count, or replaces a draining or overloaded member's backup:
//! the primary's member copies it as above but never stops serving it. Its last pass freezes the primary's index (readers go on,
//! writers wait), and the map then names the target the group's last
//! backup under a new group epoch. Every copy of the shard restarts under
//! it, the primary's thawed: a writer that observed the shard before the
//! target joined, and so would not set it, can commit nowhere, and every
//! write from then on sets the target too. Until its member sees that
//! map, the primary stays stopped (see `ShardHost::floors`). A copy that
//! fails after the freeze restarts the primary under the same epoch. A
//! copy goes only from a server under the map's group (a failover that
//! just made this member primary restarts it first), and one found in the
//! first map this process followed is dropped, as above. A copy that
//! replaces a draining member's copy (`ShardMove::replaces`) ends the
//! same way, that member leaving the group; one that replaces the primary
//! itself is a **handover**: the source stops serving before the last
//! pass, as in a move, and the map names the target the primary of the
//! same backups under a new group epoch (argued at `finish_move`).
//!
//! After a failover, the member that leads a shard levels the backups
//! kept beside it (`ShardMap::unlevelled`), one shard at a time, in a
//! thread of its own (see `level`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kv_cluster::etcd::BlockingEtcd;
use kv_cluster::{shard_address, ClusterUrl, ShardMap, ShardMove};
use kv_common::Address;

use crate::control::Shared;
use crate::level::{self, Levelling};
use crate::regions_made::{MissingRegions, Refusal, RegionsMade};
use crate::shard_move::{self, Outgoing};
use crate::{region_path, MetricsEndpoint, Server, ServerConfig, ServerError};

/// A shard's server, and what it asks of a client.
struct Served {
    server: Server,
    asks: Asks,
}

/// What a shard's server asks of a client at connect: the move's secret
/// when it is a move's target; the group epoch its copies serve (see
/// `ShardMap::group_epochs`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Asks {
    secret: Option<String>,
    group_epoch: u64,
}

/// The shards served, as the metrics endpoint reads them: weakly, so that
/// a stopped server's region lock and listener go with it (a scrape must
/// not keep them from the server that replaces it).
type ShardServers = Vec<(u32, Weak<Shared>)>;

/// Least time between two follows of one map by `poll`.
const RETRY_EVERY: Duration = Duration::from_secs(1);
/// Longest a stopping member waits for etcd to take the records of the
/// regions it made (see `RegionsMade::flush`).
const RECORD_FLUSH_WAIT: Duration = Duration::from_secs(3);

/// What the member tells a move under way, and what it did.
#[derive(Default)]
struct MoveFlags {
    /// Give up (the member is going).
    quit: AtomicBool,
    /// It may still stop its shard and finish (see `ShardHost::poll`).
    proceed: AtomicBool,
    /// It asked the shard's server to freeze the index: a copy's server
    /// must restart to thaw it.
    froze: AtomicBool,
}

impl MoveFlags {
    fn go_on(&self) -> bool {
        self.proceed.load(Ordering::SeqCst) && !self.quit.load(Ordering::SeqCst)
    }
}

/// A move being sent.
struct Sending {
    m: ShardMove,
    /// A replicated cluster's copy (the source keeps the shard); not a
    /// handover.
    copy: bool,
    /// The shard's server while it still serves (the first pass); taken
    /// by whoever stops it first, the move or `stop_all`.
    server: Arc<Mutex<Option<Server>>>,
    flags: Arc<MoveFlags>,
    thread: JoinHandle<Option<u64>>,
}

/// A levelling under way (see `level`).
struct LevelRun {
    what: Levelling,
    quit: Arc<AtomicBool>,
    started: Instant,
    thread: JoinHandle<Result<level::Levelled, String>>,
}

/// How long after a levelling failed the next of that shard is tried,
/// doubling at each failure up to `LEVEL_RETRY_MAX` (a backup's server
/// that does not answer, or is too old to list its keys, costs the
/// primary's member a listing that often); other shards go meanwhile.
const LEVEL_RETRY: Duration = Duration::from_secs(1);
const LEVEL_RETRY_MAX: Duration = Duration::from_secs(30);

pub struct ShardHost {
    /// Settings every shard's server starts with; its address, region file
    /// and metrics endpoint are the shard's own.
    template: ServerConfig,
    member: String,
    url: ClusterUrl,
    serving: BTreeMap<u32, Served>,
    /// The move this member is sending, while its thread runs.
    sending: Option<Sending>,
    /// The last move sent: done, whether or not the map shows it yet.
    sent: Option<ShardMove>,
    /// The move in the first map this process followed: an earlier
    /// process of this member may have begun sending it, into a target
    /// that then holds keys this one cannot know of (see the module's
    /// comment).
    inherited: Option<ShardMove>,
    /// The least group epoch each shard may start under: a copy this
    /// member made published its shard's next epoch, and until the map
    /// followed here shows it, the shard's server must not start under
    /// the old one (whose writers do not set the new copy).
    floors: BTreeMap<u32, u64>,
    /// The map last followed.
    map: Option<ShardMap>,
    /// Where each member was last seen to listen, the departed included:
    /// a failover fences the region of a shard's old primary (see
    /// `fence_old_primaries`).
    listens: BTreeMap<String, String>,
    /// Whether the cluster keeps several copies of each shard.
    replicated: bool,
    /// The member's lease, which a replicated cluster's copies check at
    /// each connect.
    lease: Option<kv_cluster::member::LeaseDeadline>,
    /// When to follow it again if this member is behind it (see `poll`).
    retry_at: Option<Instant>,
    /// Out of the cluster (`leave`): the last map is kept (a drain still
    /// counts what it gives this member) but not served by until a map
    /// read after joining again is followed.
    out: bool,
    /// Why each shard that cannot start failed last: logged once, not at
    /// every retry.
    failing: BTreeMap<u32, String>,
    /// The member's metrics endpoint (`--metrics-listen`), labelled by
    /// shard, and the shards it shows.
    metrics: Option<MetricsEndpoint>,
    shown: Arc<Mutex<ShardServers>>,
    /// The levelling of a led shard's backups under way, if one is; the
    /// last one the map took (until the map shows it); and, for each shard
    /// whose last levelling failed or was not taken, when to try again and
    /// the wait after the next failure.
    levelling: Option<LevelRun>,
    levelled: Option<Levelling>,
    level_retry: BTreeMap<u32, (Instant, Duration)>,
    /// Which regions this member made, checked before one is made from
    /// nothing (None: unchecked, in this module's tests, which have no
    /// etcd).
    regions: Option<RegionsMade>,
    /// A copy whose region is lost: the daemon ends (see `failure`).
    lost: Option<String>,
}

impl ShardHost {
    /// `template.address` is the member's `--listen` address; its
    /// `metrics_listen`, the endpoint for every shard served here.
    ///
    /// # Errors
    ///
    /// When the metrics endpoint cannot listen.
    pub fn new(
        template: ServerConfig,
        member: String,
        url: ClusterUrl,
        missing: MissingRegions,
    ) -> Result<ShardHost, ServerError> {
        let listen = template.address.to_string();
        let regions = RegionsMade::new(url.clone(), &member, &listen, missing);
        let shown: Arc<Mutex<ShardServers>> = Arc::default();
        let metrics = match template.metrics_listen {
            Some(at) => {
                let shards = shown.clone();
                let servers = Box::new(move || {
                    let shards = shards.lock().unwrap_or_else(|e| e.into_inner());
                    shards
                        .iter()
                        .filter_map(|(s, shared)| Some((Some(*s), shared.upgrade()?)))
                        .collect()
                });
                Some(MetricsEndpoint::start(at, servers)?)
            }
            None => None,
        };
        Ok(ShardHost {
            template,
            member,
            url,
            serving: BTreeMap::new(),
            sending: None,
            sent: None,
            inherited: None,
            floors: BTreeMap::new(),
            map: None,
            listens: BTreeMap::new(),
            replicated: false,
            lease: None,
            retry_at: None,
            out: false,
            failing: BTreeMap::new(),
            metrics,
            shown,
            levelling: None,
            levelled: None,
            level_retry: BTreeMap::new(),
            regions: Some(regions),
            lost: None,
        })
    }

    /// Where the metrics endpoint listens, if there is one.
    pub fn metrics_address(&self) -> Option<std::net::SocketAddr> {
        self.metrics.as_ref().map(MetricsEndpoint::address)
    }

    /// Shows the shards served now on the metrics endpoint: a shard being
    /// sent too, until its move stops it.
    fn show_served(&self) {
        let mut served: ShardServers = self
            .serving
            .iter()
            .map(|(shard, s)| (*shard, Arc::downgrade(&s.server.shared)))
            .collect();
        if let Some(s) = &self.sending {
            let server = s.server.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(server) = server.as_ref() {
                served.push((s.m.shard, Arc::downgrade(&server.shared)));
                served.sort_by_key(|(shard, _)| *shard);
            }
        }
        *self.shown.lock().unwrap_or_else(|e| e.into_inner()) = served;
    }

    pub fn member(&self) -> &str {
        &self.member
    }

    /// The deadline every shard here is served with.
    pub fn op_deadline(&self) -> Duration {
        self.template.op_deadline
    }

    pub fn listen(&self) -> &Address {
        &self.template.address
    }

    /// The member's lease, as the copies started from now on check it.
    pub fn set_lease(&mut self, lease: kv_cluster::member::LeaseDeadline) {
        self.lease = Some(lease);
    }

    /// Takes in what `state` says besides the map: where its members
    /// listen (see `listens`), and whether it keeps copies.
    pub fn saw(&mut self, state: &kv_cluster::ClusterState) {
        for m in &state.members {
            self.listens.insert(m.id.clone(), m.listen.clone());
        }
        self.replicated = state.config.replicas > 1;
    }

    /// Serves exactly what `map` gives this member: the shards it owns
    /// (reopening their regions when they exist, with every write they
    /// held) and a move's fresh region when it is the target; sends a
    /// shard it owns that the map moves; stops everything else. A copy
    /// whose group epoch changed (a failover) is stopped, so that every
    /// client routing by the old group loses it, and started again under
    /// the new epoch after a grace period; a copy the map no longer gives
    /// this member is deleted (a failover dropped it: it misses writes
    /// made since). A shard that cannot start is logged and tried again at
    /// the next map. Starting stops as soon as `held` says the lease may
    /// be lost.
    pub fn follow(&mut self, map: &ShardMap, held: impl Fn() -> bool) {
        self.out = false;
        let before = self.map.replace(map.clone());
        if before.is_none() {
            self.inherited.clone_from(&map.moving);
        }
        self.retry_at = Some(Instant::now() + RETRY_EVERY);
        let (wanted, outgoing) = self.plan(map);
        let stale: Vec<u32> = self
            .serving
            .iter()
            .filter(|(s, served)| {
                wanted.get(s) != Some(&served.asks)
                    && Some(**s) != outgoing.as_ref().map(|m| m.shard)
            })
            .map(|(s, _)| *s)
            .collect();
        for shard in stale {
            if let Some(served) = self.serving.remove(&shard) {
                tracing::info!(shard, "stopping (the map changed)");
                served.server.shutdown();
            }
        }
        if self.replicated {
            self.discard_dropped_copies(map, &wanted);
        }
        self.floors
            .retain(|&shard, floor| map.group_epoch(shard) < *floor);
        // The shards held here whose group changed since the last map (a
        // failover, or a copy added), whether served now or not.
        let failed_over: Vec<u32> = map
            .copies_of(&self.member)
            .filter(|&s| {
                before
                    .as_ref()
                    .is_some_and(|b| b.group_epoch(s) != map.group_epoch(s))
            })
            .collect();
        self.fence_old_primaries(before.as_ref(), map, &failed_over);
        if !failed_over.is_empty() {
            // Each starts again after a grace period for what the clients
            // cut off had begun (`Server::start` waits it).
            tracing::info!(shards = ?failed_over, "a new group (a failover, or a copy added): serving under its epoch");
        }
        if let Some(m) = outgoing.filter(|_| held()) {
            self.send(m);
        }
        for (shard, asks) in wanted {
            if !held() {
                break;
            }
            if self.serving.contains_key(&shard) {
                continue;
            }
            self.start(shard, asks, map.epoch);
        }
        self.level_next(map, held());
        self.show_served();
    }

    /// Calls off a levelling of a shard this member no longer leads;
    /// else, unless one runs, starts levelling the backups a failover kept
    /// beside a shard this member leads (see `level`), one shard at a
    /// time, once the shard is served here under the map's group.
    fn level_next(&mut self, map: &ShardMap, held: bool) {
        if let Some(run) = &self.levelling {
            let leads = map.owner(run.what.shard) == Some(self.member.as_str());
            if !leads || !held {
                run.quit.store(true, Ordering::SeqCst);
            }
            return;
        }
        if !self.replicated || !held {
            return;
        }
        let now = Instant::now();
        let next = map.shards_of(&self.member).find_map(|shard| {
            if self.level_retry.get(&shard).is_some_and(|r| now < r.0) {
                return None;
            }
            let what = Levelling {
                shard,
                group_epoch: map.group_epoch(shard),
                members: map.unlevelled(shard).to_vec(),
                primary: shard_address(&self.template.address, shard).ok()?,
            };
            let served = self
                .serving
                .get(&shard)
                .is_some_and(|s| s.asks.secret.is_none() && s.asks.group_epoch == what.group_epoch);
            let fresh = self.levelled.as_ref() != Some(&what);
            (served && fresh && !what.members.is_empty()).then_some(what)
        });
        let Some(what) = next else {
            return;
        };
        let quit = Arc::new(AtomicBool::new(false));
        let (url, told, job) = (self.url.clone(), quit.clone(), what.clone());
        let member = self.member.clone();
        let thread = std::thread::Builder::new()
            .name(format!("kv-level-{}", what.shard))
            .spawn(move || level::level(&url, &member, &job, &told));
        match thread {
            Ok(thread) => {
                tracing::info!(shard = what.shard, backups = ?what.members, "levelling the backups a failover kept");
                self.levelling = Some(LevelRun {
                    what,
                    quit,
                    started: Instant::now(),
                    thread,
                });
            }
            Err(e) => {
                tracing::error!(shard = what.shard, "cannot start levelling: {e}");
                self.level_failed(what.shard);
            }
        }
    }

    /// Takes in a levelling that ended.
    fn levelling_ended(&mut self) {
        let done = self
            .levelling
            .as_ref()
            .is_some_and(|r| r.thread.is_finished());
        let Some(run) = self.levelling.take_if(|_| done) else {
            return;
        };
        let shard = run.what.shard;
        let ms = run.started.elapsed().as_millis() as u64;
        match run.thread.join() {
            Ok(Ok(l)) => {
                tracing::info!(shard, keys = l.keys, listed_apart = l.listed_apart, listed_ms = l.listed.as_millis() as u64, written = l.written, published = l.published, ms, backups = ?run.what.members, "levelled");
                self.level_retry.remove(&shard);
                match l.published {
                    true => self.levelled = Some(run.what),
                    // Not before this member's map shows why.
                    false => {
                        let retry = (Instant::now() + LEVEL_RETRY, LEVEL_RETRY);
                        self.level_retry.insert(shard, retry);
                    }
                }
            }
            Ok(Err(e)) => {
                tracing::warn!(shard, ms, "levelling failed (tried again later): {e}");
                self.level_failed(shard);
            }
            Err(_) => {
                tracing::error!(shard, "the levelling thread panicked");
                self.level_failed(shard);
            }
        }
    }

    /// Waits longer before levelling `shard` again.
    fn level_failed(&mut self, shard: u32) {
        let wait = self
            .level_retry
            .get(&shard)
            .map_or(LEVEL_RETRY, |r| (r.1 * 2).min(LEVEL_RETRY_MAX));
        self.level_retry
            .insert(shard, (Instant::now() + wait, wait));
    }

    /// Deletes the region of each shard whose copy this member held and
    /// `map` (a replicated cluster's) no longer gives it: a failover
    /// dropped it while this member was away, so it misses acknowledged
    /// writes and must never be served as current again.
    fn discard_dropped_copies(&self, map: &ShardMap, wanted: &BTreeMap<u32, Asks>) {
        let mine: Vec<u32> = map.copies_of(&self.member).collect();
        for shard in 0..map.owners.len() as u32 {
            if wanted.contains_key(&shard)
                || self.serving.contains_key(&shard)
                || mine.contains(&shard)
            {
                continue;
            }
            let Ok(path) = self.config_of(shard).and_then(|c| region_path(&c)) else {
                continue;
            };
            match std::fs::remove_file(&path) {
                Ok(()) => tracing::warn!(
                    shard,
                    "deleted this server's copy: the map no longer keeps it here (a failover left it behind, or a copy elsewhere replaced it)"
                ),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => tracing::error!(shard, "cannot delete a dropped copy: {e}"),
            }
        }
    }

    /// For each shard in `shards`, whose primary a failover changed from
    /// `before`: over shm (one host, so the old primary's region file is
    /// here), revokes every key of the old primary's region, so that a
    /// client still routing by the old map can no longer read there, even
    /// if its server is not running to do it. Over rdma a dead server's
    /// registrations went with its process, and a live one fences itself
    /// once its lease is unconfirmed (kv-server's `main`).
    fn fence_old_primaries(&self, before: Option<&ShardMap>, map: &ShardMap, shards: &[u32]) {
        for &shard in shards {
            let Some(old) = before.and_then(|b| b.owner(shard)) else {
                continue;
            };
            // Still in the group: it gave its lead to a copy that took it,
            // its server stopped before that was published (its clients'
            // keys revoked), and it serves again as a backup, whose keys
            // must stay.
            if map.owner(shard) == Some(old) || map.backups(shard).iter().any(|b| b == old) {
                continue;
            }
            let listen = self.listens.get(old).and_then(|l| Address::parse(l).ok());
            let Some(Address::Shm { .. }) = listen else {
                continue;
            };
            let Some(at) = listen.and_then(|l| shard_address(&l, shard).ok()) else {
                continue;
            };
            let Address::Shm { region } = at else {
                continue;
            };
            if !region.exists() {
                continue;
            }
            match crate::region::revoke_keys(&region) {
                Ok(()) => tracing::info!(shard, old, "revoked the old primary's keys"),
                Err(e) => tracing::warn!(shard, old, "cannot revoke the old primary's keys: {e}"),
            }
        }
    }

    /// What `map` asks of this member: each shard to serve (those it owns
    /// and those it backs up: a backup's region is served as a primary's,
    /// for the writers that keep it a copy), with what it asks of clients
    /// (a move target's secret, the group epoch), and the move to send.
    /// A shard below its floor waits for a newer map.
    fn plan(&self, map: &ShardMap) -> (BTreeMap<u32, Asks>, Option<ShardMove>) {
        let mut wanted: BTreeMap<u32, Asks> = map
            .copies_of(&self.member)
            .filter(|s| self.floors.get(s).is_none_or(|&f| map.group_epoch(*s) >= f))
            .map(|s| {
                let asks = Asks {
                    secret: None,
                    group_epoch: map.group_epoch(s),
                };
                (s, asks)
            })
            .collect();
        // Its server is the move's until the move's end is taken in.
        if let Some(s) = &self.sending {
            wanted.remove(&s.m.shard);
        }
        let mut outgoing = None;
        if let Some(m) = &map.moving {
            if map.owner(m.shard) == Some(self.member.as_str()) {
                // A copy is sent from the shard's server under the map's
                // group: one that a failover just gave this member (the
                // two maps may arrive as one) restarts under it first.
                // A handover sent, whose end this map does not show yet,
                // stays out as a plain move does: its region is the
                // target's now, and gone from here (or, when the copy took
                // the lead, this member's backup under the group to come).
                let handed_over =
                    self.sent.as_ref() == Some(m) && m.takes_lead(Some(self.member.as_str()));
                let ready = !self.replicated
                    || handed_over
                    || self.inherited.as_ref() == Some(m)
                    || self.sending.as_ref().is_some_and(|s| s.m == *m)
                    || self
                        .serving
                        .get(&m.shard)
                        .is_some_and(|s| wanted.get(&m.shard) == Some(&s.asks));
                if ready {
                    wanted.remove(&m.shard);
                    outgoing = Some(m.clone());
                }
            } else if m.to == self.member {
                // Only the copier, who knows the secret, connects; and it
                // routes by no group.
                let asks = Asks {
                    secret: Some(m.secret.clone()),
                    group_epoch: 0,
                };
                wanted.insert(m.shard, asks);
            }
        }
        (wanted, outgoing)
    }

    /// Whether the last map asks for something not under way here: a shard
    /// not served (its start failed, or was skipped while the lease was
    /// unconfirmed), or a move not being sent.
    fn behind(&self) -> bool {
        let Some(map) = &self.map else {
            return false;
        };
        let (wanted, outgoing) = self.plan(map);
        let unserved = wanted.keys().any(|s| !self.serving.contains_key(s));
        let unsent =
            outgoing.is_some_and(|m| self.sending.is_none() && self.sent.as_ref() != Some(&m));
        unserved || unsent
    }

    fn start(&mut self, shard: u32, asks: Asks, epoch: u64) {
        let secret = asks.secret.clone();
        if secret.is_none() && !self.vouch_for_region(shard) {
            return;
        }
        let started = self.config_of(shard).and_then(|mut config| {
            prepare_region(&region_path(&config)?, secret.as_deref())?;
            config.group_epoch = asks.group_epoch;
            if let Some(secret) = &secret {
                config.secret = Some(secret.as_bytes().to_vec());
                // Only the copier connects: it sizes the index as the
                // source's before it copies, and reads nothing that needs
                // a read lease (the region restarts under the new group
                // epoch, leased, before anyone else reads it).
                config.resize_on_request_up_to = u64::MAX;
                config.lease = None;
            }
            Server::start(config)
        });
        match started {
            Ok(server) => {
                if let Some(regions) = self.regions.as_mut() {
                    regions.record(shard);
                }
                let role = if secret.is_some() {
                    "receiving"
                } else {
                    "serving"
                };
                tracing::info!(shard, address = %server.address(), epoch, "{role}");
                self.serving.insert(shard, Served { server, asks });
                self.failing.remove(&shard);
            }
            Err(e) => self.cannot_serve(shard, e.to_string()),
        }
    }

    /// Logs why shard `shard` cannot start, once while the reason stays.
    fn cannot_serve(&mut self, shard: u32, why: String) {
        if self.failing.get(&shard) == Some(&why) {
            tracing::debug!(shard, "still cannot serve: {why}");
        } else {
            tracing::error!(shard, "cannot serve (tried again each second): {why}");
            self.failing.insert(shard, why);
        }
    }

    /// Whether shard `shard`'s copy, given by the map rather than brought
    /// by a move, may start from its region (see `regions_made`): a lost
    /// region ends the daemon; an unanswered check is tried again.
    fn vouch_for_region(&mut self, shard: u32) -> bool {
        let path = self
            .config_of(shard)
            .and_then(|config| region_path(&config));
        let (Some(regions), Ok(path)) = (self.regions.as_mut(), path) else {
            return true;
        };
        match regions.check(shard, &path, self.replicated) {
            Ok(()) => true,
            Err(Refusal::Lost(why)) => {
                tracing::error!(shard, "{why}");
                self.lost.get_or_insert(why);
                false
            }
            Err(Refusal::Unchecked(why)) => {
                let why = format!("cannot tell from etcd whether its region was made: {why}");
                self.cannot_serve(shard, why);
                false
            }
            Err(Refusal::Asking) => {
                tracing::debug!(shard, "waiting for this member's region records from etcd");
                // Tried again at the loop's next turn, not a second later.
                self.retry_at = Some(Instant::now());
                false
            }
        }
    }

    /// Starts sending shard `m.shard` to `m.to`, unless that is under way
    /// or done.
    fn send(&mut self, m: ShardMove) {
        if self.sending.is_some() || self.sent.as_ref() == Some(&m) {
            return;
        }
        let outgoing = match self.outgoing(&m) {
            Ok(o) => o,
            Err(e) => return tracing::error!(shard = m.shard, "cannot move: {e}"),
        };
        // A levelling of a shard whose lead goes with the move is called
        // off before the move can end: were the lead to come back here
        // later (a failover to this member, the old primary kept), the
        // map would look as the levelling began, and its result, from
        // another group, could still be published.
        if let Some(run) = self
            .levelling
            .as_ref()
            .filter(|r| r.what.shard == m.shard && m.takes_lead(Some(&self.member)))
        {
            run.quit.store(true, Ordering::SeqCst);
        }
        let server = Arc::new(Mutex::new(self.serving.remove(&m.shard).map(|s| s.server)));
        let flags = Arc::new(MoveFlags::default());
        flags.proceed.store(true, Ordering::SeqCst);
        // A replicated cluster's copy keeps its source serving, unless it
        // replaces the source itself (a draining primary hands over) or
        // takes its lead.
        let copy = self.replicated && !m.takes_lead(Some(&self.member));
        let (url, target) = (self.url.clone(), m.clone());
        let (in_thread, told) = (server.clone(), flags.clone());
        let thread = std::thread::Builder::new()
            .name(format!("kv-move-{}", m.shard))
            .spawn(move || {
                let shard = MovingShard {
                    server: &in_thread,
                    flags: &told,
                    copy,
                };
                move_shard(shard, &outgoing, &url, &target)
            });
        match thread {
            Ok(thread) => {
                self.sending = Some(Sending {
                    m,
                    copy,
                    server,
                    flags,
                    thread,
                })
            }
            Err(e) => {
                tracing::error!(shard = m.shard, "cannot start the move: {e}");
                self.serve_on(m.shard, &server);
            }
        }
        self.show_served();
    }

    /// Keeps serving `shard` with the server a move held, if it still
    /// serves.
    fn serve_on(&mut self, shard: u32, server: &Mutex<Option<Server>>) {
        if let Some(server) = take(server) {
            if let Some(regions) = self.regions.as_mut() {
                regions.record(shard);
            }
            let asks = Asks {
                secret: None,
                group_epoch: server.shared.group_epoch,
            };
            let served = Served { server, asks };
            self.serving.insert(shard, served);
        }
    }

    fn outgoing(&self, m: &ShardMove) -> Result<Outgoing, String> {
        let config = self.config_of(m.shard).map_err(|e| e.to_string())?;
        let region = region_path(&config).map_err(|e| e.to_string())?;
        Ok(Outgoing {
            shard: m.shard,
            secret: m.secret.as_bytes().to_vec(),
            region,
            grace: config.grace(),
        })
    }

    /// Between maps: tells the move under way whether it may still stop
    /// its shard (the lease held, the map still showing it); takes in a
    /// move that ended; and follows the last map again when a move ended,
    /// or, at most once per `RETRY_EVERY`, when it asks for something not
    /// under way here; and writes the region records that failed (see
    /// `RegionsMade::record_pending`).
    pub fn poll(&mut self, held: impl Fn() -> bool) {
        if let Some(s) = &self.sending {
            let shown = self.map.as_ref().and_then(|m| m.moving.as_ref()) == Some(&s.m);
            s.flags.proceed.store(held() && shown, Ordering::SeqCst);
        }
        let done = self
            .sending
            .as_ref()
            .is_some_and(|s| s.thread.is_finished());
        if let Some(s) = self.sending.take_if(|_| done) {
            match s.thread.join() {
                Ok(Some(group_epoch)) => {
                    self.sent = Some(s.m.clone());
                    // Served here again only under the group that ended
                    // the copy: as its primary, or, when the copy took the
                    // lead, its last backup.
                    if s.copy || s.m.leads {
                        self.floors.insert(s.m.shard, group_epoch);
                    }
                }
                Ok(None) => {}
                // Not sent again into a target this process cannot vouch
                // for: the move stays until its source or target leaves.
                Err(_) => {
                    tracing::error!(shard = s.m.shard, "the move's thread panicked");
                    self.sent = Some(s.m.clone());
                }
            }
            if s.copy && s.flags.froze.load(Ordering::SeqCst) {
                // Started again (thawed) under the epoch the map gives.
                if let Some(server) = take(&s.server) {
                    server.shutdown();
                }
            }
            // A move dropped in its first passes: the server goes on.
            self.serve_on(s.m.shard, &s.server);
        }
        self.levelling_ended();
        if let Some(map) = self.map.take() {
            self.level_next(&map, held());
            self.map = Some(map);
        }
        let retry = self.retry_at.is_none_or(|t| Instant::now() >= t);
        if !self.out && (done || (retry && held() && self.behind())) {
            match self.map.clone() {
                Some(map) => self.follow(&map, held),
                None => self.show_served(),
            }
        }
        let served = self.served_here();
        if let Some(regions) = self.regions.as_mut() {
            if let Err(why) = regions.record_pending(|shard| served.contains(&shard)) {
                tracing::warn!("cannot record in etcd that a region is made (tried again): {why}");
            }
        }
    }

    fn config_of(&self, shard: u32) -> Result<ServerConfig, ServerError> {
        let mut config = self.template.clone();
        config.address =
            shard_address(&self.template.address, shard).map_err(ServerError::Config)?;
        config.region_file = self.template.region_file.as_ref().map(|f| {
            let mut name = f.as_os_str().to_owned();
            name.push(format!(".shard-{shard}"));
            PathBuf::from(name)
        });
        // The member's one endpoint shows every shard (see `new`).
        config.metrics_listen = None;
        if self.replicated {
            config.lease = self.lease.as_ref().map(|l| l.pinned());
        }
        Ok(config)
    }

    /// Stops serving every shard (the member's lease is gone, or it
    /// leaves), a shard being sent included: its move goes on with nobody
    /// serving it.
    pub fn stop_all(&mut self) {
        if let Some(run) = &self.levelling {
            run.quit.store(true, Ordering::SeqCst);
        }
        for (shard, served) in std::mem::take(&mut self.serving) {
            tracing::info!(shard, "stopping");
            served.server.shutdown();
        }
        if let Some(s) = &self.sending {
            if let Some(server) = take(&s.server) {
                tracing::info!(shard = s.m.shard, "stopping");
                server.shutdown();
            }
        }
        self.show_served();
    }

    /// Stops everything, for a member out of the cluster (its lease
    /// lost): it serves again only by a map read after it joined again
    /// (`follow`). The last map it saw may be long gone (a failover
    /// dropped its copies meanwhile), and serving by it even for a moment
    /// would serve copies that miss writes, at the address a copy
    /// restoring them to this member is then sent to.
    pub fn leave(&mut self) {
        self.stop_all();
        self.out = true;
        if let Some(regions) = self.regions.as_mut() {
            regions.reread();
        }
    }

    /// A copy whose region is lost, or the first shard server that
    /// failed, and why.
    pub fn failure(&self) -> Option<String> {
        if let Some(why) = &self.lost {
            return Some(why.clone());
        }
        self.serving.iter().find_map(|(shard, s)| {
            s.server
                .failure()
                .map(|why| format!("shard {shard}: {why}"))
        })
    }

    /// Whether the cluster keeps several copies of each shard (its copies
    /// fail over, and its moves add copies or replace one).
    pub fn keeps_copies(&self) -> bool {
        self.replicated
    }

    /// The shards whose servers run here, a shard being sent included.
    fn served_here(&self) -> BTreeSet<u32> {
        let sending = self.sending.as_ref().map(|s| s.m.shard);
        self.serving.keys().copied().chain(sending).collect()
    }

    /// Whether a shard's server runs here.
    pub fn serves_any(&self) -> bool {
        !self.serving.is_empty()
    }

    /// Whether this member serves no shard and sends none: it may leave
    /// without making any shard unavailable.
    pub fn is_empty(&self) -> bool {
        let me = self.member.as_str();
        let in_map = self.map.as_ref().is_some_and(|map| {
            map.copies_of(me).next().is_some() || map.moving.as_ref().is_some_and(|m| m.to == me)
        });
        self.serving.is_empty() && self.sending.is_none() && !in_map
    }
}

impl Drop for ShardHost {
    fn drop(&mut self) {
        let served = self.served_here();
        if let Some(regions) = self.regions.as_mut() {
            regions.flush(|shard| served.contains(&shard), RECORD_FLUSH_WAIT);
        }
        self.stop_all();
        if let Some(s) = self.sending.take() {
            s.flags.quit.store(true, Ordering::SeqCst);
            let _ = s.thread.join();
        }
        if let Some(run) = self.levelling.take() {
            let _ = run.thread.join();
        }
    }
}

/// Readies a shard's region file before its server starts. A move's
/// target starts from nothing (whatever the file holds is from an earlier
/// ownership) unless the file was made for this very move (`NAME.move`
/// holds its secret): a target that restarts keeps a copy it received.
/// An owner's region is its own: the mark goes.
fn prepare_region(path: &std::path::Path, move_secret: Option<&str>) -> Result<(), ServerError> {
    let mut mark = path.as_os_str().to_owned();
    mark.push(".move");
    let mark = PathBuf::from(mark);
    let error = |e: std::io::Error| ServerError::Region {
        path: path.to_path_buf(),
        reason: format!("preparing it for a move: {e}"),
    };
    let Some(secret) = move_secret else {
        return match std::fs::remove_file(&mark) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(error(e)),
            _ => Ok(()),
        };
    };
    if std::fs::read_to_string(&mark).is_ok_and(|s| s == secret) {
        return Ok(());
    }
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(error(e)),
        _ => {}
    }
    std::fs::write(&mark, secret).map_err(error)
}

/// Takes the server out of a move's hands, if it still serves.
fn take(server: &Mutex<Option<Server>>) -> Option<Server> {
    server.lock().unwrap_or_else(|e| e.into_inner()).take()
}

/// The source's whole move: copy (stopping the shard's server before the
/// last pass, if its flags still say so, unless it is a copy), then make
/// the target the owner, or a backup; or, if the copy failed or was called
/// off, drop the move (the source serves the shard again). A source with
/// no server for the shard drops it at once (see the module's comment).
/// The end is told to the map until it is, or until `quit`: the shard's
/// group epoch in the map that ends it, or none when it is not told.
fn move_shard(
    mut shard: MovingShard<'_>,
    out: &Outgoing,
    url: &ClusterUrl,
    m: &ShardMove,
) -> Option<u64> {
    let serving = shard
        .server
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .is_some();
    let copied = if serving {
        target_address(url, m).and_then(|to| {
            // A copy that panics is dropped like one that fails: the map
            // must not keep a move that nobody sends.
            let send = std::panic::AssertUnwindSafe(|| shard_move::send(out, &to, &mut shard));
            std::panic::catch_unwind(send).unwrap_or_else(|_| Err("the copy panicked".into()))
        })
    } else {
        Err("this server does not serve the shard (it restarted)".into())
    };
    if let Err(e) = &copied {
        tracing::error!(shard = m.shard, "move to {} failed: {e}", m.to);
    }
    loop {
        match finish_move(url, m, copied.is_ok(), shard.copy) {
            Ok((true, group_epoch)) if shard.copy => {
                tracing::info!(shard = m.shard, group_epoch, "copied to {}", m.to);
                return Some(group_epoch);
            }
            Ok((true, group_epoch)) if m.leads => {
                // The region stays: this member's copy, a backup now.
                tracing::info!(
                    shard = m.shard,
                    group_epoch,
                    "copied to {}, which leads",
                    m.to
                );
                return Some(group_epoch);
            }
            Ok((true, group_epoch)) => {
                tracing::info!(shard = m.shard, "moved to {}", m.to);
                // Nobody reads it here any more: its clients were revoked.
                if let Err(e) = std::fs::remove_file(&out.region) {
                    tracing::warn!(shard = m.shard, "removing the moved region: {e}");
                }
                return Some(group_epoch);
            }
            Ok((false, group_epoch)) => {
                tracing::warn!(
                    shard = m.shard,
                    "the move was dropped; serving the shard again"
                );
                return Some(group_epoch);
            }
            Err(e) if shard.flags.quit.load(Ordering::SeqCst) => {
                tracing::warn!(shard = m.shard, "the move's end is not in the map: {e}");
                return None;
            }
            Err(e) => {
                tracing::warn!(shard = m.shard, "ending the move in the map: {e}");
                std::thread::sleep(Duration::from_secs(1));
            }
        }
    }
}

/// The shard a move sends, as its copy sees it.
struct MovingShard<'a> {
    server: &'a Mutex<Option<Server>>,
    flags: &'a MoveFlags,
    /// A replicated cluster's copy that leaves the lead where it is: the
    /// server goes on serving.
    copy: bool,
}

/// Longest a move waits for the shard's index to freeze.
const FREEZE_LIMIT: Duration = Duration::from_secs(60);

impl shard_move::Source for MovingShard<'_> {
    fn go_on(&self) -> bool {
        self.flags.go_on()
    }

    fn freeze(&mut self) -> Result<(), String> {
        self.flags.froze.store(true, Ordering::SeqCst);
        // Waited for without the lock: `stop_all` must not wait on it.
        let asked = self
            .server
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(Server::hand_over);
        asked
            .ok_or("the shard's server has stopped")?
            .wait(FREEZE_LIMIT)
    }

    fn stop_serving(&mut self) {
        if self.copy {
            return;
        }
        if let Some(server) = take(self.server) {
            server.shutdown();
        }
    }
}

/// Where the target serves the shard: from its member record.
fn target_address(url: &ClusterUrl, m: &ShardMove) -> Result<Address, String> {
    let mut etcd = BlockingEtcd::connect(url).map_err(|e| e.to_string())?;
    let state = etcd.state().map_err(|e| e.to_string())?;
    let member = state
        .member(&m.to)
        .ok_or_else(|| format!("the target {} is not a live member", m.to))?;
    let listen = Address::parse(&member.listen)?;
    shard_address(&listen, m.shard)
}

/// Publishes the end of move `m` on the map, if the map still shows it
/// (`ShardMap::ended_move`). Whether the target took it, and the shard's
/// group epoch in the map that ended the move.
///
/// Why a handover keeps the backups: the target holds exactly what the
/// source held when it stopped, every committed write and nothing else
/// (the last pass copied the frozen index, then the source stopped
/// serving, its readers' keys revoked, before this publishes). Each backup
/// holds, for every key, the last committed write or a set from a writer
/// never answered that landed after it (see kv-client's `replicated`):
/// what it holds beside any primary, so the group is as sound as before;
/// one still unlevelled after a failover stays so, and the target's member
/// levels it (see `level`). (A failover promotes a backup, whose
/// unanswered sets are not what the other backups hold: there the others
/// are unlevelled.) The new group epoch cuts off every writer that
/// observed the old primary.
fn finish_move(
    url: &ClusterUrl,
    m: &ShardMove,
    copied: bool,
    copy: bool,
) -> Result<(bool, u64), String> {
    let mut etcd = BlockingEtcd::connect(url).map_err(|e| e.to_string())?;
    let took = |map: &ShardMap| match copy {
        true => map.backups(m.shard).contains(&m.to),
        false => map.owner(m.shard) == Some(m.to.as_str()),
    };
    for _ in 0..100 {
        let state = etcd.state().map_err(|e| e.to_string())?;
        let Some((map, revision)) = state.map else {
            return Err("the map is gone".into());
        };
        if map.moving.as_ref() != Some(m) {
            // Published by an earlier try whose answer was lost; or
            // dropped meanwhile (its target left): the source keeps it.
            return Ok((copied && took(&map), map.group_epoch(m.shard)));
        }
        let next = map.ended_move(m, copied, copy);
        if etcd
            .publish_map(&next, Some((&map, revision)))
            .map_err(|e| e.to_string())?
        {
            return Ok((copied, next.group_epoch(m.shard)));
        }
    }
    Err("the map kept changing".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    impl ShardHost {
        /// A host of member m0 that has no etcd to check its regions with.
        fn unchecked(template: ServerConfig, url: ClusterUrl) -> ShardHost {
            let mut host =
                ShardHost::new(template, "m0".into(), url, MissingRegions::Refuse).expect("a host");
            host.regions = None;
            host
        }
    }

    fn scrape(at: std::net::SocketAddr) -> String {
        use std::io::{Read, Write};
        let mut http = std::net::TcpStream::connect(at).expect("the metrics endpoint");
        http.write_all(b"GET /metrics HTTP/1.0\r\n\r\n")
            .expect("ask");
        let mut reply = String::new();
        http.read_to_string(&mut reply).expect("the figures");
        reply
    }

    fn map(moving: Option<ShardMove>) -> ShardMap {
        ShardMap {
            group_epochs: Vec::new(),
            unlevelled: Vec::new(),
            lead_epochs: Vec::new(),
            epoch: 1 + u64::from(moving.is_some()),
            owners: vec![Some("m0".into()), Some("m0".into())],
            backups: Vec::new(),
            moving,
        }
    }

    /// A shard that cannot start is tried again at each follow, and its
    /// error logged once (again only when it changes).
    #[test]
    fn a_shard_that_cannot_start_is_logged_once() {
        #[derive(Clone, Default)]
        struct Log(Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Log {
            fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
                self.0
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .extend_from_slice(bytes);
                Ok(bytes.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let log = Log::default();
        let writer = log.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_max_level(tracing::Level::INFO)
            .with_ansi(false)
            .finish();
        let dir = tempfile::tempdir().expect("a directory");
        // No such directory: the shards' region files cannot be made.
        let listen = format!("shm://{}/gone/m0", dir.path().display());
        let template = ServerConfig::new(Address::parse(&listen).expect("an address"));
        let url = ClusterUrl::parse("etcd://127.0.0.1:1/nowhere").expect("a url");
        tracing::subscriber::with_default(subscriber, || {
            let mut host = ShardHost::unchecked(template, url);
            for _ in 0..3 {
                host.follow(&map(None), || true);
            }
            assert!(host.serving.is_empty());
        });
        let text =
            String::from_utf8_lossy(&log.0.lock().unwrap_or_else(|e| e.into_inner())).to_string();
        for shard in ["shard=0", "shard=1"] {
            let lines = text
                .lines()
                .filter(|l| l.contains("cannot serve") && l.contains(shard));
            assert_eq!(lines.count(), 1, "{text}");
        }
    }

    /// A member out of the cluster (its lease lost) serves nothing by the
    /// last map it saw, however long it polls, until it follows a new one.
    #[test]
    fn a_host_that_left_serves_nothing_until_it_follows_a_map_again() {
        let dir = tempfile::tempdir().expect("a directory");
        let listen =
            Address::parse(&format!("shm://{}/m0", dir.path().display())).expect("an address");
        let url = ClusterUrl::parse("etcd://127.0.0.1:1/nowhere").expect("a url");
        let mut host = ShardHost::unchecked(ServerConfig::new(listen), url);
        host.follow(&map(None), || true);
        assert_eq!(host.serving.len(), 2);
        host.leave();
        assert!(host.serving.is_empty());
        // A drain under way still counts the shards the map gives it.
        assert!(!host.is_empty());
        host.retry_at = None;
        host.poll(|| true);
        assert!(host.serving.is_empty(), "served by the map it saw before");
        host.follow(&map(None), || true);
        assert_eq!(host.serving.len(), 2);
        host.stop_all();
    }

    /// A replicated shard handed over (its move sent) is not served again
    /// while the map followed still shows the handover: it would start
    /// from an empty region, under the old group.
    #[test]
    fn a_shard_handed_over_is_not_served_again_before_the_map_shows_it() {
        let dir = tempfile::tempdir().expect("a directory");
        let listen =
            Address::parse(&format!("shm://{}/m0", dir.path().display())).expect("an address");
        let url = ClusterUrl::parse("etcd://127.0.0.1:1/nowhere").expect("a url");
        let mut host = ShardHost::unchecked(ServerConfig::new(listen), url);
        host.replicated = true;
        let handover = ShardMove {
            shard: 1,
            to: "m2".into(),
            secret: "00".into(),
            replaces: Some("m0".into()),
            leads: false,
        };
        let mut before = map(None);
        before.backups = vec![vec!["m1".into()], vec!["m1".into()]];
        host.follow(&before, || true);
        let region = dir.path().join("m0.shard-1");
        assert!(host.serving.contains_key(&1) && region.exists());
        let shown = ShardMap {
            moving: Some(handover.clone()),
            ..before
        };
        // As the handover's end leaves it: stopped, its region removed.
        if let Some(served) = host.serving.remove(&1) {
            served.server.shutdown();
        }
        std::fs::remove_file(&region).expect("remove");
        host.sent = Some(handover);
        host.follow(&shown, || true);
        assert!(host.serving.contains_key(&0), "the other shard is served");
        assert!(!host.serving.contains_key(&1), "{:?}", host.failing);
        assert!(host.sending.is_none(), "not sent again");
        assert!(!region.exists(), "no region made");
    }

    /// The shard stays served while its move's copy runs (here it never
    /// gets going: no etcd answers where the target is), and so it stays
    /// on the member's metrics.
    #[test]
    fn a_shard_being_sent_stays_on_the_metrics_endpoint() {
        let dir = tempfile::tempdir().expect("a directory");
        let listen =
            Address::parse(&format!("shm://{}/m0", dir.path().display())).expect("an address");
        let mut template = ServerConfig::new(listen);
        template.metrics_listen = Some(([127, 0, 0, 1], 0).into());
        let url = ClusterUrl::parse("etcd://127.0.0.1:1/nowhere").expect("a url");
        let mut host = ShardHost::unchecked(template, url);
        let at = host.metrics_address().expect("metrics");
        host.follow(&map(None), || true);
        let shown = |reply: &str| reply.matches("onekv_clients_connected{shard=").count();
        assert_eq!(shown(&scrape(at)), 2);

        let moving = ShardMove {
            shard: 1,
            to: "m1".into(),
            secret: "00".into(),
            replaces: None,
            leads: false,
        };
        host.follow(&map(Some(moving)), || true);
        assert!(host.sending.is_some(), "the move is under way");
        let reply = scrape(at);
        assert_eq!(shown(&reply), 2, "{reply}");
        assert!(
            reply.contains("onekv_clients_connected{shard=\"1\"}"),
            "{reply}"
        );
    }
}
