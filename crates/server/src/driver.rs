//! The tokio driver: sockets and timers around the sans-IO [`Node`].
//!
//! The node sits behind one mutex, held only for plain computation, never across an await. Each
//! connection's reader task reads and decodes frames, then takes the lock, feeds the frames to the node and
//! writes what the node produced straight to the sockets that take it at once: a message from publisher to
//! consumer crosses no task boundary, which at moderate rates costs more than the protocol work itself. What a
//! socket does not take at once goes, in order, to that connection's writer task, which waits for the socket;
//! past a limit of unwritten bytes the node stops delivering to that connection. A timer task sleeps until the
//! node's earliest deadline (a heartbeat, a handshake or close timeout, a queue's expiry) and ticks it then:
//! an idle broker wakes only when something is due. A dispatcher task finishes deliveries that one pass left
//! pending.

use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt, WriteHalf};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch, Notify};
use tokio::task::JoinHandle;
use warren_broker::ConnId;
use warren_codec::{decode_protocol_header, FrameDecoder, PROTOCOL_HEADER};
use warren_session::manage::TlsInfo;
use warren_session::{Node, Transmit};

use crate::storage::StoreThread;

/// Read sizes adapt between these: small for quiet clients, large for streaming publishers.
const MIN_READ: usize = 4 * 1024;
const MAX_READ: usize = 128 * 1024;
/// A read buffer with less room than this (or than a 32nd of the read size, for a busy
/// client) is replaced before the next read.
const MIN_SPARE: usize = 1024;
/// A connection whose unsent output reaches this many times the backlog limit is not read until
/// it drains (deliveries already stop at the limit itself).
const UNSENT_READ_FACTOR: usize = 4;
const UNSENT_POLL: Duration = Duration::from_millis(10);
/// How long a shutdown waits for clients to answer connection.close.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);
/// After the broker's last frame (a close-ok or a close), how long the socket is still read (and
/// what arrives discarded) while waiting for the client to close it.
const CLOSE_DRAIN: Duration = Duration::from_secs(5);
/// Dispatch passes made under one lock before other tasks get a turn.
const DISPATCH_PASSES: usize = 4;

/// Bytes for a writer task; `close` ends the connection once they are written.
struct Outgoing {
    bytes: Bytes,
    close: bool,
}

/// The core's handle on one connection's socket.
struct Writer {
    tx: mpsc::UnboundedSender<Outgoing>,
    /// A plain socket, written straight from the core when it takes the bytes at once; `None`
    /// for TLS, whose records only the writer task makes.
    socket: Option<Arc<OwnedWriteHalf>>,
    frame_max: Arc<AtomicU32>,
    /// Bytes handed to the writer task and not yet written; shared so the writer task reports only when
    /// it drains below the limit, not every write.
    pending: Arc<AtomicUsize>,
    blocked: bool,
    /// True while a resource alarm holds the connection: its reader reads nothing.
    pause: watch::Sender<bool>,
}

/// The node and what the node's output needs to reach sockets.
/// The command log of `--record-commands`.
pub struct Recorder {
    file: File,
    buf: BytesMut,
}

impl Recorder {
    pub fn new(file: File) -> Self {
        Recorder {
            file,
            buf: BytesMut::new(),
        }
    }
}

struct Core {
    recorder: Option<Recorder>,
    /// The store thread's queue of write batches (persistence on).
    store: Option<std::sync::mpsc::Sender<warren_broker::WriteBatch>>,
    node: Node,
    writers: HashMap<ConnId, Writer>,
    transmits: Vec<Transmit>,
    start: Instant,
    /// Wall-clock milliseconds since the Unix epoch at `start`. The node's time is this plus
    /// the monotonic time since: expiry times written to disk stay meaningful after a
    /// restart, and x-death timestamps are real dates, while the clock never goes backwards.
    epoch_ms: u64,
    backlog_limit: usize,
    /// The number of the last batch handed to the store thread.
    last_sent: u64,
    /// The node's confirm marks as last told to [`Shared::written`]'s waiters.
    marks: (u64, u64),
    /// The broker's count of definition changes answered by the cluster, as last told to
    /// the API's waiters ([`WriteState::answered`]).
    answered: u64,
    /// This node's Raft groups, in a cluster.
    raft: Option<crate::cluster::RaftNode>,
    /// Reused buffer of the replicated queues' proposals.
    proposals: Vec<warren_broker::Proposal>,
    /// Reused buffer of the replicated queues' snapshots.
    snapshots: Vec<warren_broker::ReplicaSnapshot>,
    /// Queues that long polls (SQS ReceiveMessage) wait on (see [`Core::wake_watchers`]).
    watched: HashMap<warren_broker::QueueId, Watched>,
}

/// What became of the batches, for the management API and SQS to wait on (the node's
/// confirm marks: see `Node::confirm_marks`).
#[derive(Default)]
struct Written {
    state: Mutex<WriteState>,
    changed: Condvar,
    /// The same news for tasks (`NodeHandle::write_async`), which must not block their worker.
    tasks: Notify,
    /// Wakes the tasks whose definition change waits for the cluster when one is answered.
    cluster: Notify,
}

#[derive(Default, Clone, Copy)]
struct WriteState {
    /// Threads blocked in `NodeHandle::write`: without one, a confirm wakes nobody, and a
    /// condvar's `notify_all` is a futex call even then (one per group commit).
    blocked: usize,
    /// The last batch confirmed: on disk and, where it holds replicated entries, committed.
    upto: u64,
    /// The last batch refused: a write that failed (it may be retried; nobody was told it is
    /// on disk) or replicated entries that were lost.
    failed: u64,
    /// Definition changes the cluster has answered so far (`Broker::changes_answered`): a
    /// thread waiting for one looks again when it moves.
    answered: u64,
}

impl WriteState {
    /// [`WriteState::outcome`] for a change that found `before` sent already: one that sent
    /// nothing of its own is answered once what came before it is written, whatever was
    /// refused in it (a lost publish of someone else's must not refuse every later read of
    /// an idle node).
    fn outcome_since(self, sent: u64, before: u64) -> Option<bool> {
        if sent <= before && self.upto >= sent {
            return Some(true);
        }
        self.outcome(sent)
    }

    /// What became of batch `sent`: on disk (`true`), refused (`false`), not known yet. A
    /// refusal is looked at first: a batch whose replicated entries were lost stops holding
    /// the confirmed mark back as it is refused, so both marks pass it at once. (An earlier
    /// batch whose waiter looks only then is refused too: a retry makes a duplicate, never a
    /// loss.)
    fn outcome(self, sent: u64) -> Option<bool> {
        if sent == 0 {
            // No batch: nothing was written for it (batches are numbered from 1).
            Some(true)
        } else if self.failed >= sent {
            Some(false)
        } else if self.upto >= sent {
            Some(true)
        } else {
            None
        }
    }
}

struct Shared {
    core: Mutex<Core>,
    /// The node stopped taking changes: what it held was counted and its store let go
    /// (the end of [`serve`]); a change now would be answered without reaching the disk.
    closed: AtomicBool,
    /// Woken when a flush leaves deliveries pending.
    dispatch: Notify,
    /// Wakes the timer task when the node's earliest deadline moved before the one it sleeps until.
    timer: Notify,
    /// The deadline (node ms) the timer task sleeps until; `u64::MAX` = none.
    armed: AtomicU64,
    written: Written,
    /// How long an API change waits for its store write before it is refused.
    write_wait: Duration,
    /// Turns true, under the node's lock, in the step that ends recovery: the management API
    /// refuses every request until then (see [`NodeHandle::recovering`]).
    recovered: AtomicBool,
    /// Queues recovery still has to bring back, for the API's refusal.
    recovery_left: AtomicUsize,
    /// Turns true just after `recovered`, for waiting on it.
    recovered_rx: watch::Receiver<bool>,
    /// Since when (node ms) this node is in maintenance mode, 0 when it is not: new client
    /// connections are turned away at once meanwhile.
    draining_since: AtomicU64,
    /// The node asks to join a cluster and does not hold its definitions yet: a client would
    /// find no queue (an unroutable publish is confirmed and dropped), so none is taken.
    joining: AtomicBool,
    alarms: Mutex<Alarms>,
    /// In a cluster, the figures each peer sent last (its `/api/nodes` entry, JSON) and when.
    peer_figures: Mutex<std::collections::BTreeMap<u64, (Instant, Bytes)>>,
    /// Restarts one of the shovels this node runs (vhost, name), for a peer that was asked.
    shovel_restarter: std::sync::OnceLock<ShovelRestarter>,
}

type ShovelRestarter = Box<dyn Fn(&str, &str) -> bool + Send + Sync>;

/// What the resource alarms are made of: the monitor's measures, the store's writes, and the
/// cluster's other nodes' own alarms.
#[derive(Default)]
struct Alarms {
    pressure: Option<crate::alarms::Pressure>,
    /// The store's writes fail: a disk alarm, whatever the free space says.
    store_failing: bool,
    /// Each peer's own memory and disk alarms, as its figures said last, and when.
    peers: std::collections::BTreeMap<u64, (bool, bool, Instant)>,
}

impl Alarms {
    /// This node's own alarms (memory, disk): what its `/api/nodes` entry says.
    fn local(&self) -> (bool, bool) {
        let p = self.pressure;
        (
            p.is_some_and(|p| p.memory),
            p.is_some_and(|p| p.disk) || self.store_failing,
        )
    }

    /// The alarms this node's publishers are blocked by: its own, and, as RabbitMQ's are
    /// cluster-wide, every running peer's (as long as its figures are fresh).
    fn in_force(&self) -> (bool, bool) {
        let (mut memory, mut disk) = self.local();
        for (m, d, at) in self.peers.values() {
            if at.elapsed() < crate::http::FIGURES_STALE {
                memory |= *m;
                disk |= *d;
            }
        }
        (memory, disk)
    }
}

impl Shared {
    /// This node's own alarms (memory, disk), not the cluster's.
    fn local_alarms(&self) -> (bool, bool) {
        self.alarms
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .local()
    }

