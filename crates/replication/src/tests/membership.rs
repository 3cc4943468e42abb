//! Membership changes: a node added to a group starts from its leader's snapshot, votes once it
//! caught up, and keeps its members across a restart; a node removed leaves the group, and a
//! leader that is to leave hands over first.

use super::sim::{config_in, Sim, SimNode};
use crate::{GroupId, MemberChange, Members, NodeId};

const G: GroupId = GroupId(7);

/// The group's members as each live node in `on` applied them.
fn members_on(sim: &Sim, on: &[NodeId]) -> Vec<Option<Members>> {
    on.iter().map(|id| sim.nodes[id].raft.members(G)).collect()
}

/// Steps until `cond`, at most `max` steps.
fn run_until(sim: &mut Sim, max: u64, what: &str, mut cond: impl FnMut(&Sim) -> bool) {
    for _ in 0..max {
        if cond(sim) {
            return;
        }
        sim.step();
    }
    assert!(cond(sim), "not within {max} steps: {what}");
}

fn data(i: u32) -> Vec<u8> {
    format!("entry {i}").into_bytes()
}

/// Four nodes in the cluster's list, the group on nodes 1 to 3 only, led by node 1, with
/// `entries` committed.
fn three_of_four(seed: u64, entries: u32) -> Sim {
    let mut sim = Sim::bare(seed, vec![1, 2, 3, 4]);
    sim.groups = vec![G];
    for id in 1..=3 {
        let n = sim.nodes.get_mut(&id).expect("node");
        n.raft.set_members(vec![1, 2, 3]);
        n.raft.add_group(G, id == 1).expect("group");
    }
    run_until(&mut sim, 500, "a leader", |s| s.leader(G).is_some());
    for i in 0..entries {
        assert!(sim.propose(G, data(i)));
    }
    run_until(&mut sim, 500, "the entries on 1 to 3", |s| {
        (1..=3).all(|id| {
            s.nodes[&id]
                .applied
                .get(&G)
                .is_some_and(|a| a.len() == entries as usize)
        })
    });
    sim
}

/// Node `id`'s member of `G`, made to be added (it waits for its leader's snapshot).
fn join_on(sim: &mut Sim, id: NodeId) {
    sim.nodes
        .get_mut(&id)
        .expect("node")
        .raft
        .join_group(G)
        .expect("join");
}

fn set_members_everywhere(sim: &mut Sim, voters: &[NodeId]) {
    for n in sim.nodes.values_mut() {
        n.raft.set_members(voters.to_vec());
    }
}

#[test]
fn a_node_added_starts_from_the_leaders_snapshot_votes_once_caught_up_and_keeps_its_members() {
    let mut sim = three_of_four(11, 30);
    let before = sim.nodes[&1].raft.members(G);
    assert_eq!(before, Some(Members::voters(vec![1, 2, 3])));
    join_on(&mut sim, 4);
    set_members_everywhere(&mut sim, &[1, 2, 3, 4]);
    run_until(&mut sim, 2000, "node 4 a voter everywhere", |s| {
        members_on(s, &[1, 2, 3, 4])
            .iter()
            .all(|m| m.as_ref() == Some(&Members::voters(vec![1, 2, 3, 4])))
    });
    // It took the log only after the leader's snapshot: its first entry follows it.
    let log4 = sim.nodes[&4].log.recovered(G);
    let snap = log4.snapshot.as_ref().expect("node 4 installed a snapshot");
    assert!(
        log4.entries
            .first()
            .is_none_or(|e| e.index > snap.meta.index),
        "{:?}",
        log4.entries.first()
    );
    assert_eq!(
        snap.members,
        Some(Members {
            voters: vec![1, 2, 3],
            learners: vec![4]
        }),
        "the snapshot carries the members at its index"
    );
    for i in 30..40 {
        assert!(sim.propose(G, data(i)));
    }
    run_until(&mut sim, 1000, "everything on node 4", |s| {
        s.nodes[&4].applied.get(&G).is_some_and(|a| a.len() == 40)
    });
    sim.assert_applied_everywhere(&[1, 2, 3, 4]);
    // Four voters: with two of them down nothing commits; node 4's vote makes a majority.
    sim.kill(2);
    for i in 40..45 {
        assert!(sim.propose(G, data(i)));
    }
    run_until(&mut sim, 1000, "a commit with node 4's vote", |s| {
        s.nodes[&4].applied.get(&G).is_some_and(|a| a.len() == 45)
    });
    // A restart of the new node keeps its members (from its snapshot and the changes after).
    sim.kill(4);
    sim.restart(4);
    // From the snapshot's members, then the promotion after it, applied again as the log
    // replays.
    assert_eq!(
        sim.nodes[&4].raft.members(G),
        Some(Members {
            voters: vec![1, 2, 3],
            learners: vec![4]
        })
    );
    sim.step();
    assert_eq!(
        sim.nodes[&4].raft.members(G),
        Some(Members::voters(vec![1, 2, 3, 4]))
    );
    sim.restart(2);
    run_until(&mut sim, 2000, "every node back", |s| {
        (1..=4).all(|id| s.nodes[&id].applied.get(&G).is_some_and(|a| a.len() == 45))
    });
    sim.assert_applied_everywhere(&[1, 2, 3, 4]);
}

