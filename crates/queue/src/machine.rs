//! The queue state machine: a pure, deterministic function of the commands it is given.
//!
//! Modelled on RabbitMQ's `rabbit_fifo`: [`QueueMachine::apply`] takes a [`Meta`] (the log
//! index and the time, both chosen by whoever orders the commands: the broker today, a Raft
//! leader later) and a [`Command`], changes the state, returns a [`Reply`] and pushes
//! [`Effect`]s. Nothing else changes the state. There is no I/O, no clock read and no
//! callback, so applying the same commands to a fresh machine gives the same state (see
//! [`QueueMachine::digest`]) and the same effects: that is what the store recovers from and
//! what replication will replicate.
//!
//! Every enqueued message gets a monotonically increasing `msg_id`, which is also its position
//! in the queue. A message is in exactly one of these places:
//!
//! * **ready**: `ready` (a `VecDeque` in id order: the common path) or `returned` (a
//!   `BTreeMap` for messages that were delivered and came back, so they go back to their
//!   ORIGINAL position: the next delivery takes the smaller id of the two heads);
//! * **in flight**: `in_flight`, keyed by `msg_id`, remembering the holder (a consumer, or
//!   the node of a basic.get) and the attempt;
//! * **gone**: settled, discarded, expired, purged or handed to a no-ack consumer.
//!
//! Every delivery carries a [`Receipt`] (message id and attempt number). Settling, returning
//! or discarding with a receipt that is no longer current (the message was returned and
//! delivered again since) changes nothing and replies [`Reply::Stale`].
//!
//! Consumers, their prefetch and what each holds live here. Whether a consumer may take a
//! message is decided from the state alone: its own prefetch against what it holds, and the
//! credit of its channel ([`CreditGroup`]), which the session sets with [`Command::Credit`]
//! for what the queue cannot see (a channel-wide prefetch shared with other queues, a socket
//! that is backed up). Consumers that may take a message wait in `service`, in round-robin
//! order; one that runs out of credit leaves it and rejoins at the back when credit returns,
//! so a delivery costs O(log n) however many consumers are blocked.
//!
//! Timed things are ordered indexes: `expiries` (and `expiries_in_order`, for a queue TTL)
//! hold the expiries of ready messages, `visibility` and `ack_deadlines` the visibility and
//! consumer timeouts of deliveries; [`QueueMachine::next_deadline`] reports the earliest of
//! them, of the next paged run's expiry and of the queue's own `x-expires`.
//!
//! What a declaration asks for (length limits, priorities, single active consumer, delivery
//! limit, timeouts) arrives as a [`Policy`] with [`Command::Configure`], so a replay rebuilds
//! it like everything else.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::hash::{Hash, Hasher};

use bytes::BytesMut;
use warren_codec::{FieldTable, ShortStr};

use crate::Overflow;
use crate::{node_of, ConnId, NodeId};

mod in_order;
mod snapshot;
pub use snapshot::{Restoring, SnapshotError, SNAPSHOT_PREFIX, SNAPSHOT_VERSION};

/// A message group, as a non-zero hash of the group header's value.
pub type GroupKey = std::num::NonZeroU64;

/// Lines of fewer slots than this keep their room when they drain ([`QueueMachine::apply`]).
const SHRINK_ABOVE: usize = 4096;

/// A held publish ([`Command::EnqueueWith`]) that a full `reject-publish` queue refuses when it
/// is due is held back this much longer (ms), as a node's own delayed release is.
const HELD_BACK_MS: u64 = 1_000;

/// What the machine needs to know about a message, computed by the caller when enqueuing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct MsgMeta {
    /// Body size in bytes, for the `bytes` counters (and later `x-max-length-bytes`).
    pub size: u64,
    /// Absolute expiry in ms (per-message or queue TTL), if any: the message is dropped from
    /// ready (with a [`DeadLetterReason::Expired`] effect) once the time reaches it.
    pub expires_at: Option<u64>,
    /// The message is on disk, for this queue alone, and can be read back by its id: a
    /// [`Command::PageOut`] may drop it from memory once its write is done.
    pub pageable: bool,
    /// It is on disk in the scratch area (a transient message of a deep queue, dropped at
    /// start), not in the durable store: read back from there. Runs never mix the two.
    pub spilled: bool,
    /// The message's priority in a queue with `x-max-priority` (already capped to it; 0
    /// elsewhere).
    pub priority: u8,
    /// Its message group in a queue with `x-group-header` (a hash of the header's value): a
    /// group's messages go out in order, one at a time. (Non-zero, so the option costs no
    /// space: every queued entry carries it.)
    pub group: Option<GroupKey>,
}

/// What a queue's declaration asks of its machine (`x-max-length`, `x-expires`...), set once
/// with [`Command::Configure`] when the queue is declared or recovered.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Policy {
    /// `x-max-length`: most ready messages.
    pub max_length: Option<u64>,
    /// `x-max-length-bytes`: most bytes of ready message bodies.
    pub max_length_bytes: Option<u64>,
    /// `x-overflow`: what a full queue does.
    pub overflow: Overflow,
    /// `x-expires`: the queue goes once it has had no consumer, no basic.get and no
    /// redeclaration for this long (ms).
    pub expires_ms: Option<u64>,
    /// `x-max-priority`: ready messages go out highest priority first.
    pub max_priority: Option<u8>,
    /// `x-single-active-consumer`: only the oldest consumer receives.
    pub single_active: bool,
    /// `x-delivery-limit`: a message returned after this many deliveries is dead-lettered
    /// (reason `delivery_limit`) instead of going back.
    pub delivery_limit: Option<u64>,
    /// `x-visibility-timeout`: a delivery not settled this long after it went out comes back
    /// on its own (ms; a consumer's own `x-visibility-timeout` overrides it).
    pub visibility_timeout_ms: Option<u64>,
    /// `x-consumer-timeout` (RabbitMQ 4.3): a consumer that leaves a delivery unsettled this
    /// long is cancelled and all its deliveries come back (ms; a consumer's own overrides it).
    pub consumer_timeout_ms: Option<u64>,
    /// `x-delayed-retry-*`: a message given back by its consumer (nack or reject with requeue,
    /// a visibility timeout) is delivered again only after a back-off delay.
    pub retry: Option<RetryPolicy>,
    /// Deliveries are decided by applying the commands that make them possible (an enqueue
    /// with a consumer waiting, a settle or a credit that frees room, a consume), as in
    /// rabbit_fifo, instead of by a separate [`Command::Checkout`]: up to [`AUTO_CHECKOUT_MAX`]
    /// deliveries come out of one command, and only when more are possible
    /// ([`QueueMachine::has_work`]) is a `Checkout` needed. Built for replicated queues, which
    /// measured it slower than batched `Checkout` entries (every member pays a checkout per
    /// entry: bench/cluster.md) and do not use it.
    pub deliver_on_apply: bool,
    /// At-least-once dead-lettering (a replicated queue with a dead-letter exchange, as
    /// RabbitMQ's `x-dead-letter-strategy: at-least-once`): a dead-lettered message stays in
    /// the machine, outside the queue, until [`Command::DeadLettered`] says its dead letter is
    /// safe in its targets. A failover between the two finds it here, and the new leader
    /// sends it again (at least once: perhaps twice, never lost).
    pub hold_dead_letters: bool,
    /// A checkout that finds every group of the line's messages locked leaves the line as it
    /// is, told so by counts of the line's messages per group, instead of setting every
    /// message aside (parking) on the way to its end: a deep queue in few groups, drained by
    /// consumers with room for more than one message per group, otherwise moved its whole
    /// line into the parked sets, whole entries where the line held them packed. Parked
    /// messages do not expire until they rejoin the line, so which messages expire when
    /// differs: a replicated queue's members must agree on it (cluster feature level 10).
    pub index_groups: bool,
}

/// Most deliveries one command makes in a queue that delivers on apply: a consume by a
/// consumer without prefetch on a deep queue must not make one entry's effects unbounded.
pub const AUTO_CHECKOUT_MAX: u32 = 256;

/// The back-off of delayed retries (RabbitMQ 4.3's `x-delayed-retry-min`/`-max`, LavinMQ's
/// `x-delayed-retry-multiplier`, and Warren's `x-delayed-retry-jitter`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RetryPolicy {
    /// The first retry's delay (ms).
    pub min_ms: u64,
    /// No delay is longer than this (ms); retries never stop because of it.
    pub max_ms: Option<u64>,
    /// None: linear (min x failed deliveries); 1: constant; n >= 2: exponential (min x
    /// n^(failed deliveries - 1)).
    pub multiplier: Option<u64>,
    /// Up to this percentage of a delay is taken off, differently for each message and
    /// attempt (spreads a burst of retries); 0 = none.
    pub jitter_pct: u8,
}

impl RetryPolicy {
    /// The delay before delivery `failed + 1` of message `id`, after `failed` failed ones.
    pub fn delay(&self, id: u64, failed: u32) -> u64 {
        let n = u64::from(failed.max(1));
        let base = match self.multiplier {
            None => self.min_ms.saturating_mul(n),
            Some(1) => self.min_ms,
            Some(m) => {
                let exp = u32::try_from(n - 1).unwrap_or(u32::MAX).min(63);
                self.min_ms.saturating_mul(m.saturating_pow(exp))
            }
        };
        let capped = self.max_ms.map_or(base, |max| base.min(max));
        if self.jitter_pct == 0 {
            return capped;
        }
        // A deterministic spread (the machine has no randomness): a mix of id and attempt.
        let span = capped.saturating_mul(u64::from(self.jitter_pct.min(100))) / 100;
        capped - mix(id ^ n.rotate_left(32)) % span.saturating_add(1)
    }
}

/// splitmix64's finaliser: a well-spread 64-bit function of its input.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Policy {
    /// Is this the default (a plain queue: no command needed)?
    pub fn is_plain(&self) -> bool {
        *self == Policy::default()
    }

    /// Does the queue keep a length limit?
    pub fn limits_length(&self) -> bool {
        self.max_length.is_some() || self.max_length_bytes.is_some()
    }
}

/// Where a command sits in the queue's history and when it happened. Chosen by whoever orders
/// the commands, never read from a clock inside the machine, so a replay sees the same time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Meta {
    /// The command's position in the queue's log (1, 2, 3...).
    pub index: u64,
    /// Milliseconds on the orderer's clock. The machine's time never goes backwards: an older
    /// value is taken as the latest one seen.
    pub now_ms: u64,
}

/// A consumer's id, unique for the broker's life (never reused). Node-qualified
/// ([`crate::qualify`]) and minted by the node its channel is on, so a delivery held by a
/// consumer cancelled since still names the node that holds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConsumerId(pub u64);

impl ConsumerId {
    /// The node that minted it: the node of the consumer's channel.
    pub fn node(self) -> NodeId {
        node_of(self.0)
    }
}

/// A publish's deduplication key (`x-message-deduplication`), as the broker computed it: up to
/// 32 bytes verbatim (`len` of them), or a digest of a longer one (`len` = `u8::MAX`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DedupKey {
    pub len: u8,
    pub bytes: [u8; 32],
}

/// What [`Command::EnqueueWith`] asks of the queue's deduplication window: drop the publish
/// if `key` was taken within the window, else remember it `ttl_ms`, keeping at most
/// `max_keys` (the oldest forgotten first).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DedupWindow {
    pub key: DedupKey,
    pub ttl_ms: u64,
    pub max_keys: u32,
}

/// A sender of publishes that may be resent ([`Command::EnqueueFrom`]): a node forwarding
/// to a replicated queue's leader. Node-qualified ([`crate::qualify`]) and never reused, across
/// the node's restarts too: a new enqueuer's sequence numbers start afresh.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EnqueuerId(pub u64);

impl EnqueuerId {
    /// The node of the publisher's channel.
    pub fn node(self) -> NodeId {
        node_of(self.0)
    }
}

/// The channel a consumer lives on: the unit of channel-wide credit (global prefetch, socket
/// back-pressure).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CreditGroup {
    pub conn: ConnId,
    pub channel: u16,
}

/// A delivery's receipt: which message, and which delivery of it. Only the current delivery's
/// receipt settles it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Receipt {
    pub msg_id: u64,
    /// The delivery count of this delivery (1 for the first).
    pub attempt: u32,
}

/// A consumer as basic.consume declared it.
#[derive(Clone, Debug, PartialEq)]
pub struct ConsumerSpec {
    pub group: CreditGroup,
    pub tag: ShortStr,
    pub no_ack: bool,
    /// Most unacked messages it may hold; 0 = unlimited. Ignored for no-ack consumers.
    pub prefetch: u32,
    pub exclusive: bool,
    /// `x-priority` (0 when absent); consumer priorities come later.
    pub priority: i64,
    pub arguments: FieldTable,
}

/// The credit the session gives a channel in this queue.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Credit {
    /// No deliveries at all (the connection's socket is backed up), no-ack consumers included.
    pub blocked: bool,
    /// At most this many more deliveries to acking consumers of the channel (channel-wide
    /// prefetch); `None` = no channel-wide limit. Each delivery takes one.
    pub limit: Option<u32>,
}

/// The commands of the machine. Plain data: they can be written to a log and replayed.
#[derive(Clone, Debug, PartialEq)]
pub enum Command<M> {
    Enqueue {
        message: M,
        meta: MsgMeta,
    },
    /// An enqueue that a publisher may send again (a node forwards to a replicated queue's
    /// leader and resends what was not answered after a failover). `seq` counts the
    /// enqueuer's publishes to this queue: 1 for its first, one more for each next. A `seq` at
    /// or below one the machine already decided for this enqueuer is a resend: nothing is
    /// enqueued, and the reply is [`Reply::Duplicate`] (the first was enqueued: confirm it) or
    /// `Refused(Full)` when a refusal of the enqueuer's came at or after it (the first may
    /// have been refused; a nack is safe, a confirm might not be). A `seq` past the next one
    /// (the one before it was lost on its way) is `Refused(OutOfOrder)` and decides nothing:
    /// were it enqueued, the lost one, sent again, would be taken for a resend and confirmed
    /// unenqueued. The sender nacks it and goes on as a new enqueuer. The machine keeps, per
    /// enqueuer, the highest sequence decided and the highest refused, until
    /// [`Command::Unregister`], or until another enqueuer of its node starts (sequence 1):
    /// a node is one enqueuer per queue at a time, so the queue remembers at most one per
    /// node. A [`Command::Down`] of its node leaves it: the node may still be running, and
    /// its resends must still be recognised (enqueuer ids never repeat, restarts included).
    EnqueueFrom {
        enqueuer: EnqueuerId,
        seq: u64,
        message: M,
        meta: MsgMeta,
    },
    /// A publish held back `delay_ms` (a replicated queue's `x-delivery-delay`, or the
    /// message's `x-delay` there) from the entry's time: kept beside the queue, neither counted
    /// nor deliverable, and enqueued as a new message by the first [`Command::Tick`] at or
    /// after it is due (so it goes behind what came meanwhile, as a delayed message released
    /// into a classic queue does). The due time is the machine's clock plus the delay, so
    /// that it is the proposing leader's clock that counts, not that of the node that took
    /// the publish. With `from`, the enqueuer's sequence is decided now, as
    /// [`Command::EnqueueFrom`]'s. With `dedup`, a publish whose key the queue took within
    /// its window is a `Duplicate` (nothing changes but the enqueuer's sequence), and one
    /// taken (enqueued or held) is remembered: the window is the queue's, in every member,
    /// so it holds whichever node takes the publish and across a failover. Replies `Ok` once
    /// held; with no delay, what `Enqueue` replies.
    EnqueueWith {
        delay_ms: u64,
        from: Option<(EnqueuerId, u64)>,
        /// Boxed: the command is moved whole on every publish, and few carry one.
        dedup: Option<Box<DedupWindow>>,
        message: M,
        meta: MsgMeta,
    },
    /// The enqueuer is done with: its sequence is forgotten. `Stale` if it was unknown.
    Unregister {
        enqueuer: EnqueuerId,
    },
    /// A node is gone (rabbit_fifo's `down`): every consumer whose channel is on it is
    /// cancelled (with a single active consumer, the next takes over), every delivery its
    /// channels hold (consumer deliveries, by the consumer's node, and basic.gets made with
    /// [`Command::GetBy`] there) comes back at once to its original position, as
    /// [`Command::Release`] does (no retry delay, delivery count kept, so a delivery limit
    /// still applies). Its enqueuers are kept (see [`Command::EnqueueFrom`]). Replies
    /// `Cancelled { consumers_left }`
    /// if it cancelled a consumer, else `Ok`.
    ///
    /// There is no "suspected down" state as in rabbit_fifo (whose consumers wait out a
    /// `noconnection` before they are cancelled): whoever sends `Down` has decided that the
    /// node's connections are gone, and everything of the node goes with them. A node that
    /// comes back (after a partition or a restart) has no consumers or deliveries here: its
    /// clients consume again under new ids, and a late ack from its old
    /// channels is `Stale` (the message was redelivered, at least once as promised). Nothing is
    /// needed for an `Up`. A restarted node's counters start over: `Down` of that node must be
    /// applied before it mints ids again, else its new ids could meet its old ones here.
    Down {
        node: NodeId,
    },
    /// Recovery: a message read back from the store, ready, with the id, delivery count and
    /// expiry it had. Ids must come in increasing order, after every id the machine has given
    /// (else [`Reply::Stale`]). `redelivered` marks a message that may have been delivered
    /// although its count says not (recovered after a crash).
    Restore {
        msg_id: u64,
        message: M,
        meta: MsgMeta,
        delivery_count: u32,
        redelivered: bool,
        /// It was waiting for a delayed retry due then (with retries on, it waits on).
        retry_at: Option<u64>,
    },
    /// Recovery: ids below `next_id` are taken (entries on disk that could not be restored).
    SkipIds {
        next_id: u64,
    },
    /// Recovery: `count` stored messages (`bytes` in all) with ids in `first_id..=last_id`,
    /// left on disk: they are ready, and read back with [`Command::Load`] before delivery. Same
    /// id rule as `Restore`.
    RestoreRun {
        first_id: u64,
        last_id: u64,
        count: u64,
        bytes: u64,
        redelivered: bool,
        /// The earliest expiry among them, if any has one.
        expires_min: Option<u64>,
    },
    /// Memory: the ready messages past the first `keep` (and past `keep_bytes`) that are
    /// pageable and have ids up to `upto_id` (their writes are done) leave memory. They stay
    /// in the queue, in place, as runs of ids; a run's messages are read back with
    /// [`Command::Load`] when they come near the head.
    PageOut {
        keep: u32,
        keep_bytes: u64,
        upto_id: u64,
    },
    /// The first paged run's messages with ids up to `through_id`, read back from the store in
    /// id order. A load that does not match the first run changes nothing ([`Reply::Stale`]).
    /// Loaded messages whose time has come expire at once (`DeadLetter { Expired }`).
    Load {
        messages: Vec<Loaded<M>>,
        through_id: u64,
    },
    /// basic.consume.
    Consume {
        id: ConsumerId,
        spec: ConsumerSpec,
    },
    /// basic.cancel, or the consumer's channel closed. Its in-flight messages stay in flight
    /// (the channel still holds them).
    Cancel {
        id: ConsumerId,
    },
    /// Sets a channel's credit in this queue.
    Credit {
        group: CreditGroup,
        credit: Credit,
    },
    /// Hands up to `max` ready messages to consumers that may take them.
    Checkout {
        max: u32,
    },
    /// basic.get: takes one ready message with no consumer. The delivery is held by node 0
    /// (a node on its own): `GetBy` with node 0.
    Get {
        no_ack: bool,
    },
    /// basic.get on a channel of `node`: a [`Command::Down`] of that node returns the delivery.
    GetBy {
        no_ack: bool,
        node: NodeId,
    },
    /// Ack.
    Settle {
        receipt: Receipt,
    },
    /// nack/reject with requeue, basic.recover: back to its original position (after a delay
    /// with delayed retries).
    Return {
        receipt: Receipt,
    },
    /// The holder's channel closed: back to its original position at once (no retry delay:
    /// the worker went away, not the message's fault).
    Release {
        receipt: Receipt,
    },
    /// reject/nack without requeue.
    Discard {
        receipt: Receipt,
    },
    /// Drops every ready message.
    Purge,
    /// Time passes (the time is in [`Meta`]): expires what is due; a queue unused past its
    /// `x-expires` replies [`Reply::QueueExpired`].
    Tick,
    /// Sets the queue's policy (its declaration's arguments). Counts as a use of the queue.
    Configure(Policy),
    /// The holder of a delivery asks for more time: its visibility deadline becomes now plus
    /// `timeout_ms`. `Stale` if the receipt is not the current delivery.
    Extend {
        receipt: Receipt,
        timeout_ms: u64,
    },
    /// The queue was redeclared: a use (`x-expires` counts from here).
    Touch,
    /// A lower queue TTL reaches messages already queued (a policy changed): each ready or
    /// delivered message with an id up to a cap's `.0` (the first such cap, caps in id order)
    /// expires no later than its `.1`. Paged messages take their cap when they are read back.
    /// The caller derives the caps from when the messages came (conservatively: never
    /// earlier than their enqueue time plus the new TTL). Expires what is due at once.
    CapExpiry {
        caps: Vec<(u64, u64)>,
    },
    /// The dead letters of these held messages ([`Policy::hold_dead_letters`]) are in their
    /// targets: they go. Ids not held are ignored; `Stale` if none was.
    DeadLettered {
        ids: Vec<u64>,
    },
}

impl<M> Command<M> {
    /// A command that only this node's memory or disk asks for: paging out and reading back,
    /// and recovery from its own store. It never enters a replicated log: another member's
    /// memory and disk differ, and what it holds must not depend on them.
    pub fn is_node_local(&self) -> bool {
        matches!(
            self,
            Command::Restore { .. }
                | Command::SkipIds { .. }
                | Command::RestoreRun { .. }
                | Command::PageOut { .. }
                | Command::Load { .. }
        )
    }

    /// The command's name, for messages.
    pub fn name(&self) -> &'static str {
        match self {
            Command::Enqueue { .. } => "enqueue",
            Command::EnqueueFrom { .. } => "enqueue_from",
            Command::EnqueueWith { .. } => "enqueue_with",
            Command::Unregister { .. } => "unregister",
            Command::Down { .. } => "down",
            Command::Restore { .. } => "restore",
            Command::SkipIds { .. } => "skip_ids",
            Command::RestoreRun { .. } => "restore_run",
            Command::PageOut { .. } => "page_out",
            Command::Load { .. } => "load",
            Command::Consume { .. } => "consume",
            Command::Cancel { .. } => "cancel",
            Command::Credit { .. } => "credit",
            Command::Checkout { .. } => "checkout",
            Command::Get { .. } => "get",
            Command::GetBy { .. } => "get_by",
            Command::Settle { .. } => "settle",
            Command::Return { .. } => "return",
            Command::Release { .. } => "release",
            Command::Discard { .. } => "discard",
            Command::Purge => "purge",
            Command::Tick => "tick",
            Command::Configure(_) => "configure",
            Command::Extend { .. } => "extend",
            Command::Touch => "touch",
            Command::CapExpiry { .. } => "cap_expiry",
            Command::DeadLettered { .. } => "dead_lettered",
        }
    }
}

/// A message read back from the store for [`Command::Load`].
#[derive(Clone, Debug, PartialEq, Hash)]
pub struct Loaded<M> {
    pub msg_id: u64,
    pub message: M,
    pub meta: MsgMeta,
    pub delivery_count: u32,
}

/// What the store should read for a queue whose next message is paged out: the stored
/// messages with ids in `from_id..=to_id` (as many as fit a page).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadRequest {
    pub from_id: u64,
    pub to_id: u64,
    /// The run is in the scratch area.
    pub spilled: bool,
}

/// A paged run: the queue's messages with ids in `first_id..=last_id`, on disk only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PagedRun {
    pub first_id: u64,
    pub last_id: u64,
    pub spilled: bool,
}

/// Why a consume was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Refusal {
    /// An exclusive consumer holds the queue, or an exclusive consume met other consumers.
    ExclusiveInUse,
    /// The consumer id is already registered.
    DuplicateConsumer,
    /// Enqueue: the queue is full and its `x-overflow` refuses new messages.
    Full,
    /// [`Command::EnqueueFrom`]: the sequence skips one the machine never decided.
    OutOfOrder,
}

/// The machine's answer to one command.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reply {
    Ok,
    Enqueued {
        msg_id: u64,
    },
    /// Checkout and Get: how many messages were handed out (in [`Effect::Deliver`]).
    Delivered {
        count: u32,
    },
    Purged {
        count: u32,
    },
    /// PageOut: how many messages left memory.
    Paged {
        count: u32,
    },
    /// A consumer was removed; how many are left.
    Cancelled {
        consumers_left: u32,
    },
    /// The receipt or consumer is not current: nothing changed.
    Stale,
    Refused(Refusal),
    /// Tick: the queue has been unused for its `x-expires`; the broker deletes it.
    QueueExpired,
    /// [`Command::EnqueueFrom`]: the enqueuer sent this sequence before and it was enqueued
    /// then; nothing changed. The publish is confirmed as the first one was.
    Duplicate,
}

/// Why a message left the queue without being acknowledged (names follow RabbitMQ's
/// `x-death` reasons).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeadLetterReason {
    Rejected,
    Expired,
    MaxLen,
    DeliveryLimit,
}

impl DeadLetterReason {
    /// The reason as `x-death` spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            DeadLetterReason::Rejected => "rejected",
            DeadLetterReason::Expired => "expired",
            DeadLetterReason::MaxLen => "maxlen",
            DeadLetterReason::DeliveryLimit => "delivery_limit",
        }
    }
}

/// A message handed to a consumer (or to basic.get).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Deliver<M> {
    /// `None` for basic.get.
    pub consumer: Option<ConsumerId>,
    /// The consumer's channel and tag (copied from its spec, so the caller needs no lookup).
    pub to: Option<(CreditGroup, ShortStr)>,
    pub receipt: Receipt,
    pub message: M,
    /// True if the message was delivered before (and came back).
    pub redelivered: bool,
    /// The queue already forgot the message (no-ack consumer or basic.get with no-ack).
    pub settled: bool,
    /// The delivery has a timer (visibility or consumer timeout): it may time out, and the
    /// session is told with a [`Effect::TimedOut`] naming its receipt.
    pub timed: bool,
}

/// What a command asks the world to do.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Effect<M> {
    Deliver(Deliver<M>),
    /// A message left the queue unacknowledged: dead-letter it if the queue has a dead-letter
    /// exchange, else drop it.
    DeadLetter {
        msg_id: u64,
        message: M,
        delivery_count: u32,
        reason: DeadLetterReason,
    },
    /// A delivery was not settled within its visibility timeout: the message is ready again
    /// (or dead-lettered, past its delivery limit: a `DeadLetter` follows). `group`: the
    /// channel that held it, for a consumer delivery.
    TimedOut {
        msg_id: u64,
        attempt: u32,
        group: Option<CreditGroup>,
        message: M,
    },
    /// A consumer left a delivery unsettled past its consumer timeout: it is cancelled (its
    /// deliveries come back, each with a `TimedOut`). The session tells the client.
    ConsumerTimedOut {
        consumer: ConsumerId,
        group: CreditGroup,
        tag: ShortStr,
        timeout_ms: u64,
    },
    /// A late ack (the delivery had timed out) removed the message from the ready line: it
    /// was waiting there, delivered to nobody else since.
    SettledLate {
        msg_id: u64,
        message: M,
        delivery_count: u32,
    },
}

#[derive(Clone, Debug)]
struct Entry<M> {
    id: u64,
    msg: M,
    meta: MsgMeta,
    /// How many times this message has been handed out (0 while it was never delivered).
    delivery_count: u32,
    /// Delivered as redelivered even with a count of 0 (recovered after a crash).
    maybe_delivered: bool,
    /// Back in the ready line because its delivery timed out (not because its holder gave it
    /// back): a late ack from that holder may still settle it.
    timed_out: bool,
}

/// A dead-lettered message held until its dead letter is safe ([`Policy::hold_dead_letters`]).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Dead<M> {
    pub message: M,
    pub delivery_count: u32,
    pub reason: DeadLetterReason,
}

/// Ready messages that are on disk only: every message of the queue with an id in
/// `first..=last` (ids in between are not in the queue).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Run {
    first: u64,
    last: u64,
    count: u64,
    bytes: u64,
    /// Recovered after a crash: delivered as redelivered.
    maybe_delivered: bool,
    /// In the scratch area, not the durable store.
    spilled: bool,
    /// The earliest expiry of its messages, if any has one (an upper bound once part of the
    /// run was read: the rest may expire later).
    expires_min: Option<u64>,
    /// Its messages are in the line's census by group ([`QueueMachine::line_groups`]): paged
    /// out here. A run restored from the store is in `line_unknown` until it is read.
    counted: bool,
}

/// The expiry cap of message `id`: the first cap (in id order) that reaches it.
fn cap_of(caps: &[(u64, u64)], id: u64) -> Option<u64> {
    let i = caps.partition_point(|(up_to, _)| *up_to < id);
    caps.get(i).map(|c| c.1)
}

/// Two cap lists as one: at every boundary, the lower of the two caps there.
fn merge_caps(a: &[(u64, u64)], b: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut bounds: Vec<u64> = a.iter().chain(b).map(|c| c.0).collect();
    bounds.sort_unstable();
    bounds.dedup();
    bounds
        .into_iter()
        .filter_map(|up_to| min_opt(cap_of(a, up_to), cap_of(b, up_to)).map(|at| (up_to, at)))
        .collect()
}

