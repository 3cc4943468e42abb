//! Messages moved into a quorum queue (the management API's "Move messages", shovels'
//! moves): each leaves its source only once its copy's entry is applied, and goes back to the
//! source when that entry is lost. Raft is played by the test: it commits or refuses what the
//! node proposes.

use bytes::Bytes;
use warren_broker::{Broker, BrokerConfig, Committed, GroupId, Message, Proposal, QueueDef};
use warren_codec::{FieldTable, FieldValue, ShortStr};

use crate::{Node, SessionConfig};

const NODES: [u64; 3] = [1, 2, 3];
const TERM: u64 = 1;

struct Leader {
    node: Node,
    group: u64,
    /// The last index committed in the queue's group.
    index: u64,
    now: u64,
}

fn message(n: u32) -> Message {
    Message {
        exchange: ShortStr::from_static(""),
        routing_key: ShortStr::from_static("source"),
        properties: Bytes::from_static(&[0x00, 0x00]),
        body: Bytes::from(format!("job {n}")),
        persistent: false,
        store_key: None,
        away: None,
    }
}

fn def(name: &'static str, arguments: FieldTable) -> QueueDef {
    QueueDef {
        vhost: "/".into(),
        name: ShortStr::from_static(name),
        key: 0,
        auto_delete: false,
        arguments,
        group: None,
        voters: None,
    }
}

impl Leader {
    /// Node 1 of three, leading the quorum queue `target`, with a local (classic) queue
    /// `source` holding `count` messages.
    fn new(count: u32) -> Leader {
        let mut node = Node::new(
            SessionConfig::default(),
            Broker::new(BrokerConfig::default()),
        );
        node.join_cluster(1, &NODES, 1);
        let b = node.broker_mut();
        let mut quorum = FieldTable::new();
        quorum.insert("x-queue-type", FieldValue::long_str("quorum"));
        let target = b.restore_queue(&def("target", quorum)).expect("target");
        b.restore_queue(&def("source", FieldTable::new()))
            .expect("source");
        let group = b.replica_group(target).expect("a replicated target");
        for n in 0..count {
            let routed = b
                .publish("/", "", "source", message(n), 0)
                .expect("publish");
            assert_eq!(routed.queues, 1);
        }
        let mut l = Leader {
            node,
            group,
            index: 0,
            now: 0,
        };
        l.node.set_leader(group, Some(1), TERM, 0);
        l.commit_all();
        assert!(l.node.broker().acts_on(target), "the leader acts");
        l
    }

    /// The queue group's proposals made since the last look.
    fn proposals(&mut self) -> Vec<Vec<u8>> {
        let mut out: Vec<Proposal> = Vec::new();
        self.node.take_proposals(&mut out);
        out.into_iter()
            .filter(|p| p.group == self.group && p.to.is_none())
            .map(|p| p.data)
            .collect()
    }

    /// Raft commits every proposal, in order.
    fn commit_all(&mut self) {
        for _ in 0..10 {
            let data = self.proposals();
            if data.is_empty() {
                return;
            }
            let entries: Vec<Committed> = data
                .into_iter()
                .map(|d| {
                    self.index += 1;
                    Committed {
                        group: GroupId(self.group),
                        index: self.index,
                        term: TERM,
                        data: Bytes::from(d),
                    }
                })
                .collect();
            self.now += 10;
            self.node.replicated(&entries, self.now);
        }
        panic!("proposals kept coming");
    }

    /// Raft hands every proposal back: this node no longer leads when it would have
    /// appended them (deposed, then elected again).
    fn refuse_all(&mut self) -> usize {
        let data = self.proposals();
        for d in &data {
            self.now += 10;
            self.node.proposal_refused(self.group, d, Some(1), self.now);
        }
        data.len()
    }

    fn counts(&self, name: &str) -> usize {
        let b = self.node.broker();
        let id = b.queue_id("/", name).expect("queue");
        let m = b.machine(id).expect("machine");
        m.ready_count() + m.in_flight_count()
    }

    fn committed_count(&self, name: &str) -> usize {
        let b = self.node.broker();
        let id = b.queue_id("/", name).expect("queue");
        b.committed_machine(id).expect("committed").ready_count()
    }

    /// Moves the source's `n` messages into the target.
    fn move_all(&mut self, n: u32) {
        let moved = self
            .node
            .move_messages("/", "source", "target", n, self.now)
            .expect("move");
        assert_eq!(moved, n);
    }
}

#[test]
fn a_moved_message_leaves_its_source_once_its_copy_is_applied() {
    let mut l = Leader::new(2);
    l.move_all(2);
    // Taken from the source, held until the copies' entries are applied.
    assert_eq!(l.counts("source"), 2, "held in flight, not gone");
    l.commit_all();
    assert_eq!(l.counts("source"), 0);
    assert_eq!(l.committed_count("target"), 2);
}

#[test]
fn a_moved_message_whose_copy_is_lost_goes_back_to_its_source() {
    let mut l = Leader::new(2);
    l.move_all(2);
    assert!(l.refuse_all() > 0, "the copies were proposed");
    // The leader falls back to its committed state and acts again; what it proposes then
    // (its new term's marker) is committed.
    l.commit_all();
    assert_eq!(l.committed_count("target"), 0, "no copy in the target");
    let b = l.node.broker();
    let id = b.queue_id("/", "source").expect("source");
    let m = b.machine(id).expect("machine");
    assert_eq!(
        (m.ready_count(), m.in_flight_count()),
        (2, 0),
        "both back in the source, ready"
    );
}
