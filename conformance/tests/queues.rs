//! Queues behind the default exchange: declare (server-named, passive, durable, exclusive, auto-delete),
//! purge, delete (if-unused, if-empty), and how bindings on the default exchange are refused.

use lapin::options::{
    BasicConsumeOptions, BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions,
    QueueDeclareOptions, QueueDeleteOptions, QueuePurgeOptions,
};
use lapin::types::FieldTable;
use lapin::BasicProperties;
use warren_conformance::raw::protocol::{queue, AMQPClass};
use warren_conformance::raw::{m, QueueFlags};
use warren_conformance::{assert_amqp_error, unique, within, TestBroker};

fn passive() -> QueueFlags {
    QueueFlags {
        passive: true,
        ..Default::default()
    }
}

async fn declare_ok(
    raw: &mut warren_conformance::raw::Raw,
    ch: u16,
    method: AMQPClass,
) -> queue::DeclareOk {
    match raw.call(ch, method).await {
        AMQPClass::Queue(queue::AMQPMethod::DeclareOk(ok)) => ok,
        other => unreachable!("{other:?}"),
    }
}

#[tokio::test]
async fn default_exchange_routes_by_queue_name() {
    let broker = TestBroker::start();
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("q-default");
    ch.queue_declare(
        q.as_str().into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.basic_publish(
        "".into(),
        q.as_str().into(),
        BasicPublishOptions::default(),
        b"hello",
        BasicProperties::default(),
    )
    .await
    .unwrap();
    let msg = loop {
        if let Some(msg) = ch
            .basic_get(q.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
        {
            break msg;
        }
    };
    assert_eq!(msg.delivery.data, b"hello");
    assert_eq!(msg.delivery.exchange.as_str(), "");
    assert_eq!(msg.delivery.routing_key.as_str(), q);
}

/// RabbitMQ 3.10 has no `amq.default` alias for the default exchange (some docs suggest otherwise).
#[tokio::test]
async fn amq_default_is_not_an_exchange() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    let q = unique("q-amqdefault");
    raw.declare_queue(1, &q).await;
    raw.publish(1, "amq.default", &q, false, Default::default(), b"x")
        .await;
    raw.expect_channel_close(
        1,
        404,
        "NOT_FOUND - no exchange 'amq.default' in vhost '/'",
        60,
        40,
    )
    .await;
}

#[tokio::test]
async fn server_named_queue_starts_with_amq_gen() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    let ok = raw.declare_queue(1, "").await;
    let name = ok.queue.as_str().to_string();
    assert!(name.starts_with("amq.gen-"), "server-named queue {name:?}");
    assert!(
        name.len() > "amq.gen-".len() + 8,
        "name too short: {name:?}"
    );
    assert_eq!((ok.message_count, ok.consumer_count), (0, 0));
    // Each declare gets a fresh name, and the queue is usable by name.
    let other = raw.declare_queue(1, "").await;
    assert_ne!(other.queue.as_str(), name);
    raw.publish(1, "", &name, false, Default::default(), b"to gen")
        .await;
    raw.wait_ready(1, &name, 1).await;
}

#[tokio::test]
async fn server_named_queue_with_lapin() {
    let broker = TestBroker::start();
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = ch
        .queue_declare(
            "".into(),
            QueueDeclareOptions {
                exclusive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    assert!(q.name().as_str().starts_with("amq.gen-"), "{:?}", q.name());
}

#[tokio::test]
async fn declare_ok_reports_message_and_consumer_counts() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    raw.channel_open(2).await;
    let q = unique("q-counts");
    let ok = raw.declare_queue(1, &q).await;
    assert_eq!(
        (ok.queue.as_str(), ok.message_count, ok.consumer_count),
        (q.as_str(), 0, 0)
    );
    for i in 0..3 {
        raw.publish(
            1,
            "",
            &q,
            false,
            Default::default(),
            format!("{i}").as_bytes(),
        )
        .await;
    }
    raw.wait_ready(1, &q, 3).await;
    // Redeclare with the same properties is idempotent and reports the counts.
    let ok = raw.declare_queue(1, &q).await;
    assert_eq!((ok.message_count, ok.consumer_count), (3, 0));
    raw.send(2, m::basic_qos(1, false)).await;
    raw.recv_method().await;
    raw.call(2, m::basic_consume(&q, "c", false, false)).await;
    raw.recv_delivery().await;
    // One message is unacked (not counted as ready), one consumer.
    let ok = declare_ok(&mut raw, 1, m::queue_declare(&q, passive())).await;
    assert_eq!((ok.message_count, ok.consumer_count), (2, 1));
}

#[tokio::test]
async fn passive_declare_of_existing_queue_does_not_check_flags() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    let q = unique("q-passive");
    declare_ok(
        &mut raw,
        1,
        m::queue_declare(
            &q,
            QueueFlags {
                durable: true,
                ..Default::default()
            },
        ),
    )
    .await;
    // Passive with other flags: only existence is checked.
    let ok = declare_ok(
        &mut raw,
        1,
        m::queue_declare(
            &q,
            QueueFlags {
                passive: true,
                durable: false,
                auto_delete: true,
                ..Default::default()
            },
        ),
    )
    .await;
    assert_eq!(ok.queue.as_str(), q);
    raw.call(1, m::queue_delete(&q, false, false)).await;
}

