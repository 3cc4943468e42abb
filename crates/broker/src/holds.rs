//! Confirms that wait for replicated entries, one publish (or one transaction) at a time.
//!
//! A channel's publish to a quorum queue is confirmed once its entry is committed. Counted
//! per store batch, one entry that could not commit (its group electing, installing a
//! snapshot, or without a majority) held back every later confirm of the node, for every
//! queue and every channel, until the timeout nacked them all. A hold is the wait of one
//! channel's publish instead: the channel's own later confirms still wait behind it (they
//! keep publish order), while other channels' confirms go out as soon as their own entries
//! are in.
//!
//! The session opens a hold around a publish ([`Holds::open`]), the queues' proposals made
//! while it is open count in it, and closing it says whether the publish waits for one. A
//! hold is pending until every proposal in it is applied (then it is forgotten: a hold the
//! map does not know is a success) or one is lost (then it is kept as lost until no channel
//! waits on it any more, [`Holds::prune_lost_below`]).

use std::collections::{BTreeMap, BTreeSet};

/// What became of a hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HoldState {
    /// Entries of it are not applied yet.
    Pending,
    /// Every entry of it is applied.
    Applied,
    /// An entry of it will never be applied (a leader change dropped it, or it waited past
    /// the confirm timeout): its confirm is a nack.
    Lost,
}

#[derive(Clone, Copy, Debug)]
struct Wait {
    /// Proposals not applied yet.
    proposals: u32,
    /// When the hold got its first proposal (ms).
    since: u64,
}

/// The hold being filled, while a publish (or a transaction's commit) is routed.
#[derive(Debug, Default)]
struct Span {
    id: u64,
    /// Whether the routed copies count in it now (a publish's own copies, not the dead
    /// letters or released delayed messages routed while it is open).
    counting: bool,
    /// Whether a proposal counted in it.
    used: bool,
    /// Every proposal counts while it is open, not only a publish's copies (the management
    /// API's gets, whose answer waits for the log to have them).
    every: bool,
    /// Holds of earlier publishes this one waits for too (a deduplicated publish waits for
    /// its first copy's).
    joined: Vec<u64>,
}

/// Every pending and lost hold of this node.
#[derive(Debug, Default)]
pub struct Holds {
    last: u64,
    span: Option<Span>,
    pending: BTreeMap<u64, Wait>,
    lost: BTreeSet<u64>,
    /// What waits for a pending hold (by it): settled with it.
    then: BTreeMap<u64, Vec<Follower>>,
    /// Store batches whose wait on a hold ended since the caller last looked, and whether it
    /// was lost ([`Holds::take_batches`]).
    batches: Vec<(u64, bool)>,
    /// Holds lost since the caller last looked ([`Holds::take_newly_lost`]).
    newly_lost: Vec<u64>,
}

/// What waits for a pending hold.
#[derive(Clone, Copy, Debug)]
enum Follower {
    /// A later publish's hold (a deduplicated copy, or one that joined several).
    Hold(u64),
    /// A store batch's confirms (a deduplicated copy whose publisher has no hold of its own:
    /// the management API's or SQS's, which wait for batches).
    Batch(u64),
}

impl Holds {
    /// What became of `hold` (0: no hold, applied).
    pub fn state(&self, hold: u64) -> HoldState {
        if hold == 0 {
            HoldState::Applied
        } else if self.pending.contains_key(&hold) {
            HoldState::Pending
        } else if self.lost.contains(&hold) {
            HoldState::Lost
        } else {
            HoldState::Applied
        }
    }

    /// Starts a publish's hold: the queues' proposals from here to [`Holds::close`] count in it.
    pub(crate) fn open(&mut self) {
        self.last += 1;
        self.span = Some(Span {
            id: self.last,
            counting: true,
            ..Span::default()
        });
    }

    /// Starts a hold in which every proposal counts, a consumer's command too
    /// ([`Holds::counts_every`]).
    pub(crate) fn open_every(&mut self) {
        self.open();
        if let Some(s) = self.span.as_mut() {
            s.every = true;
        }
    }

