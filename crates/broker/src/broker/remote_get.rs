//! basic.get on a replicated queue another node leads: the get goes to the leader as a
//! `GetBy` of this node, and its answer is the entry's, when this node applies it. The
//! channel waits meanwhile (its connection is not read), as a RabbitMQ channel waits for a
//! quorum queue's leader.
//!
//! The leader always takes the message with an ack to come, even for a no-ack get: the node
//! that asked settles it once the client has it. An answer nobody waits for any more (the
//! wait ran out, the channel closed) gives the message back, so a get that is lost on its way
//! costs a redelivery, never a message.
//!
//! A get is known lost, and answered empty at once, when an entry of a later term, or a later
//! entry of this node's, is applied without it: Raft applies an entry before any of a later
//! term, and this node's forwards in the order it sent them. A snapshot that skips a get's
//! entry (or the entry of one whose wait ran out) brings this node `Down`: the message the
//! skipped entry took comes back.
//!
//! On the leader itself, a get while its machine runs ahead of the log waits the same way
//! ([`HeldGet`]), for the log to have the get.

use super::*;
use crate::replica::{Mode, NodeId};

/// A get forwarded to a leader and not answered within this long is answered empty (a
/// poller asks again); its entry, if it commits later, gives the message back.
pub const GET_WAIT_MS: u64 = 5_000;

/// What a basic.get gets now, or the ticket of the answer to come.
// Returned by value once per basic.get, as `Broker::get`'s answer is: boxing saves nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Got {
    /// The message and how many stay ready, or nothing (get-empty).
    Now(Option<(Delivery, u32)>),
    /// Sent to the queue's leader: the answer comes from [`Broker::take_get_answers`] with
    /// this ticket.
    Waiting(u64),
}

/// The answer to a forwarded basic.get, for the channel that waits with `ticket`.
#[derive(Debug)]
pub struct GetAnswer {
    pub conn: ConnId,
    pub channel: u16,
    pub ticket: u64,
    /// The message (not settled: the channel settles a no-ack get once it is sent) and how
    /// many stay ready; `None`: get-empty.
    pub got: Option<(Delivery, u32)>,
}

/// A get on the queue's leader while its machine runs ahead of the log: the message is taken
/// there at once, and handed out once the log has the get (its hold applied; nothing, if the
/// hold is lost). Raft commits the message's own entry before the get, so the client never
/// sees a message a failover takes back. Before, such a get answered get-empty, and a poller
/// of a queue a publisher was busy with got nothing most of the time.
#[derive(Debug)]
struct HeldGet {
    conn: ConnId,
    channel: u16,
    ticket: u64,
    got: (Delivery, u32),
    /// When it was taken, and the leader's term then.
    since: u64,
    term: u64,
}

#[derive(Debug)]
struct Waiter {
    conn: ConnId,
    channel: u16,
    ticket: u64,
    since: u64,
    /// The term of the leader it was sent to, as this node knew it.
    term: u64,
}

/// The forwarded gets of this node, by group and proposal number.
#[derive(Debug, Default)]
pub(super) struct RemoteGets {
    waiting: BTreeMap<(u64, u64), Waiter>,
    /// Gets answered empty when their wait ran out, whose entries may still be applied (with
    /// the term they were sent in): a snapshot that skips one must bring this node `Down`.
    given_up: BTreeMap<(u64, u64), u64>,
    answers: Vec<GetAnswer>,
    next_ticket: u64,
    /// The leader's own gets waiting for the log, by hold.
    held: BTreeMap<u64, HeldGet>,
    /// Messages of held gets answered empty while their leader still leads (the hold lost or
    /// the wait run out): given back if it still leads in that term, by a return that the log
    /// orders after the get ([`Broker::take_get_answers`]).
    to_release: Vec<(QueueId, Receipt, u64)>,
}

/// A get of this node's applied from the log: the queue, its group, the proposal number, and
/// the delivery with how many stay ready.
pub(super) struct AppliedGet {
    pub queue: QueueId,
    pub group: u64,
    pub seq: u64,
    pub got: Option<(Delivery, u32)>,
}

