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

use std::io::Read;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::Response;

use super::{peer_figures, Api, ApiError};

/// Set on a call one node sends another. Such a call is never sent on again: a leader that
/// moved meanwhile answers it as a follower does, rather than sending it round the cluster.
pub const FORWARDED_BY: &str = "x-warren-forwarded-by";

/// How long the leader's API may take to accept the connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long its answer may take to start (a get waits for the log, up to the 30 s a
/// proposal's hold may last), and each later read of it.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(60);
/// The size of the pieces an answer is passed on in.
const CHUNK: usize = 64 * 1024;
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
/// `None`: this node answers it (also when the leader could not be reached: the answer then
/// names the node to ask).
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
    let (head_tx, head_rx) = tokio::sync::oneshot::channel();
    let (body_tx, body_rx) = tokio::sync::mpsc::channel(4);
    tokio::task::spawn_blocking(move || send(&url, auth, &by, &body, head_tx, body_tx));
    let answer = match head_rx.await {
        Ok(Ok(head)) => head,
        Ok(Err(Failed::NotSent(error))) => {
            // Nothing reached the leader: this node answers, naming it.
            tracing::warn!(%error, leader = node, "a quorum queue's leader could not be reached for a management call");
            return None;
        }
        Ok(Err(Failed::Sent(error))) => {
            tracing::warn!(%error, leader = node, "a management call sent to a quorum queue's leader got no answer");
            return Some(Err(ApiError::leader_silent(node)));
        }
        Err(_) => {
            return Some(Err(ApiError::internal(
                "the call to the queue's leader stopped",
            )))
        }
    };
    let chunks = futures_lite::stream::unfold(body_rx, |mut rx| async move {
        rx.recv().await.map(|chunk| (chunk, rx))
    });
    let mut out = Response::new(Body::from_stream(chunks));
    *out.status_mut() = answer.status;
    out.headers_mut().extend(answer.headers);
    Some(Ok(out))
}

/// The leader's answer, but for its body.
struct Head {
    status: StatusCode,
    headers: Vec<(header::HeaderName, HeaderValue)>,
}

/// Why a forwarded call has no answer.
enum Failed {
    /// It never reached the leader (no connection).
    NotSent(ureq::Error),
    /// It may have: the leader may have carried it out.
    Sent(ureq::Error),
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
    if api.http_tls.0 {
        // The caller's credentials came over TLS: they do not go on in the clear.
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

/// POSTs `body` to `url` as the caller: the leader's status and headers go to `head`, then
/// its body, as it comes, to `chunks` (an answer of 10,000 large messages is not held whole
/// here).
fn send(
    url: &str,
    auth: HeaderValue,
    by: &str,
    body: &[u8],
    head: tokio::sync::oneshot::Sender<Result<Head, Failed>>,
    chunks: tokio::sync::mpsc::Sender<std::io::Result<Bytes>>,
) {
    let config = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_connect(Some(CONNECT_TIMEOUT))
        .timeout_recv_response(Some(ANSWER_TIMEOUT))
        .timeout_per_read(Some(ANSWER_TIMEOUT))
        .proxy(None)
        .build();
    let agent = ureq::Agent::new_with_config(config);
    let sent = agent
        .post(url)
        .header(header::AUTHORIZATION, auth)
        .header(header::CONTENT_TYPE, "application/json")
        .header(FORWARDED_BY, by)
        .send(body);
    let answer = match sent {
        Ok(answer) => answer,
        Err(e) => {
            let failed = if not_sent(&e) {
                Failed::NotSent(e)
            } else {
                Failed::Sent(e)
            };
            let _ = head.send(Err(failed));
            return;
        }
    };
    let status = StatusCode::from_u16(answer.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let headers = KEPT
        .iter()
        .filter_map(|k| Some((k.clone(), answer.headers().get(k)?.clone())))
        .collect();
    if head.send(Ok(Head { status, headers })).is_err() {
        return;
    }
    let mut reader = answer.into_body().into_reader();
    let mut buf = vec![0; CHUNK];
    loop {
        let chunk = match reader.read(&mut buf) {
            Ok(0) => return,
            Ok(n) => Ok(Bytes::copy_from_slice(&buf[..n])),
            Err(e) => Err(e),
        };
        let last = chunk.is_err();
        // The caller went away: nothing more to pass on.
        if chunks.blocking_send(chunk).is_err() || last {
            return;
        }
    }
}

/// Whether a failed call never reached the leader, so that this node may answer it instead.
fn not_sent(e: &ureq::Error) -> bool {
    use std::io::ErrorKind::{
        AddrNotAvailable, ConnectionRefused, HostUnreachable, NetworkUnreachable,
    };
    match e {
        ureq::Error::ConnectionFailed
        | ureq::Error::HostNotFound
        | ureq::Error::Timeout(ureq::Timeout::Connect | ureq::Timeout::Resolve) => true,
        // Errors only a connection's setup meets (a reset or a broken pipe may come after
        // the leader read the call).
        ureq::Error::Io(io) => matches!(
            io.kind(),
            ConnectionRefused | AddrNotAvailable | HostUnreachable | NetworkUnreachable
        ),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_leader_that_takes_no_connection_was_not_sent_the_call() {
        // A port nothing listens on any more.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let (head_tx, mut head_rx) = tokio::sync::oneshot::channel();
        let (body_tx, _body_rx) = tokio::sync::mpsc::channel(1);
        let url = format!("http://127.0.0.1:{port}/api/queues/%2F/q/get");
        let auth = HeaderValue::from_static("Basic Z3Vlc3Q6Z3Vlc3Q=");
        send(&url, auth, "warren-1@test", b"{}", head_tx, body_tx);
        match head_rx.try_recv() {
            Ok(Err(Failed::NotSent(_))) => {}
            Ok(Err(Failed::Sent(e))) => panic!("sent: {e:?}"),
            _ => panic!("answered"),
        }
    }

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
