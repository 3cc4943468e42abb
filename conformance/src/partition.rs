//! Network partitions between the nodes of a [`crate::cluster::TestCluster`] on one machine: every
//! cluster link (from node i to node j) goes through a proxy of its own, so a test can cut a node off
//! from the others while it keeps running and serving its clients.
//!
//! A cut link goes silent, as a partition makes it: what either side sends is read and thrown
//! away, nothing arrives, and new connections are taken and held silent too (no refusal, no reset:
//! the nodes notice only by their timers). Healing a link closes every connection that was silenced
//! (a real partition breaks them: their bytes are lost) and forwards new ones again. A link may
//! also be slowed: what crosses it arrives a set time later, in order.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

/// How often a proxy thread looks at its link's state while it waits for bytes.
const POLL: Duration = Duration::from_millis(20);

/// One direction of the cluster's traffic, from node `from` to node `to`.
struct Link {
    from: u64,
    to: u64,
    cut: AtomicBool,
    /// What crosses the link arrives this many milliseconds later.
    delay_ms: AtomicU64,
    /// Bumped when the link heals: connections of an older generation that were silenced close.
    generation: AtomicU64,
    /// Set when the proxies stop (the cluster is dropped).
    stopped: Arc<AtomicBool>,
}

/// A node's view of the cluster: each node (itself included) and the address it reaches it at.
pub type View = Vec<(u64, SocketAddr)>;

/// The proxies of a cluster's links.
pub struct Links {
    links: Vec<Arc<Link>>,
    stopped: Arc<AtomicBool>,
}

impl Links {
    /// Proxies for every ordered pair of the nodes in `real` (node, the address it listens on for
    /// its peers). Returns them with each node's view of the cluster: its own real address, and
    /// for each peer the proxy of the link to it.
    pub fn start(real: &[(u64, SocketAddr)]) -> (Links, Vec<(u64, View)>) {
        let stopped = Arc::new(AtomicBool::new(false));
        let mut links = Vec::new();
        let mut views = Vec::new();
        for &(from, own) in real {
            let mut view = vec![(from, own)];
            for &(to, target) in real.iter().filter(|(n, _)| *n != from) {
                let listener = TcpListener::bind("127.0.0.1:0").expect("a proxy port");
                let addr = listener.local_addr().expect("proxy address");
                let link = Arc::new(Link {
                    from,
                    to,
                    cut: AtomicBool::new(false),
                    delay_ms: AtomicU64::new(0),
                    generation: AtomicU64::new(0),
                    stopped: stopped.clone(),
                });
                let l = link.clone();
                thread::spawn(move || accept_loop(listener, target, l));
                links.push(link);
                view.push((to, addr));
            }
            view.sort();
            views.push((from, view));
        }
        (Links { links, stopped }, views)
    }

    /// Cuts node `n` off from every other node, both ways.
    pub fn cut(&self, n: u64) {
        for l in self.links.iter().filter(|l| l.from == n || l.to == n) {
            l.cut.store(true, Ordering::SeqCst);
        }
    }

    /// Delays what every other node sends node `n` by `by` (what `n` sends is not delayed), for
    /// the connections made from now on and those already open.
    pub fn delay_to(&self, n: u64, by: Duration) {
        for l in self.links.iter().filter(|l| l.to == n) {
            l.delay_ms.store(by.as_millis() as u64, Ordering::SeqCst);
        }
    }

    /// Heals every link of node `n`.
    pub fn heal(&self, n: u64) {
        for l in self.links.iter().filter(|l| l.from == n || l.to == n) {
            l.generation.fetch_add(1, Ordering::SeqCst);
            l.cut.store(false, Ordering::SeqCst);
        }
    }
}

impl Drop for Links {
    fn drop(&mut self) {
        self.stopped.store(true, Ordering::SeqCst);
    }
}

fn accept_loop(listener: TcpListener, target: SocketAddr, link: Arc<Link>) {
    if listener.set_nonblocking(true).is_err() {
        return;
    }
    while !link.stopped.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((inbound, _)) => {
                let l = link.clone();
                thread::spawn(move || serve(inbound, target, l));
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => thread::sleep(POLL),
            Err(_) => thread::sleep(POLL),
        }
    }
}

/// One connection through the link: forwarded while the link is whole; silent once cut, until the
/// link heals and the connection is closed.
fn serve(inbound: TcpStream, target: SocketAddr, link: Arc<Link>) {
    let generation = link.generation.load(Ordering::SeqCst);
    // A connection made while the link is cut never reaches the other side.
    let outbound = if link.cut.load(Ordering::SeqCst) {
        None
    } else {
        TcpStream::connect_timeout(&target, Duration::from_secs(1)).ok()
    };
    let Some(outbound) = outbound else {
        silent(&inbound, &link, generation);
        let _ = inbound.shutdown(Shutdown::Both);
        return;
    };
    let (Ok(a), Ok(b)) = (inbound.try_clone(), outbound.try_clone()) else {
        return;
    };
    let l = link.clone();
    let back = thread::spawn(move || pump(b, a, &l, generation));
    pump(inbound, outbound, &link, generation);
    let _ = back.join();
}

