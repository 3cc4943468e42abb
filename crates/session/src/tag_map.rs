//! A channel's unacked deliveries by delivery tag: an ordered map made for keys that grow.
//!
//! Delivery tags are handed out in increasing order and mostly acked in that order, so the
//! entries live in a ring buffer sorted by tag: an insert appends, an in-order ack pops the
//! front, a lookup is a binary search. An entry removed from the middle leaves a hole (its tag
//! kept, its value gone) that goes once it reaches either end, or when holes outnumber the
//! entries (then the buffer is compacted, which costs no more than the removals that made the
//! holes). Why not a `BTreeMap`: a worker's channel holds around ten deliveries, and a B-tree
//! of that size splits its root (two allocations) and merges it back (two frees) as its count
//! goes above and below eleven, which in the worker shape of docs/benchmarks.md (s9) was a
//! fifth of the broker's allocations per message. The ring buffer keeps its capacity.

use std::collections::VecDeque;

/// Holes beyond this many more than the entries make a removal compact the buffer.
const SLACK: usize = 32;

#[derive(Debug)]
pub struct TagMap<V> {
    /// Sorted by tag; `None` is a hole. Neither end is a hole.
    slots: VecDeque<(u64, Option<V>)>,
    live: usize,
}

impl<V> Default for TagMap<V> {
    fn default() -> Self {
        TagMap {
            slots: VecDeque::new(),
            live: 0,
        }
    }
}

impl<V> TagMap<V> {
    pub fn len(&self) -> usize {
        self.live
    }

    fn find(&self, tag: u64) -> Result<usize, usize> {
        // Most lookups are of the oldest delivery (an in-order ack) or the newest.
        match self.slots.front() {
            None => return Err(0),
            Some((first, _)) if *first == tag => return Ok(0),
            Some((first, _)) if *first > tag => return Err(0),
            Some(_) => {}
        }
        self.slots.binary_search_by_key(&tag, |(t, _)| *t)
    }

    /// Inserts `value` under `tag`, returning the value it replaced. Appending (a tag above
    /// every other) is the cheap case; any other tag goes to its place.
    pub fn insert(&mut self, tag: u64, value: V) -> Option<V> {
        if self.slots.back().is_none_or(|(last, _)| *last < tag) {
            self.slots.push_back((tag, Some(value)));
            self.live += 1;
            return None;
        }
        match self.find(tag) {
            Ok(i) => {
                let old = self.slots.get_mut(i).and_then(|(_, v)| v.replace(value));
                if old.is_none() {
                    self.live += 1;
                }
                old
            }
            Err(i) => {
                self.slots.insert(i, (tag, Some(value)));
                self.live += 1;
                None
            }
        }
    }

    pub fn get(&self, tag: u64) -> Option<&V> {
        let i = self.find(tag).ok()?;
        self.slots.get(i).and_then(|(_, v)| v.as_ref())
    }

    pub fn get_mut(&mut self, tag: u64) -> Option<&mut V> {
        let i = self.find(tag).ok()?;
        self.slots.get_mut(i).and_then(|(_, v)| v.as_mut())
    }

    pub fn contains_key(&self, tag: u64) -> bool {
        self.get(tag).is_some()
    }

    pub fn remove(&mut self, tag: u64) -> Option<V> {
        let i = self.find(tag).ok()?;
        let value = self.slots.get_mut(i).and_then(|(_, v)| v.take())?;
        self.live -= 1;
        self.trim();
        Some(value)
    }

    /// Removes and returns the entry with the lowest tag if that tag is at most `upto`.
    pub fn pop_first_upto(&mut self, upto: u64) -> Option<(u64, V)> {
        match self.slots.front() {
            Some((tag, _)) if *tag <= upto => {}
            _ => return None,
        }
        let (tag, value) = self.slots.pop_front()?;
        // Neither end is a hole, so the front had a value.
        let value = value?;
        self.live -= 1;
        self.trim();
        Some((tag, value))
    }

    /// The entry with the highest tag.
    pub fn last(&self) -> Option<(u64, &V)> {
        self.slots
            .back()
            .and_then(|(t, v)| v.as_ref().map(|v| (*t, v)))
    }

    /// The entries in tag order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, &V)> {
        self.slots
            .iter()
            .filter_map(|(t, v)| v.as_ref().map(|v| (*t, v)))
    }

    /// Every entry, in tag order, leaving the map empty (its buffer kept).
    pub fn drain(&mut self) -> impl Iterator<Item = (u64, V)> + '_ {
        self.live = 0;
        self.slots.drain(..).filter_map(|(t, v)| v.map(|v| (t, v)))
    }

    /// Drops the holes at either end, and every hole once they outnumber the entries by
    /// [`SLACK`].
    fn trim(&mut self) {
        while self.slots.front().is_some_and(|(_, v)| v.is_none()) {
            self.slots.pop_front();
        }
        while self.slots.back().is_some_and(|(_, v)| v.is_none()) {
            self.slots.pop_back();
        }
        if self.slots.len() > 2 * self.live + SLACK {
            self.slots.retain(|(_, v)| v.is_some());
        }
    }
}

