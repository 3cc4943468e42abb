//! A group's snapshot: its state machine's state once every entry up to an index is applied,
//! so that the log before it can go and a follower too far behind is sent the state instead.
//!
//! The state machine (the broker's queue) makes the bytes; this crate only keeps them: one file
//! per group ([`SnapshotFiles`], beside the node's log), written whole, fsynced and renamed into
//! place, so a crash leaves the old snapshot or the new one, never half of one. Only the
//! metadata stays in memory; a leader reads the data back when a follower needs it
//! ([`SnapshotSource`]).

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use bytes::Bytes;

use raft::eraftpb::ConfState;

use crate::wal::LogError;
use crate::{GroupId, NodeId};

/// Where a snapshot stands in its group's log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SnapshotMeta {
    /// The last entry the state covers, and that entry's term.
    pub index: u64,
    pub term: u64,
}

/// A group's members at some index of its log: who votes, and who receives the log without a
/// vote (a member being added, until it caught up). Both sorted.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Members {
    pub voters: Vec<NodeId>,
    pub learners: Vec<NodeId>,
}

impl Members {
    /// Every node of `voters` votes.
    pub fn voters(mut voters: Vec<NodeId>) -> Self {
        voters.sort_unstable();
        voters.dedup();
        Members {
            voters,
            learners: Vec::new(),
        }
    }

    pub fn contains(&self, node: NodeId) -> bool {
        self.voters.contains(&node) || self.learners.contains(&node)
    }

    pub fn is_empty(&self) -> bool {
        self.voters.is_empty() && self.learners.is_empty()
    }

    pub fn to_conf_state(&self) -> ConfState {
        ConfState::from((self.voters.clone(), self.learners.clone()))
    }

    pub fn from_conf_state(cs: &ConfState) -> Self {
        let mut voters = cs.voters.clone();
        let mut learners = cs.learners.clone();
        voters.sort_unstable();
        learners.sort_unstable();
        Members { voters, learners }
    }
}

/// A snapshot with its state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredSnapshot {
    pub meta: SnapshotMeta,
    pub data: Bytes,
    /// The group's members at the snapshot's index (`None` in a file of an earlier version,
    /// whose groups had every node of the cluster's list as voters).
    pub members: Option<Members>,
}

/// Where a group's snapshot is read back when a follower needs it.
pub trait SnapshotSource: Send + Sync + std::fmt::Debug {
    /// The group's latest durable snapshot, if it has one.
    fn load(&self, group: u64) -> Result<Option<StoredSnapshot>, String>;

    /// The group's latest snapshot for a follower, if one at `at_least` or later is at hand
    /// now; a source that reads on another thread answers [`Fetch::Pending`] meanwhile (Raft
    /// asks again at its next attempt). By default, [`SnapshotSource::load`] there and then.
    fn fetch(&self, group: u64, at_least: u64) -> Fetch {
        let _ = at_least;
        match self.load(group) {
            Ok(Some(s)) => Fetch::Ready(s),
            Ok(None) => Fetch::Missing,
            Err(e) => Fetch::Failed(e),
        }
    }

    /// The group was removed: nothing read for it may go to a group made again under its
    /// number.
    fn forget(&self, group: u64) {
        let _ = group;
    }
}

/// What [`SnapshotSource::fetch`] has for a group.
#[derive(Debug)]
pub enum Fetch {
    Ready(StoredSnapshot),
    /// Being read: ask again later.
    Pending,
    /// The group has none.
    Missing,
    /// It could not be read (the file is damaged, or the disk failed).
    Failed(String),
}

/// Snapshot files read for followers on a thread of their own: a deep queue's snapshot (tens
/// of MB, read and checked) would otherwise be read on the Raft thread, holding up every
/// group of the node while a lagging follower is served. The first [`SnapshotSource::fetch`]
/// starts the read and answers [`Fetch::Pending`]; a later one hands the snapshot over, and
/// so does each one after it until the group's file is newer. One not asked for within
/// [`READ_KEPT`] is let go.
#[derive(Debug)]
pub struct SnapshotReader {
    files: SnapshotFiles,
    state: std::sync::Arc<std::sync::Mutex<HashMap<u64, Reading>>>,
    todo: std::sync::mpsc::Sender<u64>,
}

/// How long a snapshot read for a follower waits to be asked for again.
pub const READ_KEPT: std::time::Duration = std::time::Duration::from_secs(30);

/// A read, with the index it was asked for at least (what it found may be older: the caller
/// then asks the state machine for a newer snapshot).
#[derive(Debug)]
enum Reading {
    Started(u64, std::time::Instant),
    Done(u64, std::time::Instant, Fetch),
}

