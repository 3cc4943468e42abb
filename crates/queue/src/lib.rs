//! warren-queue: the queue state machine and its command log.
//!
//! A queue is a pure function of the commands it is given ([`machine::QueueMachine::apply`],
//! modelled on RabbitMQ's `rabbit_fifo`): no I/O, no clock reads, time arrives in
//! [`machine::Meta`]. The broker drives it on a single node today; a replicated queue applies
//! the same commands from a committed Raft log on every member, and a member far behind starts
//! from a snapshot of the state ([`machine::QueueMachine::snapshot`]). This crate depends on the
//! codec alone, so the broker and the replication layer can both sit on top of it.

pub mod log;
pub mod machine;
pub mod stable_hash;

use bytes::Bytes;
use warren_codec::ShortStr;

/// Identifies a client connection for the life of the broker. Node-qualified (see
/// [`qualify`]): the node the connection is on is [`node_of`] its id.
pub type ConnId = u64;

/// A node of a cluster. Node 0 is a node on its own: every id minted before clustering (and
/// every id in a log or store written then) is an id of node 0.
pub type NodeId = u16;

/// Ids that must not collide across nodes (connections, consumers, enqueuers) keep the node
/// that minted them in their top 16 bits and a per-node counter in the low 48. A node mints
/// ids of its own only, so two nodes never mint the same id; node 0's ids are the plain
/// counter values.
pub const LOCAL_ID_BITS: u32 = 48;

/// The largest per-node counter value an id can carry.
pub const LOCAL_ID_MAX: u64 = (1 << LOCAL_ID_BITS) - 1;

/// The id minted on `node` with counter value `local`; `None` once the counter has outgrown
/// its 48 bits (2.8e14 ids: the node must not reuse any).
pub fn qualify(node: NodeId, local: u64) -> Option<u64> {
    (local <= LOCAL_ID_MAX).then(|| u64::from(node) << LOCAL_ID_BITS | local)
}

/// The node that minted a qualified id.
pub fn node_of(id: u64) -> NodeId {
    // The shift leaves 16 bits: the cast cannot truncate.
    (id >> LOCAL_ID_BITS) as NodeId
}

/// The per-node counter value of a qualified id.
pub fn local_of(id: u64) -> u64 {
    id & LOCAL_ID_MAX
}

/// `x-overflow`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Overflow {
    #[default]
    DropHead,
    RejectPublish,
    RejectPublishDlx,
}

/// A message as routed: every field refcounted, so cloning for fan-out copies no payload and
/// allocates nothing.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Message {
    pub exchange: ShortStr,
    pub routing_key: ShortStr,
    /// Raw content-header property bytes as received (property flags first).
    pub properties: Bytes,
    pub body: Bytes,
    pub persistent: bool,
    /// The key of the stored body, once the broker has written the message to disk (a
    /// persistent message routed to a durable queue); `None` for a message only in memory.
    pub store_key: Option<u64>,
}

/// A header a publisher sets (true) to have its message delivered as redelivered the first
/// time: `warren migrate` sets it on a message its source had delivered before, so that the
/// redelivered flag crosses with it.
pub const REDELIVERED_HEADER: &str = "x-redelivered";

/// What the queue machine reads of a message itself. It is derived from the message's bytes
/// alone, so every replica and every recovery reads the same.
pub trait Payload {
    /// The message says it was delivered before ([`REDELIVERED_HEADER`]).
    fn says_redelivered(&self) -> bool {
        false
    }

    /// The message is going to wait in the queue: it should hold no buffer larger than
    /// itself ([`Message::compact`]).
    fn detach(&mut self) {}
}

impl Payload for u64 {}
/// Test payloads: plain values that never say so.
impl<A, B> Payload for (A, B) {}
impl Payload for &str {}

impl Payload for Message {
    fn detach(&mut self) {
        self.compact();
    }

    fn says_redelivered(&self) -> bool {
        // Most messages stop at the first check (no headers) or the search (headers without
        // the name): the table is decoded only when its bytes hold the name.
        let Some(raw) = warren_codec::properties::headers_raw(&self.properties) else {
            return false;
        };
        // The name as a table key: its length byte, then it.
        static KEY: std::sync::OnceLock<memchr::memmem::Finder<'static>> =
            std::sync::OnceLock::new();
        let key = KEY.get_or_init(|| memchr::memmem::Finder::new(b"\x0dx-redelivered"));
        if key.find(raw).is_none() {
            return false;
        }
        warren_codec::properties::headers(&self.properties)
            .ok()
            .flatten()
            .is_some_and(|h| {
                matches!(
                    h.get(REDELIVERED_HEADER),
                    Some(warren_codec::table::FieldValue::Bool(true))
                )
            })
    }
}

/// Messages smaller than this are copied into one allocation of their own when they are queued.
pub const COMPACT_BELOW: usize = 16 * 1024;

