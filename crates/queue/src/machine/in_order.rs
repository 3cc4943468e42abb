//! The expiries of a line that come in id order (a queue TTL's: each message expires after the
//! one before it), as `(expires_at, msg_id)` pairs sorted by both.
//!
//! A deep quorum queue writes its packed runs out of memory ([`super::QueueMachine::spill_line`]),
//! but a queue TTL kept a pair per message here: 16 bytes a message, the largest share of a deep
//! TTL queue's memory once its runs had left. The pairs of a run written out are folded into one
//! [`Fold`] that keeps the first and last pair: the run's record holds every message's expiry,
//! so the pairs come back from it when the run is read back. Folding is node-local, as spilling
//! is: everything the machine computes from these pairs (which message expires when, digests,
//! snapshots) sees the same sequence whether or not a node folded it.

use std::collections::VecDeque;

/// The pairs of a spilled run, folded: the first and last (what `front` and `back` need), how
/// many, and the first id of the run that holds them.
#[derive(Clone, Debug)]
struct Fold {
    first: (u64, u64),
    last: (u64, u64),
    n: usize,
    run: u64,
}

/// The in-order pairs: those in memory, and the folds of spilled runs, two id-ordered
/// sequences whose id ranges do not overlap (pairs are appended only past the last one, folded
/// or not, and a fold takes every pair of its run's id range).
#[derive(Clone, Debug, Default)]
pub(super) struct InOrder {
    pairs: VecDeque<(u64, u64)>,
    folds: VecDeque<Fold>,
    /// Pairs the folds stand for.
    folded: usize,
}

impl InOrder {
    /// How many pairs, folded ones included.
    pub(super) fn len(&self) -> usize {
        self.pairs.len() + self.folded
    }

    /// The first pair, folded or not.
    pub(super) fn front(&self) -> Option<(u64, u64)> {
        match (self.pairs.front(), self.folds.front()) {
            (Some(p), Some(f)) if f.first.1 < p.1 => Some(f.first),
            (Some(p), _) => Some(*p),
            (None, f) => f.map(|f| f.first),
        }
    }

    /// The first id of the run whose folded pairs come first, if they do.
    pub(super) fn front_fold(&self) -> Option<u64> {
        let f = self.folds.front()?;
        match self.pairs.front() {
            Some(p) if p.1 < f.first.1 => None,
            _ => Some(f.run),
        }
    }

    /// The last pair, folded or not.
    pub(super) fn back(&self) -> Option<(u64, u64)> {
        match (self.pairs.back(), self.folds.back()) {
            (Some(p), Some(f)) if f.last.1 > p.1 => Some(f.last),
            (Some(p), _) => Some(*p),
            (None, f) => f.map(|f| f.last),
        }
    }

    /// Appends a pair past the last one (the caller checked it sorts after it).
    pub(super) fn push_back(&mut self, pair: (u64, u64)) {
        self.pairs.push_back(pair);
    }

    /// Takes the first pair if it is in memory; `None` (and no change) if it is folded: its
    /// run is to be read back first ([`Self::unfold`]).
    pub(super) fn pop_front(&mut self) -> Option<(u64, u64)> {
        if self.front_fold().is_some() {
            return None;
        }
        self.pairs.pop_front()
    }

    /// Takes the last pair if it is in memory and its id is at least `first`.
    pub(super) fn pop_back_from(&mut self, first: u64) -> Option<(u64, u64)> {
        let back = *self.pairs.back()?;
        if back.1 < first || self.folds.back().is_some_and(|f| f.last.1 > back.1) {
            return None;
        }
        self.pairs.pop_back()
    }

    pub(super) fn clear(&mut self) {
        self.pairs.clear();
        self.folds.clear();
        self.folded = 0;
    }

    /// Gives back room a drained deque no longer needs (see `shrink_drained`).
    pub(super) fn shrink(&mut self, above: usize) {
        if self.pairs.capacity() > above && self.pairs.capacity() / 4 > self.pairs.len() {
            self.pairs.shrink_to(self.pairs.len() * 2);
        }
    }

