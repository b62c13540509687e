//! Where a [`crate::ClusterClient`] reads its cluster's members and shard
//! map: etcd itself (feature `etcd`), or the members, each of which hands
//! out the map it follows at its own address ([`Request::ClusterMap`]).
//! Reading from members needs no async runtime, gRPC or protoc, and keeps
//! working while etcd is down.
//!
//! A client also follows the map between its operations ([`MapWatch`]): a
//! thread, one for all of a process's clients of the cluster, watches
//! etcd (from the revision read, read whole after a compaction), or asks
//! the members again every [`MEMBERS_POLL`] (a member serves each channel
//! on a thread of its own, so a long-held ask per client would crowd the
//! members out). The newest state waits on a [`Board`] that the client
//! looks at, one atomic load, before each operation.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use kv_cluster::directory::{self, MemberView};
use kv_cluster::{ClusterSource, ClusterState};
use kv_common::protocol::{Request, Response, PROTOCOL_VERSION};
use kv_common::transport::{self, ConnectOptions, Cutoff};
use kv_common::Address;

use crate::{unexpected, Error, Result};

pub(crate) enum MapSource {
    /// Boxed: its runtime is large.
    #[cfg(feature = "etcd")]
    Etcd(Box<kv_cluster::etcd::BlockingEtcd>),
    Members(Members),
}

/// How often a client that reads the map from the members asks them again.
pub(crate) const MEMBERS_POLL: Duration = Duration::from_secs(1);

/// The members a client knows: those it was given, and those the map it
/// holds names.
#[derive(Clone)]
pub(crate) struct Members {
    seeds: Vec<Address>,
    known: Vec<Address>,
    /// Which of `known` answered last: asked first next time.
    last: usize,
    /// Those that did not answer at the last read: passed over when the
    /// follower takes turns.
    silent: Vec<Address>,
    /// The cluster's name, once a member said it.
    cluster: Option<String>,
    options: ConnectOptions,
}

impl MapSource {
    pub(crate) fn open(source: &ClusterSource, options: ConnectOptions) -> Result<MapSource> {
        match source {
            #[cfg(feature = "etcd")]
            ClusterSource::Etcd(url) => kv_cluster::etcd::BlockingEtcd::connect(url)
                .map(|etcd| MapSource::Etcd(Box::new(etcd)))
                .map_err(|e| Error::Cluster(e.to_string())),
            #[cfg(not(feature = "etcd"))]
            ClusterSource::Etcd(url) => Err(Error::InvalidAddress(format!(
                "{url}: this build reads no etcd (kv-client's feature `etcd`); \
                 name the cluster by its members: cluster+rdma://HOST:PORT[,HOST:PORT...]"
            ))),
            ClusterSource::Members(seeds) => Ok(MapSource::Members(Members {
                seeds: seeds.clone(),
                known: seeds.clone(),
                last: 0,
                silent: Vec::new(),
                cluster: None,
                options,
            })),
        }
    }

    /// What etcd records of the `--op-deadline-ms` every member runs, as
    /// `kv-server cluster status` says it (kv-cluster's
    /// `Etcd::describe_op_deadline`); None from the members, whose map
    /// says nothing of it.
    pub(crate) fn describe_op_deadline(&mut self) -> Result<Option<String>> {
        match self {
            #[cfg(feature = "etcd")]
            MapSource::Etcd(etcd) => etcd
                .describe_op_deadline()
                .map(Some)
                .map_err(|e| Error::Cluster(e.to_string())),
            MapSource::Members(_) => Ok(None),
        }
    }

    /// The cluster now, never older than `newest` (what the caller holds).
    pub(crate) fn read(&mut self, newest: Option<&ClusterState>) -> Result<ClusterState> {
        self.read_past(newest, None)
    }

    /// As [`Self::read`], after the server `failed` (a member's address)
    /// would not serve what `newest` says it owns. etcd is read as ever.
    /// Members are asked from `failed` on: a member drops a shard only once
    /// it has seen the map that moves it, so its own view shows where the
    /// shard went even while the member that answered last lags (its watch
    /// being made again after an etcd outage, say). A dead one is passed
    /// over, as in [`Self::read`].
    pub(crate) fn read_past(
        &mut self,
        newest: Option<&ClusterState>,
        failed: Option<&Address>,
    ) -> Result<ClusterState> {
        match self {
            #[cfg(feature = "etcd")]
            MapSource::Etcd(etcd) => etcd.state().map_err(|e| Error::Cluster(e.to_string())),
            MapSource::Members(members) => members.read(newest, failed),
        }
    }
}

/// The newest cluster state a follower has seen.
#[derive(Default)]
pub(crate) struct Board {
    /// Its revision: looked at before each operation, without the lock.
    revision: AtomicI64,
    /// The state, and when it came.
    newest: Mutex<Option<(ClusterState, Instant)>>,
    /// The clients' connections to copies of replicated shards, cut off
    /// when a newer state drops their copy from its group.
    copies: Mutex<Vec<CopyWatched>>,
}

