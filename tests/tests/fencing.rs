//! A client the server cuts off (here by the idle timeout; a crashed one is
//! cut off the same way) is fenced: its verbs fail from then on, so it can
//! never write into space the server reclaimed. Its next operation
//! reconnects by itself, and none of the space it held is lost.

use std::time::Duration;

use kv_client::Client;
use kv_server::Server;
use onekv_tests::{assert_no_space_lost, region_dir, test_config};

#[test]
fn a_client_cut_off_by_the_idle_timeout_is_fenced_reconnects_and_leaks_nothing() {
    let dir = region_dir();
    let mut config = test_config(&dir.path().join("region"));
    config.op_deadline = Duration::from_millis(5);
    config.timeouts.idle = Some(Duration::from_millis(500));
    let address = config.address.to_string();
    let server = Server::start(config.clone()).unwrap();
    let mut kv = Client::connect(&address).unwrap();
    for round in 0..4u64 {
        for i in 0..50 {
            let value = format!("round {round} {}", "v".repeat(i * 20));
            kv.put(format!("k{i}").as_bytes(), value.as_bytes())
                .unwrap();
        }
        // Silent on the control channel for longer than the idle timeout:
        // the server cuts the client off and reclaims what it held.
        let cut_off = server.stats().departures + 1;
        onekv_tests::eventually("the idle client cut off", Duration::from_secs(300), || {
            server.stats().departures >= cut_off
        });
        // Its old key no longer works; the operation reconnects and is
        // redone, transparently.
        let reconnects = kv.reconnects();
        let got = kv.get(b"k7").unwrap().unwrap();
        assert!(got.starts_with(format!("round {round} ").as_bytes()));
        assert!(
            kv.reconnects() > reconnects,
            "a fenced client's read went through"
        );
    }
    kv.close().unwrap();
    // Cut off while alive, its space waits a grace period from the fence.
    assert_no_space_lost(server, config, "reconnecting after fences");
}
