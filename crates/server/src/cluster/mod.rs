//! One node's Raft groups, run for real: a thread owning the node's [`MultiRaft`] and its
//! node-wide [`EngineLog`] (see [`node`]), and an authenticated TCP transport to the other
//! nodes (see [`transport`]). The broker feeds it through a [`RaftNode`] handle and hears back
//! through [`RaftEvents`]; nothing here knows what the entries mean.

mod address;
mod auth;
mod link_tls;
mod node;
mod pieces;
mod transport;
mod wire;

#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub use address::PeerAddr;
pub use link_tls::ClusterTlsFiles;
pub use node::SnapshotBody;
pub use warren_replication::{Committed, Forward, GroupId, NodeId, SnapshotMeta, StoredSnapshot};

/// A forward to this group carries the sender's figures for `/api/nodes` (every few seconds),
/// not a proposal. A node that predates it drops it, as a forward to a group it does not have.
/// (The top group number is the wire's draining marker; queues' numbers are hashes, which this
/// one is as likely to meet as any other.)
pub const NODE_FIGURES: GroupId = GroupId((1 << 63) - 2);
/// A forward to this group asks the receiver to restart one of the shovels it runs (a restart
/// asked through another node's API): the vhost's length (4 bytes), the vhost, the name.
pub const SHOVEL_RESTART: GroupId = GroupId((1 << 63) - 3);
/// A forward to this group is a node's request to join the cluster (it started with
/// `--cluster-join`): its cluster address (`HOST:PORT`, as UTF-8), then a 0 byte and its
/// feature level in decimal. The only thing a node that is no member may send.
pub const JOIN_REQUEST: GroupId = GroupId((1 << 63) - 4);
/// A forward to this group carries how far the sender applied the metadata log (the broker's
/// `META_APPLIED`: 8 bytes, big-endian).
pub const META_APPLIED: GroupId = GroupId(warren_broker::META_APPLIED);
/// A forward to this group is a piece of a Raft message too large for one frame (`pieces`):
/// the transport puts the message together again, and no other part of a node sees it.
pub const PIECE: GroupId = GroupId((1 << 63) - 6);
/// A forward to this group answers a [`JOIN_REQUEST`] from a node the cluster has added but
/// that does not hold the metadata yet: the sender's peers, `ID=HOST:PORT` separated by commas.
/// The joining node links with them, so that the metadata group's leader, which it may not
/// have listed, can reach it (it refuses nodes it does not know).
pub const JOIN_PEERS: GroupId = GroupId((1 << 63) - 7);
use warren_replication::{Config, EngineLog, LogError, LogStore, MultiRaft};

use node::{Command, Driver};
use transport::{Counters, Net};

/// The largest proposal taken: a larger entry would not fit in a frame, never reach a
/// follower and stall its group. The margin covers the batch's and the message's other fields.
pub const MAX_PROPOSAL: usize = wire::MAX_FRAME - (64 << 10);
/// The largest snapshot a replicated queue takes once every node receives snapshots in pieces
/// (a larger queue keeps its log until it is smaller), while a node of the cluster runs a
/// version that puts a snapshot whose pieces it cannot spool together in memory.
pub const MAX_SNAPSHOT: usize = 1 << 30;
/// The largest snapshot once every node spools any size to its disk and maps it from there
/// (`LARGE_SNAPSHOTS_LEVEL`): the leader maps its file as it sends it, the follower spools the
/// pieces and maps them, and neither holds it in its heap. A queue beyond it (a terabyte of
/// messages) keeps its log.
pub const MAX_SNAPSHOT_LARGE: usize = pieces::MAX_PIECED;
/// The shortest cluster secret accepted.
pub const MIN_SECRET_LEN: usize = 16;
/// How long `shutdown` waits for the transport's tasks once the Raft thread has stopped.
const NET_SHUTDOWN: Duration = Duration::from_secs(1);

