//! Recovery: rebuilds the broker's durable exchanges, queues, bindings and messages from the
//! store, through the broker's own declaration code and the queue machine's `Restore` command.

use std::collections::{BTreeMap, HashMap, VecDeque};

use rocksdb::{Direction, IteratorMode, ReadOptions};
use warren_broker::{Broker, QueueDef, StoreKeys, StoreOp};

use crate::codec::{self, Def};
use crate::{Store, StoreError, CF_BODIES, CF_COUNTS, CF_DEFS, CF_INDEX};

/// What recovery found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Recovered {
    pub exchanges: usize,
    pub queues: usize,
    pub bindings: usize,
    pub messages: u64,
    /// Definitions the broker refused (a vhost no longer configured, say): logged and skipped.
    pub skipped: usize,
    /// The previous run did not stop cleanly: every message came back marked redelivered.
    pub after_crash: bool,
}

/// A recovery in progress: the definitions are back, the queues' messages come one queue per
/// [`Store::recover_step`], so that a server can answer connections between steps.
pub struct Recovery {
    pending: VecDeque<(QueueDef, warren_broker::QueueId)>,
    keys: StoreKeys,
    /// References to bodies written for several queues (only those are counted): complete
    /// only once every queue is back, so nothing may release a body before the end.
    shared: HashMap<u64, u32>,
    found: Recovered,
}

impl Recovery {
    /// Queues whose messages are still to come.
    pub fn queues_left(&self) -> usize {
        self.pending.len()
    }
}

impl Store {
    /// Loads everything into `broker` (whose persistence must be on, so later changes are
    /// written): definitions first, then each queue's messages in id order.
    pub fn recover(&self, broker: &mut Broker) -> Result<Recovered, StoreError> {
        let recovery = self.begin_recovery(broker)?;
        self.finish_recovery(broker, recovery)
    }

    /// The first part of [`Store::recover`]: durable exchanges, queues and bindings.
    pub fn begin_recovery(&self, broker: &mut Broker) -> Result<Recovery, StoreError> {
        let mut out = Recovered {
            after_crash: !self.clean_start,
            ..Recovered::default()
        };
        let mut exchanges = Vec::new();
        let mut queues = Vec::new();
        let mut bindings = Vec::new();
        let mut access = Vec::new();
        for item in self.db.iterator_cf(self.cf(CF_DEFS)?, IteratorMode::Start) {
            let (k, v) = item.map_err(StoreError::Read)?;
            match codec::decode_def(&k, &v)? {
                Def::Access(op) => access.push(op),
                Def::Exchange(x) => exchanges.push(x),
                Def::Queue(q) => queues.push(q),
                Def::Binding(b) => bindings.push(b),
            }
        }
        // Vhosts first (the key order puts them last), then users, then permissions.
        access.sort_by_key(|op| match op {
            StoreOp::PutVhost { .. } => 0,
            StoreOp::PutUser(_) => 1,
            _ => 2,
        });
        for op in &access {
            if let Err(e) = broker.restore_access(op) {
                tracing::warn!(record = ?op, error = %e, "stored access record not restored");
                out.skipped += 1;
            }
        }
        for x in &exchanges {
            match broker.restore_exchange(x) {
                Ok(()) => out.exchanges += 1,
                Err(e) => {
                    tracing::warn!(vhost = %x.vhost, exchange = %x.name, error = %e, "stored exchange not restored");
                    out.skipped += 1;
                }
            }
        }
        let mut restored: Vec<(QueueDef, warren_broker::QueueId)> = Vec::new();
        for q in queues {
            match broker.restore_queue(&q) {
                Ok(id) => {
                    out.queues += 1;
                    restored.push((q, id));
                }
                Err(e) => {
                    tracing::warn!(vhost = %q.vhost, queue = %q.name, error = %e, "stored queue not restored");
                    out.skipped += 1;
                }
            }
        }
        for b in &bindings {
            match broker.restore_binding(b) {
                Ok(()) => out.bindings += 1,
                Err(e) => {
                    tracing::warn!(vhost = %b.vhost, source = %b.source, error = %e, "stored binding not restored");
                    out.skipped += 1;
                }
            }
        }

        let mut keys = StoreKeys {
            next_queue_key: 1,
            next_body_key: 1,
        };
        for (def, _) in &restored {
            keys.next_queue_key = keys.next_queue_key.max(def.key.saturating_add(1));
        }
        Ok(Recovery {
            pending: restored.into(),
            keys,
            shared: HashMap::new(),
            found: out,
        })
    }

