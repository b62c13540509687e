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
//! start, and still at each try since) and whose region is then lost by
//! another process of the member (this one knows what it made). A record
//! that could not be written is tried again every `RECORD_RETRY` while the
//! copy is served here (`record_pending`).
//!
//! The member's loop never waits here for etcd: its records are read in
//! one request, on a thread of their own, from the moment the member
//! starts (so they are known when its first map comes) and again each
//! time it joins the cluster anew (another server of its name may have
//! made regions meanwhile); and they are written on a thread of their
//! own. An etcd that does not answer costs a call its timeouts (seconds),
//! and the loop must go on meanwhile: to stop its copies in time when its
//! lease goes unconfirmed. A copy whose region is missing waits for the
//! read (`Refusal::Asking`).
//!
//! In a cluster of several copies an empty region served in a lost one's
//! place passes for a copy level with the others: a failover could promote
//! it, or a levelling copy its emptiness over them. So there the server
//! stops, and started again once its copies have failed over (a lease
//! TTL), it rejoins empty and is given fresh copies by the others. Only
//! when no other copy holds the shard's data (every server lost its
//! regions, or none is left that may be promoted) does the operator
//! accept the loss, as with one copy (`--recreate-missing-regions`).

use std::collections::{BTreeMap, BTreeSet};
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
    /// The member's records are being read: ask again in a moment.
    Asking,
}

/// What a read of the member's records gives: where each region was made,
/// by shard.
type Read = Result<BTreeMap<u32, String>, String>;

/// The member's records in etcd, as this process knows them.
enum Found {
    /// Being read, on a thread of its own.
    Reading(JoinHandle<Read>),
    Read(BTreeMap<u32, String>),
    /// The read failed: why, and when to read again.
    Failed(String, Instant),
}

/// The shards a retry recorded, and how it ended.
type Retried = (Vec<u32>, Result<(), String>);

/// How often the records that could not be written, or read, are tried
/// again.
const RECORD_RETRY: Duration = Duration::from_secs(5);

pub struct RegionsMade {
    url: ClusterUrl,
    member: String,
    listen: String,
    missing: MissingRegions,
    /// The member's records as etcd held them when it last joined. Later
    /// ones are this process's own: `recorded`, `pending`.
    found: Found,
    /// The shards whose records this process wrote.
    recorded: BTreeSet<u32>,
    /// The shards whose copies started here but whose records are not
    /// written yet, and when to try again after a try that failed.
    pending: BTreeSet<u32>,
    next_try: Option<Instant>,
    /// A write of the pending records under way, on a thread of its own
    /// (see the module's doc): what it wrote, and how it ended.
    retry: Option<JoinHandle<Retried>>,
}

impl RegionsMade {
    /// Starts reading the member's records.
    pub fn new(url: ClusterUrl, member: &str, listen: &str, missing: MissingRegions) -> Self {
        let found = read_records(&url, member);
        RegionsMade {
            url,
            member: member.to_string(),
            listen: listen.to_string(),
            missing,
            found,
            recorded: BTreeSet::new(),
            pending: BTreeSet::new(),
            next_try: None,
            retry: None,
        }
    }

