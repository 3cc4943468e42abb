//! What the broker asks the store to write, as plain data.
//!
//! The broker is sans-IO: as commands change durable state it appends [`StoreOp`]s to a buffer,
//! and the server takes the buffer as numbered [`WriteBatch`]es (`Broker::take_writes`), writes
//! them (group commit: every batch waiting, one synced write) and reports the last batch
//! written. A publisher confirm that needs the disk waits for the number of the batch that holds
//! its message (`Broker::pending_batch`). Ops are applied in order, so a delete always follows
//! the put it undoes. The schema is in docs/design.md ("Storage").

use std::collections::HashMap;

use warren_codec::{FieldTable, ShortStr};

use crate::access::{PermissionDef, TopicPermissionDef, UserDef};
use crate::delayed::{DelayKey, Delayed, ReadRequest};
use crate::exchange::ExchangeKind;
use crate::limits::{LimitScope, Limits};
use crate::queue::machine::{LoadRequest, Loaded};
use crate::Message;

/// Where a stored binding leads (by name: ids do not outlive the process).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum BindingDest {
    Queue(ShortStr),
    Exchange(ShortStr),
}

/// A durable binding: both ends are durable.
#[derive(Clone, Debug, PartialEq)]
pub struct BindingDef {
    pub vhost: String,
    pub source: ShortStr,
    pub dest: BindingDest,
    pub routing_key: ShortStr,
    pub arguments: FieldTable,
}

/// A durable exchange's declaration.
#[derive(Clone, Debug, PartialEq)]
pub struct ExchangeDef {
    pub vhost: String,
    pub name: ShortStr,
    /// How it routes (for an `x-delayed-message` exchange, its `x-delayed-type`).
    pub kind: ExchangeKind,
    /// An `x-delayed-message` exchange.
    pub delayed: bool,
    /// A delayed exchange's incarnation number (see `Exchange::incarnation`); `None` in
    /// declarations stored before it was kept.
    pub incarnation: Option<u64>,
    pub auto_delete: bool,
    pub internal: bool,
    pub arguments: FieldTable,
}

/// A durable queue's declaration and the key its messages are stored under.
#[derive(Clone, Debug, PartialEq)]
pub struct QueueDef {
    pub vhost: String,
    pub name: ShortStr,
    pub key: u64,
    pub auto_delete: bool,
    pub arguments: FieldTable,
    /// A replicated queue's Raft group when the metadata log numbered it (a queue declared
    /// again after a deletion is another group); `None`: the number its name gives.
    pub group: Option<u64>,
    /// A replicated queue's own voters, when they are only some of the cluster's nodes
    /// (`x-quorum-initial-group-size`); `None`: every node votes.
    pub voters: Option<Vec<u64>>,
}

