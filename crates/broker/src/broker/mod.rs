//! The broker: vhosts, exchanges, bindings, queues, and the API the session calls.

mod away;
mod flows;
mod held_dead_letters;
mod metadata;
mod metadata_group;
mod metadata_ops;
mod metadata_snapshot;
mod parameters;
mod persistence;
mod policies;
mod publish;
mod queue_arguments;
mod queue_members;
mod reconcile;
mod remote_get;
mod replicated;
mod runtime;
pub mod snapshot;
mod users;

// The free helpers of each part, for the others.
pub use away::AwayContext;
use flows::*;
use metadata::*;
pub use metadata_group::{
    ChangeAnswer, DeclareAnswer, ForgetError, GroupChange, MetaClosed, CHANGE_WAIT_MS,
    DECLARE_WAIT_MS, FEATURE_LEVEL, META_APPLIED, META_GROUP,
};
use persistence::*;
use publish::*;
pub use queue_members::{voters_in, MemberError};
pub use reconcile::Reconciliation;
pub use remote_get::{GetAnswer, Got, GET_WAIT_MS};
use replicated::not_led_here;
pub use replicated::{
    group_of, DecodedSnapshot, Proposal, ReplicaSnapshot, SnapshotData, SnapshotDataError,
    SnapshotLimits, NODE_DOWN_MS, REPLICATED_MAX_BODY, SNAPSHOT_ENTRIES, SNAPSHOT_INTERVAL_MS,
};

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};

use warren_codec::{AmqpError, FieldTable, FieldValue, ShortStr};

use crate::dead_letter::{self, Death};
use crate::dedup::Verdict;
use crate::delayed::{self, DelayKey, Delayed, Holder, Scheduler};
use crate::erl::rs;
use crate::exchange::{headers, Dest, Exchange, ExchangeKind, LazyHeaders};
use crate::names::NameGen;
use crate::persist::{
    BindingDef, BindingDest, ExchangeDef, PageSource, Persist, QueueDef, StoreKeys, StoreOp,
    WriteBatch,
};
use crate::policy::{PolicyKind, Target};
use crate::queue::args::{self, QueueType};
use crate::queue::log::{Record, STATE_DIGEST_EVERY};
use crate::queue::machine::{
    effects_digest, Command, ConsumerId, ConsumerSpec, Credit, CreditGroup, DeadLetterReason,
    Effect, Meta, MsgMeta, Policy, QueueMachine, Receipt, Refusal, Reply, RetryPolicy,
};
use crate::queue::Queue;
use crate::small::Small;
use crate::stats::Counted;
use crate::{
    BrokerConfig, ConnId, ConsumerKey, DeclareQueue, Declared, Delivery, Message, QueueDeclared,
    QueueDeleted, QueueId, Routed,
};

/// A snapshot of one queue's counters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QueueInfo {
    pub id: QueueId,
    pub name: ShortStr,
    pub vhost: String,
    /// Ready messages.
    pub message_count: u32,
    /// Messages delivered and not yet settled.
    pub in_flight: u32,
    pub consumer_count: u32,
    pub ready_bytes: u64,
    pub durable: bool,
    pub exclusive: bool,
    pub auto_delete: bool,
}

#[derive(Clone, Debug, Default)]
struct VHost {
    exchanges: HashMap<ShortStr, Exchange>,
    queues: HashMap<ShortStr, QueueId>,
    meta: crate::vhost_meta::VhostMeta,
}

/// The exchanges RabbitMQ 3.10 declares in every vhost (besides the default exchange "",
/// which is built in): name, type, internal.
const SYSTEM_EXCHANGES: [(&str, ExchangeKind, bool); 6] = [
    ("amq.direct", ExchangeKind::Direct, false),
    ("amq.fanout", ExchangeKind::Fanout, false),
    ("amq.topic", ExchangeKind::Topic, false),
    ("amq.headers", ExchangeKind::Headers, false),
    ("amq.match", ExchangeKind::Headers, false),
    ("amq.rabbitmq.trace", ExchangeKind::Topic, true),
];