/// A client's connection to member `member`'s copy of `shard`.
struct CopyWatched {
    shard: u32,
    member: String,
    /// The revision of the state the client routed by when it connected:
    /// only a newer one may drop the copy (a client that read the map
    /// itself can be ahead of the board).
    routed_by: i64,
    /// Gone with the client.
    cutoff: Weak<Cutoff>,
}

impl CopyWatched {
    /// Cuts the connection off if `state`, newer than the one it was made
    /// by, holds no such copy; whether it is still to be watched.
    fn cut_if_dropped(&self, state: &ClusterState) -> bool {
        let Some(cutoff) = self.cutoff.upgrade() else {
            return false;
        };
        let Some(map) = state
            .shard_map()
            .filter(|_| state.revision > self.routed_by)
        else {
            return true;
        };
        let held = map.owner(self.shard) == Some(self.member.as_str())
            || map.backups(self.shard).contains(&self.member);
        if !held {
            cutoff.cut(format!(
                "{} holds no copy of shard {} in map epoch {}",
                self.member, self.shard, map.epoch
            ));
        }
        held
    }
}

impl Board {
    fn offer(&self, state: &ClusterState) {
        let Ok(mut newest) = self.newest.lock() else {
            return;
        };
        if newest
            .as_ref()
            .is_none_or(|(n, _)| state.revision > n.revision)
        {
            *newest = Some((state.clone(), Instant::now()));
            self.revision.store(state.revision, Ordering::Release);
            drop(newest);
            self.cut_dropped(state);
        }
    }

    /// A cutoff for a client's connections to `member`'s copy of `shard`,
    /// made routing by the state of revision `routed_by`: cut once a newer
    /// state this board has or is offered drops that copy from the shard's
    /// group. A writer waiting for that copy (frozen, say, and failed
    /// over) then follows the map, rather than wait out its call.
    pub(crate) fn cutoff_for(&self, shard: u32, member: &str, routed_by: i64) -> Arc<Cutoff> {
        let cutoff = Arc::new(Cutoff::default());
        let watched = CopyWatched {
            shard,
            member: member.to_string(),
            routed_by,
            cutoff: Arc::downgrade(&cutoff),
        };
        // Held while the newest state is looked at: a state offered
        // meanwhile cuts after this, finding the copy watched.
        let mut copies = self.copies.lock().unwrap_or_else(|e| e.into_inner());
        copies.retain(|c| c.cutoff.strong_count() > 0);
        let newest = self.newest.lock().unwrap_or_else(|e| e.into_inner());
        if newest
            .as_ref()
            .is_none_or(|(s, _)| watched.cut_if_dropped(s))
        {
            copies.push(watched);
        }
        cutoff
    }

    fn cut_dropped(&self, state: &ClusterState) {
        let mut copies = self.copies.lock().unwrap_or_else(|e| e.into_inner());
        copies.retain(|c| c.cut_if_dropped(state));
    }

    /// The newest state and when it came, if it is newer than `revision`.
    pub(crate) fn newer_than(&self, revision: i64) -> Option<(ClusterState, Instant)> {
        if self.revision.load(Ordering::Acquire) <= revision {
            return None;
        }
        let newest = self.newest.lock().ok()?;
        newest
            .as_ref()
            .filter(|(s, _)| s.revision > revision)
            .cloned()
    }
}

/// A client's follower of the map: a thread that keeps a [`Board`]
/// current. The clients of one cluster in a process share it (a pool's, a
/// benchmark's threads): it stops once the last of them is dropped.
pub(crate) struct MapWatch {
    following: Arc<Following>,
}

struct Following {
    board: Arc<Board>,
    _follower: Follower,
}

/// The followers running in this process, by the address of their cluster.
static FOLLOWING: Mutex<Vec<(String, Weak<Following>)>> = Mutex::new(Vec::new());

/// Held only to be dropped: each stops its thread then.
enum Follower {
    #[cfg(feature = "etcd")]
    Etcd {
        _thread: kv_cluster::follow::Follower,
    },
    /// The thread sees its channel closed.
    Members { _stop: mpsc::Sender<()> },
}

impl MapWatch {
    /// Follows the cluster at `address` (which `source` reads), from `from`
    /// (read from it) on, unless a client of this process already does.
    pub(crate) fn start(
        address: &str,
        source: &MapSource,
        from: &ClusterState,
    ) -> Result<MapWatch> {
        let mut running = FOLLOWING.lock().unwrap_or_else(|e| e.into_inner());
        running.retain(|(_, f)| f.strong_count() > 0);
        if let Some(following) = running
            .iter()
            .find(|(a, _)| a == address)
            .and_then(|(_, f)| f.upgrade())
        {
            return Ok(MapWatch { following });
        }
        let following = Arc::new(Following::start(source, from)?);
        running.push((address.to_string(), Arc::downgrade(&following)));
        Ok(MapWatch { following })
    }

