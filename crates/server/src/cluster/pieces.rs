//! A Raft message too large for one frame travels in pieces. Only a snapshot grows that large: a
//! deep queue's state (a frame holds 64 MiB, about 60,000 queued 1 KiB messages). Sent in one
//! frame it would also hold every other group's heartbeats on the link behind it for as long as
//! its write takes (about a second per GiB here), long enough to start elections.
//!
//! The sender writes the message without its snapshot's data (the *head*), then the data, as
//! forwards to the reserved group [`super::PIECE`]: at most [`PIECE_BYTES`] in a frame and one
//! frame of pieces per write, so what Raft sends meanwhile goes out between them. A piece is the
//! message's group (u64), the data's length (u64), where this piece's data starts in it (u64), the
//! head's length (u32) and the head (in the first piece only), then the data, all big-endian.
//!
//! The receiver keeps one message in pieces per link: a piece at offset 0 starts one (dropping
//! an unfinished one), any other must follow the one before it, and the last makes the message
//! whole, handed to Raft like any other. A node's links write the pieces to a file of their own
//! ([`Incoming::spooled`]) and hand the message over with its data mapped from it, so that a deep
//! queue's snapshot is never whole in the heap of a member catching up: before, it was held
//! whole there from its last piece until its state was installed, beside the machine decoded from
//! it. A link that breaks loses what it held in pieces; Raft
//! sends the snapshot again when the follower still lacks it. A node that predates pieces drops
//! them as forwards to a group it does not have: the broker takes snapshots larger than a frame
//! only once every node of the cluster announced the feature level that receives them.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes};
use protobuf::Message as _;
use warren_replication::raft::eraftpb::Message;
use warren_replication::{Envelope, GroupId, NodeBatch};

use super::wire::{self, Header, WireError, BATCH_HEADER, ENVELOPE_HEADER, MAX_FRAME};

/// Data bytes in one piece: a few milliseconds of a link's time, so a heartbeat queued behind
/// a piece is late by no more than that.
pub const PIECE_BYTES: usize = 4 << 20;
/// A message whose snapshot data is at most this travels in one frame, as before pieces: a
/// node that predates them reads it.
pub const INLINE_MAX: usize = super::MAX_PROPOSAL;
/// The largest snapshot data sent or taken in pieces. A receiver spools a message's pieces to
/// its disk until the last one (and only if its disk has room for them), so this is a sanity
/// bound, not a budget: a terabyte. Nodes of versions before `LARGE_SNAPSHOTS_LEVEL` refuse
/// more than 4 GiB, and are sent at most [`super::MAX_SNAPSHOT`].
pub const MAX_PIECED: usize = 1 << 40;
/// The largest message of pieces put together in memory, when a link has no spool file or
/// cannot write it: a larger one is read to its end and dropped (Raft sends it again), never
/// held in the heap.
pub const MAX_IN_MEMORY: usize = super::MAX_SNAPSHOT;
const _: () = assert!(super::MAX_SNAPSHOT <= MAX_PIECED);
/// Room a spooled message leaves on its disk: the node's log and store write there too.
const SPOOL_MARGIN: u64 = 256 << 20;
/// The longest a receiver declines to put together again a snapshot that came whole.
const AGAIN_AT_MOST: Duration = Duration::from_secs(300);
/// Messages waiting to go in pieces on one link; more are dropped (Raft sends them again).
const MAX_WAITING: usize = 4;
const PIECE_HEADER: usize = 28;

/// The messages a link sends in pieces, oldest first; the first may be under way.
pub struct Outgoing {
    waiting: VecDeque<Sending>,
    /// The link's latest batch header: pieces of a message taken earlier say what it says
    /// (whether the sender drains now; the receiver would see maintenance mode come and go
    /// otherwise).
    header: Header,
    /// Larger snapshot data goes in pieces of `piece_bytes` ([`INLINE_MAX`] and
    /// [`PIECE_BYTES`], smaller in tests).
    inline_max: usize,
    piece_bytes: usize,
}

impl Default for Outgoing {
    fn default() -> Self {
        Outgoing::new(INLINE_MAX)
    }
}

struct Sending {
    group: u64,
    head: Vec<u8>,
    data: Bytes,
    sent: usize,
}

impl Outgoing {
    pub fn new(inline_max: usize) -> Outgoing {
        let inline_max = inline_max.clamp(1, INLINE_MAX);
        Outgoing {
            waiting: VecDeque::new(),
            header: Header::default(),
            inline_max,
            piece_bytes: (inline_max / 4).clamp(1, PIECE_BYTES),
        }
    }