#[tokio::test]
async fn passive_declare_of_missing_queue_is_404_with_lapin() {
    let broker = TestBroker::start();
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("q-missing");
    let res = ch
        .queue_declare(
            q.as_str().into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await;
    assert_amqp_error(
        res,
        404,
        &format!("NOT_FOUND - no queue '{q}' in vhost '/'"),
    );
}

#[tokio::test]
async fn durable_flag_is_recorded() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    let q = unique("q-durable");
    declare_ok(
        &mut raw,
        1,
        m::queue_declare(
            &q,
            QueueFlags {
                durable: true,
                ..Default::default()
            },
        ),
    )
    .await;
    declare_ok(
        &mut raw,
        1,
        m::queue_declare(
            &q,
            QueueFlags {
                durable: true,
                ..Default::default()
            },
        ),
    )
    .await;
    raw.send(1, m::queue_declare(&q, QueueFlags::default()))
        .await;
    raw.expect_channel_close(
        1,
        406,
        &format!("PRECONDITION_FAILED - inequivalent arg 'durable' for queue '{q}' in vhost '/': received 'false' but current is 'true'"),
        50,
        10,
    )
    .await;
    raw.channel_open(1).await;
    raw.call(1, m::queue_delete(&q, false, false)).await;
}

#[tokio::test]
async fn auto_delete_flag_is_recorded() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    let q = unique("q-ad-flag");
    declare_ok(
        &mut raw,
        1,
        m::queue_declare(
            &q,
            QueueFlags {
                auto_delete: true,
                ..Default::default()
            },
        ),
    )
    .await;
    raw.send(1, m::queue_declare(&q, QueueFlags::default()))
        .await;
    raw.expect_channel_close(
        1,
        406,
        &format!("PRECONDITION_FAILED - inequivalent arg 'auto_delete' for queue '{q}' in vhost '/': received 'false' but current is 'true'"),
        50,
        10,
    )
    .await;
}

#[tokio::test]
async fn exclusive_queue_is_usable_by_its_connection() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    raw.channel_open(2).await;
    let q = unique("q-excl");
    declare_ok(
        &mut raw,
        1,
        m::queue_declare(
            &q,
            QueueFlags {
                exclusive: true,
                ..Default::default()
            },
        ),
    )
    .await;
    // Any channel of the owning connection may use it.
    raw.publish(2, "", &q, false, Default::default(), b"mine")
        .await;
    let d = loop {
        if let Some(d) = raw.get(2, &q, true).await {
            break d;
        }
    };
    assert_eq!(d.body, b"mine");
    declare_ok(
        &mut raw,
        2,
        m::queue_declare(
            &q,
            QueueFlags {
                exclusive: true,
                ..Default::default()
            },
        ),
    )
    .await;
}

#[tokio::test]
async fn exclusive_queue_vanishes_with_its_connection() {
    let broker = TestBroker::start();
    let mut owner = broker.raw().await;
    owner.channel_open(1).await;
    let q = unique("q-excl-gone");
    declare_ok(
        &mut owner,
        1,
        m::queue_declare(
            &q,
            QueueFlags {
                exclusive: true,
                ..Default::default()
            },
        ),
    )
    .await;
    owner
        .publish(1, "", &q, false, Default::default(), b"x")
        .await;
    owner.close().await;

    let mut other = broker.raw().await;
    other.channel_open(1).await;
    other.send(1, m::queue_declare(&q, passive())).await;
    other
        .expect_channel_close(
            1,
            404,
            &format!("NOT_FOUND - no queue '{q}' in vhost '/'"),
            50,
            10,
        )
        .await;
}

