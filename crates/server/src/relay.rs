//! Sends an HTTP call on to another node of the cluster and passes its answer back as it
//! comes: what the management API and the SQS endpoint do with a call on a quorum queue that
//! only the queue's leader can answer (`http::forward`, `sqs::forward`).
//!
//! A call one node sends another carries [`FORWARDED_BY`], and is never sent on again: a
//! leader that moved meanwhile answers it as a follower does, rather than sending it round
//! the cluster.

use std::io::Read;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, HeaderName, Method, StatusCode};
use axum::response::Response;

/// Set on a call one node sends another.
pub const FORWARDED_BY: &str = "x-warren-forwarded-by";

/// How long the other node may take to accept the connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long its answer may take to start (a get waits for the log, up to the 30 s a
/// proposal's hold may last; an SQS receive up to its 20 s wait before that), and each later
/// read of it.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(60);
/// The size of the pieces an answer is passed on in.
const CHUNK: usize = 64 * 1024;
/// Most calls sent on at once. Each holds a thread of tokio's blocking pool for as long as
/// it lasts (an SQS long poll: 20 s), and that pool also serves the management API's
/// writes: past this many, this node answers the call itself (naming the leader).
const MOST_AT_ONCE: usize = 64;

static SLOTS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(MOST_AT_ONCE);

/// One client for every call: its connections to the other nodes are kept and reused.
fn agent() -> &'static ureq::Agent {
    static AGENT: std::sync::OnceLock<ureq::Agent> = std::sync::OnceLock::new();
    AGENT.get_or_init(|| {
        let config = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_connect(Some(CONNECT_TIMEOUT))
            .timeout_recv_response(Some(ANSWER_TIMEOUT))
            .timeout_per_read(Some(ANSWER_TIMEOUT))
            // The other node is a peer: a proxy from the environment must not see the call,
            // and its answer is passed back as it is, a redirect included.
            .proxy(None)
            .max_redirects(0)
            .build();
        ureq::Agent::new_with_config(config)
    })
}

/// A call to send on.
pub struct Call {
    pub method: Method,
    /// Where to: the other node's base address and the call's path and query.
    pub url: String,
    /// The caller's headers to pass on (the connection's own are dropped).
    pub headers: HeaderMap,
    pub body: Bytes,
    /// This node's name, for [`FORWARDED_BY`].
    pub by: String,
}

/// Why a call sent on has no answer.
#[derive(Debug)]
pub enum Failed {
    /// It never reached the other node (no connection): this node may answer it instead.
    NotSent(String),
    /// It may have: the other node may have carried it out.
    Sent(String),
}

/// Sends `call` and answers with the other node's status, headers and body, the body passed
/// on as it comes (an answer of 10,000 large messages is not held whole here).
pub async fn relay(call: Call) -> Result<Response, Failed> {
    let Ok(slot) = SLOTS.try_acquire() else {
        return Err(Failed::NotSent(format!(
            "{MOST_AT_ONCE} calls are being sent on already"
        )));
    };
    let (head_tx, head_rx) = tokio::sync::oneshot::channel();
    let (body_tx, body_rx) = tokio::sync::mpsc::channel(4);
    tokio::task::spawn_blocking(move || {
        send(call, head_tx, body_tx);
        drop(slot);
    });
    let (status, headers) = match head_rx.await {
        Ok(head) => head?,
        Err(_) => return Err(Failed::Sent("the call stopped".into())),
    };
    let chunks = futures_lite::stream::unfold(body_rx, |mut rx| async move {
        rx.recv().await.map(|chunk| (chunk, rx))
    });
    let mut out = Response::new(Body::from_stream(chunks));
    *out.status_mut() = status;
    *out.headers_mut() = headers;
    Ok(out)
}

/// Headers that belong to one connection, not to the call.
fn per_connection(name: &HeaderName) -> bool {
    name == header::CONNECTION
        || name == header::CONTENT_LENGTH
        || name == header::TRANSFER_ENCODING
        || name == header::TE
        || name == header::TRAILER
        || name == header::UPGRADE
        || name == "keep-alive"
        || name == header::PROXY_AUTHORIZATION
}

type Head = (StatusCode, HeaderMap);

