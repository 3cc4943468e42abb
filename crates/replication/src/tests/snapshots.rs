//! Snapshots through the groups: a follower cut off while its leader's log is compacted past
//! it is sent the leader's snapshot, and a node restarted from a snapshot replays only the
//! entries after it.

use super::sim::Sim;
use crate::GroupId;

const G: GroupId = GroupId(0);

fn propose_many(sim: &mut Sim, from: u32, n: u32) {
    for i in from..from + n {
        assert!(
            sim.propose(G, format!("entry {i}").into_bytes()),
            "entry {i}"
        );
        sim.step();
    }
    sim.run(20);
}

#[test]
fn a_follower_behind_the_compacted_log_gets_the_snapshot_and_a_restart_replays_the_tail() {
    let mut sim = Sim::new(11, 1);
    sim.snapshot_every = Some(10);
    sim.run_until_led(200).expect("a leader");
    let leader = sim.leader(G).expect("leader");
    let behind = leader % 3 + 1;
    sim.isolated.insert(behind);
    propose_many(&mut sim, 0, 100);
    let log = sim.nodes[&leader].log.recovered(G);
    let snap = log.snapshot.as_ref().expect("the leader snapshotted");
    assert!(snap.meta.index >= 90, "snapshot at {}", snap.meta.index);
    let first = log.entries.first().map_or(u64::MAX, |e| e.index);
    assert!(
        first > 50,
        "the leader's log was compacted: first entry {first}"
    );
    assert_eq!(sim.nodes[&behind].log.recovered(G).snapshot, None);

    sim.isolated.clear();
    sim.run(100);
    let caught = sim.nodes[&behind].log.recovered(G);
    assert!(
        caught.snapshot.is_some_and(|s| s.meta.index >= 90),
        "the follower installed the leader's snapshot"
    );
    sim.assert_applied_everywhere(&[1, 2, 3]);

    // A restart starts from the snapshot: only the entries after it come out again.
    propose_many(&mut sim, 100, 5);
    sim.kill(behind);
    sim.restart(behind);
    let restarted = sim.nodes[&behind].applied[&G].len();
    assert!(
        restarted >= 90,
        "the snapshot's entries are back at once: {restarted}"
    );
    sim.run_until_led(200).expect("a leader");
    propose_many(&mut sim, 105, 5);
    sim.assert_applied_everywhere(&[1, 2, 3]);
    assert_eq!(sim.committed_ever.len(), 110);
}

/// Three nodes configured by `tune`, whose groups read what left memory back from their
/// durable logs, with group `G` led.
fn led_with_cold_logs(seed: u64, tune: impl Fn(&mut crate::Config)) -> Sim {
    let mut sim = Sim::new(seed, 0);
    for (id, n) in sim.nodes.iter_mut() {
        let mut cfg = super::sim::config(*id);
        tune(&mut cfg);
        *n = super::sim::SimNode::fresh(cfg);
        n.raft.set_cold_log(n.log.cold());
        n.raft.add_group(G, *id == 1).expect("group");
    }
    sim.groups = vec![G];
    sim.run_until_led(200).expect("a leader");
    sim
}

/// A leader held every entry a follower lacked in memory for as long as the follower was away
/// (a node down for an hour under load: the whole hour's log, bodies included, in the leader's
/// heap). Past `LAGGING_IN_MEMORY` times `log_keep` behind, the follower is sent its entries
/// from the durable log instead, and catches up all the same.
#[test]
fn a_leader_keeps_little_in_memory_for_a_follower_far_behind_which_catches_up_from_disk() {
    let mut sim = led_with_cold_logs(13, |cfg| cfg.log_keep = 8);
    let leader = sim.leader(G).expect("leader");
    let behind = leader % 3 + 1;
    sim.isolated.insert(behind);
    propose_many(&mut sim, 0, 300);
    let held = sim.nodes[&leader].raft.entries_in_memory(G).expect("group");
    let bound = (8 * (crate::multi::LAGGING_IN_MEMORY + 2)) as usize;
    assert!(held <= bound, "the leader holds {held} entries in memory");
    back_and_caught_up(&mut sim, behind, 300);
    assert_eq!(sim.committed_ever.len(), 300);
}

