//! `warren redrive`: a dead-letter queue moved back to the queues its messages came from, or to
//! a named queue, with nothing lost or doubled, and errors that leave every message where it
//! was. The command speaks plain AMQP, so these tests also run against RabbitMQ
//! (`WARREN_TEST_URL`); the command itself is always Warren's binary.

use std::collections::BTreeSet;
use std::process::Command;
use std::time::{Duration, Instant};

use lapin::options::{
    BasicGetOptions, BasicPublishOptions, BasicRejectOptions, ConfirmSelectOptions,
};
use lapin::{BasicProperties, Channel};
use warren_conformance::queues::{
    args, dead_letter_queue, declare_durable, ready, text, wait_ready,
};
use warren_conformance::{unique, warren_binary, TestBroker};

async fn publish(ch: &Channel, q: &str, body: String) {
    ch.basic_publish(
        "".into(),
        q.into(),
        BasicPublishOptions::default(),
        body.as_bytes(),
        BasicProperties::default().with_delivery_mode(2),
    )
    .await
    .unwrap()
    .await
    .unwrap();
}

/// `n` messages published to `q` and rejected into its dead-letter queue.
async fn dead_letters(ch: &Channel, q: &str, prefix: &str, n: usize) -> BTreeSet<String> {
    let mut sent = BTreeSet::new();
    for i in 0..n {
        let body = format!("{prefix}-{i}");
        publish(ch, q, body.clone()).await;
        sent.insert(body);
    }
    for _ in 0..n {
        let m = ch
            .basic_get(q.into(), BasicGetOptions { no_ack: false })
            .await
            .unwrap()
            .expect("a message to reject");
        m.delivery
            .reject(BasicRejectOptions { requeue: false })
            .await
            .unwrap();
    }
    sent
}

