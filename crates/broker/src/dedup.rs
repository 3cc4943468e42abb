//! Message deduplication (LavinMQ's `x-message-deduplication`, on a queue or an exchange): a
//! new message whose deduplication key was seen within the window is dropped, and its
//! publisher still gets its confirm, as the first copy's (once that copy is on disk).
//!
//! The key is the value of the header named by `x-deduplication-header` (by default the header
//! `x-deduplication-header` itself, as LavinMQ), else the message's `message-id` property. The
//! window is a time (`x-cache-ttl`, ms; a message's own `x-cache-ttl` header overrides it) and a
//! number of keys (`x-cache-size`, oldest forgotten first). The cache is in memory: a restart
//! starts it empty.
//!
//! Only a new message is judged. One that comes back (a dead letter, a delayed release, or a
//! publish of a message that was dead-lettered or moved before: it carries `x-death` or
//! [`MOVED_HEADER`]) is neither dropped nor remembered: its first copy is what it is, and
//! dropping it would lose the only one left. A key is remembered only once a copy was taken
//! (enqueued, not refused), with the store batch that writes it: a duplicate's confirm waits
//! for that write, and a failed write makes the key new again.

use crate::holds::{HoldState, Holds};
use std::collections::{HashMap, VecDeque};

use bytes::Bytes;
use sha2::{Digest, Sha256};
use warren_codec::properties::BasicProperties;
use warren_codec::{CodecError, FieldTable, FieldValue};

/// The header that names a message's key when `x-deduplication-header` is not given.
pub const DEFAULT_HEADER: &str = "x-deduplication-header";
/// Keys remembered when `x-cache-size` is not given (LavinMQ remembers 128, which a busy
/// publisher fills in milliseconds; Warren's window is meant to hold minutes of traffic).
pub const DEFAULT_SIZE: usize = 100_000;
/// How long a key is remembered when `x-cache-ttl` is not given: SQS FIFO's five minutes.
pub const DEFAULT_TTL_MS: u64 = 5 * 60 * 1000;
/// The most keys a window holds: a key costs about 130 bytes, so a full window 130 MB or more.
pub const MAX_SIZE: usize = 1_000_000;
/// The longest window, ms: seven days (Azure Service Bus's longest duplicate detection).
pub const MAX_TTL_MS: u64 = 7 * 24 * 60 * 60 * 1000;
/// The header `warren move` and `warren redrive` give what they move (the source queue's
/// name): such a publish is not a new message, and deduplication lets it through.
pub const MOVED_HEADER: &str = "x-moved-from";

/// What a declaration asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DedupSpec {
    pub size: usize,
    pub ttl_ms: u64,
    pub header: String,
}

/// A malformed deduplication argument: the argument, and the reason as RabbitMQ prints it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArgError {
    pub key: &'static str,
    pub reason: String,
}

impl ArgError {
    /// RabbitMQ's text for a bad argument of `rs` (`queue 'q' in vhost '/'`).
    pub fn message(&self, rs: &str) -> String {
        format!("invalid arg '{}' for {rs}: {}", self.key, self.reason)
    }
}

