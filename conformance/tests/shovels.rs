//! Dynamic shovels as RabbitMQ's shovel plugin defines them: declared as `shovel` runtime
//! parameters over the management API (RabbitMQ 3.10's validation texts), reported by
//! `/api/shovels`, carried by definitions, and moving messages with confirmed hand-over
//! between two brokers while either is killed with SIGKILL: every message arrives at least
//! once.

use std::collections::BTreeSet;
use std::time::Duration;

use lapin::options::{BasicGetOptions, BasicPublishOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel};
use serde_json::{json, Value};
use warren_conformance::http::{eventually, Api};
use warren_conformance::queues::{confirm_channel, declare_durable, ready};
use warren_conformance::{unique, within_for, TestBroker};

async fn publish_numbered(ch: &Channel, q: &str, range: std::ops::Range<u32>) {
    let mut confirms = Vec::new();
    for i in range {
        confirms.push(
            ch.basic_publish(
                "".into(),
                q.into(),
                BasicPublishOptions::default(),
                format!("m-{i}").as_bytes(),
                BasicProperties::default()
                    .with_delivery_mode(2)
                    .with_message_id(format!("id-{i}").into()),
            )
            .await
            .expect("publish"),
        );
    }
    for c in confirms {
        assert!(c.await.expect("confirm").is_ack());
    }
}

/// Every body in `q`, taken with acks.
async fn drain(ch: &Channel, q: &str) -> Vec<String> {
    let mut out = Vec::new();
    while let Some(m) = ch
        .basic_get(q.into(), BasicGetOptions { no_ack: true })
        .await
        .expect("get")
    {
        out.push(String::from_utf8_lossy(&m.delivery.data).into_owned());
    }
    out
}

