//! Starting the binary the way a newcomer does: errors say what to do next.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use warren_conformance::warren_binary;

/// Runs `warren` with these arguments until it exits (at most 10 s); returns its exit code and
/// standard error.
fn run_until_exit(args: &[&str]) -> (Option<i32>, String) {
    let mut child = Command::new(warren_binary())
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn warren");
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("warren kept running with {args:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    if let Some(mut pipe) = child.stderr.take() {
        use std::io::Read;
        let _ = pipe.read_to_string(&mut err);
    }
    (status.code(), err)
}

#[test]
fn a_busy_port_names_the_flag_that_moves_the_broker() {
    if std::env::var("WARREN_TEST_URL").is_ok_and(|u| !u.trim().is_empty()) {
        return; // about the warren binary, not about an external broker
    }
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = taken.local_addr().expect("addr").port().to_string();
    let (code, err) = run_until_exit(&["--bind", "127.0.0.1", "--port", &port]);
    assert_ne!(code, Some(0), "warren started on a busy port: {err}");
    assert!(
        err.contains(&format!("cannot listen on 127.0.0.1:{port}")) && err.contains("--port"),
        "the error should name the port and the flag that changes it: {err}"
    );
    assert!(
        err.contains("cargo run --release -- --port"),
        "the error should show how to pass the flag through cargo: {err}"
    );
}

#[test]
fn a_command_log_that_does_not_replay_is_refused_with_its_reason() {
    if std::env::var("WARREN_TEST_URL").is_ok_and(|u| !u.trim().is_empty()) {
        return;
    }
    let dir = std::env::temp_dir().join(format!("warren-startup-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let path = dir.join("bad.log");
    // A record whose body is too short for its header: malformed, not merely cut short.
    std::fs::write(&path, [0u8, 0, 0, 3, 1, 2, 3]).expect("write");
    let (code, err) = run_until_exit(&["--replay-commands", path.to_str().expect("utf-8")]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("replay failed") && err.contains("record 0"),
        "{err}"
    );
    std::fs::remove_dir_all(dir).ok();
}
