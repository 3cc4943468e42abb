//! The `warren` CLI end to end: each test runs the binary's subcommands against a spawned
//! broker's management API (`WARREN_API`), and checks what they print, their exit codes and
//! what they did to the broker. Against an external broker (`WARREN_TEST_URL`) the API is
//! `WARREN_TEST_HTTP_URL`; the command is always Warren's binary.

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use lapin::{Connection, ConnectionProperties};

use serde_json::Value;
use warren_conformance::queues::ready;
use warren_conformance::{unique, warren_binary, TestBroker, WAIT};

/// What a run of the CLI gave.
struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Run {
    fn ok(self) -> Run {
        assert_eq!(
            self.code, 0,
            "stdout:\n{}\nstderr:\n{}",
            self.stdout, self.stderr
        );
        self
    }

    fn json(&self) -> Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("not JSON ({e}):\n{}", self.stdout))
    }
}

/// Runs `warren ARGS` against the broker's API, with `stdin` as its input.
fn warren_in(b: &TestBroker, args: &[&str], stdin: &str) -> Run {
    let mut child = Command::new(warren_binary())
        .args(args)
        .env("WARREN_API", b.http_url().expect("management API on"))
        .env_remove("WARREN_USER")
        .env_remove("WARREN_PASSWORD")
        .env_remove("WARREN_URL")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run warren");
    if let Some(mut input) = child.stdin.take() {
        input.write_all(stdin.as_bytes()).expect("write stdin");
    }
    let out = child.wait_with_output().expect("warren output");
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn warren(b: &TestBroker, args: &[&str]) -> Run {
    warren_in(b, args, "")
}

fn ready_now(b: &TestBroker, q: &str) -> u32 {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let conn = b.connect().await;
        let ch = conn.create_channel().await.unwrap();
        let n = ready(&ch, q).await;
        let _ = conn.close(200, "".into()).await;
        n
    })
}

#[test]
fn a_queue_is_declared_published_to_listed_peeked_and_purged() {
    let b = TestBroker::start();
    let q = unique("cli-q");
    let made = warren(
        &b,
        &[
            "declare",
            "queue",
            &q,
            "--durable",
            "--argument",
            "x-max-length=10",
        ],
    )
    .ok();
    assert!(made.stdout.contains("declared queue"), "{}", made.stdout);
    let again = warren(
        &b,
        &[
            "declare",
            "queue",
            &q,
            "--durable",
            "--argument",
            "x-max-length=10",
        ],
    )
    .ok();
    assert!(again.stdout.contains("unchanged"), "{}", again.stdout);
    for body in ["one", "two"] {
        let p = warren(
            &b,
            &[
                "publish",
                "--routing-key",
                &q,
                "--body",
                body,
                "--header",
                "n=1",
            ],
        )
        .ok();
        assert_eq!(p.stdout.trim(), "routed: true");
    }
    warren_in(
        &b,
        &[
            "publish",
            "--routing-key",
            &q,
            "--property",
            "delivery_mode=2",
        ],
        "from stdin",
    )
    .ok();
    assert_eq!(ready_now(&b, &q), 3);

    // A table with the queue's row, and the API's JSON with typed arguments.
    let table = warren(&b, &["list", "queues", "--filter", &format!("^{q}$")])
        .ok()
        .stdout;
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 2, "{table}");
    assert!(
        lines[0].starts_with("name") && lines[0].contains("ready"),
        "{table}"
    );
    assert!(
        lines[1].starts_with(&q) && lines[1].contains("classic"),
        "{table}"
    );
    let listed = warren(
        &b,
        &[
            "list",
            "queues",
            "--filter",
            &format!("^{q}$"),
            "--format",
            "json",
        ],
    )
    .ok()
    .json();
    assert_eq!(listed[0]["name"], q.as_str());
    assert_eq!(
        listed[0]["arguments"]["x-max-length"], 10,
        "a number, not \"10\""
    );
    assert_eq!(listed[0]["durable"], true);

    // get peeks by default: the messages stay.
    let peek = warren(&b, &["get", &q, "--count", "3"]).ok().stdout;
    for body in ["one", "two", "from stdin"] {
        assert!(peek.lines().any(|l| l == body), "{peek}");
    }
    assert!(peek.contains("\"n\":1"), "headers shown: {peek}");
    assert_eq!(ready_now(&b, &q), 3);
    let taken = warren(
        &b,
        &[
            "get",
            &q,
            "--ackmode",
            "ack_requeue_false",
            "--format",
            "json",
        ],
    )
    .ok()
    .json();
    assert_eq!(taken.as_array().map(Vec::len), Some(1));
    assert_eq!(ready_now(&b, &q), 2);

    warren(&b, &["purge", &q]).ok();
    assert_eq!(ready_now(&b, &q), 0);
    let unrouted = warren(
        &b,
        &[
            "publish",
            "--routing-key",
            &unique("nowhere"),
            "--body",
            "x",
        ],
    );
    assert_eq!(unrouted.code, 1, "{}", unrouted.stderr);
    assert_eq!(unrouted.stdout.trim(), "routed: false");
    warren(&b, &["delete", "queue", &q, "--if-empty"]).ok();
    let gone = warren(&b, &["purge", &q]);
    assert_eq!(gone.code, 1);
    assert!(
        gone.stderr
            .contains(&format!("queue '{q}' does not exist in vhost '/'")),
        "{}",
        gone.stderr
    );
}

