//! The management API's endpoints (RabbitMQ 3.10's paths, methods and status codes).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{ConnectInfo, Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use base64::Engine;
use serde_json::{json, Value};
use warren_broker::access::{Perm, Resource};
use warren_broker::{DeclareQueue, Message, VhostMeta};
use warren_codec::{FieldTable, ShortStr};
use warren_session::manage::API_CONN;

use super::list::ListQuery;
use super::{
    forward, json as conv, objects, Admin, Api, ApiError, Level, LoggedIn, Login, Need, Unscoped,
    Via,
};

type ApiState = State<Arc<Api>>;
type Peer = ConnectInfo<SocketAddr>;
type Params = Query<HashMap<String, String>>;
type Answer = Result<Response, ApiError>;

fn ok(v: Value) -> Answer {
    Ok(Json(v).into_response())
}

fn no_content() -> Answer {
    Ok(StatusCode::NO_CONTENT.into_response())
}

fn created() -> Answer {
    Ok(StatusCode::CREATED.into_response())
}

pub fn router(api: Arc<Api>) -> Router {
    Router::new()
        .route("/", get(super::ui::page))
        .route("/api/overview", get(overview))
        .route("/api/nodes", get(nodes))
        .route("/api/nodes/{node}", get(one_node))
        .route("/api/nodes/{node}/drain", post(drain))
        .route("/api/nodes/{node}/revive", post(revive))
        .route("/api/nodes/{node}/forget", post(forget))
        .route("/api/cluster/join", post(join_cluster))
        .route("/api/rebalance/queues", post(rebalance))
        .route("/api/extensions", get(extensions))
        .merge(super::access::routes())
        .merge(super::limits::routes())
        .route("/api/whoami", get(whoami))
        .route("/api/vhosts", get(vhosts))
        .route("/api/vhosts/{vhost}/connections", get(vhost_connections))
        .route("/api/vhosts/{vhost}/channels", get(vhost_channels))
        .merge(super::policies::routes())
        .merge(super::parameters::routes())
        .merge(super::global::routes())
        .merge(super::replicas::routes())
        .route("/api/exchanges", get(exchanges_all))
        .route("/api/exchanges/{vhost}", get(exchanges_vhost))
        .route(
            "/api/exchanges/{vhost}/{name}",
            get(one_exchange).put(put_exchange).delete(delete_exchange),
        )
        .route("/api/exchanges/{vhost}/{name}/publish", post(publish))
        .route(
            "/api/exchanges/{vhost}/{name}/bindings/source",
            get(exchange_bindings_source),
        )
        .route(
            "/api/exchanges/{vhost}/{name}/bindings/destination",
            get(exchange_bindings_destination),
        )
        .route("/api/queues", get(queues_all))
        .route("/api/queues/{vhost}", get(queues_vhost))
        .route(
            "/api/queues/{vhost}/{name}",
            get(one_queue).put(put_queue).delete(delete_queue),
        )
        .route(
            "/api/queues/{vhost}/{name}/contents",
            axum::routing::delete(purge_queue),
        )
        .route("/api/queues/{vhost}/{name}/get", post(get_messages))
        .route("/api/queues/{vhost}/{name}/move", post(move_messages))
        .route("/api/queues/{vhost}/{name}/bindings", get(queue_bindings))
        .route(
            "/api/queues/{vhost}/{name}/quorum-status",
            get(queue_quorum_status),
        )
        .route("/api/bindings", get(bindings_all))
        .route("/api/bindings/{vhost}", get(bindings_vhost))
        .route(
            "/api/bindings/{vhost}/e/{source}/{kind}/{dest}",
            get(bindings_between).post(create_binding),
        )
        .route(
            "/api/bindings/{vhost}/e/{source}/{kind}/{dest}/{props}",
            get(one_binding).delete(delete_binding),
        )
        .route("/api/connections", get(connections))
        .route(
            "/api/connections/{name}",
            get(one_connection).delete(close_connection),
        )
        .route("/api/connections/{name}/channels", get(connection_channels))
        .route(
            "/api/connections/username/{user}",
            get(user_connections).delete(close_user_connections),
        )
        .route("/api/channels", get(channels))
        .route("/api/channels/{name}", get(one_channel))
        .route("/api/consumers", get(consumers_all))
        .route("/api/consumers/{vhost}", get(consumers_vhost))
        .route(
            "/api/definitions",
            get(definitions_all).post(import_definitions),
        )
        .route(
            "/api/definitions/{vhost}",
            get(definitions_vhost).post(import_definitions_vhost),
        )
        .route("/api/health/checks/alarms", get(health_alarms))
        .route("/api/health/checks/local-alarms", get(health_alarms))
        .route("/api/health/checks/virtual-hosts", get(health_ok))
        .route(
            "/api/health/checks/node-is-quorum-critical",
            get(health_quorum_critical),
        )
        .route(
            "/api/health/checks/node-is-mirror-sync-critical",
            get(health_ok),
        )
        .route(
            "/api/health/checks/certificate-expiration/{within}/{unit}",
            get(health_certificates),
        )
        .route("/api/health/checks/port-listener/{port}", get(health_port))
        .route(
            "/api/health/checks/protocol-listener/{protocol}",
            get(health_protocol),
        )
        .route("/api/aliveness-test/{vhost}", get(aliveness))
        .route("/api/{*rest}", axum::routing::any(unknown))
        .with_state(api)
}

async fn unknown() -> Answer {
    Err(ApiError::not_found())
}

fn login(api: &Api, headers: &HeaderMap, peer: SocketAddr) -> Result<Login, ApiError> {
    api.login(headers, peer)
}

/// A request body as JSON (an empty body reads as `{}`), with RabbitMQ's 400 on bad JSON.
fn body_json(body: &Bytes) -> Result<Value, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(json!({}));
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(v) if v.is_object() => Ok(v),
        _ => Err(ApiError::bad_request("not_json")),
    }
}

fn short(s: &str, what: &str) -> Result<ShortStr, ApiError> {
    ShortStr::try_from_str(s).map_err(|_| ApiError::bad_request(format!("{what} name too long")))
}

/// A boolean field of a body, false when absent; as RabbitMQ's `parse_bool`, also the strings
/// "true" and "false" (what rabbitmqadmin sends), and a 400 for anything else.
fn boolean(b: &Value, k: &str) -> Result<bool, ApiError> {
    match b.get(k) {
        None | Some(Value::Null) => Ok(false),
        Some(other) => conv::boolean(other)
            .ok_or_else(|| ApiError::bad_request(format!("[\"not_boolean\", {other}]"))),
    }
}

fn flag(q: &HashMap<String, String>, k: &str) -> bool {
    q.get(k).is_some_and(|v| v == "true")
}

fn vhost_must_exist(api: &Api, vhost: &str) -> Result<(), ApiError> {
    if api.node.read(|n, _| n.broker().vhost_exists(vhost)) {
        Ok(())
    } else {
        Err(ApiError::not_found())
    }
}

// ------------------------------------------------------------------ overview, nodes

fn listeners(api: &Api) -> Value {
    // RabbitMQ's names: amqp/ssl for amqps, https and https/prometheus over TLS.
    let (mgmt_tls, prom_tls) = api.http_tls;
    let mut l = vec![
        json!({"node": api.node_name, "protocol": "amqp", "ip_address": "::", "port": api.amqp_port}),
    ];
    // Port 0: the management API is off (the node shares its figures for SQS or metrics).
    if api.http_port != 0 {
        l.push(json!({"node": api.node_name, "protocol": if mgmt_tls { "https" } else { "http" }, "ip_address": "::", "port": api.http_port}));
    }
    if let Some(p) = api.amqps_port {
        l.insert(
            1,
            json!({"node": api.node_name, "protocol": "amqp/ssl", "ip_address": "::", "port": p}),
        );
    }
    if let Some(p) = api.prometheus_port {
        let protocol = if prom_tls {
            "https/prometheus"
        } else {
            "http/prometheus"
        };
        l.push(json!({"node": api.node_name, "protocol": protocol, "ip_address": "::", "port": p}));
    }
    if let Some(p) = api.sqs_port {
        l.push(json!({"node": api.node_name, "protocol": "sqs", "ip_address": "::", "port": p}));
    }
    Value::Array(l)
}

fn exchange_types() -> Value {
    json!([
        {"name": "direct", "description": "AMQP direct exchange, as per the AMQP specification", "enabled": true},
        {"name": "fanout", "description": "AMQP fanout exchange, as per the AMQP specification", "enabled": true},
        {"name": "headers", "description": "AMQP headers exchange, as per the AMQP specification", "enabled": true},
        {"name": "topic", "description": "AMQP topic exchange, as per the AMQP specification", "enabled": true},
        {"name": "x-delayed-message", "description": "Delayed Message Exchange.", "enabled": true},
    ])
}

