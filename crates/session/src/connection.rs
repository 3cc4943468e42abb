//! One client connection: handshake, negotiation, heartbeats and the channel table.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use bytes::{Bytes, BytesMut};
use warren_broker::{Broker, ConnId};
use warren_codec::{
    AmqpError, ConnectionClose, ConnectionCloseOk, ConnectionOpenOk, ConnectionStart,
    ConnectionTune, ConnectionUpdateSecretOk, FieldTable, FieldValue, Method, ShortStr,
    FRAME_MIN_SIZE,
};

use crate::auth::{self, AuthError};
use crate::channel::{Channel, Fault};
use crate::config::SessionConfig;
use crate::out::send;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum State {
    AwaitStartOk,
    AwaitTuneOk,
    AwaitOpen,
    Open,
    /// The server sent connection.close: only close-ok (or a crossing close) is read.
    Closing,
    /// Torn down; the socket is being closed.
    Closed,
}

impl State {
    pub(crate) fn name(self) -> &'static str {
        match self {
            State::AwaitStartOk => "starting",
            State::AwaitTuneOk => "tuning",
            State::AwaitOpen => "opening",
            State::Open => "running",
            State::Closing => "closing",
            State::Closed => "closed",
        }
    }
}

/// Extensions the client said it understands, from client-properties.capabilities.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ClientCaps {
    pub consumer_cancel_notify: bool,
    pub connection_blocked: bool,
}

pub(crate) struct Connection {
    pub id: ConnId,
    pub peer: Option<SocketAddr>,
    /// The broker's end of the socket (for the connection's name in the management API).
    pub local: Option<SocketAddr>,
    /// The user name from a verified TLS client certificate: EXTERNAL is offered and accepted.
    pub external: Option<String>,
    /// Boxed: most connections are plain TCP.
    pub tls: Option<Box<crate::manage::TlsInfo>>,
    /// The SASL mechanism of start-ok, for the management API.
    pub auth_mechanism: String,
    pub state: State,
    pub opened_at: u64,
    pub vhost: String,
    pub user: String,
    /// Logged in as the node's own internal user (a shovel's end on this node): every
    /// permission is granted, as to RabbitMQ's direct connections without a user.
    pub trusted: bool,
    pub channel_max: u16,
    pub frame_max: u32,
    pub heartbeat_ms: u64,
    pub last_recv: u64,
    pub last_send: u64,
    pub close_deadline: u64,
    /// Boxed: a B-tree node holds eleven values inline, and a channel is a few hundred bytes,
    /// so unboxed channels would cost an idle one-channel connection kilobytes.
    pub channels: BTreeMap<u16, Box<Channel>>,
    pub caps: ClientCaps,
    /// What the client said about itself in connection.start-ok (shown by the management API),
    /// encoded as on the wire: the decoded table's strings are slices of the read buffer it
    /// came in, and kept for the connection's life they would pin that buffer (4 KiB or more)
    /// where this copy takes the few hundred bytes the client sent.
    pub client_properties: Bytes,
    pub out: BytesMut,
    /// The socket is backed up: no deliveries until the driver says it drained.
    pub write_blocked: bool,
    /// A dispatch filled `out` past the backlog limit: no deliveries until it is handed over.
    pub out_blocked: bool,
    /// The deadline this connection is filed under in the node's timer index.
    pub timer: Option<u64>,
    /// Set when this connection has something for the driver (bytes, a close, a new frame_max).
    pub dirty: bool,
    pub close_socket: bool,
    pub frame_max_changed: bool,
    /// Some channel holds coalesced confirms not yet written.
    pub confirms_pending: bool,
    /// Channels and consumers were already released to the broker.
    pub released: bool,
    /// It has published: a resource alarm stops reading from it.
    pub published: bool,
    /// A resource alarm holds it: the driver reads nothing from its socket until it ends.
    pub paused: bool,
    /// `paused` changed and the driver has not been told.
    pub pause_changed: bool,
    /// A channel waits for a basic.get's answer from another node: nothing more is read
    /// from the socket until it comes (the driver is told as for `paused`).
    pub holding: bool,
}

