//! The Raft thread: owns the node's `MultiRaft` and its `EngineLog` and runs them pass by pass.
//! A pass steps every batch that arrived, applies every queued command, ticks when a tick is
//! due, then takes one `ready`: its messages go out at once, its state is written with one
//! write and (when needed) one fsync, and `advance` releases the messages that waited for it
//! and the committed entries, which go to [`RaftEvents`] with the pass's leader changes and
//! refused proposals.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TryRecvError};
use warren_replication::raft::eraftpb::MessageType;
use warren_replication::{
    EngineLog, Envelope, Error, Forward, GroupId, LogStore, Members, MultiRaft, NodeBatch, NodeId,
    SnapshotFiles, SnapshotMeta, StoredSnapshot,
};

use super::transport::{Budget, Outbound, Queued, INBOUND_QUEUE};
use super::{Prepared, Preparer, RaftEvents, MAX_PROPOSAL};

/// What a [`super::RaftNode`] asks of the Raft thread.
pub(crate) enum Command {
    /// A group, its creator standing for its leader or not, and the voters it starts with
    /// (`None`: the list's nodes, or the cluster's nodes as last set).
    AddGroup(GroupId, bool, Option<Vec<NodeId>>),
    /// A group this node is being added to ([`MultiRaft::join_group`]).
    JoinGroup(GroupId),
    RemoveGroup(GroupId),
    Propose(GroupId, Vec<u8>),
    /// A proposal that may share an entry with the others of its group taken in the same pass.
    ProposeJoinable(GroupId, Vec<u8>),
    /// A proposal for the leader `NodeId` of the group: sent with the next pass's batches.
    Forward(NodeId, GroupId, Vec<u8>),
    /// The state machine's snapshot of a group: written, then the log before it compacted.
    Snapshot(GroupId, SnapshotMeta, SnapshotBody),
    /// Maintenance mode on or off ([`MultiRaft::set_draining`]).
    Drain(bool),
    /// Hand a group's leadership to a node ([`MultiRaft::transfer_leader`]).
    Transfer(GroupId, NodeId),
    /// The cluster's nodes changed: every group moves to them ([`MultiRaft::set_members`]),
    /// and the nodes not among them are no peers any more; with the addresses of the nodes
    /// the list lacks.
    Members(Vec<NodeId>, Vec<(NodeId, String)>),
    /// A group's voters of its own ([`MultiRaft::set_group_voters`]).
    GroupVoters(GroupId, Option<Vec<NodeId>>),
    /// How many groups led here do not have the cluster's nodes yet
    /// ([`MultiRaft::changing_members`]).
    Changing(tokio::sync::oneshot::Sender<usize>),
    /// Every group's state, for metrics ([`MultiRaft::status`]).
    Status(tokio::sync::oneshot::Sender<Vec<warren_replication::GroupStatus>>),
    Shutdown,
}

enum Woke {
    Command(Command),
    Batch(Queued),
    Staged(Staged),
    Closed,
    /// The writer thread or the transport is gone: its channel would be ready for ever.
    WriterGone,
    InboundGone,
    Nothing,
}

/// What makes a snapshot's bytes on the writer thread, straight into its file: given a sink,
/// it hands it every byte but the first `prefix`, and returns those (see
/// `SnapshotFiles::stage_stream`).
pub type StreamSnapshot =
    Box<dyn FnOnce(&mut dyn FnMut(&[u8]) -> Result<(), String>) -> Result<Vec<u8>, String> + Send>;

/// A snapshot's bytes, or what makes them on the writer thread.
pub enum SnapshotBody {
    Ready(bytes::Bytes),
    /// Encodes the state: a deep queue's machine is copied under the node's lock (its
    /// bodies shared) and written out here, which takes several times longer, a chunk at a
    /// time, so that its bytes (up to a GiB) are never in memory whole.
    Stream {
        prefix: usize,
        write: StreamSnapshot,
    },
}

/// What the writer thread is handed: a snapshot whose bytes may still have to be made.
pub(crate) struct Pending {
    meta: SnapshotMeta,
    members: Option<warren_replication::Members>,
    body: SnapshotBody,
    /// A leader's snapshot this node received, held back from Raft until it is on disk.
    received: bool,
}

impl Pending {
    /// Writes the snapshot to a file of its own (`SnapshotFiles::stage`): its length and the
    /// file, and, for a leader's snapshot received, what `preparer` made of it.
    fn stage(
        self,
        files: &SnapshotFiles,
        group: GroupId,
        seq: u64,
        preparer: Option<&Preparer>,
    ) -> (usize, Result<std::path::PathBuf, String>, Option<Prepared>) {
        match self.body {
            SnapshotBody::Ready(data) => {
                let snap = StoredSnapshot {
                    meta: self.meta,
                    data,
                    members: self.members,
                };
                let file = files.stage(group, seq, &snap).map_err(|e| e.to_string());
                let prepared = match (self.received, &file, preparer) {
                    (true, Ok(_), Some(p)) => Some(p(group, snap.data.clone())),
                    _ => None,
                };
                (snap.data.len(), file, prepared)
            }
            SnapshotBody::Stream { prefix, write } => {
                match files.stage_stream(
                    group,
                    seq,
                    self.meta,
                    self.members.as_ref(),
                    prefix,
                    write,
                ) {
                    Ok((file, len)) => (usize::try_from(len).unwrap_or(usize::MAX), Ok(file), None),
                    Err(e) => (0, Err(format!("cannot encode it: {e}")), None),
                }
            }
        }
    }
}

/// A snapshot the writer thread has on disk beside the group's, not yet the group's.
pub(crate) struct Staged {
    group: GroupId,
    seq: u64,
    meta: SnapshotMeta,
    received: bool,
    /// What the preparer made of a leader's snapshot it wrote.
    prepared: Option<Prepared>,
    bytes: usize,
    started: Instant,
    file: Result<std::path::PathBuf, String>,
}

