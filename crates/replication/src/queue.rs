//! A replicated queue's state on one member: its queue machine, fed only with committed entries
//! ("replicate, then apply").
//!
//! An entry is the leader's time, the proposal's origin and one machine command (`[now_ms u64]
//! [origin node u64][proposal seq u64]`, big-endian, then [`warren_queue::log::encode_entry`]'s
//! versioned, checksummed command). The time is the leader's, chosen when it proposed, so every
//! member applies the command at the same moment and expiries, visibility timeouts and delays
//! fall at the same log position everywhere. The origin lets the node that proposed find its
//! answer ([`Proposals`]); the other members ignore it. A Raft entry may join several such
//! entries ([`crate::batch`]). [`Replica`], the spike's member, takes the entry's Raft index for
//! the machine's [`Meta::index`]; the broker's members count commands instead.

use bytes::{Buf, Bytes, BytesMut};
use warren_queue::log::{decode_entry, encode_entry, EntryError, LogError as EntryDecodeError};
use warren_queue::machine::{Command, Effect, Meta, QueueMachine, Reply};
use warren_queue::Message;

use std::collections::{BTreeMap, VecDeque};

use crate::{Committed, GroupId, NodeId};

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum QueueEntryError {
    #[error(transparent)]
    Encode(#[from] EntryError),
    #[error("entry of {0} bytes is too short for its time")]
    Short(usize),
    #[error(transparent)]
    Decode(#[from] EntryDecodeError),
}

/// Who proposed an entry: a node and its proposal number there (0: nobody waits for it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Origin {
    pub node: NodeId,
    pub seq: u64,
}

/// What an entry carries besides its command.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EntryHead {
    pub now_ms: u64,
    pub origin: Origin,
}

const HEAD_LEN: usize = 24;

/// The bytes a leader proposes for `command` at its time `now_ms`.
pub fn encode(
    now_ms: u64,
    origin: Origin,
    command: &Command<Message>,
) -> Result<Vec<u8>, QueueEntryError> {
    let mut out = BytesMut::with_capacity(64);
    out.extend_from_slice(&now_ms.to_be_bytes());
    out.extend_from_slice(&origin.node.to_be_bytes());
    out.extend_from_slice(&origin.seq.to_be_bytes());
    encode_entry(command, &mut out)?;
    Ok(out.to_vec())
}

/// The head and the command of an entry written by [`encode`].
pub fn decode(mut data: Bytes) -> Result<(EntryHead, Command<Message>), QueueEntryError> {
    if data.len() < HEAD_LEN {
        return Err(QueueEntryError::Short(data.len()));
    }
    let now_ms = data.get_u64();
    let origin = Origin {
        node: data.get_u64(),
        seq: data.get_u64(),
    };
    Ok((EntryHead { now_ms, origin }, decode_entry(data)?))
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
    ) -> Result<Option<(Origin, Reply)>, QueueEntryError> {
        if entry.index <= self.applied {
            return Ok(None);
        }
        let (head, command) = decode(entry.data.clone())?;
        let meta = Meta {
            index: entry.index,
            now_ms: head.now_ms,
        };
        self.applied = entry.index;
        Ok(Some((
            head.origin,
            self.machine.apply(meta, command, effects),
        )))
    }

    /// Is a timer of the queue due (an expiry, a visibility or consumer timeout, a retry's
    /// back-off, `x-expires`)? The leader then proposes a `Tick`: time moves the machine only
    /// through the log.
    pub fn due(&self, now_ms: u64) -> bool {
        self.machine.next_deadline().is_some_and(|at| at <= now_ms)
    }
}

/// What became of a proposal made on this node.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome<T> {
    /// Committed and applied: the machine's answer.
    Applied(T, Reply),
    /// A later proposal of this node committed in the same group while this one did not: a
    /// leader change dropped it. The caller resends (an `EnqueueFrom` resend is harmless) or
    /// nacks; it is never silently taken for done.
    Lost(T),
}

