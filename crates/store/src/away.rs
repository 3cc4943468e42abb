//! Where a deep replicated queue's member keeps the contents of messages that left its memory
//! (the broker's [`AwayStore`]): the scratch area, under a prefix of their own, written without
//! the write-ahead log or an fsync. The queue's Raft log stays the durable record: a restart
//! rebuilds the machine from its snapshot and log, with every message in memory, and the
//! scratch area of the previous run is dropped at start.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::BytesMut;
use rocksdb::WriteOptions;
use warren_broker::{AwayStore, Message};

use crate::{codec, Store, StoreError, CF_SPILL};

/// Released keys are deleted this many at a time (one unlogged write each).
const DELETE_BATCH: usize = 256;

pub struct StoreAway {
    store: Arc<Store>,
    next: AtomicU64,
    /// Keys whose last handle dropped, not deleted yet.
    released: Mutex<Vec<u64>>,
    /// Records written and not released: what the node holds away.
    live: AtomicU64,
}

impl StoreAway {
    pub fn new(store: Arc<Store>) -> Self {
        StoreAway {
            store,
            next: AtomicU64::new(0),
            released: Mutex::new(Vec::new()),
            live: AtomicU64::new(0),
        }
    }

    fn unlogged() -> WriteOptions {
        let mut w = WriteOptions::default();
        w.disable_wal(true);
        w
    }

    /// Deletes the released records (a failure only leaves them until the next start).
    pub fn flush(&self) {
        let keys = match self.released.lock() {
            Ok(mut r) => std::mem::take(&mut *r),
            Err(_) => return,
        };
        if keys.is_empty() {
            return;
        }
        let Ok(cf) = self.store.cf(CF_SPILL) else {
            return;
        };
        let mut wb = rocksdb::WriteBatch::default();
        for key in &keys {
            wb.delete_cf(cf, codec::body_key_in(Some(codec::SPILL_AWAY), *key));
        }
        if let Err(error) = self.store.db.write_opt(wb, &Self::unlogged()) {
            tracing::warn!(%error, keys = keys.len(), "deleting the contents of messages that left memory failed; they stay until the next start");
        }
    }

    fn read(&self, key: u64) -> Result<Option<Message>, StoreError> {
        let cf = self.store.cf(CF_SPILL)?;
        let k = codec::body_key_in(Some(codec::SPILL_AWAY), key);
        match self.store.db.get_cf(cf, k).map_err(StoreError::Read)? {
            None => Ok(None),
            Some(v) => codec::decode_body(key, v).map(|(m, _)| Some(m)),
        }
    }
}

impl AwayStore for StoreAway {
    fn next_key(&self) -> u64 {
        self.next.fetch_add(1, Ordering::Relaxed) + 1
    }

    fn put(&self, items: &[(u64, &Message)]) -> Result<(), String> {
        let cf = self.store.cf(CF_SPILL).map_err(|e| e.to_string())?;
        let mut wb = rocksdb::WriteBatch::default();
        let mut value = BytesMut::new();
        for (key, m) in items {
            codec::body_value_into(&mut value, m, 1);
            wb.put_cf(
                cf,
                codec::body_key_in(Some(codec::SPILL_AWAY), *key),
                &value,
            );
        }
        self.store
            .db
            .write_opt(wb, &Self::unlogged())
            .map_err(|e| e.to_string())?;
        self.live.fetch_add(items.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    fn get(&self, key: u64) -> Result<Option<Message>, String> {
        self.read(key).map_err(|e| e.to_string())
    }

    fn held(&self) -> u64 {
        self.live.load(Ordering::Relaxed)
    }

    fn release(&self, key: u64) {
        self.live.fetch_sub(1, Ordering::Relaxed);
        let full = match self.released.lock() {
            Ok(mut r) => {
                r.push(key);
                r.len() >= DELETE_BATCH
            }
            Err(_) => false,
        };
        if full {
            self.flush();
        }
    }
}
