//! Reading paged-out messages back: a bounded scan of one queue's entries (in `index`, or in the
//! scratch area for spilled ones), the delivery counts beside them, and the bodies in one
//! `multi_get`.

use std::collections::BTreeMap;
use std::sync::Arc;

use rocksdb::{Direction, IteratorMode};
use warren_broker::machine::{LoadRequest, Loaded, MsgMeta};
use warren_broker::{DelayKey, Delayed, Page, PageSource, ReadRequest, SPILL_BIT};

use crate::{codec, Store, StoreError};

/// An entry or count key without the scratch area's prefix.
fn unprefixed(key: &[u8], prefix: Option<u8>) -> &[u8] {
    match prefix {
        Some(_) => key.get(1..).unwrap_or_default(),
        None => key,
    }
}

impl Store {
    /// The stored messages of `queue` with ids in `from..=to`, in id order, stopping after
    /// `max_messages` or once `max_bytes` of bodies are read. An entry whose body is missing
    /// or damaged is skipped with a warning and reported in [`Page::unreadable`].
    pub fn read_page(
        &self,
        queue: u64,
        from: u64,
        to: u64,
        max_messages: usize,
        max_bytes: u64,
    ) -> Result<Page, StoreError> {
        let (index, prefix) = self.entries_of(queue)?;
        let (lo, hi) = codec::id_range_in(prefix, queue, from, to);
        let mut entries = Vec::new();
        let mut bytes = 0u64;
        let mut through = to;
        for item in self.db.iterator_cf_opt(
            index,
            codec::bounded(lo.as_ref(), hi.as_ref()),
            IteratorMode::From(lo.as_ref(), Direction::Forward),
        ) {
            let (k, v) = item.map_err(StoreError::Read)?;
            let (_, msg_id) = codec::decode_entry_key(unprefixed(&k, prefix))?;
            let entry = codec::decode_entry(&v)?;
            bytes = bytes.saturating_add(u64::from(entry.size.unwrap_or(0)));
            entries.push((msg_id, entry));
            if entries.len() >= max_messages.max(1) || bytes >= max_bytes {
                through = msg_id;
                break;
            }
        }
        let mut counts = BTreeMap::new();
        let (counts_cf, prefix) = self.counts_of(queue)?;
        let (counts_lo, counts_hi) = codec::id_range_in(prefix, queue, from, through);
        for item in self.db.iterator_cf_opt(
            counts_cf,
            codec::bounded(counts_lo.as_ref(), counts_hi.as_ref()),
            IteratorMode::From(counts_lo.as_ref(), Direction::Forward),
        ) {
            let (k, v) = item.map_err(StoreError::Read)?;
            let (_, msg_id) = codec::decode_entry_key(unprefixed(&k, prefix))?;
            // A paged message's retry due time is not kept: it is ready when read back.
            let (count, _) = codec::decode_count(&v)?;
            counts.insert(msg_id, count);
        }
        // A run's bodies are all in one place (stored, or in the scratch area): one batched
        // lookup. Entries from elsewhere (none today) are looked up one by one.
        let keys = entries
            .iter()
            .map(|(_, e)| self.body_of(e.body))
            .collect::<Result<Vec<_>, _>>()?;
        let same_place = entries
            .windows(2)
            .all(|w| (w[0].1.body ^ w[1].1.body) & SPILL_BIT == 0);
        let bodies: Vec<Result<Option<Vec<u8>>, rocksdb::Error>> = match keys.first() {
            Some((cf, _)) if same_place => self
                .db
                .batched_multi_get_cf(*cf, keys.iter().map(|(_, k)| k), false)
                .into_iter()
                .map(|r| r.map(|v| v.map(|v| v.to_vec())))
                .collect(),
            _ => self.db.multi_get_cf(keys.iter().map(|(cf, k)| (*cf, k))),
        };
        let mut messages = Vec::with_capacity(entries.len());
        let mut unreadable = Vec::new();
        for ((msg_id, entry), body) in entries.into_iter().zip(bodies) {
            let Some(body) = body.map_err(StoreError::Read)? else {
                tracing::warn!(
                    queue,
                    msg_id,
                    body_key = entry.body,
                    "a paged message has no body: skipped"
                );
                unreadable.push(msg_id);
                continue;
            };
            let message = match codec::decode_body(entry.body, body) {
                Ok((message, _)) => message,
                Err(error) => {
                    tracing::warn!(queue, msg_id, body_key = entry.body, %error, "a paged message's body is damaged: skipped");
                    unreadable.push(msg_id);
                    continue;
                }
            };
            let meta = MsgMeta {
                size: message.body.len() as u64,
                expires_at: entry.expires_at,
                pageable: true,
                spilled: queue & SPILL_BIT != 0,
                // Set by the broker, which knows the queue's `x-max-priority`.
                priority: 0,
                group: None,
            };
            messages.push(Loaded {
                msg_id,
                message,
                meta,
                delivery_count: counts.get(&msg_id).copied().unwrap_or(0),
            });
        }
        Ok(Page {
            messages,
            through_id: through,
            unreadable,
        })
    }
}

