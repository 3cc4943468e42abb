//! A deep replicated queue keeps its messages' contents out of memory on every member.
//!
//! A classic queue pages whole entries out in runs; a replicated queue cannot, since where a run
//! expires would depend on what each member paged (docs/design.md, §9). So a member keeps every
//! message's logical part in its machine (id, size, expiry, priority, group, delivery count)
//! and lets only the contents go: past the queue's window, the exchange, routing key,
//! properties and body of each ready message are written to this node's [`AwayStore`] and the
//! machine's copy becomes a stub that equals the message ([`Message::away_stub`]). Nothing
//! replicated changes: the log, digests and snapshots are the same on every member whatever
//! each one sent away. A delivery to a client of this node and a dead letter read the contents
//! back ([`Message::load`]); a snapshot writes them whole. The contents are released when the
//! last copy of the stub drops (both machines of a leader share it).

use std::sync::Arc;

use warren_queue::machine::QueueMachine;
use warren_queue::{AwayStore, Message};

use super::persistence::{keep, window_of};
use super::{Broker, QueueId};
use crate::replica::Mode;

/// Fewer new messages than this past the window wait for the next pass: each pass is one
/// write to the store.
const AWAY_BATCH: usize = 256;

/// At most this many messages, and this many bytes of their contents, go in one write.
const AWAY_PASS_MESSAGES: usize = 4096;
const AWAY_PASS_BYTES: u64 = 16 << 20;
/// Passes one call makes at most.
const AWAY_PASSES: usize = 16;
/// Passes a call from [`Broker::tick`] makes at most: it holds the node as an entry's does,
/// and comes back every [`AWAY_CONTINUE_MS`] while there is more.
const CONTINUE_PASSES: usize = 4;
/// After a failed write, the next is tried this much later (a full disk is not retried at
/// every entry).
const AWAY_RETRY_MS: u64 = 1_000;
/// A queue with more to send away than one call does goes on this much later, from
/// [`Broker::tick`], whether or not anything touches it (a queue restored from its log at a
/// start, then idle): the node's other work runs in between.
const AWAY_CONTINUE_MS: u64 = 10;

/// The broker's [`AwayStore`] (a wrapper, so the broker stays `Debug`).
pub(super) struct AwayHandle {
    store: Arc<dyn AwayStore>,
    /// A write failed (logged once): none is tried before this time.
    retry_at: Option<u64>,
    /// Queues whose last call stopped with more to send (its passes' limit, or a failed
    /// write): [`Broker::continue_away`] goes on with them.
    pending: std::collections::BTreeSet<QueueId>,
}

impl std::fmt::Debug for AwayHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AwayHandle")
    }
}

impl Broker {
    /// Gives the broker where deep replicated queues' messages go when they leave memory; from
    /// then on each member keeps only what its queues' machines read of the messages past the
    /// window (`page_window`, `page_window_bytes`).
    pub fn set_away_store(&mut self, store: Arc<dyn AwayStore>) {
        self.away = Some(AwayHandle {
            store,
            retry_at: None,
            pending: std::collections::BTreeSet::new(),
        });
    }

    /// Messages of replicated queues whose contents are out of this node's memory.
    pub fn messages_away(&self) -> u64 {
        self.away.as_ref().map_or(0, |a| a.store.held())
    }

    /// Sends the contents of the replicated queue's ready messages past its window away, once
    /// enough new ones arrived there: in passes of at most [`AWAY_PASS_MESSAGES`] messages and
    /// [`AWAY_PASS_BYTES`], up to [`AWAY_PASSES`] of them a call (never one buffer the size of
    /// the queue); what is left waits for the next call or [`Broker::continue_away`]'s. A
    /// failed write leaves them in memory; writes are tried again [`AWAY_RETRY_MS`] later.
    pub(super) fn send_away(&mut self, id: QueueId) {
        self.send_away_up_to(id, AWAY_PASSES);
    }

    fn send_away_up_to(&mut self, id: QueueId, passes: usize) {
        let mut step = Step::More;
        for _ in 0..passes {
            step = self.send_away_pass(id);
            if step != Step::More {
                break;
            }
        }
        if let Some(h) = self.away.as_mut() {
            if step == Step::Done {
                h.pending.remove(&id);
            } else {
                h.pending.insert(id);
            }
        }
    }

