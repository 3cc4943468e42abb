//! The node driven frame by frame with simulated time: no sockets, no sleeps.

mod frame_max;
mod held_moves;
mod props;
mod tx;

use bytes::{Bytes, BytesMut};
use warren_broker::{Broker, BrokerConfig};
use warren_codec::*;

use crate::{Node, SessionConfig, Transmit};

const CONN: u64 = 1;

struct Client {
    node: Node,
    now: u64,
    decoder: FrameDecoder,
    closed: bool,
    received: Vec<Frame>,
    /// The largest frame the node sent, overhead included.
    largest_frame: usize,
}

impl Client {
    fn connect_from(config: SessionConfig, peer: &str) -> Client {
        Client::connect_with(config, peer, Broker::new(BrokerConfig::default()))
    }

    fn connect_with(config: SessionConfig, peer: &str, broker: Broker) -> Client {
        let mut node = Node::new(config, broker);
        let fresh = node.broker().access().is_empty();
        node.apply_config_users(fresh, &mut || [0, 1, 2, 3]);
        node.connection_opened(CONN, Some(peer.parse().unwrap()), 0);
        Client {
            node,
            now: 0,
            decoder: FrameDecoder::new(131_072),
            closed: false,
            received: Vec::new(),
            largest_frame: 0,
        }
    }

    fn start_ok(&mut self, user: &str, password: &str) {
        let start = self.recv_method();
        assert!(matches!(start, Method::ConnectionStart(_)), "{start:?}");
        self.send(
            0,
            ConnectionStartOk {
                client_properties: client_properties(),
                mechanism: ShortStr::from("PLAIN"),
                response: Bytes::from(format!("\0{user}\0{password}")),
                locale: ShortStr::from("en_US"),
            },
        );
    }

    /// A fully opened connection, as a client library leaves it.
    fn open_with(config: SessionConfig) -> Client {
        Client::open_with_broker(config, Broker::new(BrokerConfig::default()))
    }

    fn open_with_broker(config: SessionConfig, broker: Broker) -> Client {
        Client::open_tuned(config, broker, None)
    }

    /// Opened with the client's own frame_max in tune-ok (`None`: the server's).
    fn open_tuned(config: SessionConfig, broker: Broker, frame_max: Option<u32>) -> Client {
        let mut c = Client::connect_with(config, "127.0.0.1:40000", broker);
        c.start_ok("guest", "guest");
        let tune = c.recv_method();
        let Method::ConnectionTune(t) = tune else {
            panic!("{tune:?}")
        };
        c.send(
            0,
            ConnectionTuneOk {
                channel_max: t.channel_max,
                frame_max: frame_max.unwrap_or(t.frame_max),
                heartbeat: t.heartbeat,
            },
        );
        c.send(
            0,
            ConnectionOpen {
                virtual_host: ShortStr::from("/"),
                ..Default::default()
            },
        );
        assert!(matches!(c.recv_method(), Method::ConnectionOpenOk(_)));
        c
    }

    fn open() -> Client {
        Client::open_with(SessionConfig::default())
    }

    fn send(&mut self, channel: u16, method: impl Into<Method>) {
        self.node.handle_frame(
            CONN,
            Frame::Method {
                channel,
                method: method.into(),
            },
            self.now,
        );
    }

    fn channel(&mut self, channel: u16) {
        self.send(channel, ChannelOpen::default());
        assert!(matches!(self.recv_method(), Method::ChannelOpenOk(_)));
    }

    /// basic.publish and its content header; the body frames, if any, are the caller's.
    fn publish_header(
        &mut self,
        channel: u16,
        publish: BasicPublish,
        body_size: u64,
        properties: Bytes,
    ) {
        self.send(channel, publish);
        self.node.handle_frame(
            CONN,
            Frame::Header {
                channel,
                header: ContentHeader {
                    class_id: 60,
                    weight: 0,
                    body_size,
                    properties,
                },
            },
            self.now,
        );
    }

    fn publish_props(&mut self, channel: u16, routing_key: &str, body: &[u8], properties: Bytes) {
        let publish = BasicPublish {
            routing_key: ShortStr::from_string(routing_key.to_string()),
            ..Default::default()
        };
        self.publish_header(channel, publish, body.len() as u64, properties);
        if !body.is_empty() {
            self.node.handle_frame(
                CONN,
                Frame::Body {
                    channel,
                    payload: Bytes::copy_from_slice(body),
                },
                self.now,
            );
        }
    }

    fn publish(&mut self, channel: u16, routing_key: &str, body: &[u8]) {
        self.publish_props(
            channel,
            routing_key,
            body,
            BasicProperties::default().encode(),
        );
    }

    fn declare(&mut self, channel: u16, name: &str) {
        self.send(
            channel,
            QueueDeclare {
                queue: ShortStr::from_string(name.to_string()),
                ..Default::default()
            },
        );
        assert!(matches!(self.recv_method(), Method::QueueDeclareOk(_)));
    }

    /// Everything the node wants written, decoded.
    fn pump(&mut self) {
        let mut out: Vec<Transmit> = Vec::new();
        self.node.poll_transmit(self.now, &mut out);
        for t in out {
            // Frame by frame as written, whatever the decoder below would tolerate.
            let mut rest = &t.bytes[..];
            while rest.len() >= FRAME_HEADER_LEN {
                let size = u32::from_be_bytes([rest[3], rest[4], rest[5], rest[6]]) as usize;
                let len = (size + FRAME_OVERHEAD).min(rest.len());
                self.largest_frame = self.largest_frame.max(len);
                rest = &rest[len..];
            }
            let mut buf = BytesMut::from(&t.bytes[..]);
            while let Some(f) = self.decoder.decode(&mut buf).unwrap() {
                self.received.push(f);
            }
            assert!(buf.is_empty());
            if t.close {
                self.closed = true;
            }
        }
    }

