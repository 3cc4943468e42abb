//! Changing a quorum queue's voters after its declaration, as RabbitMQ's `rabbitmq-queues
//! add_member` and `delete_member` do (and `grow` and `shrink`, which the API runs queue by
//! queue). A node taken off a queue's voters keeps the queue as a learner, as every node not
//! among them does (see `MultiRaft::set_group_voters`); one added votes once it has the log.

use warren_codec::ShortStr;

use super::metadata_group::GROUP_VOTERS_LEVEL;
use super::metadata_ops::MetaOp;
use super::Broker;
use crate::replica::NodeId;

/// Why a queue's voters could not change.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MemberError {
    #[error("this node is not in a cluster")]
    NotClustered,
    #[error(
        "a node of the cluster runs a version that cannot keep a queue's members (cluster feature level {level}, {needs} needed): upgrade every node first"
    )]
    ClusterTooOld { level: u64, needs: u64 },
    #[error("no queue '{name}' in vhost '{vhost}'")]
    NoQueue { vhost: String, name: String },
    #[error("queue '{name}' in vhost '{vhost}' is not a quorum queue")]
    NotQuorum { vhost: String, name: String },
    #[error("node {0} is not a node of the cluster")]
    UnknownNode(NodeId),
    #[error("node {node} is the last member of queue '{name}' in vhost '{vhost}'")]
    LastMember {
        vhost: String,
        name: String,
        node: NodeId,
    },
}

impl Broker {
    /// Whether this node may change quorum queues' members: in a cluster whose every node
    /// keeps them.
    pub fn members_changeable(&self) -> Result<(), MemberError> {
        if self.cluster.is_none() {
            return Err(MemberError::NotClustered);
        }
        let level = self.cluster_feature_level().unwrap_or(0);
        if level < GROUP_VOTERS_LEVEL {
            return Err(MemberError::ClusterTooOld {
                level,
                needs: GROUP_VOTERS_LEVEL,
            });
        }
        Ok(())
    }

    /// Adds `node` to the voters of quorum queue `name` (`add`), or takes it off them.
    /// Whether anything changes: adding a voter or taking off a node that is not one changes
    /// nothing, as RabbitMQ's commands are safe to repeat. The change is the cluster's: every
    /// node applies it when the metadata log has it (this one too), and the queue's leader
    /// then moves its group to it.
    pub fn change_queue_member(
        &mut self,
        vhost: &str,
        name: &str,
        node: NodeId,
        add: bool,
    ) -> Result<bool, MemberError> {
        self.members_changeable()?;
        let nodes = self.sorted_nodes();
        if !nodes.contains(&node) {
            return Err(MemberError::UnknownNode(node));
        }
        let q = self
            .queue_id(vhost, name)
            .and_then(|id| self.queues.get(&id))
            .ok_or_else(|| MemberError::NoQueue {
                vhost: vhost.to_owned(),
                name: name.to_owned(),
            })?;
        let r = q.replica.as_ref().ok_or_else(|| MemberError::NotQuorum {
            vhost: vhost.to_owned(),
            name: name.to_owned(),
        })?;
        let group = r.group;
        let voters = voters_in(r.voters.as_deref(), &nodes);
        match (add, voters.contains(&node)) {
            (true, true) | (false, false) => return Ok(false),
            (false, true) if voters.len() == 1 => {
                return Err(MemberError::LastMember {
                    vhost: vhost.to_owned(),
                    name: name.to_owned(),
                    node,
                })
            }
            _ => {}
        }
        tracing::info!(%vhost, queue = %name, node, add, "quorum queue member change asked for");
        self.announce_by_log(MetaOp::ChangeQueueMember {
            vhost: vhost.to_owned(),
            name: ShortStr::from_string(name.to_owned()),
            group,
            node,
            add,
        });
        Ok(true)
    }

    pub(super) fn sorted_nodes(&self) -> Vec<NodeId> {
        let mut nodes = self
            .cluster
            .as_ref()
            .map(|c| c.nodes().to_vec())
            .unwrap_or_default();
        nodes.sort_unstable();
        nodes
    }

    /// The quorum queues (vhost, name) and their voters, every node of the cluster unless a
    /// queue has voters of its own; in order.
    pub fn quorum_queue_voters(&self) -> Vec<(String, ShortStr, Vec<NodeId>)> {
        let nodes = self.sorted_nodes();
        let mut out: Vec<(String, ShortStr, Vec<NodeId>)> = self
            .queues
            .values()
            .filter_map(|q| {
                let r = q.replica.as_ref()?;
                Some((
                    q.vhost.clone(),
                    q.name.clone(),
                    voters_in(r.voters.as_deref(), &nodes),
                ))
            })
            .collect();
        out.sort();
        out
    }

    /// A `change_queue_member` entry, applied by every node in the log's order to the voters
    /// the entries before gave: the queue of that group takes it (one of another group,
    /// declared again since, keeps its own); a change that would leave no voter is refused
    /// on every node alike.
    pub(super) fn apply_member_change(
        &mut self,
        vhost: &str,
        name: &str,
        group: u64,
        node: NodeId,
        add: bool,
    ) -> Option<String> {
        let id = self.queue_id(vhost, name)?;
        if self.replica_group(id) != Some(group) {
            return None;
        }
        let nodes = self.sorted_nodes();
        let mut voters = voters_in(self.replica_voters(id), &nodes);
        if add {
            if !nodes.contains(&node) {
                return Some(format!("node {node} is not a node of the cluster"));
            }
            voters.push(node);
            voters.sort_unstable();
            voters.dedup();
        } else {
            voters.retain(|n| *n != node);
            if voters.is_empty() {
                return Some(format!(
                    "node {node} is the last member of queue '{name}' in vhost '{vhost}'"
                ));
            }
        }
        // Every node of the cluster: no voters of its own (a node added later votes too).
        let voters = (voters != nodes).then_some(voters);
        self.set_replica_voters(id, voters);
        None
    }
}

/// A queue's voters as Raft takes them: those of its own still in the cluster (sorted), else
/// every node of `nodes` (sorted).
pub fn voters_in(own: Option<&[NodeId]>, nodes: &[NodeId]) -> Vec<NodeId> {
    let mut voters: Vec<NodeId> = own
        .unwrap_or_default()
        .iter()
        .copied()
        .filter(|n| nodes.contains(n))
        .collect();
    voters.sort_unstable();
    voters.dedup();
    if voters.is_empty() {
        nodes.to_vec()
    } else {
        voters
    }
}
