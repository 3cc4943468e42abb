//! A cluster of spawned brokers on loopback ports, each with its own data directory, for the
//! replicated-queue tests.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::http::Api;
use crate::partition::Links;
use crate::{free_port, TestBroker, WAIT};

pub struct TestCluster {
    /// Node `n` is `nodes[n - 1]`.
    pub nodes: Vec<TestBroker>,
    dir: PathBuf,
    /// The proxies of the cluster's links, when the test partitions it.
    links: Option<Links>,
    /// Every node's cluster address, the Raft tick, and the arguments each node was given
    /// beyond its own: for a node added later ([`TestCluster::add_joining_node`]).
    addrs: Vec<(u64, std::net::SocketAddr)>,
    tick_ms: u64,
    extra: Vec<String>,
}

impl TestCluster {
    /// Give this among the extra arguments for nodes with the SQS endpoint on (it is off).
    pub const WITH_SQS: &'static str = "(with the SQS endpoint)";

    /// Starts `size` nodes (numbered from 1) that form one cluster, with a short Raft tick, and
    /// waits until every node sees a leader of the cluster's metadata.
    pub fn start(size: u64, tick_ms: u64) -> TestCluster {
        Self::start_with(size, tick_ms, &[])
    }

    /// [`TestCluster::start`] with more arguments for every node.
    pub fn start_with(size: u64, tick_ms: u64, extra: &[&str]) -> TestCluster {
        Self::start_on(size, tick_ms, extra, false)
    }

    /// [`TestCluster::start_with`], each cluster link through a proxy of its own, so that
    /// [`TestCluster::cut`] can partition the nodes.
    pub fn start_partitionable(size: u64, tick_ms: u64, extra: &[&str]) -> TestCluster {
        Self::start_on(size, tick_ms, extra, true)
    }

    fn start_on(size: u64, tick_ms: u64, extra: &[&str], proxied: bool) -> TestCluster {
        let dir = std::env::temp_dir().join(crate::unique("warren-cluster"));
        std::fs::create_dir_all(&dir).expect("cluster dir");
        let secret = dir.join("secret");
        std::fs::write(&secret, "a test secret of more than sixteen bytes").expect("secret");
        let real: Vec<(u64, std::net::SocketAddr)> = (1..=size)
            .map(|n| (n, std::net::SocketAddr::from(([127, 0, 0, 1], free_port()))))
            .collect();
        let text = |view: &[(u64, std::net::SocketAddr)]| {
            let list: Vec<String> = view.iter().map(|(n, a)| format!("{n}={a}")).collect();
            list.join(",")
        };
        // Every node's list: its own address, and how it reaches each peer.
        let (links, lists): (Option<Links>, Vec<String>) = if proxied {
            let (links, views) = Links::start(&real);
            (Some(links), views.iter().map(|(_, v)| text(v)).collect())
        } else {
            (None, (1..=size).map(|_| text(&real)).collect())
        };
        let nodes = (1..=size)
            .map(|n| spawn_node(&dir, n, &lists[(n - 1) as usize], tick_ms, extra, false))
            .collect();
        let c = TestCluster {
            nodes,
            dir,
            links,
            addrs: real,
            tick_ms,
            extra: extra.iter().map(|a| (*a).to_owned()).collect(),
        };
        for n in 1..=size {
            c.wait_for_metadata_leader(n);
        }
        c
    }

