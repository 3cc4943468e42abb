//! Real nodes in one process: loopback sockets on ephemeral ports, temporary log directories,
//! 10 ms ticks. Every wait is for a condition, bounded in time.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::*;

const SECRET: &[u8] = b"a cluster secret for the tests";
const WAIT: Duration = Duration::from_secs(15);
const G: GroupId = GroupId(1);

#[derive(Default)]
struct Seen {
    committed: Vec<Committed>,
    leaders: BTreeMap<GroupId, Option<NodeId>>,
    refused: Vec<(GroupId, Vec<u8>, Option<NodeId>)>,
    snapshots: Vec<(GroupId, StoredSnapshot)>,
    /// Snapshots handed over with what the preparer made of them.
    prepared: usize,
    peers: Vec<(NodeId, bool)>,
}

#[derive(Clone, Default)]
struct Recorder(Arc<Mutex<Seen>>);

impl Recorder {
    fn with<T>(&self, f: impl FnOnce(&Seen) -> T) -> T {
        f(&self.0.lock().unwrap())
    }
    fn data(&self, group: GroupId) -> Vec<Vec<u8>> {
        self.with(|s| {
            s.committed
                .iter()
                .filter(|c| c.group == group)
                .map(|c| c.data.to_vec())
                .collect()
        })
    }
    fn leader(&self, group: GroupId) -> Option<NodeId> {
        self.with(|s| s.leaders.get(&group).copied().flatten())
    }
    /// The snapshots handed over, by index, with their data.
    fn snapshots(&self, group: GroupId) -> Vec<(u64, Vec<u8>)> {
        self.with(|s| {
            s.snapshots
                .iter()
                .filter(|(g, _)| *g == group)
                .map(|(_, s)| (s.meta.index, s.data.to_vec()))
                .collect()
        })
    }
    /// The last entry committed in `group`, as a snapshot of everything up to it would be.
    fn last_meta(&self, group: GroupId) -> SnapshotMeta {
        self.with(|s| {
            s.committed
                .iter()
                .rev()
                .find(|c| c.group == group)
                .map(|c| SnapshotMeta {
                    index: c.index,
                    term: c.term,
                })
                .unwrap_or_default()
        })
    }
}

impl RaftEvents for Recorder {
    fn peers(&self, changes: Vec<(NodeId, bool)>) {
        self.0.lock().unwrap().peers.extend(changes);
    }
    fn snapshots(&self, snapshots: Vec<(GroupId, StoredSnapshot, Option<Prepared>)>) {
        let mut seen = self.0.lock().unwrap();
        for (g, s, prepared) in snapshots {
            // What the preparer below made of it, for a large one.
            if let Some(p) = prepared {
                let len = p.downcast::<usize>().expect("the preparer's");
                assert_eq!(*len, s.data.len());
                seen.prepared += 1;
            }
            seen.snapshots.push((g, s));
        }
    }
    fn preparer(&self) -> Option<Preparer> {
        Some(Arc::new(|_, data: bytes::Bytes| {
            Box::new(data.len()) as Prepared
        }))
    }
    fn committed(&self, entries: Vec<Committed>) {
        self.0.lock().unwrap().committed.extend(entries);
    }
    fn leaders(&self, changes: Vec<(GroupId, Option<NodeId>, u64)>, refused: Vec<Refused>) {
        let mut seen = self.0.lock().unwrap();
        seen.leaders
            .extend(changes.into_iter().map(|(g, l, _)| (g, l)));
        seen.refused.extend(refused);
    }
}

fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < WAIT, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Free loopback addresses: bound together so they differ, then released for the nodes.
fn addrs(n: usize) -> Vec<SocketAddr> {
    let ls: Vec<std::net::TcpListener> = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    ls.iter().map(|l| l.local_addr().unwrap()).collect()
}

struct Cluster {
    addrs: Vec<SocketAddr>,
    /// Peers are given as `localhost:PORT`, looked up at each dial.
    named: bool,
    dirs: Vec<tempfile::TempDir>,
    nodes: Vec<Option<RaftNode>>,
    seen: Vec<Recorder>,
    /// Each node's cluster TLS (none: plain TCP).
    tls: Vec<Option<ClusterTlsFiles>>,
    /// Snapshots larger than this go in pieces.
    inline_max: usize,
}