#[test]
fn a_removed_node_leaves_the_group_and_a_leader_to_be_removed_hands_over_first() {
    let mut sim = three_of_four(12, 10);
    join_on(&mut sim, 4);
    set_members_everywhere(&mut sim, &[1, 2, 3, 4]);
    run_until(&mut sim, 2000, "four voters", |s| {
        s.nodes[&1].raft.members(G) == Some(Members::voters(vec![1, 2, 3, 4]))
    });
    let leader = sim.leader(G).expect("a leader");
    let stay: Vec<NodeId> = (1..=4).filter(|n| *n != leader).collect();
    set_members_everywhere(&mut sim, &stay);
    run_until(&mut sim, 3000, "the old leader out of the group", |s| {
        stay.iter()
            .all(|id| s.nodes[id].raft.members(G) == Some(Members::voters(stay.clone())))
            && s.nodes[&leader].raft.members(G).is_none()
    });
    let now = sim.leader(G).expect("a new leader");
    assert!(stay.contains(&now));
    for i in 10..20 {
        assert!(sim.propose(G, data(i)));
    }
    run_until(&mut sim, 1000, "the later entries on the three", |s| {
        stay.iter()
            .all(|id| s.nodes[id].applied.get(&G).is_some_and(|a| a.len() == 20))
    });
    // The removed node took no part: its last applied entry is before the later ones.
    let gone = sim.nodes[&leader].applied.get(&G).map_or(0, Vec::len);
    assert!(gone <= 10, "node {leader} applied {gone}");
}

#[test]
fn a_proposed_change_waits_for_the_one_before_and_is_refused_off_the_leader() {
    let mut sim = three_of_four(13, 1);
    let leader = sim.leader(G).expect("leader");
    let follower = (1..=3).find(|n| *n != leader).expect("a follower");
    let refused = sim
        .nodes
        .get_mut(&follower)
        .expect("node")
        .raft
        .propose_member_change(G, MemberChange::AddLearner(4));
    assert!(
        matches!(refused, Err(crate::Error::NotLeader { .. })),
        "{refused:?}"
    );
    let raft = &mut sim.nodes.get_mut(&leader).expect("node").raft;
    // A voter must have the log: a node not yet a learner cannot be promoted; and a leader
    // does not remove itself.
    for refused in [MemberChange::Promote(4), MemberChange::Remove(leader)] {
        let e = raft.propose_member_change(G, refused);
        assert!(
            matches!(e, Err(crate::Error::Config(_))),
            "{refused:?}: {e:?}"
        );
    }
    raft.propose_member_change(G, MemberChange::AddLearner(4))
        .expect("first");
    let second = raft.propose_member_change(G, MemberChange::Promote(4));
    assert!(
        matches!(second, Err(crate::Error::ChangeInProgress(_))),
        "{second:?}"
    );
    run_until(&mut sim, 500, "the learner applied", |s| {
        s.nodes[&leader].raft.members(G)
            == Some(Members {
                voters: vec![1, 2, 3],
                learners: vec![4],
            })
    });
}

