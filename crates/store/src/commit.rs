//! The group commit's bookkeeping, apart from the thread that runs it: which batches wait,
//! which publishes were nacked, and what a write that keeps failing holds.
//!
//! A failed group is never skipped: applying the next one without it could drop a delete and
//! bring an acked message back (docs/design.md, "Storage"). So the group is kept and tried
//! again with whatever arrives meanwhile, and every batch that joins it is reported failed at
//! once (its publishers get their nack now, not after the next retry). While it is held, a
//! body put and deleted inside the group cancel out (a message published and acked during
//! the outage): what the group holds is bounded by the messages that are still live, and
//! with publishers blocked by the disk alarm that stops growing.

use std::collections::HashSet;

use warren_broker::{StoreOp, WriteBatch};

use crate::{Store, StoreError};

/// Batches waiting to be written, in order.
#[derive(Default)]
pub struct GroupCommit {
    group: Vec<WriteBatch>,
    /// The last batch already reported failed: its publishers were nacked.
    nacked: u64,
    /// The last write failed, and the group waits for a retry.
    failing: bool,
}

/// What one [`GroupCommit::write`] did.
#[derive(Debug)]
pub enum Outcome {
    /// Every batch up to `last` is written; `recovered` if writes had been failing.
    Written { last: u64, recovered: bool },
    /// The write failed and the group is kept. `nack`: batches up to `last` were not yet
    /// reported failed (their publishers are to be nacked now); `first`: writes were working
    /// until this one.
    Failed {
        last: u64,
        error: StoreError,
        nack: bool,
        first: bool,
    },
}

impl GroupCommit {
    /// Adds the next batch. Returns true if writes are failing, so the batch is already
    /// reported failed: its publishers are to be nacked now.
    pub fn push(&mut self, batch: WriteBatch) -> bool {
        let number = batch.number;
        self.group.push(batch);
        if self.failing && number > self.nacked {
            self.nacked = number;
            return true;
        }
        false
    }

    pub fn is_empty(&self) -> bool {
        self.group.is_empty()
    }

    /// The last write failed and the group waits to be tried again.
    pub fn failing(&self) -> bool {
        self.failing
    }

    /// How many ops wait (to bound and report what a failing store holds).
    pub fn held_ops(&self) -> usize {
        self.group.iter().map(|b| b.ops.len()).sum()
    }

    /// Writes every waiting batch as one group; `None` if nothing waits.
    pub fn write(&mut self, store: &Store) -> Option<Outcome> {
        let last = self.group.last()?.number;
        if self.failing {
            self.merge();
        }
        match store.write(&self.group) {
            Ok(()) => {
                self.group.clear();
                let recovered = std::mem::replace(&mut self.failing, false);
                Some(Outcome::Written { last, recovered })
            }
            Err(error) => {
                let first = !std::mem::replace(&mut self.failing, true);
                let nack = last > self.nacked;
                self.nacked = self.nacked.max(last);
                Some(Outcome::Failed {
                    last,
                    error,
                    nack,
                    first,
                })
            }
        }
    }

    /// Folds the held batches into one and drops what cancels out inside it: bodies and
    /// scheduled messages both put and deleted, entries both put and deleted (with no stored
    /// delivery count, whose delete must still be written). Writing the result has the same
    /// effect as writing the batches one by one.
    fn merge(&mut self) {
        let Some(last) = self.group.last().map(|b| b.number) else {
            return;
        };
        let sync = self.group.iter().any(|b| b.sync);
        let mut put_bodies = HashSet::new();
        let mut put_entries = HashSet::new();
        let mut put_delayed = HashSet::new();
        for op in self.group.iter().flat_map(|b| &b.ops) {
            match op {
                StoreOp::PutBody { key, .. } => {
                    put_bodies.insert(*key);
                }
                StoreOp::PutEntry { queue, msg_id, .. } => {
                    put_entries.insert((*queue, *msg_id));
                }
                StoreOp::PutDelayed { key, .. } => {
                    put_delayed.insert(*key);
                }
                _ => {}
            }
        }
        let mut gone_bodies = HashSet::new();
        let mut gone_entries = HashSet::new();
        let mut gone_delayed = HashSet::new();
        for op in self.group.iter().flat_map(|b| &b.ops) {
            match op {
                StoreOp::DeleteBody { key } if put_bodies.contains(key) => {
                    gone_bodies.insert(*key);
                }
                StoreOp::DeleteEntry {
                    queue,
                    msg_id,
                    count: false,
                } if put_entries.contains(&(*queue, *msg_id)) => {
                    gone_entries.insert((*queue, *msg_id));
                }
                StoreOp::DeleteDelayed { key } if put_delayed.contains(key) => {
                    gone_delayed.insert(*key);
                }
                _ => {}
            }
        }
        let ops = std::mem::take(&mut self.group)
            .into_iter()
            .flat_map(|b| b.ops)
            .filter(|op| match op {
                StoreOp::PutBody { key, .. } | StoreOp::DeleteBody { key } => {
                    !gone_bodies.contains(key)
                }
                StoreOp::PutEntry { queue, msg_id, .. }
                | StoreOp::DeleteEntry { queue, msg_id, .. } => {
                    !gone_entries.contains(&(*queue, *msg_id))
                }
                StoreOp::PutDelayed { key, .. } | StoreOp::DeleteDelayed { key } => {
                    !gone_delayed.contains(key)
                }
                _ => true,
            })
            .collect();
        self.group.push(WriteBatch {
            number: last,
            ops,
            sync,
        });
    }
}
