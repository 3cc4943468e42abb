//! Plain copies of what the broker holds, for the management API and metrics: taken under the
//! node's lock, serialised after it is released.

use warren_codec::{FieldTable, ShortStr};

use super::{type_name, Broker, Dest};
use crate::queue::Queue;
use crate::stats::QueueCounters;
use crate::{ConnId, QueueId};

/// One queue as operators see it.
#[derive(Clone, Debug)]
pub struct QueueSnapshot {
    pub id: QueueId,
    pub vhost: String,
    pub name: ShortStr,
    pub durable: bool,
    pub auto_delete: bool,
    /// The connection of an exclusive queue.
    pub owner: Option<ConnId>,
    pub arguments: FieldTable,
    /// `classic`, `quorum` or `stream`, as declared with `x-queue-type`.
    pub queue_type: &'static str,
    pub ready: u64,
    pub unacked: u64,
    pub ready_bytes: u64,
    pub unacked_bytes: u64,
    /// Ready messages on disk only (not in memory).
    pub paged: u64,
    /// Ready messages waiting for a delayed retry.
    pub retrying: u64,
    pub consumers: u32,
    pub counters: QueueCounters,
    /// When the oldest ready message was enqueued (ms since the epoch), if any is ready.
    pub oldest_ready_at: Option<u64>,
    /// The deduplication window (`x-message-deduplication`), if it has one.
    pub dedup: Option<crate::dedup::DedupStats>,
    /// The user and operator policies that apply, and what they set together.
    pub policy: Option<String>,
    pub operator_policy: Option<String>,
    pub effective_policy_definition: crate::policy::Definition,
    /// A replicated queue: its group's leader as this node knows it (`None`: none now).
    pub replica: Option<Option<u64>>,
    /// A replicated queue's voters of its own (`x-quorum-initial-group-size`); `None`: every
    /// node of the cluster.
    pub voters: Option<Vec<u64>>,
}

#[derive(Clone, Debug)]
pub struct ExchangeSnapshot {
    pub vhost: String,
    pub name: ShortStr,
    /// The type as declared (`x-delayed-message` for a delayed exchange).
    pub kind: &'static str,
    pub durable: bool,
    pub auto_delete: bool,
    pub internal: bool,
    pub arguments: FieldTable,
    /// The deduplication window (`x-message-deduplication`), if it has one.
    pub dedup: Option<crate::dedup::DedupStats>,
    /// The user policy that applies.
    pub policy: Option<String>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct BindingSnapshot {
    pub vhost: String,
    /// `""` for the default exchange's implicit binding to every queue.
    pub source: ShortStr,
    pub destination: ShortStr,
    /// The destination is a queue (else an exchange).
    pub to_queue: bool,
    pub routing_key: ShortStr,
    pub arguments: FieldTable,
}

#[derive(Clone, Debug)]
pub struct ConsumerSnapshot {
    pub vhost: String,
    pub queue: ShortStr,
    pub conn: ConnId,
    pub channel: u16,
    pub tag: ShortStr,
    pub ack_required: bool,
    pub prefetch: u32,
    pub exclusive: bool,
    pub priority: i64,
    pub arguments: FieldTable,
    /// With single active consumer: is it the one receiving.
    pub active: bool,
    /// Unacked messages it holds.
    pub held: u32,
    /// Its consumer timeout (ms): its own `x-consumer-timeout`, else its queue's; `None` when
    /// it has none.
    pub timeout_ms: Option<u64>,
}

/// Totals over every queue (RabbitMQ's `queue_totals`, `object_totals`).
#[derive(Clone, Debug, Default)]
pub struct BrokerTotals {
    pub queues: u64,
    pub exchanges: u64,
    pub consumers: u64,
    pub ready: u64,
    pub unacked: u64,
    /// Messages held back by delayed exchanges and delivery delays (and how many of them are
    /// in memory).
    pub delayed: u64,
    pub delayed_in_memory: u64,
    /// Dead-lettered messages quorum queues keep until their dead letters are in their targets
    /// (each member counts its copy).
    pub dead_lettering: u64,
}

fn queue_snapshot(q: &Queue, policies: &crate::policy::PolicyTable) -> QueueSnapshot {
    QueueSnapshot {
        id: q.id,
        vhost: q.vhost.clone(),
        name: q.name.clone(),
        durable: q.durable,
        auto_delete: q.auto_delete,
        owner: q.owner,
        arguments: q.arguments.clone(),
        queue_type: q.args.queue_type.as_str(),
        ready: q.machine.ready_count() as u64,
        unacked: q.machine.in_flight_count() as u64,
        ready_bytes: q.machine.ready_bytes(),
        unacked_bytes: q.machine.in_flight_bytes(),
        paged: q.machine.paged_count(),
        retrying: q.machine.retrying_count() as u64,
        consumers: q.consumer_count(),
        counters: q.stats.counters.clone(),
        oldest_ready_at: q.oldest_ready_at(),
        dedup: q.dedup.as_ref().map(|d| {
            let mut stats = d.stats();
            // A replicated queue's window is in its machine (the local one judges only below
            // feature level 6, or a message of a node of its own).
            stats.keys = stats.keys.max(q.machine.dedup_keys() as u64);
            stats
        }),
        policy: q.policy.clone(),
        operator_policy: q.operator_policy.clone(),
        effective_policy_definition: super::policies::definition_of(q, policies),
        replica: q.replica.as_ref().map(|r| r.leader),
        voters: q.replica.as_ref().and_then(|r| r.voters.clone()),
    }
}

impl Broker {
    /// The vhosts' names, sorted.
    pub fn vhost_names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.vhosts.keys().cloned().collect();
        v.sort();
        v
    }

