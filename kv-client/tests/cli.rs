//! The kv command line: help, and clear errors when there is no server.
//! (Against a running server it is tested end to end in tests/processes.rs.)

use std::process::Command;

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
