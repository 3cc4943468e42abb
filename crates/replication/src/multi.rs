//! Many Raft groups on one node, driven in batches.
//!
//! The driver loop (one thread per node, or one per core later) is:
//! `step` what arrived from peers, `propose`, `tick(now_ms)`, then `ready()`: send its messages,
//! write its entries and hard states through one [`LogStore`] batch with one fsync, then
//! `advance(batch)`: send what it returns, apply its committed entries. Nothing here reads a clock
//! or touches a socket or a file.
//!
//! Idle groups hibernate: they leave the tick set and send nothing. One liveness heartbeat per peer
//! node replaces per-group heartbeats for failure detection: when a peer is seen down, the groups it
//! led wake up and elect.

use std::collections::{BTreeMap, BTreeSet};

use bytes::Bytes;
use protobuf::Message as _;
use raft::eraftpb::{
    ConfChange, ConfChangeSingle, ConfChangeType, ConfChangeV2, Entry, EntryType, HardState,
    Message, MessageType,
};
use raft::{RawNode, StateRole, INVALID_ID};

use crate::snapshots::{Members, SnapshotMeta, SnapshotSource, StoredSnapshot};
use crate::storage::GroupLog;
use crate::wal::{DurableGroup, LogError, LogStore};
use crate::{GroupId, NodeId};

/// Tuning of a node's groups. Ticks are `tick_ms` of the time passed to [`MultiRaft::tick`].
#[derive(Debug, Clone)]
pub struct Config {
    pub node: NodeId,
    /// This node's incarnation, higher after each restart (peers learn from it that groups this
    /// node led before have no leader now).
    pub boot: u64,
    /// Every node of the cluster at this start: the peers, and the voters of the groups made
    /// with [`MultiRaft::add_group`] until [`MultiRaft::set_members`] says otherwise.
    pub nodes: Vec<NodeId>,
    pub tick_ms: u64,
    pub election_tick: usize,
    pub heartbeat_tick: usize,
    /// Ticks of nothing to do after which a group stops being ticked. Must leave a follower short
    /// of its election timeout: `hibernate_ticks + heartbeat_tick < election_tick`.
    pub hibernate_ticks: u32,
    /// A liveness heartbeat goes to each peer node every this many ticks.
    pub node_heartbeat_ticks: u64,
    /// A peer not heard from for this many ticks is down.
    pub node_down_ticks: u64,
    pub max_inflight_msgs: usize,
    pub max_size_per_msg: u64,
    /// The most bytes of committed entries one ready hands out per group (the rest come in the
    /// next): a start replaying a long log, or a follower catching up, applies it in parts
    /// instead of holding all of it at once. A pass may hand out two such parts (its ready's
    /// and the one after its append), and their entries stay in memory until applied.
    pub max_committed_size_per_ready: u64,
    /// Applied entries kept in memory for peers that lag behind (older ones are read back
    /// from the durable log). A leader keeps more for a follower up to
    /// [`LAGGING_IN_MEMORY`] times this behind; one further behind (down, or cut off) is sent
    /// what it lacks from the durable log, so the leader's memory does not grow with the log
    /// while a member is away.
    pub log_keep: u64,
    /// The same window in bytes of entries' data, whichever is smaller: an entry joining many
    /// proposals ([`crate::batch`]) can be a thousand times the size of one.
    pub log_keep_bytes: usize,
    /// Entries the durable log keeps behind a snapshot for a follower that lags (a leader
    /// keeps what its followers still lack, up to this many): one further behind is sent the
    /// snapshot.
    pub snapshot_keep: u64,
}

impl Config {
    pub fn new(node: NodeId, nodes: Vec<NodeId>) -> Self {
        Config {
            node,
            boot: 1,
            nodes,
            tick_ms: 50,
            election_tick: 10,
            heartbeat_tick: 2,
            hibernate_ticks: 4,
            node_heartbeat_ticks: 1,
            node_down_ticks: 4,
            max_inflight_msgs: 32,
            max_size_per_msg: 1 << 20,
            max_committed_size_per_ready: 16 << 20,
            log_keep: 1024,
            log_keep_bytes: 1 << 20,
            snapshot_keep: 4096,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("group {0:?} exists")]
    GroupExists(GroupId),
    #[error("no group {0:?}")]
    NoGroup(GroupId),
    #[error("not the leader of {group:?} (leader: {leader:?})")]
    NotLeader {
        group: GroupId,
        leader: Option<NodeId>,
    },
    #[error("group {0:?} has a membership change in progress")]
    ChangeInProgress(GroupId),
    #[error("raft: {0}")]
    Raft(#[from] raft::Error),
    #[error(transparent)]
    Log(#[from] LogError),
}

/// A Raft message of one group.
#[derive(Debug, Clone)]
pub struct Envelope {
    pub group: GroupId,
    pub msg: Message,
}

/// Everything one node sends another from one pass. An empty batch is a liveness heartbeat.
#[derive(Debug, Clone)]
pub struct NodeBatch {
    pub from: NodeId,
    /// The sender's [`Config::boot`].
    pub boot: u64,
    pub to: NodeId,
    /// The sender is in maintenance mode ([`MultiRaft::set_draining`]): peers hand it no
    /// leadership and place nothing on it.
    pub draining: bool,
    pub msgs: Vec<Envelope>,
    /// Proposals for groups the receiver leads, from a node that does not lead them (a
    /// publish forwarded to its queue's leader). [`MultiRaft::step`] leaves them alone: they
    /// are the caller's, to propose as its own.
    pub forwards: Vec<Forward>,
}

/// A proposal sent to a group's leader by another member.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Forward {
    pub group: GroupId,
    pub data: Bytes,
}

/// A proposal [`MultiRaft::try_propose`] did not take. `data` is the proposal's, or empty if
/// raft-rs itself dropped it (`error` is then [`Error::Raft`]).
#[derive(Debug)]
pub struct Refused {
    pub error: Error,
    pub data: Vec<u8>,
}

/// A committed proposal, in log order within its group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Committed {
    pub group: GroupId,
    pub index: u64,
    pub term: u64,
    pub data: Bytes,
}

/// Counters for tests and the benchmark.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Stats {
    pub raft_msgs_sent: u64,
    pub node_heartbeats_sent: u64,
    pub group_ticks: u64,
    pub hibernations: u64,
    pub wakeups: u64,
}

struct Group {
    raw: RawNode<GroupLog>,
    /// Consecutive ticks with nothing to do.
    quiet_ticks: u32,
    /// The leader last reported in [`ReadyBatch::leaders`] (`INVALID_ID`: none), and its term.
    reported_leader: NodeId,
    reported_term: u64,
    /// Leaders seen since the group was made here (each new one counts).
    leader_changes: u64,
}

/// One group as this member sees it, for metrics and the management API.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupStatus {
    pub group: GroupId,
    pub term: u64,
    pub commit: u64,
    pub applied: u64,
    /// The last index in this member's log (written or about to be, in this pass).
    pub last_index: u64,
    /// The latest durable snapshot's index (0: none).
    pub snapshot_index: u64,
    pub leader: Option<NodeId>,
    pub leading: bool,
    /// Leaders seen since the group was made on this node.
    pub leader_changes: u64,
    /// While this member leads: each follower and the last index it is known to hold.
    pub followers: Vec<(NodeId, u64)>,
    /// The group's members as this member applied them.
    pub members: Members,
}

/// One step of a group's membership: one member at a time, so that any two majorities of
/// successive configurations overlap (Raft's single-server changes; raft-rs refuses more).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemberChange {
    /// The node receives the log, without a vote, until it caught up.
    AddLearner(NodeId),
    /// A learner (or a new node) votes from now on.
    Promote(NodeId),
    /// The node leaves the group.
    Remove(NodeId),
    /// A voter keeps the log without a vote (a queue's member taken off its voters while its
    /// node stays in the cluster).
    Demote(NodeId),
}

impl MemberChange {
    fn to_conf_change(self) -> ConfChangeV2 {
        let (kind, node) = match self {
            // raft-rs makes a voter a learner with the change that adds one: a single
            // change, as the voters differ by one.
            MemberChange::AddLearner(n) | MemberChange::Demote(n) => {
                (ConfChangeType::AddLearnerNode, n)
            }
            MemberChange::Promote(n) => (ConfChangeType::AddNode, n),
            MemberChange::Remove(n) => (ConfChangeType::RemoveNode, n),
        };
        let mut single = ConfChangeSingle::default();
        single.set_change_type(kind);
        single.node_id = node;
        let mut cc = ConfChangeV2::default();
        cc.set_changes(vec![single].into());
        cc
    }
}

/// A learner counts as caught up once it holds the leader's log up to this many entries
/// behind the commit index (under load a replicating follower trails by what is in flight).
const CAUGHT_UP_LAG: u64 = 64;

struct Peer {
    last_heard: u64,
    up: bool,
    /// The peer's incarnation last heard (0: never heard).
    boot: u64,
    /// It said it is in maintenance mode, in its last batch.
    draining: bool,
}

/// The output of [`MultiRaft::ready`]: send `messages` now, persist [`ReadyBatch::persist`],
/// then hand the batch back to [`MultiRaft::advance`] before stepping, proposing or ticking again.
pub struct ReadyBatch {
    pub messages: Vec<NodeBatch>,
    /// Groups whose leader changed since the last `ready` (`None`: no leader known now), for the
    /// driver to report whichever way it persists the batch. The same leader in a later term
    /// counts as a change: a learner sees no election, so a leader that died and won again
    /// would otherwise look unchanged to it.
    pub leaders: Vec<(GroupId, Option<NodeId>)>,
    /// Groups whose members changed here since the last `ready` (a membership change applied,
    /// or a leader's snapshot installed), with their members now. A group whose members no
    /// longer hold this node has left it: the caller removes it ([`MultiRaft::remove_group`])
    /// and its durable log.
    pub members: Vec<(GroupId, Members)>,
    /// Groups whose leader needs a snapshot that is not there yet (for a member being added,
    /// which starts from one): the state machine should take one ([`MultiRaft::snapshot_saved`]).
    pub snapshots_wanted: Vec<GroupId>,
    /// Members that groups started with here, to record with the batch
    /// ([`LogStore::put_members`]).
    starts: Vec<(GroupId, Members)>,
    /// Peer nodes seen going down (`false`) or coming back (`true`) since the last `ready`, in
    /// order.
    pub peers: Vec<(NodeId, bool)>,
    /// Peer nodes that went into maintenance mode (`true`) or came out of it, in order.
    pub draining: Vec<(NodeId, bool)>,
    /// Proposals held during a leadership transfer that ended with another leader: refused
    /// now, with the group's leader (as [`MultiRaft::try_propose`] refuses), in order.
    pub refused: Vec<(GroupId, Vec<u8>, Option<NodeId>)>,
    readys: Vec<(GroupId, raft::Ready)>,
    committed: Vec<Committed>,
    /// Snapshots from leaders, with the hard state the group's log restarts from.
    snapshots: Vec<(GroupId, StoredSnapshot, HardState)>,
    must_sync: bool,
}

