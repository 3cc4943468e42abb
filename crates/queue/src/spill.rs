//! A run of packed messages written out of memory ([`crate::machine::QueueMachine::spill_line`]).
//!
//! A packed message of a deep replicated queue keeps 24 bytes in its run and a 48-byte handle
//! of its contents ([`Away`]): about 90 bytes a message with the rest, 0.9 GB for ten million on
//! every member. A spilled run keeps none of that in memory: its items (what the machine keeps
//! of each message, and each handle's key and hash) go to the node's [`AwayStore`] as one
//! record, and the run holds its messages' contents there ([`AwayStore::hold`]) in place of
//! their handles. Reading it back makes a handle of each message again. Node-local, as the
//! contents being away are: nothing replicated changes.
//!
//! A record: its format version (1), the machine's part (length, bytes), the number of
//! messages and, for each, its handle's word and hash (three little-endian `u64`), then the
//! CRC-32 of everything before it.

use bytes::{Buf, BufMut};

use crate::{Away, AwayStoreHandle, PackedMessage};

const VERSION: u8 = 1;

/// A spilled run's handle: shared by the copies of the machine that hold it (a snapshot being
/// written holds one); the record and what it holds go when the last drops.
#[derive(Clone)]
pub struct SpilledMessages(triomphe::Arc<Record>);

struct Record {
    key: u64,
    /// What [`AwayStore::hold`] gave for the messages' contents.
    pins: Vec<u64>,
    count: u64,
    store: AwayStoreHandle,
}

impl Drop for Record {
    fn drop(&mut self) {
        self.store.unhold(&self.pins, self.count);
        self.store.release_run(self.key);
    }
}

impl std::fmt::Debug for SpilledMessages {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "SpilledMessages({}, {} messages)",
            self.0.key, self.0.count
        )
    }
}

fn same_store(a: &AwayStoreHandle, b: &AwayStoreHandle) -> bool {
    std::sync::Arc::ptr_eq(&a.0, &b.0) || std::sync::Arc::ptr_eq(&*a.0, &*b.0)
}

type Refused = (Vec<u8>, Vec<PackedMessage>);

impl SpilledMessages {
    /// Writes `items` (all of one store) and `meta` as one record; the items' handles are let
    /// go once the record holds their contents. `Err`: nothing changed.
    pub(crate) fn write(meta: Vec<u8>, items: Vec<PackedMessage>) -> Result<Self, Refused> {
        let Some(store) = items.first().map(|p| p.0.store.clone()) else {
            return Err((meta, items));
        };
        if items.iter().any(|p| !same_store(&p.0.store, &store)) {
            return Err((meta, items));
        }
        let Ok(meta_len) = u32::try_from(meta.len()) else {
            return Err((meta, items));
        };
        let Ok(count) = u32::try_from(items.len()) else {
            return Err((meta, items));
        };
        let mut buf = Vec::with_capacity(1 + 4 + meta.len() + 4 + items.len() * 24 + 4);
        buf.put_u8(VERSION);
        buf.put_u32_le(meta_len);
        buf.put_slice(&meta);
        buf.put_u32_le(count);
        for p in &items {
            buf.put_u64_le(p.0.word);
            buf.put_u64_le(p.0.content[0]);
            buf.put_u64_le(p.0.content[1]);
        }
        let crc = crc32fast::hash(&buf);
        buf.put_u32_le(crc);
        let key = match store.put_run(&buf) {
            Ok(key) => key,
            Err(_) => return Err((meta, items)),
        };
        let keys: Vec<u64> = items.iter().map(|p| p.0.key()).collect();
        // Held before the handles drop, so no message's contents go in between.
        let pins = store.hold(&keys);
        drop(items);
        Ok(SpilledMessages(triomphe::Arc::new(Record {
            key,
            pins,
            count: u64::from(count),
            store,
        })))
    }

    /// The run read back: the machine's part, and a handle of each message.
    pub(crate) fn read(&self) -> (Vec<u8>, Vec<PackedMessage>) {
        let r = &self.0;
        let bytes = match r.store.get_run(r.key) {
            Ok(b) => b,
            Err(error) => self.fatal(&format!("reading back a run of spilled messages: {error}")),
        };
        let (meta, words) = match parse(&bytes, r.count) {
            Ok(parts) => parts,
            Err(error) => self.fatal(&format!("a run of spilled messages read back: {error}")),
        };
        let keys: Vec<u64> = words
            .iter()
            .map(|w| w[0] & !crate::PERSISTENT_BIT)
            .collect();
        // Each handle made below releases its key when it drops; the run still holds them all.
        r.store.retain(&keys);
        let items = words
            .into_iter()
            .map(|[word, c0, c1]| {
                PackedMessage(triomphe::Arc::new(Away {
                    word,
                    content: [c0, c1],
                    store: r.store.clone(),
                }))
            })
            .collect();
        (meta, items)
    }

