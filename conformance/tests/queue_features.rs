//! RabbitMQ's queue features as applications use them: message TTL (queue and per message),
//! dead-lettering with `x-death`, length limits and overflow, queue expiry, priorities, single
//! active consumer, consumer priorities, and the rules of quorum queues. Expected values were
//! measured on RabbitMQ 3.10.8 (`../shared/reference/rabbitmq-3.10.8-queue-features.md` in the
//! team's notes); every test here passes against it too (`WARREN_TEST_URL`), except where it
//! says Warren differs on purpose.
//!
//! Timers use short TTLs (tens of milliseconds) and wait by polling, never for seconds.

use std::time::Duration;

use futures_lite::StreamExt;
use lapin::message::BasicGetMessage;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicGetOptions, BasicNackOptions, BasicPublishOptions,
    BasicQosOptions, BasicRejectOptions, ExchangeDeclareOptions, QueueBindOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, ExchangeKind};
use warren_conformance::queues::{
    args, confirm_channel, dead_letter_queue, deaths, declare_durable, field, get_eventually,
    header, ready, text, wait_ready,
};
use warren_conformance::{amqp_error, unique, within, TestBroker, QUIET};

async fn declare(ch: &Channel, q: &str, arguments: FieldTable) {
    ch.queue_declare(q.into(), QueueDeclareOptions::default(), arguments)
        .await
        .unwrap();
}

async fn publish(ch: &Channel, exchange: &str, key: &str, body: &[u8], props: BasicProperties) {
    ch.basic_publish(
        exchange.into(),
        key.into(),
        BasicPublishOptions::default(),
        body,
        props,
    )
    .await
    .unwrap();
}

async fn next_get(ch: &Channel, q: &str) -> BasicGetMessage {
    get_eventually(ch, q, false).await
}