    fn frames(&mut self) -> Vec<Frame> {
        self.pump();
        std::mem::take(&mut self.received)
    }

    fn recv_method(&mut self) -> Method {
        self.pump();
        assert!(!self.received.is_empty(), "nothing received");
        match self.received.remove(0) {
            Frame::Method { method, .. } => method,
            other => panic!("expected a method, got {other:?}"),
        }
    }

    /// Deliveries received as (delivery tag, body, redelivered).
    fn deliveries(&mut self) -> Vec<(u64, Bytes, bool)> {
        let mut got = Vec::new();
        let mut pending: Option<(u64, bool)> = None;
        for f in self.frames() {
            match f {
                Frame::Method {
                    method: Method::BasicDeliver(d),
                    ..
                } => pending = Some((d.delivery_tag, d.redelivered)),
                Frame::Method {
                    method: Method::BasicGetOk(d),
                    ..
                } => pending = Some((d.delivery_tag, d.redelivered)),
                Frame::Body { payload, .. } => {
                    let (tag, redelivered) = pending.take().unwrap();
                    got.push((tag, payload, redelivered));
                }
                Frame::Header { header, .. } if header.body_size == 0 => {
                    let (tag, redelivered) = pending.take().unwrap();
                    got.push((tag, Bytes::new(), redelivered));
                }
                _ => {}
            }
        }
        got
    }

    fn consume(&mut self, channel: u16, queue: &str, no_ack: bool) -> ShortStr {
        self.send(
            channel,
            BasicConsume {
                queue: ShortStr::from_string(queue.to_string()),
                no_ack,
                ..Default::default()
            },
        );
        match self.recv_method() {
            Method::BasicConsumeOk(ok) => ok.consumer_tag,
            other => panic!("{other:?}"),
        }
    }

    fn qos(&mut self, channel: u16, prefetch_count: u16, global: bool) {
        self.send(
            channel,
            BasicQos {
                prefetch_count,
                global,
                ..Default::default()
            },
        );
        assert!(matches!(self.recv_method(), Method::BasicQosOk(_)));
    }
}

fn client_properties() -> FieldTable {
    let mut caps = FieldTable::default();
    caps.insert(
        ShortStr::from("consumer_cancel_notify"),
        FieldValue::Bool(true),
    );
    let mut props = FieldTable::default();
    props.insert(ShortStr::from("capabilities"), FieldValue::Table(caps));
    props
}

fn expect_channel_close(m: Method, code: u16, text: &str, class_id: u16, method_id: u16) {
    let Method::ChannelClose(c) = m else {
        panic!("expected channel.close, got {m:?}")
    };
    assert_eq!(
        (c.reply_code, c.reply_text.as_str(), c.class_id, c.method_id),
        (code, text, class_id, method_id)
    );
}

fn expect_connection_close(m: Method, code: u16, text: &str, class_id: u16, method_id: u16) {
    let Method::ConnectionClose(c) = m else {
        panic!("expected connection.close, got {m:?}")
    };
    assert_eq!(
        (c.reply_code, c.reply_text.as_str(), c.class_id, c.method_id),
        (code, text, class_id, method_id)
    );
}

#[test]
fn handshake_advertises_rabbitmq_capabilities_and_defaults() {
    let mut c = Client::connect_from(SessionConfig::default(), "127.0.0.1:40000");
    let Method::ConnectionStart(start) = c.recv_method() else {
        panic!()
    };
    assert_eq!((start.version_major, start.version_minor), (0, 9));
    assert_eq!(&start.mechanisms[..], b"PLAIN AMQPLAIN");
    let Some(FieldValue::Table(caps)) = start.server_properties.get("capabilities") else {
        panic!()
    };
    for cap in [
        "publisher_confirms",
        "basic.nack",
        "consumer_cancel_notify",
        "per_consumer_qos",
        "authentication_failure_close",
    ] {
        assert_eq!(caps.get(cap), Some(&FieldValue::Bool(true)), "{cap}");
    }
    c.received.clear();
    c.send(
        0,
        ConnectionStartOk {
            client_properties: FieldTable::default(),
            mechanism: ShortStr::from("PLAIN"),
            response: Bytes::from_static(b"\0guest\0guest"),
            locale: ShortStr::from("en_US"),
        },
    );
    let Method::ConnectionTune(t) = c.recv_method() else {
        panic!()
    };
    assert_eq!(
        (t.channel_max, t.frame_max, t.heartbeat),
        (2047, 131_072, 60)
    );
}