    /// Takes out of `batch` the messages too large for one frame, to go in pieces after it.
    /// Returns how many of them were dropped instead: too large even for pieces, a head that
    /// would not encode, no room among the waiting ones. A message for a group and peer that
    /// already has one waiting is dropped too: Raft asks for a snapshot again each time the
    /// follower refuses an append it cannot take yet, and starting the first one over would
    /// never let it finish.
    pub fn take_large(&mut self, batch: &mut NodeBatch) -> usize {
        self.header = Header::of(batch);
        if !batch
            .msgs
            .iter()
            .any(|e| e.msg.get_snapshot().data.len() > self.inline_max)
        {
            return 0;
        }
        let mut dropped = 0;
        let msgs = std::mem::take(&mut batch.msgs);
        for env in msgs {
            if env.msg.get_snapshot().data.len() <= self.inline_max {
                batch.msgs.push(env);
                continue;
            }
            let data = env.msg.get_snapshot().data.clone();
            // One link, one peer: the group tells a message apart.
            let same = |s: &Sending| s.group == env.group.0;
            if data.len() > MAX_PIECED
                || self.waiting.len() >= MAX_WAITING
                || self.waiting.iter().any(same)
            {
                dropped += 1;
                continue;
            }
            let mut head = env.msg;
            head.mut_snapshot().data = Bytes::new();
            match head.write_to_bytes() {
                Ok(head) if PIECE_HEADER + head.len() + self.piece_bytes <= room() => {
                    self.waiting.push_back(Sending {
                        group: env.group.0,
                        head,
                        data,
                        sent: 0,
                    });
                }
                _ => dropped += 1,
            }
        }
        dropped
    }

    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }

    /// Appends the next piece's frame to `out`. Returns whether it wrote one, and whether
    /// that was its message's last.
    pub fn next_frame(&mut self, out: &mut Vec<u8>) -> (bool, bool) {
        let Some(s) = self.waiting.front_mut() else {
            return (false, false);
        };
        let end = (s.sent + self.piece_bytes).min(s.data.len());
        let chunk = s.data.get(s.sent..end).unwrap_or_default();
        let head: &[u8] = if s.sent == 0 { &s.head } else { &[] };
        let mut top = Vec::with_capacity(PIECE_HEADER);
        top.put_u64(s.group);
        top.put_u64(s.data.len() as u64);
        top.put_u64(s.sent as u64);
        top.put_u32(head.len() as u32);
        wire::encode_forward_frame(&self.header, super::PIECE.0, &[&top, head, chunk], out);
        s.sent = end;
        let last = s.sent >= s.data.len();
        if last {
            self.waiting.pop_front();
        }
        (true, last)
    }
}

/// Payload bytes a frame leaves for one envelope's data, whether or not it says its sender
/// drains.
fn room() -> usize {
    MAX_FRAME - BATCH_HEADER - 2 * ENVELOPE_HEADER
}

/// A snapshot of a group, at an index, that came whole less than this long ago (and a second
/// more per 64 MiB of it) is not put together again: the leader sends it again each time the
/// follower refuses an append before its Raft thread has installed the first (a deep queue's
/// takes a while to write and decode), and each copy would be spooled or held again.
const AGAIN_AFTER: Duration = Duration::from_secs(10);

fn again_after(total: usize) -> Duration {
    (AGAIN_AFTER + Duration::from_secs((total >> 26) as u64)).min(AGAIN_AT_MOST)
}

/// Disk room a link counts on for a message it spools: twice its size (the spool file, then
/// the snapshot file written from it while the spool is still mapped), held in a count the
/// node's links share, so that links receiving at once do not each count the same free space.
struct Reservation {
    bytes: u64,
    spooling: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.spooling
            .fetch_sub(self.bytes, std::sync::atomic::Ordering::Relaxed);
    }
}

/// The message a link is receiving in pieces.
pub struct Incoming {
    partial: Option<Partial>,
    /// The last message made whole: its group, snapshot index, and until when the same one
    /// is not put together again.
    last: Option<(u64, u64, Instant)>,
    /// Where the pieces are written (none: kept in memory).
    spool: Option<PathBuf>,
    /// The largest message put together in memory ([`MAX_IN_MEMORY`]; less in tests).
    memory_max: usize,
    /// The free bytes of the spool's file system ([`crate::alarms::free_disk`]; made up in
    /// tests).
    free_disk: fn(&Path) -> Option<u64>,
    /// Disk room the node's links count on for the messages they are spooling
    /// ([`Reservation`]).
    spooling: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl Default for Incoming {
    fn default() -> Self {
        Incoming {
            partial: None,
            last: None,
            spool: None,
            memory_max: MAX_IN_MEMORY,
            free_disk: crate::alarms::free_disk,
            spooling: std::sync::Arc::default(),
        }
    }
}

struct Partial {
    group: u64,
    total: usize,
    head: Message,
    /// Each piece's data, copied out of its frame (whose buffer may be twice as large), when
    /// the link has no spool file.
    parts: Vec<Bytes>,
    /// The spool file the pieces are written to, if the link has one.
    file: Option<std::fs::File>,
    have: usize,
    /// Its pieces are checked, not kept: a copy of the last message made whole, or one that
    /// has nowhere to go (larger than `memory_max` and no room to spool it).
    again: bool,
    /// The disk room its spool file counts on, given back when it ends (held for its drop).
    _reserved: Option<Reservation>,
}

/// Empties the folder the links spool pieces into (`dir`, created if missing): what a crash
/// left there is never finished.
pub fn clear_spool(dir: &Path) -> std::io::Result<()> {
    if dir.exists() {
        std::fs::remove_dir_all(dir)?;
    }
    std::fs::create_dir_all(dir)
}

impl Incoming {
    /// A link's receiver that writes the pieces to `file` (a name of its own, in a folder
    /// emptied at the node's start: [`clear_spool`]), and maps it once the message is whole;
    /// `spooling` is the disk room the node's links count on, shared by them all.
    pub fn spooled(
        file: PathBuf,
        spooling: std::sync::Arc<std::sync::atomic::AtomicU64>,
    ) -> Incoming {
        let mut incoming = Incoming::default();
        incoming.spool = Some(file);
        incoming.spooling = spooling;
        incoming
    }