impl Cluster {
    fn config(&self, i: usize, secret: &[u8], boot: u64) -> ClusterConfig {
        let node = i as NodeId + 1;
        ClusterConfig {
            node,
            peers: (0..self.addrs.len())
                .filter(|j| *j != i)
                .map(|j| (j as NodeId + 1, self.peer(j)))
                .collect(),
            listen: self.addrs[i],
            secret: secret.to_vec(),
            tls: self.tls.get(i).cloned().flatten(),
            dir: self.dirs[i].path().to_path_buf(),
            tick_ms: 10,
            boot,
            // Small, so that a follower down for a few dozen entries needs a snapshot.
            snapshot_keep: 8,
            join: None,
            inline_max: self.inline_max,
        }
    }

    /// Node `j + 1`'s address for its peers: by name (`localhost`) when `named`.
    fn peer(&self, j: usize) -> PeerAddr {
        if self.named {
            PeerAddr::parse(&format!("localhost:{}", self.addrs[j].port())).unwrap()
        } else {
            PeerAddr::from(self.addrs[j])
        }
    }

    /// Three nodes; `secrets[i]` is node i + 1's.
    fn start(secrets: [&[u8]; 3]) -> Cluster {
        Self::start_with(secrets, false)
    }

    /// Three nodes, whose peers are given by name when `named`.
    fn start_with(secrets: [&[u8]; 3], named: bool) -> Cluster {
        Self::start_tls(secrets, named, vec![None, None, None])
    }

    /// Three nodes, node i + 1 with `tls[i]`.
    fn start_tls(secrets: [&[u8]; 3], named: bool, tls: Vec<Option<ClusterTlsFiles>>) -> Cluster {
        Self::start_all(secrets, named, tls, MAX_PROPOSAL)
    }

    /// Three nodes sending snapshots above `inline_max` bytes in pieces.
    fn start_pieced(inline_max: usize) -> Cluster {
        Self::start_all([SECRET; 3], false, vec![None, None, None], inline_max)
    }

    fn start_all(
        secrets: [&[u8]; 3],
        named: bool,
        tls: Vec<Option<ClusterTlsFiles>>,
        inline_max: usize,
    ) -> Cluster {
        let mut c = Cluster {
            named,
            addrs: addrs(3),
            dirs: (0..3).map(|_| tempfile::tempdir().unwrap()).collect(),
            nodes: Vec::new(),
            seen: Vec::new(),
            tls,
            inline_max,
        };
        for (i, secret) in secrets.iter().enumerate() {
            let seen = Recorder::default();
            let node = RaftNode::start(c.config(i, secret, 1), seen.clone()).unwrap();
            c.nodes.push(Some(node));
            c.seen.push(seen);
        }
        c
    }

    fn node(&self, id: NodeId) -> &RaftNode {
        self.nodes[id as usize - 1].as_ref().unwrap()
    }

    fn seen(&self, id: NodeId) -> &Recorder {
        &self.seen[id as usize - 1]
    }

    /// Once `on` are connected to each other: group `G` on each, node 1 campaigning (added
    /// last, so its vote requests find the group). Returns the leader all of `on` report; node
    /// 1 unless its first election lost a race.
    fn group_led(&self, on: &[NodeId]) -> NodeId {
        let others = on.len() as u64 - 1;
        wait_for("the nodes to connect", || {
            on.iter().all(|id| {
                let s = self.node(*id).stats();
                s.connections_out >= others && s.connections_in >= others
            })
        });
        for id in on.iter().rev() {
            self.node(*id).add_group(G, *id == 1);
        }
        let mut leader = None;
        wait_for("a leader known to all", || {
            let l = self.seen(on[0]).leader(G);
            leader = l.filter(|_| on.iter().all(|id| self.seen(*id).leader(G) == l));
            leader.is_some()
        });
        leader.unwrap_or_default()
    }

    fn stop(&mut self, id: NodeId) {
        if let Some(n) = self.nodes[id as usize - 1].take() {
            n.shutdown();
        }
    }

    fn restart(&mut self, id: NodeId, boot: u64) {
        let i = id as usize - 1;
        let seen = Recorder::default();
        let node = RaftNode::start(self.config(i, SECRET, boot), seen.clone()).unwrap();
        self.seen[i] = seen;
        self.nodes[i] = Some(node);
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for n in self.nodes.iter_mut().filter_map(Option::take) {
            n.shutdown();
        }
    }
}

