//! Dynamic shovels, as RabbitMQ's shovel plugin defines them: a `shovel` runtime parameter
//! per vhost and name (`/api/parameters/shovel/{vhost}/{name}`, definitions files) that
//! moves messages from a source queue or exchange to a destination, on this node or another
//! broker (RabbitMQ or Warren), over AMQP 0-9-1.
//!
//! The broker keeps the parameters (durable, replicated in a cluster); [`supervise`] starts,
//! restarts and stops a [`worker`] for each, and [`Shovels`] holds what `/api/shovels`
//! reports. In a cluster, the lowest-numbered running node runs every shovel (RabbitMQ runs
//! each on one node too); when it goes down the next one takes over, and what was in flight
//! goes back to its source.

pub mod definition;
pub mod expiry;
pub mod uri;
pub(crate) mod worker;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::driver::NodeHandle;
use definition::{Destination, ShovelDef, Source};
pub use uri::Local;

/// The runtime parameters' component of shovels.
pub const COMPONENT: &str = "shovel";

/// How often the supervisor looks at the node's parameters (a look is a read of a counter
/// unless something changed).
const LOOK_EVERY: Duration = Duration::from_millis(200);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    /// Connecting (again, after `reason`), or declaring what it needs.
    Starting,
    /// Consuming from its source.
    Running,
    /// Its definition cannot run (stored by another version, say): `reason` says why.
    Terminated,
}

impl State {
    fn as_str(self) -> &'static str {
        match self {
            State::Starting => "starting",
            State::Running => "running",
            State::Terminated => "terminated",
        }
    }
}

#[derive(Clone, Debug)]
struct Status {
    state: State,
    /// When the state last changed, seconds since the epoch.
    since: i64,
    reason: Option<String>,
    /// The URIs the running session uses, without passwords.
    uris: Option<(String, String)>,
    def: Option<ShovelDef>,
    counters: Arc<Counters>,
}

/// A running shovel's counts, updated by its worker without a lock.
#[derive(Debug)]
pub struct Counters {
    /// Messages moved since the shovel started on this node.
    forwarded: AtomicU64,
    /// Left before it deletes itself (`src-delete-after`); `u64::MAX`: it never does.
    remaining: AtomicU64,
}

impl Default for Counters {
    fn default() -> Self {
        Counters {
            forwarded: AtomicU64::new(0),
            remaining: AtomicU64::new(u64::MAX),
        }
    }
}

impl Counters {
    /// Messages moved so far.
    pub fn forwarded(&self) -> u64 {
        self.forwarded.load(Ordering::Relaxed)
    }

