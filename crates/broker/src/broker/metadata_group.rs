//! The cluster's metadata group (group 0): where the definitions reach every node. Vhosts,
//! users, permissions, limits, policies, durable exchanges, their bindings to replicated
//! queues and to each other, and replicated queues themselves are the cluster's, as RabbitMQ
//! keeps them in its metadata store; classic queues, their bindings and transient exchanges
//! stay on their node.
//!
//! The node a client (or the management API) changes a definition on applies it at once (the
//! client gets its answer) and sends the change to the group's leader, except a quorum queue's
//! declaration, which every node, that one included, applies only from the log (the client
//! waits: see `declare_through_log`); every node applies the committed entries in log order, so all converge on the log's order even when two nodes
//! change one object at once. A node keeps one entry in flight at a time (what is changed
//! meanwhile waits for the next entry) and sends it again until it is applied: changes are
//! numbered per node, and a copy is applied once. The index applied is written to the store
//! with what the entries changed, so a restart applies only the entries after it.
//!
//! A node's own changes are applied again only for the objects whose latest change they carry
//! (another node's change may have come between), so that a later change made here is not
//! undone for a moment. Each change stays in the store until the log has applied it, so a
//! node killed in between sends it again when it starts.

use super::metadata_ops::{
    decode_entry, decode_head, encode_entry, readable, Binding, MetaOp, QueueGroup,
};
use super::*;
use crate::persist::BindingDest;
use crate::replica::NodeId;
use warren_codec::ReplyCode;

use super::replicated::Proposal;
use warren_replication::Committed;

/// The metadata group's number (a queue's group is never 0: see `group_of`).
pub const META_GROUP: u64 = 0;

/// An entry not applied after this long is sent again: its leader may have dropped it.
const META_RESEND_MS: u64 = 2_000;

/// At most this many operations in one entry (a definitions import makes thousands).
const OPS_PER_ENTRY: usize = 256;

/// How long a member's number may ask to join before the log says it is refused: a node just
/// added asks until it holds the metadata, seconds at most.
const JOIN_REFUSED_AFTER_MS: u64 = 30_000;

/// What this version does that every node must do alike, announced in the log
/// (`MetaOp::FeatureLevel`): 1, quorum queues numbered by the metadata log
/// (`QueueGroup::FromLog`). A node uses a level once every node of the cluster announced it.
/// 2, nodes added and forgotten through the log (`MetaOp::AddNode`, `MetaOp::ForgetNode`).
/// 3, each node tells the others how far it applied the log ([`META_APPLIED`]), so that a
/// quorum queue's declaration is answered once every running node has the queue.
/// 4, a Raft message too large for one frame of the transport travels in pieces, so a queue
/// whose snapshot is larger than a frame is snapshotted (its log compacted) too.
/// 5, a publish forwarded to a quorum queue's leader is an `EnqueueFrom` whose sequence has no
/// gaps, so that sent again after a failover or a snapshot it is taken once.
/// 6, a publish held back for a quorum queue (`x-delivery-delay`, an `x-delay` header) is a
/// `Command::EnqueueWith` in the queue's log, held by every member and released by whichever
/// leads when it is due, instead of waiting on the disk of the node that took it; and a
/// quorum queue's deduplication window is in its machine (`EnqueueWith`'s `dedup`).
/// 7, a quorum queue with a dead-letter exchange holds its dead-lettered messages until their
/// dead letters are safe (`Policy::hold_dead_letters`, `Command::DeadLettered`, snapshot
/// version 4).
/// 8, a node receives a snapshot in pieces above 4 GiB (spooled to its disk, never held in
/// memory), so a quorum queue deeper than the earlier levels' largest snapshot is snapshotted.
/// 9, a quorum queue's entry may join several commands (`warren_replication::batch`).
/// 10, a quorum queue counts its line's messages per group (`Policy::index_groups`), so a
/// checkout that finds every group busy leaves its line whole.
/// 11, a vhost's metadata (its description, tags and default queue type) is in its
/// `put_vhost` entries, and every node keeps it.
/// 12, a quorum queue may have voters of its own (`x-quorum-initial-group-size`), in its
/// `declare_queue` entry, changed by `change_queue_member` entries: the cluster's other nodes
/// hold it as learners.
pub const FEATURE_LEVEL: u64 = 12;

/// The level from which a quorum queue gets voters of its own: a node of an older version
/// would make every node a voter of its group, and lead it towards that.
pub(super) const GROUP_VOTERS_LEVEL: u64 = 12;

/// The level from which a vhost's metadata may be set: a node of an older version makes the
/// vhost and drops its metadata, and would make that vhost's queues of its own default type.
pub(super) const VHOST_META_LEVEL: u64 = 11;

/// The level from which a quorum queue's machine counts its line per message group
/// (`Policy::index_groups`): its messages of busy groups stay in the line, where they expire
/// on time, instead of being set aside, where they wait for their group; a node of an older
/// version would expire them later and the members would disagree.
pub(super) const GROUP_INDEX_LEVEL: u64 = 10;

/// The level from which a leader joins the commands a pass proposes to a quorum queue into
/// one Raft entry: a node of an older version reads a joined entry as one it cannot decode.
pub(super) const JOINED_ENTRIES_LEVEL: u64 = 9;

/// The level from which every node takes a snapshot in pieces of any size its disk holds: a
/// node of an older version drops the link that sends it one above 4 GiB.
pub(super) const LARGE_SNAPSHOTS_LEVEL: u64 = 8;

/// The level from which quorum queues hold their dead letters until they are safe: a node of
/// an older version cannot read `Command::DeadLettered`, nor a snapshot that holds some.
pub(super) const HELD_DEAD_LETTERS_LEVEL: u64 = 7;

/// The level from which a publish held back for a quorum queue, or judged by its deduplication
/// window, goes into its log as a `Command::EnqueueWith`: a node of an older version cannot
/// read that entry.
pub(super) const HELD_LEVEL: u64 = 6;

/// The level from which a node forwards publishes as an enqueuer (`Broker::as_enqueuer`):
/// a node of an older version would apply an `EnqueueFrom` whose sequence skips one, where
/// this one refuses it, and the queue's members would disagree.
pub(super) const ENQUEUERS_LEVEL: u64 = 5;

/// The level from which every node takes a snapshot sent in pieces.
pub(super) const PIECES_LEVEL: u64 = 4;

/// The level from which a node reports its applied index ([`META_APPLIED`]).
pub(super) const REPORTS_LEVEL: u64 = 3;

/// A forward to this group carries the sender's metadata applied index (8 bytes, big-endian),
/// not a proposal: sent to every running peer when it grows, and to a peer that comes back.
/// A node that predates it drops it, as a forward to a group it does not have. (Queues'
/// numbers are hashes below 2^63, which this one is as likely to meet as any other; the
/// server's reserved groups sit just above it.)
pub const META_APPLIED: u64 = (1 << 63) - 5;

/// The level at which the cluster can add and forget nodes.
const MEMBERSHIP_LEVEL: u64 = 2;

/// A quorum queue's declaration waits this long for the metadata log to apply it; then the
/// client is told it failed (the queue may still be made, when the entry commits later).
pub const DECLARE_WAIT_MS: u64 = 30_000;

/// A quorum queue the log made here is declared to its client once every other running node
/// has it too and, when this node is its first leader, once that leader acts (a publish then
/// is taken at once, not refused as one in an election is), or after this long: a node that
/// has not said it applied the entry (a slow one, or its reports lost) is not waited for longer.
const MADE_WAIT_MS: u64 = 2_000;

/// A definition change is answered at the latest this long after it was made, applied by the
/// log or not. A slow peer is waited for `MADE_WAIT_MS` from when the log applied the change
/// here, so a log slow to commit (a loaded machine's fsyncs) does not eat the peers' time.
pub const CHANGE_WAIT_MS: u64 = 5_000;

/// How long a queue declared with `x-quorum-initial-group-size` before every node's feature
/// level was known waits for them, to be given its voters then ([`SizeLater`]).
const SIZE_LATER_MS: u64 = 60_000;

/// A quorum queue declared here with `x-quorum-initial-group-size` while some node's feature
/// level was not in the log yet (a cluster that has just formed): every node votes at first,
/// and once every level is known this node takes the nodes past the size off its voters.
#[derive(Debug)]
pub(super) struct SizeLater {
    vhost: String,
    name: ShortStr,
    size: usize,
    /// Given up (the queue keeps every node as a voter) past this time, if the levels, the
    /// queue or its leader are not known by then.
    until: u64,
}

/// A quorum queue's declaration made here, waiting for the log to make the queue.
#[derive(Debug)]
pub(super) struct PendingDeclare {
    conn: ConnId,
    vhost: String,
    name: ShortStr,
    arguments: FieldTable,
    since: u64,
    /// The log made the queue here: the answer waits for the other nodes to have it too, and
    /// for its first leader to act when that is this node (at most `MADE_WAIT_MS`).
    made: Option<Made>,
}

/// Where and when the log made a declared queue, and what its answer still waits for.
#[derive(Debug, Clone, Copy)]
struct Made {
    at: u64,
    /// The metadata log's index of the entry that made it.
    index: u64,
    /// This node is its first leader and does not act yet.
    leader: bool,
}

/// The answer to a quorum queue's declaration that waited for the metadata log
/// ([`crate::Declared::Waiting`]): for the connection `conn` with its ticket.
#[derive(Debug)]
pub struct DeclareAnswer {
    pub conn: ConnId,
    pub ticket: u64,
    pub result: Result<QueueDeclared, AmqpError>,
}

/// A user or vhost another node deleted: the session closes its connections here.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MetaClosed {
    User(String),
    Vhost(String),
}

/// The entry this node sent and the log has not applied yet.
#[derive(Debug)]
struct InFlight {
    /// Its first operation's number (the entry's in its head), and its last one's: it is
    /// applied once the log has applied that one.
    seq: u64,
    last: u64,
    data: Vec<u8>,
    /// When it was last sent (`None`: no leader known yet).
    sent: Option<u64>,
    /// Its operations' numbers: the store's records of them go if it is given up.
    numbers: Vec<u64>,
}

/// A change made here that the log has not applied yet.
#[derive(Debug)]
pub(super) struct Waiting {
    pub(super) number: u64,
    op: MetaOp,
    /// The store batch that keeps it: it goes to the cluster once that batch is written, so
    /// that every number the log may hold of this node is in its store after a crash.
    batch: u64,
}

/// The broker's part in the metadata group.
#[derive(Debug, Default)]
pub(crate) struct MetaState {
    /// Who leads the metadata group.
    pub(super) leader: Option<NodeId>,
    in_flight: Option<InFlight>,
    /// Changes made here since, numbered, for the next entry (and, after a restart, those
    /// of the previous start the log had not applied: the store kept them).
    pub(super) queued: VecDeque<Waiting>,
    /// The store batches written (see `Broker::writes_done`).
    pub(super) written: u64,
    /// The number of this node's last change: numbers grow across restarts (from the start
    /// time, and past any the store or the log has of this node).
    pub(super) next_op: u64,
    /// The highest change number applied, per node: a copy is applied once.
    pub(super) seen: BTreeMap<NodeId, u64>,
    /// The log index applied (and written to the store with what it changed).
    pub(super) applied: u64,
    /// The term of the entry at `applied` (0: none applied since this start).
    pub(super) applied_term: u64,
    /// Entries applied since the last snapshot taken or installed.
    pub(super) since_snapshot: u64,
    /// The users of this node's configuration file (see `Broker::keep_users_local`).
    pub(super) local_users: BTreeSet<String>,
    /// The number of the latest change made here to each object whose entry is not applied.
    pub(super) latest: HashMap<String, u64>,
    pub(super) closed: Vec<MetaClosed>,
    /// Groups to create and to remove, in order, for the driver.
    pub(super) group_changes: Vec<GroupChange>,
    /// The feature level each node announced in the log (`FEATURE_LEVEL`).
    pub(super) levels: BTreeMap<NodeId, u64>,
    /// The cluster's nodes once the log added or forgot one (`None`: the list this node
    /// started with), and the addresses of those that list lacks (added nodes').
    pub(super) members: Option<Vec<NodeId>>,
    pub(super) addresses: BTreeMap<NodeId, String>,
    /// Nodes that asked to join and whose `AddNode` this node sent, until it is applied.
    pub(super) joins_asked: BTreeSet<NodeId>,
    /// The numbers of nodes the log forgot and did not add again. A node started again on
    /// its old data after it was forgotten gets no link (it is no member); a new node may
    /// join under the number (`--cluster-join`, an empty data directory), as a StatefulSet
    /// scaled down then up again brings back a pod's ordinal.
    pub(super) forgotten: BTreeSet<NodeId>,
    /// Nodes that ask to join while members already: since when (ms), until told in the log
    /// (`u64::MAX` then); and nodes of a version below the cluster's feature level, refused
    /// (`u64::MAX`: warned once, until one of that number is added).
    join_refused: BTreeMap<NodeId, u64>,
    /// Raft asked for a snapshot of the metadata (a node being added needs one).
    pub(super) snapshot_asked: bool,
    /// Queues are being made from a metadata snapshot: their groups wait for their leaders'
    /// snapshots rather than start with members the snapshot cannot tell.
    pub(super) from_snapshot: bool,
    /// This node announced its level since it started.
    level_announced: bool,
    /// Another node's level changed in the log: this node announces its own again.
    level_wanted: bool,
    /// Quorum queues' declarations made here and waiting for the log, by change number
    /// (their ticket), and the answers not taken yet.
    pub(super) declares: BTreeMap<u64, PendingDeclare>,
    /// This node's declarations that go through the log and that it has not applied yet, by
    /// object: their number and arguments (another declaration of that name here meanwhile
    /// must be equivalent, or the log's queue could not be made here).
    pub(super) through_log: HashMap<String, (u64, FieldTable)>,
    declare_answers: Vec<DeclareAnswer>,
    /// Quorum queues declared here whose size waits for every node's level.
    sizes_later: Vec<SizeLater>,
    /// How far each peer says it applied the log ([`META_APPLIED`]), since it was last seen
    /// coming up.
    pub(super) peer_applied: BTreeMap<NodeId, u64>,
    /// The applied index last sent to every running peer, and the peers that came up since
    /// and are owed it.
    pub(super) reported: u64,
    pub(super) report_to: BTreeSet<NodeId>,
    /// Changes made here whose clients wait until every running node has them (a binding
    /// of a durable exchange to a quorum queue: [`Broker::wait_for_cluster`]), by number.
    change_waits: BTreeMap<u64, ChangeWait>,
    change_answers: Vec<ChangeAnswer>,
    /// How many changes have stopped waiting, ever: the server wakes the API's waiters when
    /// it moves ([`Broker::changes_answered`]).
    answered: u64,
}

