//! A deterministic 3-node cluster in one thread: simulated time, an in-process network that drops,
//! delays and partitions by a seeded RNG, crashes that lose unflushed writes.

use std::collections::{BTreeMap, BTreeSet};

use bytes::{Buf, BufMut, Bytes};

use crate::{
    Committed, Config, GroupId, LogStore, MemLog, MultiRaft, NodeBatch, NodeId, SnapshotMeta,
    StoredSnapshot,
};

pub const TICK_MS: u64 = 10;

/// SplitMix64: a seeded, dependency-free RNG so a failing seed replays exactly.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }
    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

pub struct SimNode {
    pub raft: MultiRaft,
    pub log: MemLog,
    /// Entries applied here, per group, in the order they were applied.
    pub applied: BTreeMap<GroupId, Vec<Committed>>,
    /// Each group's leader as `ReadyBatch::leaders` last reported it here.
    pub reported_leaders: BTreeMap<GroupId, Option<NodeId>>,
    /// How many leader changes `ReadyBatch::leaders` reported here.
    pub leader_reports: u64,
    pub alive: bool,
    pub boots: u64,
    /// Jobs submitted to the log but not yet written (asynchronous mode).
    pub pending: Vec<crate::PersistJob>,
    /// Proposals held during a leadership transfer and then refused (`ReadyBatch::refused`).
    pub refused: Vec<(GroupId, Vec<u8>, Option<NodeId>)>,
}

impl SimNode {
    /// A node with an empty log and no group.
    pub fn fresh(cfg: Config) -> SimNode {
        let log = MemLog::new();
        let mut raft = MultiRaft::new(cfg).expect("config");
        raft.set_snapshot_source(log.snapshots());
        // As a server's node: entries that leave memory (a group asleep drops all of them) are
        // read back from the log.
        raft.set_cold_log(log.cold());
        SimNode {
            raft,
            log,
            applied: BTreeMap::new(),
            reported_leaders: BTreeMap::new(),
            leader_reports: 0,
            alive: true,
            boots: 1,
            pending: Vec::new(),
            refused: Vec::new(),
        }
    }
}

struct InFlight {
    at: u64,
    seq: u64,
    batch: NodeBatch,
}

pub struct Sim {
    pub nodes: BTreeMap<NodeId, SimNode>,
    pub now_ms: u64,
    pub rng: Rng,
    pub drop_percent: u64,
    /// Drop only batches that carry Raft messages, never a bare liveness heartbeat.
    pub spare_heartbeats: bool,
    /// Extra delivery delay, in steps, drawn from `0..=max_delay`.
    pub max_delay: u64,
    /// Write the log asynchronously (`submit`/`on_persisted`), one step after `ready`.
    pub async_log: bool,
    /// Nodes cut off from the rest (both directions).
    pub isolated: BTreeSet<NodeId>,
    net: Vec<InFlight>,
    seq: u64,
    pub groups: Vec<GroupId>,
    /// Every (group, index, data) some node reported committed, with the durable logs checked.
    pub committed_ever: BTreeMap<(GroupId, u64), Committed>,
    /// Each node snapshots a group's state (the entries it applied) once this many entries
    /// were applied since its last snapshot; `None`: never.
    pub snapshot_every: Option<u64>,
    /// The cluster's list of nodes, every node's `Config::nodes`.
    pub list: Vec<NodeId>,
}

/// The sim's state machine, a group's applied entries, as snapshot bytes.
fn encode_applied(applied: &[Committed]) -> Bytes {
    let mut out = Vec::new();
    for c in applied {
        out.put_u64(c.index);
        out.put_u64(c.term);
        out.put_u32(c.data.len() as u32);
        out.put_slice(&c.data);
    }
    out.into()
}

fn decode_applied(group: GroupId, mut b: Bytes) -> Vec<Committed> {
    let mut out = Vec::new();
    while b.has_remaining() {
        let (index, term, len) = (b.get_u64(), b.get_u64(), b.get_u32() as usize);
        out.push(Committed {
            group,
            index,
            term,
            data: b.split_to(len),
        });
    }
    out
}

pub fn config(node: NodeId) -> Config {
    config_in(node, vec![1, 2, 3])
}

