//! Prometheus metrics on 15692, as RabbitMQ's `rabbitmq_prometheus` plugin serves them:
//! `/metrics` with node-wide totals, `/metrics/per-object` with a series per queue, RabbitMQ's
//! metric names (so its Grafana dashboards work) and Warren's own (`warren_*`).
//!
//! The text is written by hand, in the exposition format 0.0.4 that RabbitMQ serves:
//! prometheus-client writes OpenMetrics only, whose counter family names differ from the
//! series names RabbitMQ's dashboards query.

use std::fmt::Write;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use warren_broker::stats::{QueueCounters, DEAD_LETTER_REASONS, DELIVERY_BUCKETS};
use warren_broker::QueueSnapshot;
use warren_replication::GroupStatus;
use warren_session::latency::CONFIRM_BOUNDS_MS;

use crate::http::Api;

/// How long a scrape waits for the Raft thread's figures before it leaves them out.
const RAFT_STATUS_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Bounds (seconds) of the store's write-and-sync latency histogram.
const SYNC_BOUNDS: [f64; 10] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
];

/// A latency histogram updated by the store thread without a lock.
pub struct LatencyHistogram {
    buckets: [AtomicU64; SYNC_BOUNDS.len() + 1],
    sum_us: AtomicU64,
}

/// The store's synced writes (one per group commit): the floor under a confirm's latency.
pub static STORE_WRITES: LatencyHistogram = LatencyHistogram {
    buckets: [const { AtomicU64::new(0) }; SYNC_BOUNDS.len() + 1],
    sum_us: AtomicU64::new(0),
};

/// The store's writes fail (the store thread sets it; the disk alarm is on meanwhile).
pub static STORE_FAILING: AtomicBool = AtomicBool::new(false);
/// Damaged records recovery moved to the quarantine at this start.
pub static QUARANTINED: AtomicU64 = AtomicU64::new(0);