/// The management API shows what the client sent in start-ok, and keeping it does not keep
/// the buffer it was read into: a decoded table's strings are slices of that buffer, which is
/// kilobytes for a few hundred bytes of properties.
#[test]
fn client_properties_are_kept_without_pinning_the_read_buffer() {
    let mut sent = client_properties();
    sent.insert(
        ShortStr::from("connection_name"),
        FieldValue::long_str("orders-worker"),
    );
    let mut wire = BytesMut::new();
    sent.encode(&mut wire);
    wire.extend_from_slice(&[0u8; 4096]);
    let read_buffer = wire.freeze();
    let decoded = FieldTable::decode(&mut read_buffer.clone()).unwrap();
    assert!(
        !read_buffer.is_unique(),
        "the decoded table refers to the buffer"
    );

    let mut c = Client::connect_from(SessionConfig::default(), "127.0.0.1:40000");
    assert!(matches!(c.recv_method(), Method::ConnectionStart(_)));
    c.send(
        0,
        ConnectionStartOk {
            client_properties: decoded,
            mechanism: ShortStr::from("PLAIN"),
            response: Bytes::from_static(b"\0guest\0guest"),
            locale: ShortStr::from("en_US"),
        },
    );
    assert!(matches!(c.recv_method(), Method::ConnectionTune(_)));
    assert!(
        read_buffer.is_unique(),
        "the connection still holds the read buffer"
    );
    let snapshots = c.node.connection_snapshots();
    assert_eq!(snapshots.len(), 1);
    assert_eq!(snapshots[0].client_properties, sent);
}

#[test]
fn wrong_password_is_refused_with_rabbitmq_text_and_the_socket_closes() {
    let mut c = Client::connect_from(SessionConfig::default(), "127.0.0.1:40000");
    c.start_ok("guest", "wrong");
    expect_connection_close(
        c.recv_method(),
        403,
        "ACCESS_REFUSED - Login was refused using authentication mechanism PLAIN. For details see the broker logfile.",
        0,
        0,
    );
    assert!(c.closed);
}

#[test]
fn guest_cannot_log_in_from_a_remote_address() {
    let mut c = Client::connect_from(SessionConfig::default(), "192.0.2.7:40000");
    c.start_ok("guest", "guest");
    let Method::ConnectionClose(close) = c.recv_method() else {
        panic!()
    };
    assert_eq!(close.reply_code, 403);
}

#[test]
fn missing_vhost_is_530() {
    let mut c = Client::connect_from(SessionConfig::default(), "127.0.0.1:40000");
    c.start_ok("guest", "guest");
    c.recv_method();
    c.send(
        0,
        ConnectionTuneOk {
            channel_max: 0,
            frame_max: 131_072,
            heartbeat: 0,
        },
    );
    c.send(
        0,
        ConnectionOpen {
            virtual_host: ShortStr::from("novhost"),
            ..Default::default()
        },
    );
    expect_connection_close(
        c.recv_method(),
        530,
        "NOT_ALLOWED - vhost novhost not found",
        10,
        40,
    );
}

#[test]
fn publish_get_ack_and_unknown_tag() {
    let mut c = Client::open();
    c.channel(1);
    c.declare(1, "q");
    c.publish(1, "q", b"hello");
    c.send(
        1,
        BasicGet {
            queue: ShortStr::from("q"),
            no_ack: false,
            ..Default::default()
        },
    );
    let got = c.deliveries();
    assert_eq!(got, vec![(1, Bytes::from_static(b"hello"), false)]);
    c.send(
        1,
        BasicAck {
            delivery_tag: 1,
            multiple: false,
        },
    );
    c.send(
        1,
        BasicGet {
            queue: ShortStr::from("q"),
            ..Default::default()
        },
    );
    assert!(matches!(c.recv_method(), Method::BasicGetEmpty(_)));
    c.send(
        1,
        BasicAck {
            delivery_tag: 1,
            multiple: false,
        },
    );
    expect_channel_close(
        c.recv_method(),
        406,
        "PRECONDITION_FAILED - unknown delivery tag 1",
        60,
        80,
    );
}

#[test]
fn prefetch_limits_a_consumer_until_it_acks() {
    let mut c = Client::open();
    c.channel(1);
    c.declare(1, "q");
    for i in 0..5u8 {
        c.publish(1, "q", &[i]);
    }
    c.qos(1, 2, false);
    c.consume(1, "q", false);
    let first = c.deliveries();
    assert_eq!(first.len(), 2);
    c.send(
        1,
        BasicAck {
            delivery_tag: 2,
            multiple: true,
        },
    );
    let second = c.deliveries();
    assert_eq!(second.iter().map(|d| d.0).collect::<Vec<_>>(), vec![3, 4]);
    assert_eq!(second[0].1, Bytes::from_static(&[2]));
}

#[test]
fn global_prefetch_is_shared_by_the_channel_consumers() {
    let mut c = Client::open();
    c.channel(1);
    c.declare(1, "a");
    c.declare(1, "b");
    for i in 0..3u8 {
        c.publish(1, "a", &[i]);
        c.publish(1, "b", &[i]);
    }
    c.qos(1, 3, true);
    for q in ["a", "b"] {
        c.send(
            1,
            BasicConsume {
                queue: ShortStr::from(q),
                ..Default::default()
            },
        );
    }
    assert_eq!(c.deliveries().len(), 3);
    c.send(
        1,
        BasicAck {
            delivery_tag: 0,
            multiple: true,
        },
    );
    assert_eq!(c.deliveries().len(), 3);
}

#[test]
fn closing_a_channel_requeues_its_unacked_at_their_original_position() {
    let mut c = Client::open();
    c.channel(1);
    c.channel(2);
    c.declare(1, "q");
    for i in 0..3u8 {
        c.publish(1, "q", &[i]);
    }
    c.qos(2, 2, false);
    c.consume(2, "q", false);
    assert_eq!(c.deliveries().len(), 2);
    c.send(2, ChannelClose::default());
    assert!(matches!(c.recv_method(), Method::ChannelCloseOk(_)));
    let mut got = Vec::new();
    for _ in 0..3 {
        c.send(
            1,
            BasicGet {
                queue: ShortStr::from("q"),
                no_ack: true,
                ..Default::default()
            },
        );
        got.extend(c.deliveries());
    }
    let bodies: Vec<(u8, bool)> = got.iter().map(|d| (d.1[0], d.2)).collect();
    assert_eq!(bodies, vec![(0, true), (1, true), (2, false)]);
}

