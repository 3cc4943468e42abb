//! A rate limiter that works in time slices: the producer wakes once per slice and sends every
//! message that has come due since the start, so the long-run rate is exact however late the
//! timer fires, and no task sleeps once per message.

use std::time::Duration;

#[derive(Debug, Clone)]
pub struct RateLimiter {
    /// Messages per second.
    rate: f64,
    /// Messages sent (or given up) so far.
    sent: u64,
    /// At most this many messages may be owed at once; beyond that the debt is forgiven (and
    /// counted in `skipped`) so that a stalled broker is not hit by a huge burst afterwards.
    max_debt: u64,
    /// Messages the producer could not send in time and that were forgiven.
    pub skipped: u64,
}

impl RateLimiter {
    /// `max_debt_time`: how much lateness is caught up with a burst (e.g. 100 ms).
    pub fn new(rate: f64, max_debt_time: Duration) -> Self {
        assert!(rate > 0.0);
        let max_debt = ((rate * max_debt_time.as_secs_f64()).ceil() as u64).max(1);
        Self {
            rate,
            sent: 0,
            max_debt,
            skipped: 0,
        }
    }

    /// How many messages are due at `elapsed` since the start (not yet recorded as sent).
    pub fn due(&mut self, elapsed: Duration) -> u64 {
        let target = (self.rate * elapsed.as_secs_f64()).floor() as u64;
        let mut due = target.saturating_sub(self.sent);
        if due > self.max_debt {
            let forgiven = due - self.max_debt;
            self.skipped += forgiven;
            self.sent += forgiven;
            due = self.max_debt;
        }
        due
    }

    /// Records that `n` messages were sent.
    pub fn sent(&mut self, n: u64) {
        self.sent += n;
    }

    /// Elapsed time (since the start) at which the next message comes due.
    pub fn next_due(&self) -> Duration {
        Duration::from_secs_f64((self.sent + 1) as f64 / self.rate)
    }

    /// When to wake next: when the next message is due, but not sooner than one slice after
    /// `now` (so that a fast rate is served in batches, one wake-up per slice).
    pub fn next_wake(&self, now: Duration, slice: Duration) -> Duration {
        self.next_due().max(now + slice)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Simulates a producer driven by a jittery timer for `secs` seconds and returns how many
    /// messages it sent and how many wake-ups it needed.
    fn simulate(
        rate: f64,
        secs: f64,
        slice: Duration,
        jitter: impl Fn(u64) -> Duration,
    ) -> (u64, u64) {
        let mut rl = RateLimiter::new(rate, Duration::from_millis(100));
        let end = Duration::from_secs_f64(secs);
        let mut now = Duration::ZERO;
        let (mut total, mut wakes) = (0, 0);
        let mut last_wake = now;
        while now <= end {
            let n = rl.due(now);
            rl.sent(n);
            total += n;
            wakes += 1;
            last_wake = now;
            now = rl.next_wake(now, slice) + jitter(wakes);
        }
        // Whatever the timer's lateness, everything due at the last wake-up was sent.
        assert_eq!(total, (rate * last_wake.as_secs_f64()).floor() as u64);
        assert_eq!(rl.skipped, 0);
        (total, wakes)
    }

    #[test]
    fn exact_at_10k_with_late_timers() {
        // Timers that fire up to 0.9 ms late (tokio's are millisecond-grained).
        let (sent, wakes) = simulate(10_000.0, 10.0, Duration::from_millis(1), |i| {
            Duration::from_micros((i * 7919) % 900)
        });
        // The last wake-up is at most one slice plus the jitter before the end.
        assert!((99_980..=100_000).contains(&sent), "sent {sent}");
        // Batched: about one wake-up per slice, far fewer than messages.
        assert!(wakes <= 10_001, "wakes {wakes}");
    }

    #[test]
    fn slow_rate_sleeps_until_due() {
        let (sent, wakes) = simulate(10.0, 5.0, Duration::from_millis(1), |_| Duration::ZERO);
        assert_eq!(sent, 50);
        assert!(wakes <= 52, "wakes {wakes}");
    }

    #[test]
    fn stall_is_forgiven_beyond_max_debt() {
        let mut rl = RateLimiter::new(1000.0, Duration::from_millis(100));
        assert_eq!(rl.due(Duration::from_millis(10)), 10);
        rl.sent(10);
        // A 5 s stall: only 100 ms worth is caught up.
        assert_eq!(rl.due(Duration::from_millis(5010)), 100);
        assert_eq!(rl.skipped, 4900);
        rl.sent(100);
        assert_eq!(rl.due(Duration::from_millis(5011)), 1);
    }

    #[test]
    fn next_wake_respects_slice() {
        let rl = RateLimiter::new(100_000.0, Duration::from_millis(100));
        let now = Duration::from_millis(3);
        assert_eq!(
            rl.next_wake(now, Duration::from_millis(1)),
            Duration::from_millis(4)
        );
        let rl = RateLimiter::new(2.0, Duration::from_millis(100));
        assert_eq!(
            rl.next_wake(now, Duration::from_millis(1)),
            Duration::from_millis(500)
        );
    }
}
