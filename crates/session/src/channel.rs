//! One AMQP channel: content assembly, consumers, delivery tags, prefetch, confirms and transactions.

use std::collections::{BTreeMap, HashMap, VecDeque};

use bytes::{Bytes, BytesMut};
use warren_broker::queue::args::QueueType;
use warren_broker::{
    Broker, ConnId, ConsumerId, ConsumerKey, Credit, CreditGroup, DeclareQueue, Declared, Delivery,
    Got, Message, QueueId, Receipt,
};
use warren_codec::{
    encode_ack, encode_get_ok, encode_nack, encode_return, properties, AmqpError, BasicPublish,
    ContentHeader, FieldValue, Frame, Method, ReplyCode, ShortStr,
};
use warren_codec::{
    BasicCancelOk, BasicConsumeOk, BasicGetEmpty, BasicQosOk, BasicRecoverOk, ChannelFlowOk,
    ConfirmSelectOk, ExchangeBindOk, ExchangeDeclareOk, ExchangeDeleteOk, ExchangeUnbindOk,
    QueueBindOk, QueueDeclareOk, QueueDeleteOk, QueuePurgeOk, QueueUnbindOk, TxCommitOk,
    TxRollbackOk, TxSelectOk,
};

use crate::config::SessionConfig;
use crate::fit::{self, Fit};
use crate::latency::ConfirmLatency;
use crate::out::send;
use crate::tag_map::TagMap;
use warren_broker::access::{Perm, Resource};
use warren_broker::holds::{HoldState, Holds};

const BASIC_CLASS: u16 = 60;
const BASIC_PUBLISH: u16 = 40;

/// An error raised while handling a frame, with the method it is blamed on (for the close frame).
#[derive(Debug)]
pub(crate) struct Fault {
    pub error: AmqpError,
    pub class_id: u16,
    pub method_id: u16,
}

impl Fault {
    pub fn new(error: AmqpError, class_id: u16, method_id: u16) -> Self {
        Fault {
            error,
            class_id,
            method_id,
        }
    }

    fn on(method: &Method, error: AmqpError) -> Self {
        Fault::new(error, method.class_id(), method.method_id())
    }

    fn on_publish(error: AmqpError) -> Self {
        Fault::new(error, BASIC_CLASS, BASIC_PUBLISH)
    }
}

/// What a channel handler needs from outside the channel.
/// A publish whose confirm waits for a store write (or for an earlier one that does).
#[derive(Clone, Copy, Debug)]
struct Waiting {
    seq: u64,
    /// The store batch it waits for (0: none, only its turn).
    batch: u64,
    /// The hold of replicated entries it waits for too (0: none; see
    /// `warren_broker::holds`).
    hold: u64,
    /// A full queue refused it: a nack.
    rejected: bool,
    /// When it was published (ms), for the confirm latency.
    at: u64,
}

pub(crate) struct Ctx<'a> {
    pub broker: &'a mut Broker,
    pub conn: ConnId,
    pub vhost: &'a str,
    /// The connection's user, whose permissions each operation is checked against.
    pub user: &'a str,
    /// The node's internal user (see `Connection::trusted`): nothing is checked.
    pub trusted: bool,
    pub out: &'a mut BytesMut,
    pub frame_max: u32,
    pub now: u64,
    pub config: &'a SessionConfig,
    /// Consumers of queues deleted by this frame: each gets a basic.cancel if its client wants one.
    pub cancelled: &'a mut Vec<ConsumerKey>,
    /// Source of unique suffixes for generated consumer tags.
    pub next_id: &'a mut u64,
    /// The node's confirm latency histogram.
    pub confirm_latency: &'a mut ConfirmLatency,
    /// Messages published to a direct reply-to address, for the node to hand to that channel's consumer.
    pub direct_replies: &'a mut Vec<DirectReply>,
    /// The connection takes no deliveries now (its socket is backed up).
    pub conn_blocked: bool,
}

impl Ctx<'_> {
    /// RabbitMQ's permission check for the connection's user in its vhost.
    fn check(&self, perm: Perm, resource: Resource<'_>) -> Result<(), AmqpError> {
        if self.trusted {
            return Ok(());
        }
        self.broker
            .access()
            .check(self.user, self.vhost, perm, resource)
    }

    /// RabbitMQ's topic authorisation of a routing key on an exchange.
    fn check_topic(&self, exchange: &str, perm: Perm, key: &str) -> Result<(), AmqpError> {
        if self.trusted {
            return Ok(());
        }
        self.broker
            .access()
            .check_topic(self.user, self.vhost, exchange, perm, key)
    }
}

/// RabbitMQ's direct reply-to: a pseudo-queue a client consumes from (no-ack) to get RPC replies without
/// declaring a queue. Publishing with this `reply_to` rewrites it to an address of the publishing channel.
pub(crate) const REPLY_TO: &str = "amq.rabbitmq.reply-to";
const REPLY_TO_PREFIX: &str = "amq.rabbitmq.reply-to.";

pub(crate) struct DirectReply {
    pub conn: ConnId,
    pub channel: u16,
    pub key: String,
    pub message: Message,
}

/// `amq.rabbitmq.reply-to.<conn>.<channel>.<key>` -> its parts.
fn parse_reply_address(routing_key: &str) -> Option<(ConnId, u16, &str)> {
    let rest = routing_key.strip_prefix(REPLY_TO_PREFIX)?;
    let mut parts = rest.splitn(3, '.');
    let conn = parts.next()?.parse().ok()?;
    let channel = parts.next()?.parse().ok()?;
    Some((conn, channel, parts.next()?))
}

/// Publishing to this exchange name extends the visibility timeout of a delivery the channel
/// holds (headers `x-delivery-tag` and `x-visibility-timeout`); nothing is routed.
pub const VISIBILITY_EXCHANGE: &str = "amq.warren.visibility";

/// A delivery the client has not settled yet, by delivery tag.
#[derive(Debug)]
pub(crate) struct Unacked {
    pub queue: QueueId,
    pub receipt: Receipt,
    /// A consumer delivery (counted against the channel-wide prefetch); false for basic.get.
    pub counted: bool,
    /// Its visibility timeout passed: the message went back to its queue. The tag stays valid
    /// (a late ack is not an error), but no longer counts against the channel's prefetch.
    pub timed_out: bool,
}

/// Timed-out deliveries a channel keeps for late acks; past this, the oldest are forgotten
/// (their late ack is still no error: see `forgotten_below`).
const TIMED_OUT_KEPT: usize = 4096;

/// The channel's record of one of its consumers: the consumer itself (prefetch, what it holds)
/// lives in its queue's machine.
#[derive(Debug)]
pub(crate) struct Consumer {
    pub queue: QueueId,
    pub id: ConsumerId,
    pub no_ack: bool,
}

enum Content {
    Idle,
    AwaitHeader(BasicPublish),
    AwaitBody {
        publish: BasicPublish,
        header: ContentHeader,
        body: Body,
    },
}

/// A body that arrives in one frame stays the frame's own slice; only multi-frame bodies are copied together.
enum Body {
    Empty,
    One(Bytes),
    Many(BytesMut),
}

impl Body {
    fn len(&self) -> usize {
        match self {
            Body::Empty => 0,
            Body::One(b) => b.len(),
            Body::Many(b) => b.len(),
        }
    }

    /// Adds a frame's bytes. Memory follows what arrived, never the size the content header
    /// announced (`total`, which only caps the first reservation): a client that announces
    /// 128 MiB and sends two frames costs two frames, and a body that does arrive grows by
    /// doubling, so at most twice its bytes are ever reserved.
    fn push(&mut self, chunk: Bytes, total: usize) {
        *self = match std::mem::replace(self, Body::Empty) {
            Body::Empty => Body::One(chunk),
            Body::One(first) => {
                let arrived = first.len() + chunk.len();
                let mut all = BytesMut::with_capacity(total.min(arrived.saturating_mul(2)));
                all.extend_from_slice(&first);
                all.extend_from_slice(&chunk);
                Body::Many(all)
            }
            Body::Many(mut all) => {
                all.extend_from_slice(&chunk);
                Body::Many(all)
            }
        }
    }

    fn into_bytes(self) -> Bytes {
        match self {
            Body::Empty => Bytes::new(),
            Body::One(b) => b,
            Body::Many(b) => b.freeze(),
        }
    }
}

