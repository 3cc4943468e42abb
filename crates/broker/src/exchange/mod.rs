//! Exchanges and their bindings.
//!
//! Each exchange keeps its bindings twice: a canonical set (binding = destination, key,
//! arguments, as RabbitMQ identifies them) and an index shaped for its type, so routing
//! costs what the type needs: a hash lookup (direct), a trie walk (topic), a scan with a
//! merge per binding (headers), every destination (fanout).

pub mod headers;
pub mod topic;

use std::collections::HashMap;

use bytes::Bytes;

use warren_codec::{FieldTable, FieldValue, ShortStr};

use crate::QueueId;
use headers::HeadersSpec;
use topic::TopicTrie;

/// A message's headers, parsed from the raw properties only if a headers exchange asks.
#[derive(Debug)]
pub struct LazyHeaders<'a> {
    raw: Option<&'a Bytes>,
    parsed: Option<Vec<(ShortStr, FieldValue)>>,
}

impl<'a> LazyHeaders<'a> {
    /// Headers to be read from raw basic properties.
    pub fn new(raw_properties: &'a Bytes) -> Self {
        LazyHeaders {
            raw: Some(raw_properties),
            parsed: None,
        }
    }

    /// Already parsed headers (any order).
    pub fn parsed(headers: Vec<(ShortStr, FieldValue)>) -> Self {
        LazyHeaders {
            raw: None,
            parsed: Some(headers::sorted_headers(Some(FieldTable(headers)))),
        }
    }

    /// The headers sorted by key; malformed or missing headers read as none.
    pub fn get(&mut self) -> &[(ShortStr, FieldValue)] {
        let raw = self.raw;
        self.parsed.get_or_insert_with(|| {
            let table = raw.and_then(|r| warren_codec::properties::headers(r).ok().flatten());
            headers::sorted_headers(table)
        })
    }
}

/// The exchange types Warren knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ExchangeKind {
    Direct,
    Fanout,
    Topic,
    Headers,
}

impl ExchangeKind {
    /// Parses an exchange.declare `type`.
    pub fn parse(s: &str) -> Option<ExchangeKind> {
        match s {
            "direct" => Some(ExchangeKind::Direct),
            "fanout" => Some(ExchangeKind::Fanout),
            "topic" => Some(ExchangeKind::Topic),
            "headers" => Some(ExchangeKind::Headers),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ExchangeKind::Direct => "direct",
            ExchangeKind::Fanout => "fanout",
            ExchangeKind::Topic => "topic",
            ExchangeKind::Headers => "headers",
        }
    }
}

/// Where a binding leads.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Dest {
    Queue(QueueId),
    Exchange(ShortStr),
}

#[derive(Clone, Debug)]
enum Index {
    /// routing key -> destinations (once per binding).
    Direct(HashMap<ShortStr, Vec<Dest>>),
    /// Fanout routes to every destination of the canonical set.
    Fanout,
    Topic(TopicTrie<Dest>),
    Headers(Vec<(Dest, FieldTable, HeadersSpec)>),
}

/// An exchange.
#[derive(Clone, Debug)]
pub struct Exchange {
    pub name: ShortStr,
    /// How it routes (an `x-delayed-message` exchange routes as its `x-delayed-type`).
    pub kind: ExchangeKind,
    /// An `x-delayed-message` exchange: a message with a positive `x-delay` header is held
    /// back that many milliseconds, then routed.
    pub delayed: bool,
    /// A delayed exchange's number, which no other queue or exchange gets (kept with a
    /// durable one's declaration): messages it holds belong to this incarnation. `None` for
    /// other exchanges, and for a delayed one stored before the number was kept.
    pub incarnation: Option<u64>,
    /// The deduplication window (`x-message-deduplication`).
    pub dedup: Option<Box<crate::dedup::Dedup>>,
    pub durable: bool,
    pub auto_delete: bool,
    pub internal: bool,
    pub arguments: FieldTable,
    /// The user policy that applies to it, if any.
    pub policy: Option<String>,
    /// That policy's `alternate-exchange` (its own argument comes first).
    pub policy_alternate: Option<ShortStr>,
    /// Canonical bindings with this exchange as source: (destination, key) -> the argument
    /// tables of the bindings with that destination and key.
    bindings: HashMap<(Dest, ShortStr), Vec<FieldTable>>,
    binding_count: usize,
    index: Index,
    /// Bindings with this exchange as destination: (source, key, arguments).
    pub(crate) incoming: Vec<(ShortStr, ShortStr, FieldTable)>,
}