impl RemoteGets {
    /// Holds settled: each held get whose hold ended is answered, with its message if the log
    /// has the get.
    pub(super) fn holds_settled(&mut self, holds: &crate::holds::Holds) {
        if self.held.is_empty() {
            return;
        }
        let ended = self.take_held(|hold, _| holds.state(hold) != crate::holds::HoldState::Pending);
        for (hold, g) in ended {
            if holds.state(hold) == crate::holds::HoldState::Applied {
                self.answer_held(g, true);
            } else {
                self.give_back(g);
            }
        }
    }

    /// Answers a held get empty; its message goes back if its leader still leads.
    fn give_back(&mut self, g: HeldGet) {
        let (d, _) = &g.got;
        self.to_release.push((d.queue, d.receipt, g.term));
        self.answer_held(g, false);
    }

    /// The leader of `queue` stepped down: its held gets are answered empty. Their messages
    /// went back with the machine that ran ahead; a get whose entry commits still, the node
    /// applies as another's and gives back (no waiter), and the next leader's `Down` of this
    /// node returns what it took.
    pub(super) fn stepped_down(&mut self, queue: QueueId) {
        for (_, g) in self.take_held(|_, g| g.got.0.queue == queue) {
            self.answer_held(g, false);
        }
    }

    /// Takes the held gets `which` picks, by hold.
    fn take_held(&mut self, which: impl Fn(u64, &HeldGet) -> bool) -> Vec<(u64, HeldGet)> {
        let (taken, kept): (BTreeMap<u64, HeldGet>, _) = std::mem::take(&mut self.held)
            .into_iter()
            .partition(|(hold, g)| which(*hold, g));
        self.held = kept;
        taken.into_iter().collect()
    }

    /// Answers a held get: with its message, or get-empty.
    fn answer_held(&mut self, g: HeldGet, with_message: bool) {
        self.answers.push(GetAnswer {
            conn: g.conn,
            channel: g.channel,
            ticket: g.ticket,
            got: with_message.then_some(g.got),
        });
    }

    /// Answers the get empty (its entry may still come: `given_up` keeps it).
    fn give_up(&mut self, key: (u64, u64)) {
        if let Some(w) = self.waiting.remove(&key) {
            self.given_up.insert(key, w.term);
            self.answer_empty(w);
        }
    }

    fn answer_empty(&mut self, w: Waiter) {
        self.answers.push(GetAnswer {
            conn: w.conn,
            channel: w.channel,
            ticket: w.ticket,
            got: None,
        });
    }

    /// An entry of `group` in `term` was applied (`own_seq`: this node's proposal number, if
    /// it was this node's): every get of the group whose entry can no longer come is
    /// answered empty and forgotten.
    pub(super) fn applied(&mut self, group: u64, term: u64, own_seq: Option<u64>) {
        // The entry being applied is not lost, whatever its term (this node's view of the
        // leader's term when it sent it may have been behind).
        let lost = |(g, seq): &(u64, u64), sent_term: u64| {
            *g == group
                && own_seq != Some(*seq)
                && (term > sent_term || own_seq.is_some_and(|own| own > *seq))
        };
        let gone: Vec<(u64, u64)> = self
            .waiting
            .range((group, 0)..=(group, u64::MAX))
            .filter(|(k, w)| lost(k, w.term))
            .map(|(k, _)| *k)
            .collect();
        for k in gone {
            if let Some(w) = self.waiting.remove(&k) {
                self.answer_empty(w);
            }
        }
        self.given_up.retain(|k, sent_term| !lost(k, *sent_term));
    }

