//! The whole protocol core of one broker node: every connection's state machine and the broker they share.
//!
//! Sans-IO: the driver (crates/server) feeds it events with the current time and drains the bytes to write.
//! Nothing here blocks, sleeps or reads a clock, so tests drive it frame by frame with simulated time.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;

use bytes::{Bytes, BytesMut};
use warren_broker::holds::HoldState;
use warren_broker::limits::{LimitScope, MAX_CHANNELS, MAX_CONNECTIONS};
use warren_broker::{Broker, ConnId, ConsumerKey, Delivery, QueueId, Receipt};
use warren_codec::{
    encode_deliver, encode_heartbeat, AmqpError, BasicCancel, ChannelClose, ChannelCloseOk,
    ChannelOpenOk, DecodeError, Frame, Method,
};

use crate::channel::{Channel, Ctx, DirectReply, Fault};
use crate::config::SessionConfig;
use crate::connection::{short_text, Connection, Next, State};
use crate::fit::{self, Fit};
use crate::latency::ConfirmLatency;
use crate::out::send;

/// tx.commit's class and method ids, for a commit that fails after its frame was handled.
const TX_COMMIT: (u16, u16) = (90, 20);
const BASIC_GET: (u16, u16) = (60, 70);
const QUEUE_DECLARE: (u16, u16) = (50, 10);
/// Answers to the management API's quorum queue declarations kept for their callers.
const API_DECLARES_KEPT: usize = 1 << 16;

/// A delivery whose content header its consumer's connection cannot take (see [`fit`]).
struct Oversized {
    conn: ConnId,
    channel: u16,
    queue: QueueId,
    queue_name: warren_codec::ShortStr,
    receipt: Receipt,
    /// The queue forgot it already (no-ack): it must be put back, not returned.
    settled: bool,
    message: warren_broker::Message,
    header_len: usize,
    frame_max: u32,
}

/// Closes a channel on the broker's own initiative, outside a frame of the channel: its
/// unacked deliveries go back and its consumers are cancelled, as for any channel error.
fn close_channel(
    broker: &mut Broker,
    out: &mut BytesMut,
    ch: &mut Channel,
    error: &AmqpError,
    (class_id, method_id): (u16, u16),
) {
    ch.flush_confirms(out);
    send(
        out,
        ch.id,
        ChannelClose {
            reply_code: error.code.code(),
            reply_text: short_text(&error.reply_text()),
            class_id,
            method_id,
        },
    );
    ch.closing = true;
    ch.release_all(broker);
}

/// Output buffer capacity a connection keeps between batches.
const OUT_BUFFER_KEEP: usize = 64 * 1024;

/// Bytes for one connection's socket, and what to do after writing them.
#[derive(Debug)]
pub struct Transmit {
    pub conn: ConnId,
    pub bytes: Bytes,
    /// The negotiated frame_max: the reader's decoder must enforce it from now on.
    pub frame_max: Option<u32>,
    /// Close the socket once these bytes are written.
    pub close: bool,
    /// Stop (true) or resume (false) reading from the socket: a resource alarm (memory, disk)
    /// holds publishers back as RabbitMQ does, by not reading what they send.
    pub pause: Option<bool>,
}

pub struct Node {
    broker: Broker,
    config: SessionConfig,
    pub(crate) conns: BTreeMap<ConnId, Connection>,
    /// `(deadline, connection)`: each connection at most once, under `Connection::timer`. A
    /// deadline is filed early rather than late: activity only moves a connection's real
    /// deadline later, and an entry that fires early is filed again.
    timers: BTreeSet<(u64, ConnId)>,
    /// Reused delivery buffer.
    deliveries: Vec<Delivery>,
    /// Connections with something for the driver.
    dirty: Vec<ConnId>,
    /// Consumers whose queue went away, to be told with basic.cancel.
    cancelled: Vec<ConsumerKey>,
    direct_replies: Vec<DirectReply>,
    next_id: u64,
    confirm_latency: ConfirmLatency,
    /// Channels with publisher confirms waiting for a store write.
    confirm_waiters: BTreeSet<(ConnId, u16)>,
    /// The last store batch written.
    written: u64,
    /// The resource alarm in force ("low on memory", "low on disk"), if any.
    alarm: Option<&'static str>,
    /// Recovery is in progress (`set_recovering`).
    recovering: bool,
    /// The highest store batch whose confirms went out as acks (on disk, and a majority has
    /// its replicated entries), and the highest whose went out as nacks.
    confirmed: u64,
    nacked: u64,
    /// Answers to quorum queue declarations the management API and SQS made, by ticket,
    /// until their callers take them ([`Node::take_api_declare`]); the oldest go beyond
    /// [`API_DECLARES_KEPT`] (a caller that went away never takes its answer).
    api_declares: BTreeMap<u64, Result<warren_broker::QueueDeclared, AmqpError>>,
    /// Messages the management API moved to a quorum queue, still in flight from their source
    /// until the copy's entries are applied (then settled there) or lost (then given back).
    pub(crate) held_moves: Vec<(u64, QueueId, Receipt)>,
}

impl Node {
    pub fn new(config: SessionConfig, broker: Broker) -> Self {
        Node {
            broker,
            config,
            conns: BTreeMap::new(),
            timers: BTreeSet::new(),
            deliveries: Vec::new(),
            dirty: Vec::new(),
            cancelled: Vec::new(),
            direct_replies: Vec::new(),
            next_id: 0,
            confirm_latency: ConfirmLatency::default(),
            confirm_waiters: BTreeSet::new(),
            written: 0,
            alarm: None,
            recovering: false,
            confirmed: 0,
            nacked: 0,
            api_declares: BTreeMap::new(),
            held_moves: Vec::new(),
        }
    }

    /// Sets the resource alarms (the driver measures memory and free disk). While one is on,
    /// every connection that publishes is blocked: the driver stops reading its socket, and a
    /// client that advertises the `connection.blocked` capability is told so, with RabbitMQ's
    /// reason text. Connections that only consume keep running, so queues drain. When the
    /// last alarm clears, blocked connections get `connection.unblocked` and are read again.
    /// Memory is past the paging threshold: transient messages of deep queues go to disk
    /// (see `Broker::set_spill`).
    pub fn set_paging(&mut self, on: bool) {
        self.broker.set_spill(on);
    }

