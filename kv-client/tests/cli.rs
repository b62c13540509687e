//! The kv command line: help, clear errors when there is no server, and
//! values too large for a command line. (Against a running server it is
//! tested end to end in tests/processes.rs.)

use std::io::Write;
use std::process::{Command, Stdio};

fn kv(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kv"))
        .args(args)
        .output()
        .expect("run kv")
}

#[test]
fn help_lists_the_commands() {
    let out = kv(&["--help"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for word in ["put", "get", "del", "stats", "--server"] {
        assert!(text.contains(word), "--help does not mention {word}");
    }
}

#[test]
fn no_server_and_bad_address_exit_2_with_a_reason() {
    let dir = tempfile::tempdir().unwrap();
    let address = format!("shm://{}", dir.path().join("nobody").display());
    let out = kv(&["--server", &address, "get", "k"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unreachable"));

    let out = kv(&["--server", "localhost:1234", "get", "k"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a onekv address"));
}

#[test]
fn large_values_come_from_standard_input_or_a_file() {
    let dir = tempfile::tempdir().unwrap();
    let region = dir.path().join("r");
    let config = kv_server::ServerConfig {
        memory: 16 << 20,
        ..kv_server::ServerConfig::new(kv_common::Address::Shm {
            region: region.clone(),
        })
    };
    let _server = kv_server::Server::start(config).unwrap();
    let address = format!("shm://{}", region.display());
    // 300 KiB of binary bytes: far over what an argument list takes.
    let value: Vec<u8> = (0..300 << 10).map(|i: u32| (i * 7 % 251) as u8).collect();
    let mut put = Command::new(env!("CARGO_BIN_EXE_kv"))
        .args(["--server", &address, "put", "big"])
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    put.stdin.take().unwrap().write_all(&value).unwrap();
    assert!(put.wait().unwrap().success());
    let got = kv(&["--server", &address, "get", "big"]);
    assert!(got.status.success());
    // Byte for byte into a pipe: no newline added off a terminal.
    assert_eq!(got.stdout, value);

    let file = dir.path().join("value");
    std::fs::write(&file, &value[..1000]).unwrap();
    let out = kv(&[
        "--server",
        &address,
        "put",
        "small",
        "--value-file",
        file.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got = kv(&["--server", &address, "get", "small"]);
    assert_eq!(got.stdout, &value[..1000]);

    // An endless source stops at the limit, rather than fill the memory.
    let endless = kv(&[
        "--server",
        &address,
        "put",
        "zeros",
        "--value-file",
        "/dev/zero",
    ]);
    assert_eq!(endless.status.code(), Some(2));
    let said = String::from_utf8_lossy(&endless.stderr);
    assert!(
        said.contains("larger than the 1048576-byte limit"),
        "{said}"
    );
}

#[test]
fn resize_doubles_the_index_and_stats_show_it() {
    let dir = tempfile::tempdir().unwrap();
    let region = dir.path().join("r");
    let config = kv_server::ServerConfig {
        memory: 16 << 20,
        buckets: Some(64),
        ..kv_server::ServerConfig::new(kv_common::Address::Shm {
            region: region.clone(),
        })
    };
    let _server = kv_server::Server::start(config).unwrap();
    let address = format!("shm://{}", region.display());
    assert!(kv(&["--server", &address, "put", "k", "v"])
        .status
        .success());
    let out = kv(&["--server", &address, "resize"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("buckets 64 -> 128"));
    let stats = String::from_utf8_lossy(&kv(&["--server", &address, "stats"]).stdout).into_owned();
    for line in ["epoch 2", "resizes 1", "buckets 128", "occupancy "] {
        assert!(stats.contains(line), "no {line:?} in {stats}");
    }
    let got = kv(&["--server", &address, "get", "k"]);
    assert_eq!(got.stdout, b"v");
}
