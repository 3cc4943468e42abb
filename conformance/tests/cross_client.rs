//! The core flows (connect, declare, publish, get, consume with manual ack, prefetch, requeue on close,
//! confirms) driven by pika and by amqplib against the test broker: `clients/pika_flows.py` and
//! `clients/amqplib_flows.js`; a real Celery application with its worker (`clients/celery_flows.py`); and
//! asyncio flows with aio-pika (`clients/aiopika_flows.py`), including a robust connection that lives through
//! broker restarts; and a pool of pika worker processes on Warren's task-queue features
//! (`clients/worker_pool.py`); and boto3 on Warren's SQS endpoint, with pika on the same queues
//! (`clients/sqs_flows.py`); and Celery on its SQS transport (`clients/celery_sqs_flows.py`). A missing
//! interpreter or library fails the test (never a silent skip): `scripts/test` installs pika, Celery, aio-pika,
//! boto3 and pycurl (`clients/requirements.txt`) into `clients/.deps/python` and amqplib into
//! `clients/node_modules`.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use warren_conformance::TestBroker;

fn clients_dir() -> PathBuf {
    warren_conformance::conformance_dir()
        .join("..")
        .join("clients")
}

fn python() -> String {
    std::env::var("WARREN_PYTHON").unwrap_or_else(|_| "python3".into())
}

fn node() -> String {
    std::env::var("WARREN_NODE").unwrap_or_else(|_| "node".into())
}

/// PYTHONPATH with the project-local Python packages (pika, Celery, aio-pika) first.
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

