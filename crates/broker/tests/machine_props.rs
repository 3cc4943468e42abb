//! Property tests: random command sequences against the queue machine, checked step by step
//! against a simple model.

use std::collections::{BTreeSet, HashMap};

use proptest::prelude::*;
use warren_broker::machine::{Checkout, Deliver, MsgMeta, QueueMachine};

type Consumer = u8;
/// The message is its own id plus a size, so the test can check what came back.
type Msg = (u64, u64);

#[derive(Clone, Debug)]
enum Op {
    Enqueue {
        size: u64,
    },
    Consume {
        c: Consumer,
        no_ack: bool,
        prefetch: u32,
    },
    Cancel {
        c: Consumer,
    },
    Checkout {
        max: usize,
    },
    Get {
        no_ack: bool,
    },
    Settle {
        pick: usize,
    },
    Return {
        pick: usize,
    },
    Discard {
        pick: usize,
    },
    Purge,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u64..100).prop_map(|size| Op::Enqueue { size }),
        2 => (0u8..4, any::<bool>(), 0u32..4).prop_map(|(c, no_ack, prefetch)| Op::Consume { c, no_ack: no_ack && c == 3, prefetch }),
        1 => (0u8..4).prop_map(|c| Op::Cancel { c }),
        4 => (1usize..6).prop_map(|max| Op::Checkout { max }),
        1 => any::<bool>().prop_map(|no_ack| Op::Get { no_ack }),
        3 => any::<usize>().prop_map(|pick| Op::Settle { pick }),
        2 => any::<usize>().prop_map(|pick| Op::Return { pick }),
        1 => any::<usize>().prop_map(|pick| Op::Discard { pick }),
        1 => Just(Op::Purge),
    ]
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Ready,
    InFlight(Option<Consumer>),
    Settled,
    Discarded,
    Purged,
}

#[derive(Default)]
struct Model {
    state: HashMap<u64, State>,
    size: HashMap<u64, u64>,
    delivered_before: BTreeSet<u64>,
    /// Prefetch per live consumer (0 = unlimited).
    prefetch: HashMap<Consumer, u32>,
    /// In-flight messages per consumer incarnation (kept after cancel, like a channel's
    /// unacked map; a consumer re-added with the same id is a new incarnation).
    unacked: HashMap<(Consumer, u32), u32>,
    generation: HashMap<Consumer, u32>,
    /// The incarnation an in-flight message was delivered to.
    owner: HashMap<u64, (Consumer, u32)>,
}

impl Model {
    fn ready(&self) -> BTreeSet<u64> {
        self.state
            .iter()
            .filter(|(_, s)| **s == State::Ready)
            .map(|(id, _)| *id)
            .collect()
    }
    fn in_flight(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self
            .state
            .iter()
            .filter(|(_, s)| matches!(s, State::InFlight(_)))
            .map(|(id, _)| *id)
            .collect();
        v.sort_unstable();
        v
    }
    fn incarnation(&self, c: Consumer) -> (Consumer, u32) {
        (c, self.generation.get(&c).copied().unwrap_or(0))
    }
    fn unacked_of(&self, c: Consumer) -> u32 {
        self.unacked.get(&self.incarnation(c)).copied().unwrap_or(0)
    }
    fn has_credit(&self, c: Consumer) -> bool {
        match self.prefetch.get(&c) {
            None => false,
            Some(0) => true,
            Some(p) => self.unacked_of(c) < *p,
        }
    }
    /// Records a delivery, checking it took the smallest ready id of a ready message.
    fn delivered(&mut self, d: &Deliver<Consumer, Msg>) -> Result<(), TestCaseError> {
        let min = self.ready().first().copied();
        prop_assert_eq!(Some(d.msg_id), min, "not the head of the queue");
        prop_assert_eq!(
            self.state.get(&d.msg_id),
            Some(&State::Ready),
            "delivered twice"
        );
        prop_assert_eq!(d.message.0, d.msg_id);
        prop_assert_eq!(d.redelivered, self.delivered_before.contains(&d.msg_id));
        self.delivered_before.insert(d.msg_id);
        let next = if d.settled {
            State::Settled
        } else {
            if let Some(c) = d.consumer {
                let inc = self.incarnation(c);
                *self.unacked.entry(inc).or_default() += 1;
                self.owner.insert(d.msg_id, inc);
            }
            State::InFlight(d.consumer)
        };
        self.state.insert(d.msg_id, next);
        Ok(())
    }
    fn leave_flight(&mut self, id: u64, to: State) {
        if let Some(inc) = self.owner.remove(&id) {
            if let Some(n) = self.unacked.get_mut(&inc) {
                *n -= 1;
            }
        }
        self.state.insert(id, to);
    }
}