fn payloads(range: std::ops::Range<u32>) -> Vec<Vec<u8>> {
    range.map(|i| format!("message {i}").into_bytes()).collect()
}

/// Peers given by name (`localhost:PORT`) are looked up when dialled: the nodes connect and
/// elect as with addresses.
#[test]
fn peers_given_by_name_are_looked_up_and_form_the_cluster() {
    let mut c = Cluster::start_with([SECRET; 3], true);
    let leader = c.group_led(&[1, 2, 3]);
    c.node(leader).propose(G, b"by name".to_vec());
    for id in 1..=3 {
        wait_for("the entry everywhere", || !c.seen(id).data(G).is_empty());
    }
    for id in 1..=3 {
        c.stop(id);
    }
    for id in 1..=3 {
        assert_eq!(c.seen(id).data(G), [b"by name".to_vec()], "node {id}");
    }
}

#[test]
fn a_thousand_proposals_commit_on_every_node_in_order_exactly_once() {
    let mut c = Cluster::start([SECRET; 3]);
    let leader = c.group_led(&[1, 2, 3]);
    let want = payloads(0..1000);
    for p in &want {
        c.node(leader).propose(G, p.clone());
    }
    for id in 1..=3 {
        wait_for("every entry everywhere", || {
            c.seen(id).data(G).len() >= 1000
        });
    }
    for id in 1..=3 {
        c.stop(id);
    }
    for id in 1..=3 {
        assert_eq!(c.seen(id).data(G), want, "node {id}");
        let indexes: Vec<u64> = c
            .seen(id)
            .with(|s| s.committed.iter().map(|e| e.index).collect());
        assert!(
            indexes.windows(2).all(|w| w[0] < w[1]),
            "node {id}: {indexes:?}"
        );
    }
}

#[test]
fn the_survivors_elect_and_commit_and_a_restarted_node_recovers_and_catches_up() {
    let mut c = Cluster::start([SECRET; 3]);
    let old = c.group_led(&[1, 2, 3]);
    let before = payloads(0..100);
    for p in &before {
        c.node(old).propose(G, p.clone());
    }
    for id in 1..=3 {
        wait_for("the first entries everywhere", || {
            c.seen(id).data(G).len() == 100
        });
    }
    c.stop(old);
    let survivors: Vec<NodeId> = (1..=3).filter(|id| *id != old).collect();
    let mut leader = None;
    wait_for("a survivor to lead", || {
        let l = c.seen(survivors[0]).leader(G);
        leader = l.filter(|l| *l != old && c.seen(survivors[1]).leader(G) == Some(*l));
        leader.is_some()
    });
    let leader = leader.unwrap_or_default();
    let after = payloads(100..150);
    for p in &after {
        c.node(leader).propose(G, p.clone());
    }
    let all: Vec<Vec<u8>> = before.iter().chain(&after).cloned().collect();
    for id in &survivors {
        wait_for("the new entries on the survivors", || {
            c.seen(*id).data(G).len() == 150
        });
        assert_eq!(c.seen(*id).data(G), all);
    }
    // First alone (its own address and its peers' moved away): what it commits can only come
    // from its log.
    let lonely = addrs(3);
    let mut cfg = c.config(old as usize - 1, SECRET, 2);
    cfg.listen = lonely[0];
    cfg.peers = [
        (survivors[0], PeerAddr::from(lonely[1])),
        (survivors[1], PeerAddr::from(lonely[2])),
    ]
    .into();
    let seen = Recorder::default();
    let alone = RaftNode::start(cfg, seen.clone()).unwrap();
    assert_eq!(alone.groups(), &[G]);
    wait_for("the old leader to recover", || seen.data(G).len() >= 100);
    alone.shutdown();
    assert_eq!(seen.data(G), before);
    // Then among its peers again.
    c.restart(old, 3);
    wait_for("the old leader to catch up", || {
        c.seen(old).data(G).len() >= 150
    });
    // Recovered entries first, from the first, then the missed ones; each once.
    assert_eq!(c.seen(old).data(G), all);
    wait_for("the old leader to learn the new one", || {
        c.seen(old).leader(G) == Some(leader)
    });
}

