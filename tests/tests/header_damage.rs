//! A damaged header record: every byte range of either record flipped, in
//! regions at several epochs (before any resize, after one, after several
//! with a growth, and killed between a switch's epoch word and its twin
//! record by the fault hook). For every case the server either starts with
//! every acknowledged key, or refuses naming the damage and the way out —
//! never starts on an index the region had left; `check` reports the damage
//! and `check --repair` rebuilds the record so that every key is back.

use std::time::Duration;

use kv_client::Client;
use kv_common::layout::{Geometry, RECORD_OFFSETS, RECORD_WORDS};
use kv_server::region::{self, CheckMode};
use kv_server::{Server, ServerConfig};
use onekv_tests::{rdma_host, region_dir, test_address, test_config, Daemon};

fn value(i: usize) -> Vec<u8> {
    format!("value {i} {}", "x".repeat(i % 200)).into_bytes()
}

/// Puts keys `from..to`, all acknowledged.
fn put_keys(kv: &mut Client, from: usize, to: usize) {
    for i in from..to {
        kv.put(format!("key{i}").as_bytes(), value(i)).unwrap();
    }
}

/// Every key `0..count` holds its value.
fn assert_all_keys(address: &str, count: usize, case: &str) {
    let mut kv = Client::connect(address).unwrap();
    let missing: Vec<usize> = (0..count)
        .filter(|&i| kv.get(format!("key{i}").as_bytes()).unwrap() != Some(value(i)))
        .collect();
    assert!(
        missing.is_empty(),
        "{case}: {} of {count} keys lost (first {:?})",
        missing.len(),
        &missing[..missing.len().min(5)]
    );
    kv.close().unwrap();
}

/// The word ranges of a record each case damages: all of them over shm;
/// over rdma (a restart re-registers the region, and shm has shown every
/// range) the bucket count.
fn damaged_words() -> Vec<usize> {
    if rdma_host().is_some() {
        vec![4]
    } else {
        (0..RECORD_WORDS).collect()
    }
}

/// Damages each word range of each record of the region (from `pristine`
/// each time) and starts a server on it: it serves all `keys`, or refuses
/// with an error naming the damage and `check --repair`, which `check`
/// reports and `--repair` mends. Returns how many cases were refused.
fn damage_every_record(config: &ServerConfig, pristine: &[u8], keys: usize, state: &str) -> usize {
    let path = config.region_file.clone().unwrap();
    let address = config.address.to_string();
    let mut refused = 0;
    for record in RECORD_OFFSETS {
        for word in damaged_words() {
            let case = format!("{state}, record at {record}, word {word}");
            std::fs::write(&path, pristine).unwrap();
            // One byte of the word, a different one for each word.
            flip_byte(&path, record + word as u64 * 8 + (word as u64 % 8));
            match Server::start(config.clone()) {
                Ok(server) => {
                    assert_all_keys(&address, keys, &case);
                    drop(server);
                }
                Err(e) => {
                    let message = e.to_string();
                    assert!(
                        message.contains("damaged") && message.contains("check --repair"),
                        "{case}: {message}"
                    );
                    refused += 1;
                    let report = region::check(&path, CheckMode::Report).unwrap();
                    assert!(!report.is_clean(), "{case}: check found it clean");
                    let header = report.header.expect("header damage reported");
                    assert!(header.located.is_some(), "{case}: {header:?}");
                    let repair = CheckMode::Repair {
                        settle: Duration::ZERO,
                    };
                    assert!(region::check(&path, repair).unwrap().header_repaired);
                    assert!(region::check(&path, CheckMode::Report).unwrap().is_clean());
                    let server = Server::start(config.clone())
                        .unwrap_or_else(|e| panic!("{case}: after the repair: {e}"));
                    assert_all_keys(&address, keys, &case);
                    drop(server);
                }
            }
        }
    }
    refused
}

fn flip_byte(path: &std::path::Path, at: u64) {
    use std::os::unix::fs::FileExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut byte = [0u8];
    file.read_exact_at(&mut byte, at).unwrap();
    file.write_all_at(&[byte[0] ^ 0x5a], at).unwrap();
}

/// Writes `record`'s geometry into the header slot `at` (as the region
/// looked before a switch wrote its twin).
fn put_record(path: &std::path::Path, at: u64, record: &Geometry) {
    use std::os::unix::fs::FileExt;
    let bytes: Vec<u8> = record
        .encode_header()
        .iter()
        .flat_map(|w| w.to_le_bytes())
        .collect();
    let file = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    file.write_all_at(&bytes, at).unwrap();
}

/// Damages both header records: a server refuses the region, naming the
/// way out, and `check --repair` takes it (its report is returned).
fn lose_both_records_and_repair(config: &ServerConfig) -> region::CheckReport {
    let path = config.region_file.clone().unwrap();
    for at in RECORD_OFFSETS {
        flip_byte(&path, at + 8 * 4);
    }
    let refusal = Server::start(config.clone()).err().expect("refused");
    assert!(refusal.to_string().contains("check --repair"), "{refusal}");
    let repair = CheckMode::Repair {
        settle: Duration::ZERO,
    };
    region::check(&path, repair).unwrap()
}

