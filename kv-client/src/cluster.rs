//! A client of a cluster: each key goes to its shard
//! ([`kv_common::layout::shard_of`]), through a connection to the server
//! that owns the shard, made when the shard is first used. The shard map
//! and the members come from etcd or from any member ([`MapSource`]), read
//! at connect, followed from then on by a thread that the process's clients
//! of the cluster share ([`MapWatch`]: a shard that moved is sought at its
//! new owner before its old one is asked), and read again at once when a shard's server cannot
//! be reached or refuses. etcd is never on the data path.

use std::time::{Duration, Instant};

use kv_cluster::{shard_address, ClusterSource, ClusterState};
use kv_common::layout::shard_of;

use smallvec::SmallVec;

use crate::batch::{Blocks, DeleteBatch, GetBatch, PutBatch, Unsettled};
use crate::local::BATCH_KEYS;
use crate::map_source::{MapSource, MapWatch};
use crate::replicated::{self, Group};
use crate::{Client, ClientOptions, Error, Result, ServerStats, VerbStats};

/// A cluster, with the API of one server's [`Client`] for single keys.
/// Like a `Client`, it is one thread's: give each thread its own.
///
/// ```no_run
/// let mut kv = kv_client::ClusterClient::connect("etcd://127.0.0.1:2379/prod")?;
/// kv.put(b"user1", b"hello")?;
/// assert_eq!(kv.get(b"user1")?.as_deref(), Some(&b"hello"[..]));
/// // The same cluster, read from its members instead of etcd:
/// let mut kv = kv_client::ClusterClient::connect("cluster+rdma://10.0.0.1:7000,10.0.0.2:7000")?;
/// # Ok::<(), kv_client::Error>(())
/// ```
pub struct ClusterClient {
    source: ClusterSource,
    options: ClientOptions,
    map: MapSource,
    /// The newest state the client's follower has seen.
    watch: MapWatch,
    /// The state it routes by.
    state: ClusterState,
    /// The newest revision looked at on the follower's board.
    board_seen: i64,
    /// When each shard was seen to change owners: its new owner may still
    /// be opening it for a while (MOVE_SETTLE).
    moved_at: Vec<Option<Instant>>,
    /// When `state` was read.
    read_at: Instant,
    /// A connection per shard, once used: to its primary.
    shards: Vec<Option<Client>>,
    /// A connection to each backup of a replicated shard, once written
    /// (all of them, or none).
    backups: Vec<Vec<Client>>,
    /// Verbs of the connections dropped so far (a shard that moved or
    /// failed over), still counted: `verb_stats` only grows.
    retired_stats: VerbStats,
}

/// A shard's pairs of a `put_many`.
type Pairs<'p> = Vec<(&'p [u8], &'p [u8])>;

/// Where a shard's part of a cluster write stands.
enum Progress {
    /// Keys or pairs done so far.
    Going(usize),
    /// Its server moved or went: done again from here, by `on`.
    Redo(usize),
    /// An error a retry would not cure.
    Failed(Error),
}

impl Progress {
    /// What an error met by the batch from `from` on leaves: a redo from
    /// there for what `on` retries (a server that moved or went), else the
    /// error.
    fn after(e: Error, from: usize) -> Progress {
        let gone = matches!(e, Error::ShardUnavailable { .. } | Error::Refused(_))
            || (e.is_retryable() && !matches!(e, Error::Contended(_)));
        match gone {
            true => Progress::Redo(from),
            false => Progress::Failed(e),
        }
    }

    /// Whether this part still has some of its `len` keys to do here.
    fn left(&self, len: usize) -> bool {
        matches!(*self, Progress::Going(done) if done < len)
    }
}

/// A shard's connection that is not there (nothing clears one during a
/// batch; said rather than assumed).
fn gone() -> Error {
    Error::Internal("a shard's connection vanished during a batch".into())
}

/// The steps of a multi-key batch at one server, each waiting for what the
/// one before started: a GET's first batch, its blocks, their check, the
/// keys left to the single path; a PUT's or DELETE's first batch, the
/// copies, the CASes, their outcomes.
const STEPS: usize = 4;

/// A batch's step without its batch (likewise).
fn out_of_order() -> Error {
    Error::Internal("a batch step without its batch".into())
}

/// How long a client tries etcd (or the members) again when they fail to
/// answer.
const ETCD_RETRY: Duration = Duration::from_secs(2);
/// Least time between two reads of the map prompted by unreachable shards.
const REREAD_EVERY: Duration = Duration::from_millis(100);
/// How long an operation waits for its shard to finish moving.
const MOVE_WAIT: Duration = Duration::from_secs(60);
/// How often the map is read while a shard moves.
const MOVE_POLL: Duration = Duration::from_millis(50);
/// How long a shard that has just moved may take to start serving at its
/// new owner (it reopens the region it received).
const MOVE_SETTLE: Duration = Duration::from_secs(10);
/// How long an operation on a replicated shard waits for a copy it cannot
/// reach to be failed over: the member's lease TTL (3 s by default), the
/// coordinator's turn, and the copies' restart under the new group epoch.
const FAILOVER_WAIT: Duration = Duration::from_secs(20);
/// How many times a write to a replicated shard cut off before its commit
/// is run again (see `ClusterClient::on_group`).
const RESUMES: usize = 3;
/// How long a connect to a replicated shard's copy waits for its answer: a
/// live server on a busy host answers well within it; a frozen one may be
/// being failed over, and the map is read again meanwhile.
const COPY_CONNECT_WAIT: Duration = Duration::from_secs(2);

