//! Policies in the broker: setting or clearing one re-applies every policy of its vhost to
//! each queue and exchange there, so a change reaches existing queues without a redeclare
//! (as a `Configure` command to each queue whose arguments it changes).

use super::*;
use crate::policy::{Definition, PolicyDef, PolicyError, PolicyTable};

/// What a queue's user and operator policies set together.
pub(super) fn definition_of(q: &Queue, policies: &PolicyTable) -> Definition {
    let get = |kind, name: &Option<String>| {
        name.as_deref()
            .and_then(|n| policies.get(&q.vhost, kind, n))
    };
    crate::policy::effective_definition(
        get(PolicyKind::User, &q.policy),
        get(PolicyKind::Operator, &q.operator_policy),
    )
}

impl Broker {
    pub fn policies(&self) -> &PolicyTable {
        &self.policies
    }

    /// Sets (or replaces) a policy, then applies it to what it matches now and what the
    /// policy it replaces matched.
    pub fn set_policy(&mut self, def: PolicyDef) -> Result<(), PolicyError> {
        if !self.vhost_exists(&def.vhost) {
            return Err(PolicyError::NoVhost(def.vhost));
        }
        self.policies.put(def.clone())?;
        let vhost = def.vhost.clone();
        tracing::info!(vhost = %vhost, policy = %def.name, kind = ?def.kind, "policy set");
        self.write_def(StoreOp::PutPolicy(def.clone()));
        self.announce(super::metadata_ops::MetaOp::PutPolicy(def));
        self.apply_policies(&vhost);
        Ok(())
    }

    /// Clears a policy; false if there was none of that name.
    pub fn clear_policy(&mut self, vhost: &str, kind: PolicyKind, name: &str) -> bool {
        if self.policies.remove(vhost, kind, name).is_none() {
            return false;
        }
        tracing::info!(vhost, policy = name, ?kind, "policy cleared");
        self.write_def(StoreOp::DeletePolicy {
            vhost: vhost.to_owned(),
            kind,
            name: name.to_owned(),
        });
        self.announce(super::metadata_ops::MetaOp::DeletePolicy {
            vhost: vhost.to_owned(),
            kind,
            name: name.to_owned(),
        });
        self.apply_policies(vhost);
        true
    }

    /// A deleted vhost's policies go too, on disk as well.
    pub(super) fn forget_policies(&mut self, vhost: &str) {
        for (kind, name) in self.policies.forget_vhost(vhost) {
            self.write_def(StoreOp::DeletePolicy {
                vhost: vhost.to_owned(),
                kind,
                name,
            });
        }
    }

    /// Recovery: a stored policy comes back (queues are restored after it, and pick it up).
    pub(super) fn restore_policy(&mut self, def: &PolicyDef) -> Result<(), AmqpError> {
        if !self.vhost_exists(&def.vhost) {
            return Err(AmqpError::not_found(format!(
                "vhost {} not found",
                def.vhost
            )));
        }
        self.policies
            .put(def.clone())
            .map_err(|e| AmqpError::precondition_failed(e.to_string()))
    }

    /// After recovery: the stored expiry of a message predates any TTL a policy lowered since
    /// (the queue machine's caps live in memory), so every restored message of a queue with a
    /// TTL expires by now plus that TTL at the latest (it was enqueued before now: never
    /// early; a message whose stored expiry is sooner keeps it). Not on a replicated queue:
    /// its messages come back from its log with the expiries they were enqueued with, and a
    /// cap applied by one member alone, outside the log, would set it apart from the others.
    pub fn cap_restored_expiries(&mut self, now_ms: u64) {
        self.now_ms = self.now_ms.max(now_ms);
        let due: Vec<(QueueId, u64)> = self
            .queues
            .values()
            .filter(|q| q.replica.is_none())
            .filter(|q| q.policy.is_some() || q.operator_policy.is_some())
            .filter(|q| q.machine.ready_count() + q.machine.in_flight_count() > 0)
            .filter_map(|q| q.args.message_ttl_ms.map(|ttl| (q.id, ttl)))
            .collect();
        for (id, ttl) in due {
            let caps = vec![(u64::MAX, self.now_ms.saturating_add(ttl))];
            self.run(id, Command::CapExpiry { caps });
            self.finish_effects(id);
        }
        self.dead_letter_pending();
    }

    /// The user and operator policies of a queue, and the arguments it then acts on (`None`
    /// when no policy applies: its own).
    pub(super) fn queue_policies(
        &self,
        vhost: &str,
        name: &str,
        qtype: QueueType,
        declared: &FieldTable,
    ) -> (Option<String>, Option<String>, Option<FieldTable>) {
        if self.policies.is_empty() {
            return (None, None, None);
        }
        let t = Target::Queue(qtype);
        let user = self.policies.matching(vhost, PolicyKind::User, name, t);
        let op = self.policies.matching(vhost, PolicyKind::Operator, name, t);
        if user.is_none() && op.is_none() {
            return (None, None, None);
        }
        let def = crate::policy::effective_definition(user, op);
        let effective = crate::policy::effective_arguments(declared, qtype, &def);
        (
            user.map(|p| p.name.clone()),
            op.map(|p| p.name.clone()),
            Some(effective),
        )
    }

