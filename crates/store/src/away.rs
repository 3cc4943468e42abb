//! Where a deep replicated queue's member keeps the contents of messages that left its memory
//! (the broker's [`AwayStore`]): append-only segment files in `away/` under the data directory,
//! written without an fsync. The queue's Raft log stays the durable record: a restart rebuilds
//! the machine from its snapshot and log with every message in memory, so the folder is emptied
//! at every start.
//!
//! Contents are written once, read back at most a few times (a delivery, a snapshot) and then
//! released: a log of segments fits that better than RocksDB, whose memtable, block cache,
//! flushes and compactions cost a deep queue's member about a third of its publish rate when
//! this first used the scratch area. A key is where its record is: the segment's number in
//! bits 44 to 62, the record's offset in the low 44 (a key's top bit is the broker's). A record is its length (`u32`, big-endian)
//! and the message as the store writes a body; the message's hash, kept beside the key in
//! memory, checks it when read. A segment is deleted once it is full and every record in it was
//! released.

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::BytesMut;
use warren_broker::{AwayStore, Message};

use crate::codec;

/// A segment is closed once it holds this much; the next write starts another.
const SEGMENT_BYTES: u64 = 64 << 20;
const OFFSET_BITS: u32 = 44;
const OFFSET_MASK: u64 = (1 << OFFSET_BITS) - 1;
/// Segment numbers fit in the key's 19 bits below its top one (which [`AwayStore::put`]
/// leaves clear); they wrap after half a million segments (32 TiB written), long after the
/// first ones were deleted.
const SEGMENT_MASK: u32 = (1 << 19) - 1;

struct Segment {
    file: Arc<File>,
    /// Records written and not released (and those being written).
    live: u64,
    /// No more records go to it: deleted once `live` is 0.
    closed: bool,
    /// Where the writes still under way start (each wrote its place's length in advance), and
    /// where the space given out ends: a read ahead stops before the first write under way
    /// past what it asks for, so it never keeps bytes not written yet.
    writing: BTreeSet<u64>,
    end: u64,
}

impl Segment {
    /// How far a read of the record at `offset` may read ahead.
    fn readable_end(&self, offset: u64) -> u64 {
        self.writing
            .range(offset.saturating_add(1)..)
            .next()
            .copied()
            .unwrap_or(self.end)
    }
}

struct Files {
    segments: HashMap<u32, Segment>,
    /// The segment written to, and its length.
    current: Option<(u32, u64)>,
    next: u32,
}

pub struct AwayFiles {
    dir: PathBuf,
    files: Mutex<Files>,
    live: AtomicU64,
}

fn key_of(segment: u32, offset: u64) -> u64 {
    u64::from(segment) << OFFSET_BITS | offset
}

fn split(key: u64) -> (u32, u64) {
    // The shift leaves 20 bits.
    ((key >> OFFSET_BITS) as u32, key & OFFSET_MASK)
}

