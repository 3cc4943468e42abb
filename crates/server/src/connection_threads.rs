//! The threads client connections run on: each a current-thread tokio runtime of its own, and a
//! connection stays on the thread it was given when accepted (round robin).
//!
//! Why not the main runtime's work-stealing workers (measured in docs/benchmarks.md, "Threads
//! for connections"): there a socket made readable while both workers sleep wakes one through a
//! futex, and a task woken on one worker is often run on the other, so with many connections
//! each doing a little (a worker acking one message at a time) nearly every message paid one
//! or two futex wake-ups between the workers. A current-thread runtime sleeps in its own
//! `epoll_wait` and is woken by its sockets alone. Deliveries need no hand-over either way: the
//! thread that handles a publish writes the delivery to the consumer's socket itself
//! (`Writer::transmit` in driver.rs), whichever thread the consumer's connection lives on.
//! How many threads: [`ConnectionThreads::default_count`].

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::net::TcpStream;
use tokio::runtime::Handle;
use tokio::sync::oneshot;

/// The most connection threads a node starts (`--connection-threads`): far more than any
/// machine's cores; a mistyped count fails at start-up with a message instead of exhausting the
/// machine's threads.
pub const MAX_THREADS: usize = 1024;

/// How long a stopping thread lets its connections' tasks finish what they are writing.
const STOP_GRACE: Duration = Duration::from_millis(200);

/// How often a stopping thread looks whether its connections' tasks have ended.
const STOP_POLL: Duration = Duration::from_millis(5);

/// Where connections run: threads of their own, or the runtime that accepted them.
pub enum ConnectionThreads {
    /// `--connection-threads 0`: every connection is a task of the runtime that accepted it.
    Shared,
    Pinned {
        threads: Vec<Handle>,
        next: AtomicUsize,
        /// Dropped (with `self`, or in [`ConnectionThreads::stop`]) to stop the threads.
        stops: Vec<oneshot::Sender<()>>,
        /// Each thread's word that it has stopped.
        stopped: Vec<oneshot::Receiver<()>>,
    },
}

impl ConnectionThreads {
    /// Starts `count` threads (none for 0).
    pub fn start(count: usize) -> std::io::Result<Self> {
        if count == 0 {
            return Ok(Self::Shared);
        }
        let mut threads = Vec::with_capacity(count);
        let mut stops = Vec::with_capacity(count);
        let mut dones = Vec::with_capacity(count);
        for i in 0..count {
            let (stop, stopped) = oneshot::channel::<()>();
            let (done, finished) = oneshot::channel::<()>();
            let (started, handle) = std::sync::mpsc::sync_channel(1);
            // The runtime is built on its own thread: one dropped here, inside the caller's
            // runtime (a failed spawn drops the closure), would panic.
            std::thread::Builder::new()
                .name(format!("warren-conn-{i}"))
                .spawn(move || {
                    let runtime = match tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                    {
                        Ok(r) => r,
                        Err(e) => {
                            let _ = started.send(Err(e));
                            return;
                        }
                    };
                    if started.send(Ok(runtime.handle().clone())).is_err() {
                        return;
                    }
                    // Runs the connections' tasks until the server lets go of the sender, then
                    // until they end, for a little while: their writers may still hold the
                    // last close frames.
                    runtime.block_on(async {
                        let _ = stopped.await;
                        let metrics = Handle::current().metrics();
                        let deadline = tokio::time::Instant::now() + STOP_GRACE;
                        // This task is one of the runtime's alive tasks only when spawned; the
                        // future of block_on is not counted.
                        while metrics.num_alive_tasks() > 0
                            && tokio::time::Instant::now() < deadline
                        {
                            tokio::time::sleep(STOP_POLL).await;
                        }
                    });
                    // What is left (a connection that would not end) is dropped here.
                    runtime.shutdown_background();
                    let _ = done.send(());
                })?;
            let handle = handle.recv().map_err(|_| {
                std::io::Error::other("a connection thread stopped before its runtime started")
            })??;
            threads.push(handle);
            stops.push(stop);
            dones.push(finished);
        }
        tracing::debug!(threads = count, "connection threads started");
        Ok(Self::Pinned {
            threads,
            next: AtomicUsize::new(0),
            stops,
            stopped: dones,
        })
    }

    /// The default: one thread per two cores the process may use, at least one. The node's
    /// state is behind one lock, so a second thread on it mostly moves the state's cache lines
    /// between cores (on 2 cores, two threads cost 15 to 35% more CPU per message than one in
    /// the worker shapes, and moved no throughput); the other cores are left to the store's
    /// and Raft's threads, the management API and the clients. More threads pay off where
    /// much happens outside the lock: TLS, many connections' reads and frame decoding.
    pub fn default_count() -> usize {
        std::thread::available_parallelism().map_or(1, |n| (n.get() / 2).max(1))
    }