    /// A peer's figures said its own alarms (or it went down: `None`).
    fn peer_alarms(&self, peer: u64, alarms: Option<(bool, bool)>) {
        let changed = {
            let mut a = self.alarms.lock().unwrap_or_else(|p| p.into_inner());
            let before = a.peers.get(&peer).map(|(m, d, _)| (*m, *d));
            match alarms {
                Some((m, d)) => {
                    a.peers.insert(peer, (m, d, Instant::now()));
                }
                None => {
                    a.peers.remove(&peer);
                }
            }
            before != alarms
        };
        if changed {
            if let Some((memory, disk)) = alarms.filter(|(m, d)| *m || *d) {
                tracing::warn!(
                    peer,
                    memory,
                    disk,
                    "resource alarm on a peer node: this node's publishers are blocked too"
                );
            }
            self.apply_alarms();
        }
    }

    /// Tells the node the alarms as they stand now.
    fn apply_alarms(&self) {
        let (memory, disk, paging) = {
            let a = self.alarms.lock().unwrap_or_else(|p| p.into_inner());
            let (memory, disk) = a.in_force();
            (memory, disk, a.pressure.map(|p| p.paging))
        };
        self.with_node(|node, now| {
            node.set_alarms(memory, disk, now);
            if let Some(paging) = paging {
                node.set_paging(paging);
            }
        });
    }
}

/// A peer's own memory and disk alarms, from the figures it sends (its `/api/nodes` entry).
fn figures_alarms(data: &[u8]) -> Option<(bool, bool)> {
    let v: serde_json::Value = serde_json::from_slice(data).ok()?;
    let node = v.get("node")?;
    Some((
        node.get("mem_alarm")?.as_bool()?,
        node.get("disk_free_alarm")?.as_bool()?,
    ))
}

/// Ends the process now with `code`, from any thread: no exit handlers and no static
/// destructors, which would run while the store's and the runtime's threads still work (and
/// could crash on the way out, losing the code). What is on disk is as after a kill -9, which
/// Warren recovers from; the log is written to stderr synchronously, so nothing said is lost.
fn exit_at_once(code: i32) -> ! {
    // SAFETY: `_exit` takes no pointer and does not return; skipping destructors is the point.
    unsafe { libc::_exit(code) }
}

/// The Raft thread's reports: committed entries applied, leader changes, forwarded publishes.
struct RaftReports {
    shared: Arc<Shared>,
    /// Where a deep queue read from a snapshot sends its contents as it is decoded.
    away: Option<warren_broker::AwayContext>,
}

impl crate::cluster::RaftEvents for RaftReports {
    fn log_failed(&self, error: &str) {
        // Serving on would leave this node's clients waiting for ever: its replicated queues'
        // confirms and deliveries, and the publishes it forwards, all go through the Raft
        // thread. What is on disk is consistent (as after a kill -9): stop, so that clients
        // reconnect to the other nodes, which elect new leaders, and a restart (once the disk
        // has room again) reads the log back and catches up.
        tracing::error!(%error, "the raft log cannot be written: stopping the broker");
        eprintln!("warren: the raft log cannot be written ({error}): stopping; free disk space and start the node again");
        exit_at_once(70);
    }

    fn snapshots(
        &self,
        snapshots: Vec<(
            warren_broker::GroupId,
            crate::cluster::StoredSnapshot,
            Option<crate::cluster::Prepared>,
        )>,
    ) {
        // Read before the node is taken (a third of a second per GiB of a deep queue's
        // snapshot; a leader's large one was read on the snapshot writer's thread), and what
        // they replace let go after: the node's clients wait for neither.
        let decoded: Vec<_> = snapshots
            .into_iter()
            .map(|(group, s, prepared)| {
                let d = match prepared.map(|p| p.downcast::<warren_broker::DecodedSnapshot>()) {
                    Some(Ok(d)) => *d,
                    _ => warren_broker::DecodedSnapshot::decode_with(
                        group.0,
                        s.data,
                        self.away.as_ref(),
                    ),
                };
                (group, s.meta, d)
            })
            .collect();
        let replaced = self.shared.with_node(|node, now| {
            decoded
                .into_iter()
                .filter_map(|(group, meta, d)| {
                    node.install_decoded(group.0, meta.index, meta.term, d, now)
                })
                .collect::<Vec<_>>()
        });
        drop(replaced);
    }

    fn preparer(&self) -> Option<crate::cluster::Preparer> {
        let away = self.away.clone();
        Some(std::sync::Arc::new(
            move |group: warren_broker::GroupId, data| {
                Box::new(warren_broker::DecodedSnapshot::decode_with(
                    group.0,
                    data,
                    away.as_ref(),
                )) as crate::cluster::Prepared
            },
        ))
    }

    fn committed(&self, entries: Vec<warren_broker::Committed>) {
        self.shared
            .with_node(|node, now| node.replicated(&entries, now));
    }

    fn draining(&self, changes: Vec<(u64, bool)>) {
        self.shared.with_node(|node, _| {
            for (peer, on) in changes {
                tracing::info!(peer, draining = on, "peer node maintenance mode");
                node.broker_mut().set_peer_draining(peer, on);
            }
        });
    }

    fn peers(&self, changes: Vec<(u64, bool)>) {
        {
            // What a peer sent before it went down is not what it will say after a restart.
            let mut figures = self
                .shared
                .peer_figures
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            for (peer, up) in &changes {
                if !up {
                    figures.remove(peer);
                }
            }
        }
        for (peer, up) in &changes {
            if !up {
                self.shared.peer_alarms(*peer, None);
            }
        }
        self.shared.with_node(|node, now| {
            for (peer, up) in changes {
                node.set_peer_up(peer, up, now);
            }
        });
    }

    fn leaders(
        &self,
        changes: Vec<(warren_broker::GroupId, Option<u64>, u64)>,
        refused: Vec<crate::cluster::Refused>,
    ) {
        self.shared.with_node(|node, now| {
            for (group, leader, term) in changes {
                tracing::debug!(group = group.0, ?leader, term, "raft group leader");
                node.set_leader(group.0, leader, term, now);
            }
            // Held through a leadership transfer, a publish goes on to the new leader; otherwise
            // the queue ran ahead with it and falls back, nacking what waited (a leader change,
            // told just above, or an entry too large while this node still leads).
            for (group, data, leader) in refused {
                tracing::debug!(group = group.0, ?leader, "proposal refused by raft");
                node.proposal_refused(group.0, &data, leader, now);
            }
        });
    }

    fn snapshots_wanted(&self, groups: Vec<warren_broker::GroupId>) {
        let groups: Vec<u64> = groups.into_iter().map(|g| g.0).collect();
        self.shared
            .with_node(|node, _| node.broker_mut().want_snapshots(&groups));
    }

    fn forwarded(&self, mut entries: Vec<(u64, crate::cluster::Forward)>) {
        let joins: Vec<(u64, String, u64)> = entries
            .iter()
            .filter(|(_, f)| f.group == crate::cluster::JOIN_REQUEST)
            .filter_map(|(from, f)| {
                let text = std::str::from_utf8(&f.data).ok()?;
                let (addr, level) = text.split_once('\0').unwrap_or((text, "0"));
                let level = level.parse().unwrap_or(0);
                crate::cluster::PeerAddr::parse(addr).map(|_| (*from, addr.to_owned(), level))
            })
            .collect();
        entries.retain(|(_, f)| f.group != crate::cluster::JOIN_REQUEST);
        if !joins.is_empty() {
            self.shared.with_node(|node, _| {
                for (from, addr, level) in joins {
                    node.broker_mut().request_join(from, &addr, level);
                }
            });
        }
        let applied: Vec<(u64, u64)> = entries
            .iter()
            .filter(|(_, f)| f.group == crate::cluster::META_APPLIED)
            .filter_map(|(from, f)| {
                let index = <[u8; 8]>::try_from(&f.data[..]).ok()?;
                Some((*from, u64::from_be_bytes(index)))
            })
            .collect();
        entries.retain(|(_, f)| f.group != crate::cluster::META_APPLIED);
        if !applied.is_empty() {
            self.shared.with_node(|node, now| {
                for (from, index) in applied {
                    node.peer_meta_applied(from, index, now);
                }
            });
        }
        entries.retain(|(from, f)| {
            if f.group == crate::cluster::SHOVEL_RESTART {
                let restarted = shovel_restart_of(&f.data).is_some_and(|(vhost, name)| {
                    self.shared
                        .shovel_restarter
                        .get()
                        .is_some_and(|restart| restart(&vhost, &name))
                });
                tracing::info!(from, restarted, "shovel restart asked by a peer");
                return false;
            }
            if f.group != crate::cluster::NODE_FIGURES {
                return true;
            }
            self.shared
                .peer_figures
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(*from, (Instant::now(), f.data.clone()));
            self.shared.peer_alarms(*from, figures_alarms(&f.data));
            false
        });
        if entries.is_empty() {
            return;
        }
        self.shared.with_node(|node, now| {
            for (_, f) in entries {
                node.forwarded(f.group.0, &f.data, now);
            }
        });
    }
}

/// How often a node that asks to join asks again, until the cluster's metadata names it.
const JOIN_ASK_EVERY: Duration = Duration::from_secs(1);

