//! Replicated (quorum) queues on a 3-node cluster of spawned brokers: a queue declared on one
//! node is on every node; publishes on any node are confirmed once a majority has them; when
//! the leader's node is killed, another node leads within the test's patience and hands out
//! every confirmed message, and the killed node comes back on its data and catches up.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use futures_lite::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicGetOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Confirmation, PublisherConfirm};
use warren_conformance::cluster::TestCluster;
use warren_conformance::http::Api;
use warren_conformance::{unique, WAIT};

/// Publishes a persistent message with `mandatory` on `publisher` (in confirm mode) and returns
/// its confirm: a return comes before it when the message reached no queue.
async fn publish_mandatory(publisher: &Channel, x: &str, key: &str) -> Confirmation {
    let confirm = publisher
        .basic_publish(
            x.into(),
            key.into(),
            BasicPublishOptions {
                mandatory: true,
                ..Default::default()
            },
            b"routed",
            BasicProperties::default().with_delivery_mode(2),
        )
        .await
        .expect("publish");
    tokio::time::timeout(WAIT, confirm)
        .await
        .expect("a confirm within the wait")
        .expect("confirm")
}

async fn channel(c: &TestCluster, n: u64) -> (lapin::Connection, Channel) {
    let conn = c.node(n).connect().await;
    let ch = conn.create_channel().await.expect("channel");
    (conn, ch)
}

async fn consume(ch: &Channel, q: &str) -> lapin::Result<lapin::Consumer> {
    ch.basic_consume(
        q.into(),
        "".into(),
        BasicConsumeOptions::default(),
        FieldTable::default(),
    )
    .await
}

/// Consumes on `q`'s leader, as `asked` names it. A leader just elected takes the consume at
/// once and serves it when its term's first entries are applied, a few milliseconds later.
async fn consume_on_leader(
    c: &TestCluster,
    q: &str,
    asked: u64,
) -> (u64, lapin::Connection, lapin::Consumer) {
    let leader = c.leader_of(q, asked);
    let (conn, ch) = channel(c, leader).await;
    let consumer = consume(&ch, q)
        .await
        .unwrap_or_else(|e| panic!("consume on node {leader}: {e}"));
    (leader, conn, consumer)
}

/// Publishes `body` as a persistent message to `q` through the default exchange.
async fn publish_persistent(ch: &Channel, q: &str, body: &str) -> PublisherConfirm {
    ch.basic_publish(
        "".into(),
        q.into(),
        BasicPublishOptions::default(),
        body.as_bytes(),
        BasicProperties::default().with_delivery_mode(2),
    )
    .await
    .expect("publish")
}

