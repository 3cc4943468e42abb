//! RabbitMQ's own management client, `rabbitmqadmin` (the Python 3 script shipped with
//! RabbitMQ 3.10.8), against the broker: every command it has that Warren's API serves.
//! rabbitmqadmin sends what RabbitMQ accepts and scripts are built on, e.g. `"durable":
//! "true"` as a string and `"count": "1"` for a get.
//!
//! The script comes from `WARREN_RABBITMQADMIN`, else `clients/.deps/rabbitmqadmin/rabbitmqadmin`
//! (scripts/test puts it there), else `rabbitmqadmin` on PATH. Without it the test is skipped,
//! unless `WARREN_TEST_REQUIRE_RABBITMQADMIN` is set (scripts/test sets it once installed).

use std::path::PathBuf;
use std::process::Command;

use futures_lite::StreamExt;
use lapin::options::{BasicConsumeOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use serde_json::Value;
use warren_conformance::http::{eventually, request};
use warren_conformance::{unique, TestBroker};

fn script() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("WARREN_RABBITMQADMIN") {
        return Some(PathBuf::from(p));
    }
    let deps =
        warren_conformance::conformance_dir().join("../clients/.deps/rabbitmqadmin/rabbitmqadmin");
    if deps.is_file() {
        return Some(deps);
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("rabbitmqadmin"))
            .find(|p| p.is_file())
    })
}

struct Admin {
    script: PathBuf,
    host: String,
    port: String,
}