    /// The messages of the next queue; false once every queue is back.
    pub fn recover_step(
        &self,
        broker: &mut Broker,
        recovery: &mut Recovery,
    ) -> Result<bool, StoreError> {
        let Some((def, id)) = recovery.pending.pop_front() else {
            return Ok(false);
        };
        recovery.found.messages += self.recover_queue(broker, &def, id, &mut recovery.shared)?;
        Ok(!recovery.pending.is_empty())
    }

    /// The last part (after the remaining steps, if any): key counters past everything on
    /// disk, and the shared bodies' counts. Nothing may reach a queue before it returns.
    pub fn finish_recovery(
        &self,
        broker: &mut Broker,
        mut recovery: Recovery,
    ) -> Result<Recovered, StoreError> {
        while self.recover_step(broker, &mut recovery)? {}
        let Recovery {
            mut keys,
            shared,
            found: out,
            ..
        } = recovery;
        let bodies = self.cf(CF_BODIES)?;
        if let Some(item) = self.db.iterator_cf(bodies, IteratorMode::End).next() {
            let (k, _) = item.map_err(StoreError::Read)?;
            keys.next_body_key = codec::decode_u64(&k, "a body key")?.saturating_add(1);
        }
        // Keys given out and since deleted are past the largest found: the reservations say
        // how far keys went, so none is ever written twice.
        if let Some(v) = self.db.get(crate::KEY_RESERVED).map_err(StoreError::Read)? {
            let reserved = <[u8; 16]>::try_from(v.as_slice()).map_err(|_| {
                StoreError::Corrupt("the key reservation record is malformed".into())
            })?;
            let (q, b) = reserved.split_at(8);
            keys.next_queue_key = keys
                .next_queue_key
                .max(codec::decode_u64(q, "reservation")?);
            keys.next_body_key = keys.next_body_key.max(codec::decode_u64(b, "reservation")?);
        }
        broker.set_store_keys(keys, shared);
        if self.has_delayed()? {
            // Read back as ticks start, earliest first: what fell due while the node was
            // down is released at once.
            broker.restore_delayed();
        }
        Ok(out)
    }

