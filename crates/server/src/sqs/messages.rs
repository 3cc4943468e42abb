//! The message actions: send, receive (with long polling), delete, change visibility.

use std::collections::HashSet;
use std::time::Duration;

use bytes::Bytes;
use serde_json::{json, Map, Value};
use warren_broker::access::{Perm, Resource};
use warren_broker::{Message, QueueId};
use warren_codec::properties::BasicProperties;
use warren_codec::{FieldTable, FieldValue, ShortStr};
use warren_session::manage::API_CONN;

use super::attributes::{self, Attribute};
use super::queues::{
    amqp, is_fifo, ARG_CONTENT_DEDUP, ARG_DEDUP_SCOPE, ARG_MAX_SIZE, ARG_VISIBILITY, ARG_WAIT,
    DEDUP_ID_HEADER, DEDUP_KEY_HEADER, DEFAULT_VISIBILITY, GROUP_HEADER, MAX_MESSAGE_SIZE,
};
use super::receipt::Handle;
use super::{integer, queue_of, required, strings, Ctx, Sqs, SqsError};

/// When SendMessage sent it (ms since the epoch): SQS's `SentTimestamp`.
const SENT_HEADER: &str = "x-sqs-sent-timestamp";

/// A FIFO message's `SequenceNumber`.
const SEQUENCE_HEADER: &str = "x-sqs-sequence-number";

/// The last sequence number given: each is above the one before and, from a later start,
/// above every one of an earlier start (they begin at the time in milliseconds times 10^6).
static SEQUENCE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The next FIFO sequence number, as SQS writes them (a string of digits, growing).
fn next_sequence(now_ms: u64) -> String {
    use std::sync::atomic::Ordering;
    SEQUENCE.fetch_max(now_ms.saturating_mul(1_000_000), Ordering::AcqRel);
    let mine = SEQUENCE.fetch_add(1, Ordering::AcqRel).saturating_add(1);
    format!("{mine:020}")
}

/// SQS's rule for a `MessageGroupId` and a `MessageDeduplicationId`: 1 to 128 characters,
/// letters, digits and ASCII punctuation.
fn fifo_id(input: &Map<String, Value>, name: &str) -> Result<Option<String>, SqsError> {
    let Some(v) = super::text(input, name)? else {
        return Ok(None);
    };
    let ok = (1..=128).contains(&v.len()) && v.bytes().all(|b| b.is_ascii_graphic());
    if !ok {
        return Err(SqsError::invalid_parameter(format!(
            "Value {v} for parameter {name} is invalid. Reason: {name} can only include alphanumeric and punctuation characters. 1 to 128 in length."
        )));
    }
    Ok(Some(v.to_owned()))
}

/// The delayed exchange (`x-delayed-message`, direct) of a vhost through which a message
/// with its own DelaySeconds reaches a queue that has no delay of its own: each such queue
/// is bound to it under its name, the first time it is needed.
pub const DELAY_EXCHANGE: &str = "warren.sqs-delay";

/// Makes sure `queue` is bound to the vhost's [`DELAY_EXCHANGE`].
fn delay_route(n: &mut warren_session::Node, vhost: &str, queue: &str) -> Result<(), SqsError> {
    let b = n.broker_mut();
    if !b.exchange_exists(vhost, DELAY_EXCHANGE) {
        let mut args = FieldTable::new();
        args.insert("x-delayed-type", FieldValue::long_str("direct"));
        b.declare_exchange(
            vhost,
            DELAY_EXCHANGE,
            "x-delayed-message",
            false,
            true,
            false,
            false,
            &args,
        )
        .map_err(amqp)?;
    }
    b.bind_queue(
        vhost,
        queue,
        DELAY_EXCHANGE,
        queue,
        &FieldTable::new(),
        API_CONN,
    )
    .map_err(amqp)
}

/// A random id in UUID form (SQS's MessageId).
pub(super) fn new_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    let word = || {
        std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish()
    };
    let (a, b) = (word(), word());
    format!(
        "{:08x}-{:04x}-4{:03x}-{:04x}-{:012x}",
        a >> 32,
        (a >> 16) & 0xffff,
        a & 0xfff,
        ((b >> 48) & 0x3fff) | 0x8000,
        b & 0xffff_ffff_ffff
    )
}

