//! The management HTTP API (RabbitMQ's paths, JSON fields and status codes, on 15672) and the
//! web page it serves.
//!
//! Handlers read the node through [`NodeHandle::read`], which copies what they need (plain
//! snapshots) under the node's lock; JSON is built after the lock is released, so listing
//! 10,000 queues holds the node only for the copy.

mod access;
pub mod certificates;
pub(crate) mod definitions;
mod forward;
mod gate;
pub use gate::HOLD as RECOVERY_HOLD;
mod global;
mod json;
mod limits;
mod list;
mod objects;
mod parameters;
pub mod passwords;
pub(crate) mod policies;
pub mod rates;
mod replicas;
mod routes;
mod ui;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{FromRequestParts, RawPathParams};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use serde_json::{json, Value};
use warren_broker::access::{Access, Perm, Resource};
use warren_codec::AmqpError;

use crate::driver::{NodeHandle, WriteError};

/// What the API knows besides the node.
pub struct Api {
    pub node: NodeHandle,
    /// `warren@<hostname>` (RabbitMQ's nodes are `rabbit@<hostname>`).
    pub node_name: String,
    /// The AMQP listener's port (`/api/health/checks/port-listener`, `listeners`).
    pub amqp_port: u16,
    pub http_port: u16,
    pub prometheus_port: Option<u16>,
    /// The SQS endpoint's, when it is on (plain HTTP).
    pub sqs_port: Option<u16>,
    /// The amqps listener's port (`amqp/ssl` in `listeners`, as RabbitMQ names it).
    pub amqps_port: Option<u16>,
    /// The management API and the metrics endpoint speak HTTPS (`https` in `listeners`).
    pub http_tls: (bool, bool),
    /// The TLS listeners' certificate file and CA file (certificate-expiration check).
    pub tls_files: Option<(std::path::PathBuf, Option<std::path::PathBuf>)>,
    /// Node time (ms since the epoch) when the broker started.
    pub started_ms: u64,
    pub rates: Arc<rates::Rates>,
    pub data_dir: std::path::PathBuf,
    pub alarms: crate::config::AlarmConfig,
    /// In a cluster, every node's name by number (this one's is `node_name`).
    pub cluster_names: std::collections::BTreeMap<u64, String>,
    /// The shovels this node runs (`/api/shovels`).
    pub shovels: crate::shovel::Shovels,
    /// Stops the node to start it again as a node of a cluster (`POST /api/cluster/join`).
    pub restart: Option<Arc<crate::joining::Restart>>,
}

/// How often a cluster node sends its `/api/nodes` entry to its peers, whose `/api/nodes` then
/// show its figures.
pub const FIGURES_EVERY: std::time::Duration = std::time::Duration::from_secs(2);
/// A peer's figures older than this are not shown (it stopped sending: it is down or slow, or
/// runs without the management API).
pub const FIGURES_STALE: std::time::Duration = std::time::Duration::from_secs(10);

/// In a cluster, sends this node's figures to its peers every [`FIGURES_EVERY`], for as long
/// as the node runs: its `/api/nodes` entry (`node`) and the shovels it runs (`shovels`, as its
/// `/api/shovels` lists them), so that any node's API shows the whole cluster.
pub async fn share_figures(api: Arc<Api>) {
    if api.cluster_names.is_empty() {
        return;
    }
    let mut every = tokio::time::interval(FIGURES_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        every.tick().await;
        let figures = json!({
            "node": routes::node_json_now(&api).await,
            "shovels": api.shovels.list(None),
        });
        match serde_json::to_vec(&figures) {
            Ok(data) => api.node.share_figures(&data),
            Err(error) => tracing::warn!(%error, "this node's figures not shared"),
        }
    }
}

/// What running peer `node` sent last ([`share_figures`]) and how long ago, if it is fresh
/// (younger than [`FIGURES_STALE`]) and reads as its figures.
pub(crate) fn peer_figures(api: &Api, node: u64) -> Option<(std::time::Duration, Value)> {
    let running = api
        .node
        .read(|n, _| n.broker().peers_running())
        .into_iter()
        .any(|(n, up)| n == node && up);
    if !running {
        return None;
    }
    let (age, data) = api.node.peer_figures(node)?;
    if age >= FIGURES_STALE {
        return None;
    }
    let v: Value = serde_json::from_slice(&data).ok()?;
    let name = api.name_of(node);
    (v["node"]["name"] == name.as_str() && v["node"]["cluster"].is_object()).then_some((age, v))
}