#[test]
fn connection_loss_requeues_and_deletes_exclusive_queues() {
    let mut c = Client::open();
    c.channel(1);
    c.declare(1, "shared");
    c.send(
        1,
        QueueDeclare {
            queue: ShortStr::from("mine"),
            exclusive: true,
            ..Default::default()
        },
    );
    c.recv_method();
    c.publish(1, "shared", b"x");
    c.consume(1, "shared", false);
    assert_eq!(c.deliveries().len(), 1);
    c.node.connection_lost(CONN);
    let broker = c.node.broker();
    assert!(broker.queue_id("/", "mine").is_none());
    let id = broker.queue_id("/", "shared").unwrap();
    assert_eq!(broker.queue_info(id).unwrap().message_count, 1);
}

#[test]
fn after_channel_close_only_close_ok_is_read() {
    let mut c = Client::open();
    c.channel(1);
    c.send(
        1,
        BasicGet {
            queue: ShortStr::from("nope"),
            ..Default::default()
        },
    );
    expect_channel_close(
        c.recv_method(),
        404,
        "NOT_FOUND - no queue 'nope' in vhost '/'",
        60,
        70,
    );
    // Ignored: the channel is closing.
    c.send(
        1,
        QueueDeclare {
            queue: ShortStr::from("q"),
            ..Default::default()
        },
    );
    assert!(c.frames().is_empty());
    assert!(c.node.broker().queue_id("/", "q").is_none());
    c.send(1, ChannelCloseOk {});
    c.channel(1);
}

/// Publishes to a missing exchange on channel 1 and sends the client's own channel.close before
/// reading the broker's (as amqp091-go's Publish then Close does): the two closes cross. Returns the
/// methods the broker sent.
fn cross_closes(c: &mut Client) -> Vec<Method> {
    c.channel(1);
    c.channel(2);
    let publish = BasicPublish {
        exchange: ShortStr::from("missing"),
        routing_key: ShortStr::from("k"),
        ..Default::default()
    };
    c.publish_header(1, publish, 0, BasicProperties::default().encode());
    client_close(c, 1);
    let methods: Vec<Method> = c
        .frames()
        .into_iter()
        .filter_map(|f| match f {
            Frame::Method { method, .. } => Some(method),
            _ => None,
        })
        .collect();
    assert_eq!(methods.len(), 2, "{methods:?}");
    expect_channel_close(
        methods[0].clone(),
        404,
        "NOT_FOUND - no exchange 'missing' in vhost '/'",
        60,
        40,
    );
    assert!(
        matches!(methods[1], Method::ChannelCloseOk(_)),
        "{methods:?}"
    );
    methods
}

/// The client's own channel.close (reply 200).
fn client_close(c: &mut Client, channel: u16) {
    c.send(
        channel,
        ChannelClose {
            reply_code: 200,
            reply_text: ShortStr::from("bye"),
            class_id: 0,
            method_id: 0,
        },
    );
}

fn declare_exchange_works(c: &mut Client, channel: u16, name: &str) {
    c.send(
        channel,
        ExchangeDeclare {
            exchange: ShortStr::from_string(name.to_string()),
            kind: ShortStr::from("direct"),
            ..Default::default()
        },
    );
    assert!(matches!(c.recv_method(), Method::ExchangeDeclareOk(_)));
}

#[test]
fn crossing_channel_closes_leave_the_connection_alone() {
    let mut c = Client::open();
    cross_closes(&mut c);
    // The client answers the broker's close, as clients do; that ends the channel quietly.
    c.send(1, ChannelCloseOk {});
    assert!(c.frames().is_empty());
    // Channel 2 still works, and channel 1 opens again.
    declare_exchange_works(&mut c, 2, "x");
    c.channel(1);
    declare_exchange_works(&mut c, 1, "x1");
}

#[test]
fn a_client_that_takes_a_crossing_close_as_its_close_ok_can_reopen_the_channel() {
    let mut c = Client::open();
    cross_closes(&mut c);
    // A second close from the client is not answered twice.
    client_close(&mut c, 1);
    assert!(c.frames().is_empty());
    // No close-ok from this client: it opens channel 1 again straight away.
    c.channel(1);
    declare_exchange_works(&mut c, 1, "y");
    declare_exchange_works(&mut c, 2, "z");
}

#[test]
fn confirms_are_coalesced_into_one_multiple_ack() {
    let mut c = Client::open();
    c.channel(1);
    c.declare(1, "q");
    c.send(1, ConfirmSelect { no_wait: false });
    assert!(matches!(c.recv_method(), Method::ConfirmSelectOk(_)));
    for _ in 0..3 {
        c.publish(1, "q", b"m");
    }
    let acks: Vec<(u64, bool)> = c
        .frames()
        .into_iter()
        .filter_map(|f| match f {
            Frame::Method {
                method: Method::BasicAck(a),
                ..
            } => Some((a.delivery_tag, a.multiple)),
            _ => None,
        })
        .collect();
    assert_eq!(acks, vec![(3, true)]);
}

