//! basic.publish (properties, mandatory, large and empty bodies), basic.consume (tags, exclusive, no-ack),
//! basic.cancel in both directions, basic.get, dispatch order and round-robin.

use futures_lite::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicGetOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue as LV, ByteArray, FieldArray, FieldTable as LFieldTable};
use lapin::{BasicProperties, Confirmation};
use warren_conformance::raw::protocol::{basic, AMQPClass};
use warren_conformance::raw::types::{AMQPValue, FieldTable};
use warren_conformance::raw::{client_properties, m, Handshake, Raw};
use warren_conformance::{unique, within, TestBroker, QUIET};

async fn get_one(raw: &mut Raw, ch: u16, q: &str) -> warren_conformance::raw::RawDelivery {
    let deadline = tokio::time::Instant::now() + warren_conformance::WAIT;
    loop {
        if let Some(d) = raw.get(ch, q, true).await {
            return d;
        }
        assert!(tokio::time::Instant::now() < deadline, "no message in {q}");
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn properties_and_headers_roundtrip_with_lapin() {
    let broker = TestBroker::start();
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("pc-props");
    ch.queue_declare(
        q.as_str().into(),
        QueueDeclareOptions::default(),
        LFieldTable::default(),
    )
    .await
    .unwrap();
    let mut headers = LFieldTable::default();
    headers.insert("bool".into(), LV::Boolean(true));
    headers.insert("i8".into(), LV::ShortShortInt(-8));
    headers.insert("i16".into(), LV::ShortInt(-1600));
    headers.insert("i32".into(), LV::LongInt(-320000));
    headers.insert("i64".into(), LV::LongLongInt(-6_400_000_000));
    headers.insert("f32".into(), LV::Float(1.5));
    headers.insert("f64".into(), LV::Double(2.25));
    headers.insert("str".into(), LV::LongString("hello".into()));
    headers.insert("ts".into(), LV::Timestamp(1_700_000_000));
    headers.insert(
        "bytes".into(),
        LV::ByteArray(ByteArray::from(vec![0u8, 1, 2, 255])),
    );
    headers.insert("void".into(), LV::Void);
    let mut arr = FieldArray::default();
    arr.push(LV::LongString("a".into()));
    arr.push(LV::LongInt(2));
    headers.insert("array".into(), LV::FieldArray(arr));
    let mut nested = LFieldTable::default();
    nested.insert("inner".into(), LV::LongString("x".into()));
    headers.insert("table".into(), LV::FieldTable(nested));
    let props = BasicProperties::default()
        .with_content_type("application/json".into())
        .with_content_encoding("gzip".into())
        .with_headers(headers)
        .with_delivery_mode(2)
        .with_priority(3)
        .with_correlation_id("corr-1".into())
        .with_reply_to("reply-q".into())
        .with_expiration("600000".into())
        .with_message_id("msg-1".into())
        .with_timestamp(1_700_000_123)
        .with_type("my-type".into())
        .with_user_id("guest".into())
        .with_app_id("conformance".into());
    ch.basic_publish(
        "".into(),
        q.as_str().into(),
        BasicPublishOptions::default(),
        b"{\"a\":1}",
        props.clone(),
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
    assert_eq!(msg.delivery.data, b"{\"a\":1}");
    assert_eq!(msg.delivery.properties, props);
}

/// Content properties travel byte for byte: key order, duplicate keys and type tags are kept.
#[tokio::test]
async fn property_bytes_are_forwarded_verbatim() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    let q = unique("pc-verbatim");
    raw.declare_queue(1, &q).await;

    let mut table = Vec::new();
    let mut entry = |key: &str, tag: u8, value: &[u8]| {
        table.push(key.len() as u8);
        table.extend_from_slice(key.as_bytes());
        table.push(tag);
        table.extend_from_slice(value);
    };
    let longstr = |s: &str| {
        let mut v = (s.len() as u32).to_be_bytes().to_vec();
        v.extend_from_slice(s.as_bytes());
        v
    };
    // Keys deliberately out of order, one duplicated, several type tags.
    entry("zz", b'S', &longstr("first key"));
    entry("aa", b'I', &42i32.to_be_bytes());
    entry("dup", b't', &[1]);
    entry("dup", b't', &[0]);
    entry("u32", b'i', &7u32.to_be_bytes());
    entry("i16", b's', &(-2i16).to_be_bytes());
    entry("f", b'd', &1.25f64.to_be_bytes());
    entry("bin", b'x', &longstr("\u{0}\u{1}"));
    entry("nothing", b'V', &[]);
    entry("dec", b'D', &[2, 0, 0, 1, 0x2c]);

    let mut props = Vec::new();
    // content-type, headers, delivery-mode, correlation-id, message-id, timestamp
    props
        .extend_from_slice(&(0x8000u16 | 0x2000 | 0x1000 | 0x0400 | 0x0080 | 0x0040).to_be_bytes());
    props.push(10);
    props.extend_from_slice(b"text/plain");
    props.extend_from_slice(&(table.len() as u32).to_be_bytes());
    props.extend_from_slice(&table);
    props.push(1);
    props.push(3);
    props.extend_from_slice(b"c-1");
    props.push(3);
    props.extend_from_slice(b"m-1");
    props.extend_from_slice(&1_700_000_000u64.to_be_bytes());

    raw.publish_with_property_bytes(1, "", &q, &props, b"verbatim")
        .await;
    let d = get_one(&mut raw, 1, &q).await;
    assert_eq!(d.body, b"verbatim");
    assert_eq!(
        d.property_bytes, props,
        "content properties must be forwarded byte for byte"
    );
}

#[tokio::test]
async fn empty_body_is_delivered_without_body_frames() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    let q = unique("pc-empty");
    raw.declare_queue(1, &q).await;
    raw.publish(1, "", &q, false, Default::default(), b"").await;
    let d = get_one(&mut raw, 1, &q).await;
    assert!(d.body.is_empty());
    assert!(
        d.body_frame_sizes.is_empty(),
        "no body frame for an empty body: {:?}",
        d.body_frame_sizes
    );
    // The next frame is a normal method, not a stray empty body frame.
    raw.declare_queue(1, &q).await;
}

#[tokio::test]
async fn large_message_is_split_into_frames_of_frame_max() {
    let broker = TestBroker::start();
    let body: Vec<u8> = (0..(1024 * 1024u32))
        .map(|i| (i.wrapping_mul(31) % 256) as u8)
        .collect();
    let q = unique("pc-large");

    // lapin publishes it (splitting at 131072) ...
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.queue_declare(
        q.as_str().into(),
        QueueDeclareOptions::default(),
        LFieldTable::default(),
    )
    .await
    .unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let confirm = ch
        .basic_publish(
            "".into(),
            q.as_str().into(),
            BasicPublishOptions::default(),
            &body,
            BasicProperties::default(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    assert_eq!(confirm, Confirmation::Ack(None));

    // ... and the raw client checks how the broker splits it on the way out.
    let mut raw = broker.raw().await;
    assert_eq!(raw.frame_max, 131072);
    raw.channel_open(1).await;
    let d = get_one(&mut raw, 1, &q).await;
    assert!(d.body == body, "1 MiB body corrupted");
    assert!(
        d.body_frame_sizes.iter().all(|&s| s <= 131072 - 8),
        "body frames larger than frame_max: {:?}",
        d.body_frame_sizes
    );
    assert!(d.body_frame_sizes.len() >= 9, "{:?}", d.body_frame_sizes);

    // lapin consumes a second copy.
    ch.basic_publish(
        "".into(),
        q.as_str().into(),
        BasicPublishOptions::default(),
        &body,
        BasicProperties::default(),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    let mut consumer = ch
        .basic_consume(
            q.as_str().into(),
            "".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            LFieldTable::default(),
        )
        .await
        .unwrap();
    let delivery = within("the large delivery", consumer.next())
        .await
        .unwrap()
        .unwrap();
    assert!(delivery.data == body);
}

#[tokio::test]
async fn mandatory_unroutable_message_is_returned_312() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    let rk = unique("pc-nowhere");
    let props = warren_conformance::raw::AMQPProperties::default().with_message_id("ret-1".into());
    raw.publish(1, "", &rk, true, props, b"come back").await;
    let d = raw.recv_delivery().await;
    match &d.method {
        AMQPClass::Basic(basic::AMQPMethod::Return(r)) => {
            assert_eq!(r.reply_code, 312);
            assert_eq!(r.reply_text.as_str(), "NO_ROUTE");
            assert_eq!(r.exchange.as_str(), "");
            assert_eq!(r.routing_key.as_str(), rk);
        }
        other => panic!("expected basic.return, got {other:?}"),
    }
    assert_eq!(d.channel, 1);
    assert_eq!(d.body, b"come back");
    assert_eq!(
        d.properties.message_id().as_ref().map(|s| s.as_str()),
        Some("ret-1")
    );
}

#[tokio::test]
async fn mandatory_routable_message_is_not_returned() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    let q = unique("pc-routable");
    raw.declare_queue(1, &q).await;
    raw.publish(1, "", &q, true, Default::default(), b"stays")
        .await;
    raw.expect_silence(QUIET).await;
    assert_eq!(get_one(&mut raw, 1, &q).await.body, b"stays");
}

#[tokio::test]
async fn non_mandatory_unroutable_message_is_dropped_silently() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    raw.publish(
        1,
        "",
        &unique("pc-nowhere"),
        false,
        Default::default(),
        b"gone",
    )
    .await;
    raw.expect_silence(QUIET).await;
    raw.declare_queue(1, &unique("pc-still-open")).await;
}

#[tokio::test]
async fn mandatory_return_with_lapin_confirm() {
    let broker = TestBroker::start();
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let confirm = ch
        .basic_publish(
            "".into(),
            unique("pc-nowhere").as_str().into(),
            BasicPublishOptions {
                mandatory: true,
                ..Default::default()
            },
            b"returned",
            BasicProperties::default(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    match confirm {
        Confirmation::Ack(Some(ret)) => {
            assert_eq!(ret.reply_code, 312);
            assert_eq!(ret.reply_text.as_str(), "NO_ROUTE");
            assert_eq!(ret.delivery.data, b"returned");
        }
        other => panic!("expected an ack carrying the returned message, got {other:?}"),
    }
}

#[tokio::test]
async fn consume_with_empty_tag_gets_server_generated_amq_ctag() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    let q = unique("pc-ctag");
    raw.declare_queue(1, &q).await;
    let tag1 = match raw.call(1, m::basic_consume(&q, "", true, false)).await {
        AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(ok)) => ok.consumer_tag.to_string(),
        other => panic!("{other:?}"),
    };
    let tag2 = match raw.call(1, m::basic_consume(&q, "", true, false)).await {
        AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(ok)) => ok.consumer_tag.to_string(),
        other => panic!("{other:?}"),
    };
    assert!(tag1.starts_with("amq.ctag-"), "{tag1}");
    assert!(tag2.starts_with("amq.ctag-"), "{tag2}");
    assert_ne!(tag1, tag2);
    raw.publish(1, "", &q, false, Default::default(), b"x")
        .await;
    let d = raw.recv_delivery().await;
    assert!([tag1.as_str(), tag2.as_str()].contains(&d.consumer_tag().as_str()));
}

