//! A queue machine's whole state as bytes and back: what a Raft snapshot carries, so that a
//! replicated queue's log can be compacted and a follower far behind catches up from it.
//!
//! Layout: the format version ([`SNAPSHOT_VERSION`], one byte: 4 while dead-lettered messages
//! are held, which then end the state after version 3's fields; 3 while publishes are held
//! until due, which then end the state after the handoff; 2 while a TTL-0 handoff is
//! pending, whose time then ends the state; 1 otherwise), a CRC-32 (big-endian) of everything
//! after it, then the state field by field, in the order [`QueueMachine::snapshot`] writes it. Messages, message metadata, policies and consumer specs use the command log's
//! encodings (`log.rs`). Every collection is a `u32` count followed by its items in the
//! machine's own order, so the same machine always gives the same bytes and a restored one
//! snapshots to the bytes it came from.
//!
//! Reading never panics and never allocates more than the input can justify: every length and
//! count is checked against the bytes left before anything is allocated from it, keys must come
//! strictly in order (a duplicate would lose an entry and break the counters), and bytes left
//! after the state are an error. It does not check the state against itself (counters against
//! contents, ids against the next id): a snapshot comes from a member of the queue's group, and
//! its checksum stands against damage, not against a hostile peer, as with the log's entries.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use bytes::{Buf, BufMut, Bytes, BytesMut};

use super::{
    Consumer, ConsumerId, Credit, CreditGroup, Dead, DeadLetterReason, DedupKey, Enqueuer,
    EnqueuerId, Entry, GroupKey, Holder, InFlight, QueueMachine, Service, Slot, Timers,
};
use crate::log::{
    put_consumer_spec, put_group, put_message, put_msg_meta, put_opt_u64, put_policy, LogError,
    Reader,
};
use crate::Message;

/// How a deep queue's snapshot is decoded on a node that keeps contents out of memory
/// ([`QueueMachine::restore_snapshot_away`]): the ready line past its first `keep` messages has
/// its contents written to `store` as it is read, `BATCH` messages at a time, and is packed
/// ([`QueueMachine::pack_line`]), so that the line is never whole in memory. Decoded whole, a
/// snapshot of 2.3 million messages took 1.1 GB of the heap before a pass sent them away.
pub struct Restoring {
    pub keep: usize,
    pub store: crate::AwayStoreHandle,
    /// Why the contents could not be written, if they could not: from then on the rest of
    /// the line is kept whole, as without a store.
    pub error: Option<String>,
}

impl Restoring {
    /// Messages whose contents are written in one call.
    const BATCH: usize = 4096;
    /// Packed runs at the line's head that stay in memory (the rest are spilled).
    pub const KEEP_RUNS: usize = 2;
}

/// The part of a decoded ready line past its head, packed ([`SnapReader::ready_packing`]).
#[derive(Default)]
struct PackedTail {
    slots: VecDeque<Slot<Message>>,
    count: u64,
    runs: usize,
    /// The first id it holds.
    first: u64,
}

/// The version of the snapshot encoding. 1: the first. 2: the machine's handoff time after
/// the expiry caps (a version 1 snapshot, which has none, is still read). 3: then the
/// publishes held until due (`Command::EnqueueWith`) and the deduplication window, the handoff
/// written as an option. 4: then the dead-lettered messages held until their dead letters are
/// safe (`Policy::hold_dead_letters`).
/// Each is written only when its state needs it, so that members of earlier versions read
/// what a leader of this one sends them until then.
pub const SNAPSHOT_VERSION: u8 = 4;

/// The bytes a snapshot starts with: its format version and the checksum of the rest.
pub const SNAPSHOT_PREFIX: usize = 5;
const PREFIX: usize = SNAPSHOT_PREFIX;

/// The fewest bytes an encoded entry takes (id, the message's four lengths and two flags, the
/// meta's size, three options and two bytes, the delivery count and flags): what a count is
/// checked against before anything is allocated for it.
const MIN_ENTRY_BYTES: usize = 8 + (1 + 1 + 4 + 4 + 1 + 1) + (8 + 1 + 1 + 1 + 1) + 4 + 1;

/// Why a machine could not be written as a snapshot, or bytes not read back as one.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SnapshotError {
    /// Part of the ready line is paged out to this node's disk (a classic queue with a store):
    /// those messages are not in memory and would mean nothing on another node. A replicated
    /// queue never pages.
    #[error(
        "{runs} paged runs are on this node's disk only: a machine that pages has no snapshot"
    )]
    Paged { runs: usize },
    /// More items than a count of the format holds (2^32: far beyond any queue in memory).
    #[error("{items} items are more than a snapshot holds")]
    TooLarge { items: usize },
    #[error("snapshot format version {found}, this build reads versions 1 to {SNAPSHOT_VERSION}")]
    UnknownVersion { found: u8 },
    #[error("snapshot checksum mismatch")]
    Checksum,
    #[error("snapshot malformed: {0}")]
    Malformed(String),
    /// A message whose contents left memory could not be read back to be written.
    #[error(transparent)]
    Away(#[from] crate::AwayError),
    /// What a streamed snapshot was written to refused a chunk ([`QueueMachine::snapshot_to`]).
    #[error("cannot write the snapshot: {0}")]
    Write(String),
}

impl From<LogError> for SnapshotError {
    fn from(e: LogError) -> Self {
        let LogError::Malformed { what, .. } = e;
        SnapshotError::Malformed(what)
    }
}

/// What a snapshot is written into: a buffer that holds it whole ([`QueueMachine::snapshot`]),
/// or one handed on chunk by chunk ([`QueueMachine::snapshot_to`]), so that a deep queue's
/// snapshot never sits in memory whole. The writers below call [`SnapOut::spill`] after each
/// item that can repeat per message.
struct SnapOut<'a> {
    buf: &'a mut BytesMut,
    stream: Option<Stream<'a>>,
}

struct Stream<'a> {
    sink: &'a mut dyn FnMut(&[u8]) -> Result<(), String>,
    chunk: usize,
    /// Of every byte handed to `sink`.
    crc: crc32fast::Hasher,
}

impl SnapOut<'_> {
    fn spill(&mut self) -> Result<(), SnapshotError> {
        match &mut self.stream {
            Some(s) if self.buf.len() >= s.chunk => {
                s.crc.update(self.buf);
                (s.sink)(self.buf).map_err(SnapshotError::Write)?;
                self.buf.clear();
                Ok(())
            }
            _ => Ok(()),
        }
    }
}

impl std::ops::Deref for SnapOut<'_> {
    type Target = BytesMut;
    fn deref(&self) -> &BytesMut {
        self.buf
    }
}

impl std::ops::DerefMut for SnapOut<'_> {
    fn deref_mut(&mut self) -> &mut BytesMut {
        self.buf
    }
}

fn put_len(out: &mut BytesMut, n: usize) {
    // `snapshot` refused a machine with a collection this large: never cut.
    out.put_u32(u32::try_from(n).unwrap_or(u32::MAX));
}

fn put_entry(out: &mut SnapOut, e: &Entry<Message>) -> Result<(), SnapshotError> {
    out.put_u64(e.id);
    // A message whose contents left this member's memory is written whole: a snapshot is
    // read on other nodes, and restored without any of them away.
    put_message(out, &*e.msg.loaded()?);
    put_msg_meta(out, &e.meta);
    out.put_u32(e.delivery_count);
    out.put_u8(u8::from(e.maybe_delivered) | u8::from(e.timed_out) << 1);
    out.spill()
}

/// A dead-letter reason as one byte.
fn reason_byte(reason: DeadLetterReason) -> u8 {
    match reason {
        DeadLetterReason::Rejected => 0,
        DeadLetterReason::Expired => 1,
        DeadLetterReason::MaxLen => 2,
        DeadLetterReason::DeliveryLimit => 3,
    }
}

/// A deduplication key's length and its 32 bytes.
const DEDUP_KEY_BYTES: usize = 33;

fn put_dedup_key(out: &mut BytesMut, key: &DedupKey) {
    out.put_u8(key.len);
    out.put_slice(&key.bytes);
}

fn put_pairs(
    out: &mut SnapOut,
    n: usize,
    pairs: impl Iterator<Item = (u64, u64)>,
) -> Result<(), SnapshotError> {
    put_len(out, n);
    let mut written = 0;
    for (a, b) in pairs {
        out.put_u64(a);
        out.put_u64(b);
        out.spill()?;
        written += 1;
    }
    // Folded expiries are read back from their runs as they are written: a count that does
    // not match would make the snapshot unreadable, so it is not written.
    if written != n {
        return Err(SnapshotError::Write(format!(
            "{written} expiries written of {n} counted"
        )));
    }
    Ok(())
}

fn put_opt_consumer(out: &mut BytesMut, c: Option<ConsumerId>) {
    put_opt_u64(out, c.map(|c| c.0));
}