impl Store {
    /// Scheduled messages from `request.from` on (below `request.until`), in due order,
    /// stopping after `max_messages` or once `max_bytes` are read (true: a limit stopped it).
    /// A damaged one is logged and moved to the quarantine, so it is not found again.
    pub fn read_delayed(
        &self,
        request: ReadRequest,
    ) -> Result<(Vec<(DelayKey, Delayed)>, bool), StoreError> {
        let (max_messages, max_bytes) = (request.max_messages, request.max_bytes);
        let cf = self.cf(crate::CF_DELAYED)?;
        let lo = codec::delayed_key(request.from);
        let mut out = Vec::new();
        let mut bytes = 0u64;
        let mut opts = rocksdb::ReadOptions::default();
        opts.set_iterate_lower_bound(lo.as_ref().to_vec());
        if let Some(until) = request.until {
            opts.set_iterate_upper_bound(codec::delayed_key(until).as_ref().to_vec());
        }
        for item in self.db.iterator_cf_opt(
            cf,
            opts,
            IteratorMode::From(lo.as_ref(), Direction::Forward),
        ) {
            if out.len() >= max_messages.max(1) || bytes >= max_bytes {
                return Ok((out, true));
            }
            let (k, v) = item.map_err(StoreError::Read)?;
            let key = codec::decode_delayed_key(&k)?;
            bytes = bytes.saturating_add(v.len() as u64);
            match codec::decode_delayed(v.to_vec()) {
                Ok(d) => out.push((key, d)),
                Err(error) => {
                    tracing::error!(due = key.due, seq = key.seq, %error, "a delayed message is damaged: it is lost, and moved to the quarantine");
                    self.quarantine(crate::CF_DELAYED, &k, &v)?;
                }
            }
        }
        Ok((out, false))
    }

    /// Does the store hold scheduled messages?
    pub fn has_delayed(&self) -> Result<bool, StoreError> {
        let cf = self.cf(crate::CF_DELAYED)?;
        match self.db.iterator_cf(cf, IteratorMode::Start).next() {
            Some(item) => item.map(|_| true).map_err(StoreError::Read),
            None => Ok(false),
        }
    }
}

/// The broker's [`PageSource`] over a shared [`Store`] (RocksDB reads are thread-safe; the
/// store thread writes while the broker reads).
pub struct StorePager(pub Arc<Store>);

impl PageSource for StorePager {
    fn read(
        &mut self,
        queue_key: u64,
        request: LoadRequest,
        max_messages: usize,
        max_bytes: u64,
    ) -> Result<Page, String> {
        self.0
            .read_page(
                queue_key,
                request.from_id,
                request.to_id,
                max_messages,
                max_bytes,
            )
            .map_err(|e| e.to_string())
    }

    fn read_delayed(
        &mut self,
        request: ReadRequest,
    ) -> Result<(Vec<(DelayKey, Delayed)>, bool), String> {
        self.0.read_delayed(request).map_err(|e| e.to_string())
    }
}
