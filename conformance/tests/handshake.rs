//! Connection establishment: protocol header, connection.start/tune/open, authentication, heartbeats, and the
//! connection-level close handshakes (including SIGTERM).

use std::time::{Duration, Instant};

use warren_conformance::raw::types::AMQPValue;
use warren_conformance::raw::{
    self, amqplain_response, encode, m, plain_response, raw_frame, Handshake, Raw, RecvError,
    PROTOCOL_HEADER,
};
use warren_conformance::raw::{frame::AMQPFrame, protocol::connection, protocol::AMQPClass};
use warren_conformance::{assert_amqp_error, connect_url, unique, TestBroker, QUIET};

async fn start_of(broker: &TestBroker) -> connection::Start {
    let mut raw = Raw::tcp(broker.addr()).await;
    raw.send_bytes(PROTOCOL_HEADER).await;
    raw.expect_start().await
}

/// Sends `header` and expects the server's own 0-9-1 header back, then the socket closed.
async fn expect_header_rejected(broker: &TestBroker, header: &[u8]) {
    let mut raw = Raw::tcp(broker.addr()).await;
    raw.send_bytes(header).await;
    let reply = raw.recv_raw_bytes(8).await;
    assert_eq!(
        reply, PROTOCOL_HEADER,
        "server must answer with its own protocol header"
    );
    raw.expect_disconnect().await;
}

#[tokio::test]
async fn connection_start_announces_0_9_and_mechanisms() {
    let broker = TestBroker::start();
    let start = start_of(&broker).await;
    assert_eq!((start.version_major, start.version_minor), (0, 9));
    let mechanisms = String::from_utf8_lossy(start.mechanisms.as_bytes()).into_owned();
    let mechanisms: Vec<&str> = mechanisms.split(' ').collect();
    assert!(mechanisms.contains(&"PLAIN"), "mechanisms {mechanisms:?}");
    assert!(
        mechanisms.contains(&"AMQPLAIN"),
        "mechanisms {mechanisms:?}"
    );
    let locales = String::from_utf8_lossy(start.locales.as_bytes()).into_owned();
    assert!(
        locales.split(' ').any(|l| l == "en_US"),
        "locales {locales:?}"
    );
}

#[tokio::test]
async fn wrong_protocol_version_gets_server_header_and_close() {
    let broker = TestBroker::start();
    expect_header_rejected(&broker, b"AMQP\x00\x00\x09\x02").await;
}

#[tokio::test]
async fn amqp_1_0_header_gets_server_header_and_close() {
    let broker = TestBroker::start();
    expect_header_rejected(&broker, b"AMQP\x00\x01\x00\x00").await;
}

