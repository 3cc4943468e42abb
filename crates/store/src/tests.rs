//! The store's tests, compiled only under `#[cfg(test)]` (`mod tests` in lib.rs): every unwrap
//! and expect below is test code.

mod sim;

use bytes::Bytes;
use warren_broker::{
    Broker, BrokerConfig, CreditGroup, DeclareQueue, DelayKey, Delivery, Message, ReadRequest,
};
use warren_codec::{FieldTable, ShortStr};

use super::*;

fn broker() -> Broker {
    Broker::new(BrokerConfig {
        persistence: true,
        ..BrokerConfig::default()
    })
}

fn declare(b: &mut Broker, name: &'static str, durable: bool) {
    declare_with(b, name, durable, FieldTable::new()).expect("declare");
}

/// Declares a queue ("" = server-named); its name, or the broker's refusal.
fn declare_with(
    b: &mut Broker,
    name: &'static str,
    durable: bool,
    arguments: FieldTable,
) -> Result<ShortStr, warren_codec::AmqpError> {
    b.declare_queue(
        "/",
        DeclareQueue {
            name: ShortStr::from_static(name),
            passive: false,
            durable,
            exclusive: false,
            auto_delete: false,
            arguments,
        },
        1,
    )
    .map(|d| d.name)
}

fn msg(body: &'static str, persistent: bool) -> Message {
    Message {
        exchange: ShortStr::empty(),
        routing_key: ShortStr::empty(),
        // Property flags with delivery-mode set, then delivery-mode 2.
        properties: Bytes::from_static(&[0x10, 0x00, 2]),
        body: Bytes::from_static(body.as_bytes()),
        persistent,
        store_key: None,
        away: None,
    }
}

fn flush(b: &mut Broker, s: &Store) {
    let mut batches = Vec::new();
    while let Some(w) = b.take_writes() {
        batches.push(w);
    }
    s.write(&batches).expect("write");
}

/// A broker rebuilt from the store, reading paged messages back through it.
fn recovered(s: Store) -> (Broker, Recovered, std::sync::Arc<Store>) {
    let s = std::sync::Arc::new(s);
    let mut b = broker();
    b.set_pager(Box::new(StorePager(s.clone())));
    let r = s.recover(&mut b).expect("recover");
    (b, r, s)
}

/// The bodies of a queue's ready messages in id order, in memory or paged out.
fn ready(b: &Broker, s: &Store, q: &str) -> Vec<Bytes> {
    let id = b.queue_id("/", q).expect("queue");
    let m = b.machine(id).expect("machine");
    let mut v: Vec<(u64, Bytes)> = m
        .ready_messages()
        .map(|(id, m, _)| (id, m.body.clone()))
        .collect();
    let key = b.queue_store_key(id).expect("durable");
    for (first, last) in m.paged_runs() {
        let page = s
            .read_page(key, first, last, usize::MAX, u64::MAX)
            .expect("read");
        v.extend(
            page.messages
                .into_iter()
                .map(|l| (l.msg_id, l.message.body)),
        );
    }
    v.sort_by_key(|(id, _)| *id);
    v.into_iter().map(|(_, b)| b).collect()
}

fn consume_all(b: &mut Broker, q: &str) -> Vec<Delivery> {
    b.consume(
        "/",
        q,
        CreditGroup {
            conn: 1,
            channel: 1,
        },
        ShortStr::from_static("c"),
        false,
        false,
        0,
        &FieldTable::new(),
    )
    .expect("consume");
    let mut out = Vec::new();
    while b.dispatch_one(&mut out) {}
    out
}

#[test]
fn durable_messages_survive_and_transient_ones_do_not() {
    let dir = tempfile::tempdir().expect("tempdir");
    {
        let s = Store::open(dir.path()).expect("open");
        let mut b = broker();
        declare(&mut b, "durable", true);
        declare(&mut b, "transient", false);
        for (body, persistent) in [("a", true), ("b", false), ("c", true)] {
            b.publish("/", "", "durable", msg(body, persistent), 0)
                .expect("publish");
            b.publish("/", "", "transient", msg(body, persistent), 0)
                .expect("publish");
        }
        flush(&mut b, &s);
        s.close_clean().expect("close");
    }
    let s = Store::open(dir.path()).expect("reopen");
    assert!(s.clean_start());
    let (b, r, s) = recovered(s);
    assert_eq!((r.queues, r.messages, r.after_crash), (1, 2, false));
    assert_eq!(ready(&b, &s, "durable"), vec!["a", "c"]);
    assert!(b.queue_id("/", "transient").is_none());
}

#[test]
fn acked_messages_stay_gone_and_unacked_ones_come_back_redelivered() {
    let dir = tempfile::tempdir().expect("tempdir");
    {
        let s = Store::open(dir.path()).expect("open");
        let mut b = broker();
        declare(&mut b, "q", true);
        for body in ["1", "2", "3"] {
            b.publish("/", "", "q", msg(body, true), 0)
                .expect("publish");
        }
        flush(&mut b, &s);
        let d = consume_all(&mut b, "q");
        assert_eq!(d.len(), 3);
        assert!(b.settle(d[0].queue, d[0].receipt));
        // "2" came back once (nack with requeue) and was delivered again.
        assert!(b.requeue(d[1].queue, d[1].receipt));
        let again: Vec<Delivery> = {
            let mut out = Vec::new();
            while b.dispatch_one(&mut out) {}
            out
        };
        assert_eq!(again.len(), 1);
        flush(&mut b, &s);
        // No clean close: a crash.
    }
    let s = Store::open(dir.path()).expect("reopen");
    assert!(!s.clean_start());
    let (mut b, r, s) = recovered(s);
    assert!(r.after_crash);
    assert_eq!(ready(&b, &s, "q"), vec!["2", "3"]);
    let d = consume_all(&mut b, "q");
    assert!(
        d.iter().all(|d| d.redelivered),
        "after a crash all come back redelivered"
    );
    // "2" was delivered twice before; its count was stored when it came back the first time.
    assert_eq!(d[0].receipt.attempt, 2);
    assert_eq!(d[1].receipt.attempt, 1);
}

#[test]
fn fanned_out_body_is_stored_once_and_deleted_with_its_last_queue_entry() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = Store::open(dir.path()).expect("open");
    let mut b = broker();
    declare(&mut b, "q1", true);
    declare(&mut b, "q2", true);
    b.bind_queue("/", "q1", "amq.fanout", "", &FieldTable::new(), 1)
        .expect("bind");
    b.bind_queue("/", "q2", "amq.fanout", "", &FieldTable::new(), 1)
        .expect("bind");
    let mut m = msg("fan", true);
    m.exchange = ShortStr::from_static("amq.fanout");
    b.publish("/", "amq.fanout", "", m, 0).expect("publish");
    let w = b.take_writes().expect("writes");
    let bodies = w
        .ops
        .iter()
        .filter(|o| matches!(o, StoreOp::PutBody { .. }))
        .count();
    assert_eq!(bodies, 1);
    s.write(&[w]).expect("write");
    let d1 = consume_all(&mut b, "q1");
    assert!(b.settle(d1[0].queue, d1[0].receipt));
    let w = b.take_writes().expect("writes");
    assert!(!w
        .ops
        .iter()
        .any(|o| matches!(o, StoreOp::DeleteBody { .. })));
    s.write(&[w]).expect("write");
    let bodies_cf = s.cf(CF_BODIES).expect("cf");
    assert_eq!(
        s.db.iterator_cf(bodies_cf, rocksdb::IteratorMode::Start)
            .count(),
        1
    );
    let d2 = consume_all(&mut b, "q2");
    assert!(b.settle(d2[0].queue, d2[0].receipt));
    flush(&mut b, &s);
    assert_eq!(
        s.db.iterator_cf(bodies_cf, rocksdb::IteratorMode::Start)
            .count(),
        0
    );
}

