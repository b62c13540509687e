//! The cluster's records in etcd: one consistent read of all of them, and
//! the writes that change them (each a transaction that checks what it
//! builds on). Only the v3 API that etcd 3.4 serves is used.

use std::collections::BTreeMap;
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, GetOptions, PutOptions, Txn, TxnOp, TxnOpResponse,
    WatchOptions, WatchStream,
};

pub use crate::records::ClusterState;
use crate::records::{decode, encode, ClusterConfig, MemberRecord, ShardMap};
use crate::url::ClusterUrl;
use crate::ClusterError;

/// The keys of one cluster.
#[derive(Clone, Debug)]
pub struct Keys {
    prefix: String,
    name: String,
}

impl Keys {
    pub fn new(name: &str) -> Keys {
        Keys {
            prefix: format!("/onekv/{name}/"),
            name: name.to_string(),
        }
    }
    pub fn prefix(&self) -> &str {
        &self.prefix
    }
    pub fn config(&self) -> String {
        format!("{}config", self.prefix)
    }
    pub fn members(&self) -> String {
        format!("{}members/", self.prefix)
    }
    pub fn member(&self, id: &str) -> String {
        format!("{}members/{id}", self.prefix)
    }
    pub fn map(&self) -> String {
        format!("{}map", self.prefix)
    }
    pub fn op_deadline(&self) -> String {
        format!("{}op_deadline_ms", self.prefix)
    }
    pub fn coordinator(&self) -> String {
        format!("{}coordinator", self.prefix)
    }
    /// Where member `id` made the region of its copy of `shard` (no lease:
    /// it outlives the member's absences; see `Etcd::regions_made_by`).
    /// Outside the cluster's prefix, which members and the coordinator
    /// read whole and watch: a member's key per copy would be read with
    /// the map at every change, and each one written would wake them all.
    pub fn region_made(&self, id: &str, shard: u32) -> String {
        format!("{}{shard}", self.regions_made_by(id))
    }

    /// The prefix of member `id`'s `region_made` keys.
    pub fn regions_made_by(&self, id: &str) -> String {
        format!("/onekv-regions/{}/{id}/", self.name)
    }

    /// What the record at `key` is, decoded from `value`.
    pub(crate) fn record(&self, key: &[u8], value: &[u8]) -> Result<Record, ClusterError> {
        Ok(if key == self.config().as_bytes() {
            Record::Config(decode("the cluster's config", value)?)
        } else if key == self.map().as_bytes() {
            Record::Map(decode("the shard map", value)?)
        } else if key.starts_with(self.members().as_bytes()) {
            Record::Member(decode("a member record", value)?)
        } else {
            Record::Other
        })
    }
}

/// One of a cluster's records in etcd.
pub(crate) enum Record {
    Config(ClusterConfig),
    Map(ShardMap),
    Member(MemberRecord),
    /// The coordinator's election, and keys of later versions.
    Other,
}

/// A map of as many shards as the cluster has, or none.
pub(crate) fn check_map(state: &ClusterState) -> Result<(), ClusterError> {
    match state.shard_map() {
        Some(m) if m.owners.len() != state.config.shards as usize => {
            Err(ClusterError::Damaged(format!(
                "the shard map has {} shards, the cluster {}",
                m.owners.len(),
                state.config.shards
            )))
        }
        Some(m) => m
            .check_groups(state.config.replicas)
            .map_err(|e| ClusterError::Damaged(format!("the shard map: {e}"))),
        None => Ok(()),
    }
}

/// How long one request to etcd may take before it is given up.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// How often a long watch's connection is pinged.
const WATCH_PING: Duration = Duration::from_secs(10);

/// A connection to the etcd that holds one cluster.
#[derive(Clone)]
pub struct Etcd {
    pub client: Client,
    pub keys: Keys,
    url: ClusterUrl,
}

fn etcd_error(url: &ClusterUrl) -> impl Fn(etcd_client::Error) -> ClusterError + '_ {
    move |e| ClusterError::Etcd(format!("{}: {e}", url))
}

impl Etcd {
    pub async fn connect(url: &ClusterUrl) -> Result<Etcd, ClusterError> {
        let options = ConnectOptions::new().with_timeout(REQUEST_TIMEOUT);
        Etcd::connect_with(url, options).await
    }