const DEFAULT_EXCHANGE: &str = "operation not permitted on the default exchange";

/// The broker core. Single-threaded and deterministic: the server owns it and drives it.
#[derive(Debug)]
pub struct Broker {
    config: BrokerConfig,
    vhosts: HashMap<String, VHost>,
    /// Boxed: a table holding `Queue`s inline (680 bytes each) pays its spare capacity in
    /// whole queues; boxed, spare slots are pointers. An idle queue cost 1.32 KB inline and
    /// 0.9 KB boxed (`warren-bench --idle-queues 10000`, release build).
    queues: HashMap<QueueId, Box<Queue>>,
    next_queue: u64,
    /// The next consumer id (ids are never reused).
    next_consumer: u64,
    /// Exclusive queues by owning connection.
    exclusive: HashMap<ConnId, Vec<QueueId>>,
    /// Queues that may have work for dispatch (each at most once: `Queue::dirty`).
    dirty: VecDeque<QueueId>,
    names: NameGen,
    /// Reused routing buffers.
    scratch_dests: Vec<Dest>,
    scratch_queues: Vec<QueueId>,
    scratch_kinds: Vec<Kept>,
    /// The latest time seen (publish, tick).
    now_ms: u64,
    /// Queues with a deadline, by deadline (each queue once, under `Queue::scheduled`).
    deadlines: BTreeSet<(u64, QueueId)>,
    /// The effects of the command being applied (reused buffer).
    effects: Vec<Effect<Message>>,
    /// Every applied command, while recording is on (a debug option: see `queue::log`).
    recording: Option<Vec<Record>>,
    /// The write buffer for the store, with persistence on (set aside while recovery rebuilds
    /// what the store already holds).
    persist: Option<Persist>,
    /// Users and what each may do where.
    access: crate::access::Access,
    limits: crate::limits::LimitTable,
    policies: crate::policy::PolicyTable,
    /// Runtime parameters (dynamic shovels).
    parameters: crate::parameters::Parameters,
    /// Recovery is declaring what the store holds: names a client may not declare
    /// (`amq.gen-...` of server-named queues) and vhost limits are accepted.
    restoring: bool,
    /// A change applied from the metadata group (or kept to this node): not announced.
    meta_quiet: bool,
    /// The node the metadata entry being applied chose for a new queue's first leader.
    leader_hint: Option<u64>,
    /// The Raft group the metadata log (or the store) gives the queue being declared;
    /// `None`: its name's (`group_of`).
    group_hint: Option<u64>,
    /// The voters of its own the metadata log (or the store) gives the queue being declared
    /// (`x-quorum-initial-group-size`); `None`: every node votes.
    voters_hint: Option<Vec<u64>>,
    /// Reads paged messages back; without one, nothing is paged out.
    pager: Option<Pager>,
    /// Where deep replicated queues' messages go when they leave memory; without one, they
    /// stay.
    away: Option<away::AwayHandle>,
    /// Maintenance mode ([`Broker::set_draining`]).
    draining: bool,
    /// Memory is short: messages the store does not keep go to its scratch area when they
    /// reach a deep queue, so that they can leave memory too.
    spill: bool,
    /// The store is still bringing queues back: no timer runs (an expiry could release a
    /// body whose references are not all counted yet).
    recovering: bool,
    /// Stored messages that may be paged out once their batch is written: (batch, queue,
    /// message id), in batch order, one entry per queue and batch.
    page_pending: VecDeque<(u64, QueueId, u64)>,
    /// Messages on their way to a dead-letter exchange, republished in order by
    /// [`Broker::dead_letter_pending`] (a worklist: a dead letter that makes another queue
    /// drop its head does not recurse).
    dead_letters: VecDeque<DeadLetter>,
    /// `dead_letter_pending` is running.
    dead_lettering: bool,
    /// Dead letters of replicated queues' held messages, until they are safe.
    held_dead_letters: held_dead_letters::HeldDeadLetters,
    /// Queues a dead-letter cycle was reported for (logged once each).
    cycles_reported: HashSet<QueueId>,
    /// `tick` is running: deadlines are filed exactly.
    ticking: bool,
    /// Deliveries to consumers that timed out since the last [`Broker::take_timed_out`]: the
    /// session stops counting them against their channel's prefetch.
    timed_out: Vec<(QueueId, CreditGroup, Receipt)>,
    /// Consumers cancelled by their consumer timeout since the last
    /// [`Broker::take_consumer_timeouts`].
    consumer_timeouts: Vec<ConsumerTimeout>,
    /// Queues that may refuse a publish (`x-overflow` reject-publish with a length limit): while
    /// there are none, a publish does not look its targets up to ask.
    refusing_queues: usize,
    /// Queues with `x-delivery-delay`: while there are none, a publish does not look for one.
    delaying_queues: usize,
    /// Queues and exchanges with `x-message-deduplication` (the same: no look while none).
    dedup_queues: usize,
    /// An exchange with `x-message-deduplication` was declared (never reset: while none was,
    /// a publish does not look its exchange up twice).
    dedup_exchanges: bool,
    /// How far the store got, for deduplication: a duplicate's confirm waits for its first
    /// copy's write, and a failed write makes the key new again.
    disk: crate::dedup::Disk,
    /// Messages held back until they are due (delayed exchanges, queues' delivery delays).
    scheduler: Scheduler,
    /// The last incarnation number given out without a store (with one, they are body keys).
    last_incarnation: u64,
    /// A delayed message is being released: how many times a full queue refused it before.
    releasing: Option<u32>,
    /// Node-wide message counters (for operators).
    counters: crate::stats::BrokerCounters,
    /// This node's part in a cluster (replicated queues), once it joined one.
    cluster: Option<Box<replicated::Cluster>>,
}

