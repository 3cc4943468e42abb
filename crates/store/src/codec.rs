//! Keys and values of the store (the schema is in docs/design.md, "Storage"). Integers are
//! big-endian so that key order is numeric order; strings carry their length first, so no
//! name can run into the next field.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use warren_broker::access::{
    AccessKeyDef, HashAlgorithm, PasswordHash, PermissionDef, TopicPermissionDef, UserDef,
};
use warren_broker::limits::{LimitScope, Limits};
use warren_broker::parameters::ParameterDef;
use warren_broker::policy::{ApplyTo, Definition, PolicyDef, PolicyKind, PolicyValue};
use warren_broker::{
    BindingDef, BindingDest, DelayKey, Delayed, ExchangeDef, ExchangeKind, Holder, Message,
    QueueDef, QueueType, StoreOp, VhostMeta,
};
use warren_codec::{FieldTable, ShortStr};

use crate::StoreError;

pub const EXCHANGE: u8 = b'x';
pub const QUEUE: u8 = b'q';
pub const BINDING: u8 = b'b';
pub const VHOST: u8 = b'v';
pub const USER: u8 = b'u';
pub const PERMISSION: u8 = b'p';
pub const TOPIC_PERMISSION: u8 = b't';
/// The limits of a vhost (`LIMITS`, `VHOST`, name) or of a user (`LIMITS`, `USER`, name).
pub const LIMITS: u8 = b'l';
/// A policy (`POLICY`, `USER` or `OPERATOR`, vhost, name): pattern, apply-to, priority and
/// definition.
pub const POLICY: u8 = b'y';
/// A cluster node's place in the metadata group's log (one record): the index applied, then
/// the highest change number applied per node.
pub const META_APPLIED: u8 = b'm';
/// A definition change a cluster node made that the metadata group's log has not applied yet
/// (`META_PENDING`, its number): the change, as a metadata entry of its own.
pub const META_PENDING: u8 = b'n';
/// An SQS access key: its id; the user, the secret and when it was made.
pub const ACCESS_KEY: u8 = b'k';
/// A runtime parameter (component, vhost, name): its JSON value.
pub const PARAMETER: u8 = b'r';
const OPERATOR: u8 = b'o';

const DEST_QUEUE: u8 = b'q';
const DEST_EXCHANGE: u8 = b'e';
const FLAG_AUTO_DELETE: u8 = 1;
const FLAG_INTERNAL: u8 = 2;
/// An `x-delayed-message` exchange (its type field holds how it routes).
const FLAG_DELAYED: u8 = 4;
/// The first byte of a vhost record's value when it holds metadata.
const VHOST_META_FORMAT: u8 = 1;
/// The first byte of a body value: its layout version (the first layout is of a persistent
/// message; the same layout for a transient one, which only the scratch area holds).
const BODY_V1: u8 = 1;
const BODY_V1_TRANSIENT: u8 = 2;

/// Prefixes of the scratch area's keys (one column family holds its entries, counts and
/// bodies, and is dropped at every start).
pub const SPILL_ENTRY: u8 = b'i';
pub const SPILL_COUNT: u8 = b'c';
pub const SPILL_BODY: u8 = b'b';

/// A key of at most 17 bytes, on the stack.
#[derive(Clone, Copy)]
pub struct Key {
    buf: [u8; 17],
    len: usize,
}

impl AsRef<[u8]> for Key {
    fn as_ref(&self) -> &[u8] {
        self.buf.get(..self.len).unwrap_or_default()
    }
}

fn key_of(prefix: Option<u8>, parts: &[u64]) -> Key {
    let mut k = Key {
        buf: [0; 17],
        len: 0,
    };
    if let Some(p) = prefix {
        k.buf[0] = p;
        k.len = 1;
    }
    for part in parts {
        if let Some(dst) = k.buf.get_mut(k.len..k.len + 8) {
            dst.copy_from_slice(&part.to_be_bytes());
            k.len += 8;
        }
    }
    k
}

/// An entry's (or a count's) key: the queue key, then the message id; with the scratch
/// area's prefix when it has one.
pub fn entry_key_in(prefix: Option<u8>, queue: u64, msg_id: u64) -> Key {
    key_of(prefix, &[queue, msg_id])
}

/// A body's key, with the scratch area's prefix when it has one.
pub fn body_key_in(prefix: Option<u8>, key: u64) -> Key {
    key_of(prefix, &[key])
}

/// A scheduled message's key: its due time, then its sequence number (so a scan is in due
/// order).
pub fn delayed_key(k: DelayKey) -> Key {
    key_of(None, &[k.due, k.seq])
}

pub fn decode_delayed_key(key: &[u8]) -> Result<DelayKey, StoreError> {
    let (due, seq) = decode_entry_key(key)?;
    Ok(DelayKey { due, seq })
}

const DELAYED_V1: u8 = 1;
/// Layout 2 adds the holder after the target.
const DELAYED_V2: u8 = 2;
const HOLDER_ANY: u8 = 0;
const HOLDER_STORED: u8 = 1;
const HOLDER_INCARNATION: u8 = 2;

/// A scheduled message: where it goes (vhost; a queue, or its exchange when absent), which
/// incarnation of that holder holds it (a kind byte and a u64), then the message as a body
/// value.
pub fn delayed_value(d: &Delayed) -> BytesMut {
    let mut v = BytesMut::new();
    v.put_u8(DELAYED_V2);
    put_vhost(&mut v, &d.vhost);
    match &d.queue {
        Some(q) => {
            v.put_u8(1);
            put_short(&mut v, q);
        }
        None => v.put_u8(0),
    }
    let (kind, n) = match d.holder {
        Holder::Any => (HOLDER_ANY, 0),
        Holder::Stored(k) => (HOLDER_STORED, k),
        Holder::Incarnation(n) => (HOLDER_INCARNATION, n),
    };
    v.put_u8(kind);
    v.put_u64(n);
    v.put_slice(&body_value(&d.message, 0));
    v
}

