//! Dead-lettering: the headers a message carries when it leaves a queue unacknowledged and is
//! republished to the queue's dead-letter exchange, and RabbitMQ's rule for breaking cycles.
//!
//! The `x-death` header is a list of tables, most recent first, one per (queue, reason): a
//! message that dies again for the same reason in the same queue has that entry's `count`
//! raised and the entry moved to the front. `x-first-death-*` are set once, `x-last-death-*`
//! every time. The `expiration` property is removed (a message that expired would otherwise
//! expire again at once) and kept in the entry as `original-expiration`.

use bytes::Bytes;
use warren_codec::{BasicProperties, CodecError, FieldTable, FieldValue, ShortStr};

use crate::queue::machine::DeadLetterReason;

/// Where a message died.
pub struct Death<'a> {
    pub queue: &'a str,
    pub reason: DeadLetterReason,
    /// The exchange and routing keys it was published with (the routing key and any `CC`).
    pub exchange: &'a str,
    pub routing_keys: Vec<FieldValue>,
    /// Wall-clock seconds.
    pub time_s: u64,
}

fn text(v: &FieldValue) -> Option<&[u8]> {
    match v {
        FieldValue::LongStr(b) => Some(b),
        _ => None,
    }
}

/// The routing keys a message was published with: its routing key, then the `CC` header's.
pub fn routing_keys(routing_key: &str, headers: Option<&FieldTable>) -> Vec<FieldValue> {
    let mut keys = vec![FieldValue::long_str(routing_key)];
    keys.extend(cc(headers).map(FieldValue::long_str));
    keys
}

/// The `CC` header's routing keys (its text entries).
pub fn cc(headers: Option<&FieldTable>) -> impl Iterator<Item = &str> {
    let list = match headers.and_then(|h| h.get("CC")) {
        Some(FieldValue::Array(list)) => list.as_slice(),
        _ => &[],
    };
    list.iter()
        .filter_map(|v| text(v).and_then(|b| std::str::from_utf8(b).ok()))
}

/// Sorts a table's entries by key, bytewise (stable: duplicates keep their order), as
/// RabbitMQ does to a headers table it adds `x-death` to.
fn sort(table: &mut FieldTable) {
    table.0.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
}

/// The message's properties after this death: `x-death` updated, `x-first-death-*` and
/// `x-last-death-*` set, `expiration` moved into the entry, `BCC` removed, and `CC` removed
/// too when the queue names its own dead-letter routing key (`keep_cc` false). The headers
/// table ends sorted by key, and an updated entry too, as RabbitMQ 3.10 leaves them.
pub fn record(properties: &Bytes, death: &Death<'_>, keep_cc: bool) -> Result<Bytes, CodecError> {
    let mut props = BasicProperties::decode_bytes(properties.clone())?;
    let mut headers = props.headers.take().unwrap_or_default();
    let reason = FieldValue::long_str(death.reason.as_str());
    let queue = FieldValue::long_str(death.queue);
    let mut deaths = match headers.remove("x-death") {
        Some(FieldValue::Array(list)) => list,
        _ => Vec::new(),
    };
    let same = deaths.iter().position(|d| match d {
        FieldValue::Table(t) => t.get("queue") == Some(&queue) && t.get("reason") == Some(&reason),
        _ => false,
    });
    let entry = match same.map(|i| deaths.remove(i)) {
        Some(FieldValue::Table(mut t)) => {
            let count = t.get("count").and_then(FieldValue::as_i64).unwrap_or(0);
            t.insert("count", FieldValue::I64(count.saturating_add(1)));
            sort(&mut t);
            t
        }
        _ => {
            let mut t = FieldTable::new();
            t.insert("count", FieldValue::I64(1));
            t.insert("reason", reason.clone());
            t.insert("queue", queue.clone());
            t.insert("time", FieldValue::Timestamp(death.time_s));
            t.insert("exchange", FieldValue::long_str(death.exchange));
            t.insert(
                "routing-keys",
                FieldValue::Array(death.routing_keys.clone()),
            );
            if let Some(exp) = &props.expiration {
                t.insert("original-expiration", FieldValue::long_str(exp.as_str()));
            }
            t
        }
    };
    deaths.insert(0, FieldValue::Table(entry));
    // A dead letter is a new message in its next queue (RabbitMQ delivers it unredelivered):
    // the mark a migration gave it stays behind.
    headers.remove(warren_queue::REDELIVERED_HEADER);
    headers.remove("BCC");
    if !keep_cc {
        headers.remove("CC");
    }
    if !headers.contains_key("x-first-death-reason") {
        headers.insert("x-first-death-reason", reason.clone());
        headers.insert("x-first-death-queue", queue.clone());
        headers.insert(
            "x-first-death-exchange",
            FieldValue::long_str(death.exchange),
        );
    }
    headers.insert("x-last-death-reason", reason);
    headers.insert("x-last-death-queue", queue);
    headers.insert(
        "x-last-death-exchange",
        FieldValue::long_str(death.exchange),
    );
    headers.insert("x-death", FieldValue::Array(deaths));
    sort(&mut headers);
    props.headers = Some(headers);
    props.expiration = None;
    Ok(props.encode())
}