/// The proposals this node made and is waiting for, per group, in proposal order.
#[derive(Debug)]
pub struct Proposals<T> {
    node: NodeId,
    next_seq: u64,
    waiting: BTreeMap<GroupId, VecDeque<(u64, T)>>,
}

impl<T> Proposals<T> {
    pub fn new(node: NodeId) -> Self {
        Self::starting_at(node, 1)
    }

    /// Numbers from `first` (above every number this node gave before a restart, so that the
    /// entries it replays are not taken for its new proposals).
    pub fn starting_at(node: NodeId, first: u64) -> Self {
        Proposals {
            node,
            next_seq: first.max(1),
            waiting: BTreeMap::new(),
        }
    }

    /// The origin for the next proposal in `group`, remembered with `token` until its entry
    /// is applied ([`Proposals::applied`]) or known lost.
    pub fn next(&mut self, group: GroupId, token: T) -> Origin {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.waiting
            .entry(group)
            .or_default()
            .push_back((seq, token));
        Origin {
            node: self.node,
            seq,
        }
    }

    /// The number the next proposal will have: those numbered from it on are made after now.
    pub fn upcoming(&self) -> u64 {
        self.next_seq
    }

    /// Takes back the proposal `origin` names if it was refused at once (this node is not the
    /// leader any more): nothing waits for it.
    pub fn withdraw(&mut self, group: GroupId, origin: Origin) -> Option<T> {
        let line = self.waiting.get_mut(&group)?;
        let at = line.iter().position(|(seq, _)| *seq == origin.seq)?;
        let token = line.remove(at).map(|(_, token)| token);
        if line.is_empty() {
            self.waiting.remove(&group);
        }
        token
    }

    /// An entry of `group` from `origin` was applied with `reply`: its proposal's outcome, and
    /// those of this node's earlier proposals in the group that can no longer commit.
    pub fn applied(
        &mut self,
        group: GroupId,
        origin: Origin,
        reply: Reply,
        out: &mut Vec<Outcome<T>>,
    ) {
        if origin.node != self.node {
            return;
        }
        let Some(line) = self.waiting.get_mut(&group) else {
            return;
        };
        while let Some((seq, _)) = line.front() {
            if *seq > origin.seq {
                // Not this node's any more (it restarted and reuses numbers): nothing waits.
                return;
            }
            let Some((seq, token)) = line.pop_front() else {
                return;
            };
            if seq == origin.seq {
                out.push(Outcome::Applied(token, reply));
                break;
            }
            out.push(Outcome::Lost(token));
        }
        if line.is_empty() {
            self.waiting.remove(&group);
        }
    }

    /// The token of proposal `seq` in `group`, while it waits.
    pub fn waiting_mut(&mut self, group: GroupId, seq: u64) -> Option<&mut T> {
        self.waiting
            .get_mut(&group)?
            .iter_mut()
            .find(|(s, _)| *s == seq)
            .map(|(_, token)| token)
    }

    /// Gives up the proposals of `group` whose tokens `lost` picks (their entries can no
    /// longer commit), in order; the others keep waiting for their entries.
    pub fn lose_where(
        &mut self,
        group: GroupId,
        mut lost: impl FnMut(&T) -> bool,
        out: &mut Vec<Outcome<T>>,
    ) {
        let Some(line) = self.waiting.get_mut(&group) else {
            return;
        };
        let mut kept = VecDeque::with_capacity(line.len());
        for (seq, token) in line.drain(..) {
            if lost(&token) {
                out.push(Outcome::Lost(token));
            } else {
                kept.push_back((seq, token));
            }
        }
        if kept.is_empty() {
            self.waiting.remove(&group);
        } else {
            *line = kept;
        }
    }

