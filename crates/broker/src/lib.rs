//! warren-broker: Warren's broker core.
//!
//! Virtual hosts, exchanges, bindings, routing and queues, as plain deterministic Rust: no
//! tokio, no sockets, no clock reads (time comes in as `now_ms`). `crates/session` calls the
//! [`Broker`] API; `crates/server` is the only driver.
//!
//! Behaviour (reply codes and texts) follows RabbitMQ 3.10: see `shared/reference` and the
//! tests beside each module.
//!
//! # Driving it
//!
//! - Declarations, bindings, publish, consume, get: plain calls returning `AmqpError`s with
//!   RabbitMQ's reply texts.
//! - Every change to a queue is a [`machine::Command`] applied to its
//!   [`machine::QueueMachine`] (a pure function, like RabbitMQ's `rabbit_fifo`), with the
//!   queue's next log index and the broker's time. [`Broker::set_recording`] keeps every
//!   command so that [`queue::log::replay`] can check a replay rebuilds the same queues.
//! - Deliveries: while [`Broker::needs_dispatch`], call [`Broker::dispatch_one`]; each call
//!   runs one bounded checkout on one queue. Consumers' prefetch lives in the machine;
//!   channel-wide credit (global prefetch, a backed-up socket) is set with
//!   [`Broker::set_credit`].
//! - Settlement: [`Broker::settle`] (ack), [`Broker::requeue`] (nack/reject with requeue,
//!   channel closed), [`Broker::discard`] (without requeue), with the delivery's
//!   [`machine::Receipt`]; a stale receipt changes nothing.
//! - Teardown: [`Broker::cancel`] for consumers, [`Broker::connection_closed`] for exclusive
//!   queues.
//! - Time: [`Broker::tick`] at [`Broker::next_deadline`].

pub mod access;
mod broker;
pub mod dead_letter;
pub mod dedup;
pub mod delayed;
mod erl;
pub mod exchange;
pub mod holds;
pub mod limits;
pub mod names;
pub mod parameters;
mod pattern;
pub mod persist;
pub mod policy;
pub mod queue;
pub mod replica;
mod small;
pub mod stats;
pub mod vhost_meta;

pub use broker::snapshot::{
    BindingSnapshot, BrokerTotals, ConsumerSnapshot, ExchangeSnapshot, QueueSnapshot,
};
pub use broker::{
    group_of, voters_in, AwayContext, Broker, ChangeAnswer, ConsumerTimeout, DeclareAnswer,
    DecodedSnapshot, ForgetError, GetAnswer, Got, GroupChange, MemberError, MetaClosed, Proposal,
    QueueInfo, Reconciliation, ReplicaSnapshot, SnapshotData, SnapshotDataError, SnapshotLimits,
    CHANGE_WAIT_MS, DECLARE_WAIT_MS, FEATURE_LEVEL, GET_WAIT_MS, META_APPLIED, META_GROUP,
    NODE_DOWN_MS, REPLICATED_MAX_BODY, SNAPSHOT_ENTRIES, SNAPSHOT_INTERVAL_MS,
};
pub use delayed::{DelayKey, Delayed, Holder, ReadRequest};
pub use exchange::ExchangeKind;
pub use persist::{
    BindingDef, BindingDest, ExchangeDef, Page, PageSource, QueueDef, StoreKeys, StoreOp,
    WriteBatch, SPILL_BIT,
};
pub use queue::args::{DeadLetterStrategy, Overflow, QueueArgs, QueueMode, QueueType};
pub use queue::machine;
pub use queue::machine::{ConsumerId, Credit, CreditGroup, Receipt};
pub use vhost_meta::{VhostMeta, VhostMetaChange};
pub use warren_queue::{
    qualify, Away, AwayError, AwayStore, AwayStoreHandle, ConnId, Message, Payload, COMPACT_BELOW,
    REDELIVERED_HEADER,
};
pub use warren_replication::{Committed, GroupId};

use warren_codec::{FieldTable, ShortStr};

/// Identifies a consumer: its connection, channel and consumer tag.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConsumerKey {
    pub conn: ConnId,
    pub channel: u16,
    pub tag: ShortStr,
}

/// Identifies a queue, unique for the broker's life: a redeclared queue gets a new id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct QueueId(pub u64);

/// A message handed to a consumer or to basic.get.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Delivery {
    pub queue: QueueId,
    pub queue_name: ShortStr,
    /// Pass it back to settle / requeue / discard; `receipt.attempt` is how many times the
    /// message has now been delivered, this delivery included (`x-delivery-count`).
    pub receipt: Receipt,
    pub message: Message,
    pub redelivered: bool,
    /// The queue already forgot the message (a no-ack consumer or basic.get with no-ack).
    pub settled: bool,
    /// The consumer, its channel and its tag; `None` for basic.get.
    pub consumer: Option<(ConsumerId, CreditGroup, ShortStr)>,
    /// It may time out (visibility or consumer timeout): the session indexes it by receipt.
    pub timed: bool,
}

