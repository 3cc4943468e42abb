//! Delayed messages: what the `x-delayed-message` exchange holds back (its `x-delay` header)
//! and what a queue with `x-delivery-delay` holds back, until they are due.
//!
//! Scheduled messages are kept on disk, ordered by due time (the store's `delayed` column
//! family, keyed by [`DelayKey`]), and only the earliest few thousand are in memory: ten
//! million scheduled messages cost the memory of [`MAX_LOADED`]. The memory window holds every
//! scheduled message with a key below [`Scheduler::disk_from`]; what sorts after it is on disk
//! only and is read back, in key order, as the window empties. A message leaves the store in
//! the same write batch that puts it in its queues, so a crash delivers it again (at least
//! once) and never loses it.
//!
//! Without persistence every scheduled message stays in memory.
//!
//! A scheduled message belongs to what holds it (its queue, or its delayed exchange), and
//! to that one incarnation of it ([`Holder`]): deleting the holder drops what it holds (in
//! memory at once; what is on disk only, when the scheduler reaches it), and a holder declared
//! again under the same name starts empty.

use std::collections::BTreeMap;

use bytes::Bytes;
use warren_codec::{BasicProperties, CodecError, FieldTable, FieldValue, ShortStr};

use crate::Message;

/// Where a scheduled message sorts: its due time (ms, node clock), then a sequence number
/// unique for the store's life (a body key), so keys are never written twice.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DelayKey {
    pub due: u64,
    pub seq: u64,
}

impl DelayKey {
    /// The first key after this one.
    pub fn next(self) -> DelayKey {
        match self.seq.checked_add(1) {
            Some(seq) => DelayKey { due: self.due, seq },
            None => DelayKey {
                due: self.due.saturating_add(1),
                seq: 0,
            },
        }
    }
}

/// Which incarnation of a queue or exchange holds a scheduled message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Holder {
    /// Stored before holders were recorded: whichever holder has the name.
    Any,
    /// A durable queue, by its store key (kept with its declaration, never reused).
    Stored(u64),
    /// Any other queue, or a delayed exchange, by a number never reused, across restarts
    /// too (a body key, with a store; kept with a durable exchange's declaration).
    Incarnation(u64),
}

impl Holder {
    /// May a message recorded as held by `self` go to a holder that is `current`?
    pub fn admits(self, current: Holder) -> bool {
        self == Holder::Any || self == current
    }
}

/// A message waiting for its due time.
#[derive(Clone, Debug, PartialEq)]
pub struct Delayed {
    pub vhost: String,
    /// `None`: routed by its exchange (a delayed exchange) when due. `Some`: enqueued on this
    /// queue when due (the queue's `x-delivery-delay`).
    pub queue: Option<ShortStr>,
    /// The incarnation of the queue (or exchange) that holds it.
    pub holder: Holder,
    /// How many times a full `reject-publish` queue refused it when it fell due (in memory
    /// only: after a restart the back-off starts again).
    pub refused: u32,
    pub message: Message,
}

/// A delayed message that a full `reject-publish` queue refused when due is tried again
/// this much later, doubling with each refusal up to [`REFUSED_RETRY_MAX_MS`].
pub const REFUSED_RETRY_MS: u64 = 1_000;
pub const REFUSED_RETRY_MAX_MS: u64 = 60_000;

/// How long a message refused `refused` times before waits for its next try.
pub fn refused_retry_ms(refused: u32) -> u64 {
    REFUSED_RETRY_MS
        .checked_shl(refused.min(16))
        .unwrap_or(u64::MAX)
        .min(REFUSED_RETRY_MAX_MS)
}

impl Delayed {
    /// Is it held by the queue `name` (`queue`) or the exchange `name` of `vhost`?
    fn held_by(&self, vhost: &str, queue: bool, name: &str) -> bool {
        self.vhost == vhost
            && match &self.queue {
                Some(q) => queue && q.as_str() == name,
                None => !queue && self.message.exchange.as_str() == name,
            }
    }
}