impl LatencyHistogram {
    pub fn observe(&self, d: std::time::Duration) {
        let secs = d.as_secs_f64();
        let i = SYNC_BOUNDS
            .iter()
            .position(|b| secs <= *b)
            .unwrap_or(SYNC_BOUNDS.len());
        if let Some(b) = self.buckets.get(i) {
            b.fetch_add(1, Ordering::Relaxed);
        }
        self.sum_us.fetch_add(
            u64::try_from(d.as_micros()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }
}

/// Label values escaped as the text format wants (backslash, quote, newline).
fn escape(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

/// Writes families: `# HELP`, `# TYPE`, then the samples.
struct Text(String);

impl Text {
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.0, "# TYPE {name} {kind}\n# HELP {name} {help}");
    }

    fn sample(&mut self, name: &str, labels: &str, v: impl std::fmt::Display) {
        if labels.is_empty() {
            let _ = writeln!(self.0, "{name} {v}");
        } else {
            let _ = writeln!(self.0, "{name}{{{labels}}} {v}");
        }
    }

    fn one(&mut self, name: &str, kind: &str, help: &str, v: impl std::fmt::Display) {
        self.family(name, kind, help);
        self.sample(name, "", v);
    }

    /// A histogram without labels from per-bucket counts (`counts` has one more entry than
    /// `bounds`: what is over every bound).
    fn histogram(&mut self, name: &str, help: &str, bounds: &[f64], counts: &[u64], sum: f64) {
        self.family(name, "histogram", help);
        let bucket = format!("{name}_bucket");
        let mut cumulative = 0;
        for (b, n) in bounds.iter().zip(counts) {
            cumulative += n;
            self.sample(&bucket, &format!("le=\"{b}\""), cumulative);
        }
        let count: u64 = counts.iter().sum();
        self.sample(&bucket, "le=\"+Inf\"", count);
        self.sample(&format!("{name}_sum"), "", sum);
        self.sample(&format!("{name}_count"), "", count);
    }
}

/// The gauges and counters of a queue (or of all of them, summed), with RabbitMQ's names.
const QUEUE_FAMILIES: [(&str, &str, &str); 11] = [
    (
        "rabbitmq_queue_messages_ready",
        "gauge",
        "Messages ready to be delivered to consumers",
    ),
    (
        "rabbitmq_queue_messages_unacked",
        "gauge",
        "Messages delivered to consumers but not yet acknowledged",
    ),
    (
        "rabbitmq_queue_messages",
        "gauge",
        "Sum of ready and unacknowledged messages - total queue depth",
    ),
    (
        "rabbitmq_queue_messages_bytes",
        "gauge",
        "Size in bytes of ready and unacknowledged messages",
    ),
    (
        "rabbitmq_queue_messages_paged_out",
        "gauge",
        "Messages paged out to disk",
    ),
    ("rabbitmq_queue_consumers", "gauge", "Consumers on a queue"),
    (
        "rabbitmq_queue_messages_published_total",
        "counter",
        "Total number of messages published to queues",
    ),
    (
        "rabbitmq_queue_messages_delivered_total",
        "counter",
        "Total number of messages delivered to consumers or fetched by basic.get",
    ),
    (
        "rabbitmq_queue_messages_redelivered_total",
        "counter",
        "Total number of messages redelivered",
    ),
    (
        "rabbitmq_queue_messages_acked_total",
        "counter",
        "Total number of messages acknowledged by consumers",
    ),
    (
        "warren_queue_messages_retrying",
        "gauge",
        "Ready messages waiting for a delayed retry",
    ),
];

fn queue_values(q: &QueueSnapshot) -> [u64; 11] {
    let c = &q.counters;
    [
        q.ready,
        q.unacked,
        q.ready + q.unacked,
        q.ready_bytes + q.unacked_bytes,
        q.paged,
        u64::from(q.consumers),
        c.published,
        c.deliver_get(),
        c.redelivered,
        c.acked,
        q.retrying,
    ]
}

fn delivery_histogram(t: &mut Text, labels: &str, c: &QueueCounters) {
    let name = "warren_queue_delivery_count";
    let sep = if labels.is_empty() { "" } else { "," };
    let mut cumulative = 0;
    for (i, b) in DELIVERY_BUCKETS.iter().enumerate() {
        cumulative += c.deliveries.get(i).copied().unwrap_or(0);
        t.sample(
            &format!("{name}_bucket"),
            &format!("{labels}{sep}le=\"{b}\""),
            cumulative,
        );
    }
    let total: u64 = c.deliveries.iter().sum();
    t.sample(
        &format!("{name}_bucket"),
        &format!("{labels}{sep}le=\"+Inf\""),
        total,
    );
    t.sample(&format!("{name}_sum"), labels, c.deliveries_sum);
    t.sample(&format!("{name}_count"), labels, total);
}

/// Builds the exposition text; `per_object`: a series per queue rather than totals.
pub fn render(api: &Api, per_object: bool, raft: Option<&[GroupStatus]>) -> String {
    let (now, queues, counters, totals, conns, alarm, delayed, confirms, groups, away) =
        api.node.read(|n, now| {
            let b = n.broker();
            let conns = n.connection_snapshots();
            (
                now,
                b.queue_snapshots(None),
                b.counters(),
                b.totals(),
                conns,
                n.alarm(),
                b.delayed_counts().0,
                n.confirm_latency().clone(),
                b.replica_groups(),
                (b.messages_away(), b.messages_spilled()),
            )
        });
    let mut t = Text(String::with_capacity(4096 + queues.len() * 1200));
    t.family(
        "rabbitmq_identity_info",
        "untyped",
        "RabbitMQ node & cluster identity info",
    );
    let node = escape(&api.node_name);
    // The cluster's name and id, the same on every node: dashboards group nodes by them.
    let (cluster, id) = (
        escape(&api.cluster_name()),
        escape(&api.default_cluster_name()),
    );
    t.sample(
        "rabbitmq_identity_info",
        &format!("rabbitmq_node=\"{node}\",rabbitmq_cluster=\"{cluster}\",rabbitmq_cluster_permanent_id=\"{id}\""),
        1,
    );
    t.family(
        "rabbitmq_build_info",
        "untyped",
        "RabbitMQ & Erlang/OTP version info",
    );
    t.sample(
        "rabbitmq_build_info",
        &format!(
            "rabbitmq_version=\"3.10.8\",prometheus_plugin_version=\"3.10.8\",product=\"Warren\",product_version=\"{}\"",
            env!("CARGO_PKG_VERSION")
        ),
        1,
    );
    let channels: usize = conns.iter().map(|c| c.channels.len()).sum();
    let blocked = conns.iter().filter(|c| c.blocked).count();
    t.one(
        "rabbitmq_connections",
        "gauge",
        "Connections currently open",
        conns.len(),
    );
    t.one(
        "rabbitmq_channels",
        "gauge",
        "Channels currently open",
        channels,
    );
    t.one(
        "rabbitmq_consumers",
        "gauge",
        "Consumers currently connected",
        totals.consumers,
    );
    t.one(
        "rabbitmq_queues",
        "gauge",
        "Queues available",
        totals.queues,
    );
    t.one(
        "rabbitmq_global_messages_received_total",
        "counter",
        "Total number of messages received from publishers",
        counters.received,
    );
    t.one(
        "rabbitmq_global_messages_routed_total",
        "counter",
        "Total number of messages routed to queues or streams",
        counters.received - counters.unroutable.min(counters.received),
    );
    t.one("rabbitmq_global_messages_unroutable_dropped_total", "counter", "Total number of messages published as non-mandatory into an exchange and dropped as unroutable", counters.unroutable);
    let mut sum = QueueCounters::default();
    for q in &queues {
        let c = &q.counters;
        sum.published += c.published;
        sum.delivered += c.delivered;
        sum.delivered_no_ack += c.delivered_no_ack;
        sum.got += c.got;
        sum.got_no_ack += c.got_no_ack;
        sum.redelivered += c.redelivered;
        sum.acked += c.acked;
        for (a, b) in sum.dead_lettered.iter_mut().zip(c.dead_lettered) {
            *a += b;
        }
        for (a, b) in sum.deliveries.iter_mut().zip(c.deliveries) {
            *a += b;
        }
        sum.deliveries_sum += c.deliveries_sum;
    }
    t.one(
        "rabbitmq_global_messages_delivered_total",
        "counter",
        "Total number of messages delivered to consumers",
        sum.deliver_get(),
    );
    t.one(
        "rabbitmq_global_messages_delivered_consume_manual_ack_total",
        "counter",
        "Total number of messages delivered to consumers using manual acknowledgement mode",
        sum.delivered,
    );
    t.one(
        "rabbitmq_global_messages_delivered_consume_auto_ack_total",
        "counter",
        "Total number of messages delivered to consumers using automatic acknowledgement mode",
        sum.delivered_no_ack,
    );
    t.one("rabbitmq_global_messages_delivered_get_manual_ack_total", "counter", "Total number of messages delivered to consumers using basic.get with manual acknowledgement mode", sum.got);
    t.one("rabbitmq_global_messages_delivered_get_auto_ack_total", "counter", "Total number of messages delivered to consumers using basic.get with automatic acknowledgement mode", sum.got_no_ack);
    t.one(
        "rabbitmq_global_messages_redelivered_total",
        "counter",
        "Total number of messages redelivered to consumers",
        sum.redelivered,
    );
    t.one(
        "rabbitmq_global_messages_acknowledged_total",
        "counter",
        "Total number of message acknowledgements received from consumers",
        sum.acked,
    );
    t.family("rabbitmq_global_messages_dead_lettered_total", "counter", "Total number of messages that left a queue unacknowledged (dead-lettered, or dropped without a dead-letter exchange), by reason");
    for (reason, name) in DEAD_LETTER_REASONS {
        t.sample(
            "rabbitmq_global_messages_dead_lettered_total",
            &format!("reason=\"{name}\""),
            sum.dead_lettered_by(reason),
        );
    }
    let mem = crate::alarms::rss_bytes().unwrap_or(0);
    t.one(
        "rabbitmq_process_resident_memory_bytes",
        "gauge",
        "Memory used in bytes",
        mem,
    );
    t.one(
        "rabbitmq_resident_memory_limit_bytes",
        "gauge",
        "Memory high watermark in bytes",
        crate::alarms::memory_limit(&api.alarms).unwrap_or(0),
    );
    t.one(
        "rabbitmq_disk_space_available_bytes",
        "gauge",
        "Disk space available in bytes",
        crate::alarms::free_disk(&api.data_dir).unwrap_or(0),
    );
    t.one(
        "rabbitmq_disk_space_available_limit_bytes",
        "gauge",
        "Free disk space low watermark in bytes",
        api.alarms.disk_free_limit,
    );
    t.one(
        "rabbitmq_alarms_memory_used_watermark",
        "gauge",
        "is 1 if VM memory watermark alarm is in effect",
        u8::from(alarm.is_some_and(|a| a.contains("memory"))),
    );
    t.one(
        "rabbitmq_alarms_free_disk_space_watermark",
        "gauge",
        "is 1 if free disk space watermark alarm is in effect",
        u8::from(alarm.is_some_and(|a| a.contains("disk"))),
    );
    t.one(
        "warren_store_write_failing",
        "gauge",
        "is 1 while the store's writes fail (publishes are nacked, the disk alarm is on)",
        u8::from(STORE_FAILING.load(Ordering::Relaxed)),
    );
    t.one(
        "warren_store_quarantined_records",
        "gauge",
        "Damaged records recovery moved to the quarantine at this start",
        QUARANTINED.load(Ordering::Relaxed),
    );
    t.one(
        "warren_node_maintenance_seconds",
        "gauge",
        "How long this node has been in maintenance mode (warren ctl drain); 0 when it is not",
        api.node.draining_for().map_or(0, |d| d.as_secs()),
    );
    if let Some((count, bytes)) = crate::allocations::totals() {
        t.one(
            "warren_heap_allocations_total",
            "counter",
            "Heap allocations since the start (counted with WARREN_COUNT_ALLOCATIONS set)",
            count,
        );
        t.one(
            "warren_heap_allocated_bytes_total",
            "counter",
            "Bytes those heap allocations asked for",
            bytes,
        );
    }
    let fds = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count());
    t.one(
        "rabbitmq_process_open_fds",
        "gauge",
        "Open file descriptors",
        fds,
    );
    t.one(
        "warren_connections_blocked",
        "gauge",
        "Connections whose publishes are held by a resource alarm (flow control)",
        blocked,
    );
    t.one(
        "warren_delayed_messages",
        "gauge",
        "Messages held back by delayed exchanges and queue delivery delays",
        delayed,
    );
    t.one(
        "warren_dead_lettering_messages",
        "gauge",
        "Dead-lettered messages of quorum queues kept until their dead letters are in their targets",
        totals.dead_lettering,
    );
    t.one(
        "warren_replicated_messages_away",
        "gauge",
        "Messages of deep quorum queues whose contents this node keeps on disk, out of memory",
        away.0,
    );
    t.one(
        "warren_replicated_messages_spilled",
        "gauge",
        "Messages of deep quorum queues whose packed entries this node keeps on disk too, in runs",
        away.1,
    );
    t.one(
        "warren_delayed_refused_total",
        "counter",
        "Releases of delayed messages that a full reject-publish queue refused (each is retried later)",
        counters.delayed_refused,
    );
    t.one(
        "rabbitmq_global_messages_confirmed_total",
        "counter",
        "Total number of messages confirmed to publishers",
        confirms.count,
    );
    // From each publish to its confirm, and the store's synced writes under them.
    let bounds: Vec<f64> = CONFIRM_BOUNDS_MS
        .iter()
        .map(|b| *b as f64 / 1000.0)
        .collect();
    t.histogram(
        "warren_confirm_latency_seconds",
        "Time from a publish to its publisher confirm (persistent messages wait for their store write)",
        &bounds,
        &confirms.buckets,
        confirms.sum_ms as f64 / 1000.0,
    );
    let h = &STORE_WRITES;
    let counts: Vec<u64> = h
        .buckets
        .iter()
        .map(|b| b.load(Ordering::Relaxed))
        .collect();
    t.histogram(
        "warren_store_sync_seconds",
        "Time to write and fsync one group of store batches (a publisher confirm waits at least this long)",
        &SYNC_BOUNDS,
        &counts,
        h.sum_us.load(Ordering::Relaxed) as f64 / 1e6,
    );