#[test]
fn bindings_are_declared_used_and_deleted() {
    let b = TestBroker::start();
    let (q, x) = (unique("cli-bq"), unique("cli-bx"));
    warren(&b, &["declare", "queue", &q]).ok();
    warren(&b, &["declare", "exchange", &x, "--type", "direct"]).ok();
    let key = "a key/with.odd chars";
    warren(
        &b,
        &[
            "declare",
            "binding",
            "--source",
            &x,
            "--destination",
            &q,
            "--routing-key",
            key,
        ],
    )
    .ok();
    let listed = warren(
        &b,
        &["list", "bindings", "--format", "json", "--filter", &x],
    )
    .ok()
    .json();
    assert!(
        listed
            .as_array()
            .unwrap()
            .iter()
            .any(|v| v["source"] == x.as_str() && v["routing_key"] == key),
        "{listed}"
    );
    let routed = warren(
        &b,
        &[
            "publish",
            "--exchange",
            &x,
            "--routing-key",
            key,
            "--body",
            "hi",
        ],
    )
    .ok();
    assert_eq!(routed.stdout.trim(), "routed: true");
    warren(
        &b,
        &[
            "delete",
            "binding",
            "--source",
            &x,
            "--destination",
            &q,
            "--routing-key",
            key,
        ],
    )
    .ok();
    let not = warren(
        &b,
        &[
            "publish",
            "--exchange",
            &x,
            "--routing-key",
            key,
            "--body",
            "hi",
        ],
    );
    assert_eq!((not.code, not.stdout.trim()), (1, "routed: false"));
    let again = warren(
        &b,
        &[
            "delete",
            "binding",
            "--source",
            &x,
            "--destination",
            &q,
            "--routing-key",
            key,
        ],
    );
    assert_eq!(again.code, 1);
    assert!(
        again.stderr.contains("no binding from exchange"),
        "{}",
        again.stderr
    );
    warren(&b, &["delete", "exchange", &x]).ok();
    warren(&b, &["delete", "queue", &q]).ok();
}

#[test]
fn definitions_are_exported_and_imported_back() {
    let b = TestBroker::start();
    let (q, x) = (unique("cli-dq"), unique("cli-dx"));
    warren(
        &b,
        &[
            "declare",
            "queue",
            &q,
            "--durable",
            "--argument",
            "x-message-ttl=60000",
        ],
    )
    .ok();
    warren(
        &b,
        &["declare", "exchange", &x, "--type", "fanout", "--durable"],
    )
    .ok();
    warren(
        &b,
        &["declare", "binding", "--source", &x, "--destination", &q],
    )
    .ok();
    let file = std::env::temp_dir().join(format!("{}.json", unique("warren-defs")));
    let path = file.to_str().unwrap();
    let out = warren(&b, &["export", path]).ok();
    assert!(out.stderr.contains("exported"), "{}", out.stderr);
    let defs: Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    assert!(defs["queues"]
        .as_array()
        .unwrap()
        .iter()
        .any(|v| v["name"] == q.as_str()));
    warren(&b, &["delete", "exchange", &x]).ok();
    warren(&b, &["delete", "queue", &q]).ok();
    warren(&b, &["import", path]).ok();
    let back = warren(&b, &["list", "queues", "--format", "json", "--filter", &q])
        .ok()
        .json();
    assert_eq!(back[0]["arguments"]["x-message-ttl"], 60000);
    let bound = warren(&b, &["publish", "--exchange", &x, "--body", "again"]).ok();
    assert_eq!(
        bound.stdout.trim(),
        "routed: true",
        "the binding came back too"
    );
    let _ = std::fs::remove_file(&file);
    warren(&b, &["delete", "exchange", &x]).ok();
    warren(&b, &["delete", "queue", &q]).ok();
}