/// RabbitMQ's cycle rule: a message that would reach `queue` again, having died there before
/// with no rejection since (all its deaths on the way automatic: expiry, length, delivery
/// limit), is dropped for that queue. `x_death` is the header after this death was recorded.
pub fn is_cycle(x_death: Option<&FieldValue>, reason: DeadLetterReason, queue: &str) -> bool {
    if reason == DeadLetterReason::Rejected {
        return false;
    }
    let Some(FieldValue::Array(deaths)) = x_death else {
        return false;
    };
    let rejected = FieldValue::long_str("rejected");
    for d in deaths {
        let FieldValue::Table(t) = d else {
            continue;
        };
        if t.get("reason") == Some(&rejected) {
            return false;
        }
        if t.get("queue").and_then(text) == Some(queue.as_bytes()) {
            return true;
        }
    }
    false
}

/// The `x-death` header of decoded properties.
pub fn x_death(properties: &Bytes) -> Option<FieldValue> {
    let props = BasicProperties::decode_bytes(properties.clone()).ok()?;
    props.headers?.remove("x-death")
}

/// The `x-delivery-count` header set to `count` (quorum queues tell a redelivered message how
/// many times it was delivered before).
pub fn with_delivery_count(properties: &Bytes, count: u32) -> Result<Bytes, CodecError> {
    let mut props = BasicProperties::decode_bytes(properties.clone())?;
    let mut headers = props.headers.take().unwrap_or_default();
    headers.insert(
        ShortStr::from_static("x-delivery-count"),
        FieldValue::I64(i64::from(count)),
    );
    props.headers = Some(headers);
    Ok(props.encode())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn props(expiration: Option<&str>, headers: Option<FieldTable>) -> Bytes {
        BasicProperties {
            expiration: expiration.map(|e| ShortStr::from_string(e.to_string())),
            headers,
            ..Default::default()
        }
        .encode()
    }

    fn death(queue: &str, reason: DeadLetterReason, t: u64) -> Death<'_> {
        Death {
            queue,
            reason,
            exchange: "x",
            routing_keys: vec![FieldValue::long_str("k")],
            time_s: t,
        }
    }

    fn deaths(p: &Bytes) -> Vec<FieldTable> {
        match x_death(p) {
            Some(FieldValue::Array(v)) => v
                .into_iter()
                .filter_map(|d| match d {
                    FieldValue::Table(t) => Some(t),
                    _ => None,
                })
                .collect(),
            _ => Vec::new(),
        }
    }

    #[test]
    fn deaths_merge_per_queue_and_reason_most_recent_first() {
        let p = props(Some("5000"), None);
        let p = record(&p, &death("a", DeadLetterReason::Expired, 10), true).unwrap();
        let decoded = BasicProperties::decode(&p).unwrap();
        assert_eq!(decoded.expiration, None, "expiration moves into x-death");
        let d = deaths(&p);
        assert_eq!(d.len(), 1);
        assert_eq!(d[0].get("count"), Some(&FieldValue::I64(1)));
        assert_eq!(
            d[0].get("original-expiration"),
            Some(&FieldValue::long_str("5000"))
        );
        assert_eq!(d[0].get("time"), Some(&FieldValue::Timestamp(10)));
        let p = record(&p, &death("b", DeadLetterReason::Rejected, 11), true).unwrap();
        let p = record(&p, &death("a", DeadLetterReason::Expired, 12), true).unwrap();
        let d = deaths(&p);
        assert_eq!(d.len(), 2);
        assert_eq!(d[0].get("queue"), Some(&FieldValue::long_str("a")));
        assert_eq!(d[0].get("count"), Some(&FieldValue::I64(2)));
        assert_eq!(d[1].get("queue"), Some(&FieldValue::long_str("b")));
        let h = BasicProperties::decode(&p).unwrap().headers.unwrap();
        assert_eq!(
            h.get("x-first-death-queue"),
            Some(&FieldValue::long_str("a"))
        );
        assert_eq!(
            h.get("x-first-death-reason"),
            Some(&FieldValue::long_str("expired"))
        );
        assert_eq!(
            h.get("x-last-death-queue"),
            Some(&FieldValue::long_str("a"))
        );
    }

    #[test]
    fn cycles_are_automatic_deaths_back_to_the_same_queue() {
        let p = props(None, None);
        let p = record(&p, &death("a", DeadLetterReason::Expired, 1), true).unwrap();
        let xd = x_death(&p);
        assert!(is_cycle(xd.as_ref(), DeadLetterReason::Expired, "a"));
        assert!(!is_cycle(xd.as_ref(), DeadLetterReason::Expired, "b"));
        assert!(!is_cycle(xd.as_ref(), DeadLetterReason::Rejected, "a"));
        // A rejection on the way breaks the cycle: a client decided.
        let p = record(&p, &death("b", DeadLetterReason::Rejected, 2), true).unwrap();
        let p = record(&p, &death("c", DeadLetterReason::Expired, 3), true).unwrap();
        let xd = x_death(&p);
        assert!(!is_cycle(xd.as_ref(), DeadLetterReason::Expired, "a"));
        assert!(is_cycle(xd.as_ref(), DeadLetterReason::Expired, "c"));
    }

    #[test]
    fn cc_keys_are_recorded_and_bcc_removed() {
        let mut h = FieldTable::new();
        h.insert(
            "CC",
            FieldValue::Array(vec![FieldValue::long_str("c1"), FieldValue::I32(3)]),
        );
        h.insert("BCC", FieldValue::Array(vec![FieldValue::long_str("b1")]));
        let keys = routing_keys("k", Some(&h));
        assert_eq!(
            keys,
            vec![FieldValue::long_str("k"), FieldValue::long_str("c1")]
        );
        let p = record(
            &props(None, Some(h)),
            &Death {
                routing_keys: keys,
                ..death("a", DeadLetterReason::Rejected, 1)
            },
            true,
        )
        .unwrap();
        let h = BasicProperties::decode(&p).unwrap().headers.unwrap();
        assert!(h.get("BCC").is_none());
        assert!(h.get("CC").is_some());
        // Sorted by key, as RabbitMQ leaves a table it added x-death to.
        let keys: Vec<&str> = h.iter().map(|(k, _)| k.as_str()).collect();
        let mut sorted = keys.clone();
        sorted.sort();
        assert_eq!(keys, sorted);
        // A queue with its own dead-letter routing key drops CC.
        let p = record(&p, &death("b", DeadLetterReason::Rejected, 2), false).unwrap();
        let h = BasicProperties::decode(&p).unwrap().headers.unwrap();
        assert!(h.get("CC").is_none());
    }
}