#[tokio::test]
async fn deliver_carries_tag_exchange_routing_key_and_counts_tags_from_1() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    let q = unique("pc-deliver");
    raw.declare_queue(1, &q).await;
    match raw
        .call(1, m::basic_consume(&q, "my-tag", false, false))
        .await
    {
        AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(ok)) => {
            assert_eq!(ok.consumer_tag.as_str(), "my-tag")
        }
        other => panic!("{other:?}"),
    }
    for i in 1..=3u64 {
        raw.publish(
            1,
            "",
            &q,
            false,
            Default::default(),
            format!("m{i}").as_bytes(),
        )
        .await;
        let d = raw.recv_delivery().await;
        match &d.method {
            AMQPClass::Basic(basic::AMQPMethod::Deliver(del)) => {
                assert_eq!(del.consumer_tag.as_str(), "my-tag");
                assert_eq!(del.delivery_tag, i);
                assert!(!del.redelivered);
                assert_eq!(del.exchange.as_str(), "");
                assert_eq!(del.routing_key.as_str(), q);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(d.body, format!("m{i}").as_bytes());
    }
}

#[tokio::test]
async fn messages_are_delivered_in_publish_order() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    let q = unique("pc-fifo");
    raw.declare_queue(1, &q).await;
    for i in 0..100 {
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
    raw.call(1, m::basic_consume(&q, "c", true, false)).await;
    for i in 0..100 {
        assert_eq!(raw.recv_delivery().await.body, format!("{i}").as_bytes());
    }
}

#[tokio::test]
async fn no_ack_consumer_deliveries_are_settled_on_send() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    raw.channel_open(2).await;
    let q = unique("pc-noack");
    raw.declare_queue(1, &q).await;
    for _ in 0..3 {
        raw.publish(1, "", &q, false, Default::default(), b"n")
            .await;
    }
    raw.call(2, m::basic_consume(&q, "c", true, false)).await;
    for _ in 0..3 {
        raw.recv_delivery().await;
    }
    // Closing the consumer's channel puts nothing back.
    raw.call(2, m::channel_close()).await;
    raw.wait_ready(1, &q, 0).await;
    raw.expect_silence(QUIET).await;
    raw.wait_ready(1, &q, 0).await;
}

