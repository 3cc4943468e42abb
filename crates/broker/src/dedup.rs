//! Message deduplication (LavinMQ's `x-message-deduplication`, on a queue or an exchange): a
//! message whose deduplication key was seen within the window is dropped, and its publisher
//! still gets its confirm, as if it had been routed (the first copy was).
//!
//! The key is the value of the header named by `x-deduplication-header` (by default the header
//! `x-deduplication-header` itself, as LavinMQ), else the message's `message-id` property. The
//! window is a time (`x-cache-ttl`, ms; a message's own `x-cache-ttl` header overrides it) and a
//! number of keys (`x-cache-size`, oldest forgotten first). The cache is in memory: a restart
//! starts it empty.

use std::collections::{HashMap, VecDeque};

use bytes::Bytes;
use warren_codec::{FieldTable, FieldValue};

use crate::Message;

/// The header that names a message's key when `x-deduplication-header` is not given.
pub const DEFAULT_HEADER: &str = "x-deduplication-header";
/// Keys remembered when `x-cache-size` is not given (LavinMQ remembers 128, which a busy
/// publisher fills in milliseconds; Warren's window is meant to hold minutes of traffic).
pub const DEFAULT_SIZE: usize = 100_000;
/// How long a key is remembered when `x-cache-ttl` is not given: SQS FIFO's five minutes.
pub const DEFAULT_TTL_MS: u64 = 5 * 60 * 1000;

/// What a declaration asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DedupSpec {
    pub size: usize,
    pub ttl_ms: u64,
    pub header: String,
}

/// Reads the deduplication arguments of a queue or exchange declaration: `None` when
/// `x-message-deduplication` is absent or false; an error text for a malformed one.
pub fn spec(args: &FieldTable) -> Result<Option<DedupSpec>, String> {
    match args.get("x-message-deduplication") {
        None => return Ok(None),
        Some(FieldValue::Bool(false)) => return Ok(None),
        Some(FieldValue::Bool(true)) => {}
        Some(other) => {
            return Err(format!(
                "x-message-deduplication must be a boolean, not {}",
                other.type_name()
            ))
        }
    }
    let int = |key: &str| -> Result<Option<i64>, String> {
        match args.get(key) {
            None => Ok(None),
            Some(v) => match v.as_i64() {
                Some(n) if n >= 0 && !matches!(v, FieldValue::Bool(_)) => Ok(Some(n)),
                _ => Err(format!("{key} must be a non-negative integer")),
            },
        }
    };
    let size = match int("x-cache-size")? {
        Some(0) => return Err("x-cache-size must be at least 1".to_string()),
        Some(n) => usize::try_from(n).unwrap_or(usize::MAX),
        None => DEFAULT_SIZE,
    };
    let ttl_ms = int("x-cache-ttl")?.map_or(DEFAULT_TTL_MS, |n| n as u64);
    let header = match args.get("x-deduplication-header") {
        None => DEFAULT_HEADER.to_string(),
        Some(v) => v
            .as_str()
            .filter(|h| !h.is_empty())
            .ok_or("x-deduplication-header must name a header")?
            .to_string(),
    };
    Ok(Some(DedupSpec {
        size,
        ttl_ms,
        header,
    }))
}

/// The keys seen within the window.
#[derive(Clone, Debug)]
pub struct Dedup {
    spec: DedupSpec,
    /// key -> (forgotten at, insertion number).
    seen: HashMap<Bytes, (u64, u64)>,
    /// Keys in insertion order (a key inserted again after it was forgotten appears twice; the
    /// map's insertion number tells the live entry).
    order: VecDeque<(Bytes, u64)>,
    next: u64,
}

impl Dedup {
    pub fn new(spec: DedupSpec) -> Self {
        Dedup {
            spec,
            seen: HashMap::new(),
            order: VecDeque::new(),
            next: 0,
        }
    }

    /// Is `message` a duplicate of one seen in the window at `now`? If not, its key (if it
    /// has one) is remembered.
    pub fn is_duplicate(&mut self, message: &Message, now: u64) -> bool {
        let headers = warren_codec::properties::headers(&message.properties)
            .ok()
            .flatten();
        let Some(key) = key(headers.as_ref(), &self.spec.header, &message.properties) else {
            return false;
        };
        if let Some(&(until, _)) = self.seen.get(&key) {
            if now < until {
                return true;
            }
        }
        let ttl = headers
            .as_ref()
            .and_then(|h| h.get("x-cache-ttl"))
            .and_then(FieldValue::as_i64)
            .and_then(|n| u64::try_from(n).ok())
            .unwrap_or(self.spec.ttl_ms);
        let number = self.next;
        self.next += 1;
        self.seen
            .insert(key.clone(), (now.saturating_add(ttl), number));
        self.order.push_back((key, number));
        self.forget(now);
        false
    }

    /// Forgets the oldest keys past the size limit, and expired keys at the front.
    fn forget(&mut self, now: u64) {
        while let Some((key, number)) = self.order.front() {
            let live = self.seen.get(key).filter(|(_, n)| n == number).copied();
            let drop = match live {
                None => true,
                Some((until, _)) => self.seen.len() > self.spec.size || until <= now,
            };
            if !drop {
                break;
            }
            if live.is_some() {
                self.seen.remove(key);
            }
            self.order.pop_front();
        }
    }

