//! Warren's durable storage on RocksDB: what the broker's [`WriteBatch`]es say, written with
//! one synced write per group, and the recovery that rebuilds the broker from it.
//!
//! The schema, the write path and recovery are described in docs/design.md ("Storage"). This
//! crate does I/O only; deciding what to write is the broker's (sans-IO) job.

mod away;
mod codec;
mod commit;
#[cfg(any(test, feature = "fault-injection"))]
pub mod faults;
mod page;
mod quarantine;
mod recover;

use std::collections::HashSet;
use std::fs::File;
use std::path::{Path, PathBuf};

use rocksdb::{
    BlockBasedOptions, ColumnFamilyDescriptor, DBCompressionType, Options, WriteOptions, DB,
};
use warren_broker::{StoreOp, WriteBatch, SPILL_BIT};

pub use away::AwayFiles;
pub use commit::{GroupCommit, Outcome};
pub use page::StorePager;
pub use quarantine::{Quarantined, QUARANTINE_PREFIX};
pub use recover::{Recovered, Recovery};

/// The layout this build writes. Format 2 added the body size and a shared flag to `index`
/// entries; format 3 the `delayed` column family and retry due times beside delivery counts
/// (`counts` values of 12 bytes); format 4 vhosts, users and permissions in `defs`; format 5
/// vhost and user limits in `defs`; format 6 the holder of each delayed message (layout 2
/// of `delayed` values) and a delayed exchange's incarnation after its arguments; format 7
/// policies in `defs`; format 8 SQS access keys (`k`) in `defs`; format 9 runtime parameters
/// (`r`: dynamic shovels) in `defs`; format 10 a replicated queue's group after its arguments
/// and the nodes' feature levels after the metadata place; format 11 the cluster's nodes after
/// the levels, once the cluster added or forgot a node. Older directories are still read and marked 11,
/// so that an older Warren, which would misread the new records, refuses them.
pub const FORMAT_VERSION: u32 = 11;
/// The oldest layout this build reads.
const OLDEST_FORMAT: u32 = 1;

const CF_DEFS: &str = "defs";
const CF_BODIES: &str = "bodies";
const CF_INDEX: &str = "index";
const CF_COUNTS: &str = "counts";
/// Scheduled messages (delayed exchanges, queues' delivery delays), keyed by due time.
const CF_DELAYED: &str = "delayed";
/// The scratch area: transient messages of deep queues (entries, counts and bodies under
/// prefixes), dropped and created anew at every start.
const CF_SPILL: &str = "spill";
const KEY_FORMAT: &[u8] = b"format";
const KEY_CLEAN: &[u8] = b"clean";
/// The key reservations (`StoreOp::ReserveKeys`): next queue key, next body key.
const KEY_RESERVED: &[u8] = b"keys";
const LOCK_FILE: &str = "warren.lock";
/// Bodies at least this large go to blob files, out of the LSM's compactions.
const MIN_BLOB_SIZE: u64 = 4096;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(
        "another Warren is using the data directory {dir} (it holds {lock}); stop it, or give this \
         one its own directory with --data-dir DIR or WARREN_DATA_DIR"
    )]
    Locked { dir: PathBuf, lock: PathBuf },
    #[error("cannot use the data directory {dir}: {source}")]
    Io {
        dir: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "cannot open the data directory {dir}: {source} (if it is damaged, move it aside and \
         Warren starts with an empty one)"
    )]
    Open {
        dir: PathBuf,
        source: rocksdb::Error,
    },
    #[error(
        "the data directory {dir} has format {found}, and this Warren reads formats \
         {OLDEST_FORMAT} to {FORMAT_VERSION}: run the Warren that wrote it, or start with \
         another --data-dir"
    )]
    Format { dir: PathBuf, found: String },
    #[error("write failed: {0}")]
    Write(rocksdb::Error),
    #[error("read failed: {0}")]
    Read(rocksdb::Error),
    #[error("the data directory holds damaged data: {0}")]
    Corrupt(String),
    /// A fault a test injected (see `faults`).
    #[error("injected fault: {0}")]
    Injected(&'static str),
}

/// An open data directory. Dropping it closes RocksDB and releases the lock.
pub struct Store {
    db: DB,
    dir: PathBuf,
    /// Held (locked) for the store's life: a second broker on the directory is refused.
    _lock: File,
    /// Whether the previous run stopped cleanly (read at open, before the marker is removed).
    clean_start: bool,
    #[cfg(any(test, feature = "fault-injection"))]
    faults: faults::Hook,
}