/// Reads the deduplication arguments of a queue or exchange declaration: `None` when
/// `x-message-deduplication` is absent or false. A size or window above [`MAX_SIZE`] /
/// [`MAX_TTL_MS`] is refused (`{value_too_large,N}`), as RabbitMQ refuses an `x-expires` past
/// its limit: a declaration must not silently get a shorter window than it asked for.
pub fn spec(args: &FieldTable) -> Result<Option<DedupSpec>, ArgError> {
    let text = |key, reason: String| ArgError {
        key,
        reason: crate::erl::quoted(&reason),
    };
    match args.get("x-message-deduplication") {
        None | Some(FieldValue::Bool(false)) => return Ok(None),
        Some(FieldValue::Bool(true)) => {}
        Some(other) => {
            let reason = format!(
                "x-message-deduplication must be a boolean, not {}",
                other.type_name()
            );
            return Err(text("x-message-deduplication", reason));
        }
    }
    let int = |key: &'static str, max: u64, zero: bool| -> Result<Option<u64>, ArgError> {
        let Some(v) = args.get(key) else {
            return Ok(None);
        };
        let tagged = |tag: &str, n: i64| ArgError {
            key,
            reason: format!("{{{tag},{n}}}"),
        };
        match v.as_i64().filter(|_| !matches!(v, FieldValue::Bool(_))) {
            None => Err(text(
                key,
                format!("expected integer, got {}", v.type_name()),
            )),
            Some(n) if n < 0 => Err(tagged("value_negative", n)),
            Some(0) if !zero => Err(tagged("value_zero", 0)),
            Some(n) if n as u64 > max => Err(tagged("value_too_large", n)),
            Some(n) => Ok(Some(n as u64)),
        }
    };
    let size = int("x-cache-size", MAX_SIZE as u64, false)?
        .map_or(DEFAULT_SIZE, |n| usize::try_from(n).unwrap_or(MAX_SIZE));
    let ttl_ms = int("x-cache-ttl", MAX_TTL_MS, true)?.unwrap_or(DEFAULT_TTL_MS);
    let header = match args.get("x-deduplication-header") {
        None => DEFAULT_HEADER.to_string(),
        Some(v) => v
            .as_str()
            .filter(|h| !h.is_empty())
            .ok_or_else(|| {
                text(
                    "x-deduplication-header",
                    "x-deduplication-header must name a header".to_string(),
                )
            })?
            .to_string(),
    };
    Ok(Some(DedupSpec {
        size,
        ttl_ms,
        header,
    }))
}

/// Recovery: the arguments of a queue or exchange stored before [`MAX_SIZE`] and
/// [`MAX_TTL_MS`] were enforced, with a larger size or window brought down to the limit
/// (`None` when nothing is over): refusing them would leave the queue and its messages
/// unrecovered.
pub fn clamped(args: &FieldTable) -> Option<FieldTable> {
    let over = |key: &str, max: u64| {
        args.get(key)
            .and_then(FieldValue::as_i64)
            .is_some_and(|n| n > 0 && n as u64 > max)
    };
    let limits = [
        ("x-cache-size", MAX_SIZE as u64),
        ("x-cache-ttl", MAX_TTL_MS),
    ];
    if !limits.iter().any(|(key, max)| over(key, *max)) {
        return None;
    }
    let mut out = args.clone();
    for (key, max) in limits {
        if over(key, max) {
            out.insert(key, FieldValue::I64(max as i64));
        }
    }
    Some(out)
}

/// Does this message come back rather than arrive (dead-lettered or moved before)? Such a
/// message is never judged: it may be the only copy left of one seen in the window.
pub fn comes_back(headers: Option<&FieldTable>) -> bool {
    headers.is_some_and(|h| h.contains_key("x-death") || h.contains_key(MOVED_HEADER))
}

/// `properties` with [`MOVED_HEADER`] set to `from`: a message moved out of queue `from`,
/// which deduplication lets through.
pub fn moved_properties(properties: &Bytes, from: &str) -> Result<Bytes, CodecError> {
    let mut props = BasicProperties::decode_bytes(properties.clone())?;
    let mut headers = props.headers.take().unwrap_or_default();
    headers.insert(MOVED_HEADER, FieldValue::long_str(from));
    props.headers = Some(headers);
    Ok(props.encode())
}

/// How far the store got: batches up to `written` are on disk; those after it up to `failed`
/// were reported failed (the store may still retry them, but their publishers were nacked).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Disk {
    pub written: u64,
    pub failed: u64,
}

/// A key as remembered: up to [`INLINE`] bytes verbatim, a longer one as its SHA-256 digest.
/// Either way it is copied out of the message: a key that sliced the message's properties
/// would hold the whole network read buffer they came in, for as long as the window lasts.
/// Its size is fixed, so a window's memory is bounded by its number of keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Key {
    /// The length of a verbatim key, or [`DIGEST`].
    tag: u8,
    bytes: [u8; INLINE],
}

