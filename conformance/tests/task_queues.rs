//! Warren's task-queue semantics (docs/task-queues.md): visibility timeouts with extensions
//! from an unmodified client, late acks that never take a message from the worker that now holds
//! it, and `x-delivery-limit` on classic queues. RabbitMQ ignores these arguments, so the tests
//! return early against an external broker.
//!
//! Timeouts are tens of milliseconds; waits poll, never sleep for seconds.

use std::time::Duration;

use futures_lite::StreamExt;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicGetOptions, BasicNackOptions, BasicPublishOptions,
    BasicQosOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Confirmation, Consumer};
use warren_conformance::queues::{
    args, dead_letter_queue, deaths, declare_durable, field, get_eventually, header, ready, text,
    wait_ready,
};
use warren_conformance::raw::m;
use warren_conformance::{amqp_error, unique, within, TestBroker, QUIET};

async fn publish(ch: &Channel, q: &str, body: &[u8]) {
    ch.basic_publish(
        "".into(),
        q.into(),
        BasicPublishOptions::default(),
        body,
        BasicProperties::default().with_delivery_mode(2),
    )
    .await
    .unwrap();
}

async fn consume(ch: &Channel, q: &str, prefetch: u16, arguments: FieldTable) -> Consumer {
    ch.basic_qos(prefetch, BasicQosOptions::default())
        .await
        .unwrap();
    ch.basic_consume(
        q.into(),
        "worker".into(),
        BasicConsumeOptions::default(),
        arguments,
    )
    .await
    .unwrap()
}

async fn next(c: &mut Consumer, what: &str) -> Delivery {
    within(what, c.next()).await.unwrap().unwrap()
}

/// Asks for `ms` more milliseconds on a delivery this channel holds; the confirm says whether
/// the broker granted it.
async fn extend(ch: &Channel, tag: u64, ms: i64) -> Confirmation {
    let mut h = FieldTable::default();
    h.insert("x-delivery-tag".into(), AMQPValue::LongLongInt(tag as i64));
    h.insert("x-visibility-timeout".into(), AMQPValue::LongLongInt(ms));
    ch.basic_publish(
        "amq.warren.visibility".into(),
        "".into(),
        BasicPublishOptions::default(),
        b"",
        BasicProperties::default().with_headers(h),
    )
    .await
    .unwrap()
    .await
    .unwrap()
}

/// An unacked delivery comes back on its own after the queue's visibility timeout, to the same
/// consumer (its channel stays open), redelivered and with its delivery count.
#[tokio::test]
async fn an_unacked_delivery_comes_back_after_the_visibility_timeout() {
    let broker = TestBroker::start();
    if broker.is_external() {
        return;
    }
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("vis");
    declare_durable(
        &ch,
        &q,
        args(&[("x-visibility-timeout", AMQPValue::LongInt(80))]),
    )
    .await;
    publish(&ch, &q, b"job").await;
    let wch = conn.create_channel().await.unwrap();
    let mut worker = consume(&wch, &q, 1, FieldTable::default()).await;
    let first = next(&mut worker, "the first delivery").await;
    assert!(!first.redelivered);
    assert_eq!(header(&first.properties, "x-delivery-count"), None);
    let again = next(&mut worker, "the delivery after its timeout").await;
    assert_eq!(again.data, b"job");
    assert!(again.redelivered);
    assert_eq!(
        header(&again.properties, "x-delivery-count"),
        Some(&AMQPValue::LongLongInt(1))
    );
    again.ack(BasicAckOptions::default()).await.unwrap();
    // The first delivery's late ack is not an error, and there is nothing left to take.
    first.ack(BasicAckOptions::default()).await.unwrap();
    assert!(wch.status().connected(), "the channel stays open");
    assert!(tokio::time::timeout(QUIET, worker.next()).await.is_err());
    assert_eq!(ready(&ch, &q).await, 0);
}

