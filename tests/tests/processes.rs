//! Server and clients as separate processes: the `kv-server` daemon, the
//! `kv` command-line client, and several client processes at once.

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};

use kv_common::Address;
use onekv_tests::{region_dir, workspace_bin, Daemon};

fn start_daemon(region: &Path, extra: &[&str]) -> Daemon {
    let address = Address::Shm {
        region: region.to_path_buf(),
    };
    let mut args = vec!["--memory", "32MiB"];
    args.extend_from_slice(extra);
    Daemon::start(&address, region, &args)
}

fn kv(region: &Path, args: &[&str]) -> Output {
    Command::new(workspace_bin("kv"))
        .arg("--server")
        .arg(format!("shm://{}", region.display()))
        .args(args)
        .output()
        .expect("run kv")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).trim_end().to_string()
}

#[test]
fn daemon_and_cli() {
    let dir = region_dir();
    let region = dir.path().join("cli");
    let daemon = start_daemon(&region, &[]);

    assert!(kv(&region, &["put", "greeting", "hello world"])
        .status
        .success());
    let got = kv(&region, &["get", "greeting"]);
    assert!(got.status.success());
    assert_eq!(stdout(&got), "hello world");

    let missing = kv(&region, &["get", "nope"]);
    assert_eq!(missing.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("key not found: nope"));

    assert!(kv(&region, &["put", "gone", "soon"]).status.success());
    assert!(kv(&region, &["del", "gone"]).status.success());
    assert_eq!(kv(&region, &["del", "gone"]).status.code(), Some(1));

    // Counters: incr prints the new value, get its decimal text; incr of a
    // plain value is an error (status 2).
    assert_eq!(stdout(&kv(&region, &["incr", "hits"])), "1");
    assert_eq!(stdout(&kv(&region, &["incr", "hits", "41"])), "42");
    assert_eq!(stdout(&kv(&region, &["incr", "hits", "-2"])), "40");
    assert_eq!(stdout(&kv(&region, &["get", "hits"])), "40");
    let plain = kv(&region, &["incr", "greeting"]);
    assert_eq!(plain.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&plain.stderr).contains("not a counter"));
    assert!(kv(&region, &["del", "hits"]).status.success());

    // live_slots is as of the server's last index scan, which follows each
    // departing client shortly.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let stats = kv(&region, &["stats"]);
        assert!(stats.status.success());
        if stdout(&stats).contains("live_slots 1 ") {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{}", stdout(&stats));
        std::thread::sleep(std::time::Duration::from_millis(50));
    }

    // SIGTERM: clean shutdown, socket removed, region kept.
    let (status, log) = daemon.terminate();
    assert!(status.success(), "kv-server exited with {status:?}");
    assert!(log.contains("stopped"), "{log}");
    assert!(!Address::shm_socket(&region).exists());
    let down = kv(&region, &["get", "greeting"]);
    assert_eq!(down.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&down.stderr).contains("unreachable"));

    // A new daemon reopens the region with its data.
    let _daemon = start_daemon(&region, &[]);
    assert_eq!(stdout(&kv(&region, &["get", "greeting"])), "hello world");
}

/// Settings no member could run with are refused before anything starts,
/// naming the flag.
#[test]
fn impossible_member_settings_are_refused_naming_the_flag() {
    let dir = region_dir();
    let listen = format!("shm://{}", dir.path().join("m").display());
    for (flag, value) in [
        ("--member-name", ""),
        ("--lease-ttl", "0"),
        ("--lease-ttl", "99999999999999"),
        ("--op-deadline-ms", "0"),
        ("--op-deadline-ms", "18446744073709551615"),
    ] {
        let out = Command::new(workspace_bin("kv-server"))
            .args([
                "--listen",
                &listen,
                "--cluster",
                "etcd://127.0.0.1:1/x",
                flag,
                value,
            ])
            .output()
            .expect("run kv-server");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flag} {value:?}: {stderr}");
        assert!(stderr.contains(flag), "{flag} {value:?}: {stderr}");
    }
    let out = Command::new(workspace_bin("kv-server"))
        .args(["cluster", "create", "etcd://127.0.0.1:1/x", "--shards", "2"])
        .args(["--op-deadline-ms", "18446744073709551615"])
        .output()
        .expect("run kv-server");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--op-deadline-ms"), "{stderr}");
}

#[test]
fn secret_file_is_enforced() {
    let dir = region_dir();
    let region = dir.path().join("secret");
    let secret = dir.path().join("secret.txt");
    std::fs::write(&secret, "s3cret\n").unwrap();
    let _daemon = start_daemon(&region, &["--secret-file", secret.to_str().unwrap()]);
    let refused = kv(&region, &["put", "a", "b"]);
    assert_eq!(refused.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&refused.stderr).contains("refused"));
    let ok = Command::new(workspace_bin("kv"))
        .args([
            "--server",
            &format!("shm://{}", region.display()),
            "--secret-file",
        ])
        .arg(&secret)
        .args(["put", "a", "b"])
        .output()
        .unwrap();
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
}

#[test]
fn many_client_processes_share_one_server() {
    let dir = region_dir();
    let region = dir.path().join("multi");
    let _daemon = start_daemon(&region, &[]);
    let address = format!("shm://{}", region.display());
    let names = ["p0", "p1", "p2", "p3"];
    let workers: Vec<Child> = names
        .iter()
        .map(|name| {
            Command::new(env!("CARGO_BIN_EXE_kv-stress"))
                .args([&address, *name, "4000", &names.join(",")])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for (name, w) in names.iter().zip(workers) {
        let out = w.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "client process {name} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // Every worker process disconnected cleanly: only this one is left.
    let last = kv(&region, &["stats"]);
    assert!(
        stdout(&last).contains("clients_connected 1"),
        "{}",
        stdout(&last)
    );
}
