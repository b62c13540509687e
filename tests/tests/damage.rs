//! Damage in the region file (bytes flipped in a block, a slot that cannot
//! point at a block): reads of the keys it hits fail fast with
//! `Error::Corrupt` naming where (a write, which reads a block only as far
//! as its key, replaces a damaged value), every other key works, the
//! server counts damaged slots,
//! and `kv-server check` finds them offline and `--repair` unlinks them.

use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use kv_client::{Client, Error};
use kv_common::layout::{Slot, EPOCH_OFFSET};
use kv_server::region::{self, CheckMode};
use kv_server::Server;
use onekv_tests::{region_dir, test_config};

fn value(i: usize) -> Vec<u8> {
    format!("value of key{i} {}", "v".repeat(100)).into_bytes()
}

/// A server on a fresh region that holds `key0..key199`, and its client.
struct Stored {
    dir: tempfile::TempDir,
    path: std::path::PathBuf,
    config: kv_server::ServerConfig,
    server: Server,
    kv: Client,
}

fn stored_keys() -> Stored {
    let dir = region_dir();
    let path = dir.path().join("region");
    let config = test_config(&path);
    let server = Server::start(config.clone()).unwrap();
    let mut kv = Client::connect(&config.address.to_string()).unwrap();
    for i in 0..200 {
        kv.put(format!("key{i}").as_bytes(), value(i)).unwrap();
    }
    Stored {
        dir,
        path,
        config,
        server,
        kv,
    }
}

#[test]
fn damaged_keys_fail_fast_others_work_and_check_repairs_them() {
    let Stored {
        dir: _dir,
        path,
        config,
        server,
        mut kv,
    } = stored_keys();
    let address = config.address.to_string();
    let (_, block_hit) = server.slots_of(b"key7").unwrap()[0];
    let (pos9, slot_hit) = server.slots_of(b"key9").unwrap()[0];
    let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    // A byte of key7's value flipped; key9's slot given a size class no
    // block has (byte 6 of the slot word).
    file.write_all_at(b"#", block_hit.offset() + 40).unwrap();
    let slot9_at = server.geometry().slot_offset(pos9);
    file.write_all_at(&[250], slot9_at + 6).unwrap();

    let started = Instant::now();
    match kv.get(b"key7") {
        Err(Error::Corrupt { key, offset, .. }) => {
            assert_eq!((key.as_str(), offset), ("key7", block_hit.offset()))
        }
        other => panic!("expected Corrupt for key7, got {other:?}"),
    }
    match kv.get(b"key9") {
        Err(Error::Corrupt {
            key, bucket, slot, ..
        }) => {
            assert_eq!(
                (key.as_str(), bucket, slot),
                ("key9", pos9.bucket, pos9.index)
            )
        }
        other => panic!("expected Corrupt for key9, got {other:?}"),
    }
    // A write reads a block only as far as its key: a damaged value it
    // replaces, and the key is whole again.
    let (_, value_hit) = server.slots_of(b"key11").unwrap()[0];
    file.write_all_at(b"#", value_hit.offset() + 40).unwrap();
    assert!(matches!(kv.get(b"key11"), Err(Error::Corrupt { .. })));
    kv.put(b"key11", b"new").unwrap();
    assert_eq!(kv.get(b"key11").unwrap().as_deref(), Some(&b"new"[..]));
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "damage took {:?} to report",
        started.elapsed()
    );
    for i in (0..200).filter(|&i| ![7, 9, 11].contains(&i)) {
        assert_eq!(
            kv.get(format!("key{i}").as_bytes()).unwrap(),
            Some(value(i))
        );
    }
    server.collect_now();
    assert_eq!(server.stats().corrupt_slots, 1);
    kv.close().unwrap();
    drop(server);

    let report = region::check(&path, CheckMode::Report).unwrap();
    let mut found: Vec<Slot> = report.damaged.iter().map(|d| d.slot).collect();
    found.sort_by_key(|s| s.0);
    let mut expected = vec![block_hit, Slot(slot_hit.0 & !(0xff << 48) | 250 << 48)];
    expected.sort_by_key(|s| s.0);
    assert_eq!(found, expected, "{:?}", report.damaged);
    assert_eq!(
        region::check(
            &path,
            CheckMode::Repair {
                settle: Duration::ZERO
            }
        )
        .unwrap()
        .repaired,
        2
    );
    assert!(region::check(&path, CheckMode::Report)
        .unwrap()
        .damaged
        .is_empty());

    let _server = Server::start(config).unwrap();
    let mut kv = Client::connect(&address).unwrap();
    assert_eq!(kv.get(b"key7").unwrap(), None);
    assert_eq!(kv.get(b"key9").unwrap(), None);
    kv.put(b"key7", b"new").unwrap();
    assert_eq!(kv.get(b"key7").unwrap().as_deref(), Some(&b"new"[..]));
    assert_eq!(kv.get(b"key8").unwrap(), Some(value(8)));
}

