//! A raw-socket AMQP 0-9-1 client for tests that must see or send what real client libraries hide: the class
//! and method ids of a close, frame sizes, heartbeats, methods in the wrong order, malformed frames.
//!
//! Encoding and decoding of well-formed frames is done by `amq-protocol` (an implementation independent of
//! Warren's codec); malformed input is written byte by byte with [`Raw::send_bytes`].

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::time::Duration;

use amq_protocol::frame::{gen_frame, parse_frame, AMQPContentHeader, AMQPFrame, WriteContext};
use amq_protocol::protocol::{basic, channel, confirm, connection, exchange, queue, tx, AMQPClass};
use amq_protocol::types::{AMQPValue, FieldTable, LongString, ShortString};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::WAIT;

pub use amq_protocol::protocol::basic::AMQPProperties;
pub use amq_protocol::{frame, protocol, types};

/// The AMQP 0-9-1 protocol header.
pub const PROTOCOL_HEADER: &[u8; 8] = b"AMQP\x00\x00\x09\x01";

/// One frame as it came off the wire.
#[derive(Debug, Clone)]
pub struct Frame {
    /// 1 method, 2 content header, 3 body, 8 heartbeat.
    pub kind: u8,
    pub channel: u16,
    /// Payload size from the frame header.
    pub size: u32,
    pub payload: Vec<u8>,
    /// The decoded frame (None if amq-protocol cannot decode it).
    pub parsed: Option<AMQPFrame>,
}

/// How a receive ended without a frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecvError {
    /// The peer closed the socket (EOF or reset).
    Closed(String),
    /// Nothing arrived within the timeout.
    Timeout,
}

/// A delivery received with basic.deliver or basic.get-ok.
#[derive(Debug, Clone)]
pub struct RawDelivery {
    pub channel: u16,
    pub method: AMQPClass,
    pub properties: AMQPProperties,
    pub body: Vec<u8>,
    /// The content header payload after class id, weight and body size: property flags and property values
    /// exactly as the broker sent them.
    pub property_bytes: Vec<u8>,
    /// Payload sizes of the body frames that carried the body.
    pub body_frame_sizes: Vec<u32>,
}

impl RawDelivery {
    pub fn delivery_tag(&self) -> u64 {
        match &self.method {
            AMQPClass::Basic(basic::AMQPMethod::Deliver(d)) => d.delivery_tag,
            AMQPClass::Basic(basic::AMQPMethod::GetOk(g)) => g.delivery_tag,
            other => panic!("not a delivery: {other:?}"),
        }
    }
    pub fn redelivered(&self) -> bool {
        match &self.method {
            AMQPClass::Basic(basic::AMQPMethod::Deliver(d)) => d.redelivered,
            AMQPClass::Basic(basic::AMQPMethod::GetOk(g)) => g.redelivered,
            other => panic!("not a delivery: {other:?}"),
        }
    }
    pub fn consumer_tag(&self) -> String {
        match &self.method {
            AMQPClass::Basic(basic::AMQPMethod::Deliver(d)) => d.consumer_tag.to_string(),
            other => panic!("not a basic.deliver: {other:?}"),
        }
    }
}

/// Options for the connection handshake.
#[derive(Debug, Clone)]
pub struct Handshake {
    pub mechanism: String,
    pub response: Vec<u8>,
    pub client_properties: FieldTable,
    /// None: echo the server's channel_max.
    pub channel_max: Option<u16>,
    /// None: echo the server's frame_max.
    pub frame_max: Option<u32>,
    /// Heartbeat to send in tune-ok (0 = none).
    pub heartbeat: u16,
    pub vhost: String,
}

impl Default for Handshake {
    fn default() -> Self {
        Handshake {
            mechanism: "PLAIN".into(),
            response: plain_response("guest", "guest"),
            client_properties: client_properties(),
            channel_max: None,
            frame_max: None,
            heartbeat: 0,
            vhost: "/".into(),
        }
    }
}

/// PLAIN: `\0user\0password`.
pub fn plain_response(user: &str, password: &str) -> Vec<u8> {
    format!("\0{user}\0{password}").into_bytes()
}

/// AMQPLAIN: a field table without its length prefix, LOGIN and PASSWORD as long strings.
pub fn amqplain_response(user: &str, password: &str) -> Vec<u8> {
    let mut out = Vec::new();
    for (k, v) in [("LOGIN", user), ("PASSWORD", password)] {
        out.push(k.len() as u8);
        out.extend_from_slice(k.as_bytes());
        out.push(b'S');
        out.extend_from_slice(&(v.len() as u32).to_be_bytes());
        out.extend_from_slice(v.as_bytes());
    }
    out
}

