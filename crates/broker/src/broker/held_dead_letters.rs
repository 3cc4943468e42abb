//! At-least-once dead-lettering out of replicated queues (`Policy::hold_dead_letters`).
//!
//! A replicated queue's leader acts on a dead letter ahead of the log, as on every effect: the
//! entry that takes the message out of the queue (a return past its delivery limit, a reject,
//! an expiry) can commit while the dead letter's own entry, in another queue's group, has not,
//! and a failover between the two would lose the message. So the queue's machine keeps the
//! message, outside the queue, until this node sees its dead letter safe in its targets (the
//! store batch its republish waits in is written and every replicated entry of that batch
//! applied: what a publisher's confirm waits for) and proposes `DeadLettered`. A leader that
//! starts acting sends again whatever its machine still holds: a failover may double a dead
//! letter, never lose one. This is RabbitMQ's `at-least-once` dead-letter strategy, for every
//! replicated queue with a dead-letter exchange.

use std::collections::{BTreeMap, BTreeSet};

use super::*;
use crate::machine::Dead;

/// Most ids in one `Command::DeadLettered` entry: a queue that settles a large backlog at once
/// must not make an entry larger than a proposal may be.
const SETTLED_PER_ENTRY: usize = 4_096;

/// The dead letters of held messages on their way, by what they wait for.
#[derive(Debug, Default)]
pub(super) struct HeldDeadLetters {
    /// Republished, until the batch their copies' confirms wait in is confirmable.
    waiting: BTreeMap<u64, Vec<(QueueId, u64)>>,
    /// To be sent again: (when, queue, message id).
    retry: BTreeSet<(u64, QueueId, u64)>,
    /// How many times each was sent again, for its back-off (1 s, doubling, to 60 s, as a
    /// delayed message refused by a full queue): a dead-letter queue that stays full, or without
    /// a leader, costs a proposal a minute per message, not one a second.
    attempts: HashMap<(QueueId, u64), u32>,
    /// Safe in their targets, or dropped as a dead letter with nowhere to go is: settled in
    /// their queues at the next chance (not from inside a command's effects).
    done: Vec<(QueueId, u64)>,
    /// A held message's dead letter is being republished: its copies need no guard record
    /// (`Broker::release_guard`), since its queue keeps it until they are safe.
    pub(super) publishing: bool,
    /// What the cluster's feature level lets replicated queues do, as last seen.
    level_on: LevelRules,
}

/// What a queue's machine may do that every member of it must do alike: what the cluster's
/// feature level allows a replicated queue ([`Broker::level_rules`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct LevelRules {
    /// Dead letters held until they are safe (`Policy::hold_dead_letters`).
    pub(super) hold: bool,
    /// The line's census per message group (`Policy::index_groups`).
    pub(super) index_groups: bool,
}

/// What a queue asks of its machine: its arguments' policy, and, when the rules allow it and
/// it has a dead-letter exchange, dead letters held until they are safe.
pub(super) fn queue_policy(a: &crate::queue::args::QueueArgs, rules: LevelRules) -> Policy {
    Policy {
        hold_dead_letters: rules.hold && a.dead_letter_exchange.is_some(),
        index_groups: rules.index_groups,
        ..policy(a)
    }
}

impl HeldDeadLetters {
    fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.retry.is_empty() && self.done.is_empty()
    }
}

impl Broker {
    /// The metadata changed (a level announced, a node forgotten, a snapshot installed): once
    /// every node can, the queues led here start holding their dead letters (and counting
    /// their lines per group) at once, not at their next leader's term.
    pub(super) fn check_hold_level(&mut self) {
        let on = self.level_rules(true);
        if on != self.held_dead_letters.level_on {
            self.held_dead_letters.level_on = on;
            if on != LevelRules::default() {
                self.configure_led_queues();
            }
        }
    }

    /// What a queue here may ask of its machine: a local one, everything this version can; a
    /// replicated one, what every node of the cluster can. Only a replicated queue holds its
    /// dead letters (a local one's dead letters are on this node's disk already).
    pub(super) fn level_rules(&self, replicated: bool) -> LevelRules {
        let level = self.cluster_feature_level().unwrap_or(0);
        LevelRules {
            hold: replicated && level >= super::metadata_group::HELD_DEAD_LETTERS_LEVEL,
            index_groups: !replicated || level >= super::metadata_group::GROUP_INDEX_LEVEL,
        }
    }

