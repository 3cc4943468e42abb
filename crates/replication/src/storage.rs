//! A group's view of its own log, as raft-rs reads it.
//!
//! raft-rs reads entries back from `Storage` (to send appends, to find terms). This is the in-memory
//! copy of what the node-wide log holds for one group: the durable copy is written by a
//! [`crate::LogStore`] once per batch for all groups. No locks: the group's `RawNode` owns it.

use raft::eraftpb::{ConfState, Entry, HardState, Snapshot, SnapshotMetadata};
use raft::{GetEntriesContext, RaftState, Storage, StorageError};

use crate::snapshots::{Fetch, Members, SnapshotMeta, SnapshotSource};

/// Where a group's entries that left memory can still be read: the node-wide durable log
/// (until snapshots let it compact, it holds every entry).
pub trait ColdLog: Send + Sync + std::fmt::Debug {
    /// The group's first durable index, if it has entries.
    fn first_index(&self, group: u64) -> Option<u64>;
    /// Entries `low..high` of the group, from `low` on without a gap: all of them, or, with
    /// `max_size`, as many as fit in it (at least one); an error if any is missing.
    fn entries(
        &self,
        group: u64,
        low: u64,
        high: u64,
        max_size: Option<u64>,
    ) -> Result<Vec<Entry>, String>;
}

/// The entries of one group since its last compaction, with its hard and conf state.
#[derive(Debug, Default)]
pub struct GroupLog {
    /// The durable log, for entries compacted out of memory, and this group's number there.
    cold: Option<(u64, std::sync::Arc<dyn ColdLog>)>,
    hard_state: HardState,
    conf_state: ConfState,
    /// The members at the latest snapshot (or at the group's start here), and the membership
    /// changes applied since, by their entries' indexes: a snapshot at an index records the
    /// members in force there, not those of changes applied after it.
    base_conf: ConfState,
    confs: Vec<(u64, ConfState)>,
    /// raft-rs asked for a snapshot this node does not have yet (for a member being added):
    /// the state machine should take one.
    snapshot_wanted: std::cell::Cell<bool>,
    /// Index and term of the last entry dropped from memory (0, 0 for a new log; the term is
    /// unknown for a log recovered from a compacted one).
    compacted_index: u64,
    compacted_term: Option<u64>,
    entries: std::collections::VecDeque<Entry>,
    /// The bytes of the entries' data held in `entries`.
    bytes: usize,
    /// The group's latest durable snapshot, and where its data is read when a follower needs it.
    snapshot: Option<SnapshotMeta>,
    source: Option<(u64, std::sync::Arc<dyn SnapshotSource>)>,
    /// No entry below it can be read any more (the durable log dropped them).
    floor: u64,
}

impl GroupLog {
    /// A new, empty log of a group whose members are `voters`.
    pub fn new(voters: Vec<u64>) -> Self {
        Self::with_members(&Members::voters(voters))
    }

    /// A new, empty log of a group with these members (none: a member being added, which
    /// learns them from its leader's snapshot).
    pub fn with_members(members: &Members) -> Self {
        let cs = members.to_conf_state();
        GroupLog {
            conf_state: cs.clone(),
            base_conf: cs,
            compacted_term: Some(0),
            ..GroupLog::default()
        }
    }

