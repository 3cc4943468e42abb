//! Broker objects in the JSON shapes of RabbitMQ's management API (3.10): the fields tools
//! and dashboards read, with RabbitMQ's names and types.

use serde_json::{json, Map, Value};
use warren_broker::{BindingSnapshot, ConsumerSnapshot, ExchangeSnapshot, QueueSnapshot};
use warren_session::manage::{ChannelSnapshot, ConnectionSnapshot};

use super::json::table;
use super::rates::{Point, QueueRates};

/// `{"rate": r}`, RabbitMQ's `*_details` object.
fn details(rate: f64) -> Value {
    json!({ "rate": rate })
}

/// A queue's `message_stats`: RabbitMQ's counters with their `_details` rates.
fn message_stats(s: &QueueSnapshot, r: &QueueRates) -> Value {
    let c = &s.counters;
    let mut m = Map::new();
    let mut put = |k: &str, n: u64, rate: f64| {
        m.insert(k.into(), n.into());
        m.insert(format!("{k}_details"), details(rate));
    };
    put("publish", c.published, r.publish);
    put("deliver", c.delivered, r.deliver);
    put("deliver_no_ack", c.delivered_no_ack, r.deliver_no_ack);
    put("get", c.got, r.get);
    put("get_no_ack", c.got_no_ack, r.get_no_ack);
    put("deliver_get", c.deliver_get(), r.deliver_get);
    put("ack", c.acked, r.ack);
    put("redeliver", c.redelivered, r.redeliver);
    Value::Object(m)
}

pub fn queue(s: &QueueSnapshot, r: &QueueRates, node: &str, now: u64) -> Value {
    let oldest_age = oldest_ready_age(s, now);
    let c = &s.counters;
    let buckets: Vec<Value> = warren_broker::stats::DELIVERY_BUCKETS
        .iter()
        .map(|b| Value::from(b.to_string()))
        .chain(std::iter::once(Value::from("more")))
        .collect();
    let distribution: Map<String, Value> = buckets
        .iter()
        .zip(c.deliveries.iter())
        .map(|(b, n)| (b.as_str().unwrap_or_default().to_owned(), Value::from(*n)))
        .collect();
    let dead: Map<String, Value> = warren_broker::stats::DEAD_LETTER_REASONS
        .iter()
        .map(|(reason, name)| ((*name).to_owned(), c.dead_lettered_by(*reason).into()))
        .collect();
    json!({
        "name": s.name.as_str(),
        "vhost": s.vhost,
        "type": s.queue_type,
        "durable": s.durable,
        "auto_delete": s.auto_delete,
        "exclusive": s.owner.is_some(),
        "arguments": table(&s.arguments),
        "node": node,
        "state": "running",
        "policy": s.policy,
        "operator_policy": s.operator_policy,
        "effective_policy_definition": super::policies::definition_json(&s.effective_policy_definition),
        "exclusive_consumer_tag": null,
        "consumers": s.consumers,
        "consumer_capacity": if s.consumers > 0 { 1.0 } else { 0.0 },
        "consumer_utilisation": if s.consumers > 0 { 1.0 } else { 0.0 },
        "messages": s.ready + s.unacked,
        "messages_details": details(0.0),
        "messages_ready": s.ready,
        "messages_ready_details": details(0.0),
        "messages_unacknowledged": s.unacked,
        "messages_unacknowledged_details": details(0.0),
        "messages_ram": (s.ready - s.paged.min(s.ready)) + s.unacked,
        "messages_ready_ram": s.ready - s.paged.min(s.ready),
        "messages_unacknowledged_ram": s.unacked,
        "messages_paged_out": s.paged,
        "message_bytes": s.ready_bytes + s.unacked_bytes,
        "message_bytes_ready": s.ready_bytes,
        "message_bytes_unacknowledged": s.unacked_bytes,
        "message_stats": message_stats(s, r),
        "head_message_timestamp": null,
        // Warren's own: the age of the oldest ready message (seconds, to within about a
        // second), messages waiting for a delayed retry, and how many deliveries the
        // messages that left needed.
        "oldest_ready_age_seconds": oldest_age,
        "messages_retrying": s.retrying,
        "delivery_count_distribution": distribution,
        "dead_lettered": dead,
        "deduplication": deduplication(s.dedup),
    })
}