async fn overview(State(api): ApiState, _: LoggedIn) -> Answer {
    let (totals, counters, conns, channels) = api.node.read(|n, _| {
        let snaps = n.connection_snapshots();
        let channels: usize = snaps.iter().map(|c| c.channels.len()).sum();
        (
            n.broker().totals(),
            n.broker().counters(),
            snaps.len(),
            channels,
        )
    });
    let (rates, _) = api.rates.node();
    let d = |r: f64| json!({ "rate": r });
    let version = env!("CARGO_PKG_VERSION");
    ok(json!({
        "management_version": "3.10.8",
        "rates_mode": "basic",
        "rabbitmq_version": "3.10.8",
        "product_name": "Warren",
        "product_version": version,
        "cluster_name": api.cluster_name(),
        "erlang_version": "none (Warren is written in Rust)",
        "node": api.node_name,
        "exchange_types": exchange_types(),
        "listeners": listeners(&api),
        "contexts": [{"node": api.node_name, "description": "RabbitMQ Management", "path": "/", "port": api.http_port.to_string()}],
        "message_stats": {
            "publish": counters.received, "publish_details": d(rates.publish),
            "deliver_get_details": d(rates.deliver_get),
            "ack_details": d(rates.ack),
            "redeliver_details": d(rates.redeliver),
            "drop_unroutable": counters.unroutable,
        },
        "queue_totals": {
            "messages": totals.ready + totals.unacked, "messages_details": d(0.0),
            "messages_ready": totals.ready, "messages_ready_details": d(0.0),
            "messages_unacknowledged": totals.unacked, "messages_unacknowledged_details": d(0.0),
            "messages_delayed": totals.delayed,
            "messages_dead_lettering": totals.dead_lettering,
        },
        "object_totals": {
            "channels": channels, "connections": conns, "consumers": totals.consumers,
            "exchanges": totals.exchanges, "queues": totals.queues,
        },
        "statistics_db_event_queue": 0,
    }))
}

/// This node's `/api/nodes` entry (also what it sends its peers: [`super::share_figures`]).
pub(crate) fn node_json(api: &Api) -> Value {
    let (now, cluster, level) = api.node.read(|n, now| {
        let b = n.broker();
        (now, b.cluster_view(), b.cluster_feature_level())
    });
    // Its own alarms: a peer's, which block this node's publishers too, are in that peer's entry.
    let (mem_alarm, disk_alarm) = api.node.local_alarms();
    let mem_used = crate::alarms::rss_bytes().unwrap_or(0);
    let mem_limit = crate::alarms::memory_limit(&api.alarms).unwrap_or(0);
    let disk_free = crate::alarms::free_disk(&api.data_dir).unwrap_or(0);
    let fds = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count());
    let processors = std::thread::available_parallelism().map_or(1, |n| n.get());
    json!({
        "name": api.node_name,
        "type": "disc",
        "running": true,
        "os_pid": std::process::id().to_string(),
        "uptime": now.saturating_sub(api.started_ms),
        "mem_used": mem_used,
        "mem_limit": mem_limit,
        "mem_alarm": mem_alarm,
        "disk_free": disk_free,
        "disk_free_limit": api.alarms.disk_free_limit,
        "disk_free_alarm": disk_alarm,
        "fd_used": fds,
        "processors": processors,
        "rates_mode": "basic",
        "partitions": [],
        "exchange_types": exchange_types(),
        "being_drained": api.node.is_draining(),
        // Warren's own: this node's place in its cluster (null on a node of its own).
        "cluster": cluster.map(|(node, nodes, leader)| {
            let t = api.node.cluster_stats().unwrap_or_default();
            let mut c = json!({
                "node": node,
                "nodes": nodes,
                "metadata_leader": leader,
                // Still asking the cluster to add it (`--cluster-join`): it takes no client
                // until the cluster's metadata names it.
                "joining": api.node.is_joining(),
                // What every node announced it can do: 1 once quorum queues are numbered by
                // the metadata log, 2 once the cluster can forget a node (an upgrade of the
                // whole cluster is complete).
                "feature_level": level,
                "queues_led": queues_led_here(api),
                // Where this node's management API listens (its host is the one in its name),
                // for a client that asks every node (`warren ctl quorum_status`).
                // (null when it is off: a node may run SQS alone.)
                "management": (api.http_port != 0).then(|| json!({
                    "port": api.http_port,
                    "scheme": if api.http_tls.0 { "https" } else { "http" },
                })),
                // Where its SQS endpoint listens, for a node that sends a call on a quorum
                // queue this node leads on to it (`sqs::forward`).
                "sqs": api.sqs_port.map(|port| json!({"port": port, "scheme": "http"})),
                "transport": {
                    "connections_in": t.connections_in, "connections_out": t.connections_out,
                    "batches_in": t.batches_in, "batches_out": t.batches_out,
                    "dropped_in": t.dropped_in, "dropped_out": t.dropped_out,
                    "skipped_messages": t.skipped_msgs, "refused_peers": t.refused,
                    "bad_frames": t.bad_frames,
                    "snapshots_sent_in_pieces": t.pieced_out,
                    "snapshots_received_in_pieces": t.pieced_in,
                    "snapshots_received_written_ahead": t.staged_in,
                    "snapshots_installed_from_written": t.staged_used,
                },
                // Proposals that shared a Raft entry with others of their queue, and those
                // entries: how much the log's per-entry costs were divided.
                "joined_proposals": {"entries": t.joined_entries, "proposals": t.joined_parts},
            });
            // The version and listeners each node runs, for `warren ctl cluster_status` on any
            // node (RabbitMQ's lists every node's).
            c["version"] = json!(env!("CARGO_PKG_VERSION"));
            c["listeners"] = listeners(api);
            c
        }),
    })
}

/// [`node_json`] with what only the Raft thread knows: `cluster.members_changing`, the
/// groups this node leads whose members are not yet the cluster's nodes (after a node was
/// forgotten: 0 once every group led here moved off it).
pub(crate) async fn node_json_now(api: &Api) -> Value {
    let mut v = node_json(api);
    if let Some(changing) = members_changing(api).await {
        v["cluster"]["members_changing"] = json!(changing);
    }
    v
}

async fn members_changing(api: &Api) -> Option<usize> {
    let raft = api.node.raft()?;
    raft.changing_members(std::time::Duration::from_secs(2))
        .await
}

/// Another node of the cluster: the figures it sent last (its own entry, as its API gives it;
/// `cluster.figures_age_ms` says how old), while it runs and they are fresh; otherwise only
/// whether it runs. `running` and `being_drained` are always this node's view (its Raft hears
/// of both at every heartbeat).
fn peer_json(api: &Api, node: u64, running: bool) -> Value {
    let name = api.name_of(node);
    let drained = api.node.read(|n, _| n.broker().node_draining(node));
    // Only a running peer's (`peer_figures` looks that up itself).
    if let Some((age, mut figures)) = super::peer_figures(api, node) {
        let mut v = figures["node"].take();
        v["running"] = json!(true);
        v["being_drained"] = json!(drained);
        v["cluster"]["figures_age_ms"] = json!(u64::try_from(age.as_millis()).unwrap_or(u64::MAX));
        return v;
    }
    json!({
        "name": name,
        "type": "disc",
        "running": running,
        "being_drained": drained,
        "partitions": [],
        "cluster": {"node": node},
    })
}

fn peers_json(api: &Api) -> Vec<Value> {
    api.node
        .read(|n, _| n.broker().peers_running())
        .into_iter()
        .map(|(node, running)| peer_json(api, node, running))
        .collect()
}

/// Every node of the cluster, this one first (RabbitMQ lists every member, `running` false
/// for one that is down).
async fn nodes(State(api): ApiState, ConnectInfo(peer): Peer, headers: HeaderMap) -> Answer {
    login(&api, &headers, peer)?.require(Level::Monitoring)?;
    let mut all = vec![node_json_now(&api).await];
    all.extend(peers_json(&api));
    ok(Value::Array(all))
}

async fn one_node(
    State(api): ApiState,
    ConnectInfo(peer): Peer,
    headers: HeaderMap,
    Path(node): Path<String>,
) -> Answer {
    login(&api, &headers, peer)?.require(Level::Monitoring)?;
    if node == api.node_name {
        return ok(node_json_now(&api).await);
    }
    peers_json(&api)
        .into_iter()
        .find(|p| p["name"] == node.as_str())
        .map_or_else(|| Err(ApiError::not_found()), ok)
}

/// `POST /api/nodes/{node}/drain` (`warren ctl drain`, RabbitMQ's `rabbitmq-upgrade drain`):
/// maintenance mode for the node that answers. It takes no new client connection, closes
/// those it has (320, "Node was put into maintenance mode"), and in a cluster hands every
/// queue leadership to the other nodes; it keeps running, its members keep their copies.
async fn drain(State(api): ApiState, Admin(who): Admin, Path(node): Path<String>) -> Answer {
    maintenance(&api, &who.name, &node, true)
}

/// `POST /api/nodes/{node}/revive` (RabbitMQ's `rabbitmq-upgrade revive`): out of
/// maintenance mode, taking clients again.
async fn revive(State(api): ApiState, Admin(who): Admin, Path(node): Path<String>) -> Answer {
    maintenance(&api, &who.name, &node, false)
}

/// `POST /api/nodes/{node}/forget` (Warren's; `warren ctl forget_cluster_node`, RabbitMQ's
/// `rabbitmqctl forget_cluster_node`): the cluster forgets a stopped node, its name or its
/// number. Answered 204 once the change is on its way through the metadata log; every quorum
/// queue's leader then removes the node from its group (`/api/nodes` stops listing it once
/// this node applied the change).
async fn forget(State(api): ApiState, Admin(who): Admin, Path(node): Path<String>) -> Answer {
    let id = node.parse::<u64>().ok().or_else(|| {
        api.names()
            .iter()
            .find(|(_, name)| **name == node)
            .map(|(id, _)| *id)
    });
    let Some(id) = id else {
        return Err(ApiError::not_found());
    };
    let asked = api.node.write(|n, _| n.broker_mut().forget_node(id))?;
    match asked {
        Ok(()) => {
            tracing::warn!(by = %who.name, node = id, "the cluster is asked to forget a node");
            no_content()
        }
        Err(warren_broker::ForgetError::NotMember(_)) => Err(ApiError::not_found()),
        Err(e) => Err(ApiError::bad_request(e.to_string())),
    }
}

