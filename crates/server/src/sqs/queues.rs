//! The queue actions, and SQS's queue attributes as Warren's queue arguments.

use serde_json::{json, Map, Value};
use warren_broker::access::{Perm, Resource};
use warren_broker::DeclareQueue;
use warren_codec::{AmqpError, FieldTable, FieldValue, ReplyCode, ShortStr};
use warren_session::manage::API_CONN;

use super::{integer, queue_of, required, strings, text, Ctx, Sqs, SqsError};

/// SQS's defaults (seconds, bytes).
pub const DEFAULT_VISIBILITY: u64 = 30;
pub const DEFAULT_RETENTION: u64 = 345_600;
pub const MAX_MESSAGE_SIZE: u64 = 262_144;

/// Warren's queue arguments for what SQS has and Warren's queues do not: kept with the
/// queue, read back by the SQS endpoint.
pub const ARG_WAIT: &str = "x-sqs-receive-wait-time-seconds";
pub const ARG_MAX_SIZE: &str = "x-sqs-maximum-message-size";
/// A visibility timeout of 0 (`x-visibility-timeout` must be positive).
pub const ARG_VISIBILITY: &str = "x-sqs-visibility-timeout";

/// A FIFO queue is a queue with message groups (`x-group-header`) on this header, which
/// holds a message's `MessageGroupId`, and deduplication (`x-message-deduplication`) on
/// [`DEDUP_KEY_HEADER`] over SQS's five minutes.
pub const GROUP_HEADER: &str = "x-sqs-message-group-id";
/// What a FIFO queue deduplicates on: the deduplication id, prefixed by the group when the
/// queue's `DeduplicationScope` is `messageGroup`.
pub const DEDUP_KEY_HEADER: &str = "x-sqs-deduplication-key";
/// A FIFO message's `MessageDeduplicationId`, as given or computed from its body.
pub const DEDUP_ID_HEADER: &str = "x-sqs-message-deduplication-id";
pub const ARG_CONTENT_DEDUP: &str = "x-sqs-content-based-deduplication";
pub const ARG_DEDUP_SCOPE: &str = "x-sqs-deduplication-scope";
pub const ARG_THROUGHPUT: &str = "x-sqs-fifo-throughput-limit";
/// SQS's deduplication interval.
const DEDUP_WINDOW_MS: i64 = 300_000;
/// Keys a FIFO queue remembers (Warren's largest `x-cache-size`): SQS has no such limit, and
/// keys only cost memory once used.
const DEDUP_KEYS: i64 = 1_000_000;

/// Is this queue (by its arguments) one of SQS's FIFO queues?
pub fn is_fifo(args: &FieldTable) -> bool {
    args.get("x-group-header").and_then(FieldValue::as_str) == Some(GROUP_HEADER)
}

/// The attributes SQS lets CreateQueue set.
const SETTABLE: [&str; 10] = [
    "VisibilityTimeout",
    "MessageRetentionPeriod",
    "DelaySeconds",
    "ReceiveMessageWaitTimeSeconds",
    "MaximumMessageSize",
    "RedrivePolicy",
    "FifoQueue",
    "ContentBasedDeduplication",
    "DeduplicationScope",
    "FifoThroughputLimit",
];

/// The attributes only a FIFO queue has.
const FIFO_ONLY: [&str; 3] = [
    "ContentBasedDeduplication",
    "DeduplicationScope",
    "FifoThroughputLimit",
];

/// Accepted and without effect: encryption and access policies are AWS's.
const IGNORED: [&str; 5] = [
    "SqsManagedSseEnabled",
    "KmsMasterKeyId",
    "KmsDataKeyReusePeriodSeconds",
    "Policy",
    "RedriveAllowPolicy",
];

