//! Topic routing: a trie over binding-key words, as RabbitMQ's topic exchange.
//!
//! Keys split on `.` exactly like `rabbit_exchange_type_topic:split_topic_key/1`: the empty
//! key has no words, and every `.` separates two (possibly empty) words, so `"a."` is
//! `["a", ""]`. In a binding key `*` matches exactly one word and `#` zero or more.
//!
//! Nodes live in one arena `Vec` (indices, not pointers) and freed nodes are reused, so the
//! trie stays compact and a match walks contiguous memory.

use std::collections::HashMap;

use crate::small::Small;

/// The position after the last word of a key.
const END: usize = usize::MAX - 1;

/// The word at byte offset `pos` (not `END`) and the position after it.
fn next_word(key: &str, pos: usize) -> (&str, usize) {
    let rest = key.get(pos..).unwrap_or("");
    match rest.find('.') {
        Some(dot) => (rest.get(..dot).unwrap_or(""), pos + dot + 1),
        None => (rest, END),
    }
}

/// Splits a topic key into words (`""` has none).
pub fn words(key: &str) -> impl Iterator<Item = &str> {
    let mut it = key.split('.');
    if key.is_empty() {
        it.next();
    }
    it
}

#[derive(Clone, Debug, Default)]
struct Node<D> {
    children: HashMap<Box<str>, u32>,
    star: Option<u32>,
    hash: Option<u32>,
    /// Destinations bound with exactly this key (a destination appears once per binding).
    dests: Vec<D>,
}

impl<D> Node<D> {
    fn is_empty(&self) -> bool {
        self.children.is_empty()
            && self.star.is_none()
            && self.hash.is_none()
            && self.dests.is_empty()
    }
}

/// A topic trie mapping binding keys to destinations `D`.
#[derive(Clone, Debug)]
pub struct TopicTrie<D> {
    nodes: Vec<Node<D>>,
    free: Vec<u32>,
}

impl<D> Default for TopicTrie<D> {
    fn default() -> Self {
        TopicTrie {
            nodes: vec![Node {
                children: HashMap::new(),
                star: None,
                hash: None,
                dests: Vec::new(),
            }],
            free: Vec::new(),
        }
    }
}

enum Edge<'a> {
    Word(&'a str),
    Star,
    Hash,
}

fn edge(word: &str) -> Edge<'_> {
    match word {
        "*" => Edge::Star,
        "#" => Edge::Hash,
        w => Edge::Word(w),
    }
}

impl<D: Clone + PartialEq> TopicTrie<D> {
    pub fn new() -> Self {
        Self::default()
    }

    fn node(&self, i: u32) -> Option<&Node<D>> {
        self.nodes.get(i as usize)
    }

    fn child(&self, at: u32, e: &Edge<'_>) -> Option<u32> {
        let n = self.node(at)?;
        match e {
            Edge::Word(w) => n.children.get(*w).copied(),
            Edge::Star => n.star,
            Edge::Hash => n.hash,
        }
    }

    fn alloc(&mut self) -> u32 {
        let fresh = Node {
            children: HashMap::new(),
            star: None,
            hash: None,
            dests: Vec::new(),
        };
        if let Some(i) = self.free.pop() {
            if let Some(slot) = self.nodes.get_mut(i as usize) {
                *slot = fresh;
                return i;
            }
        }
        self.nodes.push(fresh);
        (self.nodes.len() - 1) as u32
    }

    /// Adds one binding of `key` to `dest`.
    pub fn insert(&mut self, key: &str, dest: D) {
        let mut at = 0u32;
        for w in words(key) {
            let e = edge(w);
            at = match self.child(at, &e) {
                Some(c) => c,
                None => {
                    let c = self.alloc();
                    if let Some(n) = self.nodes.get_mut(at as usize) {
                        match e {
                            Edge::Word(w) => {
                                n.children.insert(w.into(), c);
                            }
                            Edge::Star => n.star = Some(c),
                            Edge::Hash => n.hash = Some(c),
                        }
                    }
                    c
                }
            };
        }
        if let Some(n) = self.nodes.get_mut(at as usize) {
            n.dests.push(dest);
        }
    }