    /// The effective arguments parsed; arguments a queue's own validation would refuse (a
    /// policy's `dead-letter-routing-key` without a dead-letter exchange, a TTL past ten
    /// years) leave the queue on its own.
    pub(super) fn effective_args(
        &self,
        effective: &FieldTable,
        rs: &str,
        own: args::QueueArgs,
    ) -> args::QueueArgs {
        match args::validate(effective, rs) {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(resource = rs, error = %e.text, "policy not applied: the arguments it makes are invalid");
                own
            }
        }
    }

    /// The effective policy definition of a queue (`effective_policy_definition`).
    pub fn queue_policy_definition(&self, queue: QueueId) -> Definition {
        self.queues
            .get(&queue)
            .map(|q| definition_of(q, &self.policies))
            .unwrap_or_default()
    }

    /// Works out every queue's and exchange's policies in a vhost again and applies what
    /// changed.
    fn apply_policies(&mut self, vhost: &str) {
        let Some(vh) = self.vhosts.get_mut(vhost) else {
            return;
        };
        for x in vh.exchanges.values_mut() {
            let p = self
                .policies
                .matching(vhost, PolicyKind::User, &x.name, Target::Exchange);
            x.policy = p.map(|p| p.name.clone());
            x.policy_alternate = crate::policy::alternate_exchange(p).map(ShortStr::from_string);
        }
        let mut ids: Vec<QueueId> = vh.queues.values().copied().collect();
        ids.sort();
        for id in ids {
            self.reapply_queue(id);
        }
        // A policy's `target-group-size` may leave queues short of it.
        self.reconcile_soon();
        // What a lowered limit dropped goes to its dead-letter exchange now.
        self.dead_letter_pending();
    }

    pub(super) fn reapply_queue(&mut self, id: QueueId) {
        let Some(q) = self.queues.get(&id) else {
            return;
        };
        let rs = q.rs();
        let (user, op, effective) =
            self.queue_policies(&q.vhost, &q.name, q.args.queue_type, &q.arguments);
        let Ok(own) = args::validate(&q.arguments, &rs) else {
            return;
        };
        let new = match effective {
            Some(eff) => self.effective_args(&eff, &rs, own),
            None => own,
        };
        let replicated = self.queues.get(&id).is_some_and(|q| q.replica.is_some());
        let rules = self.level_rules(replicated);
        let Some(q) = self.queues.get_mut(&id) else {
            return;
        };
        q.policy = user;
        q.operator_policy = op;
        if q.args == new {
            return;
        }
        let (before, after) = (
            super::held_dead_letters::queue_policy(&q.args, rules),
            super::held_dead_letters::queue_policy(&new, rules),
        );
        match (refuses(&before), refuses(&after)) {
            (false, true) => self.refusing_queues += 1,
            (true, false) => self.refusing_queues = self.refusing_queues.saturating_sub(1),
            _ => {}
        }
        match (
            q.args.delivery_delay_ms.is_some(),
            new.delivery_delay_ms.is_some(),
        ) {
            (false, true) => self.delaying_queues += 1,
            (true, false) => self.delaying_queues = self.delaying_queues.saturating_sub(1),
            _ => {}
        }
        if q.args.dedup != new.dedup {
            match (q.dedup.is_some(), new.dedup.is_some()) {
                (false, true) => self.dedup_queues += 1,
                (true, false) => self.dedup_queues = self.dedup_queues.saturating_sub(1),
                _ => {}
            }
            q.dedup = new
                .dedup
                .clone()
                .map(|s| Box::new(crate::dedup::Dedup::new(s)));
        }
        tracing::debug!(queue = %q.name, vhost = %q.vhost, policy = ?q.policy, operator_policy = ?q.operator_policy, "queue arguments changed by a policy");
        // A lower TTL reaches what is queued already (RabbitMQ's does not; a policy that
        // shortens a TTL is meant to shed the backlog it finds). Not on a replicated queue:
        // the caps come from this node's own record of enqueue times, and each member would
        // apply its own, outside the log (there, as in RabbitMQ, the new TTL applies to the
        // messages that come after the change).
        let caps = match (q.args.message_ttl_ms, new.message_ttl_ms) {
            _ if q.replica.is_some() => None,
            (old, Some(ttl)) if old.is_none_or(|old| ttl < old) => {
                Some(q.stats.enqueue_times.expiry_caps(ttl, self.now_ms))
            }
            _ => None,
        };
        q.args = new;
        if before != after {
            self.run(id, Command::Configure(after));
            // A lowered limit drops messages: their store entries go, their dead letters
            // are queued.
            self.finish_effects(id);
        }
        if let Some(caps) = caps {
            self.run(id, Command::CapExpiry { caps });
            self.finish_effects(id);
        }
    }
}