/// A client's change waiting to be on every running node.
#[derive(Debug)]
struct ChangeWait {
    conn: ConnId,
    since: u64,
    /// The metadata log's index of the entry that applied it, and when it was applied here.
    index: Option<(u64, u64)>,
}

impl ChangeWait {
    /// When its client is answered whatever the peers say.
    fn due(&self) -> u64 {
        let applied = self
            .index
            .map_or(u64::MAX, |(_, at)| at.saturating_add(MADE_WAIT_MS));
        applied.min(self.since.saturating_add(CHANGE_WAIT_MS))
    }
}

/// A change made by connection `conn` ([`Broker::wait_for_cluster`]'s `ticket`) is on every
/// running node, or waited as long as it may: its client gets its answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChangeAnswer {
    pub conn: ConnId,
    pub ticket: u64,
}

/// A Raft group this node's broker needs, or no longer needs (a queue deleted and declared
/// again between two passes of the driver needs its group removed, then made anew).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GroupChange {
    /// Create it; `campaign`: this node stands for its leader (a client declared it here).
    Add {
        group: u64,
        campaign: bool,
        /// The nodes it starts with (`None`: every node of the driver's list, or the
        /// cluster's nodes its Raft was last told).
        voters: Option<Vec<u64>>,
    },
    Remove {
        group: u64,
    },
    /// Maintenance mode on or off ([`crate::Broker::set_draining`]).
    Drain {
        on: bool,
    },
    /// Hand the leadership of `group` to node `to`, if this node still leads it
    /// ([`crate::Broker::rebalance`]).
    Transfer {
        group: u64,
        to: u64,
    },
    /// The cluster's nodes changed (one was added or forgotten): every group moves to
    /// `voters`, and the nodes not among them are no peers any more; `addresses` are those of
    /// nodes the driver's list lacks. Comes before the groups made after it.
    Members {
        voters: Vec<u64>,
        addresses: Vec<(u64, String)>,
    },
    /// Make this node's member of a group it learnt of from a metadata snapshot: it waits for
    /// its leader's snapshot (which tells it the members) before it takes any entry.
    Join {
        group: u64,
    },
    /// The group's voters of its own, the cluster's other nodes its learners (`None`: every
    /// node votes). Comes before the group's `Add` when it has them from the start.
    Voters {
        group: u64,
        voters: Option<Vec<u64>>,
    },
}

/// Why the cluster cannot forget a node.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ForgetError {
    #[error("this node is not in a cluster")]
    NotClustered,
    #[error("node {0} is not a member of the cluster")]
    NotMember(NodeId),
    #[error("node {0} is this node: forget it from another node")]
    Itself(NodeId),
    #[error("node {0} is running: stop it first (RabbitMQ's forget_cluster_node also needs the node stopped)")]
    Running(NodeId),
    #[error("a cluster of {0} node(s) cannot lose one")]
    TooFew(usize),
    #[error("every node must run a version that can forget nodes (cluster feature level {have}, {want} needed): upgrade the nodes first")]
    Level { have: u64, want: u64 },
    #[error("the metadata group has no leader: the cluster has no majority")]
    NoLeader,
    #[error("quorum queue '{name}' in vhost '{vhost}' has too few of its members running to let node {node} go (its group could not agree to drop it, and would stop for good): bring node {node} back first, or, if the queue never counted on it, take it off the queue's members (warren ctl delete_member)")]
    QueueWithoutMajority {
        vhost: String,
        name: String,
        node: NodeId,
    },
}

impl MetaState {
    /// This node's changes numbered up to `number` are in the log at or before `index`: the
    /// clients waiting for them wait for the other nodes to reach it.
    pub(super) fn changes_applied_upto(&mut self, number: u64, index: u64, now: u64) {
        for w in self.change_waits.range_mut(..=number).map(|(_, w)| w) {
            w.index.get_or_insert((index, now));
        }
    }

    /// This node's changes `numbers` will never be in the log (their entry was given up):
    /// their clients are answered now.
    fn changes_given_up(&mut self, numbers: &[u64]) {
        for n in numbers {
            if let Some(w) = self.change_waits.remove(n) {
                self.answered += 1;
                tracing::warn!(conn = w.conn, "a definition change the cluster could not take: answered, it stays on this node");
                self.change_answers.push(ChangeAnswer {
                    conn: w.conn,
                    ticket: *n,
                });
            }
        }
    }

    /// An entry of this node's is in flight.
    pub(super) fn in_flight_pending(&self) -> bool {
        self.in_flight.is_some()
    }

    /// The entry in flight, if its last change is at or below `number` (applied): its
    /// changes' numbers.
    pub(super) fn take_in_flight_upto(&mut self, number: u64) -> Option<Vec<u64>> {
        if self.in_flight.as_ref()?.last > number {
            return None;
        }
        self.in_flight.take().map(|f| f.numbers)
    }

    pub(super) fn starting_at(first_op: u64) -> Self {
        MetaState {
            next_op: first_op,
            ..MetaState::default()
        }
    }

    /// The entry to send now, if any: the one in flight (made from what is queued when there
    /// is none), once a leader is known.
    pub(super) fn send(&mut self, node: NodeId, now: u64, again: bool) -> Option<Proposal> {
        let mut stored = self
            .queued
            .iter()
            .take(OPS_PER_ENTRY)
            .take_while(|w| w.batch <= self.written)
            .count();
        if let Some(i) = self
            .queued
            .iter()
            .take(stored)
            .position(|w| w.op.travels_alone())
        {
            stored = stored.min(i.max(1));
        }
        if self.in_flight.is_none() && stored > 0 {
            let ops: Vec<(u64, MetaOp)> = self
                .queued
                .drain(..stored)
                .map(|w| (w.number, w.op))
                .collect();
            self.in_flight = Some(InFlight {
                seq: ops.first().map_or(0, |(n, _)| *n),
                last: ops.last().map_or(0, |(n, _)| *n),
                data: encode_entry(now, node, &ops),
                sent: None,
                numbers: ops.iter().map(|(n, _)| *n).collect(),
            });
        }
        let leader = self.leader?;
        let f = self.in_flight.as_mut()?;
        if f.sent.is_some() && !again {
            return None;
        }
        f.sent = Some(now);
        Some(Proposal {
            group: META_GROUP,
            data: f.data.clone(),
            to: (leader != node).then_some(leader),
        })
    }
}

impl Broker {
    /// Runs `f` with what it changes kept to this node (its own configuration file's users,
    /// say), not sent to the cluster.
    pub fn local_only<T>(&mut self, f: impl FnOnce(&mut Broker) -> T) -> T {
        let was = std::mem::replace(&mut self.meta_quiet, true);
        let out = f(self);
        self.meta_quiet = was;
        out
    }

    /// A definition changed by a client here: every node is told.
    /// Sends `op` to the cluster, to be applied here too only when the log has it
    /// ([`MetaOp::applied_by_log`]).
    pub(super) fn announce_by_log(&mut self, op: MetaOp) {
        debug_assert!(op.applied_by_log());
        self.announce_as(op, false);
    }

    pub(super) fn announce(&mut self, op: MetaOp) {
        self.announce_as(op, true);
    }

    /// Sends `op` to the cluster; `applied_here`: this node applied it already (so its
    /// entry is applied here again only while it is the latest change to its object), else
    /// it is applied here, as everywhere, when the log has it. The change's number, if it
    /// went.
    fn announce_as(&mut self, op: MetaOp, applied_here: bool) -> Option<u64> {
        if self.restoring || self.meta_quiet || self.cluster.is_none() {
            return None;
        }
        if !readable(&op) {
            tracing::error!(
                ?op,
                "a definition the cluster could not read back: kept on this node only"
            );
            return None;
        }
        let now = self.now_ms;
        // The batch the change goes into (`None`: no store, nothing to wait for).
        let batch = self.persist.as_ref().map_or(0, |p| p.next_batch);
        let c = self.cluster.as_mut()?;
        let node = c.node();
        let m = &mut c.meta;
        m.next_op += 1;
        let number = m.next_op;
        // Kept in the store with the change itself, until the log has applied it: after a
        // crash the node sends it again (else its store would hold what the cluster lacks).
        let pending = StoreOp::PutMetaPending {
            number,
            data: encode_entry(now, node, &[(number, op.clone())]),
        };
        if applied_here {
            m.latest.insert(op.object(), number);
        }
        m.queued.push_back(Waiting { number, op, batch });
        if let Some(p) = m.send(node, now, false) {
            c.push(p);
        }
        if let Some(p) = self.persist.as_mut() {
            p.push(pending, true);
        }
        Some(number)
    }

    /// The store wrote its batches up to `upto`: the changes they keep may go to the cluster.
    pub(super) fn meta_written(&mut self, upto: u64) {
        let now = self.now_ms;
        let Some(c) = self.cluster.as_mut() else {
            return;
        };
        c.meta.written = c.meta.written.max(upto);
        let node = c.node();
        if let Some(p) = c.meta.send(node, now, false) {
            c.push(p);
        }
    }

    /// A replicated queue was declared by a client here.
    pub(super) fn announce_declare(
        &mut self,
        vhost: &str,
        name: &ShortStr,
        arguments: &FieldTable,
        leader: Option<NodeId>,
    ) {
        self.announce(MetaOp::DeclareQueue {
            vhost: vhost.to_owned(),
            name: name.clone(),
            arguments: arguments.detached(),
            leader,
            group: QueueGroup::Named,
            voters: None,
        });
    }

    /// Every node of the cluster numbers new quorum queues' groups by the metadata log: a
    /// declaration then waits for the log, which makes the queue on every node alike.
    pub(super) fn groups_from_log(&self) -> bool {
        self.cluster_feature_level().is_some_and(|l| l >= 1)
    }

    /// A quorum queue declared by a client here, once every node numbers groups by the log:
    /// the queue is made when the log applies its entry, here as on every node, and the
    /// client is answered then (the ticket returned; `None`: there is no cluster to ask).
    pub(super) fn declare_through_log(
        &mut self,
        vhost: &str,
        name: ShortStr,
        arguments: FieldTable,
        leader: Option<NodeId>,
        conn: ConnId,
    ) -> Option<u64> {
        // Numbered by the log once every node can; by its name while one may not.
        let group = if self.groups_from_log() {
            QueueGroup::FromLog
        } else {
            QueueGroup::ByName
        };
        let size = requested_size(&arguments);
        let voters = size.and_then(|size| self.initial_voters(size, leader));
        if let (Some(size), None) = (size, &voters) {
            if self.levels_pending() && size < self.sorted_nodes().len() {
                tracing::info!(
                    %vhost,
                    queue = %name,
                    size,
                    "x-quorum-initial-group-size waits for every node's feature level: every \
                     node votes until then"
                );
                let until = self.now_ms.saturating_add(SIZE_LATER_MS);
                if let Some(c) = self.cluster.as_mut() {
                    c.meta.sizes_later.push(SizeLater {
                        vhost: vhost.to_owned(),
                        name: name.clone(),
                        size,
                        until,
                    });
                }
            }
        }
        let number = self.announce_as(
            MetaOp::DeclareQueue {
                vhost: vhost.to_owned(),
                name: name.clone(),
                arguments: arguments.detached(),
                leader,
                group,
                voters,
            },
            false,
        )?;
        let since = self.now_ms;
        let c = self.cluster.as_mut()?;
        c.meta.through_log.insert(
            super::metadata_ops::queue_object(vhost, &name),
            (number, arguments.detached()),
        );
        c.meta.declares.insert(
            number,
            PendingDeclare {
                conn,
                vhost: vhost.to_owned(),
                name,
                arguments,
                since,
                made: None,
            },
        );
        Some(number)
    }