    /// Removes one binding of `key` to `dest`; prunes nodes left empty. False if absent.
    pub fn remove(&mut self, key: &str, dest: &D) -> bool {
        let mut path: Vec<(u32, &str)> = Vec::new();
        let mut at = 0u32;
        for w in words(key) {
            match self.child(at, &edge(w)) {
                Some(c) => {
                    path.push((at, w));
                    at = c;
                }
                None => return false,
            }
        }
        let Some(n) = self.nodes.get_mut(at as usize) else {
            return false;
        };
        let Some(pos) = n.dests.iter().position(|d| d == dest) else {
            return false;
        };
        n.dests.swap_remove(pos);
        // Prune empty nodes bottom-up (never the root).
        let mut child = at;
        while let Some((parent, w)) = path.pop() {
            if !self.node(child).is_some_and(Node::is_empty) {
                break;
            }
            if let Some(p) = self.nodes.get_mut(parent as usize) {
                match edge(w) {
                    Edge::Word(w) => {
                        p.children.remove(w);
                    }
                    Edge::Star => p.star = None,
                    Edge::Hash => p.hash = None,
                }
            }
            self.free.push(child);
            child = parent;
        }
        true
    }

    /// Appends every destination whose binding key matches `routing_key` to `out`
    /// (a destination bound twice may appear twice).
    ///
    /// A depth-first walk over (node, position in the key); positions are byte offsets, so
    /// the key is never split into a vector. `#` expands to every later position once per
    /// `#` node: each one remembers the smallest position it was expanded from, which keeps
    /// patterns like `#.#.#` linear instead of exponential. No allocation unless the walk is
    /// unusually deep or wide.
    pub fn matches(&self, routing_key: &str, out: &mut Vec<D>) {
        let start = if routing_key.is_empty() { END } else { 0 };
        let mut stack: Small<(u32, usize), 16> = Small::new();
        let mut hash_from: Small<(u32, usize), 8> = Small::new();
        stack.push((0, start));
        while let Some((at, pos)) = stack.pop() {
            let Some(node) = self.node(at) else { continue };
            if let Some(h) = node.hash {
                // `#` takes zero or more words: positions pos, next(pos), ... up to where
                // this `#` node was already expanded from.
                let until = match hash_from.find_mut(|(n, _)| *n == h) {
                    Some(entry) => {
                        let until = entry.1;
                        entry.1 = entry.1.min(pos);
                        until
                    }
                    None => {
                        hash_from.push((h, pos));
                        usize::MAX
                    }
                };
                let mut p = pos;
                while p < until {
                    stack.push((h, p));
                    if p == END {
                        break;
                    }
                    p = next_word(routing_key, p).1;
                }
            }
            if pos == END {
                out.extend(node.dests.iter().cloned());
                continue;
            }
            let (word, next) = next_word(routing_key, pos);
            if let Some(&c) = node.children.get(word) {
                stack.push((c, next));
            }
            if let Some(c) = node.star {
                stack.push((c, next));
            }
        }
    }

