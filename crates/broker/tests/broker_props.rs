//! Property test over the whole broker: random publishes, consumers coming and going, acks,
//! requeues, rejects, stale settlements, gets, purges, channel-wide prefetch changes and
//! blocked channels, driven the way the session drives it (consumer prefetch at consume;
//! channel-wide credit pushed with `set_credit` whenever it changes; `dispatch_one` until no
//! queue has work). After each step and a dispatch:
//! - liveness: no queue is left with ready messages while one of its consumers may take one;
//! - conservation: each queue's ready / in-flight counts match a model that tracks every
//!   message to exactly one fate;
//! - prefetch: no consumer holds more unacked messages than its prefetch, no channel more than
//!   its channel-wide prefetch, and a blocked channel gets nothing;
//! - the queue's own record of its consumers and what each holds matches the session's.
//!
//! At the end, the recorded command log replays to the same machines.

use std::collections::HashMap;

use bytes::{Bytes, BytesMut};
use proptest::prelude::*;
use warren_broker::queue::log;
use warren_broker::{
    Broker, BrokerConfig, ConsumerId, Credit, CreditGroup, DeclareQueue, Delivery, Message,
    QueueId, Receipt,
};
use warren_codec::{FieldTable, ShortStr};

const QUEUES: [&str; 2] = ["q0", "q1"];
const CONSUMERS: usize = 4;

#[derive(Clone, Debug)]
enum Op {
    Publish {
        q: usize,
    },
    Consume {
        c: usize,
        q: usize,
        prefetch: u32,
        no_ack: bool,
    },
    Cancel {
        c: usize,
    },
    Ack {
        pick: usize,
    },
    Requeue {
        pick: usize,
    },
    Reject {
        pick: usize,
    },
    /// Settles, requeues or discards with a receipt that is no longer current.
    Stale {
        pick: usize,
    },
    Get {
        q: usize,
        no_ack: bool,
    },
    Purge {
        q: usize,
    },
    /// basic.qos global: the channel-wide prefetch of consumer `c`'s channel (0 = none).
    Prefetch {
        c: usize,
        prefetch: u32,
    },
    /// The channel's connection is backed up (or drains again).
    Block {
        c: usize,
        blocked: bool,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0usize..2).prop_map(|q| Op::Publish { q }),
        2 => (0..CONSUMERS, 0usize..2, 0u32..4, prop::bool::weighted(0.2))
            .prop_map(|(c, q, prefetch, no_ack)| Op::Consume { c, q, prefetch, no_ack }),
        1 => (0..CONSUMERS).prop_map(|c| Op::Cancel { c }),
        4 => any::<usize>().prop_map(|pick| Op::Ack { pick }),
        2 => any::<usize>().prop_map(|pick| Op::Requeue { pick }),
        1 => any::<usize>().prop_map(|pick| Op::Reject { pick }),
        1 => any::<usize>().prop_map(|pick| Op::Stale { pick }),
        1 => (0usize..2, any::<bool>()).prop_map(|(q, no_ack)| Op::Get { q, no_ack }),
        1 => (0usize..2).prop_map(|q| Op::Purge { q }),
        1 => (0..CONSUMERS, 0u32..4).prop_map(|(c, prefetch)| Op::Prefetch { c, prefetch }),
        1 => (0..CONSUMERS, prop::bool::weighted(0.3))
            .prop_map(|(c, blocked)| Op::Block { c, blocked }),
    ]
}

/// Each consumer on its own channel, so a channel-wide prefetch is per consumer.
fn group(c: usize) -> CreditGroup {
    CreditGroup {
        conn: 1,
        channel: c as u16 + 1,
    }
}

fn tag(c: usize) -> ShortStr {
    ShortStr::from_string(format!("c{c}"))
}

#[derive(Clone, Copy, Debug)]
struct Consumer {
    queue: QueueId,
    id: ConsumerId,
    no_ack: bool,
    prefetch: u32,
}