#[tokio::test]
async fn cancel_stops_deliveries() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    let q = unique("pc-cancel");
    raw.declare_queue(1, &q).await;
    raw.call(1, m::basic_consume(&q, "c1", true, false)).await;
    raw.publish(1, "", &q, false, Default::default(), b"before")
        .await;
    assert_eq!(raw.recv_delivery().await.body, b"before");
    match raw.call(1, m::basic_cancel("c1")).await {
        AMQPClass::Basic(basic::AMQPMethod::CancelOk(ok)) => {
            assert_eq!(ok.consumer_tag.as_str(), "c1")
        }
        other => panic!("{other:?}"),
    }
    raw.publish(1, "", &q, false, Default::default(), b"after")
        .await;
    raw.wait_ready(1, &q, 1).await;
    raw.expect_silence(QUIET).await;
}

#[tokio::test]
async fn cancel_of_unknown_tag_is_answered_with_cancel_ok() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    match raw.call(1, m::basic_cancel("never-was")).await {
        AMQPClass::Basic(basic::AMQPMethod::CancelOk(ok)) => {
            assert_eq!(ok.consumer_tag.as_str(), "never-was")
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn queue_deletion_sends_basic_cancel_to_consumers() {
    let broker = TestBroker::start();
    let mut consumer = broker.raw().await;
    consumer.channel_open(1).await;
    let q = unique("pc-srv-cancel");
    consumer.declare_queue(1, &q).await;
    consumer
        .call(1, m::basic_consume(&q, "watch", false, false))
        .await;

    let mut admin = broker.raw().await;
    admin.channel_open(1).await;
    admin.call(1, m::queue_delete(&q, false, false)).await;

    match consumer.recv_method().await {
        (1, AMQPClass::Basic(basic::AMQPMethod::Cancel(c))) => {
            assert_eq!(c.consumer_tag.as_str(), "watch");
        }
        other => panic!("expected basic.cancel on channel 1, got {other:?}"),
    }
    // The channel stays open.
    consumer.declare_queue(1, &unique("pc-after-cancel")).await;
}

#[tokio::test]
async fn no_basic_cancel_for_clients_without_consumer_cancel_notify() {
    let broker = TestBroker::start();
    let mut props = client_properties();
    let caps = FieldTable::default(); // no capabilities at all
    props.insert("capabilities".into(), AMQPValue::FieldTable(caps));
    let mut consumer = Raw::open_with(
        broker.addr(),
        Handshake {
            client_properties: props,
            ..Handshake::default()
        },
    )
    .await;
    consumer.channel_open(1).await;
    let q = unique("pc-no-notify");
    consumer.declare_queue(1, &q).await;
    consumer
        .call(1, m::basic_consume(&q, "quiet", false, false))
        .await;

    let mut admin = broker.raw().await;
    admin.channel_open(1).await;
    admin.call(1, m::queue_delete(&q, false, false)).await;

    consumer.expect_silence(QUIET).await;
    consumer.declare_queue(1, &unique("pc-after")).await;
}

#[tokio::test]
async fn get_empty_and_get_ok_message_count() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    let q = unique("pc-get");
    raw.declare_queue(1, &q).await;
    assert!(raw.get(1, &q, true).await.is_none());
    for b in [b"1", b"2", b"3"] {
        raw.publish(1, "", &q, false, Default::default(), b).await;
    }
    raw.wait_ready(1, &q, 3).await;
    for (expected_body, remaining) in [(b"1", 2u32), (b"2", 1), (b"3", 0)] {
        let d = raw.get(1, &q, false).await.expect("a message");
        match &d.method {
            AMQPClass::Basic(basic::AMQPMethod::GetOk(ok)) => {
                assert_eq!(ok.message_count, remaining);
                assert_eq!(ok.exchange.as_str(), "");
                assert_eq!(ok.routing_key.as_str(), q);
                assert!(!ok.redelivered);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(d.body, expected_body);
    }
    assert!(raw.get(1, &q, true).await.is_none());
}

#[tokio::test]
async fn round_robin_among_consumers() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    let q = unique("pc-rr");
    raw.declare_queue(1, &q).await;
    for tag in ["a", "b", "c"] {
        raw.call(1, m::basic_consume(&q, tag, true, false)).await;
    }
    for i in 0..30 {
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
    let mut tags = Vec::new();
    for _ in 0..30 {
        tags.push(raw.recv_delivery().await.consumer_tag());
    }
    for tag in ["a", "b", "c"] {
        assert_eq!(
            tags.iter().filter(|t| t.as_str() == tag).count(),
            10,
            "deliveries: {tags:?}"
        );
    }
    // Strict rotation: no consumer gets two in a row.
    assert!(
        tags.windows(2).all(|w| w[0] != w[1]),
        "not round-robin: {tags:?}"
    );
}

#[tokio::test]
async fn round_robin_with_lapin_consumers_on_separate_connections() {
    let broker = TestBroker::start();
    let q = unique("pc-rr-lapin");
    let mut consumers = Vec::new();
    let mut conns = Vec::new();
    for _ in 0..2 {
        let conn = broker.connect().await;
        let ch = conn.create_channel().await.unwrap();
        ch.queue_declare(
            q.as_str().into(),
            QueueDeclareOptions::default(),
            LFieldTable::default(),
        )
        .await
        .unwrap();
        ch.basic_qos(10, BasicQosOptions::default()).await.unwrap();
        let c = ch
            .basic_consume(
                q.as_str().into(),
                "".into(),
                BasicConsumeOptions::default(),
                LFieldTable::default(),
            )
            .await
            .unwrap();
        consumers.push(c);
        conns.push((conn, ch));
    }
    let pubch = conns[0].0.create_channel().await.unwrap();
    for i in 0..10 {
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
    let mut counts = [0; 2];
    for (i, c) in consumers.iter_mut().enumerate() {
        for _ in 0..5 {
            let d = within("a delivery", c.next()).await.unwrap().unwrap();
            d.ack(BasicAckOptions::default()).await.unwrap();
            counts[i] += 1;
        }
    }
    assert_eq!(counts, [5, 5]);
}
