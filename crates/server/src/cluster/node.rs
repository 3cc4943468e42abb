//! The Raft thread: owns the node's `MultiRaft` and its `EngineLog` and runs them pass by pass.
//! A pass steps every batch that arrived, applies every queued command, ticks when a tick is
//! due, then takes one `ready`: its messages go out at once, its state is written with one
//! write and (when needed) one fsync, and `advance` releases the messages that waited for it
//! and the committed entries, which go to [`RaftEvents`] with the pass's leader changes and
//! refused proposals.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TryRecvError};
use warren_replication::{
    EngineLog, Error, Forward, GroupId, LogError, LogStore, MultiRaft, NodeBatch, NodeId,
    SnapshotFiles, SnapshotMeta, StoredSnapshot,
};

use super::transport::{Budget, Outbound, Queued, INBOUND_QUEUE};
use super::{RaftEvents, MAX_PROPOSAL};

/// What a [`super::RaftNode`] asks of the Raft thread.
pub(crate) enum Command {
    /// A group, its creator standing for its leader or not, and the voters it starts with
    /// (`None`: the list's nodes, or the cluster's nodes as last set).
    AddGroup(GroupId, bool, Option<Vec<NodeId>>),
    /// A group this node is being added to ([`MultiRaft::join_group`]).
    JoinGroup(GroupId),
    RemoveGroup(GroupId),
    Propose(GroupId, Vec<u8>),
    /// A proposal for the leader `NodeId` of the group: sent with the next pass's batches.
    Forward(NodeId, GroupId, Vec<u8>),
    /// The state machine's snapshot of a group: written, then the log before it compacted.
    Snapshot(GroupId, StoredSnapshot),
    /// Maintenance mode on or off ([`MultiRaft::set_draining`]).
    Drain(bool),
    /// Hand a group's leadership to a node ([`MultiRaft::transfer_leader`]).
    Transfer(GroupId, NodeId),
    /// The cluster's nodes changed: every group moves to them ([`MultiRaft::set_members`]),
    /// and the nodes not among them are no peers any more; with the addresses of the nodes
    /// the list lacks.
    Members(Vec<NodeId>, Vec<(NodeId, String)>),
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
    Nothing,
}

/// A snapshot the writer thread has on disk beside the group's, not yet the group's.
pub(crate) struct Staged {
    group: GroupId,
    meta: SnapshotMeta,
    bytes: usize,
    started: Instant,
    file: Result<std::path::PathBuf, LogError>,
}

/// The thread that writes and fsyncs the state machine's snapshots, so that a deep queue's
/// (tens of MB, tens to hundreds of milliseconds) does not hold up every group's ticks,
/// heartbeats and appends on the Raft thread. The Raft thread then only renames the file
/// into place, records it and compacts the log: cheap, and in order with everything else it
/// does to the group.
pub(crate) struct SnapshotWriter {
    jobs: Sender<(GroupId, u64, StoredSnapshot)>,
    done: Receiver<Staged>,
    files: SnapshotFiles,
    seq: u64,
}

impl SnapshotWriter {
    /// Starts the thread; it stops once this is dropped (the Raft thread's end).
    pub(crate) fn start(node: NodeId, files: SnapshotFiles) -> std::io::Result<Self> {
        let (jobs, todo) = crossbeam_channel::unbounded::<(GroupId, u64, StoredSnapshot)>();
        let (tell, done) = crossbeam_channel::unbounded();
        let writer = files.clone();
        std::thread::Builder::new()
            .name(format!("warren-snap-{node}"))
            .spawn(move || {
                for (group, seq, snap) in todo {
                    let started = Instant::now();
                    let staged = Staged {
                        group,
                        meta: snap.meta,
                        bytes: snap.data.len(),
                        started,
                        file: writer.stage(group, seq, &snap),
                    };
                    if tell.send(staged).is_err() {
                        return;
                    }
                }
            })?;
        Ok(SnapshotWriter {
            jobs,
            done,
            files,
            seq: 0,
        })
    }
}