pub fn decode_delayed(value: Vec<u8>) -> Result<Delayed, StoreError> {
    let mut v = Reader::new(value, "a delayed message");
    let layout = v.u8("layout")?;
    if layout != DELAYED_V1 && layout != DELAYED_V2 {
        return Err(StoreError::Corrupt(
            "a delayed message has an unknown layout".into(),
        ));
    }
    let vhost = v.vhost()?;
    let queue = match v.u8("target")? {
        0 => None,
        _ => Some(v.short("queue")?),
    };
    let holder = if layout == DELAYED_V1 {
        Holder::Any
    } else {
        let kind = v.u8("holder kind")?;
        let n = v.u64("holder")?;
        match kind {
            HOLDER_ANY => Holder::Any,
            HOLDER_STORED => Holder::Stored(n),
            HOLDER_INCARNATION => Holder::Incarnation(n),
            _ => {
                return Err(StoreError::Corrupt(
                    "a delayed message has an unknown holder kind".into(),
                ))
            }
        }
    };
    let (mut message, _) = decode_body(0, v.rest())?;
    message.store_key = None;
    Ok(Delayed {
        vhost,
        queue,
        holder,
        refused: 0,
        message,
    })
}

/// The bounds of a queue's entries with ids in `first..=last`, with a prefix.
pub fn id_range_in(prefix: Option<u8>, queue: u64, first: u64, last: u64) -> (Key, Key) {
    let to = match last.checked_add(1) {
        Some(next) => key_of(prefix, &[queue, next]),
        None => key_of(prefix, &[queue.saturating_add(1), 0]),
    };
    (key_of(prefix, &[queue, first]), to)
}

fn put_vhost(out: &mut BytesMut, vhost: &str) {
    out.put_u32(u32::try_from(vhost.len()).unwrap_or(u32::MAX));
    out.put_slice(vhost.as_bytes());
}

fn put_short(out: &mut BytesMut, s: &ShortStr) {
    // A ShortStr is at most 255 bytes by construction.
    out.put_u8(u8::try_from(s.len()).unwrap_or(u8::MAX));
    out.put_slice(s.as_bytes());
}

pub fn exchange_key(vhost: &str, name: &ShortStr) -> BytesMut {
    let mut k = BytesMut::with_capacity(6 + vhost.len() + name.len());
    k.put_u8(EXCHANGE);
    put_vhost(&mut k, vhost);
    put_short(&mut k, name);
    k
}

pub fn queue_key(vhost: &str, name: &ShortStr) -> BytesMut {
    let mut k = BytesMut::with_capacity(6 + vhost.len() + name.len());
    k.put_u8(QUEUE);
    put_vhost(&mut k, vhost);
    put_short(&mut k, name);
    k
}

/// A binding is its key: everything that tells two bindings apart, arguments included.
pub fn binding_key(b: &BindingDef) -> BytesMut {
    let mut k = BytesMut::with_capacity(32 + b.vhost.len() + b.source.len());
    k.put_u8(BINDING);
    put_vhost(&mut k, &b.vhost);
    put_short(&mut k, &b.source);
    match &b.dest {
        BindingDest::Queue(q) => {
            k.put_u8(DEST_QUEUE);
            put_short(&mut k, q);
        }
        BindingDest::Exchange(x) => {
            k.put_u8(DEST_EXCHANGE);
            put_short(&mut k, x);
        }
    }
    put_short(&mut k, &b.routing_key);
    b.arguments.encode(&mut k);
    k
}

pub fn exchange_value(x: &ExchangeDef) -> BytesMut {
    let mut v = BytesMut::new();
    put_short(&mut v, &ShortStr::from_static(x.kind.as_str()));
    let mut flags = 0;
    if x.auto_delete {
        flags |= FLAG_AUTO_DELETE;
    }
    if x.internal {
        flags |= FLAG_INTERNAL;
    }
    if x.delayed {
        flags |= FLAG_DELAYED;
    }
    v.put_u8(flags);
    x.arguments.encode(&mut v);
    // After the arguments, so that declarations stored without it still read.
    if let Some(n) = x.incarnation {
        v.put_u64(n);
    }
    v
}

pub fn queue_value(q: &QueueDef) -> BytesMut {
    let mut v = BytesMut::new();
    v.put_u64(q.key);
    v.put_u8(if q.auto_delete { FLAG_AUTO_DELETE } else { 0 });
    q.arguments.encode(&mut v);
    // After the arguments, so that declarations stored without it still read.
    if q.group.is_some() || q.voters.is_some() {
        // With voters after it, a group is written even when it is the name's.
        v.put_u64(
            q.group
                .unwrap_or_else(|| warren_broker::group_of(&q.vhost, &q.name)),
        );
    }
    // After the group; versions before read the group and pass over what follows.
    if let Some(voters) = &q.voters {
        let n = u8::try_from(voters.len()).unwrap_or(u8::MAX);
        v.put_u8(n);
        for node in voters.iter().take(usize::from(n)) {
            v.put_u64(*node);
        }
    }
    v
}

/// Read options for an iterator that stays within `[from, to)`.
pub fn bounded(from: &[u8], to: &[u8]) -> rocksdb::ReadOptions {
    let mut r = rocksdb::ReadOptions::default();
    r.set_iterate_lower_bound(from.to_vec());
    r.set_iterate_upper_bound(to.to_vec());
    r
}