/// Runs `cmd` with its standard input piped, handing each line it prints to `on_line`; a `Some(reply)` is
/// written back to its standard input as one line. Fails the test after `timeout`; returns (success,
/// stdout + stderr).
fn run_interactive(
    mut cmd: Command,
    timeout: Duration,
    mut on_line: impl FnMut(&str) -> Option<String>,
) -> (bool, String) {
    let desc = format!("{cmd:?}");
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| {
            panic!("cannot run {desc}: {e} — is it installed? (scripts/test sets it up)")
        });
    let mut stdin = child.stdin.take().unwrap();
    let out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let (lines_tx, lines) = mpsc::channel::<String>();
    let out_reader = std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if lines_tx.send(line).is_err() {
                break;
            }
        }
    });
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + timeout;
    let mut stdout = String::new();
    let mut timed_out = false;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match lines.recv_timeout(left) {
            Ok(line) => {
                stdout.push_str(&line);
                stdout.push('\n');
                if let Some(reply) = on_line(&line) {
                    // The script may have died meanwhile: its output says why.
                    let _ = writeln!(stdin, "{reply}").and_then(|()| stdin.flush());
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                timed_out = true;
                break;
            }
        }
    }
    drop(stdin);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if timed_out || Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let _ = out_reader.join();
    let output = format!(
        "--- stdout ---\n{stdout}--- stderr ---\n{}",
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

/// Checks that `modules` import from the project-local Python packages, with the message telling what to run.
fn require_python_modules(modules: &str) {
    let mut cmd = Command::new(python());
    cmd.arg("-c")
        .arg(format!("import {modules}"))
        .env("PYTHONPATH", python_path());
    let (ok, out) = run(cmd, Duration::from_secs(30));
    assert!(
        ok,
        "python3 with {modules} is required for the cross-client tests (run scripts/test, or \
         `python3 -m pip install --target clients/.deps/python -r clients/requirements.txt`):\n{out}"
    );
}

fn require_celery() {
    require_python_modules("celery, kombu, sqlalchemy");
}

fn require_aiopika() {
    require_python_modules("aio_pika, aiormq");
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

/// PYTHONPATH with the SDK from before SQS's JSON protocol (botocore 1.31,
/// `clients/requirements-legacy.txt`), which `scripts/test` installs into `clients/.deps/python-legacy`.
fn legacy_python_path() -> String {
    clients_dir()
        .join(".deps")
        .join("python-legacy")
        .display()
        .to_string()
}

/// botocore 1.31, unchanged, on the SQS endpoint over the query protocol (`clients/sqs_query_flows.py`):
/// queues and their attributes, messages with every attribute type (botocore checks the digests),
/// batches with a failed entry, visibility, purge, the query protocol's error codes, a FIFO queue.
#[test]
fn botocore_over_the_sqs_query_protocol() {
    let broker = TestBroker::start();
    if broker.is_external() {
        eprintln!("skipped: the SQS API is Warren's, not the external broker's");
        return;
    }
    let mut cmd = Command::new(python());
    cmd.arg(clients_dir().join("sqs_query_flows.py"))
        .arg(broker.sqs_url().expect("the SQS API on"))
        .env("PYTHONPATH", legacy_python_path())
        .env("PYTHONUNBUFFERED", "1");
    let (ok, out) = run(cmd, Duration::from_secs(120));
    assert!(
        ok,
        "the query-protocol flows failed against {:?} (is botocore 1.31 in clients/.deps/python-legacy? scripts/test installs it):\n{out}",
        broker.sqs_url()
    );
    eprintln!("{out}");
}

/// pika on a quorum queue of a 3-node cluster, connected to a node that does not lead it
/// (`clients/pika_cluster_flows.py`): publishes with confirms there and on the leader, basic.get with
/// and without ack (served by the leader), a get given back by a closed channel, a consumer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pika_on_a_follower_of_a_quorum_queue() {
    if std::env::var_os("WARREN_TEST_URL").is_some() {
        eprintln!("skipped: needs a Warren cluster of its own");
        return;
    }
    require_pika();
    let c = warren_conformance::cluster::TestCluster::start(3, 20);
    let q = warren_conformance::unique("pika-qq");
    c.declare_quorum_queue(1, &q).await;
    let leader = c.leader_of(&q, 1);
    let follower = leader % 3 + 1;
    let mut cmd = Command::new(python());
    cmd.arg(clients_dir().join("pika_cluster_flows.py"))
        .arg(c.node(follower).url())
        .arg(c.node(leader).url())
        .arg(&q)
        .env("PYTHONPATH", python_path())
        .env("PYTHONUNBUFFERED", "1");
    let (ok, out) = tokio::task::spawn_blocking(move || run(cmd, Duration::from_secs(60)))
        .await
        .expect("the pika run");
    assert!(ok, "pika on a follower failed:\n{out}");
}

/// The worker pool of Warren's task queues, end to end (`clients/worker_pool.py`): 4 pika worker processes
/// (prefetch 3, each its own connection) on a queue with `x-visibility-timeout`, `x-delivery-limit` and a
/// dead-letter exchange, `x-delayed-retry-min` and `x-group-header`, given a few hundred persistent jobs. Some
/// crash their worker (os._exit: the connection drops; the worker is restarted), some run for several
/// visibility timeouts extending their delivery through `amq.warren.visibility`, some stall past their timeout
/// and ack late, some always nack (poison), and 10 groups of jobs carry crash, long and poison jobs too. Every
/// job but the poison ones is done; the poison ones, and only they, are in the dead-letter queue once each with
/// an `x-death` of reason `delivery_limit`; long jobs are done once and never redelivered; each group's jobs ran
/// one at a time, first completions in publish order; the work queue ends empty.
#[test]
fn pika_worker_pool_with_crashes_extensions_poison_and_groups() {
    require_pika();
    let broker = TestBroker::start();
    if broker.is_external() {
        eprintln!("skipped: needs Warren's task-queue arguments (visibility timeouts, groups)");
        return;
    }
    let mut cmd = Command::new(python());
    cmd.arg(clients_dir().join("worker_pool.py"))
        .arg(broker.url())
        .env("PYTHONPATH", python_path())
        .env("PYTHONUNBUFFERED", "1");
    let (ok, out) = run(cmd, Duration::from_secs(90));
    assert!(
        ok,
        "the pika worker pool failed against {}:\n{out}",
        broker.url()
    );
    eprintln!("{out}");
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

/// Runs `clients/celery_flows.py` (a Celery app, its worker as a subprocess, results in SQLite) with the flows
/// whose names start with one of `flows`.
fn celery_flows(flows: &[&str]) {
    require_celery();
    let broker = TestBroker::start();
    let mut cmd = Command::new(python());
    cmd.arg(clients_dir().join("celery_flows.py"))
        .arg(broker.url())
        .args(flows)
        .env("PYTHONPATH", python_path())
        .env("PYTHONUNBUFFERED", "1");
    let (ok, out) = run(cmd, Duration::from_secs(120));
    assert!(ok, "celery flows failed against {}:\n{out}", broker.url());
}

/// Plain tasks and results (and a failing task), countdown and eta tasks (run no earlier than asked),
/// `self.retry(countdown=1)` ending in success, an `acks_late` task whose worker is SIGKILLed mid-task and runs
/// again in a new worker (redelivered), a group and a chord.
#[test]
fn celery_tasks_eta_retry_acks_late_and_canvas() {
    celery_flows(&["tasks", "eta", "retry", "acks_late", "canvas"]);
}

/// A worker holds ETA tasks unacked until they are due and raises its prefetch (basic.qos) for each, so that
/// other tasks still reach it.
///
/// kombu sends that basic.qos with global=true only to a broker whose `product` is RabbitMQ (3.3 or later), and
/// global=false otherwise, which RabbitMQ and Warren apply to new consumers only: this is why Warren's
/// `connection.start` says RabbitMQ 3.10.8 (its `platform` says Warren).
#[test]
fn celery_eta_tasks_do_not_hold_up_other_tasks() {
    celery_flows(&["prefetch"]);
}

/// Publisher confirms (100 concurrent, then consumed in order with manual acks; a mandatory publish to no
/// queue returned with 312 NO_ROUTE), RPC over direct reply-to, and the 406 for a reply-to without a reply
/// consumer.
#[test]
fn aiopika_confirms_and_direct_reply_to() {
    require_aiopika();
    let broker = TestBroker::start();
    let mut cmd = Command::new(python());
    cmd.arg(clients_dir().join("aiopika_flows.py"))
        .arg(broker.url())
        .arg("core")
        .env("PYTHONPATH", python_path())
        .env("PYTHONUNBUFFERED", "1");
    let (ok, out) = run(cmd, Duration::from_secs(60));
    assert!(ok, "aio-pika flows failed against {}:\n{out}", broker.url());
}

/// `aio_pika.connect_robust` consuming from a durable queue with prefetch 1 while the broker is stopped with
/// SIGTERM and started again on the same port and data directory, then killed with SIGKILL and started again:
/// the connection, channel and consumer come back by themselves, the message held unacked comes back
/// redelivered, the queued persistent messages follow in order, and publishing on the same channel goes on.
#[test]
fn aiopika_robust_connection_survives_broker_restarts() {
    require_aiopika();
    let mut broker = TestBroker::start();
    if broker.is_external() {
        eprintln!("skipped: needs a spawned warren (restarts it)");
        return;
    }
    let url = broker.url().to_string();
    let mut cmd = Command::new(python());
    cmd.arg(clients_dir().join("aiopika_flows.py"))
        .arg(&url)
        .arg("robust")
        .env("PYTHONPATH", python_path())
        .env("PYTHONUNBUFFERED", "1");
    let mut restarts = Vec::new();
    let (ok, out) = run_interactive(cmd, Duration::from_secs(120), |line| {
        let how = line.strip_prefix("RESTART-BROKER ")?;
        let kill = match how.trim() {
            "term" => false,
            "kill" => true,
            other => panic!("the script asked for an unknown restart {other:?}"),
        };
        broker.restart(kill);
        restarts.push(how.trim().to_string());
        Some("restarted".into())
    });
    assert!(ok, "aio-pika robust flow failed against {url}:\n{out}");
    assert_eq!(
        restarts,
        ["term", "kill"],
        "restarts the script asked for:\n{out}"
    );
}

/// boto3, unchanged, on the SQS endpoint (`clients/sqs_flows.py`): create, send with attributes (the
/// digests checked against AWS's algorithm), a long poll answered at the send, visibility changes and
/// batches, redrive to a dead-letter queue after maxReceiveCount receives, a queue shared with pika
/// (an AMQP publish received by boto3, a boto3 send consumed over AMQP), and a FIFO queue (groups in
/// order and one at a time, content-based and explicit deduplication, SQS's refusals).
#[test]
fn boto3_sqs_flows_and_pika_on_the_same_queues() {
    require_python_modules("boto3, pika");
    let broker = TestBroker::start();
    if broker.is_external() {
        eprintln!("skipped: the SQS API is Warren's, not the external broker's");
        return;
    }
    let mut cmd = Command::new(python());
    cmd.arg(clients_dir().join("sqs_flows.py"))
        .arg(broker.sqs_url().expect("the SQS API on"))
        .arg(broker.url())
        .env("PYTHONPATH", python_path())
        .env("PYTHONUNBUFFERED", "1");
    let (ok, out) = run(cmd, Duration::from_secs(120));
    assert!(
        ok,
        "boto3 SQS flows failed against {:?}:\n{out}",
        broker.sqs_url()
    );
    eprintln!("{out}");
}

/// Celery on its SQS transport (kombu's `sqs://`, boto3 and pycurl), unchanged, on the SQS endpoint
/// (`clients/celery_sqs_flows.py`): tasks and results, a worker killed mid-task whose task runs again after
/// its visibility timeout, and a poison task moved to the dead-letter queue by its redrive policy, then sent
/// back by a message move task once fixed.
#[test]
fn celery_on_the_sqs_transport_with_crashes_and_a_redrive() {
    require_python_modules("celery, kombu, boto3, pycurl, sqlalchemy");
    let broker = TestBroker::start();
    if broker.is_external() {
        eprintln!("skipped: the SQS API is Warren's, not the external broker's");
        return;
    }
    let mut cmd = Command::new(python());
    cmd.arg(clients_dir().join("celery_sqs_flows.py"))
        .arg(broker.sqs_url().expect("the SQS API on"))
        .env("PYTHONPATH", python_path())
        .env("PYTHONUNBUFFERED", "1");
    let (ok, out) = run(cmd, Duration::from_secs(180));
    assert!(
        ok,
        "Celery SQS flows failed against {:?}:\n{out}",
        broker.sqs_url()
    );
    eprintln!("{out}");
}