/// The cluster's list may change (a node added to it) without changing any group's members:
/// they come from the group's records, and a group of an earlier version, which has none, is
/// recorded with the list's nodes at its first start.
#[test]
fn a_groups_members_survive_a_change_of_the_list_even_for_a_group_of_an_earlier_version() {
    let mut sim = Sim::new(14, 1);
    let g = crate::GroupId(0);
    sim.run_until_led(500).expect("led");
    assert!(sim.propose(g, data(0)));
    sim.run(50);
    // An earlier version recorded no members.
    sim.kill(1);
    sim.nodes[&1]
        .log
        .durable()
        .get_mut(&g)
        .expect("group 0 on node 1")
        .members = None;
    sim.restart(1);
    sim.run(50);
    assert_eq!(
        sim.nodes[&1].log.recovered(g).members,
        Some(Members::voters(vec![1, 2, 3])),
        "recorded at the first start"
    );
    // The list now names a fourth node: the group keeps its three.
    sim.list = vec![1, 2, 3, 4];
    for id in 1..=3 {
        sim.kill(id);
        sim.restart(id);
        assert_eq!(
            sim.nodes[&id].raft.members(g),
            Some(Members::voters(vec![1, 2, 3])),
            "node {id}"
        );
    }
}

/// Replacing a running member (3 by 4): the new node votes before the old one leaves, so the
/// group never has fewer than three voters on the way.
#[test]
fn a_running_member_replaced_leaves_only_after_its_replacement_votes() {
    let mut sim = three_of_four(15, 5);
    join_on(&mut sim, 4);
    set_members_everywhere(&mut sim, &[1, 2, 4]);
    let mut fewest = usize::MAX;
    for _ in 0..3000 {
        sim.step();
        if let Some(l) = sim.leader(G) {
            if let Some(m) = sim.nodes[&l].raft.members(G) {
                fewest = fewest.min(m.voters.len());
            }
        }
        if (1..=2)
            .chain([4])
            .all(|id| sim.nodes[&id].raft.members(G) == Some(Members::voters(vec![1, 2, 4])))
        {
            break;
        }
    }
    assert_eq!(
        sim.nodes[&1].raft.members(G),
        Some(Members::voters(vec![1, 2, 4])),
        "the replacement done"
    );
    assert!(fewest >= 3, "the group went down to {fewest} voters");
}

/// A node of an earlier version: a snapshot without members and no start record. Its first
/// start records the list's nodes, so a later list that names a fourth node changes nothing.
#[test]
fn a_group_with_an_earlier_versions_snapshot_keeps_its_members_when_the_list_grows() {
    let mut sim = Sim::new(16, 1);
    let g = crate::GroupId(0);
    sim.snapshot_every = Some(5);
    sim.run_until_led(500).expect("led");
    for i in 0..20 {
        assert!(sim.propose(g, data(i)));
    }
    sim.run(100);
    sim.kill(1);
    {
        let n = sim.nodes.get_mut(&1).expect("node");
        let mut snap = n.log.recovered(g).snapshot.expect("a snapshot");
        snap.members = None;
        crate::LogStore::save_snapshot(&mut n.log, g, &snap).expect("save");
        n.log.durable().get_mut(&g).expect("group").members = None;
    }
    sim.restart(1);
    sim.run(50);
    sim.list = vec![1, 2, 3, 4];
    sim.kill(1);
    sim.restart(1);
    sim.step();
    assert_eq!(
        sim.nodes[&1].raft.members(g),
        Some(Members::voters(vec![1, 2, 3]))
    );
}

