//! Continuous membership reconciliation, as RabbitMQ 3.13's (`quorum_membership_reconciliation_*`):
//! off unless configured. Each node looks at the quorum queues it leads, and one with fewer
//! voters than its target size gets one more from the running nodes (never one in
//! maintenance mode), through the metadata log as `add_member` does. Warren's other nodes
//! already hold such a queue as learners, so the new voter has the log and votes at once.
//!
//! A queue's target is the largest of the configured size, the policy key
//! `target-group-size` and the argument `x-quorum-target-group-size`; none of them, no
//! growth. As RabbitMQ, a queue grows to an odd size (from an even size by one, from an odd
//! one only when two nodes can join), and only while all its voters run. RabbitMQ's
//! `auto_remove` has no setting here: `forget_cluster_node` always takes the forgotten node
//! off every queue.

use super::Broker;
use super::QueueId;
use crate::policy::PolicyValue;
use crate::replica::NodeId;

/// How a node reconciles its queues' members.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reconciliation {
    /// The size every quorum queue grows to (`None`: only those whose policy or argument
    /// asks for one).
    pub target_group_size: Option<usize>,
    /// Time between two looks with nothing to do (ms).
    pub interval_ms: u64,
    /// Time from a change that may call for one (a node up or down, a queue made, a policy
    /// set) to the next look, and between looks while queues grow (ms).
    pub trigger_interval_ms: u64,
}

impl Default for Reconciliation {
    /// RabbitMQ's defaults: an hour, and 10 s after a change.
    fn default() -> Self {
        Reconciliation {
            target_group_size: None,
            interval_ms: 3_600_000,
            trigger_interval_ms: 10_000,
        }
    }
}

/// How long a look waits for the voter it asked for a queue before it asks again (the
/// metadata log may be slow, or have lost the change with its leader).
const ASKED_WAIT_MS: u64 = 60_000;

/// The argument and the policy key of a queue's target size.
const TARGET_ARG: &str = "x-quorum-target-group-size";
const TARGET_KEY: &str = "target-group-size";

impl Broker {
    /// Turns reconciliation on with `config` (`None`: off, the default).
    pub fn set_membership_reconciliation(&mut self, config: Option<Reconciliation>) {
        let now = self.now_ms;
        if let Some(c) = self.cluster.as_mut() {
            c.reconcile = config;
            c.reconcile_at = config.map_or(u64::MAX, |r| now.saturating_add(r.interval_ms));
        }
    }

    /// Something changed that may leave a queue short of its target: the next look comes
    /// within the trigger interval.
    pub(super) fn reconcile_soon(&mut self) {
        let now = self.now_ms;
        if let Some(c) = self.cluster.as_mut() {
            if let Some(r) = c.reconcile {
                c.reconcile_at = c
                    .reconcile_at
                    .min(now.saturating_add(r.trigger_interval_ms));
            }
        }
    }

    /// When the next look is due (for the driver's timer).
    pub(super) fn reconcile_deadline(&self) -> Option<u64> {
        let c = self.cluster.as_ref()?;
        c.reconcile.map(|_| c.reconcile_at)
    }

    /// Looks at the queues this node leads once the time has come: each short of its target
    /// gets one voter more.
    pub(super) fn reconcile_members(&mut self) {
        let now = self.now_ms;
        let Some((config, at)) = self
            .cluster
            .as_ref()
            .and_then(|c| Some((c.reconcile?, c.reconcile_at)))
        else {
            return;
        };
        if now < at {
            return;
        }
        // Not now (in maintenance mode, or before every node's level is known): soon again.
        let skipped = self.is_draining() || self.members_changeable().is_err();
        let grown = if skipped {
            0
        } else {
            self.grow_short_queues(config.target_group_size)
        };
        let next = if grown > 0 || skipped {
            config.trigger_interval_ms
        } else {
            config.interval_ms
        };
        if let Some(c) = self.cluster.as_mut() {
            c.reconcile_at = now.saturating_add(next);
        }
    }