#[test]
fn mandatory_unroutable_comes_back_before_its_confirm() {
    let mut c = Client::open();
    c.channel(1);
    c.send(1, ConfirmSelect { no_wait: false });
    c.recv_method();
    c.publish_header(
        1,
        BasicPublish {
            routing_key: ShortStr::from("nowhere"),
            mandatory: true,
            ..Default::default()
        },
        0,
        BasicProperties::default().encode(),
    );
    let frames = c.frames();
    let Frame::Method {
        method: Method::BasicReturn(r),
        ..
    } = &frames[0]
    else {
        panic!("{frames:?}")
    };
    assert_eq!((r.reply_code, r.reply_text.as_str()), (312, "NO_ROUTE"));
    assert!(matches!(
        frames.last(),
        Some(Frame::Method {
            method: Method::BasicAck(_),
            ..
        })
    ));
}

#[test]
fn reusing_a_consumer_tag_closes_the_connection() {
    let mut c = Client::open();
    c.channel(1);
    c.declare(1, "q");
    c.send(
        1,
        BasicConsume {
            queue: ShortStr::from("q"),
            consumer_tag: ShortStr::from("t1"),
            ..Default::default()
        },
    );
    c.recv_method();
    c.send(
        1,
        BasicConsume {
            queue: ShortStr::from("q"),
            consumer_tag: ShortStr::from("t1"),
            ..Default::default()
        },
    );
    expect_connection_close(
        c.recv_method(),
        530,
        "NOT_ALLOWED - attempt to reuse consumer tag 't1'",
        60,
        20,
    );
}

#[test]
fn methods_on_an_unopened_channel_are_a_channel_error() {
    let mut c = Client::open();
    c.send(
        3,
        QueueDeclare {
            queue: ShortStr::from("q"),
            ..Default::default()
        },
    );
    expect_connection_close(
        c.recv_method(),
        504,
        "CHANNEL_ERROR - expected 'channel.open'",
        50,
        10,
    );
}

#[test]
fn content_without_a_publish_is_an_unexpected_frame() {
    let mut c = Client::open();
    c.channel(1);
    c.node.handle_frame(
        CONN,
        Frame::Body {
            channel: 1,
            payload: Bytes::from_static(b"x"),
        },
        0,
    );
    let Method::ConnectionClose(close) = c.recv_method() else {
        panic!()
    };
    assert_eq!(close.reply_code, 505);
}

#[test]
fn multi_frame_bodies_are_reassembled() {
    let mut c = Client::open();
    c.channel(1);
    c.declare(1, "q");
    c.publish_header(
        1,
        BasicPublish {
            routing_key: ShortStr::from("q"),
            ..Default::default()
        },
        6,
        BasicProperties::default().encode(),
    );
    for part in [&b"ab"[..], b"cd", b"ef"] {
        c.node.handle_frame(
            CONN,
            Frame::Body {
                channel: 1,
                payload: Bytes::copy_from_slice(part),
            },
            0,
        );
    }
    c.send(
        1,
        BasicGet {
            queue: ShortStr::from("q"),
            no_ack: true,
            ..Default::default()
        },
    );
    assert_eq!(c.deliveries()[0].1, Bytes::from_static(b"abcdef"));
}

#[test]
fn an_oversized_message_is_refused_from_its_header() {
    let config = SessionConfig {
        max_message_size: 10,
        ..SessionConfig::default()
    };
    let mut c = Client::open_with(config);
    c.channel(1);
    c.publish_header(
        1,
        BasicPublish {
            routing_key: ShortStr::from("q"),
            ..Default::default()
        },
        11,
        BasicProperties::default().encode(),
    );
    expect_channel_close(
        c.recv_method(),
        406,
        "PRECONDITION_FAILED - message size 11 is larger than configured max size 10",
        60,
        40,
    );
}

/// A connection through the handshake that negotiated a 1 s heartbeat.
fn open_with_heartbeat_1s() -> Client {
    let mut c = Client::connect_from(SessionConfig::default(), "127.0.0.1:40000");
    c.start_ok("guest", "guest");
    c.recv_method();
    c.send(
        0,
        ConnectionTuneOk {
            channel_max: 0,
            frame_max: 131_072,
            heartbeat: 1,
        },
    );
    c.send(
        0,
        ConnectionOpen {
            virtual_host: ShortStr::from("/"),
            ..Default::default()
        },
    );
    c.recv_method();
    c
}

#[test]
fn heartbeats_are_sent_and_a_silent_client_is_dropped() {
    let mut c = open_with_heartbeat_1s();
    c.now = 600;
    c.node.tick(c.now);
    assert!(matches!(
        c.frames().as_slice(),
        [Frame::Heartbeat { channel: 0 }]
    ));
    c.now = 1999;
    c.node.tick(c.now);
    c.pump();
    assert!(!c.closed);
    c.now = 2000;
    c.node.tick(c.now);
    c.pump();
    assert!(c.closed);
}

#[test]
fn a_client_held_during_recovery_is_not_dropped_for_its_silence() {
    let mut c = open_with_heartbeat_1s();
    // The server holds the client's frames while recovery runs: its heartbeats go unread.
    c.node.set_recovering(true, c.now);
    c.now = 10_000;
    c.node.tick(c.now);
    c.pump();
    assert!(!c.closed, "dropped for a silence that was ours");
    // A deadline left in the past would bring the timer straight back, a busy loop for as
    // long as the client is held (seen under a long disk alarm).
    assert!(
        c.node.next_deadline().is_some_and(|at| at > c.now),
        "next deadline {:?} is not after {}",
        c.node.next_deadline(),
        c.now
    );
    c.node.set_recovering(false, c.now);
    c.now = 11_999;
    c.node.tick(c.now);
    c.pump();
    assert!(!c.closed, "counted as heard from when recovery ended");
    c.now = 12_000;
    c.node.tick(c.now);
    c.pump();
    assert!(c.closed, "then silent for two intervals");
}

