//! Property test: the topic trie agrees with a direct recursive matcher, for any set of
//! binding keys and routing keys over a small alphabet (empty words, `*` and `#` included).

use proptest::prelude::*;
use warren_broker::exchange::topic::{words, TopicTrie};

fn reference(pattern: &[&str], key: &[&str]) -> bool {
    match pattern.split_first() {
        None => key.is_empty(),
        Some((&"#", rest)) => (0..=key.len()).any(|i| reference(rest, &key[i..])),
        Some((&"*", rest)) => !key.is_empty() && reference(rest, &key[1..]),
        Some((w, rest)) => key.first() == Some(w) && reference(rest, &key[1..]),
    }
}

fn key(max_words: usize, wildcards: bool) -> impl Strategy<Value = String> {
    let word = if wildcards {
        prop_oneof![Just(""), Just("a"), Just("b"), Just("*"), Just("#")].boxed()
    } else {
        prop_oneof![Just(""), Just("a"), Just("b")].boxed()
    };
    prop_oneof![
        1 => Just(String::new()),
        6 => proptest::collection::vec(word, 1..=max_words).prop_map(|w| w.join(".")),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1024, ..ProptestConfig::default() })]

    #[test]
    fn trie_agrees_with_reference(
        patterns in proptest::collection::vec(key(5, true), 1..12),
        keys in proptest::collection::vec(key(6, false), 1..12),
        removed in proptest::collection::vec(any::<bool>(), 12),
    ) {
        let mut trie = TopicTrie::new();
        for (i, p) in patterns.iter().enumerate() {
            trie.insert(p, i);
        }
        // Remove some bindings again: pruning must not disturb the others.
        let mut live = vec![true; patterns.len()];
        for (i, p) in patterns.iter().enumerate() {
            if removed.get(i).copied().unwrap_or(false) {
                prop_assert!(trie.remove(p, &i));
                live[i] = false;
            }
        }
        for k in &keys {
            let kw: Vec<&str> = words(k).collect();
            let mut want: Vec<usize> = patterns
                .iter()
                .enumerate()
                .filter(|(i, p)| live[*i] && reference(&words(p).collect::<Vec<_>>(), &kw))
                .map(|(i, _)| i)
                .collect();
            want.sort_unstable();
            let mut got = Vec::new();
            trie.matches(k, &mut got);
            got.sort_unstable();
            let n = got.len();
            got.dedup();
            prop_assert_eq!(n, got.len(), "a binding matched twice for {:?}", k);
            prop_assert_eq!(got, want, "routing key {:?}", k);
        }
    }
}
