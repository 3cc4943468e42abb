//! The publisher-confirm latency histogram: from a publish's arrival to its confirm, for
//! every confirm the node sends (those that wait for a store write, and those sent at once).

/// Upper bounds of the buckets, in milliseconds (the node's clock has millisecond steps, so a
/// confirm sent in the same turn as its publish counts as 0 ms, in the first bucket).
pub const CONFIRM_BOUNDS_MS: [u64; 12] = [1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000];

/// Counts per bucket (not cumulative; the last counts what is over every bound), their sum and
/// their number.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ConfirmLatency {
    pub buckets: [u64; CONFIRM_BOUNDS_MS.len() + 1],
    pub sum_ms: u64,
    pub count: u64,
}

impl ConfirmLatency {
    pub fn observe(&mut self, ms: u64) {
        let i = CONFIRM_BOUNDS_MS
            .iter()
            .position(|b| ms <= *b)
            .unwrap_or(CONFIRM_BOUNDS_MS.len());
        if let Some(b) = self.buckets.get_mut(i) {
            *b += 1;
        }
        self.sum_ms = self.sum_ms.saturating_add(ms);
        self.count += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_by_upper_bound() {
        let mut h = ConfirmLatency::default();
        for ms in [0, 1, 2, 3, 5000, 5001] {
            h.observe(ms);
        }
        assert_eq!(h.buckets[0], 2, "0 and 1 ms");
        assert_eq!(h.buckets[1], 1, "2 ms");
        assert_eq!(h.buckets[2], 1, "3 ms");
        assert_eq!(h.buckets[11], 1, "5000 ms");
        assert_eq!(h.buckets[12], 1, "over every bound");
        assert_eq!((h.count, h.sum_ms), (6, 10_007));
    }
}