/// A late ack never takes the message from the worker that now holds it.
#[tokio::test]
async fn a_late_ack_leaves_the_copy_another_worker_holds() {
    let broker = TestBroker::start();
    if broker.is_external() {
        return;
    }
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("vis-late");
    declare_durable(
        &ch,
        &q,
        args(&[("x-visibility-timeout", AMQPValue::LongInt(60))]),
    )
    .await;
    publish(&ch, &q, b"job").await;
    let slow_ch = conn.create_channel().await.unwrap();
    let slow = within(
        "a get",
        slow_ch.basic_get(q.as_str().into(), BasicGetOptions::default()),
    )
    .await
    .unwrap()
    .expect("the job");
    // Another worker takes it once the first one's time is up.
    let fast_ch = conn.create_channel().await.unwrap();
    let mut fast = consume(&fast_ch, &q, 1, FieldTable::default()).await;
    let taken = next(&mut fast, "the job, after the first holder's timeout").await;
    assert!(taken.redelivered);
    slow.delivery.ack(BasicAckOptions::default()).await.unwrap();
    // The second holder gives it back: it is still there to give.
    fast_ch
        .basic_cancel("worker".into(), Default::default())
        .await
        .unwrap();
    taken
        .nack(BasicNackOptions {
            multiple: false,
            requeue: true,
        })
        .await
        .unwrap();
    let back = get_eventually(&ch, &q, true).await;
    assert_eq!(back.delivery.data, b"job");
}

/// A worker that finishes after its timeout, while nobody else has taken the message, still
/// settles it with its ack.
#[tokio::test]
async fn a_late_ack_settles_a_message_nobody_else_took() {
    let broker = TestBroker::start();
    if broker.is_external() {
        return;
    }
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("vis-waiting");
    declare_durable(
        &ch,
        &q,
        args(&[("x-visibility-timeout", AMQPValue::LongInt(40))]),
    )
    .await;
    publish(&ch, &q, b"job").await;
    let m = within(
        "a get",
        ch.basic_get(q.as_str().into(), BasicGetOptions::default()),
    )
    .await
    .unwrap()
    .expect("the job");
    wait_ready(&ch, &q, 1).await;
    m.delivery.ack(BasicAckOptions::default()).await.unwrap();
    wait_ready(&ch, &q, 0).await;
}

/// A long job keeps its delivery by publishing to amq.warren.visibility, as often as it needs;
/// the confirm says whether the extension was granted. Once it stops, the timeout applies.
#[tokio::test]
async fn a_worker_extends_its_delivery_from_an_unmodified_client() {
    let broker = TestBroker::start();
    if broker.is_external() {
        return;
    }
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("vis-extend");
    declare_durable(
        &ch,
        &q,
        args(&[("x-visibility-timeout", AMQPValue::LongInt(100))]),
    )
    .await;
    publish(&ch, &q, b"long job").await;
    let wch = conn.create_channel().await.unwrap();
    wch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let mut worker = consume(&wch, &q, 1, FieldTable::default()).await;
    let d = next(&mut worker, "the job").await;
    for _ in 0..6 {
        assert_eq!(
            extend(&wch, d.delivery_tag, 150).await,
            Confirmation::Ack(None)
        );
        assert!(
            tokio::time::timeout(Duration::from_millis(60), worker.next())
                .await
                .is_err(),
            "redelivered while extended"
        );
    }
    assert_eq!(
        extend(&wch, 9999, 150).await,
        Confirmation::Nack(None),
        "an unknown tag"
    );
    let again = next(&mut worker, "the job once extensions stop").await;
    assert!(again.redelivered);
    // The timed-out delivery can no longer be extended.
    assert_eq!(
        extend(&wch, d.delivery_tag, 150).await,
        Confirmation::Nack(None)
    );
    again.ack(BasicAckOptions::default()).await.unwrap();
}

/// A consumer's own x-visibility-timeout applies on a queue without one.
#[tokio::test]
async fn a_consumer_sets_its_own_visibility_timeout() {
    let broker = TestBroker::start();
    if broker.is_external() {
        return;
    }
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("vis-consumer");
    declare_durable(&ch, &q, FieldTable::default()).await;
    publish(&ch, &q, b"job").await;
    let wch = conn.create_channel().await.unwrap();
    let mut worker = consume(
        &wch,
        &q,
        1,
        args(&[("x-visibility-timeout", AMQPValue::LongInt(50))]),
    )
    .await;
    let first = next(&mut worker, "the job").await;
    let again = next(&mut worker, "the job after the consumer's timeout").await;
    assert_eq!(again.data, first.data);
    assert!(again.redelivered);
}