/// A queue name as SQS allows it: 1 to 80 letters, digits, `-` and `_`, and for a FIFO
/// queue (`FifoQueue` true) the `.fifo` suffix, counted in the 80.
fn check_name(name: &str, fifo: bool) -> Result<(), SqsError> {
    let base = if fifo {
        name.strip_suffix(".fifo")
    } else {
        Some(name)
    };
    let ok = base.is_some_and(|b| {
        !b.is_empty()
            && name.len() <= 80
            && b.bytes()
                .all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_')
    });
    match (ok, fifo) {
        (true, _) => Ok(()),
        (false, true) => Err(SqsError::invalid_parameter(
            "The name of a FIFO queue can only include alphanumeric characters, hyphens, or underscores, must end with .fifo suffix and be 1 to 80 in length.",
        )),
        (false, false) => Err(SqsError::invalid_parameter(
            "Can only include alphanumeric characters, hyphens, or underscores. 1 to 80 in length",
        )),
    }
}

/// Does CreateQueue ask for a FIFO queue (`FifoQueue` true)?
fn fifo_asked(attrs: &[(String, String)]) -> Result<bool, SqsError> {
    match attrs
        .iter()
        .find(|(k, _)| k == "FifoQueue")
        .map(|(_, v)| v.as_str())
    {
        None | Some("false") => Ok(false),
        Some("true") => Ok(true),
        Some(v) => Err(SqsError::invalid_attribute_value(format!(
            "Invalid value for the parameter FifoQueue: {v}."
        ))),
    }
}

/// The value of one of the FIFO attributes that take a word.
fn one_of<'a>(name: &str, v: &'a str, allowed: &[&str]) -> Result<&'a str, SqsError> {
    allowed.contains(&v).then_some(v).ok_or_else(|| {
        SqsError::invalid_attribute_value(format!("Invalid value for the parameter {name}."))
    })
}

/// The attributes map of a request (`{"Name": "value"}`).
fn attribute_map(input: &Map<String, Value>) -> Result<Vec<(String, String)>, SqsError> {
    let Some(v) = input.get("Attributes") else {
        return Ok(Vec::new());
    };
    let m = v
        .as_object()
        .ok_or_else(|| SqsError::invalid_parameter("Attributes must be a map."))?;
    m.iter()
        .map(|(k, v)| match v {
            Value::String(s) => Ok((k.clone(), s.clone())),
            Value::Number(n) => Ok((k.clone(), n.to_string())),
            _ => Err(SqsError::invalid_attribute_value(format!(
                "Invalid value for the parameter {k}."
            ))),
        })
        .collect()
}

fn seconds(name: &str, v: &str, range: std::ops::RangeInclusive<u64>) -> Result<u64, SqsError> {
    v.trim()
        .parse::<u64>()
        .ok()
        .filter(|n| range.contains(n))
        .ok_or_else(|| {
            SqsError::invalid_attribute_value(format!("Invalid value for the parameter {name}."))
        })
}

/// The redrive policy's dead-letter queue (in `vhost`) and maxReceiveCount.
fn redrive(v: &str, vhost: &str) -> Result<(String, u64), SqsError> {
    let bad = || {
        SqsError::invalid_attribute_value(format!(
            "Value {v} for parameter RedrivePolicy is invalid."
        ))
    };
    let p: Value = serde_json::from_str(v).map_err(|_| bad())?;
    let arn = p
        .get("deadLetterTargetArn")
        .and_then(Value::as_str)
        .ok_or_else(bad)?;
    let count = match p.get("maxReceiveCount") {
        Some(Value::Number(n)) => n.as_u64(),
        Some(Value::String(s)) => s.parse().ok(),
        _ => None,
    }
    .filter(|n| (1..=1000).contains(n))
    .ok_or_else(bad)?;
    // arn:aws:sqs:<region>:<account>:<name>
    let parts: Vec<&str> = arn.splitn(6, ':').collect();
    let [_, _, "sqs", _, account, name] = parts.as_slice() else {
        return Err(bad());
    };
    if super::vhost_of(account) != vhost {
        return Err(SqsError::invalid_attribute_value(
            "The dead-letter queue must be in the same vhost (account) as the queue.",
        ));
    }
    Ok(((*name).to_owned(), count))
}