/// A node the cluster forgets while it is down: the peers drop it, every group's leader
/// removes it, and when it comes back on its old log it takes no part in the group.
#[test]
fn a_forgotten_node_is_removed_from_its_groups_and_takes_no_part_when_it_comes_back() {
    let mut sim = three_of_four(21, 10);
    sim.kill(3);
    for id in [1, 2, 4] {
        let n = sim.nodes.get_mut(&id).expect("node");
        n.raft.set_peers(&[1, 2]);
        n.raft.set_members(vec![1, 2]);
    }
    assert!(!sim.nodes[&1].raft.is_peer(3));
    run_until(&mut sim, 3000, "node 3 out of the group", |s| {
        [1, 2]
            .iter()
            .all(|id| s.nodes[id].raft.members(G) == Some(Members::voters(vec![1, 2])))
    });
    sim.restart(3);
    for i in 10..20 {
        assert!(sim.propose(G, data(i)));
    }
    run_until(&mut sim, 2000, "the later entries on the two", |s| {
        [1, 2]
            .iter()
            .all(|id| s.nodes[id].applied.get(&G).is_some_and(|a| a.len() == 20))
    });
    sim.run(500);
    let leader = sim.leader(G).expect("a leader");
    assert!([1, 2].contains(&leader), "led by {leader}");
    let back = sim.nodes[&3].applied.get(&G).map_or(0, Vec::len);
    assert_eq!(back, 10, "node 3 took nothing more");
}

/// A node that made a group waiting for its leader's snapshot while the group counts it as a
/// voter from the start (it learnt of the queue from the metadata's snapshot, not from the
/// entry that made it) asks for the snapshot and catches up, never taking the log from its
/// first entry.
#[test]
fn a_voter_made_to_wait_for_a_snapshot_asks_its_leader_for_one() {
    let mut sim = Sim::bare(31, vec![1, 2, 3]);
    sim.groups = vec![G];
    for id in [1, 2] {
        let n = sim.nodes.get_mut(&id).expect("node");
        n.raft.add_group(G, id == 1).expect("group");
    }
    run_until(&mut sim, 500, "a leader", |s| s.leader(G).is_some());
    for i in 0..10 {
        assert!(sim.propose(G, data(i)));
    }
    sim.nodes
        .get_mut(&3)
        .expect("node 3")
        .raft
        .join_group(G)
        .expect("join");
    run_until(&mut sim, 3000, "node 3 caught up from a snapshot", |s| {
        s.nodes[&3].applied.get(&G).is_some_and(|a| a.len() == 10)
            && s.nodes[&3].raft.members(G) == Some(Members::voters(vec![1, 2, 3]))
    });
    let log3 = sim.nodes[&3].log.recovered(G);
    assert!(log3.snapshot.is_some(), "started from a snapshot");
}

/// A node replaced by an empty one under the same number, joining while a group still counts
/// the old one as a voter, gives no vote until its leader's snapshot: the candidate that lacks
/// what the old node helped commit cannot win with it.
#[test]
fn a_member_waiting_for_its_snapshot_votes_for_nobody() {
    let mut sim = Sim::bare(41, vec![1, 2, 3]);
    sim.groups = vec![G];
    for id in 1..=3 {
        let n = sim.nodes.get_mut(&id).expect("node");
        n.raft.add_group(G, id == 1).expect("group");
    }
    run_until(&mut sim, 500, "a leader", |s| s.leader(G) == Some(1));
    // Node 2 cut off: what follows is committed by nodes 1 and 3 alone.
    sim.isolated.insert(2);
    for i in 0..5 {
        assert!(sim.propose_on(1, G, data(i)));
    }
    run_until(&mut sim, 1000, "the entries on 1 and 3", |s| {
        [1, 3]
            .iter()
            .all(|id| s.nodes[id].applied.get(&G).is_some_and(|a| a.len() == 5))
    });
    // Node 3's data is lost; a new, empty node 3 joins the group (which still lists 3).
    sim.nodes
        .insert(3, SimNode::fresh(config_in(3, vec![1, 2, 3])));
    join_on(&mut sim, 3);
    // Node 1 dies; node 2 comes back with none of the five entries.
    sim.kill(1);
    sim.isolated.clear();
    for _ in 0..3000 {
        sim.step();
        assert_ne!(
            sim.leader(G),
            Some(2),
            "node 2 elected without the committed entries"
        );
    }
    assert!(sim.nodes[&3].applied.get(&G).is_none_or(|a| a.is_empty()));
}