/// One message to send, checked.
struct Outgoing {
    body: String,
    attrs: Vec<Attribute>,
    delay_s: Option<i64>,
    group: Option<String>,
    dedup: Option<String>,
}

fn outgoing(input: &Map<String, Value>) -> Result<Outgoing, SqsError> {
    let body = required(input, "MessageBody")?.to_owned();
    if body.is_empty() {
        return Err(SqsError::missing_parameter("MessageBody"));
    }
    // SQS's allowed characters: #x9 | #xA | #xD | #x20 to #xD7FF | #xE000 to #xFFFD | #x10000 to #x10FFFF.
    if body.chars().any(|c| {
        (c < ' ' && !matches!(c, '\t' | '\n' | '\r')) || c == '\u{FFFE}' || c == '\u{FFFF}'
    }) {
        return Err(SqsError::new(
            400,
            "InvalidMessageContents",
            "InvalidMessageContents",
            "Invalid characters found.",
        ));
    }
    let attrs = attributes::parse(input.get("MessageAttributes"))?;
    let delay_s = integer(input, "DelaySeconds", 0..=900)?;
    Ok(Outgoing {
        body,
        attrs,
        delay_s,
        group: fifo_id(input, "MessageGroupId")?,
        dedup: fifo_id(input, "MessageDeduplicationId")?,
    })
}

/// Publishes `m` to the queue through the default exchange, as an AMQP client would.
fn publish(
    n: &mut warren_session::Node,
    now: u64,
    ctx: &Ctx,
    (vhost, name): (&str, &str),
    m: &Outgoing,
) -> Result<Map<String, Value>, SqsError> {
    let b = n.broker();
    let args = b
        .queue_snapshot(vhost, name)
        .ok_or_else(SqsError::no_queue)?
        .arguments;
    let max = args
        .get(ARG_MAX_SIZE)
        .and_then(FieldValue::as_i64)
        .map_or(MAX_MESSAGE_SIZE as usize, |m| m.max(0) as usize);
    if m.body.len() + attributes::size(&m.attrs) > max {
        return Err(SqsError::invalid_parameter(format!(
            "One or more parameters are invalid. Reason: Message must be shorter than {max} bytes."
        )));
    }
    let delays = args.contains_key("x-delivery-delay");
    let mut headers = FieldTable::new();
    attributes::to_headers(&m.attrs, &mut headers);
    headers.insert(SENT_HEADER, FieldValue::I64(now as i64));
    let sequence = if is_fifo(&args) {
        Some(fifo_headers(&args, m, now, &mut headers)?)
    } else {
        if m.dedup.is_some() {
            return Err(not_for_this_queue("MessageDeduplicationId"));
        }
        // A standard queue takes a MessageGroupId and keeps no order by it (as SQS's fair
        // queues do).
        None
    };
    // A queue with a delay of its own holds back a message by its `x-delay` header; to any
    // other the message goes through the delayed exchange.
    let mut exchange = "";
    if let Some(d) = m.delay_s.filter(|d| *d > 0) {
        headers.insert("x-delay", FieldValue::I64(d * 1000));
        if !delays {
            delay_route(n, vhost, name)?;
            exchange = DELAY_EXCHANGE;
        }
    }
    let id = new_id();
    let props = BasicProperties {
        delivery_mode: Some(2),
        timestamp: Some(now / 1000),
        message_id: Some(ShortStr::from_string(id.clone())),
        user_id: ShortStr::try_from_str(&ctx.user).ok(),
        headers: Some(headers),
        ..BasicProperties::default()
    };
    let message = Message {
        exchange: ShortStr::from_static(if exchange.is_empty() {
            ""
        } else {
            DELAY_EXCHANGE
        }),
        routing_key: ShortStr::try_from_str(name).map_err(|_| SqsError::no_queue())?,
        properties: props.encode(),
        body: Bytes::from(m.body.clone().into_bytes()),
        persistent: true,
        store_key: None,
        away: None,
    };
    let routed = n
        .broker_mut()
        .publish(vhost, exchange, name, message, now)
        .map_err(amqp)?;
    // A delayed exchange routes when the message is due: nothing is routed now.
    if routed.queues == 0 && exchange.is_empty() {
        return Err(SqsError::no_queue());
    }
    if routed.rejected {
        // Refused by a length limit, or by a quorum queue with no leader that acts yet (one
        // is being elected): that one is worth a retry, which SDKs make on a 503.
        let limited = n
            .broker()
            .queue_id(vhost, name)
            .and_then(|id| n.broker().queue_args(id))
            .is_some_and(|a| a.overflow != warren_broker::Overflow::DropHead);
        return Err(if limited {
            SqsError::new(
                400,
                "OverLimit",
                "OverLimit",
                "The queue is full (its x-max-length) and refuses new messages.",
            )
        } else {
            SqsError::new(
                503,
                "ServiceUnavailable",
                "AWS.SimpleQueueService.ServiceUnavailable",
                "The queue has no leader to take the message now (one is being elected); retry.",
            )
        });
    }
    let mut out = Map::new();
    out.insert("MessageId".into(), Value::String(id));
    out.insert(
        "MD5OfMessageBody".into(),
        Value::String(attributes::md5_hex(m.body.as_bytes())),
    );
    if let Some(md5) = attributes::md5_of_attributes(&m.attrs) {
        out.insert("MD5OfMessageAttributes".into(), Value::String(md5));
    }
    if let Some(sequence) = sequence {
        out.insert("SequenceNumber".into(), Value::String(sequence));
    }
    Ok(out)
}

