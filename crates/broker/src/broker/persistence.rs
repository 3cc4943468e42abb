//! Persistence and paging: the writes for the store, recovery of what it holds, reading paged messages back.

use super::*;

/// May this queue's copy of a message leave memory? ([`args::QueueArgs::pages`])
pub(super) fn may_page(q: &Queue) -> bool {
    q.args.pages()
}

/// A purge or delete: the queue's paged runs leave the store (entries and bodies).
pub(super) fn drop_runs(p: &mut Persist, q: &Queue) {
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
pub(super) fn keep(config: &BrokerConfig, q: &Queue) -> u32 {
    window_of(&q.machine, config.page_window, config.page_window_idle)
}

/// The messages a queue keeps in memory: `window` with consumers, `idle` without.
pub(super) fn window_of(machine: &QueueMachine<Message>, window: u32, idle: u32) -> u32 {
    if machine.consumer_count() > 0 {
        window
    } else {
        idle
    }
}

impl Broker {
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

    /// The writes made since the last call, as the next numbered batch (`None` if nothing
    /// changed on disk, or persistence is off).
    pub fn take_writes(&mut self) -> Option<WriteBatch> {
        self.persist.as_mut()?.take()
    }

    /// The store failed to write the batches up to `upto` (their publishers were nacked; the
    /// store may still retry them): a message deduplication remembered from them is new again.
    pub fn writes_failed(&mut self, upto: u64) {
        self.disk.failed = self.disk.failed.max(upto);
        self.held_dead_letters_lost(upto);
    }

    /// The store wrote every batch up to `upto`: messages they hold may leave memory. Each
    /// queue with stored messages past its window gets a `PageOut`.
    pub fn writes_done(&mut self, upto: u64) {
        self.disk.written = self.disk.written.max(upto);
        self.scheduler.written(upto);
        self.meta_written(upto);
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
        self.settle_held_dead_letters();
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
    pub(super) fn fill(&mut self, id: QueueId, low_water: usize, window: u32) -> bool {
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
    pub(super) fn restoring<T>(&mut self, f: impl FnOnce(&mut Broker) -> T) -> T {
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
            b.group_hint = def.group;
            b.voters_hint.clone_from(&def.voters);
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
        });
        // Taken by the queue it was meant for, unless the declaration made none.
        self.group_hint = None;
        self.voters_hint = None;
        let declared = declared?;
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
}