/// A message that left a queue with a dead-letter exchange, with what its `x-death` needs.
#[derive(Debug)]
struct DeadLetter {
    vhost: String,
    queue: ShortStr,
    exchange: String,
    routing_key: Option<String>,
    message: Message,
    reason: DeadLetterReason,
    /// A replicated queue's held message (its queue and id): settled there once this dead
    /// letter is safe in its targets.
    source: Option<(QueueId, u64)>,
}

/// A consumer cancelled because it left a delivery unsettled past its consumer timeout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConsumerTimeout {
    pub queue: QueueId,
    pub consumer: ConsumerId,
    pub group: CreditGroup,
    pub tag: ShortStr,
    pub timeout_ms: u64,
}

/// What a queue's declaration asks of its machine.
fn policy(a: &args::QueueArgs) -> Policy {
    Policy {
        max_length: a.max_length,
        max_length_bytes: a.max_length_bytes,
        overflow: a.overflow,
        expires_ms: a.expires_ms,
        max_priority: a.max_priority,
        single_active: a.single_active_consumer,
        delivery_limit: a.effective_delivery_limit(),
        visibility_timeout_ms: a.visibility_timeout_ms,
        consumer_timeout_ms: a.consumer_timeout_ms,
        retry: a
            .retry_min_ms
            .filter(|_| a.retries())
            .map(|min_ms| RetryPolicy {
                min_ms,
                max_ms: a.retry_max_ms,
                multiplier: a.retry_multiplier,
                jitter_pct: a.retry_jitter_pct,
            }),
        // Classic queues are dispatched by the broker's Checkout passes.
        deliver_on_apply: false,
        hold_dead_letters: false,
        index_groups: false,
    }
}

/// May a queue with this policy refuse a publish?
fn refuses(p: &Policy) -> bool {
    p.overflow != args::Overflow::DropHead && p.limits_length()
}

/// The exchange type the delayed-message plugin registers.
const DELAYED_TYPE: &str = "x-delayed-message";

fn short(s: &str) -> ShortStr {
    ShortStr::from_string(s.to_owned())
}

