//! The store thread: writes the node's batches to RocksDB (group commit) and reports them
//! written, which releases the publisher confirms waiting for them.
//!
//! RocksDB calls block, so they run on a thread of their own, never on the tokio runtime.
//! While one synced write is in progress, the batches made meanwhile queue up and go together
//! in the next: one fsync covers every connection and queue that wrote in that time.
//!
//! A write that fails is kept and tried again (see `GroupCommit`): meanwhile every publish
//! waiting for the disk is nacked as soon as its batch arrives, the store reports itself
//! failing (the server raises the disk alarm, which blocks publishers), and a stop does not
//! wait for a disk that may never come back: what is not written was not confirmed.

use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use warren_broker::WriteBatch;
use warren_store::{GroupCommit, Outcome, Store};

/// How long a failed write waits before it is tried again.
const RETRY_AFTER: Duration = Duration::from_millis(500);
/// How often a store that keeps failing says so again in the log.
const REMIND_EVERY: Duration = Duration::from_secs(30);
/// How long a stop waits for the last writes before it gives up on them.
const FINISH_WAIT: Duration = Duration::from_secs(10);

/// What the store thread tells the server.
pub trait StoreEvents: Send + 'static {
    /// Batches up to `last` are written (`ok`), or the publishes waiting for them are to be
    /// nacked (their write failed, or joined a failing group).
    fn written(&self, last: u64, ok: bool);
    /// Writes started failing (true) or work again (false).
    fn failing(&self, on: bool);
}

pub struct StoreThread {
    pub tx: mpsc::Sender<WriteBatch>,
    /// The store, once the thread is done: `None` if writes were left unwritten.
    done: mpsc::Receiver<Option<Arc<Store>>>,
}

impl StoreThread {
    /// Starts the thread.
    pub fn spawn(store: Arc<Store>, events: impl StoreEvents) -> std::io::Result<StoreThread> {
        let (tx, rx) = mpsc::channel::<WriteBatch>();
        let (done_tx, done) = mpsc::channel();
        std::thread::Builder::new()
            .name("warren-store".into())
            .spawn(move || {
                let left = run(&store, &rx, &events);
                let _ = done_tx.send(left.then_some(store));
            })?;
        Ok(StoreThread { tx, done })
    }

    /// Waits (a bounded time) for the batches already sent to be written, then hands the store
    /// back; `None` if they could not all be written, so no clean stop may be recorded.
    pub fn finish(self) -> Option<Arc<Store>> {
        drop(self.tx);
        match self.done.recv_timeout(FINISH_WAIT) {
            Ok(store) => store,
            Err(_) => {
                tracing::error!(
                    waited_ms = FINISH_WAIT.as_millis() as u64,
                    "the last store writes did not finish: stopping without them (they were not confirmed)"
                );
                None
            }
        }
    }
}

/// The thread's loop; true if every batch was written when the senders went away.
fn run(store: &Store, rx: &mpsc::Receiver<WriteBatch>, events: &impl StoreEvents) -> bool {
    let mut commit = GroupCommit::default();
    // Set when the node stopped sending: one more try, then give up.
    let mut stopping = false;
    let mut failing_since: Option<Instant> = None;
    let mut reminded = Instant::now();
    let mut retry_at = Instant::now();
    loop {
        if commit.is_empty() {
            match rx.recv() {
                Ok(first) => {
                    commit.push(first);
                }
                Err(_) => return true,
            }
        } else if commit.failing() && !stopping {
            // Until the retry: take what arrives, and nack its publishes at once.
            loop {
                let wait = retry_at.saturating_duration_since(Instant::now());
                if wait.is_zero() {
                    break;
                }
                match rx.recv_timeout(wait) {
                    Ok(batch) => take(&mut commit, batch, events),
                    Err(mpsc::RecvTimeoutError::Timeout) => break,
                    Err(mpsc::RecvTimeoutError::Disconnected) => {
                        stopping = true;
                        break;
                    }
                }
            }
        }
        loop {
            match rx.try_recv() {
                Ok(batch) => take(&mut commit, batch, events),
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => {
                    stopping |= commit.failing();
                    break;
                }
            }
        }
        let started = Instant::now();
        match commit.write(store) {
            None => {}
            Some(Outcome::Written { last, recovered }) => {
                crate::metrics::STORE_WRITES.observe(started.elapsed());
                if recovered {
                    let since = failing_since.take().map(|t| t.elapsed().as_millis() as u64);
                    tracing::warn!(failed_for_ms = since, "store writes work again");
                    crate::metrics::STORE_FAILING
                        .store(false, std::sync::atomic::Ordering::Relaxed);
                    events.failing(false);
                }
                events.written(last, true);
            }
            Some(Outcome::Failed {
                last,
                error,
                nack,
                first,
            }) => {
                if first {
                    failing_since = Some(Instant::now());
                    reminded = Instant::now();
                    tracing::error!(
                        %error,
                        data_dir = %store.dir().display(),
                        "store write failed: publishes waiting for the disk are nacked and publishers blocked (disk alarm) until writes work again. A full disk recovers by itself once space is freed; after an I/O error RocksDB refuses every write until the broker is restarted (nothing confirmed is lost)"
                    );
                    crate::metrics::STORE_FAILING.store(true, std::sync::atomic::Ordering::Relaxed);
                    events.failing(true);
                } else if reminded.elapsed() >= REMIND_EVERY {
                    reminded = Instant::now();
                    tracing::error!(
                        %error,
                        failing_for_s = failing_since.map_or(0, |t| t.elapsed().as_secs()),
                        held_ops = commit.held_ops(),
                        "store writes still fail: if the disk has room and works, restart the broker"
                    );
                }
                if nack {
                    events.written(last, false);
                }
                if stopping {
                    tracing::error!(
                        %error,
                        held_ops = commit.held_ops(),
                        "stopping with store writes that failed: they were not confirmed, and the next start recovers what is on disk"
                    );
                    return false;
                }
                retry_at = Instant::now() + RETRY_AFTER;
            }
        }
    }
}