/// Commands taken per pass at most, so one pass (and its fsync) stays bounded.
const MAX_COMMANDS_PER_PASS: usize = 8192;

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
    /// Proposals to send to other nodes, by destination; and what other nodes sent here.
    pub(crate) to_forward: std::collections::BTreeMap<NodeId, Vec<Forward>>,
    pub(crate) forwarded: Vec<(NodeId, Forward)>,
    /// Snapshots for the broker at the next pass: the recovered ones at first.
    pub(crate) snapshots: Vec<(GroupId, StoredSnapshot)>,
    pub(crate) writer: SnapshotWriter,
    pub(crate) stopping: bool,
}

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
            self.take_input();
            if !self.pass() {
                break;
            }
        }
        tracing::info!(node, "raft thread stopped");
    }

    /// Sleeps until input arrives or the next tick is due, unless a pass is due now.
    fn wait(&mut self) {
        let now = self.now_ms();
        let due = self.raft.next_tick_ms().unwrap_or(now);
        if self.raft.has_ready() || due <= now {
            return;
        }
        let timeout = Duration::from_millis(due - now);
        let woke = crossbeam_channel::select! {
            recv(self.commands) -> c => c.map_or(Woke::Closed, Woke::Command),
            recv(self.inbound) -> b => b.map_or(Woke::Nothing, Woke::Batch),
            recv(self.writer.done) -> s => s.map_or(Woke::Nothing, Woke::Staged),
            default(timeout) => Woke::Nothing,
        };
        match woke {
            Woke::Command(c) => self.command(c),
            Woke::Batch(q) => self.inbound(q),
            Woke::Staged(s) => self.snapshot_staged(s),
            // Every handle is gone: nobody can use this node any more.
            Woke::Closed => self.stopping = true,
            Woke::Nothing => {}
        }
    }

    fn take_input(&mut self) {
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
        self.forwarded.extend(
            std::mem::take(&mut b.forwards)
                .into_iter()
                .map(|f| (from, f)),
        );
        self.raft.step(b);
    }

    fn command(&mut self, c: Command) {
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
                if self.raft.remove_group(group) {
                    if let Err(e) = self.log.remove_group(group) {
                        tracing::error!(node = self.raft.node(), group = group.0, error = %e, "cannot remove a raft group's log");
                    }
                }
            }
            Command::Propose(group, data) if data.len() > MAX_PROPOSAL => {
                tracing::warn!(
                    node = self.raft.node(),
                    group = group.0,
                    bytes = data.len(),
                    "proposal too large to replicate"
                );
                let leader = self.raft.leader_of(group);
                self.refused.push((group, data, leader));
            }
            Command::Propose(group, data) => {
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
            Command::Forward(to, group, data) => {
                self.to_forward.entry(to).or_default().push(Forward {
                    group,
                    data: data.into(),
                });
            }
            Command::Snapshot(group, snap) => self.save_snapshot(group, snap),
            Command::Drain(on) => self.raft.set_draining(on),
            Command::Members(voters, addresses) => {
                self.out.set_peers(&voters, &addresses);
                self.raft.set_peers(&voters);
                self.raft.set_members(voters);
            }

            Command::Transfer(group, to) => {
                if !self.raft.transfer_leader(group, to) {
                    tracing::debug!(group = group.0, to, "leadership transfer not started");
                }
            }
            Command::Shutdown => self.stopping = true,
        }
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
    fn save_snapshot(&mut self, group: GroupId, mut snap: StoredSnapshot) {
        snap.meta = self.raft.snapshot_covering(group, snap.meta);
        snap.members = self.raft.members_at(group, snap.meta.index);
        if !self.snapshot_is_news(group, snap.meta) {
            return;
        }
        self.writer.seq += 1;
        let seq = self.writer.seq;
        if self.writer.jobs.send((group, seq, snap)).is_err() {
            tracing::error!(
                node = self.raft.node(),
                group = group.0,
                "the snapshot writer has stopped; the group keeps its log"
            );
        }
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
        let file = match s.file {
            Ok(file) => file,
            Err(e) => {
                tracing::error!(node, group = group.0, error = %e, "cannot write a snapshot; the group keeps its log");
                return;
            }
        };
        if !self.snapshot_is_news(group, s.meta) {
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

    /// One tick (if due), ready, write, advance, report. False if the log failed: this node
    /// can no longer promise anything and stops.
    fn pass(&mut self) -> bool {
        let now = self.now_ms();
        self.raft.tick(now);
        let mut rd = self.raft.ready();
        self.refused.append(&mut rd.refused);
        for b in std::mem::take(&mut rd.messages) {
            self.out.send(b);
        }
        let leaders = std::mem::take(&mut rd.leaders);
        let wanted = std::mem::take(&mut rd.snapshots_wanted);
        let peers = std::mem::take(&mut rd.peers);
        let draining = std::mem::take(&mut rd.draining);
        if let Err(e) = rd.persist(&mut self.log) {
            // An fsync that failed cannot be retried safely: stop, and let peers see us down.
            tracing::error!(node = self.raft.node(), error = %e, "raft log write failed; stopping this node's raft");
            return false;
        }
        let mut done = self.raft.advance(rd);
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
            self.events.snapshots(std::mem::take(&mut self.snapshots));
        }
        if !done.committed.is_empty() {
            self.events.committed(done.committed);
        }
        if !self.forwarded.is_empty() {
            self.events.forwarded(std::mem::take(&mut self.forwarded));
        }
        true
    }
}