/// `POST /api/cluster/join` (Warren's; `warren ctl join_cluster`, RabbitMQ's `rabbitmqctl
/// join_cluster` after `stop_app` and `reset`): this node, running on its own, becomes a node
/// of a running cluster. The body gives its number (`node`), `nodes` (`N=HOST:PORT,...`: this
/// node's cluster address and at least one running node's), `secret_file` and the optional
/// `tls_cert`, `tls_key` and `tls_ca`, as the `--cluster-*` flags would. A node holding
/// messages refuses unless `force` is true: it starts empty, and takes the cluster's
/// definitions. Answered 202 with the name the node will have; the node saves the settings in
/// its data directory, stops (its clients are closed as on a shutdown) and starts again,
/// reset, asking the cluster to add it ([`crate::joining`]).
async fn join_cluster(State(api): ApiState, Admin(who): Admin, body: Bytes) -> Answer {
    let b = body_json(&body)?;
    let Some(restart) = api.restart.clone() else {
        return Err(ApiError::bad_request(
            "this node cannot start itself again: start it with --cluster-join",
        ));
    };
    if !api.cluster_names.is_empty() {
        return Err(ApiError::bad_request(format!(
            "{} is a node of a cluster already: to move it to another cluster, forget it \
             there (warren ctl forget_cluster_node) and start it on an empty data directory \
             with --cluster-join",
            api.node_name
        )));
    }
    let text = |key: &str| b.get(key).and_then(Value::as_str).map(str::to_owned);
    let path = |key: &str| -> Result<Option<std::path::PathBuf>, ApiError> {
        match text(key).map(std::path::PathBuf::from) {
            Some(p) if p.is_relative() => Err(ApiError::bad_request(format!(
                "{key}: give an absolute path ({}): the node reads it on its own host, at \
                 every start",
                p.display()
            ))),
            p => Ok(p),
        }
    };
    let Some(node) = b.get("node").and_then(Value::as_u64).filter(|n| *n > 0) else {
        return Err(ApiError::bad_request(
            "node: this node's number in the cluster (one that no node of it has), from 1",
        ));
    };
    let Some(nodes) = text("nodes") else {
        return Err(ApiError::bad_request(
            "nodes: this node's cluster address and at least one running node's, as \
             N=HOST:PORT,...",
        ));
    };
    let Some(secret_file) = path("secret_file")? else {
        return Err(ApiError::bad_request(
            "secret_file: the file holding the cluster's secret, on this node's host",
        ));
    };
    let tls = (path("tls_cert")?, path("tls_key")?, path("tls_ca")?);
    let force = b.get("force").and_then(Value::as_bool).unwrap_or(false);
    secret_file_is_private(&secret_file)?;
    let canonical =
        |p: &std::path::Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    if canonical(&secret_file).starts_with(canonical(&api.data_dir)) {
        return Err(ApiError::bad_request(format!(
            "secret_file {}: keep the cluster's secret out of the node's data directory (the \
             files Warren writes there are no secrets)",
            secret_file.display()
        )));
    }
    let settings = crate::config::cluster_settings(
        Some(node),
        Some(nodes.clone()),
        Some(secret_file.clone()),
        tls.clone(),
        (None, None, None),
    )
    .map_err(|e| ApiError::bad_request(e.to_string()))?
    .ok_or_else(|| ApiError::internal("no cluster settings"))?;
    if settings.nodes.len() < 2 {
        return Err(ApiError::bad_request(
            "nodes: give at least one running node of the cluster beside this one",
        ));
    }
    let held = api.node.read(|n, _| crate::driver::messages_held(n));
    if held > 0 && !force {
        return Err(ApiError::bad_request(format!(
            "this node holds {held} message(s), and a node that joins a cluster starts empty, \
             as rabbitmqctl reset leaves it: move them first (warren migrate, or consume them), \
             or ask again with force (--force) to drop them"
        )));
    }
    let name = settings
        .nodes
        .get(&node)
        .map(|a| super::cluster_node_name(node, a))
        .unwrap_or_default();
    if !restart.claim(force) {
        return Err(ApiError::conflict(
            "the node is stopping already (to join a cluster, or for good)",
        ));
    }
    let saved = crate::joining::Saved {
        node,
        nodes,
        secret_file,
        tls_cert: tls.0,
        tls_key: tls.1,
        tls_ca: tls.2,
        reset: true,
    };
    if let Err(e) = crate::joining::Asked::save(&api.data_dir, &saved) {
        restart.unclaim();
        return Err(ApiError::internal(format!(
            "cannot save the cluster settings in {}: {e}",
            api.data_dir.display()
        )));
    }
    // The settings become the node's only once it stopped and counted what it holds then:
    // without `force`, any message calls the join off (crate::main's `run`).
    restart.stop_after(std::time::Duration::from_millis(300));
    tracing::warn!(by = %who.name, node, name = %name, dropped = held, "this node stops, resets and starts again to join a cluster");
    Ok((
        StatusCode::ACCEPTED,
        Json(json!({ "node": name, "messages_dropped": held })),
    )
        .into_response())
}

/// The largest cluster secret file taken through the API.
const SECRET_FILE_MAX: u64 = 64 << 10;

/// A secret file named through the API must be a small regular file that not every user of
/// the host can read: else an administrator of the API could take the node into a cluster of
/// their own with a file whose contents everybody knows.
fn secret_file_is_private(path: &std::path::Path) -> Result<(), ApiError> {
    use std::os::unix::fs::PermissionsExt;
    let refused = |why: &str| {
        Err(ApiError::bad_request(format!(
            "secret_file {}: {why}",
            path.display()
        )))
    };
    let Ok(meta) = std::fs::metadata(path) else {
        return refused("cannot be read by the node");
    };
    if !meta.is_file() || meta.len() > SECRET_FILE_MAX {
        return refused("is not a cluster secret (a small regular file)");
    }
    if meta.permissions().mode() & 0o004 != 0 {
        return refused(
            "every user of the host can read it: chmod o-r it (a secret stays private)",
        );
    }
    Ok(())
}

/// `POST /api/rebalance/queues` (as RabbitMQ's): the cluster evens out its quorum queues'
/// leaders (see `Broker::rebalance`); answered once the request is on its way, 204. The
/// transfers take a few Raft rounds: `warren ctl rebalance` waits and asks again.
async fn rebalance(State(api): ApiState, Admin(who): Admin) -> Answer {
    let asked = api.node.write(|n, _| n.broker_mut().rebalance())?;
    if !asked {
        return Err(ApiError::bad_request(
            "this node is not in a cluster: there is nothing to rebalance",
        ));
    }
    tracing::info!(by = %who.name, "rebalance of quorum queue leaders requested");
    no_content()
}

/// The replicated queues this node's Raft leads now.
fn queues_led_here(api: &Api) -> usize {
    api.node.read(|n, _| n.broker().queues_led_here())
}

fn maintenance(api: &Api, by: &str, node: &str, on: bool) -> Answer {
    if node != api.node_name {
        let peer = api.names().values().any(|n| n == node);
        if !peer {
            return Err(ApiError::not_found());
        }
        // A node goes into maintenance by its own API, as rabbitmq-upgrade acts on its -n node.
        return Err(ApiError::bad_request(format!(
            "{node} is another node of the cluster: ask its own management API (this is {})",
            api.node_name
        )));
    }
    let closed = api.node.set_draining(on);
    tracing::warn!(
        by,
        draining = on,
        connections_closed = closed,
        "maintenance mode"
    );
    let leading = queues_led_here(api);
    ok(json!({
        "node": api.node_name,
        "being_drained": on,
        "connections_closed": closed,
        "queues_led": leading,
    }))
}

async fn extensions(_: LoggedIn) -> Answer {
    ok(json!([]))
}

async fn whoami(LoggedIn(who): LoggedIn) -> Answer {
    ok(json!({"name": who.name, "tags": who.tags}))
}

// ------------------------------------------------------------------ vhosts, users

/// Each node's state of a vhost, as RabbitMQ gives it (`nodedown` for a node that is down).
fn cluster_state(api: &Api) -> Value {
    let mut m = serde_json::Map::new();
    m.insert(api.node_name.clone(), json!("running"));
    for p in peers_json(api) {
        let state = if p["running"] == true {
            "running"
        } else {
            "nodedown"
        };
        if let Some(name) = p["name"].as_str() {
            m.insert(name.to_owned(), json!(state));
        }
    }
    Value::Object(m)
}

/// A vhost's metadata as RabbitMQ 3.11 exports it: `default_queue_type` only where the vhost
/// sets one.
pub(super) fn vhost_metadata_json(meta: &VhostMeta) -> Value {
    let mut m = json!({"description": meta.description, "tags": meta.tags});
    if let Some(t) = meta.default_queue_type {
        m["default_queue_type"] = json!(t.as_str());
    }
    m
}

pub(super) fn vhost_json(api: &Api, name: &str) -> Value {
    let (ready, unacked, meta, node_default) = api.node.read(|n, _| {
        let b = n.broker();
        let (ready, unacked) = b
            .queue_snapshots(Some(name))
            .iter()
            .fold((0, 0), |(r, u), q| (r + q.ready, u + q.unacked));
        let meta = b.vhost_meta(name).cloned().unwrap_or_default();
        (ready, unacked, meta, b.config().default_queue_type)
    });
    json!({
        "name": name, "description": meta.description, "tags": meta.tags,
        "metadata": vhost_metadata_json(&meta),
        // What a queue declared here without `x-queue-type` gets: the vhost's, else the
        // node's (`--default-queue-type`).
        "default_queue_type": meta.default_queue_type.unwrap_or(node_default).as_str(),
        "tracing": false,
        "messages": ready + unacked, "messages_ready": ready, "messages_unacknowledged": unacked,
        "cluster_state": cluster_state(api),
    })
}