impl Api {
    /// The cluster's nodes now (it may have added some to the list this node started with,
    /// and forgotten others), each with its name.
    pub fn names(&self) -> std::collections::BTreeMap<u64, String> {
        let (nodes, added) = self.node.read(|n, _| {
            let b = n.broker();
            (
                b.cluster_view()
                    .map(|(_, nodes, _)| nodes)
                    .unwrap_or_default(),
                b.cluster_addresses(),
            )
        });
        nodes
            .into_iter()
            .map(|n| (n, name_from(n, &self.cluster_names, &added)))
            .collect()
    }

    /// The name a cluster gets until one is set: its first node's (this node's on its own),
    /// the same on every node. It stays the cluster's permanent id when a name is set.
    pub fn default_cluster_name(&self) -> String {
        self.names()
            .into_values()
            .next()
            .unwrap_or_else(|| self.node_name.clone())
    }

    /// The cluster's name (RabbitMQ's global parameter `cluster_name`: `PUT /api/cluster-name`,
    /// `warren ctl set_cluster_name`), else [`Api::default_cluster_name`].
    pub fn cluster_name(&self) -> String {
        let set = self.node.read(|n, _| {
            n.broker()
                .parameters()
                .global(warren_broker::parameters::CLUSTER_NAME)
                .and_then(|v| serde_json::from_str::<Value>(v).ok())
                .and_then(|v| v.as_str().map(str::to_owned))
        });
        set.unwrap_or_else(|| self.default_cluster_name())
    }

    /// Node `node`'s name.
    pub fn name_of(&self, node: u64) -> String {
        let added = self.node.read(|n, _| n.broker().cluster_addresses());
        name_from(node, &self.cluster_names, &added)
    }
}

fn name_from(
    node: u64,
    listed: &std::collections::BTreeMap<u64, String>,
    added: &std::collections::BTreeMap<u64, String>,
) -> String {
    if let Some(addr) = added
        .get(&node)
        .and_then(|a| crate::cluster::PeerAddr::parse(a))
    {
        return cluster_node_name(node, &addr);
    }
    listed
        .get(&node)
        .cloned()
        .unwrap_or_else(|| format!("warren-{node}"))
}

/// A cluster node's name: `warren-N@` its cluster address's host (as `--cluster-nodes` gives
/// it), the same on every node.
pub fn cluster_node_name(node: u64, addr: &crate::cluster::PeerAddr) -> String {
    format!("warren-{node}@{}", addr.host())
}

/// An error as RabbitMQ's management API sends it: a status and `{"error", "reason"}`.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    error: &'static str,
    reason: String,
    /// A reason RabbitMQ sends as a JSON term rather than a string (`["no_such_user","u"]`).
    reason_json: Option<Value>,
    /// Seconds for a `Retry-After` header (a node that is still starting).
    retry_after: Option<u32>,
}

impl ApiError {
    pub fn bad_request(reason: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            error: "bad_request",
            reason: reason.into(),
            reason_json: None,
            retry_after: None,
        }
    }

    /// A 400 for a policy or a runtime parameter that does not validate: RabbitMQ escapes the
    /// angle brackets of its Erlang terms there (`&lt;&lt;"x"&gt;&gt;`), and only there (a
    /// vhost limit's texts keep them).
    pub fn validation(reason: &str) -> Self {
        Self::bad_request(reason.replace('<', "&lt;").replace('>', "&gt;"))
    }

    pub fn pagination(reason: String) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            error: "invalid_pagination_parameters",
            reason,
            reason_json: None,
            retry_after: None,
        }
    }

    pub fn page_out_of_range(reason: String) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            error: "page_out_of_range",
            reason,
            reason_json: None,
            retry_after: None,
        }
    }

    /// Why the request failed, as the answer's `reason` says.
    pub fn reason(&self) -> &str {
        &self.reason
    }

    /// 409: the request clashes with one in progress.
    pub fn conflict(reason: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::CONFLICT,
            error: "conflict",
            reason: reason.into(),
            reason_json: None,
            retry_after: None,
        }
    }

    pub fn not_found() -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            error: "Object Not Found",
            reason: "Not Found".into(),
            reason_json: None,
            retry_after: None,
        }
    }

    /// The server could not do it (RabbitMQ: 500 `internal_server_error`).
    pub fn internal(reason: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            error: "internal_server_error",
            reason: reason.into(),
            reason_json: None,
            retry_after: None,
        }
    }

    /// A login that failed (RabbitMQ spells this one `not_authorized`).
    fn login_failed() -> Self {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            error: "not_authorized",
            reason: "Login failed".into(),
            reason_json: None,
            retry_after: None,
        }
    }

    /// No credentials at all: RabbitMQ answers with the challenge and an empty body.
    fn no_credentials() -> Self {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            error: "",
            reason: String::new(),
            reason_json: None,
            retry_after: None,
        }
    }

    /// The user may not do this (RabbitMQ: 401 `not_authorised`, without a challenge).
    pub fn not_allowed(reason: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            error: "not_authorised",
            reason: reason.into(),
            reason_json: None,
            retry_after: None,
        }
    }

    /// A 400 whose reason is a JSON term (RabbitMQ's `["no_such_user","u"]`).
    pub fn bad_request_term(reason: Value) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            error: "bad_request",
            reason: String::new(),
            reason_json: Some(reason),
            retry_after: None,
        }
    }

    /// A vhost named in the path is missing where RabbitMQ says so (`vhost_not_found`).
    pub fn vhost_not_found() -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            error: "not_found",
            reason: "vhost_not_found".into(),
            reason_json: None,
            retry_after: None,
        }
    }

    /// A broker object named in a request body is missing (RabbitMQ's `not_found` with the
    /// AMQP text, as opposed to a path's `Object Not Found`).
    pub fn amqp_not_found(text: &str) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            error: "not_found",
            reason: format!("NOT_FOUND - {text}"),
            reason_json: None,
            retry_after: None,
        }
    }
}