impl ReadyBatch {
    pub fn is_empty(&self) -> bool {
        self.messages.is_empty()
            && self.leaders.is_empty()
            && self.peers.is_empty()
            && self.readys.is_empty()
            && self.committed.is_empty()
            && self.members.is_empty()
            && self.snapshots_wanted.is_empty()
            && self.starts.is_empty()
    }

    /// Snapshots from leaders in this batch: each replaces its group's state machine (the
    /// driver hands them over before any committed entry that follows).
    pub fn installed(&self) -> impl Iterator<Item = (GroupId, &StoredSnapshot)> {
        self.snapshots.iter().map(|(g, s, _)| (*g, s))
    }

    /// Each group with entries to write in this batch, and the index of its last one.
    pub fn last_entries(&self) -> impl Iterator<Item = (GroupId, u64)> + '_ {
        self.readys
            .iter()
            .filter_map(|(group, rd)| rd.entries().last().map(|e| (*group, e.index)))
    }

    /// Groups with entries or a hard state to persist.
    pub fn groups_to_persist(&self) -> usize {
        self.readys.len()
    }

    /// Writes every ready group's entries and hard state as one batch: one write, and one fsync
    /// unless only commit indexes moved.
    pub fn persist(&self, log: &mut impl LogStore) -> Result<(), LogError> {
        if self.readys.is_empty() && self.starts.is_empty() {
            return Ok(());
        }
        write_snapshots(&self.snapshots, log)?;
        write_starts(&self.starts, log)?;
        for (group, rd) in &self.readys {
            log.append(*group, rd.entries(), rd.hs())?;
        }
        log.flush(self.must_sync)
    }
}

/// A leader's snapshot is saved (durable at once) and the group's old log dropped in the
/// batch, before the batch's own entries, which follow the snapshot.
fn write_snapshots(
    snapshots: &[(GroupId, StoredSnapshot, HardState)],
    log: &mut impl LogStore,
) -> Result<(), LogError> {
    for (group, snap, hs) in snapshots {
        log.save_snapshot(*group, snap)?;
        log.clear_entries(*group, hs)?;
    }
    Ok(())
}

fn write_starts(starts: &[(GroupId, Members)], log: &mut impl LogStore) -> Result<(), LogError> {
    for (group, m) in starts {
        log.put_members(*group, m)?;
    }
    Ok(())
}

/// A batch of Raft state handed to a log writer by [`MultiRaft::submit`]: write it (several jobs
/// may share one fsync), then give it back to [`MultiRaft::on_persisted`], in submission order.
pub struct PersistJob {
    writes: Vec<(GroupId, Vec<Entry>, Option<HardState>, u64)>,
    /// Messages that may leave only once the write is durable (votes, append responses).
    held: Vec<(GroupId, Vec<Message>)>,
    snapshots: Vec<(GroupId, StoredSnapshot, HardState)>,
    starts: Vec<(GroupId, Members)>,
    must_sync: bool,
}

impl PersistJob {
    /// Snapshots from leaders in this job: each replaces its group's state machine before the
    /// committed entries that follow it.
    pub fn installed(&self) -> impl Iterator<Item = (GroupId, &StoredSnapshot)> {
        self.snapshots.iter().map(|(g, s, _)| (*g, s))
    }

    pub fn is_empty(&self) -> bool {
        self.writes.is_empty() && self.starts.is_empty()
    }

    /// Whether the job needs an fsync (false when only commit indexes moved).
    pub fn must_sync(&self) -> bool {
        self.must_sync
    }

    /// Adds the job to the log's current batch, without flushing it.
    pub fn write(&self, log: &mut impl LogStore) -> Result<(), LogError> {
        write_snapshots(&self.snapshots, log)?;
        write_starts(&self.starts, log)?;
        for (group, entries, hs, _) in &self.writes {
            log.append(*group, entries, hs.as_ref())?;
        }
        Ok(())
    }
}

/// What [`MultiRaft::advance`] returns: messages that had to wait for the write, snapshots from
/// leaders, and entries now committed and persisted here. Install the snapshots first, then
/// apply the entries in order.
#[derive(Default)]
pub struct Advanced {
    pub messages: Vec<NodeBatch>,
    pub snapshots: Vec<(GroupId, StoredSnapshot)>,
    pub committed: Vec<Committed>,
}

pub struct MultiRaft {
    cfg: Config,
    logger: slog::Logger,
    /// Boxed: a group is about a kilobyte, and B-tree nodes holding them inline would keep a
    /// third of their slots empty, which thousands of idle groups pay for.
    groups: BTreeMap<GroupId, Box<Group>>,
    /// Groups that are ticked. A hibernating group is absent and costs nothing per tick.
    awake: BTreeSet<GroupId>,
    /// Groups stepped, proposed to or ticked since the last `ready`.
    touched: BTreeSet<GroupId>,
    peers: BTreeMap<NodeId, Peer>,
    ticks: u64,
    next_tick_ms: Option<u64>,
    heartbeat_due: bool,
    stats: Stats,
    /// The durable log, where groups read back entries that left their memory.
    cold: Option<std::sync::Arc<dyn crate::storage::ColdLog>>,
    /// Where groups read their snapshots back.
    snapshots: Option<std::sync::Arc<dyn SnapshotSource>>,
    /// Snapshots sent since the last `ready`, to report to their groups.
    snapshot_reports: Vec<(GroupId, NodeId)>,
    /// Peers seen down or up since the last `ready`.
    peer_changes: Vec<(NodeId, bool)>,
    /// Peers seen entering or leaving maintenance mode since the last `ready`.
    drain_changes: Vec<(NodeId, bool)>,
    /// This node is in maintenance mode: it hands every leadership away and stands for none.
    draining: bool,
    /// Proposals to groups this node leads while it transfers their leadership (raft-rs would
    /// drop them): proposed once the transfer is given up, refused once another node leads.
    held: BTreeMap<GroupId, Vec<Vec<u8>>>,
    /// The voters every group should have ([`MultiRaft::set_members`]); `None`: leave each
    /// group's members as they are.
    target: Option<Vec<NodeId>>,
    /// Groups told their voters ([`MultiRaft::set_group_voters`]): some of the cluster's
    /// nodes, the other nodes holding them as learners; `None`, every node (a group whose
    /// voters of its own were taken back).
    group_voters: BTreeMap<GroupId, Option<Vec<NodeId>>>,
    /// Since the last `ready`: groups whose members changed, groups whose leader wants a
    /// snapshot, members groups started with.
    member_changes: Vec<(GroupId, Members)>,
    snapshots_wanted: BTreeSet<GroupId>,
    /// When (in ticks) each group last asked the state machine for a snapshot.
    wanted_at: BTreeMap<GroupId, u64>,
    starts: Vec<(GroupId, Members)>,
    /// Messages of this node's own making for the next `ready`: snapshot requests of groups
    /// waiting for their leader's snapshot.
    asks: Vec<(GroupId, Message)>,
    /// Messages for groups this node does not have yet ([`Early`]).
    early: Early,
}

/// Messages that arrive for a group before this node makes it, kept for a few ticks and stepped
/// once it does. A new queue's creator campaigns as soon as it applies the metadata entry that
/// makes the group, and its peers usually apply that entry a little later (a follower learns the
/// commit with the leader's next message): dropped, the vote requests would leave the group
/// without a leader until the candidate's election timeout, about half a second, and a client
/// declaring quorum queues one after another would wait that long for most of them. Bounded in
/// count and size; a group that never comes (a deleted queue's stragglers) has them expire.
#[derive(Default)]
struct Early {
    by_group: BTreeMap<GroupId, Vec<(u64, NodeId, Envelope)>>,
    count: usize,
}

impl Early {
    /// At most this many messages waiting, for every group of the node.
    const MAX: usize = 4096;
    /// A message with more entry bytes than this is not kept (a new group's first messages
    /// carry none or a few small ones).
    const MAX_BYTES: usize = 64 * 1024;

    fn keep(&mut self, tick: u64, from: NodeId, env: Envelope) {
        if self.count >= Self::MAX || env.msg.get_msg_type() == MessageType::MsgSnapshot {
            return;
        }
        let bytes: usize = env.msg.entries.iter().map(|e| e.data.len()).sum();
        if bytes > Self::MAX_BYTES {
            return;
        }
        self.by_group
            .entry(env.group)
            .or_default()
            .push((tick, from, env));
        self.count += 1;
    }

    fn take(&mut self, group: GroupId) -> Vec<(u64, NodeId, Envelope)> {
        let list = self.by_group.remove(&group).unwrap_or_default();
        self.count -= list.len();
        list
    }

    /// Forgets what came before tick `from`.
    fn expire(&mut self, from: u64) {
        if self.count == 0 {
            return;
        }
        let mut count = 0;
        self.by_group.retain(|_, list| {
            list.retain(|(at, _, _)| *at >= from);
            count += list.len();
            !list.is_empty()
        });
        self.count = count;
    }
}

impl MultiRaft {
    /// Groups created from now on read their snapshots from `source` when a follower needs
    /// one: call it before adding or recovering groups.
    pub fn set_snapshot_source(&mut self, source: std::sync::Arc<dyn SnapshotSource>) {
        self.snapshots = Some(source);
    }

    /// Groups created from now on read entries that left their memory from `cold` (the
    /// node-wide durable log): call it before adding or recovering groups.
    pub fn set_cold_log(&mut self, cold: std::sync::Arc<dyn crate::storage::ColdLog>) {
        self.cold = Some(cold);
    }

