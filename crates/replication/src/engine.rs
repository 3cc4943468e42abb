//! The node-wide log on tikv's raft-engine: every group's entries and hard state in one
//! log-structured store, one write (and one fsync) per batch, segment files recycled once every
//! group that had entries in them compacted past them.
//!
//! raft-engine is what TiKV keeps its thousands of Raft logs in: appends go to a single active
//! file with a per-group in-memory index, a rewrite of a group's uncommitted tail replaces it, and
//! [`EngineLog::compact_to`] (after a snapshot) lets whole files go. That is the segment and
//! compaction design [`crate::FileLog`] lacks, from a maintained crate rather than our own code.

use std::path::Path;

use raft::eraftpb::{ConfState, Entry, HardState};
use raft_engine::{Config, Engine, LogBatch, MessageExt, ReadableSize};

use crate::snapshots::{Members, SnapshotFiles, StoredSnapshot};
use crate::wal::{DurableGroup, LogError, LogStore, Unloaded};
use crate::GroupId;

/// The key of a group's hard state among its key-value records.
const HARD_STATE: &[u8] = b"hard_state";
/// The members a group started with on this node, when recorded (`LogStore::put_members`).
const MEMBERS: &[u8] = b"members";

/// Tells raft-engine where an entry's index is.
#[derive(Clone)]
struct Entries;

impl MessageExt for Entries {
    type Entry = Entry;

    fn index(e: &Entry) -> u64 {
        e.index
    }
}

fn engine_error(e: raft_engine::Error) -> LogError {
    LogError::Engine(e.to_string())
}

/// A node's log in a raft-engine directory.
pub struct EngineLog {
    engine: std::sync::Arc<Engine>,
    batch: LogBatch,
    /// The groups' snapshots, in `snapshots/` inside the log's directory (raft-engine reads
    /// only its own file names there).
    snapshots: SnapshotFiles,
    /// Leaders' snapshots written to disk before Raft was given them ([`EngineLog::prestage`]).
    prestaged: std::collections::HashMap<GroupId, Prestaged>,
    /// Staged snapshots that Raft's save found ready, since the start.
    prestaged_used: u64,
}

/// A leader's snapshot already written and fsynced beside the group's file, and what tells it
/// apart: Raft's copy is the same buffer.
struct Prestaged {
    meta: crate::snapshots::SnapshotMeta,
    members: Option<Members>,
    /// Where its bytes are (compared, never read).
    data: usize,
    len: usize,
    file: std::path::PathBuf,
    at: std::time::Instant,
}

/// Reads of the durable log for entries that left a group's memory ([`crate::storage::ColdLog`]).
struct ColdEngine(std::sync::Arc<Engine>);

impl std::fmt::Debug for ColdEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ColdEngine")
    }
}

impl crate::storage::ColdLog for ColdEngine {
    fn first_index(&self, group: u64) -> Option<u64> {
        self.0.first_index(group)
    }

    fn entries(
        &self,
        group: u64,
        low: u64,
        high: u64,
        max_size: Option<u64>,
    ) -> Result<Vec<raft::eraftpb::Entry>, String> {
        let mut out = Vec::new();
        // raft-engine counts its own encoding of each entry, close to raft's; raft's
        // `limit_size` cuts again by its own measure.
        let max = max_size.map(|m| usize::try_from(m).unwrap_or(usize::MAX));
        self.0
            .fetch_entries_to::<Entries>(group, low, high, max, &mut out)
            .map_err(|e| e.to_string())?;
        Ok(out)
    }
}

impl std::fmt::Debug for EngineLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineLog").finish_non_exhaustive()
    }
}

impl EngineLog {
    /// Opens the log in `dir` (created if missing), reading back what it holds.
    pub fn open(dir: &Path) -> Result<Self, LogError> {
        let cfg = Config {
            dir: dir.to_string_lossy().into_owned(),
            // Files are recycled whole: smaller files are freed sooner after a compaction.
            target_file_size: ReadableSize::mb(64),
            ..Config::default()
        };
        let engine = std::sync::Arc::new(Engine::open(cfg).map_err(engine_error)?);
        Ok(EngineLog {
            engine,
            batch: LogBatch::default(),
            snapshots: SnapshotFiles::open(&dir.join("snapshots"))?,
            prestaged: std::collections::HashMap::new(),
            prestaged_used: 0,
        })
    }

