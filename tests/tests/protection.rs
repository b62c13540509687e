//! A client over rdma writes only into its own leases (`docs/rdma.md`,
//! "Protection"): hostile clients with valid connections WRITE across the
//! region (the header, the epoch word, the index, other clients' blocks,
//! free space, just past their own lease) with the region's key and with
//! their own window's key, and nothing outside their leases changes; each
//! attempt costs the attacker its queue pair and is counted. A window's key
//! is refused on another client's queue pair, after its lease is given
//! back, and after its client was cut off. Atomics on the index still work,
//! and frozen bits a client sets with them are thawed.
//!
//! Over rdma only (shm is one trust domain): the Soft-RoCE VM
//! (`scripts/rxe-vm.sh`) runs them with `--include-ignored`.

use std::time::{Duration, Instant};

use kv_client::Client;
use kv_common::layout::{Geometry, Slot, EPOCH_OFFSET, HEADER_SIZE};
use kv_common::protocol::{
    ConnectInfo, ErrorKind, Extent, Request, Response, Spent, PROTOCOL_VERSION,
};
use kv_common::transport::{self, ConnectOptions, Connection, Verb};
use kv_common::Address;
use onekv_tests::{eventually, rdma_host, region_dir, test_address, Daemon, TestServer};

const LOCAL: usize = 4096;

/// A raw connection that has sent Connect and attached the region.
struct Raw {
    conn: Box<dyn Connection>,
    info: ConnectInfo,
}

fn raw(srv: &TestServer) -> Raw {
    raw_at(&srv.address)
}

fn raw_at(address: &str) -> Raw {
    let address: Address = address.parse().expect("the server's address");
    let mut conn = transport::connect(&address, &ConnectOptions::default()).expect("connected");
    let hello = Request::Connect {
        protocol_version: PROTOCOL_VERSION,
        secret: vec![],
        group: 0,
    };
    let Ok(Response::Connected(info)) = conn.call(&hello) else {
        panic!("not admitted");
    };
    conn.attach(&info.region, LOCAL).expect("attached");
    Raw { conn, info }
}

impl Raw {
    /// Leases one extent and takes its window's key.
    fn lease(&mut self) -> (Extent, u32) {
        match self.lease_keys() {
            (extent, keys) if keys.len() == 1 => {
                self.conn.allow_writes(extent, keys[0]);
                (extent, keys[0])
            }
            other => panic!("a lease with one window: {other:?}"),
        }
    }

    /// Leases one extent: it and the keys that came with it. While space
    /// given back waits out its grace period, the lease waits.
    fn lease_keys(&mut self) -> (Extent, Vec<u32>) {
        let give_up = Instant::now() + Duration::from_secs(10);
        loop {
            match self.conn.call(&Request::Lease { min_len: 64 }) {
                Ok(Response::Leased {
                    extents,
                    write_keys,
                }) if extents.len() == 1 => return (extents[0], write_keys),
                Ok(Response::Error {
                    kind: ErrorKind::HeapBusy,
                    ..
                }) if Instant::now() < give_up => std::thread::sleep(Duration::from_millis(1)),
                other => panic!("a lease of one extent: {other:?}"),
            }
        }
    }

    /// WRITEs `value` at `offset`: whether the device took it.
    fn write(&mut self, offset: u64, value: u64) -> bool {
        self.conn.local_mut()[..8].copy_from_slice(&value.to_le_bytes());
        let verb = Verb::Write {
            remote: offset,
            local: 0,
            len: 8,
        };
        self.conn.post(&[verb]).is_ok()
    }

    /// WRITEs `value` at `offset` through the window of key `key`, named
    /// for `extent` (a lease of another client's, or of an earlier one):
    /// whether the device took it.
    fn write_with(&mut self, extent: Extent, key: u32, offset: u64, value: u64) -> bool {
        self.conn.allow_writes(extent, key);
        self.write(offset, value)
    }