    pub fn new(cfg: Config) -> Result<Self, Error> {
        if cfg.hibernate_ticks as usize + cfg.heartbeat_tick >= cfg.election_tick {
            return Err(Error::Config(
                "hibernate_ticks + heartbeat_tick must be below election_tick".into(),
            ));
        }
        if cfg.node_down_ticks <= cfg.node_heartbeat_ticks {
            return Err(Error::Config(
                "node_down_ticks must exceed node_heartbeat_ticks".into(),
            ));
        }
        if !cfg.nodes.contains(&cfg.node) || cfg.nodes.contains(&INVALID_ID) {
            return Err(Error::Config("nodes must hold this node and no 0".into()));
        }
        let peers = cfg
            .nodes
            .iter()
            .filter(|n| **n != cfg.node)
            .map(|n| {
                (
                    *n,
                    Peer {
                        last_heard: 0,
                        up: true,
                        boot: 0,
                        draining: false,
                    },
                )
            })
            .collect();
        Ok(MultiRaft {
            cfg,
            logger: slog::Logger::root(slog::Discard, slog::o!()),
            groups: BTreeMap::new(),
            awake: BTreeSet::new(),
            touched: BTreeSet::new(),
            peers,
            ticks: 0,
            next_tick_ms: None,
            heartbeat_due: false,
            stats: Stats::default(),
            cold: None,
            snapshots: None,
            snapshot_reports: Vec::new(),
            peer_changes: Vec::new(),
            drain_changes: Vec::new(),
            draining: false,
            held: BTreeMap::new(),
            target: None,
            group_voters: BTreeMap::new(),
            member_changes: Vec::new(),
            snapshots_wanted: BTreeSet::new(),
            wanted_at: BTreeMap::new(),
            starts: Vec::new(),
            asks: Vec::new(),
            early: Early::default(),
        })
    }

    /// This node's incarnation ([`Config::boot`]).
    pub fn boot(&self) -> u64 {
        self.cfg.boot
    }

    pub fn node(&self) -> NodeId {
        self.cfg.node
    }

    pub fn stats(&self) -> Stats {
        self.stats
    }

    /// Messages kept for groups this node has not made yet.
    pub fn early_count(&self) -> usize {
        self.early.count
    }

    pub fn group_count(&self) -> usize {
        self.groups.len()
    }

    pub fn awake_count(&self) -> usize {
        self.awake.len()
    }

    pub fn is_awake(&self, group: GroupId) -> bool {
        self.awake.contains(&group)
    }

    pub fn leader_of(&self, group: GroupId) -> Option<NodeId> {
        let g = self.groups.get(&group)?;
        let l = g.raw.raft.leader_id;
        (l != INVALID_ID).then_some(l)
    }

    /// The entries a group holds in memory (the rest of its log is on disk only).
    pub fn entries_in_memory(&self, group: GroupId) -> Option<usize> {
        self.groups.get(&group).map(|g| g.raw.store().len())
    }

    /// The bytes of entries' data `group` holds in memory.
    pub fn entry_bytes_in_memory(&self, group: GroupId) -> Option<usize> {
        self.groups.get(&group).map(|g| g.raw.store().bytes())
    }

    pub fn is_leader(&self, group: GroupId) -> bool {
        self.groups
            .get(&group)
            .is_some_and(|g| g.raw.raft.state == StateRole::Leader)
    }

