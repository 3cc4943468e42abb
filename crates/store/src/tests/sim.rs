//! A simulation of the broker core on a real store with faults injected: random publishes
//! (with confirms), gets, acks, requeues, rejects (dead-lettered from `work` to `dlq`),
//! delayed messages, purges, queue deletions, time passing, failing and half-done writes, and
//! crashes (the store dropped without its clean marker and recovered from disk, as after
//! `kill -9`: only what was written survives). The group commit is the server's own
//! (`GroupCommit`), driven here as the store thread drives it.
//!
//! What must hold: every confirmed message is found at the end (after a last crash and
//! recovery) unless something may legitimately have removed it (an ack, a purge or delete of
//! a queue it may be in, a reject without a dead-letter target), and nothing is ever
//! delivered that was not published.
//!
//! `WARREN_SIM_CASES` sets the number of cases (default 16), `WARREN_SIM_SEED` the first
//! seed, `WARREN_SIM_STEPS` the steps per case, `WARREN_SIM_TRACE` how many of the last steps
//! a failure shows (with its seed); `work` deduplicates messages unless `WARREN_SIM_DEDUP=0`
//! (a redriven message must not be taken for a duplicate of itself).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use bytes::Bytes;
use warren_broker::{Broker, BrokerConfig, DeclareQueue, Delivery, Message};
use warren_codec::{FieldTable, FieldValue, ShortStr};

use crate::faults::Fault;
use crate::{GroupCommit, Outcome, Store, StorePager};

/// A small deterministic generator (xorshift64*): a failing seed replays exactly.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

const QUEUES: [&str; 4] = ["work", "dlq", "other", "later"];
/// `later`'s delivery delay.
const DELAY_MS: u64 = 50;

/// What the model knows of one published message.
#[derive(Default, Debug)]
struct Rec {
    confirmed: bool,
    /// Something may legitimately have removed it.
    may_be_gone: bool,
    /// Queues it may be in (a dead letter adds `dlq`; a crash may undo the move).
    queues: BTreeSet<&'static str>,
}

struct Sim {
    dir: tempfile::TempDir,
    store: Option<Arc<Store>>,
    broker: Broker,
    commit: GroupCommit,
    now: u64,
    next_msg: u64,
    recs: BTreeMap<String, Rec>,
    /// Publishes waiting for their batch: (message, batch).
    pending: Vec<(String, u64)>,
    held: Vec<Delivery>,
    /// Percent of writes that fail, and whether a failure may be half done.
    fail_percent: u64,
    torn: bool,
    rng_faults: u64,
    trace: Vec<String>,
    /// What the current step did, for the trace.
    note: String,
    stats: Stats,
}

#[derive(Default, Debug, Clone, Copy)]
struct Stats {
    published: u64,
    confirmed: u64,
    nacked: u64,
    delivered: u64,
    crashes: u64,
    failed_writes: u64,
    redriven: u64,
    checked: u64,
}

fn args(q: &str) -> FieldTable {
    let mut a = FieldTable::new();
    match q {
        "work" => {
            if env("WARREN_SIM_DEDUP") != Some(0) {
                a.insert(
                    ShortStr::from_static("x-message-deduplication"),
                    FieldValue::Bool(true),
                );
            }
            a.insert(
                ShortStr::from_static("x-dead-letter-exchange"),
                FieldValue::long_str(""),
            );
            a.insert(
                ShortStr::from_static("x-dead-letter-routing-key"),
                FieldValue::long_str("dlq"),
            );
        }
        "later" => {
            a.insert(
                ShortStr::from_static("x-delivery-delay"),
                FieldValue::I32(DELAY_MS as i32),
            );
        }
        _ => {}
    }
    a
}

/// delivery-mode 2 and the message's name as its message-id.
fn properties(name: &str) -> Bytes {
    let mut p = vec![0x10, 0x80, 2, name.len() as u8];
    p.extend_from_slice(name.as_bytes());
    Bytes::from(p)
}

fn declare(b: &mut Broker, q: &'static str) {
    b.declare_queue(
        "/",
        DeclareQueue {
            name: ShortStr::from_static(q),
            passive: false,
            durable: true,
            exclusive: false,
            auto_delete: false,
            arguments: args(q),
        },
        1,
    )
    .expect("declare");
}

fn new_broker(store: &Arc<Store>) -> Broker {
    let mut b = Broker::new(BrokerConfig {
        persistence: true,
        // Small windows: queues page out and read back within a few messages.
        page_window: 4,
        page_window_idle: 2,
        ..BrokerConfig::default()
    });
    b.set_pager(Box::new(StorePager(store.clone())));
    b
}

