//! Replicated queues: proposals to their Raft groups, committed entries applied, leader changes.
//! The why is in `crate::replica`; the driver moves the bytes (see `Proposal`).

use super::away::AwayContext;
use super::*;
use crate::replica::{Mode, NodeId, ReplicaState};
use warren_queue::machine::EnqueuerId;
use warren_replication::queue::{decode, encode, Origin, Outcome, Proposals};
use warren_replication::{Committed, GroupId};

/// An entry for a replicated queue's group, from [`Broker::take_proposals`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Proposal {
    pub group: u64,
    pub data: Vec<u8>,
    /// `None`: propose it here (this node leads). `Some(node)`: a publish on a node that does
    /// not lead, for the leader's [`Broker::forwarded`].
    pub to: Option<NodeId>,
}

/// What a proposal's answer releases: the store batch its confirm waits in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Token {
    batch: u64,
    /// The channel publish's hold this proposal counts in ([`crate::holds`]; 0: none, the
    /// confirm waits in `batch`).
    hold: u64,
    /// Sent to the leader: a refusal is learnt only when it is applied here.
    forwarded: bool,
    /// A delayed message falling due, or a dead letter: the guard record that releases it
    /// again unless this entry is applied ([`Broker::settle_release_guards`]).
    release: Option<Guard>,
}

/// A guard record ([`Broker::release_guard`]) and what it guards.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Guard {
    pub key: DelayKey,
    /// A dead letter, which a full `reject-publish` queue drops (as RabbitMQ does) where a
    /// delayed message is held back again.
    pub dead_letter: bool,
}

/// How a guarded entry ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum GuardEnd {
    Applied,
    Refused,
    Lost,
}

/// The largest message body a replicated queue takes: its entry must fit in one frame of the
/// cluster's transport (64 MiB), with room to spare. A larger one is nacked.
pub const REPLICATED_MAX_BODY: usize = 32 << 20;

/// A publish this node forwarded, until it is applied.
#[derive(Debug)]
struct Kept {
    seq: u64,
    data: Vec<u8>,
    /// Taken out of the proposals when this node was elected (its own first entries must not
    /// make it look lost): proposed again, with this token, once the node acts.
    token: Option<Token>,
    /// When it was first sent, and last sent.
    first: u64,
    at: u64,
    /// The number of this node's next proposal when it was last sent: one of its entries
    /// numbered from there on, applied while this one is not, shows this one lost.
    sent_before: u64,
    /// A publish, whose confirm waits for it (a consumer's command waits for nothing).
    confirm: bool,
    /// The channel whose credit it sets, for a `Credit`: a later one replaces it.
    credit: Option<CreditGroup>,
    /// A `Down` of this node, which the consumer commands after it wait for; and one of those,
    /// not sent yet.
    down: bool,
    held: bool,
}

impl Kept {
    /// Sends it (again) to `leader` at `now`, before this node's proposal `upcoming`.
    fn send_to(
        &mut self,
        leader: NodeId,
        group: u64,
        outbox: &mut Vec<Proposal>,
        (now, upcoming): (u64, u64),
    ) {
        outbox.push(Proposal {
            group,
            data: self.data.clone(),
            to: Some(leader),
        });
        self.at = now;
        self.sent_before = upcoming;
        self.held = false;
    }
}

/// A publish held back behind this node's own undecided proposals as leader
/// ([`Cluster::behind`]), with the confirm that waits for it.
#[derive(Debug)]
struct Behind {
    id: QueueId,
    command: Command<Message>,
    token: Token,
    /// When it was published: it is nacked, as a forward is, once it waited
    /// `FORWARD_TIMEOUT_MS`.
    at: u64,
}

/// A batch whose replicated entries are not all applied within this time is nacked: a group
/// that lost its majority for good must not hold back every later confirm of the node.
const CONFIRM_TIMEOUT_MS: u64 = 30_000;

/// A delayed message falling due, or a dead letter, into a replicated queue is sent there again
/// this long after, unless its entry is applied first (`Broker::release_guard`): past the confirm
/// timeout, so that the entry's fate is known by then.
pub(super) const RELEASE_GUARD_MS: u64 = CONFIRM_TIMEOUT_MS + 5_000;

/// A peer node unheard of for this long has lost its connections as far as its queues are
/// concerned: the queues this node leads bring it `Down` (its consumers go, what they held is
/// delivered again). Shorter outages cost nothing: its consumers carry on.
pub const NODE_DOWN_MS: u64 = 5_000;

/// A definition change waits for a peer down this recently, as for a running one: its Raft
/// calls a peer down after a few ticks without a word (200 ms at the default tick), which a
/// loaded machine or a slow link reaches without any node stopping. One down longer is not
/// waited for.
pub(super) const RECENTLY_DOWN_MS: u64 = 1_000;

/// A publish forwarded to a leader and not applied within this time is nacked (the leader
/// may have dropped it; if it commits after all, the publisher has a duplicate, never a loss).
const FORWARD_TIMEOUT_MS: u64 = 10_000;

/// What a consumer on this node did (an ack, a cancel) and its leader has not applied after
/// this long is sent to it again: the first may have been lost with a connection (applied
/// twice, it changes nothing).
const FORWARD_RESEND_MS: u64 = 2_000;

/// A replicated queue's committed state at an index of its group's log, from
/// [`Broker::take_snapshots`]: once the driver has it on disk, the log before it may go.
#[derive(Debug)]
pub struct ReplicaSnapshot {
    pub group: u64,
    pub index: u64,
    pub term: u64,
    pub data: SnapshotData,
}

/// A snapshot's bytes, or the state to make them from.
#[derive(Debug)]
pub enum SnapshotData {
    Encoded(bytes::Bytes),
    /// A deep queue's committed machine, copied (its messages' bytes shared, not copied) for
    /// whoever writes the snapshot to encode: the copy takes a fifth of the encoding's time
    /// (12 ms against 57 to 70 ms for 100,000 queued 1 KiB messages here), and only the copy is
    /// made while the node is held. Its snapshot was estimated at most `max` bytes; one that
    /// turns out larger (its messages' properties weigh more than estimated) is refused.
    Machine {
        machine: Box<QueueMachine<Message>>,
        max: usize,
    },
}

/// Why [`SnapshotData::encode`] made no snapshot.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotDataError {
    #[error(transparent)]
    Machine(#[from] crate::machine::SnapshotError),
    #[error("{bytes} bytes or more, more than the {max} a follower can be sent")]
    TooLarge { bytes: usize, max: usize },
}

impl SnapshotData {
    /// The snapshot's bytes (encoding the machine, if that is still to do).
    pub fn encode(self) -> Result<bytes::Bytes, SnapshotDataError> {
        match self {
            SnapshotData::Encoded(b) => Ok(b),
            SnapshotData::Machine { machine, max } => {
                let mut buf = bytes::BytesMut::new();
                machine.snapshot(&mut buf)?;
                if buf.len() > max {
                    return Err(SnapshotDataError::TooLarge {
                        bytes: buf.len(),
                        max,
                    });
                }
                Ok(buf.freeze())
            }
        }
    }

    /// The bytes [`SnapshotData::encode`] gives, but all except the first
    /// [`SnapshotData::PREFIX`] handed to `sink` a chunk at a time as they are made; those
    /// first ones, known last, are returned. A deep queue's snapshot (up to a GiB) is written
    /// to its file this way, never whole in memory. Past `max` bytes it stops, refused.
    pub fn write_to(
        self,
        sink: &mut dyn FnMut(&[u8]) -> Result<(), String>,
    ) -> Result<Vec<u8>, SnapshotDataError> {
        let (machine, max) = match self {
            SnapshotData::Encoded(b) => {
                let (prefix, rest) = b.split_at(Self::PREFIX.min(b.len()));
                sink(rest).map_err(crate::machine::SnapshotError::Write)?;
                return Ok(prefix.to_vec());
            }
            SnapshotData::Machine { machine, max } => (machine, max),
        };
        let mut bytes = Self::PREFIX;
        let mut over = false;
        let prefix = machine.snapshot_to(STREAM_CHUNK, &mut |chunk: &[u8]| {
            bytes = bytes.saturating_add(chunk.len());
            if bytes > max {
                over = true;
                return Err("too large".to_owned());
            }
            sink(chunk)
        });
        match prefix {
            Ok(p) => Ok(p.to_vec()),
            Err(_) if over => Err(SnapshotDataError::TooLarge { bytes, max }),
            Err(e) => Err(e.into()),
        }
    }

    /// How many bytes a snapshot starts with that [`SnapshotData::write_to`] returns.
    pub const PREFIX: usize = crate::machine::SNAPSHOT_PREFIX;
}

/// The chunks a snapshot is streamed in: large enough that writing them costs a few calls per
/// MiB, small beside the snapshot.
const STREAM_CHUNK: usize = 1 << 20;

/// A group's snapshot as [`Broker::install_decoded`] takes it: a queue's state read from its
/// bytes (by whoever received them, before taking the broker), or the metadata's bytes.
#[derive(Debug)]
pub struct DecodedSnapshot {
    /// The metadata group's snapshot, read while installed (it names vhosts and queues the
    /// broker has to look up).
    data: bytes::Bytes,
    bytes: u64,
    machine: Option<Result<QueueMachine<Message>, crate::machine::SnapshotError>>,
}

impl DecodedSnapshot {
    pub fn decode(group: u64, data: bytes::Bytes) -> Self {
        Self::decode_with(group, data, None)
    }

    /// [`DecodedSnapshot::decode`], and with `away` (the broker's
    /// [`Broker::away_context`]) a deep queue's contents past its window sent away at once,
    /// the rest copied out of `data` (see [`AwayContext::send_restored_away`]).
    pub fn decode_with(group: u64, data: bytes::Bytes, away: Option<&AwayContext>) -> Self {
        let bytes = data.len() as u64;
        if group == super::metadata_group::META_GROUP {
            return DecodedSnapshot {
                data,
                bytes,
                machine: None,
            };
        }
        let mut machine = match away {
            Some(away) => {
                let mut restoring = away.restoring();
                let m = QueueMachine::<Message>::restore_snapshot_away(data, Some(&mut restoring));
                if let Some(error) = restoring.error {
                    tracing::warn!(%error, "writing the messages of a replicated queue read from a snapshot out of memory failed: they stay in memory for now");
                }
                m
            }
            None => QueueMachine::<Message>::restore_snapshot(data),
        };
        if let (Some(away), Ok(m)) = (away, machine.as_mut()) {
            away.send_restored_away(m, bytes);
        }
        DecodedSnapshot {
            machine: Some(machine),
            data: bytes::Bytes::new(),
            bytes,
        }
    }
}

/// About what a machine's snapshot holds: its messages' bodies and a little more each (46
/// bytes beside a body with its routing key and a delivery mode, §9 of docs/design.md).
fn snapshot_estimate(m: &QueueMachine<Message>) -> u64 {
    let (held, held_bytes) = m.held_count();
    let count = (m.ready_count() + m.in_flight_count() + held + m.dead_held_count()) as u64;
    // A deduplication key takes 49 bytes, a place in its order 41.
    let window = (m.dedup_keys() * 49 + m.dedup_order_len() * 41) as u64;
    // Dead-lettered messages kept until their dead letters are safe: few, and no counter of
    // their bytes is kept, so they are summed.
    let dead: u64 = m
        .dead_held()
        .map(|(_, d)| d.message.body.len() as u64)
        .sum();
    m.ready_bytes() + m.in_flight_bytes() + held_bytes + dead + 64 * count + window
}

fn too_large(queue: &dyn std::fmt::Display, vhost: &dyn std::fmt::Display, bytes: u64, max: usize) {
    tracing::warn!(%queue, %vhost, bytes, max, "replicated queue too large to snapshot: its log is kept until it is smaller");
}

/// A queue whose snapshot would be smaller than this is encoded at once (a few milliseconds at
/// most); a deeper one's machine is copied and encoded by the snapshot's writer.
const ENCODE_AT_ONCE_MAX: u64 = 8 << 20;

/// The largest queue snapshot a follower can be sent, by what every node of the cluster
/// receives ([`Broker::set_snapshot_policy`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SnapshotLimits {
    /// In one frame of the transport.
    pub frame: usize,
    /// In pieces, by nodes that hold a message of pieces in memory when they cannot spool it.
    pub pieced: usize,
    /// In pieces, by nodes that spool any size to their disk.
    pub large: usize,
}

impl SnapshotLimits {
    /// No limit: a broker whose snapshots never leave its node (tests).
    pub const NONE: SnapshotLimits = SnapshotLimits {
        frame: usize::MAX,
        pieced: usize::MAX,
        large: usize::MAX,
    };
}

/// Entries applied between two snapshots of a queue, at least.
pub const SNAPSHOT_ENTRIES: u64 = 4096;

/// Time between two snapshots of a queue, at least ([`Broker::set_snapshot_interval`]), unless
/// the log since the last one holds [`SNAPSHOT_LOG_BOUND`] bytes. A busy queue with a small
/// state outgrew its last snapshot many times a second (a worker's queue of a thousand 1 KiB
/// messages at 15,000 a second: 15 snapshots a second, each encoded, written and fsynced),
/// and its snapshots cost as much disk writing as its log.
pub const SNAPSHOT_INTERVAL_MS: u64 = 1_000;

/// Log bytes since a queue's last snapshot past which the interval is not waited for.
const SNAPSHOT_LOG_BOUND: u64 = 64 << 20;

/// The broker's part in a cluster.
#[derive(Debug)]
pub(crate) struct Cluster {
    node: NodeId,
    /// Every node of the cluster, this one included.
    nodes: Vec<NodeId>,
    /// Proposals waiting for their entries, each with the store batch its confirm waits in.
    proposals: Proposals<Token>,
    /// The origin of a forwarded entry being applied ahead by this leader.
    forwarding: Option<Origin>,
    /// Forwarded publishes not applied yet, by group, in order: sent again to the next leader
    /// when the leader changes (a leader's death must not nack what waited for it).
    kept: BTreeMap<u64, VecDeque<Kept>>,
    /// The token a publish this node forwarded, and now proposes itself, keeps.
    reissue: Option<Token>,
    /// Publishes of this node's clients held back, by group, in order, while what this node
    /// proposed as the group's leader is still undecided (a leader deposed while paused, that
    /// resumed and learnt of its successor before its Raft handed those proposals back): sent
    /// on once each of them is in the log, lost, or itself sent on, so that they reach the
    /// queue in the order their clients published them.
    behind: BTreeMap<u64, VecDeque<Behind>>,
    /// Groups this node stopped leading with proposals of its own as leader still undecided
    /// (publishes to them wait in `behind`), and the number of the last of them: found once
    /// as it steps down, so that a forward does not look through every proposal that waits,
    /// and what it proposes once it leads again does not count.
    led_pending: BTreeMap<u64, u64>,
    /// Publishes forwarded to this node while it was elected and not acting yet, by group.
    early: BTreeMap<u64, Vec<Vec<u8>>>,
    /// What this node's own consumers did (acks, rejects, cancels, credit) while it was
    /// elected and not acting yet, by group: run once it acts. Dropped, an ack would leave
    /// its message checked out to a live consumer for ever.
    deferred: BTreeMap<u64, Vec<Command<Message>>>,
    outbox: Vec<Proposal>,
    groups: HashMap<u64, QueueId>,
    /// Proposals not yet applied, per batch: a batch is confirmable once it has none.
    waiting: BTreeMap<u64, u32>,
    /// When each waiting batch got its first proposal (a batch never confirmable within
    /// `CONFIRM_TIMEOUT_MS` is nacked: no other publisher waits behind it for ever).
    waiting_since: BTreeMap<u64, u64>,
    /// Channels' publishes whose confirms wait for their own entries instead.
    pub(super) holds: crate::holds::Holds,
    /// The highest batch holding a proposal that will never be applied (its confirms are nacks).
    lost_upto: u64,
    /// Deliveries whose entries are applied, for the next dispatch.
    released: Vec<Delivery>,
    /// Consumers on this node of queues it stopped leading, for basic.cancel.
    cancelled: Vec<ConsumerKey>,
    /// Reused effects buffer of committed entries (every member computes them; only the
    /// leader acted on them, ahead of the log).
    scratch: Vec<Effect<Message>>,
    /// The metadata group's part.
    pub(super) meta: super::metadata_group::MetaState,
    /// basic.gets sent to other nodes' queues, waiting for their entries.
    pub(super) gets: super::remote_get::RemoteGets,
    /// Snapshots taken, for the driver.
    pub(super) snapshots: Vec<ReplicaSnapshot>,
    /// Entries between snapshots, and the largest snapshot that can be sent to a follower: in
    /// one frame, in pieces once every node takes them (`PIECES_LEVEL`), and larger ones once
    /// every node spools them to its disk whatever their size (`LARGE_SNAPSHOTS_LEVEL`).
    pub(super) snapshot_entries: u64,
    /// Time between two snapshots of a queue, at least (ms).
    pub(super) snapshot_interval_ms: u64,
    pub(super) snapshot_max: usize,
    pub(super) snapshot_max_pieced: usize,
    pub(super) snapshot_max_large: usize,
    /// Consumers of this node's channels on replicated queues (since it started): their queue,
    /// their key, and whether their group applied their `Consume` (a `Down` of this node
    /// applied after that means the leader took them away).
    local_consumers: HashMap<ConsumerId, (QueueId, ConsumerKey, bool)>,
    /// This node's consumers cancelled here whose `Cancel` the log has not applied yet: what
    /// the log still gives them goes to the session, which hands it back (the channel that
    /// would have released it has forgotten it).
    retired: HashMap<ConsumerId, QueueId>,
    /// Peers seen down, since when; and those already brought `Down` in the queues led here.
    down_since: BTreeMap<NodeId, u64>,
    downed: BTreeSet<NodeId>,
    /// Peers in maintenance mode, as their Raft batches say: no new leader is placed there.
    draining_peers: BTreeSet<NodeId>,
    /// The first proposal number of this start: an entry of this node's with a lower one is
    /// from an earlier start (replayed from the log), and speaks of channels that are gone.
    boot_seq: u64,
    /// The cluster addresses of this node's list (`--cluster-nodes`), as `HOST:PORT`.
    listed: BTreeMap<NodeId, String>,
    /// This node as the enqueuer of the publishes it forwards, per group: its id and the
    /// sequence of its last forward ([`Broker::as_enqueuer`]).
    enqueuers: HashMap<u64, (EnqueuerId, u64)>,
    /// The local part of this start's first enqueuer id, and how many were minted after it.
    enqueuer_base: u64,
    enqueuers_minted: u64,
    /// The guard record of the delayed message (or dead letter) being routed, for the tokens
    /// of its enqueues; guards whose entries ended, and how; and guards dropped already (the
    /// leader's own refusal, seen as it applied the entry ahead), whose entry's end changes
    /// nothing (a key is deleted once: the store's deletes rely on it).
    pub(super) release_tag: Option<Guard>,
    pub(super) guards_settled: Vec<(Guard, GuardEnd)>,
    pub(super) guards_dropped: HashSet<DelayKey>,
    /// Membership reconciliation (`None`: off), and when it looks next.
    pub(super) reconcile: Option<super::Reconciliation>,
    pub(super) reconcile_at: u64,
    /// Queues it asked a voter for: their number of voters then, and when.
    pub(super) reconcile_asked: HashMap<QueueId, (usize, u64)>,
}