impl Message {
    /// Copies a small message (routing strings, properties, body) into one allocation of its
    /// own. A decoded message is a set of slices of the connection's read buffer (up to 128
    /// KiB); a small message that stays queued for long would otherwise keep that whole buffer
    /// alive. Large bodies are left in place: they are most of their buffer anyway.
    pub fn compact(&mut self) {
        let (x, k, p, b) = (
            self.exchange.len(),
            self.routing_key.len(),
            self.properties.len(),
            self.body.len(),
        );
        let total = x + k + p + b;
        if total >= COMPACT_BELOW {
            return;
        }
        let mut buf = bytes::BytesMut::with_capacity(total);
        buf.extend_from_slice(self.exchange.as_bytes());
        buf.extend_from_slice(self.routing_key.as_bytes());
        buf.extend_from_slice(&self.properties);
        buf.extend_from_slice(&self.body);
        let all = buf.freeze();
        // The strings were valid UTF-8 and are copied byte for byte, so re-wrapping cannot fail;
        // if it somehow did, the original (uncompacted) string is kept.
        if let Ok(s) = ShortStr::try_from_bytes(all.slice(..x)) {
            self.exchange = s;
        }
        if let Ok(s) = ShortStr::try_from_bytes(all.slice(x..x + k)) {
            self.routing_key = s;
        }
        self.properties = all.slice(x + k..x + k + p);
        self.body = all.slice(x + k + p..);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn within(part: &[u8], whole: &[u8]) -> bool {
        let (p, w) = (part.as_ptr() as usize, whole.as_ptr() as usize);
        p >= w && p < w + whole.len()
    }

    #[test]
    fn qualified_ids_keep_node_and_counter_apart() {
        // Node 0's ids are the plain counter: every id minted before clustering stays valid.
        assert_eq!(qualify(0, 41), Some(41));
        assert_eq!((node_of(41), local_of(41)), (0, 41));
        let id = qualify(3, 41).unwrap();
        assert_eq!(id, 3 << 48 | 41);
        assert_eq!((node_of(id), local_of(id)), (3, 41));
        assert_ne!(
            qualify(1, 7),
            qualify(2, 7),
            "two nodes never mint the same id"
        );
        let top = qualify(NodeId::MAX, LOCAL_ID_MAX).unwrap();
        assert_eq!((node_of(top), local_of(top)), (NodeId::MAX, LOCAL_ID_MAX));
        assert_eq!(
            qualify(1, LOCAL_ID_MAX + 1),
            None,
            "a counter past 48 bits is refused"
        );
    }

    #[test]
    fn a_message_says_it_was_delivered_before_only_with_the_header_true() {
        assert_eq!(
            REDELIVERED_HEADER.len(),
            0x0d,
            "the key the search looks for"
        );
        use warren_codec::properties::BasicProperties;
        use warren_codec::table::{FieldTable, FieldValue};
        let with = |headers: Option<FieldTable>| Message {
            exchange: ShortStr::from_static(""),
            routing_key: ShortStr::from_static("q"),
            properties: BasicProperties {
                headers,
                ..BasicProperties::default()
            }
            .encode(),
            body: Bytes::from_static(b"x"),
            persistent: false,
            store_key: None,
        };
        let table = |k: &'static str, v: FieldValue| {
            let mut t = FieldTable::new();
            t.insert(ShortStr::from_static(k), v);
            Some(t)
        };
        assert!(with(table(REDELIVERED_HEADER, FieldValue::Bool(true))).says_redelivered());
        assert!(!with(table(REDELIVERED_HEADER, FieldValue::Bool(false))).says_redelivered());
        assert!(!with(None).says_redelivered());
        // The name as another header's value is not the header.
        assert!(!with(table(
            "note",
            FieldValue::LongStr(Bytes::from_static(b"x-redelivered"))
        ))
        .says_redelivered());
    }

    #[test]
    fn a_small_message_lets_go_of_its_read_buffer_and_a_large_one_does_not_copy() {
        // A 128 KiB "read buffer" holding the message's pieces.
        let mut raw = vec![0u8; 128 * 1024];
        raw[..5].copy_from_slice(b"ex.rk");
        raw[5..8].copy_from_slice(&[0x10, 0, 2]);
        let buffer = Bytes::from(raw);
        let m = Message {
            exchange: ShortStr::try_from_bytes(buffer.slice(0..2)).unwrap(),
            routing_key: ShortStr::try_from_bytes(buffer.slice(3..5)).unwrap(),
            properties: buffer.slice(5..8),
            body: buffer.slice(8..108),
            persistent: true,
            store_key: None,
        };
        let mut small = m.clone();
        small.compact();
        assert_eq!(small, m);
        for part in [
            small.exchange.as_bytes(),
            small.routing_key.as_bytes(),
            &small.properties[..],
            &small.body[..],
        ] {
            assert!(!within(part, &buffer), "still a slice of the read buffer");
        }
        let mut large = Message {
            body: buffer.slice(8..8 + COMPACT_BELOW),
            ..m
        };
        large.compact();
        assert!(within(&large.body, &buffer), "a large body is not copied");
    }
}
