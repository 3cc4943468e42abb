use std::io::Write;

use raft::eraftpb::{Entry, HardState};

use crate::{FileLog, GroupId, LogStore};

fn entry(index: u64, term: u64, data: &[u8]) -> Entry {
    Entry {
        index,
        term,
        data: bytes::Bytes::copy_from_slice(data),
        ..Default::default()
    }
}

#[test]
fn the_file_log_replays_every_group_and_stops_at_a_torn_tail() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("raft.log");
    let mut log = FileLog::create(&path).expect("create");
    let hs = HardState {
        term: 2,
        vote: 1,
        commit: 2,
        ..Default::default()
    };
    log.append(GroupId(1), &[entry(1, 1, b"a"), entry(2, 1, b"b")], None)
        .expect("append");
    log.append(GroupId(9), &[entry(1, 1, b"x")], Some(&hs))
        .expect("append");
    log.flush(true).expect("flush");
    // A new leader replaced group 1's entry 2.
    log.append(GroupId(1), &[entry(2, 2, b"c")], Some(&hs))
        .expect("append");
    log.flush(true).expect("flush");
    assert_eq!(log.syncs, 2);
    // A last record whose bytes did not all reach the disk: complete in length, one byte wrong.
    log.append(GroupId(1), &[entry(3, 2, b"d")], None)
        .expect("append");
    log.flush(true).expect("flush");
    drop(log);
    let mut bytes = std::fs::read(&path).expect("read");
    if let Some(last) = bytes.last_mut() {
        *last ^= 0xff;
    }
    // And half a record after it.
    bytes.extend_from_slice(&[1, 200, 0, 0, 0, 1, 2, 3]);
    std::fs::File::create(&path)
        .and_then(|mut f| f.write_all(&bytes))
        .expect("rewrite");

    let groups = FileLog::replay(&path).expect("replay");
    let g1 = &groups[&GroupId(1)];
    let got: Vec<(u64, u64, &[u8])> = g1
        .entries
        .iter()
        .map(|e| (e.index, e.term, &e.data[..]))
        .collect();
    assert_eq!(got, vec![(1, 1, &b"a"[..]), (2, 2, &b"c"[..])]);
    assert_eq!(g1.hard_state, hs);
    assert_eq!(groups[&GroupId(9)].entries.len(), 1);
    assert_eq!(groups[&GroupId(9)].hard_state, hs);
}

/// Three nodes, each logging to its own file; node 2 restarts from its file alone and replays
/// exactly what it had applied.
#[test]
fn a_node_restarted_from_its_file_log_replays_what_it_applied() {
    use crate::{Committed, Config, MultiRaft, NodeBatch};
    let dir = tempfile::tempdir().expect("tempdir");
    let mut nodes: Vec<(MultiRaft, FileLog, Vec<Committed>)> = (1..=3)
        .map(|id| {
            let mut raft = MultiRaft::new(Config::new(id, vec![1, 2, 3])).expect("config");
            for g in 0..3 {
                raft.add_group(GroupId(g), g + 1 == id).expect("group");
            }
            let log = FileLog::create(&dir.path().join(format!("{id}.log"))).expect("log");
            (raft, log, Vec::new())
        })
        .collect();
    let mut net: Vec<NodeBatch> = Vec::new();
    let mut round = |nodes: &mut Vec<(MultiRaft, FileLog, Vec<Committed>)>, now: u64| {
        for b in std::mem::take(&mut net) {
            nodes[(b.to - 1) as usize].0.step(b);
        }
        for (raft, log, applied) in nodes.iter_mut() {
            raft.tick(now);
            let mut rd = raft.ready();
            net.append(&mut rd.messages);
            rd.persist(log).expect("persist");
            let mut done = raft.advance(rd);
            net.append(&mut done.messages);
            applied.extend(done.committed);
        }
    };
    for t in 0..20 {
        round(&mut nodes, t * 50);
    }
    for i in 0..30u64 {
        let g = GroupId(i % 3);
        let leader = nodes
            .iter()
            .position(|n| n.0.is_leader(g))
            .expect("a leader");
        nodes[leader]
            .0
            .propose(g, format!("m{i}").into_bytes())
            .expect("propose");
        round(&mut nodes, 1000 + i * 50);
    }
    for t in 0..20 {
        round(&mut nodes, 3000 + t * 50);
    }
    let before = nodes[1].2.clone();
    assert_eq!(before.len(), 30, "node 2 applied every proposal");
    drop(nodes);

    let durable = FileLog::replay(&dir.path().join("2.log")).expect("replay");
    let mut raft = MultiRaft::new(Config::new(2, vec![1, 2, 3])).expect("config");
    for g in 0..3 {
        let d = durable.get(&GroupId(g)).cloned().unwrap_or_default();
        raft.recover_group(GroupId(g), &d).expect("recover");
    }
    let rd = raft.ready();
    let mut mem = crate::MemLog::new();
    rd.persist(&mut mem).expect("persist");
    let replayed = raft.advance(rd).committed;
    let key = |c: &Committed| (c.group, c.index);
    let (mut a, mut b) = (before, replayed);
    a.sort_by_key(key);
    b.sort_by_key(key);
    assert_eq!(a, b);
}
