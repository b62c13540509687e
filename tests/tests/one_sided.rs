//! The data path is one-sided: during a steady GET/PUT/DELETE loop the
//! server's control plane handles no message except heap leases, and each
//! operation takes the round trips the design promises.

use std::time::Duration;

use kv_client::{Client, ClientOptions, ReadOrder};
use onekv_tests::TestServer;

#[test]
fn steady_loop_sends_no_control_messages_beyond_leases() {
    let srv = TestServer::start(|_| {});
    let mut kv = Client::connect(&srv.address).unwrap();
    for i in 0..200 {
        kv.put(format!("warm-{i}").as_bytes(), [7u8; 1024]).unwrap();
    }
    let before = srv.server.stats();
    let mut value = Vec::new();
    for i in 0..20_000u32 {
        let key = format!("warm-{}", i % 200);
        match i % 4 {
            0 => kv.put(key.as_bytes(), i.to_le_bytes().repeat(256)).unwrap(),
            3 if i % 40 == 3 => {
                kv.delete(key.as_bytes()).unwrap();
            }
            _ => {
                kv.get_into(key.as_bytes(), &mut value).unwrap();
            }
        }
    }
    let after = srv.server.stats();
    let messages = after.messages() - before.messages();
    let leases = after.leases - before.leases;
    let heap = leases + after.give_backs - before.give_backs;
    assert_eq!(
        messages, heap,
        "control messages other than heap leases: {before:?} → {after:?}"
    );
    assert!(
        leases < 20,
        "{leases} leases for a bounded working set: space is not being reused"
    );
}

/// Clients that keep the slot hints of `entries` keys (0: none).
fn hinted(address: &str, entries: usize) -> Client {
    let options = ClientOptions::default().with_slot_cache_entries(entries);
    Client::connect_with(address, options).unwrap()
}

#[test]
fn operations_take_the_promised_round_trips() {
    // A long deadline, so that hints stay fresh however slow the machine:
    // a hint settles three deadlines after its copy appeared, and is used
    // in one round trip for two deadlines after it was last confirmed.
    let deadline = Duration::from_millis(600);
    let srv = TestServer::start(|c| c.op_deadline = deadline);
    let mut kv = hinted(&srv.address, 1024);
    kv.put(b"warm", b"up").unwrap(); // takes the first lease
    let rt = |kv: &Client| kv.verb_stats().round_trips;
    let took = |kv: &mut Client, op: &dyn Fn(&mut Client)| {
        let at = rt(kv);
        op(kv);
        rt(kv) - at
    };
    // Warm GETs a deadline apart (each while the last sighting is fresh)
    // until the copy is three deadlines old.
    let settle = |kv: &mut Client, get: &dyn Fn(&mut Client)| {
        for pause in [deadline, deadline, deadline + Duration::from_millis(100)] {
            std::thread::sleep(pause);
            assert_eq!(took(kv, get), 1, "warm get");
        }
    };
    let put = |v: u8| move |kv: &mut Client| kv.put(b"k", [v; 1024]).unwrap();
    let get = |v: u8| move |kv: &mut Client| assert_eq!(kv.get(b"k").unwrap(), Some(vec![v; 1024]));

    assert_eq!(
        took(&mut kv, &put(1)),
        2,
        "insert: write+buckets, CAS+buckets"
    );
    assert_eq!(
        took(&mut kv, &put(2)),
        2,
        "young copy: write+buckets+block, CAS"
    );
    assert_eq!(
        took(&mut kv, &get(2)),
        1,
        "warm get: buckets and block in one batch"
    );
    // Once no other insert of the key can still land (three deadlines), a
    // sighting that shows it alone lets updates and deletes go without
    // reading.
    settle(&mut kv, &get(2));
    assert_eq!(
        took(&mut kv, &put(3)),
        1,
        "warm update: write and CAS in one batch"
    );
    assert_eq!(took(&mut kv, &get(3)), 1, "warm get after a warm update");

    // A client that has not seen the key: buckets, then block; then warm.
    let mut other = hinted(&srv.address, 1024);
    assert_eq!(took(&mut other, &get(3)), 2, "cold get: buckets, block");
    assert_eq!(took(&mut other, &get(3)), 1, "warm get");
    // Its hint goes stale when another client updates the key: the slot no
    // longer matches, and the buckets read with it lead to the block.
    assert_eq!(took(&mut kv, &put(4)), 1, "warm update");
    assert_eq!(
        took(&mut other, &get(4)),
        2,
        "stale hint: buckets+block, block"
    );

    // Without hints: every operation reads the buckets first.
    let mut cold = hinted(&srv.address, 0);
    assert_eq!(
        took(&mut cold, &put(5)),
        3,
        "cold update: write+buckets, block, CAS"
    );
    assert_eq!(took(&mut cold, &get(5)), 2, "cold get: buckets, block");

    // A settled hint reads only its slot's word with the block: when
    // another client has written the key, the buckets come next.
    assert_eq!(
        took(&mut kv, &get(5)),
        3,
        "stale settled hint: slot+block, buckets, block"
    );
    settle(&mut kv, &get(5));
    let delete = |kv: &mut Client| assert!(kv.delete(b"k").unwrap());
    assert_eq!(took(&mut kv, &delete), 1, "warm delete: one CAS");
    let missing = |kv: &mut Client| assert_eq!(kv.get(b"k").unwrap(), None);
    assert!(
        took(&mut kv, &missing) <= 2,
        "missing key: buckets (and a fingerprint false positive at most)"
    );
    cold.put(b"k", [6; 1024]).unwrap();
    assert_eq!(
        took(&mut cold, &delete),
        3,
        "cold delete: buckets, block, CAS"
    );
}