    /// Takes one piece (a forward's bytes); the message it makes whole comes back. An error
    /// is a sender that breaks the rules above: the link is dropped.
    pub fn take(&mut self, mut piece: Bytes, now: Instant) -> Result<Option<Envelope>, WireError> {
        if piece.len() < PIECE_HEADER {
            return Err(WireError::Piece("a piece shorter than its header"));
        }
        let top = piece.split_to(PIECE_HEADER);
        let word = |at: usize| {
            top.get(at..at + 8)
                .and_then(|b| <[u8; 8]>::try_from(b).ok())
                .map_or(0, u64::from_be_bytes)
        };
        let (group, total, offset) = (word(0), word(8), word(16));
        let head_len = top
            .get(24..28)
            .and_then(|b| <[u8; 4]>::try_from(b).ok())
            .map_or(0, u32::from_be_bytes) as usize;
        if total > MAX_PIECED as u64 {
            return Err(WireError::Piece(
                "a message above the largest taken in pieces",
            ));
        }
        let total = total as usize;
        if head_len > piece.len() {
            return Err(WireError::Piece("a head longer than its piece"));
        }
        let head = piece.split_to(head_len);
        if offset == 0 {
            let head = Message::parse_from_carllerche_bytes(&head)?;
            let index = head.get_snapshot().get_metadata().index;
            let mut again = self
                .last
                .is_some_and(|(g, i, until)| g == group && i == index && now < until);
            // An unfinished message is dropped, its file with it.
            self.discard_partial();
            let (file, reserved) = match (&self.spool, again) {
                (Some(path), false) => self.open_room(path, total).unzip(),
                _ => (None, None),
            };
            if !again && file.is_none() && total > self.memory_max {
                tracing::warn!(
                    group,
                    bytes = total,
                    "a snapshot in pieces cannot be spooled and is too large to hold in memory: it is dropped (its leader sends it again)"
                );
                again = true;
            }
            self.partial = Some(Partial {
                group,
                total,
                head,
                parts: Vec::new(),
                file,
                have: 0,
                again,
                _reserved: reserved,
            });
        } else if head_len != 0 {
            return Err(WireError::Piece("a head in a piece other than the first"));
        }
        let p = match self.partial.as_mut() {
            Some(p) if p.group == group && p.total == total && p.have as u64 == offset => p,
            _ => {
                self.discard_partial();
                return Err(WireError::Piece(
                    "a piece that does not follow the one before",
                ));
            }
        };
        if piece.len() > p.total - p.have {
            self.discard_partial();
            return Err(WireError::Piece("pieces longer than their message"));
        }
        if !piece.is_empty() && !p.again {
            let spooled = match p.file.as_mut() {
                Some(f) => match std::io::Write::write_all(f, &piece) {
                    Ok(()) => true,
                    Err(e) if p.total > self.memory_max => {
                        tracing::warn!(group, bytes = p.total, error = %e, "a snapshot in pieces cannot be spooled and is too large to hold in memory: it is dropped (its leader sends it again)");
                        p.file = None;
                        p.again = true;
                        remove_spool_file(&self.spool);
                        false
                    }
                    Err(e) => {
                        spool_failed(&e);
                        let back = back_to_memory(p);
                        // Read back or not, the file is not used again (it may be what filled
                        // the disk).
                        remove_spool_file(&self.spool);
                        if let Err(e) = back {
                            self.partial = None;
                            return Err(spool_error(&e));
                        }
                        false
                    }
                },
                None => false,
            };
            if !spooled && !p.again {
                p.parts.push(Bytes::copy_from_slice(&piece));
            }
        }
        p.have += piece.len();
        if p.have < p.total {
            return Ok(None);
        }
        let Some(mut p) = self.partial.take() else {
            return Ok(None);
        };
        if p.again {
            return Ok(None);
        }
        let data = match p.file.take() {
            Some(f) => {
                // SAFETY: the file is this link's own, written above and never again: the
                // next message of the link creates a new file under the name once this one
                // is unlinked, and the folder is emptied only at the node's start.
                let mapped = if p.have == 0 {
                    // A mapping of nothing is refused.
                    Ok(Bytes::new())
                } else {
                    unsafe { warren_replication::map_file(&f) }
                };
                remove_spool_file(&self.spool);
                mapped.map_err(|e| spool_error(&e))?
            }
            None => {
                // Sized by bytes that arrived, not by what the sender declared; each piece let
                // go once copied, so the message is held about once.
                let mut data = Vec::with_capacity(p.have);
                for part in p.parts.drain(..) {
                    data.extend_from_slice(&part);
                }
                data.into()
            }
        };
        if data.len() != p.have {
            return Err(WireError::Piece(
                "a spool file that does not hold its pieces",
            ));
        }
        let index = p.head.get_snapshot().get_metadata().index;
        self.last = Some((group, index, now + again_after(p.total)));
        p.head.mut_snapshot().data = data;
        Ok(Some(Envelope {
            group: GroupId(group),
            msg: p.head,
        }))
    }

