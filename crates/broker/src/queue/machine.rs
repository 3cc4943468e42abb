//! The queue state machine: a pure, deterministic function of the commands it is given.
//!
//! Modelled on RabbitMQ's `rabbit_fifo`: no I/O, no clock reads (time comes in as
//! `now_ms`), so the same command sequence always gives the same state and effects. That is
//! what makes it property-testable today and replicable (apply the same log on every member)
//! later.
//!
//! Every enqueued message gets a monotonically increasing `msg_id`, which is also its position
//! in the queue. A message is in exactly one of these places:
//!
//! * **ready**: `ready` (a `VecDeque` in id order: the common path, no per-message allocation
//!   beyond the deque's amortised growth) or `returned` (a `BTreeMap` for messages that were
//!   delivered and came back, so they go back to their ORIGINAL position: the next delivery
//!   takes the smaller id of the two heads);
//! * **in flight**: `in_flight`, keyed by `msg_id`, remembering the consumer (`None` for
//!   basic.get) and how many times it was delivered;
//! * **gone**: settled, discarded, purged or handed to a no-ack consumer.
//!
//! Consumers are kept in round-robin order: after a consumer gets a message it moves to the
//! back. Whether a consumer may take one more message right now (prefetch, back-pressure) is
//! not part of the state: the [`Checkout`] driver is asked right before each message is taken.
//!
//! Later features hook in here: message TTL / `x-expires` via [`MsgMeta::expires_at`] and
//! [`QueueMachine::tick`]; max-length via the O(1) counters; dead-lettering via the
//! [`Discarded`] value that [`QueueMachine::discard`] returns; delivery limits via
//! `delivery_count`.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::hash::Hash;

/// What the machine needs to know about a message, computed by the caller when enqueuing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MsgMeta {
    /// Body size in bytes, for the `bytes` counters (and later `x-max-length-bytes`).
    pub size: u64,
    /// Absolute expiry in ms (per-message or queue TTL), if any. Not enforced yet.
    pub expires_at: Option<u64>,
}

#[derive(Clone, Debug)]
struct Entry<M> {
    id: u64,
    msg: M,
    meta: MsgMeta,
    /// How many times this message has been handed out (0 while it was never delivered).
    delivery_count: u32,
}

#[derive(Clone, Debug)]
struct InFlight<C, M> {
    consumer: Option<C>,
    entry: Entry<M>,
}

#[derive(Clone, Debug)]
struct Slot<C> {
    consumer: C,
    no_ack: bool,
}

/// A message handed to a consumer (or to basic.get).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Deliver<C, M> {
    /// `None` for basic.get.
    pub consumer: Option<C>,
    pub msg_id: u64,
    pub message: M,
    /// True if the message was delivered before (and came back).
    pub redelivered: bool,
    /// Number of times it has now been delivered, this delivery included (>= 1).
    pub delivery_count: u32,
    /// The queue already forgot the message (no-ack consumer or basic.get with no-ack).
    pub settled: bool,
}

/// A message removed by discard (reject/nack without requeue): the hook for dead-lettering.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Discarded<M> {
    pub msg_id: u64,
    pub message: M,
    pub delivery_count: u32,
}

/// Why a message left the queue without being acknowledged; carried by
/// [`Effect::DeadLetter`] once dead-lettering exists (names follow RabbitMQ's `x-death`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeadLetterReason {
    Rejected,
    Expired,
    MaxLen,
    DeliveryLimit,
}

/// The driver of a checkout: says whether a consumer has credit and takes the deliveries.
pub trait Checkout<C, M> {
    /// May this consumer take one more message now? Asked right before a message is taken.
    fn has_credit(&mut self, consumer: &C) -> bool;
    /// The message now belongs to the consumer.
    fn deliver(&mut self, delivery: Deliver<C, M>);
}