impl AwayFiles {
    /// Empties (or makes) the folder `dir`: what a previous run left there is of machines that
    /// start again from their logs.
    pub fn open(dir: &Path) -> std::io::Result<Self> {
        match std::fs::remove_dir_all(dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        std::fs::create_dir_all(dir)?;
        Ok(AwayFiles {
            dir: dir.to_path_buf(),
            files: Mutex::new(Files {
                segments: HashMap::new(),
                current: None,
                next: 0,
            }),
            live: AtomicU64::new(0),
        })
    }

    fn path(&self, segment: u32) -> PathBuf {
        self.dir.join(format!("{segment:08}.seg"))
    }

    fn remove(&self, segment: u32) {
        if let Err(error) = std::fs::remove_file(self.path(segment)) {
            tracing::warn!(segment, %error, "removing a segment of messages' contents failed; it stays until the next start");
        }
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Files>, String> {
        self.files
            .lock()
            .map_err(|_| "the segments' lock is poisoned".to_string())
    }

    /// No more records go to `segment`: it is deleted at once if none in it is live, else
    /// once the last is released.
    fn close(&self, files: &mut Files, segment: u32) {
        let empty = files.segments.get_mut(&segment).is_some_and(|s| {
            s.closed = true;
            s.live == 0
        });
        if empty {
            files.segments.remove(&segment);
            self.remove(segment);
        }
    }

    /// The segment a write of `len` bytes goes to, and where in it; opens a new one when the
    /// current one is full.
    fn place(&self, files: &mut Files, len: u64) -> std::io::Result<(u32, u64, Arc<File>)> {
        if let Some((segment, at)) = files.current {
            let fits = at == 0 || at + len <= SEGMENT_BYTES;
            if let (true, Some(s)) = (fits, files.segments.get(&segment)) {
                return Ok((segment, at, s.file.clone()));
            }
            self.close(files, segment);
        }
        let segment = files.next;
        files.next = (files.next + 1) & SEGMENT_MASK;
        // Written at the places given out (`write_at`), not appended: several writes may be
        // under way at once, outside the lock.
        let file = Arc::new(
            std::fs::OpenOptions::new()
                .create_new(true)
                .read(true)
                .write(true)
                .open(self.path(segment))?,
        );
        files.segments.insert(
            segment,
            Segment {
                file: file.clone(),
                live: 0,
                closed: false,
                writing: BTreeSet::new(),
                end: 0,
            },
        );
        files.current = Some((segment, 0));
        Ok((segment, 0, file))
    }
}

/// What one read takes from a segment: the records after the one asked for come with it, and
/// the next reads on this thread are served from memory. Contents are read in the order they
/// were written (a consumer draining the line, a snapshot writing it), so one read serves a
/// hundred 1 KiB records.
const READ_AHEAD: usize = 128 << 10;

/// The last read of this thread: a segment's bytes from `start` on. Records never change once
/// written, and the `Arc` tells a segment from a later one under the same number.
struct Ahead {
    /// Weak: a segment deleted meanwhile is closed, not kept open by a thread's last read.
    file: std::sync::Weak<File>,
    start: u64,
    data: Vec<u8>,
}

thread_local! {
    static AHEAD: std::cell::RefCell<Option<Ahead>> = const { std::cell::RefCell::new(None) };
}

/// The record at `offset` (without its length), reading ahead no further than `limit`.
fn read_record(file: &Arc<File>, offset: u64, limit: u64) -> std::io::Result<Vec<u8>> {
    AHEAD.with(|ahead| {
        let mut ahead = ahead.borrow_mut();
        if let Some(record) = ahead.as_ref().and_then(|a| cached(a, file, offset)) {
            return Ok(record);
        }
        let span = limit.saturating_sub(offset).min(READ_AHEAD as u64);
        let mut data = vec![0u8; usize::try_from(span).unwrap_or(READ_AHEAD)];
        let mut got = 0;
        while got < data.len() {
            match file.read_at(&mut data[got..], offset + got as u64) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        data.truncate(got);
        let a = Ahead {
            file: Arc::downgrade(file),
            start: offset,
            data,
        };
        let record = cached(&a, file, offset);
        *ahead = Some(a);
        match record {
            Some(record) => Ok(record),
            // Longer than a read ahead.
            None => {
                let mut len = [0u8; 4];
                file.read_exact_at(&mut len, offset)?;
                let len = u64::from(u32::from_be_bytes(len));
                // A damaged length must not allocate more than the segment holds.
                let end = file.metadata()?.len();
                if offset.saturating_add(4).saturating_add(len) > end {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        format!("a record at {offset} of {len} bytes runs past the segment's end ({end})"),
                    ));
                }
                let mut value = vec![0u8; usize::try_from(len).unwrap_or(usize::MAX)];
                file.read_exact_at(&mut value, offset + 4)?;
                Ok(value)
            }
        }
    })
}

/// The record at `offset` if `a` holds all of it.
fn cached(a: &Ahead, file: &Arc<File>, offset: u64) -> Option<Vec<u8>> {
    if !std::ptr::eq(a.file.as_ptr(), Arc::as_ptr(file)) || offset < a.start {
        return None;
    }
    let at = usize::try_from(offset - a.start).ok()?;
    let len = a.data.get(at..at.checked_add(4)?)?;
    let len = u32::from_be_bytes(len.try_into().ok()?) as usize;
    a.data
        .get(at + 4..(at + 4).checked_add(len)?)
        .map(<[u8]>::to_vec)
}

impl AwayFiles {
    /// Writes `buf` (records, at `offsets` in it) to a segment; the records' keys.
    fn write_records(&self, buf: &[u8], offsets: Vec<u64>) -> Result<Vec<u64>, String> {
        let len = buf.len() as u64;
        let n = offsets.len() as u64;
        let mut files = self.lock()?;
        let (segment, at, file) = self.place(&mut files, len).map_err(|e| e.to_string())?;
        // The place is this write's from here on: the lock is not held through the write (up
        // to 16 MiB, while a snapshot's contents go out on another thread), so that reads and
        // releases of the broker's thread do not wait behind it. Its records count as live
        // meanwhile, so the segment stays.
        files.current = Some((segment, at + len));
        if let Some(s) = files.segments.get_mut(&segment) {
            s.live += n;
            s.writing.insert(at);
            s.end = s.end.max(at + len);
        }
        drop(files);
        let written = file.write_all_at(buf, at);
        let mut files = self.lock()?;
        if let Some(s) = files.segments.get_mut(&segment) {
            s.writing.remove(&at);
        }
        if let Err(error) = written {
            // What failed part way is a hole no key points to; the segment takes no more,
            // and goes once what else it holds is released.
            if let Some(s) = files.segments.get_mut(&segment) {
                s.live = s.live.saturating_sub(n);
            }
            if files.current.is_some_and(|(current, _)| current == segment) {
                files.current = None;
            }
            self.close(&mut files, segment);
            return Err(error.to_string());
        }
        drop(files);
        Ok(offsets
            .into_iter()
            .map(|o| key_of(segment, at + o))
            .collect())
    }