#[test]
fn a_deleted_queue_cancels_its_consumers() {
    let mut c = Client::open();
    c.channel(1);
    c.declare(1, "q");
    let tag = c.consume(1, "q", false);
    c.send(
        1,
        QueueDelete {
            queue: ShortStr::from("q"),
            ..Default::default()
        },
    );
    let frames = c.frames();
    let cancel = frames.iter().find_map(|f| match f {
        Frame::Method {
            method: Method::BasicCancel(b),
            ..
        } => Some(b.consumer_tag.clone()),
        _ => None,
    });
    assert_eq!(cancel, Some(tag));
}

#[test]
fn shutdown_sends_connection_forced() {
    let mut c = Client::open();
    c.node.shutdown(0);
    expect_connection_close(
        c.recv_method(),
        320,
        "CONNECTION_FORCED - broker forced connection closure with reason 'shutdown'",
        0,
        0,
    );
}

#[test]
fn direct_reply_to_round_trip() {
    let mut c = Client::open();
    c.channel(1);
    c.channel(2);
    c.declare(2, "rpc");
    let tag = c.consume(1, "amq.rabbitmq.reply-to", true);
    let props = BasicProperties {
        reply_to: Some(ShortStr::from("amq.rabbitmq.reply-to")),
        correlation_id: Some(ShortStr::from("42")),
        ..Default::default()
    };
    c.publish_props(1, "rpc", b"ping", props.encode());
    c.send(
        2,
        BasicGet {
            queue: ShortStr::from("rpc"),
            no_ack: true,
            ..Default::default()
        },
    );
    let frames = c.frames();
    let header = frames
        .iter()
        .find_map(|f| match f {
            Frame::Header { header, .. } => Some(header.clone()),
            _ => None,
        })
        .unwrap();
    let request = BasicProperties::decode(&header.properties).unwrap();
    let address = request.reply_to.unwrap();
    assert!(address.starts_with("amq.rabbitmq.reply-to."), "{address}");
    assert_eq!(request.correlation_id.as_deref(), Some("42"));
    c.publish(2, &address, b"pong");
    let frames = c.frames();
    let Frame::Method {
        channel: 1,
        method: Method::BasicDeliver(d),
    } = &frames[0]
    else {
        panic!("{frames:?}")
    };
    assert_eq!(d.consumer_tag, tag);
    assert!(matches!(&frames[2], Frame::Body { payload, .. } if &payload[..] == b"pong"));
    // A forged address reaches nobody.
    c.publish(2, "amq.rabbitmq.reply-to.1.1.forged", b"x");
    assert!(c.frames().is_empty());
}

#[test]
fn reply_to_without_a_reply_consumer_is_refused() {
    let mut c = Client::open();
    c.channel(1);
    let props = BasicProperties {
        reply_to: Some(ShortStr::from("amq.rabbitmq.reply-to")),
        ..Default::default()
    };
    c.publish_props(1, "rpc", b"ping", props.encode());
    expect_channel_close(
        c.recv_method(),
        406,
        "PRECONDITION_FAILED - fast reply consumer does not exist",
        60,
        40,
    );
}

#[test]
fn a_backed_up_socket_gets_no_deliveries_until_it_drains() {
    let mut c = Client::open();
    c.channel(1);
    c.declare(1, "q");
    c.node.set_write_blocked(CONN, true);
    c.publish(1, "q", b"a");
    c.consume(1, "q", true);
    assert!(c.deliveries().is_empty());
    c.node.set_write_blocked(CONN, false);
    assert_eq!(c.deliveries().len(), 1);
}

/// A client of a node whose broker writes to a store (the test plays the store), with a durable
/// queue "q" on channel 1.
fn persistent_client() -> Client {
    let broker = Broker::new(BrokerConfig {
        persistence: true,
        ..BrokerConfig::default()
    });
    let mut c = Client::open_with_broker(SessionConfig::default(), broker);
    c.channel(1);
    c.send(
        1,
        QueueDeclare {
            queue: ShortStr::from("q"),
            durable: true,
            ..Default::default()
        },
    );
    assert!(matches!(c.recv_method(), Method::QueueDeclareOk(_)));
    c
}

fn persistent_props() -> Bytes {
    BasicProperties {
        delivery_mode: Some(2),
        ..Default::default()
    }
    .encode()
}

/// Publisher acks and nacks received: (ack?, tag, multiple).
fn confirms(frames: Vec<Frame>) -> Vec<(bool, u64, bool)> {
    frames
        .into_iter()
        .filter_map(|f| match f {
            Frame::Method {
                method: Method::BasicAck(a),
                ..
            } => Some((true, a.delivery_tag, a.multiple)),
            Frame::Method {
                method: Method::BasicNack(n),
                ..
            } => Some((false, n.delivery_tag, n.multiple)),
            _ => None,
        })
        .collect()
}

#[test]
fn a_persistent_publish_is_confirmed_only_once_its_write_is_done() {
    let mut c = persistent_client();
    c.send(1, ConfirmSelect { no_wait: false });
    assert!(matches!(c.recv_method(), Method::ConfirmSelectOk(_)));
    c.publish_props(1, "q", b"on disk", persistent_props());
    // A transient publish behind it waits too: a multiple ack must not cover tag 1 early.
    c.publish(1, "q", b"in memory");
    assert_eq!(confirms(c.frames()), vec![]);
    let batch = c
        .node
        .take_writes()
        .expect("a write for the persistent message");
    assert!(batch.sync);
    c.now += 7;
    c.node.writes_done(batch.number, true, c.now);
    assert_eq!(confirms(c.frames()), vec![(true, 2, true)]);
    // Both confirms waited 7 ms: the (5, 10] bucket.
    let h = c.node.confirm_latency();
    assert_eq!((h.count, h.sum_ms, h.buckets[3]), (2, 14, 2));
    // A confirm that waits for nothing counts as 0 ms.
    c.publish(1, "q", b"in memory");
    assert_eq!(confirms(c.frames()), vec![(true, 3, false)]);
    let h = c.node.confirm_latency();
    assert_eq!((h.count, h.buckets[0]), (3, 1));
}

