//! The SQS API (AWS's JSON 1.0 protocol: `POST` with `X-Amz-Target: AmazonSQS.<Action>`,
//! and the older query protocol: `query.rs`) on Warren's own queues, on `--sqs-port` (9324,
//! ElasticMQ's).
//!
//! - **Credentials.** Signature Version 4 is checked against a user's access key (made with
//!   `warren ctl add_access_key`, kept with its secret in the store), or a user's name with
//!   its password as the secret. The server must know the password itself to check an HMAC,
//!   and Warren stores only password hashes: the users whose password it knows are those of
//!   the configuration (the built-in `guest`, and `[[users]]` of the file), as long as the
//!   stored hash still matches. Loopback-only users (guest) from loopback only, with a key too.
//! - **Queue URLs** are `http://<host>:<port>/<account>/<queue>` where the account segment
//!   is the vhost: `000000000000` for the default vhost `/`, any other vhost percent-encoded.
//!   Actions that name no queue (CreateQueue, ListQueues) act on the vhost of the endpoint's
//!   path (`http://host:9324/<vhost>`), the default vhost for `/`.
//! - **Receives hold deliveries as a `basic.get` without no-ack does**, held by the node
//!   itself (the management API's holder), with the visibility timeout as the delivery's
//!   deadline: a client that vanishes after a receive loses nothing, its messages come back
//!   when their timeout passes.
//! - **Long polls** wait on [`crate::driver::NodeHandle::watch_queue`]: a `Notify` per
//!   watched queue, signalled after any change to the node that leaves a message ready.

mod attributes;
mod error;
mod forward;
mod messages;
mod moves;
mod query;
mod queues;
mod receipt;
mod sigv4;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::{ConnectInfo, DefaultBodyLimit, State};
use axum::http::{HeaderMap, Method, Uri};
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value};
use tokio::net::TcpListener;
use warren_broker::access::{Perm, Resource};

use crate::driver::NodeHandle;
pub use error::SqsError;

/// The account id that stands for the default vhost in queue URLs and ARNs (ElasticMQ's).
pub const DEFAULT_ACCOUNT: &str = "000000000000";

/// Bodies up to this size are read (a batch of 10 messages at the 256 KiB limit, and JSON
/// escaping); larger requests are refused before they are buffered.
const MAX_REQUEST: usize = 4 * 1024 * 1024;

pub struct Sqs {
    pub node: NodeHandle,
    /// This node's name, on the calls it sends on to a queue's leader.
    node_name: String,
    /// Message move tasks (dead-letter queue redrives) running or run on this node.
    moves: moves::MoveTasks,
    /// When each message in flight through SQS was first received (SQS's
    /// `ApproximateFirstReceiveTimestamp`); in memory only, bounded.
    first_receive: Mutex<std::collections::HashMap<(u64, u64), u64>>,
}

/// Most entries of [`Sqs::first_receive`]: past it the map starts again (the timestamps are
/// approximate by SQS's own name).
const FIRST_RECEIVE_MAX: usize = 100_000;

impl Sqs {
    /// `local`: how tasks reach this node's own AMQP listener (none: no message move tasks).
    pub fn new(node: NodeHandle, node_name: String, local: Option<crate::shovel::Local>) -> Self {
        Sqs {
            node,
            node_name,
            moves: moves::MoveTasks::new(local),
            first_receive: Mutex::new(std::collections::HashMap::new()),
        }
    }

    fn first_receive(&self, key: (u64, u64), now: u64) -> u64 {
        let mut m = self.first_receive.lock().unwrap_or_else(|p| p.into_inner());
        if m.len() >= FIRST_RECEIVE_MAX && !m.contains_key(&key) {
            m.clear();
        }
        *m.entry(key).or_insert(now)
    }

    fn forget_receive(&self, key: (u64, u64)) {
        self.first_receive
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&key);
    }
}