/// A node started with `--cluster-join`: asks every node of its list to add it (whichever
/// runs, and whichever is reached first, asks the cluster through the metadata log), until
/// the metadata it installed names it among the cluster's nodes.
async fn ask_to_join(
    shared: Arc<Shared>,
    raft: crate::cluster::RaftNode,
    addr: String,
    peers: Vec<u64>,
) {
    let mut every = tokio::time::interval(JOIN_ASK_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut asked = 0u64;
    loop {
        every.tick().await;
        if shared.with_node(|node, _| node.broker().joined()) {
            shared.joining.store(false, Ordering::Release);
            tracing::info!(node = raft.node(), "joined the cluster: taking clients");
            return;
        }
        if asked.is_multiple_of(10) {
            tracing::info!(node = raft.node(), address = %addr, ?peers, "asking the cluster to add this node");
        }
        asked += 1;
        // Its address, then its feature level: the cluster's level stays known meanwhile.
        let data = format!("{addr}\0{}", warren_broker::FEATURE_LEVEL).into_bytes();
        for peer in &peers {
            raft.forward(*peer, crate::cluster::JOIN_REQUEST, data.clone());
        }
    }
}

/// A [`crate::cluster::SHOVEL_RESTART`] forward: the vhost's length first, as a vhost name may
/// hold any byte.
fn shovel_restart_data(vhost: &str, name: &str) -> Vec<u8> {
    let mut data = Vec::with_capacity(4 + vhost.len() + name.len());
    data.extend_from_slice(&(vhost.len() as u32).to_be_bytes());
    data.extend_from_slice(vhost.as_bytes());
    data.extend_from_slice(name.as_bytes());
    data
}

/// The vhost and name a [`crate::cluster::SHOVEL_RESTART`] forward carries (the vhost's length
/// as 4 bytes, the vhost, the name); `None` for one that does not read so.
fn shovel_restart_of(data: &[u8]) -> Option<(String, String)> {
    let (len, rest) = data.split_first_chunk::<4>()?;
    let len = u32::from_be_bytes(*len) as usize;
    let vhost = std::str::from_utf8(rest.get(..len)?).ok()?;
    let name = std::str::from_utf8(rest.get(len..)?).ok()?;
    Some((vhost.to_owned(), name.to_owned()))
}

/// The store thread's reports, turned into confirms and the disk alarm.
struct StoreReports(Arc<Shared>);

impl crate::storage::StoreEvents for StoreReports {
    fn written(&self, last: u64, ok: bool) {
        // What the node then confirms (or refuses) reaches the waiters in `with_core`.
        self.0
            .with_node(|node, now| node.writes_done(last, ok, now));
    }

    fn failing(&self, on: bool) {
        self.0
            .alarms
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .store_failing = on;
        self.0.apply_alarms();
    }
}

impl Shared {
    /// This node is in maintenance mode.
    fn is_draining(&self) -> bool {
        self.draining_since.load(Ordering::Acquire) != 0
    }

    /// New client connections are closed at once: maintenance mode, or joining a cluster.
    fn turns_clients_away(&self) -> bool {
        self.is_draining() || self.joining.load(Ordering::Acquire)
    }

    fn lock(&self) -> MutexGuard<'_, Core> {
        // A panic while holding the lock is a bug elsewhere; the node's state is still consistent enough
        // to keep serving the other connections, so a poisoned lock is taken over rather than propagated.
        self.core
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Runs `f` on the node, then writes out whatever the node produced.
    fn with_node<R>(&self, f: impl FnOnce(&mut Node, u64) -> R) -> R {
        self.with_core(|core, now| f(&mut core.node, now))
    }

    fn with_core<R>(&self, f: impl FnOnce(&mut Core, u64) -> R) -> R {
        let (r, more, next) = {
            let mut core = self.lock();
            let now = core.now();
            // The broker's clock moves at passes: a change made here after a quiet spell
            // would start its waits at the last pass's time.
            core.node.advance_time(now);
            let r = f(&mut core, now);
            let more = core.flush(DISPATCH_PASSES);
            core.wake_watchers();
            let marks = core.node.confirm_marks();
            let answered = core.node.broker().changes_answered();
            if (marks, answered) != (core.marks, core.answered) {
                // A batch is confirmed (or refused) once the node says so: on disk, and, with
                // replicated queues in it, once a majority has their entries; a definition
                // change, once the cluster has it.
                let mut state = self.written.state.lock().unwrap_or_else(|p| p.into_inner());
                state.upto = state.upto.max(marks.0);
                state.failed = state.failed.max(marks.1);
                state.answered = answered;
                if state.blocked > 0 {
                    self.written.changed.notify_all();
                }
                if marks != core.marks {
                    self.written.tasks.notify_waiters();
                }
                if answered != core.answered {
                    self.written.cluster.notify_waiters();
                }
                core.marks = marks;
                core.answered = answered;
            }
            (r, more, core.node.next_deadline())
        };
        if more {
            self.dispatch.notify_one();
        }
        if next.is_some_and(|at| at < self.armed.load(Ordering::Acquire)) {
            self.timer.notify_one();
        }
        r
    }
}

/// The node, for the management API and metrics: reads take the lock only to copy what they
/// need; changes go through the same path as a client's frames (flushed, persisted).
#[derive(Clone)]
pub struct NodeHandle(Arc<Shared>);

impl NodeHandle {
    /// This node's cluster transport counters, in a cluster.
    /// This node's handle on its Raft thread, in a cluster.
    pub fn raft(&self) -> Option<crate::cluster::RaftNode> {
        self.0.lock().raft.clone()
    }

    pub fn cluster_stats(&self) -> Option<crate::cluster::ClusterStats> {
        self.0.lock().raft.as_ref().map(|r| r.stats())
    }

    /// Maintenance mode on or off (`warren ctl drain` / `revive`): new AMQP connections are
    /// turned away from now on (or taken again), every open one is closed with RabbitMQ's
    /// text, and in a cluster this node hands its leaderships away. The number of
    /// connections closed.
    pub fn set_draining(&self, on: bool) -> usize {
        // Nothing to store (maintenance mode ends with the process), so no wait for the
        // store and no refusal while recovering; the flag changes under the node's lock.
        let shared = &self.0;
        shared.with_node(|n, now| {
            let since = if on { now.max(1) } else { 0 };
            if !on || !shared.is_draining() {
                shared.draining_since.store(since, Ordering::Release);
            }
            n.set_draining(on, now)
        })
    }

    /// How long this node has been in maintenance mode (`warren ctl drain`), if it is.
    pub fn draining_for(&self) -> Option<Duration> {
        let since = self.0.draining_since.load(Ordering::Acquire);
        (since != 0).then(|| Duration::from_millis(self.read(|_, now| now.saturating_sub(since))))
    }

    /// The figures peer `node` sent last (its own `/api/nodes` entry, JSON) and how long ago.
    pub fn peer_figures(&self, node: u64) -> Option<(Duration, Bytes)> {
        let figures = self
            .0
            .peer_figures
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        figures
            .get(&node)
            .map(|(at, data)| (at.elapsed(), data.clone()))
    }

    /// How this node restarts a shovel it runs when a peer's API was asked to (set once).
    pub fn set_shovel_restarter(
        &self,
        restart: impl Fn(&str, &str) -> bool + Send + Sync + 'static,
    ) {
        let _ = self.0.shovel_restarter.set(Box::new(restart));
    }

    /// Asks `peer`, which runs the shovel, to restart it (at most once: lost with the link).
    pub fn restart_shovel_on(&self, peer: u64, vhost: &str, name: &str) {
        let Some(raft) = self.raft() else { return };
        raft.forward(
            peer,
            crate::cluster::SHOVEL_RESTART,
            shovel_restart_data(vhost, name),
        );
    }

    /// This node's own resource alarms (memory, disk), without its peers' that block its
    /// publishers too.
    pub fn local_alarms(&self) -> (bool, bool) {
        self.0.local_alarms()
    }

    /// Sends this node's figures to every peer (a forward to [`crate::cluster::NODE_FIGURES`],
    /// which a node without it drops as a forward to a group it does not have).
    pub fn share_figures(&self, data: &[u8]) {
        let Some(raft) = self.raft() else { return };
        let peers = self.read(|n, _| n.broker().peers_running());
        for (peer, _) in peers.into_iter().filter(|(_, up)| *up) {
            raft.forward(peer, crate::cluster::NODE_FIGURES, data.to_vec());
        }
    }

    /// This node is in maintenance mode.
    pub fn is_draining(&self) -> bool {
        self.0.is_draining()
    }

    /// Whether the node still asks a cluster to add it (`--cluster-join`, until the metadata
    /// it installed names it).
    pub fn is_joining(&self) -> bool {
        self.0.joining.load(Ordering::Acquire)
    }

    /// Reads the node (and its time, ms since the epoch) under the lock; keep `f` short.
    pub fn read<R>(&self, f: impl FnOnce(&Node, u64) -> R) -> R {
        let core = self.0.lock();
        let now = core.now();
        f(&core.node, now)
    }

    /// While the store is still bringing queues back, the number of queues left: until then
    /// store keys, shared bodies and message ids are not restored, and any change (or a read
    /// of a half-restored queue) would be wrong. Once `None`, it stays so.
    pub fn recovering(&self) -> Option<usize> {
        if self.0.recovered.load(Ordering::Acquire) {
            None
        } else {
            Some(self.0.recovery_left.load(Ordering::Relaxed))
        }
    }

    /// [`NodeHandle::recovering`], after waiting up to `most` for recovery to end: a
    /// request that comes in its last moments (or just after a start with nothing to
    /// restore, which still takes a step) is served rather than refused.
    pub async fn recovering_after(&self, most: Duration) -> Option<usize> {
        self.recovering()?;
        let mut done = self.0.recovered_rx.clone();
        // A closed channel means recovery ended without turning it (the process is exiting).
        let _ = tokio::time::timeout(most, done.wait_for(|d| *d)).await;
        self.recovering()
    }

    /// Watches `queue` for a ready message: [`QueueWatch::notify`] is woken after any change
    /// that leaves one there (create its `notified()` future before looking at the queue, so
    /// that a message arriving in between is not missed). Stops watching when dropped.
    pub fn watch_queue(&self, queue: warren_broker::QueueId) -> QueueWatch {
        let mut core = self.0.lock();
        let seen = takeable(core.node.broker(), queue);
        let entry = core.watched.entry(queue).or_insert_with(|| Watched {
            notify: Arc::new(Notify::new()),
            waiters: 0,
            seen,
        });
        entry.waiters += 1;
        QueueWatch {
            notify: entry.notify.clone(),
            queue,
            shared: self.0.clone(),
        }
    }

    /// Changes the node as [`NodeHandle::write`] does, without waiting for the store: for
    /// changes a crash may undo without breaking a promise, as an AMQP ack (an acked message
    /// may come back after a crash: at least once). Their writes go in the next batch.
    pub fn change<R>(&self, f: impl FnOnce(&mut Node, u64) -> R) -> Result<R, WriteError> {
        let shared = &self.0;
        shared.with_node(|node, now| {
            // Under the lock that recovery's last step holds: no change slips in before it;
            // and under the one the stop's count holds: none slips in after it.
            if shared.closed.load(Ordering::Acquire) {
                Err(WriteError::Stopping)
            } else if shared.recovered.load(Ordering::Acquire) {
                Ok(f(node, now))
            } else {
                Err(WriteError::Recovering)
            }
        })
    }

    /// As [`NodeHandle::write`], for a task: it waits for the store (and the cluster)
    /// without blocking its worker thread (`write` hands the worker's other tasks to another thread while it
    /// waits, a thread switch per call).
    pub async fn write_async<R>(
        &self,
        f: impl FnOnce(&mut Node, u64) -> R,
    ) -> Result<R, WriteError> {
        let before = self.last_sent();
        let (r, ticket) = self.change_for_cluster(f)?;
        self.on_disk(before).await?;
        if let Some(ticket) = ticket {
            let deadline = tokio::time::Instant::now() + CLUSTER_WAIT;
            loop {
                let news = self.0.written.cluster.notified();
                tokio::pin!(news);
                // Registered before the look: an answer after it wakes this wait.
                news.as_mut().enable();
                if !self.cluster_waits(ticket)
                    || tokio::time::timeout_at(deadline, news).await.is_err()
                {
                    break;
                }
            }
        }
        Ok(r)
    }

    /// As [`NodeHandle::change`], noting whether the change went to the cluster's metadata
    /// log: its ticket then, for the caller to wait until every running node has it (as an
    /// AMQP client's bind or declare waits), so that a client of another node told of the
    /// change sees it there.
    fn change_for_cluster<R>(
        &self,
        f: impl FnOnce(&mut Node, u64) -> R,
    ) -> Result<(R, Option<u64>), WriteError> {
        self.change(|node, now| {
            let mark = node.broker().change_mark();
            let r = f(node, now);
            // No connection has this id (ids start at 1), so no channel is answered.
            let ticket = node
                .broker_mut()
                .wait_for_cluster(mark, warren_session::manage::API_CONN);
            (r, ticket)
        })
    }

    /// Whether the change `ticket` still waits for the cluster's other running nodes (the
    /// broker gives up waiting 2 s after the log applied it here, 5 s after it was made at
    /// the latest, as for an AMQP client).
    fn cluster_waits(&self, ticket: u64) -> bool {
        self.0.lock().node.broker().change_waiting(ticket)
    }

    /// The last batch the node has handed to the store (for [`NodeHandle::on_disk`]).
    pub fn last_sent(&self) -> u64 {
        self.0.lock().last_sent
    }

    /// Waits, as a task, until what the node has sent to the store so far is on disk (and
    /// committed, for replicated entries); an error if it was refused or the wait ran out.
    /// `before`: what was sent before the change being answered was made
    /// ([`NodeHandle::last_sent`]).
    pub async fn on_disk(&self, before: u64) -> Result<(), WriteError> {
        let shared = &self.0;
        let sent = shared.lock().last_sent;
        let deadline = tokio::time::Instant::now() + shared.write_wait;
        loop {
            let news = shared.written.tasks.notified();
            tokio::pin!(news);
            // Registered before the look: a mark set after it wakes this wait.
            news.as_mut().enable();
            let state = *shared
                .written
                .state
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            match state.outcome_since(sent, before) {
                Some(true) => return Ok(()),
                Some(false) => return Err(self.refused(sent, true)),
                None => {}
            }
            if tokio::time::timeout_at(deadline, news).await.is_err() {
                return Err(self.refused(sent, false));
            }
        }
    }

    /// Changes the node; what it produced is written out as after a client's frame, and
    /// the call returns once the store has it on disk (as RabbitMQ answers an API change
    /// once its database has it) and, for a definition change in a cluster, once every
    /// running node has applied it (a round trip; at most [`CLUSTER_WAIT`] when a node is
    /// cut off). It blocks its thread: never call it from a connection's task (a
    /// connection thread's other connections would wait with it). Refused, without running `f`, while the node recovers; an
    /// error if the store's write fails or does not end within the wait: the change is made
    /// in memory, but nobody may be told it is durable.
    pub fn write<R>(&self, f: impl FnOnce(&mut Node, u64) -> R) -> Result<R, WriteError> {
        let before = self.last_sent();
        let (r, ticket) = self.change_for_cluster(f)?;
        self.wait_on_disk(before)?;
        if let Some(ticket) = ticket {
            // A round trip to the other nodes: milliseconds.
            let deadline = Instant::now() + CLUSTER_WAIT;
            blocking(|| loop {
                // Read before the look, so an answer between the two ends the wait below.
                let seen = self.write_state().answered;
                let left = deadline.saturating_duration_since(Instant::now());
                if !self.cluster_waits(ticket) || left.is_zero() {
                    break;
                }
                self.wait_for_state(left, |s| s.answered != seen);
            });
        }
        Ok(r)
    }

    fn write_state(&self) -> MutexGuard<'_, WriteState> {
        self.0
            .written
            .state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Blocks until `done` holds for the write state, or `timeout` passes; returns the state.
    /// Counted in `blocked` meanwhile, so that changes of the state wake it.
    fn wait_for_state(
        &self,
        timeout: Duration,
        mut done: impl FnMut(&WriteState) -> bool,
    ) -> WriteState {
        let mut state = self.write_state();
        state.blocked += 1;
        let (mut state, _) = self
            .0
            .written
            .changed
            .wait_timeout_while(state, timeout, |s| !done(s))
            .unwrap_or_else(|p| p.into_inner());
        state.blocked -= 1;
        *state
    }

    /// Blocks until what the node has sent to the store so far is on disk (as
    /// [`NodeHandle::on_disk`], for a thread).
    fn wait_on_disk(&self, before: u64) -> Result<(), WriteError> {
        let sent = self.0.lock().last_sent;
        if let Some(outcome) = self.write_state().outcome_since(sent, before) {
            return if outcome {
                Ok(())
            } else {
                Err(self.refused(sent, true))
            };
        }
        // A few milliseconds (one group commit). The state's lock is taken inside: held across
        // `block_in_place`'s hand-over of the worker's tasks, it would stall every group
        // commit's report, and the node's lock with it (`with_core` takes it for the marks).
        let outcome = blocking(|| {
            self.wait_for_state(self.0.write_wait, |s| {
                s.outcome_since(sent, before).is_some()
            })
        });
        match outcome.outcome_since(sent, before) {
            Some(true) => Ok(()),
            Some(false) => Err(self.refused(sent, true)),
            None => Err(self.refused(sent, false)),
        }
    }

    /// The answer to a quorum queue declaration that waits for the cluster's metadata log
    /// (`Declared::Waiting`), as a task. The broker answers every declaration within
    /// `DECLARE_WAIT_MS` (with an error once that wait ran out); this wait ends a little
    /// later in any case.
    pub async fn declared(
        &self,
        ticket: u64,
    ) -> Result<warren_broker::QueueDeclared, warren_codec::AmqpError> {
        let shared = &self.0;
        let wait = Duration::from_millis(warren_broker::DECLARE_WAIT_MS + 5_000);
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let news = shared.written.tasks.notified();
            tokio::pin!(news);
            news.as_mut().enable();
            if let Some(answer) = shared.lock().node.take_api_declare(ticket) {
                return answer;
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(warren_codec::AmqpError::internal_error(
                    "the cluster did not answer the queue's declaration",
                ));
            }
            // The log's entry is written to the store when it is applied, so the store's
            // news comes with it; a short timeout covers an answer without a write.
            let _ = tokio::time::timeout(Duration::from_millis(20), news).await;
        }
    }

    /// The error for a change whose batch was refused (`failed`) or not written in time.
    fn refused(&self, sent: u64, failed: bool) -> WriteError {
        let error = if failed {
            WriteError::Failed
        } else {
            WriteError::TimedOut(self.0.write_wait)
        };
        tracing::warn!(batch = sent, error = %error, "an API change is not on disk: refusing to confirm it");
        error
    }
}

