//! `warren ctl drain` and `warren ctl revive`: RabbitMQ's `rabbitmq-upgrade drain` and
//! `revive`, for the node whose management API `--api` names (drain acts on the node that
//! answers, as rabbitmq-upgrade acts on its `-n` node), with `rabbitmq-queues
//! check_if_node_is_quorum_critical` and `rabbitmq-upgrade await_online_quorum_plus_one` for
//! that node; and `warren ctl rebalance`, RabbitMQ's `rabbitmq-queues rebalance quorum`, for the
//! whole cluster.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::api::{enc, Api};
use super::table::{col, render};
use super::{CliError, Conn};

#[derive(clap::Subcommand, Debug, Clone)]
pub enum MaintenanceCmd {
    /// Puts the node into maintenance mode: it takes no new client connection, closes those
    /// it has (clients reconnect to another node), and hands the leadership of its quorum
    /// queues to the other nodes; it keeps running. Returns once it leads no queue.
    Drain {
        /// How long to wait for the leaderships to move, in seconds
        #[arg(long, default_value_t = 60.0)]
        wait: f64,
        #[command(flatten)]
        conn: Conn,
    },
    /// Takes the node out of maintenance mode: it serves clients again
    Revive {
        #[command(flatten)]
        conn: Conn,
    },
    /// Removes a stopped node from the cluster (RabbitMQ's `forget_cluster_node`): every
    /// quorum queue's group moves to the other nodes, and the node cannot rejoin on its old
    /// data. Returns once no group counts on it any more
    #[command(name = "forget_cluster_node", alias = "forget-cluster-node")]
    ForgetClusterNode {
        /// The node: its name as /api/nodes gives it (warren-3@host), or its number
        node: String,
        /// How long to wait for every group to move, in seconds
        #[arg(long, default_value_t = 60.0)]
        wait: f64,
        #[command(flatten)]
        conn: Conn,
    },
    /// Makes the node, running on its own, a node of a running cluster (RabbitMQ's `stop_app`,
    /// `reset`, `join_cluster` and `start_app` in one): it stops, empties its data directory,
    /// saves these settings in it and starts again asking SEED to add it; it takes the
    /// cluster's definitions and every quorum queue. A node holding messages refuses unless
    /// `--force`. Returns once the cluster lists it and no group is still taking it in
    #[command(name = "join_cluster", alias = "join-cluster")]
    JoinCluster(JoinCluster),
    /// Fails (exit 1) if stopping the node would leave a quorum queue, or the cluster's
    /// definitions, without a majority of running members, naming them (RabbitMQ's
    /// `rabbitmq-queues check_if_node_is_quorum_critical`)
    #[command(
        name = "check_if_node_is_quorum_critical",
        alias = "check-if-node-is-quorum-critical"
    )]
    CheckIfNodeIsQuorumCritical {
        #[command(flatten)]
        conn: Conn,
    },
    /// Waits until stopping the node would leave every quorum queue, and the cluster's
    /// definitions, a majority of running members: every other member is back (RabbitMQ's
    /// `rabbitmq-upgrade await_online_quorum_plus_one`); fails once `--wait` passes
    #[command(
        name = "await_online_quorum_plus_one",
        alias = "await-online-quorum-plus-one"
    )]
    AwaitOnlineQuorumPlusOne {
        /// How long to wait, in seconds
        #[arg(long, default_value_t = 120.0)]
        wait: f64,
        #[command(flatten)]
        conn: Conn,
    },
    /// The cluster's nodes, those running, their versions, maintenance states, alarms and
    /// listeners, as RabbitMQ's `rabbitmqctl cluster_status`
    #[command(name = "cluster_status", alias = "cluster-status")]
    ClusterStatus {
        #[command(flatten)]
        out: super::ctl::Out,
    },
    /// Shows each member of a quorum queue's Raft group as its node sees it: state, membership,
    /// log, applied, commit and snapshot indexes, term (RabbitMQ's `rabbitmq-queues
    /// quorum_status`). Asks every node's management API; a node that does not answer is shown
    /// as `noproc` with the reason
    #[command(name = "quorum_status", alias = "quorum-status")]
    QuorumStatus {
        /// The queue
        queue: String,
        #[command(flatten)]
        conn: super::InVhost,
    },
    /// Evens out the quorum queues' leaders over the running nodes (not those in maintenance
    /// mode), showing each round's leaders per node; safe to interrupt
    Rebalance {
        /// How long to keep going, in seconds
        #[arg(long, default_value_t = 60.0)]
        wait: f64,
        #[command(flatten)]
        conn: Conn,
    },
}