impl ApiError {
    /// A call sent on to a quorum queue's leader ([`forward`]) got no answer from it: the
    /// leader may have carried it out (taken the messages of a get), so no retry is advised.
    pub fn leader_silent(node: u64) -> Self {
        ApiError {
            status: StatusCode::BAD_GATEWAY,
            error: "bad_gateway",
            reason: format!(
                "the queue's leader, node {node}, took the call but its answer did not come \
                 back (this node's log says why): it may have been carried out, so look at \
                 the queue before repeating it"
            ),
            reason_json: None,
            retry_after: None,
        }
    }

    /// The node is still bringing its queues back from disk (see [`NodeHandle::recovering`]).
    /// RabbitMQ opens its management listener only once the node has booted; Warren answers,
    /// so that a health check or a dashboard can tell "starting" from "down".
    pub fn recovering(left: usize) -> Self {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            error: "service_unavailable",
            reason: recovering_reason(left),
            reason_json: None,
            retry_after: Some(1),
        }
    }
}

/// What a request during start-up is told.
pub fn recovering_reason(left: usize) -> String {
    format!(
        "the node is starting: it is still recovering its queues from disk ({left} left); \
         the management API answers once that is over, retry shortly"
    )
}

/// A change the store has not put on disk is not reported as done.
impl From<WriteError> for ApiError {
    fn from(e: WriteError) -> Self {
        match e {
            // The gate in front of the routes answers first; a change that reaches the node
            // before the end of recovery is refused there too.
            WriteError::Recovering => ApiError::recovering(0),
            WriteError::Stopping => ApiError {
                status: StatusCode::SERVICE_UNAVAILABLE,
                error: "service_unavailable",
                reason: "the node is stopping: nothing was changed".into(),
                reason_json: None,
                retry_after: Some(1),
            },
            WriteError::Failed => ApiError {
                status: StatusCode::INTERNAL_SERVER_ERROR,
                error: "internal_server_error",
                reason: "the change is made in memory, but the store could not write it to \
                         disk (see the broker's log): it is not durable and may be lost on a \
                         restart"
                    .into(),
                reason_json: None,
                retry_after: None,
            },
            WriteError::TimedOut(wait) => ApiError {
                status: StatusCode::SERVICE_UNAVAILABLE,
                error: "service_unavailable",
                reason: format!(
                    "the change is made in memory, but the disk has not confirmed it after \
                     {} ms (it is slow or failing): it is not yet durable and may be lost on \
                     a restart",
                    wait.as_millis()
                ),
                reason_json: None,
                retry_after: None,
            },
        }
    }
}

/// An AMQP error from the broker, as RabbitMQ's API reports it: a missing object 404, a
/// refused operation (a reserved `amq.` name...) 401 "Access refused.", anything else 400 with
/// the AMQP reply text.
impl From<AmqpError> for ApiError {
    fn from(e: AmqpError) -> Self {
        match e.code.code() {
            404 => ApiError::amqp_not_found(&e.text),
            403 => ApiError::not_allowed("Access refused."),
            _ => ApiError::bad_request(e.text.to_string()),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let challenge = self.status == StatusCode::UNAUTHORIZED && self.error != "not_authorised";
        let mut r = if self.error.is_empty() {
            self.status.into_response()
        } else {
            (
                self.status,
                axum::Json(json!({
                    "error": self.error,
                    "reason": self.reason_json.unwrap_or(Value::String(self.reason)),
                })),
            )
                .into_response()
        };
        if let Some(secs) = self.retry_after {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        if challenge {
            r.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Basic realm=\"RabbitMQ Management\""),
            );
        }
        r
    }
}