impl Cluster {
    pub(crate) fn new(node: NodeId, nodes: &[NodeId], boot: u64) -> Self {
        Cluster {
            node,
            nodes: nodes.to_vec(),
            // 2^20 proposals per unit of `boot` (a millisecond) before numbers could meet.
            proposals: Proposals::starting_at(node, boot.saturating_mul(1 << 20)),
            meta: super::metadata_group::MetaState::starting_at(boot.saturating_mul(1 << 20)),
            gets: Default::default(),
            forwarding: None,
            kept: BTreeMap::new(),
            behind: BTreeMap::new(),
            led_pending: BTreeMap::new(),
            reissue: None,
            early: BTreeMap::new(),
            deferred: BTreeMap::new(),
            outbox: Vec::new(),
            groups: HashMap::new(),
            waiting: BTreeMap::new(),
            waiting_since: BTreeMap::new(),
            holds: Default::default(),
            lost_upto: 0,
            released: Vec::new(),
            cancelled: Vec::new(),
            scratch: Vec::new(),
            snapshots: Vec::new(),
            snapshot_entries: SNAPSHOT_ENTRIES,
            snapshot_interval_ms: SNAPSHOT_INTERVAL_MS,
            snapshot_max: usize::MAX,
            snapshot_max_pieced: usize::MAX,
            snapshot_max_large: usize::MAX,
            local_consumers: HashMap::new(),
            retired: HashMap::new(),
            down_since: BTreeMap::new(),
            downed: BTreeSet::new(),
            draining_peers: BTreeSet::new(),
            boot_seq: boot.saturating_mul(1 << 20),
            listed: BTreeMap::new(),
            enqueuers: HashMap::new(),
            // From the start's time (ms since 1970) on, 64 per millisecond: a restarted node's
            // ids never meet its earlier ones (which would take new publishes for resends of
            // old ones) unless its last run made 64 enqueuers (one per queue it forwarded to,
            // and one more per refusal) per millisecond it ran.
            // They fit the 48 bits of a node's ids until 2109 (past that, plain `Enqueue`s).
            enqueuer_base: boot.saturating_mul(1 << 6),
            enqueuers_minted: 0,
            release_tag: None,
            guards_settled: Vec::new(),
            guards_dropped: HashSet::new(),
            reconcile: None,
            reconcile_at: u64::MAX,
            reconcile_asked: HashMap::new(),
        }
    }

    /// This node's consumers of queue `id` that `machine` does not have: their consume was
    /// never applied (forwarded, or held until this node acts).
    fn unlogged<'a>(
        &'a self,
        id: QueueId,
        machine: &'a QueueMachine<Message>,
    ) -> impl Iterator<Item = ConsumerId> + 'a {
        self.local_consumers
            .iter()
            .filter(move |(cid, (queue, _, _))| {
                *queue == id && machine.consumers().all(|(other, _, _)| other != **cid)
            })
            .map(|(cid, _)| *cid)
    }

    /// [`Cluster::unlogged`] consumers are forgotten, and told with basic.cancel.
    fn cancel_unlogged(&mut self, id: QueueId, machine: &QueueMachine<Message>) {
        let unlogged: Vec<ConsumerId> = self.unlogged(id, machine).collect();
        for cid in unlogged {
            if let Some((_, key, _)) = self.local_consumers.remove(&cid) {
                self.cancelled.push(key);
            }
        }
    }

    pub(super) fn node(&self) -> NodeId {
        self.node
    }

    pub(super) fn nodes(&self) -> &[NodeId] {
        &self.nodes
    }

    /// Whether `node` runs (as far as Raft tells).
    pub(super) fn is_running(&self, node: NodeId) -> bool {
        node == self.node || (self.nodes.contains(&node) && !self.down_since.contains_key(&node))
    }

    /// The other nodes that run (as far as Raft tells).
    fn running_peers(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.nodes
            .iter()
            .copied()
            .filter(|n| *n != self.node && !self.down_since.contains_key(n))
    }

    /// When the first peer down since less than [`RECENTLY_DOWN_MS`] at `now` stops being
    /// waited for by definition changes ([`Cluster::peers_behind`]).
    pub(super) fn recently_down_until(&self, now: u64) -> Option<u64> {
        self.down_since
            .values()
            .map(|at| at.saturating_add(RECENTLY_DOWN_MS))
            .filter(|until| *until > now)
            .min()
    }

    /// The peers that report how far they applied the metadata log and have not said they
    /// reached `index`, at `now`: the running ones, and those down for less than
    /// [`RECENTLY_DOWN_MS`] (a link slow for a moment reads as a node down; a change answered
    /// without it was not there yet for its clients).
    pub(super) fn peers_behind(&self, index: u64, now: u64) -> Vec<NodeId> {
        let m = &self.meta;
        self.nodes
            .iter()
            .copied()
            .filter(|n| *n != self.node)
            .filter(|n| {
                self.down_since
                    .get(n)
                    .is_none_or(|at| now.saturating_sub(*at) < RECENTLY_DOWN_MS)
            })
            .filter(|n| {
                m.levels
                    .get(n)
                    .is_some_and(|l| *l >= super::metadata_group::REPORTS_LEVEL)
            })
            .filter(|n| m.peer_applied.get(n).copied().unwrap_or(0) < index)
            .collect()
    }

    /// Tells the running peers how far this node applied the metadata log: all of them when
    /// it grew, and those that came up since the last report.
    fn report_meta_applied(&mut self) {
        let applied = self.meta.applied;
        let to: Vec<NodeId> = if applied > self.meta.reported {
            self.meta.reported = applied;
            self.running_peers().collect()
        } else if self.meta.report_to.is_empty() || applied == 0 {
            return;
        } else {
            self.running_peers()
                .filter(|n| self.meta.report_to.contains(n))
                .collect()
        };
        self.meta.report_to.clear();
        for peer in to {
            self.outbox.push(Proposal {
                group: super::metadata_group::META_APPLIED,
                data: applied.to_be_bytes().to_vec(),
                to: Some(peer),
            });
        }
    }

    /// The cluster's nodes are now `nodes` (the metadata log added or forgot one): what this
    /// node knew of those that left goes, and the driver moves every group.
    pub(super) fn set_members(&mut self, mut nodes: Vec<NodeId>) {
        nodes.sort_unstable();
        nodes.dedup();
        for gone in self.nodes.iter().filter(|n| !nodes.contains(n)) {
            self.down_since.remove(gone);
            // Down for good: a leader elected from now on brings it `Down` too, so what its
            // consumers held is never kept for it.
            self.downed.insert(*gone);
            self.draining_peers.remove(gone);
            self.meta.levels.remove(gone);
        }
        for back in nodes.iter().filter(|n| !self.nodes.contains(n)) {
            // A forgotten number a new node took: nothing of the old one's holds for it.
            self.downed.remove(back);
            self.down_since.remove(back);
        }
        self.meta.addresses.retain(|n, _| nodes.contains(n));
        self.nodes = nodes.clone();
        self.meta.members = Some(nodes.clone());
        let addresses = self
            .meta
            .addresses
            .iter()
            .map(|(n, a)| (*n, a.clone()))
            .collect();
        self.meta
            .group_changes
            .push(super::metadata_group::GroupChange::Members {
                voters: nodes,
                addresses,
            });
    }

    /// [`Cluster::set_members`] from a list with addresses (empty: the one this node's list
    /// gives).
    pub(super) fn set_member_list(&mut self, list: Vec<(NodeId, String)>) {
        for (n, addr) in &list {
            if !addr.is_empty() {
                self.meta.addresses.insert(*n, addr.clone());
            }
        }
        self.set_members(list.into_iter().map(|(n, _)| n).collect());
    }

    /// The cluster's nodes with their addresses, once the log changed them: an added
    /// node's from the log, the others' from this node's list (so that a node that joins
    /// through a few of them learns where the rest are).
    pub(super) fn member_list(&self) -> Option<Vec<(NodeId, String)>> {
        let members = self.meta.members.as_ref()?;
        Some(
            members
                .iter()
                .map(|n| {
                    let addr = self
                        .meta
                        .addresses
                        .get(n)
                        .or_else(|| self.listed.get(n))
                        .cloned()
                        .unwrap_or_default();
                    (*n, addr)
                })
                .collect(),
        )
    }

    /// Raft saw `node` go down and not come back (a node never heard since this one started
    /// counts as down too).
    pub(super) fn peer_down(&self, node: NodeId) -> bool {
        self.down_since.contains_key(&node)
    }

    /// The store's record of the metadata log's place.
    pub(super) fn meta_applied_record(&self) -> StoreOp {
        let m = &self.meta;
        StoreOp::PutMetaApplied {
            index: m.applied,
            seen: m.seen.iter().map(|(n, s)| (*n, *s)).collect(),
            levels: m.levels.iter().map(|(n, l)| (*n, *l)).collect(),
            members: self.member_list(),
            forgotten: m.forgotten.iter().copied().collect(),
        }
    }

    pub(super) fn push(&mut self, p: Proposal) {
        self.outbox.push(p);
    }

    pub(super) fn push_cancelled(&mut self, keys: Vec<ConsumerKey>) {
        self.cancelled.extend(keys);
    }

    /// Sends the forwards of `group` that `which` picks to `leader` again, in order (with no
    /// leader known, they only count as sent now).
    fn send_kept(
        &mut self,
        group: u64,
        leader: Option<NodeId>,
        now: u64,
        which: impl Fn(&Kept) -> bool,
    ) {
        let upcoming = self.proposals.upcoming();
        for k in self.kept.get_mut(&group).into_iter().flatten() {
            if !which(k) {
                continue;
            }
            k.at = now;
            if let Some(leader) = leader {
                k.send_to(leader, group, &mut self.outbox, (now, upcoming));
            }
        }
    }

    fn settle(&mut self, outcome: Outcome<Token>) {
        let (token, reply) = match outcome {
            Outcome::Applied(token, reply) => (token, Some(reply)),
            Outcome::Lost(token) => (token, None),
        };
        // A forwarded publish refused by a full queue: its confirm is a nack (the leader's own
        // refusals were nacked when it applied them ahead).
        let lost = match reply {
            Some(Reply::Refused(_)) => token.forwarded,
            Some(_) => false,
            None => true,
        };
        if let Some(guard) = token.release {
            // A refusal (a full queue, or a sequence out of order) enqueued nothing, whoever
            // proposed it (a forward this node proposes itself once elected is its own token
            // by then).
            let end = match reply {
                Some(Reply::Refused(Refusal::Full)) => GuardEnd::Refused,
                Some(Reply::Refused(_)) | None => GuardEnd::Lost,
                Some(_) => GuardEnd::Applied,
            };
            self.guards_settled.push((guard, end));
        }
        if token.hold != 0 {
            self.holds.settle(token.hold, lost);
            self.batches_after_holds();
            return;
        }
        self.unwait_batch(token.batch, lost);
    }

    /// One wait fewer for the confirms of `batch`; with `lost`, they are nacks.
    fn unwait_batch(&mut self, batch: u64, lost: bool) {
        if let Some(n) = self.waiting.get_mut(&batch) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.waiting.remove(&batch);
                self.waiting_since.remove(&batch);
            }
        }
        if lost {
            self.lost_upto = self.lost_upto.max(batch);
        }
    }

    /// One more wait, from `now`, for the confirms of `batch`.
    fn wait_in_batch(&mut self, batch: u64, now: u64) {
        *self.waiting.entry(batch).or_insert(0) += 1;
        self.waiting_since.entry(batch).or_insert(now);
    }

    /// The publish of `token` will never be applied: its confirm is a nack.
    fn lose(&mut self, token: &Token) {
        if token.hold != 0 {
            self.holds.settle(token.hold, true);
            self.batches_after_holds();
        } else {
            self.lost_upto = self.lost_upto.max(token.batch);
        }
    }

    /// Store batches whose confirms waited for a hold that ended (a deduplicated copy's, from
    /// a publisher that waits for batches): one wait fewer, or lost.
    fn batches_after_holds(&mut self) {
        for (batch, lost) in self.holds.take_batches() {
            self.unwait_batch(batch, lost);
        }
        self.gets.holds_settled(&self.holds);
    }

    /// The confirms of the store batch being filled wait for `hold` too (a deduplicated copy
    /// of a channel's publish, published by the management API or SQS).
    pub(super) fn wait_in_batch_for(&mut self, hold: u64, batch: u64, now: u64) {
        if self.holds.follow_in_batch(hold, batch) {
            self.wait_in_batch(batch, now);
        }
    }

    /// A new publish token: its confirm waits in `batch`, or in the channel's hold being
    /// routed (not a released delayed message's or a dead letter's, which carry a guard).
    fn publish_token(&self, batch: u64, forwarded: bool, release: Option<Guard>) -> Token {
        Token {
            batch,
            hold: if release.is_none() {
                self.holds.current()
            } else {
                0
            },
            forwarded,
            release,
        }
    }

    /// The highest batch nacked since the confirms last went out (0: none).
    pub(super) fn lost_mark(&self) -> u64 {
        self.lost_upto
    }

    /// One more proposal the confirms of its hold, or else of its batch, wait for.
    fn wait_on(&mut self, token: &Token, now: u64) {
        if token.hold != 0 {
            self.holds.wait_on(token.hold, now);
            return;
        }
        self.wait_in_batch(token.batch, now);
    }

    /// Every proposal of this node still waiting in `group` will never be applied: their
    /// confirms are nacks. What this node's consumers did (acks, cancels, its own `Down`) is
    /// still sent to each leader until the log has it: given up, it would leave messages in
    /// flight for ever (and applied twice it changes nothing: a receipt is used once).
    fn abandon(&mut self, group: u64, out: &mut Vec<Outcome<Token>>) {
        let all = Origin {
            node: self.node,
            seq: u64::MAX,
        };
        self.proposals.applied(GroupId(group), all, Reply::Ok, out);
        // Sequences given to publishes dropped here (never sent, or sent and given up) would
        // be gaps: the next forward starts a new enqueuer, instead of being refused as out of
        // order with every one after it until that refusal came back.
        self.enqueuers.remove(&group);
        if let Some(kept) = self.kept.get_mut(&group) {
            kept.retain_mut(|k| {
                if k.confirm {
                    // Taken out of the proposals at an election: answered here.
                    if let Some(token) = k.token.take() {
                        out.push(Outcome::Lost(token));
                    }
                }
                !k.confirm
            });
            if kept.is_empty() {
                self.kept.remove(&group);
            }
        }
    }

    /// This node led `group` and a later leader's entry is applied: what it proposed as
    /// leader and is not in the log by now never will be. What it forwarded since (to the
    /// new leader, in the log after that entry) still waits for its own entry.
    fn abandon_led(&mut self, group: u64, out: &mut Vec<Outcome<Token>>) {
        self.proposals
            .lose_where(GroupId(group), |t| !t.forwarded, out);
    }
}

/// The Raft group of a replicated queue: a number every node computes alike from its vhost and
/// name (until the metadata group hands them out).
pub fn group_of(vhost: &str, name: &str) -> u64 {
    let mut key = Vec::with_capacity(4 + vhost.len() + name.len());
    key.extend_from_slice(&u32::try_from(vhost.len()).unwrap_or(u32::MAX).to_be_bytes());
    key.extend_from_slice(vhost.as_bytes());
    key.extend_from_slice(name.as_bytes());
    // Group 0 is the cluster's metadata; the top bit marks forwarded proposals on the wire.
    (warren_queue::stable_hash::hash_bytes(&key) >> 1).max(1)
}

/// The Raft group of a replicated queue the metadata log created at `index`: a queue deleted
/// and declared again is another group, so a member of the old one (a node away meanwhile,
/// with its higher term and longer log) can take no part in the new one's elections.
pub fn group_placed(vhost: &str, name: &str, index: u64) -> u64 {
    let mut key = Vec::with_capacity(13 + vhost.len() + name.len());
    key.push(b'p');
    key.extend_from_slice(&index.to_be_bytes());
    key.extend_from_slice(&u32::try_from(vhost.len()).unwrap_or(u32::MAX).to_be_bytes());
    key.extend_from_slice(vhost.as_bytes());
    key.extend_from_slice(name.as_bytes());
    (warren_queue::stable_hash::hash_bytes(&key) >> 1).max(1)
}