/// Work a transaction holds back until tx.commit.
enum TxOp {
    Publish {
        exchange: ShortStr,
        routing_key: ShortStr,
        mandatory: bool,
        message: Box<Message>,
    },
    /// An ack, nack or reject: the deliveries it names leave the unacked map at once, as in
    /// RabbitMQ (a second ack of one of them fails then, not halfway through the commit), and
    /// go back to it on rollback. Until the commit they still count against the prefetch.
    Settle {
        how: Settle,
        taken: Vec<(u64, Unacked)>,
    },
}

/// The answer to a definition change, sent at once or once the cluster has it
/// ([`Channel::change_waiting`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ChangeReply {
    QueueBind,
    QueueUnbind,
    /// queue.delete-ok with the queue's message count.
    QueueDelete(u32),
    ExchangeBind,
    ExchangeUnbind,
    ExchangeDeclare,
    ExchangeDelete,
    /// A `nowait` method: nothing is sent, but what the client sends next is read only once
    /// the cluster has the change, as RabbitMQ's channel applies it before its next method.
    Nothing,
}

pub(crate) struct Channel {
    pub id: u16,
    /// A basic.get sent to the queue's leader on another node: its ticket, and whether the
    /// client asked for no-ack.
    pub get_waiting: Option<(u64, bool)>,
    /// A quorum queue's declaration waiting for the cluster's metadata log: its ticket, and
    /// whether the client asked for no-wait.
    pub declare_waiting: Option<(u64, bool)>,
    /// A definition (a binding, a durable exchange) the cluster's other nodes must have
    /// before the client hears of it: its ticket
    /// ([`warren_broker::Broker::wait_for_cluster`]) and the reply it then gets.
    pub change_waiting: Option<(u64, ChangeReply)>,
    /// The server sent channel.close and waits for close-ok: everything else on the channel is dropped.
    pub closing: bool,
    /// While closing: the client's own channel.close crossed ours (and was answered).
    pub peer_closed: bool,
    content: Content,
    confirm: bool,
    publish_seq: u64,
    /// Publishes confirmed but not yet acknowledged to the client: acks go out coalesced, once per batch.
    confirm_pending: Option<(u64, u64)>,
    /// Publishes whose confirm waits for a store write: (publish sequence number, write batch),
    /// in publish order. A publish that needs no write but follows one that does waits too
    /// (batch 0), so that a `multiple` ack never covers a message not yet on disk.
    confirm_waiting: VecDeque<Waiting>,
    /// The exchange the last publish was allowed to write to, and the permissions'
    /// generation then.
    write_checked: Option<(u64, ShortStr)>,
    /// tx.commit-ok replies waiting for the store write that holds the transaction's persistent
    /// messages (the batch numbers, in commit order).
    commit_waiting: VecDeque<(u64, u64)>,
    /// The holds waiting confirms and commits wait for, with how many wait for each (a
    /// deduplicated publish may wait for an earlier publish's): the lowest is what
    /// [`Channel::hold_floor`] tells.
    holds_waiting: BTreeMap<u64, u32>,
    /// A store write a commit waited for failed: the channel is to be closed.
    commit_failed: bool,
    tx: Option<Vec<TxOp>>,
    next_tag: u64,
    /// Ordered by delivery tag: a single ack is O(log n) in any order, a multiple ack splits.
    pub unacked: TagMap<Unacked>,
    /// The unacked deliveries that may time out, by (queue, message id): a timeout finds its
    /// tag without a scan. Deliveries without a timer are not in it (it costs them nothing).
    timed: HashMap<(QueueId, u64), u64>,
    /// Timed-out deliveries still in `unacked` (kept for late acks).
    timed_out_kept: usize,
    /// Tags below this that are not in `unacked` may be timed-out deliveries forgotten to bound
    /// memory: their ack is accepted (and does nothing) instead of failing as unknown.
    forgotten_below: u64,
    pub consumers: BTreeMap<ShortStr, Consumer>,
    consumer_prefetch: u16,
    pub channel_prefetch: u16,
    pub channel_unacked: u32,
    /// The credit last given to this channel's consumers in their queues; `None` when a queue
    /// may hold another value (it must be told again).
    sent_credit: Option<Credit>,
    last_queue: Option<ShortStr>,
    /// The direct reply-to consumer's tag and the secret part of this channel's reply address.
    pub reply_consumer: Option<(ShortStr, String)>,
}

#[derive(Clone, Copy)]
enum Settle {
    Ack,
    Requeue,
    Discard,
}

impl Channel {
    /// Is a publish's content (its header or body frames) still to come?
    pub(crate) fn mid_content(&self) -> bool {
        !matches!(self.content, Content::Idle)
    }

    pub fn new(id: u16) -> Self {
        Channel {
            id,
            get_waiting: None,
            declare_waiting: None,
            change_waiting: None,
            closing: false,
            peer_closed: false,
            content: Content::Idle,
            confirm: false,
            publish_seq: 0,
            confirm_pending: None,
            confirm_waiting: VecDeque::new(),
            write_checked: None,
            commit_waiting: VecDeque::new(),
            holds_waiting: BTreeMap::new(),
            commit_failed: false,
            tx: None,
            next_tag: 1,
            unacked: TagMap::default(),
            timed: HashMap::new(),
            timed_out_kept: 0,
            forgotten_below: 0,
            consumers: BTreeMap::new(),
            consumer_prefetch: 0,
            channel_prefetch: 0,
            channel_unacked: 0,
            sent_credit: Some(Credit::default()),
            last_queue: None,
            reply_consumer: None,
        }
    }

    /// The next delivery tag, for a delivery that is never acked (direct reply-to).
    pub fn take_delivery_tag(&mut self) -> u64 {
        let tag = self.next_tag;
        self.next_tag += 1;
        tag
    }

    /// A queue used up credit on a delivery the channel did not take: tell the queues again.
    pub fn forget_sent_credit(&mut self) {
        self.sent_credit = None;
    }

    /// Records a delivery to one of this channel's consumers and returns its delivery tag.
    pub fn record_delivery(
        &mut self,
        no_ack: bool,
        queue: QueueId,
        receipt: Receipt,
        timed: bool,
    ) -> u64 {
        let delivery_tag = self.next_tag;
        self.next_tag += 1;
        if !no_ack {
            if timed {
                self.timed.insert((queue, receipt.msg_id), delivery_tag);
            }
            self.channel_unacked += 1;
            self.unacked.insert(
                delivery_tag,
                Unacked {
                    queue,
                    receipt,
                    counted: true,
                    timed_out: false,
                },
            );
        }
        delivery_tag
    }

    /// The credit this channel's consumers have in their queues: none while the connection is
    /// backed up or the channel is closing; what is left of the channel-wide prefetch.
    fn credit(&self, conn_blocked: bool) -> Credit {
        Credit {
            blocked: conn_blocked || self.closing,
            limit: (self.channel_prefetch != 0)
                .then(|| u32::from(self.channel_prefetch).saturating_sub(self.channel_unacked)),
        }
    }

    /// Tells the queues of this channel's consumers its credit, if it changed since last told
    /// (with a channel-wide prefetch it changes with every delivery and ack).
    pub fn push_credit(&mut self, conn: ConnId, conn_blocked: bool, broker: &mut Broker) {
        let credit = self.credit(conn_blocked);
        if Some(credit) == self.sent_credit {
            return;
        }
        self.sent_credit = Some(credit);
        let group = CreditGroup {
            conn,
            channel: self.id,
        };
        let mut last = None;
        for c in self.consumers.values() {
            // Consumers of one queue are usually next to each other: tell each queue once
            // in a row (a repeat is harmless).
            if last != Some(c.queue) {
                broker.set_credit(c.queue, group, credit);
                last = Some(c.queue);
            }
        }
    }

    /// Writes the coalesced publisher confirms (one basic.ack, multiple where it covers several).
    pub fn flush_confirms(&mut self, out: &mut BytesMut) {
        if let Some((first, last)) = self.confirm_pending.take() {
            encode_ack(out, self.id, last, last > first);
        }
    }

    /// The channel is going away: unacked deliveries return to their queues, consumers are cancelled.
    /// What the management API shows of this channel.
    pub fn snapshot(&self) -> crate::manage::ChannelSnapshot {
        crate::manage::ChannelSnapshot {
            number: self.id,
            confirm: self.confirm,
            transactional: self.tx.is_some(),
            prefetch_count: self.consumer_prefetch,
            global_prefetch_count: self.channel_prefetch,
            unacked: self.unacked.len() as u64,
            consumers: self.consumers.len() as u32,
            closing: self.closing,
        }
    }

