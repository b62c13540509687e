//! The kv-server binary's command line: help, and clear refusals.
//! (Serving, signals and restarts are tested end to end in tests/processes.rs.)

use std::process::Command;

fn server(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kv-server"))
        .args(args)
        .output()
        .expect("run kv-server")
}

#[test]
fn help_explains_the_options() {
    let out = server(&["--help"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for option in [
        "--listen",
        "--memory",
        "--secret-file",
        "--op-deadline-ms",
        "shm:///dev/shm/NAME",
    ] {
        assert!(text.contains(option), "--help does not mention {option}");
    }
}

#[test]
fn bad_arguments_are_refused_clearly() {
    let out = server(&["--listen", "tcp://x:1"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a onekv address"));

    let out = server(&["--listen", "shm:///dev/shm/never", "--memory", "12XB"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("size suffix"));

    let dir = tempfile::tempdir().unwrap();
    let region = format!("shm://{}", dir.path().join("r").display());
    let missing = dir.path().join("no-such-secret");
    let out = server(&[
        "--listen",
        &region,
        "--secret-file",
        missing.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot read secret file"));

    let out = server(&["--listen", &region, "--memory", "4KiB"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("too small"));

    // An index whose size would wrap around is refused, not served.
    let out = server(&["--listen", &region, "--buckets", "9223372036854775808"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("power of two from 8"));

    let out = server(&[
        "--listen",
        &region,
        "--buckets",
        "256",
        "--max-buckets",
        "128",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("below the 256 buckets"));

    let out = server(&[]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--listen is required"));
}

/// A server of a 4 MiB region at `path`.
fn small_region(path: &std::path::Path) -> kv_server::ServerConfig {
    kv_server::ServerConfig {
        memory: 4 << 20,
        ..kv_server::ServerConfig::new(kv_common::Address::Shm {
            region: path.to_path_buf(),
        })
    }
}

#[test]
fn check_reports_a_clean_region_and_refuses_other_files() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("r");
    let config = small_region(&path);
    drop(kv_server::Server::start(config).unwrap());
    let out = server(&["check", path.to_str().unwrap()]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("0 damaged"));

    std::fs::write(
        dir.path().join("notes"),
        b"not a region at all, just notes".repeat(300),
    )
    .unwrap();
    let out = server(&["check", dir.path().join("notes").to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("onekv region"));
}

#[test]
fn a_server_whose_control_socket_was_removed_still_stops() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("r");
    let config = small_region(&path);
    let server = kv_server::Server::start(config).unwrap();
    std::fs::remove_file(kv_common::Address::shm_socket(&path)).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        drop(server);
        let _ = tx.send(());
    });
    assert!(
        rx.recv_timeout(std::time::Duration::from_secs(60)).is_ok(),
        "the server never stopped"
    );
}

#[test]
fn a_start_that_fails_removes_only_the_region_it_made() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("r");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let config = |metrics_listen| kv_server::ServerConfig {
        metrics_listen,
        ..small_region(&path)
    };
    let busy = Some(taken.local_addr().unwrap());
    assert!(kv_server::Server::start(config(busy)).is_err());
    assert!(!path.exists(), "an empty region left behind");
    drop(kv_server::Server::start(config(None)).unwrap());
    assert!(kv_server::Server::start(config(busy)).is_err());
    assert!(path.exists(), "a region that was there before removed");
}