/// x-delivery-limit on a classic queue: timeouts count as failed deliveries, and past the limit
/// the message is dead-lettered (reason delivery_limit), so a poison job stops coming back.
#[tokio::test]
async fn a_classic_queue_dead_letters_past_its_delivery_limit() {
    let broker = TestBroker::start();
    if broker.is_external() {
        return;
    }
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let (dlx, dlq) = dead_letter_queue(&ch, "poison", true).await;
    let q = unique("poison");
    declare_durable(
        &ch,
        &q,
        args(&[
            ("x-visibility-timeout", AMQPValue::LongInt(40)),
            ("x-delivery-limit", AMQPValue::LongInt(1)),
            ("x-dead-letter-exchange", text(&dlx)),
        ]),
    )
    .await;
    publish(&ch, &q, b"poison").await;
    publish(&ch, &q, b"fine").await;
    let wch = conn.create_channel().await.unwrap();
    let mut worker = consume(&wch, &q, 1, FieldTable::default()).await;
    // The poison job times out twice (never acked), then the fine one gets through.
    let mut seen = Vec::new();
    loop {
        let d = next(&mut worker, "a job").await;
        seen.push(String::from_utf8(d.data.clone()).unwrap());
        if d.data == b"fine" {
            d.ack(BasicAckOptions::default()).await.unwrap();
            break;
        }
    }
    assert_eq!(seen, ["poison", "poison", "fine"]);
    let dead = get_eventually(&ch, &dlq, true).await;
    assert_eq!(dead.delivery.data, b"poison");
    assert_eq!(
        field(&deaths(&dead.delivery.properties)[0], "reason"),
        &text("delivery_limit")
    );
}

#[tokio::test]
async fn bad_visibility_timeouts_are_refused() {
    let broker = TestBroker::start();
    if broker.is_external() {
        return;
    }
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("vis-bad");
    let res = ch
        .queue_declare(
            q.as_str().into(),
            QueueDeclareOptions::default(),
            args(&[("x-visibility-timeout", AMQPValue::LongInt(0))]),
        )
        .await;
    assert_eq!(
        amqp_error(&res.unwrap_err()),
        Some((
            406,
            format!(
                "PRECONDITION_FAILED - invalid arg 'x-visibility-timeout' for queue '{q}' in vhost '/': {{value_zero,0}}"
            )
        ))
    );
    let ch = conn.create_channel().await.unwrap();
    declare_durable(&ch, &q, FieldTable::default()).await;
    let res = ch
        .basic_consume(
            q.as_str().into(),
            "c".into(),
            BasicConsumeOptions::default(),
            args(&[("x-visibility-timeout", text("soon"))]),
        )
        .await;
    assert_eq!(
        amqp_error(&res.unwrap_err()),
        Some((
            406,
            format!(
                "PRECONDITION_FAILED - invalid arg 'x-visibility-timeout' for queue '{q}' in vhost '/': \"expected integer, got longstr\""
            )
        ))
    );
}