    /// A new quorum queue's voters of its own, when `x-quorum-initial-group-size` asks for
    /// `size`, fewer than the cluster's nodes (and every node can keep them): the node standing
    /// for its first leader, then the running nodes after it in the nodes' order, then the
    /// others. `None`: every node votes, as before the level (the argument was accepted and
    /// ignored, or waits for the levels: [`SizeLater`]).
    fn initial_voters(&self, size: usize, leader: Option<NodeId>) -> Option<Vec<u64>> {
        let level = self.cluster_feature_level();
        if level.is_none_or(|l| l < GROUP_VOTERS_LEVEL) {
            // Said, not silent. A node not heard from yet is waited for instead.
            if level.is_some() && !self.levels_pending() {
                tracing::warn!(
                    size,
                    level,
                    needs = GROUP_VOTERS_LEVEL,
                    "x-quorum-initial-group-size ignored: a node of the cluster runs a version \
                     that cannot keep a queue's own voters, so every node votes (upgrade every \
                     node, then take nodes off with `warren ctl delete_member`)"
                );
            }
            return None;
        }
        self.voters_of_size(size, leader)
    }

    /// `size` voters: `first` (this node if `None`), then the running nodes after it in the
    /// nodes' order, then the others. `None`: as many as the cluster has nodes, or more.
    fn voters_of_size(&self, size: usize, first: Option<NodeId>) -> Option<Vec<u64>> {
        let c = self.cluster.as_ref()?;
        let mut nodes = c.nodes().to_vec();
        nodes.sort_unstable();
        if size >= nodes.len() {
            return None;
        }
        let first = first.unwrap_or_else(|| c.node());
        let start = nodes.iter().position(|n| *n == first).unwrap_or(0);
        nodes.rotate_left(start);
        let (running, down): (Vec<u64>, Vec<u64>) = nodes
            .into_iter()
            .partition(|n| *n == first || c.is_running(*n));
        Some(running.into_iter().chain(down).take(size).collect())
    }

    /// Whether the cluster's level is low only for want of some node's level in the log
    /// (every level known is one that keeps a queue's voters).
    fn levels_pending(&self) -> bool {
        let Some(c) = self.cluster.as_ref() else {
            return false;
        };
        let known = |n: &NodeId| c.meta.levels.get(n).copied();
        c.nodes().iter().any(|n| known(n).is_none())
            && c.nodes()
                .iter()
                .filter_map(known)
                .all(|l| l >= GROUP_VOTERS_LEVEL)
    }

    /// The queues whose `x-quorum-initial-group-size` waited for every node's level: once
    /// the levels are in, each still voted on by every node has the nodes past its size taken
    /// off (through the log, as `delete_member`), keeping its leader; past their wait, or
    /// when a node's level is one that cannot keep voters, they keep every node.
    fn size_queues_later(&mut self) {
        let now = self.now_ms;
        let ready = self.members_changeable().is_ok();
        let pending = self.levels_pending();
        let Some(c) = self.cluster.as_mut() else {
            return;
        };
        if c.meta.sizes_later.is_empty() {
            return;
        }
        let later = std::mem::take(&mut c.meta.sizes_later);
        let mut waiting = Vec::new();
        for s in later {
            let id = self.queue_id(&s.vhost, &s.name);
            let queue = id.and_then(|id| self.queues.get(&id));
            if queue.is_some_and(|q| requested_size(&q.arguments) != Some(s.size)) {
                // Deleted and declared again meanwhile without that size: not this one.
                continue;
            }
            let made = queue.and_then(|q| q.replica.as_ref());
            let Some(r) = made.filter(|r| ready && r.leader.is_some()) else {
                if (pending || id.is_none() || (ready && made.is_some())) && now < s.until {
                    // The levels, the declaration or the queue's first leader are not known
                    // yet (a voter taken off could be the one about to be elected).
                    waiting.push(s);
                } else {
                    tracing::warn!(
                        vhost = %s.vhost,
                        queue = %s.name,
                        size = s.size,
                        "x-quorum-initial-group-size not applied: every node votes (take nodes \
                         off with `warren ctl delete_member`)"
                    );
                }
                continue;
            };
            if r.voters.is_some() {
                // Its members were changed meanwhile: left as they are.
                continue;
            }
            let Some(keep) = self.voters_of_size(s.size, r.leader) else {
                continue;
            };
            let off: Vec<NodeId> = self
                .sorted_nodes()
                .into_iter()
                .filter(|n| !keep.contains(n))
                .collect();
            tracing::info!(vhost = %s.vhost, queue = %s.name, voters = ?keep, "x-quorum-initial-group-size applied");
            for node in off {
                if let Err(error) = self.change_queue_member(&s.vhost, &s.name, node, false) {
                    tracing::warn!(vhost = %s.vhost, queue = %s.name, node, %error, "x-quorum-initial-group-size not applied");
                }
            }
        }
        if let Some(c) = self.cluster.as_mut() {
            c.meta.sizes_later.append(&mut waiting);
        }
    }

    /// The arguments of a quorum queue's declaration here that waits for the log: another
    /// declaration of that name meanwhile must be equivalent to it.
    pub(super) fn pending_declaration(&self, vhost: &str, name: &str) -> Option<&FieldTable> {
        self.cluster
            .as_ref()?
            .meta
            .through_log
            .get(&super::metadata_ops::queue_object(vhost, name))
            .map(|(_, arguments)| arguments)
    }

    /// Answers for declarations that waited for the log, since the last call.
    pub fn take_declare_answers(&mut self, out: &mut Vec<DeclareAnswer>) {
        if let Some(c) = self.cluster.as_mut() {
            out.append(&mut c.meta.declare_answers);
        }
    }

    /// Whether [`Broker::take_declare_answers`] has any.
    pub fn has_declare_answers(&self) -> bool {
        self.cluster
            .as_ref()
            .is_some_and(|c| !c.meta.declare_answers.is_empty())
    }

    /// The log applied this node's declaration `number`, at `index`: answered once every
    /// other running node has applied it too (a publish on any node then reaches the queue,
    /// as RabbitMQ answers once the queue's record is on every node) and, when it made the
    /// queue with this node for its first leader, once that leader acts.
    fn settle_declare(&mut self, number: u64, index: u64, error: Option<AmqpError>) {
        if error.is_some() {
            self.answer_declare(number, error);
            return;
        }
        let now = self.now_ms;
        let node = self.cluster_node();
        let waits_for_leader = self.cluster.as_ref().is_some_and(|c| {
            c.meta.declares.get(&number).is_some_and(|w| {
                self.queue_id(&w.vhost, &w.name)
                    .and_then(|id| self.queues.get(&id))
                    .and_then(|q| q.replica.as_ref())
                    .is_some_and(|r| {
                        r.chosen == node
                            && node.is_some()
                            && r.leader.is_none_or(|l| Some(l) == node)
                            && !r.is_leading()
                    })
            })
        });
        if let Some(w) = self
            .cluster
            .as_mut()
            .and_then(|c| c.meta.declares.get_mut(&number))
        {
            w.made = Some(Made {
                at: now,
                index,
                leader: waits_for_leader,
            });
        }
        self.answer_cluster_waits();
    }

    /// Replicated queue `id` has a leader that acts (this node, or another one): the
    /// declarations that made it here no longer wait for it.
    pub(super) fn leader_acts(&mut self, id: QueueId) {
        let Some(q) = self.queues.get(&id) else {
            return;
        };
        let (vhost, name) = (q.vhost.clone(), q.name.clone());
        let Some(c) = self.cluster.as_mut() else {
            return;
        };
        for w in c.meta.declares.values_mut() {
            if let Some(made) = w
                .made
                .as_mut()
                .filter(|_| w.vhost == vhost && w.name == name)
            {
                made.leader = false;
            }
        }
        self.answer_cluster_waits();
    }

    /// Answers what waits for nothing more: declarations the log made here whose first
    /// leader (if this node) acts, and changes the log applied, once every running peer that
    /// reports how far it applied the log has applied their entry; changes also after
    /// `MADE_WAIT_MS`.
    pub(super) fn answer_cluster_waits(&mut self) {
        let now = self.now_ms;
        let Some(c) = self.cluster.as_ref() else {
            return;
        };
        let ready: Vec<u64> = c
            .meta
            .declares
            .iter()
            .filter(|(_, w)| {
                w.made
                    .is_some_and(|m| !m.leader && c.peers_behind(m.index, now).is_empty())
            })
            .map(|(n, _)| *n)
            .collect();
        for number in ready {
            self.answer_declare(number, None);
        }
        let Some(c) = self.cluster.as_mut() else {
            return;
        };
        let ready: Vec<u64> = c
            .meta
            .change_waits
            .iter()
            .filter(|(_, w)| {
                now >= w.due()
                    || w.index
                        .is_some_and(|(i, _)| c.peers_behind(i, now).is_empty())
            })
            .map(|(n, _)| *n)
            .collect();
        for number in ready {
            if let Some(w) = c.meta.change_waits.remove(&number) {
                c.meta.answered += 1;
                if w.index
                    .is_none_or(|(i, _)| !c.peers_behind(i, now).is_empty())
                {
                    tracing::warn!(conn = w.conn, index = ?w.index, "a definition change answered before every running node had it");
                }
                c.meta.change_answers.push(ChangeAnswer {
                    conn: w.conn,
                    ticket: number,
                });
            }
        }
    }

    /// Where this node's change numbers stand, before a client's change: with
    /// [`Broker::wait_for_cluster`] after it.
    pub fn change_mark(&self) -> u64 {
        self.cluster.as_ref().map_or(0, |c| c.meta.next_op)
    }

    /// Whether the change a client of `conn` just made (since `mark`, from
    /// [`Broker::change_mark`]) went to the cluster: its ticket if so, answered in
    /// [`Broker::take_change_answers`] once the metadata log applied it and every other
    /// running node says it did too (or after `MADE_WAIT_MS`). RabbitMQ answers a binding once
    /// it is in the metadata store of every node: a publish on another node right after it
    /// is then routed by it.
    pub fn wait_for_cluster(&mut self, mark: u64, conn: ConnId) -> Option<u64> {
        let now = self.now_ms;
        let c = self.cluster.as_mut()?;
        let number = c.meta.next_op;
        if number <= mark {
            return None;
        }
        c.meta.change_waits.insert(
            number,
            ChangeWait {
                conn,
                since: now,
                index: None,
            },
        );
        Some(number)
    }

    /// Whether the change `ticket` ([`Broker::wait_for_cluster`]) still waits for the
    /// cluster: the management API looks whenever [`Broker::changes_answered`] moves, having
    /// no channel to be answered on.
    pub fn change_waiting(&self, ticket: u64) -> bool {
        self.cluster
            .as_ref()
            .is_some_and(|c| c.meta.change_waits.contains_key(&ticket))
    }

    /// How many of this node's changes have stopped waiting for the cluster so far: a waiter
    /// that saw it move looks at [`Broker::change_waiting`] again.
    pub fn changes_answered(&self) -> u64 {
        self.cluster.as_ref().map_or(0, |c| c.meta.answered)
    }

    /// Changes that were waiting for the cluster and are answered now.
    pub fn take_change_answers(&mut self, out: &mut Vec<ChangeAnswer>) {
        if let Some(c) = self.cluster.as_mut() {
            out.append(&mut c.meta.change_answers);
        }
    }

    /// Whether [`Broker::take_change_answers`] has any.
    pub fn has_change_answers(&self) -> bool {
        self.cluster
            .as_ref()
            .is_some_and(|c| !c.meta.change_answers.is_empty())
    }

    /// A peer says how far it applied the metadata log ([`META_APPLIED`]).
    pub fn peer_meta_applied(&mut self, peer: NodeId, index: u64) {
        let Some(c) = self.cluster.as_mut() else {
            return;
        };
        if peer == c.node() || !c.nodes().contains(&peer) {
            return;
        }
        let at = c.meta.peer_applied.entry(peer).or_insert(0);
        *at = (*at).max(index);
        self.answer_cluster_waits();
    }

    /// The log applied this node's declaration `number` (or a snapshot holding it): its
    /// client learns what the queue is now. `error`: why its entry made nothing.
    pub(super) fn answer_declare(&mut self, number: u64, error: Option<AmqpError>) {
        let Some(w) = self
            .cluster
            .as_mut()
            .and_then(|c| c.meta.declares.remove(&number))
        else {
            return;
        };
        let q = self
            .queue_id(&w.vhost, &w.name)
            .and_then(|id| self.queues.get(&id));
        let result = match (q, error) {
            (Some(q), _) => {
                let rs = rs("queue", &w.name, &w.vhost);
                // Declared by another node first, or by a client here with other
                // arguments: answered as a declaration of an existing queue is.
                args::assert_args_equivalence(
                    &q.arguments,
                    &w.arguments,
                    &rs,
                    q.args.queue_type.equivalence_keys(),
                )
                .map(|()| declared(q))
            }
            (None, Some(e)) => Err(e),
            // Deleted since (the snapshot that settled it no longer has it).
            (None, None) => Err(AmqpError::not_found(format!(
                "{} was deleted while it was declared",
                rs("queue", &w.name, &w.vhost)
            ))),
        };
        if let Some(c) = self.cluster.as_mut() {
            c.meta.declare_answers.push(DeclareAnswer {
                conn: w.conn,
                ticket: number,
                result,
            });
        }
    }

