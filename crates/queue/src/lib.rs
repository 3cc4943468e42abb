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
pub mod spill;
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
///
/// Two messages are equal, and hash alike, when their contents are: a message whose contents
/// left memory ([`Message::away`]) equals the one it was made from.
#[derive(Clone, Debug)]
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
    /// Set when the exchange, routing key, properties and body are not here but in this node's
    /// [`AwayStore`] (a deep replicated queue's member keeps only what its machine reads):
    /// those four fields are empty until [`Message::loaded`] reads them back. Node-local:
    /// never in a log entry or a snapshot.
    pub away: Option<triomphe::Arc<Away>>,
}

/// Where a member of a replicated queue keeps the contents of messages that left its memory.
/// Node-local, beside the log (which stays the durable record): each member decides for
/// itself what leaves, and a restart, which rebuilds the machine from its snapshot and log,
/// starts with none away.
pub trait AwayStore: Send + Sync {
    /// Writes the messages' contents; once it returns each can be read under its key (in the
    /// order given). A key is below 2^63 ([`Away`] keeps a flag in the top bit).
    fn put(&self, items: &[&Message]) -> Result<Vec<u64>, String>;
    /// The contents written under `key`, `None` if there are none.
    fn get(&self, key: u64) -> Result<Option<Message>, String>;
    /// Nothing refers to `key` any more: its contents may go. Called as the last handle on
    /// them drops, on whatever thread that is: it must not block for long.
    fn release(&self, key: u64);
    /// How many messages' contents it holds (written and not released).
    fn held(&self) -> u64;

    /// Writes a run of packed messages' handles ([`Payload::spill`]) as one record, and gives
    /// its key. A store that keeps no runs refuses (the default): the run stays in memory. A
    /// store that keeps runs implements the methods below too.
    fn put_run(&self, _bytes: &[u8]) -> Result<u64, String> {
        Err("this store keeps no runs".to_owned())
    }
    /// The record [`AwayStore::put_run`] wrote under `key`.
    fn get_run(&self, key: u64) -> Result<Vec<u8>, String> {
        Err(format!("this store keeps no runs (key {key})"))
    }
    /// The run under `key` is no longer needed.
    fn release_run(&self, _key: u64) {}
    /// Each of `keys` gains a handle: its contents stay until one more
    /// [`AwayStore::release`] of it (a run read back makes a handle of each message again).
    fn retain(&self, _keys: &[u64]) {}
    /// The contents under `keys` stay, whatever becomes of their handles, until
    /// [`AwayStore::unhold`] of what this returns (a run out of memory holds its messages'
    /// contents so). By default a handle of each; a store may hold them more cheaply (by
    /// the files they are in).
    fn hold(&self, keys: &[u64]) -> Vec<u64> {
        self.retain(keys);
        keys.to_vec()
    }
    /// Lets go of what [`AwayStore::hold`] held (`messages` of them).
    fn unhold(&self, pins: &[u64], _messages: u64) {
        for key in pins {
            self.release(*key);
        }
    }
    /// A run written out of memory cannot be read back: the node stops. Its queues' logs are
    /// the durable record and a restart rebuilds their machines from them; a machine that
    /// went on without the run's messages would no longer be its queue's.
    fn fatal(&self, error: &str) -> ! {
        eprintln!("warren: {error}; stopping (the queues' logs rebuild them at the next start)");
        std::process::exit(70)
    }
}

/// A store's handle as every message away keeps it: one pointer, where `Arc<dyn AwayStore>`
/// takes two (8 bytes a message of a deep queue).
#[derive(Clone)]
pub struct AwayStoreHandle(std::sync::Arc<std::sync::Arc<dyn AwayStore>>);

impl AwayStoreHandle {
    pub fn new(store: std::sync::Arc<dyn AwayStore>) -> Self {
        AwayStoreHandle(std::sync::Arc::new(store))
    }
}

impl std::ops::Deref for AwayStoreHandle {
    type Target = dyn AwayStore;
    fn deref(&self) -> &(dyn AwayStore + 'static) {
        &**self.0
    }
}

impl From<std::sync::Arc<dyn AwayStore>> for AwayStoreHandle {
    fn from(store: std::sync::Arc<dyn AwayStore>) -> Self {
        AwayStoreHandle::new(store)
    }
}