/// Sets the frozen bit of the slot word at `at` in the region file (as
/// flipped bits, or a client, would).
fn freeze_word(path: &std::path::Path, at: u64) {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut word = [0u8; 8];
    file.read_exact_at(&mut word, at).unwrap();
    let frozen = Slot(u64::from_le_bytes(word)).frozen();
    file.write_all_at(&frozen.0.to_le_bytes(), at).unwrap();
}

/// Where to set stray frozen bits: the slots of keys `key0..key19` and
/// four empty slots of key0's buckets.
fn stray_words(server: &Server, path: &std::path::Path) -> Vec<u64> {
    let g = server.geometry();
    let mut words: Vec<u64> = (0..20)
        .map(|i| {
            let (pos, _) = server.slots_of(format!("key{i}").as_bytes()).unwrap()[0];
            g.slot_offset(pos)
        })
        .collect();
    let file = std::fs::File::open(path).unwrap();
    let h = kv_common::layout::KeyHash::new(b"key0", g.bucket_count);
    let empty = (0..kv_common::layout::CANDIDATE_SLOTS)
        .map(|i| g.slot_offset(h.slot_pos(i)))
        .filter(|&at| {
            let mut word = [0u8; 8];
            file.read_exact_at(&mut word, at).unwrap();
            u64::from_le_bytes(word) == 0
        });
    words.extend(empty.take(4));
    words
}

fn freeze_all(path: &std::path::Path, words: &[u64]) -> u64 {
    for &at in words {
        freeze_word(path, at);
    }
    words.len() as u64
}

/// Frozen bits with no resize under way (a few flipped bytes, or a client
/// that set them): writers of those keys tell the server, which thaws them,
/// instead of waiting out a resize that never comes; the server counts them.
#[test]
fn writers_meeting_stray_frozen_slots_have_them_thawed() {
    let Stored {
        dir: _dir,
        path,
        server,
        mut kv,
        ..
    } = stored_keys();
    let frozen = freeze_all(&path, &stray_words(&server, &path));
    let (done_tx, done) = std::sync::mpsc::channel();
    let writer = std::thread::spawn(move || {
        for i in 0..20 {
            kv.put(format!("key{i}").as_bytes(), b"after the thaw")
                .unwrap();
        }
        kv.put(b"new key", b"in thawed buckets").unwrap();
        done_tx.send(()).unwrap();
        kv
    });
    // Without the thaw they would wait out the ten-minute resize wait.
    done.recv_timeout(Duration::from_secs(60))
        .expect("writers stalled on stray frozen slots");
    let mut kv = writer.join().unwrap();
    for i in 0..20 {
        assert_eq!(
            kv.get(format!("key{i}").as_bytes()).unwrap().as_deref(),
            Some(&b"after the thaw"[..])
        );
    }
    server.collect_now();
    let stats = server.stats();
    assert!(stats.thawed_slots >= 1, "{stats:?}");
    assert!(stats.thawed_slots <= frozen, "{stats:?}");
    assert_eq!(stats.frozen_slots, 0, "{stats:?}");
    assert_eq!(stats.resizes, 0, "{stats:?}");
}

