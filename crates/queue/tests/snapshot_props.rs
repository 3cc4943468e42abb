//! A snapshot is the machine: for random command sequences, a machine restored from a snapshot
//! taken at a random point has the same digest as the original, snapshots to the same bytes,
//! and, given the rest of the commands, gives the same replies, effects and digests at every
//! step.

use std::collections::BTreeMap;

use bytes::{Bytes, BytesMut};
use proptest::prelude::*;
use warren_codec::{FieldTable, FieldValue, ShortStr};
use warren_queue::machine::{
    effects_digest, Command, ConsumerId, ConsumerSpec, Credit, CreditGroup, DedupKey, DedupWindow,
    Effect, EnqueuerId, GroupKey, Meta, MsgMeta, Policy, QueueMachine, Receipt, Reply, RetryPolicy,
};
use warren_queue::{qualify, Message, NodeId, Overflow};

const NODES: u16 = 3;

#[derive(Clone, Debug)]
enum Op {
    Enqueue {
        size: usize,
        ttl: Option<u64>,
        priority: u8,
        group: Option<u8>,
        stored: bool,
    },
    /// An enqueue with the publisher slot's next sequence, `gap` past its last one.
    Publish {
        slot: u8,
        gap: u64,
        size: usize,
    },
    /// One of the slot's earlier sequences again.
    Resend {
        slot: u8,
        pick: usize,
    },
    Unregister {
        slot: u8,
    },
    Consume {
        slot: u8,
        node: NodeId,
        no_ack: bool,
        prefetch: u32,
        priority: i64,
        visibility_ms: Option<u64>,
        timeout_ms: Option<u64>,
    },
    Cancel {
        slot: u8,
    },
    Credit {
        node: NodeId,
        blocked: bool,
        limit: Option<u32>,
    },
    Checkout {
        max: u32,
    },
    Get {
        no_ack: bool,
        node: NodeId,
    },
    /// A receipt of a delivery the test saw (current unless `stale`).
    Settle {
        pick: usize,
        stale: bool,
    },
    Return {
        pick: usize,
        stale: bool,
    },
    Release {
        pick: usize,
        stale: bool,
    },
    Discard {
        pick: usize,
        stale: bool,
    },
    Extend {
        pick: usize,
        timeout_ms: u64,
    },
    Down {
        node: NodeId,
    },
    Tick {
        advance: u64,
    },
    /// A new policy (the queue's priorities and delivery mode stay as declared).
    Configure(Policy),
    Touch,
    Purge,
    /// Settles some held dead letters (`pick` chooses which, with an id never held too).
    DeadLettered {
        pick: usize,
    },
    CapExpiry {
        within: u64,
    },
    /// A publish held back `delay` ms (`EnqueueWith`), from enqueuer `from` if any, with a
    /// deduplication key (of a few) and its window if any.
    Hold {
        size: usize,
        delay: u64,
        from: Option<u8>,
        key: Option<(u8, u64, u32)>,
    },
}

fn policy() -> impl Strategy<Value = Policy> {
    (
        (
            prop::option::weighted(0.3, 1u64..8),
            prop::option::weighted(0.15, 1u64..400),
            prop_oneof![
                Just(Overflow::DropHead),
                Just(Overflow::RejectPublish),
                Just(Overflow::RejectPublishDlx)
            ],
            prop::option::weighted(0.15, 20u64..200),
        ),
        (
            prop::option::weighted(0.3, 0u8..5),
            prop::bool::weighted(0.2),
            prop::option::weighted(0.4, 0u64..4),
            prop::option::weighted(0.3, 5u64..60),
            prop::option::weighted(0.2, 5u64..80),
        ),
        prop::option::weighted(
            0.3,
            (
                1u64..20,
                prop::option::of(10u64..60),
                prop::option::of(1u64..4),
                0u8..50,
            )
                .prop_map(|(min_ms, max_ms, multiplier, jitter_pct)| RetryPolicy {
                    min_ms,
                    max_ms,
                    multiplier,
                    jitter_pct,
                }),
        ),
        (
            prop::bool::weighted(0.5),
            prop::bool::weighted(0.5),
            prop::bool::weighted(0.5),
        ),
    )
        .prop_map(
            |(
                (max_length, max_length_bytes, overflow, expires_ms),
                (max_priority, single_active, delivery_limit, visibility, consumer_timeout),
                retry,
                (deliver_on_apply, hold_dead_letters, index_groups),
            )| Policy {
                max_length,
                max_length_bytes,
                overflow,
                expires_ms,
                max_priority,
                single_active,
                delivery_limit,
                visibility_timeout_ms: visibility,
                consumer_timeout_ms: consumer_timeout,
                retry,
                deliver_on_apply,
                hold_dead_letters,
                index_groups,
            },
        )
}