/// One node's place in the cluster.
#[derive(Clone)]
pub struct ClusterConfig {
    /// This node (never 0): its Raft id in every group.
    pub node: NodeId,
    /// Every other node's cluster address (a name is looked up at each dial).
    pub peers: BTreeMap<NodeId, PeerAddr>,
    /// This node's cluster address.
    pub listen: SocketAddr,
    /// Shared by every node, at least [`MIN_SECRET_LEN`] bytes (like Erlang's cookie).
    pub secret: Vec<u8>,
    /// TLS on every link to and from the peers (`None`: plain TCP).
    pub tls: Option<ClusterTlsFiles>,
    /// The node-wide Raft log's directory.
    pub dir: PathBuf,
    /// Raft's tick (50 ms by default): elections take 10 to 16 ticks, a silent peer is down
    /// after 4.
    pub tick_ms: u64,
    /// This start's incarnation, higher at every start (e.g. milliseconds since the epoch), so
    /// peers see a restart at once.
    pub boot: u64,
    /// Entries the log keeps behind a group's snapshot for a follower that lags (4096 by
    /// default); one further behind is sent the snapshot.
    pub snapshot_keep: u64,
    /// This node asks to join a running cluster (`--cluster-join`), giving the others this
    /// address (`HOST:PORT`, its own entry of `--cluster-nodes`): its links use the joining
    /// handshake, and it starts the metadata group waiting for its leader's snapshot.
    pub join: Option<String>,
    /// A snapshot larger than this goes to a follower in pieces ([`MAX_PROPOSAL`]; less in
    /// tests).
    pub inline_max: usize,
}

impl std::fmt::Debug for ClusterConfig {
    // Without the secret: a configuration may be logged.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterConfig")
            .field("node", &self.node)
            .field("peers", &self.peers)
            .field("listen", &self.listen)
            .field("tls", &self.tls)
            .field("dir", &self.dir)
            .field("tick_ms", &self.tick_ms)
            .field("boot", &self.boot)
            .field("snapshot_keep", &self.snapshot_keep)
            .field("join", &self.join)
            .field("inline_max", &self.inline_max)
            .finish_non_exhaustive()
    }
}

/// A proposal handed back: its group, its data, and the group's leader as far as this node
/// knows.
pub type Refused = (GroupId, Vec<u8>, Option<NodeId>);

/// What [`RaftEvents::preparer`] made of a snapshot's bytes, for [`RaftEvents::snapshots`].
pub type Prepared = Box<dyn std::any::Any + Send>;

/// Reads a leader's snapshot into what the state machine installs, on the snapshot writer's
/// thread.
pub type Preparer = Arc<dyn Fn(GroupId, bytes::Bytes) -> Prepared + Send + Sync>;