impl Exchange {
    pub fn new(
        name: ShortStr,
        kind: ExchangeKind,
        durable: bool,
        auto_delete: bool,
        internal: bool,
        arguments: FieldTable,
    ) -> Exchange {
        let index = match kind {
            ExchangeKind::Direct => Index::Direct(HashMap::new()),
            ExchangeKind::Fanout => Index::Fanout,
            ExchangeKind::Topic => Index::Topic(TopicTrie::new()),
            ExchangeKind::Headers => Index::Headers(Vec::new()),
        };
        Exchange {
            name,
            kind,
            delayed: false,
            incarnation: None,
            dedup: None,
            durable,
            auto_delete,
            internal,
            arguments,
            policy: None,
            policy_alternate: None,
            bindings: HashMap::new(),
            binding_count: 0,
            index,
            incoming: Vec::new(),
        }
    }

    /// This incarnation, as the holder of the messages it delays.
    pub fn holder(&self) -> crate::delayed::Holder {
        self.incarnation.map_or(
            crate::delayed::Holder::Any,
            crate::delayed::Holder::Incarnation,
        )
    }

    /// Number of bindings with this exchange as source.
    pub fn binding_count(&self) -> usize {
        self.binding_count
    }

    pub fn has_binding(&self, dest: &Dest, key: &ShortStr, args: &FieldTable) -> bool {
        self.bindings
            .get(&(dest.clone(), key.clone()))
            .is_some_and(|v| v.contains(args))
    }

    /// Adds a binding. False if it already exists.
    pub fn bind(&mut self, dest: Dest, key: ShortStr, args: FieldTable) -> bool {
        let entry = self
            .bindings
            .entry((dest.clone(), key.clone()))
            .or_default();
        if entry.contains(&args) {
            return false;
        }
        entry.push(args.clone());
        self.binding_count += 1;
        match &mut self.index {
            Index::Direct(map) => map.entry(key).or_default().push(dest),
            Index::Fanout => {}
            Index::Topic(trie) => trie.insert(&key, dest),
            Index::Headers(list) => {
                let spec = HeadersSpec::parse(&args);
                list.push((dest, args, spec));
            }
        }
        true
    }

    /// Removes a binding. False if it does not exist.
    pub fn unbind(&mut self, dest: &Dest, key: &ShortStr, args: &FieldTable) -> bool {
        let k = (dest.clone(), key.clone());
        let Some(list) = self.bindings.get_mut(&k) else {
            return false;
        };
        let Some(pos) = list.iter().position(|a| a == args) else {
            return false;
        };
        list.swap_remove(pos);
        if list.is_empty() {
            self.bindings.remove(&k);
        }
        self.binding_count -= 1;
        match &mut self.index {
            Index::Direct(map) => {
                if let Some(v) = map.get_mut(key) {
                    if let Some(i) = v.iter().position(|d| d == dest) {
                        v.swap_remove(i);
                    }
                    if v.is_empty() {
                        map.remove(key);
                    }
                }
            }
            Index::Fanout => {}
            Index::Topic(trie) => {
                trie.remove(key, dest);
            }
            Index::Headers(list) => {
                if let Some(i) = list.iter().position(|(d, a, _)| d == dest && a == args) {
                    list.swap_remove(i);
                }
            }
        }
        true
    }