#[test]
fn a_damaged_header_record_never_starts_an_index_the_region_has_left() {
    let dir = region_dir();
    let path = dir.path().join("region");
    let config = test_config(&path);
    let address = config.address.to_string();
    let mut keys = 0;
    let mut refused = 0;
    let mut previous: Option<Geometry> = None;
    let mut last = None;
    for (state, resizes, grow) in [
        ("before any resize", 0, false),
        ("after a resize", 1, false),
        ("after several resizes and a growth", 3, true),
    ] {
        let server = Server::start(config.clone()).unwrap();
        let mut kv = Client::connect(&address).unwrap();
        put_keys(&mut kv, keys, keys + 300);
        let first = server.geometry().bucket_count;
        for _ in 0..resizes {
            kv.resize().unwrap();
        }
        if grow {
            // Values that fill the 16 MiB heap, then go again.
            let big = vec![7u8; 64 << 10];
            let len = server.geometry().region_len;
            for i in 0..400 {
                kv.put(format!("big{}", i % 300).as_bytes(), &big).unwrap();
            }
            for i in 0..300 {
                kv.delete(format!("big{i}").as_bytes()).unwrap();
            }
            assert!(server.geometry().region_len > len, "{state}: no growth");
        }
        // Keys that only the geometry in force knows.
        put_keys(&mut kv, keys + 300, keys + 600);
        keys += 600;
        let g = server.geometry();
        assert!(g.bucket_count >= first << resizes, "{state}: {g:?}");
        kv.close().unwrap();
        drop(server);
        let pristine = std::fs::read(&path).unwrap();
        // Over rdma, the last state only: shm shows the others.
        if rdma_host().is_none() || grow {
            refused += damage_every_record(&config, &pristine, keys, state);
            std::fs::write(&path, &pristine).unwrap();
        }
        previous = last.replace(g);
    }
    // Every switch was complete: both records hold the geometry in force,
    // so damage to either leaves the other.
    assert_eq!(refused, 0);

    // The state the issue found: the older record still in the twin's
    // slot (as a kill between a switch's epoch word and its twin leaves
    // it, or as a region written before twins were kept), its index
    // released long since. Damage to the record in force is refused, and
    // the repair finds the index in force.
    let (g, older) = (last.unwrap(), previous.unwrap());
    put_record(&path, g.twin_record_offset(), &older);
    let pristine = std::fs::read(&path).unwrap();
    refused = damage_every_record(&config, &pristine, keys, "older twin");
    assert!(refused > 0, "no damage to the record in force was refused");

    // Both records lost: refused, and rebuilt from the index alone.
    let rebuilt = lose_both_records_and_repair(&config);
    let located = rebuilt.header.unwrap().located.unwrap();
    assert_eq!(
        (located.index_offset, located.bucket_count),
        (g.index_offset, g.bucket_count)
    );
    let _server = Server::start(config.clone()).unwrap();
    assert_all_keys(&address, keys, "both records rebuilt");
}

/// The server killed between a switch's epoch word and its twin record
/// (ONEKV_RESIZE_FAULT=switched): the restart finishes the switch, and
/// before it does, damage to the record in force is refused or harmless.
#[test]
fn a_server_killed_between_epoch_word_and_twin_record_refuses_a_damaged_record() {
    let dir = region_dir();
    let path = dir.path().join("region");
    let address = test_address(&path);
    let mut config = ServerConfig::new(address.clone());
    config.region_file = Some(path.clone());
    config.memory = 16 << 20;
    let faulty = Daemon::start_with_env(
        &address,
        &path,
        &["--memory", "16MiB"],
        &[("ONEKV_RESIZE_FAULT", "switched")],
    );
    let mut kv = Client::connect(&address.to_string()).unwrap();
    put_keys(&mut kv, 0, 500);
    // Answered or not: the server tells the new geometry just before the
    // fault point.
    let _ = kv.resize();
    drop(kv);
    let (status, log) = faulty.wait_exit(Duration::from_secs(60));
    assert!(
        !status.success() && log.contains("ONEKV_RESIZE_FAULT"),
        "{log}"
    );
    let pristine = std::fs::read(&path).unwrap();
    let refused = damage_every_record(&config, &pristine, 500, "killed after the epoch word");
    assert!(refused > 0, "no damage to the record in force was refused");
    // Undamaged, it starts on the new index and completes the switch.
    std::fs::write(&path, &pristine).unwrap();
    let server = Server::start(config.clone()).unwrap();
    assert!(server.geometry().epoch >= 2);
    assert_all_keys(&address.to_string(), 500, "after the finished switch");
    drop(server);
    assert!(region::check(&path, CheckMode::Report).unwrap().is_clean());
}

/// A region that holds no key, both records lost (a create that died in
/// the middle of its first record looks the same): refused, and rebuilt
/// with an empty index.
#[test]
fn an_empty_region_whose_records_are_lost_is_rebuilt() {
    let dir = region_dir();
    let path = dir.path().join("region");
    let config = test_config(&path);
    drop(Server::start(config.clone()).unwrap());
    assert!(lose_both_records_and_repair(&config).header_repaired);
    let _server = Server::start(config.clone()).unwrap();
    let mut kv = Client::connect(&config.address.to_string()).unwrap();
    put_keys(&mut kv, 0, 100);
    kv.close().unwrap();
    assert_all_keys(&config.address.to_string(), 100, "rebuilt empty region");
}