    /// A connection whose requests may wait as long as they need (a
    /// campaign is answered only once won).
    pub async fn connect_untimed(url: &ClusterUrl) -> Result<Etcd, ClusterError> {
        Etcd::connect_with(url, ConnectOptions::new()).await
    }

    /// A connection for a long watch, which the request timeout does not
    /// bound: pings find a connection gone silent or half-open (its stream
    /// then ends, and the watch is made again), and an etcd member cut off
    /// from its leader refuses the watch rather than holding it silent.
    /// Pings go only while the watch is open, and no more often than etcd
    /// allows by default (one per 5 s, `--grpc-keepalive-min-time`).
    pub async fn connect_watching(url: &ClusterUrl) -> Result<Etcd, ClusterError> {
        let options = ConnectOptions::new()
            .with_timeout(REQUEST_TIMEOUT)
            .with_keep_alive(WATCH_PING, REQUEST_TIMEOUT)
            .with_require_leader(true);
        Etcd::connect_with(url, options).await
    }

    pub fn url(&self) -> &ClusterUrl {
        &self.url
    }

    async fn connect_with(url: &ClusterUrl, options: ConnectOptions) -> Result<Etcd, ClusterError> {
        let options = options.with_connect_timeout(REQUEST_TIMEOUT);
        let client = Client::connect(&url.endpoints, Some(options))
            .await
            .map_err(etcd_error(url))?;
        Ok(Etcd {
            client,
            keys: Keys::new(&url.name),
            url: url.clone(),
        })
    }

