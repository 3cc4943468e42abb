//! The regular expressions of policies and permissions: Erlang `re` (PCRE) expressions in
//! RabbitMQ, so look-ahead such as `^(?!amq\\.).*` must work. fancy-regex runs a pattern
//! without look-around on the regex crate (linear time) and backtracks only for the rest; the
//! backtracking is bounded far below fancy-regex's default, because a policymaker's pattern is
//! matched against every queue and exchange of a vhost on every policy change: a match that
//! runs out of steps counts as no match.

/// Steps one match may take. The names matched are at most 255 bytes: a pattern that needs
/// more is pathological.
const BACKTRACK_LIMIT: usize = 10_000;

pub fn compile(src: &str) -> Result<fancy_regex::Regex, fancy_regex::Error> {
    fancy_regex::RegexBuilder::new(src)
        .backtrack_limit(BACKTRACK_LIMIT)
        .build()
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_pathological_pattern_ends_quickly_and_matches_nothing() {
        // Exponential backtracking through a look-ahead (fancy-regex backtracks it).
        let re = super::compile(r"^(?=(a+)+$)(a+)+b").expect("compiles");
        let name = "a".repeat(255);
        let start = std::time::Instant::now();
        assert!(!re.is_match(&name).unwrap_or(false));
        assert!(start.elapsed() < std::time::Duration::from_secs(1));
    }
}