#[test]
fn a_connection_is_closed_by_its_name() {
    let b = TestBroker::start();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let tag = unique("cli-conn");
    let props = ConnectionProperties::default().with_connection_name(tag.as_str().into());
    let conn = rt
        .block_on(Connection::connect(b.url(), props))
        .expect("connect");
    // Ours among any others, by the name it gave; RabbitMQ lists a connection only once its
    // first statistics are out (a few seconds), Warren at once.
    let deadline = Instant::now() + WAIT;
    let name = loop {
        let listed = warren(&b, &["list", "connections", "--format", "json"])
            .ok()
            .json();
        let ours = listed.as_array().unwrap().iter().find_map(|c| {
            (c["client_properties"]["connection_name"] == tag.as_str())
                .then(|| c["name"].as_str().map(str::to_owned))
                .flatten()
        });
        match ours {
            Some(n) => break n,
            None if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(100)),
            None => panic!("our connection is not listed: {listed}"),
        }
    };
    let table = warren(&b, &["list", "connections"]).ok().stdout;
    assert!(table.contains(&name), "{table}");
    warren(&b, &["close", &name, "--reason", "maintenance"]).ok();
    rt.block_on(async {
        while conn.status().connected() && Instant::now() < deadline + WAIT {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    assert!(!conn.status().connected(), "closed");
    let again = warren(&b, &["close", &name]);
    assert_eq!(again.code, 1);
    assert!(again.stderr.contains("does not exist"), "{}", again.stderr);
}

#[test]
fn messages_move_between_queues_with_a_limit() {
    let b = TestBroker::start();
    let (from, to) = (unique("cli-from"), unique("cli-to"));
    for q in [&from, &to] {
        warren(&b, &["declare", "queue", q, "--durable"]).ok();
    }
    for i in 0..10 {
        warren(
            &b,
            &[
                "publish",
                "--routing-key",
                &from,
                "--body",
                &format!("m{i}"),
            ],
        )
        .ok();
    }
    let moved = warren(
        &b,
        &[
            "move",
            "--from",
            &from,
            "--to",
            &to,
            "--limit",
            "4",
            "--url",
            b.url(),
        ],
    )
    .ok();
    assert!(
        moved.stdout.contains("moved 4 message(s)"),
        "{}",
        moved.stdout
    );
    assert!(
        moved.stderr.contains("moved 4/4"),
        "the progress line: {}",
        moved.stderr
    );
    assert_eq!((ready_now(&b, &from), ready_now(&b, &to)), (6, 4));
    // The first four, in order.
    let got = warren(&b, &["get", &to, "--count", "10", "--format", "json"])
        .ok()
        .json();
    let bodies: Vec<&str> = got
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m["payload"].as_str())
        .collect();
    assert_eq!(bodies, ["m0", "m1", "m2", "m3"]);
    let missing = warren(
        &b,
        &[
            "move",
            "--from",
            &from,
            "--to",
            &unique("nope"),
            "--url",
            b.url(),
        ],
    );
    assert_eq!(missing.code, 1);
    assert!(
        missing.stderr.contains("does not exist"),
        "{}",
        missing.stderr
    );
    assert_eq!(ready_now(&b, &from), 6, "nothing moved to a missing queue");
    for q in [&from, &to] {
        warren(&b, &["delete", "queue", q]).ok();
    }
}

#[test]
fn lists_longer_than_a_page_are_listed_whole() {
    let b = TestBroker::start();
    let prefix = unique("cli-page");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let n = 520; // more than one page of 500
    rt.block_on(async {
        let conn = b.connect().await;
        let ch = conn.create_channel().await.unwrap();
        for i in 0..n {
            ch.queue_declare(
                format!("{prefix}-{i:04}").as_str().into(),
                Default::default(),
                Default::default(),
            )
            .await
            .unwrap();
        }
        let _ = conn.close(200, "".into()).await;
    });
    let table = warren(&b, &["list", "queues", "--filter", &format!("^{prefix}-")])
        .ok()
        .stdout;
    assert_eq!(table.lines().count(), n + 1, "a header and every queue");
    assert!(table
        .lines()
        .nth(n)
        .unwrap()
        .starts_with(&format!("{prefix}-0519")));
    rt.block_on(async {
        let conn = b.connect().await;
        let ch = conn.create_channel().await.unwrap();
        for i in 0..n {
            let q = format!("{prefix}-{i:04}");
            ch.queue_delete(q.as_str().into(), Default::default())
                .await
                .unwrap();
        }
        let _ = conn.close(200, "".into()).await;
    });
    let status = warren(&b, &["status"]).ok().stdout;
    assert!(status.contains("queues:"), "{status}");
    assert!(
        status
            .lines()
            .any(|l| l.starts_with("listeners:") && l.contains("amqp")),
        "{status}"
    );
    if !b.is_external() {
        assert!(status.contains("Warren"), "{status}");
    }
}

#[test]
fn errors_say_what_to_do_next() {
    let b = TestBroker::start();
    let denied = warren(&b, &["list", "queues", "--password", "wrong"]);
    assert_eq!(denied.code, 1);
    assert!(
        denied.stderr.contains("--user") && denied.stderr.contains("--password"),
        "{}",
        denied.stderr
    );
    // A port nobody listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let api = format!("http://127.0.0.1:{port}");
    let down = warren(&b, &["status", "--api", &api]);
    assert_eq!(down.code, 1);
    assert!(
        down.stderr
            .contains(&format!("cannot reach the management API at {api}"))
            && down.stderr.contains("pass --api"),
        "{}",
        down.stderr
    );
    let vhost = warren(&b, &["list", "queues", "--vhost", &unique("no-vhost")]);
    assert_eq!(vhost.code, 1);
    assert!(vhost.stderr.contains("vhost 'no-vhost"), "{}", vhost.stderr);
    let usage = warren(
        &b,
        &["declare", "queue", "q", "--argument", "no-equals-sign"],
    );
    assert_eq!(usage.code, 2, "{}", usage.stderr);
    assert!(usage.stderr.contains("KEY=VALUE"), "{}", usage.stderr);
}

/// `warren ctl` does what `rabbitmqctl`'s commands of the same names do, through the API:
/// users (the password from stdin or an argument), tags, vhosts, permissions and topic
/// permissions.
#[test]
fn ctl_manages_users_vhosts_and_permissions_under_rabbitmqctl_names() {
    use warren_conformance::http::request;
    let b = TestBroker::start();
    let api = format!("{}/api", b.http_url().expect("management API on"));
    let user = unique("ctl-u");
    let vhost = unique("ctl-v");
    let logs_in = |password: &str| {
        request(
            "GET",
            &format!("{api}/whoami"),
            Some((&user, password)),
            &[],
            None,
        )
        .status
            == 200
    };
    let tags_of = |json: &Value| -> Option<Value> {
        json.as_array()?
            .iter()
            .find(|u| u["name"] == user.as_str())
            .map(|u| u["tags"].clone())
    };

    // The password from stdin, kept out of the shell's history.
    let r = warren_in(
        &b,
        &["ctl", "add_user", &user, "--tags", "management"],
        "first pw\n",
    )
    .ok();
    assert!(
        r.stdout.contains(&format!("added user '{user}'")),
        "{}",
        r.stdout
    );
    assert!(logs_in("first pw"));
    let again = warren_in(
        &b,
        &["ctl", "add_user", &user, "--tags", "administrator"],
        "x\n",
    );
    assert_eq!(
        again.code, 1,
        "adding an existing user fails: {}",
        again.stdout
    );
    assert!(again.stderr.contains("already exists"), "{}", again.stderr);
    assert!(
        logs_in("first pw"),
        "a refused add_user leaves the password"
    );

    let users = warren(&b, &["ctl", "list_users", "--format", "json"])
        .ok()
        .json();
    assert_eq!(tags_of(&users), Some(serde_json::json!(["management"])));

    // A logged-in user the API refuses gets the API's reason, not a "wrong password".
    let refused = warren(
        &b,
        &[
            "ctl",
            "list_users",
            "--user",
            &user,
            "--password",
            "first pw",
        ],
    );
    assert_eq!(refused.code, 1);
    assert!(
        refused.stderr.contains("Not administrator user"),
        "{}",
        refused.stderr
    );

    warren(&b, &["ctl", "change_password", &user, "second pw"]).ok();
    assert!(logs_in("second pw") && !logs_in("first pw"));
    warren(
        &b,
        &["ctl", "set_user_tags", &user, "monitoring", "policymaker"],
    )
    .ok();
    let users = warren(&b, &["ctl", "list_users", "--format", "json"])
        .ok()
        .json();
    assert_eq!(
        tags_of(&users),
        Some(serde_json::json!(["monitoring", "policymaker"]))
    );
    assert!(logs_in("second pw"), "set_user_tags keeps the password");
    let table = warren(&b, &["ctl", "list_users"]).ok().stdout;
    assert!(
        table
            .lines()
            .any(|l| l.starts_with(&user) && l.contains("monitoring,policymaker")),
        "{table}"
    );

    warren(&b, &["ctl", "add_vhost", &vhost]).ok();
    let kept = warren(&b, &["ctl", "add_vhost", &vhost]).ok();
    assert!(kept.stdout.contains("already exists"), "{}", kept.stdout);
    let vhosts = warren(&b, &["ctl", "list_vhosts", "--format", "json"])
        .ok()
        .json();
    assert!(vhosts
        .as_array()
        .is_some_and(|a| a.iter().any(|v| v["name"] == vhost.as_str())));

    warren(
        &b,
        &[
            "ctl",
            "set_permissions",
            "-p",
            &vhost,
            &user,
            "^c-",
            "^w-",
            "",
        ],
    )
    .ok();
    let perms = warren(
        &b,
        &["ctl", "list_permissions", "-p", &vhost, "--format", "json"],
    )
    .ok()
    .json();
    let mine = perms
        .as_array()
        .and_then(|a| a.iter().find(|p| p["user"] == user.as_str()).cloned());
    assert_eq!(
        mine.map(|p| (
            p["configure"].clone(),
            p["write"].clone(),
            p["read"].clone()
        )),
        Some((
            serde_json::json!("^c-"),
            serde_json::json!("^w-"),
            serde_json::json!("")
        ))
    );
    let by_user = warren(&b, &["ctl", "list_user_permissions", &user])
        .ok()
        .stdout;
    assert!(
        by_user
            .lines()
            .any(|l| l.starts_with(&vhost) && l.contains("^c-")),
        "{by_user}"
    );

    for x in ["amq.topic", "amq.direct"] {
        warren(
            &b,
            &[
                "ctl",
                "set_topic_permissions",
                "-p",
                &vhost,
                &user,
                x,
                "^w\\.",
                "^r\\.",
            ],
        )
        .ok();
    }
    let exchanges = |b: &TestBroker| -> Vec<String> {
        let mut x: Vec<String> = warren(
            b,
            &[
                "ctl",
                "list_user_topic_permissions",
                &user,
                "--format",
                "json",
            ],
        )
        .ok()
        .json()
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| t["exchange"].as_str().map(str::to_owned))
        .collect();
        x.sort();
        x
    };
    assert_eq!(exchanges(&b), ["amq.direct", "amq.topic"]);
    warren(
        &b,
        &[
            "ctl",
            "clear_topic_permissions",
            "-p",
            &vhost,
            &user,
            "amq.topic",
        ],
    )
    .ok();
    assert_eq!(exchanges(&b), ["amq.direct"], "one exchange's cleared");
    let listed = warren(&b, &["ctl", "list_topic_permissions", "-p", &vhost])
        .ok()
        .stdout;
    assert!(
        listed.contains("amq.direct") && listed.contains("^w\\."),
        "{listed}"
    );
    warren(&b, &["ctl", "clear_topic_permissions", "-p", &vhost, &user]).ok();
    assert!(exchanges(&b).is_empty());

    warren(&b, &["ctl", "clear_permissions", "-p", &vhost, &user]).ok();
    let gone = warren(&b, &["ctl", "clear_permissions", "-p", &vhost, &user]);
    assert_eq!(gone.code, 1, "nothing left to clear: {}", gone.stdout);
    warren(&b, &["ctl", "delete_vhost", &vhost]).ok();
    warren(&b, &["ctl", "delete_user", &user]).ok();
    assert!(!logs_in("second pw"));
    let missing = warren(&b, &["ctl", "delete_user", &user]);
    assert_eq!(missing.code, 1);
    assert!(
        missing.stderr.contains("does not exist"),
        "{}",
        missing.stderr
    );
}