    /// Gives `extent` back, nothing carved from it, without forgetting its
    /// key.
    fn give_back(&mut self, extent: Extent) {
        let spent = Spent {
            extent,
            carved: 0,
            starts: Vec::new(),
        };
        let request = Request::GiveBack {
            spent: vec![spent],
            unlinked: vec![],
        };
        assert_eq!(self.conn.call(&request).ok(), Some(Response::GivenBack));
    }
}

fn server() -> TestServer {
    assert!(
        rdma_host().is_some(),
        "ONEKV_TEST_RDMA_HOST: these tests run over rdma (scripts/rxe-vm.sh sets it)"
    );
    // Room for a lease per attacker.
    TestServer::start(|c| c.memory = 64 << 20)
}

fn value(i: usize) -> Vec<u8> {
    format!("honest {i} {}", "v".repeat(i % 300)).into_bytes()
}

fn region_bytes(srv: &TestServer) -> Vec<u8> {
    std::fs::read(srv.region_path()).expect("the region file")
}

fn word_at(bytes: &[u8], offset: u64) -> u64 {
    let at = offset as usize;
    u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
}

fn random(n: u64) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(n);
    h.finish()
}

#[test]
#[ignore = "over rdma only: scripts/rxe-vm.sh runs it"]
fn a_hostile_client_changes_nothing_outside_its_own_leases() {
    let srv = server();
    let mut honest = Client::connect(&srv.address).unwrap();
    for i in 0..300 {
        honest.put(format!("key{i}").as_bytes(), value(i)).unwrap();
    }
    let faulted_before = honest.server_stats().unwrap().faulted_clients;
    let g: Geometry = raw(&srv).info.geometry;
    let before = region_bytes(&srv);
    let heap_end = g.heap_offset + g.heap_size;
    // Where an attacker would aim: the header and its epoch word, the key
    // table, the index, and anywhere in the heap (the honest client's
    // blocks, free space).
    let mut targets = vec![0, EPOCH_OFFSET, HEADER_SIZE + 8, g.index_offset];
    for n in 0..8u64 {
        let span = if n % 2 == 0 {
            (g.index_offset, g.index_offset + g.bucket_count * 64)
        } else {
            (g.heap_offset, heap_end)
        };
        targets.push((span.0 + random(n) % (span.1 - span.0 - 8)) & !7);
    }
    let mut own: Vec<Extent> = Vec::new();
    let mut attempts = 0;
    for (n, &target) in targets.iter().enumerate() {
        let mut hostile = raw(&srv);
        let (lease, key) = hostile.lease();
        own.push(lease);
        // Its own lease takes its writes.
        assert!(
            hostile.write(lease.offset, 0x5eed),
            "a write into its own lease"
        );
        // Through the region's key, through its own window's key (named
        // for the target's range), or just past its lease.
        let target = match n % 3 {
            0 => target,
            1 => {
                hostile.conn.allow_writes(
                    Extent {
                        offset: target,
                        len: 8,
                    },
                    key,
                );
                target
            }
            _ => lease.offset + lease.len,
        };
        let beyond = target + 8 > g.region_len;
        if beyond
            || own
                .iter()
                .any(|e| e.offset <= target && target < e.offset + e.len)
        {
            continue;
        }
        attempts += 1;
        assert!(
            !hostile.write(target, 0xbad0_bad0_bad0_bad0),
            "a WRITE at {target} (attempt {n}) outside the client's lease {lease:?} was taken"
        );
    }
    let after = region_bytes(&srv);
    let mine = |at: usize| {
        own.iter()
            .any(|e| e.offset as usize <= at && at < (e.offset + e.len) as usize)
    };
    let changed: Vec<usize> = (0..before.len().min(after.len()))
        .filter(|&at| before[at] != after[at] && !mine(at))
        .collect();
    assert!(
        changed.is_empty(),
        "{} bytes changed outside the attackers' leases (first at {:?})",
        changed.len(),
        changed.first()
    );
    for i in 0..300 {
        let key = format!("key{i}");
        assert_eq!(honest.get(key.as_bytes()).unwrap(), Some(value(i)), "{key}");
    }
    // The server saw every violation as one and cut its client off.
    eventually("the violations counted", Duration::from_secs(20), || {
        honest
            .server_stats()
            .is_ok_and(|s| s.faulted_clients >= faulted_before + attempts)
    });
}