/// A node's configuration in a cluster whose list is `nodes`.
pub fn config_in(node: NodeId, nodes: Vec<NodeId>) -> Config {
    let mut c = Config::new(node, nodes);
    c.tick_ms = TICK_MS;
    c.log_keep = 1 << 20;
    // Taken only when a test snapshots (`Sim::snapshot_every`).
    c.snapshot_keep = 4;
    c
}

impl Sim {
    /// A cluster of nodes 1..=3 with `groups` groups; group g's first leader is node `g % 3 + 1`.
    pub fn new(seed: u64, groups: u64) -> Self {
        let mut nodes = BTreeMap::new();
        for id in 1..=3 {
            let mut node = SimNode::fresh(config(id));
            for g in 0..groups {
                node.raft
                    .add_group(GroupId(g), g % 3 + 1 == id)
                    .expect("group");
            }
            nodes.insert(id, node);
        }
        Sim {
            nodes,
            now_ms: 0,
            rng: Rng::new(seed),
            drop_percent: 0,
            spare_heartbeats: false,
            max_delay: 0,
            async_log: false,
            isolated: BTreeSet::new(),
            net: Vec::new(),
            seq: 0,
            groups: (0..groups).map(GroupId).collect(),
            committed_ever: BTreeMap::new(),
            snapshot_every: None,
            list: vec![1, 2, 3],
        }
    }

    /// Nodes `list` with no group: the test makes them.
    pub fn bare(seed: u64, list: Vec<NodeId>) -> Self {
        let mut sim = Sim::new(seed, 0);
        sim.nodes.clear();
        for id in &list {
            sim.nodes
                .insert(*id, SimNode::fresh(config_in(*id, list.clone())));
        }
        sim.list = list;
        sim
    }

    fn connected(&self, a: NodeId, b: NodeId) -> bool {
        self.isolated.contains(&a) == self.isolated.contains(&b)
    }

    /// One step: deliver due messages, tick every live node once, run one ready round on each.
    pub fn step(&mut self) {
        self.now_ms += TICK_MS;
        let now = self.now_ms;
        let mut due: Vec<InFlight> = Vec::new();
        let mut later = Vec::new();
        for m in self.net.drain(..) {
            if m.at <= now {
                due.push(m);
            } else {
                later.push(m);
            }
        }
        self.net = later;
        due.sort_by_key(|m| (m.at, m.seq));
        for m in due {
            if !self.connected(m.batch.from, m.batch.to) {
                continue;
            }
            if let Some(n) = self.nodes.get_mut(&m.batch.to) {
                if n.alive {
                    n.raft.step(m.batch);
                }
            }
        }
        let ids: Vec<NodeId> = self.nodes.keys().copied().collect();
        for id in ids {
            self.run_node(id, now);
        }
    }

