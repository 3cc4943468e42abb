use super::sim::{Rng, Sim};
use crate::GroupId;

/// Elections settled and every group asleep.
fn settled(seed: u64, groups: u64) -> Sim {
    let mut sim = Sim::new(seed, groups);
    sim.run_until_led(100).expect("leaders elected");
    sim.run_until_asleep(100).expect("groups hibernate");
    sim
}

#[test]
fn an_idle_cluster_sends_no_raft_messages_and_ticks_no_group() {
    let mut sim = settled(0, 300);
    let (msgs, ticks, beats) = (
        sim.raft_msgs_sent(),
        sim.group_ticks(),
        sim.node_heartbeats_sent(),
    );
    sim.run(100);
    assert_eq!(sim.raft_msgs_sent() - msgs, 0, "raft messages while idle");
    assert_eq!(sim.group_ticks() - ticks, 0, "group ticks while idle");
    // Liveness costs one heartbeat per node pair and direction per tick, whatever the group count.
    assert_eq!(sim.node_heartbeats_sent() - beats, 100 * 3 * 2);
    assert!(sim.all_led());
}

#[test]
fn groups_elect_and_hibernate_within_a_bounded_number_of_ticks() {
    let mut sim = Sim::new(0, 300);
    let led = sim.run_until_led(100).expect("leaders elected");
    let asleep = sim.run_until_asleep(100).expect("groups hibernate");
    assert!(led <= 10, "elected after {led} ticks");
    assert!(asleep <= 20, "asleep {asleep} ticks after election");
    for g in 0..300 {
        assert_eq!(
            sim.leader(GroupId(g)),
            Some(g % 3 + 1),
            "placed leader of {g}"
        );
    }
}

#[test]
fn a_proposal_wakes_only_its_group_which_sleeps_again() {
    let mut sim = settled(0, 300);
    let msgs = sim.raft_msgs_sent();
    assert!(sim.propose(GroupId(7), b"hello".to_vec()));
    for _ in 0..20 {
        sim.step();
        assert!(sim.awake_total() <= 3, "only group 7 may wake");
    }
    sim.run_until_asleep(50).expect("asleep again");
    sim.assert_applied_everywhere(&[1, 2, 3]);
    assert_eq!(sim.committed_ever.len(), 1);
    // Append, responses, commit and heartbeats of one group only: a handful of messages.
    assert!(
        sim.raft_msgs_sent() - msgs < 40,
        "{} messages",
        sim.raft_msgs_sent() - msgs
    );
}

#[test]
fn hibernating_groups_elect_on_the_survivors_when_their_leader_node_dies() {
    let mut sim = settled(1, 300);
    for g in 0..300 {
        assert!(sim.propose(GroupId(g), format!("before {g}").into_bytes()));
    }
    sim.run_until_asleep(100)
        .expect("asleep after the proposals");
    let before: Vec<_> = (0..300).map(|g| sim.leader(GroupId(g))).collect();
    sim.kill(1);
    let took = sim
        .run_until_led(60)
        .expect("groups led by node 1 elect new leaders");
    // Detection (node_down_ticks), the longest election timeout, a pre-vote and a vote round.
    assert!(took <= 30, "took {took} ticks");
    for g in 0..300u64 {
        let now = sim.leader(GroupId(g)).expect("a leader");
        assert_ne!(now, 1);
        if before[g as usize] != Some(1) {
            assert_eq!(
                Some(now),
                before[g as usize],
                "group {g} kept its live leader"
            );
        }
    }
    // A dead follower does not keep leaders awake.
    sim.run_until_asleep(100)
        .expect("survivors hibernate with a peer down");
    for g in 0..300 {
        assert!(sim.propose(GroupId(g), format!("after {g}").into_bytes()));
    }
    sim.run_until_asleep(100)
        .expect("asleep after the proposals");
    assert_eq!(sim.committed_ever.len(), 600);
    sim.assert_applied_everywhere(&[2, 3]);
}

#[test]
fn groups_elect_at_their_next_ticks_when_the_dead_leaders_connection_is_seen_closing() {
    let mut sim = settled(1, 300);
    sim.run_until_asleep(100).expect("asleep");
    sim.kill(1);
    for n in [2, 3] {
        if let Some(node) = sim.nodes.get_mut(&n) {
            node.raft.peer_lost(1);
        }
    }
    let took = sim.run_until_led(60).expect("new leaders");
    // A pre-vote and a vote round after the shortest election timeout's last ticks: far less
    // than detection by missing heartbeats plus a full timeout (18 ticks measured).
    assert!(took <= 10, "took {took} ticks");
    for g in 0..300 {
        assert!(sim.propose(GroupId(g), format!("after {g}").into_bytes()));
    }
    sim.run_until_asleep(100)
        .expect("asleep after the proposals");
    assert_eq!(sim.committed_ever.len(), 300);
    sim.assert_applied_everywhere(&[2, 3]);
}

