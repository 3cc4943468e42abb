//! The node-wide log: every group's entries and hard states go into one write, made durable with
//! one fsync per batch (group commit), as Ra's WAL and TiKV's raft-engine do.
//!
//! [`FileLog`] is the spike's version: one append-only file, never compacted. A real log needs
//! segments, per-group indexes and truncation once every group has a snapshot past a segment.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::Path;

use raft::eraftpb::{Entry, EntryType, HardState};

use crate::snapshots::{Members, StoredSnapshot};
use crate::GroupId;

#[derive(Debug, thiserror::Error)]
pub enum LogError {
    #[error("log i/o: {0}")]
    Io(#[from] std::io::Error),
    #[error("entry of {0} bytes is too large for the log format")]
    TooLarge(usize),
    #[error("raft-engine: {0}")]
    Engine(String),
    #[error("{0}")]
    Corrupt(String),
    #[error("{0} is not supported by this log")]
    Unsupported(&'static str),
    /// What was to be written could not be made (a snapshot whose state failed to encode).
    #[error("{0}")]
    Unmade(String),
}

/// Where a node's batch of Raft state goes before it may be acknowledged.
pub trait LogStore {
    /// Adds one group's new entries (possibly replacing an uncommitted tail from `entries[0].index`
    /// on) and hard state to the current batch.
    fn append(
        &mut self,
        group: GroupId,
        entries: &[Entry],
        hard_state: Option<&HardState>,
    ) -> Result<(), LogError>;

    /// Makes the batch durable. `must_sync` is false when only commit indexes moved: the batch is
    /// written but needs no fsync (Raft can recompute a lost commit index).
    fn flush(&mut self, must_sync: bool) -> Result<(), LogError>;

    /// Makes `snap` the group's snapshot, durable when this returns (before the batch's flush:
    /// what the batch drops relies on it).
    fn save_snapshot(&mut self, group: GroupId, snap: &StoredSnapshot) -> Result<(), LogError>;

    /// Adds to the batch: every entry of the group goes, its hard state becomes `hard_state`
    /// (a follower installed its leader's snapshot, which replaces its whole log).
    fn clear_entries(&mut self, group: GroupId, hard_state: &HardState) -> Result<(), LogError>;

    /// Drops the group's entries below `index`, which a snapshot covers.
    fn compact_to(&mut self, group: GroupId, index: u64) -> Result<(), LogError>;

    /// Adds to the batch: the members the group started with on this node (none for a member
    /// being added). A restart starts the group from its snapshot's members, else from these,
    /// then applies the changes in its log.
    fn put_members(&mut self, group: GroupId, members: &Members) -> Result<(), LogError>;
}

/// What the log holds for one group: the entries made durable, in index order, its hard state
/// and its latest snapshot (the entries before it may be gone).
#[derive(Debug, Default, Clone)]
pub struct DurableGroup {
    /// The entries read into memory: all of them, or those after [`DurableGroup::unloaded`].
    pub entries: Vec<Entry>,
    /// Entries the log holds before `entries` and that were left there: committed, so final,
    /// and read back in bounded batches as the group applies them or a follower needs them
    /// (the group's [`crate::storage::ColdLog`]).
    pub unloaded: Option<Unloaded>,
    pub hard_state: HardState,
    pub snapshot: Option<StoredSnapshot>,
    /// The members it started with, if recorded ([`LogStore::put_members`]).
    pub members: Option<Members>,
}

/// The committed entries `first..=last` of a recovered group, left in the durable log: the
/// term of the last (where the group's log in memory starts), and the term of the entry at
/// the group's snapshot's index if it is among them (whether the log follows the snapshot).
///
/// A deep queue's log since its last snapshot can be as large as that snapshot (hundreds of
/// MB): read whole at a start, it was that much memory at once before a single entry applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unloaded {
    pub first: u64,
    pub last: u64,
    pub last_term: u64,
    pub term_at_snapshot: Option<u64>,
}

impl DurableGroup {
    /// The members a recovered group starts from: its snapshot's, else those it started with
    /// (recorded as the list's nodes for a group of an earlier version, whose snapshots hold
    /// none: it had no membership change), else every node of `nodes` as a voter.
    pub fn start_members(&self, nodes: &[crate::NodeId]) -> Members {
        self.snapshot
            .as_ref()
            .and_then(|s| s.members.clone())
            .or_else(|| self.members.clone())
            .unwrap_or_else(|| Members::voters(nodes.to_vec()))
    }
}

impl DurableGroup {
    /// Leaves out entries that cannot follow the snapshot: a log that stops short of it or has
    /// a gap after it, or one that diverged from it (a crash between saving a leader's snapshot
    /// and dropping the old log). Returns whether any went: the durable log must then drop
    /// them too before anything is appended.
    pub fn fit_to_snapshot(&mut self) -> bool {
        let Some(s) = self.snapshot.as_ref().map(|s| s.meta) else {
            return false;
        };
        let Some(first) = self
            .unloaded
            .map(|u| u.first)
            .or(self.entries.first().map(|e| e.index))
        else {
            return false;
        };
        let at_snapshot = match self.unloaded {
            Some(u) if (u.first..=u.last).contains(&s.index) => u.term_at_snapshot,
            _ => self
                .entries
                .iter()
                .find(|e| e.index == s.index)
                .map(|e| e.term),
        };
        if first == s.index + 1 || at_snapshot == Some(s.term) {
            return false;
        }
        self.entries.clear();
        self.unloaded = None;
        true
    }

