//! A server's membership: its record on an etcd lease it keeps alive, the
//! cluster's state as it changes, and (when elected) the coordinator's
//! work. It runs on a thread of its own; the server hears of it by
//! [`MemberEvent`]s.
//!
//! **Fencing.** etcd lets a lease expire no sooner than `ttl` after it
//! received the last renewal, which was after that renewal was sent. The
//! member stops counting a lease as held `ttl − ttl/4` after sending the
//! last renewal that was acknowledged: from then on it starts nothing (no
//! shard, no move) and asks etcd how long the lease has left. If etcd says
//! it is gone, the member says [`MemberEvent::Fenced`] (the server stops
//! serving every shard) and joins again under a new lease: a new
//! incarnation. If etcd says it lives, the lease counts as held again.
//!
//! **While etcd cannot be reached**, the shards go on being served: the
//! data path never needs etcd, and stopping would make every etcd outage
//! an outage of the whole store. This is safe because nothing gives a
//! member's shards to another without that member: a move is copied and
//! ended by its source (`placement` keeps a dead member's shards with it).
//! So a member cut off from etcd — etcd down, or this member partitioned
//! from it — is still the only server of its shards; clients that connect
//! meanwhile cannot find it (its record has expired) and get
//! `ShardUnavailable`.
//!
//! **With replicas** that no longer holds: once a member's lease expires,
//! the coordinator fails its copies over to their other members
//! (`placement`). So a member of a replicated cluster stops serving its
//! copies as soon as its lease is unconfirmed (kv-server's `main`), at
//! least a quarter TTL before etcd could expire it, and serves them again
//! once etcd says the lease lives; a replicated cluster's copies thus
//! wait out an etcd outage. (Telling "etcd is down" from "this member is
//! cut off from it" would need the peers' word: not built.)

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use crate::etcd::{ClusterState, Etcd};
use crate::placement::{next_map_avoiding, random_secret, Members};
use crate::records::{MemberRecord, ShardMap, ShardMove};
use crate::url::ClusterUrl;
use crate::ClusterError;

/// What the server hears from its membership.
#[derive(Debug)]
pub enum MemberEvent {
    /// The record is in etcd under a new lease.
    Joined { incarnation: i64 },
    /// The cluster as of a revision (sent after `Joined` and on every
    /// change while joined).
    State(Box<ClusterState>),
    /// The lease is gone (etcd said so), or joining failed: serve
    /// nothing until the next `Joined`.
    Fenced { why: String },
    /// This member may not join as configured (`ClusterError::Refused`):
    /// the membership has ended.
    Refused { why: String },
}

/// Whether the lease is held, as an atomic the server reads.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(u8)]
enum Hold {
    /// Not joined, or the lease is gone.
    Lost,
    Held,
    /// No renewal acknowledged for the margin, and etcd not reached since.
    Unconfirmed,
}

#[derive(Default)]
struct HoldFlag(AtomicU8);

/// Until when the member counts its lease as held, as the servers of its
/// copies read it at each client's connect and read-lease renewal: they
/// refuse clients past it even before the member's own loop has stopped
/// them (it may lag, or the process may just have woken from a pause).
/// A copy's server reads it [`pinned`](LeaseDeadline::pinned) to the etcd
/// lease it started under: once that one is lost, a lease the member takes
/// when it joins again is not the copy's (the map may have failed it over
/// meanwhile, and only a restart under the new map serves it again).
#[derive(Clone, Debug, Default)]
pub struct LeaseDeadline {
    shared: Arc<DeadlineWords>,
    /// The incarnation this handle counts for; None: whichever is current.
    pinned: Option<u64>,
}

#[derive(Debug, Default)]
struct DeadlineWords {
    /// Nanoseconds since `deadline_base`; 0 while no lease is held.
    until: AtomicU64,
    /// Bumped each time a lease is lost (`clear`).
    incarnation: AtomicU64,
}

/// What [`LeaseDeadline`]s count from.
fn deadline_base() -> std::time::Instant {
    static BASE: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    *BASE.get_or_init(std::time::Instant::now)
}

