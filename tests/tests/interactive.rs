//! The `kv` prompt driven through a pseudo-terminal, as a person at a
//! terminal would use it: line editing on, values quoted and escaped the
//! way redis-cli does, `--raw`, and the exit status at `quit`; and with
//! its input piped in, as a script drives it.

use std::process::Command;
use std::time::Duration;

use expectrl::process::unix::WaitStatus;
use expectrl::{Eof, Expect, Session};
use onekv_tests::{workspace_bin, TestServer};

fn prompt(t: &TestServer, extra: &[&str]) -> expectrl::session::OsSession {
    let home = tempfile::tempdir().expect("home directory");
    let mut cmd = Command::new(workspace_bin("kv"));
    cmd.arg("--server").arg(&t.address).args(extra);
    // History goes to a directory of its own, not the tester's home.
    cmd.env("HOME", home.keep());
    let mut p = Session::spawn(cmd).expect("kv starts on a pty");
    p.set_expect_timeout(Some(Duration::from_secs(30)));
    p.expect(format!("{}> ", t.address))
        .expect("prompt shows the server");
    p
}

/// Types `line`, then waits for `answer` and the next prompt.
fn says(p: &mut expectrl::session::OsSession, t: &TestServer, line: &str, answer: &str) {
    p.send_line(line).expect("line sent");
    // Between the answer and the prompt, the line editor redraws (escape
    // sequences).
    p.expect(format!("{answer}\r\n"))
        .unwrap_or_else(|e| panic!("after {line:?}: no {answer:?}: {e}"));
    p.expect(format!("{}> ", t.address))
        .unwrap_or_else(|e| panic!("after {line:?}: no prompt: {e}"));
}

#[test]
fn the_prompt_stores_reads_and_quotes_like_redis_cli() {
    let t = TestServer::start(|_| {});
    let mut p = prompt(&t, &[]);
    says(&mut p, &t, r#"put greeting "hello world""#, "OK");
    says(&mut p, &t, "GET greeting", r#""hello world""#);
    // Binary bytes typed as escapes come back escaped.
    says(&mut p, &t, r#"put bin "\x00\xff\ttab\"q""#, "OK");
    says(&mut p, &t, "get bin", r#""\x00\xff\ttab\"q""#);
    says(&mut p, &t, "get missing", "(nil)");
    // Words that start with a dash are keys and values, not options.
    says(&mut p, &t, r#"put -k "-1""#, "OK");
    says(&mut p, &t, "get -k", r#""-1""#);
    says(&mut p, &t, "incr visits 5", "(integer) 5");
    says(&mut p, &t, "del visits", "(integer) 1");
    says(&mut p, &t, "del visits", "(integer) 0");
    says(
        &mut p,
        &t,
        r#"get "unterminated"#,
        "(error) Invalid argument(s): unbalanced quotes",
    );
    p.send_line("frobnicate x").expect("line sent");
    p.expect("unrecognized subcommand 'frobnicate'")
        .expect("unknown commands are named");
    p.expect(format!("{}> ", t.address)).expect("prompt again");
    p.send_line("quit").expect("line sent");
    p.expect(Eof).expect("kv exits at quit");
    assert!(matches!(
        p.get_process().wait().expect("kv's status"),
        WaitStatus::Exited(_, 0)
    ));

    // What the prompt stored is what the one-shot command line reads, byte
    // for byte off a terminal.
    let out = Command::new(workspace_bin("kv"))
        .args(["--server", &t.address, "get", "bin"])
        .output()
        .expect("kv get");
    assert_eq!(out.stdout, b"\x00\xff\ttab\"q");
}

#[test]
fn raw_prints_values_as_they_are_and_end_of_input_exits_0() {
    let t = TestServer::start(|_| {});
    let mut kv = kv_client::Client::connect(&t.address).expect("client");
    kv.put(b"two lines", b"first\nsecond").expect("put");
    let mut p = prompt(&t, &["--raw"]);
    says(&mut p, &t, r#"get "two lines""#, "first\r\nsecond");
    says(&mut p, &t, "incr n", "1");
    // Ctrl-D on an empty line ends the session.
    p.send(expectrl::ControlCode::EndOfTransmission)
        .expect("Ctrl-D sent");
    p.expect(Eof).expect("kv exits at end of input");
    assert!(matches!(
        p.get_process().wait().expect("kv's status"),
        WaitStatus::Exited(_, 0)
    ));
}

/// `kv` at the prompt with its input piped in: its exit status, once it
/// exits (within a minute), and what it said on standard error.
fn scripted(
    t: &TestServer,
    feed: impl FnOnce(std::process::ChildStdin) + Send + 'static,
    read: impl FnOnce(std::process::ChildStdout),
) -> (Option<i32>, String) {
    use std::io::Read;
    use std::process::Stdio;
    let home = tempfile::tempdir().expect("home directory");
    let mut child = Command::new(workspace_bin("kv"))
        .arg("--server")
        .arg(&t.address)
        .env("HOME", home.path())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kv starts");
    let stdin = child.stdin.take().expect("stdin");
    std::thread::spawn(move || feed(stdin));
    read(child.stdout.take().expect("stdout"));
    let started = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("kv's status") {
            break status;
        }
        if started.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("kv went on for a minute");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut stderr = String::new();
    let _ = child
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut stderr);
    assert!(
        !home.path().join(".onekv_history").exists(),
        "a scripted session kept in the history"
    );
    (status.code(), stderr)
}

#[test]
fn a_scripted_session_ends_when_nobody_reads_its_answers() {
    use std::io::{BufRead, Write};
    let t = TestServer::start(|_| {});
    let endless = |mut stdin: std::process::ChildStdin| {
        while stdin.write_all(b"incr hits\n").is_ok() {}
    };
    let first_answer = |stdout: std::process::ChildStdout| {
        let mut line = String::new();
        std::io::BufReader::new(stdout)
            .read_line(&mut line)
            .expect("an answer");
        assert_eq!(line, "(integer) 1\n");
    };
    let (code, stderr) = scripted(&t, endless, first_answer);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("writing an answer"), "{stderr}");
}

#[test]
fn a_line_that_is_not_utf8_ends_a_scripted_session_with_an_error() {
    use std::io::{Read, Write};
    let t = TestServer::start(|_| {});
    let lines = |mut stdin: std::process::ChildStdin| {
        let _ = stdin.write_all(b"put a 1\nput nu \xff\xfe\nput b 2\n");
    };
    let mut answers = String::new();
    let (code, stderr) = scripted(&t, lines, |mut stdout| {
        let _ = stdout.read_to_string(&mut answers);
    });
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("reading the prompt"), "{stderr}");
    assert_eq!(answers, "OK\n");
    let mut kv = kv_client::Client::connect(&t.address).expect("client");
    assert_eq!(kv.get(b"b").expect("get"), None, "a line after it ran");
}

#[test]
fn a_session_the_server_cut_off_while_idle_still_ends_well() {
    use std::io::{Read, Write};
    let t = TestServer::start(|c| c.timeouts.idle = Some(Duration::from_secs(1)));
    let lines = |mut stdin: std::process::ChildStdin| {
        let _ = stdin.write_all(b"put a 1\n");
        // Idle past the server's timeout before the input ends.
        std::thread::sleep(Duration::from_millis(2500));
    };
    let mut answers = String::new();
    let (code, stderr) = scripted(&t, lines, |mut stdout| {
        let _ = stdout.read_to_string(&mut answers);
    });
    assert_eq!(answers, "OK\n");
    assert_eq!(code, Some(0), "{stderr}");
}