    /// Number of live nodes (tests: pruning).
    pub fn node_count(&self) -> usize {
        self.nodes.len() - self.free.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(bindings: &[&str], key: &str) -> Vec<usize> {
        let mut t = TopicTrie::new();
        for (i, b) in bindings.iter().enumerate() {
            t.insert(b, i);
        }
        let mut out = Vec::new();
        t.matches(key, &mut out);
        out.sort_unstable();
        out.dedup();
        out
    }

    fn hit(binding: &str, key: &str) -> bool {
        !route(&[binding], key).is_empty()
    }

    #[test]
    fn word_splitting() {
        assert_eq!(words("").count(), 0);
        assert_eq!(words("a").collect::<Vec<_>>(), vec!["a"]);
        assert_eq!(words("a.").collect::<Vec<_>>(), vec!["a", ""]);
        assert_eq!(words(".").collect::<Vec<_>>(), vec!["", ""]);
        assert_eq!(words("a..b").collect::<Vec<_>>(), vec!["a", "", "b"]);
    }

    #[test]
    fn hash_matches_everything() {
        for key in ["", "a", "a.b", "a.b.c", ".", "..", "a..b"] {
            assert!(hit("#", key), "{key}");
        }
    }

    #[test]
    fn exact_and_star() {
        assert!(hit("a.b", "a.b"));
        assert!(!hit("a.b", "a.b.c"));
        assert!(!hit("a.b", "a"));
        assert!(hit("", ""));
        assert!(!hit("", "a"));
        assert!(hit("*", "a"));
        // "" has no words, so `*` (exactly one word) does not match it.
        assert!(!hit("*", ""));
    }

    #[test]
    fn star_star() {
        assert!(hit("*.*", "a.b"));
        assert!(hit("*.*", "."));
        assert!(hit("*.*", "a."));
        assert!(!hit("*.*", "a"));
        assert!(!hit("*.*", "a.b.c"));
        assert!(!hit("*.*", ""));
    }

    #[test]
    fn hash_in_the_middle() {
        assert!(hit("a.#.b", "a.b"));
        assert!(hit("a.#.b", "a.x.b"));
        assert!(hit("a.#.b", "a.x.y.b"));
        assert!(!hit("a.#.b", "a.x.y"));
        assert!(!hit("a.#.b", "b.a.b"));
        assert!(hit("a.#", "a"));
        assert!(hit("a.#", "a.b.c"));
        assert!(!hit("a.#", "b"));
        assert!(hit("#.b", "b"));
        assert!(hit("#.b", "a.b"));
        assert!(!hit("#.b", "b.a"));
        assert!(hit("#.#", ""));
        assert!(hit("#.*", "a"));
        assert!(!hit("#.*", ""));
        assert!(hit("*.#.*", "a.b"));
        assert!(!hit("*.#.*", "a"));
    }

    #[test]
    fn empty_words() {
        assert!(hit("a..b", "a..b"));
        assert!(hit("a.*.b", "a..b"));
        assert!(!hit("a.b", "a..b"));
        assert!(hit("a.", "a."));
        assert!(!hit("a.", "a"));
    }

    #[test]
    fn many_bindings_and_dedup() {
        let got = route(&["a.*", "a.#", "#", "b.*", "a.b", "*.b"], "a.b");
        assert_eq!(got, vec![0, 1, 2, 4, 5]);
        // Pathological: many hashes stay polynomial and find the match once per binding.
        let got = route(
            &["#.#.#.#.#.#.#.#.a"],
            "x.x.x.x.x.x.x.x.x.x.x.x.x.x.x.x.x.x.a",
        );
        assert_eq!(got, vec![0]);
    }

    /// Which of these binding keys match which routing keys, as RabbitMQ 3.10.8 routed them
    /// (measured: one queue per binding key on a topic exchange, one publish per key).
    #[test]
    fn same_matches_as_rabbitmq() {
        const PATTERNS: [&str; 21] = [
            "#", "*", "", "a", "a.*", "a.#", "#.a", "*.a", "a.#.b", "*.*", "#.*", "*.#", "#.#",
            "a..b", "a.*.b", ".", "a.", ".a", "#.a.#", "*.#.*", "#.b.#.a",
        ];
        const RABBITMQ: [(&str, &[&str]); 17] = [
            ("", &["#", "", "#.#"]),
            (
                "a",
                &["#", "*", "a", "a.#", "#.a", "#.*", "*.#", "#.#", "#.a.#"],
            ),
            ("b", &["#", "*", "#.*", "*.#", "#.#"]),
            (
                "a.b",
                &[
                    "#", "a.*", "a.#", "a.#.b", "*.*", "#.*", "*.#", "#.#", "#.a.#", "*.#.*",
                ],
            ),
            (
                "a.a",
                &[
                    "#", "a.*", "a.#", "#.a", "*.a", "*.*", "#.*", "*.#", "#.#", "#.a.#", "*.#.*",
                ],
            ),
            (
                "a..b",
                &[
                    "#", "a.#", "a.#.b", "#.*", "*.#", "#.#", "a..b", "a.*.b", "#.a.#", "*.#.*",
                ],
            ),
            (
                "a.x.b",
                &[
                    "#", "a.#", "a.#.b", "#.*", "*.#", "#.#", "a.*.b", "#.a.#", "*.#.*",
                ],
            ),
            (
                "a.x.y.b",
                &["#", "a.#", "a.#.b", "#.*", "*.#", "#.#", "#.a.#", "*.#.*"],
            ),
            (".", &["#", "*.*", "#.*", "*.#", "#.#", ".", "*.#.*"]),
            ("..", &["#", "#.*", "*.#", "#.#", "*.#.*"]),
            (
                "a.",
                &[
                    "#", "a.*", "a.#", "*.*", "#.*", "*.#", "#.#", "a.", "#.a.#", "*.#.*",
                ],
            ),
            (
                ".a",
                &[
                    "#", "#.a", "*.a", "*.*", "#.*", "*.#", "#.#", ".a", "#.a.#", "*.#.*",
                ],
            ),
            (
                "a.b.c",
                &["#", "a.#", "#.*", "*.#", "#.#", "#.a.#", "*.#.*"],
            ),
            (
                "b.a",
                &[
                    "#", "#.a", "*.a", "*.*", "#.*", "*.#", "#.#", "#.a.#", "*.#.*", "#.b.#.a",
                ],
            ),
            (
                "a.a.a",
                &["#", "a.#", "#.a", "#.*", "*.#", "#.#", "#.a.#", "*.#.*"],
            ),
            (
                "x.b.y.a",
                &["#", "#.a", "#.*", "*.#", "#.#", "#.a.#", "*.#.*", "#.b.#.a"],
            ),
            (
                "b.a.a",
                &["#", "#.a", "#.*", "*.#", "#.#", "#.a.#", "*.#.*", "#.b.#.a"],
            ),
        ];
        let mut t = TopicTrie::new();
        for (i, p) in PATTERNS.iter().enumerate() {
            t.insert(p, i);
        }
        for (key, want) in RABBITMQ {
            let mut got = Vec::new();
            t.matches(key, &mut got);
            got.sort_unstable();
            got.dedup();
            let got: Vec<&str> = got
                .into_iter()
                .filter_map(|i| PATTERNS.get(i).copied())
                .collect();
            let mut want: Vec<&str> = want.to_vec();
            want.sort_by_key(|p| PATTERNS.iter().position(|q| q == p));
            assert_eq!(got, want, "routing key {key:?}");
        }
    }

    #[test]
    fn remove_prunes() {
        let mut t = TopicTrie::new();
        t.insert("a.b.c", 1);
        t.insert("a.#", 2);
        t.insert("a.b.c", 3);
        assert_eq!(t.node_count(), 5);
        assert!(t.remove("a.b.c", &1));
        assert!(!t.remove("a.b.c", &1));
        assert!(!t.remove("x", &1));
        assert_eq!(t.node_count(), 5);
        assert!(t.remove("a.b.c", &3));
        assert_eq!(t.node_count(), 3);
        let mut out = Vec::new();
        t.matches("a.b.c", &mut out);
        assert_eq!(out, vec![2]);
        assert!(t.remove("a.#", &2));
        assert_eq!(t.node_count(), 1);
        // Reuses freed nodes.
        t.insert("q.r", 9);
        assert_eq!(t.nodes.len(), 5);
    }
}