/// Serves the SQS API on `listener` until the process ends.
pub async fn serve(listener: TcpListener, sqs: Arc<Sqs>) {
    let app = axum::Router::new()
        .fallback(handle)
        .layer(DefaultBodyLimit::max(MAX_REQUEST))
        .with_state(sqs);
    if let Err(e) = axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await
    {
        tracing::error!(error = %e, "the SQS endpoint stopped");
    }
}

/// Who asks, from where, in which vhost.
pub struct Ctx {
    pub user: String,
    /// The signing region, for ARNs.
    pub region: String,
    /// `http://host:port`, as the client reached the endpoint (for queue URLs).
    pub base: String,
    /// The vhost of the endpoint's path.
    pub vhost: String,
}

impl Ctx {
    pub fn queue_url(&self, vhost: &str, name: &str) -> String {
        format!(
            "{}/{}/{}",
            self.base,
            account_of(vhost),
            sigv4::uri_encode(name, false)
        )
    }

    pub fn arn(&self, vhost: &str, name: &str) -> String {
        format!("arn:aws:sqs:{}:{}:{name}", self.region, account_of(vhost))
    }

    /// Whether the user may use the vhost, and what the AMQP operation behind the action
    /// would need there.
    pub fn permit(
        &self,
        access: &warren_broker::access::Access,
        vhost: &str,
        needs: &[(Perm, Resource<'_>)],
    ) -> Result<(), SqsError> {
        if !access.may_open(&self.user, vhost) {
            return Err(SqsError::access_denied(format!(
                "User {} may not use the vhost {vhost}.",
                self.user
            )));
        }
        for (perm, resource) in needs {
            access
                .check(&self.user, vhost, *perm, *resource)
                .map_err(|e| SqsError::access_denied(e.text))?;
        }
        Ok(())
    }
}

/// The account segment of a vhost.
pub fn account_of(vhost: &str) -> String {
    if vhost == "/" {
        DEFAULT_ACCOUNT.to_owned()
    } else {
        sigv4::uri_encode(vhost, false)
    }
}

/// The vhost of an account segment.
pub fn vhost_of(account: &str) -> String {
    if account == DEFAULT_ACCOUNT || account.is_empty() {
        "/".to_owned()
    } else {
        percent_encoding::percent_decode_str(account)
            .decode_utf8_lossy()
            .into_owned()
    }
}

/// A queue URL's (vhost, queue name): `.../<account>/<queue>`, or a bare queue name (the
/// default vhost).
pub fn parse_queue_url(url: &str) -> Result<(String, String), SqsError> {
    let path = match url.split_once("://") {
        Some((_, rest)) => rest.find('/').map_or("", |i| &rest[i..]),
        None => url,
    };
    let path = path.split(['?', '#']).next().unwrap_or_default();
    let segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    let decode = |s: &str| {
        percent_encoding::percent_decode_str(s)
            .decode_utf8_lossy()
            .into_owned()
    };
    match segments.as_slice() {
        [queue] => Ok(("/".to_owned(), decode(queue))),
        [.., account, queue] => Ok((vhost_of(account), decode(queue))),
        [] => Err(SqsError::no_queue()),
    }
}

async fn handle(
    State(sqs): State<Arc<Sqs>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let header = |k: &str| headers.get(k).and_then(|v| v.to_str().ok());
    let json = header("x-amz-target").is_some();
    let query_protocol = !json && query::is_query(header("content-type"), uri.query());
    let request = (&method, &uri, &headers, &body);
    // A call only the queue's leader answers goes there; one whose answer was lost on the
    // way is answered with the error, in the request's protocol.
    let lost = match forward::to_leader(&sqs, peer, request, query_protocol).await {
        Ok(Some(answer)) => return answer,
        Ok(None) => None,
        Err(e) => Some(e),
    };
    if query_protocol {
        let id = messages::new_id();
        let (action, result) = match lost {
            Some(e) => (String::new(), Err(e)),
            None => serve_query(&sqs, peer, &method, &uri, &headers, &body).await,
        };
        let (status, xml) = match result {
            Ok(v) => (axum::http::StatusCode::OK, query::output(&action, &v, &id)),
            Err(e) => (e.status, query::error(&e, &id)),
        };
        let mut r = (status, xml).into_response();
        r.headers_mut().insert(
            "content-type",
            axum::http::HeaderValue::from_static("text/xml"),
        );
        return r;
    }
    let result = match lost {
        Some(e) => Err(e),
        None => serve_one(&sqs, peer, &method, &uri, &headers, &body).await,
    };
    match result {
        Ok(v) => {
            let mut r = Value::Object(v).to_string().into_response();
            r.headers_mut().insert(
                "content-type",
                axum::http::HeaderValue::from_static("application/x-amz-json-1.0"),
            );
            r
        }
        Err(e) => e.into_response(),
    }
}

/// A query-protocol request: its action (for the answer's element names) and answer.
async fn serve_query(
    sqs: &Sqs,
    peer: SocketAddr,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    body: &Bytes,
) -> (String, Result<Map<String, Value>, SqsError>) {
    // The parameters are in the body of a POST, in the query string of a GET.
    let form: &[u8] = if method == Method::GET {
        uri.query().unwrap_or_default().as_bytes()
    } else {
        body
    };
    // A request sent to a queue's URL names its queue so.
    let host = headers
        .get("host")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("localhost");
    let segments = uri.path().split('/').filter(|s| !s.is_empty()).count();
    let queue_url = (segments >= 2).then(|| format!("http://{host}{}", uri.path()));
    // The signature first: an unsigned request is not parsed beyond its bytes.
    let ctx = match authenticate(sqs, peer, method, uri, headers, body) {
        Ok(ctx) => ctx,
        Err(e) => return (String::new(), Err(e)),
    };
    let (action, input) = match query::input(form, queue_url) {
        Ok(x) => x,
        Err(e) => return (String::new(), Err(e)),
    };
    let answer = async {
        if let Some(left) = sqs.node.recovering_after(crate::http::RECOVERY_HOLD).await {
            return Err(SqsError::unavailable(crate::http::recovering_reason(left)));
        }
        tracing::debug!(action = %action, user = %ctx.user, "SQS request (query protocol)");
        dispatch(sqs, &ctx, &action, &input).await
    }
    .await;
    (action, answer)
}

async fn serve_one(
    sqs: &Sqs,
    peer: SocketAddr,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<Map<String, Value>, SqsError> {
    let header = |k: &str| headers.get(k).and_then(|v| v.to_str().ok());
    let Some(action) = header("x-amz-target").and_then(|t| t.strip_prefix("AmazonSQS.")) else {
        return Err(SqsError::new(
            400,
            "InvalidAction",
            "InvalidAction",
            "The request has no X-Amz-Target: AmazonSQS.<Action> header, nor a query-protocol Action.",
        ));
    };
    let action = action.to_owned();
    let ctx = authenticate(sqs, peer, method, uri, headers, body)?;
    if let Some(left) = sqs.node.recovering_after(crate::http::RECOVERY_HOLD).await {
        return Err(SqsError::unavailable(crate::http::recovering_reason(left)));
    }
    let input: Map<String, Value> = if body.is_empty() {
        Map::new()
    } else {
        match serde_json::from_slice(body) {
            Ok(Value::Object(m)) => m,
            _ => {
                return Err(SqsError::new(
                    400,
                    "SerializationException",
                    "MalformedInput",
                    "The request body must be a JSON object.",
                ))
            }
        }
    };
    tracing::debug!(action = %action, user = %ctx.user, "SQS request");
    dispatch(sqs, &ctx, &action, &input).await
}

/// Runs one action on its input (as the JSON protocol has it, whichever protocol it came in).
async fn dispatch(
    sqs: &Sqs,
    ctx: &Ctx,
    action: &str,
    input: &Map<String, Value>,
) -> Result<Map<String, Value>, SqsError> {
    match action {
        "CreateQueue" => queues::create(sqs, ctx, input).await,
        "GetQueueUrl" => queues::get_url(sqs, ctx, input),
        "ListQueues" => queues::list(sqs, ctx, input),
        "DeleteQueue" => queues::delete(sqs, ctx, input).await,
        "PurgeQueue" => queues::purge(sqs, ctx, input).await,
        "GetQueueAttributes" => queues::get_attributes(sqs, ctx, input),
        "SetQueueAttributes" => queues::set_attributes(sqs, ctx, input).await,
        "TagQueue" => queues::tag(sqs, ctx, input).await,
        "UntagQueue" => queues::untag(sqs, ctx, input).await,
        "ListQueueTags" => queues::list_tags(sqs, ctx, input),
        "SendMessage" => messages::send(sqs, ctx, input).await,
        "SendMessageBatch" => messages::send_batch(sqs, ctx, input).await,
        "ReceiveMessage" => messages::receive(sqs, ctx, input).await,
        "DeleteMessage" => messages::delete(sqs, ctx, input).await,
        "DeleteMessageBatch" => messages::delete_batch(sqs, ctx, input).await,
        "ChangeMessageVisibility" => messages::change_visibility(sqs, ctx, input).await,
        "ChangeMessageVisibilityBatch" => messages::change_visibility_batch(sqs, ctx, input).await,
        "ListDeadLetterSourceQueues" => queues::dead_letter_sources(sqs, ctx, input),
        "StartMessageMoveTask" => moves::start(sqs, ctx, input),
        "CancelMessageMoveTask" => moves::cancel(sqs, ctx, input),
        "ListMessageMoveTasks" => moves::list(sqs, ctx, input),
        other => Err(SqsError::new(
            400,
            "InvalidAction",
            "InvalidAction",
            format!("The action {other} is not valid for this endpoint."),
        )),
    }
}

/// The queue an action names, once it is known to exist and the user may do `perm` to it
/// (a missing queue is `QueueDoesNotExist` whatever the user's rights).
fn permitted_queue(
    n: &warren_session::Node,
    ctx: &Ctx,
    vhost: &str,
    name: &str,
    perm: Perm,
) -> Result<warren_broker::QueueId, SqsError> {
    let id = n
        .broker()
        .queue_id(vhost, name)
        .ok_or_else(SqsError::no_queue)?;
    ctx.permit(n.broker().access(), vhost, &[(perm, Resource::Queue(name))])?;
    Ok(id)
}

/// Checks the request's SigV4 signature; the user it names is the request's.
fn authenticate(
    sqs: &Sqs,
    peer: SocketAddr,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<Ctx, SqsError> {
    let Some(value) = headers.get("authorization").and_then(|v| v.to_str().ok()) else {
        return Err(SqsError::new(
            403,
            "MissingAuthenticationToken",
            "MissingAuthenticationToken",
            "Request is missing Authentication Token",
        ));
    };
    let incomplete = |e: sigv4::AuthError| {
        SqsError::new(
            400,
            "IncompleteSignature",
            "IncompleteSignature",
            e.to_string(),
        )
    };
    let auth = sigv4::parse_authorization(value).map_err(incomplete)?;
    let all: Vec<(String, String)> = headers
        .iter()
        .filter_map(|(k, v)| Some((k.as_str().to_owned(), v.to_str().ok()?.to_owned())))
        .collect();
    let req = sigv4::Request {
        method: method.as_str(),
        path: uri.path(),
        query: uri.query().unwrap_or_default(),
        headers: &all,
        body,
    };
    let now = sqs.node.read(|_, now| now);
    let amz_date = sigv4::check_date(&req, &auth, now).map_err(|e| match e {
        sigv4::AuthError::Expired => SqsError::new(
            400,
            "RequestExpired",
            "RequestExpired",
            "Request has expired: its date is more than 15 minutes from the server's time.",
        ),
        other => incomplete(other),
    })?;
    // An access key of a user (`warren ctl add_access_key`), or a user's name with the
    // password the node knows for it, if it still opens the user's account from this peer
    // (the stored hash, loopback-only users).
    let found = sqs.node.read(|n, _| {
        if let Some(k) = n.broker().access().access_key(&auth.access_key) {
            return n
                .may_act_as(&k.user, Some(peer.ip()))
                .then(|| (k.secret.clone(), k.user.clone()));
        }
        n.config()
            .users
            .iter()
            .find(|u| u.name == auth.access_key)
            .map(|u| (u.password.clone(), u.name.clone()))
            .filter(|(pw, name)| n.check_login(name, pw, Some(peer.ip())).is_some())
    });
    let Some((secret, user)) = found else {
        tracing::info!(key = %auth.access_key, peer = %peer, "SQS request with an unknown access key");
        return Err(SqsError::new(
            403,
            "InvalidClientTokenId",
            "InvalidClientTokenId",
            "The security token included in the request is invalid.",
        ));
    };
    let canonical = sigv4::canonical_request(&req, &auth.signed_headers);
    let to_sign = sigv4::string_to_sign(&amz_date, &auth, &canonical);
    if !auth.signed_headers.iter().any(|h| h == "host")
        || !sigv4::same(&sigv4::signature(&secret, &auth, &to_sign), &auth.signature)
    {
        tracing::info!(key = %auth.access_key, peer = %peer, "SQS request with a wrong signature");
        return Err(SqsError::new(
            403,
            "SignatureDoesNotMatch",
            "SignatureDoesNotMatch",
            "The request signature we calculated does not match the signature you provided. Check your AWS Secret Access Key and signing method.",
        ));
    }
    let host = headers
        .get("host")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("localhost")
        .to_owned();
    let vhost = uri
        .path()
        .split('/')
        .find(|s| !s.is_empty())
        .map_or_else(|| "/".to_owned(), vhost_of);
    Ok(Ctx {
        user,
        region: auth.region,
        base: format!("http://{host}"),
        vhost,
    })
}

/// A string field of the request, if present.
pub fn text<'a>(input: &'a Map<String, Value>, key: &str) -> Result<Option<&'a str>, SqsError> {
    match input.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(SqsError::invalid_parameter(format!(
            "{key} must be a string."
        ))),
    }
}

pub fn required<'a>(input: &'a Map<String, Value>, key: &str) -> Result<&'a str, SqsError> {
    text(input, key)?.ok_or_else(|| SqsError::missing_parameter(key))
}

