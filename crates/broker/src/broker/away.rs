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
use warren_queue::{AwayStore, AwayStoreHandle, Message, Payload};

use super::persistence::{keep, window_of};
use super::{Broker, QueueId};
use crate::queue::Queue;
use crate::replica::{Mode, ReplicaState, Rounds};
use warren_codec::ShortStr;

/// Fewer new messages than this past the window wait for the next pass: each pass is one
/// write to the store.
const AWAY_BATCH: usize = 256;

/// At most this many messages, and this many bytes of their contents, go in one write.
const AWAY_PASS_MESSAGES: usize = 4096;
const AWAY_PASS_BYTES: u64 = 16 << 20;
/// A pass looks at no more messages than this, away or not.
const AWAY_PASS_WALK: usize = 8 * AWAY_PASS_MESSAGES;
/// A round over a queue's messages waiting for a retry begins at most this often: they come
/// and go in no order a round could follow, so each round walks them all.
const RETRY_ROUND_MS: u64 = 1_000;
/// Passes one call makes at most.
const AWAY_PASSES: usize = 16;
/// After entries were applied, a queue's passes go on as many times as a pass's messages of
/// this many bytes each would fill those entries' bytes (at least [`AWAY_PASSES`]): a restart
/// replays its log, and a member catches up, a ready of up to `max_committed_size_per_ready`
/// twice a Raft pass, and with a fixed number of passes a call the rest waited, whole, each
/// entry's buffer held by its messages, while the next came in. Proportional, not unbounded:
/// an ordinary apply makes the passes it made before.
const AWAY_APPLIED_BYTES_PER_MESSAGE: usize = 64;
/// Packed runs at the head of a deep line that stay in memory beyond those the window may
/// reach: the next messages a consumer takes. The runs past them are written out of memory
/// (`spill_line`) and read back, a run at a time, as they reach the head.
const SPILL_KEEP_RUNS: usize = 2;