impl SnapshotReader {
    /// Starts the reading thread; it ends when the reader is dropped.
    pub fn start(files: SnapshotFiles) -> std::io::Result<Self> {
        let (todo, jobs) = std::sync::mpsc::channel::<u64>();
        let state: std::sync::Arc<std::sync::Mutex<HashMap<u64, Reading>>> = Default::default();
        let (reader, done) = (files.clone(), state.clone());
        std::thread::Builder::new()
            .name("warren-snap-read".into())
            .spawn(move || loop {
                let group = match jobs.recv_timeout(READ_KEPT) {
                    Ok(group) => group,
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                        // What nobody came back for is let go, even if nobody asks again.
                        let mut state = done.lock().unwrap_or_else(|p| p.into_inner());
                        state.retain(|_, r| !matches!(r, Reading::Done(_, at, _) if at.elapsed() > READ_KEPT));
                        continue;
                    }
                    Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return,
                };
                {
                    let got = reader.fetch(group, 0);
                    let mut state = done.lock().unwrap_or_else(|p| p.into_inner());
                    // Let go meanwhile: nobody waits for it.
                    if let Some(r) = state.get_mut(&group) {
                        if let Reading::Started(asked, _) = *r {
                            *r = Reading::Done(asked, std::time::Instant::now(), got);
                        }
                    }
                }
            })?;
        Ok(SnapshotReader { files, state, todo })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Reading>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl SnapshotSource for SnapshotReader {
    fn load(&self, group: u64) -> Result<Option<StoredSnapshot>, String> {
        self.files.load(group)
    }

    fn fetch(&self, group: u64, at_least: u64) -> Fetch {
        let mut state = self.lock();
        state.retain(|_, r| !matches!(r, Reading::Done(_, at, _) if at.elapsed() > READ_KEPT));
        match state.remove(&group) {
            // A read that never ended (its thread is gone) is started again below.
            Some(Reading::Started(asked, since)) if since.elapsed() < READ_KEPT => {
                state.insert(group, Reading::Started(asked, since));
                return Fetch::Pending;
            }
            // Read before a newer one was written: read again.
            Some(Reading::Done(asked, _, Fetch::Ready(s)))
                if s.meta.index < at_least && asked < at_least => {}
            // Kept while it is asked for: raft-rs asks again while a snapshot sent in pieces
            // is still on its way (each refused append), and reading a GiB each time would
            // keep this thread and the disk busy. A newer file is read instead.
            Some(Reading::Done(asked, _, Fetch::Ready(s))) => {
                let newer = self
                    .files
                    .index_on_disk(GroupId(group))
                    .is_some_and(|i| i > s.meta.index);
                if !newer {
                    let out = s.clone();
                    state.insert(
                        group,
                        Reading::Done(asked, std::time::Instant::now(), Fetch::Ready(s)),
                    );
                    return Fetch::Ready(out);
                }
            }
            Some(Reading::Done(_, _, got)) => return got,
            Some(Reading::Started(..)) | None => {}
        }
        if self.todo.send(group).is_err() {
            drop(state);
            return self.files.fetch(group, at_least);
        }
        state.insert(group, Reading::Started(at_least, std::time::Instant::now()));
        Fetch::Pending
    }

    fn forget(&self, group: u64) {
        self.lock().remove(&group);
    }
}

/// A snapshot larger than this is written and synced this much at a time.
const SYNC_EVERY: usize = 16 << 20;

/// `WSNP`, then the format version.
const MAGIC: &[u8; 4] = b"WSNP";
/// Version 1: no members (an earlier version's files, and snapshots saved without members).
/// Version 2: the members' block between the header and the data, its length in the header
/// before the CRC (which covers it too).
const VERSION: u8 = 1;
const VERSION_MEMBERS: u8 = 2;
/// Magic, version, group, index, term, data length, CRC-32 of everything before it and the data.
const HEADER: usize = 4 + 1 + 8 + 8 + 8 + 8 + 4;
/// Version 2's header: a u32 length of the members' block before the CRC.
const HEADER_MEMBERS: usize = HEADER + 4;
/// More members than any cluster has: a length beyond it is damage.
const MAX_MEMBERS: usize = 1024;

fn encode_members(m: &Members) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + 8 * (m.voters.len() + m.learners.len()));
    for list in [&m.voters, &m.learners] {
        out.extend_from_slice(&(list.len() as u16).to_be_bytes());
        for n in list {
            out.extend_from_slice(&n.to_be_bytes());
        }
    }
    out
}

fn decode_members(group: GroupId, mut b: &[u8]) -> Result<Members, LogError> {
    let mut lists = [Vec::new(), Vec::new()];
    for list in &mut lists {
        let (count, rest) = b
            .split_first_chunk::<2>()
            .ok_or_else(|| corrupt(group, "members cut short"))?;
        let count = u16::from_be_bytes(*count) as usize;
        if count > MAX_MEMBERS || rest.len() < count * 8 {
            return Err(corrupt(group, "members cut short"));
        }
        let (ids, rest) = rest.split_at(count * 8);
        list.extend(
            ids.chunks_exact(8)
                .filter_map(|c| c.try_into().ok())
                .map(u64::from_be_bytes),
        );
        b = rest;
    }
    if !b.is_empty() {
        return Err(corrupt(group, "bytes after the members"));
    }
    let [voters, learners] = lists;
    Ok(Members { voters, learners })
}

/// Snapshots in a directory: `<group as 16 hex digits>.snap`.
#[derive(Debug, Clone)]
pub struct SnapshotFiles {
    dir: PathBuf,
}