/// What a connection-level step asks the node to do next.
pub(crate) enum Next {
    Nothing,
    /// A fatal protocol error: send connection.close and release everything.
    Fail(Fault),
    /// Close the socket now (after flushing what is queued) and release everything.
    Drop,
}

impl Connection {
    pub fn new(id: ConnId, peer: Option<SocketAddr>, now: u64, config: &SessionConfig) -> Self {
        Connection {
            id,
            peer,
            local: None,
            external: None,
            tls: None,
            auth_mechanism: String::new(),
            state: State::AwaitStartOk,
            opened_at: now,
            vhost: String::new(),
            user: String::new(),
            trusted: false,
            channel_max: config.channel_max,
            frame_max: config.frame_max,
            heartbeat_ms: 0,
            last_recv: now,
            last_send: now,
            close_deadline: 0,
            channels: BTreeMap::new(),
            out_blocked: false,
            timer: None,
            caps: ClientCaps::default(),
            client_properties: Bytes::new(),
            out: BytesMut::new(),
            write_blocked: false,
            dirty: false,
            close_socket: false,
            frame_max_changed: false,
            confirms_pending: false,
            released: false,
            published: false,
            paused: false,
            pause_changed: false,
            holding: false,
        }
    }

    pub fn is_open(&self) -> bool {
        self.state == State::Open
    }

    /// Takes no deliveries now: its socket or its output buffer is backed up.
    pub fn credit_blocked(&self) -> bool {
        self.write_blocked || self.out_blocked
    }

    /// When this connection next has something to do on its own: the handshake deadline,
    /// a heartbeat to send or a missed one to act on, the close-ok deadline.
    pub fn deadline(&self, config: &SessionConfig) -> Option<u64> {
        match self.state {
            State::AwaitStartOk | State::AwaitTuneOk | State::AwaitOpen => {
                Some(self.opened_at.saturating_add(config.handshake_timeout_ms))
            }
            State::Open if self.heartbeat_ms > 0 => Some(
                self.last_recv
                    .saturating_add(2 * self.heartbeat_ms)
                    .min(self.last_send.saturating_add(self.heartbeat_ms / 2)),
            ),
            State::Closing => Some(self.close_deadline),
            _ => None,
        }
    }

    pub fn send_start(&mut self, config: &SessionConfig) {
        send(
            &mut self.out,
            0,
            ConnectionStart {
                version_major: 0,
                version_minor: 9,
                server_properties: server_properties(config),
                mechanisms: Bytes::from_static(if self.external.is_some() {
                    auth::MECHANISMS_WITH_EXTERNAL.as_bytes()
                } else {
                    auth::MECHANISMS.as_bytes()
                }),
                locales: Bytes::from_static(b"en_US"),
            },
        );
    }

    /// Login accepted: connection.tune, then wait for tune-ok.
    fn send_tune(&mut self, config: &SessionConfig) {
        send(
            &mut self.out,
            0,
            ConnectionTune {
                channel_max: config.channel_max,
                frame_max: config.frame_max,
                heartbeat: config.heartbeat_secs,
            },
        );
        self.state = State::AwaitTuneOk;
    }

    /// Sends connection.close for a fault and enters the closing state.
    pub fn start_close(&mut self, fault: &Fault, now: u64, config: &SessionConfig) {
        if matches!(self.state, State::Closing | State::Closed) {
            return;
        }
        send(
            &mut self.out,
            0,
            ConnectionClose {
                reply_code: fault.error.code.code(),
                reply_text: short_text(&fault.error.reply_text()),
                class_id: fault.class_id,
                method_id: fault.method_id,
            },
        );
        self.state = State::Closing;
        self.close_deadline = now + config.close_timeout_ms;
    }