    pub fn release_all(&mut self, broker: &mut Broker) {
        for (_, u) in self.unacked.drain() {
            broker.release(u.queue, u.receipt);
        }
        self.timed.clear();
        self.timed_out_kept = 0;
        for (_, c) in std::mem::take(&mut self.consumers) {
            broker.cancel(c.queue, c.id);
        }
        // Deliveries a transaction settled but did not commit are still the client's.
        for op in self.tx.take().into_iter().flatten() {
            if let TxOp::Settle { taken, .. } = op {
                for (_, u) in taken {
                    broker.release(u.queue, u.receipt);
                }
            }
        }
        self.channel_unacked = 0;
        self.sent_credit = Some(Credit::default());
        self.content = Content::Idle;
        self.reply_consumer = None;
    }

    pub fn on_frame(&mut self, frame: Frame, ctx: &mut Ctx<'_>) -> Result<(), Fault> {
        match std::mem::replace(&mut self.content, Content::Idle) {
            Content::Idle => match frame {
                Frame::Method { method, .. } => self.on_method(method, ctx),
                _ => Err(Fault::new(
                    AmqpError::unexpected_frame(
                        "expected method frame, got non method frame instead".to_string(),
                    ),
                    0,
                    0,
                )),
            },
            Content::AwaitHeader(publish) => match frame {
                Frame::Header { header, .. } => self.on_header(publish, header, ctx),
                _ => Err(Fault::on_publish(AmqpError::unexpected_frame(
                    "expected content header for class 60, got non content header frame instead"
                        .to_string(),
                ))),
            },
            Content::AwaitBody {
                publish,
                header,
                mut body,
            } => match frame {
                Frame::Body { payload, .. } => {
                    let expected = header.body_size;
                    let total = body.len() as u64 + payload.len() as u64;
                    if total > expected {
                        return Err(Fault::on_publish(AmqpError::frame_error(format!(
                            "content body of {total} bytes exceeds the {expected} bytes announced in its header"
                        ))));
                    }
                    // Bounded by max_message_size, checked when the header arrived.
                    body.push(payload, expected as usize);
                    if total == expected {
                        self.complete_publish(publish, header, body.into_bytes(), ctx)
                    } else {
                        self.content = Content::AwaitBody {
                            publish,
                            header,
                            body,
                        };
                        Ok(())
                    }
                }
                _ => Err(Fault::on_publish(AmqpError::unexpected_frame(
                    "expected content body, got non content body frame instead".to_string(),
                ))),
            },
        }
    }

    fn on_header(
        &mut self,
        publish: BasicPublish,
        header: ContentHeader,
        ctx: &mut Ctx<'_>,
    ) -> Result<(), Fault> {
        if header.class_id != BASIC_CLASS {
            return Err(Fault::on_publish(AmqpError::unexpected_frame(format!(
                "expected content header for class 60, got one for class {} instead",
                header.class_id
            ))));
        }
        let max = ctx.config.max_message_size;
        if header.body_size > max {
            return Err(Fault::on_publish(AmqpError::precondition_failed(format!(
                "message size {} is larger than configured max size {max}",
                header.body_size
            ))));
        }
        if header.body_size == 0 {
            return self.complete_publish(publish, header, Bytes::new(), ctx);
        }
        self.content = Content::AwaitBody {
            publish,
            header,
            body: Body::Empty,
        };
        Ok(())
    }

    fn complete_publish(
        &mut self,
        publish: BasicPublish,
        header: ContentHeader,
        body: Bytes,
        ctx: &mut Ctx<'_>,
    ) -> Result<(), Fault> {
        if publish.exchange.as_str() == VISIBILITY_EXCHANGE {
            // Not a message: a holder asking for more time on one of its deliveries. Its
            // confirm (if the channel has confirms on) says whether it got it.
            let extended = self.extend_visibility(&header.properties, ctx);
            if self.confirm {
                self.publish_seq += 1;
                self.confirm_publish(None, 0, !extended, ctx);
            }
            return Ok(());
        }
        check_user_id(&header.properties, ctx).map_err(Fault::on_publish)?;
        check_expiration(&header.properties).map_err(Fault::on_publish)?;
        let persistent = properties::delivery_mode(&header.properties) == Some(2);
        let mut props = header.properties;
        if properties::reply_to(&props) == Some(REPLY_TO) {
            props = self.reply_address(&props, ctx).map_err(Fault::on_publish)?;
        }
        let message = Message {
            exchange: publish.exchange.clone(),
            routing_key: publish.routing_key.clone(),
            properties: props,
            body,
            persistent,
            store_key: None,
            away: None,
        };
        if self.tx.is_some() {
            // What the commit would refuse is refused now, as RabbitMQ does (its channel
            // closes before the commit, and nothing of the transaction is applied).
            ctx.broker
                .check_publish(ctx.vhost, &publish.exchange)
                .map_err(Fault::on_publish)?;
        }
        if let Some(ops) = self.tx.as_mut() {
            ops.push(TxOp::Publish {
                exchange: publish.exchange,
                routing_key: publish.routing_key,
                mandatory: publish.mandatory,
                message: Box::new(message),
            });
            return Ok(());
        }
        if self.confirm {
            self.publish_seq += 1;
        }
        // Its confirm waits for its own replicated entries only, not for other channels'.
        ctx.broker.open_hold();
        let routed = self.route(
            &publish.exchange,
            &publish.routing_key,
            publish.mandatory,
            message,
            ctx,
        );
        let hold = ctx.broker.close_hold();
        let (batch, rejected) = routed?;
        if self.confirm {
            self.confirm_publish(batch, hold, rejected, ctx);
        }
        Ok(())
    }

    /// Confirms the latest publish: at once, or after the store write it waits for (`batch`)
    /// and its replicated entries (`hold`), in publish order; as a nack if it was `rejected`
    /// (a full queue refused it) or its entries were lost.
    fn confirm_publish(
        &mut self,
        batch: Option<u64>,
        hold: u64,
        rejected: bool,
        ctx: &mut Ctx<'_>,
    ) {
        let seq = self.publish_seq;
        if batch.is_some() || hold != 0 || !self.confirm_waiting.is_empty() {
            self.note_hold(hold);
            self.confirm_waiting.push_back(Waiting {
                seq,
                batch: batch.unwrap_or(0),
                hold,
                rejected,
                at: ctx.now,
            });
            return;
        }
        ctx.confirm_latency.observe(0);
        if rejected {
            // Acks before it go first, so that a multiple ack cannot cover it.
            self.flush_confirms(ctx.out);
            encode_nack(ctx.out, self.id, seq, false, false);
        } else {
            self.confirm_ready(seq);
        }
    }

    /// A publish to `amq.warren.visibility`: headers `x-delivery-tag` (a delivery this channel
    /// holds) and `x-visibility-timeout` (ms from now). True if the delivery's deadline moved;
    /// false for an unknown or timed-out tag, a queue without the delivery, or bad headers.
    fn extend_visibility(&mut self, props: &Bytes, ctx: &mut Ctx<'_>) -> bool {
        let Ok(Some(headers)) = properties::headers(props) else {
            return false;
        };
        let tag = headers.get("x-delivery-tag").and_then(|v| v.as_u64());
        let ms = headers
            .get("x-visibility-timeout")
            .and_then(|v| v.as_u64())
            .filter(|ms| *ms > 0);
        let (Some(tag), Some(ms)) = (tag, ms) else {
            return false;
        };
        match self.unacked.get(tag) {
            Some(u) if !u.timed_out => ctx.broker.extend(u.queue, u.receipt, ms),
            _ => false,
        }
    }

    fn confirm_ready(&mut self, seq: u64) {
        self.confirm_pending = Some(match self.confirm_pending {
            Some((first, _)) => (first, seq),
            None => (seq, seq),
        });
    }

    /// A commit failed with its store write since last asked: the channel must be closed with
    /// [`partial_tx`] (RabbitMQ's answer when a queue fails a transaction's message).
    pub fn take_commit_failure(&mut self) -> Option<AmqpError> {
        std::mem::take(&mut self.commit_failed).then(partial_tx)
    }

    /// Publishes (or a tx.commit) wait for a store write.
    pub fn confirms_waiting(&self) -> bool {
        !self.confirm_waiting.is_empty() || !self.commit_waiting.is_empty()
    }

