//! The cluster's metadata group (group 0): where a replicated queue's declaration and deletion
//! reach every node.
//!
//! The node a client declares a replicated queue on declares it at once (the client gets its
//! declare-ok) and proposes the declaration to the metadata group; every other node declares the
//! queue when the entry commits, and the queue's own group is created on each. A node that was
//! down replays the group's log when it comes back, so it learns what was declared and deleted
//! meanwhile. An entry is `[now u64][origin node u64][origin seq u64]` and an AMQP field table
//! naming the operation, so that later versions can add operations and fields.
//!
//! Exchanges, bindings, users and policies are still each node's own; this group is where they
//! will go.

use super::*;
use crate::replica::NodeId;
use bytes::{Buf, BufMut, Bytes, BytesMut};

use super::replicated::Proposal;
use warren_replication::Committed;

/// The metadata group's number (a queue's group is never 0: see `group_of`).
pub const META_GROUP: u64 = 0;

/// What the metadata group's entries do.
#[derive(Clone, Debug, PartialEq)]
enum MetaOp {
    DeclareQueue {
        vhost: String,
        name: ShortStr,
        arguments: FieldTable,
    },
    DeleteQueue {
        vhost: String,
        name: ShortStr,
    },
}

/// The broker's part in the metadata group.
#[derive(Debug, Default)]
pub(crate) struct MetaState {
    /// Who leads the metadata group.
    leader: Option<NodeId>,
    /// Entries made while no leader was known, sent once one is.
    pending: Vec<Vec<u8>>,
    next_seq: u64,
    /// Groups to create (with whether this node stands for their leader) and to remove, for
    /// the driver.
    pub(super) new_groups: Vec<(u64, bool)>,
    pub(super) removed_groups: Vec<u64>,
}

const HEAD: usize = 24;

fn encode_op(now_ms: u64, node: NodeId, seq: u64, op: &MetaOp) -> Vec<u8> {
    let mut t = FieldTable::new();
    match op {
        MetaOp::DeclareQueue {
            vhost,
            name,
            arguments,
        } => {
            t.insert("op", FieldValue::long_str("declare_queue"));
            t.insert("vhost", FieldValue::long_str(vhost));
            t.insert("name", FieldValue::long_str(name.as_str()));
            t.insert("arguments", FieldValue::Table(arguments.detached()));
        }
        MetaOp::DeleteQueue { vhost, name } => {
            t.insert("op", FieldValue::long_str("delete_queue"));
            t.insert("vhost", FieldValue::long_str(vhost));
            t.insert("name", FieldValue::long_str(name.as_str()));
        }
    }
    let mut out = BytesMut::with_capacity(64);
    out.put_u64(now_ms);
    out.put_u64(node);
    out.put_u64(seq);
    t.encode(&mut out);
    out.to_vec()
}

fn decode_op(data: &Bytes) -> Option<(NodeId, MetaOp)> {
    let mut b = data.clone();
    if b.len() < HEAD {
        return None;
    }
    let _now = b.get_u64();
    let node = b.get_u64();
    let _seq = b.get_u64();
    let t = FieldTable::decode(&mut b).ok()?;
    let text = |k: &str| t.get(k).and_then(|v| v.as_str()).map(str::to_owned);
    let vhost = text("vhost")?;
    let name = ShortStr::from_string(text("name")?);
    let op = match text("op")?.as_str() {
        "declare_queue" => MetaOp::DeclareQueue {
            vhost,
            name,
            arguments: t.get("arguments")?.as_table()?.clone(),
        },
        "delete_queue" => MetaOp::DeleteQueue { vhost, name },
        _ => return None,
    };
    Some((node, op))
}

impl Broker {
    /// A replicated queue was declared by a client here: every node is told.
    pub(super) fn announce_declare(
        &mut self,
        vhost: &str,
        name: &ShortStr,
        arguments: &FieldTable,
    ) {
        self.announce(MetaOp::DeclareQueue {
            vhost: vhost.to_owned(),
            name: name.clone(),
            arguments: arguments.detached(),
        });
    }

    /// A replicated queue was deleted by a client here.
    pub(super) fn announce_delete(&mut self, vhost: &str, name: &ShortStr) {
        self.announce(MetaOp::DeleteQueue {
            vhost: vhost.to_owned(),
            name: name.clone(),
        });
    }