fn min_opt(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// Has a message with this expiry expired at `now`? Strictly after: a message with a TTL of 0
/// can still go to a consumer waiting at the moment it arrives, as in RabbitMQ.
fn expired(at: u64, now: u64) -> bool {
    at < now
}

/// Consumers that may take a message now, highest `x-priority` first and in round-robin order
/// within a priority. Nearly always one level (every consumer at 0).
#[derive(Clone, Debug, Default, Hash)]
struct Service {
    levels: Vec<(i64, VecDeque<ConsumerId>)>,
}

impl Service {
    fn line(&mut self, priority: i64) -> &mut VecDeque<ConsumerId> {
        let i = match self.levels.iter().position(|(p, _)| *p <= priority) {
            Some(i) if self.levels.get(i).is_some_and(|(p, _)| *p == priority) => i,
            Some(i) => {
                self.levels.insert(i, (priority, VecDeque::new()));
                i
            }
            None => {
                self.levels.push((priority, VecDeque::new()));
                self.levels.len() - 1
            }
        };
        &mut self.levels[i].1
    }

    fn push_back(&mut self, priority: i64, id: ConsumerId) {
        self.line(priority).push_back(id);
    }

    fn push_front(&mut self, priority: i64, id: ConsumerId) {
        self.line(priority).push_front(id);
    }

    fn pop_front(&mut self) -> Option<(ConsumerId, i64)> {
        self.levels
            .iter_mut()
            .find_map(|(p, line)| line.pop_front().map(|id| (id, *p)))
    }

    fn remove(&mut self, id: ConsumerId) {
        for (_, line) in &mut self.levels {
            line.retain(|c| *c != id);
        }
    }

    fn is_empty(&self) -> bool {
        self.levels.iter().all(|(_, line)| line.is_empty())
    }
}

/// A place in the tail of the ready line: a message in memory, a run on disk, a run of
/// packed messages in memory (never empty), or such a run written out of memory.
#[derive(Clone, Debug)]
enum Slot<M: crate::Payload> {
    Msg(Entry<M>),
    Paged(Run),
    Packed(PackedRun<M::Packed>),
    Spilled(SpilledRun<M::Spilled>),
}

impl<M: crate::Payload> Slot<M> {
    fn first_id(&self) -> u64 {
        match self {
            Slot::Msg(e) => e.id,
            Slot::Paged(r) => r.first,
            Slot::Packed(run) => run.items.front().map_or(0, |p| p.id),
            Slot::Spilled(run) => run.first,
        }
    }

    /// A packed run, in memory or not.
    fn is_run_of_packed(&self) -> bool {
        matches!(self, Slot::Packed(_) | Slot::Spilled(_))
    }
}

/// A packed run written out of this node's memory ([`QueueMachine::spill_line`]): its first
/// id and length stay, the rest is read back ([`Payload::unspill`]) when it is needed.
///
/// [`Payload::unspill`]: crate::Payload::unspill
#[derive(Clone, Debug)]
struct SpilledRun<S> {
    first: u64,
    last: u64,
    len: usize,
    /// What tells it from another run of the same ids ([`spill_mark`]).
    mark: u64,
    /// How many of its messages have an expiry (its pairs the in-order deque may fold).
    expiring: usize,
    handle: S,
}

/// A run's mark: a hash of its own part and of its items' ([`crate::Payload::spill_mark`]).
fn spill_mark<M: crate::Payload>(meta: &[u8], items: &[M::Packed]) -> u64 {
    use std::hash::Hasher;
    let mut h = crate::stable_hash::StableHasher::new();
    h.write(meta);
    h.write_u64(M::spill_mark(items));
    h.finish()
}

/// A spilled run read back. What does not read as the run written stops the node
/// ([`crate::Payload::spill_unreadable`]).
fn read_spilled<M: crate::Payload>(s: &SpilledRun<M::Spilled>) -> PackedRun<M::Packed> {
    let (meta, items) = M::unspill(&s.handle);
    match PackedRun::from_spill(&meta, items) {
        Ok(run) if run.len() == s.len && run.items.front().map(|p| p.id) == Some(s.first) => run,
        Ok(run) => M::spill_unreadable(
            &s.handle,
            &format!(
                "{} messages from id {:?} where {} from {} were written",
                run.len(),
                run.items.front().map(|p| p.id),
                s.len,
                s.first
            ),
        ),
        Err(error) => M::spill_unreadable(&s.handle, &error),
    }
}

/// A ready message far down a deep line, packed ([`QueueMachine::pack_line`]): all the
/// machine reads of an entry whose other fields are at their defaults (never delivered, no
/// group or priority, not on this node's disk), and the payload's packed form. Its entry is
/// rebuilt, equal to the one packed, when it is needed whole.
#[derive(Clone, Debug)]
struct Packed<P> {
    id: u64,
    size: u32,
    /// Its expiry, as an offset from its run's [`PackedRun::base`] plus one; 0: none.
    expiry: u32,
    item: P,
}

/// A message that can be packed ([`QueueMachine::packable`]), before a run takes it.
struct Packing<P> {
    id: u64,
    size: u32,
    expires_at: Option<u64>,
    group: Option<GroupKey>,
    item: P,
}

/// Packed messages, in id order (never empty in the tail). Their expiries are kept as 32-bit
/// offsets from the run's base, so that a queue TTL's messages pack in 24 bytes as the others.
#[derive(Clone, Debug)]
struct PackedRun<P> {
    /// What the expiries are offsets from; [`NO_BASE`] until a message with one joins.
    base: u64,
    items: VecDeque<Packed<P>>,
    /// The items' groups (0: none), once a message in a group joins the run; empty before,
    /// so a run of messages in no group pays nothing for them.
    groups: VecDeque<u64>,
}

const NO_BASE: u64 = u64::MAX;

/// The base a run's first expiry `at` sets: room for expiries about 24 days either side of it.
fn base_for(at: u64) -> u64 {
    at.saturating_sub(1 << 31)
}

impl<P> PackedRun<P> {
    /// A run of one: its base set from the message's expiry, if it has one.
    fn one(p: Packing<P>) -> Self {
        let (base, expiry) = match p.expires_at {
            Some(at) => {
                let base = base_for(at);
                // At most 2^31 past its base: the cast is exact.
                (base, (at - base) as u32 + 1)
            }
            None => (NO_BASE, 0),
        };
        PackedRun {
            base,
            groups: p
                .group
                .map(|g| VecDeque::from([g.get()]))
                .unwrap_or_default(),
            items: VecDeque::from([Packed {
                id: p.id,
                size: p.size,
                expiry,
                item: p.item,
            }]),
        }
    }

    fn len(&self) -> usize {
        self.items.len()
    }

    /// Appends `p` if the run has room and its expiry is within reach of the base.
    fn push(&mut self, p: Packing<P>) -> Result<(), Packing<P>> {
        // A run holds ids of one block of `PACKED_RUN`: where a run starts then depends on
        // the ids alone, not on what each machine happened to pack before, so a leader's two
        // machines make the same runs (and share their spilled records) even after one of
        // them kept a message whole that the other packed.
        let block = |id: u64| id / PACKED_RUN as u64;
        if self.items.len() >= PACKED_RUN
            || self
                .items
                .front()
                .is_some_and(|f| block(f.id) != block(p.id))
        {
            return Err(p);
        }
        let expiry = match p.expires_at {
            None => 0,
            Some(at) => {
                if self.base == NO_BASE {
                    self.base = base_for(at);
                }
                match at
                    .checked_sub(self.base)
                    .and_then(|d| d.checked_add(1))
                    .and_then(|e| u32::try_from(e).ok())
                {
                    Some(e) => e,
                    None => return Err(p),
                }
            }
        };
        if p.group.is_some() && self.groups.is_empty() {
            self.groups.resize(self.items.len(), 0);
        }
        if p.group.is_some() || !self.groups.is_empty() {
            self.groups.push_back(p.group.map_or(0, GroupKey::get));
        }
        self.items.push_back(Packed {
            id: p.id,
            size: p.size,
            expiry,
            item: p.item,
        });
        Ok(())
    }

    /// Where message `id` is in the run.
    fn position(&self, id: u64) -> Option<usize> {
        self.items.binary_search_by_key(&id, |p| p.id).ok()
    }

    /// The entry packed as `p` (in `group`), rebuilt equal to what was packed.
    fn entry<M: crate::Payload<Packed = P>>(&self, p: &Packed<P>, group: u64) -> Entry<M> {
        Entry {
            id: p.id,
            msg: M::unpack(&p.item),
            meta: MsgMeta {
                size: u64::from(p.size),
                expires_at: (p.expiry > 0)
                    .then(|| self.base.saturating_add(u64::from(p.expiry - 1))),
                group: GroupKey::new(group),
                ..MsgMeta::default()
            },
            delivery_count: 0,
            maybe_delivered: false,
            timed_out: false,
        }
    }

    fn group_at(&self, i: usize) -> u64 {
        self.groups.get(i).copied().unwrap_or(0)
    }

    /// Every message of the run, rebuilt, in order.
    fn entries<M: crate::Payload<Packed = P>>(&self) -> impl Iterator<Item = Entry<M>> + '_ {
        self.items
            .iter()
            .enumerate()
            .map(|(i, p)| self.entry(p, self.group_at(i)))
    }

    /// `(expires_at, id)` of its messages with an expiry, in order.
    fn expiry_pairs(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.items
            .iter()
            .filter(|p| p.expiry > 0)
            .map(|p| (self.base.saturating_add(u64::from(p.expiry - 1)), p.id))
    }

    fn expiring(&self) -> usize {
        self.items.iter().filter(|p| p.expiry > 0).count()
    }

    /// Takes message `i` out of the run, rebuilt.
    fn take<M: crate::Payload<Packed = P>>(&mut self, i: usize) -> Option<Entry<M>> {
        let p = self.items.remove(i)?;
        let group = self.groups.remove(i).unwrap_or(0);
        Some(self.entry(&p, group))
    }

    /// The run's own part of a spilled record (its base, each message's id, size and expiry,
    /// its groups if it has them), and a copy of its items.
    fn spill_parts(&self) -> (Vec<u8>, Vec<P>)
    where
        P: Clone,
    {
        use bytes::BufMut;
        let n = self.items.len();
        let mut meta = Vec::with_capacity(13 + n * 16 + self.groups.len() * 8);
        meta.put_u64_le(self.base);
        // A run holds at most `PACKED_RUN` messages.
        meta.put_u32_le(n as u32);
        meta.put_u8(u8::from(!self.groups.is_empty()));
        for p in &self.items {
            meta.put_u64_le(p.id);
            meta.put_u32_le(p.size);
            meta.put_u32_le(p.expiry);
        }
        for g in &self.groups {
            meta.put_u64_le(*g);
        }
        (meta, self.items.iter().map(|p| p.item.clone()).collect())
    }

    /// The run whose parts [`Self::spill_parts`] gave.
    fn from_spill(meta: &[u8], items: Vec<P>) -> Result<Self, String> {
        use bytes::Buf;
        let mut b = meta;
        if b.remaining() < 13 {
            return Err(format!("a run's part of {} bytes", meta.len()));
        }
        let base = b.get_u64_le();
        let n = b.get_u32_le() as usize;
        let grouped = b.get_u8() != 0;
        let want = n * 16 + if grouped { n * 8 } else { 0 };
        if n != items.len() || n > PACKED_RUN || b.remaining() != want {
            return Err(format!(
                "a run's part of {} bytes for {n} messages, {} items",
                meta.len(),
                items.len()
            ));
        }
        let mut packed = VecDeque::with_capacity(n);
        for item in items {
            packed.push_back(Packed {
                id: b.get_u64_le(),
                size: b.get_u32_le(),
                expiry: b.get_u32_le(),
                item,
            });
        }
        let groups = if grouped {
            (0..n).map(|_| b.get_u64_le()).collect()
        } else {
            VecDeque::new()
        };
        Ok(PackedRun {
            base,
            items: packed,
            groups,
        })
    }
}

/// Messages a packed run holds at most.
pub const PACKED_RUN: usize = 4096;

/// How many messages of the line a tail slot holds in memory (a run on disk: none).
fn slot_len<M: crate::Payload>(s: &Slot<M>) -> usize {
    match s {
        Slot::Msg(_) => 1,
        Slot::Paged(_) => 0,
        Slot::Packed(run) => run.len(),
        Slot::Spilled(run) => run.len,
    }
}

#[derive(Clone, Debug)]
struct InFlight<M> {
    holder: Holder,
    entry: Entry<M>,
}

/// Who holds a delivery: a consumer, or a basic.get on a channel of a node (as small as the
/// `Option<ConsumerId>` it replaced: a basic.get's node costs no memory).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Holder {
    Consumer(ConsumerId),
    Get(NodeId),
}

impl Holder {
    fn consumer(self) -> Option<ConsumerId> {
        match self {
            Holder::Consumer(c) => Some(c),
            Holder::Get(_) => None,
        }
    }

    fn node(self) -> NodeId {
        match self {
            Holder::Consumer(c) => c.node(),
            Holder::Get(node) => node,
        }
    }
}

/// What the machine remembers of an enqueuer ([`Command::EnqueueFrom`]): two numbers,
/// however many messages it published.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
struct Enqueuer {
    /// The highest sequence number decided (enqueued or refused).
    seq: u64,
    /// The highest sequence number refused (`reject-publish`), if any was.
    refused: Option<u64>,
}

/// The timers of an in-flight message, kept beside `in_flight` for the deliveries that have
/// one (most have none: they cost nothing).
#[derive(Clone, Copy, Debug, Default, Hash)]
struct Timers {
    /// The channel of a consumer delivery (the consumer may be cancelled before it settles).
    group: Option<CreditGroup>,
    /// When it comes back if not settled (a visibility timeout).
    deadline: Option<u64>,
    /// When its consumer is cancelled if it is not settled (a consumer timeout).
    ack_deadline: Option<u64>,
}

#[derive(Clone, Debug)]
struct Consumer {
    spec: ConsumerSpec,
    /// Unacked messages it holds.
    held: u32,
    /// Waiting in `service`.
    in_service: bool,
    /// Its own `x-visibility-timeout` (ms), overriding the queue's.
    visibility_ms: Option<u64>,
    /// Its own `x-consumer-timeout` (ms), overriding the queue's.
    ack_timeout_ms: Option<u64>,
}

/// A consumer's timeout argument (`x-visibility-timeout`, `x-consumer-timeout`; validated by
/// the broker: a positive integer of ms).
fn consumer_timeout(arguments: &FieldTable, key: &str) -> Option<u64> {
    arguments
        .get(key)
        .and_then(|v| v.as_u64())
        .filter(|ms| *ms > 0)
}

/// A message enqueued behind this many ready ones is taken as one that waits, whatever room
/// the consumers have (a checkout hands out a bounded batch at a time).
const TAKES_AT_ONCE_MAX: u64 = 256;

/// The queue state machine. `M` is the message (cheap to clone: a fan-out clones it).
#[derive(Clone, Debug)]
pub struct QueueMachine<M: crate::Payload> {
    next_id: u64,
    /// The head of the ready line, in memory, in id order.
    ready: VecDeque<Entry<M>>,
    /// The rest of the ready line (every id above `ready`'s), once the queue pages: runs on
    /// disk and messages still in memory (not yet written, or not pageable). Empty while the
    /// queue is shallow: then new messages go to `ready`.
    tail: VecDeque<Slot<M>>,
    /// Messages in `tail`, paged or not.
    tail_count: u64,
    /// Runs in `tail` (paged: on disk).
    tail_runs: usize,
    /// Packed runs in `tail` ([`Self::pack_line`]: node-local, not part of the state).
    tail_packed: usize,
    /// Ready messages with ids up to this were looked at by [`Self::pack_line`] (node-local).
    pack_seen: u64,
    /// Tail slots whose first ids are up to this were looked at by [`Self::spill_line`]
    /// (node-local).
    spill_seen: u64,
    /// Tail messages with smaller ids were considered by a `PageOut` already.
    paged_below: u64,
    /// Messages ever paged out, and ever read back (statistics; part of the state, so a
    /// replay that misses a `PageOut` or a `Load` is caught even when a purge erased it).
    paged_out_total: u64,
    loaded_total: u64,
    returned: BTreeMap<u64, Entry<M>>,
    /// The ready messages of a queue with `x-max-priority`, by (priority, reversed; id): the
    /// first is the next to go. Such a queue keeps its ready messages here and nowhere else.
    by_priority: BTreeMap<(u8, u64), Entry<M>>,
    in_flight: BTreeMap<u64, InFlight<M>>,
    consumers: BTreeMap<ConsumerId, Consumer>,
    /// Consumers that may take a message, by priority, in round-robin order.
    service: Service,
    /// What the declaration asks for.
    policy: Policy,
    /// With `x-single-active-consumer`: the one consumer that receives.
    active: Option<ConsumerId>,
    /// The last time the queue was used (declared, consumed from, polled): `x-expires`.
    last_used: u64,
    /// Channels with a credit other than the default (unblocked, no limit).
    credit: BTreeMap<CreditGroup, Credit>,
    exclusive_consumer: Option<ConsumerId>,
    /// auto-delete queues are deleted when their last consumer goes, if they ever had one.
    has_had_consumers: bool,
    /// `(deadline, msg_id)` of in-flight messages with a visibility timeout.
    visibility: BTreeSet<(u64, u64)>,
    /// `(deadline, msg_id)` of consumer deliveries with a consumer timeout.
    ack_deadlines: BTreeSet<(u64, u64)>,
    /// The timers of the in-flight messages that have one, by message id.
    timers: BTreeMap<u64, Timers>,
    /// Messages waiting for a delayed retry (counted as ready, not deliverable until due), and
    /// `(due, msg_id)` of them.
    retrying: BTreeMap<u64, (u64, Entry<M>)>,
    retry_due: BTreeSet<(u64, u64)>,
    /// Bytes of the messages waiting for a retry (in `ready_bytes` too).
    retrying_bytes: u64,
    /// Publishes held back until they are due ([`Command::EnqueueWith`]), by `(due, seq)`;
    /// the next `seq`, and their bytes (not in `ready_bytes`: they are not in the queue yet).
    held: BTreeMap<(u64, u64), (M, MsgMeta)>,
    held_seq: u64,
    held_bytes: u64,
    /// The deduplication window ([`DedupWindow`]): each key taken, until when and its
    /// insertion number; the keys in insertion order (one inserted again after it was
    /// forgotten is in it twice: the number tells the live one); the next number.
    dedup: BTreeMap<DedupKey, (u64, u64)>,
    dedup_order: VecDeque<(DedupKey, u64)>,
    dedup_next: u64,
    /// Dead-lettered messages kept until their dead letters are safe
    /// ([`Policy::hold_dead_letters`]), by id.
    dead: BTreeMap<u64, Dead<M>>,
    /// `(expires_at, msg_id)` of ready messages with a TTL.
    expiries: BTreeSet<(u64, u64)>,
    /// The same for messages of the line whose expiries come in id order (a queue TTL: each
    /// message expires after the one before it): a deque, so the common case costs no tree
    /// node per message. Every entry's message is in `ready`, or in the tail of a queue that
    /// does not page (a packed line's: [`Self::pack_line`]); `expiries` holds the rest. The
    /// pairs of a run written out of memory are folded while it is out (node-local).
    expiries_in_order: in_order::InOrder,
    ready_bytes: u64,
    in_flight_bytes: u64,
    /// Message groups with a message in flight or waiting for its retry, and that message's
    /// id: the group's next message waits until it is settled or dead-lettered.
    group_locks: BTreeMap<GroupKey, u64>,
    /// Ready messages of locked groups, set aside when they reached the head of the line, in
    /// id order per group (counted as ready, in `ready_bytes` too).
    parked: BTreeMap<GroupKey, BTreeMap<u64, Entry<M>>>,
    parked_count: usize,
    /// The line's census ([`Policy::index_groups`]), derived from the line and kept by every
    /// change to it (not part of the state: digests and snapshots ignore it): the ready
    /// messages of each group in the line, parked or in runs paged out here (not those waiting
    /// for a retry), those in no group, those of runs restored from the store (whose groups
    /// nobody read yet), and how many groups are open (not locked, with a message in the line
    /// that is not parked).
    line_groups: BTreeMap<GroupKey, u64>,
    line_ungrouped: u64,
    line_unknown: u64,
    open_groups: u64,
    /// Publishers that may resend ([`Command::EnqueueFrom`]), while their channel lives.
    enqueuers: BTreeMap<EnqueuerId, Enqueuer>,
    /// Expiry caps ([`Command::CapExpiry`]) still owed to messages on disk, whose stored
    /// expiry predates them: `(up to id, expires at)` in id order, applied when they are read
    /// back.
    expiry_caps: Vec<(u64, u64)>,
    /// A message due at once (a TTL of 0) arrived at this time with a consumer waiting: until
    /// the checkout that follows, ready messages expire as at this time. RabbitMQ hands such a
    /// message over as it arrives; here deliveries come from the checkout the broker runs at
    /// its next dispatch, at a later time, when the message would have expired. What is ahead
    /// of it is judged alike: a consumer waiting then would have taken that first. Part of the
    /// state, so every member of a replicated queue, and a replay, judge that checkout alike.
    handoff: Option<u64>,
    /// The last applied command's index and the latest time seen.
    last_index: u64,
    now_ms: u64,
}

impl<M: crate::Payload> Default for QueueMachine<M> {
    fn default() -> Self {
        QueueMachine {
            next_id: 0,
            ready: VecDeque::new(),
            tail: VecDeque::new(),
            tail_count: 0,
            tail_runs: 0,
            tail_packed: 0,
            pack_seen: 0,
            spill_seen: 0,
            paged_below: 0,
            paged_out_total: 0,
            loaded_total: 0,
            returned: BTreeMap::new(),
            by_priority: BTreeMap::new(),
            in_flight: BTreeMap::new(),
            consumers: BTreeMap::new(),
            service: Service::default(),
            policy: Policy::default(),
            active: None,
            last_used: 0,
            credit: BTreeMap::new(),
            exclusive_consumer: None,
            has_had_consumers: false,
            visibility: BTreeSet::new(),
            ack_deadlines: BTreeSet::new(),
            timers: BTreeMap::new(),
            retrying: BTreeMap::new(),
            retry_due: BTreeSet::new(),
            retrying_bytes: 0,
            held: BTreeMap::new(),
            held_seq: 0,
            held_bytes: 0,
            dedup: BTreeMap::new(),
            dedup_order: VecDeque::new(),
            dedup_next: 0,
            dead: BTreeMap::new(),
            expiries: BTreeSet::new(),
            expiries_in_order: in_order::InOrder::default(),
            ready_bytes: 0,
            in_flight_bytes: 0,
            group_locks: BTreeMap::new(),
            parked: BTreeMap::new(),
            parked_count: 0,
            line_groups: BTreeMap::new(),
            line_ungrouped: 0,
            line_unknown: 0,
            open_groups: 0,
            enqueuers: BTreeMap::new(),
            expiry_caps: Vec::new(),
            handoff: None,
            last_index: 0,
            now_ms: 0,
        }
    }
}

