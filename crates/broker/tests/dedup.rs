//! Deduplication through the broker (docs/task-queues.md): only a new publish is judged, a key
//! is remembered only once its copy was taken, and a duplicate's confirm waits for the first
//! copy's write. A duplicate must never cost a message that exists nowhere else.

use bytes::Bytes;
use warren_broker::{Broker, BrokerConfig, DeclareQueue, Message, Routed};
use warren_codec::properties::BasicProperties;
use warren_codec::{FieldTable, FieldValue, ShortStr};

fn broker(persistence: bool) -> Broker {
    Broker::new(BrokerConfig {
        persistence,
        ..BrokerConfig::default()
    })
}

fn table(pairs: &[(&str, FieldValue)]) -> FieldTable {
    let mut t = FieldTable::new();
    for (k, v) in pairs {
        t.insert(ShortStr::from_string((*k).to_owned()), v.clone());
    }
    t
}

fn dedup(more: &[(&str, FieldValue)]) -> FieldTable {
    let mut t = table(&[("x-message-deduplication", FieldValue::Bool(true))]);
    for (k, v) in more {
        t.insert(ShortStr::from_string((*k).to_owned()), v.clone());
    }
    t
}

fn queue(b: &mut Broker, name: &str, arguments: FieldTable) {
    let req = DeclareQueue {
        name: ShortStr::from_string(name.to_owned()),
        passive: false,
        durable: true,
        exclusive: false,
        auto_delete: false,
        arguments,
    };
    b.declare_queue("/", req, 1).expect("declare queue");
}

fn message(id: &str, headers: FieldTable) -> Message {
    Message {
        exchange: ShortStr::empty(),
        routing_key: "k".into(),
        properties: BasicProperties {
            message_id: Some(ShortStr::from_string(id.to_owned())),
            headers: Some(headers),
            delivery_mode: Some(2),
            ..BasicProperties::default()
        }
        .encode(),
        body: Bytes::from(id.to_owned()),
        persistent: true,
        store_key: None,
        away: None,
    }
}

fn publish(b: &mut Broker, exchange: &str, key: &str, m: Message, now: u64) -> Routed {
    b.publish("/", exchange, key, m, now).expect("publish")
}

fn ready(b: &Broker, q: &str) -> u32 {
    let id = b.queue_id("/", q).expect("queue");
    b.queue_info(id).expect("info").message_count
}

/// Takes one message from `q` and rejects it without requeue (dead-lettered).
fn reject(b: &mut Broker, q: &str) {
    let (d, _) = b.get("/", q, false, 1).unwrap().expect("a message");
    assert!(b.discard(d.queue, d.receipt));
}

/// A dead-letter cycle with a delay, RabbitMQ's retry pattern: the message that comes back
/// to its dedup queue within the window is a dead letter, not a new publish.
#[test]
fn a_dead_letter_coming_back_to_its_dedup_queue_is_kept() {
    let mut b = broker(false);
    queue(
        &mut b,
        "jobs",
        dedup(&[
            ("x-dead-letter-exchange", FieldValue::long_str("")),
            ("x-dead-letter-routing-key", FieldValue::long_str("wait")),
        ]),
    );
    queue(
        &mut b,
        "wait",
        table(&[
            ("x-message-ttl", FieldValue::I32(10)),
            ("x-dead-letter-exchange", FieldValue::long_str("")),
            ("x-dead-letter-routing-key", FieldValue::long_str("jobs")),
        ]),
    );
    let r = publish(&mut b, "", "jobs", message("m-1", FieldTable::new()), 0);
    assert_eq!(r.queues, 1);
    reject(&mut b, "jobs");
    assert_eq!(ready(&b, "wait"), 1);
    b.tick(20);
    assert_eq!(ready(&b, "wait"), 0);
    assert_eq!(
        ready(&b, "jobs"),
        1,
        "the retried message was dropped as a duplicate"
    );
    // A new publish of the same message is still a duplicate.
    publish(&mut b, "", "jobs", message("m-1", FieldTable::new()), 21);
    assert_eq!(ready(&b, "jobs"), 1);
}

