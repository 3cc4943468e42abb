//! Message rates and recent history, as RabbitMQ's management plugin keeps them: counters are
//! sampled every few seconds, a rate is the change over the last interval, and the last minutes
//! of depth and rates are kept for the web page's graphs.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use warren_broker::stats::QueueCounters;
use warren_broker::QueueId;

use crate::driver::NodeHandle;

/// RabbitMQ's default collection interval.
pub const INTERVAL: Duration = Duration::from_secs(5);
/// Points kept per queue (2 minutes) and for the whole node (10 minutes).
const QUEUE_POINTS: usize = 24;
const NODE_POINTS: usize = 120;

/// Rates (per second) of one queue's counters over the last interval.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct QueueRates {
    pub publish: f64,
    pub deliver: f64,
    pub deliver_no_ack: f64,
    pub get: f64,
    pub get_no_ack: f64,
    pub deliver_get: f64,
    pub ack: f64,
    pub redeliver: f64,
}

/// One point of history.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Point {
    /// Seconds since the epoch.
    pub at: u64,
    pub ready: u64,
    pub unacked: u64,
    pub publish: f32,
    pub deliver_get: f32,
    pub ack: f32,
}

impl Point {
    fn is_idle(&self) -> bool {
        self.ready == 0 && self.unacked == 0 && self.publish == 0.0 && self.deliver_get == 0.0
    }
}

#[derive(Debug, Default)]
struct QueueSample {
    counters: QueueCounters,
    rates: QueueRates,
    /// Empty while the queue is idle, so idle queues cost no history.
    history: VecDeque<Point>,
}

#[derive(Debug, Default)]
struct Inner {
    /// Node time (ms) of the last sample.
    at: u64,
    queues: HashMap<QueueId, QueueSample>,
    node: QueueRates,
    node_history: VecDeque<Point>,
    /// Node-wide publish counter at the last sample (messages received from clients).
    received: u64,
}

/// The sampled rates, shared by the API handlers and the sampler.
#[derive(Debug, Default)]
pub struct Rates {
    inner: Mutex<Inner>,
}

fn per_second(now: u64, before: u64, ms: u64) -> f64 {
    if ms == 0 {
        return 0.0;
    }
    now.saturating_sub(before) as f64 * 1000.0 / ms as f64
}

fn rates_of(now: &QueueCounters, before: &QueueCounters, ms: u64) -> QueueRates {
    let r = |a: u64, b: u64| per_second(a, b, ms);
    QueueRates {
        publish: r(now.published, before.published),
        deliver: r(now.delivered, before.delivered),
        deliver_no_ack: r(now.delivered_no_ack, before.delivered_no_ack),
        get: r(now.got, before.got),
        get_no_ack: r(now.got_no_ack, before.got_no_ack),
        deliver_get: r(now.deliver_get(), before.deliver_get()),
        ack: r(now.acked, before.acked),
        redeliver: r(now.redelivered, before.redelivered),
    }
}

fn push(history: &mut VecDeque<Point>, p: Point, max: usize) {
    if history.len() >= max {
        history.pop_front();
    }
    history.push_back(p);
}

