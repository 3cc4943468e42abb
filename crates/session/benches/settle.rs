//! Acking many unacked deliveries on one channel: in delivery order and in random order must
//! cost about the same (a single ack is O(log n) whatever its position).
//!
//! `cargo bench -p warren-session --bench settle`

use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, Criterion};
use warren_broker::{Broker, BrokerConfig};
use warren_codec::*;
use warren_session::{Node, SessionConfig, Transmit};

const UNACKED: u64 = 100_000;

fn frame(channel: u16, method: impl Into<Method>) -> Frame {
    Frame::Method {
        channel,
        method: method.into(),
    }
}

/// A node with one open connection and channel, `UNACKED` messages delivered to one consumer
/// and none acked yet.
fn loaded() -> Node {
    let mut node = Node::new(
        SessionConfig::default(),
        Broker::new(BrokerConfig::default()),
    );
    node.apply_config_users(true, &mut || [0, 1, 2, 3]);
    let mut out: Vec<Transmit> = Vec::new();
    node.connection_opened(1, Some("127.0.0.1:1".parse().expect("addr")), 0);
    node.handle_frame(
        1,
        frame(
            0,
            ConnectionStartOk {
                client_properties: FieldTable::default(),
                mechanism: ShortStr::from("PLAIN"),
                response: Bytes::from_static(b"\0guest\0guest"),
                locale: ShortStr::from("en_US"),
            },
        ),
        0,
    );
    node.handle_frame(
        1,
        frame(
            0,
            ConnectionTuneOk {
                channel_max: 0,
                frame_max: 131_072,
                heartbeat: 0,
            },
        ),
        0,
    );
    node.handle_frame(
        1,
        frame(
            0,
            ConnectionOpen {
                virtual_host: ShortStr::from("/"),
                ..Default::default()
            },
        ),
        0,
    );
    node.handle_frame(1, frame(1, ChannelOpen::default()), 0);
    node.handle_frame(
        1,
        frame(
            1,
            QueueDeclare {
                queue: ShortStr::from("q"),
                ..Default::default()
            },
        ),
        0,
    );
    let body = Bytes::from_static(b"0123456789abcdef");
    for _ in 0..UNACKED {
        node.handle_frame(
            1,
            frame(
                1,
                BasicPublish {
                    routing_key: ShortStr::from("q"),
                    ..Default::default()
                },
            ),
            0,
        );
        node.handle_frame(
            1,
            Frame::Header {
                channel: 1,
                header: ContentHeader {
                    class_id: 60,
                    weight: 0,
                    body_size: body.len() as u64,
                    properties: BasicProperties::default().encode(),
                },
            },
            0,
        );
        node.handle_frame(
            1,
            Frame::Body {
                channel: 1,
                payload: body.clone(),
            },
            0,
        );
    }
    node.handle_frame(
        1,
        frame(
            1,
            BasicConsume {
                queue: ShortStr::from("q"),
                consumer_tag: ShortStr::from("c"),
                ..Default::default()
            },
        ),
        0,
    );
    while node.needs_dispatch() {
        node.poll_transmit(0, &mut out);
        out.clear();
    }
    node.poll_transmit(0, &mut out);
    let id = node.broker().queue_id("/", "q").expect("queue");
    let info = node.broker().queue_info(id).expect("info");
    assert_eq!(
        u64::from(info.in_flight),
        UNACKED,
        "all delivered, none acked"
    );
    node
}

/// A fixed permutation of 1..=n (xorshift, so every run acks in the same order).
fn shuffled(n: u64) -> Vec<u64> {
    let mut tags: Vec<u64> = (1..=n).collect();
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    for i in (1..tags.len()).rev() {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        tags.swap(i, (state % (i as u64 + 1)) as usize);
    }
    tags
}

/// Acks every tag in `order`, one basic.ack each; returns the time the acks took.
fn ack_all(node: &mut Node, order: &[u64]) -> Duration {
    let start = Instant::now();
    for &tag in order {
        node.handle_frame(
            1,
            frame(
                1,
                BasicAck {
                    delivery_tag: tag,
                    multiple: false,
                },
            ),
            0,
        );
    }
    start.elapsed()
}

fn settle(c: &mut Criterion) {
    let in_order: Vec<u64> = (1..=UNACKED).collect();
    let random = shuffled(UNACKED);
    let mut g = c.benchmark_group("ack 100k unacked on one channel");
    g.sample_size(10);
    for (name, order) in [("in order", &in_order), ("random order", &random)] {
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let mut node = loaded();
                    total += ack_all(&mut node, order);
                    let id = node.broker().queue_id("/", "q").expect("queue");
                    assert_eq!(node.broker().queue_info(id).expect("info").in_flight, 0);
                }
                total
            })
        });
    }
    g.finish();
}

criterion_group!(benches, settle);
criterion_main!(benches);
