//! The broker: vhosts, exchanges, bindings, queues, and the API the session calls.

pub mod snapshot;
mod users;

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
    BrokerConfig, ConnId, ConsumerKey, DeclareQueue, Delivery, Message, QueueDeclared,
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
    /// Recovery is declaring what the store holds: names a client may not declare
    /// (`amq.gen-...` of server-named queues) and vhost limits are accepted.
    restoring: bool,
    /// Reads paged messages back; without one, nothing is paged out.
    pager: Option<Pager>,
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
    }
}

/// May a queue with this policy refuse a publish?
fn refuses(p: &Policy) -> bool {
    p.overflow != args::Overflow::DropHead && p.limits_length()
}

/// A message's own TTL (the `expiration` property, validated by the session), in ms.
fn message_ttl(message: &Message) -> Option<u64> {
    warren_codec::properties::expiration(&message.properties)?
        .parse()
        .ok()
}

/// When a message enqueued `now` expires in this queue: the shorter of the queue's TTL and
/// the message's own.
fn expiry(q: &Queue, own_ttl: Option<u64>, now: u64) -> Option<u64> {
    let ttl = match (q.args.message_ttl_ms, own_ttl) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    ttl.map(|t| now.saturating_add(t))
}

/// A message's priority in this queue (`x-max-priority`): its `priority` property, capped. In
/// a queue with message groups, none: a group's order is its publish order.
fn priority(q: &Queue, message: &Message) -> u8 {
    if q.args.group_header.is_some() {
        return 0;
    }
    match q.args.max_priority {
        Some(max) => warren_codec::properties::priority(&message.properties)
            .unwrap_or(0)
            .min(max),
        None => 0,
    }
}

/// A message's group in a queue with `x-group-header`: a hash of the value of the header it
/// names (a string, or an integer read as its decimal digits); `None` without that header
/// (the message is in no group and goes out as in any queue).
fn message_group(q: &Queue, message: &Message) -> Option<crate::machine::GroupKey> {
    use warren_queue::stable_hash::hash_bytes;
    let name = q.args.group_header.as_deref()?;
    let headers = warren_codec::properties::headers(&message.properties)
        .ok()
        .flatten()?;
    // The same value on every node and build (a replica or a restarted node derives the same
    // key); recovery recomputes keys from the stored headers, so older keys never mix in.
    let h = match headers.get(name)? {
        FieldValue::LongStr(b) | FieldValue::ByteArray(b) => hash_bytes(b),
        v => hash_bytes(v.as_i64()?.to_string().as_bytes()),
    };
    // A hash of 0 (one in 2^64) shares group 1.
    crate::machine::GroupKey::new(h).or(crate::machine::GroupKey::new(1))
}

/// The dead letter of a message leaving `q`, if `q` has a dead-letter exchange (else the
/// message is dropped, as in RabbitMQ).
fn dead_letter_of(q: &Queue, message: Message, reason: DeadLetterReason) -> Option<DeadLetter> {
    let exchange = q.args.dead_letter_exchange.clone()?;
    Some(DeadLetter {
        vhost: q.vhost.clone(),
        queue: q.name.clone(),
        exchange,
        routing_key: q.args.dead_letter_routing_key.clone(),
        message,
        reason,
    })
}

/// May this queue's copy of a message leave memory? ([`args::QueueArgs::pages`])
fn may_page(q: &Queue) -> bool {
    q.args.pages()
}

/// The exchange type the delayed-message plugin registers.
const DELAYED_TYPE: &str = "x-delayed-message";

/// An exchange.declare `type` (and, for `x-delayed-message`, its `x-delayed-type` argument):
/// how the exchange routes, and whether it delays. The plugin's replies.
fn exchange_type(kind: &str, arguments: &FieldTable) -> Result<(ExchangeKind, bool), AmqpError> {
    let unknown =
        |kind: &str| AmqpError::command_invalid(format!("unknown exchange type '{kind}'"));
    if kind != DELAYED_TYPE {
        return Ok((
            ExchangeKind::parse(kind).ok_or_else(|| unknown(kind))?,
            false,
        ));
    }
    match arguments.get("x-delayed-type").and_then(FieldValue::as_str) {
        Some(DELAYED_TYPE) => Err(AmqpError::precondition_failed(
            "Invalid argument, 'x-delayed-message' can't be used for 'x-delayed-type'",
        )),
        Some(inner) => Ok((
            ExchangeKind::parse(inner).ok_or_else(|| unknown(inner))?,
            true,
        )),
        None => Err(AmqpError::precondition_failed(
            "Invalid argument, 'x-delayed-type' must be an existing exchange type",
        )),
    }
}

/// The type an exchange was declared with.
fn type_name(kind: ExchangeKind, delayed: bool) -> &'static str {
    if delayed {
        DELAYED_TYPE
    } else {
        kind.as_str()
    }
}

/// RabbitMQ strips CR and LF from queue and exchange names.
fn strip_cr_lf(name: &str) -> Cow<'_, str> {
    if name.contains(['\r', '\n']) {
        Cow::Owned(name.chars().filter(|c| *c != '\r' && *c != '\n').collect())
    } else {
        Cow::Borrowed(name)
    }
}

fn short(s: &str) -> ShortStr {
    ShortStr::from_string(s.to_owned())
}

