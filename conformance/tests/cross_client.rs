//! The core flows (connect, declare, publish, get, consume with manual ack, prefetch, requeue on close,
//! confirms) driven by pika and by amqplib against the test broker: `clients/pika_flows.py` and
//! `clients/amqplib_flows.js`. A missing interpreter or library fails the test (never a silent skip):
//! `scripts/test` installs pika into `clients/.deps/python` and amqplib into `clients/node_modules`.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use warren_conformance::TestBroker;

fn clients_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("clients")
}

fn python() -> String {
    std::env::var("WARREN_PYTHON").unwrap_or_else(|_| "python3".into())
}

fn node() -> String {
    std::env::var("WARREN_NODE").unwrap_or_else(|_| "node".into())
}

/// PYTHONPATH with the project-local pika first.
fn python_path() -> String {
    let local = clients_dir().join(".deps").join("python");
    match std::env::var("PYTHONPATH") {
        Ok(p) if !p.is_empty() => format!("{}:{p}", local.display()),
        _ => local.display().to_string(),
    }
}

/// Runs `cmd`, failing the test after `timeout`; returns (success, stdout + stderr).
fn run(mut cmd: Command, timeout: Duration) -> (bool, String) {
    let desc = format!("{cmd:?}");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| {
            panic!("cannot run {desc}: {e} — is it installed? (scripts/test sets it up)")
        });
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let out_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let output = format!(
        "--- stdout ---\n{}--- stderr ---\n{}",
        out_reader.join().unwrap(),
        err_reader.join().unwrap()
    );
    match status {
        Some(s) => (s.success(), output),
        None => (
            false,
            format!("{desc} timed out after {timeout:?}\n{output}"),
        ),
    }
}

fn require_pika() {
    let mut cmd = Command::new(python());
    cmd.arg("-c")
        .arg("import pika; print(pika.__version__)")
        .env("PYTHONPATH", python_path());
    let (ok, out) = run(cmd, Duration::from_secs(30));
    assert!(
        ok,
        "python3 with pika is required for the cross-client tests (run scripts/test, or \
         `python3 -m pip install --target clients/.deps/python pika`):\n{out}"
    );
}

fn require_amqplib() {
    let mut cmd = Command::new(node());
    cmd.arg("-e")
        .arg("require('amqplib'); console.log('amqplib ok')")
        .current_dir(clients_dir());
    let (ok, out) = run(cmd, Duration::from_secs(30));
    assert!(
        ok,
        "node with amqplib is required for the cross-client tests (run scripts/test, or `npm ci` in clients/):\n{out}"
    );
}

#[test]
fn pika_core_flows() {
    require_pika();
    let broker = TestBroker::start();
    let mut cmd = Command::new(python());
    cmd.arg(clients_dir().join("pika_flows.py"))
        .arg(broker.url())
        .env("PYTHONPATH", python_path())
        .env("PYTHONUNBUFFERED", "1");
    let (ok, out) = run(cmd, Duration::from_secs(120));
    assert!(ok, "pika flows failed against {}:\n{out}", broker.url());
}

#[test]
fn amqplib_core_flows() {
    require_amqplib();
    let broker = TestBroker::start();
    let mut cmd = Command::new(node());
    cmd.arg(clients_dir().join("amqplib_flows.js"))
        .arg(broker.url())
        .current_dir(clients_dir());
    let (ok, out) = run(cmd, Duration::from_secs(120));
    assert!(ok, "amqplib flows failed against {}:\n{out}", broker.url());
}