    /// A log rebuilt from what the node-wide log held for the group after a restart: its
    /// entries (from the first kept, fitted to the snapshot: [`crate::DurableGroup::fit_to_snapshot`]),
    /// hard state and latest snapshot. Entries left in the durable log (`unloaded`) are
    /// read back from the [`ColdLog`] given with [`GroupLog::set_cold`], as if they had left
    /// memory.
    pub fn restore(
        members: &Members,
        entries: Vec<Entry>,
        unloaded: Option<crate::Unloaded>,
        mut hard_state: HardState,
        snapshot: Option<SnapshotMeta>,
    ) -> Self {
        let entries: std::collections::VecDeque<Entry> = entries.into();
        let bytes = data_bytes(entries.iter());
        if let Some(s) = snapshot {
            // The snapshot covers committed entries only, whatever commit index was last written.
            hard_state.commit = hard_state.commit.max(s.index);
        }
        if let Some(u) = unloaded {
            let cs = members.to_conf_state();
            return GroupLog {
                hard_state,
                conf_state: cs.clone(),
                base_conf: cs,
                entries,
                bytes,
                compacted_index: u.last,
                compacted_term: Some(u.last_term),
                snapshot,
                floor: u.first,
                ..GroupLog::default()
            };
        }
        let first = entries
            .front()
            .map(|e| e.index)
            .or(snapshot.map(|s| s.index + 1))
            .unwrap_or(1);
        let compacted_index = first.saturating_sub(1);
        let compacted_term = match snapshot {
            Some(s) if s.index == compacted_index => Some(s.term),
            _ if compacted_index == 0 => Some(0),
            _ => None,
        };
        let cs = members.to_conf_state();
        GroupLog {
            hard_state,
            conf_state: cs.clone(),
            base_conf: cs,
            entries,
            bytes,
            compacted_index,
            compacted_term,
            snapshot,
            floor: first,
            ..GroupLog::default()
        }
    }

    /// Reads the group's snapshots back from `source` when a follower needs one.
    pub fn set_snapshot_source(&mut self, group: u64, source: std::sync::Arc<dyn SnapshotSource>) {
        self.source = Some((group, source));
    }

    /// The group's latest durable snapshot.
    pub fn snapshot_meta(&self) -> Option<SnapshotMeta> {
        self.snapshot
    }

    /// This node saved a snapshot of its own state machine at `meta`: the entries it covers
    /// may be dropped from now on ([`GroupLog::set_floor`]), and a follower that needs them is
    /// sent it instead.
    pub fn snapshot_saved(&mut self, meta: SnapshotMeta) {
        if self.snapshot.is_none_or(|s| s.index < meta.index) {
            self.snapshot = Some(meta);
            self.base_conf = self.conf_at(meta.index);
            self.confs.retain(|(i, _)| *i > meta.index);
        }
    }

    /// The members now (as applied).
    pub fn conf_state(&self) -> &ConfState {
        &self.conf_state
    }

    /// The members in force once the entry at `index` is applied.
    /// The members at the log's base: those the group started with, or its latest snapshot's.
    pub fn base_conf(&self) -> &ConfState {
        &self.base_conf
    }

    pub fn conf_at(&self, index: u64) -> ConfState {
        self.confs
            .iter()
            .rev()
            .find(|(i, _)| *i <= index)
            .map_or_else(|| self.base_conf.clone(), |(_, cs)| cs.clone())
    }

    /// A membership change in the entry at `index` was applied: these are the members now.
    pub fn conf_applied(&mut self, index: u64, cs: ConfState) {
        self.conf_state = cs.clone();
        self.confs.push((index, cs));
    }

    /// Whether raft-rs asked for a snapshot that is not there yet, since the last call.
    pub fn take_snapshot_wanted(&self) -> bool {
        self.snapshot_wanted.replace(false)
    }

    /// A snapshot from the leader replaces the whole log: every entry goes, and its members
    /// are the group's.
    pub fn apply_snapshot(&mut self, meta: SnapshotMeta, conf: ConfState) {
        self.conf_state = conf.clone();
        self.base_conf = conf;
        self.confs.clear();
        self.entries.clear();
        self.bytes = 0;
        self.compacted_index = meta.index;
        self.compacted_term = Some(meta.term);
        self.floor = meta.index + 1;
        self.snapshot = Some(meta);
        self.hard_state.commit = self.hard_state.commit.max(meta.index);
        self.hard_state.term = self.hard_state.term.max(meta.term);
    }

    /// The first entry that can still be read.
    pub fn floor(&self) -> u64 {
        self.floor
    }