/// The bounds of one queue's entries: `[queue, queue + 1)`.
pub fn queue_range(queue: u64) -> ([u8; 8], [u8; 8]) {
    (queue.to_be_bytes(), queue.saturating_add(1).to_be_bytes())
}

/// An `index` value: which body, how large, whether other queues hold it too, the expiry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    pub body: u64,
    /// `None` for entries written before sizes were stored (their queue is loaded whole).
    pub size: Option<u32>,
    pub shared: bool,
    pub expires_at: Option<u64>,
}

impl Entry {
    /// Can the message stay on disk until its queue reads it (a run at recovery)?
    pub fn pageable(&self) -> bool {
        self.size.is_some() && !self.shared
    }
}

const ENTRY_SHARED: u8 = 1;
const ENTRY_EXPIRES: u8 = 2;

/// Layout: body key (u64), body size (u32), flags (u8), expiry (u64, if flagged): 13 or 21
/// bytes. The first layout (body key, expiry flag, expiry: 9 or 17 bytes) is still read.
/// Written into `v` (cleared first): a group commit encodes its values into one buffer, which
/// RocksDB copies from, instead of allocating one per message.
pub fn entry_value_into(v: &mut BytesMut, e: &Entry) {
    v.clear();
    v.put_u64(e.body);
    v.put_u32(e.size.unwrap_or(0));
    let mut flags = 0;
    if e.shared {
        flags |= ENTRY_SHARED;
    }
    if e.expires_at.is_some() {
        flags |= ENTRY_EXPIRES;
    }
    v.put_u8(flags);
    if let Some(at) = e.expires_at {
        v.put_u64(at);
    }
}

/// A delivery count, and the due time of the delayed retry the message waits for (if any):
/// 4 bytes, or 12 (format 3).
pub fn count_value(count: u32, retry_at: Option<u64>) -> Vec<u8> {
    let mut v = count.to_be_bytes().to_vec();
    if let Some(at) = retry_at {
        v.extend_from_slice(&at.to_be_bytes());
    }
    v
}

/// Reads a [`count_value`].
pub fn decode_count(v: &[u8]) -> Result<(u32, Option<u64>), StoreError> {
    let bad = || StoreError::Corrupt("a delivery count is malformed".into());
    let count = v
        .get(..4)
        .and_then(|b| <[u8; 4]>::try_from(b).ok())
        .map(u32::from_be_bytes)
        .ok_or_else(bad)?;
    let retry_at = match v.len() {
        4 => None,
        12 => v
            .get(4..12)
            .and_then(|b| <[u8; 8]>::try_from(b).ok())
            .map(u64::from_be_bytes),
        _ => return Err(bad()),
    };
    Ok((count, retry_at))
}

/// A body with the number of durable queues it was written for (recovery counts references
/// only for bodies shared by several).
pub fn body_value(message: &Message, queues: u32) -> BytesMut {
    let mut v = BytesMut::new();
    body_value_into(&mut v, message, queues);
    v
}

/// [`body_value`] written into `v` (cleared first), as [`entry_value_into`].
pub fn body_value_into(v: &mut BytesMut, message: &Message, queues: u32) {
    v.clear();
    body_value_append(v, message, queues);
}

/// [`body_value_into`] at the end of what `v` holds.
pub fn body_value_append(v: &mut BytesMut, message: &Message, queues: u32) {
    v.reserve(
        16 + message.exchange.len()
            + message.routing_key.len()
            + message.properties.len()
            + message.body.len(),
    );
    v.put_u8(if message.persistent {
        BODY_V1
    } else {
        BODY_V1_TRANSIENT
    });
    v.put_u32(queues);
    put_short(v, &message.exchange);
    put_short(v, &message.routing_key);
    v.put_u32(u32::try_from(message.properties.len()).unwrap_or(u32::MAX));
    v.put_slice(&message.properties);
    v.put_slice(&message.body);
}

/// Reads one stored value, naming what is wrong when it is damaged.
pub struct Reader {
    buf: Bytes,
    what: &'static str,
}

impl Reader {
    pub fn new(buf: impl Into<Bytes>, what: &'static str) -> Self {
        Reader {
            buf: buf.into(),
            what,
        }
    }

    fn bad(&self, field: &str) -> StoreError {
        StoreError::Corrupt(format!("{}: {field} is cut short or malformed", self.what))
    }

    fn need(&self, n: usize, field: &str) -> Result<(), StoreError> {
        if self.buf.remaining() < n {
            Err(self.bad(field))
        } else {
            Ok(())
        }
    }

    pub fn u8(&mut self, field: &str) -> Result<u8, StoreError> {
        self.need(1, field)?;
        Ok(self.buf.get_u8())
    }

    pub fn u32(&mut self, field: &str) -> Result<u32, StoreError> {
        self.need(4, field)?;
        Ok(self.buf.get_u32())
    }

    pub fn u64(&mut self, field: &str) -> Result<u64, StoreError> {
        self.need(8, field)?;
        Ok(self.buf.get_u64())
    }

    fn bytes(&mut self, n: usize, field: &str) -> Result<Bytes, StoreError> {
        self.need(n, field)?;
        Ok(self.buf.split_to(n))
    }

    pub fn vhost(&mut self) -> Result<String, StoreError> {
        let n = self.u32("vhost length")? as usize;
        let b = self.bytes(n, "vhost")?;
        String::from_utf8(b.to_vec()).map_err(|_| self.bad("vhost"))
    }

    pub fn short(&mut self, field: &str) -> Result<ShortStr, StoreError> {
        let n = usize::from(self.u8(field)?);
        let b = self.bytes(n, field)?;
        ShortStr::try_from_bytes(b).map_err(|_| self.bad(field))
    }

    pub fn table(&mut self, field: &str) -> Result<FieldTable, StoreError> {
        FieldTable::decode(&mut self.buf).map_err(|_| self.bad(field))
    }