/// A sink that grants credit from the model's prefetch and checks every delivery was
/// preceded by a has_credit that said yes, for that consumer.
struct Sink<'a> {
    model: &'a mut Model,
    asked: Option<(Consumer, bool)>,
    error: Option<TestCaseError>,
    count: usize,
}

impl Checkout<Consumer, Msg> for Sink<'_> {
    fn has_credit(&mut self, c: &Consumer) -> bool {
        let yes = self.model.has_credit(*c);
        self.asked = Some((*c, yes));
        yes
    }
    fn deliver(&mut self, d: Deliver<Consumer, Msg>) {
        self.count += 1;
        if self.error.is_some() {
            return;
        }
        let consumer = d.consumer;
        if consumer.is_none() || self.asked.take() != consumer.map(|c| (c, true)) {
            self.error = Some(TestCaseError::fail(format!(
                "delivery to {consumer:?} without credit"
            )));
            return;
        }
        if let Err(e) = self.model.delivered(&d) {
            self.error = Some(e);
        }
    }
}

fn check(m: &QueueMachine<Consumer, Msg>, model: &Model) -> Result<(), TestCaseError> {
    // Exactly one place per message.
    prop_assert_eq!(model.state.len() as u64, m.next_msg_id());
    let ready = model.ready();
    prop_assert_eq!(m.ready_ids(), ready.iter().copied().collect::<Vec<_>>());
    prop_assert_eq!(m.ready_count(), ready.len());
    prop_assert_eq!(m.in_flight_count(), model.in_flight().len());
    for (id, s) in &model.state {
        prop_assert_eq!(m.is_ready(*id), *s == State::Ready);
        match s {
            State::InFlight(c) => prop_assert_eq!(m.in_flight_consumer(*id), Some(c.as_ref())),
            _ => prop_assert_eq!(m.in_flight_consumer(*id), None),
        }
    }
    let bytes = |ids: &mut dyn Iterator<Item = u64>| ids.map(|id| model.size[&id]).sum::<u64>();
    prop_assert_eq!(m.ready_bytes(), bytes(&mut ready.iter().copied()));
    prop_assert_eq!(
        m.in_flight_bytes(),
        bytes(&mut model.in_flight().into_iter())
    );
    // Prefetch respected.
    for (c, p) in &model.prefetch {
        if *p > 0 {
            prop_assert!(model.unacked_of(*c) <= *p);
        }
    }
    Ok(())
}

fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let mut m: QueueMachine<Consumer, Msg> = QueueMachine::new();
    let mut model = Model::default();
    for op in ops {
        match op {
            Op::Enqueue { size } => {
                let id = m.next_msg_id();
                prop_assert_eq!(
                    m.enqueue(
                        (id, size),
                        MsgMeta {
                            size,
                            expires_at: None
                        }
                    ),
                    id
                );
                model.state.insert(id, State::Ready);
                model.size.insert(id, size);
            }
            Op::Consume {
                c,
                no_ack,
                prefetch,
            } => {
                let added = m.add_consumer(c, no_ack);
                prop_assert_eq!(added, !model.prefetch.contains_key(&c));
                if added {
                    model.prefetch.insert(c, if no_ack { 0 } else { prefetch });
                    *model.generation.entry(c).or_default() += 1;
                }
            }
            Op::Cancel { c } => {
                prop_assert_eq!(m.remove_consumer(&c), model.prefetch.remove(&c).is_some());
            }
            Op::Checkout { max } => {
                let mut sink = Sink {
                    model: &mut model,
                    asked: None,
                    error: None,
                    count: 0,
                };
                let n = m.checkout(&mut sink, max);
                if let Some(e) = sink.error {
                    return Err(e);
                }
                prop_assert_eq!(n, sink.count);
                prop_assert!(n <= max);
                // It stops only when out of messages, out of budget or out of credit.
                if n < max && m.ready_count() > 0 {
                    for c in model.prefetch.keys() {
                        prop_assert!(!model.has_credit(*c), "consumer {} left with credit", c);
                    }
                }
            }
            Op::Get { no_ack } => match m.get(no_ack) {
                Some(d) => {
                    prop_assert_eq!(d.consumer, None);
                    prop_assert_eq!(d.settled, no_ack);
                    model.delivered(&d)?;
                }
                None => prop_assert!(model.ready().is_empty()),
            },
            Op::Settle { pick } | Op::Return { pick } | Op::Discard { pick } => {
                // Mostly in-flight ids, sometimes any id (unknown / already settled).
                let flying = model.in_flight();
                let id = if pick % 4 != 0 && !flying.is_empty() {
                    flying[pick % flying.len()]
                } else {
                    (pick as u64) % (m.next_msg_id() + 2)
                };
                let was_flying = matches!(model.state.get(&id), Some(State::InFlight(_)));
                match op {
                    Op::Settle { .. } => {
                        prop_assert_eq!(m.settle(id), was_flying);
                        if was_flying {
                            model.leave_flight(id, State::Settled);
                        }
                    }
                    Op::Return { .. } => {
                        prop_assert_eq!(m.requeue(id), was_flying);
                        if was_flying {
                            model.leave_flight(id, State::Ready);
                        }
                    }
                    _ => {
                        let d = m.discard(id);
                        prop_assert_eq!(d.is_some(), was_flying);
                        if let Some(d) = d {
                            prop_assert_eq!(d.message.0, id);
                            prop_assert!(d.delivery_count >= 1);
                            model.leave_flight(id, State::Discarded);
                        }
                    }
                }
            }
            Op::Purge => {
                let ready = model.ready();
                prop_assert_eq!(m.purge() as usize, ready.len());
                for id in ready {
                    model.state.insert(id, State::Purged);
                }
            }
        }
        check(&m, &model)?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn machine_matches_model(ops in proptest::collection::vec(op(), 0..120)) {
        run(ops)?;
    }

    /// One consumer, no requeues: deliveries come in id order, all of them, once.
    #[test]
    fn single_consumer_gets_id_order(
        batches in proptest::collection::vec((0usize..5, 0usize..5, any::<bool>()), 1..40)
    ) {
        let mut m: QueueMachine<Consumer, Msg> = QueueMachine::new();
        m.add_consumer(0, false);
        struct All(Vec<u64>);
        impl Checkout<Consumer, Msg> for All {
            fn has_credit(&mut self, _: &Consumer) -> bool { true }
            fn deliver(&mut self, d: Deliver<Consumer, Msg>) { self.0.push(d.msg_id) }
        }
        let mut sink = All(Vec::new());
        for (enqueue, take, settle) in batches {
            for _ in 0..enqueue {
                let id = m.next_msg_id();
                m.enqueue((id, 1), MsgMeta::default());
            }
            m.checkout(&mut sink, take);
            if settle {
                for id in sink.0.clone() {
                    m.settle(id);
                }
            }
        }
        m.checkout(&mut sink, usize::MAX);
        let want: Vec<u64> = (0..m.next_msg_id()).collect();
        prop_assert_eq!(sink.0, want);
    }

    /// Requeued messages come back before every later one, in id order among themselves.
    #[test]
    fn requeued_come_back_first(n in 1u64..30, back in proptest::collection::btree_set(0u64..30, 0..10)) {
        let mut m: QueueMachine<Consumer, Msg> = QueueMachine::new();
        for id in 0..n {
            m.enqueue((id, 1), MsgMeta::default());
        }
        let half = n / 2;
        for _ in 0..half {
            prop_assert!(m.get(false).is_some());
        }
        let back: Vec<u64> = back.into_iter().filter(|id| *id < half).collect();
        // Return in reverse order: position, not return order, decides.
        for id in back.iter().rev() {
            prop_assert!(m.requeue(*id));
        }
        let mut got = Vec::new();
        while let Some(d) = m.get(true) {
            prop_assert_eq!(d.redelivered, back.contains(&d.msg_id));
            got.push(d.msg_id);
        }
        let want: Vec<u64> = back.iter().copied().chain(half..n).collect();
        prop_assert_eq!(got, want);
    }
}