/// The group a replicated queue's records name: `None` when it is its name's.
pub(super) fn stored_group(q: &Queue) -> Option<u64> {
    let group = q.replica.as_ref()?.group;
    (group != group_of(&q.vhost, &q.name)).then_some(group)
}

impl Broker {
    /// Makes this broker node `node` of the cluster of `nodes`: queues declared with
    /// `x-queue-type: quorum` from now on are replicated (their commands go to
    /// [`Broker::take_proposals`]). Ids it mints are qualified by the node, so a peer can tell
    /// whose consumer a delivery went to. `boot` grows with every start of the node (the
    /// time in milliseconds will do): its proposals are numbered from it.
    pub fn join_cluster(&mut self, node: NodeId, nodes: &[NodeId], boot: u64) {
        self.cluster = Some(Box::new(Cluster::new(node, nodes, boot)));
        let local = warren_queue::LOCAL_ID_MAX.min(self.next_consumer);
        self.next_consumer = qualified(node, local);
    }

    /// The cluster addresses of the nodes of this node's list (`HOST:PORT`): a node joining
    /// through some of them learns the others' from the metadata.
    pub fn set_cluster_addresses(&mut self, listed: BTreeMap<NodeId, String>) {
        if let Some(c) = self.cluster.as_mut() {
            c.listed = listed;
        }
    }

    /// A replicated queue's committed state is snapshotted once `entries` entries were applied
    /// since the last one (and the log since holds as many bytes as that one did); a snapshot
    /// larger than what the cluster's transport can carry to a follower is not kept, and the
    /// log goes on growing until the queue is smaller. The transport carries `limits.frame` in
    /// one frame, `limits.pieced` in pieces once every node announced `PIECES_LEVEL` (a node of
    /// an earlier version drops pieces, so a follower of it could never catch up), and
    /// `limits.large` once every node announced `LARGE_SNAPSHOTS_LEVEL`.
    pub fn set_snapshot_policy(&mut self, entries: u64, limits: SnapshotLimits) {
        if let Some(c) = self.cluster.as_mut() {
            c.snapshot_entries = entries.max(1);
            c.snapshot_max = limits.frame;
            c.snapshot_max_pieced = limits.pieced.max(limits.frame);
            c.snapshot_max_large = limits.large.max(c.snapshot_max_pieced);
        }
    }

    /// A replicated queue is snapshotted at most once in `ms` (0: whenever the entries and
    /// bytes rule allows), unless the log since its last snapshot holds 64 MiB.
    pub fn set_snapshot_interval(&mut self, ms: u64) {
        if let Some(c) = self.cluster.as_mut() {
            c.snapshot_interval_ms = ms;
        }
    }

    /// The snapshots taken since the last call.
    pub fn take_snapshots(&mut self, out: &mut Vec<ReplicaSnapshot>) {
        if let Some(c) = self.cluster.as_mut() {
            out.append(&mut c.snapshots);
        }
    }

    /// A snapshot of a replicated queue's group at `index` replaces its machine: sent by the
    /// leader to a follower too far behind, or read back at a restart before the entries after
    /// it. What this node waited for in the group is nacked (it may be in the snapshot: a
    /// duplicate at worst, never a loss).
    pub fn install_snapshot(&mut self, group: u64, index: u64, term: u64, data: bytes::Bytes) {
        let decoded = DecodedSnapshot::decode_with(group, data, self.away_context().as_ref());
        drop(self.install_decoded(group, index, term, decoded));
    }

    /// [`Broker::install_snapshot`] of a snapshot decoded beforehand, away from whatever
    /// guards the broker: decoding a deep queue's takes about a third of a second per GiB.
    /// Returns the machine the snapshot replaced (or the snapshot's, when it is not
    /// installed), for the caller to drop there too: freeing millions of messages is not free
    /// either.
    pub fn install_decoded(
        &mut self,
        group: u64,
        index: u64,
        term: u64,
        decoded: DecodedSnapshot,
    ) -> Option<QueueMachine<Message>> {
        let replaced = self.install_decoded_here(group, index, term, decoded);
        // The proposals it gave up on may let publishes held back behind them go now, not at
        // the next entry applied or the next tick.
        self.send_behind();
        replaced
    }

    fn install_decoded_here(
        &mut self,
        group: u64,
        index: u64,
        term: u64,
        decoded: DecodedSnapshot,
    ) -> Option<QueueMachine<Message>> {
        let (len, machine) = match decoded.machine {
            None => {
                self.install_meta_snapshot(index, term, &decoded.data);
                self.check_hold_level();
                return None;
            }
            Some(m) => (decoded.bytes, m),
        };
        let Some(&id) = self.cluster.as_ref().and_then(|c| c.groups.get(&group)) else {
            tracing::warn!(
                group,
                index,
                "snapshot of a group with no queue here: ignored"
            );
            return machine.ok();
        };
        let applied = self
            .queues
            .get(&id)
            .and_then(|q| q.replica.as_ref())
            .map_or(u64::MAX, |r| r.applied_index);
        if index <= applied {
            return machine.ok();
        }
        let machine = match machine {
            Ok(m) => m,
            Err(error) => {
                // Checksummed on disk and on the wire: this is a bug or a different version.
                tracing::error!(group, index, %error, "unreadable snapshot: the queue keeps its state");
                return None;
            }
        };
        let leading = self
            .queues
            .get(&id)
            .and_then(|q| q.replica.as_ref())
            .is_some_and(|r| !matches!(r.mode, Mode::Following));
        if leading {
            self.step_down(id);
        }
        let (Some(c), Some(q)) = (self.cluster.as_mut(), self.queues.get_mut(&id)) else {
            return None;
        };
        let r = q.replica.as_mut()?;
        let replaced = std::mem::replace(&mut q.machine, machine);
        // From the start: what the decoder sent away is skipped (one walk of the line), and the
        // entries applied since count towards the next pass with those it left.
        r.away_through = 0;
        r.held_away = Default::default();
        r.retry_away = Default::default();
        r.mode = Mode::Following;
        r.held.clear();
        r.applied_index = index;
        r.applied_term = term;
        r.since_snapshot = 0;
        r.since_snapshot_bytes = 0;
        r.snapshot_bytes = len;
        r.applied_own = r.proposed;
        r.stepped_down = None;
        r.forwarded_ahead = 0;
        // What it proposed as leader and did not see applied is not in the log by now; its
        // forwarded publishes are sent again below.
        let mut outcomes = Vec::new();
        c.abandon_led(group, &mut outcomes);
        for o in outcomes {
            c.settle(o);
        }
        // The entries the snapshot skips may have given this node's consumers messages their
        // sessions never saw, and only a Down of this node gets those back: its consumers are
        // cancelled (told; what the log still gives them goes back) and it brings itself Down
        // before anything else of it. A follower gets a snapshot only when far behind.
        let mine: Vec<ConsumerId> = c
            .local_consumers
            .iter()
            .filter(|(_, (queue, _, _))| *queue == id)
            .map(|(cid, _)| *cid)
            .collect();
        // A basic.get the snapshot skipped took a message for this node too.
        let cut_off = c.gets.skipped(group) | !mine.is_empty();
        for cid in mine {
            if let Some((_, key, _)) = c.local_consumers.remove(&cid) {
                c.retired.insert(cid, id);
                c.cancelled.push(key);
            }
        }
        if cut_off {
            r.downed_self = false;
        }
        tracing::info!(queue = %q.name, vhost = %q.vhost, index, bytes = len, "replicated queue restored from a snapshot");
        if cut_off {
            self.down_self_once(id);
        }
        self.forward_again(id, group);
        // Restored with every message in memory: those past the window leave it again.
        self.send_away(id);
        Some(replaced)
    }

    /// After a snapshot: the publishes this node forwarded and still waits for may be in the
    /// entries it skipped or not, so each is forwarded again under a new proposal number,
    /// keeping its confirm. Each is an `EnqueueFrom` ([`Broker::as_enqueuer`]): one the
    /// snapshot holds, or whose first copy is applied after it, is a `Duplicate` (confirmed,
    /// in the queue once). Forwarded as a plain `Enqueue` (a cluster with a node below
    /// `ENQUEUERS_LEVEL`), it is in the queue twice, never lost. Either way the publisher is
    /// not nacked for a snapshot it cannot know of: a node restarted under load is sent one,
    /// and it nacked what its clients published in its first moments. The old numbers answer
    /// nothing any more (this node's waiting proposals now start after them).
    fn forward_again(&mut self, id: QueueId, group: u64) {
        let Some(c) = self.cluster.as_mut() else {
            return;
        };
        let node = c.node;
        let Some(kept) = c.kept.get_mut(&group) else {
            return;
        };
        let proposals = &mut c.proposals;
        let mut again = Vec::new();
        kept.retain_mut(|k| {
            if !k.confirm {
                return true;
            }
            let origin = Origin { node, seq: k.seq };
            let token = k
                .token
                .take()
                .or_else(|| proposals.withdraw(GroupId(group), origin));
            again.push((std::mem::take(&mut k.data), token));
            false
        });
        if kept.is_empty() {
            c.kept.remove(&group);
        }
        for (data, token) in again {
            // None: its outcome was settled already (nothing waits for it).
            let Some(token) = token else { continue };
            match decode(bytes::Bytes::from(data)) {
                Ok((_, command)) => {
                    // One the snapshot shows decided is answered from it, not sent again: a
                    // node far behind is sent snapshot after snapshot, and each sent its whole
                    // backlog again, a log entry per message, which put it further behind.
                    let decided = match &command {
                        Command::EnqueueFrom { enqueuer, seq, .. }
                        | Command::EnqueueWith {
                            from: Some((enqueuer, seq)),
                            ..
                        } => self
                            .committed_machine(id)
                            .and_then(|m| m.decided(*enqueuer, *seq)),
                        _ => None,
                    };
                    if let Some(reply) = decided {
                        if let Some(c) = self.cluster.as_mut() {
                            c.settle(Outcome::Applied(token, reply));
                        }
                        continue;
                    }
                    self.forward_keeping(id, &command, true, Some(token));
                }
                Err(_) => {
                    if let Some(c) = self.cluster.as_mut() {
                        c.settle(Outcome::Lost(token));
                    }
                }
            }
        }
    }

    /// Raft's leaders need snapshots of these groups now (a node being added starts from
    /// one): each queue's committed state is taken at once, the metadata's once no change of
    /// this node's waits for the log (Raft asks again a second later otherwise).
    pub fn want_snapshots(&mut self, groups: &[u64]) {
        // Only once the cluster's nodes changed (a node being added waits for these): a
        // cluster that never changed keeps to the snapshots taken every so many entries, which
        // serve a lagging follower as before (the on-demand path is new, and a scripts/faults
        // run lost confirmed messages once with it on in a cluster of fixed nodes, cause not
        // yet found).
        if self
            .cluster
            .as_ref()
            .is_none_or(|c| c.meta.members.is_none())
        {
            return;
        }
        let mut ids = Vec::new();
        for g in groups {
            if *g == super::metadata_group::META_GROUP {
                if let Some(c) = self.cluster.as_mut() {
                    c.meta.snapshot_asked = true;
                }
                self.take_meta_snapshot();
                continue;
            }
            let Some(id) = self.cluster.as_ref().and_then(|c| c.groups.get(g)).copied() else {
                continue;
            };
            if let Some(r) = self.queues.get_mut(&id).and_then(|q| q.replica.as_mut()) {
                r.since_snapshot = u64::MAX;
                r.since_snapshot_bytes = u64::MAX;
                ids.push(id);
            }
        }
        self.take_due_snapshots(&ids);
    }

    /// The largest queue snapshot kept: what a follower can be sent.
    pub(super) fn snapshot_limit(&self) -> usize {
        let Some(c) = self.cluster.as_ref() else {
            return usize::MAX;
        };
        use super::metadata_group::{LARGE_SNAPSHOTS_LEVEL, PIECES_LEVEL};
        match self.cluster_feature_level() {
            Some(l) if l >= LARGE_SNAPSHOTS_LEVEL => c.snapshot_max_large,
            Some(l) if l >= PIECES_LEVEL => c.snapshot_max_pieced,
            _ => c.snapshot_max,
        }
    }

    /// Snapshots the committed state of the queues in `ids` that applied enough since their
    /// last one.
    fn take_due_snapshots(&mut self, ids: &[QueueId]) {
        let max = self.snapshot_limit();
        // Contents that left memory are read back to be written: a queue that holds some is
        // encoded by the snapshot's writer, off this thread.
        let away_on = self.away.is_some();
        let now = self.now_ms;
        let Some(c) = self.cluster.as_mut() else {
            return;
        };
        for id in ids {
            let Some(q) = self.queues.get_mut(id) else {
                continue;
            };
            let Some(r) = q.replica.as_mut() else {
                continue;
            };
            if r.since_snapshot < c.snapshot_entries || r.since_snapshot_bytes < r.snapshot_bytes {
                continue;
            }
            let soon = now < r.snapshot_at_ms.saturating_add(c.snapshot_interval_ms);
            if soon && r.since_snapshot_bytes < SNAPSHOT_LOG_BOUND {
                continue;
            }
            r.snapshot_at_ms = now;
            let machine = match &r.mode {
                Mode::Leading { committed } => committed,
                _ => &q.machine,
            };
            r.since_snapshot = 0;
            r.since_snapshot_bytes = 0;
            let estimate = snapshot_estimate(machine);
            let at_once = estimate <= ENCODE_AT_ONCE_MAX
                && !(away_on
                    && (machine.messages().any(|(_, m, _)| m.is_away())
                        || machine.held_messages().any(|m| m.is_away())
                        || machine.dead_held().any(|(_, d)| d.message.is_away())));
            let data = if at_once {
                let mut buf = bytes::BytesMut::new();
                if let Err(error) = machine.snapshot(&mut buf) {
                    tracing::error!(queue = %q.name, %error, "no snapshot of a replicated queue");
                    continue;
                }
                r.snapshot_bytes = buf.len() as u64;
                SnapshotData::Encoded(buf.freeze())
            } else if estimate <= max as u64 {
                r.snapshot_bytes = estimate;
                SnapshotData::Machine {
                    machine: Box::new(machine.clone()),
                    max,
                }
            } else {
                // Not copied: it could not be sent.
                r.snapshot_bytes = estimate;
                too_large(&q.name, &q.vhost, estimate, max);
                continue;
            };
            if r.snapshot_bytes > max as u64 {
                too_large(&q.name, &q.vhost, r.snapshot_bytes, max);
                continue;
            }
            c.snapshots.push(ReplicaSnapshot {
                group: r.group,
                index: r.applied_index,
                term: r.applied_term,
                data,
            });
        }
    }

    /// This node's consumers of replicated queue `id` whose consume is in no machine yet
    /// (forwarded to the leader, or held until this node acts): they count as the queue's
    /// consumers for its client-facing limits.
    pub(super) fn unlogged_consumers(&self, id: QueueId) -> usize {
        let (Some(c), Some(q)) = (self.cluster.as_ref(), self.queues.get(&id)) else {
            return 0;
        };
        c.unlogged(id, &q.machine).count()
    }

    /// A consumer of this node's on a replicated queue, from now until it is cancelled.
    pub(super) fn track_consumer(&mut self, queue: QueueId, id: ConsumerId, key: ConsumerKey) {
        let replicated = self.queues.get(&queue).is_some_and(|q| q.replica.is_some());
        if let (true, Some(c)) = (replicated, self.cluster.as_mut()) {
            c.local_consumers.insert(id, (queue, key, false));
        }
    }

    pub(super) fn untrack_consumer(&mut self, id: ConsumerId) {
        if let Some(c) = self.cluster.as_mut() {
            if let Some((queue, _, _)) = c.local_consumers.remove(&id) {
                c.retired.insert(id, queue);
            }
        }
    }

    /// Deliveries a leader made for consumers on other nodes stay out of its session: each
    /// node hands its own consumers theirs when it applies the entry that made them.
    pub(super) fn keep_local_deliveries(&self, id: QueueId, out: &mut Vec<Delivery>, from: usize) {
        let Some(c) = self.cluster.as_ref() else {
            return;
        };
        if self.queues.get(&id).is_none_or(|q| q.replica.is_none()) {
            return;
        }
        let node = c.node;
        if out[from..].iter().all(|d| delivers_here(d, node)) {
            return;
        }
        let mine: Vec<Delivery> = out
            .drain(from..)
            .filter(|d| delivers_here(d, node))
            .collect();
        out.extend(mine);
    }

    /// The driver's Raft saw a peer node go down or come back. One down for
    /// [`NODE_DOWN_MS`] is brought `Down` in every queue led here (at the next tick).
    pub fn set_peer_up(&mut self, node: NodeId, up: bool) {
        let now = self.now_ms;
        let Some(c) = self.cluster.as_mut() else {
            return;
        };
        if up {
            c.down_since.remove(&node);
            c.downed.remove(&node);
            // It may have restarted: it learns how far this node is, and says again how far
            // it is itself.
            c.meta.report_to.insert(node);
        } else {
            c.down_since.entry(node).or_insert(now);
            c.meta.peer_applied.remove(&node);
            c.meta.report_to.remove(&node);
        }
        // A declaration no longer waits for a node that is down (once it has been down for
        // `RECENTLY_DOWN_MS`: the timer comes back for it).
        self.answer_cluster_waits();
        // A node back (or new) may take a queue to its target size.
        self.reconcile_soon();
    }

