//! The cluster's TCP transport: one connection per peer and direction, each side sending on the
//! connection it dialed. Dialers reconnect with a back-off; listeners authenticate ([`auth`])
//! before they decode anything ([`wire`]) and hand batches to the Raft thread. With cluster TLS
//! ([`link_tls`]) every link is TLS first, and the authentication runs inside it.
//!
//! It runs on a small tokio runtime of its own (one worker): heartbeats and votes must not queue
//! behind client traffic on the broker's runtime (a late heartbeat is a needless election), and
//! the node starts and stops as one unit whoever calls it, tests included.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc::error::TrySendError;
use tokio::sync::{mpsc, Notify, Semaphore};
use warren_replication::{NodeBatch, NodeId};

use super::auth::{self, AuthError};
use super::link_tls::{self, ClusterTls};
use super::pieces;
use super::wire::{self, WireError, MAX_FRAME};
use super::{ClusterConfig, ClusterError, ClusterStats, PeerAddr};

/// Batches, and their bytes, waiting for one peer's connection; more are dropped (Raft sends
/// again).
const PEER_QUEUE: usize = 1024;
const PEER_QUEUE_BYTES: usize = 64 << 20;
/// Batches, and their bytes, from all peers waiting for the Raft thread; more are dropped.
pub(crate) const INBOUND_QUEUE: usize = 4096;
const INBOUND_QUEUE_BYTES: usize = 256 << 20;
const MIN_BACKOFF: Duration = Duration::from_millis(50);
const MAX_BACKOFF: Duration = Duration::from_secs(1);
/// For a connect and its handshake: a stalled stranger holds no slot longer.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(2);
/// Connections being authenticated at once; more are closed at once.
const MAX_HANDSHAKES: usize = 64;
/// Bytes of queued batches written in one go.
const WRITE_CHUNK: usize = 1 << 20;
/// A refused connection from one address is logged at most this often.
const REFUSAL_LOG_EVERY: Duration = Duration::from_secs(60);

/// A link's byte stream: a TCP connection, or TLS over one.
trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}
type Stream = Box<dyn Io>;

/// What a failed TLS handshake is most likely about, for the operator.
const TLS_HINT: &str = "every node needs --cluster-tls-cert, --cluster-tls-key and \
                        --cluster-tls-ca, with certificates signed by that CA that name the hosts \
                        --cluster-nodes gives";

/// Bytes a queue may hold, on top of its bound in batches: one batch can be megabytes.
pub(crate) struct Budget {
    used: AtomicUsize,
    max: usize,
}

impl Budget {
    fn new(max: usize) -> Arc<Budget> {
        Arc::new(Budget {
            used: AtomicUsize::new(0),
            max,
        })
    }

    fn take(&self, n: usize) -> bool {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                u.checked_add(n).filter(|t| *t <= self.max)
            })
            .is_ok()
    }

    pub(crate) fn give(&self, n: usize) {
        let _ = self
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                Some(u.saturating_sub(n))
            });
    }
}

/// A batch and the bytes it holds of its queue's [`Budget`].
pub(crate) struct Queued {
    pub(crate) batch: NodeBatch,
    pub(crate) bytes: usize,
    /// Not a batch: the connection `batch.from` made to this node has ended.
    pub(crate) lost: bool,
}

/// What a batch weighs in a queue: its entries' data and a little per message (the encoded size
/// would cost a pass over every message on the Raft thread).
fn weight(b: &NodeBatch) -> usize {
    let msgs: usize = b
        .msgs
        .iter()
        .map(|e| 64 + e.msg.entries.iter().map(|x| x.data.len()).sum::<usize>())
        .sum();
    let forwards: usize = b.forwards.iter().map(|f| 16 + f.data.len()).sum();
    32 + msgs + forwards
}

