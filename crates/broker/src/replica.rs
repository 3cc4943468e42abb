//! What the broker keeps for a replicated queue (`x-queue-type: quorum` on a cluster): its Raft
//! group, who leads it, and what waits for the group's log.
//!
//! The leader's broker applies a command to the queue's machine at once, as for any queue, and
//! proposes the same command to the group: its replies stay synchronous (consume-ok, a purge's
//! count, a refused publish) and Raft keeps a leader's proposals in order, so once they commit
//! every member holds the state the leader computed. What a client could see of an entry that a
//! failover may still take back waits for the commit: a publish's confirm (its batch is
//! confirmable only when every proposal made up to it is applied) and a delivery (held until
//! the entry that made it is applied). Beside the machine that runs ahead, the leader keeps the
//! committed one; when it stops leading, the machine falls back to that one. Members that do
//! not lead apply committed entries only, and act on none of their effects: the leader
//! delivers, dead-letters and times out.

use std::collections::VecDeque;

use warren_queue::machine::QueueMachine;

use crate::{Delivery, Message};

/// A node of the cluster (Raft's peer id, never 0).
pub type NodeId = u64;

/// A replicated queue's part in this node's broker.
#[derive(Clone, Debug)]
pub struct ReplicaState {
    /// The queue's Raft group.
    pub group: u64,
    /// The group's leader as last reported, and the term it leads in.
    pub leader: Option<NodeId>,
    /// The node chosen to stand for the first leader, until one is known (placement counts
    /// it, so that queues declared in a burst spread too).
    pub chosen: Option<NodeId>,
    pub term: u64,
    pub mode: Mode,
    /// Deliveries made ahead of the log, with the proposal they wait for: released once this
    /// node's proposals up to it are applied.
    pub held: VecDeque<(u64, Delivery)>,
    /// The last of this node's proposals in the group, and the last one applied.
    pub proposed: u64,
    pub applied_own: u64,
    /// Publishes other nodes forwarded that this leader applied ahead and that are not
    /// applied from the log yet.
    pub forwarded_ahead: u64,
    /// This node led the group until this term: a proposal it made then that is not applied
    /// before an entry of a later term never will be.
    pub stepped_down: Option<u64>,
    /// The last log entry applied to the committed machine, and its term.
    pub applied_index: u64,
    pub applied_term: u64,
    /// Since the last snapshot (taken or installed): entries and their bytes applied; and how
    /// large it was. A snapshot is taken once the log since holds as much as the last one, so
    /// its cost stays in proportion to the log it lets go.
    pub since_snapshot: u64,
    pub since_snapshot_bytes: u64,
    pub snapshot_bytes: u64,
    /// When the last snapshot here was taken (the broker's clock, ms).
    pub snapshot_at_ms: u64,
    /// This node told the group, since it started, that its channels from before are gone
    /// (a `Down` of itself, before anything else of it).
    pub downed_self: bool,
    /// The last leader reported, kept when the group has none for a while.
    pub last_leader: Option<NodeId>,
    /// The group's voters of its own (`x-quorum-initial-group-size`), the cluster's other
    /// nodes its learners; `None`: every node votes.
    pub voters: Option<Vec<NodeId>>,
    /// Ready messages with ids up to this one were considered for leaving memory
    /// (`Broker::send_away`); 0 again whenever the machine is replaced.
    pub away_through: u64,
    /// Where sending the contents of the held publishes, and of the messages waiting for a
    /// retry, away stands (`Broker::send_away`); afresh whenever the machine is replaced.
    pub held_away: Rounds<(u64, u64)>,
    pub retry_away: Rounds<u64>,
    /// The same for the messages given back, and those parked behind their group.
    pub returned_away: Rounds<u64>,
    pub parked_away: Rounds<(u64, u64)>,
    /// And for the messages in flight.
    pub in_flight_away: Rounds<u64>,
}

/// The rounds over a part of a replicated queue whose messages' contents leave memory.
#[derive(Debug, Clone, Copy)]
pub struct Rounds<K> {
    /// A round is under way, and the key it walked last (`None`: it walks from the first).
    pub round: Option<Option<K>>,
    /// When the last round began: the machine's `held_seq` then for the held publishes, the
    /// broker's time for the retries.
    pub seen: u64,
    /// The last key the last finished round walked: most rounds over the held publishes walk
    /// only what is held past it.
    pub mark: Option<K>,
    /// Rounds begun (every few over the held publishes walks them all).
    pub rounds: u32,
    /// The group's applied index when the last round over the retries began: none begins
    /// again before it moves.
    pub index: u64,
}

impl<K> Default for Rounds<K> {
    fn default() -> Self {
        Rounds {
            round: None,
            seen: 0,
            mark: None,
            rounds: 0,
            index: 0,
        }
    }
}

impl ReplicaState {
    pub fn new(group: u64) -> Self {
        ReplicaState {
            group,
            leader: None,
            chosen: None,
            term: 0,
            mode: Mode::Following,
            held: VecDeque::new(),
            proposed: 0,
            applied_own: 0,
            forwarded_ahead: 0,
            stepped_down: None,
            applied_index: 0,
            applied_term: 0,
            since_snapshot: 0,
            since_snapshot_bytes: 0,
            snapshot_at_ms: 0,
            snapshot_bytes: 0,
            downed_self: false,
            last_leader: None,
            voters: None,
            away_through: 0,
            held_away: Rounds::default(),
            retry_away: Rounds::default(),
            returned_away: Rounds::default(),
            parked_away: Rounds::default(),
            in_flight_away: Rounds::default(),
        }
    }

    /// Does this node lead the group, with everything before its term applied (may it act)?
    pub fn is_leading(&self) -> bool {
        matches!(self.mode, Mode::Leading { .. })
    }

    /// Is everything this node applied ahead of the log applied from it too?
    pub fn caught_up(&self) -> bool {
        self.applied_own >= self.proposed && self.forwarded_ahead == 0
    }
}

/// This node's part in the group.
#[derive(Clone, Debug)]
pub enum Mode {
    /// Another node leads, or none does: the machine applies committed entries only.
    Following,
    /// This node was elected and waits for its first proposal of the term (`marker`) to be
    /// applied: every entry before it is then in the machine, which may run ahead from there.
    Starting { marker: u64 },
    /// This node leads: the broker's machine runs ahead of the log, `committed` is where the
    /// log's committed entries have brought it.
    Leading {
        committed: Box<QueueMachine<Message>>,
    },
}