/// The packed runs a queue keeping `window` messages in memory keeps unspilled: each pass
/// looks that far down the line (`head_within`), and never reads a run back to do so.
fn spill_keep(window: usize) -> usize {
    SPILL_KEEP_RUNS + window.div_ceil(warren_queue::machine::PACKED_RUN)
}
/// A shorter run stays in memory (a record is not worth it).
const SPILL_MIN: usize = 256;
/// Every this many rounds over a queue's held publishes walks them all (the others walk what
/// came past the last round's end).
const FULL_ROUND_EVERY: u32 = 16;
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
    store: AwayStoreHandle,
    /// A write failed (logged once): none is tried before this time.
    retry_at: Option<u64>,
    /// Queues whose last call stopped with more to send (its passes' limit, or a failed
    /// write): [`Broker::continue_away`] goes on with them.
    pending: std::collections::BTreeSet<QueueId>,
    /// Queues with a round to begin at a time (over their messages waiting for a retry), and
    /// that time: [`Broker::continue_away`] begins it then, touched or not.
    scheduled: std::collections::BTreeMap<QueueId, u64>,
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
            store: AwayStoreHandle::new(store),
            retry_at: None,
            pending: std::collections::BTreeSet::new(),
            scheduled: std::collections::BTreeMap::new(),
        });
    }

    /// Messages of replicated queues whose contents are out of this node's memory.
    pub fn messages_away(&self) -> u64 {
        self.away.as_ref().map_or(0, |a| a.store.held())
    }

    /// Messages of replicated queues whose packed entries are out of this node's memory too,
    /// in runs (`spill_line`), counted in each queue's machine (a leader's committed one shares
    /// its runs).
    pub fn messages_spilled(&self) -> u64 {
        self.queues
            .values()
            .filter(|q| q.replica.is_some())
            .map(|q| q.machine.spilled_count() as u64)
            .sum()
    }

    /// Sends the contents of the replicated queue's ready messages past its window away, once
    /// enough new ones arrived there: in passes of at most [`AWAY_PASS_MESSAGES`] messages and
    /// [`AWAY_PASS_BYTES`], up to [`AWAY_PASSES`] of them a call (never one buffer the size of
    /// the queue); what is left waits for the next call or [`Broker::continue_away`]'s. A
    /// failed write leaves them in memory; writes are tried again [`AWAY_RETRY_MS`] later.
    pub(super) fn send_away(&mut self, id: QueueId) {
        self.send_away_up_to(id, AWAY_PASSES);
    }

    /// [`Broker::send_away`] after `bytes` of entries were applied to the queue: enough passes
    /// for what they can have brought past the window ([`AWAY_APPLIED_BYTES_PER_MESSAGE`]).
    pub(super) fn send_away_applied(&mut self, id: QueueId, bytes: usize) {
        let passes = bytes / (AWAY_PASS_MESSAGES * AWAY_APPLIED_BYTES_PER_MESSAGE) + 1;
        self.send_away_up_to(id, passes.max(AWAY_PASSES));
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
            match step {
                Step::Done => {
                    h.pending.remove(&id);
                }
                Step::At(at) => {
                    h.pending.remove(&id);
                    h.scheduled.insert(id, at);
                }
                Step::More | Step::Later => {
                    h.pending.insert(id);
                }
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
        let due = h
            .scheduled
            .iter()
            .find(|(_, at)| **at <= now)
            .map(|(id, _)| *id);
        if let Some(id) = due {
            h.scheduled.remove(&id);
            self.send_away_up_to(id, CONTINUE_PASSES);
        } else if let Some(id) = h.pending.pop_first() {
            self.send_away_up_to(id, CONTINUE_PASSES);
        }
    }

    /// When [`Broker::continue_away`] has work, if ever.
    pub(super) fn away_deadline(&self) -> Option<u64> {
        let h = self.away.as_ref()?;
        // Nothing goes on before a failed write's pause is over.
        let after_pause = |t: u64| h.retry_at.map_or(t, |at| at.max(t));
        let scheduled = h.scheduled.values().min().copied().map(after_pause);
        let pending = (!h.pending.is_empty())
            .then(|| after_pause(self.now_ms.saturating_add(AWAY_CONTINUE_MS)));
        match (scheduled, pending) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
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

    /// One pass of [`Broker::send_away`]: the ready line's; once it has nothing to send, the
    /// held publishes'; once they have none, the retries'.
    fn send_away_pass(&mut self, id: QueueId) -> Step {
        let now = self.now_ms;
        let Some(handle) = self.away.as_mut() else {
            return Step::Done;
        };
        let Some(q) = self.queues.get_mut(&id) else {
            return Step::Done;
        };
        let count = keep(&self.config, q) as usize;
        let window_bytes = self.config.page_window_bytes;
        match ready_away_pass(handle, q, count, window_bytes, now) {
            Step::Done => {}
            step => return step,
        }
        match held_away_pass(handle, q, count, now) {
            Step::Done => {}
            step => return step,
        }
        // Rounds over the parts that come and go: a round not due yet leaves the next part
        // its turn.
        let mut next: Option<u64> = None;
        let mut later = |step: Step| match step {
            Step::Done => None,
            Step::At(at) => {
                next = Some(next.map_or(at, |n| n.min(at)));
                None
            }
            step => Some(step),
        };
        if let Some(step) = later(line_away_pass(&RETRYING, handle, q, count, now)) {
            return step;
        }
        if let Some(step) = later(line_away_pass(&RETURNED, handle, q, count, now)) {
            return step;
        }
        if let Some(step) = later(line_away_pass(&PARKED, handle, q, count, now)) {
            return step;
        }
        if let Some(step) = later(line_away_pass(&IN_FLIGHT, handle, q, count, now)) {
            return step;
        }
        next.map_or(Step::Done, Step::At)
    }
}

/// A pass over the ready line past the window ([`Broker::send_away`]).
fn ready_away_pass(
    handle: &mut AwayHandle,
    q: &mut Queue,
    count: usize,
    window_bytes: u64,
    now: u64,
) -> Step {
    let Some(r) = q.replica.as_mut() else {
        return Step::Done;
    };
    if q.machine.head_after(r.away_through) < AWAY_BATCH {
        return Step::Done;
    }
    let kept = q.machine.head_within(count, window_bytes);
    // The window's messages stay; the passes that follow look past them.
    if let Some(last) = kept.checked_sub(1).and_then(|p| q.machine.head_id(p)) {
        r.away_through = r.away_through.max(last);
    }
    let from = r.away_through;
    let Some(pass) = attempt(handle, &mut q.machine, (&q.name, &q.vhost), now, |m, s| {
        pass(m, s, kept, from)
    }) else {
        return Step::Later;
    };
    r.away_through = pass.last;
    // What is away past the window keeps a few words a message (`pack_line`), and the
    // runs of them past the first few none (`spill_line`).
    let keep_runs = spill_keep(count);
    if let Mode::Leading { committed } = &mut r.mode {
        // The committed machine holds the same messages (or will, once their entries
        // commit, from this machine's copies).
        committed.share_head_payloads(&pass.stubs);
        committed.pack_line(kept, pass.last);
        q.machine.pack_line(kept, pass.last);
        // This machine spills what the committed one holds too (it takes each message's
        // handle from this one as its entry commits), which shares the runs spilled.
        q.machine
            .spill_line_with(keep_runs, SPILL_MIN, committed.next_msg_id(), None);
        committed.spill_line_with(keep_runs, SPILL_MIN, u64::MAX, Some(&q.machine));
    } else {
        q.machine.pack_line(kept, pass.last);
        q.machine.spill_line(keep_runs, SPILL_MIN);
    }
    pass.step()
}

/// A pass over the publishes the queue holds until due ([`Command::EnqueueWith`]): those
/// due soonest stay (as many as the window keeps of the line), the others' contents leave
/// memory as a ready message's do. They are held by due time, so a new one may come
/// anywhere among them: once [`AWAY_BATCH`] came since the last round, a round walks
/// them, a pass at a time. A queue's own delay puts new ones after those held before, so
/// most rounds walk only what is held past where the last one ended; every
/// [`FULL_ROUND_EVERY`]th walks them all, for those held for less than the rest (without
/// it, each round walked every held publish: 14 s of a test's 17 for 262,144 of them).
///
/// [`Command::EnqueueWith`]: warren_queue::machine::Command::EnqueueWith
fn held_away_pass(handle: &mut AwayHandle, q: &mut Queue, count: usize, now: u64) -> Step {
    let Some(r) = q.replica.as_mut() else {
        return Step::Done;
    };
    let h = &mut r.held_away;
    let seq = q.machine.held_seq();
    if seq < h.seen {
        // The held line was empty since: counted afresh.
        *h = Default::default();
    }
    let after = match h.round {
        Some(after) => after,
        None => {
            if seq - h.seen < AWAY_BATCH as u64 || q.machine.held_count().0 <= count {
                return Step::Done;
            }
            // What is held from now on counts towards the next round.
            h.seen = seq;
            h.rounds = h.rounds.wrapping_add(1);
            let from = match h.rounds % FULL_ROUND_EVERY {
                0 => None,
                _ => h.mark,
            };
            h.round = Some(from);
            from
        }
    };
    let Some(pass) = attempt(handle, &mut q.machine, (&q.name, &q.vhost), now, |m, s| {
        pass_held(m, s, count, after)
    }) else {
        return Step::Later;
    };
    if pass.full {
        h.round = Some(Some(pass.last));
    } else {
        h.round = None;
        h.mark = Some(pass.last).filter(|k| *k != (0, 0)).or(h.mark);
    }
    if let Mode::Leading { committed } = &mut r.mode {
        for (key, stub) in &pass.stubs {
            committed.share_held(*key, stub);
        }
    }
    pass.step()
}

/// A part of a replicated queue whose messages come and go in no order a round could follow:
/// its rounds, how many it holds, its messages past the `skip` first (from the key after a
/// given one), and one of them by key.
struct Line<K: 'static> {
    rounds: fn(&mut ReplicaState) -> &mut Rounds<K>,
    len: fn(&QueueMachine<Message>) -> usize,
    walk: for<'a> fn(&'a mut QueueMachine<Message>, usize, Option<K>) -> Walk<'a, K>,
    get: for<'a> fn(&'a QueueMachine<Message>, K) -> Option<&'a Message>,
}