/// `set_vhost_limits`, `set_user_limits` and their clear/list companions, under rabbitmqctl's
/// names and JSON arguments.
/// SQS access keys: made for a user (id and secret printed once), listed without the
/// secret, deleted; a missing user or key says what to run.
/// `add_vhost` with `--description`, `--tags` and `--default-queue-type`, and
/// `update_vhost_metadata` (RabbitMQ 3.11's names), which changes what it is given and keeps
/// the rest, and refuses a vhost that does not exist rather than make it.
#[test]
fn ctl_gives_a_vhost_metadata_and_a_default_queue_type() {
    let b = TestBroker::start();
    if b.is_external() {
        // RabbitMQ 3.10 has no default queue type per vhost.
        eprintln!("skipped: needs a vhost default queue type");
        return;
    }
    let v = unique("cli-meta");
    let out = warren(
        &b,
        &[
            "ctl",
            "add_vhost",
            &v,
            "--description",
            "invoices",
            "--tags",
            "eu,prod",
            "--default-queue-type",
            "quorum",
        ],
    )
    .ok();
    assert!(out.stdout.contains("added"), "{}", out.stdout);
    let listed = |b: &TestBroker| {
        let all = warren(b, &["ctl", "list_vhosts", "--format", "json"])
            .ok()
            .json();
        all.as_array()
            .and_then(|l| l.iter().find(|x| x["name"] == v.as_str()).cloned())
            .unwrap_or(Value::Null)
    };
    let got = listed(&b);
    assert_eq!(got["description"], "invoices", "{got}");
    assert_eq!(got["tags"], serde_json::json!(["eu", "prod"]), "{got}");
    assert_eq!(got["default_queue_type"], "quorum", "{got}");
    let table = warren(&b, &["ctl", "list_vhosts"]).ok().stdout;
    assert!(
        table
            .lines()
            .any(|l| l.starts_with(&v) && l.contains("invoices") && l.contains("quorum")),
        "{table}"
    );

    warren(
        &b,
        &[
            "ctl",
            "update_vhost_metadata",
            &v,
            "--default-queue-type",
            "classic",
        ],
    )
    .ok();
    let got = listed(&b);
    assert_eq!(
        (
            &got["description"],
            &got["tags"],
            &got["default_queue_type"]
        ),
        (
            &serde_json::json!("invoices"),
            &serde_json::json!(["eu", "prod"]),
            &serde_json::json!("classic")
        ),
        "{got}"
    );
    let bad = warren(
        &b,
        &[
            "ctl",
            "update_vhost_metadata",
            &v,
            "--default-queue-type",
            "stream",
        ],
    );
    assert_eq!(bad.code, 1, "{}", bad.stdout);
    assert!(bad.stderr.contains("classic or quorum"), "{}", bad.stderr);
    let missing = unique("cli-nowhere");
    let absent = warren(
        &b,
        &[
            "ctl",
            "update_vhost_metadata",
            &missing,
            "--description",
            "x",
        ],
    );
    assert_eq!(absent.code, 1, "{}", absent.stdout);
    assert!(
        absent.stderr.contains("does not exist"),
        "{}",
        absent.stderr
    );
    let vhosts = warren(&b, &["ctl", "list_vhosts", "--format", "json"])
        .ok()
        .json();
    assert!(
        !vhosts.to_string().contains(&missing),
        "update_vhost_metadata made a vhost: {vhosts}"
    );
    let nothing = warren(&b, &["ctl", "update_vhost_metadata", &v]);
    assert_eq!(nothing.code, 2, "{}", nothing.stderr);
    warren(&b, &["ctl", "delete_vhost", &v]).ok();
}