#[tokio::test]
async fn http_request_gets_server_header_and_close() {
    let broker = TestBroker::start();
    expect_header_rejected(&broker, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await;
}

/// Some old clients send the AMQP 0-9 header `AMQP 1 1 0 9`; RabbitMQ answers it as 0-9-1.
#[tokio::test]
async fn amqp_0_9_header_is_accepted_as_0_9_1() {
    let broker = TestBroker::start();
    let mut raw = Raw::tcp(broker.addr()).await;
    raw.send_bytes(b"AMQP\x01\x01\x00\x09").await;
    let start = raw.expect_start().await;
    assert_eq!((start.version_major, start.version_minor), (0, 9));
}

#[tokio::test]
async fn protocol_header_split_across_writes_is_accepted() {
    let broker = TestBroker::start();
    let mut raw = Raw::tcp(broker.addr()).await;
    raw.send_bytes(&PROTOCOL_HEADER[..3]).await;
    tokio::time::sleep(Duration::from_millis(30)).await;
    raw.send_bytes(&PROTOCOL_HEADER[3..]).await;
    raw.expect_start().await;
}

#[tokio::test]
async fn server_properties_advertise_rabbitmq_capabilities() {
    let broker = TestBroker::start();
    let start = start_of(&broker).await;
    let props = start.server_properties.inner();
    let caps = match props.get("capabilities") {
        Some(AMQPValue::FieldTable(t)) => t.inner().clone(),
        other => panic!("capabilities must be a field table, got {other:?}"),
    };
    for cap in [
        "publisher_confirms",
        "exchange_exchange_bindings",
        "basic.nack",
        "consumer_cancel_notify",
        "connection.blocked",
        "consumer_priorities",
        "authentication_failure_close",
        "per_consumer_qos",
        "direct_reply_to",
    ] {
        assert_eq!(
            caps.get(cap),
            Some(&AMQPValue::Boolean(true)),
            "capability {cap} (all: {caps:?})"
        );
    }
    // Clients log and display these; they are long strings in RabbitMQ.
    for key in ["product", "version", "platform", "copyright", "information"] {
        match props.get(key) {
            Some(AMQPValue::LongString(s)) if !s.is_empty() => {}
            other => panic!("server property {key} must be a non-empty long string, got {other:?}"),
        }
    }
}

#[tokio::test]
async fn plain_authentication_succeeds() {
    let broker = TestBroker::start();
    let raw = Raw::open_with(
        broker.addr(),
        Handshake {
            mechanism: "PLAIN".into(),
            response: plain_response("guest", "guest"),
            ..Handshake::default()
        },
    )
    .await;
    raw.close().await;
}

#[tokio::test]
async fn amqplain_authentication_succeeds() {
    let broker = TestBroker::start();
    let raw = Raw::open_with(
        broker.addr(),
        Handshake {
            mechanism: "AMQPLAIN".into(),
            response: amqplain_response("guest", "guest"),
            ..Handshake::default()
        },
    )
    .await;
    raw.close().await;
}

/// Runs start-ok with these credentials and expects the 403 close of RabbitMQ (for clients that advertise
/// the authentication_failure_close capability, as the raw client does).
async fn expect_login_refused(broker: &TestBroker, mechanism: &str, response: Vec<u8>) {
    let mut raw = Raw::tcp(broker.addr()).await;
    raw.send_bytes(PROTOCOL_HEADER).await;
    raw.expect_start().await;
    raw.send_start_ok(&Handshake {
        mechanism: mechanism.into(),
        response,
        ..Handshake::default()
    })
    .await;
    raw.expect_connection_close(
        403,
        &format!(
            "ACCESS_REFUSED - Login was refused using authentication mechanism {mechanism}. \
             For details see the broker logfile."
        ),
        0,
        0,
    )
    .await;
}

#[tokio::test]
async fn wrong_password_plain_is_refused_403() {
    let broker = TestBroker::start();
    expect_login_refused(&broker, "PLAIN", plain_response("guest", "wrong")).await;
}

#[tokio::test]
async fn wrong_password_amqplain_is_refused_403() {
    let broker = TestBroker::start();
    expect_login_refused(&broker, "AMQPLAIN", amqplain_response("guest", "wrong")).await;
}

#[tokio::test]
async fn unknown_user_is_refused_403() {
    let broker = TestBroker::start();
    let user = unique("nobody");
    expect_login_refused(&broker, "PLAIN", plain_response(&user, "guest")).await;
}

#[tokio::test]
async fn wrong_password_lapin_sees_403() {
    let broker = TestBroker::start();
    let url = broker.url_with_credentials("guest", "wrong");
    let res = tokio::time::timeout(
        warren_conformance::WAIT,
        lapin::Connection::connect(&url, lapin::ConnectionProperties::default()),
    )
    .await
    .expect("lapin connect must fail promptly");
    assert_amqp_error(
        res.map(|_| ()),
        403,
        "ACCESS_REFUSED - Login was refused using authentication mechanism PLAIN. For details see the broker logfile.",
    );
}

#[tokio::test]
async fn tune_proposes_rabbitmq_defaults() {
    let broker = TestBroker::start();
    let mut raw = Raw::tcp(broker.addr()).await;
    raw.send_bytes(PROTOCOL_HEADER).await;
    raw.expect_start().await;
    raw.send_start_ok(&Handshake::default()).await;
    match raw.recv_method().await {
        (0, AMQPClass::Connection(connection::AMQPMethod::Tune(t))) => {
            assert_eq!(
                (t.channel_max, t.frame_max, t.heartbeat),
                (2047, 131072, 60),
                "connection.tune (channel_max, frame_max, heartbeat)"
            );
        }
        other => panic!("expected connection.tune, got {other:?}"),
    }
}

#[tokio::test]
async fn lower_frame_max_is_used_for_outgoing_bodies() {
    let broker = TestBroker::start();
    let mut raw = Raw::open_with(
        broker.addr(),
        Handshake {
            frame_max: Some(4096),
            ..Handshake::default()
        },
    )
    .await;
    raw.channel_open(1).await;
    let q = unique("hs-fm");
    raw.declare_queue(1, &q).await;
    let body: Vec<u8> = (0..20_000u32).map(|i| (i % 251) as u8).collect();
    raw.publish(1, "", &q, false, Default::default(), &body)
        .await;
    let d = loop {
        if let Some(d) = raw.get(1, &q, true).await {
            break d;
        }
    };
    assert_eq!(d.body, body);
    assert!(
        d.body_frame_sizes.iter().all(|&s| s <= 4096 - 8),
        "body frames must fit the negotiated frame_max 4096: {:?}",
        d.body_frame_sizes
    );
    assert!(d.body_frame_sizes.len() >= 5);
}

/// Property bytes (flags, then a headers table of one long string) whose content header
/// frame is `frame_len` bytes, overhead included.
fn property_bytes_for_header_frame(frame_len: usize) -> Vec<u8> {
    // Frame overhead 8, class/weight/body size 12, flags 2, table length 4, then the entry:
    // key (1 + 6), type (1), string length (4).
    let n = frame_len - (8 + 12 + 2 + 4 + 7 + 1 + 4);
    let mut p = vec![0x20, 0x00];
    p.extend_from_slice(&(12 + n as u32).to_be_bytes());
    p.push(6);
    p.extend_from_slice(b"filler");
    p.push(b'S');
    p.extend_from_slice(&(n as u32).to_be_bytes());
    p.extend(std::iter::repeat_n(b'f', n));
    p
}

/// Opens a raw connection with frame_max 4096 and channel 1.
async fn small_frames(broker: &TestBroker) -> Raw {
    let mut raw = Raw::open_with(
        broker.addr(),
        Handshake {
            frame_max: Some(4096),
            ..Handshake::default()
        },
    )
    .await;
    raw.channel_open(1).await;
    raw
}

fn header_frame_len(d: &raw::RawDelivery) -> usize {
    8 + 12 + d.property_bytes.len()
}

fn delivery_tag(d: &raw::RawDelivery) -> u64 {
    match &d.method {
        AMQPClass::Basic(raw::protocol::basic::AMQPMethod::Deliver(m)) => m.delivery_tag,
        other => panic!("{other:?}"),
    }
}

// Warren-only: RabbitMQ adds x-delivery-count and sends the larger frame.
#[tokio::test]
async fn a_redelivery_near_frame_max_is_not_sent_in_a_larger_frame() {
    let broker = TestBroker::start();
    if broker.is_external() {
        return;
    }
    let mut raw = small_frames(&broker).await;
    let q = unique("hs-fm-qq");
    let durable = raw::QueueFlags {
        durable: true,
        ..Default::default()
    };
    let args = m::table(&[("x-queue-type", AMQPValue::LongString("quorum".into()))]);
    raw.call(1, m::queue_declare_args(&q, durable, args)).await;
    raw.publish_with_property_bytes(1, "", &q, &property_bytes_for_header_frame(4086), b"m")
        .await;
    raw.call(1, m::basic_consume(&q, "c", false, false)).await;
    let first = raw.recv_delivery().await;
    assert_eq!(header_frame_len(&first), 4086);
    raw.send(1, m::basic_nack(delivery_tag(&first), false, true))
        .await;
    let again = raw.recv_delivery().await;
    assert!(
        header_frame_len(&again) <= 4096,
        "a content header frame of {} bytes for frame_max 4096",
        header_frame_len(&again)
    );
    let headers = again.properties.headers().clone().unwrap_or_default();
    assert!(headers.inner().contains_key("filler"));
    raw.close().await;
}

// Warren-only: RabbitMQ sends the dead letter in a frame larger than frame_max.
#[tokio::test]
async fn a_dead_letter_too_large_for_a_consumer_stays_in_its_queue() {
    let broker = TestBroker::start();
    if broker.is_external() {
        return;
    }
    let mut raw = small_frames(&broker).await;
    let (work, dlq) = (unique("hs-fm-work"), unique("hs-fm-dlq"));
    let args = m::table(&[
        ("x-dead-letter-exchange", AMQPValue::LongString("".into())),
        (
            "x-dead-letter-routing-key",
            AMQPValue::LongString(dlq.as_str().into()),
        ),
    ]);
    raw.call(1, m::queue_declare_args(&work, Default::default(), args))
        .await;
    raw.declare_queue(1, &dlq).await;
    raw.publish_with_property_bytes(1, "", &work, &property_bytes_for_header_frame(4046), b"m")
        .await;
    raw.call(1, m::basic_consume(&work, "c", false, false))
        .await;
    let first = raw.recv_delivery().await;
    raw.send(1, m::basic_reject(delivery_tag(&first), false))
        .await;
    raw.wait_ready(1, &dlq, 1).await;
    // With x-death added the header no longer fits 4096: no delivery, the channel closes.
    raw.channel_open(2).await;
    raw.call(2, m::basic_consume(&dlq, "d", false, false)).await;
    let close = raw.recv_channel_close(2).await;
    assert_eq!(close.reply_code, 406);
    assert!(
        close
            .reply_text
            .as_str()
            .contains("needs a content header frame of"),
        "{}",
        close.reply_text
    );
    raw.wait_ready(1, &dlq, 1).await;
    raw.close().await;
    // A connection with the default frame_max gets it, x-death and all.
    let mut big = broker.raw().await;
    big.channel_open(1).await;
    let d = big.get(1, &dlq, false).await.expect("the dead letter");
    assert!(header_frame_len(&d) > 4096);
    let headers = d.properties.headers().clone().unwrap_or_default();
    assert!(headers.inner().contains_key("x-death"));
    big.close().await;
}

#[tokio::test]
async fn lower_frame_max_is_enforced_on_incoming_frames() {
    let broker = TestBroker::start();
    let mut raw = Raw::open_with(
        broker.addr(),
        Handshake {
            frame_max: Some(4096),
            ..Handshake::default()
        },
    )
    .await;
    raw.channel_open(1).await;
    let q = unique("hs-fm2");
    raw.declare_queue(1, &q).await;
    // A body frame of 5000 bytes payload: larger than the negotiated 4096.
    let mut bytes = encode(&AMQPFrame::Method(
        1,
        AMQPClass::Basic(raw::protocol::basic::AMQPMethod::Publish(
            raw::protocol::basic::Publish {
                exchange: "".into(),
                routing_key: q.as_str().into(),
                mandatory: false,
                immediate: false,
            },
        )),
    ));
    bytes.extend(encode(&AMQPFrame::Header(
        1,
        raw::frame::AMQPContentHeader {
            class_id: 60,
            body_size: 5000,
            properties: Default::default(),
        },
    )));
    bytes.extend(raw_frame(3, 1, &[7u8; 5000]));
    raw.send_bytes(&bytes).await;
    raw.expect_connection_close_prefix(501, "FRAME_ERROR", 0, 0)
        .await;
}

#[tokio::test]
async fn lower_channel_max_is_enforced() {
    let broker = TestBroker::start();
    let mut raw = Raw::open_with(
        broker.addr(),
        Handshake {
            channel_max: Some(3),
            ..Handshake::default()
        },
    )
    .await;
    for ch in 1..=3 {
        raw.channel_open(ch).await;
    }
    raw.send(4, m::channel_open()).await;
    raw.expect_connection_close(
        530,
        "NOT_ALLOWED - number of channels opened (3) has reached the negotiated channel_max (3)",
        0,
        0,
    )
    .await;
}

/// A tune-ok above the server's limits fails the negotiation. RabbitMQ closes the socket (after a 3 s delay)
/// without connection.close; a connection.close 530 is accepted as well.
async fn expect_tune_ok_refused(broker: &TestBroker, channel_max: u16, frame_max: u32) {
    let mut raw = Raw::tcp(broker.addr()).await;
    raw.handshake_until_open(&Handshake {
        channel_max: Some(channel_max),
        frame_max: Some(frame_max),
        ..Handshake::default()
    })
    .await;
    match raw.recv_timeout(Duration::from_secs(6)).await {
        Err(RecvError::Closed(_)) => {}
        Ok(f) => match &f.parsed {
            Some(AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Close(c)))) => {
                assert_eq!(c.reply_code, 530, "{c:?}");
                assert!(c.reply_text.as_str().starts_with("NOT_ALLOWED"), "{c:?}");
            }
            _ => panic!("expected the connection to be refused, got {f:?}"),
        },
        Err(RecvError::Timeout) => panic!("tune-ok above the server's limits was not refused"),
    }
}