    fn error(&self) -> impl Fn(etcd_client::Error) -> ClusterError + '_ {
        etcd_error(&self.url)
    }

    /// Records a new cluster, and the `--op-deadline-ms` its members must
    /// run if one is given; refused if a cluster of that name exists.
    pub async fn create(
        &mut self,
        config: &ClusterConfig,
        op_deadline_ms: Option<u64>,
    ) -> Result<(), ClusterError> {
        config.validate().map_err(ClusterError::Config)?;
        if op_deadline_ms == Some(0) {
            return Err(ClusterError::Config(
                "--op-deadline-ms 0: a deadline must be at least 1 ms".into(),
            ));
        }
        let key = self.keys.config();
        let mut puts = vec![TxnOp::put(key.clone(), encode(config), None)];
        if let Some(ms) = op_deadline_ms {
            puts.push(TxnOp::put(self.keys.op_deadline(), encode(&ms), None));
        }
        let txn = Txn::new()
            .when([Compare::create_revision(key, CompareOp::Equal, 0)])
            .and_then(puts);
        let reply = self.client.txn(txn).await.map_err(self.error())?;
        if reply.succeeded() {
            return Ok(());
        }
        Err(ClusterError::Exists(self.url.to_string()))
    }

    /// All of the cluster's records, read at one revision.
    pub async fn state(&mut self) -> Result<ClusterState, ClusterError> {
        let prefix = self.keys.prefix().to_string();
        let reply = self
            .client
            .get(prefix, Some(GetOptions::new().with_prefix()))
            .await
            .map_err(self.error())?;
        let revision = reply.header().map_or(0, |h| h.revision());
        let (mut config, mut map, mut members) = (None, None, Vec::new());
        for kv in reply.kvs() {
            match self.keys.record(kv.key(), kv.value())? {
                Record::Config(c) => config = Some(c),
                Record::Map(m) => map = Some((m, kv.mod_revision())),
                Record::Member(m) => members.push(m),
                Record::Other => {}
            }
        }
        let config = config.ok_or_else(|| ClusterError::NoSuchCluster(self.url.to_string()))?;
        config.validate().map_err(ClusterError::Damaged)?;
        let state = ClusterState {
            config,
            members,
            map,
            revision,
        };
        check_map(&state)?;
        Ok(state)
    }

    /// Changes under the cluster's prefix after `revision`, as they happen.
    pub async fn watch_from(&mut self, revision: i64) -> Result<WatchStream, ClusterError> {
        let prefix = self.keys.prefix().to_string();
        let options = WatchOptions::new()
            .with_prefix()
            .with_start_revision(revision + 1);
        self.client
            .watch(prefix, Some(options))
            .await
            .map_err(self.error())
    }

    /// Writes `map` if the map is still as last read (`based_on`: that map
    /// and its revision, or none when there was no map) and, for a
    /// coordinator, while `leader` (its election key) still exists. False
    /// when either changed: someone else's change won. Every map goes out
    /// through here, stamped with its leads (`ShardMap::stamp_leads`).
    pub async fn publish_map(
        &mut self,
        map: &ShardMap,
        based_on: Option<(&ShardMap, i64)>,
        leader: Option<&[u8]>,
    ) -> Result<bool, ClusterError> {
        let key = self.keys.map();
        let mut map = map.clone();
        map.stamp_leads(based_on.map(|(before, _)| before));
        let mut checks = vec![match based_on {
            Some((_, revision)) => Compare::mod_revision(key.clone(), CompareOp::Equal, revision),
            None => Compare::create_revision(key.clone(), CompareOp::Equal, 0),
        }];
        if let Some(leader) = leader {
            checks.push(Compare::version(leader.to_vec(), CompareOp::Greater, 0));
        }
        let txn = Txn::new()
            .when(checks)
            .and_then([TxnOp::put(key, encode(&map), None)]);
        let reply = self.client.txn(txn).await.map_err(self.error())?;
        Ok(reply.succeeded())
    }

    /// Rewrites this member's own record (on its lease).
    pub async fn update(&mut self, record: &MemberRecord, lease: i64) -> Result<(), ClusterError> {
        let key = self.keys.member(&record.id);
        let options = PutOptions::new().with_lease(lease);
        self.client
            .put(key, encode(record), Some(options))
            .await
            .map_err(self.error())?;
        Ok(())
    }

    /// Holds this member to the `--op-deadline-ms` the cluster's members
    /// run: the one recorded, or `own_ms`, recorded now if none is (by
    /// `cluster create`, or by an earlier member: the first to join sets
    /// it). Refused when another is recorded. Why one for all: a
    /// replicated write's lock keeps a margin of the primary's deadlines
    /// for CASes on the backups, each in flight for up to the backup's
    /// (see kv-client's `replicated`).
    pub async fn agree_op_deadline(&mut self, own_ms: u64) -> Result<(), ClusterError> {
        let key = self.keys.op_deadline();
        let txn = Txn::new()
            .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(key.clone(), encode(&own_ms), None)])
            .or_else([TxnOp::get(key, None)]);
        let reply = self.client.txn(txn).await.map_err(self.error())?;
        if reply.succeeded() {
            return Ok(());
        }
        let recorded = reply.op_responses().into_iter().find_map(|r| match r {
            TxnOpResponse::Get(got) => got.kvs().first().map(|kv| kv.value().to_vec()),
            _ => None,
        });
        // The compare and the get read one revision: a failed compare
        // means the key is there.
        let recorded = recorded.ok_or_else(|| {
            ClusterError::Etcd(format!("{}: etcd answered no op deadline record", self.url))
        })?;
        // Retrying cannot mend a bad record: an operator must.
        let recorded = self
            .decode_op_deadline(&recorded)
            .map_err(ClusterError::Refused)?;
        if recorded == own_ms {
            return Ok(());
        }
        Err(ClusterError::Refused(format!(
            "this server runs --op-deadline-ms {own_ms}, but the members of {} run {recorded}: \
             start it with --op-deadline-ms {recorded} (a replicated write's lock margins \
             assume that every member keeps one deadline)",
            self.url
        )))
    }

    /// The op deadline `record` holds; what is wrong with it and how to
    /// repair it, where it holds none (it does not decode, or is 0).
    fn decode_op_deadline(&self, record: &[u8]) -> Result<u64, String> {
        let why = match decode::<u64>("the op deadline record", record) {
            Ok(0) => "the op deadline record in etcd is 0".to_string(),
            Ok(ms) => return Ok(ms),
            Err(why) => why,
        };
        Err(format!(
            "{why}: put the members' deadline in milliseconds there \
             (etcdctl put {} 50)",
            self.keys.op_deadline()
        ))
    }

    /// The `--op-deadline-ms` the cluster's members run, as `cluster
    /// status` says it: the one recorded, none yet, or a damaged record
    /// (which members refuse to join under) and how to repair it.
    pub async fn describe_op_deadline(&mut self) -> Result<String, ClusterError> {
        let reply = self
            .client
            .get(self.keys.op_deadline(), None)
            .await
            .map_err(self.error())?;
        Ok(match reply.kvs().first() {
            None => "--op-deadline-ms: set by the first member to join".to_string(),
            Some(kv) => match self.decode_op_deadline(kv.value()) {
                Ok(ms) => format!("every member runs --op-deadline-ms {ms}"),
                Err(damage) => format!("servers refuse to join: {damage}"),
            },
        })
    }

    /// Where the servers of member `id` made the regions of its copies,
    /// by shard: the `--listen` address of the one that made each. A
    /// server of that name that later finds a region missing lost its data
    /// (it was started elsewhere, or its /dev/shm emptied) and must not
    /// serve an empty one in its place. One read for every shard: a member
    /// starting its copies asks once, not once per copy.
    pub async fn regions_made_by(
        &mut self,
        id: &str,
    ) -> Result<BTreeMap<u32, String>, ClusterError> {
        let prefix = self.keys.regions_made_by(id);
        let reply = self
            .client
            .get(prefix.clone(), Some(GetOptions::new().with_prefix()))
            .await
            .map_err(self.error())?;
        // A key that names no shard is none of this version's.
        Ok(reply
            .kvs()
            .iter()
            .filter_map(|kv| {
                let shard = kv.key().strip_prefix(prefix.as_bytes())?;
                let shard = std::str::from_utf8(shard).ok()?.parse().ok()?;
                Some((shard, String::from_utf8_lossy(kv.value()).into_owned()))
            })
            .collect())
    }

    /// Records that member `id`'s server at `listen` made the region of
    /// its copy of `shard` (see `regions_made_by`).
    pub async fn record_region_made(
        &mut self,
        id: &str,
        shard: u32,
        listen: &str,
    ) -> Result<(), ClusterError> {
        self.client
            .put(self.keys.region_made(id, shard), listen, None)
            .await
            .map_err(self.error())?;
        Ok(())
    }

    /// Puts a member's record on its lease, unless a record of that id
    /// exists: another server of the same name, or this one's previous
    /// incarnation, whose lease has not run out yet.
    pub async fn announce(
        &mut self,
        record: &MemberRecord,
        lease: i64,
    ) -> Result<(), ClusterError> {
        let key = self.keys.member(&record.id);
        let options = PutOptions::new().with_lease(lease);
        let txn = Txn::new()
            .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(key, encode(record), Some(options))]);
        let reply = self.client.txn(txn).await.map_err(self.error())?;
        if reply.succeeded() {
            return Ok(());
        }
        Err(ClusterError::Etcd(format!(
            "member {} is already in the cluster (another server of that name, or this one \
             before its old lease runs out)",
            record.id
        )))
    }
}

