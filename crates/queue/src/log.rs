//! The queue command log: every command applied to a queue machine, as plain bytes, and the
//! replay that checks a log rebuilds the same machines.
//!
//! The broker records `(queue, meta, command)` with a digest of the reply and effects and,
//! after every command while the queue holds few messages and every [`STATE_DIGEST_EVERY`]
//! commands otherwise, a digest of the whole machine. [`replay`] applies the commands to fresh machines and compares both digests at
//! every record: any divergence (a command missing from the log, a decision taken outside the
//! machine, an order that depends on hashing) shows up as a mismatch.
//!
//! A record is `u32` length (big-endian), then the format version ([`FORMAT_VERSION`], one
//! byte), a CRC-32 (big-endian, of everything after it) and the body. A log cut short by a crash
//! ends with a partial record, or a last record whose checksum fails (a torn write), which
//! [`replay`] reports and ignores; a bad checksum before the end is an error.
//!
//! A command alone, as a replicated log carries it, is an *entry* ([`encode_entry`],
//! [`decode_entry`]): the same version byte and checksum around the command's encoding. A
//! reader refuses a version it does not know rather than guess, so a node of an older build
//! stops instead of applying an entry it would misread.

use std::collections::BTreeMap;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use warren_codec::{FieldTable, ShortStr};

use super::machine::{
    effects_digest, Command, ConsumerId, ConsumerSpec, Credit, CreditGroup, DedupKey, DedupWindow,
    Effect, EnqueuerId, Loaded, Meta, MsgMeta, Policy, QueueMachine, Receipt, RetryPolicy,
};
use crate::Message;
use crate::Overflow;

/// How often (in commands per queue) a record carries the digest of the whole machine.
pub const STATE_DIGEST_EVERY: u64 = 16;