#[derive(Default)]
pub(crate) struct Counters {
    batches_in: AtomicU64,
    batches_out: AtomicU64,
    dropped_in: AtomicU64,
    dropped_out: AtomicU64,
    skipped_msgs: AtomicU64,
    refused: AtomicU64,
    bad_frames: AtomicU64,
    connections_in: AtomicU64,
    connections_out: AtomicU64,
    dial_failures: AtomicU64,
    pieced_out: AtomicU64,
    pieced_in: AtomicU64,
    pub(crate) staged_in: AtomicU64,
    pub(crate) staged_used: AtomicU64,
    pub(crate) joined_entries: AtomicU64,
    pub(crate) joined_parts: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

impl Counters {
    pub(crate) fn snapshot(&self) -> ClusterStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        ClusterStats {
            batches_in: get(&self.batches_in),
            batches_out: get(&self.batches_out),
            dropped_in: get(&self.dropped_in),
            dropped_out: get(&self.dropped_out),
            skipped_msgs: get(&self.skipped_msgs),
            refused: get(&self.refused),
            bad_frames: get(&self.bad_frames),
            connections_in: get(&self.connections_in),
            connections_out: get(&self.connections_out),
            dial_failures: get(&self.dial_failures),
            pieced_out: get(&self.pieced_out),
            pieced_in: get(&self.pieced_in),
            staged_in: get(&self.staged_in),
            staged_used: get(&self.staged_used),
            joined_entries: get(&self.joined_entries),
            joined_parts: get(&self.joined_parts),
        }
    }
}

/// What the Raft thread sends through: one bounded queue per peer.
pub(crate) struct Outbound {
    links: BTreeMap<NodeId, (mpsc::Sender<Queued>, Arc<Budget>)>,
    counters: Arc<Counters>,
    shared: Arc<Shared>,
    /// The transport's runtime, for the dialers of nodes added later.
    runtime: tokio::runtime::Handle,
}

impl Outbound {
    /// This node was started to join the cluster (`--cluster-join`, with no metadata then).
    pub(crate) fn joining(&self) -> bool {
        self.shared.joining
    }

    /// The peers this node knows, and their addresses.
    pub(crate) fn peers(&self) -> BTreeMap<NodeId, PeerAddr> {
        self.shared
            .peers
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The cluster's nodes are now `nodes` (`addresses`: those of nodes the list this node
    /// started with lacks): a node added gets a dialer and may connect; the dialer of a node
    /// forgotten stops (its queue closes), its connection to this node closes at its next
    /// frame, and it cannot connect again.
    pub(crate) fn set_peers(&mut self, nodes: &[NodeId], addresses: &[(NodeId, String)]) {
        let me = self.shared.me;
        let peers = {
            let mut peers = self.shared.peers.write().unwrap_or_else(|p| p.into_inner());
            // This node's own list wins (it may reach a node otherwise than its peers do: a
            // proxy, another network); the cluster's metadata gives the rest.
            for (node, text) in addresses {
                match PeerAddr::parse(text) {
                    Some(addr) if *node != me => {
                        peers.entry(*node).or_insert(addr);
                    }
                    Some(_) => {}
                    None => {
                        tracing::error!(node = me, peer = node, address = %text, "a cluster node's address does not read as HOST:PORT");
                    }
                }
            }
            peers.retain(|n, _| nodes.contains(n));
            for node in nodes {
                if *node != me && !peers.contains_key(node) {
                    tracing::error!(
                        node = me,
                        peer = node,
                        "no address for a node of the cluster: list it in --cluster-nodes"
                    );
                }
            }
            peers.clone()
        };
        self.shared.generation.fetch_add(1, Ordering::Release);
        let gone: Vec<NodeId> = self
            .links
            .keys()
            .copied()
            .filter(|n| !peers.contains_key(n))
            .collect();
        for node in gone {
            tracing::info!(
                node = me,
                peer = node,
                "no more links with a forgotten node"
            );
            self.links.remove(&node);
            self.shared
                .redial
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&node);
        }
        for (peer, addr) in peers {
            if !self.links.contains_key(&peer) {
                tracing::info!(node = me, peer, %addr, "linking with a node added to the cluster");
                self.link(peer, addr);
            }
        }
    }

    /// A queue and a dialer for `peer`.
    fn link(&mut self, peer: NodeId, addr: PeerAddr) {
        let (tx, rx) = mpsc::channel(PEER_QUEUE);
        let budget = Budget::new(PEER_QUEUE_BYTES);
        self.links.insert(peer, (tx, budget.clone()));
        let redial = Arc::new(Notify::new());
        self.shared
            .redial
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(peer, redial.clone());
        let dialer = dial_loop(self.shared.clone(), peer, addr, rx, budget, redial);
        self.runtime.spawn(dialer);
    }

