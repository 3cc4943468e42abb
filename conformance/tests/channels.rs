//! Channels: open/close handshakes in both directions, channel.flow, the discard rule after a server-sent
//! channel.close, isolation between channels.

use warren_conformance::raw::frame::AMQPFrame;
use warren_conformance::raw::protocol::{channel, queue, AMQPClass};
use warren_conformance::raw::{encode, m, AMQPProperties, QueueFlags};
use warren_conformance::{assert_amqp_error, unique, TestBroker, QUIET};

use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;

#[tokio::test]
async fn channel_open_close_and_reopen_same_number() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    match raw.call(1, m::channel_close()).await {
        AMQPClass::Channel(channel::AMQPMethod::CloseOk(_)) => {}
        other => panic!("{other:?}"),
    }
    raw.channel_open(1).await;
    raw.declare_queue(1, &unique("ch-reopen")).await;
    raw.close().await;
}

#[tokio::test]
async fn many_channels_on_one_connection() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    for ch in 1..=200u16 {
        raw.channel_open(ch).await;
    }
    // The highest channel number allowed by channel_max 2047 works too.
    raw.channel_open(2047).await;
    raw.close().await;
}

#[tokio::test]
async fn channel_open_twice_is_504() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    raw.send(1, m::channel_open()).await;
    raw.expect_connection_close(504, "CHANNEL_ERROR - second 'channel.open' seen", 20, 10)
        .await;
}

#[tokio::test]
async fn channel_flow_active_true_is_acknowledged() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    match raw.call(1, m::channel_flow(true)).await {
        AMQPClass::Channel(channel::AMQPMethod::FlowOk(ok)) => assert!(ok.active),
        other => panic!("{other:?}"),
    }
    // The channel still works.
    raw.declare_queue(1, &unique("ch-flow")).await;
}

// channel.flow active=false (540) is in errors.rs with the other reference rows.

/// After the server sends channel.close it must ignore everything the client sends on that channel until
/// close-ok (spec 0-9-1, channel.close), content included; then the channel number can be reused.
#[tokio::test]
async fn after_server_channel_close_only_close_ok_is_accepted() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    raw.channel_open(2).await;
    let target = unique("ch-discard-target");
    raw.declare_queue(2, &target).await;
    let discarded1 = unique("ch-discard-1");
    let discarded2 = unique("ch-discard-2");
    let missing = unique("ch-missing");

    // Provoke a channel error and keep talking on that channel without waiting for the close.
    raw.send(
        1,
        m::queue_declare(
            &missing,
            QueueFlags {
                passive: true,
                ..Default::default()
            },
        ),
    )
    .await;
    raw.send(1, m::queue_declare(&discarded1, QueueFlags::default()))
        .await;
    raw.publish(
        1,
        "",
        &target,
        false,
        Default::default(),
        b"must be discarded",
    )
    .await;
    let close = raw.recv_channel_close_only(1).await;
    assert_eq!(close.reply_code, 404);
    assert_eq!(
        close.reply_text.as_str(),
        format!("NOT_FOUND - no queue '{missing}' in vhost '/'")
    );

    // More traffic before close-ok: all of it ignored, no reply at all.
    raw.send(1, m::queue_declare(&discarded2, QueueFlags::default()))
        .await;
    raw.publish(1, "", &target, false, Default::default(), b"also discarded")
        .await;
    raw.send(1, m::basic_get(&target, true)).await;
    // (channel.open is the exception: RabbitMQ answers it with 504 "second 'channel.open' seen".)
    raw.expect_silence(QUIET).await;

    raw.send(1, m::channel_close_ok()).await;
    raw.channel_open(1).await;

    // Nothing sent in between had any effect.
    for name in [&discarded1, &discarded2] {
        raw.channel_open(3).await;
        raw.send(
            3,
            m::queue_declare(
                name,
                QueueFlags {
                    passive: true,
                    ..Default::default()
                },
            ),
        )
        .await;
        raw.expect_channel_close(
            3,
            404,
            &format!("NOT_FOUND - no queue '{name}' in vhost '/'"),
            50,
            10,
        )
        .await;
    }
    match raw
        .call(
            2,
            m::queue_declare(
                &target,
                QueueFlags {
                    passive: true,
                    ..Default::default()
                },
            ),
        )
        .await
    {
        AMQPClass::Queue(queue::AMQPMethod::DeclareOk(ok)) => {
            assert_eq!(
                ok.message_count, 0,
                "publishes after channel.close must be discarded"
            )
        }
        other => panic!("{other:?}"),
    }
    raw.close().await;
}