impl QueueMachine<Message> {
    /// Appends the machine's whole state to `out` (see the module's documentation for the
    /// layout). Refused for a machine with paged runs ([`SnapshotError::Paged`]); `out` is left
    /// as it was then. A Raft snapshot's data is the frozen buffer, and the machine comes back
    /// from it with [`Self::restore_snapshot`]:
    ///
    /// ```
    /// use bytes::BytesMut;
    /// use warren_queue::machine::{QueueMachine, SnapshotError};
    /// use warren_queue::Message;
    ///
    /// let m = QueueMachine::<Message>::new();
    /// let mut out = BytesMut::new();
    /// m.snapshot(&mut out)?;
    /// let back = QueueMachine::restore_snapshot(out.freeze())?;
    /// assert_eq!(back.digest(), m.digest());
    /// # Ok::<(), SnapshotError>(())
    /// ```
    pub fn snapshot(&self, out: &mut BytesMut) -> Result<(), SnapshotError> {
        let start = out.len();
        self.check_snapshot()?;
        out.reserve(self.snapshot_reserve());
        out.put_bytes(0, PREFIX);
        let mut body = SnapOut {
            buf: out,
            stream: None,
        };
        match self.write_snapshot(&mut body) {
            Ok(version) => {
                let crc = crc32fast::hash(&out[start + PREFIX..]);
                out[start] = version;
                out[start + 1..start + PREFIX].copy_from_slice(&crc.to_be_bytes());
                Ok(())
            }
            Err(e) => {
                // A message's contents that could not be read back stop it half way.
                out.truncate(start);
                Err(e)
            }
        }
    }

    /// [`Self::snapshot`]'s bytes handed to `sink` in chunks of about `chunk` bytes, except the
    /// first [`SNAPSHOT_PREFIX`] (the version and the checksum of the rest, known only at the
    /// end), which it returns: the snapshot is those followed by what `sink` took. A deep
    /// queue's snapshot is written to its file this way without ever being whole in memory.
    /// An error from `sink` ends it ([`SnapshotError::Write`]).
    pub fn snapshot_to(
        &self,
        chunk: usize,
        sink: &mut dyn FnMut(&[u8]) -> Result<(), String>,
    ) -> Result<[u8; SNAPSHOT_PREFIX], SnapshotError> {
        self.check_snapshot()?;
        let chunk = chunk.max(1);
        let mut buf = BytesMut::with_capacity(chunk.saturating_add(chunk / 4));
        let mut out = SnapOut {
            buf: &mut buf,
            stream: Some(Stream {
                sink,
                chunk,
                crc: crc32fast::Hasher::new(),
            }),
        };
        let version = self.write_snapshot(&mut out)?;
        let SnapOut {
            buf: rest,
            stream: Some(mut s),
        } = out
        else {
            return Err(SnapshotError::Write("no stream".to_owned()));
        };
        if !rest.is_empty() {
            s.crc.update(rest);
            (s.sink)(rest).map_err(SnapshotError::Write)?;
        }
        let mut prefix = [0; SNAPSHOT_PREFIX];
        prefix[0] = version;
        prefix[1..].copy_from_slice(&s.crc.finalize().to_be_bytes());
        Ok(prefix)
    }

    /// Refuses a machine that cannot be written as a snapshot, before anything is written.
    fn check_snapshot(&self) -> Result<(), SnapshotError> {
        let runs = self.runs().count();
        if runs > 0 {
            return Err(SnapshotError::Paged { runs });
        }
        let entries = self.ready_count() + self.in_flight.len();
        // Every collection holds at most this many (timers and deadlines are per message).
        let items = entries
            .saturating_add(self.consumers.len())
            .saturating_add(self.service.levels.len())
            .saturating_add(self.credit.len())
            .saturating_add(self.enqueuers.len())
            .saturating_add(self.expiry_caps.len())
            .saturating_add(self.held.len())
            .saturating_add(self.dedup_order.len());
        if u32::try_from(items).is_err() {
            return Err(SnapshotError::TooLarge { items });
        }
        Ok(())
    }

    /// About what a snapshot takes, so that a buffer grows once instead of doubling over a
    /// deep queue's bodies.
    fn snapshot_reserve(&self) -> usize {
        let payload: usize = self
            .messages()
            .map(|(_, m, _)| m.contents_len())
            .chain(self.held_messages().map(Message::contents_len))
            .sum();
        let entries = self.ready_count() + self.in_flight.len() + self.held.len();
        payload.saturating_add(entries.saturating_mul(MIN_ENTRY_BYTES + 16))
    }

    /// Writes the state after the prefix (the version and the checksum) into `out`; returns
    /// the version the prefix must name.
    fn write_snapshot(&self, out: &mut SnapOut) -> Result<u8, SnapshotError> {
        // Every field by name, none with `..`: a field added to the machine does not compile
        // until it is written below (or said to be derived) and read back in `machine`.
        let QueueMachine {
            next_id: _,
            ready: _,
            tail: _,
            tail_count: _,  // derived: the tail holds messages only
            tail_runs: _,   // derived: none
            tail_packed: _, // node-local: packed messages are written as their entries
            pack_seen: _,
            spill_seen: _,
            paged_below: _,
            paged_out_total: _,
            loaded_total: _,
            returned: _,
            by_priority: _,
            in_flight: _,
            consumers: _,
            service: _,
            policy: _,
            active: _,
            last_used: _,
            credit: _,
            exclusive_consumer: _,
            has_had_consumers: _,
            visibility: _,
            ack_deadlines: _,
            timers: _,
            retrying: _,
            retry_due: _,
            retrying_bytes: _,
            held: _,
            held_seq: _,
            held_bytes: _, // derived: the held messages' sizes
            dedup: _,
            dedup_order: _,
            dedup_next: _,
            dead: _,
            expiries: _,
            expiries_in_order: _,
            ready_bytes: _,
            in_flight_bytes: _,
            group_locks: _,
            parked: _,
            parked_count: _, // derived: the parked lines' lengths
            line_groups: _,  // derived: the census of the line
            line_ungrouped: _,
            line_unknown: _,
            open_groups: _,
            enqueuers: _,
            expiry_caps: _,
            handoff: _,
            last_index: _,
            now_ms: _,
        } = self;
        // Version 1 while there is no handoff (nearly always): a member of an earlier version,
        // during a rolling upgrade, still reads what a leader of this one sends it.
        let version = if !self.dead.is_empty() {
            4
        } else if !self.held.is_empty() || !self.dedup.is_empty() {
            3
        } else if self.handoff.is_some() {
            2
        } else {
            1
        };
        for n in [
            self.last_index,
            self.now_ms,
            self.next_id,
            self.last_used,
            self.ready_bytes,
            self.in_flight_bytes,
            self.retrying_bytes,
            self.paged_below,
            self.paged_out_total,
            self.loaded_total,
        ] {
            out.put_u64(n);
        }
        put_policy(out, &self.policy);
        put_opt_consumer(out, self.active);
        put_opt_consumer(out, self.exclusive_consumer);
        out.put_u8(u8::from(self.has_had_consumers));

        // The whole line as the head, the tail's messages after `ready`'s (runs on disk were
        // refused above; packed ones are written whole): where a member's line splits is its
        // own, and a member of an earlier version reads a snapshot whose line is all in its
        // head, as its own were (its passes send away only the head's messages).
        put_len(out, self.ready.len() + self.tail_len());
        for e in &self.ready {
            put_entry(out, e)?;
        }
        for e in self.tail_entries() {
            put_entry(out, &e)?;
        }
        put_len(out, 0);
        put_len(out, self.returned.len());
        for e in self.returned.values() {
            put_entry(out, e)?;
        }
        put_len(out, self.by_priority.len());
        for ((level, _), e) in &self.by_priority {
            out.put_u8(*level);
            put_entry(out, e)?;
        }
        put_len(out, self.retrying.len());
        for (at, e) in self.retrying.values() {
            out.put_u64(*at);
            put_entry(out, e)?;
        }
        put_pairs(out, self.retry_due.len(), self.retry_due.iter().copied())?;
        put_len(out, self.parked.len());
        for (g, line) in &self.parked {
            out.put_u64(g.get());
            put_len(out, line.len());
            for e in line.values() {
                put_entry(out, e)?;
            }
        }
        put_len(out, self.group_locks.len());
        for (g, id) in &self.group_locks {
            out.put_u64(g.get());
            out.put_u64(*id);
        }

        put_len(out, self.in_flight.len());
        for f in self.in_flight.values() {
            match f.holder {
                Holder::Consumer(c) => {
                    out.put_u8(0);
                    out.put_u64(c.0);
                }
                Holder::Get(node) => {
                    out.put_u8(1);
                    out.put_u16(node);
                }
            }
            put_entry(out, &f.entry)?;
        }
        put_len(out, self.timers.len());
        for (id, t) in &self.timers {
            out.put_u64(*id);
            match t.group {
                Some(g) => {
                    out.put_u8(1);
                    put_group(out, g);
                }
                None => out.put_u8(0),
            }
            put_opt_u64(out, t.deadline);
            put_opt_u64(out, t.ack_deadline);
            out.spill()?;
        }
        put_pairs(out, self.visibility.len(), self.visibility.iter().copied())?;
        put_pairs(
            out,
            self.ack_deadlines.len(),
            self.ack_deadlines.iter().copied(),
        )?;

        put_len(out, self.consumers.len());
        for (id, c) in &self.consumers {
            out.put_u64(id.0);
            put_consumer_spec(out, &c.spec);
            out.put_u32(c.held);
            out.put_u8(u8::from(c.in_service));
            put_opt_u64(out, c.visibility_ms);
            put_opt_u64(out, c.ack_timeout_ms);
        }
        put_len(out, self.service.levels.len());
        for (priority, line) in &self.service.levels {
            out.put_i64(*priority);
            put_len(out, line.len());
            for id in line {
                out.put_u64(id.0);
            }
        }
        put_len(out, self.credit.len());
        for (g, c) in &self.credit {
            put_group(out, *g);
            out.put_u8(u8::from(c.blocked));
            put_opt_u64(out, c.limit.map(u64::from));
        }

        put_pairs(out, self.expiries.len(), self.expiries.iter().copied())?;
        // Folded pairs read back from their runs: a snapshot holds every pair, as a node that
        // folded none would write it.
        put_pairs(out, self.expiries_in_order.len(), self.in_order_pairs())?;
        put_len(out, self.enqueuers.len());
        for (id, e) in &self.enqueuers {
            out.put_u64(id.0);
            out.put_u64(e.seq);
            put_opt_u64(out, e.refused);
        }
        put_pairs(
            out,
            self.expiry_caps.len(),
            self.expiry_caps.iter().copied(),
        )?;
        match version {
            1 => {}
            2 => put_opt_u64(out, self.handoff),
            _ => {
                put_opt_u64(out, self.handoff);
                out.put_u64(self.held_seq);
                put_len(out, self.held.len());
                for ((due, seq), (message, meta)) in &self.held {
                    out.put_u64(*due);
                    out.put_u64(*seq);
                    put_message(out, &*message.loaded()?);
                    put_msg_meta(out, meta);
                    out.spill()?;
                }
                out.put_u64(self.dedup_next);
                put_len(out, self.dedup_order.len());
                for (key, number) in &self.dedup_order {
                    put_dedup_key(out, key);
                    out.put_u64(*number);
                    out.spill()?;
                }
                put_len(out, self.dedup.len());
                for (key, (until, number)) in &self.dedup {
                    put_dedup_key(out, key);
                    out.put_u64(*until);
                    out.put_u64(*number);
                    out.spill()?;
                }
                if version >= 4 {
                    put_len(out, self.dead.len());
                    for (id, d) in &self.dead {
                        out.put_u64(*id);
                        put_message(out, &*d.message.loaded()?);
                        out.put_u32(d.delivery_count);
                        out.put_u8(reason_byte(d.reason));
                        out.spill()?;
                    }
                }
            }
        }

        Ok(version)
    }