#[test]
fn a_follower_back_after_the_log_was_compacted_gets_a_snapshot_and_restarts_from_it() {
    let mut c = Cluster::start([SECRET; 3]);
    let state = bytes::Bytes::from_static(b"the state at 100");
    follower_back_after_compaction(&mut c, state, |c, _, down| {
        // Small: Raft writes it itself, and the state machine reads it.
        let s = c.node(down).stats();
        assert_eq!((s.staged_in, s.staged_used), (0, 0), "{s:?}");
        assert_eq!(c.seen(down).with(|s| s.prepared), 0);
    });
}

#[test]
fn a_large_snapshot_is_on_disk_before_raft_installs_it_and_a_restart_reads_it_back() {
    let mut c = Cluster::start([SECRET; 3]);
    let size = crate::cluster::node::STAGE_RECEIVED_ABOVE + 4096;
    let state: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
    follower_back_after_compaction(&mut c, state.into(), |c, _, down| {
        let s = c.node(down).stats();
        assert!(s.staged_in >= 1, "written by the writer thread: {s:?}");
        assert!(
            s.staged_used >= 1,
            "Raft found it written and only renamed it: {s:?}"
        );
        assert!(
            c.seen(down).with(|s| s.prepared) >= 1,
            "and it was read on the writer thread too"
        );
    });
}

#[test]
fn a_snapshot_larger_than_a_frame_reaches_the_follower_in_pieces() {
    // Snapshots above 1 KiB go in pieces of 256 bytes here (64 MiB and 4 MiB by default).
    let mut c = Cluster::start_pieced(1024);
    let state: Vec<u8> = (0..20_000u32).map(|i| (i % 253) as u8).collect();
    follower_back_after_compaction(&mut c, state.into(), |c, leader, down| {
        assert!(c.node(leader).stats().pieced_out >= 1);
        assert!(c.node(down).stats().pieced_in >= 1);
    });
}

/// A follower down while `state` is snapshotted and the log behind it compacted gets the
/// snapshot and the entries after it (then `caught_up` sees the leader and it), and starts
/// from them after a restart.
fn follower_back_after_compaction(
    c: &mut Cluster,
    state: bytes::Bytes,
    caught_up: impl FnOnce(&Cluster, NodeId, NodeId),
) {
    let leader = c.group_led(&[1, 2, 3]);
    let down = leader % 3 + 1;
    let up: Vec<NodeId> = (1..=3).filter(|id| *id != down).collect();
    c.stop(down);
    for p in payloads(0..100) {
        c.node(leader).propose(G, p);
    }
    for id in &up {
        wait_for("the entries on the two up", || {
            c.seen(*id).data(G).len() == 100
        });
    }
    // Each up node's state machine snapshots what it applied: the log before it goes.
    let meta = c.seen(leader).last_meta(G);
    for id in &up {
        assert_eq!(c.seen(*id).last_meta(G), meta);
        c.node(*id).snapshot(G, meta, state.clone());
    }
    let after = payloads(100..105);
    for p in &after {
        c.node(leader).propose(G, p.clone());
    }
    for id in &up {
        wait_for("the later entries", || c.seen(*id).data(G).len() == 105);
    }
    c.restart(down, 2);
    wait_for("the snapshot and the entries after it", || {
        c.seen(down).data(G).len() >= 5
    });
    assert_eq!(
        c.seen(down).snapshots(G),
        vec![(meta.index, state.to_vec())],
        "sent the snapshot: the entries it covers are gone from the leader's log"
    );
    assert_eq!(
        c.seen(down).data(G),
        after,
        "only what follows the snapshot"
    );
    caught_up(c, leader, down);
    // A restart starts from the snapshot it installed, then replays the entries after it.
    c.stop(down);
    c.restart(down, 3);
    wait_for("the entries after the snapshot again", || {
        c.seen(down).data(G).len() >= 5
    });
    assert_eq!(
        c.seen(down).snapshots(G),
        vec![(meta.index, state.to_vec())],
        "read back as it was installed"
    );
    assert_eq!(c.seen(down).data(G), after);
}