impl<T: AwayStore + 'static> From<std::sync::Arc<T>> for AwayStoreHandle {
    fn from(store: std::sync::Arc<T>) -> Self {
        AwayStoreHandle::new(store)
    }
}

impl From<&AwayStoreHandle> for AwayStoreHandle {
    fn from(store: &AwayStoreHandle) -> Self {
        store.clone()
    }
}

/// The handle of a message's contents in an [`AwayStore`]. Shared by every copy of the message
/// that left memory (the machines of a leader, a delivery being made, a snapshot being
/// written); the contents are released when the last copy drops.
///
/// A deep queue's member keeps one for each message past its window, so it is kept to 32
/// bytes, counted by a `triomphe::Arc` (no weak count): 48 bytes of heap where a `std` `Arc`
/// of the first version took 80. The message's flag rides in the key's top bit, so that a
/// packed message ([`PackedMessage`]) is this handle alone.
pub struct Away {
    /// The store's key, and [`Message::persistent`] in bit 63.
    word: u64,
    /// [`Message::content_hash`] of the contents, so that equality and digests need no read;
    /// two words, not a `u128`, whose alignment of 16 would pad the allocation.
    content: [u64; 2],
    store: AwayStoreHandle,
}

const PERSISTENT_BIT: u64 = 1 << 63;

impl Away {
    pub fn key(&self) -> u64 {
        self.word & !PERSISTENT_BIT
    }

    fn persistent(&self) -> bool {
        self.word & PERSISTENT_BIT != 0
    }

    fn content(&self) -> u128 {
        u128::from(self.content[0]) | u128::from(self.content[1]) << 64
    }
}

impl Drop for Away {
    fn drop(&mut self) {
        self.store.release(self.key());
    }
}

impl std::fmt::Debug for Away {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Away({})", self.key())
    }
}

/// The contents of a message could not be read back from where they went.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AwayError {
    #[error("the contents of a message that left memory (key {key}) are not in the store")]
    Missing { key: u64 },
    #[error("reading the contents of a message that left memory (key {key}): {error}")]
    Read { key: u64, error: String },
    #[error("the contents read back for key {key} are not the message's")]
    Mismatch { key: u64 },
}

impl PartialEq for Message {
    fn eq(&self, other: &Self) -> bool {
        if self.persistent != other.persistent || self.store_key != other.store_key {
            return false;
        }
        match (&self.away, &other.away) {
            (None, None) => {
                self.exchange == other.exchange
                    && self.routing_key == other.routing_key
                    && self.properties == other.properties
                    && self.body == other.body
            }
            (Some(a), Some(b)) if triomphe::Arc::ptr_eq(a, b) => true,
            _ => self.content_hash() == other.content_hash(),
        }
    }
}

impl Eq for Message {}

impl std::hash::Hash for Message {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.content_hash().hash(state);
        self.persistent.hash(state);
        self.store_key.hash(state);
    }
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

    /// What a ready message far down a deep line keeps in memory once packed with its
    /// neighbours ([`machine::QueueMachine::pack_line`]): for a message whose contents are
    /// away, the handle of its contents. Node-local, as the contents being away are.
    type Packed: Clone + std::fmt::Debug;

    /// The packed form, when this message can be rebuilt from it alone (`None`: it stays
    /// whole in the line).
    fn pack(&self) -> Option<Self::Packed>;

    /// The message again, equal to the one packed.
    fn unpack(packed: &Self::Packed) -> Self;

    /// What stays in memory of a run of packed messages written out of it
    /// ([`machine::QueueMachine::spill_line`]). Node-local, as packing is.
    type Spilled: Clone + std::fmt::Debug;

    /// Writes a run's packed messages out of memory, with `meta` (what the machine keeps of
    /// the run beside them). `Err` gives both back, to stay in memory: a payload that is
    /// never spilled, a store that keeps no runs, a failed write.
    #[allow(clippy::type_complexity)]
    fn spill(
        meta: Vec<u8>,
        items: Vec<Self::Packed>,
    ) -> Result<Self::Spilled, (Vec<u8>, Vec<Self::Packed>)>;

    /// What [`Payload::spill`] wrote, read back (the spilled run stays valid). A node that
    /// cannot read it back stops ([`AwayStore::fatal`]).
    fn unspill(spilled: &Self::Spilled) -> (Vec<u8>, Vec<Self::Packed>);

    /// What [`Payload::unspill`] gave back does not read as a run: the node stops.
    fn spill_unreadable(spilled: &Self::Spilled, error: &str) -> !;

    /// A hash of what `items` hold (for a message away, its handle's key and hash): two
    /// machines of a member whose runs have the same mark share one spilled run.
    fn spill_mark(items: &[Self::Packed]) -> u64;
}

