//! Property tests: random command sequences against the queue machine, checked step by step
//! against a simple model, and replayed into a fresh machine.

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;
use warren_codec::{FieldTable, ShortStr};
use warren_queue::machine::{
    effects_digest, Command, ConsumerId, ConsumerSpec, Credit, CreditGroup, DeadLetterReason,
    Deliver, Effect, EnqueuerId, Loaded, Meta, MsgMeta, Policy, QueueMachine, Receipt, Refusal,
    Reply,
};
use warren_queue::{node_of, qualify, NodeId, Overflow};

/// A consumer slot of the test (a slot re-used after a cancel is a new consumer).
type Slot = u8;
/// A publisher slot: one enqueuer at a time (a new one after an unregister or a down).
type PubSlot = u8;
/// The nodes of the test: channel `c` is on node `c`, publisher slot `p` on node `p % 3`.
const NODES: u16 = 3;
/// The message is its own id plus a size, so the test can check what came back.
type Msg = (u64, u64);

#[derive(Clone, Debug)]
enum Op {
    /// Every message given so far takes an expiry `within` ms from now, or keeps an earlier
    /// one (a policy's TTL set on the queue).
    CapExpiry {
        within: u64,
    },
    Enqueue {
        size: u64,
        ttl: Option<u64>,
        pageable: bool,
    },
    /// Node-local: packs the line past its first `keep` (never logged: the replay, which
    /// never packs, must come to the same digests).
    Pack {
        keep: usize,
    },
    /// Pages out past `keep` what is written: ids below `next_id - unwritten`.
    PageOut {
        keep: u32,
        unwritten: u64,
    },
    Consume {
        slot: Slot,
        channel: u16,
        no_ack: bool,
        prefetch: u32,
    },
    Cancel {
        slot: Slot,
    },
    Credit {
        channel: u16,
        blocked: bool,
        limit: Option<u32>,
    },
    Checkout {
        max: u32,
    },
    /// `node`: a `GetBy` there; `None`: a plain `Get` (node 0).
    Get {
        no_ack: bool,
        node: Option<NodeId>,
    },
    /// A node is gone.
    Down {
        node: NodeId,
    },
    /// A publish with the enqueuer's next sequence, `gap` past it (refused: out of order).
    Publish {
        slot: PubSlot,
        gap: u64,
        size: u64,
    },
    /// The enqueuer sends one of its earlier publishes again (a failover).
    Resend {
        slot: PubSlot,
        pick: usize,
    },
    /// The enqueuer's channel closes.
    Unregister {
        slot: PubSlot,
    },
    /// `x-max-length` with `reject-publish` (or no limit): publishes may be refused.
    Limit {
        max_length: Option<u64>,
    },
    Settle {
        pick: usize,
        stale: bool,
    },
    Return {
        pick: usize,
        stale: bool,
    },
    Discard {
        pick: usize,
        stale: bool,
    },
    Purge,
    Tick {
        advance: u64,
    },
    /// A message with a TTL of 0, then the broker's next dispatch `advance` ms later: a tick
    /// (the server may run one first) and a checkout.
    Ttl0 {
        size: u64,
        advance: u64,
    },
}

/// What a replicated queue's member does: nothing pageable and no `PageOut`, its line packed
/// often (messages with a TTL among them).
fn member_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => op().prop_map(|o| match o {
            Op::Enqueue { size, ttl, .. } => Op::Enqueue { size, ttl, pageable: false },
            Op::PageOut { keep, .. } => Op::Pack { keep: keep as usize },
            other => other,
        }),
        1 => (0usize..4).prop_map(|keep| Op::Pack { keep }),
        // A TTL policy set on the queue, a member's line packed or not.
        1 => (1u64..40).prop_map(|within| Op::CapExpiry { within }),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u64..100, prop::option::weighted(0.3, prop_oneof![1 => Just(0u64), 4 => 1u64..50]), prop::bool::weighted(0.8)).prop_map(|(size, ttl, pageable)| Op::Enqueue { size, ttl, pageable }),
        2 => (0u32..4, 0u64..3).prop_map(|(keep, unwritten)| Op::PageOut { keep, unwritten }),
        2 => (0usize..4).prop_map(|keep| Op::Pack { keep }),
        2 => (0u8..4, 0u16..NODES, any::<bool>(), 0u32..4).prop_map(|(slot, channel, no_ack, prefetch)| Op::Consume { slot, channel, no_ack: no_ack && slot == 3, prefetch }),
        1 => (0u8..4).prop_map(|slot| Op::Cancel { slot }),
        1 => (0u16..NODES, prop::bool::weighted(0.3), prop::option::of(0u32..4)).prop_map(|(channel, blocked, limit)| Op::Credit { channel, blocked, limit }),
        4 => (1u32..6).prop_map(|max| Op::Checkout { max }),
        1 => (any::<bool>(), prop::option::of(0u16..NODES)).prop_map(|(no_ack, node)| Op::Get { no_ack, node }),
        1 => (0u16..NODES).prop_map(|node| Op::Down { node }),
        3 => (0u8..4, prop::option::weighted(0.2, 1u64..3), 0u64..100).prop_map(|(slot, gap, size)| Op::Publish { slot, gap: gap.unwrap_or(0), size }),
        2 => (0u8..4, any::<usize>()).prop_map(|(slot, pick)| Op::Resend { slot, pick }),
        1 => (0u8..4).prop_map(|slot| Op::Unregister { slot }),
        1 => prop::option::of(1u64..6).prop_map(|max_length| Op::Limit { max_length }),
        3 => (any::<usize>(), prop::bool::weighted(0.15)).prop_map(|(pick, stale)| Op::Settle { pick, stale }),
        2 => (any::<usize>(), prop::bool::weighted(0.15)).prop_map(|(pick, stale)| Op::Return { pick, stale }),
        1 => (any::<usize>(), prop::bool::weighted(0.15)).prop_map(|(pick, stale)| Op::Discard { pick, stale }),
        1 => Just(Op::Purge),
        1 => (0u64..30).prop_map(|advance| Op::Tick { advance }),
        2 => (0u64..100, 1u64..5).prop_map(|(size, advance)| Op::Ttl0 { size, advance }),
    ]
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Ready,
    InFlight {
        consumer: Option<ConsumerId>,
        attempt: u32,
        /// The node holding it: its consumer's, or the basic.get's.
        node: NodeId,
    },
    Settled,
    Discarded,
    Purged,
    Expired,
}