/// A queue long polls wait on.
struct Watched {
    notify: Arc<Notify>,
    /// How many [`QueueWatch`]es hold it.
    waiters: usize,
    /// [`takeable`] at the last look.
    seen: usize,
}

/// Ready messages a get could take now, near enough: those waiting for a retry's back-off
/// are left out (a group's messages behind one in flight are not told apart).
fn takeable(broker: &warren_broker::Broker, queue: warren_broker::QueueId) -> usize {
    broker
        .machine(queue)
        .map_or(0, |m| m.ready_count().saturating_sub(m.retrying_count()))
}

/// Runs `f`, which blocks its thread: on a worker of a multi-thread runtime through
/// `block_in_place`, which hands the worker's other tasks to another worker (a current-thread
/// runtime, a connection thread's, has nowhere to move them, and `block_in_place` would
/// panic there).
fn blocking<R>(f: impl FnOnce() -> R) -> R {
    let shared_runtime = tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
    if shared_runtime {
        tokio::task::block_in_place(f)
    } else {
        f()
    }
}

/// How long an API change waits for every running node to have it, at most: past the
/// broker's own limit, after which it answers anyway.
const CLUSTER_WAIT: Duration = Duration::from_millis(warren_broker::CHANGE_WAIT_MS + 500);

/// A long poll's watch of one queue (see [`NodeHandle::watch_queue`]).
pub struct QueueWatch {
    pub notify: Arc<Notify>,
    queue: warren_broker::QueueId,
    shared: Arc<Shared>,
}

impl Drop for QueueWatch {
    fn drop(&mut self) {
        let mut core = self.shared.lock();
        if let std::collections::hash_map::Entry::Occupied(mut e) = core.watched.entry(self.queue) {
            e.get_mut().waiters -= 1;
            if e.get().waiters == 0 {
                e.remove();
            }
        }
    }
}

/// Why [`NodeHandle::write`] cannot say its change is on disk, or did not make it.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error("the node is still recovering its queues")]
    Recovering,
    #[error("the node is stopping")]
    Stopping,
    #[error("the store's write failed")]
    Failed,
    #[error("the store did not finish the write within {0:?}")]
    TimedOut(Duration),
}

/// How long an API change waits for its store write before it is refused: far beyond a
/// healthy fsync, short of an HTTP client's patience.
pub const WRITE_WAIT: Duration = Duration::from_secs(10);