fn receipt_op() -> impl Strategy<Value = (usize, bool)> {
    (any::<usize>(), prop::bool::weighted(0.15))
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0usize..40, prop::option::weighted(0.3, 0u64..60), 0u8..6, prop::option::weighted(0.4, 0u8..3), any::<bool>())
            .prop_map(|(size, ttl, priority, group, stored)| Op::Enqueue { size, ttl, priority, group, stored }),
        3 => (0u8..3, prop::option::weighted(0.2, 1u64..3), 0usize..40)
            .prop_map(|(slot, gap, size)| Op::Publish { slot, gap: gap.unwrap_or(0), size }),
        1 => (0u8..3, any::<usize>()).prop_map(|(slot, pick)| Op::Resend { slot, pick }),
        1 => (0u8..3).prop_map(|slot| Op::Unregister { slot }),
        2 => (0u8..4, 0u16..NODES, prop::bool::weighted(0.2), 0u32..4, -1i64..2, prop::option::weighted(0.2, 5u64..50), prop::option::weighted(0.2, 5u64..80))
            .prop_map(|(slot, node, no_ack, prefetch, priority, visibility_ms, timeout_ms)| Op::Consume { slot, node, no_ack, prefetch, priority, visibility_ms, timeout_ms }),
        1 => (0u8..4).prop_map(|slot| Op::Cancel { slot }),
        1 => (0u16..NODES, prop::bool::weighted(0.3), prop::option::of(0u32..4))
            .prop_map(|(node, blocked, limit)| Op::Credit { node, blocked, limit }),
        3 => (1u32..6).prop_map(|max| Op::Checkout { max }),
        1 => (any::<bool>(), 0u16..NODES).prop_map(|(no_ack, node)| Op::Get { no_ack, node }),
        3 => receipt_op().prop_map(|(pick, stale)| Op::Settle { pick, stale }),
        2 => receipt_op().prop_map(|(pick, stale)| Op::Return { pick, stale }),
        1 => receipt_op().prop_map(|(pick, stale)| Op::Release { pick, stale }),
        1 => receipt_op().prop_map(|(pick, stale)| Op::Discard { pick, stale }),
        1 => (any::<usize>(), 1u64..60).prop_map(|(pick, timeout_ms)| Op::Extend { pick, timeout_ms }),
        1 => (0u16..NODES).prop_map(|node| Op::Down { node }),
        3 => (0u64..40).prop_map(|advance| Op::Tick { advance }),
        1 => policy().prop_map(Op::Configure),
        1 => Just(Op::Touch),
        1 => Just(Op::Purge),
        2 => any::<usize>().prop_map(|pick| Op::DeadLettered { pick }),
        1 => (0u64..40).prop_map(|within| Op::CapExpiry { within }),
        3 => (0usize..40, 0u64..50, prop::option::weighted(0.3, 0u8..3), prop::option::weighted(0.5, (0u8..4, 1u64..60, 1u32..4)))
            .prop_map(|(size, delay, from, key)| Op::Hold { size, delay, from, key }),
    ]
}

/// Channel `n` is on node `n`.
fn group(node: NodeId) -> CreditGroup {
    CreditGroup {
        conn: qualify(node, 7).unwrap_or(7),
        channel: node,
    }
}