impl SnapshotFiles {
    /// Snapshots in `dir`, created if missing. Files of an interrupted write are removed.
    pub fn open(dir: &Path) -> Result<Self, LogError> {
        std::fs::create_dir_all(dir)?;
        for entry in std::fs::read_dir(dir)? {
            let path = entry?.path();
            if path.extension().is_some_and(|e| e == "tmp") {
                std::fs::remove_file(&path)?;
            }
        }
        Ok(SnapshotFiles {
            dir: dir.to_path_buf(),
        })
    }

    fn path(&self, group: GroupId) -> PathBuf {
        self.dir.join(format!("{:016x}.snap", group.0))
    }

    /// Makes `snap` the group's snapshot: durable when this returns, the old one replaced
    /// atomically.
    pub fn save(&self, group: GroupId, snap: &StoredSnapshot) -> Result<(), LogError> {
        let tmp = self.path(group).with_extension("tmp");
        // Written on the thread that runs the group, which waits for it whole: one fsync.
        self.write_file(&tmp, group, snap, false)?;
        self.publish(group, &tmp)
    }

    /// Writes `snap` to a file of its own beside the group's snapshot, fsynced, without
    /// making it the group's yet ([`SnapshotFiles::publish`] does, or
    /// [`SnapshotFiles::discard`] drops it): the slow part of a save, for another thread
    /// than the one that runs the group. `seq` tells apart the writes of one group that
    /// overlap. Left behind by a crash, the file is removed at the next open.
    pub fn stage(
        &self,
        group: GroupId,
        seq: u64,
        snap: &StoredSnapshot,
    ) -> Result<PathBuf, LogError> {
        let staged = self.dir.join(format!("{:016x}.{seq}.tmp", group.0));
        if let Err(e) = self.write_file(&staged, group, snap, true) {
            self.discard(&staged);
            return Err(e);
        }
        Ok(staged)
    }

    /// Makes a written file the group's snapshot, replacing the old one atomically; durable
    /// when this returns.
    pub fn publish(&self, group: GroupId, written: &Path) -> Result<(), LogError> {
        std::fs::rename(written, self.path(group))?;
        // The rename itself must survive a crash.
        std::fs::File::open(&self.dir)?.sync_all()?;
        Ok(())
    }

