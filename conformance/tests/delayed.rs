//! Delayed messages (docs/task-queues.md): the `x-delayed-message` exchange of RabbitMQ's
//! delayed-message plugin (`x-delayed-type`, the `x-delay` header) and Warren's queue argument
//! `x-delivery-delay`. Never early, durable across a `kill -9`. RabbitMQ 3.10.8 as Debian
//! ships it has no delayed-message plugin, so the tests return early against an external broker.
//!
//! Delays are a few hundred milliseconds; waits poll.

use std::time::{Duration, Instant};

use futures_lite::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, ExchangeDeclareOptions,
    QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Confirmation, ExchangeKind};
use warren_conformance::queues::{args, confirm_channel, get_eventually, header, ready, text};
use warren_conformance::{assert_amqp_error, unique, within, TestBroker};

/// Whether a message held for `delay` came due no earlier than that after `sent` (a time the
/// test took before publishing). The broker's clock counts whole milliseconds, rounded down,
/// so a delay can end up to 1 ms before it would by the test's finer clock.
fn not_early(sent: Instant, delay: Duration) -> bool {
    sent.elapsed() + Duration::from_millis(1) >= delay
}

/// A durable delayed exchange routing as `direct`, and a durable queue bound with key "k".
async fn delayed_setup(ch: &Channel, prefix: &str) -> (String, String) {
    delayed_setup_with(ch, prefix, FieldTable::default()).await
}