    fn run_node(&mut self, id: NodeId, now: u64) {
        let Some(n) = self.nodes.get_mut(&id) else {
            return;
        };
        if !n.alive {
            return;
        }
        let mut out = Vec::new();
        // Asynchronous mode: what was submitted last step is written (one flush) only now.
        if !n.pending.is_empty() {
            let jobs = std::mem::take(&mut n.pending);
            let sync = jobs.iter().any(|j| j.must_sync());
            for j in &jobs {
                j.write(&mut n.log).expect("mem log");
                for (g, snap) in j.installed() {
                    n.applied.insert(g, decode_applied(g, snap.data.clone()));
                }
            }
            n.log.flush(sync).expect("mem log");
            for j in jobs {
                out.extend(n.raft.on_persisted(j));
            }
        }
        n.raft.tick(now);
        let mut batch = n.raft.ready();
        out.append(&mut batch.messages);
        n.leader_reports += batch.leaders.len() as u64;
        n.reported_leaders.extend(batch.leaders.drain(..));
        n.refused.append(&mut batch.refused);
        let wanted = std::mem::take(&mut batch.snapshots_wanted);
        let left: Vec<GroupId> = batch
            .members
            .drain(..)
            .filter(|(_, m)| !m.contains(id) && !m.is_empty())
            .map(|(g, _)| g)
            .collect();
        let committed = if self.async_log {
            let (committed, job) = n.raft.submit(batch);
            if !job.is_empty() {
                n.pending.push(job);
            }
            committed
        } else {
            batch.persist(&mut n.log).expect("mem log");
            let done = n.raft.advance(batch);
            out.extend(done.messages);
            for (g, snap) in done.snapshots {
                n.applied.insert(g, decode_applied(g, snap.data));
            }
            done.committed
        };
        for c in &committed {
            n.applied.entry(c.group).or_default().push(c.clone());
        }
        for g in wanted {
            // The state machine snapshots what it applied when its leader needs one.
            let Some(last) = n.applied.get(&g).and_then(|a| a.last()) else {
                continue;
            };
            let meta = n.raft.snapshot_covering(
                g,
                SnapshotMeta {
                    index: last.index,
                    term: last.term,
                },
            );
            let snap = StoredSnapshot {
                meta,
                data: encode_applied(&n.applied[&g]),
                members: n.raft.members_at(g, meta.index),
            };
            n.log.save_snapshot(g, &snap).expect("mem log");
            if let Some(bound) = n.raft.snapshot_saved(g, snap.meta) {
                n.log.compact_to(g, bound).expect("mem log");
            }
        }
        for g in left {
            // Removed from the group: it goes from this node, as a deleted queue's would.
            n.raft.remove_group(g);
            n.log.remove_group(g);
        }
        if let Some(every) = self.snapshot_every {
            for (g, applied) in &n.applied {
                let Some(last) = applied.last() else {
                    continue;
                };
                let taken = n.raft.snapshot_index(*g).unwrap_or(u64::MAX);
                if last.index < taken.saturating_add(every) {
                    continue;
                }
                let snap = StoredSnapshot {
                    meta: SnapshotMeta {
                        index: last.index,
                        term: last.term,
                    },
                    data: encode_applied(applied),
                    members: n.raft.members_at(*g, last.index),
                };
                n.log.save_snapshot(*g, &snap).expect("mem log");
                if let Some(bound) = n.raft.snapshot_saved(*g, snap.meta) {
                    n.log.compact_to(*g, bound).expect("mem log");
                }
            }
        }
        for c in committed {
            self.check_on_majority(&c);
            if let Some(prev) = self.committed_ever.get(&(c.group, c.index)) {
                assert_eq!(prev, &c, "two entries committed at one index");
            }
            self.committed_ever.insert((c.group, c.index), c);
        }
        for b in out {
            self.send(b);
        }
    }

    /// Raft's promise: an entry handed out as committed is durable on a majority.
    fn check_on_majority(&self, c: &Committed) {
        let holders = self
            .nodes
            .values()
            .filter(|n| {
                // In its log, or covered by its snapshot (the log before it may be gone).
                let g = n.log.recovered(c.group);
                g.snapshot.is_some_and(|s| s.meta.index >= c.index)
                    || g.entries
                        .iter()
                        .any(|e| e.index == c.index && e.term == c.term && e.data == c.data)
            })
            .count();
        assert!(
            holders >= 2,
            "{c:?} committed but durable on {holders} node(s)"
        );
    }

    fn send(&mut self, b: NodeBatch) {
        let spared = self.spare_heartbeats && b.msgs.is_empty();
        if !spared && self.rng.chance(self.drop_percent) {
            return;
        }
        let delay = 1 + self.rng.below(self.max_delay + 1);
        self.seq += 1;
        self.net.push(InFlight {
            at: self.now_ms + delay * TICK_MS,
            seq: self.seq,
            batch: b,
        });
    }

    pub fn run(&mut self, steps: u64) {
        for _ in 0..steps {
            self.step();
        }
    }

    /// Steps until every group has one leader that all live, connected members agree on.
    pub fn run_until_led(&mut self, max_steps: u64) -> Option<u64> {
        for i in 0..max_steps {
            if self.all_led() {
                return Some(i);
            }
            self.step();
        }
        self.all_led().then_some(max_steps)
    }

    pub fn all_led(&self) -> bool {
        let live: Vec<&SimNode> = self
            .nodes
            .values()
            .filter(|n| n.alive && !self.isolated.contains(&n.raft.node()))
            .collect();
        self.groups.iter().all(|g| {
            let leaders: BTreeSet<Option<NodeId>> =
                live.iter().map(|n| n.raft.leader_of(*g)).collect();
            match leaders.iter().next() {
                Some(Some(l)) if leaders.len() == 1 => live
                    .iter()
                    .any(|n| n.raft.node() == *l && n.raft.is_leader(*g)),
                _ => false,
            }
        })
    }

