//! One running shovel: consumes from its source and publishes to its destination over AMQP
//! 0-9-1 (lapin), reconnecting after `reconnect-delay` whenever either side fails.
//!
//! With `on-confirm` a message is acked at the source only once the destination confirmed
//! its copy, so a crash of either broker, of this node, or a dropped connection loses
//! nothing: what was in flight goes back to the source queue (unacked) and is shovelled
//! again (a duplicate, never a loss). `on-publish` acks once the copy is written;
//! `no-ack` consumes without acks at all (RabbitMQ's three modes).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use futures_lite::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldArray, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Confirmation, Connection, ConnectionProperties, PublisherConfirm};
use serde_json::{Map, Value};
use tokio::sync::watch;

use super::definition::{AckMode, DeleteAfter, Destination, ShovelDef, Source};
use super::uri::{self, Local};
use super::{Counters, Shovels, State};

/// Why a session of the shovel ended before its work was done.
#[derive(Debug, thiserror::Error)]
pub(super) enum SessionError {
    #[error("{0}")]
    Amqp(#[from] lapin::Error),
    #[error("cannot connect to {uri}: {error}")]
    Connect { uri: String, error: lapin::Error },
    #[error("{0}")]
    Uri(String),
    #[error("the source cancelled the shovel's consumer (its queue was deleted?)")]
    SourceGone,
    #[error("the destination refused a message (nack): it stays in the source")]
    Refused,
}

/// What a shovel keeps across its sessions.
struct Progress {
    /// Messages still to move before the shovel deletes itself (`None`: it never does).
    remaining: Option<u64>,
    /// `queue-length` was measured (at the first start, as RabbitMQ does).
    measured: bool,
    /// Which of the URIs the next session tries.
    attempt: usize,
}

/// How a worker ended.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ended {
    /// Its `src-delete-after` work is done (it was not stopped).
    pub done: bool,
    /// Its connections closed cleanly: what was in flight is back in the source now, not
    /// once a broker notices the connection is gone.
    pub closed: bool,
}

pub(crate) struct Worker {
    pub vhost: String,
    pub name: String,
    pub def: ShovelDef,
    pub local: Local,
    pub shovels: Shovels,
    /// The cluster's name, for `x-shovelled`.
    pub cluster_name: String,
    /// What `/api/shovels` counts of it.
    pub counters: Arc<Counters>,
    /// `warren migrate`'s sessions carry more of each message than a shovel does.
    pub migration: Option<Migration>,
}

/// What a `warren migrate` session carries of each message beyond a shovel's copy.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Migration {
    /// The source queue's TTL (ms), if it has one: each copy's time to live is what is left
    /// of it ([`super::expiry::carried`]).
    pub queue_ttl_ms: Option<u64>,
    /// The destination is a Warren: a message its source delivered before crosses with the
    /// `x-redelivered` header, which makes Warren deliver it as redelivered.
    pub into_warren: bool,
}

impl Worker {
    /// Runs until its work is done (`src-delete-after`) or `stop` says so.
    pub(crate) async fn run(self, mut stop: watch::Receiver<bool>) -> Ended {
        let mut progress = Progress {
            remaining: match self.def.delete_after {
                DeleteAfter::Count(n) => Some(n),
                _ => None,
            },
            measured: false,
            attempt: 0,
        };
        loop {
            self.shovels
                .set_state(&self.vhost, &self.name, State::Starting, None);
            let mut conns = Vec::new();
            let outcome = tokio::select! {
                r = self.session(&mut conns, &mut progress) => Some(r),
                _ = stop.changed() => None,
            };
            let mut closed = true;
            for c in conns {
                // Unacked deliveries go back to the source queue as the connection closes.
                let r = tokio::time::timeout(
                    Duration::from_secs(2),
                    c.close(200, "shovel stopped".into()),
                )
                .await;
                closed &= matches!(r, Ok(Ok(())));
            }
            match outcome {
                None => {
                    return Ended {
                        done: false,
                        closed,
                    }
                }
                Some(Ok(())) => return Ended { done: true, closed },
                Some(Err(e)) => {
                    tracing::warn!(vhost = %self.vhost, shovel = %self.name, error = %e, "shovel interrupted; reconnecting after its reconnect-delay");
                    self.shovels.set_state(
                        &self.vhost,
                        &self.name,
                        State::Starting,
                        Some(e.to_string()),
                    );
                    progress.attempt = progress.attempt.wrapping_add(1);
                }
            }
            // RabbitMQ's reconnect-delay; never faster than ten attempts a second.
            let pause = self.def.reconnect_delay.max(Duration::from_millis(100));
            tokio::select! {
                _ = tokio::time::sleep(pause) => {}
                _ = stop.changed() => return Ended { done: false, closed: true },
            }
        }
    }