/// Client properties like those of RabbitMQ's own clients, capabilities included.
pub fn client_properties() -> FieldTable {
    let mut caps = FieldTable::default();
    for cap in [
        "authentication_failure_close",
        "basic.nack",
        "connection.blocked",
        "consumer_cancel_notify",
        "exchange_exchange_bindings",
        "publisher_confirms",
    ] {
        caps.insert(cap.into(), AMQPValue::Boolean(true));
    }
    let mut props = FieldTable::default();
    props.insert(
        "product".into(),
        AMQPValue::LongString("warren-conformance-raw".into()),
    );
    props.insert("capabilities".into(), AMQPValue::FieldTable(caps));
    props
}

/// A raw AMQP connection.
pub struct Raw {
    stream: TcpStream,
    rbuf: Vec<u8>,
    /// Negotiated frame_max (used to split outgoing bodies).
    pub frame_max: u32,
    pub start: Option<connection::Start>,
    pub tune: Option<connection::Tune>,
    /// Asynchronous methods (deliveries, returns, confirms, cancels) that arrived while [`Raw::call`] or
    /// [`Raw::get`] waited for a synchronous reply; handed out first by the receive methods.
    pending: VecDeque<Pending>,
    /// The content of a pending delivery whose method [`Raw::recv_method`] already handed out.
    stashed: Option<RawDelivery>,
}

enum Pending {
    Method(u16, AMQPClass),
    Delivery(Box<RawDelivery>),
}

fn is_async_content(m: &AMQPClass) -> bool {
    matches!(
        m,
        AMQPClass::Basic(basic::AMQPMethod::Deliver(_) | basic::AMQPMethod::Return(_))
    )
}

fn is_async_method(m: &AMQPClass) -> bool {
    matches!(
        m,
        AMQPClass::Basic(
            basic::AMQPMethod::Ack(_) | basic::AMQPMethod::Nack(_) | basic::AMQPMethod::Cancel(_)
        )
    )
}

impl Raw {
    /// A bare TCP connection; nothing sent yet.
    pub async fn tcp(addr: SocketAddr) -> Raw {
        let stream = tokio::time::timeout(WAIT, TcpStream::connect(addr))
            .await
            .expect("tcp connect timed out")
            .expect("tcp connect failed");
        stream.set_nodelay(true).ok();
        Raw {
            stream,
            rbuf: Vec::new(),
            frame_max: 4096,
            start: None,
            tune: None,
            pending: VecDeque::new(),
            stashed: None,
        }
    }

    /// A connection with the handshake done (guest/guest, vhost /, no heartbeats).
    pub async fn open(addr: SocketAddr) -> Raw {
        Self::open_with(addr, Handshake::default()).await
    }

    /// A connection with the handshake done with these options; panics if the broker refuses.
    pub async fn open_with(addr: SocketAddr, hs: Handshake) -> Raw {
        let mut raw = Raw::tcp(addr).await;
        raw.handshake_until_open(&hs).await;
        match raw.recv_method().await {
            (0, AMQPClass::Connection(connection::AMQPMethod::OpenOk(_))) => raw,
            other => panic!("expected connection.open-ok, got {other:?}"),
        }
    }