#[derive(Clone, Debug)]
struct ModelConsumer {
    group: CreditGroup,
    no_ack: bool,
    prefetch: u32,
}

/// What an enqueuer sent: enqueued as a message id, or refused.
#[derive(Clone, Copy, Debug)]
enum Sent {
    Enqueued(u64),
    Refused,
}

/// One life of a publisher slot's enqueuer.
#[derive(Clone, Debug)]
struct ModelEnqueuer {
    id: EnqueuerId,
    /// Every publish sent, by sequence, with its size.
    sent: BTreeMap<u64, (Sent, u64)>,
    /// The highest sequence decided, and the highest refused.
    highest: u64,
    refused: Option<u64>,
}

#[derive(Default)]
struct Model {
    state: BTreeMap<u64, State>,
    /// Messages the "store" holds: pageable ones, until they leave the queue.
    stored: BTreeSet<u64>,
    /// Of those, the ones in the scratch area.
    spilled: BTreeSet<u64>,
    size: BTreeMap<u64, u64>,
    expires: BTreeMap<u64, u64>,
    deliveries: BTreeMap<u64, u32>,
    consumers: BTreeMap<ConsumerId, ModelConsumer>,
    slots: BTreeMap<Slot, ConsumerId>,
    credit: BTreeMap<CreditGroup, Credit>,
    next_consumer: u64,
    enqueuers: BTreeMap<PubSlot, ModelEnqueuer>,
    next_enqueuer: u64,
    /// `x-max-length` with `reject-publish`.
    max_length: Option<u64>,
    now: u64,
}

/// Channel `c` is on node `c`.
fn group(channel: u16) -> CreditGroup {
    CreditGroup {
        conn: qualify(channel, 7).unwrap(),
        channel,
    }
}

fn pub_node(slot: PubSlot) -> NodeId {
    NodeId::from(slot) % NODES
}

impl Model {
    fn ready(&self) -> BTreeSet<u64> {
        self.state
            .iter()
            .filter(|(_, s)| **s == State::Ready)
            .map(|(id, _)| *id)
            .collect()
    }

    fn in_flight(&self) -> Vec<(u64, Option<ConsumerId>, u32)> {
        self.state
            .iter()
            .filter_map(|(id, s)| match s {
                State::InFlight {
                    consumer, attempt, ..
                } => Some((*id, *consumer, *attempt)),
                _ => None,
            })
            .collect()
    }

    /// Would the queue refuse a publish now?
    fn full(&self) -> bool {
        self.max_length
            .is_some_and(|n| self.ready().len() as u64 >= n)
    }

    fn held(&self, c: ConsumerId) -> u32 {
        self.in_flight()
            .iter()
            .filter(|(_, who, _)| *who == Some(c))
            .count() as u32
    }

    fn may_take(&self, id: ConsumerId) -> bool {
        let Some(c) = self.consumers.get(&id) else {
            return false;
        };
        let credit = self.credit.get(&c.group).copied().unwrap_or_default();
        if credit.blocked {
            return false;
        }
        if c.no_ack {
            return true;
        }
        (c.prefetch == 0 || self.held(id) < c.prefetch) && credit.limit.is_none_or(|n| n > 0)
    }

    /// Records a delivery, checking it took the head of the queue and was allowed. `node`: the
    /// node of a basic.get.
    fn delivered(&mut self, d: &Deliver<Msg>, node: NodeId) -> Result<(), TestCaseError> {
        let id = d.receipt.msg_id;
        prop_assert_eq!(Some(id), self.ready().first().copied(), "not the head");
        prop_assert_eq!(d.message.0, id);
        let before = self.deliveries.get(&id).copied().unwrap_or(0);
        prop_assert_eq!(d.redelivered, before > 0);
        prop_assert_eq!(d.receipt.attempt, before + 1);
        self.deliveries.insert(id, before + 1);
        if let Some(c) = d.consumer {
            prop_assert!(self.may_take(c), "delivery to {:?} without credit", c);
            let mc = &self.consumers[&c];
            prop_assert_eq!(d.settled, mc.no_ack);
            if !mc.no_ack {
                if let Some(n) = self
                    .credit
                    .get_mut(&mc.group)
                    .and_then(|cr| cr.limit.as_mut())
                {
                    *n = n.saturating_sub(1);
                }
            }
        }
        if d.settled {
            self.stored.remove(&id);
        }
        let next = if d.settled {
            State::Settled
        } else {
            State::InFlight {
                consumer: d.consumer,
                attempt: d.receipt.attempt,
                node: d.consumer.map_or(node, ConsumerId::node),
            }
        };
        self.state.insert(id, next);
        Ok(())
    }
}

