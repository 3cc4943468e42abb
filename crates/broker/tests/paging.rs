//! Paging through the broker, with an in-memory store standing in for RocksDB: deep queues
//! page out only what was written, read back ahead of consumers, and a store that cannot be
//! read makes a queue wait and try again (on its deadline), never spin or lose a message.

mod common;

use bytes::Bytes;
use common::MemStore;
use warren_broker::{
    Broker, BrokerConfig, CreditGroup, DeclareQueue, Delivery, Message, SPILL_BIT,
};
use warren_codec::{FieldTable, ShortStr};

fn setup() -> (Broker, MemStore) {
    let mut b = Broker::new(BrokerConfig {
        persistence: true,
        page_window: 8,
        page_window_idle: 2,
        ..BrokerConfig::default()
    });
    let store = MemStore::default();
    b.set_pager(Box::new(store.clone()));
    b.declare_queue(
        "/",
        DeclareQueue {
            name: "deep".into(),
            passive: false,
            durable: true,
            exclusive: false,
            auto_delete: false,
            arguments: FieldTable::new(),
        },
        1,
    )
    .expect("declare");
    (b, store)
}

fn declare_transient(b: &mut Broker, name: &'static str) {
    let req = DeclareQueue {
        name: name.into(),
        passive: false,
        durable: false,
        exclusive: false,
        auto_delete: false,
        arguments: FieldTable::new(),
    };
    b.declare_queue("/", req, 1).expect("declare");
}

fn publish(b: &mut Broker, i: u32) {
    publish_to(b, "deep", i, true);
}

fn publish_to(b: &mut Broker, q: &'static str, i: u32, persistent: bool) {
    let m = Message {
        exchange: ShortStr::empty(),
        routing_key: ShortStr::from(q),
        properties: Bytes::from_static(&[0x10, 0x00, 2]),
        body: Bytes::from(format!("m{i}")),
        persistent,
        store_key: None,
        away: None,
    };
    b.publish("/", "", q, m, 0).expect("publish");
}

fn consume(b: &mut Broker) {
    consume_with(b, true);
}

fn consume_with(b: &mut Broker, no_ack: bool) {
    let group = CreditGroup {
        conn: 1,
        channel: 1,
    };
    let tag = ShortStr::from("c");
    b.consume(
        "/",
        "deep",
        group,
        tag,
        no_ack,
        false,
        0,
        &FieldTable::new(),
    )
    .expect("consume");
}

fn drain(b: &mut Broker) -> Vec<String> {
    let mut out: Vec<Delivery> = Vec::new();
    let mut rounds = 0;
    while b.dispatch_one(&mut out) {
        rounds += 1;
        assert!(rounds < 10_000, "the dispatcher spins");
    }
    out.iter()
        .map(|d| String::from_utf8_lossy(&d.message.body).into_owned())
        .collect()
}

fn paged(b: &Broker) -> u64 {
    let id = b.queue_id("/", "deep").expect("queue");
    b.machine(id).expect("machine").paged_count()
}

#[test]
fn only_written_messages_leave_memory_and_all_come_back_in_order() {
    let (mut b, store) = setup();
    for i in 0..40 {
        publish(&mut b, i);
    }
    assert_eq!(paged(&b), 0, "nothing is paged before its write is done");
    store.apply(&mut b);
    assert_eq!(paged(&b), 38, "all but the idle window of 2");
    for i in 40..50 {
        publish(&mut b, i);
    }
    assert_eq!(paged(&b), 38);
    consume(&mut b);
    let got = drain(&mut b);
    assert_eq!(got, (0..50).map(|i| format!("m{i}")).collect::<Vec<_>>());
}

#[test]
fn a_store_that_cannot_be_read_makes_the_queue_wait_and_try_again() {
    let (mut b, store) = setup();
    for i in 0..30 {
        publish(&mut b, i);
    }
    store.apply(&mut b);
    store.0.lock().unwrap().failing = true;
    b.advance_time(1_000);
    consume(&mut b);
    let first = drain(&mut b);
    assert_eq!(
        first,
        vec!["m0", "m1"],
        "the window in memory, then the read fails"
    );
    assert_eq!(
        store.0.lock().unwrap().reads,
        1,
        "one read, not a read per dispatch"
    );
    assert_eq!(b.next_deadline(), Some(2_000), "woken again in a second");
    // Nothing changes before the deadline.
    b.tick(1_500);
    assert!(drain(&mut b).is_empty());
    assert_eq!(store.0.lock().unwrap().reads, 1);
    store.0.lock().unwrap().failing = false;
    b.tick(2_000);
    let rest = drain(&mut b);
    assert_eq!(rest, (2..30).map(|i| format!("m{i}")).collect::<Vec<_>>());
}

