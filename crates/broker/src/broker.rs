//! The broker: vhosts, exchanges, bindings, queues, and the API the session calls.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};

use warren_codec::{AmqpError, FieldTable, FieldValue, ShortStr};

use crate::erl::rs;
use crate::exchange::{headers, Dest, Exchange, ExchangeKind, LazyHeaders};
use crate::names::NameGen;
use crate::queue::args::{self, QueueType};
use crate::queue::machine::{
    Checkout, DeadLetterReason, Deliver, Discarded, MsgMeta, QueueMachine,
};
use crate::queue::{ConsumerInfo, Queue};
use crate::small::Small;
use crate::{
    BrokerConfig, ConnId, ConsumerKey, DeclareQueue, Delivery, DeliverySink, Message,
    QueueDeclared, QueueDeleted, QueueId, Routed,
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
    queues: HashMap<QueueId, Queue>,
    next_queue: u64,
    /// Every consumer and its queue (ordered, so a connection's or a channel's consumers
    /// are a range).
    consumers: BTreeMap<ConsumerKey, QueueId>,
    /// Exclusive queues by owning connection.
    exclusive: HashMap<ConnId, Vec<QueueId>>,
    /// Queues that may have work for dispatch (each at most once: `Queue::dirty`).
    dirty: VecDeque<QueueId>,
    names: NameGen,
    /// Reused routing buffers.
    scratch_dests: Vec<Dest>,
    scratch_queues: Vec<QueueId>,
    /// The latest time seen (publish, tick).
    now_ms: u64,
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

/// Puts a queue on the dirty list if it has consumers and ready messages.
fn mark_dirty(dirty: &mut VecDeque<QueueId>, q: &mut Queue) {
    if !q.dirty && !q.consumers.is_empty() && q.machine.ready_count() > 0 {
        q.dirty = true;
        dirty.push_back(q.id);
    }
}

/// Adapts a [`DeliverySink`] to the queue machine's [`Checkout`].
struct SinkCheckout<'a> {
    sink: &'a mut dyn DeliverySink,
    queue: QueueId,
    queue_name: &'a ShortStr,
}

impl Checkout<ConsumerKey, Message> for SinkCheckout<'_> {
    fn has_credit(&mut self, consumer: &ConsumerKey) -> bool {
        self.sink.has_credit(consumer)
    }

    fn deliver(&mut self, d: Deliver<ConsumerKey, Message>) {
        if let Some(consumer) = d.consumer {
            let delivery = Delivery {
                queue: self.queue,
                queue_name: self.queue_name.clone(),
                msg_id: d.msg_id,
                message: d.message,
                redelivered: d.redelivered,
                delivery_count: d.delivery_count,
            };
            self.sink.deliver(&consumer, delivery);
        }
    }
}