#[tokio::test]
async fn tune_ok_frame_max_above_server_is_refused() {
    let broker = TestBroker::start();
    expect_tune_ok_refused(&broker, 2047, 1_000_000).await;
}

#[tokio::test]
async fn tune_ok_frame_max_below_minimum_is_refused() {
    let broker = TestBroker::start();
    expect_tune_ok_refused(&broker, 2047, 1000).await;
}

#[tokio::test]
async fn open_missing_vhost_is_530() {
    let broker = TestBroker::start();
    let mut raw = Raw::tcp(broker.addr()).await;
    raw.handshake_until_open(&Handshake {
        vhost: "novhost".into(),
        ..Handshake::default()
    })
    .await;
    raw.expect_connection_close(530, "NOT_ALLOWED - vhost novhost not found", 10, 40)
        .await;
}

#[tokio::test]
async fn open_missing_vhost_lapin_sees_530() {
    let broker = TestBroker::start();
    let url = broker.url_with_vhost("novhost");
    let res = tokio::time::timeout(
        warren_conformance::WAIT,
        lapin::Connection::connect(&url, lapin::ConnectionProperties::default()),
    )
    .await
    .expect("lapin connect must fail promptly");
    assert_amqp_error(
        res.map(|_| ()),
        530,
        "NOT_ALLOWED - vhost novhost not found",
    );
}

