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
    /// Adds `node` to the voters of quorum queue `name` (`add`), or takes it off them.
    /// Whether anything changed: adding a voter or taking off a node that is not one changes
    /// nothing, as RabbitMQ's commands are safe to repeat. The change is the cluster's: every
    /// node applies it from the metadata log, and the queue's leader moves its group to it.
    pub fn change_queue_member(
        &mut self,
        vhost: &str,
        name: &str,
        node: NodeId,
        add: bool,
    ) -> Result<bool, MemberError> {
        let Some(c) = self.cluster.as_ref() else {
            return Err(MemberError::NotClustered);
        };
        let level = self.cluster_feature_level().unwrap_or(0);
        if level < GROUP_VOTERS_LEVEL {
            return Err(MemberError::ClusterTooOld {
                level,
                needs: GROUP_VOTERS_LEVEL,
            });
        }
        if !c.nodes().contains(&node) {
            return Err(MemberError::UnknownNode(node));
        }
        let mut nodes = c.nodes().to_vec();
        nodes.sort_unstable();
        let (id, group, current) = {
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
            let mut current = r.voters.clone().unwrap_or_else(|| nodes.clone());
            current.retain(|n| nodes.contains(n));
            (q.id, r.group, current)
        };
        let mut voters = current.clone();
        if add {
            if voters.contains(&node) {
                return Ok(false);
            }
            voters.push(node);
        } else {
            if !voters.contains(&node) {
                return Ok(false);
            }
            if voters.len() == 1 {
                return Err(MemberError::LastMember {
                    vhost: vhost.to_owned(),
                    name: name.to_owned(),
                    node,
                });
            }
            voters.retain(|n| *n != node);
        }
        voters.sort_unstable();
        // Every node of the cluster: no voters of its own (a node added later votes too).
        let voters = (voters != nodes).then_some(voters);
        tracing::info!(%vhost, queue = %name, node, add, "quorum queue member change");
        self.set_replica_voters(id, voters.clone());
        self.announce(MetaOp::SetQueueVoters {
            vhost: vhost.to_owned(),
            name: ShortStr::from_string(name.to_owned()),
            group,
            voters,
        });
        Ok(true)
    }

    /// The quorum queues (vhost, name) and their voters, every node of the cluster unless a
    /// queue has voters of its own; in order.
    pub fn quorum_queue_voters(&self) -> Vec<(String, ShortStr, Vec<NodeId>)> {
        let Some(c) = self.cluster.as_ref() else {
            return Vec::new();
        };
        let mut nodes = c.nodes().to_vec();
        nodes.sort_unstable();
        let mut out: Vec<(String, ShortStr, Vec<NodeId>)> = self
            .queues
            .values()
            .filter_map(|q| {
                let r = q.replica.as_ref()?;
                let mut voters = r.voters.clone().unwrap_or_else(|| nodes.clone());
                voters.retain(|n| nodes.contains(n));
                voters.sort_unstable();
                Some((q.vhost.clone(), q.name.clone(), voters))
            })
            .collect();
        out.sort();
        out
    }

    /// A `set_queue_voters` entry: the queue of that group takes them (one of another group,
    /// declared again since, keeps its own).
    pub(super) fn apply_queue_voters(
        &mut self,
        vhost: &str,
        name: &str,
        group: u64,
        voters: Option<Vec<NodeId>>,
    ) -> Option<String> {
        let id = self.queue_id(vhost, name)?;
        if self.replica_group(id) != Some(group) {
            return None;
        }
        self.set_replica_voters(id, voters);
        None
    }
}