#[test]
fn definitions_survive_with_their_arguments() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut args = FieldTable::new();
    args.insert(
        ShortStr::from_static("x-max-length"),
        warren_codec::FieldValue::I32(10),
    );
    let mut xargs = FieldTable::new();
    xargs.insert(
        ShortStr::from_static("alternate-exchange"),
        warren_codec::FieldValue::LongStr(Bytes::from_static(b"ae")),
    );
    {
        let s = Store::open(dir.path()).expect("open");
        let mut b = broker();
        b.declare_exchange("/", "logs", "topic", false, true, false, false, &xargs)
            .expect("exchange");
        b.declare_exchange("/", "gone", "direct", false, false, false, false, &args)
            .expect("exchange");
        declare_with(&mut b, "q", true, args.clone()).expect("queue");
        b.bind_queue("/", "q", "logs", "a.#", &FieldTable::new(), 1)
            .expect("bind");
        b.bind_exchange("/", "logs", "amq.topic", "x.*", &FieldTable::new())
            .expect("bind");
        flush(&mut b, &s);
        s.close_clean().expect("close");
    }
    let s = Store::open(dir.path()).expect("reopen");
    let (mut b, r, _s) = recovered(s);
    assert_eq!((r.exchanges, r.queues, r.bindings, r.skipped), (1, 1, 2, 0));
    assert!(b.exchange_exists("/", "logs"));
    assert!(!b.exchange_exists("/", "gone"));
    // Redeclaring with the same arguments is accepted; other arguments are refused (406).
    b.declare_exchange("/", "logs", "topic", false, true, false, false, &xargs)
        .expect("equivalent");
    assert!(b
        .declare_exchange(
            "/",
            "logs",
            "topic",
            false,
            true,
            false,
            false,
            &FieldTable::new()
        )
        .is_err());
    let q = b.queue_id("/", "q").expect("queue");
    assert_eq!(b.queue_info(q).map(|i| i.durable), Some(true));
    assert!(declare_with(&mut b, "q", true, FieldTable::new()).is_err());
    // The restored bindings route: amq.topic -> logs -> q.
    let mut m = msg("routed", true);
    m.exchange = ShortStr::from_static("amq.topic");
    let routed = b.publish("/", "amq.topic", "x.y", m, 0).expect("publish");
    assert_eq!(routed.queues, 0, "x.y does not match a.#");
    let mut m = msg("routed", true);
    m.exchange = ShortStr::from_static("logs");
    let routed = b.publish("/", "logs", "a.b", m, 0).expect("publish");
    assert_eq!(routed.queues, 1);
    assert!(routed.batch.is_some());
}

