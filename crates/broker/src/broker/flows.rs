//! Flows between queues: dead letters republished to their exchanges, delayed messages released when due.

use super::replicated::GuardEnd;
use super::*;

/// The dead letter of a message leaving `q`, if `q` has a dead-letter exchange (else the
/// message is dropped, as in RabbitMQ).
pub(super) fn dead_letter_of(
    q: &Queue,
    mut message: Message,
    reason: DeadLetterReason,
) -> Option<DeadLetter> {
    let exchange = q.args.dead_letter_exchange.clone()?;
    // A deep replicated queue's message may have left memory: it goes on whole. Contents that
    // cannot be read back are lost to the dead-letter path, as an unreadable page is.
    if let Err(error) = message.load() {
        tracing::error!(queue = %q.name, vhost = %q.vhost, %error, "a dead letter's contents could not be read back: it is dropped");
        return None;
    }
    Some(DeadLetter {
        vhost: q.vhost.clone(),
        queue: q.name.clone(),
        exchange,
        routing_key: q.args.dead_letter_routing_key.clone(),
        message,
        reason,
        source: None,
    })
}

impl Broker {
    /// Holds a message back `delay_ms` (on disk with a store), to be routed by its exchange
    /// (`queue` = `None`) or enqueued on `queue` when due. It counts as routed; a persistent
    /// one's confirm waits for its write.
    pub(super) fn schedule(
        &mut self,
        vhost: &str,
        target: (Option<ShortStr>, Holder),
        message: Message,
        delay_ms: u64,
        refused: u32,
    ) -> Routed {
        let (_, batch) = self.schedule_keyed(vhost, target, message, delay_ms, refused);
        Routed {
            queues: 1,
            batch,
            rejected: false,
            unled: false,
            full: false,
        }
    }

