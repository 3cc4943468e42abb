//! `warren migrate` from a real RabbitMQ 3.10 (Debian's, started by the test): definitions
//! with users, policies and a shovel, and messages across queues and vhosts while a producer
//! keeps publishing to the source; the migration is killed with SIGKILL once and run again.
//! Every message arrives at least once, and Warren's queues act as the source's policies say.
//! A consumer left on the source holding unacked messages keeps the migration going until it
//! leaves (its messages come back to the source then, and must cross too).

use std::collections::BTreeSet;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use futures_lite::StreamExt;
use lapin::options::{
    BasicConsumeOptions, BasicGetOptions, BasicPublishOptions, BasicQosOptions, BasicRejectOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel};
use serde_json::json;
use warren_conformance::http::{eventually, Api};
use warren_conformance::queues::{confirm_channel, consume_no_ack};
use warren_conformance::rabbitmq::RabbitMq;
use warren_conformance::{connect_url, warren_binary, within_for, TestBroker};

/// Messages put in each queue before the migration starts.
fn per_queue() -> u32 {
    std::env::var("WARREN_MIGRATE_MESSAGES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50_000)
}

/// Messages an application consumer on the source holds unacked during the second run.
const HELD: u16 = 50;

/// Messages in a retry queue (10 min TTL) that were dead-lettered into it 5 min ago.
const WAITING: u32 = 20;

/// (vhost, queue) pairs filled at the source.
const QUEUES: &[(&str, &str)] = &[
    ("/", "jobs.email"),
    ("/", "jobs.reports"),
    ("/", "events"),
    ("billing", "invoices"),
];

async fn publish(ch: &Channel, q: &str, ids: std::ops::Range<u32>) {
    let mut pending = Vec::new();
    for i in ids {
        pending.push(
            ch.basic_publish(
                "".into(),
                q.into(),
                BasicPublishOptions::default(),
                format!("{q}:{i}").as_bytes(),
                BasicProperties::default()
                    .with_delivery_mode(2)
                    .with_message_id(format!("{q}-{i}").into()),
            )
            .await
            .expect("publish"),
        );
        if pending.len() >= 2000 {
            for c in pending.drain(..) {
                assert!(c.await.expect("confirm").is_ack());
            }
        }
    }
    for c in pending {
        assert!(c.await.expect("confirm").is_ack());
    }
}

fn vhost_path(v: &str) -> &str {
    if v == "/" {
        "%2F"
    } else {
        v
    }
}

fn migrate_command(rabbit: &RabbitMq, warren: &TestBroker) -> Command {
    let warren_amqp = warren
        .url()
        .rsplit_once('/')
        .map_or(warren.url(), |(base, _)| base)
        .to_owned();
    let mut cmd = Command::new(warren_binary());
    cmd.arg("migrate")
        .arg("--from-api")
        .arg(format!("http://guest:guest@127.0.0.1:{}", rabbit.http_port))
        .arg("--from-amqp")
        .arg(format!("amqp://guest:guest@127.0.0.1:{}", rabbit.amqp_port))
        .arg("--url")
        .arg(warren_amqp)
        .arg("--api")
        .arg(warren.http_url().expect("management API"))
        .args(["--quiet", "2"])
        .stdout(Stdio::piped())
        .stderr(if std::env::var_os("WARREN_MIGRATE_PROGRESS").is_some() {
            Stdio::inherit()
        } else {
            Stdio::null()
        });
    cmd
}

/// Waits for a migration to exit, killing it (and failing the test) past `limit`.
fn finish(mut child: std::process::Child, limit: Duration) -> std::process::Output {
    let deadline = Instant::now() + limit;
    while child.try_wait().expect("wait").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("warren migrate did not finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    child.wait_with_output().expect("migrate output")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rabbitmq_moves_into_warren_with_nothing_lost_across_a_killed_migration() {
    let Some(rabbit) = RabbitMq::start() else {
        return;
    };
    let n = per_queue();
    // Definitions at the source: a vhost, a user, a policy, a dead-letter exchange, a shovel.
    for (method, path, body) in [
        ("PUT", "/vhosts/billing".to_owned(), json!({})),
        (
            "PUT",
            "/users/app".to_owned(),
            json!({"password": "app-secret", "tags": ""}),
        ),
        (
            "PUT",
            "/permissions/%2F/app".to_owned(),
            json!({"configure": ".*", "write": ".*", "read": ".*"}),
        ),
        (
            "PUT",
            "/permissions/billing/guest".to_owned(),
            json!({"configure": ".*", "write": ".*", "read": ".*"}),
        ),
        (
            "PUT",
            "/exchanges/%2F/jobs.dlx".to_owned(),
            json!({"type": "fanout", "durable": true}),
        ),
        (
            "PUT",
            "/policies/%2F/jobs".to_owned(),
            json!({"pattern": "^jobs\\.", "apply-to": "queues", "priority": 1,
                   "definition": {"dead-letter-exchange": "jobs.dlx", "max-length": 1_000_000}}),
        ),
        (
            "PUT",
            "/queues/%2F/jobs.dead".to_owned(),
            json!({"durable": true}),
        ),
        (
            "POST",
            "/bindings/%2F/e/jobs.dlx/q/jobs.dead".to_owned(),
            json!({"routing_key": ""}),
        ),
        (
            "PUT",
            "/operator-policies/%2F/cap".to_owned(),
            json!({"pattern": "^capped$", "apply-to": "queues", "definition": {"max-length": 3}}),
        ),
        (
            "PUT",
            "/queues/%2F/capped".to_owned(),
            json!({"durable": true}),
        ),
        (
            "PUT",
            "/queues/%2F/retry.wait".to_owned(),
            json!({"durable": true, "arguments": {"x-message-ttl": 600_000}}),
        ),
        (
            "PUT",
            "/queues/%2F/outbox".to_owned(),
            json!({"durable": true}),
        ),
        (
            "PUT",
            "/queues/%2F/outbox.sent".to_owned(),
            json!({"durable": true}),
        ),
        (
            "PUT",
            "/parameters/shovel/%2F/outbox".to_owned(),
            json!({"value": {"src-uri": "amqp://", "src-queue": "outbox",
                             "dest-uri": "amqp://", "dest-queue": "outbox.sent"}}),
        ),
    ] {
        let (code, body) = rabbit.api(method, &path, Some(body));
        assert!((200..300).contains(&code), "{method} {path}: {code} {body}");
    }
    for (vhost, q) in QUEUES {
        let args = if *q == "jobs.reports" {
            json!({"x-queue-type": "quorum"})
        } else {
            json!({})
        };
        let (code, body) = rabbit.api(
            "PUT",
            &format!("/queues/{}/{q}", vhost_path(vhost)),
            Some(json!({"durable": true, "arguments": args})),
        );
        assert!((200..300).contains(&code), "declare {q}: {code} {body}");
    }
    let filled = Instant::now();
    for (vhost, q) in QUEUES {
        let conn = connect_url(&format!(
            "amqp://guest:guest@127.0.0.1:{}/{}",
            rabbit.amqp_port,
            vhost_path(vhost)
        ))
        .await;
        let ch = confirm_channel(&conn).await;
        within_for(
            Duration::from_secs(120),
            "filling the source",
            publish(&ch, q, 0..n),
        )
        .await;
    }
    {
        let conn = connect_url(&format!(
            "amqp://guest:guest@127.0.0.1:{}/%2F",
            rabbit.amqp_port
        ))
        .await;
        let ch = confirm_channel(&conn).await;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_secs();
        for i in 0..WAITING {
            let mut death = FieldTable::default();
            death.insert("queue".into(), AMQPValue::LongString("jobs.email".into()));
            death.insert("reason".into(), AMQPValue::LongString("rejected".into()));
            death.insert("count".into(), AMQPValue::LongLongInt(1));
            death.insert("time".into(), AMQPValue::Timestamp(now - 300));
            let mut headers = FieldTable::default();
            headers.insert("tenant".into(), AMQPValue::LongString("acme".into()));
            headers.insert(
                "x-death".into(),
                AMQPValue::FieldArray(vec![AMQPValue::FieldTable(death)].into()),
            );
            let confirm = ch
                .basic_publish(
                    "".into(),
                    "retry.wait".into(),
                    BasicPublishOptions::default(),
                    format!("wait:{i}").as_bytes(),
                    BasicProperties::default()
                        .with_delivery_mode(2)
                        .with_timestamp(now - 3600)
                        .with_headers(headers),
                )
                .await
                .expect("publish");
            assert!(confirm.await.expect("confirm").is_ack());
        }
    }
    eprintln!(
        "source filled: {} messages in {:.1} s",
        n as usize * QUEUES.len(),
        filled.elapsed().as_secs_f64()
    );

    let warren = TestBroker::start();
    let warren_api = Api::of(&warren);
    // The first run is killed once some of the messages are across.
    let mut first = migrate_command(&rabbit, &warren)
        .spawn()
        .expect("spawn migrate");
    eventually("part of the messages to reach Warren", || {
        let (_, q) = warren_api.call("GET", "/queues/%2F/jobs.email", None);
        match q["messages"].as_u64() {
            Some(m) if m >= u64::from(n / 4) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    });
    first.kill().expect("SIGKILL the migration");
    let _ = first.wait();

    // A producer that keeps publishing to the source while the second run moves, until
    // Warren holds the backlog: then it stops, for the source to empty.
    let published = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let producer = {
        let url = format!("amqp://guest:guest@127.0.0.1:{}/%2f", rabbit.amqp_port);
        let (published, warren_api) = (published.clone(), Api::of(&warren));
        tokio::spawn(async move {
            let conn = connect_url(&url).await;
            let ch = confirm_channel(&conn).await;
            let mut batch = 0u32;
            loop {
                publish(&ch, "jobs.email", n + batch * 200..n + (batch + 1) * 200).await;
                batch += 1;
                published.store(batch * 200, std::sync::atomic::Ordering::SeqCst);
                let (_, q) = warren_api.call("GET", "/queues/%2F/jobs.email", None);
                if q["messages"].as_u64().is_some_and(|m| m >= u64::from(n)) || batch >= 500 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    // An application consumer still on the source, holding messages unacked.
    let source_url = format!("amqp://guest:guest@127.0.0.1:{}/%2f", rabbit.amqp_port);
    let holder = connect_url(&source_url).await;
    let holding = holder.create_channel().await.expect("channel");
    holding
        .basic_qos(HELD, BasicQosOptions::default())
        .await
        .expect("qos");
    let mut held = holding
        .basic_consume(
            "jobs.email".into(),
            "holder".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("consume");
    let mut held_bodies = BTreeSet::new();
    within_for(Duration::from_secs(30), "the holder's deliveries", async {
        for _ in 0..HELD {
            let d = held.next().await.expect("delivery").expect("delivery");
            held_bodies.insert(String::from_utf8_lossy(&d.data).into_owned());
        }
    })
    .await;
    let started = Instant::now();
    let mut second = migrate_command(&rabbit, &warren)
        .spawn()
        .expect("spawn migrate");
    // The holder leaves once the source queue has been empty for a while (past RabbitMQ's
    // statistics interval twice, and the migration's quiet time), or once the migration ended
    // without it: its messages then go back to the source queue, and a migration that ended
    // has left them behind.
    let asking = connect_url(&source_url).await;
    let ask = asking.create_channel().await.expect("channel");
    let mut empty_since: Option<Instant> = None;
    let exited_with_holder = loop {
        if second.try_wait().expect("wait").is_some() {
            break true;
        }
        assert!(
            started.elapsed() < Duration::from_secs(300),
            "the migration did not drain the source"
        );
        let passive = QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let ready = ask
            .queue_declare("jobs.email".into(), passive, FieldTable::default())
            .await
            .expect("passive declare")
            .message_count();
        if ready > 0 {
            empty_since = None;
        } else if empty_since.get_or_insert_with(Instant::now).elapsed() >= Duration::from_secs(14)
        {
            break false;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    holder
        .close(200, "moving to Warren".into())
        .await
        .expect("close");
    assert!(
        !exited_with_holder,
        "warren migrate ended while a consumer on the source held {HELD} unacked messages"
    );
    let out = tokio::task::spawn_blocking(move || finish(second, Duration::from_secs(120)))
        .await
        .expect("join");
    producer.await.expect("producer");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "migrate failed: {stdout}");
    eprintln!(
        "second run: {:.1} s; {}",
        started.elapsed().as_secs_f64(),
        stdout.lines().last().unwrap_or("")
    );
    // The producer published until the backlog was across, and the run ends only once the
    // source stayed empty, so its messages are across too. Every message is in Warren at
    // least once.
    let extra = published.load(std::sync::atomic::Ordering::SeqCst);
    eprintln!("published to the source while moving: {extra}");
    assert!(
        extra >= 200,
        "the producer published while the second run moved"
    );
    for (vhost, q) in QUEUES {
        let conn = connect_url(&warren.url_with_vhost(vhost_path(vhost))).await;
        let ch = conn.create_channel().await.expect("channel");
        let expected = if *q == "jobs.email" { n + extra } else { n };
        let mut consumer = consume_no_ack(&ch, q).await;
        let (mut seen, mut redelivered) = (BTreeSet::new(), BTreeSet::new());
        let mut delivered = 0usize;
        within_for(Duration::from_secs(120), "reading Warren's queue", async {
            while seen.len() < expected as usize {
                let d = consumer.next().await.expect("delivery").expect("delivery");
                delivered += 1;
                let body = String::from_utf8_lossy(&d.data).into_owned();
                if d.redelivered {
                    redelivered.insert(body.clone());
                }
                seen.insert(body);
            }
            // The duplicates of what was in flight when a run stopped come last: read them too.
            while let Ok(Some(Ok(d))) =
                tokio::time::timeout(Duration::from_millis(500), consumer.next()).await
            {
                delivered += 1;
                if d.redelivered {
                    redelivered.insert(String::from_utf8_lossy(&d.data).into_owned());
                }
            }
        })
        .await;
        // One run was killed: at most what it had in flight (--prefetch, 500) came twice.
        let twice = delivered - seen.len();
        assert!(twice <= 500, "{q}: {twice} messages arrived twice");
        if *q == "jobs.email" {
            // What the source had delivered to its own consumer comes as redelivered.
            let fresh: Vec<_> = held_bodies.difference(&redelivered).collect();
            assert!(
                fresh.is_empty(),
                "delivered at the source, not redelivered in Warren: {fresh:?}"
            );
        }
        let missing: Vec<u32> = (0..expected)
            .filter(|i| !seen.contains(&format!("{q}:{i}")))
            .collect();
        assert!(missing.is_empty(), "{q}: lost {} messages", missing.len());
    }
    // The definitions came across: the policy acts on the queues it names, the user logs in
    // with the password RabbitMQ had, the shovel runs on Warren.
    let (_, q) = warren_api.call("GET", "/queues/%2F/jobs.email", None);
    assert_eq!(q["policy"], "jobs", "{q}");
    assert_eq!(
        q["effective_policy_definition"]["dead-letter-exchange"],
        "jobs.dlx"
    );
    let (_, q) = warren_api.call("GET", "/queues/%2F/jobs.reports", None);
    assert_eq!(q["type"], "quorum");
    let app = connect_url(&warren.url_with_credentials("app", "app-secret")).await;
    let ch = confirm_channel(&app).await;
    // The policy's dead-letter exchange: a rejected job goes to jobs.dead.
    publish(&ch, "jobs.email", 0..1).await;
    let got = ch
        .basic_get("jobs.email".into(), BasicGetOptions::default())
        .await
        .expect("get")
        .expect("a message");
    got.delivery
        .reject(BasicRejectOptions { requeue: false })
        .await
        .expect("reject");
    // The operator policy's cap: 3 of 5.
    publish(&ch, "capped", 0..5).await;
    // The shovel runs on Warren.
    publish(&ch, "outbox", 0..2).await;
    eventually("the policies and the shovel to act on Warren", || {
        let depth = |q: &str| {
            warren_api.call("GET", &format!("/queues/%2F/{q}"), None).1["messages"].as_u64()
        };
        match (depth("jobs.dead"), depth("capped"), depth("outbox.sent")) {
            (Some(1), Some(3), Some(2)) => Ok(()),
            other => Err(format!("jobs.dead, capped, outbox.sent: {other:?}")),
        }
    });
    // The retry queue's messages keep their headers and what was left of their 10 min: they
    // were dead-lettered into it 5 min ago.
    let mut waiting = consume_no_ack(&ch, "retry.wait").await;
    within_for(Duration::from_secs(30), "the waiting messages", async {
        for _ in 0..WAITING {
            let d = waiting.next().await.expect("delivery").expect("delivery");
            let headers = d.properties.headers().clone().unwrap_or_default();
            assert_eq!(
                headers.inner().get("tenant"),
                Some(&AMQPValue::LongString("acme".into()))
            );
            assert!(
                matches!(headers.inner().get("x-death"), Some(AMQPValue::FieldArray(a)) if a.as_slice().len() == 1),
                "{headers:?}"
            );
            let left: u64 = d
                .properties
                .expiration()
                .as_ref()
                .and_then(|e| e.as_str().parse().ok())
                .expect("an expiration: what was left of the queue's TTL");
            assert!(
                (60_000..=301_000).contains(&left),
                "5 min of 10 were left when it moved: {left} ms"
            );
        }
    })
    .await;
}

/// The way back: a Warren into a RabbitMQ 3.10. What RabbitMQ would refuse (Warren's own
/// policy keys, `x-delivery-limit` on a classic queue) is left out and said, instead of the
/// whole import failing; the rest and every message cross.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warren_moves_back_into_rabbitmq() {
    let Some(rabbit) = RabbitMq::start() else {
        return;
    };
    let warren = TestBroker::start();
    let api = Api::of(&warren);
    for (path, body) in [
        (
            "/policies/%2F/tasks",
            json!({"pattern": "^tasks\\.", "apply-to": "queues",
                   "definition": {"visibility-timeout": 30000, "max-length": 1000}}),
        ),
        (
            "/queues/%2F/tasks.email",
            json!({"durable": true, "arguments": {"x-delivery-limit": 5, "x-visibility-timeout": 10000}}),
        ),
        (
            "/queues/%2F/tasks.quorum",
            json!({"durable": true, "arguments": {"x-queue-type": "quorum", "x-delivery-limit": 3}}),
        ),
    ] {
        let (code, body) = api.call("PUT", path, Some(body));
        assert!((200..300).contains(&code), "{path}: {code} {body}");
    }
    let conn = warren.connect().await;
    let ch = confirm_channel(&conn).await;
    publish(&ch, "tasks.email", 0..300).await;
    publish(&ch, "tasks.quorum", 0..300).await;
    let warren_amqp = warren
        .url()
        .rsplit_once('/')
        .map_or(warren.url(), |(base, _)| base)
        .to_owned();
    let http = warren.http_url().expect("management API").to_owned();
    let from_api = http.replacen("http://", "http://guest:guest@", 1);
    let mut cmd = Command::new(warren_binary());
    cmd.arg("migrate")
        .args(["--from-api", &from_api, "--from-amqp", &warren_amqp])
        .arg("--url")
        .arg(format!("amqp://guest:guest@127.0.0.1:{}", rabbit.amqp_port))
        .arg("--api")
        .arg(rabbit.http_url())
        .args(["--quiet", "1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let child = cmd.spawn().expect("spawn migrate");
    let out = tokio::task::spawn_blocking(move || finish(child, Duration::from_secs(120)))
        .await
        .expect("join");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "migrate failed: {stdout}");
    for said in [
        "policy 'tasks', its keys: visibility-timeout",
        "queue 'tasks.email', its arguments: x-delivery-limit",
    ] {
        assert!(stdout.contains(said), "{said} in: {stdout}");
    }
    let (_, policy) = rabbit.api("GET", "/policies/%2F/tasks", None);
    assert_eq!(
        policy["definition"],
        json!({"max-length": 1000}),
        "{policy}"
    );
    let (_, q) = rabbit.api("GET", "/queues/%2F/tasks.quorum", None);
    assert_eq!(q["arguments"]["x-delivery-limit"], 3, "{q}");
    for q in ["tasks.email", "tasks.quorum"] {
        let conn = connect_url(&format!(
            "amqp://guest:guest@127.0.0.1:{}/%2F",
            rabbit.amqp_port
        ))
        .await;
        let ch = conn.create_channel().await.expect("channel");
        let mut consumer = consume_no_ack(&ch, q).await;
        let mut seen = BTreeSet::new();
        within_for(Duration::from_secs(60), "reading RabbitMQ's queue", async {
            while seen.len() < 300 {
                let d = consumer.next().await.expect("delivery").expect("delivery");
                seen.insert(String::from_utf8_lossy(&d.data).into_owned());
            }
        })
        .await;
    }
}