    /// Store writes up to batch `upto` are done (`ok`) or failed: the confirms waiting for them
    /// are released in publish order, as acks, or as nacks for the messages of a failed write.
    /// A publish whose replicated entries are still pending in `holds` stops the release (the
    /// order is kept); one whose entries were lost is nacked. True if confirms are still
    /// waiting.
    pub fn writes_done(
        &mut self,
        upto: u64,
        ok: bool,
        holds: Option<&Holds>,
        now: u64,
        latency: &mut ConfirmLatency,
        out: &mut BytesMut,
    ) -> bool {
        let state = |hold: u64| holds.map_or(HoldState::Applied, |h| h.state(hold));
        while let Some(&Waiting {
            seq,
            batch,
            hold,
            rejected,
            at,
        }) = self.confirm_waiting.front()
        {
            if batch > upto {
                break;
            }
            let failed = !ok && batch != 0;
            let held = state(hold);
            if held == HoldState::Pending && !failed {
                break;
            }
            self.confirm_waiting.pop_front();
            self.unnote_hold(hold);
            latency.observe(now.saturating_sub(at));
            if !rejected && !failed && held == HoldState::Applied {
                self.confirm_ready(seq);
            } else {
                // Acks before this one go out first: a multiple ack must not cover it.
                self.flush_confirms(out);
                encode_nack(out, self.id, seq, false, false);
            }
        }
        // A commit has no nack: a failed write (or a lost entry) fails the commits waiting for
        // it (their messages may still reach the disk, as a nacked publish's may).
        while let Some(&(batch, hold)) = self.commit_waiting.front() {
            if batch > upto {
                break;
            }
            let held = state(hold);
            // A failed write fails the commits in it; one that waits for no write (only for
            // replicated entries) fails only with them.
            if (!ok && batch != 0) || held == HoldState::Lost {
                for (_, h) in std::mem::take(&mut self.commit_waiting) {
                    self.unnote_hold(h);
                }
                self.commit_failed = true;
                break;
            }
            if held == HoldState::Pending {
                break;
            }
            self.commit_waiting.pop_front();
            self.unnote_hold(hold);
            send(out, self.id, TxCommitOk {});
        }
        self.confirms_waiting()
    }

    /// A confirm or commit now waits for `hold`.
    fn note_hold(&mut self, hold: u64) {
        if hold != 0 {
            *self.holds_waiting.entry(hold).or_insert(0) += 1;
        }
    }

    /// A confirm or commit that waited for `hold` is answered.
    fn unnote_hold(&mut self, hold: u64) {
        if let Some(n) = self.holds_waiting.get_mut(&hold) {
            *n -= 1;
            if *n == 0 {
                self.holds_waiting.remove(&hold);
            }
        }
    }

    /// The lowest hold a confirm or commit of this channel waits for, if any: lost holds below
    /// every channel's floor are forgotten.
    pub fn hold_floor(&self) -> Option<u64> {
        self.holds_waiting.keys().next().copied()
    }

    fn route(
        &mut self,
        exchange: &ShortStr,
        routing_key: &ShortStr,
        mandatory: bool,
        message: Message,
        ctx: &mut Ctx<'_>,
    ) -> Result<(Option<u64>, bool), Fault> {
        if exchange.is_empty() {
            if let Some((conn, channel, key)) = parse_reply_address(routing_key) {
                // Delivered by the node, straight to the waiting consumer; dropped if it is gone, as in RabbitMQ.
                ctx.direct_replies.push(DirectReply {
                    conn,
                    channel,
                    key: key.to_string(),
                    message,
                });
                return Ok((None, false));
            }
        }
        // Only a mandatory publish can come back, so only then is a handle on the message kept.
        let returned = mandatory.then(|| message.clone());
        let routed = ctx
            .broker
            .publish(ctx.vhost, exchange, routing_key, message, ctx.now)
            .map_err(Fault::on_publish)?;
        if routed.queues == 0 {
            // The publisher's own header, but it may have sent it within RabbitMQ's few
            // bytes of tolerance past frame_max: not sent back then.
            let returned = returned.filter(|m| {
                let fits = fit::fits(&m.properties, ctx.frame_max);
                if !fits {
                    tracing::warn!(conn = ctx.conn, channel = self.id, frame_max = ctx.frame_max, "an unroutable mandatory message's content header is larger than frame_max: dropped without basic.return");
                }
                fits
            });
            if let Some(m) = returned {
                encode_return(
                    ctx.out,
                    self.id,
                    ReplyCode::NoRoute.code(),
                    "NO_ROUTE",
                    exchange,
                    routing_key,
                    &m.properties,
                    &m.body,
                    ctx.frame_max,
                );
            }
        }
        Ok((routed.batch, routed.rejected))
    }

    /// basic.get took a message whose content header this connection cannot take: it goes back
    /// to its queue (to its tail if the get was no-ack, which made the queue forget it) and
    /// the channel is closed with the error returned.
    /// get-ok with the message, or get-empty. `no_ack` and a delivery the queue did not settle
    /// (a forwarded get's): settled now that it is sent.
    fn send_get(
        &mut self,
        got: Option<(Delivery, u32)>,
        no_ack: bool,
        ctx: &mut Ctx<'_>,
    ) -> Result<(), AmqpError> {
        let ch = self.id;
        let Some((d, remaining)) = got else {
            send(ctx.out, ch, BasicGetEmpty::default());
            return Ok(());
        };
        let smaller = match fit::fit(&d.message.properties, ctx.frame_max) {
            Fit::AsIs => None,
            Fit::Without(properties) => Some(properties),
            Fit::TooLarge(len) => return Err(self.refuse_get(d, len, ctx)),
        };
        let tag = self.next_tag;
        self.next_tag += 1;
        if !no_ack {
            self.unacked.insert(
                tag,
                Unacked {
                    queue: d.queue,
                    receipt: d.receipt,
                    counted: false,
                    timed_out: false,
                },
            );
        }
        encode_get_ok(
            ctx.out,
            ch,
            tag,
            d.redelivered,
            &d.message.exchange,
            &d.message.routing_key,
            remaining,
            smaller.as_ref().unwrap_or(&d.message.properties),
            &d.message.body,
            ctx.frame_max,
        );
        if no_ack && !d.settled && !ctx.broker.settle(d.queue, d.receipt) {
            tracing::warn!(conn = ctx.conn, channel = ch, queue = %d.queue_name, "a no-ack basic.get's message could not be settled: it may be delivered again");
        }
        Ok(())
    }

    /// The answer to the basic.get this channel sent to another node (`get_waiting`).
    pub(crate) fn answer_get(
        &mut self,
        got: Option<(Delivery, u32)>,
        ctx: &mut Ctx<'_>,
    ) -> Result<(), AmqpError> {
        let no_ack = self.get_waiting.take().is_some_and(|(_, no_ack)| no_ack);
        self.send_get(got, no_ack, ctx)
    }

    /// The channel waits for an answer from the cluster (its connection is not read
    /// meanwhile, so what the client sent next sees the answer's effects).
    pub(crate) fn waits(&self) -> bool {
        !self.closing
            && (self.get_waiting.is_some()
                || self.declare_waiting.is_some()
                || self.change_waiting.is_some())
    }

    /// The change this channel waits for is on every running node: the client gets its
    /// answer.
    pub(crate) fn answer_change(&mut self, out: &mut BytesMut) {
        if let Some((_, answer)) = self.change_waiting.take() {
            send_change_reply(out, self.id, answer);
        }
    }

    /// The answer to the quorum queue declaration this channel waits for
    /// (`declare_waiting`).
    pub(crate) fn answer_declare(
        &mut self,
        result: Result<warren_broker::QueueDeclared, AmqpError>,
        out: &mut BytesMut,
    ) -> Result<(), AmqpError> {
        let no_wait = self
            .declare_waiting
            .take()
            .is_some_and(|(_, no_wait)| no_wait);
        let declared = result?;
        self.last_queue = Some(declared.name.clone());
        if !no_wait {
            send(
                out,
                self.id,
                QueueDeclareOk {
                    queue: declared.name,
                    message_count: declared.message_count,
                    consumer_count: declared.consumer_count,
                },
            );
        }
        Ok(())
    }