    /// `snap`, a leader's snapshot of `group` that is about to be stepped into Raft, is on
    /// disk already in `file` ([`SnapshotFiles::stage`], on another thread): when Raft has
    /// this node save it, the file is only renamed into place. A deep queue's snapshot (up to
    /// a GiB) is otherwise written and fsynced on the Raft thread, where every group of the
    /// node waits for it. Replaces (and removes) a file staged earlier for the group.
    pub fn prestage(&mut self, group: GroupId, snap: &StoredSnapshot, file: std::path::PathBuf) {
        let staged = Prestaged {
            meta: snap.meta,
            members: snap.members.clone(),
            data: snap.data.as_ptr() as usize,
            len: snap.data.len(),
            file,
            at: std::time::Instant::now(),
        };
        if let Some(old) = self.prestaged.insert(group, staged) {
            self.snapshots.discard(&old.file);
        }
    }

    /// Removes the staged files Raft did not take: of groups `done` says have what they
    /// needed (a snapshot at least as recent, or no group any more), and any older than
    /// `max_age`.
    pub fn drop_prestaged(
        &mut self,
        max_age: std::time::Duration,
        mut done: impl FnMut(GroupId, u64) -> bool,
    ) {
        let files = &self.snapshots;
        self.prestaged.retain(|group, p| {
            let keep = p.at.elapsed() < max_age && !done(*group, p.meta.index);
            if !keep {
                files.discard(&p.file);
            }
            keep
        });
    }

    /// How many staged snapshots wait for Raft to save them, and how many it found staged
    /// since the start.
    pub fn prestaged_counts(&self) -> (usize, u64) {
        (self.prestaged.len(), self.prestaged_used)
    }

    /// The groups' snapshot files, for a thread that writes the state machine's snapshots
    /// off the Raft thread ([`SnapshotFiles::stage`]).
    pub fn snapshot_files(&self) -> SnapshotFiles {
        self.snapshots.clone()
    }

    /// A handle that reads the groups' snapshots back on a thread of its own, for a leader
    /// sending one to a follower (`MultiRaft::set_snapshot_source`).
    pub fn snapshot_reader(
        &self,
    ) -> std::io::Result<std::sync::Arc<crate::snapshots::SnapshotReader>> {
        crate::snapshots::SnapshotReader::start(self.snapshots.clone()).map(std::sync::Arc::new)
    }

    /// A handle that reads the groups' snapshots back, for a leader sending one to a follower
    /// (`MultiRaft::set_snapshot_source`).
    pub fn snapshots(&self) -> std::sync::Arc<dyn crate::snapshots::SnapshotSource> {
        std::sync::Arc::new(self.snapshots.clone())
    }

    /// A handle that reads entries back for the groups' in-memory logs
    /// (`MultiRaft::set_cold_log`), so that a follower far behind catches up from disk.
    pub fn cold(&self) -> std::sync::Arc<dyn crate::storage::ColdLog> {
        std::sync::Arc::new(ColdEngine(self.engine.clone()))
    }

    /// The groups with entries or a hard state in the log, in id order.
    pub fn groups(&self) -> Vec<GroupId> {
        let mut ids: Vec<GroupId> = self.engine.raft_groups().into_iter().map(GroupId).collect();
        ids.sort_unstable();
        ids
    }

