//! Snapshots of the metadata group, so that its log does not hold every definition change
//! since the cluster began.
//!
//! A snapshot is the cluster's definitions written as the operations that make them (the same
//! operations entries carry) with the change numbers applied per node. A node takes one of
//! its committed state every so many entries, when no change of its own is waiting for the
//! log: only then is what it holds exactly what the log says. Raft then drops the log before
//! it, and sends it to a follower too far behind (or a node whose store is behind its log
//! after a crash reads it back at its start).
//!
//! Installing a snapshot is a difference, not a replacement: what this node holds and the
//! snapshot lacks is deleted, what the snapshot holds differently is applied, each through
//! the same functions the log's entries use, so the store and the session learn of it as of
//! any other change. Two kinds of object are left as they are: those this node changed and
//! the log has not applied yet (its own entry, still to come, is later in the log), and the
//! users of this node's configuration file with their permissions, which are each node's own.

use std::collections::{BTreeMap, BTreeSet};

use super::metadata_ops::{
    decode_snapshot, encode_snapshot, readable, Binding, MetaOp, MetaSnapshot, QueueGroup,
};
use super::*;
use crate::access::{PermissionDef, TopicPermissionDef, UserDef};
use crate::limits::{LimitScope, Limits};
use crate::parameters::ParameterDef;
use crate::persist::BindingDest;
use crate::policy::PolicyDef;

use super::metadata_group::META_GROUP;
use super::replicated::{ReplicaSnapshot, SnapshotData};

/// The order operations are applied in (a vhost before what lives in it, an exchange and a
/// queue before their bindings); deletions go the other way.
fn rank(op: &MetaOp) -> u8 {
    match op {
        MetaOp::PutVhost { .. } | MetaOp::DeleteVhost(_) => 0,
        MetaOp::PutUser(_) | MetaOp::DeleteUser(_) => 1,
        MetaOp::PutLimits { .. } => 2,
        MetaOp::PutPermission(_) | MetaOp::DeletePermission { .. } => 3,
        MetaOp::PutTopicPermission(_) | MetaOp::ClearTopicPermission { .. } => 4,
        MetaOp::PutPolicy(_) | MetaOp::DeletePolicy { .. } => 5,
        MetaOp::PutParameter(_) | MetaOp::DeleteParameter { .. } => 6,
        MetaOp::PutAccessKey(_) | MetaOp::DeleteAccessKey(_) => 7,
        MetaOp::DeclareExchange { .. } | MetaOp::DeleteExchange { .. } => 8,
        MetaOp::DeclareQueue { .. }
        | MetaOp::DeleteQueue { .. }
        | MetaOp::SetQueueArguments { .. }
        | MetaOp::ChangeQueueMember { .. } => 9,
        MetaOp::Bind(_) | MetaOp::Unbind(_) => 10,
        MetaOp::Rebalance => 11,
        MetaOp::FeatureLevel { .. } => 12,
        MetaOp::ForgetNode { .. } | MetaOp::AddNode { .. } => 13,
    }
}

/// The operation that removes what `op` makes.
fn undo(op: &MetaOp) -> Option<MetaOp> {
    Some(match op {
        MetaOp::DeclareQueue {
            vhost, name, group, ..
        } => MetaOp::DeleteQueue {
            vhost: vhost.clone(),
            name: name.clone(),
            group: match group {
                QueueGroup::Fixed(g) => Some(*g),
                _ => None,
            },
        },
        MetaOp::DeclareExchange { vhost, name, .. } => MetaOp::DeleteExchange {
            vhost: vhost.clone(),
            name: name.clone(),
        },
        MetaOp::Bind(b) => MetaOp::Unbind(b.clone()),
        MetaOp::PutVhost { name, .. } => MetaOp::DeleteVhost(name.clone()),
        MetaOp::PutUser(u) => MetaOp::DeleteUser(u.name.clone()),
        MetaOp::PutPermission(p) => MetaOp::DeletePermission {
            user: p.user.clone(),
            vhost: p.vhost.clone(),
        },
        MetaOp::PutTopicPermission(t) => MetaOp::ClearTopicPermission {
            user: t.user.clone(),
            vhost: t.vhost.clone(),
            exchange: Some(t.exchange.clone()),
        },
        MetaOp::PutLimits { scope, name, .. } => MetaOp::PutLimits {
            scope: *scope,
            name: name.clone(),
            limits: Limits::default(),
        },
        MetaOp::PutPolicy(p) => MetaOp::DeletePolicy {
            vhost: p.vhost.clone(),
            kind: p.kind,
            name: p.name.clone(),
        },
        MetaOp::PutAccessKey(k) => MetaOp::DeleteAccessKey(k.id.clone()),
        MetaOp::PutParameter(p) => MetaOp::DeleteParameter {
            component: p.component.clone(),
            vhost: p.vhost.clone(),
            name: p.name.clone(),
        },
        _ => return None,
    })
}

