//! Raw client bytes into a `warren_session::Node`, as the server's read loop hands them
//! over: protocol header, a valid PLAIN guest/guest handshake (so the fuzzer starts with an
//! open connection and reaches channels), then the input split into frames by the codec's
//! `FrameDecoder` (frame_max as negotiated), each frame to `handle_frame`, a decode error
//! to `decode_error`. The first input byte sets how far the simulated clock moves per
//! frame; timers run (`tick`) and output is drained (`poll_transmit`) after every frame.
//! Checked: no panic; after the socket goes away (`connection_lost`), no connection is left
//! and no queue holds an unsettled delivery or a consumer (the invariants of the session
//! crate's property test); the recorded queue log decodes to itself and replays to the
//! live queues.
//!
//! The `unwrap`s and `expect`s below are this harness's assertions (a failed one is the
//! finding libFuzzer reports); none is in code a client reaches.
#![no_main]

use bytes::{Bytes, BytesMut};
use libfuzzer_sys::fuzz_target;
use warren_broker::{Broker, BrokerConfig};
use warren_codec::{
    decode_protocol_header, ConnectionOpen, ConnectionStartOk, ConnectionTuneOk, FieldTable, Frame,
    FrameDecoder, Method, ShortStr, PROTOCOL_HEADER,
};
use warren_session::{Node, SessionConfig, Transmit};

const CONN: u64 = 1;
const FRAME_MAX: u32 = 131_072;

/// Milliseconds the clock moves per frame, from the first input byte: 0 up to hours, so
/// heartbeats, TTLs and consumer timeouts can come due.
fn step_ms(b: u8) -> u64 {
    const SCALE: [u64; 8] = [0, 1, 10, 100, 1_000, 10_000, 100_000, 1_000_000];
    SCALE[usize::from(b & 7)] * u64::from((b >> 3) + 1)
}

/// The handshake a client library sends after the protocol header.
fn handshake() -> BytesMut {
    let mut out = BytesMut::new();
    let mut method = |m: Method| {
        Frame::Method {
            channel: 0,
            method: m,
        }
        .encode(&mut out)
    };
    method(
        ConnectionStartOk {
            client_properties: FieldTable::default(),
            mechanism: ShortStr::from("PLAIN"),
            response: Bytes::from_static(b"\0guest\0guest"),
            locale: ShortStr::from("en_US"),
        }
        .into(),
    );
    method(
        ConnectionTuneOk {
            channel_max: 0,
            frame_max: FRAME_MAX,
            heartbeat: 60,
        }
        .into(),
    );
    method(
        ConnectionOpen {
            virtual_host: ShortStr::from("/"),
            ..Default::default()
        }
        .into(),
    );
    out
}

/// `NODE_FRAMES_TRACE=1` prints every frame both ways (to check what a seed reaches:
/// `cargo +nightly fuzz run node_frames corpus/node_frames/SEED`).
fn trace() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("NODE_FRAMES_TRACE").is_some())
}

struct Driver {
    node: Node,
    decoder: FrameDecoder,
    now: u64,
    closed: bool,
    out: Vec<Transmit>,
}

impl Driver {
    /// Runs due timers, completes store writes (a store that never fails) and drains
    /// output, as the server's driver does.
    fn pump(&mut self) {
        while let Some(batch) = self.node.take_writes() {
            self.node.writes_done(batch.number, true, self.now);
        }
        if self.node.next_deadline().is_some_and(|at| at <= self.now) {
            self.node.tick(self.now);
        }
        self.node.poll_transmit(self.now, &mut self.out);
        for t in self.out.drain(..) {
            assert_eq!(t.conn, CONN);
            if let Some(fm) = t.frame_max {
                self.decoder.set_frame_max(fm);
            }
            // Whatever the node writes must be well-formed frames.
            let mut buf = BytesMut::from(&t.bytes[..]);
            let mut check = FrameDecoder::new(0);
            while let Some(frame) = check.decode(&mut buf).expect("node wrote a bad frame") {
                if trace() {
                    eprintln!("{:>8} <- {frame:?}", self.now);
                }
            }
            assert!(buf.is_empty(), "node wrote a partial frame");
            if t.close {
                self.closed = true;
            }
        }
    }

    /// Feeds bytes as one socket read; false once the connection is over.
    fn read(&mut self, buf: &mut BytesMut, step: u64) -> bool {
        loop {
            if self.closed {
                return false;
            }
            match self.decoder.decode(buf) {
                Ok(Some(frame)) => {
                    self.now += step;
                    if trace() {
                        eprintln!("{:>8} -> {frame:?}", self.now);
                    }
                    self.node.handle_frame(CONN, frame, self.now);
                    self.pump();
                }
                Ok(None) => return true,
                Err(e) => {
                    self.node.decode_error(CONN, &e, self.now);
                    self.pump();
                    return false;
                }
            }
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&first, rest)) = data.split_first() else {
        return;
    };
    let step = step_ms(first);
    let mut broker = Broker::new(BrokerConfig::default());
    broker.set_recording(true);
    let mut node = Node::new(SessionConfig::default(), broker);
    node.apply_config_users(true, &mut || [0, 1, 2, 3]);
    let mut header = BytesMut::from(&PROTOCOL_HEADER[..]);
    assert!(matches!(decode_protocol_header(&mut header), Ok(true)));
    node.connection_opened(CONN, Some("127.0.0.1:1".parse().unwrap()), 0);
    let mut d = Driver {
        node,
        decoder: FrameDecoder::new(FRAME_MAX),
        now: 0,
        closed: false,
        out: Vec::new(),
    };
    d.pump();
    let ok = d.read(&mut handshake(), 0);
    assert!(
        ok && d.node.is_open(CONN),
        "the handshake did not open the connection"
    );
    let mut buf = BytesMut::from(rest);
    d.read(&mut buf, step);

    // The socket goes away (the client's EOF, or after the close the node asked for).
    d.now += step;
    d.pump();
    d.node.connection_lost(CONN);
    d.pump();
    assert_eq!(
        d.node.connection_count(),
        0,
        "a connection outlived its socket"
    );
    for q in d.node.broker().queues("/") {
        assert_eq!(
            q.in_flight, 0,
            "queue {} still has messages in flight",
            q.name
        );
        assert_eq!(q.consumer_count, 0, "queue {} still has consumers", q.name);
    }
    let records = d.node.take_records();
    let mut log = BytesMut::new();
    for r in &records {
        warren_broker::queue::log::encode(r, &mut log);
    }
    let (decoded, truncated) =
        warren_broker::queue::log::decode_all(log.freeze()).expect("the queue log decodes");
    assert!(!truncated);
    assert_eq!(decoded, records, "the queue log does not round trip");
    // Every command applied to a queue was recorded: replaying the log rebuilds each live
    // queue exactly (a queue no command reached is a fresh machine).
    let (_, machines) = warren_broker::queue::log::replay_records(decoded, false)
        .unwrap_or_else(|e| panic!("the queue log does not replay: {e:?}"));
    let fresh = warren_broker::machine::QueueMachine::<warren_broker::Message>::new().digest();
    for q in d.node.broker().queues("/") {
        let live = d
            .node
            .broker()
            .machine(q.id)
            .expect("a listed queue")
            .digest();
        let replayed = machines.get(&q.id.0).map_or(fresh, |m| m.digest());
        assert_eq!(
            replayed, live,
            "replaying the log does not rebuild queue {}",
            q.name
        );
    }
});