    /// [`Broker::schedule`]: the message's key, and the store batch a persistent one's write
    /// is in.
    fn schedule_keyed(
        &mut self,
        vhost: &str,
        (queue, holder): (Option<ShortStr>, Holder),
        mut message: Message,
        delay_ms: u64,
        refused: u32,
    ) -> (DelayKey, Option<u64>) {
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
                // Without a reader, what leaves memory could not come back: keep it all.
                let stored = self.pager.is_some().then_some(number);
                self.scheduler.schedule(key, d, stored);
                (key, sync.then_some(number))
            }
            None => {
                let key = DelayKey {
                    due,
                    seq: self.scheduler.memory_seq(),
                };
                self.scheduler.schedule(key, d, None);
                (key, None)
            }
        }
    }

    /// Routes the scheduled messages that are due (at most [`RELEASES_PER_TICK`]; a backlog
    /// keeps the deadline at now), reading the next ones back from disk as memory runs low.
    pub(super) fn release_delayed(&mut self) {
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

    /// A delayed message falling due, or a dead letter, into replicated queue `id`: a guard
    /// record, the message scheduled again for that queue `RELEASE_GUARD_MS` from now, written
    /// in the batch that deletes the message where it was (its delayed record, or its source
    /// queue's entry). The queue's entry is only proposed (or forwarded to its leader): if it
    /// is lost (a failover, a forward lost on its way) the guard releases the message again,
    /// and a crash before the entry is applied finds the guard on disk. Once the entry is
    /// applied the guard goes ([`Broker::settle_release_guards`]). Its key, for the entry's
    /// token.
    pub(super) fn release_guard(
        &mut self,
        vhost: &str,
        id: QueueId,
        message: &Message,
        refused: u32,
    ) -> Option<DelayKey> {
        let q = self.queues.get(&id)?;
        q.replica.as_ref()?;
        // Without a store a crash loses everything anyway, and nothing needs guarding.
        self.persist.as_ref()?;
        let target = (Some(q.name.clone()), q.holder());
        let wait = super::replicated::RELEASE_GUARD_MS;
        let (key, _) = self.schedule_keyed(vhost, target, message.clone(), wait, refused);
        Some(key)
    }

    /// A guard ([`Broker::release_guard`]) no longer needed.
    pub(super) fn drop_release_guard(&mut self, key: DelayKey) {
        self.scheduler.forget(key);
        if let Some(p) = self.persist.as_mut() {
            p.push(StoreOp::DeleteDelayed { key }, false);
        }
    }

    /// [`Broker::drop_release_guard`] for a guard whose entry was just proposed and refused
    /// as it was applied ahead: its entry's end, later, leaves it alone.
    pub(super) fn drop_release_guard_early(&mut self, key: DelayKey) {
        self.drop_release_guard(key);
        if let Some(c) = self.cluster.as_mut() {
            c.guards_dropped.insert(key);
        }
    }

    /// Guards of released delayed messages and dead letters whose queue entries are applied
    /// (the guard is deleted), refused by a full queue (dead-lettered by a `reject-publish-dlx`
    /// queue; else a dead letter is dropped, as RabbitMQ drops one, and a delayed message is
    /// held back again: as when the leader refuses it at once) or lost (released again after a
    /// back-off, as a message refused by a full queue is, when the guard is in memory; else
    /// when it comes due).
    pub(super) fn settle_release_guards(&mut self) {
        let Some(settled) = self
            .cluster
            .as_mut()
            .map(|c| std::mem::take(&mut c.guards_settled))
            .filter(|s| !s.is_empty())
        else {
            return;
        };
        for (guard, end) in settled {
            if self
                .cluster
                .as_mut()
                .is_some_and(|c| c.guards_dropped.remove(&guard.key))
            {
                continue;
            }
            if end == GuardEnd::Refused && self.dead_letter_refused_guard(guard.key) {
                continue;
            }
            let gone = match end {
                GuardEnd::Applied => true,
                GuardEnd::Refused => guard.dead_letter,
                GuardEnd::Lost => false,
            };
            if gone {
                self.drop_release_guard(guard.key);
                continue;
            }
            let Some(d) = self.scheduler.cancel(guard.key) else {
                // On disk only: it is released when it comes due.
                continue;
            };
            if let Some(p) = self.persist.as_mut() {
                p.push(StoreOp::DeleteDelayed { key: guard.key }, false);
            }
            let wait = delayed::refused_retry_ms(d.refused);
            tracing::debug!(vhost = %d.vhost, queue = ?d.queue, retry_in_ms = wait, "a guarded message's queue entry was lost or refused: released again later");
            self.schedule(
                &d.vhost,
                (d.queue, d.holder),
                d.message,
                wait,
                d.refused.saturating_add(1),
            );
        }
        self.dead_letter_pending();
    }

    /// A guarded message refused by a full `reject-publish-dlx` queue is dead-lettered by it
    /// (`maxlen`), as that queue's own refusals are; whether it was (the guard is gone then).
    fn dead_letter_refused_guard(&mut self, key: DelayKey) -> bool {
        let Some(d) = self.scheduler.loaded_get(key) else {
            return false;
        };
        let queue = d.queue.as_ref().and_then(|name| {
            let id = self.vhosts.get(&d.vhost)?.queues.get(name)?;
            self.queues.get(id).filter(|q| d.holder.admits(q.holder()))
        });
        let Some(q) = queue.filter(|q| q.args.overflow == args::Overflow::RejectPublishDlx) else {
            return false;
        };
        let dead = dead_letter_of(q, d.message.clone(), DeadLetterReason::MaxLen);
        self.drop_release_guard(key);
        if let Some(dl) = dead {
            self.dead_letters.push_back(dl);
        }
        true
    }

    /// Does the incarnation of the queue or exchange that held `d` still exist?
    pub(super) fn still_held(&self, d: &Delayed) -> bool {
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
    pub(super) fn read_delayed(&mut self) {
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

    /// Handles what a command left in `self.effects` besides deliveries (the callers that can
    /// deliver take those first).
    pub(super) fn finish_effects(&mut self, queue: QueueId) {
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
                    let Some(q) = self.queues.get(&queue) else {
                        continue;
                    };
                    // Its queue keeps it until the dead letter is safe (a replicated queue's).
                    let held = q.machine.dead_held_get(msg_id).is_some();
                    match dead_letter_of(q, message, reason) {
                        Some(mut dl) => {
                            dl.source = held.then_some((queue, msg_id));
                            self.dead_letters.push_back(dl);
                        }
                        None if held => self.held_dead_letter_dropped((queue, msg_id)),
                        None => {}
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
    pub(super) fn dead_letter_pending(&mut self) {
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
                    if let Some(source) = dl.source {
                        // Every leader would fail alike: kept, it would be kept for ever.
                        self.held_dead_letter_dropped(source);
                    }
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
                away: None,
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
            let source = dl.source;
            self.held_dead_letters.publishing = source.is_some();
            let routed =
                self.publish_to(&dl.vhost, &dl.exchange, &routing_key, message, death, false);
            self.held_dead_letters.publishing = false;
            if let Some(source) = source {
                self.held_dead_letter_routed(source, &routed);
            }
            match routed {
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
}