    /// A snapshot of `group` was installed: the gets it may have skipped are answered empty
    /// and forgotten. True if there were any (their messages may be held by this node now).
    pub(super) fn skipped(&mut self, group: u64) -> bool {
        let waiting: Vec<(u64, u64)> = self
            .waiting
            .range((group, 0)..=(group, u64::MAX))
            .map(|(k, _)| *k)
            .collect();
        let mut any = !waiting.is_empty();
        for k in waiting {
            if let Some(w) = self.waiting.remove(&k) {
                self.answer_empty(w);
            }
        }
        let before = self.given_up.len();
        self.given_up.retain(|(g, _), _| *g != group);
        any |= self.given_up.len() != before;
        any
    }
}

impl Broker {
    /// basic.get from a channel (`channel` of `conn`): as [`Broker::get`], except that a
    /// replicated queue led by another node is asked of its leader ([`Got::Waiting`]).
    pub fn basic_get(
        &mut self,
        vhost: &str,
        queue: &str,
        no_ack: bool,
        conn: ConnId,
        channel: u16,
    ) -> Result<Got, AmqpError> {
        let name = strip_cr_lf(queue);
        let q = self.queue_by_name(vhost, &name)?;
        check_access(q, conn)?;
        let id = q.id;
        let node = self.cluster_node();
        // `Some(None)`: nothing can be handed out now (an election is on, or this node was
        // just elected and does not act yet): get-empty, and a poller asks again.
        // Nothing ready here either: empty, without an entry per poll (what the leader has and
        // this node has not applied yet is a few milliseconds old). A poll of a queue with
        // `x-expires` is a use, which only the log can record.
        let idle = q.machine.ready_count() == 0 && q.args.expires_ms.is_none();
        let ahead = q
            .replica
            .as_ref()
            .is_some_and(|r| r.is_leading() && !r.caught_up());
        let elsewhere = q.replica.as_ref().and_then(|r| match r.mode {
            Mode::Following if idle => Some(None),
            Mode::Following => Some(r.leader.filter(|l| Some(*l) != node)),
            Mode::Starting { .. } => Some(None),
            Mode::Leading { .. } => None,
        });
        match elsewhere {
            None if ahead && !idle => self.held_get(vhost, queue, conn, channel),
            None => self.get(vhost, queue, no_ack, conn).map(Got::Now),
            Some(None) => Ok(Got::Now(None)),
            Some(Some(leader)) => Ok(match self.forward_get(id, leader, conn, channel) {
                Some(ticket) => Got::Waiting(ticket),
                None => Got::Now(None),
            }),
        }
    }

    /// A get on a leader whose machine runs ahead of its log ([`HeldGet`]): taken with an ack
    /// to come, as a forwarded get is (the channel settles a no-ack get once it is sent).
    fn held_get(
        &mut self,
        vhost: &str,
        queue: &str,
        conn: ConnId,
        channel: u16,
    ) -> Result<Got, AmqpError> {
        self.open_hold_every();
        let got = self.get_awaited(vhost, queue, false, conn);
        let hold = self.close_hold();
        let Some(got) = got? else {
            return Ok(Got::Now(None));
        };
        let now = self.now_ms;
        let term = self
            .queues
            .get(&got.0.queue)
            .and_then(|q| q.replica.as_ref())
            .map_or(0, |r| r.term);
        let Some(c) = self.cluster.as_mut() else {
            return Ok(Got::Now(Some(got)));
        };
        match c.holds.state(hold) {
            crate::holds::HoldState::Applied => Ok(Got::Now(Some(got))),
            crate::holds::HoldState::Lost => {
                // Its entry was never sent: the message goes back.
                self.release(got.0.queue, got.0.receipt);
                Ok(Got::Now(None))
            }
            crate::holds::HoldState::Pending => {
                let gets = &mut c.gets;
                gets.next_ticket += 1;
                let ticket = gets.next_ticket;
                gets.held.insert(
                    hold,
                    HeldGet {
                        conn,
                        channel,
                        ticket,
                        got,
                        since: now,
                        term,
                    },
                );
                Ok(Got::Waiting(ticket))
            }
        }
    }