type Walk<'a, K> = Box<dyn Iterator<Item = (K, &'a mut Message)> + 'a>;

/// The messages waiting for a delayed retry (`x-delayed-retry-type`): the oldest stay (as many
/// as the window keeps of the line). A message that left the line with its contents away
/// keeps them away while it waits, but one delivered from the window came back whole, so a
/// worker failing every job (a service it calls is down) put every message of a busy queue in
/// memory, whole, on every member, for as long as the outage lasted.
const RETRYING: Line<u64> = Line {
    rounds: |r| &mut r.retry_away,
    len: |m| m.retrying_count(),
    walk: |m, skip, after| Box::new(m.retrying_payloads_mut(skip, after)),
    get: |m, id| m.retrying_payload(id),
};

/// The messages given back (nacked with requeue, or held by a consumer that went): they go out
/// first, and those next to go stay; one delivered from the window came back whole.
const RETURNED: Line<u64> = Line {
    rounds: |r| &mut r.returned_away,
    len: |m| m.returned_count(),
    walk: |m, skip, after| Box::new(m.returned_payloads_mut(skip, after)),
    get: |m, id| m.returned_payload(id),
};

/// The messages parked behind their group's message in flight, set aside whole when they
/// reached the head of the line from the window.
const PARKED: Line<(u64, u64)> = Line {
    rounds: |r| &mut r.parked_away,
    len: |m| m.parked_len(),
    walk: |m, skip, after| Box::new(m.parked_payloads_mut(skip, after)),
    get: |m, key| m.parked_payload(key),
};