    pub fn rest(self) -> Bytes {
        self.buf
    }

    pub fn done(&self, field: &str) -> Result<(), StoreError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(self.bad(field))
        }
    }
}

/// A string with a 4-byte length first (names of users and vhosts are not bounded by AMQP's
/// short strings).
fn put_text(out: &mut BytesMut, s: &str) {
    put_vhost(out, s);
}

/// The key of a vhost, user or (topic) permission record, for a put or a delete.
pub fn access_key(op: &StoreOp) -> Option<BytesMut> {
    let mut k = BytesMut::new();
    match op {
        StoreOp::PutVhost { name, .. } | StoreOp::DeleteVhost { name } => {
            k.put_u8(VHOST);
            put_text(&mut k, name);
        }
        StoreOp::PutUser(UserDef { name, .. }) | StoreOp::DeleteUser { name } => {
            k.put_u8(USER);
            put_text(&mut k, name);
        }
        StoreOp::PutPermission(PermissionDef { user, vhost, .. })
        | StoreOp::DeletePermission { user, vhost } => {
            k.put_u8(PERMISSION);
            put_text(&mut k, user);
            put_text(&mut k, vhost);
        }
        StoreOp::PutTopicPermission(TopicPermissionDef {
            user,
            vhost,
            exchange,
            ..
        })
        | StoreOp::DeleteTopicPermission {
            user,
            vhost,
            exchange,
        } => {
            k.put_u8(TOPIC_PERMISSION);
            put_text(&mut k, user);
            put_text(&mut k, vhost);
            put_text(&mut k, exchange);
        }
        StoreOp::PutLimits { scope, name, .. } => {
            k.put_u8(LIMITS);
            k.put_u8(match scope {
                LimitScope::Vhost => VHOST,
                LimitScope::User => USER,
            });
            put_text(&mut k, name);
        }
        StoreOp::PutPolicy(PolicyDef {
            vhost, name, kind, ..
        })
        | StoreOp::DeletePolicy { vhost, name, kind } => {
            k.put_u8(POLICY);
            k.put_u8(match kind {
                PolicyKind::User => USER,
                PolicyKind::Operator => OPERATOR,
            });
            put_text(&mut k, vhost);
            put_text(&mut k, name);
        }
        StoreOp::PutMetaApplied { .. } => k.put_u8(META_APPLIED),
        StoreOp::PutMetaPending { number, .. } | StoreOp::DeleteMetaPending { number } => {
            k.put_u8(META_PENDING);
            k.put_u64(*number);
        }
        StoreOp::PutAccessKey(AccessKeyDef { id, .. }) | StoreOp::DeleteAccessKey { id } => {
            k.put_u8(ACCESS_KEY);
            put_text(&mut k, id);
        }
        StoreOp::PutParameter(ParameterDef {
            component,
            vhost,
            name,
            ..
        })
        | StoreOp::DeleteParameter {
            component,
            vhost,
            name,
        } => {
            k.put_u8(PARAMETER);
            put_text(&mut k, component);
            put_text(&mut k, vhost);
            put_text(&mut k, name);
        }
        _ => return None,
    }
    Some(k)
}

/// The key and value of a put of a vhost, user or (topic) permission.
pub fn access_record(op: &StoreOp) -> Option<(BytesMut, BytesMut)> {
    let key = access_key(op)?;
    let mut v = BytesMut::new();
    match op {
        StoreOp::PutVhost { meta, .. } => {
            // Empty for a vhost without metadata, as every version before it wrote.
            if *meta != VhostMeta::default() {
                v.put_u8(VHOST_META_FORMAT);
                put_text(&mut v, &meta.description);
                v.put_u32(u32::try_from(meta.tags.len()).unwrap_or(u32::MAX));
                for t in &meta.tags {
                    put_text(&mut v, t);
                }
                v.put_u8(match meta.default_queue_type {
                    None => 0,
                    Some(QueueType::Classic) => 1,
                    Some(QueueType::Quorum) => 2,
                    // Never a vhost's default (`parse_default_queue_type` refuses it).
                    Some(QueueType::Stream) => 0,
                });
            }
        }
        StoreOp::PutUser(u) => {
            match &u.hash {
                None => v.put_u8(0),
                Some(h) => {
                    v.put_u8(match h.algorithm {
                        HashAlgorithm::Sha256 => 1,
                        HashAlgorithm::Sha512 => 2,
                    });
                    v.put_u32(u32::try_from(h.bytes.len()).unwrap_or(u32::MAX));
                    v.put_slice(&h.bytes);
                }
            }
            v.put_u32(u32::try_from(u.tags.len()).unwrap_or(u32::MAX));
            for t in &u.tags {
                put_text(&mut v, t);
            }
        }
        StoreOp::PutPermission(p) => {
            put_text(&mut v, &p.configure);
            put_text(&mut v, &p.write);
            put_text(&mut v, &p.read);
        }
        StoreOp::PutTopicPermission(t) => {
            put_text(&mut v, &t.write);
            put_text(&mut v, &t.read);
        }
        StoreOp::PutMetaPending { data, .. } => {
            v.put_u32(u32::try_from(data.len()).unwrap_or(u32::MAX));
            v.put_slice(data);
        }
        StoreOp::PutParameter(p) => put_text(&mut v, &p.value),
        StoreOp::PutAccessKey(key) => {
            put_text(&mut v, &key.user);
            put_text(&mut v, &key.secret);
            v.put_u64(key.created_ms);
        }
        StoreOp::PutMetaApplied {
            index,
            seen,
            levels,
            members,
            forgotten,
        } => {
            v.put_u64(*index);
            for pairs in [seen, levels] {
                v.put_u32(u32::try_from(pairs.len()).unwrap_or(u32::MAX));
                for (node, n) in pairs {
                    v.put_u64(*node);
                    v.put_u64(*n);
                }
            }
            if let Some(members) = members {
                v.put_u32(u32::try_from(members.len()).unwrap_or(u32::MAX));
                for (node, addr) in members {
                    v.put_u64(*node);
                    put_text(&mut v, addr);
                }
                v.put_u32(u32::try_from(forgotten.len()).unwrap_or(u32::MAX));
                for node in forgotten {
                    v.put_u64(*node);
                }
            }
        }
        StoreOp::PutLimits { limits, .. } => {
            let all: Vec<(&str, i64)> = limits.iter().collect();
            v.put_u32(u32::try_from(all.len()).unwrap_or(u32::MAX));
            for (name, value) in all {
                put_text(&mut v, name);
                v.put_i64(value);
            }
        }
        StoreOp::PutPolicy(p) => {
            put_text(&mut v, &p.pattern);
            put_text(&mut v, p.apply_to.as_str());
            v.put_i64(p.priority);
            v.put_u32(u32::try_from(p.definition.len()).unwrap_or(u32::MAX));
            for (key, value) in &p.definition {
                put_text(&mut v, key);
                match value {
                    PolicyValue::Str(s) => {
                        v.put_u8(b's');
                        put_text(&mut v, s);
                    }
                    PolicyValue::Int(i) => {
                        v.put_u8(b'i');
                        v.put_i64(*i);
                    }
                    PolicyValue::Bool(b) => {
                        v.put_u8(b'b');
                        v.put_u8(u8::from(*b));
                    }
                    // A mirroring key's list or object, kept as given.
                    PolicyValue::Other { json, erl } => {
                        v.put_u8(b'o');
                        put_text(&mut v, json);
                        put_text(&mut v, erl);
                    }
                }
            }
        }
        _ => return None,
    }
    Some((key, v))
}