/// Test payloads' spilled runs: kept in memory, so that the machine's spilling is tested
/// without a store.
pub type SpilledInMemory<P> = std::sync::Arc<(Vec<u8>, Vec<P>)>;

/// A payload with no packed form.
#[derive(Clone, Copy, Debug)]
pub enum NotPacked {}

/// Test payloads: plain values that never say so. A `u64` packs as itself, so that tests of
/// the machine can pack a line without an [`AwayStore`].
impl Payload for u64 {
    type Packed = u64;
    fn pack(&self) -> Option<u64> {
        Some(*self)
    }
    fn unpack(packed: &u64) -> u64 {
        *packed
    }
    type Spilled = SpilledInMemory<u64>;
    fn spill(meta: Vec<u8>, items: Vec<u64>) -> Result<Self::Spilled, (Vec<u8>, Vec<u64>)> {
        Ok(std::sync::Arc::new((meta, items)))
    }
    fn unspill(spilled: &Self::Spilled) -> (Vec<u8>, Vec<u64>) {
        (spilled.0.clone(), spilled.1.clone())
    }
    fn spill_unreadable(_: &Self::Spilled, error: &str) -> ! {
        panic!("a test run does not read back: {error}")
    }
    fn spill_mark(items: &[u64]) -> u64 {
        use std::hash::Hasher;
        let mut h = stable_hash::StableHasher::new();
        items.iter().for_each(|i| h.write_u64(*i));
        h.finish()
    }
}
/// A pair packs as itself too.
impl<A: Clone + std::fmt::Debug, B: Clone + std::fmt::Debug> Payload for (A, B) {
    type Packed = (A, B);
    fn pack(&self) -> Option<(A, B)> {
        Some(self.clone())
    }
    fn unpack(packed: &(A, B)) -> Self {
        packed.clone()
    }
    type Spilled = SpilledInMemory<(A, B)>;
    #[allow(clippy::type_complexity)]
    fn spill(meta: Vec<u8>, items: Vec<(A, B)>) -> Result<Self::Spilled, (Vec<u8>, Vec<(A, B)>)> {
        Ok(std::sync::Arc::new((meta, items)))
    }
    fn unspill(spilled: &Self::Spilled) -> (Vec<u8>, Vec<(A, B)>) {
        (spilled.0.clone(), spilled.1.clone())
    }
    fn spill_unreadable(_: &Self::Spilled, error: &str) -> ! {
        panic!("a test run does not read back: {error}")
    }
    fn spill_mark(items: &[(A, B)]) -> u64 {
        stable_hash::hash_bytes(format!("{items:?}").as_bytes())
    }
}
impl Payload for &str {
    type Packed = NotPacked;
    fn pack(&self) -> Option<NotPacked> {
        None
    }
    fn unpack(packed: &NotPacked) -> Self {
        match *packed {}
    }
    type Spilled = NotPacked;
    fn spill(meta: Vec<u8>, items: Vec<NotPacked>) -> Result<NotPacked, (Vec<u8>, Vec<NotPacked>)> {
        Err((meta, items))
    }
    fn unspill(spilled: &NotPacked) -> (Vec<u8>, Vec<NotPacked>) {
        match *spilled {}
    }
    fn spill_unreadable(spilled: &NotPacked, _: &str) -> ! {
        match *spilled {}
    }
    fn spill_mark(_: &[NotPacked]) -> u64 {
        0
    }
}

/// A packed [`Message`]: its contents' handle (which holds its flag too); the rest is empty in
/// a stub.
#[derive(Clone, Debug)]
pub struct PackedMessage(triomphe::Arc<Away>);

