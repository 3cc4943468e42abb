//! Policies reach queues and exchanges: declared before or after the policy, changed and
//! cleared without a redeclare.

use bytes::Bytes;
use warren_broker::policy::{ApplyTo, Definition, PolicyDef, PolicyKind, PolicyValue};
use warren_broker::{Broker, BrokerConfig, DeclareQueue, Message, QueueId};
use warren_codec::{FieldTable, FieldValue};

const V: &str = "/";

fn declare(b: &mut Broker, name: &'static str, args: FieldTable) -> QueueId {
    let req = DeclareQueue {
        name: name.into(),
        passive: false,
        durable: false,
        exclusive: false,
        auto_delete: false,
        arguments: args,
    };
    b.declare_queue(V, req, 1).expect("declare").queue
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

fn ready(b: &Broker, q: QueueId) -> u32 {
    b.queue_info(q).expect("queue").message_count
}

fn policy(name: &str, kind: PolicyKind, pattern: &str, pairs: &[(&str, PolicyValue)]) -> PolicyDef {
    PolicyDef {
        vhost: V.into(),
        name: name.into(),
        kind,
        pattern: pattern.into(),
        apply_to: ApplyTo::Queues,
        priority: 0,
        definition: pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.clone()))
            .collect::<Definition>(),
    }
}

/// A fanout exchange `dlx` with queue `dead` bound to it.
fn dead_letter_target(b: &mut Broker) -> QueueId {
    b.declare_exchange(
        V,
        "dlx",
        "fanout",
        false,
        false,
        false,
        false,
        &FieldTable::new(),
    )
    .expect("dlx");
    let dead = declare(b, "dead", FieldTable::new());
    b.bind_queue(V, "dead", "dlx", "", &FieldTable::new(), 1)
        .expect("bind");
    dead
}

#[test]
fn a_policy_set_after_the_queue_limits_and_dead_letters_it_and_clearing_it_restores_it() {
    let mut b = Broker::new(BrokerConfig::default());
    let dead = dead_letter_target(&mut b);
    let work = declare(&mut b, "work", FieldTable::new());
    for body in ["a", "b", "c", "d", "e"] {
        b.publish(V, "", "work", msg(body), 0).expect("publish");
    }
    assert_eq!(ready(&b, work), 5);
    let p = policy(
        "limit",
        PolicyKind::User,
        "^work$",
        &[
            ("max-length", PolicyValue::Int(2)),
            ("dead-letter-exchange", PolicyValue::Str("dlx".into())),
        ],
    );
    b.set_policy(p).expect("set");
    // The lower limit drops the head at once, to the policy's dead-letter exchange.
    assert_eq!(ready(&b, work), 2);
    assert_eq!(ready(&b, dead), 3);
    let snap = b.queue_policy_definition(work);
    assert_eq!(snap.get("max-length"), Some(&PolicyValue::Int(2)));
    b.publish(V, "", "work", msg("f"), 0).expect("publish");
    assert_eq!((ready(&b, work), ready(&b, dead)), (2, 4));

    assert!(b.clear_policy(V, PolicyKind::User, "limit"));
    for body in ["g", "h", "i"] {
        b.publish(V, "", "work", msg(body), 0).expect("publish");
    }
    assert_eq!((ready(&b, work), ready(&b, dead)), (5, 4));
    assert!(b.queue_policy_definition(work).is_empty());
    assert!(!b.clear_policy(V, PolicyKind::User, "limit"));
}

#[test]
fn a_queue_declared_after_the_policy_takes_its_ttl() {
    let mut b = Broker::new(BrokerConfig::default());
    let dead = dead_letter_target(&mut b);
    let p = policy(
        "ttl",
        PolicyKind::User,
        "^jobs",
        &[
            ("message-ttl", PolicyValue::Int(100)),
            ("dead-letter-exchange", PolicyValue::Str("dlx".into())),
        ],
    );
    b.set_policy(p).expect("set");
    let jobs = declare(&mut b, "jobs", FieldTable::new());
    let other = declare(&mut b, "other", FieldTable::new());
    b.publish(V, "", "jobs", msg("a"), 0).expect("publish");
    b.publish(V, "", "other", msg("b"), 0).expect("publish");
    b.tick(200);
    assert_eq!(
        (ready(&b, jobs), ready(&b, other), ready(&b, dead)),
        (0, 1, 1)
    );
}

