//! Queue `x-` arguments: validation, equivalence and the parsed form.
//!
//! Mirrors RabbitMQ 3.10's `rabbit_amqqueue:declare_args/0`: the same keys, checked in the
//! same order, with the same error terms (printed as Erlang's `~p` would), and the same set
//! of keys compared when a queue is redeclared.

use warren_codec::{AmqpError, FieldTable, FieldValue};

use crate::erl;

/// The largest TTL / expiry RabbitMQ 3.10 accepts (ms): ten years.
pub const MAX_EXPIRY_MS: i64 = 315_360_000_000;
/// `?MAX_SUPPORTED_PRIORITY`.
pub const MAX_PRIORITY: i64 = 255;

/// Every queue argument RabbitMQ 3.10 knows, in its `declare_args/0` order: values are
/// validated, and a redeclare compared, in this order.
pub const DECLARE_ARGS: [&str; 22] = [
    "x-expires",
    "x-message-ttl",
    "x-dead-letter-exchange",
    "x-dead-letter-routing-key",
    "x-dead-letter-strategy",
    "x-max-length",
    "x-max-length-bytes",
    "x-max-in-memory-length",
    "x-max-in-memory-bytes",
    "x-max-priority",
    "x-overflow",
    "x-queue-mode",
    "x-queue-version",
    "x-single-active-consumer",
    "x-queue-type",
    "x-quorum-initial-group-size",
    "x-max-age",
    "x-stream-max-segment-size-bytes",
    "x-initial-cluster-size",
    "x-queue-leader-locator",
    "x-queue-master-locator",
    "x-delivery-limit",
];

/// The arguments a classic queue accepts (RabbitMQ 3.10.8, measured).
const CLASSIC_ARGS: &[&str] = &[
    "x-expires",
    "x-message-ttl",
    "x-dead-letter-exchange",
    "x-dead-letter-routing-key",
    "x-max-length",
    "x-max-length-bytes",
    "x-max-priority",
    "x-overflow",
    "x-queue-mode",
    "x-queue-version",
    "x-single-active-consumer",
    "x-queue-type",
    "x-queue-master-locator",
    // Quorum queues' only in RabbitMQ 3.10; Warren acts on it for every queue.
    "x-delivery-limit",
];

/// The arguments a quorum queue accepts.
const QUORUM_ARGS: &[&str] = &[
    "x-expires",
    "x-message-ttl",
    "x-dead-letter-exchange",
    "x-dead-letter-routing-key",
    "x-dead-letter-strategy",
    "x-max-length",
    "x-max-length-bytes",
    "x-max-in-memory-length",
    "x-max-in-memory-bytes",
    "x-overflow",
    "x-single-active-consumer",
    "x-queue-type",
    "x-quorum-initial-group-size",
    "x-queue-leader-locator",
    "x-delivery-limit",
];

/// The arguments a stream accepts.
const STREAM_ARGS: &[&str] = &[
    "x-max-length-bytes",
    "x-queue-type",
    "x-max-age",
    "x-stream-max-segment-size-bytes",
    "x-initial-cluster-size",
    "x-queue-leader-locator",
];

/// `x-queue-type`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum QueueType {
    #[default]
    Classic,
    Quorum,
    Stream,
}

impl QueueType {
    /// The name `x-queue-type` gives it.
    pub fn as_str(self) -> &'static str {
        match self {
            QueueType::Classic => "classic",
            QueueType::Quorum => "quorum",
            QueueType::Stream => "stream",
        }
    }
}

impl QueueType {
    /// The `x-` arguments this type accepts; the other known ones are refused.
    pub fn supported_args(self) -> &'static [&'static str] {
        match self {
            QueueType::Classic => CLASSIC_ARGS,
            QueueType::Quorum => QUORUM_ARGS,
            QueueType::Stream => STREAM_ARGS,
        }
    }

    pub fn supports(self, key: &str) -> bool {
        self.supported_args().contains(&key)
    }

    /// RabbitMQ's module name for the type, as its error texts show it.
    pub fn module(self) -> &'static str {
        match self {
            QueueType::Classic => "rabbit_classic_queue",
            QueueType::Quorum => "rabbit_quorum_queue",
            QueueType::Stream => "rabbit_stream_queue",
        }
    }

    /// The arguments compared when a queue of this type is redeclared, in RabbitMQ's order.
    /// The arguments a redeclaration must repeat: RabbitMQ's for the type, and Warren's own
    /// (RabbitMQ would ignore those; a worker that redeclares a task queue with another
    /// visibility timeout is told, rather than silently getting the first one).
    pub fn equivalence_keys(self) -> impl Iterator<Item = &'static str> {
        let warren = if self == QueueType::Stream {
            &[][..]
        } else {
            &WARREN_ARGS[..]
        };
        DECLARE_ARGS
            .into_iter()
            .filter(move |k| self.supports(k))
            .chain(warren.iter().copied())
    }
}

pub use warren_queue::Overflow;

/// `x-queue-mode`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum QueueMode {
    #[default]
    Default,
    Lazy,
}

/// `x-dead-letter-strategy`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DeadLetterStrategy {
    #[default]
    AtMostOnce,
    AtLeastOnce,
}

