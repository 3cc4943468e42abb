//! Acknowledgements: ack / nack / reject (multiple, requeue), basic.recover, delivery tags, and requeueing of
//! unacked deliveries when a channel or connection closes (original position, redelivered flag).

use futures_lite::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions,
    BasicRejectOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::BasicProperties;
use warren_conformance::raw::{m, Raw};
use warren_conformance::{unique, within, TestBroker, QUIET};

/// Declares `q` on channel 1 and publishes `bodies` to it, waiting until they are all ready.
async fn fill(raw: &mut Raw, q: &str, bodies: &[&str]) {
    raw.declare_queue(1, q).await;
    for b in bodies {
        raw.publish(1, "", q, false, Default::default(), b.as_bytes())
            .await;
    }
    raw.wait_ready(1, q, bodies.len() as u32).await;
}

/// Drains the queue with basic.get no-ack: (body, redelivered) in order.
async fn drain(raw: &mut Raw, ch: u16, q: &str) -> Vec<(String, bool)> {
    let mut out = Vec::new();
    while let Some(d) = raw.get(ch, q, true).await {
        out.push((String::from_utf8(d.body.clone()).unwrap(), d.redelivered()));
    }
    out
}

fn owned(v: &[(&str, bool)]) -> Vec<(String, bool)> {
    v.iter().map(|(s, r)| (s.to_string(), *r)).collect()
}

#[tokio::test]
async fn ack_removes_message() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    raw.channel_open(2).await;
    let q = unique("ack-one");
    fill(&mut raw, &q, &["a", "b"]).await;
    let d = raw.get(2, &q, false).await.unwrap();
    assert_eq!(d.delivery_tag(), 1);
    raw.send(2, m::basic_ack(1, false)).await;
    raw.call(2, m::channel_close()).await;
    assert_eq!(drain(&mut raw, 1, &q).await, owned(&[("b", false)]));
}

#[tokio::test]
async fn ack_multiple_acks_up_to_and_including_tag() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    raw.channel_open(2).await;
    let q = unique("ack-multi");
    fill(&mut raw, &q, &["a", "b", "c", "d"]).await;
    for tag in 1..=4 {
        assert_eq!(raw.get(2, &q, false).await.unwrap().delivery_tag(), tag);
    }
    raw.send(2, m::basic_ack(3, true)).await;
    raw.call(2, m::channel_close()).await;
    assert_eq!(drain(&mut raw, 1, &q).await, owned(&[("d", true)]));
}

#[tokio::test]
async fn ack_multiple_with_tag_zero_acks_everything() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    raw.channel_open(2).await;
    let q = unique("ack-zero");
    fill(&mut raw, &q, &["a", "b", "c"]).await;
    for _ in 0..3 {
        raw.get(2, &q, false).await.unwrap();
    }
    raw.send(2, m::basic_ack(0, true)).await;
    raw.call(2, m::channel_close()).await;
    assert!(drain(&mut raw, 1, &q).await.is_empty());
}

#[tokio::test]
async fn nack_requeue_puts_message_back_at_its_position_redelivered() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    raw.channel_open(2).await;
    let q = unique("nack-requeue");
    fill(&mut raw, &q, &["a", "b", "c"]).await;
    let d = raw.get(2, &q, false).await.unwrap();
    assert_eq!(d.body, b"a");
    raw.send(2, m::basic_nack(d.delivery_tag(), false, true))
        .await;
    let again = raw.get(2, &q, false).await.unwrap();
    assert_eq!(
        (again.body.as_slice(), again.redelivered()),
        (&b"a"[..], true)
    );
    assert_eq!(
        again.delivery_tag(),
        2,
        "a redelivery gets a new delivery tag"
    );
    raw.send(2, m::basic_ack(2, false)).await;
    assert_eq!(
        drain(&mut raw, 2, &q).await,
        owned(&[("b", false), ("c", false)])
    );
}

#[tokio::test]
async fn nack_multiple_without_requeue_discards() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    raw.channel_open(2).await;
    let q = unique("nack-discard");
    fill(&mut raw, &q, &["a", "b", "c"]).await;
    raw.get(2, &q, false).await.unwrap();
    raw.get(2, &q, false).await.unwrap();
    raw.send(2, m::basic_nack(2, true, false)).await;
    raw.call(2, m::channel_close()).await;
    assert_eq!(drain(&mut raw, 1, &q).await, owned(&[("c", false)]));
}

