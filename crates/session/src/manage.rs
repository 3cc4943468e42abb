//! What the management API reads and does through the node: plain copies of connections and
//! channels, closing a connection, checking a login, deleting a queue (its consumers are told).

use std::net::{IpAddr, SocketAddr};

use warren_broker::access::{HashAlgorithm, PasswordHash, PermissionDef, UserDef};
use warren_broker::{Broker, ConnId, Message, QueueDeleted};
use warren_codec::{AmqpError, FieldTable, ShortStr};

use crate::auth::{self, Credentials};
use crate::channel::Fault;
use crate::config::SessionConfig;
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
    /// `None` for a plain TCP connection.
    pub tls: Option<TlsInfo>,
    /// The SASL mechanism the client logged in with (empty before start-ok).
    pub auth_mechanism: String,
    pub channels: Vec<ChannelSnapshot>,
}

/// What the driver learnt from a connection's TLS handshake, in the words RabbitMQ's management
/// API uses (`ssl_protocol` "tlsv1.3", `ssl_cipher` "aes_256_gcm"...).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TlsInfo {
    pub protocol: String,
    pub key_exchange: String,
    pub cipher: String,
    pub hash: String,
    /// The client certificate's subject and issuer (RFC 4514) and validity, if it sent one.
    pub peer_cert_subject: Option<String>,
    pub peer_cert_issuer: Option<String>,
    pub peer_cert_validity: Option<String>,
    /// The user name a verified client certificate gives EXTERNAL: then EXTERNAL is offered.
    pub external: Option<String>,
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
                // Encoded by the connection itself from a table it had decoded.
                client_properties: FieldTable::decode(&mut c.client_properties.clone())
                    .unwrap_or_default(),
                blocked: c.paused,
                tls: c.tls.as_deref().cloned(),
                auth_mechanism: c.auth_mechanism.clone(),
                channels: c.channels.values().map(|ch| ch.snapshot()).collect(),
            })
            .collect()
    }

    /// Closes a connection as an operator asked (`DELETE /api/connections/...`): the client
    /// gets connection.close 320 CONNECTION_FORCED with the reason, as from RabbitMQ. False if
    /// there is no such connection.
    pub fn close_connection(&mut self, conn: ConnId, reason: &str, now: u64) -> bool {
        self.force_close(
            conn,
            format!("broker forced connection closure with reason '{reason}'"),
            now,
        )
    }

    /// Closes a connection with 320 CONNECTION_FORCED and this text (or drops it if it is not
    /// open yet). False if there is no such connection.
    fn force_close(&mut self, conn: ConnId, text: String, now: u64) -> bool {
        let Some(open) = self.conns.get(&conn).map(|c| c.state == State::Open) else {
            return false;
        };
        if open {
            let error = AmqpError::new(warren_codec::ReplyCode::ConnectionForced, text);
            self.fail_connection(conn, Fault::new(error, 0, 0), now);
        } else {
            self.drop_connection(conn);
        }
        true
    }

    /// Maintenance mode on or off ([`warren_broker::Broker::set_draining`]). Going in, every
    /// client connection is closed with 320 CONNECTION_FORCED "Node was put into maintenance
    /// mode", RabbitMQ's text, so that clients reconnect to another node; the number closed.
    pub fn set_draining(&mut self, on: bool, now: u64) -> usize {
        self.broker_mut().set_draining(on);
        if !on {
            return 0;
        }
        self.close_all("Node was put into maintenance mode", now)
    }

    /// Every connection closed with 320 CONNECTION_FORCED and this text (one not open yet is
    /// dropped); how many there were.
    pub(crate) fn close_all(&mut self, text: &str, now: u64) -> usize {
        let ids: Vec<ConnId> = self.conns.keys().copied().collect();
        let mut closed = 0;
        for conn in ids {
            if self.force_close(conn, text.to_owned(), now) {
                closed += 1;
            }
        }
        closed
    }

    fn close_where(&mut self, keep: impl Fn(&str, &str) -> bool, text: &str, now: u64) {
        let doomed: Vec<ConnId> = self
            .conns
            .values()
            .filter(|c| c.state == State::Open && !keep(&c.user, &c.vhost))
            .map(|c| c.id)
            .collect();
        for conn in doomed {
            self.force_close(conn, text.to_owned(), now);
        }
    }

    /// Deletes a vhost and all in it; its connections are closed first, as RabbitMQ does
    /// (320 "vhost 'v' is deleted"). False if there was no such vhost.
    pub fn delete_vhost(&mut self, name: &str, now: u64) -> bool {
        if !self.broker().vhost_exists(name) {
            return false;
        }
        self.close_where(|_, v| v != name, &format!("vhost '{name}' is deleted"), now);
        self.broker_mut().delete_vhost(name)
    }

    /// Deletes a user and their permissions; their connections are closed first, as RabbitMQ
    /// does (320 "user 'u' is deleted"). False if there was no such user.
    pub fn delete_user(&mut self, name: &str, now: u64) -> bool {
        if self.broker().access().user(name).is_none() {
            return false;
        }
        self.close_where(|u, _| u != name, &format!("user '{name}' is deleted"), now);
        self.broker_mut().delete_user(name)
    }

    /// The broker's end of a connection's socket.
    pub fn set_local_addr(&mut self, conn: ConnId, local: SocketAddr) {
        if let Some(c) = self.conns.get_mut(&conn) {
            c.local = Some(local);
        }
    }

    /// A login by another protocol (HTTP basic auth): the user, if the name, password and
    /// peer address are accepted as they would be for AMQP.
    pub fn check_login(
        &self,
        name: &str,
        password: &str,
        peer: Option<IpAddr>,
    ) -> Option<&UserDef> {
        let creds = Credentials {
            user: name.to_owned(),
            password: password.to_owned(),
        };
        let access = self.broker().access();
        auth::authenticate(access, self.config(), &creds, peer).ok()?;
        access.user(name)
    }

    /// May `name` act from `peer` without a password (it signs with an access key): the user
    /// exists, and a loopback-only user comes from this machine.
    pub fn may_act_as(&self, name: &str, peer: Option<IpAddr>) -> bool {
        auth::authenticate_external(self.broker().access(), self.config(), name, peer).is_ok()
    }

    /// Brings the configured users into the broker (see [`SessionConfig::users`]); `fresh`:
    /// the store held no users (a new node). `salt` gives each new password hash its salt.
    pub fn apply_config_users(&mut self, fresh: bool, salt: &mut dyn FnMut() -> [u8; 4]) {
        let config = self.config().clone();
        // Each node's own file: a cluster's users are changed through the management API.
        self.broker_mut()
            .keep_users_local(config.users.iter().map(|u| u.name.clone()));
        self.broker_mut()
            .local_only(|b| apply_config_users(b, &config, fresh, salt));
    }

    /// Another node of the cluster deleted a user or a vhost (this node's broker applied it):
    /// their connections here are closed as that node closed its own.
    pub(crate) fn closed_elsewhere(&mut self, closed: warren_broker::MetaClosed, now: u64) {
        match closed {
            warren_broker::MetaClosed::User(name) => {
                self.close_where(|u, _| u != name, &format!("user '{name}' is deleted"), now)
            }
            warren_broker::MetaClosed::Vhost(name) => {
                self.close_where(|_, v| v != name, &format!("vhost '{name}' is deleted"), now)
            }
        }
    }
}