fn not_for_this_queue(name: &str) -> SqsError {
    SqsError::invalid_parameter(format!(
        "The request include parameter {name} that is not valid for this queue type."
    ))
}

/// A FIFO message's group, deduplication and sequence headers; its sequence number.
fn fifo_headers(
    args: &FieldTable,
    m: &Outgoing,
    now: u64,
    headers: &mut FieldTable,
) -> Result<String, SqsError> {
    let Some(group) = &m.group else {
        return Err(SqsError::missing_parameter("MessageGroupId"));
    };
    if let Some(d) = m.delay_s.filter(|d| *d > 0) {
        // A FIFO queue delays every message or none (its DelaySeconds attribute).
        return Err(SqsError::invalid_parameter(format!(
            "Value {d} for parameter DelaySeconds is invalid. Reason: The request include parameter that is not valid for this queue type."
        )));
    }
    let content = args.get(ARG_CONTENT_DEDUP).and_then(FieldValue::as_bool) == Some(true);
    let dedup = match (&m.dedup, content) {
        (Some(d), _) => d.clone(),
        (None, true) => {
            use sha2::Digest;
            hex(&sha2::Sha256::digest(m.body.as_bytes()))
        }
        (None, false) => {
            return Err(SqsError::invalid_parameter(
                "The queue should either have ContentBasedDeduplication enabled or MessageDeduplicationId provided explicitly",
            ))
        }
    };
    let per_group = args.get(ARG_DEDUP_SCOPE).and_then(FieldValue::as_str) == Some("messageGroup");
    let key = if per_group {
        // A group's name cannot hold a space (1 to 128 visible characters): no two
        // (group, id) pairs make one key.
        format!("{group} {dedup}")
    } else {
        dedup.clone()
    };
    let sequence = next_sequence(now);
    headers.insert(GROUP_HEADER, FieldValue::long_str(group));
    headers.insert(DEDUP_KEY_HEADER, FieldValue::long_str(&key));
    headers.insert(DEDUP_ID_HEADER, FieldValue::long_str(&dedup));
    headers.insert(SEQUENCE_HEADER, FieldValue::long_str(&sequence));
    Ok(sequence)
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes.iter().fold(String::with_capacity(64), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

fn may_send(n: &warren_session::Node, ctx: &Ctx, vhost: &str) -> Result<(), SqsError> {
    ctx.permit(
        n.broker().access(),
        vhost,
        &[(Perm::Write, Resource::Exchange(""))],
    )
}

pub async fn send(
    sqs: &Sqs,
    ctx: &Ctx,
    input: &Map<String, Value>,
) -> Result<Map<String, Value>, SqsError> {
    let (vhost, name) = queue_of(input)?;
    let m = outgoing(input)?;
    sqs.node
        .write_async(|n, now| {
            may_send(n, ctx, &vhost)?;
            publish(n, now, ctx, (&vhost, &name), &m)
        })
        .await?
}

/// Batch entries, checked as SQS does: 1 to 10, each with a distinct valid Id.
/// A batch's entries, each with its Id.
type Entries<'a> = Vec<(String, &'a Map<String, Value>)>;

fn entries(input: &Map<String, Value>) -> Result<Entries<'_>, SqsError> {
    let list = input
        .get("Entries")
        .and_then(Value::as_array)
        .ok_or_else(|| SqsError::missing_parameter("Entries"))?;
    if list.is_empty() {
        return Err(SqsError::empty_batch());
    }
    if list.len() > 10 {
        return Err(SqsError::too_many_entries(list.len()));
    }
    let mut seen = HashSet::new();
    let mut out = Vec::with_capacity(list.len());
    for e in list {
        let e = e
            .as_object()
            .ok_or_else(|| SqsError::invalid_parameter("Each entry must be an object."))?;
        let id = required(e, "Id")?.to_owned();
        let valid = !id.is_empty()
            && id.len() <= 80
            && id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        if !valid {
            return Err(SqsError::invalid_batch_id(&id));
        }
        if !seen.insert(id.clone()) {
            return Err(SqsError::ids_not_distinct(&id));
        }
        out.push((id, e));
    }
    Ok(out)
}