impl Delayed {
    fn size(&self) -> u64 {
        (self.message.body.len() + self.message.properties.len() + 64) as u64
    }
}

/// A read of scheduled messages from disk: keys from `from` on, below `until` if given, at
/// most `max_messages` or about `max_bytes`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadRequest {
    pub from: DelayKey,
    pub until: Option<DelayKey>,
    pub max_messages: usize,
    pub max_bytes: u64,
}

/// At most this many scheduled messages in memory (with a store)...
pub const MAX_LOADED: usize = 8192;
/// ...and at most this many bytes of them.
pub const MAX_LOADED_BYTES: u64 = 8 << 20;
/// Below half of either, the next ones are read back from disk.
const LOW_LOADED: usize = MAX_LOADED / 2;
const LOW_LOADED_BYTES: u64 = MAX_LOADED_BYTES / 2;
/// A read that could not run (writes still on their way, or a failed read) is tried again
/// this much later.
pub const READ_RETRY_MS: u64 = 5;

/// The node's scheduled messages.
#[derive(Debug, Default)]
pub(crate) struct Scheduler {
    /// Every scheduled message with a key below `disk_from` (all of them when it is `None`).
    loaded: BTreeMap<DelayKey, Delayed>,
    loaded_bytes: u64,
    /// The first key that may be on disk only; `None` when memory holds everything.
    disk_from: Option<DelayKey>,
    /// Write batches not yet reported written that hold messages which left (or skipped)
    /// memory, with the smallest such key in each: a read stops before the smallest of them,
    /// so it cannot miss a message, and never waits for writes of later keys (under a steady
    /// stream of publishes some batch is always on its way to the disk).
    unwritten: BTreeMap<u64, DelayKey>,
    /// A read that could not run waits until then.
    retry_at: Option<u64>,
    /// Sequence numbers without a store.
    next_seq: u64,
    /// Scheduled messages known to this run (those found on disk at start are counted as
    /// they are read back).
    count: u64,
}

impl Scheduler {
    /// A sequence number for a key when nothing is stored (the store's keys come from its
    /// body-key reservations).
    pub fn memory_seq(&mut self) -> u64 {
        self.next_seq += 1;
        self.next_seq
    }

    /// Holds `d` back until `key.due`. `stored`: it is written in batch `batch` (with a store);
    /// then it may leave memory.
    pub fn schedule(&mut self, key: DelayKey, d: Delayed, stored: Option<u64>) {
        self.count += 1;
        if let (Some(batch), Some(from)) = (stored, self.disk_from) {
            if key >= from {
                self.on_disk_only(batch, key);
                return;
            }
        }
        self.loaded_bytes += d.size();
        self.loaded.insert(key, d);
        let Some(batch) = stored else { return };
        while self.loaded.len() > MAX_LOADED || self.loaded_bytes > MAX_LOADED_BYTES {
            let Some((last, evicted)) = self.loaded.pop_last() else {
                break;
            };
            self.loaded_bytes = self.loaded_bytes.saturating_sub(evicted.size());
            self.disk_from = Some(self.disk_from.map_or(last, |f| f.min(last)));
            self.on_disk_only(batch, last);
        }
    }

    /// `key` is now on disk only, once batch `batch` is written.
    fn on_disk_only(&mut self, batch: u64, key: DelayKey) {
        let min = self.unwritten.entry(batch).or_insert(key);
        *min = (*min).min(key);
    }

    /// The smallest key that may be missing from disk still.
    fn barrier(&self) -> Option<DelayKey> {
        self.unwritten.values().min().copied()
    }

    /// The store holds scheduled messages from an earlier run: read them back from the start.
    pub fn restore(&mut self) {
        self.disk_from = Some(DelayKey { due: 0, seq: 0 });
    }

    /// The store wrote every batch up to `upto`.
    pub fn written(&mut self, upto: u64) {
        while self
            .unwritten
            .first_key_value()
            .is_some_and(|(batch, _)| *batch <= upto)
        {
            self.unwritten.pop_first();
        }
    }

