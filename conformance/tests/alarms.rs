//! Resource alarms (RabbitMQ's memory high watermark and disk free limit): while one is on, a connection that
//! publishes is told `connection.blocked` with RabbitMQ's reason text and is not read any more, and connections
//! that only consume keep draining queues.

use std::time::Duration;

use warren_conformance::{unique, TestBroker, QUIET};

async fn blocked_reason(args: &[&str]) -> (String, u32, u32) {
    let broker = TestBroker::start_with(args);
    let q = unique("alarm");
    // A consumer-only connection, opened first: it must keep working.
    let mut consumer = broker.raw().await;
    consumer.channel_open(1).await;
    consumer.declare_queue(1, &q).await;

    let mut publisher = broker.raw().await;
    publisher.channel_open(1).await;
    publisher
        .publish(1, "", &q, false, Default::default(), b"first")
        .await;
    let reason = publisher.recv_blocked().await;
    // The first publish was handled; what follows is not read while the alarm lasts.
    for _ in 0..3 {
        publisher
            .publish(1, "", &q, false, Default::default(), b"held back")
            .await;
    }
    tokio::time::sleep(QUIET).await;
    let ready = consumer.wait_ready(1, &q, 1).await.message_count;
    // The consumer's connection still works: it takes the message.
    let got = consumer.get(1, &q, true).await.map_or(0, |_| 1);
    (reason, ready, got)
}

#[tokio::test]
async fn a_memory_alarm_blocks_publishers_and_lets_consumers_drain() {
    if TestBroker::start().is_external() {
        return; // the limits are Warren's flags
    }
    let (reason, ready, got) = blocked_reason(&["--memory-limit", "1"]).await;
    assert_eq!(reason, "low on memory");
    assert_eq!((ready, got), (1, 1));
}

#[tokio::test]
async fn a_disk_alarm_blocks_publishers_with_rabbitmqs_reason() {
    if TestBroker::start().is_external() {
        return;
    }
    // More free space than any disk has: the alarm is on from the start.
    let (reason, ready, got) = blocked_reason(&["--disk-free-limit", "1000000000000000000"]).await;
    assert_eq!(reason, "low on disk");
    assert_eq!((ready, got), (1, 1));
}

#[tokio::test]
async fn without_an_alarm_nobody_is_blocked() {
    let broker = TestBroker::start();
    let mut publisher = broker.raw().await;
    publisher.channel_open(1).await;
    let q = unique("no-alarm");
    publisher.declare_queue(1, &q).await;
    publisher
        .publish(1, "", &q, false, Default::default(), b"x")
        .await;
    match publisher
        .recv_method_timeout(Duration::from_millis(300))
        .await
    {
        Err(_) => {}
        Ok(other) => panic!("nothing expected, got {other:?}"),
    }
    assert_eq!(publisher.wait_ready(1, &q, 1).await.message_count, 1);
}

/// A client that writes and never reads (here: mandatory publishes that all come back as
/// basic.return) is not read either once its unsent output piles up: the broker's memory stays
/// bounded, and the connection is not lost.
#[tokio::test]
async fn a_client_that_never_reads_its_returns_is_not_read_either() {
    let broker = TestBroker::start();
    if broker.is_external() {
        eprintln!("SKIPPED: measures the spawned broker's memory");
        return;
    }
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    let nowhere = unique("nowhere");
    let body = vec![b'r'; 16 * 1024];
    let mut batch = Vec::new();
    for _ in 0..64 {
        let props = warren_conformance::raw::AMQPProperties::default();
        batch.extend(raw.encode_publish(1, "", &nowhere, true, props, &body));
    }
    let before = broker.rss_bytes().expect("rss");
    let mut written = 0usize;
    // Unbounded, the broker would take all 512 MB and hold the returns in memory.
    while written < 512 << 20 {
        match tokio::time::timeout(Duration::from_millis(500), raw.try_send_bytes(&batch)).await {
            Ok(Ok(())) => written += batch.len(),
            Ok(Err(e)) => panic!("the broker dropped the connection: {e}"),
            Err(_) => break,
        }
    }
    let grown = broker.rss_bytes().expect("rss").saturating_sub(before);
    assert!(
        written < 160 << 20,
        "the broker kept reading a client that does not read: {} MB taken",
        written >> 20
    );
    assert!(grown < 160 << 20, "the broker grew by {} MB", grown >> 20);
    // Still served: another connection works.
    let mut other = broker.raw().await;
    other.channel_open(1).await;
    other.declare_queue(1, &unique("after")).await;
}