    pub(crate) fn board(&self) -> &Board {
        &self.following.board
    }
}

impl Following {
    fn start(source: &MapSource, from: &ClusterState) -> Result<Following> {
        let board = Arc::new(Board::default());
        let follower = match source {
            #[cfg(feature = "etcd")]
            MapSource::Etcd(etcd) => {
                let board = board.clone();
                let offer = move |state: &ClusterState| board.offer(state);
                kv_cluster::follow::Follower::start(etcd.url(), from.clone(), offer)
                    .map(|thread| Follower::Etcd { _thread: thread })
                    .map_err(|e| Error::Cluster(e.to_string()))?
            }
            MapSource::Members(members) => {
                let (stop, stopped) = mpsc::channel::<()>();
                let (mut members, board) = (members.clone(), board.clone());
                let mut newest = from.clone();
                std::thread::Builder::new()
                    .name("onekv-map".into())
                    .spawn(move || {
                        while let Err(RecvTimeoutError::Timeout) =
                            stopped.recv_timeout(MEMBERS_POLL)
                        {
                            // None answered: asked again at the next turn.
                            if let Ok(state) = members.read(Some(&newest), None) {
                                board.offer(&state);
                                newest = state;
                            }
                            members.take_turns();
                        }
                    })
                    .map_err(|e| Error::Cluster(format!("cannot start a thread: {e}")))?;
                Follower::Members { _stop: stop }
            }
        };
        Ok(Following {
            board,
            _follower: follower,
        })
    }
}

impl Members {
    /// Asks the known members in turn, from the last that answered, until
    /// one's view is at least as new as `newest`. If none is, `newest`
    /// stands: a member behind etcd would route to owners that have moved
    /// on. With `failed`, from that member on (see
    /// [`MapSource::read_past`]).
    fn read(
        &mut self,
        newest: Option<&ClusterState>,
        failed: Option<&Address>,
    ) -> Result<ClusterState> {
        let held = newest.map_or(i64::MIN, |s| s.revision);
        // The failed owner may be one this reader has not asked yet (the
        // map that names it came through the follower).
        if let Some(f) = failed.filter(|f| !self.known.contains(f)) {
            self.known.push(f.clone());
        }
        let first = failed
            .and_then(|f| self.known.iter().position(|a| a == f))
            .unwrap_or(self.last);
        self.silent.clear();
        let mut best: Option<(usize, ClusterState)> = None;
        let mut failures = Vec::new();
        for turn in 0..self.known.len() {
            let at = (first + turn) % self.known.len();
            let view = match ask(&self.known[at], &self.options) {
                Ok(view) => view,
                Err(e) => {
                    failures.push(format!("{}: {e}", self.known[at]));
                    self.silent.push(self.known[at].clone());
                    continue;
                }
            };
            // A stray address among the members given: passed over.
            match &self.cluster {
                Some(name) if *name != view.cluster => {
                    failures.push(format!(
                        "{} is a member of cluster {}, not of {name}",
                        self.known[at], view.cluster
                    ));
                    continue;
                }
                _ => self.cluster = Some(view.cluster.clone()),
            }
            let newer = best
                .as_ref()
                .is_none_or(|(_, b)| view.state.revision > b.revision);
            if newer {
                best = Some((at, view.state));
            }
            if best.as_ref().is_some_and(|(_, b)| b.revision >= held) {
                break;
            }
        }
        let Some((at, state)) = best else {
            return Err(Error::Cluster(format!(
                "no member answered: {}",
                failures.join("; ")
            )));
        };
        if let Some(newest) = newest.filter(|n| n.revision > state.revision) {
            return Ok(newest.clone());
        }
        let answered = self.known[at].clone();
        self.learn(&state);
        self.last = self.known.iter().position(|a| *a == answered).unwrap_or(0);
        Ok(state)
    }

    /// Starts the next read at the member after the one that answered
    /// last, passing over those that did not answer: a member that lags
    /// (its watch made again after an etcd outage, say) holds a follower
    /// back for one turn, not for good, and a dead one costs no connect
    /// timeout per turn.
    fn take_turns(&mut self) {
        let n = self.known.len().max(1);
        for _ in 0..n {
            self.last = (self.last + 1) % n;
            if self
                .known
                .get(self.last)
                .is_none_or(|a| !self.silent.contains(a))
            {
                return;
            }
        }
    }