    /// The machine a [`Self::snapshot`] wrote. Message strings, properties and bodies are
    /// slices of `bytes` (no copies): the buffer lives as long as any of them.
    pub fn restore_snapshot(bytes: Bytes) -> Result<QueueMachine<Message>, SnapshotError> {
        Self::restore_snapshot_away(bytes, None)
    }

    /// [`Self::restore_snapshot`], with a deep queue's ready line sent to `away`'s store and
    /// packed as it is read (node-local, like [`Self::pack_line`]: the machine is the same
    /// state, its digest included). A queue with priorities or pages is decoded as it is.
    pub fn restore_snapshot_away(
        bytes: Bytes,
        away: Option<&mut Restoring>,
    ) -> Result<QueueMachine<Message>, SnapshotError> {
        let found = *bytes.first().ok_or(SnapshotError::Malformed(
            "empty: no format version".to_owned(),
        ))?;
        if !(1..=SNAPSHOT_VERSION).contains(&found) {
            return Err(SnapshotError::UnknownVersion { found });
        }
        let (Some(head), Some(body)) = (bytes.get(1..5), bytes.get(5..)) else {
            return Err(SnapshotError::Malformed("checksum cut short".to_owned()));
        };
        let crc = <[u8; 4]>::try_from(head)
            .map(u32::from_be_bytes)
            .map_err(|_| SnapshotError::Malformed("checksum cut short".to_owned()))?;
        if crc32fast::hash(body) != crc {
            return Err(SnapshotError::Checksum);
        }
        let mut r = SnapReader(Reader::new(bytes.slice(5..)));
        let m = r.machine(found, away)?;
        if r.0.buf.has_remaining() {
            return Err(r.fail(format!("{} bytes after the state", r.0.buf.remaining())));
        }
        Ok(m)
    }
}

/// The command log's reader, with what only a snapshot holds.
struct SnapReader(Reader);

impl SnapReader {
    fn fail(&self, what: impl Into<String>) -> SnapshotError {
        SnapshotError::Malformed(what.into())
    }

    /// A count of items that take at least `min` bytes each: more than the bytes left can
    /// hold is an error, so what it sizes is bounded by the input.
    fn count(&mut self, min: usize, what: &str) -> Result<usize, SnapshotError> {
        let n = self.0.u32(what)? as usize;
        if n.saturating_mul(min) > self.0.buf.remaining() {
            return Err(self.fail(format!("{what}: {n} do not fit the bytes left")));
        }
        Ok(n)
    }

    fn u64(&mut self, what: &str) -> Result<u64, SnapshotError> {
        Ok(self.0.u64(what)?)
    }

    fn flag(&mut self, what: &str) -> Result<bool, SnapshotError> {
        match self.0.u8(what)? {
            0 => Ok(false),
            1 => Ok(true),
            t => Err(self.fail(format!("{what}: bad flag {t}"))),
        }
    }

    fn opt_consumer(&mut self, what: &str) -> Result<Option<ConsumerId>, SnapshotError> {
        Ok(self.0.opt_u64(what)?.map(ConsumerId))
    }

    fn opt_u32(&mut self, what: &str) -> Result<Option<u32>, SnapshotError> {
        match self.0.opt_u64(what)? {
            Some(n) => u32::try_from(n)
                .map(Some)
                .map_err(|_| self.fail(format!("{what}: {n} over u32"))),
            None => Ok(None),
        }
    }

    fn group_key(&mut self, what: &str) -> Result<GroupKey, SnapshotError> {
        let g = self.u64(what)?;
        GroupKey::new(g).ok_or_else(|| self.fail(format!("{what}: zero")))
    }

    fn dedup_key(&mut self) -> Result<DedupKey, SnapshotError> {
        let len = self.0.u8("deduplication key length")?;
        if len > 32 && len != u8::MAX {
            return Err(self.fail(format!("deduplication key length {len}")));
        }
        let mut bytes = [0u8; 32];
        for b in &mut bytes {
            *b = self.0.u8("deduplication key")?;
        }
        Ok(DedupKey { len, bytes })
    }

    fn entry(&mut self) -> Result<Entry<Message>, SnapshotError> {
        let id = self.u64("message id")?;
        let msg = self.0.message()?;
        let meta = self.0.msg_meta()?;
        let delivery_count = self.0.u32("delivery count")?;
        let flags = self.0.u8("entry flags")?;
        if flags > 3 {
            return Err(self.fail(format!("entry flags {flags:#x}")));
        }
        Ok(Entry {
            id,
            msg,
            meta,
            delivery_count,
            maybe_delivered: flags & 1 != 0,
            timed_out: flags & 2 != 0,
        })
    }

    fn entries(&mut self, what: &str) -> Result<VecDeque<Entry<Message>>, SnapshotError> {
        let n = self.count(MIN_ENTRY_BYTES, what)?;
        let mut out = VecDeque::with_capacity(n);
        for _ in 0..n {
            out.push_back(self.entry()?);
        }
        Ok(out)
    }

    /// `n` items read by `item`, whose keys must rise strictly: the map they make.
    fn map<K: Ord + Copy, V>(
        &mut self,
        n: usize,
        what: &str,
        mut item: impl FnMut(&mut Self) -> Result<(K, V), SnapshotError>,
    ) -> Result<BTreeMap<K, V>, SnapshotError> {
        let mut items: Vec<(K, V)> = Vec::with_capacity(n);
        for _ in 0..n {
            let (k, v) = item(self)?;
            if items.last().is_some_and(|(last, _)| *last >= k) {
                return Err(self.fail(format!("{what}: keys out of order")));
            }
            items.push((k, v));
        }
        // Sorted already: the map is built in one pass.
        Ok(items.into_iter().collect())
    }

    fn entry_map(&mut self, what: &str) -> Result<BTreeMap<u64, Entry<Message>>, SnapshotError> {
        let n = self.count(MIN_ENTRY_BYTES, what)?;
        self.map(n, what, |r| {
            let e = r.entry()?;
            Ok((e.id, e))
        })
    }

