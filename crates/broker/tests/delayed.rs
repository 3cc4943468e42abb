//! Delayed messages through the broker, on simulated time: the `x-delayed-message` exchange
//! and queues' `x-delivery-delay` hold messages back until due (never early), keep only a
//! window of them in memory with a store, and bring them back after a restart.

mod common;

use bytes::Bytes;
use common::MemStore;
use warren_broker::delayed::MAX_LOADED;
use warren_broker::{Broker, BrokerConfig, DeclareQueue, Message, StoreOp};
use warren_codec::properties::BasicProperties;
use warren_codec::{FieldTable, FieldValue, ReplyCode, ShortStr};

fn props(delay: Option<i64>) -> Bytes {
    let mut headers = FieldTable::new();
    if let Some(d) = delay {
        headers.insert("x-delay", FieldValue::I64(d));
    }
    BasicProperties {
        headers: Some(headers),
        delivery_mode: Some(2),
        ..BasicProperties::default()
    }
    .encode()
}

fn message(exchange: &str, body: String, delay: Option<i64>) -> Message {
    Message {
        exchange: ShortStr::from_string(exchange.to_owned()),
        routing_key: "k".into(),
        properties: props(delay),
        body: Bytes::from(body),
        persistent: true,
        store_key: None,
        away: None,
    }
}

fn queue(b: &mut Broker, name: &'static str, arguments: FieldTable) {
    let req = DeclareQueue {
        name: name.into(),
        passive: false,
        durable: true,
        exclusive: false,
        auto_delete: false,
        arguments,
    };
    b.declare_queue("/", req, 1).expect("declare queue");
}

fn delayed_exchange(b: &mut Broker, inner: &str) -> Result<(), warren_codec::AmqpError> {
    let mut args = FieldTable::new();
    args.insert("x-delayed-type", FieldValue::long_str(inner));
    b.declare_exchange(
        "/",
        "delayed",
        "x-delayed-message",
        false,
        true,
        false,
        false,
        &args,
    )
}

/// A broker with a delayed direct exchange bound to queue "q" with key "k".
fn setup(persistence: bool) -> Broker {
    let mut b = Broker::new(BrokerConfig {
        persistence,
        ..BrokerConfig::default()
    });
    delayed_exchange(&mut b, "direct").expect("declare exchange");
    queue(&mut b, "q", FieldTable::new());
    b.bind_queue("/", "q", "delayed", "k", &FieldTable::new(), 1)
        .expect("bind");
    b
}

fn drain(b: &mut Broker, q: &str) -> Vec<String> {
    let mut out = Vec::new();
    while let Some((d, _)) = b.get("/", q, true, 1).expect("get") {
        out.push(String::from_utf8_lossy(&d.message.body).into_owned());
    }
    out
}

#[test]
fn a_delayed_message_is_routed_when_due_and_never_before() {
    let mut b = setup(false);
    let r = b
        .publish(
            "/",
            "delayed",
            "k",
            message("delayed", "later".into(), Some(1000)),
            5_000,
        )
        .expect("publish");
    assert_eq!(r.queues, 1, "held back counts as routed (no basic.return)");
    b.publish(
        "/",
        "delayed",
        "k",
        message("delayed", "now".into(), None),
        5_000,
    )
    .expect("publish");
    b.publish(
        "/",
        "delayed",
        "k",
        message("delayed", "neg".into(), Some(-5)),
        5_000,
    )
    .expect("publish");
    assert_eq!(drain(&mut b, "q"), vec!["now", "neg"]);
    assert_eq!(b.next_deadline(), Some(6_000));
    b.tick(5_999);
    assert!(drain(&mut b, "q").is_empty(), "one millisecond early");
    b.tick(6_000);
    assert_eq!(drain(&mut b, "q"), vec!["later"]);
    assert_eq!(b.next_deadline(), None);
}

