//! The publish pipeline: routing, deduplication, the copies a message leaves in its queues.

use super::*;

/// A message's own TTL (the `expiration` property, validated by the session), in ms.
pub(super) fn message_ttl(message: &Message) -> Option<u64> {
    warren_codec::properties::expiration(&message.properties)?
        .parse()
        .ok()
}

/// When a message enqueued `now` expires in this queue: the shorter of the queue's TTL and
/// the message's own.
pub(super) fn expiry(q: &Queue, own_ttl: Option<u64>, now: u64) -> Option<u64> {
    let ttl = match (q.args.message_ttl_ms, own_ttl) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    ttl.map(|t| now.saturating_add(t))
}

/// Publishes a quorum queue holds in its log until due ([`Command::EnqueueWith`]), at most.
/// Past the window, the contents of those not due soon leave each member's memory as a deep
/// queue's do (`Broker::send_away`): each keeps about 300 bytes of memory on every member
/// (twice that on the leader, which holds the queue's state twice), and its bytes in the
/// queue's snapshots. Past this many, or [`HELD_IN_LOG_BYTES`] of bodies, a delayed publish
/// waits on the disk of the node that takes it, as it did before, where memory stays bounded
/// however many wait.
pub(super) const HELD_IN_LOG_MESSAGES: usize = 262_144;
pub(super) const HELD_IN_LOG_BYTES: u64 = 256 << 20;
/// The same bounds on a node whose messages cannot leave memory (it has no away store): held
/// publishes are whole in memory there.
pub(super) const HELD_IN_MEMORY_MESSAGES: usize = 16_384;
pub(super) const HELD_IN_MEMORY_BYTES: u64 = 16 << 20;

/// Whether a quorum queue holds as many publishes as it takes in its log
/// ([`HELD_IN_LOG_MESSAGES`]; `away`: whether this node's messages can leave memory).
fn held_full(q: &Queue, away: bool) -> bool {
    let (count, bytes) = q.machine.held_count();
    match away {
        true => count >= HELD_IN_LOG_MESSAGES || bytes >= HELD_IN_LOG_BYTES,
        false => count >= HELD_IN_MEMORY_MESSAGES || bytes >= HELD_IN_MEMORY_BYTES,
    }
}