/// The session's view of one channel.
#[derive(Default)]
struct Chan {
    consumer: Option<Consumer>,
    /// Channel-wide prefetch; 0 = none.
    prefetch: u32,
    blocked: bool,
    /// The credit last told to the queues.
    sent: Credit,
}

struct Unacked {
    /// The channel of a consumer delivery (counted against its channel-wide prefetch); `None`
    /// for basic.get.
    channel: Option<usize>,
    consumer: Option<ConsumerId>,
    queue: QueueId,
    receipt: Receipt,
}

#[derive(Default)]
struct Session {
    chans: [Chan; CONSUMERS],
    unacked: Vec<Unacked>,
    /// Receipts that are no longer current (settled, returned, discarded, or no-ack).
    stale: Vec<(QueueId, Receipt)>,
    delivered_from: HashMap<QueueId, u32>,
}

impl Session {
    fn channel_unacked(&self, c: usize) -> u32 {
        self.unacked.iter().filter(|u| u.channel == Some(c)).count() as u32
    }

    fn held(&self, id: ConsumerId) -> u32 {
        self.unacked
            .iter()
            .filter(|u| u.consumer == Some(id))
            .count() as u32
    }

    fn credit(&self, c: usize) -> Credit {
        let ch = &self.chans[c];
        Credit {
            blocked: ch.blocked,
            limit: (ch.prefetch != 0).then(|| ch.prefetch.saturating_sub(self.channel_unacked(c))),
        }
    }

    /// Tells the channel's queue its credit if it changed since last told (as the session's
    /// `push_credit` does).
    fn push_credit(&mut self, c: usize, b: &mut Broker) {
        let credit = self.credit(c);
        if credit == self.chans[c].sent {
            return;
        }
        self.chans[c].sent = credit;
        if let Some(con) = self.chans[c].consumer {
            b.set_credit(con.queue, group(c), credit);
        }
    }

    fn push_all(&mut self, b: &mut Broker) {
        for c in 0..CONSUMERS {
            self.push_credit(c, b);
        }
    }

    /// May channel `c`'s consumer take one more message?
    fn may_take(&self, c: usize) -> bool {
        let ch = &self.chans[c];
        let Some(con) = ch.consumer else {
            return false;
        };
        if ch.blocked {
            return false;
        }
        con.no_ack
            || ((con.prefetch == 0 || self.held(con.id) < con.prefetch)
                && (ch.prefetch == 0 || self.channel_unacked(c) < ch.prefetch))
    }

    /// Takes a consumer delivery as the session would, checking it was allowed.
    fn deliver(&mut self, d: Delivery) -> Result<(), TestCaseError> {
        let Some((id, g, t)) = d.consumer.clone() else {
            return Err(TestCaseError::fail(
                "a dispatch delivery without a consumer",
            ));
        };
        let c = usize::from(g.channel).wrapping_sub(1);
        prop_assert!(g.conn == 1 && c < CONSUMERS, "unknown channel {:?}", g);
        let Some(con) = self.chans[c].consumer else {
            return Err(TestCaseError::fail(format!(
                "delivery to cancelled consumer {id:?}"
            )));
        };
        prop_assert_eq!(con.id, id);
        prop_assert_eq!(con.queue, d.queue);
        prop_assert_eq!(t, tag(c));
        prop_assert_eq!(d.settled, con.no_ack);
        prop_assert!(
            self.may_take(c),
            "delivery to {} without credit (blocked {}, held {}/{}, channel {}/{})",
            tag(c),
            self.chans[c].blocked,
            self.held(id),
            con.prefetch,
            self.channel_unacked(c),
            self.chans[c].prefetch
        );
        *self.delivered_from.entry(d.queue).or_default() += 1;
        if con.no_ack {
            self.stale.push((d.queue, d.receipt));
        } else {
            self.unacked.push(Unacked {
                channel: Some(c),
                consumer: Some(id),
                queue: d.queue,
                receipt: d.receipt,
            });
        }
        Ok(())
    }
}