fn failed(id: &str, e: &SqsError) -> Value {
    json!({"Id": id, "SenderFault": e.sender, "Code": e.code, "Message": e.message})
}

fn batch_answer(ok: Vec<Value>, bad: Vec<Value>) -> Map<String, Value> {
    let mut out = Map::new();
    out.insert("Successful".into(), Value::Array(ok));
    out.insert("Failed".into(), Value::Array(bad));
    out
}

pub async fn send_batch(
    sqs: &Sqs,
    ctx: &Ctx,
    input: &Map<String, Value>,
) -> Result<Map<String, Value>, SqsError> {
    let (vhost, name) = queue_of(input)?;
    let list = entries(input)?;
    let checked: Vec<(String, Result<Outgoing, SqsError>)> =
        list.into_iter().map(|(id, e)| (id, outgoing(e))).collect();
    let total: usize = checked
        .iter()
        .filter_map(|(_, m)| m.as_ref().ok())
        .map(|m| m.body.len() + attributes::size(&m.attrs))
        .sum();
    if total > MAX_MESSAGE_SIZE as usize {
        return Err(SqsError::new(
            400,
            "BatchRequestTooLong",
            "AWS.SimpleQueueService.BatchRequestTooLong",
            format!("Batch requests cannot be longer than {MAX_MESSAGE_SIZE} bytes. You have sent {total} bytes."),
        ));
    }
    let (ok, bad) = sqs
        .node
        .write_async(|n, now| {
            may_send(n, ctx, &vhost)?;
            if n.broker().queue_id(&vhost, &name).is_none() {
                return Err(SqsError::no_queue());
            }
            let (mut ok, mut bad) = (Vec::new(), Vec::new());
            for (id, m) in &checked {
                match m
                    .as_ref()
                    .map_err(Clone::clone)
                    .and_then(|m| publish(n, now, ctx, (&vhost, &name), m))
                {
                    Ok(mut r) => {
                        r.insert("Id".into(), Value::String(id.clone()));
                        ok.push(Value::Object(r));
                    }
                    Err(e) => bad.push(failed(id, &e)),
                }
            }
            Ok((ok, bad))
        })
        .await??;
    Ok(batch_answer(ok, bad))
}

/// One received message, read out under the node's lock.
struct Received {
    queue: QueueId,
    receipt: warren_broker::queue::machine::Receipt,
    body: Bytes,
    properties: Bytes,
}