    /// Bytes held for the message under way (in memory or in its spool file).
    #[cfg(test)]
    fn held(&self) -> usize {
        self.partial.as_ref().map_or(0, |p| p.have)
    }
}

impl Incoming {
    /// A spool file for a message of `total` bytes, and the room reserved for it, if its
    /// disk has room for it twice beside what the node's other links spool and what the node
    /// writes there.
    fn open_room(&self, path: &Path, total: usize) -> Option<(std::fs::File, Reservation)> {
        use std::sync::atomic::Ordering;
        let dir = path.parent().unwrap_or(path);
        let need = (total as u64).saturating_mul(2);
        let others = self.spooling.fetch_add(need, Ordering::Relaxed);
        let reserved = Reservation {
            bytes: need,
            spooling: self.spooling.clone(),
        };
        if let Some(free) = (self.free_disk)(dir) {
            if free < others.saturating_add(need).saturating_add(SPOOL_MARGIN) {
                tracing::warn!(
                    bytes = total,
                    free,
                    spooling = others,
                    "no room on the disk to spool a snapshot in pieces"
                );
                return None;
            }
        }
        let file = open_spool(path).map_err(|e| spool_failed(&e)).ok()?;
        Some((file, reserved))
    }

    /// Drops the message under way, and its spool file if it has one.
    fn discard_partial(&mut self) {
        if let Some(Partial { file: Some(_), .. }) = self.partial.take() {
            remove_spool_file(&self.spool);
        }
    }
}

impl Drop for Incoming {
    fn drop(&mut self) {
        // A link that ends with a message unfinished leaves no file behind.
        self.discard_partial();
    }
}

/// Unlinks the link's spool file, if it has one (a mapping of it lives on).
fn remove_spool_file(spool: &Option<PathBuf>) {
    if let Some(path) = spool {
        let _ = std::fs::remove_file(path);
    }
}

/// A new, empty spool file at `path`: a message's pieces replace whatever a link left there.
fn open_spool(path: &Path) -> std::io::Result<std::fs::File> {
    // Unlinked first: a mapping of the file's last message may still be alive (Raft holds the
    // snapshot until it is installed), and truncating its file would pull its pages away.
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(path)
}

/// A spool file that cannot be made or written (a full disk): the message is put together in
/// memory, as without a spool.
fn spool_failed(e: &std::io::Error) {
    tracing::warn!(error = %e, "a snapshot in pieces cannot be written to its spool file: it is put together in memory");
}

/// Reads back what the spool file holds (the pieces taken before this one) into memory, and
/// goes on without it.
fn back_to_memory(p: &mut Partial) -> std::io::Result<()> {
    use std::io::{Read, Seek};
    let Some(mut f) = p.file.take() else {
        return Ok(());
    };
    let mut held = Vec::with_capacity(p.have);
    f.seek(std::io::SeekFrom::Start(0))?;
    (&mut f).take(p.have as u64).read_to_end(&mut held)?;
    if held.len() != p.have {
        return Err(std::io::Error::other("the spool file lost pieces"));
    }
    p.parts.push(held.into());
    Ok(())
}

fn spool_error(e: &std::io::Error) -> WireError {
    tracing::warn!(error = %e, "a snapshot in pieces cannot be read back: the link is dropped, and the snapshot sent again");
    WireError::Piece("a snapshot in pieces could not be put together")
}

#[cfg(test)]
mod tests {
    use super::*;
    use warren_replication::raft::eraftpb::MessageType;