/// etcd from code that does not run an async runtime (the `kv` CLI, the
/// client library, `cluster create`): each call runs on a runtime of its
/// own thread.
pub struct BlockingEtcd {
    runtime: tokio::runtime::Runtime,
    etcd: Etcd,
}

impl BlockingEtcd {
    pub fn connect(url: &ClusterUrl) -> Result<BlockingEtcd, ClusterError> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| ClusterError::Etcd(format!("cannot start a runtime: {e}")))?;
        let etcd = runtime.block_on(Etcd::connect(url))?;
        Ok(BlockingEtcd { runtime, etcd })
    }

    pub fn create(
        &mut self,
        config: &ClusterConfig,
        op_deadline_ms: Option<u64>,
    ) -> Result<(), ClusterError> {
        self.runtime
            .block_on(self.etcd.create(config, op_deadline_ms))
    }

    pub fn describe_op_deadline(&mut self) -> Result<String, ClusterError> {
        self.runtime.block_on(self.etcd.describe_op_deadline())
    }

    pub fn state(&mut self) -> Result<ClusterState, ClusterError> {
        self.runtime.block_on(self.etcd.state())
    }

    pub fn publish_map(
        &mut self,
        map: &ShardMap,
        based_on: Option<(&ShardMap, i64)>,
    ) -> Result<bool, ClusterError> {
        self.runtime
            .block_on(self.etcd.publish_map(map, based_on, None))
    }

    pub fn regions_made_by(&mut self, id: &str) -> Result<BTreeMap<u32, String>, ClusterError> {
        self.runtime.block_on(self.etcd.regions_made_by(id))
    }

    pub fn record_region_made(
        &mut self,
        id: &str,
        shard: u32,
        listen: &str,
    ) -> Result<(), ClusterError> {
        self.runtime
            .block_on(self.etcd.record_region_made(id, shard, listen))
    }

    pub fn url(&self) -> &ClusterUrl {
        self.etcd.url()
    }
}
