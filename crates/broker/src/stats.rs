//! What operators read about a queue: message counters (RabbitMQ's `message_stats`), the age
//! of the oldest ready message, and how many deliveries messages needed.
//!
//! Kept beside the queue machine, not in it: statistics are not part of the replicated state,
//! and a replay must not depend on them. Updated from each command's reply and effects, so the
//! machine's hot path pays one pass over effects it produces anyway.

use std::collections::VecDeque;

use crate::queue::machine::{DeadLetterReason, Effect, Reply};

/// The upper bounds of the delivery-count histogram: how many deliveries a message had when it
/// left the queue (acked or dead-lettered). The last bucket is "more".
pub const DELIVERY_BUCKETS: [u32; 5] = [1, 2, 3, 5, 10];

/// Counters of one queue since it was declared (or the broker started). Every field only grows.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct QueueCounters {
    /// Messages enqueued (RabbitMQ's `publish`).
    pub published: u64,
    /// Deliveries to consumers that ack (`deliver`) and that do not (`deliver_no_ack`).
    pub delivered: u64,
    pub delivered_no_ack: u64,
    /// basic.get with and without ack (`get`, `get_no_ack`).
    pub got: u64,
    pub got_no_ack: u64,
    /// Deliveries of messages delivered before (`redeliver`).
    pub redelivered: u64,
    /// Acknowledgements that settled a message (`ack`).
    pub acked: u64,
    /// Messages that left unacknowledged, by reason (dead-lettered if the queue has a
    /// dead-letter exchange, else dropped): rejected, expired, maxlen, delivery_limit.
    pub dead_lettered: [u64; 4],
    /// Messages that left (acked or dead-lettered) by how many deliveries they had:
    /// `DELIVERY_BUCKETS` then one bucket for more. A message never delivered counts as 0
    /// deliveries and falls in the first bucket.
    pub deliveries: [u64; DELIVERY_BUCKETS.len() + 1],
    /// The sum of those delivery counts (for a Prometheus histogram's `_sum`).
    pub deliveries_sum: u64,
}

impl QueueCounters {
    /// `deliver_get`: every delivery and get.
    pub fn deliver_get(&self) -> u64 {
        self.delivered + self.delivered_no_ack + self.got + self.got_no_ack
    }

    pub fn dead_lettered_by(&self, reason: DeadLetterReason) -> u64 {
        self.dead_lettered[reason_index(reason)]
    }

    fn left_after(&mut self, deliveries: u32) {
        let bucket = DELIVERY_BUCKETS
            .iter()
            .position(|b| deliveries <= *b)
            .unwrap_or(DELIVERY_BUCKETS.len());
        if let Some(n) = self.deliveries.get_mut(bucket) {
            *n += 1;
        }
        self.deliveries_sum += u64::from(deliveries);
    }
}

/// The reasons in `QueueCounters::dead_lettered` order, with RabbitMQ's names.
pub const DEAD_LETTER_REASONS: [(DeadLetterReason, &str); 4] = [
    (DeadLetterReason::Rejected, "rejected"),
    (DeadLetterReason::Expired, "expired"),
    (DeadLetterReason::MaxLen, "maxlen"),
    (DeadLetterReason::DeliveryLimit, "delivery_limit"),
];

fn reason_index(reason: DeadLetterReason) -> usize {
    match reason {
        DeadLetterReason::Rejected => 0,
        DeadLetterReason::Expired => 1,
        DeadLetterReason::MaxLen => 2,
        DeadLetterReason::DeliveryLimit => 3,
    }
}

/// Node-wide counters of publishes (RabbitMQ's `rabbitmq_global_messages_*`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BrokerCounters {
    /// Messages published by clients (basic.publish, the API's publish).
    pub received: u64,
    /// Of those, routed to no queue.
    pub unroutable: u64,
    /// Delayed messages that a full `reject-publish` queue refused when they fell due (each
    /// refusal once): they are held back and tried again, not dropped.
    pub delayed_refused: u64,
}

/// What a command was, as far as counters care (taken before the command is applied).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Counted {
    Enqueue,
    Settle {
        attempt: u32,
    },
    /// Recovery brought messages back from this id on: their age counts from now.
    Restored {
        first_id: u64,
    },
    Other,
}

/// When messages were enqueued, coarsely: `(first id, time)` pairs, at most one per
/// `resolution` ms, so that the age of the oldest ready message is known to within that
/// resolution without a timestamp per message. The pairs say: messages with ids from this one
/// on were enqueued at this time or later.
#[derive(Clone, Debug)]
pub struct EnqueueTimes {
    marks: VecDeque<(u64, u64)>,
    /// The latest enqueue of each mark's messages (those up to the next mark's id).
    lasts: VecDeque<u64>,
    resolution_ms: u64,
}