/// What the Raft thread tells the broker. Called on the Raft thread, with none of its locks
/// held; a slow callback slows every group, so hand work off rather than doing it here. In a
/// pass, `peers` comes first, then `leaders` (with the refused proposals), `snapshots` and
/// `committed`.
pub trait RaftEvents: Send + 'static {
    /// Snapshots that replace their groups' state machines: a leader's, installed here in place
    /// of the log this node lacked, or, after a restart, each group's latest one, before the
    /// entries after it. A leader's large snapshot comes with what the [`RaftEvents::preparer`]
    /// made of it, when it made something.
    fn snapshots(&self, snapshots: Vec<(GroupId, StoredSnapshot, Option<Prepared>)>);
    /// Reads a large snapshot from a leader before Raft installs it, away from the Raft
    /// thread (decoding a deep queue's takes about a third of a second per GiB).
    fn preparer(&self) -> Option<Preparer> {
        None
    }
    /// Entries now committed and durable here, in log order within each group. After a
    /// restart every recovered committed entry after the group's snapshot comes again, before
    /// new ones.
    fn committed(&self, entries: Vec<Committed>);
    /// Groups whose leader changed (`None`: no leader known for now), with the group's term;
    /// then the proposals this node could not take in the pass, each with its group, its data
    /// (empty only if raft-rs itself dropped it) and who leads the group if known: it does not
    /// lead the group (proposals held through a leadership transfer come back so once it
    /// follows), has no such group, or the proposal is above [`MAX_PROPOSAL`] (`leader` is who
    /// leads, this node included). One report, so that nothing this node's clients do comes
    /// between a step-down and the proposals it hands back, and both come before the pass's
    /// committed entries (a new leader's first entry gives up what this node proposed as
    /// leader and did not hand on).
    fn leaders(&self, changes: Vec<(GroupId, Option<NodeId>, u64)>, refused: Vec<Refused>);
    /// Peer nodes seen going down (`false`: its connection closed, or its heartbeats stopped)
    /// or coming back (`true`), in order. Comes first in a pass.
    fn peers(&self, changes: Vec<(NodeId, bool)>);
    /// Peer nodes that went into maintenance mode (`true`) or came out of it, in order.
    fn draining(&self, changes: Vec<(NodeId, bool)>) {
        let _ = changes;
    }
    /// Proposals other nodes sent for groups they believe this node leads, with the sender.
    fn forwarded(&self, entries: Vec<(NodeId, Forward)>) {
        let _ = entries;
    }
    /// The Raft log could not be written (a full disk, an I/O error): the Raft thread stops
    /// after this call (an fsync that failed cannot be retried safely). Nothing replicated can
    /// go on here until a restart.
    fn log_failed(&self, error: &str) {
        let _ = error;
    }
    /// Groups whose leader here needs the state machine's snapshot now (a node being added
    /// starts from one): answer with [`RaftNode::snapshot`].
    fn snapshots_wanted(&self, groups: Vec<GroupId>) {
        let _ = groups;
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("cluster configuration: {0}")]
    Config(String),
    #[error("raft log in {dir}: {source}")]
    Log { dir: PathBuf, source: LogError },
    #[error("raft: {0}")]
    Raft(#[from] warren_replication::Error),
    #[error("cluster address {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("{0}")]
    Tls(String),
    #[error("cluster transport runtime: {0}")]
    Runtime(std::io::Error),
    #[error("raft thread: {0}")]
    Thread(std::io::Error),
}

/// Transport counters since start.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ClusterStats {
    /// Batches from peers handed to the Raft thread.
    pub batches_in: u64,
    /// Frames written to peers.
    pub batches_out: u64,
    /// Batches from peers dropped because the Raft thread's queue was full.
    pub dropped_in: u64,
    /// Batches to peers dropped: the peer's queue was full or its connection down.
    pub dropped_out: u64,
    /// Raft messages never sent: too large for a frame (or for pieces), or a snapshot of a
    /// group whose previous one was still going out in pieces.
    pub skipped_msgs: u64,
    /// Raft messages (snapshots) sent whole in pieces, and put together from pieces.
    pub pieced_out: u64,
    pub pieced_in: u64,
    /// Leaders' snapshots written to disk by the writer thread and handed to Raft, and those
    /// Raft then found written when it installed them (it only renamed the file into place).
    pub staged_in: u64,
    pub staged_used: u64,
    /// Entries this node proposed joining several proposals of one group, and the proposals
    /// they held ([`warren_replication::batch`]).
    pub joined_entries: u64,
    pub joined_parts: u64,
    /// Incoming connections that failed authentication.
    pub refused: u64,
    /// Authenticated connections dropped for a bad frame or batch.
    pub bad_frames: u64,
    pub connections_in: u64,
    pub connections_out: u64,
    /// Connections to peers that failed (refused, unreachable, timed out).
    pub dial_failures: u64,
}

/// A handle on the node's Raft thread; clones share it. Methods only queue work and never
/// block, except `shutdown`.
#[derive(Clone)]
pub struct RaftNode {
    inner: Arc<Inner>,
}