    /// Folds the pairs whose ids are in `run..=last` (a spilled run's), if there are exactly
    /// `n` of them, at least two: the run holds `n` messages with an expiry, and each must be
    /// here for the run's record to stand for them (one whose expiry went to the ordered index,
    /// because it came out of order, keeps the run unfolded). Whether it folded.
    pub(super) fn fold(&mut self, run: u64, last: u64, n: usize) -> bool {
        if n < 2 {
            return false;
        }
        let lo = self.pairs.partition_point(|p| p.1 < run);
        let hi = self.pairs.partition_point(|p| p.1 <= last);
        if hi - lo != n {
            return false;
        }
        let (Some(&first), Some(&end)) = (self.pairs.get(lo), self.pairs.get(hi - 1)) else {
            return false;
        };
        // A drain moves the shorter side: what is left in memory before a run being spilled
        // is the window and the runs kept, whether one run is folded or a restored line's
        // hundreds are, front to back.
        self.pairs.drain(lo..hi);
        let at = self.folds.partition_point(|f| f.run < run);
        self.folds.insert(
            at,
            Fold {
                first,
                last: end,
                n,
                run,
            },
        );
        self.folded += n;
        true
    }

    fn fold_at(&self, run: u64) -> Option<usize> {
        self.folds.binary_search_by_key(&run, |f| f.run).ok()
    }

    /// Puts back the folded pairs of run `run`, read from its record (`pairs`, in order).
    /// Returns false if they do not match what was folded (the caller's record is not the
    /// one folded); the pairs are put back either way.
    pub(super) fn unfold(&mut self, run: u64, pairs: impl IntoIterator<Item = (u64, u64)>) -> bool {
        let Some(i) = self.fold_at(run) else {
            return true;
        };
        let Some(fold) = self.folds.remove(i) else {
            return true;
        };
        self.folded = self.folded.saturating_sub(fold.n);
        let back: Vec<(u64, u64)> = pairs.into_iter().collect();
        let matches = back.len() == fold.n
            && back.first() == Some(&fold.first)
            && back.last() == Some(&fold.last);
        let at = self.pairs.partition_point(|p| p.1 < fold.first.1);
        if at <= self.pairs.len() - at {
            // Near the front (a run read back as the head reaches it): what is before it
            // moves, not the rest of the deque.
            let before: Vec<(u64, u64)> = self.pairs.drain(..at).collect();
            for p in back.into_iter().rev().chain(before.into_iter().rev()) {
                self.pairs.push_front(p);
            }
        } else {
            let mut after = self.pairs.split_off(at);
            self.pairs.extend(back);
            self.pairs.append(&mut after);
        }
        matches
    }

