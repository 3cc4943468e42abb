//! What the metadata group's entries say: the operations on vhosts, users, permissions,
//! limits, policies, exchanges, bindings and replicated queues that every node applies, and
//! their encoding.
//!
//! An entry is `[now u64][origin node u64][number u64]` and an AMQP field table. The first
//! format's table names one operation (`op`, and its fields); the second's has `v` = 2 and
//! `ops`, an array of such tables, applied in order, each with its `number` on its node (the
//! head's number is the first one's): a node numbers its changes in order, across restarts,
//! and every node applies each change of a node once. Names of fields are spelled out, so
//! that later versions can add operations and fields; an entry this version cannot read is
//! skipped with an error in the log.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use warren_codec::{FieldTable, FieldValue, ShortStr};

use crate::access::{
    AccessKeyDef, HashAlgorithm, PasswordHash, PermissionDef, TopicPermissionDef, UserDef,
};
use crate::limits::{LimitScope, Limits};
use crate::parameters::ParameterDef;
use crate::persist::BindingDest;
use crate::policy::{ApplyTo, Definition, PolicyDef, PolicyKind, PolicyValue};
use crate::replica::NodeId;
use crate::vhost_meta::VhostMeta;

/// The length of an entry's fixed head.
pub(super) const HEAD: usize = 24;

/// The format of entries that carry a list of operations and are applied once each.
const FORMAT_LIST: i64 = 2;

/// One change to the cluster's definitions.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum MetaOp {
    DeclareQueue {
        vhost: String,
        name: ShortStr,
        arguments: FieldTable,
        /// The node that stands for the queue's first leader (`x-queue-leader-locator`);
        /// `None` in entries of earlier versions (their declaring node stood).
        leader: Option<u64>,
        group: QueueGroup,
        /// The queue's voters of its own (`x-quorum-initial-group-size`, at
        /// `GROUP_VOTERS_LEVEL`): the cluster's other nodes hold it as learners. `None`: every
        /// node votes (and in entries of earlier versions).
        voters: Option<Vec<u64>>,
    },
    DeleteQueue {
        vhost: String,
        name: ShortStr,
        /// The group of the queue deleted (absent in entries of earlier versions): a node
        /// holding the queue under another group (declared again since) keeps it.
        group: Option<u64>,
    },
    /// A replicated queue's arguments replaced (SQS's SetQueueAttributes and tags). Unknown
    /// to nodes of earlier versions: it travels in an entry of its own.
    SetQueueArguments {
        vhost: String,
        name: ShortStr,
        changes: Vec<super::queue_arguments::ArgumentChange>,
    },
    /// `node` made a voter of a quorum queue (`add`), or taken off its voters (`add_member`,
    /// `delete_member`, `grow`, `shrink`), for the queue of `group` only (one declared again
    /// since keeps its own). A change, not the set: two nodes changing one queue at once
    /// both count. Applied by the log alone, on every node alike (never ahead on the node
    /// that made it), so every node reaches the same voters. Unknown to nodes of earlier
    /// versions (proposed only at `GROUP_VOTERS_LEVEL`): it travels in an entry of its own.
    ChangeQueueMember {
        vhost: String,
        name: ShortStr,
        group: u64,
        node: u64,
        add: bool,
    },
    DeclareExchange {
        vhost: String,
        name: String,
        /// The type as exchange.declare names it (`x-delayed-message` for a delayed one).
        kind: String,
        auto_delete: bool,
        internal: bool,
        arguments: FieldTable,
    },
    DeleteExchange {
        vhost: String,
        name: String,
    },
    Bind(Binding),
    Unbind(Binding),
    /// A vhost made, or its metadata changed (fields of their own, which nodes of earlier
    /// versions pass over: they make the vhost and keep no metadata). `None`: an entry of an
    /// earlier version, which makes the vhost if it is not there and leaves its metadata.
    PutVhost {
        name: String,
        meta: Option<VhostMeta>,
    },
    DeleteVhost(String),
    PutUser(UserDef),
    DeleteUser(String),
    PutPermission(PermissionDef),
    DeletePermission {
        user: String,
        vhost: String,
    },
    PutTopicPermission(TopicPermissionDef),
    /// One exchange's topic permission of a user in a vhost, or all of them.
    ClearTopicPermission {
        user: String,
        vhost: String,
        exchange: Option<String>,
    },
    PutLimits {
        scope: LimitScope,
        name: String,
        limits: Limits,
    },
    PutPolicy(PolicyDef),
    DeletePolicy {
        vhost: String,
        kind: PolicyKind,
        name: String,
    },
    PutAccessKey(AccessKeyDef),
    DeleteAccessKey(String),
    PutParameter(ParameterDef),
    DeleteParameter {
        component: String,
        vhost: String,
        name: String,
    },
    /// Every node hands the quorum queue leaderships it holds above an even share to the
    /// nodes below it (`warren ctl rebalance`).
    Rebalance,
    /// What a node's version can do ([`super::metadata_group::FEATURE_LEVEL`]), announced at
    /// each start: a change every node must read is made only once all have announced it.
    /// Unknown to nodes of earlier versions: it travels in an entry of its own.
    FeatureLevel {
        node: NodeId,
        level: u64,
    },
    /// The cluster forgets a node (`warren ctl forget_cluster_node`, as RabbitMQ's
    /// `forget_cluster_node`): every group moves to the other nodes, and the node is no
    /// peer any more. Unknown to nodes of earlier versions (proposed only at
    /// `FEATURE_LEVEL` 2): it travels in an entry of its own.
    ForgetNode {
        node: NodeId,
    },
    /// The cluster takes a new node, reached at `addr` (`HOST:PORT`), that asked to join
    /// (`--cluster-join`): every node links with it, and every group adds it (as a learner
    /// sent the leader's snapshot, then a voter). At `FEATURE_LEVEL` 2, alone in its entry.
    AddNode {
        node: NodeId,
        addr: String,
        /// The feature level it said it has (0 from a node that said none).
        level: u64,
    },
}

/// The key of a queue's operations (see [`MetaOp::object`]).
pub(super) fn queue_object(vhost: &str, name: &str) -> String {
    format!("q\0{vhost}\0{name}")
}