/// Group `G` made on node 1, which campaigns at once, and 3 steps later: its pre-vote
/// requests have reached nodes 2 and 3, which do not have the group yet.
fn made_on_node_1_only(seed: u64) -> Sim {
    let mut sim = Sim::bare(seed, vec![1, 2, 3]);
    sim.groups = vec![G];
    sim.nodes
        .get_mut(&1)
        .expect("node 1")
        .raft
        .add_group(G, true)
        .expect("group");
    sim.run(3);
    sim
}

/// A new group's creator campaigns at once, usually before its peers have made the group (they
/// apply the metadata entry that makes it a little later): what it sent them meanwhile is kept
/// and stepped when they do, so it leads at once instead of after its election timeout.
#[test]
fn a_group_its_peers_make_late_is_led_by_its_creator_without_waiting_for_a_timeout() {
    let mut sim = made_on_node_1_only(51);
    assert_eq!(sim.leader(G), None);
    for id in [2, 3] {
        let n = sim.nodes.get_mut(&id).expect("node");
        n.raft.add_group(G, false).expect("group");
    }
    let election_tick = super::sim::config(1).election_tick as u64;
    let steps = sim.run_until_led(election_tick).expect("led");
    assert!(
        steps < election_tick,
        "led after {steps} steps: the creator waited for its election timeout"
    );
    assert_eq!(sim.leader(G), Some(1));
}

/// Messages for a group that never comes expire: they hold no memory for good.
#[test]
fn messages_for_a_group_that_never_comes_expire() {
    let mut sim = made_on_node_1_only(52);
    assert!(sim.nodes[&2].raft.early_count() > 0);
    let election_tick = super::sim::config(1).election_tick as u64;
    // The candidate keeps asking each election timeout: what it asked before then goes.
    sim.nodes.get_mut(&1).expect("node 1").alive = false;
    sim.run(election_tick + 2);
    assert_eq!(sim.nodes[&2].raft.early_count(), 0);
}

/// Three nodes, the group on all three; `voters` its own voters, told to every node.
fn group_voters_everywhere(sim: &mut Sim, voters: Option<&[NodeId]>) {
    for n in sim.nodes.values_mut() {
        n.raft.set_group_voters(G, voters.map(<[NodeId]>::to_vec));
    }
}

fn learners_of(voters: &[NodeId], learners: &[NodeId]) -> Members {
    Members {
        voters: voters.to_vec(),
        learners: learners.to_vec(),
    }
}