#[tokio::test]
async fn nack_multiple_requeue_keeps_original_order() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    raw.channel_open(2).await;
    let q = unique("nack-order");
    fill(&mut raw, &q, &["a", "b", "c", "d"]).await;
    for _ in 0..3 {
        raw.get(2, &q, false).await.unwrap();
    }
    raw.send(2, m::basic_nack(3, true, true)).await;
    assert_eq!(
        drain(&mut raw, 2, &q).await,
        owned(&[("a", true), ("b", true), ("c", true), ("d", false)])
    );
}

#[tokio::test]
async fn reject_requeue_and_reject_discard() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    raw.channel_open(2).await;
    let q = unique("reject");
    fill(&mut raw, &q, &["a", "b"]).await;
    let a = raw.get(2, &q, false).await.unwrap();
    raw.send(2, m::basic_reject(a.delivery_tag(), false)).await; // discard a
    let b = raw.get(2, &q, false).await.unwrap();
    assert_eq!(b.body, b"b");
    raw.send(2, m::basic_reject(b.delivery_tag(), true)).await; // requeue b
    assert_eq!(drain(&mut raw, 2, &q).await, owned(&[("b", true)]));
}

#[tokio::test]
async fn lapin_ack_nack_reject() {
    let broker = TestBroker::start();
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("ack-lapin");
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
    for b in ["ack", "nack", "reject"] {
        ch.basic_publish(
            "".into(),
            q.as_str().into(),
            BasicPublishOptions::default(),
            b.as_bytes(),
            BasicProperties::default(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    }
    let mut consumer = ch
        .basic_consume(
            q.as_str().into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut seen = Vec::new();
    while seen.len() < 5 {
        let d = within("a delivery", consumer.next())
            .await
            .unwrap()
            .unwrap();
        let body = String::from_utf8(d.data.clone()).unwrap();
        seen.push((body.clone(), d.redelivered));
        let res = match (body.as_str(), d.redelivered) {
            ("ack", _) => d.ack(BasicAckOptions::default()).await,
            ("nack", false) => {
                d.nack(BasicNackOptions {
                    requeue: true,
                    ..Default::default()
                })
                .await
            }
            ("reject", false) => d.reject(BasicRejectOptions { requeue: true }).await,
            (_, true) => d.ack(BasicAckOptions::default()).await,
            _ => unreachable!(),
        };
        res.unwrap();
    }
    seen.sort();
    assert_eq!(
        seen,
        vec![
            ("ack".to_string(), false),
            ("nack".to_string(), false),
            ("nack".to_string(), true),
            ("reject".to_string(), false),
            ("reject".to_string(), true)
        ]
    );
}

#[tokio::test]
async fn recover_requeue_redelivers_unacked() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    raw.channel_open(2).await;
    let q = unique("recover");
    fill(&mut raw, &q, &["a", "b"]).await;
    raw.call(2, m::basic_consume(&q, "c", false, false)).await;
    let first = [raw.recv_delivery().await, raw.recv_delivery().await];
    assert_eq!((first[0].delivery_tag(), first[1].delivery_tag()), (1, 2));
    raw.call(2, m::basic_recover(true)).await;
    let mut again = [raw.recv_delivery().await, raw.recv_delivery().await];
    again.sort_by_key(|d| d.body.clone());
    assert_eq!(again[0].body, b"a");
    assert_eq!(again[1].body, b"b");
    assert!(again.iter().all(|d| d.redelivered()));
    let mut tags: Vec<u64> = again.iter().map(|d| d.delivery_tag()).collect();
    tags.sort();
    assert_eq!(tags, vec![3, 4], "redeliveries get new delivery tags");
    // The old tags are gone.
    raw.send(2, m::basic_ack(1, false)).await;
    raw.expect_channel_close(
        2,
        406,
        "PRECONDITION_FAILED - unknown delivery tag 1",
        60,
        80,
    )
    .await;
}

#[tokio::test]
async fn delivery_tags_are_per_channel() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    raw.channel_open(2).await;
    raw.channel_open(3).await;
    let q = unique("tags");
    fill(&mut raw, &q, &["a", "b", "c", "d"]).await;
    assert_eq!(raw.get(2, &q, false).await.unwrap().delivery_tag(), 1);
    assert_eq!(raw.get(3, &q, false).await.unwrap().delivery_tag(), 1);
    assert_eq!(raw.get(2, &q, false).await.unwrap().delivery_tag(), 2);
    assert_eq!(raw.get(3, &q, false).await.unwrap().delivery_tag(), 2);
    // Acking on the wrong channel is an unknown tag there.
    raw.send(3, m::basic_ack(2, false)).await;
    raw.send(3, m::basic_ack(3, false)).await;
    raw.expect_channel_close(
        3,
        406,
        "PRECONDITION_FAILED - unknown delivery tag 3",
        60,
        80,
    )
    .await;
}

#[tokio::test]
async fn unacked_messages_requeue_at_original_position_on_channel_close() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    raw.channel_open(2).await;
    let q = unique("requeue-ch");
    fill(&mut raw, &q, &["m1", "m2", "m3", "m4", "m5"]).await;
    raw.send(2, m::basic_qos(3, false)).await;
    raw.recv_method().await;
    raw.call(2, m::basic_consume(&q, "c", false, false)).await;
    let ds: Vec<_> = vec![
        raw.recv_delivery().await,
        raw.recv_delivery().await,
        raw.recv_delivery().await,
    ];
    assert_eq!(
        ds.iter().map(|d| d.body.clone()).collect::<Vec<_>>(),
        vec![b"m1".to_vec(), b"m2".to_vec(), b"m3".to_vec()]
    );
    // Ack m2 only; m1 and m3 stay unacked, and the freed credit brings m4.
    raw.send(2, m::basic_ack(ds[1].delivery_tag(), false)).await;
    assert_eq!(raw.recv_delivery().await.body, b"m4");
    raw.call(2, m::channel_close()).await;
    assert_eq!(
        drain(&mut raw, 1, &q).await,
        owned(&[("m1", true), ("m3", true), ("m4", true), ("m5", false)])
    );
}