    pub fn set_alarms(&mut self, memory: bool, disk: bool, now: u64) {
        let alarm = match (memory, disk) {
            (true, _) => Some("low on memory"),
            (false, true) => Some("low on disk"),
            (false, false) => None,
        };
        if alarm == self.alarm {
            return;
        }
        let was = self.alarm.is_some();
        self.alarm = alarm;
        match alarm {
            Some(_) if !was => {
                tracing::warn!(reason = alarm, "resource alarm: publishers are blocked");
                let ids: Vec<ConnId> = self
                    .conns
                    .iter()
                    .filter(|(_, c)| c.published && !c.paused)
                    .map(|(id, _)| *id)
                    .collect();
                for id in ids {
                    self.block(id);
                }
            }
            Some(_) => {}
            None => {
                tracing::warn!("resource alarm cleared: publishers may publish again");
                for (id, c) in self.conns.iter_mut().filter(|(_, c)| c.paused) {
                    c.paused = false;
                    c.pause_changed = true;
                    // Its heartbeats were not read while it was blocked.
                    c.last_recv = now;
                    if c.caps.connection_blocked && c.is_open() {
                        send(&mut c.out, 0, warren_codec::ConnectionUnblocked {});
                    }
                    if !c.dirty {
                        c.dirty = true;
                        self.dirty.push(*id);
                    }
                }
            }
        }
    }