    /// Every binding with this exchange as source, as (destination, key, arguments).
    pub fn bindings(&self) -> impl Iterator<Item = (&Dest, &ShortStr, &FieldTable)> + '_ {
        self.bindings
            .iter()
            .flat_map(|((d, k), args)| args.iter().map(move |a| (d, k, a)))
    }

    /// Appends the destinations a message with this routing key and these (lazily parsed,
    /// sorted) headers goes to. Destinations may repeat; the caller dedups.
    pub fn route(&self, routing_key: &str, headers: &mut LazyHeaders<'_>, out: &mut Vec<Dest>) {
        match &self.index {
            Index::Direct(map) => {
                if let Some(v) = map.get(routing_key) {
                    out.extend(v.iter().cloned());
                }
            }
            Index::Fanout => out.extend(self.bindings.keys().map(|(d, _)| d.clone())),
            Index::Topic(trie) => trie.matches(routing_key, out),
            Index::Headers(list) => {
                if list.is_empty() {
                    return;
                }
                let data = headers.get();
                for (dest, _, spec) in list {
                    if spec.matches(data) {
                        out.push(dest.clone());
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn x(kind: ExchangeKind) -> Exchange {
        Exchange::new("x".into(), kind, false, false, false, FieldTable::new())
    }

    fn q(n: u64) -> Dest {
        Dest::Queue(QueueId(n))
    }

    fn route(x: &Exchange, key: &str, hdrs: &[(ShortStr, FieldValue)]) -> Vec<Dest> {
        let mut out = Vec::new();
        let mut h = LazyHeaders::parsed(hdrs.to_vec());
        x.route(key, &mut h, &mut out);
        out.sort();
        out.dedup();
        out
    }

    #[test]
    fn direct() {
        let mut e = x(ExchangeKind::Direct);
        assert!(e.bind(q(1), "a".into(), FieldTable::new()));
        assert!(!e.bind(q(1), "a".into(), FieldTable::new()));
        let mut args = FieldTable::new();
        args.insert("k", FieldValue::I32(1));
        assert!(e.bind(q(1), "a".into(), args.clone()));
        assert!(e.bind(q(2), "b".into(), FieldTable::new()));
        assert!(e.bind(Dest::Exchange("y".into()), "a".into(), FieldTable::new()));
        assert_eq!(e.binding_count(), 4);
        assert_eq!(route(&e, "a", &[]), vec![q(1), Dest::Exchange("y".into())]);
        assert_eq!(route(&e, "b", &[]), vec![q(2)]);
        assert!(route(&e, "c", &[]).is_empty());
        assert!(e.unbind(&q(1), &"a".into(), &FieldTable::new()));
        // Still bound through the binding with arguments.
        assert_eq!(route(&e, "a", &[]), vec![q(1), Dest::Exchange("y".into())]);
        assert!(e.unbind(&q(1), &"a".into(), &args));
        assert!(!e.unbind(&q(1), &"a".into(), &args));
        assert_eq!(route(&e, "a", &[]), vec![Dest::Exchange("y".into())]);
        assert_eq!(e.binding_count(), 2);
    }

    #[test]
    fn fanout_ignores_keys() {
        let mut e = x(ExchangeKind::Fanout);
        e.bind(q(1), "a".into(), FieldTable::new());
        e.bind(q(2), "".into(), FieldTable::new());
        assert_eq!(route(&e, "zzz", &[]), vec![q(1), q(2)]);
    }

    #[test]
    fn topic_and_headers() {
        let mut e = x(ExchangeKind::Topic);
        e.bind(q(1), "a.*".into(), FieldTable::new());
        e.bind(q(2), "#".into(), FieldTable::new());
        assert_eq!(route(&e, "a.b", &[]), vec![q(1), q(2)]);
        assert_eq!(route(&e, "b", &[]), vec![q(2)]);
        e.unbind(&q(2), &"#".into(), &FieldTable::new());
        assert!(route(&e, "b", &[]).is_empty());

        let mut h = x(ExchangeKind::Headers);
        let mut args = FieldTable::new();
        args.insert("x-match", "any");
        args.insert("color", "red");
        h.bind(q(1), "".into(), args.clone());
        let hdrs = vec![(ShortStr::from("color"), FieldValue::long_str("red"))];
        assert_eq!(route(&h, "ignored", &hdrs), vec![q(1)]);
        assert!(route(&h, "ignored", &[]).is_empty());
        assert!(h.unbind(&q(1), &"".into(), &args));
        assert!(route(&h, "ignored", &hdrs).is_empty());
    }
}