impl<V> Extend<(u64, V)> for TagMap<V> {
    fn extend<I: IntoIterator<Item = (u64, V)>>(&mut self, entries: I) {
        for (tag, value) in entries {
            self.insert(tag, value);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    #[derive(Debug, Clone)]
    enum Op {
        /// The next tag (as a channel hands them out).
        Append,
        /// Any tag (a transaction rolled back puts its acks back).
        Insert(u64),
        Remove(u64),
        /// An ack of the oldest.
        RemoveFirst,
        PopUpto(u64),
        GetMut(u64),
        Drain,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => Just(Op::Append),
            1 => (0u64..300).prop_map(Op::Insert),
            4 => (0u64..300).prop_map(Op::Remove),
            3 => Just(Op::RemoveFirst),
            1 => (0u64..300).prop_map(Op::PopUpto),
            1 => (0u64..300).prop_map(Op::GetMut),
            1 => Just(Op::Drain),
        ]
    }

    proptest! {
        /// Whatever is done to it, the map holds what a `BTreeMap` would, in the same order,
        /// and its buffer stays within twice its entries plus the slack.
        #[test]
        fn behaves_as_an_ordered_map(ops in proptest::collection::vec(op(), 1..400)) {
            let mut map = TagMap::default();
            let mut model = BTreeMap::new();
            let mut next = 0u64;
            for (n, op) in ops.into_iter().enumerate() {
                let value = n as u64;
                match op {
                    Op::Append => {
                        next = next.max(model.keys().next_back().map_or(0, |k| k + 1));
                        prop_assert_eq!(map.insert(next, value), model.insert(next, value));
                        next += 1;
                    }
                    Op::Insert(tag) => {
                        prop_assert_eq!(map.insert(tag, value), model.insert(tag, value));
                    }
                    Op::Remove(tag) => prop_assert_eq!(map.remove(tag), model.remove(&tag)),
                    Op::RemoveFirst => {
                        let first = model.keys().next().copied();
                        if let Some(tag) = first {
                            prop_assert_eq!(map.remove(tag), model.remove(&tag));
                        }
                    }
                    Op::PopUpto(upto) => {
                        let expected = model
                            .first_key_value()
                            .filter(|(k, _)| **k <= upto)
                            .map(|(k, v)| (*k, *v));
                        if let Some((k, _)) = expected {
                            model.remove(&k);
                        }
                        prop_assert_eq!(map.pop_first_upto(upto), expected);
                    }
                    Op::GetMut(tag) => {
                        if let Some(v) = map.get_mut(tag) {
                            *v += 1000;
                        }
                        if let Some(v) = model.get_mut(&tag) {
                            *v += 1000;
                        }
                    }
                    Op::Drain => {
                        let drained: Vec<_> = map.drain().collect();
                        let expected: Vec<_> = std::mem::take(&mut model).into_iter().collect();
                        prop_assert_eq!(drained, expected);
                    }
                }
                prop_assert_eq!(map.len(), model.len());
                let seen: Vec<_> = map.iter().map(|(k, v)| (k, *v)).collect();
                let expected: Vec<_> = model.iter().map(|(k, v)| (*k, *v)).collect();
                prop_assert_eq!(seen, expected);
                prop_assert_eq!(map.last().map(|(k, v)| (k, *v)), model.last_key_value().map(|(k, v)| (*k, *v)));
                for tag in [0, 1, next.saturating_sub(1), next, 150] {
                    prop_assert_eq!(map.get(tag), model.get(&tag));
                    prop_assert_eq!(map.contains_key(tag), model.contains_key(&tag));
                }
                prop_assert!(map.slots.len() <= 2 * map.len() + SLACK + 1);
                prop_assert!(map.slots.front().is_none_or(|(_, v)| v.is_some()));
                prop_assert!(map.slots.back().is_none_or(|(_, v)| v.is_some()));
            }
        }
    }

    #[test]
    fn a_worker_acking_in_order_reuses_the_buffer() {
        let mut map = TagMap::default();
        for tag in 1..=12 {
            map.insert(tag, ());
        }
        let capacity = map.slots.capacity();
        for tag in 13..10_000u64 {
            map.insert(tag, ());
            assert_eq!(map.pop_first_upto(tag - 12), Some((tag - 12, ())));
        }
        assert_eq!(map.slots.capacity(), capacity);
        assert_eq!(map.len(), 12);
    }

    #[test]
    fn one_delivery_held_for_ever_does_not_grow_the_buffer_without_bound() {
        let mut map = TagMap::default();
        map.insert(0, ());
        let mut tag = 1;
        for _ in 0..1_000 {
            let first = tag;
            for _ in 0..100 {
                map.insert(tag, ());
                tag += 1;
            }
            // Acked in order behind the held one: each leaves a hole in the middle.
            for t in first..tag {
                assert_eq!(map.remove(t), Some(()));
                assert!(map.slots.len() <= 2 * map.len() + SLACK);
            }
        }
        assert_eq!(map.iter().map(|(t, _)| t).collect::<Vec<_>>(), [0]);
        assert_eq!(map.slots.len(), 1);
    }
}