/// Milliseconds since the Unix epoch (0 if the system clock is set before it).
fn wall_clock_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl Core {
    /// Wakes the long polls of every watched queue that has more messages a get can take
    /// than at the last look (publishes, returns, timeouts and delays all end in a change
    /// made through [`Shared::with_core`], so looking here misses none). Waking on more,
    /// not on any, keeps a poll that found nothing from being woken by its own look, or
    /// again and again by messages it cannot take. With nobody watching it costs one
    /// `is_empty`.
    fn wake_watchers(&mut self) {
        if self.watched.is_empty() {
            return;
        }
        let broker = self.node.broker();
        for (queue, w) in self.watched.iter_mut() {
            let now = takeable(broker, *queue);
            if now > w.seen {
                w.notify.notify_waiters();
            }
            w.seen = now;
        }
    }

    fn now(&self) -> u64 {
        let elapsed = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.epoch_ms.saturating_add(elapsed)
    }

    /// Hands each connection's output to its socket; returns true if deliveries are still pending.
    fn flush(&mut self, passes: usize) -> bool {
        let now = self.now();
        for _ in 0..passes {
            self.node.poll_transmit(now, &mut self.transmits);
            // Before any client sees an effect of these commands, they are in the log.
            self.record();
            self.persist(now);
            self.replicate();
            // Taken out for `send` and put back emptied: the next pass pushes into the same
            // allocation (taken whole, every pass that wrote allocated a new list).
            let mut transmits = std::mem::take(&mut self.transmits);
            for t in transmits.drain(..) {
                self.send(t);
            }
            self.transmits = transmits;
            if !self.node.needs_dispatch() {
                return false;
            }
        }
        true
    }

    /// Hands the store writes made since the last call to the store thread.
    fn persist(&mut self, now: u64) {
        let Some(tx) = self.store.as_ref() else {
            return;
        };
        if let Some(batch) = self.node.take_writes() {
            self.last_sent = batch.number;
            // A batch with nothing to write only numbers confirms that wait for replicated
            // entries (their group's log is their disk). Once every batch before it is
            // written it is written too: the store thread need not wake for it, nor the node
            // take its lock again for the report (two thread switches and a lock a pass of a
            // quorum queue's publishes, on a machine where a switch costs more than the pass).
            // Behind a batch still being written, or a failing write, it queues as any other.
            if batch.ops.is_empty() && self.node.written().saturating_add(1) >= batch.number {
                self.node.writes_done(batch.number, true, now);
                return;
            }
            if tx.send(batch).is_err() {
                // Serving on without a disk would confirm nothing and grow without bound, and
                // what is on disk is consistent up to here: stop.
                tracing::error!("the store thread is gone: stopping the broker");
                exit_at_once(70);
            }
        }
    }

    /// Hands the replicated queues' proposals (and the groups to create or drop) to the Raft
    /// thread: groups change first, in the broker's order, so a group is there before anything
    /// is proposed to it (a removed group's proposals were dropped by the broker).
    fn replicate(&mut self) {
        let Some(raft) = self.raft.as_ref() else {
            return;
        };
        for change in self.node.broker_mut().take_group_changes() {
            match change {
                warren_broker::GroupChange::Add {
                    group,
                    campaign,
                    voters,
                } => raft.add_group_with(warren_broker::GroupId(group), campaign, voters),
                warren_broker::GroupChange::Join { group } => {
                    raft.join_group(warren_broker::GroupId(group))
                }
                warren_broker::GroupChange::Remove { group } => {
                    raft.remove_group(warren_broker::GroupId(group))
                }
                warren_broker::GroupChange::Drain { on } => raft.set_draining(on),
                warren_broker::GroupChange::Transfer { group, to } => {
                    raft.transfer_leader(warren_broker::GroupId(group), to)
                }
                warren_broker::GroupChange::Members { voters, addresses } => {
                    raft.set_members(voters, addresses)
                }
                warren_broker::GroupChange::Voters { group, voters } => {
                    raft.set_group_voters(warren_broker::GroupId(group), voters)
                }
            }
        }
        self.node.take_proposals(&mut self.proposals);
        let joins = self.node.broker().joins_entries();
        for p in self.proposals.drain(..) {
            let group = warren_broker::GroupId(p.group);
            match p.to {
                None if joins && p.group != warren_broker::META_GROUP => {
                    raft.propose_joinable(group, p.data)
                }
                None => raft.propose(group, p.data),
                Some(leader) => raft.forward(leader, group, p.data),
            }
        }
        self.node.take_snapshots(&mut self.snapshots);
        for s in self.snapshots.drain(..) {
            let meta = crate::cluster::SnapshotMeta {
                index: s.index,
                term: s.term,
            };
            let group = warren_broker::GroupId(s.group);
            match s.data {
                warren_broker::SnapshotData::Encoded(data) => raft.snapshot(group, meta, data),
                deferred => {
                    let write = move |sink: &mut dyn FnMut(&[u8]) -> Result<(), String>| {
                        deferred.write_to(sink).map_err(|e| e.to_string())
                    };
                    raft.snapshot_with(
                        group,
                        meta,
                        crate::cluster::SnapshotBody::Stream {
                            prefix: warren_broker::SnapshotData::PREFIX,
                            write: Box::new(write),
                        },
                    );
                }
            }
        }
    }

    /// Appends the commands applied since the last call to the command log, if one is kept.
    fn record(&mut self) {
        let Some(rec) = self.recorder.as_mut() else {
            return;
        };
        let records = self.node.take_records();
        if records.is_empty() {
            return;
        }
        rec.buf.clear();
        for r in &records {
            warren_broker::queue::log::encode(r, &mut rec.buf);
        }
        if let Err(e) = rec.file.write_all(&rec.buf) {
            tracing::error!(error = %e, "cannot write the command log: recording stops");
            self.recorder = None;
        }
    }

    fn send(&mut self, t: Transmit) {
        let Some(w) = self.writers.get_mut(&t.conn) else {
            return;
        };
        if let Some(fm) = t.frame_max {
            w.frame_max.store(fm, Ordering::Relaxed);
        }
        if let Some(p) = t.pause {
            w.pause.send_replace(p);
        }
        if w.transmit(t.bytes, t.close) >= self.backlog_limit && !w.blocked {
            w.blocked = true;
            self.node.set_write_blocked(t.conn, true);
        }
        if t.close {
            // The socket's write side shuts down once the writer task drops its handle too.
            self.writers.remove(&t.conn);
        }
    }
}