impl ClusterClient {
    /// Reads the cluster at `url` with default options: from etcd
    /// (`etcd://HOST:PORT[,HOST:PORT...]/NAME`, feature `etcd`), or from
    /// any of its members (`cluster+rdma://HOST:PORT[,HOST:PORT...]`,
    /// `cluster+shm:///PATH[,/PATH...]`: their `--listen` addresses).
    ///
    /// # Errors
    ///
    /// As [`ClusterClient::connect_with`].
    pub fn connect(url: &str) -> Result<ClusterClient> {
        ClusterClient::connect_with(url, ClientOptions::default())
    }

    /// Reads the cluster's members and shard map; `options` apply to each
    /// shard's connection.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidAddress`] for a malformed URL (or an etcd URL in a
    /// build without the feature); [`Error::Cluster`] when neither etcd
    /// nor any member named answers, or etcd holds no such cluster.
    pub fn connect_with(url: &str, options: ClientOptions) -> Result<ClusterClient> {
        let source = ClusterSource::parse(url).map_err(Error::InvalidAddress)?;
        let mut map = MapSource::open(&source, options.connect_options())?;
        let state = map.read(None)?;
        let watch = MapWatch::start(&source.to_string(), &map, &state)?;
        let shards = (0..state.config.shards).map(|_| None).collect();
        let backups = (0..state.config.shards).map(|_| Vec::new()).collect();
        Ok(ClusterClient {
            source,
            options,
            map,
            watch,
            board_seen: state.revision,
            moved_at: vec![None; state.config.shards as usize],
            state,
            read_at: Instant::now(),
            shards,
            backups,
            retired_stats: VerbStats::default(),
        })
    }

    /// The cluster's shard count.
    pub fn shards(&self) -> u32 {
        self.state.config.shards
    }

    /// Which shard holds `key`.
    pub fn shard_of(&self, key: impl AsRef<[u8]>) -> u32 {
        shard_of(key.as_ref(), self.shards())
    }

    /// The member that owns `shard` in the map the client routes by, if
    /// any.
    pub fn owner(&self, shard: u32) -> Option<&str> {
        self.state.shard_map()?.owner(shard)
    }

    /// The epoch of the newest shard map the client has seen (0 before the
    /// first map): the one its next operation routes by.
    pub fn map_epoch(&mut self) -> u64 {
        self.follow();
        self.state.shard_map().map_or(0, |m| m.epoch)
    }

    /// The value of `key`, or None.
    ///
    /// # Errors
    ///
    /// As [`Client::get`], and [`Error::ShardUnavailable`] when the key's
    /// shard has no server that answers.
    pub fn get(&mut self, key: impl AsRef<[u8]>) -> Result<Option<Vec<u8>>> {
        let key = key.as_ref();
        self.on_shard(key, |c| c.get(key))
    }

    /// Reads the value of `key` into `out`; false if there is no such key.
    ///
    /// # Errors
    ///
    /// As [`ClusterClient::get`].
    pub fn get_into(&mut self, key: impl AsRef<[u8]>, out: &mut Vec<u8>) -> Result<bool> {
        let key = key.as_ref();
        self.on_shard(key, |c| c.get_into(key, out))
    }

    /// Stores `value` under `key`.
    ///
    /// # Errors
    ///
    /// As [`Client::put`], and [`Error::ShardUnavailable`].
    pub fn put(&mut self, key: impl AsRef<[u8]>, value: impl AsRef<[u8]>) -> Result<()> {
        let (key, value) = (key.as_ref(), value.as_ref());
        match self.is_replicated() {
            true => self.on_group(key, |g| g.put(key, value)),
            false => self.on_shard(key, |c| c.put(key, value)),
        }
    }

    /// Removes `key`; false if it was absent.
    ///
    /// # Errors
    ///
    /// As [`Client::delete`], and [`Error::ShardUnavailable`].
    pub fn delete(&mut self, key: impl AsRef<[u8]>) -> Result<bool> {
        let key = key.as_ref();
        match self.is_replicated() {
            true => self.on_group(key, |g| g.delete(key)),
            false => self.on_shard(key, |c| c.delete(key)),
        }
    }

    /// Adds `delta` to the counter `key` and returns its new value.
    ///
    /// # Errors
    ///
    /// As [`Client::incr`], and [`Error::ShardUnavailable`].
    pub fn incr(&mut self, key: impl AsRef<[u8]>, delta: i64) -> Result<i64> {
        let key = key.as_ref();
        match self.is_replicated() {
            true => self.on_group(key, |g| g.incr(key, delta)),
            false => self.on_shard(key, |c| c.incr(key, delta)),
        }
    }

    /// The counter `key`, or None.
    ///
    /// # Errors
    ///
    /// As [`Client::get_counter`], and [`Error::ShardUnavailable`].
    pub fn get_counter(&mut self, key: impl AsRef<[u8]>) -> Result<Option<i64>> {
        let key = key.as_ref();
        match self.is_replicated() {
            // Counters of a replicated shard are the text of their value.
            true => replicated::counter(self.on_shard(key, |c| c.get(key))?),
            false => self.on_shard(key, |c| c.get_counter(key)),
        }
    }