/// The messages in flight: those delivered from the window went out whole and stayed so in the
/// machine until settled, so a consumer with a large prefetch (or none), or many consumers each
/// holding a message for a long visibility timeout, held that much of the queue in memory on
/// every member. The oldest stay (a worker taking its deliveries in order settles them
/// first); those past them are likely to wait longest.
const IN_FLIGHT: Line<u64> = Line {
    rounds: |r| &mut r.in_flight_away,
    len: |m| m.in_flight_count(),
    walk: |m, skip, after| Box::new(m.in_flight_payloads_mut(skip, after)),
    get: |m, id| m.in_flight_payload(id),
};

/// A pass over one such part of the queue past the first `count`: their contents leave
/// memory. A round walks them all, at most once every [`RETRY_ROUND_MS`], and only once
/// entries were applied since the last one.
fn line_away_pass<K: Copy + Ord + Default>(
    line: &Line<K>,
    handle: &mut AwayHandle,
    q: &mut Queue,
    count: usize,
    now: u64,
) -> Step {
    let Some(r) = q.replica.as_mut() else {
        return Step::Done;
    };
    let applied = r.applied_index;
    let h = (line.rounds)(r);
    let after = match h.round {
        Some(after) => after,
        None => {
            // Nothing applied since the last round: nothing came.
            let changed = h.rounds == 0 || h.index != applied;
            if !changed || (line.len)(&q.machine) <= count {
                return Step::Done;
            }
            let due = h.seen.saturating_add(RETRY_ROUND_MS);
            if h.rounds > 0 && now < due {
                return Step::At(due);
            }
            h.seen = now;
            h.index = applied;
            h.rounds = h.rounds.wrapping_add(1);
            h.round = Some(None);
            None
        }
    };
    let Some(pass) = attempt(handle, &mut q.machine, (&q.name, &q.vhost), now, |m, s| {
        pass_line(line, m, s, count, after)
    }) else {
        return Step::Later;
    };
    (line.rounds)(r).round = pass.full.then_some(Some(pass.last));
    if let Mode::Leading { committed } = &mut r.mode {
        // The committed machine takes the same stubs over the same stretch: those made now,
        // and those made before the message came there too (it came from the committed
        // machine's own delivery, whole, when its entry committed).
        let ahead = &q.machine;
        for (key, m) in (line.walk)(committed, count, after) {
            if key > pass.last {
                break;
            }
            if let Some(stub) = (line.get)(ahead, key) {
                if stub.is_away() && !m.is_away() && *stub == *m {
                    *m = stub.clone();
                }
            }
        }
    }
    pass.step()
}