/// Applies commands with consecutive indexes and keeps the log for a replay.
struct Runner {
    m: QueueMachine<Msg>,
    effects: Vec<Effect<Msg>>,
    log: Vec<(Meta, Command<Msg>, u64)>,
    /// Whether each command changed the queue (beyond its index and time).
    changed: Vec<bool>,
    /// The time the machine's expiry should go by until the next checkout (its `handoff`): set
    /// by a message due at once enqueued with work for a checkout, ended by that checkout or
    /// when the work goes.
    handoff: Option<u64>,
}

impl Runner {
    fn new() -> Self {
        Runner {
            m: QueueMachine::new(),
            effects: Vec::new(),
            log: Vec::new(),
            changed: Vec::new(),
            handoff: None,
        }
    }

    /// What a tick or a checkout expires by.
    fn expiry_now(&self, now: u64) -> u64 {
        self.handoff.unwrap_or(now)
    }

    fn apply(&mut self, now: u64, c: Command<Msg>) -> Reply {
        let meta = Meta {
            index: self.log.len() as u64 + 1,
            now_ms: now,
        };
        self.effects.clear();
        let paging = |m: &QueueMachine<Msg>| m.paging_totals();
        let before = paging(&self.m);
        // What a Down or an enqueue with a sequence may change beyond its reply.
        let seq = |m: &QueueMachine<Msg>| match &c {
            Command::EnqueueFrom { enqueuer, .. } => m.enqueuer_seq(*enqueuer),
            _ => None,
        };
        let probe = |m: &QueueMachine<Msg>| (m.in_flight_count(), m.enqueuer_count(), seq(m));
        let probed = probe(&self.m);
        let reply = self.m.apply(meta, c.clone(), &mut self.effects);
        let due = match &c {
            Command::Enqueue { meta, .. } | Command::EnqueueFrom { meta, .. } => {
                meta.expires_at.is_some_and(|at| at <= now)
            }
            _ => false,
        };
        if due && matches!(reply, Reply::Enqueued { .. }) && self.m.has_work() {
            self.handoff.get_or_insert(now);
        }
        if matches!(c, Command::Checkout { .. } | Command::Configure(_)) || !self.m.has_work() {
            self.handoff = None;
        }
        let paging_changed = before != paging(&self.m);
        let changed = match (&c, reply) {
            (Command::PageOut { .. } | Command::Load { .. }, _) => paging_changed,
            (Command::Down { .. } | Command::EnqueueFrom { .. }, _) => {
                probed != probe(&self.m) || matches!(reply, Reply::Cancelled { .. })
            }
            (Command::Unregister { .. }, Reply::Ok) => true,
            (_, Reply::Enqueued { .. } | Reply::Cancelled { .. }) => true,
            (_, Reply::Purged { count } | Reply::Delivered { count }) => count > 0,
            (Command::Consume { .. } | Command::Settle { .. }, Reply::Ok) => true,
            (Command::Return { .. } | Command::Discard { .. }, Reply::Ok) => true,
            (Command::Tick, _) => !self.effects.is_empty(),
            _ => false,
        };
        self.changed.push(changed);
        self.log
            .push((meta, c, effects_digest(&reply, &self.effects)));
        reply
    }
}

/// Ready ids inside the machine's paged runs.
fn paged(m: &QueueMachine<Msg>, ready: &BTreeSet<u64>) -> BTreeSet<u64> {
    m.paged_runs()
        .flat_map(|(a, b)| ready.range(a..=b).copied())
        .collect()
}

/// What the broker does before a checkout or a get: the store reads the run's range back
/// (at most `max` messages), and the machine loads them.
fn load(
    r: &mut Runner,
    model: &mut Model,
    now: u64,
    low_water: usize,
    max: usize,
) -> Result<(), TestCaseError> {
    let Some(req) = r.m.load_request(low_water) else {
        return Ok(());
    };
    let found: Vec<u64> = model
        .stored
        .range(req.from_id..=req.to_id)
        .copied()
        .take(max)
        .collect();
    // Only ready messages may be in a run's range: the run holds exactly its messages, all
    // from one place.
    for id in &found {
        prop_assert_eq!(
            model.spilled.contains(id),
            req.spilled,
            "mixed run at {}",
            id
        );
        prop_assert_eq!(
            model.state.get(id),
            Some(&State::Ready),
            "run range holds {}",
            id
        );
    }
    let through_id = if found.len() == max {
        found[max - 1]
    } else {
        req.to_id
    };
    let messages = found
        .iter()
        .map(|id| Loaded {
            msg_id: *id,
            message: (*id, model.size[id]),
            meta: MsgMeta {
                size: model.size[id],
                expires_at: model.expires.get(id).copied(),
                pageable: true,
                spilled: req.spilled,
                priority: 0,
                group: None,
            },
            delivery_count: model.deliveries.get(id).copied().unwrap_or(0),
        })
        .collect();
    let reply = r.apply(
        now,
        Command::Load {
            messages,
            through_id,
        },
    );
    prop_assert_eq!(reply, Reply::Ok);
    // What expired on disk goes as it is read back.
    for e in r.effects.clone() {
        match e {
            Effect::DeadLetter {
                msg_id,
                reason: DeadLetterReason::Expired,
                ..
            } => {
                prop_assert!(model.expires.get(&msg_id).is_some_and(|at| *at < now));
                // Loaded or already in memory: everything due goes.
                prop_assert_eq!(model.state.get(&msg_id), Some(&State::Ready));
                model.state.insert(msg_id, State::Expired);
                model.stored.remove(&msg_id);
            }
            other => return Err(TestCaseError::fail(format!("{other:?}"))),
        }
    }
    Ok(())
}