    async fn connect(
        &self,
        uris: &[String],
        attempt: usize,
    ) -> Result<(Connection, String), SessionError> {
        // Several URIs: each session tries the next one (RabbitMQ picks one at random).
        let Some(chosen) = uris.get(attempt % uris.len().max(1)) else {
            return Err(SessionError::Uri("no URI".into()));
        };
        let target = uri::target(chosen, &self.local, &self.vhost).map_err(SessionError::Uri)?;
        let props = ConnectionProperties::default()
            .with_connection_name(format!("Shovel {}", self.name).into());
        let conn = match uri::connect(chosen, target, props).await {
            Ok(c) => c,
            Err(uri::ConnectError::Settings(e)) => return Err(SessionError::Uri(e)),
            Err(uri::ConnectError::Amqp(error)) => {
                return Err(SessionError::Connect {
                    uri: uri::redacted(chosen),
                    error,
                })
            }
        };
        Ok((conn, chosen.clone()))
    }

    /// One connection to each side, moving messages until the work is done or one fails.
    async fn session(
        &self,
        conns: &mut Vec<Connection>,
        progress: &mut Progress,
    ) -> Result<(), SessionError> {
        let def = &self.def;
        let (src_conn, src_uri) = self.connect(&def.src_uris, progress.attempt).await?;
        conns.push(src_conn);
        let (dest_conn, dest_uri) = self.connect(&def.dest_uris, progress.attempt).await?;
        conns.push(dest_conn);
        let [src_conn, dest_conn] = conns.as_slice() else {
            return Err(SessionError::Uri("a connection is missing".into()));
        };
        let queue = match &def.src {
            Source::Queue { name, args } => {
                ensure_queue(src_conn, name, args).await?;
                name.clone()
            }
            Source::Exchange { name, key } => {
                let ch = src_conn.create_channel().await?;
                let own = QueueDeclareOptions {
                    exclusive: true,
                    ..Default::default()
                };
                let q = ch
                    .queue_declare("".into(), own, FieldTable::default())
                    .await?;
                ch.queue_bind(
                    q.name().clone(),
                    name.as_str().into(),
                    key.as_str().into(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await?;
                q.name().to_string()
            }
        };
        if let Destination::Queue { name, args } = &def.dest {
            ensure_queue(dest_conn, name, args).await?;
        }
        let src = src_conn.create_channel().await?;
        if def.delete_after == DeleteAfter::QueueLength && !progress.measured {
            let passive = QueueDeclareOptions {
                passive: true,
                ..Default::default()
            };
            let q = src
                .queue_declare(queue.as_str().into(), passive, FieldTable::default())
                .await?;
            progress.remaining = Some(u64::from(q.message_count()));
            progress.measured = true;
            self.counters.set_remaining(progress.remaining);
        }
        if progress.remaining == Some(0) {
            return Ok(());
        }
        let dest = dest_conn.create_channel().await?;
        if def.ack_mode == AckMode::OnConfirm {
            dest.confirm_select(ConfirmSelectOptions::default()).await?;
        }
        // 0 is no limit in AMQP: in flight, every message would wait here for its confirm.
        // A bounded window instead (the largest AMQP allows).
        let mut prefetch = if def.prefetch == 0 {
            u16::MAX
        } else {
            def.prefetch
        };
        if let Some(r) = progress.remaining {
            // Never more in flight than are left to move.
            prefetch = u16::try_from(r).unwrap_or(u16::MAX).min(prefetch).max(1);
        }
        src.basic_qos(prefetch, BasicQosOptions::default()).await?;
        let mut consumer = src
            .basic_consume(
                queue.as_str().into(),
                "".into(),
                BasicConsumeOptions {
                    no_ack: def.ack_mode == AckMode::NoAck,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await?;
        let tag = consumer.tag();
        self.shovels.set_running(
            &self.vhost,
            &self.name,
            uri::redacted(&src_uri),
            uri::redacted(&dest_uri),
        );
        let headers = self.forward_table(&src_uri, &dest_uri);
        // Deliveries still to take in this session, and confirms awaited in order.
        let mut to_take = progress.remaining;
        let mut cancelled = false;
        // The consumer's stream ended after its cancel: nothing more comes.
        let mut ended = false;
        let mut head: Option<(std::pin::Pin<Box<PublisherConfirm>>, u64)> = None;
        // Confirmed at the destination, not yet acked at the source.
        let mut confirmed = 0u64;
        let ack_every = u64::from(prefetch / 4).max(1);
        let mut waiting: VecDeque<(std::pin::Pin<Box<PublisherConfirm>>, u64)> = VecDeque::new();
        loop {
            if head.is_none() {
                head = waiting.pop_front();
            }
            // Once cancelled, a no-ack consumer still moves what the source sent before the
            // cancel (it is no longer in the source); the others leave it there, unacked.
            let taking = (!cancelled || def.ack_mode == AckMode::NoAck) && !ended;
            if !taking && head.is_none() {
                return Ok(());
            }
            let confirm = async {
                match head.as_mut() {
                    Some((c, _)) => c.as_mut().await,
                    None => std::future::pending().await,
                }
            };
            let step = tokio::select! {
                d = consumer.next(), if taking => Step::Delivery(d),
                c = confirm => Step::Confirm(c),
            };
            match step {
                Step::Delivery(None) if cancelled => ended = true,
                Step::Delivery(None) => return Err(SessionError::SourceGone),
                Step::Delivery(Some(d)) => {
                    let d = d?;
                    let (exchange, key) = route(&def.dest, &d.exchange, &d.routing_key);
                    let props =
                        self.copy_properties(&d.properties, headers.as_ref(), d.redelivered);
                    let confirm = dest
                        .basic_publish(
                            exchange,
                            key,
                            BasicPublishOptions::default(),
                            &d.data,
                            props,
                        )
                        .await?;
                    if let Some(n) = to_take.as_mut() {
                        *n = n.saturating_sub(1);
                        if *n == 0 && !cancelled {
                            cancelled = true;
                            src.basic_cancel(tag.clone(), BasicCancelOptions::default())
                                .await?;
                        }
                    }
                    match def.ack_mode {
                        AckMode::OnConfirm => {
                            waiting.push_back((Box::pin(confirm), d.delivery_tag));
                        }
                        AckMode::OnPublish => {
                            src.basic_ack(d.delivery_tag, BasicAckOptions::default())
                                .await?;
                            self.moved(progress, 1);
                        }
                        AckMode::NoAck => self.moved(progress, 1),
                    }
                }
                Step::Confirm(c) => {
                    let Some((_, delivery_tag)) = head.take() else {
                        continue;
                    };
                    match c? {
                        Confirmation::Ack(_) | Confirmation::NotRequested => {
                            // Confirms come in delivery order, so one ack with `multiple`
                            // settles every delivery confirmed so far: a batch of them at a
                            // time, and whatever is confirmed once none is awaited.
                            confirmed += 1;
                            if confirmed >= ack_every || waiting.is_empty() {
                                src.basic_ack(delivery_tag, BasicAckOptions { multiple: true })
                                    .await?;
                                self.moved(progress, std::mem::take(&mut confirmed));
                            }
                        }
                        // The session ends: closing the source connection puts it back.
                        Confirmation::Nack(_) => return Err(SessionError::Refused),
                    }
                }
            }
        }
    }

    fn moved(&self, progress: &mut Progress, n: u64) {
        if let Some(r) = progress.remaining.as_mut() {
            *r = r.saturating_sub(n);
        }
        self.counters.moved(n, progress.remaining);
    }

    /// RabbitMQ's `x-shovelled` entry (when `dest-add-forward-headers`), credentials left out.
    fn forward_table(&self, src_uri: &str, dest_uri: &str) -> Option<FieldTable> {
        if !self.def.add_forward_headers {
            return None;
        }
        let mut t = FieldTable::default();
        let mut put = |k: &str, v: &str| {
            t.insert(k.into(), AMQPValue::LongString(LongString::from(v)));
        };
        put("shovelled-by", &self.cluster_name);
        put("shovel-type", "dynamic");
        put("shovel-name", &self.name);
        put("shovel-vhost", &self.vhost);
        put("src-uri", &uri::without_credentials(src_uri));
        put("dest-uri", &uri::without_credentials(dest_uri));
        match &self.def.src {
            Source::Queue { name, .. } => put("src-queue", name),
            Source::Exchange { name, key } => {
                put("src-exchange", name);
                put("src-exchange-key", key);
            }
        }
        match &self.def.dest {
            Destination::Queue { name, .. } => put("dest-queue", name),
            Destination::Exchange { name, key } => {
                put("dest-exchange", name);
                if let Some(k) = key {
                    put("dest-exchange-key", k);
                }
            }
            Destination::AsPublished => {}
        }
        Some(t)
    }

    /// The copy's properties: the message's own, with `dest-publish-properties` over them and
    /// the forward and timestamp headers added.
    fn copy_properties(
        &self,
        props: &BasicProperties,
        forward: Option<&FieldTable>,
        redelivered: bool,
    ) -> BasicProperties {
        let mut p = props.clone();
        for (k, v) in &self.def.publish_properties {
            p = set_property(p, k, v);
        }
        if let Some(m) = self.migration {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
            p = super::expiry::carried(p, m.queue_ttl_ms, now);
        }
        let mark = redelivered && self.migration.is_some_and(|m| m.into_warren);
        // A copy is new where it lands, unless this is a migration of a message the source
        // delivered: a mark from an earlier hop does not travel on.
        let stale = p
            .headers()
            .as_ref()
            .is_some_and(|h| h.inner().contains_key(warren_broker::REDELIVERED_HEADER));
        if forward.is_none() && !self.def.add_timestamp_header && !mark && !stale {
            return p;
        }
        let mut headers = p.headers().clone().unwrap_or_default();
        if mark {
            headers.insert(
                warren_broker::REDELIVERED_HEADER.into(),
                AMQPValue::Boolean(true),
            );
        } else if stale {
            let mut kept = headers.inner().clone();
            kept.remove(warren_broker::REDELIVERED_HEADER);
            headers = FieldTable::from(kept);
        }
        if let Some(entry) = forward {
            // The newest hop first, as RabbitMQ prepends it.
            let mut hops = vec![AMQPValue::FieldTable(entry.clone())];
            if let Some(AMQPValue::FieldArray(old)) = headers.inner().get("x-shovelled") {
                hops.extend(old.as_slice().iter().cloned());
            }
            headers.insert(
                "x-shovelled".into(),
                AMQPValue::FieldArray(FieldArray::from(hops)),
            );
        }
        if self.def.add_timestamp_header {
            let secs = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            headers.insert(
                "x-shovelled-timestamp".into(),
                AMQPValue::LongLongInt(i64::try_from(secs).unwrap_or(i64::MAX)),
            );
        }
        p.with_headers(headers)
    }
}

enum Step {
    Delivery(Option<lapin::Result<lapin::message::Delivery>>),
    Confirm(lapin::Result<Confirmation>),
}

/// The exchange and routing key a copy is published with.
fn route(
    dest: &Destination,
    exchange: &ShortString,
    routing_key: &ShortString,
) -> (ShortString, ShortString) {
    match dest {
        Destination::Queue { name, .. } => ("".into(), name.as_str().into()),
        Destination::Exchange { name, key } => (
            name.as_str().into(),
            key.as_deref()
                .map_or_else(|| routing_key.clone(), Into::into),
        ),
        Destination::AsPublished => (exchange.clone(), routing_key.clone()),
    }
}

/// Declares `name` durable (with `args`) unless it exists, as RabbitMQ's shovel does: a
/// passive declare first, on a channel of its own since a missing queue closes it.
async fn ensure_queue(
    conn: &Connection,
    name: &str,
    args: &Map<String, Value>,
) -> Result<(), SessionError> {
    let probe = conn.create_channel().await?;
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    if probe
        .queue_declare(name.into(), passive, FieldTable::default())
        .await
        .is_ok()
    {
        let _ = probe.close(200, "".into()).await;
        return Ok(());
    }
    let ch = conn.create_channel().await?;
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    ch.queue_declare(name.into(), durable, table(args)).await?;
    let _ = ch.close(200, "".into()).await;
    Ok(())
}

/// A JSON object as AMQP arguments (RabbitMQ's JSON-to-table mapping).
pub(super) fn table(m: &Map<String, Value>) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in m {
        if let Some(v) = amqp_value(v) {
            t.insert(k.as_str().into(), v);
        }
    }
    t
}

fn amqp_value(v: &Value) -> Option<AMQPValue> {
    Some(match v {
        Value::Null => return None,
        Value::Bool(b) => AMQPValue::Boolean(*b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => AMQPValue::LongLongInt(i),
            None => AMQPValue::Double(n.as_f64()?),
        },
        Value::String(s) => AMQPValue::LongString(LongString::from(s.as_str())),
        Value::Array(a) => AMQPValue::FieldArray(FieldArray::from(
            a.iter().filter_map(amqp_value).collect::<Vec<_>>(),
        )),
        Value::Object(o) => AMQPValue::FieldTable(table(o)),
    })
}

/// The basic properties `dest-publish-properties` may set, and what each takes.
const PROPERTIES: &[(&str, Kind)] = &[
    ("content_type", Kind::Text),
    ("content_encoding", Kind::Text),
    ("delivery_mode", Kind::Octet),
    ("priority", Kind::Octet),
    ("correlation_id", Kind::Text),
    ("reply_to", Kind::Text),
    ("expiration", Kind::Text),
    ("message_id", Kind::Text),
    ("timestamp", Kind::Number),
    ("type", Kind::Text),
    ("user_id", Kind::Text),
    ("app_id", Kind::Text),
    ("cluster_id", Kind::Text),
];

#[derive(Clone, Copy)]
enum Kind {
    Text,
    Octet,
    Number,
}

/// Is `key: value` a property `dest-publish-properties` can set?
pub(super) fn check_property(key: &str, value: &Value) -> Result<(), String> {
    let Some((_, kind)) = PROPERTIES.iter().find(|(k, _)| *k == key) else {
        return Err(if key == "headers" {
            "setting headers this way is not supported (as in RabbitMQ)".into()
        } else {
            format!("{key} is not a basic property")
        });
    };
    let ok = match kind {
        Kind::Text => value.as_str().is_some_and(|s| s.len() <= 255),
        Kind::Octet => value.as_u64().is_some_and(|n| n <= 255),
        Kind::Number => value.as_u64().is_some(),
    };
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{key} should be {}, actually was {}",
            match kind {
                Kind::Text => "a string of at most 255 bytes",
                Kind::Octet => "a number from 0 to 255",
                Kind::Number => "a non-negative number",
            },
            super::definition::erl(value)
        ))
    }
}