/// A group of two voters on a cluster of three: the third node (which led it, and hands the
/// leadership over first) keeps it as a learner that applies everything and never votes, so
/// the group commits without it and cannot without either voter.
#[test]
fn a_group_with_voters_of_its_own_keeps_the_other_nodes_as_learners() {
    let mut sim = Sim::bare(31, vec![1, 2, 3]);
    sim.groups = vec![G];
    for id in 1..=3 {
        let n = sim.nodes.get_mut(&id).expect("node");
        n.raft.set_members(vec![1, 2, 3]);
        n.raft.add_group(G, id == 3).expect("group");
    }
    run_until(&mut sim, 500, "node 3 leads", |s| s.leader(G) == Some(3));
    for i in 0..5 {
        assert!(sim.propose(G, data(i)));
    }
    group_voters_everywhere(&mut sim, Some(&[1, 2]));
    let want = learners_of(&[1, 2], &[3]);
    assert_eq!(sim.nodes[&3].raft.wanted_members(G), Some(want.clone()));
    let mut fewest = usize::MAX;
    run_until(&mut sim, 3000, "two voters and a learner everywhere", |s| {
        if let Some(m) = s.leader(G).and_then(|l| s.nodes[&l].raft.members(G)) {
            fewest = fewest.min(m.voters.len());
        }
        members_on(s, &[1, 2, 3])
            .iter()
            .all(|m| m.as_ref() == Some(&want))
    });
    assert!(fewest >= 2, "the group went down to {fewest} voters");
    let leader = sim.leader(G).expect("a leader");
    assert!([1, 2].contains(&leader), "node {leader} leads");
    assert_eq!(sim.nodes[&leader].raft.changing_members(), 0);
    for i in 5..10 {
        assert!(sim.propose(G, data(i)));
    }
    run_until(&mut sim, 1000, "every entry on the learner too", |s| {
        s.nodes[&3].applied.get(&G).is_some_and(|a| a.len() == 10)
    });
    sim.assert_applied_everywhere(&[1, 2, 3]);
    // Without the learner the two voters commit.
    sim.kill(3);
    for i in 10..15 {
        assert!(sim.propose(G, data(i)));
    }
    run_until(&mut sim, 1000, "a commit without the learner", |s| {
        [1, 2]
            .iter()
            .all(|id| s.nodes[id].applied.get(&G).is_some_and(|a| a.len() == 15))
    });
    // Without the other voter nothing commits, and the learner never stands for election.
    sim.restart(3);
    group_voters_everywhere(&mut sim, Some(&[1, 2]));
    let other = if leader == 1 { 2 } else { 1 };
    sim.kill(other);
    let before = sim.nodes[&leader].applied.get(&G).map_or(0, Vec::len);
    sim.propose(G, data(15));
    for _ in 0..500 {
        sim.step();
        assert_ne!(sim.leader(G), Some(3), "the learner leads");
    }
    assert_eq!(
        sim.nodes[&leader].applied.get(&G).map_or(0, Vec::len),
        before,
        "a commit with one voter of two"
    );
}

/// Voters of its own taken back: the learner votes again once caught up. Then the voters
/// move to other nodes: each node coming in votes before any going out stops.
#[test]
fn a_groups_voters_move_and_come_back_without_ever_falling_below_their_number() {
    let mut sim = Sim::bare(32, vec![1, 2, 3, 4]);
    sim.groups = vec![G];
    for id in 1..=4 {
        let n = sim.nodes.get_mut(&id).expect("node");
        n.raft.set_members(vec![1, 2, 3, 4]);
        n.raft.set_group_voters(G, Some(vec![1, 2, 3]));
        // Every node makes it with the same members, the fourth as a learner from the start.
        n.raft.add_group(G, id == 1).expect("group");
    }
    assert!(members_on(&sim, &[1, 2, 3, 4])
        .iter()
        .all(|m| m.as_ref() == Some(&learners_of(&[1, 2, 3], &[4]))));
    run_until(&mut sim, 500, "node 1 leads", |s| s.leader(G) == Some(1));
    for i in 0..20 {
        assert!(sim.propose(G, data(i)));
    }
    // Node 3 replaced by node 4; then node 1 (the leader) by node 3; then node 2 out; then all
    // four: on the way the group never has fewer voters than the fewer of before and after.
    let mut before = 3;
    for (voters, learners) in [
        (vec![1, 2, 4], vec![3]),
        (vec![2, 3, 4], vec![1]),
        (vec![3, 4], vec![1, 2]),
        (vec![1, 2, 3, 4], vec![]),
    ] {
        group_voters_everywhere(&mut sim, Some(&voters));
        let want = learners_of(&voters, &learners);
        let floor = voters.len().min(before);
        before = voters.len();
        let mut fewest = usize::MAX;
        run_until(&mut sim, 4000, "the voters moved", |s| {
            if let Some(m) = s.leader(G).and_then(|l| s.nodes[&l].raft.members(G)) {
                fewest = fewest.min(m.voters.len());
            }
            members_on(s, &[1, 2, 3, 4])
                .iter()
                .all(|m| m.as_ref() == Some(&want))
        });
        assert!(
            fewest >= floor,
            "to {voters:?}: the group went down to {fewest} voters"
        );
        let leader = sim.leader(G).expect("a leader");
        assert!(voters.contains(&leader), "node {leader} leads {voters:?}");
    }
    group_voters_everywhere(&mut sim, None);
    assert_eq!(
        sim.nodes[&1].raft.wanted_members(G),
        Some(Members::voters(vec![1, 2, 3, 4]))
    );
    for i in 20..30 {
        assert!(sim.propose(G, data(i)));
    }
    run_until(&mut sim, 1000, "every entry everywhere", |s| {
        (1..=4).all(|id| s.nodes[&id].applied.get(&G).is_some_and(|a| a.len() == 30))
    });
    sim.assert_applied_everywhere(&[1, 2, 3, 4]);
}