/// With no writer to meet them, the server's own scan finds stray frozen
/// slots and thaws them; offline, `check` reports them and `--repair`
/// thaws them.
#[test]
fn stray_frozen_slots_are_found_by_scans_and_by_check() {
    let Stored {
        dir: _dir,
        path,
        config,
        server,
        kv,
    } = stored_keys();
    let words = stray_words(&server, &path);
    let frozen = freeze_all(&path, &words);
    onekv_tests::eventually(
        "the stray frozen slots thawed",
        Duration::from_secs(30),
        || {
            server.collect_now();
            server.stats().thawed_slots == frozen
        },
    );
    server.collect_now();
    assert_eq!(server.stats().frozen_slots, 0);
    kv.close().unwrap();

    drop(server);
    let frozen = freeze_all(&path, &words);
    let report = region::check(&path, CheckMode::Report).unwrap();
    assert_eq!(report.frozen, frozen);
    assert!(!report.is_clean());
    let repair = CheckMode::Repair {
        settle: Duration::ZERO,
    };
    assert_eq!(region::check(&path, repair).unwrap().thawed, frozen);
    assert!(region::check(&path, CheckMode::Report).unwrap().is_clean());
    let _server = Server::start(config.clone()).unwrap();
    let mut kv = Client::connect(&config.address.to_string()).unwrap();
    for i in 0..200 {
        assert_eq!(
            kv.get(format!("key{i}").as_bytes()).unwrap(),
            Some(value(i))
        );
    }
}

/// The header's bytes: both records and the epoch word.
fn header_bytes(path: &std::path::Path) -> Vec<u8> {
    let mut bytes = vec![0u8; EPOCH_OFFSET as usize + 8];
    std::fs::File::open(path)
        .unwrap()
        .read_exact_at(&mut bytes, 0)
        .unwrap();
    bytes
}

/// A client that writes over the header (over shm it maps it; over rdma
/// the region is one registration): it bumps the epoch word, which would
/// make a restart refuse the region (a record in force older than the
/// epoch published), and scribbles over the spare record. The server
/// writes both back from the geometry it holds, at its next pass and at
/// stop, and counts it; a restart finds every key.
#[test]
fn a_header_a_client_wrote_over_is_written_back() {
    let Stored {
        dir: _dir,
        path,
        config,
        server,
        mut kv,
    } = stored_keys();
    let pristine = header_bytes(&path);
    let g = server.geometry();
    let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    file.write_all_at(&(g.epoch + 7).to_le_bytes(), EPOCH_OFFSET)
        .unwrap();
    file.write_all_at(&[0x5a; 64], g.twin_record_offset())
        .unwrap();
    for i in 0..20 {
        kv.put(format!("key{i}").as_bytes(), b"past the tampering")
            .unwrap();
    }
    onekv_tests::eventually("the header written back", Duration::from_secs(30), || {
        header_bytes(&path) == pristine
    });
    assert!(server.stats().header_repairs >= 1, "{:?}", server.stats());
    kv.close().unwrap();
    // Again just before a stop, which writes it back too.
    file.write_all_at(&(g.epoch + 9).to_le_bytes(), EPOCH_OFFSET)
        .unwrap();
    drop(server);
    assert_eq!(header_bytes(&path), pristine, "the header at stop");

    let _server = Server::start(config.clone()).expect("a restart takes the region");
    let mut kv = Client::connect(&config.address.to_string()).unwrap();
    for i in 0..200 {
        let expected = if i < 20 {
            b"past the tampering".to_vec()
        } else {
            value(i)
        };
        assert_eq!(
            kv.get(format!("key{i}").as_bytes()).unwrap(),
            Some(expected)
        );
    }
}

/// The region file truncated under a running daemon (by its own user or
/// root: nothing can keep a writable file from shrinking): the daemon
/// stops with an error that says what happened, not a bare SIGBUS.
#[test]
fn a_region_file_truncated_under_the_daemon_stops_it_with_a_clear_error() {
    let dir = region_dir();
    let path = dir.path().join("region");
    let address = onekv_tests::test_address(&path);
    let daemon = onekv_tests::Daemon::start(&address, &path, &["--memory", "16MiB"]);
    let mut kv = Client::connect(&address.to_string()).unwrap();
    for i in 0..200 {
        kv.put(format!("key{i}").as_bytes(), value(i)).unwrap();
    }
    kv.close().unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    let (status, log) = daemon.wait_exit(Duration::from_secs(30));
    assert!(!status.success(), "{log}");
    assert!(log.contains("truncated"), "{log}");
}