    /// Removes a staged file that will not be published.
    pub fn discard(&self, staged: &Path) {
        if let Err(e) = std::fs::remove_file(staged) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(file = %staged.display(), error = %e, "cannot remove a snapshot file that was not used");
            }
        }
    }

    /// [`SnapshotFiles::stage`] for a snapshot whose bytes are made while they are written,
    /// never whole in memory: `fill` hands them to the sink it is given in order, except the
    /// first `prefix_len`, which it returns once it is done (a checksum of what follows, say).
    /// The file is the same as `stage` writes for those bytes. An error from `fill` (or one
    /// the sink returned to it) leaves no file. Returns the file and the data's length.
    pub fn stage_stream(
        &self,
        group: GroupId,
        seq: u64,
        meta: SnapshotMeta,
        members: Option<&Members>,
        prefix_len: usize,
        fill: impl FnOnce(&mut dyn FnMut(&[u8]) -> Result<(), String>) -> Result<Vec<u8>, String>,
    ) -> Result<(PathBuf, u64), LogError> {
        let staged = self.dir.join(format!("{:016x}.{seq}.tmp", group.0));
        // Removed on an error, and on a panic in `fill` too (a bug encoding a state): a
        // partial file can be as large as the queue.
        struct Partial<'a>(&'a SnapshotFiles, &'a Path, bool);
        impl Drop for Partial<'_> {
            fn drop(&mut self) {
                if !self.2 {
                    self.0.discard(self.1);
                }
            }
        }
        let mut partial = Partial(self, &staged, false);
        let len = self.write_stream(&staged, group, meta, members, prefix_len, fill)?;
        partial.2 = true;
        drop(partial);
        Ok((staged, len))
    }

    fn write_stream(
        &self,
        path: &Path,
        group: GroupId,
        meta: SnapshotMeta,
        members: Option<&Members>,
        prefix_len: usize,
        fill: impl FnOnce(&mut dyn FnMut(&[u8]) -> Result<(), String>) -> Result<Vec<u8>, String>,
    ) -> Result<u64, LogError> {
        use std::os::unix::fs::FileExt;
        let members = members.map(encode_members);
        let head_len = header(group, meta, members.as_deref(), 0).len() + 4;
        let data_at = (head_len + members.as_ref().map_or(0, Vec::len)) as u64;
        let f = std::fs::File::create(path)?;
        // The header and the prefix are known last: their room is left, the rest streamed,
        // synced in steps as `write_file` does.
        let mut written = data_at + prefix_len as u64;
        f.set_len(written)?;
        let mut file = std::io::BufWriter::with_capacity(1 << 20, &f);
        std::io::Seek::seek(&mut file, std::io::SeekFrom::Start(written))?;
        let mut rest = crc32fast::Hasher::new();
        let mut synced = written;
        let mut failed: Option<std::io::Error> = None;
        let prefix = fill(&mut |chunk: &[u8]| {
            let step = file.write_all(chunk).and_then(|()| {
                written += chunk.len() as u64;
                if written - synced >= SYNC_EVERY as u64 {
                    file.flush()?;
                    file.get_ref().sync_data()?;
                    synced = written;
                }
                Ok(())
            });
            step.map_err(|e| {
                let text = e.to_string();
                failed = Some(e);
                text
            })?;
            rest.update(chunk);
            Ok(())
        });
        if let Some(e) = failed {
            return Err(e.into());
        }
        let prefix = prefix.map_err(LogError::Unmade)?;
        if prefix.len() != prefix_len {
            return Err(LogError::Unmade(format!(
                "a prefix of {} bytes where {prefix_len} were announced",
                prefix.len()
            )));
        }
        file.flush()?;
        drop(file);
        let len = written - data_at;
        let mut head = header(group, meta, members.as_deref(), len);
        let mut crc = crc32fast::Hasher::new();
        crc.update(&head);
        if let Some(m) = &members {
            crc.update(m);
        }
        crc.update(&prefix);
        crc.combine(&rest);
        head.extend_from_slice(&crc.finalize().to_be_bytes());
        if let Some(m) = &members {
            head.extend_from_slice(m);
        }
        head.extend_from_slice(&prefix);
        f.write_all_at(&head, 0)?;
        f.sync_all()?;
        Ok(len)
    }

    /// `stepwise`: synced every [`SYNC_EVERY`] bytes, for a writer beside the node's log.
    fn write_file(
        &self,
        path: &Path,
        group: GroupId,
        snap: &StoredSnapshot,
        stepwise: bool,
    ) -> Result<(), LogError> {
        let members = snap.members.as_ref().map(encode_members);
        let mut header = header(group, snap.meta, members.as_deref(), snap.data.len() as u64);
        let mut crc = crc32fast::Hasher::new();
        crc.update(&header);
        if let Some(m) = &members {
            crc.update(m);
        }
        crc.update(&snap.data);
        header.extend_from_slice(&crc.finalize().to_be_bytes());
        let mut f = std::fs::File::create(path)?;
        f.write_all(&header)?;
        if let Some(m) = &members {
            f.write_all(m)?;
        }
        // In synced steps: a deep queue's snapshot (hundreds of MB) left dirty whole is flushed
        // at once by its final fsync, and the node's log, fsynced on the same disk for every
        // confirm, waits behind it (the longest confirm of a 600,000-message queue's publisher
        // while its 580 MB snapshot was written: 311 and 368 ms, 148 and 170 ms in steps).
        for chunk in snap.data.chunks(SYNC_EVERY) {
            f.write_all(chunk)?;
            if stepwise && snap.data.len() > SYNC_EVERY {
                f.sync_data()?;
            }
        }
        f.sync_all()?;
        Ok(())
    }

    /// The group's snapshot, if it has one. A file that does not check out is an error: the
    /// log before it may be gone, so it cannot be ignored.
    ///
    /// A file of [`MAP_FROM`] bytes or more is mapped rather than read: its data is the page
    /// cache's, which the kernel takes back under pressure, never the process's own memory.
    /// A node's start reads every quorum queue's snapshot before its Raft thread runs, and
    /// read whole they were a peak of the sum of them in the heap (1.3 GB for a node whose
    /// steady RSS was 370 MB, with one 580 MB snapshot): enough to have a container's memory
    /// limit kill it at every start.
    pub fn read(&self, group: GroupId) -> Result<Option<StoredSnapshot>, LogError> {
        let mut file = match std::fs::File::open(self.path(group)) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        if file.metadata()?.len() < MAP_FROM {
            let mut b = Vec::new();
            std::io::Read::read_to_end(&mut file, &mut b)?;
            return decode(group, Bytes::from(b)).map(Some);
        }
        let map = Mapped::of(&file)?;
        let snap = decode(group, Bytes::from_owner(map.clone()));
        // Checked: the pages the checksum read are let go from this mapping (they stay in the
        // page cache), so that a start reading many snapshots holds none of them but the one
        // being decoded.
        map.let_go();
        snap.map(Some)
    }

    /// The index of the group's snapshot on disk, from its header alone (`None`: no file, or
    /// one whose header does not read): whether a snapshot read earlier is still the latest.
    pub fn index_on_disk(&self, group: GroupId) -> Option<u64> {
        use std::io::Read;
        let mut head = [0u8; 21];
        std::fs::File::open(self.path(group))
            .and_then(|mut f| f.read_exact(&mut head))
            .ok()?;
        if head.get(..4)? != MAGIC {
            return None;
        }
        head.get(13..21)
            .and_then(|b| <[u8; 8]>::try_from(b).ok())
            .map(u64::from_be_bytes)
    }

    /// Forgets the group's snapshot (its queue was deleted).
    pub fn remove(&self, group: GroupId) -> Result<(), LogError> {
        match std::fs::remove_file(self.path(group)) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e.into()),
        }
    }
}

impl SnapshotSource for SnapshotFiles {
    fn load(&self, group: u64) -> Result<Option<StoredSnapshot>, String> {
        self.read(GroupId(group)).map_err(|e| e.to_string())
    }
}

/// The size from which a snapshot file is mapped rather than read ([`SnapshotFiles::read`]): a
/// small one costs less copied than a mapping of its own.
pub const MAP_FROM: u64 = 1 << 20;