/// The validated, parsed queue arguments. Features built later (TTL, max-length,
/// dead-lettering, priorities, single active consumer, delivery limits) read these.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct QueueArgs {
    /// `x-expires`: delete the queue after this long unused (ms, > 0).
    pub expires_ms: Option<u64>,
    /// `x-message-ttl` (ms).
    pub message_ttl_ms: Option<u64>,
    /// `x-dead-letter-exchange`.
    pub dead_letter_exchange: Option<String>,
    /// `x-dead-letter-routing-key`.
    pub dead_letter_routing_key: Option<String>,
    /// `x-dead-letter-strategy`.
    pub dead_letter_strategy: DeadLetterStrategy,
    /// `x-max-length` (messages).
    pub max_length: Option<u64>,
    /// `x-max-length-bytes`.
    pub max_length_bytes: Option<u64>,
    /// `x-max-priority` (0..=255).
    pub max_priority: Option<u8>,
    /// `x-overflow`.
    pub overflow: Overflow,
    /// `x-queue-mode` (accepted; every queue behaves the same).
    pub queue_mode: QueueMode,
    /// `x-queue-version` (1 or 2; accepted, no effect).
    pub queue_version: Option<u8>,
    /// `x-single-active-consumer`.
    pub single_active_consumer: bool,
    /// `x-queue-type`.
    pub queue_type: QueueType,
    /// `x-queue-leader-locator` other than `client-local`: a new replicated queue's first
    /// leader is the running node leading the fewest.
    pub balanced_leader: bool,
    /// `x-max-age` for streams, in ms.
    pub max_age_ms: Option<u64>,
    /// `x-delivery-limit` (quorum queues; not validated by RabbitMQ 3.10: taken when it is
    /// a non-negative integer, ignored otherwise).
    pub delivery_limit: Option<u64>,
    /// `x-delivery-limit` was an integer (a negative one: no limit).
    pub delivery_limit_given: bool,
    /// `x-visibility-timeout` (Warren's): a delivery not settled within this many ms comes
    /// back to the queue.
    pub visibility_timeout_ms: Option<u64>,
    /// `x-delivery-delay` (Warren's, SQS's DelaySeconds): every message is held back this many
    /// ms before it joins the queue (a message's own `x-delay` header overrides it).
    pub delivery_delay_ms: Option<u64>,
    /// `x-message-deduplication` and its `x-cache-*` (LavinMQ's).
    pub dedup: Option<crate::dedup::DedupSpec>,
    /// `x-group-header` (Warren's): the header whose value is a message's group; a group's
    /// messages go out in publish order, one at a time (SQS FIFO's MessageGroupId).
    pub group_header: Option<String>,
    /// `x-consumer-timeout` (RabbitMQ 4.3's): a consumer that leaves a delivery unsettled this
    /// long is cancelled.
    pub consumer_timeout_ms: Option<u64>,
    /// `x-delayed-retry-type` = `disabled`.
    pub retry_disabled: bool,
    /// `x-delayed-retry-min`, `-max` (ms), `-multiplier`, `-jitter` (percent).
    pub retry_min_ms: Option<u64>,
    pub retry_max_ms: Option<u64>,
    pub retry_multiplier: Option<u64>,
    pub retry_jitter_pct: u8,
}

/// The delivery limit of a quorum queue declared without one (RabbitMQ 4.0's default).
pub const QUORUM_DEFAULT_DELIVERY_LIMIT: u64 = 20;

impl QueueArgs {
    /// Does the queue use Warren's task-queue arguments (a visibility timeout, a delivery
    /// limit)? Its redeliveries then say how many deliveries came before (`x-delivery-count`).
    pub fn is_task_queue(&self) -> bool {
        self.visibility_timeout_ms.is_some() || self.delivery_limit.is_some() || self.retries()
    }

    /// Does a redelivery (and every basic.get) tell the consumer how many deliveries came
    /// before (`x-delivery-count`)? A quorum queue's do, as RabbitMQ's, and a task queue's.
    pub fn counts_deliveries(&self) -> bool {
        self.queue_type == QueueType::Quorum || self.is_task_queue()
    }

    /// The delivery limit that applies: the argument, or for a quorum queue without one,
    /// RabbitMQ 4's default of 20 (a negative argument: none).
    pub fn effective_delivery_limit(&self) -> Option<u64> {
        match (self.queue_type, self.delivery_limit_given) {
            // Delayed retries without a limit would retry a poison message forever (LavinMQ
            // has the same default).
            (QueueType::Quorum, false) => Some(QUORUM_DEFAULT_DELIVERY_LIMIT),
            (_, false) if self.retries() => Some(QUORUM_DEFAULT_DELIVERY_LIMIT),
            _ => self.delivery_limit,
        }
    }

    /// May the queue's messages leave memory (page)? Not with a length limit (the limit bounds
    /// its memory and its head must be droppable), priorities (their order is not the ids')
    /// or message groups (a message's group is worked out when it is enqueued).
    pub fn pages(&self) -> bool {
        !self.limits_length() && self.max_priority.is_none() && self.group_header.is_none()
    }

    /// Are delayed retries on (`x-delayed-retry-min` given, the type not `disabled`)?
    pub fn retries(&self) -> bool {
        self.retry_min_ms.is_some() && !self.retry_disabled
    }

    /// Does the queue keep a length limit (`x-max-length` or `x-max-length-bytes`)?
    pub fn limits_length(&self) -> bool {
        self.max_length.is_some() || self.max_length_bytes.is_some()
    }
}

