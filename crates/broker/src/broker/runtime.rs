//! The queue runtime: commands applied to queue machines, consumers, dispatch, settlement, timers.

use super::*;

/// Commands a replicated queue's members each take from their own definitions, not from the
/// log: the queue's policy as declared and as policies change it.
fn restores(command: &Command<Message>) -> bool {
    matches!(
        command,
        Command::Restore { .. } | Command::RestoreRun { .. } | Command::SkipIds { .. }
    )
}

fn declared_here(command: &Command<Message>) -> bool {
    matches!(command, Command::Configure(_) | Command::CapExpiry { .. })
}

impl Broker {
    /// Applies one command to a queue's machine: the only way a queue's state changes. The
    /// command gets the queue's next log index and the broker's time; it is recorded when
    /// recording is on; the queue's deadline and dirty flag follow its new state. The effects
    /// are left in `self.effects`. `None` if the queue does not exist.
    pub(super) fn run(&mut self, id: QueueId, command: Command<Message>) -> Option<Reply> {
        self.run_with(id, |_| (command, ()))
            .map(|(reply, ())| reply)
    }

    /// [`Broker::run`] with the command built from the queue (one lookup), and something the
    /// builder returns beside it.
    pub(super) fn run_with<T>(
        &mut self,
        id: QueueId,
        build: impl FnOnce(&Queue) -> (Command<Message>, T),
    ) -> Option<(Reply, T)> {
        let q = self.queues.get(&id)?;
        let (command, extra) = build(q);
        if q.replica.is_some() && restores(&command) {
            // Messages in the store: a quorum queue declared before this node joined a
            // cluster. It stays this node's (see `Broker::keep_local`).
            self.keep_local(id);
        }
        let q = self.queues.get(&id)?;
        // A replicated queue's members each apply their own definitions, at different times:
        // at the machine's own time, they start no lease (x-expires) that differs between them.
        let mut now_ms = self.now_ms;
        match q
            .replica
            .as_ref()
            .map(|r| (declared_here(&command), r.is_leading()))
        {
            // The definitions are the cluster's: the leader puts what they ask of the queue in
            // its log, and every member applies it there, at one index (a member applying
            // its own copy when it learnt of a policy would differ from the others). A leader
            // that starts acting proposes what its definitions ask if the log says otherwise.
            Some((true, leading)) if matches!(command, Command::Configure(_)) => {
                if !leading {
                    self.effects.clear();
                    return Some((Reply::Ok, extra));
                }
                self.propose(id, &command);
            }
            // Every member applies the caps of its own recovery.
            Some((true, leading)) => {
                now_ms = q.machine.now_ms();
                if leading {
                    self.configure_committed(id, &command);
                }
            }
            None => {}
            // Only the leader acts, and only once its term's first entry is applied.
            Some((false, false)) => {
                // Nothing applied here: no effects either, whatever an earlier command left.
                self.effects.clear();
                let reply = self.forward(id, &command)?;
                return Some((reply, extra));
            }
            Some((false, true)) => self.propose(id, &command),
        }
        let q = self.queues.get_mut(&id)?;
        let meta = Meta {
            index: q.machine.last_index() + 1,
            now_ms,
        };
        // A replicated queue's commands are in its group's log, and its machine also moves by
        // committed entries and falls back when deposed: the debug record would not replay.
        let logged = (self.recording.is_some() && q.replica.is_none()).then(|| command.clone());
        // A publish its machine's deduplication window judges (a replicated queue's).
        let keyed = matches!(command, Command::EnqueueWith { dedup: Some(_), .. });
        let counted = match &command {
            Command::Enqueue { .. } | Command::EnqueueFrom { .. } | Command::EnqueueWith { .. } => {
                Counted::Enqueue
            }
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
        if keyed && reply == Reply::Duplicate {
            // Dropped by the window, on the node that leads (its own clients' publishes and
            // those sent on to it).
            if let Some(d) = q.dedup.as_deref_mut() {
                d.count_dropped();
            }
        }
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
            if q.machine.consumer_count() + self.unlogged_consumers(q.id) >= max {
                return Err(AmqpError::precondition_failed(format!(
                    "cannot consume from queue '{queue}' in vhost '{vhost}': consumer limit ({max}) is reached"
                )));
            }
        }
        let priority = args::validate_consume(arguments, &q.rs())?;
        if q.replica.as_ref().is_some_and(|r| !r.is_leading()) {
            // A member that follows takes the consumer and sends it to the leader; one just
            // elected takes it and runs it once it acts, a few milliseconds later (RabbitMQ's
            // consume waits for a leader too, instead of failing the client's connection).
            // The leader decides; what this member's committed state already says is refused
            // here (two nodes racing for exclusive use are sorted out by the log: the loser is
            // cancelled when the entry is applied).
            let taken = q.machine.consumers().any(|(_, s, _)| s.exclusive);
            if taken || (exclusive && q.machine.consumer_count() > 0) {
                return Err(AmqpError::access_refused(format!(
                    "queue '{queue}' in vhost '{vhost}' in exclusive use"
                )));
            }
        }
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
        let key = ConsumerKey {
            conn: spec.group.conn,
            channel: spec.group.channel,
            tag: spec.tag.clone(),
        };
        match self.run(id, Command::Consume { id: consumer, spec }) {
            Some(Reply::Ok) => {
                self.track_consumer(id, consumer, key);
                Ok((id, consumer))
            }
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
        self.untrack_consumer(consumer);
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
        !self.dirty.is_empty() || self.has_released()
    }

    /// Queues waiting for dispatch now (a caller that dispatches each once stops after this
    /// many).
    pub fn dirty_count(&self) -> usize {
        self.dirty.len() + usize::from(self.has_released())
    }

    /// Runs one checkout (at most `config.dispatch_batch` deliveries) on the next queue with
    /// work; its deliveries are appended to `out`. A queue with more work stays dirty. False
    /// when no queue has work.
    pub fn dispatch_one(&mut self, out: &mut Vec<Delivery>) -> bool {
        if self.has_released() {
            self.take_released(out);
            return true;
        }
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
        let from = out.len();
        self.take_deliveries(id, out);
        self.keep_local_deliveries(id, out, from);
        self.hold_deliveries(id, out, from);
        true
    }

    /// Moves the deliveries out of `self.effects` into `out`, then handles the rest.
    pub(super) fn take_deliveries(&mut self, id: QueueId, out: &mut Vec<Delivery>) {
        let Some(q) = self.queues.get(&id) else {
            return;
        };
        let mut rest = Vec::new();
        let node = self.cluster_node();
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
                    // A delivery for another node's consumer is dropped from this node's
                    // session (`keep_local_deliveries`): contents away stay where they are.
                    let conn = d.consumer.and(d.to.as_ref()).map(|(g, _)| g.conn);
                    let here = node.is_none_or(|n| super::replicated::consumer_here(conn, n));
                    if let Some(delivery) = delivery_of(q, d, here) {
                        out.push(delivery);
                    }
                }
                other => rest.push(other),
            }
        }
        if !rest.is_empty() {
            self.effects = rest;
            self.finish_effects(id);
        }
    }

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
        self.continue_away();
        self.release_delayed();
        self.expire_forwards();
        // What expired forwards (or a deleted queue) lost is released again now.
        self.settle_release_guards();
        self.retry_held_dead_letters();
        self.settle_held_dead_letters();
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
        [
            queues,
            self.scheduler.deadline(),
            self.forward_deadline(),
            self.away_deadline(),
            self.held_dead_letters_deadline(),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// A queue's machine (read-only: tests, diagnostics, digests).
    pub fn machine(&self, queue: QueueId) -> Option<&QueueMachine<Message>> {
        self.queues.get(&queue).map(|q| &q.machine)
    }

    /// basic.get: the next ready message and how many stay ready.
    pub fn get(
        &mut self,
        vhost: &str,
        queue: &str,
        no_ack: bool,
        conn: ConnId,
    ) -> Result<Option<(Delivery, u32)>, AmqpError> {
        self.get_from(vhost, queue, no_ack, conn, false)
    }

    /// [`Broker::get`] for a caller that hands the message out only once the log has the
    /// get's entry, in a hold of [`Broker::open_hold_every`] (the management API): a
    /// replicated queue's leader gives the next message even while its machine runs ahead
    /// of the log. Raft commits the message's own entry before the get's, so the answer never
    /// shows a message a failover takes back; a get lost with its leader leaves the message
    /// in the queue, and the caller answers an error.
    pub fn get_awaited(
        &mut self,
        vhost: &str,
        queue: &str,
        no_ack: bool,
        conn: ConnId,
    ) -> Result<Option<(Delivery, u32)>, AmqpError> {
        self.get_from(vhost, queue, no_ack, conn, true)
    }

    /// Up to `count` messages of a queue for a caller that answers once they are safe (the
    /// management API's get, SQS's receive), each taken with [`Broker::get_awaited`] and then
    /// given to `then` (to settle, requeue or hide it), all in one hold: the store batch the
    /// caller waits for waits until the log has every get and what `then` did. An error with
    /// nothing taken is the answer; after some were taken, those are.
    pub fn get_many_awaited(
        &mut self,
        (vhost, queue): (&str, &str),
        count: usize,
        conn: ConnId,
        mut then: impl FnMut(&mut Self, &Delivery),
    ) -> Result<Vec<(Delivery, u32)>, AmqpError> {
        self.open_hold_every();
        let mut got = Vec::new();
        let mut failed = None;
        while got.len() < count {
            match self.get_awaited(vhost, queue, false, conn) {
                Ok(Some(d)) => got.push(d),
                Ok(None) => break,
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        for (d, _) in &got {
            then(self, d);
        }
        let hold = self.close_hold();
        self.batch_waits_for(hold);
        match failed {
            Some(e) if got.is_empty() => Err(e),
            _ => Ok(got),
        }
    }

    fn get_from(
        &mut self,
        vhost: &str,
        queue: &str,
        no_ack: bool,
        conn: ConnId,
        awaited: bool,
    ) -> Result<Option<(Delivery, u32)>, AmqpError> {
        let queue = strip_cr_lf(queue);
        let q = self.queue_by_name(vhost, &queue)?;
        check_access(q, conn)?;
        let id = q.id;
        if let Some(r) = q.replica.as_ref() {
            if !r.is_leading() {
                return Err(not_led_here(q));
            }
            if !awaited && !r.caught_up() {
                // A message is handed out only once the log has it, and this node's machine
                // is ahead of it now: a poller asks again (a consumer gets held deliveries).
                return Ok(None);
            }
        }
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
            // A replicated queue's get is by this node's channel: a `Down` of the node returns it.
            let command = match self
                .cluster_node()
                .filter(|_| self.replica_group(id).is_some())
            {
                Some(node) => Command::GetBy {
                    no_ack,
                    node: u16::try_from(node).unwrap_or(u16::MAX),
                },
                None => Command::Get { no_ack },
            };
            self.run(id, command);
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
    pub(super) fn stored_in_flight(&self, queue: QueueId, receipt: Receipt) -> Option<(u64, u64)> {
        self.persist.as_ref()?;
        let q = self.queues.get(&queue)?;
        let (m, _) = q.machine.in_flight_message(receipt.msg_id)?;
        Some((q.entry_key(m)?, m.store_key?))
    }

    /// A stored message left a durable queue outside a settle.
    pub(super) fn forget_stored(
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

    pub(super) fn give_back(&mut self, queue: QueueId, receipt: Receipt, by_client: bool) -> bool {
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

/// A machine's delivery as the session takes it (see [`delivery_with`]).
pub(super) fn delivery_of(
    q: &Queue,
    d: warren_queue::machine::Deliver<Message>,
    load: bool,
) -> Option<Delivery> {
    let counts = q.args.counts_deliveries();
    delivery_with(q.id, &q.name, counts, d, load)
}

/// [`delivery_of`] from the queue's parts. `counts`: `QueueArgs::counts_deliveries`.
pub(super) fn delivery_with(
    queue: QueueId,
    name: &ShortStr,
    counts: bool,
    d: warren_queue::machine::Deliver<Message>,
    load: bool,
) -> Option<Delivery> {
    let mut message = d.message;
    // `load`: the delivery goes to a client of this node, with its contents read back if a
    // deep replicated queue let them leave memory. Contents that cannot be read back are not
    // sent as some other message: the delivery is dropped, and its message stays checked out
    // to the consumer until the consumer goes or its delivery times out (then it is ready
    // again). It is not given back at once: with the disk failing, the next delivery of it
    // would fail too, in a loop. A no-ack delivery's message is lost, as it is when a no-ack
    // consumer's connection drops.
    if load {
        if let Err(error) = message.load() {
            tracing::error!(queue = %name, msg_id = d.receipt.msg_id, %error, "a delivery's contents could not be read back: not delivered");
            return None;
        }
    }
    if counts && !message.is_away() && (d.receipt.attempt > 1 || d.consumer.is_none()) {
        let before = d.receipt.attempt.saturating_sub(1);
        if let Ok(p) = dead_letter::with_delivery_count(&message.properties, before) {
            message.properties = p;
        }
    }
    Some(Delivery {
        queue,
        queue_name: name.clone(),
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