async fn get_now(ch: &Channel, q: &str) -> Option<BasicGetMessage> {
    ch.basic_get(q.into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
}

// ------------------------------------------------------------------------------------ TTL

#[tokio::test]
async fn queue_ttl_expires_ready_messages_without_a_consumer() {
    let broker = TestBroker::start();
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("ttl");
    declare(&ch, &q, args(&[("x-message-ttl", AMQPValue::LongInt(50))])).await;
    for i in 0..3u8 {
        publish(&ch, "", &q, &[i], BasicProperties::default()).await;
    }
    // Nobody reads the queue: the messages still go.
    wait_ready(&ch, &q, 0).await;
    assert!(get_now(&ch, &q).await.is_none());
}

#[tokio::test]
async fn per_message_expiration_is_kept_on_delivery_and_expires_at_the_head() {
    let broker = TestBroker::start();
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("exp");
    declare(&ch, &q, FieldTable::default()).await;
    publish(
        &ch,
        "",
        &q,
        b"short",
        BasicProperties::default().with_expiration("30".into()),
    )
    .await;
    publish(
        &ch,
        "",
        &q,
        b"long",
        BasicProperties::default().with_expiration("60000".into()),
    )
    .await;
    wait_ready(&ch, &q, 1).await;
    let m = get_now(&ch, &q).await.expect("the long-lived message");
    assert_eq!(m.delivery.data, b"long");
    assert_eq!(
        m.delivery
            .properties
            .expiration()
            .as_ref()
            .map(|s| s.as_str()),
        Some("60000"),
        "the expiration property is delivered as published"
    );
}

/// A message with a TTL of 0 goes to a consumer that is waiting for it, and is dropped when
/// nobody is (RabbitMQ's rule).
#[tokio::test]
async fn ttl_zero_reaches_a_waiting_consumer_only() {
    let broker = TestBroker::start();
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("ttl0");
    declare(&ch, &q, args(&[("x-message-ttl", AMQPValue::LongInt(0))])).await;
    publish(&ch, "", &q, b"nobody", BasicProperties::default()).await;
    wait_ready(&ch, &q, 0).await;
    let mut consumer = ch
        .basic_consume(
            q.as_str().into(),
            "c".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    publish(&ch, "", &q, b"waited-for", BasicProperties::default()).await;
    let d = within("the delivery", consumer.next())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(d.data, b"waited-for");
}

/// Warren only (a restart): an expiry written to disk is a wall-clock time, so a message that
/// came due while the broker was down expires right after it starts, dead-lettered.
#[tokio::test]
async fn expiry_survives_a_restart() {
    let mut broker = TestBroker::start();
    if broker.is_external() {
        return;
    }
    let q = unique("ttl-durable");
    let (dlq, dlx) = {
        let conn = broker.connect().await;
        let ch = confirm_channel(&conn).await;
        let dlx = unique("ttl-durable-dlx");
        let dlq = unique("ttl-durable-dlq");
        ch.exchange_declare(
            dlx.as_str().into(),
            ExchangeKind::Fanout,
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
        for (name, arguments) in [
            (&dlq, FieldTable::default()),
            (&q, args(&[("x-dead-letter-exchange", text(&dlx))])),
        ] {
            ch.queue_declare(
                name.as_str().into(),
                QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                arguments,
            )
            .await
            .unwrap();
        }
        ch.queue_bind(
            dlq.as_str().into(),
            dlx.as_str().into(),
            "".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
        for (body, ttl) in [(&b"soon"[..], "300"), (&b"later"[..], "600000")] {
            let confirm = ch
                .basic_publish(
                    "".into(),
                    q.as_str().into(),
                    BasicPublishOptions::default(),
                    body,
                    BasicProperties::default()
                        .with_delivery_mode(2)
                        .with_expiration(ttl.into()),
                )
                .await
                .unwrap();
            assert_eq!(confirm.await.unwrap(), Confirmation::Ack(None));
        }
        (dlq, dlx)
    };
    broker.restart(true);
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let m = next_get(&ch, &dlq).await;
    assert_eq!(m.delivery.data, b"soon");
    assert_eq!(m.delivery.exchange.as_str(), dlx);
    let d = deaths(&m.delivery.properties);
    assert_eq!(field(&d[0], "reason"), &text("expired"));
    assert_eq!(ready(&ch, &q).await, 1, "the message with a long TTL stays");
}

// ------------------------------------------------------------------------- dead-lettering

#[tokio::test]
async fn a_rejected_message_is_dead_lettered_with_x_death_as_rabbitmq_writes_it() {
    let broker = TestBroker::start();
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let (dlx, dlq) = dead_letter_queue(&ch, "rej", false).await;
    let q = unique("rej");
    declare(&ch, &q, args(&[("x-dead-letter-exchange", text(&dlx))])).await;
    let mut user = FieldTable::default();
    user.insert("foo".into(), text("bar"));
    publish(
        &ch,
        "",
        &q,
        b"poison",
        BasicProperties::default()
            .with_expiration("60000".into())
            .with_headers(user),
    )
    .await;
    let m = next_get(&ch, &q).await;
    ch.basic_reject(
        m.delivery.delivery_tag,
        BasicRejectOptions { requeue: false },
    )
    .await
    .unwrap();
    let d = next_get(&ch, &dlq).await;
    assert_eq!(d.delivery.data, b"poison");
    assert_eq!(d.delivery.exchange.as_str(), dlx);
    assert_eq!(
        d.delivery.routing_key.as_str(),
        q,
        "the original routing key"
    );
    assert!(!d.delivery.redelivered);
    let p = &d.delivery.properties;
    assert_eq!(p.expiration(), &None, "expiration moves into x-death");
    assert_eq!(header(p, "foo"), Some(&text("bar")));
    let x = deaths(p);
    assert_eq!(x.len(), 1);
    assert_eq!(field(&x[0], "count"), &AMQPValue::LongLongInt(1));
    assert_eq!(field(&x[0], "reason"), &text("rejected"));
    assert_eq!(field(&x[0], "queue"), &text(&q));
    assert_eq!(field(&x[0], "exchange"), &text(""));
    assert_eq!(field(&x[0], "original-expiration"), &text("60000"));
    match field(&x[0], "routing-keys") {
        AMQPValue::FieldArray(keys) => assert_eq!(keys.as_slice(), &[text(&q)]),
        other => panic!("routing-keys: {other:?}"),
    }
    assert!(matches!(field(&x[0], "time"), AMQPValue::Timestamp(t) if *t > 1_600_000_000));
    assert_eq!(header(p, "x-first-death-reason"), Some(&text("rejected")));
    assert_eq!(header(p, "x-first-death-queue"), Some(&text(&q)));
    assert_eq!(header(p, "x-first-death-exchange"), Some(&text("")));
}

#[tokio::test]
async fn expired_messages_dead_letter_with_the_queues_routing_key() {
    let broker = TestBroker::start();
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let target = unique("retry-target");
    declare(&ch, &target, FieldTable::default()).await;
    // The retry-with-delay pattern: a delay queue without consumers whose messages expire
    // back into the work queue.
    let delay = unique("retry-delay");
    declare(
        &ch,
        &delay,
        args(&[
            ("x-message-ttl", AMQPValue::LongInt(40)),
            ("x-dead-letter-exchange", text("")),
            ("x-dead-letter-routing-key", text(&target)),
        ]),
    )
    .await;
    publish(&ch, "", &delay, b"job", BasicProperties::default()).await;
    let m = next_get(&ch, &target).await;
    assert_eq!(m.delivery.routing_key.as_str(), target);
    let x = deaths(&m.delivery.properties);
    assert_eq!(field(&x[0], "reason"), &text("expired"));
    assert_eq!(field(&x[0], "queue"), &text(&delay));
    assert!(!x[0].contains_key(&ShortString::from("original-expiration")));
}

/// A message rejected again and again through the same queue keeps one x-death entry whose
/// count grows (a cycle with rejections in it is the client's choice: never broken).
#[tokio::test]
async fn repeated_deaths_merge_into_one_entry_per_queue_and_reason() {
    let broker = TestBroker::start();
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("again");
    declare(
        &ch,
        &q,
        args(&[
            ("x-dead-letter-exchange", text("")),
            ("x-dead-letter-routing-key", text(&q)),
        ]),
    )
    .await;
    publish(&ch, "", &q, b"m", BasicProperties::default()).await;
    for round in 1..=3i64 {
        let m = next_get(&ch, &q).await;
        if round > 1 {
            let x = deaths(&m.delivery.properties);
            assert_eq!(x.len(), 1);
            assert_eq!(field(&x[0], "count"), &AMQPValue::LongLongInt(round - 1));
        }
        ch.basic_nack(
            m.delivery.delivery_tag,
            BasicNackOptions {
                multiple: false,
                requeue: false,
            },
        )
        .await
        .unwrap();
    }
    let m = next_get(&ch, &q).await;
    assert_eq!(
        field(&deaths(&m.delivery.properties)[0], "count"),
        &AMQPValue::LongLongInt(3)
    );
}

/// An expiry cycle (a queue dead-letters to itself by TTL) is broken: the message dies once and
/// is dropped on its way back, while the other queues the exchange routes to still get it.
#[tokio::test]
async fn an_automatic_dead_letter_cycle_is_dropped_once() {
    let broker = TestBroker::start();
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let (dlx, tap) = dead_letter_queue(&ch, "cycle", false).await;
    let q = unique("cycle");
    declare(
        &ch,
        &q,
        args(&[
            ("x-message-ttl", AMQPValue::LongInt(20)),
            ("x-dead-letter-exchange", text(&dlx)),
        ]),
    )
    .await;
    ch.queue_bind(
        q.as_str().into(),
        dlx.as_str().into(),
        "".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    publish(&ch, "", &q, b"loop", BasicProperties::default()).await;
    let m = next_get(&ch, &tap).await;
    assert_eq!(
        field(&deaths(&m.delivery.properties)[0], "count"),
        &AMQPValue::LongLongInt(1)
    );
    tokio::time::sleep(QUIET).await;
    assert_eq!(ready(&ch, &q).await, 0, "dropped, not cycling");
    assert!(get_now(&ch, &tap).await.is_none(), "one death only");
}

/// A dead-letter exchange that does not exist drops the message (RabbitMQ: silently); the
/// channel goes on.
#[tokio::test]
async fn a_missing_dead_letter_exchange_drops_the_message() {
    let broker = TestBroker::start();
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("nodlx");
    declare(
        &ch,
        &q,
        args(&[("x-dead-letter-exchange", text(&unique("missing")))]),
    )
    .await;
    publish(&ch, "", &q, b"m", BasicProperties::default()).await;
    let m = next_get(&ch, &q).await;
    ch.basic_reject(
        m.delivery.delivery_tag,
        BasicRejectOptions { requeue: false },
    )
    .await
    .unwrap();
    assert_eq!(ready(&ch, &q).await, 0);
}

// ------------------------------------------------------------------------- length limits

#[tokio::test]
async fn drop_head_dead_letters_the_oldest() {
    let broker = TestBroker::start();
    let conn = broker.connect().await;
    let ch = confirm_channel(&conn).await;
    let (dlx, dlq) = dead_letter_queue(&ch, "maxlen", false).await;
    let q = unique("maxlen");
    declare(
        &ch,
        &q,
        args(&[
            ("x-max-length", AMQPValue::LongInt(2)),
            ("x-dead-letter-exchange", text(&dlx)),
        ]),
    )
    .await;
    for i in 0..3u8 {
        let c = ch
            .basic_publish(
                "".into(),
                q.as_str().into(),
                BasicPublishOptions::default(),
                &[i],
                BasicProperties::default(),
            )
            .await
            .unwrap();
        assert_eq!(c.await.unwrap(), Confirmation::Ack(None));
    }
    assert_eq!(ready(&ch, &q).await, 2);
    let d = next_get(&ch, &dlq).await;
    assert_eq!(d.delivery.data, [0]);
    assert_eq!(
        field(&deaths(&d.delivery.properties)[0], "reason"),
        &text("maxlen")
    );
    assert_eq!(get_now(&ch, &q).await.unwrap().delivery.data, [1]);
}

#[tokio::test]
async fn max_length_bytes_counts_bodies() {
    let broker = TestBroker::start();
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("maxbytes");
    declare(
        &ch,
        &q,
        args(&[("x-max-length-bytes", AMQPValue::LongInt(4))]),
    )
    .await;
    for body in [b"aa", b"bb", b"cc"] {
        publish(&ch, "", &q, body, BasicProperties::default()).await;
    }
    wait_ready(&ch, &q, 2).await;
    assert_eq!(get_now(&ch, &q).await.unwrap().delivery.data, b"bb");
}

/// reject-publish: the refused publish is nacked, and even with mandatory nothing comes back
/// (the queue was routed to).
#[tokio::test]
async fn reject_publish_nacks_without_a_return() {
    let broker = TestBroker::start();
    let conn = broker.connect().await;
    let ch = confirm_channel(&conn).await;
    let q = unique("reject-publish");
    declare(
        &ch,
        &q,
        args(&[
            ("x-max-length", AMQPValue::LongInt(2)),
            ("x-overflow", text("reject-publish")),
        ]),
    )
    .await;
    let mut confirms = Vec::new();
    for i in 0..3u8 {
        let c = ch
            .basic_publish(
                "".into(),
                q.as_str().into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..Default::default()
                },
                &[i],
                BasicProperties::default(),
            )
            .await
            .unwrap();
        confirms.push(c.await.unwrap());
    }
    assert_eq!(
        confirms,
        vec![
            Confirmation::Ack(None),
            Confirmation::Ack(None),
            Confirmation::Nack(None)
        ]
    );
    assert_eq!(ready(&ch, &q).await, 2);
    assert_eq!(get_now(&ch, &q).await.unwrap().delivery.data, [0]);
}

#[tokio::test]
async fn reject_publish_dlx_dead_letters_the_refused_message() {
    let broker = TestBroker::start();
    let conn = broker.connect().await;
    let ch = confirm_channel(&conn).await;
    let (dlx, dlq) = dead_letter_queue(&ch, "rpdlx", false).await;
    let q = unique("rpdlx");
    declare(
        &ch,
        &q,
        args(&[
            ("x-max-length", AMQPValue::LongInt(1)),
            ("x-overflow", text("reject-publish-dlx")),
            ("x-dead-letter-exchange", text(&dlx)),
        ]),
    )
    .await;
    let mut confirms = Vec::new();
    for body in [&b"kept"[..], b"refused"] {
        let c = ch
            .basic_publish(
                "".into(),
                q.as_str().into(),
                BasicPublishOptions::default(),
                body,
                BasicProperties::default(),
            )
            .await
            .unwrap();
        confirms.push(c.await.unwrap());
    }
    assert_eq!(
        confirms,
        vec![Confirmation::Ack(None), Confirmation::Nack(None)]
    );
    let d = next_get(&ch, &dlq).await;
    assert_eq!(d.delivery.data, b"refused");
    assert_eq!(
        field(&deaths(&d.delivery.properties)[0], "reason"),
        &text("maxlen")
    );
}

// ---------------------------------------------------------------------------- x-expires

/// A queue nobody uses goes after its x-expires; one with a consumer stays, and its lease
/// starts when the last consumer leaves.
#[tokio::test]
async fn an_unused_queue_expires_and_a_consumer_holds_it() {
    let broker = TestBroker::start();
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let lease = args(&[("x-expires", AMQPValue::LongInt(150))]);
    let (idle, held) = (unique("expires-idle"), unique("expires-held"));
    declare(&ch, &idle, lease.clone()).await;
    declare(&ch, &held, lease).await;
    publish(&ch, "", &idle, b"goes with it", BasicProperties::default()).await;
    let consumer_ch = conn.create_channel().await.unwrap();
    let _consumer = consumer_ch
        .basic_consume(
            held.as_str().into(),
            "holder".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(450)).await;
    let gone = ch
        .queue_declare(
            idle.as_str().into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await;
    assert_eq!(amqp_error(&gone.unwrap_err()).map(|e| e.0), Some(404));
    let ch = conn.create_channel().await.unwrap();
    assert_eq!(ready(&ch, &held).await, 0, "held by its consumer");
    consumer_ch.close(200, "bye".into()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(450)).await;
    let gone = ch
        .queue_declare(
            held.as_str().into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await;
    assert_eq!(amqp_error(&gone.unwrap_err()).map(|e| e.0), Some(404));
}

/// RabbitMQ: a queue is unused while it has no consumers, is not redeclared and sees no
/// basic.get; a poll that finds nothing counts too. Polled every 100 ms, a queue with an
/// x-expires of 300 ms stays.
#[tokio::test]
async fn polling_with_basic_get_keeps_an_expiring_queue() {
    let broker = TestBroker::start();
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("expires-polled");
    declare(&ch, &q, args(&[("x-expires", AMQPValue::LongInt(300))])).await;
    for _ in 0..10 {
        let got = ch
            .basic_get(q.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .expect("the queue is still there");
        assert!(got.is_none());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let still = ch
        .queue_declare(
            q.as_str().into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await;
    assert!(still.is_ok(), "expired while polled: {still:?}");
}

// --------------------------------------------------------------------------- priorities

#[tokio::test]
async fn priority_queues_deliver_highest_first_fifo_within_a_level() {
    let broker = TestBroker::start();
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("prio");
    declare(&ch, &q, args(&[("x-max-priority", AMQPValue::LongInt(5))])).await;
    let sent: [(&str, Option<u8>); 8] = [
        ("none", None),
        ("p0", Some(0)),
        ("p3", Some(3)),
        ("p5", Some(5)),
        ("p9", Some(9)),
        ("p255", Some(255)),
        ("none2", None),
        ("p1", Some(1)),
    ];
    for (body, p) in sent {
        let props = match p {
            Some(p) => BasicProperties::default().with_priority(p),
            None => BasicProperties::default(),
        };
        publish(&ch, "", &q, body.as_bytes(), props).await;
    }
    wait_ready(&ch, &q, 8).await;
    let mut got = Vec::new();
    let mut tags = Vec::new();
    for _ in 0..8 {
        let m = next_get(&ch, &q).await;
        tags.push(m.delivery.delivery_tag);
        got.push(String::from_utf8(m.delivery.data.clone()).unwrap());
    }
    let order = ["p5", "p9", "p255", "p3", "p1", "none", "p0", "none2"];
    assert_eq!(got, order);
    // Returned, they come back in the same order.
    ch.basic_nack(
        *tags.last().unwrap(),
        BasicNackOptions {
            multiple: true,
            requeue: true,
        },
    )
    .await
    .unwrap();
    let mut again = Vec::new();
    for _ in 0..8 {
        let m = next_get(&ch, &q).await;
        assert!(m.delivery.redelivered);
        again.push(String::from_utf8(m.delivery.data.clone()).unwrap());
    }
    assert_eq!(again, order);
}

// ------------------------------------------------------------------ choice of consumer

/// Single active consumer: the first consumer gets everything; when its channel closes, its
/// unacked messages go back and the next consumer gets them first.
#[tokio::test]
async fn single_active_consumer_hands_over_with_unacked_first() {
    let broker = TestBroker::start();
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("sac");
    declare(
        &ch,
        &q,
        args(&[("x-single-active-consumer", AMQPValue::Boolean(true))]),
    )
    .await;
    let (a_ch, b_ch) = (
        conn.create_channel().await.unwrap(),
        conn.create_channel().await.unwrap(),
    );
    for c in [&a_ch, &b_ch] {
        c.basic_qos(2, BasicQosOptions::default()).await.unwrap();
    }
    let mut a = a_ch
        .basic_consume(
            q.as_str().into(),
            "a".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut b = b_ch
        .basic_consume(
            q.as_str().into(),
            "b".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    for i in 0..4u8 {
        publish(&ch, "", &q, &[i], BasicProperties::default()).await;
    }
    for i in 0..2u8 {
        let d = within("a delivery to a", a.next()).await.unwrap().unwrap();
        assert_eq!(d.data, [i]);
    }
    assert!(
        tokio::time::timeout(QUIET, b.next()).await.is_err(),
        "b is not active"
    );
    a_ch.close(200, "bye".into()).await.unwrap();
    for (i, redelivered) in [(0u8, true), (1, true)] {
        let d = within("a delivery to b", b.next()).await.unwrap().unwrap();
        assert_eq!((d.data.as_slice(), d.redelivered), (&[i][..], redelivered));
        d.ack(BasicAckOptions::default()).await.unwrap();
    }
    for i in 2..4u8 {
        let d = within("a delivery to b", b.next()).await.unwrap().unwrap();
        assert_eq!(d.data, [i]);
        d.ack(BasicAckOptions::default()).await.unwrap();
    }
}

/// Consumer priorities: a higher-priority consumer gets messages while it has credit, the
/// lower one only what it cannot take.
#[tokio::test]
async fn higher_priority_consumers_are_served_first() {
    let broker = TestBroker::start();
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("cprio");
    declare(&ch, &q, FieldTable::default()).await;
    let (hi_ch, lo_ch) = (
        conn.create_channel().await.unwrap(),
        conn.create_channel().await.unwrap(),
    );
    hi_ch
        .basic_qos(2, BasicQosOptions::default())
        .await
        .unwrap();
    lo_ch
        .basic_qos(10, BasicQosOptions::default())
        .await
        .unwrap();
    let mut lo = lo_ch
        .basic_consume(
            q.as_str().into(),
            "lo".into(),
            BasicConsumeOptions::default(),
            args(&[("x-priority", AMQPValue::LongInt(1))]),
        )
        .await
        .unwrap();
    let mut hi = hi_ch
        .basic_consume(
            q.as_str().into(),
            "hi".into(),
            BasicConsumeOptions::default(),
            args(&[("x-priority", AMQPValue::LongInt(10))]),
        )
        .await
        .unwrap();
    for i in 0..5u8 {
        publish(&ch, "", &q, &[i], BasicProperties::default()).await;
    }
    for i in 0..2u8 {
        let d = within("hi", hi.next()).await.unwrap().unwrap();
        assert_eq!(d.data, [i]);
    }
    for i in 2..5u8 {
        let d = within("lo", lo.next()).await.unwrap().unwrap();
        assert_eq!(d.data, [i]);
    }
}

// --------------------------------------------------------------------------- queue types

fn quorum(extra: &[(&str, AMQPValue)]) -> FieldTable {
    let mut entries = vec![("x-queue-type", text("quorum"))];
    entries.extend(extra.iter().cloned());
    args(&entries)
}

/// x-delivery-limit on a quorum queue: a message is delivered limit + 1 times, then
/// dead-lettered with reason delivery_limit; redeliveries carry x-delivery-count.
#[tokio::test]
async fn quorum_delivery_limit_dead_letters_and_counts_deliveries() {
    let broker = TestBroker::start();
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let (dlx, dlq) = dead_letter_queue(&ch, "qq", false).await;
    let q = unique("qq-limit");
    declare_durable(
        &ch,
        &q,
        quorum(&[
            ("x-delivery-limit", AMQPValue::LongInt(1)),
            ("x-dead-letter-exchange", text(&dlx)),
        ]),
    )
    .await;
    let consume_ch = conn.create_channel().await.unwrap();
    consume_ch
        .basic_qos(1, BasicQosOptions::default())
        .await
        .unwrap();
    let mut c = consume_ch
        .basic_consume(
            q.as_str().into(),
            "w".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    publish(&ch, "", &q, b"poison", BasicProperties::default()).await;
    for attempt in 0..2i64 {
        let d = within("a delivery", c.next()).await.unwrap().unwrap();
        let count = header(&d.properties, "x-delivery-count");
        if attempt == 0 {
            assert_eq!(count, None, "no count on the first delivery");
        } else {
            assert_eq!(count, Some(&AMQPValue::LongLongInt(attempt)));
        }
        d.reject(BasicRejectOptions { requeue: true })
            .await
            .unwrap();
    }
    let m = next_get(&ch, &dlq).await;
    assert_eq!(
        field(&deaths(&m.delivery.properties)[0], "reason"),
        &text("delivery_limit")
    );
    assert!(
        tokio::time::timeout(QUIET, c.next()).await.is_err(),
        "not delivered a third time"
    );
}

#[tokio::test]
async fn quorum_queues_refuse_a_global_prefetch() {
    let broker = TestBroker::start();
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("qq-global");
    declare_durable(&ch, &q, quorum(&[])).await;
    ch.basic_qos(10, BasicQosOptions { global: true })
        .await
        .unwrap();
    let res = ch
        .basic_consume(
            q.as_str().into(),
            "g".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await;
    let (code, text) = amqp_error(&res.unwrap_err()).expect("a connection.close");
    assert_eq!(code, 540);
    assert_eq!(
        text,
        format!("NOT_IMPLEMENTED - queue '{q}' in vhost '/' does not support global qos")
    );
}

/// Warren refuses stream queues (RabbitMQ 3.10 declares them): a declared queue that did not
/// act as a stream would mislead more than a clear refusal.
#[tokio::test]
async fn stream_queues_are_refused_until_supported() {
    let broker = TestBroker::start();
    if broker.is_external() {
        return;
    }
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("stream");
    let res = ch
        .queue_declare(
            q.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            args(&[("x-queue-type", text("stream"))]),
        )
        .await;
    let (code, reply) = amqp_error(&res.unwrap_err()).expect("a channel.close");
    assert_eq!(code, 406);
    assert_eq!(
        reply,
        format!(
            "PRECONDITION_FAILED - invalid arg 'x-queue-type' for queue '{q}' in vhost '/': \"unsupported queue type 'stream'\""
        )
    );
}