impl<M: Clone + Hash + crate::Payload> QueueMachine<M> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Runs one command: the only way the state changes. Effects are appended to `effects`
    /// (a buffer the caller reuses, so the hot path allocates nothing here).
    pub fn apply(
        &mut self,
        meta: Meta,
        command: Command<M>,
        effects: &mut Vec<Effect<M>>,
    ) -> Reply {
        self.last_index = self.last_index.max(meta.index);
        self.now_ms = self.now_ms.max(meta.now_ms);
        // Checkout and basic.get deliver on their own; paging and recovery are this node's.
        let may_deliver = !command.is_node_local()
            && !matches!(
                command,
                Command::Checkout { .. } | Command::Get { .. } | Command::GetBy { .. }
            );
        let reply = match command {
            Command::Enqueue { message, meta } => self.enqueue_new(message, meta, effects),
            Command::EnqueueFrom {
                enqueuer,
                seq,
                message,
                meta,
            } => self.enqueue_from(enqueuer, seq, (message, meta), (0, None), effects),
            Command::EnqueueWith {
                delay_ms,
                from,
                dedup,
                message,
                meta,
            } => {
                let with = (delay_ms, dedup.map(|w| *w));
                match from {
                    Some((enqueuer, seq)) => {
                        self.enqueue_from(enqueuer, seq, (message, meta), with, effects)
                    }
                    None => self.enqueue_or_hold(message, meta, with, effects),
                }
            }
            Command::Unregister { enqueuer } => match self.enqueuers.remove(&enqueuer) {
                Some(_) => Reply::Ok,
                None => Reply::Stale,
            },
            Command::Down { node } => self.down(node, effects),
            Command::Restore {
                msg_id,
                message,
                meta,
                delivery_count,
                redelivered,
                retry_at,
            } => self.restore(
                msg_id,
                message,
                meta,
                (delivery_count, retry_at),
                redelivered,
            ),
            Command::SkipIds { next_id } => {
                self.next_id = self.next_id.max(next_id);
                Reply::Ok
            }
            Command::RestoreRun {
                first_id,
                last_id,
                count,
                bytes,
                redelivered,
                expires_min,
            } => self.restore_run(first_id, last_id, count, bytes, redelivered, expires_min),
            Command::PageOut {
                keep,
                keep_bytes,
                upto_id,
            } => Reply::Paged {
                count: self.page_out(keep, keep_bytes, upto_id),
            },
            Command::Load {
                messages,
                through_id,
            } => {
                let reply = self.load(messages, through_id);
                // What expired on disk goes now, before a checkout could hand it out.
                self.expire(effects);
                // A limit lowered while the head was on disk trims what came back.
                self.drop_over_limit(effects);
                reply
            }
            Command::Consume { id, spec } => {
                self.last_used = self.now_ms;
                self.consume(id, spec)
            }
            Command::Cancel { id } => {
                self.last_used = self.now_ms;
                self.cancel(id)
            }
            Command::Credit { group, credit } => {
                self.set_credit(group, credit);
                Reply::Ok
            }
            Command::Checkout { max } => {
                // Nothing expired goes out, whether or not its tick has come yet.
                self.expire(effects);
                let count = self.checkout(max, effects);
                self.end_handoff(effects);
                Reply::Delivered { count }
            }
            Command::Get { no_ack } => self.get(no_ack, 0, effects),
            Command::GetBy { no_ack, node } => self.get(no_ack, node, effects),
            Command::Settle { receipt } => match self.take_in_flight(receipt) {
                Some(entry) => {
                    self.group_done(&entry);
                    Reply::Ok
                }
                None => self.settle_late(receipt, effects),
            },
            Command::Return { receipt } => match self.take_in_flight(receipt) {
                Some(entry) => {
                    self.back_to_ready(entry, true, effects);
                    Reply::Ok
                }
                None => Reply::Stale,
            },
            Command::Release { receipt } => match self.take_in_flight(receipt) {
                Some(entry) => {
                    self.back_to_ready(entry, false, effects);
                    Reply::Ok
                }
                None => Reply::Stale,
            },
            Command::Discard { receipt } => match self.take_in_flight(receipt) {
                Some(entry) => {
                    self.group_done(&entry);
                    self.dead_letter(
                        entry.id,
                        entry.msg,
                        entry.delivery_count,
                        DeadLetterReason::Rejected,
                        effects,
                    );
                    Reply::Ok
                }
                None => Reply::Stale,
            },
            Command::Purge => Reply::Purged {
                count: self.purge(),
            },
            Command::Tick => {
                self.consumers_time_out(effects);
                self.time_out(effects);
                self.retries_due();
                self.held_due(effects);
                self.expire(effects);
                if self.queue_expiry().is_some_and(|at| at <= self.now_ms) {
                    Reply::QueueExpired
                } else {
                    Reply::Ok
                }
            }
            Command::Configure(policy) => {
                // A new policy restarts the x-expires lease (it may have set one); the same
                // one again (a replicated queue's leader puts it in the log at each term) not.
                if self.policy != policy {
                    self.last_used = self.now_ms;
                }
                self.policy = policy;
                // A policy may lower a limit on a queue that already holds messages.
                self.drop_over_limit(effects);
                // A replicated queue's new leader puts its Configure first in its term: a
                // handoff from before the failover, whose checkout never came, ends here rather
                // than at the new leader's first checkout, however late that is.
                self.end_handoff(effects);
                Reply::Ok
            }
            Command::Touch => {
                self.last_used = self.now_ms;
                Reply::Ok
            }
            Command::CapExpiry { caps } => {
                self.cap_expiry(caps, effects);
                Reply::Ok
            }
            Command::Extend {
                receipt,
                timeout_ms,
            } => self.extend(receipt, timeout_ms),
            Command::DeadLettered { ids } => {
                let before = self.dead.len();
                for id in ids {
                    self.dead.remove(&id);
                }
                if self.dead.len() < before {
                    Reply::Ok
                } else {
                    Reply::Stale
                }
            }
        };
        if may_deliver && self.policy.deliver_on_apply {
            // As a Checkout would: nothing expired goes out.
            self.expire(effects);
            self.checkout(AUTO_CHECKOUT_MAX, effects);
            self.end_handoff(effects);
        }
        if self.handoff.is_some() && !self.has_work() {
            // No checkout is coming for it (the consumer left or ran out of credit): expiry
            // goes by the clock again, and the next tick drops what the handoff kept. Not here:
            // the callers of most commands expect no dead letters from them.
            self.handoff = None;
        }
        self.shrink_drained();
        reply
    }

    /// Gives back the room of a line that drained: a deque keeps its largest capacity, so a
    /// queue that once held a million messages kept about 220 MB of empty slots (twice on a
    /// replicated queue's leader) for as long as it lived. Halving at least each time it is
    /// four times larger than needed costs a copy of what is left, amortised over the
    /// removals that made it so. Not part of the state (digests and snapshots ignore it).
    fn shrink_drained(&mut self) {
        fn shrink<T>(line: &mut VecDeque<T>) {
            if line.capacity() > SHRINK_ABOVE && line.capacity() / 4 > line.len() {
                line.shrink_to(line.len() * 2);
            }
        }
        shrink(&mut self.ready);
        shrink(&mut self.tail);
        self.expiries_in_order.shrink(SHRINK_ABOVE);
    }

    fn enqueue_new(&mut self, message: M, meta: MsgMeta, effects: &mut Vec<Effect<M>>) -> Reply {
        if self.rejects(meta.size) {
            return Reply::Refused(Refusal::Full);
        }
        let msg_id = self.enqueue(message, meta);
        self.drop_over_limit(effects);
        // Any later checkout would find it expired: the one owed to the waiting consumer judges
        // expiry at this time.
        if meta.expires_at.is_some_and(|at| at <= self.now_ms) && self.has_work() {
            self.handoff.get_or_insert(self.now_ms);
        }
        Reply::Enqueued { msg_id }
    }

    /// A publish enqueued now, or held `delay_ms` if it has one; with a deduplication
    /// window, dropped as a `Duplicate` if its key was taken within it, else remembered once
    /// taken.
    fn enqueue_or_hold(
        &mut self,
        message: M,
        meta: MsgMeta,
        (delay_ms, dedup): (u64, Option<DedupWindow>),
        effects: &mut Vec<Effect<M>>,
    ) -> Reply {
        if let Some(w) = dedup {
            self.forget_keys(w.max_keys);
            let now = self.now_ms;
            if self
                .dedup
                .get(&w.key)
                .is_some_and(|(until, _)| *until > now)
            {
                return Reply::Duplicate;
            }
        }
        let reply = if delay_ms > 0 {
            self.hold(self.now_ms.saturating_add(delay_ms), message, meta);
            Reply::Ok
        } else {
            self.enqueue_new(message, meta, effects)
        };
        if let (Some(w), Reply::Ok | Reply::Enqueued { .. }) = (dedup, reply) {
            let number = self.dedup_next;
            self.dedup_next = number.wrapping_add(1);
            let until = self.now_ms.saturating_add(w.ttl_ms);
            self.dedup.insert(w.key, (until, number));
            self.dedup_order.push_back((w.key, number));
            self.forget_keys(w.max_keys);
        }
        reply
    }

    /// Forgets the window's keys that expired and, oldest first, those past `max_keys`.
    /// Numbers start over once it is empty, so that a state with no key is the same whatever
    /// came before (a snapshot then carries none of this).
    fn forget_keys(&mut self, max_keys: u32) {
        let now = self.now_ms;
        while let Some(&(key, number)) = self.dedup_order.front() {
            let live = self.dedup.get(&key).filter(|(_, n)| *n == number).copied();
            let drop = match live {
                None => true,
                Some((until, _)) => self.dedup.len() > max_keys as usize || until <= now,
            };
            if !drop {
                break;
            }
            if live.is_some() {
                self.dedup.remove(&key);
            }
            self.dedup_order.pop_front();
        }
        if self.dedup.is_empty() {
            self.dedup_order.clear();
            self.dedup_next = 0;
        } else if self.dedup_order.len() > 2 * self.dedup.len() + 64 {
            // Keys taken again leave their earlier places behind, gone only once they reach
            // the front: a long-lived key there would let them pile up (every member keeps
            // them, every snapshot carries them).
            let keys = &self.dedup;
            self.dedup_order
                .retain(|(key, number)| keys.get(key).is_some_and(|(_, n)| n == number));
        }
    }

    fn hold(&mut self, due: u64, message: M, meta: MsgMeta) {
        let seq = self.held_seq;
        self.held_seq = seq.wrapping_add(1);
        self.held_bytes = self.held_bytes.saturating_add(meta.size);
        self.held.insert((due, seq), (message, meta));
    }

    /// Held publishes whose time came are enqueued, in due order. One a full queue refuses
    /// (`reject-publish`) is held back again [`HELD_BACK_MS`] later, as a node's delayed
    /// release into a full queue is; `reject-publish-dlx` dead-letters it.
    fn held_due(&mut self, effects: &mut Vec<Effect<M>>) {
        while let Some(entry) = self.held.first_entry() {
            let due = entry.key().0;
            if due > self.now_ms {
                break;
            }
            let (message, mut meta) = entry.remove();
            self.held_bytes = self.held_bytes.saturating_sub(meta.size);
            if !self.rejects(meta.size) {
                self.enqueue_new(message, meta, effects);
                continue;
            }
            if self.policy.overflow == Overflow::RejectPublishDlx {
                let msg_id = self.next_id;
                self.next_id += 1;
                self.dead_letter(msg_id, message, 0, DeadLetterReason::MaxLen, effects);
            } else {
                // Its time to live counts from when the queue takes it, as a classic queue's
                // delayed release recomputes it: moved as far as its due time.
                let again = self.now_ms.saturating_add(HELD_BACK_MS);
                meta.expires_at = meta
                    .expires_at
                    .map(|at| at.saturating_add(again.saturating_sub(due)));
                self.hold(again, message, meta);
            }
        }
        if self.held.is_empty() {
            // Numbers start over, so that a state with none held is the same whatever came
            // before (a snapshot then carries none of this).
            self.held_seq = 0;
        }
    }

    /// After a checkout: what the handoff kept and no consumer took expires by the clock.
    fn end_handoff(&mut self, effects: &mut Vec<Effect<M>>) {
        if self.handoff.take().is_some() {
            self.expire(effects);
        }
    }

    /// The time ready messages expire by: the handoff's while a checkout is owed to a message
    /// due at once (see `handoff`), else now.
    fn expiry_now(&self) -> u64 {
        self.handoff.unwrap_or(self.now_ms)
    }

    /// An enqueue with a publisher sequence: a resend of a decided one changes nothing (see
    /// [`Command::EnqueueFrom`]).
    fn enqueue_from(
        &mut self,
        enqueuer: EnqueuerId,
        seq: u64,
        (message, meta): (M, MsgMeta),
        with: (u64, Option<DedupWindow>),
        effects: &mut Vec<Effect<M>>,
    ) -> Reply {
        if let Some(reply) = self.decided(enqueuer, seq) {
            return reply;
        }
        let last = self.enqueuers.get(&enqueuer).map(|e| e.seq);
        match last {
            Some(decided) if seq != decided.saturating_add(1) => {
                return Reply::Refused(Refusal::OutOfOrder)
            }
            None if seq != 1 => return Reply::Refused(Refusal::OutOfOrder),
            _ => {}
        }
        if last.is_none() {
            // The node's earlier enqueuer is done with (it started anew, or restarted).
            let node = enqueuer.node();
            self.enqueuers.retain(|id, _| id.node() != node);
        }
        let reply = self.enqueue_or_hold(message, meta, with, effects);
        let e = self.enqueuers.entry(enqueuer).or_default();
        e.seq = seq;
        if matches!(reply, Reply::Refused(_)) {
            e.refused = Some(seq);
        }
        reply
    }

    fn get(&mut self, no_ack: bool, node: NodeId, effects: &mut Vec<Effect<M>>) -> Reply {
        self.last_used = self.now_ms;
        self.expire(effects);
        let count = match self.pop_deliverable() {
            Some(entry) => {
                let d = self.hand_out(entry, Err(node), no_ack, (None, None));
                effects.push(Effect::Deliver(d));
                1
            }
            None => 0,
        };
        Reply::Delivered { count }
    }

    /// `node` is gone: its consumers, their deliveries and its basic.gets go (see
    /// [`Command::Down`]).
    fn down(&mut self, node: NodeId, effects: &mut Vec<Effect<M>>) -> Reply {
        let gone: Vec<ConsumerId> = self
            .consumers
            .iter()
            .filter(|(_, c)| node_of(c.spec.group.conn) == node)
            .map(|(id, _)| *id)
            .collect();
        let mut reply = Reply::Ok;
        for id in &gone {
            reply = self.cancel(*id);
        }
        if !gone.is_empty() {
            self.last_used = self.now_ms;
        }
        // By the holder's node, and by the consumers just cancelled too: a consumer's id names
        // its channel's node, but a caller that broke that rule must not strand a delivery.
        let held: Vec<Receipt> = self
            .in_flight
            .iter()
            .filter(|(_, f)| {
                f.holder.node() == node
                    || f.holder
                        .consumer()
                        .is_some_and(|c| gone.binary_search(&c).is_ok())
            })
            .map(|(id, f)| Receipt {
                msg_id: *id,
                attempt: f.entry.delivery_count,
            })
            .collect();
        for receipt in held {
            if let Some(entry) = self.take_in_flight(receipt) {
                self.back_to_ready(entry, false, effects);
            }
        }
        reply
    }

    /// A message that was in flight goes back to its place in the ready line, unless it has
    /// used up its delivery limit (dead-lettered, reason `delivery_limit`); a queue back over
    /// its length limit drops its head.
    fn back_to_ready(&mut self, entry: Entry<M>, retry: bool, effects: &mut Vec<Effect<M>>) {
        let limit = self.policy.delivery_limit;
        if limit.is_some_and(|l| u64::from(entry.delivery_count) > l) {
            self.group_done(&entry);
            self.dead_letter(
                entry.id,
                entry.msg,
                entry.delivery_count,
                DeadLetterReason::DeliveryLimit,
                effects,
            );
            return;
        }
        // It may wait now: it no longer shares the buffer it arrived in (one a consumer took
        // at once was not copied out of it).
        let mut entry = entry;
        entry.msg.detach();
        self.ready_bytes = self.ready_bytes.saturating_add(entry.meta.size);
        if let Some(r) = self.policy.retry.filter(|_| retry) {
            // Waits for its retry (its group stays locked: nothing overtakes it); its expiry is
            // filed when it is due.
            let at = self
                .now_ms
                .saturating_add(r.delay(entry.id, entry.delivery_count));
            self.retry_due.insert((at, entry.id));
            self.retrying_bytes = self.retrying_bytes.saturating_add(entry.meta.size);
            self.retrying.insert(entry.id, (at, entry));
            return;
        }
        // Back in the line in its place: its group's next message may not overtake it (ids).
        self.group_done(&entry);
        self.line_in(entry.meta.group);
        self.rejoin_line(entry);
        // Back at the head, over the limit: drop-head drops it again at once.
        self.drop_over_limit(effects);
    }

    /// A message leaves the queue unacknowledged: its `DeadLetter` effect, and, when dead letters
    /// are held ([`Policy::hold_dead_letters`]), a copy kept until [`Command::DeadLettered`].
    fn dead_letter(
        &mut self,
        msg_id: u64,
        message: M,
        delivery_count: u32,
        reason: DeadLetterReason,
        effects: &mut Vec<Effect<M>>,
    ) {
        if self.policy.hold_dead_letters {
            let dead = Dead {
                message: message.clone(),
                delivery_count,
                reason,
            };
            self.dead.insert(msg_id, dead);
        }
        effects.push(Effect::DeadLetter {
            msg_id,
            message,
            delivery_count,
            reason,
        });
    }

    /// The message that held its group's lock left flight (settled, dead-lettered, back in the
    /// line): the group's next parked message rejoins the line.
    #[inline]
    fn group_done(&mut self, entry: &Entry<M>) {
        if self.group_locks.is_empty() {
            return;
        }
        let Some(g) = entry.meta.group else { return };
        if self.group_locks.get(&g) != Some(&entry.id) {
            return;
        }
        self.regroup(g, |m| {
            m.group_locks.remove(&g);
            m.unpark(g);
        });
    }

    /// A ready message left the line without being delivered (expired, dropped, settled
    /// late): if it was its group's way forward, the group's next parked message takes its
    /// place, so an unlocked group never waits behind nothing.
    fn left_line(&mut self, entry: &Entry<M>) {
        if let Some(g) = entry
            .meta
            .group
            .filter(|g| !self.group_locks.contains_key(g))
        {
            self.regroup(g, |m| m.unpark(g));
        }
    }

    /// Whether group `g` is open: not locked, with a message in the line that is not parked.
    fn is_open(&self, g: GroupKey) -> bool {
        !self.group_locks.contains_key(&g)
            && self.line_groups.get(&g).copied().unwrap_or(0)
                > self.parked.get(&g).map_or(0, |line| line.len() as u64)
    }

    /// Runs `f`, a change to group `g`'s lock, parked messages or count, and keeps
    /// `open_groups` (never nested: each call counts the change it sees).
    fn regroup<R>(&mut self, g: GroupKey, f: impl FnOnce(&mut Self) -> R) -> R {
        let before = self.is_open(g);
        let r = f(self);
        match (before, self.is_open(g)) {
            (false, true) => self.open_groups += 1,
            (true, false) => self.open_groups = self.open_groups.saturating_sub(1),
            _ => {}
        }
        r
    }

    /// Counts a ready message into (`up`) or out of the line's census, alone: the callers
    /// keep `open_groups` ([`Self::line_in`], [`Self::line_out`], [`Self::regroup`]).
    fn tally(&mut self, group: Option<GroupKey>, up: bool) {
        match group {
            None if up => self.line_ungrouped += 1,
            None => self.line_ungrouped = self.line_ungrouped.saturating_sub(1),
            Some(g) if up => *self.line_groups.entry(g).or_insert(0) += 1,
            Some(g) => {
                if let Some(n) = self.line_groups.get_mut(&g) {
                    *n = n.saturating_sub(1);
                    if *n == 0 {
                        self.line_groups.remove(&g);
                    }
                }
            }
        }
    }

    /// A ready message joins the line (or leaves it, `line_out`): the census follows.
    fn line_in(&mut self, group: Option<GroupKey>) {
        match group {
            None => self.tally(None, true),
            Some(g) => self.regroup(g, |m| m.tally(Some(g), true)),
        }
    }

    fn line_out(&mut self, group: Option<GroupKey>) {
        match group {
            None => self.tally(None, false),
            Some(g) => self.regroup(g, |m| m.tally(Some(g), false)),
        }
    }

    /// Nothing in the line may go out now, as the census tells ([`Policy::index_groups`]):
    /// every message in it is of a locked group, and no run restored from the store is unread.
    fn line_blocked(&self) -> bool {
        self.policy.index_groups
            && self.open_groups == 0
            && self.line_ungrouped == 0
            && self.line_unknown == 0
    }

    /// The group's first parked message rejoins the line.
    fn unpark(&mut self, g: GroupKey) {
        let Some(line) = self.parked.get_mut(&g) else {
            return;
        };
        let next = line.pop_first();
        if line.is_empty() {
            self.parked.remove(&g);
        }
        if let Some((_, next)) = next {
            self.parked_count = self.parked_count.saturating_sub(1);
            self.rejoin_line(next);
        }
    }

    /// Takes the parked message with the smallest id (for `drop-head`).
    fn pop_parked(&mut self) -> Option<Entry<M>> {
        let (&g, _) = self
            .parked
            .iter()
            .min_by_key(|(_, line)| line.keys().next().copied().unwrap_or(u64::MAX))?;
        let e = self.regroup(g, |m| {
            let line = m.parked.get_mut(&g)?;
            let (_, e) = line.pop_first()?;
            if line.is_empty() {
                m.parked.remove(&g);
            }
            m.tally(Some(g), false);
            Some(e)
        })?;
        self.parked_count = self.parked_count.saturating_sub(1);
        self.ready_bytes = self.ready_bytes.saturating_sub(e.meta.size);
        Some(e)
    }

    /// The next ready message that may go out now. One of a group whose lock another message
    /// holds is set aside (parked) until that one is done, so a group never has two messages
    /// in flight, and other groups' messages go past it.
    #[inline]
    fn pop_deliverable(&mut self) -> Option<Entry<M>> {
        if self.group_locks.is_empty() && self.parked.is_empty() {
            // No group waits for anything: the head goes.
            let entry = self.pop_ready()?;
            self.line_out(entry.meta.group);
            return Some(entry);
        }
        if self.line_blocked() {
            // The walk would set the whole line aside and find nothing.
            return None;
        }
        loop {
            let entry = self.pop_ready()?;
            let Some(g) = entry.meta.group else {
                self.tally(None, false);
                return Some(entry);
            };
            if self
                .group_locks
                .get(&g)
                .is_none_or(|holder| *holder == entry.id)
            {
                return Some(self.regroup(g, |m| {
                    m.tally(Some(g), false);
                    // An earlier message of the group parked meanwhile goes first.
                    let earlier = m
                        .parked
                        .get_mut(&g)
                        .and_then(|line| line.first_entry())
                        .filter(|first| *first.key() < entry.id)
                        .map(|first| first.remove());
                    let Some(earlier) = earlier else {
                        return entry;
                    };
                    if m.parked.get(&g).is_some_and(BTreeMap::is_empty) {
                        m.parked.remove(&g);
                    }
                    m.parked.entry(g).or_default().insert(entry.id, entry);
                    earlier
                }));
            }
            // Its expiry is filed again when it rejoins the line.
            self.ready_bytes = self.ready_bytes.saturating_add(entry.meta.size);
            self.parked_count += 1;
            // By id: one that rejoined the line and was parked again keeps its place.
            self.regroup(g, |m| {
                m.parked.entry(g).or_default().insert(entry.id, entry)
            });
            if self.line_blocked() {
                // What is left of the line is all of locked groups: it stays where it is.
                return None;
            }
        }
    }

    /// A message that was delivered goes back to its place in the ready line (counted in
    /// `ready_bytes` already).
    fn rejoin_line(&mut self, entry: Entry<M>) {
        if let Some(at) = entry.meta.expires_at {
            self.expiries.insert((at, entry.id));
        }
        if self.policy.max_priority.is_some() {
            self.by_priority
                .insert((u8::MAX - entry.meta.priority, entry.id), entry);
        } else {
            self.returned.insert(entry.id, entry);
        }
    }

    /// The `by_priority` level holding message `id` (if it passes `test`), found by trying each
    /// level the queue has (few: `x-max-priority`).
    fn priority_level(&self, id: u64, test: impl Fn(&Entry<M>) -> bool) -> Option<u8> {
        let max = self.policy.max_priority?;
        (u8::MAX - max..=u8::MAX).find(|p| self.by_priority.get(&(*p, id)).is_some_and(&test))
    }

    /// Messages whose retry delay has passed join the ready line.
    fn retries_due(&mut self) {
        while let Some(&(at, id)) = self.retry_due.first() {
            if at > self.now_ms {
                break;
            }
            self.retry_due.pop_first();
            if let Some((_, entry)) = self.retrying.remove(&id) {
                self.retrying_bytes = self.retrying_bytes.saturating_sub(entry.meta.size);
                self.group_done(&entry);
                self.line_in(entry.meta.group);
                self.rejoin_line(entry);
            }
        }
    }

    /// Deliveries whose visibility deadline has passed come back (the consumer and its
    /// channel stay; the consumer gets its credit back).
    fn time_out(&mut self, effects: &mut Vec<Effect<M>>) {
        while let Some(&(at, id)) = self.visibility.first() {
            if !expired(at, self.now_ms) {
                break;
            }
            self.visibility.pop_first();
            self.return_timed_out(id, effects);
        }
    }

    /// An in-flight message comes back because a timeout passed.
    fn return_timed_out(&mut self, id: u64, effects: &mut Vec<Effect<M>>) {
        let Some(f) = self.in_flight.get(&id) else {
            return;
        };
        let receipt = Receipt {
            msg_id: id,
            attempt: f.entry.delivery_count,
        };
        let group = self.timers.get(&id).and_then(|t| t.group);
        let Some(mut entry) = self.take_in_flight(receipt) else {
            return;
        };
        entry.timed_out = true;
        effects.push(Effect::TimedOut {
            msg_id: id,
            attempt: receipt.attempt,
            group,
            message: entry.msg.clone(),
        });
        self.back_to_ready(entry, true, effects);
    }

    /// Consumers that left a delivery unsettled past their consumer timeout are cancelled, and
    /// every delivery they hold comes back (RabbitMQ 4.3's `x-consumer-timeout`). A delivery
    /// whose consumer was cancelled already comes back alone.
    fn consumers_time_out(&mut self, effects: &mut Vec<Effect<M>>) {
        while let Some(&(at, id)) = self.ack_deadlines.first() {
            if !expired(at, self.now_ms) {
                break;
            }
            self.ack_deadlines.pop_first();
            let Some(cid) = self.in_flight.get(&id).and_then(|f| f.holder.consumer()) else {
                continue;
            };
            let Some(c) = self.consumers.get(&cid) else {
                self.return_timed_out(id, effects);
                continue;
            };
            let timeout_ms = c
                .ack_timeout_ms
                .or(self.policy.consumer_timeout_ms)
                .unwrap_or(0);
            let (group, tag) = (c.spec.group, c.spec.tag.clone());
            self.cancel(cid);
            self.last_used = self.now_ms;
            effects.push(Effect::ConsumerTimedOut {
                consumer: cid,
                group,
                tag,
                timeout_ms,
            });
            let held: Vec<u64> = self
                .in_flight
                .iter()
                .filter(|(_, f)| f.holder == Holder::Consumer(cid))
                .map(|(id, _)| *id)
                .collect();
            for mid in held {
                self.return_timed_out(mid, effects);
            }
        }
    }

    fn extend(&mut self, receipt: Receipt, timeout_ms: u64) -> Reply {
        let now = self.now_ms;
        let Some(f) = self
            .in_flight
            .get_mut(&receipt.msg_id)
            .filter(|f| f.entry.delivery_count == receipt.attempt)
        else {
            return Reply::Stale;
        };
        // A delivery that had no timer yet: its channel is its consumer's, if it is still here.
        let group = f
            .holder
            .consumer()
            .and_then(|c| self.consumers.get(&c))
            .map(|c| c.spec.group);
        let t = self.timers.entry(receipt.msg_id).or_insert(Timers {
            group,
            ..Timers::default()
        });
        if let Some(old) = t.deadline.take() {
            self.visibility.remove(&(old, receipt.msg_id));
        }
        let at = now.saturating_add(timeout_ms);
        t.deadline = Some(at);
        self.visibility.insert((at, receipt.msg_id));
        Reply::Ok
    }

    /// An ack whose delivery is no longer current. If its delivery timed out and the message
    /// is back in the ready line, delivered to nobody since (its count is the ack's attempt),
    /// the ack still settles it: the work was done. If another delivery holds it now, nothing
    /// changes: a late ack never takes a message from the worker that has it.
    fn settle_late(&mut self, receipt: Receipt, effects: &mut Vec<Effect<M>>) -> Reply {
        let id = receipt.msg_id;
        let current = |e: &Entry<M>| e.timed_out && e.delivery_count == receipt.attempt;
        let mut in_line = true;
        let entry = if self.returned.get(&id).is_some_and(current) {
            self.returned.remove(&id)
        } else if self.retrying.get(&id).is_some_and(|(_, e)| current(e)) {
            in_line = false;
            let e = self.retrying.remove(&id).map(|(at, e)| {
                self.retry_due.remove(&(at, id));
                e
            });
            if let Some(e) = &e {
                self.retrying_bytes = self.retrying_bytes.saturating_sub(e.meta.size);
            }
            e
        } else if let Some(p) = self.priority_level(id, current) {
            self.by_priority.remove(&(p, id))
        } else {
            None
        };
        let Some(e) = entry else {
            return Reply::Stale;
        };
        if in_line {
            self.line_out(e.meta.group);
        }
        // A message waiting for its retry held its group's lock; one in the line may have been
        // its group's way forward.
        self.group_done(&e);
        self.left_line(&e);
        self.ready_bytes = self.ready_bytes.saturating_sub(e.meta.size);
        if let Some(at) = e.meta.expires_at {
            self.expiries.remove(&(at, e.id));
        }
        effects.push(Effect::SettledLate {
            msg_id: e.id,
            message: e.msg,
            delivery_count: e.delivery_count,
        });
        Reply::Ok
    }

    /// Would a message of `size` bytes be refused (`x-overflow` = `reject-publish` or
    /// `reject-publish-dlx` and the queue is full)? As RabbitMQ: refused once the ready
    /// messages have reached the length or the bytes limit.
    pub fn rejects(&self, size: u64) -> bool {
        let _ = size;
        self.policy.overflow != Overflow::DropHead && self.is_full()
    }

    /// Has the ready line reached `x-max-length` or `x-max-length-bytes`?
    fn is_full(&self) -> bool {
        let (count, bytes) = self.limited();
        self.policy.max_length.is_some_and(|n| count >= n)
            || self.policy.max_length_bytes.is_some_and(|n| bytes >= n)
    }

    /// What the length limits count: the ready messages and their bytes, less those waiting
    /// for a retry (delivered already, like the unacked, which do not count either).
    fn limited(&self) -> (u64, u64) {
        let count = self.ready_count().saturating_sub(self.retrying.len()) as u64;
        let bytes = self.ready_bytes.saturating_sub(self.retrying_bytes);
        (count, bytes)
    }

    /// `drop-head`: while the ready line is over a limit, its head goes (dead-lettered with
    /// reason `maxlen`).
    fn drop_over_limit(&mut self, effects: &mut Vec<Effect<M>>) {
        if self.policy.overflow != Overflow::DropHead || !self.policy.limits_length() {
            return;
        }
        while self.over_limit() {
            // Parked messages count too: when the line has nothing droppable, the oldest of
            // them goes.
            let e = match self.pop_ready() {
                Some(e) => {
                    self.line_out(e.meta.group);
                    e
                }
                None => match self.pop_parked() {
                    Some(e) => e,
                    // The head is paged out: trimmed once it is read back.
                    None => break,
                },
            };
            self.left_line(&e);
            self.dead_letter(
                e.id,
                e.msg,
                e.delivery_count,
                DeadLetterReason::MaxLen,
                effects,
            );
        }
    }

    /// When the queue expires if nobody uses it (`x-expires`; only while it has no consumer).
    fn queue_expiry(&self) -> Option<u64> {
        let ms = self.policy.expires_ms?;
        self.consumers
            .is_empty()
            .then(|| self.last_used.saturating_add(ms))
    }

    fn enqueue(&mut self, message: M, meta: MsgMeta) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        let maybe_delivered = message.says_redelivered();
        self.push_ready(Entry {
            id,
            msg: message,
            meta,
            delivery_count: 0,
            maybe_delivered,
            timed_out: false,
        });
        id
    }

    fn restore(
        &mut self,
        id: u64,
        message: M,
        meta: MsgMeta,
        (delivery_count, retry_at): (u32, Option<u64>),
        maybe_delivered: bool,
    ) -> Reply {
        let Some(next) = id.checked_add(1).filter(|_| id >= self.next_id) else {
            return Reply::Stale;
        };
        self.next_id = next;
        let entry = Entry {
            id,
            maybe_delivered: maybe_delivered || message.says_redelivered(),
            msg: message,
            meta,
            delivery_count,
            timed_out: false,
        };
        match retry_at.filter(|_| self.policy.retry.is_some()) {
            // It was waiting for its retry: it waits on (until its time, which may have passed:
            // the next tick brings it back then).
            Some(at) => {
                self.ready_bytes = self.ready_bytes.saturating_add(entry.meta.size);
                self.retrying_bytes = self.retrying_bytes.saturating_add(entry.meta.size);
                self.retry_due.insert((at, id));
                self.retrying.insert(id, (at, entry));
            }
            None => self.push_ready(entry),
        }
        Reply::Enqueued { msg_id: id }
    }

    /// Appends a message with the largest id so far to the ready line.
    fn push_ready(&mut self, entry: Entry<M>) {
        self.ready_bytes = self.ready_bytes.saturating_add(entry.meta.size);
        self.line_in(entry.meta.group);
        // Behind a packed line the in-order deque goes on; behind a paged one (or messages a
        // page out left in the tail) it stops.
        let back_of_line = self.policy.max_priority.is_none()
            && (self.tail.is_empty() || (self.tail_packed > 0 && !self.pages()));
        if let Some(at) = entry.meta.expires_at {
            self.track_expiry(at, entry.id, back_of_line);
        }
        if self.policy.max_priority.is_some() {
            self.by_priority
                .insert((u8::MAX - entry.meta.priority, entry.id), entry);
        } else if self.tail.is_empty() {
            self.ready.push_back(entry);
        } else {
            self.tail_count += 1;
            self.tail.push_back(Slot::Msg(entry));
        }
    }

    /// Files a ready message's expiry: in the in-order deque if the message goes to the back of
    /// the line where that deque may reach (`ready`, or the tail of a queue that does not page)
    /// and expires no earlier than the last one there, else in the ordered index.
    fn track_expiry(&mut self, at: u64, id: u64, back_of_line: bool) {
        let in_order = back_of_line
            && self
                .expiries_in_order
                .back()
                .is_none_or(|(last, last_id)| at >= last && id > last_id);
        if in_order {
            self.expiries_in_order.push_back((at, id));
        } else {
            self.expiries.insert((at, id));
        }
    }

    /// A ready message leaves with its expiry (taken from the head of `ready`, or anywhere
    /// else through the index).
    fn untrack_expiry(&mut self, at: u64, id: u64) {
        if self.expiries_in_order.front() == Some((at, id)) {
            self.unfold_front();
            self.expiries_in_order.pop_front();
        } else {
            self.expiries.remove(&(at, id));
        }
    }

    fn restore_run(
        &mut self,
        first: u64,
        last: u64,
        count: u64,
        bytes: u64,
        maybe_delivered: bool,
        expires_min: Option<u64>,
    ) -> Reply {
        let span = last.checked_sub(first).and_then(|d| d.checked_add(1));
        let Some(next) = last
            .checked_add(1)
            .filter(|_| first >= self.next_id && count > 0 && span.is_some_and(|s| count <= s))
        else {
            return Reply::Stale;
        };
        self.next_id = next;
        self.paged_below = self.paged_below.max(next);
        self.tail_count += count;
        self.tail_runs += 1;
        self.line_unknown += count;
        self.ready_bytes = self.ready_bytes.saturating_add(bytes);
        self.tail.push_back(Slot::Paged(Run {
            first,
            last,
            count,
            bytes,
            maybe_delivered,
            spilled: false,
            expires_min,
            counted: false,
        }));
        Reply::Ok
    }

    /// Drops from memory the pageable ready messages past the first `keep` / `keep_bytes`
    /// with ids up to `upto_id`. Runs are contiguous ids: a message that stays in memory (or a
    /// gap) starts a new run, so reading a run's range back finds exactly its messages.
    fn page_out(&mut self, keep: u32, keep_bytes: u64, upto_id: u64) -> u32 {
        let before = self.paged_out_total;
        if self.tail.is_empty() {
            // The line splits once: past the window, everything moves to the tail.
            let (mut n, mut bytes, mut split) = (0u32, 0u64, self.ready.len());
            for (i, e) in self.ready.iter().enumerate() {
                if n >= keep || bytes >= keep_bytes {
                    split = i;
                    break;
                }
                n += 1;
                bytes = bytes.saturating_add(e.meta.size);
            }
            if split == self.ready.len() {
                return 0;
            }
            self.paged_below = 0;
            let moved = self.ready.split_off(split);
            if let Some(first) = moved.front().map(|e| e.id) {
                self.expiries_leave_ready(first);
            }
            self.tail_count += moved.len() as u64;
            self.tail.extend(moved.into_iter().map(Slot::Msg));
        }
        // Only the part of the tail that no earlier PageOut covered is looked at.
        let from = self
            .tail
            .partition_point(|s| s.first_id() < self.paged_below);
        let rest = self.tail.split_off(from);
        let mut paged_below = self.paged_below;
        for slot in rest {
            match slot {
                Slot::Msg(e) if e.meta.pageable && e.id <= upto_id => {
                    paged_below = paged_below.max(e.id + 1);
                    self.paged_out_total += 1;
                    if let Some(at) = e.meta.expires_at {
                        self.expiries.remove(&(at, e.id));
                    }
                    let run = Run {
                        first: e.id,
                        last: e.id,
                        count: 1,
                        bytes: e.meta.size,
                        maybe_delivered: e.maybe_delivered || e.delivery_count > 0,
                        spilled: e.meta.spilled,
                        expires_min: e.meta.expires_at,
                        // Its group stays counted: a checkout knows of it without reading it.
                        counted: true,
                    };
                    match self.tail.back_mut() {
                        Some(Slot::Paged(r))
                            if r.last + 1 == e.id
                                && r.maybe_delivered == run.maybe_delivered
                                && r.spilled == run.spilled
                                && r.counted =>
                        {
                            r.last = e.id;
                            r.count += 1;
                            r.bytes = r.bytes.saturating_add(e.meta.size);
                            r.expires_min = min_opt(r.expires_min, e.meta.expires_at);
                        }
                        _ => {
                            self.tail_runs += 1;
                            self.tail.push_back(Slot::Paged(run));
                        }
                    }
                }
                Slot::Msg(e) if e.id <= upto_id => {
                    paged_below = paged_below.max(e.id + 1);
                    self.tail.push_back(Slot::Msg(e));
                }
                other => self.tail.push_back(other),
            }
        }
        self.paged_below = paged_below;
        u32::try_from(self.paged_out_total - before).unwrap_or(u32::MAX)
    }

    fn load(&mut self, messages: Vec<Loaded<M>>, through_id: u64) -> Reply {
        let Some(&Slot::Paged(run)) = self.tail.front() else {
            return Reply::Stale;
        };
        let in_order = messages.windows(2).all(|w| w[0].msg_id < w[1].msg_id);
        let in_run = messages
            .iter()
            .all(|m| m.msg_id >= run.first && m.msg_id <= run.last.min(through_id));
        if through_id < run.first || !in_order || !in_run {
            return Reply::Stale;
        }
        let mut left = run;
        self.loaded_total += messages.len() as u64;
        for mut m in messages {
            left.count = left.count.saturating_sub(1);
            left.bytes = left.bytes.saturating_sub(m.meta.size);
            m.meta.expires_at = min_opt(m.meta.expires_at, cap_of(&self.expiry_caps, m.msg_id));
            if let Some(at) = m.meta.expires_at {
                self.track_expiry(at, m.msg_id, self.policy.max_priority.is_none());
            }
            self.tail_count = self.tail_count.saturating_sub(1);
            if !run.counted {
                self.line_unknown = self.line_unknown.saturating_sub(1);
                self.line_in(m.meta.group);
            }
            let entry = Entry {
                id: m.msg_id,
                maybe_delivered: run.maybe_delivered || m.message.says_redelivered(),
                msg: m.message,
                meta: m.meta,
                delivery_count: m.delivery_count,
                timed_out: false,
            };
            if self.policy.max_priority.is_some() {
                self.by_priority
                    .insert((u8::MAX - entry.meta.priority, entry.id), entry);
            } else {
                self.ready.push_back(entry);
            }
        }
        if through_id < run.last && left.count > 0 {
            left.first = through_id + 1;
            if let Some(front) = self.tail.front_mut() {
                *front = Slot::Paged(left);
            }
        } else {
            self.tail.pop_front();
            self.tail_runs = self.tail_runs.saturating_sub(1);
            // The run is read to its end: whatever it still counts was not on disk.
            self.tail_count = self.tail_count.saturating_sub(left.count);
            if !run.counted {
                self.line_unknown = self.line_unknown.saturating_sub(left.count);
            }
            // (A counted run's missing messages stay in their groups' counts: a census that
            // counts too many only walks the line as before.)
            self.ready_bytes = self.ready_bytes.saturating_sub(left.bytes);
        }
        self.settle_tail();
        Reply::Ok
    }

    /// [`Command::CapExpiry`]: every ready and delivered message takes its cap now (the
    /// expiry index is rebuilt: a policy change is rare), paged runs their first id's (the
    /// earliest of the run's), and the caps are kept for the paged messages' reads.
    fn cap_expiry(&mut self, mut caps: Vec<(u64, u64)>, effects: &mut Vec<Effect<M>>) {
        // Only ids given so far: a later message comes with the TTL in force.
        let last = self.next_id.saturating_sub(1);
        caps.sort_unstable();
        caps.dedup_by_key(|c| c.0);
        if let Some(i) = caps.iter().position(|c| c.0 >= last) {
            caps.truncate(i + 1);
            if let Some(c) = caps.last_mut() {
                c.0 = last;
            }
        }
        if caps.is_empty() || self.next_id == 0 {
            return;
        }
        // Rare: every packed message is rebuilt whole to take its cap, and the expiry index
        // below is rebuilt from whole entries. The next `pack_line` looks at the whole line
        // again: packed once more, with its new expiries (a TTL policy set on a deep quorum
        // queue kept every message whole on every member for as long as it stayed).
        self.unpack_tail();
        self.pack_seen = 0;
        self.spill_seen = 0;
        let cap = |e: &mut Entry<M>| {
            e.meta.expires_at = min_opt(e.meta.expires_at, cap_of(&caps, e.id));
        };
        self.ready.iter_mut().for_each(cap);
        self.returned.values_mut().for_each(cap);
        self.by_priority.values_mut().for_each(cap);
        self.parked
            .values_mut()
            .flat_map(|g| g.values_mut())
            .for_each(cap);
        self.retrying.values_mut().for_each(|(_, e)| cap(e));
        self.in_flight.values_mut().for_each(|f| cap(&mut f.entry));
        for slot in self.tail.iter_mut() {
            match slot {
                Slot::Msg(e) => cap(e),
                Slot::Paged(r) => r.expires_min = min_opt(r.expires_min, cap_of(&caps, r.first)),
                Slot::Packed(_) | Slot::Spilled(_) => {}
            }
        }
        // What is tracked: the ready line in memory (parked and retrying messages file their
        // expiry when they rejoin it).
        self.expiries.clear();
        self.expiries_in_order.clear();
        let tracked = self
            .ready
            .iter()
            .chain(self.returned.values())
            .chain(self.by_priority.values())
            .chain(self.tail.iter().filter_map(|s| match s {
                Slot::Msg(e) => Some(e),
                Slot::Paged(_) | Slot::Packed(_) | Slot::Spilled(_) => None,
            }));
        for e in tracked {
            if let Some(at) = e.meta.expires_at {
                self.expiries.insert((at, e.id));
            }
        }
        // Memory messages may page out later (their stored expiry is the old one), so the
        // caps stay while any message they reach is ready; the oldest ready id bounds them.
        self.expiry_caps = merge_caps(&self.expiry_caps, &caps);
        if let Some(oldest) = self.oldest_ready_id() {
            self.expiry_caps.retain(|c| c.0 >= oldest);
        }
        self.expire(effects);
    }

    /// Has the queue ever paged (a classic queue's [`Command::PageOut`])? Then its tail is
    /// runs on disk and messages around them, whose expiries the in-order deque never holds.
    fn pages(&self) -> bool {
        self.tail_runs > 0 || self.paged_below > 0 || self.paged_out_total > 0
    }

    /// What leaves `ready` for a page out (messages from id `first` on) takes its expiry to the
    /// index.
    fn expiries_leave_ready(&mut self, first: u64) {
        while let Some((at, id)) = self.expiries_in_order.pop_back_from(first) {
            self.expiries.insert((at, id));
        }
    }

    /// Once the tail holds no run, it is just the rest of the line: back into `ready`.
    fn settle_tail(&mut self) {
        if self.tail_runs > 0 || self.tail_packed > 0 || self.tail.is_empty() {
            return;
        }
        for slot in std::mem::take(&mut self.tail) {
            if let Slot::Msg(e) = slot {
                self.ready.push_back(e);
            }
        }
        self.tail_count = 0;
        self.paged_below = 0;
    }

    /// Node-local: keeps the first `keep` messages of the ready line in `ready` and packs the
    /// rest with ids up to `upto` (those whose contents went away), where it can
    /// ([`crate::Payload::pack`]: a message never delivered, with no priority; its expiry, if
    /// it has one, is kept, and its entry in the expiry index stays; its group, if it has one,
    /// beside it in its run), in runs of up to [`PACKED_RUN`]; a message that cannot be packed
    /// stays as it is, and the line moves to the tail only from its first message that packs
    /// (a queue none of whose messages packs stays as it is). Each message is looked at once
    /// (`pack_seen`), so a call costs what came since the last one. Nothing the machine
    /// does changes, its digest included: a packed message is rebuilt, equal, whenever it is
    /// needed whole (as it reaches the head, for a policy change, a snapshot). A queue that
    /// pages (a classic queue's [`Command::PageOut`], whose outcome depends on where the
    /// line splits) or has priorities is left as it is. Returns how many messages it packed.
    pub fn pack_line(&mut self, keep: usize, upto: u64) -> usize {
        if self.pages() || self.policy.max_priority.is_some() {
            return 0;
        }
        // The head comes back from the tail first, if a consumer took it below `keep`.
        while self.ready.len() < keep {
            match self.take_tail_front() {
                Some(e) => self.ready.push_back(e),
                None => break,
            }
        }
        let seen = self.pack_seen;
        let mut packed = 0;
        // The tail's messages not looked at yet (what came after its packed runs).
        let from = self.tail.partition_point(|s| s.first_id() <= seen);
        if from < self.tail.len() {
            let rest = self.tail.split_off(from);
            let mut tail = std::mem::take(&mut self.tail);
            let mut whole = Vec::new();
            for slot in rest {
                match slot {
                    Slot::Msg(e) => whole.push(e),
                    // A run packed since the last call (`pack_slot`, as a committed machine
                    // takes its copies) stays as it is, in its place.
                    run => {
                        packed += self.pack_into(&mut tail, whole.drain(..), upto);
                        tail.push_back(run);
                    }
                }
            }
            packed += self.pack_into(&mut tail, whole, upto);
            self.tail = tail;
        }
        // `ready` past the window, from the first message not looked at yet that packs.
        let look = self
            .ready
            .partition_point(|e| e.id <= seen)
            .max(keep)
            .min(self.ready.len());
        let first = self
            .ready
            .range(look..)
            .take_while(|e| e.id <= upto)
            .position(|e| Self::packable(e).is_some())
            .map(|i| look + i);
        if let Some(first) = first {
            let moved = self.ready.split_off(first);
            // A line restored from a snapshot was all in `ready`: its room goes with it.
            if self.ready.capacity() > SHRINK_ABOVE && self.ready.capacity() / 4 > self.ready.len()
            {
                self.ready.shrink_to(self.ready.len() * 2);
            }
            // Their expiries stay where they are: the in-order deque reaches a packed line.
            self.tail_count += moved.len() as u64;
            let mut front = VecDeque::new();
            packed += self.pack_into(&mut front, moved, upto);
            while let Some(slot) = front.pop_back() {
                self.tail.push_front(slot);
            }
        }
        self.pack_seen = self.pack_seen.max(upto);
        self.settle_tail();
        packed
    }

    /// Appends `entries` (in id order, after what `slots` holds) to `slots`, packed where
    /// they can be (ids up to `upto`), into the last run if it has room; how many it packed.
    /// A message that packs alone between two that do not stays whole (a run of one takes
    /// more than its entry), unless it ends `entries` (the run may grow at the next call).
    fn pack_into(
        &mut self,
        slots: &mut VecDeque<Slot<M>>,
        entries: impl IntoIterator<Item = Entry<M>>,
        upto: u64,
    ) -> usize {
        let mut packed = 0;
        let mut lone: Option<(Entry<M>, Packing<M::Packed>)> = None;
        for entry in entries {
            let p = if entry.id <= upto {
                Self::packable(&entry)
            } else {
                None
            };
            let Some(p) = p else {
                if let Some((e, _)) = lone.take() {
                    slots.push_back(Slot::Msg(e));
                }
                slots.push_back(Slot::Msg(entry));
                continue;
            };
            let open = matches!(slots.back(), Some(Slot::Packed(run)) if run.len() < PACKED_RUN);
            if !open && lone.is_none() && !slots.back().is_some_and(Slot::is_run_of_packed) {
                // It starts a run only once the next one packs too (or nothing follows).
                lone = Some((entry, p));
                continue;
            }
            for p in lone.take().map(|(_, p)| p).into_iter().chain([p]) {
                packed += 1;
                self.push_packed(slots, p);
            }
        }
        if let Some((_, p)) = lone {
            packed += 1;
            self.push_packed(slots, p);
        }
        packed
    }

    /// Appends a packed message to the last run of `slots`, or to a run of its own after it
    /// (the last is full, or the message's expiry is out of its reach).
    fn push_packed(&mut self, slots: &mut VecDeque<Slot<M>>, p: Packing<M::Packed>) {
        let p = match slots.back_mut() {
            Some(Slot::Packed(run)) => match run.push(p) {
                Ok(()) => return,
                Err(p) => p,
            },
            _ => p,
        };
        self.tail_packed += 1;
        slots.push_back(Slot::Packed(PackedRun::one(p)));
    }

    /// What a ready entry packs as, if every field but its id, size, expiry and payload is at
    /// its default (so its run rebuilds it equal).
    fn packable(e: &Entry<M>) -> Option<Packing<M::Packed>> {
        let m = &e.meta;
        let plain = e.delivery_count == 0
            && !e.maybe_delivered
            && !e.timed_out
            && !m.pageable
            && !m.spilled
            && m.priority == 0;
        if !plain {
            return None;
        }
        Some(Packing {
            id: e.id,
            size: u32::try_from(m.size).ok()?,
            expires_at: m.expires_at,
            group: m.group,
            item: e.msg.pack()?,
        })
    }

    /// Takes the message at the front of the tail, if it is in memory (packed or not).
    fn take_tail_front(&mut self) -> Option<Entry<M>> {
        self.unspill_at(0);
        let e = match self.tail.front_mut()? {
            Slot::Paged(_) => return None,
            Slot::Msg(_) => match self.tail.pop_front() {
                Some(Slot::Msg(e)) => e,
                _ => return None,
            },
            Slot::Packed(run) => {
                let e = run.take(0)?;
                if run.items.is_empty() {
                    self.tail.pop_front();
                    self.tail_packed = self.tail_packed.saturating_sub(1);
                }
                e
            }
            Slot::Spilled(_) => return None,
        };
        self.tail_count = self.tail_count.saturating_sub(1);
        Some(e)
    }

    /// Every packed message back as a message slot (a policy change reads them all).
    fn unpack_tail(&mut self) {
        if self.tail_packed == 0 {
            return;
        }
        let old = std::mem::take(&mut self.tail);
        for slot in old {
            match slot {
                Slot::Packed(run) => self.tail.extend(run.entries().map(Slot::Msg)),
                Slot::Spilled(spilled) => {
                    let run = read_spilled::<M>(&spilled);
                    self.expiries_in_order
                        .unfold(spilled.first, run.expiry_pairs());
                    self.tail.extend(run.entries().map(Slot::Msg));
                }
                other => self.tail.push_back(other),
            }
        }
        self.tail_packed = 0;
    }

    /// Node-local, as [`Self::pack_line`]: writes the packed runs of the tail past its first
    /// `keep` ones out of memory ([`crate::Payload::spill`]), each of at least `min` messages
    /// and packed for good (full, or followed by another run `pack_line` made). What stays of each is a few
    /// words; it is read back whole when any of its messages is needed (as it nears the
    /// head, for a policy change, a snapshot). Runs are looked at once (`spill_seen`), so a
    /// call costs what was packed since the last; a run read back for a message in its
    /// middle (one expiring there) stays in memory. Returns how many messages it spilled;
    /// a run the payload refuses (a store that keeps none, a failed write) stays as it is.
    pub fn spill_line(&mut self, keep: usize, min: usize) -> usize {
        self.spill_line_with(keep, min, u64::MAX, None)
    }

    /// [`Self::spill_line`] for a leader's two machines. `below`: only runs whose messages'
    /// ids are all below it (the machine that runs ahead spills only what the committed one
    /// holds too: the committed one takes each message's handle from it as its entry
    /// commits, and would read a spilled run back for each). `like`: that other machine. A
    /// run it spilled with the same messages and items is shared (one record, its messages'
    /// contents held once), a run it has not looked at yet waits, and a run it left as it
    /// was is written as this machine's own. Returns how many messages it spilled or shared.
    pub fn spill_line_with(
        &mut self,
        keep: usize,
        min: usize,
        below: u64,
        like: Option<&Self>,
    ) -> usize {
        if self.tail_packed <= keep {
            return 0;
        }
        let mut runs = 0;
        let mut from = self.tail.len();
        for (i, slot) in self.tail.iter().enumerate() {
            if slot.is_run_of_packed() {
                runs += 1;
                if runs > keep {
                    from = i;
                    break;
                }
            }
        }
        let seen = self.spill_seen;
        from = from.max(self.tail.partition_point(|s| s.first_id() <= seen));
        // Only slots that can no longer change are looked at (and so counted as seen): those
        // before the last one `pack_line` has looked past, and that one too if it is a full
        // run. The last may still grow, and what follows it may still be packed (a line
        // replayed after a restart comes whole; once seen whole, it was never looked at again).
        let pack_seen = self.pack_seen;
        let mut last = self
            .tail
            .partition_point(|s| s.first_id() <= pack_seen)
            .saturating_sub(1);
        if matches!(self.tail.get(last), Some(Slot::Packed(run)) if run.len() >= PACKED_RUN) {
            last += 1;
        }
        let mut spilled = 0;
        let mut folds = Vec::new();
        for i in from..last {
            let Some(slot) = self.tail.get_mut(i) else {
                break;
            };
            let first = slot.first_id();
            let run = match slot {
                Slot::Packed(run) if run.len() >= min.max(1) => run,
                _ => {
                    self.spill_seen = self.spill_seen.max(first);
                    continue;
                }
            };
            let run_last = run.items.back().map_or(first, |p| p.id);
            // The other machine has not looked at this run yet (nor spilled one there).
            let unseen =
                like.is_some_and(|l| l.spill_seen < first && l.spilled_at(first).is_none());
            if run_last >= below || unseen {
                // Not yet: the next call looks again from this run.
                break;
            }
            let (meta, items) = run.spill_parts();
            let mark = spill_mark::<M>(&meta, &items);
            let len = items.len();
            let expiring = run.expiring();
            let same = like
                .and_then(|l| l.spilled_at(first))
                .filter(|s| s.len == len && s.last == run_last && s.mark == mark);
            if let Some(s) = same {
                *slot = Slot::Spilled(s.clone());
            } else {
                match M::spill(meta, items) {
                    Ok(handle) => {
                        *slot = Slot::Spilled(SpilledRun {
                            first,
                            last: run_last,
                            len,
                            mark,
                            expiring,
                            handle,
                        });
                    }
                    // Refused: the next call tries again from this run.
                    Err(_) => break,
                }
            }
            self.spill_seen = self.spill_seen.max(first);
            spilled += len;
            folds.push((first, run_last, expiring));
        }
        for (first, last, expiring) in folds {
            self.expiries_in_order.fold(first, last, expiring);
        }
        spilled
    }

    /// Reads back the run whose pairs come first in the in-order deque, if they are folded
    /// (before the front pair is taken).
    fn unfold_front(&mut self) {
        let Some(run) = self.expiries_in_order.front_fold() else {
            return;
        };
        let at = self.tail.binary_search_by_key(&run, Slot::first_id).ok();
        match at.and_then(|i| self.tail.get(i)) {
            Some(Slot::Spilled(_)) => {
                if let Some(i) = at {
                    self.unspill_at(i);
                }
            }
            // A fold outlives its spilled run only by a fault of this machine's: its pairs
            // come from the run if it is in memory, else they go (those messages then expire
            // when they reach the head) rather than stop the line's expiries for good.
            slot => {
                debug_assert!(false, "a fold outlived its run {run}");
                let pairs: Vec<(u64, u64)> = match slot {
                    Some(Slot::Packed(r)) => r.expiry_pairs().collect(),
                    _ => Vec::new(),
                };
                self.expiries_in_order.unfold(run, pairs);
            }
        }
    }

    /// The pairs of the spilled run whose first id is `run`, read back (none if there is no
    /// such run).
    fn spilled_pairs(&self, run: u64) -> Vec<(u64, u64)> {
        self.spilled_at(run)
            .map(|s| read_spilled::<M>(s).expiry_pairs().collect())
            .unwrap_or_default()
    }

    /// The in-order expiries, folded ones read back from their runs: the same sequence on
    /// every node.
    fn in_order_pairs(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.expiries_in_order
            .iter_with(move |run| self.spilled_pairs(run))
    }

    /// The spilled run whose first message is `first`, if there is one.
    fn spilled_at(&self, first: u64) -> Option<&SpilledRun<M::Spilled>> {
        let i = self
            .tail
            .binary_search_by_key(&first, Slot::first_id)
            .ok()?;
        match self.tail.get(i)? {
            Slot::Spilled(run) => Some(run),
            _ => None,
        }
    }

    /// Writes `slot` out of memory if it is a packed run of at least `min` messages: how
    /// many messages it wrote (0: not such a run), `None` if the payload refused.
    fn spill_slot(slot: &mut Slot<M>, min: usize) -> Option<usize> {
        let first = slot.first_id();
        let (meta, items, last, expiring) = match slot {
            Slot::Packed(run) if run.len() >= min.max(1) => {
                let (meta, items) = run.spill_parts();
                let last = run.items.back().map_or(first, |p| p.id);
                (meta, items, last, run.expiring())
            }
            _ => return Some(0),
        };
        let len = items.len();
        let mark = spill_mark::<M>(&meta, &items);
        let handle = M::spill(meta, items).ok()?;
        *slot = Slot::Spilled(SpilledRun {
            first,
            last,
            len,
            mark,
            expiring,
            handle,
        });
        Some(len)
    }

    /// Messages of the tail's runs written out of memory ([`Self::spill_line`]).
    pub fn spilled_count(&self) -> usize {
        self.tail
            .iter()
            .map(|s| match s {
                Slot::Spilled(run) => run.len,
                _ => 0,
            })
            .sum()
    }

    /// Brings tail slot `i` back into memory if it is a spilled run.
    fn unspill_at(&mut self, i: usize) {
        let run = match self.tail.get(i) {
            Some(Slot::Spilled(spilled)) => {
                let run = read_spilled::<M>(spilled);
                self.expiries_in_order
                    .unfold(spilled.first, run.expiry_pairs());
                run
            }
            _ => return,
        };
        if let Some(slot) = self.tail.get_mut(i) {
            *slot = Slot::Packed(run);
        }
    }

    /// Messages packed in the tail ([`Self::pack_line`]).
    pub fn packed_count(&self) -> usize {
        self.tail
            .iter()
            .map(|s| match s {
                Slot::Packed(run) => run.len(),
                Slot::Spilled(run) => run.len,
                _ => 0,
            })
            .sum()
    }

    /// Every ready message of the line's tail in memory (or in runs spilled from it), in
    /// order, packed ones rebuilt.
    fn tail_entries(&self) -> impl Iterator<Item = Cow<'_, Entry<M>>> + '_ {
        self.tail.iter().flat_map(|s| {
            let (one, run, spilled) = match s {
                Slot::Msg(e) => (Some(e), None, None),
                Slot::Paged(_) => (None, None, None),
                Slot::Packed(run) => (None, Some(run), None),
                Slot::Spilled(run) => (None, None, Some(read_spilled::<M>(run))),
            };
            one.map(Cow::Borrowed)
                .into_iter()
                .chain(run.into_iter().flat_map(|r| r.entries().map(Cow::Owned)))
                .chain(
                    spilled
                        .into_iter()
                        .flat_map(|r| r.entries().collect::<Vec<_>>().into_iter())
                        .map(Cow::Owned),
                )
        })
    }

    /// How many ready messages the tail holds in memory or in runs spilled from it (runs on
    /// disk left out).
    fn tail_len(&self) -> usize {
        self.tail.iter().map(slot_len).sum()
    }

    /// Would a [`Command::Get`] (or [`Self::pop_ready`]) find a message without loading one
    /// first? (Not when the next one is paged out.)
    pub fn head_loaded(&self) -> bool {
        if !self.ready.is_empty() || !self.by_priority.is_empty() {
            return true;
        }
        match (self.tail.front(), self.returned.first_key_value()) {
            (Some(Slot::Msg(_) | Slot::Packed(_) | Slot::Spilled(_)), _) => true,
            (Some(Slot::Paged(r)), Some((&id, _))) => id < r.first,
            (Some(Slot::Paged(_)), None) => false,
            (None, returned) => returned.is_some(),
        }
    }

    fn consume(&mut self, id: ConsumerId, spec: ConsumerSpec) -> Reply {
        if self.consumers.contains_key(&id) {
            return Reply::Refused(Refusal::DuplicateConsumer);
        }
        if self.exclusive_consumer.is_some() || (spec.exclusive && !self.consumers.is_empty()) {
            return Reply::Refused(Refusal::ExclusiveInUse);
        }
        if spec.exclusive {
            self.exclusive_consumer = Some(id);
        }
        if self.policy.single_active && self.active.is_none() {
            self.active = Some(id);
        }
        self.has_had_consumers = true;
        let priority = spec.priority;
        let visibility_ms = consumer_timeout(&spec.arguments, "x-visibility-timeout");
        let ack_timeout_ms = consumer_timeout(&spec.arguments, "x-consumer-timeout");
        let mut c = Consumer {
            spec,
            held: 0,
            in_service: false,
            visibility_ms,
            ack_timeout_ms,
        };
        if self.may_take(&c) && self.may_receive(id) {
            c.in_service = true;
            self.service.push_back(priority, id);
        }
        self.consumers.insert(id, c);
        Reply::Ok
    }

    /// With a single active consumer, only that one receives.
    fn may_receive(&self, id: ConsumerId) -> bool {
        !self.policy.single_active || self.active == Some(id)
    }

    fn cancel(&mut self, id: ConsumerId) -> Reply {
        let Some(c) = self.consumers.remove(&id) else {
            return Reply::Stale;
        };
        if c.in_service {
            self.service.remove(id);
        }
        if self.exclusive_consumer == Some(id) {
            self.exclusive_consumer = None;
        }
        if self.active == Some(id) {
            // The next in line, in the order they came, takes over.
            self.active = self.consumers.keys().next().copied();
            if let Some(next) = self.active {
                self.rejoin(next);
            }
        }
        let group = c.spec.group;
        if self.credit.contains_key(&group)
            && !self.consumers.values().any(|o| o.spec.group == group)
        {
            // Nobody of that channel is left here: forget its credit.
            self.credit.remove(&group);
        }
        Reply::Cancelled {
            consumers_left: u32::try_from(self.consumers.len()).unwrap_or(u32::MAX),
        }
    }

    fn set_credit(&mut self, group: CreditGroup, credit: Credit) {
        // Kept only while a consumer of the channel is here (the channel tells a queue its
        // credit after consuming from it), so a queue never collects channels it does not serve.
        let present = self.consumers.values().any(|c| c.spec.group == group);
        if credit == Credit::default() || !present {
            self.credit.remove(&group);
        } else {
            self.credit.insert(group, credit);
        }
        // Consumers of the channel that can take messages again rejoin the round-robin, in id
        // order (deterministic).
        let of_group: Vec<ConsumerId> = self
            .consumers
            .iter()
            .filter(|(_, c)| c.spec.group == group)
            .map(|(id, _)| *id)
            .collect();
        for id in of_group {
            self.rejoin(id);
        }
    }

    /// May this consumer take one more message now?
    fn may_take(&self, c: &Consumer) -> bool {
        let credit = self.credit.get(&c.spec.group).copied().unwrap_or_default();
        if credit.blocked {
            return false;
        }
        if c.spec.no_ack {
            return true;
        }
        (c.spec.prefetch == 0 || c.held < c.spec.prefetch) && credit.limit.is_none_or(|n| n > 0)
    }

    fn checkout(&mut self, max: u32, effects: &mut Vec<Effect<M>>) -> u32 {
        let mut delivered = 0;
        while delivered < max && self.head_loaded() {
            let Some((id, priority)) = self.service.pop_front() else {
                break;
            };
            let Some(c) = self.consumers.get(&id) else {
                continue;
            };
            if !self.may_take(c) {
                if let Some(c) = self.consumers.get_mut(&id) {
                    c.in_service = false;
                }
                continue;
            }
            let no_ack = c.spec.no_ack;
            let to = (c.spec.group, c.spec.tag.clone());
            let own = (c.visibility_ms, c.ack_timeout_ms);
            let Some(entry) = self.pop_deliverable() else {
                self.service.push_front(priority, id);
                break;
            };
            let d = self.hand_out(entry, Ok((id, to)), no_ack, own);
            effects.push(Effect::Deliver(d));
            delivered += 1;
            if !no_ack {
                if let Some(c) = self.consumers.get_mut(&id) {
                    c.held = c.held.saturating_add(1);
                    if let Some(cr) = self.credit.get_mut(&c.spec.group) {
                        if let Some(n) = cr.limit.as_mut() {
                            *n = n.saturating_sub(1);
                        }
                    }
                }
            }
            // Round-robin: the served consumer goes to the back, if it may take more.
            let again = self.consumers.get(&id).is_some_and(|c| self.may_take(c));
            if again {
                self.service.push_back(priority, id);
            } else if let Some(c) = self.consumers.get_mut(&id) {
                c.in_service = false;
            }
        }
        delivered
    }

    /// Takes the next ready message in id order: the returned one with the smallest id, or the
    /// head of the line (in `ready`, or in the tail once `ready` is empty). `None` when there
    /// is none, or the next one is paged out (it must be loaded first).
    #[inline]
    fn pop_ready(&mut self) -> Option<Entry<M>> {
        if let Some((_, entry)) = self.by_priority.pop_first() {
            self.ready_bytes = self.ready_bytes.saturating_sub(entry.meta.size);
            if let Some(at) = entry.meta.expires_at {
                self.expiries.remove(&(at, entry.id));
            }
            return Some(entry);
        }
        let line_head = match self.ready.front() {
            Some(e) => Some(e.id),
            None => self.tail.front().map(Slot::first_id),
        };
        let take_returned = match (self.returned.first_key_value(), line_head) {
            (Some((&r, _)), Some(h)) => r < h,
            (Some(_), None) => true,
            (None, _) => false,
        };
        let entry = if take_returned {
            self.returned.pop_first().map(|(_, e)| e)
        } else if let Some(e) = self.ready.pop_front() {
            Some(e)
        } else if let Some(Slot::Msg(_) | Slot::Packed(_) | Slot::Spilled(_)) = self.tail.front() {
            let e = self.take_tail_front();
            self.settle_tail();
            e
        } else {
            None
        }?;
        self.ready_bytes = self.ready_bytes.saturating_sub(entry.meta.size);
        if let Some(at) = entry.meta.expires_at {
            self.untrack_expiry(at, entry.id);
        }
        Some(entry)
    }

    /// Delivers `entry` to a consumer (with its channel and tag), or to a basic.get on a node.
    fn hand_out(
        &mut self,
        mut entry: Entry<M>,
        to: Result<(ConsumerId, (CreditGroup, ShortStr)), NodeId>,
        no_ack: bool,
        (own_visibility, own_ack_timeout): (Option<u64>, Option<u64>),
    ) -> Deliver<M> {
        let redelivered = entry.delivery_count > 0 || entry.maybe_delivered;
        entry.delivery_count = entry.delivery_count.saturating_add(1);
        entry.timed_out = false;
        let receipt = Receipt {
            msg_id: entry.id,
            attempt: entry.delivery_count,
        };
        let (holder, consumer, to) = match to {
            Ok((id, to)) => (Holder::Consumer(id), Some(id), Some(to)),
            Err(node) => (Holder::Get(node), None, None),
        };
        if no_ack {
            return Deliver {
                consumer,
                to,
                receipt,
                message: entry.msg,
                redelivered,
                settled: true,
                timed: false,
            };
        }
        let message = entry.msg.clone();
        self.in_flight_bytes = self.in_flight_bytes.saturating_add(entry.meta.size);
        let deadline = own_visibility
            .or(self.policy.visibility_timeout_ms)
            .map(|ms| self.now_ms.saturating_add(ms));
        // Only a consumer can time out as a consumer (basic.get has none).
        let ack_deadline = consumer
            .and(own_ack_timeout.or(self.policy.consumer_timeout_ms))
            .map(|ms| self.now_ms.saturating_add(ms));
        if let Some(at) = deadline {
            self.visibility.insert((at, entry.id));
        }
        if let Some(at) = ack_deadline {
            self.ack_deadlines.insert((at, entry.id));
        }
        let timed = deadline.is_some() || ack_deadline.is_some();
        if timed {
            let group = to.as_ref().map(|(g, _)| *g);
            let timers = Timers {
                group,
                deadline,
                ack_deadline,
            };
            self.timers.insert(entry.id, timers);
        }
        if let Some(g) = entry.meta.group {
            let id = entry.id;
            self.regroup(g, |m| m.group_locks.insert(g, id));
        }
        self.in_flight.insert(entry.id, InFlight { holder, entry });
        Deliver {
            consumer,
            to,
            receipt,
            message,
            redelivered,
            settled: false,
            timed,
        }
    }

    /// Removes the in-flight message the receipt names, if the receipt is current, and gives
    /// its consumer the credit back.
    fn take_in_flight(&mut self, receipt: Receipt) -> Option<Entry<M>> {
        let std::collections::btree_map::Entry::Occupied(slot) =
            self.in_flight.entry(receipt.msg_id)
        else {
            return None;
        };
        if slot.get().entry.delivery_count != receipt.attempt {
            return None;
        }
        let f = slot.remove();
        if !self.timers.is_empty() {
            if let Some(t) = self.timers.remove(&receipt.msg_id) {
                if let Some(at) = t.deadline {
                    self.visibility.remove(&(at, receipt.msg_id));
                }
                if let Some(at) = t.ack_deadline {
                    self.ack_deadlines.remove(&(at, receipt.msg_id));
                }
            }
        }
        self.in_flight_bytes = self.in_flight_bytes.saturating_sub(f.entry.meta.size);
        if let Some(id) = f.holder.consumer() {
            if let Some(c) = self.consumers.get_mut(&id) {
                c.held = c.held.saturating_sub(1);
            }
            self.rejoin(id);
        }
        Some(f.entry)
    }

    /// Puts a consumer back at the end of the round-robin line if it may take a message now and
    /// is not already waiting there.
    fn rejoin(&mut self, id: ConsumerId) {
        let back = self
            .consumers
            .get(&id)
            .filter(|c| !c.in_service && self.may_take(c) && self.may_receive(id))
            .map(|c| c.spec.priority);
        if let Some(priority) = back {
            if let Some(c) = self.consumers.get_mut(&id) {
                c.in_service = true;
            }
            self.service.push_back(priority, id);
        }
    }

    fn purge(&mut self) -> u32 {
        let n = self.ready_count();
        self.ready.clear();
        self.tail.clear();
        self.tail_count = 0;
        self.tail_runs = 0;
        self.tail_packed = 0;
        self.paged_below = 0;
        self.returned.clear();
        self.by_priority.clear();
        self.retrying.clear();
        self.retry_due.clear();
        self.retrying_bytes = 0;
        self.parked.clear();
        self.parked_count = 0;
        self.line_groups.clear();
        self.line_ungrouped = 0;
        self.line_unknown = 0;
        self.open_groups = 0;
        let in_flight = &self.in_flight;
        self.group_locks.retain(|_, id| in_flight.contains_key(id));
        self.expiries.clear();
        self.expiries_in_order.clear();
        self.ready_bytes = 0;
        u32::try_from(n).unwrap_or(u32::MAX)
    }

    /// Drops every ready message whose expiry has come. In-flight messages are not expired
    /// (RabbitMQ's rule: a delivered message belongs to its consumer); one that comes back
    /// expires then.
    fn expire(&mut self, effects: &mut Vec<Effect<M>>) {
        let now = self.expiry_now();
        // Earliest first, from either index: which one holds an expiry depends on where its
        // message sits in the line, which is not part of the state (a replicated queue's
        // member packs its line as it likes).
        loop {
            let in_order = self.expiries_in_order.front();
            let index = self.expiries.first().copied();
            let ((at, id), from_in_order) = match (in_order, index) {
                (Some(a), Some(b)) if a <= b => (a, true),
                (_, Some(b)) => (b, false),
                (Some(a), None) => (a, true),
                (None, None) => break,
            };
            if !expired(at, now) {
                break;
            }
            let entry = if from_in_order {
                // Its message is in `ready`, nearly always at its head, or (a packed line's)
                // at the front of the tail (its run read back first if it was written out).
                self.unfold_front();
                if self.expiries_in_order.front() != Some((at, id)) {
                    continue;
                }
                self.expiries_in_order.pop_front();
                self.take_expiring(id)
            } else {
                self.expiries.pop_first();
                self.take_expiring(id)
            };
            if let Some(e) = entry {
                self.ready_bytes = self.ready_bytes.saturating_sub(e.meta.size);
                self.line_out(e.meta.group);
                self.left_line(&e);
                self.dead_letter(
                    e.id,
                    e.msg,
                    e.delivery_count,
                    DeadLetterReason::Expired,
                    effects,
                );
            }
        }
    }

    /// Takes the ready message `id` whose expiry the index held, wherever it is.
    fn take_expiring(&mut self, id: u64) -> Option<Entry<M>> {
        if let Some(e) = self.returned.remove(&id) {
            return Some(e);
        }
        if let Some(p) = self.priority_level(id, |_| true) {
            return self.by_priority.remove(&(p, id));
        }
        // `ready` is sorted by id. A queue-wide TTL expires from the head (O(1)); a
        // per-message expiry in the middle shifts the shorter side of the deque. A packed
        // message is taken from its run (a queue TTL's from the run's front).
        if let Ok(i) = self.ready.binary_search_by_key(&id, |e| e.id) {
            return self.ready.remove(i);
        }
        let slot = self
            .tail
            .partition_point(|s| s.first_id() <= id)
            .checked_sub(1)?;
        self.unspill_at(slot);
        let e = match self.tail.get_mut(slot)? {
            Slot::Msg(e) if e.id == id => match self.tail.remove(slot) {
                Some(Slot::Msg(e)) => e,
                _ => return None,
            },
            Slot::Packed(run) => {
                let i = run.position(id)?;
                let e = run.take(i)?;
                if run.items.is_empty() {
                    self.tail.remove(slot);
                    self.tail_packed = self.tail_packed.saturating_sub(1);
                }
                e
            }
            _ => return None,
        };
        self.tail_count = self.tail_count.saturating_sub(1);
        Some(e)
    }

    // ------------------------------------------------------------ queries (no change)

    /// The time expiry goes by until the checkout owed to a TTL-0 message (see `handoff`).
    pub fn handoff(&self) -> Option<u64> {
        self.handoff
    }

    /// The earliest time at which a [`Command::Tick`] has work to do.
    pub fn next_deadline(&self) -> Option<u64> {
        // While a handoff is pending, a tick expires nothing the checkout owed will not: its
        // expiries are that checkout's.
        let first = if self.handoff.is_some() {
            None
        } else {
            min_opt(
                self.expiries.first().map(|&(at, _)| at),
                self.expiries_in_order.front().map(|(at, _)| at),
            )
        };
        let first = min_opt(first, self.visibility.first().map(|&(at, _)| at));
        let first = min_opt(first, self.ack_deadlines.first().map(|&(at, _)| at));
        let message = first.map(|at| at.saturating_add(1));
        // A retry is due at its time (not strictly after, as expiries are).
        let message = min_opt(message, self.retry_due.first().map(|&(at, _)| at));
        let message = min_opt(message, self.held.keys().next().map(|&(at, _)| at));
        let run = self.run_expiry().map(|at| at.saturating_add(1));
        min_opt(min_opt(message, run), self.queue_expiry())
    }

    /// The earliest expiry of the next paged run when nothing is ahead of it in memory: its
    /// messages should be read back then, to expire (a queue nobody consumes from still
    /// sheds what expired).
    fn run_expiry(&self) -> Option<u64> {
        if !self.ready.is_empty() || !self.returned.is_empty() || !self.by_priority.is_empty() {
            return None;
        }
        match self.tail.front() {
            // Over a length limit (lowered by a policy) with the head on disk: due now, to
            // be read back and trimmed.
            Some(Slot::Paged(_)) if self.over_limit() => Some(self.now_ms.saturating_sub(1)),
            Some(Slot::Paged(r)) => r.expires_min,
            _ => None,
        }
    }

    /// Is a `drop-head` queue over its length limit?
    fn over_limit(&self) -> bool {
        if self.policy.overflow != Overflow::DropHead {
            return false;
        }
        let (count, bytes) = self.limited();
        self.policy.max_length.is_some_and(|n| count > n)
            || self.policy.max_length_bytes.is_some_and(|n| bytes > n)
    }

    /// Has the next paged run's earliest expiry passed, with nothing ahead of it in memory?
    /// (The broker then reads it back, which expires what is due.)
    pub fn run_due(&self) -> bool {
        self.run_expiry().is_some_and(|at| expired(at, self.now_ms))
    }

    /// The smallest id among ready messages (the one waiting longest, as ids grow with time),
    /// paged out or not, waiting for a retry or parked behind its group included.
    pub fn oldest_ready_id(&self) -> Option<u64> {
        let firsts = [
            self.ready.front().map(|e| e.id),
            self.returned.keys().next().copied(),
            self.tail.front().map(Slot::first_id),
            self.retrying.keys().next().copied(),
            self.parked
                .values()
                .filter_map(|g| g.keys().next().copied())
                .min(),
            self.oldest_by_priority(),
        ];
        firsts.into_iter().flatten().min()
    }

    /// Ordered by priority first: the oldest is the smallest first id of any level (one
    /// seek per level present, at most 256).
    fn oldest_by_priority(&self) -> Option<u64> {
        let mut oldest: Option<u64> = None;
        let mut from = (0u8, 0u64);
        while let Some(((level, id), _)) = self.by_priority.range(from..).next() {
            oldest = Some(oldest.map_or(*id, |o| o.min(*id)));
            match level.checked_add(1) {
                Some(next) => from = (next, 0),
                None => break,
            }
        }
        oldest
    }

    /// Whether a message enqueued now goes to a consumer at the next checkout: the consumers
    /// waiting have room for it and for every message ready before it (a read of several
    /// publishes enqueues them all before the checkout that hands them out).
    pub fn takes_at_once(&self) -> bool {
        let before = self.ready_count() as u64;
        if before >= TAKES_AT_ONCE_MAX {
            return false;
        }
        // The line may still hold consumers that can no longer take (a blocked channel, one
        // out of credit: the next checkout drops them), so the first few are asked; past
        // them the answer is no, which costs a copy, never a pinned buffer.
        let mut room: u64 = 0;
        // A channel-wide limit is the channel's, shared by its consumers: what one consumer's
        // room took of it is not there for the next.
        let mut spent: [(Option<CreditGroup>, u64); 4] = [(None, 0); 4];
        for id in self
            .service
            .levels
            .iter()
            .flat_map(|(_, line)| line.iter())
            .take(4)
        {
            let Some(c) = self.consumers.get(id) else {
                continue;
            };
            if !self.may_take(c) || !self.may_receive(*id) {
                continue;
            }
            room = room.saturating_add(self.room(c, &mut spent));
            if room > before {
                return true;
            }
        }
        false
    }

    /// How many more messages consumer `c` may be handed now (`u64::MAX`: no limit), less what
    /// consumers counted before it took of its channel's limit (`spent`, updated).
    fn room(&self, c: &Consumer, spent: &mut [(Option<CreditGroup>, u64)]) -> u64 {
        if c.spec.no_ack {
            return u64::MAX;
        }
        let own = match c.spec.prefetch {
            0 => u64::MAX,
            n => u64::from(n.saturating_sub(c.held)),
        };
        let group = c.spec.group;
        let Some(limit) = self.credit.get(&group).and_then(|credit| credit.limit) else {
            return own;
        };
        let at = spent
            .iter()
            .position(|(g, _)| *g == Some(group))
            .or_else(|| spent.iter().position(|(g, _)| g.is_none()));
        let Some(slot) = at.and_then(|i| spent.get_mut(i)) else {
            return 0;
        };
        slot.0 = Some(group);
        let room = own.min(u64::from(limit).saturating_sub(slot.1));
        slot.1 = slot.1.saturating_add(room);
        room
    }

    /// Ready messages (not in flight), paged out or not.
    pub fn ready_count(&self) -> usize {
        self.ready.len()
            + self.returned.len()
            + self.by_priority.len()
            + self.retrying.len()
            + self.parked_count
            + usize::try_from(self.tail_count).unwrap_or(usize::MAX)
    }

    /// When a message waiting for its delayed retry is due (the broker stores it, so that a
    /// restart keeps the back-off).
    pub fn retry_due_of(&self, msg_id: u64) -> Option<u64> {
        self.retrying.get(&msg_id).map(|(at, _)| *at)
    }

    /// Ready messages waiting for a delayed retry (counted in [`Self::ready_count`]).
    pub fn retrying_count(&self) -> usize {
        self.retrying.len()
    }

    /// Ready messages in memory at the head of the line (what a `PageOut` keeps).
    pub fn head_count(&self) -> usize {
        self.ready.len()
    }

    /// Ready messages that are on disk only.
    pub fn paged_count(&self) -> u64 {
        self.tail
            .iter()
            .map(|s| match s {
                Slot::Paged(r) => r.count,
                Slot::Msg(_) | Slot::Packed(_) | Slot::Spilled(_) => 0,
            })
            .sum()
    }

    /// Messages ever paged out, and ever read back.
    pub fn paging_totals(&self) -> (u64, u64) {
        (self.paged_out_total, self.loaded_total)
    }

    /// The paged runs, in order, and where each is.
    pub fn runs(&self) -> impl Iterator<Item = PagedRun> + '_ {
        self.tail.iter().filter_map(|s| match s {
            Slot::Paged(r) => Some(PagedRun {
                first_id: r.first,
                last_id: r.last,
                spilled: r.spilled,
            }),
            Slot::Msg(_) | Slot::Packed(_) | Slot::Spilled(_) => None,
        })
    }

    /// The id ranges of the paged runs, in order (each holds exactly the queue's messages
    /// with ids in it).
    pub fn paged_runs(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.runs().map(|r| (r.first_id, r.last_id))
    }

    /// The next message is paged out and the head is below `low_water` messages: what to
    /// read back with a [`Command::Load`].
    pub fn load_request(&self, low_water: usize) -> Option<LoadRequest> {
        match self.tail.front() {
            Some(Slot::Paged(r)) if self.ready.len() < low_water => Some(LoadRequest {
                from_id: r.first,
                to_id: r.last,
                spilled: r.spilled,
            }),
            _ => None,
        }
    }

    /// Do consumers wait, and is the head below `low_water` with a paged run next: should
    /// the next page be read back before a checkout?
    pub fn wants_load(&self, low_water: usize) -> bool {
        !self.service.is_empty() && self.load_request(low_water).is_some()
    }

    /// Has the line split into a head and a tail (the queue pages)?
    pub fn has_tail(&self) -> bool {
        !self.tail.is_empty()
    }

    pub fn ready_bytes(&self) -> u64 {
        self.ready_bytes
    }

    pub fn in_flight_count(&self) -> usize {
        self.in_flight.len()
    }

    pub fn in_flight_bytes(&self) -> u64 {
        self.in_flight_bytes
    }

    /// Would a [`Command::Checkout`] deliver anything now? (Not when every message in the
    /// line is of a busy group, as the census tells.)
    pub fn has_work(&self) -> bool {
        self.head_loaded() && !self.service.is_empty() && !self.line_blocked()
    }

    pub fn consumer_count(&self) -> usize {
        self.consumers.len()
    }

    pub fn consumer(&self, id: ConsumerId) -> Option<&ConsumerSpec> {
        self.consumers.get(&id).map(|c| &c.spec)
    }

    /// Consumers in id order, with how many messages each holds.
    pub fn consumers(&self) -> impl Iterator<Item = (ConsumerId, &ConsumerSpec, u32)> + '_ {
        self.consumers.iter().map(|(id, c)| (*id, &c.spec, c.held))
    }

    /// A consumer's timeout (ms), as it is enforced: its own `x-consumer-timeout`, else the
    /// queue's; `None` when it has none (or is gone).
    pub fn consumer_timeout_ms(&self, id: ConsumerId) -> Option<u64> {
        let c = self.consumers.get(&id)?;
        c.ack_timeout_ms.or(self.policy.consumer_timeout_ms)
    }

    pub fn has_had_consumers(&self) -> bool {
        self.has_had_consumers
    }

    /// With `x-single-active-consumer`: the consumer that receives.
    pub fn active_consumer(&self) -> Option<ConsumerId> {
        self.active
    }

    pub fn exclusive_consumer(&self) -> Option<ConsumerId> {
        self.exclusive_consumer
    }

    /// The id the next enqueued message will get (= how many were ever enqueued).
    pub fn next_msg_id(&self) -> u64 {
        self.next_id
    }

    /// What the queue's definitions asked of it, as last configured.
    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// The index of the last command applied.
    pub fn last_index(&self) -> u64 {
        self.last_index
    }

    /// The latest time the machine has seen.
    pub fn now_ms(&self) -> u64 {
        self.now_ms
    }

    /// Is this receipt the current delivery of an in-flight message, and to whom
    /// (`Some(None)` = basic.get)?
    pub fn holder(&self, receipt: Receipt) -> Option<Option<ConsumerId>> {
        self.in_flight
            .get(&receipt.msg_id)
            .filter(|f| f.entry.delivery_count == receipt.attempt)
            .map(|f| f.holder.consumer())
    }

    /// The node holding the current delivery of an in-flight message (its consumer's, or the
    /// basic.get's).
    pub fn holder_node(&self, receipt: Receipt) -> Option<NodeId> {
        self.in_flight
            .get(&receipt.msg_id)
            .filter(|f| f.entry.delivery_count == receipt.attempt)
            .map(|f| f.holder.node())
    }

    /// An enqueuer's highest decided sequence number, while the machine remembers it.
    pub fn enqueuer_seq(&self, enqueuer: EnqueuerId) -> Option<u64> {
        self.enqueuers.get(&enqueuer).map(|e| e.seq)
    }

    /// What the machine answers an enqueuer's `seq` sent again, if it decided it already: a
    /// `Duplicate` (in the queue once), or `Refused(Full)`. `None` while it waits to be decided.
    pub fn decided(&self, enqueuer: EnqueuerId, seq: u64) -> Option<Reply> {
        let e = self.enqueuers.get(&enqueuer)?;
        if seq > e.seq {
            return None;
        }
        // Only the highest refusal is known: one at or after `seq` may have been `seq`.
        Some(if e.refused.is_some_and(|r| seq <= r) {
            Reply::Refused(Refusal::Full)
        } else {
            Reply::Duplicate
        })
    }

    /// Keys in the deduplication window ([`DedupWindow`]).
    pub fn dedup_keys(&self) -> usize {
        self.dedup.len()
    }

    /// Entries of the deduplication window's insertion order (live keys, and the earlier
    /// places of keys taken again): with [`Self::dedup_keys`], what a snapshot writes of it.
    pub fn dedup_order_len(&self) -> usize {
        self.dedup_order.len()
    }

    /// Publishes held back until they are due ([`Command::EnqueueWith`]), and their bytes.
    /// Dead-lettered messages held until their dead letters are safe
    /// ([`Policy::hold_dead_letters`]), by id.
    pub fn dead_held(&self) -> impl Iterator<Item = (u64, &Dead<M>)> + '_ {
        self.dead.iter().map(|(id, d)| (*id, d))
    }

    /// The held dead-lettered message `msg_id`, if it is held.
    pub fn dead_held_get(&self, msg_id: u64) -> Option<&Dead<M>> {
        self.dead.get(&msg_id)
    }

    /// How many dead-lettered messages are held.
    pub fn dead_held_count(&self) -> usize {
        self.dead.len()
    }

    pub fn held_count(&self) -> (usize, u64) {
        (self.held.len(), self.held_bytes)
    }

    /// Enqueuers remembered (one per live publisher channel that sent [`Command::EnqueueFrom`]).
    pub fn enqueuer_count(&self) -> usize {
        self.enqueuers.len()
    }

    /// An in-flight message and its delivery count, whatever the attempt.
    pub fn in_flight_message(&self, msg_id: u64) -> Option<(&M, u32)> {
        self.in_flight
            .get(&msg_id)
            .map(|f| (&f.entry.msg, f.entry.delivery_count))
    }

    /// Message `msg_id`, where it waits at the head of the ready line, came back to it, or is
    /// delivered (not where it waits for a priority, a retry or its group).
    pub fn payload(&self, msg_id: u64) -> Option<&M> {
        if let Some(f) = self.in_flight.get(&msg_id) {
            return Some(&f.entry.msg);
        }
        if let Some(e) = self.returned.get(&msg_id) {
            return Some(&e.msg);
        }
        if let Some(i) = self.ready_position(msg_id) {
            return self.ready.get(i).map(|e| &e.msg);
        }
        match self.tail.get(self.tail_position(msg_id)?) {
            Some(Slot::Msg(e)) => Some(&e.msg),
            _ => None,
        }
    }

    /// [`Self::payload`], or the message rebuilt from its packed form: what another machine
    /// holding the same message can share ([`Self::share_payload`]).
    pub fn payload_to_share(&self, msg_id: u64) -> Option<Cow<'_, M>> {
        if let Some(m) = self.payload(msg_id) {
            return Some(Cow::Borrowed(m));
        }
        let slot = self.tail.partition_point(|s| s.first_id() <= msg_id);
        let run = match self.tail.get(slot.checked_sub(1)?)? {
            Slot::Packed(run) => Cow::Borrowed(run),
            Slot::Spilled(run) => Cow::Owned(read_spilled::<M>(run)),
            _ => return None,
        };
        let i = run.position(msg_id)?;
        run.items.get(i).map(|p| Cow::Owned(M::unpack(&p.item)))
    }

    /// Where message `msg_id` is in the tail, as a message slot (not packed): among the
    /// last slots first, as [`Self::ready_position`] looks.
    fn tail_position(&self, msg_id: u64) -> Option<usize> {
        const TAIL: usize = 64;
        let from = self.tail.len().saturating_sub(TAIL);
        if self.tail.get(from).is_some_and(|s| s.first_id() <= msg_id) {
            return self
                .tail
                .range(from..)
                .rposition(|s| matches!(s, Slot::Msg(e) if e.id == msg_id))
                .map(|i| from + i);
        }
        let i = self
            .tail
            .binary_search_by_key(&msg_id, Slot::first_id)
            .ok()?;
        matches!(self.tail.get(i), Some(Slot::Msg(_))).then_some(i)
    }

    /// Where message `msg_id` is in `ready`. Looked for among the last entries first: the
    /// message a leader shares between its machines as its entry commits was enqueued last or
    /// nearly, and a search of a deep queue's whole line misses the cache at every step.
    fn ready_position(&self, msg_id: u64) -> Option<usize> {
        const TAIL: usize = 64;
        // Past `ready`'s last (in the tail of a packed line): not here.
        if self.ready.back().is_none_or(|e| e.id < msg_id) {
            return None;
        }
        let from = self.ready.len().saturating_sub(TAIL);
        if self.ready.get(from).is_some_and(|e| e.id <= msg_id) {
            return self
                .ready
                .range(from..)
                .rposition(|e| e.id == msg_id)
                .map(|i| from + i);
        }
        self.ready.binary_search_by_key(&msg_id, |e| e.id).ok()
    }

    /// [`Self::share_payload`] for messages of the head of the ready line, in id order: one
    /// search, then a walk. How many it shared.
    pub fn share_head_payloads(&mut self, shared: &[(u64, M)]) -> usize
    where
        M: PartialEq + Clone,
    {
        let Some((first, _)) = shared.first() else {
            return 0;
        };
        let mut i = self.ready.partition_point(|e| e.id < *first);
        let mut done = 0;
        let mut rest = shared.iter();
        for (msg_id, other) in rest.by_ref() {
            while self.ready.get(i).is_some_and(|e| e.id < *msg_id) {
                i += 1;
            }
            match self.ready.get_mut(i) {
                Some(e) if e.id == *msg_id && e.msg == *other => {
                    e.msg = other.clone();
                    done += 1;
                }
                Some(_) => {}
                None => {
                    done += usize::from(self.share_tail_payload(*msg_id, other));
                    break;
                }
            }
        }
        // Past `ready`, in the tail's messages ([`Self::pack_line`]).
        for (msg_id, other) in rest {
            done += usize::from(self.share_tail_payload(*msg_id, other));
        }
        done
    }

    /// [`Self::share_payload`] for a message of the tail, not packed.
    fn share_tail_payload(&mut self, msg_id: u64, other: &M) -> bool
    where
        M: PartialEq + Clone,
    {
        let Some(i) = self.tail_position(msg_id) else {
            return false;
        };
        match self.tail.get_mut(i) {
            Some(Slot::Msg(e)) if e.msg == *other => {
                e.msg = other.clone();
            }
            _ => return false,
        }
        // A message shared into a packed line (a leader's committed machine takes its
        // copies as entries commit, after the pass that packed the line) packs at once.
        if self.tail_packed > 0 {
            self.pack_slot(i);
        }
        true
    }

    /// Packs the message in tail slot `i`, if it can be and follows a packed run: into that
    /// run when it has room (the slot is near the end of the tail: a shift of a few slots),
    /// or as the first of the next.
    fn pack_slot(&mut self, i: usize) {
        let Some(Slot::Msg(e)) = self.tail.get(i) else {
            return;
        };
        let Some(p) = Self::packable(e) else {
            return;
        };
        let p = match i.checked_sub(1).and_then(|j| self.tail.get_mut(j)) {
            Some(Slot::Packed(run)) => match run.push(p) {
                Ok(()) => {
                    self.tail.remove(i);
                    return;
                }
                Err(p) => p,
            },
            // A run written out of memory takes no more: this one starts the next.
            Some(Slot::Spilled(_)) => p,
            _ => return,
        };
        if let Some(slot) = self.tail.get_mut(i) {
            *slot = Slot::Packed(PackedRun::one(p));
            self.tail_packed += 1;
        }
    }

    /// Makes message `msg_id` hold `other` in place of an equal value of its own: a member
    /// holding the same message twice (a leader's copy as published and the one its log
    /// gave back) keeps one copy of its bytes. Nothing the machine does changes; false if
    /// the message is not where [`Self::payload`] looks or is not equal to `other`.
    pub fn share_payload(&mut self, msg_id: u64, other: &M) -> bool
    where
        M: PartialEq + Clone,
    {
        let slot = if self.in_flight.contains_key(&msg_id) {
            self.in_flight.get_mut(&msg_id).map(|f| &mut f.entry.msg)
        } else if self.returned.contains_key(&msg_id) {
            self.returned.get_mut(&msg_id).map(|e| &mut e.msg)
        } else {
            match self.ready_position(msg_id) {
                Some(i) => self.ready.get_mut(i).map(|e| &mut e.msg),
                None => {
                    return self.share_tail_payload(msg_id, other);
                }
            }
        };
        match slot {
            Some(m) if *m == *other => {
                *m = other.clone();
                true
            }
            _ => false,
        }
    }

    /// Node-local: the messages at the head of the ready line (the part [`Self::head_count`]
    /// counts) from position `skip` on whose ids are above `after`, with their ids, in line
    /// order, for a change that leaves each equal to what it was (its contents leaving memory,
    /// [`crate::Message::away_stub`]). Nothing the machine does or digests changes.
    pub fn head_payloads_mut(
        &mut self,
        skip: usize,
        after: u64,
    ) -> impl Iterator<Item = (u64, &mut M)> + '_ {
        let from = self.ready.partition_point(|e| e.id <= after).max(skip);
        let from = from.min(self.ready.len());
        // The tail's messages in memory and not packed, past the first `skip` of the line.
        let mut pos = self.ready.len();
        let mut first = 0;
        while pos < skip && first < self.tail.len() {
            pos += self.tail.get(first).map_or(1, slot_len);
            first += 1;
        }
        let first = self
            .tail
            .partition_point(|s| s.first_id() <= after)
            .max(first);
        self.ready
            .range_mut(from..)
            .map(|e| (e.id, &mut e.msg))
            .chain(self.tail.range_mut(first..).filter_map(|s| match s {
                Slot::Msg(e) => Some((e.id, &mut e.msg)),
                Slot::Paged(_) | Slot::Packed(_) | Slot::Spilled(_) => None,
            }))
    }

    /// How many messages of the ready line in memory and not packed have ids above `after`.
    pub fn head_after(&self, after: u64) -> usize {
        let in_ready = self.ready.len() - self.ready.partition_point(|e| e.id <= after);
        // Past `after`, the tail holds what came since the last packing, one message a slot
        // (runs hold only what was sent away, ids up to `after`), counted without a walk:
        // this is asked at every entry a deep queue applies.
        in_ready + (self.tail.len() - self.tail.partition_point(|s| s.first_id() <= after))
    }

    /// The ready line in memory, in order: ids and sizes (runs on disk left out).
    fn line_sizes(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.ready
            .iter()
            .map(|e| (e.id, e.meta.size))
            .chain(self.tail_entries().map(|e| (e.id, e.meta.size)))
    }

    /// The id of the message at position `pos` of the ready line in memory.
    pub fn head_id(&self, pos: usize) -> Option<u64> {
        match self.ready.get(pos) {
            Some(e) => Some(e.id),
            None => self.line_sizes().nth(pos).map(|(id, _)| id),
        }
    }

    /// How many messages at the head of the ready line fit in `count` messages and `bytes`
    /// of bodies (at least one when the line is not empty): the part a member keeps in memory.
    pub fn head_within(&self, count: usize, bytes: u64) -> usize {
        let mut total = 0u64;
        let mut n = 0;
        for (i, (_, size)) in self.line_sizes().take(count).enumerate() {
            total = total.saturating_add(size);
            if total > bytes {
                return i.max(1);
            }
            n = i + 1;
        }
        n
    }

    /// Every ready message in memory with its id and delivery count, in no particular order
    /// (paged ones are in [`Self::paged_runs`]); a packed one rebuilt.
    pub fn ready_messages(&self) -> impl Iterator<Item = (u64, Cow<'_, M>, u32)> + '_ {
        fn borrowed<M: Clone>(e: &Entry<M>) -> (u64, Cow<'_, M>, u32) {
            (e.id, Cow::Borrowed(&e.msg), e.delivery_count)
        }
        self.ready
            .iter()
            .map(borrowed)
            .chain(self.tail_entries().map(|e| match e {
                Cow::Borrowed(e) => borrowed(e),
                Cow::Owned(e) => (e.id, Cow::Owned(e.msg), e.delivery_count),
            }))
            .chain(
                self.returned
                    .values()
                    .chain(self.by_priority.values())
                    .chain(self.retrying.values().map(|(_, e)| e))
                    .chain(self.parked.values().flat_map(|line| line.values()))
                    .map(borrowed),
            )
    }

    /// Every message the queue holds, ready or in flight, with its id and delivery count.
    pub fn messages(&self) -> impl Iterator<Item = (u64, Cow<'_, M>, u32)> + '_ {
        self.ready_messages()
            .chain(self.in_flight.values().map(|f| {
                (
                    f.entry.id,
                    Cow::Borrowed(&f.entry.msg),
                    f.entry.delivery_count,
                )
            }))
    }

    /// Every message in memory, ready or in flight, in no particular order, to change in
    /// place for one that equals it ([`Self::share_payload`]'s contract: the machine's
    /// state, its digest included, must not change). Packed ones are not in it: they can
    /// be packed only once their contents are away.
    pub fn messages_mut(&mut self) -> impl Iterator<Item = &mut M> + '_ {
        self.ready
            .iter_mut()
            .chain(self.tail.iter_mut().filter_map(|s| match s {
                Slot::Msg(e) => Some(e),
                Slot::Paged(_) | Slot::Packed(_) | Slot::Spilled(_) => None,
            }))
            .chain(self.returned.values_mut())
            .chain(self.by_priority.values_mut())
            .chain(self.retrying.values_mut().map(|(_, e)| e))
            .chain(self.parked.values_mut().flat_map(|line| line.values_mut()))
            .chain(self.in_flight.values_mut().map(|f| &mut f.entry))
            .map(|e| &mut e.msg)
            .chain(self.held.values_mut().map(|(m, _)| m))
    }

    /// The publishes held until due ([`Command::EnqueueWith`]), in due order.
    pub fn held_messages(&self) -> impl Iterator<Item = &M> + '_ {
        self.held.values().map(|(m, _)| m)
    }

    /// The key of the publish an [`Command::EnqueueWith`] of `delay_ms` just held (its reply
    /// was `Ok`), to share its payload with another machine that held it too
    /// ([`Self::share_held`]).
    pub fn last_held(&self, delay_ms: u64) -> Option<(u64, u64)> {
        let key = (
            self.now_ms.saturating_add(delay_ms),
            self.held_seq.wrapping_sub(1),
        );
        self.held.contains_key(&key).then_some(key)
    }

    /// The held publish under `key`, if it equals `other`, becomes a clone of it (as
    /// [`Self::share_payload`] does for a queued message). False if there is none that equals.
    pub fn share_held(&mut self, key: (u64, u64), other: &M) -> bool
    where
        M: PartialEq + Clone,
    {
        match self.held.get_mut(&key) {
            Some((m, _)) if *m == *other => {
                *m = other.clone();
                true
            }
            _ => false,
        }
    }

    /// The held publish under `key`.
    pub fn held_payload(&self, key: (u64, u64)) -> Option<&M> {
        self.held.get(&key).map(|(m, _)| m)
    }

    /// Held publishes since the held line was last empty: grows by one with each publish
    /// held, so a member tells from it whether new ones came since it last looked.
    pub fn held_seq(&self) -> u64 {
        self.held_seq
    }

    /// The held publishes past the `skip` due soonest, in due order, from the first whose key
    /// is above `after` on, with their keys: what a member may send out of memory (those due
    /// soonest stay). Node-local use only: the payloads must stay equal to what they were.
    pub fn held_payloads_mut(
        &mut self,
        skip: usize,
        after: Option<(u64, u64)>,
    ) -> impl Iterator<Item = ((u64, u64), &mut M)> + '_ {
        range_past(&mut self.held, skip, after).map(|(k, (m, _))| (*k, m))
    }

    /// The messages waiting for a delayed retry past the `skip` first (by id: the oldest),
    /// from the first whose id is above `after` on: [`Self::held_payloads_mut`] for them.
    pub fn retrying_payloads_mut(
        &mut self,
        skip: usize,
        after: Option<u64>,
    ) -> impl Iterator<Item = (u64, &mut M)> + '_ {
        range_past(&mut self.retrying, skip, after).map(|(k, (_, e))| (*k, &mut e.msg))
    }

    /// The message waiting for a retry under `msg_id`.
    pub fn retrying_payload(&self, msg_id: u64) -> Option<&M> {
        self.retrying.get(&msg_id).map(|(_, e)| &e.msg)
    }

    /// Messages given back to the queue (they go out first, by id), and those parked behind
    /// their group's message in flight.
    pub fn returned_count(&self) -> usize {
        self.returned.len()
    }

    pub fn parked_len(&self) -> usize {
        self.parked_count
    }

    /// The messages given back past the `skip` first (by id: the next to go out), from the
    /// first whose id is above `after` on: [`Self::held_payloads_mut`] for them.
    pub fn returned_payloads_mut(
        &mut self,
        skip: usize,
        after: Option<u64>,
    ) -> impl Iterator<Item = (u64, &mut M)> + '_ {
        range_past(&mut self.returned, skip, after).map(|(k, e)| (*k, &mut e.msg))
    }

    /// The message given back under `msg_id`.
    pub fn returned_payload(&self, msg_id: u64) -> Option<&M> {
        self.returned.get(&msg_id).map(|e| &e.msg)
    }

    /// The messages in flight past the `skip` first (by id: the oldest, which a worker taking
    /// them in order settles first), from the first whose id is above `after` on:
    /// [`Self::held_payloads_mut`] for them.
    pub fn in_flight_payloads_mut(
        &mut self,
        skip: usize,
        after: Option<u64>,
    ) -> impl Iterator<Item = (u64, &mut M)> + '_ {
        range_past(&mut self.in_flight, skip, after).map(|(k, f)| (*k, &mut f.entry.msg))
    }

    /// The message in flight under `msg_id`.
    pub fn in_flight_payload(&self, msg_id: u64) -> Option<&M> {
        self.in_flight.get(&msg_id).map(|f| &f.entry.msg)
    }

    /// The messages parked behind their group's message in flight, keyed by (group, id): past
    /// the `skip` first in that order, or, given `after`, from the first whose key is above it
    /// on (a pass that follows one begun past the skipped ones): [`Self::held_payloads_mut`]
    /// for them.
    pub fn parked_payloads_mut(
        &mut self,
        skip: usize,
        after: Option<(u64, u64)>,
    ) -> impl Iterator<Item = ((u64, u64), &mut M)> + '_ {
        use std::ops::Bound;
        // From `after`'s group on (no walk over what a pass before walked); `skip` counts
        // from the first only (a pass after one that skipped them starts past them).
        let groups = match after.and_then(|(g, _)| GroupKey::new(g)) {
            Some(g) => self.parked.range_mut(g..),
            None => self.parked.range_mut(..),
        };
        groups
            .flat_map(move |(group, line)| {
                let group = group.get();
                let lower = match after {
                    Some((g, id)) if g == group => Bound::Excluded(id),
                    _ => Bound::Unbounded,
                };
                line.range_mut((lower, Bound::Unbounded))
                    .map(move |(id, e)| ((group, *id), &mut e.msg))
            })
            .skip(if after.is_some() { 0 } else { skip })
    }

    /// The message parked under `(group, id)`.
    pub fn parked_payload(&self, (group, id): (u64, u64)) -> Option<&M> {
        let group = GroupKey::new(group)?;
        self.parked.get(&group)?.get(&id).map(|e| &e.msg)
    }

    /// Ids of the ready messages in memory in delivery order, then those parked behind their
    /// group's message in flight (tests and diagnostics; O(n)).
    pub fn ready_ids(&self) -> Vec<u64> {
        let mut out: Vec<u64> = self.by_priority.values().map(|e| e.id).collect();
        let mut r = self.returned.keys().copied().peekable();
        let mut q = self
            .ready
            .iter()
            .map(|e| e.id)
            .chain(self.tail_entries().map(|e| e.id))
            .peekable();
        loop {
            let next = match (r.peek(), q.peek()) {
                (Some(&a), Some(&b)) if a < b => r.next(),
                (Some(_), Some(_)) | (None, Some(_)) => q.next(),
                (Some(_), None) => r.next(),
                (None, None) => {
                    out.extend(self.parked.values().flat_map(|line| line.keys()));
                    return out;
                }
            };
            out.extend(next);
        }
    }

    /// The line's census ([`Self::line_groups`] and the rest) counted from what is in
    /// memory: O(line). The messages of runs paged out here are counted by group in the census
    /// kept, not here: their total is the last number.
    fn census(&self) -> (BTreeMap<GroupKey, u64>, u64, u64, u64) {
        let mut groups: BTreeMap<GroupKey, u64> = BTreeMap::new();
        let (mut ungrouped, mut unknown, mut counted) = (0u64, 0u64, 0u64);
        let mut count = |g: Option<GroupKey>| match g {
            Some(g) => *groups.entry(g).or_insert(0) += 1,
            None => ungrouped += 1,
        };
        let whole = self
            .ready
            .iter()
            .chain(self.returned.values())
            .chain(self.by_priority.values())
            .chain(self.parked.values().flat_map(BTreeMap::values));
        for e in whole {
            count(e.meta.group);
        }
        for slot in &self.tail {
            match slot {
                Slot::Msg(e) => count(e.meta.group),
                Slot::Packed(run) => {
                    for i in 0..run.len() {
                        count(GroupKey::new(run.group_at(i)));
                    }
                }
                Slot::Spilled(run) => {
                    let run = read_spilled::<M>(run);
                    for i in 0..run.len() {
                        count(GroupKey::new(run.group_at(i)));
                    }
                }
                Slot::Paged(r) if r.counted => counted += r.count,
                Slot::Paged(r) => unknown += r.count,
            }
        }
        (groups, ungrouped, unknown, counted)
    }

    /// How many groups are open by the census kept.
    fn count_open(&self) -> u64 {
        self.line_groups
            .keys()
            .filter(|g| self.is_open(**g))
            .count() as u64
    }

    /// Sets the line's census from the line (a machine decoded from a snapshot, which has no
    /// paged runs).
    fn recount(&mut self) {
        let (groups, ungrouped, unknown, _) = self.census();
        self.line_groups = groups;
        self.line_ungrouped = ungrouped;
        self.line_unknown = unknown;
        self.open_groups = self.count_open();
    }

    /// Whether the census kept change by change is the one counted from scratch, the messages
    /// of runs paged out here aside (for tests: a census that counts too few would leave a
    /// deliverable message in the line).
    #[doc(hidden)]
    pub fn census_is_current(&self) -> bool {
        let (groups, ungrouped, unknown, counted) = self.census();
        let at_least = groups
            .iter()
            .all(|(g, n)| self.line_groups.get(g).is_some_and(|kept| kept >= n))
            && self.line_ungrouped >= ungrouped;
        let kept: u64 = self.line_groups.values().sum::<u64>() + self.line_ungrouped;
        let seen: u64 = groups.values().sum::<u64>() + ungrouped;
        at_least
            && kept.checked_sub(seen) == Some(counted)
            && unknown == self.line_unknown
            && self.count_open() == self.open_groups
    }

    /// A digest of the whole state: two machines with the same digest are the same machine
    /// (used to check that replaying a command log rebuilds a queue exactly). O(state).
    pub fn digest(&self) -> u64 {
        let mut h = crate::stable_hash::StableHasher::new();
        self.next_id.hash(&mut h);
        self.last_index.hash(&mut h);
        self.now_ms.hash(&mut h);
        self.ready_bytes.hash(&mut h);
        self.in_flight_bytes.hash(&mut h);
        // The ready line as one sequence, whichever of its messages are in `ready` and which
        // in the tail, packed or not (packing is node-local); paged runs where they are.
        (
            self.ready.len() as u64 + self.tail_count,
            self.tail_runs,
            self.paged_below,
        )
            .hash(&mut h);
        (self.paged_out_total, self.loaded_total).hash(&mut h);
        for e in &self.ready {
            hash_entry(e, &mut h);
        }
        for s in &self.tail {
            match s {
                Slot::Msg(e) => hash_entry(e, &mut h),
                Slot::Paged(r) => r.hash(&mut h),
                Slot::Packed(run) => {
                    for e in run.entries::<M>() {
                        hash_entry(&e, &mut h);
                    }
                }
                Slot::Spilled(run) => {
                    for e in read_spilled::<M>(run).entries::<M>() {
                        hash_entry(&e, &mut h);
                    }
                }
            }
        }
        self.returned.len().hash(&mut h);
        for e in self.returned.values() {
            hash_entry(e, &mut h);
        }
        self.by_priority.len().hash(&mut h);
        for e in self.by_priority.values() {
            hash_entry(e, &mut h);
        }
        (self.retrying.len(), self.retrying_bytes).hash(&mut h);
        for (at, e) in self.retrying.values() {
            at.hash(&mut h);
            hash_entry(e, &mut h);
        }
        self.retry_due.hash(&mut h);
        (self.parked_count, &self.group_locks).hash(&mut h);
        for (g, line) in &self.parked {
            g.hash(&mut h);
            for e in line.values() {
                hash_entry(e, &mut h);
            }
        }
        (self.policy, self.active, self.last_used).hash(&mut h);
        self.in_flight.len().hash(&mut h);
        self.visibility.hash(&mut h);
        self.ack_deadlines.hash(&mut h);
        self.timers.len().hash(&mut h);
        for (id, t) in &self.timers {
            (id, t).hash(&mut h);
        }
        for f in self.in_flight.values() {
            // Hashed as the `Option<ConsumerId>` it was, so a state of a single node (gets held
            // by node 0) keeps its digest.
            f.holder.consumer().hash(&mut h);
            if let Holder::Get(node @ 1..) = f.holder {
                node.hash(&mut h);
            }
            hash_entry(&f.entry, &mut h);
        }
        self.consumers.len().hash(&mut h);
        let mut args = BytesMut::new();
        for (id, c) in &self.consumers {
            id.hash(&mut h);
            let s = &c.spec;
            (
                s.group,
                &s.tag,
                s.no_ack,
                s.prefetch,
                s.exclusive,
                s.priority,
            )
                .hash(&mut h);
            args.clear();
            s.arguments.encode(&mut args);
            args.hash(&mut h);
            (c.held, c.in_service).hash(&mut h);
        }
        self.service.hash(&mut h);
        self.credit.len().hash(&mut h);
        for (g, c) in &self.credit {
            (g, c).hash(&mut h);
        }
        self.exclusive_consumer.hash(&mut h);
        self.has_had_consumers.hash(&mut h);
        // One set, whichever of the two holds each expiry (packing moves some: node-local).
        (self.expiries_in_order.len() + self.expiries.len()).hash(&mut h);
        let mut in_order = self.in_order_pairs().peekable();
        let mut index = self.expiries.iter().copied().peekable();
        loop {
            let next = match (in_order.peek(), index.peek()) {
                (Some(a), Some(b)) if a <= b => in_order.next(),
                (_, Some(_)) => index.next(),
                (Some(_), None) => in_order.next(),
                (None, None) => break,
            };
            next.hash(&mut h);
        }
        // Only when there are any, so a state without enqueuers keeps its digest.
        if !self.enqueuers.is_empty() {
            self.enqueuers.len().hash(&mut h);
            for (id, e) in &self.enqueuers {
                (id, e).hash(&mut h);
            }
        }
        if !self.expiry_caps.is_empty() {
            self.expiry_caps.hash(&mut h);
        }
        if self.handoff.is_some() {
            self.handoff.hash(&mut h);
        }
        if !self.held.is_empty() {
            (self.held.len(), self.held_seq, self.held_bytes).hash(&mut h);
            for (key, (message, meta)) in &self.held {
                (key, message, meta).hash(&mut h);
            }
        }
        if !self.dedup.is_empty() {
            (&self.dedup, &self.dedup_order, self.dedup_next).hash(&mut h);
        }
        if !self.dead.is_empty() {
            (self.dead.len(), &self.dead).hash(&mut h);
        }
        h.finish()
    }
}

