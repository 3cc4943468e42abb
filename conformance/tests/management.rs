//! The management HTTP API and the Prometheus endpoint, as RabbitMQ 3.10.8 answers: status
//! codes, error bodies and JSON fields that tools read. Against an external broker
//! (`WARREN_TEST_URL`) the API is `WARREN_TEST_HTTP_URL` (default http://127.0.0.1:15672).

use serde_json::{json, Value};
use warren_conformance::http::{eventually, request};
use warren_conformance::{unique, TestBroker};

const GUEST: Option<(&str, &str)> = Some(("guest", "guest"));

/// Imports `defs` through `POST /api/definitions` on the API at `a`.
fn import(a: &str, defs: &Value) {
    let r = request(
        "POST",
        &format!("{a}/definitions"),
        GUEST,
        &[],
        Some(&defs.to_string()),
    );
    assert!(r.status == 201 || r.status == 204, "{}", r.text());
}

fn api(b: &TestBroker) -> String {
    format!("{}/api", b.http_url().expect("management API on"))
}

#[test]
fn logins_are_checked_as_rabbitmq_does() {
    let b = TestBroker::start();
    let url = format!("{}/overview", api(&b));
    let none = request("GET", &url, None, &[], None);
    assert_eq!(none.status, 401);
    assert_eq!(
        none.header("www-authenticate"),
        Some("Basic realm=\"RabbitMQ Management\"")
    );
    assert!(none.body.is_empty());
    let wrong = request("GET", &url, Some(("guest", "nope")), &[], None);
    assert_eq!(wrong.status, 401);
    assert_eq!(
        wrong.json(),
        json!({"error": "not_authorized", "reason": "Login failed"})
    );
    let ok = request("GET", &url, GUEST, &[], None);
    assert_eq!(ok.status, 200, "{}", ok.text());
    let v = ok.json();
    assert!(v["object_totals"]["queues"].is_u64(), "{v}");
    assert_eq!(
        request("GET", &format!("{}/whoami", api(&b)), GUEST, &[], None).json()["name"],
        "guest"
    );
    let missing = request("GET", &format!("{}/nonexistent", api(&b)), GUEST, &[], None);
    assert_eq!(missing.status, 404);
    assert_eq!(
        missing.json(),
        json!({"error": "Object Not Found", "reason": "Not Found"})
    );
}