    /// Declarations that waited for the log longer than [`DECLARE_WAIT_MS`] are refused
    /// (with the words RabbitMQ uses when a quorum queue cannot be made).
    fn expire_declares(&mut self) {
        let now = self.now_ms;
        let node = self.cluster_node().unwrap_or(0);
        let Some(c) = self.cluster.as_mut() else {
            return;
        };
        // Made, and its leader slow to act or a peer slow to apply it: answered all the same
        // (a publish before the leader acts is nacked, as in any election; one on the slow
        // peer may find no queue). Not made in time: refused, unless the queue exists by now
        // (another declaration made it).
        let due: Vec<(u64, Option<AmqpError>)> = c
            .meta
            .declares
            .iter()
            .filter_map(|(n, w)| match w.made {
                Some(m) => (now.saturating_sub(m.at) >= MADE_WAIT_MS).then(|| {
                    let behind = c.peers_behind(m.index, now);
                    if !behind.is_empty() {
                        tracing::warn!(queue = %w.name, vhost = %w.vhost, ?behind, "quorum queue declared before every running node applied it");
                    }
                    (*n, None)
                }),
                None => (now.saturating_sub(w.since) >= DECLARE_WAIT_MS).then(|| {
                    let error = AmqpError::internal_error(format!(
                        "Cannot declare a queue '{}' on node {node}: timeout",
                        rs("queue", &w.name, &w.vhost),
                    ));
                    (*n, Some(error))
                }),
            })
            .collect();
        for (number, error) in due {
            self.answer_declare(number, error);
        }
        // Changes whose wait ran out.
        self.answer_cluster_waits();
    }

    /// This node's level goes to the log once per start, unless the log has it already.
    fn announce_level(&mut self) {
        let Some(c) = self.cluster.as_mut() else {
            return;
        };
        let node = c.node();
        if c.meta.level_announced || c.meta.leader.is_none() {
            return;
        }
        c.meta.level_announced = true;
        if c.meta.levels.get(&node) == Some(&FEATURE_LEVEL) {
            return;
        }
        self.announce(MetaOp::FeatureLevel {
            node,
            level: FEATURE_LEVEL,
        });
    }

    /// A replicated queue was deleted by a client here.
    pub(super) fn announce_delete(&mut self, vhost: &str, name: &ShortStr, group: u64) {
        self.announce(MetaOp::DeleteQueue {
            vhost: vhost.to_owned(),
            name: name.clone(),
            group: Some(group),
        });
    }

    /// A binding made or removed here: the cluster's if both ends are.
    pub(super) fn announce_binding(&mut self, added: bool, binding: Binding) {
        self.announce(if added {
            MetaOp::Bind(binding)
        } else {
            MetaOp::Unbind(binding)
        });
    }

    /// Binds a quorum queue whose declaration here waits for the metadata log
    /// ([`Declared::Waiting`]): the binding goes to the log after it, and every node, this
    /// one too, makes it once the queue is there (a definitions import binds what it
    /// declares before the cluster has made it).
    pub fn bind_declared_queue(
        &mut self,
        vhost: &str,
        queue: &str,
        exchange: &str,
        key: &str,
        arguments: &FieldTable,
    ) -> Result<(), AmqpError> {
        let pending = self.cluster.as_ref().is_some_and(|c| {
            c.meta
                .declares
                .values()
                .any(|w| w.vhost == vhost && w.name.as_str() == queue)
        });
        if !pending {
            return Err(AmqpError::not_found(format!(
                "no {}",
                rs("queue", queue, vhost)
            )));
        }
        let durable = self
            .vhosts
            .get(vhost)
            .and_then(|vh| vh.exchanges.get(exchange))
            .map(|x| x.durable);
        match durable {
            None => Err(AmqpError::not_found(format!(
                "no {}",
                rs("exchange", exchange, vhost)
            ))),
            // A transient exchange's bindings stay on its node: none can reach the queue.
            Some(false) => Err(AmqpError::precondition_failed(format!(
                "cannot bind transient {} to a quorum queue the cluster is making",
                rs("exchange", exchange, vhost)
            ))),
            Some(true) => {
                self.announce_binding(
                    true,
                    Binding {
                        vhost: vhost.to_owned(),
                        source: exchange.to_owned(),
                        dest: BindingDest::Queue(ShortStr::from_string(queue.to_owned())),
                        key: key.to_owned(),
                        arguments: arguments.detached(),
                    },
                );
                Ok(())
            }
        }
    }

    /// The metadata group's leader changed: the entry in flight goes to it.
    pub(super) fn set_meta_leader(&mut self, leader: Option<NodeId>) {
        let now = self.now_ms;
        let Some(c) = self.cluster.as_mut() else {
            return;
        };
        c.meta.leader = leader;
        let node = c.node();
        if let Some(p) = c.meta.send(node, now, true) {
            c.push(p);
        }
        self.announce_level();
    }

    /// The entry in flight is sent again if the log has not applied it for long (its leader
    /// may have dropped it, or the connection to it).
    pub(super) fn resend_meta(&mut self) {
        self.expire_declares();
        let now = self.now_ms;
        let Some(c) = self.cluster.as_mut() else {
            return;
        };
        let late = c
            .meta
            .in_flight
            .as_ref()
            .and_then(|f| f.sent)
            .is_some_and(|at| now.saturating_sub(at) >= META_RESEND_MS);
        if late {
            let node = c.node();
            if let Some(p) = c.meta.send(node, now, true) {
                c.push(p);
            }
        }
    }

    /// When the entry in flight is due to be sent again (for the driver's timer).
    pub(super) fn meta_deadline(&self) -> Option<u64> {
        let c = self.cluster.as_ref()?;
        let m = &c.meta;
        // While something waits for the other nodes, the moment a peer down since recently
        // stops being waited for.
        let waiting = !m.change_waits.is_empty() || m.declares.values().any(|w| w.made.is_some());
        let undown = c.recently_down_until(self.now_ms).filter(|_| waiting);
        let declare = m
            .declares
            .values()
            .map(|w| match w.made {
                Some(m) => m.at.saturating_add(MADE_WAIT_MS),
                None => w.since.saturating_add(DECLARE_WAIT_MS),
            })
            .chain(m.change_waits.values().map(ChangeWait::due))
            .min();
        // With no leader there is nowhere to send it: the next leader gets it at once.
        let resend = m.leader.and(
            m.in_flight
                .as_ref()
                .and_then(|f| f.sent)
                .map(|at| at.saturating_add(META_RESEND_MS)),
        );
        resend.into_iter().chain(declare).chain(undown).min()
    }

    /// A metadata entry another node sent this node, which it leads the group for.
    pub(super) fn forwarded_meta(&mut self, data: &[u8]) {
        let Some(c) = self.cluster.as_mut() else {
            return;
        };
        if c.meta.leader != Some(c.node()) {
            // The sender hears of the new leader and sends it again.
            tracing::debug!("metadata entry for a group this node no longer leads: dropped");
            return;
        }
        c.push(Proposal {
            group: META_GROUP,
            data: data.to_vec(),
            to: None,
        });
    }

    /// Committed metadata entries, in log order. The index reached is written to the store
    /// in the same batch as what they changed.
    pub(super) fn apply_meta(&mut self, entries: &[&Committed]) {
        let before = self.cluster.as_ref().map_or(0, |c| c.meta.applied);
        for e in entries {
            self.apply_meta_entry(e);
        }
        let Some(c) = self.cluster.as_mut() else {
            return;
        };
        if std::mem::take(&mut c.meta.level_wanted) {
            let node = c.node();
            self.announce(MetaOp::FeatureLevel {
                node,
                level: FEATURE_LEVEL,
            });
        }
        let Some(c) = self.cluster.as_ref() else {
            return;
        };
        if c.meta.applied > before {
            let op = c.meta_applied_record();
            if let Some(p) = self.persist.as_mut() {
                p.push(op, true);
            }
        }
        self.take_meta_snapshot();
        // Changes of this node the entries applied, with no running peer to wait for.
        self.answer_cluster_waits();
        self.size_queues_later();
    }

    fn apply_meta_entry(&mut self, e: &Committed) {
        let now = self.now_ms;
        let Some(c) = self.cluster.as_mut() else {
            return;
        };
        if e.index <= c.meta.applied {
            // Its changes were written to the store before the restart.
            return;
        }
        c.meta.applied = e.index;
        c.meta.applied_term = e.term;
        c.meta.since_snapshot += 1;
        let node = c.node();
        let Some(entry) = decode_entry(&e.data) else {
            tracing::error!(index = e.index, "unreadable metadata entry skipped");
            // This node's own (it checks what it sends, so a bug): the next one goes.
            let (origin, seq) = decode_head(&e.data).unwrap_or((0, 0));
            let m = &mut c.meta;
            if origin == node && m.in_flight.as_ref().is_some_and(|f| f.seq == seq) {
                let numbers = m.in_flight.take().map_or(Vec::new(), |f| f.numbers);
                m.changes_given_up(&numbers);
                if let Some(p) = m.send(node, now, false) {
                    c.push(p);
                }
                if let Some(p) = self.persist.as_mut() {
                    for number in numbers {
                        p.push(StoreOp::DeleteMetaPending { number }, false);
                    }
                }
            }
            return;
        };
        let mine = entry.origin == node;
        if mine {
            let top = entry.ops.iter().map(|(n, _)| *n).max().unwrap_or(0);
            c.meta.changes_applied_upto(top, e.index, self.now_ms);
        }
        if !entry.numbered {
            // The first format: its origin applied it when it was made.
            if !mine {
                for (_, op) in entry.ops {
                    self.apply_meta_op(op);
                }
            }
            return;
        }
        let m = &mut c.meta;
        let seen = m.seen.entry(entry.origin).or_insert(0);
        let mut apply = Vec::new();
        let mut done = Vec::new();
        for (number, op) in entry.ops {
            if mine {
                // Applied by the log: the store no longer keeps it for a resend.
                done.push(StoreOp::DeleteMetaPending { number });
            }
            if number <= *seen {
                continue; // a copy
            }
            *seen = number;
            let through_log = op.applied_by_log();
            if mine && through_log {
                let object = op.object();
                if m.through_log
                    .get(&object)
                    .is_some_and(|(n, _)| *n <= number)
                {
                    m.through_log.remove(&object);
                }
            }
            if mine && !through_log {
                // Applied here when it was made: again only while it is the latest change
                // to its object (another node's change to it may have come between).
                let object = op.object();
                if m.latest.get(&object) != Some(&number) {
                    continue;
                }
                m.latest.remove(&object);
            }
            apply.push((number, op));
        }
        let seen = *seen;
        if mine {
            // A change restored after a restart may be applied by its first copy before it
            // is sent again.
            while m.queued.front().is_some_and(|w| w.number <= seen) {
                m.queued.pop_front();
            }
            if m.in_flight.as_ref().is_some_and(|f| f.last <= seen) {
                m.in_flight = None;
                if let Some(p) = m.send(node, now, false) {
                    c.push(p);
                }
            }
        }
        if let Some(p) = self.persist.as_mut() {
            for op in done {
                p.push(op, false);
            }
        }
        for (number, op) in apply {
            match op {
                MetaOp::DeclareQueue {
                    vhost,
                    name,
                    arguments,
                    leader,
                    group: group @ (QueueGroup::FromLog | QueueGroup::ByName),
                    voters,
                } => {
                    let group = if group == QueueGroup::FromLog {
                        super::replicated::group_placed(&vhost, &name, e.index)
                    } else {
                        super::replicated::group_of(&vhost, &name)
                    };
                    let error = self.make_cluster_queue(
                        &vhost,
                        name,
                        arguments,
                        (leader, Some(group)),
                        voters,
                    );
                    if let Some(e) = &error {
                        tracing::warn!(%vhost, error = %e, "quorum queue declaration not applied on this node");
                    }
                    if mine {
                        self.settle_declare(number, e.index, error);
                    }
                }
                op => self.apply_meta_op(op),
            }
        }
    }

    /// A quorum queue's declaration from the log (or a snapshot): the queue is made with
    /// `group` (`None`: its name's) and `leader` standing for its first leader, unless it
    /// exists (declared first by another entry: this one changes nothing, and its client is
    /// answered as for an existing queue). Why it could not be made, if so.
    fn make_cluster_queue(
        &mut self,
        vhost: &str,
        name: ShortStr,
        arguments: FieldTable,
        (leader, group): (Option<NodeId>, Option<u64>),
        voters: Option<Vec<u64>>,
    ) -> Option<AmqpError> {
        if let Some(id) = self.queue_id(vhost, &name) {
            if self.replica_group(id).is_none() {
                tracing::warn!(%vhost, queue = %name, "a quorum queue the cluster made has the name of a queue of this node's own: this node keeps its queue and is no member of the cluster's");
            }
            return None;
        }
        let req = DeclareQueue {
            name,
            passive: false,
            durable: true,
            exclusive: false,
            auto_delete: false,
            arguments,
        };
        let was = std::mem::replace(&mut self.meta_quiet, true);
        // As recovery declares: the origin checked names, limits and permissions.
        self.restoring = true;
        self.leader_hint = leader;
        self.group_hint = group;
        self.voters_hint = voters;
        let declared = self.declare_queue(vhost, req, 0);
        self.restoring = false;
        self.leader_hint = None;
        self.group_hint = None;
        self.voters_hint = None;
        self.meta_quiet = was;
        declared.err()
    }

    /// Applies one operation as the node that made it did, without telling the cluster.
    pub(super) fn apply_meta_op(&mut self, op: MetaOp) {
        let was = std::mem::replace(&mut self.meta_quiet, true);
        let failed = self.apply_meta_op_quietly(&op);
        self.meta_quiet = was;
        if let Some(error) = failed {
            tracing::warn!(?op, %error, "metadata operation not applied on this node");
        }
    }

