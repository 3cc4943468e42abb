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

use warren_queue::{AwayStore, Message};

use super::{persistence::keep, Broker, QueueId};
use crate::replica::Mode;

/// Fewer new messages than this past the window wait for the next pass: each pass is one
/// write to the store.
const AWAY_BATCH: usize = 256;

/// At most this many messages, and this many bytes of their contents, go in one write.
const AWAY_PASS_MESSAGES: usize = 4096;
const AWAY_PASS_BYTES: u64 = 16 << 20;
/// Passes one call makes at most.
const AWAY_PASSES: usize = 16;
/// After a failed write, the next is tried this much later (a full disk is not retried at
/// every entry).
const AWAY_RETRY_MS: u64 = 1_000;

/// The broker's [`AwayStore`] (a wrapper, so the broker stays `Debug`).
pub(super) struct AwayHandle {
    store: Arc<dyn AwayStore>,
    /// A write failed (logged once): none is tried before this time.
    retry_at: Option<u64>,
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
        });
    }

    /// Messages of replicated queues whose contents are out of this node's memory.
    pub fn messages_away(&self) -> u64 {
        self.away.as_ref().map_or(0, |a| a.store.held())
    }

    /// Sends the contents of the replicated queue's ready messages past its window away, once
    /// enough new ones arrived there: in passes of at most [`AWAY_PASS_MESSAGES`] messages and
    /// [`AWAY_PASS_BYTES`], up to [`AWAY_PASSES`] of them a call (a queue restored whole from a
    /// snapshot goes out over the calls that follow, never in one buffer the size of the queue).
    /// A failed write leaves them in memory; writes are tried again [`AWAY_RETRY_MS`] later.
    pub(super) fn send_away(&mut self, id: QueueId) {
        for _ in 0..AWAY_PASSES {
            if !self.send_away_pass(id) {
                return;
            }
        }
    }

    /// One pass of [`Broker::send_away`]; true if it wrote a full pass (more may wait).
    fn send_away_pass(&mut self, id: QueueId) -> bool {
        let now = self.now_ms;
        let Some(handle) = self.away.as_mut() else {
            return false;
        };
        if handle.retry_at.is_some_and(|at| now < at) {
            return false;
        }
        let Some(q) = self.queues.get_mut(&id) else {
            return false;
        };
        let count = keep(&self.config, q) as usize;
        let Some(r) = q.replica.as_mut() else {
            return false;
        };
        if q.machine.head_after(r.away_through) < AWAY_BATCH {
            return false;
        }
        let kept = q.machine.head_within(count, self.config.page_window_bytes);
        // The window's messages stay; the passes that follow look past them.
        if let Some(last) = kept.checked_sub(1).and_then(|p| q.machine.head_id(p)) {
            r.away_through = r.away_through.max(last);
        }
        let from = r.away_through;
        let store = handle.store.clone();
        let mut copies: Vec<(u64, Message)> = Vec::new();
        let (mut last, mut bytes, mut full) = (from, 0u64, false);
        for (msg_id, m) in q.machine.head_payloads_mut(kept, from) {
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
            r.away_through = last;
            return false;
        }
        let items: Vec<&Message> = copies.iter().map(|(_, m)| m).collect();
        let written = store
            .put(&items)
            .and_then(|keys| match keys.len() == items.len() {
                true => Ok(keys),
                false => Err(format!("{} keys for {} messages", keys.len(), items.len())),
            });
        let keys = match written {
            Ok(keys) => keys,
            Err(error) => {
                if handle.retry_at.is_some() {
                    tracing::debug!(queue = %q.name, %error, "writing messages' contents away failed again");
                } else {
                    tracing::warn!(queue = %q.name, vhost = %q.vhost, %error, "writing a deep replicated queue's messages out of memory failed: they stay in memory, tried again in a second");
                }
                handle.retry_at = Some(now.saturating_add(AWAY_RETRY_MS));
                return false;
            }
        };
        handle.retry_at = None;
        r.away_through = last;
        let stubs: Vec<(u64, Message)> = copies
            .into_iter()
            .zip(keys)
            .map(|((msg_id, m), key)| (msg_id, m.away_stub(key, store.clone())))
            .collect();
        if let Mode::Leading { committed } = &mut r.mode {
            // The committed machine holds the same messages (or will, once their entries
            // commit, from this machine's copies).
            committed.share_head_payloads(&stubs);
        }
        let mut stubs = stubs.into_iter().peekable();
        for (msg_id, m) in q.machine.head_payloads_mut(kept, from) {
            if msg_id > last {
                break;
            }
            if stubs.peek().is_some_and(|(id, _)| *id == msg_id) {
                if let Some((_, stub)) = stubs.next() {
                    *m = stub;
                }
            }
        }
        full
    }
}
