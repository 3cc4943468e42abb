use super::sim::Sim;
use crate::{GroupId, NodeId};

const GROUPS: u64 = 30;

fn led_by(sim: &Sim, node: NodeId) -> usize {
    (0..GROUPS)
        .filter(|g| sim.leader(GroupId(*g)) == Some(node))
        .count()
}

fn set_draining(sim: &mut Sim, node: NodeId, on: bool) {
    if let Some(n) = sim.nodes.get_mut(&node) {
        n.raft.set_draining(on);
    }
}

fn propose_all(sim: &mut Sim, round: &str) {
    for g in 0..GROUPS {
        assert!(
            sim.propose(GroupId(g), format!("{round} {g}").into_bytes()),
            "group {g} has a leader to take {round}"
        );
    }
}

#[test]
fn a_draining_node_hands_every_leadership_over_and_stands_for_none() {
    let mut sim = Sim::new(11, GROUPS);
    sim.run_until_led(100).expect("leaders elected");
    sim.run_until_asleep(100).expect("asleep");
    assert_eq!(led_by(&sim, 1), 10);
    set_draining(&mut sim, 1, true);
    let mut took = None;
    for step in 0..100 {
        sim.step();
        if led_by(&sim, 1) == 0 && sim.all_led() {
            took = Some(step);
            break;
        }
    }
    let took = took.expect("node 1 handed its groups over");
    // A transfer is a TimeoutNow and one vote round once the follower has the log.
    assert!(took <= 10, "took {took} steps");
    for n in [2, 3] {
        assert!(sim.nodes[&n].raft.peer_draining(1), "node {n} heard of it");
    }
    // Node 1 still holds its copies and counts in each majority.
    propose_all(&mut sim, "drained");
    sim.run_until_asleep(100).expect("asleep");
    sim.assert_applied_everywhere(&[1, 2, 3]);
    assert_eq!(led_by(&sim, 1), 0);

    // With node 2 gone, node 3 leads everything on node 1's votes; node 1 never stands.
    sim.kill(2);
    sim.run_until_led(100)
        .expect("node 3 elected with the drained node's votes");
    assert_eq!(led_by(&sim, 3), GROUPS as usize);
    propose_all(&mut sim, "one down");
    sim.run_until_asleep(200).expect("asleep");
    assert_eq!(sim.committed_ever.len(), 2 * GROUPS as usize);
    sim.assert_applied_everywhere(&[1, 3]);

    // Revived, node 1 may lead again: with node 3 gone it takes over what node 2 cannot.
    set_draining(&mut sim, 1, false);
    sim.restart(2);
    sim.run_until_led(100).expect("led with node 2 back");
    sim.run_until_asleep(200).expect("asleep");
    sim.kill(3);
    sim.run_until_led(100).expect("led without node 3");
    assert!(
        led_by(&sim, 1) > 0,
        "a revived node stands for election again"
    );
    propose_all(&mut sim, "revived");
    sim.run_until_asleep(200).expect("asleep");
    assert_eq!(sim.committed_ever.len(), 3 * GROUPS as usize);
}

#[test]
fn proposals_made_during_a_transfer_are_held_then_committed_or_handed_back() {
    let mut sim = Sim::new(12, GROUPS);
    sim.run_until_led(100).expect("leaders elected");
    sim.run_until_asleep(100).expect("asleep");
    let led: Vec<u64> = (0..GROUPS)
        .filter(|g| sim.leader(GroupId(*g)) == Some(1))
        .collect();
    set_draining(&mut sim, 1, true);
    // One step starts the transfers; what node 1 is asked meanwhile is not dropped.
    sim.step();
    let mut held = 0;
    for g in &led {
        let n = sim.nodes.get_mut(&1).expect("node 1");
        if n.raft
            .propose(GroupId(*g), format!("during {g}").into_bytes())
            .is_ok()
        {
            held += 1;
        }
    }
    assert_eq!(held, led.len(), "taken while transferring");
    sim.run(50);
    let refused = sim.nodes[&1].refused.clone();
    let committed = sim
        .committed_ever
        .values()
        .filter(|c| c.data.starts_with(b"during"))
        .count();
    // Each is either in the log or handed back (to go to the new leader): none vanishes.
    assert_eq!(committed + refused.len(), led.len(), "{refused:?}");
    for (g, data, leader) in refused {
        assert!(data.starts_with(b"during"));
        assert_ne!(
            leader,
            Some(1),
            "group {g:?} handed back with its new leader"
        );
    }
    assert_eq!(led_by(&sim, 1), 0);
}

#[test]
fn two_drained_nodes_lead_again_when_the_third_is_gone() {
    let mut sim = Sim::new(13, GROUPS);
    sim.run_until_led(100).expect("leaders elected");
    set_draining(&mut sim, 1, true);
    set_draining(&mut sim, 2, true);
    sim.run(60);
    sim.run_until_led(100).expect("led");
    assert_eq!(led_by(&sim, 3), GROUPS as usize, "only node 3 may lead");
    sim.kill(3);
    sim.run_until_led(200)
        .expect("the drained nodes elect rather than leave the groups without a leader");
    propose_all(&mut sim, "last two");
    sim.run_until_asleep(200).expect("asleep");
    assert_eq!(sim.committed_ever.len(), GROUPS as usize);
}