/// See [`Node::apply_config_users`]: on a fresh node every configured user is made, with all
/// permissions on the default vhost; after that only the users the configuration file names,
/// whose password and tags follow it (a user the file adds gets all permissions on the
/// default vhost; existing permissions are left as they are).
pub fn apply_config_users(
    broker: &mut Broker,
    config: &SessionConfig,
    fresh: bool,
    salt: &mut dyn FnMut() -> [u8; 4],
) {
    if !fresh && !config.explicit_users {
        return;
    }
    let vhost = broker.config().default_vhost.clone();
    for u in &config.users {
        let existing = broker.access().user(&u.name);
        let same = existing.is_some_and(|e| {
            e.tags == u.tags && e.hash.as_ref().is_some_and(|h| h.matches(&u.password))
        });
        if same {
            continue;
        }
        let new = existing.is_none();
        broker.put_user(UserDef {
            name: u.name.clone(),
            hash: Some(PasswordHash::new(
                &u.password,
                salt(),
                HashAlgorithm::Sha256,
            )),
            tags: u.tags.clone(),
        });
        if new {
            let all = PermissionDef {
                user: u.name.clone(),
                vhost: vhost.clone(),
                configure: ".*".into(),
                write: ".*".into(),
                read: ".*".into(),
            };
            if let Err(e) = broker.set_permission(all) {
                tracing::warn!(user = %u.name, error = %e, "configured user without permissions");
            }
        }
    }
}