    /// Is it time to read the next scheduled messages back from disk?
    pub fn wants_read(&self, now: u64) -> bool {
        self.disk_from.is_some()
            && (self.loaded.len() < LOW_LOADED && self.loaded_bytes < LOW_LOADED_BYTES)
            && self.retry_at.is_none_or(|t| now >= t)
    }

    /// Where to read from, up to which key (exclusive: the first that may not be written yet)
    /// and how much, if a read may run now; otherwise it is retried [`READ_RETRY_MS`] later.
    pub fn read_request(&mut self, now: u64) -> Option<ReadRequest> {
        let from = self.disk_from?;
        let until = self.barrier();
        if until.is_some_and(|u| u <= from) {
            self.retry_at = Some(now.saturating_add(READ_RETRY_MS));
            return None;
        }
        let max = MAX_LOADED.saturating_sub(self.loaded.len()).max(1);
        let bytes = MAX_LOADED_BYTES.saturating_sub(self.loaded_bytes).max(1);
        Some(ReadRequest {
            from,
            until,
            max_messages: max,
            max_bytes: bytes,
        })
    }

    /// A read of `request` returned `read` (in key order); `more`: it stopped at its limit.
    pub fn loaded_from_disk(
        &mut self,
        request: ReadRequest,
        read: Vec<(DelayKey, Delayed)>,
        more: bool,
    ) {
        let last = read.last().map(|(k, _)| *k);
        for (key, d) in read {
            if key < request.from || request.until.is_some_and(|u| key >= u) {
                // Outside what was asked: memory has it already, or it is read later.
                continue;
            }
            self.loaded_bytes += d.size();
            self.loaded.insert(key, d);
        }
        self.disk_from = match (more, last) {
            (true, Some(last)) => Some(last.next()),
            // Everything before the barrier is read; from there on, the disk may hold more.
            _ => request.until,
        };
        self.retry_at = None;
    }

    /// A read failed: try again later.
    pub fn read_failed(&mut self, now: u64) {
        self.retry_at = Some(now.saturating_add(READ_RETRY_MS));
    }

    /// The holder (the queue `name` if `queue`, else the exchange `name`) is gone: what it
    /// holds in memory goes, and the keys are returned (to delete them on disk). What is on
    /// disk only is dropped when it is read back, by its [`Holder`].
    pub fn drop_held(&mut self, vhost: &str, queue: bool, name: &str) -> Vec<DelayKey> {
        let keys: Vec<DelayKey> = self
            .loaded
            .iter()
            .filter(|(_, d)| d.held_by(vhost, queue, name))
            .map(|(k, _)| *k)
            .collect();
        for key in &keys {
            if let Some(d) = self.loaded.remove(key) {
                self.loaded_bytes = self.loaded_bytes.saturating_sub(d.size());
                self.count = self.count.saturating_sub(1);
            }
        }
        keys
    }

    /// `key`'s message, if it is in memory.
    pub fn loaded_get(&self, key: DelayKey) -> Option<&Delayed> {
        self.loaded.get(&key)
    }

    /// Takes `key` out of memory, if it is there (one on disk only is left there).
    pub fn cancel(&mut self, key: DelayKey) -> Option<Delayed> {
        let d = self.loaded.remove(&key)?;
        self.loaded_bytes = self.loaded_bytes.saturating_sub(d.size());
        self.count = self.count.saturating_sub(1);
        Some(d)
    }

    /// `key` is deleted wherever it is: taken out of memory, or, on disk only (at or past
    /// where memory ends), no longer counted, as its delete reaches the disk before it is read
    /// back (a key before that edge and not in memory has come due and was counted out then).
    pub fn forget(&mut self, key: DelayKey) {
        if self.cancel(key).is_none() && self.disk_from.is_some_and(|from| key >= from) {
            self.count = self.count.saturating_sub(1);
        }
    }

