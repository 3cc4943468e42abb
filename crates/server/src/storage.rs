//! The store thread: writes the node's batches to RocksDB (group commit) and reports them
//! written, which releases the publisher confirms waiting for them.
//!
//! RocksDB calls block, so they run on a thread of their own, never on the tokio runtime.
//! While one synced write is in progress, the batches made meanwhile queue up and go together
//! in the next: one fsync covers every connection and queue that wrote in that time.

use std::sync::mpsc;
use std::thread::JoinHandle;

use warren_broker::WriteBatch;
use warren_store::Store;

pub struct StoreThread {
    pub tx: mpsc::Sender<WriteBatch>,
    handle: JoinHandle<Store>,
}

impl StoreThread {
    /// Starts the thread; `written(last, ok)` is called after each group with the number of its
    /// last batch and whether the write succeeded.
    pub fn spawn(
        store: Store,
        written: impl Fn(u64, bool) + Send + 'static,
    ) -> std::io::Result<StoreThread> {
        let (tx, rx) = mpsc::channel::<WriteBatch>();
        let handle = std::thread::Builder::new()
            .name("warren-store".into())
            .spawn(move || {
                let mut group = Vec::new();
                // Ends when every sender is gone and the last batches are written.
                while let Ok(first) = rx.recv() {
                    group.push(first);
                    while let Ok(more) = rx.try_recv() {
                        group.push(more);
                    }
                    let last = group.last().map_or(0, |b| b.number);
                    let ok = match store.write(&group) {
                        Ok(()) => true,
                        Err(e) => {
                            tracing::error!(error = %e, batches = group.len(), "store write failed: the publishes in it are nacked");
                            false
                        }
                    };
                    group.clear();
                    written(last, ok);
                }
                store
            })?;
        Ok(StoreThread { tx, handle })
    }

    /// Waits for the batches already sent to be written, then hands the store back.
    pub fn finish(self) -> Option<Store> {
        drop(self.tx);
        self.handle.join().ok()
    }
}