#[test]
fn a_peer_with_the_wrong_secret_reaches_no_raft_and_the_others_go_on() {
    let c = Cluster::start([SECRET, SECRET, b"not the cluster secret at all"]);
    c.node(3).add_group(G, false);
    let leader = c.group_led(&[1, 2]);
    let want = payloads(0..10);
    for p in &want {
        c.node(leader).propose(G, p.clone());
    }
    for id in [1, 2] {
        wait_for("entries on the right peers", || {
            c.seen(id).data(G).len() == 10
        });
        assert_eq!(c.seen(id).data(G), want);
    }
    // Both directions were tried and refused by the nodes with the right secret.
    wait_for("refusals", || {
        c.node(1).stats().refused > 0 && c.node(2).stats().refused > 0
    });
    // Nor does a stranger that skips the listener's proof and makes one up.
    let refused = c.node(1).stats().refused;
    let mut s = TcpStream::connect(c.addrs[0]).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    let mut hello = b"WRNRAFT1".to_vec();
    for v in [3u64, 1] {
        hello.extend_from_slice(&v.to_be_bytes());
    }
    hello.extend_from_slice(&[7; 32]);
    s.write_all(&hello).unwrap();
    let mut answer = [0u8; 80];
    s.read_exact(&mut answer).unwrap();
    s.write_all(&[0; 32]).unwrap();
    assert_closed(s);
    wait_for("the stranger refused", || {
        c.node(1).stats().refused > refused
    });
    let s3 = c.node(3).stats();
    assert_eq!(s3.batches_in, 0, "{s3:?}");
    assert_eq!(s3.connections_in + s3.connections_out, 0, "{s3:?}");
    assert!(c.seen(3).data(G).is_empty());
    assert_eq!(c.seen(3).leader(G), None);
}

/// A connection to `addr` that authenticates as node `as_node`, as a member would.
fn member_connection(addr: SocketAddr, as_node: NodeId, to: NodeId) -> TcpStream {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let std_stream = rt.block_on(async {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        auth::dial(&mut s, SECRET, as_node, to, false)
            .await
            .unwrap();
        s.into_std().unwrap()
    });
    std_stream.set_nonblocking(false).unwrap();
    std_stream.set_read_timeout(Some(WAIT)).unwrap();
    std_stream
}

/// The node closed the connection (a read sees the end, not the timeout).
fn assert_closed(mut s: TcpStream) {
    let mut b = [0u8; 16];
    match s.read(&mut b) {
        Ok(0) => {}
        Ok(_) => panic!("the node wrote after the handshake"),
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        Err(e) => panic!("connection still open: {e}"),
    }
}

#[test]
fn a_huge_frame_or_garbage_after_the_handshake_drops_the_connection_and_nothing_else() {
    let c = Cluster::start([SECRET; 3]);
    let leader = c.group_led(&[1, 2, 3]);
    // The test poses as another member on a second connection of its own.
    let (victim, posing) = (leader, leader % 3 + 1);
    let addr = c.addrs[victim as usize - 1];
    let bad = |n: u64| {
        wait_for("the bad frame counted", || {
            c.node(victim).stats().bad_frames == n
        });
    };
    // A length far above the maximum.
    let mut s = member_connection(addr, posing, victim);
    s.write_all(&[0xff, 0xff, 0xff, 0xf0, 1, 2, 3, 4]).unwrap();
    assert_closed(s);
    bad(1);
    // A frame too short for a batch header.
    let mut s = member_connection(addr, posing, victim);
    s.write_all(&[0, 0, 0, 5, 1, 2, 3, 4, 5]).unwrap();
    assert_closed(s);
    bad(2);
    // A well-formed header, then bytes that are no Raft message.
    let mut frame = Vec::new();
    for v in [posing, 1, victim, 1] {
        frame.extend_from_slice(&v.to_be_bytes());
    }
    frame.extend_from_slice(&[0, 0, 0, 4, 0xff, 0xff, 0xff, 0xff]);
    let mut s = member_connection(addr, posing, victim);
    s.write_all(&(frame.len() as u32).to_be_bytes()).unwrap();
    s.write_all(&frame).unwrap();
    assert_closed(s);
    bad(3);
    // A good batch on the wrong link: it says it comes from the node it is sent to.
    let mut frame = Vec::new();
    for v in [victim, 1, victim] {
        frame.extend_from_slice(&v.to_be_bytes());
    }
    let mut s = member_connection(addr, posing, victim);
    s.write_all(&(frame.len() as u32).to_be_bytes()).unwrap();
    s.write_all(&frame).unwrap();
    assert_closed(s);
    bad(4);
    let want = payloads(0..10);
    for p in &want {
        c.node(leader).propose(G, p.clone());
    }
    for id in 1..=3 {
        wait_for("entries after the bad frames", || {
            c.seen(id).data(G).len() == 10
        });
        assert_eq!(c.seen(id).data(G), want);
    }
}