/// The connection id operations of the management API act as (client connections start at 1).
pub const API_CONN: ConnId = 0;

impl Node {
    /// Moves up to `count` ready messages, oldest first, from queue `from` to queue `to` of
    /// the same vhost (through the default exchange, body and properties unchanged but for the
    /// header `x-moved-from` naming the source queue). Each is
    /// put in `to` and acked in `from` by the same store write, so a crash leaves it in one
    /// queue or the other, never in neither. Stops early when `from` runs dry, or when `to`
    /// refuses a message (full with `reject-publish`), which stays in `from`. Returns how
    /// many moved.
    pub fn move_messages(
        &mut self,
        vhost: &str,
        from: &str,
        to: &str,
        count: u32,
        now: u64,
    ) -> Result<u32, AmqpError> {
        let broker = self.broker_mut();
        let target = ShortStr::try_from_str(to)
            .ok()
            .filter(|_| broker.queue_id(vhost, to).is_some())
            .ok_or_else(|| AmqpError::not_found(format!("no queue '{to}' in vhost '{vhost}'")))?;
        if from == to {
            return Err(AmqpError::precondition_failed(format!(
                "cannot move messages of queue '{from}' to itself"
            )));
        }
        let mut moved = 0;
        let mut held = Vec::new();
        while moved < count {
            // The answer waits for the get's entry too, as for the management API's gets.
            broker.open_hold_every();
            let got = broker.get_awaited(vhost, from, false, API_CONN);
            let hold = broker.close_hold();
            broker.batch_waits_for(hold);
            let Some((d, _)) = got? else {
                break;
            };
            // Marked as moved: the target's deduplication must not drop it as a new publish
            // of a message it has seen, and the ack below lose it.
            let Ok(properties) =
                warren_broker::dedup::moved_properties(&d.message.properties, from)
            else {
                broker.release(d.queue, d.receipt);
                break;
            };
            let message = Message {
                exchange: ShortStr::empty(),
                routing_key: target.clone(),
                properties,
                body: d.message.body.clone(),
                persistent: d.message.persistent,
                store_key: None,
                away: None,
            };
            // A copy in a quorum queue is safe once its entries are applied: the message
            // leaves its source then (`Node::end_held_moves`), and goes back if they are lost.
            broker.open_hold();
            let routed = broker.publish(vhost, "", to, message, now);
            let hold = broker.close_hold();
            // The answer waits for the copy's entries too.
            broker.batch_waits_for(hold);
            match routed {
                Ok(r) if r.queues > 0 && !r.rejected => {
                    if hold == 0 {
                        broker.settle(d.queue, d.receipt);
                    } else {
                        held.push((hold, d.queue, d.receipt));
                    }
                    moved += 1;
                }
                _ => {
                    broker.release(d.queue, d.receipt);
                    break;
                }
            }
        }
        self.held_moves.extend(held);
        Ok(moved)
    }

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