fn hash_entry<M: Hash>(e: &Entry<M>, h: &mut impl Hasher) {
    e.id.hash(h);
    e.msg.hash(h);
    e.meta.hash(h);
    e.delivery_count.hash(h);
    e.maybe_delivered.hash(h);
    e.timed_out.hash(h);
}

/// A digest of a command's effects and reply, for comparing a replay with the original run.
pub fn effects_digest<M: Hash>(reply: &Reply, effects: &[Effect<M>]) -> u64 {
    let mut h = crate::stable_hash::StableHasher::new();
    reply.hash(&mut h);
    effects.hash(&mut h);
    h.finish()
}

/// The entries of `map` past its `skip` first, from the first whose key is above `after` on.
fn range_past<K: Ord + Copy, V>(
    map: &mut BTreeMap<K, V>,
    skip: usize,
    after: Option<K>,
) -> std::collections::btree_map::RangeMut<'_, K, V> {
    use std::ops::Bound;
    let start = match (map.keys().nth(skip).copied(), after) {
        (Some(b), Some(a)) if a >= b => Bound::Excluded(a),
        (Some(b), _) => Bound::Included(b),
        // Nothing past the skipped ones: past the last key (none: the map is empty).
        (None, _) => match map.keys().next_back().copied() {
            Some(last) => Bound::Excluded(last),
            None => Bound::Unbounded,
        },
    };
    map.range_mut((start, Bound::Unbounded))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A machine of packable `u64` payloads, for [`QueueMachine::pack_line`].
    fn packing_line(expiries: impl Fn(u64) -> Option<u64>, n: u64) -> QueueMachine<u64> {
        let mut m = QueueMachine::new();
        enqueue_ids(&mut m, 0..n, expiries);
        m
    }

    /// Enqueues payloads `ids` (each its own id, at log index id + 1) with these expiries.
    fn enqueue_ids(
        m: &mut QueueMachine<u64>,
        ids: std::ops::Range<u64>,
        expiries: impl Fn(u64) -> Option<u64>,
    ) {
        enqueue_metas(m, ids, |id| MsgMeta {
            size: 1,
            expires_at: expiries(id),
            ..MsgMeta::default()
        });
    }

    /// Enqueues payloads `ids` (each its own id, at log index id + 1) with these metadata.
    fn enqueue_metas(
        m: &mut QueueMachine<u64>,
        ids: std::ops::Range<u64>,
        meta_of: impl Fn(u64) -> MsgMeta,
    ) {
        for id in ids {
            let meta = Meta {
                index: id + 1,
                now_ms: 0,
            };
            let message = Command::Enqueue {
                message: id,
                meta: meta_of(id),
            };
            m.apply(meta, message, &mut Vec::new());
        }
    }

    /// A message of group `g`.
    /// Applies `c` as the next command, at time 0; its effects.
    fn step_at_zero(m: &mut QueueMachine<u64>, c: Command<u64>) -> Vec<Effect<u64>> {
        let mut effects = Vec::new();
        let meta = Meta {
            index: m.last_index() + 1,
            now_ms: 0,
        };
        m.apply(meta, c, &mut effects);
        effects
    }

    /// The receipts of the deliveries among `effects`.
    fn receipts_of(effects: &[Effect<u64>]) -> Vec<Receipt> {
        effects
            .iter()
            .filter_map(|e| match e {
                Effect::Deliver(d) => Some(d.receipt),
                _ => None,
            })
            .collect()
    }

    fn in_group(g: u64) -> MsgMeta {
        MsgMeta {
            size: 1,
            group: GroupKey::new(g),
            ..MsgMeta::default()
        }
    }

    /// A message that does not pack (a classic queue's, which pages instead).
    fn unpackable() -> MsgMeta {
        MsgMeta {
            size: 1,
            pageable: true,
            ..MsgMeta::default()
        }
    }

    /// A queue none of whose messages packs has nothing to pack: its line stays where it is at
    /// every call (a queue whose every message had a TTL, which did not pack then, was moved
    /// to the tail and back, whole, at each pass: its publishes became quadratic).
    #[test]
    fn a_line_with_nothing_to_pack_stays_as_it_is() {
        let mut m = QueueMachine::new();
        enqueue_metas(&mut m, 0..10_000, |_| unpackable());
        let digest = m.digest();
        for upto in [5_000, 9_999, 9_999] {
            assert_eq!(m.pack_line(16, upto), 0);
            assert!(m.tail.is_empty());
            assert_eq!(m.ready.len(), 10_000);
        }
        assert_eq!(m.digest(), digest);
    }

    /// A queue TTL's line packs as any other (its expiries as offsets from each run's base),
    /// and its messages expire from their runs, in order, as they would whole.
    #[test]
    fn a_line_with_a_queue_ttl_packs_and_expires_from_its_runs_in_order() {
        let n = 2 * PACKED_RUN as u64 + 100;
        let ttl = |id: u64| Some(1_000 + id);
        let mut m = packing_line(ttl, n);
        let mut whole = packing_line(ttl, n);
        let digest = m.digest();
        assert_eq!(m.pack_line(16, n - 1), n as usize - 16);
        assert_eq!(
            m.digest(),
            digest,
            "packing changes nothing the machine holds"
        );
        assert_eq!(m.tail_packed, 3);
        assert!(
            m.expiries.is_empty(),
            "the in-order deque reaches the packed line: no tree node a message"
        );
        assert_eq!(m.next_deadline(), whole.next_deadline());
        // Half of them expire: from the head, then the runs' fronts, across a run's end.
        for now in [1_010, 1_000 + PACKED_RUN as u64 + 50, 1_000 + n + 5] {
            let meta = Meta {
                index: m.last_index() + 1,
                now_ms: now,
            };
            let (mut a, mut b) = (Vec::new(), Vec::new());
            m.apply(meta, Command::Tick, &mut a);
            whole.apply(meta, Command::Tick, &mut b);
            assert_eq!(a, b, "the same expiries, in the same order, at {now}");
            assert_eq!(m.digest(), whole.digest());
            assert_eq!(m.ready_count(), whole.ready_count());
        }
        assert_eq!(m.ready_count(), 0);
        assert_eq!(m.tail_packed, 0, "every run went as its messages did");
    }

    /// A run keeps expiries within about 24 days either side of its first; a message whose
    /// expiry is out of reach starts a run of its own, and each comes back with its own expiry.
    #[test]
    fn an_expiry_out_of_a_runs_reach_starts_another_run() {
        let far = 60 * 24 * 3_600_000;
        let mut m = packing_line(|id| Some(if id % 2 == 0 { 1_000 } else { far + id }), 40);
        let digest = m.digest();
        assert_eq!(m.pack_line(1, 39), 39);
        assert_eq!(m.digest(), digest);
        assert_eq!(m.tail_packed, 39, "each one a run of its own");
        let e = m
            .tail_entries()
            .map(|e| e.meta.expires_at)
            .collect::<Vec<_>>();
        let want: Vec<_> = (1..40)
            .map(|id| Some(if id % 2 == 0 { 1_000 } else { far + id }))
            .collect();
        assert_eq!(e, want);
        // The latest expiry there is (a huge per-message one) is out of any run's reach but
        // its own, and comes back as it was.
        let mut m = packing_line(|id| Some(if id == 3 { u64::MAX } else { 1_000 }), 8);
        let digest = m.digest();
        assert_eq!(m.pack_line(1, 7), 7);
        assert_eq!(m.digest(), digest);
        let e = m
            .tail_entries()
            .map(|e| e.meta.expires_at)
            .collect::<Vec<_>>();
        let want: Vec<_> = (1..8)
            .map(|id| Some(if id == 3 { u64::MAX } else { 1_000 }))
            .collect();
        assert_eq!(e, want);
        // No expiry at all, and one of 0, pack too.
        let mut m = packing_line(|id| (id % 2 == 0).then_some(0), 10);
        let digest = m.digest();
        assert_eq!(m.pack_line(1, 9), 9);
        assert_eq!(m.digest(), digest);
        assert_eq!(m.tail_packed, 1);
    }

    /// A message that packs alone between two that do not stays whole (a run of one takes
    /// more memory than its entry); runs of two or more pack; each message is looked at once.
    #[test]
    fn lone_messages_stay_whole_and_runs_pack() {
        // Ids 0..16 the window; then alternating (odd ids do not pack), then a run of 5.
        let mut m = QueueMachine::new();
        enqueue_metas(&mut m, 0..45, |id| {
            if id < 40 && id % 2 == 1 {
                unpackable()
            } else {
                MsgMeta {
                    size: 1,
                    ..MsgMeta::default()
                }
            }
        });
        let digest = m.digest();
        assert_eq!(m.pack_line(16, 44), 5, "the run of 40..45 alone");
        assert_eq!(m.digest(), digest);
        assert_eq!(m.packed_count(), 5);
        assert_eq!(m.tail_packed, 1);
        // Looked at once: a second call finds nothing new.
        assert_eq!(m.pack_line(16, 44), 0);
    }

    /// Messages in groups pack too (a run keeps their groups beside them, 8 bytes each, only
    /// once one of its messages is in a group), come back in their groups, and reach consumers
    /// exactly as the line they pack: a group's next message waits for the one before.
    #[test]
    fn a_line_in_groups_packs_and_delivers_as_the_whole_line() {
        let meta = |id: u64| match id % 5 {
            0 => MsgMeta {
                size: 1,
                ..MsgMeta::default()
            },
            g => in_group(g),
        };
        let mut packed = QueueMachine::new();
        let mut whole = QueueMachine::new();
        enqueue_metas(&mut packed, 0..200, meta);
        enqueue_metas(&mut whole, 0..200, meta);
        assert_eq!(packed.pack_line(16, 199), 184);
        assert_eq!(packed.digest(), whole.digest());
        let groups: Vec<Option<GroupKey>> = packed.tail_entries().map(|e| e.meta.group).collect();
        let want: Vec<Option<GroupKey>> = (16..200).map(|id| meta(id).group).collect();
        assert_eq!(groups, want);
        // A run that began with messages in no group takes its first grouped one.
        let mut late = QueueMachine::new();
        enqueue_metas(&mut late, 0..40, |id| {
            if id < 30 {
                meta(0)
            } else {
                in_group(3)
            }
        });
        assert_eq!(late.pack_line(4, 39), 36);
        assert_eq!(late.tail_packed, 1);
        let groups: Vec<Option<GroupKey>> = late.tail_entries().map(|e| e.meta.group).collect();
        let want: Vec<Option<GroupKey>> = (4..40)
            .map(|id| if id < 30 { None } else { GroupKey::new(3) })
            .collect();
        assert_eq!(groups, want);
        // Two consumers take and settle, a few at a time: the same deliveries from both.
        let step = step_at_zero;
        for m in [&mut packed, &mut whole] {
            for id in 1..=2 {
                step(
                    m,
                    Command::Consume {
                        id: ConsumerId(id),
                        spec: spec(1, 3, false),
                    },
                );
            }
        }
        let mut settled = 0;
        while settled < 200 {
            let a = step(&mut packed, Command::Checkout { max: 4 });
            let b = step(&mut whole, Command::Checkout { max: 4 });
            assert_eq!(a, b, "the same deliveries after {settled} settled");
            assert_eq!(packed.digest(), whole.digest());
            let receipts = receipts_of(&a);
            assert!(
                !receipts.is_empty(),
                "nothing delivered after {settled} settled"
            );
            for r in receipts {
                let x = step(&mut packed, Command::Settle { receipt: r });
                let y = step(&mut whole, Command::Settle { receipt: r });
                assert_eq!(x, y);
                settled += 1;
            }
        }
        assert_eq!(packed.ready_count(), 0);
        assert_eq!(packed.digest(), whole.digest());
    }

    /// A deep line in few groups, drained by a consumer with room for more messages than
    /// there are groups: once every group has a message out, the next checkout finds nothing
    /// to send. Counting the line per group, it leaves the line packed where it is; walking
    /// it, every message was set aside, whole, on the way to its end. Both send the same.
    #[test]
    fn a_checkout_with_every_group_busy_leaves_a_packed_line_where_it_is() {
        let step = step_at_zero;
        let (groups, n) = (4u64, 2_000u64);
        let mut machines = [false, true].map(|index_groups| {
            let mut m = QueueMachine::new();
            step(
                &mut m,
                Command::Configure(Policy {
                    index_groups,
                    ..Policy::default()
                }),
            );
            enqueue_metas(&mut m, 0..n, |id| in_group(id % groups + 1));
            m.pack_line(16, n - 1);
            step(
                &mut m,
                Command::Consume {
                    id: ConsumerId(1),
                    spec: spec(1, 10, false),
                },
            );
            m
        });
        let mut settled = 0;
        while settled < n {
            let [walked, counted] = &mut machines;
            let a = step(walked, Command::Checkout { max: 10 });
            let b = step(counted, Command::Checkout { max: 10 });
            assert_eq!(a, b, "the same deliveries after {settled} settled");
            assert!(counted.census_is_current());
            if settled == 0 {
                // Walked: everything but the first of each group set aside, whole.
                assert_eq!(walked.parked_len() as u64, n - groups);
                assert_eq!(walked.packed_count(), 0);
            }
            // Counted: nothing set aside but what came before a group's next message.
            assert!(counted.parked_len() as u64 <= groups * groups, "{settled}");
            if settled < n / 2 {
                assert!(counted.packed_count() as u64 > n / 3, "{settled}");
            }
            let receipts = receipts_of(&a);
            assert_eq!(receipts.len() as u64, groups.min(n - settled));
            for r in receipts {
                assert_eq!(
                    step(walked, Command::Settle { receipt: r }),
                    step(counted, Command::Settle { receipt: r })
                );
                settled += 1;
            }
        }
        for m in &machines {
            assert_eq!(m.ready_count(), 0);
        }
    }

    /// A packed message of a deep replicated queue is its id, its size and one pointer (the
    /// handle of its contents: docs/design.md §9 counts on these sizes).
    #[test]
    fn a_packed_message_takes_24_bytes_of_its_run() {
        assert_eq!(std::mem::size_of::<Packed<crate::PackedMessage>>(), 24);
    }

    /// A leader's committed machine packs a message as it takes the other machine's copy
    /// (`share_payload`): one that follows a full run starts a run of its own, whose first id
    /// is past what `pack_line` looked at. The next call took that run for messages to look
    /// at and dropped it: the machine lost its messages (a deep quorum queue's leader then
    /// snapshotted its queue without them, and a follower sent that snapshot held fewer).
    #[test]
    fn a_run_packed_by_a_share_after_a_full_run_is_kept_by_the_next_pack() {
        let n = 16 + PACKED_RUN as u64;
        let mut m = packing_line(|_| None, n);
        assert_eq!(m.pack_line(16, n - 1), PACKED_RUN);
        // Published since the pass: whole in the tail, after the full run.
        let mut more = packing_line(|_| None, n + 10);
        enqueue_ids(&mut m, n..n + 10, |_| None);
        // Their copies shared as their entries commit: the first starts a run after the full one.
        assert!(m.share_payload(n, &n));
        assert_eq!(m.packed_count(), PACKED_RUN + 1);
        let digest = m.digest();
        m.pack_line(16, n + 9);
        assert_eq!(m.packed_count(), PACKED_RUN + 10);
        assert_eq!(m.digest(), digest);
        let ids: Vec<u64> = m.ready_messages().map(|(id, _, _)| id).collect();
        assert_eq!(ids, (0..n + 10).collect::<Vec<_>>());
        assert_eq!(m.ready_count(), (n + 10) as usize);
        assert_eq!(more.pack_line(16, n + 9), PACKED_RUN + 10);
        assert_eq!(more.digest(), digest);
    }

    /// Runs written out of memory ([`QueueMachine::spill_line`]) change nothing the machine
    /// does: its line is counted by group, expired and drained as the whole line is, packed
    /// and spilled again as more comes; a run read back for a message in its middle (one
    /// expiring there) stays in memory.
    #[test]
    fn a_spilled_line_expires_and_delivers_as_the_whole_line() {
        let run = PACKED_RUN as u64;
        let n = 5 * run + 300;
        let meta = |id: u64| MsgMeta {
            size: 1 + id % 7,
            expires_at: id.is_multiple_of(11).then_some(50_000 + id),
            group: GroupKey::new(id % 3),
            ..MsgMeta::default()
        };
        let mut spilled = QueueMachine::new();
        let mut whole = QueueMachine::new();
        enqueue_metas(&mut spilled, 0..n, meta);
        enqueue_metas(&mut whole, 0..n, meta);
        assert_eq!(spilled.pack_line(16, n - 1), (n - 16) as usize);
        assert_eq!(spilled.tail_packed, 6);
        // The first run stays, and the last (it may still grow).
        assert_eq!(spilled.spill_line(1, 64), 4 * PACKED_RUN);
        assert_eq!(spilled.spill_line(1, 64), 0, "looked at already");
        assert_eq!(spilled.spilled_count(), 4 * PACKED_RUN);
        assert_eq!(spilled.packed_count(), (n - 16) as usize);
        assert_eq!(spilled.digest(), whole.digest());
        assert!(spilled.census_is_current());
        // More comes: the last run fills and is followed, so it goes too.
        enqueue_metas(&mut spilled, n..n + run, meta);
        enqueue_metas(&mut whole, n..n + run, meta);
        spilled.pack_line(16, n + run - 1);
        assert_eq!(spilled.spill_line(1, 64), PACKED_RUN);
        assert_eq!(spilled.digest(), whole.digest());
        let ids: Vec<u64> = spilled.ready_messages().map(|(id, _, _)| id).collect();
        assert_eq!(ids, (0..n + run).collect::<Vec<_>>());
        // Expiries in the middle of spilled runs, then across them.
        for now in [50_000 + 2 * run + 10, 50_000 + 3 * run + 500] {
            tick_alike(&mut spilled, &mut whole, now);
        }
        assert!(
            spilled.spilled_count() < 5 * PACKED_RUN,
            "runs read back for their expiries stay in memory"
        );
        assert!(spilled.census_is_current());
        // Two consumers drain both lines, a few at a time: the same deliveries.
        drain_alike(&mut spilled, &mut whole, 2, 50, 64);
        assert_eq!(spilled.ready_count(), 0);
        assert_eq!(spilled.spilled_count(), 0);
        assert_eq!(spilled.digest(), whole.digest());
    }

    /// A queue TTL's line (every message expires after the one before it, a log entry's
    /// messages at the same time) keeps no pair per message for its runs written out of
    /// memory: their pairs are folded, read back with the run, and everything the machine
    /// does is as with the whole line (expiries at the front and in a run's middle, digests,
    /// a snapshot, the drain).
    #[test]
    fn a_queue_ttls_spilled_runs_keep_no_expiry_per_message() {
        let run = PACKED_RUN as u64;
        let n = 6 * run + 100;
        // A hundred messages an entry, as a busy publisher's: the same expiry each.
        let meta = |id: u64| MsgMeta {
            size: 3,
            expires_at: Some(100_000 + id / 100),
            ..MsgMeta::default()
        };
        let mut spilled = QueueMachine::new();
        let mut whole = QueueMachine::new();
        enqueue_metas(&mut spilled, 0..n, meta);
        enqueue_metas(&mut whole, 0..n, meta);
        assert_eq!(spilled.expiries_in_order.in_memory(), n as usize);
        spilled.pack_line(16, n - 1);
        // All but the first run and the last (it may still grow).
        assert_eq!(spilled.spill_line(1, 64), 5 * PACKED_RUN);
        assert_eq!(spilled.expiries_in_order.len(), n as usize);
        let kept = spilled.expiries_in_order.in_memory();
        assert_eq!(kept, n as usize - 5 * PACKED_RUN + 5, "five runs folded");
        assert_eq!(spilled.digest(), whole.digest());
        // The head expires into the first spilled run, then into the middle of the next.
        for now in [100_001 + (run + 50) / 100, 100_001 + (2 * run + 3000) / 100] {
            tick_alike(&mut spilled, &mut whole, now);
            assert_eq!(spilled.next_deadline(), whole.next_deadline());
        }
        assert!(spilled.spilled_count() < 5 * PACKED_RUN, "runs read back");
        assert_eq!(
            spilled.expiries_in_order.len(),
            whole.expiries_in_order.len()
        );
        // More comes and is spilled; a consumer drains both lines the same way.
        enqueue_metas(&mut spilled, n..n + 2 * run, meta);
        enqueue_metas(&mut whole, n..n + 2 * run, meta);
        spilled.pack_line(16, n + 2 * run - 1);
        assert!(spilled.spill_line(1, 64) > 0);
        assert!(spilled.expiries_in_order.in_memory() < spilled.expiries_in_order.len() / 2);
        assert_eq!(spilled.digest(), whole.digest());
        drain_alike(&mut spilled, &mut whole, 1, 100, 100);
        assert_eq!(spilled.expiries_in_order.len(), 0);
        assert_eq!(spilled.digest(), whole.digest());
    }

    /// A message shared into a line whose last run was written out of memory starts a run
    /// of its own (a spilled run takes no more), and a purge lets spilled runs go.
    #[test]
    fn a_message_after_a_spilled_run_packs_in_a_run_of_its_own() {
        // Two blocks of ids: runs of 16 to 4,095 and of 4,096 to 8,191.
        let n = 2 * PACKED_RUN as u64;
        let packed = n as usize - 16;
        let mut m = packing_line(|_| None, n);
        assert_eq!(m.pack_line(16, n - 1), packed);
        enqueue_ids(&mut m, n..n + 2, |_| None);
        // The second run is followed by a message slot now: both runs go.
        assert_eq!(m.spill_line(0, 1), packed);
        assert!(m.share_payload(n, &n));
        assert_eq!(m.packed_count(), packed + 1);
        assert_eq!(m.tail_packed, 3);
        let ids: Vec<u64> = m.ready_messages().map(|(id, _, _)| id).collect();
        assert_eq!(ids, (0..n + 2).collect::<Vec<_>>());
        step_at_zero(&mut m, Command::Purge);
        assert_eq!(m.ready_count(), 0);
        assert_eq!(m.spilled_count(), 0);
    }

    /// A leader's two machines: the one that runs ahead spills only runs the committed one
    /// holds too (`below`), and the committed one shares each run spilled the same (one
    /// record), waits for a run the other has not looked at, and writes its own for a run
    /// the other left as it was.
    #[test]
    fn a_leaders_committed_machine_shares_the_runs_its_other_machine_spilled() {
        let run = PACKED_RUN as u64;
        let n = 16 + 6 * run;
        let mut ahead = packing_line(|_| None, n);
        let mut committed = packing_line(|_| None, n);
        for m in [&mut ahead, &mut committed] {
            assert_eq!(m.pack_line(16, n - 1), 6 * PACKED_RUN);
        }
        assert_eq!(
            committed.spill_line_with(1, 64, u64::MAX, Some(&ahead)),
            0,
            "nothing looked at by the other machine yet"
        );
        // The committed machine holds ids below 16 + 3 runs: the ahead one spills runs 2 and 3.
        assert_eq!(
            ahead.spill_line_with(1, 64, 16 + 3 * run, None),
            2 * PACKED_RUN
        );
        assert_eq!(
            committed.spill_line_with(1, 64, u64::MAX, Some(&ahead)),
            2 * PACKED_RUN
        );
        let shared = shared_records;
        assert_eq!(
            shared(&committed, &ahead),
            2,
            "one record for both machines"
        );
        // The ahead machine passes over runs 4 to 6 without spilling them (too short for its
        // `min`): the committed machine writes its own (the last too: it is full).
        ahead.spill_line_with(1, PACKED_RUN + 1, u64::MAX, None);
        assert_eq!(
            committed.spill_line_with(1, 64, u64::MAX, Some(&ahead)),
            3 * PACKED_RUN
        );
        assert_eq!(shared(&committed, &ahead), 2);
        assert_eq!(committed.spilled_count(), 5 * PACKED_RUN);
        assert_eq!(committed.digest(), ahead.digest());
        let ids: Vec<u64> = committed.ready_messages().map(|(id, _, _)| id).collect();
        assert_eq!(ids, (0..n).collect::<Vec<_>>());
    }

    /// A tick at `now` on `a` and `b`: something expires, the same on both, and their digests
    /// stay equal.
    fn tick_alike(a: &mut QueueMachine<u64>, b: &mut QueueMachine<u64>, now: u64) {
        let meta = Meta {
            index: a.last_index() + 1,
            now_ms: now,
        };
        let (mut ea, mut eb) = (Vec::new(), Vec::new());
        a.apply(meta, Command::Tick, &mut ea);
        b.apply(meta, Command::Tick, &mut eb);
        assert!(!ea.is_empty());
        assert_eq!(ea, eb, "the same expiries at {now}");
        assert_eq!(a.digest(), b.digest());
    }

    /// Consumers 1 to `consumers` (prefetch `prefetch` each) drain `a` and `b`, `max` a
    /// checkout, each delivery settled: the same deliveries and replies in every round, and
    /// the same digests every 64 rounds.
    fn drain_alike(
        a: &mut QueueMachine<u64>,
        b: &mut QueueMachine<u64>,
        consumers: u64,
        prefetch: u32,
        max: u32,
    ) {
        for m in [&mut *a, &mut *b] {
            for id in 1..=consumers {
                step_at_zero(
                    m,
                    Command::Consume {
                        id: ConsumerId(id),
                        spec: spec(1, prefetch, false),
                    },
                );
            }
        }
        let mut rounds = 0;
        while b.ready_count() > 0 {
            rounds += 1;
            assert!(rounds < 10_000, "the lines do not drain");
            let da = step_at_zero(a, Command::Checkout { max });
            let db = step_at_zero(b, Command::Checkout { max });
            assert_eq!(da, db, "the same deliveries in round {rounds}");
            for r in receipts_of(&da) {
                assert_eq!(
                    step_at_zero(a, Command::Settle { receipt: r }),
                    step_at_zero(b, Command::Settle { receipt: r })
                );
            }
            if rounds % 64 == 0 {
                assert_eq!(a.digest(), b.digest());
            }
        }
    }

    /// How many of `a`'s spilled runs are one record with a run of `b`'s.
    fn shared_records(a: &QueueMachine<u64>, b: &QueueMachine<u64>) -> usize {
        a.tail
            .iter()
            .filter_map(|s| match s {
                Slot::Spilled(r) => b
                    .spilled_at(r.first)
                    .map(|o| std::sync::Arc::ptr_eq(&o.handle, &r.handle)),
                _ => None,
            })
            .filter(|same| *same)
            .count()
    }

    /// A run holds one block of `PACKED_RUN` ids: a machine that kept a message whole where
    /// its other machine packed it (here one of the first block) makes the same runs past
    /// that block, and shares their spilled records. Runs that started wherever the last one
    /// ended were offset from there on, and a leader wrote each of a deep queue's runs twice.
    #[test]
    fn runs_hold_blocks_of_ids_so_two_machines_share_them_past_a_difference() {
        let run = PACKED_RUN as u64;
        let n = 4 * run + 10;
        let mut ahead = packing_line(|_| None, n);
        let mut committed = QueueMachine::new();
        enqueue_metas(&mut committed, 0..n, |id| MsgMeta {
            size: 1,
            pageable: id == 100,
            ..MsgMeta::default()
        });
        ahead.pack_line(16, n - 1);
        committed.pack_line(16, n - 1);
        let firsts = |m: &QueueMachine<u64>| -> Vec<u64> {
            m.tail
                .iter()
                .filter(|s| s.is_run_of_packed())
                .map(Slot::first_id)
                .collect()
        };
        assert_eq!(firsts(&ahead), [16, run, 2 * run, 3 * run, 4 * run]);
        assert_eq!(
            firsts(&committed),
            [16, 101, run, 2 * run, 3 * run, 4 * run]
        );
        assert!(ahead.spill_line_with(0, 64, u64::MAX, None) > 0);
        assert!(committed.spill_line_with(0, 64, u64::MAX, Some(&ahead)) > 0);
        assert_eq!(
            shared_records(&committed, &ahead),
            3,
            "the second, third and fourth blocks' runs"
        );
    }

    type M = QueueMachine<&'static str>;

    struct Driver {
        m: M,
        index: u64,
        now: u64,
        effects: Vec<Effect<&'static str>>,
    }

    impl Driver {
        fn new() -> Self {
            Driver {
                m: M::new(),
                index: 0,
                now: 0,
                effects: Vec::new(),
            }
        }

        fn run(&mut self, c: Command<&'static str>) -> Reply {
            self.index += 1;
            let meta = Meta {
                index: self.index,
                now_ms: self.now,
            };
            self.m.apply(meta, c, &mut self.effects)
        }

        fn settle(&mut self, msg_id: u64, attempt: u32) -> Reply {
            self.run(Command::Settle {
                receipt: receipt(msg_id, attempt),
            })
        }

        fn ret(&mut self, msg_id: u64, attempt: u32) -> Reply {
            self.run(Command::Return {
                receipt: receipt(msg_id, attempt),
            })
        }

        fn enqueue(&mut self, s: &'static str, size: u64, expires_at: Option<u64>) -> u64 {
            match self.run(Command::Enqueue {
                message: s,
                meta: MsgMeta {
                    size,
                    expires_at,
                    pageable: false,
                    spilled: false,
                    priority: 0,
                    group: None,
                },
            }) {
                Reply::Enqueued { msg_id } => msg_id,
                other => panic!("unexpected {other:?}"),
            }
        }

        fn delivered(&mut self) -> Vec<(Option<u64>, u64, u32, bool)> {
            self.effects
                .drain(..)
                .filter_map(|e| match e {
                    Effect::Deliver(d) => Some((
                        d.consumer.map(|c| c.0),
                        d.receipt.msg_id,
                        d.receipt.attempt,
                        d.redelivered,
                    )),
                    _ => None,
                })
                .collect()
        }
    }

    fn spec(channel: u16, prefetch: u32, no_ack: bool) -> ConsumerSpec {
        ConsumerSpec {
            group: CreditGroup { conn: 1, channel },
            tag: ShortStr::from("t"),
            no_ack,
            prefetch,
            exclusive: false,
            priority: 0,
            arguments: FieldTable::new(),
        }
    }

    fn receipt(msg_id: u64, attempt: u32) -> Receipt {
        Receipt { msg_id, attempt }
    }

    #[test]
    fn a_message_is_taken_at_once_while_the_waiting_consumers_have_room_for_all_ready_before_it() {
        let mut d = Driver::new();
        assert!(!d.m.takes_at_once(), "no consumer");
        d.run(Command::Consume {
            id: ConsumerId(1),
            spec: spec(1, 3, false),
        });
        assert!(d.m.takes_at_once());
        // Two publishes of one read, before the checkout: room for three.
        d.enqueue("a", 1, None);
        d.enqueue("b", 1, None);
        assert!(d.m.takes_at_once(), "the third still fits");
        d.enqueue("c", 1, None);
        assert!(!d.m.takes_at_once(), "the fourth would wait");
        // A second consumer's room counts too; a channel-wide limit caps a consumer's.
        d.run(Command::Consume {
            id: ConsumerId(2),
            spec: spec(2, 10, false),
        });
        assert!(d.m.takes_at_once());
        d.run(Command::Credit {
            group: CreditGroup {
                conn: 1,
                channel: 2,
            },
            credit: Credit {
                blocked: false,
                limit: Some(0),
            },
        });
        assert!(!d.m.takes_at_once(), "consumer 2's channel has no credit");
        d.run(Command::Checkout { max: 10 });
        assert_eq!(d.delivered().len(), 3);
        assert!(!d.m.takes_at_once(), "consumer 1 is full, 2 has no credit");
    }

    #[test]
    fn a_channel_wide_limit_is_counted_once_for_all_its_consumers() {
        let mut d = Driver::new();
        for id in [1, 2] {
            d.run(Command::Consume {
                id: ConsumerId(id),
                spec: spec(1, 0, false),
            });
        }
        // The channel may take one more message in all (a global prefetch of 1).
        d.run(Command::Credit {
            group: CreditGroup {
                conn: 1,
                channel: 1,
            },
            credit: Credit {
                blocked: false,
                limit: Some(1),
            },
        });
        assert!(d.m.takes_at_once());
        d.enqueue("a", 1, None);
        assert!(
            !d.m.takes_at_once(),
            "the second would wait for the first's ack, whichever consumer"
        );
    }

    #[test]
    fn an_equal_payload_is_shared_where_the_message_waits_and_nothing_else_changes() {
        let mut d = Driver::new();
        let a = d.enqueue("alpha", 5, None);
        let b = d.enqueue("beta", 4, None);
        let before = d.m.digest();
        // The same text at another address, as a message decoded from a log is.
        let copy: &'static str = Box::leak(String::from("alpha").into_boxed_str());
        assert!(!std::ptr::eq(
            d.m.payload(a).unwrap().as_ptr(),
            copy.as_ptr()
        ));
        assert!(d.m.share_payload(a, &copy));
        assert!(std::ptr::eq(
            d.m.payload(a).unwrap().as_ptr(),
            copy.as_ptr()
        ));
        assert_eq!(d.m.digest(), before, "nothing the machine does changed");
        assert!(
            !d.m.share_payload(b, &"not beta"),
            "a different value is no copy"
        );
        assert_eq!(d.m.payload(b), Some(&"beta"));
        assert!(!d.m.share_payload(99, &"alpha"));
        assert_eq!(d.m.payload(99), None);
    }

    /// A line that held many messages gives its room back as it drains, and keeps what it
    /// needs while it is deep.
    #[test]
    fn a_drained_line_gives_its_room_back() {
        let mut d = Driver::new();
        for _ in 0..100_000 {
            d.enqueue("m", 1, None);
        }
        assert!(d.m.ready.capacity() >= 100_000);
        for _ in 0..99_000 {
            d.run(Command::Get { no_ack: true });
        }
        assert_eq!(d.m.ready_count(), 1_000);
        assert!(
            d.m.ready.capacity() <= 4 * 1_000 + SHRINK_ABOVE,
            "{} slots for 1,000 messages",
            d.m.ready.capacity()
        );
        d.run(Command::Purge);
        assert!(d.m.ready.capacity() <= SHRINK_ABOVE);
        for _ in 0..10_000 {
            d.enqueue("m", 1, None);
        }
        assert_eq!(d.m.ready_count(), 10_000);
    }

    /// A deep line's messages are found wherever they are (the last ones are looked for
    /// first), and a run of them is shared in one walk.
    #[test]
    fn messages_of_a_deep_line_are_found_and_shared_in_order() {
        const WORDS: [&str; 3] = ["a", "b", "c"];
        let mut d = Driver::new();
        let ids: Vec<u64> = (0..300).map(|i| d.enqueue(WORDS[i % 3], 1, None)).collect();
        // A gap: ids are not positions.
        d.run(Command::Purge);
        let ids: Vec<u64> = ids
            .iter()
            .map(|i| d.enqueue(WORDS[(*i % 3) as usize], 1, None))
            .collect();
        for (n, id) in ids.iter().enumerate() {
            assert_eq!(d.m.payload(*id), Some(&WORDS[n % 3]), "message {id}");
        }
        assert_eq!(d.m.payload(ids[0] - 1), None);
        assert_eq!(d.m.payload(ids[299] + 1), None);
        let before = d.m.digest();
        let copies: Vec<(u64, &'static str)> = ids[100..250]
            .iter()
            .enumerate()
            .filter(|(n, _)| n % 2 == 0)
            .map(|(n, id)| {
                let copy: &'static str =
                    Box::leak(String::from(WORDS[(n + 100) % 3]).into_boxed_str());
                (*id, copy)
            })
            .chain([(ids[299] + 5, "a")])
            .collect();
        assert_eq!(d.m.share_head_payloads(&copies), 75);
        for (id, copy) in &copies[..75] {
            assert!(std::ptr::eq(
                d.m.payload(*id).unwrap().as_ptr(),
                copy.as_ptr()
            ));
        }
        assert_eq!(d.m.digest(), before);
    }

    #[test]
    fn round_robin_prefetch_and_requeue_to_original_position() {
        let mut d = Driver::new();
        for s in ["a", "b", "c", "d"] {
            d.enqueue(s, 1, None);
        }
        assert_eq!(
            d.run(Command::Consume {
                id: ConsumerId(1),
                spec: spec(1, 1, false)
            }),
            Reply::Ok
        );
        assert_eq!(
            d.run(Command::Consume {
                id: ConsumerId(2),
                spec: spec(2, 0, false)
            }),
            Reply::Ok
        );
        assert_eq!(
            d.run(Command::Consume {
                id: ConsumerId(2),
                spec: spec(2, 0, false)
            }),
            Reply::Refused(Refusal::DuplicateConsumer)
        );
        assert_eq!(
            d.run(Command::Checkout { max: 3 }),
            Reply::Delivered { count: 3 }
        );
        // Consumer 1 has prefetch 1: after one message it leaves the rotation.
        assert_eq!(
            d.delivered(),
            vec![
                (Some(1), 0, 1, false),
                (Some(2), 1, 1, false),
                (Some(2), 2, 1, false)
            ]
        );
        assert_eq!((d.m.ready_count(), d.m.in_flight_count()), (1, 3));
        assert_eq!((d.m.ready_bytes(), d.m.in_flight_bytes()), (1, 3));
        // Return 1: it comes back before 3.
        assert_eq!(d.ret(1, 1), Reply::Ok);
        assert_eq!(d.ret(1, 1), Reply::Stale);
        assert_eq!(d.m.ready_ids(), vec![1, 3]);
        assert_eq!(
            d.run(Command::Get { no_ack: false }),
            Reply::Delivered { count: 1 }
        );
        assert_eq!(d.delivered(), vec![(None, 1, 2, true)]);
        // The first delivery's receipt is stale now; the second's settles.
        assert_eq!(d.settle(1, 1), Reply::Stale);
        assert_eq!(d.m.holder(receipt(1, 2)), Some(None));
        assert_eq!(d.settle(1, 2), Reply::Ok);
        // Settling consumer 1's message gives it credit back: it takes message 3.
        assert_eq!(d.settle(0, 1), Reply::Ok);
        d.run(Command::Credit {
            group: CreditGroup {
                conn: 1,
                channel: 2,
            },
            credit: Credit {
                blocked: true,
                limit: None,
            },
        });
        assert_eq!(
            d.run(Command::Checkout { max: 10 }),
            Reply::Delivered { count: 1 }
        );
        assert_eq!(d.delivered(), vec![(Some(1), 3, 1, false)]);
        match d.run(Command::Discard {
            receipt: receipt(2, 1),
        }) {
            Reply::Ok => {}
            other => panic!("unexpected {other:?}"),
        }
        assert!(matches!(
            d.effects.pop(),
            Some(Effect::DeadLetter {
                msg_id: 2,
                reason: DeadLetterReason::Rejected,
                ..
            })
        ));
        assert_eq!(d.run(Command::Purge), Reply::Purged { count: 0 });
        assert_eq!(
            d.run(Command::Cancel { id: ConsumerId(2) }),
            Reply::Cancelled { consumers_left: 1 }
        );
        assert_eq!(d.run(Command::Cancel { id: ConsumerId(2) }), Reply::Stale);
    }

    #[test]
    fn channel_credit_limits_deliveries_exactly() {
        let mut d = Driver::new();
        for s in ["a", "b", "c", "d", "e"] {
            d.enqueue(s, 1, None);
        }
        let g = CreditGroup {
            conn: 1,
            channel: 1,
        };
        let limited = Command::Credit {
            group: g,
            credit: Credit {
                blocked: false,
                limit: Some(2),
            },
        };
        // A channel with no consumer here: the queue does not keep its credit.
        d.run(limited.clone());
        assert_eq!(d.m.consumers().count(), 0);
        assert_eq!(d.m.digest(), {
            let mut fresh = Driver::new();
            for s in ["a", "b", "c", "d", "e"] {
                fresh.enqueue(s, 1, None);
            }
            fresh.run(Command::Tick);
            fresh.m.digest()
        });
        d.run(Command::Consume {
            id: ConsumerId(1),
            spec: spec(1, 0, false),
        });
        d.run(Command::Consume {
            id: ConsumerId(2),
            spec: spec(1, 0, false),
        });
        d.run(limited);
        // Two consumers share the channel's limit of 2 within one checkout.
        assert_eq!(
            d.run(Command::Checkout { max: 10 }),
            Reply::Delivered { count: 2 }
        );
        assert!(!d.m.has_work());
        d.run(Command::Credit {
            group: g,
            credit: Credit {
                blocked: false,
                limit: Some(1),
            },
        });
        assert_eq!(
            d.run(Command::Checkout { max: 10 }),
            Reply::Delivered { count: 1 }
        );
        // No-ack consumers ignore the limit but not a block.
        d.run(Command::Consume {
            id: ConsumerId(3),
            spec: spec(1, 0, true),
        });
        assert_eq!(
            d.run(Command::Checkout { max: 1 }),
            Reply::Delivered { count: 1 }
        );
        d.run(Command::Credit {
            group: g,
            credit: Credit {
                blocked: true,
                limit: None,
            },
        });
        assert_eq!(
            d.run(Command::Checkout { max: 10 }),
            Reply::Delivered { count: 0 }
        );
        d.run(Command::Credit {
            group: g,
            credit: Credit::default(),
        });
        assert_eq!(
            d.run(Command::Checkout { max: 10 }),
            Reply::Delivered { count: 1 }
        );
        assert_eq!(d.m.ready_count(), 0);
    }

    #[test]
    fn a_lower_ttl_caps_queued_delivered_and_paged_messages() {
        let mut d = Driver::new();
        // Ids 0..=5 came at time 0 (0, 1 with no expiry, 2 with a late one), 3..=5 at 100.
        let meta = |expires_at, pageable| MsgMeta {
            size: 1,
            expires_at,
            pageable,
            ..MsgMeta::default()
        };
        for (s, e) in [("a", None), ("b", None), ("c", Some(10_000))] {
            d.run(Command::Enqueue {
                message: s,
                meta: meta(e, false),
            });
        }
        d.now = 100;
        for s in ["d", "e", "f"] {
            d.run(Command::Enqueue {
                message: s,
                meta: meta(None, true),
            });
        }
        // "a" is out with a basic.get; "e", "f" are paged out.
        assert_eq!(
            d.run(Command::Get { no_ack: false }),
            Reply::Delivered { count: 1 }
        );
        assert_eq!(
            d.run(Command::PageOut {
                keep: 3,
                keep_bytes: 100,
                upto_id: 5
            }),
            Reply::Paged { count: 2 }
        );
        d.effects.clear();
        // A TTL of 50: ids up to 2 are due at 50 (now), ids 3..=5 at 150.
        d.now = 120;
        d.run(Command::CapExpiry {
            caps: vec![(2, 50), (u64::MAX, 150)],
        });
        let expired: Vec<u64> = d
            .effects
            .drain(..)
            .filter_map(|e| match e {
                Effect::DeadLetter {
                    msg_id,
                    reason: DeadLetterReason::Expired,
                    ..
                } => Some(msg_id),
                _ => None,
            })
            .collect();
        assert_eq!(
            expired,
            vec![1, 2],
            "ready messages past the new TTL go at once"
        );
        assert_eq!(d.m.next_deadline(), Some(151), "strictly after the cap");
        // The delivered one expires as it comes back.
        d.ret(0, 1);
        d.run(Command::Tick);
        assert!(
            d.effects
                .iter()
                .any(|e| matches!(e, Effect::DeadLetter { msg_id: 0, .. })),
            "{:?}",
            d.effects
        );
        d.effects.clear();
        // The paged ones take their cap when read back, with the expiry stored before it.
        d.now = 200;
        d.run(Command::Tick);
        d.effects.clear();
        let loaded = |id, s| Loaded {
            msg_id: id,
            message: s,
            meta: meta(None, true),
            delivery_count: 0,
        };
        d.run(Command::Load {
            messages: vec![loaded(4, "e"), loaded(5, "f")],
            through_id: 5,
        });
        let expired = d
            .effects
            .iter()
            .filter(|e| {
                matches!(
                    e,
                    Effect::DeadLetter {
                        reason: DeadLetterReason::Expired,
                        ..
                    }
                )
            })
            .count();
        assert_eq!(expired, 2, "{:?}", d.effects);
        assert_eq!(d.m.ready_count(), 0);
        // A later message is not capped.
        d.enqueue("g", 1, None);
        d.now = 10_000;
        d.run(Command::Tick);
        assert_eq!(d.m.ready_count(), 1);
    }

    /// A classic queue in few groups whose line is paged: a checkout with every group busy
    /// reads nothing back and sets nothing aside; a group's next message on disk is read back
    /// when its turn comes. Walking instead, it read the whole queue back into the parked
    /// sets, run after run.
    #[test]
    fn a_paged_line_in_busy_groups_stays_on_disk() {
        let (groups, n) = (4u64, 400u64);
        let meta = |id: u64| MsgMeta {
            size: 1,
            pageable: true,
            group: GroupKey::new(id % groups + 1),
            ..MsgMeta::default()
        };
        let drain = |index_groups: bool| -> (Vec<u64>, usize, u64) {
            let mut d = Driver::new();
            d.run(Command::Configure(Policy {
                index_groups,
                ..Policy::default()
            }));
            for id in 0..n {
                d.run(Command::Enqueue {
                    message: "m",
                    meta: meta(id),
                });
            }
            d.run(Command::PageOut {
                keep: 8,
                keep_bytes: 100,
                upto_id: n - 1,
            });
            d.run(Command::Consume {
                id: ConsumerId(1),
                spec: spec(1, 10, false),
            });
            let (mut order, mut most_parked, mut paged_at_half) = (Vec::new(), 0, None);
            let mut held = VecDeque::new();
            while (order.len() as u64) < n || !held.is_empty() {
                // As the broker does: a checkout, a run read back (a few messages at a time)
                // when the head is on disk, and here the worker acks its oldest.
                d.effects.clear();
                d.run(Command::Checkout { max: 10 });
                for e in &d.effects {
                    if let Effect::Deliver(x) = e {
                        order.push(x.receipt.msg_id);
                        held.push_back(x.receipt.msg_id);
                    }
                }
                assert!(d.m.census_is_current());
                most_parked = most_parked.max(d.m.parked_len());
                if order.len() as u64 >= n / 2 {
                    paged_at_half.get_or_insert(d.m.paged_count());
                }
                if let Some(req) = d.m.load_request(1).filter(|_| !d.m.head_loaded()) {
                    let through = req.to_id.min(req.from_id + 7);
                    let messages = (req.from_id..=through)
                        .map(|id| Loaded {
                            msg_id: id,
                            message: "m",
                            meta: meta(id),
                            delivery_count: 0,
                        })
                        .collect();
                    d.run(Command::Load {
                        messages,
                        through_id: through,
                    });
                }
                if let Some(id) = held.pop_front() {
                    assert_eq!(d.settle(id, 1), Reply::Ok);
                }
            }
            (order, most_parked, paged_at_half.unwrap_or(0))
        };
        let (walked, walked_parked, walked_paged) = drain(false);
        let (counted, counted_parked, counted_paged) = drain(true);
        assert_eq!(counted, walked, "the same deliveries, in the same order");
        assert_eq!(walked_paged, 0, "walking read every run back by half way");
        assert!(walked_parked as u64 > n / 2, "{walked_parked}");
        assert!(counted_parked <= 8, "{counted_parked} set aside");
        assert!(
            counted_paged >= n / 2 - 16,
            "{counted_paged} on disk half way"
        );
    }

    #[test]
    fn paged_messages_come_back_in_place_and_expire_when_read_back() {
        let mut d = Driver::new();
        for (i, s) in ["a", "b", "c", "d", "e"].into_iter().enumerate() {
            let id = d.m.next_msg_id();
            let expires_at = (i == 3).then_some(10);
            let meta = MsgMeta {
                size: 1,
                expires_at,
                pageable: i != 2,
                spilled: false,
                priority: 0,
                group: None,
            };
            d.run(Command::Enqueue { message: s, meta });
            assert_eq!(id, i as u64);
        }
        // Keep one; "c" is not pageable, so it splits the runs: [1], c, [3, 4].
        assert_eq!(
            d.run(Command::PageOut {
                keep: 1,
                keep_bytes: 100,
                upto_id: 4,
            }),
            Reply::Paged { count: 3 }
        );
        assert_eq!(d.m.paged_runs().collect::<Vec<_>>(), vec![(1, 1), (3, 4)]);
        assert_eq!((d.m.ready_count(), d.m.ready_bytes()), (5, 5));
        assert_eq!(
            d.m.next_deadline(),
            None,
            "a paged message has no deadline in memory"
        );
        assert_eq!(d.m.load_request(1), None, "the head is in memory");
        assert_eq!(
            d.run(Command::Get { no_ack: true }),
            Reply::Delivered { count: 1 }
        );
        assert_eq!(
            d.run(Command::Get { no_ack: true }),
            Reply::Delivered { count: 0 },
            "the next one is on disk"
        );
        let req = d.m.load_request(1).expect("a load");
        assert_eq!((req.from_id, req.to_id), (1, 1));
        // A load that does not start at the run changes nothing.
        let wrong = Command::Load {
            messages: Vec::new(),
            through_id: 0,
        };
        assert_eq!(d.run(wrong), Reply::Stale);
        let load = |id: u64, s: &'static str, expires_at| Loaded {
            msg_id: id,
            message: s,
            meta: MsgMeta {
                size: 1,
                expires_at,
                pageable: true,
                spilled: false,
                priority: 0,
                group: None,
            },
            delivery_count: 0,
        };
        d.run(Command::Load {
            messages: vec![load(1, "b", None)],
            through_id: 1,
        });
        // "c" waits in memory behind the run just read; then the run [3, 4].
        assert_eq!(d.m.ready_ids(), vec![1, 2]);
        d.run(Command::Get { no_ack: true });
        d.run(Command::Get { no_ack: true });
        d.now = 20;
        d.effects.clear();
        d.run(Command::Load {
            messages: vec![load(3, "d", Some(10)), load(4, "e", None)],
            through_id: 4,
        });
        assert!(
            matches!(
                d.effects.as_slice(),
                [Effect::DeadLetter {
                    msg_id: 3,
                    reason: DeadLetterReason::Expired,
                    ..
                }]
            ),
            "an expired message read back goes at once: {:?}",
            d.effects
        );
        assert_eq!(d.m.paged_runs().count(), 0);
        assert_eq!((d.m.ready_ids(), d.m.ready_count()), (vec![4], 1));
    }

    #[test]
    fn expiry_follows_the_deadline_index() {
        let mut d = Driver::new();
        d.enqueue("a", 1, Some(100));
        d.enqueue("b", 1, None);
        d.enqueue("c", 1, Some(50));
        // A message expires once its time has passed (at its time, a waiting consumer may
        // still take it: a TTL of 0 reaches a consumer that is ready).
        assert_eq!(d.m.next_deadline(), Some(51));
        d.now = 50;
        d.run(Command::Tick);
        assert!(d.effects.is_empty());
        d.now = 60;
        d.run(Command::Tick);
        assert_eq!(d.m.ready_ids(), vec![0, 1]);
        assert_eq!(d.m.next_deadline(), Some(101));
        // A delivered message does not expire; back in the queue, it does.
        d.run(Command::Get { no_ack: false });
        d.effects.clear();
        d.now = 200;
        d.run(Command::Tick);
        assert!(d.effects.is_empty());
        d.run(Command::Return {
            receipt: receipt(0, 1),
        });
        assert_eq!(d.m.next_deadline(), Some(101));
        d.run(Command::Tick);
        assert_eq!(d.effects.len(), 1);
        assert_eq!(d.m.ready_ids(), vec![1]);
        assert_eq!(d.m.next_deadline(), None);
        // Time never goes backwards.
        d.now = 10;
        d.run(Command::Tick);
        assert_eq!(d.m.now_ms(), 200);
    }

    /// Consumer 1 (no-ack, no prefetch limit) waits; message 0 arrives at 10, due at once.
    fn ttl_zero_with_a_consumer_waiting() -> Driver {
        let mut d = Driver::new();
        d.run(Command::Consume {
            id: ConsumerId(1),
            spec: spec(1, 0, true),
        });
        d.now = 10;
        d.enqueue("a", 1, Some(10));
        d
    }

    /// RabbitMQ's rule for a TTL of 0: delivered if a consumer waits as the message arrives,
    /// expired at once otherwise. The broker's checkout follows the enqueue at a later time
    /// (the next dispatch), by which the message's time has passed.
    #[test]
    fn a_ttl_of_zero_reaches_a_consumer_waiting_as_it_arrives() {
        let mut d = ttl_zero_with_a_consumer_waiting();
        d.now = 11;
        d.run(Command::Tick);
        d.run(Command::Checkout { max: 10 });
        assert!(dead_letters(&mut d).is_empty());
        assert_eq!(d.delivered(), vec![(Some(1), 0, 1, false)]);
        assert_eq!((d.m.ready_count(), d.m.next_deadline()), (0, None));

        // Nobody waits: it expires at once, however soon a consumer comes.
        d.run(Command::Cancel { id: ConsumerId(1) });
        d.enqueue("b", 1, Some(11));
        assert_eq!(d.m.next_deadline(), Some(12));
        d.run(Command::Consume {
            id: ConsumerId(2),
            spec: spec(1, 1, false),
        });
        d.now = 12;
        d.run(Command::Checkout { max: 10 });
        assert_eq!(dead_letters(&mut d), vec![(1, DeadLetterReason::Expired)]);
        assert!(d.delivered().is_empty());

        // One waits, without room for two: the first is delivered, the second expires.
        d.enqueue("c", 1, Some(12));
        d.enqueue("d", 1, Some(12));
        d.now = 13;
        d.run(Command::Tick);
        d.run(Command::Checkout { max: 10 });
        assert_eq!(dead_letters(&mut d), vec![(3, DeadLetterReason::Expired)]);
        assert_eq!(d.delivered(), vec![(Some(2), 2, 1, false)]);
        assert_eq!(d.m.ready_count(), 0);
    }

    /// A replicated queue's new leader puts a Configure first in its term: a handoff whose
    /// checkout never came (the old leader died first) ends there, and what it kept expires.
    #[test]
    fn a_configure_ends_a_pending_handoff() {
        let mut d = ttl_zero_with_a_consumer_waiting();
        assert_eq!(d.m.handoff(), Some(10));
        assert_eq!(d.m.next_deadline(), None, "the owed checkout expires it");
        d.now = 500;
        let policy = d.m.policy();
        d.run(Command::Configure(policy));
        assert_eq!(d.m.handoff(), None);
        assert_eq!(dead_letters(&mut d), vec![(0, DeadLetterReason::Expired)]);
        assert_eq!(d.m.ready_count(), 0);
    }

    #[test]
    fn exclusive_consumers() {
        let mut d = Driver::new();
        let mut ex = spec(1, 0, false);
        ex.exclusive = true;
        d.run(Command::Consume {
            id: ConsumerId(1),
            spec: spec(1, 0, false),
        });
        assert_eq!(
            d.run(Command::Consume {
                id: ConsumerId(2),
                spec: ex.clone()
            }),
            Reply::Refused(Refusal::ExclusiveInUse)
        );
        d.run(Command::Cancel { id: ConsumerId(1) });
        assert_eq!(
            d.run(Command::Consume {
                id: ConsumerId(2),
                spec: ex
            }),
            Reply::Ok
        );
        assert_eq!(d.m.exclusive_consumer(), Some(ConsumerId(2)));
        assert_eq!(
            d.run(Command::Consume {
                id: ConsumerId(3),
                spec: spec(1, 0, false)
            }),
            Reply::Refused(Refusal::ExclusiveInUse)
        );
        assert!(d.m.has_had_consumers());
    }

    #[test]
    fn same_commands_same_digest() {
        let script = |d: &mut Driver| {
            d.enqueue("a", 1, None);
            d.run(Command::Consume {
                id: ConsumerId(1),
                spec: spec(1, 0, false),
            });
            d.run(Command::Checkout { max: 5 });
            d.run(Command::Return {
                receipt: receipt(0, 1),
            });
        };
        let (mut a, mut b) = (Driver::new(), Driver::new());
        script(&mut a);
        script(&mut b);
        assert_eq!(a.m.digest(), b.m.digest());
        b.run(Command::Checkout { max: 5 });
        assert_ne!(a.m.digest(), b.m.digest());
    }

    fn dead_letters(d: &mut Driver) -> Vec<(u64, DeadLetterReason)> {
        let mut out = Vec::new();
        d.effects.retain(|e| match e {
            Effect::DeadLetter { msg_id, reason, .. } => {
                out.push((*msg_id, *reason));
                false
            }
            _ => true,
        });
        out
    }

    fn with_policy(policy: Policy) -> Driver {
        let mut d = Driver::new();
        assert_eq!(d.run(Command::Configure(policy)), Reply::Ok);
        d
    }

    fn enqueue_prio(d: &mut Driver, s: &'static str, priority: u8) -> Reply {
        d.run(Command::Enqueue {
            message: s,
            meta: MsgMeta {
                size: 1,
                priority,
                ..MsgMeta::default()
            },
        })
    }

    #[test]
    fn drop_head_keeps_the_newest_and_dead_letters_the_rest() {
        let mut d = with_policy(Policy {
            max_length: Some(2),
            ..Policy::default()
        });
        for s in ["a", "b", "c", "e"] {
            d.enqueue(s, 1, None);
        }
        assert_eq!(
            dead_letters(&mut d),
            vec![(0, DeadLetterReason::MaxLen), (1, DeadLetterReason::MaxLen)]
        );
        assert_eq!(d.m.ready_ids(), vec![2, 3]);
        // In flight does not count; a message back over the limit goes at once.
        d.run(Command::Get { no_ack: false });
        d.enqueue("f", 1, None);
        assert!(dead_letters(&mut d).is_empty());
        d.effects.clear();
        d.ret(2, 1);
        assert_eq!(dead_letters(&mut d), vec![(2, DeadLetterReason::MaxLen)]);
        assert_eq!(d.m.ready_ids(), vec![3, 4]);
    }

    #[test]
    fn reject_publish_refuses_once_full_by_count_or_bytes() {
        let mut d = with_policy(Policy {
            max_length_bytes: Some(3),
            overflow: Overflow::RejectPublish,
            ..Policy::default()
        });
        d.enqueue("a", 2, None);
        d.enqueue("b", 2, None);
        let refused = d.run(Command::Enqueue {
            message: "c",
            meta: MsgMeta {
                size: 1,
                ..MsgMeta::default()
            },
        });
        assert_eq!(refused, Reply::Refused(Refusal::Full));
        assert!(d.m.rejects(1));
        assert_eq!(d.m.ready_count(), 2);
        assert!(d.effects.is_empty(), "refused, not dropped");
    }

    #[test]
    fn a_delivery_limit_dead_letters_instead_of_returning() {
        let mut d = with_policy(Policy {
            delivery_limit: Some(1),
            ..Policy::default()
        });
        d.enqueue("a", 1, None);
        d.run(Command::Get { no_ack: false });
        d.effects.clear();
        d.ret(0, 1);
        assert!(dead_letters(&mut d).is_empty(), "one failure is allowed");
        d.run(Command::Get { no_ack: false });
        d.effects.clear();
        d.ret(0, 2);
        assert_eq!(
            dead_letters(&mut d),
            vec![(0, DeadLetterReason::DeliveryLimit)]
        );
        assert_eq!(d.m.ready_count(), 0);
    }

    #[test]
    fn held_dead_letters_stay_until_their_dead_letters_are_safe() {
        let mut d = with_policy(Policy {
            delivery_limit: Some(0),
            hold_dead_letters: true,
            ..Policy::default()
        });
        d.enqueue("a", 1, None);
        d.enqueue("b", 1, None);
        d.enqueue("c", 1, Some(5));
        d.run(Command::Get { no_ack: false });
        d.run(Command::Get { no_ack: false });
        d.effects.clear();
        // Past its delivery limit, rejected, expired: each leaves the queue and stays held.
        d.ret(0, 1);
        d.run(Command::Discard {
            receipt: receipt(1, 1),
        });
        d.now = 10;
        d.run(Command::Tick);
        assert_eq!(
            dead_letters(&mut d),
            vec![
                (0, DeadLetterReason::DeliveryLimit),
                (1, DeadLetterReason::Rejected),
                (2, DeadLetterReason::Expired)
            ]
        );
        assert_eq!(d.m.ready_count() + d.m.in_flight_count(), 0);
        let held: Vec<(u64, &str, u32, DeadLetterReason)> =
            d.m.dead_held()
                .map(|(id, x)| (id, x.message, x.delivery_count, x.reason))
                .collect();
        assert_eq!(
            held,
            vec![
                (0, "a", 1, DeadLetterReason::DeliveryLimit),
                (1, "b", 1, DeadLetterReason::Rejected),
                (2, "c", 0, DeadLetterReason::Expired)
            ]
        );
        let digest = d.m.digest();
        assert_eq!(
            d.run(Command::DeadLettered { ids: vec![0, 2, 9] }),
            Reply::Ok
        );
        assert_ne!(d.m.digest(), digest, "what is held is part of the state");
        assert_eq!(d.m.dead_held().map(|(id, _)| id).collect::<Vec<_>>(), [1]);
        assert_eq!(d.run(Command::DeadLettered { ids: vec![0] }), Reply::Stale);
        assert_eq!(d.run(Command::DeadLettered { ids: vec![1] }), Reply::Ok);
        assert_eq!(d.m.dead_held_count(), 0);
        // Without the policy nothing is held.
        let mut d = with_policy(Policy::default());
        d.enqueue("a", 1, None);
        d.run(Command::Get { no_ack: false });
        d.run(Command::Discard {
            receipt: receipt(0, 1),
        });
        assert_eq!(dead_letters(&mut d), vec![(0, DeadLetterReason::Rejected)]);
        assert_eq!(d.m.dead_held_count(), 0);
    }

    #[test]
    fn priorities_order_ready_messages_and_returns() {
        let mut d = with_policy(Policy {
            max_priority: Some(5),
            ..Policy::default()
        });
        enqueue_prio(&mut d, "low", 0);
        enqueue_prio(&mut d, "high", 5);
        enqueue_prio(&mut d, "mid", 3);
        enqueue_prio(&mut d, "high2", 5);
        assert_eq!(d.m.ready_ids(), vec![1, 3, 2, 0]);
        d.run(Command::Get { no_ack: false });
        d.effects.clear();
        enqueue_prio(&mut d, "top", 5);
        d.ret(1, 1);
        // Back at the head of its level, ahead of a later message of the same priority.
        assert_eq!(d.m.ready_ids(), vec![1, 3, 4, 2, 0]);
        // Expiry finds a message in any level.
        d.run(Command::Enqueue {
            message: "short",
            meta: MsgMeta {
                size: 1,
                priority: 2,
                group: None,
                expires_at: Some(5),
                ..MsgMeta::default()
            },
        });
        d.now = 10;
        d.run(Command::Tick);
        assert_eq!(dead_letters(&mut d), vec![(5, DeadLetterReason::Expired)]);
        assert_eq!(d.m.ready_count(), 5);
    }

    #[test]
    fn a_single_active_consumer_hands_over_when_it_goes() {
        let mut d = with_policy(Policy {
            single_active: true,
            ..Policy::default()
        });
        for id in [1, 2] {
            d.run(Command::Consume {
                id: ConsumerId(id),
                spec: spec(id as u16, 0, false),
            });
        }
        for s in ["a", "b"] {
            d.enqueue(s, 1, None);
        }
        d.run(Command::Checkout { max: 10 });
        let got = d.delivered();
        assert!(got.iter().all(|(c, ..)| *c == Some(1)), "{got:?}");
        assert_eq!(
            d.run(Command::Cancel { id: ConsumerId(1) }),
            Reply::Cancelled { consumers_left: 1 }
        );
        d.ret(0, 1);
        d.enqueue("c", 1, None);
        d.run(Command::Checkout { max: 10 });
        let got = d.delivered();
        assert_eq!(
            got.first(),
            Some(&(Some(2), 0, 2, true)),
            "returned first: {got:?}"
        );
        assert!(got.iter().all(|(c, ..)| *c == Some(2)));
    }

    #[test]
    fn higher_priority_consumers_take_first_while_they_have_credit() {
        let mut d = Driver::new();
        let mut lo = spec(1, 0, false);
        lo.priority = 1;
        let mut hi = spec(2, 2, false);
        hi.priority = 10;
        d.run(Command::Consume {
            id: ConsumerId(1),
            spec: lo,
        });
        d.run(Command::Consume {
            id: ConsumerId(2),
            spec: hi,
        });
        for s in ["a", "b", "c", "e", "f"] {
            d.enqueue(s, 1, None);
        }
        d.run(Command::Checkout { max: 10 });
        let to: Vec<Option<u64>> = d.delivered().iter().map(|g| g.0).collect();
        assert_eq!(to, vec![Some(2), Some(2), Some(1), Some(1), Some(1)]);
    }

    #[test]
    fn an_unused_queue_expires_and_consumers_hold_it() {
        let mut d = with_policy(Policy {
            expires_ms: Some(100),
            ..Policy::default()
        });
        assert_eq!(d.m.next_deadline(), Some(100));
        d.now = 50;
        d.run(Command::Consume {
            id: ConsumerId(1),
            spec: spec(1, 0, false),
        });
        assert_eq!(d.m.next_deadline(), None, "a consumer holds it");
        d.now = 500;
        assert_eq!(d.run(Command::Tick), Reply::Ok);
        d.run(Command::Cancel { id: ConsumerId(1) });
        assert_eq!(d.m.next_deadline(), Some(600));
        d.now = 550;
        d.run(Command::Touch);
        d.now = 600;
        assert_eq!(d.run(Command::Tick), Reply::Ok, "renewed by a declare");
        d.now = 650;
        assert_eq!(d.run(Command::Tick), Reply::QueueExpired);
    }

    #[test]
    fn a_due_paged_run_asks_to_be_read_back_once_nothing_is_ahead() {
        let mut d = Driver::new();
        for i in 0..4u64 {
            d.run(Command::Enqueue {
                message: "m",
                meta: MsgMeta {
                    size: 1,
                    expires_at: Some(100 + i),
                    pageable: true,
                    ..MsgMeta::default()
                },
            });
        }
        d.run(Command::PageOut {
            keep: 1,
            keep_bytes: u64::MAX,
            upto_id: 3,
        });
        assert_eq!(d.m.paged_count(), 3);
        assert_eq!(d.m.next_deadline(), Some(101), "the head in memory first");
        d.now = 101;
        d.run(Command::Tick);
        assert_eq!(dead_letters(&mut d), vec![(0, DeadLetterReason::Expired)]);
        // Nothing in memory ahead of the run: its earliest expiry is the deadline.
        assert_eq!(d.m.next_deadline(), Some(102));
        assert!(!d.m.run_due());
        d.now = 102;
        d.run(Command::Tick);
        assert!(d.effects.is_empty(), "paged messages expire when read back");
        assert!(d.m.run_due());
    }

    #[test]
    fn retry_delays_grow_as_configured_and_stay_capped() {
        let linear = RetryPolicy {
            min_ms: 100,
            max_ms: Some(250),
            multiplier: None,
            jitter_pct: 0,
        };
        let delays: Vec<u64> = (1..=4).map(|n| linear.delay(7, n)).collect();
        assert_eq!(delays, vec![100, 200, 250, 250]);
        let constant = RetryPolicy {
            multiplier: Some(1),
            max_ms: None,
            ..linear
        };
        assert_eq!(constant.delay(7, 5), 100);
        let exponential = RetryPolicy {
            multiplier: Some(3),
            max_ms: Some(10_000),
            ..linear
        };
        let delays: Vec<u64> = (1..=5).map(|n| exponential.delay(7, n)).collect();
        assert_eq!(delays, vec![100, 300, 900, 2_700, 8_100]);
        assert_eq!(exponential.delay(7, 60), 10_000, "capped, no overflow");
        // Jitter takes up to its share off, differently per message, the same on a replay.
        let jittered = RetryPolicy {
            jitter_pct: 50,
            ..exponential
        };
        let spread: Vec<u64> = (0..200).map(|id| jittered.delay(id, 2)).collect();
        assert!(spread.iter().all(|d| (150..=300).contains(d)), "{spread:?}");
        assert!(spread.iter().any(|d| *d < 250) && spread.iter().any(|d| *d > 250));
        assert_eq!(jittered.delay(3, 2), jittered.delay(3, 2));
    }

    #[test]
    fn a_returned_message_waits_for_its_retry_but_a_released_one_does_not() {
        let mut d = with_policy(Policy {
            retry: Some(RetryPolicy {
                min_ms: 100,
                ..RetryPolicy::default()
            }),
            ..Policy::default()
        });
        d.enqueue("a", 1, None);
        d.enqueue("b", 1, None);
        d.run(Command::Get { no_ack: false });
        d.run(Command::Get { no_ack: false });
        d.effects.clear();
        d.ret(0, 1);
        d.run(Command::Release {
            receipt: receipt(1, 1),
        });
        assert_eq!(d.m.ready_count(), 2);
        assert_eq!(d.m.retrying_count(), 1);
        assert_eq!(d.m.ready_ids(), vec![1], "the released one at once");
        assert_eq!(d.m.next_deadline(), Some(100));
        d.now = 99;
        d.run(Command::Tick);
        assert_eq!(d.m.retrying_count(), 1, "never early");
        d.now = 100;
        d.run(Command::Tick);
        assert_eq!(d.m.ready_ids(), vec![0, 1], "back in its place");
    }

    #[test]
    fn messages_waiting_for_a_retry_are_walked_past_the_oldest_and_found_by_id() {
        let mut d = with_policy(Policy {
            retry: Some(RetryPolicy {
                min_ms: 100,
                ..RetryPolicy::default()
            }),
            ..Policy::default()
        });
        for s in ["a", "b", "c", "d"] {
            d.enqueue(s, 1, None);
        }
        for _ in 0..4 {
            d.run(Command::Get { no_ack: false });
        }
        for id in [2, 0, 3, 1] {
            d.ret(id, 1);
        }
        assert_eq!(d.m.retrying_count(), 4);
        let walk = |m: &mut QueueMachine<&'static str>, skip, after| {
            m.retrying_payloads_mut(skip, after)
                .map(|(id, p)| (id, *p))
                .collect::<Vec<_>>()
        };
        assert_eq!(walk(&mut d.m, 1, None), vec![(1, "b"), (2, "c"), (3, "d")]);
        assert_eq!(walk(&mut d.m, 1, Some(2)), vec![(3, "d")]);
        assert_eq!(walk(&mut d.m, 4, None), vec![]);
        assert_eq!(d.m.retrying_payload(3), Some(&"d"));
        assert_eq!(d.m.retrying_payload(9), None);
        d.now = 100;
        d.run(Command::Tick);
        assert_eq!(d.m.retrying_count(), 0);
        assert_eq!(walk(&mut d.m, 0, None), vec![]);
    }

    fn enqueue_in(d: &mut Driver, s: &'static str, group: Option<u64>) -> u64 {
        let meta = MsgMeta {
            size: 1,
            group: group.and_then(GroupKey::new),
            ..MsgMeta::default()
        };
        match d.run(Command::Enqueue { message: s, meta }) {
            Reply::Enqueued { msg_id } => msg_id,
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn a_group_has_one_message_in_flight_and_keeps_its_order_through_returns_and_retries() {
        let mut d = with_policy(Policy {
            retry: Some(RetryPolicy {
                min_ms: 100,
                ..RetryPolicy::default()
            }),
            delivery_limit: Some(1),
            ..Policy::default()
        });
        // a1 a2 b1 a3 b2 x (no group)
        let a1 = enqueue_in(&mut d, "a1", Some(1));
        let a2 = enqueue_in(&mut d, "a2", Some(1));
        let b1 = enqueue_in(&mut d, "b1", Some(2));
        let a3 = enqueue_in(&mut d, "a3", Some(1));
        let b2 = enqueue_in(&mut d, "b2", Some(2));
        let x = enqueue_in(&mut d, "x", None);
        d.run(Command::Consume {
            id: ConsumerId(1),
            spec: spec(1, 10, false),
        });
        d.run(Command::Checkout { max: 10 });
        let ids: Vec<u64> = d.delivered().iter().map(|t| t.1).collect();
        assert_eq!(ids, vec![a1, b1, x], "one per group, and the ungrouped one");
        assert_eq!(d.m.ready_count(), 3, "parked messages are still ready");
        // b1 settled: b2 may go; a1 given back: it waits for its retry, a2 still waits.
        d.settle(b1, 1);
        d.ret(a1, 1);
        d.run(Command::Checkout { max: 10 });
        let ids: Vec<u64> = d.delivered().iter().map(|t| t.1).collect();
        assert_eq!(
            ids,
            vec![b2],
            "nothing overtakes a1 while it waits for its retry"
        );
        d.now = 100;
        d.run(Command::Tick);
        d.run(Command::Checkout { max: 10 });
        let out = d.delivered();
        assert_eq!(out.iter().map(|t| t.1).collect::<Vec<_>>(), vec![a1]);
        // Its second failure passes the delivery limit: dead-lettered, and a2 goes next.
        d.ret(a1, 2);
        assert!(d
            .effects
            .iter()
            .any(|e| matches!(e, Effect::DeadLetter { msg_id, reason: DeadLetterReason::DeliveryLimit, .. } if *msg_id == a1)));
        d.effects.clear();
        d.run(Command::Checkout { max: 10 });
        assert_eq!(
            d.delivered().iter().map(|t| t.1).collect::<Vec<_>>(),
            vec![a2]
        );
        d.settle(a2, 1);
        d.run(Command::Checkout { max: 10 });
        assert_eq!(
            d.delivered().iter().map(|t| t.1).collect::<Vec<_>>(),
            vec![a3]
        );
        // A purge forgets what was parked but keeps the lock of what is in flight.
        let a4 = enqueue_in(&mut d, "a4", Some(1));
        d.run(Command::Checkout { max: 10 });
        assert!(d.delivered().is_empty());
        assert_eq!(d.m.ready_count(), 1);
        assert_eq!(d.run(Command::Purge), Reply::Purged { count: 1 });
        let a5 = enqueue_in(&mut d, "a5", Some(1));
        d.run(Command::Checkout { max: 10 });
        assert!(d.delivered().is_empty(), "a3 still holds the group");
        d.settle(a3, 1);
        d.run(Command::Checkout { max: 10 });
        assert_eq!(
            d.delivered().iter().map(|t| t.1).collect::<Vec<_>>(),
            vec![a5]
        );
        let _ = a4;
    }

    /// A consumer id and a channel of `node` (ids and connections node-qualified).
    fn on(node: NodeId, local: u64, channel: u16) -> (ConsumerId, ConsumerSpec) {
        let mut s = spec(channel, 0, false);
        s.group.conn = crate::qualify(node, 5).unwrap();
        (ConsumerId(crate::qualify(node, local).unwrap()), s)
    }

    fn consume_on(d: &mut Driver, node: NodeId, local: u64) -> ConsumerId {
        let (id, spec) = on(node, local, 1);
        assert_eq!(d.run(Command::Consume { id, spec }), Reply::Ok);
        id
    }

    #[test]
    fn down_cancels_the_nodes_consumers_and_returns_what_its_channels_hold() {
        let mut d = Driver::new();
        for s in ["a", "b", "c", "d", "e", "f"] {
            d.enqueue(s, 1, None);
        }
        let n1 = consume_on(&mut d, 1, 1);
        let n2 = consume_on(&mut d, 2, 1);
        let early = consume_on(&mut d, 1, 2);
        // 0 -> n1, 1 -> n2, 2 -> early (then cancelled: its channel still holds 2).
        d.run(Command::Checkout { max: 3 });
        let to: Vec<_> = d.delivered().iter().map(|t| (t.0, t.1)).collect();
        assert_eq!(
            to,
            vec![(Some(n1.0), 0), (Some(n2.0), 1), (Some(early.0), 2)]
        );
        d.run(Command::Cancel { id: early });
        d.run(Command::GetBy {
            no_ack: false,
            node: 1,
        });
        d.run(Command::Get { no_ack: false });
        assert_eq!(
            d.delivered().iter().map(|t| t.1).collect::<Vec<_>>(),
            vec![3, 4]
        );
        assert_eq!(d.m.holder_node(receipt(3, 1)), Some(1));
        assert_eq!(
            d.m.holder_node(receipt(4, 1)),
            Some(0),
            "a plain get: node 0"
        );
        assert_eq!(
            d.run(Command::Down { node: 1 }),
            Reply::Cancelled { consumers_left: 1 }
        );
        assert!(d.effects.is_empty());
        assert_eq!(d.m.consumer_count(), 1);
        assert!(d.m.consumer(n1).is_none());
        // Node 1's three deliveries are back in their places; node 2's and node 0's are not.
        assert_eq!(d.m.ready_ids(), vec![0, 2, 3, 5]);
        assert_eq!(d.m.in_flight_count(), 2);
        assert_eq!(d.m.holder(receipt(1, 1)), Some(Some(n2)));
        assert_eq!(d.m.holder(receipt(4, 1)), Some(None));
        // Their old receipts are stale; the next delivery is a redelivery with its count kept.
        assert_eq!(d.settle(0, 1), Reply::Stale);
        d.run(Command::Get { no_ack: false });
        assert_eq!(d.delivered(), vec![(None, 0, 2, true)]);
        // Nothing is left of node 1: a second Down finds nothing.
        assert_eq!(d.run(Command::Down { node: 1 }), Reply::Ok);
        assert_eq!((d.m.consumer_count(), d.m.in_flight_count()), (1, 3));
    }

    #[test]
    fn down_strands_no_delivery_of_a_consumer_whose_id_names_another_node() {
        let mut d = Driver::new();
        d.enqueue("a", 1, None);
        // A caller that minted the id on node 0 for a channel on node 1.
        let (_, spec) = on(1, 1, 1);
        d.run(Command::Consume {
            id: ConsumerId(3),
            spec,
        });
        d.run(Command::Checkout { max: 1 });
        assert_eq!(d.delivered().len(), 1);
        d.run(Command::Down { node: 1 });
        assert_eq!((d.m.ready_ids(), d.m.in_flight_count()), (vec![0], 0));
    }

    #[test]
    fn down_returns_as_release_does_no_retry_delay_and_the_delivery_limit_holds() {
        let mut d = with_policy(Policy {
            retry: Some(RetryPolicy {
                min_ms: 100,
                ..RetryPolicy::default()
            }),
            delivery_limit: Some(1),
            ..Policy::default()
        });
        d.enqueue("a", 1, None);
        d.run(Command::GetBy {
            no_ack: false,
            node: 3,
        });
        d.effects.clear();
        assert_eq!(d.run(Command::Down { node: 3 }), Reply::Ok);
        assert_eq!(d.m.retrying_count(), 0, "no retry delay");
        assert_eq!(d.m.ready_ids(), vec![0]);
        assert!(d.effects.is_empty(), "one delivery is within the limit");
        d.run(Command::GetBy {
            no_ack: false,
            node: 3,
        });
        assert_eq!(d.delivered(), vec![(None, 0, 2, true)]);
        d.run(Command::Down { node: 3 });
        assert_eq!(
            dead_letters(&mut d),
            vec![(0, DeadLetterReason::DeliveryLimit)]
        );
        assert_eq!(d.m.ready_count() + d.m.in_flight_count(), 0);
    }

    #[test]
    fn down_hands_a_single_active_consumer_over() {
        let mut d = with_policy(Policy {
            single_active: true,
            ..Policy::default()
        });
        let a = consume_on(&mut d, 1, 1);
        let b = consume_on(&mut d, 2, 1);
        for s in ["a", "b"] {
            d.enqueue(s, 1, None);
        }
        assert_eq!(d.m.active_consumer(), Some(a));
        d.run(Command::Checkout { max: 1 });
        assert_eq!(d.delivered(), vec![(Some(a.0), 0, 1, false)]);
        d.run(Command::Down { node: 1 });
        assert_eq!(d.m.active_consumer(), Some(b));
        d.run(Command::Checkout { max: 10 });
        assert_eq!(
            d.delivered(),
            vec![(Some(b.0), 0, 2, true), (Some(b.0), 1, 1, false)]
        );
    }

    fn from(enqueuer: u64, seq: u64, s: &'static str) -> Command<&'static str> {
        Command::EnqueueFrom {
            enqueuer: EnqueuerId(enqueuer),
            seq,
            message: s,
            meta: MsgMeta {
                size: 1,
                ..MsgMeta::default()
            },
        }
    }

    #[test]
    fn a_resent_sequence_is_not_enqueued_twice() {
        let mut d = Driver::new();
        let p = crate::qualify(1, 9).unwrap();
        let q = crate::qualify(2, 9).unwrap();
        // An unknown enqueuer starts at 1: a later one means its first was lost on its way.
        assert_eq!(
            d.run(from(p, 2, "lost before")),
            Reply::Refused(Refusal::OutOfOrder)
        );
        assert_eq!(d.m.enqueuer_seq(EnqueuerId(p)), None);
        assert_eq!(d.run(from(p, 1, "a")), Reply::Enqueued { msg_id: 0 });
        assert_eq!(d.run(from(p, 1, "a")), Reply::Duplicate);
        assert_eq!(d.run(from(p, 2, "b")), Reply::Enqueued { msg_id: 1 });
        // A gap decides nothing: the one it skips is still taken after it.
        assert_eq!(d.run(from(p, 4, "y")), Reply::Refused(Refusal::OutOfOrder));
        assert_eq!(d.m.enqueuer_seq(EnqueuerId(p)), Some(2));
        assert_eq!(d.run(from(p, 3, "x")), Reply::Enqueued { msg_id: 2 });
        // Anything at or below the highest is a resend, which `decided` answers as `apply`
        // would (a node answers what a snapshot shows decided without sending it again).
        assert_eq!(d.m.decided(EnqueuerId(p), 3), Some(Reply::Duplicate));
        assert_eq!(d.m.decided(EnqueuerId(p), 4), None);
        assert_eq!(d.m.decided(EnqueuerId(q), 1), None);
        assert_eq!(d.run(from(p, 2, "b")), Reply::Duplicate);
        assert_eq!(d.run(from(p, 3, "x")), Reply::Duplicate);
        // Another enqueuer has its own sequence.
        assert_eq!(d.run(from(q, 1, "c")), Reply::Enqueued { msg_id: 3 });
        assert_eq!(d.m.ready_ids(), vec![0, 1, 2, 3]);
        assert!(d.effects.is_empty());
        assert_eq!(d.m.enqueuer_seq(EnqueuerId(p)), Some(3));
        // Forgotten when unregistered.
        assert_eq!(
            d.run(Command::Unregister {
                enqueuer: EnqueuerId(p)
            }),
            Reply::Ok
        );
        assert_eq!(
            d.run(Command::Unregister {
                enqueuer: EnqueuerId(p)
            }),
            Reply::Stale
        );
        assert_eq!(d.run(from(p, 1, "d")), Reply::Enqueued { msg_id: 4 });
        // Kept through a Down of its node (which may still run and send again).
        assert_eq!(d.run(Command::Down { node: 2 }), Reply::Ok);
        assert_eq!(d.m.enqueuer_count(), 2);
        assert_eq!(d.run(from(q, 1, "c")), Reply::Duplicate);
        // A node's new enqueuer replaces its earlier one: one per node at most.
        let p2 = crate::qualify(1, 10).unwrap();
        assert_eq!(d.run(from(p2, 1, "e")), Reply::Enqueued { msg_id: 5 });
        assert_eq!(d.m.enqueuer_count(), 2);
        assert_eq!(d.m.enqueuer_seq(EnqueuerId(p)), None);
        assert_eq!(d.m.enqueuer_seq(EnqueuerId(q)), Some(1));
    }

    fn held(delay_ms: u64, from: Option<(u64, u64)>, s: &'static str) -> Command<&'static str> {
        Command::EnqueueWith {
            delay_ms,
            from: from.map(|(e, seq)| (EnqueuerId(e), seq)),
            dedup: None,
            message: s,
            meta: MsgMeta {
                size: 1,
                ..MsgMeta::default()
            },
        }
    }

    #[test]
    fn held_payloads_past_the_soonest_due_are_walked_from_a_key_on() {
        let mut d = Driver::new();
        assert_eq!(d.m.held_seq(), 0);
        for (delay, s) in [(300, "c"), (100, "a"), (200, "b"), (400, "d")] {
            assert_eq!(d.run(held(delay, None, s)), Reply::Ok);
        }
        assert_eq!(d.m.held_seq(), 4);
        let walk = |m: &mut QueueMachine<&'static str>, skip, after| {
            m.held_payloads_mut(skip, after)
                .map(|(k, p)| (k.0, *p))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            walk(&mut d.m, 0, None),
            vec![(100, "a"), (200, "b"), (300, "c"), (400, "d")]
        );
        assert_eq!(walk(&mut d.m, 2, None), vec![(300, "c"), (400, "d")]);
        // From a key on: past the skipped ones whatever the key.
        assert_eq!(walk(&mut d.m, 1, Some((300, 0))), vec![(400, "d")]);
        assert_eq!(walk(&mut d.m, 3, Some((100, 1))), vec![(400, "d")]);
        assert_eq!(walk(&mut d.m, 4, None), vec![]);
        // A payload changed in place stays under its key.
        for (_, p) in d.m.held_payloads_mut(3, None) {
            *p = "D";
        }
        assert_eq!(d.m.held_payload((400, 3)), Some(&"D"));
        d.now = 500;
        d.run(Command::Tick);
        assert_eq!(d.m.held_count().0, 0);
        assert_eq!(
            d.m.held_seq(),
            0,
            "counted afresh once the held line is empty"
        );
    }

    #[test]
    fn parked_and_returned_payloads_are_walked_past_the_first_and_from_a_key_on() {
        let mut d = with_policy(Policy::default());
        // a1 a2 a3 in group 1, b1 b2 in group 2, r1 r2 r3 ungrouped.
        let a: Vec<u64> = ["a1", "a2", "a3"]
            .iter()
            .map(|s| enqueue_in(&mut d, s, Some(1)))
            .collect();
        let b: Vec<u64> = ["b1", "b2"]
            .iter()
            .map(|s| enqueue_in(&mut d, s, Some(2)))
            .collect();
        let r: Vec<u64> = ["r1", "r2", "r3"]
            .iter()
            .map(|s| enqueue_in(&mut d, s, None))
            .collect();
        d.run(Command::Consume {
            id: ConsumerId(1),
            spec: spec(1, 10, false),
        });
        d.run(Command::Checkout { max: 10 });
        // a1, b1 and the r's out; a2 a3 b2 parked. The r's given back.
        for id in &r {
            d.ret(*id, 1);
        }
        assert_eq!((d.m.parked_len(), d.m.returned_count()), (3, 3));
        let parked = |m: &mut M, skip, after| {
            m.parked_payloads_mut(skip, after)
                .map(|(k, p)| (k.1, *p))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            parked(&mut d.m, 0, None),
            vec![(a[1], "a2"), (a[2], "a3"), (b[1], "b2")]
        );
        assert_eq!(parked(&mut d.m, 2, None), vec![(b[1], "b2")]);
        assert_eq!(
            parked(&mut d.m, 1, Some((1, a[1]))),
            vec![(a[2], "a3"), (b[1], "b2")]
        );
        assert_eq!(parked(&mut d.m, 1, Some((1, a[2]))), vec![(b[1], "b2")]);
        assert_eq!(parked(&mut d.m, 0, Some((2, b[1]))), vec![]);
        assert_eq!(d.m.parked_payload((2, b[1])), Some(&"b2"));
        assert_eq!(d.m.parked_payload((0, b[1])), None);
        let returned: Vec<u64> = d.m.returned_payloads_mut(1, None).map(|(k, _)| k).collect();
        assert_eq!(returned, vec![r[1], r[2]]);
        let returned: Vec<u64> =
            d.m.returned_payloads_mut(1, Some(r[1]))
                .map(|(k, _)| k)
                .collect();
        assert_eq!(returned, vec![r[2]]);
        assert_eq!(d.m.returned_payload(r[0]), Some(&"r1"));
    }

    #[test]
    fn a_held_publish_waits_beside_the_queue_and_joins_its_end_when_due() {
        let mut d = Driver::new();
        assert_eq!(d.run(held(100, None, "late")), Reply::Ok);
        assert_eq!((d.m.ready_count(), d.m.held_count()), (0, (1, 1)));
        assert_eq!(d.m.next_deadline(), Some(100), "a tick when it is due");
        d.enqueue("meanwhile", 1, None);
        d.now = 99;
        d.run(Command::Tick);
        assert_eq!(d.m.held_count(), (1, 1), "not due yet");
        d.now = 100;
        d.run(Command::Tick);
        assert_eq!(d.m.held_count(), (0, 0));
        // A new message when it is due: behind what came meanwhile.
        assert_eq!(d.m.ready_ids(), vec![0, 1]);
        assert_eq!(d.m.next_deadline(), None);
        // No delay: enqueued at once.
        assert_eq!(d.run(held(0, None, "now")), Reply::Enqueued { msg_id: 2 });
        // An enqueuer's sequence is decided when it is held: a resend is a duplicate, held
        // or released.
        assert_eq!(d.run(held(300, Some((5, 1)), "once")), Reply::Ok);
        assert_eq!(d.run(held(300, Some((5, 1)), "once")), Reply::Duplicate);
        assert_eq!(d.run(from(5, 1, "once")), Reply::Duplicate);
        assert_eq!(d.m.held_count(), (1, 1));
        assert_eq!(
            d.m.next_deadline(),
            Some(400),
            "due 300 after its entry's time"
        );
        d.now = 400;
        d.run(Command::Tick);
        assert_eq!(d.run(held(400, Some((5, 1)), "once")), Reply::Duplicate);
        assert_eq!(d.m.ready_ids(), vec![0, 1, 2, 3]);
        // A purge leaves what is held: it is not in the queue yet.
        assert_eq!(d.run(held(500, None, "kept")), Reply::Ok);
        assert_eq!(d.run(Command::Purge), Reply::Purged { count: 4 });
        assert_eq!(d.m.held_count(), (1, 1));
    }

    fn keyed(key: u8, ttl_ms: u64, max_keys: u32, s: &'static str) -> Command<&'static str> {
        Command::EnqueueWith {
            delay_ms: 0,
            from: None,
            dedup: Some(Box::new(DedupWindow {
                key: DedupKey {
                    len: 1,
                    bytes: [key; 32],
                },
                ttl_ms,
                max_keys,
            })),
            message: s,
            meta: MsgMeta {
                size: 1,
                ..MsgMeta::default()
            },
        }
    }

    #[test]
    fn a_key_taken_within_its_window_is_a_duplicate_and_forgotten_after_it() {
        let mut d = Driver::new();
        assert_eq!(d.run(keyed(1, 100, 10, "a")), Reply::Enqueued { msg_id: 0 });
        assert_eq!(d.run(keyed(1, 100, 10, "a again")), Reply::Duplicate);
        assert_eq!(d.run(keyed(2, 100, 10, "b")), Reply::Enqueued { msg_id: 1 });
        assert_eq!(d.m.dedup_keys(), 2);
        // Consumed or not, the key stays for its window.
        d.run(Command::Get { no_ack: true });
        assert_eq!(d.run(keyed(1, 100, 10, "a")), Reply::Duplicate);
        d.now = 100;
        assert_eq!(
            d.run(keyed(1, 100, 10, "a late")),
            Reply::Enqueued { msg_id: 2 }
        );
        // Key 2 expired meanwhile. At most `max_keys`, the oldest forgotten first.
        assert_eq!(d.m.dedup_keys(), 1);
        assert_eq!(d.run(keyed(3, 100, 2, "c")), Reply::Enqueued { msg_id: 3 });
        assert_eq!(d.run(keyed(4, 100, 2, "d")), Reply::Enqueued { msg_id: 4 });
        assert_eq!(d.m.dedup_keys(), 2);
        assert_eq!(d.run(keyed(1, 100, 2, "a")), Reply::Enqueued { msg_id: 5 });
        // A held publish's key is taken when it is held; an enqueuer's resend is decided.
        let mut later = keyed(9, 100, 10, "held");
        if let Command::EnqueueWith { delay_ms, from, .. } = &mut later {
            *delay_ms = 50;
            *from = Some((EnqueuerId(7), 1));
        }
        assert_eq!(d.run(later.clone()), Reply::Ok);
        assert_eq!(d.run(later), Reply::Duplicate);
        assert_eq!(d.run(keyed(9, 100, 10, "held")), Reply::Duplicate);
        assert_eq!(d.m.enqueuer_seq(EnqueuerId(7)), Some(1));
        // A refused copy (a full queue) leaves its key new.
        let mut f = with_policy(Policy {
            max_length: Some(1),
            overflow: Overflow::RejectPublish,
            ..Policy::default()
        });
        f.enqueue("x", 1, None);
        assert_eq!(f.run(keyed(5, 100, 10, "e")), Reply::Refused(Refusal::Full));
        f.run(Command::Get { no_ack: true });
        assert_eq!(f.run(keyed(5, 100, 10, "e")), Reply::Enqueued { msg_id: 1 });
        // Forgotten whole once expired: the state is as if it never had a key.
        f.now = 1_000;
        assert_eq!(f.run(keyed(6, 1, 10, "g")), Reply::Refused(Refusal::Full));
        assert_eq!(f.m.dedup_keys(), 0);
    }

    #[test]
    fn a_key_taken_again_and_again_behind_a_long_lived_one_leaves_no_trail() {
        let mut d = Driver::new();
        d.run(keyed(1, 1_000_000, 10, "stays"));
        for n in 0..1_000u64 {
            d.now = n;
            // Each takes key 2 again (its window is a millisecond).
            assert!(matches!(
                d.run(keyed(2, 1, 10, "again")),
                Reply::Enqueued { .. }
            ));
        }
        assert_eq!(d.m.dedup_keys(), 2);
        assert!(
            d.m.dedup_order_len() <= 2 * 2 + 64 + 1,
            "{}",
            d.m.dedup_order_len()
        );
        assert_eq!(d.run(keyed(1, 1_000_000, 10, "stays")), Reply::Duplicate);
    }

    #[test]
    fn a_held_publish_due_in_a_full_queue_waits_again_or_is_dead_lettered() {
        let full = |overflow| {
            let mut d = with_policy(Policy {
                max_length: Some(1),
                overflow,
                ..Policy::default()
            });
            d.enqueue("a", 1, None);
            // Due at 10, with a time to live of 500 from then.
            let mut b = held(10, None, "b");
            if let Command::EnqueueWith { meta, .. } = &mut b {
                meta.expires_at = Some(510);
            }
            assert_eq!(d.run(b), Reply::Ok);
            d.now = 10;
            d.run(Command::Tick);
            d
        };
        let mut d = full(Overflow::RejectPublish);
        assert_eq!((d.m.ready_count(), d.m.held_count()), (1, (1, 1)));
        assert_eq!(d.m.next_deadline(), Some(10 + HELD_BACK_MS));
        d.run(Command::Get { no_ack: true });
        d.now = 10 + HELD_BACK_MS;
        d.run(Command::Tick);
        assert_eq!((d.m.ready_count(), d.m.held_count()), (1, (0, 0)));
        // Taken a second late, it still has its 500 ms to live from then.
        d.now = 10 + HELD_BACK_MS + 499;
        d.run(Command::Tick);
        assert_eq!(d.m.ready_count(), 1, "expired by its first due time");
        let d = full(Overflow::RejectPublishDlx);
        assert_eq!((d.m.ready_count(), d.m.held_count()), (1, (0, 0)));
        assert!(matches!(
            d.effects.as_slice(),
            [Effect::DeadLetter {
                message: "b",
                reason: DeadLetterReason::MaxLen,
                ..
            }]
        ));
    }

    #[test]
    fn a_refused_sequence_is_never_taken_for_a_duplicate() {
        let mut d = with_policy(Policy {
            max_length: Some(1),
            overflow: Overflow::RejectPublish,
            ..Policy::default()
        });
        assert_eq!(d.run(from(1, 1, "a")), Reply::Enqueued { msg_id: 0 });
        assert_eq!(d.run(from(1, 2, "b")), Reply::Refused(Refusal::Full));
        d.run(Command::Get { no_ack: true });
        assert_eq!(d.run(from(1, 3, "c")), Reply::Enqueued { msg_id: 1 });
        // Sent again after a failover: 3 was enqueued; 2 was refused, and 1 cannot be told
        // from it any more: a nack, never a false confirm.
        assert_eq!(
            d.m.decided(EnqueuerId(1), 2),
            Some(Reply::Refused(Refusal::Full))
        );
        assert_eq!(d.run(from(1, 3, "c")), Reply::Duplicate);
        assert_eq!(d.run(from(1, 2, "b")), Reply::Refused(Refusal::Full));
        assert_eq!(d.run(from(1, 1, "a")), Reply::Refused(Refusal::Full));
        assert_eq!(d.m.next_msg_id(), 2);
    }

    #[test]
    fn enqueuers_and_get_holders_are_part_of_the_digest() {
        let run = |commands: Vec<Command<&'static str>>| {
            let mut d = Driver::new();
            for c in commands {
                d.run(c);
            }
            d.m.digest()
        };
        let plain = Command::Enqueue {
            message: "a",
            meta: MsgMeta {
                size: 1,
                ..MsgMeta::default()
            },
        };
        assert_ne!(run(vec![plain.clone()]), run(vec![from(1, 1, "a")]));
        // The same messages, the enqueuer at another sequence.
        let plain_b = Command::Enqueue {
            message: "b",
            meta: MsgMeta {
                size: 1,
                ..MsgMeta::default()
            },
        };
        assert_ne!(
            run(vec![from(1, 1, "a"), plain_b]),
            run(vec![from(1, 1, "a"), from(1, 2, "b")])
        );
        assert_ne!(run(vec![from(1, 1, "a")]), run(vec![from(2, 1, "a")]));
        let get = |node| Command::GetBy {
            no_ack: false,
            node,
        };
        assert_ne!(
            run(vec![plain.clone(), get(0)]),
            run(vec![plain.clone(), get(1)])
        );
        // A get held by node 0 is the same state as a plain get.
        assert_eq!(
            run(vec![plain.clone(), get(0)]),
            run(vec![plain, Command::Get { no_ack: false }])
        );
    }
}