/// The parts of the entries `id` committed for `group`, in order: a joined entry's each.
fn parts(c: &Cluster, id: NodeId, group: GroupId) -> Vec<Vec<u8>> {
    c.seen(id)
        .data(group)
        .into_iter()
        .flat_map(warren_replication::batch::split_owned)
        .collect()
}

#[test]
fn joinable_proposals_share_entries_and_split_back_in_order_everywhere() {
    let mut c = Cluster::start([SECRET; 3]);
    let leader = c.group_led(&[1, 2, 3]);
    let want = payloads(0..1000);
    for p in &want {
        c.node(leader).propose_joinable(G, p.clone());
    }
    for id in 1..=3 {
        wait_for("every proposal everywhere", || {
            parts(&c, id, G).len() >= 1000
        });
    }
    let stats = c.node(leader).stats();
    for id in 1..=3 {
        c.stop(id);
    }
    for id in 1..=3 {
        assert_eq!(parts(&c, id, G), want, "node {id}");
        let entries = c.seen(id).data(G).len();
        assert!(
            entries < 1000,
            "node {id}: {entries} entries for 1000 proposals"
        );
    }
    assert!(stats.joined_entries >= 1, "{stats:?}");
    assert!(stats.joined_parts > stats.joined_entries, "{stats:?}");
    // A follower's are handed back whole, for the broker to split.
    let follower = leader % 3 + 1;
    let c = Cluster::start([SECRET; 3]);
    let leader = c.group_led(&[1, 2, 3]);
    let follower = if follower == leader {
        leader % 3 + 1
    } else {
        follower
    };
    for p in payloads(0..3) {
        c.node(follower).propose_joinable(G, p);
    }
    wait_for("the refusals", || {
        c.seen(follower).with(|s| !s.refused.is_empty())
    });
    wait_for("every refusal", || {
        c.seen(follower).with(|s| {
            s.refused
                .iter()
                .flat_map(|(_, d, _)| warren_replication::batch::split_owned(d.clone()))
                .count()
                == 3
        })
    });
    let refused: Vec<Vec<u8>> = c.seen(follower).with(|s| {
        s.refused
            .iter()
            .flat_map(|(_, d, _)| warren_replication::batch::split_owned(d.clone()))
            .collect()
    });
    assert_eq!(refused, payloads(0..3));
}

#[test]
fn a_proposal_on_a_follower_is_refused_with_the_leader() {
    let c = Cluster::start([SECRET; 3]);
    let leader = c.group_led(&[1, 2, 3]);
    let follower = leader % 3 + 1;
    c.node(follower).propose(G, b"to the follower".to_vec());
    c.node(follower)
        .propose(GroupId(77), b"to no group".to_vec());
    wait_for("the refusals", || {
        c.seen(follower).with(|s| s.refused.len()) == 2
    });
    assert_eq!(
        c.seen(follower).with(|s| s.refused.clone()),
        vec![
            (G, b"to the follower".to_vec(), Some(leader)),
            (GroupId(77), b"to no group".to_vec(), None)
        ]
    );
    assert!(c.seen(follower).data(G).is_empty());
}

/// Node 1's configuration with these peers (tests of a node alone, or with a peer that is down).
fn node_one(
    peers: BTreeMap<NodeId, SocketAddr>,
    listen: SocketAddr,
    dir: &std::path::Path,
) -> ClusterConfig {
    ClusterConfig {
        node: 1,
        peers: peers
            .into_iter()
            .map(|(id, addr)| (id, PeerAddr::from(addr)))
            .collect(),
        listen,
        secret: SECRET.to_vec(),
        tls: None,
        dir: dir.to_path_buf(),
        tick_ms: 10,
        boot: 1,
        snapshot_keep: 4096,
        join: None,
        inline_max: MAX_PROPOSAL,
    }
}