    /// Groups this node leads.
    pub fn leading(&self) -> impl Iterator<Item = GroupId> + '_ {
        self.groups
            .iter()
            .filter(|(_, g)| g.raw.raft.state == StateRole::Leader)
            .map(|(id, _)| *id)
    }

    /// The group's current term, as this member knows it.
    pub fn term_of(&self, group: GroupId) -> Option<u64> {
        Some(self.groups.get(&group)?.raw.raft.term)
    }

    pub fn commit_index(&self, group: GroupId) -> Option<u64> {
        Some(self.groups.get(&group)?.raw.raft.raft_log.committed)
    }

    /// Whether the peer node is believed up.
    pub fn peer_up(&self, node: NodeId) -> bool {
        self.peers.get(&node).is_some_and(|p| p.up)
    }

    /// Maintenance mode (RabbitMQ's `drain`), or back out of it (`revive`). A draining node
    /// transfers the leadership of every group it leads to an up peer that is not draining
    /// (the most caught-up one), tick after tick until it leads none, and never stands for
    /// election itself: its members keep their logs and keep voting, so a group stays
    /// available with this node as one of its majority, but only other nodes lead. Peers
    /// learn of it from every batch this node sends.
    pub fn set_draining(&mut self, on: bool) {
        if self.draining == on {
            return;
        }
        tracing::info!(node = self.cfg.node, draining = on, "maintenance mode");
        self.draining = on;
        // Leaders wake to hand over; every peer hears of it at the next heartbeat.
        let led: Vec<GroupId> = self.leading().collect();
        for id in led {
            self.wake(id);
        }
        self.heartbeat_due = true;
    }

    /// Hands the leadership of `group` to `to` (rebalancing), if this node leads it and `to`
    /// is an up peer not in maintenance mode; false otherwise. raft-rs makes `to` campaign
    /// once it has the whole log, and gives up after an election timeout.
    pub fn transfer_leader(&mut self, group: GroupId, to: NodeId) -> bool {
        let Some(g) = self.groups.get_mut(&group) else {
            return false;
        };
        let r = &g.raw.raft;
        if r.state != StateRole::Leader
            || r.lead_transferee.is_some()
            || transfer_target(&g.raw, &self.peers, Some(to)).is_none()
        {
            return false;
        }
        g.raw.transfer_leader(to);
        self.wake(group);
        self.touched.insert(group);
        true
    }

    /// Maintenance mode holds while another node can lead: with every other node down or
    /// draining too, this one leads again rather than leave its groups without a leader.
    fn draining_in_effect(&self) -> bool {
        self.draining && self.peers.values().any(|p| p.up && !p.draining)
    }

    /// This node is in maintenance mode.
    pub fn is_draining(&self) -> bool {
        self.draining
    }

    /// The peer said it is in maintenance mode.
    pub fn peer_draining(&self, node: NodeId) -> bool {
        self.peers.get(&node).is_some_and(|p| p.draining)
    }

    /// Creates a group whose voters are every node (of [`Config::nodes`], or of the last
    /// [`MultiRaft::set_members`]): every member of a new group makes it so. `campaign` makes
    /// this node start an election at once, so a creator places leaders instead of waiting for
    /// timeouts.
    pub fn add_group(&mut self, id: GroupId, campaign: bool) -> Result<(), Error> {
        if self.group_voters.contains_key(&id) {
            // Voters of its own (set before it is made): every node makes it with the same
            // voters and learners, so none waits for a snapshot.
            if let Some(members) = self.wanted_members(id) {
                return self.add_group_members(id, members, campaign);
            }
        }
        let voters = self
            .target
            .clone()
            .unwrap_or_else(|| self.cfg.nodes.clone());
        self.add_group_with(id, voters, campaign)
    }

    /// Creates a group with `members`, as every one of them does (the same on each); a node
    /// not among them is being added to the group instead ([`MultiRaft::join_group`]). A
    /// learner never campaigns.
    pub fn add_group_members(
        &mut self,
        id: GroupId,
        members: Members,
        campaign: bool,
    ) -> Result<(), Error> {
        let me = self.cfg.node;
        if !members.contains(me) {
            return self.join_group(id);
        }
        let campaign = campaign && members.voters.contains(&me);
        let log = GroupLog::with_members(&members);
        self.insert_group(id, log, campaign, 0)?;
        self.record_start(id, members);
        Ok(())
    }

    /// Creates a group whose members are `nodes`, as every one of them does (the members a
    /// group starts with must be the same on each: the caller takes them from one log): all
    /// voters, or with voters of its own set before ([`MultiRaft::set_group_voters`]) those
    /// among `nodes`, the others learners. A node not among them is being added to the group
    /// instead ([`MultiRaft::join_group`]).
    pub fn add_group_with(
        &mut self,
        id: GroupId,
        nodes: Vec<NodeId>,
        campaign: bool,
    ) -> Result<(), Error> {
        let members = wanted_members(
            Some(&nodes),
            &self.cfg.nodes,
            self.group_voters.get(&id).map(Option::as_deref),
        )
        .unwrap_or_else(|| Members::voters(nodes));
        self.add_group_members(id, members, campaign)
    }

    /// Makes this node's member of a group it is being added to: it knows no members and takes
    /// no log entry until the leader's snapshot gives it the group's state and members (a log
    /// replayed from its first entry would not tell it the members the group started with).
    /// The leader sends the snapshot once it has made this node a learner
    /// ([`MemberChange::AddLearner`]).
    pub fn join_group(&mut self, id: GroupId) -> Result<(), Error> {
        let members = Members::default();
        self.insert_group(id, GroupLog::with_members(&members), false, 0)?;
        self.record_start(id, members);
        Ok(())
    }

    /// Records the members a group started with, for a restart: the cluster's list may have
    /// changed by then.
    fn record_start(&mut self, id: GroupId, members: Members) {
        self.starts.push((id, members));
    }

    /// Recreates a group after a restart from what the node-wide log held for it. Its committed
    /// entries after its snapshot come out of `advance` again, for the state machine to replay
    /// on top of the snapshot (which the caller hands it first), and the membership changes
    /// among them are applied again on top of the snapshot's members.
    pub fn recover_group(&mut self, id: GroupId, durable: &DurableGroup) -> Result<(), Error> {
        if durable.unloaded.is_some() && self.cold.is_none() {
            // The committed entries it left on disk could never be read back and applied.
            return Err(Error::Config(format!(
                "group {}: its committed entries are in the durable log, and no cold log is set to read them (set_cold_log before recover_group)",
                id.0
            )));
        }
        let mut durable = durable.clone();
        durable.fit_to_snapshot();
        let members = durable.start_members(&self.cfg.nodes);
        let meta = durable.snapshot.as_ref().map(|s| s.meta);
        let log = GroupLog::restore(
            &members,
            durable.entries,
            durable.unloaded,
            durable.hard_state,
            meta,
        );
        self.insert_group(id, log, false, meta.map_or(0, |m| m.index))?;
        if durable.members.is_none()
            && durable
                .snapshot
                .as_ref()
                .is_none_or(|s| s.members.is_none())
        {
            // A group from before membership could change has every node of the list as a
            // voter; recorded now, before the list may change.
            self.record_start(id, members);
        }
        Ok(())
    }

    /// A state machine's snapshot at `meta` (its last entry) holds the state at every later
    /// index up to the first entry it has not seen: entries without data (a leader's first
    /// entry) and membership changes never reach it. The snapshot is recorded at the last of
    /// those, so that it holds the membership changes just applied: a member being added
    /// needs a snapshot whose members include it.
    pub fn snapshot_covering(&self, group: GroupId, meta: SnapshotMeta) -> SnapshotMeta {
        let Some(g) = self.groups.get(&group) else {
            return meta;
        };
        let applied = g.raw.raft.raft_log.applied;
        let mut covered = meta;
        for index in meta.index + 1..=applied {
            let Ok(entries) = raft::Storage::entries(
                g.raw.store(),
                index,
                index + 1,
                None,
                raft::GetEntriesContext::empty(false),
            ) else {
                break;
            };
            match entries.first() {
                Some(e) if e.get_entry_type() != EntryType::EntryNormal || e.data.is_empty() => {
                    covered = SnapshotMeta {
                        index: e.index,
                        term: e.term,
                    };
                }
                _ => break,
            }
        }
        covered
    }

    /// The members of `group` in force at `index`, for a snapshot taken there.
    pub fn members_at(&self, group: GroupId, index: u64) -> Option<Members> {
        let g = self.groups.get(&group)?;
        Some(Members::from_conf_state(&g.raw.store().conf_at(index)))
    }

    /// The group's members as this node applied them.
    pub fn members(&self, group: GroupId) -> Option<Members> {
        let g = self.groups.get(&group)?;
        Some(Members::from_conf_state(g.raw.store().conf_state()))
    }

    /// Proposes one membership change to a group this node leads. Refused while an earlier
    /// change is not applied yet (raft-rs would drop it), during a leadership transfer, or on
    /// a node that does not lead the group.
    pub fn propose_member_change(
        &mut self,
        group: GroupId,
        change: MemberChange,
    ) -> Result<(), Error> {
        let g = self.groups.get_mut(&group).ok_or(Error::NoGroup(group))?;
        let r = &g.raw.raft;
        if r.state != StateRole::Leader {
            return Err(Error::NotLeader {
                group,
                leader: (r.leader_id != INVALID_ID).then_some(r.leader_id),
            });
        }
        if r.has_pending_conf() || r.lead_transferee.is_some() {
            return Err(Error::ChangeInProgress(group));
        }
        let cs = g.raw.store().conf_state();
        match change {
            // A voter must have the log: a new node comes in as a learner first (and is sent
            // the snapshot it starts from), and is promoted once it caught up.
            MemberChange::Promote(n) if !cs.learners.contains(&n) => {
                return Err(Error::Config(format!(
                    "node {n} is not a learner of group {}: add it as one first",
                    group.0
                )))
            }
            // raft-rs leaves a leader that removed itself leading outside its group.
            MemberChange::Remove(n) | MemberChange::Demote(n) if n == r.id => {
                return Err(Error::Config(format!(
                    "node {n} leads group {}: hand the leadership over before removing it",
                    group.0
                )))
            }
            MemberChange::Demote(n) if !cs.voters.contains(&n) => {
                return Err(Error::Config(format!(
                    "node {n} is not a voter of group {}",
                    group.0
                )))
            }
            MemberChange::AddLearner(n) if cs.voters.contains(&n) => {
                return Err(Error::Config(format!(
                    "node {n} is a voter of group {}: demote it instead",
                    group.0
                )))
            }
            _ => {}
        }
        tracing::info!(group = group.0, ?change, "membership change proposed");
        g.raw
            .propose_conf_change(Vec::new(), change.to_conf_change())?;
        self.wake(group);
        self.touched.insert(group);
        Ok(())
    }

    /// The voters every group should have: the groups this node leads move towards them, one
    /// change at a time each ([`MemberChange`]): members not among them are removed first, then
    /// each missing node that is up is added as a learner, and promoted once it caught up (a
    /// group never counts on a member that lacks its log). A leader that is not among them
    /// hands its leadership to one that is. Groups made from now on start with them.
    pub fn set_members(&mut self, voters: Vec<NodeId>) {
        let mut voters = voters;
        voters.sort_unstable();
        voters.dedup();
        tracing::info!(?voters, "cluster members");
        self.target = Some(voters);
        let led: Vec<GroupId> = self.leading().collect();
        for id in led {
            self.wake(id);
        }
    }

    /// The voters of one group, when they are only some of the cluster's nodes (a queue's
    /// members): the group this node leads moves towards them as [`MultiRaft::set_members`]
    /// says, and keeps every other node of the cluster as a learner, which holds and applies
    /// the log without a vote. Voters that are not (or no longer) nodes of the cluster are
    /// left out. `None`: every node of the cluster votes (again). Every node should be told
    /// the same, as the leader may change; only the leader acts on it.
    pub fn set_group_voters(&mut self, group: GroupId, voters: Option<Vec<NodeId>>) {
        let voters = voters.map(|mut v| {
            v.sort_unstable();
            v.dedup();
            v
        });
        if self.group_voters.get(&group) == Some(&voters) {
            return;
        }
        tracing::info!(group = group.0, ?voters, "group voters");
        self.group_voters.insert(group, voters);
        if self.is_leader(group) {
            self.wake(group);
        }
    }

    /// The members `group` should have: its own voters among the cluster's nodes and the
    /// other nodes as learners, or every node as a voter; `None` while no node-wide target is
    /// set and the group has no voters of its own (its members stay as they are).
    pub fn wanted_members(&self, group: GroupId) -> Option<Members> {
        wanted_members(
            self.target.as_deref(),
            &self.cfg.nodes,
            self.group_voters.get(&group).map(Option::as_deref),
        )
    }

    /// The nodes this one exchanges batches with, besides itself: a node added to the cluster
    /// comes in (up until it stays silent), one forgotten goes (messages for it are dropped,
    /// and groups see it down). Every member of every group should be among them.
    pub fn set_peers(&mut self, nodes: &[NodeId]) {
        let me = self.cfg.node;
        let keep: BTreeSet<NodeId> = nodes
            .iter()
            .copied()
            .filter(|n| *n != me && *n != INVALID_ID)
            .collect();
        let gone: Vec<NodeId> = self
            .peers
            .keys()
            .copied()
            .filter(|n| !keep.contains(n))
            .collect();
        for node in gone {
            // Its groups elect, as for a peer whose connection closed.
            self.peer_lost(node);
            self.peers.remove(&node);
            tracing::info!(node, "peer node forgotten");
        }
        let ticks = self.ticks;
        for node in keep {
            self.peers.entry(node).or_insert_with(|| {
                tracing::info!(node, "peer node added");
                Peer {
                    last_heard: ticks,
                    up: true,
                    boot: 0,
                    draining: false,
                }
            });
        }
    }

    /// Whether `node` is among them.
    pub fn is_peer(&self, node: NodeId) -> bool {
        self.peers.contains_key(&node)
    }

    /// Groups whose members are not yet the ones [`MultiRaft::set_members`] asks for, among
    /// those this node leads.
    pub fn changing_members(&self) -> usize {
        self.groups
            .iter()
            .filter(|(_, g)| g.raw.raft.state == StateRole::Leader)
            .filter(|(id, g)| {
                self.wanted_members(**id).is_some_and(|want| {
                    Members::from_conf_state(g.raw.store().conf_state()) != want
                })
            })
            .count()
    }

    fn insert_group(
        &mut self,
        id: GroupId,
        mut log: GroupLog,
        campaign: bool,
        applied: u64,
    ) -> Result<(), Error> {
        if let Some(cold) = &self.cold {
            log.set_cold(id.0, cold.clone());
        }
        if let Some(source) = &self.snapshots {
            log.set_snapshot_source(id.0, source.clone());
        }
        if self.groups.contains_key(&id) {
            return Err(Error::GroupExists(id));
        }
        let n = self.cfg.nodes.len() as u64;
        let pos = self
            .cfg
            .nodes
            .iter()
            .position(|x| *x == self.cfg.node)
            .unwrap_or(0) as u64;
        // raft-rs draws election timeouts from the thread's RNG; a range of one value, different
        // on each member of a group, keeps runs deterministic and still breaks split votes.
        let spread = (self.cfg.election_tick as u64 / n.max(1)).max(2);
        let min = self.cfg.election_tick + (((pos + id.0) % n) * spread) as usize;
        let rc = raft::Config {
            id: self.cfg.node,
            election_tick: self.cfg.election_tick,
            heartbeat_tick: self.cfg.heartbeat_tick,
            min_election_tick: min,
            max_election_tick: min + 1,
            max_size_per_msg: self.cfg.max_size_per_msg,
            max_inflight_msgs: self.cfg.max_inflight_msgs,
            max_committed_size_per_ready: self.cfg.max_committed_size_per_ready,
            check_quorum: true,
            pre_vote: true,
            applied,
            ..Default::default()
        };
        let mut raw = RawNode::new(&rc, log, &self.logger)?;
        if campaign {
            raw.campaign()?;
        }
        self.groups.insert(
            id,
            Box::new(Group {
                raw,
                quiet_ticks: 0,
                reported_leader: INVALID_ID,
                reported_term: 0,
                leader_changes: 0,
            }),
        );
        self.awake.insert(id);
        self.touched.insert(id);
        for (_, from, env) in self.early.take(id) {
            self.step_msgs(from, vec![env]);
        }
        Ok(())
    }

    #[cfg(test)]
    pub(crate) fn debug_group(&self, group: GroupId) -> String {
        let Some(g) = self.groups.get(&group) else {
            return "none".into();
        };
        let r = &g.raw.raft;
        let st = g.raw.store();
        format!(
            "state {:?} term {} leader {} applied {} committed {} persisted {} last {} first {:?} floor {} snap {:?} prs {:?} awake {} pending_snap {:?}",
            r.state,
            r.term,
            r.leader_id,
            r.raft_log.applied,
            r.raft_log.committed,
            r.raft_log.persisted,
            r.raft_log.last_index(),
            raft::Storage::first_index(st),
            st.floor(),
            st.snapshot_meta(),
            r.prs().iter().map(|(id, p)| (*id, p.matched, p.next_idx, format!("{:?}", p.state))).collect::<Vec<_>>(),
            self.awake.contains(&group),
            r.raft_log.unstable_snapshot().as_ref().map(|s| s.get_metadata().index),
        )
    }

    /// Every group as this member sees it, in group order.
    pub fn status(&self) -> Vec<GroupStatus> {
        let mut out: Vec<GroupStatus> = self
            .groups
            .iter()
            .map(|(id, g)| {
                let r = &g.raw.raft;
                let leading = r.state == StateRole::Leader;
                let mut followers: Vec<(NodeId, u64)> = if leading {
                    r.prs()
                        .iter()
                        .filter(|(n, _)| **n != self.cfg.node)
                        .map(|(n, p)| (*n, p.matched))
                        .collect()
                } else {
                    Vec::new()
                };
                followers.sort_unstable();
                GroupStatus {
                    group: *id,
                    term: r.term,
                    commit: r.raft_log.committed,
                    applied: r.raft_log.applied,
                    last_index: r.raft_log.last_index(),
                    snapshot_index: g.raw.store().snapshot_meta().map_or(0, |m| m.index),
                    leader: (r.leader_id != INVALID_ID).then_some(r.leader_id),
                    leading,
                    leader_changes: g.leader_changes,
                    followers,
                    members: Members::from_conf_state(g.raw.store().conf_state()),
                }
            })
            .collect();
        out.sort_unstable_by_key(|s| s.group);
        out
    }

    /// The index of the group's latest durable snapshot (0: none), if the group exists.
    pub fn snapshot_index(&self, group: GroupId) -> Option<u64> {
        let g = self.groups.get(&group)?;
        Some(g.raw.store().snapshot_meta().map_or(0, |m| m.index))
    }

    /// The state machine's snapshot of `group` at `meta` is durable: a follower that lacks its
    /// entries is sent it from now on. Returns the index below which the durable log may drop
    /// the group's entries (`LogStore::compact_to`): past the snapshot, less what a leader's
    /// followers still lack (at most [`Config::snapshot_keep`] entries of it). `None`: nothing
    /// to drop, or a snapshot this node cannot have (beyond what it applied).
    pub fn snapshot_saved(&mut self, group: GroupId, meta: SnapshotMeta) -> Option<u64> {
        let keep = self.cfg.snapshot_keep;
        let g = self.groups.get_mut(&group)?;
        let r = &g.raw.raft;
        if meta.index > r.raft_log.applied || meta.index == 0 {
            return None;
        }
        let mut bound = meta.index + 1;
        if r.state == StateRole::Leader {
            for (id, pr) in r.prs().iter() {
                if *id != r.id {
                    bound = bound.min(pr.matched + 1);
                }
            }
        }
        bound = bound.max((meta.index + 1).saturating_sub(keep));
        let store = g.raw.mut_store();
        store.snapshot_saved(meta);
        if bound <= store.floor() {
            return None;
        }
        store.set_floor(bound);
        Some(bound)
    }

    /// Drops a group (its queue was deleted); its durable log is the caller's to remove. Returns
    /// whether it existed.
    pub fn remove_group(&mut self, id: GroupId) -> bool {
        self.awake.remove(&id);
        self.touched.remove(&id);
        // What it held goes with it (its queue is gone; a group made again under the same
        // number is another queue).
        self.held.remove(&id);
        self.wanted_at.remove(&id);
        self.group_voters.remove(&id);
        if let Some(source) = &self.snapshots {
            source.forget(id.0);
        }
        self.groups.remove(&id).is_some()
    }

    /// Whether a group has state that the next `ready` hands out: a driver runs another pass at
    /// once instead of waiting for input or the next tick.
    pub fn has_ready(&self) -> bool {
        self.touched
            .iter()
            .any(|id| self.groups.get(id).is_some_and(|g| g.raw.has_ready()))
    }

    fn wake(&mut self, id: GroupId) {
        if self.awake.insert(id) {
            self.stats.wakeups += 1;
            if let Some(g) = self.groups.get_mut(&id) {
                g.quiet_ticks = 0;
            }
        }
    }

    /// Proposes `data` to a group this node leads. It wakes the group either way, so a group that
    /// lost its leader while asleep elects one.
    pub fn propose(&mut self, group: GroupId, data: Vec<u8>) -> Result<(), Error> {
        self.try_propose(group, data).map_err(|r| r.error)
    }

    /// [`MultiRaft::propose`] that hands a refused proposal's data back, for a driver that
    /// forwards it to the leader or answers its client.
    pub fn try_propose(&mut self, group: GroupId, data: Vec<u8>) -> Result<(), Refused> {
        let Some(g) = self.groups.get_mut(&group) else {
            return Err(Refused {
                error: Error::NoGroup(group),
                data,
            });
        };
        let (state, leader) = (g.raw.raft.state, g.raw.raft.leader_id);
        // raft-rs drops a proposal during a leadership transfer, and the data with it: held
        // until the transfer ends either way (a round trip or two).
        let transferring = g.raw.raft.lead_transferee.is_some();
        g.quiet_ticks = 0;
        self.wake(group);
        self.touched.insert(group);
        // Behind what is held, whatever this node is now: answers keep their order.
        if (state == StateRole::Leader && transferring) || self.held.contains_key(&group) {
            self.held.entry(group).or_default().push(data);
            return Ok(());
        }
        if state != StateRole::Leader {
            return Err(Refused {
                error: Error::NotLeader {
                    group,
                    leader: (leader != INVALID_ID).then_some(leader),
                },
                data,
            });
        }
        let Some(g) = self.groups.get_mut(&group) else {
            return Err(Refused {
                error: Error::NoGroup(group),
                data,
            });
        };
        g.raw.propose(vec![], data).map_err(|e| Refused {
            error: e.into(),
            data: Vec::new(),
        })
    }

    /// Takes a batch from a peer node. Any batch, even empty, shows the peer is alive.
    pub fn step(&mut self, batch: NodeBatch) {
        if !self.peers.contains_key(&batch.from) {
            // A node the cluster forgot (or never had): what it says counts for nothing.
            tracing::debug!(from = batch.from, "batch from a node that is no peer");
            return;
        }
        self.heard_from(batch.from, batch.boot);
        if let Some(p) = self.peers.get_mut(&batch.from) {
            if p.draining != batch.draining {
                p.draining = batch.draining;
                self.drain_changes.push((batch.from, batch.draining));
            }
        }
        self.step_msgs(batch.from, batch.msgs);
    }

    /// Steps one message of a batch from `from` that was held back (a leader's snapshot
    /// written to disk first), unless `from` restarted since it was sent (its new incarnation
    /// sends what it still means) or is down (a new leader sends its own): the peer's
    /// liveness and maintenance state stay as the batches since left them. False if it was
    /// dropped.
    pub fn step_held(&mut self, from: NodeId, boot: u64, env: Envelope) -> bool {
        match self.peers.get(&from) {
            Some(p) if p.boot == boot && p.up => {}
            _ => return false,
        }
        self.step_msgs(from, vec![env]);
        true
    }

    /// The group's commit index here, if the group exists.
    pub fn committed_index(&self, group: GroupId) -> Option<u64> {
        Some(self.groups.get(&group)?.raw.raft.raft_log.committed)
    }

    fn step_msgs(&mut self, from: NodeId, msgs: Vec<Envelope>) {
        let draining = self.draining_in_effect();
        for mut env in msgs {
            if env.msg.from != from || env.msg.to != self.cfg.node {
                tracing::warn!(group = env.group.0, from, "misaddressed raft message");
                continue;
            }
            if draining && env.msg.get_msg_type() == MessageType::MsgTimeoutNow {
                // A transfer to this node from a leader that had not heard it drains: the
                // leader gives it up after its election timeout and tries another.
                continue;
            }
            let Some(g) = self.groups.get_mut(&env.group) else {
                tracing::trace!(
                    group = env.group.0,
                    from,
                    "message for a group not made yet"
                );
                self.early.keep(self.ticks, from, env);
                continue;
            };
            if awaits_snapshot(&g.raw) {
                // A member being added, before its leader's snapshot (which tells it the
                // members and the state the log leads to).
                match env.msg.get_msg_type() {
                    MessageType::MsgAppend if env.msg.index == 0 => {
                        // It takes no entry from the first: they would not tell it the
                        // members. A leader that counts it as a voter already (it made the
                        // group with it) would go on sending entries: it is asked for the
                        // snapshot, as raft-rs's followers ask (an append refused with a
                        // snapshot request).
                        self.asks.push((env.group, snapshot_request(&env.msg)));
                        continue;
                    }
                    MessageType::MsgRequestVote | MessageType::MsgRequestPreVote => {
                        // With no entry it would vote for any candidate, and a group that
                        // still counts an old node of its number (forgotten, its data gone,
                        // the number taken again before every group removed it) would let a
                        // candidate without the committed entries win. Not answering is
                        // always safe.
                        continue;
                    }
                    MessageType::MsgHeartbeat => {
                        // Such a leader also believes the old node holds entries and says
                        // they are committed: raft-rs panics on a commit past its log.
                        env.msg.commit = 0;
                    }
                    _ => {}
                }
            }
            if g.raw.raft.state != StateRole::Leader {
                g.quiet_ticks = 0;
            }
            // The answers to a leader's last heartbeats arrive after it fell asleep; they carry
            // nothing that needs it awake.
            let keep_asleep = env.msg.get_msg_type() == MessageType::MsgHeartbeatResponse;
            if let Err(e) = g.raw.step(env.msg) {
                tracing::debug!(group = env.group.0, error = %e, "raft step");
            }
            if g.raw.raft.state == StateRole::Leader {
                snapshot_for_new_learners(&mut g.raw);
            }
            if !keep_asleep {
                self.wake(env.group);
            }
            self.touched.insert(env.group);
        }
    }

    fn heard_from(&mut self, node: NodeId, boot: u64) {
        let ticks = self.ticks;
        let Some(p) = self.peers.get_mut(&node) else {
            return;
        };
        p.last_heard = ticks;
        let restarted = p.boot != 0 && p.boot != boot;
        let came_back = !p.up;
        p.boot = boot;
        p.up = true;
        if restarted {
            // It restarted faster than it could be seen down: the groups it led lost their leader.
            tracing::info!(node, boot, "peer node restarted");
            self.wake_orphans_of(node);
        } else if came_back {
            tracing::info!(node, "peer node up");
        }
        if came_back {
            self.peer_changes.push((node, true));
        }
        if restarted || came_back {
            // The groups this node leads may have entries the peer lacks, and it must learn who
            // leads them: wake them so they heartbeat and replicate.
            let led: Vec<GroupId> = self.leading().collect();
            for id in led {
                self.wake(id);
            }
        }
    }

    /// When the next tick is due, for a driver that sleeps until then.
    pub fn next_tick_ms(&self) -> Option<u64> {
        self.next_tick_ms
    }

    /// Advances time. Ticks only awake groups; a group quiet for `hibernate_ticks` goes to sleep.
    pub fn tick(&mut self, now_ms: u64) {
        let next = *self.next_tick_ms.get_or_insert(now_ms);
        if now_ms < next {
            return;
        }
        // One tick per call however late it comes: a node that stalled (a slow fsync) must not
        // fire a burst of ticks and take its peers, whose messages it has not read yet, for dead.
        self.next_tick_ms = Some(now_ms + self.cfg.tick_ms.max(1));
        self.tick_once();
    }

    /// Wakes the groups whose leader was `node`, so they time out and elect.
    /// The transport saw the peer's connection end. On loopback or a LAN that is its process
    /// gone (a crash, a SIGKILL: the kernel closes its sockets), so it is down now rather than
    /// after `node_down_ticks`, and each group it led elects at its next ticks: its members stop
    /// honouring the dead leader's lease (raft-rs refuses votes within it) and the member whose
    /// election timeout is the shortest campaigns first. A machine that vanishes without closing
    /// anything is still found by the missing heartbeats. A peer that is in fact alive (a
    /// connection reset) costs an election at most, and is up again at its next batch.
    pub fn peer_lost(&mut self, node: NodeId) {
        let Some(p) = self.peers.get_mut(&node) else {
            return;
        };
        if p.up {
            tracing::info!(node, "peer node's connection closed: down");
            self.peer_changes.push((node, false));
        }
        p.up = false;
        let orphans: Vec<GroupId> = self
            .groups
            .iter_mut()
            .filter(|(_, g)| g.raw.raft.leader_id == node && g.raw.raft.state != StateRole::Leader)
            .map(|(id, g)| {
                let r = &mut g.raw.raft;
                r.election_elapsed = r.election_elapsed.max(r.election_timeout());
                *id
            })
            .collect();
        for id in orphans {
            self.wake(id);
            self.touched.insert(id);
        }
    }

    fn wake_orphans_of(&mut self, node: NodeId) {
        let orphans: Vec<GroupId> = self
            .groups
            .iter()
            .filter(|(_, g)| g.raw.raft.leader_id == node)
            .map(|(id, _)| *id)
            .collect();
        for id in orphans {
            self.wake(id);
        }
    }

    fn tick_once(&mut self) {
        self.ticks += 1;
        // Kept for an election timeout: a candidate whose request expired campaigns again.
        self.early
            .expire(self.ticks.saturating_sub(self.cfg.election_tick as u64));
        if self
            .ticks
            .is_multiple_of(self.cfg.node_heartbeat_ticks.max(1))
        {
            self.heartbeat_due = true;
        }
        let ticks = self.ticks;
        let down: Vec<NodeId> = self
            .peers
            .iter_mut()
            .filter(|(_, p)| p.up && ticks.saturating_sub(p.last_heard) > self.cfg.node_down_ticks)
            .map(|(n, p)| {
                p.up = false;
                *n
            })
            .collect();
        for node in down {
            tracing::info!(node, "peer node down");
            self.peer_changes.push((node, false));
            self.wake_orphans_of(node);
        }
        let draining = self.draining_in_effect();
        if draining {
            // Groups still led here wake, to hand their leadership over.
            let led: Vec<GroupId> = self.leading().collect();
            for id in led {
                self.wake(id);
            }
        }
        let awake: Vec<GroupId> = self.awake.iter().copied().collect();
        for id in awake {
            let Some(g) = self.groups.get_mut(&id) else {
                self.awake.remove(&id);
                continue;
            };
            if draining {
                if g.raw.raft.state == StateRole::Leader {
                    hand_over(&mut g.raw, &self.peers);
                    g.raw.tick();
                } else {
                    // A follower's tick only counts towards its election: count, up to the
                    // timeout (past it, this member's lease is over and it grants votes to
                    // others), but never campaign.
                    let r = &mut g.raw.raft;
                    if r.election_elapsed < r.election_timeout() {
                        r.election_elapsed += 1;
                    }
                }
            } else {
                g.raw.tick();
            }
            self.stats.group_ticks += 1;
            self.touched.insert(id);
            let want = if g.raw.raft.state == StateRole::Leader {
                wanted_members(
                    self.target.as_deref(),
                    &self.cfg.nodes,
                    self.group_voters.get(&id).map(Option::as_deref),
                )
            } else {
                None
            };
            if let Some(want) = &want {
                reconcile(id, &mut g.raw, want, &self.peers);
            }
            let quiet = is_quiet(&g.raw, &self.peers)
                && want
                    .as_ref()
                    .is_none_or(|w| Members::from_conf_state(g.raw.store().conf_state()) == *w);
            g.quiet_ticks = if quiet { g.quiet_ticks + 1 } else { 0 };
            if g.quiet_ticks >= self.cfg.hibernate_ticks {
                self.awake.remove(&id);
                self.stats.hibernations += 1;
                release_for_sleep(g);
            }
        }
    }

    /// The batches for the peers; a snapshot among them counts as delivered (raft-rs waits for
    /// word of it before it sends the follower anything else). One that is lost is sent again:
    /// the follower refuses the appends that follow it, and the leader goes back to the snapshot.
    fn send_out(&mut self, mut out: Outbox) -> Vec<NodeBatch> {
        self.snapshot_reports.append(&mut out.snapshots);
        out.into_batches(self.cfg.node, self.cfg.boot, self.draining)
    }

    /// Proposes what was held for a transfer that is over, or refuses it if another node
    /// leads now.
    fn release_held(&mut self) -> Vec<(GroupId, Vec<u8>, Option<NodeId>)> {
        let mut refused = Vec::new();
        let groups: Vec<GroupId> = self.held.keys().copied().collect();
        for id in groups {
            let Some(g) = self.groups.get_mut(&id) else {
                if let Some(list) = self.held.remove(&id) {
                    refused.extend(list.into_iter().map(|d| (id, d, None)));
                }
                continue;
            };
            let r = &g.raw.raft;
            if r.state == StateRole::Leader && r.lead_transferee.is_some() {
                continue;
            }
            let Some(list) = self.held.remove(&id) else {
                continue;
            };
            if r.state == StateRole::Leader {
                let me = r.id;
                for data in list {
                    if let Err(e) = g.raw.propose(vec![], data.clone()) {
                        tracing::warn!(group = id.0, error = %e, "a held proposal was refused");
                        // Refused by the leader it still is (as `try_propose` says it).
                        refused.push((id, data, Some(me)));
                    }
                }
            } else {
                let leader = (r.leader_id != INVALID_ID).then_some(r.leader_id);
                refused.extend(list.into_iter().map(|d| (id, d, leader)));
            }
            self.touched.insert(id);
        }
        refused
    }

    /// Collects every touched group's ready state into one batch.
    pub fn ready(&mut self) -> ReadyBatch {
        let refused = self.release_held();
        for (id, to) in std::mem::take(&mut self.snapshot_reports) {
            if let Some(g) = self.groups.get_mut(&id) {
                g.raw.report_snapshot(to, raft::SnapshotStatus::Finish);
                self.touched.insert(id);
            }
        }
        let mut out = Outbox::default();
        for (group, msg) in std::mem::take(&mut self.asks) {
            out.add(group, vec![msg], &mut self.stats);
        }
        let mut readys = Vec::new();
        let mut committed = Vec::new();
        let mut snapshots = Vec::new();
        let mut must_sync = false;
        let mut leaders = Vec::new();
        let touched = std::mem::take(&mut self.touched);
        for id in touched {
            let Some(g) = self.groups.get_mut(&id) else {
                continue;
            };
            // raft-rs asks storage for a snapshot only while stepping or ticking, which touch
            // the group. Asked of the state machine at most once a second: it may take a while,
            // and raft-rs asks at every heartbeat meanwhile.
            if g.raw.store().take_snapshot_wanted() {
                let every = (1000 / self.cfg.tick_ms.max(1)).max(1);
                let last = self.wanted_at.get(&id).copied();
                if last.is_none_or(|t| self.ticks >= t + every) {
                    self.wanted_at.insert(id, self.ticks);
                    self.snapshots_wanted.insert(id);
                }
            }
            // Only stepping, proposing and ticking move a leader, and each touches the group.
            let (leader, term) = (g.raw.raft.leader_id, g.raw.raft.term);
            let new_term = leader != INVALID_ID && term > g.reported_term;
            if leader != g.reported_leader || new_term {
                if leader != INVALID_ID {
                    g.leader_changes += 1;
                }
                g.reported_leader = leader;
                if leader != INVALID_ID {
                    g.reported_term = term;
                }
                leaders.push((id, (leader != INVALID_ID).then_some(leader)));
            }
            if !g.raw.has_ready() {
                continue;
            }
            let mut rd = g.raw.ready();
            out.add(id, rd.take_messages(), &mut self.stats);
            let entries = rd.take_committed_entries();
            if apply_member_changes(id, &mut g.raw, &entries, &mut self.member_changes) {
                // Applying one may have made messages (appends to a new member): next pass.
                self.touched.insert(id);
            }
            push_committed(&mut committed, id, entries);
            let store = g.raw.mut_store();
            let snap = rd.snapshot();
            let installed = (!snap.is_empty()).then(|| StoredSnapshot {
                meta: SnapshotMeta {
                    index: snap.get_metadata().index,
                    term: snap.get_metadata().term,
                },
                data: snap.data.clone(),
                members: Some(Members::from_conf_state(
                    snap.get_metadata().get_conf_state(),
                )),
            });
            if let Some(s) = &installed {
                tracing::info!(
                    group = id.0,
                    index = s.meta.index,
                    bytes = s.data.len(),
                    "snapshot from the leader"
                );
                let conf = snap.get_metadata().get_conf_state().clone();
                self.member_changes
                    .push((id, Members::from_conf_state(&conf)));
                store.apply_snapshot(s.meta, conf);
            }
            if let Err(e) = store.append(rd.entries()) {
                tracing::error!(group = id.0, error = %e, "group log append");
            }
            if let Some(hs) = rd.hs() {
                store.set_hard_state(hs.clone());
            }
            if let Some(s) = installed {
                snapshots.push((id, s, store.hard_state().clone()));
            }
            must_sync |= rd.must_sync();
            readys.push((id, rd));
        }
        if std::mem::take(&mut self.heartbeat_due) {
            for node in self.peers.keys() {
                if !out.msgs.contains_key(node) {
                    out.msgs.insert(*node, Vec::new());
                    self.stats.node_heartbeats_sent += 1;
                }
            }
        }
        ReadyBatch {
            messages: self.send_out(out),
            leaders,
            members: std::mem::take(&mut self.member_changes),
            snapshots_wanted: std::mem::take(&mut self.snapshots_wanted)
                .into_iter()
                .collect(),
            starts: std::mem::take(&mut self.starts),
            peers: std::mem::take(&mut self.peer_changes),
            draining: std::mem::take(&mut self.drain_changes),
            refused,
            readys,
            committed,
            snapshots,
            must_sync,
        }
    }

    /// The asynchronous alternative to `persist` and `advance`: sends `batch`'s Raft state off to
    /// be written and lets the groups go on at once (raft-rs's `advance_append_async`). Returns
    /// the committed entries to apply and the job for the log writer. Send `batch.messages`
    /// first; a leader's entries count towards a commit only after `on_persisted`.
    pub fn submit(&mut self, batch: ReadyBatch) -> (Vec<Committed>, PersistJob) {
        let mut job = PersistJob {
            writes: Vec::with_capacity(batch.readys.len()),
            held: Vec::new(),
            snapshots: batch.snapshots,
            starts: batch.starts,
            must_sync: batch.must_sync,
        };
        for (id, mut rd) in batch.readys {
            let Some(g) = self.groups.get_mut(&id) else {
                continue;
            };
            let number = rd.number();
            let entries = rd.take_entries();
            let hs = rd.hs().cloned();
            let held = rd.take_persisted_messages();
            if !held.is_empty() {
                job.held.push((id, held));
            }
            let snapshot = !rd.snapshot().is_empty();
            g.raw.advance_append_async(rd);
            if !snapshot {
                // A snapshot counts as applied only once it is written (`on_persisted`).
                g.raw.advance_apply();
            }
            job.writes.push((id, entries, hs, number));
        }
        (batch.committed, job)
    }

    /// Tells the groups a submitted job is durable; returns the messages it held back.
    pub fn on_persisted(&mut self, job: PersistJob) -> Vec<NodeBatch> {
        for (id, _, _, number) in &job.writes {
            if let Some(g) = self.groups.get_mut(id) {
                g.raw.on_persist_ready(*number);
                if let Some((_, snap, _)) = job.snapshots.iter().find(|(g, _, _)| g == id) {
                    g.raw.advance_apply_to(snap.meta.index);
                }
                compact(g, &self.cfg);
                self.touched.insert(*id);
            }
        }
        let mut out = Outbox::default();
        for (id, msgs) in job.held {
            out.add(id, msgs, &mut self.stats);
        }
        self.send_out(out)
    }

    /// Tells the groups their batch is durable; returns what that releases.
    pub fn advance(&mut self, batch: ReadyBatch) -> Advanced {
        let mut out = Outbox::default();
        let mut committed = batch.committed;
        for (id, mut rd) in batch.readys {
            let Some(g) = self.groups.get_mut(&id) else {
                continue;
            };
            out.add(id, rd.take_persisted_messages(), &mut self.stats);
            let mut light = g.raw.advance(rd);
            if let Some(commit) = light.commit_index() {
                g.raw.mut_store().set_commit(commit);
            }
            out.add(id, light.take_messages(), &mut self.stats);
            let entries = light.take_committed_entries();
            if apply_member_changes(id, &mut g.raw, &entries, &mut self.member_changes) {
                self.touched.insert(id);
            }
            push_committed(&mut committed, id, entries);
            g.raw.advance_apply();
            compact(g, &self.cfg);
            if g.raw.has_ready() {
                self.touched.insert(id);
            }
        }
        Advanced {
            messages: self.send_out(out),
            snapshots: batch
                .snapshots
                .into_iter()
                .map(|(g, s, _)| (g, s))
                .collect(),
            committed,
        }
    }
}

