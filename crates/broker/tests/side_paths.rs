//! Queue side paths on simulated time: what counts as use for `x-expires`, what a full
//! `reject-publish` queue answers when a publish's own dead letters fill it, and a TTL of 0
//! against the dispatch that follows a publish.

use bytes::Bytes;
use warren_broker::{Broker, BrokerConfig, CreditGroup, DeclareQueue, Delivery, Message};
use warren_codec::{FieldTable, FieldValue, ShortStr};

const V: &str = "/";

fn declare(b: &mut Broker, name: &'static str, args: &[(&'static str, FieldValue)]) {
    let mut arguments = FieldTable::new();
    for (k, v) in args {
        arguments.insert(*k, v.clone());
    }
    let req = DeclareQueue {
        name: name.into(),
        passive: false,
        durable: false,
        exclusive: false,
        auto_delete: false,
        arguments,
    };
    b.declare_queue(V, req, 1).expect("declare");
}

fn msg(body: &'static str) -> Message {
    Message {
        exchange: "".into(),
        routing_key: "".into(),
        properties: Bytes::from_static(&[0, 0]),
        body: Bytes::from_static(body.as_bytes()),
        persistent: false,
        store_key: None,
        away: None,
    }
}

fn drain(b: &mut Broker, q: &str) -> Vec<String> {
    let mut out = Vec::new();
    while let Some((d, _)) = b.get(V, q, true, 1).expect("get") {
        out.push(String::from_utf8_lossy(&d.message.body).into_owned());
    }
    out
}

fn long(s: &str) -> FieldValue {
    FieldValue::long_str(s)
}

/// RabbitMQ: a queue is unused while it has no consumers, is not redeclared and sees no
/// basic.get; a poll that finds nothing is a basic.get too.
#[test]
fn basic_get_keeps_an_x_expires_queue_alive_even_when_it_finds_nothing() {
    let mut b = Broker::new(BrokerConfig::default());
    declare(&mut b, "polled", &[("x-expires", FieldValue::I32(1500))]);
    declare(&mut b, "idle", &[("x-expires", FieldValue::I32(1500))]);
    let mut now = 0;
    while now <= 4_000 {
        b.advance_time(now);
        assert!(b.get(V, "polled", false, 1).expect("get").is_none());
        b.tick(now);
        now += 400;
    }
    assert!(b.queue_id(V, "polled").is_some(), "polled every 0.4 s");
    assert!(b.queue_id(V, "idle").is_none(), "unused for 1.5 s");
    // Once the polling stops, the lease runs out from the last get.
    b.tick(now - 400 + 1_499);
    assert!(b.queue_id(V, "polled").is_some());
    b.tick(now - 400 + 1_500);
    assert!(b.queue_id(V, "polled").is_none());
}

/// `a` (drop-head, length 1) dead-letters its head to `c` (reject-publish, length 1); a
/// publish that reaches both must not lose its copy for `c` to `a`'s dead letter while
/// being confirmed: `c` takes the message (RabbitMQ's queues get a publish's copies before
/// the dead letters it causes) and the dead letter, arriving at a full queue, is refused.
#[test]
fn a_dead_letter_the_publish_causes_does_not_refuse_its_own_copy_behind_an_ack() {
    let mut b = Broker::new(BrokerConfig::default());
    declare(
        &mut b,
        "a",
        &[
            ("x-max-length", FieldValue::I32(1)),
            ("x-dead-letter-exchange", long("")),
            ("x-dead-letter-routing-key", long("c")),
        ],
    );
    declare(
        &mut b,
        "c",
        &[
            ("x-max-length", FieldValue::I32(1)),
            ("x-overflow", long("reject-publish")),
        ],
    );
    for q in ["a", "c"] {
        b.bind_queue(V, q, "amq.fanout", "", &FieldTable::new(), 1)
            .expect("bind");
    }
    let r = b.publish(V, "", "a", msg("old"), 0).expect("publish");
    assert!(!r.rejected);
    let mut m = msg("new");
    m.exchange = ShortStr::from_static("amq.fanout");
    let r = b.publish(V, "amq.fanout", "", m, 0).expect("publish");
    let in_c = drain(&mut b, "c");
    assert!(
        r.rejected || in_c.contains(&"new".to_owned()),
        "confirmed with an ack, yet not in c: c holds {in_c:?}"
    );
    assert!(!r.rejected, "c had room for the publish itself");
    assert_eq!(in_c, vec!["new"]);
    assert_eq!(drain(&mut b, "a"), vec!["new"]);
}