    /// The durable log dropped the entries below `index`: they cannot be read any more.
    pub fn set_floor(&mut self, index: u64) {
        self.floor = self.floor.max(index);
        if index > 0 {
            self.compact_to(index - 1);
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

    /// The first entry held in memory (or that would be).
    pub fn first_index(&self) -> u64 {
        self.entries
            .front()
            .map_or(self.compacted_index + 1, |e| e.index)
    }

    /// Whether entries that left memory can be read back ([`Self::set_cold`]).
    pub fn has_cold(&self) -> bool {
        self.cold.is_some()
    }

    /// Reads entries that left memory from the durable log from now on.
    pub fn set_cold(&mut self, group: u64, cold: std::sync::Arc<dyn ColdLog>) {
        self.cold = Some((group, cold));
    }

    /// The first entry raft-rs may ask for: with a durable log behind, its first.
    fn first_available(&self) -> u64 {
        let memory = self.first_index();
        let reach = match &self.cold {
            Some((g, cold)) if self.compacted_index > 0 => {
                cold.first_index(*g).map_or(memory, |c| c.min(memory))
            }
            _ => memory,
        };
        reach.max(self.floor).min(memory)
    }

    /// Entries `low..high` read back from the durable log: all of them, or with `max_size` at
    /// least the first. Reading only what a message to a peer can carry: a follower catching
    /// up on a queue whose log is kept (too large to snapshot) asked for a message's worth and
    /// had the whole range read into memory each time.
    fn cold_entries(&self, low: u64, high: u64, max_size: Option<u64>) -> raft::Result<Vec<Entry>> {
        let Some((g, cold)) = &self.cold else {
            return Err(raft::Error::Store(StorageError::Compacted));
        };
        let got = cold
            .entries(*g, low, high, max_size)
            .map_err(|e| raft::Error::Store(StorageError::Other(e.into())))?;
        let whole = got.len() as u64 == high - low;
        let cut = max_size.is_some() && !got.is_empty() && got.len() as u64 <= high - low;
        let in_order = got.iter().zip(low..).all(|(e, index)| e.index == index);
        if !(whole || cut) || !in_order {
            return Err(raft::Error::Store(StorageError::Compacted));
        }
        Ok(got)
    }

    pub fn last_index(&self) -> u64 {
        self.entries.back().map_or_else(
            || {
                self.compacted_index
                    .max(self.snapshot.map_or(0, |s| s.index))
            },
            |e| e.index,
        )
    }

    /// Number of entries held in memory.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Bytes of the entries' data held in memory.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The index up to which entries must go for those after it to hold at most `most` bytes
    /// (the last one dropped from memory already when they do). It walks back from the newest
    /// entry, and no further than `most` bytes.
    pub fn index_keeping(&self, most: usize) -> u64 {
        if self.bytes <= most {
            return self.compacted_index;
        }
        let mut kept = 0usize;
        for e in self.entries.iter().rev() {
            kept += e.data.len();
            if kept > most {
                return e.index;
            }
        }
        self.compacted_index
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
        self.bytes -= data_bytes(self.entries.range(keep.min(self.entries.len())..));
        self.entries.truncate(keep);
        self.entries.extend(ents.iter().cloned());
        self.bytes += data_bytes(ents.iter());
        Ok(())
    }

    /// Gives back the room of entries no longer held.
    pub fn release_spare(&mut self) {
        if self.entries.is_empty() {
            self.entries = std::collections::VecDeque::new();
        } else {
            self.entries.shrink_to_fit();
        }
    }

    /// Drops the entries up to and including `index` (they are applied and no peer needs them).
    pub fn compact_to(&mut self, index: u64) {
        let index = index.min(self.last_index());
        while let Some(e) = self.entries.front() {
            if e.index > index {
                break;
            }
            self.compacted_index = e.index;
            self.compacted_term = Some(e.term);
            self.bytes -= e.data.len();
            self.entries.pop_front();
        }
    }
}

fn data_bytes<'a>(entries: impl Iterator<Item = &'a Entry>) -> usize {
    entries.map(|e| e.data.len()).sum()
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
        context: GetEntriesContext,
    ) -> raft::Result<Vec<Entry>> {
        if low < self.first_available() {
            return Err(raft::Error::Store(StorageError::Compacted));
        }
        if high > self.last_index() + 1 || low > high {
            return Err(raft::Error::Store(StorageError::Unavailable));
        }
        let offset = self.first_index();
        let max_size = max_size.into();
        // What left memory is read back from the durable log: a peer far behind (down a while,
        // or restarted) catches up without a snapshot.
        let mut ents = if low < offset {
            match self.cold_entries(low, high.min(offset), max_size) {
                // A read of the durable log for a follower that failed (an I/O error): raft-rs
                // stops the node on any other error. It sends again at the follower's next
                // answer; a leader reads there for any follower far behind, not after a
                // restart only.
                Err(raft::Error::Store(StorageError::Other(error))) if context.can_async() => {
                    let group = self.cold.as_ref().map_or(0, |(g, _)| *g);
                    tracing::warn!(group, %error, "cannot read the log back for a follower: tried again at its next answer");
                    return Err(raft::Error::Store(StorageError::LogTemporarilyUnavailable));
                }
                read => read?,
            }
        } else {
            Vec::new()
        };
        if (ents.len() as u64) < high.min(offset).saturating_sub(low) {
            // Cut at the size asked for: nothing from memory can follow.
            raft::util::limit_size(&mut ents, max_size);
            return Ok(ents);
        }
        let from = low.max(offset);
        if from < high {
            ents.extend(
                self.entries
                    .range((from - offset) as usize..(high - offset) as usize)
                    .cloned(),
            );
        }
        raft::util::limit_size(&mut ents, max_size);
        Ok(ents)
    }