    fn snapshot_msg(to: u64, index: u64, data: Bytes) -> Message {
        let mut m = Message::default();
        m.set_msg_type(MessageType::MsgSnapshot);
        m.from = 1;
        m.to = to;
        m.term = 4;
        let s = m.mut_snapshot();
        s.mut_metadata().index = index;
        s.mut_metadata().term = 4;
        s.mut_metadata().mut_conf_state().voters = vec![1, 2, 3];
        s.data = data;
        m
    }

    fn heartbeat(to: u64) -> Message {
        let mut m = Message::default();
        m.set_msg_type(MessageType::MsgHeartbeat);
        m.from = 1;
        m.to = to;
        m.term = 4;
        m
    }

    fn batch(msgs: Vec<(u64, Message)>) -> NodeBatch {
        NodeBatch {
            from: 1,
            boot: 9,
            to: 2,
            draining: false,
            msgs: msgs
                .into_iter()
                .map(|(g, msg)| Envelope {
                    group: GroupId(g),
                    msg,
                })
                .collect(),
            forwards: vec![],
        }
    }

    fn big(len: usize) -> Bytes {
        (0..len).map(|i| (i % 251) as u8).collect::<Vec<_>>().into()
    }

    /// Decodes every frame in `out`, feeding pieces to `incoming`: the batches, and the
    /// messages made whole.
    fn receive(out: &[u8], incoming: &mut Incoming) -> (Vec<NodeBatch>, Vec<Envelope>) {
        let (mut batches, mut whole) = (Vec::new(), Vec::new());
        let mut rest = out;
        while !rest.is_empty() {
            let len = u32::from_be_bytes(rest[..4].try_into().unwrap()) as usize;
            assert!(len <= MAX_FRAME);
            let mut b = wire::decode_batch(Bytes::copy_from_slice(&rest[4..4 + len])).unwrap();
            rest = &rest[4 + len..];
            for f in std::mem::take(&mut b.forwards) {
                if f.group == super::super::PIECE {
                    whole.extend(incoming.take(f.data, Instant::now()).unwrap());
                } else {
                    b.forwards.push(f);
                }
            }
            batches.push(b);
        }
        (batches, whole)
    }

    #[test]
    fn a_snapshot_larger_than_a_frame_goes_in_pieces_between_other_frames_and_comes_back_whole() {
        const INLINE: usize = 64 << 10;
        let data = big(INLINE + 17);
        let snap = snapshot_msg(2, 70, data.clone());
        let mut b = batch(vec![(5, snap.clone()), (6, heartbeat(2))]);
        let mut out = Outgoing::new(INLINE);
        assert_eq!(out.take_large(&mut b), 0);
        assert_eq!(b.msgs.len(), 1, "the heartbeat stays in its batch");
        let mut incoming = Incoming::default();
        let mut frames = 0;
        let mut whole = Vec::new();
        while !out.is_empty() {
            // What Raft sends meanwhile goes out between the pieces.
            let mut buf = Vec::new();
            wire::encode_batch(&batch(vec![(6, heartbeat(2))]), MAX_FRAME, &mut buf);
            assert!(out.next_frame(&mut buf).0);
            let (batches, w) = receive(&buf, &mut incoming);
            assert_eq!(batches.len(), 2);
            assert_eq!(batches[0].msgs.len(), 1);
            assert!(batches[1].msgs.is_empty() && batches[1].forwards.is_empty());
            whole.extend(w);
            frames += 1;
        }
        assert_eq!(frames, data.len().div_ceil(INLINE / 4));
        // A sender that starts draining meanwhile says so in the pieces too.
        let mut later = Outgoing::new(INLINE);
        later.take_large(&mut batch(vec![(5, snap.clone())]));
        let mut draining = batch(vec![]);
        draining.draining = true;
        later.take_large(&mut draining);
        let mut buf = Vec::new();
        later.next_frame(&mut buf);
        assert!(
            wire::decode_batch(Bytes::copy_from_slice(&buf[4..]))
                .unwrap()
                .draining
        );
        assert_eq!(out.next_frame(&mut Vec::new()), (false, false));
        assert_eq!(whole.len(), 1);
        assert_eq!(whole[0].group, GroupId(5));
        assert_eq!(whole[0].msg, snap, "head and data as they were sent");
        assert_eq!(incoming.held(), 0);
    }

    /// Every frame of `out`, in order, one write each.
    fn frames_of(out: &mut Outgoing) -> Vec<Vec<u8>> {
        let mut frames = Vec::new();
        while !out.is_empty() {
            let mut buf = Vec::new();
            out.next_frame(&mut buf);
            frames.push(buf);
        }
        frames
    }

