//! Property test over the whole broker: random publishes, consumers coming and going, acks,
//! requeues, rejects, gets, purges and prefetch changes, driven the way the session drives it
//! (credit_changed after every settlement). After each step and a dispatch:
//! - liveness: no queue is left with ready messages while one of its consumers has credit;
//! - conservation: each queue's ready / in-flight counts match a model that tracks every
//!   message to exactly one fate;
//! - prefetch: no consumer holds more unacked messages than its prefetch.

use std::collections::HashMap;

use bytes::Bytes;
use proptest::prelude::*;
use warren_broker::{
    Broker, BrokerConfig, ConsumerKey, DeclareQueue, Delivery, DeliverySink, Message, QueueId,
};
use warren_codec::{FieldTable, ShortStr};

const QUEUES: [&str; 2] = ["q0", "q1"];

#[derive(Clone, Debug)]
enum Op {
    Publish {
        q: usize,
    },
    Consume {
        c: u8,
        q: usize,
        prefetch: u32,
        no_ack: bool,
    },
    Cancel {
        c: u8,
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
    Get {
        q: usize,
        no_ack: bool,
    },
    Purge {
        q: usize,
    },
    Prefetch {
        c: u8,
        prefetch: u32,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0usize..2).prop_map(|q| Op::Publish { q }),
        2 => (0u8..4, 0usize..2, 0u32..4, prop::bool::weighted(0.2))
            .prop_map(|(c, q, prefetch, no_ack)| Op::Consume { c, q, prefetch, no_ack }),
        1 => (0u8..4).prop_map(|c| Op::Cancel { c }),
        4 => any::<usize>().prop_map(|pick| Op::Ack { pick }),
        2 => any::<usize>().prop_map(|pick| Op::Requeue { pick }),
        1 => any::<usize>().prop_map(|pick| Op::Reject { pick }),
        1 => (0usize..2, any::<bool>()).prop_map(|(q, no_ack)| Op::Get { q, no_ack }),
        1 => (0usize..2).prop_map(|q| Op::Purge { q }),
        1 => (0u8..4, 0u32..4).prop_map(|(c, prefetch)| Op::Prefetch { c, prefetch }),
    ]
}

fn key(c: u8) -> ConsumerKey {
    // Each consumer on its own channel, so prefetch is per consumer.
    ConsumerKey {
        conn: 1,
        channel: u16::from(c) + 1,
        tag: ShortStr::from_string(format!("c{c}")),
    }
}

/// The session's view: prefetch per channel and the unacked deliveries.
#[derive(Default)]
struct Session {
    prefetch: HashMap<ConsumerKey, u32>,
    /// Unacked deliveries: (owner channel key, queue, msg id). basic.get ones have no owner.
    unacked: Vec<(Option<ConsumerKey>, QueueId, u64)>,
    delivered: usize,
    delivered_from: HashMap<QueueId, u32>,
    violation: Option<String>,
}

impl Session {
    fn unacked_of(&self, c: &ConsumerKey) -> u32 {
        self.unacked
            .iter()
            .filter(|(k, _, _)| k.as_ref() == Some(c))
            .count() as u32
    }
    fn credit(&self, c: &ConsumerKey) -> bool {
        match self.prefetch.get(c) {
            Some(0) => true,
            Some(p) => self.unacked_of(c) < *p,
            None => false,
        }
    }
}

struct NoAck(HashMap<ConsumerKey, bool>);

struct Sink<'a> {
    s: &'a mut Session,
    no_ack: &'a NoAck,
}

impl DeliverySink for Sink<'_> {
    fn has_credit(&mut self, c: &ConsumerKey) -> bool {
        self.s.credit(c)
    }
    fn deliver(&mut self, c: &ConsumerKey, d: Delivery) {
        self.s.delivered += 1;
        *self.s.delivered_from.entry(d.queue).or_default() += 1;
        if !self.s.credit(c) {
            self.s.violation = Some(format!("delivery to {c:?} without credit"));
        }
        if !self.no_ack.0.get(c).copied().unwrap_or(false) {
            self.s.unacked.push((Some(c.clone()), d.queue, d.msg_id));
        }
    }
}