fn no_vhost(vhost: &str) -> AmqpError {
    AmqpError::not_allowed(format!("vhost {vhost} not found"))
}

fn no_queue(name: &str, vhost: &str) -> AmqpError {
    AmqpError::not_found(format!("no {}", rs("queue", name, vhost)))
}

fn no_exchange(name: &str, vhost: &str) -> AmqpError {
    AmqpError::not_found(format!("no {}", rs("exchange", name, vhost)))
}

/// Puts a queue on the dirty list if a checkout would deliver something, or its consumers
/// wait for paged messages to be read back (`low_water`: read ahead below this many).
fn mark_dirty(dirty: &mut VecDeque<QueueId>, q: &mut Queue, low_water: usize, now_ms: u64) {
    if q.dirty {
        return;
    }
    let load = || q.load_retry_at.is_none_or(|t| now_ms >= t) && q.machine.wants_load(low_water);
    if q.machine.has_work() || load() {
        q.dirty = true;
        dirty.push_back(q.id);
    }
}

/// The broker's [`PageSource`] (a wrapper, so the broker stays `Debug`).
struct Pager(Box<dyn PageSource>);

impl std::fmt::Debug for Pager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Pager")
    }
}

/// Where a queue keeps its copy of a message being published.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kept {
    Memory,
    Durable,
    Spilled,
}

/// Most pages [`Broker::tick`] reads back in one call to expire what is on disk.
const EXPIRY_READS_PER_TICK: u32 = 16;
/// Most delayed messages one tick releases (a backlog keeps the deadline at now, so the rest
/// follow on the next tick without holding the node for long).
const RELEASES_PER_TICK: usize = 4096;

/// How long a queue waits before reading its paged messages again after a failed read.
const LOAD_RETRY_MS: u64 = 1000;

impl Broker {
    /// A broker with the default vhost and RabbitMQ's pre-declared exchanges.
    pub fn new(config: BrokerConfig) -> Self {
        let mut b = Broker {
            names: NameGen::new(config.name_seed),
            config,
            vhosts: HashMap::new(),
            queues: HashMap::new(),
            next_queue: 1,
            next_consumer: 1,
            exclusive: HashMap::new(),
            dirty: VecDeque::new(),
            scratch_dests: Vec::new(),
            scratch_queues: Vec::new(),
            scratch_kinds: Vec::new(),
            now_ms: 0,
            deadlines: BTreeSet::new(),
            effects: Vec::new(),
            recording: None,
            persist: None,
            restoring: false,
            meta_quiet: false,
            leader_hint: None,
            group_hint: None,
            voters_hint: None,
            access: crate::access::Access::default(),
            limits: crate::limits::LimitTable::default(),
            policies: crate::policy::PolicyTable::default(),
            parameters: crate::parameters::Parameters::default(),
            pager: None,
            away: None,
            draining: false,
            spill: false,
            recovering: false,
            page_pending: VecDeque::new(),
            dead_letters: VecDeque::new(),
            dead_lettering: false,
            held_dead_letters: Default::default(),
            cycles_reported: HashSet::new(),
            ticking: false,
            timed_out: Vec::new(),
            consumer_timeouts: Vec::new(),
            refusing_queues: 0,
            delaying_queues: 0,
            dedup_queues: 0,
            dedup_exchanges: false,
            disk: crate::dedup::Disk::default(),
            scheduler: Scheduler::default(),
            last_incarnation: 0,
            releasing: None,
            counters: Default::default(),
            cluster: None,
        };
        if b.config.persistence {
            b.persist = Some(Persist::new());
        }
        let default = b.config.default_vhost.clone();
        b.add_vhost(&default);
        if let Some(vh) = b.vhosts.get_mut(&default) {
            // RabbitMQ's description of the vhost it makes at its first start.
            vh.meta.description = "Default virtual host".to_owned();
        }
        b
    }

    pub fn config(&self) -> &BrokerConfig {
        &self.config
    }
}