    /// The last index known committed: the hard state's commit index, or the snapshot's if
    /// later (a snapshot covers committed entries only). Entries up to it are final.
    pub(crate) fn committed_through(
        hard_state: &HardState,
        snapshot: Option<&StoredSnapshot>,
    ) -> u64 {
        hard_state.commit.max(snapshot.map_or(0, |s| s.meta.index))
    }

    /// Leaves the entries up to the commit index (or the snapshot's, if later) out of
    /// `entries`, as [`crate::EngineLog::durable`] reads them: for a log whose entries are in
    /// memory whole ([`MemLog`]), so that tests recover groups the way a node does.
    pub fn unload_committed(&mut self) {
        let commit = Self::committed_through(&self.hard_state, self.snapshot.as_ref());
        let n = self
            .entries
            .iter()
            .take_while(|e| e.index <= commit)
            .count();
        let (Some(first), Some(last)) = (
            self.entries.first(),
            n.checked_sub(1).and_then(|i| self.entries.get(i)),
        ) else {
            return;
        };
        let snapshot_index = self.snapshot.as_ref().map(|s| s.meta.index);
        self.unloaded = Some(Unloaded {
            first: first.index,
            last: last.index,
            last_term: last.term,
            term_at_snapshot: snapshot_index.and_then(|i| {
                self.entries[..n]
                    .iter()
                    .find(|e| e.index == i)
                    .map(|e| e.term)
            }),
        });
        self.entries.drain(..n);
    }
}

/// What [`MemLog`] holds until its next flush.
#[derive(Debug)]
enum Pending {
    Append(GroupId, Vec<Entry>, Option<HardState>),
    Clear(GroupId, HardState),
    Members(GroupId, Members),
}

/// An in-memory [`LogStore`] for tests: appends become visible in `durable` only at `flush`, so
/// a simulated crash can drop what was appended but never flushed.
#[derive(Debug, Default)]
pub struct MemLog {
    pending: Vec<Pending>,
    /// Shared with the groups that read entries back from it ([`MemLog::cold`]).
    durable: std::sync::Arc<std::sync::Mutex<std::collections::BTreeMap<GroupId, DurableGroup>>>,
    /// Saved snapshots, shared with the groups that read them back ([`MemLog::snapshots`]).
    snapshots: crate::snapshots::MemSnapshots,
    pub flushes: u64,
    pub syncs: u64,
}

impl MemLog {
    pub fn new() -> Self {
        MemLog::default()
    }