/// One applied command.
#[derive(Clone, Debug, PartialEq)]
pub struct Record {
    pub queue: u64,
    pub meta: Meta,
    pub command: Command<Message>,
    /// [`effects_digest`] of the reply and effects the command gave.
    pub effects: u64,
    /// [`QueueMachine::digest`] after the command, on some records.
    pub state: Option<u64>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LogError {
    #[error("record {record}: {what}")]
    Malformed { record: u64, what: String },
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ReplayError {
    #[error(transparent)]
    Log(#[from] LogError),
    #[error("queue {queue}, index {index}: {what} differs on replay (recorded {recorded:#x}, replayed {replayed:#x})")]
    Diverged {
        queue: u64,
        index: u64,
        what: &'static str,
        recorded: u64,
        replayed: u64,
    },
    #[error("queue {queue}: index {index} follows {previous} (a command is missing from the log)")]
    Gap {
        queue: u64,
        index: u64,
        previous: u64,
    },
}

/// What a replay checked.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReplaySummary {
    pub records: u64,
    pub queues: usize,
    pub state_checks: u64,
    /// The log ended inside a record (the writer was killed); the partial record was ignored.
    pub truncated: bool,
}

// ---------------------------------------------------------------------- encoding

/// The version of the record and entry encoding. 1: the first versioned format (before it,
/// records had no version byte and no checksum).
pub const FORMAT_VERSION: u8 = 1;

const ENQUEUE: u8 = 1;
const CONSUME: u8 = 2;
const CANCEL: u8 = 3;
const CREDIT: u8 = 4;
const CHECKOUT: u8 = 5;
const GET: u8 = 6;
const SETTLE: u8 = 7;
const RETURN: u8 = 8;
const DISCARD: u8 = 9;
const PURGE: u8 = 10;
const TICK: u8 = 11;
const RESTORE: u8 = 12;
const SKIP_IDS: u8 = 13;
const RESTORE_RUN: u8 = 14;
const PAGE_OUT: u8 = 15;
const LOAD: u8 = 16;
const CONFIGURE: u8 = 17;
const TOUCH: u8 = 18;
const EXTEND: u8 = 19;
const RELEASE: u8 = 20;
const DOWN: u8 = 21;
const ENQUEUE_FROM: u8 = 22;
const UNREGISTER: u8 = 23;
const GET_BY: u8 = 24;
const CAP_EXPIRY: u8 = 25;
const ENQUEUE_WITH: u8 = 26;
const DEAD_LETTERED: u8 = 27;

pub(crate) fn put_short(out: &mut BytesMut, s: &ShortStr) {
    out.put_u8(s.len() as u8);
    out.put_slice(s.as_bytes());
}

pub(crate) fn put_long(out: &mut BytesMut, b: &[u8]) {
    out.put_u32(u32::try_from(b.len()).unwrap_or(u32::MAX));
    out.put_slice(b);
}

pub(crate) fn put_opt_u64(out: &mut BytesMut, v: Option<u64>) {
    match v {
        Some(v) => {
            out.put_u8(1);
            out.put_u64(v);
        }
        None => out.put_u8(0),
    }
}

pub(crate) fn put_receipt(out: &mut BytesMut, r: Receipt) {
    out.put_u64(r.msg_id);
    out.put_u32(r.attempt);
}

pub(crate) fn put_group(out: &mut BytesMut, g: CreditGroup) {
    out.put_u64(g.conn);
    out.put_u16(g.channel);
}

pub(crate) fn put_message(out: &mut BytesMut, message: &Message) {
    put_short(out, &message.exchange);
    put_short(out, &message.routing_key);
    put_long(out, &message.properties);
    put_long(out, &message.body);
    out.put_u8(u8::from(message.persistent));
    put_opt_u64(out, message.store_key);
}

pub(crate) fn put_msg_meta(out: &mut BytesMut, meta: &MsgMeta) {
    out.put_u64(meta.size);
    put_opt_u64(out, meta.expires_at);
    out.put_u8(u8::from(meta.pageable) | u8::from(meta.spilled) << 1);
    out.put_u8(meta.priority);
    put_opt_u64(out, meta.group.map(std::num::NonZeroU64::get));
}

pub(crate) fn put_policy(out: &mut BytesMut, p: &Policy) {
    put_opt_u64(out, p.max_length);
    put_opt_u64(out, p.max_length_bytes);
    out.put_u8(match p.overflow {
        Overflow::DropHead => 0,
        Overflow::RejectPublish => 1,
        Overflow::RejectPublishDlx => 2,
    });
    put_opt_u64(out, p.expires_ms);
    put_opt_u64(out, p.max_priority.map(u64::from));
    out.put_u8(
        u8::from(p.single_active)
            | u8::from(p.deliver_on_apply) << 1
            | u8::from(p.hold_dead_letters) << 2
            | u8::from(p.index_groups) << 3,
    );
    put_opt_u64(out, p.delivery_limit);
    put_opt_u64(out, p.visibility_timeout_ms);
    put_opt_u64(out, p.consumer_timeout_ms);
    match p.retry {
        Some(r) => {
            out.put_u8(1);
            out.put_u64(r.min_ms);
            put_opt_u64(out, r.max_ms);
            put_opt_u64(out, r.multiplier);
            out.put_u8(r.jitter_pct);
        }
        None => out.put_u8(0),
    }
}

pub(crate) fn put_consumer_spec(out: &mut BytesMut, spec: &ConsumerSpec) {
    put_group(out, spec.group);
    put_short(out, &spec.tag);
    out.put_u8(u8::from(spec.no_ack) | u8::from(spec.exclusive) << 1);
    out.put_u32(spec.prefetch);
    out.put_i64(spec.priority);
    spec.arguments.encode(out);
}

/// Appends one record to `out`.
pub fn encode(record: &Record, out: &mut BytesMut) {
    let start = out.len();
    out.put_u32(0);
    out.put_u8(FORMAT_VERSION);
    out.put_u32(0);
    out.put_u64(record.queue);
    out.put_u64(record.meta.index);
    out.put_u64(record.meta.now_ms);
    put_command(out, &record.command);
    out.put_u64(record.effects);
    put_opt_u64(out, record.state);
    seal(out, start);
}

/// A command that cannot be an entry of a replicated log.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EntryError {
    #[error("{0} is this node's own (paging or recovery) and is never replicated")]
    NodeLocal(&'static str),
}

/// Appends one command as a replicated log's entry: version, checksum, command.
///
/// Only logical facts are written. Node-local commands are refused
/// ([`Command::is_node_local`]), and an enqueue leaves out what only the writing node knows:
/// the message's store key and whether this node may page it (`pageable`, `spilled`). The
/// node applying the entry decides those for itself, so two members under different memory
/// pressure apply the same commands and reach the same digest.
pub fn encode_entry(command: &Command<Message>, out: &mut BytesMut) -> Result<(), EntryError> {
    if command.is_node_local() {
        return Err(EntryError::NodeLocal(command.name()));
    }
    let start = out.len();
    out.put_u8(FORMAT_VERSION);
    out.put_u32(0);
    match command {
        Command::Enqueue { message, meta } => {
            let (message, meta) = (logical_message(message), logical_meta(meta));
            put_command(out, &Command::Enqueue { message, meta });
        }
        Command::EnqueueFrom {
            enqueuer,
            seq,
            message,
            meta,
        } => {
            let command = Command::EnqueueFrom {
                enqueuer: *enqueuer,
                seq: *seq,
                message: logical_message(message),
                meta: logical_meta(meta),
            };
            put_command(out, &command);
        }
        Command::EnqueueWith {
            delay_ms,
            from,
            dedup,
            message,
            meta,
        } => {
            let command = Command::EnqueueWith {
                delay_ms: *delay_ms,
                from: *from,
                dedup: dedup.clone(),
                message: logical_message(message),
                meta: logical_meta(meta),
            };
            put_command(out, &command);
        }
        other => put_command(out, other),
    }
    let crc = crc32fast::hash(&out[start + 5..]);
    out[start + 1..start + 5].copy_from_slice(&crc.to_be_bytes());
    Ok(())
}

/// A message without what only the writing node knows (its store key).
fn logical_message(message: &Message) -> Message {
    Message {
        store_key: None,
        away: None,
        ..message.clone()
    }
}

/// A message's meta without this node's paging flags.
fn logical_meta(meta: &MsgMeta) -> MsgMeta {
    MsgMeta {
        pageable: false,
        spilled: false,
        ..*meta
    }
}

/// Reads an entry written by [`encode_entry`].
pub fn decode_entry(mut entry: Bytes) -> Result<Command<Message>, LogError> {
    let mut r = Reader {
        buf: entry.clone(),
        record: 0,
    };
    let version = r.u8("version")?;
    if version != FORMAT_VERSION {
        return Err(r.fail(unknown_version(version)));
    }
    let crc = r.u32("checksum")?;
    entry.advance(5);
    if crc32fast::hash(&entry) != crc {
        return Err(r.fail("checksum mismatch"));
    }
    let command = r.command()?;
    if r.buf.has_remaining() {
        return Err(r.fail(format!("{} bytes after the entry", r.buf.remaining())));
    }
    Ok(command)
}

fn unknown_version(version: u8) -> String {
    format!("format version {version}, this build reads version {FORMAT_VERSION}")
}

/// Fills in a record's length and checksum, once its body is written.
fn seal(out: &mut BytesMut, start: usize) {
    let len = u32::try_from(out.len() - start - 4).unwrap_or(u32::MAX);
    out[start..start + 4].copy_from_slice(&len.to_be_bytes());
    let crc = crc32fast::hash(&out[start + 9..]);
    out[start + 5..start + 9].copy_from_slice(&crc.to_be_bytes());
}

fn put_command(out: &mut BytesMut, command: &Command<Message>) {
    match command {
        Command::Enqueue { message, meta } => {
            out.put_u8(ENQUEUE);
            put_message(out, message);
            put_msg_meta(out, meta);
        }
        Command::EnqueueFrom {
            enqueuer,
            seq,
            message,
            meta,
        } => {
            out.put_u8(ENQUEUE_FROM);
            out.put_u64(enqueuer.0);
            out.put_u64(*seq);
            put_message(out, message);
            put_msg_meta(out, meta);
        }
        Command::EnqueueWith {
            delay_ms,
            from,
            dedup,
            message,
            meta,
        } => {
            out.put_u8(ENQUEUE_WITH);
            out.put_u64(*delay_ms);
            // Which of the optional parts follow: 1, the enqueuer; 2, the window.
            out.put_u8(u8::from(from.is_some()) | u8::from(dedup.is_some()) << 1);
            if let Some((enqueuer, seq)) = from {
                out.put_u64(enqueuer.0);
                out.put_u64(*seq);
            }
            if let Some(w) = dedup {
                out.put_u8(w.key.len);
                out.put_slice(&w.key.bytes);
                out.put_u64(w.ttl_ms);
                out.put_u32(w.max_keys);
            }
            put_message(out, message);
            put_msg_meta(out, meta);
        }
        Command::Unregister { enqueuer } => {
            out.put_u8(UNREGISTER);
            out.put_u64(enqueuer.0);
        }
        Command::Down { node } => {
            out.put_u8(DOWN);
            out.put_u16(*node);
        }
        Command::Restore {
            msg_id,
            message,
            meta,
            delivery_count,
            redelivered,
            retry_at,
        } => {
            out.put_u8(RESTORE);
            out.put_u64(*msg_id);
            put_message(out, message);
            put_msg_meta(out, meta);
            out.put_u32(*delivery_count);
            out.put_u8(u8::from(*redelivered));
            put_opt_u64(out, *retry_at);
        }
        Command::SkipIds { next_id } => {
            out.put_u8(SKIP_IDS);
            out.put_u64(*next_id);
        }
        Command::RestoreRun {
            first_id,
            last_id,
            count,
            bytes,
            redelivered,
            expires_min,
        } => {
            out.put_u8(RESTORE_RUN);
            out.put_u64(*first_id);
            out.put_u64(*last_id);
            out.put_u64(*count);
            out.put_u64(*bytes);
            out.put_u8(u8::from(*redelivered));
            put_opt_u64(out, *expires_min);
        }
        Command::PageOut {
            keep,
            keep_bytes,
            upto_id,
        } => {
            out.put_u8(PAGE_OUT);
            out.put_u32(*keep);
            out.put_u64(*keep_bytes);
            out.put_u64(*upto_id);
        }
        Command::Load {
            messages,
            through_id,
        } => {
            out.put_u8(LOAD);
            out.put_u64(*through_id);
            out.put_u32(u32::try_from(messages.len()).unwrap_or(u32::MAX));
            for m in messages {
                out.put_u64(m.msg_id);
                put_message(out, &m.message);
                put_msg_meta(out, &m.meta);
                out.put_u32(m.delivery_count);
            }
        }
        Command::Consume { id, spec } => {
            out.put_u8(CONSUME);
            out.put_u64(id.0);
            put_consumer_spec(out, spec);
        }
        Command::Cancel { id } => {
            out.put_u8(CANCEL);
            out.put_u64(id.0);
        }
        Command::Credit { group, credit } => {
            out.put_u8(CREDIT);
            put_group(out, *group);
            out.put_u8(u8::from(credit.blocked));
            put_opt_u64(out, credit.limit.map(u64::from));
        }
        Command::Checkout { max } => {
            out.put_u8(CHECKOUT);
            out.put_u32(*max);
        }
        Command::Get { no_ack } => {
            out.put_u8(GET);
            out.put_u8(u8::from(*no_ack));
        }
        Command::GetBy { no_ack, node } => {
            out.put_u8(GET_BY);
            out.put_u8(u8::from(*no_ack));
            out.put_u16(*node);
        }
        Command::Settle { receipt } => {
            out.put_u8(SETTLE);
            put_receipt(out, *receipt);
        }
        Command::Return { receipt } => {
            out.put_u8(RETURN);
            put_receipt(out, *receipt);
        }
        Command::Discard { receipt } => {
            out.put_u8(DISCARD);
            put_receipt(out, *receipt);
        }
        Command::Release { receipt } => {
            out.put_u8(RELEASE);
            put_receipt(out, *receipt);
        }
        Command::Purge => out.put_u8(PURGE),
        Command::Tick => out.put_u8(TICK),
        Command::Configure(policy) => {
            out.put_u8(CONFIGURE);
            put_policy(out, policy);
        }
        Command::Touch => out.put_u8(TOUCH),
        Command::CapExpiry { caps } => {
            out.put_u8(CAP_EXPIRY);
            out.put_u32(u32::try_from(caps.len()).unwrap_or(u32::MAX));
            for (up_to, at) in caps {
                out.put_u64(*up_to);
                out.put_u64(*at);
            }
        }
        Command::DeadLettered { ids } => {
            out.put_u8(DEAD_LETTERED);
            out.put_u32(u32::try_from(ids.len()).unwrap_or(u32::MAX));
            for id in ids {
                out.put_u64(*id);
            }
        }
        Command::Extend {
            receipt,
            timeout_ms,
        } => {
            out.put_u8(EXTEND);
            put_receipt(out, *receipt);
            out.put_u64(*timeout_ms);
        }
    }
}

/// Reads a record body; every length is checked against what is left.
pub(crate) struct Reader {
    pub(crate) buf: Bytes,
    record: u64,
}

impl Reader {
    /// A reader of one body (a snapshot's: no record number).
    pub(crate) fn new(buf: Bytes) -> Self {
        Reader { buf, record: 0 }
    }

    pub(crate) fn fail(&self, what: impl Into<String>) -> LogError {
        LogError::Malformed {
            record: self.record,
            what: what.into(),
        }
    }

    pub(crate) fn need(&self, n: usize, what: &str) -> Result<(), LogError> {
        if self.buf.remaining() < n {
            return Err(self.fail(format!("{what} cut short")));
        }
        Ok(())
    }

    pub(crate) fn u8(&mut self, what: &str) -> Result<u8, LogError> {
        self.need(1, what)?;
        Ok(self.buf.get_u8())
    }

    pub(crate) fn u16(&mut self, what: &str) -> Result<u16, LogError> {
        self.need(2, what)?;
        Ok(self.buf.get_u16())
    }

    pub(crate) fn u32(&mut self, what: &str) -> Result<u32, LogError> {
        self.need(4, what)?;
        Ok(self.buf.get_u32())
    }

    pub(crate) fn u64(&mut self, what: &str) -> Result<u64, LogError> {
        self.need(8, what)?;
        Ok(self.buf.get_u64())
    }

    pub(crate) fn i64(&mut self, what: &str) -> Result<i64, LogError> {
        self.need(8, what)?;
        Ok(self.buf.get_i64())
    }

    pub(crate) fn opt_u64(&mut self, what: &str) -> Result<Option<u64>, LogError> {
        match self.u8(what)? {
            0 => Ok(None),
            1 => Ok(Some(self.u64(what)?)),
            t => Err(self.fail(format!("{what}: bad option tag {t}"))),
        }
    }

    pub(crate) fn bytes(&mut self, n: usize, what: &str) -> Result<Bytes, LogError> {
        self.need(n, what)?;
        Ok(self.buf.split_to(n))
    }

    pub(crate) fn short(&mut self, what: &str) -> Result<ShortStr, LogError> {
        let n = usize::from(self.u8(what)?);
        let b = self.bytes(n, what)?;
        ShortStr::try_from_bytes(b).map_err(|e| self.fail(format!("{what}: {e}")))
    }

    pub(crate) fn long(&mut self, what: &str) -> Result<Bytes, LogError> {
        let n = self.u32(what)? as usize;
        self.bytes(n, what)
    }

    pub(crate) fn receipt(&mut self) -> Result<Receipt, LogError> {
        Ok(Receipt {
            msg_id: self.u64("receipt")?,
            attempt: self.u32("receipt")?,
        })
    }

    pub(crate) fn group(&mut self) -> Result<CreditGroup, LogError> {
        Ok(CreditGroup {
            conn: self.u64("group")?,
            channel: self.u16("group")?,
        })
    }

    pub(crate) fn message(&mut self) -> Result<Message, LogError> {
        Ok(Message {
            exchange: self.short("exchange")?,
            routing_key: self.short("routing key")?,
            properties: self.long("properties")?,
            body: self.long("body")?,
            persistent: self.u8("persistent")? != 0,
            store_key: self.opt_u64("store key")?,
            away: None,
        })
    }

    pub(crate) fn msg_meta(&mut self) -> Result<MsgMeta, LogError> {
        let size = self.u64("size")?;
        let expires_at = self.opt_u64("expiry")?;
        let flags = self.u8("paging flags")?;
        Ok(MsgMeta {
            size,
            expires_at,
            pageable: flags & 1 != 0,
            spilled: flags & 2 != 0,
            priority: self.u8("priority")?,
            group: self.opt_u64("group")?.and_then(std::num::NonZeroU64::new),
        })
    }

    pub(crate) fn policy(&mut self) -> Result<Policy, LogError> {
        let max_length = self.opt_u64("max length")?;
        let max_length_bytes = self.opt_u64("max length bytes")?;
        let overflow = match self.u8("overflow")? {
            0 => Overflow::DropHead,
            1 => Overflow::RejectPublish,
            2 => Overflow::RejectPublishDlx,
            t => return Err(self.fail(format!("bad overflow {t}"))),
        };
        let expires_ms = self.opt_u64("expires")?;
        let max_priority = match self.opt_u64("max priority")? {
            Some(p) => Some(u8::try_from(p).map_err(|_| self.fail("max priority over 255"))?),
            None => None,
        };
        let flags = self.u8("single active")?;
        Ok(Policy {
            max_length,
            max_length_bytes,
            overflow,
            expires_ms,
            max_priority,
            single_active: flags & 1 != 0,
            delivery_limit: self.opt_u64("delivery limit")?,
            visibility_timeout_ms: self.opt_u64("visibility timeout")?,
            consumer_timeout_ms: self.opt_u64("consumer timeout")?,
            retry: match self.u8("retry")? {
                0 => None,
                1 => Some(RetryPolicy {
                    min_ms: self.u64("retry min")?,
                    max_ms: self.opt_u64("retry max")?,
                    multiplier: self.opt_u64("retry multiplier")?,
                    jitter_pct: self.u8("retry jitter")?,
                }),
                t => return Err(self.fail(format!("bad retry tag {t}"))),
            },
            deliver_on_apply: flags & 2 != 0,
            hold_dead_letters: flags & 4 != 0,
            index_groups: flags & 8 != 0,
        })
    }

    pub(crate) fn consumer_spec(&mut self) -> Result<ConsumerSpec, LogError> {
        let group = self.group()?;
        let tag = self.short("tag")?;
        let flags = self.u8("flags")?;
        let prefetch = self.u32("prefetch")?;
        let priority = self.i64("priority")?;
        let arguments = FieldTable::decode(&mut self.buf).map_err(|e| self.fail(e.to_string()))?;
        Ok(ConsumerSpec {
            group,
            tag,
            no_ack: flags & 1 != 0,
            prefetch,
            exclusive: flags & 2 != 0,
            priority,
            arguments,
        })
    }

    fn command(&mut self) -> Result<Command<Message>, LogError> {
        Ok(match self.u8("command")? {
            ENQUEUE => {
                let message = self.message()?;
                let meta = self.msg_meta()?;
                Command::Enqueue { message, meta }
            }
            ENQUEUE_FROM => {
                let enqueuer = EnqueuerId(self.u64("enqueuer")?);
                let seq = self.u64("sequence")?;
                let message = self.message()?;
                let meta = self.msg_meta()?;
                Command::EnqueueFrom {
                    enqueuer,
                    seq,
                    message,
                    meta,
                }
            }
            ENQUEUE_WITH => {
                let delay_ms = self.u64("delay")?;
                let parts = self.u8("parts")?;
                if parts > 3 {
                    return Err(self.fail(format!("enqueue parts {parts:#x}")));
                }
                let from = if parts & 1 != 0 {
                    Some((EnqueuerId(self.u64("enqueuer")?), self.u64("sequence")?))
                } else {
                    None
                };
                let dedup = if parts & 2 != 0 {
                    let len = self.u8("deduplication key length")?;
                    if len > 32 && len != u8::MAX {
                        return Err(self.fail(format!("deduplication key length {len}")));
                    }
                    let mut bytes = [0u8; 32];
                    for b in &mut bytes {
                        *b = self.u8("deduplication key")?;
                    }
                    Some(Box::new(DedupWindow {
                        key: DedupKey { len, bytes },
                        ttl_ms: self.u64("deduplication window")?,
                        max_keys: self.u32("deduplication keys")?,
                    }))
                } else {
                    None
                };
                let message = self.message()?;
                let meta = self.msg_meta()?;
                Command::EnqueueWith {
                    delay_ms,
                    from,
                    dedup,
                    message,
                    meta,
                }
            }
            UNREGISTER => Command::Unregister {
                enqueuer: EnqueuerId(self.u64("enqueuer")?),
            },
            DOWN => Command::Down {
                node: self.u16("node")?,
            },
            RESTORE => {
                let msg_id = self.u64("message id")?;
                let message = self.message()?;
                let meta = self.msg_meta()?;
                Command::Restore {
                    msg_id,
                    message,
                    meta,
                    delivery_count: self.u32("delivery count")?,
                    redelivered: self.u8("redelivered")? != 0,
                    retry_at: self.opt_u64("retry due")?,
                }
            }
            SKIP_IDS => Command::SkipIds {
                next_id: self.u64("next id")?,
            },
            RESTORE_RUN => Command::RestoreRun {
                first_id: self.u64("first id")?,
                last_id: self.u64("last id")?,
                count: self.u64("count")?,
                bytes: self.u64("bytes")?,
                redelivered: self.u8("redelivered")? != 0,
                expires_min: self.opt_u64("earliest expiry")?,
            },
            CONFIGURE => Command::Configure(self.policy()?),
            TOUCH => Command::Touch,
            CAP_EXPIRY => {
                let n = self.u32("cap count")?;
                let mut caps = Vec::new();
                for _ in 0..n {
                    caps.push((self.u64("cap id")?, self.u64("cap expiry")?));
                }
                Command::CapExpiry { caps }
            }
            DEAD_LETTERED => {
                let n = self.u32("id count")?;
                // Grown as ids are read: the count is not trusted for an allocation.
                let mut ids = Vec::new();
                for _ in 0..n {
                    ids.push(self.u64("id")?);
                }
                Command::DeadLettered { ids }
            }
            RELEASE => Command::Release {
                receipt: self.receipt()?,
            },
            EXTEND => Command::Extend {
                receipt: self.receipt()?,
                timeout_ms: self.u64("timeout")?,
            },
            PAGE_OUT => Command::PageOut {
                keep: self.u32("keep")?,
                keep_bytes: self.u64("keep bytes")?,
                upto_id: self.u64("upto id")?,
            },
            LOAD => {
                let through_id = self.u64("through id")?;
                let n = self.u32("message count")?;
                // Grown as records are read: the count is not trusted for an allocation.
                let mut messages = Vec::new();
                for _ in 0..n {
                    messages.push(Loaded {
                        msg_id: self.u64("message id")?,
                        message: self.message()?,
                        meta: self.msg_meta()?,
                        delivery_count: self.u32("delivery count")?,
                    });
                }
                Command::Load {
                    messages,
                    through_id,
                }
            }
            CONSUME => Command::Consume {
                id: ConsumerId(self.u64("consumer")?),
                spec: self.consumer_spec()?,
            },
            CANCEL => Command::Cancel {
                id: ConsumerId(self.u64("consumer")?),
            },
            CREDIT => {
                let group = self.group()?;
                let blocked = self.u8("credit")? != 0;
                let limit = match self.opt_u64("credit")? {
                    Some(n) => {
                        Some(u32::try_from(n).map_err(|_| self.fail("credit limit too large"))?)
                    }
                    None => None,
                };
                Command::Credit {
                    group,
                    credit: Credit { blocked, limit },
                }
            }
            CHECKOUT => Command::Checkout {
                max: self.u32("max")?,
            },
            GET => Command::Get {
                no_ack: self.u8("no_ack")? != 0,
            },
            GET_BY => Command::GetBy {
                no_ack: self.u8("no_ack")? != 0,
                node: self.u16("node")?,
            },
            SETTLE => Command::Settle {
                receipt: self.receipt()?,
            },
            RETURN => Command::Return {
                receipt: self.receipt()?,
            },
            DISCARD => Command::Discard {
                receipt: self.receipt()?,
            },
            PURGE => Command::Purge,
            TICK => Command::Tick,
            t => return Err(self.fail(format!("unknown command {t}"))),
        })
    }
}

/// Decodes the records of a log. Returns them and whether the log ended inside a record.
pub fn decode_all(mut data: Bytes) -> Result<(Vec<Record>, bool), LogError> {
    let mut out = Vec::new();
    let mut n = 0u64;
    loop {
        if data.is_empty() {
            return Ok((out, false));
        }
        if data.len() < 4 {
            return Ok((out, true));
        }
        let len = u32::from_be_bytes([data[0], data[1], data[2], data[3]]) as usize;
        if data.len() - 4 < len {
            return Ok((out, true));
        }
        data.advance(4);
        let body = data.split_to(len);
        let mut r = Reader {
            buf: body.clone(),
            record: n,
        };
        let version = r.u8("version")?;
        if version != FORMAT_VERSION {
            return Err(r.fail(unknown_version(version)));
        }
        let crc = r.u32("checksum")?;
        if crc32fast::hash(&body[5..]) != crc {
            if data.is_empty() {
                // The last record, written only in part before a crash.
                return Ok((out, true));
            }
            return Err(r.fail("checksum mismatch"));
        }
        let queue = r.u64("queue")?;
        let meta = Meta {
            index: r.u64("index")?,
            now_ms: r.u64("time")?,
        };
        let command = r.command()?;
        let effects = r.u64("effects digest")?;
        let state = r.opt_u64("state digest")?;
        if r.buf.has_remaining() {
            return Err(r.fail(format!("{} bytes after the record", r.buf.remaining())));
        }
        out.push(Record {
            queue,
            meta,
            command,
            effects,
            state,
        });
        n += 1;
    }
}

/// Applies a log to fresh machines and checks every recorded digest.
pub fn replay(data: Bytes) -> Result<ReplaySummary, ReplayError> {
    let (records, truncated) = decode_all(data)?;
    replay_records(records, truncated).map(|(summary, _)| summary)
}

/// [`replay`] over decoded records; also returns the rebuilt machines by queue id.
pub fn replay_records(
    records: Vec<Record>,
    truncated: bool,
) -> Result<(ReplaySummary, BTreeMap<u64, QueueMachine<Message>>), ReplayError> {
    let mut machines: BTreeMap<u64, QueueMachine<Message>> = BTreeMap::new();
    let mut effects: Vec<Effect<Message>> = Vec::new();
    let mut summary = ReplaySummary {
        truncated,
        ..ReplaySummary::default()
    };
    for r in records {
        let m = machines.entry(r.queue).or_default();
        if r.meta.index != m.last_index() + 1 {
            return Err(ReplayError::Gap {
                queue: r.queue,
                index: r.meta.index,
                previous: m.last_index(),
            });
        }
        effects.clear();
        let reply = m.apply(r.meta, r.command, &mut effects);
        let got = effects_digest(&reply, &effects);
        if got != r.effects {
            return Err(ReplayError::Diverged {
                queue: r.queue,
                index: r.meta.index,
                what: "reply and effects",
                recorded: r.effects,
                replayed: got,
            });
        }
        if let Some(want) = r.state {
            let got = m.digest();
            summary.state_checks += 1;
            if got != want {
                return Err(ReplayError::Diverged {
                    queue: r.queue,
                    index: r.meta.index,
                    what: "state",
                    recorded: want,
                    replayed: got,
                });
            }
        }
        summary.records += 1;
    }
    summary.queues = machines.len();
    Ok((summary, machines))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::machine::Reply;

    fn enqueue(body: &'static [u8]) -> Command<Message> {
        Command::Enqueue {
            message: Message {
                exchange: ShortStr::from_static("x"),
                routing_key: ShortStr::from_static("rk"),
                properties: Bytes::from_static(&[0, 0]),
                body: Bytes::from_static(body),
                persistent: true,
                store_key: None,
                away: None,
            },
            meta: MsgMeta {
                size: body.len() as u64,
                ..MsgMeta::default()
            },
        }
    }

    fn record(index: u64, command: Command<Message>) -> Record {
        let mut m = QueueMachine::<Message>::default();
        let meta = Meta { index, now_ms: 5 };
        let mut effects = Vec::new();
        let reply = m.apply(meta, command.clone(), &mut effects);
        Record {
            queue: 7,
            meta,
            command,
            effects: effects_digest(&reply, &effects),
            state: Some(m.digest()),
        }
    }

    #[test]
    fn an_entry_round_trips_and_a_flipped_bit_or_an_unknown_version_is_refused() {
        let command = enqueue(b"hello");
        let mut out = BytesMut::new();
        encode_entry(&command, &mut out).unwrap();
        let entry = out.freeze();
        assert_eq!(decode_entry(entry.clone()), Ok(command));
        for i in 0..entry.len() {
            let mut bad = entry.to_vec();
            bad[i] ^= 0x10;
            assert!(
                decode_entry(Bytes::from(bad)).is_err(),
                "byte {i} flipped was accepted"
            );
        }
        let mut newer = entry.to_vec();
        newer[0] = FORMAT_VERSION + 1;
        let err = decode_entry(Bytes::from(newer)).unwrap_err().to_string();
        assert!(err.contains("format version 2"), "{err}");
    }

    #[test]
    fn an_expiry_cap_round_trips() {
        let command = Command::CapExpiry {
            caps: vec![(7, 1_000), (u64::MAX, 2_000)],
        };
        let mut out = BytesMut::new();
        encode_entry(&command, &mut out).unwrap();
        assert_eq!(decode_entry(out.freeze()), Ok(command));
    }

    #[test]
    fn a_torn_last_record_is_a_truncated_log_and_a_damaged_earlier_one_an_error() {
        let mut out = BytesMut::new();
        encode(&record(1, enqueue(b"one")), &mut out);
        let first_len = out.len();
        encode(&record(1, enqueue(b"two")), &mut out);
        let log = out.freeze();
        let (records, truncated) = decode_all(log.clone()).unwrap();
        assert_eq!((records.len(), truncated), (2, false));

        // The last record's body damaged (written in part): the first one is kept.
        let mut torn = log.to_vec();
        let last = torn.len() - 3;
        torn[last] ^= 0xff;
        let (records, truncated) = decode_all(Bytes::from(torn)).unwrap();
        assert_eq!((records.len(), truncated), (1, true));

        // The first record damaged: not a crash's doing, so an error.
        let mut damaged = log.to_vec();
        damaged[first_len - 3] ^= 0xff;
        let err = decode_all(Bytes::from(damaged)).unwrap_err().to_string();
        assert!(err.contains("checksum mismatch"), "{err}");
    }

    #[test]
    fn an_entry_carries_logical_facts_only_so_members_under_different_memory_pressure_agree() {
        // The same publish as two members would log it: one stored the body and may page it
        // out, the other keeps it in memory.
        let plain = enqueue(b"payload");
        let Command::Enqueue { message, meta } = plain.clone() else {
            unreachable!()
        };
        let local = Command::Enqueue {
            message: Message {
                store_key: Some(42),
                away: None,
                ..message
            },
            meta: MsgMeta {
                pageable: true,
                spilled: true,
                ..meta
            },
        };
        let entry = |c: &Command<Message>| {
            let mut out = BytesMut::new();
            encode_entry(c, &mut out).unwrap();
            out.freeze()
        };
        assert_eq!(entry(&local), entry(&plain));
        let (mut a, mut b) = (QueueMachine::default(), QueueMachine::default());
        let meta = Meta {
            index: 1,
            now_ms: 1,
        };
        let mut effects = Vec::new();
        a.apply(meta, decode_entry(entry(&local)).unwrap(), &mut effects);
        b.apply(meta, decode_entry(entry(&plain)).unwrap(), &mut effects);
        assert_eq!(a.digest(), b.digest());

        // What only this node's memory or disk asks for is refused.
        let paging = Command::PageOut {
            keep: 0,
            keep_bytes: 0,
            upto_id: 1,
        };
        assert_eq!(
            encode_entry(&paging, &mut BytesMut::new()),
            Err(EntryError::NodeLocal("page_out"))
        );
        let load = Command::Load {
            messages: Vec::new(),
            through_id: 1,
        };
        assert!(encode_entry(&load, &mut BytesMut::new()).is_err());
    }

    fn message(body: &'static [u8]) -> Message {
        Message {
            exchange: ShortStr::from(""),
            routing_key: ShortStr::from("q"),
            properties: Bytes::from_static(&[0, 0]),
            body: Bytes::from_static(body),
            persistent: false,
            store_key: None,
            away: None,
        }
    }

    /// Runs the commands on one queue, recording each as the broker does (with a state
    /// digest on every record).
    fn record_all(commands: Vec<Command<Message>>) -> (BytesMut, Vec<Record>) {
        let mut m = QueueMachine::new();
        let mut effects = Vec::new();
        let mut out = BytesMut::new();
        let mut records = Vec::new();
        for (i, command) in commands.into_iter().enumerate() {
            let meta = Meta {
                index: i as u64 + 1,
                now_ms: 10,
            };
            effects.clear();
            let reply = m.apply(meta, command.clone(), &mut effects);
            let r = Record {
                queue: 4,
                meta,
                command,
                effects: effects_digest(&reply, &effects),
                state: Some(m.digest()),
            };
            encode(&r, &mut out);
            records.push(r);
        }
        (out, records)
    }

    #[test]
    fn down_enqueuers_and_get_holders_round_trip_and_replay() {
        let enqueuer = EnqueuerId(crate::qualify(2, 1).unwrap());
        let enqueue = |seq| Command::EnqueueFrom {
            enqueuer,
            seq,
            message: message(b"m"),
            meta: MsgMeta {
                size: 1,
                ..MsgMeta::default()
            },
        };
        let (bytes, records) = record_all(vec![
            enqueue(1),
            enqueue(1),
            enqueue(2),
            Command::GetBy {
                no_ack: false,
                node: 2,
            },
            Command::Get { no_ack: false },
            Command::Down { node: 2 },
            enqueue(3),
            Command::Unregister { enqueuer },
        ]);
        let (decoded, truncated) = decode_all(bytes.clone().freeze()).unwrap();
        assert!(!truncated);
        assert_eq!(decoded, records);
        let (summary, machines) = replay_records(decoded, false).unwrap();
        assert_eq!((summary.records, summary.state_checks), (8, 8));
        let m = &machines[&4];
        assert_eq!(
            (m.next_msg_id(), m.ready_count(), m.in_flight_count()),
            (3, 2, 1)
        );
        assert_eq!(m.enqueuer_count(), 0);
        // The Down's reply and effects are a Touch's (`Ok`, none): only its state tells them
        // apart, and the replay does.
        let (mut changed, _) = decode_all(bytes.freeze()).unwrap();
        changed[5].command = Command::Touch;
        assert!(matches!(
            replay_records(changed, false),
            Err(ReplayError::Diverged {
                index: 6,
                what: "state",
                ..
            })
        ));
    }

    #[test]
    fn down_enqueuers_and_get_holders_are_entries_of_logical_facts() {
        let enqueuer = EnqueuerId(crate::qualify(1, 3).unwrap());
        let from = |message, meta| Command::EnqueueFrom {
            enqueuer,
            seq: 4,
            message,
            meta,
        };
        let plain = from(message(b"m"), MsgMeta::default());
        let local = from(
            Message {
                store_key: Some(9),
                away: None,
                ..message(b"m")
            },
            MsgMeta {
                pageable: true,
                spilled: true,
                ..MsgMeta::default()
            },
        );
        let entry = |c: &Command<Message>| {
            let mut out = BytesMut::new();
            encode_entry(c, &mut out).unwrap();
            out.freeze()
        };
        assert_eq!(entry(&local), entry(&plain));
        for c in [
            plain,
            Command::Unregister { enqueuer },
            Command::Down { node: 1 },
            Command::GetBy {
                no_ack: true,
                node: 2,
            },
        ] {
            assert_eq!(decode_entry(entry(&c)), Ok(c));
        }
    }

    #[test]
    fn a_held_publish_is_an_entry_of_logical_facts_and_round_trips() {
        let enqueuer = EnqueuerId(crate::qualify(2, 8).unwrap());
        let window = DedupWindow {
            key: DedupKey {
                len: u8::MAX,
                bytes: [7; 32],
            },
            ttl_ms: 300_000,
            max_keys: 1_000,
        };
        let at = |from, message, meta| Command::EnqueueWith {
            delay_ms: 12_345,
            from,
            dedup: Some(Box::new(window)),
            message,
            meta,
        };
        let entry = |c: &Command<Message>| {
            let mut out = BytesMut::new();
            encode_entry(c, &mut out).unwrap();
            out.freeze()
        };
        let local = at(
            Some((enqueuer, 7)),
            Message {
                store_key: Some(3),
                ..message(b"h")
            },
            MsgMeta {
                pageable: true,
                ..MsgMeta::default()
            },
        );
        let plain = at(Some((enqueuer, 7)), message(b"h"), MsgMeta::default());
        assert_eq!(entry(&local), entry(&plain));
        let bare = Command::EnqueueWith {
            delay_ms: 0,
            from: None,
            dedup: None,
            message: message(b"j"),
            meta: MsgMeta::default(),
        };
        for c in [plain, at(None, message(b"i"), MsgMeta::default()), bare] {
            assert_eq!(decode_entry(entry(&c)), Ok(c));
        }
        // Parts it does not know, or a key longer than 32 bytes not said to be a digest, are
        // refused, not guessed at.
        let reseal = |mut bad: Vec<u8>| {
            let crc = crc32fast::hash(&bad[5..]);
            bad[1..5].copy_from_slice(&crc.to_be_bytes());
            Bytes::from(bad)
        };
        let good = entry(&at(None, message(b"i"), MsgMeta::default())).to_vec();
        let parts = 5 + 1 + 8;
        let mut bad = good.clone();
        bad[parts] = 4;
        assert!(decode_entry(reseal(bad)).is_err());
        let mut bad = good;
        bad[parts + 1] = 33;
        assert!(decode_entry(reseal(bad)).is_err());
    }

    #[test]
    fn a_resend_replays_as_a_duplicate() {
        let enqueuer = EnqueuerId(9);
        let c = Command::EnqueueFrom {
            enqueuer,
            seq: 1,
            message: message(b"x"),
            meta: MsgMeta::default(),
        };
        let (bytes, _) = record_all(vec![c.clone(), c]);
        let (records, _) = decode_all(bytes.freeze()).unwrap();
        let mut m = QueueMachine::new();
        let replies: Vec<Reply> = records
            .into_iter()
            .map(|r| m.apply(r.meta, r.command, &mut Vec::new()))
            .collect();
        assert_eq!(
            replies,
            vec![Reply::Enqueued { msg_id: 0 }, Reply::Duplicate]
        );
    }

    #[test]
    fn a_policy_that_delivers_on_apply_round_trips() {
        for deliver_on_apply in [false, true] {
            for single_active in [false, true] {
                let command = Command::Configure(Policy {
                    deliver_on_apply,
                    single_active,
                    ..Policy::default()
                });
                let mut out = BytesMut::new();
                encode_entry(&command, &mut out).unwrap();
                assert_eq!(decode_entry(out.freeze()), Ok(command));
            }
        }
    }
}
