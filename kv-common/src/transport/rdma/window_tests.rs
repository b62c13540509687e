//! What limiting a client's writes will rely on (`docs/rdma.md`,
//! "Protection"), checked on the device itself rather than taken from the
//! specification: a registration without remote write takes reads and
//! atomics but no WRITE; a type-2 memory window admits writes from the
//! queue pair it was bound on and from no other, and none once
//! invalidated or rebound under a new key; and how far a window bounds
//! writes (Soft-RoCE is said to check only its parent registration).
//!
//! They need an RDMA device: the Soft-RoCE VM (`scripts/rxe-vm.sh`) runs
//! them with `--include-ignored`, naming its address in
//! `ONEKV_TEST_RDMA_HOST`.

use std::io::Write as _;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::verbs::{
    Completion, Completions, Cq, Mr, Mw, Op, Pd, Qp, QueueDepths, SendWr, LOCAL_ONLY, MW_BIND,
    REMOTE_ATOMIC, REMOTE_READ, REMOTE_WRITE,
};
use super::{device_for, source_gid, Overrides};
use crate::mapping::SharedRegion;

const LEN: u64 = 64 << 10;
/// The window: 4 KiB at 16 KiB.
const AT: u64 = 16 << 10;
const SPAN: u64 = 4 << 10;

/// A server's memory (a region file, registered twice as the server will:
/// reads and atomics for everyone, windows for writes) and both ends'
/// protection domains.
struct Setup {
    ip: IpAddr,
    server: Arc<Pd>,
    client: Arc<Pd>,
    region: Arc<SharedRegion>,
    read_atomic: Mr,
    bindable: Arc<Mr>,
    /// Where the client's verbs read from and land.
    local: Mr,
    _dir: tempfile::TempDir,
}

fn setup() -> Setup {
    let host = std::env::var("ONEKV_TEST_RDMA_HOST")
        .expect("ONEKV_TEST_RDMA_HOST: this host's RDMA address (scripts/rxe-vm.sh sets it)");
    let ip: IpAddr = host.parse().expect("ONEKV_TEST_RDMA_HOST is an IP address");
    let o = Overrides::from_env().expect("overrides");
    let device = device_for(ip, &o).expect("an RDMA device");
    assert!(
        device.memory_windows,
        "{} has no type-2 memory windows",
        device.name
    );
    let server = Pd::new(device.clone()).expect("a protection domain");
    let client = Pd::new(device).expect("a protection domain");
    let dir = tempfile::tempdir().expect("a directory");
    let path = dir.path().join("region");
    let file = std::fs::File::create_new(&path).expect("a region file");
    file.set_len(LEN).expect("sized");
    let region = Arc::new(SharedRegion::from_file(&file, &path, LEN).expect("mapped"));
    let read_atomic = Mr::region(
        &server,
        region.clone(),
        LOCAL_ONLY | REMOTE_READ | REMOTE_ATOMIC,
    )
    .expect("registered for reads and atomics");
    let bindable = Arc::new(
        Mr::region(&server, region.clone(), LOCAL_ONLY | MW_BIND).expect("registered for windows"),
    );
    let local = Mr::alloc(&client, 4096, LOCAL_ONLY).expect("a local buffer");
    Setup {
        ip,
        server,
        client,
        region,
        read_atomic,
        bindable,
        local,
        _dir: dir,
    }
}

impl Setup {
    /// A connected pair of queue pairs: the server's end and the client's.
    fn pair(&self) -> (Qp, Qp) {
        let o = Overrides::from_env().expect("overrides");
        let qp = |pd: &Arc<Pd>| {
            let source = source_gid(&pd.device, self.ip, &o).expect("a GID");
            let send = Cq::new(&pd.device, 16, Completions::Polled).expect("a queue");
            let recv = Cq::new(&pd.device, 16, Completions::Polled).expect("a queue");
            let depths = QueueDepths { send: 8, recv: 1 };
            Qp::new(pd, send, recv, depths, source).expect("a queue pair")
        };
        let (server, client) = (qp(&self.server), qp(&self.client));
        server.connect(&client.endpoint()).expect("connected");
        client.connect(&server.endpoint()).expect("connected");
        (server, client)
    }

    /// Posts `op` (8 bytes from or into the local buffer) on `qp`: whether
    /// it completed.
    fn try_op(&mut self, qp: &Qp, op: Op) -> bool {
        let wr = SendWr {
            wr_id: 1,
            op,
            local_addr: self.local.addr(),
            len: 8,
            lkey: self.local.lkey(),
        };
        qp.post_send(&[wr]).expect("posted");
        completion(&qp.send_cq).ok()
    }

    /// WRITEs `value` at `offset` of the region from `qp`, through `via`:
    /// the address of the registration's start, and the key of it or of a
    /// window on it.
    fn write(&mut self, qp: &Qp, via: (u64, u32), offset: u64, value: u64) -> bool {
        let (base, rkey) = via;
        self.local.bytes_mut()[..8].copy_from_slice(&value.to_le_bytes());
        let op = Op::Write {
            remote_addr: base + offset,
            rkey,
        };
        self.try_op(qp, op)
    }