/// Reads the keys in batches a deadline apart until their copies are three
/// deadlines old: their hints then allow one-round-trip batches.
fn settle_batch(kv: &mut Client, keys: &[String], deadline: Duration) {
    for pause in [
        Duration::ZERO,
        deadline,
        deadline,
        deadline + Duration::from_millis(100),
    ] {
        std::thread::sleep(pause);
        kv.get_many(keys).unwrap();
    }
}

#[test]
fn a_batch_of_gets_takes_two_round_trips_cold_and_one_warm() {
    let deadline = Duration::from_millis(600);
    let srv = TestServer::start(|c| c.op_deadline = deadline);
    let mut writer = hinted(&srv.address, 0);
    let keys: Vec<String> = (0..16).map(|i| format!("batch-{i}")).collect();
    for (i, k) in keys.iter().enumerate() {
        writer.put(k.as_bytes(), [i as u8; 1000]).unwrap();
    }
    writer.incr(b"batch-counter", 7).unwrap();
    let mut asked = keys.clone();
    asked.push("batch-missing".into());
    asked.push("batch-counter".into());
    let expected: Vec<Option<Vec<u8>>> = (0..16)
        .map(|i| Some(vec![i as u8; 1000]))
        .chain([None, Some(b"7".to_vec())])
        .collect();
    let rt = |kv: &Client| kv.verb_stats().round_trips;

    let mut cold = hinted(&srv.address, 0);
    let at = rt(&cold);
    assert_eq!(cold.get_many(&asked).unwrap(), expected);
    assert_eq!(rt(&cold) - at, 2, "18 keys cold: windows, then blocks");
    let at = rt(&cold);
    for k in &asked {
        cold.get(k.as_bytes()).unwrap();
    }
    assert!(rt(&cold) - at >= 35, "18 single GETs: two round trips each");

    // With hints: sightings a deadline apart until the copies are three
    // deadlines old, then the batch reads slot words and blocks only.
    let mut warm = hinted(&srv.address, 64);
    settle_batch(&mut warm, &asked, deadline);
    assert_eq!(warm.get_many(&asked).unwrap(), expected);
    let at = rt(&warm);
    assert_eq!(warm.get_many(&asked).unwrap(), expected);
    assert_eq!(rt(&warm) - at, 1, "18 keys with settled hints");
    // Beyond one batch's 32 keys: several, each two round trips.
    let many: Vec<String> = (0..70).map(|i| format!("batch-{}", i % 16)).collect();
    let at = rt(&cold);
    let got = cold.get_many(&many).unwrap();
    assert_eq!(got[69], Some(vec![5; 1000]));
    assert_eq!(
        rt(&cold) - at,
        6,
        "70 keys: three batches of windows and blocks"
    );
}