/// `file`'s bytes as `Bytes` backed by a read-only mapping of it: the page cache's memory, not
/// the heap's.
///
/// # Safety
///
/// The file must not be written or truncated, by this process or another, while the `Bytes`
/// (or any slice of them) live: a mapping shows such changes, and a read past a truncated end
/// is a `SIGBUS`. Unlinking it is fine.
pub unsafe fn map_file(file: &std::fs::File) -> std::io::Result<Bytes> {
    // SAFETY: passed on to the caller.
    let map = unsafe { memmap2::Mmap::map(file)? };
    Ok(Bytes::from_owner(map))
}

/// A snapshot file mapped read-only, shared by the `Bytes` made of it and by whoever lets its
/// pages go ([`Mapped::let_go`]).
#[derive(Debug, Clone)]
struct Mapped(std::sync::Arc<memmap2::Mmap>);

impl Mapped {
    fn of(file: &std::fs::File) -> std::io::Result<Self> {
        // SAFETY: a mapping's bytes must not change while it lives. A snapshot file is never
        // written in place: it is written whole under another name, fsynced and renamed over
        // the group's (`publish`), and a group's deletion unlinks it; either leaves a mapped
        // file's bytes as they were. Only a damaged disk could change them, and the checksums
        // (the file's here, the state's when it is decoded) stand against that as for a read.
        let map = unsafe { memmap2::Mmap::map(file)? };
        // Read through once by the checksum, then once by the decoding: read ahead further.
        if let Err(error) = map.advise(memmap2::Advice::Sequential) {
            tracing::debug!(%error, "madvise(SEQUENTIAL) refused for a snapshot file");
        }
        Ok(Mapped(std::sync::Arc::new(map)))
    }

    /// Drops the mapping's resident pages; what is read afterwards is faulted in again from
    /// the page cache (or the file).
    fn let_go(&self) {
        // SAFETY: `DontNeed` on a read-only shared file mapping discards nothing: its pages
        // are the file's, and a later read maps them again with the same bytes.
        if let Err(error) = unsafe { self.0.unchecked_advise(memmap2::UncheckedAdvice::DontNeed) } {
            tracing::debug!(%error, "madvise(DONTNEED) refused for a snapshot file");
        }
    }
}

impl AsRef<[u8]> for Mapped {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

/// A file's header up to its CRC: magic, version, group, index, term, the data's length and,
/// with `members` (encoded), their block's length.
fn header(group: GroupId, meta: SnapshotMeta, members: Option<&[u8]>, len: u64) -> Vec<u8> {
    let mut header = Vec::with_capacity(HEADER_MEMBERS);
    header.extend_from_slice(MAGIC);
    header.push(if members.is_some() {
        VERSION_MEMBERS
    } else {
        VERSION
    });
    header.extend_from_slice(&group.0.to_be_bytes());
    header.extend_from_slice(&meta.index.to_be_bytes());
    header.extend_from_slice(&meta.term.to_be_bytes());
    header.extend_from_slice(&len.to_be_bytes());
    if let Some(m) = members {
        header.extend_from_slice(&(m.len() as u32).to_be_bytes());
    }
    header
}

fn corrupt(group: GroupId, why: &str) -> LogError {
    LogError::Corrupt(format!("snapshot of group {}: {why}", group.0))
}

fn decode(group: GroupId, bytes: Bytes) -> Result<StoredSnapshot, LogError> {
    let header = bytes
        .get(..HEADER)
        .ok_or_else(|| corrupt(group, "shorter than its header"))?;
    if &header[..4] != MAGIC {
        return Err(corrupt(group, "not a snapshot file"));
    }
    let with_members = match header[4] {
        VERSION => false,
        VERSION_MEMBERS => true,
        v => return Err(corrupt(group, &format!("unknown version {v}"))),
    };
    let word = |at: usize| {
        header
            .get(at..at + 8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_be_bytes)
            .unwrap_or(0)
    };
    let (owner, index, term, len) = (word(5), word(13), word(21), word(29));
    if owner != group.0 {
        return Err(corrupt(group, &format!("holds group {owner}")));
    }
    let u32_at = |b: &[u8], at: usize| {
        b.get(at..at + 4)
            .and_then(|b| b.try_into().ok())
            .map(u32::from_be_bytes)
            .unwrap_or(0)
    };
    let (covered, members_len, header_len) = if with_members {
        let long = bytes
            .get(..HEADER_MEMBERS)
            .ok_or_else(|| corrupt(group, "shorter than its header"))?;
        (&long[..41], u32_at(long, 37) as usize, HEADER_MEMBERS)
    } else {
        (&header[..37], 0, HEADER)
    };
    let expected = u32_at(&bytes, header_len - 4);
    let members_end = header_len
        .checked_add(members_len)
        .filter(|end| *end <= bytes.len())
        .ok_or_else(|| corrupt(group, "members cut short"))?;
    let members = bytes.slice(header_len..members_end);
    let data = bytes.slice(members_end..);
    if data.len() as u64 != len {
        return Err(corrupt(group, "length does not match"));
    }
    let mut crc = crc32fast::Hasher::new();
    crc.update(covered);
    crc.update(&members);
    crc.update(&data);
    if crc.finalize() != expected {
        return Err(corrupt(group, "checksum does not match"));
    }
    let members = if with_members {
        Some(decode_members(group, &members)?)
    } else {
        None
    };
    Ok(StoredSnapshot {
        meta: SnapshotMeta { index, term },
        data,
        members,
    })
}

/// Snapshots kept in memory, for tests: shared by the log that saves them and the groups that
/// read them back.
#[derive(Debug, Default, Clone)]
pub struct MemSnapshots(
    std::sync::Arc<std::sync::Mutex<std::collections::BTreeMap<u64, StoredSnapshot>>>,
);

impl MemSnapshots {
    pub fn save(&self, group: GroupId, snap: &StoredSnapshot) {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(group.0, snap.clone());
    }