    /// One voter more for each queue led here below its target; how many grew, or still wait
    /// for the voter asked for them.
    fn grow_short_queues(&mut self, configured: Option<usize>) -> usize {
        let nodes = self.sorted_nodes();
        let Some(me) = self.cluster_node() else {
            return 0;
        };
        let up =
            |b: &Broker, n: NodeId| n == me || b.cluster.as_ref().is_some_and(|c| c.is_running(n));
        let now = self.now_ms;
        let mut waiting = 0;
        let mut grow: Vec<(QueueId, usize, String, String, NodeId)> = Vec::new();
        let mut ids: Vec<_> = self.queues.keys().copied().collect();
        ids.sort();
        for id in ids {
            if !self.acts_here(id) {
                continue;
            }
            let Some(q) = self.queues.get(&id) else {
                continue;
            };
            let Some(r) = q.replica.as_ref() else {
                continue;
            };
            let policy = self.queue_policy_definition(id);
            let target = [
                configured,
                q.arguments
                    .get(TARGET_ARG)
                    .and_then(|v| v.as_i64())
                    .and_then(|n| usize::try_from(n).ok()),
                match policy.get(TARGET_KEY) {
                    Some(PolicyValue::Int(n)) => usize::try_from(*n).ok(),
                    _ => None,
                },
            ]
            .into_iter()
            .flatten()
            .max()
            .unwrap_or(0);
            let voters = super::voters_in(r.voters.as_deref(), &nodes);
            if voters.len() >= target {
                continue;
            }
            let asked = self
                .cluster
                .as_ref()
                .and_then(|c| c.reconcile_asked.get(&id).copied());
            if asked.is_some_and(|(len, at)| {
                len == voters.len() && now.saturating_sub(at) < ASKED_WAIT_MS
            }) {
                // The voter this node asked for is not in yet (the metadata log is slow):
                // asked again only once the wait is over.
                waiting += 1;
                continue;
            }
            // Growing needs every voter up (a change waits for a voter that is down).
            if !voters.iter().all(|n| up(self, *n)) {
                continue;
            }
            let candidates: Vec<NodeId> = nodes
                .iter()
                .copied()
                .filter(|n| !voters.contains(n) && up(self, *n) && !self.node_draining(*n))
                .collect();
            // To an odd size: an even one grows by one, an odd one only with two to come.
            let room = if voters.len().is_multiple_of(2) { 1 } else { 2 };
            if candidates.len() < room {
                continue;
            }
            // The node after this one in number order, as placement picks the next voter.
            let pick = candidates
                .iter()
                .copied()
                .find(|n| *n > me)
                .or_else(|| candidates.first().copied());
            if let Some(node) = pick {
                grow.push((id, voters.len(), q.vhost.clone(), q.name.to_string(), node));
            }
        }
        let mut grown = waiting;
        if let Some(c) = self.cluster.as_mut() {
            // What was asked for queues that are gone, or grew since, is forgotten.
            let queues = &self.queues;
            c.reconcile_asked.retain(|id, (len, _)| {
                queues
                    .get(id)
                    .and_then(|q| q.replica.as_ref())
                    .is_some_and(|r| super::voters_in(r.voters.as_deref(), &nodes).len() == *len)
            });
        }
        for (id, len, vhost, name, node) in grow {
            match self.change_queue_member(&vhost, &name, node, true) {
                Ok(_) => {
                    if let Some(c) = self.cluster.as_mut() {
                        c.reconcile_asked.insert(id, (len, now));
                    }
                    tracing::info!(%vhost, queue = %name, node, "quorum queue below its target size: a member added");
                    grown += 1;
                }
                Err(error) => {
                    tracing::warn!(%vhost, queue = %name, node, %error, "quorum queue below its target size: no member added");
                }
            }
        }
        grown
    }
}