    /// Stops the threads and returns once they have: what their connections were still doing
    /// (at most [`STOP_GRACE`] more) is over, so nothing of theirs reaches the node after this,
    /// when the store is closed.
    pub async fn stop(self) {
        let Self::Pinned { stops, stopped, .. } = self else {
            return;
        };
        drop(stops);
        for done in stopped {
            // A thread that panicked dropped its sender: stopped all the same.
            let _ = tokio::time::timeout(STOP_GRACE * 2, done).await;
        }
    }

    /// Runs `serve` on the next thread with `stream` moved there (its readiness is then
    /// watched by that thread's runtime), or on the current runtime when connections share it.
    pub fn spawn<F, Fut>(&self, stream: TcpStream, serve: F)
    where
        F: FnOnce(TcpStream) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let Self::Pinned { threads, next, .. } = self else {
            tokio::spawn(serve(stream));
            return;
        };
        let i = next.fetch_add(1, Ordering::Relaxed) % threads.len().max(1);
        let Some(handle) = threads.get(i) else {
            tokio::spawn(serve(stream));
            return;
        };
        // Taken out of this runtime's reactor, then registered with the thread's.
        let std_stream = match stream.into_std() {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "cannot hand a connection to its thread");
                return;
            }
        };
        let moved = {
            let _in_thread = handle.enter();
            TcpStream::from_std(std_stream)
        };
        match moved {
            Ok(stream) => {
                handle.spawn(serve(stream));
            }
            Err(e) => tracing::warn!(error = %e, "cannot hand a connection to its thread"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Stopping waits for the threads' connections to end, and for no longer than the grace
    /// when one never does.
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn stopping_waits_for_the_connections_and_not_for_ever() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let threads = ConnectionThreads::start(1).unwrap();
        let _client = TcpStream::connect(addr).await.unwrap();
        let (stream, _) = listener.accept().await.unwrap();
        let (ended_tx, ended_rx) = std::sync::mpsc::channel::<()>();
        // A connection that never ends: it holds the sender until it is dropped.
        threads.spawn(stream, move |_s| async move {
            let _ended = ended_tx;
            std::future::pending::<()>().await;
        });
        let started = std::time::Instant::now();
        threads.stop().await;
        let took = started.elapsed();
        assert!(took >= STOP_GRACE, "stopped after {took:?}");
        assert!(
            took < STOP_GRACE * 2 + Duration::from_millis(500),
            "{took:?}"
        );
        // Its task was dropped with the thread's runtime.
        assert!(ended_rx
            .recv_timeout(Duration::from_secs(1))
            .is_err_and(|e| { e == std::sync::mpsc::RecvTimeoutError::Disconnected }));

        let threads = ConnectionThreads::start(1).unwrap();
        let started = std::time::Instant::now();
        threads.stop().await;
        assert!(started.elapsed() < STOP_GRACE, "{:?}", started.elapsed());
    }

    /// Each accepted stream is served on a thread of its own, round robin, and works there.
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn connections_are_served_round_robin_on_their_own_threads() {
        let threads = ConnectionThreads::start(2).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (names_tx, mut names_rx) = tokio::sync::mpsc::unbounded_channel();
        for _ in 0..4 {
            let mut client = TcpStream::connect(addr).await.unwrap();
            let (stream, _) = listener.accept().await.unwrap();
            let names = names_tx.clone();
            threads.spawn(stream, move |mut s| async move {
                let mut b = [0u8; 1];
                s.read_exact(&mut b).await.unwrap();
                let name = std::thread::current().name().unwrap_or("").to_string();
                names.send(name).unwrap();
                s.write_all(&[b[0] + 1]).await.unwrap();
            });
            client.write_all(&[41]).await.unwrap();
            let mut b = [0u8; 1];
            client.read_exact(&mut b).await.unwrap();
            assert_eq!(b[0], 42);
        }
        let mut names = Vec::new();
        for _ in 0..4 {
            names.push(names_rx.recv().await.unwrap());
        }
        assert_eq!(
            names,
            [
                "warren-conn-0",
                "warren-conn-1",
                "warren-conn-0",
                "warren-conn-1"
            ]
        );
    }

    #[tokio::test]
    async fn with_no_threads_connections_stay_on_the_accepting_runtime() {
        let threads = ConnectionThreads::start(0).unwrap();
        assert!(matches!(threads, ConnectionThreads::Shared));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let _client = TcpStream::connect(addr).await.unwrap();
        let (stream, _) = listener.accept().await.unwrap();
        let (tx, rx) = oneshot::channel();
        threads.spawn(stream, move |_s| async move {
            let _ = tx.send(std::thread::current().name().map(str::to_string));
        });
        let name = rx.await.unwrap();
        assert!(!name.unwrap_or_default().starts_with("warren-conn"));
    }
}