    fn refuse_get(&mut self, d: Delivery, len: usize, ctx: &mut Ctx<'_>) -> AmqpError {
        tracing::warn!(conn = ctx.conn, channel = self.id, queue = %d.queue_name, vhost = %ctx.vhost, header_len = len, frame_max = ctx.frame_max, "basic.get: the message's content header is larger than frame_max: not sent, the channel is closed");
        let text = fit::too_large_text(&d.queue_name, ctx.vhost, len, ctx.frame_max);
        if d.settled {
            if let Err(e) = ctx.broker.put_back(ctx.vhost, &d.queue_name, d.message) {
                tracing::error!(queue = %d.queue_name, vhost = %ctx.vhost, error = %e, "an unsendable basic.get message could not be put back in its queue");
            }
        } else {
            ctx.broker.release(d.queue, d.receipt);
        }
        AmqpError::precondition_failed(text)
    }

    /// The publish asks for replies on this channel: its reply_to becomes the channel's own address.
    fn reply_address(&self, props: &Bytes, ctx: &Ctx<'_>) -> Result<Bytes, AmqpError> {
        let Some((_, key)) = &self.reply_consumer else {
            return Err(AmqpError::precondition_failed(
                "fast reply consumer does not exist".to_string(),
            ));
        };
        let mut decoded = warren_codec::BasicProperties::decode(props)
            .map_err(|e| AmqpError::syntax_error(e.to_string()))?;
        decoded.reply_to = Some(ShortStr::from_string(format!(
            "{REPLY_TO_PREFIX}{}.{}.{key}",
            ctx.conn, self.id
        )));
        Ok(decoded.encode())
    }

    fn resolve_queue(&self, name: &ShortStr) -> Result<ShortStr, AmqpError> {
        if !name.is_empty() {
            return Ok(name.clone());
        }
        self.last_queue
            .clone()
            .ok_or_else(|| AmqpError::not_found("no previously declared queue".to_string()))
    }

    /// A binding needs write on its destination and read on its source exchange, checked in
    /// that order as RabbitMQ does (the default exchange is left to the broker's own refusal).
    fn check_binding(
        &self,
        destination: Resource<'_>,
        source: &str,
        ctx: &Ctx<'_>,
    ) -> Result<(), AmqpError> {
        ctx.check(Perm::Write, destination)?;
        if source.is_empty() {
            return Ok(());
        }
        ctx.check(Perm::Read, Resource::Exchange(source))
    }

    /// Answers a definition change made since `mark`: at once, or, when it went to the
    /// cluster, once every running node has it, the channel holding its connection meanwhile
    /// (RabbitMQ answers a binding, an unbinding or a deletion once every node's metadata
    /// store has it). A `nowait` method waits too, answering nothing: the client's next
    /// method must see it.
    fn answer_or_hold(&mut self, mark: u64, no_wait: bool, answer: ChangeReply, ctx: &mut Ctx<'_>) {
        let answer = if no_wait {
            ChangeReply::Nothing
        } else {
            answer
        };
        match ctx.broker.wait_for_cluster(mark, ctx.conn) {
            Some(ticket) => self.change_waiting = Some((ticket, answer)),
            None => send_change_reply(ctx.out, self.id, answer),
        }
    }