/// What a request may do, from its user's tags (RabbitMQ's management permissions).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// `management`, `policymaker`: its own connections, declare and delete objects.
    Management,
    /// `monitoring`: also everyone's connections, channels, node figures.
    Monitoring,
    /// `administrator`: everything, users, vhosts, definitions.
    Administrator,
}

/// The logged-in user of a request.
pub struct Login {
    pub name: String,
    pub tags: Vec<String>,
    pub level: Level,
}

impl Login {
    pub fn require(&self, level: Level) -> Result<(), ApiError> {
        if self.level >= level {
            return Ok(());
        }
        Err(ApiError::not_allowed(match level {
            Level::Administrator => "Not administrator user",
            Level::Monitoring => "Not monitor user",
            Level::Management => "Not management user",
        }))
    }

    /// Sees every connection and channel, not only its own.
    pub fn sees_all(&self) -> bool {
        self.level >= Level::Monitoring
    }

    /// May read (or, with `close`, close) a connection of `owner`, or its channels: its own
    /// always; anyone's, reading as a monitoring user and closing as an administrator
    /// (RabbitMQ's `is_authorized_user`).
    pub fn may_reach(&self, owner: &str, close: bool) -> bool {
        self.name == owner
            || if close {
                self.level == Level::Administrator
            } else {
                self.sees_all()
            }
    }

    /// RabbitMQ's `is_authorized_vhost`: administrators see every vhost, everyone else only
    /// those where they have a permission (monitoring users included, for queues, exchanges
    /// and bindings; their wider view of connections is [`Login::sees_all`]).
    pub fn sees_vhost(&self, access: &Access, vhost: &str) -> bool {
        self.level == Level::Administrator || access.may_open(&self.name, vhost)
    }

