//! Limits as RabbitMQ applies them: a vhost's `max-connections` and `max-queues`, a user's
//! `max-connections` and `max-channels` (set through `/api/vhost-limits` and
//! `/api/user-limits`), with RabbitMQ's refusal codes, texts and class/method ids, and the
//! API's own answers. These run against RabbitMQ too (`WARREN_TEST_URL` with
//! `WARREN_TEST_HTTP_URL`); the node-wide limits of Warren's command line and the
//! persistence of limits are Warren's alone.

use std::time::{Duration, Instant};

use amq_protocol::protocol::{connection, AMQPClass};
use serde_json::{json, Value};
use warren_conformance::http::Api;
use warren_conformance::raw::{m, plain_response, Handshake, QueueFlags, Raw};
use warren_conformance::{unique, TestBroker};

/// Opens a connection as `user` to `vhost` and returns it with the broker's answer to
/// connection.open (open-ok, or the connection.close that refuses it).
async fn open(b: &TestBroker, user: &str, vhost: &str) -> (Raw, AMQPClass) {
    let mut raw = Raw::tcp(b.addr()).await;
    let password = if user == "guest" { "guest" } else { "pw" };
    raw.handshake_until_open(&Handshake {
        response: plain_response(user, password),
        vhost: vhost.into(),
        ..Handshake::default()
    })
    .await;
    let (_, reply) = raw.recv_method().await;
    (raw, reply)
}

fn is_open_ok(reply: &AMQPClass) -> bool {
    matches!(
        reply,
        AMQPClass::Connection(connection::AMQPMethod::OpenOk(_))
    )
}

/// The refusal of a connection.open: (code, text, class id, method id).
fn refusal(reply: AMQPClass) -> (u16, String, u16, u16) {
    match reply {
        AMQPClass::Connection(connection::AMQPMethod::Close(c)) => (
            c.reply_code,
            c.reply_text.to_string(),
            c.class_id,
            c.method_id,
        ),
        other => panic!("expected connection.close, got {other:?}"),
    }
}