    fn announce(&mut self, op: MetaOp) {
        let now = self.now_ms;
        let Some(c) = self.cluster.as_mut() else {
            return;
        };
        let node = c.node();
        c.meta.next_seq += 1;
        let data = encode_op(now, node, c.meta.next_seq, &op);
        match c.meta.leader {
            Some(leader) => c.push(Proposal {
                group: META_GROUP,
                data,
                to: (leader != node).then_some(leader),
            }),
            None => c.meta.pending.push(data),
        }
    }

    /// The metadata group's leader changed: what waited for one goes to it.
    pub(super) fn set_meta_leader(&mut self, leader: Option<NodeId>) {
        let Some(c) = self.cluster.as_mut() else {
            return;
        };
        c.meta.leader = leader;
        let Some(leader) = leader else {
            return;
        };
        let node = c.node();
        for data in std::mem::take(&mut c.meta.pending) {
            c.push(Proposal {
                group: META_GROUP,
                data,
                to: (leader != node).then_some(leader),
            });
        }
    }

    /// A metadata entry another node sent this node, which it leads the group for.
    pub(super) fn forwarded_meta(&mut self, data: &[u8]) {
        let Some(c) = self.cluster.as_mut() else {
            return;
        };
        if c.meta.leader != Some(c.node()) {
            // The sender hears of the new leader and its entry is lost: a declaration not
            // announced reaches the other nodes when a client declares the queue there.
            tracing::info!("metadata entry for a group this node no longer leads: dropped");
            return;
        }
        c.push(Proposal {
            group: META_GROUP,
            data: data.to_vec(),
            to: None,
        });
    }

    /// A committed metadata entry: applied here unless this node made it (it did already).
    pub(super) fn apply_meta(&mut self, e: &Committed) {
        let Some((origin, op)) = decode_op(&e.data) else {
            tracing::error!(index = e.index, "unreadable metadata entry skipped");
            return;
        };
        if self.cluster_node() == Some(origin) {
            return;
        }
        match op {
            MetaOp::DeclareQueue {
                vhost,
                name,
                arguments,
            } => {
                if self.queue_id(&vhost, &name).is_some() {
                    return;
                }
                if !self.vhosts.contains_key(&vhost) {
                    tracing::warn!(%vhost, queue = %name, "replicated queue of a vhost this node lacks: not declared here");
                    return;
                }
                let req = DeclareQueue {
                    name: name.clone(),
                    passive: false,
                    durable: true,
                    exclusive: false,
                    auto_delete: false,
                    arguments,
                };
                // As recovery declares: the origin checked names, limits and permissions.
                self.restoring = true;
                let declared = self.declare_queue(&vhost, req, 0);
                self.restoring = false;
                if let Err(error) = declared {
                    tracing::warn!(%vhost, queue = %name, %error, "replicated queue not declared here");
                }
            }
            MetaOp::DeleteQueue { vhost, name } => {
                let Some(id) = self.queue_id(&vhost, &name) else {
                    return;
                };
                if self.replica_group(id).is_none() {
                    return;
                }
                self.restoring = true;
                let deleted = self.remove_queue(id);
                self.restoring = false;
                if let (Some(deleted), Some(c)) = (deleted, self.cluster.as_mut()) {
                    c.push_cancelled(deleted.cancelled);
                }
            }
        }
    }

    /// This node's number, every node's, and who leads the metadata group (`None`: not in a
    /// cluster).
    pub fn cluster_view(&self) -> Option<(NodeId, Vec<NodeId>, Option<NodeId>)> {
        let c = self.cluster.as_ref()?;
        Some((c.node(), c.nodes().to_vec(), c.meta.leader))
    }

    /// Groups to create (and whether this node stands for leader) and to remove since the last
    /// call: the driver adds them to, and removes them from, its Raft node.
    pub fn take_group_changes(&mut self) -> (Vec<(u64, bool)>, Vec<u64>) {
        match self.cluster.as_mut() {
            Some(c) => (
                std::mem::take(&mut c.meta.new_groups),
                std::mem::take(&mut c.meta.removed_groups),
            ),
            None => (Vec::new(), Vec::new()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_metadata_entry_reads_back_and_garbage_is_refused() {
        let mut arguments = FieldTable::new();
        arguments.insert("x-queue-type", FieldValue::long_str("quorum"));
        let op = MetaOp::DeclareQueue {
            vhost: "/".into(),
            name: ShortStr::from_static("jobs"),
            arguments,
        };
        let data = Bytes::from(encode_op(5, 2, 9, &op));
        assert_eq!(decode_op(&data), Some((2, op)));
        assert_eq!(decode_op(&data.slice(..HEAD - 1)), None);
        assert_eq!(decode_op(&data.slice(..HEAD + 3)), None);
    }
}