    /// Sends the header, start-ok, tune-ok and connection.open; the caller reads what comes next.
    pub async fn handshake_until_open(&mut self, hs: &Handshake) {
        self.send_bytes(PROTOCOL_HEADER).await;
        self.expect_start().await;
        self.send_start_ok(hs).await;
        let tune = match self.recv_method().await {
            (0, AMQPClass::Connection(connection::AMQPMethod::Tune(t))) => t,
            other => panic!("expected connection.tune, got {other:?}"),
        };
        self.tune = Some(tune.clone());
        let channel_max = hs.channel_max.unwrap_or(tune.channel_max);
        let frame_max = hs.frame_max.unwrap_or(tune.frame_max);
        self.send_tune_ok(channel_max, frame_max, hs.heartbeat)
            .await;
        self.send(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
                virtual_host: hs.vhost.as_str().into(),
            })),
        )
        .await;
    }

    pub async fn expect_start(&mut self) -> connection::Start {
        match self.recv_method().await {
            (0, AMQPClass::Connection(connection::AMQPMethod::Start(s))) => {
                self.start = Some(s.clone());
                s
            }
            other => panic!("expected connection.start, got {other:?}"),
        }
    }

    pub async fn send_start_ok(&mut self, hs: &Handshake) {
        self.send(
            0,
            AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
                client_properties: hs.client_properties.clone(),
                mechanism: hs.mechanism.as_str().into(),
                response: LongString::from(hs.response.clone()),
                locale: "en_US".into(),
            })),
        )
        .await;
    }

    pub async fn send_tune_ok(&mut self, channel_max: u16, frame_max: u32, heartbeat: u16) {
        self.frame_max = if frame_max == 0 { 131072 } else { frame_max };
        self.send(
            0,
            AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
                channel_max,
                frame_max,
                heartbeat,
            })),
        )
        .await;
    }

    /// The socket as a non-blocking std stream, for tests that go on byte by byte outside the
    /// runtime (slow clients). Frames already read and not taken are dropped.
    pub fn into_std(self) -> std::net::TcpStream {
        self.stream
            .into_std()
            .unwrap_or_else(|e| panic!("cannot take the socket out of the runtime: {e}"))
    }

    // ----- sending -----

    pub async fn send_bytes(&mut self, bytes: &[u8]) {
        self.stream
            .write_all(bytes)
            .await
            .unwrap_or_else(|e| panic!("write failed: {e}"));
    }

    /// Writes, ignoring errors (for peers that may already have closed).
    pub async fn try_send_bytes(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.stream.write_all(bytes).await
    }

    pub async fn send_frame(&mut self, frame: &AMQPFrame) {
        let bytes = encode(frame);
        self.send_bytes(&bytes).await;
    }

    pub async fn send(&mut self, channel: u16, method: AMQPClass) {
        self.send_frame(&AMQPFrame::Method(channel, method)).await;
    }

    /// basic.publish + content header + body frames (split to the negotiated frame_max).
    pub async fn publish(
        &mut self,
        channel: u16,
        exchange: &str,
        routing_key: &str,
        mandatory: bool,
        properties: AMQPProperties,
        body: &[u8],
    ) {
        let bytes =
            self.encode_publish(channel, exchange, routing_key, mandatory, properties, body);
        self.send_bytes(&bytes).await;
    }

    /// The frames of [`Raw::publish`], for sending many publishes in one write.
    pub fn encode_publish(
        &self,
        channel: u16,
        exchange: &str,
        routing_key: &str,
        mandatory: bool,
        properties: AMQPProperties,
        body: &[u8],
    ) -> Vec<u8> {
        let mut bytes = encode(&AMQPFrame::Method(
            channel,
            AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
                exchange: exchange.into(),
                routing_key: routing_key.into(),
                mandatory,
                immediate: false,
            })),
        ));
        bytes.extend(encode(&AMQPFrame::Header(
            channel,
            AMQPContentHeader {
                class_id: 60,
                body_size: body.len() as u64,
                properties,
            },
        )));
        let max = (self.frame_max as usize).saturating_sub(8).max(1);
        for chunk in body.chunks(max) {
            bytes.extend(encode(&AMQPFrame::Body(channel, chunk.to_vec())));
        }
        bytes
    }

    /// basic.publish + a content header whose property flags and values are `property_bytes` verbatim + one
    /// body frame.
    pub async fn publish_with_property_bytes(
        &mut self,
        channel: u16,
        exchange: &str,
        routing_key: &str,
        property_bytes: &[u8],
        body: &[u8],
    ) {
        let mut bytes = encode(&AMQPFrame::Method(
            channel,
            AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
                exchange: exchange.into(),
                routing_key: routing_key.into(),
                mandatory: false,
                immediate: false,
            })),
        ));
        let mut header = vec![0, 60, 0, 0];
        header.extend_from_slice(&(body.len() as u64).to_be_bytes());
        header.extend_from_slice(property_bytes);
        bytes.extend(raw_frame(2, channel, &header));
        bytes.extend(raw_frame(3, channel, body));
        self.send_bytes(&bytes).await;
    }

    pub async fn channel_open(&mut self, channel: u16) {
        self.send(
            channel,
            AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
        )
        .await;
        match self.recv_method().await {
            (ch, AMQPClass::Channel(channel::AMQPMethod::OpenOk(_))) if ch == channel => {}
            other => panic!("expected channel.open-ok on {channel}, got {other:?}"),
        }
    }

    /// Sends a method and expects the given reply method (class id, method id) on the same channel.
    pub async fn call(&mut self, channel: u16, method: AMQPClass) -> AMQPClass {
        let expected = reply_of(&method);
        self.send(channel, method.clone()).await;
        self.recv_reply(channel, |reply| {
            Some((reply.get_amqp_class_id(), reply.get_amqp_method_id())) == expected
        })
        .await
        .unwrap_or_else(|(ch, reply)| {
            panic!("sent {method:?} on channel {channel}, expected reply {expected:?}, got {reply:?} on channel {ch}")
        })
    }

    /// Reads from the wire until a method on `channel` that `is_reply` accepts, setting aside deliveries,
    /// returns, confirms and cancels that arrive first. Anything else is returned as an error.
    async fn recv_reply(
        &mut self,
        channel: u16,
        is_reply: impl Fn(&AMQPClass) -> bool,
    ) -> Result<AMQPClass, (u16, AMQPClass)> {
        loop {
            let (ch, reply) = self.recv_method_wire(WAIT).await.unwrap_or_else(|e| {
                panic!("waiting for a reply on channel {channel}, connection ended: {e:?}")
            });
            if ch == channel && is_reply(&reply) {
                return Ok(reply);
            }
            if is_async_content(&reply) {
                let d = self.recv_content_wire(ch, reply).await;
                self.pending.push_back(Pending::Delivery(Box::new(d)));
            } else if is_async_method(&reply) {
                self.pending.push_back(Pending::Method(ch, reply));
            } else {
                return Err((ch, reply));
            }
        }
    }

    /// queue.declare with no arguments; returns declare-ok.
    pub async fn declare_queue(&mut self, channel: u16, name: &str) -> queue::DeclareOk {
        match self
            .call(channel, m::queue_declare(name, QueueFlags::default()))
            .await
        {
            AMQPClass::Queue(queue::AMQPMethod::DeclareOk(ok)) => ok,
            other => unreachable!("{other:?}"),
        }
    }

    /// Polls a passive queue.declare until the queue holds `ready` ready messages (publishes are asynchronous:
    /// a declare right after a publish may not count it yet). Returns the last declare-ok.
    pub async fn wait_ready(&mut self, channel: u16, queue: &str, ready: u32) -> queue::DeclareOk {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let ok = match self
                .call(
                    channel,
                    m::queue_declare(
                        queue,
                        QueueFlags {
                            passive: true,
                            ..Default::default()
                        },
                    ),
                )
                .await
            {
                AMQPClass::Queue(queue::AMQPMethod::DeclareOk(ok)) => ok,
                other => unreachable!("{other:?}"),
            };
            if ok.message_count == ready {
                return ok;
            }
            if tokio::time::Instant::now() > deadline {
                panic!(
                    "queue {queue} has {} ready messages after {WAIT:?}, expected {ready}",
                    ok.message_count
                );
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Closes the connection politely and waits for close-ok.
    pub async fn close(mut self) {
        self.send(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
                reply_code: 200,
                reply_text: "bye".into(),
                class_id: 0,
                method_id: 0,
            })),
        )
        .await;
        loop {
            match self.recv().await {
                Ok(f) if is_method(&f, 10, 51) => return,
                Ok(_) => continue,
                Err(e) => panic!("expected connection.close-ok, got {e:?}"),
            }
        }
    }

    // ----- receiving -----

    /// The next frame (heartbeats included), failing the test after [`WAIT`].
    pub async fn recv(&mut self) -> Result<Frame, RecvError> {
        match self.recv_timeout(WAIT).await {
            Err(RecvError::Timeout) => panic!("no frame from the broker within {WAIT:?}"),
            other => other,
        }
    }

    /// The next frame, or Timeout / Closed.
    pub async fn recv_timeout(&mut self, timeout: Duration) -> Result<Frame, RecvError> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Some(frame) = self.take_frame() {
                return Ok(frame);
            }
            let mut buf = [0u8; 65536];
            match tokio::time::timeout_at(deadline, self.stream.read(&mut buf)).await {
                Err(_) => return Err(RecvError::Timeout),
                Ok(Ok(0)) => return Err(RecvError::Closed("eof".into())),
                Ok(Ok(n)) => self.rbuf.extend_from_slice(&buf[..n]),
                Ok(Err(e)) => return Err(RecvError::Closed(e.to_string())),
            }
        }
    }

    /// Reads exactly `n` raw bytes (for the protocol header the server sends back), or what came before EOF.
    pub async fn recv_raw_bytes(&mut self, n: usize) -> Vec<u8> {
        let deadline = tokio::time::Instant::now() + WAIT;
        while self.rbuf.len() < n {
            let mut buf = [0u8; 1024];
            match tokio::time::timeout_at(deadline, self.stream.read(&mut buf)).await {
                Err(_) => panic!("timed out reading {n} bytes, got {:?}", self.rbuf),
                Ok(Ok(0)) | Ok(Err(_)) => break,
                Ok(Ok(k)) => self.rbuf.extend_from_slice(&buf[..k]),
            }
        }
        let k = n.min(self.rbuf.len());
        self.rbuf.drain(..k).collect()
    }

    fn take_frame(&mut self) -> Option<Frame> {
        if self.rbuf.len() < 7 {
            return None;
        }
        let kind = self.rbuf[0];
        let channel = u16::from_be_bytes([self.rbuf[1], self.rbuf[2]]);
        let size = u32::from_be_bytes([self.rbuf[3], self.rbuf[4], self.rbuf[5], self.rbuf[6]]);
        let total = 7 + size as usize + 1;
        if self.rbuf.len() < total {
            return None;
        }
        let bytes: Vec<u8> = self.rbuf.drain(..total).collect();
        assert_eq!(
            bytes[total - 1],
            0xCE,
            "broker sent a frame without the frame-end octet: {bytes:?}"
        );
        let parsed = parse_frame(&bytes[..]).ok().map(|(_, f)| f);
        Some(Frame {
            kind,
            channel,
            size,
            payload: bytes[7..total - 1].to_vec(),
            parsed,
        })
    }

    /// The next method (set-aside asynchronous methods first, then the wire), skipping heartbeats; panics on
    /// anything else.
    pub async fn recv_method(&mut self) -> (u16, AMQPClass) {
        match self.recv_method_timeout(WAIT).await {
            Ok(m) => m,
            Err(RecvError::Timeout) => panic!("no method frame from the broker within {WAIT:?}"),
            Err(e) => panic!("expected a method frame, connection ended: {e:?}"),
        }
    }

    /// The next method, which must be `connection.blocked` (a resource alarm): its reason.
    pub async fn recv_blocked(&mut self) -> String {
        match self.recv_method().await {
            (0, AMQPClass::Connection(connection::AMQPMethod::Blocked(b))) => b.reason.to_string(),
            other => panic!("expected connection.blocked, got {other:?}"),
        }
    }

    /// The next method within `timeout` (set-aside asynchronous methods first), skipping heartbeats.
    pub async fn recv_method_timeout(
        &mut self,
        timeout: Duration,
    ) -> Result<(u16, AMQPClass), RecvError> {
        match self.pending.pop_front() {
            Some(Pending::Method(ch, m)) => Ok((ch, m)),
            Some(Pending::Delivery(d)) => {
                let out = (d.channel, d.method.clone());
                self.stashed = Some(*d);
                Ok(out)
            }
            None => self.recv_method_wire(timeout).await,
        }
    }

    async fn recv_method_wire(&mut self, timeout: Duration) -> Result<(u16, AMQPClass), RecvError> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match self.recv_timeout(left).await? {
                Frame {
                    parsed: Some(AMQPFrame::Method(ch, m)),
                    ..
                } => return Ok((ch, m)),
                Frame { kind: 8, .. } => continue,
                other => panic!("expected a method frame, got {other:?}"),
            }
        }
    }

    /// Asserts that no frame (other than heartbeats) arrives for `d`.
    pub async fn expect_silence(&mut self, d: Duration) {
        if let Some(p) = self.pending.front() {
            match p {
                Pending::Method(ch, m) => {
                    panic!("expected nothing from the broker, got {m:?} on {ch}")
                }
                Pending::Delivery(d) => panic!(
                    "expected nothing from the broker, got {:?} on {}",
                    d.method, d.channel
                ),
            }
        }
        let deadline = tokio::time::Instant::now() + d;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match self.recv_timeout(left).await {
                Err(RecvError::Timeout) => return,
                Ok(Frame { kind: 8, .. }) => continue,
                Ok(f) => panic!("expected nothing from the broker, got {f:?}"),
                Err(e) => panic!("expected nothing from the broker, connection ended: {e:?}"),
            }
        }
    }

    /// Like [`Raw::expect_silence`], but the broker closing the socket also counts as saying nothing.
    pub async fn expect_silence_or_eof(&mut self, d: Duration) {
        assert!(
            self.pending.is_empty(),
            "expected nothing from the broker, got a pending frame"
        );
        let deadline = tokio::time::Instant::now() + d;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match self.recv_timeout(left).await {
                Err(RecvError::Timeout) => return,
                Ok(Frame { kind: 8, .. }) => continue,
                Ok(f) => panic!("expected nothing from the broker, got {f:?}"),
                Err(_) => return,
            }
        }
    }

    /// The method, content header and body frames of one delivery (basic.deliver, basic.get-ok, basic.return).
    pub async fn recv_delivery(&mut self) -> RawDelivery {
        let (channel, method) = self.recv_method().await;
        match &method {
            AMQPClass::Basic(
                basic::AMQPMethod::Deliver(_)
                | basic::AMQPMethod::GetOk(_)
                | basic::AMQPMethod::Return(_),
            ) => {}
            other => panic!("expected a delivery, got {other:?} on channel {channel}"),
        }
        self.recv_content(channel, method).await
    }

    /// Reads the content header and body frames following `method`.
    pub async fn recv_content(&mut self, channel: u16, method: AMQPClass) -> RawDelivery {
        if let Some(d) = self.stashed.take() {
            assert_eq!(
                (d.channel, &d.method),
                (channel, &method),
                "content of another method"
            );
            return d;
        }
        self.recv_content_wire(channel, method).await
    }

    async fn recv_content_wire(&mut self, channel: u16, method: AMQPClass) -> RawDelivery {
        let (header, property_bytes) = loop {
            match self.recv().await {
                Ok(Frame { kind: 8, .. }) => continue,
                Ok(Frame {
                    parsed: Some(AMQPFrame::Header(ch, h)),
                    payload,
                    ..
                }) if ch == channel => break (h, payload[12..].to_vec()),
                other => panic!("expected a content header on {channel}, got {other:?}"),
            }
        };
        let mut body = Vec::new();
        let mut sizes = Vec::new();
        while (body.len() as u64) < header.body_size {
            match self.recv().await {
                Ok(Frame { kind: 8, .. }) => continue,
                Ok(Frame {
                    kind: 3,
                    channel: ch,
                    size,
                    payload,
                    ..
                }) if ch == channel => {
                    sizes.push(size);
                    body.extend_from_slice(&payload);
                }
                other => panic!("expected a body frame on {channel}, got {other:?}"),
            }
        }
        assert_eq!(
            body.len() as u64,
            header.body_size,
            "body longer than announced"
        );
        RawDelivery {
            channel,
            method,
            properties: header.properties,
            property_bytes,
            body,
            body_frame_sizes: sizes,
        }
    }

    /// basic.get on `queue` (no-ack as given); None for get-empty.
    pub async fn get(&mut self, channel: u16, queue: &str, no_ack: bool) -> Option<RawDelivery> {
        self.send(channel, m::basic_get(queue, no_ack)).await;
        let method = self
            .recv_reply(channel, |m| {
                matches!(
                    m,
                    AMQPClass::Basic(basic::AMQPMethod::GetOk(_) | basic::AMQPMethod::GetEmpty(_))
                )
            })
            .await
            .unwrap_or_else(|(ch, m)| {
                panic!("expected get-ok or get-empty on {channel}, got {m:?} on {ch}")
            });
        match method {
            AMQPClass::Basic(basic::AMQPMethod::GetEmpty(_)) => None,
            AMQPClass::Basic(basic::AMQPMethod::GetOk(_)) => {
                Some(self.recv_content_wire(channel, method).await)
            }
            other => panic!("expected get-ok or get-empty, got {other:?}"),
        }
    }

    // ----- errors -----

    /// Expects channel.close with exactly this code, text, class id and method id; answers close-ok.
    pub async fn expect_channel_close(
        &mut self,
        channel: u16,
        code: u16,
        text: &str,
        class_id: u16,
        method_id: u16,
    ) {
        let close = self.recv_channel_close(channel).await;
        assert_eq!(
            (
                close.reply_code,
                close.reply_text.as_str(),
                close.class_id,
                close.method_id
            ),
            (code, text, class_id, method_id),
            "channel.close (code, text, class id, method id)"
        );
    }

    /// Receives channel.close on `channel` (skipping heartbeats) and answers close-ok.
    pub async fn recv_channel_close(&mut self, channel: u16) -> channel::Close {
        let close = self.recv_channel_close_only(channel).await;
        self.send(
            channel,
            AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
        )
        .await;
        close
    }

    /// Receives channel.close on `channel` (skipping heartbeats) without answering it.
    pub async fn recv_channel_close_only(&mut self, channel: u16) -> channel::Close {
        let (ch, method) = self.recv_method().await;
        match method {
            AMQPClass::Channel(channel::AMQPMethod::Close(close)) if ch == channel => close,
            other => panic!("expected channel.close on channel {channel}, got {other:?} on {ch}"),
        }
    }

    /// Expects connection.close with exactly this code, text, class id and method id; answers close-ok and
    /// expects the socket to be closed by the broker.
    pub async fn expect_connection_close(
        &mut self,
        code: u16,
        text: &str,
        class_id: u16,
        method_id: u16,
    ) {
        let close = self.recv_connection_close().await;
        assert_eq!(
            (
                close.reply_code,
                close.reply_text.as_str(),
                close.class_id,
                close.method_id
            ),
            (code, text, class_id, method_id),
            "connection.close (code, text, class id, method id)"
        );
    }

    /// Like [`Raw::expect_connection_close`] but the text only has to start with `text_prefix`, and the socket
    /// is not waited for: after a framing error RabbitMQ cannot read our close-ok (frame boundaries are lost)
    /// and drops the socket only after a 3 s timeout.
    pub async fn expect_connection_close_prefix(
        &mut self,
        code: u16,
        text_prefix: &str,
        class_id: u16,
        method_id: u16,
    ) -> connection::Close {
        let close = self.recv_connection_close_frame().await;
        self.send_connection_close_ok().await;
        assert!(
            close.reply_code == code
                && close.reply_text.as_str().starts_with(text_prefix)
                && close.class_id == class_id
                && close.method_id == method_id,
            "expected connection.close {code} {text_prefix:?}... class {class_id} method {method_id}, got {close:?}"
        );
        close
    }

    /// Receives connection.close (skipping heartbeats and frames on other channels that were already in
    /// flight), answers close-ok and waits for the broker to close the socket.
    pub async fn recv_connection_close(&mut self) -> connection::Close {
        let close = self.recv_connection_close_frame().await;
        self.send_connection_close_ok().await;
        self.expect_disconnect().await;
        close
    }

    /// Answers a connection.close (ignoring write errors: the broker may already have closed the socket).
    pub async fn send_connection_close_ok(&mut self) {
        let _ = self
            .try_send_bytes(&encode(&AMQPFrame::Method(
                0,
                AMQPClass::Connection(connection::AMQPMethod::CloseOk(connection::CloseOk {})),
            )))
            .await;
    }

    /// Receives connection.close (skipping heartbeats) without answering it.
    pub async fn recv_connection_close_frame(&mut self) -> connection::Close {
        loop {
            match self.recv().await {
                Ok(Frame {
                    parsed:
                        Some(AMQPFrame::Method(
                            0,
                            AMQPClass::Connection(connection::AMQPMethod::Close(c)),
                        )),
                    ..
                }) => return c,
                Ok(Frame { kind: 8, .. }) => continue,
                Ok(other) => panic!("expected connection.close, got {other:?}"),
                Err(e) => panic!("expected connection.close, the connection ended first: {e:?}"),
            }
        }
    }

    /// Expects the broker to close the socket (within [`WAIT`]), ignoring heartbeats.
    pub async fn expect_disconnect(&mut self) {
        loop {
            match self.recv_timeout(WAIT).await {
                Err(RecvError::Closed(_)) => return,
                Err(RecvError::Timeout) => {
                    panic!("the broker did not close the socket within {WAIT:?}")
                }
                Ok(Frame { kind: 8, .. }) => continue,
                Ok(f) => panic!("expected the socket to close, got {f:?}"),
            }
        }
    }
}