#[test]
fn purging_a_paged_queue_drops_its_runs_from_the_store() {
    let (mut b, store) = setup();
    for i in 0..20 {
        publish(&mut b, i);
    }
    store.apply(&mut b);
    assert_eq!(b.purge_queue("/", "deep", 1).expect("purge"), 20);
    store.apply(&mut b);
    let mem = store.0.lock().unwrap();
    assert!(mem.entries.is_empty() && mem.bodies.is_empty());
}

#[test]
fn transient_messages_of_deep_queues_spill_page_and_leave_nothing_behind() {
    let (mut b, store) = setup();
    declare_transient(&mut b, "scratch");
    // Under memory pressure; without it transient messages stay in memory.
    for i in 0..10 {
        publish_to(&mut b, "scratch", i, false);
    }
    store.apply(&mut b);
    let scratch = b.queue_id("/", "scratch").expect("queue");
    assert_eq!(b.machine(scratch).expect("machine").paged_count(), 0);
    b.purge_queue("/", "scratch", 1).expect("purge");
    b.set_spill(true);
    // The durable queue gets both kinds; the other queue only transient messages.
    for i in 0..40 {
        publish_to(&mut b, "deep", i, i % 2 == 0);
        publish_to(&mut b, "scratch", i, false);
    }
    store.apply(&mut b);
    assert_eq!(
        paged(&b),
        38,
        "persistent and spilled alike, past the window"
    );
    assert_eq!(b.machine(scratch).expect("machine").paged_count(), 38);
    // Consume with acks: every acked message leaves the store.
    consume_with(&mut b, false);
    let mut out: Vec<Delivery> = Vec::new();
    while b.dispatch_one(&mut out) {}
    let bodies: Vec<String> = out
        .iter()
        .map(|d| String::from_utf8_lossy(&d.message.body).into_owned())
        .collect();
    assert_eq!(bodies, (0..40).map(|i| format!("m{i}")).collect::<Vec<_>>());
    assert_eq!(
        out.iter().filter(|d| d.message.persistent).count(),
        20,
        "a spilled message comes back transient"
    );
    for d in &out {
        assert!(b.settle(d.queue, d.receipt));
    }
    b.delete_queue("/", "scratch", false, false, 1)
        .expect("delete");
    store.apply(&mut b);
    let mem = store.0.lock().unwrap();
    assert!(mem.entries.is_empty(), "entries left: {:?}", mem.entries);
    assert!(
        mem.bodies.is_empty(),
        "bodies left: {:?}",
        mem.bodies.keys()
    );
}

#[test]
fn a_message_stored_durably_is_not_spilled_for_another_queue() {
    let (mut b, store) = setup();
    b.set_spill(true);
    declare_transient(&mut b, "scratch");
    for q in ["deep", "scratch"] {
        b.bind_queue("/", q, "amq.fanout", "", &FieldTable::new(), 1)
            .expect("bind");
    }
    // Both queues deep: the fanned-out persistent messages are stored once, for "deep" alone,
    // so they page out there; "scratch" keeps its copies in memory (a scratch reference to a
    // durable body would be lost at a restart and leave the body behind).
    for i in 0..30 {
        let m = Message {
            exchange: ShortStr::from("amq.fanout"),
            routing_key: ShortStr::empty(),
            properties: Bytes::from_static(&[0x10, 0x00, 2]),
            body: Bytes::from(format!("f{i}")),
            persistent: true,
            store_key: None,
            away: None,
        };
        b.publish("/", "amq.fanout", "", m, 0).expect("publish");
    }
    store.apply(&mut b);
    assert_eq!(paged(&b), 28);
    let scratch = b.queue_id("/", "scratch").expect("queue");
    assert_eq!(b.machine(scratch).expect("machine").paged_count(), 0);
    let mem = store.0.lock().unwrap();
    assert_eq!(mem.entries.len(), 30, "entries of \"deep\" only");
    assert!(mem.entries.keys().all(|(q, _)| q & SPILL_BIT == 0));
}