/// A redrive or move publishes a copy that carries `x-death` or `x-moved-from`: let through.
#[test]
fn a_redriven_or_moved_message_is_let_into_a_queue_that_saw_its_key() {
    let mut b = broker(false);
    queue(&mut b, "jobs", dedup(&[]));
    publish(&mut b, "", "jobs", message("m-1", FieldTable::new()), 0);
    let (d, _) = b.get("/", "jobs", false, 1).unwrap().expect("m-1");
    assert!(b.settle(d.queue, d.receipt));
    let death = FieldValue::Array(vec![FieldValue::Table(table(&[(
        "queue",
        FieldValue::long_str("jobs"),
    )]))]);
    let back = message("m-1", table(&[("x-death", death)]));
    assert_eq!(publish(&mut b, "", "jobs", back, 1).queues, 1);
    assert_eq!(ready(&b, "jobs"), 1, "a redriven dead letter was dropped");
    let moved = message(
        "m-1",
        table(&[("x-moved-from", FieldValue::long_str("old-jobs"))]),
    );
    publish(&mut b, "", "jobs", moved, 2);
    assert_eq!(ready(&b, "jobs"), 2, "a moved message was dropped");
    // Neither was remembered: a new publish is judged against the first copy only.
    publish(&mut b, "", "jobs", message("m-1", FieldTable::new()), 3);
    assert_eq!(ready(&b, "jobs"), 2);
}

/// A first copy refused by a full `reject-publish` queue (its publisher nacked) was not taken:
/// the exchange does not remember its key.
#[test]
fn a_full_reject_publish_queue_behind_a_dedup_exchange_leaves_the_retry_new() {
    let mut b = broker(false);
    b.declare_exchange(
        "/",
        "orders",
        "fanout",
        false,
        true,
        false,
        false,
        &dedup(&[]),
    )
    .unwrap();
    queue(
        &mut b,
        "small",
        table(&[
            ("x-max-length", FieldValue::I32(1)),
            ("x-overflow", FieldValue::long_str("reject-publish")),
        ]),
    );
    b.bind_queue("/", "small", "orders", "", &FieldTable::new(), 1)
        .unwrap();
    publish(
        &mut b,
        "orders",
        "",
        message("filler", FieldTable::new()),
        0,
    );
    let r = publish(&mut b, "orders", "", message("m-1", FieldTable::new()), 1);
    assert!(
        r.rejected,
        "the full queue refuses it: the publisher is nacked"
    );
    let (d, _) = b.get("/", "small", false, 1).unwrap().expect("filler");
    assert!(b.settle(d.queue, d.receipt));
    // The publisher retries: not a duplicate of a copy nobody took.
    let r = publish(&mut b, "orders", "", message("m-1", FieldTable::new()), 2);
    assert!(!r.rejected);
    assert_eq!(
        ready(&b, "small"),
        1,
        "the retry of a nacked publish was dropped"
    );
    // And now it is taken, its retry is a duplicate.
    publish(&mut b, "orders", "", message("m-1", FieldTable::new()), 3);
    assert_eq!(ready(&b, "small"), 1);
}

/// An unroutable first copy was taken by no queue: its retry, once a queue is bound, is new.
#[test]
fn an_unroutable_first_copy_leaves_the_retry_new() {
    let mut b = broker(false);
    b.declare_exchange(
        "/",
        "orders",
        "direct",
        false,
        true,
        false,
        false,
        &dedup(&[]),
    )
    .unwrap();
    let r = publish(&mut b, "orders", "k", message("m-1", FieldTable::new()), 0);
    assert_eq!(r.queues, 0);
    queue(&mut b, "q", FieldTable::new());
    b.bind_queue("/", "q", "orders", "k", &FieldTable::new(), 1)
        .unwrap();
    publish(&mut b, "orders", "k", message("m-1", FieldTable::new()), 1);
    assert_eq!(ready(&b, "q"), 1);
}