    fn pair_list(&mut self, what: &str) -> Result<Vec<(u64, u64)>, SnapshotError> {
        let n = self.count(16, what)?;
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            out.push((self.u64(what)?, self.u64(what)?));
        }
        Ok(out)
    }

    /// The in-order expiries, the pairs of the line's spilled runs folded as they come (a deep
    /// TTL queue's were all in memory until the machine was built).
    fn in_order(
        &mut self,
        packed: Option<&PackedTail>,
    ) -> Result<super::in_order::InOrder, SnapshotError> {
        let spilled: Vec<(u64, u64, usize)> = packed
            .into_iter()
            .flat_map(|p| p.slots.iter())
            .filter_map(|s| match s {
                Slot::Spilled(r) => Some((r.first, r.last, r.expiring)),
                _ => None,
            })
            .collect();
        let mut runs = spilled.into_iter().peekable();
        let what = "expiries in order";
        let n = self.count(16, what)?;
        let mut out = super::in_order::InOrder::default();
        for _ in 0..n {
            let pair = (self.u64(what)?, self.u64(what)?);
            while let Some((first, last, expiring)) = runs.next_if(|r| r.1 < pair.1) {
                out.fold(first, last, expiring);
            }
            out.push_back(pair);
        }
        for (first, last, expiring) in runs {
            out.fold(first, last, expiring);
        }
        Ok(out)
    }

    fn pair_set(&mut self, what: &str) -> Result<BTreeSet<(u64, u64)>, SnapshotError> {
        let pairs = self.pair_list(what)?;
        let mut last = None;
        for p in &pairs {
            if last.is_some_and(|l| l >= p) {
                return Err(self.fail(format!("{what}: out of order")));
            }
            last = Some(p);
        }
        // Sorted already: the set is built in one pass.
        Ok(pairs.into_iter().collect())
    }

    /// The ready line with what follows its first `away.keep` messages sent away and packed,
    /// `Restoring::BATCH` at a time: its head, and the rest (`None` if nothing packed: then
    /// the whole line is the head, as [`Self::entries`] reads it).
    fn ready_packing(
        &mut self,
        away: &mut Restoring,
    ) -> Result<(VecDeque<Entry<Message>>, Option<PackedTail>), SnapshotError> {
        let n = self.count(MIN_ENTRY_BYTES, "ready")?;
        let mut ready = VecDeque::with_capacity(n.min(away.keep));
        let mut tail = PackedTail::default();
        // Packs as the machine's own `pack_line` does (runs, and lone messages left whole).
        let mut packer = QueueMachine::<Message>::new();
        let mut batch = Vec::with_capacity(Restoring::BATCH.min(n));
        // Full runs past the first `Restoring::KEEP_RUNS` are written out of memory as they
        // are made, as the broker's passes would ([`QueueMachine::spill_line`]), so that the
        // packed line is never whole in memory either; until the store refuses one.
        let mut spill_from = Some(0);
        for i in 0..n {
            let e = self.entry()?;
            if i < away.keep {
                ready.push_back(e);
                continue;
            }
            if tail.count == 0 && batch.is_empty() {
                tail.first = e.id;
            }
            batch.push(e);
            if batch.len() == Restoring::BATCH || i + 1 == n {
                send_away(&mut batch, away);
                tail.count += batch.len() as u64;
                packer.pack_into(&mut tail.slots, batch.drain(..), u64::MAX);
                spill_from = spill_from.and_then(|from| spill_made(&mut tail.slots, from));
            }
        }
        tail.runs = packer.tail_packed;
        if tail.runs == 0 {
            // Nothing packed (every message has an expiry, or the store failed): the line
            // stays whole, as `pack_line` leaves it.
            for slot in tail.slots {
                if let Slot::Msg(e) = slot {
                    ready.push_back(e);
                }
            }
            return Ok((ready, None));
        }
        Ok((ready, Some(tail)))
    }
}

/// Writes the full runs of a line being decoded out of memory, from slot `from` on, past the
/// first [`Restoring::KEEP_RUNS`] and before the last (which may still grow); where to go on
/// from next time, `None` once the store refuses.
fn spill_made(slots: &mut VecDeque<Slot<Message>>, from: usize) -> Option<usize> {
    let mut runs = slots
        .iter()
        .take(from)
        .filter(|s| s.is_run_of_packed())
        .count();
    let last = slots.len().saturating_sub(1);
    for i in from..last {
        let slot = slots.get_mut(i)?;
        if !slot.is_run_of_packed() {
            continue;
        }
        runs += 1;
        if runs > Restoring::KEEP_RUNS {
            QueueMachine::spill_slot(slot, super::PACKED_RUN)?;
        }
    }
    Some(last.max(from))
}

impl SnapReader {
    fn machine(
        &mut self,
        version: u8,
        away: Option<&mut Restoring>,
    ) -> Result<QueueMachine<Message>, SnapshotError> {
        let last_index = self.u64("last index")?;
        let now_ms = self.u64("time")?;
        let next_id = self.u64("next id")?;
        let last_used = self.u64("last used")?;
        let ready_bytes = self.u64("ready bytes")?;
        let in_flight_bytes = self.u64("in-flight bytes")?;
        let retrying_bytes = self.u64("retrying bytes")?;
        let paged_below = self.u64("paged below")?;
        let paged_out_total = self.u64("paged out")?;
        let loaded_total = self.u64("loaded")?;
        let policy = self.0.policy()?;
        let active = self.opt_consumer("active consumer")?;
        let exclusive_consumer = self.opt_consumer("exclusive consumer")?;
        let has_had_consumers = self.flag("had consumers")?;

        // A queue that pages or has priorities is never packed (`pack_line`).
        let packs = policy.max_priority.is_none() && paged_below == 0 && paged_out_total == 0;
        let (ready, packed) = match away {
            Some(away) if packs => self.ready_packing(away)?,
            _ => (self.entries("ready")?, None),
        };
        let tail = self.entries("tail")?;
        let returned = self.entry_map("returned")?;
        let n = self.count(1 + MIN_ENTRY_BYTES, "by priority")?;
        let by_priority = self.map(n, "by priority", |r| {
            let level = r.0.u8("priority level")?;
            let e = r.entry()?;
            Ok(((level, e.id), e))
        })?;
        let n = self.count(8 + MIN_ENTRY_BYTES, "retrying")?;
        let retrying = self.map(n, "retrying", |r| {
            let at = r.u64("retry due")?;
            let e = r.entry()?;
            Ok((e.id, (at, e)))
        })?;
        let retry_due = self.pair_set("retry due")?;
        let n = self.count(12, "parked groups")?;
        let parked: BTreeMap<GroupKey, BTreeMap<u64, Entry<Message>>> =
            self.map(n, "parked groups", |r| {
                let g = r.group_key("parked group")?;
                let line = r.entry_map("parked")?;
                Ok((g, line))
            })?;
        let n = self.count(16, "group locks")?;
        let group_locks = self.map(n, "group locks", |r| {
            Ok((r.group_key("locked group")?, r.u64("lock holder")?))
        })?;

        let n = self.count(3 + MIN_ENTRY_BYTES, "in flight")?;
        let in_flight = self.map(n, "in flight", |r| {
            let holder = match r.0.u8("holder")? {
                0 => Holder::Consumer(ConsumerId(r.u64("holder")?)),
                1 => Holder::Get(r.0.u16("holder")?),
                t => return Err(r.fail(format!("holder: bad tag {t}"))),
            };
            let entry = r.entry()?;
            Ok((entry.id, InFlight { holder, entry }))
        })?;
        let n = self.count(11, "timers")?;
        let timers = self.map(n, "timers", |r| {
            let id = r.u64("timer")?;
            let group = match r.flag("timer group")? {
                true => Some(r.0.group()?),
                false => None,
            };
            let deadline = r.0.opt_u64("visibility deadline")?;
            let ack_deadline = r.0.opt_u64("ack deadline")?;
            Ok((
                id,
                Timers {
                    group,
                    deadline,
                    ack_deadline,
                },
            ))
        })?;
        let visibility = self.pair_set("visibility deadlines")?;
        let ack_deadlines = self.pair_set("ack deadlines")?;

        // A spec is at least its group, tag length, flags, prefetch, priority and table length.
        let n = self.count(8 + 10 + 1 + 1 + 4 + 8 + 4 + 4 + 1 + 2, "consumers")?;
        let consumers = self.map(n, "consumers", |r| {
            let id = ConsumerId(r.u64("consumer")?);
            let spec = r.0.consumer_spec()?;
            let held = r.0.u32("held")?;
            let in_service = r.flag("in service")?;
            let visibility_ms = r.0.opt_u64("consumer visibility timeout")?;
            let ack_timeout_ms = r.0.opt_u64("consumer timeout")?;
            Ok((
                id,
                Consumer {
                    spec,
                    held,
                    in_service,
                    visibility_ms,
                    ack_timeout_ms,
                },
            ))
        })?;
        let n = self.count(12, "service levels")?;
        let mut levels = Vec::with_capacity(n);
        for _ in 0..n {
            let priority = self.0.i64("service priority")?;
            let k = self.count(8, "service line")?;
            let mut line = VecDeque::with_capacity(k);
            for _ in 0..k {
                line.push_back(ConsumerId(self.u64("service line")?));
            }
            levels.push((priority, line));
        }
        let n = self.count(10 + 1 + 1, "credit")?;
        let credit = self.map(n, "credit", |r| {
            let g: CreditGroup = r.0.group()?;
            let blocked = r.flag("credit blocked")?;
            let limit = r.opt_u32("credit limit")?;
            Ok((g, Credit { blocked, limit }))
        })?;

        let expiries = self.pair_set("expiries")?;
        let expiries_in_order = self.in_order(packed.as_ref())?;
        let n = self.count(17, "enqueuers")?;
        let enqueuers = self.map(n, "enqueuers", |r| {
            let id = EnqueuerId(r.u64("enqueuer")?);
            let seq = r.u64("enqueuer sequence")?;
            let refused = r.0.opt_u64("enqueuer refused")?;
            Ok((id, Enqueuer { seq, refused }))
        })?;
        let expiry_caps = self.pair_list("expiry caps")?;
        let handoff = match version {
            1 => None,
            // Written only with a handoff: one without would not snapshot back to its bytes.
            2 => Some(
                self.0
                    .opt_u64("handoff")?
                    .ok_or_else(|| self.fail("a version 2 snapshot without its handoff"))?,
            ),
            _ => self.0.opt_u64("handoff")?,
        };
        let (held_seq, held, dedup_next, dedup_order, dedup) = match version {
            1 | 2 => (0, BTreeMap::new(), 0, VecDeque::new(), BTreeMap::new()),
            _ => {
                let seq = self.u64("held sequence")?;
                // Due, sequence, and at least a message's lengths and a meta's flags.
                let n = self.count(16 + MIN_ENTRY_BYTES - 13, "held")?;
                let held = self.map(n, "held", |r| {
                    let due = r.u64("held due")?;
                    let seq = r.u64("held sequence")?;
                    let message = r.0.message()?;
                    let meta = r.0.msg_meta()?;
                    Ok(((due, seq), (message, meta)))
                })?;
                let next = self.u64("deduplication number")?;
                let n = self.count(DEDUP_KEY_BYTES + 8, "deduplication order")?;
                let mut order = VecDeque::with_capacity(n);
                for _ in 0..n {
                    let key = self.dedup_key()?;
                    order.push_back((key, self.u64("deduplication number")?));
                }
                let n = self.count(DEDUP_KEY_BYTES + 16, "deduplication keys")?;
                let keys = self.map(n, "deduplication keys", |r| {
                    let key = r.dedup_key()?;
                    Ok((key, (r.u64("until")?, r.u64("deduplication number")?)))
                })?;
                // Written only with some: none would not snapshot back to its bytes.
                if version == 3 && held.is_empty() && keys.is_empty() {
                    return Err(self.fail("a version 3 snapshot without held messages or keys"));
                }
                (seq, held, next, order, keys)
            }
        };
        let dead = match version {
            1..=3 => BTreeMap::new(),
            _ => {
                // An id, a message's lengths and flags, a count and a reason.
                let n = self.count(8 + 12 + 5, "dead-lettered")?;
                let dead = self.map(n, "dead-lettered", |r| {
                    let id = r.u64("dead-lettered id")?;
                    let message = r.0.message()?;
                    let delivery_count = r.0.u32("dead-lettered count")?;
                    let reason = match r.0.u8("dead-letter reason")? {
                        0 => DeadLetterReason::Rejected,
                        1 => DeadLetterReason::Expired,
                        2 => DeadLetterReason::MaxLen,
                        3 => DeadLetterReason::DeliveryLimit,
                        t => return Err(r.fail(format!("bad dead-letter reason {t}"))),
                    };
                    let dead = Dead {
                        message,
                        delivery_count,
                        reason,
                    };
                    Ok((id, dead))
                })?;
                if dead.is_empty() {
                    return Err(self.fail("a version 4 snapshot without dead-lettered messages"));
                }
                dead
            }
        };
        let held_bytes = held.values().map(|(_, m)| m.size).sum();
        let (tail, tail_count, tail_packed, pack_seen) = match packed {
            Some(p) => {
                let count = p.count + tail.len() as u64;
                let mut slots = p.slots;
                slots.extend(tail.into_iter().map(Slot::Msg));
                // Nothing counts as looked at (`pack_seen` 0): the first `pack_line` walks the
                // tail's slots once (its runs stay as they are) and packs what the decoder
                // left whole, the head past the queue's own window (the decoder keeps the
                // largest) and what a failed write left in memory, once they are away.
                (slots, count, p.runs, 0)
            }
            None => {
                let count = tail.len() as u64;
                (tail.into_iter().map(Slot::Msg).collect(), count, 0, 0)
            }
        };
        // No `..Default::default()`: every field is read or derived here.
        let mut m = QueueMachine {
            next_id,
            tail_count,
            tail_runs: 0,
            tail_packed,
            pack_seen,
            spill_seen: 0,
            tail,
            ready,
            paged_below,
            paged_out_total,
            loaded_total,
            returned,
            by_priority,
            in_flight,
            consumers,
            service: Service { levels },
            policy,
            active,
            last_used,
            credit,
            exclusive_consumer,
            has_had_consumers,
            visibility,
            ack_deadlines,
            timers,
            retrying,
            retry_due,
            retrying_bytes,
            held,
            held_seq,
            held_bytes,
            dedup,
            dedup_order,
            dedup_next,
            dead,
            expiries,
            expiries_in_order,
            ready_bytes,
            in_flight_bytes,
            group_locks,
            parked_count: parked.values().map(BTreeMap::len).sum(),
            parked,
            line_groups: BTreeMap::new(),
            line_ungrouped: 0,
            line_unknown: 0,
            open_groups: 0,
            enqueuers,
            expiry_caps,
            handoff,
            last_index,
            now_ms,
        };
        m.recount();
        // The expiries of what left the head stay where the snapshot has them, as
        // `pack_line` leaves them: the in-order deque reaches a packed line (those of the runs
        // written out as the line was read folded, as `spill_line` folds them).
        Ok(m)
    }
}