/// A replicated queue's leader and members, as RabbitMQ shows a quorum queue's (`node` is
/// its leader there too): its voters, every node unless it has voters of its own (the other
/// nodes hold it as learners, which RabbitMQ has no word for); `online` leaves out the
/// members on nodes in `down`.
pub fn with_members(
    v: &mut Value,
    s: &QueueSnapshot,
    names: &std::collections::BTreeMap<u64, String>,
    down: &std::collections::BTreeSet<u64>,
) {
    let (Some(leader), Value::Object(m)) = (s.replica, v) else {
        return;
    };
    let name = |n: u64| {
        names
            .get(&n)
            .cloned()
            .unwrap_or_else(|| format!("warren-{n}"))
    };
    let nodes: Vec<u64> = names.keys().copied().collect();
    let voters = warren_broker::voters_in(s.voters.as_deref(), &nodes);
    let members: Vec<Value> = voters.iter().map(|n| name(*n).into()).collect();
    let online: Vec<Value> = voters
        .iter()
        .filter(|n| !down.contains(n))
        .map(|n| name(*n).into())
        .collect();
    m.insert("members".into(), members.into());
    m.insert("online".into(), online.into());
    let leader = leader.map(name);
    if let Some(l) = &leader {
        m.insert("node".into(), l.clone().into());
    }
    m.insert("leader".into(), leader.into());
}

/// A queue's value of the field `path` (dotted for nested ones), as [`queue`] would render
/// it, without rendering the rest: the queue list sorts 10,000 queues by it. The fields
/// tools sort by are read straight from the snapshot; any other is rendered.
pub fn queue_field(
    s: &QueueSnapshot,
    r: &QueueRates,
    node: &str,
    now: u64,
    path: &str,
) -> Option<Value> {
    let c = &s.counters;
    if let Some(rest) = path.strip_prefix("message_stats.") {
        let (name, rate_only) = match rest.split_once('.') {
            Some((name, "rate")) => (name.strip_suffix("_details")?, true),
            Some(_) => return None,
            None => (rest, false),
        };
        let (n, rate) = match name {
            "publish" => (c.published, r.publish),
            "deliver" => (c.delivered, r.deliver),
            "deliver_no_ack" => (c.delivered_no_ack, r.deliver_no_ack),
            "get" => (c.got, r.get),
            "get_no_ack" => (c.got_no_ack, r.get_no_ack),
            "deliver_get" => (c.deliver_get(), r.deliver_get),
            "ack" => (c.acked, r.ack),
            "redeliver" => (c.redelivered, r.redeliver),
            _ => return lookup(&queue(s, r, node, now), path),
        };
        return Some(if rate_only { rate.into() } else { n.into() });
    }
    let ram = s.ready - s.paged.min(s.ready);
    Some(match path {
        "name" => s.name.as_str().into(),
        "vhost" => s.vhost.as_str().into(),
        "type" => s.queue_type.into(),
        "durable" => s.durable.into(),
        "auto_delete" => s.auto_delete.into(),
        "exclusive" => s.owner.is_some().into(),
        "state" => "running".into(),
        "node" => node.into(),
        "consumers" => s.consumers.into(),
        "messages" => (s.ready + s.unacked).into(),
        "messages_ready" => s.ready.into(),
        "messages_unacknowledged" => s.unacked.into(),
        "messages_ram" => (ram + s.unacked).into(),
        "messages_ready_ram" => ram.into(),
        "messages_unacknowledged_ram" => s.unacked.into(),
        "messages_paged_out" => s.paged.into(),
        "message_bytes" => (s.ready_bytes + s.unacked_bytes).into(),
        "message_bytes_ready" => s.ready_bytes.into(),
        "message_bytes_unacknowledged" => s.unacked_bytes.into(),
        "messages_retrying" => s.retrying.into(),
        "oldest_ready_age_seconds" => oldest_ready_age(s, now).into(),
        _ => return lookup(&queue(s, r, node, now), path),
    })
}