fn status_of(api: &Api, vhost: &str, name: &str) -> Option<Value> {
    let (code, list) = api.call("GET", &format!("/shovels/{vhost}"), None);
    assert_eq!(code, 200, "{list}");
    list.as_array()?.iter().find(|s| s["name"] == name).cloned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_checks_shovels_as_rabbitmq_does_and_reports_them() {
    let broker = TestBroker::start();
    let api = Api::of(&broker);
    let p = unique("shv");
    let refused = |value: Value| {
        let (code, body) = api.call(
            "PUT",
            &format!("/parameters/shovel/%2F/{p}"),
            Some(json!({ "value": value })),
        );
        assert_eq!(code, 400, "{body}");
        body["reason"].as_str().unwrap_or("").to_owned()
    };
    assert_eq!(
        refused(json!({"src-uri": "amqp://", "src-queue": "a"})),
        format!("Validation failed\n\nKey \"dest-uri\" not found in {p}\n")
    );
    assert_eq!(
        refused(json!({"src-uri": "amqp://", "dest-uri": "amqp://"})),
        "Validation failed\n\nMust specify 'src-exchange' or 'src-queue'\n"
    );
    assert_eq!(
        refused(
            json!({"src-uri": "amqp://", "src-queue": "a", "dest-uri": "amqp://",
                       "src-delete-after": 5, "ack-mode": "no-ack"})
        ),
        "Validation failed\n\nCannot specify 'no-ack' and numerical 'delete-after'\n"
    );
    assert_eq!(
        refused(json!({"src-uri": "foo://x", "src-queue": "a", "dest-uri": "amqp://"})),
        "Validation failed\n\n\"foo://x\" not a valid URI: {{unexpected_uri_scheme,\"foo\"},\"foo://x\"}\n"
    );
    let (code, body) = api.call(
        "PUT",
        &format!("/parameters/shovel/%2F/{p}"),
        Some(json!({})),
    );
    assert_eq!(
        (code, body["reason"].as_str()),
        (400, Some("[{key_missing,value}]"))
    );
    let (code, body) = api.call(
        "PUT",
        "/parameters/federation-upstream/%2F/up",
        Some(json!({"value": {"uri": "amqp://"}})),
    );
    assert_eq!(code, 400);
    assert_eq!(
        body["reason"],
        "Validation failed\n\ncomponent federation-upstream not found\n"
    );
    let (code, _) = api.call(
        "PUT",
        &format!("/parameters/shovel/nonesuch/{p}"),
        Some(json!({"value": {}})),
    );
    assert_eq!(code, 404);

    // A shovel from one queue of this broker to another ("amqp://": this node).
    let value = json!({"src-uri": "amqp://", "src-queue": format!("{p}-a"),
                       "dest-uri": "amqp://", "dest-queue": format!("{p}-b")});
    let path = format!("/parameters/shovel/%2F/{p}");
    let (code, _) = api.call("PUT", &path, Some(json!({ "value": value })));
    assert_eq!(code, 201);
    let (code, _) = api.call("PUT", &path, Some(json!({ "value": value })));
    assert_eq!(code, 204, "a second PUT replaces");
    let (code, got) = api.call("GET", &path, None);
    assert_eq!(code, 200);
    assert_eq!(
        got,
        json!({"value": value, "vhost": "/", "component": "shovel", "name": p})
    );
    let running = eventually("the shovel to run", || match status_of(&api, "%2F", &p) {
        Some(s) if s["state"] == "running" => Ok(s),
        other => Err(format!("{other:?}")),
    });
    assert_eq!(running["type"], "dynamic");
    assert_eq!(running["src_queue"], format!("{p}-a"));
    assert_eq!(running["dest_queue"], format!("{p}-b"));
    assert_eq!(running["src_protocol"], "amqp091");
    // It declared both queues (durable) and moves what arrives.
    let conn = broker.connect().await;
    let ch = confirm_channel(&conn).await;
    publish_numbered(&ch, &format!("{p}-a"), 0..20).await;
    within_for(Duration::from_secs(20), "the shovel to move 20", async {
        while ready(&ch, &format!("{p}-b")).await < 20 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert_eq!(ready(&ch, &format!("{p}-a")).await, 0);
    let (code, list) = api.call("GET", "/parameters/shovel", None);
    assert_eq!(code, 200);
    assert!(list
        .as_array()
        .is_some_and(|l| l.iter().any(|x| x["name"] == p)));
    let (code, one) = api.call("GET", &format!("/shovels/vhost/%2F/{p}"), None);
    assert_eq!((code, one["name"].as_str()), (200, Some(p.as_str())));
    let (code, _) = api.call("DELETE", &format!("/shovels/vhost/%2F/{p}/restart"), None);
    assert_eq!(code, 204);
    let (code, _) = api.call("DELETE", "/shovels/vhost/%2F/nonesuch/restart", None);
    assert_eq!(code, 404);

    // Definitions carry it.
    let (_, defs) = api.call("GET", "/definitions", None);
    let exported = defs["parameters"]
        .as_array()
        .and_then(|l| l.iter().find(|x| x["name"] == p).cloned())
        .expect("the shovel is exported");
    assert_eq!(exported["component"], "shovel");
    assert_eq!(exported["value"], value);

    let (code, _) = api.call("DELETE", &path, None);
    assert_eq!(code, 204);
    let (code, _) = api.call("DELETE", &path, None);
    assert_eq!(code, 404);
    eventually("the shovel to stop", || match status_of(&api, "%2F", &p) {
        None => Ok(()),
        Some(s) => Err(s.to_string()),
    });
    // Imported back, it runs again.
    let (code, body) = api.call(
        "POST",
        "/definitions",
        Some(json!({"parameters": [exported]})),
    );
    assert!(code == 200 || code == 201 || code == 204, "{code} {body}");
    eventually("the imported shovel to run", || {
        match status_of(&api, "%2F", &p) {
            Some(s) if s["state"] == "running" => Ok(()),
            other => Err(format!("{other:?}")),
        }
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shovel_with_src_delete_after_moves_what_the_queue_held_then_deletes_itself() {
    let broker = TestBroker::start();
    let api = Api::of(&broker);
    let p = unique("shd");
    let (src, dest) = (format!("{p}-src"), format!("{p}-dest"));
    let conn = broker.connect().await;
    let ch = confirm_channel(&conn).await;
    declare_durable(&ch, &src, FieldTable::default()).await;
    publish_numbered(&ch, &src, 0..50).await;
    api.put(
        &format!("/parameters/shovel/%2F/{p}"),
        json!({"value": {"src-uri": "amqp:///%2F", "src-queue": src, "dest-uri": "amqp://",
                         "dest-queue": dest, "src-delete-after": "queue-length",
                         "dest-add-forward-headers": true}}),
    );
    eventually("the shovel to delete itself", || {
        let (code, _) = api.call("GET", &format!("/parameters/shovel/%2F/{p}"), None);
        if code == 404 {
            Ok(())
        } else {
            Err(format!("still there ({code})"))
        }
    });
    assert_eq!(ready(&ch, &src).await, 0);
    assert_eq!(ready(&ch, &dest).await, 50);
    let m = ch
        .basic_get(dest.as_str().into(), BasicGetOptions { no_ack: true })
        .await
        .expect("get")
        .expect("a message");
    let headers = m.delivery.properties.headers().clone().unwrap_or_default();
    assert!(
        headers.inner().contains_key("x-shovelled"),
        "forward headers: {headers:?}"
    );
    assert_eq!(
        m.delivery
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.as_str()),
        Some("id-0"),
        "properties travel with the message"
    );
}

/// Two brokers; the destination runs a shovel reading the source. The destination is killed
/// with SIGKILL mid-move, then the source is: nothing confirmed at the source is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shovel_between_two_brokers_loses_nothing_when_either_is_killed() {
    const N: u32 = 20_000;
    let mut source = TestBroker::start();
    let mut dest = TestBroker::start();
    let p = unique("shk");
    let (src_q, dest_q) = (format!("{p}-src"), format!("{p}-dest"));
    {
        let conn = source.connect().await;
        let ch = confirm_channel(&conn).await;
        declare_durable(&ch, &src_q, FieldTable::default()).await;
        publish_numbered(&ch, &src_q, 0..N).await;
    }
    Api::of(&dest).put(
        &format!("/parameters/shovel/%2F/{p}"),
        json!({"value": {"src-uri": source.url(), "src-queue": src_q, "dest-uri": "amqp://",
                         "dest-queue": dest_q, "src-prefetch-count": 50,
                         "reconnect-delay": 0.2}}),
    );
    // How many the destination holds once it holds at least `at_least`.
    let moved_some = |b: &TestBroker, at_least: u64| {
        let api = Api::of(b);
        eventually("some messages to be moved", || {
            let (_, q) = api.call("GET", &format!("/queues/%2F/{dest_q}"), None);
            match q["messages"].as_u64() {
                Some(n) if n >= at_least => Ok(n),
                other => Err(format!("{other:?}")),
            }
        })
    };
    let before_kill = moved_some(&dest, 500);
    dest.restart(true);
    let before_second_kill = moved_some(&dest, before_kill + 500);
    source.restart(true);
    eprintln!("killed the destination at {before_kill} moved, the source at {before_second_kill}");
    assert!(
        before_second_kill < u64::from(N),
        "the kills must strike mid-move (make N larger if the machine is faster)"
    );
    // Published while the shovel reconnects: moved too.
    {
        let conn = source.connect().await;
        let ch = confirm_channel(&conn).await;
        publish_numbered(&ch, &src_q, N..N + 100).await;
    }
    // Ready and unacked: a message leaves the source only once the destination has it.
    let api = Api::of(&source);
    eventually("the source to empty", || {
        let (_, q) = api.call("GET", &format!("/queues/%2F/{src_q}"), None);
        match q["messages"].as_u64() {
            Some(0) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    });
    let conn = dest.connect().await;
    let ch = confirm_channel(&conn).await;
    let got: BTreeSet<String> = drain(&ch, &dest_q).await.into_iter().collect();
    let missing: Vec<u32> = (0..N + 100)
        .filter(|i| !got.contains(&format!("m-{i}")))
        .collect();
    assert!(missing.is_empty(), "lost: {missing:?}");
}

/// The other ack modes, a count for `src-delete-after`, and a shovel that writes to another
/// broker (local to remote): `on-publish` and `no-ack` move every message of a quiet source,
/// and a count moves that many and deletes the shovel, leaving the rest at the source.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ack_modes_a_counted_delete_after_and_a_remote_destination() {
    let broker = TestBroker::start();
    if broker.is_external() {
        return;
    }
    let remote = TestBroker::start();
    let api = Api::of(&broker);
    let p = unique("shmodes");
    let conn = broker.connect().await;
    let ch = confirm_channel(&conn).await;
    let remote_conn = remote.connect().await;
    let remote_ch = confirm_channel(&remote_conn).await;
    // The destinations exist before the shovels start, so that their depths can be asked.
    declare_durable(&ch, &format!("{p}-on-publish-dest"), FieldTable::default()).await;
    for q in ["no-ack", "count"] {
        declare_durable(&remote_ch, &format!("{p}-{q}-dest"), FieldTable::default()).await;
    }
    let remote_uri = remote
        .url()
        .rsplit_once('/')
        .map_or(remote.url(), |(base, _)| base)
        .to_owned();
    for (mode, dest_uri) in [("on-publish", "amqp://"), ("no-ack", remote_uri.as_str())] {
        let (src, dest) = (format!("{p}-{mode}-src"), format!("{p}-{mode}-dest"));
        declare_durable(&ch, &src, FieldTable::default()).await;
        publish_numbered(&ch, &src, 0..40).await;
        api.put(
            &format!("/parameters/shovel/%2F/{p}-{mode}"),
            json!({"value": {"src-uri": "amqp://", "src-queue": src, "dest-uri": dest_uri,
                             "dest-queue": dest, "ack-mode": mode}}),
        );
    }
    let (src, dest) = (format!("{p}-count-src"), format!("{p}-count-dest"));
    declare_durable(&ch, &src, FieldTable::default()).await;
    publish_numbered(&ch, &src, 0..30).await;
    api.put(
        &format!("/parameters/shovel/%2F/{p}-count"),
        json!({"value": {"src-uri": "amqp://", "src-queue": src, "dest-uri": remote_uri,
                         "dest-queue": dest, "src-delete-after": 12}}),
    );
    let on_publish = format!("{p}-on-publish-dest");
    let no_ack = format!("{p}-no-ack-dest");
    let counted = format!("{p}-count-dest");
    let start = std::time::Instant::now();
    loop {
        let local = ready(&ch, &on_publish).await;
        let far = (
            ready(&remote_ch, &no_ack).await,
            ready(&remote_ch, &counted).await,
        );
        let (gone, _) = api.call("GET", &format!("/parameters/shovel/%2F/{p}-count"), None);
        if (local, far, gone) == (40, (40, 12), 404) {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "on-publish {local}/40 here, no-ack {}/40 and counted {}/12 there, count's shovel {gone}",
            far.0,
            far.1
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        ready(&ch, &src).await,
        18,
        "the count's rest stays at the source"
    );
    for mode in ["on-publish", "no-ack"] {
        assert_eq!(ready(&ch, &format!("{p}-{mode}-src")).await, 0);
        let status = status_of(&api, "%2F", &format!("{p}-{mode}")).expect("listed");
        assert_eq!(status["state"], "running", "{status}");
    }
    assert_eq!(
        drain(&remote_ch, &counted).await.len(),
        12,
        "the first twelve, once each"
    );
}