#[tokio::test]
async fn client_connection_close_gets_close_ok() {
    let broker = TestBroker::start();
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    raw.send(
        0,
        AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
            reply_code: 200,
            reply_text: "Goodbye".into(),
            class_id: 0,
            method_id: 0,
        })),
    )
    .await;
    match raw.recv_method().await {
        (0, AMQPClass::Connection(connection::AMQPMethod::CloseOk(_))) => {}
        other => panic!("expected connection.close-ok, got {other:?}"),
    }
    // Nothing may follow close-ok. RabbitMQ leaves the socket to the client (dropping it 30 s later);
    // Warren closes its side at once, which the spec allows: both are fine here.
    raw.expect_silence_or_eof(QUIET).await;
}

#[tokio::test]
async fn lapin_connects_and_closes() {
    let broker = TestBroker::start();
    let conn = connect_url(broker.url()).await;
    let ch = conn.create_channel().await.unwrap();
    ch.close(200, "bye".into()).await.unwrap();
    conn.close(200, "bye".into()).await.unwrap();
}

async fn open_with_heartbeat(broker: &TestBroker, heartbeat: u16) -> Raw {
    Raw::open_with(
        broker.addr(),
        Handshake {
            heartbeat,
            ..Handshake::default()
        },
    )
    .await
}