#[test]
#[ignore = "over rdma only: scripts/rxe-vm.sh runs it"]
fn a_window_key_works_only_for_its_client_while_its_lease_lasts() {
    let srv = server();
    let word = |at: u64| word_at(&region_bytes(&srv), at);

    // Another client's key, on one's own queue pair.
    let mut a = raw(&srv);
    let (ea, ka) = a.lease();
    assert!(a.write(ea.offset, 0xa1));
    assert!(
        !raw(&srv).write_with(ea, ka, ea.offset + 8, 0xb1),
        "another client's key was taken"
    );
    assert_eq!(word(ea.offset + 8), 0, "the foreign write landed");

    // A lease given back: its key no longer writes.
    a.give_back(ea);
    assert!(
        !a.write(ea.offset + 16, 0xa2),
        "a given-back lease's key was taken"
    );
    assert_ne!(
        word(ea.offset + 16),
        0xa2,
        "the write after the give-back landed"
    );

    // A client cut off (it broke the rules): its old key on its new
    // connection.
    let mut c = raw(&srv);
    let (ec, kc) = c.lease();
    assert!(c.write(ec.offset, 0xc1));
    assert!(!c.write(HEADER_SIZE + 16, 0xc0), "a write to the key table");
    let mut observer = Client::connect(&srv.address).unwrap();
    eventually("the client cut off", Duration::from_secs(20), || {
        observer
            .server_stats()
            .is_ok_and(|s| s.faulted_clients >= 1)
    });
    assert!(
        !raw(&srv).write_with(ec, kc, ec.offset + 8, 0xc2),
        "a fenced client's key was taken"
    );
    assert_ne!(word(ec.offset + 8), 0xc2, "the fenced key's write landed");
    assert_eq!(word(ec.offset), 0xc1, "the write before the fence is there");
}

#[test]
#[ignore = "over rdma only: scripts/rxe-vm.sh runs it"]
fn the_index_takes_atomics_and_no_writes() {
    let srv = server();
    let mut honest = Client::connect(&srv.address).unwrap();
    honest.put(b"slot", b"value").unwrap();
    let mut r = raw(&srv);
    let g = r.info.geometry;
    let bytes = region_bytes(&srv);
    let (slot, held) = (0..g.bucket_count * 8)
        .map(|i| g.index_offset + i * 8)
        .map(|at| (at, word_at(&bytes, at)))
        .find(|&(_, w)| w != 0)
        .expect("a slot in use");
    // A CAS that leaves the slot as it is succeeds and returns it.
    let cas = Verb::Cas {
        remote: slot,
        local: 0,
        expect: held,
        swap: held,
    };
    r.conn.post(&[cas]).expect("a CAS on the index");
    assert_eq!(kv_common::transport::read_u64(r.conn.local(), 0), held);
    // A WRITE of the very same value is refused.
    assert!(!r.write(slot, held), "a WRITE into the index was taken");
    assert_eq!(honest.get(b"slot").unwrap(), Some(b"value".to_vec()));
}