async fn vhosts(State(api): ApiState, LoggedIn(who): LoggedIn, Query(q): Params) -> Answer {
    let query = ListQuery::parse(&q)?;
    // RabbitMQ's list_visible_vhosts: monitoring users see every vhost here, though not
    // the objects in those where they have no permission.
    let names: Vec<String> = api.node.read(|n, _| {
        let b = n.broker();
        b.vhost_names()
            .into_iter()
            .filter(|v| who.sees_all() || who.sees_vhost(b.access(), v))
            .collect()
    });
    let matcher = query.matcher()?;
    let total = names.len();
    let items = names
        .iter()
        .filter(|n| matcher(n))
        .map(|n| vhost_json(&api, n))
        .collect();
    ok(query.finish(items, total)?)
}

// ------------------------------------------------------------------ exchanges

fn list_exchanges(
    api: &Api,
    who: &Login,
    vhost: Option<&str>,
    q: &HashMap<String, String>,
) -> Answer {
    let query = ListQuery::parse(q)?;
    let matcher = query.matcher()?;
    let snaps = api.node.read(|n, _| {
        let b = n.broker();
        let mut snaps = b.exchange_snapshots(vhost);
        snaps.retain(|x| who.sees_vhost(b.access(), &x.vhost));
        snaps
    });
    let total = snaps.len();
    let items = snaps
        .iter()
        .filter(|x| matcher(&x.name))
        .map(objects::exchange)
        .collect();
    ok(query.finish(items, total)?)
}

async fn exchanges_all(State(api): ApiState, LoggedIn(who): LoggedIn, Query(q): Params) -> Answer {
    list_exchanges(&api, &who, None, &q)
}

async fn exchanges_vhost(
    State(api): ApiState,
    LoggedIn(who): LoggedIn,
    Path(vhost): Path<String>,
    Query(q): Params,
) -> Answer {
    vhost_must_exist(&api, &vhost)?;
    list_exchanges(&api, &who, Some(&vhost), &q)
}

/// The exchange named in a path: RabbitMQ's API names the default exchange `amq.default`.
fn exchange_name(name: &str) -> &str {
    if name == "amq.default" {
        ""
    } else {
        name
    }
}

async fn one_exchange(
    State(api): ApiState,
    _: LoggedIn,
    Path((vhost, name)): Path<(String, String)>,
) -> Answer {
    let name = exchange_name(&name);
    let x = api.node.read(|n, _| {
        n.broker()
            .exchange_snapshots(Some(&vhost))
            .into_iter()
            .find(|x| x.name.as_str() == name)
    });
    let mut v = objects::exchange(&x.ok_or_else(ApiError::not_found)?);
    // RabbitMQ's one-exchange view adds the per-channel and per-queue publish stats, empty
    // unless rates_mode is detailed (Warren's is basic).
    if let Some(m) = v.as_object_mut() {
        m.insert("incoming".into(), json!([]));
        m.insert("outgoing".into(), json!([]));
    }
    ok(v)
}

async fn put_exchange(
    State(api): ApiState,
    LoggedIn(who): LoggedIn,
    Path((vhost, name)): Path<(String, String)>,
    body: Bytes,
) -> Answer {
    vhost_must_exist(&api, &vhost)?;
    let b = body_json(&body)?;
    // RabbitMQ's defaults: a direct exchange, not durable.
    let kind = b
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or("direct")
        .to_owned();
    let (durable, auto_delete, internal) = (
        boolean(&b, "durable")?,
        boolean(&b, "auto_delete")?,
        boolean(&b, "internal")?,
    );
    let arguments = conv::to_table(b.get("arguments").unwrap_or(&Value::Null))
        .map_err(ApiError::bad_request)?;
    short(&name, "exchange")?;
    let existed = api.node.write(|n, _| {
        let existed = n.broker().exchange_exists(&vhost, &name);
        // As exchange.declare: a new exchange with an alternate exchange also needs read on
        // itself and write on the alternate.
        let alternate = arguments.get("alternate-exchange").and_then(|v| match v {
            warren_codec::FieldValue::LongStr(s) => Some(String::from_utf8_lossy(s).into_owned()),
            _ => None,
        });
        let mut needs = vec![Need::On(Perm::Configure, Resource::Exchange(&name))];
        if let (false, Some(ae)) = (existed, &alternate) {
            needs.push(Need::On(Perm::Read, Resource::Exchange(&name)));
            needs.push(Need::On(Perm::Write, Resource::Exchange(ae)));
        }
        who.permit_in(n.broker().access(), &vhost, &needs, Via::Direct)?;
        n.broker_mut()
            .declare_exchange(
                &vhost,
                &name,
                &kind,
                false,
                durable,
                auto_delete,
                internal,
                &arguments,
            )
            .map(|()| existed)
            .map_err(ApiError::from)
    })??;
    if existed {
        no_content()
    } else {
        created()
    }
}

async fn delete_exchange(
    State(api): ApiState,
    LoggedIn(who): LoggedIn,
    Path((vhost, name)): Path<(String, String)>,
    Query(q): Params,
) -> Answer {
    vhost_must_exist(&api, &vhost)?;
    let if_unused = flag(&q, "if-unused");
    api.node.write(|n, _| {
        if !n.broker().exchange_exists(&vhost, &name) {
            return Err(ApiError::not_found());
        }
        let needs = [Need::On(Perm::Configure, Resource::Exchange(&name))];
        who.permit_in(n.broker().access(), &vhost, &needs, Via::Direct)?;
        n.broker_mut()
            .delete_exchange(&vhost, &name, if_unused)
            .map_err(ApiError::from)
    })??;
    no_content()
}

async fn publish(
    State(api): ApiState,
    LoggedIn(who): LoggedIn,
    Path((vhost, name)): Path<(String, String)>,
    body: Bytes,
) -> Answer {
    vhost_must_exist(&api, &vhost)?;
    let b = body_json(&body)?;
    let routing_key = b
        .get("routing_key")
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::bad_request("routing_key not specified"))?;
    let payload = b
        .get("payload")
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::bad_request("payload not specified"))?;
    let body = match b
        .get("payload_encoding")
        .and_then(Value::as_str)
        .unwrap_or("string")
    {
        "string" => Bytes::copy_from_slice(payload.as_bytes()),
        "base64" => Bytes::from(
            base64::engine::general_purpose::STANDARD
                .decode(payload)
                .map_err(|_| ApiError::bad_request("payload is not valid base64"))?,
        ),
        other => {
            return Err(ApiError::bad_request(format!(
                "payload_encoding must be string or base64, got {other}"
            )))
        }
    };
    let properties = conv::to_properties(b.get("properties").unwrap_or(&Value::Null))
        .map_err(ApiError::bad_request)?;
    let exchange = exchange_name(&name);
    // Before the exchange is looked up, as basic.publish: a refusal does not tell whether it
    // exists.
    who.permit(
        &api,
        &vhost,
        &[
            Need::On(Perm::Write, Resource::Exchange(exchange)),
            Need::Topic(Perm::Write, exchange, routing_key),
        ],
        Via::Publish,
    )?;
    let message = Message {
        exchange: short(exchange, "exchange")?,
        routing_key: short(routing_key, "routing key")?,
        persistent: warren_codec::properties::is_persistent(&properties),
        properties,
        body,
        store_key: None,
        away: None,
    };
    let routed = api.node.write(|n, now| {
        n.broker_mut()
            .publish(
                &vhost,
                exchange,
                message.routing_key.as_str(),
                message.clone(),
                now,
            )
            .map_err(|e| {
                // RabbitMQ reports the channel error as text in a 400.
                ApiError::bad_request(format!("{} {} - {}", e.code.code(), e.code.name(), e.text))
            })
    })??;
    ok(json!({ "routed": routed.queues > 0 }))
}

fn bindings_where(
    api: &Api,
    vhost: &str,
    keep: impl Fn(&warren_broker::BindingSnapshot) -> bool,
) -> Value {
    let all = api
        .node
        .read(|n, _| n.broker().binding_snapshots(Some(vhost)));
    all.iter()
        .filter(|b| keep(b))
        .map(objects::binding)
        .collect()
}

async fn exchange_bindings_source(
    State(api): ApiState,
    _: LoggedIn,
    Path((vhost, name)): Path<(String, String)>,
) -> Answer {
    let name = exchange_name(&name).to_owned();
    if !api
        .node
        .read(|n, _| n.broker().exchange_exists(&vhost, &name))
    {
        return Err(ApiError::not_found());
    }
    ok(bindings_where(&api, &vhost, |b| b.source.as_str() == name))
}

async fn exchange_bindings_destination(
    State(api): ApiState,
    _: LoggedIn,
    Path((vhost, name)): Path<(String, String)>,
) -> Answer {
    if !api
        .node
        .read(|n, _| n.broker().exchange_exists(&vhost, &name))
    {
        return Err(ApiError::not_found());
    }
    ok(bindings_where(&api, &vhost, |b| {
        !b.to_queue && b.destination.as_str() == name
    }))
}

// ------------------------------------------------------------------ queues