/// Which Raft group a replicated queue's declaration gives it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum QueueGroup {
    /// The number its vhost and name give (`group_of`), the queue made ahead by its node:
    /// entries of earlier versions, and declarations that cannot wait.
    Named,
    /// The number its name gives, the queue made when the log applies the entry, on every
    /// node alike: while a node of the cluster may run an earlier version (which reads it as
    /// `Named`).
    ByName,
    /// The number of the log index the entry is applied at (`group_placed`): the declaring
    /// node makes the queue only then, as every other node does.
    FromLog,
    /// A number given before (a snapshot's queue, made by an earlier entry).
    Fixed(u64),
}

/// A binding of a durable exchange to a replicated queue or to another durable exchange.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Binding {
    pub vhost: String,
    pub source: String,
    pub dest: BindingDest,
    pub key: String,
    pub arguments: FieldTable,
}

/// A decoded entry.
#[derive(Debug, PartialEq)]
pub(super) struct Entry {
    pub origin: NodeId,
    /// The number of its first operation.
    pub seq: u64,
    /// Of the second format: its operations are numbered, so that a copy is applied once.
    pub numbered: bool,
    /// Each operation with its number on its node (0 in the first format).
    pub ops: Vec<(u64, MetaOp)>,
}

impl MetaOp {
    /// An operation nodes of an older version cannot read (they skip the whole entry that
    /// holds it): it travels in an entry of its own, so that it takes nothing else with it.
    pub(super) fn travels_alone(&self) -> bool {
        matches!(
            self,
            MetaOp::Rebalance
                | MetaOp::SetQueueArguments { .. }
                | MetaOp::ChangeQueueMember { .. }
                | MetaOp::FeatureLevel { .. }
                | MetaOp::ForgetNode { .. }
                | MetaOp::AddNode { .. }
        )
    }

    /// Applied on every node, the one that made it included, only when the log has it (a
    /// quorum queue's declaration that waits for the log, a change of a queue's members).
    pub(super) fn applied_by_log(&self) -> bool {
        matches!(
            self,
            MetaOp::DeclareQueue {
                group: QueueGroup::FromLog | QueueGroup::ByName,
                ..
            } | MetaOp::ChangeQueueMember { .. }
        )
    }

    /// What the operation changes, as a key: two operations on one object share it.
    pub(super) fn object(&self) -> String {
        match self {
            MetaOp::DeclareQueue { vhost, name, .. }
            | MetaOp::DeleteQueue { vhost, name, .. }
            | MetaOp::SetQueueArguments { vhost, name, .. } => queue_object(vhost, name),
            // Its own key: applied by the log alone, it is never weighed against the
            // queue's other changes made here.
            MetaOp::ChangeQueueMember {
                vhost, name, node, ..
            } => format!("qm\0{vhost}\0{name}\0{node}"),
            MetaOp::DeclareExchange { vhost, name, .. }
            | MetaOp::DeleteExchange { vhost, name } => {
                format!("x\0{vhost}\0{name}")
            }
            MetaOp::Bind(b) | MetaOp::Unbind(b) => {
                let (kind, dest) = match &b.dest {
                    BindingDest::Queue(q) => ('q', q.as_str()),
                    BindingDest::Exchange(x) => ('e', x.as_str()),
                };
                let args = b.arguments.to_bytes();
                format!(
                    "b\0{}\0{}\0{kind}{dest}\0{}\0{}",
                    b.vhost,
                    b.source,
                    b.key,
                    String::from_utf8_lossy(&args)
                )
            }
            MetaOp::PutVhost { name, .. } | MetaOp::DeleteVhost(name) => format!("v\0{name}"),
            MetaOp::PutUser(UserDef { name, .. }) | MetaOp::DeleteUser(name) => {
                format!("u\0{name}")
            }
            MetaOp::PutPermission(PermissionDef { user, vhost, .. })
            | MetaOp::DeletePermission { user, vhost } => format!("p\0{user}\0{vhost}"),
            MetaOp::PutTopicPermission(t) => {
                format!("t\0{}\0{}\0{}", t.user, t.vhost, t.exchange)
            }
            MetaOp::ClearTopicPermission {
                user,
                vhost,
                exchange,
            } => format!(
                "t\0{user}\0{vhost}\0{}",
                exchange.as_deref().unwrap_or("\0*")
            ),
            MetaOp::PutLimits { scope, name, .. } => format!("l\0{}\0{name}", scope_name(*scope)),
            MetaOp::PutPolicy(PolicyDef {
                vhost, kind, name, ..
            })
            | MetaOp::DeletePolicy { vhost, kind, name } => {
                format!("y\0{}\0{vhost}\0{name}", kind_name(*kind))
            }
            MetaOp::PutAccessKey(AccessKeyDef { id, .. }) | MetaOp::DeleteAccessKey(id) => {
                format!("k\0{id}")
            }
            MetaOp::PutParameter(ParameterDef {
                component,
                vhost,
                name,
                ..
            })
            | MetaOp::DeleteParameter {
                component,
                vhost,
                name,
            } => format!("r\0{component}\0{vhost}\0{name}"),
            MetaOp::Rebalance => "b\0".to_owned(),
            MetaOp::FeatureLevel { node, .. } => format!("f\0{node}"),
            MetaOp::ForgetNode { node } | MetaOp::AddNode { node, .. } => format!("n\0{node}"),
        }
    }
}

fn scope_name(s: LimitScope) -> &'static str {
    match s {
        LimitScope::Vhost => "vhost",
        LimitScope::User => "user",
    }
}

fn kind_name(k: PolicyKind) -> &'static str {
    match k {
        PolicyKind::User => "user",
        PolicyKind::Operator => "operator",
    }
}

fn text(t: &mut FieldTable, k: &'static str, v: &str) {
    t.insert(k, FieldValue::long_str(v));
}

/// A vhost's metadata in its `put_vhost` operation: `metadata` says it is there (an entry of
/// an earlier version has none, and leaves the vhost's as it is).
fn put_vhost_meta(t: &mut FieldTable, meta: &VhostMeta) {
    flag(t, "metadata", true);
    if !meta.description.is_empty() {
        text(t, "description", &meta.description);
    }
    if !meta.tags.is_empty() {
        let tags = meta.tags.iter().map(FieldValue::long_str).collect();
        t.insert("tags", FieldValue::Array(tags));
    }
    if let Some(q) = meta.default_queue_type {
        text(t, "default_queue_type", q.as_str());
    }
}

fn flag(t: &mut FieldTable, k: &'static str, v: bool) {
    t.insert(k, FieldValue::Bool(v));
}