    /// One record of `segment` is let go: the segment goes once none is left and no more
    /// are written to it.
    fn release_in(&self, segment: u32, records: u64) {
        let Ok(mut files) = self.files.lock() else {
            return;
        };
        let empty = files.segments.get_mut(&segment).is_some_and(|s| {
            s.live = s.live.saturating_sub(records);
            s.live == 0
        });
        if !empty {
            return;
        }
        // The segment being written goes too once nothing in it is live (a drained queue
        // leaves no file behind); the next write opens another.
        if files.current.is_some_and(|(current, _)| current == segment) {
            files.current = None;
        } else if !files.segments.get(&segment).is_some_and(|s| s.closed) {
            return;
        }
        files.segments.remove(&segment);
        drop(files);
        self.remove(segment);
    }
}

impl AwayStore for AwayFiles {
    fn put(&self, items: &[&Message]) -> Result<Vec<u64>, String> {
        let mut buf = BytesMut::new();
        let mut offsets = Vec::with_capacity(items.len());
        for m in items {
            // Encoded in place behind a length written once the record's size is known.
            let at = buf.len();
            buf.extend_from_slice(&[0; 4]);
            codec::body_value_append(&mut buf, m, 1);
            let len = buf.len() - at - 4;
            let len = u32::try_from(len).map_err(|_| format!("a message of {len} bytes"))?;
            buf[at..at + 4].copy_from_slice(&len.to_be_bytes());
            offsets.push(at as u64);
        }
        let keys = self.write_records(&buf, offsets)?;
        self.live.fetch_add(keys.len() as u64, Ordering::Relaxed);
        Ok(keys)
    }

    fn get(&self, key: u64) -> Result<Option<Message>, String> {
        let (segment, offset) = split(key);
        let (file, limit) = match self.lock()?.segments.get(&segment) {
            Some(s) => (s.file.clone(), s.readable_end(offset)),
            None => return Ok(None),
        };
        let value = read_record(&file, offset, limit).map_err(|e| e.to_string())?;
        codec::decode_body(key, value)
            .map(|(m, _)| Some(m))
            .map_err(|e| e.to_string())
    }

    fn release(&self, key: u64) {
        self.live.fetch_sub(1, Ordering::Relaxed);
        self.release_in(split(key).0, 1);
    }

    fn held(&self) -> u64 {
        self.live.load(Ordering::Relaxed)
    }

    /// A run is a record of its own, beside messages' contents (not counted among them).
    fn put_run(&self, bytes: &[u8]) -> Result<u64, String> {
        let len =
            u32::try_from(bytes.len()).map_err(|_| format!("a run of {} bytes", bytes.len()))?;
        let mut buf = Vec::with_capacity(4 + bytes.len());
        buf.extend_from_slice(&len.to_be_bytes());
        buf.extend_from_slice(bytes);
        let keys = self.write_records(&buf, vec![0])?;
        keys.first()
            .copied()
            .ok_or_else(|| "a run's record has no key".to_owned())
    }