#[test]
fn a_groups_own_voters_outside_the_cluster_are_left_out() {
    let w = |target: Option<&[NodeId]>, own: Option<Option<&[NodeId]>>| {
        super::super::multi::wanted_members_for_tests(target, &[1, 2, 3], own)
    };
    assert_eq!(w(None, None), None, "no target: members stay");
    assert_eq!(
        w(Some(&[1, 2, 3]), None),
        Some(Members::voters(vec![1, 2, 3]))
    );
    assert_eq!(
        w(Some(&[1, 2, 3]), Some(Some(&[3, 1, 3]))),
        Some(learners_of(&[1, 3], &[2]))
    );
    // Node 5 is not in the cluster; node 4 is, as a learner.
    assert_eq!(
        w(Some(&[1, 2, 4]), Some(Some(&[2, 5]))),
        Some(learners_of(&[2], &[1, 4]))
    );
    // Without a target, the cluster's nodes at start.
    assert_eq!(w(None, Some(Some(&[2]))), Some(learners_of(&[2], &[1, 3])));
    // None left: every node votes.
    assert_eq!(
        w(Some(&[1, 2]), Some(Some(&[7]))),
        Some(Members::voters(vec![1, 2]))
    );
    // Taken back: every node votes, with a target or without.
    assert_eq!(w(None, Some(None)), Some(Members::voters(vec![1, 2, 3])));
    assert_eq!(
        w(Some(&[1, 4]), Some(None)),
        Some(Members::voters(vec![1, 4]))
    );
}

#[test]
fn a_demotion_is_refused_for_the_leader_and_a_non_voter() {
    let mut sim = three_of_four(33, 1);
    let leader = sim.leader(G).expect("leader");
    let raft = &mut sim.nodes.get_mut(&leader).expect("node").raft;
    for refused in [
        MemberChange::Demote(leader),
        MemberChange::Demote(4),
        MemberChange::AddLearner(if leader == 1 { 2 } else { 1 }),
    ] {
        let e = raft.propose_member_change(G, refused);
        assert!(
            matches!(e, Err(crate::Error::Config(_))),
            "{refused:?}: {e:?}"
        );
    }
    let follower = (1..=3).find(|n| *n != leader).expect("a follower");
    raft.propose_member_change(G, MemberChange::Demote(follower))
        .expect("demote");
    let mut voters: Vec<NodeId> = (1..=3).filter(|n| *n != follower).collect();
    voters.sort_unstable();
    run_until(&mut sim, 500, "the follower demoted", |s| {
        s.nodes[&leader].raft.members(G) == Some(learners_of(&voters, &[follower]))
    });
}