impl Payload for Message {
    type Packed = PackedMessage;

    /// Only a stub with no store key of this node's (a replicated queue's message away).
    fn pack(&self) -> Option<PackedMessage> {
        match (&self.away, self.store_key) {
            (Some(away), None) if away.persistent() == self.persistent => {
                Some(PackedMessage(away.clone()))
            }
            _ => None,
        }
    }

    type Spilled = spill::SpilledMessages;

    fn spill(
        meta: Vec<u8>,
        items: Vec<PackedMessage>,
    ) -> Result<spill::SpilledMessages, (Vec<u8>, Vec<PackedMessage>)> {
        spill::SpilledMessages::write(meta, items)
    }

    fn unspill(spilled: &spill::SpilledMessages) -> (Vec<u8>, Vec<PackedMessage>) {
        spilled.read()
    }

    fn spill_unreadable(spilled: &spill::SpilledMessages, error: &str) -> ! {
        spilled.fatal(error)
    }

    fn spill_mark(items: &[PackedMessage]) -> u64 {
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        for p in items {
            h.update(&p.0.word.to_le_bytes());
            h.update(&p.0.content[0].to_le_bytes());
            h.update(&p.0.content[1].to_le_bytes());
        }
        h.digest()
    }

    fn unpack(packed: &PackedMessage) -> Message {
        Message {
            exchange: ShortStr::default(),
            routing_key: ShortStr::default(),
            properties: Bytes::new(),
            body: Bytes::new(),
            persistent: packed.0.persistent(),
            store_key: None,
            away: Some(packed.0.clone()),
        }
    }

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
    /// A 128-bit hash (XXH3) of the exchange, routing key, properties and body, each with its
    /// length: what tells two messages' contents apart once one of them left memory.
    pub fn content_hash(&self) -> u128 {
        if let Some(a) = &self.away {
            return a.content();
        }
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        for part in [
            self.exchange.as_bytes(),
            self.routing_key.as_bytes(),
            &self.properties[..],
            &self.body[..],
        ] {
            h.update(&(part.len() as u64).to_le_bytes());
            h.update(part);
        }
        h.digest128()
    }

    /// Are the contents away, in an [`AwayStore`]?
    pub fn is_away(&self) -> bool {
        self.away.is_some()
    }

    /// What stays in memory of this message once its contents are in `store` under `key`:
    /// the flags and keys, and the handle. Equal to `self`. A key with its top bit set (a store
    /// breaking [`AwayStore::put`]'s promise) cannot be kept: the message stays whole and the
    /// record is released.
    pub fn away_stub(&self, key: u64, store: impl Into<AwayStoreHandle>) -> Message {
        let store = store.into();
        if key & PERSISTENT_BIT != 0 {
            store.release(key);
            return self.clone();
        }
        let content = self.content_hash();
        Message {
            exchange: ShortStr::default(),
            routing_key: ShortStr::default(),
            properties: Bytes::new(),
            body: Bytes::new(),
            persistent: self.persistent,
            store_key: self.store_key,
            away: Some(triomphe::Arc::new(Away {
                word: key | if self.persistent { PERSISTENT_BIT } else { 0 },
                // The hash's low and high words.
                content: [content as u64, (content >> 64) as u64],
                store,
            })),
        }
    }