/// The queue arguments of CreateQueue's attributes (SQS's defaults for those not given).
fn arguments(attrs: &[(String, String)], vhost: &str) -> Result<FieldTable, SqsError> {
    let get = |k: &str| attrs.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
    let fifo = fifo_asked(attrs)?;
    for (k, v) in attrs {
        let known = SETTABLE.contains(&k.as_str()) || IGNORED.contains(&k.as_str());
        // Saying that a standard queue does not deduplicate is allowed (it was before FIFO
        // queues were built).
        let fifo_only =
            FIFO_ONLY.contains(&k.as_str()) && !(k == "ContentBasedDeduplication" && v == "false");
        if !known || (!fifo && fifo_only) {
            return Err(SqsError::invalid_attribute_name(k));
        }
    }
    let mut t = FieldTable::new();
    if fifo {
        t.insert("x-group-header", FieldValue::long_str(GROUP_HEADER));
        t.insert("x-message-deduplication", FieldValue::Bool(true));
        t.insert(
            "x-deduplication-header",
            FieldValue::long_str(DEDUP_KEY_HEADER),
        );
        t.insert("x-cache-ttl", FieldValue::I64(DEDUP_WINDOW_MS));
        t.insert("x-cache-size", FieldValue::I64(DEDUP_KEYS));
        let content = get("ContentBasedDeduplication")
            .map(|v| one_of("ContentBasedDeduplication", v, &["true", "false"]))
            .transpose()?;
        if content == Some("true") {
            t.insert(ARG_CONTENT_DEDUP, FieldValue::Bool(true));
        }
        if let Some(v) = get("DeduplicationScope") {
            let v = one_of("DeduplicationScope", v, &["queue", "messageGroup"])?;
            t.insert(ARG_DEDUP_SCOPE, FieldValue::long_str(v));
        }
        if let Some(v) = get("FifoThroughputLimit") {
            let v = one_of("FifoThroughputLimit", v, &["perQueue", "perMessageGroupId"])?;
            t.insert(ARG_THROUGHPUT, FieldValue::long_str(v));
        }
    }
    let ms = |s: u64| FieldValue::I64(i64::try_from(s.saturating_mul(1000)).unwrap_or(i64::MAX));
    let visibility = get("VisibilityTimeout")
        .map(|v| seconds("VisibilityTimeout", v, 0..=43_200))
        .transpose()?
        .unwrap_or(DEFAULT_VISIBILITY);
    if visibility > 0 {
        t.insert("x-visibility-timeout", ms(visibility));
    } else {
        t.insert(ARG_VISIBILITY, FieldValue::I64(0));
    }
    let retention = get("MessageRetentionPeriod")
        .map(|v| seconds("MessageRetentionPeriod", v, 60..=1_209_600))
        .transpose()?
        .unwrap_or(DEFAULT_RETENTION);
    t.insert("x-message-ttl", ms(retention));
    if let Some(v) = get("DelaySeconds") {
        let d = seconds("DelaySeconds", v, 0..=900)?;
        if d > 0 {
            t.insert("x-delivery-delay", ms(d));
        }
    }
    if let Some(v) = get("ReceiveMessageWaitTimeSeconds") {
        let w = seconds("ReceiveMessageWaitTimeSeconds", v, 0..=20)?;
        if w > 0 {
            t.insert(ARG_WAIT, FieldValue::I64(w as i64));
        }
    }
    if let Some(v) = get("MaximumMessageSize") {
        let m = seconds("MaximumMessageSize", v, 1024..=MAX_MESSAGE_SIZE)?;
        if m != MAX_MESSAGE_SIZE {
            t.insert(ARG_MAX_SIZE, FieldValue::I64(m as i64));
        }
    }
    if let Some(v) = get("RedrivePolicy") {
        if !v.is_empty() {
            let (dlq, count) = redrive(v, vhost)?;
            t.insert("x-dead-letter-exchange", FieldValue::long_str(""));
            t.insert("x-dead-letter-routing-key", FieldValue::long_str(&dlq));
            // SQS moves a message after maxReceiveCount receives; Warren's limit counts
            // the deliveries a message may have before the one that is not returned.
            t.insert("x-delivery-limit", FieldValue::I64(count as i64 - 1));
        }
    }
    Ok(t)
}

