//! lapin helpers for tests of queue behaviour: arguments, headers, polling a queue until a
//! message or a count shows up, a dead-letter exchange with a queue to look at.

use std::collections::BTreeMap;
use std::time::Duration;

use lapin::message::BasicGetMessage;
use lapin::options::{
    BasicGetOptions, ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Channel, ExchangeKind};

use crate::{unique, within};

/// Declares a durable queue with these arguments (failing the test if refused).
pub async fn declare_durable(ch: &Channel, q: &str, arguments: FieldTable) {
    ch.queue_declare(
        q.into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        arguments,
    )
    .await
    .unwrap();
}

/// A new channel in confirm mode.
pub async fn confirm_channel(conn: &lapin::Connection) -> Channel {
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    ch
}

/// A field table from (key, value) pairs.
pub fn args(entries: &[(&str, AMQPValue)]) -> FieldTable {
    crate::raw::m::table(entries)
}

/// A long string value.
pub fn text(s: &str) -> AMQPValue {
    AMQPValue::LongString(s.into())
}

/// A header of a message's properties.
pub fn header<'a>(props: &'a BasicProperties, key: &str) -> Option<&'a AMQPValue> {
    props
        .headers()
        .as_ref()?
        .inner()
        .get(&ShortString::from(key))
}

/// The `x-death` entries, most recent first (panics without an `x-death` array).
pub fn deaths(props: &BasicProperties) -> Vec<BTreeMap<ShortString, AMQPValue>> {
    match header(props, "x-death") {
        Some(AMQPValue::FieldArray(list)) => list
            .as_slice()
            .iter()
            .map(|v| match v {
                AMQPValue::FieldTable(t) => t.inner().clone(),
                other => panic!("x-death entry is not a table: {other:?}"),
            })
            .collect(),
        other => panic!("no x-death array: {other:?}"),
    }
}

/// A field of an `x-death` entry (panics if it is missing).
pub fn field<'a>(entry: &'a BTreeMap<ShortString, AMQPValue>, key: &str) -> &'a AMQPValue {
    entry
        .get(&ShortString::from(key))
        .unwrap_or_else(|| panic!("x-death entry without {key}: {entry:?}"))
}

/// The ready count a passive declare reports (a passive declare renews `x-expires`).
/// A consumer on `q` that acknowledges nothing (no-ack): every message it gets is settled.
pub async fn consume_no_ack(ch: &Channel, q: &str) -> lapin::Consumer {
    ch.basic_consume(
        q.into(),
        "".into(),
        lapin::options::BasicConsumeOptions {
            no_ack: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .expect("consume")
}

pub async fn ready(ch: &Channel, q: &str) -> u32 {
    ch.queue_declare(
        q.into(),
        QueueDeclareOptions {
            passive: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap()
    .message_count()
}

/// Polls until the queue holds `n` ready messages.
pub async fn wait_ready(ch: &Channel, q: &str, n: u32) {
    within(&format!("{q} to hold {n} ready"), async {
        while ready(ch, q).await != n {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
}

/// Polls basic.get until a message comes (failing the test after the harness's wait).
pub async fn get_eventually(ch: &Channel, q: &str, no_ack: bool) -> BasicGetMessage {
    within(&format!("a message in {q}"), async {
        loop {
            if let Some(m) = ch
                .basic_get(q.into(), BasicGetOptions { no_ack })
                .await
                .unwrap()
            {
                return m;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
}

/// A fanout exchange with a queue bound to it, where dead letters are looked at: (exchange,
/// queue).
pub async fn dead_letter_queue(ch: &Channel, prefix: &str, durable: bool) -> (String, String) {
    let (x, q) = (
        unique(&format!("{prefix}-dlx")),
        unique(&format!("{prefix}-dlq")),
    );
    ch.exchange_declare(
        x.as_str().into(),
        ExchangeKind::Fanout,
        ExchangeDeclareOptions {
            durable,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.queue_declare(
        q.as_str().into(),
        QueueDeclareOptions {
            durable,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.queue_bind(
        q.as_str().into(),
        x.as_str().into(),
        "".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    (x, q)
}