/// The thread that writes and fsyncs the state machine's snapshots, so that a deep queue's
/// (tens of MB, tens to hundreds of milliseconds) does not hold up every group's ticks,
/// heartbeats and appends on the Raft thread. The Raft thread then only renames the file
/// into place, records it and compacts the log: cheap, and in order with everything else it
/// does to the group. One write per group at a time: a newer snapshot that comes meanwhile
/// waits, replacing any that waited before it, so a slow disk holds at most two of a group's
/// snapshots in memory.
pub(crate) struct SnapshotWriter {
    jobs: Option<Sender<(GroupId, u64, Pending)>>,
    done: Receiver<Staged>,
    files: SnapshotFiles,
    thread: Option<std::thread::JoinHandle<()>>,
    /// Numbers the writes, so that one made for a group that was removed since (its number
    /// may be made again for a new queue) is told apart.
    seq: u64,
    /// Groups with a write in flight, and the snapshot that waits for it to end.
    writing: HashSet<GroupId>,
    waiting: HashMap<GroupId, Pending>,
    /// Groups removed while a write of theirs was in flight: the last write number then.
    removed: HashMap<GroupId, u64>,
}

impl SnapshotWriter {
    /// Starts the thread; [`SnapshotWriter::stop`] ends it.
    /// A leader's snapshot written is also handed to `preparer`, if any.
    pub(crate) fn start(
        node: NodeId,
        files: SnapshotFiles,
        preparer: Option<Preparer>,
    ) -> std::io::Result<Self> {
        let (jobs, todo) = crossbeam_channel::unbounded::<(GroupId, u64, Pending)>();
        let (tell, done) = crossbeam_channel::unbounded();
        let writer = files.clone();
        let thread = std::thread::Builder::new()
            .name(format!("warren-snap-{node}"))
            .spawn(move || {
                for (group, seq, pending) in todo {
                    let started = Instant::now();
                    let (meta, received) = (pending.meta, pending.received);
                    // A panic (a bug in encoding or reading a state) fails this snapshot, not
                    // the thread: every later one would go unwritten.
                    let work = std::panic::AssertUnwindSafe(|| {
                        pending.stage(&writer, group, seq, preparer.as_ref())
                    });
                    let (bytes, file, prepared) =
                        std::panic::catch_unwind(work).unwrap_or_else(|_| {
                            (
                                0,
                                Err("the snapshot writer panicked on it".to_string()),
                                None,
                            )
                        });
                    let staged = Staged {
                        group,
                        seq,
                        meta,
                        received,
                        prepared,
                        bytes,
                        started,
                        file,
                    };
                    if tell.send(staged).is_err() {
                        return;
                    }
                }
            })?;
        Ok(SnapshotWriter {
            jobs: Some(jobs),
            done,
            files,
            thread: Some(thread),
            seq: 0,
            writing: HashSet::new(),
            waiting: HashMap::new(),
            removed: HashMap::new(),
        })
    }

    /// Writes `snap`, now or once the group's write in flight ends.
    /// A leader's snapshot that waits is not replaced by one of this node's own, which it
    /// makes obsolete anyway: a message waits for it.
    /// False if the writer has stopped: nothing will be written.
    fn write(&mut self, group: GroupId, snap: Pending) -> bool {
        if self.jobs.is_none() {
            return false;
        }
        if self.writing.contains(&group) {
            let keep = self
                .waiting
                .get(&group)
                .is_some_and(|w| w.received && !snap.received);
            if !keep {
                self.waiting.insert(group, snap);
            }
            return true;
        }
        self.seq += 1;
        let sent = self
            .jobs
            .as_ref()
            .is_some_and(|jobs| jobs.send((group, self.seq, snap)).is_ok());
        if sent {
            self.writing.insert(group);
        } else {
            tracing::error!(
                group = group.0,
                "the snapshot writer has stopped; the group keeps its log"
            );
            self.jobs = None;
        }
        sent
    }

    /// Write `seq` of `group` ended: the one that waited goes next. True if it was asked for
    /// before the group was removed (its number may be a new queue's by now).
    fn finished(&mut self, group: GroupId, seq: u64) -> bool {
        self.writing.remove(&group);
        let stale = self.removed.remove(&group).is_some_and(|upto| seq <= upto);
        if let Some(next) = self.waiting.remove(&group) {
            self.write(group, next);
        }
        stale
    }

    /// The group is gone: the write in flight for it, if any, is dropped when it ends.
    fn removed(&mut self, group: GroupId) {
        self.waiting.remove(&group);
        if self.writing.contains(&group) {
            self.removed.insert(group, self.seq);
        }
    }

    /// Lets the write in flight finish, then ends the thread.
    fn stop(&mut self) {
        self.jobs = None;
        self.waiting.clear();
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                tracing::error!("the snapshot writer panicked");
            }
        }
    }
}

/// Commands taken per pass at most, so one pass (and its fsync) stays bounded.
const MAX_COMMANDS_PER_PASS: usize = 8192;

/// How long a group's proposals wait at most for the commit of its last write of them
/// ([`Driver::awaits`]): a group without a majority must not hold them for ever.
const COMMIT_WAIT_MAX: Duration = Duration::from_millis(5);

/// A joined entry ([`warren_replication::batch`]) holds at most this many bytes of
/// proposals, and this many proposals: the unit a follower far behind is sent, and what
/// [`warren_replication::Config::log_keep_bytes`] keeps in memory, stay a few entries.
const JOIN_BYTES: usize = 128 << 10;
const JOIN_PARTS: usize = 1024;

/// A proposal larger than this goes in an entry of its own.
const JOIN_PART_MAX: usize = 32 << 10;

