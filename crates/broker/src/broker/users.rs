//! Vhosts, users and permissions as the management API and definitions change them; every
//! change is written to the store, so that it outlives a restart.

use warren_codec::AmqpError;

use super::metadata_ops::MetaOp;
use super::Broker;
use crate::access::{
    Access, AccessError, AccessKeyDef, PermissionDef, TopicPermissionDef, UserDef,
};
use crate::limits::{LimitScope, LimitTable, Limits};
use crate::persist::StoreOp;
use crate::vhost_meta::{VhostMeta, VhostMetaChange, VhostMetaError};

impl Broker {
    pub fn access(&self) -> &Access {
        &self.access
    }

    pub fn limits(&self) -> &LimitTable {
        &self.limits
    }

    /// Sets one limit of a vhost or user (negative: unlimited, but kept as set, as RabbitMQ
    /// shows it). The name must be one the scope knows (`LimitScope::accepts`).
    pub fn set_limit(
        &mut self,
        scope: LimitScope,
        name: &str,
        limit: &str,
        value: i64,
    ) -> Result<(), AccessError> {
        self.limit_owner_exists(scope, name)?;
        let mut limits = self.limits.of(scope, name).cloned().unwrap_or_default();
        limits.set(limit, value);
        self.put_limits(scope, name, limits);
        Ok(())
    }

    /// Clears one limit; clearing one that is not set is no error (RabbitMQ answers 204).
    pub fn clear_limit(
        &mut self,
        scope: LimitScope,
        name: &str,
        limit: &str,
    ) -> Result<(), AccessError> {
        self.limit_owner_exists(scope, name)?;
        let mut limits = self.limits.of(scope, name).cloned().unwrap_or_default();
        if limits.remove(limit) {
            self.put_limits(scope, name, limits);
        }
        Ok(())
    }

    /// Replaces every limit of a vhost or user (definitions import).
    pub fn put_limits(&mut self, scope: LimitScope, name: &str, limits: Limits) {
        self.write_def(StoreOp::PutLimits {
            scope,
            name: name.to_owned(),
            limits: limits.clone(),
        });
        self.announce(MetaOp::PutLimits {
            scope,
            name: name.to_owned(),
            limits: limits.clone(),
        });
        self.limits.put(scope, name, limits);
    }

    fn limit_owner_exists(&self, scope: LimitScope, name: &str) -> Result<(), AccessError> {
        match scope {
            LimitScope::Vhost if !self.vhost_exists(name) => {
                Err(AccessError::NoVhost(name.to_owned()))
            }
            LimitScope::User if self.access.user(name).is_none() => {
                Err(AccessError::NoUser(name.to_owned()))
            }
            _ => Ok(()),
        }
    }

    /// A vhost or user is gone: its limits go too, on disk as well.
    fn forget_limits(&mut self, scope: LimitScope, name: &str) {
        if self.limits.forget(scope, name) {
            self.write_def(StoreOp::PutLimits {
                scope,
                name: name.to_owned(),
                limits: Limits::default(),
            });
        }
    }

    pub(super) fn write_def(&mut self, op: StoreOp) {
        if self.restoring {
            return;
        }
        if let Some(p) = self.persist.as_mut() {
            p.push(op, true);
        }
    }

    /// Creates a vhost (with its system exchanges) and keeps it. False if it exists.
    pub fn declare_vhost(&mut self, name: &str) -> bool {
        if self.vhost_exists(name) {
            return false;
        }
        self.set_vhost(name, VhostMeta::default())
    }

    /// Creates a vhost with `change` as its metadata, or makes `change` to the metadata of
    /// the one that exists, and keeps it. True if it was made. Refused while a node of the
    /// cluster runs a version that would drop the metadata (the vhost's queues would be of
    /// another type through that node).
    pub fn put_vhost(
        &mut self,
        name: &str,
        change: &VhostMetaChange,
    ) -> Result<bool, VhostMetaError> {
        let now = self.vhost_meta(name);
        let meta = now.map_or_else(
            || VhostMeta::default().changed(change),
            |m| m.changed(change),
        );
        let unchanged = now.map_or(meta == VhostMeta::default(), |m| *m == meta);
        if let Some(level) = self
            .cluster_feature_level()
            .filter(|l| *l < super::metadata_group::VHOST_META_LEVEL && !unchanged)
        {
            return Err(VhostMetaError::ClusterTooOld {
                level,
                needs: super::metadata_group::VHOST_META_LEVEL,
            });
        }
        Ok(self.set_vhost(name, meta))
    }

