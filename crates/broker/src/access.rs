//! Users, their password hashes and tags, and what each may do in each vhost: RabbitMQ's
//! internal authorisation backend (`rabbit_auth_backend_internal`).
//!
//! A permission is three regular expressions per user and vhost (configure, write, read),
//! matched against a resource's name anywhere in it (unanchored, as RabbitMQ's `re:run`); the
//! empty expression matches nothing. Topic permissions add write and read expressions per
//! topic exchange, matched against routing keys. The checks answer with RabbitMQ's texts.
//!
//! Passwords are kept as RabbitMQ keeps them: a 4-byte salt and the SHA-256 (or SHA-512) of
//! salt and password, so users exported from RabbitMQ's definitions log in with the same
//! passwords. Salts come from the caller: the core draws no random numbers.

use std::collections::BTreeMap;

use sha2::{Digest, Sha256, Sha512};
use warren_codec::AmqpError;

use crate::erl::rs;

/// RabbitMQ's password hashing modules.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum HashAlgorithm {
    #[default]
    Sha256,
    Sha512,
}

impl HashAlgorithm {
    /// The name definitions files use (`hashing_algorithm`).
    pub fn rabbitmq_name(self) -> &'static str {
        match self {
            HashAlgorithm::Sha256 => "rabbit_password_hashing_sha256",
            HashAlgorithm::Sha512 => "rabbit_password_hashing_sha512",
        }
    }

    pub fn from_rabbitmq_name(name: &str) -> Option<HashAlgorithm> {
        match name {
            "rabbit_password_hashing_sha256" => Some(HashAlgorithm::Sha256),
            "rabbit_password_hashing_sha512" => Some(HashAlgorithm::Sha512),
            _ => None,
        }
    }

    fn digest(self, salt: &[u8], password: &[u8]) -> Vec<u8> {
        match self {
            HashAlgorithm::Sha256 => Sha256::new()
                .chain_update(salt)
                .chain_update(password)
                .finalize()
                .to_vec(),
            HashAlgorithm::Sha512 => Sha512::new()
                .chain_update(salt)
                .chain_update(password)
                .finalize()
                .to_vec(),
        }
    }

    fn digest_len(self) -> usize {
        match self {
            HashAlgorithm::Sha256 => 32,
            HashAlgorithm::Sha512 => 64,
        }
    }
}

/// A salted password hash: RabbitMQ's `password_hash` is the base64 of `salt ++ digest`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PasswordHash {
    pub algorithm: HashAlgorithm,
    /// `salt ++ digest`, as RabbitMQ stores it.
    pub bytes: Vec<u8>,
}

impl PasswordHash {
    pub fn new(password: &str, salt: [u8; 4], algorithm: HashAlgorithm) -> PasswordHash {
        let mut bytes = salt.to_vec();
        bytes.extend(algorithm.digest(&salt, password.as_bytes()));
        PasswordHash { algorithm, bytes }
    }

    /// A hash as RabbitMQ stores it (salt then digest); None if it has not that shape.
    pub fn from_bytes(bytes: Vec<u8>, algorithm: HashAlgorithm) -> Option<PasswordHash> {
        (bytes.len() == 4 + algorithm.digest_len()).then_some(PasswordHash { algorithm, bytes })
    }

    pub fn matches(&self, password: &str) -> bool {
        let (salt, digest) = self.bytes.split_at(4.min(self.bytes.len()));
        constant_time_eq(&self.algorithm.digest(salt, password.as_bytes()), digest)
    }
}

/// Keeps the comparison time independent of where the digests differ.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// A user as definitions describe it. Without a hash, no password logs in (RabbitMQ's
/// passwordless users, for certificate logins).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UserDef {
    pub name: String,
    pub hash: Option<PasswordHash>,
    /// `administrator`, `monitoring`, `management`, `policymaker`, or any other word.
    pub tags: Vec<String>,
}