    /// Asks, from now on, the members given and those `state` names.
    fn learn(&mut self, state: &ClusterState) {
        self.known = self.seeds.clone();
        for m in &state.members {
            if let Ok(address) = Address::parse(&m.listen) {
                if !self.known.contains(&address) {
                    self.known.push(address);
                }
            }
        }
    }
}

/// One member's view of the cluster, read over a control channel of its own.
fn ask(member: &Address, options: &ConnectOptions) -> Result<MemberView> {
    let mut conn = transport::connect(member, options)?;
    directory::assemble(|first| {
        let request = Request::ClusterMap {
            protocol_version: PROTOCOL_VERSION,
            first,
        };
        match conn.call(&request) {
            Ok(Response::ClusterMap(page)) => Ok(page),
            Ok(other) => Err(unexpected(other).to_string()),
            Err(e) => Err(e.to_string()),
        }
    })
    .map_err(Error::Cluster)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_cluster::records::ShardMap;
    use kv_cluster::ClusterConfig;

    fn nowhere() -> (MapSource, ClusterState) {
        let dir = std::env::temp_dir().join("onekv-no-such-member");
        let seeds = vec![Address::parse(&format!("shm://{}", dir.display())).expect("an address")];
        let source = MapSource::open(&ClusterSource::Members(seeds), ConnectOptions::default());
        let state = ClusterState {
            config: ClusterConfig {
                shards: 1,
                initial_members: 1,
                replicas: 1,
            },
            members: Vec::new(),
            map: None,
            revision: 1,
        };
        (source.expect("a source"), state)
    }

    /// Clients of one cluster share a follower while any of them lives;
    /// another cluster's clients have their own.
    #[test]
    fn clients_of_one_cluster_share_one_follower() {
        let (source, state) = nowhere();
        let a = MapWatch::start("cluster+shm:///a", &source, &state).expect("a watch");
        let b = MapWatch::start("cluster+shm:///a", &source, &state).expect("a watch");
        let other = MapWatch::start("cluster+shm:///b", &source, &state).expect("a watch");
        assert!(Arc::ptr_eq(&a.following, &b.following));
        assert!(!Arc::ptr_eq(&a.following, &other.following));
        let first = Arc::downgrade(&a.following);
        drop((a, b));
        assert_eq!(first.strong_count(), 0, "the follower outlived its clients");
        let again = MapWatch::start("cluster+shm:///a", &source, &state).expect("a watch");
        assert!(!Arc::ptr_eq(&again.following, &other.following));
    }

    /// A one-shard state of revision `revision` whose map gives the shard
    /// `owner` and `backups`.
    fn grouped(revision: i64, owner: &str, backups: &[&str]) -> ClusterState {
        let (_, mut state) = nowhere();
        state.revision = revision;
        let map = ShardMap {
            epoch: revision as u64,
            owners: vec![Some(owner.to_string())],
            backups: vec![backups.iter().map(|b| b.to_string()).collect()],
            moving: None,
            group_epochs: Vec::new(),
            unlevelled: Vec::new(),
            lead_epochs: Vec::new(),
        };
        state.map = Some((map, revision));
        state
    }

    /// A state that drops a copy from its group cuts the connections to
    /// it, and only those; one that has dropped it already when the
    /// connection is made cuts it at once.
    #[test]
    fn a_map_that_drops_a_copy_cuts_the_connections_to_it() {
        let board = Board::default();
        board.offer(&grouped(1, "m0", &["m1", "m2"]));
        let (primary, backup, kept) = (
            board.cutoff_for(0, "m0", 1),
            board.cutoff_for(0, "m1", 1),
            board.cutoff_for(0, "m2", 1),
        );
        // m1 replaced by m3; then m0 failed over to m2.
        board.offer(&grouped(2, "m0", &["m2", "m3"]));
        assert!(backup.error().is_some_and(|e| e.to_string().contains("m1")));
        assert!(primary.error().is_none() && kept.error().is_none());
        board.offer(&grouped(3, "m2", &["m3"]));
        assert!(primary.error().is_some() && kept.error().is_none());
        assert!(board.cutoff_for(0, "m1", 1).error().is_some());
        // An older state offered late changes nothing.
        let late = board.cutoff_for(0, "m3", 3);
        board.offer(&grouped(2, "m0", &["m1"]));
        assert!(late.error().is_none());
        // Nor does one older than the state the client routed by (read
        // by itself, ahead of the board): m4 was added at revision 5.
        let ahead = board.cutoff_for(0, "m4", 5);
        assert!(ahead.error().is_none());
        board.offer(&grouped(4, "m2", &["m3"]));
        assert!(ahead.error().is_none());
        board.offer(&grouped(6, "m2", &["m3"]));
        assert!(ahead.error().is_some());
        // Connections gone are forgotten.
        drop((primary, backup, kept, late, ahead));
        board.offer(&grouped(7, "m2", &[]));
        assert!(board.copies.lock().expect("copies").is_empty());
    }
}