    /// From [`Broker::tick`]: the next queue left with more to send away goes on (one a
    /// call), once a failed write's pause is over.
    pub(super) fn continue_away(&mut self) {
        let now = self.now_ms;
        let Some(h) = self.away.as_mut() else {
            return;
        };
        if h.retry_at.is_some_and(|at| now < at) {
            return;
        }
        if let Some(id) = h.pending.pop_first() {
            self.send_away_up_to(id, CONTINUE_PASSES);
        }
    }

    /// When [`Broker::continue_away`] has work, if ever.
    pub(super) fn away_deadline(&self) -> Option<u64> {
        let h = self.away.as_ref().filter(|h| !h.pending.is_empty())?;
        let soon = self.now_ms.saturating_add(AWAY_CONTINUE_MS);
        Some(h.retry_at.map_or(soon, |at| at.max(soon)))
    }

    /// What a snapshot's decoder needs to send a deep queue's contents away before the queue
    /// is installed ([`crate::DecodedSnapshot::decode_with`]); `None` without an away store.
    pub fn away_context(&self) -> Option<AwayContext> {
        self.away.as_ref().map(|a| AwayContext {
            store: a.store.clone(),
            window: self.config.page_window,
            window_idle: self.config.page_window_idle,
            window_bytes: self.config.page_window_bytes,
        })
    }

    /// One pass of [`Broker::send_away`].
    fn send_away_pass(&mut self, id: QueueId) -> Step {
        let now = self.now_ms;
        let Some(handle) = self.away.as_mut() else {
            return Step::Done;
        };
        let Some(q) = self.queues.get_mut(&id) else {
            return Step::Done;
        };
        let count = keep(&self.config, q) as usize;
        let Some(r) = q.replica.as_mut() else {
            return Step::Done;
        };
        if q.machine.head_after(r.away_through) < AWAY_BATCH {
            return Step::Done;
        }
        if handle.retry_at.is_some_and(|at| now < at) {
            return Step::Later;
        }
        let kept = q.machine.head_within(count, self.config.page_window_bytes);
        // The window's messages stay; the passes that follow look past them.
        if let Some(last) = kept.checked_sub(1).and_then(|p| q.machine.head_id(p)) {
            r.away_through = r.away_through.max(last);
        }
        let from = r.away_through;
        let pass = match pass(&mut q.machine, &handle.store, kept, from) {
            Ok(pass) => pass,
            Err(error) => {
                if handle.retry_at.is_some() {
                    tracing::debug!(queue = %q.name, %error, "writing messages' contents away failed again");
                } else {
                    tracing::warn!(queue = %q.name, vhost = %q.vhost, %error, "writing a deep replicated queue's messages out of memory failed: they stay in memory, tried again in a second");
                }
                handle.retry_at = Some(now.saturating_add(AWAY_RETRY_MS));
                return Step::Later;
            }
        };
        handle.retry_at = None;
        r.away_through = pass.last;
        if let Mode::Leading { committed } = &mut r.mode {
            // The committed machine holds the same messages (or will, once their entries
            // commit, from this machine's copies).
            committed.share_head_payloads(&pass.stubs);
        }
        if pass.full {
            Step::More
        } else {
            Step::Done
        }
    }
}

/// Where one pass of [`Broker::send_away`] left a queue.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Step {
    /// Nothing more past the window to send (or no such queue).
    Done,
    /// It wrote a full pass: more may wait.
    More,
    /// A write failed, now or less than [`AWAY_RETRY_MS`] ago: tried again after that.
    Later,
}

/// What [`Broker::away_context`] gives a snapshot's decoder: the store, and the windows
/// (`--queue-window`) a queue keeps in memory with consumers and without.
#[derive(Clone)]
pub struct AwayContext {
    store: Arc<dyn AwayStore>,
    window: u32,
    window_idle: u32,
    window_bytes: u64,
}