/// Runs one pass (`pass`, given the machine and the store) unless a failed write's pause is
/// under way. A write that fails is logged (once until one works again) and none is tried for
/// [`AWAY_RETRY_MS`]; `None` then, and during the pause.
fn attempt<K>(
    handle: &mut AwayHandle,
    machine: &mut QueueMachine<Message>,
    (name, vhost): (&ShortStr, &str),
    now: u64,
    pass: impl FnOnce(&mut QueueMachine<Message>, &AwayStoreHandle) -> Result<Pass<K>, String>,
) -> Option<Pass<K>> {
    if handle.retry_at.is_some_and(|at| now < at) {
        return None;
    }
    match pass(machine, &handle.store) {
        Ok(p) => {
            handle.retry_at = None;
            Some(p)
        }
        Err(error) => {
            if handle.retry_at.is_some() {
                tracing::debug!(queue = %name, %error, "writing messages' contents away failed again");
            } else {
                tracing::warn!(queue = %name, vhost = %vhost, %error, "writing a deep replicated queue's messages out of memory failed: they stay in memory, tried again in a second");
            }
            handle.retry_at = Some(now.saturating_add(AWAY_RETRY_MS));
            None
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
    /// Nothing now; a round is to begin at this time.
    At(u64),
}

/// What [`Broker::away_context`] gives a snapshot's decoder: the store, and the windows
/// (`--queue-window`) a queue keeps in memory with consumers and without.
#[derive(Clone)]
pub struct AwayContext {
    store: AwayStoreHandle,
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
    /// How a snapshot is decoded for this node: its line past the largest window sent away
    /// and packed as it is read ([`QueueMachine::restore_snapshot_away`]);
    /// [`Self::send_restored_away`] then fits it to the window the queue has.
    pub fn restoring(&self) -> crate::machine::Restoring {
        crate::machine::Restoring {
            keep: self.window.max(self.window_idle) as usize,
            store: self.store.clone(),
            error: None,
        }
    }

    /// A replicated queue's machine just read from a snapshot, before the broker takes it:
    /// the contents of its ready messages past the window go away, all of them, in passes
    /// (off the broker's thread: this runs where the snapshot is decoded), and what stays in
    /// memory is copied out of the snapshot's buffer, which every message read from it
    /// slices: otherwise the window's few messages would keep the whole snapshot (up to a GiB)
    /// alive, for as long as the queue is idle. Not copied when what stays is more than a
    /// quarter of the snapshot's `bytes` (a small queue: every part's first `count` stay):
    /// the copies would only double the peak. If a write
    /// fails, the rest stays as it was (in memory, the buffer kept): the broker's own passes
    /// try again later.
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
        machine.pack_line(kept, from);
        machine.spill_line(spill_keep(count), SPILL_MIN);
        // The held publishes past those due soonest go too, and those waiting for a retry
        // past the oldest.
        let held = every_pass(|after| pass_held(machine, &self.store, count, after));
        let store = &self.store;
        let retrying = held
            .and_then(|()| every_pass(|a| pass_line(&RETRYING, machine, store, count, a)))
            .and_then(|()| every_pass(|a| pass_line(&RETURNED, machine, store, count, a)))
            .and_then(|()| every_pass(|a| pass_line(&PARKED, machine, store, count, a)))
            .and_then(|()| every_pass(|a| pass_line(&IN_FLIGHT, machine, store, count, a)));
        if let Err(error) = retrying {
            tracing::warn!(%error, "writing the held, retrying, given back, parked or in-flight messages of a replicated queue read from a snapshot out of memory failed: they stay in memory for now");
            return;
        }
        // Every message not packed (a packed one is a stub: no contents), held publishes
        // included; spilled runs are not read back for it.
        let staying: u64 = machine
            .messages_mut()
            .map(|m| m.contents_len() as u64)
            .sum();
        if staying.saturating_mul(4) <= bytes {
            for m in machine.messages_mut() {
                m.detach();
            }
        }
    }
}

/// What one pass wrote: its messages' stubs (already in the machine) under their keys (a
/// message id, or a held publish's due time and number), the last key it considered, and
/// whether it stopped at its limits (more may wait).
struct Pass<K> {
    stubs: Vec<(K, Message)>,
    last: K,
    full: bool,
}

impl<K> Pass<K> {
    /// More may wait after a pass its limits stopped.
    fn step(&self) -> Step {
        if self.full {
            Step::More
        } else {
            Step::Done
        }
    }
}

/// Copies of the messages of `walk` still in memory, up to a pass's limits: the copies, the
/// last key looked at (`from` if none), and whether the limits stopped it. A pass also looks
/// at no more than [`AWAY_PASS_WALK`] messages, away or not, so that a round over a line
/// mostly away already holds the node no longer than a write does.
fn copies_of<'a, K: Copy>(
    walk: impl Iterator<Item = (K, &'a mut Message)>,
    from: K,
) -> (Vec<(K, Message)>, K, bool) {
    let mut copies: Vec<(K, Message)> = Vec::new();
    let (mut last, mut bytes, mut full) = (from, 0u64, false);
    for (walked, (key, m)) in walk.enumerate() {
        if copies.len() >= AWAY_PASS_MESSAGES
            || bytes >= AWAY_PASS_BYTES
            || walked >= AWAY_PASS_WALK
        {
            full = true;
            break;
        }
        last = key;
        if !m.is_away() {
            bytes += m.body.len() as u64 + m.properties.len() as u64;
            copies.push((key, m.clone()));
        }
    }
    (copies, last, full)
}

/// Writes `copies`' contents to `store` in one write: their stubs.
fn write_away<K>(
    store: &AwayStoreHandle,
    copies: Vec<(K, Message)>,
) -> Result<Vec<(K, Message)>, String> {
    let items: Vec<&Message> = copies.iter().map(|(_, m)| m).collect();
    let keys = store
        .put(&items)
        .and_then(|keys| match keys.len() == items.len() {
            true => Ok(keys),
            false => Err(format!("{} keys for {} messages", keys.len(), items.len())),
        })?;
    Ok(copies
        .into_iter()
        .zip(keys)
        .map(|((k, m), key)| (k, m.away_stub(key, store.clone())))
        .collect())
}

/// Puts `stubs` (in key order) in place of the messages of `walk` under the same keys, up to
/// `last`.
fn swap_in<'a, K: Copy + Ord + 'a>(
    walk: impl Iterator<Item = (K, &'a mut Message)>,
    stubs: &[(K, Message)],
    last: K,
) {
    let mut next = stubs.iter().peekable();
    for (key, m) in walk {
        if key > last {
            break;
        }
        if next.peek().is_some_and(|(k, _)| *k == key) {
            if let Some((_, stub)) = next.next() {
                *m = stub.clone();
            }
        }
    }
}

/// Writes the contents of the messages of `walk` still in memory (from key `from` on), up to
/// a pass's limits ([`copies_of`]), to `store` in one write, and swaps their stubs into
/// `machine` (`walk` is walked again for it). Nothing changes if the write fails.
fn pass_keyed<K: Copy + Ord>(
    machine: &mut QueueMachine<Message>,
    store: &AwayStoreHandle,
    from: K,
    walk: impl for<'a> Fn(
        &'a mut QueueMachine<Message>,
    ) -> Box<dyn Iterator<Item = (K, &'a mut Message)> + 'a>,
) -> Result<Pass<K>, String> {
    let (copies, last, full) = copies_of(walk(machine), from);
    if copies.is_empty() {
        return Ok(Pass {
            stubs: Vec::new(),
            last,
            full,
        });
    }
    let stubs = write_away(store, copies)?;
    swap_in(walk(machine), &stubs, last);
    Ok(Pass { stubs, last, full })
}

/// Passes one after the other, each from where the last stopped, until one is not stopped by
/// its limits.
fn every_pass<K>(mut one: impl FnMut(Option<K>) -> Result<Pass<K>, String>) -> Result<(), String> {
    let mut after = None;
    loop {
        let p = one(after)?;
        if !p.full {
            return Ok(());
        }
        after = Some(p.last);
    }
}

/// A pass over the ready line past its first `kept` and past id `from`.
fn pass(
    machine: &mut QueueMachine<Message>,
    store: &AwayStoreHandle,
    kept: usize,
    from: u64,
) -> Result<Pass<u64>, String> {
    pass_keyed(machine, store, from, |m| {
        Box::new(m.head_payloads_mut(kept, from))
    })
}

/// A pass over the held publishes past the `kept` due soonest, from the one after key `after`.
/// One whose headers say it was delivered before (`x-redelivered`, as `warren migrate` sets it)
/// stays whole: the machine reads that from its properties when it is released, and a stub has
/// none, so members that sent it away and members that did not would flag it differently.
fn pass_held(
    machine: &mut QueueMachine<Message>,
    store: &AwayStoreHandle,
    kept: usize,
    after: Option<(u64, u64)>,
) -> Result<Pass<(u64, u64)>, String> {
    pass_keyed(machine, store, after.unwrap_or((0, 0)), |m| {
        Box::new(
            m.held_payloads_mut(kept, after)
                .filter(|(_, m)| !m.says_redelivered()),
        )
    })
}

/// A pass over one such part of a queue ([`Line`]) past its `kept` first, from the one after
/// key `after`.
fn pass_line<K: Copy + Ord + Default>(
    line: &Line<K>,
    machine: &mut QueueMachine<Message>,
    store: &AwayStoreHandle,
    kept: usize,
    after: Option<K>,
) -> Result<Pass<K>, String> {
    let walk = line.walk;
    pass_keyed(machine, store, after.unwrap_or_default(), |m| {
        walk(m, kept, after)
    })
}