#[test]
fn a_peer_that_is_down_costs_a_few_dials_not_a_busy_loop() {
    let a = addrs(2);
    let dir = tempfile::tempdir().unwrap();
    let cfg = node_one([(2, a[1])].into(), a[0], dir.path());
    let node = RaftNode::start(cfg, Recorder::default()).unwrap();
    node.add_group(G, true);
    wait_for("a first failed dial", || node.stats().dial_failures >= 1);
    std::thread::sleep(Duration::from_millis(400));
    // Back-off from 50 ms, doubling: about 4 dials in 400 ms; a loop without one makes thousands.
    let s = node.stats();
    assert!(s.dial_failures <= 10, "{s:?}");
    // What Raft sent meanwhile (heartbeats, votes) was dropped and counted.
    assert!(s.dropped_out > 0, "{s:?}");
    node.shutdown();
}

#[test]
fn shutdown_from_async_code_closes_the_listener_without_a_panic() {
    let a = addrs(2);
    let dir = tempfile::tempdir().unwrap();
    let cfg = node_one([(2, a[1])].into(), a[0], dir.path());
    let node = RaftNode::start(cfg.clone(), Recorder::default()).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(async move { node.shutdown() });
    // The address and the log directory are free again at once.
    let again = RaftNode::start(ClusterConfig { boot: 2, ..cfg }, Recorder::default()).unwrap();
    again.shutdown();
}

#[test]
fn one_node_groups_added_twice_removed_and_a_proposal_too_large() {
    let a = addrs(1);
    let dir = tempfile::tempdir().unwrap();
    let cfg = node_one(BTreeMap::new(), a[0], dir.path());
    let seen = Recorder::default();
    let node = RaftNode::start(cfg.clone(), seen.clone()).unwrap();
    for g in [G, GroupId(2), G] {
        node.add_group(g, true);
    }
    node.propose(G, b"one".to_vec());
    node.propose(GroupId(2), b"two".to_vec());
    wait_for("both entries", || seen.with(|s| s.committed.len()) == 2);
    // Again once it holds an entry: nothing changes.
    node.add_group(G, true);
    node.propose(G, b"three".to_vec());
    wait_for("the third entry", || seen.with(|s| s.committed.len()) == 3);
    node.remove_group(GroupId(2));
    // Too large for a frame: refused, not left to stall the group.
    node.propose(G, vec![0; MAX_PROPOSAL + 1]);
    wait_for("the large proposal refused", || {
        seen.with(|s| s.refused.len()) == 1
    });
    assert_eq!(seen.with(|s| s.refused[0].1.len()), MAX_PROPOSAL + 1);
    node.shutdown();
    let want = vec![b"one".to_vec(), b"three".to_vec()];
    assert_eq!(seen.data(G), want);
    assert_eq!(
        seen.with(|s| s.committed.iter().map(|c| c.index).collect::<Vec<_>>()),
        vec![2, 2, 3],
        "each group's first entry follows its leader's empty one"
    );
    let seen = Recorder::default();
    let node = RaftNode::start(ClusterConfig { boot: 2, ..cfg }, seen.clone()).unwrap();
    assert_eq!(node.groups(), &[G]);
    wait_for("the entries recovered", || seen.data(G).len() == 2);
    assert_eq!(seen.data(G), want);
    node.shutdown();
}

/// Certificates for cluster TLS tests, made with rcgen in a temporary directory.
struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    fn new() -> Pki {
        Pki {
            dir: tempfile::tempdir().unwrap(),
        }
    }

    fn write(&self, name: &str, pem: &str) -> std::path::PathBuf {
        let path = self.dir.path().join(name);
        std::fs::write(&path, pem).unwrap();
        path
    }

    /// A CA named `name`: its certificate's file and its issuer.
    fn ca(&self, name: &str) -> (std::path::PathBuf, rcgen::Issuer<'static, rcgen::KeyPair>) {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose};
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        let file = self.write(&format!("{name}.pem"), &cert.pem());
        (file, rcgen::Issuer::new(params, key))
    }

    /// A node's certificate for `hosts`, signed by `issuer`, trusting `ca`.
    fn node(
        &self,
        name: &str,
        hosts: &[&str],
        issuer: &rcgen::Issuer<'static, rcgen::KeyPair>,
        ca: &std::path::Path,
    ) -> ClusterTlsFiles {
        use rcgen::{CertificateParams, DnType, ExtendedKeyUsagePurpose, KeyPair};
        let hosts: Vec<String> = hosts.iter().map(|h| h.to_string()).collect();
        let mut params = CertificateParams::new(hosts).unwrap();
        params.distinguished_name.push(DnType::CommonName, name);
        // Each node is the server of the links it accepts and the client of those it dials.
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, issuer).unwrap();
        ClusterTlsFiles {
            cert: self.write(&format!("{name}.pem"), &cert.pem()),
            key: self.write(&format!("{name}.key"), &key.serialize_pem()),
            ca: ca.to_path_buf(),
        }
    }
}

