//! A quorum queue's members, as RabbitMQ's management API changes them (its 3.13 and later
//! routes, which `rabbitmq-queues add_member`, `delete_member`, `grow` and `shrink` match):
//! `POST /api/queues/quorum/{vhost}/{name}/replicas/add` and `DELETE
//! .../replicas/delete` with `{"node": N}`, `POST /api/queues/quorum/replicas/on/{node}/grow`
//! with a strategy (`all`, or `even`: only queues with an even number of members) and vhost
//! and queue patterns, `DELETE /api/queues/quorum/replicas/on/{node}/shrink`. Administrators
//! only. A node taken off a queue's members keeps it as a learner (see docs/compatibility.md).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use warren_broker::MemberError;

use super::{Admin, Api, ApiError};

type ApiState = State<Arc<Api>>;
type Answer = Result<Response, ApiError>;
/// A queue (vhost, name) and its number of voters after a change, or why it was refused.
type Outcome = (String, String, Result<usize, String>);

pub fn routes() -> Router<Arc<Api>> {
    Router::new()
        .route(
            "/api/queues/quorum/{vhost}/{name}/replicas/add",
            post(add_member),
        )
        .route(
            "/api/queues/quorum/{vhost}/{name}/replicas/delete",
            delete(delete_member),
        )
        .route("/api/queues/quorum/replicas/on/{node}/grow", post(grow))
        .route(
            "/api/queues/quorum/replicas/on/{node}/shrink",
            delete(shrink),
        )
}

/// The number of the node a request names: as `/api/nodes` names it, or its number.
fn node_number(api: &Api, name: &str) -> Result<u64, ApiError> {
    api.names()
        .into_iter()
        .find(|(n, known)| known == name || n.to_string() == name)
        .map(|(n, _)| n)
        .ok_or_else(|| ApiError::bad_request(format!("no node {name} in the cluster")))
}

fn body_node(body: &Bytes) -> Result<String, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|_| ApiError::bad_request("body must be a JSON object"))?;
    v["node"]
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| ApiError::bad_request("the body names no node (\"node\")"))
}

fn member_error(e: MemberError) -> ApiError {
    match e {
        MemberError::NoQueue { .. } => ApiError::not_found(),
        e => ApiError::bad_request(e.to_string()),
    }
}

fn change(api: &Api, vhost: &str, name: &str, node: u64, add: bool) -> Result<bool, ApiError> {
    api.node
        .write(|n, _| n.broker_mut().change_queue_member(vhost, name, node, add))?
        .map_err(member_error)
}

/// The node a `replicas/add` or `replicas/delete` body names made a voter of the queue, or
/// taken off its voters; RabbitMQ's statuses (204 and 202).
fn member_route(api: &Api, (vhost, name): (String, String), body: &Bytes, add: bool) -> Answer {
    let node = node_number(api, &body_node(body)?)?;
    change(api, &vhost, &name, node, add)?;
    Ok(if add {
        StatusCode::NO_CONTENT
    } else {
        StatusCode::ACCEPTED
    }
    .into_response())
}

async fn add_member(
    State(api): ApiState,
    _: Admin,
    Path(q): Path<(String, String)>,
    body: Bytes,
) -> Answer {
    member_route(&api, q, &body, true)
}

async fn delete_member(
    State(api): ApiState,
    _: Admin,
    Path(q): Path<(String, String)>,
    body: Bytes,
) -> Answer {
    member_route(&api, q, &body, false)
}

/// A pattern of grow's body (absent: every name): a regular expression matched anywhere in
/// the name, as RabbitMQ matches it.
fn pattern(v: &Value, key: &str) -> Result<regex_lite::Regex, ApiError> {
    let p = v[key].as_str().unwrap_or(".*");
    regex_lite::Regex::new(p).map_err(|e| ApiError::bad_request(format!("{key}: {e}")))
}

/// Each queue's outcome, as `rabbitmq-queues shrink` lists them.
fn outcomes(list: Vec<Outcome>) -> Value {
    list.into_iter()
        .map(|(vhost, name, r)| match r {
            Ok(size) => json!({"vhost": vhost, "name": name, "size": size, "result": "ok"}),
            Err(e) => json!({"vhost": vhost, "name": name, "result": "error", "error": e}),
        })
        .collect()
}

/// Makes `node` a voter of (`add`), or takes it off, each quorum queue that `wanted` picks by
/// its vhost, name and voters (and that needs the change); each one's outcome, its new size
/// or why not.
fn change_each(
    api: &Api,
    node: u64,
    add: bool,
    wanted: impl Fn(&str, &str, &[u64]) -> bool,
) -> Result<Vec<Outcome>, ApiError> {
    let list = api
        .node
        .read(|n, _| {
            let b = n.broker();
            b.members_changeable().map(|()| b.quorum_queue_voters())
        })
        .map_err(member_error)?;
    let mut done = Vec::new();
    for (vhost, name, voters) in list {
        if voters.contains(&node) == add || !wanted(&vhost, name.as_str(), &voters) {
            continue;
        }
        let size = if add {
            voters.len() + 1
        } else {
            voters.len() - 1
        };
        let r = change(api, &vhost, name.as_str(), node, add)
            .map(|_| size)
            .map_err(|e| e.reason().to_owned());
        done.push((vhost, name.to_string(), r));
    }
    Ok(done)
}

/// Makes `node` a member of every quorum queue (`all`), or of those with an even number of
/// members (`even`), whose vhost and name match the patterns.
async fn grow(State(api): ApiState, _: Admin, Path(node): Path<String>, body: Bytes) -> Answer {
    let node = node_number(&api, &node)?;
    let v: Value = if body.is_empty() {
        json!({})
    } else {
        serde_json::from_slice(&body)
            .map_err(|_| ApiError::bad_request("body must be a JSON object"))?
    };
    let even = match v["strategy"].as_str().unwrap_or("all") {
        "all" => false,
        "even" => true,
        other => {
            return Err(ApiError::bad_request(format!(
                "strategy must be all or even, not {other}"
            )))
        }
    };
    let (vhosts, queues) = (pattern(&v, "vhost_pattern")?, pattern(&v, "queue_pattern")?);
    let done = change_each(&api, node, true, |vhost, name, voters| {
        (!even || voters.len() % 2 == 0) && vhosts.is_match(vhost) && queues.is_match(name)
    })?;
    for (vhost, name, r) in &done {
        if let Err(error) = r {
            tracing::warn!(%vhost, queue = %name, node, %error, "a quorum queue did not grow");
        }
    }
    tracing::info!(node, queues = done.len(), "quorum queues grown onto a node");
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// Takes `node` off the members of every quorum queue it is one of, but those it is the
/// last member of.
async fn shrink(State(api): ApiState, _: Admin, Path(node): Path<String>) -> Answer {
    let node = node_number(&api, &node)?;
    let done = change_each(&api, node, false, |_, _, _| true)?;
    tracing::info!(node, queues = done.len(), "quorum queues shrunk off a node");
    Ok((StatusCode::ACCEPTED, Json(outcomes(done))).into_response())
}