    /// What the log holds for `group`: its hard state, its snapshot, and its entries from the
    /// first kept one, of which only those after the commit index (or the snapshot's, if
    /// later) are read: the others are final, and stay on disk ([`DurableGroup::unloaded`]).
    pub fn durable(&self, group: GroupId) -> Result<DurableGroup, LogError> {
        let hard_state = self
            .engine
            .get_message::<HardState>(group.0, HARD_STATE)
            .map_err(engine_error)?
            .unwrap_or_default();
        let snapshot = self.snapshots.read(group)?;
        let commit = DurableGroup::committed_through(&hard_state, snapshot.as_ref());
        let mut entries = Vec::new();
        let mut unloaded = None;
        if let (Some(first), Some(last)) = (
            self.engine.first_index(group.0),
            self.engine.last_index(group.0),
        ) {
            let load_from = commit.saturating_add(1).clamp(first, last + 1);
            if load_from > first {
                let term_of = |index: u64| -> Result<u64, LogError> {
                    self.engine
                        .get_entry::<Entries>(group.0, index)
                        .map_err(engine_error)?
                        .map(|e| e.term)
                        .ok_or_else(|| {
                            LogError::Corrupt(format!(
                                "entry {index} of group {} missing from its log",
                                group.0
                            ))
                        })
                };
                let last_unloaded = load_from - 1;
                let term_at_snapshot = match snapshot.as_ref().map(|s| s.meta.index) {
                    Some(i) if (first..=last_unloaded).contains(&i) => Some(term_of(i)?),
                    _ => None,
                };
                unloaded = Some(Unloaded {
                    first,
                    last: last_unloaded,
                    last_term: term_of(last_unloaded)?,
                    term_at_snapshot,
                });
            }
            if load_from <= last {
                self.engine
                    .fetch_entries_to::<Entries>(group.0, load_from, last + 1, None, &mut entries)
                    .map_err(engine_error)?;
            }
        }
        let members = self
            .engine
            .get_message::<ConfState>(group.0, MEMBERS)
            .map_err(engine_error)?
            .map(|cs| Members::from_conf_state(&cs));
        Ok(DurableGroup {
            entries,
            unloaded,
            hard_state,
            snapshot,
            members,
        })
    }

    /// Forgets a group entirely (its queue was deleted).
    pub fn remove_group(&mut self, group: GroupId) -> Result<(), LogError> {
        let mut batch = LogBatch::default();
        batch.add_command(group.0, raft_engine::Command::Clean);
        self.engine.write(&mut batch, true).map_err(engine_error)?;
        if let Some(p) = self.prestaged.remove(&group) {
            self.snapshots.discard(&p.file);
        }
        self.snapshots.remove(group)
    }
}

impl LogStore for EngineLog {
    fn append(
        &mut self,
        group: GroupId,
        entries: &[Entry],
        hard_state: Option<&HardState>,
    ) -> Result<(), LogError> {
        if !entries.is_empty() {
            // An index at or below the last one replaces the tail from there (a new leader
            // overwrote uncommitted entries): raft-engine's index does the truncation.
            self.batch
                .add_entries::<Entries>(group.0, entries)
                .map_err(engine_error)?;
        }
        if let Some(hs) = hard_state {
            self.batch
                .put_message(group.0, HARD_STATE.to_vec(), hs)
                .map_err(engine_error)?;
        }
        Ok(())
    }

    fn flush(&mut self, must_sync: bool) -> Result<(), LogError> {
        if self.batch.is_empty() {
            return Ok(());
        }
        self.engine
            .write(&mut self.batch, must_sync)
            .map_err(engine_error)?;
        Ok(())
    }

    fn save_snapshot(&mut self, group: GroupId, snap: &StoredSnapshot) -> Result<(), LogError> {
        if let Some(p) = self.prestaged.remove(&group) {
            let same = p.meta == snap.meta
                && p.members == snap.members
                && p.len == snap.data.len()
                && p.data == snap.data.as_ptr() as usize;
            if same {
                match self.snapshots.publish(group, &p.file) {
                    Ok(()) => {
                        self.prestaged_used += 1;
                        return Ok(());
                    }
                    Err(e) => {
                        tracing::warn!(group = group.0, error = %e, "a snapshot written ahead cannot be put in place; writing it again");
                    }
                }
            }
            self.snapshots.discard(&p.file);
        }
        self.snapshots.save(group, snap)
    }

    fn clear_entries(&mut self, group: GroupId, hard_state: &HardState) -> Result<(), LogError> {
        // raft-engine applies a batch's items in order: the group's entries and state go, then
        // the hard state comes back, and entries appended after start the new log.
        self.batch.add_command(group.0, raft_engine::Command::Clean);
        self.batch
            .put_message(group.0, HARD_STATE.to_vec(), hard_state)
            .map_err(engine_error)
    }

    fn put_members(&mut self, group: GroupId, members: &Members) -> Result<(), LogError> {
        self.batch
            .put_message(group.0, MEMBERS.to_vec(), &members.to_conf_state())
            .map_err(engine_error)
    }