    /// The message with its contents in memory: itself, or read back from its store (checked
    /// against its hash, so a wrong record is never delivered as the message).
    pub fn loaded(&self) -> Result<std::borrow::Cow<'_, Message>, AwayError> {
        let Some(a) = &self.away else {
            return Ok(std::borrow::Cow::Borrowed(self));
        };
        let key = a.key();
        let read = a
            .store
            .get(key)
            .map_err(|error| AwayError::Read { key, error })?
            .ok_or(AwayError::Missing { key })?;
        let m = Message {
            exchange: read.exchange,
            routing_key: read.routing_key,
            properties: read.properties,
            body: read.body,
            persistent: self.persistent,
            store_key: self.store_key,
            away: None,
        };
        if m.content_hash() != a.content() {
            return Err(AwayError::Mismatch { key });
        }
        Ok(std::borrow::Cow::Owned(m))
    }

    /// Brings the contents back into this copy ([`Message::loaded`]); the handle is let go.
    pub fn load(&mut self) -> Result<(), AwayError> {
        if self.away.is_some() {
            *self = self.loaded()?.into_owned();
        }
        Ok(())
    }

    /// Copies a small message (routing strings, properties, body) into one allocation of its
    /// own. A decoded message is a set of slices of the connection's read buffer (up to 128
    /// KiB); a small message that stays queued for long would otherwise keep that whole buffer
    /// alive. Large bodies are left in place: they are most of their buffer anyway.
    pub fn compact(&mut self) {
        if self.contents_len() < COMPACT_BELOW {
            self.detach();
        }
    }

    /// The bytes of its exchange, routing key, properties and body in memory (0 for a stub).
    pub fn contents_len(&self) -> usize {
        self.exchange.len() + self.routing_key.len() + self.properties.len() + self.body.len()
    }

    /// Copies the message's contents (routing strings, properties, body) into one allocation
    /// of its own, whatever their size: a message read from a snapshot is a set of slices of
    /// the whole snapshot, which any one of them would keep alive. A stub has none to copy.
    pub fn detach(&mut self) {
        if self.contents_len() == 0 {
            return;
        }
        let (x, k, p, b) = (
            self.exchange.len(),
            self.routing_key.len(),
            self.properties.len(),
            self.body.len(),
        );
        let total = x + k + p + b;
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
pub(crate) mod tests {
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
            away: None,
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
            away: None,
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
        // Detached (read from a snapshot), whatever its size; the same message.
        let before = large.clone();
        large.detach();
        assert!(!within(&large.body, &buffer) && !within(&large.properties, &buffer));
        assert_eq!(large.body, before.body);
        assert_eq!(large, before);
    }

    /// An [`AwayStore`] in memory that keeps what it was told.
    #[derive(Default)]
    pub struct MemAway {
        pub next: std::sync::atomic::AtomicU64,
        pub held: std::sync::Mutex<std::collections::HashMap<u64, Message>>,
        pub released: std::sync::Mutex<Vec<u64>>,
        /// Puts that succeed before every later one fails (a disk filling up); `None`: all do.
        pub fail_after: std::sync::Mutex<Option<usize>>,
        /// Handles of each key beyond the first ([`AwayStore::retain`]).
        pub extra: std::sync::Mutex<std::collections::HashMap<u64, u64>>,
        /// Runs written ([`AwayStore::put_run`]).
        pub runs: std::sync::Mutex<std::collections::HashMap<u64, Vec<u8>>>,
        /// Refuses runs, as a store that keeps none.
        pub no_runs: std::sync::Mutex<bool>,
    }

    impl AwayStore for MemAway {
        fn put(&self, items: &[&Message]) -> Result<Vec<u64>, String> {
            if let Some(left) = self.fail_after.lock().unwrap().as_mut() {
                if *left == 0 {
                    return Err("no space left on device".to_owned());
                }
                *left -= 1;
            }
            let mut held = self.held.lock().unwrap();
            let mut keys = Vec::new();
            for m in items {
                let k = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
                held.insert(k, (*m).clone());
                keys.push(k);
            }
            Ok(keys)
        }
        fn get(&self, key: u64) -> Result<Option<Message>, String> {
            Ok(self.held.lock().unwrap().get(&key).cloned())
        }
        fn release(&self, key: u64) {
            if let Some(n) = self.extra.lock().unwrap().get_mut(&key).filter(|n| **n > 0) {
                *n -= 1;
                return;
            }
            self.held.lock().unwrap().remove(&key);
            self.released.lock().unwrap().push(key);
        }
        fn held(&self) -> u64 {
            self.held.lock().unwrap().len() as u64
        }
        fn put_run(&self, bytes: &[u8]) -> Result<u64, String> {
            if *self.no_runs.lock().unwrap() {
                return Err("no runs".to_owned());
            }
            let k = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
            self.runs.lock().unwrap().insert(k, bytes.to_vec());
            Ok(k)
        }
        fn get_run(&self, key: u64) -> Result<Vec<u8>, String> {
            self.runs
                .lock()
                .unwrap()
                .get(&key)
                .cloned()
                .ok_or_else(|| format!("no run {key}"))
        }
        fn release_run(&self, key: u64) {
            self.runs.lock().unwrap().remove(&key);
        }
        fn retain(&self, keys: &[u64]) {
            let mut extra = self.extra.lock().unwrap();
            for k in keys {
                *extra.entry(*k).or_default() += 1;
            }
        }
    }

    fn sample(body: &'static [u8]) -> Message {
        Message {
            exchange: ShortStr::from_static("ex"),
            routing_key: ShortStr::from_static("rk"),
            properties: Bytes::from_static(&[0x10, 0, 2]),
            body: Bytes::from_static(body),
            persistent: true,
            store_key: None,
            away: None,
        }
    }

    #[test]
    fn a_message_away_equals_and_hashes_as_itself_and_comes_back_whole() {
        use std::hash::{Hash, Hasher};
        let store = std::sync::Arc::new(MemAway::default());
        let m = sample(b"hello");
        let key = store.put(&[&m]).unwrap()[0];
        let stub = m.away_stub(key, store.clone());
        assert!(stub.is_away() && stub.body.is_empty() && stub.routing_key.is_empty());
        assert_eq!(stub, m, "equal by contents");
        assert_ne!(stub, sample(b"hellp"));
        let hash = |x: &Message| {
            let mut h = crate::stable_hash::StableHasher::new();
            x.hash(&mut h);
            h.finish()
        };
        assert_eq!(hash(&stub), hash(&m));
        let back = stub.loaded().unwrap().into_owned();
        assert!(!back.is_away());
        assert_eq!(
            (
                back.exchange.as_bytes(),
                back.routing_key.as_bytes(),
                &back.body[..]
            ),
            (&b"ex"[..], &b"rk"[..], &b"hello"[..])
        );
        // Released once, when the last copy of the handle goes.
        let copy = stub.clone();
        drop(stub);
        assert!(store.released.lock().unwrap().is_empty());
        drop(copy);
        assert_eq!(*store.released.lock().unwrap(), vec![key]);
    }

    #[test]
    fn contents_away_that_are_gone_or_wrong_are_an_error_never_another_message() {
        let store = std::sync::Arc::new(MemAway::default());
        let m = sample(b"hello");
        let stub = m.away_stub(7, store.clone());
        assert_eq!(
            stub.loaded().map(|_| ()),
            Err(AwayError::Missing { key: 7 })
        );
        store.held.lock().unwrap().insert(7, sample(b"other"));
        assert_eq!(
            stub.loaded().map(|_| ()),
            Err(AwayError::Mismatch { key: 7 })
        );
    }

    #[test]
    fn a_packed_message_is_one_pointer_and_keeps_its_flag() {
        // What a deep queue's member keeps per message past its window: the handle's heap
        // block (its count and 32 bytes) and the pointer in the packed run.
        assert_eq!(std::mem::size_of::<Away>(), 32);
        assert_eq!(std::mem::size_of::<PackedMessage>(), 8);
        assert_eq!(std::mem::size_of::<Option<triomphe::Arc<Away>>>(), 8);
        let store = std::sync::Arc::new(MemAway::default());
        for persistent in [true, false] {
            let m = Message {
                persistent,
                ..sample(b"flag")
            };
            let key = store.put(&[&m]).unwrap()[0];
            let stub = m.away_stub(key, store.clone());
            let back = Message::unpack(&stub.pack().expect("a stub packs"));
            assert_eq!(back.persistent, persistent);
            assert_eq!(back.away.as_ref().map(|a| a.key()), Some(key));
            assert_eq!(back, m);
        }
        // A stub whose flag was changed after it was made is not packed as the other flag.
        let m = sample(b"changed");
        let key = store.put(&[&m]).unwrap()[0];
        let mut stub = m.away_stub(key, store.clone());
        stub.persistent = false;
        assert!(stub.pack().is_none());
    }

    #[test]
    fn a_key_with_its_top_bit_set_leaves_the_message_whole_and_its_record_released() {
        let store = std::sync::Arc::new(MemAway::default());
        let m = sample(b"whole");
        let key = 1 << 63 | 5;
        let stub = m.away_stub(key, store.clone());
        assert!(!stub.is_away());
        assert_eq!(stub.body, m.body);
        assert_eq!(*store.released.lock().unwrap(), vec![key]);
    }
}