/// Sets one property the definition checked (anything else leaves the properties as they are).
fn set_property(p: BasicProperties, key: &str, value: &Value) -> BasicProperties {
    let text = || value.as_str().map(ShortString::from);
    let octet = || value.as_u64().and_then(|n| u8::try_from(n).ok());
    match key {
        "content_type" => text().map_or(p.clone(), |v| p.clone().with_content_type(v)),
        "content_encoding" => text().map_or(p.clone(), |v| p.clone().with_content_encoding(v)),
        "delivery_mode" => octet().map_or(p.clone(), |v| p.clone().with_delivery_mode(v)),
        "priority" => octet().map_or(p.clone(), |v| p.clone().with_priority(v)),
        "correlation_id" => text().map_or(p.clone(), |v| p.clone().with_correlation_id(v)),
        "reply_to" => text().map_or(p.clone(), |v| p.clone().with_reply_to(v)),
        "expiration" => text().map_or(p.clone(), |v| p.clone().with_expiration(v)),
        "message_id" => text().map_or(p.clone(), |v| p.clone().with_message_id(v)),
        "timestamp" => value
            .as_u64()
            .map_or(p.clone(), |v| p.clone().with_timestamp(v)),
        "type" => text().map_or(p.clone(), |v| p.clone().with_type(v)),
        "user_id" => text().map_or(p.clone(), |v| p.clone().with_user_id(v)),
        "app_id" => text().map_or(p.clone(), |v| p.clone().with_app_id(v)),
        "cluster_id" => text().map_or(p.clone(), |v| p.clone().with_cluster_id(v)),
        _ => p,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn copies_go_where_the_destination_says() {
        let (x, k): (ShortString, ShortString) = ("orders".into(), "eu.new".into());
        let q = Destination::Queue {
            name: "archive".into(),
            args: Map::new(),
        };
        assert_eq!(route(&q, &x, &k), ("".into(), "archive".into()));
        let e = Destination::Exchange {
            name: "copy".into(),
            key: None,
        };
        assert_eq!(route(&e, &x, &k), ("copy".into(), "eu.new".into()));
        let e = Destination::Exchange {
            name: "copy".into(),
            key: Some("all".into()),
        };
        assert_eq!(route(&e, &x, &k), ("copy".into(), "all".into()));
        assert_eq!(
            route(&Destination::AsPublished, &x, &k),
            (x.clone(), k.clone())
        );
    }

    #[test]
    fn publish_properties_are_checked_and_set() {
        assert!(check_property("delivery_mode", &json!(2)).is_ok());
        assert!(check_property("delivery_mode", &json!(300)).is_err());
        assert!(check_property("headers", &json!({})).is_err());
        assert!(check_property("colour", &json!("red")).is_err());
        let p = set_property(BasicProperties::default(), "delivery_mode", &json!(2));
        let p = set_property(p, "content_type", &json!("application/json"));
        assert_eq!(*p.delivery_mode(), Some(2));
        assert_eq!(
            p.content_type().as_ref().map(|s| s.as_str()),
            Some("application/json")
        );
        let args = table(
            json!({"x-queue-type": "quorum", "x-max-length": 10})
                .as_object()
                .expect("object"),
        );
        assert_eq!(
            args.inner().get("x-max-length"),
            Some(&AMQPValue::LongLongInt(10))
        );
    }
}