    /// Maintenance mode (`warren ctl drain`, RabbitMQ's `rabbitmq-upgrade drain`) on or off
    /// for this node. In a cluster its Raft hands every leadership it holds to other nodes
    /// and stands for none; new queues' leaders go elsewhere. (The session closes its client
    /// connections; the server stops taking new ones.)
    pub fn set_draining(&mut self, on: bool) {
        if self.draining == on {
            return;
        }
        self.draining = on;
        if let Some(c) = self.cluster.as_mut() {
            c.meta
                .group_changes
                .push(super::metadata_group::GroupChange::Drain { on });
        }
        if !on {
            self.reconcile_soon();
        }
    }

    /// This node is in maintenance mode.
    pub fn is_draining(&self) -> bool {
        self.draining
    }

    /// Asks every node of the cluster to even out the quorum queue leaderships (RabbitMQ's
    /// `rabbitmq-queues rebalance quorum`): once the metadata log carries the request, each
    /// node hands those it holds above an even share (among the running nodes not in
    /// maintenance mode) to the nodes below it. Each node acts on its own view, so a round
    /// may leave a node one or two off; the CLI asks again until it is even. False outside a
    /// cluster.
    pub fn rebalance(&mut self) -> bool {
        if self.cluster.is_none() {
            return false;
        }
        self.announce(super::metadata_ops::MetaOp::Rebalance);
        true
    }

    /// This node's part of a rebalance: the transfers of what it leads above its share.
    pub(super) fn shed_leaders(&mut self) {
        let Some(c) = self.cluster.as_ref() else {
            return;
        };
        let me = c.node;
        let eligible: Vec<NodeId> = c
            .nodes
            .iter()
            .copied()
            .filter(|n| {
                if *n == me {
                    !self.draining
                } else {
                    !c.down_since.contains_key(n) && !c.draining_peers.contains(n)
                }
            })
            .collect();
        if self.draining || eligible.len() < 2 {
            return;
        }
        let mut led: BTreeMap<NodeId, usize> = eligible.iter().map(|n| (*n, 0)).collect();
        // The groups led here, each with the nodes that may lead it (its voters).
        let mut mine: Vec<(u64, Vec<NodeId>)> = Vec::new();
        let mut nodes = c.nodes.clone();
        nodes.sort_unstable();
        for (group, id) in &c.groups {
            let Some(r) = self.queues.get(id).and_then(|q| q.replica.as_ref()) else {
                continue;
            };
            let Some(leader) = r.leader else { continue };
            if let Some(count) = led.get_mut(&leader) {
                *count += 1;
            }
            if leader == me {
                let voters = super::queue_members::voters_in(r.voters.as_deref(), &nodes);
                mine.push((*group, voters));
            }
        }
        // Above the even share rounded down, and only to a node at least two below: the
        // rounding's leftover stays where it is rather than going round.
        let total: usize = led.values().sum();
        let share = total / eligible.len();
        mine.sort_unstable();
        let mut transfers = Vec::new();
        while led.get(&me).copied().unwrap_or(0) > share {
            let Some((group, voters)) = mine.pop() else {
                break;
            };
            // Only a voter can lead (a learner never stands): a queue with voters of its own
            // goes to the least led of them, or stays.
            let Some((&to, _)) = led
                .iter()
                .filter(|(n, _)| **n != me && voters.contains(n))
                .min_by_key(|(n, count)| (**count, **n))
            else {
                continue;
            };
            if led.get(&to).copied().unwrap_or(0) + 1 >= led.get(&me).copied().unwrap_or(0) {
                continue;
            }
            *led.entry(to).or_default() += 1;
            *led.entry(me).or_default() -= 1;
            transfers.push(super::metadata_group::GroupChange::Transfer { group, to });
        }
        tracing::info!(
            queues = transfers.len(),
            share,
            "rebalance: handing leaderships over"
        );
        if let Some(c) = self.cluster.as_mut() {
            c.meta.group_changes.extend(transfers);
        }
    }

    /// The replicated queues whose Raft leader is this node, as its Raft last said (whether
    /// or not the queue acts here yet).
    pub fn queues_led_here(&self) -> usize {
        let Some(c) = self.cluster.as_ref() else {
            return 0;
        };
        c.groups
            .values()
            .filter_map(|id| self.queues.get(id)?.replica.as_ref())
            .filter(|r| r.leader == Some(c.node))
            .count()
    }

    /// Whether the replicated queue `name` of `vhost` acts on another node than this one:
    /// `Some(leader)` (`None` while it has none), or `None` for a queue that acts here, a
    /// local queue, or no queue. The management API sends its leader-only calls there.
    pub fn led_elsewhere(&self, vhost: &str, name: &str) -> Option<Option<NodeId>> {
        let r = self.queue_by_name(vhost, name).ok()?.replica.as_ref()?;
        (!r.is_leading()).then_some(r.leader)
    }

    /// A peer's Raft said it went into maintenance mode, or came out of it.
    pub fn set_peer_draining(&mut self, node: NodeId, on: bool) {
        let Some(c) = self.cluster.as_mut() else {
            return;
        };
        if on {
            c.draining_peers.insert(node);
        } else {
            c.draining_peers.remove(&node);
            // Back from maintenance mode: a queue short of its size may grow onto it.
            self.reconcile_soon();
        }
    }

    /// Whether a node of the cluster (this one included) is in maintenance mode.
    pub fn node_draining(&self, node: NodeId) -> bool {
        match self.cluster.as_ref() {
            Some(c) if c.node == node => self.draining,
            Some(c) => c.draining_peers.contains(&node),
            None => self.draining,
        }
    }

    /// The other nodes of the cluster, each with whether it runs as far as this node knows (its
    /// Raft heard from it lately and its connection is open). Empty outside a cluster.
    pub fn peers_running(&self) -> Vec<(NodeId, bool)> {
        let Some(c) = self.cluster.as_ref() else {
            return Vec::new();
        };
        c.nodes
            .iter()
            .filter(|n| **n != c.node)
            .map(|n| (*n, !c.down_since.contains_key(n)))
            .collect()
    }

    /// What would lose its majority if this node stopped now (RabbitMQ's
    /// `list_with_minimum_quorum`): the replicated queues this node votes in, and the metadata
    /// group (every node votes in it), whose voters running (this node and the peers not seen
    /// down: as the driver's Raft, which takes a peer for up until it misses its heartbeats or
    /// its connection closes) are no more than a majority. The queues as (vhost, name), in
    /// order, and whether the metadata group would; `None` outside a cluster (or in a cluster
    /// of one).
    pub fn quorum_critical(&self) -> Option<(Vec<(String, ShortStr)>, bool)> {
        let c = self.cluster.as_ref()?;
        if c.nodes.len() <= 1 {
            return None;
        }
        // As RabbitMQ counts: with this node stopped, fewer than a majority of the group's
        // voters would run. A queue this node holds as a learner does not count.
        let critical = |voters: &[NodeId]| {
            let running = voters.iter().filter(|n| c.is_running(**n)).count();
            voters.contains(&c.node) && running.saturating_sub(1) < voters.len() / 2 + 1
        };
        let mut queues: Vec<(String, ShortStr)> = c
            .groups
            .values()
            .filter_map(|id| self.queues.get(id))
            .filter(|q| {
                q.replica.as_ref().is_some_and(|r| {
                    critical(&super::queue_members::voters_in(
                        r.voters.as_deref(),
                        &c.nodes,
                    ))
                })
            })
            .map(|q| (q.vhost.clone(), q.name.clone()))
            .collect();
        queues.sort();
        Some((queues, critical(&c.nodes)))
    }

    /// Brings the peers down long enough `Down` in the queues this node leads and acts on.
    fn down_lost_peers(&mut self) {
        let now = self.now_ms;
        let Some(c) = self.cluster.as_mut() else {
            return;
        };
        let due: Vec<NodeId> = c
            .down_since
            .iter()
            .filter(|(n, at)| !c.downed.contains(n) && now.saturating_sub(**at) >= NODE_DOWN_MS)
            .map(|(n, _)| *n)
            .collect();
        if due.is_empty() {
            return;
        }
        c.downed.extend(due.iter().copied());
        for node in due {
            self.down_in_queues_led_here(node);
        }
    }

    /// `Down` of `node` in every queue this node leads and acts on: its consumers go, and
    /// what they held is delivered again (a peer down for good, or one the cluster forgot).
    pub(super) fn down_in_queues_led_here(&mut self, node: NodeId) {
        let Some(c) = self.cluster.as_ref() else {
            return;
        };
        let mut led: Vec<QueueId> = c.groups.values().copied().collect();
        led.retain(|id| self.acts_here(*id));
        led.sort_unstable();
        tracing::warn!(
            node,
            queues = led.len(),
            "peer node down for good: its consumers go, what they held is delivered again"
        );
        for id in &led {
            let down = Command::Down {
                node: u16::try_from(node).unwrap_or(u16::MAX),
            };
            if self.run(*id, down).is_some() {
                self.finish_effects(*id);
            }
        }
    }

    /// This node's number in its cluster, if it is in one.
    pub fn cluster_node(&self) -> Option<NodeId> {
        self.cluster.as_ref().map(|c| c.node)
    }

    /// The Raft group of a replicated queue.
    /// The state a replicated queue's log has brought it to: the leader's committed machine,
    /// else the queue's own (tests and diagnostics).
    pub fn committed_machine(&self, queue: QueueId) -> Option<&QueueMachine<Message>> {
        let q = self.queues.get(&queue)?;
        match q.replica.as_ref().map(|r| &r.mode) {
            Some(Mode::Leading { committed }) => Some(committed),
            _ => Some(&q.machine),
        }
    }

    pub fn replica_group(&self, queue: QueueId) -> Option<u64> {
        Some(self.queues.get(&queue)?.replica.as_ref()?.group)
    }

    /// The latest Raft term this node saw for replicated queue `queue`'s group.
    pub fn replica_term(&self, queue: QueueId) -> Option<u64> {
        Some(self.queues.get(&queue)?.replica.as_ref()?.term)
    }

    /// The groups of every replicated queue, with whether this node leads it.
    pub fn replica_groups(&self) -> Vec<(u64, QueueId)> {
        let Some(c) = self.cluster.as_ref() else {
            return Vec::new();
        };
        let mut out: Vec<(u64, QueueId)> = c.groups.iter().map(|(g, q)| (*g, *q)).collect();
        out.sort_unstable();
        out
    }

    /// Gives a new queue its group, if it is replicated here; the node chosen to stand for its
    /// first leader. Declared by a client here, that is this node (`client-local`, RabbitMQ's
    /// default), or with `x-queue-leader-locator` `balanced` the running node that leads the
    /// fewest queues; declared from the metadata group, the node its entry names; from the
    /// store (a restart), none: the group waits to hear from its leader.
    pub(super) fn attach_replica(&mut self, q: &mut Queue) -> Option<NodeId> {
        let placed = self.group_hint.take();
        let voters = self.voters_hint.take();
        if self.cluster.is_none() || q.args.queue_type != QueueType::Quorum {
            return None;
        }
        let chosen = if self.restoring {
            self.leader_hint.take()
        } else {
            self.first_leader(q.args.balanced_leader)
        };
        let c = self.cluster.as_mut()?;
        let group = placed.unwrap_or_else(|| group_of(&q.vhost, &q.name));
        c.groups.insert(group, q.id);
        let mut r = ReplicaState::new(group);
        r.chosen = chosen;
        r.voters.clone_from(&voters);
        q.replica = Some(Box::new(r));
        if voters.is_some() {
            // Before the group is made: every node makes it with them.
            c.meta
                .group_changes
                .push(super::metadata_group::GroupChange::Voters { group, voters });
        }
        let change = if c.meta.members.is_none() {
            // Every node of the list, as the group's other members made it.
            super::metadata_group::GroupChange::Add {
                group,
                campaign: chosen == Some(c.node),
                voters: None,
            }
        } else if c.meta.from_snapshot {
            // Which nodes the group started with, a metadata snapshot cannot tell (the
            // cluster's nodes may have changed since): its leader's snapshot will.
            super::metadata_group::GroupChange::Join { group }
        } else {
            // Made by the log's entry, here as on every node: with the cluster's nodes at it.
            super::metadata_group::GroupChange::Add {
                group,
                campaign: chosen == Some(c.node),
                voters: Some(c.nodes.clone()),
            }
        };
        c.meta.group_changes.push(change);
        chosen
    }

    /// A replicated queue's voters of its own changed (`None`: every node votes): kept with
    /// its definition, and told to Raft.
    pub(super) fn set_replica_voters(&mut self, id: QueueId, voters: Option<Vec<NodeId>>) {
        let Some(q) = self.queues.get_mut(&id) else {
            return;
        };
        let Some(r) = q.replica.as_mut() else {
            return;
        };
        if r.voters == voters {
            return;
        }
        r.voters.clone_from(&voters);
        let group = r.group;
        tracing::info!(queue = %q.name, vhost = %q.vhost, ?voters, "quorum queue voters");
        if let (Some(key), Some(p)) = (q.store_key, self.persist.as_mut()) {
            p.push(
                crate::persist::StoreOp::PutQueue(crate::persist::QueueDef {
                    vhost: q.vhost.clone(),
                    name: q.name.clone(),
                    key,
                    auto_delete: q.auto_delete,
                    arguments: q.arguments.detached(),
                    group: stored_group(q),
                    voters: voters.clone(),
                }),
                true,
            );
        }
        if let Some(c) = self.cluster.as_mut() {
            c.meta
                .group_changes
                .push(super::metadata_group::GroupChange::Voters { group, voters });
        }
    }

    /// A replicated queue's voters of its own (`None`: every node of the cluster votes).
    pub fn replica_voters(&self, id: QueueId) -> Option<&[NodeId]> {
        self.queues.get(&id)?.replica.as_ref()?.voters.as_deref()
    }

    /// The node to stand for a new queue's first leader when a client declares it here:
    /// this one (`client-local`), or with `balanced` (or while this node is drained: a node
    /// in maintenance mode places no leader on itself, as RabbitMQ's drain) the running node
    /// that leads the fewest.
    pub(super) fn first_leader(&self, balanced: bool) -> Option<NodeId> {
        if balanced || self.draining {
            self.least_leading_node()
        } else {
            self.cluster_node()
        }
    }

    /// The running node (this one, or a peer not seen down) that leads the fewest replicated
    /// queues as this node knows their leaders; this node among equals, then the lowest.
    fn least_leading_node(&self) -> Option<NodeId> {
        let c = self.cluster.as_ref()?;
        let mut led: BTreeMap<NodeId, usize> = c
            .nodes
            .iter()
            .filter(|n| **n == c.node || !c.down_since.contains_key(n))
            .filter(|n| {
                if **n == c.node {
                    !self.draining
                } else {
                    !c.draining_peers.contains(n)
                }
            })
            .map(|n| (*n, 0))
            .collect();
        for id in c.groups.values() {
            let leader = self
                .queues
                .get(id)
                .and_then(|q| q.replica.as_ref())
                .and_then(|r| r.leader.or(r.chosen));
            if let Some(count) = leader.and_then(|l| led.get_mut(&l)) {
                *count += 1;
            }
        }
        let fewest = led.values().copied().min()?;
        if led.get(&c.node) == Some(&fewest) {
            return Some(c.node);
        }
        led.into_iter()
            .find(|(_, n)| *n == fewest)
            .map(|(node, _)| node)
    }

    /// A replicated queue left this node's broker: its group goes too, and every node is
    /// told unless the metadata group told this one.
    pub(super) fn detach_replica(&mut self, q: &Queue) {
        if let (Some(c), Some(r)) = (self.cluster.as_mut(), q.replica.as_ref()) {
            c.groups.remove(&r.group);
            c.meta
                .group_changes
                .push(super::metadata_group::GroupChange::Remove { group: r.group });
            // What it had for its group's leader goes nowhere (a queue declared again with its
            // name gets a new group of the same number).
            c.outbox.retain(|p| p.group != r.group);
            // Its group is gone: what this node still waits for there will never be applied,
            // and must not hold back the confirms of every later batch.
            let mut outcomes = Vec::new();
            c.abandon(r.group, &mut outcomes);
            // Its consumers' commands have nothing left to act on (and must not reach a queue
            // made again in a group of the same number).
            c.kept.remove(&r.group);
            c.early.remove(&r.group);
            c.deferred.remove(&r.group);
            // This node's consumers whose consume is not in the machine yet (forwarded to the
            // leader, or held until this node acts) are not among those the deletion cancels:
            // they are told here.
            c.cancel_unlogged(q.id, &q.machine);
            // A queue made again in a group of the same number knows no enqueuer of ours.
            c.enqueuers.remove(&r.group);
            for o in outcomes {
                c.settle(o);
            }
            if !self.restoring {
                self.announce_delete(&q.vhost, &q.name, r.group);
            }
        }
    }

    /// A quorum queue whose messages are in this node's store was declared before the node
    /// joined a cluster: it keeps working as it did, on this node only (a replicated queue
    /// keeps its messages in its group's log, never in the store). Moving it onto the
    /// cluster is a `warren move` to a new quorum queue.
    pub(super) fn keep_local(&mut self, id: QueueId) {
        let Some(q) = self.queues.get_mut(&id) else {
            return;
        };
        let Some(r) = q.replica.take() else {
            return;
        };
        tracing::warn!(queue = %q.name, vhost = %q.vhost, "quorum queue from before this node joined the cluster: it stays on this node, not replicated");
        if let Some(c) = self.cluster.as_mut() {
            c.groups.remove(&r.group);
            c.meta
                .group_changes
                .push(super::metadata_group::GroupChange::Remove { group: r.group });
        }
    }

    /// The entries proposed since the last call, in order, for the groups' leaders (this node:
    /// a driver proposes only where it leads).
    pub fn take_proposals(&mut self, out: &mut Vec<Proposal>) {
        if let Some(c) = self.cluster.as_mut() {
            c.report_meta_applied();
            out.append(&mut c.outbox);
        }
    }

