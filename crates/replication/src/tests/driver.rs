//! What a node's driver needs beyond the Raft loop: leader changes to report, refused proposals
//! handed back, groups removed, and whether another pass is due at once.

use super::sim::Sim;
use crate::{Error, GroupId, NodeId};

fn reported(sim: &Sim, node: NodeId, g: u64) -> Option<NodeId> {
    sim.nodes[&node]
        .reported_leaders
        .get(&GroupId(g))
        .copied()
        .flatten()
}

#[test]
fn every_leader_change_is_reported_to_the_driver() {
    let mut sim = Sim::new(5, 30);
    sim.run_until_led(100).expect("leaders elected");
    for node in 1..=3 {
        for g in 0..30 {
            assert_eq!(
                reported(&sim, node, g),
                Some(g % 3 + 1),
                "node {node}, group {g}"
            );
        }
    }
    sim.kill(1);
    sim.run_until_led(100).expect("survivors lead");
    for node in 2..=3 {
        for g in 0..30 {
            let now = sim.nodes[&node].raft.leader_of(GroupId(g));
            assert!(now.is_some_and(|l| l != 1));
            assert_eq!(reported(&sim, node, g), now, "node {node}, group {g}");
        }
    }
}

#[test]
fn a_proposal_on_a_follower_comes_back_with_its_data_and_the_leader() {
    let mut sim = Sim::new(6, 3);
    sim.run_until_led(100).expect("leaders elected");
    // Group 0's leader is node 1.
    let n2 = sim.nodes.get_mut(&2).expect("node 2");
    let refused = n2
        .raft
        .try_propose(GroupId(0), b"body".to_vec())
        .expect_err("node 2 follows");
    assert_eq!(refused.data, b"body");
    assert!(matches!(
        refused.error,
        Error::NotLeader {
            group: GroupId(0),
            leader: Some(1)
        }
    ));
    let refused = n2
        .raft
        .try_propose(GroupId(99), b"x".to_vec())
        .expect_err("no such group");
    assert_eq!(refused.data, b"x");
    assert!(matches!(refused.error, Error::NoGroup(GroupId(99))));
    assert!(sim
        .nodes
        .get_mut(&1)
        .expect("node 1")
        .raft
        .try_propose(GroupId(0), b"ok".to_vec())
        .is_ok());
}

#[test]
fn a_removed_group_is_gone_and_the_others_go_on() {
    let mut sim = Sim::new(7, 3);
    sim.run_until_led(100).expect("leaders elected");
    for n in sim.nodes.values_mut() {
        assert!(n.raft.remove_group(GroupId(1)));
        assert!(!n.raft.remove_group(GroupId(1)));
    }
    sim.groups.retain(|g| *g != GroupId(1));
    assert!(sim.propose(GroupId(0), b"a".to_vec()));
    assert!(sim.propose(GroupId(2), b"b".to_vec()));
    sim.run_until_asleep(100).expect("asleep");
    sim.assert_applied_everywhere(&[1, 2, 3]);
    assert_eq!(sim.committed_ever.len(), 2);
    for n in sim.nodes.values() {
        assert_eq!(n.raft.group_count(), 2);
        assert_eq!(n.raft.leader_of(GroupId(1)), None);
    }
}

#[test]
fn has_ready_says_when_another_pass_is_due() {
    let mut sim = Sim::new(8, 3);
    sim.run_until_led(100).expect("leaders elected");
    sim.run_until_asleep(100).expect("asleep");
    let n1 = sim.nodes.get_mut(&1).expect("node 1");
    assert!(!n1.raft.has_ready());
    n1.raft.propose(GroupId(0), b"p".to_vec()).expect("leader");
    assert!(n1.raft.has_ready());
    let mut rd = n1.raft.ready();
    assert!(!n1.raft.has_ready());
    rd.persist(&mut n1.log).expect("mem log");
    rd.messages.clear();
    let _ = n1.raft.advance(rd);
}