pub(crate) struct Driver<E> {
    pub(crate) raft: MultiRaft,
    pub(crate) log: EngineLog,
    pub(crate) events: E,
    pub(crate) out: Outbound,
    pub(crate) commands: Receiver<Command>,
    pub(crate) inbound: Receiver<Queued>,
    pub(crate) inbound_budget: Arc<Budget>,
    pub(crate) epoch: Instant,
    pub(crate) refused: Vec<(GroupId, Vec<u8>, Option<NodeId>)>,
    /// Joinable proposals taken since the last pass, in order: joined per group at its start.
    pub(crate) joining: Vec<(GroupId, Vec<u8>)>,
    /// Proposals to send to other nodes, by destination; and what other nodes sent here.
    pub(crate) to_forward: std::collections::BTreeMap<NodeId, Vec<Forward>>,
    pub(crate) forwarded: Vec<(NodeId, Forward)>,
    /// Snapshots for the broker at the next pass: the recovered ones at first.
    pub(crate) snapshots: Vec<(GroupId, StoredSnapshot)>,
    pub(crate) writer: SnapshotWriter,
    /// Leaders' snapshots being written before Raft is given them, by group.
    pub(crate) receiving: HashMap<GroupId, Held>,
    /// What the preparer made of leaders' snapshots given to Raft, until they are installed.
    pub(crate) prepared: HashMap<GroupId, (SnapshotMeta, Instant, Prepared)>,
    pub(crate) counters: Arc<super::transport::Counters>,
    pub(crate) stopping: bool,
    /// Groups led here whose last write of proposals is not committed yet: the index it ended
    /// at, and until when their next proposals wait for it ([`Driver::awaits`]).
    pub(crate) awaiting: HashMap<GroupId, (u64, Instant)>,
    /// Proposals waiting for their group's last write to commit, in the order they came; and
    /// their groups.
    pub(crate) deferred: std::collections::VecDeque<(GroupId, Command)>,
    pub(crate) deferring: std::collections::HashSet<GroupId>,
    /// Groups proposed to since the last pass.
    pub(crate) proposed: std::collections::HashSet<GroupId>,
    /// The last pass's writes, by group (its last index).
    pub(crate) written: Vec<(GroupId, u64)>,
}

/// The parts of one pass that can hold every group up: Raft's ready, the log write (with its
/// fsync), Raft's advance, and the broker's work on what the pass committed.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct PassParts {
    ready: Duration,
    write: Duration,
    advance: Duration,
    apply: Duration,
}

/// A leader's snapshot message, held back until the writer thread has its data on disk.
pub(crate) struct Held {
    from: NodeId,
    boot: u64,
    env: Envelope,
    since: Instant,
}

/// The snapshot a leader's MsgSnapshot carries, as this node saves it (the members its
/// metadata names; its data shared, not copied).
fn carried(env: &Envelope) -> StoredSnapshot {
    let s = env.msg.get_snapshot();
    let md = s.get_metadata();
    StoredSnapshot {
        meta: SnapshotMeta {
            index: md.index,
            term: md.term,
        },
        data: s.data.clone(),
        members: Some(Members::from_conf_state(md.get_conf_state())),
    }
}

/// A snapshot held for the writer this long goes to Raft without it.
const HELD_MAX: Duration = Duration::from_secs(120);

/// A leader's snapshot larger than this is written to disk on the writer thread before Raft
/// is given it; Raft then only renames the file into place. Written on the Raft thread, a
/// deep queue's (up to a GiB, seconds to write and fsync) held up every group of the node,
/// those it leads included.
pub(crate) const STAGE_RECEIVED_ABOVE: usize = 1 << 20;

/// A staged snapshot Raft did not take within this time is removed.
const PRESTAGED_MAX_AGE: Duration = Duration::from_secs(30);

impl<E: RaftEvents> Driver<E> {
    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    pub(crate) fn run(mut self) {
        let node = self.raft.node();
        tracing::info!(
            node,
            groups = self.raft.group_count(),
            "raft thread started"
        );
        while !self.stopping {
            self.wait();
            let started = Instant::now();
            self.take_input();
            let Some(parts) = self.pass() else {
                break;
            };
            self.await_commits(started);
            slow_pass(node, started.elapsed(), parts);
        }
        self.writer.stop();
        tracing::info!(node, "raft thread stopped");
    }

    /// A group's proposals wait for the commit of its last write of them, made while this node
    /// led it (or for [`COMMIT_WAIT_MAX`]): at most one such write of a group is in flight, and
    /// the next carries everything that came meanwhile. Each write costs every member a few
    /// thread switches and syscalls whatever it holds (its fsync, the appends, each follower's
    /// write and answer). A client that waits for each answer loses nothing: its next proposal
    /// comes after the commit anyway; and other groups' proposals do not wait for this one's.
    fn await_commits(&mut self, started: Instant) {
        let until = started + COMMIT_WAIT_MAX;
        for (group, index) in self.written.drain(..) {
            if self.proposed.contains(&group) && self.raft.is_leader(group) {
                self.awaiting.insert(group, (index, until));
            }
        }
        self.proposed.clear();
    }

    /// Whether the group's proposals wait for its last write's commit now.
    fn awaits(&mut self, group: GroupId) -> bool {
        let Some(&(index, until)) = self.awaiting.get(&group) else {
            return false;
        };
        let waits = Instant::now() < until
            && self.raft.is_leader(group)
            && self.raft.committed_index(group).is_some_and(|c| c < index);
        if !waits {
            self.awaiting.remove(&group);
        }
        waits
    }

    /// The deferred proposals of groups that wait no more (of every group with `all`) are
    /// taken, in the order they came.
    fn release_deferred(&mut self, all: bool) {
        if self.deferred.is_empty() {
            return;
        }
        let groups: Vec<GroupId> = self.deferring.iter().copied().collect();
        let mut go = std::collections::HashSet::new();
        for group in groups {
            if all || !self.awaits(group) {
                go.insert(group);
            }
        }
        if go.is_empty() {
            return;
        }
        let mut kept = std::collections::VecDeque::with_capacity(self.deferred.len());
        for (group, c) in std::mem::take(&mut self.deferred) {
            if go.contains(&group) {
                self.proposed.insert(group);
                self.command_now(c);
            } else {
                kept.push_back((group, c));
            }
        }
        self.deferred = kept;
        self.deferring.retain(|g| !go.contains(g));
    }