impl Reader {
    fn text(&mut self, field: &str) -> Result<String, StoreError> {
        let n = self.u32(field)? as usize;
        let b = self.bytes(n, field)?;
        String::from_utf8(b.to_vec()).map_err(|_| self.bad(field))
    }
}

/// A stored vhost, user or permission, as the op that wrote it.
fn decode_access(kind: u8, k: &mut Reader, v: &mut Reader) -> Result<StoreOp, StoreError> {
    let op = match kind {
        PARAMETER => StoreOp::PutParameter(ParameterDef {
            component: k.text("parameter component")?,
            vhost: k.text("parameter vhost")?,
            name: k.text("parameter name")?,
            value: v.text("parameter value")?,
        }),
        ACCESS_KEY => StoreOp::PutAccessKey(AccessKeyDef {
            id: k.text("access key id")?,
            user: v.text("access key user")?,
            secret: v.text("access key secret")?,
            created_ms: v.u64("access key time")?,
        }),
        META_PENDING => {
            let number = k.u64("pending change number")?;
            let n = v.u32("pending change length")? as usize;
            let data = v.bytes(n, "pending change")?.to_vec();
            StoreOp::PutMetaPending { number, data }
        }
        META_APPLIED => {
            let index = v.u64("metadata index")?;
            let n = v.u32("metadata node count")?;
            let seen = (0..n)
                .map(|_| Ok((v.u64("metadata node")?, v.u64("metadata entry number")?)))
                .collect::<Result<Vec<_>, StoreError>>()?;
            // Written after `seen` since format 10.
            let levels = if v.done("metadata place").is_ok() {
                Vec::new()
            } else {
                let n = v.u32("metadata level count")?;
                (0..n)
                    .map(|_| Ok((v.u64("metadata node")?, v.u64("feature level")?)))
                    .collect::<Result<Vec<_>, StoreError>>()?
            };
            // After the levels since format 11, once the cluster added or forgot a node.
            let members = if v.done("metadata place").is_ok() {
                None
            } else {
                let n = v.u32("cluster node count")?;
                Some(
                    (0..n)
                        .map(|_| Ok((v.u64("cluster node")?, v.text("cluster address")?)))
                        .collect::<Result<Vec<_>, StoreError>>()?,
                )
            };
            // After the nodes: the numbers of those forgotten.
            let forgotten = if members.is_none() {
                Vec::new()
            } else {
                let n = v.u32("forgotten node count")?;
                (0..n)
                    .map(|_| v.u64("forgotten node"))
                    .collect::<Result<Vec<_>, StoreError>>()?
            };
            StoreOp::PutMetaApplied {
                index,
                seen,
                levels,
                members,
                forgotten,
            }
        }
        VHOST => {
            let name = k.text("vhost name")?;
            let meta = if v.done("vhost metadata").is_ok() {
                VhostMeta::default()
            } else {
                match v.u8("vhost metadata format")? {
                    VHOST_META_FORMAT => {}
                    other => {
                        return Err(StoreError::Corrupt(format!(
                            "vhost '{name}': metadata of an unknown format {other}"
                        )))
                    }
                }
                let description = v.text("vhost description")?;
                let n = v.u32("vhost tag count")?;
                let mut tags = Vec::new();
                for _ in 0..n {
                    tags.push(v.text("vhost tag")?);
                }
                let default_queue_type = match v.u8("vhost default queue type")? {
                    0 => None,
                    1 => Some(QueueType::Classic),
                    2 => Some(QueueType::Quorum),
                    other => {
                        return Err(StoreError::Corrupt(format!(
                            "vhost '{name}': an unknown default queue type {other}"
                        )))
                    }
                };
                VhostMeta {
                    description,
                    tags,
                    default_queue_type,
                }
            };
            StoreOp::PutVhost { name, meta }
        }
        USER => {
            let name = k.text("user name")?;
            let hash = match v.u8("password hash algorithm")? {
                0 => None,
                a => {
                    let algorithm = if a == 2 {
                        HashAlgorithm::Sha512
                    } else {
                        HashAlgorithm::Sha256
                    };
                    let n = v.u32("password hash length")? as usize;
                    let bytes = v.bytes(n, "password hash")?.to_vec();
                    Some(PasswordHash::from_bytes(bytes, algorithm).ok_or_else(|| {
                        StoreError::Corrupt(format!("user '{name}': password hash of a wrong size"))
                    })?)
                }
            };
            let n = v.u32("tag count")?;
            let tags = (0..n)
                .map(|_| v.text("tag"))
                .collect::<Result<Vec<_>, _>>()?;
            StoreOp::PutUser(UserDef { name, hash, tags })
        }
        LIMITS => {
            let scope = match k.u8("limits scope")? {
                VHOST => LimitScope::Vhost,
                USER => LimitScope::User,
                other => {
                    return Err(StoreError::Corrupt(format!(
                        "limits of an unknown kind {other:#04x}"
                    )))
                }
            };
            let name = k.text("limits owner")?;
            let n = v.u32("limit count")?;
            let limits = (0..n)
                .map(|_| Ok((v.text("limit name")?, v.u64("limit value")? as i64)))
                .collect::<Result<Limits, StoreError>>()?;
            StoreOp::PutLimits {
                scope,
                name,
                limits,
            }
        }
        POLICY => {
            let kind = match k.u8("policy kind")? {
                USER => PolicyKind::User,
                OPERATOR => PolicyKind::Operator,
                other => {
                    return Err(StoreError::Corrupt(format!(
                        "policy of an unknown kind {other:#04x}"
                    )))
                }
            };
            let vhost = k.text("policy vhost")?;
            let name = k.text("policy name")?;
            let pattern = v.text("policy pattern")?;
            let apply = v.text("policy apply-to")?;
            let apply_to = ApplyTo::parse(&apply).ok_or_else(|| {
                StoreError::Corrupt(format!("policy '{name}': unknown apply-to '{apply}'"))
            })?;
            let priority = v.u64("policy priority")? as i64;
            let n = v.u32("policy key count")?;
            let mut definition = Definition::new();
            for _ in 0..n {
                let key = v.text("policy key")?;
                let value = match v.u8("policy value type")? {
                    b's' => PolicyValue::Str(v.text("policy value")?),
                    b'i' => PolicyValue::Int(v.u64("policy value")? as i64),
                    b'b' => PolicyValue::Bool(v.u8("policy value")? != 0),
                    _ => PolicyValue::Other {
                        json: v.text("policy value")?,
                        erl: v.text("policy value")?,
                    },
                };
                definition.insert(key, value);
            }
            StoreOp::PutPolicy(PolicyDef {
                vhost,
                name,
                kind,
                pattern,
                apply_to,
                priority,
                definition,
            })
        }
        PERMISSION => StoreOp::PutPermission(PermissionDef {
            user: k.text("permission user")?,
            vhost: k.text("permission vhost")?,
            configure: v.text("configure")?,
            write: v.text("write")?,
            read: v.text("read")?,
        }),
        _ => StoreOp::PutTopicPermission(TopicPermissionDef {
            user: k.text("topic permission user")?,
            vhost: k.text("topic permission vhost")?,
            exchange: k.text("topic permission exchange")?,
            write: v.text("write")?,
            read: v.text("read")?,
        }),
    };
    k.done("access key")?;
    v.done("access record")?;
    Ok(op)
}