#[derive(clap::Args, Debug, Clone)]
pub struct JoinCluster {
    /// Running nodes of the cluster, as their --cluster-nodes entries: N=HOST:PORT, one or
    /// more, comma-separated (the others come with the cluster's metadata)
    pub seed: String,
    /// This node's number in the cluster: one no node of it has (a forgotten node's may be
    /// taken again)
    #[arg(long)]
    pub cluster_node: u64,
    /// Where the other nodes reach this node: HOST:PORT of its cluster listener
    #[arg(long)]
    pub cluster_address: String,
    /// The file that holds the cluster's secret, on the node's host (read at every start)
    #[arg(long)]
    pub cluster_secret_file: std::path::PathBuf,
    /// This node's certificate for the cluster's TLS links, when the cluster uses them
    #[arg(long, requires_all = ["cluster_tls_key", "cluster_tls_ca"])]
    pub cluster_tls_cert: Option<std::path::PathBuf>,
    /// Its private key
    #[arg(long, requires_all = ["cluster_tls_cert", "cluster_tls_ca"])]
    pub cluster_tls_key: Option<std::path::PathBuf>,
    /// The CA that signs every node's certificate
    #[arg(long, requires_all = ["cluster_tls_cert", "cluster_tls_key"])]
    pub cluster_tls_ca: Option<std::path::PathBuf>,
    /// Drop the messages the node holds (it starts empty either way)
    #[arg(long)]
    pub force: bool,
    /// How long to wait for the cluster to take the node in, in seconds
    #[arg(long, default_value_t = 120.0)]
    pub wait: f64,
    #[command(flatten)]
    pub conn: Conn,
}

pub fn name(c: &MaintenanceCmd) -> &'static str {
    match c {
        MaintenanceCmd::Drain { .. } => "ctl drain",
        MaintenanceCmd::Revive { .. } => "ctl revive",
        MaintenanceCmd::Rebalance { .. } => "ctl rebalance",
        MaintenanceCmd::ForgetClusterNode { .. } => "ctl forget_cluster_node",
        MaintenanceCmd::JoinCluster(_) => "ctl join_cluster",
        MaintenanceCmd::CheckIfNodeIsQuorumCritical { .. } => {
            "ctl check_if_node_is_quorum_critical"
        }
        MaintenanceCmd::AwaitOnlineQuorumPlusOne { .. } => "ctl await_online_quorum_plus_one",
        MaintenanceCmd::QuorumStatus { .. } => "ctl quorum_status",
        MaintenanceCmd::ClusterStatus { .. } => "ctl cluster_status",
    }
}

/// `seconds` as a duration: negative is none, too large (or infinite) is for ever.
pub(super) fn seconds(s: f64) -> Duration {
    Duration::try_from_secs_f64(s.max(0.0)).unwrap_or(Duration::MAX)
}

/// `now + d`, or a day from now (as good as never for a wait) when that would overflow.
fn deadline(d: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(d)
        .unwrap_or_else(|| now + Duration::from_secs(86_400))
}

/// The name of the node that answers at `api`.
fn node_name(api: &Api) -> Result<String, CliError> {
    let overview = api.get("/overview", "the node's overview")?;
    overview["node"]
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| CliError::Failed("the API's overview names no node".into()))
}