#[test]
fn a_leader_node_that_restarts_before_it_is_seen_down_loses_nothing() {
    let mut sim = settled(3, 30);
    for g in 0..30 {
        assert!(sim.propose(GroupId(g), format!("before {g}").into_bytes()));
    }
    sim.run_until_asleep(100)
        .expect("asleep after the proposals");
    sim.kill(1);
    sim.step();
    sim.restart(1);
    let took = sim.run_until_led(100).expect("leaders again");
    // Seen through its new incarnation at once, not after node_down_ticks of silence.
    assert!(took <= 30, "took {took} ticks");
    for g in 0..30 {
        assert!(sim.propose(GroupId(g), format!("after {g}").into_bytes()));
    }
    sim.run_until_asleep(100)
        .expect("asleep after the proposals");
    assert_eq!(sim.committed_ever.len(), 60);
    sim.assert_applied_everywhere(&[1, 2, 3]);
}

#[test]
fn followers_apply_everything_before_their_group_sleeps_even_when_messages_are_lost() {
    for seed in 0..8 {
        let mut sim = Sim::new(seed, 30);
        sim.drop_percent = 30;
        sim.spare_heartbeats = true;
        sim.run_until_led(300).expect("leaders");
        for round in 0..3 {
            for g in 0..30 {
                sim.propose(GroupId(g), format!("{round}/{g}").into_bytes());
            }
            sim.step();
        }
        sim.run_until_asleep(1000).expect("asleep");
        assert!(!sim.committed_ever.is_empty());
        sim.assert_applied_everywhere(&[1, 2, 3]);
    }
}

#[test]
fn a_minority_partition_commits_nothing() {
    let mut sim = settled(2, 30);
    sim.isolated.insert(1);
    let mut proposed = 0;
    for g in (0..30).filter(|g| g % 3 == 0) {
        // Node 1 still believes it leads these groups and accepts the proposal.
        assert!(sim.propose_on(1, GroupId(g), b"minority".to_vec()));
        proposed += 1;
    }
    assert_eq!(proposed, 10);
    sim.run(100);
    sim.run_until_led(100).expect("the majority elects leaders");
    for g in 0..30 {
        assert!(sim.propose(GroupId(g), b"majority".to_vec()));
    }
    sim.run(50);
    sim.isolated.clear();
    sim.run(100);
    sim.run_until_asleep(100).expect("asleep after healing");
    assert!(
        sim.committed_ever
            .values()
            .all(|c| &c.data[..] != b"minority"),
        "a minority committed"
    );
    assert_eq!(sim.committed_ever.len(), 30);
    sim.assert_applied_everywhere(&[1, 2, 3]);
}

/// Random proposals under message loss, delays, a partition, and a crash and restart from the
/// durable log. Checked all along: a committed entry is durable on a majority and no two entries
/// commit at one index. At the end: every node applied every committed entry in one order.
fn random_schedule(seed: u64, async_log: bool, snapshot_every: Option<u64>) {
    let groups = 12;
    let mut sim = Sim::new(seed, groups);
    sim.async_log = async_log;
    sim.snapshot_every = snapshot_every;
    let mut rng = Rng::new(seed ^ 0x5eed);
    sim.drop_percent = 5 + rng.below(10);
    sim.max_delay = rng.below(4);
    let mut dead: Option<(u64, u64)> = None;
    let mut cut: Option<(u64, u64)> = None;
    for step in 0..800u64 {
        if rng.chance(30) {
            let g = GroupId(rng.below(groups));
            sim.propose(g, format!("{seed}/{step}").into_bytes());
        }
        match dead {
            Some((node, until)) if step >= until => {
                sim.restart(node);
                dead = None;
            }
            None if cut.is_none() && rng.chance(1) => {
                let node = 1 + rng.below(3);
                sim.kill(node);
                dead = Some((node, step + 50 + rng.below(150)));
            }
            _ => {}
        }
        match cut {
            Some((_, until)) if step >= until => {
                sim.isolated.clear();
                cut = None;
            }
            None if dead.is_none() && rng.chance(1) => {
                let node = 1 + rng.below(3);
                sim.isolated.insert(node);
                cut = Some((node, step + 20 + rng.below(100)));
            }
            _ => {}
        }
        sim.step();
    }
    if let Some((node, _)) = dead {
        sim.restart(node);
    }
    sim.isolated.clear();
    sim.drop_percent = 0;
    sim.max_delay = 0;
    sim.run_until_led(300).expect("leaders after healing");
    if sim.run_until_asleep(300).is_none() {
        for (id, n) in &sim.nodes {
            for g in 0..groups {
                if n.raft.is_awake(GroupId(g)) {
                    eprintln!(
                        "seed {seed} node {id} group {g}: {}",
                        n.raft.debug_group(GroupId(g))
                    );
                }
            }
        }
        panic!("not asleep after healing");
    }
    assert!(!sim.committed_ever.is_empty());
    sim.assert_applied_everywhere(&[1, 2, 3]);
}