    /// The hold a command other than a publish counts in (0: none).
    pub(crate) fn every(&self) -> u64 {
        match &self.span {
            Some(s) if s.every => s.id,
            _ => 0,
        }
    }

    /// Whether the copies routed from now on count in the open hold (a publish's own do;
    /// what it makes a queue dead-letter does not).
    pub(crate) fn count(&mut self, on: bool) -> bool {
        match self.span.as_mut() {
            Some(s) => std::mem::replace(&mut s.counting, on),
            None => false,
        }
    }

    /// The hold a proposal made now counts in (0: none).
    pub(crate) fn current(&self) -> u64 {
        match &self.span {
            Some(s) if s.counting => s.id,
            _ => 0,
        }
    }

    /// The open hold, if a proposal counted in it or it joined another (0: none): what a
    /// deduplication window remembers for the publish's later copies to wait on.
    pub(crate) fn routed(&self) -> u64 {
        match &self.span {
            Some(s) if s.used || !s.joined.is_empty() => s.id,
            _ => 0,
        }
    }

    /// Whether a publish is being routed in a hold.
    pub(crate) fn is_open(&self) -> bool {
        self.span.is_some()
    }

    /// The publish being routed waits for `hold` too, unless that one is applied already (or
    /// is its own: a transaction's second copy of a key it published already).
    pub(crate) fn join(&mut self, hold: u64) {
        if self.state(hold) == HoldState::Applied {
            return;
        }
        if let Some(s) = self.span.as_mut().filter(|s| s.id != hold) {
            s.joined.push(hold);
        }
    }

    /// The confirms of store `batch` wait for `hold` (pending) to end: true if they do, and
    /// [`Holds::take_batches`] tells when.
    pub(crate) fn follow_in_batch(&mut self, hold: u64, batch: u64) -> bool {
        if self.state(hold) != HoldState::Pending {
            return false;
        }
        self.then
            .entry(hold)
            .or_default()
            .push(Follower::Batch(batch));
        true
    }

    /// Store batches whose wait on a hold ended since the last call, and whether it was lost.
    pub(crate) fn take_batches(&mut self) -> Vec<(u64, bool)> {
        std::mem::take(&mut self.batches)
    }