    /// Posts `ops` on `qp` as one batch (work request `i` for `ops[i]`,
    /// each on its own 8 bytes of the local buffer): their completions, in
    /// the order the device gave them.
    fn batch(&mut self, qp: &Qp, ops: Vec<Op>) -> Vec<Completion> {
        let wrs: Vec<SendWr> = ops
            .into_iter()
            .enumerate()
            .map(|(i, op)| SendWr {
                wr_id: i as u64,
                op,
                local_addr: self.local.addr() + 8 * i as u64,
                len: 8,
                lkey: self.local.lkey(),
            })
            .collect();
        qp.post_send(&wrs).expect("posted");
        wrs.iter().map(|_| completion(&qp.send_cq)).collect()
    }

    fn word(&self, offset: u64) -> u64 {
        self.region.load(offset).expect("in the region")
    }

    /// Binds `mw` over the window on the server's end `qp`: its key.
    fn bind(&self, qp: &Qp, mw: &mut Mw) -> u32 {
        let rkey = qp
            .bind(mw, &self.bindable, AT..AT + SPAN, REMOTE_WRITE)
            .expect("bind posted");
        let done = completion(&qp.send_cq);
        assert!(done.ok(), "bind: {}", done.status_text());
        rkey
    }

    /// A fresh pair and a window bound on its server's end: the server's
    /// end, the client's, the window and its key.
    fn bound_pair(&self) -> (Qp, Qp, Mw, u32) {
        let (server, client) = self.pair();
        let mut mw = Mw::alloc(&self.server).expect("a window");
        let rkey = self.bind(&server, &mut mw);
        (server, client, mw, rkey)
    }

    /// Where a write through the window of key `rkey` goes.
    fn window(&self, rkey: u32) -> (u64, u32) {
        (self.bindable.addr(), rkey)
    }
}

/// Invalidates the window of key `rkey` on the server's end `qp`.
fn invalidate(qp: &Qp, rkey: u32) {
    qp.invalidate(rkey).expect("invalidate posted");
    let done = completion(&qp.send_cq);
    assert!(done.ok(), "invalidate: {}", done.status_text());
}

fn completion(cq: &Cq) -> Completion {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut out = Vec::new();
    while out.is_empty() {
        cq.poll(&mut out, 1).expect("polled");
        assert!(Instant::now() < deadline, "no completion within 10 s");
    }
    out[0]
}

#[test]
#[ignore = "needs an RDMA device: run by scripts/rxe-vm.sh"]
fn a_registration_without_remote_write_takes_reads_and_atomics_but_no_write() {
    let mut s = setup();
    let (_server, client) = s.pair();
    let (base, rkey) = (s.read_atomic.addr(), s.read_atomic.rkey());
    s.region.store(0, 41).expect("stored");
    assert!(s.try_op(
        &client,
        Op::Read {
            remote_addr: base,
            rkey
        }
    ));
    assert_eq!(s.local.bytes()[..8], 41u64.to_le_bytes());
    let cas = Op::Cas {
        remote_addr: base + 8,
        rkey,
        expect: 0,
        swap: 7,
    };
    assert!(s.try_op(&client, cas), "CAS refused");
    assert_eq!(s.word(8), 7);
    assert!(
        !s.write(&client, (base, rkey), 16, u64::MAX),
        "a WRITE went through"
    );
    assert_eq!(s.word(16), 0);
}

#[test]
#[ignore = "needs an RDMA device: run by scripts/rxe-vm.sh"]
fn a_window_admits_writes_from_its_queue_pair_only_and_none_once_invalidated() {
    let mut s = setup();
    let (server, client, _mw, rkey) = s.bound_pair();
    assert!(
        s.write(&client, s.window(rkey), AT, 1),
        "the window's own write refused"
    );
    assert_eq!(s.word(AT), 1);

    // Another client's queue pair, even on the same protection domains.
    let (_other_server, other) = s.pair();
    assert!(
        !s.write(&other, s.window(rkey), AT + 8, 2),
        "another queue pair wrote"
    );
    assert_eq!(s.word(AT + 8), 0);

    invalidate(&server, rkey);
    assert!(
        !s.write(&client, s.window(rkey), AT + 16, 3),
        "an invalidated window wrote"
    );
    assert_eq!(s.word(AT + 16), 0);
}

#[test]
#[ignore = "needs an RDMA device: run by scripts/rxe-vm.sh"]
fn a_window_bound_again_under_a_new_key_refuses_the_old_one() {
    let mut s = setup();
    let (server, client, mut mw, old) = s.bound_pair();
    invalidate(&server, old);
    let new = s.bind(&server, &mut mw);
    assert_ne!(old, new);
    assert!(
        s.write(&client, s.window(new), AT, 1),
        "the new key refused"
    );
    assert!(
        !s.write(&client, s.window(old), AT + 8, 2),
        "the old key wrote"
    );
    assert_eq!((s.word(AT), s.word(AT + 8)), (1, 0));
}

