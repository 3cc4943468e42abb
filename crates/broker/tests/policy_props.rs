//! Property tests for queues with a policy (`x-max-length`, `x-overflow`, `x-max-priority`,
//! `x-delivery-limit`, single active consumer, consumer priorities): random command sequences,
//! with every message accounted for after every step, the policy's promise checked, and the
//! log replayed into a fresh machine.

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;
use warren_broker::machine::{
    effects_digest, Command, ConsumerId, ConsumerSpec, CreditGroup, DeadLetterReason, Effect, Meta,
    MsgMeta, Policy, QueueMachine, Receipt, Reply, RetryPolicy,
};
use warren_broker::queue::args::Overflow;
use warren_codec::{FieldTable, ShortStr};

/// A message is its id and priority.
type Msg = (u64, u8);

#[derive(Clone, Debug)]
enum Op {
    Enqueue {
        priority: u8,
        ttl: Option<u64>,
        /// Its message group (used when the queue has no priorities, as the broker does).
        group: Option<u8>,
    },
    Consume {
        priority: i64,
        prefetch: u32,
    },
    Cancel {
        pick: usize,
    },
    Checkout {
        max: u32,
    },
    Get,
    Settle {
        pick: usize,
    },
    Return {
        pick: usize,
    },
    Discard {
        pick: usize,
    },
    Tick {
        advance: u64,
    },
    /// Extends a delivery's visibility.
    Extend {
        pick: usize,
        ms: u64,
    },
    /// An ack with the receipt of a delivery that timed out.
    LateSettle {
        pick: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (0u8..12, prop::option::weighted(0.2, 1u64..40), prop::option::weighted(0.5, 0u8..3))
            .prop_map(|(priority, ttl, group)| Op::Enqueue { priority, ttl, group }),
        1 => (-2i64..3, 0u32..4).prop_map(|(priority, prefetch)| Op::Consume { priority, prefetch }),
        1 => any::<usize>().prop_map(|pick| Op::Cancel { pick }),
        3 => (1u32..5).prop_map(|max| Op::Checkout { max }),
        1 => Just(Op::Get),
        2 => any::<usize>().prop_map(|pick| Op::Settle { pick }),
        2 => any::<usize>().prop_map(|pick| Op::Return { pick }),
        1 => any::<usize>().prop_map(|pick| Op::Discard { pick }),
        1 => (0u64..20).prop_map(|advance| Op::Tick { advance }),
        1 => (any::<usize>(), 1u64..30).prop_map(|(pick, ms)| Op::Extend { pick, ms }),
        1 => any::<usize>().prop_map(|pick| Op::LateSettle { pick }),
    ]
}

fn policy() -> impl Strategy<Value = Policy> {
    (
        prop::option::of(0u64..5),
        prop::option::of(0u64..6),
        prop_oneof![
            Just(Overflow::DropHead),
            Just(Overflow::RejectPublish),
            Just(Overflow::RejectPublishDlx)
        ],
        prop::option::of(0u8..10),
        any::<bool>(),
        prop::option::of(0u64..3),
        prop::option::of(1u64..30),
        prop::option::weighted(0.3, 1u64..40),
        prop::option::weighted(
            0.3,
            (
                1u64..20,
                prop::option::of(1u64..60),
                prop::option::of(1u64..4),
                0u8..60,
            ),
        ),
        any::<bool>(),
    )
        .prop_map(
            |(
                max_length,
                max_length_bytes,
                overflow,
                max_priority,
                single_active,
                delivery_limit,
                visibility_timeout_ms,
                consumer_timeout_ms,
                retry,
                index_groups,
            )| {
                Policy {
                    max_length,
                    max_length_bytes,
                    overflow,
                    expires_ms: None,
                    max_priority,
                    single_active,
                    delivery_limit,
                    visibility_timeout_ms,
                    consumer_timeout_ms,
                    retry: retry.map(|(min_ms, max_ms, multiplier, jitter_pct)| RetryPolicy {
                        min_ms,
                        max_ms,
                        multiplier,
                        jitter_pct,
                    }),
                    deliver_on_apply: false,
                    hold_dead_letters: false,
                    index_groups,
                }
            },
        )
}