    pub fn get(&self, group: GroupId) -> Option<StoredSnapshot> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&group.0)
            .cloned()
    }

    pub fn remove(&self, group: GroupId) {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&group.0);
    }
}

impl SnapshotSource for MemSnapshots {
    fn load(&self, group: u64) -> Result<Option<StoredSnapshot>, String> {
        Ok(self.get(GroupId(group)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap(index: u64, data: &'static [u8]) -> StoredSnapshot {
        StoredSnapshot {
            meta: SnapshotMeta { index, term: 3 },
            data: Bytes::from_static(data),
            members: None,
        }
    }

    /// Every truncation and every flipped byte of the group's good file `good` reads as an error.
    fn every_damage_is_an_error(files: &SnapshotFiles, group: GroupId, good: &[u8]) {
        let path = files.path(group);
        for cut in 0..good.len() {
            std::fs::write(&path, &good[..cut]).expect("write");
            assert!(files.read(group).is_err(), "cut at {cut}");
        }
        for at in 0..good.len() {
            let mut bad = good.to_vec();
            bad[at] ^= 0x40;
            std::fs::write(&path, &bad).expect("write");
            assert!(files.read(group).is_err(), "flipped byte {at}");
        }
    }

    fn with_members(index: u64, data: &'static [u8]) -> StoredSnapshot {
        StoredSnapshot {
            members: Some(Members {
                voters: vec![1, 2, 4],
                learners: vec![5],
            }),
            ..snap(index, data)
        }
    }

    #[test]
    fn members_are_kept_in_the_file_and_a_file_without_them_reads_as_before() {
        let dir = tempfile::tempdir().expect("dir");
        let files = SnapshotFiles::open(dir.path()).expect("open");
        files
            .save(GroupId(3), &with_members(12, b"state at 12"))
            .expect("save");
        files.save(GroupId(4), &snap(7, b"plain")).expect("save");
        assert_eq!(
            files.read(GroupId(3)).expect("read"),
            Some(with_members(12, b"state at 12"))
        );
        assert_eq!(
            files.read(GroupId(4)).expect("read"),
            Some(snap(7, b"plain"))
        );
        // Without members the file is version 1, as an earlier version wrote and reads it.
        let plain = std::fs::read(files.path(GroupId(4))).expect("file");
        assert_eq!(plain[4], 1);
        assert_eq!(plain.len(), HEADER + 5);
        let path = files.path(GroupId(3));
        let good = std::fs::read(&path).expect("read");
        assert_eq!(good[4], 2);
        every_damage_is_an_error(&files, GroupId(3), &good);
    }

    #[test]
    fn a_large_snapshot_is_mapped_reads_back_the_same_and_outlives_its_replacement() {
        let dir = tempfile::tempdir().expect("dir");
        let files = SnapshotFiles::open(dir.path()).expect("open");
        let data: Vec<u8> = (0..(MAP_FROM as usize + 4099))
            .map(|i| (i * 7) as u8)
            .collect();
        let big = StoredSnapshot {
            meta: SnapshotMeta { index: 40, term: 2 },
            data: Bytes::from(data.clone()),
            members: Some(Members::voters(vec![1, 2, 3])),
        };
        files.save(GroupId(9), &big).expect("save");
        let read = files.read(GroupId(9)).expect("read").expect("a snapshot");
        assert_eq!(read, big);
        // Its pages were let go after the checksum: read again, they are the file's bytes.
        assert_eq!(&read.data[..], &data[..]);
        // A newer snapshot replaces the file; the one read keeps the bytes it was read with,
        // and the group reads the new one.
        files
            .save(GroupId(9), &snap(50, b"small again"))
            .expect("save");
        assert_eq!(&read.data[..], &data[..]);
        assert_eq!(
            files.read(GroupId(9)).expect("read"),
            Some(snap(50, b"small again"))
        );
        // Deleted while mapped: still readable through the mapping.
        files.save(GroupId(10), &big).expect("save");
        let kept = files.read(GroupId(10)).expect("read").expect("a snapshot");
        files.remove(GroupId(10)).expect("remove");
        assert_eq!(&kept.data[..], &data[..]);

        // Damage to a mapped file is found as in a read one: a flipped byte far into the
        // data, and a file cut short.
        files.save(GroupId(11), &big).expect("save");
        let path = files.path(GroupId(11));
        let good = std::fs::read(&path).expect("file");
        let mut bad = good.clone();
        bad[good.len() / 2] ^= 0x01;
        std::fs::write(&path, &bad).expect("write");
        assert!(files.read(GroupId(11)).is_err(), "a flipped byte");
        std::fs::write(&path, &good[..good.len() - 1]).expect("write");
        assert!(files.read(GroupId(11)).is_err(), "cut short");
        std::fs::write(&path, &good).expect("write");
        assert_eq!(files.read(GroupId(11)).expect("read"), Some(big));
    }

    #[test]
    fn a_saved_snapshot_reads_back_and_a_newer_one_replaces_it() {
        let dir = tempfile::tempdir().expect("dir");
        let files = SnapshotFiles::open(dir.path()).expect("open");
        assert_eq!(files.read(GroupId(7)).expect("read"), None);
        files
            .save(GroupId(7), &snap(10, b"state at 10"))
            .expect("save");
        files
            .save(GroupId(7), &snap(20, b"state at 20"))
            .expect("save");
        files.save(GroupId(8), &snap(5, b"other")).expect("save");
        let files = SnapshotFiles::open(dir.path()).expect("reopen");
        assert_eq!(
            files.read(GroupId(7)).expect("read"),
            Some(snap(20, b"state at 20"))
        );
        files.remove(GroupId(7)).expect("remove");
        assert_eq!(files.read(GroupId(7)).expect("read"), None);
        assert_eq!(files.load(8).expect("load").map(|s| s.meta.index), Some(5));
    }

    #[test]
    fn a_damaged_file_is_an_error_never_a_wrong_state() {
        let dir = tempfile::tempdir().expect("dir");
        let files = SnapshotFiles::open(dir.path()).expect("open");
        files.save(GroupId(1), &snap(10, b"state")).expect("save");
        let path = files.path(GroupId(1));
        let good = std::fs::read(&path).expect("read");
        every_damage_is_an_error(&files, GroupId(1), &good);
        // Another group's file under this group's name.
        files.save(GroupId(2), &snap(10, b"state")).expect("save");
        std::fs::copy(files.path(GroupId(2)), &path).expect("copy");
        assert!(files.read(GroupId(1)).is_err());
    }

    #[test]
    fn an_interrupted_write_leaves_the_old_snapshot() {
        let dir = tempfile::tempdir().expect("dir");
        let files = SnapshotFiles::open(dir.path()).expect("open");
        files.save(GroupId(1), &snap(10, b"old")).expect("save");
        std::fs::write(files.path(GroupId(1)).with_extension("tmp"), b"WSNP half").expect("tmp");
        let files = SnapshotFiles::open(dir.path()).expect("reopen");
        assert_eq!(
            files.read(GroupId(1)).expect("read"),
            Some(snap(10, b"old"))
        );
        let left: Vec<_> = std::fs::read_dir(dir.path()).expect("dir").collect();
        assert_eq!(left.len(), 1, "the torn file is gone");
    }

    #[test]
    fn a_snapshot_larger_than_a_sync_step_is_staged_in_steps_and_reads_back_whole() {
        let dir = tempfile::tempdir().expect("dir");
        let files = SnapshotFiles::open(dir.path()).expect("open");
        let data: Vec<u8> = (0..SYNC_EVERY * 2 + 5).map(|i| (i % 241) as u8).collect();
        let big = StoredSnapshot {
            meta: SnapshotMeta { index: 9, term: 2 },
            data: data.into(),
            members: None,
        };
        let staged = files.stage(GroupId(4), 1, &big).expect("stage");
        files.publish(GroupId(4), &staged).expect("publish");
        assert_eq!(files.read(GroupId(4)).expect("read"), Some(big));
        assert_eq!(files.index_on_disk(GroupId(4)), Some(9));
        assert_eq!(files.index_on_disk(GroupId(5)), None);
    }

    /// A snapshot streamed in chunks, its first bytes given last, makes the file `stage` makes
    /// of the same bytes whole; one whose maker fails leaves nothing behind.
    #[test]
    fn a_streamed_snapshot_is_the_same_file_and_a_failed_one_leaves_none() {
        let dir = tempfile::tempdir().expect("dir");
        let files = SnapshotFiles::open(dir.path()).expect("open");
        let big: Vec<u8> = (0..SYNC_EVERY + 3_000_017)
            .map(|i| (i % 251) as u8)
            .collect();
        let members = Members {
            voters: vec![1, 2, 3],
            learners: vec![4],
        };
        for (seq, (data, members)) in [
            (&b"hello"[..], None),
            (&b"hello"[..], Some(members.clone())),
            (&big[..], Some(members)),
        ]
        .into_iter()
        .enumerate()
        {
            let seq = seq as u64;
            let whole = StoredSnapshot {
                meta: SnapshotMeta { index: 40, term: 3 },
                data: Bytes::copy_from_slice(data),
                members: members.clone(),
            };
            let staged = files.stage(GroupId(6), seq * 2, &whole).expect("stage");
            let (streamed, len) = files
                .stage_stream(
                    GroupId(6),
                    seq * 2 + 1,
                    whole.meta,
                    members.as_ref(),
                    2,
                    |sink| {
                        for chunk in data[2..].chunks(70_001) {
                            sink(chunk)?;
                        }
                        Ok(data[..2].to_vec())
                    },
                )
                .expect("streamed");
            assert_eq!(len, data.len() as u64);
            assert!(
                std::fs::read(&staged).expect("staged")
                    == std::fs::read(&streamed).expect("streamed"),
                "the same file for {} bytes",
                data.len()
            );
            files.publish(GroupId(6), &streamed).expect("publish");
            assert_eq!(files.read(GroupId(6)).expect("read"), Some(whole));
            files.discard(&staged);
        }
        let failed = files.stage_stream(GroupId(6), 9, SnapshotMeta::default(), None, 2, |sink| {
            sink(b"part")?;
            Err("cannot read a message back".to_owned())
        });
        assert!(
            matches!(&failed, Err(LogError::Unmade(e)) if e.contains("cannot read")),
            "{failed:?}"
        );
        let short = files.stage_stream(GroupId(6), 10, SnapshotMeta::default(), None, 2, |_| {
            Ok(vec![1])
        });
        assert!(matches!(short, Err(LogError::Unmade(_))), "{short:?}");
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            files.stage_stream(GroupId(6), 11, SnapshotMeta::default(), None, 2, |sink| {
                sink(b"part")?;
                panic!("a bug while encoding the state")
            })
        }));
        assert!(panicked.is_err());
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .expect("dir")
            .filter_map(|e| e.ok())
            .map(|e| e.file_name())
            .collect();
        assert_eq!(left.len(), 1, "only the group's snapshot: {left:?}");
    }

