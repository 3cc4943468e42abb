//! The tokio driver: sockets and timers around the sans-IO [`Node`].
//!
//! One core task owns the node and handles events in batches; each connection has a reader task (protocol
//! header, frame decoding) and a writer task. Readers feed the core through one bounded channel, so a core
//! that falls behind stops the readers and TCP pushes back on publishers. The core writes to a socket itself
//! while the socket takes everything at once (the common case: no task wake-up per write); what the socket
//! does not take goes, in order, to the connection's writer task, which waits for the socket.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use tokio::io::AsyncReadExt;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::AbortHandle;
use warren_broker::ConnId;
use warren_codec::{decode_protocol_header, DecodeError, Frame, FrameDecoder, PROTOCOL_HEADER};
use warren_session::Node;

/// Events queued for the core; bounded so readers wait (and stop reading) when the core is busy.
const EVENT_QUEUE: usize = 1024;
/// Events handled per batch before the node's output is flushed, so one busy client can't delay others' bytes.
const BATCH: usize = 256;
/// Read sizes adapt between these: small for quiet clients, large for streaming publishers.
const MIN_READ: usize = 4 * 1024;
const MAX_READ: usize = 128 * 1024;
const TICK: Duration = Duration::from_millis(100);
/// How long a shutdown waits for clients to answer connection.close.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

enum Event {
    Opened {
        conn: ConnId,
        peer: SocketAddr,
        writer: mpsc::UnboundedSender<Outgoing>,
        socket: Arc<OwnedWriteHalf>,
        frame_max: Arc<AtomicU32>,
        pending: Arc<AtomicUsize>,
    },
    Frames {
        conn: ConnId,
        frames: Vec<Frame>,
    },
    DecodeError {
        conn: ConnId,
        error: DecodeError,
    },
    Lost {
        conn: ConnId,
    },
    /// The writer drained below the back-pressure limit.
    Writable {
        conn: ConnId,
    },
}

/// Bytes for a writer task; `close` ends the connection once they are written.
struct Outgoing {
    bytes: Bytes,
    close: bool,
}

struct Writer {
    tx: mpsc::UnboundedSender<Outgoing>,
    socket: Arc<OwnedWriteHalf>,
    frame_max: Arc<AtomicU32>,
    /// Bytes handed to the writer task and not yet written. Shared, so the writer reports only crossings of
    /// the limit instead of every write.
    pending: Arc<AtomicUsize>,
    blocked: bool,
}

/// What a connection's tasks share with the core.
struct Shared {
    frame_max: Arc<AtomicU32>,
    pending: Arc<AtomicUsize>,
    backlog_limit: usize,
}

/// Runs the broker on `listener` until `shutdown` turns true, then closes every connection with 320.
pub async fn serve(
    listener: TcpListener,
    node: Node,
    mut shutdown: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let config = node.config().clone();
    let (events_tx, events_rx) = mpsc::channel(EVENT_QUEUE);
    let core = tokio::spawn(core(node, events_rx, shutdown.clone()));
    let next_id = AtomicU64::new(1);
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
                let conn = next_id.fetch_add(1, Ordering::Relaxed);
                let events = events_tx.clone();
                let frame_max = config.frame_max;
                let backlog_limit = config.write_backlog_limit;
                tokio::spawn(async move {
                    connection(stream, peer, conn, events, frame_max, handshake_timeout, backlog_limit).await;
                });
            }
            _ = shutdown.changed() => break,
        }
    }
    drop(events_tx);
    core.await.map_err(std::io::Error::other)
}