    /// Holds lost since the last call (deduplication windows forget the keys they remember
    /// with them: a retry of such a publish is new).
    pub(crate) fn take_newly_lost(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.newly_lost)
    }

    /// Ends the open hold, at `now`: the hold the publish (or transaction) waits for, if any
    /// (0: none). One that joined earlier holds waits for them through its own (which a
    /// deduplication window may have remembered: [`Holds::routed`]).
    pub(crate) fn close(&mut self, now: u64) -> u64 {
        let Some(s) = self.span.take() else {
            return 0;
        };
        let mut joined: Vec<u64> = s
            .joined
            .into_iter()
            .filter(|h| self.state(*h) != HoldState::Applied)
            .collect();
        joined.sort_unstable();
        joined.dedup();
        // A proposal lost before it counted (its encoding failed) still makes it wait: lost.
        let used = s.used || self.lost.contains(&s.id);
        if !used && joined.is_empty() {
            return 0;
        }
        let own = s.id;
        for h in joined {
            if self.state(h) == HoldState::Lost {
                // Lost too, even with no proposal of its own.
                self.settle(own, true);
            } else if self.state(own) != HoldState::Lost {
                self.pending
                    .entry(own)
                    .or_insert(Wait {
                        proposals: 0,
                        since: now,
                    })
                    .proposals += 1;
                self.then.entry(h).or_default().push(Follower::Hold(own));
            }
        }
        own
    }

    /// One more proposal in `hold`, made at `now`.
    pub(crate) fn wait_on(&mut self, hold: u64, now: u64) {
        if hold == 0 || self.lost.contains(&hold) {
            return;
        }
        if let Some(s) = self.span.as_mut().filter(|s| s.id == hold) {
            s.used = true;
        }
        self.pending
            .entry(hold)
            .or_insert(Wait {
                proposals: 0,
                since: now,
            })
            .proposals += 1;
    }

    /// A proposal of `hold` is applied, or `lost`; so is the wait of each hold that joined it.
    pub(crate) fn settle(&mut self, hold: u64, lost: bool) {
        let mut work = vec![(hold, lost)];
        while let Some((hold, lost)) = work.pop() {
            if hold == 0 {
                continue;
            }
            let ended = if lost {
                // Lost for good, even a proposal that never counted as waiting (one whose
                // encoding failed before it was sent).
                let was = self.pending.remove(&hold).is_some();
                if self.lost.insert(hold) {
                    self.newly_lost.push(hold);
                }
                was
            } else {
                match self.pending.get_mut(&hold) {
                    Some(w) if w.proposals > 1 => {
                        w.proposals -= 1;
                        false
                    }
                    Some(_) => {
                        self.pending.remove(&hold);
                        true
                    }
                    None => false,
                }
            };
            if ended {
                for f in self.then.remove(&hold).unwrap_or_default() {
                    match f {
                        Follower::Hold(h) => work.push((h, lost)),
                        Follower::Batch(b) => self.batches.push((b, lost)),
                    }
                }
            }
        }
    }

    /// Holds pending since `timeout` ms before `now` are lost. Returns how many.
    pub(crate) fn time_out(&mut self, now: u64, timeout: u64) -> usize {
        let mut n = 0;
        // Holds are numbered in time order, and each gets its first proposal as it is
        // opened: the oldest is first.
        while let Some((&hold, w)) = self.pending.first_key_value() {
            if now.saturating_sub(w.since) < timeout {
                break;
            }
            self.settle(hold, true);
            n += 1;
        }
        n
    }

    /// When the oldest pending hold runs out of time.
    pub(crate) fn deadline(&self, timeout: u64) -> Option<u64> {
        self.pending
            .first_key_value()
            .map(|(_, w)| w.since.saturating_add(timeout))
    }

    /// Whether some hold is kept as lost (for [`Holds::prune_lost_below`]).
    pub fn has_lost(&self) -> bool {
        !self.lost.is_empty()
    }

    /// No channel waits on a lost hold below `floor` any more (`None`: on none at all): they
    /// are forgotten.
    pub fn prune_lost_below(&mut self, floor: Option<u64>) {
        match floor {
            None => self.lost.clear(),
            Some(floor) => self.lost = self.lost.split_off(&floor),
        }
    }

    /// Pending holds (for tests and the node's figures).
    pub fn pending(&self) -> usize {
        self.pending.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn closed(h: &mut Holds) -> Vec<u64> {
        match h.close(0) {
            0 => Vec::new(),
            x => vec![x],
        }
    }

    fn one_publish(h: &mut Holds, proposals: u32) -> u64 {
        h.open();
        let id = h.current();
        for _ in 0..proposals {
            h.wait_on(id, 0);
        }
        h.close(0)
    }

    #[test]
    fn a_publish_that_joined_two_holds_waits_for_both_through_its_own() {
        let mut h = Holds::default();
        let a = one_publish(&mut h, 1);
        let b = one_publish(&mut h, 1);
        h.open();
        h.join(a);
        h.join(b);
        let own = h.close(0);
        assert!(own > b);
        h.settle(a, false);
        assert_eq!(h.state(own), HoldState::Pending);
        h.settle(b, false);
        assert_eq!(h.state(own), HoldState::Applied);
        // One of them lost: so is the publish that waited for both.
        let c = one_publish(&mut h, 1);
        let d = one_publish(&mut h, 1);
        h.open();
        let third = h.current();
        h.wait_on(third, 0);
        h.join(c);
        h.join(d);
        let own = h.close(0);
        assert_eq!(own, third);
        h.settle(d, true);
        assert_eq!(h.state(own), HoldState::Lost);
        h.settle(c, false);
        h.settle(third, false);
        assert_eq!(h.state(own), HoldState::Lost);
        assert!(h.then.is_empty(), "nothing left waiting");
    }

    #[test]
    fn a_publish_that_joins_a_lost_hold_is_lost() {
        let mut h = Holds::default();
        let a = one_publish(&mut h, 1);
        h.settle(a, true);
        h.open();
        let own_id = h.current();
        h.wait_on(own_id, 0);
        h.join(a);
        let own = h.close(0);
        assert_eq!(own, own_id);
        assert_eq!(h.state(own), HoldState::Lost);
    }

    #[test]
    fn a_hold_is_pending_until_each_of_its_proposals_is_applied() {
        let mut h = Holds::default();
        h.open();
        let id = h.current();
        h.wait_on(id, 5);
        h.wait_on(id, 5);
        assert_eq!(closed(&mut h), vec![id]);
        h.settle(id, false);
        assert_eq!(h.state(id), HoldState::Pending);
        h.settle(id, false);
        assert_eq!(h.state(id), HoldState::Applied);
        assert_eq!(h.pending(), 0);
    }

    #[test]
    fn one_lost_proposal_loses_the_hold_until_it_is_pruned() {
        let mut h = Holds::default();
        h.open();
        let id = h.current();
        h.wait_on(id, 0);
        h.wait_on(id, 0);
        closed(&mut h);
        h.settle(id, true);
        assert_eq!(h.state(id), HoldState::Lost);
        // Its other proposal applied after changes nothing.
        h.settle(id, false);
        assert_eq!(h.state(id), HoldState::Lost);
        h.prune_lost_below(Some(id));
        assert_eq!(h.state(id), HoldState::Lost);
        h.prune_lost_below(Some(id + 1));
        assert!(!h.has_lost());
    }

    #[test]
    fn a_publish_without_proposals_waits_for_nothing_but_what_it_joined() {
        let mut h = Holds::default();
        h.open();
        let first = h.current();
        h.wait_on(first, 0);
        closed(&mut h);
        h.open();
        h.join(first);
        let joined = closed(&mut h);
        assert_eq!(joined.len(), 1);
        assert_eq!(h.state(joined[0]), HoldState::Pending);
        h.settle(first, false);
        assert_eq!(h.state(joined[0]), HoldState::Applied);
        h.open();
        h.join(first);
        assert!(closed(&mut h).is_empty(), "applied: nothing to wait for");
    }

    #[test]
    fn a_publish_that_only_joined_is_remembered_by_its_own_hold() {
        let mut h = Holds::default();
        let first = one_publish(&mut h, 1);
        h.open();
        let id = h.current();
        assert_eq!(h.routed(), 0);
        h.join(first);
        // What a window remembers for it must be a hold its later duplicates can wait on.
        assert_eq!(h.routed(), id);
        assert_eq!(h.close(0), id);
        h.settle(first, true);
        assert_eq!(h.state(id), HoldState::Lost);
        assert_eq!(h.take_newly_lost(), vec![first, id]);
    }

    #[test]
    fn copies_that_do_not_count_make_no_wait() {
        let mut h = Holds::default();
        h.open();
        assert!(h.count(false));
        assert_eq!(h.current(), 0);
        assert!(!h.count(true));
        assert_ne!(h.current(), 0);
        assert!(closed(&mut h).is_empty());
        assert_eq!(h.current(), 0);
    }

    #[test]
    fn only_a_hold_opened_for_every_command_counts_what_is_not_a_publish() {
        let mut h = Holds::default();
        h.open();
        assert_eq!(h.every(), 0);
        h.close(0);
        h.open_every();
        let id = h.every();
        assert_ne!(id, 0);
        assert_eq!(h.current(), id);
        h.wait_on(id, 5);
        assert_eq!(h.close(5), id);
        assert_eq!(h.every(), 0);
        assert_eq!(h.state(id), HoldState::Pending);
        h.settle(id, false);
        assert_eq!(h.state(id), HoldState::Applied);
    }

    #[test]
    fn the_oldest_holds_time_out_first() {
        let mut h = Holds::default();
        let mut ids = Vec::new();
        for at in [10, 20, 30] {
            h.open();
            let id = h.current();
            h.wait_on(id, at);
            closed(&mut h);
            ids.push(id);
        }
        assert_eq!(h.deadline(100), Some(110));
        assert_eq!(h.time_out(125, 100), 2);
        assert_eq!(h.state(ids[0]), HoldState::Lost);
        assert_eq!(h.state(ids[1]), HoldState::Lost);
        assert_eq!(h.state(ids[2]), HoldState::Pending);
        assert_eq!(h.deadline(100), Some(130));
    }
}