    /// Every queue (of one vhost when given), in no particular order.
    pub fn queue_snapshots(&self, vhost: Option<&str>) -> Vec<QueueSnapshot> {
        self.queues
            .values()
            .filter(|q| vhost.is_none_or(|v| v == q.vhost))
            .map(|q| queue_snapshot(q, &self.policies))
            .collect()
    }

    /// One queue.
    pub fn queue_snapshot(&self, vhost: &str, name: &str) -> Option<QueueSnapshot> {
        let id = self.queue_id(vhost, name)?;
        self.queues
            .get(&id)
            .map(|q| queue_snapshot(q, &self.policies))
    }

    /// Every exchange (of one vhost when given), the default exchange included (named "").
    pub fn exchange_snapshots(&self, vhost: Option<&str>) -> Vec<ExchangeSnapshot> {
        let mut out = Vec::new();
        for (name, vh) in &self.vhosts {
            if vhost.is_some_and(|v| v != name) {
                continue;
            }
            out.push(ExchangeSnapshot {
                vhost: name.clone(),
                name: ShortStr::from_static(""),
                kind: "direct",
                durable: true,
                auto_delete: false,
                internal: false,
                arguments: FieldTable::new(),
                dedup: None,
                policy: None,
            });
            for x in vh.exchanges.values() {
                out.push(ExchangeSnapshot {
                    vhost: name.clone(),
                    name: x.name.clone(),
                    kind: type_name(x.kind, x.delayed),
                    durable: x.durable,
                    auto_delete: x.auto_delete,
                    internal: x.internal,
                    arguments: x.arguments.clone(),
                    dedup: x.dedup.as_ref().map(|d| d.stats()),
                    policy: x.policy.clone(),
                });
            }
        }
        out
    }

    /// Every binding (of one vhost when given), the default exchange's implicit ones included.
    pub fn binding_snapshots(&self, vhost: Option<&str>) -> Vec<BindingSnapshot> {
        let mut out = Vec::new();
        for (vname, vh) in &self.vhosts {
            if vhost.is_some_and(|v| v != vname) {
                continue;
            }
            for id in vh.queues.values() {
                if let Some(q) = self.queues.get(id) {
                    out.push(BindingSnapshot {
                        vhost: vname.clone(),
                        source: ShortStr::from_static(""),
                        destination: q.name.clone(),
                        to_queue: true,
                        routing_key: q.name.clone(),
                        arguments: FieldTable::new(),
                    });
                }
            }
            for x in vh.exchanges.values() {
                for (dest, key, args) in x.bindings() {
                    let (destination, to_queue) = match dest {
                        Dest::Queue(id) => match self.queues.get(id) {
                            Some(q) => (q.name.clone(), true),
                            None => continue,
                        },
                        Dest::Exchange(name) => (name.clone(), false),
                    };
                    out.push(BindingSnapshot {
                        vhost: vname.clone(),
                        source: x.name.clone(),
                        destination,
                        to_queue,
                        routing_key: key.clone(),
                        arguments: args.clone(),
                    });
                }
            }
        }
        out
    }

    /// Every consumer (of one vhost when given).
    pub fn consumer_snapshots(&self, vhost: Option<&str>) -> Vec<ConsumerSnapshot> {
        let mut out = Vec::new();
        for q in self.queues.values() {
            if vhost.is_some_and(|v| v != q.vhost) {
                continue;
            }
            let single = q.args.single_active_consumer;
            let receiving = q.machine.active_consumer();
            for (id, spec, held) in q.machine.consumers() {
                out.push(ConsumerSnapshot {
                    vhost: q.vhost.clone(),
                    queue: q.name.clone(),
                    conn: spec.group.conn,
                    channel: spec.group.channel,
                    tag: spec.tag.clone(),
                    ack_required: !spec.no_ack,
                    prefetch: spec.prefetch,
                    exclusive: spec.exclusive,
                    priority: spec.priority,
                    arguments: spec.arguments.clone(),
                    active: !single || Some(id) == receiving,
                    held,
                    timeout_ms: q.machine.consumer_timeout_ms(id),
                });
            }
        }
        out
    }

    /// Each queue's depth and counters, without its names (the rate sampler's cheap read).
    pub fn queue_counters(&self) -> Vec<(QueueId, u64, u64, QueueCounters)> {
        self.queues
            .values()
            .map(|q| {
                (
                    q.id,
                    q.machine.ready_count() as u64,
                    q.machine.in_flight_count() as u64,
                    q.stats.counters.clone(),
                )
            })
            .collect()
    }

    /// Node-wide publish counters.
    pub fn counters(&self) -> crate::stats::BrokerCounters {
        self.counters
    }

    /// Totals over every queue and exchange.
    pub fn totals(&self) -> BrokerTotals {
        let (delayed, loaded) = self.delayed_counts();
        let mut t = BrokerTotals {
            queues: self.queues.len() as u64,
            exchanges: self
                .vhosts
                .values()
                .map(|vh| vh.exchanges.len() as u64 + 1)
                .sum(),
            delayed,
            delayed_in_memory: loaded as u64,
            ..BrokerTotals::default()
        };
        for q in self.queues.values() {
            t.consumers += q.machine.consumer_count() as u64;
            t.ready += q.machine.ready_count() as u64;
            t.unacked += q.machine.in_flight_count() as u64;
            // A quorum queue's held publishes are in its machine, in memory.
            let held = q.machine.held_count().0 as u64;
            t.delayed += held;
            t.delayed_in_memory += held;
            t.dead_lettering += q.machine.dead_held_count() as u64;
        }
        t
    }
}