/// Whether `here` (what this node holds) already is what `there` (a snapshot's) makes: the
/// same operation, or a vhost a snapshot of an earlier version names without metadata.
fn holds(here: &MetaOp, there: &MetaOp) -> bool {
    match (here, there) {
        (
            MetaOp::PutVhost { name: a, .. },
            MetaOp::PutVhost {
                name: b,
                meta: None,
            },
        ) => a == b,
        _ => here == there,
    }
}

/// The user a user, permission or access key operation is about.
fn user_of(op: &MetaOp) -> Option<&str> {
    match op {
        MetaOp::PutUser(UserDef { name, .. }) => Some(name),
        MetaOp::PutPermission(PermissionDef { user, .. })
        | MetaOp::PutTopicPermission(TopicPermissionDef { user, .. })
        | MetaOp::PutAccessKey(crate::access::AccessKeyDef { user, .. }) => Some(user),
        _ => None,
    }
}

/// Passes of an install before what still differs is given up on (each pass applies what
/// the one before uncovered; a definition that cannot apply here would differ for ever).
const INSTALL_PASSES: usize = 4;

/// Operations keyed by (rank, object): in the order they apply.
type Definitions = BTreeMap<(u8, String), MetaOp>;

fn keyed(ops: impl IntoIterator<Item = MetaOp>) -> Definitions {
    ops.into_iter()
        .map(|op| ((rank(&op), op.object()), op))
        .collect()
}

impl Broker {
    /// The users named in this node's configuration file: they and their permissions are this
    /// node's own, neither carried by the metadata group's snapshots nor changed by them.
    pub fn keep_users_local(&mut self, names: impl IntoIterator<Item = String>) {
        if let Some(c) = self.cluster.as_mut() {
            c.meta.local_users.extend(names);
        }
    }

    /// The cluster's definitions as this node holds them, as the operations that make them:
    /// vhosts, users, limits, permissions, policies, parameters, access keys, durable
    /// exchanges (not the built-in ones), replicated queues, and the bindings between them.
    /// Classic queues, transient exchanges and their bindings are this node's own.
    pub(super) fn cluster_definitions(&self) -> Vec<MetaOp> {
        let mut ops = Vec::new();
        ops.extend(self.vhosts.iter().map(|(name, vh)| MetaOp::PutVhost {
            name: name.clone(),
            meta: Some(vh.meta.clone()),
        }));
        ops.extend(self.access.users().cloned().map(MetaOp::PutUser));
        for scope in [LimitScope::Vhost, LimitScope::User] {
            ops.extend(
                self.limits
                    .all(scope)
                    .map(|(name, limits)| MetaOp::PutLimits {
                        scope,
                        name: name.to_owned(),
                        limits: limits.clone(),
                    }),
            );
        }
        ops.extend(
            self.access
                .permissions()
                .cloned()
                .map(MetaOp::PutPermission),
        );
        ops.extend(
            self.access
                .topic_permissions()
                .cloned()
                .map(MetaOp::PutTopicPermission),
        );
        for kind in [PolicyKind::User, PolicyKind::Operator] {
            ops.extend(
                self.policies
                    .list(kind, None)
                    .cloned()
                    .map(|p: PolicyDef| MetaOp::PutPolicy(p)),
            );
        }
        ops.extend(
            self.parameters
                .all()
                .cloned()
                .map(|p: ParameterDef| MetaOp::PutParameter(p)),
        );
        ops.extend(self.access.access_keys().cloned().map(MetaOp::PutAccessKey));
        for (vhost, vh) in &self.vhosts {
            for x in vh.exchanges.values().filter(|x| x.durable) {
                let builtin = SYSTEM_EXCHANGES.iter().any(|(n, _, _)| *n == &*x.name);
                if !builtin {
                    ops.push(MetaOp::DeclareExchange {
                        vhost: vhost.clone(),
                        name: x.name.to_string(),
                        kind: type_name(x.kind, x.delayed).to_owned(),
                        auto_delete: x.auto_delete,
                        internal: x.internal,
                        arguments: x.arguments.clone(),
                    });
                }
                for (dest, key, arguments) in x.bindings() {
                    let dest = match dest {
                        Dest::Queue(id) => match self.queues.get(id) {
                            Some(q) if q.replica.is_some() => BindingDest::Queue(q.name.clone()),
                            _ => continue,
                        },
                        Dest::Exchange(name) => match vh.exchanges.get(name) {
                            Some(d) if d.durable => BindingDest::Exchange(name.clone()),
                            _ => continue,
                        },
                    };
                    ops.push(MetaOp::Bind(Binding {
                        vhost: vhost.clone(),
                        source: x.name.to_string(),
                        dest,
                        key: key.to_string(),
                        arguments: arguments.clone(),
                    }));
                }
            }
        }
        ops.extend(
            self.queues
                .values()
                .filter_map(|q| Some((q, q.replica.as_ref()?)))
                .map(|(q, r)| MetaOp::DeclareQueue {
                    vhost: q.vhost.clone(),
                    name: q.name.clone(),
                    arguments: q.arguments.clone(),
                    leader: None,
                    // Every queue's, so that a node holding another group for its name (the
                    // queue was deleted and declared again while it was away) sees it differ;
                    // earlier versions read the name's.
                    group: QueueGroup::Fixed(r.group),
                    voters: r.voters.clone(),
                }),
        );
        ops
    }

