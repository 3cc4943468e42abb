//! Slow and stalled clients: a consumer that never reads its socket, clients that dribble one byte
//! at a time (slowloris), and hundreds of connections that never finish the handshake. In each,
//! the broker's memory and file descriptors stay bounded and a normal client beside them keeps a
//! round trip of milliseconds.
//!
//! The bounds are wide on purpose, since these run on loaded 2-core machines; each one says what
//! was measured. The tests of this file run one at a time: they measure the broker's memory and a
//! probe's latency, and hold hundreds of sockets, which side by side would disturb each other.

use std::io::{ErrorKind, Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use warren_conformance::raw::frame::{AMQPContentHeader, AMQPFrame};
use warren_conformance::raw::protocol::{basic, connection, AMQPClass};
use warren_conformance::raw::{
    encode, m, AMQPProperties, Handshake, QueueFlags, Raw, RawDelivery, RecvError, PROTOCOL_HEADER,
};
use warren_conformance::{unique, TestBroker, WAIT};

/// One test at a time (an async lock: it is held across the test's awaits, and a failed test
/// does not poison it for the others).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A normal client's round trip (publish to its own queue, get the delivery back) must stay
/// under this while the slow clients are there. Measured: 0.1-0.2 ms alone, 18 ms at worst
/// beside a stalled consumer with 96 MiB going by, 80 ms with two busy loops on both cores as
/// well; a broker that served the slow clients first would take seconds.
const ROUND_TRIP: Duration = Duration::from_secs(1);

/// The handshake timeout the handshake tests give the broker (`--handshake-timeout`, seconds).
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(1);

const MIB: u64 = 1 << 20;

fn auto_delete() -> QueueFlags {
    QueueFlags {
        auto_delete: true,
        ..QueueFlags::default()
    }
}

/// A normal client beside the slow ones.
struct Probe {
    raw: Raw,
    queue: String,
}

impl Probe {
    async fn open(broker: &TestBroker) -> Probe {
        let mut raw = broker.raw().await;
        raw.channel_open(1).await;
        let queue = unique("probe");
        raw.call(1, m::queue_declare(&queue, auto_delete())).await;
        raw.call(1, m::basic_consume(&queue, "probe", true, false))
            .await;
        Probe { raw, queue }
    }

    async fn round_trip(&mut self) -> Duration {
        let t = Instant::now();
        self.raw
            .publish(
                1,
                "",
                &self.queue,
                false,
                AMQPProperties::default(),
                b"ping",
            )
            .await;
        let d = self.raw.recv_delivery().await;
        assert_eq!(d.body, b"ping");
        t.elapsed()
    }
}

/// Open file descriptors of the spawned broker.
fn fd_count(broker: &TestBroker) -> Option<usize> {
    let pid = broker.pid()?;
    Some(std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count())
}

/// Polls `f` until it is true or `within` has passed; returns whether it became true.
fn eventually(within: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    loop {
        if f() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

// ----- a consumer that never reads its socket -----

/// Message size and count published at the stalled consumer's queue: 96 MiB in all.
const BODY: usize = 32 * 1024;
const MESSAGES: usize = 3072;
const BATCH: usize = 32;

/// What the stalled consumer may hold: deliveries written to its socket's kernel buffers
/// (the broker's send buffer grows to 4 MiB on Linux by default, the client's receive buffer
/// stays near its initial 128 KiB since the client never reads), plus what the broker keeps for
/// it unwritten, which stops at the per-connection write backlog (4 MiB) and at most one
/// delivery more. Measured: 257-260 messages (8 MiB) on Warren; 300 (9.4 MiB) on RabbitMQ
/// 3.10.8, which stops a channel at 200 unsent messages per queue. Half of the 96 MiB reach it
/// if nothing stops it (round-robin, prefetch 10,000): 48 MiB, measured with Warren's
/// back-pressure turned off.
const HELD_BOUND: u64 = 24 * MIB;

/// How much the broker's RSS may grow while the 96 MiB go by: the held deliveries above (their
/// bodies in the queue and their encoded frames in the write backlog), the queue kept at most
/// 4 MiB deep by the publisher, the other consumer's window, read buffers, and the allocator's
/// slack. Measured: 27-30 MiB with manual acks, 8-10 MiB with no-ack; 162 MiB with the
/// back-pressure turned off.
const RSS_BOUND: u64 = 64 * MIB;

/// What a consumer saw.
struct Seen {
    got: Vec<bool>,
    unique: usize,
    duplicates: usize,
    redelivered: usize,
}

impl Seen {
    fn new() -> Self {
        Seen {
            got: vec![false; MESSAGES],
            unique: 0,
            duplicates: 0,
            redelivered: 0,
        }
    }

    fn record(&mut self, d: &RawDelivery) {
        let seq = d
            .body
            .get(..8)
            .and_then(|b| <[u8; 8]>::try_from(b).ok())
            .map(u64::from_be_bytes)
            .unwrap_or_else(|| panic!("a delivery without a sequence number: {d:?}"));
        let slot = self
            .got
            .get_mut(seq as usize)
            .unwrap_or_else(|| panic!("sequence number {seq} out of range"));
        if std::mem::replace(slot, true) {
            self.duplicates += 1;
        } else {
            self.unique += 1;
        }
        if d.redelivered() {
            self.redelivered += 1;
        }
    }
}

fn message(seq: usize) -> Vec<u8> {
    let mut body = vec![b'm'; BODY];
    body[..8].copy_from_slice(&(seq as u64).to_be_bytes());
    body
}

/// Takes deliveries and acks each one until `stop`.
async fn consume_and_ack(mut raw: Raw, seen: Arc<Mutex<Seen>>, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::Acquire) {
        match raw.recv_method_timeout(Duration::from_millis(50)).await {
            Ok((ch, method @ AMQPClass::Basic(basic::AMQPMethod::Deliver(_)))) => {
                let d = raw.recv_content(ch, method).await;
                seen.lock().unwrap().record(&d);
                raw.send(ch, m::basic_ack(d.delivery_tag(), false)).await;
            }
            Ok(other) => panic!("the normal consumer got {other:?}"),
            Err(RecvError::Timeout) => {}
            Err(e) => panic!("the normal consumer's connection ended: {e:?}"),
        }
    }
}

/// Polls the queue's ready count until it is at most `depth`.
async fn wait_depth(raw: &mut Raw, queue: &str, depth: u32) {
    let deadline = Instant::now() + WAIT;
    loop {
        let passive = QueueFlags {
            passive: true,
            ..QueueFlags::default()
        };
        let ready = match raw.call(1, m::queue_declare(queue, passive)).await {
            AMQPClass::Queue(warren_conformance::raw::protocol::queue::AMQPMethod::DeclareOk(
                ok,
            )) => ok.message_count,
            other => panic!("expected queue.declare-ok, got {other:?}"),
        };
        if ready <= depth {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{queue} still has {ready} ready messages after {WAIT:?}: the normal consumer is not served"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// A consumer subscribes and then never reads its socket while 96 MiB are published to its
/// queue; a second consumer on the queue takes them, and a probe on another queue keeps its
/// round trip. What the stalled consumer holds, and the broker's memory, stay bounded.
async fn stalled_consumer(no_ack: bool) {
    let _serial = SERIAL.lock().await;
    let broker = TestBroker::start();
    let queue = unique("stalled");
    let mut publisher = broker.raw().await;
    publisher.channel_open(1).await;
    publisher
        .call(1, m::queue_declare(&queue, auto_delete()))
        .await;

    let mut stuck = broker.raw().await;
    stuck.channel_open(1).await;
    if !no_ack {
        // Prefetch is not what stops it here: 10,000 messages are 320 MiB.
        stuck.call(1, m::basic_qos(10_000, false)).await;
    }
    stuck
        .call(1, m::basic_consume(&queue, "stuck", no_ack, false))
        .await;

    let mut normal = broker.raw().await;
    normal.channel_open(1).await;
    normal.call(1, m::basic_qos(200, false)).await;
    normal
        .call(1, m::basic_consume(&queue, "normal", false, false))
        .await;
    let seen = Arc::new(Mutex::new(Seen::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let taker = tokio::spawn(consume_and_ack(normal, seen.clone(), stop.clone()));

    let mut probe = Probe::open(&broker).await;
    let quiet = probe.round_trip().await;
    let rss_before = broker.rss_bytes();
    let mut rss_peak = rss_before;
    let mut slowest = Duration::ZERO;
    let started = Instant::now();
    for batch in 0..MESSAGES / BATCH {
        let mut bytes = Vec::with_capacity(BATCH * (BODY + 256));
        for seq in batch * BATCH..(batch + 1) * BATCH {
            let props = AMQPProperties::default();
            bytes.extend(publisher.encode_publish(1, "", &queue, false, props, &message(seq)));
        }
        publisher.send_bytes(&bytes).await;
        // The queue kept shallow: the broker's growth is then what the stalled consumer costs,
        // not the depth of a queue that outruns its consumer.
        wait_depth(&mut publisher, &queue, 4 * BATCH as u32).await;
        rss_peak = rss_peak.max(broker.rss_bytes());
        if batch % 8 == 0 {
            slowest = slowest.max(probe.round_trip().await);
        }
    }
    wait_depth(&mut publisher, &queue, 0).await;
    let published_in = started.elapsed();

    let held = if no_ack {
        // What was sent to it is gone from the queue; read it now to count it, and check
        // that every message reached one consumer or the other.
        let mut held = 0;
        let deadline = Instant::now() + WAIT;
        while seen.lock().unwrap().unique + held < MESSAGES {
            assert!(
                Instant::now() < deadline,
                "after {WAIT:?} the consumers have {} + {held} of {MESSAGES} messages",
                seen.lock().unwrap().unique
            );
            match stuck.recv_method_timeout(Duration::from_millis(50)).await {
                Ok((ch, method)) => {
                    stuck.recv_content(ch, method).await;
                    held += 1;
                }
                Err(RecvError::Timeout) => {}
                Err(e) => panic!("the stalled consumer's connection ended: {e:?}"),
            }
        }
        held
    } else {
        // Dropping the socket with unread data in it resets the connection: its unacked
        // deliveries go back to the queue, and to the other consumer.
        drop(stuck);
        let deadline = Instant::now() + WAIT;
        while seen.lock().unwrap().unique < MESSAGES {
            assert!(
                Instant::now() < deadline,
                "after the stalled consumer closed, the other has {} of {MESSAGES} messages",
                seen.lock().unwrap().unique
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        seen.lock().unwrap().redelivered
    };
    stop.store(true, Ordering::Release);
    taker.await.expect("the normal consumer failed");
    let seen = seen.lock().unwrap();
    let held_bytes = (held * BODY) as u64;
    eprintln!(
        "no_ack={no_ack}: published {} MiB in {published_in:?}; the stalled consumer held {held} \
         messages ({} MiB); probe round trip {quiet:?} quiet, {slowest:?} at worst; RSS {:?} MiB \
         before, {:?} MiB at peak",
        (MESSAGES * BODY) as u64 / MIB,
        held_bytes / MIB,
        rss_before.map(|b| b / MIB),
        rss_peak.map(|b| b / MIB),
    );
    assert_eq!(seen.duplicates, 0, "a message was delivered twice");
    if !no_ack {
        assert_eq!(
            seen.redelivered, held,
            "only the stalled consumer's messages come back"
        );
    }
    assert!(
        held_bytes <= HELD_BOUND,
        "the stalled consumer was sent {} MiB (bound {} MiB)",
        held_bytes / MIB,
        HELD_BOUND / MIB
    );
    assert!(
        slowest < ROUND_TRIP,
        "a probe round trip took {slowest:?} while a consumer was stalled"
    );
    if let (Some(before), Some(peak)) = (rss_before, rss_peak) {
        let grown = peak.saturating_sub(before);
        assert!(
            grown < RSS_BOUND,
            "the broker grew by {} MiB (bound {} MiB)",
            grown / MIB,
            RSS_BOUND / MIB
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_consumer_with_manual_acks_holds_a_bounded_window() {
    stalled_consumer(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_no_ack_consumer_is_sent_a_bounded_amount() {
    stalled_consumer(true).await;
}

// ----- clients that dribble -----

/// A connection that sends its script one byte at a time.
struct Dribbler {
    stream: std::net::TcpStream,
    script: Vec<u8>,
    sent: usize,
    opened: Instant,
    /// How long after `opened` the broker closed it. `opened` is taken before the connect,
    /// so that a test preempted after it cannot see the broker close early.
    closed: Option<Duration>,
}

impl Dribbler {
    fn new(stream: std::net::TcpStream, script: Vec<u8>, opened: Instant) -> Dribbler {
        stream.set_nonblocking(true).expect("a non-blocking socket");
        Dribbler {
            stream,
            script,
            sent: 0,
            opened,
            closed: None,
        }
    }

    /// Reads (and drops) what the broker sent; notes when it closed.
    fn watch(&mut self) {
        let mut buf = [0u8; 4096];
        while self.closed.is_none() {
            match self.stream.read(&mut buf) {
                Ok(0) => self.closed = Some(self.opened.elapsed()),
                Ok(_) => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(_) => self.closed = Some(self.opened.elapsed()),
            }
        }
    }

    fn next_byte(&mut self) {
        let Some(byte) = self.script.get(self.sent..self.sent + 1) else {
            return;
        };
        match self.stream.write(byte) {
            Ok(1) => self.sent += 1,
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            Err(_) => self.closed = Some(self.opened.elapsed()),
        }
    }
}

/// Dribbles on its own thread (so the test's runtime is not what slows the probe) until told
/// to stop or every connection is closed; returns the connections.
fn dribble(
    mut conns: Vec<Dribbler>,
    every: Duration,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<Vec<Dribbler>> {
    std::thread::spawn(move || {
        let mut next = Instant::now();
        while !stop.load(Ordering::Acquire) && conns.iter().any(|c| c.closed.is_none()) {
            let write = Instant::now() >= next;
            if write {
                next += every;
            }
            for c in conns.iter_mut() {
                c.watch();
                if write && c.closed.is_none() {
                    c.next_byte();
                }
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        conns
    })
}

fn connect(broker: &TestBroker) -> std::net::TcpStream {
    let s = std::net::TcpStream::connect_timeout(&broker.addr(), WAIT)
        .unwrap_or_else(|e| panic!("connect to {}: {e}", broker.addr()));
    s.set_nodelay(true).ok();
    s
}

fn start_ok() -> Vec<u8> {
    let hs = Handshake::default();
    encode(&AMQPFrame::Method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
            client_properties: hs.client_properties,
            mechanism: hs.mechanism.as_str().into(),
            response: hs.response.into(),
            locale: "en_US".into(),
        })),
    ))
}

/// Clients that dribble the protocol header and the handshake are closed when the handshake
/// timeout runs out, counted from the TCP connection, whatever they have sent by then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dribbled_handshake_is_closed_at_the_handshake_timeout() {
    let _serial = SERIAL.lock().await;
    let secs = HANDSHAKE_TIMEOUT.as_secs().to_string();
    let broker = TestBroker::start_with(&["--handshake-timeout", &secs]);
    if broker.is_external() {
        eprintln!("SKIPPED: needs --handshake-timeout (RabbitMQ's handshake_timeout is 10 s)");
        return;
    }
    let mut probe = Probe::open(&broker).await;
    let fds_before = fd_count(&broker).expect("fd count");
    let rss_before = broker.rss_bytes().expect("rss");

    let mut conns = Vec::new();
    for _ in 0..100 {
        // The header's last byte goes at 0.7 s, start-ok follows: a timer that started with
        // the header would let it live to 1.7 s.
        let mut script = PROTOCOL_HEADER.to_vec();
        script.extend(start_ok());
        let opened = Instant::now();
        conns.push(Dribbler::new(connect(&broker), script, opened));
    }
    for _ in 0..100 {
        let opened = Instant::now();
        let mut s = connect(&broker);
        s.write_all(PROTOCOL_HEADER).expect("send the header");
        conns.push(Dribbler::new(s, start_ok(), opened));
    }
    let stop = Arc::new(AtomicBool::new(false));
    let dribbling = dribble(conns, Duration::from_millis(100), stop.clone());

    let mut slowest = Duration::ZERO;
    let t0 = Instant::now();
    while t0.elapsed() < HANDSHAKE_TIMEOUT * 3 / 4 {
        slowest = slowest.max(probe.round_trip().await);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let rss_during = broker.rss_bytes().expect("rss");
    let deadline = Instant::now() + WAIT;
    while !dribbling.is_finished() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.store(true, Ordering::Release);
    let conns = dribbling.join().expect("the dribbling thread");
    let times: Vec<Duration> = conns.iter().filter_map(|c| c.closed).collect();
    assert_eq!(
        times.len(),
        conns.len(),
        "{} of {} dribbling handshakes still open after {WAIT:?}",
        conns.len() - times.len(),
        conns.len()
    );
    let first = times.iter().min().copied().unwrap_or_default();
    let last = times.iter().max().copied().unwrap_or_default();
    eprintln!(
        "200 dribbled handshakes closed after {first:?} to {last:?}; probe round trip at worst \
         {slowest:?}; RSS {} -> {} MiB",
        rss_before / MIB,
        rss_during / MIB
    );
    // Never before the timeout (the broker's timers do not fire early) ...
    assert!(
        first >= HANDSHAKE_TIMEOUT - Duration::from_millis(50),
        "a dribbled handshake was closed after {first:?}, before the timeout"
    );
    // ... and not long after it (measured: within 30 ms; the margin is for a loaded machine,
    // and still well under the 1.7 s of a timer restarted by the header).
    assert!(
        last < HANDSHAKE_TIMEOUT + Duration::from_millis(600),
        "a dribbled handshake lived {last:?} with a {HANDSHAKE_TIMEOUT:?} handshake timeout"
    );
    assert!(
        slowest < ROUND_TRIP,
        "a probe round trip took {slowest:?} beside 200 dribbling handshakes"
    );
    // 200 connections with a partial start-ok each: measured 2-3 MiB.
    assert!(
        rss_during.saturating_sub(rss_before) < 16 * MIB,
        "200 dribbling handshakes cost {} MiB",
        rss_during.saturating_sub(rss_before) / MIB
    );
    assert!(
        eventually(WAIT, || fd_count(&broker) <= Some(fds_before)),
        "the broker holds {:?} file descriptors, {fds_before} before",
        fd_count(&broker)
    );
    probe.round_trip().await;
}

/// Clients past the handshake that send a frame one byte at a time: each holds at most one
/// partial frame (at most frame_max); the ones that negotiated heartbeats are closed after two
/// intervals without a whole frame; the others stay and cost little.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frame_dribbled_after_the_handshake_holds_one_partial_frame() {
    let _serial = SERIAL.lock().await;
    let broker = TestBroker::start();
    let queue = unique("dribbled");
    let mut probe = Probe::open(&broker).await;
    let rss_before = broker.rss_bytes();

    const BODY_SIZE: u32 = 120_000;
    let mut conns = Vec::new();
    let mut with_heartbeats = Vec::new();
    for i in 0..200 {
        let heartbeat = if i % 4 == 0 { 1 } else { 0 };
        let mut raw = Raw::open_with(
            broker.addr(),
            Handshake {
                heartbeat,
                ..Handshake::default()
            },
        )
        .await;
        raw.channel_open(1).await;
        // A publish whose body frame header announces nearly frame_max: the broker may
        // keep room for it, and no more.
        let mut head = encode(&AMQPFrame::Method(
            1,
            AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
                exchange: "".into(),
                routing_key: queue.as_str().into(),
                mandatory: false,
                immediate: false,
            })),
        ));
        head.extend(encode(&AMQPFrame::Header(
            1,
            AMQPContentHeader {
                class_id: 60,
                body_size: BODY_SIZE.into(),
                properties: AMQPProperties::default(),
            },
        )));
        head.push(3);
        head.extend_from_slice(&1u16.to_be_bytes());
        head.extend_from_slice(&BODY_SIZE.to_be_bytes());
        raw.send_bytes(&head).await;
        let opened = Instant::now();
        let d = Dribbler::new(raw.into_std(), vec![b'd'; BODY_SIZE as usize], opened);
        if heartbeat > 0 {
            with_heartbeats.push(conns.len());
        }
        conns.push(d);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let dribbling = dribble(conns, Duration::from_millis(150), stop.clone());

    // Two heartbeat intervals, and a second for the broker to notice.
    let mut slowest = Duration::ZERO;
    let mut rss_peak = rss_before;
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(3) {
        slowest = slowest.max(probe.round_trip().await);
        rss_peak = rss_peak.max(broker.rss_bytes());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.store(true, Ordering::Release);
    let conns = dribbling.join().expect("the dribbling thread");
    let closed: Vec<Option<Duration>> = conns.iter().map(|c| c.closed).collect();
    eprintln!(
        "200 dribbling connections: probe round trip at worst {slowest:?}; RSS {:?} -> {:?} MiB \
         at peak; closed: {} with heartbeats, {} without",
        rss_before.map(|b| b / MIB),
        rss_peak.map(|b| b / MIB),
        with_heartbeats
            .iter()
            .filter(|&&i| closed[i].is_some())
            .count(),
        (0..closed.len())
            .filter(|i| !with_heartbeats.contains(i) && closed[*i].is_some())
            .count(),
    );
    assert!(
        slowest < ROUND_TRIP,
        "a probe round trip took {slowest:?} beside 200 dribbling connections"
    );
    for (i, c) in closed.iter().enumerate() {
        if !with_heartbeats.contains(&i) {
            // Without heartbeats nothing limits a slow frame but frame_max (as in RabbitMQ).
            assert_eq!(
                *c, None,
                "a dribbling connection without heartbeats was closed"
            );
        } else if !broker.is_external() {
            // Warren counts whole frames as signs of life; RabbitMQ counts bytes and keeps a
            // client that sends a byte per heartbeat interval.
            let t = c.unwrap_or_else(|| {
                panic!("a connection that sent no whole frame for 3 s at heartbeat 1 s is open")
            });
            assert!(
                t >= Duration::from_millis(1500),
                "closed after {t:?}: a client may be silent for two intervals"
            );
        }
    }
    if let (Some(before), Some(peak)) = (rss_before, rss_peak) {
        // At most one frame each: 200 x 128 KiB = 25 MiB if every reserved page were touched.
        // Measured: 4 MiB, since only the bytes that arrived are written.
        let grown = peak.saturating_sub(before);
        assert!(
            grown < 40 * MIB,
            "200 dribbling connections cost {} MiB",
            grown / MIB
        );
    }
    drop(conns);
    probe.round_trip().await;
}

// ----- connections that never finish the handshake -----

/// How many idle connections the test opens: 500, or fewer if the file descriptor limit (which
/// the spawned broker inherits) leaves less room.
fn idle_connections() -> usize {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct it is given.
    let soft = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 {
        lim.rlim_cur
    } else {
        1024
    };
    (soft.saturating_sub(128) as usize).clamp(50, 500)
}

/// Hundreds of connections that send nothing, or only the protocol header, are closed at the
/// handshake timeout; the broker's file descriptors return to where they were, its memory stays
/// flat, and a new client connects and works while they are there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundreds_of_unfinished_handshakes_are_closed_and_cost_little() {
    let _serial = SERIAL.lock().await;
    let secs = HANDSHAKE_TIMEOUT.as_secs().to_string();
    let broker = TestBroker::start_with(&["--handshake-timeout", &secs]);
    if broker.is_external() {
        eprintln!("SKIPPED: needs --handshake-timeout (RabbitMQ's handshake_timeout is 10 s)");
        return;
    }
    let mut probe = Probe::open(&broker).await;
    let fds_before = fd_count(&broker).expect("fd count");
    let rss_before = broker.rss_bytes().expect("rss");
    let n = idle_connections();

    let mut conns = Vec::with_capacity(n);
    for i in 0..n {
        let opened = Instant::now();
        let mut s = connect(&broker);
        if i % 2 == 1 {
            s.write_all(PROTOCOL_HEADER).expect("send the header");
        }
        conns.push(Dribbler::new(s, Vec::new(), opened));
    }
    let stop = Arc::new(AtomicBool::new(false));
    let watching = dribble(conns, Duration::from_millis(100), stop.clone());

    // While they are all there: a new client connects and works, the probe keeps its pace.
    let mut fds_peak = 0;
    let mut rss_peak = rss_before;
    let mut fresh = broker.raw().await;
    fresh.channel_open(1).await;
    let q = unique("meanwhile");
    fresh.call(1, m::queue_declare(&q, auto_delete())).await;
    fresh
        .publish(1, "", &q, false, AMQPProperties::default(), b"hello")
        .await;
    let got = fresh.get(1, &q, true).await.expect("the message back");
    assert_eq!(got.body, b"hello");
    fresh.close().await;
    let mut slowest = Duration::ZERO;
    let t0 = Instant::now();
    while t0.elapsed() < HANDSHAKE_TIMEOUT / 2 {
        slowest = slowest.max(probe.round_trip().await);
        fds_peak = fds_peak.max(fd_count(&broker).unwrap_or(0));
        rss_peak = rss_peak.max(broker.rss_bytes().unwrap_or(0));
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let deadline = Instant::now() + WAIT;
    while !watching.is_finished() && Instant::now() < deadline {
        rss_peak = rss_peak.max(broker.rss_bytes().unwrap_or(0));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.store(true, Ordering::Release);
    let conns = watching.join().expect("the watching thread");
    let times: Vec<Duration> = conns.iter().filter_map(|c| c.closed).collect();
    let first = times.iter().min().copied().unwrap_or_default();
    let last = times.iter().max().copied().unwrap_or_default();
    eprintln!(
        "{n} unfinished handshakes: broker fds {fds_before} -> {fds_peak} at peak; closed after \
         {first:?} to {last:?}; probe round trip at worst {slowest:?}; RSS {} -> {} MiB at peak",
        rss_before / MIB,
        rss_peak / MIB
    );
    assert_eq!(
        times.len(),
        n,
        "{} of {n} unfinished handshakes still open after {WAIT:?}",
        n - times.len()
    );
    assert!(
        fds_peak >= fds_before + n / 2,
        "the broker never held the connections ({fds_before} -> {fds_peak} descriptors)"
    );
    assert!(
        first >= HANDSHAKE_TIMEOUT - Duration::from_millis(50),
        "an idle connection was closed after {first:?}, before the timeout"
    );
    // Measured: all closed within 50 ms of the timeout; the margin is for a loaded machine,
    // short of the 1 s SYN retransmit a connect waits when the listen backlog overflows (the
    // broker then accepts it a second late).
    assert!(
        last < HANDSHAKE_TIMEOUT + Duration::from_millis(900),
        "an idle connection lived {last:?} with a {HANDSHAKE_TIMEOUT:?} handshake timeout"
    );
    assert!(
        slowest < ROUND_TRIP,
        "a probe round trip took {slowest:?} beside {n} unfinished handshakes"
    );
    // Measured: 3 MiB for 500 (a task, a socket and a small buffer each).
    let grown = rss_peak.saturating_sub(rss_before);
    assert!(
        grown < 32 * MIB,
        "{n} unfinished handshakes cost {} MiB",
        grown / MIB
    );
    drop(conns);
    assert!(
        eventually(WAIT, || fd_count(&broker) <= Some(fds_before)),
        "the broker holds {:?} file descriptors, {fds_before} before",
        fd_count(&broker)
    );
    probe.round_trip().await;
}