    pub(crate) fn send(&self, batch: NodeBatch) {
        let Some((link, budget)) = self.links.get(&batch.to) else {
            tracing::debug!(to = batch.to, "batch for a node that is not a peer");
            return;
        };
        let bytes = weight(&batch);
        if !budget.take(bytes) {
            bump(&self.counters.dropped_out);
            return;
        }
        match link.try_send(Queued {
            batch,
            bytes,
            lost: false,
        }) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                budget.give(bytes);
                bump(&self.counters.dropped_out);
            }
            Err(TrySendError::Closed(_)) => budget.give(bytes),
        }
    }
}

/// The transport's runtime; dropping it closes every socket.
pub(crate) struct Net {
    runtime: Option<tokio::runtime::Runtime>,
}

impl Net {
    /// Stops every task and closes every socket, waiting at most `limit`.
    pub(crate) fn shutdown(mut self, limit: Duration) {
        if let Some(rt) = self.runtime.take() {
            // tokio refuses to wait for a runtime from inside another one's task: wait on a
            // thread of our own, whoever the caller is.
            let waiter = std::thread::Builder::new()
                .name("warren-cluster-stop".into())
                .spawn(move || rt.shutdown_timeout(limit));
            match waiter {
                Ok(t) => {
                    let _ = t.join();
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot wait for the cluster transport to stop")
                }
            }
        }
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        // A handle dropped without `shutdown`, maybe inside async code: do not block.
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

struct Shared {
    me: NodeId,
    secret: Vec<u8>,
    tls: Option<ClusterTls>,
    /// The nodes this one links with: the cluster may forget one.
    peers: RwLock<BTreeMap<NodeId, PeerAddr>>,
    /// Bumped when `peers` changes: a link's reader checks its peer is still one then.
    generation: AtomicU64,
    inbound: crossbeam_channel::Sender<Queued>,
    inbound_budget: Arc<Budget>,
    counters: Arc<Counters>,
    /// Woken when a peer connects to us: it is up, so our dialer need not wait out its back-off.
    redial: Mutex<BTreeMap<NodeId, Arc<Notify>>>,
    /// This node asks to join the cluster: it dials with the joining handshake, which a
    /// node that does not know it yet takes (for its request to join alone).
    joining: bool,
    handshakes: Arc<Semaphore>,
    refusals_logged: Mutex<HashMap<IpAddr, Instant>>,
    /// Snapshot data above this goes in pieces ([`pieces::INLINE_MAX`]; less in tests).
    inline_max: usize,
    /// Where links write what they receive in pieces (none: in memory), and a number for
    /// each link's file.
    spool: Option<PathBuf>,
    links_in: AtomicU64,
    /// Disk room the links count on for what they are spooling ([`pieces::Incoming::spooled`]).
    spooling: Arc<AtomicU64>,
}

/// Binds the cluster address and starts the listener and one dialer per peer.
/// The Raft thread gives each batch's bytes back to `inbound_budget` when it takes the batch.
pub(crate) fn start(
    cfg: &ClusterConfig,
    joining: bool,
    inbound: crossbeam_channel::Sender<Queued>,
    counters: Arc<Counters>,
) -> Result<(Net, Outbound, Arc<Budget>), ClusterError> {
    // Before the runtime: a runtime dropped inside the caller's async code would panic.
    let tls = match &cfg.tls {
        Some(files) => Some(ClusterTls::load(files.clone()).map_err(ClusterError::Tls)?),
        None => None,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name(format!("warren-cluster-{}", cfg.node))
        .enable_all()
        .build()
        .map_err(ClusterError::Runtime)?;
    let listen_error = |source| ClusterError::Listen {
        addr: cfg.listen,
        source,
    };
    // Bound here, not in a task, so a taken address fails `start`.
    let std_listener = std::net::TcpListener::bind(cfg.listen).map_err(listen_error)?;
    std_listener.set_nonblocking(true).map_err(listen_error)?;
    let listener = {
        let _rt = runtime.enter();
        TcpListener::from_std(std_listener).map_err(listen_error)?
    };
    let inbound_budget = Budget::new(INBOUND_QUEUE_BYTES);
    let spool = cfg.dir.join("incoming");
    let spool = match pieces::clear_spool(&spool) {
        Ok(()) => Some(spool),
        Err(error) => {
            tracing::warn!(dir = %spool.display(), %error, "cannot make the folder for snapshots received in pieces: they are put together in memory");
            None
        }
    };
    let shared = Arc::new(Shared {
        me: cfg.node,
        secret: cfg.secret.clone(),
        tls,
        peers: RwLock::new(cfg.peers.clone()),
        generation: AtomicU64::new(0),
        inbound,
        inbound_budget: inbound_budget.clone(),
        counters: counters.clone(),
        redial: Mutex::new(BTreeMap::new()),
        joining,
        handshakes: Arc::new(Semaphore::new(MAX_HANDSHAKES)),
        refusals_logged: Mutex::new(HashMap::new()),
        inline_max: cfg.inline_max,
        spool,
        links_in: AtomicU64::new(0),
        spooling: Arc::default(),
    });
    runtime.spawn(accept_loop(shared.clone(), listener));
    let mut out = Outbound {
        links: BTreeMap::new(),
        counters,
        shared,
        runtime: runtime.handle().clone(),
    };
    for (peer, addr) in &cfg.peers {
        out.link(*peer, addr.clone());
    }
    Ok((
        Net {
            runtime: Some(runtime),
        },
        out,
        inbound_budget,
    ))
}

/// A dialer's last logged state, so a peer that stays down is logged once, not per attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Link {
    Starting,
    Unreachable,
    Refused,
}

/// Dials `peer`, looking its name up again: a node rescheduled elsewhere (a Kubernetes pod)
/// comes back under its name at another address.
async fn connect(shared: &Shared, peer: NodeId, addr: &PeerAddr) -> Result<Stream, DialError> {
    let target = addr.resolve().await?;
    let tcp = TcpStream::connect(target).await?;
    tcp.set_nodelay(true)?;
    let mut stream: Stream = match &shared.tls {
        None => Box::new(tcp),
        Some(tls) => {
            let name = link_tls::server_name(addr.host()).map_err(|e| {
                DialError::Tls(format!(
                    "`{}` cannot be checked against a certificate: {e}",
                    addr.host()
                ))
            })?;
            let tls = tokio_rustls::TlsConnector::from(tls.configs().dial)
                .connect(name, tcp)
                .await
                .map_err(|e| match link_tls::refusal(&e) {
                    Some(why) => DialError::Tls(why),
                    None => DialError::Io(e),
                })?;
            Box::new(tls)
        }
    };
    // In TLS 1.3 the listener checks this node's certificate after the dialer's handshake is
    // done: its refusal arrives as an alert on the first read.
    auth::dial(&mut stream, &shared.secret, shared.me, peer, shared.joining)
        .await
        .map_err(|e| match &e {
            AuthError::Io(io) => link_tls::refusal(io).map_or(DialError::Auth(e), DialError::Tls),
            _ => DialError::Auth(e),
        })?;
    Ok(stream)
}

#[derive(Debug, thiserror::Error)]
enum DialError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Auth(#[from] AuthError),
    #[error("TLS handshake failed: {0} ({TLS_HINT})")]
    Tls(String),
    #[error("handshake timed out")]
    Timeout,
}

async fn dial_loop(
    shared: Arc<Shared>,
    peer: NodeId,
    addr: PeerAddr,
    mut rx: mpsc::Receiver<Queued>,
    budget: Arc<Budget>,
    redial: Arc<Notify>,
) {
    let me = shared.me;
    let mut backoff = MIN_BACKOFF;
    let mut link = Link::Starting;
    loop {
        let attempt = tokio::time::timeout(HANDSHAKE_TIMEOUT, connect(&shared, peer, &addr))
            .await
            .unwrap_or(Err(DialError::Timeout));
        match attempt {
            Ok(stream) => {
                bump(&shared.counters.connections_out);
                tracing::info!(node = me, peer, %addr, tls = shared.tls.is_some(), "connected to cluster peer");
                backoff = MIN_BACKOFF;
                match send_loop(&shared, stream, &mut rx, &budget).await {
                    Ok(()) => return,
                    Err(e) => {
                        tracing::info!(node = me, peer, %addr, error = %e, "connection to cluster peer lost");
                        link = Link::Unreachable;
                    }
                }
            }
            Err(e) => {
                bump(&shared.counters.dial_failures);
                let now = match e {
                    DialError::Auth(AuthError::Io(_)) | DialError::Io(_) | DialError::Timeout => {
                        Link::Unreachable
                    }
                    DialError::Auth(_) | DialError::Tls(_) => Link::Refused,
                };
                if now != link {
                    if now == Link::Refused {
                        tracing::warn!(node = me, peer, %addr, error = %e, "cluster peer refused or failed authentication");
                    } else {
                        tracing::warn!(node = me, peer, %addr, error = %e, "cannot reach cluster peer; retrying");
                    }
                    link = now;
                } else {
                    tracing::debug!(node = me, peer, %addr, error = %e, "cluster peer still down");
                }
            }
        }
        // Back off, dropping what queues meanwhile: Raft sends it again, and a stale batch
        // should not fill the new connection.
        let sleep = tokio::time::sleep(backoff);
        tokio::pin!(sleep);
        loop {
            tokio::select! {
                _ = &mut sleep => break,
                _ = redial.notified() => break,
                b = rx.recv() => match b {
                    Some(q) => {
                        budget.give(q.bytes);
                        bump(&shared.counters.dropped_out);
                    }
                    None => return,
                },
            }
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// Writes batches until the Raft thread stops (`Ok`) or the connection fails. A message too
/// large for a frame goes in pieces ([`pieces`]), one frame of them per write, so that what the
/// Raft thread sends meanwhile is not held behind it.
async fn send_loop(
    shared: &Shared,
    stream: Stream,
    rx: &mut mpsc::Receiver<Queued>,
    budget: &Budget,
) -> std::io::Result<()> {
    let (mut read, mut write) = tokio::io::split(stream);
    let mut buf = Vec::new();
    let mut probe = [0u8; 1];
    let mut large = pieces::Outgoing::new(shared.inline_max);
    loop {
        buf.clear();
        tokio::select! {
            biased;
            b = rx.recv() => {
                let Some(q) = b else { return Ok(()) };
                take(shared, q, budget, &mut large, &mut buf);
            }
            // The listener writes nothing after the handshake: any read result ends the link.
            r = read.read(&mut probe) => {
                return Err(match r {
                    Ok(0) => std::io::ErrorKind::UnexpectedEof.into(),
                    Ok(_) => std::io::Error::other("unexpected bytes from the listener"),
                    Err(e) => e,
                });
            }
            () = std::future::ready(()), if !large.is_empty() => {}
        }
        while buf.len() < WRITE_CHUNK {
            let Ok(q) = rx.try_recv() else { break };
            take(shared, q, budget, &mut large, &mut buf);
        }
        let (_, last) = large.next_frame(&mut buf);
        write.write_all(&buf).await?;
        if last {
            bump(&shared.counters.pieced_out);
        }
        // TLS holds records back until flushed (a no-op for plain TCP).
        write.flush().await?;
        if buf.capacity() > 4 * WRITE_CHUNK + pieces::PIECE_BYTES {
            buf = Vec::new();
        }
    }
}

/// Encodes a batch taken from the queue, its messages too large for a frame set aside in `large`.
fn take(
    shared: &Shared,
    mut q: Queued,
    budget: &Budget,
    large: &mut pieces::Outgoing,
    buf: &mut Vec<u8>,
) {
    budget.give(q.bytes);
    let dropped = large.take_large(&mut q.batch);
    if dropped > 0 {
        shared
            .counters
            .skipped_msgs
            .fetch_add(dropped as u64, Ordering::Relaxed);
        tracing::debug!(
            node = shared.me,
            peer = q.batch.to,
            dropped,
            "snapshots not sent: one of their group is still under way, or too many wait"
        );
    }
    encode(shared, &q.batch, buf);
}

fn encode(shared: &Shared, b: &NodeBatch, buf: &mut Vec<u8>) {
    let done = wire::encode_batch(b, MAX_FRAME, buf);
    shared
        .counters
        .batches_out
        .fetch_add(done.frames as u64, Ordering::Relaxed);
    if done.skipped > 0 {
        shared
            .counters
            .skipped_msgs
            .fetch_add(done.skipped as u64, Ordering::Relaxed);
        tracing::error!(
            node = shared.me,
            peer = b.to,
            skipped = done.skipped,
            "raft messages too large for a frame were not sent"
        );
    }
}

async fn accept_loop(shared: Arc<Shared>, listener: TcpListener) {
    loop {
        match listener.accept().await {
            Ok((stream, remote)) => {
                let Ok(permit) = shared.handshakes.clone().try_acquire_owned() else {
                    tracing::debug!(node = shared.me, %remote, "too many cluster handshakes at once");
                    continue;
                };
                tokio::spawn(serve(shared.clone(), stream, remote, permit));
            }
            Err(e) => {
                // Out of file descriptors, most likely: wait instead of spinning.
                tracing::warn!(node = shared.me, error = %e, "cluster accept failed");
                tokio::time::sleep(MIN_BACKOFF).await;
            }
        }
    }
}

/// A dialer's TLS handshake (if the cluster has TLS), then its proof of the secret; with TLS,
/// its certificate must also name the host `--cluster-nodes` gives for the node it proved to
/// be, as the dialer checks the listener's.
async fn handshake(shared: &Shared, tcp: TcpStream) -> Result<(Stream, NodeId, u64), String> {
    // Read before the peers it checks against: a change in between is seen by `serve`.
    let generation = shared.generation.load(Ordering::Acquire);
    let peers = shared
        .peers
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    let Some(tls) = &shared.tls else {
        let mut stream: Stream = Box::new(tcp);
        let peer = auth::accept(&mut stream, &shared.secret, shared.me, &peers, |_| Ok(()))
            .await
            .map_err(|e| e.to_string())?;
        return Ok((stream, peer, generation));
    };
    let mut stream = tokio_rustls::TlsAcceptor::from(tls.configs().accept)
        .accept(tcp)
        .await
        .map_err(|e| match link_tls::refusal(&e) {
            Some(why) => format!("TLS handshake failed: {why} ({TLS_HINT})"),
            None => format!("TLS handshake failed: {e}"),
        })?;
    let cert = stream
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .map(|c| c.clone().into_owned())
        .ok_or("no client certificate")?;
    let vet = |peer: NodeId| {
        let host = peers.get(&peer).map(|a| a.host()).unwrap_or_default();
        link_tls::names_host(&cert, host).map_err(|e| format!("{e} ({TLS_HINT})"))
    };
    let peer = auth::accept(&mut stream, &shared.secret, shared.me, &peers, vet)
        .await
        .map_err(|e| e.to_string())?;
    Ok((Box::new(stream), peer, generation))
}

async fn serve(
    shared: Arc<Shared>,
    stream: TcpStream,
    remote: SocketAddr,
    permit: tokio::sync::OwnedSemaphorePermit,
) {
    let me = shared.me;
    let _ = stream.set_nodelay(true);
    let hello = tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake(&shared, stream)).await;
    drop(permit);
    let (stream, peer, mut generation) = match hello {
        Ok(Ok(done)) => done,
        Ok(Err(e)) => return refused(&shared, remote, &e),
        Err(_) => return refused(&shared, remote, &"handshake timed out"),
    };
    bump(&shared.counters.connections_in);
    tracing::info!(node = me, peer, %remote, tls = shared.tls.is_some(), "cluster peer connected");
    let wake = shared
        .redial
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(&peer)
        .cloned();
    if let Some(n) = wake {
        n.notify_one();
    }
    let mut read = BufReader::with_capacity(64 << 10, stream);
    let mut large = match &shared.spool {
        Some(dir) => {
            let n = shared.links_in.fetch_add(1, Ordering::Relaxed);
            pieces::Incoming::spooled(
                dir.join(format!("{peer}.{n}.part")),
                shared.spooling.clone(),
            )
        }
        None => pieces::Incoming::default(),
    };
    // The peer's own connection ending is the first sign of its death: the Raft thread hears of
    // it at once (see `MultiRaft::peer_lost`).
    let lost = |shared: &Shared| {
        let batch = NodeBatch {
            from: peer,
            boot: 0,
            to: me,
            draining: false,
            msgs: Vec::new(),
            forwards: Vec::new(),
        };
        let _ = shared.inbound.try_send(Queued {
            batch,
            bytes: 0,
            lost: true,
        });
    };

    loop {
        let frame = match wire::read_frame(&mut read).await {
            Ok(Some(frame)) => frame,
            Ok(None) => {
                tracing::info!(node = me, peer, %remote, "cluster peer disconnected");
                return lost(&shared);
            }
            Err(WireError::Io(e)) => {
                tracing::info!(node = me, peer, %remote, error = %e, "cluster peer disconnected");
                return lost(&shared);
            }
            Err(e) => return bad_frame(&shared, peer, remote, &e),
        };
        let now = shared.generation.load(Ordering::Acquire);
        if now != generation {
            generation = now;
            let member = shared
                .peers
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .contains_key(&peer);
            if !member {
                tracing::info!(node = me, peer, %remote, "link from a forgotten node closed");
                return;
            }
        }
        // Decoded before the budget is asked: the pieces of a large message are held here, not
        // queued for the Raft thread, and a piece dropped would lose the whole message.
        let mut bytes = frame.len();
        let mut batch = match wire::decode_batch(frame) {
            Ok(b) => b,
            Err(e) => return bad_frame(&shared, peer, remote, &e),
        };
        if batch.from != peer || batch.to != me {
            let e = format!("batch from {} to {} on this link", batch.from, batch.to);
            return bad_frame(&shared, peer, remote, &e);
        }
        if batch.forwards.iter().any(|f| f.group == super::PIECE) {
            for f in std::mem::take(&mut batch.forwards) {
                if f.group != super::PIECE {
                    batch.forwards.push(f);
                    continue;
                }
                bytes = bytes.saturating_sub(f.data.len());
                // Spooling a piece is a blocking write of megabytes into the page cache (the
                // kernel's copy alone held this runtime's one worker for 2 to 3 s of a 540 MB
                // snapshot, with every other link's heartbeats and acks behind it): the
                // runtime hands its other tasks to another thread meanwhile.
                let taken = tokio::task::block_in_place(|| large.take(f.data, Instant::now()));
                match taken {
                    Ok(None) => {}
                    // Not counted in the budget: a link holds one such message at a time.
                    Ok(Some(whole)) => {
                        bump(&shared.counters.pieced_in);
                        let one = NodeBatch {
                            from: peer,
                            boot: batch.boot,
                            to: me,
                            draining: batch.draining,
                            msgs: vec![whole],
                            forwards: Vec::new(),
                        };
                        if !deliver(&shared, one, 0) {
                            return;
                        }
                    }
                    Err(e) => return bad_frame(&shared, peer, remote, &e),
                }
            }
        }
        if !shared.inbound_budget.take(bytes) {
            bump(&shared.counters.dropped_in);
            continue;
        }
        if !deliver(&shared, batch, bytes) {
            return;
        }
    }
}

/// Hands a batch holding `bytes` of the inbound budget to the Raft thread (dropped if its
/// queue is full, giving the bytes back); false once the Raft thread is gone.
fn deliver(shared: &Shared, batch: NodeBatch, bytes: usize) -> bool {
    match shared.inbound.try_send(Queued {
        batch,
        bytes,
        lost: false,
    }) {
        Ok(()) => {
            bump(&shared.counters.batches_in);
            true
        }
        Err(crossbeam_channel::TrySendError::Full(_)) => {
            shared.inbound_budget.give(bytes);
            bump(&shared.counters.dropped_in);
            true
        }
        Err(crossbeam_channel::TrySendError::Disconnected(_)) => false,
    }
}

fn bad_frame(shared: &Shared, peer: NodeId, remote: SocketAddr, e: &dyn std::fmt::Display) {
    bump(&shared.counters.bad_frames);
    tracing::warn!(node = shared.me, peer, %remote, error = %e, "bad frame from cluster peer; dropping the connection");
}

fn refused(shared: &Shared, remote: SocketAddr, e: &dyn std::fmt::Display) {
    bump(&shared.counters.refused);
    let now = Instant::now();
    let first = {
        let Ok(mut logged) = shared.refusals_logged.lock() else {
            return;
        };
        if logged.len() >= 1024 {
            logged.clear();
        }
        match logged.get(&remote.ip()) {
            Some(at) if now.duration_since(*at) < REFUSAL_LOG_EVERY => false,
            _ => {
                logged.insert(remote.ip(), now);
                true
            }
        }
    };
    if first {
        tracing::warn!(node = shared.me, %remote, error = %e, "cluster connection refused");
    } else {
        tracing::debug!(node = shared.me, %remote, error = %e, "cluster connection refused");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_budget_refuses_what_would_exceed_it_until_bytes_come_back() {
        let b = Budget::new(100);
        assert!(b.take(60));
        assert!(!b.take(41));
        assert!(b.take(40));
        assert!(!b.take(1));
        b.give(60);
        assert!(b.take(60));
        assert!(!b.take(usize::MAX));
    }
}