#[test]
fn vhosts_users_and_permissions_survive_and_deletions_too() {
    use warren_broker::access::{
        AccessKeyDef, HashAlgorithm, PasswordHash, Perm, PermissionDef, Resource,
        TopicPermissionDef, UserDef,
    };
    let key = |id: &str, user: &str| AccessKeyDef {
        id: id.into(),
        secret: format!("secret of {id}"),
        user: user.into(),
        created_ms: 1_764_000_000_123,
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let user = |name: &str, tags: &[&str]| UserDef {
        name: name.into(),
        hash: Some(PasswordHash::new("pw", [9, 8, 7, 6], HashAlgorithm::Sha512)),
        tags: tags.iter().map(|t| t.to_string()).collect(),
    };
    let perm = |user: &str, vhost: &str| PermissionDef {
        user: user.into(),
        vhost: vhost.into(),
        configure: "^c-".into(),
        write: "".into(),
        read: ".*".into(),
    };
    {
        let s = Store::open(dir.path()).expect("open");
        let mut b = broker();
        b.declare_vhost("staging");
        b.declare_vhost("gone");
        b.put_vhost(
            "billing",
            &warren_broker::VhostMetaChange {
                description: Some("invoices".into()),
                tags: Some(vec!["eu".into(), "prod".into()]),
                default_queue_type: Some(Some(warren_broker::QueueType::Quorum)),
            },
        )
        .expect("vhost");
        b.put_user(user("app", &["monitoring"]));
        b.put_user(user("old", &[]));
        b.set_permission(perm("app", "staging"))
            .expect("permission");
        b.set_permission(perm("app", "gone")).expect("permission");
        b.set_permission(perm("old", "/")).expect("permission");
        b.set_topic_permission(TopicPermissionDef {
            user: "app".into(),
            vhost: "staging".into(),
            exchange: "amq.topic".into(),
            write: "^{username}".into(),
            read: "".into(),
        })
        .expect("topic permission");
        b.declare_exchange(
            "staging",
            "x",
            "topic",
            false,
            true,
            false,
            false,
            &FieldTable::new(),
        )
        .expect("exchange");
        use warren_broker::limits::LimitScope;
        b.set_limit(LimitScope::Vhost, "staging", "max-queues", 7)
            .expect("limit");
        b.set_limit(LimitScope::Vhost, "staging", "max-connections", -1)
            .expect("limit");
        b.set_limit(LimitScope::Vhost, "gone", "max-queues", 1)
            .expect("limit");
        b.set_limit(LimitScope::User, "app", "max-channels", 3)
            .expect("limit");
        b.set_limit(LimitScope::User, "old", "max-channels", 3)
            .expect("limit");
        b.set_limit(LimitScope::Vhost, "/", "max-queues", 5)
            .expect("limit");
        b.clear_limit(LimitScope::Vhost, "/", "max-queues")
            .expect("clear");
        b.put_access_key(key("WKIAKEPT", "app")).expect("key");
        b.put_access_key(key("WKIADELETED", "app")).expect("key");
        b.put_access_key(key("WKIAOFOLD", "old")).expect("key");
        assert!(b.put_access_key(key("WKIANOBODY", "nobody")).is_err());
        assert!(b.delete_access_key("WKIADELETED"));
        let param =
            |vhost: &str, name: &str, value: &str| warren_broker::parameters::ParameterDef {
                component: "shovel".into(),
                vhost: vhost.into(),
                name: name.into(),
                value: value.into(),
            };
        b.set_parameter(param("staging", "kept", r#"{"src-uri":"amqp://"}"#))
            .expect("parameter");
        b.set_parameter(param("staging", "cleared", "{}"))
            .expect("parameter");
        b.set_parameter(param("gone", "of a gone vhost", "{}"))
            .expect("parameter");
        assert!(b.set_parameter(param("nowhere", "p", "{}")).is_err());
        assert!(b.clear_parameter("shovel", "staging", "cleared"));
        b.delete_user("old");
        b.delete_vhost("gone");
        flush(&mut b, &s);
        s.close_clean().expect("close");
    }
    let s = Store::open(dir.path()).expect("reopen");
    let (b, r, _s) = recovered(s);
    assert_eq!(r.skipped, 0);
    assert!(b.vhost_exists("staging"));
    assert!(!b.vhost_exists("gone"));
    assert_eq!(
        b.vhost_meta("billing"),
        Some(&warren_broker::VhostMeta {
            description: "invoices".into(),
            tags: vec!["eu".into(), "prod".into()],
            default_queue_type: Some(warren_broker::QueueType::Quorum),
        }),
        "a vhost's metadata is kept"
    );
    assert_eq!(
        b.vhost_meta("staging"),
        Some(&warren_broker::VhostMeta::default())
    );
    assert!(b.exchange_exists("staging", "x"));
    {
        use warren_broker::limits::LimitScope;
        let l = b.limits();
        assert_eq!(l.limit(LimitScope::Vhost, "staging", "max-queues"), Some(7));
        assert_eq!(
            l.of(LimitScope::Vhost, "staging").map(|l| l
                .iter()
                .map(|(n, v)| (n.to_string(), v))
                .collect::<Vec<_>>()),
            Some(vec![
                ("max-connections".to_string(), -1),
                ("max-queues".to_string(), 7)
            ])
        );
        assert_eq!(l.limit(LimitScope::User, "app", "max-channels"), Some(3));
        assert!(l.of(LimitScope::Vhost, "gone").is_none());
        assert!(l.of(LimitScope::User, "old").is_none());
        assert!(l.of(LimitScope::Vhost, "/").is_none());
    }
    let a = b.access();
    assert!(a.user("old").is_none());
    assert_eq!(
        a.login("app", "pw").map(|u| u.tags.clone()),
        Some(vec!["monitoring".to_string()])
    );
    assert!(a.may_open("app", "staging"));
    assert!(!a.may_open("app", "gone"));
    assert!(a
        .check("app", "staging", Perm::Configure, Resource::Queue("c-1"))
        .is_ok());
    assert!(a
        .check("app", "staging", Perm::Write, Resource::Exchange("c-1"))
        .is_err());
    assert!(a
        .check_topic("app", "staging", "amq.topic", Perm::Write, "app.x")
        .is_ok());
    assert!(a
        .check_topic("app", "staging", "amq.topic", Perm::Write, "bob.x")
        .is_err());
    assert_eq!(a.permissions().count(), 1);
    let keys: Vec<&AccessKeyDef> = a.access_keys().collect();
    assert_eq!(
        keys,
        [&key("WKIAKEPT", "app")],
        "deleted keys and a deleted user's stay gone"
    );
    let params: Vec<(&str, &str)> = a_params(&b);
    assert_eq!(
        params,
        [("kept", r#"{"src-uri":"amqp://"}"#)],
        "a cleared parameter and a deleted vhost's stay gone"
    );
}

#[test]
fn a_deleted_queue_leaves_nothing_behind() {
    let dir = tempfile::tempdir().expect("tempdir");
    {
        let s = Store::open(dir.path()).expect("open");
        let mut b = broker();
        declare(&mut b, "q", true);
        for body in ["1", "2"] {
            b.publish("/", "", "q", msg(body, true), 0)
                .expect("publish");
        }
        flush(&mut b, &s);
        b.delete_queue("/", "q", false, false, 1).expect("delete");
        flush(&mut b, &s);
        for cf in [CF_BODIES, CF_INDEX, CF_DEFS] {
            let handle = s.cf(cf).expect("cf");
            assert_eq!(
                s.db.iterator_cf(handle, rocksdb::IteratorMode::Start)
                    .count(),
                0,
                "{cf} is not empty"
            );
        }
        s.close_clean().expect("close");
    }
    let s = Store::open(dir.path()).expect("reopen");
    let mut b = broker();
    assert_eq!(s.recover(&mut b).expect("recover").queues, 0);
}

#[test]
fn a_second_store_on_the_same_directory_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _first = Store::open(dir.path()).expect("open");
    match Store::open(dir.path()) {
        Err(e @ StoreError::Locked { .. }) => {
            let text = e.to_string();
            assert!(text.contains("--data-dir"), "{text}");
        }
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!("a second store opened the same directory"),
    }
}

#[test]
fn a_newer_format_or_damaged_files_are_clear_errors() {
    let dir = tempfile::tempdir().expect("tempdir");
    {
        let s = Store::open(dir.path()).expect("open");
        s.db.put(KEY_FORMAT, 99u32.to_be_bytes()).expect("put");
    }
    match Store::open(dir.path()) {
        Err(e @ StoreError::Format { .. }) => assert!(e.to_string().contains("99"), "{e}"),
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!("a store of another format opened"),
    }
    // A CURRENT file pointing nowhere: RocksDB's own corruption.
    let dir = tempfile::tempdir().expect("tempdir");
    drop(Store::open(dir.path()).expect("open"));
    std::fs::write(dir.path().join("CURRENT"), "MANIFEST-999999\n").expect("write");
    match Store::open(dir.path()) {
        Err(e @ StoreError::Open { .. }) => {
            let text = e.to_string();
            assert!(text.contains(&dir.path().display().to_string()), "{text}");
        }
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!("a damaged store opened"),
    }
}

#[test]
fn server_named_durable_queues_come_back_and_keys_are_never_reused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (named, deleted_key) = {
        let s = Store::open(dir.path()).expect("open");
        let mut b = broker();
        let named = declare_with(&mut b, "", true, FieldTable::new()).expect("declare");
        b.publish("/", "", &named, msg("kept", true), 0)
            .expect("publish");
        // The queue with the largest key is deleted: its key must not come back.
        declare(&mut b, "gone", true);
        let gone = b.queue_id("/", "gone").expect("queue");
        let deleted_key = b.queue_store_key(gone).expect("key");
        b.publish("/", "", "gone", msg("x", true), 0)
            .expect("publish");
        b.delete_queue("/", "gone", false, false, 1)
            .expect("delete");
        flush(&mut b, &s);
        s.close_clean().expect("close");
        (named, deleted_key)
    };
    let s = Store::open(dir.path()).expect("reopen");
    let (mut b, _, s) = recovered(s);
    assert!(named.starts_with("amq.gen-"));
    assert_eq!(ready(&b, &s, &named), vec!["kept"]);
    declare(&mut b, "new", true);
    let key = b
        .queue_store_key(b.queue_id("/", "new").expect("queue"))
        .expect("key");
    assert!(
        key > deleted_key,
        "key {key} reused (deleted queue had {deleted_key})"
    );
    // Bodies too: the next body key is past every key given out before the restart.
    b.publish("/", "", "new", msg("y", true), 0)
        .expect("publish");
    let w = b.take_writes().expect("writes");
    let body = w.ops.iter().find_map(|o| match o {
        StoreOp::PutBody { key, .. } => Some(*key),
        _ => None,
    });
    assert!(body.is_some_and(|k| k > 2), "{body:?}");
}

fn dir_size(path: &std::path::Path) -> u64 {
    std::fs::read_dir(path)
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|e| e.metadata().ok())
                .filter(|m| m.is_file())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

/// A queue that moves many messages (appended at the tail, acked at the head, as a worker
/// does) neither slows down nor keeps the disk it used: puts and their SingleDeletes cancel
/// out, and nothing scans the tombstones of the acked head. 1 million 1 KiB messages here;
/// `WARREN_CHURN_MESSAGES=10000000` for the long run.
#[test]
fn a_queue_that_moved_a_million_messages_is_as_fast_and_gives_its_disk_back() {
    let total: u64 = std::env::var("WARREN_CHURN_MESSAGES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000);
    const BATCH: u64 = 1000;
    // Messages stay queued this many batches before their ack: the head is never the tail.
    const LAG: u64 = 20;
    let dir = tempfile::tempdir().expect("tempdir");
    let s = Store::open(dir.path()).expect("open");
    let body = bytes::Bytes::from(vec![7u8; 1024]);
    let message = Message {
        body,
        ..msg("", true)
    };
    let batches = total / BATCH;
    let mut times = Vec::with_capacity(batches as usize);
    let mut peak = 0;
    for n in 0..batches + LAG {
        let started = std::time::Instant::now();
        let mut ops = Vec::new();
        if n < batches {
            for i in n * BATCH..(n + 1) * BATCH {
                ops.push(StoreOp::PutBody {
                    key: i + 1,
                    message: message.clone(),
                    queues: 1,
                });
                ops.push(StoreOp::PutEntry {
                    queue: 1,
                    msg_id: i,
                    body: i + 1,
                    size: 1024,
                    shared: false,
                    expires_at: None,
                });
            }
        }
        if n >= LAG {
            for i in (n - LAG) * BATCH..(n - LAG + 1) * BATCH {
                ops.push(StoreOp::DeleteEntry {
                    queue: 1,
                    msg_id: i,
                    count: false,
                });
                ops.push(StoreOp::DeleteBody { key: i + 1 });
            }
        }
        s.write(&[WriteBatch {
            number: n + 1,
            ops,
            sync: false,
        }])
        .expect("write");
        if n < batches {
            times.push(started.elapsed());
        }
        if n % 100 == 0 {
            peak = peak.max(dir_size(dir.path()));
        }
    }
    s.db.flush_cf(s.cf(CF_BODIES).expect("cf")).expect("flush");
    s.db.flush_cf(s.cf(CF_INDEX).expect("cf")).expect("flush");
    let tenth = (times.len() / 10).max(1);
    let first: std::time::Duration = times[..tenth].iter().sum();
    let last: std::time::Duration = times[times.len() - tenth..].iter().sum();
    // The queue is empty again; what it held is gone from the index without a seek crawling
    // through tombstones: a bounded scan of its range finds nothing, quickly.
    let (from, to) = codec::queue_range(1);
    let mut r = rocksdb::ReadOptions::default();
    r.set_iterate_lower_bound(from);
    r.set_iterate_upper_bound(to);
    let scan = std::time::Instant::now();
    let left =
        s.db.iterator_cf_opt(s.cf(CF_INDEX).expect("cf"), r, rocksdb::IteratorMode::Start)
            .count();
    let scan = scan.elapsed();
    let size = dir_size(dir.path());
    eprintln!(
        "churn: {total} messages of 1 KiB; first tenth {first:?}, last tenth {last:?}; \
         directory peak {} MiB, after {} MiB; empty-queue scan {scan:?}",
        peak >> 20,
        size >> 20
    );
    assert_eq!(left, 0);
    assert!(
        last < first * 2 + std::time::Duration::from_millis(200),
        "the last tenth took {last:?}, the first {first:?}"
    );
    // 1 GiB went through; what stays is a fraction of it (WAL and small SST files).
    assert!(
        size < 128 << 20,
        "the directory still holds {} MiB",
        size >> 20
    );
    assert!(scan < std::time::Duration::from_millis(500), "{scan:?}");
}

// ------------------------------------------------------------------ paging

/// A broker that pages: small windows, reading back through the store.
fn paging_broker(s: &std::sync::Arc<Store>) -> Broker {
    let mut b = Broker::new(BrokerConfig {
        persistence: true,
        page_window: 8,
        page_window_idle: 4,
        ..BrokerConfig::default()
    });
    b.set_pager(Box::new(StorePager(s.clone())));
    b
}

/// Writes what the broker made and tells it the writes are done (which lets it page out).
fn flush_done(b: &mut Broker, s: &Store) {
    let mut batches = Vec::new();
    while let Some(w) = b.take_writes() {
        batches.push(w);
    }
    s.write(&batches).expect("write");
    if let Some(last) = batches.last() {
        b.writes_done(last.number);
    }
}

fn count(s: &Store, cf: &str) -> usize {
    let handle = s.cf(cf).expect("cf");
    s.db.iterator_cf(handle, rocksdb::IteratorMode::Start)
        .count()
}

fn owned_msg(body: String, persistent: bool) -> Message {
    Message {
        body: Bytes::from(body),
        ..msg("", persistent)
    }
}

fn paged_count(b: &Broker, q: &str) -> u64 {
    let id = b.queue_id("/", q).expect("queue");
    b.machine(id).expect("machine").paged_count()
}

fn head_count(b: &Broker, q: &str) -> usize {
    let id = b.queue_id("/", q).expect("queue");
    b.machine(id).expect("machine").head_count()
}

#[test]
fn a_deep_queue_keeps_a_window_in_memory_and_delivers_everything_in_order() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = std::sync::Arc::new(Store::open(dir.path()).expect("open"));
    let mut b = paging_broker(&s);
    declare(&mut b, "deep", true);
    // Persistent messages with a transient one now and then: those stay in memory, in place.
    for i in 0..200 {
        let m = owned_msg(format!("m{i}"), i % 50 != 7);
        b.publish("/", "", "deep", m, 0).expect("publish");
        if i % 30 == 29 {
            flush_done(&mut b, &s);
        }
    }
    flush_done(&mut b, &s);
    // Idle window 4, and 4 transient messages that cannot leave memory.
    assert_eq!(head_count(&b, "deep"), 4);
    assert_eq!(paged_count(&b, "deep"), 192);
    let info = b
        .queue_info(b.queue_id("/", "deep").expect("id"))
        .expect("info");
    assert_eq!(info.message_count, 200, "paged messages still count");
    let d = consume_all(&mut b, "deep");
    let bodies: Vec<String> = d
        .iter()
        .map(|d| String::from_utf8_lossy(&d.message.body).into_owned())
        .collect();
    let want: Vec<String> = (0..200).map(|i| format!("m{i}")).collect();
    assert_eq!(bodies, want);
    assert!(d.iter().all(|d| !d.redelivered));
    for d in &d {
        assert!(b.settle(d.queue, d.receipt));
    }
    flush_done(&mut b, &s);
    assert_eq!((count(&s, CF_INDEX), count(&s, CF_BODIES)), (0, 0));
}

#[test]
fn purging_or_deleting_a_paged_queue_removes_its_bodies_from_disk() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = std::sync::Arc::new(Store::open(dir.path()).expect("open"));
    let mut b = paging_broker(&s);
    for q in ["purged", "deleted"] {
        declare(&mut b, q, true);
        for i in 0..50 {
            b.publish("/", "", q, owned_msg(format!("{q}{i}"), true), 0)
                .expect("publish");
        }
        flush_done(&mut b, &s);
        assert!(paged_count(&b, q) > 0);
    }
    assert_eq!(count(&s, CF_BODIES), 100);
    assert_eq!(b.purge_queue("/", "purged", 1).expect("purge"), 50);
    flush_done(&mut b, &s);
    assert_eq!((count(&s, CF_INDEX), count(&s, CF_BODIES)), (50, 50));
    let deleted = b
        .delete_queue("/", "deleted", false, false, 1)
        .expect("delete");
    assert_eq!(deleted.message_count, 50);
    flush_done(&mut b, &s);
    assert_eq!((count(&s, CF_INDEX), count(&s, CF_BODIES)), (0, 0));
}

#[test]
fn recovery_leaves_messages_on_disk_until_a_consumer_reads_them() {
    let dir = tempfile::tempdir().expect("tempdir");
    {
        let s = std::sync::Arc::new(Store::open(dir.path()).expect("open"));
        let mut b = paging_broker(&s);
        declare(&mut b, "q", true);
        for i in 0..30 {
            b.publish("/", "", "q", owned_msg(format!("m{i}"), true), 0)
                .expect("publish");
        }
        flush_done(&mut b, &s);
        // m0 goes out and comes back: its count is stored.
        let id = b.queue_id("/", "q").expect("id");
        let (got, _) = b.get("/", "q", false, 1).expect("get").expect("a message");
        assert!(b.requeue(id, got.receipt));
        flush_done(&mut b, &s);
        // A crash: no clean close.
    }
    let s = Store::open(dir.path()).expect("reopen");
    let (mut b, r, s) = {
        let s = std::sync::Arc::new(s);
        let mut b = paging_broker(&s);
        let r = s.recover(&mut b).expect("recover");
        (b, r, s)
    };
    assert_eq!(r.messages, 30);
    assert_eq!(paged_count(&b, "q"), 30, "start-up reads no bodies");
    assert_eq!(ready(&b, &s, "q").len(), 30);
    let (first, _) = b.get("/", "q", true, 1).expect("get").expect("a message");
    assert_eq!(&first.message.body[..], b"m0");
    assert_eq!(
        first.receipt.attempt, 2,
        "the stored delivery count is read back"
    );
    let d = consume_all(&mut b, "q");
    assert_eq!(d.len(), 29);
    assert!(
        d.iter().all(|d| d.redelivered),
        "after a crash, all redelivered"
    );
    let bodies: Vec<String> = d
        .iter()
        .map(|d| String::from_utf8_lossy(&d.message.body).into_owned())
        .collect();
    assert_eq!(bodies, (1..30).map(|i| format!("m{i}")).collect::<Vec<_>>());
}

#[test]
fn transient_messages_of_a_deep_queue_spill_and_are_gone_after_a_restart() {
    let dir = tempfile::tempdir().expect("tempdir");
    {
        let s = std::sync::Arc::new(Store::open(dir.path()).expect("open"));
        let mut b = paging_broker(&s);
        // Memory pressure, as the server reports it past the paging ratio.
        b.set_spill(true);
        declare(&mut b, "durable", true);
        declare(&mut b, "transient", false);
        // A durable queue with both kinds, and a transient queue: all past the window spill.
        for i in 0..60 {
            let m = owned_msg(format!("d{i}"), i % 3 != 0);
            b.publish("/", "", "durable", m, 0).expect("publish");
            let m = owned_msg(format!("t{i}"), false);
            b.publish("/", "", "transient", m, 0).expect("publish");
        }
        flush_done(&mut b, &s);
        assert_eq!(paged_count(&b, "transient"), 56, "all but the idle window");
        assert_eq!(paged_count(&b, "durable"), 56);
        assert!(count(&s, CF_SPILL) > 0);
        let bodies: Vec<String> = consume_all(&mut b, "durable")
            .iter()
            .map(|d| String::from_utf8_lossy(&d.message.body).into_owned())
            .collect();
        assert_eq!(bodies, (0..60).map(|i| format!("d{i}")).collect::<Vec<_>>());
        // The transient queue is deleted with its spilled messages.
        b.delete_queue("/", "transient", false, false, 1)
            .expect("delete");
        flush_done(&mut b, &s);
        // Re-publish a few transient ones to the durable queue (no consumer now... it has one,
        // so they are kept in memory) and leave some spilled data behind for the restart.
        declare(&mut b, "scratch", false);
        for i in 0..30 {
            let m = owned_msg(format!("s{i}"), false);
            b.publish("/", "", "scratch", m, 0).expect("publish");
        }
        flush_done(&mut b, &s);
        assert!(count(&s, CF_SPILL) > 0);
    }
    let s = Store::open(dir.path()).expect("reopen");
    assert_eq!(
        count(&s, CF_SPILL),
        0,
        "the scratch area is dropped at start"
    );
    let (b, r, _s) = recovered(s);
    assert!(b.queue_id("/", "scratch").is_none());
    // The durable queue's persistent messages were consumed (not acked): they come back.
    assert_eq!(r.messages, 40);
}

/// Delayed messages on RocksDB: more than the memory window is scheduled, a restart finds them
/// all, and each is released once, in due order, leaving the column family empty.
#[test]
fn delayed_messages_live_on_disk_and_come_back_after_a_restart() {
    use warren_codec::properties::BasicProperties;
    use warren_codec::FieldValue;
    let dir = tempfile::tempdir().expect("tempdir");
    let total = warren_broker::delayed::MAX_LOADED as u64 + 500;
    let declare_all = |b: &mut Broker| {
        let mut args = FieldTable::new();
        args.insert("x-delayed-type", FieldValue::long_str("direct"));
        b.declare_exchange(
            "/",
            "later",
            "x-delayed-message",
            false,
            true,
            false,
            false,
            &args,
        )
        .expect("exchange");
        declare(b, "jobs", true);
        b.bind_queue("/", "jobs", "later", "jobs", &FieldTable::new(), 1)
            .expect("bind");
    };
    {
        let s = std::sync::Arc::new(Store::open(dir.path()).expect("open"));
        let mut b = paging_broker(&s);
        declare_all(&mut b);
        for i in 0..total {
            let mut h = FieldTable::new();
            // Due in reverse publish order: 100_000 ms down to 100_000 - total.
            h.insert("x-delay", FieldValue::I64((100_000 - i) as i64));
            let m = Message {
                exchange: ShortStr::from_static("later"),
                routing_key: ShortStr::from_static("jobs"),
                properties: BasicProperties {
                    headers: Some(h),
                    delivery_mode: Some(2),
                    ..BasicProperties::default()
                }
                .encode(),
                ..owned_msg(format!("{i}"), true)
            };
            b.publish("/", "later", "jobs", m, 0).expect("publish");
            if i % 1000 == 0 {
                flush_done(&mut b, &s);
            }
        }
        flush_done(&mut b, &s);
        let (_, loaded) = b.delayed_counts();
        assert!(loaded <= warren_broker::delayed::MAX_LOADED);
        assert_eq!(count(&s, CF_DELAYED) as u64, total);
    }
    let (mut b, _, s) = recovered(Store::open(dir.path()).expect("reopen"));
    // The exchange came back as a delayed one (its flag in the definition).
    assert_eq!(b.next_deadline(), Some(0), "the first read is due at once");
    let mut got = Vec::new();
    // Not yet due: nothing comes out.
    b.tick(100_000 - total);
    assert!(b.get("/", "jobs", true, 1).expect("get").is_none());
    // All due: each tick releases a bounded batch, reading the next ones from disk.
    let now = 200_000;
    while b.next_deadline().is_some() {
        b.tick(now);
        flush_done(&mut b, &s);
        while let Some((d, _)) = b.get("/", "jobs", true, 1).expect("get") {
            got.push(
                String::from_utf8_lossy(&d.message.body)
                    .parse::<u64>()
                    .unwrap(),
            );
        }
        flush_done(&mut b, &s);
    }
    assert_eq!(got.len() as u64, total, "each released once");
    let expected: Vec<u64> = (0..total).rev().collect();
    assert_eq!(got, expected, "in due order");
    assert_eq!(count(&s, CF_DELAYED), 0, "nothing left scheduled");
}

/// A message waiting for its delayed retry still waits after a restart (its due time is kept
/// beside its delivery count), also in a queue that pages; one whose time passed meanwhile is
/// ready at the first tick.
#[test]
fn a_retry_back_off_survives_a_restart() {
    use warren_codec::FieldValue;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut args = FieldTable::new();
    args.insert("x-delayed-retry-min", FieldValue::I32(10_000));
    {
        let s = std::sync::Arc::new(Store::open(dir.path()).expect("open"));
        let mut b = paging_broker(&s);
        declare_with(&mut b, "jobs", true, args.clone()).expect("declare");
        for i in 0..20 {
            b.publish("/", "", "jobs", owned_msg(format!("m{i}"), true), 1_000)
                .expect("publish");
        }
        flush_done(&mut b, &s);
        let (d, _) = b
            .get("/", "jobs", false, 1)
            .expect("get")
            .expect("a message");
        b.advance_time(1_000);
        assert!(b.requeue(d.queue, d.receipt), "back, waiting 10 s");
        flush_done(&mut b, &s);
        let id = b.queue_id("/", "jobs").expect("queue");
        assert_eq!(b.machine(id).unwrap().retry_due_of(0), Some(11_000));
    }
    let (mut b, _, s) = recovered(Store::open(dir.path()).expect("reopen"));
    let id = b.queue_id("/", "jobs").expect("queue");
    let m = b.machine(id).expect("machine");
    assert_eq!(m.retry_due_of(0), Some(11_000), "still waiting");
    assert_eq!(m.ready_count(), 20);
    // Before its time the others go first; at its time it is back.
    b.tick(5_000);
    let first = b
        .get("/", "jobs", true, 1)
        .expect("get")
        .expect("a message")
        .0;
    assert_eq!(first.message.body, Bytes::from_static(b"m1"));
    b.tick(11_000);
    flush_done(&mut b, &s);
    let next = b
        .get("/", "jobs", true, 1)
        .expect("get")
        .expect("a message")
        .0;
    assert_eq!(
        next.message.body,
        Bytes::from_static(b"m0"),
        "back in its place"
    );
    assert_eq!(next.receipt.attempt, 2);
}

/// What a durable queue with `x-delivery-delay` holds is still its own after a restart (it
/// is held by the queue's store key), and is released to it; deleting the queue then takes
/// what it still holds off the disk, and the next queue of its name gets none of it.
#[test]
fn a_delaying_queue_keeps_its_held_copies_over_a_restart_and_drops_them_when_deleted() {
    use warren_codec::FieldValue;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut args = FieldTable::new();
    args.insert("x-delivery-delay", FieldValue::I32(1_000));
    {
        let s = std::sync::Arc::new(Store::open(dir.path()).expect("open"));
        let mut b = paging_broker(&s);
        declare_with(&mut b, "later", true, args.clone()).expect("declare");
        for (body, at) in [("soon", 0), ("late", 10_000)] {
            let m = Message {
                routing_key: ShortStr::from_static("later"),
                ..owned_msg(body.into(), true)
            };
            b.publish("/", "", "later", m, at).expect("publish");
        }
        flush_done(&mut b, &s);
        assert_eq!(count(&s, CF_DELAYED), 2);
    }
    let (mut b, _, s) = recovered(Store::open(dir.path()).expect("reopen"));
    b.tick(10_000);
    flush_done(&mut b, &s);
    let got = b
        .get("/", "later", true, 1)
        .expect("get")
        .expect("released");
    assert_eq!(&got.0.message.body[..], b"soon");
    assert_eq!(count(&s, CF_DELAYED), 1);
    b.delete_queue("/", "later", false, false, 1)
        .expect("delete");
    flush_done(&mut b, &s);
    assert_eq!(count(&s, CF_DELAYED), 0, "its held copy went with it");
    declare_with(&mut b, "later", false, FieldTable::new()).expect("declare");
    b.tick(20_000);
    assert!(b.get("/", "later", true, 1).expect("get").is_none());
}

/// The raw `(key, value)` records of `cf` whose keys start with `prefix`.
fn raw(s: &Store, cf: &str, prefix: &[u8]) -> Vec<(Vec<u8>, Vec<u8>)> {
    let cf = s.cf(cf).expect("cf");
    s.db.iterator_cf(cf, rocksdb::IteratorMode::Start)
        .map(|item| item.expect("read"))
        .filter(|(k, _)| k.starts_with(prefix))
        .map(|(k, v)| (k.to_vec(), v.to_vec()))
        .collect()
}

#[test]
fn damaged_records_are_quarantined_and_the_rest_comes_back() {
    let dir = tempfile::tempdir().expect("tempdir");
    let garbage: &[u8] = &[0xff, 0x01, 0x02];
    let mut expected = Vec::new();
    {
        let s = Store::open(dir.path()).expect("open");
        let mut b = broker();
        for q in ["entry", "count", "fan1", "fan2", "def", "fine"] {
            declare(&mut b, q, true);
        }
        for q in ["fan1", "fan2"] {
            b.bind_queue("/", q, "amq.fanout", "", &FieldTable::new(), 1)
                .expect("bind");
        }
        for q in ["entry", "count", "def", "fine"] {
            for body in ["1", "2"] {
                b.publish("/", "", q, msg(body, true), 0).expect("publish");
            }
        }
        for body in ["f1", "f2"] {
            let mut m = msg(body, true);
            m.exchange = ShortStr::from_static("amq.fanout");
            b.publish("/", "amq.fanout", "", m, 0).expect("publish");
        }
        flush(&mut b, &s);
        let key = |q: &str| {
            let id = b.queue_id("/", q).expect("queue");
            b.queue_store_key(id).expect("durable").to_be_bytes()
        };
        let index = CF_INDEX;
        // An index entry: the last message of `entry` (its id must never be used again).
        let (k, _) = raw(&s, index, &key("entry"))[1].clone();
        s.db.put_cf(s.cf(index).expect("cf"), &k, garbage)
            .expect("put");
        expected.push((index.to_string(), k, garbage.to_vec()));
        // A delivery count of `count`'s first message.
        let (k, _) = raw(&s, index, &key("count"))[0].clone();
        s.db.put_cf(s.cf(CF_COUNTS).expect("cf"), &k, garbage)
            .expect("put");
        expected.push((CF_COUNTS.to_string(), k, garbage.to_vec()));
        // The shared body of the first fanned-out message.
        let (fan_k, fan_v) = raw(&s, index, &key("fan1"))[0].clone();
        let body = codec::decode_entry(&fan_v).expect("entry").body;
        s.db.put_cf(s.cf(CF_BODIES).expect("cf"), body.to_be_bytes(), garbage)
            .expect("put");
        expected.push((
            CF_BODIES.to_string(),
            body.to_be_bytes().to_vec(),
            garbage.to_vec(),
        ));
        expected.push((index.to_string(), fan_k, fan_v));
        // ... which leaves `fan2`'s entry for it without a body.
        expected.push((
            index.to_string(),
            raw(&s, index, &key("fan2"))[0].0.clone(),
            { raw(&s, index, &key("fan2"))[0].1.clone() },
        ));
        // The definition of `def`.
        let def_key = codec::queue_key("/", &ShortStr::from_static("def"));
        s.db.put_cf(s.cf(CF_DEFS).expect("cf"), &def_key, garbage)
            .expect("put");
        expected.push((CF_DEFS.to_string(), def_key.to_vec(), garbage.to_vec()));
    }
    let s = Store::open(dir.path()).expect("reopen");
    let (b, r, s) = recovered(s);
    assert_eq!(ready(&b, &s, "fine"), vec!["1", "2"]);
    assert_eq!(ready(&b, &s, "entry"), vec!["1"]);
    assert_eq!(
        ready(&b, &s, "count"),
        vec!["1", "2"],
        "a bad count costs no message"
    );
    assert_eq!(ready(&b, &s, "fan1"), vec!["f2"]);
    assert_eq!(ready(&b, &s, "fan2"), vec!["f2"]);
    assert!(b.queue_id("/", "def").is_none());
    assert_eq!((r.quarantined, r.lost), (6, 3), "{r:?}");
    let mut found: Vec<_> = s
        .quarantined()
        .expect("quarantine")
        .into_iter()
        .map(|q| (q.family, q.key, q.value))
        .collect();
    found.sort();
    expected.sort();
    assert_eq!(found, expected);
    // The damaged records left their column families (a new message may take a moved
    // entry's id: its key was deleted with a plain delete): a second start finds nothing
    // wrong, and the quarantine is kept.
    drop(b);
    let s = std::sync::Arc::into_inner(s).expect("one owner");
    drop(s);
    let s = Store::open(dir.path()).expect("reopen");
    let (_, r, s) = recovered(s);
    assert_eq!((r.quarantined, r.lost, r.messages), (0, 0, 7), "{r:?}");
    assert_eq!(s.quarantined().expect("quarantine").len(), 6);
}

#[test]
fn a_damaged_delayed_message_is_quarantined_not_deleted() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = Store::open(dir.path()).expect("open");
    let key = codec::delayed_key(DelayKey { due: 5, seq: 1 });
    s.db.put_cf(s.cf(CF_DELAYED).expect("cf"), key.as_ref(), [9u8])
        .expect("put");
    let (found, _) = s
        .read_delayed(ReadRequest {
            from: DelayKey { due: 0, seq: 0 },
            until: None,
            max_messages: 10,
            max_bytes: u64::MAX,
        })
        .expect("read");
    assert!(found.is_empty());
    let q = s.quarantined().expect("quarantine");
    assert_eq!(q.len(), 1);
    assert_eq!(
        (q[0].family.as_str(), &q[0].value[..]),
        (CF_DELAYED, &[9u8][..])
    );
}

#[test]
fn policies_survive_a_restart_and_act_on_restored_queues() {
    use warren_broker::policy::{ApplyTo, PolicyDef, PolicyKind, PolicyValue};
    let dir = tempfile::tempdir().expect("tempdir");
    let pol = |name: &str, kind, pairs: &[(&str, PolicyValue)]| PolicyDef {
        vhost: "/".into(),
        name: name.into(),
        kind,
        pattern: "^limited".into(),
        apply_to: ApplyTo::Queues,
        priority: -3,
        definition: pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.clone()))
            .collect(),
    };
    let user = pol(
        "limit",
        PolicyKind::User,
        &[
            ("max-length", PolicyValue::Int(2)),
            ("dead-letter-exchange", PolicyValue::Str("dlx".into())),
            ("message-deduplication", PolicyValue::Bool(false)),
            (
                "ha-params",
                PolicyValue::Other {
                    json: r#"["a"]"#.into(),
                    erl: r#"[<<"a">>]"#.into(),
                },
            ),
        ],
    );
    let op = pol(
        "cap",
        PolicyKind::Operator,
        &[("max-length", PolicyValue::Int(5))],
    );
    {
        let s = Store::open(dir.path()).expect("open");
        let mut b = broker();
        b.set_policy(user.clone()).expect("policy");
        b.set_policy(op.clone()).expect("operator policy");
        b.set_policy(pol(
            "gone",
            PolicyKind::User,
            &[("expires", PolicyValue::Int(9))],
        ))
        .expect("policy");
        assert!(b.clear_policy("/", PolicyKind::User, "gone"));
        declare(&mut b, "limited", true);
        flush(&mut b, &s);
        s.close_clean().expect("close");
    }
    let s = Store::open(dir.path()).expect("reopen");
    let (mut b, r, _s) = recovered(s);
    assert_eq!(r.skipped, 0);
    let p = b.policies();
    assert_eq!(p.get("/", PolicyKind::User, "limit"), Some(&user));
    assert_eq!(p.get("/", PolicyKind::Operator, "cap"), Some(&op));
    assert!(p.get("/", PolicyKind::User, "gone").is_none());
    for i in 0..4 {
        let m = owned_msg(format!("m{i}"), true);
        b.publish("/", "", "limited", m, 0).expect("publish");
    }
    let id = b.queue_id("/", "limited").expect("queue");
    assert_eq!(b.queue_info(id).map(|i| i.message_count), Some(2));
}