impl LeaseDeadline {
    fn set(&self, until: Instant) {
        let nanos = until
            .into_std()
            .saturating_duration_since(deadline_base())
            .as_nanos();
        let nanos = u64::try_from(nanos).unwrap_or(u64::MAX);
        self.shared.until.store(nanos, Ordering::SeqCst);
    }

    /// The lease is lost: cleared first, so a reader that sees a later
    /// `set` also sees the new incarnation.
    fn clear(&self) {
        self.shared.until.store(0, Ordering::SeqCst);
        self.shared.incarnation.fetch_add(1, Ordering::SeqCst);
    }

    /// This deadline as it stands for the lease held now (or the next one,
    /// if none is): it passes for good once that lease is lost.
    pub fn pinned(&self) -> LeaseDeadline {
        LeaseDeadline {
            shared: Arc::clone(&self.shared),
            pinned: Some(self.shared.incarnation.load(Ordering::SeqCst)),
        }
    }

    /// Whether the lease may be lost by now (never held, or past the time
    /// it counts as held).
    pub fn passed(&self) -> bool {
        self.remaining().is_none()
    }

    /// How long the lease still counts as held; None once it may be lost.
    pub fn remaining(&self) -> Option<Duration> {
        // The deadline before the incarnation: a deadline set after a
        // loss is read with the incarnation that loss began.
        let until = self.shared.until.load(Ordering::SeqCst);
        let incarnation = self.shared.incarnation.load(Ordering::SeqCst);
        if self.pinned.is_some_and(|p| p != incarnation) {
            return None;
        }
        let now = deadline_base().elapsed().as_nanos();
        let left = u128::from(until).checked_sub(now)?;
        (left > 0).then(|| Duration::from_nanos(u64::try_from(left).unwrap_or(u64::MAX)))
    }
}

impl HoldFlag {
    fn set(&self, hold: Hold) {
        self.0.store(hold as u8, Ordering::SeqCst);
    }

    fn get(&self) -> Hold {
        match self.0.load(Ordering::SeqCst) {
            1 => Hold::Held,
            2 => Hold::Unconfirmed,
            _ => Hold::Lost,
        }
    }
}

/// A running membership; [`Membership::leave`] (or drop) ends it and
/// revokes its lease, so its record goes at once.
pub struct Membership {
    stop: watch::Sender<bool>,
    draining: watch::Sender<bool>,
    held: Arc<HoldFlag>,
    deadline: LeaseDeadline,
    thread: Option<JoinHandle<()>>,
}

/// Who joins and how long its lease lives.
#[derive(Clone, Debug)]
pub struct MemberSpec {
    pub id: String,
    pub listen: String,
    pub ttl: Duration,
    /// Its failure domain (`--zone`), if it names one.
    pub zone: Option<String>,
    /// Its `--op-deadline-ms`, which must be the cluster's.
    pub op_deadline_ms: u64,
}