/// A message's priority in this queue (`x-max-priority`): its `priority` property, capped. In
/// a queue with message groups, none: a group's order is its publish order.
pub(super) fn priority(q: &Queue, message: &Message) -> u8 {
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
pub(super) fn message_group(q: &Queue, message: &Message) -> Option<crate::machine::GroupKey> {
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

/// Collects the queues a message goes to from exchange `start`: follows exchange-to-exchange
/// bindings (each exchange visited once, so cycles end) and alternate exchanges (used when an
/// exchange itself routes nowhere, as RabbitMQ does); `out` ends sorted and deduplicated.
pub(super) fn route(
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
            } else if let Some(ae) = &x.policy_alternate {
                dests.push(Dest::Exchange(ae.clone()));
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

impl Broker {
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

    /// Routes and enqueues. Errors: 404 no exchange, 403 internal exchange, 406 message too
    /// large. A channel's publish on a cluster runs inside its hold ([`Broker::open_hold`]);
    /// any other (the management API's, SQS's) gets a hold of its own, which the store batch
    /// its confirm waits in waits for.
    pub fn publish(
        &mut self,
        vhost: &str,
        exchange: &str,
        routing_key: &str,
        message: Message,
        now_ms: u64,
    ) -> Result<Routed, AmqpError> {
        let own = match self.cluster.as_mut() {
            Some(c) if !c.holds.is_open() => {
                c.holds.open();
                true
            }
            _ => false,
        };
        let routed = self.publish_in_hold(vhost, exchange, routing_key, message, now_ms);
        if !own {
            return routed;
        }
        let hold = self.close_hold();
        let waits = self.batch_waits_for(hold);
        routed.map(|r| Routed {
            batch: r.batch.max(waits),
            ..r
        })
    }

    fn publish_in_hold(
        &mut self,
        vhost: &str,
        exchange: &str,
        routing_key: &str,
        message: Message,
        now_ms: u64,
    ) -> Result<Routed, AmqpError> {
        self.now_ms = self.now_ms.max(now_ms);
        let routed = match self.exchange_verdict(vhost, exchange, &message) {
            Verdict::Duplicate { batch, hold } => {
                // Its confirm is the first copy's, which may still wait for its entries.
                let waits = self.duplicate_of(hold);
                Ok(Routed {
                    // Dropped, and confirmed as the first copy is (once it is on disk).
                    queues: 1,
                    batch: batch.max(waits),
                    rejected: false,
                    unled: false,
                    full: false,
                })
            }
            verdict => {
                let routed = self.publish_to(vhost, exchange, routing_key, message, None, false);
                if let (Verdict::New(pending), Ok(r)) = (verdict, &routed) {
                    // Remembered once a queue took it: a nacked or unroutable first copy
                    // leaves its retry new.
                    if r.queues > 0 && !r.rejected {
                        let now = self.now_ms;
                        let hold = self.cluster.as_ref().map_or(0, |c| c.holds.routed());
                        if let Some(d) = self.exchange_dedup(vhost, exchange) {
                            d.remember(pending, r.batch, hold, now);
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
    pub(super) fn exchange_dedup(
        &mut self,
        vhost: &str,
        exchange: &str,
    ) -> Option<&mut crate::dedup::Dedup> {
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
    pub(super) fn exchange_verdict(
        &mut self,
        vhost: &str,
        exchange: &str,
        message: &Message,
    ) -> Verdict {
        if message.body.len() > self.config.max_message_size {
            return Verdict::Unjudged;
        }
        let (now, disk) = (self.now_ms, self.disk);
        if !self.dedup_exchanges || exchange.is_empty() {
            return Verdict::Unjudged;
        }
        let holds = self.cluster.as_ref().map(|c| &c.holds);
        let Some(d) = self
            .vhosts
            .get_mut(vhost)
            .and_then(|vh| vh.exchanges.get_mut(exchange))
            .and_then(|x| x.dedup.as_deref_mut())
        else {
            return Verdict::Unjudged;
        };
        let headers = warren_codec::properties::headers(&message.properties)
            .ok()
            .flatten();
        d.judge(headers.as_ref(), &message.properties, now, disk, holds)
    }

    /// Routes and enqueues; `death`: the message is a dead letter (its reason, and its
    /// `x-death` header after this death), and queues it would cycle back to are left out.
    pub(super) fn publish_to(
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
        let mut exchange_delay: Option<u64> = None;
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
            // A delayed exchange's message with a delay waits at the exchange, routed when due
            // (as the plugin does), unless on a cluster its bindings route it to a quorum queue
            // now: then each queue it reaches holds its copy until due (below), as a queue's
            // own `x-delivery-delay` does; held on this node's disk alone, it would be lost with
            // that disk, and late while this node is down.
            let delay = if x.delayed && !released {
                let headers = warren_codec::properties::headers(&message.properties);
                delayed::header_delay(headers.ok().flatten().as_ref())
            } else {
                None
            };
            // Every node reads a publish held in a quorum queue's log.
            let held_in_logs = delay.is_some()
                && self.cluster.is_some()
                && self
                    .cluster_feature_level()
                    .is_some_and(|l| l >= super::metadata_group::HELD_LEVEL);
            if delay.is_none() || held_in_logs {
                let mut dests = std::mem::take(&mut self.scratch_dests);
                route(vh, x, routing_key, &message, &mut dests, &mut targets);
                for key in death.iter().flat_map(|(_, _, cc)| cc) {
                    route(vh, x, key, &message, &mut dests, &mut targets);
                }
                self.scratch_dests = dests;
            }
            if let Some(delay) = delay {
                let queues = &self.queues;
                let replicated = |id: &QueueId| queues.get(id).is_some_and(|q| q.replica.is_some());
                if held_in_logs && targets.iter().any(replicated) {
                    exchange_delay = Some(delay);
                } else {
                    targets.clear();
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
        }
        let mut message = message;
        if let Some(delay) = exchange_delay {
            // Delivered with the delay spent, as a release from the exchange is.
            if let Ok(p) = delayed::released_properties(&message.properties, delay) {
                message.properties = p;
            }
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
        let mut first_holds: Vec<u64> = Vec::new();
        let mut new_keys: Vec<(QueueId, crate::dedup::Pending)> = Vec::new();
        // Replicated queues judge in their machine, whichever node takes the publish and
        // across a failover, once every node can read such an entry.
        let mut windows: Vec<(QueueId, warren_queue::machine::DedupWindow)> = Vec::new();
        // Whether every node reads a publish held or judged in a queue's log.
        let in_log =
            (self.dedup_queues > 0 || self.delaying_queues > 0 || exchange_delay.is_some())
                && self
                    .cluster_feature_level()
                    .is_some_and(|l| l >= super::metadata_group::HELD_LEVEL);
        let away = self.away.is_some();
        if self.dedup_queues > 0 && !released && death.is_none() {
            let (now, disk) = (self.now_ms, self.disk);
            let queues = &mut self.queues;
            let holds = self.cluster.as_ref().map(|c| &c.holds);
            let joined = &mut first_holds;
            let mut headers = None;
            targets.retain(|id| {
                let Some(q) = queues.get_mut(id) else {
                    return true;
                };
                // A delayed copy the queue's log cannot hold waits on this node's disk (below),
                // and is judged here as before.
                let in_machine = q.replica.is_some()
                    && !((q.args.delivery_delay_ms.is_some() || exchange_delay.is_some())
                        && held_full(q, away));
                let Some(d) = q.dedup.as_deref_mut() else {
                    return true;
                };
                let headers = headers.get_or_insert_with(|| {
                    warren_codec::properties::headers(&message.properties)
                        .ok()
                        .flatten()
                });
                if in_log && in_machine {
                    if let Some(w) = d.window(headers.as_ref(), &message.properties) {
                        windows.push((*id, w));
                    }
                    return true;
                }
                match d.judge(headers.as_ref(), &message.properties, now, disk, holds) {
                    Verdict::Duplicate { batch, hold } => {
                        duplicates += 1;
                        first_copies = first_copies.max(batch);
                        if hold != 0 {
                            joined.push(hold);
                        }
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
        // Replicated queues hold theirs in their own log (every member has it, whichever leads
        // releases it), once every node can read such an entry.
        let mut held_in_log: Vec<(QueueId, u64)> = Vec::new();
        if (self.delaying_queues > 0 || exchange_delay.is_some()) && !released {
            let headers = warren_codec::properties::headers(&message.properties);
            let own = delayed::header_delay(headers.ok().flatten().as_ref());
            let refusing = self.refusing_queues > 0;
            targets.retain(|id| {
                let Some(q) = self.queues.get(id) else {
                    return true;
                };
                // A delayed exchange's delay replaces the queue's own, as when it releases.
                match exchange_delay.or(q.args.delivery_delay_ms) {
                    Some(_) if refusing && q.machine.rejects(size) => {
                        refused_now.push(*id);
                        false
                    }
                    Some(delay) if in_log && q.replica.is_some() && !held_full(q, away) => {
                        held_in_log.push((*id, own.unwrap_or(delay)));
                        true
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
        // A copy of its own for a message that will wait in a queue (else it would keep its
        // connection's read buffer alive while it waits); none when every queue hands it to a
        // consumer waiting for it (the worker's shape: it is written out and acked within
        // moments, and the copy was the one allocation per message left on this path). What
        // such a consumer holds unacked keeps its slice of the read buffer until it is acked or
        // given back (and copied then, as it may wait again).
        let stays = |id: &QueueId| {
            self.queues
                .get(id)
                .is_none_or(|q| q.replica.is_some() || !q.machine.takes_at_once())
        };
        if targets.iter().any(stays) {
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
                    // A replicated queue's copy is in its group's log, not in the store.
                    Some(q) if q.replica.is_some() => Kept::Memory,
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
        let mut unled = false;
        let mut full = refused_now.iter().any(|id| self.refuses_plainly(*id));
        let mut routed = duplicates + rejected;
        // Only a body stored for one queue is paged out (a shared one is counted in memory).
        let paging = self.pager.is_some() && stored == 1;
        // What a copy makes its queue drop (drop-head) is dead-lettered once every copy is in:
        // a dead letter that filled a later target would otherwise refuse that target's copy,
        // and RabbitMQ's queues get a publish's copies before any dead letter it causes.
        let defer = !self.dead_lettering;
        // This release's own copies only: not the dead letters republished below.
        let releasing = self.releasing.take().filter(|_| released);
        let dead_letter = death.is_some();
        self.dead_lettering = true;
        for (i, id) in targets.iter().enumerate() {
            let kind = kinds.get(i).copied().unwrap_or(Kept::Memory);
            if dead_letter && self.held_dead_letters.publishing && self.refused_elsewhere(*id) {
                // A held dead letter for a full quorum queue led by another node: refused
                // here, as its leader would refuse it (this member holds the queue's committed
                // state, a few entries behind at most). Forwarded, the refusal would come back
                // as the nack of a whole batch, and a `reject-publish-dlx` queue would send a
                // copy onward at every retry; here it goes on once, and a plain
                // `reject-publish` one is tried again after its back-off.
                self.refused(*id, kind, &message, None);
                full |= self.refuses_plainly(*id);
                routed += 1;
                rejected += 1;
                continue;
            }
            let mut copy = message.clone();
            if kind == Kept::Memory {
                // This queue's copy is in memory only: nothing to delete when it goes.
                copy.store_key = None;
            }
            let now = self.now_ms;
            // The copy's meta depends on its queue (TTL, priorities): built from the same
            // lookup that applies the command.
            if message.body.len() > super::replicated::REPLICATED_MAX_BODY
                && self.queues.get(id).is_some_and(|q| q.replica.is_some())
            {
                tracing::warn!(
                    queue = id.0,
                    size = message.body.len(),
                    "message too large for a replicated queue (32 MiB at most): nacked"
                );
                routed += 1;
                rejected += 1;
                continue;
            }
            // A delayed message falling due, or a dead letter, into a replicated queue: its
            // guard goes with the entry's token until the entry is applied.
            // (A held message's dead letter needs none: its queue keeps it until it is safe.)
            let guarded =
                releasing.or((dead_letter && !self.held_dead_letters.publishing).then_some(0));
            let guard = match (guarded, self.cluster.is_some()) {
                (Some(refused), true) => self.release_guard(vhost, *id, &message, refused),
                _ => None,
            };
            // Only the publish's own copies count in its channel's hold: a dead letter (or a
            // released delayed message) waits in its batch, as its guard or holder needs.
            let counted = self.cluster.as_mut().map(|c| {
                c.release_tag = guard.map(|key| super::replicated::Guard { key, dead_letter });
                c.holds.count(!dead_letter && !released)
            });
            let delay = held_in_log
                .iter()
                .find(|(held, _)| held == id)
                .map(|(_, delay)| *delay);
            let window = windows
                .iter()
                .find(|(keyed, _)| keyed == id)
                .map(|(_, w)| *w);
            let ran = self.run_with(*id, |q| {
                let meta = MsgMeta {
                    pageable: paging && kind != Kept::Memory && may_page(q),
                    spilled: kind == Kept::Spilled,
                    // A held message's time to live starts when it is due, as in a queue
                    // that takes it only then.
                    expires_at: expiry(q, own_ttl, now.saturating_add(delay.unwrap_or(0))),
                    priority: priority(q, &copy),
                    group: message_group(q, &copy),
                    ..meta
                };
                let command = if delay.is_some() || window.is_some() {
                    Command::EnqueueWith {
                        delay_ms: delay.unwrap_or(0),
                        from: None,
                        dedup: window.map(Box::new),
                        message: copy,
                        meta,
                    }
                } else {
                    Command::Enqueue {
                        message: copy,
                        meta,
                    }
                };
                (command, meta)
            });
            if let Some(c) = self.cluster.as_mut() {
                c.release_tag = None;
                c.holds.count(counted.unwrap_or(false));
            }
            let Some((reply, meta)) = ran else {
                if self.queues.get(id).is_some_and(|q| q.replica.is_some()) {
                    // A replicated queue with no leader to take it: the publisher is told
                    // with a nack (a mandatory publish is not returned: the queue exists).
                    routed += 1;
                    rejected += 1;
                    unled = true;
                }
                continue;
            };
            routed += 1;
            // (A node on its own looks nothing up here.)
            if self.cluster.is_some() && self.queues.get(id).is_some_and(|q| q.replica.is_some()) {
                // Its confirm waits for the entry's commit, in the batch being filled.
                if let Some(p) = self.persist.as_ref() {
                    batch = batch.max(Some(p.next_batch));
                }
            }
            if reply == Reply::Refused(Refusal::Full) {
                if let Some(key) = guard {
                    // Refused at once: `refused` holds it back again (or drops a dead letter)
                    // by itself.
                    self.drop_release_guard_early(key);
                }
                self.refused(*id, kind, &message, releasing);
                full |= self.refuses_plainly(*id);
                rejected += 1;
                continue;
            }
            let took_it =
                matches!(reply, Reply::Enqueued { .. }) || (delay.is_some() && reply == Reply::Ok);
            if !new_keys.is_empty() && took_it {
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
        for hold in first_holds {
            first_copies = first_copies.max(self.duplicate_of(hold));
        }
        if !new_keys.is_empty() {
            let now = self.now_ms;
            let hold = self.cluster.as_ref().map_or(0, |c| c.holds.routed());
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
                        d.remember(pending, batch, hold, now);
                    }
                }
            }
        }
        Ok(Routed {
            queues: routed,
            batch: batch.max(first_copies),
            rejected: rejected > 0,
            unled,
            full,
        })
    }

    /// Queue `id` is a replicated queue led by another node whose committed state here is full
    /// and refuses publishes (`reject-publish` or `reject-publish-dlx`).
    fn refused_elsewhere(&self, id: QueueId) -> bool {
        self.queues.get(&id).is_some_and(|q| {
            q.replica.as_ref().is_some_and(|r| !r.is_leading()) && q.machine.rejects(0)
        })
    }

    /// Queue `id` refuses a publish when full and keeps nothing of it (`reject-publish`, not
    /// `reject-publish-dlx`).
    fn refuses_plainly(&self, id: QueueId) -> bool {
        self.queues
            .get(&id)
            .is_some_and(|q| q.args.overflow == args::Overflow::RejectPublish)
    }

    /// A full `reject-publish` queue refused its copy of `message`: a stored copy lets its
    /// body go, and `reject-publish-dlx` dead-letters the message (reason `maxlen`). A delayed
    /// message refused as it falls due was confirmed long ago, and nobody is left to tell:
    /// with plain `reject-publish` it waits again, for this queue only, and is tried later
    /// (the back-off doubles, 1 s to 60 s), rather than being dropped.
    /// `releasing`: the message is a delayed one falling due, refused that many times before.
    pub(super) fn refused(
        &mut self,
        id: QueueId,
        kind: Kept,
        message: &Message,
        releasing: Option<u32>,
    ) {
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
    pub(super) fn store_entry(
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
}