/// Encodes a frame with amq-protocol.
pub fn encode(frame: &AMQPFrame) -> Vec<u8> {
    gen_frame(frame)(WriteContext::from(Vec::new()))
        .unwrap_or_else(|e| panic!("cannot encode {frame:?}: {e:?}"))
        .write
}

/// A frame from raw parts: type, channel, payload (the size field is the payload length).
pub fn raw_frame(kind: u8, channel: u16, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload.len() + 8);
    out.push(kind);
    out.extend_from_slice(&channel.to_be_bytes());
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(payload);
    out.push(0xCE);
    out
}

pub fn is_method(f: &Frame, class_id: u16, method_id: u16) -> bool {
    matches!(&f.parsed, Some(AMQPFrame::Method(_, m)) if m.get_amqp_class_id() == class_id && m.get_amqp_method_id() == method_id)
}

/// The (class id, method id) of the synchronous reply to `method`, if it has one.
fn reply_of(method: &AMQPClass) -> Option<(u16, u16)> {
    let (c, mid) = (method.get_amqp_class_id(), method.get_amqp_method_id());
    match (c, mid) {
        (20, 10) | (20, 20) | (20, 40) => Some((20, mid + 1)),
        (40, 10) | (40, 20) | (40, 30) | (40, 40) => Some((40, mid + 1)),
        (40, 31) => Some((40, 51)), // exchange.unbind -> unbind-ok
        (50, 10) | (50, 20) | (50, 30) | (50, 40) => Some((50, mid + 1)),
        (50, 50) => Some((50, 51)),
        (60, 10) | (60, 20) | (60, 30) => Some((60, mid + 1)),
        (60, 110) => Some((60, 111)),
        (85, 10) => Some((85, 11)),
        (90, 10) | (90, 20) | (90, 30) => Some((90, mid + 1)),
        _ => None,
    }
}