impl Writer {
    /// Writes what the socket takes now, if the writer task holds nothing older, and queues the rest for
    /// the task. Returns the bytes now waiting in the task.
    fn transmit(&self, mut bytes: Bytes, close: bool) -> usize {
        if let (0, Some(socket)) = (self.pending.load(Ordering::Acquire), &self.socket) {
            // Nothing queued, so writing here keeps the order: the task decrements only after writing.
            while !bytes.is_empty() {
                match socket.try_write(&bytes) {
                    Ok(n) => {
                        let _ = bytes.split_to(n);
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    // The reader sees the error too and reports the connection lost.
                    Err(_) => return 0,
                }
            }
            if bytes.is_empty() && !close {
                return 0;
            }
        }
        let n = bytes.len();
        let pending = self.pending.fetch_add(n, Ordering::AcqRel) + n;
        // A gone writer task means the socket is gone; the reader reports it.
        let _ = self.tx.send(Outgoing { bytes, close });
        pending
    }
}

/// The recovery the server finishes while it serves (see [`recover`]).
pub struct PendingRecovery {
    pub recovery: warren_store::Recovery,
    /// Tests only: a pause before each queue.
    pub step_pause: Option<Duration>,
}

/// How the management API's changes wait for the store.
#[derive(Clone, Copy, Debug)]
pub struct ApiWrites {
    /// How long a change waits for its write ([`WRITE_WAIT`] unless a test shortens it).
    pub wait: Duration,
    /// Tests only: each batch reaches the store this much later (a slow disk).
    pub store_delay: Option<Duration>,
}

impl Default for ApiWrites {
    fn default() -> Self {
        ApiWrites {
            wait: WRITE_WAIT,
            store_delay: None,
        }
    }
}

/// Runs the broker on `listener` until `shutdown` turns true, then closes every connection with 320.
pub async fn serve(
    (listener, tls_listener): (TcpListener, Option<(TcpListener, crate::tls::Tls)>),
    node: Node,
    recorder: Option<Recorder>,
    (store, recovery): (Option<Arc<warren_store::Store>>, Option<PendingRecovery>),
    (alarms, data_dir, writes, threads): (
        crate::config::AlarmConfig,
        std::path::PathBuf,
        ApiWrites,
        crate::connection_threads::ConnectionThreads,
    ),
    (mut shutdown, cluster): (watch::Receiver<bool>, Option<crate::cluster::ClusterConfig>),
    on_start: impl FnOnce(NodeHandle),
) -> std::io::Result<Served> {
    let config = node.config().clone();
    let (recovered_tx, recovered_rx) = watch::channel(recovery.is_none() || store.is_none());
    let shared = Arc::new(Shared {
        closed: AtomicBool::new(false),
        core: Mutex::new(Core {
            recorder,
            store: None,
            node,
            writers: HashMap::new(),
            transmits: Vec::new(),
            start: Instant::now(),
            epoch_ms: wall_clock_ms(),
            backlog_limit: config.write_backlog_limit,
            last_sent: 0,
            marks: (0, 0),
            answered: 0,
            watched: HashMap::new(),
            raft: None,
            proposals: Vec::new(),
            snapshots: Vec::new(),
        }),
        dispatch: Notify::new(),
        timer: Notify::new(),
        armed: AtomicU64::new(u64::MAX),
        written: Written::default(),
        write_wait: writes.wait,
        recovered: AtomicBool::new(recovery.is_none() || store.is_none()),
        recovery_left: AtomicUsize::new(recovery.as_ref().map_or(0, |r| r.recovery.queues_left())),
        recovered_rx: recovered_rx.clone(),
        alarms: Mutex::new(Alarms::default()),
        draining_since: AtomicU64::new(0),
        joining: AtomicBool::new(false),
        peer_figures: Mutex::new(std::collections::BTreeMap::new()),
        shovel_restarter: std::sync::OnceLock::new(),
    });
    // The store's sender is in place before anything can change the node: recovery may end
    // (and the API take changes) before this task runs again, and a change made while the
    // node had no sender was reported on disk at once (no batch sent, none to wait for).
    let store_thread = match store.clone() {
        Some(store) => {
            let t = StoreThread::spawn(store, StoreReports(shared.clone()))?;
            let tx = match writes.store_delay {
                Some(delay) => slow_disk(t.tx.clone(), delay)?,
                None => t.tx.clone(),
            };
            shared.lock().store = Some(tx);
            Some(t)
        }
        None => None,
    };
    on_start(NodeHandle(shared.clone()));
    let cancel_recovery = Arc::new(AtomicBool::new(false));
    if let (Some(recovery), Some(store)) = (recovery, store.clone()) {
        let shared = shared.clone();
        let dir = data_dir.clone();
        let cancel = cancel_recovery.clone();
        tokio::task::spawn_blocking(move || {
            let run = std::panic::AssertUnwindSafe(|| {
                recover(&shared, &store, recovery, &dir, (recovered_tx, &cancel))
            });
            if std::panic::catch_unwind(run).is_err() {
                // Clients would wait for ever behind a recovery that will not finish.
                eprintln!("warren: recovery failed unexpectedly (see the log); stopping");
                std::process::exit(70);
            }
        });
    }
    let on_alarm = shared.clone();
    let set_alarms: Arc<dyn Fn(crate::alarms::Pressure) + Send + Sync> =
        Arc::new(move |p: crate::alarms::Pressure| {
            on_alarm
                .alarms
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .pressure = Some(p);
            on_alarm.apply_alarms();
        });
    let monitor = tokio::spawn(crate::alarms::monitor(alarms, data_dir, set_alarms));
    let ticker = tokio::spawn(timer(shared.clone()));
    let dispatcher = tokio::spawn(dispatcher(shared.clone()));
    let raft = match cluster {
        Some(cfg) => {
            let node_id = cfg.node;
            let first = cfg.peers.keys().chain([&node_id]).min().copied() == Some(node_id);
            let peers: Vec<u64> = cfg.peers.keys().copied().collect();
            let reports = RaftReports {
                shared: shared.clone(),
                away: shared.lock().node.broker().away_context(),
            };
            let raft = crate::cluster::RaftNode::start(cfg, reports)
                .map_err(|e| std::io::Error::other(e.to_string()))?;
            let join = raft.joining().map(|addr| (addr, peers));
            let recovered: std::collections::BTreeSet<u64> =
                raft.groups().iter().map(|g| g.0).collect();
            // The metadata group exists on every node; the lowest-numbered node stands for its
            // first leader. Every replicated queue recovered from the store has its group.
            if !recovered.contains(&0) {
                match &join {
                    // Joining: the metadata comes from its leader's snapshot, once the
                    // cluster has added this node.
                    Some(_) => raft.join_group(warren_broker::GroupId(0)),
                    None => raft.add_group(warren_broker::GroupId(0), first),
                }
            }
            if let Some((addr, peers)) = join {
                shared.joining.store(true, Ordering::Release);
                tokio::spawn(ask_to_join(shared.clone(), raft.clone(), addr, peers));
            }
            shared.with_core(|core, _| {
                core.raft = Some(raft.clone());
                // What the broker restored so far first, in its order: the cluster's nodes
                // (which groups made after them start with), then its groups.
                core.replicate();
                let voters = core.node.broker().cluster_voters();
                for (group, _) in core.node.broker().replica_groups() {
                    if !recovered.contains(&group) {
                        raft.add_group_with(warren_broker::GroupId(group), false, voters.clone());
                    }
                }
            });
            Some((raft.node(), raft))
        }
        None => None,
    };
    // Connection ids carry the node's number in a cluster (a replicated queue's members tell
    // whose consumer a delivery went to).
    let first_conn = raft
        .as_ref()
        .and_then(|(n, _)| warren_broker::qualify(u16::try_from(*n).ok()?, 1))
        .unwrap_or(1);
    let next_id = AtomicU64::new(first_conn);
    let handshake_timeout = Duration::from_millis(config.handshake_timeout_ms);
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        // Out of file descriptors and the like: keep serving the connections we have.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                if shared.turns_clients_away() {
                    // Maintenance mode: as RabbitMQ's suspended listeners, no new client.
                    // (Nor while the node joins a cluster: it lacks the definitions.)
                    drop(stream);
                    continue;
                }
                let conn = next_id.fetch_add(1, Ordering::Relaxed);
                let shared = shared.clone();
                let frame_max = config.frame_max;
                let limits = (HandshakeClock::start(handshake_timeout), recovered_rx.clone());
                threads.spawn(stream, move |stream| async move {
                    connection(stream, peer, conn, shared, frame_max, limits).await;
                });
            }
            accepted = accept_tls(&tls_listener) => {
                let (stream, peer) = match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        tracing::warn!(error = %e, "accept failed (amqps)");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                if shared.turns_clients_away() {
                    drop(stream);
                    continue;
                }
                let Some((_, tls)) = &tls_listener else { continue };
                let conn = next_id.fetch_add(1, Ordering::Relaxed);
                let shared = shared.clone();
                let frame_max = config.frame_max;
                let limits = (HandshakeClock::start(handshake_timeout), recovered_rx.clone());
                let tls = tls.clone();
                threads.spawn(stream, move |stream| async move {
                    tls_connection(stream, peer, tls, conn, shared, frame_max, limits).await;
                });
            }
            _ = shutdown.changed() => break,
        }
    }
    drop(listener);
    drop(tls_listener);
    cancel_recovery.store(true, Ordering::Release);
    let open = shared.lock().node.connection_count();
    tracing::info!(connections = open, "shutting down");
    if raft.is_some() {
        hand_over(&shared).await;
    }
    shared.with_node(|node, now| node.shutdown(now));
    let deadline = Instant::now() + SHUTDOWN_GRACE;
    while Instant::now() < deadline && shared.lock().node.connection_count() > 0 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    ticker.abort();
    dispatcher.abort();
    monitor.abort();
    // The connections' threads end before the store is let go: a connection that would not
    // close could otherwise still reach the node (and read pages) while the store closes.
    threads.stop().await;
    if let Some((_, raft)) = raft {
        shared.lock().raft = None;
        let _ = tokio::task::spawn_blocking(move || raft.shutdown()).await;
    }
    // The last writes (messages of closed channels coming back) reach the disk before the store
    // is handed back. What the node holds is counted under the same lock: nothing can be
    // confirmed after it.
    let held = {
        let mut core = shared.lock();
        let held = messages_held(&core.node);
        core.store = None;
        shared.closed.store(true, Ordering::Release);
        held
    };
    Ok(Served {
        store: store_thread.and_then(StoreThread::finish),
        held,
    })
}

/// The messages the node holds: ready, delivered and not yet acked, delayed, and on their
/// way to a dead-letter target.
pub fn messages_held(node: &Node) -> u64 {
    let t = node.broker().totals();
    t.ready + t.unacked + t.delayed + t.dead_lettering
}

/// What a node's run leaves: its store, and the messages it held once it stopped.
pub struct Served {
    pub store: Option<Arc<warren_store::Store>>,
    pub held: u64,
}

/// How long a cluster node that is stopping waits for its leaderships to move before it
/// closes its clients' connections.
const HANDOVER_WAIT: Duration = Duration::from_secs(5);