    /// Sleeps until input arrives or the next tick is due, unless a pass is due now.
    fn wait(&mut self) {
        let now = self.now_ms();
        let due = self.raft.next_tick_ms().unwrap_or(now);
        if self.raft.has_ready() || due <= now {
            return;
        }
        let mut timeout = Duration::from_millis(due - now);
        if !self.deferred.is_empty() {
            // Deferred proposals go at their group's commit, or when their wait runs out: at
            // once if the pass just made committed a group's write (nothing else may come to
            // wake this: its client may be waiting for that very proposal's answer); else a
            // peer's batch wakes this, or the soonest wait's end.
            let groups: Vec<GroupId> = self.deferring.iter().copied().collect();
            let mut soonest: Option<Instant> = None;
            for group in groups {
                if !self.awaits(group) {
                    return;
                }
                if let Some((_, until)) = self.awaiting.get(&group) {
                    soonest = Some(soonest.map_or(*until, |s| s.min(*until)));
                }
            }
            if let Some(until) = soonest {
                timeout = timeout.min(until.saturating_duration_since(Instant::now()));
            }
        }
        let woke = crossbeam_channel::select! {
            recv(self.commands) -> c => c.map_or(Woke::Closed, Woke::Command),
            recv(self.inbound) -> b => b.map_or(Woke::InboundGone, Woke::Batch),
            recv(self.writer.done) -> s => s.map_or(Woke::WriterGone, Woke::Staged),
            default(timeout) => Woke::Nothing,
        };
        match woke {
            Woke::Command(c) => self.command(c),
            Woke::Batch(q) => self.inbound(q),
            Woke::Staged(s) => self.snapshot_staged(s),
            Woke::WriterGone => {
                tracing::error!(
                    node = self.raft.node(),
                    "the snapshot writer has stopped: groups keep their logs"
                );
                self.writer.done = crossbeam_channel::never();
                self.writer.jobs = None;
                self.release_held(true);
            }
            Woke::InboundGone => self.inbound = crossbeam_channel::never(),
            // Every handle is gone: nobody can use this node any more.
            Woke::Closed => self.stopping = true,
            Woke::Nothing => {}
        }
    }