    /// Creates a vhost with `meta`, or gives the one that exists `meta`, and keeps it. True
    /// if it was made.
    pub(super) fn set_vhost(&mut self, name: &str, meta: VhostMeta) -> bool {
        let made = self.add_vhost(name);
        let Some(vh) = self.vhosts.get_mut(name) else {
            return false;
        };
        if !made && meta == vh.meta {
            return false;
        }
        vh.meta = meta.clone();
        self.write_def(StoreOp::PutVhost {
            name: name.to_owned(),
            meta: meta.clone(),
        });
        self.announce(MetaOp::PutVhost {
            name: name.to_owned(),
            meta: Some(meta),
        });
        made
    }

    /// A vhost's metadata; `None` if there is no such vhost.
    pub fn vhost_meta(&self, name: &str) -> Option<&VhostMeta> {
        self.vhosts.get(name).map(|v| &v.meta)
    }

    /// Deletes a vhost with everything in it: queues (their messages too), exchanges,
    /// bindings, permissions. The caller closes its connections first. False if there was
    /// no such vhost.
    pub fn delete_vhost(&mut self, name: &str) -> bool {
        let Some(vh) = self.vhosts.get(name) else {
            return false;
        };
        let queues: Vec<String> = vh.queues.keys().map(|q| q.to_string()).collect();
        let exchanges: Vec<String> = vh.exchanges.keys().map(|x| x.to_string()).collect();
        for q in queues {
            let owner = self
                .queue_id(name, &q)
                .and_then(|id| self.queues.get(&id))
                .and_then(|q| q.owner)
                .unwrap_or(0);
            if let Err(e) = self.delete_queue(name, &q, false, false, owner) {
                tracing::warn!(vhost = name, queue = %q, error = %e, "queue of a deleted vhost not deleted");
            }
        }
        for x in exchanges {
            if let Some(vh) = self.vhosts.get_mut(name) {
                super::remove_exchange(
                    name,
                    vh,
                    &mut self.queues,
                    self.persist.as_mut(),
                    &mut self.scheduler,
                    &x,
                );
            }
        }
        self.vhosts.remove(name);
        let gone: Vec<(String, Option<String>)> = self
            .access
            .permissions()
            .filter(|p| p.vhost == name)
            .map(|p| (p.user.clone(), None))
            .chain(
                self.access
                    .topic_permissions()
                    .filter(|t| t.vhost == name)
                    .map(|t| (t.user.clone(), Some(t.exchange.clone()))),
            )
            .collect();
        self.access.vhost_deleted(name);
        self.forget_limits(LimitScope::Vhost, name);
        self.forget_policies(name);
        self.forget_parameters(name);
        for (user, exchange) in gone {
            self.write_def(match exchange {
                None => StoreOp::DeletePermission {
                    user,
                    vhost: name.to_owned(),
                },
                Some(exchange) => StoreOp::DeleteTopicPermission {
                    user,
                    vhost: name.to_owned(),
                    exchange,
                },
            });
        }
        self.write_def(StoreOp::DeleteVhost {
            name: name.to_owned(),
        });
        self.announce(MetaOp::DeleteVhost(name.to_owned()));
        true
    }

    /// Creates or replaces a user.
    pub fn put_user(&mut self, user: UserDef) {
        self.write_def(StoreOp::PutUser(user.clone()));
        self.announce(MetaOp::PutUser(user.clone()));
        self.access.put_user(user);
    }