/// An error term as RabbitMQ prints it with `~p`.
enum Bad {
    /// `{value_negative,-5}` and friends.
    Tagged(&'static str, String),
    /// A bare atom such as `invalid_overflow`.
    Atom(&'static str),
    /// A string, printed quoted.
    Text(String),
}

impl Bad {
    fn render(&self) -> String {
        match self {
            Bad::Tagged(tag, v) => format!("{{{tag},{v}}}"),
            Bad::Atom(a) => (*a).to_string(),
            Bad::Text(t) => erl::quoted(t),
        }
    }
}

fn check_int(v: &FieldValue) -> Result<i64, Bad> {
    erl::int_arg(v).ok_or_else(|| Bad::Text(format!("expected integer, got {}", v.type_name())))
}

fn check_non_neg(v: &FieldValue) -> Result<u64, Bad> {
    let i = check_int(v)?;
    u64::try_from(i).map_err(|_| Bad::Tagged("value_negative", i.to_string()))
}

fn check_expiry(i: i64) -> Result<u64, Bad> {
    if i < 0 {
        Err(Bad::Tagged("value_negative", i.to_string()))
    } else if i > MAX_EXPIRY_MS {
        Err(Bad::Tagged("value_too_large", i.to_string()))
    } else {
        Ok(i as u64)
    }
}

fn check_str(v: &FieldValue) -> Result<&[u8], Bad> {
    match v {
        FieldValue::LongStr(b) => Ok(b),
        other => Err(Bad::Tagged(
            "unacceptable_type",
            other.type_name().to_string(),
        )),
    }
}

fn check_one_of<'a>(v: &FieldValue, known: &[&'a str], err: &'static str) -> Result<&'a str, Bad> {
    let s = check_str(v)?;
    known
        .iter()
        .find(|k| k.as_bytes() == s)
        .copied()
        .ok_or(Bad::Atom(err))
}

fn lossy(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// `check_max_age/1`: digits then exactly one unit of Y M D h m s, value > 0.
fn parse_max_age(s: &[u8]) -> Option<u64> {
    let digits = s.iter().take_while(|c| c.is_ascii_digit()).count();
    let (num, unit) = s.split_at(digits);
    let n: u64 = std::str::from_utf8(num).ok()?.parse().ok()?;
    if n == 0 {
        return None;
    }
    let unit_ms: u64 = match unit {
        b"Y" => 365 * 24 * 3600 * 1000,
        b"M" => 30 * 24 * 3600 * 1000,
        b"D" => 24 * 3600 * 1000,
        b"h" => 3600 * 1000,
        b"m" => 60 * 1000,
        b"s" => 1000,
        _ => return None,
    };
    n.checked_mul(unit_ms)
}

fn check_key(key: &str, v: &FieldValue, args: &FieldTable, out: &mut QueueArgs) -> Result<(), Bad> {
    match key {
        "x-expires" => {
            let i = check_int(v)?;
            if i == 0 {
                return Err(Bad::Tagged("value_zero", "0".to_string()));
            }
            out.expires_ms = Some(check_expiry(i)?);
        }
        "x-message-ttl" => out.message_ttl_ms = Some(check_expiry(check_int(v)?)?),
        "x-dead-letter-exchange" => out.dead_letter_exchange = Some(lossy(check_str(v)?)),
        "x-dead-letter-routing-key" => {
            let s = check_str(v)?;
            if args.get("x-dead-letter-exchange").is_none() {
                return Err(Bad::Atom("routing_key_but_no_dlx_defined"));
            }
            out.dead_letter_routing_key = Some(lossy(s));
        }
        "x-dead-letter-strategy" => {
            out.dead_letter_strategy = match check_one_of(
                v,
                &["at-most-once", "at-least-once"],
                "invalid_dlx_strategy",
            )? {
                "at-least-once" => DeadLetterStrategy::AtLeastOnce,
                _ => DeadLetterStrategy::AtMostOnce,
            }
        }
        "x-max-length" => out.max_length = Some(check_non_neg(v)?),
        "x-max-length-bytes" => out.max_length_bytes = Some(check_non_neg(v)?),
        "x-max-in-memory-length" | "x-max-in-memory-bytes" | "x-stream-max-segment-size-bytes" => {
            check_non_neg(v)?;
        }
        "x-max-priority" => {
            let n = check_non_neg(v)?;
            out.max_priority = Some(
                u8::try_from(n).map_err(|_| Bad::Tagged("max_value_exceeded", n.to_string()))?,
            );
        }
        "x-overflow" => {
            out.overflow = match check_one_of(
                v,
                &["drop-head", "reject-publish", "reject-publish-dlx"],
                "invalid_overflow",
            )? {
                "reject-publish" => Overflow::RejectPublish,
                "reject-publish-dlx" => Overflow::RejectPublishDlx,
                _ => Overflow::DropHead,
            }
        }
        "x-queue-mode" => {
            let s = check_str(v)?;
            out.queue_mode = match s {
                b"default" => QueueMode::Default,
                b"lazy" => QueueMode::Lazy,
                _ => return Err(Bad::Text(format!("unsupported queue mode '{}'", lossy(s)))),
            }
        }
        "x-queue-version" => {
            let i = check_int(v)?;
            out.queue_version = match i {
                1 => Some(1),
                2 => Some(2),
                _ => return Err(Bad::Text(format!("unsupported queue version '{i}'"))),
            };
        }
        "x-delivery-limit" => {
            out.delivery_limit = v.as_u64();
            out.delivery_limit_given = v.as_i64().is_some();
        }
        "x-single-active-consumer" => match v {
            FieldValue::Bool(b) => out.single_active_consumer = *b,
            other => {
                return Err(Bad::Tagged(
                    "unacceptable_type",
                    other.type_name().to_string(),
                ))
            }
        },
        "x-queue-type" => {
            let s = check_str(v)?;
            out.queue_type = match s {
                b"classic" => QueueType::Classic,
                b"quorum" => QueueType::Quorum,
                b"stream" => QueueType::Stream,
                _ => return Err(Bad::Text(format!("unsupported queue type '{}'", lossy(s)))),
            }
        }
        "x-quorum-initial-group-size" | "x-initial-cluster-size" => {
            check_non_neg(v).and_then(|n| match n {
                0 => Err(Bad::Tagged("value_zero", "0".to_string())),
                _ => Ok(()),
            })?;
        }
        "x-max-age" => {
            let s = check_str(v)?;
            out.max_age_ms = Some(parse_max_age(s).ok_or(Bad::Atom("invalid_max_age"))?);
        }
        "x-queue-leader-locator" => {
            // RabbitMQ 3.10's values, and `balanced`, the name later versions give both
            // `random` and `least-leaders`.
            check_one_of(
                v,
                &["client-local", "random", "least-leaders", "balanced"],
                "invalid_queue_locator_arg",
            )?;
            out.balanced_leader = v.as_str() != Some("client-local");
        }
        _ => {}
    }
    Ok(())
}

/// Validates the arguments of a new queue and parses them, as RabbitMQ 3.10's
/// `check_declare_arguments`: `x-queue-type` first, then the values of the arguments the
/// type supports (in [`DECLARE_ARGS`] order), then known arguments the type does not
/// support (in the table's order). `rs` is the queue's resource text
/// (`queue 'q' in vhost '/'`).
pub fn validate(args: &FieldTable, rs: &str) -> Result<QueueArgs, AmqpError> {
    let invalid = |key: &str, bad: Bad| {
        AmqpError::precondition_failed(format!("invalid arg '{key}' for {rs}: {}", bad.render()))
    };
    let mut out = QueueArgs::default();
    if let Some(v) = args.get("x-queue-type") {
        check_key("x-queue-type", v, args, &mut out).map_err(|b| invalid("x-queue-type", b))?;
    }
    let qtype = out.queue_type;
    for key in DECLARE_ARGS {
        if key == "x-queue-type" || !qtype.supports(key) {
            continue;
        }
        if let Some(v) = args.get(key) {
            check_key(key, v, args, &mut out).map_err(|b| invalid(key, b))?;
        }
    }
    if qtype != QueueType::Stream {
        for key in WARREN_ARGS {
            if let Some(v) = args.get(key) {
                check_warren_key(key, v, &mut out).map_err(|b| invalid(key, b))?;
            }
        }
        out.dedup =
            crate::dedup::spec(args).map_err(|e| AmqpError::precondition_failed(e.message(rs)))?;
    }
    for (key, _) in args.iter() {
        if DECLARE_ARGS.contains(&key.as_str()) && !qtype.supports(key) {
            return Err(AmqpError::precondition_failed(format!(
                "invalid arg '{key}' for {rs} of queue type {}",
                qtype.module()
            )));
        }
    }
    Ok(out)
}

/// Whether RabbitMQ 3.10 refuses a queue argument Warren takes for this type: one it knows
/// for another queue type (`x-delivery-limit` on a classic queue). Warren's own arguments are
/// not among them: RabbitMQ ignores those.
pub fn refused_by_rabbitmq(qtype: QueueType, key: &str) -> bool {
    qtype == QueueType::Classic && key == "x-delivery-limit"
}

/// Warren's own queue arguments (RabbitMQ ignores them), for classic and quorum queues.
/// (`x-consumer-timeout` and `x-delayed-retry-type`/`-min`/`-max` are RabbitMQ 4.3's,
/// `x-delayed-retry-multiplier` LavinMQ's; 3.10 ignores them all.)
pub const WARREN_ARGS: [&str; 13] = [
    "x-message-deduplication",
    "x-cache-size",
    "x-cache-ttl",
    "x-deduplication-header",
    "x-visibility-timeout",
    "x-delivery-delay",
    "x-group-header",
    "x-consumer-timeout",
    "x-delayed-retry-type",
    "x-delayed-retry-min",
    "x-delayed-retry-max",
    "x-delayed-retry-multiplier",
    "x-delayed-retry-jitter",
];

fn check_warren_key(key: &str, v: &FieldValue, out: &mut QueueArgs) -> Result<(), Bad> {
    match key {
        "x-visibility-timeout" => out.visibility_timeout_ms = Some(check_positive_ms(v)?),
        "x-delivery-delay" => out.delivery_delay_ms = Some(check_positive_ms(v)?),
        "x-group-header" => {
            let name = std::str::from_utf8(check_str(v)?)
                .ok()
                .filter(|n| !n.is_empty())
                .ok_or_else(|| Bad::Text("a header name is needed".to_string()))?;
            out.group_header = Some(name.to_owned());
        }
        "x-consumer-timeout" => out.consumer_timeout_ms = Some(check_positive_ms(v)?),
        "x-delayed-retry-type" => {
            out.retry_disabled = match check_str(v)? {
                b"disabled" => true,
                b"all" | b"failed" | b"returned" => false,
                other => {
                    return Err(Bad::Text(format!(
                        "unsupported delayed retry type '{}'",
                        lossy(other)
                    )))
                }
            }
        }
        "x-delayed-retry-min" => out.retry_min_ms = Some(check_positive_ms(v)?),
        "x-delayed-retry-max" => out.retry_max_ms = Some(check_positive_ms(v)?),
        "x-delayed-retry-multiplier" => {
            let n = check_non_neg(v)?;
            if n == 0 {
                return Err(Bad::Tagged("value_zero", "0".to_string()));
            }
            out.retry_multiplier = Some(n);
        }
        "x-delayed-retry-jitter" => {
            let n = check_non_neg(v)?;
            out.retry_jitter_pct = u8::try_from(n)
                .ok()
                .filter(|p| *p <= 100)
                .ok_or_else(|| Bad::Tagged("max_value_exceeded", n.to_string()))?;
        }
        _ => {}
    }
    Ok(())
}

/// A positive number of milliseconds, at most ten years.
fn check_positive_ms(v: &FieldValue) -> Result<u64, Bad> {
    let n = check_int(v)?;
    if n == 0 {
        return Err(Bad::Tagged("value_zero", "0".to_string()));
    }
    let n = check_expiry(n)?;
    Ok(n)
}

/// The `x-dead-letter-exchange` type check that RabbitMQ's channel makes before declaring.
pub fn check_dlx_type(args: &FieldTable, rs: &str) -> Result<(), AmqpError> {
    const KEY: &str = "x-dead-letter-exchange";
    match args.get(KEY) {
        None | Some(FieldValue::LongStr(_)) => Ok(()),
        Some(other) => Err(AmqpError::precondition_failed(format!(
            "invalid type '{}' for arg '{KEY}' in {rs}",
            other.type_name()
        ))),
    }
}

/// `rabbit_misc:val/1` for a value that may be missing.
fn val_opt(v: Option<&FieldValue>) -> String {
    match v {
        None => "none".to_string(),
        Some(v) => format!("the value '{}' of type '{}'", erl::val(v), v.type_name()),
    }
}

/// `rabbit_misc:assert_args_equivalence/4` over `keys`: the first differing key fails with
/// RabbitMQ's 406 text.
pub fn assert_args_equivalence<'k>(
    current: &FieldTable,
    received: &FieldTable,
    rs: &str,
    keys: impl IntoIterator<Item = &'k str>,
) -> Result<(), AmqpError> {
    for key in keys {
        let (orig, new) = (current.get(key), received.get(key));
        let fail = |received: String, current: String| {
            AmqpError::precondition_failed(format!(
                "inequivalent arg '{key}' for {rs}: received {received} but current is {current}"
            ))
        };
        match (orig, new) {
            (None, None) => {}
            (Some(o), Some(n)) => {
                let same = (erl::type_class(o) == erl::type_class(n) && erl::value_eq(o, n))
                    // assert_field_equivalence(Current, Current): identical Erlang values.
                    || (o.type_name() == n.type_name() && o == n);
                if !same {
                    return Err(fail(
                        format!("'{}'", erl::val(n)),
                        format!("'{}'", erl::val(o)),
                    ));
                }
            }
            (o, n) => {
                let classic = |v: Option<&FieldValue>| matches!(v, Some(FieldValue::LongStr(b)) if &b[..] == b"classic");
                if key == "x-queue-type" && (classic(o) || classic(n)) {
                    continue;
                }
                return Err(fail(val_opt(n), val_opt(o)));
            }
        }
    }
    Ok(())
}

/// `rabbit_misc:assert_field_equivalence/4` for a boolean property (durable, auto_delete...).
pub fn assert_field_equivalence(
    current: bool,
    received: bool,
    rs: &str,
    key: &str,
) -> Result<(), AmqpError> {
    if current == received {
        Ok(())
    } else {
        Err(AmqpError::precondition_failed(format!(
            "inequivalent arg '{key}' for {rs}: received '{received}' but current is '{current}'"
        )))
    }
}

/// Validates basic.consume arguments (`check_consume_arguments`); returns `x-priority`.
pub fn validate_consume(args: &FieldTable, rs: &str) -> Result<i64, AmqpError> {
    let err = |key: &str, bad: Bad| {
        AmqpError::precondition_failed(format!("invalid arg '{key}' for {rs}: {}", bad.render()))
    };
    let mut priority = 0;
    if let Some(v) = args.get("x-priority") {
        priority = check_int(v).map_err(|b| err("x-priority", b))?;
    }
    for key in ["x-visibility-timeout", "x-consumer-timeout"] {
        if let Some(v) = args.get(key) {
            check_positive_ms(v).map_err(|b| err(key, b))?;
        }
    }
    if let Some(v) = args.get("x-cancel-on-ha-failover") {
        if !matches!(v, FieldValue::Bool(_)) {
            return Err(err(
                "x-cancel-on-ha-failover",
                Bad::Tagged("unacceptable_type", v.type_name().to_string()),
            ));
        }
    }
    Ok(priority)
}

#[cfg(test)]
mod tests {
    use super::*;
    use warren_codec::ReplyCode;