#[test]
fn ctl_manages_sqs_access_keys() {
    let b = TestBroker::start();
    let user = unique("ctl-keys");
    warren_in(&b, &["ctl", "add_user", &user], "pw\n").ok();
    let made = warren(&b, &["ctl", "add_access_key", &user]).ok().stdout;
    let field = |label: &str| {
        made.lines()
            .find_map(|l| l.strip_prefix(label))
            .map(|v| v.trim().to_owned())
            .unwrap_or_else(|| panic!("no {label} in {made}"))
    };
    let id = field("access key id:");
    let secret = field("secret access key:");
    assert!(id.starts_with("WKIA") && secret.len() == 40, "{made}");
    let listed = warren(&b, &["ctl", "list_access_keys", &user, "--format", "json"])
        .ok()
        .json();
    assert_eq!(listed[0]["access_key_id"], id.as_str(), "{listed}");
    assert!(!listed.to_string().contains(&secret), "never the secret");
    let all = warren(&b, &["ctl", "list_access_keys"]).ok().stdout;
    assert!(all.contains(&id) && all.contains(&user), "{all}");
    warren(&b, &["ctl", "delete_access_key", &user, &id]).ok();
    let again = warren(&b, &["ctl", "delete_access_key", &user, &id]);
    assert!(
        again.code != 0 && again.stderr.contains("list_access_keys"),
        "{}",
        again.stderr
    );
    let nobody = warren(&b, &["ctl", "add_access_key", "no-such-user"]);
    assert!(
        nobody.code != 0 && nobody.stderr.contains("list_users"),
        "{}",
        nobody.stderr
    );
}