    #[test]
    fn a_staged_snapshot_is_the_groups_only_once_published_and_a_crash_leaves_the_old_one() {
        let dir = tempfile::tempdir().expect("dir");
        let files = SnapshotFiles::open(dir.path()).expect("open");
        files.save(GroupId(1), &snap(10, b"old")).expect("save");
        let first = files
            .stage(GroupId(1), 1, &snap(20, b"at 20"))
            .expect("stage");
        let second = files
            .stage(GroupId(1), 2, &with_members(30, b"at 30"))
            .expect("stage");
        assert_ne!(
            first, second,
            "overlapping writes of one group have files of their own"
        );
        assert_eq!(
            files.read(GroupId(1)).expect("read"),
            Some(snap(10, b"old")),
            "staged is not the group's yet"
        );
        files.publish(GroupId(1), &second).expect("publish");
        files.discard(&first);
        assert_eq!(
            files.read(GroupId(1)).expect("read"),
            Some(with_members(30, b"at 30"))
        );
        // A crash between the write and the rename: the staged file goes at the next open.
        files
            .stage(GroupId(1), 3, &snap(40, b"at 40"))
            .expect("stage");
        let files = SnapshotFiles::open(dir.path()).expect("reopen");
        assert_eq!(
            files.read(GroupId(1)).expect("read").map(|s| s.meta.index),
            Some(30)
        );
        let left: Vec<_> = std::fs::read_dir(dir.path()).expect("dir").collect();
        assert_eq!(left.len(), 1, "only the group's snapshot is left");
    }