    /// Proposes `command` to the group of a replicated queue this node leads, as the broker
    /// applies it. Node-local commands (paging) are this node's alone.
    pub(super) fn propose(&mut self, id: QueueId, command: &Command<Message>) {
        if command.is_node_local() {
            return;
        }
        let now = self.now_ms;
        let (Some(c), Some(q)) = (self.cluster.as_mut(), self.queues.get_mut(&id)) else {
            return;
        };
        let Some(r) = q.replica.as_mut() else {
            return;
        };
        if let Some(origin) = c.forwarding {
            // Another node's publish: its confirm waits there, for this entry's commit.
            match encode(now, origin, command) {
                Ok(data) => {
                    r.forwarded_ahead += 1;
                    c.outbox.push(Proposal {
                        group: r.group,
                        data,
                        to: None,
                    });
                }
                Err(error) => {
                    tracing::error!(queue = id.0, %error, "forwarded command not replicated")
                }
            }
            return;
        }
        // A forward proposed by this node now that it leads is its own proposal from here on.
        let reissued = c.reissue.take().map(|t| Token {
            forwarded: false,
            ..t
        });
        let publish = is_enqueue(command);
        let release = c.release_tag.filter(|_| publish);
        // Only a publish's confirm waits for its entry. A consumer's command (a consume, an
        // ack, a `Down`) holds no store batch back: waited on, one in a group that cannot
        // commit held every later confirm of this node, for every queue, until the timeout
        // nacked them.
        let token = reissued.unwrap_or_else(|| {
            if publish {
                c.publish_token(open_batch(self.persist.as_mut()), false, release)
            } else {
                Token {
                    batch: 0,
                    // Waited on only by a caller that asked for it (`open_hold_every`).
                    hold: c.holds.every(),
                    forwarded: false,
                    release,
                }
            }
        });
        let origin = c.proposals.next(GroupId(r.group), token);
        match encode(now, origin, command) {
            Ok(data) => {
                r.proposed = origin.seq;
                if reissued.is_none() && (publish || token.hold != 0) {
                    c.wait_on(&token, now);
                }
                c.outbox.push(Proposal {
                    group: r.group,
                    data,
                    to: None,
                });
            }
            Err(error) => {
                // Every command a queue applies is logical here; one that is not cannot
                // reach the log, and the state would part from the followers'.
                tracing::error!(queue = id.0, %error, "command not replicated");
                c.proposals.withdraw(GroupId(r.group), origin);
                c.lose(&token);
            }
        }
    }

    /// A client's command on a replicated queue led by another node goes to that leader: a
    /// publish (its confirm waits until this node applies the entry: every member applies every
    /// entry), or what a consumer on this node does (consume, cancel, ack, reject, credit,
    /// visibility). With no leader known it waits for one (at most `FORWARD_TIMEOUT_MS`). The
    /// reply is the one the leader gives unless the log says otherwise (a consumer refused
    /// there is cancelled here when its entry is applied). On a node just elected that does not
    /// act yet, a publish waits until it does (`hold_until_acting`), and what a consumer does
    /// (consume, ack, reject, credit, cancel) runs once it does (`deferred`): a consume is
    /// answered at once, and its consumer is told with basic.cancel if it never runs (the node
    /// is deposed first) or the queue refuses it then. `None` for any other command.
    pub(super) fn forward(&mut self, id: QueueId, command: &Command<Message>) -> Option<Reply> {
        let (reply, confirm) = match command {
            Command::Enqueue { .. } | Command::EnqueueFrom { .. } => {
                (Reply::Enqueued { msg_id: 0 }, true)
            }
            Command::EnqueueWith { .. } => (Reply::Ok, true),
            Command::Cancel { .. } => (Reply::Cancelled { consumers_left: 1 }, false),
            Command::Consume { .. }
            | Command::Credit { .. }
            | Command::Settle { .. }
            | Command::Return { .. }
            | Command::Release { .. }
            | Command::Discard { .. }
            | Command::Extend { .. } => (Reply::Ok, false),
            _ => return None,
        };
        if confirm && self.behind_own_proposals(id) {
            // Whoever leads now (this node again, too), it goes after those held already.
            self.down_self_once(id);
            return self.hold_behind(id, command).then_some(reply);
        }
        let c = self.cluster.as_mut()?;
        let r = self.queues.get(&id)?.replica.as_ref()?;
        if r.leader == Some(c.node) {
            if confirm {
                // Proposed once this node acts, as what it forwarded before its election.
                return self.hold_until_acting(id, command).then_some(reply);
            }
            // Elected, not acting yet: its first entries are not applied.
            c.deferred.entry(r.group).or_default().push(command.clone());
            return Some(reply);
        }
        self.down_self_once(id);
        let command = self.as_enqueuer(id, command);
        self.forward_one(id, &command, confirm).then_some(reply)
    }

    /// Must a publish to `id` wait ([`Cluster::behind`])? While this node's proposals as the
    /// queue's leader are undecided, or publishes wait behind them already.
    fn behind_own_proposals(&self, id: QueueId) -> bool {
        let Some(c) = self.cluster.as_ref() else {
            return false;
        };
        if c.behind.is_empty() && c.led_pending.is_empty() {
            return false;
        }
        let Some(group) = self.replica_group(id) else {
            return false;
        };
        c.behind.contains_key(&group) || c.led_pending.contains_key(&group)
    }

    /// Holds a publish back behind this node's undecided proposals as leader, its confirm
    /// waiting in the store batch being filled, as a forward's does.
    fn hold_behind(&mut self, id: QueueId, command: &Command<Message>) -> bool {
        let now = self.now_ms;
        let Some(group) = self.replica_group(id) else {
            return false;
        };
        let Some(token) = self.waiting_publish(command) else {
            return false;
        };
        let Some(c) = self.cluster.as_mut() else {
            return false;
        };
        c.behind.entry(group).or_default().push_back(Behind {
            id,
            command: command.clone(),
            token,
            at: now,
        });
        true
    }

    /// Sends on the publishes held back ([`Cluster::behind`]) of each group none of whose
    /// proposals this node made as leader still waits: to whoever leads now, in order.
    fn send_behind(&mut self) {
        let Some(c) = self.cluster.as_mut() else {
            return;
        };
        if c.led_pending.is_empty() && c.behind.is_empty() {
            return;
        }
        let proposals = &c.proposals;
        c.led_pending.retain(|g, last| {
            proposals.any_waiting(GroupId(*g), |seq, t| seq <= *last && own_as_leader(t))
        });
        // A queue acting here again has applied an entry of its new term: what it proposed
        // in an earlier one is decided, whatever its proposals still say.
        let acting: Vec<u64> = c
            .led_pending
            .keys()
            .copied()
            .filter(|g| {
                c.groups.get(g).is_some_and(|id| {
                    self.queues
                        .get(id)
                        .is_some_and(|q| q.replica.as_ref().is_some_and(|r| r.is_leading()))
                })
            })
            .collect();
        for g in acting {
            c.led_pending.remove(&g);
        }
        let ready: Vec<u64> = c
            .behind
            .keys()
            .copied()
            .filter(|g| !c.led_pending.contains_key(g))
            .collect();
        for group in ready {
            let Some(held) = self.cluster.as_mut().and_then(|c| c.behind.remove(&group)) else {
                continue;
            };
            for b in held {
                self.send_held(b);
            }
        }
    }

    /// One publish held back, on its way now: proposed here if this node leads the queue
    /// again, kept for when it acts if it is elected and not acting yet, else forwarded.
    fn send_held(&mut self, b: Behind) {
        let Behind {
            id, command, token, ..
        } = b;
        let leads_here = self
            .queues
            .get(&id)
            .and_then(|q| q.replica.as_ref())
            .zip(self.cluster.as_ref())
            .is_some_and(|(r, c)| r.leader == Some(c.node));
        if self.acts_here(id) && leads_here {
            if let Some(c) = self.cluster.as_mut() {
                c.reissue = Some(token);
            }
            let reply = self.run(id, command);
            if let Some(c) = self.cluster.as_mut() {
                if let Some(token) = c.reissue.take() {
                    c.settle(Outcome::Lost(token));
                } else if matches!(reply, Some(Reply::Refused(_))) {
                    // Refused by a full queue as it was applied ahead: a nack, as
                    // `reissue_forwards` makes it (the entry's token is this node's own now).
                    c.lose(&token);
                }
            }
            if reply.is_some() {
                self.finish_effects(id);
            }
        } else if leads_here {
            if !self.keep_until_acting(id, &command, token) {
                if let Some(c) = self.cluster.as_mut() {
                    c.settle(Outcome::Lost(token));
                }
            }
        } else {
            let command = self.as_enqueuer(id, &command).into_owned();
            self.forward_keeping(id, &command, true, Some(token));
        }
    }