#[test]
fn a_ttl_lowered_by_a_policy_still_reaches_stored_messages_after_a_restart() {
    use warren_broker::policy::{ApplyTo, PolicyDef, PolicyKind, PolicyValue};
    let dir = tempfile::tempdir().expect("tempdir");
    {
        let s = Store::open(dir.path()).expect("open");
        let mut b = broker();
        declare(&mut b, "kept", true);
        for i in 0..3 {
            b.publish("/", "", "kept", owned_msg(format!("m{i}"), true), 0)
                .expect("publish");
        }
        flush(&mut b, &s);
        b.set_policy(PolicyDef {
            vhost: "/".into(),
            name: "ttl".into(),
            kind: PolicyKind::User,
            pattern: "^kept$".into(),
            apply_to: ApplyTo::Queues,
            priority: 0,
            definition: [("message-ttl".to_owned(), PolicyValue::Int(60_000))]
                .into_iter()
                .collect(),
        })
        .expect("policy");
        flush(&mut b, &s);
        s.close_clean().expect("close");
    }
    let s = Store::open(dir.path()).expect("reopen");
    let (mut b, _r, _s) = recovered(s);
    let id = b.queue_id("/", "kept").expect("queue");
    // Stored without an expiry: the policy's TTL counts from the restart at the latest.
    b.cap_restored_expiries(1_000_000);
    b.tick(1_000_000 + 59_000);
    assert_eq!(b.queue_info(id).map(|i| i.message_count), Some(3));
    b.tick(1_000_000 + 60_001);
    assert_eq!(b.queue_info(id).map(|i| i.message_count), Some(0));
}