    /// Proposals still waiting in all groups.
    pub fn len(&self) -> usize {
        self.waiting.values().map(VecDeque::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }

    /// Does a proposal of this node in `group` whose number and token pass `test` still wait?
    pub fn any_waiting(&self, group: GroupId, test: impl Fn(u64, &T) -> bool) -> bool {
        self.waiting
            .get(&group)
            .is_some_and(|line| line.iter().any(|(seq, t)| test(*seq, t)))
    }

    /// The number of the last proposal of this node in `group` whose token passes `test` and
    /// still waits.
    pub fn last_waiting(&self, group: GroupId, test: impl Fn(&T) -> bool) -> Option<u64> {
        self.waiting
            .get(&group)?
            .iter()
            .rev()
            .find(|(_, t)| test(t))
            .map(|(seq, _)| *seq)
    }

    /// Does nothing of this node wait in `group`?
    pub fn is_empty_in(&self, group: GroupId) -> bool {
        !self.waiting.contains_key(&group)
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
                away: None,
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
        let origin = Origin { node: 2, seq: 7 };
        let data = encode(1234, origin, &enqueue(b"a")).unwrap();
        let (head, _) = decode(Bytes::from(data.clone())).unwrap();
        assert_eq!(
            head,
            EntryHead {
                now_ms: 1234,
                origin
            }
        );
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
            Ok(Some((o, Reply::Enqueued { msg_id: 0 }))) if o == origin
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
        assert!(matches!(
            encode(1, Origin::default(), &page),
            Err(QueueEntryError::Encode(_))
        ));
    }

    #[test]
    fn a_proposal_is_answered_once_and_one_overtaken_by_a_later_commit_is_lost() {
        let (g, other) = (GroupId(1), GroupId(2));
        let mut p = Proposals::new(1);
        let a = p.next(g, "a");
        let b = p.next(g, "b");
        let c = p.next(g, "c");
        let d = p.next(other, "d");
        let mut out = Vec::new();
        // Another node's entry is not ours.
        p.applied(
            g,
            Origin {
                node: 2,
                seq: a.seq,
            },
            Reply::Ok,
            &mut out,
        );
        assert!(out.is_empty());
        p.applied(g, a, Reply::Ok, &mut out);
        assert_eq!(out, vec![Outcome::Applied("a", Reply::Ok)]);
        out.clear();
        // b was dropped by a leader change; c made it.
        p.applied(g, c, Reply::Duplicate, &mut out);
        assert_eq!(
            out,
            vec![Outcome::Lost("b"), Outcome::Applied("c", Reply::Duplicate)]
        );
        assert_eq!(p.len(), 1, "d waits in its own group");
        assert_eq!(p.withdraw(other, d), Some("d"));
        assert!(p.is_empty());
        // Handed c again (a replay): nothing waits for it any more.
        out.clear();
        p.applied(g, c, Reply::Ok, &mut out);
        assert!(out.is_empty());
        let _ = b;
    }

    #[test]
    fn giving_up_some_proposals_keeps_the_others_waiting_in_order() {
        let g = GroupId(1);
        let mut p = Proposals::new(1);
        let _a = p.next(g, ("a", false));
        let b = p.next(g, ("b", true));
        let _c = p.next(g, ("c", false));
        let d = p.next(g, ("d", true));
        if let Some(t) = p.waiting_mut(g, d.seq) {
            t.0 = "d2";
        }
        assert!(p.waiting_mut(GroupId(2), d.seq).is_none());
        let mut out = Vec::new();
        p.lose_where(g, |t| !t.1, &mut out);
        assert_eq!(
            out,
            vec![Outcome::Lost(("a", false)), Outcome::Lost(("c", false))]
        );
        out.clear();
        p.applied(g, d, Reply::Ok, &mut out);
        assert_eq!(
            out,
            vec![
                Outcome::Lost(("b", true)),
                Outcome::Applied(("d2", true), Reply::Ok)
            ]
        );
        p.lose_where(g, |_| true, &mut out);
        assert!(p.is_empty());
        let _ = b;
    }
}