/// Writes the contents of `batch`'s messages to `away`'s store and puts their stubs in their
/// place; after a failure, leaves them (and every later batch) whole.
fn send_away(batch: &mut [Entry<Message>], away: &mut Restoring) {
    if away.error.is_some() {
        return;
    }
    let whole: Vec<&Message> = batch
        .iter()
        .map(|e| &e.msg)
        .filter(|m| !m.is_away())
        .collect();
    if whole.len() != batch.len() {
        // A decoded message is never away; a mix cannot be matched to its keys below.
        away.error = Some("a decoded message already away".to_owned());
        return;
    }
    match away.store.put(&whole) {
        Ok(keys) if keys.len() == batch.len() => {
            for (e, key) in batch.iter_mut().zip(keys) {
                e.msg = e.msg.away_stub(key, away.store.clone());
            }
        }
        Ok(keys) => {
            away.error = Some(format!(
                "{} keys for {} messages written",
                keys.len(),
                batch.len()
            ));
        }
        Err(error) => away.error = Some(error),
    }
}

#[cfg(test)]
mod tests {
    use warren_codec::{FieldTable, FieldValue, ShortStr};

    use super::*;
    use crate::machine::{Command, ConsumerSpec, Meta, MsgMeta, Policy, Receipt, RetryPolicy};
    use crate::AwayStore;

    fn message(body: &'static [u8]) -> Message {
        Message {
            exchange: ShortStr::from_static("x"),
            routing_key: ShortStr::from_static("rk"),
            properties: Bytes::from_static(&[0x10, 0, 2]),
            body: Bytes::from_static(body),
            persistent: true,
            store_key: Some(9),
            away: None,
        }
    }

    struct Run {
        m: QueueMachine<Message>,
        now: u64,
    }

    impl Run {
        fn apply(&mut self, c: Command<Message>) {
            let meta = Meta {
                index: self.m.last_index() + 1,
                now_ms: self.now,
            };
            self.m.apply(meta, c, &mut Vec::new());
        }

        fn enqueue(&mut self, body: &'static [u8], meta: MsgMeta) {
            self.apply(Command::Enqueue {
                message: message(body),
                meta: MsgMeta {
                    size: body.len() as u64,
                    ..meta
                },
            });
        }
    }

    fn spec(channel: u16, prefetch: u32) -> ConsumerSpec {
        let mut arguments = FieldTable::new();
        arguments.insert("x-visibility-timeout", FieldValue::I64(40));
        ConsumerSpec {
            group: CreditGroup { conn: 3, channel },
            tag: ShortStr::from_static("ctag"),
            no_ack: false,
            prefetch,
            exclusive: false,
            priority: 2,
            arguments,
        }
    }

    /// A machine with something in most of its places: deliveries with timers, a retry, a
    /// parked group message, a returned one, credit, an enqueuer, expiries and caps.
    fn busy() -> QueueMachine<Message> {
        let mut r = Run {
            m: QueueMachine::new(),
            now: 100,
        };
        r.apply(Command::Configure(Policy {
            delivery_limit: Some(5),
            consumer_timeout_ms: Some(500),
            retry: Some(RetryPolicy {
                min_ms: 30,
                max_ms: Some(90),
                multiplier: Some(2),
                jitter_pct: 10,
            }),
            ..Policy::default()
        }));
        let g = GroupKey::new(77);
        for (body, group) in [(&b"a"[..], g), (b"b", g), (b"c", None), (b"d", None)] {
            r.enqueue(
                body,
                MsgMeta {
                    group,
                    expires_at: Some(10_000),
                    ..MsgMeta::default()
                },
            );
        }
        r.apply(Command::EnqueueFrom {
            enqueuer: EnqueuerId(crate::qualify(2, 5).unwrap_or(0)),
            seq: 1,
            message: message(b"e"),
            meta: MsgMeta::default(),
        });
        r.apply(Command::Consume {
            id: ConsumerId(1),
            spec: spec(1, 2),
        });
        r.apply(Command::Credit {
            group: CreditGroup {
                conn: 3,
                channel: 1,
            },
            credit: Credit {
                blocked: false,
                limit: Some(7),
            },
        });
        r.apply(Command::Checkout { max: 10 });
        r.apply(Command::GetBy {
            no_ack: false,
            node: 2,
        });
        r.now = 120;
        r.apply(Command::Return {
            receipt: Receipt {
                msg_id: 2,
                attempt: 1,
            },
        });
        r.apply(Command::CapExpiry {
            caps: vec![(100, 9_000)],
        });
        r.m
    }

    fn snapshot_of(m: &QueueMachine<Message>) -> Bytes {
        let mut out = BytesMut::new();
        m.snapshot(&mut out)
            .map(|()| out.freeze())
            .unwrap_or_default()
    }

    /// Writes a new checksum over a changed body, so that the reader's other checks are met.
    fn reseal(mut bytes: Vec<u8>) -> Bytes {
        let crc = crc32fast::hash(bytes.get(5..).unwrap_or_default());
        if let Some(head) = bytes.get_mut(1..5) {
            head.copy_from_slice(&crc.to_be_bytes());
        }
        Bytes::from(bytes)
    }