fn msg() -> Message {
    Message {
        exchange: ShortStr::empty(),
        routing_key: ShortStr::empty(),
        properties: Bytes::from_static(&[0, 0]),
        body: Bytes::from_static(b"m"),
        persistent: false,
        store_key: None,
        away: None,
    }
}

fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let mut b = Broker::new(BrokerConfig {
        dispatch_batch: 3,
        ..BrokerConfig::default()
    });
    b.set_recording(true);
    let mut ids = Vec::new();
    for q in QUEUES {
        let d = b
            .declare_queue(
                "/",
                DeclareQueue {
                    name: ShortStr::from_static(q),
                    passive: false,
                    durable: false,
                    exclusive: false,
                    auto_delete: false,
                    arguments: FieldTable::new(),
                },
                1,
            )
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        ids.push(d.queue);
    }
    let mut s = Session::default();
    // Model: ready count per queue.
    let mut ready = [0u32; 2];
    let qidx = |id: QueueId, ids: &[QueueId]| ids.iter().position(|x| *x == id).unwrap_or(0);
    let mut deliveries = Vec::new();

    for op in ops {
        match op {
            Op::Publish { q } => {
                let r = b
                    .publish("/", "", QUEUES[q], msg(), 0)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                prop_assert_eq!(r.queues, 1);
                ready[q] += 1;
            }
            Op::Consume {
                c,
                q,
                prefetch,
                no_ack,
            } => {
                // A tag in use on the channel: the session refuses it (530) without asking
                // the broker.
                if s.chans[c].consumer.is_none() {
                    let (queue, id) = b
                        .consume(
                            "/",
                            QUEUES[q],
                            group(c),
                            tag(c),
                            no_ack,
                            false,
                            prefetch,
                            &FieldTable::new(),
                        )
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                    prop_assert_eq!(queue, ids[q]);
                    s.chans[c].consumer = Some(Consumer {
                        queue,
                        id,
                        no_ack,
                        prefetch,
                    });
                    // The new consumer's queue has not heard of the channel's credit yet.
                    if s.chans[c].sent != Credit::default() {
                        b.set_credit(queue, group(c), s.chans[c].sent);
                    }
                }
            }
            Op::Cancel { c } => {
                if let Some(con) = s.chans[c].consumer.take() {
                    prop_assert!(b.cancel(con.queue, con.id));
                    prop_assert!(!b.cancel(con.queue, con.id), "cancelled twice");
                }
            }
            Op::Ack { pick } | Op::Requeue { pick } | Op::Reject { pick } => {
                if s.unacked.is_empty() {
                    continue;
                }
                let u = s.unacked.remove(pick % s.unacked.len());
                let current = match op {
                    Op::Ack { .. } => b.settle(u.queue, u.receipt),
                    Op::Requeue { .. } => {
                        ready[qidx(u.queue, &ids)] += 1;
                        b.requeue(u.queue, u.receipt)
                    }
                    _ => b.discard(u.queue, u.receipt),
                };
                prop_assert!(current, "{:?} of {:?} refused", op, u.receipt);
                s.stale.push((u.queue, u.receipt));
            }
            Op::Stale { pick } => {
                if s.stale.is_empty() {
                    continue;
                }
                let (q, r) = s.stale[pick % s.stale.len()];
                let current = match pick % 3 {
                    0 => b.settle(q, r),
                    1 => b.requeue(q, r),
                    _ => b.discard(q, r),
                };
                prop_assert!(!current, "stale receipt {:?} accepted", r);
            }
            Op::Get { q, no_ack } => {
                let got = b
                    .get("/", QUEUES[q], no_ack, 1)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                match got {
                    Some((d, left)) => {
                        ready[q] -= 1;
                        prop_assert_eq!(left, ready[q]);
                        prop_assert_eq!(d.queue, ids[q]);
                        prop_assert_eq!(d.queue_name.as_str(), QUEUES[q]);
                        prop_assert!(d.consumer.is_none());
                        prop_assert_eq!(d.settled, no_ack);
                        prop_assert_eq!(d.redelivered, d.receipt.attempt > 1);
                        if no_ack {
                            s.stale.push((d.queue, d.receipt));
                        } else {
                            s.unacked.push(Unacked {
                                channel: None,
                                consumer: None,
                                queue: d.queue,
                                receipt: d.receipt,
                            });
                        }
                    }
                    None => prop_assert_eq!(ready[q], 0),
                }
            }
            Op::Purge { q } => {
                let n = b
                    .purge_queue("/", QUEUES[q], 1)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                prop_assert_eq!(n, ready[q]);
                ready[q] = 0;
            }
            Op::Prefetch { c, prefetch } => s.chans[c].prefetch = prefetch,
            Op::Block { c, blocked } => s.chans[c].blocked = blocked,
        }
        // Credit changed by the step (settlements, qos, back-pressure) reaches the queues.
        s.push_all(&mut b);
        // Dispatch until the broker says it is done (bounded), telling the queues the
        // channels' credit after each checkout as the session does.
        let mut rounds = 0;
        while b.needs_dispatch() && rounds <= 1000 {
            prop_assert!(b.dispatch_one(&mut deliveries));
            for d in deliveries.drain(..) {
                prop_assert_eq!(d.redelivered, d.receipt.attempt > 1);
                s.deliver(d)?;
            }
            s.push_all(&mut b);
            rounds += 1;
        }
        prop_assert!(!b.needs_dispatch(), "dispatch never settles");
        for (i, id) in ids.iter().enumerate() {
            let info = b
                .queue_info(*id)
                .ok_or_else(|| TestCaseError::fail("queue gone"))?;
            // Liveness: ready messages and a consumer that may take one cannot coexist.
            if info.message_count > 0 {
                for c in 0..CONSUMERS {
                    if s.chans[c].consumer.is_some_and(|con| con.queue == *id) {
                        prop_assert!(
                            !s.may_take(c),
                            "{} may take but {} stays ready",
                            tag(c),
                            QUEUES[i]
                        );
                    }
                }
            }
            // Conservation: in flight == what the session holds unacked for this queue.
            let held = s.unacked.iter().filter(|u| u.queue == *id).count() as u32;
            prop_assert_eq!(info.in_flight, held);
            // Conservation: ready == published + requeued - got - purged - delivered.
            let delivered = s.delivered_from.remove(id).unwrap_or(0);
            ready[i] -= delivered;
            prop_assert_eq!(info.message_count, ready[i]);
            // The queue's consumers, and what each holds, are the session's.
            let m = b
                .machine(*id)
                .ok_or_else(|| TestCaseError::fail("no machine"))?;
            let theirs: Vec<(ConsumerId, CreditGroup, u32)> = m
                .consumers()
                .map(|(cid, spec, n)| (cid, spec.group, n))
                .collect();
            let mut ours: Vec<(ConsumerId, CreditGroup, u32)> = (0..CONSUMERS)
                .filter_map(|c| {
                    let con = s.chans[c].consumer.filter(|con| con.queue == *id)?;
                    let held = if con.no_ack { 0 } else { s.held(con.id) };
                    Some((con.id, group(c), held))
                })
                .collect();
            ours.sort();
            prop_assert_eq!(theirs, ours);
            prop_assert_eq!(info.consumer_count as usize, m.consumer_count());
        }
    }
    // The command log rebuilds the same queues.
    let records = b.take_records();
    let mut bytes = BytesMut::new();
    for r in &records {
        log::encode(r, &mut bytes);
    }
    let summary =
        log::replay(bytes.freeze()).map_err(|e| TestCaseError::fail(format!("replay: {e}")))?;
    prop_assert_eq!(summary.records, records.len() as u64);
    prop_assert!(!summary.truncated);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn broker_never_stalls_or_loses(ops in proptest::collection::vec(op(), 0..150)) {
        run(ops)?;
    }
}