    /// Deletes a user and their permissions; the caller closes their connections. False if
    /// there was no such user.
    pub fn delete_user(&mut self, name: &str) -> bool {
        let gone: Vec<StoreOp> = self
            .access
            .permissions()
            .filter(|p| p.user == name)
            .map(|p| StoreOp::DeletePermission {
                user: p.user.clone(),
                vhost: p.vhost.clone(),
            })
            .chain(
                self.access
                    .topic_permissions()
                    .filter(|t| t.user == name)
                    .map(|t| StoreOp::DeleteTopicPermission {
                        user: t.user.clone(),
                        vhost: t.vhost.clone(),
                        exchange: t.exchange.clone(),
                    }),
            )
            .chain(
                self.access
                    .access_keys()
                    .filter(|k| k.user == name)
                    .map(|k| StoreOp::DeleteAccessKey { id: k.id.clone() }),
            )
            .collect();
        if !self.access.delete_user(name) {
            return false;
        }
        self.forget_limits(LimitScope::User, name);
        for op in gone {
            // Told to the cluster one by one before the user's own delete: a change to one of
            // them made here earlier, not yet applied by the log, is then not the latest
            // change to it, and is not applied again to a user of the same name made after.
            let told = match &op {
                StoreOp::DeleteAccessKey { id } => Some(MetaOp::DeleteAccessKey(id.clone())),
                StoreOp::DeletePermission { user, vhost } => Some(MetaOp::DeletePermission {
                    user: user.clone(),
                    vhost: vhost.clone(),
                }),
                StoreOp::DeleteTopicPermission {
                    user,
                    vhost,
                    exchange,
                } => Some(MetaOp::ClearTopicPermission {
                    user: user.clone(),
                    vhost: vhost.clone(),
                    exchange: Some(exchange.clone()),
                }),
                _ => None,
            };
            self.write_def(op);
            if let Some(told) = told {
                self.announce(told);
            }
        }
        self.write_def(StoreOp::DeleteUser {
            name: name.to_owned(),
        });
        self.announce(MetaOp::DeleteUser(name.to_owned()));
        true
    }

    /// Adds an SQS access key to an existing user (the caller makes the id and secret).
    pub fn put_access_key(&mut self, key: AccessKeyDef) -> Result<(), AccessError> {
        self.access.put_access_key(key.clone())?;
        self.write_def(StoreOp::PutAccessKey(key.clone()));
        self.announce(MetaOp::PutAccessKey(key));
        Ok(())
    }

    /// False if there was no such key.
    pub fn delete_access_key(&mut self, id: &str) -> bool {
        if !self.access.delete_access_key(id) {
            return false;
        }
        self.write_def(StoreOp::DeleteAccessKey { id: id.to_owned() });
        self.announce(MetaOp::DeleteAccessKey(id.to_owned()));
        true
    }

    pub fn set_permission(&mut self, def: PermissionDef) -> Result<(), AccessError> {
        if !self.vhost_exists(&def.vhost) {
            return Err(AccessError::NoVhost(def.vhost));
        }
        self.access.set_permission(def.clone())?;
        self.write_def(StoreOp::PutPermission(def.clone()));
        self.announce(MetaOp::PutPermission(def));
        Ok(())
    }

    pub fn clear_permission(&mut self, user: &str, vhost: &str) -> bool {
        let found = self.access.clear_permission(user, vhost);
        if found {
            self.write_def(StoreOp::DeletePermission {
                user: user.to_owned(),
                vhost: vhost.to_owned(),
            });
            self.announce(MetaOp::DeletePermission {
                user: user.to_owned(),
                vhost: vhost.to_owned(),
            });
        }
        found
    }

    pub fn set_topic_permission(&mut self, def: TopicPermissionDef) -> Result<(), AccessError> {
        if !self.vhost_exists(&def.vhost) {
            return Err(AccessError::NoVhost(def.vhost));
        }
        self.access.set_topic_permission(def.clone())?;
        self.write_def(StoreOp::PutTopicPermission(def.clone()));
        self.announce(MetaOp::PutTopicPermission(def));
        Ok(())
    }

    /// Clears a user's topic permissions in a vhost, on one exchange or on all.
    pub fn clear_topic_permission(&mut self, user: &str, vhost: &str, exchange: Option<&str>) {
        let gone: Vec<String> = self
            .access
            .topic_permissions()
            .filter(|t| t.user == user && t.vhost == vhost)
            .filter(|t| exchange.is_none_or(|e| e == t.exchange))
            .map(|t| t.exchange.clone())
            .collect();
        self.access.clear_topic_permission(user, vhost, exchange);
        if !gone.is_empty() {
            self.announce(MetaOp::ClearTopicPermission {
                user: user.to_owned(),
                vhost: vhost.to_owned(),
                exchange: exchange.map(str::to_owned),
            });
        }
        for exchange in gone {
            self.write_def(StoreOp::DeleteTopicPermission {
                user: user.to_owned(),
                vhost: vhost.to_owned(),
                exchange,
            });
        }
    }