#[test]
fn random_schedules_with_loss_partitions_and_crashes_keep_every_committed_entry() {
    let seeds: u64 = std::env::var("WARREN_SIM_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(24);
    for seed in 0..seeds {
        random_schedule(seed, false, None);
    }
}

/// The same with every node snapshotting its groups every few entries and its log keeping
/// only a few behind: followers that lag or restart catch up from a snapshot.
#[test]
fn random_schedules_with_snapshots_and_compaction_keep_every_committed_entry() {
    let seeds: u64 = std::env::var("WARREN_SIM_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(24);
    for seed in 0..seeds {
        random_schedule(seed, seed % 2 == 1, Some(1 + seed % 4));
    }
}

#[test]
fn random_schedules_with_asynchronous_log_writes_keep_every_committed_entry() {
    let seeds: u64 = std::env::var("WARREN_SIM_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(24);
    for seed in 0..seeds {
        random_schedule(seed, true, None);
    }
}

#[test]
fn with_asynchronous_log_writes_groups_still_fail_over_and_sleep() {
    let mut sim = Sim::new(4, 60);
    sim.async_log = true;
    sim.run_until_led(100).expect("leaders elected");
    sim.run_until_asleep(100).expect("groups hibernate");
    let msgs = sim.raft_msgs_sent();
    sim.run(50);
    assert_eq!(sim.raft_msgs_sent(), msgs, "idle");
    for g in 0..60 {
        assert!(sim.propose(GroupId(g), format!("before {g}").into_bytes()));
    }
    sim.run_until_asleep(100)
        .expect("asleep after the proposals");
    sim.kill(2);
    sim.run_until_led(60).expect("new leaders");
    for g in 0..60 {
        assert!(sim.propose(GroupId(g), format!("after {g}").into_bytes()));
    }
    sim.run_until_asleep(100).expect("asleep again");
    assert_eq!(sim.committed_ever.len(), 120);
    sim.assert_applied_everywhere(&[1, 3]);
}

#[test]
fn a_configuration_that_would_let_followers_time_out_while_asleep_is_refused() {
    let mut cfg = super::sim::config(1);
    cfg.hibernate_ticks = 9;
    assert!(crate::MultiRaft::new(cfg).is_err());
    let mut cfg = super::sim::config(1);
    cfg.node_down_ticks = cfg.node_heartbeat_ticks;
    assert!(crate::MultiRaft::new(cfg).is_err());
    assert!(crate::MultiRaft::new(super::sim::config(1)).is_ok());
}

#[test]
fn a_group_asleep_holds_no_entry_in_memory_and_a_member_back_from_down_still_catches_up() {
    let mut sim = settled(2, 30);
    sim.kill(3);
    sim.run_until_led(60).expect("led without node 3");
    for round in 0..3 {
        for g in 0..30 {
            assert!(sim.propose(GroupId(g), format!("{round} {g}").into_bytes()));
        }
        sim.run_until_asleep(100)
            .expect("asleep after the proposals");
    }
    for g in 0..30 {
        for n in [1, 2] {
            assert_eq!(
                sim.nodes[&n].raft.entries_in_memory(GroupId(g)),
                Some(0),
                "group {g} on node {n}"
            );
        }
    }
    // What node 3 lacks is read back from the durable log.
    sim.restart(3);
    sim.run_until_led(100).expect("led with node 3 back");
    for g in 0..30 {
        assert!(sim.propose(GroupId(g), format!("after {g}").into_bytes()));
    }
    sim.run_until_asleep(200).expect("asleep again");
    assert_eq!(sim.committed_ever.len(), 120);
    sim.assert_applied_everywhere(&[1, 2, 3]);
}