    /// A publish forwarded to a queue's leader goes as `EnqueueFrom`, with this node as its
    /// enqueuer and the next of its sequence for the group, so that however often it is sent
    /// again (to each new leader, after a snapshot) the queue takes it once. The sequence has
    /// no gaps: the machine refuses one that skips a number (`Refusal::OutOfOrder`: the one
    /// skipped was lost on its way) and decides nothing for it, so "at or below the last one
    /// decided" always means "in the queue already, or refused". A refusal of that kind
    /// starts a new enqueuer, which the queue takes in place of the old one. Ids never
    /// repeat, across starts too (`enqueuer_base`), so the queue keeps a node's enqueuer
    /// through a `Down` of the node. Until every node can (`ENQUEUERS_LEVEL`), a plain
    /// `Enqueue` as before.
    fn as_enqueuer<'a>(
        &mut self,
        id: QueueId,
        command: &'a Command<Message>,
    ) -> std::borrow::Cow<'a, Command<Message>> {
        use std::borrow::Cow;
        let (message, meta, with) = match command {
            Command::Enqueue { message, meta } => (message, meta, None),
            Command::EnqueueWith {
                delay_ms,
                from: None,
                dedup,
                message,
                meta,
            } => (message, meta, Some((*delay_ms, dedup.clone()))),
            _ => return Cow::Borrowed(command),
        };
        let level = self.cluster_feature_level().unwrap_or(0);
        if level < super::metadata_group::ENQUEUERS_LEVEL {
            return Cow::Borrowed(command);
        }
        let group = self.replica_group(id);
        let (Some(c), Some(group)) = (self.cluster.as_mut(), group) else {
            return Cow::Borrowed(command);
        };
        let node = u16::try_from(c.node).unwrap_or(u16::MAX);
        let (enqueuer, seq) = match c.enqueuers.get_mut(&group) {
            Some((enqueuer, seq)) => {
                *seq += 1;
                (*enqueuer, *seq)
            }
            None => {
                // A number of its own, even for a group of a number seen before (a queue
                // deleted and made again), whose log may remember an old one.
                let local = c.enqueuer_base.saturating_add(c.enqueuers_minted);
                let Some(qualified) = warren_queue::qualify(node, local) else {
                    return Cow::Borrowed(command);
                };
                c.enqueuers_minted += 1;
                let enqueuer = EnqueuerId(qualified);
                c.enqueuers.insert(group, (enqueuer, 1));
                (enqueuer, 1)
            }
        };
        Cow::Owned(match with {
            None => Command::EnqueueFrom {
                enqueuer,
                seq,
                message: message.clone(),
                meta: *meta,
            },
            Some((delay_ms, dedup)) => Command::EnqueueWith {
                delay_ms,
                from: Some((enqueuer, seq)),
                dedup,
                message: message.clone(),
                meta: *meta,
            },
        })
    }

    /// A publish on a node just elected for the queue, before it acts (its term's first entries
    /// are not applied yet): kept, its confirm waiting, as the publishes it forwarded before its
    /// election are, and proposed once it acts (`reissue_kept`), or sent to the node that leads
    /// if this one does not get to act. A leadership handed over (a rebalance, a node stopping)
    /// made its new leader nack what its clients published in those first moments. False if it
    /// cannot be encoded (the publisher is nacked).
    fn hold_until_acting(&mut self, id: QueueId, command: &Command<Message>) -> bool {
        let Some(token) = self.waiting_publish(command) else {
            return false;
        };
        let kept = self.keep_until_acting(id, command, token);
        if !kept {
            if let Some(c) = self.cluster.as_mut() {
                c.settle(Outcome::Lost(token));
            }
        }
        kept
    }

    /// The token of a publish this node holds for later (its confirm waiting in the store batch
    /// being filled, as a forward's does), registered as waiting.
    fn waiting_publish(&mut self, command: &Command<Message>) -> Option<Token> {
        let now = self.now_ms;
        let batch = open_batch(self.persist.as_mut());
        let c = self.cluster.as_mut()?;
        let token = c.publish_token(batch, true, c.release_tag.filter(|_| is_enqueue(command)));
        c.wait_on(&token, now);
        Some(token)
    }

    /// [`Broker::hold_until_acting`] for a publish whose confirm waits with `token` already.
    fn keep_until_acting(&mut self, id: QueueId, command: &Command<Message>, token: Token) -> bool {
        // Kept, it may be sent on to another leader, and again after a snapshot: with an
        // enqueuer identity the queue takes it once however often it comes.
        let command = self.as_enqueuer(id, command).into_owned();
        let command = &command;
        let now = self.now_ms;
        let (Some(c), Some(q)) = (self.cluster.as_mut(), self.queues.get(&id)) else {
            return false;
        };
        let Some(group) = q.replica.as_ref().map(|r| r.group) else {
            return false;
        };
        let origin = c.proposals.next(GroupId(group), token);
        // Out of the proposals at once, as at an election: its own entry answers it.
        let token = c.proposals.withdraw(GroupId(group), origin);
        let data = match encode(now, origin, command) {
            Ok(data) => data,
            Err(error) => {
                tracing::error!(queue = id.0, %error, command = command.name(), "command not kept");
                return false;
            }
        };
        c.kept.entry(group).or_default().push_back(Kept {
            seq: origin.seq,
            data,
            token,
            first: now,
            at: now,
            sent_before: c.proposals.upcoming(),
            confirm: true,
            credit: None,
            down: false,
            held: false,
        });
        true
    }

    /// What this node's channels held before it started is gone: the first thing it sends a
    /// group's leader after a start is a `Down` of itself, so that it comes before anything
    /// new of this node in the log (its ids start over with each start).
    pub(super) fn down_self_once(&mut self, id: QueueId) {
        let Some(node) = self.cluster.as_ref().map(|c| c.node) else {
            return;
        };
        let Some(r) = self.queues.get_mut(&id).and_then(|q| q.replica.as_mut()) else {
            return;
        };
        if std::mem::replace(&mut r.downed_self, true) {
            return;
        }
        let down = Command::Down {
            node: u16::try_from(node).unwrap_or(u16::MAX),
        };
        self.forward_one(id, &down, false);
    }

    /// Sends one command to the queue's leader and keeps it until it is applied here (sent
    /// again to each new leader). A `confirm` waits in the store batch being filled.
    fn forward_one(&mut self, id: QueueId, command: &Command<Message>, confirm: bool) -> bool {
        self.forward_keeping(id, command, confirm, None)
    }

    /// [`Broker::forward_one`], for a publish whose confirm already waits with `waiting`
    /// (one this node proposed as leader that Raft handed back).
    fn forward_keeping(
        &mut self,
        id: QueueId,
        command: &Command<Message>,
        confirm: bool,
        waiting: Option<Token>,
    ) -> bool {
        let now = self.now_ms;
        let batch = match waiting {
            Some(t) => t.batch,
            None if confirm => open_batch(self.persist.as_mut()),
            None => 0,
        };
        let (Some(c), Some(q)) = (self.cluster.as_mut(), self.queues.get(&id)) else {
            if let (Some(c), Some(t)) = (self.cluster.as_mut(), waiting) {
                c.settle(Outcome::Lost(t));
            }
            return false;
        };
        let Some(r) = q.replica.as_ref() else {
            if let Some(t) = waiting {
                c.settle(Outcome::Lost(t));
            }
            return false;
        };
        let leader = r.leader;
        let token = match waiting {
            Some(t) => Token {
                forwarded: true,
                ..t
            },
            None if confirm => {
                c.publish_token(batch, true, c.release_tag.filter(|_| is_enqueue(command)))
            }
            None => Token {
                batch,
                hold: 0,
                forwarded: true,
                release: None,
            },
        };
        let origin = c.proposals.next(GroupId(r.group), token);
        match encode(now, origin, command) {
            Ok(data) => {
                if confirm && waiting.is_none() {
                    c.wait_on(&token, now);
                }
                let cl = &mut **c;
                let kept = cl.kept.entry(r.group).or_default();
                // Behind a `Down` of this node not applied yet, a consumer's command waits for
                // it: sent now, it could reach the log first (a `Down` lost on its way is sent
                // again), and the `Down` would then undo it (a consume cut off at once).
                let held = !confirm && kept.iter().any(|k| k.down);
                if let Some(leader) = leader.filter(|_| !held) {
                    cl.outbox.push(Proposal {
                        group: r.group,
                        data: data.clone(),
                        to: Some(leader),
                    });
                }
                if !confirm {
                    // Sent again out of order (overtaken, or after a snapshot), an earlier
                    // command this one supersedes would undo it: a channel's older credit (a
                    // credit sets, it does not add), or anything of this node's consumers
                    // before a `Down` of itself (which ends them all).
                    match command {
                        Command::Down { .. } => kept.retain(|k| k.confirm),
                        Command::Credit { group, .. } => {
                            kept.retain(|k| k.confirm || k.credit != Some(*group));
                        }
                        _ => {}
                    }
                }
                kept.push_back(Kept {
                    seq: origin.seq,
                    data,
                    token: None,
                    first: now,
                    at: now,
                    sent_before: cl.proposals.upcoming(),
                    confirm,
                    credit: match command {
                        Command::Credit { group, .. } => Some(*group),
                        _ => None,
                    },
                    down: matches!(command, Command::Down { .. }),
                    held,
                });
                true
            }
            Err(error) => {
                tracing::error!(queue = id.0, %error, command = command.name(), "command not forwarded");
                let token = c.proposals.withdraw(GroupId(r.group), origin);
                if let (Some(token), Some(_)) = (token, waiting) {
                    c.settle(Outcome::Lost(token));
                }
                false
            }
        }
    }

    /// Sends one command to `leader` and keeps nothing: what waits for its entry gives up on
    /// its own (a forwarded get). Its group and proposal number.
    pub(super) fn forward_once(
        &mut self,
        id: QueueId,
        leader: NodeId,
        command: &Command<Message>,
    ) -> Option<(u64, u64)> {
        self.down_self_once(id);
        let now = self.now_ms;
        let c = self.cluster.as_mut()?;
        let group = self.queues.get(&id)?.replica.as_ref()?.group;
        let token = Token {
            batch: 0,
            hold: 0,
            forwarded: true,
            release: None,
        };
        let origin = c.proposals.next(GroupId(group), token);
        match encode(now, origin, command) {
            Ok(data) => {
                c.outbox.push(Proposal {
                    group,
                    data,
                    to: Some(leader),
                });
                Some((group, origin.seq))
            }
            Err(error) => {
                tracing::error!(queue = id.0, %error, command = command.name(), "command not forwarded");
                c.proposals.withdraw(GroupId(group), origin);
                None
            }
        }
    }

    /// A publish another node forwarded to a queue this node leads: applied ahead and proposed
    /// as this node's own commands are, with the sender's origin, so that the sender finds its
    /// answer when it applies the entry. Not leading (any more), it is dropped: the sender
    /// nacks it when the term changes or its wait runs out.
    pub fn forwarded(&mut self, group: u64, data: &[u8]) {
        if group == super::metadata_group::META_GROUP {
            self.forwarded_meta(data);
            return;
        }
        let Some(&id) = self.cluster.as_ref().and_then(|c| c.groups.get(&group)) else {
            return;
        };
        let (head, mut command) = match decode(bytes::Bytes::copy_from_slice(data)) {
            Ok(x) => x,
            Err(error) => {
                tracing::warn!(group, %error, "unreadable forwarded publish dropped");
                return;
            }
        };
        on_clock_of_leader(&mut command, head.now_ms, self.now_ms);
        let accepted = match &command {
            Command::Enqueue { .. }
            | Command::EnqueueFrom { .. }
            | Command::EnqueueWith { .. }
            | Command::Consume { .. }
            | Command::Cancel { .. }
            | Command::Credit { .. }
            | Command::Settle { .. }
            | Command::Return { .. }
            | Command::Release { .. }
            | Command::Discard { .. }
            | Command::Extend { .. } => true,
            // A node may bring only itself down this way, and get only for itself.
            Command::Down { node } | Command::GetBy { node, .. } => {
                u64::from(*node) == head.origin.node
            }
            _ => false,
        };
        if !accepted {
            tracing::warn!(group, command = command.name(), "forwarded command refused");
            return;
        }
        let cancel = matches!(command, Command::Cancel { .. });
        let get = matches!(command, Command::GetBy { .. });
        let starting = self
            .queues
            .get(&id)
            .and_then(|q| q.replica.as_ref())
            .is_some_and(|r| matches!(r.mode, Mode::Starting { .. }));
        if starting {
            // Elected, not acting yet: taken once its term's first entries are applied.
            if let Some(c) = self.cluster.as_mut() {
                c.early.entry(group).or_default().push(data.to_vec());
            }
            return;
        }
        if !self.acts_here(id) {
            return;
        }
        if let Some(c) = self.cluster.as_mut() {
            c.forwarding = Some(head.origin);
        }
        let reply = self.run(id, command);
        if let Some(c) = self.cluster.as_mut() {
            c.forwarding = None;
        }
        if get {
            // The asking node hands the message out when it applies the entry.
            self.effects.retain(|e| !matches!(e, Effect::Deliver(_)));
        }
        if reply.is_some() {
            // What the enqueue made the queue drop (drop-head) is dead-lettered here, what a
            // reject or a Down sends past its delivery limit too.
            self.finish_effects(id);
        }
        let last_gone = matches!(reply, Some(Reply::Cancelled { consumers_left: 0 }));
        let auto_delete = self
            .queues
            .get(&id)
            .is_some_and(|q| q.auto_delete && q.machine.has_had_consumers());
        if cancel && last_gone && auto_delete {
            // The last consumer, on another node, went: the queue goes, as on a classic one.
            self.remove_queue(id);
        }
    }

    /// Forwarded publishes waiting longer than their timeout are nacked; peers down long
    /// enough are brought `Down`.
    pub(super) fn expire_forwards(&mut self) {
        self.expire_forwards_here();
        // What it decided may let publishes held back behind this node's own proposals go.
        self.send_behind();
    }

    fn expire_forwards_here(&mut self) {
        self.reconcile_members();
        self.down_lost_peers();
        self.resend_meta();
        self.expire_gets();
        let now = self.now_ms;
        let Some(c) = self.cluster.as_mut() else {
            return;
        };
        // The oldest forward of each group waiting for its entry (a stream of later ones must
        // not make it look late, nor hide one that is).
        let late: Vec<u64> = c
            .kept
            .iter()
            .filter(|(_, k)| {
                k.iter()
                    .find(|f| f.confirm)
                    .is_some_and(|f| now.saturating_sub(f.first) >= FORWARD_TIMEOUT_MS)
            })
            .map(|(g, _)| *g)
            .collect();
        let mut outcomes = Vec::new();
        for g in late {
            tracing::warn!(group = g, "forwarded publishes not applied in time: nacked");
            c.abandon(g, &mut outcomes);
        }
        for o in outcomes {
            c.settle(o);
        }
        // Publishes held back behind this node's undecided proposals as leader (a deposed
        // leader cut off from its successor) are nacked as late forwards are, all of a group
        // at once (what comes after them waits behind them): none is kept for ever.
        let late: Vec<u64> = c
            .behind
            .iter()
            .filter(|(_, b)| {
                b.front()
                    .is_some_and(|f| now.saturating_sub(f.at) >= FORWARD_TIMEOUT_MS)
            })
            .map(|(g, _)| *g)
            .collect();
        for g in late {
            tracing::warn!(
                group = g,
                "publishes held behind a deposed leader's proposals: nacked"
            );
            for b in c.behind.remove(&g).into_iter().flatten() {
                c.settle(Outcome::Lost(b.token));
            }
        }
        // Consumers' commands still waiting go to the leader again.
        let due: Vec<(u64, Option<NodeId>)> = c
            .kept
            .iter()
            .filter(|(_, kept)| {
                kept.front()
                    .is_some_and(|f| now.saturating_sub(f.at) >= FORWARD_RESEND_MS)
            })
            .map(|(group, _)| {
                let leader = c
                    .groups
                    .get(group)
                    .and_then(|id| self.queues.get(id))
                    .and_then(|q| q.replica.as_ref())
                    .and_then(|r| r.leader)
                    .filter(|l| *l != c.node);
                (*group, leader)
            })
            .collect();
        for (group, leader) in due {
            // With no leader known they wait for one (a leader change sends them all).
            c.send_kept(group, leader, now, |k| !k.confirm);
            if let Some(f) = c.kept.get_mut(&group).and_then(|k| k.front_mut()) {
                f.at = now;
            }
        }
        while let Some((&batch, &since)) = c.waiting_since.first_key_value() {
            if now.saturating_sub(since) < CONFIRM_TIMEOUT_MS {
                break;
            }
            // Their entries may still commit (the publisher gets a duplicate if it resends).
            tracing::warn!(
                batch,
                "replicated entries not applied in time: their confirms are nacks"
            );
            c.waiting_since.remove(&batch);
            c.waiting.remove(&batch);
            c.lost_upto = c.lost_upto.max(batch);
        }
        let timed_out = c.holds.time_out(now, CONFIRM_TIMEOUT_MS);
        c.batches_after_holds();
        if timed_out > 0 {
            tracing::warn!(
                publishes = timed_out,
                "replicated entries not applied in time: their confirms are nacks"
            );
        }
    }

    /// When the forwarded publishes' wait runs out (for the driver's timer).
    pub(super) fn forward_deadline(&self) -> Option<u64> {
        let c = self.cluster.as_ref()?;
        let forwards = c
            .kept
            .values()
            .filter_map(|k| k.front())
            .map(|f| {
                let resend = f.at.saturating_add(FORWARD_RESEND_MS);
                if f.confirm {
                    resend.min(f.first.saturating_add(FORWARD_TIMEOUT_MS))
                } else {
                    resend
                }
            })
            .min();
        let confirms = c
            .waiting_since
            .values()
            .next()
            .map(|t| t.saturating_add(CONFIRM_TIMEOUT_MS))
            .into_iter()
            .chain(c.holds.deadline(CONFIRM_TIMEOUT_MS))
            .min();
        let downs = c
            .down_since
            .iter()
            .filter(|(n, _)| !c.downed.contains(n))
            .map(|(_, t)| t.saturating_add(NODE_DOWN_MS))
            .min();
        forwards
            .into_iter()
            .chain(confirms)
            .chain(downs)
            .chain(self.meta_deadline())
            .chain(self.get_deadline())
            .chain(self.reconcile_deadline())
            .min()
    }

    /// A leader that starts acting on a queue puts in its log what the queue's definitions
    /// (arguments and policies, the cluster's) ask of it, before anything else it proposes: a
    /// policy set while no member led, or learnt after the previous leader's death, reaches
    /// the machine, and so do logs written before Configure went through the log (each member
    /// applied its own then: a member replaying one has none).
    fn configure_for_term(&mut self, id: QueueId) {
        let Some(q) = self.queues.get(&id) else {
            return;
        };
        let rules = self.level_rules(q.replica.is_some());
        let want = super::held_dead_letters::queue_policy(&q.args, rules);
        self.run(id, Command::Configure(want));
        // A lower limit drops messages: their dead letters go out.
        self.finish_effects(id);
    }

    /// Every replicated queue this node leads, and acts for, proposes what its definitions ask
    /// again (the cluster can do more than when its term started).
    pub(super) fn configure_led_queues(&mut self) {
        let led: Vec<QueueId> = self
            .queues
            .iter()
            .filter(|(_, q)| q.replica.is_some())
            .map(|(id, _)| *id)
            .filter(|id| self.acts_here(*id))
            .collect();
        for id in led {
            self.configure_for_term(id);
        }
    }

    /// A command each member takes from its own definitions reaches the committed copy too.
    pub(super) fn configure_committed(&mut self, id: QueueId, command: &Command<Message>) {
        let Some(r) = self.queues.get_mut(&id).and_then(|q| q.replica.as_mut()) else {
            return;
        };
        if let Mode::Leading { committed } = &mut r.mode {
            let meta = Meta {
                index: committed.last_index(),
                now_ms: committed.now_ms(),
            };
            committed.apply(meta, command.clone(), &mut Vec::new());
        }
    }

    /// May a command from a client run on this queue here? Any queue that is not replicated;
    /// a replicated one only where its leader is, with its term started.
    pub fn acts_on(&self, id: QueueId) -> bool {
        self.acts_here(id)
    }

    pub(super) fn acts_here(&self, id: QueueId) -> bool {
        self.queues
            .get(&id)
            .is_none_or(|q| q.replica.as_ref().is_none_or(|r| r.is_leading()))
    }

    /// A delivery made ahead of the log waits for the entry that made it.
    pub(super) fn hold_deliveries(&mut self, id: QueueId, out: &mut Vec<Delivery>, from: usize) {
        let Some(r) = self.queues.get_mut(&id).and_then(|q| q.replica.as_mut()) else {
            return;
        };
        if r.caught_up() {
            return;
        }
        let seq = r.proposed;
        r.held.extend(out.drain(from..).map(|d| (seq, d)));
    }

    /// Deliveries whose entries are applied, into `out`.
    pub(super) fn take_released(&mut self, out: &mut Vec<Delivery>) {
        if let Some(c) = self.cluster.as_mut() {
            out.append(&mut c.released);
        }
    }

    pub(super) fn has_released(&self) -> bool {
        self.cluster
            .as_ref()
            .is_some_and(|c| !c.released.is_empty())
    }

    /// Applies committed entries of replicated queues' groups, in log order per group. A
    /// queue this node leads moves its committed copy; any other moves its machine. This
    /// node's own proposals are answered: their confirms and deliveries are released.
    pub fn apply_committed(&mut self, entries: &[Committed]) {
        self.apply_committed_here(entries);
        // What it decided may let publishes held back behind this node's own proposals go.
        self.send_behind();
    }

    fn apply_committed_here(&mut self, entries: &[Committed]) {
        let now_ms = self.now_ms;
        let Some(c) = self.cluster.as_mut() else {
            return;
        };
        let mut outcomes = Vec::new();
        let mut started = Vec::new();
        let mut meta = Vec::new();
        // Each queue an entry was applied to, and the bytes of its entries.
        let mut touched: Vec<(QueueId, usize)> = Vec::new();
        let mut ghosts: Vec<(QueueId, ConsumerId)> = Vec::new();
        let mut parts: Vec<bytes::Bytes> = Vec::new();
        let mut gets: Vec<super::remote_get::AppliedGet> = Vec::new();
        for e in entries {
            if e.group.0 == super::metadata_group::META_GROUP {
                meta.push(e);
                continue;
            }
            let Some(&id) = c.groups.get(&e.group.0) else {
                continue;
            };
            let Some(q) = self.queues.get_mut(&id) else {
                continue;
            };
            let Some(r) = q.replica.as_mut() else {
                continue;
            };
            if e.index <= r.applied_index {
                // Covered by the snapshot the machine was restored from.
                continue;
            }
            r.applied_index = e.index;
            r.applied_term = e.term;
            // Saturating: a snapshot asked for sets both to their largest value.
            r.since_snapshot = r.since_snapshot.saturating_add(1);
            r.since_snapshot_bytes = r.since_snapshot_bytes.saturating_add(e.data.len() as u64);
            match touched.last_mut() {
                Some((last, bytes)) if *last == id => *bytes += e.data.len(),
                _ => touched.push((id, e.data.len())),
            }
            parts.clear();
            match warren_replication::batch::split_into(&e.data, &mut parts) {
                Ok(true) => {}
                Ok(false) => parts.push(e.data.clone()),
                Err(error) => {
                    // Every member refuses the same bytes: their states stay equal.
                    tracing::error!(group = e.group.0, index = e.index, %error, "unreadable joined entry skipped");
                }
            }
            r.since_snapshot = r
                .since_snapshot
                .saturating_add(parts.len().saturating_sub(1) as u64);
            // Each command of a joined entry as if it were an entry of its own, at its index.
            for data in parts.drain(..) {
                let (head, command) = match decode(data) {
                    Ok(x) => x,
                    Err(error) => {
                        // Every member refuses the same bytes: their states stay equal.
                        tracing::error!(group = e.group.0, index = e.index, %error, "unreadable entry skipped");
                        continue;
                    }
                };
                if r.stepped_down.is_some_and(|t| e.term > t) {
                    // A later leader's entry: what this node proposed while it led and is not in
                    // the log by now never will be.
                    r.stepped_down = None;
                    c.abandon_led(e.group.0, &mut outcomes);
                    r.applied_own = r.proposed;
                }
                // The machine counts the commands it applied, not Raft's entries (a joined
                // entry holds many): the leader's machine that runs ahead counts alike, one a
                // command it proposes, so both agree once the log caught up with it.
                let applied = match &r.mode {
                    Mode::Leading { committed } => committed.last_index(),
                    _ => q.machine.last_index(),
                };
                let meta = Meta {
                    index: applied + 1,
                    now_ms: head.now_ms,
                };
                // Of this node, since it started (what a restart replays is of channels gone).
                let own = head.origin.node == c.node && head.origin.seq >= c.boot_seq;
                let consumed = match &command {
                    Command::Consume { id, .. } if own => Some(*id),
                    _ => None,
                };
                // A get this node forwarded: its answer is this entry's.
                let own_get = own
                    && matches!(&command, Command::GetBy { node, .. } if u64::from(*node) == c.node);
                let mut got = None;
                match &command {
                    Command::Cancel { id } if own => {
                        c.retired.remove(id);
                    }
                    Command::Down { node } if u64::from(*node) == c.node => {
                        c.retired.retain(|_, queue| *queue != id);
                    }
                    _ => {}
                }
                // A Down of this node that its own start did not send (the leader lost it): its
                // consumers whose Consume the log had are gone, and are told.
                let node16 = u16::try_from(c.node).unwrap_or(u16::MAX);
                let cut_off: Vec<ConsumerId> = match &command {
                    Command::Down { node } if *node == node16 && !r.is_leading() => c
                        .local_consumers
                        .iter()
                        .filter(|(_, (queue, _, applied))| *queue == id && *applied)
                        .map(|(cid, _)| *cid)
                        .collect(),
                    _ => Vec::new(),
                };
                // This node's enqueuer in the group starts over after a refusal of one of its
                // sequences as out of order.
                let enqueuer_used = match &command {
                    Command::EnqueueFrom { enqueuer, .. }
                    | Command::EnqueueWith {
                        from: Some((enqueuer, _)),
                        ..
                    } if head.origin.node == c.node => Some(*enqueuer),
                    _ => None,
                };
                c.scratch.clear();
                let reply = match &mut r.mode {
                    Mode::Leading { committed } => {
                        let held_delay = match &command {
                            Command::EnqueueWith { delay_ms, .. } => Some(*delay_ms),
                            _ => None,
                        };
                        let reply = committed.apply(meta, command, &mut c.scratch);
                        if let (Some(delay), Reply::Ok) = (held_delay, reply) {
                            // The same for a held publish: its copies stay shared once released.
                            if let Some(key) = committed.last_held(delay) {
                                if let Some(m) = q.machine.held_payload(key) {
                                    committed.share_held(key, m);
                                }
                            }
                        }
                        if let Reply::Enqueued { msg_id } = reply {
                            // The machine that ran ahead holds the message as it was published,
                            // the committed one as the log gave it back: one copy of its bytes
                            // is enough (a deep queue's leader held twice its followers' memory).
                            if let Some(m) = q.machine.payload_to_share(msg_id) {
                                committed.share_payload(msg_id, &m);
                            }
                        }
                        reply
                    }
                    _ => q.machine.apply(meta, command, &mut c.scratch),
                };
                if !r.is_leading() {
                    // A leader acted on these ahead; every other member hands this node's consumers
                    // what the entry gave them.
                    let counts = q.args.counts_deliveries();
                    let (live, retired) = (&c.local_consumers, &c.retired);
                    let ours = |cid: &ConsumerId| live.get(cid).is_some_and(|l| l.2);
                    let ours_or_retired = |cid: &ConsumerId| ours(cid) || retired.contains_key(cid);
                    let our_channel = |g: &CreditGroup| {
                        live.values().any(|(_, k, applied)| {
                            *applied && k.conn == g.conn && k.channel == g.channel
                        })
                    };
                    let mut gone = Vec::new();
                    for effect in c.scratch.drain(..) {
                        match effect {
                            Effect::Deliver(d)
                                if d.consumer.as_ref().is_some_and(ours_or_retired) =>
                            {
                                if let Some(delivery) =
                                    super::runtime::delivery_with(id, &q.name, counts, d, true)
                                {
                                    c.released.push(delivery);
                                }
                            }
                            Effect::Deliver(d) if own_get && d.consumer.is_none() => {
                                got = super::runtime::delivery_with(id, &q.name, counts, d, true);
                            }
                            Effect::TimedOut {
                                msg_id,
                                attempt,
                                group: Some(group),
                                ..
                            } if our_channel(&group) => {
                                self.timed_out
                                    .push((id, group, Receipt { msg_id, attempt }));
                            }
                            Effect::ConsumerTimedOut {
                                consumer,
                                group,
                                tag,
                                timeout_ms,
                            } if ours(&consumer) => {
                                gone.push(consumer);
                                self.consumer_timeouts.push(ConsumerTimeout {
                                    queue: id,
                                    consumer,
                                    group,
                                    tag,
                                    timeout_ms,
                                });
                            }
                            _ => {}
                        }
                    }
                    for cid in gone {
                        c.local_consumers.remove(&cid);
                    }
                }
                c.scratch.clear();
                if let (Some(used), Reply::Refused(Refusal::OutOfOrder)) = (enqueuer_used, reply) {
                    if c.enqueuers
                        .get(&e.group.0)
                        .is_some_and(|(now, _)| *now == used)
                    {
                        tracing::debug!(
                            group = e.group.0,
                            "a forward was lost on its way: a new enqueuer"
                        );
                        c.enqueuers.remove(&e.group.0);
                    }
                }
                // A get of this node's that this entry shows can no longer come is answered.
                let own_seq = (head.origin.node == c.node).then_some(head.origin.seq);
                c.gets.applied(e.group.0, e.term, own_seq);
                if own_get && !r.is_leading() {
                    let remaining = u32::try_from(q.machine.ready_count()).unwrap_or(u32::MAX);
                    gets.push(super::remote_get::AppliedGet {
                        queue: id,
                        group: e.group.0,
                        seq: head.origin.seq,
                        got: got.map(|d| (d, remaining)),
                    });
                }
                if let Some(cid) = consumed {
                    // What the machine holds decides, whatever this entry's reply: a forward sent
                    // again to a new leader may be applied twice (the second refused as a
                    // duplicate).
                    let present = q.machine.consumers().any(|(other, _, _)| other == cid);
                    match (present, c.local_consumers.get_mut(&cid)) {
                        (true, Some(l)) => l.2 = true,
                        // Cancelled here meanwhile, and in the machine again (a duplicate): it must
                        // go, and what it is given goes back.
                        (true, None) => ghosts.push((id, cid)),
                        (false, Some(_)) => {
                            // The leader refused it (another node's exclusive consumer came first).
                            if let Some((_, key, _)) = c.local_consumers.remove(&cid) {
                                c.cancelled.push(key);
                            }
                        }
                        (false, None) => {}
                    }
                }
                for cid in cut_off {
                    if q.machine.consumers().all(|(other, _, _)| other != cid) {
                        if let Some((_, key, _)) = c.local_consumers.remove(&cid) {
                            c.cancelled.push(key);
                        }
                    }
                }
                if head.origin.node != c.node && r.is_leading() {
                    r.forwarded_ahead = r.forwarded_ahead.saturating_sub(1);
                }
                if head.origin.node == c.node {
                    let cl = &mut **c;
                    if let Some(kept) = cl.kept.get_mut(&e.group.0) {
                        // Those still in the proposals are answered there (this one, or lost
                        // before it); one taken out at an election waits for its own entry, which
                        // the old leader may have committed after all.
                        let seq = head.origin.seq;
                        let (outbox, upcoming, node) =
                            (&mut cl.outbox, cl.proposals.upcoming(), cl.node);
                        kept.retain_mut(|k| match k.token.take() {
                            None if k.seq >= seq => k.seq > seq,
                            // A publish: its proposal's outcome is a nack.
                            None if k.confirm => false,
                            None => {
                                // A consumer's command that a later one of this node overtook
                                // was lost on its way (a broken connection, a leader that died
                                // before it took it, or one that took it before it acted) if
                                // that later one was sent after it. Dropped, an ack lost would
                                // leave its message checked out to a live consumer for good: it
                                // goes again now (twice changes nothing).
                                if seq >= k.sent_before && !k.held {
                                    if let Some(leader) = r.leader.filter(|l| *l != node) {
                                        k.send_to(leader, e.group.0, outbox, (now_ms, upcoming));
                                    }
                                }
                                true
                            }
                            Some(token) if k.seq == seq => {
                                outcomes.push(Outcome::Applied(token, reply));
                                false
                            }
                            Some(token) => {
                                k.token = Some(token);
                                true
                            }
                        });
                        if !kept.iter().any(|k| k.down) {
                            // The `Down` they waited for is in the log: they go now, in order.
                            if let Some(leader) = r.leader.filter(|l| *l != node) {
                                for k in kept.iter_mut().filter(|k| k.held) {
                                    k.send_to(leader, e.group.0, outbox, (now_ms, upcoming));
                                }
                            }
                        }
                        if kept.is_empty() {
                            cl.kept.remove(&e.group.0);
                        }
                    }
                    r.applied_own = r.applied_own.max(head.origin.seq);
                    if let Mode::Starting { marker } = r.mode {
                        if head.origin.seq >= marker {
                            r.mode = Mode::Leading {
                                committed: Box::new(q.machine.clone()),
                            };
                            started.push(id);
                        }
                    }
                }
                c.proposals
                    .applied(e.group, head.origin, reply, &mut outcomes);
                while r.held.front().is_some_and(|(seq, _)| *seq <= r.applied_own) {
                    if let Some((_, d)) = r.held.pop_front() {
                        c.released.push(d);
                    }
                }
            }
        }
        for outcome in outcomes {
            c.settle(outcome);
        }
        for id in started {
            self.refile(id);
            // First: what the steps below dead-letter is sent with them, not twice.
            self.resend_held_dead_letters(id);
            self.configure_for_term(id);
            self.reissue_kept(id);
        }
        for (id, cid) in ghosts {
            if let Some(c) = self.cluster.as_mut() {
                c.retired.insert(cid, id);
            }
            self.run(id, Command::Cancel { id: cid });
        }
        self.gets_applied(gets);
        self.settle_release_guards();
        self.settle_held_dead_letters();
        // A queue whose entries came between other queues' is there more than once: its
        // bytes are summed, and it sends away once.
        touched.sort_unstable_by_key(|(id, _)| *id);
        let mut merged: Vec<(QueueId, usize)> = Vec::with_capacity(touched.len());
        for (id, bytes) in touched {
            match merged.last_mut() {
                Some((last, sum)) if *last == id => *sum += bytes,
                _ => merged.push((id, bytes)),
            }
        }
        let queues: Vec<QueueId> = merged.iter().map(|(id, _)| *id).collect();
        for (id, bytes) in merged {
            self.send_away_applied(id, bytes);
        }
        self.take_due_snapshots(&queues);
        self.apply_meta(&meta);
        self.check_hold_level();
    }

    /// The highest store batch whose confirms may go out once the store wrote up to
    /// `written`: the replicated entries proposed up to it must be applied too.
    pub fn confirmable(&self, written: u64) -> u64 {
        match self.cluster.as_ref().and_then(|c| c.waiting.keys().next()) {
            Some(first) => written.min(first.saturating_sub(1)),
            None => written,
        }
    }

    /// Starts a channel's publish (or transaction commit): what it proposes to replicated
    /// queues from here to [`Broker::close_hold`] counts in one hold ([`crate::holds`]),
    /// instead of holding back every confirm of its store batch. Nothing on a single node.
    pub fn open_hold(&mut self) {
        if let Some(c) = self.cluster.as_mut() {
            c.holds.open();
        }
    }

    /// [`Broker::open_hold`] for a caller that waits for every command it runs to be in the
    /// log, not only its publishes (the management API's gets: [`Broker::get_awaited`]).
    pub fn open_hold_every(&mut self) {
        if let Some(c) = self.cluster.as_mut() {
            c.holds.open_every();
        }
    }

    /// Ends the hold [`Broker::open_hold`] started: the hold the publish's confirm waits for
    /// (0: none), its own or a deduplicated publish's first copy's.
    pub fn close_hold(&mut self) -> u64 {
        let now = self.now_ms;
        self.cluster.as_mut().map_or(0, |c| c.holds.close(now))
    }

    /// The holds channels' confirms wait on (none on a single node).
    pub fn holds(&self) -> Option<&crate::holds::Holds> {
        self.cluster.as_ref().map(|c| &c.holds)
    }

    /// No channel waits on a lost hold below `floor` (`None`: on none): see
    /// [`crate::holds::Holds::prune_lost_below`].
    pub fn prune_lost_holds(&mut self, floor: Option<u64>) {
        if let Some(c) = self.cluster.as_mut() {
            c.holds.prune_lost_below(floor);
        }
    }

    /// Publishes of this node's clients held back behind its undecided proposals as a deposed
    /// leader ([`Cluster::behind`]).
    pub fn behind_count(&self) -> usize {
        self.cluster
            .as_ref()
            .map_or(0, |c| c.behind.values().map(VecDeque::len).sum())
    }

    /// The highest batch holding a replicated entry that was lost (a leader change dropped
    /// it) since the last call: the confirms up to it are nacks.
    pub fn take_lost(&mut self) -> Option<u64> {
        let c = self.cluster.as_mut()?;
        let lost = std::mem::take(&mut c.lost_upto);
        let lost_holds = c.holds.take_newly_lost();
        self.held_dead_letters_lost(lost);
        self.forget_lost_keys(&lost_holds);
        (lost > 0).then_some(lost)
    }

    /// A duplicate dropped because its first copy, a publish in `hold`, was taken: its confirm
    /// waits for that hold. A publish in a hold (a channel's, or one of its own) joins it; a
    /// store batch waits for it otherwise.
    pub(super) fn duplicate_of(&mut self, hold: u64) -> Option<u64> {
        let c = self.cluster.as_mut()?;
        if c.holds.is_open() {
            c.holds.join(hold);
            return None;
        }
        self.batch_waits_for(hold)
    }

    /// The store batch being filled waits for `hold` (0: none) to be applied, and is nacked if
    /// it is lost: the batch, if there is one to wait for (what the management API waits on).
    pub fn batch_waits_for(&mut self, hold: u64) -> Option<u64> {
        let now = self.now_ms;
        let state = self.cluster.as_ref()?.holds.state(hold);
        if state == crate::holds::HoldState::Applied {
            return None;
        }
        let batch = open_batch(self.persist.as_mut());
        let c = self.cluster.as_mut()?;
        if state == crate::holds::HoldState::Lost {
            c.lost_upto = c.lost_upto.max(batch);
        } else {
            c.wait_in_batch_for(hold, batch, now);
        }
        Some(batch)
    }

    /// Deduplication windows forget the keys of publishes whose entries were lost: their
    /// publishers were nacked, and a retry is new. (Judged before this runs, a retry is new
    /// too: the window looks at its first copy's hold.)
    fn forget_lost_keys(&mut self, holds: &[u64]) {
        if holds.is_empty() || (!self.dedup_exchanges && self.dedup_queues == 0) {
            return;
        }
        let holds: std::collections::BTreeSet<u64> = holds.iter().copied().collect();
        for vh in self.vhosts.values_mut() {
            for x in vh.exchanges.values_mut() {
                if let Some(d) = x.dedup.as_deref_mut() {
                    d.forget_holds(&holds);
                }
            }
        }
        for q in self.queues.values_mut() {
            if let Some(d) = q.dedup.as_deref_mut() {
                d.forget_holds(&holds);
            }
        }
    }

    /// Consumers on this node of replicated queues it no longer leads: the session tells them
    /// with basic.cancel (their client consumes again, from the new leader).
    pub fn take_replica_cancelled(&mut self) -> Vec<ConsumerKey> {
        self.cluster
            .as_mut()
            .map(|c| std::mem::take(&mut c.cancelled))
            .unwrap_or_default()
    }

    /// The leader of `group` is now `leader` (in `term`), as the driver's Raft reports it.
    /// Elected here, the queue waits for its first entries of the term before it acts: a
    /// `Down` of the previous leader (what it took ahead of the log is lost), of this node if
    /// its start has not brought itself down yet, and of the nodes down for good; the other
    /// members' consumers carry on. Meanwhile its own consumers' acks and cancels wait
    /// (`deferred`). Deposed here, the machine falls back to the committed state and the
    /// local consumers are cancelled.
    pub fn set_leader(&mut self, group: u64, leader: Option<NodeId>, term: u64) {
        self.set_leader_here(group, leader, term);
        // What it decided may let publishes held back behind this node's own proposals go.
        self.send_behind();
    }

    fn set_leader_here(&mut self, group: u64, leader: Option<NodeId>, term: u64) {
        let now = self.now_ms;
        if group == super::metadata_group::META_GROUP {
            self.set_meta_leader(leader);
            return;
        }
        let Some(c) = self.cluster.as_ref() else {
            return;
        };
        let node = c.node;
        let Some(&id) = c.groups.get(&group) else {
            return;
        };
        let Some(r) = self.queues.get_mut(&id).and_then(|q| q.replica.as_mut()) else {
            return;
        };
        let previous = r.leader;
        let was_here = !matches!(r.mode, Mode::Following);
        if previous == leader && (leader == Some(node)) == was_here {
            if was_here && term > r.term {
                // Deposed and elected again within one Raft pass (a leader's term grows only
                // through an election it had to stand in): what it ran ahead of the log in its
                // earlier term may have been overwritten by the leader in between. Taken as
                // the two changes it was: back to the committed state, then a new term.
                let led_in = r.term;
                self.set_leader(group, None, led_in);
                self.set_leader(group, leader, term);
                return;
            }
            if term > r.term && !was_here {
                if let (Some(l), Some(c)) = (leader, self.cluster.as_mut()) {
                    // The same leader in a later term: it died and came back, or lost the lead
                    // and won it again out of this node's sight (a learner sees no election).
                    // What it was sent before may be gone with its old term.
                    c.send_kept(group, Some(l), now, |_| true);
                }
            }
            r.term = r.term.max(term);
            return;
        }
        r.leader = leader;
        // The term this node proposed in: what it leaves waiting is lost once an entry of a
        // later one is applied (`step_down` reads it before it moves on).
        let led_in = r.term;
        r.term = term;
        if leader.is_some_and(|l| l != node) {
            // Another node won the queue's first election: a declaration made here need
            // not wait for this node to act.
            self.leader_acts(id);
        }
        if was_here && leader != Some(node) {
            self.step_down(id);
            if let Some(r) = self.queues.get_mut(&id).and_then(|q| q.replica.as_mut()) {
                r.stepped_down = Some(led_in);
            }
        }
        if let (Some(l), Some(c)) = (leader, self.cluster.as_mut()) {
            if l == node {
                // What it forwarded to the old leader, this node proposes itself once it acts
                // (the old leader may have committed some: a duplicate, never a loss).
                for k in c.kept.get_mut(&group).into_iter().flatten() {
                    let origin = Origin { node, seq: k.seq };
                    if let Some(t) = c.proposals.withdraw(GroupId(group), origin) {
                        k.token = Some(t);
                    }
                }
            } else {
                // Sent again to the new leader, in order: one the old leader committed is a
                // `Duplicate` of its enqueuer's there (or, as a plain `Enqueue`, in the queue
                // twice; never a loss).
                c.send_kept(group, Some(l), now, |_| true);
            }
        }
        if leader == Some(node) && !was_here {
            // Re-elected: what it proposed in its earlier term is answered by the rule of later
            // proposals (one applied after them means they are lost).
            let mut gone: BTreeSet<NodeId> = BTreeSet::new();
            if let Some(r) = self.queues.get_mut(&id).and_then(|q| q.replica.as_mut()) {
                r.stepped_down = None;
                // The previous leader's consumers go (it fell back to what was committed, and
                // what it took ahead of the log is lost), and so does what this node's own
                // channels held before it started.
                gone.extend(previous.or(r.last_leader).filter(|l| *l != node));
                if !std::mem::replace(&mut r.downed_self, true) {
                    gone.insert(node);
                }
            }
            // And the nodes down for good: their connections are gone. Other members'
            // consumers carry on under this leader.
            if let Some(c) = self.cluster.as_ref() {
                gone.extend(c.downed.iter().copied());
            }
            let downs = gone.into_iter().map(|n| Command::Down {
                node: u16::try_from(n).unwrap_or(u16::MAX),
            });
            // And a `Touch`: an `x-expires` lease runs from the term's start, at the leader's
            // time, the same on every member.
            let marker: Vec<Command<Message>> = downs.chain([Command::Touch]).collect();
            self.start_term(id, marker);
            // A queue made, or led here now, may be short of its target size.
            self.reconcile_soon();
        } else if leader.is_some_and(|l| l != node) {
            // Its first word to a leader since it started, if nothing was sent before.
            self.down_self_once(id);
        }
        if let Some(r) = self.queues.get_mut(&id).and_then(|q| q.replica.as_mut()) {
            if leader.is_some() {
                r.last_leader = leader;
            }
        }
    }

    /// Proposes the first entries of this node's term, outside `run` (the queue does not act
    /// yet); the queue acts once the last is applied.
    fn start_term(&mut self, id: QueueId, mut commands: Vec<Command<Message>>) {
        if commands.is_empty() {
            commands.push(Command::Tick);
        }
        let now = self.now_ms;
        let (Some(c), Some(q)) = (self.cluster.as_mut(), self.queues.get_mut(&id)) else {
            return;
        };
        let Some(r) = q.replica.as_mut() else {
            return;
        };
        let token = Token {
            batch: 0,
            hold: 0,
            forwarded: false,
            release: None,
        };
        for command in &commands {
            let origin = c.proposals.next(GroupId(r.group), token);
            match encode(now, origin, command) {
                Ok(data) => {
                    r.proposed = origin.seq;
                    // No confirm waits for a term's first entries.
                    r.mode = Mode::Starting { marker: origin.seq };
                    c.outbox.push(Proposal {
                        group: r.group,
                        data,
                        to: None,
                    });
                }
                Err(error) => {
                    c.proposals.withdraw(GroupId(r.group), origin);
                    tracing::error!(queue = id.0, %error, "term marker not encoded");
                }
            }
        }
    }

    fn step_down(&mut self, id: QueueId) {
        let group = self.replica_group(id);
        if let (Some(c), Some(g)) = (self.cluster.as_mut(), group) {
            // Its clients' next publishes wait for what it proposed as leader.
            if let Some(last) = c.proposals.last_waiting(GroupId(g), own_as_leader) {
                c.led_pending.insert(g, last);
            }
            // Their senders send them again to whoever leads now.
            c.early.remove(&g);
            // The `Down` of this node that comes next gives back what its consumers held.
            c.deferred.remove(&g);
            c.gets.stepped_down(id);
        }
        let Some(c) = self.cluster.as_mut() else {
            return;
        };
        let node = c.node;
        let Some(q) = self.queues.get_mut(&id) else {
            return;
        };
        let Some(r) = q.replica.as_mut() else {
            return;
        };
        let mode = std::mem::replace(&mut r.mode, Mode::Following);
        if let Mode::Leading { committed } = mode {
            q.machine = *committed;
            r.away_through = 0;
            r.held_away = Default::default();
            r.retry_away = Default::default();
        }
        // What it held for its consumers is dropped: the entries that gave it to them may
        // still commit, so this node brings itself `Down` again before anything else of it
        // (its next term's marker, or its first forward), and those messages come back.
        r.downed_self = false;
        r.held.clear();
        r.stepped_down = Some(r.term);
        // Its consumers are told now: what it took for them ahead of the log is lost, and the
        // next leader brings this node `Down`.
        for (cid, spec, _) in q.machine.consumers() {
            if warren_queue::node_of(spec.group.conn) == u16::try_from(node).unwrap_or(0) {
                // What the log still gives it (entries of this term committed after this)
                // goes to the session, which hands it back.
                if c.local_consumers.remove(&cid).is_some() {
                    c.retired.insert(cid, id);
                }
                c.cancelled.push(ConsumerKey {
                    conn: spec.group.conn,
                    channel: spec.group.channel,
                    tag: spec.tag.clone(),
                });
            }
        }
        // Those the log never had are gone as well.
        c.cancel_unlogged(id, &q.machine);
        if let Some(at) = q.scheduled.take() {
            self.deadlines.remove(&(at, id));
        }
        tracing::info!(queue = %q.name, vhost = %q.vhost, "no longer leads its replicated queue");
    }

    /// What this node sent for the queue before it was elected, and what its clients did
    /// since, run now that it acts, in the order it came: the publishes others forwarded to
    /// it, then its own forwards (publishes keep the confirm they had), then its consumers'
    /// commands held meanwhile (`deferred`). A `Down` of itself forwarded before, and lost, is
    /// among its forwards: run after a consume made since, it would remove that consumer.
    fn reissue_kept(&mut self, id: QueueId) {
        let Some(group) = self.replica_group(id) else {
            return;
        };
        let early = self
            .cluster
            .as_mut()
            .and_then(|c| c.early.remove(&group))
            .unwrap_or_default();
        for data in early {
            self.forwarded(group, &data);
        }
        self.reissue_forwards(id, group);
        let deferred = self
            .cluster
            .as_mut()
            .and_then(|c| c.deferred.remove(&group))
            .unwrap_or_default();
        for command in deferred {
            self.run_as_leader(id, command);
        }
    }

    /// This node's forwards to the queue's earlier leaders that its log does not have yet,
    /// proposed as its own ([`Broker::reissue_kept`]).
    fn reissue_forwards(&mut self, id: QueueId, group: u64) {
        let Some(kept) = self.cluster.as_mut().and_then(|c| c.kept.remove(&group)) else {
            return;
        };
        for k in kept {
            let Some(token) = k.token else {
                if !k.confirm {
                    // A consumer's command forwarded to the old leader whose proposal was
                    // given up: not applied here, so not committed; run now (twice would
                    // change nothing).
                    if let Ok((_, command)) = decode(bytes::Bytes::from(k.data)) {
                        self.run_as_leader(id, command);
                    }
                }
                continue;
            };
            let command = decode(bytes::Bytes::from(k.data)).map(|(_, c)| c);
            let Some(c) = self.cluster.as_mut() else {
                return;
            };
            let Ok(command) = command else {
                c.settle(Outcome::Lost(token));
                continue;
            };
            c.reissue = Some(token);
            let reply = self.run(id, command);
            let applied = reply.is_some();
            if let Some(c) = self.cluster.as_mut() {
                if let Some(token) = c.reissue.take() {
                    // Not proposed after all: its publisher is told.
                    c.settle(Outcome::Lost(token));
                } else if matches!(reply, Some(Reply::Refused(_))) {
                    // Refused by a full queue (reject-publish) as it was applied ahead: its
                    // publisher, told "enqueued" long ago, gets a nack. Its entry carries the
                    // same refusal to every member; the proposal's token is this node's own
                    // now, which the entry alone would settle as a success.
                    c.lose(&token);
                }
            }
            if applied {
                self.finish_effects(id);
            }
        }
    }

    /// Runs a consumer's command that waited for this node to act, and sends out what it
    /// dead-letters.
    fn run_as_leader(&mut self, id: QueueId, command: Command<Message>) {
        if self.run(id, command).is_some() {
            self.finish_effects(id);
        }
    }

    /// Raft refused proposal `data` of this node, with `leader` leading the group as far as it
    /// knows. Once this node has stepped down (a leadership transfer hands back what it held
    /// meanwhile), a publish goes on to the new leader as a forward, keeping its confirm.
    /// While the queue still acts here (Raft lost the lead first, or the entry was too large),
    /// the machine that ran ahead with it falls back to the committed state, what this node
    /// still waits for in the group is nacked, and, if Raft still has it lead, a new term
    /// marker brings it back to acting once everything before is applied.
    pub fn proposal_refused(&mut self, group: u64, data: &[u8], leader: Option<NodeId>) {
        if warren_replication::batch::is_joined(data) {
            // A joined entry's commands, each refused in its turn as if proposed alone.
            for part in warren_replication::batch::split_owned(data.to_vec()) {
                self.proposal_refused_here(group, &part, leader);
            }
        } else {
            self.proposal_refused_here(group, data, leader);
        }
        // What it decided may let publishes held back behind this node's own proposals go.
        self.send_behind();
    }

    fn proposal_refused_here(&mut self, group: u64, data: &[u8], leader: Option<NodeId>) {
        let Some(&id) = self.cluster.as_ref().and_then(|c| c.groups.get(&group)) else {
            return;
        };
        let here = self
            .queues
            .get(&id)
            .and_then(|q| q.replica.as_ref())
            .is_some_and(|r| !matches!(r.mode, Mode::Following));
        if !here {
            self.forward_refused(id, group, data);
            return;
        }
        let still_leads = leader.is_some() && leader == self.cluster_node();
        tracing::warn!(
            group,
            "a proposal was refused: the queue falls back to its committed state"
        );
        self.step_down(id);
        if let Some(r) = self.queues.get_mut(&id).and_then(|q| q.replica.as_mut()) {
            r.stepped_down = None;
            r.applied_own = r.proposed;
        }
        if let Some(c) = self.cluster.as_mut() {
            let mut outcomes = Vec::new();
            c.abandon(group, &mut outcomes);
            for o in outcomes {
                c.settle(o);
            }
        }
        if still_leads {
            let node = self.cluster_node();
            if let Some(r) = self.queues.get_mut(&id).and_then(|q| q.replica.as_mut()) {
                // Elected again as far as this queue knows: its next marker decides.
                r.leader = None;
            }
            let term = self
                .queues
                .get(&id)
                .and_then(|q| q.replica.as_ref())
                .map_or(0, |r| r.term);
            self.set_leader(group, node, term);
        }
    }

    /// A publish this node proposed as leader and Raft handed back after it stepped down (held
    /// through a leadership transfer, or refused once Raft no longer led: a leader paused,
    /// deposed meanwhile, then resumed): sent to whoever leads now with a new number (after
    /// this node's `Down` of itself, which its step-down sent first), its confirm still
    /// waiting. Raft never appended it, so this is the only copy. Anything else is dropped:
    /// its consumer is gone, and the new leader's `Down` of this node gives back what it held.
    fn forward_refused(&mut self, id: QueueId, group: u64, data: &[u8]) {
        let Ok((head, command)) = decode(bytes::Bytes::copy_from_slice(data)) else {
            return;
        };
        let Some(c) = self.cluster.as_mut() else {
            return;
        };
        if head.origin.node != c.node {
            // Another node's forward this node proposed for it: its sender keeps it and
            // sends it to the new leader itself.
            return;
        }
        if !is_enqueue(&command) {
            // Dropped on purpose, so not a loss: left waiting, it was taken for lost at the
            // new leader's first entry, and the confirms of its store batch and every earlier
            // one (publishes forwarded on and still coming) were nacked with it.
            if let Some(token) = c.proposals.withdraw(GroupId(group), head.origin) {
                c.settle(Outcome::Applied(token, Reply::Ok));
            }
            return;
        }
        // Answered already (lost at a later leader's entry): nothing waits any more.
        let Some(token) = c.proposals.withdraw(GroupId(group), head.origin) else {
            return;
        };
        self.down_self_once(id);
        tracing::debug!(group, "a publish Raft handed back goes to the new leader");
        // Never appended here, so this is its first copy on its way: as an `EnqueueFrom`,
        // since it stays kept until this node applies it, and a snapshot installed meanwhile
        // sends it again (`forward_again`). A plain `Enqueue` was taken once per sending: a
        // deposed leader that resumed under load put one publish in the queue four times.
        let command = self.as_enqueuer(id, &command).into_owned();
        self.forward_keeping(id, &command, true, Some(token));
    }

    /// A queue that starts acting files its deadline and looks for work.
    fn refile(&mut self, id: QueueId) {
        let Some(q) = self.queues.get_mut(&id) else {
            return;
        };
        if let Some(at) = q.machine.next_deadline() {
            self.deadlines.insert((at, id));
            q.scheduled = Some(at);
        }
        let low_water = (self.config.page_window / 2).max(1) as usize;
        mark_dirty(&mut self.dirty, q, low_water, self.now_ms);
        tracing::info!(queue = %q.name, vhost = %q.vhost, "leads its replicated queue");
        self.leader_acts(id);
    }
}