    /// Before shard `shard`'s copy, one the map gave this member (not a
    /// move's), starts from its region at `path`: refused if the region is
    /// missing though the member made it.
    pub fn check(&mut self, shard: u32, path: &Path, replicated: bool) -> Result<(), Refusal> {
        if path.exists() {
            return Ok(());
        }
        let Some(at) = self.made_at(shard)? else {
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

    /// Where the member made shard `shard`'s region, if it did: made by
    /// this process, or recorded before it last joined. A read that failed
    /// is not tried again for `RECORD_RETRY` (a map of many copies would
    /// otherwise wait out etcd's timeouts for each).
    fn made_at(&mut self, shard: u32) -> Result<Option<String>, Refusal> {
        if self.recorded.contains(&shard) || self.pending.contains(&shard) {
            return Ok(Some(self.listen.clone()));
        }
        let ended = matches!(&self.found, Found::Reading(read) if read.is_finished());
        if ended {
            let unknown = Found::Failed(String::new(), Instant::now());
            if let Found::Reading(read) = std::mem::replace(&mut self.found, unknown) {
                self.found = match read.join() {
                    Ok(Ok(found)) => Found::Read(found),
                    Ok(Err(why)) => Found::Failed(why, Instant::now() + RECORD_RETRY),
                    Err(_) => Found::Failed("its thread panicked".into(), Instant::now()),
                };
            }
        }
        match &self.found {
            Found::Read(found) => Ok(found.get(&shard).cloned()),
            Found::Reading(_) => Err(Refusal::Asking),
            Found::Failed(why, until) if Instant::now() < *until => Err(Refusal::Unchecked(
                format!("{why} (asked again within {RECORD_RETRY:?})"),
            )),
            Found::Failed(..) => {
                self.reread();
                Err(Refusal::Asking)
            }
        }
    }

    /// Reads the member's records again, as it joins the cluster anew:
    /// while it was out, another server of its name may have made
    /// regions.
    pub fn reread(&mut self) {
        self.found = read_records(&self.url, &self.member);
    }

    /// Records that shard `shard`'s copy has its region here, now that its
    /// server started on it (once per process), by `record_pending`'s
    /// next turn.
    pub fn record(&mut self, shard: u32) {
        if !self.recorded.contains(&shard) && self.pending.insert(shard) {
            self.next_try = None;
        }
    }

    /// Writes, on a thread of its own, the records of the copies still
    /// served here (`served`) that are not written yet; after a try that
    /// failed, at most once per `RECORD_RETRY`: a region lost later
    /// without its record would be served empty by another process of
    /// the member. Err: why the last try failed, once it ended.
    pub fn record_pending(&mut self, served: impl Fn(u32) -> bool) -> Result<(), String> {
        if let Some(ended) = self.retry.take_if(|r| r.is_finished()) {
            let (written, done) = ended
                .join()
                .unwrap_or_else(|_| (Vec::new(), Err("its thread panicked".into())));
            for shard in written {
                self.pending.remove(&shard);
                self.recorded.insert(shard);
            }
            if let Err(why) = done {
                self.next_try = Some(Instant::now() + RECORD_RETRY);
                return Err(why);
            }
        }
        self.pending.retain(|&shard| served(shard));
        let due = self.next_try.is_none_or(|t| Instant::now() >= t);
        if self.retry.is_some() || self.pending.is_empty() || !due {
            return Ok(());
        }
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

    /// Writes the records not written yet, of the copies `served`, as the
    /// member stops: waiting at most `wait` for etcd. Its next server
    /// relies on them should the regions be lost meanwhile.
    pub fn flush(&mut self, served: impl Fn(u32) -> bool, wait: Duration) {
        let deadline = Instant::now() + wait;
        self.pending.retain(|&shard| served(shard));
        loop {
            // Each try at once, not after RECORD_RETRY.
            self.next_try = None;
            let tried = self.record_pending(|_| true);
            if self.pending.is_empty() && self.retry.is_none() {
                return;
            }
            if Instant::now() >= deadline {
                let why = tried.err().unwrap_or_else(|| "etcd did not answer".into());
                return tracing::warn!(
                    shards = ?self.pending,
                    "stopping without recording in etcd that these regions are made: {why}"
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
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
}

/// Starts reading `member`'s records, on a thread of its own.
fn read_records(url: &ClusterUrl, member: &str) -> Found {
    let (url, member) = (url.clone(), member.to_string());
    let read = std::thread::Builder::new()
        .name("kv-region-read".into())
        .spawn(move || {
            BlockingEtcd::connect(&url)
                .and_then(|mut etcd| etcd.regions_made_by(&member))
                .map_err(|e| e.to_string())
        });
    match read {
        Ok(read) => Found::Reading(read),
        Err(e) => Found::Failed(format!("cannot start a thread: {e}"), Instant::now()),
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;
    use std::sync::atomic::AtomicUsize;
    use std::sync::Arc;

    /// An "etcd" that takes connections and never answers: how many
    /// requests (HTTP/2 streams a client opened) it was sent.
    fn silent_etcd() -> (ClusterUrl, Arc<AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("address").port();
        let asked = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&asked);
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let counted = Arc::clone(&counted);
                std::thread::spawn(move || count_requests(stream, &counted));
            }
        });
        let url = ClusterUrl::parse(&format!("etcd://127.0.0.1:{port}/silent")).expect("url");
        (url, asked)
    }

    /// Counts the HEADERS frames that open a stream, after the client's
    /// preface (24 bytes): each frame is a 9-byte header (length, type,
    /// flags, stream id) and its payload.
    fn count_requests(mut stream: std::net::TcpStream, counted: &AtomicUsize) {
        use std::io::Read;
        let mut preface = [0u8; 24];
        if stream.read_exact(&mut preface).is_err() {
            return;
        }
        let mut opened = BTreeSet::new();
        let mut header = [0u8; 9];
        while stream.read_exact(&mut header).is_ok() {
            let len = u32::from_be_bytes([0, header[0], header[1], header[2]]);
            let id = u32::from_be_bytes([header[5], header[6], header[7], header[8]]) & !(1 << 31);
            if header[3] == 1 && opened.insert(id) {
                counted.fetch_add(1, Ordering::SeqCst);
            }
            let mut payload = vec![0u8; len as usize];
            if stream.read_exact(&mut payload).is_err() {
                return;
            }
        }
    }

    /// Checks shards 0 to 3, whose regions are missing, until none is
    /// waiting for the records any more: the last refusals.
    fn check_until_answered(made: &mut RegionsMade) -> Vec<Result<(), Refusal>> {
        let dir = tempfile::tempdir().expect("dir");
        let started = Instant::now();
        loop {
            let checked: Vec<_> = (0..4)
                .map(|shard| made.check(shard, &dir.path().join(format!("shard-{shard}")), true))
                .collect();
            if !checked.iter().any(|c| matches!(c, Err(Refusal::Asking))) {
                return checked;
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "never answered"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    #[test]
    fn a_silent_etcd_is_asked_once_for_every_missing_region_and_waited_for_by_none() {
        let (url, asked) = silent_etcd();
        let mut made = RegionsMade::new(url, "m0", "shm:/x", MissingRegions::Refuse);
        let dir = tempfile::tempdir().expect("dir");
        // The check does not wait for the read under way.
        let first = made.check(0, &dir.path().join("shard-0"), true);
        assert!(matches!(first, Err(Refusal::Asking)));
        let last = check_until_answered(&mut made);
        assert!(last.iter().all(|c| matches!(c, Err(Refusal::Unchecked(_)))));
        assert_eq!(asked.load(Ordering::SeqCst), 1);
        // Asked again, once, after a rejoin.
        made.reread();
        check_until_answered(&mut made);
        assert_eq!(asked.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn a_region_made_here_is_known_without_waiting_for_etcd() {
        let (url, _) = silent_etcd();
        let mut made = RegionsMade::new(url, "m0", "shm:/x", MissingRegions::Refuse);
        let dir = tempfile::tempdir().expect("dir");
        made.record(3);
        let checked = made.check(3, &dir.path().join("shard-3"), false);
        let Err(Refusal::Lost(why)) = checked else {
            panic!("a region this process made, missing, must be refused");
        };
        assert!(why.contains("shard 3") && why.contains("here"), "{why}");
    }

    #[test]
    fn a_stopping_member_waits_a_bounded_time_for_its_records() {
        let (url, _) = silent_etcd();
        let mut made = RegionsMade::new(url, "m0", "shm:/x", MissingRegions::Refuse);
        made.record(1);
        made.record(2);
        // Shard 2's copy is no longer served here: its record is not due.
        made.flush(|shard| shard == 1, Duration::from_millis(300));
        assert_eq!(made.pending, BTreeSet::from([1]));
        assert!(
            made.retry.is_some(),
            "the write of shard 1's record is under way"
        );
    }
}