async fn core(
    mut node: Node,
    mut events: mpsc::Receiver<Event>,
    mut shutdown: watch::Receiver<bool>,
) {
    let start = Instant::now();
    let now = || u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX);
    let mut writers: HashMap<ConnId, Writer> = HashMap::new();
    let mut ticker = tokio::time::interval(TICK);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut transmits = Vec::new();
    let backlog_limit = node.config().write_backlog_limit;
    let mut stopping: Option<Instant> = None;
    let mut last_tick = Instant::now();
    loop {
        if node.needs_dispatch() {
            // Deliveries are still possible: take what is queued without waiting, then dispatch again.
            tokio::task::yield_now().await;
            let t = now();
            for _ in 0..BATCH {
                match events.try_recv() {
                    Ok(ev) => handle(&mut node, &mut writers, ev, t),
                    Err(_) => break,
                }
            }
            if last_tick.elapsed() >= TICK {
                last_tick = Instant::now();
                node.tick(t);
            }
            if stopping.is_none() && shutdown.has_changed().unwrap_or(false) {
                shutdown.mark_unchanged();
                tracing::info!(connections = node.connection_count(), "shutting down");
                node.shutdown(t);
                stopping = Some(Instant::now());
            }
        } else {
            tokio::select! {
                ev = events.recv() => {
                    let Some(ev) = ev else { break };
                    let t = now();
                    handle(&mut node, &mut writers, ev, t);
                    for _ in 1..BATCH {
                        match events.try_recv() {
                            Ok(ev) => handle(&mut node, &mut writers, ev, t),
                            Err(_) => break,
                        }
                    }
                }
                _ = ticker.tick() => {
                    last_tick = Instant::now();
                    node.tick(now());
                    if let Some(since) = stopping {
                        if node.connection_count() == 0 || since.elapsed() > SHUTDOWN_GRACE {
                            break;
                        }
                    }
                }
                changed = shutdown.changed(), if stopping.is_none() => {
                    if changed.is_ok() {
                        tracing::info!(connections = node.connection_count(), "shutting down");
                        node.shutdown(now());
                        stopping = Some(Instant::now());
                    }
                }
            }
        }
        node.poll_transmit(now(), &mut transmits);
        for t in transmits.drain(..) {
            let close = t.close;
            let conn = t.conn;
            if let Some(w) = writers.get_mut(&conn) {
                if let Some(fm) = t.frame_max {
                    w.frame_max.store(fm, Ordering::Relaxed);
                }
                if w.transmit(t.bytes, close) >= backlog_limit && !w.blocked {
                    w.blocked = true;
                    node.set_write_blocked(conn, true);
                }
            }
            if close {
                writers.remove(&conn);
            }
        }
    }
    // Let writers flush their last close frames.
    drop(writers);
}

