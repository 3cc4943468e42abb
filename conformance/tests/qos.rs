//! basic.qos: prefetch-count per consumer (global=false) and per channel (global=true), and the guarantee
//! that a consumer never holds more unacked deliveries than its prefetch allows.

use futures_lite::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::BasicProperties;
use warren_conformance::raw::protocol::{basic, AMQPClass};
use warren_conformance::raw::{m, Raw};
use warren_conformance::{unique, within, TestBroker, QUIET};

async fn qos(raw: &mut Raw, ch: u16, count: u16, global: bool) {
    match raw.call(ch, m::basic_qos(count, global)).await {
        AMQPClass::Basic(basic::AMQPMethod::QosOk(_)) => {}
        other => panic!("{other:?}"),
    }
}

async fn fill(raw: &mut Raw, q: &str, n: usize) {
    raw.declare_queue(1, q).await;
    for i in 0..n {
        raw.publish(
            1,
            "",
            q,
            false,
            Default::default(),
            format!("{i}").as_bytes(),
        )
        .await;
    }
    raw.wait_ready(1, q, n as u32).await;
}

#[tokio::test]
async fn prefetch_count_limits_unacked_deliveries() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    raw.channel_open(2).await;
    let q = unique("qos-limit");
    fill(&mut raw, &q, 5).await;
    qos(&mut raw, 2, 2, false).await;
    raw.call(2, m::basic_consume(&q, "c", false, false)).await;
    let a = raw.recv_delivery().await;
    let b = raw.recv_delivery().await;
    raw.expect_silence(QUIET).await;
    // One ack frees exactly one slot.
    raw.send(2, m::basic_ack(a.delivery_tag(), false)).await;
    let c = raw.recv_delivery().await;
    assert_eq!(c.body, b"2");
    raw.expect_silence(QUIET).await;
    // A multiple ack frees both.
    raw.send(2, m::basic_ack(c.delivery_tag(), true)).await;
    let _ = b;
    raw.recv_delivery().await;
    raw.recv_delivery().await;
    raw.expect_silence(QUIET).await;
}

#[tokio::test]
async fn per_consumer_prefetch_applies_to_each_consumer_separately() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    raw.channel_open(2).await;
    let q1 = unique("qos-pc1");
    let q2 = unique("qos-pc2");
    fill(&mut raw, &q1, 5).await;
    fill(&mut raw, &q2, 5).await;
    qos(&mut raw, 2, 2, false).await;
    raw.call(2, m::basic_consume(&q1, "c1", false, false)).await;
    raw.call(2, m::basic_consume(&q2, "c2", false, false)).await;
    let mut tags = Vec::new();
    for _ in 0..4 {
        tags.push(raw.recv_delivery().await.consumer_tag());
    }
    raw.expect_silence(QUIET).await;
    tags.sort();
    assert_eq!(tags, ["c1", "c1", "c2", "c2"]);
}

#[tokio::test]
async fn global_prefetch_is_shared_by_all_consumers_on_the_channel() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    raw.channel_open(2).await;
    let q1 = unique("qos-g1");
    let q2 = unique("qos-g2");
    fill(&mut raw, &q1, 5).await;
    fill(&mut raw, &q2, 5).await;
    qos(&mut raw, 2, 3, true).await;
    raw.call(2, m::basic_consume(&q1, "c1", false, false)).await;
    raw.call(2, m::basic_consume(&q2, "c2", false, false)).await;
    let mut got = Vec::new();
    for _ in 0..3 {
        got.push(raw.recv_delivery().await);
    }
    raw.expect_silence(QUIET).await;
    raw.send(2, m::basic_ack(got[0].delivery_tag(), false))
        .await;
    raw.recv_delivery().await;
    raw.expect_silence(QUIET).await;
}

/// Collects deliveries on `ch` until the broker is quiet; returns their consumer tags.
async fn deliveries_until_quiet(raw: &mut Raw, ch: u16) -> Vec<String> {
    let mut tags = Vec::new();
    loop {
        match raw.recv_method_timeout(QUIET).await {
            Ok((c, m)) if c == ch => tags.push(raw.recv_content(ch, m).await.consumer_tag()),
            Ok(other) => panic!("unexpected {other:?}"),
            Err(_) => return tags,
        }
    }
}