    fn term(&self, idx: u64) -> raft::Result<u64> {
        if let Some(s) = self.snapshot.filter(|s| s.index == idx) {
            return Ok(s.term);
        }
        if idx == self.compacted_index {
            return self
                .compacted_term
                .ok_or(raft::Error::Store(StorageError::Compacted));
        }
        if idx < self.compacted_index {
            let first = self.first_available();
            if idx == 0 && first == 1 {
                // Before the first entry of a log that still holds its whole history.
                return Ok(0);
            }
            if idx < first {
                return Err(raft::Error::Store(StorageError::Compacted));
            }
            let got = self.cold_entries(idx, idx + 1, None)?;
            return got
                .first()
                .map(|e| e.term)
                .ok_or(raft::Error::Store(StorageError::Compacted));
        }
        let offset = self.first_index();
        self.entries
            .get((idx - offset) as usize)
            .map(|e| e.term)
            .ok_or(raft::Error::Store(StorageError::Unavailable))
    }

    fn first_index(&self) -> raft::Result<u64> {
        Ok(self.first_available())
    }

    fn last_index(&self) -> raft::Result<u64> {
        Ok(GroupLog::last_index(self))
    }

    fn snapshot(&self, request_index: u64, to: u64) -> raft::Result<Snapshot> {
        // Read back from disk: only the metadata stays in memory. raft-rs asks again later
        // for one that is not there yet.
        let unavailable = raft::Error::Store(StorageError::SnapshotTemporarilyUnavailable);
        let (Some(meta), Some((group, source))) = (self.snapshot, &self.source) else {
            self.snapshot_wanted.set(true);
            return Err(unavailable);
        };
        let stored = match source.fetch(*group, meta.index) {
            Fetch::Ready(s) => s,
            // Being read on another thread: raft-rs asks again at its next attempt.
            Fetch::Pending => return Err(unavailable),
            Fetch::Missing => {
                self.snapshot_wanted.set(true);
                return Err(unavailable);
            }
            // Any other error is fatal to raft-rs; a new snapshot replaces the bad file.
            Fetch::Failed(error) => {
                tracing::error!(group, %error, "cannot read a snapshot back for a follower: a new one is taken");
                self.snapshot_wanted.set(true);
                return Err(unavailable);
            }
        };
        if stored.meta.index < request_index.max(meta.index) {
            self.snapshot_wanted.set(true);
            return Err(unavailable);
        }
        let conf = stored
            .members
            .as_ref()
            .map_or_else(|| self.conf_at(stored.meta.index), Members::to_conf_state);
        if !conf.voters.contains(&to) && !conf.learners.contains(&to) {
            // Taken before `to` was made a member: it would refuse it. A later one is needed.
            self.snapshot_wanted.set(true);
            return Err(unavailable);
        }
        let mut snap = Snapshot {
            data: stored.data,
            ..Default::default()
        };
        snap.set_metadata(SnapshotMetadata {
            conf_state: Some(conf).into(),
            index: stored.meta.index,
            term: stored.meta.term,
            ..Default::default()
        });
        Ok(snap)
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

    /// A durable log holding entries 1..=n of group 7.
    #[derive(Debug)]
    struct Disk(Vec<Entry>);

    impl ColdLog for Disk {
        fn first_index(&self, _group: u64) -> Option<u64> {
            self.0.first().map(|e| e.index)
        }
        fn entries(
            &self,
            _group: u64,
            low: u64,
            high: u64,
            max_size: Option<u64>,
        ) -> Result<Vec<Entry>, String> {
            let mut out: Vec<Entry> = self
                .0
                .iter()
                .filter(|e| e.index >= low && e.index < high)
                .cloned()
                .collect();
            // As raft-engine: at least one, then whole entries within the size.
            raft::util::limit_size(&mut out, max_size);
            Ok(out)
        }
    }

    /// A durable log whose reads fail (a disk error).
    #[derive(Debug)]
    struct Broken;

    impl ColdLog for Broken {
        fn first_index(&self, _group: u64) -> Option<u64> {
            Some(1)
        }
        fn entries(&self, _: u64, _: u64, _: u64, _: Option<u64>) -> Result<Vec<Entry>, String> {
            Err("Input/output error (os error 5)".to_owned())
        }
    }

    /// A read for a follower that fails is tried again later (any other error stops the node
    /// in raft-rs); one for applying entries is still an error.
    #[test]
    fn a_failed_read_for_a_follower_is_tried_again_later() {
        let all = vec![e(1, 1), e(2, 1), e(3, 2), e(4, 2), e(5, 3)];
        let mut log = GroupLog::new(vec![1, 2, 3]);
        log.append(&all).expect("append");
        log.set_cold(7, std::sync::Arc::new(Broken));
        log.compact_to(3);
        assert!(matches!(
            log.entries(1, 6, None, GetEntriesContext::empty(true)),
            Err(raft::Error::Store(StorageError::LogTemporarilyUnavailable))
        ));
        assert!(matches!(
            log.entries(1, 6, None, GetEntriesContext::empty(false)),
            Err(raft::Error::Store(StorageError::Other(_)))
        ));
        assert_eq!(
            log.entries(4, 6, None, GetEntriesContext::empty(true))
                .expect("from memory"),
            all[3..].to_vec()
        );
    }

    #[test]
    fn entries_that_left_memory_are_read_back_from_the_durable_log() {
        let all = vec![e(1, 1), e(2, 1), e(3, 2), e(4, 2), e(5, 3)];
        let mut log = GroupLog::new(vec![1, 2, 3]);
        log.append(&all).expect("append");
        log.set_cold(7, std::sync::Arc::new(Disk(all.clone())));
        log.compact_to(3);
        assert_eq!(log.len(), 2, "two left in memory");
        assert_eq!(Storage::first_index(&log).expect("first"), 1);
        let got = log
            .entries(1, 6, None, GetEntriesContext::empty(false))
            .expect("entries from disk and memory");
        assert_eq!(got, all);
        assert_eq!(log.term(2).expect("a term on disk"), 1);
        assert_eq!(log.term(0).expect("before the first"), 0);
        // Asked for a message's worth, only that much is read: the first entry at least.
        let one = log
            .entries(1, 6, Some(1), GetEntriesContext::empty(false))
            .expect("one entry");
        assert_eq!(one, all[..1].to_vec());
        let size = u64::from(protobuf::Message::compute_size(&all[0]));
        let two = log
            .entries(1, 6, Some(2 * size), GetEntriesContext::empty(false))
            .expect("two entries");
        assert_eq!(two, all[..2].to_vec());
        // A durable log missing what it should hold is an error, never a wrong answer.
        log.set_cold(7, std::sync::Arc::new(Disk(all[2..].to_vec())));
        assert!(log
            .entries(1, 3, None, GetEntriesContext::empty(false))
            .is_err());
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
