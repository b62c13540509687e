//! The region outlives the server: a restarted server reopens it with its
//! data, hands out a new access key, and clients recover by reconnecting.

use kv_client::Client;
use kv_server::Server;

#[test]
fn data_survives_restart_and_clients_reconnect() {
    let dir = onekv_tests::region_dir();
    let path = dir.path().join("region");
    // Over rdma too: the restarted server registers the region anew, and
    // the old client's queue pair fails and is replaced, not reused.
    let config = onekv_tests::test_config(&path);
    let address = config.address.to_string();

    let server = Server::start(config.clone()).unwrap();
    assert!(server.created());
    let mut kv = Client::connect(&address).unwrap();
    for i in 0..500 {
        kv.put(format!("k{i}").as_bytes(), format!("v{i}").as_bytes())
            .unwrap();
    }
    kv.delete(b"k7").unwrap();
    drop(server);

    // While no server runs, verbs with the revoked key fail cleanly (and
    // reconnecting finds nobody).
    assert!(kv.get(b"k1").is_err());

    let server = Server::start(config).unwrap();
    assert!(!server.created(), "the region was recreated, not reopened");
    assert_eq!(server.stats().live_slots, 499);
    // The old client reconnects by itself and sees everything.
    for i in 0..500 {
        let got = kv.get(format!("k{i}").as_bytes()).unwrap();
        let want = (i != 7).then(|| format!("v{i}").into_bytes());
        assert_eq!(got, want, "k{i}");
    }
    // New writes land in free space, not on top of live blocks.
    let mut other = Client::connect(&address).unwrap();
    for i in 0..500 {
        other.put(format!("n{i}").as_bytes(), [b'x'; 300]).unwrap();
    }
    for i in 0..500 {
        assert_eq!(
            kv.get(format!("k{i}").as_bytes()).unwrap().is_some(),
            i != 7
        );
    }
}
