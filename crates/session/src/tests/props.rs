//! Random client behaviour against the node: it never panics, and when the client goes away nothing it
//! held stays held — every message is back in its queue, no consumer is left behind.

use bytes::Bytes;
use proptest::prelude::*;
use warren_broker::{Broker, BrokerConfig};
use warren_codec::*;

use crate::{Node, SessionConfig, Transmit};

const QUEUES: [&str; 3] = ["a", "b", ""];
const TAGS: [&str; 3] = ["t1", "t2", ""];

fn name(i: usize, set: &[&'static str]) -> ShortStr {
    ShortStr::from(set[i % set.len()])
}

fn method() -> impl Strategy<Value = Method> {
    let q = 0..QUEUES.len();
    let t = 0..TAGS.len();
    prop_oneof![
        3 => (q.clone(), prop::bool::weighted(0.1), prop::bool::weighted(0.1)).prop_map(|(q, exclusive, auto_delete)| Method::from(QueueDeclare {
            queue: name(q, &QUEUES), exclusive, auto_delete, ..Default::default()
        })),
        1 => (q.clone(), any::<bool>(), any::<bool>()).prop_map(|(q, if_unused, if_empty)| Method::from(QueueDelete {
            queue: name(q, &QUEUES), if_unused, if_empty, ..Default::default()
        })),
        1 => q.clone().prop_map(|q| Method::from(QueuePurge { queue: name(q, &QUEUES), ..Default::default() })),
        1 => (q.clone(), any::<bool>()).prop_map(|(q, mandatory)| Method::from(BasicPublish {
            routing_key: name(q, &QUEUES), mandatory, ..Default::default()
        })),
        3 => (q.clone(), t.clone(), any::<bool>(), any::<bool>()).prop_map(|(q, t, no_ack, exclusive)| Method::from(BasicConsume {
            queue: name(q, &QUEUES), consumer_tag: name(t, &TAGS), no_ack, exclusive, ..Default::default()
        })),
        1 => t.prop_map(|t| Method::from(BasicCancel { consumer_tag: name(t, &TAGS), no_wait: false })),
        2 => (q, any::<bool>()).prop_map(|(q, no_ack)| Method::from(BasicGet { queue: name(q, &QUEUES), no_ack, ..Default::default() })),
        4 => (0u64..4, any::<bool>()).prop_map(|(delivery_tag, multiple)| Method::from(BasicAck { delivery_tag, multiple })),
        2 => (0u64..4, any::<bool>(), any::<bool>()).prop_map(|(delivery_tag, multiple, requeue)| Method::from(BasicNack { delivery_tag, multiple, requeue })),
        1 => (0u64..4, any::<bool>()).prop_map(|(delivery_tag, requeue)| Method::from(BasicReject { delivery_tag, requeue })),
        2 => (0u16..4, any::<bool>()).prop_map(|(prefetch_count, global)| Method::from(BasicQos { prefetch_count, global, ..Default::default() })),
        1 => Just(Method::from(BasicRecover { requeue: true })),
        1 => Just(Method::from(ConfirmSelect { no_wait: false })),
        1 => Just(Method::from(TxSelect {})),
        1 => Just(Method::from(TxCommit {})),
        1 => Just(Method::from(TxRollback {})),
    ]
}

#[derive(Debug, Clone)]
enum Step {
    Method(u16, Method),
    /// A whole publish: method, header and body frames.
    Publish(u16, usize, usize),
    Header(u16, u64),
    Body(u16, usize),
    Tick(u64),
    /// The client closes a channel and opens it again.
    Reopen(u16),
    /// The driver drains output (dispatch runs here).
    Flush,
    /// The client's socket goes away; it connects again as a new connection.
    Reconnect,
}

fn step() -> impl Strategy<Value = Step> {
    let ch = 1u16..4;
    prop_oneof![
        40 => (ch.clone(), method()).prop_map(|(c, m)| Step::Method(c, m)),
        25 => (ch.clone(), 0..QUEUES.len(), 0usize..3).prop_map(|(c, q, n)| Step::Publish(c, q, n)),
        // Stray content frames are connection errors: rare, or no run would get far.
        1 => (ch.clone(), 0u64..4).prop_map(|(c, n)| Step::Header(c, n)),
        1 => (ch, 1usize..4).prop_map(|(c, n)| Step::Body(c, n)),
        3 => (0u64..3000).prop_map(Step::Tick),
        3 => (1u16..4).prop_map(Step::Reopen),
        15 => Just(Step::Flush),
        1 => Just(Step::Reconnect),
    ]
}

fn connect(node: &mut Node, conn: u64) {
    node.connection_opened(conn, Some("127.0.0.1:1".parse().unwrap()), 0);
    let frame = |method: Method| Frame::Method { channel: 0, method };
    node.handle_frame(
        conn,
        frame(
            ConnectionStartOk {
                client_properties: FieldTable::default(),
                mechanism: ShortStr::from("PLAIN"),
                response: Bytes::from_static(b"\0guest\0guest"),
                locale: ShortStr::from("en_US"),
            }
            .into(),
        ),
        0,
    );
    node.handle_frame(
        conn,
        frame(
            ConnectionTuneOk {
                channel_max: 0,
                frame_max: 131_072,
                heartbeat: 0,
            }
            .into(),
        ),
        0,
    );
    node.handle_frame(
        conn,
        frame(
            ConnectionOpen {
                virtual_host: ShortStr::from("/"),
                ..Default::default()
            }
            .into(),
        ),
        0,
    );
    for ch in 1..4 {
        node.handle_frame(
            conn,
            Frame::Method {
                channel: ch,
                method: ChannelOpen::default().into(),
            },
            0,
        );
    }
}

/// Drains the node's output like a client library: a channel the broker closed is acknowledged and opened again.
fn flush(node: &mut Node, now: u64, out: &mut Vec<Transmit>) {
    node.poll_transmit(now, out);
    for t in out.drain(..) {
        let mut buf = bytes::BytesMut::from(&t.bytes[..]);
        let mut decoder = FrameDecoder::new(131_072);
        while let Ok(Some(frame)) = decoder.decode(&mut buf) {
            if let Frame::Method {
                channel,
                method: Method::ChannelClose(_),
            } = frame
            {
                node.handle_frame(
                    t.conn,
                    Frame::Method {
                        channel,
                        method: ChannelCloseOk {}.into(),
                    },
                    now,
                );
                node.handle_frame(
                    t.conn,
                    Frame::Method {
                        channel,
                        method: ChannelOpen::default().into(),
                    },
                    now,
                );
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn random_clients_never_panic_and_leave_nothing_held(steps in proptest::collection::vec((0u64..2, step()), 1..120)) {
        let mut broker = Broker::new(BrokerConfig::default());
        broker.set_recording(true);
        let mut node = Node::new(SessionConfig::default(), broker);
        node.apply_config_users(true, &mut || [0, 1, 2, 3]);
        let mut conns = [1u64, 2];
        let mut next_conn = 3;
        for c in conns {
            connect(&mut node, c);
        }
        let mut out: Vec<Transmit> = Vec::new();
        let mut now = 0;
        for (who, s) in steps {
            let conn = conns[who as usize];
            match s {
                Step::Method(ch, m) => node.handle_frame(conn, Frame::Method { channel: ch, method: m }, now),
                Step::Publish(ch, q, size) => {
                    let publish = BasicPublish { routing_key: name(q, &QUEUES), ..Default::default() };
                    node.handle_frame(conn, Frame::Method { channel: ch, method: publish.into() }, now);
                    node.handle_frame(conn, Frame::Header { channel: ch, header: ContentHeader {
                        class_id: 60, weight: 0, body_size: size as u64, properties: BasicProperties::default().encode(),
                    } }, now);
                    if size > 0 {
                        node.handle_frame(conn, Frame::Body { channel: ch, payload: Bytes::from(vec![1u8; size]) }, now);
                    }
                }
                Step::Header(ch, size) => node.handle_frame(conn, Frame::Header { channel: ch, header: ContentHeader {
                    class_id: 60, weight: 0, body_size: size, properties: BasicProperties::default().encode(),
                } }, now),
                Step::Body(ch, n) => node.handle_frame(conn, Frame::Body { channel: ch, payload: Bytes::from(vec![7u8; n]) }, now),
                Step::Tick(dt) => {
                    now += dt;
                    node.tick(now);
                }
                Step::Reopen(ch) => {
                    flush(&mut node, now, &mut out);
                    node.handle_frame(conn, Frame::Method { channel: ch, method: ChannelClose::default().into() }, now);
                    node.handle_frame(conn, Frame::Method { channel: ch, method: ChannelOpen::default().into() }, now);
                }
                Step::Flush => flush(&mut node, now, &mut out),
                Step::Reconnect => {
                    node.connection_lost(conn);
                    conns[who as usize] = next_conn;
                    connect(&mut node, next_conn);
                    next_conn += 1;
                }
            }
        }
        node.poll_transmit(now, &mut out);
        for c in conns {
            node.connection_lost(c);
        }
        node.poll_transmit(now, &mut out);
        for name in ["a", "b"] {
            if let Some(id) = node.broker().queue_id("/", name) {
                let info = node.broker().queue_info(id).unwrap();
                prop_assert_eq!(info.in_flight, 0, "queue {} still has messages in flight", name);
                prop_assert_eq!(info.consumer_count, 0, "queue {} still has consumers", name);
            }
        }
        // Every command applied to a queue was recorded: replaying the log rebuilds each live
        // queue exactly, and a log with one command missing does not replay.
        let records = node.take_records();
        let mut log = bytes::BytesMut::new();
        for r in &records {
            warren_broker::queue::log::encode(r, &mut log);
        }
        let (decoded, truncated) = warren_broker::queue::log::decode_all(log.freeze()).expect("decodes");
        prop_assert!(!truncated);
        prop_assert_eq!(&decoded, &records);
        let live: Vec<(u64, u64)> = ["a", "b"]
            .iter()
            .filter_map(|name| node.broker().queue_id("/", name))
            .filter_map(|id| Some((id.0, node.broker().machine(id)?.digest())))
            .collect();
        let same_as_live = |records: Vec<warren_broker::queue::log::Record>| {
            let Ok((_, machines)) = warren_broker::queue::log::replay_records(records, false) else {
                return false;
            };
            // A queue no command reached is a fresh machine.
            let fresh = warren_broker::machine::QueueMachine::<warren_broker::Message>::new().digest();
            live.iter().all(|(id, digest)| machines.get(id).map_or(fresh, |m| m.digest()) == *digest)
        };
        prop_assert!(same_as_live(decoded.clone()), "a replay differs from the live queues");
        // Leave out one command of a live queue: the replay must notice.
        let of_live: Vec<usize> = (0..decoded.len())
            .filter(|i| live.iter().any(|(id, _)| decoded[*i].queue == *id))
            .collect();
        if !of_live.is_empty() {
            let mut short = decoded;
            let gone = short.remove(of_live[of_live.len() / 2]);
            prop_assert!(!same_as_live(short), "a log without {:?} replayed", gone.command);
        }
    }
}