    /// Starts node `len + 1` with `--cluster-join` and an empty data directory, listing the
    /// nodes in `known` and itself: it asks them to add it to the cluster. Returns its number
    /// (not waiting for the cluster to take it).
    pub fn add_joining_node(&mut self, known: &[u64]) -> u64 {
        let n = self.nodes.len() as u64 + 1;
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], free_port()));
        self.addrs.push((n, addr));
        let node = self.spawn_joining(n, known);
        self.nodes.push(node);
        n
    }

    /// Starts node `n` with `--cluster-join`, listing the nodes in `known` and itself.
    fn spawn_joining(&self, n: u64, known: &[u64]) -> TestBroker {
        let list: Vec<String> = self
            .addrs
            .iter()
            .filter(|(id, _)| known.contains(id) || *id == n)
            .map(|(id, a)| format!("{id}={a}"))
            .collect();
        let extra: Vec<&str> = self.extra.iter().map(String::as_str).collect();
        spawn_node(&self.dir, n, &list.join(","), self.tick_ms, &extra, true)
    }

    /// Replaces node `n`, which must be stopped, with a new node under the same number and
    /// cluster address: an empty data directory, `--cluster-join`, listing the nodes in
    /// `known` and itself (a StatefulSet pod scaled away with its claim and scaled back).
    pub fn rejoin_empty(&mut self, n: u64, known: &[u64]) {
        let i = usize::try_from(n - 1).expect("a node number");
        assert!(
            self.nodes[i].pid().is_none(),
            "node {n} must be stopped first"
        );
        let _ = std::fs::remove_dir_all(self.dir.join(format!("node{n}")));
        self.nodes[i] = self.spawn_joining(n, known);
    }

    /// Cuts node `n` off from the other nodes (it keeps running and serving its clients).
    /// Panics if the cluster was not started with [`TestCluster::start_partitionable`].
    pub fn cut(&self, n: u64) {
        self.links.as_ref().expect("a partitionable cluster").cut(n);
    }

    /// Delays what the other nodes send node `n` by `by`.
    /// Panics if the cluster was not started with [`TestCluster::start_partitionable`].
    pub fn delay_to(&self, n: u64, by: Duration) {
        self.links
            .as_ref()
            .expect("a partitionable cluster")
            .delay_to(n, by);
    }

    /// Heals node `n`'s links.
    pub fn heal(&self, n: u64) {
        self.links
            .as_ref()
            .expect("a partitionable cluster")
            .heal(n);
    }

    /// Node `n`'s cluster address (`--cluster-nodes` entry), as its peers reach it.
    pub fn cluster_address(&self, n: u64) -> std::net::SocketAddr {
        self.addrs
            .iter()
            .find(|(id, _)| *id == n)
            .map(|(_, a)| *a)
            .expect("a node of the cluster")
    }

    /// Node `n`'s data directory.
    pub fn data_dir(&self, n: u64) -> PathBuf {
        self.dir.join(format!("node{n}"))
    }

    pub fn node(&self, n: u64) -> &TestBroker {
        &self.nodes[(n - 1) as usize]
    }

    /// Runs `warren ctl ARGS` against node `n`'s management API.
    pub fn ctl(&self, n: u64, args: &[&str]) -> std::process::Output {
        let api = self.node(n).http_url().expect("the management API is on");
        std::process::Command::new(crate::warren_binary())
            .arg("ctl")
            .args(args)
            .args(["--api", api])
            .output()
            .expect("run warren ctl")
    }

    pub fn node_mut(&mut self, n: u64) -> &mut TestBroker {
        &mut self.nodes[(n - 1) as usize]
    }

    /// Declares a durable quorum queue on node `n` (the cluster replicates it on every node).
    pub async fn declare_quorum_queue(&self, n: u64, name: &str) {
        self.declare_quorum_queue_with(n, name, &[]).await;
    }

    /// [`TestCluster::declare_quorum_queue`] with more arguments, once every node knows every
    /// node's feature level ([`TestCluster::wait_for_feature_levels`]).
    pub async fn declare_quorum_queue_with(
        &self,
        n: u64,
        name: &str,
        extra: &[(&str, lapin::types::AMQPValue)],
    ) {
        if !extra.is_empty() {
            self.wait_for_feature_levels();
        }
        let conn = self.node(n).connect().await;
        let ch = conn.create_channel().await.expect("channel");
        let mut args = lapin::types::FieldTable::default();
        args.insert(
            "x-queue-type".into(),
            lapin::types::AMQPValue::LongString("quorum".into()),
        );
        for (k, v) in extra {
            args.insert((*k).into(), v.clone());
        }
        let durable = lapin::options::QueueDeclareOptions {
            durable: true,
            ..Default::default()
        };
        ch.queue_declare(name.into(), durable, args)
            .await
            .expect("declare a quorum queue");
    }

    /// Waits until every node knows every node's feature level (it reports one above 0). Until
    /// then a node counts an unknown node as the oldest, and ignores the queue arguments of
    /// newer features (`x-quorum-initial-group-size`), as it must in a mixed cluster.
    pub fn wait_for_feature_levels(&self) {
        let start = Instant::now();
        for n in 1..=self.nodes.len() as u64 {
            let api = Api::of(self.node(n));
            loop {
                let (_, v) = api.call("GET", "/nodes", None);
                if v[0]["cluster"]["feature_level"]
                    .as_u64()
                    .is_some_and(|l| l > 0)
                {
                    break;
                }
                assert!(
                    start.elapsed() < WAIT,
                    "node {n} does not know every node's feature level: {v}"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }

    /// Waits until node `n` knows who leads the cluster's metadata.
    pub fn wait_for_metadata_leader(&self, n: u64) -> u64 {
        let api = Api::of(self.node(n));
        let start = Instant::now();
        loop {
            let (status, v) = api.call("GET", "/nodes", None);
            if let Some(l) = v[0]["cluster"]["metadata_leader"].as_u64() {
                return l;
            }
            assert!(
                start.elapsed() < WAIT,
                "node {n} sees no metadata leader: {status} {v}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Puts node `n` into maintenance mode through its API and waits, at most `patience`,
    /// until it leads no queue and not the metadata.
    pub fn drain(&self, n: u64, patience: Duration) {
        let api = Api::of(self.node(n));
        let (_, me) = api.call("GET", "/overview", None);
        let name = me["node"]
            .as_str()
            .expect("a node name")
            .replace('@', "%40");
        let (status, v) = api.call("POST", &format!("/nodes/{name}/drain"), None);
        assert!(status < 300, "drain: {status} {v}");
        let start = Instant::now();
        loop {
            let (_, v) = api.call("GET", &format!("/nodes/{name}"), None);
            let cluster = &v["cluster"];
            if cluster["queues_led"] == 0 && cluster["metadata_leader"] != cluster["node"] {
                return;
            }
            assert!(start.elapsed() < patience, "drain of node {n}: {v}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits until node `asked` has fresh figures of node `of` announcing its HTTP endpoint
    /// `part` (`management`, `sqs`): what it needs to send a call on to that node.
    pub fn wait_for_endpoint(&self, asked: u64, of: u64, part: &str) {
        let api = Api::of(self.node(asked));
        let start = Instant::now();
        loop {
            let (_, nodes) = api.call("GET", "/nodes", None);
            let announced = nodes.as_array().is_some_and(|l| {
                l.iter().any(|n| {
                    n["name"].as_str().and_then(node_number) == Some(of)
                        && n["cluster"][part]["port"].is_u64()
                })
            });
            if announced {
                return;
            }
            assert!(
                start.elapsed() < WAIT,
                "node {asked} has no figures of node {of}'s {part}: {nodes}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The node that leads `queue` (of vhost `/`), as node `asked` reports it, once it does.
    pub fn leader_of(&self, queue: &str, asked: u64) -> u64 {
        let api = Api::of(self.node(asked));
        let start = Instant::now();
        loop {
            let (status, v) = api.call("GET", &format!("/queues/%2f/{queue}"), None);
            let leader = v["leader"].as_str().and_then(node_number);
            if let Some(l) = leader {
                return l;
            }
            assert!(
                start.elapsed() < WAIT,
                "node {asked} sees no leader of {queue}: {status} {v}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Starts node `n` of a test cluster under `dir` (its data in `node{n}`, the shared secret in
/// `secret`) with `list` for `--cluster-nodes`, asking to join a running cluster if `join`.
fn spawn_node(
    dir: &std::path::Path,
    n: u64,
    list: &str,
    tick_ms: u64,
    extra: &[&str],
    join: bool,
) -> TestBroker {
    let data = dir.join(format!("node{n}")).display().to_string();
    let secret = dir.join("secret").display().to_string();
    let (node, tick) = (n.to_string(), tick_ms.to_string());
    let mut args = vec![
        "--data-dir",
        &data,
        "--cluster-node",
        &node,
        "--cluster-nodes",
        list,
        "--cluster-secret-file",
        &secret,
        "--test-cluster-tick-ms",
        &tick,
    ];
    if join {
        args.push("--cluster-join");
    }
    // The SQS endpoint only where a test asks for it (`WITH_SQS`): each node would take one
    // more port.
    if !extra.contains(&TestCluster::WITH_SQS) {
        args.push("--no-sqs");
    }
    args.extend(
        extra
            .iter()
            .copied()
            .filter(|a| *a != TestCluster::WITH_SQS),
    );
    TestBroker::start_with(&args)
}

impl Drop for TestCluster {
    fn drop(&mut self) {
        // The brokers first (their drop kills them), then their data.
        self.nodes.clear();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The number of a Warren node from its name (`warren-2@127.0.0.1`: 2).
pub fn node_number(name: &str) -> Option<u64> {
    name.strip_prefix("warren-")?
        .split('@')
        .next()?
        .parse()
        .ok()
}