impl Writer {
    /// Writes what the socket takes now, if the writer task holds nothing older, and queues the rest for
    /// the task. Returns the bytes now waiting in the task.
    fn transmit(&self, mut bytes: Bytes, close: bool) -> usize {
        if self.pending.load(Ordering::Acquire) == 0 {
            // Nothing queued, so writing here keeps the order: the task decrements only after writing.
            while !bytes.is_empty() {
                match self.socket.try_write(&bytes) {
                    Ok(n) => {
                        let _ = bytes.split_to(n);
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    // The reader will see the error too and report the connection lost.
                    Err(_) => return 0,
                }
            }
            if bytes.is_empty() && !close {
                return 0;
            }
        }
        let n = bytes.len();
        let pending = self.pending.fetch_add(n, Ordering::AcqRel) + n;
        // A gone writer task means the socket is gone; its Lost event is on the way.
        let _ = self.tx.send(Outgoing { bytes, close });
        pending
    }
}

fn handle(node: &mut Node, writers: &mut HashMap<ConnId, Writer>, ev: Event, now: u64) {
    match ev {
        Event::Opened {
            conn,
            peer,
            writer,
            socket,
            frame_max,
            pending,
        } => {
            writers.insert(
                conn,
                Writer {
                    tx: writer,
                    socket,
                    frame_max,
                    pending,
                    blocked: false,
                },
            );
            node.connection_opened(conn, Some(peer), now);
        }
        Event::Frames { conn, frames } => {
            for frame in frames {
                node.handle_frame(conn, frame, now);
            }
        }
        Event::DecodeError { conn, error } => node.decode_error(conn, &error, now),
        Event::Lost { conn } => {
            writers.remove(&conn);
            node.connection_lost(conn);
        }
        Event::Writable { conn } => {
            if let Some(w) = writers.get_mut(&conn) {
                w.blocked = false;
            }
            node.set_write_blocked(conn, false);
        }
    }
}

async fn connection(
    stream: TcpStream,
    peer: SocketAddr,
    conn: ConnId,
    events: mpsc::Sender<Event>,
    frame_max: u32,
    handshake_timeout: Duration,
    backlog_limit: usize,
) {
    if let Err(e) = stream.set_nodelay(true) {
        tracing::debug!(conn, error = %e, "set_nodelay failed");
    }
    let (mut rd, wr) = stream.into_split();
    let wr = Arc::new(wr);
    match tokio::time::timeout(handshake_timeout, read_protocol_header(&mut rd)).await {
        Ok(Ok(true)) => {}
        Ok(Ok(false)) => {
            // The spec: answer a header we don't speak with the one we do, then close.
            let _ = write_all(&wr, PROTOCOL_HEADER).await;
            return;
        }
        _ => return,
    }
    let shared = Shared {
        frame_max: Arc::new(AtomicU32::new(frame_max)),
        pending: Arc::new(AtomicUsize::new(0)),
        backlog_limit,
    };
    let (tx, rx) = mpsc::unbounded_channel();
    if events
        .send(Event::Opened {
            conn,
            peer,
            writer: tx,
            socket: wr.clone(),
            frame_max: shared.frame_max.clone(),
            pending: shared.pending.clone(),
        })
        .await
        .is_err()
    {
        return;
    }
    let reader = tokio::spawn(read_loop(
        rd,
        conn,
        events.clone(),
        shared.frame_max.clone(),
    ));
    write_loop(wr, rx, conn, events, reader.abort_handle(), shared).await;
}

/// Reads until the 8-byte protocol header is known good (true) or bad (false); a bad prefix is refused
/// as soon as it arrives rather than after 8 bytes.
async fn read_protocol_header(rd: &mut OwnedReadHalf) -> std::io::Result<bool> {
    let mut buf = BytesMut::with_capacity(8);
    loop {
        match decode_protocol_header(&mut buf) {
            Ok(true) => return Ok(true),
            Ok(false) => {}
            Err(_) => return Ok(false),
        }
        let mut byte = [0u8; 8];
        let want = 8 - buf.len();
        let n = rd.read(&mut byte[..want]).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        buf.extend_from_slice(&byte[..n]);
    }
}

async fn read_loop(
    mut rd: OwnedReadHalf,
    conn: ConnId,
    events: mpsc::Sender<Event>,
    frame_max: Arc<AtomicU32>,
) {
    let mut decoder = FrameDecoder::new(frame_max.load(Ordering::Relaxed));
    let mut buf = BytesMut::new();
    let mut read_size = MIN_READ;
    loop {
        if buf.capacity() - buf.len() < MIN_READ {
            // Frames taken out earlier keep their part of the old buffer alive; small reads share one
            // buffer, so a small message does not pin a buffer of its own.
            buf.reserve(read_size);
        }
        let spare = buf.capacity() - buf.len();
        match rd.read_buf(&mut buf).await {
            Ok(0) | Err(_) => {
                let _ = events.send(Event::Lost { conn }).await;
                return;
            }
            // A read that fills the buffer means a busy client: read more at a time; small reads, less.
            Ok(n) if n == spare => read_size = (read_size * 2).min(MAX_READ),
            Ok(n) if n < read_size / 8 => read_size = (read_size / 2).max(MIN_READ),
            Ok(_) => {}
        }
        let fm = frame_max.load(Ordering::Relaxed);
        if fm != decoder.frame_max() {
            decoder.set_frame_max(fm);
        }
        let mut frames = Vec::new();
        let mut failure = None;
        loop {
            match decoder.decode(&mut buf) {
                Ok(Some(frame)) => frames.push(frame),
                Ok(None) => break,
                Err(error) => {
                    failure = Some(error);
                    break;
                }
            }
        }
        if !frames.is_empty() && events.send(Event::Frames { conn, frames }).await.is_err() {
            return;
        }
        if let Some(error) = failure {
            // Nothing after a framing error can be trusted: stop reading; the core closes the connection.
            let _ = events.send(Event::DecodeError { conn, error }).await;
            return;
        }
    }
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

/// Writes what the core could not write at once. The socket's write side shuts down when the last
/// handle (this task's and the core's) is dropped.
async fn write_loop(
    socket: Arc<OwnedWriteHalf>,
    mut rx: mpsc::UnboundedReceiver<Outgoing>,
    conn: ConnId,
    events: mpsc::Sender<Event>,
    reader: AbortHandle,
    shared: Shared,
) {
    while let Some(out) = rx.recv().await {
        if write_all(&socket, &out.bytes).await.is_err() {
            break;
        }
        let written = out.bytes.len();
        let before = shared.pending.fetch_sub(written, Ordering::AcqRel);
        let limit = shared.backlog_limit;
        if before >= limit
            && before - written < limit
            && events.send(Event::Writable { conn }).await.is_err()
        {
            break;
        }
        if out.close {
            break;
        }
    }
    drop(socket);
    reader.abort();
    let _ = events.send(Event::Lost { conn }).await;
}