#[tokio::test]
async fn exclusive_queue_vanishes_when_connection_drops_without_close() {
    let broker = TestBroker::start();
    let q = unique("q-excl-drop");
    {
        let mut owner = broker.raw().await;
        owner.channel_open(1).await;
        declare_ok(
            &mut owner,
            1,
            m::queue_declare(
                &q,
                QueueFlags {
                    exclusive: true,
                    ..Default::default()
                },
            ),
        )
        .await;
        // Dropped: the socket is closed without connection.close.
    }
    let mut other = broker.raw().await;
    other.channel_open(1).await;
    // The broker notices the dropped socket asynchronously: poll briefly. Until it has, the
    // queue is still the other connection's: a passive declare is refused with 405
    // RESOURCE_LOCKED (as RabbitMQ refuses it), which closes the channel.
    for attempt in 0.. {
        other.send(1, m::queue_declare(&q, passive())).await;
        let (_, reply) = other.recv_method().await;
        match reply {
            AMQPClass::Channel(warren_conformance::raw::protocol::channel::AMQPMethod::Close(
                c,
            )) => {
                other.send(1, m::channel_close_ok()).await;
                if c.reply_code == 405 && attempt < 100 {
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                    other.channel_open(1).await;
                    continue;
                }
                assert_eq!(c.reply_code, 404, "{c:?}");
                break;
            }
            other => panic!("exclusive queue still there after its connection dropped: {other:?}"),
        }
    }
}

#[tokio::test]
async fn auto_delete_queue_is_deleted_when_last_consumer_cancels() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    let q = unique("q-autodel");
    declare_ok(
        &mut raw,
        1,
        m::queue_declare(
            &q,
            QueueFlags {
                auto_delete: true,
                ..Default::default()
            },
        ),
    )
    .await;
    // Without ever having had a consumer it stays.
    declare_ok(&mut raw, 1, m::queue_declare(&q, passive())).await;
    raw.call(1, m::basic_consume(&q, "c1", true, false)).await;
    raw.call(1, m::basic_consume(&q, "c2", true, false)).await;
    raw.call(1, m::basic_cancel("c1")).await;
    // One consumer left: still there.
    declare_ok(&mut raw, 1, m::queue_declare(&q, passive())).await;
    raw.call(1, m::basic_cancel("c2")).await;
    raw.send(1, m::queue_declare(&q, passive())).await;
    raw.expect_channel_close(
        1,
        404,
        &format!("NOT_FOUND - no queue '{q}' in vhost '/'"),
        50,
        10,
    )
    .await;
}

#[tokio::test]
async fn auto_delete_queue_is_deleted_when_consumer_channel_closes() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    raw.channel_open(2).await;
    let q = unique("q-autodel2");
    declare_ok(
        &mut raw,
        1,
        m::queue_declare(
            &q,
            QueueFlags {
                auto_delete: true,
                ..Default::default()
            },
        ),
    )
    .await;
    raw.call(2, m::basic_consume(&q, "c1", false, false)).await;
    raw.call(2, m::channel_close()).await;
    raw.send(1, m::queue_declare(&q, passive())).await;
    raw.expect_channel_close(
        1,
        404,
        &format!("NOT_FOUND - no queue '{q}' in vhost '/'"),
        50,
        10,
    )
    .await;
}