/// The same with `reject-publish-dlx` and `c` already full: the publish is nacked for `c`,
/// and `c` dead-letters the refused copy (reason maxlen) to `c-dlq`.
#[test]
fn a_refused_copy_is_a_nack_and_reject_publish_dlx_dead_letters_it() {
    let mut b = Broker::new(BrokerConfig::default());
    declare(&mut b, "c-dlq", &[]);
    declare(
        &mut b,
        "c",
        &[
            ("x-max-length", FieldValue::I32(1)),
            ("x-overflow", long("reject-publish-dlx")),
            ("x-dead-letter-exchange", long("")),
            ("x-dead-letter-routing-key", long("c-dlq")),
        ],
    );
    declare(&mut b, "plain", &[]);
    for q in ["c", "plain"] {
        b.bind_queue(V, q, "amq.fanout", "", &FieldTable::new(), 1)
            .expect("bind");
    }
    assert!(!b.publish(V, "", "c", msg("first"), 0).unwrap().rejected);
    let mut m = msg("second");
    m.exchange = ShortStr::from_static("amq.fanout");
    let r = b.publish(V, "amq.fanout", "", m, 0).expect("publish");
    assert!(r.rejected, "c is full");
    assert_eq!(
        r.queues, 2,
        "a refusing queue counts as routed (no basic.return)"
    );
    assert_eq!(drain(&mut b, "plain"), vec!["second"]);
    assert_eq!(drain(&mut b, "c"), vec!["first"]);
    assert_eq!(drain(&mut b, "c-dlq"), vec!["second"]);
}

/// Dispatches until no queue has work, as the server does after a publish.
fn dispatch(b: &mut Broker) -> Vec<Delivery> {
    let mut out = Vec::new();
    while b.needs_dispatch() {
        assert!(b.dispatch_one(&mut out), "needs_dispatch but no work");
    }
    out
}

/// RabbitMQ: a message with a TTL of 0 reaches a consumer that waits as it arrives, and is
/// dead-lettered at once when none does. The server's dispatch runs after the publish, on a
/// clock that may have moved on (a busy node, a tick in between): the message must still go
/// to the consumer that waited for it.
#[test]
fn a_ttl_of_zero_reaches_a_waiting_consumer_when_the_dispatch_comes_later() {
    let mut b = Broker::new(BrokerConfig::default());
    declare(&mut b, "dead", &[]);
    declare(
        &mut b,
        "zero",
        &[
            ("x-message-ttl", FieldValue::I32(0)),
            ("x-dead-letter-exchange", long("")),
            ("x-dead-letter-routing-key", long("dead")),
        ],
    );
    b.publish(V, "", "zero", msg("nobody"), 1_000)
        .expect("publish");
    assert!(dispatch(&mut b).is_empty());
    b.tick(1_001);
    assert_eq!(drain(&mut b, "dead"), vec!["nobody"]);

    let group = CreditGroup {
        conn: 1,
        channel: 1,
    };
    b.consume(
        V,
        "zero",
        group,
        "c".into(),
        true,
        false,
        0,
        &FieldTable::new(),
    )
    .expect("consume");
    assert!(dispatch(&mut b).is_empty());
    b.publish(V, "", "zero", msg("waited-for"), 2_000)
        .expect("publish");
    b.advance_time(2_003);
    b.tick(2_003);
    let got = dispatch(&mut b);
    let bodies: Vec<&[u8]> = got.iter().map(|d| &d.message.body[..]).collect();
    assert_eq!(bodies, vec![&b"waited-for"[..]]);
    b.tick(2_010);
    assert!(drain(&mut b, "dead").is_empty());
    assert!(drain(&mut b, "zero").is_empty());
}
