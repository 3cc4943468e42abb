//! A queue's arguments changed in place (what SQS's SetQueueAttributes needs): the queue keeps
//! its messages and acts on the new arguments at once; what cannot change is refused.

use bytes::Bytes;
use warren_broker::policy::{ApplyTo, PolicyDef, PolicyKind, PolicyValue};
use warren_broker::{Broker, BrokerConfig, DeclareQueue, Message, QueueId};
use warren_codec::{FieldTable, FieldValue, ReplyCode};

const V: &str = "/";

fn declare(b: &mut Broker, name: &'static str, args: FieldTable, exclusive: bool) -> QueueId {
    let req = DeclareQueue {
        name: name.into(),
        passive: false,
        durable: false,
        exclusive,
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

fn table(pairs: &[(&'static str, FieldValue)]) -> FieldTable {
    let mut t = FieldTable::new();
    for (k, v) in pairs {
        t.insert(*k, v.clone());
    }
    t
}

#[test]
fn new_arguments_act_on_the_messages_already_queued() {
    let mut b = Broker::new(BrokerConfig::default());
    let dead = declare(&mut b, "dead", FieldTable::new(), false);
    let q = declare(
        &mut b,
        "work",
        table(&[("x-message-ttl", FieldValue::I64(60_000))]),
        false,
    );
    for body in ["a", "b", "c"] {
        b.publish(V, "", "work", msg(body), 1_000).expect("publish");
    }
    b.tick(10_000);
    assert_eq!(ready(&b, q), 3);
    let shorter = table(&[
        ("x-message-ttl", FieldValue::I64(5_000)),
        ("x-dead-letter-exchange", FieldValue::long_str("")),
        ("x-dead-letter-routing-key", FieldValue::long_str("dead")),
        ("x-max-length", FieldValue::I64(10)),
    ]);
    b.set_queue_arguments(V, "work", shorter.clone(), None)
        .expect("changed");
    // Due at 6,000 under the new TTL: dead-lettered at once, through the new arguments.
    assert_eq!((ready(&b, q), ready(&b, dead)), (0, 3));
    assert_eq!(
        b.queue_snapshot(V, "work").expect("queue").arguments,
        shorter
    );
    // The same arguments again change nothing; a declare must now name the new ones.
    b.set_queue_arguments(V, "work", shorter.clone(), None)
        .expect("same");
    let again = DeclareQueue {
        name: "work".into(),
        passive: false,
        durable: false,
        exclusive: false,
        auto_delete: false,
        arguments: shorter,
    };
    assert_eq!(b.declare_queue(V, again, 1).expect("equivalent").queue, q);
}

#[test]
fn a_policy_still_caps_the_new_arguments_as_at_a_declare() {
    let mut b = Broker::new(BrokerConfig::default());
    let q = declare(&mut b, "capped", FieldTable::new(), false);
    b.set_policy(PolicyDef {
        vhost: V.into(),
        name: "cap".into(),
        kind: PolicyKind::Operator,
        pattern: "^capped$".into(),
        apply_to: ApplyTo::Queues,
        priority: 0,
        definition: [("max-length".to_owned(), PolicyValue::Int(2))]
            .into_iter()
            .collect(),
    })
    .expect("policy");
    b.set_queue_arguments(
        V,
        "capped",
        table(&[("x-max-length", FieldValue::I64(100))]),
        None,
    )
    .expect("changed");
    for body in ["a", "b", "c", "d"] {
        b.publish(V, "", "capped", msg(body), 0).expect("publish");
    }
    assert_eq!(ready(&b, q), 2, "the operator policy's lower limit wins");
}

#[test]
fn what_cannot_change_is_refused_and_leaves_the_queue_as_it_was() {
    let mut b = Broker::new(BrokerConfig::default());
    declare(&mut b, "plain", FieldTable::new(), false);
    let quorum = table(&[("x-queue-type", FieldValue::long_str("quorum"))]);
    let e = b
        .set_queue_arguments(V, "plain", quorum, None)
        .expect_err("type change");
    assert_eq!(e.code, ReplyCode::PreconditionFailed);
    let bad = table(&[("x-max-length", FieldValue::long_str("ten"))]);
    let e = b
        .set_queue_arguments(V, "plain", bad, None)
        .expect_err("invalid");
    assert_eq!(e.code, ReplyCode::PreconditionFailed);
    assert!(b
        .queue_snapshot(V, "plain")
        .expect("queue")
        .arguments
        .is_empty());
    let e = b
        .set_queue_arguments(V, "missing", FieldTable::new(), None)
        .expect_err("no queue");
    assert_eq!(e.code, ReplyCode::NotFound);
    declare(&mut b, "mine", FieldTable::new(), true);
    let e = b
        .set_queue_arguments(V, "mine", FieldTable::new(), None)
        .expect_err("exclusive");
    assert_eq!(e.code, ReplyCode::ResourceLocked);
}
