//! A queue machine replicated by the simulated cluster: every member applies the committed
//! entries and reaches the leader's state; after the leader's node dies, the new leader's `Down`
//! returns what that node's consumer held, and a publisher's resend is not enqueued twice.

use bytes::Bytes;
use warren_codec::{FieldTable, ShortStr};
use warren_queue::machine::{
    Command, ConsumerId, ConsumerSpec, CreditGroup, EnqueuerId, Meta, MsgMeta, Policy,
    QueueMachine, Reply,
};
use warren_queue::{qualify, Message};

use super::sim::Sim;
use crate::queue::{encode, Origin, Outcome, Proposals, Replica};
use crate::{GroupId, NodeId};

const G: GroupId = GroupId(0);

fn message(n: u64) -> Message {
    Message {
        exchange: ShortStr::from_static(""),
        routing_key: ShortStr::from_static("work"),
        properties: Bytes::from_static(&[0, 0]),
        body: Bytes::from(n.to_be_bytes().to_vec()),
        persistent: true,
        store_key: None,
        away: None,
    }
}

/// An id minted on `node` (Raft's node ids are the queue's node numbers here).
fn on(node: NodeId, local: u64) -> u64 {
    qualify(node as u16, local).unwrap()
}

fn publish(sim: &mut Sim, publisher: EnqueuerId, seq: u64) -> bool {
    let command = Command::EnqueueFrom {
        enqueuer: publisher,
        seq,
        message: message(seq),
        meta: MsgMeta {
            size: 8,
            ..MsgMeta::default()
        },
    };
    propose(sim, command)
}

fn propose(sim: &mut Sim, command: Command<Message>) -> bool {
    let data = encode(sim.now_ms, Origin::default(), &command).unwrap();
    sim.propose(G, data)
}

/// Each node's replica, built from what it applied, and the replies it computed.
fn replicas(sim: &Sim, nodes: &[NodeId]) -> Vec<(Replica, Vec<Reply>)> {
    nodes
        .iter()
        .map(|n| {
            let mut r = Replica::new();
            let mut replies = Vec::new();
            let mut effects = Vec::new();
            for c in sim.nodes[n].applied.get(&G).into_iter().flatten() {
                if let Some((_, reply)) = r.apply(c, &mut effects).unwrap() {
                    replies.push(reply);
                }
            }
            (r, replies)
        })
        .collect()
}

fn assert_same(replicas: &[(Replica, Vec<Reply>)]) {
    let (first, first_replies) = &replicas[0];
    for (r, replies) in &replicas[1..] {
        assert_eq!(r.applied(), first.applied());
        assert_eq!(r.machine().digest(), first.machine().digest());
        assert_eq!(replies, first_replies);
    }
}