#[test]
fn ctl_sets_vhost_and_user_limits_as_rabbitmqctl() {
    let b = TestBroker::start();
    let user = unique("ctl-lu");
    let vhost = unique("ctl-lv");
    warren_in(&b, &["ctl", "add_user", &user], "pw\n").ok();
    warren(&b, &["ctl", "add_vhost", &vhost]).ok();

    warren(
        &b,
        &[
            "ctl",
            "set_vhost_limits",
            "-p",
            &vhost,
            r#"{"max-connections": 10, "max-queues": -1}"#,
        ],
    )
    .ok();
    let listed = warren(
        &b,
        &["ctl", "list_vhost_limits", "-p", &vhost, "--format", "json"],
    )
    .ok()
    .json();
    assert_eq!(
        listed,
        serde_json::json!([{"vhost": vhost, "value": {"max-connections": 10, "max-queues": -1}}])
    );
    let global = warren(&b, &["ctl", "list_vhost_limits", "--global"])
        .ok()
        .stdout;
    assert!(
        global
            .lines()
            .any(|l| l.starts_with(&vhost) && l.contains("max-connections")),
        "{global}"
    );
    let bad = warren(
        &b,
        &[
            "ctl",
            "set_vhost_limits",
            "-p",
            &vhost,
            r#"{"max-channels": 1}"#,
        ],
    );
    assert_eq!(bad.code, 2, "{}", bad.stderr);
    assert!(
        bad.stderr.contains("unknown limit 'max-channels'"),
        "{}",
        bad.stderr
    );
    warren(&b, &["ctl", "clear_vhost_limits", "-p", &vhost]).ok();
    let cleared = warren(
        &b,
        &["ctl", "list_vhost_limits", "-p", &vhost, "--format", "json"],
    )
    .ok()
    .json();
    assert_eq!(
        cleared.as_array().map(|a| a
            .iter()
            .all(|e| e["value"].as_object().is_none_or(|o| o.is_empty()))),
        Some(true),
        "{cleared}"
    );

    warren(
        &b,
        &[
            "ctl",
            "set_user_limits",
            &user,
            r#"{"max-connections": 2, "max-channels": 20}"#,
        ],
    )
    .ok();
    warren(&b, &["ctl", "clear_user_limits", &user, "max-connections"]).ok();
    let mine = warren(&b, &["ctl", "list_user_limits", &user, "--format", "json"])
        .ok()
        .json();
    assert_eq!(
        mine,
        serde_json::json!([{"user": user, "value": {"max-channels": 20}}])
    );
    warren(&b, &["ctl", "clear_user_limits", &user, "all"]).ok();
    warren(&b, &["ctl", "delete_user", &user]).ok();
    warren(&b, &["ctl", "delete_vhost", &vhost]).ok();
}