    /// The cluster's definitions as this node holds them, one line each in a fixed order:
    /// for tests that compare the nodes of a cluster.
    #[doc(hidden)]
    pub fn cluster_definitions_text(&self) -> Vec<String> {
        let local = self
            .cluster
            .as_ref()
            .map(|c| c.meta.local_users.clone())
            .unwrap_or_default();
        keyed(self.cluster_definitions())
            .into_values()
            .filter(|op| user_of(op).is_none_or(|u| !local.contains(u)))
            .map(|op| format!("{op:?}"))
            .collect()
    }

    /// After applying committed metadata entries: a snapshot of the definitions, if enough
    /// entries were applied since the last one and nothing of this node's waits for the log.
    pub(super) fn take_meta_snapshot(&mut self) {
        let Some(c) = self.cluster.as_ref() else {
            return;
        };
        let m = &c.meta;
        // Raft asks for one when a node being added needs it (`Broker::want_snapshots`).
        let due =
            (m.since_snapshot >= c.snapshot_entries || m.snapshot_asked) && m.applied_term > 0;
        let quiet = m.latest.is_empty() && m.queued.is_empty() && !m.in_flight_pending();
        if !due || !quiet {
            return;
        }
        let local = &m.local_users;
        // A definition the log could not carry (`readable`: a table nested too deep) stayed
        // on this node when it was made: it stays out of the snapshot too.
        let ops = keyed(self.cluster_definitions())
            .into_values()
            .filter(|op| user_of(op).is_none_or(|u| !local.contains(u)))
            .filter(readable)
            .collect();
        let snap = MetaSnapshot {
            seen: m.seen.iter().map(|(n, s)| (*n, *s)).collect(),
            ops,
            local_users: local.iter().cloned().collect(),
            levels: m.levels.iter().map(|(n, l)| (*n, *l)).collect(),
            members: c.member_list(),
            forgotten: m.forgotten.iter().copied().collect(),
        };
        let data = encode_snapshot(&snap);
        let (index, term, max) = (m.applied, m.applied_term, c.snapshot_max);
        // A snapshot another node could not read would leave it without the log it replaces.
        let reads_back = decode_snapshot(&data).is_some_and(|back| back == snap);
        let Some(c) = self.cluster.as_mut() else {
            return;
        };
        c.meta.since_snapshot = 0;
        c.meta.snapshot_asked = false;
        if !reads_back {
            tracing::error!(
                index,
                "a metadata snapshot that does not read back: not taken, the log is kept"
            );
            return;
        }
        if data.len() > max {
            tracing::warn!(
                index,
                bytes = data.len(),
                "metadata snapshot larger than the cluster can carry: the log is kept"
            );
            return;
        }
        tracing::debug!(index, bytes = data.len(), "metadata snapshot taken");
        c.snapshots.push(ReplicaSnapshot {
            group: META_GROUP,
            index,
            term,
            data: SnapshotData::Encoded(data),
        });
    }

    /// `op` is a snapshot's quorum queue that this node holds under another group: the queue
    /// was deleted and declared again while this node was away. Replaced even when this node
    /// has a change of its own to it waiting for the log (that change then reaches the new
    /// queue, as on every other node).
    fn holds_other_group(&self, op: &MetaOp) -> bool {
        let MetaOp::DeclareQueue {
            vhost,
            name,
            group: QueueGroup::Fixed(g),
            ..
        } = op
        else {
            return false;
        };
        self.queue_id(vhost, name)
            .and_then(|id| self.replica_group(id))
            .is_some_and(|had| had != *g)
    }