    /// The values of many keys, in order, as [`Client::get_many`] reads
    /// them, the keys of each shard at its server: each batch is posted to
    /// every server the keys fall in before any is waited for, so the
    /// batch costs the round trips of one server's, not their sum. A shard
    /// whose batch fails (its server moved or went) is read again the way
    /// [`ClusterClient::get`] retries.
    ///
    /// # Errors
    ///
    /// The error of a shard that still fails when read again, as
    /// [`ClusterClient::get`]'s.
    pub fn get_many<K: AsRef<[u8]>>(&mut self, keys: &[K]) -> Result<Vec<Option<Vec<u8>>>> {
        self.follow();
        let mut answers = vec![None; keys.len()];
        let mut retry = Vec::new();
        let by_shard = self.by_shard(keys.iter().map(AsRef::as_ref))?;
        // Connected first: each batch then goes out at once.
        let mut shards = Vec::new();
        for (shard, at) in by_shard {
            match self.connection(shard) {
                Ok(_) => shards.push((shard, at)),
                Err(_) => retry.push((shard, at)),
            }
        }
        let rounds = shards.iter().map(|(_, at)| at.len().div_ceil(BATCH_KEYS));
        // A shard that failed is read again whole, and not in later rounds.
        let mut failed: Vec<u32> = Vec::new();
        for round in 0..rounds.max().unwrap_or(0) {
            let parts: Vec<(u32, &[usize])> = shards
                .iter()
                .filter(|(shard, _)| !failed.contains(shard))
                .filter_map(|(shard, at)| Some((*shard, at.chunks(BATCH_KEYS).nth(round)?)))
                .collect();
            failed.extend(self.get_overlapped(keys, &parts, &mut answers));
        }
        retry.extend(shards.into_iter().filter(|(s, _)| failed.contains(s)));
        for (shard, at) in retry {
            let batch: Vec<&[u8]> = at.iter().map(|&i| keys[i].as_ref()).collect();
            let got = self.on(shard, |c| c.get_many(&batch))?;
            for (i, answer) in at.into_iter().zip(got) {
                answers[i] = answer;
            }
        }
        Ok(answers)
    }