    /// Keys remembered.
    pub fn len(&self) -> usize {
        self.seen.len()
    }

    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
    }
}

/// A message's deduplication key: the named header's value (a string's bytes, a number's
/// digits), else its `message-id`.
fn key(headers: Option<&FieldTable>, header: &str, properties: &Bytes) -> Option<Bytes> {
    if let Some(v) = headers.and_then(|h| h.get(header)) {
        match v {
            FieldValue::LongStr(b) | FieldValue::ByteArray(b) => return Some(b.clone()),
            other => {
                if let Some(n) = other.as_i64() {
                    return Some(Bytes::from(n.to_string()));
                }
            }
        }
    }
    warren_codec::properties::message_id(properties).map(|id| Bytes::copy_from_slice(id.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use warren_codec::properties::BasicProperties;
    use warren_codec::ShortStr;

    fn msg(dedup: Option<&str>, message_id: Option<&str>, ttl: Option<i32>) -> Message {
        let mut h = FieldTable::new();
        if let Some(k) = dedup {
            h.insert(DEFAULT_HEADER, FieldValue::long_str(k));
        }
        if let Some(t) = ttl {
            h.insert("x-cache-ttl", FieldValue::I32(t));
        }
        Message {
            exchange: ShortStr::empty(),
            routing_key: "q".into(),
            properties: BasicProperties {
                headers: Some(h),
                message_id: message_id.map(|m| ShortStr::from_string(m.to_owned())),
                ..BasicProperties::default()
            }
            .encode(),
            body: Bytes::from_static(b"x"),
            persistent: false,
            store_key: None,
        }
    }

    fn args(pairs: &[(&str, FieldValue)]) -> FieldTable {
        let mut t = FieldTable::new();
        for (k, v) in pairs {
            t.insert(ShortStr::from_string(k.to_string()), v.clone());
        }
        t
    }

    #[test]
    fn arguments_as_lavinmq_names_them() {
        assert_eq!(spec(&FieldTable::new()), Ok(None));
        assert_eq!(
            spec(&args(&[(
                "x-message-deduplication",
                FieldValue::Bool(false)
            )])),
            Ok(None)
        );
        let s = spec(&args(&[(
            "x-message-deduplication",
            FieldValue::Bool(true),
        )]))
        .unwrap()
        .unwrap();
        assert_eq!(
            s,
            DedupSpec {
                size: DEFAULT_SIZE,
                ttl_ms: DEFAULT_TTL_MS,
                header: DEFAULT_HEADER.into()
            }
        );
        let s = spec(&args(&[
            ("x-message-deduplication", FieldValue::Bool(true)),
            ("x-cache-size", FieldValue::I32(10)),
            ("x-cache-ttl", FieldValue::I64(1000)),
            ("x-deduplication-header", FieldValue::long_str("order-id")),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            (s.size, s.ttl_ms, s.header.as_str()),
            (10, 1000, "order-id")
        );
        for bad in [
            args(&[("x-message-deduplication", FieldValue::long_str("yes"))]),
            args(&[
                ("x-message-deduplication", FieldValue::Bool(true)),
                ("x-cache-size", FieldValue::I32(0)),
            ]),
            args(&[
                ("x-message-deduplication", FieldValue::Bool(true)),
                ("x-cache-ttl", FieldValue::I32(-1)),
            ]),
        ] {
            assert!(spec(&bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_key_seen_in_the_window_is_a_duplicate_and_forgotten_after_it() {
        let mut d = Dedup::new(DedupSpec {
            size: 3,
            ttl_ms: 100,
            header: DEFAULT_HEADER.into(),
        });
        assert!(!d.is_duplicate(&msg(Some("a"), None, None), 0));
        assert!(d.is_duplicate(&msg(Some("a"), None, None), 99));
        assert!(
            !d.is_duplicate(&msg(Some("a"), None, None), 100),
            "window over"
        );
        // The message-id when the header is absent; no key at all: never a duplicate.
        assert!(!d.is_duplicate(&msg(None, Some("m1"), None), 100));
        assert!(d.is_duplicate(&msg(None, Some("m1"), None), 101));
        assert!(!d.is_duplicate(&msg(None, None, None), 101));
        assert!(!d.is_duplicate(&msg(None, None, None), 101));
        // A message's own x-cache-ttl.
        assert!(!d.is_duplicate(&msg(Some("short"), None, Some(5)), 101));
        assert!(!d.is_duplicate(&msg(Some("short"), None, None), 106));
        // The size bound forgets the oldest.
        for k in ["k1", "k2", "k3"] {
            assert!(!d.is_duplicate(&msg(Some(k), None, None), 110));
        }
        assert!(d.len() <= 3);
        assert!(
            !d.is_duplicate(&msg(None, Some("m1"), None), 111),
            "evicted"
        );
        assert!(d.is_duplicate(&msg(Some("k3"), None, None), 111));
    }
}