/// A `defs` record, decoded.
pub enum Def {
    /// A vhost, user or permission, as the op that wrote it.
    Access(StoreOp),
    Exchange(ExchangeDef),
    Queue(QueueDef),
    Binding(BindingDef),
}

pub fn decode_def(key: &[u8], value: &[u8]) -> Result<Def, StoreError> {
    let mut k = Reader::new(Bytes::copy_from_slice(key), "a definition key");
    let mut v = Reader::new(Bytes::copy_from_slice(value), "a definition");
    match k.u8("kind")? {
        EXCHANGE => {
            let vhost = k.vhost()?;
            let name = k.short("exchange name")?;
            k.done("exchange key")?;
            let kind_name = v.short("exchange type")?;
            let kind = ExchangeKind::parse(&kind_name).ok_or_else(|| {
                StoreError::Corrupt(format!("exchange '{name}': unknown type '{kind_name}'"))
            })?;
            let flags = v.u8("exchange flags")?;
            let arguments = v.table("exchange arguments")?;
            let incarnation = if v.done("exchange").is_ok() {
                None
            } else {
                Some(v.u64("delayed exchange incarnation")?)
            };
            Ok(Def::Exchange(ExchangeDef {
                vhost,
                name,
                kind,
                delayed: flags & FLAG_DELAYED != 0,
                incarnation,
                auto_delete: flags & FLAG_AUTO_DELETE != 0,
                internal: flags & FLAG_INTERNAL != 0,
                arguments,
            }))
        }
        QUEUE => {
            let vhost = k.vhost()?;
            let name = k.short("queue name")?;
            k.done("queue key")?;
            let key = v.u64("queue store key")?;
            let flags = v.u8("queue flags")?;
            let arguments = v.table("queue arguments")?;
            let group = if v.done("queue").is_ok() {
                None
            } else {
                // 0 is the metadata group's, never a queue's.
                Some(v.u64("replicated queue group")?).filter(|g| *g != 0)
            };
            let voters = if v.done("queue").is_ok() {
                None
            } else {
                let n = v.u8("replicated queue voter count")?;
                let mut voters = Vec::with_capacity(usize::from(n));
                for _ in 0..n {
                    voters.push(v.u64("replicated queue voter")?);
                }
                Some(voters)
            };
            Ok(Def::Queue(QueueDef {
                vhost,
                name,
                key,
                auto_delete: flags & FLAG_AUTO_DELETE != 0,
                arguments,
                group,
                voters,
            }))
        }
        BINDING => {
            let vhost = k.vhost()?;
            let source = k.short("binding source")?;
            let dest = match k.u8("binding destination kind")? {
                DEST_QUEUE => BindingDest::Queue(k.short("binding queue")?),
                DEST_EXCHANGE => BindingDest::Exchange(k.short("binding exchange")?),
                other => {
                    return Err(StoreError::Corrupt(format!(
                        "binding from '{source}': unknown destination kind {other}"
                    )))
                }
            };
            let routing_key = k.short("binding routing key")?;
            let arguments = k.table("binding arguments")?;
            k.done("binding key")?;
            Ok(Def::Binding(BindingDef {
                vhost,
                source,
                dest,
                routing_key,
                arguments,
            }))
        }
        kind @ (VHOST | USER | PERMISSION | TOPIC_PERMISSION | LIMITS | POLICY | META_APPLIED
        | META_PENDING | ACCESS_KEY | PARAMETER) => {
            decode_access(kind, &mut k, &mut v).map(Def::Access)
        }
        other => Err(StoreError::Corrupt(format!(
            "unknown definition kind {other:#04x}"
        ))),
    }
}

