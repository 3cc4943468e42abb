//! Metadata: virtual hosts, queue and exchange declarations and deletions, bindings.

use super::metadata_ops::MetaOp;
use super::*;

/// An exchange.declare `type` (and, for `x-delayed-message`, its `x-delayed-type` argument):
/// how the exchange routes, and whether it delays. The plugin's replies.
pub(super) fn exchange_type(
    kind: &str,
    arguments: &FieldTable,
) -> Result<(ExchangeKind, bool), AmqpError> {
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
pub(super) fn type_name(kind: ExchangeKind, delayed: bool) -> &'static str {
    if delayed {
        DELAYED_TYPE
    } else {
        kind.as_str()
    }
}

/// RabbitMQ strips CR and LF from queue and exchange names.
pub(super) fn strip_cr_lf(name: &str) -> Cow<'_, str> {
    if name.contains(['\r', '\n']) {
        Cow::Owned(name.chars().filter(|c| *c != '\r' && *c != '\n').collect())
    } else {
        Cow::Borrowed(name)
    }
}

/// Recovery: stored arguments with a deduplication window over today's limits brought down
/// to them (said in the log), rather than a queue or exchange left unrecovered.
pub(super) fn restorable(
    arguments: &FieldTable,
    kind: &str,
    name: &str,
    vhost: &str,
) -> Option<FieldTable> {
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

pub(super) fn locked(q: &Queue) -> AmqpError {
    AmqpError::resource_locked(format!(
        "cannot obtain exclusive access to locked {}. It could be originally declared on \
         another connection or the exclusive property value does not match that of the \
         original declaration.",
        q.rs()
    ))
}

pub(super) fn check_access(q: &Queue, conn: ConnId) -> Result<(), AmqpError> {
    if q.accessible_by(conn) {
        Ok(())
    } else {
        Err(locked(q))
    }
}

pub(super) fn declared(q: &Queue) -> QueueDeclared {
    QueueDeclared {
        queue: q.id,
        name: q.name.clone(),
        message_count: q.ready_count(),
        consumer_count: q.consumer_count(),
    }
}

/// The store's name for a binding's destination, if the binding is durable (both ends are).
pub(super) fn durable_dest(
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

pub(super) fn binding_def(
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
/// A binding as the metadata group carries it.
pub(super) fn cluster_binding(
    vhost: &str,
    source: &str,
    dest: BindingDest,
    key: &str,
    arguments: &FieldTable,
) -> super::metadata_ops::Binding {
    super::metadata_ops::Binding {
        vhost: vhost.to_owned(),
        source: source.to_owned(),
        dest,
        key: key.to_owned(),
        arguments: arguments.detached(),
    }
}

#[allow(clippy::too_many_arguments)]
pub(super) fn persist_binding(
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
pub(super) fn remove_exchange(
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
pub(super) fn drop_held(
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
pub(super) fn remove_one(
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
pub(super) fn maybe_auto_delete(
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

    pub(super) fn vhost(&self, vhost: &str) -> Result<&VHost, AmqpError> {
        self.vhosts.get(vhost).ok_or_else(|| no_vhost(vhost))
    }

    pub(super) fn queue_by_name(&self, vhost: &str, name: &str) -> Result<&Queue, AmqpError> {
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

    /// queue.declare, answered at once: a quorum queue in a cluster is made here first and
    /// then announced (recovery, tests, and callers that cannot wait).
    pub fn declare_queue(
        &mut self,
        vhost: &str,
        req: DeclareQueue,
        conn: ConnId,
    ) -> Result<QueueDeclared, AmqpError> {
        match self.declare_queue_with(vhost, req, conn, None, false)? {
            Declared::Now(d) => Ok(d),
            Declared::Waiting(_) => Err(AmqpError::internal_error(
                "a declaration that cannot wait was sent to the cluster",
            )),
        }
    }

    /// queue.declare by a user whose permissions are checked where RabbitMQ checks them:
    /// configure on the queue (by its generated name for a server-named one), and for a new
    /// queue with a dead-letter exchange, read on the queue and write on that exchange. A
    /// new quorum queue in a cluster whose nodes all number groups by the metadata log is
    /// made when the log applies its declaration, here as on every node: the answer is
    /// then a ticket, and comes from [`Broker::take_declare_answers`].
    pub fn declare_queue_as(
        &mut self,
        vhost: &str,
        req: DeclareQueue,
        conn: ConnId,
        user: Option<&str>,
    ) -> Result<Declared, AmqpError> {
        self.declare_queue_with(vhost, req, conn, user, true)
    }

    fn declare_queue_with(
        &mut self,
        vhost: &str,
        mut req: DeclareQueue,
        conn: ConnId,
        user: Option<&str>,
        may_wait: bool,
    ) -> Result<Declared, AmqpError> {
        use crate::access::{Perm, Resource};
        use crate::limits::{LimitScope, MAX_QUEUES};
        let stripped = strip_cr_lf(&req.name);
        if req.passive {
            let q = self.queue_by_name(vhost, &stripped)?;
            check_access(q, conn)?;
            let (id, out) = (q.id, declared(q));
            self.touch(id);
            return Ok(Declared::Now(out));
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
        // The vhost's default type, else the node's, for a declaration that names none and
        // whose queue may have it (RabbitMQ's `default_queue_type`; a transient, exclusive,
        // auto-delete or server-named queue stays classic: a client's private reply queue
        // has no use for a cluster). A queue that exists keeps its type: the declaration is
        // equivalent whatever the type (RabbitMQ 3.x refused an existing classic queue once
        // the default changed, and workers that redeclare their queue broke).
        let default_type = vh
            .meta
            .default_queue_type
            .unwrap_or(self.config.default_queue_type);
        // A declaration a default applies to: it may find a queue of either type, once any
        // default was set (a vhost switched back to classic keeps its quorum queues, and
        // their workers' declarations must not fail).
        let untyped = !self.restoring
            && !self.meta_quiet
            && durable
            && !req.auto_delete
            && !req.name.is_empty()
            && req.arguments.get("x-queue-type").is_none();
        let lenient = untyped
            && (vh.meta.default_queue_type.is_some()
                || self.config.default_queue_type != QueueType::Classic);
        let defaulted = untyped && default_type != QueueType::Classic;
        if let Some(pending) = self
            .pending_declaration(vhost, &name)
            .filter(|_| !self.restoring)
        {
            // A quorum queue of that name is being made by the cluster for a client here: as
            // good as there for another declaration (which goes to the log too, if equal).
            args::assert_args_equivalence(
                pending,
                &req.arguments,
                &rs,
                unless_defaulted(QueueType::Quorum.equivalence_keys(), lenient),
            )?;
        }

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
                unless_defaulted(q.args.queue_type.equivalence_keys(), lenient),
            )?;
            let (id, out) = (q.id, declared(q));
            self.touch(id);
            return Ok(Declared::Now(out));
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
        if defaulted {
            // Kept in the queue's arguments, as RabbitMQ keeps it: the API shows the type,
            // and a restart or another node reads it back.
            req.arguments
                .insert("x-queue-type", FieldValue::long_str(default_type.as_str()));
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
        let mut parsed = args::validate(&req.arguments, &rs)?;
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

        let (policy_name, operator_policy, effective) =
            self.queue_policies(vhost, &name, parsed.queue_type, &req.arguments);
        if let Some(eff) = effective {
            parsed = self.effective_args(&eff, &rs, parsed);
        }

        if may_wait
            && parsed.queue_type == QueueType::Quorum
            && !self.restoring
            && !self.meta_quiet
            && self.cluster.is_some()
        {
            let leader = self.first_leader(parsed.balanced_leader);
            let arguments = req.arguments.detached();
            if let Some(ticket) = self.declare_through_log(vhost, name, arguments, leader, conn) {
                return Ok(Declared::Waiting(ticket));
            }
            return Err(AmqpError::internal_error(format!(
                "Cannot declare a {rs}: the cluster could not be told"
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
                        group: self.group_hint,
                        voters: self.voters_hint.clone(),
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
            policy: policy_name,
            operator_policy,
            machine: QueueMachine::new(),
            bindings: Vec::new(),
            dirty: false,
            scheduled: None,
            store_key,
            incarnation,
            load_retry_at: None,
            spill_key: None,
            stats: Box::default(),
            replica: None,
        };
        let mut q = q;
        let leader = self.attach_replica(&mut q);
        if q.replica.is_some() && !self.restoring {
            self.announce_declare(vhost, &q.name, &q.arguments, leader);
        }
        let out = declared(&q);
        let rules = self.level_rules(q.replica.is_some());
        let policy = super::held_dead_letters::queue_policy(&q.args, rules);
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
        Ok(Declared::Now(out))
    }

    /// A number no queue or exchange had, in this run or an earlier one: a body key with a
    /// store (reserved on disk like any), else a counter.
    pub(super) fn incarnation(&mut self) -> u64 {
        match self.persist.as_mut() {
            Some(p) => p.body_key(),
            None => {
                self.last_incarnation += 1;
                self.last_incarnation
            }
        }
    }

    /// A declaration renews an `x-expires` lease (nothing to log for other queues).
    pub(super) fn touch(&mut self, id: QueueId) {
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
        if if_unused && q.machine.consumer_count() + self.unlogged_consumers(id) > 0 {
            return Err(AmqpError::precondition_failed(format!("{} in use", q.rs())));
        }
        Ok(self.remove_queue(id).unwrap_or_default())
    }

    /// Deletes a queue outright: its consumers (returned, to be told with basic.cancel), its
    /// bindings (and auto-delete exchanges left without bindings), its messages.
    pub(super) fn remove_queue(&mut self, id: QueueId) -> Option<QueueDeleted> {
        let q = self.queues.remove(&id)?;
        self.detach_replica(&q);
        self.cycles_reported.remove(&id);
        let refusing = refuses(&policy(&q.args));
        if refusing {
            self.refusing_queues = self.refusing_queues.saturating_sub(1);
        }
        if q.args.delivery_delay_ms.is_some() {
            self.delaying_queues = self.delaying_queues.saturating_sub(1);
        }
        // What it holds: its own delayed copies, releases it refused when they fell due, and on
        // a cluster the copies a delayed exchange routed to it when they were published.
        if refusing
            || q.args.delivery_delay_ms.is_some()
            || (self.cluster.is_some() && self.scheduler.count() > 0)
        {
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
            // Each copy on disk holds its body (a copy in memory only has no key). A replicated
            // queue's messages are in its log, never under a key of this node's store: its line
            // is not walked (a deep one's spilled runs would be read back for nothing).
            if q.replica.is_none() {
                for (_, m, _) in q.machine.messages() {
                    if let Some(body) = m.store_key {
                        p.release_body(body);
                    }
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
        let classic = self.queues.get(&id).filter(|q| q.replica.is_none());
        if let (Some(p), Some(q)) = (self.persist.as_mut(), classic) {
            for (msg_id, m, count) in q.machine.ready_messages() {
                if let (Some(key), Some(body)) = (q.entry_key(&m), m.store_key) {
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
                let policy =
                    self.policies
                        .matching(vhost, PolicyKind::User, &name, Target::Exchange);
                x.policy = policy.map(|p| p.name.clone());
                x.policy_alternate =
                    crate::policy::alternate_exchange(policy).map(ShortStr::from_string);
                vh.exchanges.insert(name.clone(), x);
                if durable {
                    self.announce(MetaOp::DeclareExchange {
                        vhost: vhost.to_owned(),
                        name: name.to_string(),
                        kind: type_name(kind, delayed).to_owned(),
                        auto_delete,
                        internal,
                        arguments: arguments.detached(),
                    });
                }
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
        let durable = x.durable;
        remove_exchange(
            vhost,
            vh,
            &mut self.queues,
            self.persist.as_mut(),
            &mut self.scheduler,
            &name,
        );
        if durable {
            self.announce(MetaOp::DeleteExchange {
                vhost: vhost.to_owned(),
                name: name.to_string(),
            });
        }
        Ok(())
    }

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
            if x.durable && q.replica.is_some() {
                let b = cluster_binding(
                    vhost,
                    &x.name,
                    BindingDest::Queue(q.name.clone()),
                    &key,
                    &arguments,
                );
                self.announce_binding(true, b);
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
        let told = (x.durable && q.replica.is_some()).then(|| {
            cluster_binding(
                vhost,
                &x.name,
                BindingDest::Queue(q.name.clone()),
                &key,
                arguments,
            )
        });
        maybe_auto_delete(
            vhost,
            vh,
            &mut self.queues,
            self.persist.as_mut(),
            &mut self.scheduler,
            &exchange,
        );
        if let Some(b) = told {
            self.announce_binding(false, b);
        }
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
        let durable = src.durable && dst.durable;
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
                dst.incoming
                    .push((src_name.clone(), key.clone(), arguments.clone()));
            }
            if durable {
                let b = cluster_binding(
                    vhost,
                    &src_name,
                    BindingDest::Exchange(dst_name),
                    &key,
                    arguments,
                );
                self.announce_binding(true, b);
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
        let durable = vh.exchanges.get(&*destination).is_some_and(|x| x.durable)
            && vh.exchanges.get(&*source).is_some_and(|x| x.durable);
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
            if durable {
                let b = cluster_binding(
                    vhost,
                    &source,
                    BindingDest::Exchange(dst_name),
                    &key,
                    arguments,
                );
                self.announce_binding(false, b);
            }
        }
        Ok(())
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
}

/// The arguments a redeclaration is compared on, without `x-queue-type` when the declaration
/// named none and a default type (the vhost's or the node's) was set for such a queue.
fn unless_defaulted(
    keys: impl Iterator<Item = &'static str>,
    defaulted: bool,
) -> impl Iterator<Item = &'static str> {
    keys.filter(move |k| !(defaulted && *k == "x-queue-type"))
}