    // Queues: summed, or one series each.
    let oldest = |q: &QueueSnapshot| {
        q.oldest_ready_at
            .map_or(0.0, |at| now.saturating_sub(at) as f64 / 1000.0)
    };
    if per_object {
        let labels: Vec<String> = queues
            .iter()
            .map(|q| {
                format!(
                    "vhost=\"{}\",queue=\"{}\"",
                    escape(&q.vhost),
                    escape(&q.name)
                )
            })
            .collect();
        let values: Vec<[u64; 11]> = queues.iter().map(queue_values).collect();
        for (i, (name, kind, help)) in QUEUE_FAMILIES.iter().enumerate() {
            t.family(name, kind, help);
            for (l, v) in labels.iter().zip(&values) {
                t.sample(name, l, v.get(i).copied().unwrap_or(0));
            }
        }
        t.family(
            "warren_queue_oldest_ready_seconds",
            "gauge",
            "Age of the oldest ready message (0 when none is ready)",
        );
        for (l, q) in labels.iter().zip(&queues) {
            t.sample("warren_queue_oldest_ready_seconds", l, oldest(q));
        }
        t.family(
            "warren_queue_dead_lettered_total",
            "counter",
            "Messages that left the queue unacknowledged, by reason",
        );
        for (l, q) in labels.iter().zip(&queues) {
            for (reason, name) in DEAD_LETTER_REASONS {
                t.sample(
                    "warren_queue_dead_lettered_total",
                    &format!("{l},reason=\"{name}\""),
                    q.counters.dead_lettered_by(reason),
                );
            }
        }
        t.family(
            "warren_queue_delivery_count",
            "histogram",
            "Deliveries a message had when it left the queue (acked or dead-lettered)",
        );
        for (l, q) in labels.iter().zip(&queues) {
            delivery_histogram(&mut t, l, &q.counters);
        }
    } else {
        let mut sums = [0u64; 11];
        for q in &queues {
            for (s, v) in sums.iter_mut().zip(queue_values(q)) {
                *s += v;
            }
        }
        for ((name, kind, help), v) in QUEUE_FAMILIES.iter().zip(sums) {
            t.one(name, kind, help, v);
        }
        let max_age = queues.iter().map(oldest).fold(0.0, f64::max);
        t.one(
            "warren_queue_oldest_ready_seconds",
            "gauge",
            "Age of the oldest ready message in any queue (0 when none is ready)",
            max_age,
        );
        t.family(
            "warren_queue_delivery_count",
            "histogram",
            "Deliveries a message had when it left its queue (acked or dead-lettered)",
        );
        delivery_histogram(&mut t, "", &sum);
    }
    if let Some(raft) = raft {
        // Thousands of queues: look each group up, never scan for it.
        let by_id: std::collections::HashMap<_, &QueueSnapshot> =
            queues.iter().map(|q| (q.id, q)).collect();
        let members: Vec<(String, &GroupStatus)> = raft
            .iter()
            .filter_map(|s| {
                // `replica_groups` is in group order.
                let at = groups.binary_search_by_key(&s.group.0, |(g, _)| *g).ok()?;
                let q = by_id.get(&groups.get(at)?.1)?;
                Some((
                    format!(
                        "vhost=\"{}\",queue=\"{}\"",
                        escape(&q.vhost),
                        escape(&q.name)
                    ),
                    s,
                ))
            })
            .collect();
        raft_families(&mut t, per_object, &members, &api.names());
    }
    t.0
}