fn list_queues(api: &Api, who: &Login, vhost: Option<&str>, q: &HashMap<String, String>) -> Answer {
    let query = ListQuery::parse(q)?;
    let matcher = query.matcher()?;
    let (now, snaps) = api.node.read(|n, now| {
        let b = n.broker();
        let mut snaps = b.queue_snapshots(vhost);
        snaps.retain(|s| who.sees_vhost(b.access(), &s.vhost));
        (now, snaps)
    });
    let total = snaps.len();
    let kept: Vec<_> = snaps.into_iter().filter(|s| matcher(&s.name)).collect();
    let rates = api.rates.queues(kept.iter().map(|s| s.id));
    let node = api.node_name.as_str();
    let down = nodes_down(api);
    let names = api.names();
    ok(query.finish_with(
        kept.into_iter().zip(rates).collect(),
        total,
        |(s, r), field| objects::queue_field(s, r, node, now, field),
        |(s, _)| (s.vhost.clone(), s.name.clone()),
        |(s, r)| {
            let mut v = objects::queue(&s, &r, node, now);
            objects::with_members(&mut v, &s, &names, &down);
            v
        },
    )?)
}

/// The cluster's nodes this node sees down.
fn nodes_down(api: &Api) -> std::collections::BTreeSet<u64> {
    api.node.read(|n, _| {
        n.broker()
            .peers_running()
            .into_iter()
            .filter(|(_, running)| !running)
            .map(|(node, _)| node)
            .collect()
    })
}

async fn queues_all(State(api): ApiState, LoggedIn(who): LoggedIn, Query(q): Params) -> Answer {
    list_queues(&api, &who, None, &q)
}

async fn queues_vhost(
    State(api): ApiState,
    LoggedIn(who): LoggedIn,
    Path(vhost): Path<String>,
    Query(q): Params,
) -> Answer {
    vhost_must_exist(&api, &vhost)?;
    list_queues(&api, &who, Some(&vhost), &q)
}

async fn one_queue(
    State(api): ApiState,
    _: LoggedIn,
    Path((vhost, name)): Path<(String, String)>,
    Query(q): Params,
) -> Answer {
    let (now, snap, consumers, conns) = api.node.read(|n, now| {
        let b = n.broker();
        let snap = b.queue_snapshot(&vhost, &name);
        let consumers: Vec<_> = b
            .consumer_snapshots(Some(&vhost))
            .into_iter()
            .filter(|c| c.queue.as_str() == name)
            .collect();
        let conns = if consumers.is_empty() {
            Vec::new()
        } else {
            n.connection_snapshots()
        };
        (now, snap, consumers, conns)
    });
    let s = snap.ok_or_else(ApiError::not_found)?;
    let mut v = objects::queue(&s, &api.rates.queue(s.id), &api.node_name, now);
    objects::with_members(&mut v, &s, &api.names(), &nodes_down(&api));
    if q.contains_key("lengths_age") || q.contains_key("msg_rates_age") {
        v = objects::with_history(v, &api.rates.queue_history(s.id));
    }
    let details: Vec<Value> = consumers
        .iter()
        .map(|c| objects::consumer(c, conns.iter().find(|x| x.id == c.conn), &api.node_name))
        .collect();
    if let Some(m) = v.as_object_mut() {
        m.insert("consumer_details".into(), Value::Array(details));
        // Per-channel and per-exchange stats, as RabbitMQ's one-queue view: empty unless
        // rates_mode is detailed (Warren's is basic).
        m.insert("deliveries".into(), json!([]));
        m.insert("incoming".into(), json!([]));
    }
    ok(v)
}

async fn put_queue(
    State(api): ApiState,
    LoggedIn(who): LoggedIn,
    Path((vhost, name)): Path<(String, String)>,
    body: Bytes,
) -> Answer {
    vhost_must_exist(&api, &vhost)?;
    let b = body_json(&body)?;
    // RabbitMQ's default: not durable.
    let req = DeclareQueue {
        name: short(&name, "queue")?,
        passive: false,
        durable: boolean(&b, "durable")?,
        exclusive: false,
        auto_delete: boolean(&b, "auto_delete")?,
        arguments: conv::to_table(b.get("arguments").unwrap_or(&Value::Null))
            .map_err(ApiError::bad_request)?,
    };
    if name.is_empty() {
        return Err(ApiError::bad_request("queue name must not be empty"));
    }
    let (existed, declared) = api.node.write(|n, _| {
        let existed = n.broker().queue_id(&vhost, &name).is_some();
        let needs = [Need::On(Perm::Configure, Resource::Queue(&name))];
        who.permit_in(n.broker().access(), &vhost, &needs, Via::Direct)?;
        // As the user, for the dead-letter exchange's checks of queue.declare.
        n.broker_mut()
            .declare_queue_as(&vhost, req, API_CONN, Some(&who.name))
            .map(|d| (existed, d))
            .map_err(ApiError::from)
    })??;
    if let warren_broker::Declared::Waiting(ticket) = declared {
        // A quorum queue in a cluster: made once the metadata log has it.
        api.node.declared(ticket).await?;
    }
    if existed {
        no_content()
    } else {
        created()
    }
}

async fn delete_queue(
    State(api): ApiState,
    LoggedIn(who): LoggedIn,
    Path((vhost, name)): Path<(String, String)>,
    Query(q): Params,
) -> Answer {
    vhost_must_exist(&api, &vhost)?;
    let conditions = (flag(&q, "if-unused"), flag(&q, "if-empty"));
    api.node.write(|n, _| {
        if n.broker().queue_id(&vhost, &name).is_none() {
            return Err(ApiError::not_found());
        }
        let needs = [Need::On(Perm::Configure, Resource::Queue(&name))];
        who.permit_in(n.broker().access(), &vhost, &needs, Via::Direct)?;
        n.delete_queue(&vhost, &name, conditions)
            .map_err(ApiError::from)
    })??;
    no_content()
}

async fn purge_queue(
    State(api): ApiState,
    LoggedIn(who): LoggedIn,
    Path((vhost, name)): Path<(String, String)>,
) -> Answer {
    vhost_must_exist(&api, &vhost)?;
    api.node.write(|n, _| {
        // RabbitMQ answers 404 for a missing queue before looking at permissions.
        if n.broker().queue_id(&vhost, &name).is_none() {
            return Err(ApiError::not_found());
        }
        let needs = [Need::On(Perm::Read, Resource::Queue(&name))];
        who.permit_in(n.broker().access(), &vhost, &needs, Via::Direct)?;
        n.broker_mut()
            .purge_queue(&vhost, &name, API_CONN)
            .map_err(ApiError::from)
    })??;
    no_content()
}

/// `POST /api/queues/{vhost}/{name}/get`: takes up to `count` messages, then settles them as
/// `ackmode` says (`ack_requeue_true` puts them back, redelivered, as RabbitMQ does).
/// Warren's own: `POST /api/queues/{vhost}/{name}/move` with `{"destination": "q2"}` and an
/// optional `count` (default and most: 10,000) moves ready messages to another queue of
/// the vhost, each put there and acked here in one store write (acked once its copy's
/// entries are applied, for a quorum queue on a cluster). Answers `{"moved": n}`.
async fn move_messages(
    State(api): ApiState,
    LoggedIn(who): LoggedIn,
    ConnectInfo(peer): Peer,
    Path((vhost, name)): Path<(String, String)>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Answer {
    vhost_must_exist(&api, &vhost)?;
    let call = (&who.name[..], peer.ip(), &uri, &headers, &body);
    if let Some(answer) = forward::to_leader(&api, call, (&vhost, &name)).await {
        return answer;
    }
    let b = body_json(&body)?;
    let destination = b
        .get("destination")
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::bad_request("[{key_missing,destination}]"))?
        .to_owned();
    // At most this many per call, so that one call holds the node for milliseconds: a
    // caller moving more calls again until `moved` comes back short.
    const MOST: u32 = 10_000;
    let count = match b.get("count") {
        None | Some(Value::Null) => MOST,
        Some(v) => conv::integer(v)
            .map(|n| u32::try_from(n).unwrap_or(u32::MAX).min(MOST))
            .ok_or_else(|| ApiError::bad_request("count must be a non-negative integer"))?,
    };
    // A get from the source and a publish to the destination through the default exchange:
    // what a client doing the same over AMQP would need.
    let needs = [
        Need::On(Perm::Read, Resource::Queue(&name)),
        Need::On(Perm::Write, Resource::Exchange("")),
    ];
    let moved = api.node.write(|n, now| {
        who.permit_in(n.broker().access(), &vhost, &needs, Via::Channel)?;
        n.move_messages(&vhost, &name, &destination, count, now)
            .map_err(ApiError::from)
    })??;
    ok(json!({ "moved": moved }))
}