    pub fn leader(&self, g: GroupId) -> Option<NodeId> {
        self.nodes
            .values()
            .filter(|n| n.alive && !self.isolated.contains(&n.raft.node()))
            .find(|n| n.raft.is_leader(g))
            .map(|n| n.raft.node())
    }

    /// Proposes on the group's leader as a live node sees it; false if it has none.
    pub fn propose(&mut self, g: GroupId, data: Vec<u8>) -> bool {
        let Some(l) = self.leader(g) else {
            return false;
        };
        self.propose_on(l, g, data)
    }

    pub fn propose_on(&mut self, node: NodeId, g: GroupId, data: Vec<u8>) -> bool {
        self.nodes
            .get_mut(&node)
            .is_some_and(|n| n.raft.propose(g, data).is_ok())
    }

    pub fn awake_total(&self) -> usize {
        self.nodes
            .values()
            .filter(|n| n.alive)
            .map(|n| n.raft.awake_count())
            .sum()
    }

    /// Steps until no live node has an awake group.
    pub fn run_until_asleep(&mut self, max_steps: u64) -> Option<u64> {
        for i in 0..max_steps {
            if self.awake_total() == 0 {
                return Some(i);
            }
            self.step();
        }
        (self.awake_total() == 0).then_some(max_steps)
    }

    /// Stops a node: it runs no more, and what it appended but did not flush is lost.
    pub fn kill(&mut self, id: NodeId) {
        if let Some(n) = self.nodes.get_mut(&id) {
            n.alive = false;
            n.log.crash();
            n.pending.clear();
        }
    }

    /// Restarts a killed node from its durable log; its state machine replays from the start.
    pub fn restart(&mut self, id: NodeId) {
        let groups = self.groups.clone();
        let Some(n) = self.nodes.get_mut(&id) else {
            return;
        };
        let mut cfg = config_in(id, self.list.clone());
        cfg.boot = n.boots + 1;
        n.boots += 1;
        let mut raft = MultiRaft::new(cfg).expect("config");
        raft.set_snapshot_source(n.log.snapshots());
        // As a node does: committed entries stay in the log, read back as they are applied.
        raft.set_cold_log(n.log.cold());
        n.applied.clear();
        for g in groups {
            if !n.log.durable().contains_key(&g) && n.log.recovered(g).snapshot.is_none() {
                // Not a member of it here (never was, or left it).
                continue;
            }
            let mut durable = n.log.recovered(g);
            durable.unload_committed();
            if durable.fit_to_snapshot() {
                n.log
                    .clear_entries(g, &durable.hard_state)
                    .expect("mem log");
                n.log.flush(true).expect("mem log");
            }
            raft.recover_group(g, &durable).expect("recover");
            // The state machine starts from the snapshot; the entries after it replay.
            if let Some(s) = durable.snapshot {
                n.applied.insert(g, decode_applied(g, s.data));
            }
        }
        // The restarted node reads its time from zero again: its clock is its own.
        n.raft = raft;
        n.reported_leaders.clear();
        n.alive = true;
        let _ = n.log.flush(false);
    }

    pub fn raft_msgs_sent(&self) -> u64 {
        self.nodes
            .values()
            .map(|n| n.raft.stats().raft_msgs_sent)
            .sum()
    }

    pub fn node_heartbeats_sent(&self) -> u64 {
        self.nodes
            .values()
            .map(|n| n.raft.stats().node_heartbeats_sent)
            .sum()
    }

    pub fn group_ticks(&self) -> u64 {
        self.nodes
            .values()
            .map(|n| n.raft.stats().group_ticks)
            .sum()
    }

    /// Every committed entry is applied, in one order, on each given node.
    pub fn assert_applied_everywhere(&self, nodes: &[NodeId]) {
        for g in &self.groups {
            let expected: Vec<&Committed> = self
                .committed_ever
                .range((*g, 0)..=(*g, u64::MAX))
                .map(|(_, c)| c)
                .collect();
            for id in nodes {
                let got: Vec<&Committed> = self.nodes[id]
                    .applied
                    .get(g)
                    .map(|v| v.iter().collect())
                    .unwrap_or_default();
                assert_eq!(got, expected, "group {g:?} on node {id}");
            }
        }
    }
}