/// One change to durable state.
#[derive(Clone, Debug, PartialEq)]
pub enum StoreOp {
    PutExchange(ExchangeDef),
    DeleteExchange {
        vhost: String,
        name: ShortStr,
    },
    PutQueue(QueueDef),
    /// The declaration and every message entry of the queue (its bodies are released one by
    /// one with [`StoreOp::DeleteBody`]).
    DeleteQueue {
        vhost: String,
        name: ShortStr,
        key: u64,
    },
    PutBinding(BindingDef),
    DeleteBinding(BindingDef),
    /// A message's exchange, routing key, properties and body, once per publish.
    PutBody {
        key: u64,
        message: Message,
        /// How many durable queues it was routed to.
        queues: u32,
    },
    /// The last queue holding the body let it go.
    DeleteBody {
        key: u64,
    },
    /// A message in a queue: its id there, its body (of `size` bytes; `shared` by other
    /// queues), its expiry.
    PutEntry {
        queue: u64,
        msg_id: u64,
        body: u64,
        size: u64,
        shared: bool,
        expires_at: Option<u64>,
    },
    /// Purge or delete of a paged run: every entry of the queue with an id in
    /// `first_id..=last_id`, their delivery counts and their bodies (never shared: only
    /// messages stored for one queue are paged).
    DropRun {
        queue: u64,
        first_id: u64,
        last_id: u64,
    },
    /// Every entry and count of a queue key (a queue's scratch entries when it goes).
    DeleteEntries {
        queue: u64,
    },
    /// The message left the queue; `count` when a delivery count was stored for it.
    DeleteEntry {
        queue: u64,
        msg_id: u64,
        count: bool,
    },
    /// The message came back (nack, requeue, channel closed) after this many deliveries;
    /// `retry_at`: it waits for a delayed retry due then.
    PutCount {
        queue: u64,
        msg_id: u64,
        count: u32,
        retry_at: Option<u64>,
    },
    /// A message held back until `key.due` (a delayed exchange's, or a queue's
    /// `x-delivery-delay`).
    PutDelayed {
        key: DelayKey,
        delayed: Delayed,
    },
    /// The scheduled message was released (or dropped).
    DeleteDelayed {
        key: DelayKey,
    },
    /// Keys below these are (or may have been) used: after a restart, new keys start here, so
    /// no key is ever written twice (`SingleDelete` relies on it).
    ReserveKeys(StoreKeys),
    /// A vhost made (or kept) by the management API or definitions; its exchanges and queues
    /// have their own ops.
    PutVhost {
        name: String,
        meta: crate::vhost_meta::VhostMeta,
    },
    DeleteVhost {
        name: String,
    },
    PutUser(UserDef),
    DeleteUser {
        name: String,
    },
    PutPermission(PermissionDef),
    DeletePermission {
        user: String,
        vhost: String,
    },
    PutTopicPermission(TopicPermissionDef),
    DeleteTopicPermission {
        user: String,
        vhost: String,
        exchange: String,
    },
    /// The limits of a vhost or a user, all of them at once; empty limits delete the record.
    PutLimits {
        scope: LimitScope,
        name: String,
        limits: Limits,
    },
    /// A user or operator policy, set or replaced.
    PutPolicy(crate::policy::PolicyDef),
    DeletePolicy {
        vhost: String,
        kind: crate::policy::PolicyKind,
        name: String,
    },
    /// A cluster node's place in the metadata group's log: the definitions in the store hold
    /// the changes of every entry up to `index`; `seen` is the highest change number applied
    /// per node (a copy of a change sent twice is applied once).
    PutMetaApplied {
        index: u64,
        seen: Vec<(u64, u64)>,
        /// The feature level each node announced in the log (see `FEATURE_LEVEL`).
        levels: Vec<(u64, u64)>,
        /// The cluster's nodes once the log added or forgot one (`None`: the list the node
        /// starts with), each with its cluster address (empty: the one that list gives).
        members: Option<Vec<(u64, String)>>,
        /// The numbers of the nodes the cluster forgot.
        forgotten: Vec<u64>,
    },
    /// A definition change a cluster node made, until the metadata group's log has applied
    /// it (`data`: the change as an entry of its own): sent again after a restart.
    PutMetaPending {
        number: u64,
        data: Vec<u8>,
    },
    /// The metadata group's log applied the change: it is no longer sent again.
    DeleteMetaPending {
        number: u64,
    },
    /// An SQS access key of a user, made or replaced.
    PutAccessKey(crate::access::AccessKeyDef),
    DeleteAccessKey {
        id: String,
    },
    /// A runtime parameter (a dynamic shovel), set or replaced.
    PutParameter(crate::parameters::ParameterDef),
    DeleteParameter {
        component: String,
        vhost: String,
        name: String,
    },
}

/// Reads paged-out messages back (the server gives the broker one over the store). Called
/// on the broker's thread: a page is a bounded read of one queue's entries and their bodies.
/// It only ever asks for messages whose write was reported done.
pub trait PageSource: Send {
    /// The stored messages of queue `queue_key` with ids in `request.from_id..=to_id`, in id
    /// order, stopping after `max_messages` or once `max_bytes` of bodies are read.
    fn read(
        &mut self,
        queue_key: u64,
        request: LoadRequest,
        max_messages: usize,
        max_bytes: u64,
    ) -> Result<Page, String>;

    /// Scheduled messages with keys from `request.from` on and below `request.until` (if
    /// given), in key order, stopping after `max_messages` or once `max_bytes` are read; the
    /// flag says a limit stopped the read (more may follow). Entries that cannot be read as
    /// messages are skipped with a warning.
    fn read_delayed(
        &mut self,
        request: ReadRequest,
    ) -> Result<(Vec<(DelayKey, Delayed)>, bool), String>;
}

/// What a [`PageSource`] read.
#[derive(Clone, Debug, PartialEq)]
pub struct Page {
    pub messages: Vec<Loaded<Message>>,
    /// The last id the read covered (`to_id` when it reached the end of the range).
    pub through_id: u64,
    /// Ids within the range whose entries could not be read back as messages (the body is
    /// missing or damaged): the broker deletes those entries.
    pub unreadable: Vec<u64>,
}