    fn apply_meta_op_quietly(&mut self, op: &MetaOp) -> Option<String> {
        let err = |e: AmqpError| Some(e.to_string());
        match op.clone() {
            MetaOp::DeclareQueue {
                vhost,
                name,
                arguments,
                leader,
                group,
                voters,
            } => {
                let group = match group {
                    QueueGroup::Named => None,
                    QueueGroup::Fixed(g) => Some(g),
                    // Only an entry makes these (`apply_meta_entry`).
                    QueueGroup::FromLog | QueueGroup::ByName => {
                        return Some("a declaration made by the log, outside an entry".into())
                    }
                };
                let existing = self.queue_id(&vhost, &name);
                if let Some(id) = existing.filter(|id| {
                    group.is_some_and(|g| self.replica_group(*id).is_some_and(|had| had != g))
                }) {
                    // A snapshot's queue of another group than this node's: the queue was
                    // deleted and declared again while this node was away. Its old group
                    // goes (it is never made again: its number was its entry's).
                    self.restoring = true;
                    let deleted = self.remove_queue(id);
                    self.restoring = false;
                    if let (Some(deleted), Some(c)) = (deleted, self.cluster.as_mut()) {
                        c.push_cancelled(deleted.cancelled);
                    }
                    return self
                        .make_cluster_queue(&vhost, name, arguments, (leader, group), voters)
                        .map(|e| e.to_string());
                }
                if let Some(id) = existing {
                    // A snapshot's voters are the cluster's, whatever this node kept.
                    if group.is_some() {
                        self.set_replica_voters(id, voters);
                    }
                    // Declared differently on two nodes at once (or deleted and declared again
                    // on one while another changed it): the later in the log wins everywhere.
                    let differs = self
                        .queues
                        .get(&id)
                        .is_some_and(|q| q.arguments != arguments);
                    if differs && self.replica_group(id).is_some() {
                        return self
                            .set_queue_arguments(&vhost, &name, arguments, None)
                            .err()
                            .and_then(err);
                    }
                    return None;
                }
                self.make_cluster_queue(&vhost, name, arguments, (leader, group), voters)
                    .map(|e| e.to_string())
            }
            MetaOp::DeleteQueue { vhost, name, group } => {
                let id = self.queue_id(&vhost, &name)?;
                let had = self.replica_group(id)?;
                if group.is_some_and(|g| g != had) {
                    // A deletion of the queue's earlier incarnation, applied late: this one
                    // was declared since, and stays.
                    return None;
                }
                self.restoring = true;
                let deleted = self.remove_queue(id);
                self.restoring = false;
                if let (Some(deleted), Some(c)) = (deleted, self.cluster.as_mut()) {
                    c.push_cancelled(deleted.cancelled);
                }
                None
            }
            MetaOp::ChangeQueueMember {
                vhost,
                name,
                group,
                node,
                add,
            } => self.apply_member_change(&vhost, &name, group, node, add),
            MetaOp::SetQueueArguments {
                vhost,
                name,
                changes,
            } => {
                // A queue of that name kept on this node alone is not the cluster's.
                self.replica_group(self.queue_id(&vhost, &name)?)?;
                self.change_queue_arguments(&vhost, &name, &changes, None)
                    .err()
                    .and_then(err)
            }
            MetaOp::DeclareExchange {
                vhost,
                name,
                kind,
                auto_delete,
                internal,
                arguments,
            } => {
                let declare = |b: &mut Broker| {
                    b.declare_exchange(
                        &vhost,
                        &name,
                        &kind,
                        false,
                        true,
                        auto_delete,
                        internal,
                        &arguments,
                    )
                };
                match declare(self) {
                    Ok(()) => None,
                    // Declared differently on two nodes at once: every node ends with the one
                    // the log put last, as for any other change (its bindings go with it).
                    Err(e) if e.code == ReplyCode::PreconditionFailed => {
                        tracing::warn!(%vhost, exchange = %name, "exchange declared differently on two nodes at once: the later one replaces it");
                        let _ = self.delete_exchange(&vhost, &name, false);
                        declare(self).err().and_then(err)
                    }
                    Err(e) => err(e),
                }
            }
            MetaOp::DeleteExchange { vhost, name } => self
                .delete_exchange(&vhost, &name, false)
                .err()
                .and_then(err),
            MetaOp::Bind(b) | MetaOp::Unbind(b) => {
                let bind = matches!(op, MetaOp::Bind(_));
                let r = match (&b.dest, bind) {
                    (BindingDest::Queue(q), true) => {
                        self.bind_queue(&b.vhost, q, &b.source, &b.key, &b.arguments, 0)
                    }
                    (BindingDest::Queue(q), false) => {
                        self.unbind_queue(&b.vhost, q, &b.source, &b.key, &b.arguments, 0)
                    }
                    (BindingDest::Exchange(x), true) => {
                        self.bind_exchange(&b.vhost, x, &b.source, &b.key, &b.arguments)
                    }
                    (BindingDest::Exchange(x), false) => {
                        self.unbind_exchange(&b.vhost, x, &b.source, &b.key, &b.arguments)
                    }
                };
                r.err().and_then(err)
            }
            MetaOp::PutVhost { name, meta } => {
                match meta {
                    Some(meta) => {
                        self.set_vhost(&name, meta);
                    }
                    // An earlier version's: the vhost, with the metadata it has here.
                    None => {
                        self.declare_vhost(&name);
                    }
                }
                None
            }
            MetaOp::DeleteVhost(name) => {
                if self.delete_vhost(&name) {
                    if let Some(c) = self.cluster.as_mut() {
                        c.meta.closed.push(MetaClosed::Vhost(name));
                    }
                }
                None
            }
            MetaOp::PutUser(u) => {
                self.put_user(u);
                None
            }
            MetaOp::DeleteUser(name) => {
                if self.delete_user(&name) {
                    if let Some(c) = self.cluster.as_mut() {
                        c.meta.closed.push(MetaClosed::User(name));
                    }
                }
                None
            }
            MetaOp::PutPermission(p) => self.set_permission(p).err().map(|e| e.to_string()),
            MetaOp::DeletePermission { user, vhost } => {
                self.clear_permission(&user, &vhost);
                None
            }
            MetaOp::PutTopicPermission(t) => {
                self.set_topic_permission(t).err().map(|e| e.to_string())
            }
            MetaOp::ClearTopicPermission {
                user,
                vhost,
                exchange,
            } => {
                self.clear_topic_permission(&user, &vhost, exchange.as_deref());
                None
            }
            MetaOp::PutLimits {
                scope,
                name,
                limits,
            } => {
                self.put_limits(scope, &name, limits);
                None
            }
            MetaOp::PutPolicy(def) => self.set_policy(def).err().map(|e| e.to_string()),
            MetaOp::DeletePolicy { vhost, kind, name } => {
                self.clear_policy(&vhost, kind, &name);
                None
            }
            MetaOp::PutAccessKey(key) => self.put_access_key(key).err().map(|e| e.to_string()),
            MetaOp::PutParameter(def) => self.set_parameter(def).err().map(|e| e.to_string()),
            MetaOp::DeleteParameter {
                component,
                vhost,
                name,
            } => {
                self.clear_parameter(&component, &vhost, &name);
                None
            }
            MetaOp::DeleteAccessKey(id) => {
                self.delete_access_key(&id);
                None
            }
            MetaOp::Rebalance => {
                self.shed_leaders();
                None
            }
            MetaOp::ForgetNode { node } => {
                self.forget_applied(node);
                None
            }
            MetaOp::AddNode { node, addr, level } => {
                self.add_applied(node, addr, level);
                None
            }
            MetaOp::FeatureLevel { node, level } => {
                if let Some(c) = self.cluster.as_mut() {
                    let changed = c.meta.levels.insert(node, level) != Some(level);
                    // A node that ran an earlier version skipped the others' levels: it
                    // learns them when they announce theirs again.
                    let me = c.node();
                    if changed && node != me && c.meta.levels.contains_key(&me) {
                        c.meta.level_wanted = true;
                    }
                }
                None
            }
        }
    }

    /// Recovery: the metadata log's index this node's store holds the changes of, and the
    /// highest change number applied per node.
    pub(super) fn restore_meta_applied(
        &mut self,
        index: u64,
        seen: &[(u64, u64)],
        levels: &[(u64, u64)],
        members: Option<&[(u64, String)]>,
        forgotten: &[u64],
    ) {
        if let Some(c) = self.cluster.as_mut() {
            let node = c.node();
            let m = &mut c.meta;
            m.applied = index;
            m.seen = seen.iter().copied().collect();
            m.levels = levels.iter().copied().collect();
            // Numbered past what the log has of this node, even if the clock went back.
            m.next_op = m.next_op.max(m.seen.get(&node).copied().unwrap_or(0));
            c.meta.forgotten = forgotten.iter().copied().collect();
            if let Some(members) = members {
                c.set_member_list(members.to_vec());
            }
        }
    }

    /// Asks the cluster to forget `node`, which must be stopped (RabbitMQ's
    /// `forget_cluster_node`): every quorum queue's group moves to the other nodes (the
    /// group's leader removes it, one change at a time), and the other nodes take no more
    /// connections from it. Answered once the change is on its way through the log.
    pub fn forget_node(&mut self, node: NodeId) -> Result<(), ForgetError> {
        let level = self.cluster_feature_level();
        let c = self.cluster.as_ref().ok_or(ForgetError::NotClustered)?;
        if node == c.node() {
            return Err(ForgetError::Itself(node));
        }
        if !c.nodes().contains(&node) {
            return Err(ForgetError::NotMember(node));
        }
        if c.nodes().len() <= 2 {
            return Err(ForgetError::TooFew(c.nodes().len()));
        }
        if !c.peer_down(node) {
            return Err(ForgetError::Running(node));
        }
        let have = level.unwrap_or(0);
        if have < MEMBERSHIP_LEVEL {
            return Err(ForgetError::Level {
                have,
                want: MEMBERSHIP_LEVEL,
            });
        }
        if c.meta.leader.is_none() {
            return Err(ForgetError::NoLeader);
        }
        // Each queue's group drops the node through its leader, which a majority of its
        // voters must elect and follow without the node.
        for (vhost, name, voters) in self.quorum_queue_voters() {
            if !voters.contains(&node) {
                continue;
            }
            let running = voters
                .iter()
                .filter(|n| **n != node && c.is_running(**n))
                .count();
            if running <= voters.len() / 2 {
                return Err(ForgetError::QueueWithoutMajority {
                    vhost,
                    name: name.to_string(),
                    node,
                });
            }
        }
        tracing::warn!(node, "asking the cluster to forget a node");
        // Applied here too only when the log has it (as the latest change to its object).
        self.announce(MetaOp::ForgetNode { node });
        Ok(())
    }

    /// Node `node`, reached at `addr`, asks to join the cluster (it started with
    /// `--cluster-join` and an empty data directory): unless the cluster has it already, or
    /// this node asked for it already, the cluster is asked to add it. Whether it was asked.
    pub fn request_join(&mut self, node: NodeId, addr: &str, its_level: u64) -> bool {
        let level = self.cluster_feature_level().unwrap_or(0);
        let now = self.now_ms;
        let Some(c) = self.cluster.as_mut() else {
            return false;
        };
        if node == 0 || c.meta.joins_asked.contains(&node) {
            return false;
        }
        if c.nodes().contains(&node) {
            // A node just added asks until it holds the metadata that names it, a few seconds;
            // one that goes on asking is another node under a member's number. Told once.
            let since = c.meta.join_refused.entry(node).or_insert(now);
            if *since != u64::MAX && now.saturating_sub(*since) >= JOIN_REFUSED_AFTER_MS {
                *since = u64::MAX;
                tracing::warn!(
                    node,
                    %addr,
                    "a node asks to join under the number of a node of the cluster: refused. If that \
                     node's data is lost, forget it first (warren ctl forget_cluster_node), then \
                     the new node joins; else start it on its data directory, without --cluster-join"
                );
            }
            return false;
        }
        if level < MEMBERSHIP_LEVEL || c.meta.leader.is_none() {
            tracing::warn!(
                node,
                level,
                "a node asks to join, but the cluster cannot add it yet (every node must run a version that can, and the metadata needs a leader)"
            );
            return false;
        }
        if its_level < level {
            // It would apply what the cluster's logs already hold by older rules (a queue's
            // enqueuers, at level 5), and its members would disagree: as RabbitMQ refuses a
            // node that lacks an enabled feature flag.
            let since = c.meta.join_refused.entry(node).or_insert(now);
            if *since != u64::MAX {
                *since = u64::MAX;
                tracing::warn!(
                    node,
                    %addr,
                    its_level,
                    level,
                    "a node of an older version asks to join: refused; start it on this version"
                );
            }
            return false;
        }
        c.meta.joins_asked.insert(node);
        c.meta.join_refused.remove(&node);
        if c.meta.forgotten.contains(&node) {
            tracing::warn!(node, %addr, "a node asks to join under the number of a node the cluster forgot: adding it as a new node");
        } else {
            tracing::warn!(node, %addr, "a node asks to join the cluster: adding it");
        }
        self.announce(MetaOp::AddNode {
            node,
            addr: addr.to_owned(),
            level: its_level,
        });
        true
    }

    /// Whether this node is among the cluster's nodes as the metadata log says, once the log
    /// changed them (a node that joined is, once it installed the metadata).
    pub fn joined(&self) -> bool {
        self.cluster
            .as_ref()
            .is_some_and(|c| c.meta.members.is_some() && c.nodes().contains(&c.node()))
    }