    /// Is a resource alarm in force?
    pub fn alarm(&self) -> Option<&'static str> {
        self.alarm
    }

    fn block(&mut self, conn: ConnId) {
        let Some(reason) = self.alarm else { return };
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        if c.paused || !c.is_open() {
            return;
        }
        c.paused = true;
        c.pause_changed = true;
        if c.caps.connection_blocked {
            send(
                &mut c.out,
                0,
                warren_codec::ConnectionBlocked {
                    reason: warren_codec::ShortStr::from_static(reason),
                },
            );
        }
        if !c.dirty {
            c.dirty = true;
            self.dirty.push(conn);
        }
    }

    /// The store writes made since the last call, as the next numbered batch: the driver writes
    /// batches in order and reports each with [`Node::writes_done`].
    pub fn take_writes(&mut self) -> Option<warren_broker::WriteBatch> {
        self.broker.take_writes()
    }

    /// The last store batch reported written.
    pub fn written(&self) -> u64 {
        self.written
    }

    /// Every batch up to `upto` is written (`ok`), or the write holding them failed: publisher
    /// confirms waiting for them go out (acks, or nacks after a failure).
    pub fn writes_done(&mut self, upto: u64, ok: bool, now: u64) {
        if ok {
            self.broker.writes_done(upto);
            self.written = self.written.max(upto);
        } else {
            self.broker.writes_failed(upto);
        }
        self.replicated_marks();
        if ok {
            self.release_confirms(self.written, true, now);
        } else {
            self.nacked = self.nacked.max(upto);
            self.release_confirms(upto, false, now);
        }
    }

    /// The confirm marks the management API's and SQS's publishes wait for: a batch holding
    /// entries of replicated queues is confirmed once they are committed too, and nacked if
    /// they are lost. A channel's confirms wait for their own entries instead (their holds), so
    /// no other publish's entries hold them back.
    fn replicated_marks(&mut self) {
        if let Some(lost) = self.broker.take_lost() {
            self.nacked = self.nacked.max(lost);
        }
        self.confirmed = self.confirmed.max(self.broker.confirmable(self.written));
    }

    /// Makes this node `node` of the cluster of `nodes` (see `Broker::join_cluster`).
    pub fn join_cluster(&mut self, node: u64, nodes: &[u64], boot: u64) {
        self.broker.join_cluster(node, nodes, boot);
    }

    /// The entries for replicated queues' groups made since the last call.
    pub fn take_proposals(&mut self, out: &mut Vec<warren_broker::Proposal>) {
        self.broker.take_proposals(out);
    }

    /// The driver's time, before a change made outside a connection (the management API's):
    /// what it starts (a wait for the cluster) is stamped with it.
    pub fn advance_time(&mut self, now: u64) {
        self.broker.advance_time(now);
    }

    /// A publish another node forwarded to a queue this node leads.
    pub fn forwarded(&mut self, group: u64, data: &[u8], now: u64) {
        self.broker.advance_time(now);
        self.broker.forwarded(group, data);
    }

    /// Committed entries of replicated queues' groups: applied, and the confirms, nacks and
    /// deliveries that waited for them released.
    pub fn replicated(&mut self, entries: &[warren_broker::Committed], now: u64) {
        // Before the entries: what they apply is stamped with the time they came (a
        // definition change's application starts its wait for the other nodes).
        self.broker.advance_time(now);
        self.broker.apply_committed(entries);
        for closed in self.broker.take_meta_closed() {
            self.closed_elsewhere(closed, now);
        }
        self.after_replication(now);
    }

    /// Snapshots of replicated queues taken since the last call, for the driver to write.
    pub fn take_snapshots(&mut self, out: &mut Vec<warren_broker::ReplicaSnapshot>) {
        self.broker.take_snapshots(out);
    }

    /// A replicated queue's snapshot replaces its state (see `Broker::install_snapshot`).
    pub fn install_snapshot(
        &mut self,
        group: u64,
        index: u64,
        term: u64,
        data: bytes::Bytes,
        now: u64,
    ) {
        let away = self.broker.away_context();
        let decoded = warren_broker::DecodedSnapshot::decode_with(group, data, away.as_ref());
        drop(self.install_decoded(group, index, term, decoded, now));
    }

    /// [`Node::install_snapshot`] of one decoded beforehand; returns the queue's replaced
    /// state, for the caller to drop once it let go of the node.
    pub fn install_decoded(
        &mut self,
        group: u64,
        index: u64,
        term: u64,
        decoded: warren_broker::DecodedSnapshot,
        now: u64,
    ) -> Option<warren_broker::machine::QueueMachine<warren_broker::Message>> {
        self.broker.advance_time(now);
        let replaced = self.broker.install_decoded(group, index, term, decoded);
        // A metadata snapshot may delete users and vhosts, as the log's entries do.
        for closed in self.broker.take_meta_closed() {
            self.closed_elsewhere(closed, now);
        }
        self.after_replication(now);
        replaced
    }

    /// A peer node went down or came back, as Raft sees it (see `Broker::set_peer_up`).
    pub fn set_peer_up(&mut self, peer: u64, up: bool, now: u64) {
        self.broker.advance_time(now);
        self.broker.set_peer_up(peer, up);
        self.after_replication(now);
    }

    /// A peer says how far it applied the cluster's metadata log (see
    /// `Broker::peer_meta_applied`): a declaration that waited for it is answered now.
    pub fn peer_meta_applied(&mut self, peer: u64, index: u64, now: u64) {
        self.broker.advance_time(now);
        self.broker.peer_meta_applied(peer, index);
        self.after_replication(now);
    }

    /// A replicated queue's group has a new leader (see `Broker::set_leader`).
    pub fn set_leader(&mut self, group: u64, leader: Option<u64>, term: u64, now: u64) {
        self.broker.advance_time(now);
        self.broker.set_leader(group, leader, term);
        self.after_replication(now);
    }

    /// Raft refused a proposal for `group` (see `Broker::proposal_refused`).
    pub fn proposal_refused(&mut self, group: u64, data: &[u8], leader: Option<u64>, now: u64) {
        self.broker.advance_time(now);
        self.broker.proposal_refused(group, data, leader);
        self.after_replication(now);
    }

    fn after_replication(&mut self, now: u64) {
        self.replicated_marks();
        self.release_confirms(self.written, true, now);
        let cancelled = self.broker.take_replica_cancelled();
        if !cancelled.is_empty() {
            self.consumers_cancelled(cancelled.into_iter());
        }
        if self.broker.has_get_answers() {
            self.answer_gets(now);
        }
        if self.broker.has_change_answers() {
            self.answer_changes();
        }
        if self.broker.has_declare_answers() {
            self.answer_declares(now);
        }
    }

    /// The answer to a quorum queue declaration the management API or SQS made
    /// (`Declared::Waiting` with [`crate::manage::API_CONN`]), once the cluster gave it.
    pub fn take_api_declare(
        &mut self,
        ticket: u64,
    ) -> Option<Result<warren_broker::QueueDeclared, AmqpError>> {
        self.api_declares.remove(&ticket)
    }

    /// Quorum queue declarations the metadata log applied (or that waited too long): each
    /// waiting channel gets its queue.declare-ok or its error, and its connection is read
    /// again.
    fn answer_declares(&mut self, now: u64) {
        let mut answers = Vec::new();
        self.broker.take_declare_answers(&mut answers);
        for a in answers {
            if a.conn == crate::manage::API_CONN {
                self.api_declares.insert(a.ticket, a.result);
                while self.api_declares.len() > API_DECLARES_KEPT {
                    self.api_declares.pop_first();
                }
                continue;
            }
            let Some(c) = self.conns.get_mut(&a.conn) else {
                continue;
            };
            let channel = c
                .channels
                .iter()
                .find(|(_, ch)| {
                    !ch.closing && ch.declare_waiting.is_some_and(|(t, _)| t == a.ticket)
                })
                .map(|(id, _)| *id);
            let mut hard = None;
            if let Some(ch) = channel.and_then(|id| c.channels.get_mut(&id)) {
                match ch.answer_declare(a.result, &mut c.out) {
                    Ok(()) => {}
                    Err(error) if error.is_hard() => hard = Some(error),
                    Err(error) => {
                        close_channel(&mut self.broker, &mut c.out, ch, &error, QUEUE_DECLARE)
                    }
                }
            }
            c.holding = c.channels.values().any(|ch| ch.waits());
            c.pause_changed = true;
            if !c.dirty {
                c.dirty = true;
                self.dirty.push(a.conn);
            }
            if let Some(error) = hard {
                let (class_id, method_id) = QUEUE_DECLARE;
                self.fail_connection(a.conn, Fault::new(error, class_id, method_id), now);
            }
        }
    }

    /// Definition changes every running node has now: each waiting channel gets its answer
    /// (bind-ok, declare-ok), and its connection is read again.
    fn answer_changes(&mut self) {
        let mut answers = Vec::new();
        self.broker.take_change_answers(&mut answers);
        for a in answers {
            let Some(c) = self.conns.get_mut(&a.conn) else {
                continue;
            };
            if let Some(ch) = c
                .channels
                .values_mut()
                .find(|ch| !ch.closing && ch.change_waiting.is_some_and(|(t, _)| t == a.ticket))
            {
                ch.answer_change(&mut c.out);
            }
            c.holding = c.channels.values().any(|ch| ch.waits());
            c.pause_changed = true;
            if !c.dirty {
                c.dirty = true;
                self.dirty.push(a.conn);
            }
        }
    }

    /// Is this connection waiting, for a basic.get's answer from another node or for a
    /// resource alarm to clear? The driver then feeds it no more frames until it is told to
    /// read again: frames it read before it learnt of the pause (the bytes of a read already
    /// under way when the connection was blocked) wait too, not only the socket. A blocked
    /// connection's publish whose content is still coming (the one that got it blocked) is
    /// read to its end first.
    pub fn holds(&self, conn: ConnId) -> bool {
        self.conns.get(&conn).is_some_and(|c| {
            c.holding || (c.paused && !c.channels.values().any(|ch| ch.mid_content()))
        })
    }

    /// The answers of basic.gets sent to other nodes, to the channels that wait for them. One
    /// nobody waits for any more (the channel or its connection went) gives its message back.
    fn answer_gets(&mut self, now: u64) {
        let mut answers = Vec::new();
        self.broker.take_get_answers(&mut answers);
        for a in answers {
            let waits = |c: &Connection| {
                c.is_open()
                    && c.channels.get(&a.channel).is_some_and(|ch| {
                        !ch.closing && ch.get_waiting.is_some_and(|(t, _)| t == a.ticket)
                    })
            };
            let Some(c) = self.conns.get_mut(&a.conn).filter(|c| waits(c)) else {
                if let Some((d, _)) = a.got {
                    self.broker.release(d.queue, d.receipt);
                }
                if let Some(c) = self.conns.get_mut(&a.conn) {
                    // Its channel went meanwhile (closed by the broker): read it again.
                    let still = c.channels.values().any(|ch| ch.waits());
                    if c.holding != still {
                        c.holding = still;
                        c.pause_changed = true;
                        self.mark(a.conn);
                    }
                }
                continue;
            };
            let Connection {
                channels,
                out,
                vhost,
                user,
                trusted,
                frame_max,
                write_blocked,
                out_blocked,
                holding,
                pause_changed,
                dirty,
                ..
            } = c;
            let Some(ch) = channels.get_mut(&a.channel) else {
                continue;
            };
            let mut ctx = Ctx {
                broker: &mut self.broker,
                conn: a.conn,
                vhost,
                user,
                trusted: *trusted,
                out,
                frame_max: *frame_max,
                now,
                config: &self.config,
                cancelled: &mut self.cancelled,
                next_id: &mut self.next_id,
                confirm_latency: &mut self.confirm_latency,
                direct_replies: &mut self.direct_replies,
                conn_blocked: *write_blocked || *out_blocked,
            };
            if let Err(error) = ch.answer_get(a.got, &mut ctx) {
                close_channel(&mut self.broker, out, ch, &error, BASIC_GET);
            }
            *holding = channels.values().any(|ch| ch.waits());
            *pause_changed = true;
            if !*dirty {
                *dirty = true;
                self.dirty.push(a.conn);
            }
        }
    }

    /// The highest batch confirmed and the highest refused (see [`Node::writes_done`]): what
    /// a change that waits for its batch (the management API's, SQS's) may answer.
    pub fn confirm_marks(&self) -> (u64, u64) {
        (self.confirmed, self.nacked)
    }

    /// Channels' confirms and commits waiting for store batches up to `upto` go out (acks, or
    /// nacks when the write failed), each once its replicated entries are applied too.
    fn release_confirms(&mut self, upto: u64, ok: bool, now: u64) {
        let mut floor = self.end_held_moves();
        let waiters = std::mem::take(&mut self.confirm_waiters);
        let holds = self.broker.holds();
        let prune = holds.is_some_and(|h| h.has_lost());
        let mut failed_commits = Vec::new();
        for (conn, channel) in waiters {
            let Some(c) = self.conns.get_mut(&conn) else {
                continue;
            };
            let Some(ch) = c.channels.get_mut(&channel) else {
                continue;
            };
            if ch.writes_done(upto, ok, holds, now, &mut self.confirm_latency, &mut c.out) {
                self.confirm_waiters.insert((conn, channel));
                if prune {
                    if let Some(f) = ch.hold_floor() {
                        floor = Some(floor.map_or(f, |x| x.min(f)));
                    }
                }
            }
            if let Some(error) = ch.take_commit_failure() {
                failed_commits.push((conn, channel, error));
            }
            c.confirms_pending = true;
            if !c.dirty {
                c.dirty = true;
                self.dirty.push(conn);
            }
        }
        if prune {
            // Lost holds no channel waits on any more are forgotten.
            self.broker.prune_lost_holds(floor);
        }
        for (conn, channel, error) in failed_commits {
            let Some(c) = self.conns.get_mut(&conn) else {
                continue;
            };
            let Some(ch) = c.channels.get_mut(&channel) else {
                continue;
            };
            tracing::warn!(conn, channel, "the store write (or the replicated entries) of a committed transaction failed: the commit fails and its channel is closed");
            close_channel(&mut self.broker, &mut c.out, ch, &error, TX_COMMIT);
        }
    }

    /// Moved messages whose copies' entries are applied leave their source, those whose are
    /// lost go back to it; the lowest hold the others still wait for.
    fn end_held_moves(&mut self) -> Option<u64> {
        if self.held_moves.is_empty() {
            return None;
        }
        let holds = self.broker.holds()?;
        let mut ended = Vec::new();
        self.held_moves.retain(|&(hold, queue, receipt)| {
            let state = holds.state(hold);
            if state != HoldState::Pending {
                ended.push((state, queue, receipt));
            }
            state == HoldState::Pending
        });
        for (state, queue, receipt) in ended {
            if state == HoldState::Applied {
                self.broker.settle(queue, receipt);
            } else {
                tracing::warn!(
                    queue = queue.0,
                    "a moved message's copy was lost: it goes back to its queue"
                );
                self.broker.release(queue, receipt);
            }
        }
        self.held_moves.iter().map(|m| m.0).min()
    }

    /// From each publish to its confirm, over every confirm sent since the start.
    pub fn confirm_latency(&self) -> &ConfirmLatency {
        &self.confirm_latency
    }

    pub fn broker(&self) -> &Broker {
        &self.broker
    }

    /// The broker, for recovery (which runs between the node's events, before any client
    /// reaches a queue).
    pub fn broker_mut(&mut self) -> &mut Broker {
        &mut self.broker
    }

    /// While on, the store is bringing queues back: open connections are not read (the server
    /// holds their frames), so their heartbeats are not held against them, and broker timers
    /// wait. Turning it off counts every connection as heard from now.
    pub fn set_recovering(&mut self, on: bool, now: u64) {
        self.recovering = on;
        self.broker.set_recovering(on);
        if !on {
            self.broker.cap_restored_expiries(now);
            for c in self.conns.values_mut() {
                c.last_recv = c.last_recv.max(now);
            }
        }
    }

    /// Has the connection finished its handshake (connection.open-ok sent)?
    pub fn is_open(&self, conn: ConnId) -> bool {
        self.conns.get(&conn).is_some_and(|c| c.is_open())
    }

    /// The commands applied to queues since the last call, while the broker records them
    /// (`Broker::set_recording`, a debug option).
    pub fn take_records(&mut self) -> Vec<warren_broker::queue::log::Record> {
        self.broker.take_records()
    }

    pub fn config(&self) -> &SessionConfig {
        &self.config
    }

    pub fn connection_count(&self) -> usize {
        self.conns.len()
    }

    /// A client sent a valid protocol header: the server speaks first with connection.start.
    pub fn connection_opened(&mut self, conn: ConnId, peer: Option<SocketAddr>, now: u64) {
        self.connection_opened_as(conn, peer, None, now);
    }

    /// As [`Node::connection_opened`], for a TLS connection: when the driver verified a client
    /// certificate, `tls.external` is the user name taken from it, and EXTERNAL is offered.
    pub fn connection_opened_as(
        &mut self,
        conn: ConnId,
        peer: Option<SocketAddr>,
        tls: Option<crate::manage::TlsInfo>,
        now: u64,
    ) {
        let mut c = Connection::new(conn, peer, now, &self.config);
        c.external = tls.as_ref().and_then(|t| t.external.clone());
        c.tls = tls.map(Box::new);
        c.send_start(&self.config);
        self.conns.insert(conn, c);
        self.schedule(conn);
        self.mark(conn);
    }

    /// The socket is gone (EOF, error, or after the close the node asked for): forget the connection.
    pub fn connection_lost(&mut self, conn: ConnId) {
        self.release(conn);
        self.forget(conn);
    }

    /// Logs the end of a connection that completed its handshake (as RabbitMQ logs
    /// "closing AMQP connection").
    fn log_closed(c: &Connection, how: &str) {
        if !c.user.is_empty() && !c.vhost.is_empty() {
            tracing::info!(conn = c.id, peer = ?c.peer, user = %c.user, vhost = %c.vhost, how, "connection closed");
        }
    }

    fn forget(&mut self, conn: ConnId) {
        if let Some(c) = self.conns.remove(&conn) {
            let how = if c.close_socket {
                "closed"
            } else {
                "socket lost"
            };
            Self::log_closed(&c, how);
            if let Some(at) = c.timer {
                self.timers.remove(&(at, conn));
            }
        }
    }

    /// Files the connection under its next deadline, unless it is filed under an earlier one.
    fn schedule(&mut self, conn: ConnId) {
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        let next = c.deadline(&self.config);
        match (c.timer, next) {
            (Some(filed), Some(at)) if filed <= at => {}
            (filed, next) => {
                if let Some(f) = filed {
                    self.timers.remove(&(f, conn));
                }
                if let Some(at) = next {
                    self.timers.insert((at, conn));
                }
                c.timer = next;
            }
        }
    }

    /// The earliest time at which [`Node::tick`] has something to do (connection timers and
    /// the broker's queues); `None` when nothing is time-bound.
    pub fn next_deadline(&self) -> Option<u64> {
        let conns = self.timers.first().map(|&(at, _)| at);
        match (conns, self.broker.next_deadline()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Tells the queues of a connection's consumers whether it takes deliveries now.
    fn push_credit(&mut self, conn: ConnId) {
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        let blocked = c.credit_blocked();
        for ch in c.channels.values_mut() {
            ch.push_credit(conn, blocked, &mut self.broker);
        }
    }

    /// The connection's socket is backed up (the client reads slower than it is sent to): no deliveries go
    /// to it until it drains. The driver decides, from the bytes it has handed to the writer and not yet written.
    pub fn set_write_blocked(&mut self, conn: ConnId, blocked: bool) {
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        let was = std::mem::replace(&mut c.write_blocked, blocked);
        if was != blocked {
            self.push_credit(conn);
            self.mark(conn);
        }
    }

    /// The frame decoder failed: the connection is closed with the code RabbitMQ uses for that error.
    pub fn decode_error(&mut self, conn: ConnId, error: &DecodeError, now: u64) {
        let (class_id, method_id) = error.class_method();
        self.fail_connection(
            conn,
            Fault::new(error.to_amqp_error(), class_id, method_id),
            now,
        );
    }

    pub fn handle_frame(&mut self, conn: ConnId, frame: Frame, now: u64) {
        self.broker.advance_time(now);
        let over_limit = match &frame {
            Frame::Method {
                channel: 0,
                method: Method::ConnectionOpen(o),
            } => self.open_refusal(conn, o.virtual_host.as_str()),
            _ => None,
        };
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        c.last_recv = now;
        let state = c.state;
        let next = match frame {
            _ if state == State::Closed => Next::Nothing,
            Frame::Heartbeat { channel: 0 } => Next::Nothing,
            Frame::Heartbeat { .. } => Next::Fail(Fault::new(
                AmqpError::frame_error("heartbeat frame on a non-zero channel".to_string()),
                0,
                0,
            )),
            Frame::Method { channel: 0, method } => {
                c.on_connection_method(method, &self.config, &self.broker, over_limit)
            }
            Frame::Header { channel: 0, .. } | Frame::Body { channel: 0, .. } => {
                Next::Fail(Fault::new(
                    AmqpError::unexpected_frame(
                        "expected method frame, got non method frame instead".to_string(),
                    ),
                    0,
                    0,
                ))
            }
            frame => match state {
                State::Open => {
                    let first_publish = !c.published
                        && matches!(
                            &frame,
                            Frame::Method {
                                method: Method::BasicPublish(_),
                                ..
                            }
                        );
                    if first_publish {
                        c.published = true;
                        if self.alarm.is_some() {
                            // This publish is handled; what follows is not read until the
                            // alarm clears.
                            self.block(conn);
                        }
                    }
                    self.channel_frame(conn, frame, now)
                }
                State::Closing | State::Closed => Next::Nothing,
                // As RabbitMQ: a channel frame during the handshake is an unexpected frame, shown raw.
                _ => Next::Fail(Fault::new(
                    AmqpError::unexpected_frame(format!(
                        "type {}, all octets = <<{}>>",
                        frame.frame_type(),
                        erlang_octets(&frame)
                    )),
                    0,
                    0,
                )),
            },
        };
        self.after(conn, next, now);
    }

    /// The refusal a connection.open to `vhost` gets for a connection limit, checked in
    /// RabbitMQ's order: the node's `connection_max`, the vhost's then the user's
    /// `max-connections`. Counting walks the open connections, and only when a limit is set.
    fn open_refusal(&self, conn: ConnId, vhost: &str) -> Option<AmqpError> {
        let user = self.conns.get(&conn)?.user.as_str();
        let opened = || {
            self.conns
                .values()
                .filter(move |c| c.id != conn && !c.vhost.is_empty())
        };
        if let Some(max) = self.config.connection_max {
            if opened().count() >= max {
                return Some(AmqpError::not_allowed(format!(
                    "connection refused: node connection limit ({max}) is reached"
                )));
            }
        }
        let limits = self.broker.limits();
        if limits.is_empty() {
            return None;
        }
        if let Some(max) = limits.limit(LimitScope::Vhost, vhost, MAX_CONNECTIONS) {
            if opened().filter(|c| c.vhost == vhost).count() as u64 >= max {
                return Some(AmqpError::not_allowed(format!(
                    "access to vhost '{vhost}' refused for user '{user}': connection limit ({max}) is reached"
                )));
            }
        }
        if let Some(max) = limits.limit(LimitScope::User, user, MAX_CONNECTIONS) {
            if opened().filter(|c| c.user == user).count() as u64 >= max {
                return Some(AmqpError::not_allowed(format!(
                    "connection refused for user '{user}': user connection limit ({max}) is reached"
                )));
            }
        }
        None
    }

    /// The refusal a channel.open gets for its user's `max-channels`, counted over all the
    /// user's connections.
    fn channel_refusal(&self, conn: ConnId) -> Option<AmqpError> {
        let limits = self.broker.limits();
        if limits.is_empty() {
            return None;
        }
        let user = self.conns.get(&conn)?.user.as_str();
        let max = limits.limit(LimitScope::User, user, MAX_CHANNELS)?;
        let open: usize = self
            .conns
            .values()
            .filter(|c| c.user == user)
            .map(|c| c.channels.len())
            .sum();
        (open as u64 >= max).then(|| {
            AmqpError::not_allowed(format!(
                "number of channels opened for user '{user}' has reached the maximum allowed user limit of ({max})"
            ))
        })
    }

    fn after(&mut self, conn: ConnId, next: Next, now: u64) {
        match next {
            Next::Nothing => {}
            Next::Fail(fault) => self.fail_connection(conn, fault, now),
            Next::Drop => self.drop_connection(conn),
        }
        self.schedule(conn);
        self.notify_cancelled();
        self.deliver_direct_replies();
        self.mark(conn);
    }

    /// Replies published to a direct reply-to address go straight to that channel's reply consumer.
    fn deliver_direct_replies(&mut self) {
        for r in std::mem::take(&mut self.direct_replies) {
            let Some(c) = self.conns.get_mut(&r.conn) else {
                continue;
            };
            if !c.is_open() {
                continue;
            }
            let frame_max = c.frame_max;
            let Some(ch) = c.channels.get_mut(&r.channel) else {
                continue;
            };
            let Some((tag, key)) = ch.reply_consumer.clone() else {
                continue;
            };
            if key != r.key || ch.closing {
                continue;
            }
            if !fit::fits(&r.message.properties, frame_max) {
                // Dropped as a reply to a consumer that is gone is (RabbitMQ drops those too):
                // sent, it would cost the requester its connection.
                tracing::warn!(conn = r.conn, channel = r.channel, frame_max, "a direct reply's content header is larger than its requester's frame_max: dropped");
                continue;
            }
            let delivery_tag = ch.take_delivery_tag();
            encode_deliver(
                &mut c.out,
                r.channel,
                &tag,
                delivery_tag,
                false,
                &r.message.exchange,
                &r.message.routing_key,
                &r.message.properties,
                &r.message.body,
                frame_max,
            );
            if !c.dirty {
                c.dirty = true;
                self.dirty.push(r.conn);
            }
        }
    }

    fn channel_frame(&mut self, conn: ConnId, frame: Frame, now: u64) -> Next {
        if let Frame::Method {
            channel,
            method: Method::ChannelOpen(_),
        } = &frame
        {
            let fresh = self
                .conns
                .get(&conn)
                .is_some_and(|c| !c.channels.contains_key(channel));
            if let Some(e) = fresh.then(|| self.channel_refusal(conn)).flatten() {
                // RabbitMQ names no method for this refusal.
                return Next::Fail(Fault::new(e, 0, 0));
            }
        }
        let Some(c) = self.conns.get_mut(&conn) else {
            return Next::Nothing;
        };
        let id = frame.channel();
        let Connection {
            channels,
            out,
            vhost,
            user,
            trusted,
            frame_max,
            confirms_pending,
            channel_max,
            write_blocked,
            out_blocked,
            holding,
            pause_changed,
            ..
        } = c;
        let conn_blocked = *write_blocked || *out_blocked;
        let Some(ch) = channels.get_mut(&id) else {
            return match frame {
                Frame::Method {
                    method: Method::ChannelOpen(_),
                    ..
                } => {
                    if channels.len() >= usize::from(*channel_max) {
                        return Next::Fail(Fault::new(
                            AmqpError::not_allowed(format!(
                                "number of channels opened ({}) has reached the negotiated channel_max ({channel_max})",
                                channels.len()
                            )),
                            0,
                            0,
                        ));
                    }
                    channels.insert(id, Box::new(Channel::new(id)));
                    send(out, id, ChannelOpenOk::default());
                    Next::Nothing
                }
                other => {
                    let (class_id, method_id) = method_ids(&other);
                    Next::Fail(Fault::new(
                        AmqpError::channel_error("expected 'channel.open'".to_string()),
                        class_id,
                        method_id,
                    ))
                }
            };
        };
        if ch.closing {
            // After the server's channel.close only close-ok (or a crossing close) is read on the channel.
            match frame {
                Frame::Method {
                    method: Method::ChannelCloseOk(_),
                    ..
                } => {
                    channels.remove(&id);
                }
                // The client's close crossed ours. As RabbitMQ does: answer it, and keep the
                // channel closing until the client's close-ok for our close arrives (a client
                // sends one; removing the channel now would make that close-ok a frame on an
                // unopened channel, a connection error). A repeated close is not answered twice.
                Frame::Method {
                    method: Method::ChannelClose(_),
                    ..
                } if !ch.peer_closed => {
                    ch.peer_closed = true;
                    send(out, id, ChannelCloseOk {});
                }
                Frame::Method {
                    method: Method::ChannelOpen(_),
                    ..
                } if ch.peer_closed => {
                    // A client that took our close as the close-ok of its own (the specification's
                    // rule for crossing closes) may open the channel number again at once.
                    **ch = Channel::new(id);
                    send(out, id, ChannelOpenOk::default());
                }
                _ => {}
            }
            return Next::Nothing;
        }
        match frame {
            Frame::Method {
                method: Method::ChannelOpen(_),
                ..
            } => {
                return Next::Fail(Fault::new(
                    AmqpError::channel_error("second 'channel.open' seen".to_string()),
                    20,
                    10,
                ))
            }
            Frame::Method {
                method: Method::ChannelClose(_),
                ..
            } => {
                ch.flush_confirms(out);
                ch.release_all(&mut self.broker);
                channels.remove(&id);
                send(out, id, ChannelCloseOk {});
                return Next::Nothing;
            }
            Frame::Method {
                method: Method::ChannelCloseOk(_),
                ..
            } => return Next::Nothing,
            _ => {}
        }
        let mut ctx = Ctx {
            broker: &mut self.broker,
            conn,
            vhost,
            user,
            trusted: *trusted,
            out,
            frame_max: *frame_max,
            now,
            config: &self.config,
            cancelled: &mut self.cancelled,
            next_id: &mut self.next_id,
            confirm_latency: &mut self.confirm_latency,
            direct_replies: &mut self.direct_replies,
            conn_blocked,
        };
        let result = ch.on_frame(frame, &mut ctx);
        if ch.waits() && !*holding {
            *holding = true;
            *pause_changed = true;
        }
        *confirms_pending = true;
        if ch.confirms_waiting() {
            self.confirm_waiters.insert((conn, id));
        }
        match result {
            Ok(()) => Next::Nothing,
            Err(fault) if fault.error.is_hard() => Next::Fail(fault),
            Err(fault) => {
                ch.flush_confirms(out);
                send(
                    out,
                    id,
                    ChannelClose {
                        reply_code: fault.error.code.code(),
                        reply_text: short_text(&fault.error.reply_text()),
                        class_id: fault.class_id,
                        method_id: fault.method_id,
                    },
                );
                ch.closing = true;
                ch.release_all(&mut self.broker);
                tracing::debug!(conn, channel = id, error = %fault.error, "channel closed by the broker");
                Next::Nothing
            }
        }
    }

    pub(crate) fn fail_connection(&mut self, conn: ConnId, fault: Fault, now: u64) {
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        tracing::debug!(conn, error = %fault.error, "closing connection on error");
        let handshaking = matches!(
            c.state,
            State::AwaitStartOk | State::AwaitTuneOk | State::AwaitOpen
        );
        c.start_close(&fault, now, &self.config);
        if handshaking && c.state == State::Closing && fault.error.code.code() == 403 {
            // authentication_failure_close: the close is sent, then the socket goes; no close-ok is awaited.
            c.close_socket = true;
        }
        self.release(conn);
        self.mark(conn);
    }

    pub(crate) fn drop_connection(&mut self, conn: ConnId) {
        self.release(conn);
        if let Some(c) = self.conns.get_mut(&conn) {
            c.state = State::Closed;
            c.close_socket = true;
        }
        self.mark(conn);
    }

    /// Unacked deliveries go back to their queues, consumers are cancelled, exclusive queues are deleted.
    fn release(&mut self, conn: ConnId) {
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        if c.released {
            return;
        }
        c.released = true;
        if c.holding {
            // Its channels are gone: what the client sends now (its close-ok) is read.
            c.holding = false;
            c.pause_changed = true;
        }
        for (_, mut ch) in std::mem::take(&mut c.channels) {
            ch.release_all(&mut self.broker);
        }
        let _deleted: Vec<QueueId> = self.broker.connection_closed(conn);
    }

    /// A channel of a connection (tests look inside).
    #[cfg(test)]
    pub(crate) fn channel(&self, conn: ConnId, channel: u16) -> Option<&Channel> {
        self.conns.get(&conn)?.channels.get(&channel).map(|c| &**c)
    }

    /// RabbitMQ before 4.3: a consumer timeout closes the consumer's channel.
    fn close_channel_on_timeout(&mut self, t: &warren_broker::ConsumerTimeout) {
        let Some(c) = self.conns.get_mut(&t.group.conn) else {
            return;
        };
        let Some(ch) = c.channels.get_mut(&t.group.channel) else {
            return;
        };
        if ch.closing {
            return;
        }
        let text = format!(
            "PRECONDITION_FAILED - delivery acknowledgement on channel {} timed out. Timeout value used: {} ms. This timeout value can be configured, see consumers doc guide to learn more",
            t.group.channel, t.timeout_ms
        );
        ch.flush_confirms(&mut c.out);
        send(
            &mut c.out,
            t.group.channel,
            ChannelClose {
                reply_code: 406,
                reply_text: short_text(&text),
                class_id: 0,
                method_id: 0,
            },
        );
        ch.closing = true;
        ch.release_all(&mut self.broker);
        tracing::info!(
            conn = t.group.conn,
            channel = t.group.channel,
            timeout_ms = t.timeout_ms,
            "consumer timeout: channel closed"
        );
        self.mark(t.group.conn);
    }

    /// Consumers whose queue went away by another way than a client's frame.
    pub(crate) fn consumers_cancelled(&mut self, keys: impl Iterator<Item = ConsumerKey>) {
        self.cancelled.extend(keys);
        self.notify_cancelled();
    }

    fn notify_cancelled(&mut self) {
        for key in std::mem::take(&mut self.cancelled) {
            let Some(c) = self.conns.get_mut(&key.conn) else {
                continue;
            };
            let notify = c.caps.consumer_cancel_notify && c.is_open();
            let Some(ch) = c.channels.get_mut(&key.channel) else {
                continue;
            };
            if ch.drop_consumer(&key.tag) && notify && !ch.closing {
                send(
                    &mut c.out,
                    key.channel,
                    BasicCancel {
                        consumer_tag: key.tag.clone(),
                        no_wait: true,
                    },
                );
                if !c.dirty {
                    c.dirty = true;
                    self.dirty.push(key.conn);
                }
            }
        }
    }

    /// Dispatch stopped at its per-call batch with deliveries still possible: poll again soon.
    pub fn needs_dispatch(&self) -> bool {
        self.broker.needs_dispatch()
    }

    /// Timers: heartbeats both ways, the handshake deadline, the close-ok deadline, the broker's clock.
    /// Only the connections whose deadline has come are looked at.
    pub fn tick(&mut self, now: u64) {
        self.broker.tick(now);
        if self.broker.cluster_node().is_some() {
            // A replicated entry's wait may have run out: its confirms are nacks, now.
            self.after_replication(now);
        }
        // Deliveries whose visibility timeout passed no longer count against their channel's
        // prefetch: the channel's queues hear of its new credit.
        for (queue, group, receipt) in self.broker.take_timed_out() {
            let found = self
                .conns
                .get_mut(&group.conn)
                .and_then(|c| c.channels.get_mut(&group.channel))
                .is_some_and(|ch| ch.delivery_timed_out(queue, receipt));
            if found {
                self.push_credit(group.conn);
                self.mark(group.conn);
            }
        }
        // Consumers cancelled by their consumer timeout: the client hears of it as RabbitMQ
        // 4.3 tells it (basic.cancel), or, with the older behaviour configured, loses the
        // channel (406).
        for t in self.broker.take_consumer_timeouts() {
            if self.config.consumer_timeout_closes_channel {
                self.close_channel_on_timeout(&t);
            } else {
                self.cancelled.push(ConsumerKey {
                    conn: t.group.conn,
                    channel: t.group.channel,
                    tag: t.tag,
                });
            }
        }
        self.notify_cancelled();
        let mut due = Vec::new();
        while let Some(&(at, id)) = self.timers.first() {
            if at > now {
                break;
            }
            self.timers.pop_first();
            if let Some(c) = self.conns.get_mut(&id) {
                c.timer = None;
            }
            due.push(id);
        }
        let mut drop = Vec::new();
        for id in due {
            let Some(c) = self.conns.get_mut(&id) else {
                continue;
            };
            match c.state {
                State::AwaitStartOk | State::AwaitTuneOk | State::AwaitOpen
                    if now.saturating_sub(c.opened_at) >= self.config.handshake_timeout_ms =>
                {
                    tracing::info!(conn = id, "handshake timeout");
                    drop.push(id);
                }
                State::Open if c.heartbeat_ms > 0 => {
                    // A connection blocked by an alarm is not read: its silence is ours.
                    let heard = c.paused || c.holding || self.recovering;
                    if heard {
                        // Counted as heard now, so its deadline moves on: left in the past, it
                        // would bring the timer straight back for as long as the alarm lasts.
                        c.last_recv = c.last_recv.max(now);
                    }
                    if !heard && now.saturating_sub(c.last_recv) >= 2 * c.heartbeat_ms {
                        tracing::info!(
                            conn = id,
                            timeout_ms = c.heartbeat_ms,
                            "missed heartbeats from client"
                        );
                        drop.push(id);
                    } else if now.saturating_sub(c.last_send) >= c.heartbeat_ms / 2 {
                        encode_heartbeat(&mut c.out);
                        // Counts as sent now: the next heartbeat is half an interval away.
                        c.last_send = now;
                        if !c.dirty {
                            c.dirty = true;
                            self.dirty.push(id);
                        }
                    }
                }
                State::Closing if now >= c.close_deadline => drop.push(id),
                _ => {}
            }
            self.schedule(id);
        }
        for id in drop {
            self.drop_connection(id);
            self.schedule(id);
        }
    }

    /// The broker is shutting down: every open connection gets connection.close 320.
    pub fn shutdown(&mut self, now: u64) {
        self.close_all(
            "broker forced connection closure with reason 'shutdown'",
            now,
        );
    }

    fn mark(&mut self, conn: ConnId) {
        if let Some(c) = self.conns.get_mut(&conn) {
            if !c.dirty {
                c.dirty = true;
                self.dirty.push(conn);
            }
        }
    }

    /// Offers ready messages to consumers: one bounded checkout per queue with work (each queue
    /// at most once per call), each delivery written to its connection's buffer. A connection
    /// whose buffer passes the backlog limit is blocked before the next queue's checkout.
    fn dispatch(&mut self, now: u64) {
        self.broker.advance_time(now);
        let mut deliveries = std::mem::take(&mut self.deliveries);
        let mut orphans: Vec<(QueueId, Receipt)> = Vec::new();
        let mut oversized: Vec<Oversized> = Vec::new();
        let mut full: Vec<ConnId> = Vec::new();
        for _ in 0..self.broker.dirty_count() {
            if !self.broker.dispatch_one(&mut deliveries) {
                break;
            }
            for d in deliveries.drain(..) {
                if let Some(conn) = self.deliver(d, &mut orphans, &mut oversized) {
                    full.push(conn);
                }
                // At once: the channel's next deliveries in this batch find it closed.
                for o in oversized.drain(..) {
                    self.refuse_oversized(o);
                }
            }
            for (queue, receipt) in orphans.drain(..) {
                self.broker.requeue(queue, receipt);
            }
            full.dedup();
            for conn in full.drain(..) {
                self.push_credit(conn);
            }
        }
        self.deliveries = deliveries;
    }

    /// Writes one delivery to its consumer's connection. A delivery whose consumer is gone goes
    /// to `orphans` (to be returned). Returns the connection if its credit must be told again:
    /// its buffer just passed the backlog limit, or the channel has a channel-wide prefetch
    /// (which each delivery uses up, and the channel's other queues must hear of before their
    /// own checkout).
    fn deliver(
        &mut self,
        d: Delivery,
        orphans: &mut Vec<(QueueId, Receipt)>,
        oversized: &mut Vec<Oversized>,
    ) -> Option<ConnId> {
        let (id, group, tag) = d.consumer?;
        let c = self.conns.get_mut(&group.conn);
        let ch = c.and_then(|c| {
            let frame_max = c.frame_max;
            let ch = c.channels.get_mut(&group.channel)?;
            Some((frame_max, &mut c.out, &mut c.dirty, &mut c.out_blocked, ch))
        });
        let Some((frame_max, out, dirty, out_blocked, ch)) = ch else {
            if !d.settled {
                orphans.push((d.queue, d.receipt));
            }
            return None;
        };
        let no_ack = match ch.consumers.get(&tag) {
            Some(consumer) if consumer.id == id => consumer.no_ack,
            _ => {
                if !d.settled {
                    orphans.push((d.queue, d.receipt));
                }
                // The queue counted the delivery against the channel's credit.
                ch.forget_sent_credit();
                return Some(group.conn);
            }
        };
        let smaller = match fit::fit(&d.message.properties, frame_max) {
            Fit::AsIs => None,
            Fit::Without(properties) => Some(properties),
            Fit::TooLarge(header_len) => {
                oversized.push(Oversized {
                    conn: group.conn,
                    channel: group.channel,
                    queue: d.queue,
                    queue_name: d.queue_name,
                    receipt: d.receipt,
                    settled: d.settled,
                    message: d.message,
                    header_len,
                    frame_max,
                });
                return None;
            }
        };
        let delivery_tag = ch.record_delivery(no_ack, d.queue, d.receipt, d.timed);
        encode_deliver(
            out,
            group.channel,
            &tag,
            delivery_tag,
            d.redelivered,
            &d.message.exchange,
            &d.message.routing_key,
            smaller.as_ref().unwrap_or(&d.message.properties),
            &d.message.body,
            frame_max,
        );
        if !*dirty {
            *dirty = true;
            self.dirty.push(group.conn);
        }
        if !*out_blocked && out.len() >= self.config.write_backlog_limit {
            *out_blocked = true;
            return Some(group.conn);
        }
        (ch.channel_prefetch != 0 && !no_ack).then_some(group.conn)
    }

    /// A delivery its consumer's connection cannot take: the message stays in its queue (back
    /// where it was, or at the tail for a no-ack consumer's, which the queue forgot) and the
    /// consumer's channel is closed with 406, so that the queue does not offer it the message
    /// again in a loop. The client hears why; the message waits for a connection with a larger
    /// frame_max, the HTTP API, or a move.
    fn refuse_oversized(&mut self, o: Oversized) {
        let Some(c) = self.conns.get_mut(&o.conn) else {
            return;
        };
        let vhost = c.vhost.clone();
        let error = AmqpError::precondition_failed(fit::too_large_text(
            &o.queue_name,
            &vhost,
            o.header_len,
            o.frame_max,
        ));
        tracing::warn!(conn = o.conn, channel = o.channel, queue = %o.queue_name, vhost = %vhost, header_len = o.header_len, frame_max = o.frame_max, "a delivery's content header is larger than its consumer's frame_max: not sent, the consumer's channel is closed");
        if let Some(ch) = c.channels.get_mut(&o.channel).filter(|ch| !ch.closing) {
            close_channel(&mut self.broker, &mut c.out, ch, &error, (0, 0));
        }
        if o.settled {
            if let Err(e) = self.broker.put_back(&vhost, &o.queue_name, o.message) {
                tracing::error!(queue = %o.queue_name, vhost = %vhost, error = %e, "an unsendable no-ack delivery could not be put back in its queue");
            }
        } else {
            self.broker.release(o.queue, o.receipt);
        }
        self.mark(o.conn);
    }

    /// Runs dispatch, then hands out everything each connection has to write, one buffer per connection.
    pub fn poll_transmit(&mut self, now: u64, out: &mut Vec<Transmit>) {
        self.dispatch(now);
        // The list is kept, emptied, for the next pass: taken whole, the first connection
        // marked after it allocated a new one (one allocation per read a worker's connection
        // makes, a quarter of the broker's per message).
        let mut dirty = std::mem::take(&mut self.dirty);
        for conn in dirty.drain(..) {
            let Some(c) = self.conns.get_mut(&conn) else {
                continue;
            };
            c.dirty = false;
            if c.confirms_pending {
                c.confirms_pending = false;
                let Connection { channels, out, .. } = c;
                for ch in channels.values_mut() {
                    ch.flush_confirms(out);
                }
            }
            let pause = std::mem::take(&mut c.pause_changed).then_some(c.paused || c.holding);
            if c.out.is_empty() && !c.close_socket && !c.frame_max_changed && pause.is_none() {
                continue;
            }
            let bytes = c.out.split().freeze();
            if c.out.capacity() > OUT_BUFFER_KEEP {
                // A burst grew the buffer: don't keep it for an idle connection.
                c.out = BytesMut::new();
            }
            if !bytes.is_empty() {
                c.last_send = now;
            }
            let frame_max = std::mem::take(&mut c.frame_max_changed).then_some(c.frame_max);
            let close = c.close_socket;
            out.push(Transmit {
                conn,
                bytes,
                frame_max,
                close,
                pause,
            });
            if close {
                self.release(conn);
                self.forget(conn);
            } else if c.out_blocked {
                // What the dispatch piled up went to the writer: deliveries may resume.
                c.out_blocked = false;
                self.push_credit(conn);
            }
        }
        // Marked meanwhile: for the next pass, in the kept list.
        dirty.append(&mut self.dirty);
        self.dirty = dirty;
    }
}

fn method_ids(frame: &Frame) -> (u16, u16) {
    match frame {
        Frame::Method { method, .. } => (method.class_id(), method.method_id()),
        _ => (0, 0),
    }
}

/// A frame's payload as Erlang prints a binary (`0,20,0,10,0`), cut short like RabbitMQ's log lines.
fn erlang_octets(frame: &Frame) -> String {
    let mut payload = BytesMut::new();
    match frame {
        Frame::Method { method, .. } => method.encode(&mut payload),
        Frame::Header { header, .. } => header.encode(&mut payload),
        Frame::Body { payload: body, .. } => payload.extend_from_slice(body),
        Frame::Heartbeat { .. } => {}
    }
    let shown: Vec<String> = payload.iter().take(32).map(u8::to_string).collect();
    let mut text = shown.join(",");
    if payload.len() > 32 {
        text.push_str(",...");
    }
    text
}