/// A forwarded publish's expiry is a time on the clock of the node that took it (`sent_ms` when
/// it sent it): moved onto this leader's clock (`now_ms`), so that the message lives its time
/// to live from when the leader takes it, however far the two clocks are apart (the log's
/// entries carry the leader's time, and every member expires by it).
fn on_clock_of_leader(command: &mut Command<Message>, sent_ms: u64, now_ms: u64) {
    let meta = match command {
        Command::Enqueue { meta, .. }
        | Command::EnqueueFrom { meta, .. }
        | Command::EnqueueWith { meta, .. } => meta,
        _ => return,
    };
    if let Some(at) = meta.expires_at.as_mut() {
        *at = at.saturating_sub(sent_ms).saturating_add(now_ms);
    }
}

/// A client asked a node that does not lead a replicated queue for something only its leader
/// does (consume, get): refused as RabbitMQ refuses a queue whose leader is unavailable, with
/// where to go instead.
pub(super) fn not_led_here(q: &Queue) -> AmqpError {
    let at = match q.replica.as_ref().and_then(|r| r.leader) {
        Some(node) => format!("its leader is node {node}: connect there"),
        None => "it has no leader now: retry".to_owned(),
    };
    AmqpError::resource_error(format!("{} is not led by this node ({at})", q.rs()))
}