fn int_arg(args: &FieldTable, k: &str) -> Option<i64> {
    args.get(k).and_then(FieldValue::as_i64)
}

/// The queue's SQS attributes, as strings, from its arguments.
fn configured(args: &FieldTable, ctx: &Ctx, vhost: &str) -> Vec<(&'static str, String)> {
    let secs = |k: &str| int_arg(args, k).map(|ms| (ms / 1000).max(0));
    let visibility = secs("x-visibility-timeout")
        .or_else(|| int_arg(args, ARG_VISIBILITY))
        .unwrap_or(DEFAULT_VISIBILITY as i64);
    let mut out = vec![
        ("VisibilityTimeout", visibility.to_string()),
        (
            "MessageRetentionPeriod",
            // Warren keeps messages without a TTL until they are consumed; SQS has no such
            // setting, and its longest is 14 days.
            secs("x-message-ttl").unwrap_or(1_209_600).to_string(),
        ),
        (
            "DelaySeconds",
            secs("x-delivery-delay").unwrap_or(0).to_string(),
        ),
        (
            "ReceiveMessageWaitTimeSeconds",
            int_arg(args, ARG_WAIT).unwrap_or(0).to_string(),
        ),
        (
            "MaximumMessageSize",
            int_arg(args, ARG_MAX_SIZE)
                .unwrap_or(MAX_MESSAGE_SIZE as i64)
                .to_string(),
        ),
        ("SqsManagedSseEnabled", "false".to_owned()),
    ];
    if is_fifo(args) {
        let word = |k: &str, default: &str| {
            args.get(k)
                .and_then(FieldValue::as_str)
                .unwrap_or(default)
                .to_owned()
        };
        let content = args.get(ARG_CONTENT_DEDUP).and_then(FieldValue::as_bool) == Some(true);
        out.extend([
            ("FifoQueue", "true".to_owned()),
            ("ContentBasedDeduplication", content.to_string()),
            ("DeduplicationScope", word(ARG_DEDUP_SCOPE, "queue")),
            ("FifoThroughputLimit", word(ARG_THROUGHPUT, "perQueue")),
        ]);
    }
    let dlx = args
        .get("x-dead-letter-exchange")
        .and_then(FieldValue::as_str);
    let dlk = args
        .get("x-dead-letter-routing-key")
        .and_then(FieldValue::as_str);
    if let (Some(""), Some(dlq), Some(limit)) = (dlx, dlk, int_arg(args, "x-delivery-limit")) {
        out.push((
            "RedrivePolicy",
            json!({"deadLetterTargetArn": ctx.arn(vhost, dlq), "maxReceiveCount": limit + 1})
                .to_string(),
        ));
    }
    out
}