fn binding_table(t: &mut FieldTable, b: &Binding) {
    text(t, "vhost", &b.vhost);
    text(t, "source", &b.source);
    let (kind, dest) = match &b.dest {
        BindingDest::Queue(q) => ("queue", q.as_str()),
        BindingDest::Exchange(x) => ("exchange", x.as_str()),
    };
    text(t, "destination_type", kind);
    text(t, "destination", dest);
    text(t, "routing_key", &b.key);
    t.insert("arguments", FieldValue::Table(b.arguments.detached()));
}

fn voter_array(voters: &[u64]) -> FieldValue {
    FieldValue::Array(voters.iter().map(|n| FieldValue::U64(*n)).collect())
}

/// A table's voters (`None`: absent); a mistyped one makes the operation unreadable.
fn voters_of(t: &FieldTable) -> Option<Option<Vec<u64>>> {
    match t.get("voters") {
        None => Some(None),
        Some(v) => Some(Some(
            v.as_array()?
                .iter()
                .map(FieldValue::as_u64)
                .collect::<Option<Vec<u64>>>()?,
        )),
    }
}

fn op_table(op: &MetaOp) -> FieldTable {
    let mut t = FieldTable::new();
    let name = match op {
        MetaOp::DeclareQueue {
            vhost,
            name,
            arguments,
            leader,
            group,
            voters,
        } => {
            text(&mut t, "vhost", vhost);
            text(&mut t, "name", name.as_str());
            t.insert("arguments", FieldValue::Table(arguments.detached()));
            if let Some(v) = voters {
                t.insert("voters", voter_array(v));
            }
            if let Some(l) = leader {
                t.insert(
                    "leader",
                    FieldValue::I64(i64::try_from(*l).unwrap_or(i64::MAX)),
                );
            }
            // Only where it is not the name's: entries older versions read alike.
            match group {
                QueueGroup::Named => {}
                QueueGroup::ByName => flag(&mut t, "made_by_log", true),
                QueueGroup::FromLog => flag(&mut t, "group_from_log", true),
                QueueGroup::Fixed(g) => {
                    t.insert("group", FieldValue::U64(*g));
                }
            }
            "declare_queue"
        }
        MetaOp::ChangeQueueMember {
            vhost,
            name,
            group,
            node,
            add,
        } => {
            text(&mut t, "vhost", vhost);
            text(&mut t, "name", name.as_str());
            t.insert("group", FieldValue::U64(*group));
            t.insert("node", FieldValue::U64(*node));
            flag(&mut t, "add", *add);
            "change_queue_member"
        }
        MetaOp::DeleteQueue { vhost, name, group } => {
            text(&mut t, "vhost", vhost);
            text(&mut t, "name", name.as_str());
            if let Some(g) = group {
                t.insert("group", FieldValue::U64(*g));
            }
            "delete_queue"
        }
        MetaOp::SetQueueArguments {
            vhost,
            name,
            changes,
        } => {
            text(&mut t, "vhost", vhost);
            text(&mut t, "name", name.as_str());
            let list = changes
                .iter()
                .map(|c| {
                    let mut e = FieldTable::new();
                    text(&mut e, "key", &c.key);
                    if let Some(entry) = &c.entry {
                        text(&mut e, "entry", entry);
                    }
                    if let Some(v) = &c.value {
                        e.insert("value", v.detached());
                    }
                    FieldValue::Table(e)
                })
                .collect();
            t.insert("changes", FieldValue::Array(list));
            "set_queue_arguments"
        }
        MetaOp::DeclareExchange {
            vhost,
            name,
            kind,
            auto_delete,
            internal,
            arguments,
        } => {
            text(&mut t, "vhost", vhost);
            text(&mut t, "name", name);
            text(&mut t, "type", kind);
            flag(&mut t, "auto_delete", *auto_delete);
            flag(&mut t, "internal", *internal);
            t.insert("arguments", FieldValue::Table(arguments.detached()));
            "declare_exchange"
        }
        MetaOp::DeleteExchange { vhost, name } => {
            text(&mut t, "vhost", vhost);
            text(&mut t, "name", name);
            "delete_exchange"
        }
        MetaOp::Bind(b) => {
            binding_table(&mut t, b);
            "bind"
        }
        MetaOp::Unbind(b) => {
            binding_table(&mut t, b);
            "unbind"
        }
        MetaOp::PutVhost { name, meta } => {
            text(&mut t, "name", name);
            if let Some(meta) = meta {
                put_vhost_meta(&mut t, meta);
            }
            "put_vhost"
        }
        MetaOp::DeleteVhost(name) => {
            text(&mut t, "name", name);
            "delete_vhost"
        }
        MetaOp::PutUser(u) => {
            text(&mut t, "name", &u.name);
            if let Some(h) = &u.hash {
                let algorithm = match h.algorithm {
                    HashAlgorithm::Sha256 => "sha256",
                    HashAlgorithm::Sha512 => "sha512",
                };
                text(&mut t, "hashing_algorithm", algorithm);
                t.insert(
                    "password_hash",
                    FieldValue::ByteArray(Bytes::copy_from_slice(&h.bytes)),
                );
            }
            let tags = u.tags.iter().map(FieldValue::long_str).collect();
            t.insert("tags", FieldValue::Array(tags));
            "put_user"
        }
        MetaOp::DeleteUser(name) => {
            text(&mut t, "name", name);
            "delete_user"
        }
        MetaOp::PutPermission(p) => {
            text(&mut t, "user", &p.user);
            text(&mut t, "vhost", &p.vhost);
            text(&mut t, "configure", &p.configure);
            text(&mut t, "write", &p.write);
            text(&mut t, "read", &p.read);
            "put_permission"
        }
        MetaOp::DeletePermission { user, vhost } => {
            text(&mut t, "user", user);
            text(&mut t, "vhost", vhost);
            "delete_permission"
        }
        MetaOp::PutTopicPermission(p) => {
            text(&mut t, "user", &p.user);
            text(&mut t, "vhost", &p.vhost);
            text(&mut t, "exchange", &p.exchange);
            text(&mut t, "write", &p.write);
            text(&mut t, "read", &p.read);
            "put_topic_permission"
        }
        MetaOp::ClearTopicPermission {
            user,
            vhost,
            exchange,
        } => {
            text(&mut t, "user", user);
            text(&mut t, "vhost", vhost);
            if let Some(x) = exchange {
                text(&mut t, "exchange", x);
            }
            "clear_topic_permission"
        }
        MetaOp::PutLimits {
            scope,
            name,
            limits,
        } => {
            text(&mut t, "scope", scope_name(*scope));
            text(&mut t, "name", name);
            let mut l = FieldTable::new();
            for (k, v) in limits.iter() {
                // Limit names are RabbitMQ's, all short.
                l.insert(ShortStr::from_string(k.to_owned()), FieldValue::I64(v));
            }
            t.insert("limits", FieldValue::Table(l));
            "put_limits"
        }
        MetaOp::PutPolicy(p) => {
            text(&mut t, "vhost", &p.vhost);
            text(&mut t, "name", &p.name);
            text(&mut t, "kind", kind_name(p.kind));
            text(&mut t, "pattern", &p.pattern);
            text(&mut t, "apply_to", p.apply_to.as_str());
            t.insert("priority", FieldValue::I64(p.priority));
            let mut d = FieldTable::new();
            for (k, v) in &p.definition {
                let v = match v {
                    PolicyValue::Str(s) => FieldValue::long_str(s),
                    PolicyValue::Int(i) => FieldValue::I64(*i),
                    PolicyValue::Bool(b) => FieldValue::Bool(*b),
                    PolicyValue::Other { json, erl } => {
                        let mut o = FieldTable::new();
                        text(&mut o, "json", json);
                        text(&mut o, "erl", erl);
                        FieldValue::Table(o)
                    }
                };
                // Policy keys are RabbitMQ's, all short.
                d.insert(ShortStr::from_string(k.clone()), v);
            }
            t.insert("definition", FieldValue::Table(d));
            "put_policy"
        }
        MetaOp::DeletePolicy { vhost, kind, name } => {
            text(&mut t, "vhost", vhost);
            text(&mut t, "kind", kind_name(*kind));
            text(&mut t, "name", name);
            "delete_policy"
        }
        MetaOp::PutAccessKey(k) => {
            text(&mut t, "id", &k.id);
            text(&mut t, "user", &k.user);
            text(&mut t, "secret", &k.secret);
            t.insert(
                "created",
                FieldValue::I64(i64::try_from(k.created_ms).unwrap_or(i64::MAX)),
            );
            "put_access_key"
        }
        MetaOp::DeleteAccessKey(id) => {
            text(&mut t, "id", id);
            "delete_access_key"
        }
        MetaOp::Rebalance => "rebalance",
        MetaOp::FeatureLevel { node, level } => {
            t.insert("node", FieldValue::U64(*node));
            t.insert("level", FieldValue::U64(*level));
            "feature_level"
        }
        MetaOp::ForgetNode { node } => {
            t.insert("node", FieldValue::U64(*node));
            "forget_node"
        }
        MetaOp::AddNode { node, addr, level } => {
            t.insert("node", FieldValue::U64(*node));
            text(&mut t, "address", addr);
            t.insert("level", FieldValue::U64(*level));
            "add_node"
        }
        MetaOp::PutParameter(p) => {
            text(&mut t, "component", &p.component);
            text(&mut t, "vhost", &p.vhost);
            text(&mut t, "name", &p.name);
            text(&mut t, "value", &p.value);
            "put_parameter"
        }
        MetaOp::DeleteParameter {
            component,
            vhost,
            name,
        } => {
            text(&mut t, "component", component);
            text(&mut t, "vhost", vhost);
            text(&mut t, "name", name);
            "delete_parameter"
        }
    };
    t.insert("op", FieldValue::long_str(name));
    t
}