#[tokio::test]
async fn server_sends_heartbeats_at_negotiated_interval() {
    let broker = TestBroker::start();
    let mut raw = open_with_heartbeat(&broker, 1).await;
    let t0 = Instant::now();
    let mut beats = 0;
    while t0.elapsed() < Duration::from_millis(2200) && beats < 2 {
        // Keep our side alive too.
        raw.send_bytes(&raw_frame(8, 0, &[])).await;
        match raw.recv_timeout(Duration::from_millis(500)).await {
            Ok(f) if f.kind == 8 => {
                assert_eq!((f.channel, f.size), (0, 0), "heartbeat frame {f:?}");
                beats += 1;
            }
            Ok(f) => panic!("unexpected frame {f:?}"),
            Err(RecvError::Timeout) => {}
            Err(e) => panic!("connection ended: {e:?}"),
        }
    }
    assert!(
        beats >= 2,
        "expected at least 2 heartbeats within 2.2 s at heartbeat=1, got {beats}"
    );
}

#[tokio::test]
async fn silent_client_is_disconnected_after_two_intervals() {
    let broker = TestBroker::start();
    let mut raw = open_with_heartbeat(&broker, 1).await;
    raw.channel_open(1).await;
    let t0 = Instant::now();
    let ended = loop {
        match raw.recv_timeout(Duration::from_secs(6)).await {
            Ok(f) if f.kind == 8 => continue,
            Ok(f) => match &f.parsed {
                // A connection.close before the socket closes is fine too.
                Some(AMQPFrame::Method(
                    0,
                    AMQPClass::Connection(connection::AMQPMethod::Close(_)),
                )) => continue,
                _ => panic!("unexpected frame {f:?}"),
            },
            Err(RecvError::Closed(_)) => break t0.elapsed(),
            Err(RecvError::Timeout) => panic!("a silent client was not disconnected within 6 s"),
        }
    };
    assert!(
        ended >= Duration::from_millis(1500),
        "disconnected too early ({ended:?}): the client may be silent for up to 2 intervals"
    );
    assert!(
        ended <= Duration::from_millis(4500),
        "disconnected too late: {ended:?}"
    );
}