/// `set_policy`, `clear_policy`, `list_policies` and the operator-policy forms, with
/// rabbitmqctl's arguments: the policy acts on a queue declared before it.
#[test]
fn ctl_sets_policies_as_rabbitmqctl() {
    let b = TestBroker::start();
    let q = unique("ctl-pol-q");
    let name = unique("ctl-pol");
    warren(&b, &["declare", "queue", &q]).ok();
    warren(
        &b,
        &[
            "ctl",
            "set_policy",
            "-p",
            "/",
            "--priority",
            "3",
            "--apply-to",
            "queues",
            &name,
            &format!("^{q}$"),
            r#"{"max-length": 2}"#,
        ],
    )
    .ok();
    for body in ["a", "b", "c"] {
        warren(&b, &["publish", "--routing-key", &q, "--body", body]).ok();
    }
    assert_eq!(ready_now(&b, &q), 2);
    let listed = warren(&b, &["ctl", "list_policies", "--format", "json"])
        .ok()
        .json();
    assert_eq!(
        listed
            .as_array()
            .and_then(|a| a.iter().find(|p| p["name"] == name.as_str()).cloned()),
        Some(
            serde_json::json!({"vhost": "/", "name": name, "pattern": format!("^{q}$"),
            "apply-to": "queues", "definition": {"max-length": 2}, "priority": 3})
        )
    );
    let table = warren(&b, &["ctl", "list_policies"]).ok().stdout;
    assert!(
        table
            .lines()
            .any(|l| l.contains(&name) && l.contains("max-length")),
        "{table}"
    );
    let bad = warren(
        &b,
        &["ctl", "set_policy", &name, ".*", r#"{"max-length": "x"}"#],
    );
    assert_ne!(bad.code, 0);
    assert!(
        bad.stderr.contains("is not a valid maximum length"),
        "{}",
        bad.stderr
    );
    let bad = warren(&b, &["ctl", "set_policy", &name, ".*", "max-length=2"]);
    assert_eq!(bad.code, 2, "{}", bad.stderr);

    warren(
        &b,
        &[
            "ctl",
            "set_operator_policy",
            &name,
            &format!("^{q}$"),
            r#"{"max-length": 1}"#,
        ],
    )
    .ok();
    assert_eq!(ready_now(&b, &q), 1);
    let ops = warren(&b, &["ctl", "list_operator_policies", "--format", "json"])
        .ok()
        .json();
    assert!(
        ops.as_array()
            .is_some_and(|a| a.iter().any(|p| p["name"] == name.as_str())),
        "{ops}"
    );
    warren(&b, &["ctl", "clear_operator_policy", &name]).ok();
    warren(&b, &["ctl", "clear_policy", &name]).ok();
    let again = warren(&b, &["ctl", "clear_policy", &name]);
    assert_ne!(again.code, 0);
    for body in ["d", "e"] {
        warren(&b, &["publish", "--routing-key", &q, "--body", body]).ok();
    }
    assert_eq!(ready_now(&b, &q), 3);
}

/// A password typed at a terminal is not echoed: `warren ctl add_user` without a password,
/// on a pseudo-terminal that is its controlling terminal, turns the echo off before it reads
/// the line, and the terminal shows the prompt but never the password.
#[cfg(target_os = "linux")]
#[test]
fn ctl_does_not_echo_a_password_typed_at_a_terminal() {
    use std::io::Read;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    use std::os::unix::process::CommandExt;
    use warren_conformance::http::request;

    let b = TestBroker::start();
    let api = b.http_url().expect("management API on");
    let user = unique("tty-u");
    let (mut master, slave) = {
        let (mut m, mut s) = (-1, -1);
        // SAFETY: openpty writes two descriptors it opened into m and s; both are owned below.
        let rc = unsafe {
            libc::openpty(
                &mut m,
                &mut s,
                std::ptr::null_mut(),
                std::ptr::null(),
                std::ptr::null(),
            )
        };
        assert_eq!(rc, 0, "openpty: {}", std::io::Error::last_os_error());
        // SAFETY: m and s are open descriptors that nothing else owns.
        unsafe { (std::fs::File::from_raw_fd(m), OwnedFd::from_raw_fd(s)) }
    };
    let mut cmd = Command::new(warren_binary());
    cmd.args(["ctl", "add_user", &user, "--tags", "management"])
        .env("WARREN_API", api)
        .env_remove("WARREN_USER")
        .env_remove("WARREN_PASSWORD")
        .env_remove("WARREN_URL")
        .stdin(Stdio::from(slave.try_clone().expect("dup")))
        .stdout(Stdio::from(slave.try_clone().expect("dup")))
        .stderr(Stdio::from(slave));
    // SAFETY: only async-signal-safe calls between fork and exec. The child leads a new
    // session whose controlling terminal is the pseudo-terminal, so it can open /dev/tty.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().expect("run warren on a terminal");
    drop(cmd);

    // Type only once the echo is off, as a person would after the prompt.
    let deadline = Instant::now() + WAIT;
    loop {
        // SAFETY: a zeroed termios is a valid buffer for tcgetattr to fill.
        let mut t: libc::termios = unsafe { std::mem::zeroed() };
        // SAFETY: master is an open terminal descriptor and t a valid termios.
        assert_eq!(unsafe { libc::tcgetattr(master.as_raw_fd(), &mut t) }, 0);
        if t.c_lflag & libc::ECHO == 0 {
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("warren ctl add_user read the password with the terminal's echo on");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    master.write_all(b"typed secret\n").expect("type");
    let status = child.wait().expect("warren exits");
    let mut shown = Vec::new();
    let mut buf = [0u8; 4096];
    // Once the child is gone, reading the master gives what it wrote, then EIO.
    while let Ok(n) = master.read(&mut buf) {
        if n == 0 {
            break;
        }
        shown.extend_from_slice(&buf[..n]);
    }
    let shown = String::from_utf8_lossy(&shown);
    assert!(status.success(), "{status}: {shown}");
    assert!(shown.contains("Password:"), "{shown}");
    assert!(shown.contains(&format!("added user '{user}'")), "{shown}");
    assert!(
        !shown.contains("typed secret"),
        "the password was echoed: {shown}"
    );
    let login = request(
        "GET",
        &format!("{api}/api/whoami"),
        Some((&user, "typed secret")),
        &[],
        None,
    );
    assert_eq!(login.status, 200, "the typed password is the user's");
}