/// Every link over TLS, by name and by address: the group elects and commits on every node,
/// and no connection is refused.
#[test]
fn nodes_with_certificates_from_the_cluster_ca_replicate_over_tls() {
    for named in [true, false] {
        let pki = Pki::new();
        let (ca, issuer) = pki.ca("cluster-ca");
        let host = if named { "localhost" } else { "127.0.0.1" };
        let tls = (1..=3)
            .map(|i| Some(pki.node(&format!("node-{i}"), &[host], &issuer, &ca)))
            .collect();
        let mut c = Cluster::start_tls([SECRET; 3], named, tls);
        let leader = c.group_led(&[1, 2, 3]);
        let want = payloads(0..50);
        for p in &want {
            c.node(leader).propose(G, p.clone());
        }
        for id in 1..=3 {
            wait_for("every entry everywhere", || {
                c.seen(id).data(G).len() >= want.len()
            });
        }
        for id in 1..=3 {
            assert_eq!(c.node(id).stats().refused, 0, "node {id}, named {named}");
            c.stop(id);
            assert_eq!(c.seen(id).data(G), want, "node {id}, named {named}");
        }
    }
}

/// A node is refused by its peers when its certificate is signed by another CA, names
/// another host, or when it has no TLS at all; the other two go on.
#[test]
fn a_node_without_a_certificate_the_cluster_trusts_reaches_no_raft() {
    let pki = Pki::new();
    let (ca, issuer) = pki.ca("cluster-ca");
    let (_, rogue) = pki.ca("rogue-ca");
    let good = |i: u32| Some(pki.node(&format!("node-{i}"), &["localhost"], &issuer, &ca));
    let cases = [
        (
            "signed by another CA",
            Some(pki.node("rogue-3", &["localhost"], &rogue, &ca)),
        ),
        (
            "for another host",
            Some(pki.node("elsewhere-3", &["warren.invalid"], &issuer, &ca)),
        ),
        ("without TLS", None),
    ];
    for (what, third) in cases {
        let files = third.clone();
        let c = Cluster::start_tls([SECRET; 3], true, vec![good(1), good(2), third]);
        c.node(3).add_group(G, false);
        let leader = c.group_led(&[1, 2]);
        c.node(leader).propose(G, b"between the two".to_vec());
        for id in [1, 2] {
            wait_for("the entry on the trusted nodes", || {
                !c.seen(id).data(G).is_empty()
            });
        }
        // Refused where the certificate is checked: by the listener (a dialer's chain), or
        // by the dialer (the listener's chain and name), which the listener sees end.
        let total =
            |f: fn(&ClusterStats) -> u64| (1..=3).map(|id| f(&c.node(id).stats())).sum::<u64>();
        wait_for("node 3's links refused", || {
            total(|s| s.refused) >= 2 && total(|s| s.dial_failures) >= 2
        });
        let s3 = c.node(3).stats();
        assert_eq!(s3.batches_in, 0, "{what}: {s3:?}");
        // Neither way: each side checks the other's certificate before the link is up.
        assert_eq!(s3.connections_in + s3.connections_out, 0, "{what}: {s3:?}");
        assert!(c.seen(3).data(G).is_empty(), "{what}");
        // A certificate renewed on disk is read at the next link: node 3 joins in.
        if let Some(files) = files.filter(|_| what == "signed by another CA") {
            let renewed = pki.node("renewed-3", &["localhost"], &issuer, &ca);
            for (from, to) in [(&renewed.cert, &files.cert), (&renewed.key, &files.key)] {
                std::fs::copy(from, to).unwrap();
            }
            wait_for("node 3 to catch up with its renewed certificate", || {
                !c.seen(3).data(G).is_empty()
            });
        }
    }
}