#[tokio::test]
async fn heartbeating_client_stays_connected() {
    let broker = TestBroker::start();
    let mut raw = open_with_heartbeat(&broker, 1).await;
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_millis(3500) {
        raw.send_bytes(&raw_frame(8, 0, &[])).await;
        match raw.recv_timeout(Duration::from_millis(400)).await {
            Ok(f) if f.kind == 8 => {}
            Ok(f) => panic!("unexpected frame {f:?}"),
            Err(RecvError::Timeout) => {}
            Err(e) => panic!("a heartbeating client was disconnected: {e:?}"),
        }
    }
    raw.channel_open(1).await;
    raw.close().await;
}

#[tokio::test]
async fn heartbeat_flag_sets_tune_and_disconnects_silent_client() {
    let broker = TestBroker::start_with(&["--heartbeat", "1"]);
    if broker.is_external() {
        eprintln!("skipped: needs a spawned warren (server flag --heartbeat)");
        return;
    }
    let mut raw = Raw::tcp(broker.addr()).await;
    raw.send_bytes(PROTOCOL_HEADER).await;
    raw.expect_start().await;
    raw.send_start_ok(&Handshake::default()).await;
    let tune = match raw.recv_method().await {
        (0, AMQPClass::Connection(connection::AMQPMethod::Tune(t))) => t,
        other => panic!("expected connection.tune, got {other:?}"),
    };
    assert_eq!(tune.heartbeat, 1);
    raw.send_tune_ok(tune.channel_max, tune.frame_max, tune.heartbeat)
        .await;
    raw.send(
        0,
        AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
            virtual_host: "/".into(),
        })),
    )
    .await;
    let t0 = Instant::now();
    loop {
        match raw.recv_timeout(Duration::from_secs(6)).await {
            Ok(_) => continue,
            Err(RecvError::Closed(_)) => break,
            Err(RecvError::Timeout) => panic!("silent client not disconnected"),
        }
    }
    let ended = t0.elapsed();
    assert!(
        (Duration::from_millis(1500)..=Duration::from_millis(4500)).contains(&ended),
        "disconnected after {ended:?}"
    );
}