#[test]
fn batches_of_puts_and_deletes_take_three_round_trips_cold_and_one_warm() {
    let deadline = Duration::from_millis(600);
    let srv = TestServer::start(|c| c.op_deadline = deadline);
    let rt = |kv: &Client| kv.verb_stats().round_trips;
    let keys: Vec<String> = (0..16).map(|i| format!("many-{i}")).collect();
    let pairs = |v: u8| -> Vec<(String, Vec<u8>)> {
        keys.iter().map(|k| (k.clone(), vec![v; 900])).collect()
    };
    let mut cold = hinted(&srv.address, 0);
    cold.put(b"warm", b"up").unwrap(); // takes the first lease
    let at = rt(&cold);
    cold.put_many(&pairs(1)).unwrap();
    let inserts = rt(&cold) - at;
    // Inserts: blocks+windows, (no blocks to read), CASes+windows; a
    // fingerprint shared with another key costs its duplicate check a read.
    assert!((2..=5).contains(&inserts), "16 inserts took {inserts}");
    let at = rt(&cold);
    cold.put_many(&pairs(2)).unwrap();
    assert_eq!(
        rt(&cold) - at,
        3,
        "16 updates: blocks+windows, blocks, CASes"
    );
    let values = cold.get_many(&keys).unwrap();
    assert!(values.iter().all(|v| v.as_deref() == Some(&[2u8; 900][..])));

    // Settled hints: WRITE and CAS of every key in one batch.
    let mut warm = hinted(&srv.address, 64);
    settle_batch(&mut warm, &keys, deadline);
    warm.put(b"warm", b"up").unwrap();
    let at = rt(&warm);
    warm.put_many(&pairs(3)).unwrap();
    assert_eq!(rt(&warm) - at, 1, "16 updates with settled hints");
    let values = cold.get_many(&keys).unwrap();
    assert!(values.iter().all(|v| v.as_deref() == Some(&[3u8; 900][..])));
    // Deletes: windows, blocks, CASes; one batch with settled hints.
    let at = rt(&cold);
    let mut gone = keys[..8].to_vec();
    gone.push("never-there".into());
    let mut expected = vec![true; 8];
    expected.push(false);
    assert_eq!(cold.delete_many(&gone).unwrap(), expected);
    assert_eq!(rt(&cold) - at, 3, "9 cold deletes: windows, blocks, CASes");
    let at = rt(&warm);
    assert_eq!(warm.delete_many(&keys[8..]).unwrap(), vec![true; 8]);
    assert_eq!(rt(&warm) - at, 1, "8 deletes with settled hints");
    assert!(cold.get_many(&keys).unwrap().iter().all(Option::is_none));
    // A key given twice ends with its last value.
    cold.put_many(&[("twice", "a"), ("other", "b"), ("twice", "c")])
        .unwrap();
    assert_eq!(cold.get(b"twice").unwrap().as_deref(), Some(&b"c"[..]));
}

/// Two keys with the same windows and fingerprint: each GET of one must
/// also consider the other's slot.
fn keys_sharing_a_fingerprint(bucket_count: u64) -> (Vec<u8>, Vec<u8>) {
    use kv_common::layout::KeyHash;
    let mut seen = std::collections::HashMap::new();
    for i in 0u64.. {
        let key = format!("twin-{i}").into_bytes();
        let kh = KeyHash::new(&key, bucket_count);
        if let Some(other) = seen.insert((kh.windows, kh.fingerprint), key.clone()) {
            return (other, key);
        }
    }
    unreachable!("the search ends once two keys collide")
}

/// Two keys sharing a fingerprint and windows, holding 1000-byte values
/// (`first` in the lower slot), on a server whose deadline no stall
/// between two operations reaches (an operation whose clock starts late
/// would read again, see
/// `a_get_after_a_pause_longer_than_the_deadline_reads_again_and_finds_the_value`),
/// and a client without hints (on by default over rdma): every operation
/// reads the buckets. (server, client, first, second)
fn twins_stored() -> (TestServer, Client, Vec<u8>, Vec<u8>) {
    let srv = TestServer::start(|c| c.op_deadline = Duration::from_secs(2));
    let mut kv = hinted(&srv.address, 0);
    let (first, second) = keys_sharing_a_fingerprint(kv.geometry().bucket_count);
    // In an empty index the first insert takes the first slot of the lower
    // window and the second the next bucket's: the first is the lower slot.
    kv.put(&first, [1; 1000]).unwrap();
    kv.put(&second, [2; 1000]).unwrap();
    (srv, kv, first, second)
}

/// The round trips and bytes read that `op` took.
fn cost(kv: &mut Client, op: &dyn Fn(&mut Client)) -> (u64, u64) {
    let before = kv.verb_stats();
    op(kv);
    let after = kv.verb_stats().since(&before);
    (after.round_trips, after.bytes_read)
}

/// The bytes of a key's two windows.
const WINDOWS: u64 = 2 * 192;