/// Recovery: stored arguments with a deduplication window over today's limits brought down
/// to them (said in the log), rather than a queue or exchange left unrecovered.
fn restorable(arguments: &FieldTable, kind: &str, name: &str, vhost: &str) -> Option<FieldTable> {
    let clamped = crate::dedup::clamped(arguments)?;
    tracing::warn!(
        kind,
        name,
        vhost,
        max_size = crate::dedup::MAX_SIZE,
        max_ttl_ms = crate::dedup::MAX_TTL_MS,
        "x-cache-size or x-cache-ttl is over the limit: recovered with the limit"
    );
    Some(clamped)
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

fn locked(q: &Queue) -> AmqpError {
    AmqpError::resource_locked(format!(
        "cannot obtain exclusive access to locked {}. It could be originally declared on \
         another connection or the exclusive property value does not match that of the \
         original declaration.",
        q.rs()
    ))
}

fn check_access(q: &Queue, conn: ConnId) -> Result<(), AmqpError> {
    if q.accessible_by(conn) {
        Ok(())
    } else {
        Err(locked(q))
    }
}

fn declared(q: &Queue) -> QueueDeclared {
    QueueDeclared {
        queue: q.id,
        name: q.name.clone(),
        message_count: q.ready_count(),
        consumer_count: q.consumer_count(),
    }
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

/// A purge or delete: the queue's paged runs leave the store (entries and bodies).
fn drop_runs(p: &mut Persist, q: &Queue) {
    for run in q.machine.runs() {
        let key = if run.spilled {
            q.spill_key
        } else {
            q.store_key
        };
        if let Some(queue) = key {
            let op = StoreOp::DropRun {
                queue,
                first_id: run.first_id,
                last_id: run.last_id,
            };
            p.push(op, false);
        }
    }
}

/// How many ready messages the queue keeps in memory at its head.
fn keep(config: &BrokerConfig, q: &Queue) -> u32 {
    if q.machine.consumer_count() > 0 {
        config.page_window
    } else {
        config.page_window_idle
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

/// The store's name for a binding's destination, if the binding is durable (both ends are).
fn durable_dest(
    vh: &VHost,
    queues: &HashMap<QueueId, Box<Queue>>,
    source_durable: bool,
    dest: &Dest,
) -> Option<BindingDest> {
    if !source_durable {
        return None;
    }
    match dest {
        Dest::Queue(id) => queues
            .get(id)
            .filter(|q| q.store_key.is_some())
            .map(|q| BindingDest::Queue(q.name.clone())),
        Dest::Exchange(name) => vh
            .exchanges
            .get(name)
            .filter(|x| x.durable)
            .map(|x| BindingDest::Exchange(x.name.clone())),
    }
}

fn binding_def(
    vhost: &str,
    source: &ShortStr,
    dest: BindingDest,
    key: &ShortStr,
    args: &FieldTable,
) -> BindingDef {
    BindingDef {
        vhost: vhost.to_owned(),
        source: source.clone(),
        dest,
        routing_key: key.clone(),
        arguments: args.clone(),
    }
}

/// Writes a binding change if the binding is durable.
#[allow(clippy::too_many_arguments)]
fn persist_binding(
    persist: Option<&mut Persist>,
    vhost: &str,
    vh: &VHost,
    queues: &HashMap<QueueId, Box<Queue>>,
    source: &ShortStr,
    dest: &Dest,
    key: &ShortStr,
    args: &FieldTable,
    present: bool,
) {
    let Some(p) = persist else { return };
    let source_durable = vh.exchanges.get(source).is_some_and(|x| x.durable);
    if let Some(d) = durable_dest(vh, queues, source_durable, dest) {
        let def = binding_def(vhost, source, d, key, args);
        if present {
            p.push(StoreOp::PutBinding(def), true);
        } else {
            p.push(StoreOp::DeleteBinding(def), false);
        }
    }
}

/// Removes an exchange and every binding it takes part in; source exchanges left without
/// bindings that are auto-delete go too (a worklist, so chains cannot recurse deeply).
fn remove_exchange(
    vhost: &str,
    vh: &mut VHost,
    queues: &mut HashMap<QueueId, Box<Queue>>,
    mut persist: Option<&mut Persist>,
    scheduler: &mut Scheduler,
    name: &str,
) {
    let mut work: Vec<ShortStr> = vec![short(name)];
    while let Some(name) = work.pop() {
        let Some(x) = vh.exchanges.remove(&name) else {
            continue;
        };
        if x.delayed {
            drop_held(scheduler, persist.as_deref_mut(), vhost, false, &name);
        }
        if let Some(p) = persist.as_deref_mut().filter(|_| x.durable) {
            for (dest, key, args) in x.bindings() {
                if let Some(d) = durable_dest(vh, queues, true, dest) {
                    p.push(
                        StoreOp::DeleteBinding(binding_def(vhost, &name, d, key, args)),
                        false,
                    );
                }
            }
            for (src, key, args) in &x.incoming {
                if vh.exchanges.get(src).is_some_and(|s| s.durable) {
                    let d = BindingDest::Exchange(name.clone());
                    p.push(
                        StoreOp::DeleteBinding(binding_def(vhost, src, d, key, args)),
                        false,
                    );
                }
            }
            p.push(
                StoreOp::DeleteExchange {
                    vhost: vhost.to_owned(),
                    name: name.clone(),
                },
                true,
            );
        }
        for (dest, key, args) in x.bindings() {
            match dest {
                Dest::Queue(id) => {
                    if let Some(q) = queues.get_mut(id) {
                        remove_one(&mut q.bindings, &name, key, args);
                    }
                }
                Dest::Exchange(d) => {
                    if let Some(dx) = vh.exchanges.get_mut(d) {
                        remove_one(&mut dx.incoming, &name, key, args);
                    }
                }
            }
        }
        let me = Dest::Exchange(name.clone());
        for (src, key, args) in &x.incoming {
            if let Some(sx) = vh.exchanges.get_mut(src) {
                sx.unbind(&me, key, args);
                if sx.auto_delete && sx.binding_count() == 0 {
                    work.push(src.clone());
                }
            }
        }
    }
}

/// A queue with `x-delivery-delay` (`queue`) or a delayed exchange is gone: so are the
/// messages it holds, from memory and from the store (what is on disk only goes when the
/// scheduler reads it back and finds its holder gone).
fn drop_held(
    scheduler: &mut Scheduler,
    persist: Option<&mut Persist>,
    vhost: &str,
    queue: bool,
    name: &str,
) {
    let keys = scheduler.drop_held(vhost, queue, name);
    if !keys.is_empty() {
        tracing::debug!(
            vhost,
            holder = name,
            queue,
            count = keys.len(),
            "held delayed messages dropped with their holder"
        );
    }
    if let Some(p) = persist {
        for key in keys {
            p.push(StoreOp::DeleteDelayed { key }, false);
        }
    }
}

/// Removes one `(exchange, key, args)` entry from a reverse binding index.
fn remove_one(
    list: &mut Vec<(ShortStr, ShortStr, FieldTable)>,
    x: &str,
    key: &str,
    args: &FieldTable,
) {
    if let Some(i) = list
        .iter()
        .position(|(e, k, a)| &**e == x && &**k == key && a == args)
    {
        list.swap_remove(i);
    }
}

/// Deletes `source` if it is auto-delete and has no bindings left.
fn maybe_auto_delete(
    vhost: &str,
    vh: &mut VHost,
    queues: &mut HashMap<QueueId, Box<Queue>>,
    persist: Option<&mut Persist>,
    scheduler: &mut Scheduler,
    source: &str,
) {
    if vh
        .exchanges
        .get(source)
        .is_some_and(|x| x.auto_delete && x.binding_count() == 0)
    {
        remove_exchange(vhost, vh, queues, persist, scheduler, source);
    }
}

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
            access: crate::access::Access::default(),
            limits: crate::limits::LimitTable::default(),
            pager: None,
            spill: false,
            recovering: false,
            page_pending: VecDeque::new(),
            dead_letters: VecDeque::new(),
            dead_lettering: false,
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
        };
        if b.config.persistence {
            b.persist = Some(Persist::new());
        }
        let default = b.config.default_vhost.clone();
        b.add_vhost(&default);
        b
    }

    pub fn config(&self) -> &BrokerConfig {
        &self.config
    }

    /// Creates a vhost with the system exchanges. False if it exists.
    pub fn add_vhost(&mut self, vhost: &str) -> bool {
        if self.vhosts.contains_key(vhost) {
            return false;
        }
        let mut vh = VHost::default();
        for (name, kind, internal) in SYSTEM_EXCHANGES {
            let name = ShortStr::from_static(name);
            vh.exchanges.insert(
                name.clone(),
                Exchange::new(name, kind, true, false, internal, FieldTable::new()),
            );
        }
        self.vhosts.insert(vhost.to_owned(), vh);
        true
    }

    pub fn vhost_exists(&self, vhost: &str) -> bool {
        self.vhosts.contains_key(vhost)
    }

    fn vhost(&self, vhost: &str) -> Result<&VHost, AmqpError> {
        self.vhosts.get(vhost).ok_or_else(|| no_vhost(vhost))
    }

    fn queue_by_name(&self, vhost: &str, name: &str) -> Result<&Queue, AmqpError> {
        let vh = self.vhost(vhost)?;
        vh.queues
            .get(name)
            .and_then(|id| self.queues.get(id).map(|q| &**q))
            .ok_or_else(|| no_queue(name, vhost))
    }

    pub fn queue_id(&self, vhost: &str, name: &str) -> Option<QueueId> {
        self.vhosts.get(vhost)?.queues.get(name).copied()
    }

    pub fn queue_info(&self, queue: QueueId) -> Option<QueueInfo> {
        let q = self.queues.get(&queue)?;
        Some(QueueInfo {
            id: q.id,
            name: q.name.clone(),
            vhost: q.vhost.clone(),
            message_count: q.ready_count(),
            in_flight: u32::try_from(q.machine.in_flight_count()).unwrap_or(u32::MAX),
            consumer_count: q.consumer_count(),
            ready_bytes: q.machine.ready_bytes(),
            durable: q.durable,
            exclusive: q.owner.is_some(),
            auto_delete: q.auto_delete,
        })
    }

    /// The parsed arguments of a queue (TTL, max-length, dead-lettering... for later use).
    pub fn queue_args(&self, queue: QueueId) -> Option<&args::QueueArgs> {
        self.queues.get(&queue).map(|q| &q.args)
    }

    /// Number of queues in all vhosts.
    pub fn queue_count(&self) -> usize {
        self.queues.len()
    }

    pub fn exchange_exists(&self, vhost: &str, name: &str) -> bool {
        name.is_empty()
            || self
                .vhosts
                .get(vhost)
                .is_some_and(|vh| vh.exchanges.contains_key(name))
    }

    /// Whether a publish to `exchange` would be accepted, with [`Broker::publish`]'s errors
    /// (404 no exchange, 403 internal exchange), without routing anything: a transaction
    /// checks each publish as it comes, as RabbitMQ does, and routes them at commit.
    pub fn check_publish(&self, vhost: &str, exchange: &str) -> Result<(), AmqpError> {
        let vh = self.vhosts.get(vhost).ok_or_else(|| no_vhost(vhost))?;
        if exchange.is_empty() {
            return Ok(());
        }
        match vh.exchanges.get(exchange) {
            None => Err(no_exchange(exchange, vhost)),
            Some(x) if x.internal => Err(AmqpError::access_refused(format!(
                "cannot publish to internal {}",
                rs("exchange", exchange, vhost)
            ))),
            Some(_) => Ok(()),
        }
    }

    /// A message its queue already handed out and forgot (no-ack) that could not be sent
    /// after all: back in `queue`, at its tail. Not a new publish: no dedup window, no delay.
    pub fn put_back(
        &mut self,
        vhost: &str,
        queue: &str,
        message: Message,
    ) -> Result<Routed, AmqpError> {
        let routed = self.publish_to(vhost, "", queue, message, None, true);
        self.dead_letter_pending();
        routed
    }

    // ---------------------------------------------------------------- queues

    pub fn declare_queue(
        &mut self,
        vhost: &str,
        req: DeclareQueue,
        conn: ConnId,
    ) -> Result<QueueDeclared, AmqpError> {
        self.declare_queue_as(vhost, req, conn, None)
    }

    /// queue.declare by a user whose permissions are checked where RabbitMQ checks them:
    /// configure on the queue (by its generated name for a server-named one), and for a new
    /// queue with a dead-letter exchange, read on the queue and write on that exchange.
    pub fn declare_queue_as(
        &mut self,
        vhost: &str,
        req: DeclareQueue,
        conn: ConnId,
        user: Option<&str>,
    ) -> Result<QueueDeclared, AmqpError> {
        use crate::access::{Perm, Resource};
        use crate::limits::{LimitScope, MAX_QUEUES};
        let stripped = strip_cr_lf(&req.name);
        if req.passive {
            let q = self.queue_by_name(vhost, &stripped)?;
            check_access(q, conn)?;
            let (id, out) = (q.id, declared(q));
            self.touch(id);
            return Ok(out);
        }
        let vh = self.vhosts.get(vhost).ok_or_else(|| no_vhost(vhost))?;
        let name = if stripped.is_empty() {
            loop {
                let n = self.names.generate("amq.gen");
                if !vh.queues.contains_key(n.as_str()) {
                    break ShortStr::from_string(n);
                }
            }
        } else if stripped.starts_with("amq.") && !self.restoring {
            return Err(AmqpError::access_refused(format!(
                "queue name '{stripped}' contains reserved prefix 'amq.*'"
            )));
        } else if let Cow::Owned(s) = stripped {
            ShortStr::from_string(s)
        } else {
            // Kept for the queue's life: not a slice of the client's read buffer.
            req.name.detached()
        };
        if let Some(u) = user {
            self.access
                .check(u, vhost, Perm::Configure, Resource::Queue(&name))?;
        }
        let owner = req.exclusive.then_some(conn);
        let durable = req.durable && !req.exclusive;
        let rs = rs("queue", &name, vhost);

        if let Some(q) = vh.queues.get(&name).and_then(|id| self.queues.get(id)) {
            // rabbit_amqqueue:assert_equivalence/5
            if q.owner != owner {
                return Err(locked(q));
            }
            args::assert_field_equivalence(q.durable, durable, &rs, "durable")?;
            args::assert_field_equivalence(q.auto_delete, req.auto_delete, &rs, "auto_delete")?;
            args::assert_args_equivalence(
                &q.arguments,
                &req.arguments,
                &rs,
                q.args.queue_type.equivalence_keys(),
            )?;
            let (id, out) = (q.id, declared(q));
            self.touch(id);
            return Ok(out);
        }

        // The node's default applies where a vhost sets no `max-queues` of its own.
        let max = self
            .limits
            .of(LimitScope::Vhost, vhost)
            .filter(|l| l.iter().any(|(n, _)| n == MAX_QUEUES))
            .map_or(self.config.max_queues.map(|m| m as u64), |l| {
                l.get(MAX_QUEUES)
            });
        if let Some(max) = max.filter(|_| !self.restoring) {
            if vh.queues.len() as u64 >= max {
                return Err(AmqpError::precondition_failed(format!(
                    "cannot declare queue '{name}': queue limit in vhost '{vhost}' ({max}) is reached"
                )));
            }
        }
        args::check_dlx_type(&req.arguments, &rs)?;
        if let (Some(u), Some(FieldValue::LongStr(dlx))) =
            (user, req.arguments.get("x-dead-letter-exchange"))
        {
            self.access
                .check(u, vhost, Perm::Read, Resource::Queue(&name))?;
            let dlx = String::from_utf8_lossy(dlx);
            self.access
                .check(u, vhost, Perm::Write, Resource::Exchange(&dlx))?;
        }
        let parsed = args::validate(&req.arguments, &rs)?;
        if matches!(parsed.queue_type, QueueType::Quorum | QueueType::Stream) {
            let bad = if req.auto_delete {
                Some("auto-delete")
            } else if owner.is_some() {
                Some("exclusive-owner")
            } else if !durable {
                Some("non-durable")
            } else {
                None
            };
            if let Some(prop) = bad {
                return Err(AmqpError::precondition_failed(format!(
                    "invalid property '{prop}' for {rs}"
                )));
            }
        }
        if parsed.queue_type == QueueType::Stream {
            // Refused in the words RabbitMQ uses for a queue type it does not know, rather than
            // declared as a queue that would not act like a stream (no offsets, no replay).
            return Err(AmqpError::precondition_failed(format!(
                "invalid arg 'x-queue-type' for {rs}: \"unsupported queue type 'stream'\""
            )));
        }

        let id = QueueId(self.next_queue);
        self.next_queue += 1;
        // A queue may hold delayed messages (its own delay, or a release it refused): one
        // without a store key needs a number to be told from the next queue of its name.
        let incarnation = if durable && self.persist.is_some() {
            0
        } else {
            self.incarnation()
        };
        let store_key = match self.persist.as_mut() {
            Some(p) if durable => {
                let key = p.queue_key();
                p.push(
                    StoreOp::PutQueue(QueueDef {
                        vhost: vhost.to_owned(),
                        name: name.clone(),
                        key,
                        auto_delete: req.auto_delete,
                        arguments: req.arguments.detached(),
                    }),
                    true,
                );
                Some(key)
            }
            _ => None,
        };
        let q = Queue {
            id,
            name: name.clone(),
            vhost: vhost.to_owned(),
            durable,
            auto_delete: req.auto_delete,
            owner,
            arguments: req.arguments.detached(),
            dedup: parsed
                .dedup
                .clone()
                .map(|s| Box::new(crate::dedup::Dedup::new(s))),
            args: parsed,
            machine: QueueMachine::new(),
            bindings: Vec::new(),
            dirty: false,
            scheduled: None,
            store_key,
            incarnation,
            load_retry_at: None,
            spill_key: None,
            stats: Box::default(),
        };
        let out = declared(&q);
        let policy = policy(&q.args);
        let delays = q.args.delivery_delay_ms.is_some();
        let dedups = q.dedup.is_some();
        if let Some(vh) = self.vhosts.get_mut(vhost) {
            vh.queues.insert(name, id);
        }
        if let Some(o) = owner {
            self.exclusive.entry(o).or_default().push(id);
        }
        self.queues.insert(id, Box::new(q));
        if refuses(&policy) {
            self.refusing_queues += 1;
        }
        if delays {
            self.delaying_queues += 1;
        }
        if dedups {
            self.dedup_queues += 1;
        }
        if !policy.is_plain() {
            self.run(id, Command::Configure(policy));
        }
        Ok(out)
    }

    /// A number no queue or exchange had, in this run or an earlier one: a body key with a
    /// store (reserved on disk like any), else a counter.
    fn incarnation(&mut self) -> u64 {
        match self.persist.as_mut() {
            Some(p) => p.body_key(),
            None => {
                self.last_incarnation += 1;
                self.last_incarnation
            }
        }
    }

    /// A declaration renews an `x-expires` lease (nothing to log for other queues).
    fn touch(&mut self, id: QueueId) {
        if self
            .queues
            .get(&id)
            .is_some_and(|q| q.args.expires_ms.is_some())
        {
            self.run(id, Command::Touch);
        }
    }

    pub fn delete_queue(
        &mut self,
        vhost: &str,
        name: &str,
        if_unused: bool,
        if_empty: bool,
        conn: ConnId,
    ) -> Result<QueueDeleted, AmqpError> {
        let name = strip_cr_lf(name);
        let Some(id) = self.vhost(vhost)?.queues.get(&*name).copied() else {
            // RabbitMQ answers delete-ok with 0 messages for a missing queue.
            return Ok(QueueDeleted::default());
        };
        let Some(q) = self.queues.get(&id) else {
            return Ok(QueueDeleted::default());
        };
        check_access(q, conn)?;
        if if_empty && q.machine.ready_count() > 0 {
            return Err(AmqpError::precondition_failed(format!(
                "{} not empty",
                q.rs()
            )));
        }
        if if_unused && q.machine.consumer_count() > 0 {
            return Err(AmqpError::precondition_failed(format!("{} in use", q.rs())));
        }
        Ok(self.remove_queue(id).unwrap_or_default())
    }

    /// Deletes a queue outright: its consumers (returned, to be told with basic.cancel), its
    /// bindings (and auto-delete exchanges left without bindings), its messages.
    fn remove_queue(&mut self, id: QueueId) -> Option<QueueDeleted> {
        let q = self.queues.remove(&id)?;
        self.cycles_reported.remove(&id);
        let refusing = refuses(&policy(&q.args));
        if refusing {
            self.refusing_queues = self.refusing_queues.saturating_sub(1);
        }
        if q.args.delivery_delay_ms.is_some() {
            self.delaying_queues = self.delaying_queues.saturating_sub(1);
        }
        // What it holds: its own delayed copies, and releases it refused when they fell due.
        if refusing || q.args.delivery_delay_ms.is_some() {
            drop_held(
                &mut self.scheduler,
                self.persist.as_mut(),
                &q.vhost,
                true,
                &q.name,
            );
        }
        if q.dedup.is_some() {
            self.dedup_queues = self.dedup_queues.saturating_sub(1);
        }
        if let Some(p) = self.persist.as_mut() {
            if let (Some(vh), true) = (self.vhosts.get(&q.vhost), q.store_key.is_some()) {
                for (x, rk, args) in &q.bindings {
                    if vh.exchanges.get(x).is_some_and(|x| x.durable) {
                        let d = BindingDest::Queue(q.name.clone());
                        let def = binding_def(&q.vhost, x, d, rk, args);
                        p.push(StoreOp::DeleteBinding(def), false);
                    }
                }
            }
            drop_runs(p, &q);
            if let Some(key) = q.store_key {
                let op = StoreOp::DeleteQueue {
                    vhost: q.vhost.clone(),
                    name: q.name.clone(),
                    key,
                };
                p.push(op, true);
            }
            if let Some(queue) = q.spill_key {
                p.push(StoreOp::DeleteEntries { queue }, false);
            }
            // Each copy on disk holds its body (a copy in memory only has no key).
            for (_, m, _) in q.machine.messages() {
                if let Some(body) = m.store_key {
                    p.release_body(body);
                }
            }
        }
        if let Some(vh) = self.vhosts.get_mut(&q.vhost) {
            if vh.queues.get(&q.name) == Some(&id) {
                vh.queues.remove(&q.name);
            }
            let dest = Dest::Queue(id);
            for (x, key, args) in &q.bindings {
                if let Some(ex) = vh.exchanges.get_mut(x) {
                    ex.unbind(&dest, key, args);
                }
                maybe_auto_delete(
                    &q.vhost,
                    vh,
                    &mut self.queues,
                    self.persist.as_mut(),
                    &mut self.scheduler,
                    x,
                );
            }
        }
        if let Some(owner) = q.owner {
            if let Some(list) = self.exclusive.get_mut(&owner) {
                list.retain(|x| *x != id);
                if list.is_empty() {
                    self.exclusive.remove(&owner);
                }
            }
        }
        if let Some(at) = q.scheduled {
            self.deadlines.remove(&(at, id));
        }
        let cancelled: Vec<ConsumerKey> = q
            .machine
            .consumers()
            .map(|(_, spec, _)| ConsumerKey {
                conn: spec.group.conn,
                channel: spec.group.channel,
                tag: spec.tag.clone(),
            })
            .collect();
        Some(QueueDeleted {
            message_count: u32::try_from(q.machine.ready_count()).unwrap_or(u32::MAX),
            cancelled,
        })
    }

    /// Removes the READY messages; in-flight ones stay. Returns how many were removed.
    pub fn purge_queue(&mut self, vhost: &str, name: &str, conn: ConnId) -> Result<u32, AmqpError> {
        let name = strip_cr_lf(name);
        let q = self.queue_by_name(vhost, &name)?;
        check_access(q, conn)?;
        let id = q.id;
        if let (Some(p), Some(q)) = (self.persist.as_mut(), self.queues.get(&id)) {
            for (msg_id, m, count) in q.machine.ready_messages() {
                if let (Some(key), Some(body)) = (q.entry_key(m), m.store_key) {
                    p.forget(key, msg_id, body, count > 0);
                }
            }
            drop_runs(p, q);
        }
        match self.run(id, Command::Purge) {
            Some(Reply::Purged { count }) => Ok(count),
            _ => Ok(0),
        }
    }

    // ------------------------------------------------------------- exchanges

    #[allow(clippy::too_many_arguments)]
    pub fn declare_exchange(
        &mut self,
        vhost: &str,
        name: &str,
        kind: &str,
        passive: bool,
        durable: bool,
        auto_delete: bool,
        internal: bool,
        arguments: &FieldTable,
    ) -> Result<(), AmqpError> {
        let name = strip_cr_lf(name);
        if passive {
            if name.is_empty() {
                return Err(AmqpError::access_refused(DEFAULT_EXCHANGE));
            }
            return if self.vhost(vhost)?.exchanges.contains_key(&*name) {
                Ok(())
            } else {
                Err(no_exchange(&name, vhost))
            };
        }
        let (kind, delayed) = exchange_type(kind, arguments)?;
        if name.is_empty() {
            return Err(AmqpError::access_refused(DEFAULT_EXCHANGE));
        }
        let rs = rs("exchange", &name, vhost);
        let vh = self.vhosts.get_mut(vhost).ok_or_else(|| no_vhost(vhost))?;
        let x = match vh.exchanges.get(&*name) {
            Some(x) => x,
            None => {
                if name.starts_with("amq.") {
                    return Err(AmqpError::access_refused(format!(
                        "exchange name '{name}' contains reserved prefix 'amq.*'"
                    )));
                }
                const AE: &str = "alternate-exchange";
                if let Some(v) = arguments.get(AE) {
                    if !matches!(v, FieldValue::LongStr(_)) {
                        return Err(AmqpError::precondition_failed(format!(
                            "invalid type '{}' for arg '{AE}' in {rs}",
                            v.type_name()
                        )));
                    }
                }
                let dedup = crate::dedup::spec(arguments)
                    .map_err(|e| AmqpError::precondition_failed(e.message(&rs)))?;
                let name = short(&name);
                let incarnation = delayed.then(|| match self.persist.as_mut() {
                    Some(p) => p.body_key(),
                    None => {
                        self.last_incarnation += 1;
                        self.last_incarnation
                    }
                });
                if let Some(p) = self.persist.as_mut().filter(|_| durable) {
                    p.push(
                        StoreOp::PutExchange(ExchangeDef {
                            vhost: vhost.to_owned(),
                            name: name.clone(),
                            kind,
                            delayed,
                            incarnation,
                            auto_delete,
                            internal,
                            arguments: arguments.detached(),
                        }),
                        true,
                    );
                }
                let mut x = Exchange::new(
                    name.clone(),
                    kind,
                    durable,
                    auto_delete,
                    internal,
                    arguments.detached(),
                );
                x.delayed = delayed;
                x.incarnation = incarnation;
                x.dedup = dedup.map(|s| Box::new(crate::dedup::Dedup::new(s)));
                self.dedup_exchanges |= x.dedup.is_some();
                vh.exchanges.insert(name.clone(), x);
                return Ok(());
            }
        };
        // rabbit_exchange:assert_equivalence/6
        if x.kind != kind || x.delayed != delayed {
            return Err(AmqpError::precondition_failed(format!(
                "inequivalent arg 'type' for {rs}: received '{}' but current is '{}'",
                type_name(kind, delayed),
                type_name(x.kind, x.delayed)
            )));
        }
        args::assert_field_equivalence(x.durable, durable, &rs, "durable")?;
        args::assert_field_equivalence(x.auto_delete, auto_delete, &rs, "auto_delete")?;
        args::assert_field_equivalence(x.internal, internal, &rs, "internal")?;
        args::assert_args_equivalence(&x.arguments, arguments, &rs, ["alternate-exchange"])
    }

    pub fn delete_exchange(
        &mut self,
        vhost: &str,
        name: &str,
        if_unused: bool,
    ) -> Result<(), AmqpError> {
        let name = strip_cr_lf(name);
        if name.is_empty() {
            return Err(AmqpError::access_refused(DEFAULT_EXCHANGE));
        }
        if name.starts_with("amq.") {
            return Err(AmqpError::access_refused(format!(
                "deletion of system {} not allowed",
                rs("exchange", &name, vhost)
            )));
        }
        let vh = self.vhosts.get_mut(vhost).ok_or_else(|| no_vhost(vhost))?;
        let Some(x) = vh.exchanges.get(&*name) else {
            // RabbitMQ answers delete-ok for a missing exchange.
            return Ok(());
        };
        if if_unused && x.binding_count() > 0 {
            return Err(AmqpError::precondition_failed(format!(
                "{} in use",
                rs("exchange", &name, vhost)
            )));
        }
        remove_exchange(
            vhost,
            vh,
            &mut self.queues,
            self.persist.as_mut(),
            &mut self.scheduler,
            &name,
        );
        Ok(())
    }

    // -------------------------------------------------------------- bindings

    #[allow(clippy::too_many_arguments)]
    pub fn bind_queue(
        &mut self,
        vhost: &str,
        queue: &str,
        exchange: &str,
        routing_key: &str,
        arguments: &FieldTable,
        conn: ConnId,
    ) -> Result<(), AmqpError> {
        let (queue, exchange) = (strip_cr_lf(queue), strip_cr_lf(exchange));
        if exchange.is_empty() {
            return Err(AmqpError::access_refused(DEFAULT_EXCHANGE));
        }
        let vh = self.vhosts.get_mut(vhost).ok_or_else(|| no_vhost(vhost))?;
        let Some(x) = vh.exchanges.get_mut(&*exchange) else {
            return Err(no_exchange(&exchange, vhost));
        };
        let Some(q) = vh
            .queues
            .get(&*queue)
            .and_then(|id| self.queues.get_mut(id))
        else {
            return Err(no_queue(&queue, vhost));
        };
        if x.kind == ExchangeKind::Headers {
            headers::validate(arguments)?;
        }
        check_access(q, conn)?;
        let key = short(routing_key);
        let arguments = arguments.detached();
        if x.bind(Dest::Queue(q.id), key.clone(), arguments.clone()) {
            q.bindings
                .push((x.name.clone(), key.clone(), arguments.clone()));
            if let (Some(p), true, true) = (self.persist.as_mut(), x.durable, q.store_key.is_some())
            {
                let d = BindingDest::Queue(q.name.clone());
                p.push(
                    StoreOp::PutBinding(binding_def(vhost, &x.name, d, &key, &arguments)),
                    true,
                );
            }
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    pub fn unbind_queue(
        &mut self,
        vhost: &str,
        queue: &str,
        exchange: &str,
        routing_key: &str,
        arguments: &FieldTable,
        conn: ConnId,
    ) -> Result<(), AmqpError> {
        let (queue, exchange) = (strip_cr_lf(queue), strip_cr_lf(exchange));
        if exchange.is_empty() {
            return Err(AmqpError::access_refused(DEFAULT_EXCHANGE));
        }
        let vh = self.vhosts.get_mut(vhost).ok_or_else(|| no_vhost(vhost))?;
        // RabbitMQ answers unbind-ok when the exchange, the queue or the binding is missing.
        let Some(x) = vh.exchanges.get_mut(&*exchange) else {
            return Ok(());
        };
        let Some(q) = vh
            .queues
            .get(&*queue)
            .and_then(|id| self.queues.get_mut(id))
        else {
            return Ok(());
        };
        let key = short(routing_key);
        let dest = Dest::Queue(q.id);
        if !x.has_binding(&dest, &key, arguments) {
            return Ok(());
        }
        check_access(q, conn)?;
        x.unbind(&dest, &key, arguments);
        remove_one(&mut q.bindings, &exchange, &key, arguments);
        if let (Some(p), true, true) = (self.persist.as_mut(), x.durable, q.store_key.is_some()) {
            let d = BindingDest::Queue(q.name.clone());
            p.push(
                StoreOp::DeleteBinding(binding_def(vhost, &x.name, d, &key, arguments)),
                false,
            );
        }
        maybe_auto_delete(
            vhost,
            vh,
            &mut self.queues,
            self.persist.as_mut(),
            &mut self.scheduler,
            &exchange,
        );
        Ok(())
    }

    pub fn bind_exchange(
        &mut self,
        vhost: &str,
        destination: &str,
        source: &str,
        routing_key: &str,
        arguments: &FieldTable,
    ) -> Result<(), AmqpError> {
        let (destination, source) = (strip_cr_lf(destination), strip_cr_lf(source));
        if destination.is_empty() || source.is_empty() {
            return Err(AmqpError::access_refused(DEFAULT_EXCHANGE));
        }
        let vh = self.vhosts.get_mut(vhost).ok_or_else(|| no_vhost(vhost))?;
        let Some(src) = vh.exchanges.get(&*source) else {
            return Err(no_exchange(&source, vhost));
        };
        let Some(dst) = vh.exchanges.get(&*destination) else {
            return Err(no_exchange(&destination, vhost));
        };
        if src.kind == ExchangeKind::Headers {
            headers::validate(arguments)?;
        }
        let (src_name, dst_name) = (src.name.clone(), dst.name.clone());
        let key = short(routing_key);
        let arguments = &arguments.detached();
        let added = vh.exchanges.get_mut(&src_name).is_some_and(|src| {
            src.bind(
                Dest::Exchange(dst_name.clone()),
                key.clone(),
                arguments.clone(),
            )
        });
        if added {
            persist_binding(
                self.persist.as_mut(),
                vhost,
                vh,
                &self.queues,
                &src_name,
                &Dest::Exchange(dst_name.clone()),
                &key,
                arguments,
                true,
            );
            if let Some(dst) = vh.exchanges.get_mut(&dst_name) {
                dst.incoming.push((src_name, key, arguments.clone()));
            }
        }
        Ok(())
    }

    pub fn unbind_exchange(
        &mut self,
        vhost: &str,
        destination: &str,
        source: &str,
        routing_key: &str,
        arguments: &FieldTable,
    ) -> Result<(), AmqpError> {
        let (destination, source) = (strip_cr_lf(destination), strip_cr_lf(source));
        if destination.is_empty() || source.is_empty() {
            return Err(AmqpError::access_refused(DEFAULT_EXCHANGE));
        }
        let vh = self.vhosts.get_mut(vhost).ok_or_else(|| no_vhost(vhost))?;
        let Some(dst_name) = vh.exchanges.get(&*destination).map(|x| x.name.clone()) else {
            return Ok(());
        };
        let key = short(routing_key);
        let removed = vh
            .exchanges
            .get_mut(&*source)
            .is_some_and(|src| src.unbind(&Dest::Exchange(dst_name.clone()), &key, arguments));
        if removed {
            persist_binding(
                self.persist.as_mut(),
                vhost,
                vh,
                &self.queues,
                &short(&source),
                &Dest::Exchange(dst_name.clone()),
                &key,
                arguments,
                false,
            );
            if let Some(dst) = vh.exchanges.get_mut(&dst_name) {
                remove_one(&mut dst.incoming, &source, &key, arguments);
            }
            maybe_auto_delete(
                vhost,
                vh,
                &mut self.queues,
                self.persist.as_mut(),
                &mut self.scheduler,
                &source,
            );
        }
        Ok(())
    }

    // -------------------------------------------------------------- publish

    /// Routes and enqueues. Errors: 404 no exchange, 403 internal exchange, 406 message too
    /// large.
    pub fn publish(
        &mut self,
        vhost: &str,
        exchange: &str,
        routing_key: &str,
        message: Message,
        now_ms: u64,
    ) -> Result<Routed, AmqpError> {
        self.now_ms = self.now_ms.max(now_ms);
        let routed = match self.exchange_verdict(vhost, exchange, &message) {
            Verdict::Duplicate { batch } => Ok(Routed {
                // Dropped, and confirmed as the first copy is (once it is on disk).
                queues: 1,
                batch,
                rejected: false,
            }),
            verdict => {
                let routed = self.publish_to(vhost, exchange, routing_key, message, None, false);
                if let (Verdict::New(pending), Ok(r)) = (verdict, &routed) {
                    // Remembered once a queue took it: a nacked or unroutable first copy
                    // leaves its retry new.
                    if r.queues > 0 && !r.rejected {
                        let now = self.now_ms;
                        if let Some(d) = self.exchange_dedup(vhost, exchange) {
                            d.remember(pending, r.batch, now);
                        }
                    }
                }
                routed
            }
        };
        self.counters.received += 1;
        if routed.as_ref().is_ok_and(|r| r.queues == 0) {
            self.counters.unroutable += 1;
        }
        self.dead_letter_pending();
        routed
    }

    /// The deduplication window of a publish's exchange, if it has one.
    fn exchange_dedup(&mut self, vhost: &str, exchange: &str) -> Option<&mut crate::dedup::Dedup> {
        if !self.dedup_exchanges || exchange.is_empty() {
            return None;
        }
        self.vhosts
            .get_mut(vhost)?
            .exchanges
            .get_mut(exchange)?
            .dedup
            .as_deref_mut()
    }

    /// What the exchange's deduplication window says of a new publish (a message too large is
    /// not judged: it is refused as any other).
    fn exchange_verdict(&mut self, vhost: &str, exchange: &str, message: &Message) -> Verdict {
        if message.body.len() > self.config.max_message_size {
            return Verdict::Unjudged;
        }
        let (now, disk) = (self.now_ms, self.disk);
        let Some(d) = self.exchange_dedup(vhost, exchange) else {
            return Verdict::Unjudged;
        };
        let headers = warren_codec::properties::headers(&message.properties)
            .ok()
            .flatten();
        d.judge(headers.as_ref(), &message.properties, now, disk)
    }

    /// Holds a message back `delay_ms` (on disk with a store), to be routed by its exchange
    /// (`queue` = `None`) or enqueued on `queue` when due. It counts as routed; a persistent
    /// one's confirm waits for its write.
    fn schedule(
        &mut self,
        vhost: &str,
        (queue, holder): (Option<ShortStr>, Holder),
        mut message: Message,
        delay_ms: u64,
        refused: u32,
    ) -> Routed {
        message.store_key = None;
        message.compact();
        let due = self.now_ms.saturating_add(delay_ms);
        let d = Delayed {
            vhost: vhost.to_owned(),
            queue,
            holder,
            refused,
            message,
        };
        let mut batch = None;
        match self.persist.as_mut() {
            Some(p) => {
                let key = DelayKey {
                    due,
                    seq: p.body_key(),
                };
                let number = p.next_batch;
                let sync = d.message.persistent;
                let op = StoreOp::PutDelayed {
                    key,
                    delayed: d.clone(),
                };
                p.push(op, sync);
                batch = sync.then_some(number);
                // Without a reader, what leaves memory could not come back: keep it all.
                let stored = self.pager.is_some().then_some(number);
                self.scheduler.schedule(key, d, stored);
            }
            None => {
                let key = DelayKey {
                    due,
                    seq: self.scheduler.memory_seq(),
                };
                self.scheduler.schedule(key, d, None);
            }
        }
        Routed {
            queues: 1,
            batch,
            rejected: false,
        }
    }

    /// Routes the scheduled messages that are due (at most [`RELEASES_PER_TICK`]; a backlog
    /// keeps the deadline at now), reading the next ones back from disk as memory runs low.
    fn release_delayed(&mut self) {
        let now = self.now_ms;
        let mut released = 0;
        loop {
            if self.scheduler.wants_read(now) {
                self.read_delayed();
            }
            if released >= RELEASES_PER_TICK {
                break;
            }
            let Some((key, d)) = self.scheduler.pop_due(now) else {
                break;
            };
            released += 1;
            if let Some(p) = self.persist.as_mut() {
                // In the batch that puts the message in its queues: a crash before it is
                // written releases it again, never loses it.
                p.push(StoreOp::DeleteDelayed { key }, false);
            }
            if !self.still_held(&d) {
                // Its queue (or exchange) was deleted, perhaps declared again since: what
                // the old one held went with it.
                tracing::debug!(vhost = %d.vhost, queue = ?d.queue, exchange = %d.message.exchange, "a delayed message whose holder is gone: dropped");
                continue;
            }
            let Delayed {
                vhost,
                queue,
                message,
                refused,
                ..
            } = d;
            let mut message = message;
            let (exchange, routing_key) = match queue {
                Some(q) => (ShortStr::from_static(""), q),
                None => {
                    // Delivered with the delay spent (`x-delay` negated), as the plugin does.
                    let headers = warren_codec::properties::headers(&message.properties);
                    if let Some(delay) = delayed::header_delay(headers.ok().flatten().as_ref()) {
                        if let Ok(p) = delayed::released_properties(&message.properties, delay) {
                            message.properties = p;
                        }
                    }
                    (message.exchange.clone(), message.routing_key.clone())
                }
            };
            self.releasing = Some(refused);
            let routed = self.publish_to(&vhost, &exchange, &routing_key, message, None, true);
            self.releasing = None;
            if let Err(e) = routed {
                tracing::debug!(vhost = %vhost, exchange = %exchange, error = %e, "a delayed message came due with nowhere to go: dropped");
            }
        }
        self.dead_letter_pending();
    }

    /// Does the incarnation of the queue or exchange that held `d` still exist?
    fn still_held(&self, d: &Delayed) -> bool {
        let Some(vh) = self.vhosts.get(&d.vhost) else {
            return false;
        };
        match &d.queue {
            Some(name) => vh
                .queues
                .get(name)
                .and_then(|id| self.queues.get(id))
                .is_some_and(|q| d.holder.admits(q.holder())),
            None => vh
                .exchanges
                .get(&d.message.exchange)
                .is_some_and(|x| x.delayed && d.holder.admits(x.holder())),
        }
    }

    /// Reads the next scheduled messages back from disk (a failed read is tried again soon).
    fn read_delayed(&mut self) {
        let now = self.now_ms;
        let Some(request) = self.scheduler.read_request(now) else {
            return;
        };
        let read = match self.pager.as_mut() {
            Some(pager) => pager.0.read_delayed(request),
            None => Err("no store to read delayed messages from".to_string()),
        };
        match read {
            Ok((found, more)) => self.scheduler.loaded_from_disk(request, found, more),
            Err(error) => {
                tracing::error!(%error, "reading delayed messages failed; trying again shortly");
                self.scheduler.read_failed(now);
            }
        }
    }

    /// Recovery: the store holds scheduled messages; they are read back, earliest first, as
    /// soon as ticks run (those due while the node was down are released at once).
    pub fn restore_delayed(&mut self) {
        self.scheduler.restore();
    }

    /// Scheduled messages this run knows of, and how many of them are in memory.
    pub fn delayed_counts(&self) -> (u64, usize) {
        (self.scheduler.count(), self.scheduler.loaded())
    }

    /// Routes and enqueues; `death`: the message is a dead letter (its reason, and its
    /// `x-death` header after this death), and queues it would cycle back to are left out.
    fn publish_to(
        &mut self,
        vhost: &str,
        exchange: &str,
        routing_key: &str,
        message: Message,
        death: Option<(DeadLetterReason, Option<FieldValue>, Vec<String>)>,
        released: bool,
    ) -> Result<Routed, AmqpError> {
        if message.body.len() > self.config.max_message_size {
            return Err(AmqpError::precondition_failed(format!(
                "message size {} is larger than configured max size {}",
                message.body.len(),
                self.config.max_message_size
            )));
        }
        let vh = self.vhosts.get(vhost).ok_or_else(|| no_vhost(vhost))?;
        let mut targets = std::mem::take(&mut self.scratch_queues);
        targets.clear();
        if exchange.is_empty() {
            if let Some(&id) = vh.queues.get(routing_key) {
                targets.push(id);
            }
            for key in death.iter().flat_map(|(_, _, cc)| cc) {
                if let Some(&id) = vh.queues.get(key.as_str()) {
                    targets.push(id);
                }
            }
            targets.sort_unstable();
            targets.dedup();
        } else {
            let Some(x) = vh.exchanges.get(exchange) else {
                self.scratch_queues = targets;
                return Err(no_exchange(exchange, vhost));
            };
            if x.internal {
                self.scratch_queues = targets;
                return Err(AmqpError::access_refused(format!(
                    "cannot publish to internal {}",
                    rs("exchange", exchange, vhost)
                )));
            }
            if x.delayed && !released {
                let headers = warren_codec::properties::headers(&message.properties);
                if let Some(delay) = delayed::header_delay(headers.ok().flatten().as_ref()) {
                    self.scratch_queues = targets;
                    // Routed when due as it was published (the message's own fields are
                    // what a delivery shows; they normally say the same).
                    let mut message = message;
                    if message.exchange.as_str() != exchange {
                        message.exchange = short(exchange);
                    }
                    if message.routing_key.as_str() != routing_key {
                        message.routing_key = short(routing_key);
                    }
                    let holder = x.holder();
                    return Ok(self.schedule(vhost, (None, holder), message, delay, 0));
                }
            }
            let mut dests = std::mem::take(&mut self.scratch_dests);
            route(vh, x, routing_key, &message, &mut dests, &mut targets);
            for key in death.iter().flat_map(|(_, _, cc)| cc) {
                route(vh, x, key, &message, &mut dests, &mut targets);
            }
            self.scratch_dests = dests;
        }
        if let Some((reason, x_death, _)) = &death {
            let (queues, reported) = (&self.queues, &mut self.cycles_reported);
            targets.retain(|id| {
                let Some(q) = queues.get(id) else {
                    return true;
                };
                let cycle = dead_letter::is_cycle(x_death.as_ref(), *reason, &q.name);
                if cycle {
                    // Once per queue at warning level (RabbitMQ: once per cycle), then quietly.
                    if reported.insert(*id) {
                        tracing::warn!(queue = %q.name, vhost = %q.vhost, "dead-letter cycle: a message that would reach this queue again with no rejection on the way is dropped (reported once)");
                    } else {
                        tracing::debug!(queue = %q.name, "dead-letter cycle: message dropped");
                    }
                }
                !cycle
            });
        }
        let size = message.body.len() as u64;
        // A queue that saw the message's key within its window drops this copy (counted as
        // routed: the publisher's confirm is the first copy's, once that is on disk). Only a
        // new publish is judged: a dead letter or a delayed release may be the last copy.
        let mut duplicates = 0u32;
        let mut first_copies = None;
        let mut new_keys: Vec<(QueueId, crate::dedup::Pending)> = Vec::new();
        if self.dedup_queues > 0 && !released && death.is_none() {
            let (now, disk) = (self.now_ms, self.disk);
            let queues = &mut self.queues;
            let mut headers = None;
            targets.retain(|id| {
                let Some(d) = queues.get_mut(id).and_then(|q| q.dedup.as_deref_mut()) else {
                    return true;
                };
                let headers = headers.get_or_insert_with(|| {
                    warren_codec::properties::headers(&message.properties)
                        .ok()
                        .flatten()
                });
                match d.judge(headers.as_ref(), &message.properties, now, disk) {
                    Verdict::Duplicate { batch } => {
                        duplicates += 1;
                        first_copies = first_copies.max(batch);
                        false
                    }
                    Verdict::New(pending) => {
                        new_keys.push((*id, pending));
                        true
                    }
                    Verdict::Unjudged => true,
                }
            });
        }
        // The judged queues that took their copy (a refused one leaves its key new).
        let mut took: Vec<QueueId> = Vec::new();
        // Queues with a delivery delay get their copy when it is due; one that is full and
        // refuses new messages refuses it now, while its publisher can still be told.
        let mut held: Vec<(ShortStr, Holder, u64)> = Vec::new();
        let mut refused_now: Vec<QueueId> = Vec::new();
        if self.delaying_queues > 0 && !released {
            let headers = warren_codec::properties::headers(&message.properties);
            let own = delayed::header_delay(headers.ok().flatten().as_ref());
            let refusing = self.refusing_queues > 0;
            targets.retain(|id| {
                let Some(q) = self.queues.get(id) else {
                    return true;
                };
                match q.args.delivery_delay_ms {
                    Some(_) if refusing && q.machine.rejects(size) => {
                        refused_now.push(*id);
                        false
                    }
                    Some(delay) => {
                        held.push((q.name.clone(), q.holder(), own.unwrap_or(delay)));
                        false
                    }
                    None => true,
                }
            });
        }
        for id in &refused_now {
            self.refused(*id, Kept::Memory, &message, None);
        }
        let own_ttl = message_ttl(&message);
        let meta = MsgMeta {
            size,
            expires_at: None,
            pageable: false,
            spilled: false,
            priority: 0,
            group: None,
        };
        let mut message = message;
        // A key is this publish's to give (a message republished from a queue carries its old one).
        message.store_key = None;
        if !targets.is_empty() {
            message.compact();
        }
        // Where each target keeps the message on disk: a persistent message in a durable queue
        // in the store (its confirm waits for the write); anything else in a queue past its
        // window in the scratch area, so that a deep queue's messages can leave memory.
        let mut kinds = std::mem::take(&mut self.scratch_kinds);
        kinds.clear();
        let (mut durable, mut spilled) = (0u32, 0u32);
        // A full `reject-publish` queue will refuse its copy: the machine decides (its Enqueue
        // reply), and its copy is not written, since nothing changes a queue between this look
        // and its Enqueue (dead letters wait until every copy is in, below).
        let refusing = self.refusing_queues > 0;
        let refuses = |q: &Queue| refusing && q.machine.rejects(size);
        // Spilling pays only for a body this queue alone holds: one that is also stored
        // durably, or spilled for several queues, has its references counted in memory and
        // could not leave it anyway (and a durable body must not count scratch references,
        // which a restart drops).
        // A transient message with no memory pressure stays in memory everywhere: no look at
        // the targets (the common path of transient traffic costs nothing here).
        if self.persist.is_some() && (message.persistent || self.spill) {
            for id in &targets {
                let kind = match self.queues.get(id) {
                    Some(q) if refuses(q) => Kept::Memory,
                    Some(q) if message.persistent && q.store_key.is_some() => {
                        durable += 1;
                        Kept::Durable
                    }
                    Some(q)
                        if self.spill
                            && self.pager.is_some()
                            && q.is_deep(keep(&self.config, q)) =>
                    {
                        spilled += 1;
                        Kept::Spilled
                    }
                    _ => Kept::Memory,
                };
                kinds.push(kind);
            }
        }
        if durable > 0 || spilled > 1 {
            for kind in kinds.iter_mut().filter(|k| **k == Kept::Spilled) {
                *kind = Kept::Memory;
            }
            spilled = 0;
        }
        let stored = durable.saturating_add(spilled);
        let mut batch = None;
        if let Some(p) = self.persist.as_mut().filter(|_| stored > 0) {
            let key = if durable > 0 {
                p.body_key()
            } else {
                p.spill_key()
            };
            message.store_key = Some(key);
            let op = StoreOp::PutBody {
                key,
                message: message.clone(),
                queues: stored,
            };
            p.push(op, durable > 0);
            if stored > 1 {
                p.shared.insert(key, stored);
            }
            if durable > 0 {
                batch = Some(p.next_batch);
            }
        }
        // A full queue that refuses the message counts as routed (no basic.return), and the
        // publisher's confirm becomes a nack.
        let mut rejected = refused_now.len() as u32;
        let mut routed = duplicates + rejected;
        // Only a body stored for one queue is paged out (a shared one is counted in memory).
        let paging = self.pager.is_some() && stored == 1;
        // What a copy makes its queue drop (drop-head) is dead-lettered once every copy is in:
        // a dead letter that filled a later target would otherwise refuse that target's copy,
        // and RabbitMQ's queues get a publish's copies before any dead letter it causes.
        let defer = !self.dead_lettering;
        // This release's own copies only: not the dead letters republished below.
        let releasing = self.releasing.take().filter(|_| released);
        self.dead_lettering = true;
        for (i, id) in targets.iter().enumerate() {
            let kind = kinds.get(i).copied().unwrap_or(Kept::Memory);
            let mut copy = message.clone();
            if kind == Kept::Memory {
                // This queue's copy is in memory only: nothing to delete when it goes.
                copy.store_key = None;
            }
            let now = self.now_ms;
            // The copy's meta depends on its queue (TTL, priorities): built from the same
            // lookup that applies the command.
            let Some((reply, meta)) = self.run_with(*id, |q| {
                let meta = MsgMeta {
                    pageable: paging && kind != Kept::Memory && may_page(q),
                    spilled: kind == Kept::Spilled,
                    expires_at: expiry(q, own_ttl, now),
                    priority: priority(q, &copy),
                    group: message_group(q, &copy),
                    ..meta
                };
                let command = Command::Enqueue {
                    message: copy,
                    meta,
                };
                (command, meta)
            }) else {
                continue;
            };
            routed += 1;
            if reply == Reply::Refused(Refusal::Full) {
                self.refused(*id, kind, &message, releasing);
                rejected += 1;
                continue;
            }
            if !new_keys.is_empty() && matches!(reply, Reply::Enqueued { .. }) {
                took.push(*id);
            }
            // A queue over its length drops its head: handled once this copy's entry is
            // written (the head may be this very message).
            let dropped = (!self.effects.is_empty()).then(|| std::mem::take(&mut self.effects));
            self.store_entry(*id, kind, &message, meta, stored, reply);
            if let Some(effects) = dropped {
                self.effects = effects;
                self.finish_effects(*id);
            }
        }
        if defer {
            self.dead_lettering = false;
            self.dead_letter_pending();
        }
        self.scratch_kinds = kinds;
        self.scratch_queues = targets;
        for (queue, holder, delay) in held {
            let r = self.schedule(vhost, (Some(queue), holder), message.clone(), delay, 0);
            routed += r.queues;
            batch = batch.max(r.batch);
        }
        if !new_keys.is_empty() {
            let now = self.now_ms;
            for (id, pending) in new_keys {
                // Held for a delivery delay (no longer a target, and not refused as full):
                // scheduled, so taken too.
                let taken = took.contains(&id)
                    || (!self.scratch_queues.contains(&id) && !refused_now.contains(&id));
                if let Some(d) = self
                    .queues
                    .get_mut(&id)
                    .and_then(|q| q.dedup.as_deref_mut())
                {
                    if taken {
                        d.remember(pending, batch, now);
                    }
                }
            }
        }
        Ok(Routed {
            queues: routed,
            batch: batch.max(first_copies),
            rejected: rejected > 0,
        })
    }

    /// A full `reject-publish` queue refused its copy of `message`: a stored copy lets its
    /// body go, and `reject-publish-dlx` dead-letters the message (reason `maxlen`). A delayed
    /// message refused as it falls due was confirmed long ago, and nobody is left to tell:
    /// with plain `reject-publish` it waits again, for this queue only, and is tried later
    /// (the back-off doubles, 1 s to 60 s), rather than being dropped.
    /// `releasing`: the message is a delayed one falling due, refused that many times before.
    fn refused(&mut self, id: QueueId, kind: Kept, message: &Message, releasing: Option<u32>) {
        if let (Some(p), Some(body), false) = (
            self.persist.as_mut(),
            message.store_key,
            kind == Kept::Memory,
        ) {
            p.release_body(body);
        }
        let Some(q) = self.queues.get(&id) else {
            return;
        };
        let mut m = message.clone();
        m.store_key = None;
        match (q.args.overflow, releasing) {
            (args::Overflow::RejectPublishDlx, _) => {
                if let Some(dl) = dead_letter_of(q, m, DeadLetterReason::MaxLen) {
                    self.dead_letters.push_back(dl);
                }
            }
            (_, Some(refused)) => {
                let (vhost, target) = (q.vhost.clone(), (Some(q.name.clone()), q.holder()));
                let wait = delayed::refused_retry_ms(refused);
                self.counters.delayed_refused += 1;
                tracing::debug!(queue = %q.name, vhost = %q.vhost, refused = refused + 1, retry_in_ms = wait, "a delayed message fell due into a full reject-publish queue: held back again");
                self.schedule(&vhost, target, m, wait, refused.saturating_add(1));
            }
            _ => {}
        }
    }

    /// Writes a queue's entry for a message it just took (if its copy is on disk).
    fn store_entry(
        &mut self,
        id: QueueId,
        kind: Kept,
        message: &Message,
        meta: MsgMeta,
        stored: u32,
        reply: Reply,
    ) {
        {
            let (Some(body), Reply::Enqueued { msg_id }) = (message.store_key, reply) else {
                return;
            };
            let (Some(p), Some(q)) = (self.persist.as_mut(), self.queues.get_mut(&id)) else {
                return;
            };
            let queue = match kind {
                Kept::Memory => return,
                Kept::Durable => q.store_key,
                Kept::Spilled => Some(*q.spill_key.get_or_insert_with(|| p.spill_key())),
            };
            let Some(queue) = queue else {
                return;
            };
            let op = StoreOp::PutEntry {
                queue,
                msg_id,
                body,
                size: meta.size,
                shared: stored > 1,
                expires_at: meta.expires_at,
            };
            p.push(op, kind == Kept::Durable);
            if meta.pageable && q.is_deep(keep(&self.config, q)) {
                let number = p.next_batch;
                match self.page_pending.back_mut() {
                    Some((b, q, m)) if *b == number && *q == id => *m = msg_id,
                    _ => self.page_pending.push_back((number, id, msg_id)),
                }
            }
        }
    }

    // ------------------------------------------------------ the queue machine

    /// Applies one command to a queue's machine: the only way a queue's state changes. The
    /// command gets the queue's next log index and the broker's time; it is recorded when
    /// recording is on; the queue's deadline and dirty flag follow its new state. The effects
    /// are left in `self.effects`. `None` if the queue does not exist.
    fn run(&mut self, id: QueueId, command: Command<Message>) -> Option<Reply> {
        self.run_with(id, |_| (command, ()))
            .map(|(reply, ())| reply)
    }

    /// [`Broker::run`] with the command built from the queue (one lookup), and something the
    /// builder returns beside it.
    fn run_with<T>(
        &mut self,
        id: QueueId,
        build: impl FnOnce(&Queue) -> (Command<Message>, T),
    ) -> Option<(Reply, T)> {
        let q = self.queues.get_mut(&id)?;
        let (command, extra) = build(q);
        let meta = Meta {
            index: q.machine.last_index() + 1,
            now_ms: self.now_ms,
        };
        let logged = self.recording.is_some().then(|| command.clone());
        let counted = match &command {
            Command::Enqueue { .. } => Counted::Enqueue,
            Command::Settle { receipt } => Counted::Settle {
                attempt: receipt.attempt,
            },
            Command::Restore { msg_id, .. } => Counted::Restored { first_id: *msg_id },
            Command::RestoreRun { first_id, .. } => Counted::Restored {
                first_id: *first_id,
            },
            _ => Counted::Other,
        };
        self.effects.clear();
        let reply = q.machine.apply(meta, command, &mut self.effects);
        let machine = &q.machine;
        q.stats
            .observe((counted, &reply), &self.effects, self.now_ms, || {
                machine.oldest_ready_id()
            });
        if let (Some(log), Some(command)) = (self.recording.as_mut(), logged) {
            // Small machines are checked after every command, big ones now and then (O(state)).
            let small = q.machine.ready_count() + q.machine.in_flight_count() < 64;
            let state = (small || meta.index.is_multiple_of(STATE_DIGEST_EVERY))
                .then(|| q.machine.digest());
            log.push(Record {
                queue: id.0,
                meta,
                command,
                effects: effects_digest(&reply, &self.effects),
                state,
            });
        }
        // A queue whose page read failed is woken to try again.
        let next = match (q.machine.next_deadline(), q.load_retry_at) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        // A deadline that only moved later stays filed where it was (outside a tick): with a
        // TTL, every delivery moves it to the next message's expiry, and refiling each time
        // would cost two tree operations per message. The early tick finds nothing due and
        // files the real deadline.
        let later = matches!((q.scheduled, next), (Some(old), Some(new)) if new > old);
        if next != q.scheduled && (self.ticking || !later) {
            if let Some(old) = q.scheduled {
                self.deadlines.remove(&(old, id));
            }
            if let Some(at) = next {
                self.deadlines.insert((at, id));
            }
            q.scheduled = next;
        }
        let low_water = (self.config.page_window / 2).max(1) as usize;
        mark_dirty(&mut self.dirty, q, low_water, self.now_ms);
        Some((reply, extra))
    }

    /// Handles what a command left in `self.effects` besides deliveries (the callers that can
    /// deliver take those first).
    fn finish_effects(&mut self, queue: QueueId) {
        // Drained from a moved-out buffer that is put back: the buffer keeps its capacity.
        let mut effects = std::mem::take(&mut self.effects);
        for effect in effects.drain(..) {
            match effect {
                Effect::DeadLetter {
                    msg_id,
                    message,
                    delivery_count,
                    reason,
                } => {
                    // A rejected message was in flight (its count is stored if it came back
                    // before); an expired one was ready (stored if it was ever delivered).
                    let in_flight = matches!(
                        reason,
                        DeadLetterReason::Rejected | DeadLetterReason::DeliveryLimit
                    );
                    self.forget_stored(queue, msg_id, &message, delivery_count, in_flight);
                    if let Some(dl) = self
                        .queues
                        .get(&queue)
                        .and_then(|q| dead_letter_of(q, message, reason))
                    {
                        self.dead_letters.push_back(dl);
                    }
                }
                Effect::Deliver(d) => {
                    // Only Checkout and Get deliver, and their callers take the deliveries.
                    debug_assert!(false, "unexpected delivery {:?}", d.receipt);
                }
                Effect::TimedOut {
                    msg_id,
                    attempt,
                    group,
                    message,
                } => {
                    // Back in the queue: its count is written, as for a requeue (a
                    // dead-lettered one follows as a DeadLetter).
                    let q = self.queues.get(&queue);
                    let keys = q.and_then(|q| q.entry_key(&message));
                    let retry_at = q.and_then(|q| q.machine.retry_due_of(msg_id));
                    if let (Some(p), Some(qkey)) = (self.persist.as_mut(), keys) {
                        let op = StoreOp::PutCount {
                            queue: qkey,
                            msg_id,
                            count: attempt,
                            retry_at,
                        };
                        p.push(op, false);
                    }
                    if let Some(group) = group {
                        let receipt = Receipt { msg_id, attempt };
                        self.timed_out.push((queue, group, receipt));
                    }
                }
                Effect::SettledLate {
                    msg_id,
                    message,
                    delivery_count,
                } => self.forget_stored(queue, msg_id, &message, delivery_count, false),
                Effect::ConsumerTimedOut {
                    consumer,
                    group,
                    tag,
                    timeout_ms,
                } => self.consumer_timeouts.push(ConsumerTimeout {
                    queue,
                    consumer,
                    group,
                    tag,
                    timeout_ms,
                }),
            }
        }
        self.effects = effects;
        self.dead_letter_pending();
    }

    /// Republishes the waiting dead letters to their exchanges, with `x-death` recorded. A
    /// dead letter that makes another queue drop or expire messages adds to the list, which
    /// this works through in order; a call made while it runs returns at once.
    ///
    /// As in RabbitMQ: a dead-letter exchange that does not exist, or routes the message
    /// nowhere, drops it (with a log line); a message that would cycle back to a queue it died
    /// in without a rejection on the way is dropped for that queue.
    fn dead_letter_pending(&mut self) {
        if self.dead_lettering {
            return;
        }
        self.dead_lettering = true;
        while let Some(dl) = self.dead_letters.pop_front() {
            let m = &dl.message;
            let headers = warren_codec::properties::headers(&m.properties)
                .ok()
                .flatten();
            let death = Death {
                queue: &dl.queue,
                reason: dl.reason,
                exchange: &m.exchange,
                routing_keys: dead_letter::routing_keys(&m.routing_key, headers.as_ref()),
                time_s: self.now_ms / 1000,
            };
            let keep_cc = dl.routing_key.is_none();
            let properties = match dead_letter::record(&m.properties, &death, keep_cc) {
                Ok(p) => p,
                Err(error) => {
                    // The session validated them on publish: not expected.
                    tracing::warn!(queue = %dl.queue, %error, "dead letter with unreadable properties dropped");
                    continue;
                }
            };
            let x_death = dead_letter::x_death(&properties);
            let routing_key = match &dl.routing_key {
                Some(k) => ShortStr::from_string(k.clone()),
                None => m.routing_key.clone(),
            };
            let message = Message {
                exchange: ShortStr::from_string(dl.exchange.clone()),
                routing_key: routing_key.clone(),
                properties,
                body: m.body.clone(),
                persistent: m.persistent,
                store_key: None,
            };
            // Without its own routing key, the queue's dead letters go by the keys they were
            // published with: the routing key and the CC header's.
            let cc: Vec<String> = match &dl.routing_key {
                None => dead_letter::cc(headers.as_ref())
                    .map(str::to_owned)
                    .collect(),
                Some(_) => Vec::new(),
            };
            let death = Some((dl.reason, x_death, cc));
            match self.publish_to(&dl.vhost, &dl.exchange, &routing_key, message, death, false) {
                Ok(r) if r.queues > 0 => {}
                Ok(_) => {
                    tracing::debug!(queue = %dl.queue, exchange = %dl.exchange, "dead letter routed nowhere: dropped")
                }
                Err(error) => {
                    // As RabbitMQ: silently (a line per message would flood the log).
                    tracing::debug!(queue = %dl.queue, exchange = %dl.exchange, %error, "dead-letter exchange unusable: message dropped")
                }
            }
        }
        self.dead_lettering = false;
    }

    /// Starts or stops recording every command applied to every queue (a debug option: the
    /// server writes the records to a file, and `queue::log::replay` checks them).
    pub fn set_recording(&mut self, on: bool) {
        self.recording = on.then(Vec::new);
    }

    /// The records made since the last call (empty while recording is off).
    pub fn take_records(&mut self) -> Vec<Record> {
        match self.recording.as_mut() {
            Some(log) => std::mem::take(log),
            None => Vec::new(),
        }
    }

    // ---------------------------------------------------------------- store

    /// The writes made since the last call, as the next numbered batch (`None` if nothing
    /// changed on disk, or persistence is off).
    pub fn take_writes(&mut self) -> Option<WriteBatch> {
        self.persist.as_mut()?.take()
    }

    /// The store failed to write the batches up to `upto` (their publishers were nacked; the
    /// store may still retry them): a message deduplication remembered from them is new again.
    pub fn writes_failed(&mut self, upto: u64) {
        self.disk.failed = self.disk.failed.max(upto);
    }

    /// The store wrote every batch up to `upto`: messages they hold may leave memory. Each
    /// queue with stored messages past its window gets a `PageOut`.
    pub fn writes_done(&mut self, upto: u64) {
        self.disk.written = self.disk.written.max(upto);
        self.scheduler.written(upto);
        let mut due: BTreeMap<QueueId, u64> = BTreeMap::new();
        while let Some(&(batch, queue, msg_id)) = self.page_pending.front() {
            if batch > upto {
                break;
            }
            self.page_pending.pop_front();
            let m = due.entry(queue).or_insert(msg_id);
            *m = (*m).max(msg_id);
        }
        for (id, upto_id) in due {
            let Some(q) = self.queues.get(&id) else {
                continue;
            };
            let command = Command::PageOut {
                keep: keep(&self.config, q),
                keep_bytes: self.config.page_window_bytes,
                upto_id,
            };
            self.run(id, command);
        }
    }

    /// While on, the store is still restoring queues (see `Store::recover_step`): timers wait.
    /// The server keeps clients away from queues meanwhile.
    pub fn set_recovering(&mut self, on: bool) {
        self.recovering = on;
    }

    /// Under memory pressure (the server's paging threshold), transient messages that reach
    /// a queue past its window are written to the store's scratch area and page out like
    /// persistent ones; otherwise they stay in memory. Messages already queued stay as they are.
    pub fn set_spill(&mut self, on: bool) {
        if on != self.spill {
            tracing::info!(
                paging = on,
                "transient messages of deep queues {}",
                if on {
                    "now go to disk"
                } else {
                    "stay in memory again"
                }
            );
        }
        self.spill = on;
    }

    /// Gives the broker what reads paged messages back; from then on, stored messages of deep
    /// queues leave memory once written.
    pub fn set_pager(&mut self, pager: Box<dyn PageSource>) {
        self.pager = Some(Pager(pager));
    }

    /// Reads the queue's next paged messages back if its head is below `low_water`. A failed
    /// read is logged and tried again later (the messages stay on disk; nothing is lost).
    /// Every way this fails leaves the queue waiting [`LOAD_RETRY_MS`] (its deadline wakes it),
    /// so a queue whose pages cannot be read never spins the dispatcher.
    /// True if a page was read and loaded.
    fn fill(&mut self, id: QueueId, low_water: usize, window: u32) -> bool {
        let Some(q) = self.queues.get(&id) else {
            return false;
        };
        if q.load_retry_at.is_some_and(|t| self.now_ms < t) {
            return false;
        }
        let Some(request) = q.machine.load_request(low_water) else {
            return false;
        };
        let qkey = if request.spilled {
            q.spill_key
        } else {
            q.store_key
        };
        let max = (window as usize)
            .saturating_sub(q.machine.head_count())
            .max(1);
        let read = match (self.pager.as_mut(), qkey) {
            (Some(pager), Some(qkey)) => {
                pager
                    .0
                    .read(qkey, request, max, self.config.page_window_bytes.max(1))
            }
            _ => Err("no store to read paged messages from".to_string()),
        };
        let loaded = match read {
            Ok(page) => {
                // Entries the store could not turn into messages (no body, a damaged one) are
                // dropped from disk, so they are not found again after a restart.
                if let (Some(p), Some(qkey)) = (self.persist.as_mut(), qkey) {
                    for msg_id in page.unreadable {
                        let op = StoreOp::DeleteEntry {
                            queue: qkey,
                            msg_id,
                            count: true,
                        };
                        p.push(op, false);
                    }
                }
                let mut messages = page.messages;
                if let Some(q) = self
                    .queues
                    .get(&id)
                    .filter(|q| q.args.max_priority.is_some())
                {
                    for m in &mut messages {
                        m.meta.priority = priority(q, &m.message);
                    }
                }
                let command = Command::Load {
                    messages,
                    through_id: page.through_id,
                };
                let ok = self.run(id, command) == Some(Reply::Ok);
                self.finish_effects(id);
                if !ok {
                    tracing::warn!(
                        queue = id.0,
                        from = request.from_id,
                        "a page read back did not match the queue; trying again in a second"
                    );
                }
                ok
            }
            Err(error) => {
                tracing::error!(queue = id.0, from = request.from_id, %error, "reading paged messages failed; trying again in a second");
                false
            }
        };
        if let Some(q) = self.queues.get_mut(&id) {
            q.load_retry_at = (!loaded).then(|| self.now_ms.saturating_add(LOAD_RETRY_MS));
        }
        loaded
    }

    /// Can stored messages stay on disk until read (a [`PageSource`] is set)?
    pub fn pages(&self) -> bool {
        self.pager.is_some()
    }

    /// Does a write wait to be taken?
    pub fn has_writes(&self) -> bool {
        self.persist.as_ref().is_some_and(|p| !p.ops.is_empty())
    }

    /// Recovery: a durable exchange as the store holds it. Nothing is written back.
    pub fn restore_exchange(&mut self, def: &ExchangeDef) -> Result<(), AmqpError> {
        let clamped = restorable(&def.arguments, "exchange", &def.name, &def.vhost);
        let arguments = clamped.as_ref().unwrap_or(&def.arguments);
        self.restoring(|b| {
            b.declare_exchange(
                &def.vhost,
                &def.name,
                type_name(def.kind, def.delayed),
                false,
                true,
                def.auto_delete,
                def.internal,
                arguments,
            )
        })?;
        // The same incarnation as before the restart: what it held is still its own.
        if let Some(x) = self
            .vhosts
            .get_mut(&def.vhost)
            .and_then(|vh| vh.exchanges.get_mut(&def.name))
        {
            x.incarnation = def.incarnation.filter(|_| def.delayed);
        }
        Ok(())
    }

    /// Runs a declaration for recovery: nothing is written back to the store (it holds it
    /// already), and what only the store may declare (`amq.gen-` names, past vhost limits) is
    /// accepted.
    fn restoring<T>(&mut self, f: impl FnOnce(&mut Broker) -> T) -> T {
        let saved = self.persist.take();
        self.restoring = true;
        let r = f(self);
        self.restoring = false;
        self.persist = saved;
        r
    }

    /// Recovery: a durable queue as the store holds it, under its store key.
    pub fn restore_queue(&mut self, def: &QueueDef) -> Result<QueueId, AmqpError> {
        let arguments = restorable(&def.arguments, "queue", &def.name, &def.vhost)
            .unwrap_or_else(|| def.arguments.clone());
        let declared = self.restoring(|b| {
            b.declare_queue(
                &def.vhost,
                DeclareQueue {
                    name: def.name.clone(),
                    passive: false,
                    durable: true,
                    exclusive: false,
                    auto_delete: def.auto_delete,
                    arguments,
                },
                0,
            )
        })?;
        if let Some(q) = self.queues.get_mut(&declared.queue) {
            q.store_key = Some(def.key);
        }
        Ok(declared.queue)
    }

    /// Recovery: a durable binding.
    pub fn restore_binding(&mut self, def: &BindingDef) -> Result<(), AmqpError> {
        self.restoring(|b| match &def.dest {
            BindingDest::Queue(q) => b.bind_queue(
                &def.vhost,
                q,
                &def.source,
                &def.routing_key,
                &def.arguments,
                0,
            ),
            BindingDest::Exchange(x) => {
                b.bind_exchange(&def.vhost, x, &def.source, &def.routing_key, &def.arguments)
            }
        })
    }

    /// Recovery: a stored message back in its queue, ready, with its id and delivery count
    /// (`redelivered` after a crash, when any message may have been delivered), and the due
    /// time of the delayed retry it was waiting for, if any. False if the queue is unknown or
    /// the id is not after the queue's last one.
    pub fn restore_message(
        &mut self,
        queue: QueueId,
        msg_id: u64,
        message: Message,
        (delivery_count, retry_at): (u32, Option<u64>),
        expires_at: Option<u64>,
        redelivered: bool,
    ) -> bool {
        let meta = MsgMeta {
            size: message.body.len() as u64,
            expires_at,
            pageable: false,
            spilled: false,
            priority: self.queues.get(&queue).map_or(0, |q| priority(q, &message)),
            group: self
                .queues
                .get(&queue)
                .and_then(|q| message_group(q, &message)),
        };
        let command = Command::Restore {
            msg_id,
            message,
            meta,
            delivery_count,
            redelivered,
            retry_at,
        };
        matches!(self.run(queue, command), Some(Reply::Enqueued { .. }))
    }

    /// Recovery: `count` stored messages (`bytes` of bodies) with ids in `first_id..=last_id`
    /// are ready in the queue but left on disk, read back when consumers come near them. False
    /// if the queue is unknown or the ids are not after the queue's last one.
    #[allow(clippy::too_many_arguments)]
    pub fn restore_run(
        &mut self,
        queue: QueueId,
        first_id: u64,
        last_id: u64,
        count: u64,
        bytes: u64,
        redelivered: bool,
        expires_min: Option<u64>,
    ) -> bool {
        let command = Command::RestoreRun {
            first_id,
            last_id,
            count,
            bytes,
            redelivered,
            expires_min,
        };
        self.run(queue, command) == Some(Reply::Ok)
    }

    /// Recovery is over: new queues and bodies get keys past the ones on disk, and bodies
    /// shared by several queues are counted (`shared`: body key, queues holding it).
    pub fn set_store_keys(
        &mut self,
        keys: StoreKeys,
        shared: impl IntoIterator<Item = (u64, u32)>,
    ) {
        if let Some(p) = self.persist.as_mut() {
            p.next_queue_key = p.next_queue_key.max(keys.next_queue_key);
            p.next_body_key = p.next_body_key.max(keys.next_body_key);
            p.reserved = StoreKeys {
                next_queue_key: p.next_queue_key,
                next_body_key: p.next_body_key,
            };
            p.shared.extend(shared.into_iter().filter(|&(_, n)| n > 1));
        }
    }

    /// Recovery: ids below `next_id` are never given to new messages of this queue (an entry
    /// on disk that could not be restored keeps its key).
    pub fn skip_message_ids(&mut self, queue: QueueId, next_id: u64) {
        self.run(queue, Command::SkipIds { next_id });
    }

    /// The store key of a durable queue (persistence on).
    pub fn queue_store_key(&self, queue: QueueId) -> Option<u64> {
        self.queues.get(&queue)?.store_key
    }

    // ------------------------------------------------------------ consumers

    /// basic.consume: registers a consumer in the queue's machine. Errors: 404 no queue, 405
    /// exclusive queue of another connection, 403 exclusive use, 406 bad arguments.
    #[allow(clippy::too_many_arguments)]
    pub fn consume(
        &mut self,
        vhost: &str,
        queue: &str,
        group: CreditGroup,
        tag: ShortStr,
        no_ack: bool,
        exclusive: bool,
        prefetch: u32,
        arguments: &FieldTable,
    ) -> Result<(QueueId, ConsumerId), AmqpError> {
        let queue = strip_cr_lf(queue);
        let q = self.queue_by_name(vhost, &queue)?;
        check_access(q, group.conn)?;
        if let Some(max) = self.config.consumer_max_per_queue {
            if q.machine.consumer_count() >= max {
                return Err(AmqpError::precondition_failed(format!(
                    "cannot consume from queue '{queue}' in vhost '{vhost}': consumer limit ({max}) is reached"
                )));
            }
        }
        let priority = args::validate_consume(arguments, &q.rs())?;
        let id = q.id;
        let consumer = ConsumerId(self.next_consumer);
        self.next_consumer += 1;
        let spec = ConsumerSpec {
            group,
            tag,
            no_ack,
            prefetch,
            exclusive,
            priority,
            arguments: arguments.detached(),
        };
        match self.run(id, Command::Consume { id: consumer, spec }) {
            Some(Reply::Ok) => Ok((id, consumer)),
            Some(Reply::Refused(Refusal::ExclusiveInUse)) => Err(AmqpError::access_refused(
                format!("queue '{queue}' in vhost '{vhost}' in exclusive use"),
            )),
            _ => Err(no_queue(&queue, vhost)),
        }
    }

    /// Removes the consumer; its in-flight messages stay in flight (the channel holds them
    /// until they are acked or the channel closes). An auto-delete queue is deleted when its
    /// last consumer goes. Returns false if the consumer or queue is unknown.
    pub fn cancel(&mut self, queue: QueueId, consumer: ConsumerId) -> bool {
        let Some(Reply::Cancelled { consumers_left }) =
            self.run(queue, Command::Cancel { id: consumer })
        else {
            return false;
        };
        let auto_delete = self
            .queues
            .get(&queue)
            .is_some_and(|q| q.auto_delete && consumers_left == 0 && q.machine.has_had_consumers());
        if auto_delete {
            self.remove_queue(queue);
        }
        true
    }

    /// Sets the credit of a channel's consumers in one queue (channel-wide prefetch, a backed
    /// up socket): what the queue cannot see reaches it as a command.
    pub fn set_credit(&mut self, queue: QueueId, group: CreditGroup, credit: Credit) {
        self.run(queue, Command::Credit { group, credit });
    }

    /// Connection gone (its consumers already cancelled by the session): deletes its exclusive
    /// queues. Returns the deleted queue ids.
    pub fn connection_closed(&mut self, conn: ConnId) -> Vec<QueueId> {
        let mut deleted = Vec::new();
        if let Some(ids) = self.exclusive.remove(&conn) {
            for id in ids {
                if self.remove_queue(id).is_some() {
                    deleted.push(id);
                }
            }
        }
        deleted
    }

    /// Is there a queue with work for [`Broker::dispatch_one`]?
    pub fn needs_dispatch(&self) -> bool {
        !self.dirty.is_empty()
    }

    /// Queues waiting for dispatch now (a caller that dispatches each once stops after this
    /// many).
    pub fn dirty_count(&self) -> usize {
        self.dirty.len()
    }

    /// Runs one checkout (at most `config.dispatch_batch` deliveries) on the next queue with
    /// work; its deliveries are appended to `out`. A queue with more work stays dirty. False
    /// when no queue has work.
    pub fn dispatch_one(&mut self, out: &mut Vec<Delivery>) -> bool {
        let Some(id) = self.dirty.pop_front() else {
            return false;
        };
        let Some(q) = self.queues.get_mut(&id) else {
            return true;
        };
        q.dirty = false;
        let low_water = (self.config.page_window / 2).max(1) as usize;
        if q.machine.wants_load(low_water) && q.load_retry_at.is_none_or(|t| self.now_ms >= t) {
            self.fill(id, low_water, self.config.page_window);
        }
        let max = u32::try_from(self.config.dispatch_batch.max(1)).unwrap_or(u32::MAX);
        if self.run(id, Command::Checkout { max }).is_none() {
            return true;
        }
        self.take_deliveries(id, out);
        true
    }

    /// Moves the deliveries out of `self.effects` into `out`, then handles the rest.
    fn take_deliveries(&mut self, id: QueueId, out: &mut Vec<Delivery>) {
        let Some(q) = self.queues.get(&id) else {
            return;
        };
        let mut rest = Vec::new();
        for effect in self.effects.drain(..) {
            match effect {
                Effect::Deliver(d) => {
                    if d.settled {
                        if let (Some(p), Some(queue), Some(body)) = (
                            self.persist.as_mut(),
                            q.entry_key(&d.message),
                            d.message.store_key,
                        ) {
                            p.forget(queue, d.receipt.msg_id, body, d.receipt.attempt > 1);
                        }
                    }
                    let mut message = d.message;
                    // A quorum queue tells a consumer how many times the message went out
                    // before (RabbitMQ: on every redelivery, and on every basic.get).
                    let counts = q.args.queue_type == QueueType::Quorum || q.args.is_task_queue();
                    if counts && (d.receipt.attempt > 1 || d.consumer.is_none()) {
                        let before = d.receipt.attempt.saturating_sub(1);
                        if let Ok(p) = dead_letter::with_delivery_count(&message.properties, before)
                        {
                            message.properties = p;
                        }
                    }
                    out.push(Delivery {
                        queue: id,
                        queue_name: q.name.clone(),
                        receipt: d.receipt,
                        message,
                        redelivered: d.redelivered,
                        settled: d.settled,
                        consumer: d
                            .consumer
                            .zip(d.to)
                            .map(|(id, (group, tag))| (id, group, tag)),
                        timed: d.timed,
                    })
                }
                other => rest.push(other),
            }
        }
        if !rest.is_empty() {
            self.effects = rest;
            self.finish_effects(id);
        }
    }

    // ----------------------------------------------------------------- time

    /// Time passes: every queue whose deadline has come gets a Tick (message expiry now;
    /// queue expiry, visibility timeouts and delayed messages as they land). The server calls
    /// it at [`Broker::next_deadline`].
    pub fn tick(&mut self, now_ms: u64) {
        self.now_ms = self.now_ms.max(now_ms);
        if self.recovering {
            return;
        }
        // Pages read back to expire them, this call: the rest waits for the next tick (due
        // at once), so one call never holds the node for a whole backlog of expired pages.
        let mut reads = 0;
        self.ticking = true;
        while let Some(&(at, id)) = self.deadlines.first() {
            if at > self.now_ms || reads >= EXPIRY_READS_PER_TICK {
                break;
            }
            let reply = self.run(id, Command::Tick);
            if reply.is_none() {
                self.deadlines.remove(&(at, id));
                continue;
            }
            if reply == Some(Reply::QueueExpired) {
                tracing::debug!(queue = id.0, "queue unused for its x-expires: deleted");
                self.finish_effects(id);
                self.remove_queue(id);
                continue;
            }
            if self.queues.get(&id).is_some_and(|q| q.machine.run_due()) {
                // Expired messages on disk with nothing ahead of them: read them back to
                // drop (or dead-letter) them.
                self.finish_effects(id);
                let low_water = (self.config.page_window / 2).max(1) as usize;
                reads += 1;
                if self.fill(id, low_water, self.config.page_window) {
                    // Progress (a page read): the same deadline again is the next page.
                    continue;
                }
            }
            if self.deadlines.first() == Some(&(at, id)) {
                // The machine reported a deadline that a tick does not clear: never spin.
                self.deadlines.remove(&(at, id));
                if let Some(q) = self.queues.get_mut(&id) {
                    q.scheduled = None;
                }
            }
            self.finish_effects(id);
        }
        self.ticking = false;
        self.release_delayed();
    }

    /// The time of the commands that follow (milliseconds on the driver's clock; it never goes
    /// backwards). Every command a queue applies carries the broker's latest time.
    pub fn advance_time(&mut self, now_ms: u64) {
        self.now_ms = self.now_ms.max(now_ms);
    }

    /// The earliest time at which [`Broker::tick`] has work to do (none while recovering:
    /// ticks wait for the end of it).
    pub fn next_deadline(&self) -> Option<u64> {
        if self.recovering {
            return None;
        }
        let queues = self.deadlines.first().map(|&(at, _)| at);
        match (queues, self.scheduler.deadline()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Every queue of a vhost, sorted by name.
    pub fn queues(&self, vhost: &str) -> Vec<QueueInfo> {
        let mut out: Vec<QueueInfo> = self
            .vhosts
            .get(vhost)
            .map(|vh| {
                vh.queues
                    .values()
                    .filter_map(|id| self.queue_info(*id))
                    .collect()
            })
            .unwrap_or_default();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }

    /// A queue's machine (read-only: tests, diagnostics, digests).
    pub fn machine(&self, queue: QueueId) -> Option<&QueueMachine<Message>> {
        self.queues.get(&queue).map(|q| &q.machine)
    }

    // ------------------------------------------------------------ basic.get

    /// basic.get: the next ready message and how many stay ready.
    pub fn get(
        &mut self,
        vhost: &str,
        queue: &str,
        no_ack: bool,
        conn: ConnId,
    ) -> Result<Option<(Delivery, u32)>, AmqpError> {
        let queue = strip_cr_lf(queue);
        let q = self.queue_by_name(vhost, &queue)?;
        check_access(q, conn)?;
        let id = q.id;
        if q.machine.ready_count() == 0 {
            // Nothing to take. A queue with `x-expires` still counts the poll as use (RabbitMQ
            // restarts its expiry timer on every basic.get, empty or not); for any other queue
            // no command, so an empty poll loop writes nothing to the log.
            if q.args.expires_ms.is_some() {
                self.run(id, Command::Get { no_ack });
            }
            return Ok(None);
        }
        // A poller reads a few at a time: a queue without consumers pages out to its small
        // window again with the next write. A page may have expired whole: read on. What was
        // in memory may expire as the get begins, leaving a paged head: read that too.
        let mut got = Vec::with_capacity(1);
        loop {
            while self
                .queues
                .get(&id)
                .is_some_and(|q| !q.machine.head_loaded() && q.machine.load_request(1).is_some())
            {
                if !self.fill(id, 1, self.config.page_window_idle) {
                    break;
                }
            }
            self.run(id, Command::Get { no_ack });
            self.take_deliveries(id, &mut got);
            let paged_head = self
                .queues
                .get(&id)
                .is_some_and(|q| !q.machine.head_loaded() && q.machine.load_request(1).is_some());
            // Another round only if this one expired what was in memory and the next page
            // can be read (a failed read waits for its retry: no spinning on a broken page).
            let waiting = self
                .queues
                .get(&id)
                .is_some_and(|q| q.load_retry_at.is_some_and(|t| self.now_ms < t));
            if !got.is_empty() || !paged_head || waiting {
                break;
            }
        }
        let remaining = self.queues.get(&id).map_or(0, |q| q.ready_count());
        Ok(got.pop().map(|d| (d, remaining)))
    }

    // ----------------------------------------------------------- settlement

    /// Ack. False if the receipt is not current (the queue is gone, or the message was
    /// returned and delivered again since): nothing changes.
    pub fn settle(&mut self, queue: QueueId, receipt: Receipt) -> bool {
        let stored = self.stored_in_flight(queue, receipt);
        let ok = self.run(queue, Command::Settle { receipt }) == Some(Reply::Ok);
        if let (true, Some((qkey, body)), Some(p)) = (ok, stored, self.persist.as_mut()) {
            p.forget(qkey, receipt.msg_id, body, receipt.attempt > 1);
        }
        if !self.effects.is_empty() {
            // A late ack that settled a timed-out message waiting in the queue.
            self.finish_effects(queue);
        }
        ok
    }

    /// The queue's and body's store keys of an in-flight message that is on disk.
    fn stored_in_flight(&self, queue: QueueId, receipt: Receipt) -> Option<(u64, u64)> {
        self.persist.as_ref()?;
        let q = self.queues.get(&queue)?;
        let (m, _) = q.machine.in_flight_message(receipt.msg_id)?;
        Some((q.entry_key(m)?, m.store_key?))
    }

    /// A stored message left a durable queue outside a settle.
    fn forget_stored(
        &mut self,
        queue: QueueId,
        msg_id: u64,
        message: &Message,
        delivery_count: u32,
        in_flight: bool,
    ) {
        let Some(p) = self.persist.as_mut() else {
            return;
        };
        let (Some(qkey), Some(body)) = (
            self.queues.get(&queue).and_then(|q| q.entry_key(message)),
            message.store_key,
        ) else {
            return;
        };
        // A count is stored once a message comes back: for one in flight, the current
        // delivery is not counted on disk.
        let count = if in_flight {
            delivery_count > 1
        } else {
            delivery_count > 0
        };
        p.forget(qkey, msg_id, body, count);
    }

    /// nack/reject with requeue, basic.recover: the message goes back to its original position
    /// (after its retry delay, with delayed retries) and is redelivered=true on its next
    /// delivery. False if the receipt is stale.
    pub fn requeue(&mut self, queue: QueueId, receipt: Receipt) -> bool {
        self.give_back(queue, receipt, true)
    }

    /// The holder's channel closed: the message goes back at once (no retry delay).
    pub fn release(&mut self, queue: QueueId, receipt: Receipt) -> bool {
        self.give_back(queue, receipt, false)
    }

    fn give_back(&mut self, queue: QueueId, receipt: Receipt, by_client: bool) -> bool {
        let stored = self.stored_in_flight(queue, receipt);
        let command = if by_client {
            Command::Return { receipt }
        } else {
            Command::Release { receipt }
        };
        let ok = self.run(queue, command) == Some(Reply::Ok);
        let gone = self
            .effects
            .iter()
            .any(|e| matches!(e, Effect::DeadLetter { msg_id, .. } if *msg_id == receipt.msg_id));
        let retry_at = self
            .queues
            .get(&queue)
            .and_then(|q| q.machine.retry_due_of(receipt.msg_id));
        if let (true, false, Some((qkey, _)), Some(p)) = (ok, gone, stored, self.persist.as_mut()) {
            p.push(
                StoreOp::PutCount {
                    queue: qkey,
                    msg_id: receipt.msg_id,
                    count: receipt.attempt,
                    retry_at,
                },
                false,
            );
        }
        // Past its delivery limit the message is dead-lettered instead of returned; back over
        // the queue's length limit, drop-head drops it (or an older one).
        self.finish_effects(queue);
        ok
    }

    /// A delivery's holder asks for more time: its visibility deadline becomes now plus
    /// `timeout_ms`. False if the receipt is not current (it timed out already, or the queue
    /// is gone).
    pub fn extend(&mut self, queue: QueueId, receipt: Receipt, timeout_ms: u64) -> bool {
        self.run(
            queue,
            Command::Extend {
                receipt,
                timeout_ms,
            },
        ) == Some(Reply::Ok)
    }

    /// The consumers cancelled by their consumer timeout since the last call (the session tells
    /// their clients).
    pub fn take_consumer_timeouts(&mut self) -> Vec<ConsumerTimeout> {
        std::mem::take(&mut self.consumer_timeouts)
    }

    /// The consumer deliveries that timed out since the last call: (queue, channel, receipt).
    pub fn take_timed_out(&mut self) -> Vec<(QueueId, CreditGroup, Receipt)> {
        std::mem::take(&mut self.timed_out)
    }

    /// reject/nack without requeue: the message leaves the queue, to its dead-letter exchange
    /// if it has one. False if the receipt is stale.
    pub fn discard(&mut self, queue: QueueId, receipt: Receipt) -> bool {
        let ok = self.run(queue, Command::Discard { receipt }) == Some(Reply::Ok);
        self.finish_effects(queue);
        ok
    }
}

/// Collects the queues a message goes to from exchange `start`: follows exchange-to-exchange
/// bindings (each exchange visited once, so cycles end) and alternate exchanges (used when an
/// exchange itself routes nowhere, as RabbitMQ does); `out` ends sorted and deduplicated.
fn route(
    vh: &VHost,
    start: &Exchange,
    routing_key: &str,
    message: &Message,
    dests: &mut Vec<Dest>,
    out: &mut Vec<QueueId>,
) {
    let mut headers = LazyHeaders::new(&message.properties);
    let mut pending: Small<Option<&Exchange>, 8> = Small::new();
    pending.push(Some(start));
    // Exchanges already routed through: an inline list while few (the common case), a hash
    // set for large exchange-to-exchange graphs.
    let mut seen: Small<&str, 8> = Small::new();
    let mut seen_count = 1usize;
    seen.push(&start.name);
    let mut seen_set: Option<HashSet<&str>> = None;
    while let Some(x) = pending.pop() {
        let Some(x) = x else { continue };
        dests.clear();
        x.route(routing_key, &mut headers, dests);
        if dests.is_empty() {
            if let Some(FieldValue::LongStr(ae)) = x.arguments.get("alternate-exchange") {
                if let Ok(ae) = std::str::from_utf8(ae) {
                    dests.push(Dest::Exchange(short(ae)));
                }
            }
        }
        for d in dests.drain(..) {
            match d {
                Dest::Queue(id) => out.push(id),
                Dest::Exchange(name) => {
                    let Some((k, next)) = vh.exchanges.get_key_value(&name) else {
                        continue;
                    };
                    let k = k.as_str();
                    let new = match &mut seen_set {
                        Some(set) => set.insert(k),
                        None if seen_count < 16 => {
                            let new = !seen.any(|s| *s == k);
                            if new {
                                seen.push(k);
                                seen_count += 1;
                            }
                            new
                        }
                        None => {
                            let mut set: HashSet<&str> = HashSet::new();
                            while let Some(s) = seen.pop() {
                                set.insert(s);
                            }
                            let new = set.insert(k);
                            seen_set = Some(set);
                            new
                        }
                    };
                    if new {
                        pending.push(Some(next));
                    }
                }
            }
        }
    }
    out.sort_unstable();
    out.dedup();
}