    pub(crate) fn fatal(&self, error: &str) -> ! {
        self.0.store.fatal(error)
    }
}

/// A record's parts, checked: its machine's part and each message's three words.
fn parse(bytes: &[u8], count: u64) -> Result<(Vec<u8>, Vec<[u64; 3]>), String> {
    let Some(body_len) = bytes.len().checked_sub(4) else {
        return Err(format!("{} bytes", bytes.len()));
    };
    let (body, mut tail) = bytes.split_at(body_len);
    if crc32fast::hash(body) != tail.get_u32_le() {
        return Err("checksum mismatch".to_owned());
    }
    let mut b = body;
    let short = || "shorter than it says".to_owned();
    if b.remaining() < 5 {
        return Err(short());
    }
    let version = b.get_u8();
    if version != VERSION {
        return Err(format!("format version {version}"));
    }
    let meta_len = b.get_u32_le() as usize;
    if b.remaining() < meta_len.saturating_add(4) {
        return Err(short());
    }
    let meta = b[..meta_len].to_vec();
    b.advance(meta_len);
    let n = b.get_u32_le();
    if u64::from(n) != count {
        return Err(format!("{n} messages where {count} were written"));
    }
    if b.remaining() != n as usize * 24 {
        return Err(short());
    }
    let words = (0..n)
        .map(|_| [b.get_u64_le(), b.get_u64_le(), b.get_u64_le()])
        .collect();
    Ok((meta, words))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::MemAway;
    use crate::{AwayStore, Message, Payload};
    use bytes::Bytes;
    use warren_codec::ShortStr;

    fn stub(
        store: &std::sync::Arc<MemAway>,
        handle: &AwayStoreHandle,
        body: &'static [u8],
    ) -> Message {
        let m = Message {
            exchange: ShortStr::from_static("ex"),
            routing_key: ShortStr::from_static("rk"),
            properties: Bytes::new(),
            body: Bytes::from_static(body),
            persistent: true,
            store_key: None,
            away: None,
        };
        let key = store.put(&[&m]).expect("put")[0];
        m.away_stub(key, handle)
    }

    #[test]
    fn a_spilled_run_holds_its_messages_contents_until_it_goes() {
        let store = std::sync::Arc::new(MemAway::default());
        let handle: AwayStoreHandle = store.clone().into();
        let msgs: Vec<Message> = [&b"one"[..], b"two", b"three"]
            .into_iter()
            .map(|b| stub(&store, &handle, b))
            .collect();
        let packed: Vec<PackedMessage> = msgs.iter().map(|m| m.pack().expect("packs")).collect();
        let keys: Vec<u64> = packed.iter().map(|p| p.0.key()).collect();
        let spilled = Message::spill(b"meta".to_vec(), packed).expect("spilled");
        let copies = msgs.clone();
        drop(msgs);
        drop(copies);
        assert_eq!(store.held(), 3, "the run holds the contents");
        let (meta, items) = Message::unspill(&spilled);
        assert_eq!(meta, b"meta");
        let back: Vec<Message> = items.iter().map(Message::unpack).collect();
        assert_eq!(
            back.iter()
                .map(|m| m.loaded().expect("read").body.clone())
                .collect::<Vec<_>>(),
            vec![&b"one"[..], b"two", b"three"]
        );
        drop((items, back));
        assert_eq!(store.held(), 3, "still held by the run");
        let again = spilled.clone();
        drop(spilled);
        assert_eq!(store.held(), 3, "a copy of the run still holds them");
        drop(again);
        assert_eq!(store.held(), 0);
        let mut released = store.released.lock().unwrap().clone();
        released.sort_unstable();
        assert_eq!(released, keys);
        assert!(store.runs.lock().unwrap().is_empty(), "the record went too");
    }

    #[test]
    fn a_store_that_keeps_no_runs_leaves_the_run_in_memory() {
        let store = std::sync::Arc::new(MemAway::default());
        *store.no_runs.lock().unwrap() = true;
        let m = stub(&store, &store.clone().into(), b"one");
        let packed = vec![m.pack().expect("packs")];
        let (meta, items) = Message::spill(b"meta".to_vec(), packed).expect_err("refused");
        assert_eq!((meta.as_slice(), items.len()), (&b"meta"[..], 1));
    }

    #[test]
    fn a_damaged_record_does_not_parse() {
        let mut buf = vec![VERSION];
        buf.put_u32_le(0);
        buf.put_u32_le(1);
        buf.extend_from_slice(&[0; 24]);
        let crc = crc32fast::hash(&buf);
        buf.put_u32_le(crc);
        assert!(parse(&buf, 1).is_ok());
        assert!(
            parse(&buf, 2).is_err(),
            "a count other than the one written"
        );
        let mut bad = buf.clone();
        bad[7] ^= 1;
        assert_eq!(parse(&bad, 1), Err("checksum mismatch".to_owned()));
        assert!(parse(&buf[..3], 1).is_err());
    }
}