#[test]
fn a_get_reads_only_the_blocks_it_needs() {
    let (srv, mut kv, first, second) = twins_stored();
    let block = 1280; // the size class of a 1000-byte value with its key
    let read = |kv: &mut Client, key: &[u8]| {
        cost(kv, &|kv: &mut Client| {
            kv.get(key).unwrap().unwrap();
        })
    };
    if srv.address.starts_with("shm://") {
        // A batch costs nothing over shm: the second block is not read
        // when the first holds the key, and read after it when not.
        assert_eq!(read(&mut kv, &first), (2, WINDOWS + block));
        assert_eq!(read(&mut kv, &second), (3, WINDOWS + 2 * block));
    } else {
        // A round trip is the cost over rdma: both blocks in one.
        assert_eq!(read(&mut kv, &first), (2, WINDOWS + 2 * block));
        assert_eq!(read(&mut kv, &second), (2, WINDOWS + 2 * block));
    }
}

#[test]
fn a_write_reads_only_the_heads_of_the_blocks_it_replaces() {
    use kv_common::layout::block_head_len;
    let (srv, mut kv, first, second) = twins_stored();
    // Each candidate (both share the fingerprint) read only as far as the
    // head of a block of the writer's key: a PUT or DELETE replaces the
    // value, so it need not read it.
    assert_eq!(first.len(), second.len());
    let heads = 2 * block_head_len(first.len()) as u64;
    let put = |kv: &mut Client| kv.put(&second, [3; 1000]).unwrap();
    assert_eq!(
        cost(&mut kv, &put),
        (3, WINDOWS + heads),
        "write+windows, heads, CAS"
    );
    let delete = |kv: &mut Client| assert!(kv.delete(&first).unwrap());
    assert_eq!(
        cost(&mut kv, &delete),
        (3, WINDOWS + heads),
        "windows, heads, CAS"
    );
    assert_eq!(kv.get(&first).unwrap(), None);
    assert_eq!(kv.get(&second).unwrap(), Some(vec![3; 1000]));
    // With a hint (not yet sole): the windows and the hinted block's head
    // in the batch of the block's WRITE, then the CAS.
    let mut warm = hinted(&srv.address, 1024);
    warm.put(b"alone", [4; 1000]).unwrap();
    assert_eq!(warm.get(b"alone").unwrap(), Some(vec![4; 1000]));
    let put = |kv: &mut Client| kv.put(b"alone", [5; 1000]).unwrap();
    let head = block_head_len(b"alone".len()) as u64;
    assert_eq!(
        cost(&mut warm, &put),
        (2, WINDOWS + head),
        "write+windows+head, CAS"
    );
    assert_eq!(warm.get(b"alone").unwrap(), Some(vec![5; 1000]));
    // A batch of writes (updates here) reads the heads as well.
    kv.put(&first, [1; 1000]).unwrap();
    let pairs = [
        (first.clone(), vec![6; 1000]),
        (second.clone(), vec![7; 1000]),
    ];
    let put_many = |kv: &mut Client| kv.put_many(&pairs).unwrap();
    let batch = cost(&mut kv, &put_many);
    assert_eq!(
        batch,
        (3, 2 * (WINDOWS + heads)),
        "blocks+windows, heads, CASes"
    );
    assert_eq!(kv.get(&first).unwrap(), Some(vec![6; 1000]));
    // A counter's block is read whole (its words follow its key) and
    // stays one: a PUT over it seals and unlinks it as before.
    assert!(kv.delete(&first).unwrap());
    kv.incr(&first, 5).unwrap();
    kv.put(&first, b"plain").unwrap();
    assert_eq!(kv.get(&first).unwrap().as_deref(), Some(&b"plain"[..]));
    assert_eq!(kv.get(&second).unwrap(), Some(vec![7; 1000]));
}

/// A short key and a long one with the same windows and fingerprint.
fn short_and_long_twins(bucket_count: u64) -> (Vec<u8>, Vec<u8>) {
    use kv_common::layout::KeyHash;
    use std::collections::HashMap;
    let (mut short, mut long) = (HashMap::new(), HashMap::new());
    for i in 0u64.. {
        let s = format!("s{i}").into_bytes();
        let l = format!("a key far longer than its twin, whose head it overruns {i}").into_bytes();
        let (hs, hl) = (
            KeyHash::new(&s, bucket_count),
            KeyHash::new(&l, bucket_count),
        );
        if let Some(twin) = long.get(&(hs.windows, hs.fingerprint)) {
            return (s, Vec::clone(twin));
        }
        if let Some(twin) = short.get(&(hl.windows, hl.fingerprint)) {
            return (Vec::clone(twin), l);
        }
        short.insert((hs.windows, hs.fingerprint), s);
        long.insert((hl.windows, hl.fingerprint), l);
    }
    unreachable!("the search ends once two keys collide")
}