    #[test]
    fn a_spooled_link_writes_the_pieces_to_its_file_and_hands_the_snapshot_over_mapped() {
        const INLINE: usize = 64 << 10;
        let dir = tempfile::tempdir().expect("dir");
        let spool = dir.path().join("incoming");
        std::fs::create_dir_all(spool.join("left-by-a-crash")).expect("dir");
        clear_spool(&spool).expect("cleared");
        assert_eq!(std::fs::read_dir(&spool).expect("dir").count(), 0);
        let file = spool.join("2.0.part");
        let mut incoming = Incoming::spooled(file.clone(), Default::default());
        let data = big(3 * INLINE + 5);
        let snap = snapshot_msg(2, 80, data.clone());
        let mut out = Outgoing::new(INLINE);
        out.take_large(&mut batch(vec![(5, snap.clone())]));
        let frames = frames_of(&mut out);
        assert!(frames.len() > 2);
        // A link that ends before the last piece leaves no file behind.
        let mut cut = Incoming::spooled(spool.join("x"), Default::default());
        for f in &frames[..frames.len() - 1] {
            assert!(receive(f, &mut cut).1.is_empty());
        }
        assert!(spool.join("x").exists());
        drop(cut);
        assert!(!spool.join("x").exists(), "a link that ends leaves no file");
        let mut whole = Vec::new();
        for f in &frames {
            whole.extend(receive(f, &mut incoming).1);
        }
        assert_eq!(whole.len(), 1);
        assert_eq!(whole[0].msg, snap, "head and data as they were sent");
        assert!(!file.exists(), "the file goes once mapped");
        // The next message of the link takes the name again; the first stays readable.
        let second = snapshot_msg(2, 90, big(2 * INLINE));
        let mut out = Outgoing::new(INLINE);
        out.take_large(&mut batch(vec![(5, second.clone())]));
        let again: Vec<Envelope> = frames_of(&mut out)
            .iter()
            .flat_map(|f| receive(f, &mut incoming).1)
            .collect();
        assert_eq!(again.len(), 1);
        assert_eq!(again[0].msg, second);
        assert_eq!(whole[0].msg.get_snapshot().data, data);

        // A spool that cannot be written (its folder is gone): put together in memory.
        let mut lost =
            Incoming::spooled(dir.path().join("gone").join("2.1.part"), Default::default());
        let mut out = Outgoing::new(INLINE);
        out.take_large(&mut batch(vec![(5, snap.clone())]));
        let whole: Vec<Envelope> = frames_of(&mut out)
            .iter()
            .flat_map(|f| receive(f, &mut lost).1)
            .collect();
        assert_eq!(whole.len(), 1);
        assert_eq!(whole[0].msg, snap);
    }

    /// The pieces in one frame's bytes.
    fn pieces_in(frame: &[u8]) -> Vec<Bytes> {
        let len = u32::from_be_bytes(frame[..4].try_into().unwrap()) as usize;
        let b = wire::decode_batch(Bytes::copy_from_slice(&frame[4..4 + len])).unwrap();
        b.forwards
            .into_iter()
            .filter(|f| f.group == super::super::PIECE)
            .map(|f| f.data)
            .collect()
    }

    #[test]
    fn a_spooled_message_dropped_on_an_error_or_replaced_leaves_no_file() {
        const INLINE: usize = 64 << 10;
        let dir = tempfile::tempdir().expect("dir");
        let file = dir.path().join("2.0.part");
        let mut incoming = Incoming::spooled(file.clone(), Default::default());
        let mut out = Outgoing::new(INLINE);
        out.take_large(&mut batch(vec![(5, snapshot_msg(2, 80, big(3 * INLINE)))]));
        let frames = frames_of(&mut out);
        assert!(frames.len() >= 3);
        for p in pieces_in(&frames[0]) {
            assert!(incoming.take(p, Instant::now()).expect("taken").is_none());
        }
        assert!(file.exists());
        // A piece that does not follow: the link is dropped, and the file goes.
        let skipped = pieces_in(&frames[2]).remove(0);
        assert!(incoming.take(skipped, Instant::now()).is_err());
        assert!(!file.exists(), "dropped on an error");
        // A new first piece replaces an unfinished message, file and all.
        for p in pieces_in(&frames[0]) {
            incoming.take(p, Instant::now()).expect("taken");
        }
        assert!(file.exists());
        let mut other = Outgoing::new(INLINE);
        other.take_large(&mut batch(vec![(6, snapshot_msg(2, 9, big(2 * INLINE)))]));
        let whole: Vec<Envelope> = frames_of(&mut other)
            .iter()
            .flat_map(|f| receive(f, &mut incoming).1)
            .collect();
        assert_eq!(whole.len(), 1);
        assert!(!file.exists());
        assert_eq!(std::fs::read_dir(dir.path()).expect("dir").count(), 0);
    }

