//! Replication for Warren's queues: many Raft groups per node on tikv's raft-rs `RawNode`, driven
//! in batches by the caller (sans-IO), with one node-wide log write per batch and hibernation of
//! idle groups. See docs/design.md, "Replication: the spike and the choices".

pub mod batch;
pub mod engine;
pub mod multi;
pub mod queue;
pub mod snapshots;
pub mod storage;
pub mod wal;

#[cfg(test)]
mod tests;

pub use engine::EngineLog;
pub use multi::{
    Advanced, Committed, Config, Envelope, Error, Forward, GroupStatus, MemberChange, MultiRaft,
    NodeBatch, PersistJob, ReadyBatch, Refused, Stats,
};
pub use raft;
pub use snapshots::{
    map_file, Fetch, MemSnapshots, Members, SnapshotFiles, SnapshotMeta, SnapshotReader,
    SnapshotSource, StoredSnapshot,
};
pub use wal::{DurableGroup, FileLog, LogError, LogStore, MemLog, Unloaded};

/// A node of the cluster; also its Raft peer id in every group (never 0).
pub type NodeId = u64;

/// A Raft group (for now: one replicated queue).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GroupId(pub u64);