#[test]
fn routing_happens_when_due_with_the_bindings_of_then() {
    let mut b = setup(false);
    b.publish(
        "/",
        "delayed",
        "other",
        message("delayed", "m".into(), Some(10)),
        0,
    )
    .expect("publish");
    queue(&mut b, "late", FieldTable::new());
    b.bind_queue("/", "late", "delayed", "other", &FieldTable::new(), 1)
        .expect("bind");
    b.tick(10);
    assert_eq!(drain(&mut b, "late"), vec!["m"]);
}

#[test]
fn declaring_the_exchange_needs_a_known_delayed_type() {
    let mut b = Broker::new(BrokerConfig::default());
    let e = b
        .declare_exchange(
            "/",
            "d",
            "x-delayed-message",
            false,
            true,
            false,
            false,
            &FieldTable::new(),
        )
        .expect_err("no x-delayed-type");
    assert_eq!(e.code, ReplyCode::PreconditionFailed);
    assert_eq!(
        e.text,
        "Invalid argument, 'x-delayed-type' must be an existing exchange type"
    );
    let e = delayed_exchange(&mut b, "x-delayed-message").expect_err("itself");
    assert_eq!(e.code, ReplyCode::PreconditionFailed);
    let e = delayed_exchange(&mut b, "nope").expect_err("unknown");
    assert_eq!(e.code, ReplyCode::CommandInvalid);
    assert_eq!(e.text, "unknown exchange type 'nope'");
    delayed_exchange(&mut b, "topic").expect("declare");
    delayed_exchange(&mut b, "topic").expect("same again");
    let e = b
        .declare_exchange(
            "/",
            "delayed",
            "topic",
            false,
            true,
            false,
            false,
            &FieldTable::new(),
        )
        .expect_err("a plain topic exchange is another type");
    assert_eq!(
        e.text,
        "inequivalent arg 'type' for exchange 'delayed' in vhost '/': received 'topic' but current is 'x-delayed-message'"
    );
}

#[test]
fn a_queue_delivery_delay_holds_every_message_and_x_delay_overrides_it() {
    let mut b = Broker::new(BrokerConfig::default());
    let mut args = FieldTable::new();
    args.insert("x-delivery-delay", FieldValue::I32(500));
    queue(&mut b, "slow", args);
    queue(&mut b, "plain", FieldTable::new());
    for q in ["slow", "plain"] {
        b.bind_queue("/", q, "amq.fanout", "", &FieldTable::new(), 1)
            .expect("bind");
    }
    let r = b
        .publish(
            "/",
            "amq.fanout",
            "",
            message("amq.fanout", "a".into(), None),
            0,
        )
        .expect("publish");
    assert_eq!(r.queues, 2);
    b.publish(
        "/",
        "amq.fanout",
        "",
        message("amq.fanout", "b".into(), Some(100)),
        0,
    )
    .expect("publish");
    assert_eq!(
        drain(&mut b, "plain"),
        vec!["a", "b"],
        "other queues get theirs at once"
    );
    assert!(drain(&mut b, "slow").is_empty());
    b.tick(100);
    assert_eq!(drain(&mut b, "slow"), vec!["b"]);
    b.tick(499);
    assert!(drain(&mut b, "slow").is_empty());
    b.tick(500);
    assert_eq!(drain(&mut b, "slow"), vec!["a"]);
    // The delivered message went to the queue only, not around the fanout again.
    assert!(drain(&mut b, "plain").is_empty());
}

