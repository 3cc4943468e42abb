//! A group's view of its own log, as raft-rs reads it.
//!
//! raft-rs reads entries back from `Storage` (to send appends, to find terms). This is the in-memory
//! copy of what the node-wide log holds for one group: the durable copy is written by a
//! [`crate::LogStore`] once per batch for all groups. No locks: the group's `RawNode` owns it.

use raft::eraftpb::{ConfState, Entry, HardState, Snapshot};
use raft::{GetEntriesContext, RaftState, Storage, StorageError};

/// The entries of one group since its last compaction, with its hard and conf state.
#[derive(Debug, Default)]
pub struct GroupLog {
    hard_state: HardState,
    conf_state: ConfState,
    /// Index and term of the last entry dropped by compaction (0, 0 for a new log).
    compacted_index: u64,
    compacted_term: u64,
    entries: std::collections::VecDeque<Entry>,
}

impl GroupLog {
    /// A new, empty log of a group whose members are `voters`.
    pub fn new(voters: Vec<u64>) -> Self {
        GroupLog {
            conf_state: ConfState::from((voters, vec![])),
            ..GroupLog::default()
        }
    }

    /// A log rebuilt from what the node-wide log held for the group after a restart.
    pub fn restore(voters: Vec<u64>, entries: Vec<Entry>, hard_state: HardState) -> Self {
        GroupLog {
            hard_state,
            conf_state: ConfState::from((voters, vec![])),
            entries: entries.into(),
            ..GroupLog::default()
        }
    }

    pub fn hard_state(&self) -> &HardState {
        &self.hard_state
    }

    pub fn set_hard_state(&mut self, hs: HardState) {
        self.hard_state = hs;
    }

    pub fn set_commit(&mut self, commit: u64) {
        self.hard_state.commit = commit;
    }

    pub fn first_index(&self) -> u64 {
        self.entries
            .front()
            .map_or(self.compacted_index + 1, |e| e.index)
    }

    pub fn last_index(&self) -> u64 {
        self.entries
            .back()
            .map_or(self.compacted_index, |e| e.index)
    }

    /// Number of entries held in memory.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Appends entries handed out by a `Ready`, dropping any conflicting suffix they replace
    /// (a new leader overwriting an uncommitted tail).
    pub fn append(&mut self, ents: &[Entry]) -> Result<(), StorageError> {
        let Some(first) = ents.first() else {
            return Ok(());
        };
        if first.index <= self.compacted_index || first.index > self.last_index() + 1 {
            return Err(StorageError::Other(
                format!(
                    "append at {} outside ({}, {}]",
                    first.index,
                    self.compacted_index,
                    self.last_index() + 1
                )
                .into(),
            ));
        }
        let keep = (first.index - self.first_index()) as usize;
        self.entries.truncate(keep);
        self.entries.extend(ents.iter().cloned());
        Ok(())
    }

    /// Drops the entries up to and including `index` (they are applied and no peer needs them).
    pub fn compact_to(&mut self, index: u64) {
        let index = index.min(self.last_index());
        while let Some(e) = self.entries.front() {
            if e.index > index {
                break;
            }
            self.compacted_index = e.index;
            self.compacted_term = e.term;
            self.entries.pop_front();
        }
    }
}

impl Storage for GroupLog {
    fn initial_state(&self) -> raft::Result<RaftState> {
        Ok(RaftState::new(
            self.hard_state.clone(),
            self.conf_state.clone(),
        ))
    }

    fn entries(
        &self,
        low: u64,
        high: u64,
        max_size: impl Into<Option<u64>>,
        _context: GetEntriesContext,
    ) -> raft::Result<Vec<Entry>> {
        if low < self.first_index() {
            return Err(raft::Error::Store(StorageError::Compacted));
        }
        if high > self.last_index() + 1 || low > high {
            return Err(raft::Error::Store(StorageError::Unavailable));
        }
        let offset = self.first_index();
        let mut ents: Vec<Entry> = self
            .entries
            .range((low - offset) as usize..(high - offset) as usize)
            .cloned()
            .collect();
        raft::util::limit_size(&mut ents, max_size.into());
        Ok(ents)
    }

    fn term(&self, idx: u64) -> raft::Result<u64> {
        if idx == self.compacted_index {
            return Ok(self.compacted_term);
        }
        if idx < self.compacted_index {
            return Err(raft::Error::Store(StorageError::Compacted));
        }
        let offset = self.first_index();
        self.entries
            .get((idx - offset) as usize)
            .map(|e| e.term)
            .ok_or(raft::Error::Store(StorageError::Unavailable))
    }

    fn first_index(&self) -> raft::Result<u64> {
        Ok(GroupLog::first_index(self))
    }

    fn last_index(&self) -> raft::Result<u64> {
        Ok(GroupLog::last_index(self))
    }

    fn snapshot(&self, _request_index: u64, _to: u64) -> raft::Result<Snapshot> {
        // Snapshots come with the queue machine's state; until then a peer that fell behind the
        // compacted prefix waits (raft-rs retries), and compaction keeps a window for lagging peers.
        Err(raft::Error::Store(
            StorageError::SnapshotTemporarilyUnavailable,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(index: u64, term: u64) -> Entry {
        Entry {
            index,
            term,
            ..Default::default()
        }
    }

    fn terms(log: &GroupLog) -> Vec<(u64, u64)> {
        log.entries.iter().map(|e| (e.index, e.term)).collect()
    }

    #[test]
    fn append_replaces_a_conflicting_tail_and_refuses_gaps() {
        let mut log = GroupLog::new(vec![1, 2, 3]);
        log.append(&[e(1, 1), e(2, 1), e(3, 1)]).expect("append");
        log.append(&[e(2, 2)])
            .expect("a new leader's entry replaces 2 and 3");
        assert_eq!(terms(&log), vec![(1, 1), (2, 2)]);
        assert!(log.append(&[e(4, 2)]).is_err(), "gap");
        assert_eq!(Storage::last_index(&log).expect("last"), 2);
    }

    #[test]
    fn compaction_keeps_the_term_of_the_last_dropped_entry() {
        let mut log = GroupLog::new(vec![1, 2, 3]);
        log.append(&[e(1, 1), e(2, 1), e(3, 2), e(4, 2)])
            .expect("append");
        log.compact_to(2);
        assert_eq!(Storage::first_index(&log).expect("first"), 3);
        assert_eq!(log.term(2).expect("term of the compacted boundary"), 1);
        assert!(matches!(
            log.term(1),
            Err(raft::Error::Store(StorageError::Compacted))
        ));
        assert!(matches!(
            log.entries(2, 4, None, GetEntriesContext::empty(false)),
            Err(raft::Error::Store(StorageError::Compacted))
        ));
        let got = log
            .entries(3, 5, None, GetEntriesContext::empty(false))
            .expect("entries");
        assert_eq!(got.len(), 2);
        assert!(
            log.append(&[e(2, 3)]).is_err(),
            "below the compacted prefix"
        );
    }
}