/// Where each message is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Place {
    Ready,
    InFlight(Option<ConsumerId>, u32),
    /// Waiting for a delayed retry due at this time.
    Retrying(u64),
    Gone,
}

struct Run {
    m: QueueMachine<Msg>,
    now: u64,
    log: Vec<(Meta, Command<Msg>, u64)>,
    places: BTreeMap<u64, Place>,
    consumers: Vec<(ConsumerId, i64, u32)>,
    next_consumer: u64,
    effects: Vec<Effect<Msg>>,
    /// The latest attempt of each message that was delivered.
    attempts: BTreeMap<u64, u32>,
    /// Receipts of deliveries that timed out.
    timed_out: Vec<Receipt>,
    /// Messages whose delivery was extended (a deadline even without the queue's timeout).
    extended: BTreeSet<u64>,
    /// The group of each message enqueued in one.
    groups: BTreeMap<u64, u8>,
}

impl Run {
    fn apply(&mut self, c: Command<Msg>) -> Reply {
        let meta = Meta {
            index: self.log.len() as u64 + 1,
            now_ms: self.now,
        };
        self.effects.clear();
        let reply = self.m.apply(meta, c.clone(), &mut self.effects);
        self.log
            .push((meta, c, effects_digest(&reply, &self.effects)));
        reply
    }

    /// Books the effects of the last command: deliveries and dead letters.
    fn book(&mut self, policy: &Policy) -> Result<Vec<(u64, Option<ConsumerId>)>, TestCaseError> {
        let mut delivered = Vec::new();
        for e in self.effects.clone() {
            match e {
                Effect::Deliver(d) => {
                    let id = d.receipt.msg_id;
                    if let Some(g) = self.groups.get(&id) {
                        // Everything before it in its group is done (settled or dead-lettered):
                        // publish order, and never two of a group out at once.
                        let earlier_left = self
                            .groups
                            .range(..id)
                            .filter(|(_, h)| *h == g)
                            .all(|(e, _)| self.places.get(e) == Some(&Place::Gone));
                        prop_assert!(
                            earlier_left,
                            "{} of group {} overtook an earlier one",
                            id,
                            g
                        );
                        let alone = self.groups.iter().filter(|(_, h)| *h == g).all(|(e, _)| {
                            !matches!(
                                self.places.get(e),
                                Some(Place::InFlight(..) | Place::Retrying(_))
                            )
                        });
                        prop_assert!(alone, "{} of group {} delivered beside another", id, g);
                    }
                    prop_assert_eq!(
                        self.places.get(&id),
                        Some(&Place::Ready),
                        "{} delivered twice",
                        id
                    );
                    let place = if d.settled {
                        Place::Gone
                    } else {
                        Place::InFlight(d.consumer, d.receipt.attempt)
                    };
                    self.places.insert(id, place);
                    self.attempts.insert(id, d.receipt.attempt);
                    delivered.push((id, d.consumer));
                }
                Effect::TimedOut {
                    msg_id, attempt, ..
                } => {
                    let held = matches!(self.places.get(&msg_id), Some(Place::InFlight(_, a)) if *a == attempt);
                    prop_assert!(held, "{} timed out but was not in flight", msg_id);
                    let deadline = policy.visibility_timeout_ms.is_some()
                        || policy.consumer_timeout_ms.is_some()
                        || self.extended.contains(&msg_id);
                    prop_assert!(deadline, "{} timed out with no timeout", msg_id);
                    let back = self.back(policy, msg_id, attempt);
                    self.places.insert(msg_id, back);
                    self.timed_out.push(Receipt { msg_id, attempt });
                }
                Effect::ConsumerTimedOut { consumer, .. } => {
                    prop_assert!(policy.consumer_timeout_ms.is_some());
                    let before = self.consumers.len();
                    self.consumers.retain(|c| c.0 != consumer);
                    prop_assert_eq!(
                        self.consumers.len() + 1,
                        before,
                        "{:?} cancelled twice",
                        consumer
                    );
                }
                Effect::SettledLate {
                    msg_id,
                    delivery_count,
                    ..
                } => {
                    let waiting = matches!(
                        self.places.get(&msg_id),
                        Some(Place::Ready | Place::Retrying(_))
                    );
                    prop_assert!(waiting, "{} settled late but not waiting", msg_id);
                    prop_assert_eq!(self.attempts.get(&msg_id), Some(&delivery_count));
                    self.places.insert(msg_id, Place::Gone);
                }
                Effect::DeadLetter {
                    msg_id,
                    reason,
                    delivery_count,
                    ..
                } => {
                    let was = self.places.get(&msg_id).copied();
                    match reason {
                        DeadLetterReason::MaxLen | DeadLetterReason::Expired => {
                            prop_assert_eq!(was, Some(Place::Ready))
                        }
                        DeadLetterReason::DeliveryLimit => {
                            let limit = policy.delivery_limit.unwrap_or(u64::MAX);
                            prop_assert!(u64::from(delivery_count) > limit);
                        }
                        DeadLetterReason::Rejected => {}
                    }
                    self.places.insert(msg_id, Place::Gone);
                }
            }
        }
        Ok(delivered)
    }

