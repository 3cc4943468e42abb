//! SQS calls that only a quorum queue's leader can answer (ReceiveMessage, DeleteMessage,
//! ChangeMessageVisibility and their batches), made on another node of a cluster, go on to
//! the leader's SQS endpoint unchanged, and its answer comes back unchanged. The call keeps
//! its `Host` header, so its signature holds there, and the queue URLs the answer carries are
//! the ones the client used. A receipt handle does not name a node: a message received
//! through one node may be deleted through another.
//!
//! As for the management API (`crate::http::forward`), the leader's address is the one its
//! figures announce (`cluster.sqs` of `/api/nodes`); without fresh figures, or with a leader
//! that takes no connection, this node answers (an `InternalError` naming the leader, which
//! SDKs retry).

use axum::body::Bytes;
use axum::http::{HeaderMap, Method, Uri};
use axum::response::Response;
use serde_json::{Map, Value};

use super::{authenticate, query, queue_of, Sqs, SqsError};
use crate::relay::{self, Call, Failed, FORWARDED_BY};

/// The largest answer taken from the leader.
const MOST_BYTES: usize = 64 << 20;

/// The actions that take or settle messages, which a quorum queue's leader alone does.
const LEADER_ONLY: [&str; 5] = [
    "ReceiveMessage",
    "DeleteMessage",
    "DeleteMessageBatch",
    "ChangeMessageVisibility",
    "ChangeMessageVisibilityBatch",
];

/// The request sent on to the leader of the quorum queue it names, when it is one of
/// [`LEADER_ONLY`], another node leads the queue and that node's endpoint can be reached:
/// `Ok(Some(answer))`. `Ok(None)`: this node answers it. `Err`: the leader took the call
/// and its answer did not come back.
pub(super) async fn to_leader(
    sqs: &Sqs,
    peer: std::net::SocketAddr,
    (method, uri, headers, body): (&Method, &Uri, &HeaderMap, &Bytes),
    query_protocol: bool,
) -> Result<Option<Response>, SqsError> {
    if headers.contains_key(FORWARDED_BY)
        || !sqs.node.read(|n, _| n.broker().cluster_view().is_some())
    {
        return Ok(None);
    }
    // The action first, without reading the whole request: most calls are answered here.
    let form = form_of(method, uri, body);
    let action = if query_protocol {
        form_urlencoded::parse(form)
            .find(|(k, _)| k == "Action")
            .map(|(_, v)| v.into_owned())
    } else {
        headers
            .get("x-amz-target")
            .and_then(|v| v.to_str().ok())
            .and_then(|t| t.strip_prefix("AmazonSQS."))
            .map(str::to_owned)
    };
    let Some(action) = action.filter(|a| LEADER_ONLY.contains(&a.as_str())) else {
        return Ok(None);
    };
    // Only a signed request is read further and goes on: an unsigned one gets this node's
    // refusal.
    let Ok(ctx) = authenticate(sqs, peer, method, uri, headers, body) else {
        return Ok(None);
    };
    let Some(input) = input_of(uri, headers, body, form, query_protocol) else {
        return Ok(None);
    };
    let Ok((vhost, name)) = queue_of(&input) else {
        return Ok(None);
    };
    let Some((leader, base)) = relay::leader_endpoint(&sqs.node, &vhost, &name, "sqs") else {
        return Ok(None);
    };
    if !relay::may_carry(&sqs.node, &ctx.user, peer.ip(), &base) {
        return Ok(None);
    }
    let path = uri.path_and_query().map_or("/", |p| p.as_str());
    tracing::debug!(%action, leader, "SQS call sent to the queue's leader");
    let call = Call {
        method: method.clone(),
        url: format!("{base}{path}"),
        headers: headers.clone(),
        body: body.clone(),
        by: sqs.node_name.clone(),
    };
    match relay::relay(call).await {
        // Whole, with its length, as the endpoint answers itself (an SQS answer is at most
        // a few MiB: ten messages of 256 KiB).
        Ok(answer) => {
            let (parts, body) = answer.into_parts();
            match axum::body::to_bytes(body, MOST_BYTES).await {
                Ok(bytes) => Ok(Some(Response::from_parts(parts, bytes.into()))),
                Err(error) => {
                    tracing::warn!(%error, leader, "an SQS answer from a quorum queue's leader was cut short");
                    Err(SqsError::internal(format!(
                        "The queue's leader, node {leader}, took the call but its answer did not come back whole."
                    )))
                }
            }
        }
        Err(Failed::NotSent(error)) => {
            tracing::warn!(%error, leader, "a quorum queue's leader could not be reached for an SQS call");
            Ok(None)
        }
        Err(Failed::Sent(error)) => {
            tracing::warn!(%error, leader, "an SQS call sent to a quorum queue's leader got no answer");
            Err(SqsError::internal(format!(
                "The queue's leader, node {leader}, took the call but its answer did not come back."
            )))
        }
    }
}

/// Where a query-protocol request's parameters are: the body of a POST, the query string of
/// a GET.
fn form_of<'a>(method: &Method, uri: &'a Uri, body: &'a Bytes) -> &'a [u8] {
    if method == Method::GET {
        uri.query().unwrap_or_default().as_bytes()
    } else {
        body
    }
}

/// A request's input, read as its protocol carries it (the whole parsing happens again
/// wherever the request is answered).
fn input_of(
    uri: &Uri,
    headers: &HeaderMap,
    body: &Bytes,
    form: &[u8],
    query_protocol: bool,
) -> Option<Map<String, Value>> {
    if query_protocol {
        // A request posted to a queue's URL names its queue so.
        let host = headers.get("host").and_then(|v| v.to_str().ok())?;
        let segments = uri.path().split('/').filter(|s| !s.is_empty()).count();
        let queue_url = (segments >= 2).then(|| format!("http://{host}{}", uri.path()));
        return query::input(form, queue_url).ok().map(|(_, input)| input);
    }
    match serde_json::from_slice(body).ok()? {
        Value::Object(input) => Some(input),
        _ => None,
    }
}
