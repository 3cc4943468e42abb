//! A queue that delivers on apply (`Policy::deliver_on_apply`, what a replicated queue uses so
//! that dispatch adds nothing to its log) hands out the same messages, to the same consumers, in
//! the same order, as a classic queue given a `Checkout` after every command.

use proptest::prelude::*;
use warren_codec::{FieldTable, ShortStr};
use warren_queue::machine::{
    Command, ConsumerId, ConsumerSpec, Credit, CreditGroup, Effect, Meta, MsgMeta, Policy,
    QueueMachine, Receipt, AUTO_CHECKOUT_MAX,
};

#[derive(Clone, Debug)]
enum Op {
    Enqueue {
        ttl: Option<u64>,
    },
    Consume {
        consumer: u8,
        prefetch: u32,
    },
    Cancel {
        consumer: u8,
    },
    /// Settle, return or discard the n-th held delivery.
    Settle {
        nth: usize,
    },
    Return {
        nth: usize,
    },
    Discard {
        nth: usize,
    },
    Credit {
        channel: u8,
        blocked: bool,
        limit: Option<u32>,
    },
    Tick {
        advance: u64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => proptest::option::of(0u64..50).prop_map(|ttl| Op::Enqueue { ttl }),
        1 => (0u8..4, 0u32..4).prop_map(|(consumer, prefetch)| Op::Consume { consumer, prefetch }),
        1 => (0u8..4).prop_map(|consumer| Op::Cancel { consumer }),
        3 => (0usize..8).prop_map(|nth| Op::Settle { nth }),
        1 => (0usize..8).prop_map(|nth| Op::Return { nth }),
        1 => (0usize..8).prop_map(|nth| Op::Discard { nth }),
        1 => (0u8..2, any::<bool>(), proptest::option::of(0u32..3))
            .prop_map(|(channel, blocked, limit)| Op::Credit { channel, blocked, limit }),
        1 => (0u64..40).prop_map(|advance| Op::Tick { advance }),
    ]
}

/// A consumer's channel: consumers 0 and 2 share channel 0, 1 and 3 channel 1.
fn group(channel: u8) -> CreditGroup {
    CreditGroup {
        conn: 1,
        channel: u16::from(channel),
    }
}

fn spec(consumer: u8, prefetch: u32) -> ConsumerSpec {
    ConsumerSpec {
        group: group(consumer % 2),
        tag: ShortStr::try_from_string(format!("c{consumer}")).unwrap(),
        no_ack: false,
        prefetch,
        exclusive: false,
        priority: 0,
        arguments: FieldTable::new(),
    }
}

/// One side: a machine, its next index, the deliveries it made and what is held.
struct Side {
    m: QueueMachine<u64>,
    index: u64,
    now: u64,
    delivered: Vec<(Option<ConsumerId>, Receipt, u64)>,
    held: Vec<Receipt>,
    dead: Vec<u64>,
}

impl Side {
    fn new(deliver_on_apply: bool) -> Self {
        let mut s = Side {
            m: QueueMachine::default(),
            index: 0,
            now: 0,
            delivered: Vec::new(),
            held: Vec::new(),
            dead: Vec::new(),
        };
        let policy = Policy {
            deliver_on_apply,
            ..Policy::default()
        };
        s.run(Command::Configure(policy));
        s
    }

    fn run(&mut self, command: Command<u64>) {
        self.index += 1;
        let meta = Meta {
            index: self.index,
            now_ms: self.now,
        };
        let mut effects = Vec::new();
        self.m.apply(meta, command, &mut effects);
        for e in effects {
            match e {
                Effect::Deliver(d) => {
                    self.delivered.push((d.consumer, d.receipt, d.message));
                    self.held.push(d.receipt);
                }
                Effect::DeadLetter { message, .. } => self.dead.push(message),
                _ => {}
            }
        }
    }
}

fn apply(side: &mut Side, op: &Op, next_body: u64, checkout_after: bool) {
    let command = match op {
        Op::Enqueue { ttl } => Command::Enqueue {
            message: next_body,
            meta: MsgMeta {
                size: 1,
                expires_at: ttl.map(|t| side.now + t),
                ..MsgMeta::default()
            },
        },
        Op::Consume { consumer, prefetch } => Command::Consume {
            id: ConsumerId(u64::from(*consumer)),
            spec: spec(*consumer, *prefetch),
        },
        Op::Cancel { consumer } => Command::Cancel {
            id: ConsumerId(u64::from(*consumer)),
        },
        Op::Settle { nth } | Op::Return { nth } | Op::Discard { nth } => {
            if side.held.is_empty() {
                return;
            }
            let receipt = side.held.remove(nth % side.held.len());
            match op {
                Op::Settle { .. } => Command::Settle { receipt },
                Op::Return { .. } => Command::Return { receipt },
                _ => Command::Discard { receipt },
            }
        }
        Op::Credit {
            channel,
            blocked,
            limit,
        } => Command::Credit {
            group: group(*channel),
            credit: Credit {
                blocked: *blocked,
                limit: *limit,
            },
        },
        Op::Tick { advance } => {
            side.now += advance;
            Command::Tick
        }
    };
    side.run(command);
    if checkout_after {
        side.run(Command::Checkout {
            max: AUTO_CHECKOUT_MAX,
        });
    }
}

proptest! {
    #[test]
    fn delivering_on_apply_matches_a_checkout_after_every_command(
        ops in proptest::collection::vec(op(), 1..80)
    ) {
        let mut auto = Side::new(true);
        let mut classic = Side::new(false);
        for (i, op) in ops.iter().enumerate() {
            apply(&mut auto, op, i as u64, false);
            apply(&mut classic, op, i as u64, true);
            prop_assert_eq!(&auto.delivered, &classic.delivered, "after {:?}", op);
            prop_assert_eq!(&auto.dead, &classic.dead);
            prop_assert_eq!(auto.m.ready_count(), classic.m.ready_count());
            prop_assert_eq!(auto.m.in_flight_count(), classic.m.in_flight_count());
            // Nothing is left for a Checkout to do: dispatch needs no entry of its own.
            prop_assert!(!auto.m.has_work());
        }
    }
}

#[test]
fn a_consume_without_prefetch_on_a_deep_queue_delivers_a_bounded_batch() {
    let mut side = Side::new(true);
    for body in 0..1000 {
        side.run(Command::Enqueue {
            message: body,
            meta: MsgMeta {
                size: 1,
                ..MsgMeta::default()
            },
        });
    }
    assert!(side.delivered.is_empty(), "no consumer yet");
    side.run(Command::Consume {
        id: ConsumerId(1),
        spec: spec(1, 0),
    });
    assert_eq!(side.delivered.len(), AUTO_CHECKOUT_MAX as usize);
    // More could go: the leader logs a Checkout for the rest.
    assert!(side.m.has_work());
    while side.m.has_work() {
        side.run(Command::Checkout {
            max: AUTO_CHECKOUT_MAX,
        });
    }
    assert_eq!(side.delivered.len(), 1000);
    let bodies: Vec<u64> = side.delivered.iter().map(|d| d.2).collect();
    assert_eq!(bodies, (0..1000).collect::<Vec<_>>(), "in order");
}
