//! Recovery: rebuilds the broker's durable exchanges, queues, bindings and messages from the
//! store, through the broker's own declaration code and the queue machine's `Restore` command.

use std::collections::{BTreeMap, HashMap, VecDeque};

use rocksdb::{Direction, IteratorMode, ReadOptions};
use warren_broker::{Broker, QueueDef, StoreKeys, StoreOp};

use crate::codec::{self, Def};
use crate::{Store, StoreError, CF_BODIES, CF_COUNTS, CF_DEFS, CF_INDEX};

/// How far past the stored keys new ones start when the reservation record is unreadable
/// (more keys than a broker hands out in years).
const KEY_MARGIN: u64 = 1 << 40;

/// What one queue's recovery had to put aside.
#[derive(Default)]
struct Damage {
    quarantined: usize,
    /// Messages whose entry or body could not be read.
    lost: u64,
    /// Delivery counts that could not be read (their messages come back counted 0).
    counts: u64,
}

/// What recovery found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Recovered {
    pub exchanges: usize,
    pub queues: usize,
    pub bindings: usize,
    pub messages: u64,
    /// Definitions the broker refused (a vhost no longer configured, say): logged and skipped.
    pub skipped: usize,
    /// Damaged records (definitions, index entries, delivery counts, bodies) moved to the
    /// quarantine (see `Store::quarantined`), each logged with the queue it belonged to.
    pub quarantined: usize,
    /// Messages lost to damage (their entry or body could not be read).
    pub lost: u64,
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
            match codec::decode_def(&k, &v) {
                Ok(Def::Access(op)) => access.push(op),
                Ok(Def::Exchange(x)) => exchanges.push(x),
                Ok(Def::Queue(q)) => queues.push(q),
                Ok(Def::Binding(b)) => bindings.push(b),
                Err(error) => {
                    // The key names what it was (kind byte, vhost, name): readable enough
                    // for an operator. A queue's messages stay on disk, untouched.
                    tracing::error!(
                        record = %String::from_utf8_lossy(&k),
                        %error,
                        "a stored definition is damaged: not restored, moved to the quarantine"
                    );
                    self.quarantine(CF_DEFS, &k, &v)?;
                    out.quarantined += 1;
                }
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
        let found = &mut recovery.found;
        let (messages, damage) = self.recover_queue(broker, &def, id, &mut recovery.shared)?;
        found.messages += messages;
        found.quarantined += damage.quarantined;
        found.lost += damage.lost;
        if damage.quarantined > 0 || damage.lost > 0 {
            tracing::error!(
                vhost = %def.vhost,
                queue = %def.name,
                lost_messages = damage.lost,
                lost_counts = damage.counts,
                quarantined = damage.quarantined,
                "a queue came back with damaged records: they are in the quarantine"
            );
        }
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
            found: mut out,
            ..
        } = recovery;
        let bodies = self.cf(CF_BODIES)?;
        for item in self.db.iterator_cf(bodies, IteratorMode::End) {
            let (k, v) = item.map_err(StoreError::Read)?;
            match <[u8; 8]>::try_from(&*k) {
                Ok(key) => {
                    keys.next_body_key = u64::from_be_bytes(key).saturating_add(1);
                    break;
                }
                Err(_) => {
                    tracing::error!(key = ?k, "a stored body has a damaged key: moved to the quarantine");
                    self.quarantine(CF_BODIES, &k, &v)?;
                    out.quarantined += 1;
                }
            }
        }
        // Keys given out and since deleted are past the largest found: the reservations say
        // how far keys went, so none is ever written twice.
        if let Some(v) = self.db.get(crate::KEY_RESERVED).map_err(StoreError::Read)? {
            match <[u8; 16]>::try_from(v.as_slice()) {
                Ok(reserved) => {
                    let (q, b) = reserved.split_at(8);
                    keys.next_queue_key = keys
                        .next_queue_key
                        .max(codec::decode_u64(q, "reservation")?);
                    keys.next_body_key =
                        keys.next_body_key.max(codec::decode_u64(b, "reservation")?);
                }
                Err(_) => {
                    // How far keys went is unknown: start far past what is found, so that
                    // no deleted key is written again (SingleDelete relies on it).
                    tracing::error!(
                        "the key reservation record is damaged: new keys start far past the stored ones"
                    );
                    keys.next_queue_key = keys.next_queue_key.saturating_add(KEY_MARGIN);
                    keys.next_body_key = keys.next_body_key.saturating_add(KEY_MARGIN);
                }
            }
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
    ) -> Result<(u64, Damage), StoreError> {
        let mut damage = Damage::default();
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
            match (codec::decode_entry_key(&k), codec::decode_count(&v)) {
                (Ok((_, msg_id)), Ok(count)) => {
                    counts.insert(msg_id, count);
                }
                (key, count) => {
                    // The message itself comes back, counted as never delivered.
                    let error = key.err().or(count.err()).map(|e| e.to_string());
                    tracing::error!(vhost = %def.vhost, queue = %def.name, key = ?k, ?error, "a delivery count is damaged: its message comes back counted 0; the count is in the quarantine");
                    self.quarantine(CF_COUNTS, &k, &v)?;
                    damage.quarantined += 1;
                    damage.counts += 1;
                }
            }
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
            let (msg_id, entry) = match codec::decode_entry_key(&k) {
                Ok((_, msg_id)) => match codec::decode_entry(&v) {
                    Ok(entry) => (msg_id, entry),
                    Err(error) => {
                        tracing::error!(vhost = %def.vhost, queue = %def.name, msg_id, %error, "a stored message's index entry is damaged: the message is lost; the entry is in the quarantine");
                        self.quarantine(CF_INDEX, &k, &v)?;
                        damage.quarantined += 1;
                        damage.lost += 1;
                        // A run does not span it, and its id is never used again.
                        if let Some(r) = run.take() {
                            n += r.restore(broker, id, redelivered, &mut skip_to);
                        }
                        skip_to = Some(msg_id.saturating_add(1));
                        continue;
                    }
                },
                Err(error) => {
                    tracing::error!(vhost = %def.vhost, queue = %def.name, key = ?k, %error, "a stored message's index key is damaged: the message is lost; the entry is in the quarantine");
                    self.quarantine(CF_INDEX, &k, &v)?;
                    damage.quarantined += 1;
                    damage.lost += 1;
                    continue;
                }
            };
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
                // Its body was damaged and quarantined with another queue's entry, or a
                // crash came between a dropped run's bodies and its entries.
                tracing::error!(vhost = %def.vhost, queue = %def.name, msg_id, body_key, "a stored message has no body: the message is lost; its entry is in the quarantine");
                self.quarantine(CF_INDEX, &k, &v)?;
                damage.quarantined += 1;
                damage.lost += 1;
                skip_to = Some(msg_id.saturating_add(1));
                continue;
            };
            let body = bytes::Bytes::from(body);
            let (message, queues) = match codec::decode_body(body_key, body.clone()) {
                Ok(decoded) => decoded,
                Err(error) => {
                    // A shared body: the other queues holding it find it gone and skip
                    // their entries too (each logged).
                    tracing::error!(vhost = %def.vhost, queue = %def.name, msg_id, body_key, %error, "a stored message's body is damaged: the message is lost; body and entry are in the quarantine");
                    self.quarantine(CF_BODIES, &body_key.to_be_bytes(), &body)?;
                    self.quarantine(CF_INDEX, &k, &v)?;
                    damage.quarantined += 2;
                    damage.lost += 1;
                    skip_to = Some(msg_id.saturating_add(1));
                    continue;
                }
            };
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
        Ok((n, damage))
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