    /// Read directly, not through the thread's read ahead: a run is read once, and the read
    /// ahead keeps the contents a consumer is reading in order.
    fn get_run(&self, key: u64) -> Result<Vec<u8>, String> {
        let (segment, offset) = split(key);
        let (file, end) = match self.lock()?.segments.get(&segment) {
            Some(s) => (s.file.clone(), s.end),
            None => return Err(format!("no segment {segment} for the run under key {key}")),
        };
        let mut len = [0u8; 4];
        file.read_exact_at(&mut len, offset)
            .map_err(|e| e.to_string())?;
        let len = u64::from(u32::from_be_bytes(len));
        // A damaged length must not allocate more than the segment holds.
        if offset.saturating_add(4).saturating_add(len) > end {
            return Err(format!(
                "a run at {offset} of {len} bytes runs past the segment's end ({end})"
            ));
        }
        let mut value = vec![0u8; usize::try_from(len).map_err(|e| e.to_string())?];
        file.read_exact_at(&mut value, offset + 4)
            .map_err(|e| e.to_string())?;
        Ok(value)
    }

    fn release_run(&self, key: u64) {
        self.release_in(split(key).0, 1);
    }

    fn retain(&self, keys: &[u64]) {
        if let Ok(mut files) = self.files.lock() {
            for key in keys {
                if let Some(s) = files.segments.get_mut(&split(*key).0) {
                    s.live += 1;
                }
            }
        }
        self.live.fetch_add(keys.len() as u64, Ordering::Relaxed);
    }

    /// Holds each segment the keys are in once (a run's few thousand messages are in one
    /// or two), and counts the messages among those held.
    fn hold(&self, keys: &[u64]) -> Vec<u64> {
        let mut segments: Vec<u64> = keys.iter().map(|k| u64::from(split(*k).0)).collect();
        segments.sort_unstable();
        segments.dedup();
        if let Ok(mut files) = self.files.lock() {
            for s in &segments {
                // Fits: it came from a key's 20 bits.
                if let Some(s) = files.segments.get_mut(&(*s as u32)) {
                    s.live += 1;
                }
            }
        }
        self.live.fetch_add(keys.len() as u64, Ordering::Relaxed);
        segments
    }

    fn unhold(&self, pins: &[u64], messages: u64) {
        self.live.fetch_sub(messages, Ordering::Relaxed);
        for segment in pins {
            self.release_in(*segment as u32, 1);
        }
    }

    fn fatal(&self, error: &str) -> ! {
        tracing::error!(dir = %self.dir.display(), %error, "a deep replicated queue's run written out of memory cannot be read back: stopping; its queues' logs rebuild them at the next start");
        eprintln!(
            "warren: {}: {error}; stopping (the queues' logs rebuild them at the next start)",
            self.dir.display()
        );
        std::process::exit(70)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(body: &[u8]) -> Vec<u8> {
        let mut r = (body.len() as u32).to_be_bytes().to_vec();
        r.extend_from_slice(body);
        r
    }

    #[test]
    fn a_read_ahead_stops_before_a_write_under_way() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("segment");
        let file = Arc::new(
            std::fs::OpenOptions::new()
                .create_new(true)
                .read(true)
                .write(true)
                .open(&path)
                .expect("open"),
        );
        let (a, b, c) = (record(b"first"), record(b"second"), record(b"third"));
        // `b`'s place is given out but not written yet; `c`, after it, is written already.
        let (at_b, at_c) = (a.len() as u64, (a.len() + b.len()) as u64);
        file.write_all_at(&a, 0).expect("write a");
        file.write_all_at(&c, at_c).expect("write c");
        let segment = Segment {
            file: file.clone(),
            live: 3,
            closed: false,
            writing: BTreeSet::from([at_b]),
            end: at_c + c.len() as u64,
        };
        assert_eq!(segment.readable_end(0), at_b);
        assert_eq!(segment.readable_end(at_b), segment.end);
        assert_eq!(
            read_record(&file, 0, segment.readable_end(0)).expect("a"),
            b"first"
        );
        // Written now: read back as written, not as the zeros its place held when `a` was read.
        file.write_all_at(&b, at_b).expect("write b");
        assert_eq!(read_record(&file, at_b, segment.end).expect("b"), b"second");
        assert_eq!(read_record(&file, at_c, segment.end).expect("c"), b"third");
    }

    #[test]
    fn no_key_has_its_top_bit_set() {
        // The broker keeps a message's flag there (`AwayStore::put`'s promise).
        assert_eq!(key_of(SEGMENT_MASK, OFFSET_MASK) >> 63, 0);
        assert_eq!(split(key_of(SEGMENT_MASK, 12)), (SEGMENT_MASK, 12));
    }
}