/// Reads and drops what `s` sends until the link heals (or the proxies stop).
fn silent(s: &TcpStream, link: &Link, generation: u64) {
    let _ = s.set_read_timeout(Some(POLL));
    let mut buf = [0u8; 16 * 1024];
    let mut r = s;
    while link.generation.load(Ordering::SeqCst) == generation
        && !link.stopped.load(Ordering::SeqCst)
    {
        match r.read(&mut buf) {
            Ok(0) => return,
            Ok(_) => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => return,
        }
    }
}

/// Copies `from` to `to` while the link is whole (each chunk held for the link's delay, if it
/// has one); once it is cut, drops what arrives; closes both when the link heals after a cut,
/// when either side closes, or when the proxies stop.
fn pump(mut from: TcpStream, to: TcpStream, link: &Link, generation: u64) {
    let _ = from.set_read_timeout(Some(POLL));
    let Ok(closer) = to.try_clone() else {
        return;
    };
    // A writer of its own, so that a delay holds each chunk back without slowing the reads.
    let (tx, rx) = mpsc::channel::<(Instant, Vec<u8>)>();
    let writer = thread::spawn(move || {
        let mut to = to;
        for (due, chunk) in rx {
            if let Some(wait) = due.checked_duration_since(Instant::now()) {
                thread::sleep(wait);
            }
            if to.write_all(&chunk).is_err() {
                return;
            }
        }
    });
    let mut buf = [0u8; 64 * 1024];
    loop {
        if link.stopped.load(Ordering::SeqCst)
            || link.generation.load(Ordering::SeqCst) != generation
        {
            break;
        }
        match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                if link.cut.load(Ordering::SeqCst) {
                    continue;
                }
                let due =
                    Instant::now() + Duration::from_millis(link.delay_ms.load(Ordering::SeqCst));
                if tx.send((due, buf[..n].to_vec())).is_err() {
                    break;
                }
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => break,
        }
    }
    drop(tx);
    let _ = from.shutdown(Shutdown::Both);
    // What was read before the end still goes out, unless the link was cut meanwhile.
    if link.generation.load(Ordering::SeqCst) != generation || link.stopped.load(Ordering::SeqCst) {
        let _ = closer.shutdown(Shutdown::Both);
    }
    let _ = writer.join();
    let _ = closer.shutdown(Shutdown::Both);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn echo_server() -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = l.local_addr().expect("addr");
        thread::spawn(move || {
            for s in l.incoming().flatten() {
                thread::spawn(move || {
                    let mut r = s.try_clone().expect("clone");
                    let mut w = s;
                    let _ = std::io::copy(&mut r, &mut w);
                });
            }
        });
        addr
    }

    fn round_trip(s: &mut TcpStream, msg: &[u8]) -> std::io::Result<Vec<u8>> {
        s.write_all(msg)?;
        let mut got = vec![0u8; msg.len()];
        s.read_exact(&mut got)?;
        Ok(got)
    }

    #[test]
    fn a_cut_link_is_silent_and_a_healed_one_forwards_new_connections() {
        let (links, views) = Links::start(&[(1, echo_server()), (2, echo_server())]);
        let via = |from: u64, to: u64| {
            let view = &views.iter().find(|(n, _)| *n == from).expect("view").1;
            view.iter().find(|(n, _)| *n == to).expect("peer").1
        };
        let mut s = TcpStream::connect(via(1, 2)).expect("connect");
        s.set_read_timeout(Some(Duration::from_millis(300)))
            .expect("timeout");
        assert_eq!(round_trip(&mut s, b"hello").expect("whole"), b"hello");

        links.cut(2);
        assert!(round_trip(&mut s, b"lost").is_err(), "nothing comes back");
        let mut during = TcpStream::connect(via(2, 1)).expect("a connection is taken");
        during
            .set_read_timeout(Some(Duration::from_millis(300)))
            .expect("timeout");
        assert!(round_trip(&mut during, b"lost").is_err());

        links.heal(2);
        let mut buf = [0u8; 8];
        thread::sleep(POLL * 3);
        assert!(
            matches!(s.read(&mut buf), Ok(0) | Err(_)),
            "a silenced connection is closed"
        );
        let mut after = TcpStream::connect(via(1, 2)).expect("connect");
        after
            .set_read_timeout(Some(Duration::from_millis(500)))
            .expect("timeout");
        assert_eq!(round_trip(&mut after, b"again").expect("healed"), b"again");

        // Delayed towards node 2 only: the echo comes back the delay later, in order.
        links.delay_to(2, Duration::from_millis(100));
        let sent = Instant::now();
        after.write_all(b"one").expect("write");
        after.write_all(b"two").expect("write");
        let mut got = [0u8; 6];
        after.read_exact(&mut got).expect("delayed, not lost");
        assert_eq!(&got, b"onetwo");
        assert!(sent.elapsed() >= Duration::from_millis(100));
    }
}