#[tokio::test]
async fn unacked_messages_requeue_at_original_position_on_connection_close() {
    let broker = TestBroker::start();
    let mut admin = broker.raw().await;
    admin.channel_open(1).await;
    let q = unique("requeue-conn");
    fill(&mut admin, &q, &["m1", "m2", "m3", "m4"]).await;

    let mut worker = broker.raw().await;
    worker.channel_open(1).await;
    worker.channel_open(2).await;
    // Unacked on two channels: m1 by get on channel 1, m2 and m3 by a consumer on channel 2.
    assert_eq!(worker.get(1, &q, false).await.unwrap().body, b"m1");
    worker.send(2, m::basic_qos(2, false)).await;
    worker.recv_method().await;
    worker
        .call(2, m::basic_consume(&q, "w", false, false))
        .await;
    worker.recv_delivery().await;
    worker.recv_delivery().await;
    worker.close().await;

    admin.wait_ready(1, &q, 4).await;
    assert_eq!(
        drain(&mut admin, 1, &q).await,
        owned(&[("m1", true), ("m2", true), ("m3", true), ("m4", false)])
    );
}

#[tokio::test]
async fn unacked_messages_requeue_when_socket_drops() {
    let broker = TestBroker::start();
    let mut admin = broker.raw().await;
    admin.channel_open(1).await;
    let q = unique("requeue-drop");
    fill(&mut admin, &q, &["m1", "m2"]).await;
    {
        let mut worker = broker.raw().await;
        worker.channel_open(1).await;
        worker.get(1, &q, false).await.unwrap();
        // dropped without connection.close
    }
    admin.wait_ready(1, &q, 2).await;
    assert_eq!(
        drain(&mut admin, 1, &q).await,
        owned(&[("m1", true), ("m2", false)])
    );
}

#[tokio::test]
async fn lapin_channel_close_requeues_for_next_consumer() {
    let broker = TestBroker::start();
    let conn = broker.connect().await;
    let q = unique("requeue-lapin");
    let ch1 = conn.create_channel().await.unwrap();
    ch1.queue_declare(
        q.as_str().into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch1.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    ch1.basic_publish(
        "".into(),
        q.as_str().into(),
        BasicPublishOptions::default(),
        b"once",
        BasicProperties::default(),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    let mut c1 = ch1
        .basic_consume(
            q.as_str().into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let d = within("first delivery", c1.next()).await.unwrap().unwrap();
    assert!(!d.redelivered);
    ch1.close(200, "bye".into()).await.unwrap();

    let ch2 = conn.create_channel().await.unwrap();
    let mut c2 = ch2
        .basic_consume(
            q.as_str().into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let d = within("redelivery", c2.next()).await.unwrap().unwrap();
    assert_eq!(d.data, b"once");
    assert!(d.redelivered);
    d.ack(BasicAckOptions::default()).await.unwrap();
    tokio::time::sleep(QUIET).await;
}