async fn get_messages(
    State(api): ApiState,
    LoggedIn(who): LoggedIn,
    ConnectInfo(peer): Peer,
    Path((vhost, name)): Path<(String, String)>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Answer {
    vhost_must_exist(&api, &vhost)?;
    let call = (&who.name[..], peer.ip(), &uri, &headers, &body);
    if let Some(answer) = forward::to_leader(&api, call, (&vhost, &name)).await {
        return answer;
    }
    let b = body_json(&body)?;
    let missing: Vec<String> = ["ackmode", "count", "encoding"]
        .into_iter()
        .filter(|k| b.get(k).is_none())
        .map(|k| format!("{{key_missing,{k}}}"))
        .collect();
    if !missing.is_empty() {
        return Err(ApiError::bad_request(format!("[{}]", missing.join(","))));
    }
    // Numbers may come as strings (RabbitMQ accepts both).
    let number = |k: &str| b.get(k).and_then(conv::integer);
    let count = number("count")
        .ok_or_else(|| ApiError::bad_request("count must be a non-negative integer"))?
        .min(10_000);
    let ackmode = b
        .get("ackmode")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    let (requeue, ack) = match ackmode.as_str() {
        "ack_requeue_true" => (true, true),
        "ack_requeue_false" => (false, true),
        "reject_requeue_true" => (true, false),
        "reject_requeue_false" => (false, false),
        other => return Err(ApiError::bad_request(format!("unknown ackmode {other}"))),
    };
    let encoding = b
        .get("encoding")
        .and_then(Value::as_str)
        .unwrap_or("auto")
        .to_owned();
    if encoding != "auto" && encoding != "base64" {
        return Err(ApiError::bad_request(
            "Unsupported encoding. Please use auto or base64.",
        ));
    }
    let truncate = number("truncate").map(|t| usize::try_from(t).unwrap_or(usize::MAX));
    let got = api.node.write(|n, _| {
        // basic.get: checked before the queue is looked up.
        let needs = [Need::On(Perm::Read, Resource::Queue(&name))];
        who.permit_in(n.broker().access(), &vhost, &needs, Via::Channel)?;
        let broker = n.broker_mut();
        // On a quorum queue's leader the answer waits until the log has the gets (and what
        // follows them): the messages are handed out then, every one the call asked for.
        let settle = |b: &mut warren_broker::Broker, d: &warren_broker::Delivery| {
            match (requeue, ack) {
                (true, _) => b.requeue(d.queue, d.receipt),
                (false, true) => b.settle(d.queue, d.receipt),
                (false, false) => b.discard(d.queue, d.receipt),
            };
        };
        broker
            .get_many_awaited(
                (&vhost, &name),
                usize::try_from(count).unwrap_or(0),
                API_CONN,
                settle,
            )
            .map_err(ApiError::from)
    })??;
    let out: Vec<Value> = got
        .iter()
        .map(|(d, remaining)| {
            let m = &d.message;
            let bytes = match truncate {
                Some(t) if t < m.body.len() => m.body.slice(..t),
                _ => m.body.clone(),
            };
            let (payload, enc) = match (encoding.as_str(), std::str::from_utf8(&bytes)) {
                ("auto", Ok(text)) => (text.to_owned(), "string"),
                _ => (
                    base64::engine::general_purpose::STANDARD.encode(&bytes),
                    "base64",
                ),
            };
            json!({
                "payload_bytes": m.body.len(),
                "redelivered": d.redelivered,
                "exchange": m.exchange.as_str(),
                "routing_key": m.routing_key.as_str(),
                "message_count": remaining,
                "properties": conv::properties(&m.properties),
                "payload": payload,
                "payload_encoding": enc,
            })
        })
        .collect();
    ok(Value::Array(out))
}

async fn queue_bindings(
    State(api): ApiState,
    _: LoggedIn,
    Path((vhost, name)): Path<(String, String)>,
) -> Answer {
    if api
        .node
        .read(|n, _| n.broker().queue_id(&vhost, &name))
        .is_none()
    {
        return Err(ApiError::not_found());
    }
    ok(bindings_where(&api, &vhost, |b| {
        b.to_queue && b.destination.as_str() == name
    }))
}

/// How long a quorum status waits for the Raft thread's answer (between two of its passes).
const QUORUM_STATUS_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// `GET /api/queues/{vhost}/{name}/quorum-status` (Warren's): this node's member of a quorum
/// queue's Raft group, as one row of RabbitMQ's `rabbitmq-queues quorum_status`; `warren ctl
/// quorum_status` asks every node for its row. 400 for a queue that is not replicated.
async fn queue_quorum_status(
    State(api): ApiState,
    _: LoggedIn,
    Path((vhost, name)): Path<(String, String)>,
) -> Answer {
    let (exists, group, me) = api.node.read(|n, _| {
        let b = n.broker();
        let id = b.queue_id(&vhost, &name);
        (
            id.is_some(),
            id.and_then(|id| b.replica_group(id)),
            b.cluster_node(),
        )
    });
    if !exists {
        return Err(ApiError::not_found());
    }
    let (Some(group), Some(me)) = (group, me) else {
        return Err(ApiError::bad_request(format!(
            "queue '{name}' in vhost '{vhost}' is not a quorum queue on a cluster"
        )));
    };
    let raft = match api.node.raft() {
        Some(r) => r.group_status(QUORUM_STATUS_WAIT).await,
        None => None,
    };
    let Some(s) = raft
        .into_iter()
        .flatten()
        .find(|s| s.group == warren_replication::GroupId(group))
    else {
        // Declared here and its group not started yet, or the Raft thread did not answer.
        return ok(json!({"node": api.node_name, "raft_state": "noproc"}));
    };
    let names = api.names();
    let name_of = |n: u64| names.get(&n).cloned().unwrap_or_else(|| n.to_string());
    let membership = if s.members.voters.contains(&me) {
        "voter"
    } else if s.members.learners.contains(&me) {
        "non_voter"
    } else {
        "unknown"
    };
    ok(json!({
        "node": api.node_name,
        "raft_state": if s.leading { "leader" } else { "follower" },
        "membership": membership,
        "last_log_index": s.last_index,
        "last_applied": s.applied,
        "commit_index": s.commit,
        "snapshot_index": s.snapshot_index,
        "term": s.term,
        "machine_version": warren_broker::FEATURE_LEVEL,
        "leader": s.leader.map(name_of),
        "members": s.members.voters.iter().map(|n| name_of(*n)).collect::<Vec<_>>(),
        "learners": s.members.learners.iter().map(|n| name_of(*n)).collect::<Vec<_>>(),
    }))
}

// ------------------------------------------------------------------ bindings

async fn bindings_all(State(api): ApiState, LoggedIn(who): LoggedIn) -> Answer {
    let all = api.node.read(|n, _| {
        let b = n.broker();
        let mut all = b.binding_snapshots(None);
        all.retain(|x| who.sees_vhost(b.access(), &x.vhost));
        all
    });
    ok(all.iter().map(objects::binding).collect())
}

async fn bindings_vhost(State(api): ApiState, _: LoggedIn, Path(vhost): Path<String>) -> Answer {
    vhost_must_exist(&api, &vhost)?;
    ok(bindings_where(&api, &vhost, |_| true))
}

/// `q` or `e` in a binding path: is the destination a queue?
fn to_queue(kind: &str) -> Result<bool, ApiError> {
    match kind {
        "q" => Ok(true),
        "e" => Ok(false),
        _ => Err(ApiError::not_found()),
    }
}

/// Both ends of a binding path must exist (RabbitMQ answers 404 otherwise).
fn ends_exist(
    api: &Api,
    vhost: &str,
    source: &str,
    dest: &str,
    queue: bool,
) -> Result<(), ApiError> {
    let ok = api.node.read(|n, _| {
        let b = n.broker();
        b.exchange_exists(vhost, source)
            && if queue {
                b.queue_id(vhost, dest).is_some()
            } else {
                b.exchange_exists(vhost, dest)
            }
    });
    if ok {
        Ok(())
    } else {
        Err(ApiError::not_found())
    }
}

fn between(
    api: &Api,
    vhost: &str,
    source: &str,
    dest: &str,
    queue: bool,
) -> Vec<warren_broker::BindingSnapshot> {
    api.node
        .read(|n, _| n.broker().binding_snapshots(Some(vhost)))
        .into_iter()
        .filter(|b| {
            b.source.as_str() == source && b.destination.as_str() == dest && b.to_queue == queue
        })
        .collect()
}

async fn bindings_between(
    State(api): ApiState,
    _: LoggedIn,
    Path((vhost, source, kind, dest)): Path<(String, String, String, String)>,
) -> Answer {
    let queue = to_queue(&kind)?;
    let source = exchange_name(&source).to_owned();
    ends_exist(&api, &vhost, &source, &dest, queue)?;
    ok(between(&api, &vhost, &source, &dest, queue)
        .iter()
        .map(objects::binding)
        .collect())
}

async fn create_binding(
    State(api): ApiState,
    LoggedIn(who): LoggedIn,
    Path((vhost, source, kind, dest)): Path<(String, String, String, String)>,
    body: Bytes,
) -> Answer {
    let queue = to_queue(&kind)?;
    ends_exist(&api, &vhost, &source, &dest, queue)?;
    let b = body_json(&body)?;
    let key = b
        .get("routing_key")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_owned();
    let arguments = conv::to_table(b.get("arguments").unwrap_or(&Value::Null))
        .map_err(ApiError::bad_request)?;
    short(&key, "routing key")?;
    let needs = binding_needs(&source, &dest, queue, &key);
    api.node.write(|n, _| {
        who.permit_in(n.broker().access(), &vhost, &needs, Via::Direct)?;
        let broker = n.broker_mut();
        if queue {
            broker.bind_queue(&vhost, &dest, &source, &key, &arguments, API_CONN)
        } else {
            broker.bind_exchange(&vhost, &dest, &source, &key, &arguments)
        }
        .map_err(ApiError::from)
    })??;
    let made = warren_broker::BindingSnapshot {
        vhost: vhost.clone(),
        source: short(&source, "exchange")?,
        destination: short(&dest, "destination")?,
        to_queue: queue,
        routing_key: short(&key, "routing key")?,
        arguments,
    };
    let location = objects::properties_key(&made);
    let mut r = StatusCode::CREATED.into_response();
    if let Ok(v) = location.parse() {
        r.headers_mut().insert(header::LOCATION, v);
    }
    Ok(r)
}

/// queue.bind and exchange.bind (and their unbinds): write on the destination, read on the
/// source, and the topic permission to read the key from the source.
fn binding_needs<'a>(source: &'a str, dest: &'a str, queue: bool, key: &'a str) -> [Need<'a>; 3] {
    let destination = if queue {
        Resource::Queue(dest)
    } else {
        Resource::Exchange(dest)
    };
    [
        Need::On(Perm::Write, destination),
        Need::On(Perm::Read, Resource::Exchange(source)),
        Need::Topic(Perm::Read, source, key),
    ]
}