/// Reads a table's fields; `None` for a missing or mistyped one.
struct Fields<'a>(&'a FieldTable);

impl Fields<'_> {
    fn text(&self, k: &str) -> Option<String> {
        self.0.get(k)?.as_str().map(str::to_owned)
    }
    fn flag(&self, k: &str) -> Option<bool> {
        self.0.get(k)?.as_bool()
    }
    fn table(&self, k: &str) -> Option<FieldTable> {
        self.0.get(k)?.as_table().cloned()
    }
    fn binding(&self) -> Option<Binding> {
        let dest = ShortStr::from_string(self.text("destination")?);
        Some(Binding {
            vhost: self.text("vhost")?,
            source: self.text("source")?,
            dest: match self.text("destination_type")?.as_str() {
                "queue" => BindingDest::Queue(dest),
                "exchange" => BindingDest::Exchange(dest),
                _ => return None,
            },
            key: self.text("routing_key")?,
            arguments: self.table("arguments")?,
        })
    }
    fn scope(&self) -> Option<LimitScope> {
        match self.text("scope")?.as_str() {
            "vhost" => Some(LimitScope::Vhost),
            "user" => Some(LimitScope::User),
            _ => None,
        }
    }
    fn kind(&self) -> Option<PolicyKind> {
        match self.text("kind")?.as_str() {
            "user" => Some(PolicyKind::User),
            "operator" => Some(PolicyKind::Operator),
            _ => None,
        }
    }
}

