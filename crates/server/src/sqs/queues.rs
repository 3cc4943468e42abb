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
    }
    let visibility = DEFAULT_VISIBILITY.to_string();
    let retention = DEFAULT_RETENTION.to_string();
    for name in SETTABLE {
        let value = match (get(name), name) {
            (Some(v), _) => v,
            (None, "VisibilityTimeout") => &visibility,
            (None, "MessageRetentionPeriod") => &retention,
            (None, _) => continue,
        };
        put_attribute(&mut t, name, value, vhost)?;
    }
    Ok(t)
}

/// Sets in `t` the arguments that hold settable attribute `name` as `v` says (an argument
/// whose value is SQS's default is left out). `FifoQueue` is the caller's: it is fixed when
/// the queue is made.
fn put_attribute(t: &mut FieldTable, name: &str, v: &str, vhost: &str) -> Result<(), SqsError> {
    let ms = |s: u64| FieldValue::I64(i64::try_from(s.saturating_mul(1000)).unwrap_or(i64::MAX));
    let count = |n: u64| FieldValue::I64(i64::try_from(n).unwrap_or(i64::MAX));
    match name {
        "VisibilityTimeout" => {
            let visibility = seconds(name, v, 0..=43_200)?;
            t.remove("x-visibility-timeout");
            t.remove(ARG_VISIBILITY);
            if visibility > 0 {
                t.insert("x-visibility-timeout", ms(visibility));
            } else {
                t.insert(ARG_VISIBILITY, FieldValue::I64(0));
            }
        }
        "MessageRetentionPeriod" => {
            t.insert("x-message-ttl", ms(seconds(name, v, 60..=1_209_600)?));
        }
        "DelaySeconds" => {
            let d = seconds(name, v, 0..=900)?;
            t.remove("x-delivery-delay");
            if d > 0 {
                t.insert("x-delivery-delay", ms(d));
            }
        }
        "ReceiveMessageWaitTimeSeconds" => {
            let w = seconds(name, v, 0..=20)?;
            t.remove(ARG_WAIT);
            if w > 0 {
                t.insert(ARG_WAIT, count(w));
            }
        }
        "MaximumMessageSize" => {
            let m = seconds(name, v, 1024..=MAX_MESSAGE_SIZE)?;
            t.remove(ARG_MAX_SIZE);
            if m != MAX_MESSAGE_SIZE {
                t.insert(ARG_MAX_SIZE, count(m));
            }
        }
        "RedrivePolicy" => {
            let policy = if v.is_empty() {
                None
            } else {
                Some(redrive(v, vhost)?)
            };
            for k in [
                "x-dead-letter-exchange",
                "x-dead-letter-routing-key",
                "x-delivery-limit",
            ] {
                t.remove(k);
            }
            if let Some((dlq, count)) = policy {
                t.insert("x-dead-letter-exchange", FieldValue::long_str(""));
                t.insert("x-dead-letter-routing-key", FieldValue::long_str(&dlq));
                // SQS moves a message after maxReceiveCount receives; Warren's limit counts
                // the deliveries a message may have before the one that is not returned.
                t.insert("x-delivery-limit", FieldValue::I64(count as i64 - 1));
            }
        }
        "ContentBasedDeduplication" => {
            let on = one_of(name, v, &["true", "false"])? == "true";
            t.remove(ARG_CONTENT_DEDUP);
            if on {
                t.insert(ARG_CONTENT_DEDUP, FieldValue::Bool(true));
            }
        }
        "DeduplicationScope" => {
            let v = one_of(name, v, &["queue", "messageGroup"])?;
            t.insert(ARG_DEDUP_SCOPE, FieldValue::long_str(v));
        }
        "FifoThroughputLimit" => {
            let v = one_of(name, v, &["perQueue", "perMessageGroupId"])?;
            t.insert(ARG_THROUGHPUT, FieldValue::long_str(v));
        }
        _ => {}
    }
    Ok(())
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

/// A redrive policy's dead-letter queue must exist and be of the source's kind (FIFO or not).
fn check_redrive_target(
    n: &warren_session::Node,
    vhost: &str,
    args: &FieldTable,
) -> Result<(), SqsError> {
    if args
        .get("x-dead-letter-exchange")
        .and_then(FieldValue::as_str)
        != Some("")
    {
        return Ok(());
    }
    let Some(dlq) = args
        .get("x-dead-letter-routing-key")
        .and_then(FieldValue::as_str)
    else {
        return Ok(());
    };
    let Some(target) = n.broker().queue_snapshot(vhost, dlq) else {
        return Err(SqsError::invalid_parameter(format!(
            "Value for parameter RedrivePolicy is invalid. Reason: Dead letter target does not exist: {dlq}."
        )));
    };
    if is_fifo(&target.arguments) != is_fifo(args) {
        return Err(SqsError::invalid_parameter(
            "Value for parameter RedrivePolicy is invalid. Reason: Dead-letter queue must be same type of queue as the source.",
        ));
    }
    Ok(())
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

pub async fn create(
    sqs: &Sqs,
    ctx: &Ctx,
    input: &Map<String, Value>,
) -> Result<Map<String, Value>, SqsError> {
    let name = required(input, "QueueName")?.to_owned();
    let attrs = attribute_map(input)?;
    check_name(&name, fifo_asked(&attrs)?)?;
    let vhost = ctx.vhost.clone();
    let mut args = arguments(&attrs, &vhost)?;
    let tags = tags_given(input, "tags")?;
    if !tags.is_empty() {
        put_tags(&mut args, &tags, &[])?;
    }
    let declared = sqs
        .node
        .write_async(|n, _| {
            ctx.permit(
                n.broker().access(),
                &vhost,
                &[(Perm::Configure, Resource::Queue(&name))],
            )?;
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
                return Ok(None);
            }
            check_redrive_target(n, &vhost, &args)?;
            let req = DeclareQueue {
                name: ShortStr::try_from_str(&name)
                    .map_err(|_| SqsError::invalid_parameter("queue name too long"))?,
                passive: false,
                durable: true,
                exclusive: false,
                auto_delete: false,
                arguments: args.clone(),
            };
            n.broker_mut()
                .declare_queue_as(&vhost, req, API_CONN, Some(&ctx.user))
                .map(Some)
                .map_err(amqp)
        })
        .await??;
    if let Some(warren_broker::Declared::Waiting(ticket)) = declared {
        // A quorum queue in a cluster: made once the metadata log has it.
        sqs.node.declared(ticket).await.map_err(amqp)?;
    }
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
        Ok::<_, SqsError>(dead_letter_sources_of(n, &vhost, &name))
    })?;
    url_page(ctx, &vhost, sources, input, "queueUrls")
}

