//! Publisher confirms: confirm.select, basic.ack to the publisher (single and multiple), sequence numbers per
//! channel, and their interplay with mandatory returns.

use std::collections::BTreeSet;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Confirmation};
use warren_conformance::raw::protocol::{basic, confirm, AMQPClass};
use warren_conformance::raw::{m, Raw};
use warren_conformance::{unique, TestBroker, QUIET};

async fn select(raw: &mut Raw, ch: u16) {
    match raw.call(ch, m::confirm_select()).await {
        AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(_)) => {}
        other => panic!("{other:?}"),
    }
}

/// Reads publisher acks on `ch` until every tag in 1..=n is confirmed; returns the ack frames received.
async fn collect_acks(raw: &mut Raw, ch: u16, n: u64) -> Vec<basic::Ack> {
    collect_acks_from(raw, ch, 1, n).await
}

/// Reads publisher acks on `ch` until every tag in first..=n is confirmed (tags before `first` were confirmed
/// earlier).
async fn collect_acks_from(raw: &mut Raw, ch: u16, first: u64, n: u64) -> Vec<basic::Ack> {
    let mut confirmed = BTreeSet::new();
    let mut frames = Vec::new();
    let mut last = first - 1;
    while (confirmed.len() as u64) < n + 1 - first {
        match raw.recv_method().await {
            (c, AMQPClass::Basic(basic::AMQPMethod::Ack(ack))) if c == ch => {
                assert!(
                    ack.delivery_tag > last,
                    "confirm tags must increase: {} after {last}",
                    ack.delivery_tag
                );
                assert!(
                    ack.delivery_tag <= n,
                    "confirm for a tag never published: {ack:?}"
                );
                let from = if ack.multiple {
                    last + 1
                } else {
                    ack.delivery_tag
                };
                for t in from..=ack.delivery_tag {
                    confirmed.insert(t);
                }
                last = ack.delivery_tag;
                frames.push(ack);
            }
            other => panic!("expected basic.ack on channel {ch}, got {other:?}"),
        }
    }
    frames
}

#[tokio::test]
async fn confirm_select_then_each_publish_is_acked_with_sequence_tags() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    let q = unique("cf-seq");
    raw.declare_queue(1, &q).await;
    select(&mut raw, 1).await;
    for i in 1..=3u64 {
        raw.publish(1, "", &q, false, Default::default(), b"c")
            .await;
        match raw.recv_method().await {
            (1, AMQPClass::Basic(basic::AMQPMethod::Ack(ack))) => {
                assert_eq!(ack.delivery_tag, i);
                assert!(!ack.multiple, "a single outstanding publish is acked alone");
            }
            other => panic!("expected basic.ack, got {other:?}"),
        }
    }
}

#[tokio::test]
async fn confirm_select_is_idempotent() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    select(&mut raw, 1).await;
    select(&mut raw, 1).await;
    raw.publish(
        1,
        "",
        &unique("cf-nowhere"),
        false,
        Default::default(),
        b"x",
    )
    .await;
    let acks = collect_acks(&mut raw, 1, 1).await;
    assert_eq!(acks.len(), 1);
}

#[tokio::test]
async fn unroutable_publish_is_still_acked() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    select(&mut raw, 1).await;
    raw.publish(
        1,
        "",
        &unique("cf-nowhere"),
        false,
        Default::default(),
        b"x",
    )
    .await;
    collect_acks(&mut raw, 1, 1).await;
}

#[tokio::test]
async fn burst_of_publishes_is_fully_confirmed_in_order() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    let q = unique("cf-burst");
    raw.declare_queue(1, &q).await;
    select(&mut raw, 1).await;
    // All 500 in one write: the broker sees them together and can confirm them with multiple acks.
    let mut bytes = Vec::new();
    for i in 0..500 {
        bytes.extend(raw.encode_publish(
            1,
            "",
            &q,
            false,
            Default::default(),
            format!("{i}").as_bytes(),
        ));
    }
    raw.send_bytes(&bytes).await;
    let frames = collect_acks(&mut raw, 1, 500).await;
    assert!(
        frames.iter().any(|a| a.multiple),
        "a burst of 500 publishes should be confirmed with at least one multiple ack ({} single acks)",
        frames.len()
    );
    raw.wait_ready(1, &q, 500).await;
    raw.expect_silence(QUIET).await;
}

#[tokio::test]
async fn confirm_tags_are_per_channel() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    raw.channel_open(2).await;
    let q = unique("cf-per-channel");
    raw.declare_queue(1, &q).await;
    select(&mut raw, 1).await;
    select(&mut raw, 2).await;
    raw.publish(1, "", &q, false, Default::default(), b"a")
        .await;
    collect_acks(&mut raw, 1, 1).await;
    raw.publish(2, "", &q, false, Default::default(), b"b")
        .await;
    let acks = collect_acks(&mut raw, 2, 1).await;
    assert_eq!(acks[0].delivery_tag, 1, "each channel counts from 1");
    raw.publish(1, "", &q, false, Default::default(), b"c")
        .await;
    let acks = collect_acks_from(&mut raw, 1, 2, 2).await;
    assert_eq!(acks.last().unwrap().delivery_tag, 2);
}

#[tokio::test]
async fn mandatory_return_comes_before_its_ack() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    select(&mut raw, 1).await;
    raw.publish(1, "", &unique("cf-nowhere"), true, Default::default(), b"r")
        .await;
    let ret = raw.recv_delivery().await;
    match &ret.method {
        AMQPClass::Basic(basic::AMQPMethod::Return(r)) => assert_eq!(r.reply_code, 312),
        other => panic!("expected basic.return first, got {other:?}"),
    }
    let acks = collect_acks(&mut raw, 1, 1).await;
    assert_eq!(acks[0].delivery_tag, 1);
}

#[tokio::test]
async fn lapin_publisher_confirms() {
    let broker = TestBroker::start();
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("cf-lapin");
    ch.queue_declare(
        q.as_str().into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let mut pending = Vec::new();
    for i in 0..100 {
        pending.push(
            ch.basic_publish(
                "".into(),
                q.as_str().into(),
                BasicPublishOptions::default(),
                format!("{i}").as_bytes(),
                BasicProperties::default(),
            )
            .await
            .unwrap(),
        );
    }
    for p in pending {
        assert_eq!(p.await.unwrap(), Confirmation::Ack(None));
    }
    let returned = ch.wait_for_confirms().await.unwrap();
    assert!(returned.is_empty());
}

#[tokio::test]
async fn nowait_confirm_select_sends_no_reply() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    raw.send(
        1,
        AMQPClass::Confirm(confirm::AMQPMethod::Select(confirm::Select {
            nowait: true,
        })),
    )
    .await;
    raw.publish(1, "", &unique("cf-nowait"), false, Default::default(), b"x")
        .await;
    match raw.recv_method().await {
        (1, AMQPClass::Basic(basic::AMQPMethod::Ack(ack))) => assert_eq!(ack.delivery_tag, 1),
        other => panic!("expected basic.ack only, got {other:?}"),
    }
}