fn op_from(t: &FieldTable) -> Option<MetaOp> {
    let f = Fields(t);
    Some(match f.text("op")?.as_str() {
        "declare_queue" => MetaOp::DeclareQueue {
            vhost: f.text("vhost")?,
            name: ShortStr::from_string(f.text("name")?),
            arguments: f.table("arguments")?,
            leader: match t.get("leader") {
                None => None,
                Some(v) => Some(u64::try_from(v.as_i64()?).ok()?),
            },
            group: match (
                t.get("group"),
                f.flag("group_from_log"),
                f.flag("made_by_log"),
            ) {
                (Some(g), _, _) => QueueGroup::Fixed(g.as_u64()?),
                (None, Some(true), _) => QueueGroup::FromLog,
                (None, _, Some(true)) => QueueGroup::ByName,
                (None, _, _) => QueueGroup::Named,
            },
            voters: voters_of(t)?,
        },
        "change_queue_member" => MetaOp::ChangeQueueMember {
            vhost: f.text("vhost")?,
            name: ShortStr::from_string(f.text("name")?),
            group: t.get("group")?.as_u64()?,
            node: t.get("node")?.as_u64()?,
            add: f.flag("add")?,
        },
        "delete_queue" => MetaOp::DeleteQueue {
            vhost: f.text("vhost")?,
            name: ShortStr::from_string(f.text("name")?),
            group: match t.get("group") {
                None => None,
                Some(g) => Some(g.as_u64()?),
            },
        },
        "set_queue_arguments" => MetaOp::SetQueueArguments {
            vhost: f.text("vhost")?,
            name: ShortStr::from_string(f.text("name")?),
            changes: t
                .get("changes")?
                .as_array()?
                .iter()
                .map(|c| {
                    let c = c.as_table()?;
                    let f = Fields(c);
                    Some(super::queue_arguments::ArgumentChange {
                        key: f.text("key")?,
                        entry: match c.get("entry") {
                            None => None,
                            Some(_) => Some(f.text("entry")?),
                        },
                        value: c.get("value").map(FieldValue::detached),
                    })
                })
                .collect::<Option<Vec<_>>>()?,
        },
        "declare_exchange" => MetaOp::DeclareExchange {
            vhost: f.text("vhost")?,
            name: f.text("name")?,
            kind: f.text("type")?,
            auto_delete: f.flag("auto_delete")?,
            internal: f.flag("internal")?,
            arguments: f.table("arguments")?,
        },
        "delete_exchange" => MetaOp::DeleteExchange {
            vhost: f.text("vhost")?,
            name: f.text("name")?,
        },
        "bind" => MetaOp::Bind(f.binding()?),
        "unbind" => MetaOp::Unbind(f.binding()?),
        "put_vhost" => MetaOp::PutVhost {
            name: f.text("name")?,
            meta: if f.flag("metadata") != Some(true) {
                None
            } else {
                Some(VhostMeta {
                    description: match t.get("description") {
                        None => String::new(),
                        Some(_) => f.text("description")?,
                    },
                    tags: match t.get("tags") {
                        None => Vec::new(),
                        Some(v) => v
                            .as_array()?
                            .iter()
                            .map(|v| v.as_str().map(str::to_owned))
                            .collect::<Option<Vec<_>>>()?,
                    },
                    // A type this version does not know (a later one's) leaves the node's.
                    default_queue_type: match t.get("default_queue_type") {
                        None => None,
                        Some(_) => crate::vhost_meta::parse_default_queue_type(
                            &f.text("default_queue_type")?,
                        )
                        .ok()
                        .flatten(),
                    },
                })
            },
        },
        "delete_vhost" => MetaOp::DeleteVhost(f.text("name")?),
        "put_user" => {
            let hash = match t.get("password_hash") {
                None => None,
                Some(v) => {
                    let algorithm = match f.text("hashing_algorithm")?.as_str() {
                        "sha256" => HashAlgorithm::Sha256,
                        "sha512" => HashAlgorithm::Sha512,
                        _ => return None,
                    };
                    Some(PasswordHash::from_bytes(v.as_bytes()?.to_vec(), algorithm)?)
                }
            };
            let tags = t
                .get("tags")?
                .as_array()?
                .iter()
                .map(|v| v.as_str().map(str::to_owned))
                .collect::<Option<Vec<_>>>()?;
            MetaOp::PutUser(UserDef {
                name: f.text("name")?,
                hash,
                tags,
            })
        }
        "delete_user" => MetaOp::DeleteUser(f.text("name")?),
        "put_permission" => MetaOp::PutPermission(PermissionDef {
            user: f.text("user")?,
            vhost: f.text("vhost")?,
            configure: f.text("configure")?,
            write: f.text("write")?,
            read: f.text("read")?,
        }),
        "delete_permission" => MetaOp::DeletePermission {
            user: f.text("user")?,
            vhost: f.text("vhost")?,
        },
        "put_topic_permission" => MetaOp::PutTopicPermission(TopicPermissionDef {
            user: f.text("user")?,
            vhost: f.text("vhost")?,
            exchange: f.text("exchange")?,
            write: f.text("write")?,
            read: f.text("read")?,
        }),
        "clear_topic_permission" => MetaOp::ClearTopicPermission {
            user: f.text("user")?,
            vhost: f.text("vhost")?,
            exchange: f.text("exchange"),
        },
        "put_limits" => {
            let mut limits = Limits::default();
            for (k, v) in f.table("limits")?.iter() {
                limits.set(k.as_str(), v.as_i64()?);
            }
            MetaOp::PutLimits {
                scope: f.scope()?,
                name: f.text("name")?,
                limits,
            }
        }
        "put_policy" => {
            let mut definition = Definition::new();
            for (k, v) in f.table("definition")?.iter() {
                let value = match v {
                    FieldValue::LongStr(_) => PolicyValue::Str(v.as_str()?.to_owned()),
                    FieldValue::I64(i) => PolicyValue::Int(*i),
                    FieldValue::Bool(b) => PolicyValue::Bool(*b),
                    FieldValue::Table(o) => PolicyValue::Other {
                        json: Fields(o).text("json")?,
                        erl: Fields(o).text("erl")?,
                    },
                    _ => return None,
                };
                definition.insert(k.as_str().to_owned(), value);
            }
            MetaOp::PutPolicy(PolicyDef {
                vhost: f.text("vhost")?,
                name: f.text("name")?,
                kind: f.kind()?,
                pattern: f.text("pattern")?,
                apply_to: ApplyTo::parse(&f.text("apply_to")?)?,
                priority: t.get("priority")?.as_i64()?,
                definition,
            })
        }
        "delete_policy" => MetaOp::DeletePolicy {
            vhost: f.text("vhost")?,
            kind: f.kind()?,
            name: f.text("name")?,
        },
        "put_access_key" => MetaOp::PutAccessKey(AccessKeyDef {
            id: f.text("id")?,
            user: f.text("user")?,
            secret: f.text("secret")?,
            created_ms: u64::try_from(t.get("created")?.as_i64()?).ok()?,
        }),
        "delete_access_key" => MetaOp::DeleteAccessKey(f.text("id")?),
        "rebalance" => MetaOp::Rebalance,
        "put_parameter" => MetaOp::PutParameter(ParameterDef {
            component: f.text("component")?,
            vhost: f.text("vhost")?,
            name: f.text("name")?,
            value: f.text("value")?,
        }),
        "delete_parameter" => MetaOp::DeleteParameter {
            component: f.text("component")?,
            vhost: f.text("vhost")?,
            name: f.text("name")?,
        },
        "feature_level" => MetaOp::FeatureLevel {
            node: t.get("node")?.as_u64()?,
            level: t.get("level")?.as_u64()?,
        },
        "forget_node" => MetaOp::ForgetNode {
            node: t.get("node")?.as_u64()?,
        },
        "add_node" => MetaOp::AddNode {
            node: t.get("node")?.as_u64()?,
            addr: f.text("address")?,
            level: match t.get("level") {
                Some(l) => l.as_u64()?,
                None => 0,
            },
        },
        _ => return None,
    })
}

