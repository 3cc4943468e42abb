//! A bound on a whole test binary: a test stuck on something that never comes (a broker
//! blocking publishers on a nearly full disk was one) would otherwise hold `cargo test`, and
//! the suite, until CI gives up on it. Armed by the first broker a binary starts; when it
//! fires it prints the tail of every live broker's output, kills those brokers (and RabbitMQ
//! nodes), removes the harness's files of this process from the temporary directory, and
//! exits the binary with a failure; `cargo test --no-fail-fast` goes on with the next one.

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::time::Duration;

/// Seconds a test binary may run once it started a broker: `WARREN_TEST_BINARY_TIMEOUT`
/// (0: no bound), else 600 (the longest binary takes under 90 s on 2 cores).
fn limit() -> Option<Duration> {
    let secs = std::env::var("WARREN_TEST_BINARY_TIMEOUT")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(600u64);
    (secs > 0).then(|| Duration::from_secs(secs))
}

struct Live {
    what: String,
    output: Option<Arc<Mutex<Vec<u8>>>>,
    kill: Box<dyn Fn() + Send>,
}

static LIVE: Mutex<BTreeMap<u64, Live>> = Mutex::new(BTreeMap::new());
static NEXT: AtomicU64 = AtomicU64::new(1);

/// Notes a process the harness started (and arms the watchdog on the first): `kill` ends it
/// if the watchdog fires. The id returned is given to [`stopped`] once it is gone.
pub(crate) fn started(
    what: String,
    output: Option<Arc<Mutex<Vec<u8>>>>,
    kill: Box<dyn Fn() + Send>,
) -> u64 {
    static ARMED: Once = Once::new();
    ARMED.call_once(|| {
        if let Some(limit) = limit() {
            std::thread::spawn(move || {
                std::thread::sleep(limit);
                fire(limit);
            });
        }
    });
    let id = NEXT.fetch_add(1, Ordering::Relaxed);
    let mut live = LIVE.lock().unwrap_or_else(|p| p.into_inner());
    live.insert(id, Live { what, output, kill });
    id
}

/// Forgets a process that was stopped and waited for.
pub(crate) fn stopped(id: u64) {
    LIVE.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
}

/// SIGKILLs `pid` if it is still a child of this process (a pid reaped already may have been
/// given to another program since).
pub(crate) fn kill_child(pid: u32) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // "PID (COMM) STATE PPID ...": COMM may hold spaces and parentheses; the last ')' ends it.
    let ppid = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().nth(1))
        .and_then(|p| p.parse::<u32>().ok());
    if ppid == Some(std::process::id()) {
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
    }
}

fn fire(limit: Duration) {
    let live = LIVE.lock().unwrap_or_else(|p| p.into_inner());
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
    for l in live.values() {
        if let Some(output) = &l.output {
            let text = output
                .lock()
                .map(|o| String::from_utf8_lossy(&o).into_owned())
                .unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            let tail = &lines[lines.len().saturating_sub(40)..];
            let _ = writeln!(
                err,
                "---- last output of {} ----\n{}\n---- end ----",
                l.what,
                tail.join("\n")
            );
        }
        (l.kill)();
    }
    remove_own_files();
    std::process::exit(124);
}

/// What the harness of this process left in the temporary directory: brokers' data and
/// command logs, test clusters' and RabbitMQ nodes' directories (named with this process's id).
fn remove_own_files() {
    let pid = std::process::id();
    let prefixes = [
        format!("warren-test-data-{pid}-"),
        format!("warren-commands-{pid}-"),
        format!("warren-cluster-{pid:x}-"),
        format!("warren-test-{pid:x}-"),
    ];
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if prefixes.iter().any(|p| name.starts_with(p.as_str())) {
            let path = e.path();
            let _ = std::fs::remove_dir_all(&path).or_else(|_| std::fs::remove_file(&path));
        }
    }
}