/// A proposal this node made as a queue's leader that a confirm waits for (a publish): not a
/// forward, not a term's marker, not a consumer's command.
fn own_as_leader(t: &Token) -> bool {
    !t.forwarded && t.batch > 0
}

/// A publish, whose token may carry the guard of a delayed message falling due or of a dead
/// letter.
fn is_enqueue(command: &Command<Message>) -> bool {
    matches!(
        command,
        Command::Enqueue { .. } | Command::EnqueueFrom { .. } | Command::EnqueueWith { .. }
    )
}

/// The number of the store batch being filled, which a confirm waiting for a replicated entry
/// waits in: handed to the store even when it holds no write of its own.
fn open_batch(persist: Option<&mut Persist>) -> u64 {
    match persist {
        Some(p) => {
            p.force = true;
            p.next_batch
        }
        None => 0,
    }
}

/// A delivery for a consumer of this node's channels, or a basic.get's.
fn delivers_here(d: &Delivery, node: NodeId) -> bool {
    consumer_here(d.consumer.as_ref().map(|(_, group, _)| group.conn), node)
}

/// A delivery whose consumer is on connection `conn` (none: a basic.get) is for this node.
pub(super) fn consumer_here(conn: Option<ConnId>, node: NodeId) -> bool {
    conn.is_none_or(|conn| u64::from(warren_queue::node_of(conn)) == node)
}

fn qualified(node: NodeId, local: u64) -> u64 {
    warren_queue::qualify(u16::try_from(node).unwrap_or(u16::MAX), local).unwrap_or(local)
}

#[cfg(test)]
mod stream_tests {
    use super::*;
    use crate::machine::{Command, Meta, MsgMeta};

    fn deep(messages: usize) -> QueueMachine<Message> {
        let mut m = QueueMachine::<Message>::new();
        for i in 0..messages {
            let body = bytes::Bytes::from(vec![i as u8; 300]);
            let size = body.len() as u64;
            m.apply(
                Meta::default(),
                Command::Enqueue {
                    message: Message {
                        exchange: warren_codec::ShortStr::from_static(""),
                        routing_key: warren_codec::ShortStr::from_static("q"),
                        properties: bytes::Bytes::from_static(&[0x10, 0, 2]),
                        body,
                        persistent: true,
                        store_key: None,
                        away: None,
                    },
                    meta: MsgMeta {
                        size,
                        ..MsgMeta::default()
                    },
                },
                &mut Vec::new(),
            );
        }
        m
    }

    fn streamed(data: SnapshotData) -> Result<(Vec<u8>, usize), SnapshotDataError> {
        let (mut out, mut calls) = (Vec::new(), 0);
        let prefix = data.write_to(&mut |chunk: &[u8]| {
            calls += 1;
            out.extend_from_slice(chunk);
            Ok(())
        })?;
        Ok(([prefix, out].concat(), calls))
    }

    /// A copied machine streamed is the snapshot encoded whole, in chunks; past the limit it
    /// stops, refused, as `encode` refuses it.
    #[test]
    fn a_deep_queues_snapshot_is_streamed_in_chunks_and_refused_past_its_limit() {
        let m = deep(5_000);
        let whole = SnapshotData::Machine {
            machine: Box::new(m.clone()),
            max: usize::MAX,
        }
        .encode()
        .expect("encodes");
        let (bytes, calls) = streamed(SnapshotData::Machine {
            machine: Box::new(m.clone()),
            max: usize::MAX,
        })
        .expect("streams");
        assert_eq!(bytes, whole);
        assert!(
            whole.len() > STREAM_CHUNK,
            "a snapshot of more than one chunk"
        );
        assert!(calls >= 2, "{calls} chunks for {} bytes", whole.len());
        assert_eq!(
            streamed(SnapshotData::Encoded(whole.clone()))
                .expect("streams")
                .0,
            whole
        );
        let max = whole.len() / 2;
        let refused = streamed(SnapshotData::Machine {
            machine: Box::new(m),
            max,
        });
        assert!(
            matches!(refused, Err(SnapshotDataError::TooLarge { max: m, .. }) if m == max),
            "{refused:?}"
        );
    }
}