/// RabbitMQ's names for a quorum queue's Raft log (3.10's, which its dashboards query), and
/// Warren's own for what RabbitMQ does not report: leadership and how far followers lag.
/// `/metrics` sums them over this node's queue members (the lag: the largest), as RabbitMQ's
/// aggregated endpoint does; `/metrics/per-object` has one series per queue member here.
const RAFT_FAMILIES: [(&str, &str, &str); 7] = [
    (
        "rabbitmq_raft_term_total",
        "counter",
        "Current Raft term number",
    ),
    (
        "rabbitmq_raft_log_snapshot_index",
        "gauge",
        "Raft log snapshot index",
    ),
    (
        "rabbitmq_raft_log_last_applied_index",
        "gauge",
        "Raft log last applied index",
    ),
    (
        "rabbitmq_raft_log_commit_index",
        "gauge",
        "Raft log commit index",
    ),
    (
        "rabbitmq_raft_log_last_written_index",
        "gauge",
        "Raft log last written index",
    ),
    (
        "warren_raft_leader",
        "gauge",
        "Queue members this node leads (per object: 1 if it leads the queue)",
    ),
    (
        "warren_raft_leader_changes_total",
        "counter",
        "Leaders a queue's group has had since its member on this node was made",
    ),
];

fn raft_values(s: &GroupStatus) -> [u64; 7] {
    [
        s.term,
        s.snapshot_index,
        s.applied,
        s.commit,
        s.last_index,
        u64::from(s.leading),
        s.leader_changes,
    ]
}