impl Rates {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes one sample: each queue's counters (`(id, ready, unacked, counters)`) and the
    /// node's publish counter at node time `now` (ms).
    pub fn sample(&self, now: u64, queues: Vec<(QueueId, u64, u64, QueueCounters)>, received: u64) {
        let mut inner = self.lock();
        let first = inner.at == 0;
        let ms = if first {
            0
        } else {
            now.saturating_sub(inner.at)
        };
        // Only queues that ever moved a message are kept: a queue missing from the map reads as
        // zero rates and no history, which is what an idle queue's entry would hold, and a node
        // with thousands of idle queues keeps nothing for them.
        let mut seen = HashMap::with_capacity(inner.queues.len());
        let mut total = QueueRates::default();
        let (mut ready_all, mut unacked_all) = (0u64, 0u64);
        for (id, ready, unacked, counters) in queues {
            let mut s = inner.queues.remove(&id).unwrap_or_default();
            s.rates = if first {
                QueueRates::default()
            } else {
                rates_of(&counters, &s.counters, ms)
            };
            s.counters = counters;
            let p = Point {
                at: now / 1000,
                ready,
                unacked,
                publish: s.rates.publish as f32,
                deliver_get: s.rates.deliver_get as f32,
                ack: s.rates.ack as f32,
            };
            if !(s.history.is_empty() && p.is_idle()) {
                push(&mut s.history, p, QUEUE_POINTS);
            }
            total.deliver += s.rates.deliver;
            total.deliver_no_ack += s.rates.deliver_no_ack;
            total.get += s.rates.get;
            total.get_no_ack += s.rates.get_no_ack;
            total.deliver_get += s.rates.deliver_get;
            total.ack += s.rates.ack;
            total.redeliver += s.rates.redeliver;
            ready_all += ready;
            unacked_all += unacked;
            if s.counters != QueueCounters::default() || !s.history.is_empty() {
                seen.insert(id, s);
            }
        }
        // Queues deleted since the last sample are forgotten with the old map.
        inner.queues = seen;
        total.publish = if first {
            0.0
        } else {
            per_second(received, inner.received, ms)
        };
        inner.received = received;
        inner.node = total;
        inner.at = now;
        let p = Point {
            at: now / 1000,
            ready: ready_all,
            unacked: unacked_all,
            publish: total.publish as f32,
            deliver_get: total.deliver_get as f32,
            ack: total.ack as f32,
        };
        push(&mut inner.node_history, p, NODE_POINTS);
    }

    pub fn queue(&self, id: QueueId) -> QueueRates {
        self.lock()
            .queues
            .get(&id)
            .map(|s| s.rates)
            .unwrap_or_default()
    }

    /// The rates of many queues at once (one lock).
    pub fn queues(&self, ids: impl Iterator<Item = QueueId>) -> Vec<QueueRates> {
        let inner = self.lock();
        ids.map(|id| inner.queues.get(&id).map(|s| s.rates).unwrap_or_default())
            .collect()
    }

    pub fn queue_history(&self, id: QueueId) -> Vec<Point> {
        self.lock()
            .queues
            .get(&id)
            .map(|s| s.history.iter().copied().collect())
            .unwrap_or_default()
    }

    pub fn node(&self) -> (QueueRates, Vec<Point>) {
        let inner = self.lock();
        (inner.node, inner.node_history.iter().copied().collect())
    }
}

/// Samples the node every [`INTERVAL`] until the process ends.
pub async fn run(rates: Arc<Rates>, node: NodeHandle) {
    let mut tick = tokio::time::interval(INTERVAL);
    loop {
        tick.tick().await;
        let (now, queues, received) = node.read(|n, now| {
            let b = n.broker();
            (now, b.queue_counters(), b.counters().received)
        });
        rates.sample(now, queues, received);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_idle_queue_holds_no_entry_until_it_moves_a_message() {
        let r = Rates::default();
        let (idle, busy) = (QueueId(1), QueueId(2));
        let c = |p: u64| QueueCounters {
            published: p,
            ..QueueCounters::default()
        };
        r.sample(1_000_000, vec![(idle, 0, 0, c(0)), (busy, 0, 0, c(5))], 5);
        assert_eq!(r.lock().queues.len(), 1);
        r.sample(1_005_000, vec![(idle, 0, 0, c(10)), (busy, 0, 0, c(5))], 15);
        // Its first messages count from zero: as if it had been sampled while idle.
        assert_eq!(r.queue(idle).publish, 2.0);
        assert_eq!(r.queue(busy).publish, 0.0);
        assert_eq!(r.lock().queues.len(), 2);
    }

    #[test]
    fn a_rate_is_the_change_over_the_interval() {
        let r = Rates::default();
        let q = QueueId(1);
        let c = |p: u64, a: u64| QueueCounters {
            published: p,
            acked: a,
            ..QueueCounters::default()
        };
        r.sample(1_000_000, vec![(q, 0, 0, c(100, 0))], 100);
        assert_eq!(r.queue(q).publish, 0.0);
        r.sample(1_005_000, vec![(q, 10, 2, c(150, 40))], 160);
        assert_eq!(r.queue(q).publish, 10.0);
        assert_eq!(r.queue(q).ack, 8.0);
        assert_eq!(r.node().0.publish, 12.0);
        assert_eq!(r.queue_history(q).len(), 1);
        // A deleted queue is forgotten.
        r.sample(1_010_000, vec![], 160);
        assert_eq!(r.queue(q), QueueRates::default());
        assert_eq!(r.node().1.len(), 3);
    }
}