/// A message that expired as a checkout or get began: it was ready, in memory, and its time
/// had passed.
fn expired_now(model: &mut Model, e: &Effect<Msg>, now: u64) -> Result<(), TestCaseError> {
    let Effect::DeadLetter {
        msg_id,
        reason: DeadLetterReason::Expired,
        ..
    } = e
    else {
        return Err(TestCaseError::fail(format!("{e:?}")));
    };
    prop_assert!(model.expires.get(msg_id).is_some_and(|at| *at < now));
    prop_assert_eq!(model.state.get(msg_id), Some(&State::Ready));
    model.state.insert(*msg_id, State::Expired);
    model.stored.remove(msg_id);
    Ok(())
}

fn check(m: &QueueMachine<Msg>, model: &Model) -> Result<(), TestCaseError> {
    // Exactly one place per message.
    prop_assert_eq!(model.state.len() as u64, m.next_msg_id());
    let ready = model.ready();
    prop_assert_eq!(m.ready_count(), ready.len());
    let on_disk = paged(m, &ready);
    prop_assert_eq!(m.paged_count(), on_disk.len() as u64);
    prop_assert!(m.census_is_current(), "the line's census drifted");
    for id in &on_disk {
        prop_assert!(model.stored.contains(id), "{} paged but not stored", id);
    }
    let in_memory: Vec<u64> = ready.difference(&on_disk).copied().collect();
    prop_assert_eq!(m.ready_ids(), in_memory.clone());
    let flying = model.in_flight();
    prop_assert_eq!(m.in_flight_count(), flying.len());
    for (id, who, attempt) in &flying {
        let r = Receipt {
            msg_id: *id,
            attempt: *attempt,
        };
        prop_assert_eq!(m.holder(r), Some(*who));
        let Some(State::InFlight { node, .. }) = model.state.get(id) else {
            unreachable!()
        };
        prop_assert_eq!(m.holder_node(r), Some(*node));
    }
    // The machine remembers exactly the live enqueuers, each at its highest decided sequence.
    prop_assert_eq!(m.enqueuer_count(), model.enqueuers.len());
    for e in model.enqueuers.values() {
        prop_assert_eq!(m.enqueuer_seq(e.id), Some(e.highest));
    }
    let bytes = |ids: &mut dyn Iterator<Item = u64>| ids.map(|id| model.size[&id]).sum::<u64>();
    prop_assert_eq!(m.ready_bytes(), bytes(&mut ready.iter().copied()));
    prop_assert_eq!(m.in_flight_bytes(), bytes(&mut flying.iter().map(|f| f.0)));
    // Prefetch respected; the machine's view of what each consumer holds is the model's.
    let held: BTreeMap<ConsumerId, u32> = m.consumers().map(|(id, _, h)| (id, h)).collect();
    prop_assert_eq!(held.len(), model.consumers.len());
    for (id, c) in &model.consumers {
        prop_assert_eq!(held.get(id).copied(), Some(model.held(*id)));
        if c.prefetch > 0 && !c.no_ack {
            prop_assert!(model.held(*id) <= c.prefetch);
        }
    }
    // The next deadline is just past the earliest expiry among ready messages in memory; a
    // paged run with nothing in memory ahead of it may bring it forward (the run is read back
    // when its earliest message is due; after a partial read that bound may be early).
    let earliest = |ids: &mut dyn Iterator<Item = &u64>| {
        ids.filter_map(|id| model.expires.get(id))
            .min()
            .map(|at| at + 1)
    };
    // While a handoff is pending the checkout owed expires what is due: no deadline for it.
    let memory = if m.handoff().is_some() {
        None
    } else {
        earliest(&mut in_memory.iter())
    };
    if on_disk.is_empty() {
        prop_assert_eq!(m.next_deadline(), memory);
    } else if let Some(at) = memory {
        prop_assert!(m.next_deadline().is_some_and(|d| d <= at));
    }
    Ok(())
}

fn pick_receipt(model: &Model, pick: usize, stale: bool, next_id: u64) -> Receipt {
    let flying = model.in_flight();
    if !stale && !flying.is_empty() {
        let (msg_id, _, attempt) = flying[pick % flying.len()];
        return Receipt { msg_id, attempt };
    }
    // An old attempt of a flying message, or any id at all.
    match flying.get(pick % flying.len().max(1)) {
        Some(&(msg_id, _, attempt)) if attempt > 1 && pick.is_multiple_of(2) => Receipt {
            msg_id,
            attempt: attempt - 1,
        },
        _ => Receipt {
            msg_id: (pick as u64) % (next_id + 2),
            attempt: 1 + (pick as u32 % 3),
        },
    }
}

/// Enqueues a message of `size` expiring `ttl` ms from now; its id, unless the queue refused it.
fn enqueue(
    r: &mut Runner,
    model: &mut Model,
    size: u64,
    ttl: Option<u64>,
    pageable: bool,
) -> Result<Option<u64>, TestCaseError> {
    let now = model.now;
    let id = r.m.next_msg_id();
    let expires_at = ttl.map(|t| now + t);
    let reply = r.apply(
        now,
        Command::Enqueue {
            message: (id, size),
            meta: MsgMeta {
                size,
                expires_at,
                pageable,
                // Two kinds of storage: runs must never mix them.
                spilled: pageable && size.is_multiple_of(2),
                priority: 0,
                group: None,
            },
        },
    );
    if model.full() {
        prop_assert_eq!(reply, Reply::Refused(Refusal::Full));
        prop_assert_eq!(r.m.next_msg_id(), id);
        return Ok(None);
    }
    prop_assert_eq!(reply, Reply::Enqueued { msg_id: id });
    prop_assert!(r.effects.is_empty(), "{:?}", r.effects);
    model.state.insert(id, State::Ready);
    if pageable {
        model.stored.insert(id);
    }
    if pageable && size.is_multiple_of(2) {
        model.spilled.insert(id);
    }
    model.size.insert(id, size);
    if let Some(at) = expires_at {
        model.expires.insert(id, at);
    }
    Ok(Some(id))
}

