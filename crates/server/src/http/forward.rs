//! A quorum queue's management calls that only its leader can carry out (taking messages with
//! `get`, Warren's `move`), made on another node's API, go on to the leader's management API
//! with the caller's credentials, and its answer comes back unchanged: RabbitMQ's management
//! API answers them on any node of a cluster, and a web page or a load balancer in front of
//! the nodes does not know which one leads.
//!
//! The leader's address is the one its figures announce (`cluster.management` of
//! `/api/nodes`, shared every two seconds). When this node has no fresh figures of the
//! leader, when the leader's API cannot be reached, or when either node's API speaks HTTPS
//! (this client has no TLS, and credentials that came over TLS do not go on in the clear),
//! the call is answered here as before: a 400 naming the node to ask. A call the leader got
//! but did not answer is a 502: it may have been carried out, so it is not one to repeat
//! blindly.

use std::sync::Arc;

use axum::body::Bytes;
use axum::http::{HeaderMap, Method, Uri};
use axum::response::Response;

use super::{Api, ApiError};
use crate::relay::{self, Call, Failed, FORWARDED_BY};

/// Sends a call on the quorum queue `name` of `vhost` (by `user` from `peer`, to `uri`, with
/// `headers` and `body`) to the queue's leader when another node leads it and its API can be reached;
/// `None`: this node answers it (also when the leader could not be reached: the answer then
/// names the node to ask).
pub async fn to_leader(
    api: &Arc<Api>,
    (user, peer, uri, headers, body): (&str, std::net::IpAddr, &Uri, &HeaderMap, &Bytes),
    (vhost, name): (&str, &str),
) -> Option<Result<Response, ApiError>> {
    // A call sent on once is answered where it lands; credentials that came over TLS do not
    // go on in the clear.
    if headers.contains_key(FORWARDED_BY) || api.http_tls.0 {
        return None;
    }
    let (node, base) = relay::leader_endpoint(&api.node, vhost, name, "management")?;
    if !relay::may_carry(&api.node, user, peer, &base) {
        return None;
    }
    // The path as the client sent it (percent-encoded; the API's routes are not nested, so
    // it is whole), with its query.
    let path = uri
        .path_and_query()
        .map_or_else(|| uri.path(), |p| p.as_str());
    tracing::debug!(%base, %path, leader = node, "management call sent to the queue's leader");
    let call = Call {
        method: Method::POST,
        url: format!("{base}{path}"),
        headers: headers.clone(),
        body: body.clone(),
        by: api.node_name.clone(),
    };
    match relay::relay(call).await {
        Ok(answer) => Some(Ok(answer)),
        Err(Failed::NotSent(error)) => {
            // Nothing reached the leader: this node answers, naming it.
            tracing::warn!(%error, leader = node, "a quorum queue's leader could not be reached for a management call");
            None
        }
        Err(Failed::Sent(error)) => {
            tracing::warn!(%error, leader = node, "a management call sent to a quorum queue's leader got no answer");
            Some(Err(ApiError::leader_silent(node)))
        }
    }
}