    /// Drops what was appended since the last flush, as a crash before the fsync would.
    pub fn crash(&mut self) {
        self.pending.clear();
    }

    /// Where the groups read this log's snapshots back (`MultiRaft::set_snapshot_source`).
    pub fn snapshots(&self) -> std::sync::Arc<dyn crate::snapshots::SnapshotSource> {
        std::sync::Arc::new(self.snapshots.clone())
    }

    /// What the log holds, by group.
    pub fn durable(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::BTreeMap<GroupId, DurableGroup>> {
        self.durable.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Where the groups read back entries that left their memory, as from a node's log.
    pub fn cold(&self) -> std::sync::Arc<dyn crate::storage::ColdLog> {
        std::sync::Arc::new(MemCold(self.durable.clone()))
    }

    /// Forgets a group (its queue was deleted, or this node left it).
    pub fn remove_group(&mut self, group: GroupId) {
        self.durable().remove(&group);
        self.snapshots.remove(group);
    }

    /// What a restart reads back for `group`.
    pub fn recovered(&self, group: GroupId) -> DurableGroup {
        let mut g = self.durable().get(&group).cloned().unwrap_or_default();
        g.snapshot = self.snapshots.get(group);
        g
    }
}

/// [`MemLog`]'s entries read back as a node's durable log is ([`crate::storage::ColdLog`]).
#[derive(Debug)]
struct MemCold(std::sync::Arc<std::sync::Mutex<std::collections::BTreeMap<GroupId, DurableGroup>>>);

impl crate::storage::ColdLog for MemCold {
    fn first_index(&self, group: u64) -> Option<u64> {
        let durable = self.0.lock().unwrap_or_else(|p| p.into_inner());
        durable
            .get(&GroupId(group))?
            .entries
            .first()
            .map(|e| e.index)
    }

    fn entries(
        &self,
        group: u64,
        low: u64,
        high: u64,
        max_size: Option<u64>,
    ) -> Result<Vec<Entry>, String> {
        let durable = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let entries = durable
            .get(&GroupId(group))
            .map_or(&[][..], |g| &g.entries[..]);
        let mut out: Vec<Entry> = entries
            .iter()
            .filter(|e| (low..high).contains(&e.index))
            .cloned()
            .collect();
        if out.first().map(|e| e.index) != Some(low) {
            return Err(format!("entry {low} of group {group} is not in the log"));
        }
        raft::util::limit_size(&mut out, max_size);
        Ok(out)
    }
}

impl LogStore for MemLog {
    fn append(
        &mut self,
        group: GroupId,
        entries: &[Entry],
        hard_state: Option<&HardState>,
    ) -> Result<(), LogError> {
        self.pending.push(Pending::Append(
            group,
            entries.to_vec(),
            hard_state.cloned(),
        ));
        Ok(())
    }

    fn flush(&mut self, must_sync: bool) -> Result<(), LogError> {
        let mut durable = self.durable.lock().unwrap_or_else(|p| p.into_inner());
        for p in self.pending.drain(..) {
            match p {
                Pending::Append(group, entries, hs) => {
                    let g = durable.entry(group).or_default();
                    if let Some(first) = entries.first() {
                        g.entries.retain(|e| e.index < first.index);
                        g.entries.extend(entries);
                    }
                    if let Some(hs) = hs {
                        g.hard_state = hs;
                    }
                }
                Pending::Clear(group, hs) => {
                    let g = durable.entry(group).or_default();
                    g.entries.clear();
                    g.hard_state = hs;
                    g.members = None;
                }
                Pending::Members(group, m) => {
                    durable.entry(group).or_default().members = Some(m);
                }
            }
        }
        drop(durable);
        self.flushes += 1;
        self.syncs += u64::from(must_sync);
        Ok(())
    }

    fn save_snapshot(&mut self, group: GroupId, snap: &StoredSnapshot) -> Result<(), LogError> {
        self.snapshots.save(group, snap);
        Ok(())
    }

    fn clear_entries(&mut self, group: GroupId, hard_state: &HardState) -> Result<(), LogError> {
        self.pending.push(Pending::Clear(group, hard_state.clone()));
        Ok(())
    }

    fn compact_to(&mut self, group: GroupId, index: u64) -> Result<(), LogError> {
        if let Some(g) = self.durable().get_mut(&group) {
            g.entries.retain(|e| e.index >= index);
        }
        Ok(())
    }

    fn put_members(&mut self, group: GroupId, members: &Members) -> Result<(), LogError> {
        self.pending.push(Pending::Members(group, members.clone()));
        Ok(())
    }
}

/// Record format, version 1: `[version u8][payload len u32][crc32 of payload u32][payload]`, little
/// endian. Payload: `[group u64][kind u8]` then for an entry `[index u64][term u64][type u8][data
/// len u32][data]`, for a hard state `[term u64][vote u64][commit u64]`.
const VERSION: u8 = 1;
const KIND_ENTRY: u8 = 1;
const KIND_HARD_STATE: u8 = 2;
const HEADER: usize = 9;

/// One append-only file for all groups of a node; one `write` and at most one `fdatasync` per batch.
pub struct FileLog {
    file: File,
    buf: Vec<u8>,
    pub bytes_written: u64,
    pub syncs: u64,
}

impl FileLog {
    pub fn create(path: &Path) -> Result<Self, LogError> {
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        Ok(FileLog {
            file,
            buf: Vec::with_capacity(1 << 20),
            bytes_written: 0,
            syncs: 0,
        })
    }

    fn record(&mut self, payload_len: usize, fill: impl FnOnce(&mut Vec<u8>)) {
        let start = self.buf.len();
        self.buf.push(VERSION);
        self.buf
            .extend_from_slice(&(payload_len as u32).to_le_bytes());
        self.buf.extend_from_slice(&[0; 4]);
        fill(&mut self.buf);
        debug_assert_eq!(self.buf.len() - start - HEADER, payload_len);
        let crc = crc32fast::hash(&self.buf[start + HEADER..]);
        self.buf[start + 5..start + HEADER].copy_from_slice(&crc.to_le_bytes());
    }

    /// Reads a log back: each group's entries (a later record for an index replaces the tail from
    /// there) and last hard state. Stops at the first torn or corrupt record, which is where a
    /// crash during the last write left the file.
    pub fn replay(
        path: &Path,
    ) -> Result<std::collections::BTreeMap<GroupId, DurableGroup>, LogError> {
        let mut data = Vec::new();
        File::open(path)?.read_to_end(&mut data)?;
        let mut out: std::collections::BTreeMap<GroupId, DurableGroup> = Default::default();
        let mut rest = &data[..];
        while let Some((payload, tail)) = split_record(rest) {
            rest = tail;
            let Some(rec) = parse_payload(payload) else {
                break;
            };
            match rec {
                Parsed::Entry(group, e) => {
                    let g = out.entry(group).or_default();
                    g.entries.retain(|x| x.index < e.index);
                    g.entries.push(e);
                }
                Parsed::HardState(group, hs) => out.entry(group).or_default().hard_state = hs,
            }
        }
        Ok(out)
    }
}

impl LogStore for FileLog {
    fn append(
        &mut self,
        group: GroupId,
        entries: &[Entry],
        hard_state: Option<&HardState>,
    ) -> Result<(), LogError> {
        for e in entries {
            let data = &e.data[..];
            if data.len() > u32::MAX as usize - 64 {
                return Err(LogError::TooLarge(data.len()));
            }
            self.record(8 + 1 + 8 + 8 + 1 + 4 + data.len(), |b| {
                b.extend_from_slice(&group.0.to_le_bytes());
                b.push(KIND_ENTRY);
                b.extend_from_slice(&e.index.to_le_bytes());
                b.extend_from_slice(&e.term.to_le_bytes());
                b.push(e.get_entry_type() as u8);
                b.extend_from_slice(&(data.len() as u32).to_le_bytes());
                b.extend_from_slice(data);
            });
        }
        if let Some(hs) = hard_state {
            self.record(8 + 1 + 24, |b| {
                b.extend_from_slice(&group.0.to_le_bytes());
                b.push(KIND_HARD_STATE);
                b.extend_from_slice(&hs.term.to_le_bytes());
                b.extend_from_slice(&hs.vote.to_le_bytes());
                b.extend_from_slice(&hs.commit.to_le_bytes());
            });
        }
        Ok(())
    }

    fn flush(&mut self, must_sync: bool) -> Result<(), LogError> {
        if !self.buf.is_empty() {
            self.file.write_all(&self.buf)?;
            self.bytes_written += self.buf.len() as u64;
            self.buf.clear();
        }
        if must_sync {
            self.file.sync_data()?;
            self.syncs += 1;
        }
        Ok(())
    }

    // The spike's log has no segments to drop: it measures appends only.
    fn save_snapshot(&mut self, _group: GroupId, _snap: &StoredSnapshot) -> Result<(), LogError> {
        Err(LogError::Unsupported("a snapshot"))
    }

    fn clear_entries(&mut self, _group: GroupId, _hs: &HardState) -> Result<(), LogError> {
        Err(LogError::Unsupported("installing a snapshot"))
    }

    fn compact_to(&mut self, _group: GroupId, _index: u64) -> Result<(), LogError> {
        Err(LogError::Unsupported("compaction"))
    }

    // The spike measures appends: its groups are made once, with the list's nodes, and keep
    // them (it replays no membership either).
    fn put_members(&mut self, _group: GroupId, _members: &Members) -> Result<(), LogError> {
        Ok(())
    }
}

enum Parsed {
    Entry(GroupId, Entry),
    HardState(GroupId, HardState),
}

fn split_record(b: &[u8]) -> Option<(&[u8], &[u8])> {
    let header = b.get(..HEADER)?;
    if header[0] != VERSION {
        return None;
    }
    let len = u32::from_le_bytes(header[1..5].try_into().ok()?) as usize;
    let crc = u32::from_le_bytes(header[5..9].try_into().ok()?);
    let payload = b.get(HEADER..HEADER.checked_add(len)?)?;
    if crc32fast::hash(payload) != crc {
        return None;
    }
    Some((payload, &b[HEADER + len..]))
}

fn parse_payload(p: &[u8]) -> Option<Parsed> {
    let mut r = Reader(p);
    let group = GroupId(r.u64()?);
    match r.u8()? {
        KIND_ENTRY => {
            let mut e = Entry {
                index: r.u64()?,
                term: r.u64()?,
                ..Default::default()
            };
            let ty = match r.u8()? {
                0 => EntryType::EntryNormal,
                1 => EntryType::EntryConfChange,
                2 => EntryType::EntryConfChangeV2,
                _ => return None,
            };
            e.set_entry_type(ty);
            let len = r.u32()? as usize;
            e.data = bytes::Bytes::copy_from_slice(r.take(len)?);
            Some(Parsed::Entry(group, e))
        }
        KIND_HARD_STATE => {
            let hs = HardState {
                term: r.u64()?,
                vote: r.u64()?,
                commit: r.u64()?,
                ..Default::default()
            };
            Some(Parsed::HardState(group, hs))
        }
        _ => None,
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, tail) = (self.0.get(..n)?, self.0.get(n..)?);
        self.0 = tail;
        Some(head)
    }
    fn u8(&mut self) -> Option<u8> {
        Some(self.take(1)?[0])
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
}
