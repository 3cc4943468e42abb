//! Maintenance mode on a 3-node cluster (`warren ctl drain` / `revive`, RabbitMQ's
//! `rabbitmq-upgrade drain` / `revive`): the drained node closes its clients with RabbitMQ's
//! text and takes no new one, hands every queue it leads to the other nodes with nothing
//! lost, gets no new leader, and serves again once revived.

use std::process::Command;
use std::time::{Duration, Instant};

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Confirmation};
use serde_json::Value;
use warren_conformance::cluster::{node_number, TestCluster};
use warren_conformance::http::Api;
use warren_conformance::{unique, warren_binary, WAIT};

const MESSAGES: u64 = 200;

fn node_name(c: &TestCluster, n: u64) -> String {
    let (_, v) = Api::of(c.node(n)).call("GET", "/overview", None);
    v["node"].as_str().expect("a node name").to_owned()
}

/// Node `asked`'s view of node `n` (`/api/nodes/{name}`).
fn node_seen(c: &TestCluster, asked: u64, name: &str) -> Value {
    Api::of(c.node(asked))
        .call("GET", &format!("/nodes/{name}"), None)
        .1
}

fn eventually(what: &str, mut f: impl FnMut() -> Result<(), String>) {
    let start = Instant::now();
    loop {
        match f() {
            Ok(()) => return,
            Err(e) if start.elapsed() > WAIT => panic!("{what}: {e}"),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

async fn declare(ch: &lapin::Channel, name: &str, balanced: bool) {
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    if balanced {
        args.insert(
            "x-queue-leader-locator".into(),
            AMQPValue::LongString("balanced".into()),
        );
    }
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    ch.queue_declare(name.into(), durable, args)
        .await
        .expect("declare a quorum queue");
}

fn ctl(c: &TestCluster, n: u64, verb: &str) -> std::process::Output {
    if verb == "revive" {
        c.ctl(n, &[verb])
    } else {
        c.ctl(n, &[verb, "--wait", "20"])
    }
}

/// `warren ctl cluster_status --format json` against node `n`'s API.
fn cluster_status(c: &TestCluster, n: u64) -> Value {
    let out = c.ctl(n, &["cluster_status", "--format", "json"]);
    assert!(
        out.status.success(),
        "cluster_status: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_node_hands_its_queues_over_closes_its_clients_and_serves_again_revived() {
    let c = TestCluster::start(3, 20);
    let queues: Vec<String> = (0..3).map(|i| unique(&format!("drain{i}"))).collect();
    let conn = c.node(1).connect().await;
    let ch = conn.create_channel().await.expect("channel");
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirm.select");
    for q in &queues {
        declare(&ch, q, false).await;
        let mut confirms = Vec::new();
        for i in 0..MESSAGES {
            let body = format!("{q} {i}");
            let props = BasicProperties::default().with_delivery_mode(2);
            let p = ch
                .basic_publish(
                    "".into(),
                    q.as_str().into(),
                    BasicPublishOptions::default(),
                    body.as_bytes(),
                    props,
                )
                .await
                .expect("publish");
            confirms.push(p);
        }
        for p in confirms {
            let got = tokio::time::timeout(WAIT, p)
                .await
                .expect("a confirm")
                .expect("confirm");
            assert!(matches!(got, Confirmation::Ack(_)), "{got:?}");
        }
    }
    // The node drained leads a queue (declared on node 1, led there unless an election
    // raced the declaring node's campaign).
    let d = c.leader_of(&queues[0], 1);
    let (o1, o2) = (d % 3 + 1, (d + 1) % 3 + 1);
    let mut client = c.node(d).raw().await;
    let drained = node_name(&c, d);
    assert_eq!(node_seen(&c, o1, &drained)["being_drained"], false);

    // Drained by the CLI against its API: it returns once the node leads nothing.
    let out = ctl(&c, d, "drain");
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "drain: {said}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(said.contains("leads no queue"), "{said}");
    client
        .expect_connection_close(
            320,
            "CONNECTION_FORCED - Node was put into maintenance mode",
            0,
            0,
        )
        .await;
    // No new client: the connection ends before any handshake.
    let refused = tokio::time::timeout(
        WAIT,
        lapin::Connection::connect(c.node(d).url(), lapin::ConnectionProperties::default()),
    )
    .await
    .expect("an answer");
    assert!(refused.is_err(), "a drained node took a client");
    for q in &queues {
        let leader = c.leader_of(q, o1);
        assert_ne!(leader, d, "{q} still led by the drained node");
    }
    let seen = node_seen(&c, d, &drained);
    assert_eq!(seen["being_drained"], true);
    assert_eq!(seen["cluster"]["queues_led"], 0);
    // How long it has been drained, for an alert on a node left in maintenance mode.
    let maintenance = |n: u64| -> Option<u64> {
        let url = c.node(n).metrics_url().expect("metrics on");
        let text =
            warren_conformance::http::request("GET", &format!("{url}/metrics"), None, &[], None)
                .text();
        text.lines()
            .find_map(|l| l.strip_prefix("warren_node_maintenance_seconds "))
            .and_then(|v| v.trim().parse().ok())
    };
    assert_eq!(maintenance(o1), Some(0), "a node not drained");
    assert!(
        maintenance(d).is_some(),
        "the drained node's maintenance time"
    );
    eventually("another node sees it drained", || {
        match node_seen(&c, o1, &drained)["being_drained"].as_bool() {
            Some(true) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    });
    // `warren ctl cluster_status` on another node (RabbitMQ's `rabbitmqctl cluster_status`):
    // every node runs, the drained one is under maintenance, each one's listeners are listed
    // (another node's as it shares them, every two seconds).
    let mut status = Value::Null;
    eventually("every node's listeners in cluster_status", || {
        status = cluster_status(&c, o1);
        match status["listeners"].as_object().map(|l| l.len()) {
            Some(3) => Ok(()),
            other => Err(format!("{other:?}: {status}")),
        }
    });
    assert_eq!(
        status["disk_nodes"].as_array().map(Vec::len),
        Some(3),
        "{status}"
    );
    assert_eq!(
        status["running_nodes"].as_array().map(Vec::len),
        Some(3),
        "{status}"
    );
    assert_eq!(
        status["maintenance_status"][&drained], "under maintenance",
        "{status}"
    );
    assert_eq!(
        status["maintenance_status"][node_name(&c, o2)],
        "not under maintenance",
        "{status}"
    );
    let amqp_port = |n: u64| {
        status["listeners"][node_name(&c, n)]
            .as_array()
            .and_then(|l| l.iter().find(|x| x["protocol"] == "amqp"))
            .and_then(|x| x["port"].as_u64())
    };
    for n in 1..=3 {
        let url = c.node(n).url();
        let port = url.rsplit(':').next().and_then(|p| p.split('/').next());
        assert_eq!(
            amqp_port(n).map(|p| p.to_string()).as_deref(),
            port,
            "node {n}'s AMQP listener: {status}"
        );
    }
    assert_eq!(status["feature_level"], 12, "{status}");

    // Everything confirmed is there, on the new leaders; new queues are led elsewhere.
    let conn2 = c.node(o1).connect().await;
    let ch2 = conn2.create_channel().await.expect("channel");
    for q in &queues {
        let passive = QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let mut count = 0;
        eventually("the queue's count on its new leader", || {
            let api = Api::of(c.node(o1));
            let (_, v) = api.call("GET", &format!("/queues/%2f/{q}"), None);
            count = v["messages"].as_u64().unwrap_or(0);
            if count == MESSAGES {
                Ok(())
            } else {
                Err(format!("{count} of {MESSAGES}"))
            }
        });
        let ok = ch2
            .queue_declare(q.as_str().into(), passive, FieldTable::default())
            .await
            .expect("passive declare");
        assert_eq!(u64::from(ok.message_count()), MESSAGES, "{q}");
    }
    for i in 0..4 {
        let q = unique(&format!("placed{i}"));
        declare(&ch2, &q, true).await;
        let leader = c.leader_of(&q, o2);
        assert_ne!(leader, d, "a new leader placed on the drained node");
    }

    eventually(
        "the drained node's maintenance time counts",
        || match maintenance(d) {
            Some(s) if s >= 1 => Ok(()),
            other => Err(format!("warren_node_maintenance_seconds {other:?}")),
        },
    );

    // Revived: the node takes clients again and says so to the others.
    let out = ctl(&c, d, "revive");
    assert!(
        out.status.success(),
        "revive: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let back = c.node(d).connect().await;
    let ch1 = back
        .create_channel()
        .await
        .expect("a channel on the revived node");
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    ch1.queue_declare(queues[0].as_str().into(), passive, FieldTable::default())
        .await
        .expect("the revived node serves");
    eventually("another node sees it revived", || {
        match node_seen(&c, o2, &drained)["being_drained"].as_bool() {
            Some(false) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    });
    assert_eq!(node_number(&drained), Some(d));
    assert_eq!(maintenance(d), Some(0), "a revived node");

    // Every leader is on the other two: a rebalance, asked on another node, evens them out.
    let out = ctl(&c, o1, "rebalance");
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "rebalance: {said}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(said.contains("leaders are even"), "{said}");
    let (_, v) = Api::of(c.node(d)).call("GET", &format!("/nodes/{drained}"), None);
    let led = v["cluster"]["queues_led"].as_u64().unwrap_or(0);
    assert!(
        led >= 2,
        "the revived node leads {led} of 7 after the rebalance: {said}"
    );
}

/// `warren ctl` with `args` against node `n`'s API.
fn ctl_with(c: &TestCluster, n: u64, args: &[&str]) -> std::process::Output {
    let api = c.node(n).http_url().expect("the management API").to_owned();
    let mut cmd = Command::new(warren_binary());
    cmd.arg("ctl").args(args).args(["--api", &api]);
    cmd.output().expect("run warren ctl")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_quorum_critical_check_and_its_wait_answer_from_the_cli() {
    // RabbitMQ's `rabbitmq-queues check_if_node_is_quorum_critical` and `rabbitmq-upgrade
    // await_online_quorum_plus_one`, which rolling-restart scripts run before stopping a node.
    let mut c = TestCluster::start(3, 20);
    let q = unique("critical");
    c.declare_quorum_queue(1, &q).await;
    c.leader_of(&q, 1);
    let check = ["check_if_node_is_quorum_critical"];
    let out = ctl_with(&c, 1, &check);
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{said} {:?}", out);
    assert!(
        said.contains("leaves every quorum queue a majority"),
        "{said}"
    );

    // Node 3 down: stopping node 1 too would leave the queue, and the definitions, one member.
    c.node_mut(3).stop(true);
    let readable = format!("queue '{q}' in vhost '/'");
    eventually("node 1 quorum-critical", || {
        let out = ctl_with(&c, 1, &check);
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        match out.status.code() {
            Some(1) if err.contains(&readable) && err.contains("warren_metadata") => Ok(()),
            code => Err(format!("{code:?}: {err}")),
        }
    });
    let out = ctl_with(&c, 1, &["await_online_quorum_plus_one", "--wait", "0.5"]);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("after 0.5 s") && err.contains(&readable),
        "{err}"
    );

    // Back: the wait returns once node 3 is a running member again.
    c.node_mut(3).start_again();
    let out = ctl_with(&c, 1, &["await_online_quorum_plus_one", "--wait", "60"]);
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{said} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        said.contains("majority of running members without it"),
        "{said}"
    );
    assert!(ctl_with(&c, 1, &check).status.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quorum_status_shows_every_member_from_any_node() {
    // RabbitMQ's `rabbitmq-queues quorum_status`: one row per member, as its node sees it.
    let mut c = TestCluster::start(3, 20);
    let q = unique("status");
    c.declare_quorum_queue(1, &q).await;
    c.leader_of(&q, 1);
    let names: Vec<String> = (1..=3).map(|n| node_name(&c, n)).collect();
    let status = |c: &TestCluster| {
        let out = ctl_with(c, 2, &["quorum_status", &q]);
        let said = String::from_utf8_lossy(&out.stdout).into_owned();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        (out.status.success(), said, err)
    };
    // Every row from its own node (peers' management ports come with their shared figures).
    eventually("every member's row", || {
        let (ok, said, err) = status(&c);
        let rows: Vec<&str> = said.lines().skip(2).collect();
        let leaders = rows.iter().filter(|r| r.contains(" leader ")).count();
        let followers = rows.iter().filter(|r| r.contains(" follower ")).count();
        let voters = rows.iter().filter(|r| r.contains(" voter ")).count();
        let named = names
            .iter()
            .all(|n| rows.iter().any(|r| r.starts_with(n.as_str())));
        if ok && rows.len() == 3 && leaders == 1 && followers == 2 && voters == 3 && named {
            Ok(())
        } else {
            Err(format!("{ok} {said} {err}"))
        }
    });
    let (_, said, _) = status(&c);
    assert!(
        said.starts_with(&format!(
            "Status of quorum queue {q} in vhost / on node {}",
            names[1]
        )),
        "{said}"
    );
    assert!(
        said.contains("Raft State") && said.contains("Commit Index"),
        "{said}"
    );

    // A stopped node's row says so; the others still answer.
    c.node_mut(3).stop(true);
    eventually("node 3 shown as not running", || {
        let (ok, said, err) = status(&c);
        let row3 = said.lines().find(|r| r.starts_with(names[2].as_str()));
        match row3 {
            Some(r) if ok && r.contains("noproc") && said.contains(" leader ") => Ok(()),
            _ => Err(format!("{ok} {said} {err}")),
        }
    });

    // A missing queue is refused, named.
    let out = ctl_with(&c, 1, &["quorum_status", "no-such-queue"]);
    assert!(!out.status.success(), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no-such-queue"),
        "{out:?}"
    );
}
