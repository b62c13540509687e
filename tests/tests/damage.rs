//! Damage in the region file (bytes flipped in a block, a slot that cannot
//! point at a block): the keys it hits fail fast with `Error::Corrupt`
//! naming where, every other key works, the server counts damaged slots,
//! and `kv-server check` finds them offline and `--repair` unlinks them.

use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use kv_client::{Client, Error};
use kv_common::layout::Slot;
use kv_server::region::{self, CheckMode};
use kv_server::Server;
use onekv_tests::{region_dir, test_config};

fn value(i: usize) -> Vec<u8> {
    format!("value of key{i} {}", "v".repeat(100)).into_bytes()
}

#[test]
fn damaged_keys_fail_fast_others_work_and_check_repairs_them() {
    let dir = region_dir();
    let path = dir.path().join("region");
    let config = test_config(&path);
    let server = Server::start(config.clone()).unwrap();
    let address = config.address.to_string();
    let mut kv = Client::connect(&address).unwrap();
    for i in 0..200 {
        kv.put(format!("key{i}").as_bytes(), &value(i)).unwrap();
    }
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
    assert!(matches!(
        kv.put(b"key7", b"new"),
        Err(Error::Corrupt { .. })
    ));
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "damage took {:?} to report",
        started.elapsed()
    );
    for i in (0..200).filter(|&i| i != 7 && i != 9) {
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
