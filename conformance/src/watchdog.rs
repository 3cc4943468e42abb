//! A bound on a whole test binary: a test stuck on something that never comes (a broker
//! blocking publishers on a nearly full disk was one) would otherwise hold `cargo test`, and
//! the suite, until CI gives up on it. Armed by the first broker a binary spawns; when it
//! fires it prints the tail of every live broker's output, kills those brokers and exits
//! the binary with a failure, and `cargo test --no-fail-fast` goes on with the next one.

use std::io::Write;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, Once};
use std::time::Duration;

/// Seconds a test binary may run once it started a broker: `WARREN_TEST_BINARY_TIMEOUT`,
/// else 600 (the longest binary takes under 90 s on 2 cores).
fn limit() -> Duration {
    let secs = std::env::var("WARREN_TEST_BINARY_TIMEOUT")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(600u64);
    Duration::from_secs(secs)
}

struct Live {
    pid: u32,
    addr: SocketAddr,
    output: Arc<Mutex<Vec<u8>>>,
}

static LIVE: Mutex<Vec<Live>> = Mutex::new(Vec::new());

/// Notes a spawned broker (and arms the watchdog on the first).
pub(crate) fn started(pid: u32, addr: SocketAddr, output: Arc<Mutex<Vec<u8>>>) {
    static ARMED: Once = Once::new();
    ARMED.call_once(|| {
        let limit = limit();
        std::thread::spawn(move || {
            std::thread::sleep(limit);
            fire(limit);
        });
    });
    if let Ok(mut live) = LIVE.lock() {
        live.push(Live { pid, addr, output });
    }
}

/// Forgets a broker that was stopped and waited for.
pub(crate) fn stopped(pid: u32) {
    if let Ok(mut live) = LIVE.lock() {
        live.retain(|l| l.pid != pid);
    }
}

fn fire(limit: Duration) {
    let live = match LIVE.lock() {
        Ok(live) => live,
        Err(poisoned) => poisoned.into_inner(),
    };
    // Straight to the file descriptor: the test harness captures `eprintln!` of the test
    // thread that armed the watchdog, and drops it at the exit.
    let mut err = std::io::stderr().lock();
    let _ = writeln!(
        err,
        "\n!! this test binary has run for {} s (WARREN_TEST_BINARY_TIMEOUT): a test is stuck. \
         Its brokers' last output follows; they are killed and the binary fails. Tests still \
         running show in the 'has been running for over 60 seconds' lines above.",
        limit.as_secs()
    );
    for l in live.iter() {
        let text = l
            .output
            .lock()
            .map(|o| String::from_utf8_lossy(&o).into_owned())
            .unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let tail = &lines[lines.len().saturating_sub(40)..];
        let _ = writeln!(
            err,
            "---- last output of the broker at {} ----\n{}\n---- end ----",
            l.addr,
            tail.join("\n")
        );
        unsafe { libc::kill(l.pid as libc::pid_t, libc::SIGKILL) };
    }
    std::process::exit(124);
}