#[test]
fn with_a_store_only_a_window_is_in_memory_and_everything_comes_out_in_due_order() {
    let mut b = setup(true);
    let store = MemStore::default();
    b.set_pager(Box::new(store.clone()));
    let n = 3 * MAX_LOADED as u64 + 17;
    // Due times spread and interleaved, publish order unrelated to due order.
    for i in 0..n {
        let delay = 1 + (i * 7919) % 10_000;
        let m = message("delayed", format!("{delay:05}-{i}"), Some(delay as i64));
        let r = b.publish("/", "delayed", "k", m, 0).expect("publish");
        assert!(
            r.batch.is_some(),
            "a persistent delayed message is confirmed once written"
        );
        if i % 1000 == 0 {
            store.apply(&mut b);
        }
    }
    store.apply(&mut b);
    let (count, loaded) = b.delayed_counts();
    assert_eq!(count, n);
    assert!(loaded <= MAX_LOADED, "{loaded} in memory");
    assert_eq!(store.0.lock().unwrap().delayed.len() as u64, n);

    let mut got = Vec::new();
    let mut now = 0;
    while let Some(at) = b.next_deadline() {
        assert!(at >= now || at == 0, "deadline went back: {at} < {now}");
        now = now.max(at);
        b.tick(now);
        store.apply(&mut b);
        for body in drain(&mut b, "q") {
            let due: u64 = body[..5].parse().unwrap();
            assert!(due <= now, "{body} released early at {now}");
            got.push(body);
        }
        assert!(b.delayed_counts().1 <= MAX_LOADED);
    }
    assert_eq!(got.len() as u64, n, "every message released once");
    let mut sorted = got.clone();
    sorted.sort_by_key(|s| s[..5].to_owned());
    let dues = |v: &[String]| v.iter().map(|s| s[..5].to_owned()).collect::<Vec<_>>();
    assert_eq!(dues(&got), dues(&sorted), "released in due order");
    assert!(
        store.0.lock().unwrap().delayed.is_empty(),
        "nothing left on disk"
    );
}

#[test]
fn a_read_waits_for_the_write_it_needs() {
    let mut b = setup(true);
    let store = MemStore::default();
    b.set_pager(Box::new(store.clone()));
    for i in 0..(MAX_LOADED as u64 + 100) {
        let m = message("delayed", format!("{i}"), Some(10 + i as i64));
        b.publish("/", "delayed", "k", m, 0).expect("publish");
    }
    // Nothing written yet: the messages past the window exist only in the write buffer.
    let mut released = 0;
    let mut ticks = 0;
    while let Some(at) = b.next_deadline().filter(|at| *at <= 100_000) {
        b.tick(at.max(100_000 - 1));
        released += drain(&mut b, "q").len();
        ticks += 1;
        assert!(ticks < 10, "spinning");
    }
    assert_eq!(released, MAX_LOADED, "the window only");
    let deadline = b.next_deadline().expect("a read to retry");
    assert!(deadline >= 100_000, "no spin while the write is pending");
    store.apply(&mut b);
    b.tick(deadline);
    assert_eq!(drain(&mut b, "q").len(), 100);
}

#[test]
fn scheduled_messages_come_back_after_a_restart_and_late_ones_are_released_at_once() {
    let mut b = setup(true);
    let store = MemStore::default();
    b.set_pager(Box::new(store.clone()));
    for (i, delay) in [5_000i64, 50, 60_000].into_iter().enumerate() {
        let m = message("delayed", format!("m{i}"), Some(delay));
        b.publish("/", "delayed", "k", m, 1_000).expect("publish");
    }
    store.apply(&mut b);
    drop(b);
    // Down until 10 s: two of them fell due meanwhile.
    let mut b = setup(true);
    b.set_pager(Box::new(store.clone()));
    b.restore_delayed();
    assert_eq!(b.next_deadline(), Some(0), "read back at once");
    b.tick(10_000);
    store.apply(&mut b);
    assert_eq!(drain(&mut b, "q"), vec!["m1", "m0"]);
    assert_eq!(b.next_deadline(), Some(61_000));
    b.tick(61_000);
    store.apply(&mut b);
    assert_eq!(drain(&mut b, "q"), vec!["m2"]);
    assert!(store.0.lock().unwrap().delayed.is_empty());
}