/// Entries a follower lacks of what its leader holds.
fn lag(s: &GroupStatus, matched: u64) -> u64 {
    s.last_index.saturating_sub(matched)
}

fn raft_families(
    t: &mut Text,
    per_object: bool,
    members: &[(String, &GroupStatus)],
    names: &std::collections::BTreeMap<u64, String>,
) {
    let lag_help =
        "Entries of a queue's log that a follower lacks, as its leader on this node knows";
    if per_object {
        for (i, (name, kind, help)) in RAFT_FAMILIES.iter().enumerate() {
            t.family(name, kind, help);
            for (labels, s) in members {
                t.sample(name, labels, raft_values(s).get(i).copied().unwrap_or(0));
            }
        }
        t.family("warren_raft_follower_lag_entries", "gauge", lag_help);
        for (labels, s) in members {
            for (node, matched) in &s.followers {
                let follower = names.get(node).cloned().unwrap_or_else(|| node.to_string());
                t.sample(
                    "warren_raft_follower_lag_entries",
                    &format!("{labels},follower=\"{}\"", escape(&follower)),
                    lag(s, *matched),
                );
            }
        }
    } else {
        let mut sums = [0u64; 7];
        for (_, s) in members {
            for (sum, v) in sums.iter_mut().zip(raft_values(s)) {
                *sum += v;
            }
        }
        for ((name, kind, help), v) in RAFT_FAMILIES.iter().zip(sums) {
            t.one(name, kind, help, v);
        }
        let worst = members
            .iter()
            .flat_map(|(_, s)| s.followers.iter().map(|(_, m)| lag(s, *m)))
            .max()
            .unwrap_or(0);
        t.one(
            "warren_raft_follower_lag_entries",
            "gauge",
            "Entries the furthest-behind follower of a queue this node leads lacks",
            worst,
        );
    }
}