#[test]
fn a_writer_of_a_short_key_passes_over_a_longer_keys_block() {
    let srv = TestServer::start(|c| c.op_deadline = Duration::from_secs(2));
    let mut kv = hinted(&srv.address, 0);
    let (short, long) = short_and_long_twins(kv.geometry().bucket_count);
    // The long key's block (a value, then a counter) is a candidate of
    // every write of the short one, and its head is longer than the
    // short key's: read that far, it is another key's, not damage.
    for long_is_counter in [false, true] {
        match long_is_counter {
            false => kv.put(&long, [1; 100]).unwrap(),
            true => {
                kv.delete(&long).unwrap();
                kv.incr(&long, 7).unwrap();
            }
        }
        assert!(!kv.delete(&short).unwrap(), "absent");
        kv.put(&short, b"inserted").unwrap();
        kv.put(&short, b"updated").unwrap();
        kv.put_many(&[(&short[..], &b"batched"[..])]).unwrap();
        assert_eq!(kv.get(&short).unwrap().as_deref(), Some(&b"batched"[..]));
        assert!(kv.delete(&short).unwrap());
        assert_eq!(kv.get(&short).unwrap(), None);
    }
    assert_eq!(kv.get(&long).unwrap().as_deref(), Some(&b"7"[..]));
}

#[test]
fn a_get_after_a_pause_longer_than_the_deadline_reads_again_and_finds_the_value() {
    // Over shm a GET's clock starts at the thread's last clock reading (one
    // reading fewer per GET): after a pause that reading is too old, so the
    // first attempt is late, and the GET must read again, not trust it.
    // Long enough that no stall of a loaded machine between two GETs
    // passes for the pause.
    let deadline = Duration::from_millis(500);
    let srv = TestServer::start(|c| c.op_deadline = deadline);
    let mut kv = hinted(&srv.address, 0);
    kv.put(b"paused", [7; 100]).unwrap();
    let get = |kv: &mut Client| {
        let before = kv.verb_stats();
        assert_eq!(kv.get(b"paused").unwrap(), Some(vec![7; 100]));
        kv.verb_stats().since(&before).round_trips
    };
    std::thread::sleep(deadline + deadline / 2);
    let after_pause = get(&mut kv);
    let right_after = get(&mut kv);
    assert_eq!(right_after, 2, "buckets, then block");
    if srv.address.starts_with("shm://") {
        assert_eq!(after_pause, 4, "a late attempt, then buckets and block");
    } else {
        assert_eq!(after_pause, 2, "over rdma the clock is read at the start");
    }
}

#[test]
fn a_hint_past_its_life_still_guides_a_get_where_reads_run_in_order() {
    // A short deadline: a hint lives two deadlines after it was confirmed.
    let deadline = Duration::from_millis(5);
    let srv = TestServer::start(|c| c.op_deadline = deadline);
    let in_order = onekv_tests::rdma_host().is_none();
    let mut kv = hinted(&srv.address, 1024);
    let mut other = hinted(&srv.address, 0);
    let rt = |kv: &Client| kv.verb_stats().round_trips;
    let get = |kv: &mut Client, want: &[u8]| {
        let at = rt(kv);
        assert_eq!(kv.get(b"k").unwrap().as_deref(), Some(want));
        rt(kv) - at
    };
    kv.put(b"k", b"one").unwrap();
    get(&mut kv, b"one");
    std::thread::sleep(deadline * 10);
    // Over shm the batch reads the windows, then the block: one round
    // trip. Over rdma its READs may pass each other: buckets, then block.
    let (past_life, changed) = if in_order { (1, 2) } else { (2, 2) };
    assert_eq!(get(&mut kv, b"one"), past_life, "a hint past its life");
    // The key moved on: the windows read with the old hint lead to the
    // new block, whatever became of the old one.
    other.put(b"k", b"two").unwrap();
    std::thread::sleep(deadline * 10);
    assert_eq!(get(&mut kv, b"two"), changed, "a changed slot");
    assert_eq!(get(&mut kv, b"two"), 1, "a fresh hint again");
    if in_order {
        // Where READs may run last to first, as a NIC may run them, only
        // a fresh hint is used.
        let options = ClientOptions::default()
            .with_slot_cache_entries(1024)
            .with_read_order(ReadOrder::Reversed {
                pause: Duration::ZERO,
            });
        let mut reversed = Client::connect_with(&srv.address, options).unwrap();
        assert_eq!(get(&mut reversed, b"two"), 2, "cold");
        std::thread::sleep(deadline * 10);
        // (More when the attempt's clock, read before the pause, has run
        // out: see `a_get_after_a_pause_longer_than_the_deadline_...`.)
        assert!(get(&mut reversed, b"two") >= 2, "past its life, reversed");
    }
}