fn checkout(r: &mut Runner, model: &mut Model, max: u32) -> Result<(), TestCaseError> {
    let now = model.now;
    if r.m.wants_load(2) {
        load(r, model, now, 2, 3)?;
    }
    let reply = r.apply(now, Command::Checkout { max });
    let Reply::Delivered { count } = reply else {
        return Err(TestCaseError::fail(format!("checkout gave {reply:?}")));
    };
    prop_assert!(count <= max);
    let delivered = r
        .effects
        .iter()
        .filter(|e| matches!(e, Effect::Deliver(_)))
        .count();
    prop_assert_eq!(count as usize, delivered);
    for e in r.effects.clone() {
        match e {
            Effect::Deliver(d) => {
                prop_assert!(d.consumer.is_some());
                model.delivered(&d, 0)?;
            }
            // Nothing expired goes out: what came back expired meanwhile goes first (and
            // what a handoff kept for a consumer that did not take it, after).
            other => expired_now(model, &other, now)?,
        }
    }
    // It stops only when out of messages (in memory), out of budget or out of credit.
    if count < max && r.m.head_loaded() {
        for id in model.consumers.keys() {
            prop_assert!(!model.may_take(*id), "{:?} left with credit", id);
        }
    }
    Ok(())
}

fn tick(r: &mut Runner, model: &mut Model, advance: u64) -> Result<(), TestCaseError> {
    model.now += advance;
    let now = model.now;
    // Paged messages expire once read back, not on disk.
    let ready = model.ready();
    let on_disk = paged(&r.m, &ready);
    // A checkout owed to a message due at once still judges expiry at that message's time.
    let by = r.expiry_now(now);
    r.apply(now, Command::Tick);
    let due: BTreeSet<u64> = ready
        .difference(&on_disk)
        .copied()
        .filter(|id| model.expires.get(id).is_some_and(|at| *at < by))
        .collect();
    let expired: BTreeSet<u64> = r
        .effects
        .iter()
        .map(|e| match e {
            Effect::DeadLetter {
                msg_id,
                reason: DeadLetterReason::Expired,
                ..
            } => Ok(*msg_id),
            other => Err(TestCaseError::fail(format!("{other:?}"))),
        })
        .collect::<Result<_, _>>()?;
    prop_assert_eq!(&expired, &due);
    for id in due {
        model.state.insert(id, State::Expired);
        model.stored.remove(&id);
    }
    Ok(())
}

