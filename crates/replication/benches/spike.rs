//! The replication spike of issue 21: a 3-node cluster in one process, one OS thread per node,
//! many Raft groups per node, one node-wide log file per node with one fsync per batch.
//!
//! `cargo bench -p warren-replication --bench spike -- --groups 10000 --busy 10 --secs 10`
//!
//! Phases: create the groups (leaders placed round-robin) and wait until every group has a leader
//! and every group sleeps; stay idle for `--idle-secs` and measure the process's CPU; then feed the
//! first `--busy` groups proposals of `--size` bytes, at most `--inflight` uncommitted per group,
//! for `--secs`, and count what commits (`--async 1` writes the log on a thread of its own).
//! Last, node 1 stops dead and the survivors' time to lead every group again is measured. Batches
//! between nodes are encoded (protobuf, as a TCP transport would send them) and passed over
//! channels.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use protobuf::Message as _;
use warren_replication::raft::eraftpb::Message;
use warren_replication::{
    Config, EngineLog, Envelope, FileLog, GroupId, LogError, LogStore, MultiRaft, NodeBatch,
    NodeId, PersistJob,
};

/// What a node thread receives: a peer's encoded batch, or a job its log writer made durable.
enum Input {
    Net(Vec<u8>),
    Persisted(PersistJob),
}

const NODES: [NodeId; 3] = [1, 2, 3];
const PHASE_SETTLE: u8 = 0;
const PHASE_BUSY: u8 = 1;
const PHASE_STOP: u8 = 2;
const PHASE_IDLE: u8 = 3;
/// Node 1 stops dead; the others must elect leaders for the groups it led.
const PHASE_FAILOVER: u8 = 4;

struct Args {
    groups: u64,
    busy: u64,
    secs: u64,
    idle_secs: u64,
    size: usize,
    inflight: u64,
    tick_ms: u64,
    inflight_msgs: usize,
    /// The node's log: 0 = the spike's append-only file, 1 = raft-engine.
    engine: bool,
    /// Write the log on its own thread (`submit` / `on_persisted`) instead of in the node's loop.
    async_log: bool,
}

fn parse_args() -> Args {
    let mut a = Args {
        groups: 10_000,
        busy: 10,
        secs: 10,
        idle_secs: 10,
        size: 1024,
        inflight: 256,
        tick_ms: 50,
        inflight_msgs: 32,
        engine: false,
        async_log: false,
    };
    // `cargo bench` adds `--bench` to the arguments.
    let argv: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    let mut i = 0;
    while i + 1 < argv.len() {
        let v: u64 = argv[i + 1].parse().expect("a number");
        match argv[i].as_str() {
            "--groups" => a.groups = v,
            "--busy" => a.busy = v,
            "--secs" => a.secs = v,
            "--idle-secs" => a.idle_secs = v,
            "--size" => a.size = v as usize,
            "--inflight" => a.inflight = v,
            "--tick-ms" => a.tick_ms = v,
            "--inflight-msgs" => a.inflight_msgs = v as usize,
            "--engine" => a.engine = v != 0,
            "--async" => a.async_log = v != 0,
            other => panic!("unknown option {other}"),
        }
        i += 2;
    }
    a.busy = a.busy.min(a.groups);
    a
}

/// What each node thread publishes for the main thread.
#[derive(Default)]
struct Shared {
    awake: AtomicU64,
    /// Groups whose leader this node knows.
    led: AtomicU64,
    commits: AtomicU64,
    syncs: AtomicU64,
    /// Nanoseconds spent writing and fsyncing the log.
    persist_ns: AtomicU64,
    batches: AtomicU64,
    raft_msgs: AtomicU64,
    node_heartbeats: AtomicU64,
    ready: AtomicBool,
}

fn encode(b: &NodeBatch) -> Vec<u8> {
    let mut out = Vec::with_capacity(16 + b.msgs.len() * 64);
    out.extend_from_slice(&b.from.to_le_bytes());
    out.extend_from_slice(&b.to.to_le_bytes());
    out.extend_from_slice(&b.boot.to_le_bytes());
    for env in &b.msgs {
        let m = env.msg.write_to_bytes().expect("encode");
        out.extend_from_slice(&env.group.0.to_le_bytes());
        out.extend_from_slice(&(m.len() as u32).to_le_bytes());
        out.extend_from_slice(&m);
    }
    out
}