/// A voter leaves only once the voters coming in vote, and only while those staying have a
/// majority up: with the node coming in down (and no member yet), or with a staying voter
/// down, the group keeps the voter it would lose, and moves once the node is back.
#[test]
fn a_voter_stays_while_its_replacement_is_down_or_the_rest_would_lose_their_majority() {
    // The group on nodes 1 to 3, led by node 1; node 4 holds nothing of it.
    let mut sim = three_of_four(34, 5);
    sim.kill(4);
    sim.run(300);
    // 3 to be replaced by 4, which is down (and seen down).
    for n in sim.nodes.values_mut() {
        n.raft.set_members(vec![1, 2, 3, 4]);
    }
    group_voters_everywhere(&mut sim, Some(&[1, 2, 4]));
    sim.run(1500);
    assert_eq!(
        sim.nodes[&1].raft.members(G),
        Some(Members::voters(vec![1, 2, 3])),
        "node 3 demoted while node 4 was down"
    );
    // Node 3 out, node 2 down: demoting 3 would leave {1, 2} with one of two up.
    sim.kill(2);
    sim.run(300);
    group_voters_everywhere(&mut sim, Some(&[1, 2]));
    sim.run(1500);
    assert_eq!(
        sim.nodes[&1].raft.members(G),
        Some(Members::voters(vec![1, 2, 3])),
        "node 3 demoted with node 2 down"
    );
    assert!(sim.propose(G, data(5)), "the group still commits");
    run_until(&mut sim, 500, "the entry on node 3", |s| {
        s.nodes[&3].applied.get(&G).is_some_and(|a| a.len() == 6)
    });
    // Both back (node 4 made a member of the group, waiting for its leader's snapshot): the
    // change goes through.
    sim.restart(2);
    sim.restart(4);
    join_on(&mut sim, 4);
    for n in sim.nodes.values_mut() {
        n.raft.set_members(vec![1, 2, 3, 4]);
    }
    group_voters_everywhere(&mut sim, Some(&[1, 2]));
    run_until(&mut sim, 3000, "two voters and two learners", |s| {
        s.nodes[&1].raft.members(G) == Some(learners_of(&[1, 2], &[3, 4]))
    });
}

/// A learner sees no election: its leader died (here: handed over and won back) and led
/// again in a later term looks unchanged to it. `ReadyBatch::leaders` still reports the new
/// term, so that what the learner's node sent the leader in its earlier term is sent again.
#[test]
fn a_learner_is_told_of_the_same_leader_in_a_later_term() {
    let mut sim = Sim::bare(33, vec![1, 2, 3]);
    sim.groups = vec![G];
    for id in 1..=3 {
        let n = sim.nodes.get_mut(&id).expect("node");
        n.raft.set_members(vec![1, 2, 3]);
        n.raft.set_group_voters(G, Some(vec![1, 2]));
        n.raft.add_group(G, id == 1).expect("group");
    }
    run_until(&mut sim, 500, "node 1 leads, known to the learner", |s| {
        s.leader(G) == Some(1) && s.nodes[&3].reported_leaders.get(&G) == Some(&Some(1))
    });
    let term = sim.nodes[&1].raft.term_of(G).expect("a term");
    let reports = sim.nodes[&3].leader_reports;
    sim.isolated.insert(3);
    for to in [2, 1] {
        let from = if to == 2 { 1 } else { 2 };
        // Asked until the leader takes it (the peer must be known up and have the log).
        let mut asked = false;
        for _ in 0..200 {
            if asked || sim.leader(G) == Some(to) {
                break;
            }
            asked = sim
                .nodes
                .get_mut(&from)
                .expect("node")
                .raft
                .transfer_leader(G, to);
            sim.step();
        }
        assert!(asked, "node {from} never took the transfer to {to}");
        run_until(&mut sim, 1000, "the leadership handed over", |s| {
            s.leader(G) == Some(to)
        });
    }
    assert!(sim.nodes[&1].raft.term_of(G) > Some(term));
    sim.isolated.clear();
    run_until(&mut sim, 1000, "the learner hears of the later term", |s| {
        s.nodes[&3].raft.term_of(G) == s.nodes[&1].raft.term_of(G)
    });
    sim.run(5);
    assert_eq!(sim.nodes[&3].reported_leaders.get(&G), Some(&Some(1)));
    assert!(
        sim.nodes[&3].leader_reports > reports,
        "the same leader in a later term was not reported"
    );
}