/// A cluster node stopping (SIGTERM: a rolling restart, a Kubernetes update) first hands the
/// leadership of its quorum queues and of the metadata to other nodes, as `warren ctl drain`
/// does, while its clients stay connected (what they publish meanwhile is forwarded, a transfer
/// nacks nothing). A leader that just went away would leave its queues without one for an
/// election timeout and nack what it had not committed; handed over, the queues go on at once.
/// Returns when it leads nothing, when no other node could take over (every other one down or
/// stopping too), or after
/// [`HANDOVER_WAIT`].
async fn hand_over(shared: &Arc<Shared>) {
    shared.with_node(|node, _| node.broker_mut().set_draining(true));
    let deadline = Instant::now() + HANDOVER_WAIT;
    loop {
        let (led, metadata, peers) = NodeHandle(shared.clone()).read(|node, _| {
            let b = node.broker();
            let me = b.cluster_node();
            let metadata = b
                .cluster_view()
                .is_some_and(|(_, _, leader)| leader.is_some() && leader == me);
            let peers = b
                .peers_running()
                .iter()
                .filter(|(n, up)| *up && !b.node_draining(*n))
                .count();
            (b.queues_led_here(), metadata, peers)
        });
        if led == 0 && !metadata {
            tracing::info!("leaderships handed over");
            return;
        }
        if peers == 0 {
            tracing::info!(
                queues_led = led,
                metadata,
                "no other node can lead: stopping as leader"
            );
            return;
        }
        if Instant::now() >= deadline {
            tracing::warn!(
                queues_led = led,
                metadata,
                "leaderships not all handed over in time: stopping anyway"
            );
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Tests only (`--test-store-delay-ms`): a disk that takes `delay` for every batch. Batches
/// keep their order and overlap as a real disk's queue does; the relay ends, after the
/// last batch, when the core drops its sender.
fn slow_disk(
    store: std::sync::mpsc::Sender<warren_broker::WriteBatch>,
    delay: Duration,
) -> std::io::Result<std::sync::mpsc::Sender<warren_broker::WriteBatch>> {
    let (tx, rx) = std::sync::mpsc::channel::<warren_broker::WriteBatch>();
    std::thread::Builder::new()
        .name("warren-slow-disk".into())
        .spawn(move || {
            let mut held: std::collections::VecDeque<(Instant, warren_broker::WriteBatch)> =
                std::collections::VecDeque::new();
            loop {
                let next = match held.front() {
                    Some((at, _)) => {
                        rx.recv_timeout((*at + delay).saturating_duration_since(Instant::now()))
                    }
                    None => rx
                        .recv()
                        .map_err(|_| std::sync::mpsc::RecvTimeoutError::Disconnected),
                };
                match next {
                    Ok(batch) => held.push_back((Instant::now(), batch)),
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                    Err(std::sync::mpsc::RecvTimeoutError::Disconnected) if held.is_empty() => {
                        return
                    }
                    Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                        if let Some((at, _)) = held.front() {
                            std::thread::sleep(
                                (*at + delay).saturating_duration_since(Instant::now()),
                            );
                        }
                    }
                }
                while held.front().is_some_and(|(at, _)| at.elapsed() >= delay) {
                    if let Some((_, batch)) = held.pop_front() {
                        if store.send(batch).is_err() {
                            return;
                        }
                    }
                }
            }
        })?;
    Ok(tx)
}

/// Brings the queues' messages back one queue at a time, between the node's other events
/// (handshakes go on meanwhile; open connections wait, see `read_loop`), then lets clients in.
/// A store that cannot be read stops the broker, as it did before it served anyone.
fn recover(
    shared: &Shared,
    store: &warren_store::Store,
    PendingRecovery {
        recovery,
        step_pause: pause,
    }: PendingRecovery,
    dir: &std::path::Path,
    (done, cancel): (watch::Sender<bool>, &AtomicBool),
) {
    let started = Instant::now();
    let fail = |e: warren_store::StoreError| -> ! {
        tracing::error!(data_dir = %dir.display(), error = %e, "recovery failed");
        eprintln!("warren: {}: {e}", dir.display());
        std::process::exit(1);
    };
    let mut recovery = Some(recovery);
    loop {
        if let Some(p) = pause {
            std::thread::sleep(p);
        }
        if cancel.load(Ordering::Acquire) {
            // Shutting down: what is on disk stays there for the next start.
            return;
        }
        let mut step = Ok(false);
        shared.with_node(|node, _| {
            if let Some(r) = recovery.as_mut() {
                step = store.recover_step(node.broker_mut(), r);
                shared
                    .recovery_left
                    .store(r.queues_left(), Ordering::Relaxed);
            }
        });
        match step {
            Ok(true) => {}
            Ok(false) => break,
            Err(e) => fail(e),
        }
    }
    let mut finished = None;
    shared.with_node(|node, now| {
        if let Some(r) = recovery.take() {
            finished = Some(store.finish_recovery(node.broker_mut(), r));
        }
        node.set_recovering(false, now);
        // Inside the same lock as the last step: the API's first change comes after it.
        shared.recovered.store(true, Ordering::Release);
    });
    if let Some(Ok(r)) = &finished {
        crate::metrics::QUARANTINED.store(r.quarantined as u64, Ordering::Relaxed);
        if r.quarantined > 0 {
            tracing::error!(
                data_dir = %dir.display(),
                quarantined = r.quarantined,
                lost_messages = r.lost,
                "recovery found damaged records: the rest is back; the damaged ones are kept under the 'quarantine/' keys of the default column family (see the errors above for which queue lost what)"
            );
        }
    }
    match finished {
        Some(Ok(r)) => tracing::info!(
            data_dir = %dir.display(),
            exchanges = r.exchanges,
            queues = r.queues,
            bindings = r.bindings,
            messages = r.messages,
            after_crash = r.after_crash,
            quarantined = r.quarantined,
            lost_to_damage = r.lost,
            ms = started.elapsed().as_millis() as u64,
            "recovered durable state"
        ),
        Some(Err(e)) => fail(e),
        None => {}
    }
    let _ = done.send(true);
}

/// Sleeps until the node's earliest deadline, ticks it, and again; woken early when an event
/// brings a deadline forward. With nothing due it sleeps until an event arrives.
async fn timer(shared: Arc<Shared>) {
    loop {
        let (next, start) = {
            let core = shared.lock();
            (core.node.next_deadline(), (core.start, core.epoch_ms))
        };
        shared
            .armed
            .store(next.unwrap_or(u64::MAX), Ordering::Release);
        match next {
            Some(at) => {
                let (start, epoch_ms) = start;
                let after = Duration::from_millis(at.saturating_sub(epoch_ms));
                let when = tokio::time::Instant::from_std(start + after);
                tokio::select! {
                    _ = tokio::time::sleep_until(when) => {
                        shared.with_node(|node, now| node.tick(now));
                    }
                    _ = shared.timer.notified() => {}
                }
            }
            None => shared.timer.notified().await,
        }
    }
}

/// Finishes deliveries a flush left pending (a queue hands out at most one batch per pass).
async fn dispatcher(shared: Arc<Shared>) {
    loop {
        shared.dispatch.notified().await;
        loop {
            let more = shared.lock().flush(DISPATCH_PASSES);
            if !more {
                break;
            }
            // Let readers and writers in between batches.
            tokio::task::yield_now().await;
        }
    }
}

/// Accepts on the amqps listener, if there is one (else never returns).
async fn accept_tls(
    listener: &Option<(TcpListener, crate::tls::Tls)>,
) -> std::io::Result<(TcpStream, SocketAddr)> {
    match listener {
        Some((l, _)) => l.accept().await,
        None => std::future::pending().await,
    }
}

/// The writing end of a connection's socket, as the writer task holds it.
enum WriteSide {
    Tcp(Arc<OwnedWriteHalf>),
    Tls(WriteHalf<tokio_rustls::server::TlsStream<TcpStream>>),
}

impl WriteSide {
    async fn write(&mut self, buf: &[u8]) -> std::io::Result<()> {
        match self {
            WriteSide::Tcp(socket) => write_all(socket, buf).await,
            WriteSide::Tls(w) => {
                w.write_all(buf).await?;
                w.flush().await
            }
        }
    }

    /// Ends the stream: FIN for TCP once the core's handle is gone too; for TLS, close_notify
    /// then FIN.
    async fn finish(self) {
        match self {
            WriteSide::Tcp(socket) => drop(socket),
            WriteSide::Tls(mut w) => {
                let _ = tokio::time::timeout(Duration::from_secs(1), w.shutdown()).await;
            }
        }
    }
}

/// When a connection was accepted and how long it has to finish the handshake. One clock runs
/// from the accept through the TLS handshake, the protocol header and the AMQP handshake (as
/// RabbitMQ's `handshake_timeout`): a client dribbling each part just under its own limit would
/// otherwise hold the connection for several timeouts.
#[derive(Clone, Copy)]
struct HandshakeClock {
    accepted: Instant,
    timeout: Duration,
}

impl HandshakeClock {
    fn start(timeout: Duration) -> Self {
        HandshakeClock {
            accepted: Instant::now(),
            timeout,
        }
    }

    /// `fut`'s output, or None if the handshake time runs out first.
    async fn within<F: std::future::Future>(&self, fut: F) -> Option<F::Output> {
        match self.accepted.checked_add(self.timeout) {
            Some(at) => tokio::time::timeout_at(at.into(), fut).await.ok(),
            // A timeout too far to represent: none.
            None => Some(fut.await),
        }
    }

    fn elapsed_ms(&self) -> u64 {
        u64::try_from(self.accepted.elapsed().as_millis()).unwrap_or(u64::MAX)
    }
}

async fn connection(
    stream: TcpStream,
    peer: SocketAddr,
    conn: ConnId,
    shared: Arc<Shared>,
    frame_max: u32,
    limits: (HandshakeClock, watch::Receiver<bool>),
) {
    if let Err(e) = stream.set_nodelay(true) {
        tracing::debug!(conn, error = %e, "set_nodelay failed");
    }
    let local = stream.local_addr().ok();
    let (rd, wr) = stream.into_split();
    let wr = Arc::new(wr);
    run_connection(
        rd,
        WriteSide::Tcp(wr),
        (peer, local, None),
        conn,
        shared,
        frame_max,
        limits,
    )
    .await;
}

/// An amqps connection: the TLS handshake (within the AMQP handshake's time limit), then the
/// same life as a plain one; a verified client certificate names the user EXTERNAL logs in.
async fn tls_connection(
    stream: TcpStream,
    peer: SocketAddr,
    tls: crate::tls::Tls,
    conn: ConnId,
    shared: Arc<Shared>,
    frame_max: u32,
    limits: (HandshakeClock, watch::Receiver<bool>),
) {
    if let Err(e) = stream.set_nodelay(true) {
        tracing::debug!(conn, error = %e, "set_nodelay failed");
    }
    let local = stream.local_addr().ok();
    let stream = match limits.0.within(tls.amqp_acceptor().accept(stream)).await {
        Some(Ok(s)) => s,
        Some(Err(e)) => {
            tracing::info!(conn, %peer, error = %e, "TLS handshake failed");
            return;
        }
        None => {
            tracing::info!(conn, %peer, "TLS handshake timed out");
            return;
        }
    };
    let info = tls.info(&stream);
    tracing::debug!(conn, %peer, protocol = %info.protocol, cipher = %info.cipher, client_cert = ?info.peer_cert_subject, "TLS handshake done");
    let (rd, wr) = tokio::io::split(stream);
    run_connection(
        rd,
        WriteSide::Tls(wr),
        (peer, local, Some(info)),
        conn,
        shared,
        frame_max,
        limits,
    )
    .await;
}

async fn run_connection<R: AsyncRead + Unpin + Send + 'static>(
    mut rd: R,
    mut wr: WriteSide,
    (peer, local, tls): (SocketAddr, Option<SocketAddr>, Option<TlsInfo>),
    conn: ConnId,
    shared: Arc<Shared>,
    frame_max: u32,
    (handshake, recovered): (HandshakeClock, watch::Receiver<bool>),
) {
    match handshake.within(read_protocol_header(&mut rd)).await {
        Some(Ok(true)) => {}
        Some(Ok(false)) => {
            // The spec: answer a header we don't speak with the one we do, then close.
            let _ = wr.write(PROTOCOL_HEADER).await;
            wr.finish().await;
            return;
        }
        _ => return,
    }
    let frame_max = Arc::new(AtomicU32::new(frame_max));
    let pending = Arc::new(AtomicUsize::new(0));
    let (tx, rx) = mpsc::unbounded_channel();
    let (pause, paused) = watch::channel(false);
    let direct = match &wr {
        WriteSide::Tcp(socket) => Some(socket.clone()),
        WriteSide::Tls(_) => None,
    };
    // Checked under the node's lock, as a drain sets it: either the drain closes this
    // connection, or the connection sees the drain.
    let taken = shared.with_core(|core, now| {
        if shared.turns_clients_away() {
            return false;
        }
        core.writers.insert(
            conn,
            Writer {
                tx,
                socket: direct,
                frame_max: frame_max.clone(),
                pending: pending.clone(),
                blocked: false,
                pause,
            },
        );
        // The node's handshake timer counts from the accept, not from the header.
        let opened = now.saturating_sub(handshake.elapsed_ms());
        core.node
            .connection_opened_as(conn, Some(peer), tls, opened);
        if let Some(local) = local {
            core.node.set_local_addr(conn, local);
        }
        true
    });
    if !taken {
        return;
    }
    let draining = Arc::new(AtomicBool::new(false));
    let reader = tokio::spawn(read_loop(
        rd,
        conn,
        shared.clone(),
        frame_max,
        draining.clone(),
        (paused, pending.clone()),
        recovered,
    ));
    write_loop(wr, rx, conn, shared, reader, draining, pending).await;
}

/// Reads until the 8-byte protocol header is known good (true) or bad (false); a bad prefix is refused
/// as soon as it arrives rather than after 8 bytes.
async fn read_protocol_header<R: AsyncRead + Unpin>(rd: &mut R) -> std::io::Result<bool> {
    let mut buf = BytesMut::with_capacity(8);
    loop {
        match decode_protocol_header(&mut buf) {
            Ok(true) => return Ok(true),
            Ok(false) => {}
            Err(_) => return Ok(false),
        }
        let mut chunk = [0u8; 8];
        let want = 8 - buf.len();
        let n = rd.read(&mut chunk[..want]).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// Why a reader holds frames it has decoded.
enum Hold {
    /// Recovery is not over.
    Recovery,
    /// A basic.get of the connection waits for another node's answer, or a resource alarm
    /// blocked it.
    Answer,
}

async fn read_loop<R: AsyncRead + Unpin + Send + 'static>(
    mut rd: R,
    conn: ConnId,
    shared: Arc<Shared>,
    frame_max: Arc<AtomicU32>,
    draining: Arc<AtomicBool>,
    (mut paused, unsent): (watch::Receiver<bool>, Arc<AtomicUsize>),
    mut recovered: watch::Receiver<bool>,
) {
    let mut decoder = FrameDecoder::new(frame_max.load(Ordering::Relaxed));
    // Deliveries stop at the backlog limit; what a client's own frames make the broker send
    // (returns, get-ok, confirms, replies) stops here: a client that writes and never reads
    // is not read either, and its output stays bounded.
    let unsent_limit = shared
        .lock()
        .backlog_limit
        .saturating_mul(UNSENT_READ_FACTOR);
    let mut buf = BytesMut::new();
    let mut read_size = MIN_READ;
    let mut frames = std::collections::VecDeque::new();
    loop {
        if buf.capacity() - buf.len() < MIN_SPARE.max(read_size / 32) {
            // Frames taken out earlier keep their part of the old buffer alive; small reads share one
            // buffer, so a small message does not pin a buffer of its own. A quiet client's
            // buffer is read to its last kilobyte: replaced whenever less than a whole read
            // (4 KiB) was left, a worker's publisher got a new buffer (two allocations: the
            // buffer and, at the first frame split off, its shared header) for nearly every
            // publish while the deliveries before it were unacked. A busy client's is replaced
            // with 4 KiB left, as before: read to its last kilobyte, a deep transient queue
            // paged out under memory pressure kept more memory (the paging test's bound).
            buf.reserve(read_size);
        }
        while unsent.load(Ordering::Acquire) >= unsent_limit {
            // Rare (a client that does not read its socket), so a poll is enough.
            tokio::time::sleep(UNSENT_POLL).await;
        }
        if *paused.borrow() {
            // A resource alarm: leave the client's bytes in the kernel (TCP back-pressure)
            // until it clears. A closed sender means the connection is going away.
            if paused.wait_for(|p| !*p).await.is_err() {
                break;
            }
        }
        let spare = buf.capacity() - buf.len();
        let mut full = false;
        match rd.read_buf(&mut buf).await {
            Ok(0) | Err(_) => break,
            // A read that fills the buffer means a busy client: read more at a time; small reads, less.
            Ok(n) if n == spare => {
                read_size = (read_size * 2).min(MAX_READ);
                full = true;
            }
            Ok(n) if n < read_size / 8 => read_size = (read_size / 2).max(MIN_READ),
            Ok(_) => {}
        }
        if draining.load(Ordering::Acquire) {
            // The connection is over: read only so that the client's close is not met with a reset.
            buf.clear();
            continue;
        }
        let fm = frame_max.load(Ordering::Relaxed);
        if fm != decoder.frame_max() {
            decoder.set_frame_max(fm);
        }
        let mut failure = None;
        loop {
            match decoder.decode(&mut buf) {
                Ok(Some(frame)) => frames.push_back(frame),
                Ok(None) => break,
                Err(error) => {
                    failure = Some(error);
                    break;
                }
            }
        }
        let failed = failure.is_some();
        loop {
            // While the store is still bringing queues back, an open connection's frames wait
            // (its handshake does not): no client reaches a queue before recovery is over.
            let gated = !*recovered.borrow();
            // Seen from here: an answer that comes while this task waits below wakes it.
            paused.borrow_and_update();
            let wait = shared.with_node(|node, now| {
                while let Some(frame) = frames.pop_front() {
                    if gated && node.is_open(conn) {
                        frames.push_front(frame);
                        return Some(Hold::Recovery);
                    }
                    if node.holds(conn) {
                        // A basic.get waits for another node, or a resource alarm blocked the
                        // connection: what follows waits until it is told to read again.
                        frames.push_front(frame);
                        return Some(Hold::Answer);
                    }
                    node.handle_frame(conn, frame, now);
                }
                if failure.is_some() && node.holds(conn) {
                    return Some(Hold::Answer);
                }
                if let Some(error) = failure.take() {
                    node.decode_error(conn, &error, now);
                }
                None
            });
            let gone = match wait {
                None => break,
                Some(Hold::Recovery) => recovered.wait_for(|done| *done).await.is_err(),
                Some(Hold::Answer) => paused.changed().await.is_err(),
            };
            if gone {
                return;
            }
        }
        if failed {
            // Nothing after a framing error can be trusted: stop reading; the node closes the connection.
            return;
        }
        if full {
            // More is waiting: the other connections of this thread (a worker's acks among
            // them) go first, one read each, so a publisher sending flat out cannot hold
            // them back for tokio's whole budget of reads.
            tokio::task::yield_now().await;
        }
    }
    shared.with_core(|core, _| {
        core.node.connection_lost(conn);
        core.writers.remove(&conn);
    });
}

/// Writes all of `buf`, waiting for the socket as needed.
async fn write_all(socket: &OwnedWriteHalf, mut buf: &[u8]) -> std::io::Result<()> {
    while !buf.is_empty() {
        socket.writable().await?;
        match socket.try_write(buf) {
            Ok(n) => buf = buf.get(n..).unwrap_or_default(),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Writes what the core could not write at once. The socket's write side shuts down when the last handle
/// (this task's and the core's) is dropped.
async fn write_loop(
    mut socket: WriteSide,
    mut rx: mpsc::UnboundedReceiver<Outgoing>,
    conn: ConnId,
    shared: Arc<Shared>,
    mut reader: JoinHandle<()>,
    draining: Arc<AtomicBool>,
    pending: Arc<AtomicUsize>,
) {
    let limit = shared.lock().backlog_limit;
    let mut ended_by_close = false;
    while let Some(out) = rx.recv().await {
        if socket.write(&out.bytes).await.is_err() {
            break;
        }
        let written = out.bytes.len();
        let before = pending.fetch_sub(written, Ordering::AcqRel);
        if before >= limit && before - written < limit {
            shared.with_core(|core, _| {
                if let Some(w) = core.writers.get_mut(&conn) {
                    w.blocked = false;
                }
                core.node.set_write_blocked(conn, false);
            });
        }
        if out.close {
            ended_by_close = true;
            break;
        }
    }
    // Nothing more will be sent: a reader held back by unsent output goes on (to the end of the
    // stream, or to drain it).
    pending.store(0, Ordering::Release);
    // Sends FIN once the last reference (ours) goes: the client sees the end of the stream.
    socket.finish().await;
    if ended_by_close {
        shared.with_node(|node, _| node.connection_lost(conn));
        // The client may still be sending (publishes it had buffered before its connection.close):
        // closing a socket with unread bytes makes the kernel send a reset, and the client would
        // lose the close-ok. Read and discard until it closes, for a bounded time.
        draining.store(true, Ordering::Release);
        if tokio::time::timeout(CLOSE_DRAIN, &mut reader)
            .await
            .is_err()
        {
            reader.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_refused_as_it_is_confirmed_reads_refused_and_no_batch_reads_written() {
        let state = |upto, failed| WriteState {
            upto,
            failed,
            ..WriteState::default()
        };
        // Lost replicated entries let the confirmed mark pass their batch as it is refused.
        assert_eq!(state(7, 7).outcome(7), Some(false));
        assert_eq!(state(7, 3).outcome(5), Some(true));
        assert_eq!(state(4, 3).outcome(5), None);
        assert_eq!(state(0, 0).outcome(0), Some(true), "nothing to wait for");
        // A change that sent nothing of its own is not refused for an earlier loss.
        assert_eq!(state(7, 7).outcome_since(7, 7), Some(true));
        assert_eq!(state(7, 7).outcome_since(7, 6), Some(false));
    }

    #[test]
    fn a_shovel_restart_forward_reads_back_whatever_its_names_hold() {
        for (vhost, name) in [("/", "mv"), ("a\0b", "c"), ("", ""), ("v", "n\0\u{e9}")] {
            let data = shovel_restart_data(vhost, name);
            assert_eq!(
                shovel_restart_of(&data),
                Some((vhost.to_owned(), name.to_owned()))
            );
        }
        assert_eq!(shovel_restart_of(&[0, 0, 0, 9, b'x']), None);
        assert_eq!(shovel_restart_of(&[0, 0]), None);
    }
}