/// Which system attributes the receive asked for.
fn wants(names: &[String], attr: &str) -> bool {
    names.iter().any(|n| n == "All" || n == attr)
}

pub async fn receive(
    sqs: &Sqs,
    ctx: &Ctx,
    input: &Map<String, Value>,
) -> Result<Map<String, Value>, SqsError> {
    let (vhost, name) = queue_of(input)?;
    let max = integer(input, "MaxNumberOfMessages", 1..=10)?.unwrap_or(1) as u32;
    let visibility = integer(input, "VisibilityTimeout", 0..=43_200)?;
    let wait = integer(input, "WaitTimeSeconds", 0..=20)?;
    let mut system = strings(input, "MessageSystemAttributeNames");
    system.extend(strings(input, "AttributeNames"));
    let wanted_attrs = strings(input, "MessageAttributeNames");
    let (queue, args) = sqs.node.read(|n, _| {
        ctx.permit(
            n.broker().access(),
            &vhost,
            &[(Perm::Read, Resource::Queue(&name))],
        )?;
        n.broker()
            .queue_snapshot(&vhost, &name)
            .map(|s| (s.id, s.arguments))
            .ok_or_else(SqsError::no_queue)
    })?;
    let wait_s =
        wait.unwrap_or_else(|| args.get(ARG_WAIT).and_then(FieldValue::as_i64).unwrap_or(0));
    // The visibility timeout in force: the call's, the queue's, SQS's default.
    let visibility_ms = visibility.map(|s| s as u64 * 1000).unwrap_or_else(|| {
        args.get("x-visibility-timeout")
            .and_then(FieldValue::as_i64)
            .map(|ms| ms.max(0) as u64)
            .or_else(|| args.get(ARG_VISIBILITY).map(|_| 0))
            .unwrap_or(DEFAULT_VISIBILITY * 1000)
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(wait_s.max(0) as u64);
    // Watched before the first look, so that a message arriving between a look that found
    // nothing and the wait wakes it.
    let watch = (wait_s > 0).then(|| sqs.node.watch_queue(queue));
    let (got, now) = loop {
        let notified = watch.as_ref().map(|w| w.notify.notified());
        tokio::pin!(notified);
        if let Some(n) = notified.as_mut().as_pin_mut() {
            n.enable();
        }
        let (got, now) = sqs
            .node
            .write_async(|n, now| {
                ctx.permit(
                    n.broker().access(),
                    &vhost,
                    &[(Perm::Read, Resource::Queue(&name))],
                )?;
                let broker = n.broker_mut();
                // On a quorum queue's leader the answer waits until the log has the gets (and
                // the visibility changes after them): the messages go out then, as many as
                // are ready. Without the wait, a leader whose log was behind its machine (a
                // send a moment before) answered with fewer, or none.
                let hide = |b: &mut warren_broker::Broker, d: &warren_broker::Delivery| {
                    if visibility_ms == 0 {
                        // Visible again at once: the receive still counts.
                        b.release(d.queue, d.receipt);
                    } else {
                        b.extend(d.queue, d.receipt, visibility_ms);
                    }
                };
                let got = broker
                    .get_many_awaited((&vhost, &name), max as usize, API_CONN, hide)
                    .map_err(amqp)?;
                let got = got
                    .into_iter()
                    .map(|(d, _)| Received {
                        queue: d.queue,
                        receipt: d.receipt,
                        body: d.message.body,
                        properties: d.message.properties,
                    })
                    .collect::<Vec<_>>();
                Ok::<_, SqsError>((got, now))
            })
            .await??;
        if !got.is_empty() || tokio::time::Instant::now() >= deadline {
            break (got, now);
        }
        match notified.as_pin_mut() {
            Some(n) => {
                // Woken, or out of time: either way one more look (the last one finds what
                // arrived as the time ran out).
                let _ = tokio::time::timeout_at(deadline, n).await;
            }
            None => break (got, now),
        }
    };
    drop(watch);
    let messages: Vec<Value> = got
        .iter()
        .map(|r| message_json(sqs, (&vhost, &name), r, now, (&system, &wanted_attrs)))
        .collect();
    let mut out = Map::new();
    if !messages.is_empty() {
        out.insert("Messages".into(), Value::Array(messages));
    }
    Ok(out)
}

fn message_json(
    sqs: &Sqs,
    (vhost, name): (&str, &str),
    r: &Received,
    now: u64,
    (system, wanted): (&[String], &[String]),
) -> Value {
    let props = BasicProperties::decode_bytes(r.properties.clone()).unwrap_or_default();
    // SQS bodies are text; a binary AMQP body is given as its lossy UTF-8 reading, and the
    // digest is of what is given.
    let body = String::from_utf8_lossy(&r.body).into_owned();
    let handle = Handle {
        vhost: vhost.to_owned(),
        queue: name.to_owned(),
        receipt: r.receipt,
    };
    let mut m = Map::new();
    m.insert(
        "MessageId".into(),
        Value::String(
            props
                .message_id
                .as_ref()
                .map_or_else(|| format!("warren-{}", r.receipt.msg_id), |s| s.to_string()),
        ),
    );
    m.insert("ReceiptHandle".into(), Value::String(handle.encode()));
    m.insert(
        "MD5OfBody".into(),
        Value::String(attributes::md5_hex(body.as_bytes())),
    );
    m.insert("Body".into(), Value::String(body));
    let headers = props.headers.as_ref();
    let sent = headers
        .and_then(|h| h.get(SENT_HEADER))
        .and_then(FieldValue::as_i64)
        .map(|t| t.max(0) as u64)
        .or(props.timestamp.map(|s| s.saturating_mul(1000)));
    let first = sqs.first_receive((r.queue.0, r.receipt.msg_id), now);
    let mut sys = Map::new();
    if wants(system, "ApproximateReceiveCount") {
        sys.insert(
            "ApproximateReceiveCount".into(),
            Value::String(r.receipt.attempt.to_string()),
        );
    }
    if wants(system, "SentTimestamp") {
        if let Some(t) = sent {
            sys.insert("SentTimestamp".into(), Value::String(t.to_string()));
        }
    }
    if wants(system, "ApproximateFirstReceiveTimestamp") {
        sys.insert(
            "ApproximateFirstReceiveTimestamp".into(),
            Value::String(first.to_string()),
        );
    }
    if wants(system, "SenderId") {
        if let Some(u) = &props.user_id {
            sys.insert("SenderId".into(), Value::String(u.to_string()));
        }
    }
    for (attr, header) in [
        ("MessageGroupId", GROUP_HEADER),
        ("MessageDeduplicationId", DEDUP_ID_HEADER),
        ("SequenceNumber", SEQUENCE_HEADER),
    ] {
        let value = headers
            .and_then(|h| h.get(header))
            .and_then(FieldValue::as_str);
        if let (true, Some(v)) = (wants(system, attr), value) {
            sys.insert(attr.into(), Value::String(v.to_owned()));
        }
    }
    if !sys.is_empty() {
        m.insert("Attributes".into(), Value::Object(sys));
    }
    let attrs = attributes::from_headers(headers);
    let shown = attributes::to_json(&attrs, wanted);
    if !shown.is_empty() {
        let given: Vec<Attribute> = attrs
            .into_iter()
            .filter(|a| shown.contains_key(&a.name))
            .collect();
        if let Some(md5) = attributes::md5_of_attributes(&given) {
            m.insert("MD5OfMessageAttributes".into(), Value::String(md5));
        }
        m.insert("MessageAttributes".into(), Value::Object(shown));
    }
    Value::Object(m)
}

/// A receipt handle of the request's queue.
fn handle_of(raw: &str, vhost: &str, name: &str) -> Result<Handle, SqsError> {
    Handle::decode(raw)
        .filter(|h| h.vhost == vhost && h.queue == name)
        .ok_or_else(|| SqsError::receipt_invalid(raw))
}

/// Deletes (acks) one message. A stale handle (the message came back and went out again, or
/// is gone) changes nothing and is not an error, as in SQS.
fn delete_one(sqs: &Sqs, n: &mut warren_session::Node, queue: QueueId, h: &Handle) {
    n.broker_mut().settle(queue, h.receipt);
    sqs.forget_receive((queue.0, h.receipt.msg_id));
}

/// The queue a message action reads from: it exists and the user may read it.
fn queue_for_messages(
    n: &warren_session::Node,
    ctx: &Ctx,
    vhost: &str,
    name: &str,
) -> Result<QueueId, SqsError> {
    super::permitted_queue(n, ctx, vhost, name, Perm::Read)
}

/// Runs `one` for each entry of a batch action, sorting them into the `Successful` and
/// `Failed` lists of the answer.
fn each_entry(
    list: &Entries<'_>,
    mut one: impl FnMut(&Map<String, Value>) -> Result<(), SqsError>,
) -> (Vec<Value>, Vec<Value>) {
    let (mut ok, mut bad) = (Vec::new(), Vec::new());
    for (eid, e) in list {
        match one(e) {
            Ok(()) => ok.push(json!({"Id": eid})),
            Err(err) => bad.push(failed(eid, &err)),
        }
    }
    (ok, bad)
}

pub async fn delete(
    sqs: &Sqs,
    ctx: &Ctx,
    input: &Map<String, Value>,
) -> Result<Map<String, Value>, SqsError> {
    let (vhost, name) = queue_of(input)?;
    let h = handle_of(required(input, "ReceiptHandle")?, &vhost, &name)?;
    settle(sqs, |n| {
        let id = queue_for_messages(n, ctx, &vhost, &name)?;
        delete_one(sqs, n, id, &h);
        Ok((id, ()))
    })
    .await?;
    Ok(Map::new())
}

/// A delete or a visibility change on the queue `f` finds (and returns first), applied at
/// once. On a standard queue it is answered without waiting for its write, as an AMQP ack is
/// never confirmed: a crash just after may bring the message back, which SQS's at-least-once
/// delivery allows. A FIFO queue promises no duplicates: there the answer waits for the disk.
async fn settle<R>(
    sqs: &Sqs,
    f: impl FnOnce(&mut warren_session::Node) -> Result<(QueueId, R), SqsError>,
) -> Result<R, SqsError> {
    let before = sqs.node.last_sent();
    let (fifo, r) = sqs.node.change(|n, _| {
        let (queue, r) = f(n)?;
        let fifo = n
            .broker()
            .queue_args(queue)
            .is_some_and(|a| a.group_header.as_deref() == Some(GROUP_HEADER));
        Ok::<_, SqsError>((fifo, r))
    })??;
    if fifo {
        sqs.node.on_disk(before).await?;
    }
    Ok(r)
}

pub async fn delete_batch(
    sqs: &Sqs,
    ctx: &Ctx,
    input: &Map<String, Value>,
) -> Result<Map<String, Value>, SqsError> {
    let (vhost, name) = queue_of(input)?;
    let list = entries(input)?;
    let (ok, bad) = settle(sqs, |n| {
        let id = queue_for_messages(n, ctx, &vhost, &name)?;
        let answer = each_entry(&list, |e| {
            let h = handle_of(required(e, "ReceiptHandle")?, &vhost, &name)?;
            delete_one(sqs, n, id, &h);
            Ok(())
        });
        Ok((id, answer))
    })
    .await?;
    Ok(batch_answer(ok, bad))
}

/// A new visibility timeout for one delivery: 0 makes it visible at once.
fn change_one(
    n: &mut warren_session::Node,
    queue: QueueId,
    h: &Handle,
    seconds: i64,
) -> Result<(), SqsError> {
    let b = n.broker_mut();
    let done = if seconds == 0 {
        b.release(queue, h.receipt)
    } else {
        b.extend(queue, h.receipt, seconds as u64 * 1000)
    };
    if done {
        Ok(())
    } else {
        Err(SqsError::not_inflight())
    }
}

pub async fn change_visibility(
    sqs: &Sqs,
    ctx: &Ctx,
    input: &Map<String, Value>,
) -> Result<Map<String, Value>, SqsError> {
    let (vhost, name) = queue_of(input)?;
    let h = handle_of(required(input, "ReceiptHandle")?, &vhost, &name)?;
    let seconds = integer(input, "VisibilityTimeout", 0..=43_200)?
        .ok_or_else(|| SqsError::missing_parameter("VisibilityTimeout"))?;
    settle(sqs, |n| {
        let id = queue_for_messages(n, ctx, &vhost, &name)?;
        change_one(n, id, &h, seconds).map(|()| (id, ()))
    })
    .await?;
    Ok(Map::new())
}

pub async fn change_visibility_batch(
    sqs: &Sqs,
    ctx: &Ctx,
    input: &Map<String, Value>,
) -> Result<Map<String, Value>, SqsError> {
    let (vhost, name) = queue_of(input)?;
    let list = entries(input)?;
    let (ok, bad) = settle(sqs, |n| {
        let id = queue_for_messages(n, ctx, &vhost, &name)?;
        let answer = each_entry(&list, |e| {
            let h = handle_of(required(e, "ReceiptHandle")?, &vhost, &name)?;
            let s = integer(e, "VisibilityTimeout", 0..=43_200)?
                .ok_or_else(|| SqsError::missing_parameter("VisibilityTimeout"))?;
            change_one(n, id, &h, s)
        });
        Ok((id, answer))
    })
    .await?;
    Ok(batch_answer(ok, bad))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fifo_args(content: bool, per_group: bool) -> FieldTable {
        let mut t = FieldTable::new();
        t.insert("x-group-header", FieldValue::long_str(GROUP_HEADER));
        if content {
            t.insert(ARG_CONTENT_DEDUP, FieldValue::Bool(true));
        }
        if per_group {
            t.insert(ARG_DEDUP_SCOPE, FieldValue::long_str("messageGroup"));
        }
        t
    }

    fn message(group: Option<&str>, dedup: Option<&str>, delay_s: Option<i64>) -> Outgoing {
        Outgoing {
            body: "hello".into(),
            attrs: Vec::new(),
            delay_s,
            group: group.map(str::to_owned),
            dedup: dedup.map(str::to_owned),
        }
    }

    fn header(h: &FieldTable, k: &str) -> String {
        h.get(k)
            .and_then(FieldValue::as_str)
            .map(str::to_owned)
            .unwrap_or_default()
    }

    #[test]
    fn sequence_numbers_grow_even_when_the_clock_goes_back() {
        let a = next_sequence(2_000);
        let b = next_sequence(1_000);
        let c = next_sequence(3_000);
        assert!(a < b && b < c, "{a} {b} {c}");
        assert_eq!(a.len(), 20);
    }

    #[test]
    fn a_fifo_message_is_keyed_as_its_queue_deduplicates() {
        let mut h = FieldTable::new();
        fifo_headers(
            &fifo_args(true, false),
            &message(Some("g"), None, None),
            1,
            &mut h,
        )
        .expect("content-based");
        // SHA-256 of "hello".
        let sha = "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824";
        assert_eq!(header(&h, DEDUP_KEY_HEADER), sha);
        assert_eq!(header(&h, DEDUP_ID_HEADER), sha);
        assert_eq!(header(&h, GROUP_HEADER), "g");
        let mut h = FieldTable::new();
        let m = message(Some("g"), Some("id-1"), None);
        fifo_headers(&fifo_args(false, true), &m, 1, &mut h).expect("explicit");
        assert_eq!(
            header(&h, DEDUP_KEY_HEADER),
            "g id-1",
            "scoped to its group"
        );
        assert_eq!(header(&h, DEDUP_ID_HEADER), "id-1");
        let refused = |args: &FieldTable, m: &Outgoing| {
            fifo_headers(args, m, 1, &mut FieldTable::new())
                .err()
                .map(|e| e.code)
        };
        let none = fifo_args(false, false);
        assert_eq!(
            refused(&none, &message(None, Some("x"), None)),
            Some("MissingParameter")
        );
        assert_eq!(
            refused(&none, &message(Some("g"), None, None)),
            Some("InvalidParameterValue"),
            "no deduplication id and no content-based deduplication"
        );
        assert_eq!(
            refused(&none, &message(Some("g"), Some("x"), Some(5))),
            Some("InvalidParameterValue"),
            "a per-message delay"
        );
    }
}
