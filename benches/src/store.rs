//! The stores a workload runs against, behind one interface: onekv, and the
//! peers a user might pick instead (Redis over loopback, LMDB in shared
//! memory). Each worker thread opens its own handle.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kv_common::transport::VerbStats;

/// One thread's handle on a store.
pub trait Store {
    /// Reads `key` into `out`; false if it is absent.
    fn read(&mut self, key: &[u8], out: &mut Vec<u8>) -> Result<bool, String>;
    fn write(&mut self, key: &[u8], value: &[u8]) -> Result<(), String>;
    /// Reads many keys, each into the matching `out` (which has at least as
    /// many buffers); returns how many were present. By default one read
    /// after another.
    fn read_many(&mut self, keys: &[&[u8]], out: &mut [Vec<u8>]) -> Result<usize, String> {
        let mut found = 0;
        for (key, out) in keys.iter().zip(out) {
            found += usize::from(self.read(key, out)?);
        }
        Ok(found)
    }
    /// Verb counters, for stores that have them (onekv).
    fn verb_stats(&self) -> Option<VerbStats> {
        None
    }
}

/// Opens handles on one store, for any number of threads.
pub trait StoreFactory: Sync {
    fn open(&self) -> Result<Box<dyn Store>, String>;
    /// CPU time the server has spent so far, when the store has a server
    /// whose time can be read.
    fn server_cpu_us(&self) -> Option<u64> {
        None
    }
    /// Waits for background work the last phase set off (onekv: an index
    /// resize), so that a phase's figures are its own; says how long.
    fn settle(&self) -> Result<Duration, String> {
        Ok(Duration::ZERO)
    }
}

/// How long a phase waits for the store to settle before it gives up.
const SETTLE_LIMIT: Duration = Duration::from_secs(300);
/// How long a settled onekv server must stay without a resize.
const QUIET: Duration = Duration::from_secs(1);

pub struct Onekv {
    pub address: String,
    pub secret: Option<Vec<u8>>,
    pub slot_cache_entries: Option<usize>,
}

impl Onekv {
    /// The options every connection of the run uses.
    fn options(&self) -> kv_client::ClientOptions {
        let options = kv_client::ClientOptions::default();
        match &self.secret {
            Some(secret) => options.with_secret(secret.clone()),
            None => options,
        }
    }
}

impl StoreFactory for Onekv {
    fn open(&self) -> Result<Box<dyn Store>, String> {
        let options = self
            .options()
            .with_slot_cache_entries(self.slot_cache_entries);
        if kv_cluster::ClusterSource::is_cluster(&self.address) {
            let cluster = kv_client::ClusterClient::connect_with(&self.address, options)
                .map_err(|e| format!("onekv at {}: {e}", self.address))?;
            return Ok(Box::new(cluster));
        }
        let client = kv_client::Client::connect_with(&self.address, options)
            .map_err(|e| format!("onekv at {}: {e}", self.address))?;
        Ok(Box::new(client))
    }

    fn server_cpu_us(&self) -> Option<u64> {
        if kv_cluster::ClusterSource::is_cluster(&self.address) {
            let mut cluster =
                kv_client::ClusterClient::connect_with(&self.address, self.options()).ok()?;
            let shards = 0..cluster.shards();
            return shards
                .map(|s| cluster.server_stats(s).ok().map(|s| s.server_cpu_us))
                .sum();
        }
        let mut client = kv_client::Client::connect_with(&self.address, self.options()).ok()?;
        client.server_stats().ok().map(|s| s.server_cpu_us)
    }

    fn settle(&self) -> Result<Duration, String> {
        if kv_cluster::ClusterSource::is_cluster(&self.address) {
            return self.settle_cluster();
        }
        let mut client = kv_client::Client::connect_with(&self.address, self.options())
            .map_err(|e| e.to_string())?;
        settle_servers(|| Ok(vec![client.server_stats().map_err(|e| e.to_string())?]))
    }
}

impl Onekv {
    /// Settles every shard's server (all at once: each settled one still
    /// waits for the others).
    fn settle_cluster(&self) -> Result<Duration, String> {
        let mut cluster = kv_client::ClusterClient::connect_with(&self.address, self.options())
            .map_err(|e| e.to_string())?;
        settle_servers(|| {
            (0..cluster.shards())
                .map(|shard| cluster.server_stats(shard).map_err(|e| e.to_string()))
                .collect()
        })
    }
}