impl Admin {
    /// Runs `rabbitmqadmin ARGS` as guest: (success, stdout, stderr).
    fn run(&self, args: &[&str]) -> (bool, String, String) {
        let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
        let out = Command::new(python)
            .arg(&self.script)
            .args([
                "-H", &self.host, "-P", &self.port, "-u", "guest", "-p", "guest",
            ])
            .args(args)
            .output()
            .expect("run python3 rabbitmqadmin");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// Runs a command that must succeed; its standard output.
    fn ok(&self, args: &[&str]) -> String {
        let (ok, out, err) = self.run(args);
        assert!(ok, "rabbitmqadmin {args:?} failed:\n{out}{err}");
        out
    }

    /// `-f raw_json ARGS`, parsed.
    fn json(&self, args: &[&str]) -> Value {
        let mut all = vec!["-f", "raw_json"];
        all.extend_from_slice(args);
        let out = self.ok(&all);
        serde_json::from_str(out.trim())
            .unwrap_or_else(|e| panic!("rabbitmqadmin {args:?}: not JSON ({e}): {out}"))
    }

    /// The names in a `list` answer.
    fn names(&self, args: &[&str]) -> Vec<String> {
        let listed = self.json(args);
        listed
            .as_array()
            .unwrap_or_else(|| panic!("{args:?}: not a list: {listed}"))
            .iter()
            .filter_map(|o| o["name"].as_str().map(str::to_owned))
            .collect()
    }
}

#[tokio::test]
async fn rabbitmqadmin_manages_the_broker() {
    let Some(script) = script() else {
        assert!(
            std::env::var_os("WARREN_TEST_REQUIRE_RABBITMQADMIN").is_none(),
            "rabbitmqadmin is required (WARREN_TEST_REQUIRE_RABBITMQADMIN is set) but was not \
             found: set WARREN_RABBITMQADMIN or run scripts/test, which installs it"
        );
        eprintln!(
            "SKIPPED: rabbitmqadmin not found (scripts/test installs it into clients/.deps; or \
             set WARREN_RABBITMQADMIN to the script)"
        );
        return;
    };
    let broker = TestBroker::start();
    let http = broker.http_url().expect("management API on").to_owned();
    let (host, port) = http
        .trim_start_matches("http://")
        .rsplit_once(':')
        .expect("host:port");
    let admin = Admin {
        script,
        host: host.into(),
        port: port.into(),
    };
    let p = unique("admin");
    let (q, q2, x, v, u) = (
        format!("{p}-q"),
        format!("{p}-q2"),
        format!("{p}-x"),
        format!("{p}-vhost"),
        format!("{p}-user"),
    );
    let arg = |k: &str, v: &str| format!("{k}={v}");

    // Declarations: rabbitmqadmin sends booleans as strings ("durable": "true").
    let out = admin.ok(&["declare", "queue", &arg("name", &q)]);
    assert!(out.contains("queue declared"), "{out}");
    admin.ok(&[
        "declare",
        "queue",
        &arg("name", &q2),
        "durable=false",
        "auto_delete=false",
        r#"arguments={"x-max-length": 10}"#,
    ]);
    admin.ok(&["declare", "exchange", &arg("name", &x), "type=fanout"]);
    admin.ok(&[
        "declare",
        "binding",
        &arg("source", &x),
        &arg("destination", &q),
        "routing_key=k",
    ]);
    let queues = admin.json(&["list", "queues", "name", "durable", "arguments"]);
    let find = |name: &str| {
        queues
            .as_array()
            .and_then(|a| a.iter().find(|o| o["name"] == name).cloned())
            .unwrap_or_else(|| panic!("{name} not listed: {queues}"))
    };
    assert_eq!(find(&q)["durable"], true);
    assert_eq!(find(&q2)["durable"], false);
    assert_eq!(find(&q2)["arguments"]["x-max-length"], 10);
    let exchanges = admin.json(&["list", "exchanges", "name", "type", "durable"]);
    assert!(
        exchanges.as_array().is_some_and(|a| a
            .iter()
            .any(|e| e["name"] == x.as_str() && e["type"] == "fanout" && e["durable"] == true)),
        "{exchanges}"
    );
    let bindings = admin.json(&["list", "bindings"]);
    assert!(
        bindings.as_array().is_some_and(|a| a
            .iter()
            .any(|b| b["source"] == x.as_str() && b["destination"] == q.as_str())),
        "{bindings}"
    );

    // Publish and get, through an exchange and the default one, in each ack mode.
    let out = admin.ok(&[
        "publish",
        &arg("exchange", &x),
        "routing_key=k",
        "payload=one",
        r#"properties={"delivery_mode": 2}"#,
    ]);
    assert!(out.contains("Message published"), "{out}");
    admin.ok(&["publish", &arg("routing_key", &q), "payload=two"]);
    let out = admin.ok(&["publish", "routing_key=nowhere-at-all", "payload=x"]);
    assert!(out.contains("NOT routed"), "{out}");
    // ack_requeue_true (the default) leaves both; the count comes as the string "2".
    let peeked = admin.json(&["get", &arg("queue", &q), "count=2"]);
    assert_eq!(peeked[0]["payload"], "one", "{peeked}");
    assert_eq!(peeked[1]["payload"], "two", "{peeked}");
    let out = admin.ok(&["get", &arg("queue", &q)]);
    assert!(out.contains("one"), "{out}");
    let taken = admin.json(&["get", &arg("queue", &q), "ackmode=ack_requeue_false"]);
    assert_eq!(taken[0]["payload"], "one", "{taken}");
    assert_eq!(taken[0]["redelivered"], true, "{taken}");
    let rejected = admin.json(&["get", &arg("queue", &q), "ackmode=reject_requeue_false"]);
    assert_eq!(rejected[0]["payload"], "two", "{rejected}");
    admin.ok(&["publish", &arg("routing_key", &q), "payload=three"]);
    admin.ok(&["get", &arg("queue", &q), "ackmode=reject_requeue_true"]);
    let out = admin.ok(&["purge", "queue", &arg("name", &q)]);
    assert!(out.contains("queue purged"), "{out}");
    assert_eq!(
        admin.json(&["get", &arg("queue", &q)]),
        Value::Array(vec![])
    );
    // The metrics see what rabbitmqadmin made.
    admin.ok(&["publish", &arg("routing_key", &q2), "payload=held"]);
    let metrics_url = format!(
        "{}/metrics/per-object",
        broker.metrics_url().expect("metrics on")
    );
    let metrics = request("GET", &metrics_url, None, &[], None).text();
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("rabbitmq_queue_messages_ready{")
                && l.contains(&format!("queue=\"{q2}\""))
                && l.ends_with(" 1")),
        "{q2} with one ready message in the metrics:\n{metrics}"
    );

    // Vhosts, users, permissions.
    admin.ok(&["declare", "vhost", &arg("name", &v)]);
    admin.ok(&[
        "declare",
        "user",
        &arg("name", &u),
        "password=secret",
        "tags=management",
    ]);
    admin.ok(&[
        "declare",
        "permission",
        &arg("vhost", &v),
        &arg("user", &u),
        "configure=.*",
        "write=.*",
        "read=",
    ]);
    assert!(admin.names(&["list", "vhosts"]).contains(&v));
    assert!(admin.names(&["list", "users"]).contains(&u));
    let perms = admin.json(&["list", "permissions"]);
    assert!(
        perms.as_array().is_some_and(|a| a
            .iter()
            .any(|p| p["user"] == u.as_str() && p["vhost"] == v.as_str() && p["read"] == "")),
        "{perms}"
    );
    admin.ok(&["-V", &v, "declare", "queue", &arg("name", &q)]);
    assert_eq!(admin.names(&["-V", &v, "list", "queues"]), vec![q.clone()]);

    // Policies (rabbitmqadmin parses the definition and the priority as JSON).
    let pol = format!("{p}-policy");
    admin.ok(&[
        "declare",
        "policy",
        &arg("name", &pol),
        &arg("pattern", &format!("^{q2}$")),
        r#"definition={"max-length": 1}"#,
        "priority=7",
        "apply-to=queues",
    ]);
    let policies = admin.json(&["list", "policies"]);
    let listed = policies
        .as_array()
        .and_then(|a| a.iter().find(|o| o["name"] == pol.as_str()).cloned())
        .unwrap_or_else(|| panic!("{pol} not listed: {policies}"));
    assert_eq!(listed["priority"], 7, "{listed}");
    assert_eq!(listed["apply-to"], "queues", "{listed}");
    assert_eq!(listed["definition"]["max-length"], 1, "{listed}");
    eventually("the policy to reach the queue", || {
        let queues = admin.json(&["list", "queues", "name", "policy", "messages_ready"]);
        let shown = queues
            .as_array()
            .and_then(|a| a.iter().find(|o| o["name"] == q2.as_str()).cloned())
            .unwrap_or_default();
        (shown["policy"] == pol.as_str())
            .then_some(())
            .ok_or(format!("{shown}"))
    });
    let (ok, out, err) = admin.run(&[
        "declare",
        "policy",
        &arg("name", &pol),
        "pattern=.*",
        r#"definition={"max-length": -1}"#,
    ]);
    assert!(
        !ok && format!("{out}{err}").contains("is not a valid maximum length"),
        "{out}{err}"
    );
    admin.ok(&[
        "declare",
        "operator_policy",
        &arg("name", &pol),
        &arg("pattern", &format!("^{q2}$")),
        r#"definition={"max-length": 5}"#,
    ]);
    assert!(admin.names(&["list", "operator_policies"]).contains(&pol));
    admin.ok(&["delete", "operator_policy", &arg("name", &pol)]);
    admin.ok(&["delete", "policy", &arg("name", &pol)]);
    assert!(!admin.names(&["list", "policies"]).contains(&pol));

    // Every list rabbitmqadmin has, and show overview.
    for what in [
        "connections",
        "channels",
        "consumers",
        "exchanges",
        "queues",
        "bindings",
        "users",
        "vhosts",
        "permissions",
        "nodes",
        "parameters",
        "policies",
        "operator_policies",
        "vhost_limits",
    ] {
        admin.ok(&["list", what]);
    }
    let out = admin.ok(&["show", "overview"]);
    assert!(out.contains("rabbitmq_version"), "{out}");
    let overview = admin.json(&["show", "overview"]);
    assert!(
        overview[0]["object_totals"]["queues"].as_u64() >= Some(3),
        "{overview}"
    );

    // A client's connection, channel and consumer, listed and then closed.
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.queue_declare(
        q.as_str().into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    let mut consumer = ch
        .basic_consume(
            q.as_str().into(),
            "admin-consumer".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let consumers = admin.json(&["list", "consumers"]);
    assert!(
        consumers
            .as_array()
            .is_some_and(|a| a.iter().any(|c| c["consumer_tag"] == "admin-consumer")),
        "{consumers}"
    );
    assert!(!admin.names(&["list", "channels"]).is_empty());
    let names = admin.names(&["list", "connections"]);
    assert_eq!(names.len(), 1, "{names:?}");
    let out = admin.ok(&["close", "connection", &arg("name", &names[0])]);
    assert!(out.contains("connection closed"), "{out}");
    // The client sees its connection closed (320, as RabbitMQ's "Closed via management plugin").
    let ended = warren_conformance::within("the consumer to end", async {
        while let Some(Ok(_)) = consumer.next().await {}
    });
    ended.await;
    eventually("the connection to be gone", || {
        let left = admin.names(&["list", "connections"]);
        left.is_empty().then_some(()).ok_or(format!("{left:?}"))
    });

    // Definitions: export, delete, import brings them back.
    let file = std::env::temp_dir().join(format!("{p}-definitions.json"));
    let file_arg = file.to_string_lossy().into_owned();
    let out = admin.ok(&["export", &file_arg]);
    assert!(out.contains("Exported definitions"), "{out}");
    admin.ok(&[
        "delete",
        "binding",
        &arg("source", &x),
        "destination_type=queue",
        &arg("destination", &q),
        "properties_key=k",
    ]);
    assert!(!admin
        .json(&["list", "bindings"])
        .as_array()
        .is_some_and(|a| a.iter().any(|b| b["source"] == x.as_str())));
    admin.ok(&["delete", "exchange", &arg("name", &x)]);
    admin.ok(&["delete", "queue", &arg("name", &q2)]);
    admin.ok(&["delete", "permission", &arg("vhost", &v), &arg("user", &u)]);
    admin.ok(&["delete", "user", &arg("name", &u)]);
    admin.ok(&["delete", "vhost", &arg("name", &v)]);
    assert!(!admin.names(&["list", "vhosts"]).contains(&v));
    let out = admin.ok(&["import", &file_arg]);
    assert!(out.contains("Uploaded definitions"), "{out}");
    let _ = std::fs::remove_file(&file);
    assert!(admin.names(&["list", "vhosts"]).contains(&v));
    assert!(admin.names(&["list", "users"]).contains(&u));
    assert!(admin.names(&["list", "exchanges"]).contains(&x));
    assert!(admin.names(&["list", "queues"]).contains(&q2));
    assert!(admin
        .json(&["list", "bindings"])
        .as_array()
        .is_some_and(|a| a
            .iter()
            .any(|b| b["source"] == x.as_str() && b["destination"] == q.as_str())));
    // Refusals come back as rabbitmqadmin reports them.
    let (ok, _, err) = admin.run(&["delete", "queue", "name=no-such-queue-anywhere"]);
    assert!(!ok && err.contains("Not found"), "{err}");
    let (ok, _, err) = admin.run(&["declare", "queue", &arg("name", &q), "durable=maybe"]);
    assert!(!ok && err.contains("not_boolean"), "{err}");
}
