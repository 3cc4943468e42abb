//! Damaged records, moved aside rather than deleted: one unreadable definition, index entry,
//! delivery count or body must not stop a recovery, and must not be lost either (an operator
//! may repair it by hand, or learn from it what went wrong).
//!
//! A record moves, in one synced write, from its column family to the `default` column family
//! under `quarantine/<column family>/<its raw key>`, with its raw value. Nothing reads these
//! keys back and nothing deletes them; older Warrens ignore them too (they read only their own
//! keys from `default`).

use rocksdb::{IteratorMode, WriteOptions};

use crate::{Store, StoreError};

/// The prefix of quarantined records in the `default` column family.
pub const QUARANTINE_PREFIX: &[u8] = b"quarantine/";

/// A quarantined record: the column family it came from, its raw key and value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Quarantined {
    pub family: String,
    pub key: Vec<u8>,
    pub value: Vec<u8>,
}

fn quarantine_key(family: &str, key: &[u8]) -> Vec<u8> {
    let mut k = Vec::with_capacity(QUARANTINE_PREFIX.len() + family.len() + 1 + key.len());
    k.extend_from_slice(QUARANTINE_PREFIX);
    k.extend_from_slice(family.as_bytes());
    k.push(b'/');
    k.extend_from_slice(key);
    k
}

impl Store {
    /// Moves the record `key` of `family` (whose value is `value`) into the quarantine.
    pub(crate) fn quarantine(
        &self,
        family: &str,
        key: &[u8],
        value: &[u8],
    ) -> Result<(), StoreError> {
        let cf = self.cf(family)?;
        let mut wb = rocksdb::WriteBatch::default();
        wb.put(quarantine_key(family, key), value);
        // A plain delete: the record may have been written more than once (SingleDelete
        // would then uncover an older copy).
        wb.delete_cf(cf, key);
        let mut w = WriteOptions::default();
        w.set_sync(true);
        self.db.write_opt(wb, &w).map_err(StoreError::Write)
    }

    /// Every quarantined record, in key order.
    pub fn quarantined(&self) -> Result<Vec<Quarantined>, StoreError> {
        let mut out = Vec::new();
        let from = IteratorMode::From(QUARANTINE_PREFIX, rocksdb::Direction::Forward);
        for item in self.db.iterator(from) {
            let (k, v) = item.map_err(StoreError::Read)?;
            let Some(rest) = k.strip_prefix(QUARANTINE_PREFIX) else {
                break;
            };
            let Some(slash) = rest.iter().position(|&b| b == b'/') else {
                continue;
            };
            let (family, key) = rest.split_at(slash);
            out.push(Quarantined {
                family: String::from_utf8_lossy(family).into_owned(),
                key: key.get(1..).unwrap_or_default().to_vec(),
                value: v.to_vec(),
            });
        }
        Ok(out)
    }
}