    /// Every pair in order, a fold's through `read` (its run's pairs, read back).
    pub(super) fn iter_with<'a, R>(&'a self, read: R) -> impl Iterator<Item = (u64, u64)> + 'a
    where
        R: Fn(u64) -> Vec<(u64, u64)> + 'a,
    {
        let mut pairs = self.pairs.iter().copied().peekable();
        let mut folds = self.folds.iter().peekable();
        let mut unfolded: std::vec::IntoIter<(u64, u64)> = Vec::new().into_iter();
        std::iter::from_fn(move || loop {
            if let Some(p) = unfolded.next() {
                return Some(p);
            }
            let fold_first = match (pairs.peek(), folds.peek()) {
                (Some(p), Some(f)) => f.first.1 < p.1,
                (Some(_), None) => false,
                (None, Some(_)) => true,
                (None, None) => return None,
            };
            if !fold_first {
                return pairs.next();
            }
            let f = folds.next()?;
            unfolded = read(f.run).into_iter();
        })
    }

    /// What it holds in memory: pairs and folds.
    #[cfg(test)]
    pub(super) fn in_memory(&self) -> usize {
        self.pairs.len() + self.folds.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(pairs: &[(u64, u64)]) -> InOrder {
        let mut l = InOrder::default();
        for p in pairs {
            l.push_back(*p);
        }
        l
    }

    fn run_pairs(first: u64, last: u64) -> Vec<(u64, u64)> {
        (first..=last).map(|id| (1000 + id, id)).collect()
    }

    #[test]
    fn a_fold_keeps_the_sequence_and_gives_it_back() {
        let all = run_pairs(1, 20);
        let mut l = line(&all);
        assert!(l.fold(5, 9, 5));
        assert!(l.fold(10, 14, 5));
        assert_eq!(l.len(), 20);
        assert_eq!(l.pairs.len(), 10);
        let seen: Vec<_> = l.iter_with(|run| run_pairs(run, run + 4)).collect();
        assert_eq!(seen, all);
        assert_eq!(l.back(), Some((1020, 20)));
        // The head pops as pairs until a fold comes first.
        for id in 1..=4 {
            assert_eq!(l.front_fold(), None);
            assert_eq!(l.pop_front(), Some((1000 + id, id)));
        }
        assert_eq!(l.front(), Some((1005, 5)));
        assert_eq!(l.front_fold(), Some(5));
        assert_eq!(l.pop_front(), None, "a folded pair waits for its run");
        assert!(l.unfold(5, run_pairs(5, 9)));
        assert_eq!(l.pop_front(), Some((1005, 5)));
        assert_eq!(l.len(), 15);
        let seen: Vec<_> = l.iter_with(|run| run_pairs(run, run + 4)).collect();
        assert_eq!(seen, run_pairs(6, 20));
    }

    #[test]
    fn folds_in_any_order_merge_with_the_pairs_between_them() {
        let all = run_pairs(1, 30);
        let mut l = line(&all);
        assert!(l.fold(21, 25, 5));
        assert!(l.fold(6, 10, 5));
        assert!(l.fold(11, 15, 5));
        // Pairs 16 to 20 sit between two folds, 26 to 30 after the last.
        let read = |run: u64| run_pairs(run, run + 4);
        assert_eq!(l.iter_with(read).collect::<Vec<_>>(), all);
        assert_eq!(l.back(), Some((1030, 30)));
        for id in (26..=30).rev() {
            assert_eq!(l.pop_back_from(26), Some((1000 + id, id)));
        }
        assert_eq!(l.pop_back_from(16), None, "the back is folded");
        assert_eq!(l.back(), Some((1025, 25)), "a fold's last pair");
        assert!(l.unfold(11, read(11)));
        assert!(l.unfold(21, read(21)));
        assert_eq!(l.iter_with(read).collect::<Vec<_>>(), run_pairs(1, 25));
        for id in 1..=5 {
            assert_eq!(l.pop_front(), Some((1000 + id, id)));
        }
        assert_eq!(l.front_fold(), Some(6));
        assert!(l.unfold(6, read(6)));
        assert_eq!(l.len(), 20);
        assert_eq!(l.iter_with(read).collect::<Vec<_>>(), run_pairs(6, 25));
    }

    #[test]
    fn a_run_missing_a_pair_does_not_fold() {
        let mut all = run_pairs(1, 10);
        all.remove(6); // id 7's expiry went to the ordered index
        let mut l = line(&all);
        assert!(!l.fold(5, 9, 5), "four of its five are here");
        assert!(!l.fold(1, 1, 1), "one pair is not worth a fold");
        assert_eq!(l.len(), 9);
        assert!(l.fold(1, 4, 4));
        assert!(!l.fold(1, 4, 4), "folded already");
    }

    #[test]
    fn the_back_is_a_folds_last_pair_when_nothing_follows_it() {
        let mut l = line(&run_pairs(1, 8));
        assert!(l.fold(5, 8, 4));
        assert_eq!(l.back(), Some((1008, 8)));
        assert_eq!(l.pop_back_from(1), None, "the back is folded");
        l.push_back((1009, 9));
        assert_eq!(l.pop_back_from(9), Some((1009, 9)));
        assert!(
            !l.unfold(5, run_pairs(5, 7)),
            "a record that does not match says so"
        );
        assert_eq!(l.len(), 7);
    }
}