/// Binds `q` to exchange `x` with `key`.
async fn bind(ch: &Channel, q: &str, x: &str, key: &str) {
    ch.queue_bind(
        q.into(),
        x.into(),
        key.into(),
        lapin::options::QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .expect("queue.bind");
}

/// The feature level node `n` reports every node of the cluster announced.
fn feature_level(c: &TestCluster, n: u64) -> Option<u64> {
    let (_, v) = Api::of(c.node(n)).call("GET", "/nodes", None);
    v.as_array()?.first()?["cluster"]["feature_level"].as_u64()
}

/// The feature level of this version's nodes.
const LEVEL: u64 = 12;

/// Waits until node `n` knows every node's level ([`LEVEL`]).
fn wait_for_feature_level(c: &TestCluster, n: u64) {
    let start = Instant::now();
    while feature_level(c, n) != Some(LEVEL) {
        assert!(
            start.elapsed() < WAIT,
            "node {n}: feature level {:?}",
            feature_level(c, n)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Declares the durable quorum queue `q` on node 1 with `extra` arguments, once every node is
/// at this version's feature level.
async fn declare_quorum_with(c: &TestCluster, q: &str, extra: &[(&str, lapin::types::AMQPValue)]) {
    for n in 1..=3 {
        wait_for_feature_level(c, n);
    }
    let (_conn, declarer) = channel(c, 1).await;
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        lapin::types::AMQPValue::LongString("quorum".into()),
    );
    for (k, v) in extra {
        args.insert((*k).into(), v.clone());
    }
    declarer
        .queue_declare(
            q.into(),
            lapin::options::QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            args,
        )
        .await
        .expect("declare");
}

/// Publishes `bodies` with confirms on `ch`: every one must be acked.
async fn publish_confirmed(ch: &Channel, q: &str, bodies: impl Iterator<Item = String>) {
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirm.select");
    let mut pending = Vec::new();
    for b in bodies {
        pending.push(publish_persistent(ch, q, &b).await);
    }
    for c in pending {
        let got = tokio::time::timeout(WAIT, c)
            .await
            .expect("a confirm within the wait")
            .expect("confirm");
        assert!(matches!(got, Confirmation::Ack(_)), "nacked: {got:?}");
    }
}

/// Publishes each of `bodies` until it is confirmed, as a publisher does when a leader
/// changes under it (a nack says the message may or may not be in the queue). Returns how
/// many nacks came.
async fn publish_until_confirmed(
    ch: &Channel,
    q: &str,
    bodies: impl Iterator<Item = String>,
) -> u64 {
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirm.select");
    let mut nacks = 0;
    for b in bodies {
        loop {
            let confirm = publish_persistent(ch, q, &b).await;
            let got = tokio::time::timeout(WAIT, confirm)
                .await
                .expect("a confirm within the wait")
                .expect("confirm");
            if matches!(got, Confirmation::Ack(_)) {
                break;
            }
            nacks += 1;
            assert!(nacks <= 20, "nacked again and again: {got:?}");
        }
    }
    nacks
}

/// The messages of `q` that a queue's API on node `n` reports, once it reports `want`.
fn wait_for_messages(c: &TestCluster, n: u64, q: &str, want: u64) {
    wait_for_messages_within(c, n, q, want, want);
}

/// The messages of `q` that a queue's API on node `n` reports, once it reports between
/// `least` and `most`.
fn wait_for_messages_within(c: &TestCluster, n: u64, q: &str, least: u64, most: u64) {
    let api = Api::of(c.node(n));
    let start = Instant::now();
    loop {
        let (_, v) = api.call("GET", &format!("/queues/%2f/{q}"), None);
        if v["messages"]
            .as_u64()
            .is_some_and(|m| (least..=most).contains(&m))
        {
            return;
        }
        assert!(
            start.elapsed() < WAIT,
            "node {n} reports {} messages in {q}, not {least} to {most}",
            v["messages"]
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replicated_queue_survives_its_leaders_kill_and_the_node_catches_up() {
    let mut c = TestCluster::start(3, 20);
    let q = unique("qq");
    c.declare_quorum_queue(2, &q).await;
    let leader = c.leader_of(&q, 2);
    let follower = leader % 3 + 1;
    // basic.get on a follower is served by the leader, with what the log gives it.
    let (_cf, chf) = channel(&c, follower).await;
    publish_confirmed(&chf, &q, (0..3).map(|i| format!("g{i}"))).await;
    for n in 1..=3 {
        wait_for_messages(&c, n, &q, 3);
    }
    let get = |ch: Channel, no_ack: bool| {
        let q = q.clone();
        async move {
            tokio::time::timeout(
                WAIT,
                ch.basic_get(q.as_str().into(), BasicGetOptions { no_ack }),
            )
            .await
            .expect("a get's answer within the wait")
            .expect("basic.get on a follower")
        }
    };
    let first = get(chf.clone(), false).await.expect("a message");
    assert_eq!((&first.data[..], first.message_count), (&b"g0"[..], 2));
    first.ack(BasicAckOptions::default()).await.expect("ack");
    let second = get(chf.clone(), true).await.expect("a message");
    assert_eq!(&second.data[..], b"g1");
    // Taken and not acked when its channel closes: it comes back, redelivered.
    let (_cg, chg) = channel(&c, follower).await;
    let third = get(chg.clone(), false).await.expect("a message");
    assert_eq!((&third.data[..], third.redelivered), (&b"g2"[..], false));
    chg.close(200, "bye".into()).await.expect("close");
    let again = loop {
        if let Some(m) = get(chf.clone(), false).await {
            break m;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!((&again.data[..], again.redelivered), (&b"g2"[..], true));
    again.ack(BasicAckOptions::default()).await.expect("ack");
    for n in 1..=3 {
        wait_for_messages(&c, n, &q, 0);
    }
    let none = get(chf.clone(), false).await;
    assert!(none.is_none(), "an empty queue gives get-empty");

    // Published on a follower: forwarded to the leader, confirmed once a majority has it.
    let (_cp, chp) = channel(&c, follower).await;
    publish_confirmed(&chp, &q, (0..200).map(|i| format!("m{i}"))).await;
    for n in 1..=3 {
        wait_for_messages(&c, n, &q, 200);
    }

    // A worker on the leader holds 20 unacked when its node is killed.
    let (_cl, chl) = channel(&c, leader).await;
    chl.basic_qos(20, BasicQosOptions::default())
        .await
        .expect("qos");
    let mut held = consume(&chl, &q).await.expect("consume on the leader");
    for _ in 0..20 {
        tokio::time::timeout(WAIT, held.next())
            .await
            .expect("a delivery")
            .expect("stream")
            .expect("delivery");
    }
    let quorum_critical = |c: &TestCluster, n: u64| {
        Api::of(c.node(n)).call("GET", "/health/checks/node-is-quorum-critical", None)
    };
    let (status, v) = quorum_critical(&c, follower);
    assert_eq!(
        (status, &v["status"]),
        (200, &serde_json::json!("ok")),
        "{v}"
    );
    let killed = Instant::now();
    c.node_mut(leader).stop(true);
    let survivor = follower;
    // With one of three down, stopping a survivor would leave its queues without a majority:
    // a rolling restart waits.
    let (status, v) = loop {
        let (status, v) = quorum_critical(&c, survivor);
        if status == 503 || killed.elapsed() > WAIT {
            break (status, v);
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status, 503, "{v}");
    // The nodes as RabbitMQ lists them: every member, the killed one not running.
    let (_, nodes) = Api::of(c.node(survivor)).call("GET", "/nodes", None);
    let running: Vec<bool> = nodes
        .as_array()
        .map(|a| a.iter().map(|n| n["running"] == true).collect())
        .unwrap_or_default();
    assert_eq!(running.len(), 3, "{nodes}");
    assert_eq!(running.iter().filter(|r| !**r).count(), 1, "{nodes}");
    // The queue's members are all three; those online, the two that run.
    let (_, qv) = Api::of(c.node(survivor)).call("GET", &format!("/queues/%2f/{q}"), None);
    let count = |k: &str| qv[k].as_array().map_or(0, Vec::len);
    assert_eq!((count("members"), count("online")), (3, 2), "{qv}");
    assert!(
        v["queues"].as_array().is_some_and(|qs| qs
            .iter()
            .any(|x| x["name"] == q.as_str() && x["type"] == "quorum")),
        "{v}"
    );
    let next = loop {
        let l = c.leader_of(&q, survivor);
        if l != leader {
            break l;
        }
        assert!(killed.elapsed() < WAIT, "no new leader");
        std::thread::sleep(Duration::from_millis(20));
    };
    eprintln!(
        "new leader {next} seen {} ms after the kill",
        killed.elapsed().as_millis()
    );

    // Every confirmed message is there, the 20 that were held marked redelivered.
    let (next, _cn, mut consumer) = consume_on_leader(&c, &q, survivor).await;
    let mut seen = BTreeSet::new();
    let mut redelivered = 0;
    while seen.len() < 200 {
        let d = tokio::time::timeout(WAIT, consumer.next())
            .await
            .expect("every confirmed message")
            .expect("stream")
            .expect("delivery");
        redelivered += u32::from(d.redelivered);
        seen.insert(String::from_utf8_lossy(&d.data).into_owned());
        d.ack(BasicAckOptions::default()).await.expect("ack");
    }
    assert_eq!(redelivered, 20, "only what the dead node's worker held");
    for n in [next, survivor] {
        wait_for_messages(&c, n, &q, 0);
    }

    // The killed node comes back on its data: it has the queue and catches up.
    c.node_mut(leader).start_again();
    c.wait_for_metadata_leader(leader);
    wait_for_messages(&c, leader, &q, 0);
    let back = Instant::now();
    while quorum_critical(&c, survivor).0 != 200 {
        assert!(
            back.elapsed() < WAIT,
            "still quorum-critical with every node back"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let (_cb, chb) = channel(&c, leader).await;
    publish_confirmed(&chb, &q, std::iter::once("after".to_owned())).await;
    for n in 1..=3 {
        wait_for_messages(&c, n, &q, 1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_down_while_thousands_of_entries_commit_catches_up_and_keeps_the_majority() {
    let mut c = TestCluster::start(3, 20);
    let q = unique("qq-behind");
    c.declare_quorum_queue(1, &q).await;
    let leader = c.leader_of(&q, 1);
    let behind = leader % 3 + 1;
    let other = 6 - leader - behind;
    for n in 1..=3 {
        wait_for_messages(&c, n, &q, 0);
    }
    // Far more than a group keeps in memory (2 x 1,024 entries, or 2 MiB of them) commits
    // while it is down: the other follower lets it go from memory, the leader keeps it for
    // the one behind. The publishes the leader takes in one pass share an entry.
    c.node_mut(behind).stop(true);
    let (_cl, chl) = channel(&c, leader).await;
    let pad = "x".repeat(1024);
    publish_confirmed(&chl, &q, (0..5000).map(|i| format!("m{i} {pad}"))).await;
    wait_for_messages(&c, other, &q, 5000);
    let (_, v) = Api::of(c.node(leader)).call("GET", "/nodes", None);
    let joined = v
        .as_array()
        .into_iter()
        .flatten()
        .find(|e| e["cluster"]["node"].as_u64() == Some(leader))
        .map(|e| e["cluster"]["joined_proposals"].clone())
        .unwrap_or_default();
    let (entries, proposals) = (
        joined["entries"].as_u64().unwrap_or(0),
        joined["proposals"].as_u64().unwrap_or(0),
    );
    assert!(
        entries > 0 && proposals > entries,
        "publishes in flight together share entries: {joined}"
    );
    // The leader dies; the one that was behind comes back: the majority is the other follower,
    // which must send it what left its memory, from its disk.
    c.node_mut(leader).stop(true);
    c.node_mut(behind).start_again();
    c.wait_for_metadata_leader(behind);
    wait_for_messages(&c, behind, &q, 5000);
    let (next, _cn, _consumer) = consume_on_leader(&c, &q, behind).await;
    assert_ne!(next, leader);
    let (_cp, chp) = channel(&c, next).await;
    publish_confirmed(&chp, &q, std::iter::once("after".to_owned())).await;
    for n in [behind, other] {
        wait_for_messages(&c, n, &q, 5001);
    }
}

/// A transport figure of node `n`, as its own `/api/nodes` entry gives it.
fn transport_figure(c: &TestCluster, n: u64, name: &str) -> u64 {
    let (_, v) = Api::of(c.node(n)).call("GET", "/nodes", None);
    v.as_array()
        .into_iter()
        .flatten()
        .find(|e| e["cluster"]["node"].as_u64() == Some(n))
        .and_then(|e| e["cluster"]["transport"][name].as_u64())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_down_while_a_deep_queue_was_snapshotted_gets_the_snapshot_in_pieces() {
    // Snapshots every 50 entries, and any above 4 KiB go in pieces (above 64 MiB by default):
    // the queue below is "deeper" than a frame.
    // A window of 8 messages: past it, each member keeps the messages' contents out of memory,
    // and the snapshot reads them back to be written whole.
    let mut c = TestCluster::start_with(
        3,
        20,
        &[
            "--test-snapshot-entries",
            "50",
            "--test-snapshot-inline-bytes",
            "4096",
            "--queue-window",
            "8",
        ],
    );
    for n in 1..=3 {
        wait_for_feature_level(&c, n);
    }
    let q = unique("qq-deep");
    c.declare_quorum_queue(1, &q).await;
    let leader = c.leader_of(&q, 1);
    let behind = leader % 3 + 1;
    for n in 1..=3 {
        wait_for_messages(&c, n, &q, 0);
    }
    c.node_mut(behind).stop(true);
    let (_cl, chl) = channel(&c, leader).await;
    // 2.4 MB in all: whichever snapshot the leader sends (the last one taken, at 200 messages
    // or later, each taken once the log since holds as much as the one before) is above what
    // a follower writes on its Raft thread (1 MiB).
    let body = |i: u32| format!("{i:05}-{}", "x".repeat(8000));
    // One at a time, so that each is an entry: publishes in flight together would share one,
    // and the follower would be too few entries behind to need the snapshot.
    for i in 0..300 {
        publish_confirmed(&chl, &q, std::iter::once(body(i))).await;
    }
    warren_conformance::http::eventually("the leader keeps the contents out of memory", || {
        match messages_away(&c, leader) {
            n if n >= 200 => Ok(()),
            n => Err(format!("{n} away")),
        }
    });
    c.node_mut(behind).start_again();
    c.wait_for_metadata_leader(behind);
    wait_for_messages(&c, behind, &q, 300);
    assert!(
        transport_figure(&c, behind, "snapshots_received_in_pieces") >= 1,
        "the node caught up from the leader's snapshot, sent in pieces"
    );
    // Counted once Raft saved it, which may be just after the queue's figures say 300.
    warren_conformance::http::eventually(
        "the snapshot written to disk off the Raft thread before it was installed",
        || match transport_figure(&c, behind, "snapshots_installed_from_written") {
            0 => Err(format!(
                "none; {} written ahead",
                transport_figure(&c, behind, "snapshots_received_written_ahead")
            )),
            _ => Ok(()),
        },
    );
    // What it holds is the queue: every message, in order, from a consumer on it.
    let (_cb, chb) = channel(&c, behind).await;
    let mut consumer = consume(&chb, &q)
        .await
        .expect("consume on the node that was down");
    for i in 0..300 {
        let d = tokio::time::timeout(WAIT, consumer.next())
            .await
            .expect("a delivery")
            .expect("stream")
            .expect("delivery");
        assert_eq!(d.data, body(i).into_bytes());
        d.ack(BasicAckOptions::default()).await.expect("ack");
        if i == 0 {
            // Installed from the snapshot, in memory whole, then sent away again.
            assert!(
                messages_away(&c, behind) >= 200,
                "{} away on the node that caught up",
                messages_away(&c, behind)
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_killed_whole_comes_back_from_its_snapshots_with_every_unacked_message() {
    // A snapshot every 50 entries: the log before it goes, a restart reads the snapshot and
    // replays only the entries after it.
    // A window of 8: what the snapshots and the restart rebuild was mostly out of memory.
    let mut c = TestCluster::start_with(
        3,
        20,
        &["--test-snapshot-entries", "50", "--queue-window", "8"],
    );
    let q = unique("qq-snap");
    c.declare_quorum_queue(1, &q).await;
    let leader = c.leader_of(&q, 1);
    let (_cl, chl) = channel(&c, leader).await;
    publish_confirmed(&chl, &q, (0..400).map(|i| format!("m{i:03}"))).await;
    // A worker acks the first 150, one at a time.
    chl.basic_qos(10, BasicQosOptions::default())
        .await
        .expect("qos");
    let mut consumer = consume(&chl, &q).await.expect("consume on the leader");
    for i in 0..150 {
        let d = tokio::time::timeout(WAIT, consumer.next())
            .await
            .expect("a delivery")
            .expect("stream")
            .expect("delivery");
        assert_eq!(d.data, format!("m{i:03}").into_bytes());
        d.ack(BasicAckOptions::default()).await.expect("ack");
    }
    drop(consumer);
    chl.close(200, "done".into()).await.expect("close");
    for n in 1..=3 {
        wait_for_messages(&c, n, &q, 250);
        let snapshots = c.data_dir(n).join("raft").join("snapshots");
        let files = std::fs::read_dir(&snapshots)
            .map(|d| d.count())
            .unwrap_or(0);
        assert!(
            files >= 1,
            "node {n} keeps a snapshot in {}",
            snapshots.display()
        );
    }
    for n in 1..=3 {
        c.node_mut(n).stop(true);
    }
    for n in 1..=3 {
        c.node_mut(n).start_again();
    }
    for n in 1..=3 {
        c.wait_for_metadata_leader(n);
        wait_for_messages(&c, n, &q, 250);
    }
    let (_next, _cn, mut consumer) = consume_on_leader(&c, &q, 1).await;
    let mut seen = BTreeSet::new();
    while seen.len() < 250 {
        let d = tokio::time::timeout(WAIT, consumer.next())
            .await
            .expect("every unacked message")
            .expect("stream")
            .expect("delivery");
        seen.insert(String::from_utf8_lossy(&d.data).into_owned());
        d.ack(BasicAckOptions::default()).await.expect("ack");
    }
    let want: BTreeSet<String> = (150..400).map(|i| format!("m{i:03}")).collect();
    assert_eq!(seen, want);
}

/// Takes `n` deliveries from `consumer`, acking each; their bodies in order.
async fn take_acked(consumer: &mut lapin::Consumer, n: usize) -> Vec<String> {
    let mut got = Vec::with_capacity(n);
    while got.len() < n {
        let d = tokio::time::timeout(WAIT, consumer.next())
            .await
            .expect("a delivery within the wait")
            .expect("the consumer is not cancelled")
            .expect("delivery");
        got.push(String::from_utf8_lossy(&d.data).into_owned());
        d.ack(BasicAckOptions::default()).await.expect("ack");
    }
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_on_a_follower_gets_every_message_and_carries_on_when_the_leader_dies() {
    let mut c = TestCluster::start(3, 20);
    let q = unique("qq-follower");
    c.declare_quorum_queue(1, &q).await;
    let leader = c.leader_of(&q, 1);
    let follower = leader % 3 + 1;
    let other = 6 - leader - follower;
    // A worker on a node that does not lead the queue, as behind a load balancer.
    let (_cw, chw) = channel(&c, follower).await;
    chw.basic_qos(50, BasicQosOptions::default())
        .await
        .expect("qos");
    let mut worker = consume(&chw, &q).await.expect("consume on a follower");
    let (_cp, chp) = channel(&c, other).await;
    publish_confirmed(&chp, &q, (0..200).map(|i| format!("m{i:03}"))).await;
    let want: Vec<String> = (0..200).map(|i| format!("m{i:03}")).collect();
    assert_eq!(
        take_acked(&mut worker, 200).await,
        want,
        "each once, in order"
    );
    for n in 1..=3 {
        wait_for_messages(&c, n, &q, 0);
    }
    // The leader's node dies: the worker's consumer is not cancelled, and what is published
    // next reaches it through the new leader.
    c.node_mut(leader).stop(true);
    let (_cp2, chp2) = channel(&c, other).await;
    // A publish the new leader gets in its first moments is nacked (it acts once its term's
    // first entry is applied): the publisher sends it again, so it may arrive twice.
    let nacks = publish_until_confirmed(&chp2, &q, (200..300).map(|i| format!("m{i:03}"))).await;
    let want: Vec<String> = (200..300).map(|i| format!("m{i:03}")).collect();
    let mut got: Vec<String> = Vec::new();
    let mut deliveries = 0;
    while got.len() < want.len() {
        let d = take_acked(&mut worker, 1).await;
        deliveries += 1;
        for m in d {
            if !got.contains(&m) {
                got.push(m);
            }
        }
    }
    assert_eq!(got, want, "each at least once, in order");
    assert!(
        deliveries <= 100 + nacks,
        "{deliveries} deliveries, {nacks} nacks"
    );
    for n in [follower, other] {
        wait_for_messages(&c, n, &q, 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn definitions_made_on_one_node_are_on_every_node_and_a_deleted_user_is_closed_everywhere() {
    use lapin::options::ExchangeDeclareOptions;
    let c = TestCluster::start(3, 20);
    let q = unique("qq");
    let x = unique("orders");
    c.declare_quorum_queue(1, &q).await;
    let (_conn, ch) = channel(&c, 1).await;
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..Default::default()
    };
    ch.exchange_declare(
        x.as_str().into(),
        lapin::ExchangeKind::Topic,
        durable,
        FieldTable::default(),
    )
    .await
    .expect("exchange.declare");
    bind(&ch, &q, &x, "eu.#").await;
    let api = Api::of(c.node(1));
    api.put(
        "/users/alice",
        serde_json::json!({"password": "wonderland", "tags": ""}),
    );
    api.put(
        "/permissions/%2f/alice",
        serde_json::json!({"configure": "", "write": ".*", "read": ".*"}),
    );

    // Alice logs in on node 3 and publishes through the exchange: its binding routes there.
    let url = c.node(3).url_with_credentials("alice", "wonderland");
    let start = Instant::now();
    let conn = loop {
        match lapin::Connection::connect(&url, lapin::ConnectionProperties::default()).await {
            Ok(conn) => break conn,
            Err(e) => assert!(start.elapsed() < WAIT, "alice cannot log in on node 3: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let ch3 = conn.create_channel().await.expect("channel");
    ch3.confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirm.select");
    let confirm = ch3
        .basic_publish(
            x.as_str().into(),
            "eu.paris".into(),
            BasicPublishOptions {
                mandatory: true,
                ..Default::default()
            },
            b"bonjour",
            BasicProperties::default().with_delivery_mode(2),
        )
        .await
        .expect("publish");
    let got = tokio::time::timeout(WAIT, confirm)
        .await
        .expect("a confirm within the wait")
        .expect("confirm");
    assert!(
        matches!(got, Confirmation::Ack(None)),
        "routed and confirmed: {got:?}"
    );
    wait_for_messages(&c, 2, &q, 1);
    let (_, v) = Api::of(c.node(2)).call("GET", &format!("/exchanges/%2f/{x}"), None);
    assert_eq!(v["type"], "topic", "node 2 has the exchange: {v}");

    // Deleted on node 2, alice is gone everywhere and her connection on node 3 is closed.
    let (status, _) = Api::of(c.node(2)).call("DELETE", "/users/alice", None);
    assert_eq!(status, 204);
    let start = Instant::now();
    while conn.status().connected() {
        assert!(
            start.elapsed() < WAIT,
            "alice's connection on node 3 is still open"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (status, _) = Api::of(c.node(3)).call("GET", "/users/alice", None);
    assert_eq!(status, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_down_while_the_definitions_log_is_compacted_comes_back_with_the_clusters_definitions(
) {
    // A snapshot every 20 entries, and a leader keeps at most 20 entries for a follower that
    // lags: the node that was down is sent the metadata group's snapshot, not its log.
    let mut c = TestCluster::start_with(3, 20, &["--test-snapshot-entries", "20"]);
    let old = unique("old");
    Api::of(c.node(1)).put(
        &format!("/exchanges/%2f/{old}"),
        serde_json::json!({"type": "fanout", "durable": true}),
    );
    Api::of(c.node(1)).put(
        "/users/dora",
        serde_json::json!({"password": "explorer", "tags": ""}),
    );
    let everywhere = |c: &TestCluster, path: &str, want: u16| {
        let start = Instant::now();
        for n in 1..=3 {
            loop {
                let (status, _) = Api::of(c.node(n)).call("GET", path, None);
                if status == want {
                    break;
                }
                assert!(
                    start.elapsed() < WAIT,
                    "GET {path} on node {n}: {status}, not {want}"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    };
    everywhere(&c, "/users/dora", 200);
    let away = 3;
    c.node_mut(away).stop(true);
    // Changes on both running nodes, one at a time: far more entries than the leader keeps.
    let made: Vec<String> = (0..120).map(|i| unique(&format!("new{i}"))).collect();
    for (i, x) in made.iter().enumerate() {
        let n = 1 + (i as u64 % 2);
        Api::of(c.node(n)).put(
            &format!("/exchanges/%2f/{x}"),
            serde_json::json!({"type": "direct", "durable": true}),
        );
    }
    assert_eq!(
        Api::of(c.node(2))
            .call("DELETE", &format!("/exchanges/%2f/{old}"), None)
            .0,
        204
    );
    assert_eq!(
        Api::of(c.node(1)).call("DELETE", "/users/dora", None).0,
        204
    );
    for x in &made {
        everywhere_but(&c, away, &format!("/exchanges/%2f/{x}"));
    }
    c.node_mut(away).start_again();
    c.wait_for_metadata_leader(away);
    for x in &made {
        everywhere(&c, &format!("/exchanges/%2f/{x}"), 200);
    }
    everywhere(&c, &format!("/exchanges/%2f/{old}"), 404);
    everywhere(&c, "/users/dora", 404);
}

/// Waits until every running node but `away` answers 200 for `path`.
fn everywhere_but(c: &TestCluster, away: u64, path: &str) {
    let start = Instant::now();
    for n in (1..=3).filter(|n| *n != away) {
        while Api::of(c.node(n)).call("GET", path, None).0 != 200 {
            assert!(start.elapsed() < WAIT, "GET {path} on node {n}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_cut_off_from_the_others_confirms_nothing_while_they_go_on() {
    let c = TestCluster::start_partitionable(3, 20, &[]);
    let q = unique("qq");
    c.declare_quorum_queue(1, &q).await;
    let leader = c.leader_of(&q, 1);
    let (_conn, ch) = channel(&c, leader).await;
    publish_confirmed(&ch, &q, std::iter::once("before".to_owned())).await;

    // Cut off, the leader still takes publishes from its clients: none may be confirmed.
    c.cut(leader);
    let mut waiting = Vec::new();
    for i in 0..20 {
        let confirm = ch
            .basic_publish(
                "".into(),
                q.as_str().into(),
                BasicPublishOptions::default(),
                format!("minority {i}").as_bytes(),
                BasicProperties::default().with_delivery_mode(2),
            )
            .await
            .expect("publish");
        waiting.push(tokio::spawn(confirm));
    }
    // The two others elect a leader and confirm what their clients publish.
    let other = leader % 3 + 1;
    let start = Instant::now();
    while c.leader_of(&q, other) == leader {
        assert!(start.elapsed() < WAIT, "the majority elects no new leader");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (_conn2, ch2) = channel(&c, other).await;
    // Under load the two may elect again meanwhile: a nack then asks the publisher to resend.
    let nacked = publish_until_confirmed(&ch2, &q, (0..20).map(|i| format!("majority {i}"))).await;
    assert!(
        waiting.iter().all(|t| !t.is_finished()),
        "the cut-off leader answered a publish"
    );

    // Healed, it learns of the new term: what it took is nacked (the publisher may resend).
    c.heal(leader);
    for t in waiting {
        let got = tokio::time::timeout(WAIT, t)
            .await
            .expect("an answer once healed")
            .expect("task")
            .expect("confirm");
        assert!(
            matches!(got, Confirmation::Nack(_)),
            "confirmed by a minority: {got:?}"
        );
    }
    // None of what the cut-off leader took is in the queue (a resent one may be in twice).
    wait_for_messages_within(&c, leader, &q, 21, 21 + nacked);
}

/// Node `n`'s `warren_replicated_messages_away`: messages of deep quorum queues whose contents
/// it keeps out of memory.
fn messages_away(c: &TestCluster, n: u64) -> u64 {
    let url = c.node(n).metrics_url().expect("metrics on");
    let text =
        warren_conformance::http::request("GET", &format!("{url}/metrics"), None, &[], None).text();
    text.lines()
        .find_map(|l| l.strip_prefix("warren_replicated_messages_away "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// Node `n`'s `warren_replicated_messages_spilled`: messages of deep quorum queues whose
/// packed entries it keeps on disk, in runs.
fn messages_spilled(c: &TestCluster, n: u64) -> u64 {
    let url = c.node(n).metrics_url().expect("metrics on");
    let text =
        warren_conformance::http::request("GET", &format!("{url}/metrics"), None, &[], None).text();
    text.lines()
        .find_map(|l| l.strip_prefix("warren_replicated_messages_spilled "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deep_quorum_queues_spilled_line_comes_back_whole_after_its_leader_dies() {
    // A window of 8 messages: past it, each member keeps the messages' contents out of memory,
    // packs them in runs of 4,096, and writes the runs past the first few out of memory too.
    let mut c = TestCluster::start_with(3, 20, &["--queue-window", "8"]);
    for n in 1..=3 {
        wait_for_feature_level(&c, n);
    }
    let q = unique("qq-spilled");
    c.declare_quorum_queue(1, &q).await;
    let leader = c.leader_of(&q, 1);
    let other = leader % 3 + 1;
    let n = 24_000u64;
    let body = |i: u64| format!("{i:06}-{}", "y".repeat(200));
    let (_cl, chl) = channel(&c, leader).await;
    publish_confirmed(&chl, &q, (0..n).map(body)).await;
    for node in 1..=3 {
        wait_for_messages(&c, node, &q, n);
        warren_conformance::http::eventually("the node spills the line's runs", || {
            match messages_spilled(&c, node) {
                s if s >= 8_192 => Ok(()),
                s => Err(format!("{s} spilled on node {node}")),
            }
        });
    }
    c.node_mut(leader).stop(true);
    c.wait_for_metadata_leader(other);
    let since = Instant::now();
    let next = loop {
        match c.leader_of(&q, other) {
            l if l != leader => break l,
            _ => {
                assert!(since.elapsed() < WAIT, "no new leader of {q}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    let (_cn, chn) = channel(&c, next).await;
    chn.basic_qos(500, BasicQosOptions::default())
        .await
        .expect("qos");
    let mut consumer = consume(&chn, &q).await.expect("consume on the new leader");
    let got = take_acked(&mut consumer, n as usize).await;
    let want: Vec<String> = (0..n).map(body).collect();
    assert!(got == want, "every message whole, once, in order");
    for node in (1..=3).filter(|x| *x != leader) {
        wait_for_messages(&c, node, &q, 0);
        warren_conformance::http::eventually("the runs let go", || {
            match messages_spilled(&c, node) {
                0 => Ok(()),
                s => Err(format!("{s} still spilled on node {node}")),
            }
        });
    }
}

/// The value of the series `name{labels}` in a Prometheus text answer.
fn sample(text: &str, name: &str, labels: &str) -> Option<u64> {
    let head = format!("{name}{{{labels}}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(head.as_str()))
        .and_then(|v| v.trim().parse().ok())
}

/// Node `asked`'s `/api/nodes` entry for node `n` (by its number).
fn entry_for(c: &TestCluster, asked: u64, n: u64) -> serde_json::Value {
    let (_, v) = Api::of(c.node(asked)).call("GET", "/nodes", None);
    v.as_array()
        .and_then(|a| a.iter().find(|e| e["cluster"]["node"] == n))
        .cloned()
        .unwrap_or_default()
}

/// Each node's `/api/nodes` has every running node's own figures, and its `/api/shovels` the
/// shovels of the whole cluster, as RabbitMQ's API does; a stopped node's figures go.
#[test]
fn every_nodes_figures_and_shovels_are_in_every_nodes_api_while_it_runs() {
    if std::env::var("WARREN_TEST_URL").is_ok_and(|u| !u.trim().is_empty()) {
        return; // spawns its own cluster
    }
    let mut c = TestCluster::start(3, 20);
    let start = Instant::now();
    for asked in 1..=3u64 {
        for n in (1..=3u64).filter(|n| *n != asked) {
            // The peer's own figures: its process id, its memory, what it leads.
            let pid = c.node(n).pid().expect("a spawned node").to_string();
            loop {
                let e = entry_for(&c, asked, n);
                if e["os_pid"] == pid.as_str() {
                    assert_eq!(e["running"], true, "{e}");
                    assert!(e["mem_used"].as_u64().is_some_and(|m| m > 0), "{e}");
                    assert!(e["cluster"]["queues_led"].is_u64(), "{e}");
                    assert!(
                        e["cluster"]["figures_age_ms"]
                            .as_u64()
                            .is_some_and(|a| a < 10_000),
                        "{e}"
                    );
                    break;
                }
                assert!(
                    start.elapsed() < WAIT,
                    "node {asked} shows no figures of node {n}: {e}"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
    // A shovel runs on one node (the lowest-numbered running one); every node's /api/shovels
    // lists it, naming that node.
    let name = unique("shv");
    let (code, body) = Api::of(c.node(2)).call(
        "PUT",
        &format!("/parameters/shovel/%2F/{name}"),
        Some(
            serde_json::json!({"value": {"src-uri": "amqp://", "src-queue": "shv-src",
            "dest-uri": "amqp://", "dest-queue": "shv-dest"}}),
        ),
    );
    assert!(code < 300, "{code} {body}");
    let runner = entry_for(&c, 1, 1)["name"].clone();
    for asked in 1..=3u64 {
        let start = Instant::now();
        loop {
            let (_, v) = Api::of(c.node(asked)).call("GET", "/shovels", None);
            let found = v.as_array().and_then(|a| {
                a.iter()
                    .find(|s| s["name"] == name.as_str() && s["state"] == "running")
            });
            if let Some(s) = found {
                assert_eq!(s["node"], runner, "{s}");
                break;
            }
            assert!(
                start.elapsed() < WAIT,
                "node {asked} does not list the running shovel: {v}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    // Restarted through a node that does not run it: the node that does restarts it (its
    // connections to its source and destination are new ones).
    let shovel_connections = || {
        let (_, v) = Api::of(c.node(1)).call("GET", "/connections", None);
        let mut names: Vec<String> = v
            .as_array()
            .map(|a| {
                a.iter()
                    .filter(|x| x["user"] != "guest")
                    .filter_map(|x| x["name"].as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default();
        names.sort();
        names
    };
    let before = shovel_connections();
    assert!(!before.is_empty(), "the shovel's connections on node 1");
    let (code, body) = Api::of(c.node(3)).call(
        "DELETE",
        &format!("/shovels/vhost/%2F/{name}/restart"),
        None,
    );
    assert_eq!(code, 204, "{body}");
    let restarted = Instant::now();
    loop {
        let now = shovel_connections();
        if !now.is_empty() && now.iter().all(|n| !before.contains(n)) {
            break;
        }
        assert!(
            restarted.elapsed() < WAIT,
            "node 1 did not restart the shovel: {before:?} then {now:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let (code, _) = Api::of(c.node(2)).call("DELETE", "/shovels/vhost/%2F/nonesuch/restart", None);
    assert_eq!(code, 404);
    // A node that stopped: down, with none of its last figures.
    c.node_mut(3).stop(true);
    let stopped = Instant::now();
    loop {
        let e = entry_for(&c, 1, 3);
        if e["running"] == false {
            assert!(
                e.get("mem_used").is_none(),
                "figures of a stopped node: {e}"
            );
            break;
        }
        assert!(
            stopped.elapsed() < WAIT,
            "node 3 still running for node 1: {e}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Each node's `/metrics/per-object` has a quorum queue's Raft figures under RabbitMQ's names
/// (its member's term, commit and applied index), which node leads it, and, on the leader, how
/// far each follower lags; `/metrics` sums them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quorum_queues_raft_figures_are_in_every_nodes_metrics() {
    use warren_conformance::http::request;
    let c = TestCluster::start(3, 20);
    let q = unique("figures");
    c.declare_quorum_queue(1, &q).await;
    {
        let (_conn, ch) = channel(&c, 1).await;
        // One at a time: publishes in flight together share an entry.
        for i in 0..10 {
            publish_confirmed(&ch, &q, std::iter::once(format!("m{i}"))).await;
        }
    }
    for n in 1..=3 {
        wait_for_messages(&c, n, &q, 10);
    }
    let leader = c.leader_of(&q, 1);
    let labels = format!("vhost=\"/\",queue=\"{q}\"");
    let start = Instant::now();
    for n in 1..=3 {
        let url = c.node(n).metrics_url().expect("metrics on");
        loop {
            let text = request("GET", &format!("{url}/metrics/per-object"), None, &[], None).text();
            let value = |name: &str| sample(&text, name, &labels);
            let term = value("rabbitmq_raft_term_total");
            let commit = value("rabbitmq_raft_log_commit_index");
            let applied = value("rabbitmq_raft_log_last_applied_index");
            let leads = value("warren_raft_leader");
            // Ten enqueues at least, committed and applied on every member.
            let done = term.is_some_and(|t| t >= 1)
                && commit.is_some_and(|i| i >= 10)
                && applied.is_some_and(|i| i >= 10)
                && leads == Some(u64::from(n == leader));
            if done {
                let lags = text
                    .lines()
                    .filter(|l| {
                        l.starts_with("warren_raft_follower_lag_entries{") && l.contains(&labels)
                    })
                    .count();
                assert_eq!(lags, if n == leader { 2 } else { 0 }, "node {n}:\n{text}");
                break;
            }
            assert!(
                start.elapsed() < WAIT,
                "node {n}: term {term:?} commit {commit:?} applied {applied:?} leads {leads:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let url = c.node(leader).metrics_url().expect("metrics on");
    let text = request("GET", &format!("{url}/metrics"), None, &[], None).text();
    let led = text
        .lines()
        .find_map(|l| l.strip_prefix("warren_raft_leader "))
        .and_then(|v| v.trim().parse::<u64>().ok());
    assert!(led.is_some_and(|n| n >= 1), "{text}");
}

/// A quorum queue deleted and declared again while a node is down is the new queue on that
/// node once it is back, even when the definitions log it missed was compacted: the node drops
/// the old queue (its messages, its group) and joins the new one's group. With the node that
/// did both then killed, the returning node and the third one are the new queue's majority and
/// hand out what it confirmed, and nothing of the old queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quorum_queue_declared_again_while_a_node_was_down_is_the_new_queue_there() {
    let mut c = TestCluster::start_with(3, 20, &["--test-snapshot-entries", "20"]);
    let q = unique("again");
    // Every node's level is in the log: quorum queues are numbered by it.
    for n in 1..=3 {
        wait_for_feature_level(&c, n);
    }
    c.declare_quorum_queue(1, &q).await;
    {
        let (_conn, ch) = channel(&c, 1).await;
        publish_confirmed(&ch, &q, (0..5).map(|i| format!("old{i}"))).await;
    }
    for n in 1..=3 {
        wait_for_messages(&c, n, &q, 5);
    }
    let away = 3;
    c.node_mut(away).stop(true);
    {
        let (_conn, ch) = channel(&c, 1).await;
        ch.queue_delete(q.as_str().into(), Default::default())
            .await
            .expect("queue.delete");
    }
    c.declare_quorum_queue(1, &q).await;
    {
        let (_conn, ch) = channel(&c, 1).await;
        publish_until_confirmed(&ch, &q, (0..3).map(|i| format!("new{i}"))).await;
    }
    // Enough definition changes that the leader's log no longer holds the deletion.
    let made: Vec<String> = (0..60).map(|i| unique(&format!("x{i}"))).collect();
    for x in &made {
        Api::of(c.node(1)).put(
            &format!("/exchanges/%2f/{x}"),
            serde_json::json!({"type": "direct", "durable": true}),
        );
    }
    for x in &made {
        everywhere_but(&c, away, &format!("/exchanges/%2f/{x}"));
    }
    c.node_mut(away).start_again();
    // The levels are in its store: known again at once, before it catches up.
    assert_eq!(feature_level(&c, away), Some(LEVEL));
    c.wait_for_metadata_leader(away);
    wait_for_messages(&c, away, &q, 3);
    c.node_mut(1).stop(true);
    let killed = Instant::now();
    while c.leader_of(&q, away) == 1 {
        assert!(killed.elapsed() < WAIT, "no leader after node 1");
        std::thread::sleep(Duration::from_millis(20));
    }
    let (_leader, _conn, mut consumer) = consume_on_leader(&c, &q, away).await;
    let got = take_acked(&mut consumer, 3).await;
    assert_eq!(got, ["new0", "new1", "new2"]);
    let more = tokio::time::timeout(Duration::from_millis(300), consumer.next()).await;
    assert!(more.is_err(), "nothing of the old queue: {more:?}");
}

/// A durable exchange and a quorum queue declared on one node, and the queue's binding to the
/// exchange, are on every running node when the declaration or the bind returns: a mandatory publish on another node
/// right after each is routed and confirmed, never returned as unroutable (RabbitMQ answers
/// once the queue's record, or the binding, is in every node's metadata store). The declaring
/// node leads the metadata and the publishing one hears from the others 40 ms late, so it
/// learns of each change last.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_on_another_node_right_after_a_declaration_or_a_bind_reaches_the_queue() {
    let c = TestCluster::start_partitionable(3, 20, &[]);
    for n in 1..=3 {
        wait_for_feature_level(&c, n);
    }
    let lead = c.wait_for_metadata_leader(1);
    let late = if lead == 1 { 2 } else { 1 };
    let third = 6 - lead - late;
    c.delay_to(late, Duration::from_millis(40));
    let (_c1, declarer) = channel(&c, lead).await;
    let (late_conn, publisher) = channel(&c, late).await;
    let (_c3, other) = channel(&c, third).await;
    publisher
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirm.select");
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        lapin::types::AMQPValue::LongString("quorum".into()),
    );
    let durable = lapin::options::QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    let exchange = unique("routes");
    declarer
        .exchange_declare(
            exchange.as_str().into(),
            lapin::ExchangeKind::Direct,
            lapin::options::ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("exchange.declare");
    // The exchange is on the publishing node at once: the publish is returned for want of a
    // binding, not refused with a 404 that closes the channel.
    let got = publish_mandatory(&publisher, &exchange, "nobody").await;
    match got {
        Confirmation::Ack(Some(returned)) => assert_eq!(returned.reply_code, 312),
        other => panic!("a publish to a new exchange on another node: {other:?}"),
    }
    let queues: Vec<String> = (0..20).map(|i| unique(&format!("fresh{i}"))).collect();
    for q in &queues {
        declarer
            .queue_declare(q.as_str().into(), durable, args.clone())
            .await
            .expect("declare");
        let got = publish_mandatory(&publisher, "", q).await;
        // A returned message would come as Ack(Some(message)).
        assert!(matches!(got, Confirmation::Ack(None)), "{q}: {got:?}");
        bind(&declarer, q, &exchange, q).await;
        let got = publish_mandatory(&publisher, &exchange, q).await;
        assert!(
            matches!(got, Confirmation::Ack(None)),
            "{q} by its binding: {got:?}"
        );
        // And a passive declaration on the third node finds it.
        other
            .queue_declare(
                q.as_str().into(),
                lapin::options::QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("the queue is on the third node");
    }
    for q in &queues {
        wait_for_messages(&c, lead, q, 2);
    }
    // An unbinding, a nowait binding and the deletions are answered alike: once every node
    // has them (RabbitMQ's channel applies a nowait method before it reads the next one).
    let q = queues[0].as_str();
    declarer
        .queue_unbind(
            q.into(),
            exchange.as_str().into(),
            q.into(),
            FieldTable::default(),
        )
        .await
        .expect("queue.unbind");
    match publish_mandatory(&publisher, &exchange, q).await {
        Confirmation::Ack(Some(returned)) => assert_eq!(returned.reply_code, 312),
        other => panic!("{q} right after its unbinding: {other:?}"),
    }
    declarer
        .queue_bind(
            q.into(),
            exchange.as_str().into(),
            "again".into(),
            lapin::options::QueueBindOptions { nowait: true },
            FieldTable::default(),
        )
        .await
        .expect("queue.bind nowait");
    declarer
        .basic_qos(10, lapin::options::BasicQosOptions::default())
        .await
        .expect("basic.qos after a nowait bind");
    let got = publish_mandatory(&publisher, &exchange, "again").await;
    assert!(
        matches!(got, Confirmation::Ack(None)),
        "right after a nowait bind and the next method's answer: {got:?}"
    );
    wait_for_messages(&c, lead, q, 3);
    let count = declarer
        .queue_delete(q.into(), lapin::options::QueueDeleteOptions::default())
        .await
        .expect("queue.delete");
    assert_eq!(
        count, 3,
        "delete-ok's message count, answered once the cluster has it"
    );
    match publish_mandatory(&publisher, "", q).await {
        Confirmation::Ack(Some(returned)) => assert_eq!(returned.reply_code, 312),
        other => panic!("{q} right after its deletion: {other:?}"),
    }
    declarer
        .exchange_delete(
            exchange.as_str().into(),
            lapin::options::ExchangeDeleteOptions::default(),
        )
        .await
        .expect("exchange.delete");
    let probe = late_conn.create_channel().await.expect("channel");
    let gone = probe
        .exchange_declare(
            exchange.as_str().into(),
            lapin::ExchangeKind::Direct,
            lapin::options::ExchangeDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await;
    warren_conformance::assert_amqp_error(
        gone,
        404,
        &format!("NOT_FOUND - no exchange '{exchange}' in vhost '/'"),
    );
}

/// The same for changes made through the management API (RabbitMQ answers them once every
/// node's metadata store has them): right after an exchange is PUT, and a binding POSTed or
/// DELETEd, on the node that leads the metadata, a mandatory publish on the node that hears of
/// it last is routed by the new binding, and returned once it is deleted, never the other way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_on_another_node_right_after_an_api_change_sees_it() {
    let c = TestCluster::start_partitionable(3, 20, &[]);
    for n in 1..=3 {
        wait_for_feature_level(&c, n);
    }
    let lead = c.wait_for_metadata_leader(1);
    let late = if lead == 1 { 2 } else { 1 };
    c.delay_to(late, Duration::from_millis(40));
    let (_c2, publisher) = channel(&c, late).await;
    publisher
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirm.select");
    let api = Api::of(c.node(lead));
    let q = unique("api-bound");
    api.put(
        &format!("/queues/%2f/{q}"),
        serde_json::json!({"durable": true, "arguments": {"x-queue-type": "quorum"}}),
    );
    let exchange = unique("api-routes");
    api.put(
        &format!("/exchanges/%2f/{exchange}"),
        serde_json::json!({"type": "direct", "durable": true}),
    );
    // On the publishing node at once: returned for want of a binding, not a 404.
    match publish_mandatory(&publisher, &exchange, "nobody").await {
        Confirmation::Ack(Some(returned)) => assert_eq!(returned.reply_code, 312),
        other => panic!("a publish to a new exchange on another node: {other:?}"),
    }
    for i in 0..10 {
        let key = format!("k{i}");
        let (status, v) = api.call(
            "POST",
            &format!("/bindings/%2f/e/{exchange}/q/{q}"),
            Some(serde_json::json!({"routing_key": key})),
        );
        assert_eq!(status, 201, "POST binding {key}: {v}");
        let got = publish_mandatory(&publisher, &exchange, &key).await;
        assert!(
            matches!(got, Confirmation::Ack(None)),
            "{key} right after the API bound it: {got:?}"
        );
        let (status, v) = api.call(
            "DELETE",
            &format!("/bindings/%2f/e/{exchange}/q/{q}/{key}"),
            None,
        );
        assert_eq!(status, 204, "DELETE binding {key}: {v}");
        match publish_mandatory(&publisher, &exchange, &key).await {
            Confirmation::Ack(Some(returned)) => assert_eq!(returned.reply_code, 312),
            other => panic!("{key} right after the API unbound it: {other:?}"),
        }
    }
    wait_for_messages(&c, lead, &q, 10);
}

/// A CA's certificate and a certificate for 127.0.0.1 it signed, for both ends of a cluster
/// link, in `dir`: (cert, key, ca).
fn cluster_pki(dir: &std::path::Path) -> [String; 3] {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
        KeyPair, KeyUsagePurpose,
    };
    std::fs::create_dir_all(dir).expect("pki dir");
    let mut ca = CertificateParams::new(Vec::<String>::new()).expect("ca params");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(DnType::CommonName, "Warren cluster CA");
    ca.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca_key = KeyPair::generate().expect("ca key");
    let ca_pem = ca.self_signed(&ca_key).expect("ca").pem();
    let issuer = Issuer::new(ca, ca_key);
    let mut node = CertificateParams::new(vec!["127.0.0.1".to_string()]).expect("params");
    node.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    let key = KeyPair::generate().expect("key");
    let cert = node.signed_by(&key, &issuer).expect("cert");
    let write = |name: &str, pem: &str| {
        let path = dir.join(name);
        std::fs::write(&path, pem).expect("pem");
        path.display().to_string()
    };
    [
        write("node.pem", &cert.pem()),
        write("node.key", &key.serialize_pem()),
        write("ca.pem", &ca_pem),
    ]
}

/// `--cluster-tls-*`: the nodes form the cluster over TLS links, and a quorum queue replicates
/// and fails over as over plain ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_over_tls_links_replicates_and_fails_over() {
    let pki = std::env::temp_dir().join(unique("warren-cluster-pki"));
    let [cert, key, ca] = cluster_pki(&pki);
    let mut c = TestCluster::start_with(
        3,
        20,
        &[
            "--cluster-tls-cert",
            &cert,
            "--cluster-tls-key",
            &key,
            "--cluster-tls-ca",
            &ca,
        ],
    );
    let q = unique("qq-tls");
    c.declare_quorum_queue(1, &q).await;
    let leader = c.leader_of(&q, 1);
    let follower = leader % 3 + 1;
    {
        let (_conn, ch) = channel(&c, follower).await;
        publish_confirmed(&ch, &q, (0..5).map(|i| format!("t{i}"))).await;
    }
    for n in 1..=3 {
        wait_for_messages(&c, n, &q, 5);
    }
    c.node_mut(leader).stop(true);
    let killed = Instant::now();
    while c.leader_of(&q, follower) == leader {
        assert!(killed.elapsed() < WAIT, "no leader after node {leader}");
        std::thread::sleep(Duration::from_millis(20));
    }
    let (_, _conn, mut consumer) = consume_on_leader(&c, &q, follower).await;
    let got = take_acked(&mut consumer, 5).await;
    assert_eq!(got, ["t0", "t1", "t2", "t3", "t4"]);
    drop(c);
    let _ = std::fs::remove_dir_all(&pki);
}

/// Delayed messages published to a quorum queue (`x-delivery-delay`) on a node that does not
/// lead it reach the queue once each when due, and nothing of them stays held on that node:
/// its `warren_delayed_messages` comes back to 0. (Held in the queue's log since feature
/// level 6; before, the node held them on its disk, and the guards their releases wrote were
/// what this test was first about.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delayed_messages_held_on_a_follower_reach_the_quorum_queue_once_and_leave_no_guard() {
    let c = TestCluster::start(3, 20);
    let q = unique("later");
    declare_quorum_with(
        &c,
        &q,
        &[("x-delivery-delay", lapin::types::AMQPValue::LongInt(300))],
    )
    .await;
    let leader = c.leader_of(&q, 1);
    let follower = leader % 3 + 1;
    let (_cf, publisher) = channel(&c, follower).await;
    publish_confirmed(&publisher, &q, (0..20).map(|i| format!("d{i}"))).await;
    for n in 1..=3 {
        wait_for_messages(&c, n, &q, 20);
    }
    let url = c
        .node(follower)
        .metrics_url()
        .expect("metrics on")
        .to_string();
    let held = |text: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix("warren_delayed_messages "))
            .and_then(|v| v.trim().parse::<u64>().ok())
    };
    warren_conformance::http::eventually("the follower's guards deleted", || {
        let text =
            warren_conformance::http::request("GET", &format!("{url}/metrics"), None, &[], None)
                .text();
        match held(&text) {
            Some(0) => Ok(()),
            other => Err(format!("warren_delayed_messages: {other:?}")),
        }
    });
    // Each once: the queue holds exactly what was published.
    wait_for_messages(&c, leader, &q, 20);
}

/// A publish held back for a quorum queue (`x-delivery-delay`) is in the queue's log: the
/// node that took it dies before it is due (with it, its disk might be lost for good), and
/// whichever node leads then releases it on time. Before, the node that took it held it on
/// its own disk, released by it alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_publish_is_released_on_time_after_the_node_that_took_it_dies() {
    let mut c = TestCluster::start(3, 20);
    let q = unique("held");
    declare_quorum_with(
        &c,
        &q,
        &[("x-delivery-delay", lapin::types::AMQPValue::LongInt(1500))],
    )
    .await;
    // Its leader takes the publishes: its death is a failover as well.
    let taker = c.leader_of(&q, 1);
    let other = taker % 3 + 1;
    let (conn, publisher) = channel(&c, taker).await;
    let sent = Instant::now();
    publish_confirmed(&publisher, &q, (0..10).map(|i| format!("h{i}"))).await;
    drop((publisher, conn));
    let (_, v) = Api::of(c.node(other)).call("GET", &format!("/queues/%2f/{q}"), None);
    assert_eq!(
        v["messages"].as_u64(),
        Some(0),
        "in the queue before they are due: {v}"
    );
    c.node_mut(taker).stop(true);
    wait_for_messages(&c, other, &q, 10);
    assert!(
        sent.elapsed() >= Duration::from_millis(1500),
        "released after {:?}",
        sent.elapsed()
    );
    let (_, _conn, mut consumer) = consume_on_leader(&c, &q, other).await;
    let got = take_acked(&mut consumer, 10).await;
    let mut want: Vec<String> = (0..10).map(|i| format!("h{i}")).collect();
    let mut got = got;
    got.sort();
    want.sort();
    assert_eq!(got, want);
}

/// A delayed exchange's message that routes to a quorum queue when it is published waits in
/// that queue's log: the node that took the publish dies before it is due (its disk might be
/// lost for good), and the queue's leader releases it on time, with `x-delay` negated as the
/// plugin delivers it. Before, it waited on the disk of the node that took it, until that node
/// came back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delayed_exchanges_message_for_a_quorum_queue_is_released_after_the_node_that_took_it_dies(
) {
    let mut c = TestCluster::start(3, 20);
    let q = unique("later");
    declare_quorum_with(&c, &q, &[]).await;
    let leader = c.leader_of(&q, 1);
    let taker = leader % 3 + 1;
    let x = unique("later-x");
    let (_dc, declarer) = channel(&c, 1).await;
    let mut args = FieldTable::default();
    args.insert(
        "x-delayed-type".into(),
        lapin::types::AMQPValue::LongString("direct".into()),
    );
    declarer
        .exchange_declare(
            x.as_str().into(),
            lapin::ExchangeKind::Custom("x-delayed-message".into()),
            lapin::options::ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            args,
        )
        .await
        .expect("exchange.declare");
    bind(&declarer, &q, &x, &q).await;
    // The binding is on the taking node before it publishes.
    let start = Instant::now();
    loop {
        let (_, v) = Api::of(c.node(taker)).call("GET", &format!("/queues/%2f/{q}/bindings"), None);
        if v.as_array()
            .is_some_and(|b| b.iter().any(|b| b["source"] == x.as_str()))
        {
            break;
        }
        assert!(start.elapsed() < WAIT, "the binding on node {taker}: {v}");
        std::thread::sleep(Duration::from_millis(20));
    }
    let (conn, publisher) = channel(&c, taker).await;
    publisher
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirm.select");
    let sent = Instant::now();
    let mut pending = Vec::new();
    for i in 0..10 {
        let mut headers = FieldTable::default();
        headers.insert("x-delay".into(), lapin::types::AMQPValue::LongInt(1500));
        let confirm = publisher
            .basic_publish(
                x.as_str().into(),
                q.as_str().into(),
                BasicPublishOptions::default(),
                format!("d{i}").as_bytes(),
                BasicProperties::default()
                    .with_delivery_mode(2)
                    .with_headers(headers),
            )
            .await
            .expect("publish");
        pending.push(confirm);
    }
    for confirm in pending {
        let got = tokio::time::timeout(WAIT, confirm)
            .await
            .expect("a confirm within the wait")
            .expect("confirm");
        assert!(matches!(got, Confirmation::Ack(_)), "nacked: {got:?}");
    }
    drop((publisher, conn));
    c.node_mut(taker).stop(true);
    wait_for_messages(&c, leader, &q, 10);
    assert!(
        sent.elapsed() >= Duration::from_millis(1500),
        "released after {:?}",
        sent.elapsed()
    );
    let (_, _conn, mut consumer) = consume_on_leader(&c, &q, leader).await;
    let mut got = Vec::new();
    for _ in 0..10 {
        let d = tokio::time::timeout(WAIT, consumer.next())
            .await
            .expect("a delivery within the wait")
            .expect("a delivery")
            .expect("a delivery");
        let delay = d
            .properties
            .headers()
            .as_ref()
            .and_then(|h| h.inner().get("x-delay").cloned());
        assert_eq!(
            delay,
            Some(lapin::types::AMQPValue::LongInt(-1500)),
            "delivered with the delay spent"
        );
        got.push(String::from_utf8_lossy(&d.data).into_owned());
        d.ack(BasicAckOptions::default()).await.expect("ack");
    }
    got.sort();
    let mut want: Vec<String> = (0..10).map(|i| format!("d{i}")).collect();
    want.sort();
    assert_eq!(got, want);
}

/// Warren's own `POST .../move` into a quorum queue on a cluster: each message leaves its
/// source once its copy's entry is applied (given back if it is lost), so what the answer
/// counts as moved is in the destination on every node and gone from the source.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_moved_into_a_quorum_queue_leave_their_source_once_their_copies_commit() {
    let c = TestCluster::start(3, 20);
    let (from, to) = (unique("mv-from"), unique("mv-to"));
    declare_quorum_with(&c, &to, &[]).await;
    // A classic queue on node 1: the copies' waits alone.
    let (_conn, ch) = channel(&c, 1).await;
    ch.queue_declare(
        from.as_str().into(),
        lapin::options::QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .expect("declare");
    publish_confirmed(&ch, &from, (0..20).map(|i| format!("m{i}"))).await;
    let (status, moved) = Api::of(c.node(1)).call(
        "POST",
        &format!("/queues/%2f/{from}/move"),
        Some(serde_json::json!({ "destination": to })),
    );
    assert_eq!(status, 200, "{moved}");
    assert_eq!(moved["moved"], 20);
    for n in 1..=3 {
        wait_for_messages(&c, n, &to, 20);
    }
    wait_for_messages(&c, 1, &from, 0);
}

/// basic.get on a quorum queue's leader, one right after another: each answered with the next
/// message, once the log has the get. Before, a get while the leader's machine ran ahead of its
/// log (the previous get's entry not yet committed, or a publisher busy on the queue) answered
/// get-empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn basic_gets_on_a_quorum_queues_leader_one_after_another_each_take_a_message() {
    let c = TestCluster::start(3, 20);
    let q = unique("polled");
    declare_quorum_with(&c, &q, &[]).await;
    let leader = c.leader_of(&q, 1);
    let (_conn, ch) = channel(&c, leader).await;
    publish_confirmed(&ch, &q, (0..20).map(|i| format!("p{i}"))).await;
    for i in 0..20u32 {
        let no_ack = i % 2 == 0;
        let got = tokio::time::timeout(
            WAIT,
            ch.basic_get(q.as_str().into(), BasicGetOptions { no_ack }),
        )
        .await
        .expect("a get's answer within the wait")
        .expect("basic.get")
        .unwrap_or_else(|| panic!("get-empty at get {i}"));
        assert_eq!(
            (
                String::from_utf8_lossy(&got.data).into_owned(),
                got.message_count
            ),
            (format!("p{i}"), 19 - i)
        );
        if !no_ack {
            got.ack(BasicAckOptions::default()).await.expect("ack");
        }
    }
    for n in 1..=3 {
        wait_for_messages(&c, n, &q, 0);
    }
}

/// The management API's get and move on a quorum queue's leader take as many messages as
/// asked, each call answered once the log has its gets. Before, the leader's machine ran ahead
/// of its log after a call's first get and the rest came back empty: one message a call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_apis_get_and_move_take_every_message_asked_of_a_quorum_queues_leader() {
    let c = TestCluster::start(3, 20);
    let (q, to) = (unique("api-get"), unique("api-get-to"));
    declare_quorum_with(&c, &q, &[]).await;
    declare_quorum_with(&c, &to, &[]).await;
    let leader = c.leader_of(&q, 1);
    let (_conn, ch) = channel(&c, leader).await;
    publish_confirmed(&ch, &q, (0..20).map(|i| format!("m{i}"))).await;
    let api = Api::of(c.node(leader));
    let get = |ackmode: &str| {
        api.call(
            "POST",
            &format!("/queues/%2f/{q}/get"),
            Some(serde_json::json!({ "count": 5, "ackmode": ackmode, "encoding": "auto" })),
        )
    };
    let payloads = |v: &serde_json::Value| -> Vec<String> {
        v.as_array()
            .map(|list| {
                list.iter()
                    .map(|m| m["payload"].as_str().unwrap_or_default().to_owned())
                    .collect()
            })
            .unwrap_or_default()
    };
    let first: Vec<String> = (0..5).map(|i| format!("m{i}")).collect();
    let (status, got) = get("ack_requeue_true");
    assert_eq!(status, 200, "{got}");
    assert_eq!(payloads(&got), first, "requeued");
    let (status, got) = get("ack_requeue_false");
    assert_eq!(status, 200, "{got}");
    assert_eq!(payloads(&got), first, "taken");
    assert_eq!(got[0]["redelivered"], true, "{got}");
    let (status, moved) = api.call(
        "POST",
        &format!("/queues/%2f/{q}/move"),
        Some(serde_json::json!({ "destination": to, "count": 5 })),
    );
    assert_eq!(status, 200, "{moved}");
    assert_eq!(moved["moved"], 5);
    for n in 1..=3 {
        wait_for_messages(&c, n, &q, 10);
        wait_for_messages(&c, n, &to, 5);
    }
}

/// The management API's get and move on a node that does not lead the quorum queue go to its
/// leader's API, as RabbitMQ's answer on any node: a web page or a load balancer in front of
/// the cluster does not know which node leads. Before, such a node answered 400 "not led by
/// this node". A call one node sent on is never sent on again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_apis_get_and_move_on_a_follower_are_answered_by_the_quorum_queues_leader() {
    let c = TestCluster::start(3, 20);
    let (q, to) = (unique("api-far"), unique("api-far-to"));
    declare_quorum_with(&c, &q, &[]).await;
    declare_quorum_with(&c, &to, &[]).await;
    let leader = c.leader_of(&q, 1);
    let follower = if leader == 1 { 2 } else { 1 };
    let (_conn, ch) = channel(&c, follower).await;
    publish_confirmed(&ch, &q, (0..10).map(|i| format!("m{i}"))).await;
    // The follower learns where the leader's API listens from the figures nodes share.
    c.wait_for_endpoint(follower, leader, "management");
    let api = Api::of(c.node(follower));
    let path = format!("/queues/%2f/{q}/get");
    let body =
        serde_json::json!({ "count": 3, "ackmode": "ack_requeue_false", "encoding": "auto" });
    let (status, got) = api.call("POST", &path, Some(body.clone()));
    assert_eq!(status, 200, "{got}");
    let payloads: Vec<&str> = got
        .as_array()
        .map(|l| l.iter().filter_map(|m| m["payload"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(payloads, ["m0", "m1", "m2"], "{got}");
    assert_eq!(got[2]["message_count"], 7, "{got}");
    let (status, moved) = api.call(
        "POST",
        &format!("/queues/%2f/{q}/move"),
        Some(serde_json::json!({ "destination": to, "count": 3 })),
    );
    assert_eq!(status, 200, "{moved}");
    assert_eq!(moved["moved"], 3);
    for n in 1..=3 {
        wait_for_messages(&c, n, &q, 4);
        wait_for_messages(&c, n, &to, 3);
    }
    // An answer larger than the pieces it is passed on in comes whole.
    let big = "x".repeat(300_000);
    publish_confirmed(&ch, &q, [big.clone(), big.clone()].into_iter()).await;
    let (status, got) = api.call(
        "POST",
        &path,
        Some(serde_json::json!({ "count": 10, "ackmode": "ack_requeue_true", "encoding": "auto" })),
    );
    assert_eq!(status, 200);
    let sizes: Vec<u64> = got
        .as_array()
        .map(|l| {
            l.iter()
                .filter_map(|m| m["payload_bytes"].as_u64())
                .collect()
        })
        .unwrap_or_default();
    assert_eq!(sizes, [2, 2, 2, 2, 300_000, 300_000]);
    assert_eq!(got[5]["payload"].as_str(), Some(big.as_str()));
    // A call marked as sent on by another node is answered where it lands.
    let url = format!("{}/api{path}", c.node(follower).http_url().expect("API"));
    let r = warren_conformance::http::request(
        "POST",
        &url,
        Some(("guest", "guest")),
        &[("x-warren-forwarded-by", "warren-9@elsewhere")],
        Some(&body.to_string()),
    );
    let text = String::from_utf8_lossy(&r.body);
    assert_eq!(r.status, 400, "{text}");
    assert!(text.contains("not led by this node"), "{text}");
    wait_for_messages(&c, leader, &q, 6);
}

/// With `--default-queue-type quorum` (RabbitMQ's `default_queue_type`), a client that
/// declares a durable queue without `x-queue-type` gets a quorum queue, replicated on every
/// node; an exclusive one stays classic, and a redeclaration without the type is equivalent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_durable_queue_declared_without_a_type_is_quorum_on_a_node_whose_default_it_is() {
    let c = TestCluster::start_with(3, 20, &["--default-queue-type", "quorum"]);
    let q = unique("dqt");
    let (_conn, ch) = channel(&c, 2).await;
    let durable = lapin::options::QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    for _ in 0..2 {
        ch.queue_declare(q.as_str().into(), durable, FieldTable::default())
            .await
            .expect("declared without a type, then again");
    }
    let own = ch
        .queue_declare(
            "".into(),
            lapin::options::QueueDeclareOptions {
                exclusive: true,
                ..durable
            },
            FieldTable::default(),
        )
        .await
        .expect("exclusive");
    publish_confirmed(&ch, &q, (0..5).map(|i| format!("d{i}"))).await;
    for n in 1..=3 {
        wait_for_messages(&c, n, &q, 5);
    }
    let (_, v) = Api::of(c.node(1)).call("GET", &format!("/queues/%2f/{q}"), None);
    assert_eq!(v["type"], "quorum", "{v}");
    assert_eq!(v["arguments"]["x-queue-type"], "quorum", "{v}");
    assert_eq!(v["members"].as_array().map(Vec::len), Some(3), "{v}");
    let (_, v) =
        Api::of(c.node(2)).call("GET", &format!("/queues/%2f/{}", own.name().as_str()), None);
    assert_eq!(v["type"], "classic", "{v}");
    let (_, v) = Api::of(c.node(3)).call("GET", "/vhosts/%2f", None);
    assert_eq!(v["default_queue_type"], "quorum", "{v}");

    // A vhost's own default (RabbitMQ 3.11's), set through one node, is every node's: a
    // queue declared through another without a type is classic there.
    let vh = unique("dqt-vh");
    let (status, _) = Api::of(c.node(3)).call(
        "PUT",
        &format!("/vhosts/{vh}"),
        Some(serde_json::json!({"default_queue_type": "classic"})),
    );
    assert_eq!(status, 201);
    let on_2 = Api::of(c.node(2));
    warren_conformance::http::eventually("the vhost's default on node 2", || {
        let (_, v) = on_2.call("GET", &format!("/vhosts/{vh}"), None);
        (v["default_queue_type"] == "classic")
            .then_some(())
            .ok_or_else(|| v.to_string())
    });
    let local = unique("dqt-local");
    warren_conformance::http::eventually("guest's permissions in the vhost on node 2", || {
        let (status, v) = on_2.call(
            "PUT",
            &format!("/queues/{vh}/{local}"),
            Some(serde_json::json!({"durable": true})),
        );
        (status == 201 || status == 204)
            .then_some(())
            .ok_or_else(|| format!("{status} {v}"))
    });
    let (_, v) = on_2.call("GET", &format!("/queues/{vh}/{local}"), None);
    assert_eq!(v["type"], "classic", "{v}");
}

/// A cluster has one name on every node: its first node's until one is set, then the one set
/// through any node (RabbitMQ's `rabbitmqctl set_cluster_name`), in each node's overview and
/// metrics. Before, each node gave its own name, and dashboards that group by
/// `rabbitmq_identity_info`'s `rabbitmq_cluster` saw three clusters.
#[test]
fn the_clusters_name_is_the_same_on_every_node() {
    let c = TestCluster::start(3, 20);
    let name = |n: u64| Api::of(c.node(n)).call("GET", "/cluster-name", None).1["name"].clone();
    let first = Api::of(c.node(1)).call("GET", "/overview", None).1["node"].clone();
    for n in 1..=3 {
        assert_eq!(name(n), first, "node {n}");
    }
    let out = c.ctl(2, &["set_cluster_name", "prod-eu"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The API answers once every running node has the change.
    for n in 1..=3 {
        assert_eq!(name(n), "prod-eu", "node {n}");
        let metrics = c.node(n).metrics_url().expect("metrics on");
        let text = warren_conformance::http::request(
            "GET",
            &format!("{metrics}/metrics"),
            None,
            &[],
            None,
        )
        .text();
        assert!(
            text.lines().any(|l| l.starts_with("rabbitmq_identity_info")
                && l.contains("rabbitmq_cluster=\"prod-eu\"")
                && l.contains(&format!("rabbitmq_cluster_permanent_id={first}"))),
            "node {n}: {text}"
        );
    }
}

/// A quorum queue's deduplication window (`x-message-deduplication`) is the queue's, on every
/// node: a key published through one node is a duplicate through another (confirmed, not
/// enqueued), and still after the leader's node dies. Before, each node judged alone, in
/// memory: the same key through two nodes was in the queue twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quorum_queues_deduplication_key_holds_through_every_node_and_a_failover() {
    let mut c = TestCluster::start(3, 20);
    let q = unique("once");
    declare_quorum_with(
        &c,
        &q,
        &[(
            "x-message-deduplication",
            lapin::types::AMQPValue::Boolean(true),
        )],
    )
    .await;
    let keyed = |key: &str| {
        let mut headers = FieldTable::default();
        headers.insert(
            "x-deduplication-header".into(),
            lapin::types::AMQPValue::LongString(key.into()),
        );
        BasicProperties::default()
            .with_delivery_mode(2)
            .with_headers(headers)
    };
    let publish = |ch: Channel, q: String, key: &'static str| {
        let props = keyed(key);
        async move {
            ch.confirm_select(ConfirmSelectOptions::default())
                .await
                .expect("confirm.select");
            let confirm = ch
                .basic_publish(
                    "".into(),
                    q.as_str().into(),
                    BasicPublishOptions::default(),
                    key.as_bytes(),
                    props,
                )
                .await
                .expect("publish");
            let got = tokio::time::timeout(WAIT, confirm)
                .await
                .expect("a confirm within the wait")
                .expect("confirm");
            assert!(matches!(got, Confirmation::Ack(_)), "{key}: {got:?}");
        }
    };
    let leader = c.leader_of(&q, 1);
    let others: Vec<u64> = (1..=3).filter(|n| *n != leader).collect();
    for n in [others[0], others[1], leader] {
        let (_conn, ch) = channel(&c, n).await;
        publish(ch, q.clone(), "order-1").await;
    }
    wait_for_messages(&c, leader, &q, 1);
    c.node_mut(leader).stop(true);
    let (_conn, ch) = channel(&c, others[0]).await;
    publish(ch.clone(), q.clone(), "order-1").await;
    publish(ch, q.clone(), "order-2").await;
    wait_for_messages(&c, others[1], &q, 2);
}

/// A member whose disk fills up cannot write its Raft log: it stops (exit code 70, as when its
/// store thread is gone) rather than serving on with a Raft thread that stopped, which left
/// its clients waiting for ever, and the other two go on: every message they confirmed is
/// there, and confirms keep coming; started again with room, it catches up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_that_cannot_write_its_raft_log_stops_and_the_others_lose_nothing() {
    if std::env::var("WARREN_TEST_URL").is_ok_and(|u| !u.trim().is_empty()) {
        return;
    }
    let mut c = TestCluster::start(3, 20);
    let q = unique("full-member");
    c.declare_quorum_queue(1, &q).await;
    for n in 1..=3 {
        wait_for_messages(&c, n, &q, 0);
    }
    // Node 3 moves onto a small disk, its data copied over.
    c.node_mut(3).stop(true);
    let data = c.data_dir(3);
    let before = data.with_extension("before");
    std::fs::rename(&data, &before).expect("move node 3's data aside");
    let Some(disk) = warren_conformance::disk::SmallDisk::mount_at(&data, "48m") else {
        return;
    };
    let copied = std::process::Command::new("cp")
        .arg("-a")
        .arg(before.join("."))
        .arg(&data)
        .status()
        .expect("cp");
    assert!(copied.success(), "copying node 3's data");
    // No free-space alarm (the disk fills at once, as when something else fills it): with
    // one, node 3 would block every node's publishers, as RabbitMQ's alarms do, and its disk
    // would never fill.
    c.node_mut(3).start_again_with(&["--disk-free-limit", "0"]);
    wait_for_messages(&c, 3, &q, 0);
    let leader = c.leader_of(&q, 1);
    let publisher_node = if leader == 3 { 1 } else { leader };
    let (_pc, ch) = channel(&c, publisher_node).await;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirm.select");
    // Random bytes: the Raft log compresses its entries, and a body of one byte repeated
    // would take next to no room in it.
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let body: Vec<u8> = (0..60 * 1024)
        .map(|_| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 24) as u8
        })
        .collect();
    let mut confirmed: Vec<String> = Vec::new();
    let mut exit = None;
    // 48 MiB hold fewer than 800 such messages; a window of 10 at a time.
    for window in 0..300u32 {
        let mut pending = Vec::new();
        for i in 0..10 {
            let name = format!("m{window}-{i}");
            let mut b = name.clone().into_bytes();
            b.push(b' ');
            b.extend_from_slice(&body);
            // Bounded: a blocked connection (an alarm) would hold the publish for ever.
            let confirm = tokio::time::timeout(
                WAIT,
                ch.basic_publish(
                    "".into(),
                    q.as_str().into(),
                    BasicPublishOptions::default(),
                    &b,
                    BasicProperties::default().with_delivery_mode(2),
                ),
            )
            .await
            .expect("a publish not blocked")
            .expect("publish");
            pending.push((name, confirm));
        }
        for (name, confirm) in pending {
            let got = tokio::time::timeout(WAIT, confirm)
                .await
                .expect("a confirm within the wait")
                .expect("confirm");
            if matches!(got, Confirmation::Ack(_)) {
                confirmed.push(name);
            }
        }
        if let Some(status) = c.node_mut(3).wait_exit(Duration::ZERO) {
            exit = Some(status);
            break;
        }
    }
    // The other two confirm on.
    let after: Vec<String> = (0..20).map(|i| format!("after-{i}")).collect();
    publish_confirmed(&ch, &q, after.iter().cloned()).await;
    confirmed.extend(after);
    let status = exit.expect("node 3 stopped once its disk was full");
    assert_eq!(
        status.code(),
        Some(70),
        "node 3's exit; its output:\n{}",
        c.node(3).output()
    );
    assert!(
        c.node(3)
            .output()
            .contains("the raft log cannot be written"),
        "node 3 says why it stopped:\n{}",
        c.node(3).output()
    );
    // Every confirmed message is in the queue on the two others.
    let (_lc, leader_now, mut consumer) = {
        let (n, conn, consumer) = consume_on_leader(&c, &q, 1).await;
        (conn, n, consumer)
    };
    assert_ne!(leader_now, 3);
    let mut seen = BTreeSet::new();
    let want: BTreeSet<String> = confirmed.iter().cloned().collect();
    while !want.is_subset(&seen) {
        let d = tokio::time::timeout(WAIT, consumer.next())
            .await
            .expect("a delivery within the wait")
            .expect("a delivery")
            .expect("a delivery");
        let name = d
            .data
            .split(|b| *b == b' ')
            .next()
            .map(|n| String::from_utf8_lossy(n).into_owned())
            .unwrap_or_default();
        d.ack(BasicAckOptions::default()).await.expect("ack");
        seen.insert(name);
    }
    // With room again, node 3 starts on what its log held and catches up.
    c.node_mut(3).stop(true);
    let grown = std::process::Command::new("mount")
        .args(["-o", "remount,size=512m"])
        .arg(&data)
        .status()
        .expect("mount");
    assert!(grown.success(), "growing node 3's disk");
    c.node_mut(3).start_again();
    let last: Vec<String> = (0..5).map(|i| format!("last-{i}")).collect();
    publish_confirmed(&ch, &q, last.into_iter()).await;
    for n in 1..=3 {
        wait_for_messages(&c, n, &q, 5);
    }
    c.node_mut(3).stop(true);
    drop(disk);
}

/// A classic queue is its node's own; `warren migrate` narrowed to it (`--queues`) moves it to
/// another node of the cluster: its declaration (arguments and bindings) and its messages, each
/// acked on the first node only once the second confirmed it. What docs/operations.md's
/// runbook gives for moving a classic queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_classic_queue_moves_to_another_node_with_warren_migrate() {
    let c = TestCluster::start(3, 20);
    let q = unique("local");
    let other = unique("stays");
    let (_c1, ch) = channel(&c, 1).await;
    for (name, max) in [(&q, 10_000), (&other, 5)] {
        let mut args = FieldTable::default();
        args.insert("x-max-length".into(), lapin::types::AMQPValue::LongInt(max));
        ch.queue_declare(
            name.as_str().into(),
            lapin::options::QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            args,
        )
        .await
        .expect("declare");
    }
    bind(&ch, &q, "amq.direct", "reports").await;
    publish_confirmed(&ch, &q, (0..300).map(|i| format!("m{i}"))).await;
    publish_confirmed(&ch, &other, (0..3).map(|i| format!("o{i}"))).await;
    let amqp = |n: u64| {
        c.node(n)
            .url()
            .rsplit_once('/')
            .map_or(c.node(n).url(), |(base, _)| base)
            .to_owned()
    };
    let http = |n: u64| c.node(n).http_url().expect("management API").to_owned();
    let out = std::process::Command::new(warren_conformance::warren_binary())
        .arg("migrate")
        .arg("--from-api")
        .arg(http(1).replacen("http://", "http://guest:guest@", 1))
        .arg("--from-amqp")
        .arg(amqp(1))
        .arg("--queues")
        .arg(format!("^{q}$"))
        .arg("--url")
        .arg(amqp(2))
        .arg("--api")
        .arg(http(2))
        .args(["--quiet", "1"])
        .output()
        .expect("warren migrate");
    assert!(
        out.status.success(),
        "migrate failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let (_, moved) = Api::of(c.node(2)).call("GET", &format!("/queues/%2f/{q}"), None);
    assert_eq!(moved["messages"].as_u64(), Some(300), "{moved}");
    assert_eq!(moved["arguments"]["x-max-length"], 10_000, "{moved}");
    let (_, bindings) = Api::of(c.node(2)).call("GET", &format!("/queues/%2f/{q}/bindings"), None);
    assert!(
        bindings.as_array().is_some_and(|b| b
            .iter()
            .any(|b| b["source"] == "amq.direct" && b["routing_key"] == "reports")),
        "its binding on node 2: {bindings}"
    );
    let (_, left) = Api::of(c.node(1)).call("GET", &format!("/queues/%2f/{q}"), None);
    assert_eq!(left["messages"].as_u64(), Some(0), "{left}");
    // The other classic queue stays where it is, and is not made on node 2.
    let (code, _) = Api::of(c.node(2)).call("GET", &format!("/queues/%2f/{other}"), None);
    assert_eq!(code, 404);
    let (_, kept) = Api::of(c.node(1)).call("GET", &format!("/queues/%2f/{other}"), None);
    assert_eq!(kept["messages"].as_u64(), Some(3), "{kept}");
    let (_c2, ch2) = channel(&c, 2).await;
    let mut consumer = consume(&ch2, &q).await.expect("consume on node 2");
    let got = take_acked(&mut consumer, 300).await;
    let got: BTreeSet<String> = got.into_iter().collect();
    assert_eq!(got.len(), 300);
}

/// A resource alarm is the cluster's, as RabbitMQ's are: node 2 low on disk blocks the
/// publishers of node 1 too (`connection.blocked`, "low on disk"), node 1's `/api/nodes` says
/// whose alarm it is, and once node 2 is gone node 1's publishers are unblocked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resource_alarm_on_one_node_blocks_publishers_on_every_node() {
    use amq_protocol::protocol::{connection, AMQPClass};
    let mut c = TestCluster::start(3, 20);
    let q = unique("blocked");
    c.declare_quorum_queue(1, &q).await;
    c.node_mut(2).stop(true);
    c.node_mut(2)
        .start_again_with(&["--disk-free-limit", "1000000000000000000"]);
    let mut publisher = c.node(1).raw().await;
    publisher.channel_open(1).await;
    publisher
        .publish(1, "", &q, false, Default::default(), b"first")
        .await;
    let reason = publisher.recv_blocked().await;
    assert_eq!(reason, "low on disk");
    let (_, nodes) = Api::of(c.node(1)).call("GET", "/nodes", None);
    let alarm_of = |n: u64| {
        nodes
            .as_array()
            .and_then(|all| {
                all.iter().find(|e| {
                    e["name"]
                        .as_str()
                        .is_some_and(|s| s.starts_with(&format!("warren-{n}@")))
                })
            })
            .map(|e| e["disk_free_alarm"].clone())
    };
    assert_eq!(alarm_of(1), Some(serde_json::Value::Bool(false)), "{nodes}");
    assert_eq!(alarm_of(2), Some(serde_json::Value::Bool(true)), "{nodes}");
    // Node 2 gone: its alarm with it.
    c.node_mut(2).stop(true);
    match publisher.recv_method().await {
        (0, AMQPClass::Connection(connection::AMQPMethod::Unblocked(_))) => {}
        other => panic!("expected connection.unblocked, got {other:?}"),
    }
}

/// A store batch that only numbers a quorum queue's confirm is written at once only when every
/// batch before it is: on a node whose disk takes a second for every batch, a persistent
/// message for a classic queue, then one for a quorum queue on the same channel, are both
/// confirmed once that disk has the first (not with the quorum queue's commit, which comes
/// far sooner).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_classic_queues_confirm_still_waits_for_a_slow_disk_when_a_quorum_queues_follows() {
    const DISK_MS: u64 = 1000;
    let c = TestCluster::start_with(3, 20, &["--test-store-delay-ms", &DISK_MS.to_string()]);
    let q = unique("slow-disk-quorum");
    c.declare_quorum_queue(1, &q).await;
    let leader = c.leader_of(&q, 1);
    let (_conn, ch) = channel(&c, leader).await;
    let classic = unique("slow-disk-classic");
    ch.queue_declare(
        classic.as_str().into(),
        lapin::options::QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .expect("declare the classic queue");
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirm.select");
    let started = Instant::now();
    let on_disk = publish_persistent(&ch, &classic, "on the slow disk").await;
    // In a later pass of the node, so in a batch of its own: one with nothing to write.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let replicated = publish_persistent(&ch, &q, "replicated").await;
    for (what, confirm) in [("classic", on_disk), ("quorum", replicated)] {
        let got = tokio::time::timeout(WAIT, confirm)
            .await
            .expect("a confirm within the wait")
            .expect("confirm");
        assert!(
            matches!(got, Confirmation::Ack(_)),
            "{what}: nacked: {got:?}"
        );
        let after = started.elapsed();
        assert!(
            after >= Duration::from_millis(DISK_MS - 50),
            "the {what} queue's message was confirmed {after:?} after the first publish, before the disk had it"
        );
    }
}

/// The members a node's API lists for queue `q`, by number.
fn api_members(c: &TestCluster, n: u64, q: &str) -> Vec<u64> {
    let (_, v) = Api::of(c.node(n)).call("GET", &format!("/queues/%2f/{q}"), None);
    let mut m: Vec<u64> = v["members"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| {
            m.as_str()
                .and_then(warren_conformance::cluster::node_number)
        })
        .collect();
    m.sort_unstable();
    m
}

/// `--quorum-membership-reconciliation` (RabbitMQ's continuous membership reconciliation):
/// a queue declared with one member and `x-quorum-target-group-size` 3 grows to three on
/// its own; one without a target keeps its single member.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn membership_reconciliation_grows_a_queue_to_its_target_size() {
    let c = TestCluster::start_with(
        3,
        20,
        &[
            "--quorum-membership-reconciliation",
            "--quorum-membership-reconciliation-trigger-interval",
            "100",
        ],
    );
    let size = |n: i64| lapin::types::AMQPValue::LongLongInt(n);
    let (grows, stays) = (unique("grows"), unique("stays"));
    declare_quorum_with(
        &c,
        &grows,
        &[
            ("x-quorum-initial-group-size", size(1)),
            ("x-quorum-target-group-size", size(3)),
        ],
    )
    .await;
    declare_quorum_with(&c, &stays, &[("x-quorum-initial-group-size", size(1))]).await;
    let start = Instant::now();
    while (1..=3).any(|n| api_members(&c, n, &grows) != [1, 2, 3]) {
        assert!(
            start.elapsed() < WAIT,
            "members {:?}",
            api_members(&c, 1, &grows)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(api_members(&c, 1, &stays), [1]);
}

/// `x-quorum-initial-group-size` 2 on a cluster of three: the queue's members are the node it
/// was declared on and the next; the third holds the group as a learner (its quorum status
/// says `non_voter`), takes the queue's messages from the log as the others do, serves its
/// clients, and is never quorum-critical for the queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quorum_queue_of_two_voters_keeps_the_third_node_as_a_learner() {
    let c = TestCluster::start(3, 20);
    let q = unique("pair");
    declare_quorum_with(
        &c,
        &q,
        &[(
            "x-quorum-initial-group-size",
            lapin::types::AMQPValue::LongLongInt(2),
        )],
    )
    .await;
    for n in 1..=3 {
        assert_eq!(api_members(&c, n, &q), [1, 2], "node {n}'s API");
    }
    let status = |n: u64| {
        let (_, v) =
            Api::of(c.node(n)).call("GET", &format!("/queues/%2f/{q}/quorum-status"), None);
        v["membership"].as_str().unwrap_or_default().to_owned()
    };
    let start = Instant::now();
    while status(3) != "non_voter" {
        assert!(start.elapsed() < WAIT, "node 3: {}", status(3));
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!((status(1), status(2)), ("voter".into(), "voter".into()));
    // Published through the learner's node, applied on all three; consumed there too.
    let (_conn, ch) = channel(&c, 3).await;
    publish_confirmed(&ch, &q, (0..5).map(|i| format!("m{i}"))).await;
    for n in 1..=3 {
        wait_for_messages(&c, n, &q, 5);
    }
    let got = ch
        .basic_get(q.as_str().into(), BasicGetOptions { no_ack: true })
        .await
        .expect("basic.get on the learner's node");
    assert!(got.is_some(), "a message through the learner's node");
    let critical = |n: u64| {
        let (_, v) = Api::of(c.node(n)).call("GET", "/health/checks/node-is-quorum-critical", None);
        v["queues"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|x| x["name"].as_str() == Some(q.as_str()))
    };
    assert_eq!([critical(1), critical(2), critical(3)], [true, true, false]);
    // rabbitmq-queues' commands: node 3 made a voter, node 1 shrunk off (a learner now), node 2
    // deleted; the last member cannot go.
    let ctl = |n: u64, args: &[&str]| {
        let out = c.ctl(n, args);
        (
            out.status.success(),
            format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        )
    };
    let (ok, said) = ctl(1, &["add_member", &q, "3"]);
    assert!(ok, "{said}");
    for n in 1..=3 {
        assert_eq!(
            api_members(&c, n, &q),
            [1, 2, 3],
            "node {n}'s API after add_member"
        );
    }
    let start = Instant::now();
    while status(3) != "voter" {
        assert!(start.elapsed() < WAIT, "node 3: {}", status(3));
        std::thread::sleep(Duration::from_millis(20));
    }
    let (ok, said) = ctl(2, &["shrink", "1"]);
    assert!(ok, "{said}");
    assert!(
        said.contains(&format!("name: {q}\tsize: 2\tresult: ok")),
        "{said}"
    );
    assert_eq!(api_members(&c, 2, &q), [2, 3]);
    let start = Instant::now();
    while status(1) != "non_voter" {
        assert!(start.elapsed() < WAIT, "node 1: {}", status(1));
        std::thread::sleep(Duration::from_millis(20));
    }
    let (ok, said) = ctl(3, &["delete_member", &q, "2"]);
    assert!(ok, "{said}");
    assert_eq!(api_members(&c, 1, &q), [3]);
    let (ok, said) = ctl(3, &["delete_member", &q, "3"]);
    assert!(!ok && said.contains("last member"), "{said}");
    // The queue goes on with its one voter, through a learner's node.
    let (_conn1, ch1) = channel(&c, 1).await;
    publish_confirmed(&ch1, &q, std::iter::once("after".to_owned())).await;
    wait_for_messages(&c, 3, &q, 5);
    // grow: `even` passes over a queue of one voter; `all` with its name makes node 1 one.
    let (ok, said) = ctl(2, &["grow", "1", "even"]);
    assert!(ok, "{said}");
    assert_eq!(api_members(&c, 2, &q), [3]);
    let pattern = format!("^{q}$");
    let (ok, said) = ctl(2, &["grow", "1", "all", "--queue-pattern", &pattern]);
    assert!(ok, "{said}");
    assert_eq!(api_members(&c, 3, &q), [1, 3]);
}