const INLINE: usize = 32;
const DIGEST: u8 = u8::MAX;

impl Key {
    fn of(raw: &[u8]) -> Key {
        let mut bytes = [0u8; INLINE];
        match bytes.get_mut(..raw.len()) {
            Some(head) => {
                head.copy_from_slice(raw);
                Key {
                    tag: raw.len() as u8,
                    bytes,
                }
            }
            None => {
                bytes.copy_from_slice(&Sha256::digest(raw));
                Key { tag: DIGEST, bytes }
            }
        }
    }
}

/// The window's verdict on a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// No key, or the message comes back: let it through, remember nothing.
    Unjudged,
    /// Not seen (or its first copy's write failed): let it through, and [`Dedup::remember`]
    /// it once it was taken.
    New(Pending),
    /// Seen: drop it. Its confirm waits for `batch`, the write of the first copy, if that is
    /// still on its way to disk, and for the first copy's channel hold (0: none), if that is
    /// still waiting for replicated entries ([`crate::holds`]).
    Duplicate { batch: Option<u64>, hold: u64 },
}

/// A key to remember once its message was taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pending {
    key: Key,
    /// The message's own `x-cache-ttl`, if it has one.
    ttl_ms: Option<u64>,
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    /// Forgotten at.
    until: u64,
    /// Insertion number (tells the live entry in `order`).
    number: u64,
    /// The store batch writing the first copy, while it may not be on disk yet.
    batch: Option<u64>,
    /// The channel hold the first copy's confirm waited in (0: none).
    hold: u64,
}

/// The keys seen within the window.
#[derive(Clone, Debug)]
pub struct Dedup {
    spec: DedupSpec,
    seen: HashMap<Key, Entry>,
    /// Keys in insertion order (a key inserted again after it was forgotten appears twice; the
    /// map's insertion number tells the live entry).
    order: VecDeque<(Key, u64)>,
    next: u64,
    /// Duplicates dropped since the window was made.
    dropped: u64,
}

/// What a window holds, for the management API.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DedupStats {
    pub keys: u64,
    /// The memory its tables hold (their capacity, not only the keys in use).
    pub memory_bytes: u64,
    pub dropped: u64,
}

impl Dedup {
    pub fn new(spec: DedupSpec) -> Self {
        Dedup {
            spec,
            seen: HashMap::new(),
            order: VecDeque::new(),
            next: 0,
            dropped: 0,
        }
    }

    /// Judges a message (its decoded `headers` and raw `properties`) at `now`. Remembers
    /// nothing: see [`Dedup::remember`].
    pub fn judge(
        &mut self,
        headers: Option<&FieldTable>,
        properties: &Bytes,
        now: u64,
        disk: Disk,
        holds: Option<&Holds>,
    ) -> Verdict {
        if comes_back(headers) {
            return Verdict::Unjudged;
        }
        let Some(key) = key(headers, &self.spec.header, properties) else {
            return Verdict::Unjudged;
        };
        if let Some(entry) = self.seen.get_mut(&key).filter(|e| now < e.until) {
            let lost =
                entry.hold != 0 && holds.is_some_and(|h| h.state(entry.hold) == HoldState::Lost);
            let duplicate = match entry.batch {
                // The first copy's entry was lost (and its publisher nacked): a retry.
                _ if lost => None,
                Some(b) if b <= disk.written => {
                    entry.batch = None;
                    Some(None)
                }
                // The first copy's publisher was nacked: this is its retry, not a duplicate.
                Some(b) if b <= disk.failed => None,
                batch => Some(batch),
            };
            if let Some(batch) = duplicate {
                self.dropped += 1;
                return Verdict::Duplicate {
                    batch,
                    hold: entry.hold,
                };
            }
        }
        Verdict::New(Pending {
            key,
            ttl_ms: own_ttl(headers),
        })
    }