#[test]
fn queues_are_declared_published_to_peeked_purged_and_deleted() {
    let b = TestBroker::start();
    let q = unique("http-q");
    let url = format!("{}/queues/%2F/{q}", api(&b));
    let args = r#"{"durable":true,"arguments":{"x-message-ttl":60000}}"#;
    assert_eq!(request("PUT", &url, GUEST, &[], Some(args)).status, 201);
    assert_eq!(request("PUT", &url, GUEST, &[], Some(args)).status, 204);
    let other = request(
        "PUT",
        &url,
        GUEST,
        &[],
        Some(r#"{"durable":true,"arguments":{"x-message-ttl":5000}}"#),
    );
    assert_eq!(other.status, 400);
    assert_eq!(
        other.json()["reason"],
        format!(
            "inequivalent arg 'x-message-ttl' for queue '{q}' in vhost '/': received '5000' but current is '60000'"
        )
    );
    assert_eq!(
        request("PUT", &url, GUEST, &[], Some("{\"durable\":tru")).json(),
        json!({"error": "bad_request", "reason": "not_json"})
    );
    let publish = format!("{}/exchanges/%2F/amq.default/publish", api(&b));
    let body = json!({"properties": {"delivery_mode": 2, "headers": {"h": "v"}},
                      "routing_key": q, "payload": "hello", "payload_encoding": "string"});
    let r = request("POST", &publish, GUEST, &[], Some(&body.to_string()));
    assert_eq!(r.json(), json!({"routed": true}));
    // RabbitMQ shows the count once the queue's stats are next emitted (every 5 s).
    let one = eventually("messages_ready 1", || {
        let one = request("GET", &url, GUEST, &[], None).json();
        (one["messages_ready"] == 1)
            .then_some(one.clone())
            .ok_or(one.to_string())
    });
    assert_eq!(one["durable"], true);
    assert_eq!(one["arguments"], json!({"x-message-ttl": 60000}));
    let get = format!("{url}/get");
    let peek = request(
        "POST",
        &get,
        GUEST,
        &[],
        Some(r#"{"count":5,"ackmode":"ack_requeue_true","encoding":"auto"}"#),
    )
    .json();
    assert_eq!(peek[0]["payload"], "hello", "{peek}");
    assert_eq!(peek[0]["message_count"], 0);
    assert_eq!(peek[0]["properties"]["headers"], json!({"h": "v"}));
    // Peeked, not taken: it is still there, now redelivered.
    let again = request(
        "POST",
        &get,
        GUEST,
        &[],
        Some(r#"{"count":1,"ackmode":"ack_requeue_true","encoding":"base64"}"#),
    )
    .json();
    assert_eq!(again[0]["redelivered"], true);
    assert_eq!(again[0]["payload"], "aGVsbG8=");
    assert_eq!(
        request("POST", &get, GUEST, &[], Some(r#"{"count":1}"#)).json()["reason"],
        "[{key_missing,ackmode},{key_missing,encoding}]"
    );
    assert_eq!(
        request("DELETE", &format!("{url}?if-empty=true"), GUEST, &[], None).status,
        400
    );
    assert_eq!(
        request("DELETE", &format!("{url}/contents"), GUEST, &[], None).status,
        204
    );
    eventually("messages 0 after the purge", || {
        let one = request("GET", &url, GUEST, &[], None).json();
        (one["messages"] == 0).then_some(()).ok_or(one.to_string())
    });
    assert_eq!(request("DELETE", &url, GUEST, &[], None).status, 204);
    assert_eq!(request("DELETE", &url, GUEST, &[], None).status, 404);
    // Reserved names are refused as RabbitMQ refuses them.
    let reserved = request(
        "PUT",
        &format!("{}/queues/%2F/amq.{q}", api(&b)),
        GUEST,
        &[],
        Some("{}"),
    );
    assert_eq!(reserved.status, 401);
    assert_eq!(
        reserved.json(),
        json!({"error": "not_authorised", "reason": "Access refused."})
    );
}

/// Warren's own `POST .../move`: ready messages go to another queue, oldest first, with
/// their properties; at most `count`; a missing target is a 404 and moves nothing.
#[test]
fn messages_move_between_queues() {
    let b = TestBroker::start();
    if b.is_external() {
        return; // RabbitMQ moves messages with a shovel instead
    }
    let a = api(&b);
    let (from, to) = (unique("mv-from"), unique("mv-to"));
    for q in [&from, &to] {
        let r = request(
            "PUT",
            &format!("{a}/queues/%2F/{q}"),
            GUEST,
            &[],
            Some(r#"{"durable":true}"#),
        );
        assert_eq!(r.status, 201);
    }
    for i in 0..3 {
        let body = json!({"properties": {"delivery_mode": 2, "headers": {"n": i}},
                          "routing_key": from, "payload": format!("m{i}"), "payload_encoding": "string"});
        let r = request(
            "POST",
            &format!("{a}/exchanges/%2F/amq.default/publish"),
            GUEST,
            &[],
            Some(&body.to_string()),
        );
        assert_eq!(r.json(), json!({"routed": true}));
    }
    let mv = |body: Value| {
        request(
            "POST",
            &format!("{a}/queues/%2F/{from}/move"),
            GUEST,
            &[],
            Some(&body.to_string()),
        )
    };
    let missing = mv(json!({"destination": "no-such-queue"}));
    assert_eq!(missing.status, 404, "{}", missing.text());
    assert_eq!(
        mv(json!({"destination": to, "count": 2})).json(),
        json!({"moved": 2})
    );
    let take = |q: &str| {
        request(
            "POST",
            &format!("{a}/queues/%2F/{q}/get"),
            GUEST,
            &[],
            Some(r#"{"count":10,"ackmode":"ack_requeue_false","encoding":"auto"}"#),
        )
        .json()
    };
    let moved = take(&to);
    let payloads: Vec<&str> = moved
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["payload"].as_str().unwrap())
        .collect();
    assert_eq!(payloads, ["m0", "m1"], "{moved}");
    // Kept as published, and marked with where it was moved from (a deduplicating target
    // keeps a moved message: docs/task-queues.md).
    assert_eq!(
        moved[1]["properties"]["headers"],
        json!({"n": 1, "x-moved-from": from})
    );
    assert_eq!(moved[1]["properties"]["delivery_mode"], 2);
    let left = take(&from);
    assert_eq!(left.as_array().map(Vec::len), Some(1), "{left}");
    assert_eq!(left[0]["payload"], "m2");
}

#[test]
fn lists_page_sort_and_filter() {
    let b = TestBroker::start();
    let prefix = unique("page");
    for i in 0..5 {
        let url = format!("{}/queues/%2F/{prefix}-{i}", api(&b));
        assert_eq!(request("PUT", &url, GUEST, &[], Some("{}")).status, 201);
    }
    let list = format!(
        "{}/queues/%2F?page=2&page_size=2&name={prefix}&sort=name&sort_reverse=true&columns=name,messages",
        api(&b)
    );
    let expected = json!([{"name": format!("{prefix}-2"), "messages": 0}, {"name": format!("{prefix}-1"), "messages": 0}]);
    // RabbitMQ leaves `messages` out of a new queue's row until its first stats (up to 5 s).
    let v = eventually("a page with message counts", || {
        let v = request("GET", &list, GUEST, &[], None).json();
        (v["items"] == expected)
            .then_some(v.clone())
            .ok_or(v.to_string())
    });
    assert_eq!(v["filtered_count"], 5, "{v}");
    assert_eq!(v["page_count"], 3);
    assert_eq!(v["item_count"], 2);
    let too_big = request(
        "GET",
        &format!("{}/queues?page=1&page_size=501", api(&b)),
        GUEST,
        &[],
        None,
    );
    assert_eq!(
        too_big.json(),
        json!({"error": "invalid_pagination_parameters",
               "reason": "Invalid pagination parameters: page number 1, page size 501"})
    );
    // Leave a shared broker (RabbitMQ) as it was.
    for i in 0..5 {
        let url = format!("{}/queues/%2F/{prefix}-{i}", api(&b));
        request("DELETE", &url, GUEST, &[], None);
    }
}

#[test]
fn bindings_are_created_listed_and_deleted_by_properties_key() {
    let b = TestBroker::start();
    let q = unique("bq");
    let x = unique("bx");
    let a = api(&b);
    assert_eq!(
        request(
            "PUT",
            &format!("{a}/queues/%2F/{q}"),
            GUEST,
            &[],
            Some("{}")
        )
        .status,
        201
    );
    assert_eq!(
        request(
            "PUT",
            &format!("{a}/exchanges/%2F/{x}"),
            GUEST,
            &[],
            Some(r#"{"type":"topic"}"#)
        )
        .status,
        201
    );
    let path = format!("{a}/bindings/%2F/e/{x}/q/{q}");
    let made = request(
        "POST",
        &path,
        GUEST,
        &[],
        Some(r#"{"routing_key":"order.*"}"#),
    );
    assert_eq!(made.status, 201);
    let list = request("GET", &path, GUEST, &[], None).json();
    assert_eq!(list[0]["routing_key"], "order.*", "{list}");
    assert_eq!(list[0]["destination_type"], "queue");
    let key = list[0]["properties_key"].as_str().unwrap().to_string();
    assert_eq!(
        request("DELETE", &format!("{path}/{key}"), GUEST, &[], None).status,
        204
    );
    assert_eq!(request("GET", &path, GUEST, &[], None).json(), json!([]));
    request("DELETE", &format!("{a}/queues/%2F/{q}"), GUEST, &[], None);
    request(
        "DELETE",
        &format!("{a}/exchanges/%2F/{x}"),
        GUEST,
        &[],
        None,
    );
}

#[test]
fn connections_are_listed_and_closed_with_the_reason() {
    let b = TestBroker::start();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let conn = rt.block_on(b.connect());
    // RabbitMQ lists a new connection once its first stats are emitted.
    let name = eventually("one connection", || {
        let list = request("GET", &format!("{}/connections", api(&b)), GUEST, &[], None).json();
        list.as_array()
            .and_then(|l| l.first())
            .and_then(|c| c["name"].as_str())
            .map(str::to_string)
            .ok_or(list.to_string())
    });
    assert!(name.contains(" -> "), "{name}");
    let encoded: String = name
        .bytes()
        .map(|c| match c {
            b' ' => "%20".to_string(),
            b'>' => "%3E".to_string(),
            c => (c as char).to_string(),
        })
        .collect();
    let r = request(
        "DELETE",
        &format!("{}/connections/{encoded}", api(&b)),
        GUEST,
        &[("X-Reason", "maintenance")],
        None,
    );
    assert_eq!(r.status, 204);
    rt.block_on(async {
        let deadline = std::time::Instant::now() + warren_conformance::WAIT;
        while conn.status().connected() && std::time::Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    });
    assert!(!conn.status().connected());
}

#[test]
fn health_checks_and_aliveness() {
    let b = TestBroker::start();
    let a = api(&b);
    for path in [
        "health/checks/alarms",
        "health/checks/virtual-hosts",
        "aliveness-test/%2F",
    ] {
        let r = request("GET", &format!("{a}/{path}"), GUEST, &[], None);
        assert_eq!(
            (r.status, r.json()),
            (200, json!({"status": "ok"})),
            "{path}"
        );
    }
    let port = b.addr().port();
    let up = request(
        "GET",
        &format!("{a}/health/checks/port-listener/{port}"),
        GUEST,
        &[],
        None,
    );
    assert_eq!(up.status, 200);
    let down = request(
        "GET",
        &format!("{a}/health/checks/port-listener/1"),
        GUEST,
        &[],
        None,
    );
    assert_eq!(down.status, 503);
    assert_eq!(down.json()["status"], "failed");
}

/// On a node whose default queue type is quorum, an imported queue keeps the type its
/// definition gives (`type`, which exports now carry), and only a queue whose definition
/// names no type takes the default: an exported classic queue with priorities, imported
/// there, was made a quorum queue, which refuses `x-max-priority`, and the import stopped.
#[test]
fn an_imported_queue_keeps_its_type_on_a_node_whose_default_is_quorum() {
    let b = TestBroker::start_with(&["--default-queue-type", "quorum"]);
    let (prio, plain) = (unique("def-prio"), unique("def-plain"));
    let defs = json!({
        "queues": [
            {"name": prio, "vhost": "/", "durable": true, "auto_delete": false,
             "arguments": {"x-max-priority": 5}, "type": "classic"},
            {"name": plain, "vhost": "/", "durable": true, "auto_delete": false, "arguments": {}},
        ],
    });
    let a = api(&b);
    let r = request(
        "POST",
        &format!("{a}/definitions"),
        GUEST,
        &[],
        Some(&defs.to_string()),
    );
    assert_eq!(r.status, 204, "{}", r.text());
    let out = request("GET", &format!("{a}/definitions"), GUEST, &[], None).json();
    let type_of = |name: &str| {
        out["queues"]
            .as_array()
            .and_then(|l| l.iter().find(|x| x["name"] == name))
            .map(|x| x["type"].clone())
    };
    assert_eq!(type_of(&prio), Some(json!("classic")), "{out}");
    assert_eq!(type_of(&plain), Some(json!("quorum")), "{out}");
}

/// A vhost's metadata (RabbitMQ 3.11): a description, tags and a default queue type, given
/// by `PUT /api/vhosts/V`, replaced by another PUT (which keeps a default it does not name),
/// exported and imported with the definitions. The vhost's default comes before the node's:
/// before, Warren kept no metadata, showed the node's default, and an import dropped the
/// vhost's with a warning. Against RabbitMQ 3.10 (which has no vhost default queue type)
/// the description and tags are checked.
#[test]
fn a_vhosts_metadata_is_kept_and_its_default_queue_type_applies_to_its_queues() {
    let b = TestBroker::start();
    let dqt = !b.is_external();
    let a = api(&b);
    let v = unique("meta-vh");
    let put = |body: Value| {
        request(
            "PUT",
            &format!("{a}/vhosts/{v}"),
            GUEST,
            &[],
            Some(&body.to_string()),
        )
    };
    let get = || request("GET", &format!("{a}/vhosts/{v}"), GUEST, &[], None).json();
    let r =
        put(json!({"description": "invoices", "tags": "eu,prod", "default_queue_type": "quorum"}));
    assert_eq!(r.status, 201, "{}", r.text());
    let got = get();
    assert_eq!(got["description"], "invoices", "{got}");
    assert_eq!(got["tags"], json!(["eu", "prod"]), "{got}");
    assert_eq!(got["metadata"]["description"], "invoices", "{got}");
    if !dqt {
        request("DELETE", &format!("{a}/vhosts/{v}"), GUEST, &[], None);
        return;
    }
    assert_eq!(got["default_queue_type"], "quorum", "{got}");
    assert_eq!(got["metadata"]["default_queue_type"], "quorum", "{got}");
    // A queue declared there without a type is a quorum queue.
    let q = unique("meta-q");
    let r = request(
        "PUT",
        &format!("{a}/queues/{v}/{q}"),
        GUEST,
        &[],
        Some(r#"{"durable": true}"#),
    );
    assert!(r.status == 201 || r.status == 204, "{}", r.text());
    let got_q = request("GET", &format!("{a}/queues/{v}/{q}"), GUEST, &[], None).json();
    assert_eq!(got_q["type"], "quorum", "{got_q}");
    // Another PUT replaces the description and tags; a default it leaves out is kept.
    let r = put(json!({"tags": ["eu"]}));
    assert_eq!(r.status, 204, "{}", r.text());
    let got = get();
    assert_eq!(
        (
            &got["description"],
            &got["tags"],
            &got["default_queue_type"]
        ),
        (&json!(""), &json!(["eu"]), &json!("quorum")),
        "{got}"
    );
    let r = put(json!({"description": "invoices", "default_queue_type": "classic"}));
    assert_eq!(r.status, 204, "{}", r.text());
    assert_eq!(get()["default_queue_type"], "classic");
    // Warren has no streams to make a vhost's default.
    let r = put(json!({"default_queue_type": "stream"}));
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("classic or quorum"), "{}", r.text());
    // The older key, `defaultqueuetype`, which RabbitMQ's web page sent, is taken too.
    put(json!({"description": "invoices", "defaultqueuetype": "quorum"}));
    assert_eq!(get()["default_queue_type"], "quorum");
    // RabbitMQ 3.12's exports say `undefined` for a vhost without a default: it names none,
    // and leaves this one's (quorum, where the node's is classic).
    let r = put(json!({"description": "invoices", "default_queue_type": "undefined"}));
    assert_eq!(r.status, 204, "{}", r.text());
    assert_eq!(get()["default_queue_type"], "quorum");
    put(json!({"description": "invoices", "default_queue_type": "classic"}));
    // Exported as RabbitMQ 3.11 exports it, and imported back after the vhost is gone.
    let out = request("GET", &format!("{a}/definitions"), GUEST, &[], None).json();
    let entry = out["vhosts"]
        .as_array()
        .and_then(|l| l.iter().find(|x| x["name"] == v.as_str()))
        .cloned()
        .unwrap_or(Value::Null);
    assert_eq!(entry["metadata"]["description"], "invoices", "{out}");
    assert_eq!(entry["metadata"]["default_queue_type"], "classic", "{out}");
    let gone = request("DELETE", &format!("{a}/vhosts/{v}"), GUEST, &[], None);
    assert_eq!(gone.status, 204, "{}", gone.text());
    let defs = json!({"vhosts": [{"name": v, "metadata": {"description": "invoices",
        "tags": ["eu"], "default_queue_type": "quorum"}}]});
    import(&a, &defs);
    let got = get();
    assert_eq!(got["default_queue_type"], "quorum", "{got}");
    assert_eq!(got["tags"], json!(["eu"]), "{got}");
    request("DELETE", &format!("{a}/vhosts/{v}"), GUEST, &[], None);
}

/// The cluster's name (RabbitMQ's global parameter `cluster_name`): `PUT /api/cluster-name`
/// sets it, the overview, `/api/global-parameters`, the definitions and the metrics'
/// `rabbitmq_identity_info` show it, and an import takes it (not RabbitMQ's cluster id).
/// Before, it was always the node's name and could not be set.
#[test]
fn the_clusters_name_is_set_shown_exported_and_imported() {
    let b = TestBroker::start();
    if b.is_external() {
        eprintln!("skipped: renames the broker it runs against");
        return;
    }
    let a = api(&b);
    let name =
        || request("GET", &format!("{a}/cluster-name"), GUEST, &[], None).json()["name"].clone();
    let node = request("GET", &format!("{a}/overview"), GUEST, &[], None).json()["node"].clone();
    assert_eq!(name(), node, "a node on its own is named after itself");
    let put = |body: Value| {
        request(
            "PUT",
            &format!("{a}/cluster-name"),
            GUEST,
            &[],
            Some(&body.to_string()),
        )
    };
    assert_eq!(put(json!({"name": "prod-eu"})).status, 204);
    assert_eq!(name(), "prod-eu");
    assert_eq!(put(json!({"name": ""})).status, 400);
    let overview = request("GET", &format!("{a}/overview"), GUEST, &[], None).json();
    assert_eq!(overview["cluster_name"], "prod-eu");
    let globals = request("GET", &format!("{a}/global-parameters"), GUEST, &[], None).json();
    assert_eq!(
        globals,
        json!([{"name": "cluster_name", "value": "prod-eu"}])
    );
    let out = request("GET", &format!("{a}/definitions"), GUEST, &[], None).json();
    assert_eq!(out["global_parameters"], globals);
    // Runtime parameters of vhosts do not list it.
    let params = request("GET", &format!("{a}/parameters"), GUEST, &[], None).json();
    assert!(!params.to_string().contains("prod-eu"), "{params}");
    let metrics = b.metrics_url().expect("metrics on");
    let text = request("GET", &format!("{metrics}/metrics"), None, &[], None).text();
    assert!(
        text.lines().any(|l| l.starts_with("rabbitmq_identity_info")
            && l.contains("rabbitmq_cluster=\"prod-eu\"")),
        "{text}"
    );
    let defs = json!({"global_parameters": [
        {"name": "cluster_name", "value": "imported"},
        {"name": "internal_cluster_id", "value": "rabbitmq-cluster-id-abc"},
    ]});
    import(&a, &defs);
    assert_eq!(name(), "imported");
    let globals = request("GET", &format!("{a}/global-parameters"), GUEST, &[], None).json();
    assert!(
        !globals.to_string().contains("internal_cluster_id"),
        "{globals}"
    );
}

#[test]
fn definitions_export_and_import() {
    let b = TestBroker::start();
    let q = unique("def-q");
    let defs = json!({
        "queues": [{"name": q, "vhost": "/", "durable": true, "auto_delete": false, "arguments": {"x-max-length": 10}}],
        "exchanges": [{"name": format!("{q}-x"), "vhost": "/", "type": "fanout", "durable": true, "auto_delete": false, "internal": false, "arguments": {}}],
        "bindings": [{"source": format!("{q}-x"), "vhost": "/", "destination": q, "destination_type": "queue", "routing_key": "", "arguments": {}}],
    });
    let a = api(&b);
    let r = request(
        "POST",
        &format!("{a}/definitions"),
        GUEST,
        &[],
        Some(&defs.to_string()),
    );
    assert_eq!(r.status, 204, "{}", r.text());
    let out = request("GET", &format!("{a}/definitions"), GUEST, &[], None).json();
    assert!(
        out["queues"]
            .as_array()
            .unwrap()
            .iter()
            .any(|x| x["name"] == q && x["arguments"]["x-max-length"] == 10),
        "{out}"
    );
    assert!(out["bindings"]
        .as_array()
        .unwrap()
        .iter()
        .any(|x| x["destination"] == q));
    assert!(out["users"]
        .as_array()
        .unwrap()
        .iter()
        .any(|u| u["name"] == "guest"));
    request("DELETE", &format!("{a}/queues/%2F/{q}"), GUEST, &[], None);
    request(
        "DELETE",
        &format!("{a}/exchanges/%2F/{q}-x"),
        GUEST,
        &[],
        None,
    );
}

#[test]
fn metrics_use_rabbitmqs_names_and_pass_promtool() {
    let b = TestBroker::start();
    let q = unique("m-q");
    let a = api(&b);
    request(
        "PUT",
        &format!("{a}/queues/%2F/{q}"),
        GUEST,
        &[],
        Some("{}"),
    );
    // One publish with a confirm, for the confirm counters.
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let conn = b.connect().await;
        let ch = conn.create_channel().await.unwrap();
        ch.confirm_select(Default::default()).await.unwrap();
        let confirm = ch
            .basic_publish(
                "".into(),
                q.as_str().into(),
                Default::default(),
                b"x",
                Default::default(),
            )
            .await
            .unwrap();
        assert!(confirm.await.unwrap().is_ack());
    });
    let base = b.metrics_url().expect("metrics on");
    let agg = request("GET", &format!("{base}/metrics"), None, &[], None);
    assert_eq!(agg.status, 200);
    // RabbitMQ 3.10.8 sends `text/plain; version=0.0.4`; Warren adds the `charset=utf-8` that
    // Prometheus's exposition format recommends. Scrapers read the version either way.
    let content_type = agg.header("content-type").unwrap_or_default();
    assert!(
        content_type.starts_with("text/plain; version=0.0.4"),
        "{content_type}"
    );
    if !b.is_external() {
        assert_eq!(content_type, "text/plain; version=0.0.4; charset=utf-8");
    }
    let text = agg.text();
    let mut families = vec![
        "rabbitmq_identity_info",
        "rabbitmq_queue_messages_ready",
        "rabbitmq_global_messages_received_total",
    ];
    if !b.is_external() {
        // Warren's own families: RabbitMQ has no such metrics.
        families.extend([
            "warren_queue_oldest_ready_seconds",
            "warren_store_sync_seconds_bucket",
        ]);
    }
    for family in families {
        assert!(text.contains(family), "{family} missing");
    }
    if !b.is_external() {
        // A fresh Warren has confirmed exactly the one publish above.
        for sample in [
            "rabbitmq_global_messages_confirmed_total 1\n",
            "warren_confirm_latency_seconds_count 1\n",
            "warren_confirm_latency_seconds_bucket{le=\"+Inf\"} 1\n",
        ] {
            assert!(text.contains(sample), "{sample} missing in\n{text}");
        }
    }
    // RabbitMQ's queue metrics follow its stats emission (every 5 s).
    let line = format!("rabbitmq_queue_messages_ready{{vhost=\"/\",queue=\"{q}\"}} 1\n");
    let per = eventually("the queue's per-object metric", || {
        let per = request(
            "GET",
            &format!("{base}/metrics/per-object"),
            None,
            &[],
            None,
        )
        .text();
        per.contains(&line).then_some(per.clone()).ok_or(per)
    });
    request("DELETE", &format!("{a}/queues/%2F/{q}"), GUEST, &[], None);
    // Prometheus's own checker, where the machine has it (Debian's prometheus package). Not
    // against RabbitMQ: 3.10.8's own output fails its lint (erlang_mnesia_*_transactions are
    // counters without the `_total` suffix).
    if b.is_external() {
        return;
    }
    for t in [&text, &per] {
        let Ok(mut child) = std::process::Command::new("promtool")
            .args(["check", "metrics"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
        else {
            // scripts/test installs it and then requires it.
            assert!(
                std::env::var_os("WARREN_TEST_REQUIRE_PROMTOOL").is_none(),
                "promtool is required (WARREN_TEST_REQUIRE_PROMTOOL is set) but cannot be run"
            );
            eprintln!("promtool not installed: skipping its check");
            return;
        };
        use std::io::Write;
        child.stdin.take().unwrap().write_all(t.as_bytes()).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "promtool: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// An API change answers once the store has it on disk; when the disk does not confirm it
/// within the wait, the answer is a 503 that says so, never a success for a change that is
/// only in memory. A slow disk (every batch 3 s late) and a 200 ms wait make the case.
#[test]
fn a_change_the_disk_has_not_confirmed_is_not_reported_done() {
    let b = TestBroker::start_with(&[
        "--test-store-delay-ms",
        "3000",
        "--test-api-write-wait-ms",
        "200",
    ]);
    if b.is_external() {
        eprintln!("SKIPPED: needs the spawned broker's slow-disk test option");
        return;
    }
    // Past start-up (the gate of recovery answers 503 too, for another reason).
    eventually("the API to answer", || {
        let r = request("GET", &format!("{}/overview", api(&b)), GUEST, &[], None);
        (r.status == 200).then_some(()).ok_or(r.status.to_string())
    });
    let q = unique("slow-disk");
    let url = format!("{}/queues/%2f/{q}", api(&b));
    let declared = request("PUT", &url, GUEST, &[], Some(r#"{"durable":true}"#));
    assert_eq!(declared.status, 503, "{}", declared.text());
    let body = declared.json();
    assert_eq!(body["error"], "service_unavailable", "{body}");
    assert!(
        body["reason"]
            .as_str()
            .unwrap_or_default()
            .contains("not yet durable"),
        "{body}"
    );
    // The change is made (in memory): a retry finds it, and answers once it is on disk.
    assert_eq!(request("GET", &url, GUEST, &[], None).status, 200);
    let publish = json!({"routing_key": q, "payload": "x", "payload_encoding": "string",
                         "properties": {"delivery_mode": 2}});
    let published = request(
        "POST",
        &format!("{}/exchanges/%2f/amq.default/publish", api(&b)),
        GUEST,
        &[],
        Some(&publish.to_string()),
    );
    assert_eq!(published.status, 503, "{}", published.text());
}