#[tokio::test]
async fn channel_error_leaves_other_channels_open() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    raw.channel_open(2).await;
    let missing = unique("ch-missing");
    raw.send(
        1,
        m::queue_declare(
            &missing,
            QueueFlags {
                passive: true,
                ..Default::default()
            },
        ),
    )
    .await;
    raw.expect_channel_close(
        1,
        404,
        &format!("NOT_FOUND - no queue '{missing}' in vhost '/'"),
        50,
        10,
    )
    .await;
    raw.declare_queue(2, &unique("ch-other")).await;
    raw.close().await;
}

#[tokio::test]
async fn client_channel_close_with_pending_deliveries_gets_close_ok() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    let q = unique("ch-pending");
    raw.declare_queue(1, &q).await;
    for i in 0..50 {
        raw.publish(
            1,
            "",
            &q,
            false,
            Default::default(),
            format!("m{i}").as_bytes(),
        )
        .await;
    }
    raw.call(1, m::basic_consume(&q, "c1", false, false)).await;
    // Deliveries may be in flight when the client closes; the server must still answer close-ok.
    raw.send(1, m::channel_close()).await;
    loop {
        let (ch, method) = raw.recv_method().await;
        assert_eq!(ch, 1);
        match method {
            AMQPClass::Channel(channel::AMQPMethod::CloseOk(_)) => break,
            AMQPClass::Basic(_) => {
                // A delivery sent before the server saw our close: skip its content.
                raw.recv_content(1, method).await;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    raw.close().await;
}

#[tokio::test]
async fn lapin_channel_error_closes_only_that_channel() {
    let broker = TestBroker::start();
    let conn = broker.connect().await;
    let ch1 = conn.create_channel().await.unwrap();
    let ch2 = conn.create_channel().await.unwrap();
    let missing = unique("ch-missing");
    let res = ch1
        .queue_declare(
            missing.as_str().into(),
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
        &format!("NOT_FOUND - no queue '{missing}' in vhost '/'"),
    );
    assert!(!ch1.status().connected());
    ch2.queue_declare(
        unique("ch-ok").as_str().into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .expect("the other channel still works");
    assert!(conn.status().connected());
    let ch3 = conn.create_channel().await.unwrap();
    ch3.queue_declare(
        unique("ch-ok").as_str().into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
}

/// amqp091-go's Publish to a missing exchange followed at once by Channel.Close: the client's close
/// crosses the broker's 404 close. The broker answers the client's close, ends the channel when the
/// client's close-ok for its own close arrives, and leaves every other channel working (RabbitMQ
/// does the same).
#[tokio::test]
async fn crossing_channel_closes_leave_other_channels_working() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    raw.channel_open(2).await;
    let mut both = raw.encode_publish(
        1,
        &unique("missing-x"),
        "k",
        false,
        AMQPProperties::default(),
        b"",
    );
    // The publish and the close go out in one write, before the broker's close can be read.
    both.extend_from_slice(&encode(&AMQPFrame::Method(1, m::channel_close())));
    raw.send_bytes(&both).await;
    let mut got = Vec::new();
    for _ in 0..2 {
        got.push(raw.recv_method().await);
    }
    match &got[0] {
        (1, AMQPClass::Channel(channel::AMQPMethod::Close(c))) => assert_eq!(c.reply_code, 404),
        other => panic!("expected the broker's channel.close 404, got {other:?}"),
    }
    assert!(
        matches!(
            got[1],
            (1, AMQPClass::Channel(channel::AMQPMethod::CloseOk(_)))
        ),
        "{got:?}"
    );
    raw.send(1, m::channel_close_ok()).await;
    raw.call(2, m::exchange_declare(&unique("x"), "direct", false, false))
        .await;
    raw.channel_open(1).await;
    raw.declare_queue(1, &unique("after-crossing")).await;
    raw.close().await;
}