/// A deep queue with a TTL and no consumer: what expired on disk is read back on the queue's
/// deadline and dead-lettered (here to a second queue), page by page, without anyone asking.
#[test]
fn expired_pages_are_read_back_and_dead_lettered_without_a_consumer() {
    let (mut b, store) = setup();
    declare_transient(&mut b, "dead");
    let mut args = FieldTable::new();
    args.insert("x-message-ttl", warren_codec::FieldValue::I32(100));
    args.insert(
        "x-dead-letter-exchange",
        warren_codec::FieldValue::long_str(""),
    );
    args.insert(
        "x-dead-letter-routing-key",
        warren_codec::FieldValue::long_str("dead"),
    );
    let req = DeclareQueue {
        name: "delay".into(),
        passive: false,
        durable: true,
        exclusive: false,
        auto_delete: false,
        arguments: args,
    };
    b.declare_queue("/", req, 1).expect("declare");
    for i in 0..40 {
        publish_to(&mut b, "delay", i, true);
    }
    store.apply(&mut b);
    let delay = b.queue_id("/", "delay").unwrap();
    let paged = b.machine(delay).unwrap().paged_count();
    assert!(paged > 30, "the queue pages: {paged} on disk");
    let due = b.next_deadline().expect("a deadline for the head");
    assert!(due <= 101);
    b.tick(200);
    store.apply(&mut b);
    let dead = b.queue_id("/", "dead").unwrap();
    assert_eq!(b.queue_info(delay).unwrap().message_count, 0);
    assert_eq!(b.queue_info(dead).unwrap().message_count, 40);
    assert_eq!(b.next_deadline(), None, "nothing left to wake for");
}

#[test]
fn a_policy_that_lowers_the_ttl_expires_a_paged_backlog() {
    use warren_broker::policy::{ApplyTo, PolicyDef, PolicyKind, PolicyValue};
    let (mut b, store) = setup();
    declare_transient(&mut b, "dead");
    for i in 0..40 {
        publish(&mut b, i);
    }
    store.apply(&mut b);
    let deep = b.queue_id("/", "deep").unwrap();
    assert!(paged(&b) > 30, "the queue pages");
    b.tick(1_000);
    let definition = [
        ("message-ttl", PolicyValue::Int(100)),
        ("dead-letter-exchange", PolicyValue::Str(String::new())),
        ("dead-letter-routing-key", PolicyValue::Str("dead".into())),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    b.set_policy(PolicyDef {
        vhost: "/".into(),
        name: "shed".into(),
        kind: PolicyKind::User,
        pattern: "^deep$".into(),
        apply_to: ApplyTo::Queues,
        priority: 0,
        definition,
    })
    .expect("policy");
    // Published at 0 with no TTL: due at 100 under the policy, paged ones included.
    for _ in 0..10 {
        b.tick(1_001);
        store.apply(&mut b);
    }
    let dead = b.queue_id("/", "dead").unwrap();
    assert_eq!(b.queue_info(deep).unwrap().message_count, 0);
    assert_eq!(b.queue_info(dead).unwrap().message_count, 40);
}

#[test]
fn a_policy_that_sets_a_length_limit_trims_a_paged_backlog() {
    use warren_broker::policy::{ApplyTo, PolicyDef, PolicyKind, PolicyValue};
    let (mut b, store) = setup();
    for i in 0..40 {
        publish(&mut b, i);
    }
    store.apply(&mut b);
    assert!(paged(&b) > 30, "the queue pages");
    b.set_policy(PolicyDef {
        vhost: "/".into(),
        name: "short".into(),
        kind: PolicyKind::User,
        pattern: "^deep$".into(),
        apply_to: ApplyTo::Queues,
        priority: 0,
        definition: [("max-length".to_owned(), PolicyValue::Int(5))]
            .into_iter()
            .collect(),
    })
    .expect("policy");
    for _ in 0..20 {
        b.tick(1);
        drain(&mut b);
        store.apply(&mut b);
    }
    let deep = b.queue_id("/", "deep").unwrap();
    assert_eq!(b.queue_info(deep).unwrap().message_count, 5);
    consume(&mut b);
    let got = drain(&mut b);
    assert_eq!(got, ["m35", "m36", "m37", "m38", "m39"]);
}
