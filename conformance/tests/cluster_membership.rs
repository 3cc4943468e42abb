//! Changing a running cluster's nodes: `warren ctl forget_cluster_node` (RabbitMQ's
//! `rabbitmqctl forget_cluster_node`) removes a stopped node from every quorum queue's group,
//! with nothing confirmed lost, and the node cannot come back on its old data; a new node
//! started with `--cluster-join` is added to every group from its leaders' snapshots, so a
//! dead node is replaced.

use std::process::Command;
use std::time::{Duration, Instant};

use futures_lite::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Confirmation};
use warren_conformance::cluster::TestCluster;
use warren_conformance::http::{eventually, Api};
use warren_conformance::{unique, warren_binary, WAIT};

/// `warren ctl forget_cluster_node NODE` against node `n`'s management API.
fn forget(c: &TestCluster, n: u64, node: &str) -> std::process::Output {
    let api = c.node(n).http_url().expect("the management API").to_owned();
    Command::new(warren_binary())
        .args(["ctl", "forget_cluster_node", node, "--api", &api])
        .args(["--wait", "20"])
        .output()
        .expect("run warren ctl")
}

fn text(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The names node `n` lists in `/api/nodes`, in its order.
fn node_names(c: &TestCluster, n: u64) -> Vec<String> {
    let (_, v) = Api::of(c.node(n)).call("GET", "/nodes", None);
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(|n| n["name"].as_str().map(str::to_owned))
        .collect()
}

async fn publish_confirmed(c: &TestCluster, n: u64, q: &str, bodies: std::ops::Range<u32>) {
    let conn = c.node(n).connect().await;
    let ch = conn.create_channel().await.expect("channel");
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirm.select");
    for i in bodies {
        let confirm = ch
            .basic_publish(
                "".into(),
                q.into(),
                BasicPublishOptions::default(),
                format!("m{i}").as_bytes(),
                BasicProperties::default().with_delivery_mode(2),
            )
            .await
            .expect("publish");
        let got = tokio::time::timeout(WAIT, confirm)
            .await
            .expect("a confirm within the wait")
            .expect("confirm");
        assert!(matches!(got, Confirmation::Ack(_)), "nacked: {got:?}");
    }
}

/// Every message of `q`, consumed and acked on node `n` (a follower's consumer included),
/// until `want` came.
async fn drain(c: &TestCluster, n: u64, q: &str, want: usize) -> Vec<String> {
    let start = Instant::now();
    // The connection and channel live as long as their consumer.
    let (_conn, _ch, mut consumer) = loop {
        // A node going away closes the connection: each attempt has its own, as a client
        // that reconnects.
        let conn = c.node(n).connect().await;
        let ch = conn.create_channel().await.expect("channel");
        let attempt = ch
            .basic_consume(
                q.into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await;
        match attempt {
            Ok(consumer) => break (conn, ch, consumer),
            // A leader just elected refuses until it acts: a client retries.
            Err(e) => {
                assert!(start.elapsed() < WAIT, "consume on node {n}: {e}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    let mut got = Vec::new();
    while got.len() < want {
        let d = tokio::time::timeout(WAIT, consumer.next())
            .await
            .expect("a delivery within the wait")
            .expect("a delivery")
            .expect("delivered");
        got.push(String::from_utf8_lossy(&d.data).into_owned());
        d.ack(BasicAckOptions::default()).await.expect("ack");
    }
    got
}

/// Forgets node `n` through node `asked`'s API, once every node can (right after a start a
/// node may not have heard every node's level yet).
fn forget_once_every_node_can(c: &TestCluster, asked: u64, n: u64) {
    let start = Instant::now();
    loop {
        let out = forget(c, asked, &n.to_string());
        let said = text(&out);
        if out.status.success() {
            return;
        }
        assert!(
            said.contains("feature level") && start.elapsed() < WAIT,
            "{said}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits until node `n` lists exactly `want` (by number) and every node it reports running
/// has all its groups' members as the cluster's nodes.
fn wait_for_members(c: &TestCluster, n: u64, want: &[u64]) {
    let api = Api::of(c.node(n));
    eventually(
        &format!("node {n} to see nodes {want:?} with every group moved"),
        || {
            let (_, v) = api.call("GET", "/nodes", None);
            let list = v.as_array().cloned().unwrap_or_default();
            let mut numbers: Vec<u64> = list
                .iter()
                .filter_map(|n| n["cluster"]["node"].as_u64())
                .collect();
            numbers.sort_unstable();
            let settled = list.iter().all(|n| {
                n["running"] == true && n["cluster"]["members_changing"].as_u64() == Some(0)
            });
            if numbers == want && settled {
                Ok(())
            } else {
                Err(v.to_string())
            }
        },
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_node_is_replaced_by_a_joining_one_that_takes_every_queue_from_snapshots() {
    let mut c = TestCluster::start(3, 20);
    let queues: Vec<String> = (1..=3).map(|n| unique(&format!("replace{n}"))).collect();
    for (n, q) in (1..=3).zip(&queues) {
        c.declare_quorum_queue(n, q).await;
        publish_confirmed(&c, n, q, 0..20).await;
    }
    c.node_mut(3).stop(true);
    forget_once_every_node_can(&c, 1, 3);
    wait_for_members(&c, 1, &[1, 2]);

    // A new node, number 4, joins through a node it knows.
    // It lists node 1 alone: node 2's address comes with the metadata.
    let four = c.add_joining_node(&[1]);
    for n in [1, 2, four] {
        wait_for_members(&c, n, &[1, 2, four]);
    }
    // A queue declared once it joined starts with it; the older ones took it in.
    let late = unique("replace-late");
    c.declare_quorum_queue(2, &late).await;
    publish_confirmed(&c, 2, &late, 0..25).await;
    for q in &queues {
        let (_, v) = Api::of(c.node(four)).call("GET", &format!("/queues/%2f/{q}"), None);
        assert_eq!(v["members"].as_array().map_or(0, Vec::len), 3, "{v}");
        publish_confirmed(&c, four, q, 20..25).await;
    }
    wait_for_members(&c, 1, &[1, 2, four]);

    // Node 1 dies: nodes 2 and 4 are a majority of every queue, and hold every message.
    c.node_mut(1).stop(true);
    for q in queues.iter().chain([&late]) {
        let mut got = drain(&c, four, q, 25).await;
        got.sort();
        got.dedup();
        assert_eq!(
            got.len(),
            25,
            "every confirmed message of {q}, once: {got:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_node_is_forgotten_its_queues_go_on_two_nodes_and_only_a_new_node_takes_its_number(
) {
    let mut c = TestCluster::start(3, 20);
    // One queue led by each node (a client's declaration places the leader on its node).
    let queues: Vec<String> = (1..=3).map(|n| unique(&format!("forget{n}"))).collect();
    for (n, q) in (1..=3).zip(&queues) {
        c.declare_quorum_queue(n, q).await;
        publish_confirmed(&c, n, q, 0..20).await;
    }
    let name3 = node_names(&c, 3).first().cloned().expect("node 3's name");

    // RabbitMQ's forget_cluster_node needs the node stopped: so does Warren's.
    let start = Instant::now();
    loop {
        let out = forget(&c, 1, &name3);
        let said = text(&out);
        assert!(!out.status.success(), "forgot a running node: {said}");
        if said.contains("is running: stop it first") {
            break;
        }
        // Right after the start, a node may not have heard every node's level yet.
        assert!(
            said.contains("feature level") && start.elapsed() < WAIT,
            "{said}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    c.node_mut(3).stop(true);
    let out = forget(&c, 1, &name3);
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("is forgotten"), "{}", text(&out));
    for n in [1, 2] {
        let names = node_names(&c, n);
        assert_eq!(names.len(), 2, "node {n} lists {names:?}");
        assert!(!names.contains(&name3), "node {n} lists {names:?}");
    }
    // Each queue's members are the two nodes left, and it takes and gives messages.
    for q in &queues {
        let (_, v) = Api::of(c.node(2)).call("GET", &format!("/queues/%2f/{q}"), None);
        let members = v["members"].as_array().map_or(0, Vec::len);
        assert_eq!(members, 2, "{v}");
        publish_confirmed(&c, 2, q, 20..25).await;
    }
    for q in &queues {
        let mut got = drain(&c, 1, q, 25).await;
        got.sort();
        got.dedup();
        assert_eq!(
            got.len(),
            25,
            "every confirmed message of {q}, once: {got:?}"
        );
    }

    // Node 3 started again on its data: the others take no link from it, and the cluster
    // stays two nodes.
    c.node_mut(3).start_again();
    let api = Api::of(c.node(1));
    let start = Instant::now();
    loop {
        let (_, v) = api.call("GET", "/nodes", None);
        if v[0]["cluster"]["transport"]["refused_peers"]
            .as_u64()
            .is_some_and(|r| r > 0)
        {
            break;
        }
        assert!(start.elapsed() < WAIT, "node 3 not refused: {v}");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(node_names(&c, 1).len(), 2);
    publish_confirmed(&c, 1, &queues[0], 25..26).await;

    // Its data deleted, a new node takes number 3 by joining (a StatefulSet scaled down, the
    // pod's claim deleted, and scaled up again): every queue takes it in.
    c.node_mut(3).stop(true);
    c.rejoin_empty(3, &[1]);
    for n in [1, 2, 3] {
        wait_for_members(&c, n, &[1, 2, 3]);
    }
    for q in &queues {
        let (_, v) = Api::of(c.node(3)).call("GET", &format!("/queues/%2f/{q}"), None);
        assert_eq!(v["members"].as_array().map_or(0, Vec::len), 3, "{v}");
    }
    // Node 1 dies: nodes 2 and the new 3 are a majority, and the new 3 holds the messages.
    c.node_mut(1).stop(true);
    let mut got = drain(&c, 3, &queues[0], 1).await;
    got.sort();
    assert_eq!(got, vec!["m25".to_string()]);
}

/// A joining node that lists one running node only, which does not lead the metadata, still
/// joins: the leader, which it did not list and would refuse, is named to it by the node it
/// asked (before, the join never finished when the leader was another node).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_joining_through_a_node_that_does_not_lead_the_metadata_joins() {
    let mut c = TestCluster::start(3, 20);
    // Node 1 hands its leaderships away (maintenance mode): another node leads the metadata.
    c.drain(1, WAIT);

    let four = c.add_joining_node(&[1]);
    for n in [2, 3, four] {
        wait_for_members(&c, n, &[1, 2, 3, four]);
    }
    // It holds the metadata: a queue declared through another node is there.
    let q = unique("joined-late");
    c.declare_quorum_queue(2, &q).await;
    eventually("the new node to know the queue", || {
        let (status, v) = Api::of(c.node(four)).call("GET", &format!("/queues/%2f/{q}"), None);
        if status == 200 {
            Ok(())
        } else {
            Err(format!("{status} {v}"))
        }
    });
}

/// `warren ctl join_cluster` makes a node that runs on its own a node of a running cluster
/// (RabbitMQ's `stop_app`, `reset`, `join_cluster`, `start_app`): it refuses while the node
/// holds a message, then, with `--force`, the node starts again in the same process, empty,
/// takes every quorum queue with its messages, and a plain restart keeps it the cluster's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_running_on_its_own_joins_the_cluster_with_ctl_join_cluster() {
    let mut c = TestCluster::start(3, 20);
    let q = unique("before-ctl-join");
    c.declare_quorum_queue(1, &q).await;
    publish_confirmed(&c, 1, &q, 0..20).await;

    let alone = warren_conformance::TestBroker::start_with(&["--test-cluster-tick-ms", "20"]);
    let api = alone.http_url().expect("the management API").to_owned();
    let data = alone.data_dir().expect("its data directory").to_path_buf();
    // A file of the user's own stays; the store is made anew (RocksDB's IDENTITY changes).
    std::fs::write(data.join("my-notes.txt"), b"mine").expect("a file of my own");
    let identity = std::fs::read(data.join("IDENTITY")).expect("the store's identity");
    c.nodes.push(alone);
    // A durable queue holding one confirmed persistent message.
    let held = unique("held-alone");
    Api::of(c.node(4)).put(
        &format!("/queues/%2f/{held}"),
        serde_json::json!({"durable": true}),
    );
    publish_confirmed(&c, 4, &held, 0..1).await;

    let seed = format!("1={}", c.cluster_address(1));
    let own = format!("127.0.0.1:{}", warren_conformance::free_port());
    let secret = c.data_dir(1).with_file_name("secret");
    let join = |api: &str, force: bool| {
        Command::new(warren_binary())
            .args(["ctl", "join_cluster", &seed, "--cluster-node", "4"])
            .args(["--cluster-address", &own, "--cluster-secret-file"])
            .arg(&secret)
            .args(["--api", api, "--wait", "60"])
            .args(force.then_some("--force"))
            .output()
            .expect("run warren ctl")
    };
    // A secret every user of the host can read is refused.
    let public = join(&api, false);
    assert!(
        !public.status.success() && text(&public).contains("every user of the host can read it"),
        "{}",
        text(&public)
    );
    std::fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o600))
        .expect("chmod the secret");
    let refused = join(&api, false);
    assert!(!refused.status.success(), "{}", text(&refused));
    assert!(
        text(&refused).contains("holds 1 message(s)"),
        "{}",
        text(&refused)
    );

    // Killed right after it took a join, before it stopped and counted what it held, the node
    // starts on its own, its message kept: the join was not done.
    let (status, v) = Api::of(c.node(4)).call(
        "POST",
        "/cluster/join",
        Some(serde_json::json!({
            "node": 4,
            "nodes": format!("{seed},4={own}"),
            "secret_file": secret,
            "force": true,
        })),
    );
    assert_eq!(status, 202, "{v}");
    c.node_mut(4).restart(true);
    let alone_again = Api::of(c.node(4));
    eventually("the node on its own with its message", || {
        let (_, v) = alone_again.call("GET", &format!("/queues/%2f/{held}"), None);
        if v["messages"] == 1 {
            Ok(())
        } else {
            Err(v.to_string())
        }
    });
    assert!(!data.join("cluster.json").exists() && !data.join("cluster.json.asked").exists());

    let api = c.node(4).http_url().expect("the management API").to_owned();
    let joined = join(&api, true);
    assert!(joined.status.success(), "{}", text(&joined));
    assert!(
        text(&joined).contains("warren-4@127.0.0.1 is a node of the cluster"),
        "{}",
        text(&joined)
    );
    assert_ne!(
        std::fs::read(data.join("IDENTITY")).expect("the new store's identity"),
        identity,
        "the data directory was reset"
    );
    assert!(
        data.join("my-notes.txt").exists(),
        "a file not Warren's stays"
    );
    for n in [1, 4] {
        wait_for_members(&c, n, &[1, 2, 3, 4]);
    }
    let (_, v) = Api::of(c.node(4)).call("GET", &format!("/queues/%2f/{held}"), None);
    assert_eq!(v["error"], "Object Not Found", "the reset dropped it: {v}");

    // A plain restart, with the arguments it had on its own, keeps it node 4.
    c.node_mut(4).restart(false);
    let (_, v) = Api::of(c.node(4)).call("GET", "/overview", None);
    assert_eq!(v["node"], "warren-4@127.0.0.1", "{v}");
    let mut got = drain(&c, 4, &q, 20).await;
    got.sort();
    got.dedup();
    assert_eq!(
        got.len(),
        20,
        "every confirmed message, on the new node: {got:?}"
    );
}