    #[test]
    fn a_message_with_no_room_on_the_disk_and_too_large_for_memory_is_dropped_never_held() {
        const INLINE: usize = 64 << 10;
        let dir = tempfile::tempdir().expect("dir");
        let file = dir.path().join("2.0.part");
        let data = big(3 * INLINE);
        let mut out = Outgoing::new(INLINE);
        out.take_large(&mut batch(vec![(5, snapshot_msg(2, 80, data.clone()))]));
        let frames = frames_of(&mut out);
        let pieces: Vec<Bytes> = frames.iter().flat_map(|f| pieces_in(f)).collect();
        assert!(pieces.len() >= 3);
        // The messages made whole, and the most bytes held in memory meanwhile.
        let feed_held = |incoming: &mut Incoming| {
            let (mut whole, mut held) = (Vec::new(), 0);
            for p in &pieces {
                whole.extend(incoming.take(p.clone(), Instant::now()).expect("taken"));
                let parts = incoming.partial.as_ref().map(|p| &p.parts);
                held = parts
                    .map_or(0, |v| v.iter().map(Bytes::len).sum::<usize>())
                    .max(held);
            }
            (whole, held)
        };
        let feed = |incoming: &mut Incoming| {
            let (whole, held) = feed_held(incoming);
            assert!(held <= incoming.memory_max, "{held} in memory");
            whole
        };
        // The disk has room for what a small node writes, not for the message beside it.
        let mut full = Incoming::spooled(file.clone(), Default::default());
        full.free_disk = |_| Some(SPOOL_MARGIN + INLINE as u64);
        full.memory_max = 2 * INLINE;
        let (whole, held) = feed_held(&mut full);
        assert!(
            whole.is_empty() && held == 0,
            "dropped, nothing held: {held}"
        );
        assert!(!file.exists());
        // Sent again, it is dropped again: it never came whole, so it is not a copy.
        let (whole, held) = feed_held(&mut full);
        assert!(whole.is_empty() && held == 0);
        // Small enough for memory, it comes whole from there.
        full.memory_max = 4 * INLINE;
        let whole = feed(&mut full);
        assert_eq!(whole.len(), 1);
        assert_eq!(whole[0].msg.get_snapshot().data, data);
        // With room on the disk for it twice (the spool, then the snapshot written from it),
        // any size is spooled; the room is given back once it is whole.
        let spooling = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let mut room = Incoming::spooled(file.clone(), spooling.clone());
        room.free_disk = |_| Some(SPOOL_MARGIN + (6 * INLINE) as u64);
        room.memory_max = 0;
        let whole = feed(&mut room);
        assert_eq!(whole.len(), 1);
        assert_eq!(whole[0].msg.get_snapshot().data, data);
        assert_eq!(spooling.load(std::sync::atomic::Ordering::Relaxed), 0);
        // Two links of the node receiving at once count the same free space once: the second
        // finds it taken by the first, and drops its message.
        let mut first = Incoming::spooled(dir.path().join("2.1.part"), spooling.clone());
        first.free_disk = room.free_disk;
        first.memory_max = 0;
        let mut other = Incoming::spooled(dir.path().join("3.1.part"), spooling.clone());
        other.free_disk = room.free_disk;
        other.memory_max = 0;
        assert!(first
            .take(pieces[0].clone(), Instant::now())
            .expect("taken")
            .is_none());
        assert!(first.partial.as_ref().is_some_and(|p| p.file.is_some()));
        let (got, held) = feed_held(&mut other);
        assert!(
            got.is_empty() && held == 0,
            "the second link has no room: dropped"
        );
        let mut whole = Vec::new();
        for p in &pieces[1..] {
            whole.extend(first.take(p.clone(), Instant::now()).expect("taken"));
        }
        assert_eq!(whole.len(), 1, "the first link's message came whole");
        assert_eq!(spooling.load(std::sync::atomic::Ordering::Relaxed), 0);
        // An unknown free space (a file system that does not say) does not stop the spool.
        let mut unknown = Incoming::spooled(file, Default::default());
        unknown.free_disk = |_| None;
        unknown.memory_max = 0;
        assert_eq!(feed(&mut unknown).len(), 1);
    }

    #[test]
    fn a_spool_that_fails_half_way_goes_on_in_memory_with_what_it_held() {
        let dir = tempfile::tempdir().expect("dir");
        let mut file = open_spool(&dir.path().join("p")).expect("file");
        std::io::Write::write_all(&mut file, b"first piece, and half a second").expect("write");
        let mut p = Partial {
            group: 5,
            total: 40,
            head: heartbeat(2),
            parts: Vec::new(),
            file: Some(file),
            have: 12,
            again: false,
            _reserved: None,
        };
        // What the file holds past the pieces taken (a write cut short) is not theirs.
        back_to_memory(&mut p).expect("read back");
        assert!(p.file.is_none());
        assert_eq!(p.parts, vec![Bytes::from_static(b"first piece,")]);
        // A file that lost pieces is an error, never a message with holes.
        let mut short = Partial {
            file: Some(open_spool(&dir.path().join("q")).expect("file")),
            parts: Vec::new(),
            ..p
        };
        assert!(back_to_memory(&mut short).is_err());
    }

