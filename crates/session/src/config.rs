//! Settings of the protocol layer: negotiation limits, users, what the broker advertises.

/// A user allowed to log in. Passwords are compared as given; RabbitMQ-style hashes come with definitions import.
#[derive(Clone, Debug)]
pub struct User {
    pub name: String,
    pub password: String,
    /// Like RabbitMQ's `loopback_users`: this user may only connect from 127.0.0.0/8 or ::1.
    pub loopback_only: bool,
    /// RabbitMQ's user tags: `administrator`, `monitoring`, `management`, `policymaker`
    /// (what the management API lets the user see and do).
    pub tags: Vec<String>,
}

#[derive(Clone, Debug)]
pub struct SessionConfig {
    /// Highest channel number a client may open (RabbitMQ's default: 2047).
    pub channel_max: u16,
    /// Largest frame, header and end octet included (RabbitMQ's default: 131072).
    pub frame_max: u32,
    /// Heartbeat interval the server proposes, in seconds (RabbitMQ's default: 60).
    pub heartbeat_secs: u16,
    /// Largest message body accepted from a publisher, in bytes.
    pub max_message_size: u64,
    /// A client that has not finished the handshake by then is disconnected.
    pub handshake_timeout_ms: u64,
    /// How long to wait for connection.close-ok after the server sent connection.close.
    pub close_timeout_ms: u64,
    /// Bytes handed to a connection's writer but not yet written; above it no more deliveries go to that
    /// connection, so a slow reader cannot make the broker buffer without bound.
    pub write_backlog_limit: usize,
    /// Most connections the node keeps open (RabbitMQ's `connection_max`); `None`: no limit.
    /// RabbitMQ stops accepting sockets past it, so a client waits in the listen backlog;
    /// Warren refuses the connection.open with 530, so the client learns why at once.
    pub connection_max: Option<usize>,
    /// Most consumers on one channel (RabbitMQ's `consumer_max_per_channel`); `None`: no limit.
    pub consumer_max_per_channel: Option<usize>,
    /// Users made at start: on a fresh node, these (by default guest/guest); on every start,
    /// those the configuration file names (`explicit_users`), whose password and tags it
    /// keeps as configured. Users made through the management API live in the store.
    pub users: Vec<User>,
    /// `users` came from the configuration file (not the built-in guest).
    pub explicit_users: bool,
    /// A consumer past its `x-consumer-timeout` gets its channel closed with 406 (RabbitMQ
    /// before 4.3) rather than a basic.cancel (4.3).
    pub consumer_timeout_closes_channel: bool,
    pub product: String,
    pub version: String,
    pub cluster_name: String,
    /// The secret the node's connections to itself log in with (a shovel's end on this
    /// node): random per start, never stored. `None`: no such login.
    pub internal_secret: Option<String>,
}

impl SessionConfig {
    /// RabbitMQ's `loopback_users`: a user the configuration marks so, or `guest` unless the
    /// configuration says otherwise of it, may only connect from this machine.
    pub fn loopback_only(&self, user: &str) -> bool {
        match self.users.iter().find(|u| u.name == user) {
            Some(u) => u.loopback_only,
            None => user == "guest",
        }
    }
}

impl Default for SessionConfig {
    fn default() -> Self {
        SessionConfig {
            channel_max: 2047,
            frame_max: 131_072,
            heartbeat_secs: 60,
            max_message_size: 128 * 1024 * 1024,
            handshake_timeout_ms: 10_000,
            close_timeout_ms: 3_000,
            write_backlog_limit: 4 * 1024 * 1024,
            connection_max: None,
            consumer_max_per_channel: None,
            users: vec![User {
                name: "guest".into(),
                password: "guest".into(),
                loopback_only: true,
                tags: vec!["administrator".into()],
            }],
            explicit_users: false,
            // Clients branch on these: kombu (Celery) sends basic.qos with global=true, the
            // RabbitMQ way of limiting a channel's existing consumers, only to a product named
            // RabbitMQ from 3.3 on, and global=false (which RabbitMQ, and Warren, apply to new
            // consumers only) to anything else, which stalls a Celery worker behind its ETA
            // tasks. Warren behaves as RabbitMQ 3.10.8 does, so it says so; `platform` says
            // what it is.
            consumer_timeout_closes_channel: false,
            product: "RabbitMQ".into(),
            version: "3.10.8".into(),
            cluster_name: "warren".into(),
            internal_secret: None,
        }
    }
}