fn run(ops: Vec<Op>) -> Result<(Runner, Model), TestCaseError> {
    let mut r = Runner::new();
    let mut model = Model::default();
    let mut packs = false;
    for op in ops {
        let now = model.now;
        match op {
            Op::Enqueue {
                size,
                ttl,
                pageable,
            } => {
                enqueue(&mut r, &mut model, size, ttl, pageable)?;
            }
            Op::Consume {
                slot,
                channel,
                no_ack,
                prefetch,
            } => {
                if model.slots.contains_key(&slot) {
                    continue;
                }
                model.next_consumer += 1;
                // Minted by the node of its channel.
                let id = ConsumerId(qualify(channel, model.next_consumer).unwrap());
                let spec = ConsumerSpec {
                    group: group(channel),
                    tag: ShortStr::from("c"),
                    no_ack,
                    prefetch,
                    exclusive: false,
                    priority: 0,
                    arguments: FieldTable::new(),
                };
                prop_assert_eq!(r.apply(now, Command::Consume { id, spec }), Reply::Ok);
                model.slots.insert(slot, id);
                model.consumers.insert(
                    id,
                    ModelConsumer {
                        group: group(channel),
                        no_ack,
                        prefetch,
                    },
                );
            }
            Op::Cancel { slot } => {
                let id = model.slots.remove(&slot).unwrap_or(ConsumerId(u64::MAX));
                let known = model.consumers.remove(&id);
                let reply = r.apply(now, Command::Cancel { id });
                match known {
                    Some(c) => {
                        prop_assert_eq!(
                            reply,
                            Reply::Cancelled {
                                consumers_left: model.consumers.len() as u32
                            }
                        );
                        if !model.consumers.values().any(|o| o.group == c.group) {
                            model.credit.remove(&c.group);
                        }
                    }
                    None => prop_assert_eq!(reply, Reply::Stale),
                }
            }
            Op::Credit {
                channel,
                blocked,
                limit,
            } => {
                let credit = Credit { blocked, limit };
                r.apply(
                    now,
                    Command::Credit {
                        group: group(channel),
                        credit,
                    },
                );
                let present = model.consumers.values().any(|c| c.group == group(channel));
                if credit == Credit::default() || !present {
                    model.credit.remove(&group(channel));
                } else {
                    model.credit.insert(group(channel), credit);
                }
            }
            Op::PageOut { keep, unwritten } => {
                if packs {
                    continue;
                }
                let Some(upto_id) = r.m.next_msg_id().checked_sub(unwritten + 1) else {
                    continue;
                };
                r.apply(
                    now,
                    Command::PageOut {
                        keep,
                        keep_bytes: 150,
                        upto_id,
                    },
                );
            }
            Op::Pack { keep } => {
                // A queue packs or pages, never both (a replicated queue's machine never
                // gets a PageOut; a classic one is never packed).
                if r.log
                    .iter()
                    .any(|(_, c, _)| matches!(c, Command::PageOut { .. }))
                {
                    continue;
                }
                packs = true;
                let before = r.m.digest();
                let upto = r.m.next_msg_id().saturating_sub(1);
                r.m.pack_line(keep, upto);
                prop_assert_eq!(r.m.digest(), before, "packing changed the digest");
                // And runs past the first `keep % 2` written out of memory, however short.
                r.m.spill_line(keep % 2, 1);
                prop_assert_eq!(r.m.digest(), before, "spilling changed the digest");
            }
            Op::Checkout { max } => checkout(&mut r, &mut model, max)?,
            Op::Get { no_ack, node } => {
                let get = || match node {
                    Some(node) => Command::GetBy { no_ack, node },
                    None => Command::Get { no_ack },
                };
                // As the broker does: read on while whole pages expire as they are read.
                while !r.m.head_loaded() && r.m.load_request(1).is_some() {
                    load(&mut r, &mut model, now, 1, 2)?;
                }
                let mut reply = r.apply(now, get());
                let mut effects = r.effects.clone();
                loop {
                    while effects
                        .first()
                        .is_some_and(|e| !matches!(e, Effect::Deliver(_)))
                    {
                        expired_now(&mut model, &effects.remove(0), now)?;
                    }
                    // What was in memory expired, leaving a paged head: the broker reads on.
                    if !effects.is_empty() || r.m.head_loaded() || r.m.load_request(1).is_none() {
                        break;
                    }
                    while !r.m.head_loaded() && r.m.load_request(1).is_some() {
                        load(&mut r, &mut model, now, 1, 2)?;
                    }
                    reply = r.apply(now, get());
                    effects = r.effects.clone();
                }
                match effects.as_slice() {
                    [Effect::Deliver(d)] => {
                        prop_assert_eq!(reply, Reply::Delivered { count: 1 });
                        prop_assert_eq!(d.consumer, None);
                        prop_assert_eq!(d.settled, no_ack);
                        model.delivered(d, node.unwrap_or(0))?;
                    }
                    [] => {
                        prop_assert_eq!(reply, Reply::Delivered { count: 0 });
                        prop_assert!(model.ready().is_empty());
                    }
                    other => return Err(TestCaseError::fail(format!("{other:?}"))),
                }
            }
            Op::Settle { pick, stale }
            | Op::Return { pick, stale }
            | Op::Discard { pick, stale } => {
                let receipt = pick_receipt(&model, pick, stale, r.m.next_msg_id());
                let current = matches!(
                    model.state.get(&receipt.msg_id),
                    Some(State::InFlight { attempt, .. }) if *attempt == receipt.attempt
                );
                let (command, to) = match op {
                    Op::Settle { .. } => (Command::Settle { receipt }, State::Settled),
                    Op::Return { .. } => (Command::Return { receipt }, State::Ready),
                    _ => (Command::Discard { receipt }, State::Discarded),
                };
                let reply = r.apply(now, command);
                prop_assert_eq!(reply, if current { Reply::Ok } else { Reply::Stale });
                if current {
                    model.state.insert(receipt.msg_id, to);
                    if to != State::Ready {
                        model.stored.remove(&receipt.msg_id);
                    }
                    if to == State::Discarded {
                        match r.effects.as_slice() {
                            [Effect::DeadLetter {
                                msg_id,
                                reason: DeadLetterReason::Rejected,
                                delivery_count,
                                ..
                            }] => {
                                prop_assert_eq!(*msg_id, receipt.msg_id);
                                prop_assert_eq!(*delivery_count, receipt.attempt);
                            }
                            other => return Err(TestCaseError::fail(format!("{other:?}"))),
                        }
                    }
                } else {
                    prop_assert!(r.effects.is_empty());
                }
            }
            Op::Down { node } => {
                let gone: Vec<ConsumerId> = model
                    .consumers
                    .iter()
                    .filter(|(_, c)| node_of(c.group.conn) == node)
                    .map(|(id, _)| *id)
                    .collect();
                let reply = r.apply(now, Command::Down { node });
                for id in &gone {
                    let c = model.consumers.remove(id);
                    model.slots.retain(|_, s| s != id);
                    if let Some(c) = c {
                        if !model.consumers.values().any(|o| o.group == c.group) {
                            model.credit.remove(&c.group);
                        }
                    }
                }
                prop_assert_eq!(
                    reply,
                    if gone.is_empty() {
                        Reply::Ok
                    } else {
                        Reply::Cancelled {
                            consumers_left: model.consumers.len() as u32,
                        }
                    }
                );
                // Everything its channels held is ready again, in place, count kept (no
                // delivery limit here, and `reject-publish` drops nothing).
                prop_assert!(r.effects.is_empty(), "{:?}", r.effects);
                for s in model.state.values_mut() {
                    if matches!(s, State::InFlight { node: n, .. } if *n == node) {
                        *s = State::Ready;
                    }
                }
            }
            Op::Publish { slot, gap, size } => {
                let id = r.m.next_msg_id();
                let fresh = !model.enqueuers.contains_key(&slot);
                if fresh {
                    model.next_enqueuer += 1;
                    let id = qualify(pub_node(slot), model.next_enqueuer).unwrap();
                    model.enqueuers.insert(
                        slot,
                        ModelEnqueuer {
                            id: EnqueuerId(id),
                            sent: BTreeMap::new(),
                            highest: 0,
                            refused: None,
                        },
                    );
                }
                let full = model.full();
                let Some(e) = model.enqueuers.get_mut(&slot) else {
                    unreachable!()
                };
                // A life starts at 1; a gap stands for publishes lost on their way.
                let seq = e.highest + 1 + gap;
                let reply = r.apply(
                    now,
                    Command::EnqueueFrom {
                        enqueuer: e.id,
                        seq,
                        message: (id, size),
                        meta: MsgMeta {
                            size,
                            ..MsgMeta::default()
                        },
                    },
                );
                if gap > 0 {
                    // Nothing decided: the machine waits for the lost one.
                    prop_assert_eq!(reply, Reply::Refused(Refusal::OutOfOrder));
                    if fresh {
                        model.enqueuers.remove(&slot);
                    }
                    continue;
                }
                e.highest = seq;
                if full {
                    prop_assert_eq!(reply, Reply::Refused(Refusal::Full));
                    e.refused = Some(seq);
                    e.sent.insert(seq, (Sent::Refused, size));
                } else {
                    prop_assert_eq!(reply, Reply::Enqueued { msg_id: id });
                    e.sent.insert(seq, (Sent::Enqueued(id), size));
                    model.state.insert(id, State::Ready);
                    model.size.insert(id, size);
                }
                if fresh {
                    // A node's new enqueuer replaces its others.
                    let node = pub_node(slot);
                    model
                        .enqueuers
                        .retain(|other, _| *other == slot || pub_node(*other) != node);
                }
            }
            Op::Resend { slot, pick } => {
                let Some(e) = model.enqueuers.get(&slot) else {
                    continue;
                };
                let Some((&seq, &(sent, size))) = e.sent.iter().nth(pick % e.sent.len()) else {
                    continue;
                };
                let next = r.m.next_msg_id();
                let message = match sent {
                    Sent::Enqueued(id) => (id, size),
                    Sent::Refused => (next, size),
                };
                let reply = r.apply(
                    now,
                    Command::EnqueueFrom {
                        enqueuer: e.id,
                        seq,
                        message,
                        meta: MsgMeta {
                            size,
                            ..MsgMeta::default()
                        },
                    },
                );
                // Never enqueued again; confirmed only if it was enqueued the first time.
                prop_assert_eq!(r.m.next_msg_id(), next, "a resend was enqueued");
                prop_assert!(r.effects.is_empty());
                let ambiguous = e.refused.is_some_and(|at| seq <= at);
                prop_assert_eq!(
                    reply,
                    if ambiguous {
                        Reply::Refused(Refusal::Full)
                    } else {
                        Reply::Duplicate
                    }
                );
                if matches!(sent, Sent::Refused) {
                    prop_assert_ne!(reply, Reply::Duplicate, "a refused publish confirmed");
                }
            }
            Op::Unregister { slot } => match model.enqueuers.remove(&slot) {
                Some(e) => {
                    let reply = r.apply(now, Command::Unregister { enqueuer: e.id });
                    prop_assert_eq!(reply, Reply::Ok);
                }
                None => {
                    let never = EnqueuerId(qualify(pub_node(slot), u64::from(slot) << 40).unwrap());
                    let reply = r.apply(now, Command::Unregister { enqueuer: never });
                    prop_assert_eq!(reply, Reply::Stale);
                }
            },
            Op::Limit { max_length } => {
                let policy = Policy {
                    max_length,
                    overflow: Overflow::RejectPublish,
                    ..Policy::default()
                };
                prop_assert_eq!(r.apply(now, Command::Configure(policy)), Reply::Ok);
                model.max_length = max_length;
                // A Configure ends a pending handoff: what it kept expires by the clock.
                for e in r.effects.clone() {
                    expired_now(&mut model, &e, now)?;
                }
            }
            Op::Purge => {
                let ready = model.ready();
                prop_assert_eq!(
                    r.apply(now, Command::Purge),
                    Reply::Purged {
                        count: ready.len() as u32
                    }
                );
                for id in ready {
                    model.state.insert(id, State::Purged);
                    model.stored.remove(&id);
                }
            }
            Op::Tick { advance } => tick(&mut r, &mut model, advance)?,
            Op::CapExpiry { within } => {
                let now = model.now;
                let at = now + within;
                let reply = r.apply(
                    now,
                    Command::CapExpiry {
                        caps: vec![(u64::MAX, at)],
                    },
                );
                prop_assert_eq!(reply, Reply::Ok);
                // What was due already goes at once.
                for e in r.effects.clone() {
                    expired_now(&mut model, &e, now)?;
                }
                for (id, state) in &model.state {
                    if matches!(state, State::Ready | State::InFlight { .. }) {
                        let e = model.expires.entry(*id).or_insert(at);
                        *e = (*e).min(at);
                    }
                }
            }
            Op::Ttl0 { size, advance } => {
                // RabbitMQ's rule, whenever the checkout comes: with nothing ahead of it, the
                // message reaches a consumer that may take one as it arrives, and expires if
                // there is none.
                let ahead = !model.ready().is_empty();
                let waiting = model.consumers.keys().any(|c| model.may_take(*c));
                if let Some(id) = enqueue(&mut r, &mut model, size, Some(0), false)? {
                    tick(&mut r, &mut model, advance)?;
                    checkout(&mut r, &mut model, 5)?;
                    let state = model.state[&id];
                    if !ahead && waiting {
                        prop_assert!(
                            matches!(state, State::Settled | State::InFlight { .. }),
                            "{} not delivered: {:?}",
                            id,
                            state
                        );
                    }
                    if !waiting {
                        prop_assert_eq!(state, State::Expired, "{} with nobody waiting", id);
                    }
                }
            }
        }
        check(&r.m, &model)?;
    }
    Ok((r, model))
}