/// Waits until none of the servers whose statistics `stats` reads has a
/// resize under way; how long it took.
fn settle_servers(
    mut stats: impl FnMut() -> Result<Vec<kv_common::protocol::ServerStats>, String>,
) -> Result<Duration, String> {
    let start = Instant::now();
    let resizes = |all: &[kv_common::protocol::ServerStats]| -> Option<Vec<u64>> {
        all.iter()
            .map(|s| (!s.resizing).then_some(s.resizes))
            .collect()
    };
    // A server looks at its occupancy twice a second, so a resize the
    // load made due may start up to then: settled is no resize under way
    // at two looks a second apart, and none in between.
    loop {
        if let Some(before) = resizes(&stats()?) {
            std::thread::sleep(QUIET);
            if resizes(&stats()?) == Some(before) {
                return Ok(start.elapsed().saturating_sub(QUIET));
            }
        }
        if start.elapsed() > SETTLE_LIMIT {
            return Err(format!(
                "an index resize is still under way after {SETTLE_LIMIT:?}"
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

impl Store for kv_client::ClusterClient {
    fn read(&mut self, key: &[u8], out: &mut Vec<u8>) -> Result<bool, String> {
        self.get_into(key, out).map_err(|e| e.to_string())
    }

    fn read_many(&mut self, keys: &[&[u8]], out: &mut [Vec<u8>]) -> Result<usize, String> {
        let values = self.get_many(keys).map_err(|e| e.to_string())?;
        Ok(fill(values, out))
    }

    fn write(&mut self, key: &[u8], value: &[u8]) -> Result<(), String> {
        self.put(key, value).map_err(|e| e.to_string())
    }

    fn verb_stats(&self) -> Option<VerbStats> {
        Some(kv_client::ClusterClient::verb_stats(self))
    }
}

impl Store for kv_client::Client {
    fn read(&mut self, key: &[u8], out: &mut Vec<u8>) -> Result<bool, String> {
        self.get_into(key, out).map_err(|e| e.to_string())
    }

    fn read_many(&mut self, keys: &[&[u8]], out: &mut [Vec<u8>]) -> Result<usize, String> {
        let values = self.get_many(keys).map_err(|e| e.to_string())?;
        Ok(fill(values, out))
    }

    fn write(&mut self, key: &[u8], value: &[u8]) -> Result<(), String> {
        self.put(key, value).map_err(|e| e.to_string())
    }

    fn verb_stats(&self) -> Option<VerbStats> {
        Some(kv_client::Client::verb_stats(self))
    }
}

/// Puts the values found into `out`; how many were found.
fn fill(values: Vec<Option<Vec<u8>>>, out: &mut [Vec<u8>]) -> usize {
    let mut found = 0;
    for (value, out) in values.into_iter().zip(out) {
        if let Some(value) = value {
            *out = value;
            found += 1;
        }
    }
    found
}

/// Redis over loopback: a server given by URL, or one started here.
pub struct Redis {
    url: String,
    /// Writes sent per pipeline (1: no pipelining).
    pub pipeline: usize,
    server: Option<Child>,
    _dir: Option<tempfile::TempDir>,
}

impl Redis {
    /// Uses `url`, or starts `redis-server` on a free loopback port with
    /// persistence off. Err says why Redis is unavailable.
    pub fn start(url: Option<&str>) -> Result<Redis, String> {
        if let Some(url) = url {
            let r = Redis {
                url: url.to_string(),
                pipeline: 1,
                server: None,
                _dir: None,
            };
            r.open()?;
            return Ok(r);
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| format!("no free loopback port: {e}"))?
            .port();
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let child = Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--port", &port.to_string(), "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("redis-server not available ({e}); install the Debian package redis-server or pass --redis-url"))?;
        let r = Redis {
            url: format!("redis://127.0.0.1:{port}/"),
            pipeline: 1,
            server: Some(child),
            _dir: Some(dir),
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match r.open() {
                Ok(_) => return Ok(r),
                Err(e) if Instant::now() > deadline => {
                    return Err(format!("redis-server did not start: {e}"))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }

    fn pid(&self) -> Option<u32> {
        self.server.as_ref().map(Child::id)
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        if let Some(mut c) = self.server.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// With pipelining, writes are queued and sent N at a time (a write is
/// acknowledged when its pipeline is); a read first sends what is queued,
/// so a client still reads its own writes.
struct RedisHandle {
    conn: redis::Connection,
    pipeline: usize,
    queued: redis::Pipeline,
    queued_len: usize,
}

impl RedisHandle {
    fn flush(&mut self) -> Result<(), String> {
        if self.queued_len > 0 {
            self.queued
                .query::<()>(&mut self.conn)
                .map_err(|e| e.to_string())?;
            self.queued.clear();
            self.queued_len = 0;
        }
        Ok(())
    }
}

impl Drop for RedisHandle {
    fn drop(&mut self) {
        let _ = self.flush();
    }
}

impl StoreFactory for Redis {
    fn open(&self) -> Result<Box<dyn Store>, String> {
        let client = redis::Client::open(self.url.as_str()).map_err(|e| e.to_string())?;
        let conn = client
            .get_connection()
            .map_err(|e| format!("redis at {}: {e}", self.url))?;
        Ok(Box::new(RedisHandle {
            conn,
            pipeline: self.pipeline.max(1),
            queued: redis::pipe(),
            queued_len: 0,
        }))
    }

    fn server_cpu_us(&self) -> Option<u64> {
        process_cpu_us(self.pid()?)
    }
}

impl Store for RedisHandle {
    fn read_many(&mut self, keys: &[&[u8]], out: &mut [Vec<u8>]) -> Result<usize, String> {
        self.flush()?;
        let values: Vec<Option<Vec<u8>>> = redis::cmd("MGET")
            .arg(keys)
            .query(&mut self.conn)
            .map_err(|e| e.to_string())?;
        let mut found = 0;
        for (value, out) in values.into_iter().zip(out) {
            if let Some(value) = value {
                *out = value;
                found += 1;
            }
        }
        Ok(found)
    }

    fn read(&mut self, key: &[u8], out: &mut Vec<u8>) -> Result<bool, String> {
        self.flush()?;
        let v: Option<Vec<u8>> = redis::cmd("GET")
            .arg(key)
            .query(&mut self.conn)
            .map_err(|e| e.to_string())?;
        match v {
            Some(v) => {
                *out = v;
                Ok(true)
            }
            None => Ok(false),
        }
    }

    fn write(&mut self, key: &[u8], value: &[u8]) -> Result<(), String> {
        if self.pipeline == 1 {
            return redis::cmd("SET")
                .arg(key)
                .arg(value)
                .query::<()>(&mut self.conn)
                .map_err(|e| e.to_string());
        }
        self.queued.cmd("SET").arg(key).arg(value).ignore();
        self.queued_len += 1;
        if self.queued_len >= self.pipeline {
            self.flush()?;
        }
        Ok(())
    }
}

/// LMDB in a temporary directory in /dev/shm: the usual choice for sharing
/// a store between processes on one host. Writers are serialised by LMDB.
pub struct Lmdb {
    env: heed::Env<heed::WithoutTls>,
    db: heed::Database<heed::types::Bytes, heed::types::Bytes>,
    _dir: tempfile::TempDir,
}

impl Lmdb {
    pub fn open(map_size: usize) -> Result<Lmdb, String> {
        let base = std::path::Path::new("/dev/shm");
        let dir = if base.is_dir() {
            tempfile::tempdir_in(base)
        } else {
            tempfile::tempdir()
        }
        .map_err(|e| e.to_string())?;
        // SAFETY: the directory is new and private to this process, so no
        // other process opens the environment with other flags.
        let env = unsafe {
            heed::EnvOpenOptions::new()
                .read_txn_without_tls()
                .map_size(map_size)
                .max_dbs(1)
                .flags(heed::EnvFlags::NO_SYNC | heed::EnvFlags::NO_META_SYNC)
                .open(dir.path())
        }
        .map_err(|e| format!("lmdb: {e}"))?;
        let mut wtxn = env.write_txn().map_err(|e| e.to_string())?;
        let db = env
            .create_database(&mut wtxn, None)
            .map_err(|e| e.to_string())?;
        wtxn.commit().map_err(|e| e.to_string())?;
        Ok(Lmdb { env, db, _dir: dir })
    }
}

struct LmdbHandle {
    env: heed::Env<heed::WithoutTls>,
    db: heed::Database<heed::types::Bytes, heed::types::Bytes>,
}

impl StoreFactory for Lmdb {
    fn open(&self) -> Result<Box<dyn Store>, String> {
        Ok(Box::new(LmdbHandle {
            env: self.env.clone(),
            db: self.db,
        }))
    }
}

impl Store for LmdbHandle {
    fn read(&mut self, key: &[u8], out: &mut Vec<u8>) -> Result<bool, String> {
        let rtxn = self.env.read_txn().map_err(|e| e.to_string())?;
        match self.db.get(&rtxn, key).map_err(|e| e.to_string())? {
            Some(v) => {
                out.clear();
                out.extend_from_slice(v);
                Ok(true)
            }
            None => Ok(false),
        }
    }

    fn read_many(&mut self, keys: &[&[u8]], out: &mut [Vec<u8>]) -> Result<usize, String> {
        // One read transaction for the lot.
        let rtxn = self.env.read_txn().map_err(|e| e.to_string())?;
        let mut found = 0;
        for (key, out) in keys.iter().zip(out) {
            if let Some(v) = self.db.get(&rtxn, key).map_err(|e| e.to_string())? {
                out.clear();
                out.extend_from_slice(v);
                found += 1;
            }
        }
        Ok(found)
    }

    fn write(&mut self, key: &[u8], value: &[u8]) -> Result<(), String> {
        let mut wtxn = self.env.write_txn().map_err(|e| e.to_string())?;
        self.db
            .put(&mut wtxn, key, value)
            .map_err(|e| e.to_string())?;
        wtxn.commit().map_err(|e| e.to_string())
    }
}

/// User + system CPU time of another process, from /proc.
pub fn process_cpu_us(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the parenthesised command name; utime and stime are 14 and 15.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (hz > 0).then(|| ticks * 1_000_000 / hz as u64)
}