    fn forward_get(
        &mut self,
        id: QueueId,
        leader: NodeId,
        conn: ConnId,
        channel: u16,
    ) -> Option<u64> {
        let node = u16::try_from(self.cluster_node()?).unwrap_or(u16::MAX);
        // Taken with an ack to come, whatever the client asked: see the module's comment.
        let command = Command::GetBy {
            no_ack: false,
            node,
        };
        let term = self
            .queues
            .get(&id)
            .and_then(|q| q.replica.as_ref())
            .map_or(0, |r| r.term);
        let (group, seq) = self.forward_once(id, leader, &command)?;
        let now = self.now_ms;
        let gets = &mut self.cluster.as_mut()?.gets;
        gets.next_ticket += 1;
        let ticket = gets.next_ticket;
        gets.waiting.insert(
            (group, seq),
            Waiter {
                conn,
                channel,
                ticket,
                since: now,
                term,
            },
        );
        Some(ticket)
    }

    /// Answers to forwarded gets, into `out`.
    pub fn take_get_answers(&mut self, out: &mut Vec<GetAnswer>) {
        let Some(c) = self.cluster.as_mut() else {
            return;
        };
        out.append(&mut c.gets.answers);
        for (queue, receipt, term) in std::mem::take(&mut c.gets.to_release) {
            let still = self
                .queues
                .get(&queue)
                .and_then(|q| q.replica.as_ref())
                .is_some_and(|r| r.is_leading() && r.term == term);
            if still {
                self.release(queue, receipt);
            }
        }
    }

    /// This node's gets the log applied: each answers its waiter, or gives its message back.
    pub(super) fn gets_applied(&mut self, applied: Vec<AppliedGet>) {
        for a in applied {
            let waiter = self.cluster.as_mut().and_then(|c| {
                c.gets.given_up.remove(&(a.group, a.seq));
                c.gets.waiting.remove(&(a.group, a.seq))
            });
            match (waiter, a.got) {
                (Some(w), got) => {
                    if let Some(c) = self.cluster.as_mut() {
                        c.gets.answers.push(GetAnswer {
                            conn: w.conn,
                            channel: w.channel,
                            ticket: w.ticket,
                            got,
                        });
                    }
                }
                (None, Some((d, _))) => {
                    // Asked again, or answered empty meanwhile: the message goes back.
                    self.release(a.queue, d.receipt);
                }
                (None, None) => {}
            }
        }
    }

    /// Gets waiting longer than [`GET_WAIT_MS`] are answered empty.
    pub(super) fn expire_gets(&mut self) {
        let now = self.now_ms;
        let Some(c) = self.cluster.as_mut() else {
            return;
        };
        let late: Vec<(u64, u64)> = c
            .gets
            .waiting
            .iter()
            .filter(|(_, w)| now.saturating_sub(w.since) >= GET_WAIT_MS)
            .map(|(k, _)| *k)
            .collect();
        for k in late {
            tracing::debug!(
                group = k.0,
                "a forwarded basic.get was not answered in time: get-empty"
            );
            c.gets.give_up(k);
        }
        // A leader's own get waits no longer than a forwarded one (its group cannot commit).
        let late = c
            .gets
            .take_held(|_, g| now.saturating_sub(g.since) >= GET_WAIT_MS);
        for (_, g) in late {
            tracing::debug!(
                queue = %g.got.0.queue_name,
                "a basic.get's entry was not committed in time: get-empty"
            );
            c.gets.give_back(g);
        }
    }

    /// When the oldest waiting get runs out.
    pub(super) fn get_deadline(&self) -> Option<u64> {
        let c = self.cluster.as_ref()?;
        c.gets
            .waiting
            .values()
            .map(|w| w.since)
            .chain(c.gets.held.values().map(|g| g.since))
            .map(|since| since.saturating_add(GET_WAIT_MS))
            .min()
    }

    /// Are answers of forwarded gets waiting to be taken ([`Broker::take_get_answers`])?
    pub fn has_get_answers(&self) -> bool {
        self.cluster
            .as_ref()
            .is_some_and(|c| !c.gets.answers.is_empty())
    }
}
