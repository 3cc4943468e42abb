//! An in-memory store standing in for RocksDB: it applies the broker's write batches and
//! reads pages and scheduled messages back, as `warren-store` does.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use warren_broker::machine::{LoadRequest, Loaded, MsgMeta};
use warren_broker::{
    Broker, DelayKey, Delayed, Message, Page, PageSource, ReadRequest, StoreOp, SPILL_BIT,
};

/// What the store holds: bodies by key, entries by (queue, id), with their expiry.
#[derive(Default)]
pub struct Mem {
    pub bodies: BTreeMap<u64, Message>,
    pub entries: BTreeMap<(u64, u64), u64>,
    pub expiries: BTreeMap<(u64, u64), u64>,
    /// Scheduled messages by key.
    pub delayed: BTreeMap<DelayKey, Delayed>,
    pub failing: bool,
    pub reads: usize,
}

#[derive(Clone, Default)]
pub struct MemStore(pub Arc<Mutex<Mem>>);

impl MemStore {
    /// Applies every write the broker made and reports them done.
    pub fn apply(&self, b: &mut Broker) {
        let mut mem = self.0.lock().unwrap();
        let mut last = None;
        while let Some(w) = b.take_writes() {
            last = Some(w.number);
            for op in w.ops {
                match op {
                    StoreOp::PutBody { key, message, .. } => {
                        mem.bodies.insert(key, message);
                    }
                    StoreOp::DeleteBody { key } => {
                        mem.bodies.remove(&key);
                    }
                    StoreOp::PutEntry {
                        queue,
                        msg_id,
                        body,
                        expires_at,
                        ..
                    } => {
                        mem.entries.insert((queue, msg_id), body);
                        if let Some(at) = expires_at {
                            mem.expiries.insert((queue, msg_id), at);
                        }
                    }
                    StoreOp::DeleteEntry { queue, msg_id, .. } => {
                        mem.entries.remove(&(queue, msg_id));
                    }
                    StoreOp::DeleteEntries { queue } | StoreOp::DeleteQueue { key: queue, .. } => {
                        let gone: Vec<(u64, u64)> = mem
                            .entries
                            .range((queue, 0)..=(queue, u64::MAX))
                            .map(|(k, _)| *k)
                            .collect();
                        for k in gone {
                            mem.entries.remove(&k);
                        }
                    }
                    StoreOp::DropRun {
                        queue,
                        first_id,
                        last_id,
                    } => {
                        let gone: Vec<(u64, u64)> = mem
                            .entries
                            .range((queue, first_id)..=(queue, last_id))
                            .map(|(k, _)| *k)
                            .collect();
                        for k in gone {
                            if let Some(body) = mem.entries.remove(&k) {
                                mem.bodies.remove(&body);
                            }
                        }
                    }
                    StoreOp::PutDelayed { key, delayed } => {
                        mem.delayed.insert(key, delayed);
                    }
                    StoreOp::DeleteDelayed { key } => {
                        assert!(mem.delayed.remove(&key).is_some(), "deleted twice: {key:?}");
                    }
                    _ => {}
                }
            }
        }
        drop(mem);
        if let Some(n) = last {
            b.writes_done(n);
        }
    }
}

impl PageSource for MemStore {
    fn read(
        &mut self,
        queue_key: u64,
        request: LoadRequest,
        max_messages: usize,
        _max_bytes: u64,
    ) -> Result<Page, String> {
        let mut mem = self.0.lock().unwrap();
        mem.reads += 1;
        if mem.failing {
            return Err("the disk is on fire".into());
        }
        let mut messages = Vec::new();
        let mut through_id = request.to_id;
        for (&(_, msg_id), body) in mem
            .entries
            .range((queue_key, request.from_id)..=(queue_key, request.to_id))
        {
            let message = mem.bodies[body].clone();
            let meta = MsgMeta {
                size: message.body.len() as u64,
                expires_at: mem.expiries.get(&(queue_key, msg_id)).copied(),
                pageable: true,
                spilled: queue_key & SPILL_BIT != 0,
                priority: 0,
                group: None,
            };
            messages.push(Loaded {
                msg_id,
                message,
                meta,
                delivery_count: 0,
            });
            if messages.len() == max_messages {
                through_id = msg_id;
                break;
            }
        }
        Ok(Page {
            messages,
            through_id,
            unreadable: Vec::new(),
        })
    }