    #[test]
    fn a_snapshot_that_fits_a_frame_stays_in_its_batch() {
        let mut b = batch(vec![(5, snapshot_msg(2, 7, big(1000)))]);
        let mut out = Outgoing::default();
        assert_eq!(out.take_large(&mut b), 0);
        assert_eq!(b.msgs.len(), 1);
        assert!(out.is_empty());
    }

    #[test]
    fn a_second_snapshot_of_a_group_waiting_for_its_peer_is_dropped_and_the_first_goes_on() {
        let data = big(4097);
        let mut out = Outgoing::new(4096);
        let mut b = batch(vec![(5, snapshot_msg(2, 70, data.clone()))]);
        assert_eq!(out.take_large(&mut b), 0);
        let mut incoming = Incoming::default();
        let mut buf = Vec::new();
        assert_eq!(out.next_frame(&mut buf), (true, false));
        receive(&buf, &mut incoming);
        let mut again = batch(vec![
            (5, snapshot_msg(2, 80, data.clone())),
            (8, snapshot_msg(2, 3, data.clone())),
        ]);
        assert_eq!(out.take_large(&mut again), 1, "group 5's second is dropped");
        let mut whole = Vec::new();
        while !out.is_empty() {
            let mut buf = Vec::new();
            out.next_frame(&mut buf);
            whole.extend(receive(&buf, &mut incoming).1);
        }
        let got: Vec<(u64, u64)> = whole
            .iter()
            .map(|e| (e.group.0, e.msg.get_snapshot().get_metadata().index))
            .collect();
        assert_eq!(got, vec![(5, 70), (8, 3)]);
    }

    #[test]
    fn a_piece_out_of_turn_is_an_error_and_a_first_piece_starts_over() {
        let data = big(4 * 1024 + 1);
        let mut send = Outgoing::new(4096);
        assert_eq!(
            send.take_large(&mut batch(vec![(5, snapshot_msg(2, 70, data.clone()))])),
            0
        );
        let mut pieces = Vec::new();
        while !send.is_empty() {
            let mut buf = Vec::new();
            send.next_frame(&mut buf);
            let mut b = wire::decode_batch(Bytes::copy_from_slice(&buf[4..])).unwrap();
            pieces.push(b.forwards.remove(0).data);
        }
        assert_eq!(pieces.len(), 5);
        // The second piece first: nothing to follow.
        let t0 = Instant::now();
        let mut incoming = Incoming::default();
        assert!(incoming.take(pieces[1].clone(), t0).is_err());
        // A first piece, then the first piece again (the sender started over), then the rest.
        assert!(incoming.take(pieces[0].clone(), t0).unwrap().is_none());
        assert!(incoming.take(pieces[0].clone(), t0).unwrap().is_none());
        assert!(incoming.take(pieces[2].clone(), t0).is_err(), "a gap");
        assert_eq!(incoming.held(), 0);
        for p in &pieces[..4] {
            assert!(incoming.take(p.clone(), t0).unwrap().is_none());
        }
        let whole = incoming.take(pieces[4].clone(), t0).unwrap().unwrap();
        assert_eq!(whole.msg.get_snapshot().data, data);
        // The same snapshot again soon after: checked, not held or handed over again; later,
        // it is (the first may not have done).
        let again = |incoming: &mut Incoming, at| {
            let mut got = None;
            for p in &pieces {
                got = incoming.take(p.clone(), at).unwrap();
            }
            got
        };
        assert!(again(&mut incoming, t0 + Duration::from_secs(1)).is_none());
        assert_eq!(incoming.held(), 0);
        let later = again(&mut incoming, t0 + AGAIN_AFTER).expect("whole again");
        assert_eq!(later.msg, whole.msg);
    }

    #[test]
    fn every_damaged_piece_is_an_error_never_a_panic() {
        let data = big(2 * 4096 + 5);
        let mut send = Outgoing::new(4096);
        send.take_large(&mut batch(vec![(5, snapshot_msg(2, 70, data))]));
        let mut buf = Vec::new();
        send.next_frame(&mut buf);
        let mut b = wire::decode_batch(Bytes::copy_from_slice(&buf[4..])).unwrap();
        let first = b.forwards.remove(0).data;
        let t0 = Instant::now();
        for cut in 0..PIECE_HEADER + 64 {
            let _ = Incoming::default().take(first.slice(..cut), t0);
        }
        let mut huge = first.to_vec();
        huge[8..16].copy_from_slice(&(MAX_PIECED as u64 + 1).to_be_bytes());
        assert!(Incoming::default().take(huge.into(), t0).is_err());
        let mut long_head = first.to_vec();
        long_head[24..28].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(Incoming::default().take(long_head.into(), t0).is_err());
        let mut short_total = first.to_vec();
        short_total[8..16].copy_from_slice(&10u64.to_be_bytes());
        assert!(Incoming::default().take(short_total.into(), t0).is_err());
    }
}
