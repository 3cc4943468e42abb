//! What the management API reads and does through the node: plain copies of connections and
//! channels, closing a connection, checking a login, deleting a queue (its consumers are told).

use std::net::{IpAddr, SocketAddr};

use warren_broker::{ConnId, QueueDeleted};
use warren_codec::{AmqpError, FieldTable};

use crate::auth::{self, Credentials};
use crate::channel::Fault;
use crate::config::User;
use crate::connection::State;
use crate::node::Node;

#[derive(Clone, Debug)]
pub struct ChannelSnapshot {
    pub number: u16,
    pub confirm: bool,
    pub transactional: bool,
    /// basic.qos prefetch for new consumers (global = false) and for the channel (global).
    pub prefetch_count: u16,
    pub global_prefetch_count: u16,
    pub unacked: u64,
    pub consumers: u32,
    pub closing: bool,
}

#[derive(Clone, Debug)]
pub struct ConnectionSnapshot {
    pub id: ConnId,
    pub peer: Option<SocketAddr>,
    pub local: Option<SocketAddr>,
    /// Empty until the client logged in / opened a vhost.
    pub user: String,
    pub vhost: String,
    /// RabbitMQ's connection states: `starting`, `tuning`, `opening`, `running`, `closing`...
    pub state: &'static str,
    /// Node time (ms since the epoch) when the socket was accepted.
    pub opened_at: u64,
    pub channel_max: u16,
    pub frame_max: u32,
    pub heartbeat_secs: u64,
    pub client_properties: FieldTable,
    /// A resource alarm holds its publishes (`blocked` in RabbitMQ's terms).
    pub blocked: bool,
    pub channels: Vec<ChannelSnapshot>,
}

impl Node {
    /// Every connection, in id (arrival) order.
    pub fn connection_snapshots(&self) -> Vec<ConnectionSnapshot> {
        self.conns
            .values()
            .map(|c| ConnectionSnapshot {
                id: c.id,
                peer: c.peer,
                local: c.local,
                user: c.user.clone(),
                vhost: c.vhost.clone(),
                state: if c.paused { "blocked" } else { c.state.name() },
                opened_at: c.opened_at,
                channel_max: c.channel_max,
                frame_max: c.frame_max,
                heartbeat_secs: c.heartbeat_ms / 1000,
                client_properties: c.client_properties.clone(),
                blocked: c.paused,
                channels: c.channels.values().map(|ch| ch.snapshot()).collect(),
            })
            .collect()
    }

    /// Closes a connection as an operator asked (`DELETE /api/connections/...`): the client
    /// gets connection.close 320 CONNECTION_FORCED with the reason, as from RabbitMQ. False if
    /// there is no such connection.
    pub fn close_connection(&mut self, conn: ConnId, reason: &str, now: u64) -> bool {
        let Some(open) = self.conns.get(&conn).map(|c| c.state == State::Open) else {
            return false;
        };
        if open {
            let error = AmqpError::new(
                warren_codec::ReplyCode::ConnectionForced,
                format!("broker forced connection closure with reason '{reason}'"),
            );
            self.fail_connection(conn, Fault::new(error, 0, 0), now);
        } else {
            self.drop_connection(conn);
        }
        true
    }

    /// The broker's end of a connection's socket.
    pub fn set_local_addr(&mut self, conn: ConnId, local: SocketAddr) {
        if let Some(c) = self.conns.get_mut(&conn) {
            c.local = Some(local);
        }
    }

    /// The configured users.
    pub fn users(&self) -> &[User] {
        &self.config().users
    }

    /// A login by another protocol (HTTP basic auth): the user, if the name, password and
    /// peer address are accepted as they would be for AMQP.
    pub fn check_login(&self, name: &str, password: &str, peer: Option<IpAddr>) -> Option<&User> {
        let creds = Credentials {
            user: name.to_owned(),
            password: password.to_owned(),
        };
        auth::authenticate(self.users(), &creds, peer).ok()?;
        self.users().iter().find(|u| u.name == name)
    }
}

/// The connection id operations of the management API act as (client connections start at 1).
pub const API_CONN: ConnId = 0;

impl Node {
    /// Deletes a queue as queue.delete would; its consumers get basic.cancel if their clients
    /// take it.
    pub fn delete_queue(
        &mut self,
        vhost: &str,
        name: &str,
        (if_unused, if_empty): (bool, bool),
    ) -> Result<QueueDeleted, AmqpError> {
        let deleted = self
            .broker_mut()
            .delete_queue(vhost, name, if_unused, if_empty, API_CONN)?;
        self.consumers_cancelled(deleted.cancelled.iter().cloned());
        Ok(deleted)
    }
}