    /// The log added `node`, reached at `addr`, at feature level `level`.
    fn add_applied(&mut self, node: NodeId, addr: String, level: u64) {
        let Some(c) = self.cluster.as_mut() else {
            return;
        };
        c.meta.joins_asked.remove(&node);
        if c.nodes().contains(&node) {
            return;
        }
        // A forgotten number taken by a new node, which starts empty. A group that has not
        // removed the old one yet keeps counting it: the new one, waiting for the leader's
        // snapshot, gives no vote meanwhile (`MultiRaft::step`).
        c.meta.forgotten.remove(&node);
        // Known at once, so that the cluster's level does not drop to nothing until the node
        // announces it (it can, only once it holds the metadata).
        if level > 0 {
            c.meta.levels.insert(node, level);
        }
        tracing::warn!(node, %addr, "the cluster adds a node");
        let mut list = c
            .member_list()
            .unwrap_or_else(|| c.nodes().iter().map(|n| (*n, String::new())).collect());
        list.push((node, addr));
        c.set_member_list(list);
    }

    /// The log forgot `node`: it leaves the cluster's nodes, and every group moves off it.
    fn forget_applied(&mut self, node: NodeId) {
        let Some(c) = self.cluster.as_mut() else {
            return;
        };
        if !c.nodes().contains(&node) {
            return;
        }
        let itself = node == c.node();
        if itself {
            tracing::error!(
                node,
                "the cluster forgot this node: its peers take no more connections from it; \
                 stop it, and start it on an empty data directory with --cluster-join to bring \
                 it back"
            );
        } else {
            tracing::warn!(node, "the cluster forgot a node");
        }
        let mut nodes = c.nodes().to_vec();
        nodes.retain(|n| *n != node);
        c.meta.forgotten.insert(node);
        c.set_members(nodes);
        if !itself {
            // Its consumers' messages go back now, whether or not it was down long enough
            // for that already.
            self.down_in_queues_led_here(node);
        }
    }

    /// Recovery: a change this node made that the log had not applied when it stopped: it
    /// goes to the cluster again (in number order, before any new one). The store already
    /// holds what it changed here.
    pub(super) fn restore_meta_pending(&mut self, number: u64, data: &[u8]) {
        let Some(c) = self.cluster.as_mut() else {
            return;
        };
        let op = decode_entry(&bytes::Bytes::copy_from_slice(data))
            .and_then(|e| e.ops.into_iter().next());
        let Some((_, op)) = op else {
            tracing::error!(
                number,
                "unreadable pending definition change: not sent again"
            );
            return;
        };
        let m = &mut c.meta;
        m.next_op = m.next_op.max(number);
        // A change applied by the log alone was not applied here: the log applies it.
        match (&op, op.applied_by_log()) {
            (
                MetaOp::DeclareQueue {
                    arguments: args, ..
                },
                true,
            ) => {
                m.through_log.insert(op.object(), (number, args.detached()));
            }
            (_, true) => {}
            (_, false) => {
                let latest = m.latest.entry(op.object()).or_insert(number);
                *latest = (*latest).max(number);
            }
        }
        // Already in the store: it may go at once.
        let at = m.queued.partition_point(|w| w.number < number);
        m.queued.insert(
            at,
            Waiting {
                number,
                op,
                batch: 0,
            },
        );
    }

    /// Users and vhosts other nodes deleted since the last call: their connections here are
    /// closed by the session.
    pub fn take_meta_closed(&mut self) -> Vec<MetaClosed> {
        self.cluster
            .as_mut()
            .map(|c| std::mem::take(&mut c.meta.closed))
            .unwrap_or_default()
    }

    /// The feature level every node of the cluster announced in the metadata log (0 while
    /// one has not; `None`: not in a cluster): what the whole cluster does alike.
    pub fn cluster_feature_level(&self) -> Option<u64> {
        let c = self.cluster.as_ref()?;
        Some(
            c.nodes()
                .iter()
                .map(|n| c.meta.levels.get(n).copied().unwrap_or(0))
                .min()
                .unwrap_or(0),
        )
    }

    /// Whether this node's proposals to a queue's group may share Raft entries: every node
    /// reads joined entries. (The metadata log's entries stay one each: [`META_GROUP`].)
    pub fn joins_entries(&self) -> bool {
        self.cluster_feature_level()
            .is_some_and(|l| l >= JOINED_ENTRIES_LEVEL)
    }

    /// The cluster's nodes, once the metadata log changed them (`None`: the list each node
    /// started with still holds).
    pub fn cluster_voters(&self) -> Option<Vec<NodeId>> {
        let c = self.cluster.as_ref()?;
        c.meta.members.as_ref().map(|_| c.nodes().to_vec())
    }

    /// The cluster addresses of the nodes added to the cluster since it started (the others'
    /// are in each node's list), as `HOST:PORT`.
    pub fn cluster_addresses(&self) -> BTreeMap<NodeId, String> {
        self.cluster
            .as_ref()
            .map(|c| c.meta.addresses.clone())
            .unwrap_or_default()
    }

    /// This node's number, every node's, and who leads the metadata group (`None`: not in a
    /// cluster).
    pub fn cluster_view(&self) -> Option<(NodeId, Vec<NodeId>, Option<NodeId>)> {
        let c = self.cluster.as_ref()?;
        Some((c.node(), c.nodes().to_vec(), c.meta.leader))
    }

    /// The groups to create and remove since the last call, in the order they must be: the
    /// driver adds them to, and removes them from, its Raft node.
    pub fn take_group_changes(&mut self) -> Vec<GroupChange> {
        self.cluster
            .as_mut()
            .map(|c| std::mem::take(&mut c.meta.group_changes))
            .unwrap_or_default()
    }
}