#[test]
fn a_released_message_leaves_the_store_in_the_batch_that_enqueues_it() {
    let mut b = setup(true);
    let store = MemStore::default();
    b.set_pager(Box::new(store.clone()));
    b.publish(
        "/",
        "delayed",
        "k",
        message("delayed", "m".into(), Some(10)),
        0,
    )
    .expect("publish");
    store.apply(&mut b);
    b.tick(10);
    let w = b.take_writes().expect("a batch");
    let deleted = w
        .ops
        .iter()
        .position(|op| matches!(op, StoreOp::DeleteDelayed { .. }));
    let entry = w
        .ops
        .iter()
        .position(|op| matches!(op, StoreOp::PutEntry { .. }));
    assert!(deleted.is_some() && entry.is_some(), "{:?}", w.ops);
    assert!(w.sync, "the enqueue of a persistent message is synced");
}

/// A queue declared with these arguments, durable or not; `conn` owns it if `exclusive`.
fn queue_as(b: &mut Broker, name: &'static str, durable: bool, how: Gone, arguments: FieldTable) {
    let req = DeclareQueue {
        name: name.into(),
        passive: false,
        durable,
        exclusive: how == Gone::OwnerClosed,
        auto_delete: how == Gone::AutoDelete,
        arguments,
    };
    b.declare_queue("/", req, 7).expect("declare queue");
}

fn delaying(ms: i32) -> FieldTable {
    let mut args = FieldTable::new();
    args.insert("x-delivery-delay", FieldValue::I32(ms));
    args
}

/// Ticks at `now` until nothing more is due by then, the store keeping up.
fn run_until(b: &mut Broker, store: &MemStore, now: u64) {
    for _ in 0..100 {
        b.tick(now);
        store.apply(b);
        if b.next_deadline().is_none_or(|at| at > now) {
            return;
        }
    }
    panic!("still due at {now} after 100 ticks");
}

/// The ways a queue goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Gone {
    Deleted,
    Expired,
    AutoDelete,
    OwnerClosed,
}

fn to_queue(q: &str, body: &str) -> Message {
    Message {
        routing_key: ShortStr::from_string(q.to_owned()),
        ..message("", body.into(), None)
    }
}

/// Held messages belong to the queue that held them: however it goes, they go with it, and
/// a queue declared again under the name (non-durable, other arguments) starts empty. A purge
/// leaves them: they are not in the queue yet (not counted, as the plugin's exchange holds its
/// messages outside the queues).
#[test]
fn a_queue_that_goes_takes_its_delayed_copies_with_it() {
    for how in [
        Gone::Deleted,
        Gone::Expired,
        Gone::AutoDelete,
        Gone::OwnerClosed,
    ] {
        let mut b = Broker::new(BrokerConfig {
            persistence: true,
            ..BrokerConfig::default()
        });
        let store = MemStore::default();
        b.set_pager(Box::new(store.clone()));
        let mut args = delaying(1_000);
        if how == Gone::Expired {
            args.insert("x-expires", FieldValue::I32(500));
        }
        queue_as(&mut b, "later", how != Gone::OwnerClosed, how, args);
        b.publish("/", "", "later", to_queue("later", "held"), 0)
            .expect("publish");
        b.publish("/", "", "later", to_queue("later", "also held"), 0)
            .expect("publish");
        assert_eq!(b.purge_queue("/", "later", 7).expect("purge"), 0);
        store.apply(&mut b);
        assert_eq!(store.0.lock().unwrap().delayed.len(), 2, "{how:?}");
        match how {
            Gone::Deleted => {
                b.delete_queue("/", "later", false, false, 7)
                    .expect("delete");
            }
            Gone::Expired => b.tick(500),
            Gone::AutoDelete => {
                let (q, c) = b
                    .consume(
                        "/",
                        "later",
                        warren_broker::CreditGroup {
                            conn: 7,
                            channel: 1,
                        },
                        "c".into(),
                        true,
                        false,
                        0,
                        &FieldTable::new(),
                    )
                    .expect("consume");
                assert!(b.cancel(q, c));
            }
            Gone::OwnerClosed => {
                b.connection_closed(7);
            }
        }
        assert!(b.queue_id("/", "later").is_none(), "{how:?}: gone");
        store.apply(&mut b);
        assert!(
            store.0.lock().unwrap().delayed.is_empty(),
            "{how:?}: its copies leave the disk with it"
        );
        let mut other = FieldTable::new();
        other.insert("x-max-length", FieldValue::I32(10));
        queue_as(&mut b, "later", false, Gone::Deleted, other);
        b.tick(1_000);
        b.tick(5_000);
        assert!(
            drain(&mut b, "later").is_empty(),
            "{how:?}: the new queue got the old one's delayed copy"
        );
        assert_eq!(b.delayed_counts(), (0, 0), "{how:?}");
    }
}