async fn two_consumers(raw: &mut Raw, prefix: &str) {
    let q1 = unique(&format!("{prefix}1"));
    let q2 = unique(&format!("{prefix}2"));
    fill(raw, &q1, 5).await;
    fill(raw, &q2, 5).await;
    raw.call(2, m::basic_consume(&q1, "c1", false, false)).await;
    raw.call(2, m::basic_consume(&q2, "c2", false, false)).await;
}

#[tokio::test]
async fn per_consumer_then_global_prefetch_combine() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    raw.channel_open(2).await;
    // Each consumer at most 2, the channel at most 3.
    qos(&mut raw, 2, 2, false).await;
    qos(&mut raw, 2, 3, true).await;
    two_consumers(&mut raw, "qos-both").await;
    let mut tags = deliveries_until_quiet(&mut raw, 2).await;
    tags.sort();
    assert!(
        tags == ["c1", "c1", "c2"] || tags == ["c1", "c2", "c2"],
        "expected 3 deliveries, at most 2 per consumer: {tags:?}"
    );
}

/// RabbitMQ 3.10: basic.qos global=false also removes a channel-wide limit set before it.
#[tokio::test]
async fn per_consumer_qos_after_global_removes_the_channel_limit() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    raw.channel_open(2).await;
    qos(&mut raw, 2, 3, true).await;
    qos(&mut raw, 2, 2, false).await;
    two_consumers(&mut raw, "qos-unlimit").await;
    let mut tags = deliveries_until_quiet(&mut raw, 2).await;
    tags.sort();
    assert_eq!(tags, ["c1", "c1", "c2", "c2"]);
}

#[tokio::test]
async fn prefetch_zero_means_unlimited() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    raw.channel_open(2).await;
    let q = unique("qos-zero");
    fill(&mut raw, &q, 20).await;
    qos(&mut raw, 2, 0, false).await;
    raw.call(2, m::basic_consume(&q, "c", false, false)).await;
    for _ in 0..20 {
        raw.recv_delivery().await;
    }
}

#[tokio::test]
async fn prefetch_is_fixed_when_the_consumer_starts() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    raw.channel_open(2).await;
    let q1 = unique("qos-fixed1");
    let q2 = unique("qos-fixed2");
    fill(&mut raw, &q1, 5).await;
    fill(&mut raw, &q2, 5).await;
    qos(&mut raw, 2, 1, false).await;
    raw.call(2, m::basic_consume(&q1, "one", false, false))
        .await;
    raw.recv_delivery().await;
    qos(&mut raw, 2, 3, false).await;
    raw.call(2, m::basic_consume(&q2, "three", false, false))
        .await;
    let mut tags = Vec::new();
    for _ in 0..3 {
        tags.push(raw.recv_delivery().await.consumer_tag());
    }
    raw.expect_silence(QUIET).await;
    assert_eq!(
        tags,
        ["three", "three", "three"],
        "the first consumer keeps prefetch 1"
    );
}

#[tokio::test]
async fn no_ack_consumer_is_not_limited_by_prefetch() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    raw.channel_open(2).await;
    let q = unique("qos-noack");
    fill(&mut raw, &q, 10).await;
    qos(&mut raw, 2, 1, false).await;
    raw.call(2, m::basic_consume(&q, "c", true, false)).await;
    for _ in 0..10 {
        raw.recv_delivery().await;
    }
}

#[tokio::test]
async fn basic_get_is_not_limited_by_prefetch() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    raw.channel_open(2).await;
    let q = unique("qos-get");
    fill(&mut raw, &q, 3).await;
    qos(&mut raw, 2, 1, false).await;
    for _ in 0..3 {
        assert!(raw.get(2, &q, false).await.is_some());
    }
}

#[tokio::test]
async fn requeued_delivery_respects_prefetch() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    raw.channel_open(2).await;
    let q = unique("qos-requeue");
    fill(&mut raw, &q, 3).await;
    qos(&mut raw, 2, 1, false).await;
    raw.call(2, m::basic_consume(&q, "c", false, false)).await;
    let d = raw.recv_delivery().await;
    assert_eq!(d.body, b"0");
    raw.expect_silence(QUIET).await;
    raw.send(2, m::basic_nack(d.delivery_tag(), false, true))
        .await;
    let again = raw.recv_delivery().await;
    assert_eq!(
        (again.body.as_slice(), again.redelivered()),
        (&b"0"[..], true)
    );
    raw.expect_silence(QUIET).await;
}