/// The commands of the machine, for drivers that log or replay them (replication, tests).
/// Each maps to one method; [`QueueMachine::apply`] runs it.
#[derive(Clone, Debug)]
pub enum Command<C, M> {
    Enqueue {
        message: M,
        meta: MsgMeta,
    },
    Consume {
        consumer: C,
        no_ack: bool,
    },
    Cancel {
        consumer: C,
    },
    /// basic.get: take one ready message with no consumer.
    Get {
        no_ack: bool,
    },
    Settle {
        msg_id: u64,
    },
    Return {
        msg_id: u64,
    },
    Discard {
        msg_id: u64,
    },
    Purge,
    Tick,
}

/// The effects of a command.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Effect<C, M> {
    /// A message was enqueued with this id.
    Enqueued { msg_id: u64 },
    /// A message was handed out (only from `Get`; consumer deliveries go through [`Checkout`]).
    Deliver(Deliver<C, M>),
    /// A discarded message, to be dead-lettered when the queue has a dead-letter exchange.
    DeadLetter {
        discarded: Discarded<M>,
        reason: DeadLetterReason,
    },
    /// `n` ready messages were dropped (purge).
    Dropped { count: u32 },
    /// The command referred to something unknown (settled id, missing consumer): no change.
    Ignored,
    /// The command succeeded with nothing else to report.
    Done,
}

/// The queue state machine. `C` identifies a consumer, `M` is the message (cheap to clone).
#[derive(Clone, Debug)]
pub struct QueueMachine<C, M> {
    next_id: u64,
    ready: VecDeque<Entry<M>>,
    returned: BTreeMap<u64, Entry<M>>,
    in_flight: HashMap<u64, InFlight<C, M>>,
    consumers: VecDeque<Slot<C>>,
    ready_bytes: u64,
    in_flight_bytes: u64,
    now_ms: u64,
}

impl<C, M> Default for QueueMachine<C, M> {
    fn default() -> Self {
        QueueMachine {
            next_id: 0,
            ready: VecDeque::new(),
            returned: BTreeMap::new(),
            in_flight: HashMap::new(),
            consumers: VecDeque::new(),
            ready_bytes: 0,
            in_flight_bytes: 0,
            now_ms: 0,
        }
    }
}