async fn drain(ch: &Channel, q: &str) -> Vec<String> {
    let mut out = Vec::new();
    while let Some(m) = ch
        .basic_get(q.into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
    {
        out.push(String::from_utf8_lossy(&m.delivery.data).into_owned());
    }
    out
}

fn redrive(broker: &TestBroker, extra: &[&str]) -> (bool, String) {
    let out = Command::new(warren_binary())
        .arg("redrive")
        .args(["--url", broker.url()])
        .args(extra)
        .output()
        .expect("run warren redrive");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

async fn setup(broker: &TestBroker, prefix: &str) -> (Channel, String, String, String) {
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let (dlx, dlq) = dead_letter_queue(&ch, prefix, true).await;
    let (a, b) = (
        unique(&format!("{prefix}-a")),
        unique(&format!("{prefix}-b")),
    );
    for q in [&a, &b] {
        declare_durable(&ch, q, args(&[("x-dead-letter-exchange", text(&dlx))])).await;
    }
    // The connection must outlive the channel.
    std::mem::forget(conn);
    (ch, dlq, a, b)
}

/// Every dead letter goes back to the queue it came from, once.
#[tokio::test]
async fn a_dead_letter_queue_goes_back_to_its_sources() {
    let broker = TestBroker::start();
    let (ch, dlq, a, b) = setup(&broker, "redrive").await;
    let from_a = dead_letters(&ch, &a, "a", 150).await;
    let from_b = dead_letters(&ch, &b, "b", 30).await;
    // (RabbitMQ dead-letters asynchronously.)
    wait_ready(&ch, &dlq, 180).await;
    let (ok, out) = redrive(&broker, &["--from", &dlq]);
    assert!(ok, "{out}");
    assert!(out.contains("moved 180 message(s)"), "{out}");
    assert_eq!(ready(&ch, &dlq).await, 0);
    let back_a = drain(&ch, &a).await;
    let back_b = drain(&ch, &b).await;
    assert_eq!(back_a.len(), 150, "nothing doubled");
    assert_eq!(back_a.into_iter().collect::<BTreeSet<_>>(), from_a);
    assert_eq!(back_b.into_iter().collect::<BTreeSet<_>>(), from_b);
}

/// `--to`, `--limit` and `--rate`; a rerun carries on with the rest.
#[tokio::test]
async fn a_limited_move_at_a_rate_then_the_rest() {
    let broker = TestBroker::start();
    let (ch, dlq, a, b) = setup(&broker, "redrive-to").await;
    let sent = dead_letters(&ch, &a, "m", 20).await;
    wait_ready(&ch, &dlq, 20).await;
    let started = Instant::now();
    let (ok, out) = redrive(
        &broker,
        &["--from", &dlq, "--to", &b, "--limit", "8", "--rate", "100"],
    );
    assert!(ok, "{out}");
    assert!(
        started.elapsed() >= Duration::from_millis(70),
        "8 messages at 100/s took {:?}",
        started.elapsed()
    );
    assert_eq!(ready(&ch, &b).await, 8);
    assert_eq!(ready(&ch, &dlq).await, 12);
    let (ok, out) = redrive(&broker, &["--from", &dlq, "--to", &b]);
    assert!(ok, "{out}");
    let moved: BTreeSet<String> = drain(&ch, &b).await.into_iter().collect();
    assert_eq!(moved, sent);
    assert_eq!(ready(&ch, &a).await, 0);
}

/// Errors name the fix and leave every message in the source.
#[tokio::test]
async fn errors_leave_every_message_where_it_was() {
    let broker = TestBroker::start();
    let (ch, dlq, a, _) = setup(&broker, "redrive-err").await;
    dead_letters(&ch, &a, "e", 5).await;
    wait_ready(&ch, &dlq, 5).await;
    let (ok, out) = redrive(&broker, &["--from", &dlq, "--to", "no-such-queue-here"]);
    assert!(!ok);
    assert!(
        out.contains("queue 'no-such-queue-here' does not exist"),
        "{out}"
    );
    let (ok, out) = redrive(&broker, &["--from", "no-such-dlq"]);
    assert!(!ok);
    assert!(out.contains("queue 'no-such-dlq' does not exist"), "{out}");
    // A message that was never dead-lettered has no way back without --to.
    publish(&ch, &dlq, "stray".into()).await;
    let (ok, out) = redrive(&broker, &["--from", &dlq]);
    assert!(!ok);
    assert!(out.contains("pass --to QUEUE"), "{out}");
    assert_eq!(ready(&ch, &dlq).await, 1, "the stray one stays");
    assert_eq!(ready(&ch, &a).await, 5, "those before it were moved, once");
}

/// A redrive (or a move) into a queue with `x-message-deduplication` that saw the message's
/// key within its window: the message is put back, not dropped as a duplicate and acked away
/// at the source. (RabbitMQ ignores the argument, so there it is a plain redrive.)
#[tokio::test]
async fn a_redrive_into_a_dedup_queue_puts_the_message_back() {
    let broker = TestBroker::start();
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let (dlx, dlq) = dead_letter_queue(&ch, "redrive-dedup", true).await;
    let jobs = unique("redrive-dedup-jobs");
    declare_durable(
        &ch,
        &jobs,
        args(&[
            (
                "x-message-deduplication",
                lapin::types::AMQPValue::Boolean(true),
            ),
            ("x-dead-letter-exchange", text(&dlx)),
        ]),
    )
    .await;
    let id = unique("m");
    let props = BasicProperties::default()
        .with_delivery_mode(2)
        .with_message_id(id.as_str().into());
    let send = |q: String| {
        let (ch, props) = (ch.clone(), props.clone());
        async move {
            ch.basic_publish(
                "".into(),
                q.as_str().into(),
                BasicPublishOptions::default(),
                b"job",
                props,
            )
            .await
            .unwrap()
            .await
            .unwrap()
        }
    };
    send(jobs.clone()).await;
    let m = ch
        .basic_get(jobs.as_str().into(), BasicGetOptions { no_ack: false })
        .await
        .unwrap()
        .expect("the job");
    m.delivery
        .reject(BasicRejectOptions { requeue: false })
        .await
        .unwrap();
    wait_ready(&ch, &dlq, 1).await;
    let (ok, out) = redrive(&broker, &["--from", &dlq]);
    assert!(ok, "{out}");
    assert!(out.contains("moved 1 message(s)"), "{out}");
    assert_eq!(ready(&ch, &dlq).await, 0);
    assert_eq!(
        ready(&ch, &jobs).await,
        1,
        "the redriven message is in neither queue"
    );
    // A move of a copy that was never dead-lettered, into the queue that has seen its key.
    assert_eq!(drain(&ch, &jobs).await.len(), 1);
    let other = unique("redrive-dedup-other");
    declare_durable(&ch, &other, lapin::types::FieldTable::default()).await;
    send(other.clone()).await;
    let (ok, out) = redrive(&broker, &["--from", &other, "--to", &jobs]);
    assert!(ok, "{out}");
    assert_eq!(ready(&ch, &other).await, 0);
    assert_eq!(
        ready(&ch, &jobs).await,
        1,
        "the moved message is in neither queue"
    );
    drop(conn);
}
