//! Durability: what survives a restart (durable definitions, persistent messages in durable queues), what does
//! not (transient messages, non-durable queues), redelivery after a restart, the data directory lock, and the
//! crash test: publishers with confirms and consumers with acks while the broker is killed with SIGKILL again and
//! again; every confirmed message must be delivered at least once, and nothing never published may appear.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_lite::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicGetOptions, BasicPublishOptions,
    ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Confirmation, ExchangeKind};
use warren_conformance::disk::SmallDisk;
use warren_conformance::http::{eventually, request};
use warren_conformance::{amqp_error, connect_url, unique, within, TestBroker};

fn persistent() -> BasicProperties {
    BasicProperties::default().with_delivery_mode(2)
}

async fn declare(ch: &Channel, q: &str, durable: bool) {
    ch.queue_declare(
        q.into(),
        QueueDeclareOptions {
            durable,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
}

async fn publish_confirmed(
    ch: &Channel,
    exchange: &str,
    key: &str,
    body: &[u8],
    props: BasicProperties,
) {
    let confirm = ch
        .basic_publish(
            exchange.into(),
            key.into(),
            BasicPublishOptions::default(),
            body,
            props,
        )
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(matches!(confirm, Confirmation::Ack(_)), "{confirm:?}");
}

/// Drains `q` with basic.get (acking each): (body, redelivered) in order.
async fn drain(ch: &Channel, q: &str) -> Vec<(String, bool)> {
    let mut out = Vec::new();
    while let Some(m) = ch
        .basic_get(q.into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
    {
        out.push((
            String::from_utf8_lossy(&m.delivery.data).into_owned(),
            m.delivery.redelivered,
        ));
    }
    out
}

#[tokio::test]
async fn durable_definitions_and_persistent_messages_survive_a_restart() {
    let mut broker = TestBroker::start();
    if broker.is_external() {
        return; // restarts a spawned broker
    }
    let (dq, tq, x) = (unique("dur-q"), unique("dur-transient-q"), unique("dur-x"));
    {
        let conn = broker.connect().await;
        let ch = conn.create_channel().await.unwrap();
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        declare(&ch, &dq, true).await;
        declare(&ch, &tq, false).await;
        ch.exchange_declare(
            x.as_str().into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
        ch.queue_bind(
            dq.as_str().into(),
            x.as_str().into(),
            "jobs.#".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
        publish_confirmed(&ch, "", &dq, b"p1", persistent()).await;
        publish_confirmed(&ch, "", &dq, b"t1", BasicProperties::default()).await;
        publish_confirmed(&ch, &x, "jobs.a", b"p2", persistent()).await;
        publish_confirmed(&ch, "", &tq, b"lost", persistent()).await;
    }
    broker.restart(false);
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    // The durable queue is back with its persistent messages only, in order, not redelivered.
    assert_eq!(
        drain(&ch, &dq).await,
        vec![("p1".to_string(), false), ("p2".to_string(), false)]
    );
    // The binding routes again.
    publish_confirmed(&ch, &x, "jobs.b", b"p3", persistent()).await;
    assert_eq!(drain(&ch, &dq).await, vec![("p3".to_string(), false)]);
    // The non-durable queue is gone: a passive declare is refused with 404.
    let err = ch
        .queue_declare(
            tq.as_str().into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(amqp_error(&err).map(|(c, _)| c), Some(404), "{err}");
}

#[tokio::test]
async fn unacked_messages_come_back_redelivered_with_their_delivery_count() {
    let mut broker = TestBroker::start();
    if broker.is_external() {
        return;
    }
    let q = unique("dur-unacked");
    {
        let conn = broker.connect().await;
        let ch = conn.create_channel().await.unwrap();
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        declare(&ch, &q, true).await;
        publish_confirmed(&ch, "", &q, b"held", persistent()).await;
        publish_confirmed(&ch, "", &q, b"acked", persistent()).await;
        let mut consumer = ch
            .basic_consume(
                q.as_str().into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        let _held = within("first delivery", consumer.next())
            .await
            .unwrap()
            .unwrap();
        let acked = within("second delivery", consumer.next())
            .await
            .unwrap()
            .unwrap();
        acked.ack(BasicAckOptions::default()).await.unwrap();
        // The ack reached the broker once a round trip on the channel has completed.
        declare(&ch, &q, true).await;
        // Stopped (SIGTERM) with "held" still unacked.
        broker.restart(false);
    }
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    assert_eq!(drain(&ch, &q).await, vec![("held".to_string(), true)]);
}

#[tokio::test]
async fn a_second_broker_on_the_same_data_directory_is_refused() {
    let broker = TestBroker::start();
    let Some(dir) = broker.data_dir() else {
        return;
    };
    let dir = dir.display().to_string();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
    let out = std::process::Command::new(warren_conformance::warren_binary())
        .args(["--bind", "127.0.0.1", "--port", &port, "--data-dir", &dir])
        .args(["--no-management", "--no-prometheus", "--no-sqs"])
        .output()
        .expect("run warren");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&dir) && err.contains("--data-dir"),
        "the error should name the directory and the flag: {err}"
    );
}

/// A tiny deterministic generator (no dependency): the test's schedule is reproducible from its seed.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self, below: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % below.max(1)
    }
}

/// Publishes numbered persistent messages in windows of 16 with confirms; records the numbers confirmed. Runs
/// until the connection dies.
async fn publisher(
    url: String,
    q: String,
    next: Arc<Mutex<u64>>,
    confirmed: Arc<Mutex<BTreeSet<u64>>>,
) {
    let Ok(conn) = lapin::Connection::connect(&url, Default::default()).await else {
        return;
    };
    let Ok(ch) = conn.create_channel().await else {
        return;
    };
    if ch
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .is_err()
    {
        return;
    }
    loop {
        let mut window = Vec::new();
        for _ in 0..16 {
            let n = {
                let mut next = next.lock().unwrap();
                *next += 1;
                *next
            };
            let Ok(pending) = ch
                .basic_publish(
                    "".into(),
                    q.as_str().into(),
                    BasicPublishOptions::default(),
                    n.to_string().as_bytes(),
                    persistent(),
                )
                .await
            else {
                return;
            };
            window.push((n, pending));
        }
        for (n, pending) in window {
            match pending.await {
                Ok(Confirmation::Ack(_)) => {
                    confirmed.lock().unwrap().insert(n);
                }
                Ok(_) => {}
                Err(_) => return,
            }
        }
    }
}

/// Consumes with manual acks (one ack per message, as a worker does); records every delivered number.
async fn consumer(url: String, q: String, delivered: Arc<Mutex<BTreeSet<u64>>>) {
    let Ok(conn) = lapin::Connection::connect(&url, Default::default()).await else {
        return;
    };
    let Ok(ch) = conn.create_channel().await else {
        return;
    };
    let _ = ch.basic_qos(50, Default::default()).await;
    let Ok(mut deliveries) = ch
        .basic_consume(
            q.as_str().into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
    else {
        return;
    };
    while let Some(Ok(d)) = deliveries.next().await {
        if let Some(n) = std::str::from_utf8(&d.data)
            .ok()
            .and_then(|s| s.parse().ok())
        {
            delivered.lock().unwrap().insert(n);
        }
        if d.ack(BasicAckOptions::default()).await.is_err() {
            return;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn confirmed_messages_survive_repeated_kill_9() {
    let mut broker = TestBroker::start();
    if broker.is_external() {
        return;
    }
    // The suite runs a few cycles; scripts/crash-test runs it for minutes (WARREN_CRASH_SECONDS).
    let env = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u64>().ok());
    let seconds = env("WARREN_CRASH_SECONDS");
    let cycles = env("WARREN_CRASH_CYCLES").unwrap_or(if seconds.is_some() { u64::MAX } else { 6 });
    let deadline = Instant::now() + Duration::from_secs(seconds.unwrap_or(3600));
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64);
    eprintln!("crash test: {cycles} cycles or {seconds:?} s, seed {seed}");
    let mut rng = Lcg(seed);
    let q = unique("crash");
    {
        let conn = broker.connect().await;
        let ch = conn.create_channel().await.unwrap();
        declare(&ch, &q, true).await;
    }
    let next = Arc::new(Mutex::new(0u64));
    let confirmed = Arc::new(Mutex::new(BTreeSet::new()));
    let delivered = Arc::new(Mutex::new(BTreeSet::new()));
    let started = Instant::now();
    let mut cycle = 0u64;
    while cycle < cycles && Instant::now() < deadline {
        cycle += 1;
        let url = broker.url().to_string();
        let mut tasks = Vec::new();
        for _ in 0..2 {
            tasks.push(tokio::spawn(publisher(
                url.clone(),
                q.clone(),
                next.clone(),
                confirmed.clone(),
            )));
        }
        // Every other cycle a consumer drains concurrently; otherwise the queue grows.
        if cycle % 2 == 1 {
            tasks.push(tokio::spawn(consumer(
                url.clone(),
                q.clone(),
                delivered.clone(),
            )));
        }
        tokio::time::sleep(Duration::from_millis(50 + rng.next(300))).await;
        broker.restart(true);
        // A client that connected to the restarted broker keeps going: stop it (what it saw
        // confirmed is recorded already).
        for t in tasks {
            t.abort();
            let _ = t.await;
        }
    }
    // Drain what is left.
    let conn = connect_url(broker.url()).await;
    let ch = conn.create_channel().await.unwrap();
    for (body, _) in drain(&ch, &q).await {
        delivered
            .lock()
            .unwrap()
            .insert(body.parse::<u64>().expect("a number we published"));
    }
    let confirmed = confirmed.lock().unwrap().clone();
    let delivered = delivered.lock().unwrap().clone();
    let published = *next.lock().unwrap();
    let lost: Vec<&u64> = confirmed.difference(&delivered).take(20).collect();
    eprintln!(
        "crash test: {cycle} kills, {} published, {} confirmed, {} delivered, {:.1} s",
        published,
        confirmed.len(),
        delivered.len(),
        started.elapsed().as_secs_f64()
    );
    assert!(
        confirmed.len() > 100,
        "too few confirms to mean anything: {}",
        confirmed.len()
    );
    assert!(
        lost.is_empty(),
        "confirmed but never delivered (seed {seed}): {lost:?}"
    );
    let invented: Vec<&u64> = delivered
        .iter()
        .filter(|n| **n == 0 || **n > published)
        .take(20)
        .collect();
    assert!(
        invented.is_empty(),
        "delivered but never published: {invented:?}"
    );
}

#[tokio::test]
async fn a_full_disk_nacks_publishes_and_the_broker_keeps_serving() {
    if std::env::var("WARREN_TEST_URL").is_ok_and(|u| !u.trim().is_empty()) {
        return;
    }
    let Some(disk) = SmallDisk::mount("24m") else {
        return;
    };
    let dir = disk.path.join("data");
    let dir = dir.to_str().expect("utf-8 path");
    let broker = TestBroker::start_with(&["--data-dir", dir, "--disk-free-limit", "0"]);
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let q = unique("full");
    declare(&ch, &q, true).await;
    let body = vec![b'x'; 64 * 1024];
    let mut acked = 0u32;
    let mut nacked = false;
    // 24 MiB hold fewer than 400 such messages. Each publish is bounded: a broker that
    // neither confirms nor nacks fails here instead of hanging the suite.
    for _ in 0..1000 {
        let confirm = within("the confirm of a publish to a filling disk", async {
            ch.basic_publish(
                "".into(),
                q.as_str().into(),
                BasicPublishOptions::default(),
                &body,
                persistent(),
            )
            .await
            .unwrap()
            .await
            .unwrap()
        })
        .await;
        match confirm {
            Confirmation::Ack(_) => acked += 1,
            Confirmation::Nack(_) => {
                nacked = true;
                break;
            }
            Confirmation::NotRequested => panic!("confirms were selected"),
        }
    }
    assert!(acked > 10, "the disk took only {acked} messages");
    assert!(nacked, "a full disk must nack publishes ({acked} acked)");
    // The failing store raises the disk alarm (publishers are blocked, as under RabbitMQ's
    // disk alarm), and the broker keeps serving what it can: the API, and consumers.
    let api = broker
        .http_url()
        .expect("the test broker serves its API")
        .to_string();
    eventually("the disk alarm in /api/nodes", || {
        let nodes = request(
            "GET",
            &format!("{api}/api/nodes"),
            Some(("guest", "guest")),
            &[],
            None,
        );
        match nodes.json()[0]["disk_free_alarm"].as_bool() {
            Some(true) => Ok(()),
            other => Err(format!("disk_free_alarm is {other:?}: {}", nodes.text())),
        }
    });
    let reader = broker.connect().await;
    let rch = reader.create_channel().await.unwrap();
    let got = within(
        "a basic.get while the disk is full",
        rch.basic_get(q.as_str().into(), BasicGetOptions { no_ack: true }),
    )
    .await
    .unwrap()
    .expect("a confirmed message is still there");
    assert_eq!(got.delivery.data.len(), body.len());
    drop(reader);
    drop(conn);
    drop(broker);
}

#[tokio::test]
async fn a_committed_transaction_survives_kill_9() {
    let mut broker = TestBroker::start();
    if broker.is_external() {
        return;
    }
    let q = unique("dur-tx");
    {
        let conn = broker.connect().await;
        let ch = conn.create_channel().await.unwrap();
        declare(&ch, &q, true).await;
        ch.tx_select().await.unwrap();
        for body in [&b"t1"[..], b"t2"] {
            ch.basic_publish(
                "".into(),
                q.as_str().into(),
                BasicPublishOptions::default(),
                body,
                persistent(),
            )
            .await
            .unwrap();
        }
        // commit-ok means on disk, as a confirm does: a kill right after loses nothing.
        ch.tx_commit().await.unwrap();
        broker.restart(true);
    }
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let got: Vec<String> = drain(&ch, &q).await.into_iter().map(|(b, _)| b).collect();
    assert_eq!(got, vec!["t1", "t2"]);
}
