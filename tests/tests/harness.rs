//! The test harness's own promises. In a binary of its own: killing this
//! process's children would kill other tests' daemons.

use std::os::unix::process::ExitStatusExt;
use std::process::Command;
use std::time::{Duration, Instant};

use onekv_tests::kill_children;

/// What `abort_saying` does before it aborts, so that a test that aborts
/// does not leave its daemons running beside the tests after it.
#[test]
fn an_abort_kills_every_child_of_the_test_process() {
    let mut children: Vec<_> = (0..3)
        .map(|_| {
            Command::new("sleep")
                .arg("600")
                .spawn()
                .expect("start sleep")
        })
        .collect();
    // One already waited for: its pid is nobody's child now.
    let mut done = Command::new("true").spawn().expect("start true");
    assert!(done.wait().expect("wait for true").success());
    kill_children();
    let deadline = Instant::now() + Duration::from_secs(10);
    for child in &mut children {
        let status = loop {
            if let Some(status) = child.try_wait().expect("wait for sleep") {
                break status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("a child of the test process outlived kill_children");
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        assert_eq!(status.signal(), Some(libc::SIGKILL), "{status}");
    }
}