/// A duplicate of a persistent message whose write is still on its way is confirmed with that
/// write, not before; once it is written, at once.
#[test]
fn a_duplicates_confirm_waits_for_the_first_copys_write() {
    for exchange in ["", "orders"] {
        let mut b = broker(true);
        let (x, key) = if exchange.is_empty() {
            queue(&mut b, "jobs", dedup(&[]));
            ("", "jobs")
        } else {
            b.declare_exchange(
                "/",
                "orders",
                "fanout",
                false,
                true,
                false,
                false,
                &dedup(&[]),
            )
            .unwrap();
            queue(&mut b, "jobs", FieldTable::new());
            b.bind_queue("/", "jobs", "orders", "", &FieldTable::new(), 1)
                .unwrap();
            ("orders", "")
        };
        while b.take_writes().is_some() {}
        let first = publish(&mut b, x, key, message("m-1", FieldTable::new()), 0);
        let n = first
            .batch
            .expect("a persistent message waits for its write");
        let dup = publish(&mut b, x, key, message("m-1", FieldTable::new()), 1);
        assert_eq!(ready(&b, "jobs"), 1, "{exchange:?}");
        assert_eq!(
            dup.batch,
            Some(n),
            "{exchange:?}: confirmed before the write"
        );
        let w = b.take_writes().expect("the write");
        assert_eq!(w.number, n);
        b.writes_done(n);
        let dup = publish(&mut b, x, key, message("m-1", FieldTable::new()), 2);
        assert_eq!(dup.batch, None, "{exchange:?}");
        assert_eq!(ready(&b, "jobs"), 1);
    }
}

/// The first copy's write failed (its publisher was nacked): the retry is taken as a new
/// message, with its own write, rather than confirmed as a duplicate of a copy not on disk.
#[test]
fn a_failed_write_makes_the_retry_new() {
    let mut b = broker(true);
    queue(&mut b, "jobs", dedup(&[]));
    while b.take_writes().is_some() {}
    let first = publish(&mut b, "", "jobs", message("m-1", FieldTable::new()), 0);
    let n = first.batch.expect("a write");
    let w = b.take_writes().expect("the write");
    assert_eq!(w.number, n);
    b.writes_failed(n);
    let retry = publish(&mut b, "", "jobs", message("m-1", FieldTable::new()), 1);
    let m = retry.batch.expect("the retry is written");
    assert!(m > n, "the retry waits for its own write");
    // At least once: the first copy may still reach the disk on the store's retry.
    assert_eq!(ready(&b, "jobs"), 2);
    let w = b.take_writes().expect("the retry's write");
    b.writes_done(w.number);
    let again = publish(&mut b, "", "jobs", message("m-1", FieldTable::new()), 2);
    assert_eq!(again.batch, None);
    assert_eq!(ready(&b, "jobs"), 2);
}

/// Declarations past the limits are refused as RabbitMQ refuses an out-of-range argument.
#[test]
fn a_window_past_the_limits_is_refused() {
    let mut b = broker(false);
    let req = DeclareQueue {
        name: "big".into(),
        passive: false,
        durable: true,
        exclusive: false,
        auto_delete: false,
        arguments: dedup(&[("x-cache-size", FieldValue::I64(10_000_000))]),
    };
    let e = b.declare_queue("/", req, 1).unwrap_err();
    assert_eq!(e.code.code(), 406);
    assert_eq!(
        e.text,
        "invalid arg 'x-cache-size' for queue 'big' in vhost '/': {value_too_large,10000000}"
    );
    let e = b
        .declare_exchange(
            "/",
            "big",
            "fanout",
            false,
            true,
            false,
            false,
            &dedup(&[("x-cache-ttl", FieldValue::I64(30 * 24 * 3600 * 1000))]),
        )
        .unwrap_err();
    assert_eq!(
        e.text,
        "invalid arg 'x-cache-ttl' for exchange 'big' in vhost '/': {value_too_large,2592000000}"
    );
}

/// A queue stored with a window over today's limits is recovered with the limit, not lost.
#[test]
fn a_stored_window_over_the_limits_is_recovered_at_the_limit() {
    let mut b = broker(true);
    let def = warren_broker::QueueDef {
        vhost: "/".into(),
        name: "old".into(),
        key: 7,
        auto_delete: false,
        arguments: dedup(&[("x-cache-size", FieldValue::I64(5_000_000))]),
        group: None,
        voters: None,
    };
    let id = b.restore_queue(&def).expect("recovered");
    let size = b
        .queue_args(id)
        .and_then(|a| a.dedup.as_ref())
        .map(|d| d.size);
    assert_eq!(size, Some(warren_broker::dedup::MAX_SIZE));
}