#[test]
fn a_cluster_nodes_place_in_the_metadata_log_and_its_pending_changes_read_back() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = Store::open(dir.path()).expect("open");
    let place = |index: u64| StoreOp::PutMetaApplied {
        index,
        seen: vec![(1, 7), (3, 1 << 60)],
        levels: vec![(1, 1), (3, 0)],
        // Once the cluster forgot a node (node 2 here) and added one, its nodes.
        members: (index == 42).then(|| {
            vec![
                (1, String::new()),
                (3, String::new()),
                (4, "n4.local:7704".into()),
            ]
        }),
        forgotten: if index == 42 { vec![2] } else { Vec::new() },
    };
    let pending = |number| StoreOp::PutMetaPending {
        number,
        data: vec![number as u8; 30],
    };
    // Pending changes read back in number order (0xff before 0x100): they are sent again so.
    for (index, number) in [(41, 0x100), (42, 0xff)] {
        let batch = WriteBatch {
            number: index,
            ops: vec![place(index), pending(number), pending(141)],
            sync: true,
        };
        s.write(&[batch]).expect("write");
    }
    let applied = WriteBatch {
        number: 43,
        ops: vec![StoreOp::DeleteMetaPending { number: 141 }],
        sync: false,
    };
    s.write(&[applied]).expect("write");
    let defs = s.cf(CF_DEFS).expect("cf");
    let records: Vec<StoreOp> =
        s.db.iterator_cf(defs, rocksdb::IteratorMode::Start)
            .map(|item| {
                let (k, v) = item.expect("read");
                match codec::decode_def(&k, &v).expect("readable") {
                    codec::Def::Access(op) => op,
                    _ => panic!("not an access record"),
                }
            })
            .collect();
    assert_eq!(records, vec![place(42), pending(0xff), pending(0x100)]);
}