/// The block cache all column families share. Index and filter blocks live in it too, so the
/// store's read-side memory is bounded however much data the directory holds (otherwise every
/// open table file keeps its index and filter in memory: tens of MB for a deep queue).
const BLOCK_CACHE: usize = 32 << 20;

fn cf_options(cache: &rocksdb::Cache, bloom: bool) -> Options {
    let mut o = Options::default();
    o.set_compression_type(DBCompressionType::Lz4);
    let mut table = BlockBasedOptions::default();
    table.set_block_cache(cache);
    table.set_cache_index_and_filter_blocks(true);
    table.set_pin_l0_filter_and_index_blocks_in_cache(true);
    if bloom {
        table.set_bloom_filter(10.0, false);
    }
    o.set_block_based_table_factory(&table);
    o
}

/// The batch an op on `key` (a queue or body key) belongs in: the scratch area's, or the
/// durable one.
fn pick<'a>(
    durable: &'a mut rocksdb::WriteBatch,
    scratch: &'a mut rocksdb::WriteBatch,
    key: u64,
) -> &'a mut rocksdb::WriteBatch {
    if key & SPILL_BIT != 0 {
        scratch
    } else {
        durable
    }
}

/// No key in any column family.
fn is_empty(db: &DB) -> bool {
    let default_empty = db.iterator(rocksdb::IteratorMode::Start).next().is_none();
    default_empty
        && [CF_DEFS, CF_BODIES, CF_INDEX, CF_COUNTS, CF_DELAYED]
            .iter()
            .all(|name| {
                db.cf_handle(name).is_none_or(|cf| {
                    db.iterator_cf(cf, rocksdb::IteratorMode::Start)
                        .next()
                        .is_none()
                })
            })
}

