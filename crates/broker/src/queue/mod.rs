//! Queues: the broker's record of a queue around its state machine.

pub mod args;
pub use warren_queue::{log, machine};

use warren_codec::{FieldTable, ShortStr};

use crate::{ConnId, Message, QueueId};
use args::QueueArgs;
use machine::QueueMachine;

/// A queue: its declaration, bindings and state machine. Everything that changes as messages
/// and consumers come and go (consumers included) lives in the machine.
#[derive(Clone, Debug)]
pub struct Queue {
    pub id: QueueId,
    pub name: ShortStr,
    pub vhost: String,
    pub durable: bool,
    pub auto_delete: bool,
    /// The connection of an exclusive queue.
    pub owner: Option<ConnId>,
    /// The arguments as declared (compared on redeclare).
    pub arguments: FieldTable,
    /// The arguments it acts on (its own with its policies'), validated and parsed.
    pub args: QueueArgs,
    /// The user policy and the operator policy that apply to it, by name.
    pub policy: Option<String>,
    pub operator_policy: Option<String>,
    pub machine: QueueMachine<Message>,
    /// Bindings to this queue: (exchange, key, arguments).
    pub bindings: Vec<(ShortStr, ShortStr, FieldTable)>,
    /// In the broker's dirty list (has work for dispatch).
    pub dirty: bool,
    /// The deadline this queue is filed under in the broker's timer index.
    pub scheduled: Option<u64>,
    /// The key its messages are stored under (a durable queue, with persistence on).
    pub store_key: Option<u64>,
    /// A number no other queue or exchange gets, across restarts too: what identifies a
    /// queue without a store key as the holder of its delayed messages.
    pub incarnation: u64,
    /// Reading its paged messages back failed: not tried again before this time (ms).
    pub load_retry_at: Option<u64>,
    /// The key its messages in the scratch area are under, once it spilled one (a transient
    /// message past its window).
    pub spill_key: Option<u64>,
    /// The deduplication window (`x-message-deduplication`).
    pub dedup: Option<Box<crate::dedup::Dedup>>,
    /// Counters and enqueue times for operators (not part of the machine's state).
    pub stats: Box<crate::stats::QueueStats>,
    /// A replicated queue's group and what waits for its log.
    pub replica: Option<Box<crate::replica::ReplicaState>>,
}

impl Queue {
    /// The key of the entry holding this queue's copy of a message on disk: the durable
    /// store for a persistent message in a durable queue, the scratch area for anything else
    /// this queue spilled; `None` when the copy is in memory only.
    pub fn entry_key(&self, m: &Message) -> Option<u64> {
        m.store_key?;
        if m.persistent && self.store_key.is_some() {
            self.store_key
        } else {
            self.spill_key
        }
    }

    /// This incarnation, as the holder of its delayed messages (`x-delivery-delay`): a
    /// durable queue by its store key, which survives restarts.
    pub fn holder(&self) -> crate::delayed::Holder {
        use crate::delayed::Holder;
        self.store_key
            .map_or(Holder::Incarnation(self.incarnation), Holder::Stored)
    }

    /// Is the queue past its in-memory window (`keep` messages)?
    pub fn is_deep(&self, keep: u32) -> bool {
        self.machine.head_count() >= keep as usize || self.machine.has_tail()
    }
}

impl Queue {
    /// `rabbit_misc:rs/1`: `queue 'q' in vhost '/'`.
    pub fn rs(&self) -> String {
        crate::erl::rs("queue", &self.name, &self.vhost)
    }

    /// `check_exclusive_access(Q, ConnPid, lax)`: a non-exclusive queue or our own.
    pub fn accessible_by(&self, conn: ConnId) -> bool {
        self.owner.is_none_or(|o| o == conn)
    }

    pub fn ready_count(&self) -> u32 {
        u32::try_from(self.machine.ready_count()).unwrap_or(u32::MAX)
    }

    pub fn consumer_count(&self) -> u32 {
        u32::try_from(self.machine.consumer_count()).unwrap_or(u32::MAX)
    }

    /// When the oldest ready message was enqueued (to within a second or so), if known.
    pub fn oldest_ready_at(&self) -> Option<u64> {
        let id = self.machine.oldest_ready_id()?;
        self.stats.enqueue_times.peek_enqueued_at(id)
    }
}