    /// Taken between a TTL-0 enqueue with a consumer waiting and the checkout that follows:
    /// the restored machine hands the message out at that checkout too.
    #[test]
    fn a_pending_handoff_round_trips() {
        let mut r = Run {
            m: QueueMachine::new(),
            now: 100,
        };
        r.apply(Command::Consume {
            id: ConsumerId(1),
            spec: spec(1, 2),
        });
        r.enqueue(
            b"now or never",
            MsgMeta {
                expires_at: Some(100),
                ..MsgMeta::default()
            },
        );
        let bytes = snapshot_of(&r.m);
        let mut back = QueueMachine::restore_snapshot(bytes.clone()).unwrap();
        assert_eq!(back.digest(), r.m.digest());
        assert_eq!(snapshot_of(&back), bytes);
        let mut effects = Vec::new();
        let meta = Meta {
            index: back.last_index() + 1,
            now_ms: 105,
        };
        back.apply(meta, Command::Checkout { max: 10 }, &mut effects);
        assert!(
            matches!(effects.as_slice(), [crate::machine::Effect::Deliver(d)] if d.receipt.msg_id == 0),
            "{effects:?}"
        );
    }

    /// Dead-lettered messages held until their dead letters are safe are part of a snapshot
    /// (version 4): a follower that catches up from one can still send them as leader.
    #[test]
    fn held_dead_letters_round_trip() {
        let mut r = Run {
            m: QueueMachine::new(),
            now: 100,
        };
        r.apply(Command::Configure(Policy {
            hold_dead_letters: true,
            ..Policy::default()
        }));
        for body in [&b"rejected"[..], b"kept"] {
            r.enqueue(body, MsgMeta::default());
        }
        r.apply(Command::Get { no_ack: false });
        r.apply(Command::Discard {
            receipt: Receipt {
                msg_id: 0,
                attempt: 1,
            },
        });
        assert_eq!(r.m.dead_held_count(), 1);
        let bytes = snapshot_of(&r.m);
        assert_eq!(bytes.first(), Some(&4));
        let back = QueueMachine::restore_snapshot(bytes.clone()).unwrap();
        assert_eq!(back.digest(), r.m.digest());
        assert_eq!(snapshot_of(&back), bytes);
        let held: Vec<_> = back
            .dead_held()
            .map(|(id, d)| (id, d.message.body.clone(), d.delivery_count, d.reason))
            .collect();
        assert_eq!(
            held,
            [(
                0,
                Bytes::from_static(b"rejected"),
                1,
                crate::machine::DeadLetterReason::Rejected
            )]
        );
        // Settled, the state no longer needs version 4.
        r.apply(Command::DeadLettered { ids: vec![0] });
        assert_eq!(snapshot_of(&r.m).first(), Some(&1));
    }

    /// A member whose messages' contents left memory writes them whole, and the restored
    /// machine (on another node) holds them in memory; the member keeps its handles.
    #[test]
    fn messages_away_are_written_whole_and_come_back_in_memory() {
        let store = std::sync::Arc::new(crate::tests::MemAway::default());
        let mut r = Run {
            m: QueueMachine::new(),
            now: 100,
        };
        for body in [&b"one"[..], b"two", b"three"] {
            r.apply(Command::Enqueue {
                message: Message {
                    body: Bytes::from_static(body),
                    ..message(b"")
                },
                meta: MsgMeta {
                    size: body.len() as u64,
                    ..MsgMeta::default()
                },
            });
        }
        let whole = snapshot_of(&r.m);
        let digest = r.m.digest();
        let mut keys = Vec::new();
        for (_, m) in r.m.head_payloads_mut(1, 0) {
            let key = store.put(&[&*m]).unwrap()[0];
            *m = m.away_stub(key, store.clone());
            keys.push(key);
        }
        assert_eq!(keys.len(), 2, "the first stays");
        assert_eq!(r.m.digest(), digest, "nothing the machine holds changed");
        assert_eq!(snapshot_of(&r.m), whole);
        // Streamed a byte at a time: the same bytes, each handed on as soon as it is written.
        let mut streamed = Vec::new();
        let mut calls = 0;
        let prefix =
            r.m.snapshot_to(1, &mut |c: &[u8]| {
                calls += 1;
                streamed.extend_from_slice(c);
                Ok(())
            })
            .unwrap();
        assert_eq!([&prefix[..], &streamed].concat(), whole);
        assert!(calls >= 3, "at least one chunk per message: {calls}");
        // A sink that refuses ends it with its error.
        let refused =
            r.m.snapshot_to(1, &mut |_: &[u8]| Err("disk full".to_owned()));
        assert_eq!(refused, Err(SnapshotError::Write("disk full".to_owned())));
        let back = QueueMachine::restore_snapshot(whole).unwrap();
        assert!(back.messages().all(|(_, m, _)| !m.is_away()));
        // Contents that cannot be read back refuse the snapshot, leaving nothing written.
        store.held.lock().unwrap().clear();
        let mut out = BytesMut::from(&b"kept"[..]);
        assert!(matches!(
            r.m.snapshot(&mut out),
            Err(SnapshotError::Away(crate::AwayError::Missing { .. }))
        ));
        assert_eq!(&out[..], b"kept");
        drop(r);
        let mut released = store.released.lock().unwrap().clone();
        released.sort_unstable();
        assert_eq!(released, keys, "every handle let go with the machine");
    }

    /// A line packed past its head ([`QueueMachine::pack_line`]) is the same machine: the
    /// same digest, a snapshot that restores to it, its messages delivered whole and in
    /// order, and every handle let go once they are taken.
    /// A deep queue's snapshot decoded with a store: past its head the line is sent away and
    /// packed as it is read (never whole in memory), the same state as decoded whole, and it
    /// delivers every message whole and in order, the one with an expiry included.
    #[test]
    fn a_snapshot_decoded_with_a_store_packs_its_line_as_it_reads_it() {
        let store = std::sync::Arc::new(crate::tests::MemAway::default());
        let n = 2 * Restoring::BATCH as u32 + 300;
        let body = job;
        let (r, whole, mut packed) =
            restored_away(n, |i| (i == 5_000).then_some(1_000_000), &store);
        assert_eq!(packed.digest(), whole.digest());
        assert_eq!(packed.head_count(), 16);
        assert_eq!(
            packed.packed_count(),
            n as usize - 16,
            "all but the head, the one with an expiry too"
        );
        assert_eq!(store.held.lock().unwrap().len(), n as usize - 16);
        assert_eq!(packed.ready_count(), n as usize);
        // The head past a smaller window packs once away, as the broker's passes send it.
        for (_, m) in packed.head_payloads_mut(4, 0) {
            if !m.is_away() {
                let key = store.put(&[&*m]).unwrap()[0];
                *m = m.away_stub(key, store.clone());
            }
        }
        assert_eq!(packed.pack_line(4, u64::from(n)), 12);
        assert_eq!(packed.head_count(), 4);
        assert_eq!(packed.digest(), whole.digest());
        assert_eq!(packed.pack_line(4, u64::from(n)), 0, "looked at already");
        // Its runs written out of memory, all but the last (which may still grow): the same
        // machine, whose snapshot restores to it.
        let spilled = packed.spill_line(0, 1);
        // The runs of the first two blocks of ids (the first from id 4, past the head).
        assert_eq!(spilled, 2 * crate::machine::PACKED_RUN - 4);
        assert_eq!(packed.spilled_count(), spilled);
        assert_eq!(store.runs.lock().unwrap().len(), packed.tail_packed - 1);
        assert_eq!(packed.digest(), whole.digest());
        let again = QueueMachine::restore_snapshot(snapshot_of(&packed)).unwrap();
        assert_eq!(again.digest(), whole.digest());
        drop(again);
        // It gives every message back whole, in order.
        get_all_in_order(&mut packed, r.now, n, body);
        assert_eq!(packed.ready_count(), 0);
        assert_eq!(store.held(), 0, "every message's contents let go");
        assert!(store.runs.lock().unwrap().is_empty(), "every run let go");
        // A store that fails leaves the line whole, the state the same.
        let failing = std::sync::Arc::new(crate::tests::MemAway::default());
        *failing.fail_after.lock().unwrap() = Some(0);
        let mut restoring = Restoring {
            keep: 16,
            store: failing.into(),
            error: None,
        };
        let kept =
            QueueMachine::restore_snapshot_away(snapshot_of(&r.m), Some(&mut restoring)).unwrap();
        assert!(restoring.error.is_some());
        assert_eq!(kept.packed_count(), 0);
        assert_eq!(kept.head_count(), n as usize);
        assert_eq!(kept.digest(), whole.digest());
        // One that fails after its first batch: what it left whole packs once the broker's
        // passes send it away (it was taken as looked at, and stayed whole for good).
        let filling = std::sync::Arc::new(crate::tests::MemAway::default());
        *filling.fail_after.lock().unwrap() = Some(1);
        let mut restoring = Restoring {
            keep: 16,
            store: filling.clone().into(),
            error: None,
        };
        let mut half =
            QueueMachine::restore_snapshot_away(snapshot_of(&r.m), Some(&mut restoring)).unwrap();
        assert!(restoring.error.is_some());
        assert_eq!(half.packed_count(), Restoring::BATCH);
        assert_eq!(half.digest(), whole.digest());
        *filling.fail_after.lock().unwrap() = None;
        for (_, m) in half.head_payloads_mut(16, 0) {
            if !m.is_away() {
                let key = filling.put(&[&*m]).unwrap()[0];
                *m = m.away_stub(key, filling.clone());
            }
        }
        half.pack_line(16, u64::from(n));
        assert_eq!(half.packed_count(), n as usize - 16);
        assert_eq!(half.digest(), whole.digest());
    }