/// An entry of the second format: `ops` (numbered), applied in order, once.
pub(super) fn encode_entry(now_ms: u64, node: NodeId, ops: &[(u64, MetaOp)]) -> Vec<u8> {
    let mut t = FieldTable::new();
    t.insert("v", FieldValue::I64(FORMAT_LIST));
    let list = ops
        .iter()
        .map(|(number, op)| {
            let mut t = op_table(op);
            t.insert("number", FieldValue::U64(*number));
            FieldValue::Table(t)
        })
        .collect();
    t.insert("ops", FieldValue::Array(list));
    let mut out = BytesMut::with_capacity(128);
    out.put_u64(now_ms);
    out.put_u64(node);
    out.put_u64(ops.first().map_or(0, |(n, _)| *n));
    t.encode(&mut out);
    out.to_vec()
}

/// The node an entry comes from and its number there, even when the rest cannot be read.
pub(super) fn decode_head(data: &Bytes) -> Option<(NodeId, u64)> {
    let mut b = data.get(..HEAD)?;
    let _now = b.get_u64();
    Some((b.get_u64(), b.get_u64()))
}

/// Whether this version reads back what it writes of `op` (a table nested deeper than the
/// decoder allows would not be: such an entry could never be applied anywhere).
pub(super) fn readable(op: &MetaOp) -> bool {
    let data = Bytes::from(encode_entry(0, 0, &[(1, op.clone())]));
    decode_entry(&data).is_some_and(|e| e.ops.first().is_some_and(|(_, o)| o == op))
}

/// An entry of either format; `None` if it cannot be read (or names an operation this
/// version does not know).
pub(super) fn decode_entry(data: &Bytes) -> Option<Entry> {
    let (origin, seq) = decode_head(data)?;
    let mut b = data.slice(HEAD..);
    let t = FieldTable::decode(&mut b).ok()?;
    let numbered = t.get("v").and_then(FieldValue::as_i64) == Some(FORMAT_LIST);
    let ops = if numbered {
        t.get("ops")?
            .as_array()?
            .iter()
            .map(|v| {
                let t = v.as_table()?;
                Some((t.get("number")?.as_u64()?, op_from(t)?))
            })
            .collect::<Option<Vec<_>>>()?
    } else {
        vec![(0, op_from(&t)?)]
    };
    Some(Entry {
        origin,
        seq,
        numbered,
        ops,
    })
}

/// The format of a metadata snapshot.
const SNAPSHOT_FORMAT: u8 = 1;

/// What a metadata snapshot holds: the highest change number applied per node, and the
/// operations that make the cluster's definitions as the log had them.
#[derive(Debug, PartialEq)]
pub(super) struct MetaSnapshot {
    pub seen: Vec<(NodeId, u64)>,
    pub ops: Vec<MetaOp>,
    /// The users of the taking node's configuration file: left out of `ops`, so a node that
    /// installs the snapshot cannot tell whether they exist and leaves its own as they are.
    pub local_users: Vec<String>,
    /// The feature level each node announced (absent from snapshots of earlier versions).
    pub levels: Vec<(NodeId, u64)>,
    /// The cluster's nodes once one was added or forgotten (`None`: every node of the list
    /// each node was started with; absent from snapshots of earlier versions), each with its
    /// address (empty: the one each node's list gives).
    pub members: Option<Vec<(NodeId, String)>>,
    /// The numbers of nodes the cluster forgot: a node never joins again under one.
    pub forgotten: Vec<NodeId>,
}

fn pairs_value(pairs: &[(NodeId, u64)], second: &'static str) -> FieldValue {
    FieldValue::Array(
        pairs
            .iter()
            .map(|(node, n)| {
                let mut t = FieldTable::new();
                t.insert("node", FieldValue::U64(*node));
                t.insert(second, FieldValue::U64(*n));
                FieldValue::Table(t)
            })
            .collect(),
    )
}

fn pairs_from(v: &FieldValue, second: &str) -> Option<Vec<(NodeId, u64)>> {
    v.as_array()?
        .iter()
        .map(|v| {
            let t = v.as_table()?;
            Some((t.get("node")?.as_u64()?, t.get(second)?.as_u64()?))
        })
        .collect()
}

/// A snapshot: `[format u8][CRC-32 of the rest, u32]` and a field table with `seen` (an array of
/// `node`/`number` tables) and `ops` (the operations' tables, as in an entry).
pub(super) fn encode_snapshot(snap: &MetaSnapshot) -> Bytes {
    let mut t = FieldTable::new();
    t.insert("seen", pairs_value(&snap.seen, "number"));
    if !snap.levels.is_empty() {
        t.insert("levels", pairs_value(&snap.levels, "level"));
    }
    if let Some(members) = &snap.members {
        let list = members
            .iter()
            .map(|(node, addr)| {
                let mut m = FieldTable::new();
                m.insert("node", FieldValue::U64(*node));
                text(&mut m, "address", addr);
                FieldValue::Table(m)
            })
            .collect();
        t.insert("members", FieldValue::Array(list));
    }
    if !snap.forgotten.is_empty() {
        let list = snap.forgotten.iter().map(|n| FieldValue::U64(*n)).collect();
        t.insert("forgotten", FieldValue::Array(list));
    }
    let ops = snap
        .ops
        .iter()
        .map(|op| FieldValue::Table(op_table(op)))
        .collect();
    t.insert("ops", FieldValue::Array(ops));
    let local = snap.local_users.iter().map(FieldValue::long_str).collect();
    t.insert("local_users", FieldValue::Array(local));
    let mut out = BytesMut::with_capacity(64 + 128 * snap.ops.len());
    out.put_u8(SNAPSHOT_FORMAT);
    out.put_u32(0);
    t.encode(&mut out);
    let crc = crc32fast::hash(&out[5..]);
    out[1..5].copy_from_slice(&crc.to_be_bytes());
    out.freeze()
}