impl Sim {
    fn new() -> Sim {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(Store::open(dir.path()).expect("open"));
        let mut broker = new_broker(&store);
        for q in QUEUES {
            declare(&mut broker, q);
        }
        // The declarations are on disk before the first step (a crash then would only leave
        // queues missing, which the clients redeclare anyway).
        let mut batches = Vec::new();
        while let Some(b) = broker.take_writes() {
            batches.push(b);
        }
        store.write(&batches).expect("write");
        Sim {
            dir,
            store: Some(store),
            broker,
            commit: GroupCommit::default(),
            now: 1_000,
            next_msg: 0,
            recs: BTreeMap::new(),
            pending: Vec::new(),
            held: Vec::new(),
            fail_percent: 0,
            torn: false,
            rng_faults: 1,
            trace: Vec::new(),
            note: String::new(),
            stats: Stats::default(),
        }
    }

    fn store(&self) -> &Arc<Store> {
        self.store.as_ref().expect("store open")
    }

    fn set_faults(&mut self, percent: u64, torn: bool) {
        self.fail_percent = percent;
        self.torn = torn;
        let mut rng = Rng(self.rng_faults | 1);
        self.rng_faults = self.rng_faults.wrapping_add(0x9e37_79b9);
        self.store().set_faults(move |_| {
            if rng.below(100) >= percent {
                Fault::None
            } else if torn && rng.chance(50) {
                Fault::FailAfterWrite
            } else {
                Fault::Fail
            }
        });
    }

    fn publish(&mut self, q: &'static str) {
        let name = format!("m{}", self.next_msg);
        self.next_msg += 1;
        let m = Message {
            exchange: ShortStr::empty(),
            routing_key: ShortStr::from_static(q),
            properties: properties(&name),
            body: Bytes::from(name.clone().into_bytes()),
            persistent: true,
            store_key: None,
            away: None,
        };
        let routed = self
            .broker
            .publish("/", "", q, m, self.now)
            .expect("publish");
        self.note = format!("{name} batch {:?}", routed.batch);
        self.stats.published += 1;
        let mut rec = Rec::default();
        rec.queues.insert(q);
        match routed.batch {
            Some(n) => self.pending.push((name.clone(), n)),
            // The session confirms at once what waits for no write.
            None if routed.queues > 0 && !routed.rejected => rec.confirmed = true,
            None => {}
        }
        self.recs.insert(name, rec);
    }

    /// The store thread's part: the broker's writes join the group, which is written.
    fn flush(&mut self) {
        while let Some(batch) = self.broker.take_writes() {
            let n = batch.number;
            if self.commit.push(batch) {
                self.settle_confirms(n, false);
            }
        }
        let store = self.store().clone();
        match self.commit.write(&store) {
            None => {}
            Some(Outcome::Written { last, .. }) => {
                self.note = format!("written to {last}");
                self.settle_confirms(last, true);
                self.broker.writes_done(last);
            }
            Some(Outcome::Failed {
                last, nack, error, ..
            }) => {
                self.note = format!("failed to {last} ({error})");
                self.stats.failed_writes += 1;
                if nack {
                    self.settle_confirms(last, false);
                }
            }
        }
    }

    fn settle_confirms(&mut self, upto: u64, ok: bool) {
        let (done, waiting): (Vec<_>, Vec<_>) =
            self.pending.drain(..).partition(|(_, b)| *b <= upto);
        self.pending = waiting;
        for (name, _) in done {
            if ok {
                self.stats.confirmed += 1;
                if let Some(r) = self.recs.get_mut(&name) {
                    r.confirmed = true;
                }
            } else {
                self.stats.nacked += 1;
            }
        }
    }

    fn seen(&mut self, d: &Delivery) {
        let body = String::from_utf8_lossy(&d.message.body).into_owned();
        assert!(
            self.recs.contains_key(&body),
            "delivered '{body}', which nobody published"
        );
        self.stats.delivered += 1;
    }

    fn get(&mut self, q: &'static str) {
        if let Ok(Some((d, _))) = self.broker.get("/", q, false, 1) {
            self.note = String::from_utf8_lossy(&d.message.body).into_owned();
            self.seen(&d);
            self.held.push(d);
        }
    }