struct Inner {
    node: NodeId,
    /// This node asks to join, at this address (see [`ClusterConfig::join`]).
    joining: Option<String>,
    commands: crossbeam_channel::Sender<Command>,
    recovered: Vec<GroupId>,
    counters: Arc<Counters>,
    thread: Mutex<Option<JoinHandle<()>>>,
    net: Mutex<Option<Net>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // The last handle went without `shutdown`: stop without waiting (this may be async code).
        let _ = self.commands.send(Command::Shutdown);
    }
}

fn validate(cfg: &ClusterConfig) -> Result<(), ClusterError> {
    let bad = |m: &str| Err(ClusterError::Config(m.to_string()));
    if cfg.node == 0 || cfg.peers.contains_key(&0) {
        return bad("node ids must not be 0");
    }
    if cfg.peers.contains_key(&cfg.node) {
        return bad("peers must not hold this node");
    }
    if cfg.secret.len() < MIN_SECRET_LEN {
        return bad("the cluster secret is too short");
    }
    if cfg.tick_ms == 0 {
        return bad("tick_ms must be above 0");
    }
    if cfg.boot == 0 {
        return bad("boot must be above 0");
    }
    Ok(())
}

impl RaftNode {
    /// Opens the log, recovers every group it holds (see [`RaftNode::groups`]), binds the
    /// cluster address and starts the Raft thread and the transport.
    pub fn start(cfg: ClusterConfig, events: impl RaftEvents) -> Result<RaftNode, ClusterError> {
        validate(&cfg)?;
        let mut nodes: Vec<NodeId> = cfg.peers.keys().copied().collect();
        nodes.push(cfg.node);
        nodes.sort_unstable();
        let mut rc = Config::new(cfg.node, nodes);
        rc.tick_ms = cfg.tick_ms;
        rc.boot = cfg.boot;
        rc.snapshot_keep = cfg.snapshot_keep;
        let mut raft = MultiRaft::new(rc)?;
        let log_error = |source| ClusterError::Log {
            dir: cfg.dir.clone(),
            source,
        };
        let mut log = EngineLog::open(&cfg.dir).map_err(log_error)?;
        // A follower far behind is sent what left the leader's memory, read back from disk, or
        // the group's snapshot.
        raft.set_cold_log(log.cold());
        raft.set_snapshot_source(log.snapshot_reader().map_err(ClusterError::Thread)?);
        let recovered = log.groups();
        let mut joining = cfg.join.clone();
        if recovered.contains(&GroupId(0)) && joining.is_some() {
            // It joined on an earlier start: a member now, whatever the flag says (a node the
            // cluster forgot, started again on its data, must not ask back in).
            tracing::info!(
                node = cfg.node,
                "--cluster-join ignored: this node holds the cluster's metadata already"
            );
            joining = None;
        }
        let mut snapshots = Vec::new();
        for group in &recovered {
            let mut durable = log.durable(*group).map_err(log_error)?;
            if durable.fit_to_snapshot() {
                // A crash after a leader's snapshot was saved, before the old log was dropped.
                tracing::warn!(
                    node = cfg.node,
                    group = group.0,
                    "log entries that do not follow the group's snapshot dropped"
                );
                log.clear_entries(*group, &durable.hard_state)
                    .and_then(|()| log.flush(true))
                    .map_err(log_error)?;
            }
            raft.recover_group(*group, &durable)?;
            if let Some(s) = durable.snapshot {
                snapshots.push((*group, s));
            }
        }
        let counters = Arc::new(Counters::default());
        let (in_tx, in_rx) = crossbeam_channel::bounded(transport::INBOUND_QUEUE);
        let (net, out, inbound_budget) =
            transport::start(&cfg, joining.is_some(), in_tx, counters.clone())?;
        let (cmd_tx, cmd_rx) = crossbeam_channel::unbounded();
        let writer = node::SnapshotWriter::start(cfg.node, log.snapshot_files(), events.preparer())
            .map_err(ClusterError::Thread)?;
        let driver = Driver {
            raft,
            log,
            events,
            out,
            commands: cmd_rx,
            inbound: in_rx,
            inbound_budget,
            epoch: Instant::now(),
            refused: Vec::new(),
            joining: Vec::new(),
            to_forward: Default::default(),
            forwarded: Vec::new(),
            snapshots,
            writer,
            receiving: Default::default(),
            prepared: Default::default(),
            counters: counters.clone(),
            stopping: false,
            awaiting: Default::default(),
            deferred: Default::default(),
            deferring: Default::default(),
            proposed: Default::default(),
            written: Vec::new(),
        };
        let thread = std::thread::Builder::new()
            .name(format!("warren-raft-{}", cfg.node))
            .spawn(move || driver.run())
            .map_err(ClusterError::Thread)?;
        tracing::info!(node = cfg.node, listen = %cfg.listen, peers = cfg.peers.len(), recovered = recovered.len(), "cluster node started");
        Ok(RaftNode {
            inner: Arc::new(Inner {
                node: cfg.node,
                joining,
                commands: cmd_tx,
                recovered,
                counters,
                thread: Mutex::new(Some(thread)),
                net: Mutex::new(Some(net)),
            }),
        })
    }