    /// A method on channel 0.
    /// `over_limit` is the refusal the node would give this connection's open for a
    /// connection limit (node, vhost, user); it applies once the vhost and access checks pass.
    pub fn on_connection_method(
        &mut self,
        method: Method,
        config: &SessionConfig,
        broker: &Broker,
        over_limit: Option<AmqpError>,
    ) -> Next {
        let (class_id, method_id) = (method.class_id(), method.method_id());
        let fail = |e: AmqpError| Next::Fail(Fault::new(e, class_id, method_id));
        match (self.state, method) {
            (State::Closing, Method::ConnectionCloseOk(_)) => Next::Drop,
            (State::Closing, Method::ConnectionClose(_)) => {
                send(&mut self.out, 0, ConnectionCloseOk {});
                Next::Drop
            }
            (State::Closing | State::Closed, _) => Next::Nothing,
            (_, Method::ConnectionClose(_)) => {
                send(&mut self.out, 0, ConnectionCloseOk {});
                Next::Drop
            }
            (State::AwaitStartOk, Method::ConnectionStartOk(ok)) => {
                self.caps = client_caps(&ok.client_properties);
                let mut encoded = BytesMut::new();
                ok.client_properties.encode(&mut encoded);
                self.client_properties = Bytes::copy_from_slice(&encoded);
                self.auth_mechanism = ok.mechanism.as_str().to_owned();
                if ok.mechanism == auth::EXTERNAL {
                    // Offered only with a verified certificate; otherwise as unknown as any other.
                    let Some(name) = self.external.clone() else {
                        return fail(AmqpError::command_invalid(format!(
                            "unknown authentication mechanism '{}'",
                            ok.mechanism
                        )));
                    };
                    if auth::authenticate_external(
                        broker.access(),
                        config,
                        &name,
                        self.peer.map(|p| p.ip()),
                    )
                    .is_err()
                    {
                        tracing::info!(conn = self.id, user = %name, "login refused (EXTERNAL: no such user)");
                        return login_refused(&ok.mechanism);
                    }
                    self.user = name;
                    self.send_tune(config);
                    return Next::Nothing;
                }
                let creds = match auth::parse_response(&ok.mechanism, &ok.response) {
                    Ok(c) => c,
                    Err(AuthError::UnknownMechanism(m)) => {
                        return fail(AmqpError::command_invalid(format!(
                            "unknown authentication mechanism '{m}'"
                        )))
                    }
                    Err(_) => return login_refused(&ok.mechanism),
                };
                let peer = self.peer.map(|p| p.ip());
                if let Some(trusted) = auth::authenticate_internal(broker.access(), config, &creds)
                {
                    tracing::debug!(conn = self.id, user = %creds.user, "internal login");
                    self.trusted = trusted;
                    self.user = creds.user;
                    self.send_tune(config);
                    return Next::Nothing;
                }
                if auth::authenticate(broker.access(), config, &creds, peer).is_err() {
                    tracing::info!(conn = self.id, user = %creds.user, "login refused");
                    return login_refused(&ok.mechanism);
                }
                self.user = creds.user;
                self.send_tune(config);
                Next::Nothing
            }
            (State::AwaitTuneOk, Method::ConnectionTuneOk(t)) => {
                if t.channel_max > config.channel_max {
                    return fail(AmqpError::not_allowed(format!(
                        "channel_max={} > {} max",
                        t.channel_max, config.channel_max
                    )));
                }
                if t.frame_max != 0 && t.frame_max < FRAME_MIN_SIZE {
                    return fail(AmqpError::not_allowed(format!(
                        "frame_max={} < {FRAME_MIN_SIZE} min size",
                        t.frame_max
                    )));
                }
                if t.frame_max > config.frame_max {
                    return fail(AmqpError::not_allowed(format!(
                        "frame_max={} > {} max size",
                        t.frame_max, config.frame_max
                    )));
                }
                self.channel_max = if t.channel_max == 0 {
                    config.channel_max
                } else {
                    t.channel_max
                };
                self.frame_max = if t.frame_max == 0 {
                    config.frame_max
                } else {
                    t.frame_max
                };
                self.frame_max_changed = true;
                self.heartbeat_ms = u64::from(t.heartbeat) * 1000;
                self.state = State::AwaitOpen;
                Next::Nothing
            }
            (State::AwaitOpen, Method::ConnectionOpen(o)) => {
                if !broker.vhost_exists(&o.virtual_host) {
                    return fail(AmqpError::not_allowed(format!(
                        "vhost {} not found",
                        o.virtual_host.as_str()
                    )));
                }
                if !self.trusted && !broker.access().may_open(&self.user, &o.virtual_host) {
                    tracing::info!(conn = self.id, user = %self.user, vhost = %o.virtual_host.as_str(), "vhost access refused");
                    return fail(AmqpError::not_allowed(format!(
                        "access to vhost '{}' refused for user '{}'",
                        o.virtual_host.as_str(),
                        self.user
                    )));
                }
                if let Some(e) = over_limit {
                    tracing::info!(conn = self.id, user = %self.user, vhost = %o.virtual_host.as_str(), reason = %e.text, "connection refused: limit");
                    return fail(e);
                }
                self.vhost = o.virtual_host.to_string();
                send(&mut self.out, 0, ConnectionOpenOk::default());
                self.state = State::Open;
                tracing::info!(
                    conn = self.id,
                    peer = ?self.peer,
                    user = %self.user,
                    vhost = %self.vhost,
                    "connection opened"
                );
                Next::Nothing
            }
            (State::Open, Method::ConnectionUpdateSecret(_)) => {
                // Passwords are not time-limited tokens here: accept, as RabbitMQ does for plain users.
                send(&mut self.out, 0, ConnectionUpdateSecretOk {});
                Next::Nothing
            }
            (State::Open, Method::ConnectionBlocked(_) | Method::ConnectionUnblocked(_)) => {
                Next::Nothing
            }
            (state, _) => fail(AmqpError::channel_error(format!(
                "unexpected method in connection state {}",
                state.name()
            ))),
        }
    }
}

