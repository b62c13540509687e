//! Which regions a cluster member has made, recorded in etcd per copy
//! (`kv_cluster::etcd::Keys::region_made`, with no lease: it outlives the
//! member's absences), so that a server of its name never serves an empty
//! region in place of one the member made and that is not there now: a
//! server started with another `--listen` (a typo, another host) or after
//! a reboot emptied /dev/shm. Serving one would answer "not found" for
//! every key the copy held.
//!
//! A copy's region is recorded once its server has started on it (made
//! or opened, by the map's deal or by a move), so a record always means a
//! region that existed: a server stopped before it made one (its first
//! start failed) is not refused later. What this leaves open: a copy
//! whose record could not be written (etcd unreachable at its first
//! start, and still at each try since) and whose region is then lost. A
//! record that could not be written is tried again every `RECORD_RETRY`
//! while the copy is served here (`record_pending`).
//!
//! In a cluster of several copies an empty region served in a lost one's
//! place passes for a copy level with the others: a failover could promote
//! it, or a levelling copy its emptiness over them. So there the server
//! stops, and started again once its copies have failed over (a lease
//! TTL), it rejoins empty and is given fresh copies by the others. Only
//! when no other copy holds the shard's data (every server lost its
//! regions, or none is left that may be promoted) does the operator
//! accept the loss, as with one copy (`--recreate-missing-regions`).

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kv_cluster::etcd::BlockingEtcd;
use kv_cluster::ClusterUrl;

/// What a member does about a copy's region it made and cannot find.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MissingRegions {
    /// Stop, saying where the region was made.
    Refuse,
    /// Serve the copy empty (`--recreate-missing-regions`).
    Recreate,
}

/// Why a copy may not start.
pub enum Refusal {
    /// Its region is lost: serving an empty one would lose its keys.
    Lost(String),
    /// etcd did not say whether the member made the region.
    Unchecked(String),
}

/// The shards a retry recorded, and how it ended.
type Retried = (Vec<u32>, Result<(), String>);

/// How often the records that could not be written are tried again.
const RECORD_RETRY: Duration = Duration::from_secs(5);

pub struct RegionsMade {
    url: ClusterUrl,
    member: String,
    listen: String,
    missing: MissingRegions,
    /// The shards whose records this process wrote.
    recorded: BTreeSet<u32>,
    /// The shards whose copies started here but whose records could not
    /// be written yet, and when to try again.
    pending: BTreeSet<u32>,
    next_try: Option<Instant>,
    /// A try of the pending records under way, on a thread of its own: a
    /// call to an etcd that does not answer waits out its timeouts, and
    /// the member's loop must go on meanwhile (to stop its copies in time
    /// when its lease goes unconfirmed). What it wrote, and how it ended.
    retry: Option<JoinHandle<Retried>>,
    etcd: Option<BlockingEtcd>,
}

impl RegionsMade {
    pub fn new(url: ClusterUrl, member: &str, listen: &str, missing: MissingRegions) -> Self {
        RegionsMade {
            url,
            member: member.to_string(),
            listen: listen.to_string(),
            missing,
            recorded: BTreeSet::new(),
            pending: BTreeSet::new(),
            next_try: None,
            retry: None,
            etcd: None,
        }
    }

    /// Before shard `shard`'s copy, one the map gave this member (not a
    /// move's), starts from its region at `path`: refused if the region is
    /// missing though the member made it.
    pub fn check(&mut self, shard: u32, path: &Path, replicated: bool) -> Result<(), Refusal> {
        if path.exists() {
            return Ok(());
        }
        let member = self.member.clone();
        let made_at = (self.etcd()).and_then(|etcd| {
            etcd.region_made_at(&member, shard)
                .map_err(|e| e.to_string())
        });
        let Some(at) = made_at.map_err(Refusal::Unchecked)? else {
            return Ok(());
        };
        if self.missing == MissingRegions::Recreate {
            tracing::warn!(
                shard,
                "serving an empty region in place of the missing {} (--recreate-missing-regions): \
                 what this copy held is gone",
                path.display()
            );
            return Ok(());
        }
        Err(Refusal::Lost(self.lost(shard, path, &at, replicated)))
    }

    /// Records that shard `shard`'s copy has its region here, now that its
    /// server started on it (once per process). One that fails is tried
    /// again by `record_pending`.
    pub fn record(&mut self, shard: u32) -> Result<(), String> {
        if self.recorded.contains(&shard) {
            return Ok(());
        }
        self.write_record(shard).inspect_err(|_| {
            self.pending.insert(shard);
            self.next_try = Some(Instant::now() + RECORD_RETRY);
        })
    }