    pub fn node(&self) -> NodeId {
        self.inner.node
    }

    /// The address this node gives the cluster it asks to join, if it does (started with
    /// `--cluster-join`, holding no metadata yet).
    pub fn joining(&self) -> Option<String> {
        self.inner.joining.clone()
    }

    /// Maintenance mode on or off: this node hands its leaderships away and stands for none.
    pub fn set_draining(&self, on: bool) {
        self.send(Command::Drain(on));
    }

    /// The cluster's nodes are now `voters` (it added or forgot one; `addresses` are those of
    /// nodes this node's list lacks, `HOST:PORT`): every group this node leads moves to them,
    /// one change at a time, and the others are no peers any more.
    pub fn set_members(&self, voters: Vec<NodeId>, addresses: Vec<(NodeId, String)>) {
        self.send(Command::Members(voters, addresses));
    }

    /// A group's voters of its own (`x-quorum-initial-group-size`): the cluster's other nodes
    /// hold it as learners. Before the group's creation, it is made with them.
    pub fn set_group_voters(&self, group: GroupId, voters: Option<Vec<NodeId>>) {
        self.send(Command::GroupVoters(group, voters));
    }

    /// Makes this node's member of a group it is being added to: it waits for its leader's
    /// snapshot ([`MultiRaft::join_group`]), unless it exists.
    pub fn join_group(&self, group: GroupId) {
        self.send(Command::JoinGroup(group));
    }

    /// [`RaftNode::add_group`] with the voters it starts with (`None`: every node of the
    /// list, or the cluster's nodes as last set).
    pub fn add_group_with(&self, group: GroupId, campaign: bool, voters: Option<Vec<NodeId>>) {
        self.send(Command::AddGroup(group, campaign, voters));
    }

    /// Hands a group's leadership to another node, if this one leads it.
    pub fn transfer_leader(&self, group: GroupId, to: NodeId) {
        self.send(Command::Transfer(group, to));
    }

    /// Creates a group with every node as a voter, unless it exists. `campaign` starts an
    /// election here at once (the creator places the leader).
    pub fn add_group(&self, group: GroupId, campaign: bool) {
        self.send(Command::AddGroup(group, campaign, None));
    }

    /// Drops a group and its log (its queue was deleted).
    pub fn remove_group(&self, group: GroupId) {
        self.send(Command::RemoveGroup(group));
    }