/// What confining writes costs a lease, printed for the note
/// (`RXE-LEASES`): leases given back at once, in turns from a daemon that
/// confines writes and from one that lets clients write anywhere
/// (`ONEKV_RDMA_WRITES=open`), which hands out no keys. Space given back
/// uncarved waits a grace period where writes are confined (a WRITE begun
/// before its window went may still land): 4 ms here.
#[test]
#[ignore = "over rdma only: scripts/rxe-vm.sh runs it"]
fn a_lease_costs_a_window_only_where_writes_are_confined() {
    const ROUNDS: u32 = 200;
    assert!(
        rdma_host().is_some(),
        "ONEKV_TEST_RDMA_HOST: over rdma only"
    );
    let dir = region_dir();
    let daemon = |name: &str, env: &[(&str, &str)]| {
        let region = dir.path().join(name);
        let args = ["--memory", "64MiB", "--op-deadline-ms", "1"];
        Daemon::start_with_env(&test_address(&region), &region, &args, env)
    };
    let confined = daemon("confined", &[]);
    let open = daemon("open", &[("ONEKV_RDMA_WRITES", "open")]);
    let leases_per_second = |d: &Daemon, keys: usize| {
        let mut r = raw_at(&d.address.to_string());
        let started = Instant::now();
        for _ in 0..ROUNDS {
            let (extent, got) = r.lease_keys();
            assert_eq!(got.len(), keys, "keys with a lease from {}", d.address);
            r.give_back(extent);
        }
        f64::from(ROUNDS) / started.elapsed().as_secs_f64()
    };
    let mut rates = (Vec::new(), Vec::new());
    for _ in 0..3 {
        rates.0.push(leases_per_second(&confined, 1));
        rates.1.push(leases_per_second(&open, 0));
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (with, without) = (median(&mut rates.0), median(&mut rates.1));
    println!(
        "RXE-LEASES: {with:.0} leases/s (each leased and given back) confined to windows, \
         {without:.0} open: {:.2}x (median of 3, {ROUNDS} each)",
        with / without
    );
}

/// Frozen bits are an atomic away for any client: one that CASes them onto
/// the slots of keys others write stalls nobody for long, as the server
/// thaws them (writers meeting one tell it), and readers see no wrong value
/// meanwhile.
#[test]
#[ignore = "over rdma only: scripts/rxe-vm.sh runs it"]
fn slots_a_client_freezes_by_cas_are_thawed() {
    let srv = server();
    let mut honest = Client::connect(&srv.address).unwrap();
    let keys: Vec<String> = (0..20).map(|i| format!("key{i}")).collect();
    for k in &keys {
        honest.put(k.as_bytes(), b"before").unwrap();
    }
    let g = srv.server.geometry();
    let mut hostile = raw(&srv);
    let bytes = region_bytes(&srv);
    for k in &keys {
        let (pos, _) = srv.server.slots_of(k.as_bytes()).expect("slots")[0];
        let at = g.slot_offset(pos);
        let held = word_at(&bytes, at);
        let cas = Verb::Cas {
            remote: at,
            local: 0,
            expect: held,
            swap: Slot(held).frozen().0,
        };
        hostile.conn.post(&[cas]).expect("a CAS on the index");
        assert_eq!(
            kv_common::transport::read_u64(hostile.conn.local(), 0),
            held
        );
    }
    let reader_keys = keys.clone();
    let address = srv.address.clone();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stopped = stop.clone();
    let reader = std::thread::spawn(move || {
        let mut kv = Client::connect(&address).unwrap();
        let mut reads = 0usize;
        // At least one round, however soon the writer is done.
        loop {
            for k in &reader_keys {
                let v = kv.get(k.as_bytes()).unwrap();
                assert!(
                    matches!(v.as_deref(), Some(b"before") | Some(b"after")),
                    "{k}: {v:?}"
                );
                reads += 1;
            }
            if stopped.load(std::sync::atomic::Ordering::Relaxed) {
                return reads;
            }
        }
    });
    let (done_tx, done) = std::sync::mpsc::channel();
    let writer_keys = keys.clone();
    let writer = std::thread::spawn(move || {
        for k in &writer_keys {
            honest.put(k.as_bytes(), b"after").unwrap();
        }
        let _ = done_tx.send(());
        honest
    });
    // Without the thaw they would wait out the ten-minute resize wait.
    done.recv_timeout(Duration::from_secs(60))
        .expect("writers stalled on slots a client froze");
    let mut honest = writer.join().unwrap();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(reader.join().unwrap() >= keys.len());
    for k in &keys {
        assert_eq!(
            honest.get(k.as_bytes()).unwrap().as_deref(),
            Some(&b"after"[..])
        );
    }
    let stats = honest.server_stats().unwrap();
    assert!(stats.thawed_slots >= 1, "{stats:?}");
    assert_eq!(stats.resizes, 0, "{stats:?}");
}