    fn set_remaining(&self, remaining: Option<u64>) {
        self.remaining
            .store(remaining.unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    fn moved(&self, n: u64, remaining: Option<u64>) {
        self.forwarded.fetch_add(n, Ordering::Relaxed);
        self.set_remaining(remaining);
    }

    fn remaining(&self) -> Option<u64> {
        Some(self.remaining.load(Ordering::Relaxed)).filter(|r| *r != u64::MAX)
    }
}

fn now_secs() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

/// What `/api/shovels` shows, shared by the supervisor, the workers and the API.
#[derive(Clone)]
pub struct Shovels(Arc<Inner>);

struct Inner {
    node_name: String,
    status: Mutex<BTreeMap<(String, String), Status>>,
    /// Shovels the API asked to restart.
    restarts: Mutex<BTreeSet<(String, String)>>,
}

impl Shovels {
    pub fn new(node_name: String) -> Shovels {
        Shovels(Arc::new(Inner {
            node_name,
            status: Mutex::new(BTreeMap::new()),
            restarts: Mutex::new(BTreeSet::new()),
        }))
    }

    fn with<R>(&self, f: impl FnOnce(&mut BTreeMap<(String, String), Status>) -> R) -> R {
        let mut s = self.0.status.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut s)
    }

    fn entry<R>(&self, vhost: &str, name: &str, f: impl FnOnce(&mut Status) -> R) -> Option<R> {
        self.with(|s| s.get_mut(&(vhost.to_owned(), name.to_owned())).map(f))
    }

    fn set_state(&self, vhost: &str, name: &str, state: State, reason: Option<String>) {
        self.entry(vhost, name, |s| {
            if s.state != state {
                s.since = now_secs();
            }
            s.state = state;
            if reason.is_some() || state == State::Running {
                s.reason = reason;
            }
            if state != State::Running {
                s.uris = None;
            }
        });
    }

    fn set_running(&self, vhost: &str, name: &str, src: String, dest: String) {
        self.set_state(vhost, name, State::Running, None);
        self.entry(vhost, name, |s| s.uris = Some((src, dest)));
    }

    /// Starts reporting a shovel (as starting); the counters its worker updates.
    pub(crate) fn track(&self, vhost: &str, name: &str, def: ShovelDef) -> Arc<Counters> {
        let counters = Arc::new(Counters::default());
        let status = Status {
            state: State::Starting,
            since: now_secs(),
            reason: None,
            uris: None,
            def: Some(def),
            counters: counters.clone(),
        };
        self.with(|s| s.insert((vhost.to_owned(), name.to_owned()), status));
        counters
    }

    /// A shovel's state and the reason of its last failure.
    pub(crate) fn state_of(&self, vhost: &str, name: &str) -> Option<(State, Option<String>)> {
        self.with(|s| {
            s.get(&(vhost.to_owned(), name.to_owned()))
                .map(|st| (st.state, st.reason.clone()))
        })
    }

    /// Asks the supervisor to restart a shovel; false if this node runs no such shovel.
    pub fn restart(&self, vhost: &str, name: &str) -> bool {
        let key = (vhost.to_owned(), name.to_owned());
        if !self.with(|s| s.contains_key(&key)) {
            return false;
        }
        self.0
            .restarts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key);
        true
    }

