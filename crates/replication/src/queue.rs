//! A replicated queue's state on one member: its queue machine, fed only with committed entries
//! ("replicate, then apply").
//!
//! An entry is the leader's time and one machine command (`[now_ms u64 big-endian]` followed by
//! [`warren_queue::log::encode_entry`]'s versioned, checksummed command). The time is the
//! leader's, chosen when it proposed, so every member applies the command at the same moment
//! and expiries, visibility timeouts and delays fall at the same log position everywhere. The
//! entry's Raft index is the machine's [`Meta::index`].

use bytes::{Buf, Bytes, BytesMut};
use warren_queue::log::{decode_entry, encode_entry, EntryError, LogError as EntryDecodeError};
use warren_queue::machine::{Command, Effect, Meta, QueueMachine, Reply};
use warren_queue::Message;

use crate::Committed;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum QueueEntryError {
    #[error(transparent)]
    Encode(#[from] EntryError),
    #[error("entry of {0} bytes is too short for its time")]
    Short(usize),
    #[error(transparent)]
    Decode(#[from] EntryDecodeError),
}

/// The bytes a leader proposes for `command` at its time `now_ms`.
pub fn encode(now_ms: u64, command: &Command<Message>) -> Result<Vec<u8>, QueueEntryError> {
    let mut out = BytesMut::with_capacity(64);
    out.extend_from_slice(&now_ms.to_be_bytes());
    encode_entry(command, &mut out)?;
    Ok(out.to_vec())
}

/// The leader's time and the command of an entry written by [`encode`].
pub fn decode(mut data: Bytes) -> Result<(u64, Command<Message>), QueueEntryError> {
    if data.len() < 8 {
        return Err(QueueEntryError::Short(data.len()));
    }
    let now_ms = data.get_u64();
    Ok((now_ms, decode_entry(data)?))
}

/// One member's copy of a replicated queue.
#[derive(Debug, Default)]
pub struct Replica {
    machine: QueueMachine<Message>,
    /// The Raft index of the last entry applied.
    applied: u64,
}

impl Replica {
    pub fn new() -> Self {
        Replica::default()
    }

    pub fn machine(&self) -> &QueueMachine<Message> {
        &self.machine
    }

    pub fn applied(&self) -> u64 {
        self.applied
    }

    /// Applies a committed entry of this queue's group. An entry at or below the last applied
    /// one was applied already (a restarted member is handed its log again) and changes
    /// nothing: `None`. Only the leader acts on the effects (deliveries, dead letters); every
    /// member computes them, so a new leader is where its predecessor was.
    pub fn apply(
        &mut self,
        entry: &Committed,
        effects: &mut Vec<Effect<Message>>,
    ) -> Result<Option<Reply>, QueueEntryError> {
        if entry.index <= self.applied {
            return Ok(None);
        }
        let (now_ms, command) = decode(entry.data.clone())?;
        let meta = Meta {
            index: entry.index,
            now_ms,
        };
        self.applied = entry.index;
        Ok(Some(self.machine.apply(meta, command, effects)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::GroupId;
    use warren_codec::ShortStr;
    use warren_queue::machine::MsgMeta;

    fn enqueue(body: &'static [u8]) -> Command<Message> {
        Command::Enqueue {
            message: Message {
                exchange: ShortStr::from_static(""),
                routing_key: ShortStr::from_static("q"),
                properties: Bytes::from_static(&[0, 0]),
                body: Bytes::from_static(body),
                persistent: true,
                store_key: Some(9),
            },
            meta: MsgMeta {
                size: body.len() as u64,
                pageable: true,
                ..MsgMeta::default()
            },
        }
    }

    #[test]
    fn an_entry_carries_the_leaders_time_and_is_applied_once_in_order() {
        let data = encode(1234, &enqueue(b"a")).unwrap();
        let (now, _) = decode(Bytes::from(data.clone())).unwrap();
        assert_eq!(now, 1234);
        assert_eq!(
            decode(Bytes::from_static(b"short")),
            Err(QueueEntryError::Short(5))
        );
        let committed = |index: u64, data: Vec<u8>| Committed {
            group: GroupId(1),
            index,
            term: 1,
            data: Bytes::from(data),
        };
        let mut r = Replica::new();
        let mut effects = Vec::new();
        assert!(matches!(
            r.apply(&committed(3, data.clone()), &mut effects),
            Ok(Some(Reply::Enqueued { msg_id: 0 }))
        ));
        // Handed the same entry again (a restart replays the log): nothing changes.
        assert_eq!(r.apply(&committed(3, data), &mut effects), Ok(None));
        assert_eq!(r.machine().ready_count(), 1);
        assert_eq!(r.applied(), 3);
        // Node-local commands never become entries.
        let page = Command::PageOut {
            keep: 0,
            keep_bytes: 0,
            upto_id: 0,
        };
        assert!(matches!(encode(1, &page), Err(QueueEntryError::Encode(_))));
    }
}