    /// Proposes an entry; everything proposed before a pass goes into that pass's one write.
    /// The queue is not bounded here: the broker bounds what it has in flight (unconfirmed
    /// publishes). A proposal this node cannot take comes back through
    /// [`RaftEvents::refused`].
    pub fn propose(&self, group: GroupId, data: Vec<u8>) {
        self.send(Command::Propose(group, data));
    }

    /// [`RaftNode::propose`] for a group whose members all read joined entries
    /// ([`warren_replication::batch`]): the proposals a pass takes for it may share one entry.
    /// The group's state machine splits them back; a refusal hands back the joined entry.
    pub fn propose_joinable(&self, group: GroupId, data: Vec<u8>) {
        self.send(Command::ProposeJoinable(group, data));
    }

    /// Sends a proposal to `to`, which leads `group` (a publish on a node that does not): it
    /// reaches that node's [`RaftEvents::forwarded`], or is lost with the connection.
    pub fn forward(&self, to: NodeId, group: GroupId, data: Vec<u8>) {
        self.send(Command::Forward(to, group, data));
    }

    /// The state machine's snapshot of `group`, which holds every entry up to `meta.index`:
    /// once written, the log before it may go. An older one than the group has is ignored.
    pub fn snapshot(&self, group: GroupId, meta: SnapshotMeta, data: bytes::Bytes) {
        self.send(Command::Snapshot(group, meta, SnapshotBody::Ready(data)));
    }

    /// [`RaftNode::snapshot`] whose bytes `body` makes on the snapshot writer's thread.
    pub fn snapshot_with(&self, group: GroupId, meta: SnapshotMeta, body: SnapshotBody) {
        self.send(Command::Snapshot(group, meta, body));
    }

    /// The groups recovered from the log at start, in id order.
    pub fn groups(&self) -> &[GroupId] {
        &self.inner.recovered
    }

    pub fn stats(&self) -> ClusterStats {
        self.inner.counters.snapshot()
    }

    /// Every Raft group as this node sees it, from the Raft thread's next pass; `None` if it
    /// does not answer within `wait` (stopped, or a pass that takes longer).
    pub async fn group_status(
        &self,
        wait: std::time::Duration,
    ) -> Option<Vec<warren_replication::GroupStatus>> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.send(Command::Status(tx));
        tokio::time::timeout(wait, rx).await.ok()?.ok()
    }

    /// The groups this node leads whose members are not yet the cluster's nodes (after a
    /// node was added or forgotten), from the Raft thread's next pass; `None` if it does not
    /// answer within `wait`.
    pub async fn changing_members(&self, wait: std::time::Duration) -> Option<usize> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.send(Command::Changing(tx));
        tokio::time::timeout(wait, rx).await.ok()?.ok()
    }

    fn send(&self, c: Command) {
        if self.inner.commands.send(c).is_err() {
            tracing::debug!(
                node = self.inner.node,
                "raft thread stopped; command ignored"
            );
        }
    }

    /// Stops the Raft thread after its current pass (what it wrote stays written), then the
    /// transport, closing every connection. Other clones become inert. Blocks for at most a
    /// pass and [`NET_SHUTDOWN`], so from async code call it in `spawn_blocking`.
    pub fn shutdown(self) {
        let _ = self.inner.commands.send(Command::Shutdown);
        let thread = self.inner.thread.lock().ok().and_then(|mut t| t.take());
        // Called from a `RaftEvents` callback, the thread stops once the callback returns.
        let from_raft_thread = thread
            .as_ref()
            .is_some_and(|t| t.thread().id() == std::thread::current().id());
        if let Some(t) = thread.filter(|_| !from_raft_thread) {
            if t.join().is_err() {
                tracing::error!(node = self.inner.node, "raft thread panicked");
            }
        }
        let net = self.inner.net.lock().ok().and_then(|mut n| n.take());
        if let Some(net) = net {
            net.shutdown(NET_SHUTDOWN);
        }
        tracing::info!(node = self.inner.node, "cluster node stopped");
    }
}