fn find_binding(
    api: &Api,
    (vhost, source, kind, dest, props): &(String, String, String, String, String),
) -> Result<warren_broker::BindingSnapshot, ApiError> {
    let queue = to_queue(kind)?;
    let source = exchange_name(source);
    ends_exist(api, vhost, source, dest, queue)?;
    between(api, vhost, source, dest, queue)
        .into_iter()
        .find(|b| {
            // The path was percent-decoded once: a key's escapes arrive decoded (or, if the
            // client encoded them twice as RabbitMQ's Location header does, as sent).
            let key = objects::properties_key(b);
            key == *props || objects::percent_decode(&key) == *props
        })
        .ok_or_else(ApiError::not_found)
}

async fn one_binding(
    State(api): ApiState,
    _: LoggedIn,
    Path(path): Path<(String, String, String, String, String)>,
) -> Answer {
    ok(objects::binding(&find_binding(&api, &path)?))
}

async fn delete_binding(
    State(api): ApiState,
    LoggedIn(who): LoggedIn,
    Path(path): Path<(String, String, String, String, String)>,
) -> Answer {
    let b = find_binding(&api, &path)?;
    let needs = binding_needs(&b.source, &b.destination, b.to_queue, &b.routing_key);
    api.node.write(|n, _| {
        who.permit_in(n.broker().access(), &b.vhost, &needs, Via::Direct)?;
        let broker = n.broker_mut();
        if b.to_queue {
            broker.unbind_queue(
                &b.vhost,
                &b.destination,
                &b.source,
                &b.routing_key,
                &b.arguments,
                API_CONN,
            )
        } else {
            broker.unbind_exchange(
                &b.vhost,
                &b.destination,
                &b.source,
                &b.routing_key,
                &b.arguments,
            )
        }
        .map_err(ApiError::from)
    })??;
    no_content()
}

// ------------------------------------------------------------------ connections, channels

/// The connections this user may see: all with `monitoring`, else its own.
fn visible_connections(
    api: &Api,
    who: &Login,
    vhost: Option<&str>,
) -> Vec<warren_session::manage::ConnectionSnapshot> {
    api.node
        .read(|n, _| n.connection_snapshots())
        .into_iter()
        .filter(|c| who.may_reach(&c.user, false))
        .filter(|c| vhost.is_none_or(|v| v == c.vhost))
        .collect()
}

fn list_connections(
    api: &Api,
    who: &Login,
    vhost: Option<&str>,
    q: &HashMap<String, String>,
) -> Answer {
    let query = ListQuery::parse(q)?;
    let matcher = query.matcher()?;
    let conns = visible_connections(api, who, vhost);
    let total = conns.len();
    let items = conns
        .iter()
        .filter(|c| matcher(&objects::connection_name(c)))
        .map(|c| objects::connection(c, &api.node_name))
        .collect();
    ok(query.finish(items, total)?)
}

async fn connections(State(api): ApiState, LoggedIn(who): LoggedIn, Query(q): Params) -> Answer {
    list_connections(&api, &who, None, &q)
}

async fn vhost_connections(
    State(api): ApiState,
    LoggedIn(who): LoggedIn,
    Path(vhost): Path<String>,
    Query(q): Params,
) -> Answer {
    vhost_must_exist(&api, &vhost)?;
    list_connections(&api, &who, Some(&vhost), &q)
}

/// A connection by name: 404 when there is none, and RabbitMQ's 401 when it is another
/// user's and this one may not see it or, to close it (`close`), is not an administrator
/// (`is_authorized_user`: monitoring users see everyone's connections but close only theirs).
fn find_connection(
    api: &Api,
    who: &Login,
    name: &str,
    close: bool,
) -> Result<warren_session::manage::ConnectionSnapshot, ApiError> {
    let c = api
        .node
        .read(|n, _| n.connection_snapshots())
        .into_iter()
        .find(|c| objects::connection_name(c) == name)
        .ok_or_else(ApiError::not_found)?;
    if !who.may_reach(&c.user, close) {
        return Err(ApiError::not_allowed(
            "User not authorised to access object",
        ));
    }
    Ok(c)
}

async fn one_connection(
    State(api): ApiState,
    LoggedIn(who): LoggedIn,
    Path(name): Path<String>,
) -> Answer {
    ok(objects::connection(
        &find_connection(&api, &who, &name, false)?,
        &api.node_name,
    ))
}