fn lookup(v: &Value, path: &str) -> Option<Value> {
    path.split('.').try_fold(v, |v, k| v.get(k)).cloned()
}

/// Seconds since the oldest ready message was enqueued (to within about a second).
fn oldest_ready_age(s: &QueueSnapshot, now: u64) -> Option<f64> {
    s.oldest_ready_at
        .map(|at| now.saturating_sub(at) as f64 / 1000.0)
}

/// RabbitMQ's `*_details` with `samples` (newest first), for `lengths_age` / `msg_rates_age`.
pub fn with_history(mut q: Value, history: &[Point]) -> Value {
    let samples = |f: &dyn Fn(&Point) -> Value| -> Value {
        history
            .iter()
            .rev()
            .map(|p| json!({"timestamp": p.at * 1000, "sample": f(p)}))
            .collect()
    };
    if let Some(m) = q.as_object_mut() {
        m.insert(
            "messages_ready_details".into(),
            json!({"rate": 0.0, "samples": samples(&|p| p.ready.into())}),
        );
        m.insert(
            "messages_unacknowledged_details".into(),
            json!({"rate": 0.0, "samples": samples(&|p| p.unacked.into())}),
        );
        m.insert(
            "rate_history".into(),
            history
                .iter()
                .map(|p| {
                    json!({"timestamp": p.at * 1000, "publish": p.publish,
                           "deliver_get": p.deliver_get, "ack": p.ack})
                })
                .collect(),
        );
    }
    q
}

pub fn exchange(x: &ExchangeSnapshot) -> Value {
    json!({
        "name": x.name.as_str(),
        "vhost": x.vhost,
        "type": x.kind,
        "durable": x.durable,
        "auto_delete": x.auto_delete,
        "internal": x.internal,
        "arguments": table(&x.arguments),
        "user_who_performed_action": "rmq-internal",
        "policy": x.policy,
        // Warren's own.
        "deduplication": deduplication(x.dedup),
    })
}

/// A deduplication window as the API shows it (`null` without one): its keys, the memory its
/// tables hold (which the memory alarm sees as part of the broker's), and the duplicates it
/// dropped.
fn deduplication(d: Option<warren_broker::dedup::DedupStats>) -> Value {
    match d {
        None => Value::Null,
        Some(d) => json!({
            "keys": d.keys,
            "memory_bytes": d.memory_bytes,
            "duplicates_dropped": d.dropped,
        }),
    }
}

/// RabbitMQ's `properties_key` of a binding: `~` for an empty key without arguments, else the
/// routing key (percent-encoded), followed by `~` and a hash of the arguments when there are
/// any.
pub fn properties_key(b: &BindingSnapshot) -> String {
    let key = if b.routing_key.is_empty() && b.arguments.is_empty() {
        "~".to_owned()
    } else {
        encode_component(&b.routing_key)
    };
    if b.arguments.is_empty() {
        key
    } else {
        format!("{key}~{}", arguments_hash(&b.arguments))
    }
}