/// The queue's current value of a settable attribute, as CreateQueue compares it.
fn same_value(name: &str, given: &str, current: &[(&'static str, String)]) -> bool {
    let Some((_, now)) = current.iter().find(|(k, _)| *k == name) else {
        // An ignored attribute, or a redrive policy the queue does not have, or a standard
        // queue said not to be FIFO.
        return !SETTABLE.contains(&name)
            || given.is_empty()
            || (matches!(name, "FifoQueue" | "ContentBasedDeduplication") && given == "false");
    };
    if name == "RedrivePolicy" {
        let parse = |s: &str| -> Option<(String, u64)> {
            let v: Value = serde_json::from_str(s).ok()?;
            let arn = v.get("deadLetterTargetArn")?.as_str()?;
            let name = arn.rsplit(':').next()?.to_owned();
            let n = match v.get("maxReceiveCount")? {
                Value::Number(n) => n.as_u64()?,
                Value::String(s) => s.parse().ok()?,
                _ => return None,
            };
            Some((name, n))
        };
        return parse(given).is_some() && parse(given) == parse(now);
    }
    given.trim() == now
}

pub fn amqp(e: AmqpError) -> SqsError {
    match e.code {
        ReplyCode::NotFound => SqsError::no_queue(),
        ReplyCode::AccessRefused => SqsError::access_denied(e.text),
        ReplyCode::PreconditionFailed | ReplyCode::ResourceLocked => {
            SqsError::invalid_parameter(e.text)
        }
        _ => SqsError::internal(format!("{} {}", e.code.name(), e.text)),
    }
}

pub fn create(
    sqs: &Sqs,
    ctx: &Ctx,
    input: &Map<String, Value>,
) -> Result<Map<String, Value>, SqsError> {
    let name = required(input, "QueueName")?.to_owned();
    let attrs = attribute_map(input)?;
    check_name(&name, fifo_asked(&attrs)?)?;
    let vhost = ctx.vhost.clone();
    let args = arguments(&attrs, &vhost)?;
    sqs.node.write(|n, _| {
        ctx.permit(n.broker().access(), &vhost, &[(Perm::Configure, Resource::Queue(&name))])?;
        if let Some(s) = n.broker().queue_snapshot(&vhost, &name) {
            let current = configured(&s.arguments, ctx, &vhost);
            let differ: Vec<&str> = attrs
                .iter()
                .filter(|(k, v)| !same_value(k, v, &current))
                .map(|(k, _)| k.as_str())
                .collect();
            if !differ.is_empty() {
                return Err(SqsError::queue_exists(&differ.join(", ")));
            }
            return Ok(());
        }
        if let Some(dlq) = args.get("x-dead-letter-routing-key").and_then(FieldValue::as_str) {
            let Some(target) = n.broker().queue_snapshot(&vhost, dlq) else {
                return Err(SqsError::invalid_parameter(format!(
                    "Value for parameter RedrivePolicy is invalid. Reason: Dead letter target does not exist: {dlq}."
                )));
            };
            if is_fifo(&target.arguments) != is_fifo(&args) {
                return Err(SqsError::invalid_parameter(
                    "Value for parameter RedrivePolicy is invalid. Reason: Dead-letter queue must be same type of queue as the source.",
                ));
            }
        }
        let req = DeclareQueue {
            name: ShortStr::try_from_str(&name).map_err(|_| SqsError::invalid_parameter("queue name too long"))?,
            passive: false,
            durable: true,
            exclusive: false,
            auto_delete: false,
            arguments: args.clone(),
        };
        n.broker_mut()
            .declare_queue_as(&vhost, req, API_CONN, Some(&ctx.user))
            .map(|_| ())
            .map_err(amqp)
    })??;
    tracing::info!(vhost = %vhost, queue = %name, user = %ctx.user, "SQS CreateQueue");
    let mut out = Map::new();
    out.insert(
        "QueueUrl".into(),
        Value::String(ctx.queue_url(&vhost, &name)),
    );
    Ok(out)
}

pub fn get_url(
    sqs: &Sqs,
    ctx: &Ctx,
    input: &Map<String, Value>,
) -> Result<Map<String, Value>, SqsError> {
    let name = required(input, "QueueName")?.to_owned();
    let vhost = match text(input, "QueueOwnerAWSAccountId")? {
        Some(a) => super::vhost_of(a),
        None => ctx.vhost.clone(),
    };
    sqs.node.read(|n, _| {
        ctx.permit(n.broker().access(), &vhost, &[])?;
        n.broker()
            .queue_id(&vhost, &name)
            .map(|_| ())
            .ok_or_else(SqsError::no_queue)
    })?;
    let mut out = Map::new();
    out.insert(
        "QueueUrl".into(),
        Value::String(ctx.queue_url(&vhost, &name)),
    );
    Ok(out)
}

pub fn list(
    sqs: &Sqs,
    ctx: &Ctx,
    input: &Map<String, Value>,
) -> Result<Map<String, Value>, SqsError> {
    let prefix = text(input, "QueueNamePrefix")?
        .unwrap_or_default()
        .to_owned();
    let vhost = ctx.vhost.clone();
    let names: Vec<String> = sqs.node.read(|n, _| {
        ctx.permit(n.broker().access(), &vhost, &[])?;
        Ok::<_, SqsError>(
            n.broker()
                .queues(&vhost)
                .into_iter()
                .map(|q| q.name.to_string())
                .filter(|q| q.starts_with(&prefix))
                .collect(),
        )
    })?;
    let mut out = url_page(ctx, &vhost, names, input, "QueueUrls")?;
    if out
        .get("QueueUrls")
        .and_then(Value::as_array)
        .is_some_and(Vec::is_empty)
    {
        // SQS leaves an empty list out of ListQueues' answer.
        out.remove("QueueUrls");
    }
    Ok(out)
}

/// One page of queue `names` as URLs under `key`, in name order: those after the request's
/// `NextToken`, at most its `MaxResults` (the first 1,000 without it, as SQS answers), with
/// the `NextToken` of the next page when `MaxResults` was given and more are left.
fn url_page(
    ctx: &Ctx,
    vhost: &str,
    mut names: Vec<String>,
    input: &Map<String, Value>,
    key: &str,
) -> Result<Map<String, Value>, SqsError> {
    let max = integer(input, "MaxResults", 1..=1000)?;
    let after = next_token(input)?;
    names.sort();
    if let Some(a) = &after {
        names.retain(|q| q > a);
    }
    let limit = max.map_or(1000, |m| m as usize);
    let more = names.len() > limit;
    names.truncate(limit);
    let mut out = Map::new();
    out.insert(
        key.into(),
        names
            .iter()
            .map(|q| Value::String(ctx.queue_url(vhost, q)))
            .collect(),
    );
    if more && max.is_some() {
        if let Some(last) = names.last() {
            out.insert("NextToken".into(), Value::String(token_of(last)));
        }
    }
    Ok(out)
}

/// ListDeadLetterSourceQueues: the queues of the vhost whose redrive policy names this one
/// (dead-lettering through the default exchange to it, as a RedrivePolicy is kept), in name
/// order, `MaxResults` at a time.
pub fn dead_letter_sources(
    sqs: &Sqs,
    ctx: &Ctx,
    input: &Map<String, Value>,
) -> Result<Map<String, Value>, SqsError> {
    let (vhost, name) = queue_of(input)?;
    let sources: Vec<String> = sqs.node.read(|n, _| {
        ctx.permit(n.broker().access(), &vhost, &[])?;
        n.broker()
            .queue_id(&vhost, &name)
            .ok_or_else(SqsError::no_queue)?;
        Ok::<_, SqsError>(
            n.broker()
                .queue_snapshots(Some(&vhost))
                .into_iter()
                .filter(|q| {
                    let arg = |k: &str| q.arguments.get(k).and_then(FieldValue::as_str);
                    arg("x-dead-letter-exchange") == Some("")
                        && arg("x-dead-letter-routing-key") == Some(name.as_str())
                        && q.name.as_str() != name
                })
                .map(|q| q.name.to_string())
                .collect(),
        )
    })?;
    url_page(ctx, &vhost, sources, input, "queueUrls")
}

/// A list's NextToken: the last name given, encoded.
fn token_of(last: &str) -> String {
    base64::Engine::encode(&base64::engine::general_purpose::URL_SAFE_NO_PAD, last)
}

/// The name a NextToken stands for.
fn next_token(input: &Map<String, Value>) -> Result<Option<String>, SqsError> {
    match text(input, "NextToken")? {
        Some(t) => Ok(Some(
            base64::Engine::decode(&base64::engine::general_purpose::URL_SAFE_NO_PAD, t)
                .ok()
                .and_then(|b| String::from_utf8(b).ok())
                .ok_or_else(|| SqsError::invalid_parameter("Invalid NextToken value."))?,
        )),
        None => Ok(None),
    }
}

pub fn delete(
    sqs: &Sqs,
    ctx: &Ctx,
    input: &Map<String, Value>,
) -> Result<Map<String, Value>, SqsError> {
    let (vhost, name) = queue_of(input)?;
    sqs.node.write(|n, _| {
        super::permitted_queue(n, ctx, &vhost, &name, Perm::Configure)?;
        n.delete_queue(&vhost, &name, (false, false))
            .map(|_| ())
            .map_err(amqp)
    })??;
    tracing::info!(vhost = %vhost, queue = %name, user = %ctx.user, "SQS DeleteQueue");
    Ok(Map::new())
}

pub fn purge(
    sqs: &Sqs,
    ctx: &Ctx,
    input: &Map<String, Value>,
) -> Result<Map<String, Value>, SqsError> {
    let (vhost, name) = queue_of(input)?;
    sqs.node.write(|n, _| {
        super::permitted_queue(n, ctx, &vhost, &name, Perm::Read)?;
        n.broker_mut()
            .purge_queue(&vhost, &name, API_CONN)
            .map(|_| ())
            .map_err(amqp)
    })??;
    Ok(Map::new())
}

pub fn get_attributes(
    sqs: &Sqs,
    ctx: &Ctx,
    input: &Map<String, Value>,
) -> Result<Map<String, Value>, SqsError> {
    let (vhost, name) = queue_of(input)?;
    let wanted = strings(input, "AttributeNames");
    let snap = sqs.node.read(|n, _| {
        ctx.permit(n.broker().access(), &vhost, &[])?;
        n.broker()
            .queue_snapshot(&vhost, &name)
            .ok_or_else(SqsError::no_queue)
    })?;
    let mut all: Vec<(&'static str, String)> = vec![
        ("ApproximateNumberOfMessages", snap.ready.to_string()),
        (
            "ApproximateNumberOfMessagesNotVisible",
            snap.unacked.to_string(),
        ),
        // Messages waiting for a retry's back-off; those held by a delay are not counted
        // (Warren's queues do not count them either).
        (
            "ApproximateNumberOfMessagesDelayed",
            snap.retrying.to_string(),
        ),
        ("QueueArn", ctx.arn(&vhost, &name)),
    ];
    all.extend(configured(&snap.arguments, ctx, &vhost));
    let take_all = wanted.iter().any(|w| w == "All");
    let known: Vec<&str> = all.iter().map(|(k, _)| *k).collect();
    for w in &wanted {
        let fine = w == "All"
            || known.contains(&w.as_str())
            || [
                "CreatedTimestamp",
                "LastModifiedTimestamp",
                "Policy",
                "RedrivePolicy",
                "RedriveAllowPolicy",
                "KmsMasterKeyId",
                "KmsDataKeyReusePeriodSeconds",
                "FifoQueue",
                "ContentBasedDeduplication",
                "DeduplicationScope",
                "FifoThroughputLimit",
            ]
            .contains(&w.as_str());
        if !fine {
            return Err(SqsError::invalid_attribute_name(w));
        }
    }
    let attrs: Map<String, Value> = all
        .into_iter()
        .filter(|(k, _)| take_all || wanted.iter().any(|w| w == k))
        .map(|(k, v)| (k.to_owned(), Value::String(v)))
        .collect();
    let mut out = Map::new();
    if !attrs.is_empty() {
        out.insert("Attributes".into(), Value::Object(attrs));
    }
    Ok(out)
}

/// SetQueueAttributes: Warren changes a queue's arguments only by declaring it again, which
/// SQS clients cannot do; this round it accepts the values the queue already has (and the
/// ignored ones), and refuses a change with a message that says so.
pub fn set_attributes(
    sqs: &Sqs,
    ctx: &Ctx,
    input: &Map<String, Value>,
) -> Result<Map<String, Value>, SqsError> {
    let (vhost, name) = queue_of(input)?;
    let attrs = attribute_map(input)?;
    let snap = sqs.node.read(|n, _| {
        ctx.permit(
            n.broker().access(),
            &vhost,
            &[(Perm::Configure, Resource::Queue(&name))],
        )?;
        n.broker()
            .queue_snapshot(&vhost, &name)
            .ok_or_else(SqsError::no_queue)
    })?;
    let current = configured(&snap.arguments, ctx, &vhost);
    for (k, v) in &attrs {
        if !SETTABLE.contains(&k.as_str()) && !IGNORED.contains(&k.as_str()) {
            return Err(SqsError::invalid_attribute_name(k));
        }
        if !same_value(k, v, &current) {
            return Err(SqsError::invalid_attribute_value(format!(
                "Warren cannot change {k} of an existing queue yet: delete and create the queue with the new value."
            )));
        }
    }
    Ok(Map::new())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx() -> Ctx {
        Ctx {
            user: "guest".into(),
            region: "us-east-1".into(),
            base: "http://localhost:9324".into(),
            vhost: "/".into(),
        }
    }

    #[test]
    fn attributes_become_arguments_and_back() {
        let attrs = vec![
            ("VisibilityTimeout".to_string(), "45".to_string()),
            ("DelaySeconds".to_string(), "5".to_string()),
            (
                "RedrivePolicy".to_string(),
                r#"{"deadLetterTargetArn":"arn:aws:sqs:us-east-1:000000000000:dlq","maxReceiveCount":"3"}"#.to_string(),
            ),
        ];
        let args = arguments(&attrs, "/").expect("valid");
        assert_eq!(int_arg(&args, "x-visibility-timeout"), Some(45_000));
        assert_eq!(int_arg(&args, "x-delivery-delay"), Some(5_000));
        assert_eq!(int_arg(&args, "x-message-ttl"), Some(345_600_000));
        assert_eq!(int_arg(&args, "x-delivery-limit"), Some(2));
        let back = configured(&args, &ctx(), "/");
        for (k, v) in &attrs {
            assert!(same_value(k, v, &back), "{k}");
        }
        assert!(!same_value("VisibilityTimeout", "46", &back));
    }

    #[test]
    fn bad_attributes_are_refused() {
        let one = |k: &str, v: &str| arguments(&[(k.to_string(), v.to_string())], "/");
        assert!(one("VisibilityTimeout", "43201").is_err());
        assert!(one("Nonsense", "1").is_err());
        assert!(
            one("ContentBasedDeduplication", "true").is_err(),
            "a FIFO attribute on a standard queue"
        );
        assert!(one("RedrivePolicy", "{}").is_err());
        // A dead-letter queue of another vhost.
        assert!(one(
            "RedrivePolicy",
            r#"{"deadLetterTargetArn":"arn:aws:sqs:r:other:dlq","maxReceiveCount":1}"#
        )
        .is_err());
        assert!(check_name("jobs-1_a", false).is_ok());
        assert!(
            check_name("jobs.fifo", false).is_err(),
            "a standard queue named .fifo"
        );
        assert!(
            check_name("jobs", true).is_err(),
            "a FIFO queue without the suffix"
        );
        assert!(check_name("jobs.fifo", true).is_ok());
        assert!(check_name(".fifo", true).is_err());
        assert!(check_name("a b", false).is_err());
    }

    #[test]
    fn a_fifo_queue_has_groups_and_a_five_minute_deduplication() {
        let attrs = vec![
            ("FifoQueue".to_string(), "true".to_string()),
            ("ContentBasedDeduplication".to_string(), "true".to_string()),
            ("DeduplicationScope".to_string(), "messageGroup".to_string()),
        ];
        let args = arguments(&attrs, "/").expect("valid");
        assert!(is_fifo(&args));
        assert_eq!(int_arg(&args, "x-cache-ttl"), Some(300_000));
        assert_eq!(
            args.get("x-message-deduplication"),
            Some(&FieldValue::Bool(true))
        );
        let back = configured(&args, &ctx(), "/");
        for (k, v) in &attrs {
            assert!(same_value(k, v, &back), "{k}");
        }
        assert!(same_value("FifoThroughputLimit", "perQueue", &back));
        assert!(!same_value("ContentBasedDeduplication", "false", &back));
        let standard = configured(&arguments(&[], "/").expect("valid"), &ctx(), "/");
        assert!(same_value("FifoQueue", "false", &standard));
        assert!(!same_value("FifoQueue", "true", &standard));
        let bad = vec![
            ("FifoQueue".to_string(), "true".to_string()),
            ("DeduplicationScope".to_string(), "everything".to_string()),
        ];
        assert!(arguments(&bad, "/").is_err());
    }
}
