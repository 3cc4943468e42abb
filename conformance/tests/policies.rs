//! Policies as RabbitMQ 3.10 has them, set over the management API (`/api/policies`,
//! `/api/operator-policies`) and by a definitions import: they act on queues declared before
//! and after them, operator policies cap, clearing restores a queue's own arguments, and they
//! survive a restart.

use lapin::options::{BasicPublishOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Confirmation};
use serde_json::{json, Value};
use warren_conformance::http::Api;
use warren_conformance::queues::{confirm_channel, dead_letter_queue, ready, wait_ready};
use warren_conformance::{unique, TestBroker};

async fn publish(ch: &Channel, q: &str, body: &[u8]) {
    let confirm = ch
        .basic_publish(
            "".into(),
            q.into(),
            BasicPublishOptions::default(),
            body,
            BasicProperties::default().with_delivery_mode(2),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(matches!(confirm, Confirmation::Ack(_)), "{confirm:?}");
}

async fn declare(ch: &Channel, q: &str) {
    ch.queue_declare(
        q.into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn a_policy_set_over_the_api_limits_and_dead_letters_and_survives_a_restart() {
    let mut broker = TestBroker::start();
    let mut api = Api::of(&broker);
    let p = unique("pol");
    let (q, name, cap) = (format!("{p}-q"), format!("{p}-limit"), format!("{p}-cap"));
    let (dlx, dlq) = {
        let conn = broker.connect().await;
        let ch = confirm_channel(&conn).await;
        dead_letter_queue(&ch, &p, true).await
    };

    // RabbitMQ's refusals, with its texts.
    let (status, body) = api.call(
        "PUT",
        &format!("/policies/%2F/{name}"),
        Some(json!({"pattern": format!("^{p}-q$"), "definition": {"max-length": -1}})),
    );
    assert_eq!(status, 400, "{body}");
    assert_eq!(
        body,
        json!({"error": "bad_request",
               "reason": "Validation failed\n\n-1 is not a valid maximum length\n"})
    );
    let (status, body) = api.call(
        "PUT",
        &format!("/policies/%2F/{name}"),
        Some(json!({"pattern": ".*", "definition": {"max-lenght": 2}})),
    );
    assert_eq!(status, 400, "{body}");
    assert_eq!(
        body["reason"],
        // RabbitMQ 3.10.8 escapes the angle brackets of a policy's (and a parameter's)
        // validation text, not a vhost limit's.
        "Validation failed\n\n[{&lt;&lt;\"max-lenght\"&gt;&gt;,2}] are not recognised policy settings\n"
    );
    let (status, _) = api.call(
        "PUT",
        &format!("/operator-policies/%2F/{cap}"),
        Some(json!({"pattern": ".*", "definition": {"dead-letter-exchange": "x"}})),
    );
    assert_eq!(status, 400);

    // The queue exists before the policy.
    let conn = broker.connect().await;
    let ch = confirm_channel(&conn).await;
    declare(&ch, &q).await;
    for body in [b"a", b"b", b"c", b"d"] {
        publish(&ch, &q, body).await;
    }
    assert_eq!(ready(&ch, &q).await, 4);
    let policy = json!({
        "pattern": format!("^{p}-q$"),
        "definition": {"max-length": 2, "dead-letter-exchange": dlx},
        "priority": 1,
        "apply-to": "queues",
    });
    let (status, body) = api.call(
        "PUT",
        &format!("/policies/%2F/{name}"),
        Some(policy.clone()),
    );
    assert_eq!(status, 201, "{body}");
    let (status, _) = api.call("PUT", &format!("/policies/%2F/{name}"), Some(policy));
    assert_eq!(status, 204);
    // The head over the new limit is dead-lettered at once, without a redeclare.
    wait_ready(&ch, &q, 2).await;
    wait_ready(&ch, &dlq, 2).await;
    publish(&ch, &q, b"e").await;
    wait_ready(&ch, &dlq, 3).await;
    assert_eq!(ready(&ch, &q).await, 2);

    let (_, listed) = api.call("GET", &format!("/policies/%2F/{name}"), None);
    assert_eq!(
        listed,
        json!({"vhost": "/", "name": name, "pattern": format!("^{p}-q$"), "apply-to": "queues",
               "definition": {"dead-letter-exchange": dlx, "max-length": 2}, "priority": 1})
    );
    let (_, all) = api.call("GET", "/policies", None);
    assert!(
        all.as_array()
            .is_some_and(|a| a.iter().any(|x| x["name"] == name.as_str())),
        "{all}"
    );

    // An operator policy caps the user policy.
    let (status, _) = api.call(
        "PUT",
        &format!("/operator-policies/%2F/{cap}"),
        Some(json!({"pattern": format!("^{p}-q$"), "definition": {"max-length": 1}, "apply-to": "queues"})),
    );
    assert_eq!(status, 201);
    wait_ready(&ch, &q, 1).await;
    wait_ready(&ch, &dlq, 4).await;
    let shown = queue_when(&api, &q, |v| v["operator_policy"] == cap.as_str()).await;
    assert_eq!(shown["policy"], name.as_str(), "{shown}");
    assert_eq!(shown["operator_policy"], cap.as_str(), "{shown}");
    assert_eq!(
        shown["effective_policy_definition"],
        json!({"dead-letter-exchange": dlx, "max-length": 1})
    );
    let (_, defs) = api.call("GET", "/definitions", None);
    assert!(
        defs["policies"]
            .as_array()
            .is_some_and(|a| a.iter().any(|x| x["name"] == name.as_str())),
        "{defs}"
    );
    drop(ch);
    drop(conn);

    if !broker.is_external() {
        broker.restart(false);
        api = Api::of(&broker);
        let (_, listed) = api.call("GET", &format!("/policies/%2F/{name}"), None);
        assert_eq!(listed["definition"]["max-length"], 2, "{listed}");
        let (_, op) = api.call("GET", &format!("/operator-policies/%2F/{cap}"), None);
        assert_eq!(op["definition"]["max-length"], 1, "{op}");
        let conn = broker.connect().await;
        let ch = confirm_channel(&conn).await;
        assert_eq!(ready(&ch, &q).await, 1);
        publish(&ch, &q, b"f").await;
        wait_ready(&ch, &dlq, 5).await;
        assert_eq!(ready(&ch, &q).await, 1);
    }

    // Cleared: the queue is back on its own arguments (none).
    let (status, _) = api.call("DELETE", &format!("/operator-policies/%2F/{cap}"), None);
    assert_eq!(status, 204);
    let (status, _) = api.call("DELETE", &format!("/policies/%2F/{name}"), None);
    assert_eq!(status, 204);
    let (status, body) = api.call("DELETE", &format!("/policies/%2F/{name}"), None);
    assert_eq!(status, 404, "{body}");
    let conn = broker.connect().await;
    let ch = confirm_channel(&conn).await;
    let before = ready(&ch, &q).await;
    for body in [b"g", b"h", b"i"] {
        publish(&ch, &q, body).await;
    }
    assert_eq!(ready(&ch, &q).await, before + 3);
    let shown = queue_when(&api, &q, |v| v["policy"].is_null()).await;
    assert_eq!(shown["policy"], Value::Null, "{shown}");
}

#[tokio::test]
async fn policies_in_an_imported_definitions_file_act_on_its_queues() {
    let broker = TestBroker::start();
    let api = Api::of(&broker);
    let p = unique("defpol");
    let q = format!("{p}-q");
    let defs = json!({
        "policies": [{"vhost": "/", "name": format!("{p}-ttl"), "pattern": format!("^{p}"),
                      "apply-to": "queues", "definition": {"max-length": 1}, "priority": 0}],
        "queues": [{"name": q, "vhost": "/", "durable": true, "auto_delete": false, "arguments": {}}],
    });
    let (status, body) = api.call("POST", "/definitions", Some(defs));
    assert_eq!(status, 204, "{body}");
    let conn = broker.connect().await;
    let ch = confirm_channel(&conn).await;
    for body in [b"a", b"b", b"c"] {
        publish(&ch, &q, body).await;
    }
    assert_eq!(ready(&ch, &q).await, 1);
    let (status, _) = api.call("DELETE", &format!("/policies/%2F/{p}-ttl"), None);
    assert_eq!(status, 204);
}

#[tokio::test]
async fn a_policy_with_a_lower_ttl_expires_messages_queued_before_it() {
    let broker = TestBroker::start();
    if broker.is_external() {
        return; // Warren's own: RabbitMQ's lower TTL reaches new messages only
    }
    let api = Api::of(&broker);
    let p = unique("polttl");
    let q = format!("{p}-q");
    let conn = broker.connect().await;
    let ch = confirm_channel(&conn).await;
    let (dlx, dlq) = dead_letter_queue(&ch, &p, false).await;
    declare(&ch, &q).await;
    for body in [b"a", b"b", b"c"] {
        publish(&ch, &q, body).await;
    }
    assert_eq!(ready(&ch, &q).await, 3);
    let (status, body) = api.call(
        "PUT",
        &format!("/policies/%2F/{p}"),
        Some(json!({"pattern": format!("^{q}$"), "apply-to": "queues",
                    "definition": {"message-ttl": 1, "dead-letter-exchange": dlx}})),
    );
    assert_eq!(status, 201, "{body}");
    wait_ready(&ch, &dlq, 3).await;
    assert_eq!(ready(&ch, &q).await, 0);
    let (status, _) = api.call("DELETE", &format!("/policies/%2F/{p}"), None);
    assert_eq!(status, 204);
}

/// A RabbitMQ 3.10 export as it comes: operator policies as `operator_policy` parameters, a
/// look-ahead pattern (`rabbitmqctl set_policy ha '^(?!amq\.).*'` is in many a runbook), and,
/// on Warren only, a policy key of a plugin Warren lacks (left out, the rest kept).
#[tokio::test]
async fn a_rabbitmq_export_with_operator_policies_and_look_ahead_patterns_imports_whole() {
    let broker = TestBroker::start();
    let api = Api::of(&broker);
    let p = unique("rmqexp");
    let (kept, skipped) = (format!("{p}-kept"), format!("{p}-skip.q"));
    let mut policies = vec![json!({"vhost": "/", "name": format!("{p}-len"),
        "pattern": format!("^(?!{p}-skip\\.){p}"), "apply-to": "queues",
        "definition": {"max-length": 1}, "priority": 0})];
    if !broker.is_external() {
        policies.push(
            json!({"vhost": "/", "name": format!("{p}-fed"), "pattern": "^nothing$",
            "apply-to": "all", "definition": {"federation-upstream-set": "all"}, "priority": 0}),
        );
        policies.push(
            json!({"vhost": "/", "name": format!("{p}-mixed"), "pattern": "^nothing$",
            "apply-to": "queues", "definition": {"max-age": "1D", "message-ttl": 5000},
            "priority": 0}),
        );
    }
    let queues: Vec<_> = [&kept, &skipped]
        .iter()
        .map(|q| json!({"name": q, "vhost": "/", "durable": true, "auto_delete": false, "arguments": {}}))
        .collect();
    let defs = json!({
        "parameters": [{"vhost": "/", "component": "operator_policy", "name": format!("{p}-cap"),
            "value": {"pattern": format!("^{p}"), "definition": {"max-length-bytes": 1000000},
                      "priority": 0, "apply-to": "queues"}}],
        "policies": policies,
        "queues": queues,
    });
    let (status, body) = api.call("POST", "/definitions", Some(defs));
    assert_eq!(status, 204, "{body}");
    let conn = broker.connect().await;
    let ch = confirm_channel(&conn).await;
    for q in [&kept, &skipped] {
        for body in [b"a", b"b", b"c"] {
            publish(&ch, q, body).await;
        }
    }
    assert_eq!(ready(&ch, &kept).await, 1, "the look-ahead pattern matches");
    assert_eq!(ready(&ch, &skipped).await, 3, "and excludes what it says");
    let q = queue_when(&api, &kept, |v| v["operator_policy"].is_string()).await;
    assert_eq!(q["operator_policy"], format!("{p}-cap"), "{q}");
    let (_, ops) = api.call("GET", "/operator-policies/%2F", None);
    assert!(
        ops.as_array()
            .is_some_and(|a| a.iter().any(|o| o["name"] == format!("{p}-cap"))),
        "{ops}"
    );
    let (_, params) = api.call("GET", "/parameters/operator_policy", None);
    assert!(
        params.as_array().is_some_and(|a| a
            .iter()
            .any(|x| x["name"] == format!("{p}-cap") && x["value"]["pattern"] == format!("^{p}"))),
        "listed among the runtime parameters, as RabbitMQ keeps them: {params}"
    );
    // ... and served there one by one, set and cleared.
    let (code, one) = api.call(
        "GET",
        &format!("/parameters/operator_policy/%2F/{p}-cap"),
        None,
    );
    assert_eq!(code, 200, "{one}");
    assert_eq!(
        one["value"]["definition"]["max-length-bytes"], 1000000,
        "{one}"
    );
    let path = format!("/parameters/operator_policy/%2F/{p}-cap2");
    let (code, body) = api.call(
        "PUT",
        &path,
        Some(
            json!({"value": {"pattern": "^nothing$", "definition": {"max-length": 5},
                              "apply-to": "queues", "priority": 0}}),
        ),
    );
    assert_eq!(code, 201, "{body}");
    let (_, op) = api.call("GET", &format!("/operator-policies/%2F/{p}-cap2"), None);
    assert_eq!(op["definition"]["max-length"], 5, "{op}");
    let (code, body) = api.call("DELETE", &path, None);
    assert_eq!(code, 204, "{body}");
    let (code, _) = api.call("GET", &format!("/operator-policies/%2F/{p}-cap2"), None);
    assert_eq!(code, 404);
    if !broker.is_external() {
        let (_, fed) = api.call("GET", &format!("/policies/%2F/{p}-fed"), None);
        assert_eq!(
            fed["error"], "Object Not Found",
            "plugin keys only: left out: {fed}"
        );
        let (_, mixed) = api.call("GET", &format!("/policies/%2F/{p}-mixed"), None);
        assert_eq!(
            mixed["definition"],
            json!({"message-ttl": 5000}),
            "the plugin's key left out, the rest kept: {mixed}"
        );
        // The export gives them back as RabbitMQ does, and RabbitMQ's import takes them.
        let (_, out) = api.call("GET", "/definitions", None);
        assert!(out.get("operator_policies").is_none(), "{out}");
        let exported = out["parameters"].as_array().and_then(|a| {
            a.iter()
                .find(|x| x["component"] == "operator_policy" && x["name"] == format!("{p}-cap"))
                .cloned()
        });
        let exported = exported.expect("the operator policy among the parameters");
        assert_eq!(exported["value"]["definition"]["max-length-bytes"], 1000000);
        assert_eq!(exported["vhost"], "/");
    }
    for (kind, name) in [
        ("policies", format!("{p}-len")),
        ("policies", format!("{p}-mixed")),
        ("operator-policies", format!("{p}-cap")),
    ] {
        api.call("DELETE", &format!("/{kind}/%2F/{name}"), None);
    }
}

/// A queue as the API shows it, once `ready` holds of it (or after 15 s): RabbitMQ's
/// statistics, which carry its policies, reach its API some seconds after a change; Warren's
/// at once.
async fn queue_when(api: &Api, q: &str, ready: impl Fn(&Value) -> bool) -> Value {
    let start = std::time::Instant::now();
    loop {
        let (_, shown) = api.call("GET", &format!("/queues/%2F/{q}"), None);
        if ready(&shown) || start.elapsed() > std::time::Duration::from_secs(15) {
            return shown;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}