    /// The next scheduled message if it is due at `now`.
    pub fn pop_due(&mut self, now: u64) -> Option<(DelayKey, Delayed)> {
        let entry = self.loaded.first_entry()?;
        if entry.key().due > now {
            return None;
        }
        let (key, d) = entry.remove_entry();
        self.loaded_bytes = self.loaded_bytes.saturating_sub(d.size());
        self.count = self.count.saturating_sub(1);
        Some((key, d))
    }

    /// When the scheduler next has work: a message due, or a read to make.
    pub fn deadline(&self) -> Option<u64> {
        let due = self.loaded.first_key_value().map(|(k, _)| k.due);
        let read = self.disk_from.map(|from| {
            if self.loaded.len() < LOW_LOADED && self.loaded_bytes < LOW_LOADED_BYTES {
                self.retry_at.unwrap_or(0)
            } else {
                // The window is full enough: read when it runs dry, at the earliest when the
                // first message on disk could be due.
                from.due
            }
        });
        match (due, read) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Scheduled messages this run knows of (in memory and on disk).
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Scheduled messages in memory.
    pub fn loaded(&self) -> usize {
        self.loaded.len()
    }
}

/// The longest delay the delayed-message plugin accepts (2^32 - 1 ms, 49.7 days); a longer
/// one routes the message at once, as there.
pub const MAX_DELAY_MS: u64 = u32::MAX as u64;

/// What a message's `x-delay` header asks for, as the delayed-message plugin reads it:
/// milliseconds as any integer type, a numeric string, or a float (truncated). Only a delay
/// in `1..=MAX_DELAY_MS` holds the message back; a missing, zero, negative, too large or
/// unreadable one routes it at once (never an error).
pub fn header_delay(headers: Option<&FieldTable>) -> Option<u64> {
    let v = headers?.get("x-delay")?;
    let ms: i128 = match v {
        FieldValue::I8(_)
        | FieldValue::U8(_)
        | FieldValue::I16(_)
        | FieldValue::U16(_)
        | FieldValue::I32(_)
        | FieldValue::U32(_)
        | FieldValue::I64(_)
        | FieldValue::U64(_) => i128::from(v.as_i64()?),
        FieldValue::F32(_) | FieldValue::F64(_) => {
            let f = v.as_f64()?;
            if !f.is_finite() {
                return None;
            }
            f.trunc() as i128
        }
        FieldValue::LongStr(b) => std::str::from_utf8(b).ok()?.trim().parse().ok()?,
        _ => return None,
    };
    u64::try_from(ms)
        .ok()
        .filter(|ms| (1..=MAX_DELAY_MS).contains(ms))
}

/// The properties a message from a delayed exchange is delivered with: `x-delay` set to the
/// negated delay (as the plugin does, so that a copy sent back to a delayed exchange, by a
/// dead-letter exchange say, is not held back again). A 32-bit integer, as RabbitMQ 3.10's
/// plugin writes it, when it fits.
pub fn released_properties(properties: &Bytes, delay_ms: u64) -> Result<Bytes, CodecError> {
    let mut props = BasicProperties::decode_bytes(properties.clone())?;
    let mut headers = props.headers.take().unwrap_or_default();
    let negated = -(i64::try_from(delay_ms).unwrap_or(i64::MAX));
    let value = match i32::try_from(negated) {
        Ok(v) => FieldValue::I32(v),
        Err(_) => FieldValue::I64(negated),
    };
    headers.insert(ShortStr::from_static("x-delay"), value);
    props.headers = Some(headers);
    Ok(props.encode())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(n: u8) -> Delayed {
        Delayed {
            vhost: "/".into(),
            queue: None,
            holder: Holder::Any,
            refused: 0,
            message: Message {
                exchange: "x".into(),
                routing_key: "k".into(),
                properties: Bytes::new(),
                body: Bytes::from(vec![n; 10]),
                persistent: true,
                store_key: None,
                away: None,
            },
        }
    }

    fn key(due: u64, seq: u64) -> DelayKey {
        DelayKey { due, seq }
    }

    #[test]
    fn in_memory_everything_stays_and_comes_out_in_due_order() {
        let mut s = Scheduler::default();
        for (i, due) in [30u64, 10, 20, 10].into_iter().enumerate() {
            let seq = s.memory_seq();
            s.schedule(key(due, seq), d(i as u8), None);
        }
        assert_eq!(s.deadline(), Some(10));
        assert!(s.pop_due(9).is_none(), "never early");
        let out: Vec<u64> = std::iter::from_fn(|| s.pop_due(25))
            .map(|(k, _)| k.due)
            .collect();
        assert_eq!(out, vec![10, 10, 20]);
        assert_eq!(s.deadline(), Some(30));
        assert_eq!(s.count(), 1);
    }

    #[test]
    fn a_forgotten_key_leaves_the_count_in_memory_or_on_disk_and_once_only() {
        let mut s = Scheduler::default();
        for i in 0..(MAX_LOADED as u64 + 2) {
            s.schedule(key(1000 + i, i), d(0), Some(1));
        }
        let total = MAX_LOADED as u64 + 2;
        assert_eq!(s.count(), total);
        s.forget(key(1000, 0));
        assert_eq!((s.count(), s.loaded()), (total - 1, MAX_LOADED - 1));
        // On disk only.
        s.forget(key(1000 + total - 1, total - 1));
        assert_eq!((s.count(), s.loaded()), (total - 2, MAX_LOADED - 1));
        // Released already: nothing more.
        let (first, _) = s.pop_due(2000).expect("due");
        s.forget(first);
        assert_eq!(s.count(), total - 3);
    }

    #[test]
    fn past_the_window_messages_live_on_disk_and_a_read_waits_for_their_write() {
        let mut s = Scheduler::default();
        for i in 0..(MAX_LOADED as u64 + 10) {
            s.schedule(key(1000 + i, i), d(0), Some(1));
        }
        assert_eq!(s.loaded(), MAX_LOADED);
        assert_eq!(
            s.disk_from,
            Some(key(1000 + MAX_LOADED as u64, MAX_LOADED as u64))
        );
        // Later than the edge: disk only. Earlier: memory, and the last one leaves.
        s.schedule(key(5_000_000, 1 << 40), d(0), Some(2));
        assert_eq!(s.loaded(), MAX_LOADED);
        s.schedule(key(1, 1 << 41), d(0), Some(2));
        assert_eq!(s.loaded(), MAX_LOADED);
        assert_eq!(
            s.disk_from,
            Some(key(999 + MAX_LOADED as u64, MAX_LOADED as u64 - 1))
        );
        // Drain below the low-water mark: a read is wanted, but batch 2 is not written yet.
        let mut n = 0;
        while s.pop_due(1000 + LOW_LOADED as u64).is_some() {
            n += 1;
        }
        assert!(n > LOW_LOADED);
        assert!(s.wants_read(0));
        assert_eq!(s.read_request(100), None);
        assert!(!s.wants_read(100));
        assert!(s.wants_read(100 + READ_RETRY_MS));
        s.written(2);
        let r = s.read_request(200).unwrap();
        assert_eq!(r.from, s.disk_from.unwrap());
        assert_eq!(r.until, None, "everything is written");
        assert_eq!(r.max_messages, MAX_LOADED - s.loaded());
        let from = r.from;
        s.loaded_from_disk(
            r,
            vec![(from, d(1)), (key(5_000_000, 1 << 40), d(2))],
            false,
        );
        assert_eq!(s.disk_from, None);
        assert!(!s.wants_read(300));
        assert_eq!(s.count(), MAX_LOADED as u64 + 12 - n as u64);
    }

    #[test]
    fn after_a_restart_the_first_read_comes_at_once() {
        let mut s = Scheduler::default();
        s.restore();
        assert_eq!(s.deadline(), Some(0));
        let r = s.read_request(50).unwrap();
        assert_eq!(r.from, key(0, 0));
        s.loaded_from_disk(r, vec![(key(40, 7), d(0))], true);
        assert_eq!(s.disk_from, Some(key(40, 8)));
        assert_eq!(s.pop_due(50).map(|(k, _)| k), Some(key(40, 7)));
        // Still below the low-water mark with more on disk: read again now.
        assert_eq!(s.deadline(), Some(0));
        let r = s.read_request(50).unwrap();
        s.loaded_from_disk(r, Vec::new(), false);
        assert_eq!(s.deadline(), None);
    }

    #[test]
    fn later_writes_on_their_way_do_not_hold_back_a_read_of_earlier_keys() {
        // The steady state of a busy delayed exchange: every new message is due after what is
        // on disk, and some batch is always being written.
        let mut s = Scheduler::default();
        let total = MAX_LOADED as u64 + 2000;
        for i in 0..total {
            s.schedule(key(1000 + i, i), d(0), Some(1));
        }
        s.written(1);
        let mut next = total;
        let mut released = 0;
        for (batch, now) in (2..).zip(1000..(1000 + total)) {
            // A new message, due later than everything, in a batch not yet written.
            s.schedule(key(1_000_000 + next, next), d(0), Some(batch));
            next += 1;
            if s.wants_read(now) {
                let r = s
                    .read_request(now)
                    .expect("a read may run below the barrier");
                // Two batches are on their way: the barrier is the older one's key.
                assert_eq!(r.until, Some(key(1_000_000 + next - 2, next - 2)));
                // What the disk holds in that range: the earlier keys, all written.
                let found = (r.from.seq..total.min(r.from.seq + r.max_messages as u64))
                    .map(|i| (key(1000 + i, i), d(0)))
                    .collect::<Vec<_>>();
                let more = r.from.seq + (r.max_messages as u64) < total;
                s.loaded_from_disk(r, found, more);
            }
            while s.pop_due(now).is_some() {
                released += 1;
            }
            s.written(batch - 1);
        }
        assert_eq!(released, total, "every earlier message released on time");
    }

    #[test]
    fn a_released_message_says_its_delay_was_spent() {
        let mut h = FieldTable::new();
        h.insert("x-delay", FieldValue::I64(1500));
        h.insert("k", FieldValue::long_str("v"));
        let p = BasicProperties {
            headers: Some(h),
            ..BasicProperties::default()
        }
        .encode();
        let back = BasicProperties::decode_bytes(released_properties(&p, 1500).unwrap()).unwrap();
        let h = back.headers.unwrap();
        assert_eq!(h.get("x-delay"), Some(&FieldValue::I32(-1500)));
        assert_eq!(h.get("k"), Some(&FieldValue::long_str("v")));
        assert_eq!(header_delay(Some(&h)), None, "not delayed again");
    }

    #[test]
    fn x_delay_is_an_integer_number_of_milliseconds() {
        let mut h = FieldTable::new();
        assert_eq!(header_delay(Some(&h)), None);
        for (v, want) in [
            (FieldValue::I32(1500), Some(1500)),
            (FieldValue::I64(5), Some(5)),
            (FieldValue::U8(7), Some(7)),
            (FieldValue::I32(0), None),
            (FieldValue::I32(-10), None),
            (FieldValue::long_str("1000"), Some(1000)),
            (FieldValue::long_str("soon"), None),
            (FieldValue::F64(10.7), Some(10)),
            (FieldValue::F64(f64::NAN), None),
            (FieldValue::I64(MAX_DELAY_MS as i64), Some(MAX_DELAY_MS)),
            (FieldValue::I64(MAX_DELAY_MS as i64 + 1), None),
            (FieldValue::Bool(true), None),
        ] {
            h.insert("x-delay", v.clone());
            assert_eq!(header_delay(Some(&h)), want, "{v:?}");
        }
        assert_eq!(header_delay(None), None);
    }
}