/// Entries that join many proposals are large: the window kept in memory is bounded by
/// their bytes as well as their number, for the members in step and for one far behind.
#[test]
fn the_entries_kept_in_memory_are_bounded_by_their_bytes() {
    const KEEP: usize = 4 << 10;
    let mut sim = led_with_cold_logs(14, |cfg| cfg.log_keep_bytes = KEEP);
    let leader = sim.leader(G).expect("leader");
    let entry = |i: u32| {
        let mut data = format!("entry {i} ").into_bytes();
        data.resize(1000, b'.');
        data
    };
    for i in 0..100 {
        assert!(sim.propose(G, entry(i)), "entry {i}");
        sim.step();
    }
    sim.run(20);
    for n in [1, 2, 3] {
        let bytes = sim.nodes[&n].raft.entry_bytes_in_memory(G).expect("group");
        assert!(bytes <= 2 * KEEP + 1000, "node {n} holds {bytes} bytes");
    }
    let behind = leader % 3 + 1;
    sim.isolated.insert(behind);
    for i in 100..300 {
        assert!(sim.propose(G, entry(i)), "entry {i}");
        sim.step();
    }
    sim.run(20);
    let bytes = sim.nodes[&leader]
        .raft
        .entry_bytes_in_memory(G)
        .expect("group");
    let bound = KEEP * (crate::multi::LAGGING_IN_MEMORY as usize + 2) + 1000;
    assert!(
        bytes <= bound,
        "the leader holds {bytes} bytes for a member far behind"
    );
    back_and_caught_up(&mut sim, behind, 300);
}

/// The cut-off node `behind` comes back and catches up to `entries`, from its leader's disk.
fn back_and_caught_up(sim: &mut Sim, behind: crate::NodeId, entries: usize) {
    sim.isolated.clear();
    sim.run(200);
    sim.assert_applied_everywhere(&[1, 2, 3]);
    assert_eq!(
        sim.nodes[&behind].applied[&G].len(),
        entries,
        "caught up from disk"
    );
}

#[test]
fn the_leader_keeps_what_a_live_follower_still_lacks_up_to_its_limit() {
    let mut sim = Sim::new(12, 1);
    sim.snapshot_every = Some(5);
    sim.run_until_led(200).expect("a leader");
    propose_many(&mut sim, 0, 30);
    // Everyone keeps up: every log is compacted right behind its snapshot.
    for n in [1, 2, 3] {
        let log = sim.nodes[&n].log.recovered(G);
        let snap = log.snapshot.expect("snapshot").meta.index;
        let first = log.entries.first().map_or(snap + 1, |e| e.index);
        assert!(
            first + 4 >= snap,
            "node {n}: first {first}, snapshot {snap}"
        );
    }
    sim.assert_applied_everywhere(&[1, 2, 3]);
}

#[test]
fn a_group_whose_committed_entries_stay_on_disk_is_refused_without_a_cold_log() {
    let mut raft = crate::MultiRaft::new(super::sim::config_in(1, vec![1, 2, 3])).expect("config");
    let durable = crate::DurableGroup {
        unloaded: Some(crate::Unloaded {
            first: 1,
            last: 10,
            last_term: 2,
            term_at_snapshot: None,
        }),
        ..Default::default()
    };
    assert!(
        matches!(
            raft.recover_group(G, &durable),
            Err(crate::Error::Config(_))
        ),
        "its committed entries could never be applied"
    );
    raft.set_cold_log(crate::MemLog::new().cold());
    raft.recover_group(G, &durable).expect("with a cold log");
}