    /// What became of the republish of held message `source`'s dead letter.
    pub(super) fn held_dead_letter_routed(
        &mut self,
        source: (QueueId, u64),
        routed: &Result<Routed, AmqpError>,
    ) {
        match routed {
            // A target without a leader: sent again after a back-off, to every target (those
            // that took it get a second copy).
            Ok(Routed { unled: true, .. }) => self.retry_held_later(source),
            // A full `reject-publish` target that refused it: sent again likewise with
            // RabbitMQ's `at-least-once` strategy; dropped for that target with its default
            // `at-most-once`, as RabbitMQ drops it (kept, a queue full for hours would hold every
            // dead letter meanwhile on every member, outside its counts).
            Ok(Routed { full: true, .. }) if self.dead_letters_at_least_once(source.0) => {
                self.retry_held_later(source)
            }
            Ok(Routed {
                batch: Some(batch), ..
            }) => self
                .held_dead_letters
                .waiting
                .entry(*batch)
                .or_default()
                .push(source),
            // In memory only (a transient message, or targets without a store: a broker without
            // one keeps nothing across a crash anyway), or dropped as RabbitMQ drops a dead
            // letter that has nowhere to go (no exchange, routed to no queue).
            _ => self.held_dead_letters.done.push(source),
        }
    }

    /// Queue `id` asks for `at-least-once` dead-lettering (`x-dead-letter-strategy`, or the
    /// policy's `dead-letter-strategy`).
    fn dead_letters_at_least_once(&self, id: QueueId) -> bool {
        self.queues.get(&id).is_some_and(|q| {
            q.args.dead_letter_strategy == crate::queue::args::DeadLetterStrategy::AtLeastOnce
        })
    }

    /// Sends the dead letter of held message `source` again after its back-off.
    fn retry_held_later(&mut self, source: (QueueId, u64)) {
        let h = &mut self.held_dead_letters;
        let n = h.attempts.entry(source).or_insert(0);
        let at = self
            .now_ms
            .saturating_add(crate::delayed::refused_retry_ms(*n));
        *n = n.saturating_add(1);
        h.retry.insert((at, source.0, source.1));
    }

    /// A dead-lettered message of a queue whose dead letters are held, with nothing to send:
    /// settled as soon as it can be.
    pub(super) fn held_dead_letter_dropped(&mut self, source: (QueueId, u64)) {
        self.held_dead_letters.done.push(source);
    }

    /// Batches up to `upto` were nacked (an entry lost, a write failed): their dead letters are
    /// sent again.
    pub(super) fn held_dead_letters_lost(&mut self, upto: u64) {
        let h = &mut self.held_dead_letters;
        if upto == 0 || h.waiting.first_key_value().is_none_or(|(b, _)| *b > upto) {
            return;
        }
        let later = h.waiting.split_off(&upto.saturating_add(1));
        let lost = std::mem::replace(&mut h.waiting, later);
        // (A nack covers every batch up to the lost one: some of these were applied, and
        // arrive twice.)
        for source in lost.into_values().flatten() {
            tracing::debug!(
                queue = source.0 .0,
                msg_id = source.1,
                "a held dead letter's batch was nacked: sent again after a back-off"
            );
            self.retry_held_later(source);
        }
    }