fn msg() -> Message {
    Message {
        exchange: ShortStr::empty(),
        routing_key: ShortStr::empty(),
        properties: Bytes::from_static(&[0, 0]),
        body: Bytes::from_static(b"m"),
        persistent: false,
    }
}

fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let mut b = Broker::new(BrokerConfig {
        dispatch_batch: 3,
        ..BrokerConfig::default()
    });
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
    let mut no_ack = NoAck(HashMap::new());
    // Model: ready count per queue.
    let mut ready = [0u32; 2];
    let qidx = |id: QueueId, ids: &[QueueId]| ids.iter().position(|x| *x == id).unwrap_or(0);

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
                no_ack: na,
            } => {
                let k = key(c);
                let res = b.consume("/", QUEUES[q], k.clone(), na, false, &FieldTable::new());
                let fresh = !s.prefetch.contains_key(&k);
                prop_assert_eq!(res.is_ok(), fresh);
                if fresh {
                    s.prefetch.insert(k.clone(), if na { 0 } else { prefetch });
                    no_ack.0.insert(k, na);
                }
            }
            Op::Cancel { c } => {
                let k = key(c);
                let known = s.prefetch.remove(&k).is_some();
                let q = b.consumer_queue(&k);
                prop_assert_eq!(q.is_some(), known);
                if let Some(q) = q {
                    prop_assert!(b.cancel(q, &k));
                }
                no_ack.0.remove(&k);
            }
            Op::Ack { pick } | Op::Requeue { pick } | Op::Reject { pick } => {
                if s.unacked.is_empty() {
                    continue;
                }
                let (owner, q, id) = s.unacked.remove(pick % s.unacked.len());
                match op {
                    Op::Ack { .. } => b.settle(q, id),
                    Op::Requeue { .. } => {
                        b.requeue(q, id);
                        ready[qidx(q, &ids)] += 1;
                    }
                    _ => b.discard(q, id),
                }
                if let Some(owner) = owner {
                    b.credit_changed(&owner);
                }
            }
            Op::Get { q, no_ack: na } => {
                let got = b
                    .get("/", QUEUES[q], na, 1)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                match got {
                    Some((d, left)) => {
                        ready[q] -= 1;
                        prop_assert_eq!(left, ready[q]);
                        if !na {
                            s.unacked.push((None, d.queue, d.msg_id));
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
            Op::Prefetch { c, prefetch } => {
                let k = key(c);
                if let Some(p) = s.prefetch.get_mut(&k) {
                    if !no_ack.0.get(&k).copied().unwrap_or(false) {
                        *p = prefetch;
                    }
                    b.channel_credit_changed(k.conn, k.channel);
                }
            }
        }
        // Dispatch until the broker says it is done (bounded).
        let mut rounds = 0;
        loop {
            b.dispatch(&mut Sink {
                s: &mut s,
                no_ack: &no_ack,
            });
            if let Some(v) = s.violation.take() {
                return Err(TestCaseError::fail(v));
            }
            rounds += 1;
            if !b.needs_dispatch() || rounds > 1000 {
                break;
            }
        }
        prop_assert!(!b.needs_dispatch(), "dispatch never settles");
        for (i, id) in ids.iter().enumerate() {
            let info = b
                .queue_info(*id)
                .ok_or_else(|| TestCaseError::fail("queue gone"))?;
            // Liveness: ready messages and a consumer with credit cannot coexist.
            if info.message_count > 0 {
                for (k, _) in s
                    .prefetch
                    .iter()
                    .filter(|(k, _)| b.consumer_queue(k) == Some(*id))
                {
                    prop_assert!(
                        !s.credit(k),
                        "{:?} has credit but {} stays ready",
                        k,
                        QUEUES[i]
                    );
                }
            }
            // Conservation: in flight == what the session holds unacked for this queue.
            let held = s.unacked.iter().filter(|(_, q, _)| q == id).count() as u32;
            prop_assert_eq!(info.in_flight, held);
            // Conservation: ready == published + requeued - got - purged - delivered.
            let delivered = s.delivered_from.remove(id).unwrap_or(0);
            ready[i] -= delivered;
            prop_assert_eq!(info.message_count, ready[i]);
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn broker_never_stalls_or_loses(ops in proptest::collection::vec(op(), 0..150)) {
        run(ops)?;
    }
}