/// A batch joins the group; if writes are failing, its publishes are nacked now.
fn take(commit: &mut GroupCommit, batch: WriteBatch, events: &impl StoreEvents) {
    let number = batch.number;
    if commit.push(batch) {
        events.written(number, false);
    }
}

#[cfg(test)]
mod tests {
    //! Test code: unwraps are fine here.

    use std::sync::Mutex;

    use warren_broker::{Broker, BrokerConfig, DeclareQueue, Message, StoreOp};
    use warren_codec::{FieldTable, ShortStr};
    use warren_store::faults::Fault;

    use super::*;

    #[derive(Clone, Default)]
    struct Log(Arc<Mutex<Vec<String>>>);

    impl StoreEvents for Log {
        fn written(&self, last: u64, ok: bool) {
            self.0
                .lock()
                .unwrap()
                .push(format!("{}{last}", if ok { "ok" } else { "nack" }));
        }
        fn failing(&self, on: bool) {
            self.0.lock().unwrap().push(format!("failing {on}"));
        }
    }

    impl Log {
        fn wait_for(&self, what: &str) {
            let until = Instant::now() + Duration::from_secs(10);
            while Instant::now() < until {
                if self.0.lock().unwrap().iter().any(|e| e == what) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            panic!("no '{what}' in {:?}", self.0.lock().unwrap());
        }
    }

    fn publish(b: &mut Broker, body: &'static str) -> WriteBatch {
        let m = Message {
            exchange: ShortStr::empty(),
            routing_key: ShortStr::empty(),
            properties: bytes::Bytes::from_static(&[0x10, 0x00, 2]),
            body: bytes::Bytes::from_static(body.as_bytes()),
            persistent: true,
            store_key: None,
            away: None,
        };
        b.publish("/", "", "q", m, 0).unwrap();
        b.take_writes().unwrap()
    }

    #[test]
    fn a_failing_store_nacks_at_once_raises_the_alarm_holds_no_acked_bodies_and_stops_in_bounded_time(
    ) {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(Store::open(dir.path()).unwrap());
        let mut b = Broker::new(BrokerConfig {
            persistence: true,
            ..BrokerConfig::default()
        });
        let declare = DeclareQueue {
            name: ShortStr::from_static("q"),
            passive: false,
            durable: true,
            exclusive: false,
            auto_delete: false,
            arguments: FieldTable::new(),
        };
        b.declare_queue("/", declare, 1).unwrap();
        let log = Log::default();
        let held = Arc::new(Mutex::new(0usize));
        let seen = held.clone();
        let writes = log.clone();
        store.set_faults(move |batches| {
            writes.0.lock().unwrap().push("write".into());
            let bodies = batches
                .iter()
                .flat_map(|b| &b.ops)
                .filter(|op| matches!(op, StoreOp::PutBody { .. }))
                .count();
            *seen.lock().unwrap() = bodies;
            Fault::Fail
        });
        let t = StoreThread::spawn(store.clone(), log.clone()).unwrap();
        t.tx.send(b.take_writes().unwrap()).unwrap();
        log.wait_for("failing true");
        log.wait_for("nack1");
        // Published during the outage: nacked before any retry (which is 500 ms away).
        let w = publish(&mut b, "during");
        let n = w.number;
        let before = log.0.lock().unwrap().len();
        t.tx.send(w).unwrap();
        log.wait_for(&format!("nack{n}"));
        let after: Vec<String> = log.0.lock().unwrap()[before..].to_vec();
        assert_eq!(
            after[0],
            format!("nack{n}"),
            "nacked only after a retry: {after:?}"
        );
        // Consumed and acked during the outage: the held group lets its body go.
        for _ in 0..50 {
            let w = publish(&mut b, "acked");
            t.tx.send(w).unwrap();
            let (d, _) = b.get("/", "q", false, 1).unwrap().unwrap();
            assert!(b.settle(d.queue, d.receipt));
            t.tx.send(b.take_writes().unwrap()).unwrap();
        }
        std::thread::sleep(RETRY_AFTER * 3);
        let bodies = *held.lock().unwrap();
        assert!(bodies <= 2, "the failing group holds {bodies} bodies");
        // The disk comes back: everything is written, the alarm clears.
        store.clear_faults();
        let last = publish(&mut b, "after");
        let last_n = last.number;
        t.tx.send(last).unwrap();
        log.wait_for("failing false");
        log.wait_for(&format!("ok{last_n}"));
        // It fails again and the broker stops: the stop does not wait for the disk.
        store.set_faults(|_| Fault::Fail);
        t.tx.send(publish(&mut b, "never")).unwrap();
        std::thread::sleep(RETRY_AFTER / 5);
        let stopping = Instant::now();
        let (finished_tx, finished) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = finished_tx.send(t.finish().is_none());
        });
        let unwritten = finished
            .recv_timeout(FINISH_WAIT + Duration::from_secs(5))
            .expect("the store thread did not stop");
        assert!(
            unwritten,
            "a store with failed writes was handed back for a clean stop"
        );
        assert!(stopping.elapsed() < Duration::from_secs(5));
    }
}