impl Store {
    /// Opens (or creates) the store in `dir`. Refuses a directory another process holds, one
    /// of another format, and damaged RocksDB files, with a message that names the directory.
    pub fn open(dir: &Path) -> Result<Store, StoreError> {
        let io = |source| StoreError::Io {
            dir: dir.to_path_buf(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(io)?;
        let lock_path = dir.join(LOCK_FILE);
        let lock = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(io)?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(StoreError::Locked {
                    dir: dir.to_path_buf(),
                    lock: lock_path,
                })
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(io(e)),
        }
        let fresh = !dir.join("CURRENT").exists();

        let mut opts = Options::default();
        opts.create_if_missing(true);
        opts.create_missing_column_families(true);
        // A broker shares the machine with its clients: two background jobs are plenty.
        opts.set_max_background_jobs(2);
        // All memtables together stay small: the broker's RAM is for messages.
        opts.set_db_write_buffer_size(64 << 20);
        opts.set_compression_type(DBCompressionType::Lz4);

        let cache = rocksdb::Cache::new_lru_cache(BLOCK_CACHE);
        let defs = ColumnFamilyDescriptor::new(CF_DEFS, cf_options(&cache, false));
        let mut bodies_opts = cf_options(&cache, false);
        bodies_opts.set_enable_blob_files(true);
        bodies_opts.set_min_blob_size(MIN_BLOB_SIZE);
        bodies_opts.set_enable_blob_gc(true);
        bodies_opts.set_blob_compression_type(DBCompressionType::Lz4);
        let bodies = ColumnFamilyDescriptor::new(CF_BODIES, bodies_opts);
        let mut index_opts = cf_options(&cache, true);
        // A queue deletes at its head what it appended at its tail: files full of tombstones
        // are compacted early (RocksDB's advice for queue-shaped keyspaces).
        index_opts.add_compact_on_deletion_collector_factory(128, 64, 0.5);
        let index = ColumnFamilyDescriptor::new(CF_INDEX, index_opts);
        let counts = ColumnFamilyDescriptor::new(CF_COUNTS, cf_options(&cache, false));
        // Released in due order, so deleted at the head like a queue; large bodies in blobs.
        let mut delayed_opts = cf_options(&cache, false);
        delayed_opts.add_compact_on_deletion_collector_factory(128, 64, 0.5);
        delayed_opts.set_enable_blob_files(true);
        delayed_opts.set_min_blob_size(MIN_BLOB_SIZE);
        delayed_opts.set_enable_blob_gc(true);
        delayed_opts.set_blob_compression_type(DBCompressionType::Lz4);
        let delayed = ColumnFamilyDescriptor::new(CF_DELAYED, delayed_opts);

        let spill = ColumnFamilyDescriptor::new(CF_SPILL, cf_options(&cache, false));
        let open_err = |source| StoreError::Open {
            dir: dir.to_path_buf(),
            source,
        };
        let mut db = DB::open_cf_descriptors(
            &opts,
            dir,
            vec![defs, bodies, index, counts, delayed, spill],
        )
        .map_err(open_err)?;
        // The scratch area of the previous run goes (its messages were transient), at once.
        db.drop_cf(CF_SPILL).map_err(open_err)?;
        db.create_cf(CF_SPILL, &cf_options(&cache, false))
            .map_err(open_err)?;
        let format = db.get(KEY_FORMAT).map_err(StoreError::Read)?;
        // A first start killed between creating the files and writing the format record left
        // a directory with nothing in it: still fresh.
        let fresh = fresh || (format.is_none() && is_empty(&db));
        let readable = |v: &[u8]| {
            <[u8; 4]>::try_from(v)
                .map(u32::from_be_bytes)
                .is_ok_and(|f| (OLDEST_FORMAT..=FORMAT_VERSION).contains(&f))
        };
        match format.as_deref() {
            Some(v) if v == FORMAT_VERSION.to_be_bytes() => {}
            Some(v) if readable(v) => {
                tracing::info!(dir = %dir.display(), "data directory upgraded to format {FORMAT_VERSION}");
                let mut w = WriteOptions::default();
                w.set_sync(true);
                db.put_opt(KEY_FORMAT, FORMAT_VERSION.to_be_bytes(), &w)
                    .map_err(StoreError::Write)?;
            }
            None if fresh => {
                let mut w = WriteOptions::default();
                w.set_sync(true);
                db.put_opt(KEY_FORMAT, FORMAT_VERSION.to_be_bytes(), &w)
                    .map_err(StoreError::Write)?;
            }
            other => {
                let found = match other {
                    Some(v) => match <[u8; 4]>::try_from(v) {
                        Ok(b) => u32::from_be_bytes(b).to_string(),
                        Err(_) => format!("{v:02x?}"),
                    },
                    None => "none (the format record is missing)".to_string(),
                };
                return Err(StoreError::Format {
                    dir: dir.to_path_buf(),
                    found,
                });
            }
        }
        let clean_start = db.get(KEY_CLEAN).map_err(StoreError::Read)?.is_some() || fresh;
        // From here until a clean stop, a restart is a crash recovery.
        let mut w = WriteOptions::default();
        w.set_sync(true);
        db.delete_opt(KEY_CLEAN, &w).map_err(StoreError::Write)?;
        Ok(Store {
            db,
            dir: dir.to_path_buf(),
            _lock: lock,
            clean_start,
            #[cfg(any(test, feature = "fault-injection"))]
            faults: faults::Hook::default(),
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Did the previous run stop cleanly (or is the directory new)?
    pub fn clean_start(&self) -> bool {
        self.clean_start
    }

    fn cf(&self, name: &str) -> Result<&rocksdb::ColumnFamily, StoreError> {
        self.db
            .cf_handle(name)
            .ok_or_else(|| StoreError::Corrupt(format!("column family {name} is missing")))
    }

    /// Where a queue key's entries live: `index`, or the scratch area under its prefix.
    fn entries_of(&self, queue: u64) -> Result<(&rocksdb::ColumnFamily, Option<u8>), StoreError> {
        if queue & SPILL_BIT != 0 {
            Ok((self.cf(CF_SPILL)?, Some(codec::SPILL_ENTRY)))
        } else {
            Ok((self.cf(CF_INDEX)?, None))
        }
    }

    /// Where a queue key's delivery counts live.
    fn counts_of(&self, queue: u64) -> Result<(&rocksdb::ColumnFamily, Option<u8>), StoreError> {
        if queue & SPILL_BIT != 0 {
            Ok((self.cf(CF_SPILL)?, Some(codec::SPILL_COUNT)))
        } else {
            Ok((self.cf(CF_COUNTS)?, None))
        }
    }

    /// Where a body key's body lives.
    fn body_of(&self, key: u64) -> Result<(&rocksdb::ColumnFamily, codec::Key), StoreError> {
        if key & SPILL_BIT != 0 {
            Ok((
                self.cf(CF_SPILL)?,
                codec::body_key_in(Some(codec::SPILL_BODY), key),
            ))
        } else {
            Ok((self.cf(CF_BODIES)?, codec::body_key_in(None, key)))
        }
    }

    /// Writes `batches` (in order) as one RocksDB write, synced if any of them asks for it: the
    /// group commit. A message put and deleted within the group (acked before it reached the
    /// disk) is written not at all. What goes to the scratch area is written first, without
    /// the write-ahead log (it is dropped at the next start anyway).
    pub fn write(&self, batches: &[WriteBatch]) -> Result<(), StoreError> {
        #[cfg(any(test, feature = "fault-injection"))]
        let after = match self.faults.before_write(batches)? {
            faults::After::Nothing => None,
            faults::After::Fail(what) => Some(what),
        };
        let written = self.write_group(batches);
        #[cfg(any(test, feature = "fault-injection"))]
        if let (Ok(()), Some(what)) = (&written, after) {
            return Err(StoreError::Injected(what));
        }
        written
    }

    fn write_group(&self, batches: &[WriteBatch]) -> Result<(), StoreError> {
        let defs = self.cf(CF_DEFS)?;
        // What is both created and removed within this group, in the durable store. (The
        // scratch area is written first and without this: a group retried after a failed
        // durable write writes its scratch part again, so there a put and its delete are
        // both written, and deletes are plain deletes, which tolerate a key put twice.)
        let mut gone_bodies = HashSet::new();
        let mut gone_entries = HashSet::new();
        for op in batches.iter().flat_map(|b| &b.ops) {
            match op {
                StoreOp::DeleteBody { key } if key & SPILL_BIT == 0 => {
                    gone_bodies.insert(*key);
                }
                StoreOp::DeleteEntry { queue, msg_id, .. } if queue & SPILL_BIT == 0 => {
                    gone_entries.insert((*queue, *msg_id));
                }
                _ => {}
            }
        }
        let mut put_bodies = HashSet::new();
        let mut put_entries = HashSet::new();
        for op in batches.iter().flat_map(|b| &b.ops) {
            match op {
                StoreOp::PutBody { key, .. } if gone_bodies.contains(key) => {
                    put_bodies.insert(*key);
                }
                StoreOp::PutEntry { queue, msg_id, .. }
                    if gone_entries.contains(&(*queue, *msg_id)) =>
                {
                    put_entries.insert((*queue, *msg_id));
                }
                StoreOp::DropRun {
                    queue,
                    first_id,
                    last_id,
                } => self.drop_run_bodies(*queue, *first_id, *last_id)?,
                _ => {}
            }
        }

        let mut wb = rocksdb::WriteBatch::default();
        // The scratch area's ops, in the same order.
        let mut scratch = rocksdb::WriteBatch::default();
        // Values are encoded here and copied by RocksDB: one buffer for the group.
        let mut value = bytes::BytesMut::new();
        let mut sync = false;
        for batch in batches {
            sync |= batch.sync;
            for op in &batch.ops {
                match op {
                    StoreOp::PutExchange(x) => wb.put_cf(
                        defs,
                        codec::exchange_key(&x.vhost, &x.name),
                        codec::exchange_value(x),
                    ),
                    StoreOp::DeleteExchange { vhost, name } => {
                        wb.delete_cf(defs, codec::exchange_key(vhost, name))
                    }
                    StoreOp::PutQueue(q) => wb.put_cf(
                        defs,
                        codec::queue_key(&q.vhost, &q.name),
                        codec::queue_value(q),
                    ),
                    StoreOp::DeleteQueue { vhost, name, key } => {
                        wb.delete_cf(defs, codec::queue_key(vhost, name));
                        self.delete_entries(&mut wb, &mut scratch, *key)?;
                    }
                    StoreOp::DeleteEntries { queue } => {
                        self.delete_entries(&mut wb, &mut scratch, *queue)?;
                    }
                    StoreOp::PutVhost { .. }
                    | StoreOp::PutUser(_)
                    | StoreOp::PutPermission(_)
                    | StoreOp::PutTopicPermission(_) => {
                        if let Some((k, v)) = codec::access_record(op) {
                            wb.put_cf(defs, k, v);
                        }
                    }
                    StoreOp::PutLimits { limits, .. } if limits.is_empty() => {
                        if let Some(k) = codec::access_key(op) {
                            wb.delete_cf(defs, k);
                        }
                    }
                    StoreOp::PutLimits { .. }
                    | StoreOp::PutPolicy(_)
                    | StoreOp::PutMetaApplied { .. }
                    | StoreOp::PutMetaPending { .. }
                    | StoreOp::PutAccessKey(_)
                    | StoreOp::PutParameter(_) => {
                        if let Some((k, v)) = codec::access_record(op) {
                            wb.put_cf(defs, k, v);
                        }
                    }
                    StoreOp::DeleteVhost { .. }
                    | StoreOp::DeleteUser { .. }
                    | StoreOp::DeletePermission { .. }
                    | StoreOp::DeleteTopicPermission { .. }
                    | StoreOp::DeletePolicy { .. }
                    | StoreOp::DeleteMetaPending { .. }
                    | StoreOp::DeleteAccessKey { .. }
                    | StoreOp::DeleteParameter { .. } => {
                        if let Some(k) = codec::access_key(op) {
                            wb.delete_cf(defs, k);
                        }
                    }
                    StoreOp::PutBinding(b) => wb.put_cf(defs, codec::binding_key(b), []),
                    StoreOp::DeleteBinding(b) => wb.delete_cf(defs, codec::binding_key(b)),
                    StoreOp::PutBody {
                        key,
                        message,
                        queues,
                    } => {
                        if !put_bodies.contains(key) {
                            let (cf, k) = self.body_of(*key)?;
                            codec::body_value_into(&mut value, message, *queues);
                            pick(&mut wb, &mut scratch, *key).put_cf(cf, k, &value);
                        }
                    }
                    StoreOp::DeleteBody { key } => {
                        if !put_bodies.contains(key) {
                            // Written once, deleted once: the put and this cancel out in the
                            // first compaction that sees both, leaving no tombstone behind.
                            let (cf, k) = self.body_of(*key)?;
                            if key & SPILL_BIT == 0 {
                                wb.single_delete_cf(cf, k);
                            } else {
                                scratch.delete_cf(cf, k);
                            }
                        }
                    }
                    StoreOp::PutEntry {
                        queue,
                        msg_id,
                        body,
                        size,
                        shared,
                        expires_at,
                    } => {
                        if !put_entries.contains(&(*queue, *msg_id)) {
                            let entry = codec::Entry {
                                body: *body,
                                size: Some(u32::try_from(*size).unwrap_or(u32::MAX)),
                                shared: *shared,
                                expires_at: *expires_at,
                            };
                            let (cf, prefix) = self.entries_of(*queue)?;
                            let k = codec::entry_key_in(prefix, *queue, *msg_id);
                            codec::entry_value_into(&mut value, &entry);
                            pick(&mut wb, &mut scratch, *queue).put_cf(cf, k, &value);
                        }
                    }
                    StoreOp::DropRun {
                        queue,
                        first_id,
                        last_id,
                    } => {
                        // The bodies went first (`drop_run_bodies`).
                        for (cf, prefix) in [self.entries_of(*queue)?, self.counts_of(*queue)?] {
                            let (from, to) =
                                codec::id_range_in(prefix, *queue, *first_id, *last_id);
                            pick(&mut wb, &mut scratch, *queue).delete_range_cf(cf, from, to);
                        }
                    }
                    StoreOp::PutDelayed { key, delayed } => {
                        let cf = self.cf(CF_DELAYED)?;
                        wb.put_cf(cf, codec::delayed_key(*key), codec::delayed_value(delayed));
                    }
                    StoreOp::DeleteDelayed { key } => {
                        // Keys are never reused: written once, deleted once.
                        wb.single_delete_cf(self.cf(CF_DELAYED)?, codec::delayed_key(*key));
                    }
                    StoreOp::DeleteEntry {
                        queue,
                        msg_id,
                        count,
                    } => {
                        let w = pick(&mut wb, &mut scratch, *queue);
                        if !put_entries.contains(&(*queue, *msg_id)) {
                            let (cf, prefix) = self.entries_of(*queue)?;
                            let k = codec::entry_key_in(prefix, *queue, *msg_id);
                            if queue & SPILL_BIT == 0 {
                                w.single_delete_cf(cf, k);
                            } else {
                                w.delete_cf(cf, k);
                            }
                        }
                        if *count {
                            let (cf, prefix) = self.counts_of(*queue)?;
                            w.delete_cf(cf, codec::entry_key_in(prefix, *queue, *msg_id));
                        }
                    }
                    StoreOp::PutCount {
                        queue,
                        msg_id,
                        count,
                        retry_at,
                    } => {
                        let (cf, prefix) = self.counts_of(*queue)?;
                        let k = codec::entry_key_in(prefix, *queue, *msg_id);
                        let value = codec::count_value(*count, *retry_at);
                        pick(&mut wb, &mut scratch, *queue).put_cf(cf, k, value);
                    }
                    StoreOp::ReserveKeys(keys) => {
                        let mut v = [0u8; 16];
                        v[..8].copy_from_slice(&keys.next_queue_key.to_be_bytes());
                        v[8..].copy_from_slice(&keys.next_body_key.to_be_bytes());
                        wb.put(KEY_RESERVED, v);
                    }
                }
            }
        }
        if !scratch.is_empty() {
            let mut w = WriteOptions::default();
            w.disable_wal(true);
            self.db.write_opt(scratch, &w).map_err(StoreError::Write)?;
        }
        let mut w = WriteOptions::default();
        w.set_sync(sync);
        self.db.write_opt(wb, &w).map_err(StoreError::Write)
    }

    /// Every entry and count of a queue key.
    fn delete_entries(
        &self,
        wb: &mut rocksdb::WriteBatch,
        scratch: &mut rocksdb::WriteBatch,
        queue: u64,
    ) -> Result<(), StoreError> {
        for (cf, prefix) in [self.entries_of(queue)?, self.counts_of(queue)?] {
            let (from, to) = codec::id_range_in(prefix, queue, 0, u64::MAX);
            pick(wb, scratch, queue).delete_range_cf(cf, from, to);
        }
        Ok(())
    }

    /// Deletes the bodies of a dropped run (a purge or delete of a paged queue), in writes of
    /// bounded size: a run can hold millions of messages. They go before the group that drops
    /// the run's entries (a run holds only messages written in earlier groups, and nothing else
    /// deletes them); after a crash in between, the entries left without bodies are skipped
    /// and deleted when read.
    fn drop_run_bodies(&self, queue: u64, first_id: u64, last_id: u64) -> Result<(), StoreError> {
        const CHUNK: usize = 65_536;
        let (entries, prefix) = self.entries_of(queue)?;
        let (from, to) = codec::id_range_in(prefix, queue, first_id, last_id);
        let mut wb = rocksdb::WriteBatch::default();
        for item in self.db.iterator_cf_opt(
            entries,
            codec::bounded(from.as_ref(), to.as_ref()),
            rocksdb::IteratorMode::From(from.as_ref(), rocksdb::Direction::Forward),
        ) {
            let (k, v) = item.map_err(StoreError::Read)?;
            match codec::decode_entry(&v) {
                // Only unshared bodies are paged; a shared one is released by its last queue.
                Ok(entry) if !entry.shared => {
                    let (cf, key) = self.body_of(entry.body)?;
                    if entry.body & SPILL_BIT == 0 {
                        wb.single_delete_cf(cf, key);
                    } else {
                        wb.delete_cf(cf, key);
                    }
                }
                Ok(_) => {}
                Err(error) => {
                    tracing::warn!(key = ?k, %error, "a damaged queue entry of a dropped run: its body, if any, stays");
                }
            }
            if wb.len() >= CHUNK {
                self.db
                    .write(std::mem::take(&mut wb))
                    .map_err(StoreError::Write)?;
            }
        }
        if !wb.is_empty() {
            self.db.write(wb).map_err(StoreError::Write)?;
        }
        Ok(())
    }

    /// Marks a clean stop: the next start does not treat recovered messages as possibly
    /// delivered. Call after the last write.
    pub fn close_clean(&self) -> Result<(), StoreError> {
        let mut w = WriteOptions::default();
        w.set_sync(true);
        self.db
            .put_opt(KEY_CLEAN, [1u8], &w)
            .map_err(StoreError::Write)?;
        self.db.flush_wal(true).map_err(StoreError::Write)
    }
}

#[cfg(test)]
mod tests;