#[tokio::test]
async fn purge_returns_count_and_empties_queue() {
    let broker = TestBroker::start();
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("q-purge");
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
    for _ in 0..7 {
        ch.basic_publish(
            "".into(),
            q.as_str().into(),
            BasicPublishOptions::default(),
            b"p",
            BasicProperties::default(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    }
    // Make sure all 7 have arrived (declare is synchronous and ordered after the publishes).
    let declared = ch
        .queue_declare(
            q.as_str().into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    assert_eq!(declared.message_count(), 7);
    let purged = ch
        .queue_purge(q.as_str().into(), QueuePurgeOptions::default())
        .await
        .unwrap();
    assert_eq!(purged, 7);
    assert!(ch
        .basic_get(q.as_str().into(), BasicGetOptions::default())
        .await
        .unwrap()
        .is_none());
    assert_eq!(
        ch.queue_purge(q.as_str().into(), QueuePurgeOptions::default())
            .await
            .unwrap(),
        0
    );
}

#[tokio::test]
async fn purge_leaves_unacked_messages_alone() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    let q = unique("q-purge-unacked");
    raw.declare_queue(1, &q).await;
    for b in [b"a", b"b", b"c"] {
        raw.publish(1, "", &q, false, Default::default(), b).await;
    }
    raw.wait_ready(1, &q, 3).await;
    let d = raw.get(1, &q, false).await.expect("a message");
    assert_eq!(d.body, b"a");
    match raw.call(1, m::queue_purge(&q)).await {
        AMQPClass::Queue(queue::AMQPMethod::PurgeOk(ok)) => assert_eq!(ok.message_count, 2),
        other => panic!("{other:?}"),
    }
    // The unacked one comes back when the channel closes.
    raw.call(1, m::channel_close()).await;
    raw.channel_open(1).await;
    let d = raw.get(1, &q, true).await.expect("requeued message");
    assert_eq!((d.body.as_slice(), d.redelivered()), (&b"a"[..], true));
}

#[tokio::test]
async fn delete_returns_message_count_and_removes_queue() {
    let broker = TestBroker::start();
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("q-delete");
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
    for _ in 0..4 {
        ch.basic_publish(
            "".into(),
            q.as_str().into(),
            BasicPublishOptions::default(),
            b"d",
            BasicProperties::default(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    }
    ch.queue_declare(
        q.as_str().into(),
        QueueDeclareOptions {
            passive: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    let n = ch
        .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    assert_eq!(n, 4);
    let res = ch
        .queue_declare(
            q.as_str().into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await;
    assert_amqp_error(
        res,
        404,
        &format!("NOT_FOUND - no queue '{q}' in vhost '/'"),
    );
}

#[tokio::test]
async fn delete_of_missing_queue_is_ok_with_zero() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    match raw
        .call(1, m::queue_delete(&unique("q-never"), false, false))
        .await
    {
        AMQPClass::Queue(queue::AMQPMethod::DeleteOk(ok)) => assert_eq!(ok.message_count, 0),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn delete_if_unused_and_if_empty_succeed_when_conditions_hold() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    let q = unique("q-del-cond");
    raw.declare_queue(1, &q).await;
    match raw.call(1, m::queue_delete(&q, true, true)).await {
        AMQPClass::Queue(queue::AMQPMethod::DeleteOk(ok)) => assert_eq!(ok.message_count, 0),
        other => panic!("{other:?}"),
    }
    raw.send(1, m::queue_declare(&q, passive())).await;
    raw.expect_channel_close(
        1,
        404,
        &format!("NOT_FOUND - no queue '{q}' in vhost '/'"),
        50,
        10,
    )
    .await;
}

#[tokio::test]
async fn delete_if_unused_on_queue_with_messages_but_no_consumer_succeeds() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    let q = unique("q-del-unused");
    raw.declare_queue(1, &q).await;
    raw.publish(1, "", &q, false, Default::default(), b"1")
        .await;
    raw.publish(1, "", &q, false, Default::default(), b"2")
        .await;
    raw.wait_ready(1, &q, 2).await;
    match raw.call(1, m::queue_delete(&q, true, false)).await {
        AMQPClass::Queue(queue::AMQPMethod::DeleteOk(ok)) => assert_eq!(ok.message_count, 2),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn queue_delete_cancels_its_consumers_for_lapin() {
    let broker = TestBroker::start();
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("q-del-consumed");
    ch.queue_declare(
        q.as_str().into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let mut consumer = ch
        .basic_consume(
            q.as_str().into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let other = conn.create_channel().await.unwrap();
    other
        .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    use futures_lite::StreamExt;
    // lapin ends the consumer stream when the server cancels it.
    let next = within(
        "the consumer stream to end after basic.cancel",
        consumer.next(),
    )
    .await;
    assert!(next.is_none(), "expected the stream to end, got {next:?}");
    assert!(
        ch.status().connected(),
        "server-sent basic.cancel must not close the channel"
    );
}

#[tokio::test]
async fn unbind_from_default_exchange_is_403() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    let q = unique("q-unbind-default");
    raw.declare_queue(1, &q).await;
    raw.send(1, m::queue_unbind(&q, "", &q)).await;
    raw.expect_channel_close(
        1,
        403,
        "ACCESS_REFUSED - operation not permitted on the default exchange",
        50,
        50,
    )
    .await;
}