/// A connection that closed a moment ago may still be counted for a moment (RabbitMQ tracks
/// connections asynchronously): retry an open until it succeeds.
async fn open_eventually(b: &TestBroker, user: &str, vhost: &str) -> Raw {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (raw, reply) = open(b, user, vhost).await;
        if is_open_ok(&reply) {
            return raw;
        }
        assert!(
            Instant::now() < deadline,
            "connection to '{vhost}' as '{user}' still refused: {reply:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn vhost_limits_refuse_connections_and_queues() {
    let b = TestBroker::start();
    let api = Api::of(&b);
    let vhost = unique("lim");
    api.put(&format!("/vhosts/{vhost}"), json!({}));
    api.put(
        &format!("/vhost-limits/{vhost}/max-connections"),
        json!({"value": 1}),
    );
    api.put(
        &format!("/vhost-limits/{vhost}/max-queues"),
        json!({"value": 1}),
    );
    assert_eq!(
        api.call("GET", &format!("/vhost-limits/{vhost}"), None),
        (
            200,
            json!([{"vhost": vhost, "value": {"max-connections": 1, "max-queues": 1}}])
        )
    );
    let (_, all) = api.call("GET", "/vhost-limits", None);
    assert!(
        all.as_array()
            .is_some_and(|a| a.iter().any(|e| e["vhost"] == json!(vhost))),
        "{all}"
    );

    let mut first = open_eventually(&b, "guest", &vhost).await;
    let (_, reply) = open(&b, "guest", &vhost).await;
    assert_eq!(
        refusal(reply),
        (
            530,
            format!(
                "NOT_ALLOWED - access to vhost '{vhost}' refused for user 'guest': connection limit (1) is reached"
            ),
            10,
            40
        )
    );

    first.channel_open(1).await;
    first.declare_queue(1, "q1").await;
    // Declaring a queue that exists is no new queue.
    first.declare_queue(1, "q1").await;
    first
        .send(1, m::queue_declare("q2", QueueFlags::default()))
        .await;
    first
        .expect_channel_close(
            1,
            406,
            &format!(
                "PRECONDITION_FAILED - cannot declare queue 'q2': queue limit in vhost '{vhost}' (1) is reached"
            ),
            50,
            10,
        )
        .await;
    first.channel_open(2).await;
    first
        .send(2, m::queue_declare("", QueueFlags::default()))
        .await;
    let close = first.recv_channel_close(2).await;
    assert!(
        close
            .reply_text
            .as_str()
            .starts_with("PRECONDITION_FAILED - cannot declare queue 'amq.gen-")
            && close
                .reply_text
                .as_str()
                .ends_with(&format!("': queue limit in vhost '{vhost}' (1) is reached")),
        "{close:?}"
    );
    first.close().await;

    // Freed: the next connection opens. 0 allows none; clearing the limit lifts it.
    let again = open_eventually(&b, "guest", &vhost).await;
    again.close().await;
    api.put(
        &format!("/vhost-limits/{vhost}/max-connections"),
        json!({"value": 0}),
    );
    let (_, reply) = open(&b, "guest", &vhost).await;
    assert_eq!(refusal(reply).0, 530);
    let (status, _) = api.call(
        "DELETE",
        &format!("/vhost-limits/{vhost}/max-connections"),
        None,
    );
    assert_eq!(status, 204);
    open_eventually(&b, "guest", &vhost).await.close().await;
    assert_eq!(
        api.call("GET", &format!("/vhost-limits/{vhost}"), None),
        (200, json!([{"vhost": vhost, "value": {"max-queues": 1}}]))
    );
    api.call("DELETE", &format!("/vhosts/{vhost}"), None);
}

#[tokio::test]
async fn user_limits_refuse_connections_and_channels() {
    let b = TestBroker::start();
    let api = Api::of(&b);
    let user = unique("lu");
    api.put(
        &format!("/users/{user}"),
        json!({"password": "pw", "tags": ""}),
    );
    api.put(
        &format!("/permissions/%2F/{user}"),
        json!({"configure": ".*", "write": ".*", "read": ".*"}),
    );
    api.put(
        &format!("/user-limits/{user}/max-connections"),
        json!({"value": 1}),
    );
    api.put(
        &format!("/user-limits/{user}/max-channels"),
        json!({"value": 2}),
    );
    assert_eq!(
        api.call("GET", &format!("/user-limits/{user}"), None),
        (
            200,
            json!([{"user": user, "value": {"max-channels": 2, "max-connections": 1}}])
        )
    );
    let (_, u) = api.call("GET", &format!("/users/{user}"), None);
    assert_eq!(
        u["limits"],
        json!({"max-channels": 2, "max-connections": 1})
    );

    let mut first = open_eventually(&b, &user, "/").await;
    let (_, reply) = open(&b, &user, "/").await;
    assert_eq!(
        refusal(reply),
        (
            530,
            format!(
                "NOT_ALLOWED - connection refused for user '{user}': user connection limit (1) is reached"
            ),
            10,
            40
        )
    );
    // Another user is not held back by this one's limit.
    open_eventually(&b, "guest", "/").await.close().await;

    first.channel_open(1).await;
    first.channel_open(2).await;
    first.send(3, m::channel_open()).await;
    first
        .expect_connection_close(
            530,
            &format!(
                "NOT_ALLOWED - number of channels opened for user '{user}' has reached the maximum allowed user limit of (2)"
            ),
            0,
            0,
        )
        .await;
    api.call("DELETE", &format!("/users/{user}"), None);
}

#[tokio::test]
async fn the_limits_api_answers_as_rabbitmq() {
    let b = TestBroker::start();
    let api = Api::of(&b);
    let vhost = unique("limapi");
    let user = unique("lau");
    api.put(&format!("/vhosts/{vhost}"), json!({}));
    api.put(
        &format!("/users/{user}"),
        json!({"password": "pw", "tags": ""}),
    );
    let bad = |reason: Value| json!({"error": "bad_request", "reason": reason});
    let cases: Vec<(&str, String, Option<Value>, u16, Value)> = vec![
        (
            "PUT",
            format!("/vhost-limits/{vhost}/max-queues"),
            Some(json!({"value": -1})),
            204,
            Value::Null,
        ),
        (
            "PUT",
            format!("/vhost-limits/{vhost}/bogus"),
            Some(json!({"value": 3})),
            400,
            bad(json!(
                "Validation failed\n\nUnrecognised terms [{<<\"bogus\">>,3}] in limits\n"
            )),
        ),
        (
            "PUT",
            format!("/vhost-limits/{vhost}/max-channels"),
            Some(json!({"value": 3})),
            400,
            bad(json!(
                "Validation failed\n\nUnrecognised terms [{<<\"max-channels\">>,3}] in limits\n"
            )),
        ),
        (
            "PUT",
            format!("/vhost-limits/{vhost}/max-queues"),
            Some(json!({"value": "x"})),
            400,
            bad(json!(
                "Validation failed\n\nmax-queues should be a number, actually was <<\"x\">>\n"
            )),
        ),
        (
            "PUT",
            format!("/vhost-limits/{vhost}/max-queues"),
            Some(json!({})),
            400,
            bad(json!("[{key_missing,value}]")),
        ),
        (
            "PUT",
            "/vhost-limits/no-such-vhost/max-queues".to_string(),
            Some(json!({"value": 3})),
            404,
            json!({"error": "not_found", "reason": "vhost_not_found"}),
        ),
        (
            "PUT",
            format!("/user-limits/{user}/max-queues"),
            Some(json!({"value": 3})),
            400,
            bad(json!(
                "Unrecognised terms [{<<\"max-queues\">>,3}] in user-limits"
            )),
        ),
        (
            "PUT",
            format!("/user-limits/{user}/max-channels"),
            Some(json!({"value": 2.5})),
            400,
            bad(json!("max-channels should be a number, actually was 2.5")),
        ),
        (
            "PUT",
            "/user-limits/no-such-user/max-channels".to_string(),
            Some(json!({"value": 3})),
            400,
            bad(json!(["no_such_user", "no-such-user"])),
        ),
        (
            "DELETE",
            format!("/vhost-limits/{vhost}/max-connections"),
            None,
            204,
            Value::Null,
        ),
        ("GET", format!("/user-limits/{user}"), None, 200, json!([])),
        (
            "GET",
            "/vhost-limits/no-such-vhost".to_string(),
            None,
            404,
            json!({"error": "Object Not Found", "reason": "Not Found"}),
        ),
        (
            "GET",
            format!("/vhost-limits/{vhost}"),
            None,
            200,
            json!([{"vhost": vhost, "value": {"max-queues": -1}}]),
        ),
    ];
    for (method, path, body, status, answer) in cases {
        assert_eq!(
            api.call(method, &path, body),
            (status, answer),
            "{method} {path}"
        );
    }
    // A negative limit is no limit.
    let mut raw = open_eventually(&b, "guest", &vhost).await;
    raw.channel_open(1).await;
    raw.declare_queue(1, "a").await;
    raw.declare_queue(1, "b").await;
    raw.close().await;
    api.call("DELETE", &format!("/users/{user}"), None);
    api.call("DELETE", &format!("/vhosts/{vhost}"), None);
}

/// Warren's node-wide limits from the command line: `--connection-max` (RabbitMQ's
/// `connection_max`, refused at connection.open rather than left waiting in the listen
/// backlog), `--consumer-max-per-channel` (RabbitMQ's `consumer_max_per_channel`) and
/// `--consumer-max-per-queue` (Warren's own).
/// RabbitMQ keeps a vhost's limits as the runtime parameter `vhost-limits`/`limits`: the
/// parameters API lists them, and setting or deleting that parameter replaces or clears every
/// limit of the vhost (measured on RabbitMQ 3.10.8).
#[tokio::test]
async fn vhost_limits_are_runtime_parameters_too() {
    let b = TestBroker::start();
    let api = Api::of(&b);
    let vhost = unique("limparam");
    api.put(&format!("/vhosts/{vhost}"), json!({}));
    api.put(
        &format!("/vhost-limits/{vhost}/max-queues"),
        json!({"value": 10}),
    );
    let entry = json!({"component": "vhost-limits", "name": "limits",
                       "value": {"max-queues": 10}, "vhost": vhost});
    let (status, all) = api.call("GET", "/parameters", None);
    assert_eq!(status, 200);
    assert!(all.as_array().is_some_and(|a| a.contains(&entry)), "{all}");
    let (_, listed) = api.call("GET", &format!("/parameters/vhost-limits/{vhost}"), None);
    assert_eq!(listed, json!([entry]));
    let one = format!("/parameters/vhost-limits/{vhost}/limits");
    assert_eq!(api.call("GET", &one, None), (200, entry));
    let (status, _) = api.call("PUT", &one, Some(json!({"value": {"max-connections": 5}})));
    assert_eq!(status, 204);
    let (_, limits) = api.call("GET", &format!("/vhost-limits/{vhost}"), None);
    assert_eq!(
        limits,
        json!([{"vhost": vhost, "value": {"max-connections": 5}}])
    );
    assert_eq!(api.call("DELETE", &one, None).0, 204);
    let (_, limits) = api.call("GET", &format!("/vhost-limits/{vhost}"), None);
    assert_eq!(limits, json!([]));
    assert_eq!(api.call("GET", &one, None).0, 404);
    api.call("DELETE", &format!("/vhosts/{vhost}"), None);
}

#[tokio::test]
async fn node_limits_from_the_command_line() {
    let b = TestBroker::start_with(&[
        "--connection-max",
        "2",
        "--consumer-max-per-channel",
        "2",
        "--consumer-max-per-queue",
        "3",
    ]);
    if b.is_external() {
        return;
    }
    let mut one = open_eventually(&b, "guest", "/").await;
    let two = open_eventually(&b, "guest", "/").await;
    let (_, reply) = open(&b, "guest", "/").await;
    assert_eq!(
        refusal(reply),
        (
            530,
            "NOT_ALLOWED - connection refused: node connection limit (2) is reached".to_string(),
            10,
            40
        )
    );
    two.close().await;

    let q = unique("cq");
    one.channel_open(1).await;
    one.declare_queue(1, &q).await;
    one.call(1, m::basic_consume(&q, "a", false, false)).await;
    one.call(1, m::basic_consume(&q, "b", false, false)).await;
    one.channel_open(2).await;
    one.call(2, m::basic_consume(&q, "c", false, false)).await;
    // The queue has its 3 consumers: the 4th closes only its channel.
    one.send(2, m::basic_consume(&q, "d", false, false)).await;
    one.expect_channel_close(
        2,
        406,
        &format!(
            "PRECONDITION_FAILED - cannot consume from queue '{q}' in vhost '/': consumer limit (3) is reached"
        ),
        60,
        20,
    )
    .await;
    // Channel 1 has its 2: a 3rd on it closes the connection, as RabbitMQ does.
    one.send(1, m::basic_consume(&q, "e", false, false)).await;
    one.expect_connection_close(
        530,
        "NOT_ALLOWED - reached maximum (2) of consumers per channel",
        60,
        20,
    )
    .await;
}

/// Limits are kept on disk with the vhosts and users they belong to, go with them, and
/// travel in definitions (vhost limits as `vhost-limits` parameters, user limits in users).
#[tokio::test]
async fn limits_survive_a_restart_and_travel_in_definitions() {
    let mut b = TestBroker::start();
    if b.is_external() {
        return;
    }
    let api = Api::of(&b);
    api.put("/vhosts/kept", json!({}));
    api.put("/vhosts/gone", json!({}));
    api.put("/vhost-limits/kept/max-queues", json!({"value": 5}));
    api.put("/vhost-limits/gone/max-queues", json!({"value": 5}));
    api.put("/users/app", json!({"password": "pw", "tags": ""}));
    api.put("/user-limits/app/max-channels", json!({"value": 7}));
    api.call("DELETE", "/vhosts/gone", None);
    b.restart(true);
    let api = Api::of(&b);
    assert_eq!(
        api.call("GET", "/vhost-limits", None),
        (200, json!([{"vhost": "kept", "value": {"max-queues": 5}}]))
    );
    assert_eq!(
        api.call("GET", "/user-limits", None),
        (200, json!([{"user": "app", "value": {"max-channels": 7}}]))
    );

    let (_, defs) = api.call("GET", "/definitions", None);
    assert_eq!(
        defs["parameters"],
        json!([{"value": {"max-queues": 5}, "vhost": "kept", "component": "vhost-limits", "name": "limits"}])
    );
    let app = defs["users"]
        .as_array()
        .and_then(|u| u.iter().find(|u| u["name"] == "app"))
        .cloned()
        .expect("app exported");
    assert_eq!(app["limits"], json!({"max-channels": 7}));

    // Into a fresh node: the same limits, and they act.
    let fresh = TestBroker::start();
    let fresh_api = Api::of(&fresh);
    let (status, answer) = fresh_api.call("POST", "/definitions", Some(defs));
    assert!(status == 201 || status == 204, "{status} {answer}");
    assert_eq!(
        fresh_api.call("GET", "/user-limits/app", None),
        (200, json!([{"user": "app", "value": {"max-channels": 7}}]))
    );
    fresh_api.put("/vhost-limits/kept/max-queues", json!({"value": 0}));
    let mut raw = open_eventually(&fresh, "guest", "kept").await;
    raw.channel_open(1).await;
    raw.send(1, m::queue_declare("q", QueueFlags::default()))
        .await;
    let close = raw.recv_channel_close(1).await;
    assert_eq!(close.reply_code, 406, "{close:?}");
}