    /// Where a message given back (returned or timed out) goes: a delayed retry, or the line.
    fn back(&self, policy: &Policy, msg_id: u64, attempt: u32) -> Place {
        match policy.retry {
            Some(r) => Place::Retrying(self.now + r.delay(msg_id, attempt)),
            None => Place::Ready,
        }
    }

    fn in_flight(&self) -> Vec<(u64, Option<ConsumerId>, u32)> {
        self.places
            .iter()
            .filter_map(|(id, p)| match p {
                Place::InFlight(c, a) => Some((*id, *c, *a)),
                _ => None,
            })
            .collect()
    }
}

fn check(r: &Run, policy: &Policy) -> Result<(), TestCaseError> {
    let ready: BTreeSet<u64> = r
        .places
        .iter()
        .filter(|(_, p)| **p == Place::Ready)
        .map(|(id, _)| *id)
        .collect();
    let retrying = r
        .places
        .values()
        .filter(|p| matches!(p, Place::Retrying(_)))
        .count();
    prop_assert_eq!(r.m.retrying_count(), retrying);
    prop_assert_eq!(
        r.m.ready_count(),
        ready.len() + retrying,
        "every message in one place"
    );
    prop_assert_eq!(r.m.in_flight_count(), r.in_flight().len());
    prop_assert!(r.m.census_is_current(), "the line's census drifted");
    // A checkout from here delivers what one that walks the whole line would, and only when
    // the machine says it would (the broker runs none otherwise).
    {
        let checkout = |index_groups: bool| {
            let mut m = r.m.clone();
            let meta = |index| Meta {
                index,
                now_ms: r.now,
            };
            let mut effects = Vec::new();
            let p = Policy {
                index_groups,
                ..*policy
            };
            m.apply(meta(u64::MAX - 1), Command::Configure(p), &mut effects);
            m.apply(meta(u64::MAX), Command::Checkout { max: 64 }, &mut effects);
            effects
                .iter()
                .filter_map(|e| match e {
                    Effect::Deliver(d) => Some(d.receipt.msg_id),
                    _ => None,
                })
                .collect::<Vec<u64>>()
        };
        let counted = checkout(true);
        prop_assert_eq!(&counted, &checkout(false), "a deliverable message left");
        prop_assert!(
            counted.is_empty() || r.m.has_work(),
            "work the broker would not see"
        );
    }
    let ids = r.m.ready_ids();
    prop_assert_eq!(ids.iter().copied().collect::<BTreeSet<u64>>(), ready);
    if let Some(max) = policy.max_priority {
        // Highest priority first, then id order (a returned message goes back in place).
        let key = |id: &u64| {
            let p =
                r.m.ready_messages()
                    .find(|(i, _, _)| i == id)
                    .map(|(_, m, _)| m.1);
            (std::cmp::Reverse(p.unwrap_or(0).min(max)), *id)
        };
        let mut sorted = ids.clone();
        sorted.sort_by_key(key);
        prop_assert_eq!(&ids, &sorted);
    }
    Ok(())
}