    /// One queue's messages, in id order: a bounded scan of its `index` range, its stored
    /// delivery counts beside it. Messages stored for this queue alone stay on disk, as runs
    /// the queue reads back when consumers need them (start-up reads no bodies for them);
    /// shared bodies, and entries from before sizes were stored, are read now.
    fn recover_queue(
        &self,
        broker: &mut Broker,
        def: &QueueDef,
        id: warren_broker::QueueId,
        shared: &mut HashMap<u64, u32>,
    ) -> Result<u64, StoreError> {
        let (from, to) = codec::queue_range(def.key);
        let bounded = || {
            let mut r = ReadOptions::default();
            r.set_iterate_lower_bound(from);
            r.set_iterate_upper_bound(to);
            r
        };
        let mut counts = BTreeMap::new();
        let counts_cf = self.cf(CF_COUNTS)?;
        for item in self.db.iterator_cf_opt(
            counts_cf,
            bounded(),
            IteratorMode::From(&from, Direction::Forward),
        ) {
            let (k, v) = item.map_err(StoreError::Read)?;
            let (_, msg_id) = codec::decode_entry_key(&k)?;
            let count = codec::decode_count(&v).map_err(|_| {
                StoreError::Corrupt(format!(
                    "queue '{}': a delivery count is malformed",
                    def.name
                ))
            })?;
            counts.insert(msg_id, count);
        }
        let bodies = self.cf(CF_BODIES)?;
        let index = self.cf(CF_INDEX)?;
        let mut n = 0;
        // The id after the last entry that could not be restored: new messages start past it,
        // so its key is never written again.
        let mut skip_to = None;
        let redelivered = !self.clean_start;
        // Without a pager (a broker that cannot read pages back), everything is loaded; so is
        // a queue that keeps its messages in memory (a length limit, priorities, groups).
        let paging = broker.pages() && broker.queue_args(id).is_some_and(|a| a.pages());
        let mut run: Option<Run> = None;
        for item in self.db.iterator_cf_opt(
            index,
            bounded(),
            IteratorMode::From(&from, Direction::Forward),
        ) {
            let (k, v) = item.map_err(StoreError::Read)?;
            let (_, msg_id) = codec::decode_entry_key(&k)?;
            let entry = codec::decode_entry(&v)?;
            // A message waiting for a delayed retry is restored whole, with its due time (a page
            // read back later would make it ready at once).
            let waits = counts
                .get(&msg_id)
                .is_some_and(|(_, retry_at)| retry_at.is_some());
            if paging && entry.pageable() && !waits {
                let size = u64::from(entry.size.unwrap_or(0));
                match run.as_mut() {
                    Some(r) => {
                        r.last = msg_id;
                        r.count += 1;
                        r.bytes = r.bytes.saturating_add(size);
                        r.expires_min = match (r.expires_min, entry.expires_at) {
                            (Some(a), Some(b)) => Some(a.min(b)),
                            (a, b) => a.or(b),
                        };
                    }
                    None => {
                        run = Some(Run {
                            first: msg_id,
                            last: msg_id,
                            count: 1,
                            bytes: size,
                            expires_min: entry.expires_at,
                        })
                    }
                }
                continue;
            }
            if let Some(r) = run.take() {
                n += r.restore(broker, id, redelivered, &mut skip_to);
            }
            let (body_key, expires_at) = (entry.body, entry.expires_at);
            let Some(body) = self
                .db
                .get_cf(bodies, body_key.to_be_bytes())
                .map_err(StoreError::Read)?
            else {
                tracing::warn!(queue = %def.name, msg_id, body_key, "a stored message has no body: skipped");
                skip_to = Some(msg_id.saturating_add(1));
                continue;
            };
            let (message, queues) = codec::decode_body(body_key, body)?;
            if queues > 1 {
                *shared.entry(body_key).or_insert(0) += 1;
            }
            let count = counts.get(&msg_id).copied().unwrap_or((0, None));
            if broker.restore_message(id, msg_id, message, count, expires_at, redelivered) {
                n += 1;
            } else {
                skip_to = Some(msg_id.saturating_add(1));
            }
        }
        if let Some(r) = run.take() {
            n += r.restore(broker, id, redelivered, &mut skip_to);
        }
        if let Some(next_id) = skip_to {
            broker.skip_message_ids(id, next_id);
        }
        Ok(n)
    }
}

/// Consecutive stored entries that stay on disk at recovery.
struct Run {
    first: u64,
    last: u64,
    count: u64,
    bytes: u64,
    expires_min: Option<u64>,
}

impl Run {
    fn restore(
        self,
        broker: &mut Broker,
        queue: warren_broker::QueueId,
        redelivered: bool,
        skip_to: &mut Option<u64>,
    ) -> u64 {
        if broker.restore_run(
            queue,
            self.first,
            self.last,
            self.count,
            self.bytes,
            redelivered,
            self.expires_min,
        ) {
            self.count
        } else {
            *skip_to = Some(self.last.saturating_add(1));
            0
        }
    }
}