    fn read_delayed(
        &mut self,
        request: ReadRequest,
    ) -> Result<(Vec<(DelayKey, Delayed)>, bool), String> {
        let max_messages = request.max_messages;
        let mut mem = self.0.lock().unwrap();
        mem.reads += 1;
        if mem.failing {
            return Err("the disk is on fire".into());
        }
        let until = request.until.unwrap_or(DelayKey {
            due: u64::MAX,
            seq: u64::MAX,
        });
        let mut out: Vec<(DelayKey, Delayed)> = mem
            .delayed
            .range(request.from..until)
            .take(max_messages + 1)
            .map(|(k, d)| (*k, d.clone()))
            .collect();
        let more = out.len() > max_messages;
        out.truncate(max_messages);
        Ok((out, more))
    }
}

/// A node's [`warren_broker::AwayStore`] in memory: where a deep replicated queue's messages'
/// contents go, with what it was asked.
#[derive(Default)]
pub struct MemAway {
    pub next: std::sync::atomic::AtomicU64,
    pub held: Mutex<BTreeMap<u64, Message>>,
    pub puts: std::sync::atomic::AtomicU64,
    pub gets: std::sync::atomic::AtomicU64,
    /// Every key released, in order (a key released twice would be a bug).
    pub released: Mutex<Vec<u64>>,
    /// Writes fail while this is set (a full disk).
    pub failing: std::sync::atomic::AtomicBool,
    /// Handles of a key beyond its first ([`warren_broker::AwayStore::retain`]).
    pub extra: Mutex<BTreeMap<u64, u64>>,
    /// Runs of packed messages written out of memory, by key.
    pub runs: Mutex<BTreeMap<u64, Vec<u8>>>,
    /// Runs read back.
    pub run_gets: std::sync::atomic::AtomicU64,
}

impl warren_broker::AwayStore for MemAway {
    fn put(&self, items: &[&Message]) -> Result<Vec<u64>, String> {
        if self.failing.load(std::sync::atomic::Ordering::Relaxed) {
            return Err("no space left on device".into());
        }
        let mut held = self.held.lock().expect("lock");
        let mut keys = Vec::new();
        for m in items {
            assert!(!m.is_away(), "contents written away twice");
            let k = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
            held.insert(k, (*m).clone());
            keys.push(k);
        }
        self.puts
            .fetch_add(items.len() as u64, std::sync::atomic::Ordering::Relaxed);
        Ok(keys)
    }

    fn get(&self, key: u64) -> Result<Option<Message>, String> {
        self.gets.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(self.held.lock().expect("lock").get(&key).cloned())
    }

    fn release(&self, key: u64) {
        if let Some(n) = self.extra.lock().expect("lock").get_mut(&key) {
            if *n > 0 {
                *n -= 1;
                return;
            }
        }
        let gone = self.held.lock().expect("lock").remove(&key);
        assert!(gone.is_some(), "key {key} released but not held");
        self.released.lock().expect("lock").push(key);
    }

    fn held(&self) -> u64 {
        self.held.lock().expect("lock").len() as u64
    }

    fn put_run(&self, bytes: &[u8]) -> Result<u64, String> {
        if self.failing.load(std::sync::atomic::Ordering::Relaxed) {
            return Err("no space left on device".into());
        }
        let k = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        self.runs.lock().expect("lock").insert(k, bytes.to_vec());
        Ok(k)
    }

    fn get_run(&self, key: u64) -> Result<Vec<u8>, String> {
        self.run_gets
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.runs
            .lock()
            .expect("lock")
            .get(&key)
            .cloned()
            .ok_or_else(|| format!("no run {key}"))
    }

    fn release_run(&self, key: u64) {
        let gone = self.runs.lock().expect("lock").remove(&key);
        assert!(gone.is_some(), "run {key} released but not held");
    }

    fn retain(&self, keys: &[u64]) {
        let held = self.held.lock().expect("lock");
        let mut extra = self.extra.lock().expect("lock");
        for k in keys {
            assert!(held.contains_key(k), "key {k} retained but not held");
            *extra.entry(*k).or_default() += 1;
        }
    }
}