#[test]
fn a_lower_ttl_from_a_policy_expires_what_is_queued_already() {
    let mut b = Broker::new(BrokerConfig::default());
    let dead = dead_letter_target(&mut b);
    let mut args = FieldTable::new();
    args.insert("x-message-ttl", FieldValue::I32(60_000));
    let q = declare(&mut b, "backlog", args);
    // Two old messages, one newer.
    for body in ["old-1", "old-2"] {
        b.publish(V, "", "backlog", msg(body), 1_000)
            .expect("publish");
    }
    b.publish(V, "", "backlog", msg("new"), 9_000)
        .expect("publish");
    b.tick(10_000);
    assert_eq!(ready(&b, q), 3);
    let p = policy(
        "shorter",
        PolicyKind::User,
        "^backlog$",
        &[
            ("message-ttl", PolicyValue::Int(5_000)),
            ("dead-letter-exchange", PolicyValue::Str("dlx".into())),
        ],
    );
    b.set_policy(p).expect("set");
    // The old ones were due at 6000: gone at once, to the dead-letter exchange.
    assert_eq!((ready(&b, q), ready(&b, dead)), (1, 2));
    b.tick(13_000);
    assert_eq!(ready(&b, q), 1);
    b.tick(14_001);
    assert_eq!((ready(&b, q), ready(&b, dead)), (0, 3));
}

#[test]
fn an_operator_policy_caps_the_queue_argument_and_the_user_policy() {
    let mut b = Broker::new(BrokerConfig::default());
    let mut args = FieldTable::new();
    args.insert("x-max-length", FieldValue::I32(10));
    let q = declare(&mut b, "capped", args);
    let user = policy(
        "u",
        PolicyKind::User,
        ".*",
        &[("max-length", PolicyValue::Int(5))],
    );
    b.set_policy(user).expect("user");
    for _ in 0..8 {
        b.publish(V, "", "capped", msg("m"), 0).expect("publish");
    }
    // The lower of argument and user policy.
    assert_eq!(ready(&b, q), 5);
    let op = policy(
        "o",
        PolicyKind::Operator,
        ".*",
        &[("max-length", PolicyValue::Int(3))],
    );
    b.set_policy(op).expect("operator");
    assert_eq!(ready(&b, q), 3);
    // An operator policy cannot raise a limit.
    let op = policy(
        "o",
        PolicyKind::Operator,
        ".*",
        &[("max-length", PolicyValue::Int(50))],
    );
    b.set_policy(op).expect("operator");
    for _ in 0..8 {
        b.publish(V, "", "capped", msg("m"), 0).expect("publish");
    }
    assert_eq!(ready(&b, q), 5);
}

#[test]
fn a_policy_gives_an_exchange_its_alternate_exchange() {
    let mut b = Broker::new(BrokerConfig::default());
    let none = FieldTable::new();
    b.declare_exchange(V, "main", "direct", false, false, false, false, &none)
        .expect("main");
    b.declare_exchange(V, "ae", "fanout", false, false, false, false, &none)
        .expect("ae");
    let caught = declare(&mut b, "caught", FieldTable::new());
    b.bind_queue(V, "caught", "ae", "", &none, 1).expect("bind");
    assert_eq!(
        b.publish(V, "main", "nowhere", msg("a"), 0).unwrap().queues,
        0
    );
    let mut p = policy(
        "ae",
        PolicyKind::User,
        "^main$",
        &[("alternate-exchange", PolicyValue::Str("ae".into()))],
    );
    p.apply_to = ApplyTo::Exchanges;
    b.set_policy(p).expect("set");
    assert_eq!(
        b.publish(V, "main", "nowhere", msg("b"), 0).unwrap().queues,
        1
    );
    assert_eq!(ready(&b, caught), 1);
}

#[test]
fn a_policy_for_a_missing_vhost_or_an_invalid_one_is_refused() {
    let mut b = Broker::new(BrokerConfig::default());
    let mut p = policy(
        "p",
        PolicyKind::User,
        ".*",
        &[("max-length", PolicyValue::Int(1))],
    );
    p.vhost = "nope".into();
    assert!(b.set_policy(p).is_err());
    let bad = policy(
        "p",
        PolicyKind::User,
        ".*",
        &[("max-length", PolicyValue::Int(-1))],
    );
    assert!(b.set_policy(bad).is_err());
    assert!(b.policies().is_empty());
}