    fn take_held(&mut self, rng: &mut Rng) -> Option<(Delivery, String)> {
        if self.held.is_empty() {
            return None;
        }
        let i = rng.below(self.held.len() as u64) as usize;
        let d = self.held.swap_remove(i);
        let body = String::from_utf8_lossy(&d.message.body).into_owned();
        self.note = format!("{body} from {}", d.queue_name);
        Some((d, body))
    }

    fn ack(&mut self, rng: &mut Rng) {
        if let Some((d, body)) = self.take_held(rng) {
            if self.broker.settle(d.queue, d.receipt) {
                if let Some(r) = self.recs.get_mut(&body) {
                    r.may_be_gone = true;
                }
            }
        }
    }

    fn requeue(&mut self, rng: &mut Rng) {
        if let Some((d, _)) = self.take_held(rng) {
            self.broker.requeue(d.queue, d.receipt);
        }
    }

    fn reject(&mut self, rng: &mut Rng) {
        if let Some((d, body)) = self.take_held(rng) {
            // Dead-lettered to `dlq` if it exists; else dropped, as RabbitMQ drops it.
            let from_work = &*d.queue_name == "work" && self.broker.queue_id("/", "dlq").is_some();
            if self.broker.discard(d.queue, d.receipt) {
                if let Some(r) = self.recs.get_mut(&body) {
                    if from_work {
                        r.queues.insert("dlq");
                    } else {
                        r.may_be_gone = true;
                    }
                }
            }
        }
    }

    /// `warren redrive` / the API's move, one message: taken from `dlq`, published to
    /// `work` and acked in `dlq`, in the same store write.
    fn redrive(&mut self) {
        let Ok(Some((d, _))) = self.broker.get("/", "dlq", false, 1) else {
            return;
        };
        self.seen(&d);
        let body = String::from_utf8_lossy(&d.message.body).into_owned();
        self.note = body.clone();
        let message = Message {
            exchange: ShortStr::empty(),
            routing_key: ShortStr::from_static("work"),
            properties: d.message.properties.clone(),
            body: d.message.body.clone(),
            persistent: d.message.persistent,
            store_key: None,
            away: None,
        };
        match self.broker.publish("/", "", "work", message, self.now) {
            Ok(r) if r.queues > 0 && !r.rejected => {
                self.stats.redriven += 1;
                self.broker.settle(d.queue, d.receipt);
                if let Some(rec) = self.recs.get_mut(&body) {
                    rec.queues.insert("work");
                }
            }
            _ => {
                self.broker.release(d.queue, d.receipt);
            }
        }
    }

    /// Every message that may be in `q` may be gone.
    fn forget(&mut self, q: &str) {
        for r in self.recs.values_mut() {
            if r.queues.contains(q) {
                r.may_be_gone = true;
            }
        }
        self.held.retain(|d| &*d.queue_name != q);
    }

    fn purge(&mut self, q: &'static str) {
        self.forget(q);
        // Delayed copies do not belong to the queue's ready messages; they may go too.
        let _ = self.broker.purge_queue("/", q, 1);
    }

    fn delete_and_redeclare(&mut self, q: &'static str) {
        self.forget(q);
        self.broker
            .delete_queue("/", q, false, false, 1)
            .expect("delete");
        declare(&mut self.broker, q);
    }

    fn advance(&mut self, ms: u64) {
        self.now += ms;
        self.broker.tick(self.now);
    }

    /// kill -9: what is not written is gone; the store is reopened without its clean marker
    /// and recovered.
    fn crash(&mut self) {
        self.stats.crashes += 1;
        self.held.clear();
        // Unconfirmed publishes stay unconfirmed: their connection is gone.
        self.pending.clear();
        self.commit = GroupCommit::default();
        let store = self.store.take().expect("store");
        let placeholder = Broker::new(BrokerConfig::default());
        drop(std::mem::replace(&mut self.broker, placeholder));
        let store = Arc::into_inner(store).expect("the broker held the only other handle");
        drop(store);
        let store = Arc::new(Store::open(self.dir.path()).expect("reopen"));
        let mut broker = new_broker(&store);
        let r = store.recover(&mut broker).expect("recover");
        assert_eq!(r.quarantined, 0, "recovery found damage: {r:?}");
        self.broker = broker;
        self.store = Some(store);
        // The faults stay as they were (a new hook on the new store).
        let (p, t) = (self.fail_percent, self.torn);
        self.set_faults(p, t);
        // Clients redeclare what they use (a declaration lost with an unwritten batch).
        for q in QUEUES {
            if self.broker.queue_id("/", q).is_none() {
                declare(&mut self.broker, q);
            }
        }
        self.broker.tick(self.now);
    }