/// Starts a leader's transfer to a [`transfer_target`] (none such: it stays and tries again at
/// the next tick; RabbitMQ skips the transfer without a candidate).
fn hand_over(raw: &mut RawNode<GroupLog>, peers: &BTreeMap<NodeId, Peer>) {
    if raw.raft.lead_transferee.is_some() {
        return;
    }
    if let Some(to) = transfer_target(raw, peers, None) {
        raw.transfer_leader(to);
    }
}

/// A peer (`only` that one, if given) that is up, not draining and replicating (not waiting
/// for a snapshot or probing), the most caught-up one. raft-rs sends it the rest of the log
/// and then `TimeoutNow`; proposals are held meanwhile, so the log stops growing and the
/// catch-up is short.
fn transfer_target(
    raw: &RawNode<GroupLog>,
    peers: &BTreeMap<NodeId, Peer>,
    only: Option<NodeId>,
) -> Option<NodeId> {
    let r = &raw.raft;
    let voters = r.prs().conf().voters().ids();
    r.prs()
        .iter()
        .filter(|(id, pr)| **id != r.id && pr.state == raft::ProgressState::Replicate)
        .filter(|(id, _)| voters.contains(**id))
        .filter(|(id, _)| only.is_none_or(|o| o == **id))
        .filter(|(id, _)| peers.get(id).is_some_and(|p| p.up && !p.draining))
        .max_by_key(|(id, pr)| (pr.matched, std::cmp::Reverse(**id)))
        .map(|(id, _)| *id)
}