impl std::fmt::Debug for AwayContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AwayContext")
            .field("window", &self.window)
            .field("window_idle", &self.window_idle)
            .field("window_bytes", &self.window_bytes)
            .finish()
    }
}

impl AwayContext {
    /// A replicated queue's machine just read from a snapshot, before the broker takes it:
    /// the contents of its ready messages past the window go away, all of them, in passes
    /// (off the broker's thread: this runs where the snapshot is decoded), and what stays in
    /// memory is copied out of the snapshot's buffer, which every message read from it
    /// slices: otherwise the window's few messages would keep the whole snapshot (up to a GiB)
    /// alive, for as long as the queue is idle. Not copied when what stays is more than a
    /// quarter of the snapshot's `bytes` (a priority queue's messages, which do not leave
    /// memory yet): the copies would only double the peak. If a write fails, the rest stays
    /// as it was (in memory, the buffer kept): the broker's own passes try again later.
    pub fn send_restored_away(&self, machine: &mut QueueMachine<Message>, bytes: u64) {
        let count = window_of(machine, self.window, self.window_idle) as usize;
        let kept = machine.head_within(count, self.window_bytes);
        let mut from = kept
            .checked_sub(1)
            .and_then(|p| machine.head_id(p))
            .unwrap_or(0);
        loop {
            match pass(machine, &self.store, kept, from) {
                Ok(p) => {
                    from = p.last;
                    if !p.full {
                        break;
                    }
                }
                Err(error) => {
                    tracing::warn!(%error, "writing the messages of a replicated queue read from a snapshot out of memory failed: they stay in memory for now");
                    return;
                }
            }
        }
        let staying: u64 = machine
            .messages()
            .map(|(_, m, _)| m)
            .chain(machine.held_messages())
            .map(|m| m.contents_len() as u64)
            .sum();
        if staying.saturating_mul(4) <= bytes {
            for m in machine.messages_mut() {
                m.detach();
            }
        }
    }
}

/// What one pass wrote: its messages' stubs (already in the machine), the last message id it
/// considered, and whether it stopped at its limits (more may wait).
struct Pass {
    stubs: Vec<(u64, Message)>,
    last: u64,
    full: bool,
}

/// Writes the contents of up to [`AWAY_PASS_MESSAGES`] ready messages (and
/// [`AWAY_PASS_BYTES`]) past the first `kept` of the line and past id `from` to `store`, and
/// swaps their stubs into `machine`. Nothing changes if the write fails.
fn pass(
    machine: &mut QueueMachine<Message>,
    store: &Arc<dyn AwayStore>,
    kept: usize,
    from: u64,
) -> Result<Pass, String> {
    let mut copies: Vec<(u64, Message)> = Vec::new();
    let (mut last, mut bytes, mut full) = (from, 0u64, false);
    for (msg_id, m) in machine.head_payloads_mut(kept, from) {
        if copies.len() >= AWAY_PASS_MESSAGES || bytes >= AWAY_PASS_BYTES {
            full = true;
            break;
        }
        last = msg_id;
        if !m.is_away() {
            bytes += m.body.len() as u64 + m.properties.len() as u64;
            copies.push((msg_id, m.clone()));
        }
    }
    if copies.is_empty() {
        return Ok(Pass {
            stubs: Vec::new(),
            last,
            full: false,
        });
    }
    let items: Vec<&Message> = copies.iter().map(|(_, m)| m).collect();
    let keys = store
        .put(&items)
        .and_then(|keys| match keys.len() == items.len() {
            true => Ok(keys),
            false => Err(format!("{} keys for {} messages", keys.len(), items.len())),
        })?;
    let stubs: Vec<(u64, Message)> = copies
        .into_iter()
        .zip(keys)
        .map(|((msg_id, m), key)| (msg_id, m.away_stub(key, store.clone())))
        .collect();
    let mut next = stubs.iter().peekable();
    for (msg_id, m) in machine.head_payloads_mut(kept, from) {
        if msg_id > last {
            break;
        }
        if next.peek().is_some_and(|(id, _)| *id == msg_id) {
            if let Some((_, stub)) = next.next() {
                *m = stub.clone();
            }
        }
    }
    Ok(Pass { stubs, last, full })
}