    fn on_method(&mut self, method: Method, ctx: &mut Ctx<'_>) -> Result<(), Fault> {
        let (class_id, method_id) = (method.class_id(), method.method_id());
        let fail = |e: AmqpError| Fault::new(e, class_id, method_id);
        let ch = self.id;
        match method {
            Method::BasicPublish(p) => {
                if p.immediate {
                    return Err(fail(AmqpError::not_implemented(
                        "immediate=true".to_string(),
                    )));
                }
                // The answer is kept per exchange until a permission changes: a publisher
                // pays for the check once, not per message.
                let generation = ctx.broker.access().generation();
                // `amq.warren.visibility` only acts on deliveries this channel holds, which
                // its user could read: it needs no write permission.
                let checked = p.exchange.as_str() == VISIBILITY_EXCHANGE
                    || self
                        .write_checked
                        .as_ref()
                        .is_some_and(|(g, x)| *g == generation && *x == p.exchange);
                if !checked {
                    ctx.check(Perm::Write, Resource::Exchange(&p.exchange))
                        .map_err(fail)?;
                    self.write_checked = Some((generation, p.exchange.detached()));
                }
                ctx.check_topic(&p.exchange, Perm::Write, &p.routing_key)
                    .map_err(fail)?;
                self.content = Content::AwaitHeader(p);
                Ok(())
            }
            Method::BasicAck(a) => self
                .settle(a.delivery_tag, a.multiple, Settle::Ack, ctx)
                .map_err(fail),
            Method::BasicNack(n) => {
                let how = if n.requeue {
                    Settle::Requeue
                } else {
                    Settle::Discard
                };
                self.settle(n.delivery_tag, n.multiple, how, ctx)
                    .map_err(fail)
            }
            Method::BasicReject(r) => {
                let how = if r.requeue {
                    Settle::Requeue
                } else {
                    Settle::Discard
                };
                self.settle(r.delivery_tag, false, how, ctx).map_err(fail)
            }
            Method::BasicQos(q) => {
                if q.prefetch_size != 0 {
                    return Err(fail(AmqpError::not_implemented(format!(
                        "prefetch_size!=0 ({})",
                        q.prefetch_size
                    ))));
                }
                if q.global {
                    self.channel_prefetch = q.prefetch_count;
                } else {
                    // As RabbitMQ 3.x does: a per-consumer qos also lifts a channel-wide limit set before it.
                    self.consumer_prefetch = q.prefetch_count;
                    self.channel_prefetch = 0;
                }
                self.push_credit(ctx.conn, ctx.conn_blocked, ctx.broker);
                send(ctx.out, ch, BasicQosOk {});
                Ok(())
            }
            Method::BasicConsume(c) => {
                if let Some(max) = ctx.config.consumer_max_per_channel {
                    // As RabbitMQ: counted before anything else is checked, and a tag in use
                    // is left to the reuse check below.
                    let current = self.consumers.len() + usize::from(self.reply_consumer.is_some());
                    if current >= max && !self.consumers.contains_key(&c.consumer_tag) {
                        return Err(fail(AmqpError::not_allowed(format!(
                            "reached maximum ({max}) of consumers per channel"
                        ))));
                    }
                }
                let queue = self.resolve_queue(&c.queue).map_err(fail)?;
                if queue.as_str() != REPLY_TO {
                    ctx.check(Perm::Read, Resource::Queue(&queue))
                        .map_err(fail)?;
                }
                let tag = if c.consumer_tag.is_empty() {
                    *ctx.next_id += 1;
                    ShortStr::from_string(generated_name("amq.ctag-", ctx.conn, *ctx.next_id))
                } else {
                    // Kept as long as the consumer lives: not a slice of the read buffer.
                    c.consumer_tag.detached()
                };
                if self.consumers.contains_key(&tag)
                    || self.reply_consumer.as_ref().is_some_and(|(t, _)| *t == tag)
                {
                    return Err(fail(AmqpError::not_allowed(format!(
                        "attempt to reuse consumer tag '{tag}'"
                    ))));
                }
                if queue.as_str() == REPLY_TO {
                    if !c.no_ack {
                        return Err(fail(AmqpError::precondition_failed(
                            "reply consumer cannot acknowledge".to_string(),
                        )));
                    }
                    if self.reply_consumer.is_some() {
                        return Err(fail(AmqpError::precondition_failed(
                            "reply consumer already set".to_string(),
                        )));
                    }
                    *ctx.next_id += 1;
                    let secret =
                        generated_name("", ctx.conn ^ u64::from(self.id) << 48, *ctx.next_id);
                    self.reply_consumer = Some((tag.clone(), secret));
                    if !c.no_wait {
                        send(ctx.out, ch, BasicConsumeOk { consumer_tag: tag });
                    }
                    return Ok(());
                }
                let quorum = ctx
                    .broker
                    .queue_id(ctx.vhost, &queue)
                    .and_then(|id| ctx.broker.queue_args(id))
                    .is_some_and(|a| a.queue_type == QueueType::Quorum);
                if quorum && self.channel_prefetch != 0 {
                    // A connection error in RabbitMQ, as here.
                    return Err(fail(AmqpError::not_implemented(format!(
                        "queue '{queue}' in vhost '{}' does not support global qos",
                        ctx.vhost
                    ))));
                }
                let group = CreditGroup {
                    conn: ctx.conn,
                    channel: ch,
                };
                let (queue_id, id) = ctx
                    .broker
                    .consume(
                        ctx.vhost,
                        &queue,
                        group,
                        tag.clone(),
                        c.no_ack,
                        c.exclusive,
                        u32::from(self.consumer_prefetch),
                        &c.arguments,
                    )
                    .map_err(fail)?;
                self.consumers.insert(
                    tag.clone(),
                    Consumer {
                        queue: queue_id,
                        id,
                        no_ack: c.no_ack,
                    },
                );
                if self.sent_credit != Some(Credit::default()) {
                    // The new consumer's queue has not heard of this channel's credit yet.
                    self.sent_credit = None;
                    self.push_credit(ctx.conn, ctx.conn_blocked, ctx.broker);
                }
                if !c.no_wait {
                    send(ctx.out, ch, BasicConsumeOk { consumer_tag: tag });
                }
                Ok(())
            }
            Method::BasicCancel(c) => {
                if self
                    .reply_consumer
                    .as_ref()
                    .is_some_and(|(t, _)| *t == c.consumer_tag)
                {
                    self.reply_consumer = None;
                }
                if let Some(consumer) = self.consumers.remove(&c.consumer_tag) {
                    ctx.broker.cancel(consumer.queue, consumer.id);
                }
                if !c.no_wait {
                    send(
                        ctx.out,
                        ch,
                        BasicCancelOk {
                            consumer_tag: c.consumer_tag,
                        },
                    );
                }
                Ok(())
            }
            Method::BasicGet(g) => {
                let queue = self.resolve_queue(&g.queue).map_err(fail)?;
                ctx.check(Perm::Read, Resource::Queue(&queue))
                    .map_err(fail)?;
                match ctx
                    .broker
                    .basic_get(ctx.vhost, &queue, g.no_ack, ctx.conn, ch)
                    .map_err(fail)?
                {
                    Got::Now(got) => self.send_get(got, g.no_ack, ctx).map_err(fail),
                    Got::Waiting(ticket) => {
                        self.get_waiting = Some((ticket, g.no_ack));
                        Ok(())
                    }
                }
            }
            Method::BasicRecover(r) => {
                self.recover(r.requeue, ctx).map_err(fail)?;
                send(ctx.out, ch, BasicRecoverOk {});
                Ok(())
            }
            Method::BasicRecoverAsync(r) => self.recover(r.requeue, ctx).map_err(fail),
            Method::ChannelFlow(f) => {
                if !f.active {
                    return Err(fail(AmqpError::not_implemented("active=false".to_string())));
                }
                send(ctx.out, ch, ChannelFlowOk { active: true });
                Ok(())
            }
            Method::ChannelFlowOk(_) => Ok(()),
            Method::ExchangeDeclare(e) => {
                if !e.passive && !e.exchange.is_empty() {
                    ctx.check(Perm::Configure, Resource::Exchange(&e.exchange))
                        .map_err(fail)?;
                    let ae = e.arguments.get("alternate-exchange");
                    if let Some(FieldValue::LongStr(ae)) = ae {
                        if !ctx.broker.exchange_exists(ctx.vhost, &e.exchange) {
                            ctx.check(Perm::Read, Resource::Exchange(&e.exchange))
                                .map_err(fail)?;
                            let ae = String::from_utf8_lossy(ae);
                            ctx.check(Perm::Write, Resource::Exchange(&ae))
                                .map_err(fail)?;
                        }
                    }
                }
                let mark = ctx.broker.change_mark();
                ctx.broker
                    .declare_exchange(
                        ctx.vhost,
                        &e.exchange,
                        &e.kind,
                        e.passive,
                        e.durable,
                        e.auto_delete,
                        e.internal,
                        &e.arguments,
                    )
                    .map_err(fail)?;
                self.answer_or_hold(mark, e.no_wait, ChangeReply::ExchangeDeclare, ctx);
                Ok(())
            }
            Method::ExchangeDelete(e) => {
                if !e.exchange.is_empty() {
                    ctx.check(Perm::Configure, Resource::Exchange(&e.exchange))
                        .map_err(fail)?;
                }
                let mark = ctx.broker.change_mark();
                ctx.broker
                    .delete_exchange(ctx.vhost, &e.exchange, e.if_unused)
                    .map_err(fail)?;
                self.answer_or_hold(mark, e.no_wait, ChangeReply::ExchangeDelete, ctx);
                Ok(())
            }
            Method::ExchangeBind(b) => {
                self.check_binding(Resource::Exchange(&b.destination), &b.source, ctx)
                    .map_err(fail)?;
                let mark = ctx.broker.change_mark();
                ctx.broker
                    .bind_exchange(
                        ctx.vhost,
                        &b.destination,
                        &b.source,
                        &b.routing_key,
                        &b.arguments,
                    )
                    .map_err(fail)?;
                self.answer_or_hold(mark, b.no_wait, ChangeReply::ExchangeBind, ctx);
                Ok(())
            }
            Method::ExchangeUnbind(b) => {
                self.check_binding(Resource::Exchange(&b.destination), &b.source, ctx)
                    .map_err(fail)?;
                let mark = ctx.broker.change_mark();
                ctx.broker
                    .unbind_exchange(
                        ctx.vhost,
                        &b.destination,
                        &b.source,
                        &b.routing_key,
                        &b.arguments,
                    )
                    .map_err(fail)?;
                self.answer_or_hold(mark, b.no_wait, ChangeReply::ExchangeUnbind, ctx);
                Ok(())
            }
            Method::QueueDeclare(q) if q.queue.as_str() == REPLY_TO => {
                // The pseudo-queue exists for every channel, as in RabbitMQ, and is always empty.
                if !q.no_wait {
                    send(
                        ctx.out,
                        ch,
                        QueueDeclareOk {
                            queue: q.queue,
                            message_count: 0,
                            consumer_count: 0,
                        },
                    );
                }
                Ok(())
            }
            Method::QueueDeclare(q) => {
                let no_wait = q.no_wait;
                let declared = ctx
                    .broker
                    .declare_queue_as(
                        ctx.vhost,
                        DeclareQueue {
                            name: q.queue,
                            passive: q.passive,
                            durable: q.durable,
                            exclusive: q.exclusive,
                            auto_delete: q.auto_delete,
                            arguments: q.arguments,
                        },
                        ctx.conn,
                        // The broker checks the user's permissions (the internal user has all).
                        (!ctx.trusted).then_some(ctx.user),
                    )
                    .map_err(fail)?;
                let declared = match declared {
                    Declared::Now(d) => d,
                    Declared::Waiting(ticket) => {
                        self.declare_waiting = Some((ticket, no_wait));
                        return Ok(());
                    }
                };
                self.last_queue = Some(declared.name.clone());
                if !no_wait {
                    send(
                        ctx.out,
                        ch,
                        QueueDeclareOk {
                            queue: declared.name,
                            message_count: declared.message_count,
                            consumer_count: declared.consumer_count,
                        },
                    );
                }
                Ok(())
            }
            Method::QueueBind(b) => {
                let queue = self.resolve_queue(&b.queue).map_err(fail)?;
                // The spec: an empty queue name and routing key both mean the last declared queue.
                let routing_key = if b.queue.is_empty() && b.routing_key.is_empty() {
                    queue.clone()
                } else {
                    b.routing_key.clone()
                };
                self.check_binding(Resource::Queue(&queue), &b.exchange, ctx)
                    .map_err(fail)?;
                ctx.check_topic(&b.exchange, Perm::Read, &routing_key)
                    .map_err(fail)?;
                let mark = ctx.broker.change_mark();
                ctx.broker
                    .bind_queue(
                        ctx.vhost,
                        &queue,
                        &b.exchange,
                        &routing_key,
                        &b.arguments,
                        ctx.conn,
                    )
                    .map_err(fail)?;
                self.answer_or_hold(mark, b.no_wait, ChangeReply::QueueBind, ctx);
                Ok(())
            }
            Method::QueueUnbind(b) => {
                let queue = self.resolve_queue(&b.queue).map_err(fail)?;
                self.check_binding(Resource::Queue(&queue), &b.exchange, ctx)
                    .map_err(fail)?;
                let mark = ctx.broker.change_mark();
                ctx.broker
                    .unbind_queue(
                        ctx.vhost,
                        &queue,
                        &b.exchange,
                        &b.routing_key,
                        &b.arguments,
                        ctx.conn,
                    )
                    .map_err(fail)?;
                // queue.unbind has no nowait.
                self.answer_or_hold(mark, false, ChangeReply::QueueUnbind, ctx);
                Ok(())
            }
            Method::QueuePurge(p) => {
                let queue = self.resolve_queue(&p.queue).map_err(fail)?;
                ctx.check(Perm::Read, Resource::Queue(&queue))
                    .map_err(fail)?;
                let count = ctx
                    .broker
                    .purge_queue(ctx.vhost, &queue, ctx.conn)
                    .map_err(fail)?;
                if !p.no_wait {
                    send(
                        ctx.out,
                        ch,
                        QueuePurgeOk {
                            message_count: count,
                        },
                    );
                }
                Ok(())
            }
            Method::QueueDelete(d) => {
                let queue = self.resolve_queue(&d.queue).map_err(fail)?;
                ctx.check(Perm::Configure, Resource::Queue(&queue))
                    .map_err(fail)?;
                let mark = ctx.broker.change_mark();
                let deleted = ctx
                    .broker
                    .delete_queue(ctx.vhost, &queue, d.if_unused, d.if_empty, ctx.conn)
                    .map_err(fail)?;
                ctx.cancelled.extend(deleted.cancelled);
                let answer = ChangeReply::QueueDelete(deleted.message_count);
                self.answer_or_hold(mark, d.no_wait, answer, ctx);
                Ok(())
            }
            Method::ConfirmSelect(c) => {
                if self.tx.is_some() {
                    return Err(fail(AmqpError::precondition_failed(
                        "cannot switch from tx to confirm mode".to_string(),
                    )));
                }
                self.confirm = true;
                reply(ctx.out, ch, c.no_wait, ConfirmSelectOk {});
                Ok(())
            }
            Method::TxSelect(_) => {
                if self.confirm {
                    return Err(fail(AmqpError::precondition_failed(
                        "cannot switch from confirm to tx mode".to_string(),
                    )));
                }
                if self.tx.is_none() {
                    self.tx = Some(Vec::new());
                }
                send(ctx.out, ch, TxSelectOk {});
                Ok(())
            }
            Method::TxCommit(_) => {
                let ops = self.tx.as_mut().map(std::mem::take).ok_or_else(|| {
                    fail(AmqpError::precondition_failed(
                        "channel is not transactional".to_string(),
                    ))
                })?;
                self.commit(ops, ctx).map_err(fail)
            }
            Method::TxRollback(_) => {
                let Some(ops) = self.tx.as_mut().map(std::mem::take) else {
                    return Err(fail(AmqpError::precondition_failed(
                        "channel is not transactional".to_string(),
                    )));
                };
                for op in ops {
                    if let TxOp::Settle { taken, .. } = op {
                        self.unacked.extend(taken);
                    }
                }
                send(ctx.out, ch, TxRollbackOk {});
                Ok(())
            }
            other => Err(Fault::on(
                &other,
                AmqpError::command_invalid(format!(
                    "unexpected method {} on channel {ch}",
                    other.name()
                )),
            )),
        }
    }

