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
    drop(log);
    // A crash in the middle of a record.
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .expect("open");
    f.write_all(&[1, 200, 0, 0, 0, 1, 2, 3]).expect("torn");
    drop(f);

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