/// Nothing to do: all entries committed and applied; a leader's live followers have every entry
/// and know it is committed; a follower knows a live leader.
fn is_quiet(raw: &RawNode<GroupLog>, peers: &BTreeMap<NodeId, Peer>) -> bool {
    let r = &raw.raft;
    let log = &r.raft_log;
    if log.applied < log.committed || log.last_index() != log.committed {
        return false;
    }
    match r.state {
        StateRole::Leader => {
            r.lead_transferee.is_none()
                && !r.has_pending_conf()
                && r.prs().iter().all(|(id, pr)| {
                    // A follower sleeps with everything applied only if it knows the commit index:
                    // its responses report it, and a lost one keeps the leader heartbeating.
                    *id == r.id
                        || (pr.matched == log.last_index() && pr.committed_index >= log.committed)
                        || !peers.get(id).is_some_and(|p| p.up)
                })
        }
        StateRole::Follower => {
            r.leader_id != INVALID_ID && peers.get(&r.leader_id).is_some_and(|p| p.up)
        }
        _ => false,
    }
}

/// The answer of a member waiting for its leader's snapshot to the leader's `append`: refused,
/// with a request for a snapshot (raft-rs's `request_snapshot` needs a follower that knows its
/// leader and has a log; this member has neither).
fn snapshot_request(append: &Message) -> Message {
    let mut m = Message::default();
    m.set_msg_type(MessageType::MsgAppendResponse);
    m.to = append.from;
    m.from = append.to;
    m.term = append.term;
    m.index = append.index;
    m.reject = true;
    m.reject_hint = 0;
    m.log_term = 0;
    m.request_snapshot = 1;
    m
}