    fn recover(&mut self, requeue: bool, ctx: &mut Ctx<'_>) -> Result<(), AmqpError> {
        if !requeue {
            return Err(AmqpError::not_implemented("requeue=false".to_string()));
        }
        match self.unacked.last() {
            Some((last, _)) => self.settle_now(last, true, Settle::Requeue, ctx),
            None => Ok(()),
        }
    }

    fn settle(
        &mut self,
        tag: u64,
        multiple: bool,
        how: Settle,
        ctx: &mut Ctx<'_>,
    ) -> Result<(), AmqpError> {
        if self.tx.is_some() {
            // Validated now so an unknown tag fails at once, as RabbitMQ does.
            self.check_tag(tag, multiple)?;
            let taken = self.take_unacked(tag, multiple);
            if let Some(ops) = self.tx.as_mut() {
                ops.push(TxOp::Settle { how, taken });
            }
            return Ok(());
        }
        self.settle_now(tag, multiple, how, ctx)
    }

    /// An ack of `tag` must name an unacked delivery, except tag 0 with multiple (everything).
    fn check_tag(&self, tag: u64, multiple: bool) -> Result<(), AmqpError> {
        if (multiple && tag == 0) || self.unacked.contains_key(tag) || tag < self.forgotten_below {
            Ok(())
        } else {
            Err(AmqpError::precondition_failed(format!(
                "unknown delivery tag {tag}"
            )))
        }
    }

    /// Takes the deliveries an ack of `tag` names out of the unacked map (`check_tag` first).
    fn take_unacked(&mut self, tag: u64, multiple: bool) -> Vec<(u64, Unacked)> {
        if !multiple {
            return self
                .unacked
                .remove(tag)
                .map(|u| (tag, u))
                .into_iter()
                .collect();
        }
        // Tag 0 with multiple: everything.
        let upto = if tag == 0 { u64::MAX } else { tag };
        std::iter::from_fn(|| self.unacked.pop_first_upto(upto)).collect()
    }

    /// tx.commit: all of it or nothing of it. What could fail was checked as it came (the
    /// exchanges, permissions and sizes of the publishes, the tags of the acks); what may
    /// have changed since (an exchange deleted) is checked again before anything is applied.
    /// A queue that refuses a message (reject-publish) cannot be foreseen: the rest is
    /// applied and the commit fails, as in RabbitMQ ("partial tx completion").
    fn commit(&mut self, ops: Vec<TxOp>, ctx: &mut Ctx<'_>) -> Result<(), AmqpError> {
        let unfit = ops.iter().find_map(|op| match op {
            TxOp::Publish { exchange, .. } => ctx.broker.check_publish(ctx.vhost, exchange).err(),
            TxOp::Settle { .. } => None,
        });
        if let Some(e) = unfit {
            // Put back, for the channel's close to return the deliveries it settled.
            self.tx = Some(ops);
            return Err(e);
        }
        // The last store write the transaction's persistent messages are in.
        let mut wait = None;
        let mut refused = false;
        let mut ops = ops.into_iter();
        // The commit-ok waits for the transaction's replicated entries, no other channel's.
        ctx.broker.open_hold();
        while let Some(op) = ops.next() {
            match op {
                TxOp::Publish {
                    exchange,
                    routing_key,
                    mandatory,
                    message,
                } => match self.route(&exchange, &routing_key, mandatory, *message, ctx) {
                    Ok((batch, rejected)) => {
                        wait = wait.max(batch);
                        refused |= rejected;
                    }
                    Err(f) => {
                        // Checked just above: not expected. The rest stays unapplied.
                        ctx.broker.close_hold();
                        self.tx = Some(ops.collect());
                        return Err(f.error);
                    }
                },
                TxOp::Settle { how, taken } => {
                    for (_, u) in taken {
                        self.settle_one(u, how, ctx);
                    }
                }
            }
        }
        let hold = ctx.broker.close_hold();
        if self.channel_prefetch != 0 {
            self.push_credit(ctx.conn, ctx.conn_blocked, ctx.broker);
        }
        if refused {
            return Err(partial_tx());
        }
        // As a confirm does, commit-ok means the messages are on disk; a commit with
        // nothing to write still waits behind an earlier one (replies keep their order).
        let earlier = self.commit_waiting.back().map(|c| c.0);
        match wait.or(earlier) {
            Some(batch) => {
                self.note_hold(hold);
                self.commit_waiting.push_back((batch, hold));
            }
            None if hold != 0 => {
                self.note_hold(hold);
                self.commit_waiting.push_back((0, hold));
            }
            None => send(ctx.out, self.id, TxCommitOk {}),
        }
        Ok(())
    }

    fn settle_now(
        &mut self,
        tag: u64,
        multiple: bool,
        how: Settle,
        ctx: &mut Ctx<'_>,
    ) -> Result<(), AmqpError> {
        self.check_tag(tag, multiple)?;
        if multiple {
            // Everything up to and including `tag` (tag 0: everything); the rest stays.
            let upto = if tag == 0 { u64::MAX } else { tag };
            while let Some((_, u)) = self.unacked.pop_first_upto(upto) {
                self.settle_one(u, how, ctx);
            }
        } else if let Some(u) = self.unacked.remove(tag) {
            self.settle_one(u, how, ctx);
        }
        if self.channel_prefetch != 0 {
            self.push_credit(ctx.conn, ctx.conn_blocked, ctx.broker);
        }
        Ok(())
    }