/// What the node still leads: replicated queues, and whether the metadata group (`None` when
/// the answer is not the node's own, as from another node behind a load balancer).
fn still_leading(node: &Value, name: &str) -> Option<(u64, bool)> {
    if node["name"] != name {
        return None;
    }
    let cluster = &node["cluster"];
    if cluster.is_null() {
        // A node on its own has nothing to hand over.
        return Some((0, false));
    }
    if cluster.get("figures_age_ms").is_some() {
        // Another node's copy of this node's figures (seconds old): not the node's own answer.
        return None;
    }
    let queues = cluster["queues_led"].as_u64()?;
    let metadata = cluster["metadata_leader"].as_u64() == cluster["node"].as_u64();
    Some((queues, metadata))
}

pub fn main(c: &MaintenanceCmd) -> Result<(), CliError> {
    match c {
        MaintenanceCmd::Drain { wait, conn } => drain(&conn.api(), *wait),
        MaintenanceCmd::Rebalance { wait, conn } => rebalance(&conn.api(), *wait),
        MaintenanceCmd::ForgetClusterNode { node, wait, conn } => forget(&conn.api(), node, *wait),
        MaintenanceCmd::JoinCluster(j) => join_cluster(&j.conn.api(), j),
        MaintenanceCmd::CheckIfNodeIsQuorumCritical { conn } => {
            let api = conn.api();
            let node = node_name(&api)?;
            match quorum_critical(&api)? {
                None => {
                    println!(
                        "{node}: stopping it leaves every quorum queue a majority of its members"
                    );
                    Ok(())
                }
                Some(names) => Err(critical(&node, &names)),
            }
        }
        MaintenanceCmd::ClusterStatus { out } => {
            super::cluster_status::cluster_status(&out.conn.api(), out.format)
        }
        MaintenanceCmd::QuorumStatus { queue, conn } => {
            quorum_status(&conn.conn, &conn.vhost, queue)
        }
        MaintenanceCmd::AwaitOnlineQuorumPlusOne { wait, conn } => {
            await_quorum_plus_one(&conn.api(), *wait)
        }
        MaintenanceCmd::Revive { conn } => {
            let api = conn.api();
            let node = node_name(&api)?;
            let path = format!("/nodes/{}/revive", enc(&node));
            api.call("POST", &path, None, &[], "the node")?;
            println!("{node} is out of maintenance mode: it serves clients again");
            Ok(())
        }
    }
}