    /// The window a replicated queue's machine keeps for this message
    /// ([`warren_queue::machine::DedupWindow`]): its key, how long to remember it and the most
    /// keys to keep. `None` for a message without a key, or one that comes back (as
    /// [`Dedup::judge`] lets it through).
    pub fn window(
        &self,
        headers: Option<&FieldTable>,
        properties: &Bytes,
    ) -> Option<warren_queue::machine::DedupWindow> {
        if comes_back(headers) {
            return None;
        }
        let key = key(headers, &self.spec.header, properties)?;
        let ttl_ms = own_ttl(headers).unwrap_or(self.spec.ttl_ms);
        Some(warren_queue::machine::DedupWindow {
            key: warren_queue::machine::DedupKey {
                len: key.tag,
                bytes: key.bytes,
            },
            ttl_ms,
            max_keys: u32::try_from(self.spec.size).unwrap_or(u32::MAX),
        })
    }

    /// Remembers the key of a message that was taken, with the store batch that writes it
    /// (`None`: nothing to wait for) and the channel hold its confirm waits in (0: none).
    pub fn remember(&mut self, pending: Pending, batch: Option<u64>, hold: u64, now: u64) {
        let ttl = pending.ttl_ms.unwrap_or(self.spec.ttl_ms);
        let number = self.next;
        self.next += 1;
        let entry = Entry {
            until: now.saturating_add(ttl),
            number,
            batch,
            hold,
        };
        self.seen.insert(pending.key, entry);
        self.order.push_back((pending.key, number));
        self.forget(now);
    }