/// Turns ops into commands, picking receipts among the deliveries it has seen. Both machines
/// get the same commands, so one driver serves both.
struct Driver {
    index: u64,
    now: u64,
    bodies: u64,
    /// The queue's priorities and delivery mode, as declared.
    max_priority: Option<u8>,
    deliver_on_apply: bool,
    consumers: BTreeMap<u8, ConsumerId>,
    next_consumer: u64,
    /// A publisher slot's enqueuer and the sequences it sent.
    enqueuers: BTreeMap<u8, (EnqueuerId, Vec<(u64, Message)>)>,
    next_enqueuer: u64,
    receipts: Vec<Receipt>,
}

impl Driver {
    fn message(&mut self, size: usize, stored: bool) -> Message {
        self.bodies += 1;
        let body: Vec<u8> = self
            .bodies
            .to_be_bytes()
            .iter()
            .cycle()
            .take(size)
            .copied()
            .collect();
        Message {
            exchange: ShortStr::from_static("ex"),
            routing_key: ShortStr::from_static("q"),
            properties: Bytes::from(vec![0x10, 0, (self.bodies % 3) as u8]),
            body: Bytes::from(body),
            persistent: stored,
            store_key: stored.then_some(self.bodies),
            away: None,
        }
    }

    fn receipt(&self, m: &QueueMachine<Message>, pick: usize, stale: bool) -> Receipt {
        let current: Vec<Receipt> = self
            .receipts
            .iter()
            .filter(|r| m.holder(**r).is_some())
            .copied()
            .collect();
        match (stale, current.get(pick % current.len().max(1))) {
            (false, Some(r)) => *r,
            _ => match self.receipts.get(pick % self.receipts.len().max(1)) {
                Some(r) => *r,
                None => Receipt {
                    msg_id: pick as u64 % 8,
                    attempt: 1,
                },
            },
        }
    }