    /// A snapshot of the metadata group at `index`: from the leader, for a node too far
    /// behind, or read back at a start when the store holds less than the snapshot.
    pub(super) fn install_meta_snapshot(&mut self, index: u64, term: u64, data: &bytes::Bytes) {
        let now = self.now_ms;
        let Some(c) = self.cluster.as_mut() else {
            return;
        };
        if index <= c.meta.applied {
            // This node's store already holds as much.
            return;
        }
        let Some(snap) = decode_snapshot(data) else {
            // Checksummed on disk and on the wire: a bug or a later version.
            tracing::error!(
                index,
                "unreadable metadata snapshot: the definitions stay as they are"
            );
            return;
        };
        let node = c.node();
        let m = &mut c.meta;
        let own = snap
            .seen
            .iter()
            .find(|(n, _)| *n == node)
            .map_or(0, |(_, s)| *s);
        // This node's changes the snapshot holds are applied: their records go, and so does
        // their entry in flight.
        let mut done = Vec::new();
        while m.queued.front().is_some_and(|w| w.number <= own) {
            done.extend(m.queued.pop_front().map(|w| w.number));
        }
        if let Some(numbers) = m.take_in_flight_upto(own) {
            done.extend(numbers);
        }
        m.latest.retain(|_, n| *n > own);
        m.seen = snap.seen.into_iter().collect();
        for (n, level) in snap.levels {
            let l = m.levels.entry(n).or_insert(level);
            *l = (*l).max(level);
        }
        let members = snap.members;
        // The snapshot's, not a union: a forgotten number may have been taken again since.
        m.forgotten = snap.forgotten.iter().copied().collect();
        let settled: Vec<u64> = m.declares.range(..=own).map(|(n, _)| *n).collect();
        // Changes whose clients wait for every node: in the log at or before the snapshot.
        m.changes_applied_upto(own, index, now);
        m.through_log.retain(|_, (n, _)| *n > own);
        m.next_op = m.next_op.max(own);
        m.applied = index;
        m.applied_term = term;
        m.since_snapshot = 0;
        let pending: BTreeSet<String> = m.latest.keys().cloned().collect();
        // This node's configuration users, and the taker's (which its snapshot leaves out:
        // whether they exist in the cluster, it cannot say).
        let mut local = m.local_users.clone();
        local.extend(snap.local_users.iter().cloned());
        if let Some(p) = m.send(node, now, false) {
            c.push(p);
        }
        // The nodes first: the queues the snapshot makes here start with them.
        if let Some(members) = members {
            c.set_member_list(members);
        }
        if let Some(p) = self.persist.as_mut() {
            for number in done {
                p.push(StoreOp::DeleteMetaPending { number }, false);
            }
        }
        let ours = |op: &MetaOp| {
            !pending.contains(&op.object()) && user_of(op).is_none_or(|u| !local.contains(u))
        };
        // A snapshot of an earlier version names no groups: its queues have their names'.
        let there = keyed(snap.ops.into_iter().map(|op| match op {
            MetaOp::DeclareQueue {
                vhost,
                name,
                arguments,
                leader,
                group: QueueGroup::Named,
                voters,
            } => MetaOp::DeclareQueue {
                group: QueueGroup::Fixed(super::replicated::group_of(&vhost, &name)),
                vhost,
                name,
                arguments,
                leader,
                voters,
            },
            op => op,
        }));
        // Applying one difference can make another: an unbinding auto-deletes its exchange,
        // an exchange declared with another type loses its bindings. So again, with what the
        // node then holds, until nothing differs (a few passes at most).
        let (mut deleted, mut changed) = (0, 0);
        if let Some(c) = self.cluster.as_mut() {
            c.meta.from_snapshot = true;
        }
        for pass in 0.. {
            let here = keyed(self.cluster_definitions());
            let gone: Vec<MetaOp> = here
                .iter()
                .rev()
                .filter(|(k, op)| !there.contains_key(*k) && ours(op))
                .filter_map(|(_, op)| undo(op))
                .collect();
            let differ: Vec<MetaOp> = there
                .iter()
                .filter(|(k, op)| {
                    (ours(op) || self.holds_other_group(op))
                        && !here.get(*k).is_some_and(|h| holds(h, op))
                })
                .map(|(_, op)| op.clone())
                .collect();
            if gone.is_empty() && differ.is_empty() {
                break;
            }
            if pass == INSTALL_PASSES {
                tracing::error!(
                    index,
                    left = gone.len() + differ.len(),
                    "metadata snapshot: definitions that do not apply here stay different"
                );
                break;
            }
            deleted += gone.len();
            changed += differ.len();
            for op in gone.into_iter().chain(differ) {
                self.apply_meta_op(op);
            }
        }
        if let Some(c) = self.cluster.as_mut() {
            c.meta.from_snapshot = false;
        }
        tracing::info!(index, deleted, changed, "metadata snapshot installed");
        // Declarations of this node's the snapshot holds: their clients learn what the
        // queue is now.
        for number in settled {
            self.answer_declare(number, None);
        }
        let Some(c) = self.cluster.as_ref() else {
            return;
        };
        let op = c.meta_applied_record();
        if let Some(p) = self.persist.as_mut() {
            p.push(op, true);
        }
    }
}