/// A short stable digest of binding arguments (identifies a binding among those with the same
/// key; RabbitMQ uses a hash of its own term format, so the digits differ from RabbitMQ's).
fn arguments_hash(args: &warren_codec::FieldTable) -> String {
    use base64::Engine;
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in table(args).to_string().bytes() {
        h ^= u64::from(byte);
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(h.to_be_bytes())
}

fn encode_component(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Undoes `%XX` escapes (invalid ones are kept as they are).
pub fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes.get(i), hex) {
            (Some(b'%'), Some(v)) => {
                out.push(v);
                i += 3;
            }
            (Some(b), _) => {
                out.push(*b);
                i += 1;
            }
            (None, _) => break,
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

pub fn binding(b: &BindingSnapshot) -> Value {
    json!({
        "source": b.source.as_str(),
        "vhost": b.vhost,
        "destination": b.destination.as_str(),
        "destination_type": if b.to_queue { "queue" } else { "exchange" },
        "routing_key": b.routing_key.as_str(),
        "arguments": table(&b.arguments),
        "properties_key": properties_key(b),
    })
}

/// RabbitMQ names a connection `client ip:port -> server ip:port`.
pub fn connection_name(c: &ConnectionSnapshot) -> String {
    let addr =
        |a: Option<std::net::SocketAddr>| a.map_or_else(|| "?".to_owned(), |a| a.to_string());
    format!("{} -> {}", addr(c.peer), addr(c.local))
}

pub fn connection(c: &ConnectionSnapshot, node: &str) -> Value {
    json!({
        "name": connection_name(c),
        "node": node,
        "type": "network",
        "protocol": "AMQP 0-9-1",
        "state": c.state,
        "user": c.user,
        "user_who_performed_action": c.user,
        "vhost": c.vhost,
        "host": c.local.map(|a| a.ip().to_string()),
        "port": c.local.map(|a| a.port()),
        "peer_host": c.peer.map(|a| a.ip().to_string()),
        "peer_port": c.peer.map(|a| a.port()),
        "ssl": c.tls.is_some(),
        "ssl_protocol": c.tls.as_ref().map(|t| t.protocol.as_str()),
        "ssl_key_exchange": c.tls.as_ref().map(|t| t.key_exchange.as_str()),
        "ssl_cipher": c.tls.as_ref().map(|t| t.cipher.as_str()),
        "ssl_hash": c.tls.as_ref().map(|t| t.hash.as_str()),
        "peer_cert_subject": c.tls.as_ref().and_then(|t| t.peer_cert_subject.as_deref()),
        "peer_cert_issuer": c.tls.as_ref().and_then(|t| t.peer_cert_issuer.as_deref()),
        "peer_cert_validity": c.tls.as_ref().and_then(|t| t.peer_cert_validity.as_deref()),
        "auth_mechanism": c.auth_mechanism,
        "channels": c.channels.len(),
        "channel_max": c.channel_max,
        "frame_max": c.frame_max,
        "timeout": c.heartbeat_secs,
        "connected_at": c.opened_at,
        "client_properties": table(&c.client_properties),
    })
}

pub fn channel_name(c: &ConnectionSnapshot, ch: &ChannelSnapshot) -> String {
    format!("{} ({})", connection_name(c), ch.number)
}

pub fn channel(c: &ConnectionSnapshot, ch: &ChannelSnapshot, node: &str) -> Value {
    json!({
        "name": channel_name(c, ch),
        "node": node,
        "number": ch.number,
        "user": c.user,
        "vhost": c.vhost,
        "state": if ch.closing { "closing" } else { "running" },
        "confirm": ch.confirm,
        "transactional": ch.transactional,
        "prefetch_count": ch.prefetch_count,
        "global_prefetch_count": ch.global_prefetch_count,
        "messages_unacknowledged": ch.unacked,
        "messages_unconfirmed": 0,
        "messages_uncommitted": 0,
        "acks_uncommitted": 0,
        "consumer_count": ch.consumers,
        "connection_details": {"name": connection_name(c), "peer_host": c.peer.map(|a| a.ip().to_string()), "peer_port": c.peer.map(|a| a.port())},
    })
}

pub fn consumer(k: &ConsumerSnapshot, conn: Option<&ConnectionSnapshot>, node: &str) -> Value {
    let channel = conn.map(|c| {
        json!({
            "name": format!("{} ({})", connection_name(c), k.channel),
            "node": node,
            "number": k.channel,
            "user": c.user,
            "connection_name": connection_name(c),
            "peer_host": c.peer.map(|a| a.ip().to_string()),
            "peer_port": c.peer.map(|a| a.port()),
        })
    });
    let mut v = json!({
        "consumer_tag": k.tag.as_str(),
        "queue": {"name": k.queue.as_str(), "vhost": k.vhost},
        "channel_details": channel,
        "ack_required": k.ack_required,
        "prefetch_count": k.prefetch,
        "exclusive": k.exclusive,
        "active": k.active,
        "activity_status": if k.active { "up" } else { "waiting" },
        "arguments": table(&k.arguments),
        "priority": k.priority,
        "messages_unacknowledged": k.held,
    });
    // RabbitMQ 3.12+ always sends the consumer's timeout in ms (its default is 30 minutes),
    // and RabbitMQ's own clients read it as a number; 3.10.8 sends none. Warren has no default
    // timeout: the field is there when one applies, absent (as in 3.10.8) when none does,
    // never null.
    if let Some(ms) = k.timeout_ms {
        v["consumer_timeout"] = json!(ms);
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every field the queue list sorts by without rendering reads as the rendered queue.
    #[test]
    fn queue_fields_read_as_rendered() {
        let s = QueueSnapshot {
            id: warren_broker::QueueId(1),
            vhost: "v".into(),
            name: warren_codec::ShortStr::from_static("q"),
            durable: true,
            auto_delete: false,
            owner: None,
            arguments: warren_codec::FieldTable::new(),
            queue_type: "quorum",
            ready: 7,
            unacked: 3,
            ready_bytes: 700,
            unacked_bytes: 30,
            paged: 2,
            retrying: 1,
            consumers: 2,
            counters: warren_broker::stats::QueueCounters {
                published: 11,
                delivered: 12,
                delivered_no_ack: 13,
                got: 14,
                got_no_ack: 15,
                redelivered: 16,
                acked: 17,
                ..Default::default()
            },
            oldest_ready_at: Some(1_000),
            dedup: Some(warren_broker::dedup::DedupStats {
                keys: 4,
                memory_bytes: 512,
                dropped: 9,
            }),
            policy: Some("p".into()),
            operator_policy: None,
            effective_policy_definition: Default::default(),
            replica: None,
            voters: None,
        };
        let r = QueueRates {
            publish: 1.5,
            deliver: 2.5,
            deliver_no_ack: 3.5,
            get: 4.5,
            get_no_ack: 5.5,
            deliver_get: 6.5,
            ack: 7.5,
            redeliver: 8.5,
        };
        let rendered = queue(&s, &r, "n", 4_500);
        let mut paths = Vec::new();
        fn walk(v: &Value, at: String, out: &mut Vec<String>) {
            if let Value::Object(m) = v {
                for (k, v) in m {
                    let p = if at.is_empty() {
                        k.clone()
                    } else {
                        format!("{at}.{k}")
                    };
                    walk(v, p.clone(), out);
                    out.push(p);
                }
            }
        }
        walk(&rendered, String::new(), &mut paths);
        assert!(paths.len() > 60, "{paths:?}");
        for p in paths
            .iter()
            .map(String::as_str)
            .chain(["nope", "message_stats.x.rate"])
        {
            assert_eq!(
                queue_field(&s, &r, "n", 4_500, p),
                lookup(&rendered, p),
                "field {p}"
            );
        }
    }

    #[test]
    fn properties_keys_as_rabbitmq() {
        let b = |key: &str| BindingSnapshot {
            vhost: "/".into(),
            source: warren_codec::ShortStr::from_static("x"),
            destination: warren_codec::ShortStr::from_static("q"),
            to_queue: true,
            routing_key: warren_codec::ShortStr::try_from_str(key).unwrap(),
            arguments: warren_codec::FieldTable::new(),
        };
        assert_eq!(properties_key(&b("")), "~");
        assert_eq!(properties_key(&b("a.b")), "a.b");
        assert_eq!(properties_key(&b("a b/c")), "a%20b%2Fc");
        assert_eq!(percent_decode("a%20b%2Fc%zz"), "a b/c%zz");
    }
}