    /// The next command (`None`: the op has nothing to act on).
    fn command(&mut self, op: &Op, m: &QueueMachine<Message>) -> Option<(Meta, Command<Message>)> {
        let command = match op {
            Op::Enqueue {
                size,
                ttl,
                priority,
                group,
                stored,
            } => Command::Enqueue {
                message: self.message(*size, *stored),
                meta: MsgMeta {
                    size: *size as u64,
                    expires_at: ttl.map(|t| self.now + t),
                    pageable: false,
                    spilled: false,
                    priority: self.max_priority.map_or(0, |p| (*priority).min(p)),
                    group: group.and_then(|g| GroupKey::new(u64::from(g) + 1)),
                },
            },
            Op::Publish { slot, gap, size } => {
                if !self.enqueuers.contains_key(slot) {
                    self.next_enqueuer += 1;
                    let id = qualify(u16::from(*slot) % NODES, self.next_enqueuer)?;
                    self.enqueuers.insert(*slot, (EnqueuerId(id), Vec::new()));
                }
                let message = self.message(*size, false);
                let (id, sent) = self.enqueuers.get_mut(slot)?;
                // A life starts at 1; a gap is refused (out of order) and decides nothing.
                let seq = sent.last().map_or(1 + gap, |(last, _)| last + 1 + gap);
                if *gap == 0 {
                    sent.push((seq, message.clone()));
                }
                Command::EnqueueFrom {
                    enqueuer: *id,
                    seq,
                    message,
                    meta: MsgMeta {
                        size: *size as u64,
                        ..MsgMeta::default()
                    },
                }
            }
            Op::Resend { slot, pick } => {
                let (id, sent) = self.enqueuers.get(slot)?;
                let (seq, message) = sent.get(pick % sent.len().max(1))?.clone();
                Command::EnqueueFrom {
                    enqueuer: *id,
                    seq,
                    meta: MsgMeta {
                        size: message.body.len() as u64,
                        ..MsgMeta::default()
                    },
                    message,
                }
            }
            Op::Hold {
                size,
                delay,
                from,
                key,
            } => {
                let message = self.message(*size, false);
                let from = match from {
                    Some(slot) => {
                        if !self.enqueuers.contains_key(slot) {
                            self.next_enqueuer += 1;
                            let id = qualify(u16::from(*slot) % NODES, self.next_enqueuer)?;
                            self.enqueuers.insert(*slot, (EnqueuerId(id), Vec::new()));
                        }
                        let (id, sent) = self.enqueuers.get_mut(slot)?;
                        let seq = sent.last().map_or(1, |(last, _)| last + 1);
                        sent.push((seq, message.clone()));
                        Some((*id, seq))
                    }
                    None => None,
                };
                Command::EnqueueWith {
                    delay_ms: *delay,
                    from,
                    dedup: key.map(|(k, ttl_ms, max_keys)| {
                        Box::new(DedupWindow {
                            key: DedupKey {
                                len: 1,
                                bytes: [k; 32],
                            },
                            ttl_ms,
                            max_keys,
                        })
                    }),
                    meta: MsgMeta {
                        size: *size as u64,
                        ..MsgMeta::default()
                    },
                    message,
                }
            }
            Op::Unregister { slot } => Command::Unregister {
                enqueuer: self.enqueuers.remove(slot)?.0,
            },
            Op::Consume {
                slot,
                node,
                no_ack,
                prefetch,
                priority,
                visibility_ms,
                timeout_ms,
            } => {
                self.next_consumer += 1;
                let id = ConsumerId(qualify(*node, self.next_consumer)?);
                self.consumers.insert(*slot, id);
                let mut arguments = FieldTable::new();
                if let Some(ms) = visibility_ms {
                    arguments.insert("x-visibility-timeout", FieldValue::I64(*ms as i64));
                }
                if let Some(ms) = timeout_ms {
                    arguments.insert("x-consumer-timeout", FieldValue::I64(*ms as i64));
                }
                Command::Consume {
                    id,
                    spec: ConsumerSpec {
                        group: group(*node),
                        tag: ShortStr::try_from_string(format!("ctag-{slot}")).ok()?,
                        no_ack: *no_ack,
                        prefetch: *prefetch,
                        exclusive: false,
                        priority: *priority,
                        arguments,
                    },
                }
            }
            Op::Cancel { slot } => Command::Cancel {
                id: self.consumers.remove(slot)?,
            },
            Op::Credit {
                node,
                blocked,
                limit,
            } => Command::Credit {
                group: group(*node),
                credit: Credit {
                    blocked: *blocked,
                    limit: *limit,
                },
            },
            Op::Checkout { max } => Command::Checkout { max: *max },
            Op::Get { no_ack, node } => Command::GetBy {
                no_ack: *no_ack,
                node: *node,
            },
            Op::Settle { pick, stale } => Command::Settle {
                receipt: self.receipt(m, *pick, *stale),
            },
            Op::Return { pick, stale } => Command::Return {
                receipt: self.receipt(m, *pick, *stale),
            },
            Op::Release { pick, stale } => Command::Release {
                receipt: self.receipt(m, *pick, *stale),
            },
            Op::Discard { pick, stale } => Command::Discard {
                receipt: self.receipt(m, *pick, *stale),
            },
            Op::Extend { pick, timeout_ms } => Command::Extend {
                receipt: self.receipt(m, *pick, false),
                timeout_ms: *timeout_ms,
            },
            Op::Down { node } => Command::Down { node: *node },
            Op::Tick { advance } => {
                self.now += advance;
                Command::Tick
            }
            Op::Configure(p) => Command::Configure(Policy {
                max_priority: self.max_priority,
                deliver_on_apply: self.deliver_on_apply,
                ..*p
            }),
            Op::Touch => Command::Touch,
            Op::Purge => Command::Purge,
            Op::DeadLettered { pick } => {
                let held: Vec<u64> = m.dead_held().map(|(id, _)| id).collect();
                let mut ids: Vec<u64> = held
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| (pick >> (i % 64)) & 1 == 1)
                    .map(|(_, id)| *id)
                    .collect();
                ids.push(m.next_msg_id() + 1);
                Command::DeadLettered { ids }
            }
            Op::CapExpiry { within } => Command::CapExpiry {
                caps: vec![
                    (m.next_msg_id() / 2, self.now + within),
                    (u64::MAX, self.now + within * 2),
                ],
            },
        };
        self.index += 1;
        let meta = Meta {
            index: self.index,
            now_ms: self.now,
        };
        Some((meta, command))
    }

    fn saw(&mut self, effects: &[Effect<Message>]) {
        for e in effects {
            if let Effect::Deliver(d) = e {
                self.receipts.push(d.receipt);
            }
        }
    }
}