#[tokio::test]
async fn sigterm_closes_connections_with_320() {
    let mut broker = TestBroker::start();
    if broker.is_external() {
        eprintln!("skipped: needs a spawned warren (sends it SIGTERM)");
        return;
    }
    let mut raw = broker.raw().await;
    raw.channel_open(1).await;
    let conn = connect_url(broker.url()).await;
    let _ch = conn.create_channel().await.unwrap();
    broker.sigterm();
    let close = raw
        .expect_connection_close_prefix(320, "CONNECTION_FORCED", 0, 0)
        .await;
    assert_eq!(
        close.reply_text.as_str(),
        "CONNECTION_FORCED - broker forced connection closure with reason 'shutdown'"
    );
    let status = broker
        .wait_exit(Duration::from_secs(10))
        .expect("warren did not exit within 10 s of SIGTERM");
    assert!(
        status.success(),
        "warren exited with {status} after SIGTERM"
    );
    // lapin saw the close as well.
    tokio::time::sleep(QUIET).await;
    assert!(
        !conn.status().connected(),
        "lapin still thinks it is connected"
    );
}

#[tokio::test]
async fn heartbeat_timeout_cleans_up_the_connection() {
    let broker = TestBroker::start();
    let mut admin = broker.raw().await;
    admin.channel_open(1).await;
    let q = unique("hs-hb-cleanup");
    let excl = unique("hs-hb-excl");
    admin.declare_queue(1, &q).await;
    admin
        .publish(1, "", &q, false, Default::default(), b"held")
        .await;
    admin.wait_ready(1, &q, 1).await;

    // A client that holds an unacked message and an exclusive queue, then goes silent.
    let mut silent = open_with_heartbeat(&broker, 1).await;
    silent.channel_open(1).await;
    let d = silent.get(1, &q, false).await.expect("a message");
    assert_eq!(d.body, b"held");
    silent
        .call(
            1,
            m::queue_declare(
                &excl,
                raw::QueueFlags {
                    exclusive: true,
                    ..Default::default()
                },
            ),
        )
        .await;
    loop {
        match silent.recv_timeout(Duration::from_secs(6)).await {
            Ok(_) => continue,
            Err(RecvError::Closed(_)) => break,
            Err(RecvError::Timeout) => panic!("silent client not disconnected"),
        }
    }

    // Its unacked message is back (redelivered) and its exclusive queue is gone.
    admin.wait_ready(1, &q, 1).await;
    let back = admin.get(1, &q, true).await.expect("requeued message");
    assert_eq!(
        (back.body.as_slice(), back.redelivered()),
        (&b"held"[..], true)
    );
    admin
        .send(
            1,
            m::queue_declare(
                &excl,
                raw::QueueFlags {
                    passive: true,
                    ..Default::default()
                },
            ),
        )
        .await;
    admin
        .expect_channel_close(
            1,
            404,
            &format!("NOT_FOUND - no queue '{excl}' in vhost '/'"),
            50,
            10,
        )
        .await;
}