/// `None`: not a snapshot of this format, damaged, or naming an operation this version does
/// not know.
pub(super) fn decode_snapshot(data: &Bytes) -> Option<MetaSnapshot> {
    let mut b = data.clone();
    if b.remaining() < 5 || b.get_u8() != SNAPSHOT_FORMAT {
        return None;
    }
    let crc = b.get_u32();
    if crc32fast::hash(&b) != crc {
        return None;
    }
    let t = FieldTable::decode(&mut b).ok()?;
    let seen = pairs_from(t.get("seen")?, "number")?;
    let levels = match t.get("levels") {
        Some(v) => pairs_from(v, "level")?,
        None => Vec::new(),
    };
    let members = match t.get("members") {
        Some(v) => Some(
            v.as_array()?
                .iter()
                .map(|m| {
                    let m = m.as_table()?;
                    Some((m.get("node")?.as_u64()?, Fields(m).text("address")?))
                })
                .collect::<Option<Vec<_>>>()?,
        ),
        None => None,
    };
    let forgotten = match t.get("forgotten") {
        Some(v) => v
            .as_array()?
            .iter()
            .map(FieldValue::as_u64)
            .collect::<Option<Vec<_>>>()?,
        None => Vec::new(),
    };
    let ops = t
        .get("ops")?
        .as_array()?
        .iter()
        .map(|v| op_from(v.as_table()?))
        .collect::<Option<Vec<_>>>()?;
    let local_users = t
        .get("local_users")?
        .as_array()?
        .iter()
        .map(|v| v.as_str().map(str::to_owned))
        .collect::<Option<Vec<_>>>()?;
    Some(MetaSnapshot {
        seen,
        ops,
        local_users,
        levels,
        members,
        forgotten,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_reads_back_as_written_and_a_damaged_one_does_not() {
        let snap = MetaSnapshot {
            seen: vec![(1, 7), (3, 1 << 40)],
            ops: every_op(),
            local_users: vec!["admin".into()],
            levels: vec![(1, 1), (2, 0)],
            members: Some(vec![
                (1, String::new()),
                (2, String::new()),
                (5, "n5:7705".into()),
            ]),
            forgotten: vec![3],
        };
        let data = encode_snapshot(&snap);
        assert_eq!(decode_snapshot(&data), Some(snap));
        // An earlier version's snapshot has no levels.
        let older = MetaSnapshot {
            levels: Vec::new(),
            members: None,
            forgotten: Vec::new(),
            ..decode_snapshot(&data).expect("snapshot")
        };
        assert_eq!(decode_snapshot(&encode_snapshot(&older)), Some(older));
        let mut bad = data.to_vec();
        let last = bad.len() - 1;
        bad[last] ^= 1;
        assert_eq!(decode_snapshot(&Bytes::from(bad)), None);
        assert_eq!(decode_snapshot(&Bytes::new()), None);
    }

    fn every_op() -> Vec<MetaOp> {
        let mut arguments = FieldTable::new();
        arguments.insert("x-queue-type", FieldValue::long_str("quorum"));
        let mut limits = Limits::default();
        limits.set("max-queues", 10);
        limits.set("max-connections", -1);
        let mut definition = Definition::new();
        definition.insert("max-length".into(), PolicyValue::Int(5));
        definition.insert("overflow".into(), PolicyValue::Str("reject-publish".into()));
        definition.insert("x".into(), PolicyValue::Bool(true));
        definition.insert(
            "ha-params".into(),
            PolicyValue::Other {
                json: "[1,2]".into(),
                erl: "[1,2]".into(),
            },
        );
        let binding = Binding {
            vhost: "/".into(),
            source: "orders".into(),
            dest: BindingDest::Queue(ShortStr::from_static("jobs")),
            key: "eu.#".into(),
            arguments: arguments.clone(),
        };
        vec![
            MetaOp::DeclareQueue {
                vhost: "/".into(),
                name: ShortStr::from_static("jobs"),
                arguments: arguments.clone(),
                leader: Some(3),
                group: QueueGroup::Named,
                voters: None,
            },
            MetaOp::DeleteQueue {
                vhost: "/".into(),
                name: ShortStr::from_static("jobs"),
                group: None,
            },
            MetaOp::SetQueueArguments {
                vhost: "/".into(),
                name: ShortStr::from_static("jobs"),
                changes: vec![
                    super::super::queue_arguments::ArgumentChange {
                        key: "x-message-ttl".into(),
                        entry: None,
                        value: Some(FieldValue::I64(5_000)),
                    },
                    super::super::queue_arguments::ArgumentChange {
                        key: "x-sqs-tags".into(),
                        entry: Some("team".into()),
                        value: None,
                    },
                    super::super::queue_arguments::ArgumentChange {
                        key: "x-dead-letter-exchange".into(),
                        entry: None,
                        value: None,
                    },
                ],
            },
            MetaOp::DeclareExchange {
                vhost: "/".into(),
                name: "orders".into(),
                kind: "topic".into(),
                auto_delete: false,
                internal: true,
                arguments: FieldTable::new(),
            },
            MetaOp::DeleteExchange {
                vhost: "/".into(),
                name: "orders".into(),
            },
            MetaOp::Bind(binding.clone()),
            MetaOp::Unbind(Binding {
                dest: BindingDest::Exchange(ShortStr::from_static("audit")),
                ..binding
            }),
            MetaOp::PutVhost {
                name: "v".into(),
                meta: None,
            },
            MetaOp::DeleteVhost("v".into()),
            MetaOp::PutUser(UserDef {
                name: "u".into(),
                hash: Some(PasswordHash::new("p", [1, 2, 3, 4], HashAlgorithm::Sha512)),
                tags: vec!["administrator".into()],
            }),
            MetaOp::PutUser(UserDef {
                name: "cert".into(),
                hash: None,
                tags: vec![],
            }),
            MetaOp::DeleteUser("u".into()),
            MetaOp::PutPermission(PermissionDef {
                user: "u".into(),
                vhost: "v".into(),
                configure: ".*".into(),
                write: "".into(),
                read: "^a".into(),
            }),
            MetaOp::DeletePermission {
                user: "u".into(),
                vhost: "v".into(),
            },
            MetaOp::PutTopicPermission(TopicPermissionDef {
                user: "u".into(),
                vhost: "v".into(),
                exchange: "amq.topic".into(),
                write: "a".into(),
                read: "b".into(),
            }),
            MetaOp::ClearTopicPermission {
                user: "u".into(),
                vhost: "v".into(),
                exchange: None,
            },
            MetaOp::ClearTopicPermission {
                user: "u".into(),
                vhost: "v".into(),
                exchange: Some("amq.topic".into()),
            },
            MetaOp::PutLimits {
                scope: LimitScope::User,
                name: "u".into(),
                limits,
            },
            MetaOp::PutPolicy(PolicyDef {
                vhost: "/".into(),
                name: "p".into(),
                kind: PolicyKind::Operator,
                pattern: "^jobs$".into(),
                apply_to: ApplyTo::QuorumQueues,
                priority: -3,
                definition,
            }),
            MetaOp::DeletePolicy {
                vhost: "/".into(),
                kind: PolicyKind::User,
                name: "p".into(),
            },
            MetaOp::PutAccessKey(AccessKeyDef {
                id: "WKIAEXAMPLE".into(),
                user: "u".into(),
                secret: "s3cret/with+signs".into(),
                created_ms: 1_764_000_000_000,
            }),
            MetaOp::DeleteAccessKey("WKIAEXAMPLE".into()),
            MetaOp::Rebalance,
            MetaOp::PutParameter(ParameterDef {
                component: "shovel".into(),
                vhost: "/".into(),
                name: "move".into(),
                value: r#"{"src-uri":"amqp://","src-queue":"a"}"#.into(),
            }),
            MetaOp::DeleteParameter {
                component: "shovel".into(),
                vhost: "/".into(),
                name: "move".into(),
            },
            MetaOp::DeclareQueue {
                vhost: "/".into(),
                name: ShortStr::from_static("older"),
                arguments: FieldTable::new(),
                leader: None,
                group: QueueGroup::Named,
                voters: None,
            },
            MetaOp::DeclareQueue {
                vhost: "/".into(),
                name: ShortStr::from_static("placed"),
                arguments: FieldTable::new(),
                leader: Some(2),
                group: QueueGroup::FromLog,
                voters: Some(vec![2, 1]),
            },
            MetaOp::DeclareQueue {
                vhost: "/".into(),
                name: ShortStr::from_static("placed"),
                arguments: FieldTable::new(),
                leader: None,
                group: QueueGroup::Fixed(u64::MAX >> 1),
                voters: None,
            },
            MetaOp::FeatureLevel { node: 3, level: 1 },
            MetaOp::ForgetNode { node: 3 },
            MetaOp::ChangeQueueMember {
                vhost: "/".into(),
                name: ShortStr::from_static("placed"),
                group: 9,
                node: 4,
                add: true,
            },
            MetaOp::ChangeQueueMember {
                vhost: "/".into(),
                name: ShortStr::from_static("placed"),
                group: 9,
                node: 1,
                add: false,
            },
            MetaOp::AddNode {
                node: 5,
                addr: "n5.example:7705".into(),
                level: 2,
            },
            MetaOp::DeclareQueue {
                vhost: "/".into(),
                name: ShortStr::from_static("placed"),
                arguments: FieldTable::new(),
                leader: Some(1),
                group: QueueGroup::ByName,
                voters: None,
            },
            MetaOp::DeleteQueue {
                vhost: "/".into(),
                name: ShortStr::from_static("placed"),
                group: Some(7),
            },
            MetaOp::PutVhost {
                name: "staging".into(),
                meta: Some(VhostMeta::default()),
            },
            MetaOp::PutVhost {
                name: "billing".into(),
                meta: Some(VhostMeta {
                    description: "invoices".into(),
                    tags: vec!["eu".into(), "prod".into()],
                    default_queue_type: Some(crate::QueueType::Quorum),
                }),
            },
        ]
    }

    #[test]
    fn every_operation_reads_back_as_written() {
        let ops: Vec<(u64, MetaOp)> = (9..).zip(every_op()).collect();
        let data = Bytes::from(encode_entry(5, 2, &ops));
        let entry = decode_entry(&data).expect("entry");
        assert_eq!(
            entry,
            Entry {
                origin: 2,
                seq: 9,
                numbered: true,
                ops
            }
        );
    }

    #[test]
    fn a_first_format_entry_is_one_unnumbered_operation() {
        // As the first version wrote a queue's declaration.
        let mut t = FieldTable::new();
        t.insert("op", FieldValue::long_str("delete_queue"));
        t.insert("vhost", FieldValue::long_str("/"));
        t.insert("name", FieldValue::long_str("jobs"));
        let mut out = BytesMut::new();
        out.put_u64(1);
        out.put_u64(3);
        out.put_u64(1);
        t.encode(&mut out);
        let entry = decode_entry(&out.freeze()).expect("entry");
        assert!(!entry.numbered);
        assert_eq!(entry.origin, 3);
        assert_eq!(
            entry.ops,
            vec![(
                0,
                MetaOp::DeleteQueue {
                    vhost: "/".into(),
                    name: ShortStr::from_static("jobs"),
                    group: None,
                }
            )]
        );
    }

    #[test]
    fn garbage_and_unknown_operations_are_refused() {
        let ops: Vec<(u64, MetaOp)> = (1..).zip(every_op()).collect();
        let data = Bytes::from(encode_entry(5, 2, &ops));
        assert_eq!(decode_entry(&data.slice(..HEAD - 1)), None);
        assert_eq!(decode_entry(&data.slice(..HEAD + 3)), None);
        let mut t = FieldTable::new();
        t.insert("op", FieldValue::long_str("rename_universe"));
        let mut out = BytesMut::new();
        out.put_bytes(0, HEAD);
        t.encode(&mut out);
        assert_eq!(decode_entry(&out.freeze()), None);
    }

    #[test]
    fn operations_on_one_object_share_its_key_and_others_do_not() {
        let ops = every_op();
        // A queue's declaration, deletion and change of arguments.
        assert_eq!(ops[0].object(), ops[1].object());
        assert_eq!(ops[0].object(), ops[2].object());
        assert_eq!(ops[3].object(), ops[4].object());
        assert_ne!(ops[5].object(), ops[6].object());
        assert_eq!(ops[9].object(), ops[11].object());
        assert_ne!(ops[15].object(), ops[16].object());
        assert_ne!(ops[0].object(), ops[3].object());
    }

    #[test]
    fn only_what_older_versions_cannot_read_travels_alone() {
        let alone: Vec<bool> = every_op().iter().map(MetaOp::travels_alone).collect();
        let want: Vec<bool> = every_op()
            .iter()
            .map(|op| {
                matches!(
                    op,
                    MetaOp::SetQueueArguments { .. }
                        | MetaOp::ChangeQueueMember { .. }
                        | MetaOp::Rebalance
                        | MetaOp::FeatureLevel { .. }
                        | MetaOp::ForgetNode { .. }
                        | MetaOp::AddNode { .. }
                )
            })
            .collect();
        assert_eq!(alone, want);
        assert_eq!(alone.iter().filter(|a| **a).count(), 7);
    }
}