fn snapshot(m: &QueueMachine<Message>) -> Result<Bytes, TestCaseError> {
    let mut out = BytesMut::new();
    m.snapshot(&mut out)
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    Ok(out.freeze())
}

/// The snapshot written in chunks of about `chunk` bytes ([`QueueMachine::snapshot_to`]): its
/// prefix, then what the sink took, in order.
fn streamed(m: &QueueMachine<Message>, chunk: usize) -> Result<Bytes, TestCaseError> {
    let mut chunks: Vec<Vec<u8>> = Vec::new();
    let prefix = m
        .snapshot_to(chunk, &mut |c: &[u8]| {
            chunks.push(c.to_vec());
            Ok(())
        })
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    if let Some((_, all_but_last)) = chunks.split_last() {
        prop_assert!(all_but_last.iter().all(|c| c.len() >= chunk));
    }
    let mut out = prefix.to_vec();
    chunks.iter().for_each(|c| out.extend_from_slice(c));
    Ok(Bytes::from(out))
}

/// Every state on the way round-trips too (cheap on these small machines), and its snapshot
/// streamed in chunks is the same bytes as written whole.
fn round_trips(m: &QueueMachine<Message>) -> Result<(), TestCaseError> {
    let bytes = snapshot(m)?;
    let chunk = 1 + (m.digest() % 300) as usize;
    prop_assert_eq!(
        &streamed(m, chunk)?,
        &bytes,
        "streamed in chunks of {}",
        chunk
    );
    let back =
        QueueMachine::restore_snapshot(bytes).map_err(|e| TestCaseError::fail(e.to_string()))?;
    prop_assert_eq!(back.digest(), m.digest());
    Ok(())
}

fn step(
    m: &mut QueueMachine<Message>,
    meta: Meta,
    c: Command<Message>,
    effects: &mut Vec<Effect<Message>>,
) -> (Reply, u64) {
    effects.clear();
    let reply = m.apply(meta, c, effects);
    (reply, effects_digest(&reply, effects))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn a_restored_snapshot_is_the_same_machine_from_then_on(
        declared in policy(),
        ops in prop::collection::vec(op(), 0..150),
        at in any::<prop::sample::Index>(),
    ) {
        let mut d = Driver {
            index: 0,
            now: 1_000,
            bodies: 0,
            max_priority: declared.max_priority,
            deliver_on_apply: declared.deliver_on_apply,
            consumers: BTreeMap::new(),
            next_consumer: 0,
            enqueuers: BTreeMap::new(),
            next_enqueuer: 0,
            receipts: Vec::new(),
        };
        let mut a = QueueMachine::<Message>::new();
        let mut effects = Vec::new();
        let declare = Op::Configure(declared);
        let split = at.index(ops.len() + 1);
        for op in std::iter::once(&declare).chain(&ops[..split]) {
            let Some((meta, c)) = d.command(op, &a) else { continue };
            step(&mut a, meta, c, &mut effects);
            d.saw(&effects);
            prop_assert!(a.census_is_current(), "the line's census drifted");
            round_trips(&a)?;
        }
        let bytes = snapshot(&a)?;
        let mut b = QueueMachine::restore_snapshot(bytes.clone())
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(b.digest(), a.digest());
        prop_assert_eq!(&snapshot(&b)?, &bytes, "a restored machine snapshots to other bytes");
        let mut effects_b = Vec::new();
        for op in &ops[split..] {
            let Some((meta, c)) = d.command(op, &a) else { continue };
            let got_a = step(&mut a, meta, c.clone(), &mut effects);
            let got_b = step(&mut b, meta, c.clone(), &mut effects_b);
            prop_assert_eq!(got_a, got_b, "reply or effects differ at {:?}", c);
            prop_assert_eq!(a.digest(), b.digest(), "state differs after {:?}", c);
            prop_assert!(b.census_is_current(), "the census drifted after a restore");
            d.saw(&effects);
        }
        prop_assert_eq!(snapshot(&a)?, snapshot(&b)?);
    }
}