/// x-consumer-timeout (RabbitMQ 4.3): a consumer that leaves a delivery unacked too long is
/// cancelled with basic.cancel, its deliveries go back to the queue, and its channel stays.
#[tokio::test]
async fn a_consumer_past_its_consumer_timeout_is_cancelled() {
    let broker = TestBroker::start();
    if broker.is_external() {
        return;
    }
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("ctimeout");
    declare_durable(
        &ch,
        &q,
        args(&[("x-consumer-timeout", AMQPValue::LongInt(60))]),
    )
    .await;
    for body in [b"a", b"b", b"c"] {
        publish(&ch, &q, body).await;
    }
    let wch = conn.create_channel().await.unwrap();
    let mut worker = consume(&wch, &q, 2, FieldTable::default()).await;
    let first = next(&mut worker, "a").await;
    let _second = next(&mut worker, "b").await;
    // The server's basic.cancel ends lapin's consumer stream.
    let end = within("the consumer to be cancelled", worker.next()).await;
    assert!(end.is_none(), "expected the cancel, got {end:?}");
    // Its deliveries are back, first; the third never went out.
    let mut got = Vec::new();
    for _ in 0..3 {
        let m = get_eventually(&ch, &q, true).await;
        got.push((m.delivery.data.clone(), m.delivery.redelivered));
    }
    assert_eq!(
        got,
        vec![
            (b"a".to_vec(), true),
            (b"b".to_vec(), true),
            (b"c".to_vec(), false)
        ]
    );
    // The late ack is no error; the channel still works.
    first.ack(BasicAckOptions::default()).await.unwrap();
    wch.queue_declare(
        q.as_str().into(),
        QueueDeclareOptions {
            passive: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .expect("the worker's channel is open");
}

/// RabbitMQ's older consumer timeout, behind `--consumer-timeout-closes-channel`: the channel is
/// closed with 406 and RabbitMQ's text, and its deliveries go back.
#[tokio::test]
async fn the_older_consumer_timeout_closes_the_channel_when_configured() {
    let broker = TestBroker::start_with(&["--consumer-timeout-closes-channel"]);
    if broker.is_external() {
        return;
    }
    let q = unique("ctimeout-close");
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    raw.call(
        1,
        m::queue_declare_args(
            &q,
            Default::default(),
            args(&[("x-consumer-timeout", AMQPValue::LongInt(50))]),
        ),
    )
    .await;
    raw.publish(1, "", &q, false, Default::default(), b"job")
        .await;
    raw.call(1, m::basic_consume(&q, "w", false, false)).await;
    let d = raw.recv_delivery().await;
    assert_eq!(d.body, b"job");
    raw.expect_channel_close(
        1,
        406,
        "PRECONDITION_FAILED - delivery acknowledgement on channel 1 timed out. Timeout value used: 50 ms. This timeout value can be configured, see consumers doc guide to learn more",
        0,
        0,
    )
    .await;
    raw.channel_open(2).await;
    let ok = raw.wait_ready(2, &q, 1).await;
    assert_eq!(ok.message_count, 1, "the job is back");
}

/// Delayed retries: a nacked job comes back only after its back-off (linear here: 60 ms, then
/// 120 ms), never early; a job whose worker's channel closes comes back at once.
#[tokio::test]
async fn a_nacked_job_comes_back_after_its_back_off() {
    let broker = TestBroker::start();
    if broker.is_external() {
        return;
    }
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("retry");
    declare_durable(
        &ch,
        &q,
        args(&[
            ("x-delayed-retry-min", AMQPValue::LongInt(60)),
            ("x-delayed-retry-max", AMQPValue::LongInt(1000)),
        ]),
    )
    .await;
    publish(&ch, &q, b"flaky").await;
    let wch = conn.create_channel().await.unwrap();
    let mut worker = consume(&wch, &q, 1, FieldTable::default()).await;
    let mut d = next(&mut worker, "the job").await;
    for expected_ms in [60u64, 120] {
        let nacked = std::time::Instant::now();
        d.nack(BasicNackOptions {
            multiple: false,
            requeue: true,
        })
        .await
        .unwrap();
        d = next(&mut worker, "the retry").await;
        let waited = nacked.elapsed();
        // The broker's clock counts whole milliseconds, rounded down, so a back-off can end up
        // to 1 ms before it would by the test's finer clock.
        assert!(
            waited + Duration::from_millis(1) >= Duration::from_millis(expected_ms),
            "retried after {waited:?}, before its {expected_ms} ms back-off"
        );
        assert!(d.redelivered);
    }
    // The worker goes away holding it: no back-off for that.
    let other = conn.create_channel().await.unwrap();
    let mut next_worker = consume(&other, &q, 1, FieldTable::default()).await;
    let closed = std::time::Instant::now();
    wch.close(200, "bye".into()).await.unwrap();
    let again = next(&mut next_worker, "the job, from a closed channel").await;
    assert_eq!(again.data, b"flaky");
    assert!(
        closed.elapsed() < Duration::from_millis(240),
        "a closed channel's job waited {:?}",
        closed.elapsed()
    );
}

#[tokio::test]
async fn bad_retry_arguments_are_refused() {
    let broker = TestBroker::start();
    if broker.is_external() {
        return;
    }
    let conn = broker.connect().await;
    for (key, value, term) in [
        (
            "x-delayed-retry-type",
            text("sometimes"),
            "\"unsupported delayed retry type 'sometimes'\"",
        ),
        (
            "x-delayed-retry-min",
            AMQPValue::LongInt(0),
            "{value_zero,0}",
        ),
        (
            "x-delayed-retry-jitter",
            AMQPValue::LongInt(101),
            "{max_value_exceeded,101}",
        ),
    ] {
        let ch = conn.create_channel().await.unwrap();
        let q = unique("retry-bad");
        let res = ch
            .queue_declare(
                q.as_str().into(),
                QueueDeclareOptions::default(),
                args(&[(key, value)]),
            )
            .await;
        assert_eq!(
            amqp_error(&res.unwrap_err()),
            Some((
                406,
                format!("PRECONDITION_FAILED - invalid arg '{key}' for queue '{q}' in vhost '/': {term}")
            ))
        );
    }
}