/// An access key of a user for the SQS API (SigV4): its id, and the secret both sides sign
/// with. The secret is kept as given, since checking a signature needs it (unlike a password,
/// which is kept as a hash).
#[derive(Clone, PartialEq, Eq)]
pub struct AccessKeyDef {
    pub id: String,
    pub secret: String,
    pub user: String,
    /// When it was made, ms since the epoch.
    pub created_ms: u64,
}

impl std::fmt::Debug for AccessKeyDef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the secret: these reach logs.
        f.debug_struct("AccessKeyDef")
            .field("id", &self.id)
            .field("user", &self.user)
            .field("created_ms", &self.created_ms)
            .finish_non_exhaustive()
    }
}

/// What a user may do in a vhost: three regular expressions over resource names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PermissionDef {
    pub user: String,
    pub vhost: String,
    pub configure: String,
    pub write: String,
    pub read: String,
}

/// Which routing keys a user may publish with (`write`) or bind with (`read`) on a topic
/// exchange.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TopicPermissionDef {
    pub user: String,
    pub vhost: String,
    pub exchange: String,
    pub write: String,
    pub read: String,
}

/// The three kinds of access RabbitMQ tells apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Perm {
    /// Declare, delete, change a resource.
    Configure,
    /// Put messages in: publish to an exchange, bind a queue (or exchange) as destination.
    Write,
    /// Take messages out: consume, get, purge a queue, bind from an exchange.
    Read,
}

/// A resource a permission applies to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resource<'a> {
    Queue(&'a str),
    /// The default exchange is named `amq.default` here, as in RabbitMQ.
    Exchange(&'a str),
}

impl Resource<'_> {
    fn kind_and_name(&self) -> (&'static str, &str) {
        match *self {
            Resource::Queue(n) => ("queue", n),
            Resource::Exchange("") => ("exchange", "amq.default"),
            Resource::Exchange(n) => ("exchange", n),
        }
    }
}

/// A regular expression as RabbitMQ applies it: unanchored, the empty one matching nothing.
#[derive(Clone, Debug)]
struct Pattern(Option<fancy_regex::Regex>);

impl Pattern {
    fn compile(src: &str) -> Result<Pattern, AccessError> {
        if src.is_empty() {
            return Ok(Pattern(None));
        }
        crate::pattern::compile(src)
            .map(|r| Pattern(Some(r)))
            .map_err(|e| AccessError::BadPattern(src.to_owned(), e.to_string()))
    }

    fn matches(&self, name: &str) -> bool {
        match &self.0 {
            // Past the backtracking limit: no match, as a pattern that never matches.
            Some(r) => r.is_match(name).unwrap_or(false),
            // RabbitMQ reads "" as "^$".
            None => name.is_empty(),
        }
    }
}

#[derive(Clone, Debug)]
struct Compiled {
    def: PermissionDef,
    configure: Pattern,
    write: Pattern,
    read: Pattern,
}

/// Topic expressions may name `{username}` and `{vhost}`, filled in as RabbitMQ does at each
/// check: a topic permission is one user's in one vhost, so they are filled in once, with its
/// own, when it is set.
#[derive(Clone, Debug)]
struct CompiledTopic {
    def: TopicPermissionDef,
    write: Pattern,
    read: Pattern,
}

fn expand(src: &str, user: &str, vhost: &str) -> String {
    src.replace("{username}", &fancy_regex::escape(user))
        .replace("{vhost}", &fancy_regex::escape(vhost))
}