#[test]
fn members_apply_the_same_commands_and_a_new_leader_takes_over_the_queue() {
    let mut sim = Sim::new(21, 1);
    sim.run_until_led(500).expect("a leader");
    let leader = sim.leader(G).unwrap();
    let publisher_node = leader % 3 + 1;
    let publisher = EnqueuerId(on(publisher_node, 1));
    assert!(propose(
        &mut sim,
        Command::Configure(Policy {
            deliver_on_apply: true,
            ..Policy::default()
        })
    ));
    // A worker connected to the leader's node, prefetch 2.
    let spec = ConsumerSpec {
        group: CreditGroup {
            conn: on(leader, 1),
            channel: 1,
        },
        tag: ShortStr::from_static("worker"),
        no_ack: false,
        prefetch: 2,
        exclusive: false,
        priority: 0,
        arguments: FieldTable::new(),
    };
    let worker = ConsumerId(on(leader, 1));
    assert!(propose(&mut sim, Command::Consume { id: worker, spec }));
    for seq in 1..=5 {
        assert!(publish(&mut sim, publisher, seq));
    }
    sim.run(300);
    let all = replicas(&sim, &[1, 2, 3]);
    assert_same(&all);
    let m: &QueueMachine<Message> = all[0].0.machine();
    assert_eq!(
        (m.ready_count(), m.in_flight_count()),
        (3, 2),
        "the worker holds 2"
    );

    // The leader's node dies with the worker's two deliveries.
    sim.kill(leader);
    sim.run_until_led(1000).expect("a new leader");
    let next = sim.leader(G).unwrap();
    assert_ne!(next, leader);
    assert!(propose(
        &mut sim,
        Command::Down {
            node: leader as u16
        }
    ));
    // The publisher did not hear about 5 before the failover and sends it again, then 6, through
    // the new leader's node, which waits for their answers.
    let mut waiting: Proposals<u64> = Proposals::new(next);
    for seq in [5, 6] {
        let origin = waiting.next(G, seq);
        let command = Command::EnqueueFrom {
            enqueuer: publisher,
            seq,
            message: message(seq),
            meta: MsgMeta {
                size: 8,
                ..MsgMeta::default()
            },
        };
        let data = encode(sim.now_ms, origin, &command).unwrap();
        assert!(sim.propose_on(next, G, data));
    }
    sim.run(300);
    let mut outcomes = Vec::new();
    let mut mine = Replica::new();
    let mut effects = Vec::new();
    for c in &sim.nodes[&next].applied[&G] {
        if let Some((origin, reply)) = mine.apply(c, &mut effects).unwrap() {
            waiting.applied(G, origin, reply, &mut outcomes);
        }
    }
    assert!(
        matches!(outcomes[0], Outcome::Applied(5, Reply::Duplicate)),
        "{outcomes:?}"
    );
    assert!(matches!(
        outcomes[1],
        Outcome::Applied(6, Reply::Enqueued { .. })
    ));
    assert!(waiting.is_empty());
    let survivors: Vec<NodeId> = [1, 2, 3].into_iter().filter(|n| *n != leader).collect();
    let after = replicas(&sim, &survivors);
    assert_same(&after);
    let (r, replies) = &after[0];
    let m = r.machine();
    assert_eq!(m.consumer_count(), 0, "the dead node's worker is cancelled");
    assert_eq!(m.in_flight_count(), 0, "what it held is back");
    assert_eq!(m.ready_count(), 6, "1 to 6, the resent 5 once");
    let tail: Vec<&Reply> = replies.iter().rev().take(2).collect();
    assert!(matches!(tail[1], Reply::Duplicate), "the resend: {tail:?}");
    assert!(matches!(tail[0], Reply::Enqueued { .. }));

    // A replay of the committed log on a fresh machine reaches the same state: the
    // entries alone are the queue.
    let mut fresh = QueueMachine::<Message>::default();
    let mut effects = Vec::new();
    for c in &sim.nodes[&survivors[0]].applied[&G] {
        let (head, command) = crate::queue::decode(c.data.clone()).unwrap();
        let meta = Meta {
            index: c.index,
            now_ms: head.now_ms,
        };
        fresh.apply(meta, command, &mut effects);
    }
    assert_eq!(fresh.digest(), m.digest());

    // Time moves the queue only through the log: a message with a TTL expires on every member
    // at the Tick the leader proposes once its replica says a timer is due.
    let expiring = Command::Enqueue {
        message: message(7),
        meta: MsgMeta {
            size: 8,
            expires_at: Some(sim.now_ms + 50),
            ..MsgMeta::default()
        },
    };
    assert!(propose(&mut sim, expiring));
    sim.run(100);
    let leader_replica = &replicas(&sim, &[next])[0].0;
    assert_eq!(leader_replica.machine().ready_count(), 7);
    assert!(leader_replica.due(sim.now_ms), "its expiry has passed");
    assert!(propose(&mut sim, Command::Tick));
    sim.run(100);
    let after_tick = replicas(&sim, &survivors);
    assert_same(&after_tick);
    assert_eq!(
        after_tick[0].0.machine().ready_count(),
        6,
        "expired on every member"
    );
    assert!(!after_tick[0].0.due(sim.now_ms));
}