    /// One batch of each shard's keys (`parts`: a shard and the positions
    /// of up to `BATCH_KEYS` of its keys): every shard's first batch is
    /// started, then every shard's second, then all are finished, and only
    /// then are the keys no batch settled read one by one (a slow one must
    /// not make the other shards' batches late). Returns the shards that
    /// failed, to be read again.
    fn get_overlapped<K: AsRef<[u8]>>(
        &mut self,
        keys: &[K],
        parts: &[(u32, &[usize])],
        answers: &mut [Option<Vec<u8>>],
    ) -> Vec<u32> {
        struct Part<'p, 'k> {
            shard: u32,
            at: &'p [usize],
            keys: SmallVec<[&'k [u8]; BATCH_KEYS]>,
            values: Vec<Vec<u8>>,
            found: Vec<bool>,
            batch: Option<GetBatch>,
        }
        let mut going: Vec<Part<'_, '_>> = parts
            .iter()
            .map(|&(shard, at)| Part {
                shard,
                at,
                keys: at.iter().map(|&i| keys[i].as_ref()).collect(),
                values: vec![Vec::new(); at.len()],
                found: vec![false; at.len()],
                batch: None,
            })
            .collect();
        let mut failed = Vec::new();
        self.in_steps(
            &mut going,
            |p| p.shard,
            |step, client, p| match (step, p.batch.as_mut()) {
                (0, _) => client.get_started(&p.keys).map(|b| p.batch = Some(b)),
                (1, Some(b)) => client.get_second(b, &p.keys, &mut p.values, &mut p.found),
                (2, Some(b)) => client
                    .get_done(b, &p.keys, &mut p.values, &mut p.found)
                    .map(|unsettled| b.unsettled = unsettled),
                (_, Some(b)) => b.unsettled.iter().try_for_each(|&i| {
                    p.found[i] = client.get_into_bytes(p.keys[i], &mut p.values[i])?;
                    Ok(())
                }),
                (_, None) => Err(out_of_order()),
            },
            |p, _| failed.push(p.shard),
        );
        for p in going {
            for ((i, value), found) in p.at.iter().zip(p.values).zip(p.found) {
                answers[*i] = found.then_some(value);
            }
        }
        failed
    }

    /// Stores many pairs, as [`Client::put_many`] does, the pairs of each
    /// shard at its server: each step of a batch (its blocks' WRITEs and
    /// the keys' windows or hinted CASes; the copies; the CASes) is posted
    /// to every server before any is waited for, so a batch costs the
    /// round trips of one server's (one for keys with settled hints). A
    /// shard whose server moved or went is written again from its failed
    /// batch on, the way [`ClusterClient::put`] retries.
    ///
    /// # Errors
    ///
    /// [`Error::ValueTooLarge`] before anything is written (checked at
    /// every shard whose server answered); else the first error a shard
    /// met that a retry would not cure, or that a retry met, as
    /// [`ClusterClient::put`]'s. Some of the other pairs may have been
    /// stored (the call is not atomic).
    pub fn put_many<K: AsRef<[u8]>, V: AsRef<[u8]>>(&mut self, pairs: &[(K, V)]) -> Result<()> {
        self.follow();
        if self.replicas() > 1 {
            // One at a time: each write's copies are ordered by its own
            // primary CAS (see `replicated`).
            return pairs.iter().try_for_each(|(k, v)| self.put(k, v));
        }
        let mut shards = Vec::new();
        let mut retry = Vec::new();
        for (shard, at) in self.by_shard(pairs.iter().map(|(k, _)| k.as_ref()))? {
            let batch: Vec<(&[u8], &[u8])> = at
                .iter()
                .map(|&i| (pairs[i].0.as_ref(), pairs[i].1.as_ref()))
                .collect();
            let Ok(client) = self.connection(shard) else {
                retry.push((shard, batch));
                continue;
            };
            let max = client.max_value();
            if let Some((_, v)) = batch.iter().find(|(_, v)| v.len() > max) {
                return Err(Error::ValueTooLarge { len: v.len(), max });
            }
            shards.push((shard, batch));
        }
        self.in_rounds(shards, &mut retry, |c, shards, progress| {
            c.put_overlapped(shards, progress);
        })?;
        for (shard, batch) in retry {
            self.on(shard, |c| c.put_many(&batch))?;
        }
        Ok(())
    }

    /// The next batch of each shard's pairs that `progress` says are left:
    /// each step of the batch taken on every server before the next, then
    /// the pairs no batch settled written one by one.
    fn put_overlapped(&mut self, shards: &[(u32, Pairs<'_>)], progress: &mut [Progress]) {
        struct Part<'p> {
            n: usize,
            shard: u32,
            from: usize,
            put: Option<PutBatch<'p>>,
            took: usize,
            unsettled: Unsettled,
        }
        let mut going: Vec<Part<'_>> = (0..shards.len())
            .filter_map(|n| match progress[n] {
                Progress::Going(from) if from < shards[n].1.len() => Some(Part {
                    n,
                    shard: shards[n].0,
                    from,
                    put: None,
                    took: 0,
                    unsettled: Unsettled::new(),
                }),
                _ => None,
            })
            .collect();
        self.in_steps(
            &mut going,
            |p| p.shard,
            |step, client, p| match (step, p.put.as_mut()) {
                (0, _) => client
                    .put_started(&shards[p.n].1[p.from..], Blocks::Values)
                    .map(|put| p.put = Some(put)),
                (1, Some(put)) => client.put_second(put),
                (2, Some(put)) => client.put_third(put),
                (3, Some(put)) => client
                    .put_done(put)
                    .map(|(took, unsettled)| (p.took, p.unsettled) = (took, unsettled)),
                _ => Err(out_of_order()),
            },
            |p, e| progress[p.n] = Progress::after(e, p.from),
        );
        for p in going {
            let batch = &shards[p.n].1[p.from..];
            let wrote = match self.shards.get_mut(p.shard as usize) {
                Some(Some(client)) => p
                    .unsettled
                    .iter()
                    .try_for_each(|&i| client.put(batch[i].0, batch[i].1)),
                _ => Err(gone()),
            };
            progress[p.n] = match wrote {
                Ok(()) => Progress::Going(p.from + p.took),
                Err(e) => Progress::after(e, p.from),
            };
        }
    }

    /// Removes many keys, as [`Client::delete_many`] does, the keys of each
    /// shard at its server, and says for each whether it was there. Each
    /// step of a batch (the keys' windows or hinted CASes; the copies; the
    /// CASes) is posted to every server before any is waited for. A shard
    /// whose server moved or went is done
    /// again from its failed batch on, the way [`ClusterClient::delete`]
    /// retries (a key the failed batch saw removed still counts as there).
    ///
    /// # Errors
    ///
    /// The first error a shard met that a retry would not cure, or that a
    /// retry met, as [`ClusterClient::delete`]'s.
    pub fn delete_many<K: AsRef<[u8]>>(&mut self, keys: &[K]) -> Result<Vec<bool>> {
        self.follow();
        if self.replicas() > 1 {
            return keys.iter().map(|k| self.delete(k)).collect();
        }
        let mut out = vec![false; keys.len()];
        let mut shards = Vec::new();
        let mut retry = Vec::new();
        for (shard, at) in self.by_shard(keys.iter().map(AsRef::as_ref))? {
            match self.connection(shard) {
                Ok(_) => shards.push((shard, at)),
                Err(_) => retry.push((shard, at)),
            }
        }
        self.in_rounds(shards, &mut retry, |c, shards, progress| {
            c.delete_overlapped(keys, shards, progress, &mut out);
        })?;
        for (shard, at) in retry {
            let batch: Vec<&[u8]> = at.iter().map(|&i| keys[i].as_ref()).collect();
            let got = self.on(shard, |c| c.delete_many(&batch))?;
            for (i, was) in at.into_iter().zip(got) {
                out[i] |= was;
            }
        }
        Ok(out)
    }

    /// The next `BATCH_KEYS` keys of each shard (`shards`: a shard and its
    /// keys' positions) that `progress` says are left: each step of the
    /// batch taken on every server before the next, then the keys no batch
    /// settled removed one by one. What each removal found goes to `out`,
    /// even from a batch that then failed (a key it removed was there).
    fn delete_overlapped<K: AsRef<[u8]>>(
        &mut self,
        keys: &[K],
        shards: &[(u32, Vec<usize>)],
        progress: &mut [Progress],
        out: &mut [bool],
    ) {
        struct Part<'p, 'k> {
            n: usize,
            shard: u32,
            from: usize,
            at: &'p [usize],
            keys: SmallVec<[&'k [u8]; BATCH_KEYS]>,
            found: SmallVec<[bool; BATCH_KEYS]>,
            delete: Option<DeleteBatch>,
            unsettled: Unsettled,
        }
        let mut going: Vec<Part<'_, '_>> = (0..shards.len())
            .filter_map(|n| {
                let Progress::Going(from) = progress[n] else {
                    return None;
                };
                let all = &shards[n].1;
                let at = &all[from..all.len().min(from + BATCH_KEYS)];
                (!at.is_empty()).then(|| Part {
                    n,
                    shard: shards[n].0,
                    from,
                    at,
                    keys: at.iter().map(|&i| keys[i].as_ref()).collect(),
                    found: smallvec::smallvec![false; at.len()],
                    delete: None,
                    unsettled: Unsettled::new(),
                })
            })
            .collect();
        self.in_steps(
            &mut going,
            |p| p.shard,
            |step, client, p| match (step, p.delete.as_mut()) {
                (0, _) => client.delete_started(&p.keys).map(|d| p.delete = Some(d)),
                (1, Some(d)) => client.delete_second(d, &p.keys, &mut p.found),
                (2, Some(d)) => client.delete_third(d, &p.keys, &mut p.found),
                (3, Some(d)) => client
                    .delete_done(d, &mut p.found)
                    .map(|unsettled| p.unsettled = unsettled),
                _ => Err(out_of_order()),
            },
            |p, e| {
                for (&i, was) in p.at.iter().zip(&p.found) {
                    out[i] |= was;
                }
                progress[p.n] = Progress::after(e, p.from);
            },
        );
        for p in going {
            for (&i, was) in p.at.iter().zip(&p.found) {
                out[i] |= was;
            }
            let removed = match self.shards.get_mut(p.shard as usize) {
                Some(Some(client)) => p.unsettled.iter().try_for_each(|&i| {
                    out[p.at[i]] |= client.delete_bytes(p.keys[i])?;
                    Ok(())
                }),
                _ => Err(gone()),
            };
            progress[p.n] = match removed {
                Ok(()) => Progress::Going(p.from + p.at.len()),
                Err(e) => Progress::after(e, p.from),
            };
        }
    }

    /// Runs `round` over the shards' parts of a write (`shards`: a shard and
    /// its items) until none has items left to do at its server: what is
    /// to be redone (the server moved or went) is added to `retry`.
    ///
    /// # Errors
    ///
    /// The first error that a retry would not cure.
    fn in_rounds<T: Clone>(
        &mut self,
        shards: Vec<(u32, Vec<T>)>,
        retry: &mut Vec<(u32, Vec<T>)>,
        mut round: impl FnMut(&mut Self, &[(u32, Vec<T>)], &mut [Progress]),
    ) -> Result<()> {
        let mut progress: Vec<Progress> = shards.iter().map(|_| Progress::Going(0)).collect();
        while shards
            .iter()
            .zip(&progress)
            .any(|((_, items), p)| p.left(items.len()))
        {
            round(self, &shards, &mut progress);
        }
        for ((shard, items), p) in shards.into_iter().zip(progress) {
            match p {
                Progress::Going(_) => {}
                Progress::Redo(from) => retry.push((shard, items[from..].to_vec())),
                Progress::Failed(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Takes each of the [`STEPS`] steps of every part (`shard`: the shard
    /// it is of) on its server before the next step of any, so that each
    /// step costs one round trip for all of them. A part whose step fails
    /// is told to `failed` and dropped.
    fn in_steps<P>(
        &mut self,
        parts: &mut Vec<P>,
        shard: impl Fn(&P) -> u32,
        mut step: impl FnMut(usize, &mut Client, &mut P) -> Result<()>,
        mut failed: impl FnMut(&P, Error),
    ) {
        for n in 0..STEPS {
            parts.retain_mut(|p| {
                let done = match self.shards.get_mut(shard(p) as usize) {
                    Some(Some(client)) => step(n, client, p),
                    _ => Err(gone()),
                };
                match done {
                    Ok(()) => true,
                    Err(e) => {
                        failed(p, e);
                        false
                    }
                }
            });
        }
    }

    /// The positions of `keys` grouped by shard, in order within each.
    fn by_shard<'k>(
        &self,
        keys: impl Iterator<Item = &'k [u8]>,
    ) -> Result<std::collections::BTreeMap<u32, Vec<usize>>> {
        let mut shards: std::collections::BTreeMap<u32, Vec<usize>> = Default::default();
        for (i, key) in keys.enumerate() {
            crate::check_key(key)?;
            shards.entry(self.shard_of(key)).or_default().push(i);
        }
        Ok(shards)
    }

    /// The statistics of the server of `shard`.
    ///
    /// # Errors
    ///
    /// [`Error::Cluster`] for a shard the cluster does not have;
    /// [`Error::ShardUnavailable`].
    pub fn server_stats(&mut self, shard: u32) -> Result<ServerStats> {
        self.check_shard(shard)?;
        self.on(shard, Client::server_stats)
    }

    /// The connection to `shard`'s server, made now if it is not yet: for
    /// what is a server's own (its geometry, a resize). Of a replicated
    /// shard, its primary's: a write made through it reaches no backup.
    ///
    /// # Errors
    ///
    /// As [`Self::server_stats`], or the connection's error.
    pub fn shard_client(&mut self, shard: u32) -> Result<&mut Client> {
        self.check_shard(shard)?;
        self.connection(shard)
    }

    /// The cluster as etcd (or the member asked) holds it now, for people:
    /// its members, the shards each serves, the map's epoch, the move
    /// under way, and, from etcd, the `--op-deadline-ms` its members run
    /// (or what is wrong with that record).
    ///
    /// # Errors
    ///
    /// [`Error::Cluster`] when neither etcd nor any member answers.
    pub fn status(&mut self) -> Result<String> {
        self.reread(None)?;
        let s = &self.state;
        let mut status = kv_cluster::records::describe(&s.config, &s.members, s.shard_map());
        if let Some(line) = self.map.describe_op_deadline()? {
            status.push_str(&line);
            status.push('\n');
        }
        Ok(status)
    }

    fn check_shard(&self, shard: u32) -> Result<()> {
        if shard >= self.shards() {
            return Err(Error::Cluster(format!(
                "{} has no shard {shard} (it has {})",
                self.source,
                self.shards()
            )));
        }
        Ok(())
    }

    /// Verbs posted so far over every shard's connection, those since
    /// dropped included (as [`Client::verb_stats`] counts a replaced
    /// connection's): it only grows, so that `since` measures an
    /// operation that met a failover too.
    pub fn verb_stats(&self) -> VerbStats {
        let mut total = self.retired_stats;
        for client in self
            .shards
            .iter()
            .flatten()
            .chain(self.backups.iter().flatten())
        {
            total.add(&client.verb_stats());
        }
        total
    }

    /// Drops `shard`'s connection to its primary, its verbs still counted.
    fn drop_primary(&mut self, shard: u32) {
        if let Some(client) = self.shards[shard as usize].take() {
            self.retired_stats.add(&client.verb_stats());
        }
    }

    /// Drops `shard`'s connections to its backups, their verbs still
    /// counted.
    fn drop_backups(&mut self, shard: u32) {
        for client in self.backups[shard as usize].drain(..) {
            self.retired_stats.add(&client.verb_stats());
        }
    }

    /// Drops every connection to `shard`'s copies, their verbs still
    /// counted.
    fn drop_group(&mut self, shard: u32) {
        self.drop_primary(shard);
        self.drop_backups(shard);
    }

    /// Runs `op` on the connection to `key`'s shard (see [`Self::on`]).
    fn on_shard<T>(&mut self, key: &[u8], op: impl FnMut(&mut Client) -> Result<T>) -> Result<T> {
        crate::check_key(key)?;
        self.on(self.shard_of(key), op)
    }

    /// Runs `op` on the connection to `shard`. When the shard's server
    /// cannot be reached, the map is read again and the operation tried
    /// there: while the map shows the shard moving, and for a while after
    /// it moved (its new owner may still be opening it), for up to
    /// MOVE_WAIT; for a replicated shard, for up to FAILOVER_WAIT;
    /// otherwise once. The error then names the shard and its server.
    fn on<T>(&mut self, shard: u32, mut op: impl FnMut(&mut Client) -> Result<T>) -> Result<T> {
        self.retrying(shard, |this| this.connection(shard).and_then(&mut op))
    }

    /// Runs `op` on `key`'s replicated shard: its primary and backups, each
    /// connected when first written; retried as [`Self::on`] retries, which
    /// a write does only while no copy has it (see `replicated`).
    ///
    /// A write cut off after it may have set some backups but before it
    /// posted its commit (a copy's server went, or the group changed: a
    /// copy added or dropped) is run again, up to `RESUMES` times, while
    /// the shard's lead holds: the same owner, leading since the same map
    /// epoch (the map's `lead_epochs`, stamped wherever a map is
    /// published). Why that is sound: readers read the primary alone, so
    /// the cut write's value can reach a reader only by its commit, which
    /// it never posted, or by a backup promoted in a failover, which
    /// changes the lead. While the lead holds, the write is still in
    /// flight as far as anyone can tell, and a second run is one more of
    /// its rounds: it observes afresh, and its sets on the backups follow
    /// that observation (see `replicated`). The lead is checked before
    /// every run on the map the run routes by; one that changed since (or
    /// was never known) ends the write as an unknown outcome, as does any
    /// error of a second run. A failover after that check is the same race
    /// as for any write: the promoted backup, under its new group epoch,
    /// turns the run's sets away (or holds the value already, if one got
    /// in first), and the run commits only after every backup took its
    /// set.
    fn on_group<T>(
        &mut self,
        key: &[u8],
        mut op: impl FnMut(&mut Group) -> Result<T>,
    ) -> Result<T> {
        crate::check_key(key)?;
        let shard = self.shard_of(key);
        // The lead the write was cut under, once it was.
        let mut cut_under: Option<Lead> = None;
        for resume in 0..=RESUMES {
            let mut cut = None;
            let done = self.retrying(shard, |this| {
                cut = None;
                let lead = Lead::of(&this.state, shard);
                if cut_under.as_ref().is_some_and(|l| *l != lead) {
                    return Err(Error::OutcomeUnknown(
                        "the write reached some copies of its shard before it was cut off, \
                         and the shard's primary changed before it could be written again"
                            .into(),
                    ));
                }
                let mut group = this.group(shard)?;
                let done = op(&mut group);
                cut = group.cut_before_commit.then_some(lead);
                done
            });
            let Err(e) = done else {
                return done;
            };
            if let Error::OutcomeUnknown(_) = &e {
                // Most likely a copy's server went (or restarted under a
                // new group): the next write connects afresh, and waits
                // for the map if it must, rather than failing the same way
                // at once.
                self.drop_group(shard);
            }
            let resumable = cut.filter(|lead| {
                matches!(e, Error::OutcomeUnknown(_))
                    && lead.is_known()
                    && cut_under.as_ref().is_none_or(|under| under == lead)
            });
            match (resumable, &cut_under) {
                (Some(lead), _) if resume < RESUMES => cut_under = Some(lead),
                // A second run that failed otherwise: the first may still
                // surface.
                (_, Some(_)) if !matches!(e, Error::OutcomeUnknown(_)) => {
                    return Err(Error::OutcomeUnknown(format!(
                        "the write reached some copies of its shard before it was cut off, \
                         and failed when written again: {e}"
                    )))
                }
                _ => return Err(e),
            }
        }
        Err(Error::Internal(
            "a write's runs ended without an outcome".into(),
        ))
    }

    /// Copies of each shard the cluster keeps.
    fn replicas(&self) -> u32 {
        self.state.config.replicas
    }

    /// Whether the cluster keeps more than one copy of each shard (the
    /// map's backups are checked where it is read, and again where a
    /// group is connected).
    fn is_replicated(&mut self) -> bool {
        self.follow();
        self.replicas() > 1
    }

    /// `shard`'s primary and backups, connected.
    fn group(&mut self, shard: u32) -> Result<Group<'_>> {
        self.connection(shard)?;
        let slot = shard as usize;
        if self.backups[slot].is_empty() {
            let names: Vec<String> = self
                .state
                .shard_map()
                .map(|m| m.backups(shard).to_vec())
                .unwrap_or_default();
            if names.len() >= self.replicas() as usize {
                return Err(self.unavailable(shard, "the map names too many copies of it"));
            }
            let mut backups = Vec::with_capacity(names.len());
            for name in &names {
                let address = self.address_at(shard, name)?;
                backups.push(Client::connect_with(
                    &address,
                    self.shard_options(&address, shard, name),
                )?);
            }
            self.backups[slot] = backups;
        }
        let primary = self.shards[slot].as_mut().ok_or_else(gone)?;
        Ok(Group::new(primary, &mut self.backups[slot]))
    }

    /// Runs `attempt` on `shard`'s connections. When the shard's server
    /// cannot be reached, the map is read again and the operation tried
    /// there: while the map shows the shard moving, and for a while after
    /// it moved (its new owner may still be opening it), for up to
    /// MOVE_WAIT; otherwise once, and once more from the owner's own map
    /// when its host answered (a member that lags may not show a move the
    /// owner began). The error then names the shard and its server.
    fn retrying<T>(
        &mut self,
        shard: u32,
        mut attempt: impl FnMut(&mut Self) -> Result<T>,
    ) -> Result<T> {
        self.follow();
        // On the client's clock (the TSC): a clock_gettime per operation
        // less.
        let started = crate::clock::now();
        let mut reread = false;
        let mut asked_owner = false;
        // A refusal is tried again for MOVE_SETTLE from the first.
        let mut refused_until: Option<Instant> = None;
        // Since when etcd has failed to answer.
        let mut etcd_failing: Option<Instant> = None;
        loop {
            let error = match attempt(self) {
                Ok(done) => return Ok(done),
                Err(e @ Error::ShardUnavailable { .. }) => e,
                Err(e) if e.is_retryable() && !matches!(e, Error::Contended(_)) => e,
                // A wrong secret, or a move's target that the map names
                // owner but that is still open to the copier only (for a
                // moment): tried again for MOVE_SETTLE. A replicated
                // shard's copy turns away a group epoch it has not reached
                // yet: for as long as a failover may take.
                Err(e @ Error::Refused(_)) if refused_until.is_none_or(|t| Instant::now() < t) => {
                    let wait = match self.replicas() > 1 {
                        true => FAILOVER_WAIT,
                        false => MOVE_SETTLE,
                    };
                    refused_until.get_or_insert(Instant::now() + wait);
                    e
                }
                // A version mismatch, a lasting refusal: the same anywhere.
                Err(e) => return Err(e),
            };
            self.drop_group(shard);
            let moving = self.is_moving(shard);
            // A shard that just moved may still be starting at its new
            // owner: its connection is tried again meanwhile.
            let settling =
                refused_until.is_some_and(|t| Instant::now() < t) || self.just_moved(shard);
            // A copy of a replicated shard that cannot be reached may be
            // failed over (once its lease expires): waited for.
            let failing_over = self.replicas() > 1 && crate::clock::since(started) < FAILOVER_WAIT;
            let giving_up = !moving && !settling && !failing_over && reread;
            // The owner's map is asked for first when its host turned the
            // connection away (it answered: asking costs no connect
            // timeout), and once before giving up when it cut one (a
            // member that lags may not show the move the owner began; a
            // dead host costs its timeout only on the way to an error).
            let answered = nothing_listens(&error) || error.is_connection_lost();
            let last_chance = giving_up && answered && !asked_owner;
            if giving_up && !last_chance {
                return Err(match error {
                    Error::ShardUnavailable { .. } | Error::Refused(_) => error,
                    other => self.unavailable(shard, &other.to_string()),
                });
            }
            if crate::clock::since(started) > MOVE_WAIT {
                return Err(self.unavailable(shard, "moving for longer than the client waits"));
            }
            if moving || settling {
                std::thread::sleep(MOVE_POLL);
            } else {
                // A shard that stays down does not send every operation
                // to etcd: the map is read at most once per REREAD_EVERY.
                std::thread::sleep(REREAD_EVERY.saturating_sub(self.read_at.elapsed()));
            }
            let ask_owner = nothing_listens(&error) || last_chance;
            asked_owner |= ask_owner;
            // A connection to etcd broken by its restart fails once: tried
            // again for a moment, not for the whole wait.
            match self.reread(ask_owner.then_some(shard)) {
                Ok(()) => etcd_failing = None,
                Err(e) if etcd_failing.get_or_insert_with(Instant::now).elapsed() > ETCD_RETRY => {
                    return Err(e)
                }
                Err(_) => {
                    std::thread::sleep(MOVE_POLL);
                    continue;
                }
            }
            reread = true;
        }
    }

    /// Whether `shard` changed owners so lately that its new owner may
    /// still be opening it.
    fn just_moved(&self, shard: u32) -> bool {
        self.moved_at[shard as usize].is_some_and(|t| t.elapsed() < MOVE_SETTLE)
    }

    fn is_moving(&self, shard: u32) -> bool {
        self.state.shard_map().is_some_and(|m| m.is_moving(shard))
    }

    /// Reads the map again; with `refused_shard`, asking first the owner of
    /// that shard, whose host turned its connection away (see
    /// [`MapSource::read_past`]).
    fn reread(&mut self, refused_shard: Option<u32>) -> Result<()> {
        let failed = refused_shard
            .and_then(|shard| self.owner(shard))
            .and_then(|owner| self.state.member(owner))
            .and_then(|m| kv_common::Address::parse(&m.listen).ok());
        let state = self.map.read_past(Some(&self.state), failed.as_ref())?;
        self.read_at = Instant::now();
        if state.config.shards as usize != self.shards.len() {
            return Err(Error::Cluster(format!(
                "{} now has {} shards (it was made anew): connect again",
                self.source, state.config.shards
            )));
        }
        self.adopt(state, Instant::now());
        Ok(())
    }

    /// Routes by the newest state the follower has seen, if it is newer.
    fn follow(&mut self) {
        let Some((state, seen_at)) = self.watch.board().newer_than(self.board_seen) else {
            return;
        };
        self.board_seen = state.revision;
        // A cluster made anew is found by the next reread, which says so.
        if state.config.shards as usize == self.shards.len() && state.revision > self.state.revision
        {
            self.adopt(state, seen_at);
        }
    }

    /// Routes by `state` (read at `seen_at`) from now on: the connection of
    /// each shard whose server changed is dropped, so that its next
    /// operation goes to the new one, and a shard that changed owners is
    /// given time to open there.
    fn adopt(&mut self, state: ClusterState, seen_at: Instant) {
        for shard in 0..self.shards.len() as u32 {
            // A failover changes the group's epoch: every copy then turns
            // away connections made under the old one.
            let new_group = group_epoch(&self.state, shard) != group_epoch(&state, shard);
            if new_group || server(&self.state, shard) != server(&state, shard) {
                self.drop_primary(shard);
            }
            if new_group || backup_servers(&self.state, shard) != backup_servers(&state, shard) {
                self.drop_backups(shard);
            }
            let owner = |s: &ClusterState| {
                s.shard_map()
                    .and_then(|m| m.owner(shard))
                    .map(str::to_string)
            };
            let moving = state.shard_map().is_some_and(|m| m.is_moving(shard));
            let new_owner = owner(&state);
            if !moving && new_owner.is_some() && owner(&self.state) != new_owner {
                self.moved_at[shard as usize] = Some(seen_at);
            }
        }
        self.state = state;
    }

    fn connection(&mut self, shard: u32) -> Result<&mut Client> {
        let slot = shard as usize;
        if self.shards[slot].is_none() {
            let address = self.address_of(shard)?;
            let owner = self.owner(shard).unwrap_or_default();
            let client =
                Client::connect_with(&address, self.shard_options(&address, shard, owner))?;
            self.shards[slot] = Some(client);
        }
        self.shards[slot]
            .as_mut()
            .ok_or_else(|| Error::Internal("a shard's connection vanished".into()))
    }

    /// A shard's connection options: the slot hints of the whole client
    /// (its options', or the transport's default) shared among the shards,
    /// so that a cluster client keeps as many hints as a single one and no
    /// more (more would cost cache misses over shm; see
    /// [`crate::SlotCacheEntries`]).
    /// It presents the group epoch the map gives `shard`, and at a
    /// replicated shard's copy (at `member`) waits for a connect's answer
    /// no more than `COPY_CONNECT_WAIT`, and is cut off once a map drops
    /// the copy from the group.
    fn shard_options(&self, address: &str, shard: u32, member: &str) -> ClientOptions {
        let total = self
            .options
            .slot_cache_entries
            .unwrap_or(if address.starts_with("rdma://") {
                crate::DEFAULT_SLOT_CACHE_ENTRIES.rdma
            } else {
                crate::DEFAULT_SLOT_CACHE_ENTRIES.shm
            });
        let per_shard = total.div_ceil(self.shards.len().max(1));
        let mut options = self.options.clone().with_slot_cache_entries(per_shard);
        options.group_epoch = group_epoch(&self.state, shard);
        if self.replicas() > 1 {
            options.connect_timeout = Some(COPY_CONNECT_WAIT);
            let routed_by = self.state.revision;
            options.cutoff = Some(self.watch.board().cutoff_for(shard, member, routed_by));
        }
        options
    }

    /// The address of `shard` at its owner, as the map last read says.
    fn address_of(&self, shard: u32) -> Result<String> {
        let owner = self
            .owner(shard)
            .ok_or_else(|| self.unavailable(shard, "no server owns it yet"))?;
        self.address_at(shard, owner)
    }

    /// The address of `shard`'s copy at member `id`.
    fn address_at(&self, shard: u32, id: &str) -> Result<String> {
        let member = self.state.member(id).ok_or_else(|| {
            self.unavailable(shard, &format!("its server {id} is not a live member"))
        })?;
        let listen = kv_common::Address::parse(&member.listen).map_err(Error::Cluster)?;
        let address = shard_address(&listen, shard).map_err(Error::Cluster)?;
        Ok(address.to_string())
    }

    fn unavailable(&self, shard: u32, reason: &str) -> Error {
        Error::ShardUnavailable {
            shard,
            server: self.owner(shard).unwrap_or("none").to_string(),
            reason: format!("{reason} (cluster {})", self.source),
        }
    }
}

/// Whether `error` came from a host that answered: nothing listens for
/// the shard there (the member dropped it, or died on a live host). A host
/// that did not answer is not asked again for the map at once: that would
/// cost a second connect timeout.
fn nothing_listens(error: &Error) -> bool {
    use std::io::ErrorKind::{ConnectionRefused, NotFound};
    matches!(
        error,
        Error::Unreachable(kv_common::transport::TransportError::Unreachable { source, .. })
            if matches!(source.kind(), ConnectionRefused | NotFound)
    )
}

/// Who serves `shard`'s backups in `state`: each one's address and
/// incarnation, if it has a live record.
fn backup_servers(state: &ClusterState, shard: u32) -> Vec<Option<(&str, i64)>> {
    let Some(map) = state.shard_map() else {
        return Vec::new();
    };
    map.backups(shard)
        .iter()
        .map(|id| {
            let member = state.member(id)?;
            Some((member.listen.as_str(), member.incarnation))
        })
        .collect()
}

/// Who leads a shard, and since when (see `ShardMap::lead_epochs`).
#[derive(Clone, PartialEq, Eq)]
struct Lead {
    owner: Option<String>,
    since: u64,
}

impl Lead {
    fn of(state: &ClusterState, shard: u32) -> Lead {
        let map = state.shard_map();
        Lead {
            owner: map.and_then(|m| m.owner(shard)).map(str::to_string),
            since: map.map_or(0, |m| m.lead_epoch(shard)),
        }
    }

    fn is_known(&self) -> bool {
        self.owner.is_some() && self.since != 0
    }
}

/// The group epoch `state`'s map gives `shard`'s copies.
fn group_epoch(state: &ClusterState, shard: u32) -> u64 {
    state.shard_map().map_or(0, |m| m.group_epoch(shard))
}

/// Who serves `shard` in `state`: its owner's address and incarnation, if
/// it has a live record (a member that starts draining still serves).
fn server(state: &ClusterState, shard: u32) -> Option<(&str, i64)> {
    let member = state.member(state.shard_map()?.owner(shard)?)?;
    Some((member.listen.as_str(), member.incarnation))
}