/// An `index` value, in either layout (told apart by length).
pub fn decode_entry(value: &[u8]) -> Result<Entry, StoreError> {
    let mut v = Reader::new(Bytes::copy_from_slice(value), "a queue entry");
    let body = v.u64("body key")?;
    if value.len() == 9 || value.len() == 17 {
        let expires_at = match v.u8("expiry flag")? {
            0 => None,
            _ => Some(v.u64("expiry")?),
        };
        return Ok(Entry {
            body,
            size: None,
            // Unknown: such a body is counted like a shared one.
            shared: true,
            expires_at,
        });
    }
    let size = v.u32("body size")?;
    let flags = v.u8("entry flags")?;
    let expires_at = if flags & ENTRY_EXPIRES != 0 {
        Some(v.u64("expiry")?)
    } else {
        None
    };
    v.done("queue entry")?;
    Ok(Entry {
        body,
        size: Some(size),
        shared: flags & ENTRY_SHARED != 0,
        expires_at,
    })
}

/// A body value: the message (under `key`) and the queues it was written for.
pub fn decode_body(key: u64, value: impl Into<Bytes>) -> Result<(Message, u32), StoreError> {
    let mut v = Reader::new(value, "a message body");
    let persistent = match v.u8("layout")? {
        BODY_V1 => true,
        BODY_V1_TRANSIENT => false,
        _ => {
            return Err(StoreError::Corrupt(format!(
                "message body {key}: unknown layout"
            )))
        }
    };
    let queues = v.u32("queue count")?;
    let exchange = v.short("exchange")?;
    let routing_key = v.short("routing key")?;
    let n = v.u32("properties length")? as usize;
    let properties = v.bytes(n, "properties")?;
    let body = v.rest();
    Ok((
        Message {
            exchange,
            routing_key,
            properties,
            body,
            persistent,
            store_key: Some(key),
            away: None,
        },
        queues,
    ))
}

pub fn decode_u64(key: &[u8], what: &str) -> Result<u64, StoreError> {
    let arr: [u8; 8] = key
        .get(..8)
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| StoreError::Corrupt(format!("{what}: key shorter than 8 bytes")))?;
    Ok(u64::from_be_bytes(arr))
}

