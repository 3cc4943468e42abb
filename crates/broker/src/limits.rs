//! Per-vhost and per-user limits, with RabbitMQ's names: a vhost's `max-connections` and
//! `max-queues`, a user's `max-connections` and `max-channels`. A negative value means no
//! limit (RabbitMQ keeps and shows it as given); 0 allows none.

use std::collections::BTreeMap;

/// What a set of limits belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LimitScope {
    Vhost,
    User,
}

pub const MAX_CONNECTIONS: &str = "max-connections";
pub const MAX_QUEUES: &str = "max-queues";
pub const MAX_CHANNELS: &str = "max-channels";

impl LimitScope {
    /// The limit names RabbitMQ accepts for this scope.
    pub fn names(self) -> &'static [&'static str] {
        match self {
            LimitScope::Vhost => &[MAX_CONNECTIONS, MAX_QUEUES],
            LimitScope::User => &[MAX_CONNECTIONS, MAX_CHANNELS],
        }
    }

    pub fn accepts(self, name: &str) -> bool {
        self.names().contains(&name)
    }
}

/// The limits of one vhost or user: name -> value, as set.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Limits(BTreeMap<String, i64>);

impl Limits {
    /// The limit in force: `None` when unset or negative.
    pub fn get(&self, name: &str) -> Option<u64> {
        self.0.get(name).and_then(|v| u64::try_from(*v).ok())
    }

    pub fn set(&mut self, name: &str, value: i64) {
        self.0.insert(name.to_owned(), value);
    }

    pub fn remove(&mut self, name: &str) -> bool {
        self.0.remove(name).is_some()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Every limit as set (negative values included).
    pub fn iter(&self) -> impl Iterator<Item = (&str, i64)> {
        self.0.iter().map(|(k, v)| (k.as_str(), *v))
    }
}

impl FromIterator<(String, i64)> for Limits {
    fn from_iter<I: IntoIterator<Item = (String, i64)>>(iter: I) -> Self {
        Limits(iter.into_iter().collect())
    }
}

/// Every vhost's and user's limits.
#[derive(Clone, Debug, Default)]
pub struct LimitTable {
    table: BTreeMap<(LimitScope, String), Limits>,
    /// Moves on every change, so a session can tell whether a limit may apply at all
    /// without looking one up on its hot path.
    generation: u64,
}

impl LimitTable {
    pub fn generation(&self) -> u64 {
        self.generation
    }

    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    pub fn of(&self, scope: LimitScope, name: &str) -> Option<&Limits> {
        self.table.get(&(scope, name.to_owned()))
    }

    /// The limit in force for a vhost or user (`None`: unlimited).
    pub fn limit(&self, scope: LimitScope, name: &str, limit: &str) -> Option<u64> {
        self.of(scope, name).and_then(|l| l.get(limit))
    }

    pub fn all(&self, scope: LimitScope) -> impl Iterator<Item = (&str, &Limits)> {
        self.table
            .iter()
            .filter(move |((s, _), _)| *s == scope)
            .map(|((_, n), l)| (n.as_str(), l))
    }

    /// Replaces the limits of a vhost or user; empty limits remove the entry.
    pub fn put(&mut self, scope: LimitScope, name: &str, limits: Limits) {
        self.generation += 1;
        if limits.is_empty() {
            self.table.remove(&(scope, name.to_owned()));
        } else {
            self.table.insert((scope, name.to_owned()), limits);
        }
    }

    /// The vhost or user is gone: so are its limits. True if it had any.
    pub fn forget(&mut self, scope: LimitScope, name: &str) -> bool {
        self.generation += 1;
        self.table.remove(&(scope, name.to_owned())).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn negative_means_unlimited_and_zero_allows_none() {
        let mut t = LimitTable::default();
        let mut l = Limits::default();
        l.set(MAX_QUEUES, -1);
        l.set(MAX_CONNECTIONS, 0);
        t.put(LimitScope::Vhost, "v", l);
        assert_eq!(t.limit(LimitScope::Vhost, "v", MAX_QUEUES), None);
        assert_eq!(t.limit(LimitScope::Vhost, "v", MAX_CONNECTIONS), Some(0));
        assert_eq!(t.limit(LimitScope::User, "v", MAX_CONNECTIONS), None);
        assert_eq!(t.all(LimitScope::Vhost).count(), 1);
        assert_eq!(t.all(LimitScope::User).count(), 0);
        t.put(LimitScope::Vhost, "v", Limits::default());
        assert!(t.is_empty());
    }

    #[test]
    fn scopes_accept_rabbitmq_names_only() {
        assert!(LimitScope::Vhost.accepts("max-queues"));
        assert!(!LimitScope::Vhost.accepts("max-channels"));
        assert!(LimitScope::User.accepts("max-channels"));
        assert!(!LimitScope::User.accepts("max-queues"));
    }
}