    /// Settles the held messages whose dead letters are safe: called wherever confirms may
    /// move (writes done, entries applied, ticks).
    pub(super) fn settle_held_dead_letters(&mut self) {
        if self.held_dead_letters.is_idle() {
            return;
        }
        // A nacked batch first: its lost entry no longer holds its batch back, and must not
        // make it look confirmable.
        let lost = self.cluster.as_ref().map_or(0, |c| c.lost_mark());
        self.held_dead_letters_lost(lost);
        let ok = self.confirmable(self.disk.written);
        let h = &mut self.held_dead_letters;
        if h.waiting.first_key_value().is_some_and(|(b, _)| *b <= ok) {
            let later = h.waiting.split_off(&ok.saturating_add(1));
            let safe = std::mem::replace(&mut h.waiting, later);
            h.done.extend(safe.into_values().flatten());
        }
        if h.done.is_empty() {
            return;
        }
        let mut done = std::mem::take(&mut h.done);
        done.sort_unstable();
        done.dedup();
        for source in &done {
            h.attempts.remove(source);
        }
        let mut i = 0;
        while i < done.len() {
            let queue = done[i].0;
            let end = done[i..]
                .iter()
                .position(|(q, _)| *q != queue)
                .map_or(done.len(), |n| i + n);
            let ids: Vec<u64> = done[i..end]
                .iter()
                .map(|(_, id)| *id)
                .filter(|id| self.holds_dead(queue, *id))
                .collect();
            i = end;
            // Only a leader that acts settles: one deposed meanwhile left it to the next,
            // which sends the dead letter again.
            if !ids.is_empty() && self.acts_here(queue) {
                for chunk in ids.chunks(SETTLED_PER_ENTRY) {
                    let ids = chunk.to_vec();
                    self.run(queue, Command::DeadLettered { ids });
                }
            }
        }
    }

    /// Sends again the dead letters whose retry is due.
    pub(super) fn retry_held_dead_letters(&mut self) {
        let now = self.now_ms;
        let mut due = Vec::new();
        while let Some(&(at, queue, msg_id)) = self.held_dead_letters.retry.first() {
            if at > now {
                break;
            }
            self.held_dead_letters.retry.pop_first();
            due.push((queue, msg_id));
        }
        for (queue, msg_id) in due {
            if self.acts_here(queue) && self.holds_dead(queue, msg_id) {
                self.resend_held(queue, Some(msg_id));
            } else {
                // Settled meanwhile, or no longer led here (the next leader sends it).
                self.held_dead_letters.attempts.remove(&(queue, msg_id));
            }
        }
        self.dead_letter_pending();
    }

    /// A replicated queue's leader starts acting: every dead letter its machine holds is sent
    /// again (the previous leader may have sent some; at least once).
    pub(super) fn resend_held_dead_letters(&mut self, queue: QueueId) {
        if self
            .queues
            .get(&queue)
            .is_some_and(|q| q.machine.dead_held_count() > 0)
        {
            self.resend_held(queue, None);
            self.dead_letter_pending();
        }
    }

    /// Queues the dead letter of held message `only` of `queue` (every held one with `None`).
    fn resend_held(&mut self, queue: QueueId, only: Option<u64>) {
        if !self.acts_here(queue) {
            return;
        }
        let Some(q) = self.queues.get(&queue) else {
            return;
        };
        let mut letters = Vec::new();
        let mut dropped = Vec::new();
        // One by its id (a retry), not by a walk over all of them: a lost batch retries many
        // at once.
        let held: Box<dyn Iterator<Item = (u64, &Dead<Message>)>> = match only {
            Some(id) => Box::new(q.machine.dead_held_get(id).map(|d| (id, d)).into_iter()),
            None => Box::new(q.machine.dead_held()),
        };
        for (msg_id, d) in held {
            match super::flows::dead_letter_of(q, d.message.clone(), d.reason) {
                Some(mut dl) => {
                    dl.source = Some((queue, msg_id));
                    letters.push(dl);
                }
                None => dropped.push((queue, msg_id)),
            }
        }
        self.dead_letters.extend(letters);
        self.held_dead_letters.done.extend(dropped);
    }

    fn holds_dead(&self, queue: QueueId, msg_id: u64) -> bool {
        self.queues
            .get(&queue)
            .is_some_and(|q| q.machine.dead_held_get(msg_id).is_some())
    }

    /// When held dead letters next need this node: at once with some settled, else the first
    /// retry.
    pub(super) fn held_dead_letters_deadline(&self) -> Option<u64> {
        let h = &self.held_dead_letters;
        if !h.done.is_empty() {
            return Some(self.now_ms);
        }
        h.retry.first().map(|(at, _, _)| *at)
    }
}
