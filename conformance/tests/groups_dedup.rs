//! Ordering per message group (`x-group-header`) and deduplication (LavinMQ's
//! `x-message-deduplication`), from an unmodified client (docs/task-queues.md). RabbitMQ has
//! neither, so the tests return early against an external broker.

use std::time::Duration;

use futures_lite::StreamExt;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions, BasicQosOptions,
    ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Confirmation, Consumer, ExchangeKind};
use warren_conformance::http::request;
use warren_conformance::queues::{args, confirm_channel, declare_durable, ready, text};
use warren_conformance::{assert_amqp_error, unique, within, TestBroker, QUIET};

async fn publish(ch: &Channel, exchange: &str, key: &str, body: &str, props: BasicProperties) {
    let confirm = ch
        .basic_publish(
            exchange.into(),
            key.into(),
            BasicPublishOptions::default(),
            body.as_bytes(),
            props.with_delivery_mode(2),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    assert_eq!(confirm, Confirmation::Ack(None), "{body} confirmed");
}

fn with_header(key: &str, value: &str) -> BasicProperties {
    let mut h = FieldTable::default();
    h.insert(key.into(), text(value));
    BasicProperties::default().with_headers(h)
}

async fn next(c: &mut Consumer) -> Delivery {
    within("a delivery", c.next()).await.unwrap().unwrap()
}

async fn nothing_more(c: &mut Consumer) {
    if let Ok(Some(d)) = tokio::time::timeout(QUIET, c.next()).await {
        let d = d.unwrap();
        panic!("unexpected delivery {:?}", String::from_utf8_lossy(&d.data));
    }
}

fn body(d: &Delivery) -> String {
    String::from_utf8_lossy(&d.data).into_owned()
}

/// One message of a group out at a time, in publish order; other groups go past; a nacked
/// message comes back before its group's next.
#[tokio::test]
async fn a_group_has_one_message_out_at_a_time_in_publish_order() {
    let broker = TestBroker::start();
    if broker.is_external() {
        return;
    }
    let conn = broker.connect().await;
    let ch = confirm_channel(&conn).await;
    let q = unique("groups");
    declare_durable(&ch, &q, args(&[("x-group-header", text("x-group-key"))])).await;
    for (b, g) in [
        ("a1", "a"),
        ("a2", "a"),
        ("b1", "b"),
        ("b2", "b"),
        ("a3", "a"),
    ] {
        publish(&ch, "", &q, b, with_header("x-group-key", g)).await;
    }
    publish(&ch, "", &q, "loose", BasicProperties::default()).await;
    let wch = conn.create_channel().await.unwrap();
    wch.basic_qos(10, BasicQosOptions::default()).await.unwrap();
    let mut c = wch
        .basic_consume(
            q.as_str().into(),
            "w".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut first: Vec<Delivery> = Vec::new();
    for _ in 0..3 {
        first.push(next(&mut c).await);
    }
    let names: Vec<String> = first.iter().map(body).collect();
    assert_eq!(names, vec!["a1", "b1", "loose"], "the head of each group");
    nothing_more(&mut c).await;
    assert_eq!(ready(&ch, &q).await, 3, "the rest wait, counted as ready");
    // b1 fails and comes back first; a1 done lets a2 go.
    first[1]
        .nack(BasicNackOptions {
            requeue: true,
            ..Default::default()
        })
        .await
        .unwrap();
    let again = next(&mut c).await;
    assert_eq!(body(&again), "b1");
    assert!(again.redelivered);
    first[0].ack(BasicAckOptions::default()).await.unwrap();
    let a2 = next(&mut c).await;
    assert_eq!(body(&a2), "a2");
    nothing_more(&mut c).await;
    again.ack(BasicAckOptions::default()).await.unwrap();
    assert_eq!(body(&next(&mut c).await), "b2");
    a2.ack(BasicAckOptions::default()).await.unwrap();
    assert_eq!(body(&next(&mut c).await), "a3");
}

/// A message whose key was seen within the window is dropped and still confirmed; the key is
/// the named header, else the message-id; after the window the key is new again.
#[tokio::test]
async fn a_queue_drops_a_duplicate_within_its_window() {
    let broker = TestBroker::start();
    if broker.is_external() {
        return;
    }
    let conn = broker.connect().await;
    let ch = confirm_channel(&conn).await;
    let q = unique("dedup");
    declare_durable(
        &ch,
        &q,
        args(&[
            ("x-message-deduplication", AMQPValue::Boolean(true)),
            ("x-cache-ttl", AMQPValue::LongInt(300)),
            ("x-deduplication-header", text("order-id")),
        ]),
    )
    .await;
    publish(&ch, "", &q, "o1", with_header("order-id", "1")).await;
    publish(&ch, "", &q, "o1 again", with_header("order-id", "1")).await;
    publish(&ch, "", &q, "o2", with_header("order-id", "2")).await;
    let by_id = BasicProperties::default().with_message_id("m-1".into());
    publish(&ch, "", &q, "m1", by_id.clone()).await;
    publish(&ch, "", &q, "m1 again", by_id.clone()).await;
    publish(&ch, "", &q, "no key", BasicProperties::default()).await;
    publish(&ch, "", &q, "no key", BasicProperties::default()).await;
    assert_eq!(ready(&ch, &q).await, 5, "o1, o2, m1 and both keyless");
    tokio::time::sleep(Duration::from_millis(350)).await;
    publish(&ch, "", &q, "o1 later", with_header("order-id", "1")).await;
    assert_eq!(ready(&ch, &q).await, 6, "a new window");
    // The management API shows the window: its keys, their memory, the duplicates dropped.
    let url = format!(
        "{}/api/queues/%2f/{q}",
        broker.http_url().expect("management API on")
    );
    let got = request("GET", &url, Some(("guest", "guest")), &[], None);
    assert_eq!(got.status, 200, "{}", got.text());
    let d = &got.json()["deduplication"];
    assert_eq!(d["duplicates_dropped"], 2, "{d}");
    assert!(d["keys"].as_u64().is_some_and(|k| k >= 1), "{d}");
    assert!(d["memory_bytes"].as_u64().is_some_and(|m| m > 0), "{d}");
    // Malformed arguments are refused.
    let bad = unique("dedup-bad");
    let res = ch
        .queue_declare(
            bad.as_str().into(),
            QueueDeclareOptions::default(),
            args(&[("x-message-deduplication", text("yes"))]),
        )
        .await;
    assert_amqp_error(
        res,
        406,
        &format!(
            "PRECONDITION_FAILED - invalid arg 'x-message-deduplication' for queue '{bad}' in vhost '/': \"x-message-deduplication must be a boolean, not longstr\""
        ),
    );
    let ch = confirm_channel(&conn).await;
    let res = ch
        .queue_declare(
            bad.as_str().into(),
            QueueDeclareOptions::default(),
            args(&[
                ("x-message-deduplication", AMQPValue::Boolean(true)),
                ("x-cache-size", AMQPValue::LongLongInt(2_000_000)),
            ]),
        )
        .await;
    assert_amqp_error(
        res,
        406,
        &format!(
            "PRECONDITION_FAILED - invalid arg 'x-cache-size' for queue '{bad}' in vhost '/': {{value_too_large,2000000}}"
        ),
    );
}

/// On an exchange, a duplicate reaches no queue at all.
#[tokio::test]
async fn an_exchange_drops_a_duplicate_before_routing() {
    let broker = TestBroker::start();
    if broker.is_external() {
        return;
    }
    let conn = broker.connect().await;
    let ch = confirm_channel(&conn).await;
    let x = unique("dedup-x");
    ch.exchange_declare(
        x.as_str().into(),
        ExchangeKind::Fanout,
        ExchangeDeclareOptions::default(),
        args(&[("x-message-deduplication", AMQPValue::Boolean(true))]),
    )
    .await
    .unwrap();
    let (q1, q2) = (unique("dedup-x1"), unique("dedup-x2"));
    for q in [&q1, &q2] {
        declare_durable(&ch, q, FieldTable::default()).await;
        ch.queue_bind(
            q.as_str().into(),
            x.as_str().into(),
            "".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    }
    for _ in 0..3 {
        publish(
            &ch,
            &x,
            "",
            "once",
            with_header("x-deduplication-header", "k"),
        )
        .await;
    }
    assert_eq!(ready(&ch, &q1).await, 1);
    assert_eq!(ready(&ch, &q2).await, 1);
}

/// Groups hold across a `kill -9`: after the restart a group's messages still go out one at a
/// time, in publish order (recovery keeps a grouped queue's messages in memory, with their
/// groups, rather than as pages on disk).
#[tokio::test]
async fn groups_keep_their_order_after_a_restart() {
    let mut broker = TestBroker::start_with(&["--queue-window", "2"]);
    if broker.is_external() {
        return;
    }
    let q = unique("groups-restart");
    {
        let conn = broker.connect().await;
        let ch = confirm_channel(&conn).await;
        declare_durable(&ch, &q, args(&[("x-group-header", text("x-group-key"))])).await;
        for (b, g) in [
            ("a1", "a"),
            ("b1", "b"),
            ("a2", "a"),
            ("a3", "a"),
            ("b2", "b"),
        ] {
            publish(&ch, "", &q, b, with_header("x-group-key", g)).await;
        }
    }
    broker.restart(true);
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.basic_qos(10, BasicQosOptions::default()).await.unwrap();
    let mut c = ch
        .basic_consume(
            q.as_str().into(),
            "w".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let (x, y) = (next(&mut c).await, next(&mut c).await);
    assert_eq!((body(&x), body(&y)), ("a1".into(), "b1".into()));
    nothing_more(&mut c).await;
    x.ack(BasicAckOptions::default()).await.unwrap();
    let a2 = next(&mut c).await;
    assert_eq!(body(&a2), "a2");
    a2.ack(BasicAckOptions::default()).await.unwrap();
    assert_eq!(body(&next(&mut c).await), "a3");
}