/// Two lapin consumers with prefetch 3 process 200 messages; neither ever holds more than 3 unacked.
#[tokio::test]
async fn consumers_never_exceed_prefetch_under_load() {
    let broker = TestBroker::start();
    let conn = broker.connect().await;
    let q = unique("qos-load");
    let pubch = conn.create_channel().await.unwrap();
    pubch
        .queue_declare(
            q.as_str().into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let total = 200usize;
    let mut tasks = Vec::new();
    let counter = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    for _ in 0..2 {
        let ch = conn.create_channel().await.unwrap();
        ch.basic_qos(3, BasicQosOptions::default()).await.unwrap();
        let mut consumer = ch
            .basic_consume(
                q.as_str().into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        let counter = counter.clone();
        tasks.push(tokio::spawn(async move {
            let mut held = Vec::new();
            let mut max_held = 0;
            loop {
                let next =
                    tokio::time::timeout(std::time::Duration::from_millis(50), consumer.next())
                        .await;
                match next {
                    Ok(Some(d)) => {
                        held.push(d.unwrap());
                        max_held = max_held.max(held.len());
                        counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    }
                    Ok(None) => break,
                    Err(_) => {
                        // Nothing more within 50 ms: ack what we hold, oldest first.
                        if held.is_empty()
                            && counter.load(std::sync::atomic::Ordering::SeqCst) >= total
                        {
                            break;
                        }
                        for d in held.drain(..) {
                            d.ack(BasicAckOptions::default()).await.unwrap();
                        }
                    }
                }
                if held.len() >= 3 {
                    for d in held.drain(..) {
                        d.ack(BasicAckOptions::default()).await.unwrap();
                    }
                }
            }
            (max_held, ch)
        }));
    }
    pubch
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    for i in 0..total {
        pubch
            .basic_publish(
                "".into(),
                q.as_str().into(),
                BasicPublishOptions::default(),
                format!("{i}").as_bytes(),
                BasicProperties::default(),
            )
            .await
            .unwrap();
    }
    pubch.wait_for_confirms().await.unwrap();
    for t in tasks {
        let (max_held, _ch) = within("consumers to finish", t).await.unwrap();
        assert!(
            max_held <= 3,
            "a consumer held {max_held} unacked deliveries with prefetch 3"
        );
    }
    assert_eq!(counter.load(std::sync::atomic::Ordering::SeqCst), total);
}

/// The raw view of the same guarantee: count unacked per consumer tag while acking in bursts.
#[tokio::test]
async fn raw_consumer_never_exceeds_prefetch() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    raw.channel_open(2).await;
    let q = unique("qos-raw-load");
    fill(&mut raw, &q, 100).await;
    qos(&mut raw, 2, 4, false).await;
    raw.call(2, m::basic_consume(&q, "c", false, false)).await;
    let mut unacked: Vec<u64> = Vec::new();
    let mut received = 0;
    let mut round = 0;
    while received < 100 {
        let d = raw.recv_delivery().await;
        unacked.push(d.delivery_tag());
        received += 1;
        assert!(
            unacked.len() <= 4,
            "{} unacked with prefetch 4",
            unacked.len()
        );
        if unacked.len() == 4 {
            // Full: the broker must hold back (checked briefly, then once for longer at the start).
            let wait = if round == 0 {
                QUIET
            } else {
                std::time::Duration::from_millis(20)
            };
            if let Ok(m) = raw.recv_method_timeout(wait).await {
                panic!("a 5th unacked delivery with prefetch 4: {m:?}");
            }
            // Settle in varying ways: one single ack, a multiple ack of two, a multiple ack of all.
            match round % 3 {
                0 => {
                    raw.send(2, m::basic_ack(unacked.remove(0), false)).await;
                }
                1 => {
                    raw.send(2, m::basic_ack(unacked[1], true)).await;
                    unacked.drain(..2);
                }
                _ => {
                    raw.send(2, m::basic_ack(*unacked.last().unwrap(), true))
                        .await;
                    unacked.clear();
                }
            }
            round += 1;
        }
    }
    raw.expect_silence(QUIET).await;
}