/// Reports whether the window itself bounds writes (the specification
/// says it does; Soft-RoCE was read not to), which decides how large the
/// registrations under a lease's window may be.
#[test]
#[ignore = "needs an RDMA device: run by scripts/rxe-vm.sh"]
fn how_far_a_window_bounds_writes() {
    let mut s = setup();
    let (_server, client, _mw, rkey) = s.bound_pair();
    let outside = AT + SPAN;
    let escaped = s.write(&client, s.window(rkey), outside, 5);
    let landed = s.word(outside) == 5;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(
        out,
        "RXE-WINDOW: a write just past a {SPAN}-byte window, inside its registration: {}",
        match (escaped, landed) {
            (true, true) => "went through (the window does not bound it)",
            (false, false) => "refused (the window bounds it)",
            _ => "reported one way and landed the other",
        }
    );
    assert_eq!(escaped, landed, "the completion and the memory disagree");
}

/// What protecting one lease costs the server, printed for the note: a
/// bind and an invalidate on a window allocated ahead, and the whole of a
/// lease's window as the server makes it (registering the extent,
/// allocating and binding the window, then invalidating and freeing both).
#[test]
#[ignore = "needs an RDMA device: run by scripts/rxe-vm.sh"]
fn what_a_window_costs() {
    const ROUNDS: u32 = 200;
    let s = setup();
    let (server, _client) = s.pair();
    let mut mw = Mw::alloc(&s.server).expect("a window");
    let started = Instant::now();
    for _ in 0..ROUNDS {
        let rkey = s.bind(&server, &mut mw);
        invalidate(&server, rkey);
    }
    let bind_us = started.elapsed().as_secs_f64() * 1e6 / f64::from(ROUNDS);
    let started = Instant::now();
    for _ in 0..ROUNDS {
        let extent = Arc::new(
            Mr::range(&s.server, s.region.clone(), AT, SPAN, LOCAL_ONLY | MW_BIND)
                .expect("an extent registered"),
        );
        let mut mw = Mw::alloc(&s.server).expect("a window");
        let rkey = server
            .bind(&mut mw, &extent, 0..SPAN, REMOTE_WRITE)
            .expect("bind posted");
        assert!(completion(&server.send_cq).ok());
        invalidate(&server, rkey);
    }
    let lease_us = started.elapsed().as_secs_f64() * 1e6 / f64::from(ROUNDS);
    let d = &s.server.device;
    let atomics = match d.atomic_cap {
        rdma_sys::ibv_atomic_cap::IBV_ATOMIC_GLOB => "global",
        rdma_sys::ibv_atomic_cap::IBV_ATOMIC_HCA => "within the adapter",
        _ => "none",
    };
    let mut out = std::io::stdout().lock();
    let _ = writeln!(
        out,
        "RXE-DEVICE: {}: atomics {atomics}, type-2 memory windows {}, {} READs/atomics in flight per queue pair",
        d.name,
        if d.memory_windows { "yes" } else { "no" },
        d.max_rd_atomic
    );
    let _ = writeln!(
        out,
        "RXE-WINDOW: bind + invalidate {bind_us:.1} us; a lease's whole window \
         (register {SPAN} bytes, allocate, bind, invalidate, free) {lease_us:.1} us \
         (mean of {ROUNDS})"
    );
}

/// A batch whose first work request is refused runs none of the rest (the
/// queue pair goes to error there, in order, and flushes them), and one
/// refused further on ran those before it: what lets a client redo a
/// batch turned away at its first verb (`TransportError::TurnedAway`)
/// and not one refused later.
#[test]
#[ignore = "needs an RDMA device: run by scripts/rxe-vm.sh"]
fn a_batch_refused_at_its_first_request_runs_none_of_it() {
    let mut s = setup();
    let (base, rkey) = (s.read_atomic.addr(), s.read_atomic.rkey());
    // A WRITE under the key that takes none, and a CAS that would land.
    let refused = || Op::Write {
        remote_addr: base + 16,
        rkey,
    };
    let cas = |at: u64| Op::Cas {
        remote_addr: base + at,
        rkey,
        expect: 0,
        swap: 7,
    };
    let (_server, client) = s.pair();
    let done = s.batch(&client, vec![refused(), cas(8)]);
    assert!(
        done[0].is_remote_access_error() && done[0].wr_id == 0,
        "{done:?}"
    );
    assert!(done[1].is_flushed(), "{done:?}");
    assert_eq!(s.word(8), 0, "a CAS after the refused request ran");
    assert!(super::batch_error(&done[0]).ran_nothing());

    let (_server, client) = s.pair();
    let done = s.batch(&client, vec![cas(24), refused(), cas(32)]);
    let bad = done.iter().find(|c| !c.ok()).expect("a refusal");
    assert!(bad.is_remote_access_error() && bad.wr_id == 1, "{done:?}");
    assert_eq!((s.word(24), s.word(32)), (7, 0));
    assert!(!super::batch_error(bad).ran_nothing());
}