    fn settle_one(&mut self, u: Unacked, how: Settle, ctx: &mut Ctx<'_>) {
        if u.timed_out {
            self.timed_out_kept = self.timed_out_kept.saturating_sub(1);
        } else if !self.timed.is_empty() {
            self.timed.remove(&(u.queue, u.receipt.msg_id));
        }
        // A stale receipt (the queue is gone, or the delivery timed out and went to another
        // worker) changes nothing: the client's ack is still valid. A late ack of a timed-out
        // delivery still settles the message if nobody else has taken it since.
        let current = match how {
            Settle::Ack => ctx.broker.settle(u.queue, u.receipt),
            Settle::Requeue => ctx.broker.requeue(u.queue, u.receipt),
            Settle::Discard => ctx.broker.discard(u.queue, u.receipt),
        };
        if !current && !u.timed_out {
            // Not a timed-out delivery: the queue went, or the broker could not take it. Quiet
            // by default; a trail when a message seems stuck with its consumer.
            tracing::debug!(
                conn = ctx.conn,
                channel = self.id,
                queue = u.queue.0,
                msg_id = u.receipt.msg_id,
                attempt = u.receipt.attempt,
                "a settle the queue did not take"
            );
        }
        if u.counted && !u.timed_out {
            self.channel_unacked = self.channel_unacked.saturating_sub(1);
        }
    }

    /// A delivery of this channel timed out (its message is back in its queue): it stops
    /// counting against the channel-wide prefetch. True if the channel had it.
    pub fn delivery_timed_out(&mut self, queue: QueueId, receipt: Receipt) -> bool {
        let indexed = self
            .timed
            .remove(&(queue, receipt.msg_id))
            .filter(|tag| self.unacked.get(*tag).is_some_and(|u| u.receipt == receipt));
        let tag = match indexed {
            Some(tag) => Some(tag),
            // A delivery given a timer after it went out (an extension on a queue without a
            // timeout) is not indexed: looked for.
            None => self
                .unacked
                .iter()
                .find(|(_, u)| u.queue == queue && u.receipt == receipt && !u.timed_out)
                .map(|(tag, _)| tag),
        };
        let u = match tag.and_then(|t| self.unacked.get_mut(t)) {
            Some(u) => u,
            // Settled in a transaction not committed yet: it stops counting all the same.
            None => match held_mut(&mut self.tx, queue, receipt) {
                Some(u) => u,
                None => return false,
            },
        };
        if u.timed_out {
            return false;
        }
        u.timed_out = true;
        if u.counted {
            self.channel_unacked = self.channel_unacked.saturating_sub(1);
        }
        self.timed_out_kept += 1;
        if self.timed_out_kept > TIMED_OUT_KEPT {
            self.forget_oldest_timed_out();
        }
        true
    }

    /// Drops the oldest timed-out deliveries beyond [`TIMED_OUT_KEPT`]: a worker that never
    /// acks must not grow the channel without bound. Their late ack stays harmless.
    fn forget_oldest_timed_out(&mut self) {
        let excess = self.timed_out_kept.saturating_sub(TIMED_OUT_KEPT);
        let old: Vec<u64> = self
            .unacked
            .iter()
            .filter(|(_, u)| u.timed_out)
            .map(|(tag, _)| tag)
            .take(excess)
            .collect();
        for tag in old {
            self.unacked.remove(tag);
            self.timed_out_kept = self.timed_out_kept.saturating_sub(1);
            self.forgotten_below = self.forgotten_below.max(tag.saturating_add(1));
        }
    }

    /// A consumer removed by the broker (its queue was deleted).
    pub fn drop_consumer(&mut self, tag: &str) -> bool {
        self.consumers.remove(tag).is_some()
    }
}

/// A delivery a transaction settled and holds until its commit.
fn held_mut(tx: &mut Option<Vec<TxOp>>, queue: QueueId, receipt: Receipt) -> Option<&mut Unacked> {
    tx.iter_mut().flatten().find_map(|op| match op {
        TxOp::Settle { taken, .. } => taken
            .iter_mut()
            .find(|(_, u)| u.queue == queue && u.receipt == receipt)
            .map(|(_, u)| u),
        TxOp::Publish { .. } => None,
    })
}

/// RabbitMQ's error for a commit that was only partly applied.
fn partial_tx() -> AmqpError {
    AmqpError::precondition_failed("partial tx completion".to_string())
}

/// Sends a method's -ok unless the client asked for no-wait.
/// The answer to a definition change ([`ChangeReply`]).
fn send_change_reply(out: &mut BytesMut, channel: u16, answer: ChangeReply) {
    match answer {
        ChangeReply::QueueBind => send(out, channel, QueueBindOk {}),
        ChangeReply::QueueUnbind => send(out, channel, QueueUnbindOk {}),
        ChangeReply::QueueDelete(message_count) => {
            send(out, channel, QueueDeleteOk { message_count })
        }
        ChangeReply::ExchangeBind => send(out, channel, ExchangeBindOk {}),
        ChangeReply::ExchangeUnbind => send(out, channel, ExchangeUnbindOk {}),
        ChangeReply::ExchangeDeclare => send(out, channel, ExchangeDeclareOk {}),
        ChangeReply::ExchangeDelete => send(out, channel, ExchangeDeleteOk {}),
        ChangeReply::Nothing => {}
    }
}

fn reply(out: &mut BytesMut, channel: u16, no_wait: bool, ok: impl Into<Method>) {
    if !no_wait {
        send(out, channel, ok);
    }
}

/// RabbitMQ's validated user-id: a `user_id` property must name the connection's user, unless
/// that user has the `impersonator` tag.
fn check_user_id(props: &[u8], ctx: &Ctx<'_>) -> Result<(), AmqpError> {
    let Some(claimed) = properties::user_id(props) else {
        return Ok(());
    };
    let impersonator = || {
        ctx.broker
            .access()
            .user(ctx.user)
            .is_some_and(|u| u.tags.iter().any(|t| t == "impersonator"))
    };
    // The internal user carries messages between brokers as they are (a shovel).
    if claimed == ctx.user || ctx.trusted || impersonator() {
        return Ok(());
    }
    Err(AmqpError::precondition_failed(format!(
        "user_id property set to '{claimed}' but authenticated user was '{}'",
        ctx.user
    )))
}

/// RabbitMQ's rule for the expiration property: a non-negative integer of milliseconds, as text.
fn check_expiration(props: &[u8]) -> Result<(), AmqpError> {
    let Some(exp) = properties::expiration(props) else {
        return Ok(());
    };
    match exp.parse::<i64>() {
        Ok(v) if v >= 0 => Ok(()),
        Ok(v) => Err(AmqpError::precondition_failed(format!(
            "invalid expiration '{exp}': {{value_negative,{v}}}"
        ))),
        Err(_) => Err(AmqpError::precondition_failed(format!(
            "invalid expiration '{exp}': no_integer"
        ))),
    }
}

/// A name like RabbitMQ's `amq.ctag-<22 url-safe base64 chars>`, unique per connection and counter.
pub(crate) fn generated_name(prefix: &str, conn: ConnId, counter: u64) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut state =
        conn.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ counter.rotate_left(32) ^ 0xD6E8_FEB8_6659_FD93;
    let mut s = String::with_capacity(prefix.len() + 22);
    s.push_str(prefix);
    for _ in 0..22 {
        // splitmix64: cheap, and distinct inputs give distinct streams.
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        s.push(char::from(ALPHABET[(z & 63) as usize]));
    }
    s
}

#[cfg(test)]
mod body_tests {
    use super::*;

    #[test]
    fn a_body_reserves_what_arrived_not_what_was_announced() {
        let announced = 128 << 20;
        let mut body = Body::Empty;
        body.push(Bytes::from(vec![1u8; 10]), announced);
        body.push(Bytes::from(vec![2u8; 10]), announced);
        let Body::Many(all) = &body else {
            panic!("two frames make a copied body");
        };
        assert!(all.capacity() <= 64, "reserved {} bytes", all.capacity());
        for _ in 0..1000 {
            body.push(Bytes::from(vec![3u8; 1000]), announced);
        }
        assert_eq!(body.len(), 20 + 1000 * 1000);
        let Body::Many(all) = &body else {
            panic!("still copied");
        };
        assert!(all.capacity() <= 2 * body.len() + 1024);
        // A body that says its size exactly gets it in one reservation.
        let mut exact = Body::Empty;
        exact.push(Bytes::from(vec![1u8; 6]), 12);
        exact.push(Bytes::from(vec![2u8; 6]), 12);
        assert_eq!(exact.into_bytes().len(), 12);
    }
}