impl<C: Clone + Eq + Hash, M: Clone> QueueMachine<C, M> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Runs one command. Consumer deliveries need credit information, so they are not a
    /// command: call [`QueueMachine::checkout`].
    pub fn apply(&mut self, command: Command<C, M>, now_ms: u64) -> Effect<C, M> {
        self.now_ms = self.now_ms.max(now_ms);
        match command {
            Command::Enqueue { message, meta } => Effect::Enqueued {
                msg_id: self.enqueue(message, meta),
            },
            Command::Consume { consumer, no_ack } => {
                if self.add_consumer(consumer, no_ack) {
                    Effect::Done
                } else {
                    Effect::Ignored
                }
            }
            Command::Cancel { consumer } => {
                if self.remove_consumer(&consumer) {
                    Effect::Done
                } else {
                    Effect::Ignored
                }
            }
            Command::Get { no_ack } => match self.get(no_ack) {
                Some(d) => Effect::Deliver(d),
                None => Effect::Ignored,
            },
            Command::Settle { msg_id } => {
                if self.settle(msg_id) {
                    Effect::Done
                } else {
                    Effect::Ignored
                }
            }
            Command::Return { msg_id } => {
                if self.requeue(msg_id) {
                    Effect::Done
                } else {
                    Effect::Ignored
                }
            }
            Command::Discard { msg_id } => match self.discard(msg_id) {
                Some(discarded) => Effect::DeadLetter {
                    discarded,
                    reason: DeadLetterReason::Rejected,
                },
                None => Effect::Ignored,
            },
            Command::Purge => Effect::Dropped {
                count: self.purge(),
            },
            Command::Tick => Effect::Done,
        }
    }

    /// Appends a message; returns its id (= its position).
    pub fn enqueue(&mut self, message: M, meta: MsgMeta) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        self.ready_bytes = self.ready_bytes.saturating_add(meta.size);
        self.ready.push_back(Entry {
            id,
            msg: message,
            meta,
            delivery_count: 0,
        });
        id
    }

    /// Adds a consumer at the back of the round-robin order. False if it is already there.
    pub fn add_consumer(&mut self, consumer: C, no_ack: bool) -> bool {
        if self.has_consumer(&consumer) {
            return false;
        }
        self.consumers.push_back(Slot { consumer, no_ack });
        true
    }

    /// Removes a consumer. Its in-flight messages stay in flight. False if unknown.
    pub fn remove_consumer(&mut self, consumer: &C) -> bool {
        match self.consumers.iter().position(|s| &s.consumer == consumer) {
            Some(i) => {
                self.consumers.remove(i);
                true
            }
            None => false,
        }
    }

    pub fn has_consumer(&self, consumer: &C) -> bool {
        self.consumers.iter().any(|s| &s.consumer == consumer)
    }

    /// Consumers in their current round-robin order (the next one to be offered first).
    pub fn consumers(&self) -> impl Iterator<Item = &C> + '_ {
        self.consumers.iter().map(|s| &s.consumer)
    }

    pub fn consumer_count(&self) -> usize {
        self.consumers.len()
    }

    /// Ready messages (not in flight).
    pub fn ready_count(&self) -> usize {
        self.ready.len() + self.returned.len()
    }

    pub fn ready_bytes(&self) -> u64 {
        self.ready_bytes
    }

    pub fn in_flight_count(&self) -> usize {
        self.in_flight.len()
    }

    pub fn in_flight_bytes(&self) -> u64 {
        self.in_flight_bytes
    }

    /// The id the next enqueued message will get (= how many were ever enqueued).
    pub fn next_msg_id(&self) -> u64 {
        self.next_id
    }

    /// Is this message in flight, and with whom (`Some(None)` = basic.get)?
    pub fn in_flight_consumer(&self, msg_id: u64) -> Option<Option<&C>> {
        self.in_flight.get(&msg_id).map(|f| f.consumer.as_ref())
    }

    /// Is this message ready (waiting for delivery)?
    pub fn is_ready(&self, msg_id: u64) -> bool {
        if self.returned.contains_key(&msg_id) {
            return true;
        }
        // `ready` is sorted by id: binary search.
        self.ready.binary_search_by_key(&msg_id, |e| e.id).is_ok()
    }

    /// Ids of ready messages in delivery order (tests and diagnostics; O(n)).
    pub fn ready_ids(&self) -> Vec<u64> {
        let mut out = Vec::with_capacity(self.ready_count());
        let mut r = self.returned.keys().peekable();
        let mut q = self.ready.iter().map(|e| e.id).peekable();
        loop {
            match (r.peek(), q.peek()) {
                (Some(&&a), Some(&b)) => {
                    if a < b {
                        out.push(a);
                        r.next();
                    } else {
                        out.push(b);
                        q.next();
                    }
                }
                (Some(&&a), None) => {
                    out.push(a);
                    r.next();
                }
                (None, Some(&b)) => {
                    out.push(b);
                    q.next();
                }
                (None, None) => return out,
            }
        }
    }

    fn pop_ready(&mut self) -> Option<Entry<M>> {
        let take_returned = match (self.returned.first_key_value(), self.ready.front()) {
            (Some((&r, _)), Some(q)) => r < q.id,
            (Some(_), None) => true,
            (None, _) => false,
        };
        let entry = if take_returned {
            self.returned.pop_first().map(|(_, e)| e)
        } else {
            self.ready.pop_front()
        }?;
        self.ready_bytes = self.ready_bytes.saturating_sub(entry.meta.size);
        Some(entry)
    }

    fn hand_out(
        &mut self,
        mut entry: Entry<M>,
        consumer: Option<C>,
        no_ack: bool,
    ) -> Deliver<C, M> {
        let redelivered = entry.delivery_count > 0;
        entry.delivery_count = entry.delivery_count.saturating_add(1);
        let msg_id = entry.id;
        let delivery_count = entry.delivery_count;
        if no_ack {
            Deliver {
                consumer,
                msg_id,
                message: entry.msg,
                redelivered,
                delivery_count,
                settled: true,
            }
        } else {
            let message = entry.msg.clone();
            self.in_flight_bytes = self.in_flight_bytes.saturating_add(entry.meta.size);
            self.in_flight.insert(
                msg_id,
                InFlight {
                    consumer: consumer.clone(),
                    entry,
                },
            );
            Deliver {
                consumer,
                msg_id,
                message,
                redelivered,
                delivery_count,
                settled: false,
            }
        }
    }

    /// basic.get: takes the next ready message with no consumer.
    pub fn get(&mut self, no_ack: bool) -> Option<Deliver<C, M>> {
        let entry = self.pop_ready()?;
        Some(self.hand_out(entry, None, no_ack))
    }

    /// Offers ready messages to consumers with credit, round-robin, at most `max` of them.
    /// Returns how many were delivered. Each consumer is asked for credit right before a
    /// message is taken for it; one that says no is set aside for the rest of this call and
    /// then goes to the back of the order (as RabbitMQ moves blocked consumers), so every
    /// delivery costs O(1) however many consumers are blocked.
    pub fn checkout(&mut self, driver: &mut dyn Checkout<C, M>, max: usize) -> usize {
        let mut delivered = 0;
        let mut blocked: Vec<Slot<C>> = Vec::new();
        while delivered < max && self.ready_count() > 0 {
            let Some(slot) = self.consumers.pop_front() else {
                break;
            };
            if !driver.has_credit(&slot.consumer) {
                blocked.push(slot);
                continue;
            }
            let (consumer, no_ack) = (slot.consumer.clone(), slot.no_ack);
            // Round-robin: the served consumer goes to the back.
            self.consumers.push_back(slot);
            let Some(entry) = self.pop_ready() else {
                break;
            };
            let d = self.hand_out(entry, Some(consumer), no_ack);
            driver.deliver(d);
            delivered += 1;
        }
        self.consumers.extend(blocked);
        delivered
    }

    /// Ack: forgets an in-flight message. False if it is not in flight.
    pub fn settle(&mut self, msg_id: u64) -> bool {
        match self.in_flight.remove(&msg_id) {
            Some(f) => {
                self.in_flight_bytes = self.in_flight_bytes.saturating_sub(f.entry.meta.size);
                true
            }
            None => false,
        }
    }

    /// Requeue (nack/reject with requeue, channel closed): the message goes back to its
    /// original position and is marked redelivered. False if it is not in flight.
    pub fn requeue(&mut self, msg_id: u64) -> bool {
        match self.in_flight.remove(&msg_id) {
            Some(f) => {
                self.in_flight_bytes = self.in_flight_bytes.saturating_sub(f.entry.meta.size);
                self.ready_bytes = self.ready_bytes.saturating_add(f.entry.meta.size);
                self.returned.insert(msg_id, f.entry);
                true
            }
            None => false,
        }
    }

    /// Reject/nack without requeue: removes the in-flight message and returns it, so the
    /// caller can dead-letter it. `None` if it is not in flight.
    pub fn discard(&mut self, msg_id: u64) -> Option<Discarded<M>> {
        let f = self.in_flight.remove(&msg_id)?;
        self.in_flight_bytes = self.in_flight_bytes.saturating_sub(f.entry.meta.size);
        Some(Discarded {
            msg_id,
            message: f.entry.msg,
            delivery_count: f.entry.delivery_count,
        })
    }

    /// Drops every ready message; in-flight ones stay. Returns how many were dropped.
    pub fn purge(&mut self) -> u32 {
        let n = self.ready_count();
        self.ready.clear();
        self.returned.clear();
        self.ready_bytes = 0;
        u32::try_from(n).unwrap_or(u32::MAX)
    }

    /// Time passes. Hook for TTL, `x-expires` and consumer timeouts; nothing expires yet.
    pub fn tick(&mut self, now_ms: u64) -> Vec<Effect<C, M>> {
        self.now_ms = self.now_ms.max(now_ms);
        Vec::new()
    }

    /// The latest time the machine has seen.
    pub fn now_ms(&self) -> u64 {
        self.now_ms
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Sink {
        credit: HashMap<u32, usize>,
        got: Vec<Deliver<u32, &'static str>>,
    }

    impl Checkout<u32, &'static str> for Sink {
        fn has_credit(&mut self, c: &u32) -> bool {
            self.credit.get(c).copied().unwrap_or(0) > 0
        }
        fn deliver(&mut self, d: Deliver<u32, &'static str>) {
            if let Some(c) = d.consumer {
                if let Some(n) = self.credit.get_mut(&c) {
                    *n -= 1;
                }
            }
            self.got.push(d);
        }
    }

    fn sink(credits: &[(u32, usize)]) -> Sink {
        Sink {
            credit: credits.iter().copied().collect(),
            got: Vec::new(),
        }
    }

    fn meta(size: u64) -> MsgMeta {
        MsgMeta {
            size,
            expires_at: None,
        }
    }

    #[test]
    fn round_robin_and_requeue_to_original_position() {
        let mut m: QueueMachine<u32, &'static str> = QueueMachine::new();
        for s in ["a", "b", "c", "d"] {
            m.enqueue(s, meta(1));
        }
        assert!(m.add_consumer(1, false));
        assert!(m.add_consumer(2, false));
        assert!(!m.add_consumer(2, false));
        let mut s = sink(&[(1, 10), (2, 10)]);
        assert_eq!(m.checkout(&mut s, 3), 3);
        let who: Vec<_> = s.got.iter().map(|d| (d.consumer, d.msg_id)).collect();
        assert_eq!(who, vec![(Some(1), 0), (Some(2), 1), (Some(1), 2)]);
        assert_eq!(m.ready_count(), 1);
        assert_eq!(m.in_flight_count(), 3);
        assert_eq!(m.ready_bytes(), 1);
        assert_eq!(m.in_flight_bytes(), 3);
        // Return 1: it comes back before 3.
        assert!(m.requeue(1));
        assert!(!m.requeue(1));
        assert_eq!(m.ready_ids(), vec![1, 3]);
        let d = m.get(false).expect("ready");
        assert_eq!((d.msg_id, d.redelivered, d.delivery_count), (1, true, 2));
        assert!(m.settle(1));
        assert!(!m.settle(1));
        assert_eq!(m.discard(0).map(|d| d.message), Some("a"));
        assert_eq!(m.purge(), 1);
        assert_eq!(m.ready_count(), 0);
        assert_eq!(m.in_flight_count(), 1);
        assert_eq!(m.ready_bytes(), 0);
    }

    #[test]
    fn consumers_without_credit_are_skipped_and_no_ack_forgets() {
        let mut m: QueueMachine<u32, &'static str> = QueueMachine::new();
        m.add_consumer(1, false);
        m.add_consumer(2, true);
        for s in ["a", "b", "c"] {
            m.enqueue(s, meta(2));
        }
        let mut s = sink(&[(1, 0), (2, 2)]);
        assert_eq!(m.checkout(&mut s, usize::MAX), 2);
        assert!(s.got.iter().all(|d| d.consumer == Some(2) && d.settled));
        assert_eq!(m.in_flight_count(), 0);
        assert_eq!(m.ready_count(), 1);
        // Nobody has credit now: nothing happens.
        assert_eq!(m.checkout(&mut s, usize::MAX), 0);
        assert!(m.remove_consumer(&2));
        assert!(!m.remove_consumer(&2));
        assert_eq!(m.consumer_count(), 1);
    }

    #[test]
    fn apply_maps_commands() {
        let mut m: QueueMachine<u32, u8> = QueueMachine::new();
        assert_eq!(
            m.apply(
                Command::Enqueue {
                    message: 7,
                    meta: meta(1)
                },
                5
            ),
            Effect::Enqueued { msg_id: 0 }
        );
        assert_eq!(m.apply(Command::Settle { msg_id: 0 }, 6), Effect::Ignored);
        match m.apply(Command::Get { no_ack: false }, 7) {
            Effect::Deliver(d) => assert_eq!((d.msg_id, d.message), (0, 7)),
            other => panic!("unexpected {other:?}"),
        }
        assert!(matches!(
            m.apply(Command::Discard { msg_id: 0 }, 8),
            Effect::DeadLetter { .. }
        ));
        assert_eq!(m.now_ms(), 8);
        assert_eq!(m.apply(Command::Purge, 9), Effect::Dropped { count: 0 });
    }
}