    /// Recovery: a stored vhost, user or permission comes back (written nowhere).
    pub fn restore_access(&mut self, op: &StoreOp) -> Result<(), AmqpError> {
        let refused = |e: AccessError| AmqpError::not_found(e.to_string());
        match op {
            StoreOp::PutVhost { name, meta } => {
                self.add_vhost(name);
                if let Some(vh) = self.vhosts.get_mut(name) {
                    vh.meta = meta.clone();
                }
            }
            StoreOp::PutUser(u) => self.access.put_user(u.clone()),
            StoreOp::PutPermission(p) => {
                if !self.vhost_exists(&p.vhost) {
                    return Err(refused(AccessError::NoVhost(p.vhost.clone())));
                }
                self.access.set_permission(p.clone()).map_err(refused)?;
            }
            StoreOp::PutTopicPermission(t) => {
                if !self.vhost_exists(&t.vhost) {
                    return Err(refused(AccessError::NoVhost(t.vhost.clone())));
                }
                self.access
                    .set_topic_permission(t.clone())
                    .map_err(refused)?;
            }
            StoreOp::PutLimits {
                scope,
                name,
                limits,
            } => {
                self.limit_owner_exists(*scope, name).map_err(refused)?;
                self.limits.put(*scope, name, limits.clone());
            }
            StoreOp::PutPolicy(def) => self.restore_policy(def)?,
            StoreOp::PutParameter(def) => self.restore_parameter(def)?,
            StoreOp::PutMetaApplied {
                index,
                seen,
                levels,
                members,
                forgotten,
            } => self.restore_meta_applied(*index, seen, levels, members.as_deref(), forgotten),
            StoreOp::PutMetaPending { number, data } => self.restore_meta_pending(*number, data),
            StoreOp::PutAccessKey(key) => {
                self.access.put_access_key(key.clone()).map_err(refused)?
            }
            _ => {}
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::access::{HashAlgorithm, PasswordHash, Perm, Resource};
    use crate::{Broker, BrokerConfig};

    use super::*;

    fn broker() -> Broker {
        Broker::new(BrokerConfig {
            persistence: true,
            ..BrokerConfig::default()
        })
    }

    #[test]
    fn users_permissions_and_vhosts_are_written_and_go_with_their_vhost() {
        let mut b = broker();
        assert!(b.declare_vhost("v"));
        assert!(!b.declare_vhost("v"));
        b.put_user(UserDef {
            name: "u".into(),
            hash: Some(PasswordHash::new("p", [0; 4], HashAlgorithm::Sha256)),
            tags: vec![],
        });
        let all = |vhost: &str| PermissionDef {
            user: "u".into(),
            vhost: vhost.into(),
            configure: ".*".into(),
            write: ".*".into(),
            read: ".*".into(),
        };
        assert_eq!(
            b.set_permission(all("nowhere")),
            Err(AccessError::NoVhost("nowhere".into()))
        );
        b.set_permission(all("v")).unwrap();
        let q = crate::DeclareQueue {
            name: warren_codec::ShortStr::from_static("q"),
            passive: false,
            durable: true,
            exclusive: false,
            auto_delete: false,
            arguments: Default::default(),
        };
        b.declare_queue("v", q, 1).unwrap();
        let ops = b.take_writes().map(|w| w.ops).unwrap_or_default();
        assert!(ops.contains(&StoreOp::PutVhost {
            name: "v".into(),
            meta: VhostMeta::default()
        }));
        assert!(ops
            .iter()
            .any(|o| matches!(o, StoreOp::PutUser(u) if u.name == "u")));
        assert!(ops.contains(&StoreOp::PutPermission(all("v"))));
        assert!(b
            .access()
            .check("u", "v", Perm::Read, Resource::Queue("q"))
            .is_ok());

        assert!(b.delete_vhost("v"));
        assert!(!b.vhost_exists("v"));
        assert!(!b.access().may_open("u", "v"));
        let ops = b.take_writes().map(|w| w.ops).unwrap_or_default();
        assert!(ops
            .iter()
            .any(|o| matches!(o, StoreOp::DeleteQueue { name, .. } if name.as_str() == "q")));
        assert!(ops.contains(&StoreOp::DeletePermission {
            user: "u".into(),
            vhost: "v".into()
        }));
        assert!(ops.contains(&StoreOp::DeleteVhost { name: "v".into() }));
        assert!(!b.delete_vhost("v"));
    }
}