impl Default for EnqueueTimes {
    fn default() -> Self {
        EnqueueTimes {
            marks: VecDeque::new(),
            lasts: VecDeque::new(),
            resolution_ms: BASE_RESOLUTION_MS,
        }
    }
}

/// Marks kept per queue before they are thinned (every other one dropped, resolution doubled).
const MAX_MARKS: usize = 512;
const BASE_RESOLUTION_MS: u64 = 1000;

impl EnqueueTimes {
    /// Message `msg_id` was enqueued now. `oldest`: the oldest ready message's id, asked only
    /// when a mark is added (at most once per resolution), to forget marks no longer needed.
    pub(crate) fn enqueued(
        &mut self,
        msg_id: u64,
        now_ms: u64,
        oldest: impl FnOnce() -> Option<u64>,
    ) {
        if self
            .marks
            .back()
            .is_some_and(|(_, at)| now_ms < at.saturating_add(self.resolution_ms))
        {
            if let Some(last) = self.lasts.back_mut() {
                *last = (*last).max(now_ms);
            }
            return;
        }
        match oldest() {
            Some(id) => self.forget_below(id),
            None => {
                self.marks.clear();
                self.lasts.clear();
            }
        }
        if self.marks.len() < MAX_MARKS / 4 {
            self.resolution_ms = BASE_RESOLUTION_MS;
        }
        if self.marks.len() >= MAX_MARKS {
            // A backlog older than MAX_MARKS x resolution: keep every other mark (the first
            // always, so the oldest message's time is never understated).
            let mut i = 0;
            self.marks.retain(|_| {
                i += 1;
                i % 2 == 1
            });
            // A kept mark's messages now run to the next kept one: its latest is the later.
            let lasts: Vec<u64> = self.lasts.iter().copied().collect();
            self.lasts = lasts
                .chunks(2)
                .map(|c| c.iter().copied().max().unwrap_or(0))
                .collect();
            self.resolution_ms = self.resolution_ms.saturating_mul(2);
        }
        self.marks.push_back((msg_id, now_ms));
        self.lasts.push_back(now_ms);
    }

    /// Forgets the marks that only messages below `oldest_id` (gone) needed.
    fn forget_below(&mut self, oldest_id: u64) {
        while self.marks.len() > 1 && self.marks.get(1).is_some_and(|(id, _)| *id <= oldest_id) {
            self.marks.pop_front();
            self.lasts.pop_front();
        }
    }

    /// The expiry caps a queue TTL of `ttl_ms` set now gives the messages already queued
    /// (`machine::Command::CapExpiry`): each mark's messages expire by their latest enqueue
    /// plus the TTL (late by up to the resolution, never early); messages older than every
    /// mark by the first mark's time plus the TTL; with no mark, everything by `now_ms` plus
    /// the TTL.
    pub(crate) fn expiry_caps(&self, ttl_ms: u64, now_ms: u64) -> Vec<(u64, u64)> {
        let Some(&(first_id, first_at)) = self.marks.front() else {
            return vec![(u64::MAX, now_ms.saturating_add(ttl_ms))];
        };
        let older = first_id
            .checked_sub(1)
            .map(|id| (id, first_at.saturating_add(ttl_ms)));
        let up_to = self
            .marks
            .iter()
            .skip(1)
            .map(|(id, _)| id.saturating_sub(1))
            .chain(std::iter::once(u64::MAX));
        older
            .into_iter()
            .chain(
                up_to
                    .zip(&self.lasts)
                    .map(|(id, last)| (id, last.saturating_add(ttl_ms))),
            )
            .collect()
    }

    /// When the message `oldest_id` was enqueued, at the latest. `None` without a mark at or
    /// below it.
    pub fn peek_enqueued_at(&self, oldest_id: u64) -> Option<u64> {
        let i = self.marks.partition_point(|(id, _)| *id <= oldest_id);
        i.checked_sub(1)
            .and_then(|i| self.marks.get(i))
            .map(|(_, at)| *at)
    }
}

/// A queue's statistics.
#[derive(Clone, Debug, Default)]
pub struct QueueStats {
    pub counters: QueueCounters,
    pub enqueue_times: EnqueueTimes,
}