/// Flags of queue.declare.
#[derive(Debug, Clone, Copy, Default)]
pub struct QueueFlags {
    pub passive: bool,
    pub durable: bool,
    pub exclusive: bool,
    pub auto_delete: bool,
    pub nowait: bool,
}

/// Constructors for the methods tests send.
pub mod m {
    use super::*;

    pub fn queue_declare(name: &str, f: QueueFlags) -> AMQPClass {
        queue_declare_args(name, f, FieldTable::default())
    }

    pub fn queue_declare_args(name: &str, f: QueueFlags, arguments: FieldTable) -> AMQPClass {
        AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
            queue: name.into(),
            passive: f.passive,
            durable: f.durable,
            exclusive: f.exclusive,
            auto_delete: f.auto_delete,
            nowait: f.nowait,
            arguments,
        }))
    }

    pub fn queue_bind(queue: &str, exchange: &str, routing_key: &str) -> AMQPClass {
        AMQPClass::Queue(queue::AMQPMethod::Bind(queue::Bind {
            queue: queue.into(),
            exchange: exchange.into(),
            routing_key: routing_key.into(),
            nowait: false,
            arguments: FieldTable::default(),
        }))
    }

    pub fn queue_unbind(queue: &str, exchange: &str, routing_key: &str) -> AMQPClass {
        AMQPClass::Queue(queue::AMQPMethod::Unbind(queue::Unbind {
            queue: queue.into(),
            exchange: exchange.into(),
            routing_key: routing_key.into(),
            arguments: FieldTable::default(),
        }))
    }

    pub fn queue_purge(queue: &str) -> AMQPClass {
        AMQPClass::Queue(queue::AMQPMethod::Purge(queue::Purge {
            queue: queue.into(),
            nowait: false,
        }))
    }

    pub fn queue_delete(queue: &str, if_unused: bool, if_empty: bool) -> AMQPClass {
        AMQPClass::Queue(queue::AMQPMethod::Delete(queue::Delete {
            queue: queue.into(),
            if_unused,
            if_empty,
            nowait: false,
        }))
    }

    pub fn exchange_declare(name: &str, kind: &str, passive: bool, durable: bool) -> AMQPClass {
        AMQPClass::Exchange(exchange::AMQPMethod::Declare(exchange::Declare {
            exchange: name.into(),
            kind: kind.into(),
            passive,
            durable,
            auto_delete: false,
            internal: false,
            nowait: false,
            arguments: FieldTable::default(),
        }))
    }

    pub fn exchange_delete(name: &str) -> AMQPClass {
        AMQPClass::Exchange(exchange::AMQPMethod::Delete(exchange::Delete {
            exchange: name.into(),
            if_unused: false,
            nowait: false,
        }))
    }

    pub fn exchange_bind(destination: &str, source: &str, routing_key: &str) -> AMQPClass {
        AMQPClass::Exchange(exchange::AMQPMethod::Bind(exchange::Bind {
            destination: destination.into(),
            source: source.into(),
            routing_key: routing_key.into(),
            nowait: false,
            arguments: FieldTable::default(),
        }))
    }

    pub fn basic_qos(prefetch_count: u16, global: bool) -> AMQPClass {
        AMQPClass::Basic(basic::AMQPMethod::Qos(basic::Qos {
            prefetch_count,
            global,
        }))
    }

    /// basic.qos as raw bytes, for a non-zero prefetch-size (amq-protocol always encodes 0).
    pub fn basic_qos_frame(
        channel: u16,
        prefetch_size: u32,
        prefetch_count: u16,
        global: bool,
    ) -> Vec<u8> {
        let mut payload = vec![0, 60, 0, 10];
        payload.extend_from_slice(&prefetch_size.to_be_bytes());
        payload.extend_from_slice(&prefetch_count.to_be_bytes());
        payload.push(global as u8);
        raw_frame(1, channel, &payload)
    }

    pub fn basic_consume(queue: &str, tag: &str, no_ack: bool, exclusive: bool) -> AMQPClass {
        AMQPClass::Basic(basic::AMQPMethod::Consume(basic::Consume {
            queue: queue.into(),
            consumer_tag: tag.into(),
            no_local: false,
            no_ack,
            exclusive,
            nowait: false,
            arguments: FieldTable::default(),
        }))
    }

    pub fn basic_cancel(tag: &str) -> AMQPClass {
        AMQPClass::Basic(basic::AMQPMethod::Cancel(basic::Cancel {
            consumer_tag: tag.into(),
            nowait: false,
        }))
    }

    pub fn basic_get(queue: &str, no_ack: bool) -> AMQPClass {
        AMQPClass::Basic(basic::AMQPMethod::Get(basic::Get {
            queue: queue.into(),
            no_ack,
        }))
    }

    pub fn basic_ack(delivery_tag: u64, multiple: bool) -> AMQPClass {
        AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
            delivery_tag,
            multiple,
        }))
    }

    pub fn basic_nack(delivery_tag: u64, multiple: bool, requeue: bool) -> AMQPClass {
        AMQPClass::Basic(basic::AMQPMethod::Nack(basic::Nack {
            delivery_tag,
            multiple,
            requeue,
        }))
    }

    pub fn basic_reject(delivery_tag: u64, requeue: bool) -> AMQPClass {
        AMQPClass::Basic(basic::AMQPMethod::Reject(basic::Reject {
            delivery_tag,
            requeue,
        }))
    }

    pub fn basic_recover(requeue: bool) -> AMQPClass {
        AMQPClass::Basic(basic::AMQPMethod::Recover(basic::Recover { requeue }))
    }

    pub fn channel_flow(active: bool) -> AMQPClass {
        AMQPClass::Channel(channel::AMQPMethod::Flow(channel::Flow { active }))
    }

    pub fn channel_close() -> AMQPClass {
        AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
            reply_code: 200,
            reply_text: "bye".into(),
            class_id: 0,
            method_id: 0,
        }))
    }

    pub fn channel_close_ok() -> AMQPClass {
        AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {}))
    }

    pub fn channel_open() -> AMQPClass {
        AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {}))
    }

    pub fn confirm_select() -> AMQPClass {
        AMQPClass::Confirm(confirm::AMQPMethod::Select(confirm::Select {
            nowait: false,
        }))
    }

    pub fn tx_select() -> AMQPClass {
        AMQPClass::Tx(tx::AMQPMethod::Select(tx::Select {}))
    }

    pub fn tx_commit() -> AMQPClass {
        AMQPClass::Tx(tx::AMQPMethod::Commit(tx::Commit {}))
    }

    /// A field table from (key, value) pairs.
    pub fn table(entries: &[(&str, AMQPValue)]) -> FieldTable {
        let mut t = FieldTable::default();
        for (k, v) in entries {
            t.insert(ShortString::from(*k), v.clone());
        }
        t
    }
}