    const RS: &str = "queue 'q' in vhost '/'";

    fn table(pairs: &[(&'static str, FieldValue)]) -> FieldTable {
        let mut t = FieldTable::new();
        for (k, v) in pairs {
            t.insert(*k, v.clone());
        }
        t
    }

    fn invalid(pairs: &[(&'static str, FieldValue)]) -> String {
        match validate(&table(pairs), RS) {
            Ok(a) => panic!("accepted: {a:?}"),
            Err(e) => {
                assert_eq!(e.code, ReplyCode::PreconditionFailed);
                e.text
            }
        }
    }

    fn with_type(
        t: &'static str,
        key: &'static str,
        v: FieldValue,
    ) -> Vec<(&'static str, FieldValue)> {
        vec![("x-queue-type", FieldValue::long_str(t)), (key, v)]
    }

    #[test]
    fn reference_texts() {
        assert_eq!(
            invalid(&[("x-message-ttl", FieldValue::I32(-5))]),
            "invalid arg 'x-message-ttl' for queue 'q' in vhost '/': {value_negative,-5}"
        );
        assert_eq!(
            invalid(&[("x-max-length", FieldValue::long_str("ten"))]),
            "invalid arg 'x-max-length' for queue 'q' in vhost '/': \"expected integer, got longstr\""
        );
    }

    #[test]
    fn each_validator() {
        let cases: Vec<(&'static str, &'static str, FieldValue, &str)> = vec![
            ("classic", "x-expires", FieldValue::I32(0), "{value_zero,0}"),
            (
                "classic",
                "x-expires",
                FieldValue::I64(315_360_000_001),
                "{value_too_large,315360000001}",
            ),
            (
                "classic",
                "x-expires",
                FieldValue::F64(1.0),
                "\"expected integer, got double\"",
            ),
            (
                "classic",
                "x-message-ttl",
                FieldValue::Timestamp(5),
                "\"expected integer, got timestamp\"",
            ),
            (
                "classic",
                "x-message-ttl",
                FieldValue::Decimal {
                    scale: 1,
                    value: 15,
                },
                "\"expected integer, got decimal\"",
            ),
            (
                "classic",
                "x-max-length",
                FieldValue::Bool(true),
                "\"expected integer, got bool\"",
            ),
            (
                "classic",
                "x-dead-letter-exchange",
                FieldValue::I32(1),
                "{unacceptable_type,signedint}",
            ),
            (
                "classic",
                "x-max-length-bytes",
                FieldValue::I8(-1),
                "{value_negative,-1}",
            ),
            (
                "classic",
                "x-max-priority",
                FieldValue::I32(256),
                "{max_value_exceeded,256}",
            ),
            (
                "classic",
                "x-overflow",
                FieldValue::long_str("nope"),
                "invalid_overflow",
            ),
            (
                "classic",
                "x-overflow",
                FieldValue::Bool(true),
                "{unacceptable_type,bool}",
            ),
            (
                "classic",
                "x-queue-mode",
                FieldValue::long_str("eager"),
                "\"unsupported queue mode 'eager'\"",
            ),
            (
                "classic",
                "x-queue-version",
                FieldValue::I32(3),
                "\"unsupported queue version '3'\"",
            ),
            (
                "classic",
                "x-queue-version",
                FieldValue::long_str("x"),
                "\"expected integer, got longstr\"",
            ),
            (
                "classic",
                "x-single-active-consumer",
                FieldValue::long_str("yes"),
                "{unacceptable_type,longstr}",
            ),
            (
                "quorum",
                "x-dead-letter-strategy",
                FieldValue::long_str("x"),
                "invalid_dlx_strategy",
            ),
            (
                "quorum",
                "x-max-in-memory-length",
                FieldValue::I32(-2),
                "{value_negative,-2}",
            ),
            (
                "quorum",
                "x-quorum-initial-group-size",
                FieldValue::I32(0),
                "{value_zero,0}",
            ),
            (
                "quorum",
                "x-queue-leader-locator",
                FieldValue::long_str("x"),
                "invalid_queue_locator_arg",
            ),
            (
                "stream",
                "x-max-age",
                FieldValue::long_str("10x"),
                "invalid_max_age",
            ),
            (
                "stream",
                "x-max-age",
                FieldValue::long_str("0D"),
                "invalid_max_age",
            ),
            (
                "stream",
                "x-initial-cluster-size",
                FieldValue::I32(0),
                "{value_zero,0}",
            ),
        ];
        for (t, key, v, want) in cases {
            let text = invalid(&with_type(t, key, v));
            assert_eq!(text, format!("invalid arg '{key}' for {RS}: {want}"));
        }
        for (v, want) in [
            (
                FieldValue::long_str("fifo"),
                "\"unsupported queue type 'fifo'\"",
            ),
            (FieldValue::long_str(""), "\"unsupported queue type ''\""),
            (FieldValue::I32(1), "{unacceptable_type,signedint}"),
        ] {
            // x-queue-type is checked before anything else.
            let text = invalid(&[("x-message-ttl", FieldValue::I32(-5)), ("x-queue-type", v)]);
            assert_eq!(text, format!("invalid arg 'x-queue-type' for {RS}: {want}"));
        }
        assert_eq!(
            invalid(&[("x-dead-letter-routing-key", FieldValue::long_str("rk"))]),
            format!(
                "invalid arg 'x-dead-letter-routing-key' for {RS}: routing_key_but_no_dlx_defined"
            )
        );
        assert_eq!(
            invalid(&[
                ("x-dead-letter-exchange", FieldValue::long_str("d")),
                ("x-dead-letter-routing-key", FieldValue::I32(5)),
            ]),
            format!(
                "invalid arg 'x-dead-letter-routing-key' for {RS}: {{unacceptable_type,signedint}}"
            )
        );
        // The largest accepted TTL: ten years.
        assert!(validate(
            &table(&[("x-message-ttl", FieldValue::I64(315_360_000_000))]),
            RS
        )
        .is_ok());
    }

    #[test]
    fn first_invalid_in_rabbitmq_order() {
        // x-expires comes before x-max-length in declare_args, whatever the table order.
        let text = invalid(&[
            ("x-max-length", FieldValue::I32(-1)),
            ("x-expires", FieldValue::I32(0)),
        ]);
        assert!(text.starts_with("invalid arg 'x-expires'"), "{text}");
    }

    #[test]
    fn arguments_the_type_does_not_support() {
        for (t, key, v) in [
            ("classic", "x-quorum-initial-group-size", FieldValue::I32(3)),
            ("classic", "x-max-age", FieldValue::long_str("10x")),
            (
                "classic",
                "x-dead-letter-strategy",
                FieldValue::long_str("bad"),
            ),
            ("classic", "x-max-in-memory-length", FieldValue::I32(1)),
            ("quorum", "x-max-priority", FieldValue::I32(500)),
            ("quorum", "x-queue-mode", FieldValue::long_str("lazy")),
            ("stream", "x-message-ttl", FieldValue::I32(5)),
            ("stream", "x-overflow", FieldValue::long_str("drop-head")),
        ] {
            let module = format!("rabbit_{t}_queue");
            assert_eq!(
                invalid(&with_type(t, key, v)),
                format!("invalid arg '{key}' for {RS} of queue type {module}")
            );
        }
        // Supported values are validated before unsupported keys are refused...
        let text = invalid(&[
            ("x-dead-letter-strategy", FieldValue::long_str("bad")),
            ("x-max-length", FieldValue::I32(-1)),
        ]);
        assert_eq!(
            text,
            format!("invalid arg 'x-max-length' for {RS}: {{value_negative,-1}}")
        );
        // ...and unsupported keys are reported in the table's order.
        for (a, b) in [
            ("x-max-age", "x-quorum-initial-group-size"),
            ("x-quorum-initial-group-size", "x-max-age"),
        ] {
            let text = invalid(&[(a, FieldValue::long_str("1D")), (b, FieldValue::I32(1))]);
            assert!(text.starts_with(&format!("invalid arg '{a}'")), "{text}");
        }
        // Unknown arguments are nobody's business.
        assert!(validate(&table(&[("x-not-an-argument", FieldValue::I32(1))]), RS).is_ok());
        // Warren acts on x-delivery-limit on classic queues too (RabbitMQ 3.10 refuses it).
        let a = validate(&table(&[("x-delivery-limit", FieldValue::I32(5))]), RS).unwrap();
        assert_eq!(a.delivery_limit, Some(5));
        // Its own arguments are checked.
        assert_eq!(
            invalid(&[("x-consumer-timeout", FieldValue::I32(0))]),
            format!("invalid arg 'x-consumer-timeout' for {RS}: {{value_zero,0}}")
        );
    }

    #[test]
    fn parses_valid_args() {
        let a = validate(
            &table(&[
                ("x-expires", FieldValue::I32(1000)),
                ("x-message-ttl", FieldValue::U16(0)),
                ("x-dead-letter-exchange", FieldValue::long_str("dlx")),
                ("x-dead-letter-routing-key", FieldValue::long_str("rk")),
                ("x-max-length", FieldValue::I64(10)),
                ("x-max-length-bytes", FieldValue::I64(100)),
                ("x-max-priority", FieldValue::U8(10)),
                ("x-overflow", FieldValue::long_str("reject-publish-dlx")),
                ("x-queue-mode", FieldValue::long_str("lazy")),
                ("x-queue-version", FieldValue::I32(2)),
                ("x-single-active-consumer", FieldValue::Bool(true)),
                (
                    "x-queue-master-locator",
                    FieldValue::long_str("min-masters"),
                ),
                ("x-unknown", FieldValue::long_str("ignored")),
            ]),
            RS,
        )
        .expect("valid classic");
        assert_eq!(a.expires_ms, Some(1000));
        assert_eq!(a.message_ttl_ms, Some(0));
        assert_eq!(a.dead_letter_exchange.as_deref(), Some("dlx"));
        assert_eq!(a.dead_letter_routing_key.as_deref(), Some("rk"));
        assert_eq!(a.max_length, Some(10));
        assert_eq!(a.max_length_bytes, Some(100));
        assert_eq!(a.max_priority, Some(10));
        assert_eq!(a.overflow, Overflow::RejectPublishDlx);
        assert_eq!(a.queue_mode, QueueMode::Lazy);
        assert_eq!(a.queue_version, Some(2));
        assert!(a.single_active_consumer);
        assert_eq!(a.queue_type, QueueType::Classic);

        let q = validate(
            &table(&[
                ("x-queue-type", FieldValue::long_str("quorum")),
                ("x-delivery-limit", FieldValue::I32(3)),
                (
                    "x-dead-letter-strategy",
                    FieldValue::long_str("at-least-once"),
                ),
                ("x-max-in-memory-bytes", FieldValue::I32(3)),
            ]),
            RS,
        )
        .expect("valid quorum");
        assert_eq!(q.queue_type, QueueType::Quorum);
        assert_eq!(q.delivery_limit, Some(3));
        assert_eq!(q.dead_letter_strategy, DeadLetterStrategy::AtLeastOnce);
        // RabbitMQ 3.10 does not validate x-delivery-limit.
        let q = validate(
            &table(&[
                ("x-queue-type", FieldValue::long_str("quorum")),
                ("x-delivery-limit", FieldValue::long_str("x")),
            ]),
            RS,
        )
        .expect("unvalidated");
        assert_eq!(q.delivery_limit, None);
        // Without an integer limit a quorum queue has RabbitMQ 4's default; a negative one
        // lifts it.
        assert_eq!(
            q.effective_delivery_limit(),
            Some(QUORUM_DEFAULT_DELIVERY_LIMIT)
        );
        let unlimited = validate(
            &table(&[
                ("x-queue-type", FieldValue::long_str("quorum")),
                ("x-delivery-limit", FieldValue::I32(-1)),
            ]),
            RS,
        )
        .expect("valid quorum");
        assert_eq!(unlimited.effective_delivery_limit(), None);

        let st = validate(
            &table(&[
                ("x-queue-type", FieldValue::long_str("stream")),
                ("x-max-age", FieldValue::long_str("7D")),
            ]),
            RS,
        )
        .expect("valid stream");
        assert_eq!(st.max_age_ms, Some(7 * 24 * 3600 * 1000));
    }

    #[test]
    fn dlx_type_check() {
        let e = check_dlx_type(
            &table(&[("x-dead-letter-exchange", FieldValue::I64(1))]),
            RS,
        )
        .expect_err("long");
        assert_eq!(
            e.text,
            "invalid type 'long' for arg 'x-dead-letter-exchange' in queue 'q' in vhost '/'"
        );
    }

    #[test]
    fn equivalence() {
        let keys = || QueueType::Classic.equivalence_keys();
        let ten = table(&[("x-max-length", FieldValue::I32(10))]);
        let twenty = table(&[("x-max-length", FieldValue::I64(20))]);
        let e = assert_args_equivalence(&ten, &twenty, RS, keys()).expect_err("differs");
        assert_eq!(
            e.text,
            "inequivalent arg 'x-max-length' for queue 'q' in vhost '/': received '20' but current is '10'"
        );
        // Same integer class, different width: equivalent.
        let ten_long = table(&[("x-max-length", FieldValue::I64(10))]);
        assert!(assert_args_equivalence(&ten, &ten_long, RS, keys()).is_ok());
        // A string is not an integer, even when it prints the same.
        let ten_str = table(&[("x-max-length", FieldValue::long_str("10"))]);
        let e = assert_args_equivalence(&ten, &ten_str, RS, keys()).expect_err("string");
        assert_eq!(
            e.text,
            "inequivalent arg 'x-max-length' for queue 'q' in vhost '/': received '10' but current is '10'"
        );
        // Missing on one side.
        let e = assert_args_equivalence(&ten, &FieldTable::new(), RS, keys()).expect_err("missing");
        assert_eq!(
            e.text,
            "inequivalent arg 'x-max-length' for queue 'q' in vhost '/': received none but current is the value '10' of type 'signedint'"
        );
        // Keys are compared in declare_args order.
        let a = table(&[
            ("x-max-length", FieldValue::I32(1)),
            ("x-expires", FieldValue::I32(1000)),
        ]);
        let b = table(&[
            ("x-max-length", FieldValue::I32(2)),
            ("x-expires", FieldValue::I32(2000)),
        ]);
        let e = assert_args_equivalence(&a, &b, RS, keys()).expect_err("both differ");
        assert!(
            e.text.starts_with("inequivalent arg 'x-expires'"),
            "{}",
            e.text
        );
        // Unknown keys and keys the type does not have are not compared; classic == no type.
        let classic = table(&[
            ("x-queue-type", FieldValue::long_str("classic")),
            ("x-foo", FieldValue::I32(1)),
            ("x-quorum-initial-group-size", FieldValue::I32(1)),
        ]);
        assert!(assert_args_equivalence(&FieldTable::new(), &classic, RS, keys()).is_ok());
        assert!(assert_args_equivalence(&classic, &FieldTable::new(), RS, keys()).is_ok());
        // A quorum queue compares x-delivery-limit.
        let e = assert_args_equivalence(
            &FieldTable::new(),
            &table(&[("x-delivery-limit", FieldValue::I32(3))]),
            RS,
            QueueType::Quorum.equivalence_keys(),
        )
        .expect_err("delivery limit");
        assert_eq!(
            e.text,
            "inequivalent arg 'x-delivery-limit' for queue 'q' in vhost '/': received the value '3' of type 'signedint' but current is none"
        );
        let e = assert_field_equivalence(false, true, RS, "durable").expect_err("durable");
        assert_eq!(
            e.text,
            "inequivalent arg 'durable' for queue 'q' in vhost '/': received 'true' but current is 'false'"
        );
    }

    #[test]
    fn consume_args() {
        let e = validate_consume(&table(&[("x-priority", FieldValue::long_str("hi"))]), RS)
            .expect_err("string priority");
        assert_eq!(
            e.text,
            "invalid arg 'x-priority' for queue 'q' in vhost '/': \"expected integer, got longstr\""
        );
        let e = validate_consume(
            &table(&[("x-cancel-on-ha-failover", FieldValue::I32(1))]),
            RS,
        )
        .expect_err("not a bool");
        assert_eq!(
            e.text,
            "invalid arg 'x-cancel-on-ha-failover' for queue 'q' in vhost '/': {unacceptable_type,signedint}"
        );
        assert_eq!(
            validate_consume(&table(&[("x-priority", FieldValue::I32(5))]), RS).ok(),
            Some(5)
        );
    }
}