/// Replays a log into a fresh machine; the digest of every step's effects and the final state
/// must match.
fn replay(log: &[(Meta, Command<Msg>, u64)]) -> Result<QueueMachine<Msg>, (usize, &'static str)> {
    let mut m = QueueMachine::new();
    let mut effects = Vec::new();
    for (i, (meta, c, want)) in log.iter().enumerate() {
        effects.clear();
        let reply = m.apply(*meta, c.clone(), &mut effects);
        if effects_digest(&reply, &effects) != *want {
            return Err((i, "effects"));
        }
    }
    Ok(m)
}

/// The machine's digest before the first step of a log and after each step.
fn step_digests(log: &[(Meta, Command<Msg>, u64)]) -> Vec<u64> {
    let mut m = QueueMachine::new();
    let mut effects = Vec::new();
    let mut digests = vec![m.digest()];
    digests.extend(log.iter().map(|(meta, c, _)| {
        effects.clear();
        m.apply(*meta, c.clone(), &mut effects);
        m.digest()
    }));
    digests
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn machine_matches_model_and_replays(ops in proptest::collection::vec(op(), 0..150)) {
        let (r, _) = run(ops)?;
        let replayed = replay(&r.log).map_err(|e| TestCaseError::fail(format!("{e:?}")))?;
        prop_assert_eq!(replayed.digest(), r.m.digest());
    }

    /// A member that packs its line (a queue TTL's messages too) keeps to the model, and its
    /// log replays to its digest without packing.
    #[test]
    fn a_packing_member_matches_model_and_replays(ops in proptest::collection::vec(member_op(), 0..200)) {
        let (r, _) = run(ops)?;
        let replayed = replay(&r.log).map_err(|e| TestCaseError::fail(format!("{e:?}")))?;
        prop_assert_eq!(replayed.digest(), r.m.digest());
    }

    /// A log with one state-changing command left out does not replay to the same machine:
    /// a step's effects or the machine's digest after it differ from the full log's. (The
    /// digest after the last step alone is not enough: a later purge can clear what the
    /// missing command left, and a logged Load passes over a paged message it does not carry.)
    #[test]
    fn a_dropped_command_is_detected(ops in proptest::collection::vec(op(), 1..150), pick in any::<usize>()) {
        let (r, _) = run(ops)?;
        // A command that changed nothing (a stale ack, an empty checkout) cannot be missed:
        // pick one that changed the queue.
        let changing: Vec<usize> = (0..r.log.len()).filter(|i| r.changed[*i]).collect();
        prop_assume!(!changing.is_empty());
        let drop = changing[pick % changing.len()];
        let mut log = r.log.clone();
        log.remove(drop);
        let full = step_digests(&r.log);
        // After `j` steps of the shorter log, the full log's machine had taken `j + 1` once
        // past the dropped command.
        let diverged = replay(&log).is_err()
            || step_digests(&log)
                .iter()
                .enumerate()
                .any(|(j, d)| *d != full[if j < drop { j } else { j + 1 }]);
        prop_assert!(diverged, "dropping command {} ({:?}) went unnoticed", drop, r.log[drop].1);
    }

    /// One consumer, no requeues: deliveries come in id order, all of them, once.
    #[test]
    fn single_consumer_gets_id_order(
        batches in proptest::collection::vec((0usize..5, 0u32..5, any::<bool>()), 1..40)
    ) {
        let mut r = Runner::new();
        let spec = ConsumerSpec {
            group: group(1),
            tag: ShortStr::from("c"),
            no_ack: false,
            prefetch: 0,
            exclusive: false,
            priority: 0,
            arguments: FieldTable::new(),
        };
        r.apply(0, Command::Consume { id: ConsumerId(1), spec });
        let mut got = Vec::new();
        for (enqueue, take, settle) in batches {
            for _ in 0..enqueue {
                let id = r.m.next_msg_id();
                r.apply(0, Command::Enqueue { message: (id, 1), meta: MsgMeta::default() });
            }
            r.apply(0, Command::Checkout { max: take });
            let mut receipts = Vec::new();
            for e in &r.effects {
                if let Effect::Deliver(d) = e {
                    got.push(d.receipt.msg_id);
                    receipts.push(d.receipt);
                }
            }
            if settle {
                for receipt in receipts {
                    prop_assert_eq!(r.apply(0, Command::Settle { receipt }), Reply::Ok);
                }
            }
        }
        r.apply(0, Command::Checkout { max: u32::MAX });
        for e in &r.effects {
            if let Effect::Deliver(d) = e {
                got.push(d.receipt.msg_id);
            }
        }
        let want: Vec<u64> = (0..r.m.next_msg_id()).collect();
        prop_assert_eq!(got, want);
    }

    /// Requeued messages come back before every later one, in id order among themselves.
    #[test]
    fn requeued_come_back_first(n in 1u64..30, back in proptest::collection::btree_set(0u64..30, 0..10)) {
        let mut r = Runner::new();
        for id in 0..n {
            r.apply(0, Command::Enqueue { message: (id, 1), meta: MsgMeta::default() });
        }
        let half = n / 2;
        for _ in 0..half {
            prop_assert_eq!(r.apply(0, Command::Get { no_ack: false }), Reply::Delivered { count: 1 });
        }
        let back: Vec<u64> = back.into_iter().filter(|id| *id < half).collect();
        // Return in reverse order: position, not return order, decides.
        for id in back.iter().rev() {
            let receipt = Receipt { msg_id: *id, attempt: 1 };
            prop_assert_eq!(r.apply(0, Command::Return { receipt }), Reply::Ok);
        }
        let mut got = Vec::new();
        loop {
            r.apply(0, Command::Get { no_ack: true });
            let Some(Effect::Deliver(d)) = r.effects.first() else { break };
            prop_assert_eq!(d.redelivered, back.contains(&d.receipt.msg_id));
            got.push(d.receipt.msg_id);
        }
        let want: Vec<u64> = back.iter().copied().chain(half..n).collect();
        prop_assert_eq!(got, want);
    }
}