pub fn decode_entry_key(key: &[u8]) -> Result<(u64, u64), StoreError> {
    if key.len() != 16 {
        return Err(StoreError::Corrupt(format!(
            "queue entry key of {} bytes (16 expected)",
            key.len()
        )));
    }
    Ok((
        decode_u64(key, "queue entry")?,
        decode_u64(&key[8..], "queue entry")?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use warren_codec::FieldValue;

    fn args() -> FieldTable {
        let mut t = FieldTable::new();
        t.insert(ShortStr::from_static("x-max-length"), FieldValue::I32(5));
        t
    }

    #[test]
    fn counts_carry_a_retry_time_when_they_have_one() {
        assert_eq!(decode_count(&count_value(3, None)).unwrap(), (3, None));
        assert_eq!(
            decode_count(&count_value(7, Some(1_700_000_000_123))).unwrap(),
            (7, Some(1_700_000_000_123))
        );
        assert_eq!(
            count_value(3, None).len(),
            4,
            "format 2's layout when no retry waits"
        );
        for bad in [&[0u8; 3][..], &[0u8; 5][..], &[0u8; 13][..]] {
            assert!(decode_count(bad).is_err());
        }
    }

    #[test]
    fn delayed_messages_round_trip_and_sort_by_due_time() {
        for (queue, holder) in [
            (None, Holder::Incarnation(77)),
            (Some(ShortStr::from_static("jobs")), Holder::Stored(3)),
            (Some(ShortStr::from_static("jobs")), Holder::Any),
        ] {
            let d = Delayed {
                vhost: "v".into(),
                queue,
                holder,
                refused: 0,
                message: Message {
                    exchange: ShortStr::from_static("later"),
                    routing_key: ShortStr::from_static("k"),
                    properties: Bytes::from_static(&[0x10, 0, 2]),
                    body: Bytes::from_static(b"body"),
                    persistent: false,
                    store_key: None,
                    away: None,
                },
            };
            let back = decode_delayed(delayed_value(&d).to_vec()).expect("decodes");
            assert_eq!(back, d);
            // Layout 1 (no holder) reads as held by whichever holder has the name.
            let mut v1 = delayed_value(&d).to_vec();
            v1[0] = DELAYED_V1;
            let at = 1 + 4 + d.vhost.len() + 1 + d.queue.as_ref().map_or(0, |q| 1 + q.len());
            v1.drain(at..at + 9);
            let back = decode_delayed(v1).expect("layout 1 decodes");
            assert_eq!(back.holder, Holder::Any);
            assert_eq!(back.message, d.message);
        }
        let a = delayed_key(DelayKey { due: 1, seq: 900 });
        let b = delayed_key(DelayKey { due: 2, seq: 1 });
        assert!(a.as_ref() < b.as_ref());
        assert_eq!(
            decode_delayed_key(b.as_ref()).expect("key"),
            DelayKey { due: 2, seq: 1 }
        );
        assert!(decode_delayed(vec![9, 0, 0]).is_err());
    }

    #[test]
    fn definitions_round_trip() {
        let x = ExchangeDef {
            vhost: "/".into(),
            name: ShortStr::from_static("logs"),
            kind: ExchangeKind::Topic,
            delayed: false,
            incarnation: None,
            auto_delete: true,
            internal: false,
            arguments: args(),
        };
        match decode_def(&exchange_key(&x.vhost, &x.name), &exchange_value(&x)) {
            Ok(Def::Exchange(back)) => assert_eq!(back, x),
            _ => panic!("exchange did not round-trip"),
        }
        let delayed = ExchangeDef {
            delayed: true,
            incarnation: Some(42),
            auto_delete: false,
            ..x
        };
        match decode_def(
            &exchange_key(&delayed.vhost, &delayed.name),
            &exchange_value(&delayed),
        ) {
            Ok(Def::Exchange(back)) => assert_eq!(back, delayed),
            _ => panic!("delayed exchange did not round-trip"),
        }
        let q = QueueDef {
            vhost: "v".into(),
            name: ShortStr::from_static("jobs"),
            key: 42,
            auto_delete: false,
            arguments: args(),
            group: None,
            voters: None,
        };
        match decode_def(&queue_key(&q.vhost, &q.name), &queue_value(&q)) {
            Ok(Def::Queue(back)) => assert_eq!(back, q),
            _ => panic!("queue did not round-trip"),
        }
        let placed = QueueDef {
            group: Some(u64::MAX >> 1),
            ..q
        };
        match decode_def(
            &queue_key(&placed.vhost, &placed.name),
            &queue_value(&placed),
        ) {
            Ok(Def::Queue(back)) => assert_eq!(back, placed),
            _ => panic!("a replicated queue's group did not round-trip"),
        }
        // Its own voters, with its group; with its name's, that group is written.
        let name_group = warren_broker::group_of(&placed.vhost, &placed.name);
        for (group, back_group) in [(Some(7), Some(7)), (None, Some(name_group))] {
            let voted = QueueDef {
                group,
                voters: Some(vec![3, 1]),
                ..placed.clone()
            };
            match decode_def(&queue_key(&voted.vhost, &voted.name), &queue_value(&voted)) {
                Ok(Def::Queue(back)) => assert_eq!(
                    back,
                    QueueDef {
                        group: back_group,
                        ..voted
                    }
                ),
                _ => panic!("a replicated queue's voters did not round-trip"),
            }
        }
        let b = BindingDef {
            vhost: "/".into(),
            source: ShortStr::from_static("logs"),
            dest: BindingDest::Queue(ShortStr::from_static("jobs")),
            routing_key: ShortStr::from_static("a.#"),
            arguments: args(),
        };
        match decode_def(&binding_key(&b), &[]) {
            Ok(Def::Binding(back)) => assert_eq!(back, b),
            _ => panic!("binding did not round-trip"),
        }
    }

    #[test]
    fn bodies_and_entries_round_trip() {
        let m = Message {
            exchange: ShortStr::from_static("x"),
            routing_key: ShortStr::from_static("k"),
            properties: Bytes::from_static(&[0x10, 0x00, 2]),
            body: Bytes::from_static(b"hello"),
            persistent: true,
            store_key: Some(7),
            away: None,
        };
        let (back, queues) = decode_body(7, body_value(&m, 3).to_vec()).expect("body");
        assert_eq!((back, queues), (m, 3));
        for e in [
            Entry {
                body: 9,
                size: Some(5),
                shared: false,
                expires_at: Some(1234),
            },
            Entry {
                body: 9,
                size: Some(0),
                shared: true,
                expires_at: None,
            },
        ] {
            let mut v = BytesMut::new();
            entry_value_into(&mut v, &e);
            assert_eq!(decode_entry(&v).ok(), Some(e));
        }
        // The first layout: body key, expiry flag, expiry.
        let mut old = 9u64.to_be_bytes().to_vec();
        old.push(1);
        old.extend_from_slice(&1234u64.to_be_bytes());
        let e = decode_entry(&old).expect("old layout");
        assert_eq!((e.body, e.size, e.expires_at), (9, None, Some(1234)));
        assert!(!e.pageable());
        assert_eq!(
            decode_entry_key(entry_key_in(None, 3, 4).as_ref()).ok(),
            Some((3, 4))
        );
    }

    #[test]
    fn damaged_values_are_errors_not_panics() {
        assert!(decode_body(1, vec![BODY_V1, 0, 0]).is_err());
        assert!(decode_entry(&[1, 2]).is_err());
        assert!(decode_def(&[EXCHANGE, 0, 0, 0, 9], &[]).is_err());
        assert!(decode_def(&[0xff], &[]).is_err());
        assert!(decode_entry_key(&[0; 3]).is_err());
    }
}