/// Limits and knobs of a broker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BrokerConfig {
    /// The virtual host created at start ("/").
    pub default_vhost: String,
    /// Most queues in one vhost (RabbitMQ: vhost `max-queues`); `None` = unlimited.
    pub max_queues: Option<usize>,
    /// Most consumers on one queue; `None` = unlimited. RabbitMQ has no such limit (its
    /// `consumer_max_per_channel` is the session's); this one bounds a queue's consumer list
    /// whatever the number of channels.
    pub consumer_max_per_queue: Option<usize>,
    /// Largest accepted message body in bytes (RabbitMQ's `max_message_size`, 128 MiB).
    pub max_message_size: usize,
    /// Seed for server-named queue names. Deterministic for tests; the server should seed it
    /// from OS randomness so names differ across restarts.
    pub name_seed: u64,
    /// Most deliveries one queue makes in one [`Broker::dispatch_one`] call; a queue with more
    /// work stays dirty ([`Broker::needs_dispatch`]), so no call does unbounded work.
    pub dispatch_batch: usize,
    /// Keep durable state on disk: the broker produces [`WriteBatch`]es
    /// ([`Broker::take_writes`]) and confirms of persistent messages wait for them.
    pub persistence: bool,
    /// A queue with consumers keeps this many ready messages in memory at its head (and
    /// at most `page_window_bytes` of bodies); stored messages past it leave memory once
    /// written and are read back ahead of the consumers (with a [`PageSource`]).
    pub page_window: u32,
    pub page_window_bytes: u64,
    /// The same for a queue without consumers: nothing reads it, so little is kept.
    pub page_window_idle: u32,
    /// The type of a new queue declared without `x-queue-type` that may have another type
    /// than classic (durable, not exclusive, not auto-delete): RabbitMQ's
    /// `default_queue_type`.
    pub default_queue_type: QueueType,
}

impl Default for BrokerConfig {
    fn default() -> Self {
        BrokerConfig {
            default_vhost: "/".to_string(),
            max_queues: None,
            consumer_max_per_queue: None,
            max_message_size: 128 * 1024 * 1024,
            name_seed: 0x5741_5252_454e_2121,
            dispatch_batch: 1024,
            persistence: false,
            page_window: 1024,
            page_window_bytes: 1 << 20,
            page_window_idle: 4,
            default_queue_type: QueueType::Classic,
        }
    }
}

/// A queue.declare request.
#[derive(Clone, Debug, PartialEq)]
pub struct DeclareQueue {
    /// "" = server-named (`amq.gen-` and 22 base64url characters, like RabbitMQ).
    pub name: ShortStr,
    pub passive: bool,
    pub durable: bool,
    pub exclusive: bool,
    pub auto_delete: bool,
    pub arguments: FieldTable,
}

/// The answer to queue.declare.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QueueDeclared {
    pub queue: QueueId,
    pub name: ShortStr,
    /// Ready messages (not in flight).
    pub message_count: u32,
    pub consumer_count: u32,
}

/// The answer to queue.declare, or, for a quorum queue in a cluster, the ticket of the
/// answer to come once the metadata log made the queue
/// ([`Broker::take_declare_answers`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Declared {
    Now(QueueDeclared),
    Waiting(u64),
}

/// The answer to queue.delete.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct QueueDeleted {
    /// Ready messages the queue held.
    pub message_count: u32,
    /// Consumers to notify with basic.cancel.
    pub cancelled: Vec<ConsumerKey>,
}

/// The result of a publish.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Routed {
    /// Number of queues the message was enqueued on; 0 = unroutable (basic.return 312
    /// NO_ROUTE if mandatory).
    pub queues: u32,
    /// The message is being written to disk in this batch: its confirm waits for it.
    pub batch: Option<u64>,
    /// A target queue was full and refused it (`x-overflow` = `reject-publish` or
    /// `reject-publish-dlx`): the publisher's confirm is a nack. Such a queue counts as
    /// routed (no basic.return for a mandatory publish).
    pub rejected: bool,
    /// A target was a replicated queue with no leader to take its copy (counted in
    /// `rejected`): a copy worth sending again later.
    pub unled: bool,
    /// A full `reject-publish` queue refused its copy (counted in `rejected`; not a
    /// `reject-publish-dlx` one, which dead-letters the copy onward): a sender that keeps the
    /// message (a replicated queue's held dead letter) sends it again later, as RabbitMQ's
    /// `at-least-once` dead-lettering does.
    pub full: bool,
}