/// A member being added, before its leader's snapshot: it knows no member and has no entry.
fn awaits_snapshot(raw: &RawNode<GroupLog>) -> bool {
    raw.raft.raft_log.last_index() == 0 && raw.store().conf_state().voters.is_empty()
}

/// A leader about to send a learner the log from its first entry (the learner has none) sends
/// its snapshot instead: the learner takes its members from it (see
/// [`MultiRaft::join_group`]). raft-rs sends a snapshot to a follower with a pending request.
fn snapshot_for_new_learners(raw: &mut RawNode<GroupLog>) {
    // Called for every message a leader steps: nothing to look at without learners.
    if raw.store().conf_state().learners.is_empty() {
        return;
    }
    // A learner the group started with (a queue's voters of its own) has the log from its
    // first entry on, as the voters do; and where the log's base is a snapshot, raft-rs sends
    // it by itself to a member that lacks what came before.
    let base = raw.store().base_conf();
    let learners: Vec<NodeId> = raw
        .store()
        .conf_state()
        .learners
        .iter()
        .copied()
        .filter(|n| !base.learners.contains(n) && !base.voters.contains(n))
        .collect();
    for id in learners {
        if let Some(pr) = raw.raft.mut_prs().get_mut(id) {
            let wants_all = pr.matched == 0 && pr.next_idx <= 1;
            if wants_all
                && pr.pending_request_snapshot == raft::INVALID_INDEX
                && pr.state != raft::ProgressState::Snapshot
            {
                pr.pending_request_snapshot = 1;
            }
        }
    }
}

/// Applies the membership changes among committed entries to the group (raft-rs's part of
/// applying them: its progress tracker and who may vote), and records the members after each.
fn apply_member_changes(
    id: GroupId,
    raw: &mut RawNode<GroupLog>,
    entries: &[Entry],
    changes: &mut Vec<(GroupId, Members)>,
) -> bool {
    let before = changes.len();
    for e in entries {
        let applied = match e.get_entry_type() {
            EntryType::EntryConfChangeV2 => ConfChangeV2::parse_from_bytes(&e.data)
                .map_err(|e| e.to_string())
                .and_then(|cc| raw.apply_conf_change(&cc).map_err(|e| e.to_string())),
            EntryType::EntryConfChange => ConfChange::parse_from_bytes(&e.data)
                .map_err(|e| e.to_string())
                .and_then(|cc| raw.apply_conf_change(&cc).map_err(|e| e.to_string())),
            EntryType::EntryNormal => continue,
        };
        match applied {
            Ok(cs) => {
                let members = Members::from_conf_state(&cs);
                tracing::info!(
                    group = id.0,
                    index = e.index,
                    ?members,
                    "group members changed"
                );
                raw.mut_store().conf_applied(e.index, cs);
                changes.push((id, members));
            }
            // Every member applies the same entry the same way; one that cannot is a bug, and
            // skipping it leaves this member's view of the members as it was.
            Err(why) => {
                tracing::error!(group = id.0, index = e.index, error = %why, "a membership change could not be applied")
            }
        }
    }
    changes.len() > before
}