#[test]
fn a_failed_write_nacks_its_publishes_and_releases_the_rest() {
    let mut c = persistent_client();
    c.send(1, ConfirmSelect { no_wait: false });
    assert!(matches!(c.recv_method(), Method::ConfirmSelectOk(_)));
    c.publish_props(1, "q", b"lost", persistent_props());
    c.publish(1, "q", b"in memory");
    let batch = c.node.take_writes().expect("a write");
    c.node.writes_done(batch.number, false, c.now);
    assert_eq!(
        confirms(c.frames()),
        vec![(false, 1, false), (true, 2, false)]
    );
}

/// Publisher confirms by channel: (channel, ack?, tag).
fn confirms_by_channel(frames: Vec<Frame>) -> Vec<(u16, bool, u64)> {
    frames
        .into_iter()
        .filter_map(|f| match f {
            Frame::Method {
                channel,
                method: Method::BasicAck(a),
            } => Some((channel, true, a.delivery_tag)),
            Frame::Method {
                channel,
                method: Method::BasicNack(n),
            } => Some((channel, false, n.delivery_tag)),
            _ => None,
        })
        .collect()
}

#[test]
fn a_duplicate_is_confirmed_with_its_first_copys_write_and_a_failed_write_leaves_its_retry_new() {
    let mut c = persistent_client();
    let mut arguments = FieldTable::new();
    arguments.insert("x-message-deduplication", FieldValue::Bool(true));
    c.send(
        1,
        QueueDeclare {
            queue: ShortStr::from("jobs"),
            durable: true,
            arguments,
            ..Default::default()
        },
    );
    assert!(matches!(c.recv_method(), Method::QueueDeclareOk(_)));
    c.channel(2);
    for ch in [1, 2] {
        c.send(ch, ConfirmSelect { no_wait: false });
        assert!(matches!(c.recv_method(), Method::ConfirmSelectOk(_)));
    }
    let _ = c.node.take_writes();
    let props = BasicProperties {
        delivery_mode: Some(2),
        message_id: Some(ShortStr::from("m-1")),
        ..Default::default()
    }
    .encode();
    c.publish_props(1, "jobs", b"first", props.clone());
    // Another publisher's copy of the same message, while the first is not on disk yet.
    c.publish_props(2, "jobs", b"again", props.clone());
    assert_eq!(
        confirms_by_channel(c.frames()),
        vec![],
        "confirmed before the disk"
    );
    let batch = c.node.take_writes().expect("the first copy's write");
    c.node.writes_done(batch.number, false, c.now);
    assert_eq!(
        confirms_by_channel(c.frames()),
        vec![(1, false, 1), (2, false, 1)],
        "both nacked with the write"
    );
    // The retry is a new message, confirmed with its own write.
    c.publish_props(2, "jobs", b"retry", props.clone());
    assert_eq!(confirms_by_channel(c.frames()), vec![]);
    let batch = c.node.take_writes().expect("the retry's write");
    c.node.writes_done(batch.number, true, c.now);
    assert_eq!(confirms_by_channel(c.frames()), vec![(2, true, 2)]);
    // Now on disk: a duplicate is confirmed at once, and dropped.
    c.publish_props(1, "jobs", b"late", props);
    assert_eq!(confirms_by_channel(c.frames()), vec![(1, true, 2)]);
    let id = c.node.broker().queue_id("/", "jobs").expect("jobs");
    let ready = c.node.broker().queue_info(id).expect("info").message_count;
    assert_eq!(
        ready, 2,
        "the first copy stays (the store may yet write it) and the retry"
    );
}

/// The management API's move marks what it moves: a dedup target that saw the key keeps it.
#[test]
fn a_move_into_a_dedup_queue_that_saw_the_key_keeps_the_message() {
    let mut c = persistent_client();
    let mut arguments = FieldTable::new();
    arguments.insert("x-message-deduplication", FieldValue::Bool(true));
    c.send(
        1,
        QueueDeclare {
            queue: ShortStr::from("jobs"),
            durable: true,
            arguments,
            ..Default::default()
        },
    );
    assert!(matches!(c.recv_method(), Method::QueueDeclareOk(_)));
    let props = BasicProperties {
        delivery_mode: Some(2),
        message_id: Some(ShortStr::from("m-1")),
        ..Default::default()
    }
    .encode();
    c.publish_props(1, "jobs", b"done once", props.clone());
    let b = c.node.broker_mut();
    let (d, _) = b.get("/", "jobs", false, 1).unwrap().expect("the job");
    assert!(b.settle(d.queue, d.receipt));
    c.publish_props(1, "q", b"a copy elsewhere", props);
    let moved = c.node.move_messages("/", "q", "jobs", 10, c.now).unwrap();
    assert_eq!(moved, 1);
    let b = c.node.broker();
    let ready = |q: &str| {
        b.queue_info(b.queue_id("/", q).unwrap())
            .unwrap()
            .message_count
    };
    assert_eq!(
        (ready("q"), ready("jobs")),
        (0, 1),
        "moved into neither queue"
    );
}