    /// Asks until the reader has an answer other than Pending.
    fn fetched(r: &SnapshotReader, group: u64, at_least: u64) -> Fetch {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            match r.fetch(group, at_least) {
                Fetch::Pending => {
                    assert!(std::time::Instant::now() < deadline, "never read");
                    std::thread::sleep(std::time::Duration::from_millis(2));
                }
                got => return got,
            }
        }
    }

    #[test]
    fn a_reader_reads_on_its_own_thread_keeps_a_snapshot_while_asked_and_reads_a_newer_one() {
        let dir = tempfile::tempdir().expect("dir");
        let files = SnapshotFiles::open(dir.path()).expect("open");
        files.save(GroupId(1), &snap(10, b"at 10")).expect("save");
        let r = SnapshotReader::start(files.clone()).expect("reader");
        assert!(
            matches!(r.fetch(1, 10), Fetch::Pending),
            "the first ask starts the read"
        );
        assert!(matches!(fetched(&r, 1, 10), Fetch::Ready(s) if s == snap(10, b"at 10")));
        // Handed over and kept: asked again (a transfer still on its way), not read again.
        assert!(matches!(r.fetch(1, 10), Fetch::Ready(s) if s.meta.index == 10));
        files.save(GroupId(1), &snap(20, b"at 20")).expect("save");
        // A newer file on disk: read, not the one kept.
        assert!(matches!(r.fetch(1, 10), Fetch::Pending));
        // Read before the newer one was written, then asked for it: read again.
        assert!(matches!(fetched(&r, 1, 20), Fetch::Ready(s) if s.meta.index == 20));
        // A file older than asked for is handed over all the same, after one read for that
        // index (the caller then asks its state machine for a newer snapshot).
        assert!(matches!(fetched(&r, 1, 30), Fetch::Ready(s) if s.meta.index == 20));
        assert!(matches!(fetched(&r, 2, 0), Fetch::Missing));
        // A group removed: what was read for it is not handed to a group made under its number.
        assert!(matches!(r.fetch(1, 0), Fetch::Ready(_)));
        r.forget(1);
        assert!(
            matches!(r.fetch(1, 0), Fetch::Pending),
            "read again, not the old read"
        );
        std::fs::write(files.path(GroupId(3)), b"WSNP damaged").expect("write");
        assert!(matches!(fetched(&r, 3, 0), Fetch::Failed(_)));
    }
}