/// [`delayed_setup`] with the queue's arguments.
async fn delayed_setup_with(
    ch: &Channel,
    prefix: &str,
    queue_args: FieldTable,
) -> (String, String) {
    let (x, q) = (
        unique(&format!("{prefix}-x")),
        unique(&format!("{prefix}-q")),
    );
    ch.exchange_declare(
        x.as_str().into(),
        ExchangeKind::Custom("x-delayed-message".into()),
        ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args(&[("x-delayed-type", text("direct"))]),
    )
    .await
    .unwrap();
    ch.queue_declare(
        q.as_str().into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        queue_args,
    )
    .await
    .unwrap();
    ch.queue_bind(
        q.as_str().into(),
        x.as_str().into(),
        "k".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    (x, q)
}

async fn publish_delayed(ch: &Channel, x: &str, body: &[u8], delay: Option<i64>) -> Confirmation {
    let mut h = FieldTable::default();
    if let Some(d) = delay {
        h.insert("x-delay".into(), AMQPValue::LongLongInt(d));
    }
    ch.basic_publish(
        x.into(),
        "k".into(),
        BasicPublishOptions {
            mandatory: true,
            ..Default::default()
        },
        body,
        BasicProperties::default()
            .with_delivery_mode(2)
            .with_headers(h),
    )
    .await
    .unwrap()
    .await
    .unwrap()
}

/// A message with `x-delay` is confirmed at once, held back (not in the queue, no
/// basic.return), and delivered once due, never before; one without is routed at once.
#[tokio::test]
async fn x_delay_holds_a_message_back_until_it_is_due() {
    let broker = TestBroker::start();
    if broker.is_external() {
        return;
    }
    let conn = broker.connect().await;
    let ch = confirm_channel(&conn).await;
    let (x, q) = delayed_setup(&ch, "delay").await;
    let sent = Instant::now();
    assert_eq!(
        publish_delayed(&ch, &x, b"later", Some(400)).await,
        Confirmation::Ack(None),
        "confirmed (stored), not returned"
    );
    assert_eq!(
        publish_delayed(&ch, &x, b"now", None).await,
        Confirmation::Ack(None)
    );
    assert_eq!(ready(&ch, &q).await, 1, "only the undelayed one is queued");
    let cch = conn.create_channel().await.unwrap();
    let mut c = cch
        .basic_consume(
            q.as_str().into(),
            "c".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let first = within("the undelayed message", c.next())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(first.data, b"now");
    first.ack(BasicAckOptions::default()).await.unwrap();
    let second = within("the delayed message", c.next())
        .await
        .unwrap()
        .unwrap();
    let waited = sent.elapsed();
    assert_eq!(second.data, b"later");
    assert!(
        not_early(sent, Duration::from_millis(400)),
        "delivered early, after {waited:?}"
    );
    assert_eq!(
        second.exchange.as_str(),
        x,
        "delivered from the exchange it was sent to"
    );
    assert_eq!(second.routing_key.as_str(), "k");
    assert!(!second.redelivered);
    assert_eq!(
        header(&second.properties, "x-delay"),
        Some(&AMQPValue::LongInt(-400)),
        "the delay negated, as the plugin delivers it"
    );
}

/// The plugin's declaration errors: no `x-delayed-type`, or an unknown one.
#[tokio::test]
async fn the_delayed_exchange_needs_a_known_x_delayed_type() {
    let broker = TestBroker::start();
    if broker.is_external() {
        return;
    }
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let res = ch
        .exchange_declare(
            unique("nodt").as_str().into(),
            ExchangeKind::Custom("x-delayed-message".into()),
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        )
        .await;
    assert_amqp_error(
        res,
        406,
        "PRECONDITION_FAILED - Invalid argument, 'x-delayed-type' must be an existing exchange type",
    );
    let ch = conn.create_channel().await.unwrap();
    let res = ch
        .exchange_declare(
            unique("baddt").as_str().into(),
            ExchangeKind::Custom("x-delayed-message".into()),
            ExchangeDeclareOptions::default(),
            args(&[("x-delayed-type", text("nope"))]),
        )
        .await;
    // An unknown exchange type closes the connection (503), as for exchange.declare itself.
    let err = res.expect_err("unknown type");
    let (code, text) = warren_conformance::amqp_error(&err).expect("an AMQP error");
    assert_eq!(code, 503);
    assert_eq!(text, "COMMAND_INVALID - unknown exchange type 'nope'");
}

/// Scheduled messages are on disk: a `kill -9` right after the confirm loses none, and one
/// that fell due while the broker was down is delivered right after it starts.
#[tokio::test]
async fn delayed_messages_survive_a_kill_and_late_ones_come_at_once() {
    let mut broker = TestBroker::start();
    if broker.is_external() {
        return;
    }
    let (x, q, sent) = {
        let conn = broker.connect().await;
        let ch = confirm_channel(&conn).await;
        let (x, q) = delayed_setup(&ch, "delay-kill").await;
        let sent = Instant::now();
        for (body, delay) in [(&b"short"[..], 200), (&b"long"[..], 1500)] {
            assert_eq!(
                publish_delayed(&ch, &x, body, Some(delay)).await,
                Confirmation::Ack(None)
            );
        }
        (x, q, sent)
    };
    broker.restart(true);
    // Make sure the short one fell due while the broker was down or starting.
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let first = get_eventually(&ch, &q, true).await;
    assert_eq!(first.delivery.data, b"short");
    assert!(not_early(sent, Duration::from_millis(200)));
    let second = get_eventually(&ch, &q, true).await;
    assert_eq!(second.delivery.data, b"long");
    assert!(
        not_early(sent, Duration::from_millis(1500)),
        "delivered early after a restart"
    );
    assert_eq!(second.delivery.exchange.as_str(), x);
    assert_eq!(ready(&ch, &q).await, 0, "each delivered once");
}

/// `x-delivery-delay` on a queue holds every message that reaches it (only that queue's copy),
/// and a message's own `x-delay` replaces the default.
#[tokio::test]
async fn a_queue_delivery_delay_holds_back_its_copy_only() {
    let broker = TestBroker::start();
    if broker.is_external() {
        return;
    }
    let conn = broker.connect().await;
    let ch = confirm_channel(&conn).await;
    let q = unique("qdelay");
    ch.queue_declare(
        q.as_str().into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args(&[("x-delivery-delay", AMQPValue::LongInt(300))]),
    )
    .await
    .unwrap();
    let sent = Instant::now();
    let confirm = ch
        .basic_publish(
            "".into(),
            q.as_str().into(),
            BasicPublishOptions::default(),
            b"job",
            BasicProperties::default().with_delivery_mode(2),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    assert_eq!(confirm, Confirmation::Ack(None));
    assert_eq!(ready(&ch, &q).await, 0, "held back");
    let m = get_eventually(&ch, &q, true).await;
    assert_eq!(m.delivery.data, b"job");
    assert!(
        not_early(sent, Duration::from_millis(300)),
        "early: {:?}",
        sent.elapsed()
    );
    // A redeclaration with another delay is refused, as for RabbitMQ's own arguments.
    let res = ch
        .queue_declare(
            q.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            args(&[("x-delivery-delay", AMQPValue::LongInt(10))]),
        )
        .await;
    assert_amqp_error(
        res,
        406,
        &format!(
            "PRECONDITION_FAILED - inequivalent arg 'x-delivery-delay' for queue '{q}' in vhost '/': received '10' but current is '300'"
        ),
    );
}

/// A queue's held copies go with it: `later` deleted and declared again (non-durable, other
/// arguments) before the delay ends gets nothing; nor does a durable one declared again
/// after a `kill -9` and a restart.
#[tokio::test]
async fn a_deleted_queue_takes_its_held_copies_with_it() {
    let mut broker = TestBroker::start();
    if broker.is_external() {
        return;
    }
    // The durable one's delay outlasts the restart, so that its copy would be released to the
    // queue declared after it, not dropped for want of one.
    let (short, long) = (300, 1_000);
    let (durable_later, sent) = {
        let conn = broker.connect().await;
        let ch = confirm_channel(&conn).await;
        let (later, durable_later) = (unique("later"), unique("later-durable"));
        for (q, delay) in [(&later, short), (&durable_later, long)] {
            ch.queue_declare(
                q.as_str().into(),
                QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                args(&[("x-delivery-delay", AMQPValue::LongInt(delay))]),
            )
            .await
            .unwrap();
        }
        let sent = Instant::now();
        for q in [&later, &durable_later] {
            let confirm = ch
                .basic_publish(
                    "".into(),
                    q.as_str().into(),
                    BasicPublishOptions::default(),
                    b"held",
                    BasicProperties::default().with_delivery_mode(2),
                )
                .await
                .unwrap()
                .await
                .unwrap();
            assert_eq!(confirm, Confirmation::Ack(None));
            ch.queue_delete(q.as_str().into(), Default::default())
                .await
                .unwrap();
        }
        ch.queue_declare(
            later.as_str().into(),
            QueueDeclareOptions::default(),
            args(&[("x-max-length", AMQPValue::LongInt(10))]),
        )
        .await
        .unwrap();
        tokio::time::sleep(Duration::from_millis(short as u64 + 200)).await;
        assert_eq!(ready(&ch, &later).await, 0, "the old queue's copy arrived");
        (durable_later, sent)
    };
    broker.restart(true);
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.queue_declare(
        durable_later.as_str().into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args(&[("x-delivery-delay", AMQPValue::LongInt(long))]),
    )
    .await
    .unwrap();
    let wait = Duration::from_millis(long as u64 + 200).saturating_sub(sent.elapsed());
    tokio::time::sleep(wait.max(Duration::from_millis(100))).await;
    assert_eq!(ready(&ch, &durable_later).await, 0, "back after a restart");
}

/// A delayed message that falls due into a full `reject-publish` queue is held back and tried
/// again (after a second), never dropped, and each refusal is counted in
/// `warren_delayed_refused_total`.
#[tokio::test]
async fn a_release_into_a_full_queue_is_counted_and_tried_again() {
    let broker = TestBroker::start();
    if broker.is_external() {
        return;
    }
    let conn = broker.connect().await;
    let ch = confirm_channel(&conn).await;
    let (x, q) = delayed_setup_with(
        &ch,
        "full",
        args(&[
            ("x-max-length", AMQPValue::LongInt(1)),
            ("x-overflow", text("reject-publish")),
        ]),
    )
    .await;
    assert!(publish_delayed(&ch, &x, b"first", None).await.is_ack());
    assert!(publish_delayed(&ch, &x, b"later", Some(20)).await.is_ack());
    let base = broker.metrics_url().expect("metrics on");
    let refused = |text: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix("warren_delayed_refused_total "))
            .and_then(|v| v.trim().parse::<u64>().ok())
    };
    warren_conformance::http::eventually("a refused release counted", || {
        let text =
            warren_conformance::http::request("GET", &format!("{base}/metrics"), None, &[], None)
                .text();
        match refused(&text) {
            Some(n) if n >= 1 => Ok(n),
            other => Err(format!("warren_delayed_refused_total: {other:?}")),
        }
    });
    // Room again: the held message comes on its next try.
    let first = get_eventually(&ch, &q, true).await;
    assert_eq!(first.delivery.data, b"first");
    let later = get_eventually(&ch, &q, true).await;
    assert_eq!(later.delivery.data, b"later");
}