    fn step(&mut self, rng: &mut Rng) {
        let q = QUEUES[rng.below(QUEUES.len() as u64) as usize];
        let roll = rng.below(100);
        let what = match roll {
            0..=29 => {
                self.publish(q);
                "publish"
            }
            30..=44 => {
                self.flush();
                "flush"
            }
            45..=59 => {
                self.get(q);
                "get"
            }
            60..=69 => {
                self.ack(rng);
                "ack"
            }
            70..=74 => {
                self.requeue(rng);
                "requeue"
            }
            75..=79 => {
                self.reject(rng);
                "reject"
            }
            80..=84 => {
                self.advance(rng.below(DELAY_MS * 2));
                "advance"
            }
            // Rare: each may remove every message the queue may hold, which the check
            // can then no longer look for.
            85..=86 if rng.chance(20) => {
                self.purge(q);
                "purge"
            }
            87 if rng.chance(20) => {
                self.delete_and_redeclare(q);
                "delete"
            }
            85..=87 => {
                self.flush();
                "flush"
            }
            88..=92 => {
                let percent = [0, 0, 30, 100][rng.below(4) as usize];
                let torn = rng.chance(30);
                self.set_faults(percent, torn);
                "faults"
            }
            93..=94 => {
                self.crash();
                "crash"
            }
            95..=96 => {
                self.redrive();
                "redrive"
            }
            _ => {
                // A write that goes through now and then, whatever the faults.
                self.flush();
                "flush"
            }
        };
        let note = std::mem::take(&mut self.note);
        self.trace.push(format!("{what} {q} {note}"));
    }

    /// The disk works again, the last writes are done, a crash, everything is due: every
    /// confirmed message that nothing may have removed must be in some queue.
    fn check(&mut self) {
        self.store().clear_faults();
        self.fail_percent = 0;
        while !self.commit.is_empty() || self.broker.has_writes() {
            self.flush();
        }
        self.crash();
        self.store().clear_faults();
        self.fail_percent = 0;
        self.advance(DELAY_MS * 10);
        let mut found = BTreeSet::new();
        for q in QUEUES {
            while let Ok(Some((d, _))) = self.broker.get("/", q, true, 1) {
                self.seen(&d);
                found.insert(String::from_utf8_lossy(&d.message.body).into_owned());
            }
        }
        for (name, r) in &self.recs {
            if r.confirmed && !r.may_be_gone {
                self.stats.checked += 1;
                assert!(
                    found.contains(name),
                    "confirmed message {name} ({r:?}) is lost"
                );
            }
        }
    }
}

fn run_case(seed: u64, steps: usize) -> Stats {
    let mut rng = Rng(seed | 1);
    let mut sim = Sim::new();
    sim.rng_faults = seed;
    let run = std::panic::AssertUnwindSafe(|| {
        for _ in 0..steps {
            sim.step(&mut rng);
        }
        sim.check();
    });
    if let Err(e) = std::panic::catch_unwind(run) {
        let keep = env("WARREN_SIM_TRACE").unwrap_or(60) as usize;
        let tail: Vec<_> = sim.trace.iter().rev().take(keep).rev().collect();
        eprintln!(
            "simulation failed: seed {seed} (WARREN_SIM_SEED={seed} WARREN_SIM_CASES=1), {} steps; last steps: {tail:?}",
            sim.trace.len()
        );
        std::panic::resume_unwind(e);
    }
    sim.stats
}

fn env(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

#[test]
fn no_confirmed_message_is_lost_whatever_the_disk_and_crashes_do() {
    let cases = env("WARREN_SIM_CASES").unwrap_or(16);
    let first = env("WARREN_SIM_SEED").unwrap_or(0x5eed);
    let steps = env("WARREN_SIM_STEPS").unwrap_or(300) as usize;
    let started = std::time::Instant::now();
    let mut total = Stats::default();
    for case in 0..cases {
        let s = run_case(first.wrapping_add(case), steps);
        total.published += s.published;
        total.confirmed += s.confirmed;
        total.nacked += s.nacked;
        total.delivered += s.delivered;
        total.crashes += s.crashes;
        total.failed_writes += s.failed_writes;
        total.redriven += s.redriven;
        total.checked += s.checked;
    }
    eprintln!(
        "simulated {cases} cases of {steps} steps in {:.1} s: {total:?}",
        started.elapsed().as_secs_f64()
    );
    assert!(total.checked > 0, "nothing was checked: {total:?}");
}
