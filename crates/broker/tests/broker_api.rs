//! The broker API against RabbitMQ 3.10's answers (codes and exact texts).

use bytes::{BufMut, Bytes, BytesMut};
use warren_broker::{
    Broker, BrokerConfig, ConnId, ConsumerId, ConsumerKey, Credit, CreditGroup, DeclareQueue,
    Delivery, Message, QueueId,
};
use warren_codec::{AmqpError, FieldTable, FieldValue, ReplyCode, ShortStr};

const V: &str = "/";
const C1: ConnId = 1;
const C2: ConnId = 2;

fn broker() -> Broker {
    Broker::new(BrokerConfig::default())
}

fn req(name: &'static str) -> DeclareQueue {
    DeclareQueue {
        name: name.into(),
        passive: false,
        durable: false,
        exclusive: false,
        auto_delete: false,
        arguments: FieldTable::new(),
    }
}

fn declare(b: &mut Broker, name: &'static str) -> QueueId {
    b.declare_queue(V, req(name), C1).expect("declare").queue
}

fn table(pairs: &[(&'static str, FieldValue)]) -> FieldTable {
    let mut t = FieldTable::new();
    for (k, v) in pairs {
        t.insert(*k, v.clone());
    }
    t
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

/// Raw basic properties holding only a headers table.
fn with_headers(body: &'static str, headers: &FieldTable) -> Message {
    let mut raw = BytesMut::new();
    raw.put_u16(1 << 13);
    headers.encode(&mut raw);
    Message {
        properties: raw.freeze(),
        ..msg(body)
    }
}

fn err(code: ReplyCode, text: &str) -> AmqpError {
    AmqpError::new(code, text)
}

fn ck(conn: ConnId, channel: u16, tag: &'static str) -> ConsumerKey {
    ConsumerKey {
        conn,
        channel,
        tag: tag.into(),
    }
}

fn publish(b: &mut Broker, x: &str, rk: &str, m: Message) -> u32 {
    b.publish(V, x, rk, m, 0).expect("publish").queues
}

fn ready(b: &Broker, q: QueueId) -> u32 {
    b.queue_info(q).expect("queue").message_count
}

fn group(conn: ConnId, channel: u16) -> CreditGroup {
    CreditGroup { conn, channel }
}

/// basic.consume with no prefetch limit and no arguments.
fn consume(
    b: &mut Broker,
    queue: &str,
    conn: ConnId,
    channel: u16,
    tag: &'static str,
    no_ack: bool,
    exclusive: bool,
) -> Result<(QueueId, ConsumerId), AmqpError> {
    b.consume(
        V,
        queue,
        group(conn, channel),
        tag.into(),
        no_ack,
        exclusive,
        0,
        &FieldTable::new(),
    )
}

/// Dispatches until no queue has work, as the server does; returns the deliveries.
fn dispatch(b: &mut Broker) -> Vec<Delivery> {
    let mut out = Vec::new();
    let mut calls = 0;
    while b.needs_dispatch() {
        assert!(
            b.dispatch_one(&mut out),
            "needs_dispatch but no queue had work"
        );
        calls += 1;
        assert!(calls < 10_000, "dispatch never settles");
    }
    out
}

/// The consumer tag of a delivery ("" for basic.get).
fn tag_of(d: &Delivery) -> String {
    d.consumer
        .as_ref()
        .map(|(_, _, t)| t.to_string())
        .unwrap_or_default()
}

// ------------------------------------------------------------------ declare

#[test]
fn predeclared_exchanges() {
    let mut b = broker();
    for x in [
        "amq.direct",
        "amq.fanout",
        "amq.topic",
        "amq.headers",
        "amq.match",
        "amq.rabbitmq.trace",
    ] {
        assert!(b.exchange_exists(V, x), "{x}");
        assert_eq!(
            b.declare_exchange(V, x, "", true, false, false, false, &FieldTable::new()),
            Ok(())
        );
    }
    // Redeclaring a system exchange with its own type is fine.
    assert_eq!(
        b.declare_exchange(
            V,
            "amq.direct",
            "direct",
            false,
            true,
            false,
            false,
            &FieldTable::new()
        ),
        Ok(())
    );
    assert_eq!(
        b.publish(V, "amq.rabbitmq.trace", "x", msg("m"), 0),
        Err(err(
            ReplyCode::AccessRefused,
            "cannot publish to internal exchange 'amq.rabbitmq.trace' in vhost '/'"
        ))
    );
    assert!(b.vhost_exists("/"));
    assert!(!b.vhost_exists("other"));
}

#[test]
fn passive_declare_missing_queue() {
    let mut b = broker();
    let mut r = req("nope");
    r.passive = true;
    assert_eq!(
        b.declare_queue(V, r, C1),
        Err(err(ReplyCode::NotFound, "no queue 'nope' in vhost '/'"))
    );
}

#[test]
fn declare_and_redeclare() {
    let mut b = broker();
    let d = b.declare_queue(V, req("q"), C1).expect("declare");
    assert_eq!(
        (d.name.as_str(), d.message_count, d.consumer_count),
        ("q", 0, 0)
    );
    publish(&mut b, "", "q", msg("a"));
    let again = b.declare_queue(V, req("q"), C2).expect("redeclare");
    assert_eq!((again.queue, again.message_count), (d.queue, 1));
    let mut passive = req("q");
    passive.passive = true;
    passive.durable = true; // ignored when passive
    assert_eq!(
        b.declare_queue(V, passive, C2).expect("passive").queue,
        d.queue
    );

    let mut durable = req("q");
    durable.durable = true;
    assert_eq!(
        b.declare_queue(V, durable, C1),
        Err(err(
            ReplyCode::PreconditionFailed,
            "inequivalent arg 'durable' for queue 'q' in vhost '/': received 'true' but current is 'false'"
        ))
    );
    let mut ad = req("q");
    ad.auto_delete = true;
    assert_eq!(
        b.declare_queue(V, ad, C1),
        Err(err(
            ReplyCode::PreconditionFailed,
            "inequivalent arg 'auto_delete' for queue 'q' in vhost '/': received 'true' but current is 'false'"
        ))
    );
}

#[test]
fn inequivalent_x_args() {
    let mut b = broker();
    let mut r = req("ml");
    r.arguments = table(&[("x-max-length", FieldValue::I32(10))]);
    b.declare_queue(V, r.clone(), C1).expect("declare");
    r.arguments = table(&[("x-max-length", FieldValue::I32(20))]);
    assert_eq!(
        b.declare_queue(V, r.clone(), C1),
        Err(err(
            ReplyCode::PreconditionFailed,
            "inequivalent arg 'x-max-length' for queue 'ml' in vhost '/': received '20' but current is '10'"
        ))
    );
    // Unknown x- args are not compared; a wider integer type is equivalent.
    r.arguments = table(&[
        ("x-max-length", FieldValue::I64(10)),
        ("x-other", FieldValue::Bool(true)),
    ]);
    assert!(b.declare_queue(V, r, C1).is_ok());
}

#[test]
fn reserved_queue_name_and_invalid_args() {
    let mut b = broker();
    assert_eq!(
        b.declare_queue(V, req("amq.q"), C1),
        Err(err(
            ReplyCode::AccessRefused,
            "queue name 'amq.q' contains reserved prefix 'amq.*'"
        ))
    );
    let mut r = req("ttl");
    r.arguments = table(&[("x-message-ttl", FieldValue::I32(-5))]);
    assert_eq!(
        b.declare_queue(V, r, C1),
        Err(err(
            ReplyCode::PreconditionFailed,
            "invalid arg 'x-message-ttl' for queue 'ttl' in vhost '/': {value_negative,-5}"
        ))
    );
    let mut r = req("ml");
    r.arguments = table(&[("x-max-length", FieldValue::long_str("ten"))]);
    assert_eq!(
        b.declare_queue(V, r, C1),
        Err(err(
            ReplyCode::PreconditionFailed,
            "invalid arg 'x-max-length' for queue 'ml' in vhost '/': \"expected integer, got longstr\""
        ))
    );
    let mut r = req("dlx");
    r.arguments = table(&[("x-dead-letter-exchange", FieldValue::I32(1))]);
    assert_eq!(
        b.declare_queue(V, r, C1),
        Err(err(
            ReplyCode::PreconditionFailed,
            "invalid type 'signedint' for arg 'x-dead-letter-exchange' in queue 'dlx' in vhost '/'"
        ))
    );
    assert!(b.queue_id(V, "ttl").is_none());
}

#[test]
fn quorum_properties() {
    let mut b = broker();
    let quorum = table(&[("x-queue-type", FieldValue::long_str("quorum"))]);
    let mut r = req("qq");
    r.arguments = quorum.clone();
    r.durable = true;
    r.exclusive = true;
    assert_eq!(
        b.declare_queue(V, r, C1),
        Err(err(
            ReplyCode::PreconditionFailed,
            "invalid property 'exclusive-owner' for queue 'qq' in vhost '/'"
        ))
    );
    let mut r = req("qq");
    r.arguments = quorum.clone();
    assert_eq!(
        b.declare_queue(V, r, C1),
        Err(err(
            ReplyCode::PreconditionFailed,
            "invalid property 'non-durable' for queue 'qq' in vhost '/'"
        ))
    );
    let mut r = req("qq");
    r.arguments = quorum.clone();
    r.durable = true;
    r.auto_delete = true;
    assert_eq!(
        b.declare_queue(V, r, C1),
        Err(err(
            ReplyCode::PreconditionFailed,
            "invalid property 'auto-delete' for queue 'qq' in vhost '/'"
        ))
    );
    let mut r = req("qq");
    r.arguments = quorum;
    r.durable = true;
    let id = b.declare_queue(V, r, C1).expect("quorum").queue;
    assert_eq!(
        b.queue_args(id).map(|a| a.queue_type),
        Some(warren_broker::QueueType::Quorum)
    );
    // classic == no type on redeclare.
    let mut r = req("cl");
    r.arguments = table(&[("x-queue-type", FieldValue::long_str("classic"))]);
    b.declare_queue(V, r, C1).expect("classic");
    assert!(b.declare_queue(V, req("cl"), C1).is_ok());
}

#[test]
fn redeclare_compares_the_types_arguments() {
    let mut b = broker();
    // A classic queue ignores arguments it does not have on redeclare.
    declare(&mut b, "c");
    let mut r = req("c");
    r.arguments = table(&[
        ("x-quorum-initial-group-size", FieldValue::I32(5)),
        ("x-max-age", FieldValue::long_str("1D")),
    ]);
    assert!(b.declare_queue(V, r, C1).is_ok());
    // x-delivery-limit acts on classic queues in Warren, so it is compared.
    let mut r = req("c");
    r.arguments = table(&[("x-delivery-limit", FieldValue::I32(5))]);
    assert!(b.declare_queue(V, r, C1).is_err());
    // ...but not a type change.
    let mut r = req("c");
    r.arguments = table(&[("x-queue-type", FieldValue::long_str("quorum"))]);
    assert_eq!(
        b.declare_queue(V, r, C1),
        Err(err(
            ReplyCode::PreconditionFailed,
            "inequivalent arg 'x-queue-type' for queue 'c' in vhost '/': received the value 'quorum' of type 'longstr' but current is none"
        ))
    );
    // A quorum queue compares x-delivery-limit.
    let mut r = req("qq");
    r.durable = true;
    r.arguments = table(&[("x-queue-type", FieldValue::long_str("quorum"))]);
    b.declare_queue(V, r.clone(), C1).expect("quorum");
    r.arguments.insert("x-delivery-limit", FieldValue::I32(3));
    assert_eq!(
        b.declare_queue(V, r, C1),
        Err(err(
            ReplyCode::PreconditionFailed,
            "inequivalent arg 'x-delivery-limit' for queue 'qq' in vhost '/': received the value '3' of type 'signedint' but current is none"
        ))
    );
    // Arguments a type does not support are refused on declare.
    let mut r = req("c2");
    r.arguments = table(&[("x-quorum-initial-group-size", FieldValue::I32(5))]);
    assert_eq!(
        b.declare_queue(V, r, C1),
        Err(err(
            ReplyCode::PreconditionFailed,
            "invalid arg 'x-quorum-initial-group-size' for queue 'c2' in vhost '/' of queue type rabbit_classic_queue"
        ))
    );
}

#[test]
fn server_named_queues() {
    let mut b = broker();
    let a = b.declare_queue(V, req(""), C1).expect("a");
    let c = b.declare_queue(V, req(""), C1).expect("b");
    assert_ne!(a.name, c.name);
    for n in [&a.name, &c.name] {
        assert!(n.starts_with("amq.gen-"), "{n}");
        assert_eq!(n.len(), 30);
    }
    assert_eq!(b.queue_id(V, &a.name), Some(a.queue));
    // Deterministic for a seed.
    let mut b2 = broker();
    assert_eq!(b2.declare_queue(V, req(""), C1).expect("same").name, a.name);
}

#[test]
fn cr_lf_stripped_from_names() {
    let mut b = broker();
    let d = b.declare_queue(V, req("a\r\nb"), C1).expect("declare");
    assert_eq!(d.name.as_str(), "ab");
}

// ---------------------------------------------------------------- exclusive

fn locked(q: &str) -> AmqpError {
    err(
        ReplyCode::ResourceLocked,
        &format!(
            "cannot obtain exclusive access to locked queue '{q}' in vhost '/'. It could be originally declared on another connection or the exclusive property value does not match that of the original declaration."
        ),
    )
}

#[test]
fn exclusive_queue_locked_for_other_connections() {
    let mut b = broker();
    let mut r = req("ex");
    r.exclusive = true;
    r.durable = true;
    let id = b.declare_queue(V, r.clone(), C1).expect("declare").queue;
    assert!(
        !b.queue_info(id).expect("info").durable,
        "exclusive queues are never durable"
    );
    // The owner may redeclare (durable is forced off on both sides).
    assert!(b.declare_queue(V, r.clone(), C1).is_ok());
    assert_eq!(b.declare_queue(V, r.clone(), C2), Err(locked("ex")));
    // Same connection, exclusive flag differs: locked too.
    assert_eq!(b.declare_queue(V, req("ex"), C1), Err(locked("ex")));
    let mut passive = req("ex");
    passive.passive = true;
    assert_eq!(b.declare_queue(V, passive.clone(), C2), Err(locked("ex")));
    assert!(b.declare_queue(V, passive, C1).is_ok());
    assert_eq!(b.delete_queue(V, "ex", false, false, C2), Err(locked("ex")));
    assert_eq!(b.purge_queue(V, "ex", C2), Err(locked("ex")));
    assert_eq!(b.get(V, "ex", false, C2), Err(locked("ex")));
    assert_eq!(
        consume(&mut b, "ex", C2, 1, "t", false, false),
        Err(locked("ex"))
    );
    assert_eq!(
        b.bind_queue(V, "ex", "amq.direct", "k", &FieldTable::new(), C2),
        Err(locked("ex"))
    );
    b.bind_queue(V, "ex", "amq.direct", "k", &FieldTable::new(), C1)
        .expect("owner binds");
    assert_eq!(
        b.unbind_queue(V, "ex", "amq.direct", "k", &FieldTable::new(), C2),
        Err(locked("ex"))
    );
    // Publishing to it from anywhere is fine.
    assert_eq!(publish(&mut b, "amq.direct", "k", msg("m")), 1);
    // The owner's connection closes: the queue goes.
    assert_eq!(b.connection_closed(C1), vec![id]);
    assert!(b.queue_id(V, "ex").is_none());
    assert_eq!(publish(&mut b, "amq.direct", "k", msg("m")), 0);
}

// ------------------------------------------------------------ delete, purge

#[test]
fn delete_and_purge() {
    let mut b = broker();
    let none = FieldTable::new();
    let q = declare(&mut b, "q");
    publish(&mut b, "", "q", msg("1"));
    publish(&mut b, "", "q", msg("2"));
    assert_eq!(
        b.delete_queue(V, "q", false, true, C1),
        Err(err(
            ReplyCode::PreconditionFailed,
            "queue 'q' in vhost '/' not empty"
        ))
    );
    // Prefetch 1: the consumer takes one message and leaves the other ready.
    let (_, t) = b
        .consume(V, "q", group(C1, 1), "t".into(), false, false, 1, &none)
        .expect("consume");
    assert_eq!(
        b.delete_queue(V, "q", true, false, C1),
        Err(err(
            ReplyCode::PreconditionFailed,
            "queue 'q' in vhost '/' in use"
        ))
    );
    // if-empty is checked first.
    assert_eq!(
        b.delete_queue(V, "q", true, true, C1),
        Err(err(
            ReplyCode::PreconditionFailed,
            "queue 'q' in vhost '/' not empty"
        ))
    );
    // One in flight, one ready: purge drops the ready one only.
    let got = dispatch(&mut b);
    assert_eq!(got.len(), 1);
    assert_eq!(b.purge_queue(V, "q", C1), Ok(1));
    let info = b.queue_info(q).expect("info");
    assert_eq!((info.message_count, info.in_flight), (0, 1));
    assert_eq!(
        b.purge_queue(V, "nope", C1),
        Err(err(ReplyCode::NotFound, "no queue 'nope' in vhost '/'"))
    );
    // Delete cancels consumers and reports the ready count.
    publish(&mut b, "", "q", msg("3"));
    let d = b.delete_queue(V, "q", false, false, C1).expect("delete");
    assert_eq!(d.message_count, 1);
    assert_eq!(d.cancelled, vec![ck(C1, 1, "t")]);
    assert!(b.queue_info(q).is_none());
    assert!(b.machine(q).is_none());
    assert!(!b.cancel(q, t), "the consumer went with its queue");
    // Deleting a missing queue is ok with 0 messages.
    assert_eq!(
        b.delete_queue(V, "q", true, true, C1)
            .map(|d| d.message_count),
        Ok(0)
    );
    // Settling against a deleted queue changes nothing (the receipt is stale).
    let delivery = &got[0];
    assert!(!b.settle(delivery.queue, delivery.receipt));
    assert!(!b.requeue(delivery.queue, delivery.receipt));
    assert!(!b.discard(delivery.queue, delivery.receipt));
    // A redeclared queue gets a new id.
    assert_ne!(declare(&mut b, "q"), q);
}

// --------------------------------------------------------------- exchanges

#[test]
fn exchange_errors() {
    let mut b = broker();
    let none = FieldTable::new();
    let passive =
        |b: &mut Broker, n: &str| b.declare_exchange(V, n, "", true, false, false, false, &none);
    assert_eq!(
        passive(&mut b, "nope-x"),
        Err(err(
            ReplyCode::NotFound,
            "no exchange 'nope-x' in vhost '/'"
        ))
    );
    assert_eq!(
        passive(&mut b, ""),
        Err(err(
            ReplyCode::AccessRefused,
            "operation not permitted on the default exchange"
        ))
    );
    let none = FieldTable::new();
    b.declare_exchange(V, "x", "direct", false, false, false, false, &none)
        .expect("declare");
    assert_eq!(
        b.declare_exchange(V, "x", "fanout", false, false, false, false, &none),
        Err(err(
            ReplyCode::PreconditionFailed,
            "inequivalent arg 'type' for exchange 'x' in vhost '/': received 'fanout' but current is 'direct'"
        ))
    );
    assert_eq!(
        b.declare_exchange(V, "x", "direct", false, true, false, false, &none),
        Err(err(
            ReplyCode::PreconditionFailed,
            "inequivalent arg 'durable' for exchange 'x' in vhost '/': received 'true' but current is 'false'"
        ))
    );
    assert_eq!(
        b.declare_exchange(V, "x", "direct", false, false, false, true, &none),
        Err(err(
            ReplyCode::PreconditionFailed,
            "inequivalent arg 'internal' for exchange 'x' in vhost '/': received 'true' but current is 'false'"
        ))
    );
    let ae = table(&[("alternate-exchange", FieldValue::long_str("ae"))]);
    assert_eq!(
        b.declare_exchange(V, "x", "direct", false, false, false, false, &ae),
        Err(err(
            ReplyCode::PreconditionFailed,
            "inequivalent arg 'alternate-exchange' for exchange 'x' in vhost '/': received the value 'ae' of type 'longstr' but current is none"
        ))
    );
    assert_eq!(
        b.declare_exchange(V, "bogus-x", "bogus", false, false, false, false, &none),
        Err(err(
            ReplyCode::CommandInvalid,
            "unknown exchange type 'bogus'"
        ))
    );
    assert_eq!(
        b.declare_exchange(V, "amq.custom", "direct", false, false, false, false, &none),
        Err(err(
            ReplyCode::AccessRefused,
            "exchange name 'amq.custom' contains reserved prefix 'amq.*'"
        ))
    );
    assert_eq!(
        b.declare_exchange(V, "", "direct", false, false, false, false, &none),
        Err(err(
            ReplyCode::AccessRefused,
            "operation not permitted on the default exchange"
        ))
    );
    let bad_ae = table(&[("alternate-exchange", FieldValue::I32(1))]);
    assert_eq!(
        b.declare_exchange(V, "y", "direct", false, false, false, false, &bad_ae),
        Err(err(
            ReplyCode::PreconditionFailed,
            "invalid type 'signedint' for arg 'alternate-exchange' in exchange 'y' in vhost '/'"
        ))
    );
    assert_eq!(
        b.delete_exchange(V, "", false),
        Err(err(
            ReplyCode::AccessRefused,
            "operation not permitted on the default exchange"
        ))
    );
    assert_eq!(
        b.delete_exchange(V, "amq.direct", false),
        Err(err(
            ReplyCode::AccessRefused,
            "deletion of system exchange 'amq.direct' in vhost '/' not allowed"
        ))
    );
    assert_eq!(b.delete_exchange(V, "never-was", true), Ok(()));
    declare(&mut b, "q");
    b.bind_queue(V, "q", "x", "k", &none, C1).expect("bind");
    assert_eq!(
        b.delete_exchange(V, "x", true),
        Err(err(
            ReplyCode::PreconditionFailed,
            "exchange 'x' in vhost '/' in use"
        ))
    );
    assert_eq!(b.delete_exchange(V, "x", false), Ok(()));
    assert!(!b.exchange_exists(V, "x"));
    assert_eq!(
        b.publish(V, "x", "k", msg("m"), 0),
        Err(err(ReplyCode::NotFound, "no exchange 'x' in vhost '/'"))
    );
    b.declare_exchange(V, "int", "fanout", false, false, false, true, &none)
        .expect("internal");
    assert_eq!(
        b.publish(V, "int", "k", msg("m"), 0),
        Err(err(
            ReplyCode::AccessRefused,
            "cannot publish to internal exchange 'int' in vhost '/'"
        ))
    );
}

#[test]
fn binding_errors() {
    let mut b = broker();
    let none = FieldTable::new();
    declare(&mut b, "q");
    let default = err(
        ReplyCode::AccessRefused,
        "operation not permitted on the default exchange",
    );
    assert_eq!(
        b.bind_queue(V, "q", "", "q", &none, C1),
        Err(default.clone())
    );
    assert_eq!(
        b.unbind_queue(V, "q", "", "q", &none, C1),
        Err(default.clone())
    );
    assert_eq!(
        b.bind_exchange(V, "", "amq.direct", "k", &none),
        Err(default.clone())
    );
    assert_eq!(
        b.bind_exchange(V, "amq.direct", "", "k", &none),
        Err(default)
    );
    assert_eq!(
        b.bind_queue(V, "q", "nope-x", "k", &none, C1),
        Err(err(
            ReplyCode::NotFound,
            "no exchange 'nope-x' in vhost '/'"
        ))
    );
    // The source is reported first when both are missing.
    assert_eq!(
        b.bind_queue(V, "nope", "nope-x", "k", &none, C1),
        Err(err(
            ReplyCode::NotFound,
            "no exchange 'nope-x' in vhost '/'"
        ))
    );
    assert_eq!(
        b.bind_queue(V, "nope", "amq.direct", "k", &none, C1),
        Err(err(ReplyCode::NotFound, "no queue 'nope' in vhost '/'"))
    );
    assert_eq!(
        b.bind_exchange(V, "nope-x", "amq.direct", "k", &none),
        Err(err(
            ReplyCode::NotFound,
            "no exchange 'nope-x' in vhost '/'"
        ))
    );
    assert_eq!(
        b.bind_exchange(V, "amq.direct", "nope-src", "k", &none),
        Err(err(
            ReplyCode::NotFound,
            "no exchange 'nope-src' in vhost '/'"
        ))
    );
    assert_eq!(
        b.bind_queue(V, "q", "amq.headers", "", &table(&[("x-match", FieldValue::long_str("most"))]), C1),
        Err(err(
            ReplyCode::PreconditionFailed,
            "Invalid x-match field value <<\"most\">>; expected all, any, all-with-x, or any-with-x"
        ))
    );
    // Unbinding what does not exist is fine.
    assert_eq!(
        b.unbind_queue(V, "q", "amq.direct", "none", &none, C1),
        Ok(())
    );
    assert_eq!(b.unbind_queue(V, "nope", "nope-x", "k", &none, C1), Ok(()));
    assert_eq!(b.unbind_exchange(V, "nope", "nope-x", "k", &none), Ok(()));
}

// ----------------------------------------------------------------- routing

#[test]
fn default_exchange_routes_by_queue_name() {
    let mut b = broker();
    let q = declare(&mut b, "q");
    assert_eq!(publish(&mut b, "", "q", msg("m")), 1);
    assert_eq!(publish(&mut b, "", "other", msg("m")), 0);
    assert_eq!(ready(&b, q), 1);
}

#[test]
fn direct_fanout_topic_headers() {
    let mut b = broker();
    let none = FieldTable::new();
    let (q1, q2, q3) = (
        declare(&mut b, "q1"),
        declare(&mut b, "q2"),
        declare(&mut b, "q3"),
    );
    // direct
    b.bind_queue(V, "q1", "amq.direct", "a", &none, C1)
        .expect("bind");
    b.bind_queue(V, "q2", "amq.direct", "a", &none, C1)
        .expect("bind");
    b.bind_queue(V, "q3", "amq.direct", "b", &none, C1)
        .expect("bind");
    assert_eq!(publish(&mut b, "amq.direct", "a", msg("m")), 2);
    assert_eq!(publish(&mut b, "amq.direct", "c", msg("m")), 0);
    b.unbind_queue(V, "q2", "amq.direct", "a", &none, C1)
        .expect("unbind");
    assert_eq!(publish(&mut b, "amq.direct", "a", msg("m")), 1);
    // fanout
    b.bind_queue(V, "q1", "amq.fanout", "", &none, C1)
        .expect("bind");
    b.bind_queue(V, "q2", "amq.fanout", "ignored", &none, C1)
        .expect("bind");
    assert_eq!(publish(&mut b, "amq.fanout", "anything", msg("m")), 2);
    // topic
    for (q, key) in [("q1", "a.*"), ("q2", "#"), ("q3", "a.#.z")] {
        b.bind_queue(V, q, "amq.topic", key, &none, C1)
            .expect("bind");
    }
    assert_eq!(publish(&mut b, "amq.topic", "a.b", msg("m")), 2);
    assert_eq!(publish(&mut b, "amq.topic", "a.z", msg("m")), 3);
    assert_eq!(publish(&mut b, "amq.topic", "", msg("m")), 1);
    assert_eq!(publish(&mut b, "amq.topic", "a.b.c.z", msg("m")), 2);
    // headers
    let all = table(&[
        ("x-match", FieldValue::long_str("all")),
        ("a", FieldValue::I32(1)),
        ("b", FieldValue::long_str("x")),
    ]);
    let any = table(&[
        ("x-match", FieldValue::long_str("any")),
        ("a", FieldValue::I32(1)),
        ("b", FieldValue::long_str("x")),
    ]);
    b.bind_queue(V, "q1", "amq.headers", "", &all, C1)
        .expect("bind");
    b.bind_queue(V, "q2", "amq.match", "", &any, C1)
        .expect("bind");
    let both = table(&[("b", FieldValue::long_str("x")), ("a", FieldValue::I64(1))]);
    let one = table(&[("a", FieldValue::I64(1))]);
    assert_eq!(
        publish(&mut b, "amq.headers", "", with_headers("m", &both)),
        1
    );
    assert_eq!(
        publish(&mut b, "amq.headers", "", with_headers("m", &one)),
        0
    );
    assert_eq!(publish(&mut b, "amq.match", "", with_headers("m", &one)), 1);
    assert_eq!(publish(&mut b, "amq.match", "", msg("no headers")), 0);
    let _ = (q1, q2, q3);
}

#[test]
fn queue_bound_twice_gets_one_copy() {
    let mut b = broker();
    let none = FieldTable::new();
    let q = declare(&mut b, "q");
    b.bind_queue(V, "q", "amq.topic", "a.*", &none, C1)
        .expect("bind");
    b.bind_queue(V, "q", "amq.topic", "*.b", &none, C1)
        .expect("bind");
    b.bind_queue(V, "q", "amq.topic", "a.*", &none, C1)
        .expect("same binding again");
    b.bind_queue(
        V,
        "q",
        "amq.topic",
        "a.*",
        &table(&[("k", FieldValue::I32(1))]),
        C1,
    )
    .expect("with args");
    assert_eq!(publish(&mut b, "amq.topic", "a.b", msg("m")), 1);
    assert_eq!(ready(&b, q), 1);
}

#[test]
fn exchange_to_exchange_with_cycles() {
    let mut b = broker();
    let none = FieldTable::new();
    for (x, t) in [("x1", "direct"), ("x2", "fanout"), ("x3", "topic")] {
        b.declare_exchange(V, x, t, false, false, false, false, &none)
            .expect("declare");
    }
    let q = declare(&mut b, "q");
    let q2 = declare(&mut b, "q2");
    b.bind_exchange(V, "x2", "x1", "k", &none)
        .expect("x1 -> x2");
    b.bind_exchange(V, "x3", "x2", "", &none).expect("x2 -> x3");
    b.bind_exchange(V, "x1", "x3", "#", &none)
        .expect("x3 -> x1 (cycle)");
    b.bind_exchange(V, "x2", "x2", "", &none)
        .expect("self loop");
    b.bind_queue(V, "q", "x3", "k", &none, C1).expect("bind");
    b.bind_queue(V, "q", "x2", "", &none, C1)
        .expect("bind twice through the path");
    b.bind_queue(V, "q2", "x1", "other", &none, C1)
        .expect("bind");
    assert_eq!(publish(&mut b, "x1", "k", msg("m")), 1);
    assert_eq!(ready(&b, q), 1);
    // Through the cycle: x3 -> x1 routes "other" to q2, and x3 also to... only q via "k".
    assert_eq!(publish(&mut b, "x3", "other", msg("m")), 1);
    assert_eq!(ready(&b, q2), 1);
    b.unbind_exchange(V, "x2", "x1", "k", &none)
        .expect("unbind");
    assert_eq!(publish(&mut b, "x1", "k", msg("m")), 0);
    // Deleting an exchange removes bindings in both directions.
    b.delete_exchange(V, "x3", false).expect("delete");
    assert_eq!(publish(&mut b, "x2", "", msg("m")), 1);
}

#[test]
fn long_exchange_ring() {
    let mut b = broker();
    let none = FieldTable::new();
    let names: Vec<String> = (0..40).map(|i| format!("ring-{i}")).collect();
    for n in &names {
        b.declare_exchange(V, n, "fanout", false, false, false, false, &none)
            .expect("declare");
    }
    for i in 0..names.len() {
        let next = &names[(i + 1) % names.len()];
        b.bind_exchange(V, next, &names[i], "", &none)
            .expect("bind");
        // Shortcuts: every exchange also reaches the one after next.
        let skip = &names[(i + 2) % names.len()];
        b.bind_exchange(V, skip, &names[i], "", &none)
            .expect("bind");
    }
    let q = declare(&mut b, "q");
    b.bind_queue(V, "q", "ring-39", "", &none, C1)
        .expect("bind");
    b.bind_queue(V, "q", "ring-20", "", &none, C1)
        .expect("bind");
    assert_eq!(publish(&mut b, "ring-0", "", msg("m")), 1);
    assert_eq!(ready(&b, q), 1);
}

#[test]
fn fanout_to_many_exchanges() {
    let mut b = broker();
    let none = FieldTable::new();
    b.declare_exchange(V, "hub", "fanout", false, false, false, false, &none)
        .expect("hub");
    let q = declare(&mut b, "q");
    for i in 0..30 {
        let x = format!("spoke-{i}");
        b.declare_exchange(V, &x, "direct", false, false, false, false, &none)
            .expect("spoke");
        b.bind_exchange(V, &x, "hub", "", &none)
            .expect("hub -> spoke");
        b.bind_queue(V, "q", &x, "k", &none, C1)
            .expect("spoke -> q");
    }
    let other = declare(&mut b, "other");
    b.bind_queue(V, "other", "spoke-29", "k", &none, C1)
        .expect("bind");
    assert_eq!(publish(&mut b, "hub", "k", msg("m")), 2);
    assert_eq!((ready(&b, q), ready(&b, other)), (1, 1));
    assert_eq!(publish(&mut b, "hub", "nope", msg("m")), 0);
}

#[test]
fn alternate_exchange() {
    let mut b = broker();
    let none = FieldTable::new();
    b.declare_exchange(V, "ae", "fanout", false, false, false, false, &none)
        .expect("ae");
    let ae = table(&[("alternate-exchange", FieldValue::long_str("ae"))]);
    b.declare_exchange(V, "main", "direct", false, false, false, false, &ae)
        .expect("main");
    let (q, lost) = (declare(&mut b, "q"), declare(&mut b, "lost"));
    b.bind_queue(V, "q", "main", "k", &none, C1).expect("bind");
    b.bind_queue(V, "lost", "ae", "", &none, C1).expect("bind");
    assert_eq!(publish(&mut b, "main", "k", msg("m")), 1);
    assert_eq!(publish(&mut b, "main", "other", msg("m")), 1);
    assert_eq!((ready(&b, q), ready(&b, lost)), (1, 1));
}

#[test]
fn auto_delete_exchange_goes_with_last_binding() {
    let mut b = broker();
    let none = FieldTable::new();
    b.declare_exchange(V, "ad", "direct", false, false, true, false, &none)
        .expect("declare");
    declare(&mut b, "q1");
    declare(&mut b, "q2");
    b.bind_queue(V, "q1", "ad", "a", &none, C1).expect("bind");
    b.bind_queue(V, "q2", "ad", "a", &none, C1).expect("bind");
    b.unbind_queue(V, "q1", "ad", "a", &none, C1)
        .expect("unbind");
    assert!(b.exchange_exists(V, "ad"));
    // Deleting the last bound queue removes the last binding.
    b.delete_queue(V, "q2", false, false, C1).expect("delete");
    assert!(!b.exchange_exists(V, "ad"));

    // Only bindings with the exchange as source count (as RabbitMQ 3.10.8 does).
    b.declare_exchange(V, "ad", "direct", false, false, true, false, &none)
        .expect("again");
    b.declare_exchange(V, "other", "fanout", false, false, false, false, &none)
        .expect("other");
    b.bind_exchange(V, "ad", "other", "", &none)
        .expect("ad as destination");
    b.unbind_exchange(V, "ad", "other", "", &none)
        .expect("unbind");
    assert!(b.exchange_exists(V, "ad"));
    b.bind_exchange(V, "other", "ad", "k", &none)
        .expect("ad as source");
    b.unbind_exchange(V, "other", "ad", "k", &none)
        .expect("unbind");
    assert!(!b.exchange_exists(V, "ad"));
    // Deleting a destination exchange removes the binding, and with it an auto-delete source.
    b.declare_exchange(V, "ad", "direct", false, false, true, false, &none)
        .expect("again");
    b.bind_exchange(V, "other", "ad", "k", &none)
        .expect("ad as source");
    b.delete_exchange(V, "other", false).expect("delete other");
    assert!(!b.exchange_exists(V, "ad"));
}

// ---------------------------------------------------------------- consumers

#[test]
fn consume_errors_and_exclusive_consumers() {
    let mut b = broker();
    declare(&mut b, "q");
    assert_eq!(
        consume(&mut b, "nope", C1, 1, "t", false, false),
        Err(err(ReplyCode::NotFound, "no queue 'nope' in vhost '/'"))
    );
    assert_eq!(
        b.get(V, "nope", false, C1),
        Err(err(ReplyCode::NotFound, "no queue 'nope' in vhost '/'"))
    );
    let (id, ex) = consume(&mut b, "q", C1, 1, "ex", false, true).expect("exclusive");
    assert_eq!(b.machine(id).and_then(|m| m.exclusive_consumer()), Some(ex));
    let in_use = err(
        ReplyCode::AccessRefused,
        "queue 'q' in vhost '/' in exclusive use",
    );
    assert_eq!(
        consume(&mut b, "q", C2, 1, "t", false, false),
        Err(in_use.clone())
    );
    assert!(b.cancel(id, ex));
    assert!(!b.cancel(id, ex));
    assert_eq!(b.machine(id).and_then(|m| m.exclusive_consumer()), None);
    let (_, t) = consume(&mut b, "q", C1, 1, "t", false, false).expect("shared");
    assert_eq!(consume(&mut b, "q", C2, 1, "ex", false, true), Err(in_use));
    // A reused consumer tag is the session's to refuse (530 "attempt to reuse consumer tag"):
    // the broker registers a second consumer with its own id.
    let (_, again) = consume(&mut b, "q", C1, 1, "t", false, false).expect("tag not checked");
    assert_ne!(again, t);
    assert_eq!(b.queue_info(id).map(|i| i.consumer_count), Some(2));
    assert!(b.cancel(id, again));
    assert_eq!(
        b.consume(V, "q", group(C1, 2), "p".into(), false, false, 0, &table(&[("x-priority", FieldValue::long_str("high"))])),
        Err(err(
            ReplyCode::PreconditionFailed,
            "invalid arg 'x-priority' for queue 'q' in vhost '/': \"expected integer, got longstr\""
        ))
    );
    assert_eq!(b.queue_info(id).map(|i| i.consumer_count), Some(1));
    // The machine keeps the consumer as declared.
    let (_, p) = b
        .consume(
            V,
            "q",
            group(C2, 3),
            "p".into(),
            true,
            false,
            7,
            &table(&[("x-priority", FieldValue::I32(5))]),
        )
        .expect("with priority");
    let spec = b
        .machine(id)
        .and_then(|m| m.consumer(p))
        .cloned()
        .expect("spec");
    assert_eq!(
        (
            spec.group,
            spec.tag.as_str(),
            spec.no_ack,
            spec.exclusive,
            spec.prefetch,
            spec.priority
        ),
        (group(C2, 3), "p", true, false, 7, 5)
    );
}

#[test]
fn auto_delete_queue_goes_with_last_consumer() {
    let mut b = broker();
    let mut r = req("ad");
    r.auto_delete = true;
    let id = b.declare_queue(V, r, C1).expect("declare").queue;
    // Never consumed: stays.
    assert!(b.get(V, "ad", true, C1).expect("get").is_none());
    let (_, a) = consume(&mut b, "ad", C1, 1, "a", false, false).expect("a");
    let (_, c) = consume(&mut b, "ad", C2, 1, "b", false, false).expect("b");
    assert!(b.cancel(id, a));
    assert!(b.queue_info(id).is_some());
    // A connection closing deletes only its exclusive queues: its consumers are the session's
    // to cancel first.
    assert_eq!(b.connection_closed(C2), Vec::<QueueId>::new());
    assert_eq!(b.queue_info(id).map(|i| i.consumer_count), Some(1));
    // The session cancels the other connection's consumer, the last one: the queue goes.
    assert!(b.cancel(id, c));
    assert!(b.queue_info(id).is_none());
    assert!(b.queue_id(V, "ad").is_none());
    assert!(!b.cancel(id, c));
}

#[test]
fn dispatch_round_robin_with_credit() {
    let mut b = broker();
    let none = FieldTable::new();
    let q = declare(&mut b, "q");
    for body in ["0", "1", "2", "3", "4", "5"] {
        publish(&mut b, "", "q", msg(body));
    }
    let (ga, gc) = (group(C1, 1), group(C1, 2));
    // a has no prefetch of its own, but its channel has a channel-wide credit of 2 (what the
    // session sets for a global prefetch); c has a prefetch of 1, which acks give back.
    let (_, a) = b
        .consume(V, "q", ga, "a".into(), false, false, 0, &none)
        .expect("a");
    b.set_credit(
        q,
        ga,
        Credit {
            blocked: false,
            limit: Some(2),
        },
    );
    let (_, c) = b
        .consume(V, "q", gc, "c".into(), false, false, 1, &none)
        .expect("c");
    let mut got = dispatch(&mut b);
    let seen: Vec<(String, u64)> = got.iter().map(|d| (tag_of(d), d.receipt.msg_id)).collect();
    assert_eq!(
        seen,
        vec![("a".into(), 0), ("c".into(), 1), ("a".into(), 2)]
    );
    assert_eq!(got[1].consumer, Some((c, gc, "c".into())));
    assert!(got
        .iter()
        .all(|d| d.queue == q && !d.redelivered && !d.settled && d.receipt.attempt == 1));
    assert!(!b.needs_dispatch());
    // What each consumer holds is kept by the queue.
    let held: Vec<(ConsumerId, u32)> = b
        .machine(q)
        .expect("q")
        .consumers()
        .map(|(id, _, n)| (id, n))
        .collect();
    assert_eq!(held, vec![(a, 2), (c, 1)]);
    // No credit: nothing more until credit comes back.
    assert!(dispatch(&mut b).is_empty());
    // Acking c's message gives c its credit back.
    assert!(b.settle(q, got[1].receipt));
    assert!(!b.settle(q, got[1].receipt), "settled twice");
    assert!(b.needs_dispatch());
    got.extend(dispatch(&mut b));
    assert_eq!(
        got.last().map(|d| (tag_of(d), d.receipt.msg_id)),
        Some(("c".into(), 3))
    );
    // Requeue 0: back in its place, but a's channel has no credit left (acks do not give
    // channel credit back: the session does, with set_credit).
    assert!(b.requeue(q, got[0].receipt));
    assert!(!b.needs_dispatch());
    assert_eq!(b.machine(q).map(|m| m.ready_ids()), Some(vec![0, 4, 5]));
    // The session grants a's channel more credit: 0 is redelivered before the later ones.
    b.set_credit(
        q,
        ga,
        Credit {
            blocked: false,
            limit: Some(10),
        },
    );
    assert!(b.needs_dispatch());
    got.extend(dispatch(&mut b));
    let tail: Vec<(String, u64, bool, u32)> = got[4..]
        .iter()
        .map(|d| {
            (
                tag_of(d),
                d.receipt.msg_id,
                d.redelivered,
                d.receipt.attempt,
            )
        })
        .collect();
    assert_eq!(
        tail,
        vec![
            ("a".into(), 0, true, 2),
            ("a".into(), 4, false, 1),
            ("a".into(), 5, false, 1)
        ]
    );
    let info = b.queue_info(q).expect("info");
    assert_eq!((info.message_count, info.in_flight), (0, 5));
    // discard forgets; the first delivery's receipt of 0 is stale.
    assert!(!b.discard(q, got[0].receipt));
    assert!(b.discard(q, got[4].receipt));
    assert_eq!(b.queue_info(q).map(|i| i.in_flight), Some(4));
    // A closed channel: the session cancels its consumers. What they hold stays in flight
    // (the channel holds it) until the session requeues it.
    assert!(b.cancel(q, c));
    let left: Vec<(ConsumerId, CreditGroup, String)> = b
        .machine(q)
        .expect("q")
        .consumers()
        .map(|(id, spec, _)| (id, spec.group, spec.tag.to_string()))
        .collect();
    assert_eq!(left, vec![(a, ga, "a".to_string())]);
    assert_eq!(
        b.machine(q).and_then(|m| m.holder(got[3].receipt)),
        Some(Some(c))
    );
    assert_eq!(b.queue_info(q).map(|i| i.in_flight), Some(4));
    assert!(b.requeue(q, got[3].receipt));
    let again = dispatch(&mut b);
    assert_eq!(
        again
            .iter()
            .map(|d| (tag_of(d), d.receipt.msg_id, d.redelivered))
            .collect::<Vec<_>>(),
        vec![("a".into(), 3, true)]
    );
}

#[test]
fn blocked_channel_gets_nothing() {
    let mut b = broker();
    let q = declare(&mut b, "q");
    for _ in 0..3 {
        publish(&mut b, "", "q", msg("m"));
    }
    let g = group(C1, 1);
    let blocked = Credit {
        blocked: true,
        limit: None,
    };
    // A queue keeps no credit for a channel that has no consumer there (the session tells a
    // queue its channel's credit right after consuming from it).
    b.set_credit(q, g, blocked);
    let fresh = b.machine(q).map(|m| m.digest());
    consume(&mut b, "q", C1, 1, "n", true, false).expect("no-ack");
    b.cancel(
        q,
        b.machine(q)
            .and_then(|m| m.consumers().next())
            .map(|c| c.0)
            .expect("consumer"),
    );
    assert_ne!(b.machine(q).map(|m| m.digest()), fresh);
    // A backed-up socket blocks even no-ack consumers.
    consume(&mut b, "q", C1, 1, "n2", true, false).expect("no-ack");
    b.set_credit(q, g, blocked);
    assert!(dispatch(&mut b).is_empty());
    assert_eq!(ready(&b, q), 3);
    // A channel-wide limit does not hold back no-ack consumers.
    b.set_credit(
        q,
        g,
        Credit {
            blocked: false,
            limit: Some(0),
        },
    );
    let got = dispatch(&mut b);
    assert_eq!(got.len(), 3);
    assert!(got.iter().all(|d| d.settled));
    assert_eq!(b.queue_info(q).map(|i| i.in_flight), Some(0));
}

#[test]
fn dispatch_batch_keeps_queue_dirty() {
    let mut b = Broker::new(BrokerConfig {
        dispatch_batch: 2,
        ..BrokerConfig::default()
    });
    declare(&mut b, "q");
    for _ in 0..5 {
        publish(&mut b, "", "q", msg("m"));
    }
    consume(&mut b, "q", C1, 1, "t", true, false).expect("consume");
    let mut got = Vec::new();
    assert!(b.dispatch_one(&mut got));
    assert_eq!(got.len(), 2);
    assert!(b.needs_dispatch());
    assert!(b.dispatch_one(&mut got));
    assert!(b.dispatch_one(&mut got));
    assert_eq!(got.len(), 5);
    assert!(!b.needs_dispatch());
    assert!(!b.dispatch_one(&mut got));
    // no-ack: nothing in flight.
    assert!(got.iter().all(|d| d.settled));
    let q = b.queue_id(V, "q").expect("q");
    assert_eq!(
        b.queue_info(q).map(|i| (i.message_count, i.in_flight)),
        Some((0, 0))
    );
}

#[test]
fn basic_get() {
    let mut b = broker();
    let q = declare(&mut b, "q");
    publish(&mut b, "", "q", msg("a"));
    publish(&mut b, "", "q", msg("b"));
    let (d, left) = b.get(V, "q", false, C1).expect("ok").expect("message");
    assert_eq!(
        (
            d.receipt.msg_id,
            d.redelivered,
            d.settled,
            left,
            d.queue_name.as_str()
        ),
        (0, false, false, 1, "q")
    );
    assert_eq!(d.consumer, None);
    assert_eq!(d.message.body, Bytes::from_static(b"a"));
    assert_eq!(b.machine(q).and_then(|m| m.holder(d.receipt)), Some(None));
    assert!(b.requeue(q, d.receipt));
    let first = d.receipt;
    let (d, left) = b.get(V, "q", true, C1).expect("ok").expect("message");
    assert_eq!(
        (
            d.receipt.msg_id,
            d.redelivered,
            d.receipt.attempt,
            d.settled,
            left
        ),
        (0, true, 2, true, 1)
    );
    assert!(!b.settle(q, first), "no longer in flight");
    let (d, left) = b.get(V, "q", true, C1).expect("ok").expect("message");
    assert_eq!((d.receipt.msg_id, left), (1, 0));
    assert!(b.get(V, "q", true, C1).expect("ok").is_none());
    assert_eq!(b.queue_info(q).map(|i| i.in_flight), Some(0));
}

#[test]
fn limits() {
    let mut b = Broker::new(BrokerConfig {
        max_queues: Some(1),
        max_message_size: 3,
        ..BrokerConfig::default()
    });
    declare(&mut b, "q");
    assert_eq!(
        b.declare_queue(V, req("q2"), C1),
        Err(err(
            ReplyCode::PreconditionFailed,
            "cannot declare queue 'q2': queue limit in vhost '/' (1) is reached"
        ))
    );
    assert_eq!(
        b.publish(V, "", "q", msg("long"), 0),
        Err(err(
            ReplyCode::PreconditionFailed,
            "message size 4 is larger than configured max size 3"
        ))
    );
    assert_eq!(
        b.declare_queue("nope", req("x"), C1),
        Err(err(ReplyCode::NotAllowed, "vhost nope not found"))
    );
    let _: ShortStr = ShortStr::from("unused");
}

/// A small message that will wait in a queue is copied out of the buffer it arrived in (so it
/// does not keep a connection's read buffer alive); one that a waiting consumer takes at once
/// is not (no allocation on the worker's path). A fan-out copies it once if any queue keeps it.
#[test]
fn a_message_is_copied_only_when_it_waits_in_a_queue() {
    let mut b = broker();
    declare(&mut b, "waits");
    declare(&mut b, "taken");
    consume(&mut b, "taken", C1, 1, "t", false, false).expect("consume");
    b.bind_queue(V, "waits", "amq.fanout", "", &FieldTable::new(), C1)
        .expect("bind");
    b.bind_queue(V, "taken", "amq.fanout", "", &FieldTable::new(), C1)
        .expect("bind");
    let buffer = Bytes::from(vec![7u8; 4096]);
    let within = |part: &Bytes| {
        let (p, w) = (part.as_ptr() as usize, buffer.as_ptr() as usize);
        p >= w && p < w + buffer.len()
    };
    let from_buffer = |rk: &'static str| Message {
        routing_key: rk.into(),
        body: buffer.slice(100..200),
        ..msg("")
    };
    publish(&mut b, "", "taken", from_buffer("taken"));
    let d = dispatch(&mut b);
    assert_eq!(d.len(), 1);
    assert!(within(&d[0].message.body), "taken at once: not copied");
    // Given back, it may wait: copied then.
    assert!(b.requeue(d[0].queue, d[0].receipt));
    let (back, _) = b.get(V, "taken", true, C1).expect("ok").expect("a message");
    assert!(!within(&back.message.body), "returned: copied");
    assert_eq!(back.message.body, buffer.slice(100..200));

    publish(&mut b, "", "waits", from_buffer("waits"));
    let (got, _) = b.get(V, "waits", true, C1).expect("ok").expect("a message");
    assert!(!within(&got.message.body), "it waited: copied");
    assert_eq!(got.message.body, buffer.slice(100..200));

    // Two publishes of one read, before the dispatch: the consumer has room for both.
    publish(&mut b, "", "taken", from_buffer("taken"));
    publish(&mut b, "", "taken", from_buffer("taken"));
    let d = dispatch(&mut b);
    assert_eq!(d.len(), 2);
    assert!(within(&d[0].message.body) && within(&d[1].message.body));
    // Behind more than the consumers have room for, the next one waits: a consumer with a
    // prefetch of 1 on a queue of its own.
    declare(&mut b, "one");
    b.consume(
        V,
        "one",
        group(C1, 2),
        "p1".into(),
        false,
        false,
        1,
        &FieldTable::new(),
    )
    .expect("consume");
    publish(&mut b, "", "one", from_buffer("one"));
    publish(&mut b, "", "one", from_buffer("one"));
    let d = dispatch(&mut b);
    assert_eq!(d.len(), 1);
    assert!(within(&d[0].message.body));
    let (waited, _) = b.get(V, "one", true, C1).expect("ok").expect("a message");
    assert!(!within(&waited.message.body), "it waited: copied");

    // Fanned out to a queue that keeps it and to one whose consumer takes it: one copy for both.
    publish(&mut b, "amq.fanout", "", from_buffer(""));
    let d = dispatch(&mut b);
    let (kept, _) = b.get(V, "waits", true, C1).expect("ok").expect("a message");
    assert!(!within(&kept.message.body) && !within(&d[0].message.body));
    assert_eq!(kept.message.body.as_ptr(), d[0].message.body.as_ptr());
}