/// An integer field (the SDKs send numbers; strings of digits are taken too), within
/// `range`.
pub fn integer(
    input: &Map<String, Value>,
    key: &str,
    range: std::ops::RangeInclusive<i64>,
) -> Result<Option<i64>, SqsError> {
    let v = match input.get(key) {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Number(n)) => n.as_i64(),
        Some(Value::String(s)) => s.trim().parse().ok(),
        Some(_) => None,
    };
    match v {
        Some(n) if range.contains(&n) => Ok(Some(n)),
        _ => Err(SqsError::invalid_parameter(format!(
            "Value for parameter {key} is invalid. Reason: Must be between {} and {}.",
            range.start(),
            range.end()
        ))),
    }
}

/// A list of strings (`AttributeNames`...).
pub fn strings(input: &Map<String, Value>, key: &str) -> Vec<String> {
    input
        .get(key)
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}

/// The queue a request's `QueueUrl` names, as (vhost, name).
pub fn queue_of(input: &Map<String, Value>) -> Result<(String, String), SqsError> {
    parse_queue_url(required(input, "QueueUrl")?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queue_urls_carry_the_vhost() {
        assert_eq!(
            parse_queue_url("http://localhost:9324/000000000000/jobs").ok(),
            Some(("/".into(), "jobs".into()))
        );
        assert_eq!(
            parse_queue_url("http://localhost:9324/staging%2Feu/jobs").ok(),
            Some(("staging/eu".into(), "jobs".into()))
        );
        assert_eq!(
            parse_queue_url("jobs").ok(),
            Some(("/".into(), "jobs".into()))
        );
        assert!(parse_queue_url("http://localhost:9324/").is_err());
        assert_eq!(account_of("/"), DEFAULT_ACCOUNT);
        assert_eq!(vhost_of(&account_of("staging/eu")), "staging/eu");
    }
}