fn compile_topic(src: &str, user: &str, vhost: &str) -> Result<Pattern, AccessError> {
    Pattern::compile(&expand(src, user, vhost))
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AccessError {
    #[error("no_such_user")]
    NoUser(String),
    #[error("no_such_vhost")]
    NoVhost(String),
    #[error("invalid regular expression '{0}': {1}")]
    BadPattern(String, String),
}

/// Every user and permission of the node.
#[derive(Clone, Debug, Default)]
pub struct Access {
    users: BTreeMap<String, UserDef>,
    permissions: BTreeMap<(String, String), Compiled>,
    topics: BTreeMap<(String, String, String), CompiledTopic>,
    /// SQS access keys by id.
    keys: BTreeMap<String, AccessKeyDef>,
    /// Moves on every change, so that what a channel remembers of an earlier check can be
    /// known to be stale.
    generation: u64,
}

impl Access {
    pub fn generation(&self) -> u64 {
        self.generation
    }

    pub fn is_empty(&self) -> bool {
        self.users.is_empty()
    }

    pub fn user(&self, name: &str) -> Option<&UserDef> {
        self.users.get(name)
    }

    pub fn users(&self) -> impl Iterator<Item = &UserDef> {
        self.users.values()
    }

    /// The user, if the password is theirs.
    pub fn login(&self, name: &str, password: &str) -> Option<&UserDef> {
        self.users
            .get(name)
            .filter(|u| u.hash.as_ref().is_some_and(|h| h.matches(password)))
    }

    pub fn put_user(&mut self, user: UserDef) {
        self.generation += 1;
        self.users.insert(user.name.clone(), user);
    }

    /// Removes the user and every permission and access key they had. False if there was no
    /// such user.
    pub fn delete_user(&mut self, name: &str) -> bool {
        self.generation += 1;
        self.permissions.retain(|(u, _), _| u != name);
        self.topics.retain(|(u, _, _), _| u != name);
        self.keys.retain(|_, k| k.user != name);
        self.users.remove(name).is_some()
    }

    pub fn access_key(&self, id: &str) -> Option<&AccessKeyDef> {
        self.keys.get(id)
    }

    /// Every access key, by id.
    pub fn access_keys(&self) -> impl Iterator<Item = &AccessKeyDef> {
        self.keys.values()
    }

    /// Adds (or replaces) an access key of an existing user.
    pub fn put_access_key(&mut self, key: AccessKeyDef) -> Result<(), AccessError> {
        if !self.users.contains_key(&key.user) {
            return Err(AccessError::NoUser(key.user));
        }
        self.generation += 1;
        self.keys.insert(key.id.clone(), key);
        Ok(())
    }

    /// False if there was no such key.
    pub fn delete_access_key(&mut self, id: &str) -> bool {
        self.generation += 1;
        self.keys.remove(id).is_some()
    }

    pub fn permission(&self, user: &str, vhost: &str) -> Option<&PermissionDef> {
        self.permissions
            .get(&(user.to_owned(), vhost.to_owned()))
            .map(|c| &c.def)
    }

    pub fn permissions(&self) -> impl Iterator<Item = &PermissionDef> {
        self.permissions.values().map(|c| &c.def)
    }

    pub fn topic_permissions(&self) -> impl Iterator<Item = &TopicPermissionDef> {
        self.topics.values().map(|c| &c.def)
    }

    /// Sets a user's permissions in a vhost (the caller checks the vhost exists).
    pub fn set_permission(&mut self, def: PermissionDef) -> Result<(), AccessError> {
        if !self.users.contains_key(&def.user) {
            return Err(AccessError::NoUser(def.user));
        }
        let compiled = Compiled {
            configure: Pattern::compile(&def.configure)?,
            write: Pattern::compile(&def.write)?,
            read: Pattern::compile(&def.read)?,
            def,
        };
        self.generation += 1;
        self.permissions.insert(
            (compiled.def.user.clone(), compiled.def.vhost.clone()),
            compiled,
        );
        Ok(())
    }

    pub fn clear_permission(&mut self, user: &str, vhost: &str) -> bool {
        self.generation += 1;
        self.permissions
            .remove(&(user.to_owned(), vhost.to_owned()))
            .is_some()
    }

    pub fn set_topic_permission(&mut self, def: TopicPermissionDef) -> Result<(), AccessError> {
        if !self.users.contains_key(&def.user) {
            return Err(AccessError::NoUser(def.user));
        }
        let compiled = CompiledTopic {
            write: compile_topic(&def.write, &def.user, &def.vhost)?,
            read: compile_topic(&def.read, &def.user, &def.vhost)?,
            def,
        };
        self.generation += 1;
        let d = &compiled.def;
        self.topics.insert(
            (d.user.clone(), d.vhost.clone(), d.exchange.clone()),
            compiled,
        );
        Ok(())
    }

    /// Clears a user's topic permissions in a vhost: on one exchange, or on all.
    pub fn clear_topic_permission(&mut self, user: &str, vhost: &str, exchange: Option<&str>) {
        self.generation += 1;
        self.topics
            .retain(|(u, v, x), _| !(u == user && v == vhost && exchange.is_none_or(|e| e == x)));
    }

    /// A vhost is gone: so are the permissions in it.
    pub fn vhost_deleted(&mut self, vhost: &str) {
        self.generation += 1;
        self.permissions.retain(|(_, v), _| v != vhost);
        self.topics.retain(|(_, v, _), _| v != vhost);
    }

    /// May the user open a connection to the vhost (any permission there at all)?
    pub fn may_open(&self, user: &str, vhost: &str) -> bool {
        self.permissions
            .contains_key(&(user.to_owned(), vhost.to_owned()))
    }

    /// RabbitMQ's `check_resource_access`: 403 with its text when refused.
    pub fn check(
        &self,
        user: &str,
        vhost: &str,
        perm: Perm,
        resource: Resource<'_>,
    ) -> Result<(), AmqpError> {
        let (kind, name) = resource.kind_and_name();
        let allowed = self
            .permissions
            .get(&(user.to_owned(), vhost.to_owned()))
            .is_some_and(|c| {
                match perm {
                    Perm::Configure => &c.configure,
                    Perm::Write => &c.write,
                    Perm::Read => &c.read,
                }
                .matches(name)
            });
        if allowed {
            Ok(())
        } else {
            Err(AmqpError::access_refused(format!(
                "access to {} refused for user '{user}'",
                rs(kind, name, vhost)
            )))
        }
    }

    /// RabbitMQ's topic authorisation: a routing key on a topic exchange. Without topic
    /// permissions for that exchange, every key is allowed.
    pub fn check_topic(
        &self,
        user: &str,
        vhost: &str,
        exchange: &str,
        perm: Perm,
        routing_key: &str,
    ) -> Result<(), AmqpError> {
        // Most nodes have none: no allocation on the publish path then.
        if self.topics.is_empty() {
            return Ok(());
        }
        let key = (user.to_owned(), vhost.to_owned(), exchange.to_owned());
        let Some(t) = self.topics.get(&key) else {
            return Ok(());
        };
        let pattern = match perm {
            Perm::Write => &t.write,
            _ => &t.read,
        };
        if pattern.matches(routing_key) {
            Ok(())
        } else {
            Err(AmqpError::access_refused(format!(
                "access to topic '{routing_key}' in exchange '{exchange}' in vhost '{vhost}' refused for user '{user}'"
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn access() -> Access {
        let mut a = Access::default();
        a.put_user(UserDef {
            name: "u".into(),
            hash: Some(PasswordHash::new("pw", [1, 2, 3, 4], HashAlgorithm::Sha256)),
            tags: vec![],
        });
        a.set_permission(PermissionDef {
            user: "u".into(),
            vhost: "/".into(),
            configure: "^c-".into(),
            write: "^w-|^amq\\.default$".into(),
            read: "".into(),
        })
        .unwrap();
        a
    }

    #[test]
    fn hashes_as_rabbitmq() {
        let h = PasswordHash::new("test12", [0x90, 0x8d, 0xc6, 0x0a], HashAlgorithm::Sha256);
        assert!(h.matches("test12"));
        assert!(!h.matches("test13"));
        assert_eq!(h.bytes.len(), 36);
        let h = PasswordHash::new("x", [0; 4], HashAlgorithm::Sha512);
        assert_eq!(h.bytes.len(), 68);
        assert!(PasswordHash::from_bytes(h.bytes.clone(), HashAlgorithm::Sha512).is_some());
        assert!(PasswordHash::from_bytes(h.bytes, HashAlgorithm::Sha256).is_none());
    }

    #[test]
    fn logins_and_vhost_access() {
        let a = access();
        assert!(a.login("u", "pw").is_some());
        assert!(a.login("u", "nope").is_none());
        assert!(a.login("x", "pw").is_none());
        assert!(a.may_open("u", "/"));
        assert!(!a.may_open("u", "other"));
    }

    #[test]
    fn checks_with_rabbitmqs_texts() {
        let a = access();
        assert!(a
            .check("u", "/", Perm::Configure, Resource::Queue("c-q"))
            .is_ok());
        let e = a
            .check("u", "/", Perm::Configure, Resource::Queue("x-q"))
            .unwrap_err();
        assert_eq!(
            e.reply_text(),
            "ACCESS_REFUSED - access to queue 'x-q' in vhost '/' refused for user 'u'"
        );
        // The default exchange is amq.default.
        assert!(a
            .check("u", "/", Perm::Write, Resource::Exchange(""))
            .is_ok());
        // The empty expression matches nothing.
        assert!(a.check("u", "/", Perm::Read, Resource::Queue("")).is_ok());
        assert!(a
            .check("u", "/", Perm::Read, Resource::Queue("r-q"))
            .is_err());
        // Unanchored: anywhere in the name.
        assert!(a
            .check("u", "/", Perm::Write, Resource::Exchange("ww-x"))
            .is_err());
        assert!(a
            .check("u", "other", Perm::Write, Resource::Exchange("w-x"))
            .is_err());
    }

    #[test]
    fn patterns_are_perl_style_as_rabbitmqs() {
        let mut a = access();
        a.set_permission(PermissionDef {
            user: "u".into(),
            vhost: "/".into(),
            configure: r"^(?!amq\.).*".into(),
            write: r"^(\w+)-\1$".into(),
            read: ".*".into(),
        })
        .expect("a look-ahead and a back-reference compile");
        let may = |p, r| a.check("u", "/", p, r).is_ok();
        assert!(may(Perm::Configure, Resource::Queue("jobs")));
        assert!(!may(Perm::Configure, Resource::Exchange("amq.topic")));
        assert!(may(Perm::Write, Resource::Exchange("ab-ab")));
        assert!(!may(Perm::Write, Resource::Exchange("ab-cd")));
    }

    #[test]
    fn topic_permissions() {
        let mut a = access();
        assert!(a
            .check_topic("u", "/", "amq.topic", Perm::Write, "any")
            .is_ok());
        a.set_topic_permission(TopicPermissionDef {
            user: "u".into(),
            vhost: "/".into(),
            exchange: "amq.topic".into(),
            write: "^{username}\\.".into(),
            read: ".*".into(),
        })
        .unwrap();
        assert!(a
            .check_topic("u", "/", "amq.topic", Perm::Write, "u.x")
            .is_ok());
        let e = a
            .check_topic("u", "/", "amq.topic", Perm::Write, "v.x")
            .unwrap_err();
        assert_eq!(
            e.reply_text(),
            "ACCESS_REFUSED - access to topic 'v.x' in exchange 'amq.topic' in vhost '/' refused for user 'u'"
        );
    }

    #[test]
    fn deleting_a_user_takes_their_permissions() {
        let mut a = access();
        let g = a.generation();
        assert!(a.delete_user("u"));
        assert!(a.generation() > g);
        assert!(!a.may_open("u", "/"));
        assert!(
            a.set_permission(PermissionDef {
                user: "u".into(),
                vhost: "/".into(),
                configure: String::new(),
                write: String::new(),
                read: String::new(),
            }) == Err(AccessError::NoUser("u".into()))
        );
    }
}