/// Past the memory window a held copy is on disk only: it is dropped when the scheduler
/// reads it back and finds its queue gone, even under a queue of the same name and
/// arguments declared since; after a restart too, where a durable queue's new incarnation
/// has a new store key.
#[test]
fn a_held_copy_on_disk_only_does_not_reach_the_next_queue_of_its_name() {
    let mut b = Broker::new(BrokerConfig {
        persistence: true,
        ..BrokerConfig::default()
    });
    let store = MemStore::default();
    b.set_pager(Box::new(store.clone()));
    queue(&mut b, "filler", delaying(100));
    for i in 0..MAX_LOADED {
        b.publish("/", "", "filler", to_queue("filler", &format!("f{i}")), 0)
            .expect("publish");
    }
    queue(&mut b, "later", delaying(1_000));
    b.publish("/", "", "later", to_queue("later", "old"), 0)
        .expect("publish");
    b.publish(
        "/",
        "",
        "later",
        to_queue("later", "old, after a restart"),
        500,
    )
    .expect("publish");
    store.apply(&mut b);
    assert_eq!(
        b.delayed_counts().1,
        MAX_LOADED,
        "later's copies on disk only"
    );
    b.delete_queue("/", "later", false, false, 1)
        .expect("delete");
    queue(&mut b, "later", delaying(1_000));
    run_until(&mut b, &store, 100);
    assert_eq!(drain(&mut b, "filler").len(), MAX_LOADED);
    run_until(&mut b, &store, 1_000);
    assert!(drain(&mut b, "later").is_empty(), "the old queue's copy");
    assert_eq!(store.0.lock().unwrap().delayed.len(), 1);
    // A restart: the durable queue comes back with its store key; its new declaration after
    // a delete has another.
    drop(b);
    let mut b = Broker::new(BrokerConfig {
        persistence: true,
        ..BrokerConfig::default()
    });
    b.set_store_keys(
        warren_broker::StoreKeys {
            next_queue_key: 1_000,
            next_body_key: 1 << 30,
        },
        [],
    );
    b.set_pager(Box::new(store.clone()));
    b.restore_delayed();
    queue(&mut b, "later", delaying(1_000));
    run_until(&mut b, &store, 2_000);
    assert!(drain(&mut b, "later").is_empty(), "back after a restart");
    assert!(store.0.lock().unwrap().delayed.is_empty());
}

/// The delayed exchange holds what it delays: deleted and declared again, it starts empty.
#[test]
fn a_deleted_delayed_exchange_takes_its_messages_with_it() {
    for persistence in [false, true] {
        let mut b = setup(persistence);
        let store = MemStore::default();
        b.set_pager(Box::new(store.clone()));
        b.publish(
            "/",
            "delayed",
            "k",
            message("delayed", "old".into(), Some(100)),
            0,
        )
        .expect("publish");
        store.apply(&mut b);
        b.delete_exchange("/", "delayed", false).expect("delete");
        store.apply(&mut b);
        assert!(store.0.lock().unwrap().delayed.is_empty());
        delayed_exchange(&mut b, "direct").expect("declare again");
        b.bind_queue("/", "q", "delayed", "k", &FieldTable::new(), 1)
            .expect("bind");
        b.tick(100);
        assert!(drain(&mut b, "q").is_empty(), "persistence {persistence}");
        assert_eq!(b.delayed_counts(), (0, 0));
    }
}