fn a_params(b: &warren_broker::Broker) -> Vec<(&str, &str)> {
    b.parameters()
        .list(Some("shovel"), None)
        .map(|p| (p.name.as_str(), p.value.as_str()))
        .collect()
}

/// The contents of replicated queues' messages that left memory are read back whole; a full
/// segment goes once all its records are released; a new start begins with none.
#[test]
fn contents_away_are_read_back_and_their_segment_deleted_once_released_and_gone_after_a_restart() {
    use warren_broker::AwayStore;
    let dir = tempfile::tempdir().expect("tempdir");
    let away_dir = dir.path().join("away");
    let segments = || std::fs::read_dir(&away_dir).map(|d| d.count()).unwrap_or(0);
    let m = |body: &'static str| Message {
        exchange: ShortStr::from_static("ex"),
        routing_key: ShortStr::from_static("jobs"),
        ..msg(body, true)
    };
    let away = std::sync::Arc::new(crate::AwayFiles::open(&away_dir).expect("open"));
    let (a, b) = (m("a body"), m("another"));
    let keys = away.put(&[&a, &b]).expect("put");
    assert_eq!(keys.len(), 2);
    assert_ne!(keys[0], keys[1]);
    assert_eq!(away.held(), 2);
    let stub = a.away_stub(keys[0], away.clone());
    assert_eq!(stub.loaded().expect("read").into_owned(), a);
    assert_eq!(
        away.get(keys[1]).expect("get"),
        Some(Message {
            store_key: Some(keys[1]),
            ..b.clone()
        })
    );
    drop(stub);
    assert_eq!(away.held(), 1);
    // 64 MiB fill the first segment: the next write opens a second, and the first goes once its
    // last record is released.
    let big = Message {
        body: bytes::Bytes::from(vec![7u8; 1 << 20]),
        ..m("")
    };
    let mut bigs = Vec::new();
    for _ in 0..70 {
        bigs.extend(away.put(&[&big]).expect("put"));
    }
    assert!(segments() >= 2, "{} segments", segments());
    let before = segments();
    away.release(keys[1]);
    let first = keys[0] >> 44;
    for k in bigs.iter().filter(|k| *k >> 44 == first) {
        away.release(*k);
    }
    bigs.retain(|k| *k >> 44 != first);
    assert_eq!(segments(), before - 1, "the first segment went");
    assert_eq!(away.get(keys[1]).expect("get"), None);
    let kept = bigs[0];
    assert_eq!(
        away.get(kept)
            .expect("get")
            .expect("still there")
            .body
            .len(),
        1 << 20
    );
    // Many small records, read in order (one read serves many) and backwards.
    let smalls: Vec<Message> = (0..2000)
        .map(|i| Message {
            body: bytes::Bytes::from(format!("job {i}")),
            ..m("")
        })
        .collect();
    let refs: Vec<&Message> = smalls.iter().collect();
    let keys = away.put(&refs[..1000]).expect("put");
    let more = away.put(&refs[1000..]).expect("put");
    for (k, want) in keys.iter().chain(&more).zip(&smalls) {
        assert_eq!(away.get(*k).expect("get").expect("there").body, want.body);
    }
    for (k, want) in keys.iter().zip(&smalls).rev() {
        assert_eq!(away.get(*k).expect("get").expect("there").body, want.body);
    }
    // Everything released: no segment is left, the one being written included.
    for k in keys.iter().chain(&more).chain(&bigs) {
        away.release(*k);
    }
    assert_eq!(away.held(), 0);
    assert_eq!(segments(), 0, "a drained store leaves no file");
    let again = away.put(&[&a]).expect("put after");
    assert_eq!(
        away.get(again[0]).expect("get").map(|m| m.body),
        Some(a.body.clone())
    );
    drop(away);
    let away = crate::AwayFiles::open(&away_dir).expect("reopen");
    assert_eq!(segments(), 0, "a new start begins empty");
    assert_eq!(away.get(kept).expect("get"), None);
}