impl Membership {
    pub fn join(
        url: ClusterUrl,
        spec: MemberSpec,
        events: Sender<MemberEvent>,
    ) -> Result<Membership, ClusterError> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| ClusterError::Etcd(format!("cannot start a runtime: {e}")))?;
        let (stop, stopped) = watch::channel(false);
        let (draining, drains) = watch::channel(false);
        let held = Arc::new(HoldFlag::default());
        let deadline = LeaseDeadline::default();
        let controls = Controls {
            stopped,
            drains,
            held: Arc::clone(&held),
            deadline: deadline.clone(),
        };
        let thread = std::thread::Builder::new()
            .name("kv-member".into())
            .spawn(move || runtime.block_on(run(url, spec, events, controls)))
            .map_err(|e| ClusterError::Etcd(format!("cannot start the member thread: {e}")))?;
        Ok(Membership {
            stop,
            draining,
            held,
            deadline,
            thread: Some(thread),
        })
    }

    /// Until when the lease counts as held, kept current (see
    /// [`LeaseDeadline`]).
    pub fn lease_deadline(&self) -> LeaseDeadline {
        self.deadline.clone()
    }

    /// Whether the lease is known to be held now: false from the moment
    /// it may be lost, so that work under way (starting shards) can stop.
    pub fn holds_lease(&self) -> bool {
        self.held.get() == Hold::Held
    }

    /// Whether the lease is gone (or was never had): true before
    /// [`MemberEvent::Fenced`] is sent, so that the server can stop
    /// serving without waiting for the event. Not while etcd cannot be
    /// reached (see the module's comment).
    pub fn lease_lost(&self) -> bool {
        self.held.get() == Hold::Lost
    }

    /// Marks this member as leaving: the coordinator moves its shards to
    /// the others.
    pub fn drain(&self) {
        let _ = self.draining.send(true);
    }

    pub fn leave(mut self) {
        self.end();
    }

    fn end(&mut self) {
        let _ = self.stop.send(true);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Membership {
    fn drop(&mut self) {
        self.end();
    }
}

/// Pause between incarnations when etcd cannot be reached.
const REJOIN_PAUSE: Duration = Duration::from_millis(500);
/// How often a failure to join that stays the same is logged again.
const FAILURE_RELOG: Duration = Duration::from_secs(30);

async fn run(
    url: ClusterUrl,
    spec: MemberSpec,
    events: Sender<MemberEvent>,
    mut controls: Controls,
) {
    // The last failure logged, and when: the same one is logged again only
    // now and then (the member tries again every REJOIN_PAUSE).
    let mut logged: Option<(String, Instant)> = None;
    loop {
        let result = incarnation(&url, &spec, &events, &mut controls).await;
        controls.held.set(Hold::Lost);
        controls.deadline.clear();
        let why = match result {
            Ok(()) => return,
            Err(ClusterError::Refused(why)) => {
                tracing::error!(member = %spec.id, "{why}");
                let _ = events.send(MemberEvent::Refused { why });
                return;
            }
            Err(e) => e.to_string(),
        };
        let repeated = logged
            .as_ref()
            .is_some_and(|(last, at)| *last == why && at.elapsed() < FAILURE_RELOG);
        if !repeated {
            tracing::warn!(member = %spec.id, "{why} (trying again every {REJOIN_PAUSE:?})");
            logged = Some((why.clone(), Instant::now()));
        }
        if events.send(MemberEvent::Fenced { why }).is_err() {
            return;
        }
        tokio::select! {
            _ = controls.stopped.changed() => return,
            () = tokio::time::sleep(REJOIN_PAUSE) => {}
        }
    }
}

/// One lease's life: Ok when told to stop, Err when the lease is gone or
/// could not be had.
async fn incarnation(
    url: &ClusterUrl,
    spec: &MemberSpec,
    events: &Sender<MemberEvent>,
    controls: &mut Controls,
) -> Result<(), ClusterError> {
    let mut etcd = Etcd::connect(url).await?;
    let state = etcd.state().await?;
    etcd.agree_op_deadline(spec.op_deadline_ms).await?;
    let ttl_secs = spec.ttl.as_secs().max(1) as i64;
    // etcd starts the lease's time after this: count from here.
    let asked = Instant::now();
    let grant = etcd
        .client
        .lease_grant(ttl_secs, None)
        .await
        .map_err(|e| ClusterError::Etcd(format!("{url}: lease: {e}")))?;
    let lease = grant.id();
    // The TTL etcd granted, which may differ from the one asked for.
    let ttl = Duration::from_secs(u64::try_from(grant.ttl()).unwrap_or(0));
    if ttl.is_zero() {
        return Err(ClusterError::LeaseLost(
            "etcd granted a lease of no time".into(),
        ));
    }
    let record = MemberRecord {
        id: spec.id.clone(),
        listen: spec.listen.clone(),
        incarnation: lease,
        draining: *controls.drains.borrow(),
        zone: spec.zone.clone(),
        replaces_copies: true,
    };
    etcd.announce(&record, lease).await?;
    let renewal = Renewal::start(&mut etcd, record, asked, ttl).await?;
    controls.held.set(Hold::Held);
    send(events, MemberEvent::Joined { incarnation: lease })?;
    tracing::info!(member = %spec.id, incarnation = lease, "joined {url}");
    let (states, watched) = watch::channel(state);
    let coordinator = tokio::spawn(coordinate(etcd.clone(), spec.id.clone(), lease, watched));
    let result = serve_lease(&mut etcd, renewal, &states, events, controls).await;
    coordinator.abort();
    if result.is_ok() {
        // Leaving on purpose: the record goes now, not a TTL later.
        let _ = etcd.client.lease_revoke(lease).await;
    }
    result
}

fn send(events: &Sender<MemberEvent>, event: MemberEvent) -> Result<(), ClusterError> {
    events
        .send(event)
        .map_err(|_| ClusterError::Etcd("the server stopped listening".into()))
}

/// What a membership and its server share: what the server asks (stop,
/// drain), and whether the lease is held.
struct Controls {
    stopped: watch::Receiver<bool>,
    drains: watch::Receiver<bool>,
    held: Arc<HoldFlag>,
    deadline: LeaseDeadline,
}

/// Keeping one lease alive with the member's record on it, and when the
/// lease must count as lost.
struct Renewal {
    record: MemberRecord,
    keeper: etcd_client::LeaseKeeper,
    acks: etcd_client::LeaseKeepAliveStream,
    /// Send times of the renewals not yet acknowledged, oldest first.
    unanswered: VecDeque<Instant>,
    /// The lease is held until then.
    held_until: Instant,
    ttl: Duration,
}

impl Renewal {
    /// Renews the lease `record` is on, asked for at `asked`.
    async fn start(
        etcd: &mut Etcd,
        record: MemberRecord,
        asked: Instant,
        ttl: Duration,
    ) -> Result<Renewal, ClusterError> {
        let (keeper, acks) = etcd
            .client
            .lease_keep_alive(record.incarnation)
            .await
            .map_err(|e| ClusterError::Etcd(format!("lease keep-alive: {e}")))?;
        Ok(Renewal {
            record,
            keeper,
            acks,
            unanswered: VecDeque::new(),
            held_until: asked + Self::margin(ttl),
            ttl,
        })
    }

    /// How long after a renewal was sent the lease still counts as held.
    fn margin(ttl: Duration) -> Duration {
        ttl - ttl / 4
    }

    /// A new keep-alive stream for the same lease (the last one ended:
    /// etcd restarted, or the connection broke).
    async fn reopen(&mut self, etcd: &mut Etcd) -> Result<(), ClusterError> {
        let (keeper, acks) = etcd
            .client
            .lease_keep_alive(self.record.incarnation)
            .await
            .map_err(|e| ClusterError::Etcd(format!("lease keep-alive: {e}")))?;
        (self.keeper, self.acks) = (keeper, acks);
        self.unanswered.clear();
        Ok(())
    }

    async fn renew(&mut self) {
        let sent = Instant::now();
        if self.keeper.keep_alive().await.is_ok() {
            self.unanswered.push_back(sent);
        }
    }

    fn acknowledged(&mut self, ttl_left: i64) -> Result<(), ClusterError> {
        let sent = self.unanswered.pop_front();
        if ttl_left <= 0 {
            return Err(ClusterError::LeaseLost(
                "etcd says the lease expired".into(),
            ));
        }
        if let Some(sent) = sent {
            self.held_until = self.held_until.max(sent + Self::margin(self.ttl));
        }
        Ok(())
    }
}

/// Once the lease may be lost: asks etcd how long it has left until etcd
/// answers. True when it lives (it counts as held again, its keep-alive
/// made anew), false when told to stop meanwhile, Err when it is gone.
async fn confirm(
    etcd: &mut Etcd,
    renewal: &mut Renewal,
    controls: &mut Controls,
) -> Result<bool, ClusterError> {
    let pause = renewal.ttl / 6;
    let mut said = false;
    loop {
        let sent = Instant::now();
        let ask = async {
            let reply = etcd
                .client
                .lease_time_to_live(renewal.record.incarnation, None)
                .await
                .map_err(|e| e.to_string())?;
            if reply.ttl() > 0 {
                renewal.reopen(etcd).await.map_err(|e| e.to_string())?;
            }
            Ok::<i64, String>(reply.ttl())
        };
        tokio::select! {
            biased;
            _ = controls.stopped.changed() => return Ok(false),
            answer = tokio::time::timeout(pause, ask) => match answer.map_err(|e| e.to_string()).and_then(|a| a) {
                Ok(left) if left > 0 => {
                    // It lasts at least `left` (whole seconds, rounded
                    // down) from etcd's answer, which came after `sent`.
                    let left = Duration::from_secs(left.unsigned_abs()).min(renewal.ttl);
                    renewal.held_until = sent + Renewal::margin(left);
                    tracing::info!(member = %renewal.record.id, "etcd reached again: the lease is held");
                    return Ok(true);
                }
                Ok(_) => {
                    return Err(ClusterError::LeaseLost("etcd says the lease expired".into()))
                }
                Err(e) if !said => {
                    tracing::warn!(
                        member = %renewal.record.id,
                        "etcd cannot be reached ({e}): serving on, starting nothing"
                    );
                    said = true;
                }
                _ => {}
            }
        }
        tokio::select! {
            _ = controls.stopped.changed() => return Ok(false),
            () = tokio::time::sleep_until(sent + pause) => {}
        }
    }
}

/// Holds the lease and follows the cluster until told to stop (Ok) or the
/// lease is gone (Err). Whenever the lease may be lost, that comes first
/// (see [`confirm`]); every other call to etcd is cut off at `held_until`,
/// so neither a stalled etcd nor other work can delay it.
async fn serve_lease(
    etcd: &mut Etcd,
    mut renewal: Renewal,
    states: &watch::Sender<ClusterState>,
    events: &Sender<MemberEvent>,
    controls: &mut Controls,
) -> Result<(), ClusterError> {
    let mut revision = states.borrow().revision;
    send(
        events,
        MemberEvent::State(Box::new(states.borrow().clone())),
    )?;
    let pause = renewal.ttl / 6;
    let mut tick = tokio::time::interval(pause);
    let mut changes = None;
    // The state must be read again (and the watch made) at `retry_at`.
    let (mut stale, mut retry_at) = (true, Instant::now());
    let mut acks_open = true;
    loop {
        controls.deadline.set(renewal.held_until);
        if Instant::now() >= renewal.held_until {
            controls.held.set(Hold::Unconfirmed);
            if !confirm(etcd, &mut renewal, controls).await? {
                return Ok(());
            }
            controls.held.set(Hold::Held);
            controls.deadline.set(renewal.held_until);
            acks_open = true;
            // The watch may have broken meanwhile: read the state again.
            (stale, retry_at) = (true, Instant::now());
            continue;
        }
        tokio::select! {
            biased;
            () = tokio::time::sleep_until(renewal.held_until) => continue,
            _ = controls.stopped.changed() => return Ok(()),
            _ = controls.drains.changed(), if !renewal.record.draining => {
                renewal.record.draining = true;
                let lease = renewal.record.incarnation;
                let update = etcd.update(&renewal.record, lease);
                if !matches!(tokio::time::timeout_at(renewal.held_until, update).await, Ok(Ok(()))) {
                    // Written at the server's next ask.
                    renewal.record.draining = false;
                }
            }
            _ = tick.tick() => {
                if !acks_open {
                    let reopen = tokio::time::timeout_at(renewal.held_until, renewal.reopen(etcd));
                    acks_open = matches!(reopen.await, Ok(Ok(())));
                }
                let _ = tokio::time::timeout_at(renewal.held_until, renewal.renew()).await;
            }
            ack = renewal.acks.message(), if acks_open => match ack {
                Ok(Some(reply)) => renewal.acknowledged(reply.ttl())?,
                // No more acknowledgements on this stream: made anew at
                // the next tick.
                Ok(None) | Err(_) => acks_open = false,
            },
            open = next_change(&mut changes), if changes.is_some() => {
                if !open {
                    changes = None;
                }
                (stale, retry_at) = (true, Instant::now());
            }
            () = tokio::time::sleep_until(retry_at), if stale => {
                let read = tokio::time::timeout_at(renewal.held_until, etcd.state()).await;
                let Ok(Ok(state)) = read else {
                    retry_at = Instant::now() + pause;
                    continue;
                };
                if state.revision != revision {
                    revision = state.revision;
                    send(events, MemberEvent::State(Box::new(state.clone())))?;
                    let _ = states.send(state);
                }
                stale = false;
                if changes.is_none() {
                    let watch = tokio::time::timeout_at(renewal.held_until, etcd.watch_from(revision));
                    changes = watch.await.ok().and_then(Result::ok);
                    (stale, retry_at) = (changes.is_none(), Instant::now() + pause);
                }
            }
        }
    }
}

/// Waits for a change under the prefix: true; false when the watch is gone
/// (etcd away, or compacted past it) and must be made again. Messages
/// without events (the watch's creation, progress) are skipped.
async fn next_change(changes: &mut Option<etcd_client::WatchStream>) -> bool {
    let Some(stream) = changes.as_mut() else {
        return false;
    };
    loop {
        match stream.message().await {
            Ok(Some(reply)) if reply.canceled() => return false,
            Ok(Some(reply)) if reply.events().is_empty() => continue,
            Ok(Some(_)) => return true,
            Ok(None) | Err(_) => return false,
        }
    }
}

/// Waits to be elected coordinator; its election key. etcd answers a
/// campaign only once the candidate is elected, so it is made on a
/// connection without a request timeout, and made again if it fails.
async fn campaign(etcd: &Etcd, id: &str, lease: i64) -> Vec<u8> {
    loop {
        match Etcd::connect_untimed(etcd.url()).await {
            Ok(mut candidate) => {
                let election = candidate.keys.coordinator();
                match candidate.client.campaign(election, id, lease).await {
                    Ok(reply) => {
                        if let Some(leader) = reply.leader() {
                            return leader.key().to_vec();
                        }
                    }
                    Err(e) => tracing::debug!("campaign for coordinator: {e}"),
                }
            }
            Err(e) => tracing::debug!("campaign for coordinator: {e}"),
        }
        tokio::time::sleep(REJOIN_PAUSE).await;
    }
}

/// Campaigns to be the coordinator; once elected, keeps the map complete
/// as the cluster changes. Every map it writes is checked against the map
/// it read and its own election key, so a coordinator that lost its lease
/// (or a second one) cannot overwrite a newer map.
async fn coordinate(
    mut etcd: Etcd,
    id: String,
    lease: i64,
    mut states: watch::Receiver<ClusterState>,
) {
    let leader = campaign(&etcd, &id, lease).await;
    tracing::info!(member = %id, "coordinating");
    let mut failed = FailedMoves::default();
    loop {
        // Read afresh: the copy watched may predate the election, and so
        // list members whose leases (and election keys) ran out since.
        states.borrow_and_update();
        let state = match etcd.state().await {
            Ok(state) => state,
            Err(e) => {
                tracing::warn!("reading the cluster: {e}");
                tokio::time::sleep(REJOIN_PAUSE).await;
                continue;
            }
        };
        let map = state.shard_map();
        failed.notice(&state);
        let (live, draining, held_back) =
            (state.live_zones(), state.draining_ids(), failed.pairs());
        let members = Members {
            live: &live,
            draining: &draining,
            held_back: &held_back,
        };
        let next = next_map_avoiding(&state.config, map, &members, random_secret);
        if let Some(next) = next.filter(|n| !failed.holds_back(n) && state.can_send(n)) {
            let based_on = state.map.as_ref().map(|(m, r)| (m, *r));
            match etcd.publish_map(&next, based_on, Some(&leader)).await {
                Ok(true) => tracing::info!(epoch = next.epoch, "published the shard map"),
                Ok(false) => tracing::info!("the shard map changed meanwhile"),
                Err(e) => tracing::warn!("publishing the shard map: {e}"),
            }
        }
        tokio::select! {
            changed = states.changed() => if changed.is_err() { return },
            () = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
}

/// Moves that ended with the shard still at its source alone (the copy
/// failed: a target too small, say), held back for a while so that a move that
/// cannot succeed does not stop its shard over and over. Not one dropped
/// because its source or target left: the copy did not fail, and the
/// member that comes back (or the shard's next primary) is sent one at
/// once.
#[derive(Default)]
struct FailedMoves {
    /// The move in the map last read.
    last: Option<(ShardMove, Option<String>)>,
    /// (shard, target) → until when it is not proposed again.
    held: Vec<((u32, String), Instant)>,
}

/// How long a failed move is not proposed again.
const FAILED_MOVE_PAUSE: Duration = Duration::from_secs(30);

impl FailedMoves {
    fn notice(&mut self, state: &ClusterState) {
        let map = state.shard_map();
        let live = |id: &str| state.member(id).is_some();
        let now = Instant::now();
        self.held.retain(|(_, until)| *until > now);
        let current = map.and_then(|m| m.moving.clone());
        if let (Some((m, source)), Some(map)) = (self.last.take(), map) {
            let ended = current.as_ref() != Some(&m);
            // A replicated cluster's copy that succeeded leaves the owner
            // too, with the target among the backups.
            let joined = map.backups(m.shard).contains(&m.to);
            let both_live = live(&m.to) && source.as_deref().is_some_and(live);
            let kept = map.owner(m.shard).map(str::to_string) == source;
            if ended && !joined && kept && both_live {
                self.held.push(((m.shard, m.to), now + FAILED_MOVE_PAUSE));
            }
        }
        self.last = current.map(|m| {
            let source = map.and_then(|map| map.owner(m.shard)).map(str::to_string);
            (m, source)
        });
    }

    /// The (shard, target) pairs held back now.
    fn pairs(&self) -> Vec<(u32, String)> {
        self.held.iter().map(|(pair, _)| pair.clone()).collect()
    }

    fn holds_back(&self, next: &ShardMap) -> bool {
        next.moving.as_ref().is_some_and(|m| {
            self.held
                .iter()
                .any(|((shard, to), _)| *shard == m.shard && *to == m.to)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ClusterConfig, MemberRecord, ShardMap, ShardMove};

    /// Members `ids`, and a map of one shard owned by "a", copying to "b"
    /// when `moving`.
    fn cluster(ids: &[&str], moving: bool) -> ClusterState {
        let record = |id: &&str| MemberRecord {
            id: id.to_string(),
            listen: format!("shm:///dev/shm/{id}"),
            incarnation: 1,
            draining: false,
            zone: None,
            replaces_copies: true,
        };
        let map = ShardMap {
            epoch: 1,
            owners: vec![Some("a".into())],
            backups: vec![vec!["c".into()]],
            moving: moving.then(|| ShardMove {
                shard: 0,
                to: "b".into(),
                secret: "00".into(),
                replaces: None,
                leads: false,
            }),
            group_epochs: Vec::new(),
            unlevelled: Vec::new(),
            lead_epochs: Vec::new(),
        };
        ClusterState {
            config: ClusterConfig {
                shards: 1,
                initial_members: 3,
                replicas: 3,
            },
            members: ids.iter().map(record).collect(),
            map: Some((map, 1)),
            revision: 1,
        }
    }

    /// A copy that failed with its source and target live is held back;
    /// one dropped because either left is not: the member that comes back
    /// is sent its copy at once.
    #[test]
    fn only_a_copy_that_failed_between_live_members_is_held_back() {
        for (left, held) in [
            (&["a", "b", "c"][..], true),
            (&["a", "c"], false),
            (&["b", "c"], false),
        ] {
            let mut failed = FailedMoves::default();
            failed.notice(&cluster(&["a", "b", "c"], true));
            failed.notice(&cluster(left, false));
            assert_eq!(
                failed.pairs() == [(0, "b".to_string())],
                held,
                "live: {left:?}"
            );
        }
    }

    #[test]
    fn a_pinned_deadline_passes_for_good_once_its_lease_is_lost() {
        let deadline = LeaseDeadline::default();
        let pinned = deadline.pinned();
        assert!(pinned.passed(), "no lease held yet");
        deadline.set(Instant::now() + Duration::from_secs(60));
        assert!(pinned
            .remaining()
            .is_some_and(|d| d > Duration::from_secs(50)));
        deadline.clear();
        assert!(pinned.passed() && deadline.passed());
        // The member joins again: its new lease is not the pinned one's.
        deadline.set(Instant::now() + Duration::from_secs(60));
        assert!(!deadline.passed(), "the member's own view follows it");
        assert!(pinned.passed(), "a copy started under the lost lease");
        assert!(
            !deadline.pinned().passed(),
            "a copy started under the new one"
        );
    }
}