#[test]
fn tx_commit_ok_waits_for_the_write_of_its_persistent_messages() {
    let mut c = persistent_client();
    c.send(1, TxSelect {});
    assert!(matches!(c.recv_method(), Method::TxSelectOk(_)));
    c.publish_props(1, "q", b"committed", persistent_props());
    c.send(1, TxCommit {});
    assert!(c.frames().is_empty(), "commit-ok before the write");
    let batch = c.node.take_writes().expect("a write");
    c.node.writes_done(batch.number, true, c.now);
    assert!(matches!(c.recv_method(), Method::TxCommitOk(_)));
}

#[test]
fn a_failed_write_fails_the_commit_waiting_for_it() {
    let mut c = persistent_client();
    c.send(1, TxSelect {});
    assert!(matches!(c.recv_method(), Method::TxSelectOk(_)));
    c.publish_props(1, "q", b"committed", persistent_props());
    c.send(1, TxCommit {});
    let batch = c.node.take_writes().expect("a write");
    // No commit-ok for messages that may not be on disk, and no client left waiting while
    // the disk is failing: the commit fails as RabbitMQ fails one a queue could not take.
    c.node.writes_done(batch.number, false, c.now);
    expect_channel_close(
        c.recv_method(),
        406,
        "PRECONDITION_FAILED - partial tx completion",
        90,
        20,
    );
    // A retry that succeeds later does not answer the failed commit.
    c.node.writes_done(batch.number, true, c.now);
    assert!(c.frames().is_empty());
}

#[test]
fn commit_oks_keep_their_order_behind_one_waiting_for_the_disk() {
    let mut c = persistent_client();
    c.send(1, TxSelect {});
    assert!(matches!(c.recv_method(), Method::TxSelectOk(_)));
    c.publish_props(1, "q", b"committed", persistent_props());
    c.send(1, TxCommit {});
    // A pipelining client commits again at once, this time with nothing to write: its
    // commit-ok must not overtake the first one's.
    c.publish(1, "q", b"in memory");
    c.send(1, TxCommit {});
    assert!(c.frames().is_empty(), "a commit-ok ahead of the first");
    let batch = c.node.take_writes().expect("a write");
    c.node.writes_done(batch.number, true, c.now);
    let oks = c
        .frames()
        .into_iter()
        .filter(|f| {
            matches!(
                f,
                Frame::Method {
                    method: Method::TxCommitOk(_),
                    ..
                }
            )
        })
        .count();
    assert_eq!(oks, 2);
}

impl Client {
    fn declare_args(&mut self, channel: u16, name: &str, arguments: FieldTable) {
        self.send(
            channel,
            QueueDeclare {
                queue: ShortStr::from_string(name.to_string()),
                arguments,
                ..Default::default()
            },
        );
        assert!(matches!(self.recv_method(), Method::QueueDeclareOk(_)));
    }

    /// Time passes by `ms` on the node's clock.
    fn advance(&mut self, ms: u64) {
        self.now += ms;
        self.node.tick(self.now);
    }
}

fn visibility(ms: i32) -> FieldTable {
    let mut t = FieldTable::new();
    t.insert("x-visibility-timeout", FieldValue::I32(ms));
    t
}

#[test]
fn a_timed_out_delivery_frees_its_place_in_a_global_prefetch() {
    let mut c = Client::open();
    c.channel(1);
    c.declare_args(1, "jobs", visibility(100));
    for i in 0..2u8 {
        c.publish(1, "jobs", &[i]);
    }
    c.qos(1, 1, true);
    c.consume(1, "jobs", false);
    let first = c.deliveries();
    assert_eq!(first.len(), 1);
    c.advance(50);
    assert!(
        c.deliveries().is_empty(),
        "the channel's one place is taken"
    );
    // The delivery times out: its message comes back, and the channel may take one again.
    c.advance(60);
    let next = c.deliveries();
    assert_eq!(next.len(), 1, "{next:?}");
    assert_eq!(
        next[0].1,
        Bytes::from_static(&[0]),
        "the timed-out message first"
    );
    assert!(next[0].2, "redelivered");
    // The late ack of the first delivery is no error.
    c.send(
        1,
        BasicAck {
            delivery_tag: first[0].0,
            multiple: false,
        },
    );
    assert!(c.frames().is_empty(), "no channel.close for a late ack");
}

#[test]
fn a_worker_that_never_acks_keeps_a_bounded_channel() {
    let mut c = Client::open();
    c.channel(1);
    c.declare_args(1, "stuck", visibility(10));
    c.publish(1, "stuck", b"job");
    c.qos(1, 1, false);
    c.consume(1, "stuck", false);
    let mut first_tag = None;
    for _ in 0..5_000 {
        let got = c.deliveries();
        assert_eq!(got.len(), 1);
        first_tag.get_or_insert(got[0].0);
        c.advance(11);
    }
    let unacked = c
        .node
        .channel(CONN, 1)
        .map(|ch| ch.unacked.len())
        .unwrap_or_default();
    assert!(
        (4_000..=4_200).contains(&unacked),
        "timed-out deliveries kept: {unacked}"
    );
    // Even a forgotten delivery's ack is not an error.
    c.send(
        1,
        BasicAck {
            delivery_tag: first_tag.unwrap_or(1),
            multiple: false,
        },
    );
    assert!(c.frames().iter().all(|f| !matches!(
        f,
        Frame::Method {
            method: Method::ChannelClose(_),
            ..
        }
    )));
}
