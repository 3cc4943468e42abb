//! warren-queue: the queue state machine and its command log.
//!
//! A queue is a pure function of the commands it is given ([`machine::QueueMachine::apply`],
//! modelled on RabbitMQ's `rabbit_fifo`): no I/O, no clock reads, time arrives in
//! [`machine::Meta`]. The broker drives it on a single node today; a replicated queue applies
//! the same commands from a committed Raft log on every member. This crate depends on the
//! codec alone, so the broker and the replication layer can both sit on top of it.

pub mod log;
pub mod machine;
pub mod stable_hash;

use bytes::Bytes;
use warren_codec::ShortStr;

/// Identifies a client connection for the life of the broker.
pub type ConnId = u64;

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