/// The size `x-quorum-initial-group-size` (or its older name `x-initial-cluster-size`) asks
/// of a quorum queue, if any.
fn requested_size(arguments: &FieldTable) -> Option<usize> {
    ["x-quorum-initial-group-size", "x-initial-cluster-size"]
        .iter()
        .find_map(|k| arguments.get(k)?.as_i64())
        .and_then(|n| usize::try_from(n).ok())
        .filter(|n| *n > 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::BrokerConfig;
    use warren_replication::GroupId;

    /// Node 2 of three, started for the first time.
    fn new_node_two() -> Broker {
        let mut b = Broker::new(BrokerConfig {
            persistence: true,
            ..BrokerConfig::default()
        });
        b.join_cluster(2, &[1, 2, 3], 7);
        b
    }

    /// Node 2 of three, whose store holds its level (it announces nothing at its start).
    fn node_two() -> Broker {
        let mut b = new_node_two();
        b.restore_meta_applied(0, &[], &[(2, FEATURE_LEVEL)], None, &[]);
        b
    }

    /// A quorum queue's machine counts its line per group only once every node's version
    /// does (its members must expire alike); a local queue's always does.
    #[test]
    fn a_quorum_queue_counts_its_line_per_group_once_every_node_can() {
        let mut b = new_node_two();
        b.restore_meta_applied(0, &[], &[(1, 9), (2, 10), (3, 10)], None, &[]);
        assert!(!b.level_rules(true).index_groups);
        assert!(b.level_rules(true).hold);
        assert!(b.level_rules(false).index_groups);
        assert!(!b.level_rules(false).hold);
        b.restore_meta_applied(0, &[], &[(1, 10), (2, 10), (3, 10)], None, &[]);
        assert!(b.level_rules(true).index_groups);
        const { assert!(GROUP_INDEX_LEVEL <= FEATURE_LEVEL) };
    }

    /// A vhost's metadata is set only once every node keeps it (a node of an earlier version
    /// would make the vhost's queues of its own default type), and an earlier version's
    /// `put_vhost`, which carries none, leaves the metadata a vhost has.
    #[test]
    fn a_vhosts_metadata_waits_for_every_node_and_an_older_entry_leaves_it() {
        use crate::vhost_meta::{VhostMeta, VhostMetaChange, VhostMetaError};
        let quorum = VhostMetaChange {
            description: Some("invoices".into()),
            default_queue_type: Some(Some(crate::QueueType::Quorum)),
            ..Default::default()
        };
        let mut b = new_node_two();
        b.restore_meta_applied(0, &[], &[(1, 10), (2, 11), (3, 11)], None, &[]);
        assert_eq!(
            b.put_vhost("billing", &quorum),
            Err(VhostMetaError::ClusterTooOld {
                level: 10,
                needs: VHOST_META_LEVEL
            })
        );
        assert!(!b.vhost_exists("billing"));
        // A vhost without metadata may be made all the same.
        assert_eq!(b.put_vhost("plain", &VhostMetaChange::default()), Ok(true));
        b.restore_meta_applied(0, &[], &[(1, 11), (2, 11), (3, 11)], None, &[]);
        assert_eq!(b.put_vhost("billing", &quorum), Ok(true));
        const { assert!(VHOST_META_LEVEL <= FEATURE_LEVEL) };
        let kept = b.vhost_meta("billing").cloned();
        b.apply_committed(&[entry_from(
            1,
            1,
            100,
            MetaOp::PutVhost {
                name: "billing".into(),
                meta: None,
            },
        )]);
        assert_eq!(b.vhost_meta("billing").cloned(), kept);
        assert_eq!(
            kept.map(|m| m.default_queue_type),
            Some(Some(crate::QueueType::Quorum))
        );
        b.apply_committed(&[entry_from(
            1,
            2,
            101,
            MetaOp::PutVhost {
                name: "made-by-an-older-node".into(),
                meta: None,
            },
        )]);
        assert_eq!(
            b.vhost_meta("made-by-an-older-node"),
            Some(&VhostMeta::default())
        );
    }

    fn entry(index: u64, seq: u64, op: MetaOp) -> Committed {
        Committed {
            group: GroupId(META_GROUP),
            index,
            term: 1,
            data: bytes::Bytes::from(encode_entry(0, 1, &[(seq, op)])),
        }
    }

    fn entry_from(origin: NodeId, index: u64, seq: u64, op: MetaOp) -> Committed {
        Committed {
            group: GroupId(META_GROUP),
            index,
            term: 1,
            data: bytes::Bytes::from(encode_entry(0, origin, &[(seq, op)])),
        }
    }

    fn quorum(name: &str) -> DeclareQueue {
        let mut arguments = FieldTable::new();
        arguments.insert("x-queue-type", FieldValue::long_str("quorum"));
        DeclareQueue {
            name: ShortStr::from_string(name.to_owned()),
            passive: false,
            durable: true,
            exclusive: false,
            auto_delete: false,
            arguments,
        }
    }

    #[test]
    fn snapshots_larger_than_a_frame_are_taken_once_every_node_receives_pieces() {
        let mut b = new_node_two();
        b.set_snapshot_policy(
            10,
            SnapshotLimits {
                frame: 1_000,
                pieced: 1_000_000,
                large: 1_000_000_000,
            },
        );
        b.set_meta_leader(Some(1));
        let out = sent(&mut b);
        b.apply_committed(&[
            entry_from(1, 1, 100, MetaOp::FeatureLevel { node: 1, level: 3 }),
            own(2, out[0].clone()),
            entry_from(
                3,
                3,
                100,
                MetaOp::FeatureLevel {
                    node: 3,
                    level: PIECES_LEVEL,
                },
            ),
        ]);
        assert_eq!(b.snapshot_limit(), 1_000, "node 1 would drop the pieces");
        b.apply_committed(&[entry_from(
            1,
            4,
            101,
            MetaOp::FeatureLevel {
                node: 1,
                level: PIECES_LEVEL,
            },
        )]);
        assert_eq!(b.snapshot_limit(), 1_000_000);
        // Node 2 is at this version's level: once nodes 1 and 3 are too, any size goes.
        b.apply_committed(&[entry_from(
            1,
            5,
            102,
            MetaOp::FeatureLevel {
                node: 1,
                level: LARGE_SNAPSHOTS_LEVEL,
            },
        )]);
        assert_eq!(b.snapshot_limit(), 1_000_000, "node 3 would drop the link");
        b.apply_committed(&[entry_from(
            3,
            6,
            103,
            MetaOp::FeatureLevel {
                node: 3,
                level: LARGE_SNAPSHOTS_LEVEL,
            },
        )]);
        assert_eq!(b.snapshot_limit(), 1_000_000_000);
    }

    /// A node announces its level once it knows the metadata group's leader; a quorum queue
    /// is declared through the log only once every node's level is in it, and is then made
    /// here when the log applies its entry, with the group that entry's index gives, as on
    /// every node.
    #[test]
    fn quorum_queues_wait_for_the_log_once_every_node_can_number_them() {
        let mut b = new_node_two();
        b.set_meta_leader(Some(1));
        let out = sent(&mut b);
        let ops: Vec<MetaOp> = out
            .iter()
            .filter_map(decode_entry)
            .flat_map(|e| e.ops.into_iter().map(|(_, op)| op))
            .collect();
        assert_eq!(
            ops,
            vec![MetaOp::FeatureLevel {
                node: 2,
                level: FEATURE_LEVEL
            }]
        );
        b.apply_committed(&[
            entry_from(1, 1, 100, MetaOp::FeatureLevel { node: 1, level: 1 }),
            own(2, out[0].clone()),
        ]);
        assert_eq!(b.cluster_feature_level(), Some(0));
        // Node 3 may run an earlier version: the log makes the queue with its name's group.
        let Ok(Declared::Waiting(early)) = b.declare_queue_as("/", quorum("early"), 5, None) else {
            panic!("not through the log");
        };
        assert_eq!(b.queue_id("/", "early"), None, "made only by the log");
        let out = sent(&mut b);
        let entry = out.first().and_then(decode_entry).expect("sent");
        assert!(
            matches!(
                entry.ops.first(),
                Some((
                    _,
                    MetaOp::DeclareQueue {
                        group: QueueGroup::ByName,
                        ..
                    }
                ))
            ),
            "{entry:?}"
        );
        b.apply_committed(&[
            own(3, out[0].clone()),
            entry_from(3, 4, 100, MetaOp::FeatureLevel { node: 3, level: 1 }),
        ]);
        // A level new to it: this node tells its own again (node 3 may have missed it).
        let again = sent(&mut b);
        let level = again.first().and_then(decode_entry).expect("sent again");
        assert_eq!(
            level.ops.first().map(|(_, op)| op),
            Some(&MetaOp::FeatureLevel {
                node: 2,
                level: FEATURE_LEVEL
            })
        );
        b.apply_committed(&[own(5, again[0].clone())]);
        let named = b.queue_id("/", "early").and_then(|id| b.replica_group(id));
        assert_eq!(named, Some(group_of("/", "early")));
        assert_eq!(b.cluster_feature_level(), Some(1));
        // Its first leader is this node: the answer waits for it to act, 2 s at most.
        let mut answers = Vec::new();
        b.take_declare_answers(&mut answers);
        assert!(answers.is_empty(), "{answers:?}");
        let now = b.now_ms;
        b.tick(now + MADE_WAIT_MS);
        b.take_declare_answers(&mut answers);
        assert_eq!(
            answers.pop().map(|a| (a.ticket, a.result.is_ok())),
            Some((early, true))
        );
        let ticket = match b.declare_queue_as("/", quorum("jobs"), 5, None) {
            Ok(Declared::Waiting(t)) => t,
            other => panic!("not through the log: {other:?}"),
        };
        assert_eq!(b.queue_id("/", "jobs"), None, "made only by the log");
        let out = sent(&mut b);
        let entry = out.first().and_then(decode_entry).expect("sent");
        let Some((number, MetaOp::DeclareQueue { group, leader, .. })) = entry.ops.first() else {
            panic!("no declaration sent: {entry:?}");
        };
        assert_eq!((*number, *group), (ticket, QueueGroup::FromLog));
        assert_eq!(*leader, Some(2), "client-local");
        let _ = b.take_group_changes();
        b.apply_committed(&[own(9, out[0].clone())]);
        let id = b.queue_id("/", "jobs").expect("made by the log");
        let group = super::super::replicated::group_placed("/", "jobs", 9);
        assert_eq!(b.replica_group(id), Some(group));
        assert_ne!(group, group_of("/", "jobs"));
        assert_eq!(
            b.take_group_changes(),
            vec![GroupChange::Add {
                group,
                campaign: true,
                voters: None
            }]
        );
        let now = b.now_ms;
        b.tick(now + MADE_WAIT_MS);
        b.take_declare_answers(&mut answers);
        assert_eq!(answers.len(), 1);
        assert_eq!(answers[0].ticket, ticket);
        assert_eq!(answers[0].conn, 5);
        assert_eq!(answers[0].result.as_ref().map(|d| d.queue), Ok(id));
        // The store keeps the group the log gave it.
        let stored = written(&mut b).into_iter().any(
            |op| matches!(op, StoreOp::PutQueue(QueueDef { group: Some(g), .. }) if g == group),
        );
        assert!(stored, "the queue's group is stored");
    }

    /// `x-quorum-initial-group-size` gives a declaration voters of its own only once every
    /// node keeps them (`GROUP_VOTERS_LEVEL`): below it the entry carries none, and every node
    /// votes. The voters: this node (the first leader, `client-local`), then the next.
    #[test]
    fn an_initial_group_size_chooses_voters_only_once_every_node_keeps_them() {
        let declared = |level_of_one: u64| -> Option<Vec<u64>> {
            let mut b = new_node_two();
            b.restore_meta_applied(
                0,
                &[],
                &[(1, level_of_one), (2, FEATURE_LEVEL), (3, FEATURE_LEVEL)],
                None,
                &[],
            );
            b.set_meta_leader(Some(1));
            let _ = sent(&mut b);
            let mut req = quorum("small");
            req.arguments
                .insert("x-quorum-initial-group-size", FieldValue::I32(2));
            let Ok(Declared::Waiting(_)) = b.declare_queue_as("/", req, 5, None) else {
                panic!("not through the log");
            };
            let out = sent(&mut b);
            let entry = decode_entry(out.last().expect("sent")).expect("an entry");
            match &entry.ops.first().expect("an operation").1 {
                MetaOp::DeclareQueue { voters, .. } => voters.clone(),
                op => panic!("{op:?}"),
            }
        };
        assert_eq!(declared(FEATURE_LEVEL), Some(vec![2, 3]));
        assert_eq!(declared(GROUP_VOTERS_LEVEL - 1), None);
    }

    /// A declaration the log does not apply within its wait is refused with RabbitMQ's words;
    /// when the entry commits later, the queue is made all the same, and nobody is answered
    /// twice. One declared with other arguments than the queue the log made first is refused
    /// as a redeclaration is.
    #[test]
    fn a_declaration_that_waits_too_long_is_refused_and_a_different_one_fails_as_a_redeclare() {
        let mut b = node_two();
        b.set_meta_leader(Some(1));
        let levels: Vec<Committed> = (1..=3)
            .map(|n| entry_from(1, n, 200 + n, MetaOp::FeatureLevel { node: n, level: 1 }))
            .collect();
        b.apply_committed(&levels);
        let again = sent(&mut b);
        assert_eq!(again.len(), 1, "this node's level told again");
        b.apply_committed(&[own(4, again[0].clone())]);
        let start = b.now_ms;
        let Ok(Declared::Waiting(slow)) = b.declare_queue_as("/", quorum("slow"), 5, None) else {
            panic!("not through the log");
        };
        let out = sent(&mut b);
        let mut answers = Vec::new();
        b.tick(start + DECLARE_WAIT_MS - 1);
        b.take_declare_answers(&mut answers);
        assert!(answers.is_empty(), "{answers:?}");
        assert!(b.next_deadline() <= Some(start + DECLARE_WAIT_MS));
        b.tick(start + DECLARE_WAIT_MS);
        b.take_declare_answers(&mut answers);
        let (ticket, result) = answers
            .pop()
            .map(|a| (a.ticket, a.result.map(|_| ())))
            .expect("answered");
        assert_eq!(ticket, slow);
        let error = result.expect_err("refused");
        assert_eq!(error.code, ReplyCode::InternalError);
        assert_eq!(
            error.text,
            "Cannot declare a queue 'queue 'slow' in vhost '/'' on node 2: timeout"
        );
        b.apply_committed(&[own(7, out[0].clone())]);
        assert!(b.queue_id("/", "slow").is_some(), "made by the late entry");
        b.take_declare_answers(&mut answers);
        assert!(answers.is_empty(), "answered once: {answers:?}");

        // Another node's declaration of "jobs" with a length limit comes first.
        let mut limited = quorum("jobs").arguments;
        limited.insert("x-max-length", FieldValue::I64(5));
        let Ok(Declared::Waiting(_)) = b.declare_queue_as("/", quorum("jobs"), 6, None) else {
            panic!("not through the log");
        };
        // (The late entry of "slow" was sent again meanwhile: this one goes last.)
        let mine = sent(&mut b).pop().expect("sent");
        let theirs = MetaOp::DeclareQueue {
            vhost: "/".into(),
            name: ShortStr::from_static("jobs"),
            arguments: limited.clone(),
            leader: Some(3),
            group: QueueGroup::FromLog,
            voters: None,
        };
        b.apply_committed(&[entry_from(3, 8, 300, theirs), own(9, mine)]);
        let id = b.queue_id("/", "jobs").expect("declared");
        let arguments = b.queues.get(&id).map(|q| q.arguments.clone());
        assert_eq!(
            b.replica_group(id),
            Some(super::super::replicated::group_placed("/", "jobs", 8))
        );
        assert_eq!(
            arguments,
            Some(limited),
            "the first declaration's arguments"
        );
        b.take_declare_answers(&mut answers);
        let refused = answers
            .pop()
            .expect("answered")
            .result
            .expect_err("refused");
        assert_eq!(refused.code, ReplyCode::PreconditionFailed);
        assert!(refused.text.contains("x-max-length"), "{}", refused.text);
    }

    /// The cluster forgets a stopped node through the log, once every node can: its nodes
    /// change on every node as the entry applies (the driver moves the groups), are written
    /// with the log's place, and travel in the metadata snapshot.
    #[test]
    fn a_stopped_node_is_forgotten_through_the_log_and_stays_forgotten_after_a_restart() {
        let mut b = node_two();
        b.set_meta_leader(Some(1));
        let _ = sent(&mut b);
        assert_eq!(b.forget_node(3), Err(ForgetError::Running(3)));
        b.set_peer_up(3, false);
        assert_eq!(
            b.forget_node(3),
            Err(ForgetError::Level { have: 0, want: 2 }),
            "node 3 may run a version that cannot read the entry"
        );
        b.apply_committed(&[
            entry_from(1, 1, 100, MetaOp::FeatureLevel { node: 1, level: 2 }),
            entry_from(3, 2, 100, MetaOp::FeatureLevel { node: 3, level: 2 }),
        ]);
        // Node 2 says its level again, for the nodes that skipped it.
        let again = sent(&mut b);
        b.apply_committed(&[own(3, again[0].clone())]);
        assert_eq!(b.cluster_feature_level(), Some(2));
        assert_eq!(b.forget_node(2), Err(ForgetError::Itself(2)));
        assert_eq!(b.forget_node(4), Err(ForgetError::NotMember(4)));
        let _ = b.take_group_changes();
        b.forget_node(3).expect("asked");
        assert_eq!(
            b.cluster_view().map(|v| v.1),
            Some(vec![1, 2, 3]),
            "forgotten only as the log applies it"
        );
        let out = sent(&mut b);
        let entry = out.first().and_then(decode_entry).expect("sent");
        assert_eq!(entry.ops.len(), 1, "alone in its entry");
        assert!(
            matches!(entry.ops[0].1, MetaOp::ForgetNode { node: 3 }),
            "{:?}",
            entry.ops
        );
        b.set_snapshot_policy(1, SnapshotLimits::NONE);
        b.apply_committed(&[own(4, out[0].clone())]);
        assert_eq!(b.cluster_view().map(|v| v.1), Some(vec![1, 2]));
        assert_eq!(
            b.take_group_changes(),
            vec![GroupChange::Members {
                voters: vec![1, 2],
                addresses: vec![]
            }]
        );
        let place = StoreOp::PutMetaApplied {
            index: 4,
            seen: vec![(1, 100), (2, entry.seq), (3, 100)],
            levels: vec![(1, 2), (2, FEATURE_LEVEL)],
            members: Some(vec![(1, String::new()), (2, String::new())]),
            forgotten: vec![3],
        };
        assert_eq!(written(&mut b).last(), Some(&place));
        // Two nodes left: losing one more would leave no majority anywhere.
        b.set_peer_up(1, false);
        assert_eq!(b.forget_node(1), Err(ForgetError::TooFew(2)));

        // Started again on its store: still two nodes, and the driver hears so.
        let mut again = new_node_two();
        again.restore_access(&place).expect("restored");
        assert_eq!(again.cluster_view().map(|v| v.1), Some(vec![1, 2]));
        assert!(again.take_group_changes().contains(&GroupChange::Members {
            voters: vec![1, 2],
            addresses: vec![]
        }));

        // A node far behind installs the metadata snapshot: the nodes come with it, first.
        let mut snaps = Vec::new();
        b.take_snapshots(&mut snaps);
        let snap = snaps.pop().expect("a metadata snapshot");
        let mut behind = node_two();
        behind.install_snapshot(
            META_GROUP,
            snap.index,
            snap.term,
            snap.data.encode().unwrap(),
        );
        assert_eq!(behind.cluster_view().map(|v| v.1), Some(vec![1, 2]));
        assert_eq!(
            behind.take_group_changes().first(),
            Some(&GroupChange::Members {
                voters: vec![1, 2],
                addresses: vec![]
            })
        );
    }

    /// A node that asks to join is added through the log, once, with its address and level;
    /// a queue the log makes afterwards starts with it; a node far behind learns the nodes
    /// from the metadata snapshot and waits for each queue's snapshot; a forgotten number is
    /// taken again only by a node that joins, and a member's number never.
    #[test]
    fn a_joining_node_is_added_through_the_log_and_a_forgotten_number_only_by_a_joining_one() {
        let mut b = node_two();
        b.set_meta_leader(Some(1));
        let _ = sent(&mut b);
        b.apply_committed(&[
            entry_from(1, 1, 100, MetaOp::FeatureLevel { node: 1, level: 2 }),
            entry_from(3, 2, 100, MetaOp::FeatureLevel { node: 3, level: 2 }),
        ]);
        let again = sent(&mut b);
        b.apply_committed(&[own(3, again[0].clone())]);
        b.apply_committed(&[entry_from(1, 4, 101, MetaOp::ForgetNode { node: 3 })]);
        assert_eq!(b.cluster_view().map(|v| v.1), Some(vec![1, 2]));
        let _ = b.take_group_changes();

        assert!(
            !b.request_join(2, "n2.example:7702", 2),
            "a member's number"
        );
        assert!(
            !b.request_join(4, "n4.example:7704", 1),
            "a version below the cluster's level"
        );
        assert!(b.request_join(4, "n4.example:7704", 2));
        assert!(!b.request_join(4, "n4.example:7704", 2), "asked once");
        let out = sent(&mut b);
        let entry = out.first().and_then(decode_entry).expect("sent");
        assert_eq!(
            entry.ops.first().map(|(_, op)| op),
            Some(&MetaOp::AddNode {
                node: 4,
                addr: "n4.example:7704".into(),
                level: 2
            })
        );
        b.set_snapshot_policy(1_000_000, SnapshotLimits::NONE);
        b.apply_committed(&[own(5, out[0].clone())]);
        assert_eq!(b.cluster_view().map(|v| v.1), Some(vec![1, 2, 4]));
        assert_eq!(
            b.take_group_changes(),
            vec![GroupChange::Members {
                voters: vec![1, 2, 4],
                addresses: vec![(4, "n4.example:7704".into())]
            }]
        );
        assert_eq!(
            b.cluster_feature_level(),
            Some(2),
            "its level known at once"
        );
        assert!(!b.request_join(4, "n4.example:7704", 2), "a member already");

        // A quorum queue the log makes now starts with the three nodes.
        let Ok(Declared::Waiting(_)) = b.declare_queue_as("/", quorum("late"), 5, None) else {
            panic!("not through the log");
        };
        let out = sent(&mut b);
        b.apply_committed(&[own(6, out[0].clone())]);
        let group = super::super::replicated::group_placed("/", "late", 6);
        let changes = b.take_group_changes();
        assert!(
            changes.iter().any(|c| matches!(c, GroupChange::Add { group: g, voters: Some(v), .. } if *g == group && *v == vec![1, 2, 4])),
            "{changes:?}"
        );

        // A node far behind installs the metadata snapshot: the nodes and the forgotten
        // number come with it, and the queue's group waits for its leader's snapshot.
        b.want_snapshots(&[META_GROUP]);
        let mut snaps = Vec::new();
        b.take_snapshots(&mut snaps);
        let snap = snaps.pop().expect("a metadata snapshot, taken when asked");
        let mut behind = node_two();
        behind.install_snapshot(
            META_GROUP,
            snap.index,
            snap.term,
            snap.data.encode().unwrap(),
        );
        assert_eq!(behind.cluster_view().map(|v| v.1), Some(vec![1, 2, 4]));
        let changes = behind.take_group_changes();
        assert_eq!(
            changes.first(),
            Some(&GroupChange::Members {
                voters: vec![1, 2, 4],
                addresses: vec![(4, "n4.example:7704".into())]
            })
        );
        assert!(
            changes.contains(&GroupChange::Join { group }),
            "{changes:?}"
        );
        behind.set_meta_leader(Some(1));
        let forgotten = |b: &Broker| b.cluster.as_ref().map(|c| c.meta.forgotten.clone());
        assert_eq!(forgotten(&behind), Some([3].into()), "forgotten there too");

        // A new node joins under the forgotten number (a StatefulSet's ordinal scaled away
        // and back): added as any joining node, and no longer forgotten.
        assert!(behind.request_join(3, "n3b.example:7703", 2));
        let out = sent(&mut behind);
        behind.apply_committed(&[own(snap.index + 1, out[0].clone())]);
        assert_eq!(behind.cluster_view().map(|v| v.1), Some(vec![1, 2, 3, 4]));
        assert_eq!(forgotten(&behind), Some(Default::default()));
        let changes = behind.take_group_changes();
        assert!(
            changes.iter().any(
                |c| matches!(c, GroupChange::Members { voters, .. } if *voters == vec![1, 2, 3, 4])
            ),
            "{changes:?}"
        );
        assert!(
            !behind.request_join(3, "n3b.example:7703", 2),
            "a member now"
        );
    }

    fn exchange(name: &str) -> MetaOp {
        MetaOp::DeclareExchange {
            vhost: "/".into(),
            name: name.into(),
            kind: "direct".into(),
            auto_delete: false,
            internal: false,
            arguments: FieldTable::new(),
        }
    }

    /// A durable direct exchange, declared by a client of this node.
    fn declare(b: &mut Broker, name: &str) {
        b.declare_exchange(
            "/",
            name,
            "direct",
            false,
            true,
            false,
            false,
            &FieldTable::new(),
        )
        .expect("declare");
    }

    /// What the broker wrote since, reported written (as the store thread does).
    fn written(b: &mut Broker) -> Vec<StoreOp> {
        let mut ops = Vec::new();
        while let Some(w) = b.take_writes() {
            ops.extend(w.ops);
            b.writes_done(w.number);
        }
        ops
    }

    #[test]
    fn a_restart_applies_only_the_entries_after_those_its_store_holds() {
        let log = [
            entry(1, 10, exchange("a")),
            entry(
                2,
                11,
                MetaOp::DeleteExchange {
                    vhost: "/".into(),
                    name: "a".into(),
                },
            ),
            entry(3, 12, exchange("b")),
        ];
        let mut b = node_two();
        b.apply_committed(&log);
        assert!(!b.exchange_exists("/", "a"));
        assert!(b.exchange_exists("/", "b"));
        let ops = written(&mut b);
        let place = StoreOp::PutMetaApplied {
            index: 3,
            seen: vec![(1, 12)],
            levels: vec![(2, FEATURE_LEVEL)],
            members: None,
            forgotten: Vec::new(),
        };
        assert_eq!(
            ops.last(),
            Some(&place),
            "written with what the entries changed"
        );

        // Started again on its store: the exchange it holds and its place in the log. Raft
        // gives it every committed entry again: the old ones change nothing, a copy of the
        // last one neither, the next one is applied.
        let mut b = node_two();
        b.restore_access(&place).expect("restored");
        declare(&mut b, "b");
        let _ = written(&mut b);
        b.apply_committed(&log);
        assert!(written(&mut b).is_empty(), "nothing applied twice");
        b.apply_committed(&[entry(4, 12, exchange("copy")), entry(5, 13, exchange("c"))]);
        assert!(!b.exchange_exists("/", "copy"));
        assert!(b.exchange_exists("/", "c"));
        assert!(written(&mut b).contains(&StoreOp::PutMetaApplied {
            index: 5,
            seen: vec![(1, 13)],
            levels: vec![(2, FEATURE_LEVEL)],
            members: None,
            forgotten: Vec::new(),
        }));
    }

    /// What node 2 proposes or sends to the metadata group's leader (node 1), once its store
    /// wrote what it had.
    fn sent(b: &mut Broker) -> Vec<bytes::Bytes> {
        let _ = written(b);
        let mut out = Vec::new();
        b.take_proposals(&mut out);
        out.into_iter()
            .filter(|p| p.group == META_GROUP)
            .map(|p| bytes::Bytes::from(p.data))
            .collect()
    }

    fn own(index: u64, data: bytes::Bytes) -> Committed {
        Committed {
            group: GroupId(META_GROUP),
            index,
            term: 1,
            data,
        }
    }

    #[test]
    fn a_change_goes_to_the_cluster_once_the_store_has_it() {
        let mut b = node_two();
        b.set_meta_leader(Some(1));
        declare(&mut b, "x");
        let mut out = Vec::new();
        b.take_proposals(&mut out);
        assert!(out.is_empty(), "not before the store wrote it");
        let batch = b.take_writes().expect("a batch");
        assert!(batch
            .ops
            .iter()
            .any(|op| matches!(op, StoreOp::PutMetaPending { .. })));
        b.take_proposals(&mut out);
        assert!(out.is_empty(), "handed to the store is not written");
        b.writes_done(batch.number);
        assert_eq!(sent(&mut b).len(), 1, "sent once written");
    }

    #[test]
    fn a_rebalance_travels_in_an_entry_of_its_own() {
        let mut b = node_two();
        b.set_meta_leader(Some(1));
        declare(&mut b, "a");
        assert!(b.rebalance());
        declare(&mut b, "b");
        let mut kinds = Vec::new();
        for index in 1..=3 {
            let out = sent(&mut b);
            assert_eq!(out.len(), 1, "entry {index}");
            let entry = decode_entry(&out[0]).expect("entry");
            kinds.push(
                entry
                    .ops
                    .iter()
                    .map(|(_, op)| matches!(op, MetaOp::Rebalance))
                    .collect::<Vec<_>>(),
            );
            // Applied by the log: the next entry goes.
            b.apply_committed(&[own(index, out[0].clone())]);
        }
        // An older node that cannot read the rebalance skips it and nothing else.
        assert_eq!(kinds, vec![vec![false], vec![true], vec![false]]);
        assert!(b.exchange_exists("/", "a") && b.exchange_exists("/", "b"));
    }

    #[test]
    fn numbers_go_on_past_what_the_store_has_of_this_node_even_if_the_clock_went_back() {
        let mut b = node_two();
        let high = 40 << 20;
        b.restore_access(&StoreOp::PutMetaApplied {
            index: 3,
            seen: vec![(2, high)],
            levels: Vec::new(),
            members: None,
            forgotten: Vec::new(),
        })
        .expect("restored");
        b.set_meta_leader(Some(1));
        declare(&mut b, "x");
        let out = sent(&mut b);
        assert_eq!(out.len(), 1);
        let (_, seq) = decode_head(&out[0]).expect("head");
        assert!(seq > high, "{seq} after {high}");
    }

    #[test]
    fn a_change_the_log_had_not_applied_before_a_crash_is_sent_again_after_it() {
        let mut b = node_two();
        b.set_meta_leader(Some(1));
        declare(&mut b, "x");
        let ops = written(&mut b);
        let first = sent(&mut b);
        assert_eq!(first.len(), 1);
        let pending: Vec<StoreOp> = ops
            .into_iter()
            .filter(|op| matches!(op, StoreOp::PutMetaPending { .. }))
            .collect();
        assert_eq!(pending.len(), 1, "kept with the declaration");

        // The node dies before the log applies it; started again on its store (the clock
        // behind: its start time is below the change's number), it sends the change again
        // and numbers new ones after it.
        let mut b = Broker::new(BrokerConfig {
            persistence: true,
            ..BrokerConfig::default()
        });
        b.join_cluster(2, &[1, 2, 3], 1);
        b.restore_access(&pending[0]).expect("restored");
        b.set_meta_leader(Some(1));
        let again = sent(&mut b);
        assert_eq!(again.len(), 1, "sent again");
        let resent = decode_entry(&again[0]).expect("entry");
        let StoreOp::PutMetaPending { number, .. } = pending[0] else {
            unreachable!()
        };
        assert_eq!(
            resent.seq, number,
            "with its number: a copy is applied once"
        );
        declare(&mut b, "y");
        // Applied (with the copy that was in the log after all): the store lets it go, and
        // the next change goes.
        let _ = written(&mut b);
        b.apply_committed(&[own(1, first[0].clone()), own(2, again[0].clone())]);
        let ops = written(&mut b);
        assert!(ops.contains(&StoreOp::DeleteMetaPending { number }));
        let next = sent(&mut b);
        assert_eq!(next.len(), 1);
        let next = decode_entry(&next[0]).expect("entry");
        assert!(next.seq > number, "numbered after the restored change");
        assert_eq!(
            b.cluster.as_ref().map(|c| c.meta.seen.get(&2).copied()),
            Some(Some(number))
        );
    }

    #[test]
    fn an_unreadable_entry_of_this_node_does_not_hold_back_the_next_ones() {
        let mut b = node_two();
        b.set_meta_leader(Some(1));
        declare(&mut b, "x");
        let first = sent(&mut b);
        declare(&mut b, "y");
        assert!(sent(&mut b).is_empty(), "one entry in flight");
        assert_eq!(first.len(), 1);
        let mut damaged = first[0].slice(..super::super::metadata_ops::HEAD).to_vec();
        damaged.extend_from_slice(b"garbage");
        b.apply_committed(&[own(1, bytes::Bytes::from(damaged))]);
        assert_eq!(sent(&mut b).len(), 1, "the next entry goes");
    }

    #[test]
    fn a_key_of_a_user_deleted_and_made_again_before_the_log_applied_them_stays_deleted() {
        use crate::access::{AccessKeyDef, UserDef};
        let mut b = node_two();
        b.set_meta_leader(Some(1));
        let alice = UserDef {
            name: "alice".into(),
            hash: None,
            tags: vec![],
        };
        b.put_user(alice.clone());
        b.put_access_key(AccessKeyDef {
            id: "WKIAK".into(),
            secret: "s".into(),
            user: "alice".into(),
            created_ms: 0,
        })
        .expect("key");
        b.delete_user("alice");
        b.put_user(alice);
        assert!(b.access().access_key("WKIAK").is_none());
        // The log applies this node's changes in the order they were made.
        let mut index = 0;
        for _ in 0..20 {
            let out = sent(&mut b);
            if out.is_empty() {
                break;
            }
            for data in out {
                index += 1;
                b.apply_committed(&[own(index, data)]);
            }
        }
        assert!(index > 0, "the changes went to the log");
        assert!(b.access().user("alice").is_some());
        assert!(
            b.access().access_key("WKIAK").is_none(),
            "the deleted user's key is not applied again to the new one"
        );
    }

    #[test]
    fn with_no_leader_known_nothing_is_due() {
        let mut b = node_two();
        b.set_meta_leader(Some(1));
        declare(&mut b, "x");
        assert_eq!(sent(&mut b).len(), 1);
        assert_eq!(b.meta_deadline(), Some(META_RESEND_MS));
        b.set_meta_leader(None);
        assert_eq!(b.meta_deadline(), None, "no timer to spin on");
        b.set_meta_leader(Some(3));
        assert_eq!(sent(&mut b).len(), 1, "the new leader gets it");
    }
}