#[test]
fn contents_written_by_threads_at_once_read_back_whole_while_writes_are_under_way() {
    // Writes run outside the segments' lock, several at once: a read ahead must stop before a
    // place given out and not written yet, or it would keep its zeros and serve them later as
    // a record.
    use std::sync::mpsc;
    use warren_broker::AwayStore;
    let dir = tempfile::tempdir().expect("tempdir");
    let away = std::sync::Arc::new(crate::AwayFiles::open(&dir.path().join("away")).expect("open"));
    let (tx, rx) = mpsc::channel::<(u64, String)>();
    let writers: Vec<_> = (0..2)
        .map(|w| {
            let (away, tx) = (away.clone(), tx.clone());
            std::thread::spawn(move || {
                for batch in 0..200 {
                    // Batches of different sizes, some large enough to take a while.
                    let bodies: Vec<String> = (0..1 + (batch * 7 + w * 13) % 90)
                        .map(|i| format!("w{w}-b{batch}-m{i}-{}", "x".repeat((i * 37) % 700)))
                        .collect();
                    let messages: Vec<Message> = bodies
                        .iter()
                        .map(|b| Message {
                            body: bytes::Bytes::from(b.clone()),
                            ..msg("", true)
                        })
                        .collect();
                    let refs: Vec<&Message> = messages.iter().collect();
                    let keys = away.put(&refs).expect("put");
                    for (k, b) in keys.into_iter().zip(bodies) {
                        tx.send((k, b)).expect("send");
                    }
                }
            })
        })
        .collect();
    drop(tx);
    let mut read = 0;
    for (key, body) in rx {
        let got = away.get(key).expect("get").expect("there");
        assert_eq!(got.body, bytes::Bytes::from(body));
        read += 1;
    }
    for w in writers {
        w.join().expect("writer");
    }
    assert!(read > 5_000, "{read} read");
}