    /// Forgets the oldest keys past the size limit, and expired keys at the front.
    fn forget(&mut self, now: u64) {
        while let Some((key, number)) = self.order.front() {
            let live = self.seen.get(key).filter(|e| e.number == *number).copied();
            let drop = match live {
                None => true,
                Some(e) => self.seen.len() > self.spec.size || e.until <= now,
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

    /// Forgets the keys whose first copies waited in one of `holds`, which were lost: their
    /// publishers were nacked, so a retry must be taken, not dropped as a duplicate.
    pub fn forget_holds(&mut self, holds: &std::collections::BTreeSet<u64>) {
        // Their places in `order` stay until they reach its front: a key is live only while
        // its number matches.
        self.seen
            .retain(|_, e| e.hold == 0 || !holds.contains(&e.hold));
    }

    /// One more duplicate dropped, by a replicated queue's machine.
    pub fn count_dropped(&mut self) {
        self.dropped += 1;
    }

    /// Keys remembered.
    pub fn len(&self) -> usize {
        self.seen.len()
    }

    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
    }

    pub fn stats(&self) -> DedupStats {
        // A hash table slot holds the pair and a control byte.
        let slot = std::mem::size_of::<(Key, Entry)>() + 1;
        let memory =
            self.seen.capacity() * slot + self.order.capacity() * std::mem::size_of::<(Key, u64)>();
        DedupStats {
            keys: self.seen.len() as u64,
            memory_bytes: memory as u64,
            dropped: self.dropped,
        }
    }
}

/// A message's own window for its key (its `x-cache-ttl` header, up to [`MAX_TTL_MS`]).
fn own_ttl(headers: Option<&FieldTable>) -> Option<u64> {
    headers
        .and_then(|h| h.get("x-cache-ttl"))
        .and_then(FieldValue::as_i64)
        .and_then(|n| u64::try_from(n).ok())
        .map(|n| n.min(MAX_TTL_MS))
}

/// A message's deduplication key: the named header's value (a string's bytes, a number's
/// digits), else its `message-id`.
fn key(headers: Option<&FieldTable>, header: &str, properties: &Bytes) -> Option<Key> {
    if let Some(v) = headers.and_then(|h| h.get(header)) {
        match v {
            FieldValue::LongStr(b) | FieldValue::ByteArray(b) => return Some(Key::of(b)),
            other => {
                if let Some(n) = other.as_i64() {
                    return Some(Key::of(n.to_string().as_bytes()));
                }
            }
        }
    }
    warren_codec::properties::message_id(properties).map(|id| Key::of(id.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use warren_codec::ShortStr;

    fn props(dedup: Option<&str>, message_id: Option<&str>, ttl: Option<i32>) -> Bytes {
        let mut h = FieldTable::new();
        if let Some(k) = dedup {
            h.insert(DEFAULT_HEADER, FieldValue::long_str(k));
        }
        if let Some(t) = ttl {
            h.insert("x-cache-ttl", FieldValue::I32(t));
        }
        BasicProperties {
            headers: Some(h),
            message_id: message_id.map(|m| ShortStr::from_string(m.to_owned())),
            ..BasicProperties::default()
        }
        .encode()
    }

    const DISK: Disk = Disk {
        written: 0,
        failed: 0,
    };

    fn verdict(d: &mut Dedup, p: &Bytes, now: u64, disk: Disk) -> Verdict {
        let headers = warren_codec::properties::headers(p).unwrap();
        d.judge(headers.as_ref(), p, now, disk, None)
    }

    /// The old `is_duplicate`: judged, and remembered at once if new (no write to wait for).
    fn seen(d: &mut Dedup, p: Bytes, now: u64) -> bool {
        match verdict(d, &p, now, DISK) {
            Verdict::Duplicate { .. } => true,
            Verdict::New(pending) => {
                d.remember(pending, None, 0, now);
                false
            }
            Verdict::Unjudged => false,
        }
    }

    fn args(pairs: &[(&str, FieldValue)]) -> FieldTable {
        let mut t = FieldTable::new();
        for (k, v) in pairs {
            t.insert(ShortStr::from_string(k.to_string()), v.clone());
        }
        t
    }

    fn on(more: &[(&str, FieldValue)]) -> FieldTable {
        let mut t = args(&[("x-message-deduplication", FieldValue::Bool(true))]);
        for (k, v) in more {
            t.insert(ShortStr::from_string(k.to_string()), v.clone());
        }
        t
    }

    fn window(size: usize, ttl_ms: u64) -> Dedup {
        Dedup::new(DedupSpec {
            size,
            ttl_ms,
            header: DEFAULT_HEADER.into(),
        })
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
        let s = spec(&on(&[])).unwrap().unwrap();
        assert_eq!(
            s,
            DedupSpec {
                size: DEFAULT_SIZE,
                ttl_ms: DEFAULT_TTL_MS,
                header: DEFAULT_HEADER.into()
            }
        );
        let s = spec(&on(&[
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
        let at_limits = on(&[
            ("x-cache-size", FieldValue::I64(MAX_SIZE as i64)),
            ("x-cache-ttl", FieldValue::I64(MAX_TTL_MS as i64)),
        ]);
        let s = spec(&at_limits).unwrap().unwrap();
        assert_eq!((s.size, s.ttl_ms), (MAX_SIZE, MAX_TTL_MS));
    }

    #[test]
    fn malformed_or_too_large_arguments_are_refused_as_rabbitmq_words_it() {
        let rs = "queue 'q' in vhost '/'";
        let cases = [
            (
                args(&[("x-message-deduplication", FieldValue::long_str("yes"))]),
                "invalid arg 'x-message-deduplication' for queue 'q' in vhost '/': \"x-message-deduplication must be a boolean, not longstr\"",
            ),
            (
                on(&[("x-cache-size", FieldValue::I32(0))]),
                "invalid arg 'x-cache-size' for queue 'q' in vhost '/': {value_zero,0}",
            ),
            (
                on(&[("x-cache-size", FieldValue::I64(MAX_SIZE as i64 + 1))]),
                "invalid arg 'x-cache-size' for queue 'q' in vhost '/': {value_too_large,1000001}",
            ),
            (
                on(&[("x-cache-size", FieldValue::I64(i64::MAX))]),
                "invalid arg 'x-cache-size' for queue 'q' in vhost '/': {value_too_large,9223372036854775807}",
            ),
            (
                on(&[("x-cache-ttl", FieldValue::I32(-1))]),
                "invalid arg 'x-cache-ttl' for queue 'q' in vhost '/': {value_negative,-1}",
            ),
            (
                on(&[("x-cache-ttl", FieldValue::I64(MAX_TTL_MS as i64 + 1))]),
                "invalid arg 'x-cache-ttl' for queue 'q' in vhost '/': {value_too_large,604800001}",
            ),
            (
                on(&[("x-cache-ttl", FieldValue::long_str("60000"))]),
                "invalid arg 'x-cache-ttl' for queue 'q' in vhost '/': \"expected integer, got longstr\"",
            ),
            (
                on(&[("x-deduplication-header", FieldValue::long_str(""))]),
                "invalid arg 'x-deduplication-header' for queue 'q' in vhost '/': \"x-deduplication-header must name a header\"",
            ),
        ];
        for (bad, text) in cases {
            assert_eq!(spec(&bad).map_err(|e| e.message(rs)), Err(text.to_string()));
        }
    }

    #[test]
    fn recovery_brings_a_window_stored_over_the_limits_down_to_them() {
        assert_eq!(clamped(&on(&[("x-cache-size", FieldValue::I32(5))])), None);
        let stored = on(&[
            ("x-cache-size", FieldValue::I64(5_000_000)),
            ("x-cache-ttl", FieldValue::I64(i64::MAX)),
        ]);
        let fixed = clamped(&stored).expect("over the limits");
        let s = spec(&fixed).unwrap().unwrap();
        assert_eq!((s.size, s.ttl_ms), (MAX_SIZE, MAX_TTL_MS));
    }

    #[test]
    fn a_key_seen_in_the_window_is_a_duplicate_and_forgotten_after_it() {
        let mut d = window(3, 100);
        assert!(!seen(&mut d, props(Some("a"), None, None), 0));
        assert!(seen(&mut d, props(Some("a"), None, None), 99));
        assert!(
            !seen(&mut d, props(Some("a"), None, None), 100),
            "window over"
        );
        // The message-id when the header is absent; no key at all: never a duplicate.
        assert!(!seen(&mut d, props(None, Some("m1"), None), 100));
        assert!(seen(&mut d, props(None, Some("m1"), None), 101));
        assert!(!seen(&mut d, props(None, None, None), 101));
        assert!(!seen(&mut d, props(None, None, None), 101));
        // A message's own x-cache-ttl.
        assert!(!seen(&mut d, props(Some("short"), None, Some(5)), 101));
        assert!(!seen(&mut d, props(Some("short"), None, None), 106));
        // The size bound forgets the oldest.
        for k in ["k1", "k2", "k3"] {
            assert!(!seen(&mut d, props(Some(k), None, None), 110));
        }
        assert!(d.len() <= 3);
        assert!(!seen(&mut d, props(None, Some("m1"), None), 111), "evicted");
        assert!(seen(&mut d, props(Some("k3"), None, None), 111));
        assert_eq!(d.stats().dropped, 3);
    }

    #[test]
    fn a_key_is_remembered_only_when_told_so() {
        let mut d = window(10, 1000);
        let p = props(Some("k"), None, None);
        assert!(matches!(verdict(&mut d, &p, 0, DISK), Verdict::New(_)));
        // Not remembered (the copy was refused, say): the retry is new as well.
        assert!(matches!(verdict(&mut d, &p, 1, DISK), Verdict::New(_)));
        assert!(d.is_empty());
    }

    #[test]
    fn a_duplicate_waits_for_its_first_copys_write_and_a_failed_write_makes_the_key_new() {
        let mut d = window(10, 1000);
        let p = props(Some("k"), None, None);
        let Verdict::New(pending) = verdict(&mut d, &p, 0, DISK) else {
            panic!("new");
        };
        d.remember(pending, Some(7), 0, 0);
        let disk = |written, failed| Disk { written, failed };
        // Batch 7 not written yet: the duplicate's confirm waits for it.
        assert_eq!(
            verdict(&mut d, &p, 1, disk(6, 0)),
            Verdict::Duplicate {
                batch: Some(7),
                hold: 0
            }
        );
        // Failed: the first copy's publisher was nacked, so this is its retry.
        let Verdict::New(pending) = verdict(&mut d, &p, 2, disk(6, 7)) else {
            panic!("a nacked first copy leaves its retry new");
        };
        d.remember(pending, Some(9), 0, 2);
        assert_eq!(
            verdict(&mut d, &p, 3, disk(8, 7)),
            Verdict::Duplicate {
                batch: Some(9),
                hold: 0
            }
        );
        // Written: nothing to wait for, and that is remembered.
        assert_eq!(
            verdict(&mut d, &p, 4, disk(9, 7)),
            Verdict::Duplicate {
                batch: None,
                hold: 0
            }
        );
        assert_eq!(
            verdict(&mut d, &p, 5, disk(0, 100)),
            Verdict::Duplicate {
                batch: None,
                hold: 0
            }
        );
    }

    #[test]
    fn a_message_that_comes_back_is_not_judged() {
        let mut d = window(10, 1000);
        assert!(!seen(&mut d, props(Some("k"), None, None), 0));
        for header in ["x-death", MOVED_HEADER] {
            let mut h = FieldTable::new();
            h.insert(DEFAULT_HEADER, FieldValue::long_str("k"));
            h.insert(header, FieldValue::long_str("dlq"));
            let p = BasicProperties {
                headers: Some(h),
                ..BasicProperties::default()
            }
            .encode();
            assert_eq!(verdict(&mut d, &p, 1, DISK), Verdict::Unjudged, "{header}");
        }
    }

    #[test]
    fn a_message_moved_by_the_api_is_marked_and_let_through() {
        let mut d = window(10, 1000);
        let p = props(Some("k"), Some("m-1"), None);
        assert!(!seen(&mut d, p.clone(), 0));
        let m = moved_properties(&p, "jobs.dead").unwrap();
        assert_eq!(warren_codec::properties::message_id(&m), Some("m-1"));
        assert_eq!(verdict(&mut d, &m, 1, DISK), Verdict::Unjudged);
        let again = moved_properties(&m, "other").unwrap();
        let h = warren_codec::properties::headers(&again).unwrap().unwrap();
        assert_eq!(
            h.get(MOVED_HEADER).and_then(FieldValue::as_str),
            Some("other")
        );
        assert_eq!(
            h.get(DEFAULT_HEADER).and_then(FieldValue::as_str),
            Some("k")
        );
    }

    #[test]
    fn a_remembered_key_does_not_hold_the_buffer_its_header_came_in() {
        // A network read buffer holding a message's properties among much else.
        let key = "order-1234";
        let encoded = props(Some(key), None, None);
        let mut raw = vec![0u8; 128 * 1024];
        raw[..encoded.len()].copy_from_slice(&encoded);
        let buffer = Bytes::from(raw);
        let properties = buffer.slice(..encoded.len());
        let mut d = window(10, 1000);
        assert!(!seen(&mut d, properties.clone(), 0));
        drop(properties);
        assert!(
            buffer.is_unique(),
            "the window keeps a slice of the read buffer alive"
        );
        let mut other = vec![0u8; 128 * 1024];
        other[..encoded.len()].copy_from_slice(&encoded);
        assert!(seen(&mut d, Bytes::from(other).slice(..encoded.len()), 1));
    }

    #[test]
    fn a_long_key_is_kept_as_its_digest() {
        let mut d = window(10, 1000);
        let long = "k".repeat(10_000);
        let mut near = long.clone();
        near.push('x');
        assert!(!seen(&mut d, props(Some(&long), None, None), 0));
        assert!(seen(&mut d, props(Some(&long), None, None), 1));
        assert!(!seen(&mut d, props(Some(&near), None, None), 2));
        // A verbatim key of a digest's length is another key.
        let short = "k".repeat(INLINE);
        assert!(!seen(&mut d, props(Some(&short), None, None), 3));
        assert!(seen(&mut d, props(Some(&short), None, None), 4));
        // A key's memory does not grow with its length.
        assert!(std::mem::size_of::<Key>() <= INLINE + 1);
        assert!(d.stats().memory_bytes < 4096, "{:?}", d.stats());
    }
}