/// What [`MultiRaft::wanted_members`] answers, from the node-wide target (else the cluster's
/// nodes at start, when the group has voters of its own).
fn wanted_members(
    target: Option<&[NodeId]>,
    nodes: &[NodeId],
    own: Option<Option<&[NodeId]>>,
) -> Option<Members> {
    let Some(own) = own else {
        return target.map(|t| Members::voters(t.to_vec()));
    };
    let cluster = target.unwrap_or(nodes);
    let Some(own) = own else {
        return Some(Members::voters(cluster.to_vec()));
    };
    let voters: Vec<NodeId> = own
        .iter()
        .copied()
        .filter(|n| cluster.contains(n))
        .collect();
    if voters.is_empty() {
        // None of its voters is left in the cluster: every node votes rather than none.
        return Some(Members::voters(cluster.to_vec()));
    }
    let mut learners: Vec<NodeId> = cluster
        .iter()
        .copied()
        .filter(|n| !voters.contains(n))
        .collect();
    learners.sort_unstable();
    learners.dedup();
    let mut m = Members::voters(voters);
    m.learners = learners;
    Some(m)
}

/// Whether a learner holds the log up to [`CAUGHT_UP_LAG`] entries behind `committed`, as its
/// answers said (`matched` moves only on them). A learner that took a snapshot while the
/// leader had nothing more to send stays in raft-rs's probe state: the answer to the snapshot
/// takes it from snapshot to probe, and only an answer to an append takes it on to replicate,
/// which an idle group never sends. Waiting for replicate left such a learner unpromoted until
/// the group's next entry.
fn learner_caught_up(pr: &raft::Progress, committed: u64) -> bool {
    let answered = match pr.state {
        raft::ProgressState::Replicate => true,
        raft::ProgressState::Probe => pr.matched > 0,
        raft::ProgressState::Snapshot => false,
    };
    answered && pr.matched + CAUGHT_UP_LAG >= committed
}

/// The next step of a group this node leads towards the members `want`, proposed if there is
/// one and no other is in progress. Nodes come in before any goes, and a voter leaves (or
/// becomes a learner) only once the voters coming in vote, so that a change never leaves the
/// group with fewer voters than it had; a member that is down goes first, as it only lowers
/// the group's tolerance while it stays.
fn reconcile(
    id: GroupId,
    raw: &mut RawNode<GroupLog>,
    want: &Members,
    peers: &BTreeMap<NodeId, Peer>,
) {
    let r = &raw.raft;
    if r.has_pending_conf() || r.lead_transferee.is_some() {
        return;
    }
    let me = r.id;
    let cs = raw.store().conf_state();
    let (voters, learners) = (cs.voters.clone(), cs.learners.clone());
    let up = |n: &NodeId| peers.get(n).is_some_and(|p| p.up);
    let committed = r.raft_log.committed;
    let caught_up = |n: &NodeId| {
        r.prs()
            .get(*n)
            .is_some_and(|pr| learner_caught_up(pr, committed))
    };
    let member = |n: &NodeId| voters.contains(n) || learners.contains(n);
    let gone: Vec<NodeId> = voters
        .iter()
        .chain(&learners)
        .copied()
        .filter(|n| !want.contains(*n))
        .collect();
    let to_add = want
        .voters
        .iter()
        .chain(&want.learners)
        .copied()
        .find(|n| !member(n) && up(n));
    let to_promote = learners
        .iter()
        .copied()
        .find(|n| want.voters.contains(n) && up(n) && caught_up(n));
    let change = if let Some(down) = gone.iter().copied().find(|n| *n != me && !up(n)) {
        Some(MemberChange::Remove(down))
    } else if let Some(new) = to_add {
        Some(MemberChange::AddLearner(new))
    } else if let Some(ready) = to_promote {
        Some(MemberChange::Promote(ready))
    } else if want.voters.iter().any(|n| !voters.contains(n)) {
        // A voter to be that does not vote yet: a learner catching up, or a node down (or not
        // a member yet). Nothing leaves until it votes.
        None
    } else if !want.voters.contains(&me) {
        // Removing (or demoting) the leader itself is what raft-rs handles least well: another
        // leads first, one that can (replicating, up, not in maintenance mode).
        if let Some(to) = voters
            .iter()
            .copied()
            .filter(|v| *v != me && want.voters.contains(v))
            .find(|v| transfer_target(raw, peers, Some(*v)).is_some())
        {
            raw.transfer_leader(to);
        }
        None
    } else {
        // A running voter leaves (or becomes a learner) only while the voters staying have a
        // majority up: else the group would stop where it still commits.
        let staying_up = |n: NodeId| {
            let staying: Vec<NodeId> = voters.iter().copied().filter(|v| *v != n).collect();
            let running = staying.iter().filter(|v| **v == me || up(v)).count();
            running > staying.len() / 2
        };
        let demoted: Vec<NodeId> = voters
            .iter()
            .copied()
            .filter(|n| want.learners.contains(n))
            .collect();
        match demoted.first() {
            Some(_) => demoted
                .into_iter()
                .find(|n| staying_up(*n))
                .map(MemberChange::Demote),
            None => gone
                .first()
                .copied()
                .filter(|n| !voters.contains(n) || staying_up(*n))
                .map(MemberChange::Remove),
        }
    };
    if let Some(change) = change {
        tracing::info!(group = id.0, ?change, "membership change proposed");
        if let Err(e) = raw.propose_conf_change(Vec::new(), change.to_conf_change()) {
            tracing::warn!(group = id.0, error = %e, "membership change refused");
        }
    }
}

fn push_committed(out: &mut Vec<Committed>, group: GroupId, entries: Vec<Entry>) {
    out.extend(
        entries
            .into_iter()
            .filter(|e| e.get_entry_type() == EntryType::EntryNormal && !e.data.is_empty())
            .map(|e| Committed {
                group,
                index: e.index,
                term: e.term,
                data: e.data,
            }),
    );
}

/// How far behind (in [`Config::log_keep`]s) a follower may be for its leader to keep what it
/// lacks in memory, when the durable log can be read back.
pub const LAGGING_IN_MEMORY: u64 = 8;

/// A group going to sleep gives back what it needs only while busy: the entries it holds in
/// memory, all applied (read back from the durable log if a peer or an election ever needs
/// them), and the room raft-rs keeps for entries not yet persisted. Thousands of idle queues
/// each kept about a kilobyte of both.
fn release_for_sleep(g: &mut Group) {
    let applied = g.raw.raft.raft_log.applied;
    let store = g.raw.mut_store();
    if store.has_cold() && applied >= store.first_index() {
        store.compact_to(applied);
    }
    store.release_spare();
    let unstable = &mut g.raw.raft.raft_log.unstable;
    if unstable.entries.is_empty() {
        unstable.entries = Vec::new();
    }
}

/// Drops applied entries beyond the keep window, never past what a follower close behind still
/// needs (one further behind reads from the durable log, when there is one to read).
fn compact(g: &mut Group, cfg: &Config) {
    let r = &g.raw.raft;
    let applied = r.raft_log.applied;
    let store = r.raft_log.store();
    let keep_bytes = cfg.log_keep_bytes;
    if (store.len() as u64) < cfg.log_keep.saturating_mul(2)
        && store.bytes() < keep_bytes.saturating_mul(2)
    {
        return;
    }
    let mut to = applied
        .saturating_sub(cfg.log_keep)
        .max(store.index_keeping(keep_bytes))
        .min(applied);
    if r.state == StateRole::Leader {
        let cold = store.has_cold();
        // Below this a follower is far behind: by entries, or by their bytes.
        let far = applied
            .saturating_sub(cfg.log_keep.saturating_mul(LAGGING_IN_MEMORY))
            .max(if cold {
                store.index_keeping(keep_bytes.saturating_mul(LAGGING_IN_MEMORY as usize))
            } else {
                0
            });
        for (id, pr) in r.prs().iter() {
            if *id != r.id && !(cold && pr.matched < far) {
                to = to.min(pr.matched);
            }
        }
    }
    if to >= g.raw.store().first_index() {
        g.raw.mut_store().compact_to(to);
    }
}

#[derive(Default)]
struct Outbox {
    msgs: BTreeMap<NodeId, Vec<Envelope>>,
    /// Snapshots sent, by group and peer.
    snapshots: Vec<(GroupId, NodeId)>,
}

impl Outbox {
    fn add(&mut self, group: GroupId, msgs: Vec<Message>, stats: &mut Stats) {
        for msg in msgs {
            stats.raft_msgs_sent += 1;
            if msg.get_msg_type() == MessageType::MsgSnapshot {
                self.snapshots.push((group, msg.to));
            }
            self.msgs
                .entry(msg.to)
                .or_default()
                .push(Envelope { group, msg });
        }
    }

    fn into_batches(self, from: NodeId, boot: u64, draining: bool) -> Vec<NodeBatch> {
        self.msgs
            .into_iter()
            .map(|(to, msgs)| NodeBatch {
                forwards: Vec::new(),
                from,
                boot,
                to,
                draining,
                msgs,
            })
            .collect()
    }
}

#[cfg(test)]
pub(crate) fn wanted_members_for_tests(
    target: Option<&[NodeId]>,
    nodes: &[NodeId],
    own: Option<Option<&[NodeId]>>,
) -> Option<Members> {
    wanted_members(target, nodes, own)
}

#[cfg(test)]
mod caught_up_tests {
    use super::*;

    /// What raft-rs does with a learner sent a snapshot at index 10 whose answer comes back
    /// before the leader hears the snapshot was sent: snapshot, then probe, and no append
    /// follows while the group has nothing new.
    #[test]
    fn a_learner_that_took_a_snapshot_while_the_group_was_idle_is_caught_up() {
        let mut pr = raft::Progress::new(1, 256);
        assert!(
            !learner_caught_up(&pr, 10),
            "a new learner has answered nothing"
        );
        pr.become_snapshot(10);
        assert!(!learner_caught_up(&pr, 10), "still taking the snapshot");
        assert!(pr.maybe_update(10));
        assert!(pr.is_snapshot_caught_up());
        pr.become_probe();
        assert_eq!(pr.state, raft::ProgressState::Probe);
        assert!(learner_caught_up(&pr, 10));
        assert!(
            !learner_caught_up(&pr, 10 + CAUGHT_UP_LAG + 1),
            "too far behind"
        );
    }

    #[test]
    fn a_replicating_learner_is_caught_up_within_the_lag() {
        let mut pr = raft::Progress::new(1, 256);
        assert!(pr.maybe_update(100));
        pr.become_replicate();
        assert!(learner_caught_up(&pr, 100 + CAUGHT_UP_LAG));
        assert!(!learner_caught_up(&pr, 101 + CAUGHT_UP_LAG));
    }
}