async fn metrics(State(api): State<Arc<Api>>) -> impl IntoResponse {
    metrics_text(&api, false).await
}

async fn per_object(State(api): State<Arc<Api>>) -> impl IntoResponse {
    metrics_text(&api, true).await
}

async fn metrics_text(api: &Api, per_object: bool) -> axum::response::Response {
    if let Some(left) = api.node.recovering_after(crate::http::RECOVERY_HOLD).await {
        // Figures of half-restored queues would read as messages lost: a failed scrape
        // (`up` 0), as RabbitMQ's endpoint that is not open yet.
        return (
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            [(header::RETRY_AFTER, "1")],
            crate::http::recovering_reason(left),
        )
            .into_response();
    }
    // The Raft thread answers between two passes; a scrape does not wait long for it.
    let raft = match api.node.raft() {
        Some(r) => r.group_status(RAFT_STATUS_WAIT).await,
        None => None,
    };
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        render(api, per_object, raft.as_deref()),
    )
        .into_response()
}

/// Serves `/metrics` and `/metrics/per-object` on `listener` until the process ends.
/// Serves on a plain or a TLS listener (see `crate::tls::HttpsListener`).
pub async fn serve<L>(listener: L, api: Arc<Api>)
where
    L: axum::serve::Listener<Addr = SocketAddr>,
{
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/metrics/per-object", get(per_object))
        .with_state(api);
    // tap_io: axum gives the peer address (ConnectInfo) for any listener through it.
    if let Err(e) = axum::serve(
        axum::serve::ListenerExt::tap_io(listener, |_| {}),
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await
    {
        tracing::error!(error = %e, "the metrics endpoint stopped");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }

    #[test]
    fn histogram_buckets_are_cumulative() {
        let mut t = Text(String::new());
        let c = QueueCounters {
            deliveries: [3, 1, 0, 0, 1, 2],
            deliveries_sum: 40,
            ..QueueCounters::default()
        };
        delivery_histogram(&mut t, "queue=\"q\"", &c);
        assert!(t
            .0
            .contains("warren_queue_delivery_count_bucket{queue=\"q\",le=\"2\"} 4\n"));
        assert!(t
            .0
            .contains("warren_queue_delivery_count_bucket{queue=\"q\",le=\"+Inf\"} 7\n"));
        assert!(t
            .0
            .contains("warren_queue_delivery_count_count{queue=\"q\"} 7\n"));
    }
}