#[test]
fn a_spilled_run_keeps_its_messages_segments_until_it_goes_and_reads_back_whole() {
    // A run of packed messages written out of memory (`Payload::spill`) holds its messages'
    // segments, not a handle of each: their segments stay while only the run holds them, the
    // handles made when it is read back release as any others, and the last segment goes once
    // the run and every handle have.
    use warren_broker::{AwayStore, AwayStoreHandle, Payload};
    let dir = tempfile::tempdir().expect("tempdir");
    let away_dir = dir.path().join("away");
    let segments = || std::fs::read_dir(&away_dir).map(|d| d.count()).unwrap_or(0);
    let away = std::sync::Arc::new(crate::AwayFiles::open(&away_dir).expect("open"));
    let handle = AwayStoreHandle::from(away.clone());
    // Messages of 1 MiB, so that the run spans two segments (64 MiB each).
    let body = |i: usize| {
        let mut b = vec![(i % 251) as u8; 1 << 20];
        b[..8].copy_from_slice(&(i as u64).to_be_bytes());
        bytes::Bytes::from(b)
    };
    let n = 100;
    let stubs: Vec<Message> = (0..n)
        .map(|i| {
            let m = Message {
                body: body(i),
                ..msg("", true)
            };
            let key = away.put(&[&m]).expect("put")[0];
            m.away_stub(key, &handle)
        })
        .collect();
    assert!(segments() >= 2, "{} segments", segments());
    let packed: Vec<_> = stubs.iter().map(|m| m.pack().expect("packs")).collect();
    let spilled = Message::spill(b"the machine's part".to_vec(), packed).expect("spilled");
    drop(stubs);
    assert_eq!(away.held(), n as u64, "the run holds every message");
    let files = segments();
    assert!(files >= 2, "the run keeps its segments: {files}");
    // Read back twice: each time a handle of each message, whose contents read whole.
    for _ in 0..2 {
        let (meta, items) = Message::unspill(&spilled);
        assert_eq!(meta, b"the machine's part");
        for (i, p) in items.iter().enumerate() {
            let m = Message::unpack(p);
            assert_eq!(m.loaded().expect("read").body, body(i));
        }
        assert_eq!(away.held(), 2 * n as u64);
        drop(items);
        assert_eq!(away.held(), n as u64);
        assert_eq!(segments(), files);
    }
    // One handle outlives the run: its segment stays, the others go.
    let (_, mut items) = Message::unspill(&spilled);
    let last = items.pop().expect("one");
    drop(items);
    drop(spilled);
    assert_eq!(away.held(), 1);
    assert_eq!(
        Message::unpack(&last).loaded().expect("read").body,
        body(n - 1)
    );
    assert!(
        segments() < files,
        "{} of {files} segments left",
        segments()
    );
    drop(last);
    assert_eq!(away.held(), 0);
    assert_eq!(
        segments(),
        0,
        "nothing left once the run and every handle went"
    );
}