    /// Checks what the AMQP operation behind an API call would need, with the answer
    /// RabbitMQ's API gives for that call (`via`). Administrators are checked too: in
    /// RabbitMQ their tag opens the API, not the vhosts' resources.
    pub fn permit(
        &self,
        api: &Api,
        vhost: &str,
        needs: &[Need<'_>],
        via: Via,
    ) -> Result<(), ApiError> {
        api.node
            .read(|n, _| self.permit_in(n.broker().access(), vhost, needs, via))
    }

    pub fn permit_in(
        &self,
        access: &Access,
        vhost: &str,
        needs: &[Need<'_>],
        via: Via,
    ) -> Result<(), ApiError> {
        // RabbitMQ's API acts through a connection of the user to the vhost, which is
        // refused before any resource is looked at.
        if !access.may_open(&self.name, vhost) {
            return Err(ApiError::not_allowed("Access refused."));
        }
        for need in needs {
            match *need {
                Need::On(perm, resource) => access.check(&self.name, vhost, perm, resource),
                Need::Topic(perm, exchange, key) => {
                    access.check_topic(&self.name, vhost, exchange, perm, key)
                }
            }
            .map_err(|e| via.refusal(&e))?;
        }
        Ok(())
    }
}

/// A permission an API operation needs, as its AMQP counterpart would.
#[derive(Clone, Copy, Debug)]
pub enum Need<'a> {
    On(Perm, Resource<'a>),
    /// A routing key on an exchange, under the user's topic permissions.
    Topic(Perm, &'a str, &'a str),
}

/// How RabbitMQ's API answers a refused permission, which depends on how its handler reaches
/// the broker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Via {
    /// `direct_request` (declare, delete, purge, bind, unbind): 401 "Access refused.",
    /// without saying which resource.
    Direct,
    /// A channel of the user (get, the aliveness test; Warren's move, which is a get and a
    /// publish): 401 with the channel's error text.
    Channel,
    /// The publish endpoint: 400 with the channel error's code and text.
    Publish,
}

impl Via {
    fn refusal(self, e: &AmqpError) -> ApiError {
        match self {
            Via::Direct => ApiError::not_allowed("Access refused."),
            Via::Channel => ApiError::not_allowed(format!("{} - {}", e.code.name(), e.text)),
            Via::Publish => {
                ApiError::bad_request(format!("{} {} - {}", e.code.code(), e.code.name(), e.text))
            }
        }
    }
}

fn level_of(tags: &[String]) -> Option<Level> {
    let has = |t: &str| tags.iter().any(|x| x == t);
    if has("administrator") {
        Some(Level::Administrator)
    } else if has("monitoring") {
        Some(Level::Monitoring)
    } else if has("management") || has("policymaker") {
        Some(Level::Management)
    } else {
        None
    }
}

impl Api {
    /// Checks HTTP basic auth against the broker's users (loopback-only users from loopback
    /// only, as over AMQP); users without a management tag are refused, as by RabbitMQ.
    pub fn login(&self, headers: &HeaderMap, peer: SocketAddr) -> Result<Login, ApiError> {
        let (name, password) = basic_auth(headers).ok_or_else(ApiError::no_credentials)?;
        let user = self
            .node
            .read(|node, _| {
                node.check_login(&name, &password, Some(peer.ip()))
                    .map(|u| u.tags.clone())
            })
            .ok_or_else(|| {
                tracing::info!(user = %name, peer = %peer, "HTTP login refused");
                ApiError::login_failed()
            })?;
        let level = level_of(&user).ok_or_else(|| ApiError::not_allowed("Not management user"))?;
        Ok(Login {
            name,
            tags: user,
            level,
        })
    }
}

/// A request from a logged-in user of the management tags (for handlers: logs in from the
/// Authorization header and the peer address, as [`Api::login`]). A path naming an existing
/// vhost the user may not see is refused here, so that no handler can forget it (RabbitMQ's
/// 401 "User not authorised to access virtual host"; a missing vhost is left to the handler's
/// 404, as RabbitMQ's).
pub struct LoggedIn(pub Login);

/// A logged-in user whose path's vhost is not checked: the few RabbitMQ endpoints that filter
/// what they show instead (`/api/consumers/{vhost}`).
pub struct Unscoped(pub Login);

/// A request from an administrator.
pub struct Admin(pub Login);

fn login_from(parts: &Parts, api: &Api) -> Result<Login, ApiError> {
    let peer = parts
        .extensions
        .get::<axum::extract::ConnectInfo<SocketAddr>>()
        .map(|c| c.0)
        .ok_or_else(ApiError::no_credentials)?;
    api.login(&parts.headers, peer)
}

impl FromRequestParts<Arc<Api>> for LoggedIn {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, api: &Arc<Api>) -> Result<Self, ApiError> {
        let who = login_from(parts, api)?;
        let params = RawPathParams::from_request_parts(parts, api).await.ok();
        let vhost = params
            .as_ref()
            .and_then(|p| p.iter().find(|(k, _)| *k == "vhost").map(|(_, v)| v));
        if let Some(vhost) = vhost {
            let hidden = api.node.read(|n, _| {
                let b = n.broker();
                b.vhost_exists(vhost) && !who.sees_vhost(b.access(), vhost)
            });
            if hidden {
                return Err(ApiError::not_allowed(
                    "User not authorised to access virtual host",
                ));
            }
        }
        Ok(LoggedIn(who))
    }
}

impl FromRequestParts<Arc<Api>> for Unscoped {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, api: &Arc<Api>) -> Result<Self, ApiError> {
        login_from(parts, api).map(Unscoped)
    }
}

impl FromRequestParts<Arc<Api>> for Admin {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, api: &Arc<Api>) -> Result<Self, ApiError> {
        let who = login_from(parts, api)?;
        who.require(Level::Administrator)?;
        Ok(Admin(who))
    }
}

fn basic_auth(headers: &HeaderMap) -> Option<(String, String)> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let encoded = value
        .strip_prefix("Basic ")
        .or_else(|| value.strip_prefix("basic "))?;
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(encoded.trim())
        .ok()?;
    let text = String::from_utf8(decoded).ok()?;
    let (user, password) = text.split_once(':')?;
    Some((user.to_owned(), password.to_owned()))
}

/// The host's name, for the node's name.
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

/// Serves the management API and web page on `listener` until the process ends.
/// Serves on a plain or a TLS listener (see `crate::tls::HttpsListener`).
pub async fn serve<L>(listener: L, api: Arc<Api>)
where
    L: axum::serve::Listener<Addr = SocketAddr>,
{
    let app = routes::router(api.clone()).layer(axum::middleware::from_fn_with_state(
        api,
        gate::while_recovering,
    ));
    // tap_io: axum gives the peer address (ConnectInfo) for any listener through it.
    if let Err(e) = axum::serve(
        axum::serve::ListenerExt::tap_io(listener, |_| {}),
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await
    {
        tracing::error!(error = %e, "the management API stopped");
    }
}