/// The ops made since the last [`crate::Broker::take_writes`], under one number.
#[derive(Clone, Debug, PartialEq)]
pub struct WriteBatch {
    /// Batches are numbered 1, 2, 3... in the order they must be applied.
    pub number: u64,
    pub ops: Vec<StoreOp>,
    /// Something here waits for the disk (a message put, a declaration): fsync the write.
    /// Deletes alone may ride on the next synced write.
    pub sync: bool,
}

/// The broker's write buffer and store bookkeeping.
#[derive(Debug)]
pub(crate) struct Persist {
    pub ops: Vec<StoreOp>,
    pub sync: bool,
    /// The number the buffered ops get when taken.
    pub next_batch: u64,
    pub next_body_key: u64,
    pub next_queue_key: u64,
    /// The next scratch-area key (queue or body); starts again with every start.
    pub next_spill_key: u64,
    /// Bodies stored for more than one durable queue: how many still hold each. A body held by
    /// one queue has no entry (the common case costs no bookkeeping).
    pub shared: HashMap<u64, u32>,
    /// The key reservations last written.
    pub reserved: StoreKeys,
    /// Hand the next batch over even with no ops: confirms wait for its number (a replicated
    /// queue's entries are written by its group's log, not here).
    pub force: bool,
}

/// Body keys are reserved on disk this many at a time: one small write per block of publishes.
const RESERVE_BODIES: u64 = 1 << 16;

/// Keys with this bit (queue keys and body keys alike) are in the scratch area: transient
/// messages of deep queues, kept on disk only to leave memory, and dropped at every start.
pub const SPILL_BIT: u64 = 1 << 63;

impl Persist {
    pub fn new() -> Self {
        Persist {
            ops: Vec::new(),
            sync: false,
            next_batch: 1,
            next_body_key: 1,
            next_queue_key: 1,
            next_spill_key: SPILL_BIT | 1,
            shared: HashMap::new(),
            reserved: StoreKeys {
                next_queue_key: 1,
                next_body_key: 1,
            },
            force: false,
        }
    }

    /// A new queue's store key (reserved on disk with the queue's declaration).
    pub fn queue_key(&mut self) -> u64 {
        let key = self.next_queue_key;
        self.next_queue_key += 1;
        self.reserved.next_queue_key = self.next_queue_key;
        self.ops.push(StoreOp::ReserveKeys(self.reserved.clone()));
        key
    }

    /// A new scratch-area key (for a queue's spilled entries, or a spilled body).
    pub fn spill_key(&mut self) -> u64 {
        let key = self.next_spill_key;
        self.next_spill_key += 1;
        key
    }

    /// A new body key; every [`RESERVE_BODIES`] keys the reservation on disk moves on.
    pub fn body_key(&mut self) -> u64 {
        let key = self.next_body_key;
        self.next_body_key += 1;
        if key >= self.reserved.next_body_key {
            self.reserved.next_body_key = key.saturating_add(RESERVE_BODIES);
            self.ops.push(StoreOp::ReserveKeys(self.reserved.clone()));
        }
        key
    }

    pub fn push(&mut self, op: StoreOp, sync: bool) {
        self.ops.push(op);
        self.sync |= sync;
    }

    /// One queue no longer holds the body: delete it with the last one.
    pub fn release_body(&mut self, key: u64) {
        if let Some(n) = self.shared.get_mut(&key) {
            *n = n.saturating_sub(1);
            if *n > 0 {
                return;
            }
            self.shared.remove(&key);
        }
        self.ops.push(StoreOp::DeleteBody { key });
    }

    /// A stored message left a durable queue.
    pub fn forget(&mut self, queue: u64, msg_id: u64, body: u64, count: bool) {
        self.ops.push(StoreOp::DeleteEntry {
            queue,
            msg_id,
            count,
        });
        self.release_body(body);
    }

    pub fn take(&mut self) -> Option<WriteBatch> {
        if self.ops.is_empty() && !std::mem::take(&mut self.force) {
            return None;
        }
        self.force = false;
        let batch = WriteBatch {
            number: self.next_batch,
            ops: std::mem::take(&mut self.ops),
            sync: std::mem::take(&mut self.sync),
        };
        self.next_batch += 1;
        Some(batch)
    }
}

/// Where the broker's store counters stand after recovery.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoreKeys {
    /// Larger than every queue key on disk.
    pub next_queue_key: u64,
    /// Larger than every body key on disk.
    pub next_body_key: u64,
}
