//! The node's default queue type (`--default-queue-type`, RabbitMQ's `default_queue_type`): a
//! declaration that names no `x-queue-type` gets it when its queue may have it.

use warren_broker::{Broker, BrokerConfig, DeclareQueue, QueueType};
use warren_codec::{FieldTable, FieldValue, ReplyCode};

const V: &str = "/";

fn broker(default: QueueType) -> Broker {
    Broker::new(BrokerConfig {
        default_queue_type: default,
        ..BrokerConfig::default()
    })
}

fn req(name: &'static str, durable: bool, exclusive: bool, auto_delete: bool) -> DeclareQueue {
    DeclareQueue {
        name: name.into(),
        passive: false,
        durable,
        exclusive,
        auto_delete,
        arguments: FieldTable::new(),
    }
}

fn typed(mut r: DeclareQueue, t: &str) -> DeclareQueue {
    r.arguments.insert("x-queue-type", FieldValue::long_str(t));
    r
}

/// The type a queue got, and its `x-queue-type` argument as kept.
fn type_of(b: &Broker, name: &str) -> (&'static str, Option<String>) {
    let s = b.queue_snapshot(V, name).expect("queue");
    let arg = match s.arguments.get("x-queue-type") {
        Some(FieldValue::LongStr(t)) => Some(String::from_utf8_lossy(t).into_owned()),
        _ => None,
    };
    (s.queue_type, arg)
}

#[test]
fn a_durable_queue_declared_without_a_type_takes_the_nodes_default() {
    let mut b = broker(QueueType::Quorum);
    b.declare_queue(V, req("jobs", true, false, false), 1)
        .expect("declare");
    assert_eq!(type_of(&b, "jobs"), ("quorum", Some("quorum".into())));
    // A type the declaration names is kept.
    b.declare_queue(V, typed(req("local", true, false, false), "classic"), 1)
        .expect("declare");
    assert_eq!(type_of(&b, "local").0, "classic");
    // Without a default, nothing is added.
    let mut plain = broker(QueueType::Classic);
    plain
        .declare_queue(V, req("jobs", true, false, false), 1)
        .expect("declare");
    assert_eq!(type_of(&plain, "jobs"), ("classic", None));
}

#[test]
fn a_queue_that_cannot_be_of_the_default_type_stays_classic() {
    let mut b = broker(QueueType::Quorum);
    for (name, durable, exclusive, auto_delete) in [
        ("transient", false, false, false),
        ("exclusive", true, true, false),
        ("auto-delete", true, false, true),
    ] {
        b.declare_queue(V, req(name, durable, exclusive, auto_delete), 1)
            .unwrap_or_else(|e| panic!("{name}: {e:?}"));
        assert_eq!(type_of(&b, name), ("classic", None), "{name}");
    }
    // A server-named queue, durable or not.
    let named = b
        .declare_queue(V, req("", true, false, false), 1)
        .expect("server-named");
    let name = b.queue_info(named.queue).expect("queue").name;
    assert_eq!(type_of(&b, name.as_str()), ("classic", None));
}

#[test]
fn a_redeclaration_without_a_type_matches_the_queue_whatever_its_type() {
    let mut b = broker(QueueType::Quorum);
    b.declare_queue(V, typed(req("local", true, false, false), "classic"), 1)
        .expect("declare");
    b.declare_queue(V, req("jobs", true, false, false), 1)
        .expect("declare");
    for name in ["local", "jobs"] {
        b.declare_queue(V, req(name, true, false, false), 1)
            .unwrap_or_else(|e| panic!("{name} again: {e:?}"));
    }
    assert_eq!(type_of(&b, "local").0, "classic");
    assert_eq!(type_of(&b, "jobs").0, "quorum");
    // A type named is still compared.
    let e = b
        .declare_queue(V, typed(req("jobs", true, false, false), "classic"), 1)
        .expect_err("another type");
    assert_eq!(e.code, ReplyCode::PreconditionFailed);
    // Without a default, a quorum queue redeclared without its type is refused, as RabbitMQ
    // refuses it.
    let mut plain = broker(QueueType::Classic);
    plain
        .declare_queue(V, typed(req("jobs", true, false, false), "quorum"), 1)
        .expect("declare");
    let e = plain
        .declare_queue(V, req("jobs", true, false, false), 1)
        .expect_err("no type");
    assert_eq!(e.code, ReplyCode::PreconditionFailed);
    assert!(
        e.text.contains("inequivalent arg 'x-queue-type'"),
        "{}",
        e.text
    );
}

#[test]
fn a_vhosts_default_comes_before_the_nodes_and_can_be_taken_away() {
    use warren_broker::VhostMetaChange;
    let default = |t: Option<QueueType>| VhostMetaChange {
        default_queue_type: Some(t),
        ..Default::default()
    };
    // A node whose default is classic, a vhost whose default is quorum.
    let mut b = broker(QueueType::Classic);
    assert_eq!(
        b.put_vhost("billing", &default(Some(QueueType::Quorum))),
        Ok(true)
    );
    let in_billing = |b: &Broker, name: &str| b.queue_snapshot("billing", name).unwrap().queue_type;
    b.declare_queue("billing", req("invoices", true, false, false), 1)
        .expect("declare");
    assert_eq!(in_billing(&b, "invoices"), "quorum");
    // The other vhosts keep the node's.
    b.declare_queue(V, req("jobs", true, false, false), 1)
        .expect("declare");
    assert_eq!(type_of(&b, "jobs"), ("classic", None));
    // A vhost's classic wins over a node's quorum.
    let mut q = broker(QueueType::Quorum);
    q.put_vhost("local", &default(Some(QueueType::Classic)))
        .expect("put");
    q.declare_queue("local", req("cache", true, false, false), 1)
        .expect("declare");
    assert_eq!(
        q.queue_snapshot("local", "cache").unwrap().queue_type,
        "classic"
    );
    // Taken away, the node's applies again; the change leaves the rest of the metadata.
    let described = VhostMetaChange {
        description: Some("invoices".into()),
        ..Default::default()
    };
    assert_eq!(b.put_vhost("billing", &described), Ok(false));
    assert_eq!(b.put_vhost("billing", &default(None)), Ok(false));
    let meta = b.vhost_meta("billing").unwrap();
    assert_eq!(
        (meta.description.as_str(), meta.default_queue_type),
        ("invoices", None)
    );
    b.declare_queue("billing", req("receipts", true, false, false), 1)
        .expect("declare");
    assert_eq!(in_billing(&b, "receipts"), "classic");
    // A queue made while the vhost's default was quorum is still its workers' queue once
    // the default is classic again: their declarations name no type.
    assert_eq!(
        b.put_vhost("billing", &default(Some(QueueType::Classic))),
        Ok(false)
    );
    b.declare_queue("billing", req("invoices", true, false, false), 1)
        .expect("redeclared without a type after the switch back to classic");
    assert_eq!(in_billing(&b, "invoices"), "quorum");
    // The vhost Warren makes at its first start says what it is, as RabbitMQ's does.
    assert_eq!(b.vhost_meta(V).unwrap().description, "Default virtual host");
}