    /// Files no group needs any more are recycled.
    fn compact_to(&mut self, group: GroupId, index: u64) -> Result<(), LogError> {
        self.engine.compact_to(group.0, index);
        self.engine.purge_expired_files().map_err(engine_error)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(index: u64, term: u64, data: &[u8]) -> Entry {
        Entry {
            index,
            term,
            data: data.to_vec().into(),
            ..Default::default()
        }
    }

    fn hard_state(term: u64, vote: u64, commit: u64) -> HardState {
        HardState {
            term,
            vote,
            commit,
            ..Default::default()
        }
    }

    fn summary(g: &DurableGroup) -> Vec<(u64, u64, Vec<u8>)> {
        g.entries
            .iter()
            .map(|e| (e.index, e.term, e.data.to_vec()))
            .collect()
    }

    #[test]
    fn what_was_flushed_comes_back_after_a_reopen_and_what_was_not_does_not() {
        let dir = tempfile::tempdir().unwrap();
        {
            let mut log = EngineLog::open(dir.path()).unwrap();
            for g in 1..=3u64 {
                let entries: Vec<Entry> =
                    (1..=4).map(|i| entry(i, 1, &[g as u8, i as u8])).collect();
                log.append(GroupId(g), &entries, Some(&hard_state(1, g, 3)))
                    .unwrap();
            }
            log.flush(true).unwrap();
            // Appended, never flushed: a crash before the fsync loses it.
            log.append(GroupId(1), &[entry(5, 1, b"lost")], None)
                .unwrap();
        }
        let log = EngineLog::open(dir.path()).unwrap();
        assert_eq!(log.groups(), vec![GroupId(1), GroupId(2), GroupId(3)]);
        let g1 = log.durable(GroupId(1)).unwrap();
        // Up to the commit index (3) the entries stay on disk, read back when needed.
        assert_eq!(
            g1.unloaded,
            Some(Unloaded {
                first: 1,
                last: 3,
                last_term: 1,
                term_at_snapshot: None
            })
        );
        let cold = crate::storage::ColdLog::entries(&*log.cold(), 1, 1, 4, None).unwrap();
        let read_back: Vec<(u64, u64, Vec<u8>)> = cold
            .iter()
            .map(|e| (e.index, e.term, e.data.to_vec()))
            .chain(summary(&g1))
            .collect();
        assert_eq!(
            read_back,
            (1..=4)
                .map(|i| (i, 1, vec![1, i as u8]))
                .collect::<Vec<_>>()
        );
        assert_eq!(summary(&g1), vec![(4, 1, vec![1, 4])]);
        assert_eq!(g1.hard_state, hard_state(1, 1, 3));
        assert_eq!(log.durable(GroupId(3)).unwrap().hard_state.vote, 3);
    }

    #[test]
    fn committed_entries_stay_on_disk_and_still_tell_whether_the_log_follows_the_snapshot() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = EngineLog::open(dir.path()).unwrap();
        let entries: Vec<Entry> = (1..=20).map(|i| entry(i, 1, b"x")).collect();
        log.append(GroupId(2), &entries, Some(&hard_state(1, 0, 15)))
            .unwrap();
        log.flush(true).unwrap();
        let snap = |index, term| StoredSnapshot {
            meta: crate::SnapshotMeta { index, term },
            data: bytes::Bytes::from_static(b"state"),
            members: None,
        };
        log.save_snapshot(GroupId(2), &snap(10, 1)).unwrap();
        let mut g = log.durable(GroupId(2)).unwrap();
        assert_eq!(
            g.unloaded,
            Some(Unloaded {
                first: 1,
                last: 15,
                last_term: 1,
                term_at_snapshot: Some(1)
            })
        );
        assert_eq!(
            g.entries.iter().map(|e| e.index).collect::<Vec<_>>(),
            (16..=20).collect::<Vec<_>>()
        );
        assert!(!g.fit_to_snapshot(), "the log follows its snapshot");
        assert!(g.unloaded.is_some());

        // A snapshot past the commit index: the entries up to it are final too.
        log.save_snapshot(GroupId(2), &snap(18, 1)).unwrap();
        let g = log.durable(GroupId(2)).unwrap();
        assert_eq!(
            g.unloaded.map(|u| (u.last, u.term_at_snapshot)),
            Some((18, Some(1)))
        );
        assert_eq!(g.entries.len(), 2);

        // A log that diverged from the snapshot (another term at its index), or stops short
        // of it, does not follow it: dropped whole, the unloaded part with it.
        log.save_snapshot(GroupId(2), &snap(12, 2)).unwrap();
        let mut g = log.durable(GroupId(2)).unwrap();
        assert!(g.fit_to_snapshot());
        assert!(g.entries.is_empty() && g.unloaded.is_none());
        log.save_snapshot(GroupId(2), &snap(30, 2)).unwrap();
        let mut g = log.durable(GroupId(2)).unwrap();
        assert_eq!(
            g.unloaded.map(|u| (u.last, u.term_at_snapshot)),
            Some((20, None))
        );
        assert!(g.fit_to_snapshot());
        assert!(g.entries.is_empty() && g.unloaded.is_none());
    }