/// Removes an exchange and every binding it takes part in; source exchanges left without
/// bindings that are auto-delete go too (a worklist, so chains cannot recurse deeply).
fn remove_exchange(vh: &mut VHost, queues: &mut HashMap<QueueId, Queue>, name: &str) {
    let mut work: Vec<ShortStr> = vec![short(name)];
    while let Some(name) = work.pop() {
        let Some(x) = vh.exchanges.remove(&name) else {
            continue;
        };
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
fn maybe_auto_delete(vh: &mut VHost, queues: &mut HashMap<QueueId, Queue>, source: &str) {
    if vh
        .exchanges
        .get(source)
        .is_some_and(|x| x.auto_delete && x.binding_count() == 0)
    {
        remove_exchange(vh, queues, source);
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
            consumers: BTreeMap::new(),
            exclusive: HashMap::new(),
            dirty: VecDeque::new(),
            scratch_dests: Vec::new(),
            scratch_queues: Vec::new(),
            now_ms: 0,
        };
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
            .and_then(|id| self.queues.get(id))
            .ok_or_else(|| no_queue(name, vhost))
    }

    fn queue_by_name_mut(&mut self, vhost: &str, name: &str) -> Result<&mut Queue, AmqpError> {
        let vh = self.vhosts.get(vhost).ok_or_else(|| no_vhost(vhost))?;
        vh.queues
            .get(name)
            .and_then(|id| self.queues.get_mut(id))
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

    // ---------------------------------------------------------------- queues

    pub fn declare_queue(
        &mut self,
        vhost: &str,
        req: DeclareQueue,
        conn: ConnId,
    ) -> Result<QueueDeclared, AmqpError> {
        let stripped = strip_cr_lf(&req.name);
        if req.passive {
            let q = self.queue_by_name(vhost, &stripped)?;
            check_access(q, conn)?;
            return Ok(declared(q));
        }
        let vh = self.vhosts.get(vhost).ok_or_else(|| no_vhost(vhost))?;
        let name = if stripped.is_empty() {
            loop {
                let n = self.names.generate("amq.gen");
                if !vh.queues.contains_key(n.as_str()) {
                    break ShortStr::from_string(n);
                }
            }
        } else if stripped.starts_with("amq.") {
            return Err(AmqpError::access_refused(format!(
                "queue name '{stripped}' contains reserved prefix 'amq.*'"
            )));
        } else if let Cow::Owned(s) = stripped {
            ShortStr::from_string(s)
        } else {
            // Kept for the queue's life: not a slice of the client's read buffer.
            req.name.detached()
        };
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
            return Ok(declared(q));
        }

        if let Some(max) = self.config.max_queues {
            if vh.queues.len() >= max {
                return Err(AmqpError::precondition_failed(format!(
                    "cannot declare queue '{name}': queue limit in vhost '{vhost}' ({max}) is reached"
                )));
            }
        }
        args::check_dlx_type(&req.arguments, &rs)?;
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

        let id = QueueId(self.next_queue);
        self.next_queue += 1;
        let q = Queue {
            id,
            name: name.clone(),
            vhost: vhost.to_owned(),
            durable,
            auto_delete: req.auto_delete,
            owner,
            arguments: req.arguments.detached(),
            args: parsed,
            machine: QueueMachine::new(),
            consumers: Vec::new(),
            exclusive_consumer: None,
            has_had_consumers: false,
            bindings: Vec::new(),
            dirty: false,
        };
        let out = declared(&q);
        if let Some(vh) = self.vhosts.get_mut(vhost) {
            vh.queues.insert(name, id);
        }
        if let Some(o) = owner {
            self.exclusive.entry(o).or_default().push(id);
        }
        self.queues.insert(id, q);
        Ok(out)
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
        if if_unused && !q.consumers.is_empty() {
            return Err(AmqpError::precondition_failed(format!("{} in use", q.rs())));
        }
        Ok(self.remove_queue(id).unwrap_or_default())
    }

    /// Deletes a queue outright: its consumers (returned, to be told with basic.cancel), its
    /// bindings (and auto-delete exchanges left without bindings), its messages.
    fn remove_queue(&mut self, id: QueueId) -> Option<QueueDeleted> {
        let q = self.queues.remove(&id)?;
        if let Some(vh) = self.vhosts.get_mut(&q.vhost) {
            if vh.queues.get(&q.name) == Some(&id) {
                vh.queues.remove(&q.name);
            }
            let dest = Dest::Queue(id);
            for (x, key, args) in &q.bindings {
                if let Some(ex) = vh.exchanges.get_mut(x) {
                    ex.unbind(&dest, key, args);
                }
                maybe_auto_delete(vh, &mut self.queues, x);
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
        let cancelled: Vec<ConsumerKey> = q.consumers.into_iter().map(|(k, _)| k).collect();
        for k in &cancelled {
            self.consumers.remove(k);
        }
        Some(QueueDeleted {
            message_count: u32::try_from(q.machine.ready_count()).unwrap_or(u32::MAX),
            cancelled,
        })
    }

    /// Removes the READY messages; in-flight ones stay. Returns how many were removed.
    pub fn purge_queue(&mut self, vhost: &str, name: &str, conn: ConnId) -> Result<u32, AmqpError> {
        let name = strip_cr_lf(name);
        let q = self.queue_by_name_mut(vhost, &name)?;
        check_access(q, conn)?;
        Ok(q.machine.purge())
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
        let kind = ExchangeKind::parse(kind)
            .ok_or_else(|| AmqpError::command_invalid(format!("unknown exchange type '{kind}'")))?;
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
                let name = short(&name);
                vh.exchanges.insert(
                    name.clone(),
                    Exchange::new(
                        name.clone(),
                        kind,
                        durable,
                        auto_delete,
                        internal,
                        arguments.detached(),
                    ),
                );
                return Ok(());
            }
        };
        // rabbit_exchange:assert_equivalence/6
        if x.kind != kind {
            return Err(AmqpError::precondition_failed(format!(
                "inequivalent arg 'type' for {rs}: received '{}' but current is '{}'",
                kind.as_str(),
                x.kind.as_str()
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
        remove_exchange(vh, &mut self.queues, &name);
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
            q.bindings.push((x.name.clone(), key, arguments));
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
        maybe_auto_delete(vh, &mut self.queues, &exchange);
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
            if let Some(dst) = vh.exchanges.get_mut(&dst_name) {
                remove_one(&mut dst.incoming, &source, &key, arguments);
            }
            maybe_auto_delete(vh, &mut self.queues, &source);
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
        // TTL and delayed delivery will use the time.
        self.now_ms = self.now_ms.max(now_ms);
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
            let mut dests = std::mem::take(&mut self.scratch_dests);
            route(vh, x, routing_key, &message, &mut dests, &mut targets);
            self.scratch_dests = dests;
        }
        let meta = MsgMeta {
            size: message.body.len() as u64,
            expires_at: None,
        };
        let mut routed = 0u32;
        for id in &targets {
            if let Some(q) = self.queues.get_mut(id) {
                q.machine.enqueue(message.clone(), meta);
                mark_dirty(&mut self.dirty, q);
                routed += 1;
            }
        }
        self.scratch_queues = targets;
        Ok(Routed { queues: routed })
    }

    // ------------------------------------------------------------ consumers

    #[allow(clippy::too_many_arguments)]
    pub fn consume(
        &mut self,
        vhost: &str,
        queue: &str,
        consumer: ConsumerKey,
        no_ack: bool,
        exclusive: bool,
        arguments: &FieldTable,
    ) -> Result<QueueId, AmqpError> {
        let queue = strip_cr_lf(queue);
        let q = self.queue_by_name(vhost, &queue)?;
        check_access(q, consumer.conn)?;
        let priority = args::validate_consume(arguments, &q.rs())?;
        if q.exclusive_consumer.is_some() || (exclusive && !q.consumers.is_empty()) {
            return Err(AmqpError::access_refused(format!(
                "queue '{queue}' in vhost '{vhost}' in exclusive use"
            )));
        }
        if self.consumers.contains_key(&consumer) {
            return Err(AmqpError::not_allowed(format!(
                "attempt to reuse consumer tag '{}'",
                consumer.tag
            )));
        }
        let id = q.id;
        let Some(q) = self.queues.get_mut(&id) else {
            return Err(no_queue(&queue, vhost));
        };
        q.machine.add_consumer(consumer.clone(), no_ack);
        q.consumers.push((
            consumer.clone(),
            ConsumerInfo {
                no_ack,
                exclusive,
                priority,
                arguments: arguments.detached(),
            },
        ));
        if exclusive {
            q.exclusive_consumer = Some(consumer.clone());
        }
        q.has_had_consumers = true;
        mark_dirty(&mut self.dirty, q);
        self.consumers.insert(consumer, id);
        Ok(id)
    }

    /// Removes the consumer; its in-flight messages stay in flight (owned by the channel until
    /// acked or the channel closes). auto_delete queues are deleted when their last consumer
    /// goes. Returns false if unknown.
    pub fn cancel(&mut self, queue: QueueId, consumer: &ConsumerKey) -> bool {
        self.cancel_inner(queue, consumer).0
    }

    /// (known, auto-deleted queue)
    fn cancel_inner(&mut self, queue: QueueId, consumer: &ConsumerKey) -> (bool, Option<QueueId>) {
        let Some(q) = self.queues.get_mut(&queue) else {
            return (false, None);
        };
        if !q.machine.remove_consumer(consumer) {
            return (false, None);
        }
        q.consumers.retain(|(k, _)| k != consumer);
        if q.exclusive_consumer.as_ref() == Some(consumer) {
            q.exclusive_consumer = None;
        }
        if self.consumers.get(consumer) == Some(&queue) {
            self.consumers.remove(consumer);
        }
        if q.auto_delete && q.consumers.is_empty() && q.has_had_consumers {
            self.remove_queue(queue);
            return (true, Some(queue));
        }
        (true, None)
    }

    /// The queue a consumer consumes from.
    pub fn consumer_queue(&self, consumer: &ConsumerKey) -> Option<QueueId> {
        self.consumers.get(consumer).copied()
    }

    fn channel_range(conn: ConnId, channel: Option<u16>) -> (ConsumerKey, ConsumerKey) {
        let (lo, hi) = match channel {
            Some(c) => ((conn, c), (conn, c)),
            None => ((conn, 0), (conn, u16::MAX)),
        };
        (
            ConsumerKey {
                conn: lo.0,
                channel: lo.1,
                tag: ShortStr::empty(),
            },
            ConsumerKey {
                conn: hi.0,
                channel: hi.1,
                tag: ShortStr::empty(),
            },
        )
    }

    /// The consumers of one channel (`Some`) or of a whole connection (`None`).
    pub fn consumers_of(&self, conn: ConnId, channel: Option<u16>) -> Vec<(ConsumerKey, QueueId)> {
        let (lo, _) = Self::channel_range(conn, channel);
        self.consumers
            .range(lo..)
            .take_while(|(k, _)| k.conn == conn && channel.is_none_or(|c| k.channel == c))
            .map(|(k, q)| (k.clone(), *q))
            .collect()
    }

    /// Cancels every consumer of a channel (the channel closed). Returns them. Their in-flight
    /// messages stay with the channel, which requeues them.
    pub fn channel_closed(&mut self, conn: ConnId, channel: u16) -> Vec<ConsumerKey> {
        let list = self.consumers_of(conn, Some(channel));
        for (k, q) in &list {
            self.cancel_inner(*q, k);
        }
        list.into_iter().map(|(k, _)| k).collect()
    }

    /// Connection gone: cancels its remaining consumers and deletes its exclusive queues (and
    /// auto-delete queues that lost their last consumer). Returns the deleted queue ids.
    pub fn connection_closed(&mut self, conn: ConnId) -> Vec<QueueId> {
        let mut deleted = Vec::new();
        for (k, q) in self.consumers_of(conn, None) {
            if let (_, Some(gone)) = self.cancel_inner(q, &k) {
                deleted.push(gone);
            }
        }
        if let Some(ids) = self.exclusive.remove(&conn) {
            for id in ids {
                if self.remove_queue(id).is_some() {
                    deleted.push(id);
                }
            }
        }
        deleted
    }

    /// A consumer may have gained credit (ack, qos change): its queue is dispatched again.
    pub fn credit_changed(&mut self, consumer: &ConsumerKey) {
        if let Some(id) = self.consumers.get(consumer) {
            if let Some(q) = self.queues.get_mut(id) {
                mark_dirty(&mut self.dirty, q);
            }
        }
    }

    /// Every consumer of a channel may have gained credit (channel-wide prefetch, writable
    /// socket again).
    pub fn channel_credit_changed(&mut self, conn: ConnId, channel: u16) {
        let (lo, _) = Self::channel_range(conn, Some(channel));
        for (k, id) in self.consumers.range(lo..) {
            if k.conn != conn || k.channel != channel {
                break;
            }
            if let Some(q) = self.queues.get_mut(id) {
                mark_dirty(&mut self.dirty, q);
            }
        }
    }

    /// Is there a queue with work for [`Broker::dispatch`]?
    pub fn needs_dispatch(&self) -> bool {
        !self.dirty.is_empty()
    }

    /// Offers ready messages to consumers with credit, round-robin among a queue's
    /// consumers, for every queue that has work. Each queue makes at most
    /// `config.dispatch_batch` deliveries per call; one with more stays dirty.
    pub fn dispatch(&mut self, sink: &mut dyn DeliverySink) {
        let batch = self.config.dispatch_batch.max(1);
        for _ in 0..self.dirty.len() {
            let Some(id) = self.dirty.pop_front() else {
                break;
            };
            let Some(q) = self.queues.get_mut(&id) else {
                continue;
            };
            q.dirty = false;
            let Queue { machine, name, .. } = &mut *q;
            let mut checkout = SinkCheckout {
                sink: &mut *sink,
                queue: id,
                queue_name: name,
            };
            let delivered = machine.checkout(&mut checkout, batch);
            if delivered >= batch {
                mark_dirty(&mut self.dirty, q);
            }
        }
    }

    // ----------------------------------------------------------------- time

    /// Time passes: the hook for message TTL, `x-expires` and consumer timeouts (none of
    /// which is enforced yet). The server calls it at [`Broker::next_deadline`] or
    /// periodically.
    pub fn tick(&mut self, now_ms: u64) {
        self.now_ms = self.now_ms.max(now_ms);
    }

    /// The earliest time at which [`Broker::tick`] has work to do; `None` while nothing is
    /// time-bound.
    pub fn next_deadline(&self) -> Option<u64> {
        None
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
        let q = self.queue_by_name_mut(vhost, &queue)?;
        check_access(q, conn)?;
        let Some(d) = q.machine.get(no_ack) else {
            return Ok(None);
        };
        let delivery = Delivery {
            queue: q.id,
            queue_name: q.name.clone(),
            msg_id: d.msg_id,
            message: d.message,
            redelivered: d.redelivered,
            delivery_count: d.delivery_count,
        };
        Ok(Some((delivery, q.ready_count())))
    }

    // ----------------------------------------------------------- settlement

    /// Ack: forgets the in-flight message. Unknown ids or queues are ignored (the queue may
    /// be gone).
    pub fn settle(&mut self, queue: QueueId, msg_id: u64) {
        if let Some(q) = self.queues.get_mut(&queue) {
            q.machine.settle(msg_id);
        }
    }

    /// nack/reject with requeue, channel closed: the message goes back to its original
    /// position and is redelivered=true on its next delivery.
    pub fn requeue(&mut self, queue: QueueId, msg_id: u64) {
        if let Some(q) = self.queues.get_mut(&queue) {
            if q.machine.requeue(msg_id) {
                mark_dirty(&mut self.dirty, q);
            }
        }
    }

    /// reject/nack without requeue: the message leaves the queue and goes to
    /// the dead-lettering hook (`Broker::dead_letter`, private; dropped for now).
    pub fn discard(&mut self, queue: QueueId, msg_id: u64) {
        let Some(q) = self.queues.get_mut(&queue) else {
            return;
        };
        if let Some(discarded) = q.machine.discard(msg_id) {
            self.dead_letter(queue, discarded, DeadLetterReason::Rejected);
        }
    }

    /// The dead-lettering hook: every message that leaves a queue unacknowledged (rejected
    /// now; expired, over max-length or over the delivery limit later) comes here. Not
    /// implemented yet: the message is dropped. With `x-dead-letter-exchange` set
    /// (`QueueArgs::dead_letter_exchange`), it is to be republished there with `x-death`.
    fn dead_letter(
        &mut self,
        queue: QueueId,
        discarded: Discarded<Message>,
        reason: DeadLetterReason,
    ) {
        let _ = (queue, discarded, reason);
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