    fn take_input(&mut self) {
        self.release_deferred(false);
        while let Ok(s) = self.writer.done.try_recv() {
            self.snapshot_staged(s);
        }
        for _ in 0..INBOUND_QUEUE {
            match self.inbound.try_recv() {
                Ok(q) => self.inbound(q),
                Err(_) => break,
            }
        }
        for _ in 0..MAX_COMMANDS_PER_PASS {
            match self.commands.try_recv() {
                Ok(c) => self.command(c),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    self.stopping = true;
                    break;
                }
            }
        }
    }

    /// A batch from a peer: its Raft messages are stepped, its forwarded proposals kept for
    /// the broker (after this pass's committed entries, so it sees the leader changes first).
    fn inbound(&mut self, q: Queued) {
        self.inbound_budget.give(q.bytes);
        if q.lost {
            self.raft.peer_lost(q.batch.from);
            return;
        }
        let mut b = q.batch;
        let from = b.from;
        if !self.raft.is_peer(from) {
            // A node that is no member (one the cluster forgot, still connected, or one that
            // asks to join): nothing it says counts, but for a request to join.
            self.forwarded.extend(
                b.forwards
                    .into_iter()
                    .filter(|f| f.group == super::JOIN_REQUEST)
                    .map(|f| (from, f)),
            );
            return;
        }
        for f in std::mem::take(&mut b.forwards) {
            if f.group == super::JOIN_PEERS {
                self.join_peers(from, &f.data);
                continue;
            }
            if f.group == super::JOIN_REQUEST {
                // A node the cluster added asks again: it does not hold the metadata yet, and
                // the leader of it may be a node it did not list (it refuses those): it is told
                // every node this one knows. The request still goes on to the broker.
                // As `--cluster-nodes` lists them: the joining node reads it as that.
                let list = self
                    .out
                    .peers()
                    .iter()
                    .map(|(node, addr)| format!("{node}={addr}"))
                    .collect::<Vec<_>>()
                    .join(",");
                self.to_forward.entry(from).or_default().push(Forward {
                    group: super::JOIN_PEERS,
                    data: list.into_bytes().into(),
                });
            }
            self.forwarded.push((from, f));
        }
        if !self.receiving.is_empty() {
            // While a group's snapshot is written ahead, the leader's appends would only be
            // refused, and each refusal has it send the whole snapshot again.
            let receiving = &self.receiving;
            b.msgs.retain(|env| {
                env.msg.get_msg_type() != MessageType::MsgAppend
                    || receiving.get(&env.group).is_none_or(|h| h.from != from)
            });
        }
        if b.msgs.iter().any(is_large_snapshot) {
            let (large, rest): (Vec<_>, Vec<_>) = std::mem::take(&mut b.msgs)
                .into_iter()
                .partition(is_large_snapshot);
            b.msgs = rest;
            let boot = b.boot;
            self.raft.step(b);
            for env in large {
                self.receive_snapshot(from, boot, env);
            }
            return;
        }
        self.raft.step(b);
    }

    /// A leader's large snapshot goes to the writer thread first; Raft is given it once it is
    /// on disk ([`Driver::received_staged`]). While one of a group is held, others of the
    /// group are dropped (the leader sends again what the follower still lacks once the first
    /// is installed: replacing it could go on for as long as the leader snapshots faster than
    /// this node writes). One this node's log is past already goes to Raft at once, which
    /// refuses it cheaply. With no writer left, Raft writes it.
    fn receive_snapshot(&mut self, from: NodeId, boot: u64, env: Envelope) {
        let group = env.group;
        if self.receiving.contains_key(&group) {
            return;
        }
        let snap = carried(&env);
        if self
            .raft
            .committed_index(group)
            .is_none_or(|have| have >= snap.meta.index)
        {
            self.raft.step_held(from, boot, env);
            return;
        }
        tracing::debug!(
            node = self.raft.node(),
            group = group.0,
            index = snap.meta.index,
            bytes = snap.data.len(),
            "writing a leader's snapshot before installing it"
        );
        let queued = self.writer.write(
            group,
            Pending {
                meta: snap.meta,
                members: snap.members,
                body: SnapshotBody::Ready(snap.data),
                received: true,
            },
        );
        if !queued {
            self.raft.step_held(from, boot, env);
            return;
        }
        self.receiving.insert(
            group,
            Held {
                from,
                boot,
                env,
                since: Instant::now(),
            },
        );
    }

    /// The writer thread wrote a leader's snapshot: Raft is given the message that brought it,
    /// and finds its file ready when it saves it. One that failed to be written is given to
    /// Raft all the same (it is written there, the slow way).
    fn received_staged(&mut self, s: Staged, stale: bool) {
        let group = s.group;
        let held = match self.receiving.get(&group) {
            Some(h) if carried(&h.env).meta == s.meta && !stale => self.receiving.remove(&group),
            _ => None,
        };
        let Some(h) = held else {
            if let Ok(file) = &s.file {
                self.writer.files.discard(file);
            }
            return;
        };
        let snap = carried(&h.env);
        let node = self.raft.node();
        if !self.raft.step_held(h.from, h.boot, h.env) {
            tracing::debug!(
                node,
                group = group.0,
                "a leader's snapshot whose sender is down or restarted: dropped"
            );
            if let Ok(file) = &s.file {
                self.writer.files.discard(file);
            }
            return;
        }
        match s.file {
            Ok(file) => {
                self.counters
                    .staged_in
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                self.log.prestage(group, &snap, file);
                if let Some(p) = s.prepared {
                    self.prepared.insert(group, (snap.meta, Instant::now(), p));
                }
            }
            Err(e) => {
                tracing::warn!(node, group = group.0, error = %e, "cannot write a leader's snapshot ahead; Raft writes it");
            }
        }
    }

    /// Gives Raft the snapshots held for the writer that it has not answered for
    /// [`HELD_MAX`] (a disk that slow, or no writer any more: `all`). Raft writes them itself.
    fn release_held(&mut self, all: bool) {
        let late: Vec<GroupId> = self
            .receiving
            .iter()
            .filter(|(_, h)| all || h.since.elapsed() >= HELD_MAX)
            .map(|(g, _)| *g)
            .collect();
        for group in late {
            if let Some(h) = self.receiving.remove(&group) {
                tracing::warn!(
                    node = self.raft.node(),
                    group = group.0,
                    "a leader's snapshot was not written ahead in time; Raft writes it"
                );
                self.raft.step_held(h.from, h.boot, h.env);
            }
        }
    }

    /// What was written or read ahead for Raft and that it did not take (its log was past the
    /// snapshot already, or a newer one came) goes; so does anything older than
    /// [`PRESTAGED_MAX_AGE`].
    fn drop_unused_prestaged(&mut self) {
        let raft = &self.raft;
        let used = |group: GroupId, index: u64| {
            raft.committed_index(group).is_none_or(|have| have >= index)
        };
        if self.log.prestaged_counts().0 > 0 {
            self.log.drop_prestaged(PRESTAGED_MAX_AGE, used);
        }
        self.prepared.retain(|group, (meta, at, _)| {
            at.elapsed() < PRESTAGED_MAX_AGE && !used(*group, meta.index)
        });
    }

    fn command(&mut self, c: Command) {
        match &c {
            Command::Propose(group, _) | Command::ProposeJoinable(group, _) => {
                let group = *group;
                if self.deferring.contains(&group) || self.awaits(group) {
                    self.deferring.insert(group);
                    self.deferred.push_back((group, c));
                    return;
                }
                self.proposed.insert(group);
            }
            // A group's commands keep their order when its leader changes under them.
            Command::Forward(_, group, _) => {
                if self.deferring.contains(group) {
                    self.release_deferred(true);
                }
            }
            // Anything else keeps its place after the proposals that came before it.
            _ => self.release_deferred(true),
        }
        self.command_now(c);
    }

    fn command_now(&mut self, c: Command) {
        let c = match c {
            Command::ProposeJoinable(group, data) if data.len() <= JOIN_PART_MAX => {
                self.joining.push((group, data));
                return;
            }
            Command::ProposeJoinable(group, data) => Command::Propose(group, data),
            other => other,
        };
        // Anything else keeps its place after the proposals taken before it.
        self.flush_joining();
        match c {
            Command::Status(reply) => {
                // The asker may have given up waiting: nothing to do then.
                let _ = reply.send(self.raft.status());
            }
            Command::AddGroup(group, campaign, voters) => {
                let made = match voters {
                    Some(v) => self.raft.add_group_with(group, v, campaign),
                    None => self.raft.add_group(group, campaign),
                };
                self.group_made(group, made);
            }
            Command::JoinGroup(group) => {
                let made = self.raft.join_group(group);
                self.group_made(group, made);
            }
            Command::Changing(reply) => {
                let _ = reply.send(self.raft.changing_members());
            }
            Command::RemoveGroup(group) => {
                self.writer.removed(group);
                self.receiving.remove(&group);
                self.prepared.remove(&group);
                if self.raft.remove_group(group) {
                    if let Err(e) = self.log.remove_group(group) {
                        tracing::error!(node = self.raft.node(), group = group.0, error = %e, "cannot remove a raft group's log");
                    }
                }
            }
            Command::Propose(group, data) | Command::ProposeJoinable(group, data) => {
                self.propose(group, data)
            }
            Command::Forward(to, group, data) => {
                self.to_forward.entry(to).or_default().push(Forward {
                    group,
                    data: data.into(),
                });
            }
            Command::Snapshot(group, meta, body) => self.save_snapshot(group, meta, body),
            Command::Drain(on) => self.raft.set_draining(on),
            Command::Members(voters, addresses) => {
                self.out.set_peers(&voters, &addresses);
                self.raft.set_peers(&voters);
                self.raft.set_members(voters);
            }
            Command::GroupVoters(group, voters) => self.raft.set_group_voters(group, voters),

            Command::Transfer(group, to) => {
                if !self.raft.transfer_leader(group, to) {
                    tracing::debug!(group = group.0, to, "leadership transfer not started");
                }
            }
            Command::Shutdown => self.stopping = true,
        }
    }

    fn propose(&mut self, group: GroupId, data: Vec<u8>) {
        if data.len() > MAX_PROPOSAL {
            tracing::warn!(
                node = self.raft.node(),
                group = group.0,
                bytes = data.len(),
                "proposal too large to replicate"
            );
            let leader = self.raft.leader_of(group);
            self.refused.push((group, data, leader));
            return;
        }
        if let Err(r) = self.raft.try_propose(group, data) {
            let leader = match r.error {
                Error::NotLeader { leader, .. } => leader,
                Error::NoGroup(_) => None,
                ref e => {
                    tracing::warn!(node = self.raft.node(), group = group.0, error = %e, "raft dropped a proposal");
                    self.raft.leader_of(group)
                }
            };
            self.refused.push((group, r.data, leader));
        }
    }

    /// Proposes the joinable proposals taken since the last call: those of one group in as
    /// few entries as [`JOIN_BYTES`] and [`JOIN_PARTS`] allow, each group's in the order they
    /// came (groups' logs are apart: their order between groups means nothing).
    fn flush_joining(&mut self) {
        if self.joining.is_empty() {
            return;
        }
        let mut by_group: std::collections::BTreeMap<GroupId, Vec<Vec<u8>>> =
            std::collections::BTreeMap::new();
        for (group, data) in self.joining.drain(..) {
            by_group.entry(group).or_default().push(data);
        }
        for (group, list) in by_group {
            let mut chunk: Vec<Vec<u8>> = Vec::new();
            let mut size = warren_replication::batch::overhead(0);
            for data in list {
                let add = data.len() + warren_replication::batch::overhead(1)
                    - warren_replication::batch::overhead(0);
                if !chunk.is_empty() && (size + add > JOIN_BYTES || chunk.len() >= JOIN_PARTS) {
                    self.propose_joined(group, std::mem::take(&mut chunk));
                    size = warren_replication::batch::overhead(0);
                }
                size += add;
                chunk.push(data);
            }
            self.propose_joined(group, chunk);
        }
    }

    fn propose_joined(&mut self, group: GroupId, mut parts: Vec<Vec<u8>>) {
        if parts.len() > 1 {
            match warren_replication::batch::join(&parts) {
                Ok(joined) => {
                    self.counters
                        .joined_parts
                        .fetch_add(parts.len() as u64, std::sync::atomic::Ordering::Relaxed);
                    self.counters
                        .joined_entries
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    return self.propose(group, joined);
                }
                Err(e) => {
                    tracing::warn!(node = self.raft.node(), group = group.0, error = %e, "proposals not joined");
                }
            }
        }
        for data in parts.drain(..) {
            self.propose(group, data);
        }
    }

    /// A member's peers ([`super::JOIN_PEERS`]), taken while this node joins: it links with
    /// them too (its own list wins for a node in both), so the metadata group's leader is not
    /// refused. Nothing is removed: the metadata, once here, sets the cluster's nodes.
    fn join_peers(&mut self, from: NodeId, data: &[u8]) {
        if !self.out.joining() {
            return;
        }
        let Some(list) = std::str::from_utf8(data)
            .ok()
            .and_then(|text| crate::config::parse_cluster_nodes(text).ok())
        else {
            return;
        };
        let me = self.raft.node();
        let listed: Vec<(NodeId, String)> = list
            .into_iter()
            .filter(|(node, _)| *node != me)
            .map(|(node, addr)| (node, addr.to_string()))
            .collect();
        let known = self.out.peers();
        if listed.iter().all(|(n, _)| known.contains_key(n)) {
            return;
        }
        let mut nodes: Vec<NodeId> = known.keys().copied().collect();
        nodes.extend(listed.iter().map(|(n, _)| *n));
        nodes.push(me);
        nodes.sort_unstable();
        nodes.dedup();
        tracing::info!(
            node = me,
            from,
            ?nodes,
            "joining: linking with the cluster's nodes"
        );
        self.out.set_peers(&nodes, &listed);
        self.raft.set_peers(&nodes);
    }

    /// A group made here, or not (one that exists already is no error: the broker may ask
    /// twice, as at a start).
    fn group_made(&self, group: GroupId, made: Result<(), Error>) {
        match made {
            Ok(()) | Err(Error::GroupExists(_)) => {}
            Err(e) => {
                tracing::error!(node = self.raft.node(), group = group.0, error = %e, "cannot add raft group");
            }
        }
    }

    /// Hands the broker's snapshot of a group to the writer thread; once it is on disk
    /// ([`Driver::snapshot_staged`]) the log before it goes. A snapshot that cannot be
    /// written is no loss: the log it would have replaced stays.
    fn save_snapshot(&mut self, group: GroupId, meta: SnapshotMeta, body: SnapshotBody) {
        let meta = self.raft.snapshot_covering(group, meta);
        if !self.snapshot_is_news(group, meta) {
            return;
        }
        let members = self.raft.members_at(group, meta.index);
        // A writer that stopped said so; the group keeps its log.
        let _ = self.writer.write(
            group,
            Pending {
                meta,
                members,
                body,
                received: false,
            },
        );
    }

    /// The group exists and has no snapshot as recent as `meta` (a leader's newer one may
    /// have been installed meanwhile).
    fn snapshot_is_news(&self, group: GroupId, meta: SnapshotMeta) -> bool {
        matches!(self.raft.snapshot_index(group), Some(have) if have < meta.index)
    }

    /// The writer thread has a snapshot on disk: it becomes the group's, and the log before
    /// it goes, unless the group went or got a newer one meanwhile.
    fn snapshot_staged(&mut self, s: Staged) {
        let node = self.raft.node();
        let group = s.group;
        let stale = self.writer.finished(group, s.seq);
        if s.received {
            self.received_staged(s, stale);
            return;
        }
        let file = match s.file {
            Ok(file) => file,
            Err(e) => {
                tracing::error!(node, group = group.0, error = %e, "cannot write a snapshot; the group keeps its log");
                return;
            }
        };
        // Made for a queue that was deleted since, whose group number a new queue may have.
        if stale || !self.snapshot_is_news(group, s.meta) {
            self.writer.files.discard(&file);
            return;
        }
        if let Err(e) = self.writer.files.publish(group, &file) {
            tracing::error!(node, group = group.0, error = %e, "cannot write a snapshot; the group keeps its log");
            self.writer.files.discard(&file);
            return;
        }
        let Some(bound) = self.raft.snapshot_saved(group, s.meta) else {
            return;
        };
        if let Err(e) = self.log.compact_to(group, bound) {
            tracing::error!(node, group = group.0, error = %e, "cannot compact a group's log");
        }
        tracing::debug!(
            node,
            group = group.0,
            index = s.meta.index,
            bytes = s.bytes,
            compacted_below = bound,
            ms = s.started.elapsed().as_millis() as u64,
            "snapshot written"
        );
    }

    /// One tick (if due), ready, write, advance, report; where its time went. `None` if the
    /// log failed: this node can no longer promise anything and stops.
    fn pass(&mut self) -> Option<PassParts> {
        self.flush_joining();
        let now = self.now_ms();
        let began = Instant::now();
        self.raft.tick(now);
        let mut rd = self.raft.ready();
        let mut parts = PassParts {
            ready: began.elapsed(),
            ..PassParts::default()
        };
        self.refused.append(&mut rd.refused);
        for b in std::mem::take(&mut rd.messages) {
            self.out.send(b);
        }
        let leaders = std::mem::take(&mut rd.leaders);
        let wanted = std::mem::take(&mut rd.snapshots_wanted);
        let peers = std::mem::take(&mut rd.peers);
        let draining = std::mem::take(&mut rd.draining);
        self.written.clear();
        self.written.extend(rd.last_entries());
        let writing = Instant::now();
        let persisted = rd.persist(&mut self.log);
        parts.write = writing.elapsed();
        if let Err(e) = persisted {
            // An fsync that failed cannot be retried safely: stop, and let peers see us down.
            tracing::error!(node = self.raft.node(), error = %e, "raft log write failed; stopping this node's raft");
            self.events.log_failed(&e.to_string());
            return None;
        }
        let (_, used) = self.log.prestaged_counts();
        self.counters
            .staged_used
            .store(used, std::sync::atomic::Ordering::Relaxed);
        let advancing = Instant::now();
        let mut done = self.raft.advance(rd);
        parts.advance = advancing.elapsed();
        for b in std::mem::take(&mut done.messages) {
            self.out.send(b);
        }
        let (node, boot) = (self.raft.node(), self.raft.boot());
        for (to, forwards) in std::mem::take(&mut self.to_forward) {
            self.out.send(NodeBatch {
                from: node,
                boot,
                to,
                draining: self.raft.is_draining(),
                msgs: Vec::new(),
                forwards,
            });
        }
        if !peers.is_empty() {
            self.events.peers(peers);
        }
        if !draining.is_empty() {
            self.events.draining(draining);
        }
        let refused = std::mem::take(&mut self.refused);
        if !leaders.is_empty() || !refused.is_empty() {
            let raft = &self.raft;
            let leaders = leaders
                .into_iter()
                .map(|(g, l)| (g, l, raft.term_of(g).unwrap_or(0)))
                .collect();
            self.events.leaders(leaders, refused);
        }
        if !wanted.is_empty() {
            self.events.snapshots_wanted(wanted);
        }
        self.snapshots.append(&mut done.snapshots);
        if !self.snapshots.is_empty() {
            let prepared = &mut self.prepared;
            let list = std::mem::take(&mut self.snapshots)
                .into_iter()
                .map(|(group, s)| {
                    let p = match prepared.remove(&group) {
                        Some((meta, _, p)) if meta == s.meta => Some(p),
                        _ => None,
                    };
                    (group, s, p)
                })
                .collect();
            self.events.snapshots(list);
        }
        self.drop_unused_prestaged();
        if !self.receiving.is_empty() {
            self.release_held(false);
        }
        let applying = Instant::now();
        if !done.committed.is_empty() {
            self.events.committed(done.committed);
        }
        parts.apply = applying.elapsed();
        if !self.forwarded.is_empty() {
            self.events.forwarded(std::mem::take(&mut self.forwarded));
        }
        Some(parts)
    }
}