fn full_when_one(extra: &[(&'static str, FieldValue)]) -> FieldTable {
    let mut args = FieldTable::new();
    args.insert("x-max-length", FieldValue::I32(1));
    args.insert("x-overflow", FieldValue::long_str("reject-publish"));
    for (k, v) in extra {
        args.insert(*k, v.clone());
    }
    args
}

/// A delayed message was confirmed when it was published; a full `reject-publish` queue that
/// refuses it when it falls due has nobody to nack. It is not dropped: it waits again, for
/// that queue only, and is tried later (1 s, doubling), on disk meanwhile.
#[test]
fn a_release_a_full_reject_publish_queue_refuses_waits_and_is_tried_again() {
    let mut b = setup(true);
    let store = MemStore::default();
    b.set_pager(Box::new(store.clone()));
    queue(&mut b, "full", full_when_one(&[]));
    queue(&mut b, "plain", FieldTable::new());
    for q in ["full", "plain"] {
        b.bind_queue("/", q, "delayed", "k", &FieldTable::new(), 1)
            .expect("bind");
    }
    for body in ["first", "second"] {
        let r = b
            .publish(
                "/",
                "delayed",
                "k",
                message("delayed", body.into(), Some(100)),
                0,
            )
            .expect("publish");
        assert!(!r.rejected, "nothing is full when it is published");
    }
    store.apply(&mut b);
    run_until(&mut b, &store, 100);
    assert_eq!(drain(&mut b, "plain"), vec!["first", "second"]);
    assert_eq!(drain(&mut b, "q"), vec!["first", "second"]);
    assert_eq!(b.counters().delayed_refused, 1, "counted");
    assert_eq!(b.delayed_counts().0, 1, "'second' waits again, for 'full'");
    assert_eq!(store.0.lock().unwrap().delayed.len(), 1, "on disk");
    // Still full at its next try: it waits twice as long.
    run_until(&mut b, &store, 1_100);
    assert_eq!(b.counters().delayed_refused, 2);
    assert_eq!(b.next_deadline(), Some(3_100));
    let got = b.get("/", "full", true, 1).expect("get").expect("first");
    assert_eq!(&got.0.message.body[..], b"first");
    run_until(&mut b, &store, 3_099);
    assert!(drain(&mut b, "full").is_empty(), "never early");
    run_until(&mut b, &store, 3_100);
    assert_eq!(drain(&mut b, "full"), vec!["second"]);
    assert!(
        drain(&mut b, "plain").is_empty(),
        "the other queues got theirs once"
    );
    assert!(store.0.lock().unwrap().delayed.is_empty());
    // A queue's own delay, refused at release: the same; and `reject-publish-dlx`
    // dead-letters it instead (reason maxlen), as it would a refused publish.
    queue(&mut b, "dlq", FieldTable::new());
    queue(
        &mut b,
        "own",
        full_when_one(&[("x-delivery-delay", FieldValue::I32(50))]),
    );
    queue(
        &mut b,
        "own-dlx",
        full_when_one(&[
            ("x-delivery-delay", FieldValue::I32(50)),
            ("x-overflow", FieldValue::long_str("reject-publish-dlx")),
            ("x-dead-letter-exchange", FieldValue::long_str("")),
            ("x-dead-letter-routing-key", FieldValue::long_str("dlq")),
        ]),
    );
    for q in ["own", "own-dlx"] {
        for body in ["a", "b"] {
            b.publish("/", "", q, to_queue(q, body), 4_000)
                .expect("publish");
        }
    }
    run_until(&mut b, &store, 4_050);
    assert_eq!(drain(&mut b, "own-dlx"), vec!["a"]);
    assert_eq!(drain(&mut b, "dlq"), vec!["b"]);
    assert_eq!(drain(&mut b, "own"), vec!["a"]);
    run_until(&mut b, &store, 5_050);
    assert_eq!(drain(&mut b, "own"), vec!["b"]);
    assert_eq!(b.delayed_counts(), (0, 0));
}