    fn take_restarts(&self) -> BTreeSet<(String, String)> {
        std::mem::take(&mut *self.0.restarts.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// The shovels of one vhost (or all), as RabbitMQ's `/api/shovels` lists them.
    pub fn list(&self, vhost: Option<&str>) -> Vec<Value> {
        self.with(|s| {
            s.iter()
                .filter(|((v, _), _)| vhost.is_none_or(|w| w == v))
                .map(|((v, n), st)| self.json(v, n, st))
                .collect()
        })
    }

    fn json(&self, vhost: &str, name: &str, s: &Status) -> Value {
        let mut out = json!({
            "node": self.0.node_name,
            "timestamp": crate::http::certificates::date(s.since),
            "name": name,
            "vhost": vhost,
            "type": "dynamic",
            "state": s.state.as_str(),
        });
        let Some(m) = out.as_object_mut() else {
            return out;
        };
        if let Some(r) = &s.reason {
            m.insert("reason".into(), r.as_str().into());
        }
        if let (Some((src, dest)), Some(def)) = (&s.uris, &s.def) {
            m.insert("src_uri".into(), src.as_str().into());
            m.insert("src_protocol".into(), "amqp091".into());
            m.insert("dest_protocol".into(), "amqp091".into());
            m.insert("dest_uri".into(), dest.as_str().into());
            match &def.src {
                Source::Queue { name, .. } => {
                    m.insert("src_queue".into(), name.as_str().into());
                }
                Source::Exchange { name, key } => {
                    m.insert("src_exchange".into(), name.as_str().into());
                    m.insert("src_exchange_key".into(), key.as_str().into());
                }
            }
            match &def.dest {
                Destination::Queue { name, .. } => {
                    m.insert("dest_queue".into(), name.as_str().into());
                }
                Destination::Exchange { name, key } => {
                    m.insert("dest_exchange".into(), name.as_str().into());
                    if let Some(k) = key {
                        m.insert("dest_exchange_key".into(), k.as_str().into());
                    }
                }
                Destination::AsPublished => {}
            }
        }
        // Warren's own fields (newer RabbitMQs report these counters too).
        m.insert(
            "forwarded".into(),
            s.counters.forwarded.load(Ordering::Relaxed).into(),
        );
        if let Some(r) = s.counters.remaining() {
            m.insert("remaining".into(), r.into());
        }
        out
    }
}

/// A worker the supervisor started.
struct Running {
    /// The parameter's value it runs.
    value: String,
    stop: watch::Sender<bool>,
    task: JoinHandle<worker::Ended>,
}

/// How long a worker that failed waits before it starts again.
const RESTART_AFTER_FAILURE: Duration = Duration::from_secs(5);

/// How long a stopped worker may take to close its connections (each close waits up to 2 s)
/// before it is aborted.
const STOP_WITHIN: Duration = Duration::from_secs(5);

/// Stops a worker: asks it to close its connections (which gives back what was in flight),
/// and aborts it if it does not end in time, so no stopped shovel keeps moving messages.
/// Whether it closed its connections cleanly.
pub(crate) async fn stop_worker(
    stop: &watch::Sender<bool>,
    task: JoinHandle<worker::Ended>,
) -> bool {
    let _ = stop.send(true);
    let abort = task.abort_handle();
    match tokio::time::timeout(STOP_WITHIN, task).await {
        Ok(Ok(ended)) => ended.closed,
        Ok(Err(_)) => false,
        Err(_) => {
            abort.abort();
            false
        }
    }
}

/// What the supervisor reads of the node at each look.
struct Look {
    generation: u64,
    /// This node runs the shovels (alone, or the lowest-numbered running cluster node).
    runs: bool,
    cluster_name: String,
}

fn look(node: &NodeHandle) -> Look {
    node.read(|n, _| {
        let b = n.broker();
        let runs = match b.cluster_node() {
            // On its own, a node in maintenance mode takes no client, its shovels included.
            None => !b.is_draining(),
            Some(me) => {
                let peers = b.peers_running();
                let up = 1 + peers.iter().filter(|(_, running)| *running).count();
                // On the minority side of a partition a node sees the others down: it must
                // not start a second copy of every shovel.
                let majority = up * 2 > peers.len() + 1;
                // A node in maintenance mode runs none; the next one takes them.
                majority
                    && !b.is_draining()
                    && peers
                        .iter()
                        .all(|(peer, running)| !running || *peer > me || b.node_draining(*peer))
            }
        };
        Look {
            generation: b.parameters().generation(),
            runs,
            cluster_name: n.config().cluster_name.clone(),
        }
    })
}

/// Keeps one worker running per shovel parameter, for as long as the node runs.
pub async fn supervise(node: NodeHandle, shovels: Shovels, local: Local) {
    let mut running: HashMap<(String, String), Running> = HashMap::new();
    let mut seen: Option<(u64, bool)> = None;
    // Workers that failed (a panic), and when they may start again.
    let mut failed: HashMap<(String, String), tokio::time::Instant> = HashMap::new();
    let mut tick = tokio::time::interval(LOOK_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        // Workers whose work is done delete their shovel, as RabbitMQ's do.
        let done: Vec<(String, String)> = running
            .iter()
            .filter(|(_, r)| r.task.is_finished())
            .map(|(k, _)| k.clone())
            .collect();
        // Anything that ended is looked at again: a panicked worker starts again.
        let mut finished_any = false;
        for key in done {
            let Some(r) = running.remove(&key) else {
                continue;
            };
            finished_any = true;
            shovels.with(|s| s.remove(&key));
            match r.task.await {
                Ok(ended) if ended.done => {
                    tracing::info!(vhost = %key.0, shovel = %key.1, "shovel done (src-delete-after): deleting it");
                    clear_finished(&node, key, r.value).await;
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::error!(vhost = %key.0, shovel = %key.1, error = %e, "shovel worker failed; starting it again in a while");
                    let status = Status {
                        state: State::Terminated,
                        since: now_secs(),
                        reason: Some(format!("its worker failed ({e}); it starts again")),
                        uris: None,
                        def: None,
                        counters: Arc::new(Counters::default()),
                    };
                    shovels.with(|s| s.insert(key.clone(), status));
                    failed.insert(key, tokio::time::Instant::now() + RESTART_AFTER_FAILURE);
                }
            }
        }
        let restarts = shovels.take_restarts();
        let l = look(&node);
        let now = tokio::time::Instant::now();
        failed.retain(|_, at| *at > now);
        if seen == Some((l.generation, l.runs))
            && restarts.is_empty()
            && !finished_any
            && failed.is_empty()
        {
            continue;
        }
        seen = Some((l.generation, l.runs));
        let wanted: BTreeMap<(String, String), String> = if l.runs {
            node.read(|n, _| {
                n.broker()
                    .parameters()
                    .list(Some(COMPONENT), None)
                    .map(|p| ((p.vhost.clone(), p.name.clone()), p.value.clone()))
                    .collect()
            })
        } else {
            BTreeMap::new()
        };
        let gone: Vec<(String, String)> = running
            .iter()
            .filter(|(k, r)| wanted.get(*k) != Some(&r.value) || restarts.contains(*k))
            .map(|(k, _)| k.clone())
            .collect();
        // Every one told first, so that none moves messages while another closes.
        let stopping: Vec<((String, String), Running)> = gone
            .into_iter()
            .filter_map(|key| running.remove(&key).map(|r| (key, r)))
            .collect();
        for (_, r) in &stopping {
            let _ = r.stop.send(true);
        }
        for (key, r) in stopping {
            if !stop_worker(&r.stop, r.task).await {
                tracing::warn!(vhost = %key.0, shovel = %key.1, "a stopped shovel did not close its connections in time: aborted");
            }
            shovels.with(|s| s.remove(&key));
        }
        // Nothing reported for a shovel that is no longer defined here (one that could not
        // run, say, and was deleted since).
        shovels.with(|s| s.retain(|k, _| wanted.contains_key(k)));
        for (key, value) in wanted {
            if running.contains_key(&key) || failed.contains_key(&key) {
                continue;
            }
            let def = serde_json::from_str::<Value>(&value)
                .map_err(|e| vec![e.to_string()])
                .and_then(|v| definition::parse(&key.1, &v));
            let def = match def {
                Ok(d) => d,
                Err(e) => {
                    let status = Status {
                        state: State::Terminated,
                        since: now_secs(),
                        reason: Some(e.join("; ")),
                        uris: None,
                        def: None,
                        counters: Arc::new(Counters::default()),
                    };
                    shovels.with(|s| s.insert(key, status));
                    continue;
                }
            };
            let counters = shovels.track(&key.0, &key.1, def.clone());
            let (stop, stopped) = watch::channel(false);
            let worker = worker::Worker {
                vhost: key.0.clone(),
                name: key.1.clone(),
                def,
                local: local.clone(),
                shovels: shovels.clone(),
                cluster_name: l.cluster_name.clone(),
                counters,
                migration: None,
            };
            tracing::info!(vhost = %key.0, shovel = %key.1, "shovel starting");
            let task = tokio::spawn(worker.run(stopped));
            running.insert(key, Running { value, stop, task });
        }
    }
}

/// Deletes the parameter of a shovel whose `src-delete-after` work is done, unless it was
/// changed meanwhile (then the new definition runs).
async fn clear_finished(node: &NodeHandle, key: (String, String), value: String) {
    let (vhost, name) = key;
    let node = node.clone();
    // The write waits for the store: off the supervisor's loop.
    let cleared = tokio::task::spawn_blocking(move || {
        node.write(|n, _| {
            let b = n.broker_mut();
            let same = b
                .parameters()
                .get(COMPONENT, &vhost, &name)
                .is_some_and(|p| p.value == value);
            same && b.clear_parameter(COMPONENT, &vhost, &name)
        })
    })
    .await;
    if !matches!(cleared, Ok(Ok(_))) {
        tracing::warn!("a finished shovel's parameter could not be cleared; it will run again");
    }
}
