//! No frame larger than the connection's frame_max, whatever the broker added to a message.

use super::*;

const FRAME_MAX: u32 = 4096;

/// Properties with one header, padded so that their content header frame is `frame_len`
/// bytes, overhead included.
fn props_for_header_frame(frame_len: usize) -> Bytes {
    let build = |n: usize| {
        let mut headers = FieldTable::default();
        headers.insert(
            ShortStr::from("filler"),
            FieldValue::long_str("f".repeat(n)),
        );
        BasicProperties {
            headers: Some(headers),
            ..Default::default()
        }
        .encode()
    };
    let probe = build(0);
    let props = build(frame_len - content_header_frame_len(probe.len()));
    assert_eq!(content_header_frame_len(props.len()), frame_len);
    props
}

fn small_frames_client() -> Client {
    let mut c = Client::open_tuned(
        SessionConfig::default(),
        Broker::new(BrokerConfig::default()),
        Some(FRAME_MAX),
    );
    c.channel(1);
    c
}

/// The deliveries' headers as received: (delivery tag, headers).
fn delivered_headers(frames: Vec<Frame>) -> Vec<(u64, FieldTable)> {
    let mut got = Vec::new();
    let mut tag = None;
    for f in frames {
        match f {
            Frame::Method {
                method: Method::BasicDeliver(d),
                ..
            } => tag = Some(d.delivery_tag),
            Frame::Header { header, .. } => {
                let props = header.basic_properties().unwrap();
                got.push((tag.take().unwrap(), props.headers.unwrap_or_default()));
            }
            _ => {}
        }
    }
    got
}

#[test]
fn a_redelivery_too_large_with_its_delivery_count_goes_without_it() {
    let mut c = small_frames_client();
    let mut args = FieldTable::default();
    args.insert(
        ShortStr::from("x-queue-type"),
        FieldValue::long_str("quorum"),
    );
    c.send(
        1,
        QueueDeclare {
            queue: ShortStr::from("qq"),
            durable: true,
            arguments: args,
            ..Default::default()
        },
    );
    assert!(matches!(c.recv_method(), Method::QueueDeclareOk(_)));
    // 10 bytes under frame_max: x-delivery-count (27 bytes) does not fit in them.
    c.publish_props(
        1,
        "qq",
        b"near the limit",
        props_for_header_frame(FRAME_MAX as usize - 10),
    );
    c.consume(1, "qq", false);
    let first = delivered_headers(c.frames());
    assert_eq!(first.len(), 1);
    c.send(
        1,
        BasicNack {
            delivery_tag: first[0].0,
            multiple: false,
            requeue: true,
        },
    );
    let again = delivered_headers(c.frames());
    assert_eq!(again.len(), 1, "the redelivery went out");
    assert!(again[0].1.get("filler").is_some());
    assert!(again[0].1.get("x-delivery-count").is_none());
    assert!(
        c.largest_frame <= FRAME_MAX as usize,
        "a frame of {} bytes",
        c.largest_frame
    );
}

#[test]
fn a_dead_letter_too_large_for_its_consumer_stays_in_its_queue() {
    let mut c = small_frames_client();
    let mut args = FieldTable::default();
    args.insert(
        ShortStr::from("x-dead-letter-exchange"),
        FieldValue::long_str(""),
    );
    args.insert(
        ShortStr::from("x-dead-letter-routing-key"),
        FieldValue::long_str("dlq"),
    );
    c.declare_args(1, "work", args);
    c.declare(1, "dlq");
    c.publish_props(
        1,
        "work",
        b"poison",
        props_for_header_frame(FRAME_MAX as usize - 50),
    );
    c.consume(1, "work", false);
    let first = delivered_headers(c.frames());
    assert_eq!(first.len(), 1);
    c.send(
        1,
        BasicReject {
            delivery_tag: first[0].0,
            requeue: false,
        },
    );
    // With x-death the header no longer fits: the consumer of dlq does not get it.
    c.channel(2);
    c.send(
        2,
        BasicConsume {
            queue: ShortStr::from("dlq"),
            ..Default::default()
        },
    );
    assert!(matches!(c.recv_method(), Method::BasicConsumeOk(_)));
    let Method::ChannelClose(close) = c.recv_method() else {
        panic!("expected channel.close")
    };
    assert_eq!(close.reply_code, 406);
    assert!(
        close.reply_text.as_str().starts_with(
            "PRECONDITION_FAILED - message in queue 'dlq' in vhost '/' needs a content header frame of"
        ),
        "{}",
        close.reply_text
    );
    c.send(2, ChannelCloseOk {});
    let ready = |c: &Client| {
        let b = c.node.broker();
        b.queue_info(b.queue_id("/", "dlq").unwrap())
            .unwrap()
            .message_count
    };
    assert_eq!(ready(&c), 1, "the message left its queue");
    // basic.get, no-ack (the queue forgets what it hands out): refused the same way, and the
    // message is kept.
    c.channel(3);
    c.send(
        3,
        BasicGet {
            queue: ShortStr::from("dlq"),
            no_ack: true,
            ..Default::default()
        },
    );
    let Method::ChannelClose(close) = c.recv_method() else {
        panic!("expected channel.close")
    };
    assert_eq!(
        (close.reply_code, close.class_id, close.method_id),
        (406, 60, 70)
    );
    assert_eq!(ready(&c), 1, "the no-ack get lost the message");
    c.send(3, ChannelCloseOk {});
    // A no-ack consumer too.
    c.channel(4);
    c.consume(4, "dlq", true);
    let Method::ChannelClose(close) = c.recv_method() else {
        panic!("expected channel.close")
    };
    assert_eq!(close.reply_code, 406);
    assert_eq!(ready(&c), 1, "the no-ack delivery lost the message");
    assert!(
        c.largest_frame <= FRAME_MAX as usize,
        "a frame of {} bytes",
        c.largest_frame
    );
}