async fn close_connection(
    State(api): ApiState,
    LoggedIn(who): LoggedIn,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> Answer {
    let c = find_connection(&api, &who, &name, true)?;
    let reason = headers
        .get("x-reason")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("Closed via management plugin")
        .to_owned();
    tracing::info!(conn = c.id, by = %who.name, reason = %reason, "closing a connection through the management API");
    api.node
        .write(|n, now| n.close_connection(c.id, &reason, now))?;
    no_content()
}

/// A user's connections, for `/api/connections/username/{user}`: that user itself may list
/// and close them, a monitoring user list them (as RabbitMQ 3.10.8 answers), an
/// administrator both.
fn connections_of_user(
    api: &Api,
    who: &Login,
    user: &str,
    close: bool,
) -> Result<Vec<warren_session::manage::ConnectionSnapshot>, ApiError> {
    if !who.may_reach(user, close) {
        return Err(ApiError::not_allowed(
            "User not authorised to access object",
        ));
    }
    Ok(api
        .node
        .read(|n, _| n.connection_snapshots())
        .into_iter()
        .filter(|c| c.user == user)
        .collect())
}

/// As RabbitMQ: the user's connections as `{name, node, user, vhost}` (its tracked
/// connections), `[]` for a user with none or no such user.
async fn user_connections(
    State(api): ApiState,
    LoggedIn(who): LoggedIn,
    Path(user): Path<String>,
) -> Answer {
    let conns = connections_of_user(&api, &who, &user, false)?;
    ok(conns
        .iter()
        .map(|c| {
            json!({
                "name": objects::connection_name(c),
                "node": api.node_name,
                "user": c.user,
                "vhost": c.vhost,
            })
        })
        .collect())
}

/// Closes every connection of a user (`X-Reason` as for one connection); 204 even when the
/// user has none, as RabbitMQ.
async fn close_user_connections(
    State(api): ApiState,
    ConnectInfo(peer): Peer,
    headers: HeaderMap,
    Path(user): Path<String>,
) -> Answer {
    let who = login(&api, &headers, peer)?;
    let conns = connections_of_user(&api, &who, &user, true)?;
    let reason = headers
        .get("x-reason")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("Closed via management plugin")
        .to_owned();
    for c in conns {
        tracing::info!(conn = c.id, by = %who.name, reason = %reason, "closing a connection through the management API");
        api.node
            .write(|n, now| n.close_connection(c.id, &reason, now))?;
    }
    no_content()
}

async fn connection_channels(
    State(api): ApiState,
    LoggedIn(who): LoggedIn,
    Path(name): Path<String>,
) -> Answer {
    let c = find_connection(&api, &who, &name, false)?;
    ok(c.channels
        .iter()
        .map(|ch| objects::channel(&c, ch, &api.node_name))
        .collect())
}

fn list_channels(
    api: &Api,
    who: &Login,
    vhost: Option<&str>,
    q: &HashMap<String, String>,
) -> Answer {
    let query = ListQuery::parse(q)?;
    let matcher = query.matcher()?;
    let conns = visible_connections(api, who, vhost);
    let mut items = Vec::new();
    let mut total = 0;
    for c in &conns {
        for ch in &c.channels {
            total += 1;
            if matcher(&objects::channel_name(c, ch)) {
                items.push(objects::channel(c, ch, &api.node_name));
            }
        }
    }
    ok(query.finish(items, total)?)
}

async fn channels(State(api): ApiState, LoggedIn(who): LoggedIn, Query(q): Params) -> Answer {
    list_channels(&api, &who, None, &q)
}

async fn vhost_channels(
    State(api): ApiState,
    LoggedIn(who): LoggedIn,
    Path(vhost): Path<String>,
    Query(q): Params,
) -> Answer {
    vhost_must_exist(&api, &vhost)?;
    list_channels(&api, &who, Some(&vhost), &q)
}

async fn one_channel(
    State(api): ApiState,
    LoggedIn(who): LoggedIn,
    Path(name): Path<String>,
) -> Answer {
    let conns = api.node.read(|n, _| n.connection_snapshots());
    for c in &conns {
        if let Some(ch) = c
            .channels
            .iter()
            .find(|ch| objects::channel_name(c, ch) == name)
        {
            // Another user's channel exists for everyone, as in RabbitMQ: 401, not 404.
            if !who.may_reach(&c.user, false) {
                return Err(ApiError::not_allowed(
                    "User not authorised to access object",
                ));
            }
            return ok(objects::channel(c, ch, &api.node_name));
        }
    }
    Err(ApiError::not_found())
}

/// Consumers as RabbitMQ lists them: monitoring users see all, others those of their own
/// connections (whatever the vhost, which is why `/api/consumers/{vhost}` is [`Unscoped`]).
fn list_consumers(api: &Api, who: &Login, vhost: Option<&str>) -> Answer {
    let (consumers, conns) = api.node.read(|n, _| {
        (
            n.broker().consumer_snapshots(vhost),
            n.connection_snapshots(),
        )
    });
    ok(consumers
        .iter()
        .filter_map(|k| {
            let conn = conns.iter().find(|c| c.id == k.conn);
            conn.map_or(who.sees_all(), |c| who.may_reach(&c.user, false))
                .then(|| objects::consumer(k, conn, &api.node_name))
        })
        .collect())
}

async fn consumers_all(State(api): ApiState, LoggedIn(who): LoggedIn) -> Answer {
    list_consumers(&api, &who, None)
}

async fn consumers_vhost(
    State(api): ApiState,
    Unscoped(who): Unscoped,
    Path(vhost): Path<String>,
) -> Answer {
    vhost_must_exist(&api, &vhost)?;
    list_consumers(&api, &who, Some(&vhost))
}

// ------------------------------------------------------------------ definitions

async fn definitions_all(State(api): ApiState, _: Admin) -> Answer {
    Ok(attachment(super::definitions::export(&api, None)))
}

async fn definitions_vhost(State(api): ApiState, _: Admin, Path(vhost): Path<String>) -> Answer {
    vhost_must_exist(&api, &vhost)?;
    Ok(attachment(super::definitions::export(&api, Some(&vhost))))
}

/// `?download=file.json` in RabbitMQ's UI: the same JSON either way.
fn attachment(v: Value) -> Response {
    Json(v).into_response()
}

async fn import_definitions(State(api): ApiState, _: Admin, body: Bytes) -> Answer {
    let defs = body_json(&body)?;
    let waiting = super::definitions::import(&api, &defs, None)?;
    super::definitions::made(&api, waiting).await?;
    no_content()
}

async fn import_definitions_vhost(
    State(api): ApiState,
    _: Admin,
    Path(vhost): Path<String>,
    body: Bytes,
) -> Answer {
    vhost_must_exist(&api, &vhost)?;
    let defs = body_json(&body)?;
    let waiting = super::definitions::import(&api, &defs, Some(&vhost))?;
    super::definitions::made(&api, waiting).await?;
    no_content()
}

// ------------------------------------------------------------------ health checks

fn health_failed(reason: &str, extra: Value) -> Answer {
    let mut v = json!({"status": "failed", "reason": reason});
    if let (Some(m), Some(e)) = (v.as_object_mut(), extra.as_object()) {
        m.extend(e.clone());
    }
    Ok((StatusCode::SERVICE_UNAVAILABLE, Json(v)).into_response())
}

async fn health_alarms(State(api): ApiState, _: LoggedIn) -> Answer {
    match api.node.read(|n, _| n.alarm()) {
        None => ok(json!({"status": "ok"})),
        Some(alarm) => {
            let resource = if alarm.contains("disk") {
                "disk"
            } else {
                "memory"
            };
            health_failed(
                "There are alarms in effect in the cluster",
                json!({"alarms": [{"node": api.node_name, "resource": resource}]}),
            )
        }
    }
}

/// RabbitMQ's answer: 503 while stopping this node would leave replicated queues without a
/// majority (a rolling restart waits for it), with each queue; the metadata group too.
async fn health_quorum_critical(State(api): ApiState, _: LoggedIn) -> Answer {
    let Some((queues, metadata)) = api.node.read(|n, _| n.broker().quorum_critical()) else {
        return ok(json!({"status": "ok", "reason": "single node cluster"}));
    };
    if !metadata && queues.is_empty() {
        return ok(json!({"status": "ok"}));
    }
    let mut list: Vec<Value> = queues
        .iter()
        .map(|(vhost, name)| {
            json!({
                "readable_name": format!("queue '{name}' in vhost '{vhost}'"),
                "name": name.as_str(),
                "virtual_host": vhost,
                "type": "quorum",
            })
        })
        .collect();
    if metadata {
        list.push(json!({
            "readable_name": "warren_metadata",
            "name": "warren_metadata",
            "virtual_host": "-",
            "type": "process",
        }));
    }
    health_failed(
        "There are quorum queues that would lose their quorum if the target node is shut down",
        json!({ "queues": list }),
    )
}

async fn health_ok(_: LoggedIn) -> Answer {
    ok(json!({"status": "ok"}))
}

/// RabbitMQ's certificate check: 503 while a TLS listener's certificate (or CA) file holds a
/// certificate that expires within the period, or cannot be read.
async fn health_certificates(
    State(api): ApiState,
    _: LoggedIn,
    Path((within, unit)): Path<(String, String)>,
) -> Answer {
    let period = super::certificates::period(&within, &unit)?;
    let Some((cert, ca)) = &api.tls_files else {
        return ok(json!({"status": "ok"}));
    };
    let now = api.node.read(|_, now| now) / 1000;
    let now = i64::try_from(now).unwrap_or(i64::MAX);
    let deadline = now.saturating_add(i64::try_from(period).unwrap_or(i64::MAX));
    let mut listeners: Vec<(&str, u16)> = api
        .amqps_port
        .map(|p| ("amqp/ssl", p))
        .into_iter()
        .collect();
    if api.http_tls.0 {
        listeners.push(("https", api.http_port));
    }
    if let (true, Some(p)) = (api.http_tls.1, api.prometheus_port) {
        listeners.push(("https", p));
    }
    let expired: Vec<Value> = listeners
        .into_iter()
        .filter_map(|l| {
            super::certificates::listener_entry(
                &api.node_name,
                l,
                cert,
                ca.as_deref(),
                (now, deadline),
            )
        })
        .collect();
    if expired.is_empty() {
        return ok(json!({"status": "ok"}));
    }
    health_failed("Certificates expiring", json!({ "expired": expired }))
}

fn listening_ports(api: &Api) -> Vec<u16> {
    let mut ports = vec![api.amqp_port, api.http_port];
    ports.extend(api.amqps_port);
    ports.extend(api.prometheus_port);
    ports
}

async fn health_port(State(api): ApiState, _: LoggedIn, Path(port): Path<String>) -> Answer {
    let port: u16 = port
        .parse()
        .map_err(|_| ApiError::bad_request(format!("invalid port {port}")))?;
    let ports = listening_ports(&api);
    if ports.contains(&port) {
        ok(json!({"status": "ok", "port": port}))
    } else {
        health_failed(
            "No active listener",
            json!({"missing": port, "ports": ports}),
        )
    }
}

async fn health_protocol(
    State(api): ApiState,
    _: LoggedIn,
    Path(protocol): Path<String>,
) -> Answer {
    let known = match protocol.as_str() {
        "amqp" | "amqp091" | "amqp0.9.1" | "amqp0-9-1" => true,
        "http" => !api.http_tls.0,
        "https" => api.http_tls.0,
        "amqp/ssl" | "amqps" => api.amqps_port.is_some(),
        "prometheus" => api.prometheus_port.is_some(),
        "http/prometheus" => api.prometheus_port.is_some() && !api.http_tls.1,
        "https/prometheus" => api.prometheus_port.is_some() && api.http_tls.1,
        _ => false,
    };
    if known {
        ok(json!({"status": "ok", "protocol": protocol}))
    } else {
        health_failed(
            "No active listener",
            json!({"missing": protocol, "protocols": ["amqp", "http", "http/prometheus"]}),
        )
    }
}

/// RabbitMQ's aliveness test: declares the `aliveness-test` queue in the vhost, publishes a
/// message to it and gets it back.
async fn aliveness(
    State(api): ApiState,
    LoggedIn(who): LoggedIn,
    Path(vhost): Path<String>,
) -> Answer {
    vhost_must_exist(&api, &vhost)?;
    const QUEUE: &str = "aliveness-test";
    // RabbitMQ runs the test on a channel of the asking user: declare, publish, get.
    who.permit(
        &api,
        &vhost,
        &[
            Need::On(Perm::Configure, Resource::Queue(QUEUE)),
            Need::On(Perm::Write, Resource::Exchange("")),
            Need::On(Perm::Read, Resource::Queue(QUEUE)),
        ],
        Via::Channel,
    )?;
    let body = Bytes::from_static(b"test_message");
    let got = api.node.write(|n, now| {
        let b = n.broker_mut();
        b.declare_queue(
            &vhost,
            DeclareQueue {
                name: ShortStr::from_static(QUEUE),
                passive: false,
                durable: false,
                exclusive: false,
                auto_delete: false,
                arguments: FieldTable::new(),
            },
            API_CONN,
        )?;
        let message = Message {
            exchange: ShortStr::from_static(""),
            routing_key: ShortStr::from_static(QUEUE),
            properties: warren_codec::properties::BasicProperties::default().encode(),
            body: body.clone(),
            persistent: false,
            store_key: None,
            away: None,
        };
        b.publish(&vhost, "", QUEUE, message, now)?;
        // Earlier tests that failed half-way may have left messages: take until ours.
        loop {
            match b.get(&vhost, QUEUE, true, API_CONN)? {
                Some((d, _)) if d.message.body == body => return Ok(true),
                Some(_) => continue,
                None => return Ok::<_, warren_codec::AmqpError>(false),
            }
        }
    })??;
    if got {
        ok(json!({"status": "ok"}))
    } else {
        health_failed("the test message did not come back", json!({}))
    }
}
