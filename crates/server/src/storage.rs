//! The store thread: writes the node's batches to RocksDB (group commit) and reports them
//! written, which releases the publisher confirms waiting for them.
//!
//! RocksDB calls block, so they run on a thread of their own, never on the tokio runtime.
//! While one synced write is in progress, the batches made meanwhile queue up and go together
//! in the next: one fsync covers every connection and queue that wrote in that time.

use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;

use warren_broker::WriteBatch;
use warren_store::Store;

/// How long a failed write waits before it is tried again.
const RETRY_AFTER: std::time::Duration = std::time::Duration::from_millis(500);

pub struct StoreThread {
    pub tx: mpsc::Sender<WriteBatch>,
    handle: JoinHandle<Arc<Store>>,
}

impl StoreThread {
    /// Starts the thread; `written(last, ok)` is called after each group with the number of its
    /// last batch and whether the write succeeded.
    pub fn spawn(
        store: Arc<Store>,
        written: impl Fn(u64, bool) + Send + 'static,
    ) -> std::io::Result<StoreThread> {
        let (tx, rx) = mpsc::channel::<WriteBatch>();
        let handle = std::thread::Builder::new()
            .name("warren-store".into())
            .spawn(move || {
                let mut group: Vec<WriteBatch> = Vec::new();
                // The last batch whose waiting confirms were already nacked.
                let mut nacked = 0;
                // Ends when every sender is gone and the last batches are written.
                loop {
                    if group.is_empty() {
                        match rx.recv() {
                            Ok(first) => group.push(first),
                            Err(_) => break,
                        }
                    }
                    while let Ok(more) = rx.try_recv() {
                        group.push(more);
                    }
                    let last = group.last().map_or(0, |b| b.number);
                    let started = std::time::Instant::now();
                    match store.write(&group) {
                        Ok(()) => {
                            crate::metrics::STORE_WRITES.observe(started.elapsed());
                            group.clear();
                            written(last, true);
                        }
                        Err(e) => {
                            // The disk must not skip a write and apply the next (a lost delete
                            // would bring an acked message back): the group is kept and tried
                            // again, with what comes after it. Its publishers are nacked now
                            // rather than left waiting; a retry that succeeds makes their
                            // messages durable anyway (a nack promises nothing either way).
                            if last > nacked {
                                tracing::error!(error = %e, batches = group.len(), "store write failed: the publishes waiting for it are nacked; retrying");
                                written(last, false);
                                nacked = last;
                            }
                            std::thread::sleep(RETRY_AFTER);
                        }
                    }
                }
                store
            })?;
        Ok(StoreThread { tx, handle })
    }

    /// Waits for the batches already sent to be written, then hands the store back.
    pub fn finish(self) -> Option<Arc<Store>> {
        drop(self.tx);
        self.handle.join().ok()
    }
}