    /// Tries again, at most once per `RECORD_RETRY` and on a thread of its
    /// own, to write the records that failed, of the copies still served
    /// here (`served`): a region lost later without its record would be
    /// served empty. Err: why the last try failed, once it ended.
    pub fn record_pending(&mut self, served: impl Fn(u32) -> bool) -> Result<(), String> {
        if let Some(ended) = self.retry.take_if(|r| r.is_finished()) {
            let (written, done) = ended
                .join()
                .unwrap_or_else(|_| (Vec::new(), Err("its thread panicked".into())));
            for shard in written {
                self.pending.remove(&shard);
                self.recorded.insert(shard);
            }
            done?;
        }
        self.pending.retain(|&shard| served(shard));
        let due = self.next_try.is_none_or(|t| Instant::now() >= t);
        if self.retry.is_some() || self.pending.is_empty() || !due {
            return Ok(());
        }
        self.next_try = Some(Instant::now() + RECORD_RETRY);
        let (url, member, listen) = (self.url.clone(), self.member.clone(), self.listen.clone());
        let shards: Vec<u32> = self.pending.iter().copied().collect();
        let retry = std::thread::Builder::new()
            .name("kv-region-record".into())
            .spawn(move || {
                let mut written = Vec::new();
                let done = BlockingEtcd::connect(&url)
                    .map_err(|e| e.to_string())
                    .and_then(|mut etcd| {
                        shards.iter().try_for_each(|&shard| {
                            write_record(&mut etcd, (&member, shard, &listen))?;
                            written.push(shard);
                            Ok(())
                        })
                    });
                (written, done)
            })
            .map_err(|e| format!("cannot start a thread: {e}"))?;
        self.retry = Some(retry);
        Ok(())
    }

    fn write_record(&mut self, shard: u32) -> Result<(), String> {
        let (member, listen) = (self.member.clone(), self.listen.clone());
        write_record(self.etcd()?, (&member, shard, &listen))?;
        self.recorded.insert(shard);
        Ok(())
    }

    fn lost(&self, shard: u32, path: &Path, at: &str, replicated: bool) -> String {
        let whence = match at == self.listen {
            true => "here (was /dev/shm emptied, by a reboot?)".to_string(),
            false => format!("at {at} (this server listens at {})", self.listen),
        };
        let remedy = match replicated {
            true => {
                "Start the server where its regions are; or, if they are gone for good, \
                 start it again once the cluster has failed its copies over (a lease TTL \
                 after it stopped): it rejoins empty and is given fresh copies. Only if no \
                 other server holds the shard's data, --recreate-missing-regions serves it \
                 empty"
            }
            false => {
                "Start the server where its regions are; or, if they are gone for good, \
                      with --recreate-missing-regions to serve its copies empty"
            }
        };
        format!(
            "shard {shard}'s region {} is missing, though member {} made it {whence}: an empty \
             one served in its place would lose every key the copy held. {remedy}",
            path.display(),
            self.member
        )
    }

    fn etcd(&mut self) -> Result<&mut BlockingEtcd, String> {
        let etcd = match self.etcd.take() {
            Some(etcd) => etcd,
            None => BlockingEtcd::connect(&self.url).map_err(|e| e.to_string())?,
        };
        Ok(self.etcd.insert(etcd))
    }
}

/// Records in etcd that `member` made shard `shard`'s region at `listen`.
fn write_record(
    etcd: &mut BlockingEtcd,
    (member, shard, listen): (&str, u32, &str),
) -> Result<(), String> {
    if record_fault() {
        return Err("ONEKV_REGION_RECORD_FAULT: a record not written".into());
    }
    etcd.record_region_made(member, shard, listen)
        .map_err(|e| e.to_string())
}

/// Test hook: the first N writes of a record (`ONEKV_REGION_RECORD_FAULT=N`)
/// fail, as when etcd does not answer.
fn record_fault() -> bool {
    static LEFT: std::sync::OnceLock<AtomicU64> = std::sync::OnceLock::new();
    let left = LEFT.get_or_init(|| {
        let n = std::env::var("ONEKV_REGION_RECORD_FAULT").ok();
        AtomicU64::new(n.and_then(|n| n.parse().ok()).unwrap_or(0))
    });
    left.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok()
}