    fn job(n: u32) -> Bytes {
        Bytes::from(format!("job {n}"))
    }

    /// A deep queue's snapshot decoded with a store that keeps runs: the full runs past the
    /// first two and before the last are written out of memory as they are made, and the
    /// line gives every message back in order.
    #[test]
    fn a_snapshot_decoded_with_a_store_spills_its_full_runs() {
        let store = std::sync::Arc::new(crate::tests::MemAway::default());
        let run = crate::machine::PACKED_RUN as u32;
        let n = 16 + 4 * run + 10;
        let (r, whole, mut m) = restored_away(n, |_| None, &store);
        assert_eq!(m.spilled_count(), 2 * run as usize);
        assert_eq!(store.runs.lock().unwrap().len(), 2);
        assert_eq!(m.digest(), whole.digest());
        get_all_in_order(&mut m, r.now, n, job);
        assert_eq!(store.held(), 0);
        assert!(store.runs.lock().unwrap().is_empty());
    }

    /// A queue TTL's line restored away: its runs written out as they are read, their
    /// expiries folded (no pair per message left in memory for them), the machine the same,
    /// its snapshot holding every pair, every message given back in order.
    #[test]
    fn a_queue_ttls_line_restored_away_folds_its_spilled_expiries() {
        let store = std::sync::Arc::new(crate::tests::MemAway::default());
        // Past the runs kept in memory: three full runs go out as they are read.
        let n = 5 * Restoring::BATCH as u32 + 300;
        let (_, whole, mut packed) =
            restored_away(n, |i| Some(10_000_000 + u64::from(i / 100)), &store);
        assert_eq!(packed.digest(), whole.digest());
        assert!(packed.spilled_count() > 0);
        assert_eq!(packed.expiries_in_order.len(), n as usize);
        assert!(
            packed.expiries_in_order.in_memory() < n as usize / 2,
            "{} of {n} pairs in memory",
            packed.expiries_in_order.in_memory()
        );
        let again = QueueMachine::restore_snapshot(snapshot_of(&packed)).unwrap();
        assert_eq!(again.digest(), whole.digest());
        assert_eq!(again.expiries_in_order.in_memory(), n as usize);
        drop(again);
        // Time passes to the middle of the first spilled run: the same messages expire.
        let mut whole = whole;
        assert_eq!(packed.next_deadline(), whole.next_deadline());
        let first_spilled = 16 + Restoring::KEEP_RUNS * crate::machine::PACKED_RUN;
        let now = 10_000_001 + first_spilled as u64 / 100 + 20;
        let meta = Meta {
            index: packed.last_index() + 1,
            now_ms: now,
        };
        let (mut a, mut b) = (Vec::new(), Vec::new());
        packed.apply(meta, Command::Tick, &mut a);
        whole.apply(meta, Command::Tick, &mut b);
        assert_eq!(a, b);
        assert_eq!(packed.digest(), whole.digest());
        assert_eq!(packed.next_deadline(), whole.next_deadline());
        let left = packed.ready_count() as u32;
        assert!(
            left < n - first_spilled as u32,
            "{left} of {n} left: the expiries reached into a spilled run"
        );
        get_all_in_order_from(&mut packed, now, n - left, n, job);
        assert_eq!(packed.expiries_in_order.len(), 0);
    }

    /// A replicated queue of `n` jobs (`expiry` of each), its snapshot decoded whole and
    /// with `store` (keeping 16 messages at the head), which must take every write.
    fn restored_away(
        n: u32,
        expiry: impl Fn(u32) -> Option<u64>,
        store: &std::sync::Arc<crate::tests::MemAway>,
    ) -> (Run, QueueMachine<Message>, QueueMachine<Message>) {
        let r = jobs(n, expiry);
        let data = snapshot_of(&r.m);
        let whole = QueueMachine::restore_snapshot(data.clone()).unwrap();
        let mut restoring = Restoring {
            keep: 16,
            store: store.clone().into(),
            error: None,
        };
        let away = QueueMachine::restore_snapshot_away(data, Some(&mut restoring)).unwrap();
        assert_eq!(restoring.error, None);
        (r, whole, away)
    }

    /// Takes the `n` messages of `m` with basic.get, no ack, checking each is the next one,
    /// whole (`body` of its number).
    fn get_all_in_order(
        m: &mut QueueMachine<Message>,
        now: u64,
        n: u32,
        body: impl Fn(u32) -> Bytes,
    ) {
        get_all_in_order_from(m, now, 0, n, body);
    }

    /// [`get_all_in_order`] of messages `from` to `to` (excluded), the rest gone.
    fn get_all_in_order_from(
        m: &mut QueueMachine<Message>,
        now: u64,
        from: u32,
        to: u32,
        body: impl Fn(u32) -> Bytes,
    ) {
        let mut effects = Vec::new();
        for i in from..to {
            effects.clear();
            let meta = Meta {
                index: m.last_index() + 1,
                now_ms: now,
            };
            let reply = m.apply(meta, Command::Get { no_ack: true }, &mut effects);
            assert_eq!(reply, crate::machine::Reply::Delivered { count: 1 }, "{i}");
            let Some(crate::machine::Effect::Deliver(d)) = effects.first() else {
                panic!("{i}: no delivery: {effects:?}");
            };
            assert_eq!(d.receipt.msg_id, u64::from(i));
            assert_eq!(d.message.loaded().unwrap().body, body(i));
        }
    }

    /// A replicated queue's machine with `n` jobs (`expiry` of each) in its line.
    fn jobs(n: u32, expiry: impl Fn(u32) -> Option<u64>) -> Run {
        let mut r = Run {
            m: QueueMachine::new(),
            now: 100,
        };
        for i in 0..n {
            r.apply(Command::Enqueue {
                message: Message {
                    body: job(i),
                    // A replicated queue's message: no key of this node's store.
                    store_key: None,
                    ..message(b"")
                },
                meta: MsgMeta {
                    size: job(i).len() as u64,
                    expires_at: expiry(i),
                    ..MsgMeta::default()
                },
            });
        }
        r
    }

    /// A replicated queue's line of 40 jobs (`expiry` of each), all but the first 4 away.
    fn away_line(
        expiry: impl Fn(u32) -> Option<u64>,
    ) -> (Run, std::sync::Arc<crate::tests::MemAway>) {
        let store = std::sync::Arc::new(crate::tests::MemAway::default());
        let mut r = jobs(40, expiry);
        for (_, m) in r.m.head_payloads_mut(4, 0) {
            let key = store.put(&[&*m]).unwrap()[0];
            *m = m.away_stub(key, store.clone());
        }
        (r, store)
    }

    #[test]
    fn a_packed_line_capped_by_a_ttl_policy_is_packed_again_with_its_expiries() {
        let (mut r, _store) = away_line(|_| None);
        assert_eq!(r.m.pack_line(4, 39), 36);
        let mut whole = r.m.clone();
        whole.unpack_tail();
        let cap = Command::CapExpiry {
            caps: vec![(u64::MAX, 5_000)],
        };
        r.apply(cap.clone());
        assert_eq!(r.m.packed_count(), 0, "rebuilt whole to take the cap");
        let mut w = Run { m: whole, now: 100 };
        w.apply(cap);
        assert_eq!(r.m.digest(), w.m.digest());
        // Packed again, expiries and all: a policy's TTL no longer keeps the line whole.
        assert_eq!(r.m.pack_line(4, 39), 36);
        assert_eq!(r.m.digest(), w.m.digest());
        r.now = 5_001;
        w.now = 5_001;
        r.apply(Command::Tick);
        w.apply(Command::Tick);
        assert_eq!(r.m.ready_count(), 0, "every message expired at its cap");
        assert_eq!(r.m.digest(), w.m.digest());
    }

    #[test]
    fn a_packed_line_snapshots_and_delivers_as_the_line_it_packs() {
        let (mut r, store) = away_line(|n| (n == 20).then_some(1_000_000));
        let body = job;
        let whole = r.m.clone();
        let digest = r.m.digest();
        // All but the first 4, the one with an expiry too.
        assert_eq!(r.m.pack_line(4, 39), 36);
        assert_eq!(r.m.packed_count(), 36);
        assert_eq!(
            r.m.digest(),
            digest,
            "packing changes nothing the machine holds"
        );
        assert_eq!(r.m.ready_count(), 40);
        // Written whole, the line all in its head (where it splits is the member's own).
        let restored = QueueMachine::restore_snapshot(snapshot_of(&r.m)).unwrap();
        assert_eq!(restored.digest(), digest);
        assert_eq!(restored.packed_count(), 0);
        assert!(!restored.has_tail());
        let from_whole = QueueMachine::restore_snapshot(snapshot_of(&whole)).unwrap();
        assert_eq!(from_whole.digest(), digest);
        // Messages after the packed ones (published since) are packed by the next call,
        // into the last run, once they are away.
        r.apply(Command::Enqueue {
            message: Message {
                body: body(40),
                store_key: None,
                ..message(b"")
            },
            meta: MsgMeta {
                size: body(40).len() as u64,
                ..MsgMeta::default()
            },
        });
        assert_eq!(
            r.m.pack_line(4, 39),
            0,
            "not looked at: its contents are here"
        );
        for (_, m) in r.m.head_payloads_mut(4, 39) {
            let key = store.put(&[&*m]).unwrap()[0];
            *m = m.away_stub(key, store.clone());
        }
        assert_eq!(r.m.pack_line(4, 40), 1);
        assert_eq!(r.m.packed_count(), 37);
        // Taken from the head, whole once loaded, in order.
        let mut effects = Vec::new();
        for n in 0..41u32 {
            effects.clear();
            let meta = Meta {
                index: r.m.last_index() + 1,
                now_ms: r.now,
            };
            let reply = r.m.apply(meta, Command::Get { no_ack: true }, &mut effects);
            assert_eq!(reply, crate::machine::Reply::Delivered { count: 1 }, "{n}");
            let Some(crate::machine::Effect::Deliver(d)) = effects.first() else {
                panic!("{n}: no delivery: {effects:?}");
            };
            assert_eq!(d.receipt.msg_id, u64::from(n));
            assert_eq!(d.message.loaded().unwrap().body, body(n));
        }
        drop(effects);
        assert_eq!(r.m.ready_count(), 0);
        assert_eq!(r.m.packed_count(), 0);
        drop(whole);
        assert!(store.held.lock().unwrap().len() <= store.released.lock().unwrap().len() + 41);
        assert_eq!(
            store.released.lock().unwrap().len(),
            37,
            "every handle let go"
        );
    }