fn send(
    call: Call,
    head: tokio::sync::oneshot::Sender<Result<Head, Failed>>,
    chunks: tokio::sync::mpsc::Sender<std::io::Result<Bytes>>,
) {
    let mut request = ureq::http::Request::builder()
        .method(call.method)
        .uri(&call.url);
    for (name, value) in call.headers.iter().filter(|(n, _)| !per_connection(n)) {
        request = request.header(name, value);
    }
    let request = match request
        .header(FORWARDED_BY, call.by.as_str())
        .body(call.body.to_vec())
    {
        Ok(r) => r,
        Err(e) => {
            let _ = head.send(Err(Failed::NotSent(e.to_string())));
            return;
        }
    };
    let answer = match agent().run(request) {
        Ok(answer) => answer,
        Err(e) => {
            let failed = if not_sent(&e) {
                Failed::NotSent(e.to_string())
            } else {
                Failed::Sent(e.to_string())
            };
            let _ = head.send(Err(failed));
            return;
        }
    };
    let (parts, body) = answer.into_parts();
    let mut headers = HeaderMap::new();
    for (name, value) in parts.headers.iter().filter(|(n, _)| !per_connection(n)) {
        headers.append(name.clone(), value.clone());
    }
    if head.send(Ok((parts.status, headers))).is_err() {
        return;
    }
    let mut reader = body.into_reader();
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

/// Whether a failed call never reached the other node.
fn not_sent(e: &ureq::Error) -> bool {
    use std::io::ErrorKind::{
        AddrNotAvailable, ConnectionRefused, HostUnreachable, NetworkUnreachable,
    };
    match e {
        ureq::Error::ConnectionFailed
        | ureq::Error::HostNotFound
        | ureq::Error::Timeout(ureq::Timeout::Connect | ureq::Timeout::Resolve) => true,
        // Errors only a connection's setup meets (a reset or a broken pipe may come after
        // the other node read the call).
        ureq::Error::Io(io) => matches!(
            io.kind(),
            ConnectionRefused | AddrNotAvailable | HostUnreachable | NetworkUnreachable
        ),
        _ => false,
    }
}

/// Whether a call from `peer` by `user` may be sent on to `base`: a user the configuration
/// limits to loopback (guest) who came over loopback would be refused by a leader on another
/// host, which sees the call come from this node's address.
pub fn may_carry(
    node: &crate::driver::NodeHandle,
    user: &str,
    peer: std::net::IpAddr,
    base: &str,
) -> bool {
    let limited = node.read(|n, _| n.config().loopback_only(user));
    !limited || !peer.is_loopback() || on_loopback(base)
}

/// Whether a base address (`http://host:port`) names this machine's loopback.
fn on_loopback(base: &str) -> bool {
    let rest = base.trim_start_matches("http://");
    let host = rest
        .rsplit_once(':')
        .map_or(rest, |(h, _)| h)
        .trim_start_matches('[')
        .trim_end_matches(']');
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// The leader of the quorum queue `name` of `vhost` when another node leads it, with the
/// base address of its endpoint `part` (`management`, `sqs`) as its figures announce it
/// (shared every two seconds); `None` when this node should answer: the queue acts here or
/// is no quorum queue, it has no leader now, or the leader is down, silent or has no such
/// endpoint over plain HTTP.
pub fn leader_endpoint(
    node: &crate::driver::NodeHandle,
    vhost: &str,
    name: &str,
    part: &str,
) -> Option<(u64, String)> {
    let (own, leader, running) = node.read(|n, _| {
        let b = n.broker();
        let own = b.cluster_view().map(|(node, _, _)| node)?;
        let leader = b.led_elsewhere(vhost, name)??;
        let running = b
            .peers_running()
            .into_iter()
            .any(|(n, up)| n == leader && up);
        Some((own, leader, running))
    })?;
    // Its Raft may have elected this node before the queue acts here.
    if leader == own || !running {
        return None;
    }
    let (age, data) = node.peer_figures(leader)?;
    if age >= crate::http::FIGURES_STALE {
        return None;
    }
    let figures: serde_json::Value = serde_json::from_slice(&data).ok()?;
    let announced = &figures["node"];
    if announced["cluster"]["node"].as_u64() != Some(leader) {
        return None;
    }
    endpoint(announced, part).map(|base| (leader, base))
}

/// The base address (`http://host:port`) of the HTTP endpoint `part` (`management`, `sqs`)
/// a node's figures announce: the host of its name (`warren-2@host`), the port given there;
/// `None` for HTTPS or an endpoint that is off.
pub fn endpoint(node: &serde_json::Value, part: &str) -> Option<String> {
    let host = node["name"].as_str()?.rsplit_once('@')?.1;
    let m = &node["cluster"][part];
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

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;
    use serde_json::json;

    #[tokio::test]
    async fn a_node_that_takes_no_connection_was_not_sent_the_call() {
        // A port nothing listens on any more.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let mut headers = HeaderMap::new();
        headers.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Basic eDp5"),
        );
        let call = Call {
            method: Method::POST,
            url: format!("http://127.0.0.1:{port}/api/queues/%2F/q/get"),
            headers,
            body: Bytes::from_static(b"{}"),
            by: "warren-1@test".into(),
        };
        match relay(call).await {
            Err(Failed::NotSent(_)) => {}
            Err(Failed::Sent(e)) => panic!("sent: {e}"),
            Ok(r) => panic!("answered {}", r.status()),
        }
    }

    #[test]
    fn a_loopback_address_is_told_from_another_hosts() {
        for base in [
            "http://127.0.0.1:15702",
            "http://127.0.0.9:15702",
            "http://[::1]:15702",
            "http://localhost:15702",
        ] {
            assert!(on_loopback(base), "{base}");
        }
        for base in [
            "http://10.0.0.2:15702",
            "http://[fd00::2]:15702",
            "http://node2:15702",
        ] {
            assert!(!on_loopback(base), "{base}");
        }
    }

    #[test]
    fn an_endpoint_is_the_host_of_the_nodes_name_and_the_port_it_announces() {
        let node = |name: &str, scheme: &str| json!({"name": name, "cluster": {"management": {"port": 15702, "scheme": scheme}}});
        let base = |n: &serde_json::Value| endpoint(n, "management");
        assert_eq!(
            base(&node("warren-2@10.0.0.2", "http")).as_deref(),
            Some("http://10.0.0.2:15702")
        );
        assert_eq!(
            base(&node("warren-2@::1", "http")).as_deref(),
            Some("http://[::1]:15702")
        );
        assert_eq!(base(&node("warren-2@h", "https")), None);
        assert_eq!(base(&json!({"name": "warren-2@h"})), None);
        assert_eq!(base(&node("no-host", "http")), None);
        assert_eq!(endpoint(&node("warren-2@h", "http"), "sqs"), None);
    }
}
