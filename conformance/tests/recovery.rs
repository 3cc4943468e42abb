//! Start-up: the broker accepts connections and completes their handshake while it is still
//! bringing queues back from disk, and a client's first queue command waits until that is over
//! (so it never sees a queue half restored).

use std::time::{Duration, Instant};

use warren_conformance::raw::frame::AMQPFrame;
use warren_conformance::raw::protocol::{queue, AMQPClass};
use warren_conformance::raw::{encode, m, QueueFlags, Raw};
use warren_conformance::{unique, TestBroker};

async fn ready(raw: &mut Raw, name: &str) -> u32 {
    let passive = QueueFlags {
        passive: true,
        ..QueueFlags::default()
    };
    match raw.call(1, m::queue_declare(name, passive)).await {
        AMQPClass::Queue(queue::AMQPMethod::DeclareOk(ok)) => ok.message_count,
        other => panic!("expected queue.declare-ok, got {other:?}"),
    }
}

#[tokio::test]
async fn connections_are_served_while_queues_are_recovered() {
    // 40 ms before each of 50 queues: recovery takes at least 2 s.
    let mut broker = TestBroker::start_with(&["--test-recovery-step-ms", "40"]);
    if broker.is_external() {
        eprintln!("SKIPPED: restarts the spawned broker");
        return;
    }
    const QUEUES: u32 = 50;
    const PER_QUEUE: u32 = 20;
    let prefix = unique("recovering");
    {
        let mut raw = broker.raw().await;
        raw.channel_open(1).await;
        let durable = QueueFlags {
            durable: true,
            nowait: true,
            ..QueueFlags::default()
        };
        let mut batch = Vec::new();
        for q in 0..QUEUES {
            let name = format!("{prefix}-{q}");
            batch.extend(encode(&AMQPFrame::Method(
                1,
                m::queue_declare(&name, durable),
            )));
            for i in 0..PER_QUEUE {
                let props =
                    warren_conformance::raw::AMQPProperties::default().with_delivery_mode(2);
                let body = format!("{q}-{i}");
                batch.extend(raw.encode_publish(1, "", &name, false, props, body.as_bytes()));
            }
        }
        raw.send_bytes(&batch).await;
        let last = format!("{prefix}-{}", QUEUES - 1);
        while ready(&mut raw, &last).await < PER_QUEUE {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    // A clean stop writes everything; the restart recovers 50 queues, slowly.
    broker.restart(false);
    let started = Instant::now();
    let mut raw = broker.raw().await;
    let handshake = started.elapsed();
    assert!(
        !broker.output().contains("recovered durable state"),
        "the handshake waited for recovery ({handshake:?})"
    );
    assert!(
        handshake < Duration::from_secs(1),
        "handshake took {handshake:?}"
    );
    // The first queue command waits for the end of recovery, and sees every message.
    raw.channel_open(1).await;
    for q in [0, QUEUES - 1] {
        assert_eq!(
            ready(&mut raw, &format!("{prefix}-{q}")).await,
            PER_QUEUE,
            "queue {q}"
        );
    }
    assert!(broker.output().contains("recovered durable state"));
    assert!(started.elapsed() >= Duration::from_millis(40 * u64::from(QUEUES)));
}

/// The management API while the store brings queues back after a crash: until then store
/// keys, shared-body counts and message ids are not restored, so a change would reuse them
/// (a message published then took the key of another queue's confirmed message). Every
/// route that reaches the broker answers 503, with a reason, until recovery is over; then
/// the same calls work and nothing stored was touched.
#[tokio::test]
async fn the_management_api_waits_for_recovery_and_corrupts_nothing() {
    use lapin::options::{
        BasicGetOptions, BasicPublishOptions, ExchangeDeclareOptions, QueueBindOptions,
    };
    use lapin::types::FieldTable;
    use lapin::{BasicProperties, ExchangeKind};
    use serde_json::json;
    use warren_conformance::http::{eventually, request};
    use warren_conformance::queues::{confirm_channel, declare_durable};

    // 25 queues, 120 ms before each: the API calls below come well inside recovery.
    let mut broker = TestBroker::start_with(&["--test-recovery-step-ms", "120"]);
    if broker.is_external() {
        eprintln!("SKIPPED: restarts the spawned broker");
        return;
    }
    const GUEST: Option<(&str, &str)> = Some(("guest", "guest"));
    let p = unique("api-recovery");
    let (a, b, c, z, fan) = (
        format!("{p}-a"),
        format!("{p}-b"),
        format!("{p}-c"),
        format!("{p}-z"),
        format!("{p}-fan"),
    );
    let persistent = || BasicProperties::default().with_delivery_mode(2);
    {
        let conn = broker.connect().await;
        let ch = confirm_channel(&conn).await;
        for q in [&a, &b, &c] {
            declare_durable(&ch, q, FieldTable::default()).await;
        }
        for i in 0..22 {
            declare_durable(&ch, &format!("{p}-more-{i}"), FieldTable::default()).await;
        }
        let durable = ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        };
        ch.exchange_declare(
            fan.as_str().into(),
            ExchangeKind::Fanout,
            durable,
            FieldTable::default(),
        )
        .await
        .unwrap();
        for q in [&b, &c] {
            ch.queue_bind(
                q.as_str().into(),
                fan.as_str().into(),
                "".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        }
        for (x, key, body) in [("", a.as_str(), "a-own"), (fan.as_str(), "", "fanned")] {
            let confirm = ch
                .basic_publish(
                    x.into(),
                    key.into(),
                    BasicPublishOptions::default(),
                    body.as_bytes(),
                    persistent(),
                )
                .await
                .unwrap()
                .await
                .unwrap();
            assert!(confirm.is_ack(), "{confirm:?}");
        }
    }
    broker.restart(true);

    let api = format!("{}/api", broker.http_url().expect("management API on"));
    let publish_z = json!({
        "routing_key": z, "payload": "z-msg", "payload_encoding": "string",
        "properties": {"delivery_mode": 2},
    })
    .to_string();
    let get_one = r#"{"count":1,"ackmode":"ack_requeue_false","encoding":"auto"}"#;
    let calls = [
        ("GET", format!("{api}/definitions"), None),
        (
            "PUT",
            format!("{api}/queues/%2f/{z}"),
            Some(r#"{"durable":true}"#.to_string()),
        ),
        (
            "POST",
            format!("{api}/exchanges/%2f/amq.default/publish"),
            Some(publish_z.clone()),
        ),
        (
            "POST",
            format!("{api}/queues/%2f/{b}/get"),
            Some(get_one.to_string()),
        ),
        ("DELETE", format!("{api}/queues/%2f/{c}/contents"), None),
        ("DELETE", format!("{api}/queues/%2f/{p}-more-0"), None),
        ("DELETE", format!("{api}/exchanges/%2f/{fan}"), None),
        (
            "POST",
            format!("{api}/definitions"),
            Some(r#"{"queues":[]}"#.to_string()),
        ),
        ("GET", format!("{api}/queues"), None),
        ("GET", format!("{api}/overview"), None),
        ("GET", format!("{api}/whoami"), None),
        ("GET", format!("{api}/health/checks/alarms"), None),
        (
            "GET",
            format!("{}/metrics", broker.metrics_url().expect("metrics on")),
            None,
        ),
        ("GET", format!("{}/", broker.http_url().unwrap()), None),
    ];
    // All at once: each waits a moment for the end of recovery before it is refused.
    let answers: Vec<_> = std::thread::scope(|s| {
        let running: Vec<_> = calls
            .iter()
            .map(|(method, url, body)| {
                s.spawn(move || {
                    let r = request(method, url, GUEST, &[], body.as_deref());
                    (format!("{method} {url}"), r)
                })
            })
            .collect();
        running.into_iter().map(|t| t.join().unwrap()).collect()
    });
    assert!(
        !broker.output().contains("recovered durable state"),
        "recovery ended before the API calls were made (a very slow machine?): the test \
         proves nothing"
    );
    let (page, rest) = answers.split_last().unwrap();
    let (metrics, rest) = rest.split_last().unwrap();
    let (health, rest) = rest.split_last().unwrap();
    for (call, r) in rest {
        assert_eq!(r.status, 503, "{call} during recovery: {}", r.text());
        let body = r.json();
        assert_eq!(body["error"], "service_unavailable", "{call}: {body}");
        let reason = body["reason"].as_str().unwrap_or_default();
        assert!(reason.contains("recovering"), "{call}: {body}");
        assert_eq!(r.header("retry-after"), Some("1"), "{call}");
    }
    assert_eq!(health.1.status, 503, "{}", health.1.text());
    assert_eq!(health.1.json()["status"], "failed");
    assert_eq!(metrics.1.status, 503, "{}", metrics.1.text());
    assert_eq!(
        page.1.status, 200,
        "the web page is served while the node starts"
    );

    // The gate opens with the end of recovery; the same changes then work.
    eventually("the API to answer after recovery", || {
        let r = request("GET", &format!("{api}/overview"), GUEST, &[], None);
        (r.status == 200).then_some(()).ok_or(r.status.to_string())
    });
    assert!(broker.output().contains("recovered durable state"));
    let declared = request(
        "PUT",
        &format!("{api}/queues/%2f/{z}"),
        GUEST,
        &[],
        Some(r#"{"durable":true}"#),
    );
    assert_eq!(declared.status, 201, "{}", declared.text());
    let published = request(
        "POST",
        &format!("{api}/exchanges/%2f/amq.default/publish"),
        GUEST,
        &[],
        Some(&publish_z),
    );
    assert_eq!(published.json()["routed"], true, "{}", published.text());
    let got = request(
        "POST",
        &format!("{api}/queues/%2f/{b}/get"),
        GUEST,
        &[],
        Some(get_one),
    );
    assert_eq!(got.json()[0]["payload"], "fanned", "{}", got.text());

    // A clean stop and a start: every queue holds what it should, no more, no less.
    broker.restart(false);
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let mut contents = Vec::new();
    for q in [&a, &b, &c, &z] {
        let mut bodies = Vec::new();
        while let Some(m) = ch
            .basic_get(q.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
        {
            bodies.push(String::from_utf8_lossy(&m.delivery.data).into_owned());
        }
        contents.push(bodies);
    }
    assert_eq!(
        contents,
        [vec!["a-own"], vec![], vec!["fanned"], vec!["z-msg"]],
        "queues a, b, c and z after the restart"
    );
}