    /// Without a handoff (nearly always) a snapshot is written in version 1, which members of
    /// earlier builds read during a rolling upgrade, and reads back as no handoff.
    #[test]
    fn a_machine_without_a_handoff_snapshots_as_version_1() {
        let m = busy();
        let bytes = snapshot_of(&m);
        assert_eq!(bytes.first(), Some(&1));
        let back = QueueMachine::restore_snapshot(bytes.clone()).unwrap();
        assert_eq!(back.digest(), m.digest());
        assert_eq!(snapshot_of(&back), bytes);
    }

    #[test]
    fn held_publishes_snapshot_as_version_3_and_round_trip() {
        let mut r = Run {
            m: busy(),
            now: 200,
        };
        let held = |delay_ms, from, body| Command::EnqueueWith {
            delay_ms,
            from,
            dedup: None,
            message: message(body),
            meta: MsgMeta {
                size: 1,
                ..MsgMeta::default()
            },
        };
        let keyed = |b: u8, ttl_ms, body| Command::EnqueueWith {
            delay_ms: 0,
            from: None,
            dedup: Some(Box::new(super::super::DedupWindow {
                key: DedupKey {
                    len: 3,
                    bytes: [b; 32],
                },
                ttl_ms,
                max_keys: 10,
            })),
            message: message(body),
            meta: MsgMeta::default(),
        };
        r.apply(held(4_800, None, b"x"));
        r.apply(held(
            3_800,
            Some((EnqueuerId(crate::qualify(3, 9).unwrap_or(0)), 1)),
            b"y",
        ));
        r.apply(keyed(9, 60_000, b"z"));
        assert_eq!((r.m.held_count(), r.m.dedup_keys()), ((2, 2), 1));
        let bytes = snapshot_of(&r.m);
        assert_eq!(bytes.first(), Some(&3));
        let back = QueueMachine::restore_snapshot(bytes.clone()).unwrap();
        assert_eq!(back.digest(), r.m.digest());
        assert_eq!((back.held_count(), back.dedup_keys()), ((2, 2), 1));
        assert_eq!(snapshot_of(&back), bytes);
        // Released, the key forgotten, the state is of version 1 again (its members of earlier
        // versions read it).
        r.now = 5_000;
        r.apply(Command::Tick);
        assert_eq!(
            snapshot_of(&r.m).first(),
            Some(&3),
            "the key is kept a minute"
        );
        r.now = 70_000;
        r.apply(keyed(8, 0, b"w"));
        assert_eq!(r.m.dedup_keys(), 0);
        assert_eq!(snapshot_of(&r.m).first(), Some(&1));
    }

    #[test]
    fn a_busy_machine_round_trips_to_the_same_digest_and_bytes() {
        let m = busy();
        assert!(m.in_flight_count() > 0 && m.retrying_count() > 0 && m.enqueuer_count() > 0);
        let bytes = snapshot_of(&m);
        let back = QueueMachine::restore_snapshot(bytes.clone()).unwrap();
        assert_eq!(back.digest(), m.digest());
        assert_eq!(snapshot_of(&back), bytes);
    }

    #[test]
    fn bodies_are_slices_of_the_snapshot() {
        let bytes = snapshot_of(&busy());
        let back = QueueMachine::restore_snapshot(bytes.clone()).unwrap();
        let whole = bytes.as_ptr() as usize..bytes.as_ptr() as usize + bytes.len();
        for (_, msg, _) in back.messages() {
            assert!(
                whole.contains(&(msg.body.as_ptr() as usize)),
                "a copied body"
            );
        }
    }

    #[test]
    fn a_snapshot_cut_short_anywhere_is_an_error() {
        let bytes = snapshot_of(&busy());
        for len in 0..bytes.len() {
            let cut = bytes.slice(..len);
            assert!(
                QueueMachine::restore_snapshot(cut).is_err(),
                "{len} of {} bytes accepted",
                bytes.len()
            );
            // With its checksum right, the reader itself finds the end.
            if len >= 5 {
                assert!(
                    QueueMachine::restore_snapshot(reseal(bytes.slice(..len).to_vec())).is_err(),
                    "{len} bytes resealed accepted"
                );
            }
        }
    }

    #[test]
    fn a_flipped_byte_is_a_checksum_error_and_an_unknown_version_is_refused() {
        let bytes = snapshot_of(&busy());
        for i in 1..bytes.len() {
            let mut bad = bytes.to_vec();
            bad[i] ^= 0x40;
            assert_eq!(
                QueueMachine::restore_snapshot(Bytes::from(bad)).err(),
                Some(SnapshotError::Checksum),
                "byte {i}"
            );
        }
        let mut newer = bytes.to_vec();
        newer[0] = SNAPSHOT_VERSION + 1;
        let err = QueueMachine::restore_snapshot(Bytes::from(newer)).unwrap_err();
        assert_eq!(
            err,
            SnapshotError::UnknownVersion {
                found: SNAPSHOT_VERSION + 1
            }
        );
        assert!(err.to_string().contains("version 5"), "{err}");
        let mut none = bytes.to_vec();
        none[0] = 0;
        assert_eq!(
            QueueMachine::restore_snapshot(Bytes::from(none)).err(),
            Some(SnapshotError::UnknownVersion { found: 0 })
        );
    }

    #[test]
    fn a_resealed_damaged_byte_never_panics() {
        // What only the checksum stood against: any change must be an error or a machine.
        let bytes = snapshot_of(&busy());
        for i in 5..bytes.len() {
            for flip in [0x01, 0x80, 0xff] {
                let mut bad = bytes.to_vec();
                bad[i] ^= flip;
                let _ = QueueMachine::restore_snapshot(reseal(bad));
            }
        }
    }

    #[test]
    fn a_count_larger_than_the_bytes_left_is_refused_before_allocating() {
        let mut m = QueueMachine::<Message>::new();
        m.apply(
            Meta::default(),
            Command::Enqueue {
                message: message(b"a"),
                meta: MsgMeta::default(),
            },
            &mut Vec::new(),
        );
        let bytes = snapshot_of(&m).to_vec();
        // The ready count follows the fixed fields, the plain policy and three flags.
        let mut policy = BytesMut::new();
        put_policy(&mut policy, &Policy::default());
        let at = 5 + 10 * 8 + policy.len() + 3;
        assert_eq!(bytes.get(at..at + 4), Some(&[0, 0, 0, 1][..]));
        let mut huge = bytes.clone();
        huge[at..at + 4].copy_from_slice(&u32::MAX.to_be_bytes());
        let err = QueueMachine::restore_snapshot(reseal(huge)).unwrap_err();
        assert!(err.to_string().contains("do not fit"), "{err}");
    }

    #[test]
    fn a_machine_with_paged_runs_is_refused_and_one_whose_tail_is_in_memory_is_not() {
        let mut r = Run {
            m: QueueMachine::new(),
            now: 0,
        };
        for _ in 0..4 {
            r.enqueue(b"p", MsgMeta::default());
        }
        // Nothing is pageable: the line splits, the tail stays in memory.
        r.apply(Command::PageOut {
            keep: 1,
            keep_bytes: u64::MAX,
            upto_id: 10,
        });
        assert!(r.m.has_tail() && r.m.paged_count() == 0);
        r.enqueue(
            b"q",
            MsgMeta {
                pageable: true,
                ..MsgMeta::default()
            },
        );
        let bytes = snapshot_of(&r.m);
        let back = QueueMachine::restore_snapshot(bytes.clone()).unwrap();
        assert_eq!(back.digest(), r.m.digest());
        assert_eq!(snapshot_of(&back), bytes);

        r.apply(Command::PageOut {
            keep: 1,
            keep_bytes: u64::MAX,
            upto_id: 10,
        });
        assert_eq!(r.m.paged_count(), 1);
        let mut out = BytesMut::from(&b"kept"[..]);
        assert_eq!(
            r.m.snapshot(&mut out),
            Err(SnapshotError::Paged { runs: 1 })
        );
        assert_eq!(&out[..], b"kept", "nothing written");
    }

    #[test]
    fn bytes_after_the_state_are_refused() {
        let mut bytes = snapshot_of(&busy()).to_vec();
        bytes.push(0);
        let err = QueueMachine::restore_snapshot(reseal(bytes)).unwrap_err();
        assert!(err.to_string().contains("after the state"), "{err}");
    }
}