/// The queues of `vhost` that dead-letter to `dlq` through the default exchange (a
/// `RedrivePolicy`, or those AMQP arguments).
pub fn dead_letter_sources_of(n: &warren_session::Node, vhost: &str, dlq: &str) -> Vec<String> {
    n.broker()
        .queue_snapshots(Some(vhost))
        .into_iter()
        .filter(|q| {
            let arg = |k: &str| q.arguments.get(k).and_then(FieldValue::as_str);
            arg("x-dead-letter-exchange") == Some("")
                && arg("x-dead-letter-routing-key") == Some(dlq)
                && q.name.as_str() != dlq
        })
        .map(|q| q.name.to_string())
        .collect()
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

pub async fn delete(
    sqs: &Sqs,
    ctx: &Ctx,
    input: &Map<String, Value>,
) -> Result<Map<String, Value>, SqsError> {
    let (vhost, name) = queue_of(input)?;
    sqs.node
        .write_async(|n, _| {
            super::permitted_queue(n, ctx, &vhost, &name, Perm::Configure)?;
            n.delete_queue(&vhost, &name, (false, false))
                .map(|_| ())
                .map_err(amqp)
        })
        .await??;
    tracing::info!(vhost = %vhost, queue = %name, user = %ctx.user, "SQS DeleteQueue");
    Ok(Map::new())
}

pub async fn purge(
    sqs: &Sqs,
    ctx: &Ctx,
    input: &Map<String, Value>,
) -> Result<Map<String, Value>, SqsError> {
    let (vhost, name) = queue_of(input)?;
    sqs.node
        .write_async(|n, _| {
            super::permitted_queue(n, ctx, &vhost, &name, Perm::Read)?;
            n.broker_mut()
                .purge_queue(&vhost, &name, API_CONN)
                .map(|_| ())
                .map_err(amqp)
        })
        .await??;
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

/// SetQueueAttributes: the queue's arguments change in place (its messages and consumers
/// stay), and it acts on them from then on as a policy change would make it: a lower
/// retention period expires what is due now, a new redrive policy counts the receives its
/// messages already had. Arguments that SQS has no attribute for are kept.
pub async fn set_attributes(
    sqs: &Sqs,
    ctx: &Ctx,
    input: &Map<String, Value>,
) -> Result<Map<String, Value>, SqsError> {
    let (vhost, name) = queue_of(input)?;
    let attrs = attribute_map(input)?;
    change_arguments(sqs, ctx, &vhost, &name, |args| {
        let fifo = is_fifo(args);
        for (k, v) in &attrs {
            let k = k.as_str();
            if k == "FifoQueue" {
                if (v == "true") != fifo {
                    return Err(SqsError::invalid_attribute_value(
                        "FifoQueue cannot be changed once a queue is created.",
                    ));
                }
                continue;
            }
            let fifo_only =
                FIFO_ONLY.contains(&k) && !(k == "ContentBasedDeduplication" && v == "false");
            if !(SETTABLE.contains(&k) || IGNORED.contains(&k)) || (!fifo && fifo_only) {
                return Err(SqsError::invalid_attribute_name(k));
            }
        }
        for (k, v) in &attrs {
            put_attribute(args, k, v, &vhost)?;
        }
        Ok(())
    })
    .await
}

/// Changes the arguments of `vhost`'s queue `name` with `change` (which refuses what it
/// cannot make), as the request's user, once the store has the change.
async fn change_arguments(
    sqs: &Sqs,
    ctx: &Ctx,
    vhost: &str,
    name: &str,
    change: impl FnOnce(&mut FieldTable) -> Result<(), SqsError>,
) -> Result<Map<String, Value>, SqsError> {
    sqs.node
        .write_async(|n, _| {
            super::permitted_queue(n, ctx, vhost, name, Perm::Configure)?;
            let snap = n
                .broker()
                .queue_snapshot(vhost, name)
                .ok_or_else(SqsError::no_queue)?;
            let mut args = snap.arguments.detached();
            change(&mut args)?;
            check_redrive_target(n, vhost, &args)?;
            n.broker_mut()
                .set_queue_arguments(vhost, name, args, Some(&ctx.user))
                .map_err(amqp)
        })
        .await??;
    tracing::info!(vhost, queue = name, user = %ctx.user, "SQS queue attributes changed");
    Ok(Map::new())
}

/// The argument that keeps a queue's SQS tags: a table of key -> value.
pub const ARG_TAGS: &str = "x-sqs-tags";

/// SQS's quotas on tags: keys of 1 to 128 characters (and, for Warren, at most 255 bytes:
/// a field-table key), values of at most 256, 50 tags a queue.
const MAX_TAGS: usize = 50;
const MAX_TAG_KEY: usize = 128;
const MAX_TAG_VALUE: usize = 256;

/// The tags a request gives under `key` (a map of key -> value), checked.
fn tags_given(input: &Map<String, Value>, key: &str) -> Result<Vec<(String, String)>, SqsError> {
    let Some(v) = input.get(key) else {
        return Ok(Vec::new());
    };
    let m = v
        .as_object()
        .ok_or_else(|| SqsError::invalid_parameter("Tags must be a map of keys to values."))?;
    m.iter()
        .map(|(k, v)| {
            let v = v.as_str().ok_or_else(|| {
                SqsError::invalid_parameter(format!("The value of tag {k} must be a string."))
            })?;
            let chars = k.chars().count();
            if chars == 0 || chars > MAX_TAG_KEY || k.len() > 255 {
                return Err(SqsError::invalid_parameter(format!(
                    "Tag key must be between 1 and {MAX_TAG_KEY} characters: {k}"
                )));
            }
            if k.starts_with("aws:") {
                return Err(SqsError::invalid_parameter(format!(
                    "Tag keys starting with aws: are reserved: {k}"
                )));
            }
            if v.chars().count() > MAX_TAG_VALUE {
                return Err(SqsError::invalid_parameter(format!(
                    "Tag value must be at most {MAX_TAG_VALUE} characters (tag {k})."
                )));
            }
            Ok((k.clone(), v.to_owned()))
        })
        .collect()
}

/// A queue's tags, from its arguments.
fn tags_of(args: &FieldTable) -> Map<String, Value> {
    args.get(ARG_TAGS)
        .and_then(FieldValue::as_table)
        .map(|t| {
            t.iter()
                .filter_map(|(k, v)| Some((k.to_string(), Value::String(v.as_str()?.to_owned()))))
                .collect()
        })
        .unwrap_or_default()
}

/// Adds `add` to the tags kept in `args` (a key given again takes the new value) and takes
/// `remove` away; at most [`MAX_TAGS`] may be left.
fn put_tags(
    args: &mut FieldTable,
    add: &[(String, String)],
    remove: &[String],
) -> Result<(), SqsError> {
    let mut tags: Vec<(String, String)> = tags_of(args)
        .into_iter()
        .filter_map(|(k, v)| Some((k, v.as_str()?.to_owned())))
        .filter(|(k, _)| !remove.contains(k))
        .collect();
    for (k, v) in add {
        match tags.iter_mut().find(|(t, _)| t == k) {
            Some(t) => t.1.clone_from(v),
            None => tags.push((k.clone(), v.clone())),
        }
    }
    if tags.len() > MAX_TAGS {
        return Err(SqsError::invalid_parameter(format!(
            "Too many tags: a queue has at most {MAX_TAGS}."
        )));
    }
    args.remove(ARG_TAGS);
    if !tags.is_empty() {
        let mut t = FieldTable::new();
        for (k, v) in tags {
            t.insert(
                ShortStr::try_from_str(&k)
                    .map_err(|_| SqsError::invalid_parameter("Tag key too long."))?,
                FieldValue::long_str(v),
            );
        }
        args.insert(ARG_TAGS, FieldValue::Table(t));
    }
    Ok(())
}

/// TagQueue: adds tags to a queue, or changes their values.
pub async fn tag(
    sqs: &Sqs,
    ctx: &Ctx,
    input: &Map<String, Value>,
) -> Result<Map<String, Value>, SqsError> {
    let (vhost, name) = queue_of(input)?;
    // The JSON protocol says `Tags`; the query protocol's `Tag.N.Key` arrives as `tags`.
    let mut add = tags_given(input, "Tags")?;
    add.extend(tags_given(input, "tags")?);
    if add.is_empty() {
        return Err(SqsError::missing_parameter("Tags"));
    }
    change_arguments(sqs, ctx, &vhost, &name, |args| put_tags(args, &add, &[])).await
}

/// UntagQueue: removes tags by key (a key the queue does not have is no error).
pub async fn untag(
    sqs: &Sqs,
    ctx: &Ctx,
    input: &Map<String, Value>,
) -> Result<Map<String, Value>, SqsError> {
    let (vhost, name) = queue_of(input)?;
    let keys = strings(input, "TagKeys");
    if keys.is_empty() {
        return Err(SqsError::missing_parameter("TagKeys"));
    }
    change_arguments(sqs, ctx, &vhost, &name, |args| put_tags(args, &[], &keys)).await
}

/// ListQueueTags: the queue's tags (`Tags` left out when it has none, as SQS answers).
pub fn list_tags(
    sqs: &Sqs,
    ctx: &Ctx,
    input: &Map<String, Value>,
) -> Result<Map<String, Value>, SqsError> {
    let (vhost, name) = queue_of(input)?;
    let args = sqs.node.read(|n, _| {
        super::permitted_queue(n, ctx, &vhost, &name, Perm::Read)?;
        n.broker()
            .queue_snapshot(&vhost, &name)
            .map(|s| s.arguments)
            .ok_or_else(SqsError::no_queue)
    })?;
    let tags = tags_of(&args);
    let mut out = Map::new();
    if !tags.is_empty() {
        out.insert("Tags".into(), Value::Object(tags));
    }
    Ok(out)
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
