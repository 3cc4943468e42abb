//! A quorum queue's management calls that only its leader can carry out (taking messages with
//! `get`, Warren's `move`), made on another node's API, go on to the leader's management API
//! with the caller's credentials, and its answer comes back unchanged: RabbitMQ's management
//! API answers them on any node of a cluster, and a web page or a load balancer in front of
//! the nodes does not know which one leads.
//!
//! The leader's address is the one its figures announce (`cluster.management` of
//! `/api/nodes`, shared every two seconds). When this node has no fresh figures of the
//! leader, or the leader's API speaks HTTPS (this client has no TLS), the call is answered
//! here as before: a 400 naming the node to ask.

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::Response;

use super::{peer_figures, Api, ApiError};

/// Set on a call one node sends another. Such a call is never sent on again: a leader that
/// moved meanwhile answers it as a follower does, rather than sending it round the cluster.
pub const FORWARDED_BY: &str = "x-warren-forwarded-by";

/// The longest a forwarded call may take: a get waits for the log, up to the 30 s a
/// proposal's hold may last.
const FORWARD_TIMEOUT: Duration = Duration::from_secs(60);
/// The most an answer may hold (10,000 messages rendered as JSON).
const MOST_BYTES: u64 = 1 << 30;
/// The leader's answer headers passed on to the caller.
const KEPT: [header::HeaderName; 3] = [
    header::CONTENT_TYPE,
    header::WWW_AUTHENTICATE,
    header::RETRY_AFTER,
];

/// Where a call for a queue goes.
#[derive(Debug, PartialEq, Eq)]
enum Route {
    /// This node answers it.
    Here,
    /// The leader's management API, at this base address (`http://host:port`).
    Leader { node: u64, base: String },
}

/// Sends a call on the quorum queue `name` of `vhost` (its path and query `path`, its body
/// `body`) to the queue's leader when another node leads it and its API can be reached;
/// `None`: this node answers it.
pub async fn to_leader(
    api: &Arc<Api>,
    headers: &HeaderMap,
    vhost: &str,
    name: &str,
    path: &str,
    body: Bytes,
) -> Option<Result<Response, ApiError>> {
    if headers.contains_key(FORWARDED_BY) {
        return None;
    }
    let Route::Leader { node, base } = route(api, vhost, name) else {
        return None;
    };
    let auth = headers.get(header::AUTHORIZATION)?.clone();
    let url = format!("{base}{path}");
    let by = api.node_name.clone();
    tracing::debug!(%url, leader = node, "management call sent to the queue's leader");
    let sent = tokio::task::spawn_blocking(move || send(&url, auth, &by, &body)).await;
    Some(match sent {
        Ok(Ok(answer)) => Ok(answer),
        Ok(Err(error)) => {
            tracing::warn!(%error, leader = node, "a management call sent to a quorum queue's leader failed");
            Err(ApiError::leader_unreachable(node, &error.to_string()))
        }
        Err(error) => Err(ApiError::internal(error.to_string())),
    })
}

/// Where a call on queue `name` of `vhost` is answered.
fn route(api: &Api, vhost: &str, name: &str) -> Route {
    let own = api.node.read(|n, _| {
        let b = n.broker();
        let own = b.cluster_view().map(|(node, _, _)| node);
        b.led_elsewhere(vhost, name).map(|leader| (own, leader))
    });
    let Some((own, Some(leader))) = own else {
        return Route::Here;
    };
    if own == Some(leader) {
        // Its Raft elected this node, and the queue does not act here yet.
        return Route::Here;
    }
    match peer_figures(api, leader).and_then(|(_, v)| management_base(&v["node"])) {
        Some(base) => Route::Leader { node: leader, base },
        None => Route::Here,
    }
}

/// The base address of the management API a node's figures announce: the host of its name
/// (`warren-2@host`), the port of `cluster.management`; `None` for HTTPS.
fn management_base(node: &serde_json::Value) -> Option<String> {
    let host = node["name"].as_str()?.rsplit_once('@')?.1;
    let m = &node["cluster"]["management"];
    let port = m["port"].as_u64()?;
    if m["scheme"].as_str() != Some("http") {
        return None;
    }
    // A bare IPv6 address goes in brackets.
    let host = if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]")
    } else {
        host.to_owned()
    };
    Some(format!("http://{host}:{port}"))
}

/// POSTs `body` to `url` as the caller, and turns the leader's answer into this node's.
fn send(url: &str, auth: HeaderValue, by: &str, body: &[u8]) -> Result<Response, ureq::Error> {
    let config = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_connect(Some(Duration::from_secs(5)))
        .timeout_global(Some(FORWARD_TIMEOUT))
        .proxy(None)
        .build();
    let agent = ureq::Agent::new_with_config(config);
    let mut answer = agent
        .post(url)
        .header(header::AUTHORIZATION, auth)
        .header(header::CONTENT_TYPE, "application/json")
        .header(FORWARDED_BY, by)
        .send(body)?;
    let status = StatusCode::from_u16(answer.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let kept: Vec<(header::HeaderName, HeaderValue)> = KEPT
        .iter()
        .filter_map(|k| Some((k.clone(), answer.headers().get(k)?.clone())))
        .collect();
    let bytes = answer
        .body_mut()
        .with_config()
        .limit(MOST_BYTES)
        .read_to_vec()?;
    let mut out = Response::new(Body::from(bytes));
    *out.status_mut() = status;
    out.headers_mut().extend(kept);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_leaders_api_is_the_host_of_its_name_and_the_port_it_announces() {
        let node = |name: &str, scheme: &str| json!({"name": name, "cluster": {"management": {"port": 15702, "scheme": scheme}}});
        assert_eq!(
            management_base(&node("warren-2@10.0.0.2", "http")).as_deref(),
            Some("http://10.0.0.2:15702")
        );
        assert_eq!(
            management_base(&node("warren-2@::1", "http")).as_deref(),
            Some("http://[::1]:15702")
        );
        assert_eq!(management_base(&node("warren-2@h", "https")), None);
        assert_eq!(management_base(&json!({"name": "warren-2@h"})), None);
        assert_eq!(management_base(&node("no-host", "http")), None);
    }
}