    #[test]
    fn a_rewritten_tail_replaces_the_old_one() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = EngineLog::open(dir.path()).unwrap();
        let first: Vec<Entry> = (1..=5).map(|i| entry(i, 1, b"old")).collect();
        log.append(GroupId(7), &first, None).unwrap();
        log.flush(true).unwrap();
        // A new leader's entries from index 3 on.
        log.append(
            GroupId(7),
            &[entry(3, 2, b"new"), entry(4, 2, b"new")],
            None,
        )
        .unwrap();
        log.flush(true).unwrap();
        drop(log);
        let log = EngineLog::open(dir.path()).unwrap();
        let got: Vec<(u64, u64)> = log
            .durable(GroupId(7))
            .unwrap()
            .entries
            .iter()
            .map(|e| (e.index, e.term))
            .collect();
        assert_eq!(got, vec![(1, 1), (2, 1), (3, 2), (4, 2)]);
    }

    #[test]
    fn compaction_drops_the_head_and_a_removed_group_is_gone() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = EngineLog::open(dir.path()).unwrap();
        let entries: Vec<Entry> = (1..=100).map(|i| entry(i, 1, b"x")).collect();
        log.append(GroupId(1), &entries, None).unwrap();
        log.append(GroupId(2), &entries, None).unwrap();
        log.flush(true).unwrap();
        log.compact_to(GroupId(1), 91).unwrap();
        log.remove_group(GroupId(2)).unwrap();
        drop(log);
        let log = EngineLog::open(dir.path()).unwrap();
        let g1 = log.durable(GroupId(1)).unwrap();
        assert_eq!(g1.entries.first().map(|e| e.index), Some(91));
        assert_eq!(g1.entries.len(), 10);
        assert_eq!(log.groups(), vec![GroupId(1)]);
    }

    #[test]
    fn an_installed_snapshot_replaces_the_whole_log_and_comes_back_after_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        {
            let mut log = EngineLog::open(dir.path()).unwrap();
            let old: Vec<Entry> = (1..=20).map(|i| entry(i, 1, b"stale")).collect();
            log.append(GroupId(4), &old, Some(&hard_state(1, 2, 10)))
                .unwrap();
            log.flush(true).unwrap();
            let snap = StoredSnapshot {
                meta: crate::SnapshotMeta { index: 50, term: 3 },
                data: bytes::Bytes::from_static(b"state at 50"),
                members: None,
            };
            log.save_snapshot(GroupId(4), &snap).unwrap();
            log.clear_entries(GroupId(4), &hard_state(3, 0, 50))
                .unwrap();
            log.append(GroupId(4), &[entry(51, 3, b"new")], None)
                .unwrap();
            log.flush(true).unwrap();
        }
        let log = EngineLog::open(dir.path()).unwrap();
        let g = log.durable(GroupId(4)).unwrap();
        let got: Vec<(u64, u64)> = g.entries.iter().map(|e| (e.index, e.term)).collect();
        assert_eq!(got, vec![(51, 3)]);
        assert_eq!(g.hard_state, hard_state(3, 0, 50));
        let snap = g.snapshot.expect("the snapshot");
        assert_eq!((snap.meta.index, snap.meta.term), (50, 3));
        assert_eq!(&snap.data[..], b"state at 50");
        assert_eq!(log.groups(), vec![GroupId(4)]);
    }
}