/// RabbitMQ blames no method for a refused login (class and method ids are 0).
fn login_refused(mechanism: &str) -> Next {
    Next::Fail(Fault::new(
        AmqpError::access_refused(format!(
            "Login was refused using authentication mechanism {mechanism}. For details see the broker logfile."
        )),
        0,
        0,
    ))
}

/// A reply text must fit a shortstr.
pub(crate) fn short_text(text: &str) -> ShortStr {
    let mut end = text.len().min(255);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    ShortStr::from_string(text.get(..end).unwrap_or_default().to_string())
}

fn client_caps(props: &FieldTable) -> ClientCaps {
    let Some(FieldValue::Table(caps)) = props.get("capabilities") else {
        return ClientCaps::default();
    };
    let flag = |k: &str| matches!(caps.get(k), Some(FieldValue::Bool(true)));
    ClientCaps {
        consumer_cancel_notify: flag("consumer_cancel_notify"),
        connection_blocked: flag("connection.blocked"),
    }
}

fn server_properties(config: &SessionConfig) -> FieldTable {
    let mut caps = FieldTable::default();
    for cap in [
        "publisher_confirms",
        "exchange_exchange_bindings",
        "basic.nack",
        "consumer_cancel_notify",
        "connection.blocked",
        "consumer_priorities",
        "authentication_failure_close",
        "per_consumer_qos",
        "direct_reply_to",
    ] {
        caps.insert(ShortStr::from(cap), FieldValue::Bool(true));
    }
    let text = |s: &str| FieldValue::LongStr(Bytes::copy_from_slice(s.as_bytes()));
    let mut props = FieldTable::default();
    props.insert(ShortStr::from("capabilities"), FieldValue::Table(caps));
    props.insert(ShortStr::from("cluster_name"), text(&config.cluster_name));
    props.insert(
        ShortStr::from("copyright"),
        text("Copyright (c) the Warren authors"),
    );
    props.insert(
        ShortStr::from("information"),
        text("Warren: an AMQP 0-9-1 broker for task queues. Licensed under the Apache License 2.0"),
    );
    props.insert(
        ShortStr::from("platform"),
        text(concat!("Warren ", env!("CARGO_PKG_VERSION"), " (Rust)")),
    );
    props.insert(ShortStr::from("product"), text(&config.product));
    props.insert(ShortStr::from("version"), text(&config.version));
    props
}