fn drain(api: &Api, wait: f64) -> Result<(), CliError> {
    let node = node_name(api)?;
    let path = format!("/nodes/{}", enc(&node));
    let r = api.call("POST", &format!("{path}/drain"), None, &[], "the node")?;
    println!(
        "{node} is in maintenance mode: it takes no new client connection; {} connection(s) \
         closed",
        r.body["connections_closed"].as_u64().unwrap_or(0)
    );
    let until = deadline(seconds(wait));
    loop {
        let seen = api.get(&path, "the node")?;
        let Some((queues, metadata)) = still_leading(&seen, &node) else {
            return Err(CliError::Failed(format!(
                "the API answered for another node than {node} (a load balancer?): point --api \
                 at {node}'s own management API"
            )));
        };
        if queues == 0 && !metadata {
            println!("{node} leads no queue: it can be stopped");
            return Ok(());
        }
        if Instant::now() >= until {
            return Err(CliError::Failed(format!(
                "{node} still leads {queues} queue(s){} after {wait} s: no other node can take \
                 them (are the other nodes running? see /api/nodes); it stays in maintenance \
                 mode",
                if metadata { " and the metadata" } else { "" }
            )));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Asks the cluster to forget `node`, then waits until no node lists it and every running
/// node reports its groups moved (`cluster.members_changing` 0), and still does once every
/// peer's figure was taken again (they are sent every [`crate::http::FIGURES_EVERY`]): one
/// from before the forget reached that node would say 0 too early.
fn forget(api: &Api, node: &str, wait: f64) -> Result<(), CliError> {
    api.call(
        "POST",
        &format!("/nodes/{}/forget", enc(node)),
        None,
        &[],
        "the node",
    )?;
    println!("the cluster forgets {node}; its quorum queues' groups move to the other nodes");
    let until = deadline(seconds(wait));
    let settle = crate::http::FIGURES_EVERY + Duration::from_secs(1);
    let mut settled_since: Option<Instant> = None;
    let mut shown = None;
    loop {
        let nodes = api.get("/nodes", "the cluster's nodes")?;
        let list = nodes.as_array().cloned().unwrap_or_default();
        let listed = list.iter().any(|n| {
            n["name"] == node
                || n["cluster"]["node"]
                    .as_u64()
                    .map(|id| id.to_string())
                    .as_deref()
                    == Some(node)
        });
        let moving: Option<u64> = list
            .iter()
            .filter(|n| n["running"] == true)
            .map(|n| n["cluster"]["members_changing"].as_u64())
            .sum();
        if !listed && moving == Some(0) {
            let since = *settled_since.get_or_insert_with(Instant::now);
            if since.elapsed() >= settle {
                println!("{node} is forgotten: no quorum queue counts on it any more");
                return Ok(());
            }
        } else {
            settled_since = None;
        }
        if moving != shown {
            if let Some(m) = moving {
                println!("groups still moving off {node}: {m}");
            }
            shown = moving;
        }
        if Instant::now() >= until {
            return Err(CliError::Failed(format!(
                "the groups have not all moved off {node} after {wait} s{}: they go on moving \
                 in the background (cluster.members_changing in /api/nodes counts them; a \
                 group needs a majority of its members running to change)",
                moving.map_or(String::new(), |m| format!(" ({m} still moving)"))
            )));
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// A path the node reads on its host: made absolute here when it exists here (the usual case,
/// the command run on the node's host), else sent as given.
fn node_path(p: &std::path::Path) -> String {
    std::fs::canonicalize(p)
        .unwrap_or_else(|_| p.to_path_buf())
        .display()
        .to_string()
}

/// Asks the node to join the cluster, then waits until it answers under its new name, the
/// cluster lists it, and no running node is still taking it into a group.
fn join_cluster(api: &Api, j: &JoinCluster) -> Result<(), CliError> {
    let before = node_name(api)?;
    let mut body = serde_json::json!({
        "node": j.cluster_node,
        "nodes": format!("{},{}={}", j.seed.trim_end_matches(','), j.cluster_node, j.cluster_address),
        "secret_file": node_path(&j.cluster_secret_file),
        "force": j.force,
    });
    for (key, file) in [
        ("tls_cert", &j.cluster_tls_cert),
        ("tls_key", &j.cluster_tls_key),
        ("tls_ca", &j.cluster_tls_ca),
    ] {
        if let Some(f) = file {
            body[key] = node_path(f).into();
        }
    }
    let asked = Instant::now();
    let r = api.call("POST", "/cluster/join", Some(&body), &[], "the node")?;
    let name = r.body["node"].as_str().unwrap_or_default().to_owned();
    let dropped = r.body["messages_dropped"].as_u64().unwrap_or(0);
    println!(
        "{before} stops, empties its data directory{} and starts again as {name}, asking the \
         cluster to add it",
        if dropped > 0 {
            format!(" (dropping {dropped} message(s))")
        } else {
            String::new()
        }
    );
    let until = deadline(seconds(j.wait));
    // The nodes' figures in /api/nodes are sent every FIGURES_EVERY: a 0 from before the
    // groups began taking the node in would say done too early.
    let settle = crate::http::FIGURES_EVERY + Duration::from_secs(1);
    let mut settled_since: Option<Instant> = None;
    let mut said = None;
    loop {
        std::thread::sleep(Duration::from_millis(250));
        let now = match joined(api, (&before, asked), &name) {
            Err(CliError::Failed(back)) if back == CALLED_OFF => {
                return Err(CliError::Failed(format!(
                    "{before} called joining the cluster off: messages came while it stopped, \
                     and it keeps them; it runs on its own again (its log says how many). Move \
                     them, or ask again with --force to drop them"
                )));
            }
            Ok(None) => {
                let since = *settled_since.get_or_insert_with(Instant::now);
                if since.elapsed() >= settle {
                    println!("{name} is a node of the cluster; its quorum queues are in");
                    return Ok(());
                }
                continue;
            }
            Ok(Some(state)) => state,
            // Until it holds the cluster's definitions the node knows only guest and the
            // users of its config file; then the cluster's. Either may lack this one.
            Err(CliError::Unauthorized { user, .. }) => format!(
                "the node refuses user '{user}' (401): until it holds the cluster's \
                 definitions it knows only guest and the users of its config file, then the \
                 cluster's users"
            ),
            Err(CliError::Unreachable { .. }) => "restarting".to_owned(),
            Err(e) => e.to_string(),
        };
        settled_since = None;
        if said.as_ref() != Some(&now) {
            println!("{now}");
            said = Some(now.clone());
        }
        if Instant::now() >= until {
            return Err(CliError::Failed(format!(
                "{name} has not joined after {} s ({now}): it goes on asking; its log says why \
                 (a wrong secret, a seed that cannot be reached, a number the cluster has). To \
                 give up, stop it and remove {} from its data directory: it starts on its own \
                 again, empty once it had started to join",
                j.wait,
                crate::joining::FILE
            )));
        }
    }
}

/// What [`joined`] says of a node started again under its old name.
const CALLED_OFF: &str = "started again under its old name";

/// How long (ms) the node named `name` at `api` has been running.
fn uptime(api: &Api, name: &str) -> Result<u64, CliError> {
    let node = api.get(&format!("/nodes/{}", enc(name)), "the node")?;
    Ok(node["uptime"].as_u64().unwrap_or(u64::MAX))
}

/// What the node at `api` still waits for before it is a node of the cluster under `name`:
/// `None` once nothing. Fails with [`CALLED_OFF`] when it runs again under its name `before`
/// (it started after it was `asked`).
fn joined(
    api: &Api,
    (before, asked): (&str, Instant),
    name: &str,
) -> Result<Option<String>, CliError> {
    let overview = api.get("/overview", "the node's overview")?;
    if overview["node"] == before && before != name {
        let since_asked = u64::try_from(asked.elapsed().as_millis()).unwrap_or(u64::MAX);
        if uptime(api, before)? < since_asked {
            return Err(CliError::Failed(CALLED_OFF.into()));
        }
        return Ok(Some("stopping".into()));
    }
    if overview["node"] != name {
        return Ok(Some("restarting".into()));
    }
    let own = api.get(&format!("/nodes/{}", enc(name)), "the node")?;
    if own["cluster"]["joining"] != false {
        return Ok(Some(format!("{name} is up and asks the cluster to add it")));
    }
    let nodes = api.get("/nodes", "the cluster's nodes")?;
    let list = nodes.as_array().cloned().unwrap_or_default();
    if list.len() < 2 || !list.iter().any(|n| n["name"] == name) {
        return Ok(Some(format!("{name} is up and asks the cluster to add it")));
    }
    let moving: u64 = list
        .iter()
        .filter(|n| n["running"] == true)
        .filter_map(|n| n["cluster"]["members_changing"].as_u64())
        .sum();
    if moving > 0 {
        return Ok(Some(format!(
            "in the cluster; groups still taking it in: {moving}"
        )));
    }
    Ok(None)
}

/// What stopping the node at `api` would leave without a majority of running members: `None`
/// when nothing (a node on its own included), else their names (`queue 'q' in vhost '/'`, the
/// definitions as `warren_metadata`).
fn quorum_critical(api: &Api) -> Result<Option<Vec<String>>, CliError> {
    let path = "/health/checks/node-is-quorum-critical";
    let (passed, body) = api.health(path, "the quorum-critical check")?;
    if passed {
        return Ok(None);
    }
    let names = body["queues"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|q| q["readable_name"].as_str().map(str::to_owned))
        .collect();
    Ok(Some(names))
}

/// The error of a node whose stop would leave `names` without a majority.
fn critical(node: &str, names: &[String]) -> CliError {
    const SHOWN: usize = 20;
    let mut list = names
        .iter()
        .take(SHOWN)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    if names.len() > SHOWN {
        list.push_str(&format!(" and {} more", names.len() - SHOWN));
    }
    CliError::Failed(format!(
        "{node} is quorum-critical: stopping it now would leave {} without a majority of running \
         members: {list} (start the cluster's other nodes, or wait for them: warren ctl \
         await_online_quorum_plus_one)",
        match names.len() {
            1 => "1 quorum group".to_owned(),
            n => format!("{n} quorum groups"),
        }
    ))
}

/// Asks the quorum-critical check until it passes, saying once what it waits for.
fn await_quorum_plus_one(api: &Api, wait: f64) -> Result<(), CliError> {
    let node = node_name(api)?;
    let until = deadline(seconds(wait));
    let mut said = false;
    loop {
        match quorum_critical(api)? {
            None => {
                println!("{node}: every quorum queue has a majority of running members without it");
                return Ok(());
            }
            Some(names) => {
                if Instant::now() >= until {
                    return Err(CliError::Failed(format!(
                        "still waited for after {wait} s: {}",
                        critical(&node, &names)
                    )));
                }
                if !said {
                    println!(
                        "{node}: waiting for {} quorum group(s) to have a majority without it",
                        names.len()
                    );
                    said = true;
                }
            }
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// The quorum queues' leaders per node as the API shows them: every running node not in
/// maintenance mode, with 0 for one that leads none; the others (a drained node, no leader
/// known: `""`) too, but [`spread`] leaves them out (`Some` marks the nodes that take part).
fn leaders(api: &Api) -> Result<BTreeMap<String, (usize, bool)>, CliError> {
    let mut led = BTreeMap::new();
    let nodes = api.get("/nodes", "the cluster's nodes")?;
    for n in nodes.as_array().into_iter().flatten() {
        if n["running"] == true && n["being_drained"] != true {
            if let Some(name) = n["name"].as_str() {
                led.insert(name.to_owned(), (0, true));
            }
        }
    }
    let queues = api.get("/queues?columns=name,type,leader", "the queues")?;
    for q in queues.as_array().into_iter().flatten() {
        if q["type"] != "quorum" {
            continue;
        }
        let leader = q["leader"].as_str().unwrap_or("").to_owned();
        led.entry(leader).or_insert((0, false)).0 += 1;
    }
    Ok(led)
}

/// How far apart the most and the fewest leaderships of a node are.
fn spread(led: &BTreeMap<String, (usize, bool)>) -> usize {
    let counts: Vec<usize> = led
        .values()
        .filter(|(_, takes_part)| *takes_part)
        .map(|(c, _)| *c)
        .collect();
    let most = counts.iter().copied().max().unwrap_or(0);
    let fewest = counts.iter().copied().min().unwrap_or(0);
    most - fewest
}

fn show(round: usize, led: &BTreeMap<String, (usize, bool)>) {
    let list: Vec<String> = led
        .iter()
        .map(|(n, (c, takes_part))| match (n.is_empty(), takes_part) {
            (true, _) => format!("no leader {c}"),
            (false, true) => format!("{n} {c}"),
            (false, false) => format!("{n} {c} (down or in maintenance mode)"),
        })
        .collect();
    println!("round {round}: quorum queue leaders: {}", list.join(", "));
}

/// Asks for rebalance rounds until the leaders are even (one apart at most), nothing moves
/// any more, or `wait` seconds have passed.
fn rebalance(api: &Api, wait: f64) -> Result<(), CliError> {
    let until = deadline(seconds(wait));
    let mut led = leaders(api)?;
    show(0, &led);
    let mut round = 0;
    let mut still = 0;
    while spread(&led) > 1 {
        if Instant::now() >= until {
            return Err(CliError::Failed(format!(
                "the leaders are still uneven after {wait} s; run it again, or see the nodes' \
                 logs (a node that is down or in maintenance mode takes none)"
            )));
        }
        round += 1;
        api.call("POST", "/rebalance/queues", None, &[], "rebalancing")?;
        // A transfer takes a few Raft rounds; the API's view of the leaders follows.
        let settle = Instant::now() + Duration::from_secs(2);
        let before = led.clone();
        while Instant::now() < settle {
            std::thread::sleep(Duration::from_millis(200));
            led = leaders(api)?;
            if spread(&led) <= 1 {
                break;
            }
        }
        show(round, &led);
        still = if led == before { still + 1 } else { 0 };
        if still >= 3 {
            return Err(CliError::Failed(
                "nothing moved in the last three rounds and the leaders are still uneven (a \
                 member catching up takes no leadership); run it again later"
                    .into(),
            ));
        }
    }
    println!("quorum queue leaders are even");
    Ok(())
}

/// `warren ctl quorum_status`: every node's row for the queue, leader first.
fn quorum_status(conn: &Conn, vhost: &str, queue: &str) -> Result<(), CliError> {
    let api = conn.api();
    let here = node_name(&api)?;
    let path = format!("/queues/{}/{}/quorum-status", enc(vhost), enc(queue));
    let what = format!("queue '{queue}' in vhost '{vhost}'");
    // This node's row first: a queue that is missing or not replicated fails here, once.
    let mine = api.get(&path, &what)?;
    let nodes = api.get("/nodes", "the cluster's nodes")?;
    let mut rows = Vec::new();
    for n in nodes.as_array().into_iter().flatten() {
        let Some(name) = n["name"].as_str() else {
            continue;
        };
        if name == here {
            rows.push(mine.clone());
            continue;
        }
        rows.push(match member_api(conn, n) {
            Some(peer) => match peer.get(&path, &what) {
                Ok(row) => row,
                Err(e) => noproc(name, &e.to_string()),
            },
            None => noproc(name, "its management API is not known (is it running?)"),
        });
    }
    rows.sort_by_key(|r| {
        (
            r["raft_state"] != "leader",
            r["node"].as_str().map(str::to_owned),
        )
    });
    println!("Status of quorum queue {queue} in vhost {vhost} on node {here} ...");
    let mut columns = vec![
        col("Node Name", "node"),
        col("Raft State", "raft_state"),
        col("Membership", "membership"),
        col("Last Log Index", "last_log_index"),
        col("Last Applied", "last_applied"),
        col("Commit Index", "commit_index"),
        col("Snapshot Index", "snapshot_index"),
        col("Term", "term"),
        col("Machine Version", "machine_version"),
    ];
    if rows.iter().any(|r| r.get("reason").is_some()) {
        columns.push(col("Reason", "reason"));
    }
    print!("{}", render(&columns, &rows));
    Ok(())
}

/// The management API of the node `n` of `/api/nodes` lists, with `conn`'s credentials: the
/// host in its name (`warren-2@host`), the port and scheme it announces.
fn member_api(conn: &Conn, n: &Value) -> Option<Api> {
    let host = n["name"].as_str()?.rsplit_once('@')?.1;
    let m = &n["cluster"]["management"];
    let port = m["port"].as_u64()?;
    let scheme = m["scheme"].as_str().unwrap_or("http");
    // A bare IPv6 address goes in brackets.
    let host = if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]")
    } else {
        host.to_owned()
    };
    Some(Api::new(
        &format!("{scheme}://{host}:{port}"),
        &conn.user,
        &conn.password,
    ))
}

/// The row of a member whose node did not answer.
fn noproc(node: &str, reason: &str) -> Value {
    serde_json::json!({"node": node, "raft_state": "noproc", "reason": reason})
}