fn run(policy: Policy, ops: Vec<Op>) -> Result<Run, TestCaseError> {
    let mut r = Run {
        m: QueueMachine::new(),
        now: 0,
        log: Vec::new(),
        places: BTreeMap::new(),
        consumers: Vec::new(),
        next_consumer: 1,
        effects: Vec::new(),
        attempts: BTreeMap::new(),
        timed_out: Vec::new(),
        extended: BTreeSet::new(),
        groups: BTreeMap::new(),
    };
    r.apply(Command::Configure(policy));
    for op in ops {
        match op {
            Op::Enqueue {
                priority,
                ttl,
                group,
            } => {
                let id = r.m.next_msg_id();
                let was_full = r.m.rejects(1);
                let group = group.filter(|_| policy.max_priority.is_none());
                let meta = MsgMeta {
                    size: 1,
                    expires_at: ttl.map(|t| r.now + t),
                    priority: policy.max_priority.map_or(0, |m| priority.min(m)),
                    group: group.and_then(|g| std::num::NonZeroU64::new(u64::from(g) + 1)),
                    ..MsgMeta::default()
                };
                let reply = r.apply(Command::Enqueue {
                    message: (id, priority),
                    meta,
                });
                match reply {
                    Reply::Enqueued { msg_id } => {
                        prop_assert!(!was_full);
                        prop_assert_eq!(msg_id, id);
                        r.places.insert(id, Place::Ready);
                        if let Some(g) = group {
                            r.groups.insert(id, g);
                        }
                    }
                    Reply::Refused(_) => {
                        prop_assert!(was_full && policy.overflow != Overflow::DropHead);
                        prop_assert!(r.effects.is_empty());
                        continue;
                    }
                    other => return Err(TestCaseError::fail(format!("{other:?}"))),
                }
                r.book(&policy)?;
                if policy.overflow == Overflow::DropHead {
                    if let Some(n) = policy.max_length {
                        prop_assert!((r.m.ready_count() - r.m.retrying_count()) as u64 <= n);
                    }
                    if let Some(n) = policy.max_length_bytes.filter(|_| policy.retry.is_none()) {
                        prop_assert!(r.m.ready_bytes() <= n);
                    }
                }
            }
            Op::Consume { priority, prefetch } => {
                let id = ConsumerId(r.next_consumer);
                r.next_consumer += 1;
                let spec = ConsumerSpec {
                    group: CreditGroup {
                        conn: 1,
                        channel: id.0 as u16,
                    },
                    tag: ShortStr::from("c"),
                    no_ack: false,
                    prefetch,
                    exclusive: false,
                    priority,
                    arguments: FieldTable::new(),
                };
                prop_assert_eq!(r.apply(Command::Consume { id, spec }), Reply::Ok);
                r.consumers.push((id, priority, prefetch));
            }
            Op::Cancel { pick } => {
                if r.consumers.is_empty() {
                    continue;
                }
                let (id, ..) = r.consumers.remove(pick % r.consumers.len());
                r.apply(Command::Cancel { id });
            }
            Op::Checkout { max } => {
                r.apply(Command::Checkout { max });
                let delivered = r.book(&policy)?;
                if policy.single_active {
                    // Only the oldest consumer still there receives.
                    let oldest = r.consumers.iter().map(|c| c.0).min();
                    for (_, c) in &delivered {
                        prop_assert_eq!(*c, oldest);
                    }
                } else if let Some(&(_, first)) = delivered.first() {
                    // Nobody of a higher priority than the first served was left with credit
                    // before it (checked on the first delivery of the checkout).
                    let p = r.consumers.iter().find(|c| Some(c.0) == first).map(|c| c.1);
                    let held = |id: ConsumerId| {
                        r.in_flight().iter().filter(|f| f.1 == Some(id)).count() as u32
                    };
                    for (id, prio, prefetch) in &r.consumers {
                        if p.is_some_and(|p| *prio > p) {
                            let had_room = *prefetch == 0 || held(*id) < *prefetch;
                            prop_assert!(!had_room, "{:?} (priority {}) skipped", id, prio);
                        }
                    }
                }
            }
            Op::Get => {
                r.apply(Command::Get { no_ack: false });
                r.book(&policy)?;
            }
            Op::Settle { pick } | Op::Return { pick } | Op::Discard { pick } => {
                let flying = r.in_flight();
                if flying.is_empty() {
                    continue;
                }
                let (msg_id, _, attempt) = flying[pick % flying.len()];
                let receipt = Receipt { msg_id, attempt };
                let (c, after) = match op {
                    Op::Settle { .. } => (Command::Settle { receipt }, Place::Gone),
                    Op::Return { .. } => (
                        Command::Return { receipt },
                        r.back(&policy, msg_id, attempt),
                    ),
                    _ => (Command::Discard { receipt }, Place::Gone),
                };
                prop_assert_eq!(r.apply(c), Reply::Ok);
                r.places.insert(msg_id, after);
                r.book(&policy)?;
            }
            Op::Tick { advance } => {
                r.now += advance;
                // Retries due by now are back in the line before anything else happens.
                let now = r.now;
                for p in r.places.values_mut() {
                    if matches!(p, Place::Retrying(at) if *at <= now) {
                        *p = Place::Ready;
                    }
                }
                r.apply(Command::Tick);
                r.book(&policy)?;
            }
            Op::Extend { pick, ms } => {
                let flying = r.in_flight();
                if flying.is_empty() {
                    continue;
                }
                let (msg_id, _, attempt) = flying[pick % flying.len()];
                let receipt = Receipt { msg_id, attempt };
                let reply = r.apply(Command::Extend {
                    receipt,
                    timeout_ms: ms,
                });
                prop_assert_eq!(reply, Reply::Ok);
                r.extended.insert(msg_id);
            }
            Op::LateSettle { pick } => {
                if r.timed_out.is_empty() {
                    continue;
                }
                let receipt = r.timed_out[pick % r.timed_out.len()];
                // Settles only a message waiting in the queue, delivered to nobody since.
                let waiting = matches!(
                    r.places.get(&receipt.msg_id),
                    Some(Place::Ready | Place::Retrying(_))
                ) && r.attempts.get(&receipt.msg_id) == Some(&receipt.attempt);
                let reply = r.apply(Command::Settle { receipt });
                prop_assert_eq!(reply, if waiting { Reply::Ok } else { Reply::Stale });
                r.book(&policy)?;
            }
        }
        check(&r, &policy)?;
    }
    Ok(r)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn policies_keep_every_message_accounted_for_and_replay(
        policy in policy(),
        ops in proptest::collection::vec(op(), 0..120),
    ) {
        let r = run(policy, ops)?;
        let mut m = QueueMachine::new();
        let mut effects = Vec::new();
        for (meta, c, want) in &r.log {
            effects.clear();
            let reply = m.apply(*meta, c.clone(), &mut effects);
            prop_assert_eq!(effects_digest(&reply, &effects), *want);
        }
        prop_assert_eq!(m.digest(), r.m.digest());
    }
}