fn decode(b: &[u8]) -> NodeBatch {
    let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
    let (from, to, boot) = (u64_at(0), u64_at(8), u64_at(16));
    let mut msgs = Vec::new();
    let mut i = 24;
    while i < b.len() {
        let group = GroupId(u64_at(i));
        let len = u32::from_le_bytes(b[i + 8..i + 12].try_into().expect("4 bytes")) as usize;
        let msg = Message::parse_from_bytes(&b[i + 12..i + 12 + len]).expect("decode");
        msgs.push(Envelope { group, msg });
        i += 12 + len;
    }
    NodeBatch {
        forwards: Vec::new(),
        from,
        boot,
        to,
        draining: false,
        msgs,
    }
}

#[allow(clippy::too_many_arguments)]
fn run_node(
    id: NodeId,
    args: &Args,
    dir: &std::path::Path,
    rx: Receiver<Input>,
    me: Sender<Input>,
    peers: Vec<(NodeId, Sender<Input>)>,
    phase: &AtomicU8,
    shared: Arc<Shared>,
    epoch: Instant,
) {
    let mut cfg = Config::new(id, NODES.to_vec());
    cfg.tick_ms = args.tick_ms;
    cfg.node_down_ticks = 6;
    cfg.max_inflight_msgs = args.inflight_msgs;
    let mut raft = MultiRaft::new(cfg).expect("config");
    for g in 0..args.groups {
        raft.add_group(GroupId(g), g % 3 + 1 == id).expect("group");
    }
    let log = if args.engine {
        AnyLog::Engine(
            Box::new(
                EngineLog::open(&dir.join(format!("node-{id}.engine"))).expect("raft-engine dir"),
            ),
            0,
        )
    } else {
        AnyLog::File(Box::new(
            FileLog::create(&dir.join(format!("node-{id}.log"))).expect("log file"),
        ))
    };
    let (mut log, writer) = if args.async_log {
        (None, Some(spawn_writer(log, me, shared.clone())))
    } else {
        (Some(log), None)
    };
    let busy: Vec<GroupId> = (0..args.busy).map(GroupId).collect();
    let mut inflight = vec![0u64; args.busy as usize];
    // Incompressible, as real payloads mostly are (raft-engine compresses large batches).
    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ id;
    let payload: Vec<u8> = (0..args.size)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    shared.ready.store(true, Ordering::Release);
    let send = |batches: Vec<NodeBatch>| {
        for b in batches {
            if let Some((_, tx)) = peers.iter().find(|(n, _)| *n == b.to) {
                let _ = tx.send(Input::Net(encode(&b)));
            }
        }
    };
    loop {
        let p = phase.load(Ordering::Acquire);
        if p == PHASE_STOP || (p == PHASE_FAILOVER && id == 1) {
            break;
        }
        let mut did = false;
        while let Ok(input) = rx.try_recv() {
            match input {
                Input::Net(bytes) => raft.step(decode(&bytes)),
                Input::Persisted(job) => send(raft.on_persisted(job)),
            }
            did = true;
        }
        if p == PHASE_BUSY {
            for (i, g) in busy.iter().enumerate() {
                if !raft.is_leader(*g) {
                    inflight[i] = 0;
                    continue;
                }
                while inflight[i] < args.inflight {
                    if raft.propose(*g, payload.clone()).is_err() {
                        break;
                    }
                    inflight[i] += 1;
                    did = true;
                }
            }
        }
        let now = epoch.elapsed().as_millis() as u64;
        raft.tick(now);
        let mut rd = raft.ready();
        if !rd.is_empty() {
            did = true;
        }
        send(std::mem::take(&mut rd.messages));
        if rd.groups_to_persist() > 0 {
            shared.batches.fetch_add(1, Ordering::Relaxed);
        }
        let committed = match (&writer, log.as_mut()) {
            (Some(writer), _) => {
                let (committed, job) = raft.submit(rd);
                if !job.is_empty() {
                    let _ = writer.send(job);
                }
                committed
            }
            (None, Some(log)) => {
                let t = Instant::now();
                rd.persist(log).expect("log write");
                shared
                    .persist_ns
                    .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
                shared.syncs.store(log.syncs(), Ordering::Relaxed);
                let done = raft.advance(rd);
                send(done.messages);
                done.committed
            }
            (None, None) => unreachable!("a log or a writer"),
        };
        let mut commits = 0;
        for c in &committed {
            if c.group.0 < args.busy && raft.is_leader(c.group) {
                let i = c.group.0 as usize;
                inflight[i] = inflight[i].saturating_sub(1);
                commits += 1;
            }
        }
        shared.commits.fetch_add(commits, Ordering::Relaxed);
        let st = raft.stats();
        shared.raft_msgs.store(st.raft_msgs_sent, Ordering::Relaxed);
        shared
            .node_heartbeats
            .store(st.node_heartbeats_sent, Ordering::Relaxed);
        shared
            .awake
            .store(raft.awake_count() as u64, Ordering::Relaxed);
        if !did {
            // Nothing moved: while settling, count the groups whose leader is known (a walk over
            // all groups, so not in the measured phases); then sleep until the next tick or message.
            if p == PHASE_SETTLE || p == PHASE_FAILOVER {
                let led = (0..args.groups)
                    .filter(|g| {
                        raft.leader_of(GroupId(*g))
                            .is_some_and(|l| p == PHASE_SETTLE || l != 1)
                    })
                    .count() as u64;
                shared.led.store(led, Ordering::Relaxed);
            }
            let now = epoch.elapsed().as_millis() as u64;
            let wait = raft.next_tick_ms().unwrap_or(now).saturating_sub(now);
            match rx.recv_timeout(Duration::from_millis(wait.max(1))) {
                Ok(Input::Net(bytes)) => raft.step(decode(&bytes)),
                Ok(Input::Persisted(job)) => send(raft.on_persisted(job)),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
        }
    }
}

/// A node's log writer: takes every job queued since its last write, writes them with one fsync,
/// and hands them back to the node thread in order.
fn spawn_writer(mut log: AnyLog, node: Sender<Input>, shared: Arc<Shared>) -> Sender<PersistJob> {
    let (tx, rx) = channel::<PersistJob>();
    std::thread::spawn(move || {
        while let Ok(job) = rx.recv() {
            let mut jobs = vec![job];
            while let Ok(more) = rx.try_recv() {
                jobs.push(more);
            }
            let t = Instant::now();
            for j in &jobs {
                j.write(&mut log).expect("log write");
            }
            log.flush(jobs.iter().any(|j| j.must_sync()))
                .expect("log flush");
            shared
                .persist_ns
                .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
            shared.syncs.store(log.syncs(), Ordering::Relaxed);
            for j in jobs {
                if node.send(Input::Persisted(j)).is_err() {
                    return;
                }
            }
        }
    });
    tx
}

fn cpu_secs() -> f64 {
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes into the struct we own and reads nothing else.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    assert_eq!(rc, 0);
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

fn main() {
    let args = parse_args();
    let dir = tempfile::tempdir().expect("temp dir");
    let phase = Arc::new(AtomicU8::new(PHASE_SETTLE));
    let shared: Vec<Arc<Shared>> = NODES.iter().map(|_| Arc::new(Shared::default())).collect();
    let mut txs = Vec::new();
    let mut rxs = Vec::new();
    for _ in NODES {
        let (tx, rx) = channel::<Input>();
        txs.push(tx);
        rxs.push(Some(rx));
    }
    let args = Arc::new(args);
    let epoch = Instant::now();
    let cpu0 = cpu_secs();
    let mut handles = Vec::new();
    for (i, id) in NODES.iter().copied().enumerate() {
        let rx = rxs[i].take().expect("receiver");
        let me = txs[i].clone();
        let peers: Vec<(NodeId, Sender<Input>)> = NODES
            .iter()
            .enumerate()
            .filter(|(_, n)| **n != id)
            .map(|(j, n)| (*n, txs[j].clone()))
            .collect();
        let (args, phase, shared, path) = (
            args.clone(),
            phase.clone(),
            shared[i].clone(),
            dir.path().to_path_buf(),
        );
        handles.push(std::thread::spawn(move || {
            run_node(id, &args, &path, rx, me, peers, &phase, shared, epoch)
        }));
    }
    drop(txs);
    // Settle: every group led, as every node sees it, and every group asleep on every node.
    let mut created = None;
    let mut elected = None;
    let settled;
    loop {
        std::thread::sleep(Duration::from_millis(20));
        let t = epoch.elapsed().as_secs_f64();
        if created.is_none() && shared.iter().all(|s| s.ready.load(Ordering::Acquire)) {
            created = Some(t);
        }
        if elected.is_none()
            && shared
                .iter()
                .all(|s| s.led.load(Ordering::Relaxed) == args.groups)
        {
            elected = Some(t);
        }
        if elected.is_some() && shared.iter().all(|s| s.awake.load(Ordering::Relaxed) == 0) {
            settled = t;
            break;
        }
        assert!(t < 120.0, "did not settle");
    }
    let created = created.unwrap_or(0.0);
    let elected = elected.unwrap_or(0.0);
    let cpu_settle = cpu_secs() - cpu0;
    let msgs = |s: &[Arc<Shared>]| {
        s.iter()
            .map(|x| x.raft_msgs.load(Ordering::Relaxed))
            .sum::<u64>()
    };
    let beats = |s: &[Arc<Shared>]| {
        s.iter()
            .map(|x| x.node_heartbeats.load(Ordering::Relaxed))
            .sum::<u64>()
    };
    // Idle.
    phase.store(PHASE_IDLE, Ordering::Release);
    std::thread::sleep(Duration::from_millis(200));
    let rss_idle = rss_kib();
    let (c0, m0, h0) = (cpu_secs(), msgs(&shared), beats(&shared));
    std::thread::sleep(Duration::from_secs(args.idle_secs));
    let idle_cpu = cpu_secs() - c0;
    let idle_msgs = msgs(&shared) - m0;
    let idle_beats = beats(&shared) - h0;
    let idle_awake: u64 = shared.iter().map(|s| s.awake.load(Ordering::Relaxed)).sum();
    // Busy.
    let commits = |s: &[Arc<Shared>]| {
        s.iter()
            .map(|x| x.commits.load(Ordering::Relaxed))
            .sum::<u64>()
    };
    let syncs = |s: &[Arc<Shared>]| {
        s.iter()
            .map(|x| x.syncs.load(Ordering::Relaxed))
            .sum::<u64>()
    };
    phase.store(PHASE_BUSY, Ordering::Release);
    // A second of warm-up: pipelines fill.
    std::thread::sleep(Duration::from_secs(1));
    let persist = |s: &[Arc<Shared>]| {
        s.iter()
            .map(|x| x.persist_ns.load(Ordering::Relaxed))
            .sum::<u64>()
    };
    let (c1, k1, s1, t1) = (cpu_secs(), commits(&shared), syncs(&shared), Instant::now());
    let p1 = persist(&shared);
    std::thread::sleep(Duration::from_secs(args.secs));
    let (busy_cpu, k2, s2, dt) = (
        cpu_secs() - c1,
        commits(&shared),
        syncs(&shared),
        t1.elapsed().as_secs_f64(),
    );
    let rss_busy = rss_kib();
    // Share of the node threads' wall time spent in the log write and fsync.
    let persist_share = (persist(&shared) - p1) as f64 / 1e9 / (dt * NODES.len() as f64);
    // Failover: let the busy groups drain and sleep, then stop node 1 dead.
    phase.store(PHASE_IDLE, Ordering::Release);
    let t = Instant::now();
    while shared.iter().any(|s| s.awake.load(Ordering::Relaxed) != 0) {
        std::thread::sleep(Duration::from_millis(10));
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "did not settle after the busy phase"
        );
    }
    for s in &shared {
        s.led.store(0, Ordering::Relaxed);
    }
    let (c3, t3) = (cpu_secs(), Instant::now());
    phase.store(PHASE_FAILOVER, Ordering::Release);
    let survivors = &shared[1..];
    while survivors
        .iter()
        .any(|s| s.led.load(Ordering::Relaxed) != args.groups)
    {
        std::thread::sleep(Duration::from_millis(5));
        assert!(t3.elapsed() < Duration::from_secs(60), "no failover");
    }
    let failover_s = t3.elapsed().as_secs_f64();
    while survivors
        .iter()
        .any(|s| s.awake.load(Ordering::Relaxed) != 0)
    {
        std::thread::sleep(Duration::from_millis(5));
        assert!(
            t3.elapsed() < Duration::from_secs(60),
            "no sleep after failover"
        );
    }
    let (failover_asleep_s, failover_cpu) = (t3.elapsed().as_secs_f64(), cpu_secs() - c3);
    phase.store(PHASE_STOP, Ordering::Release);
    for h in handles {
        let _ = h.join();
    }
    let rate = (k2 - k1) as f64 / dt;
    println!(
        "groups={} busy={} created_s={:.2} elected_s={:.2} settled_s={:.2} settle_cpu_s={:.2} \
         rss_idle_kib={} idle_secs={} idle_cpu_s={:.3} idle_raft_msgs={} idle_node_heartbeats={} \
         idle_awake={} commits_per_s={:.0} busy_cpu_s={:.2} cpu_us_per_commit={:.1} \
         fsyncs_per_s={:.0} persist_share={:.2} rss_busy_kib={} failover_s={:.2} failover_asleep_s={:.2} \
         failover_cpu_s={:.2}",
        args.groups,
        args.busy,
        created,
        elected,
        settled,
        cpu_settle,
        rss_idle,
        args.idle_secs,
        idle_cpu,
        idle_msgs,
        idle_beats,
        idle_awake,
        rate,
        busy_cpu,
        busy_cpu * 1e6 / (k2 - k1).max(1) as f64,
        (s2 - s1) as f64 / dt,
        persist_share,
        rss_busy,
        failover_s,
        failover_asleep_s,
        failover_cpu,
    );
}

/// The log a node writes: the spike's file, or raft-engine (with its own count of syncs).
enum AnyLog {
    File(Box<FileLog>),
    Engine(Box<EngineLog>, u64),
}

impl AnyLog {
    fn syncs(&self) -> u64 {
        match self {
            AnyLog::File(f) => f.syncs,
            AnyLog::Engine(_, n) => *n,
        }
    }
}

impl LogStore for AnyLog {
    fn append(
        &mut self,
        group: GroupId,
        entries: &[warren_replication::raft::eraftpb::Entry],
        hard_state: Option<&warren_replication::raft::eraftpb::HardState>,
    ) -> Result<(), LogError> {
        match self {
            AnyLog::File(f) => f.append(group, entries, hard_state),
            AnyLog::Engine(e, _) => e.append(group, entries, hard_state),
        }
    }

    fn flush(&mut self, must_sync: bool) -> Result<(), LogError> {
        match self {
            AnyLog::File(f) => f.flush(must_sync),
            AnyLog::Engine(e, n) => {
                *n += u64::from(must_sync);
                e.flush(must_sync)
            }
        }
    }

    fn save_snapshot(
        &mut self,
        group: GroupId,
        snap: &warren_replication::StoredSnapshot,
    ) -> Result<(), LogError> {
        match self {
            AnyLog::File(f) => f.save_snapshot(group, snap),
            AnyLog::Engine(e, _) => e.save_snapshot(group, snap),
        }
    }

    fn clear_entries(
        &mut self,
        group: GroupId,
        hard_state: &warren_replication::raft::eraftpb::HardState,
    ) -> Result<(), LogError> {
        match self {
            AnyLog::File(f) => f.clear_entries(group, hard_state),
            AnyLog::Engine(e, _) => e.clear_entries(group, hard_state),
        }
    }

    fn compact_to(&mut self, group: GroupId, index: u64) -> Result<(), LogError> {
        match self {
            AnyLog::File(f) => f.compact_to(group, index),
            AnyLog::Engine(e, _) => e.compact_to(group, index),
        }
    }

    fn put_members(
        &mut self,
        group: GroupId,
        members: &warren_replication::Members,
    ) -> Result<(), LogError> {
        match self {
            AnyLog::File(f) => f.put_members(group, members),
            AnyLog::Engine(e, _) => e.put_members(group, members),
        }
    }
}