impl QueueStats {
    /// Counts what one applied command did.
    pub(crate) fn observe<M>(
        &mut self,
        (counted, reply): (Counted, &Reply),
        effects: &[Effect<M>],
        now_ms: u64,
        oldest: impl FnOnce() -> Option<u64>,
    ) {
        let c = &mut self.counters;
        match (counted, reply) {
            (Counted::Enqueue, Reply::Enqueued { msg_id }) => {
                c.published += 1;
                self.enqueue_times.enqueued(*msg_id, now_ms, oldest);
            }
            // Held until due (a quorum queue's delivery delay): published now, in the queue
            // once a tick releases it.
            (Counted::Enqueue, Reply::Ok) => c.published += 1,
            (Counted::Settle { attempt }, Reply::Ok) => {
                c.acked += 1;
                c.left_after(attempt);
            }
            (Counted::Restored { first_id }, _) => {
                self.enqueue_times.enqueued(first_id, now_ms, oldest)
            }
            _ => {}
        }
        for e in effects {
            match e {
                Effect::Deliver(d) => {
                    match (d.consumer.is_some(), d.settled) {
                        (true, false) => c.delivered += 1,
                        (true, true) => c.delivered_no_ack += 1,
                        (false, false) => c.got += 1,
                        (false, true) => c.got_no_ack += 1,
                    }
                    if d.redelivered {
                        c.redelivered += 1;
                    }
                    if d.settled {
                        c.left_after(d.receipt.attempt);
                    }
                }
                Effect::DeadLetter {
                    reason,
                    delivery_count,
                    ..
                } => {
                    if let Some(n) = c.dead_lettered.get_mut(reason_index(*reason)) {
                        *n += 1;
                    }
                    c.left_after(*delivery_count);
                }
                Effect::SettledLate { delivery_count, .. } => {
                    c.acked += 1;
                    c.left_after(*delivery_count);
                }
                Effect::TimedOut { .. } | Effect::ConsumerTimedOut { .. } => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oldest_time_is_never_later_than_the_message() {
        let mut t = EnqueueTimes::default();
        t.enqueued(0, 10_000, || Some(0));
        t.enqueued(1, 10_500, || Some(0)); // within the resolution: no mark
        t.enqueued(2, 11_200, || Some(0));
        assert_eq!(t.peek_enqueued_at(1), Some(10_000));
        assert_eq!(t.peek_enqueued_at(2), Some(11_200));
        // Messages 0..=2 are gone: their marks too, once a new mark is made.
        t.enqueued(3, 15_000, || Some(3));
        assert_eq!(t.peek_enqueued_at(3), Some(15_000));
        assert_eq!(t.marks, [(2, 11_200), (3, 15_000)]);
        // An empty queue starts afresh.
        t.enqueued(4, 17_000, || None);
        assert_eq!(t.peek_enqueued_at(4), Some(17_000));
        assert_eq!(t.peek_enqueued_at(3), None);
    }

    #[test]
    fn expiry_caps_never_come_before_enqueue_plus_ttl() {
        let mut t = EnqueueTimes::default();
        assert_eq!(t.expiry_caps(1_000, 9_000), vec![(u64::MAX, 10_000)]);
        t.enqueued(0, 0, || Some(0));
        t.enqueued(1, 500, || Some(0));
        t.enqueued(2, 5_000, || Some(0));
        t.enqueued(3, 5_200, || Some(0));
        // 0 and 1 by 500 + 1000; 2 and 3 by 5200 + 1000.
        assert_eq!(
            t.expiry_caps(1_000, 9_000),
            vec![(1, 1_500), (u64::MAX, 6_200)]
        );
        // 0..=2 gone: 3's mark... and what is older than the first mark by its time.
        t.enqueued(4, 8_000, || Some(3));
        assert_eq!(
            t.expiry_caps(1_000, 9_000),
            vec![(1, 6_000), (3, 6_200), (u64::MAX, 9_000)]
        );
    }

    #[test]
    fn a_long_backlog_thins_its_marks_and_keeps_the_first() {
        let mut t = EnqueueTimes::default();
        for i in 0..10_000u64 {
            t.enqueued(i, i * 1000, || Some(0));
        }
        assert!(t.marks.len() <= MAX_MARKS);
        assert_eq!(t.peek_enqueued_at(0), Some(0));
        // Message 5000 was enqueued at 5,000,000; the mark found is at or before it, and not
        // by more than the resolution reached.
        let at = t.peek_enqueued_at(5000).unwrap();
        assert!(at <= 5_000_000 && 5_000_000 - at <= t.resolution_ms, "{at}");
    }

    #[test]
    fn histogram_buckets() {
        let mut c = QueueCounters::default();
        for n in [0, 1, 2, 3, 4, 5, 6, 10, 11, 50] {
            c.left_after(n);
        }
        assert_eq!(c.deliveries, [2, 1, 1, 2, 2, 2]);
        assert_eq!(c.deliveries_sum, 92);
    }
}