/// Says so when one pass held every group of the node up (their heartbeats, appends and
/// commits wait for it): a sign of a slow disk or of work that belongs on another thread.
fn slow_pass(node: NodeId, took: Duration, parts: PassParts) {
    let ms = u64::try_from(took.as_millis()).unwrap_or(u64::MAX);
    let part = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    let (ready_ms, write_ms, advance_ms, apply_ms) = (
        part(parts.ready),
        part(parts.write),
        part(parts.advance),
        part(parts.apply),
    );
    if ms >= SLOW_PASS_WARN_MS {
        tracing::warn!(
            node,
            ms,
            ready_ms,
            write_ms,
            advance_ms,
            apply_ms,
            "slow raft pass: every group of the node waited"
        );
    } else if ms >= SLOW_PASS_DEBUG_MS {
        tracing::debug!(
            node,
            ms,
            ready_ms,
            write_ms,
            advance_ms,
            apply_ms,
            "slow raft pass"
        );
    }
}

/// A pass this long is logged: at debug level, and as a warning from a group's election
/// timeout on (ten ticks of 50 ms: its followers may have started an election meanwhile).
const SLOW_PASS_DEBUG_MS: u64 = 50;
const SLOW_PASS_WARN_MS: u64 = 500;

/// A leader's snapshot whose data is worth writing before Raft has it.
fn is_large_snapshot(env: &Envelope) -> bool {
    env.msg.get_msg_type() == MessageType::MsgSnapshot
        && env.msg.get_snapshot().data.len() > STAGE_RECEIVED_ABOVE
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap(index: u64) -> Pending {
        Pending {
            meta: SnapshotMeta { index, term: 1 },
            members: None,
            body: SnapshotBody::Ready(bytes::Bytes::from(vec![index as u8; 64])),
            received: false,
        }
    }

    fn next(w: &SnapshotWriter) -> Staged {
        w.done
            .recv_timeout(Duration::from_secs(10))
            .expect("the writer reports")
    }

    #[test]
    fn a_stopped_writer_takes_nothing_more_and_says_so() {
        let dir = tempfile::tempdir().expect("dir");
        let files = SnapshotFiles::open(dir.path()).expect("files");
        let mut w = SnapshotWriter::start(1, files, None).expect("writer");
        assert!(w.write(GroupId(7), snap(10)));
        w.stop();
        // A leader's snapshot held for it would wait for ever: the caller gives it to Raft.
        assert!(!w.write(GroupId(7), snap(20)));
        assert!(!w.write(GroupId(8), snap(5)));
    }

    #[test]
    fn a_leaders_snapshot_that_waits_is_not_replaced_by_one_of_the_nodes_own() {
        let dir = tempfile::tempdir().expect("dir");
        let files = SnapshotFiles::open(dir.path()).expect("files");
        let mut w = SnapshotWriter::start(1, files.clone(), None).expect("writer");
        let g = GroupId(7);
        let received = |index| Pending {
            received: true,
            ..snap(index)
        };
        w.write(g, snap(10));
        w.write(g, received(50));
        // Made from what this node applied, older than the leader's: a message waits for the
        // leader's, which must be written.
        w.write(g, snap(20));
        let first = next(&w);
        assert_eq!((first.meta.index, first.received), (10, false));
        assert!(!w.finished(g, first.seq));
        let second = next(&w);
        assert_eq!((second.meta.index, second.received), (50, true));
        assert!(second.file.is_ok());
        // A newer leader's snapshot does replace a waiting one (its message replaces the
        // older one's).
        w.write(g, received(60));
        w.write(g, received(70));
        assert!(!w.finished(g, second.seq));
        let third = next(&w);
        assert_eq!((third.meta.index, third.received), (70, true));
        assert!(!w.finished(g, third.seq));
        assert!(w.done.recv_timeout(Duration::from_millis(100)).is_err());
        w.stop();
    }

    #[test]
    fn one_write_per_group_at_a_time_the_newest_waits_and_a_removed_groups_write_is_stale() {
        let dir = tempfile::tempdir().expect("dir");
        let files = SnapshotFiles::open(dir.path()).expect("files");
        let mut w = SnapshotWriter::start(1, files.clone(), None).expect("writer");
        let (g, other) = (GroupId(7), GroupId(8));
        w.write(g, snap(10));
        // Two more while the first is in flight: only the newest waits.
        w.write(g, snap(20));
        w.write(g, snap(30));
        w.write(other, snap(5));
        let mut done = vec![next(&w), next(&w)];
        done.sort_by_key(|s| s.group.0);
        assert_eq!((done[0].group, done[0].meta.index), (g, 10));
        assert_eq!((done[1].group, done[1].meta.index), (other, 5));
        assert!(!w.finished(other, done[1].seq));
        assert!(!w.finished(g, done[0].seq), "not removed");
        let third = next(&w);
        assert_eq!(
            third.meta.index, 30,
            "20 was replaced by 30 while it waited"
        );
        assert!(!w.finished(g, third.seq));
        assert!(w.done.try_recv().is_err(), "nothing else was written");

        // Removed while its write is in flight (a queue deleted, its number free again).
        w.write(g, snap(40));
        w.removed(g);
        w.write(g, snap(1));
        let stale = next(&w);
        assert_eq!(stale.meta.index, 40);
        assert!(w.finished(g, stale.seq), "the old queue's write is stale");
        let fresh = next(&w);
        assert_eq!(fresh.meta.index, 1);
        assert!(!w.finished(g, fresh.seq), "the new queue's write is not");
        for s in [done.remove(0), third, stale, fresh] {
            files.discard(&s.file.expect("written"));
        }
        w.stop();
        assert!(w.thread.is_none());
    }

    #[test]
    fn a_snapshot_made_on_the_writer_is_written_as_made_and_one_that_fails_keeps_the_log() {
        let dir = tempfile::tempdir().expect("dir");
        let files = SnapshotFiles::open(dir.path()).expect("files");
        let mut w = SnapshotWriter::start(1, files.clone(), None).expect("writer");
        let made_on = std::sync::Arc::new(std::sync::Mutex::new(None));
        let seen = made_on.clone();
        let later = |index, body: SnapshotBody| Pending {
            meta: SnapshotMeta { index, term: 1 },
            members: None,
            body,
            received: false,
        };
        w.write(
            GroupId(3),
            later(
                9,
                SnapshotBody::Stream {
                    prefix: 4,
                    write: Box::new(move |sink| {
                        *seen.lock().unwrap() = std::thread::current().name().map(str::to_owned);
                        sink(b"state ")?;
                        sink(b"at 9")?;
                        Ok(b"the ".to_vec())
                    }),
                },
            ),
        );
        let s = next(&w);
        assert!(!w.finished(GroupId(3), s.seq));
        assert_eq!(s.bytes, 14);
        assert_eq!(made_on.lock().unwrap().as_deref(), Some("warren-snap-1"));
        let file = s.file.expect("written");
        files.publish(GroupId(3), &file).expect("publish");
        let back = files.read(GroupId(3)).expect("read").expect("there");
        assert_eq!(&back.data[..], b"the state at 9");

        w.write(
            GroupId(3),
            later(
                12,
                SnapshotBody::Stream {
                    prefix: 4,
                    write: Box::new(|sink| {
                        sink(b"half")?;
                        Err("no room".to_owned())
                    }),
                },
            ),
        );
        let failed = next(&w);
        assert!(failed.file.is_err());
        assert!(!w.finished(GroupId(3), failed.seq));
        assert_eq!(
            files
                .read(GroupId(3))
                .expect("read")
                .expect("kept")
                .meta
                .index,
            9
        );
        w.stop();
    }
}
