//! Latency histograms, the shared clock, and the broker's CPU and memory from /proc.

use std::sync::OnceLock;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use hdrhistogram::Histogram;
use serde::Serialize;

/// Nanoseconds on a clock shared by every producer and consumer of this process: an `Instant`
/// taken once, anchored to the wall clock so that a drain run in another process on the same
/// machine still reads sensible (if less precise) latencies.
pub fn now_ns() -> u64 {
    static EPOCH: OnceLock<(Instant, u64)> = OnceLock::new();
    let (base, wall) = EPOCH.get_or_init(|| {
        let wall = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        (Instant::now(), wall)
    });
    wall + base.elapsed().as_nanos() as u64
}

/// Latencies are recorded in microseconds, 1 us to 1 hour, 3 significant digits.
pub fn new_histogram() -> Histogram<u64> {
    // Constant bounds that hdrhistogram accepts (low >= 1, high >= 2 * low, 3 digits <= 5).
    Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("valid histogram bounds")
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct LatencySummary {
    pub count: u64,
    pub min_us: u64,
    pub mean_us: f64,
    pub p50_us: u64,
    pub p95_us: u64,
    pub p99_us: u64,
    pub p999_us: u64,
    pub max_us: u64,
}

impl LatencySummary {
    pub fn from_histogram(h: &Histogram<u64>) -> Option<Self> {
        if h.is_empty() {
            return None;
        }
        Some(Self {
            count: h.len(),
            min_us: h.min(),
            mean_us: (h.mean() * 10.0).round() / 10.0,
            p50_us: h.value_at_quantile(0.50),
            p95_us: h.value_at_quantile(0.95),
            p99_us: h.value_at_quantile(0.99),
            p999_us: h.value_at_quantile(0.999),
            max_us: h.max(),
        })
    }
}

/// Formats microseconds for humans: "850us", "12.3ms", "1.20s".
pub fn fmt_us(us: u64) -> String {
    if us < 1_000 {
        format!("{us}us")
    } else if us < 1_000_000 {
        format!("{:.1}ms", us as f64 / 1_000.0)
    } else {
        format!("{:.2}s", us as f64 / 1_000_000.0)
    }
}

/// A reading of one process from /proc.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ProcSample {
    /// utime + stime, in seconds.
    pub cpu_s: f64,
    pub rss_kb: u64,
    pub hwm_kb: u64,
}

fn clock_ticks() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

/// utime + stime in clock ticks from the text of /proc/<pid>/stat.
pub fn parse_stat_ticks(stat: &str) -> Option<u64> {
    // The command name (field 2) is in parentheses and may hold spaces or parentheses itself.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // rest starts at field 3 (state); utime is field 14, stime field 15.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(utime + stime)
}

/// A "Key:   123 kB" line of /proc/<pid>/status.
pub fn parse_status_kb(status: &str, key: &str) -> Option<u64> {
    status.lines().find_map(|line| {
        let rest = line.strip_prefix(key)?.strip_prefix(':')?;
        rest.split_whitespace().next()?.parse().ok()
    })
}

pub fn sample(pid: u32) -> std::io::Result<ProcSample> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let ticks = parse_stat_ticks(&stat).ok_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::InvalidData, "bad /proc/pid/stat")
    })?;
    Ok(ProcSample {
        cpu_s: ticks as f64 / clock_ticks(),
        rss_kb: parse_status_kb(&status, "VmRSS").unwrap_or(0),
        hwm_kb: parse_status_kb(&status, "VmHWM").unwrap_or(0),
    })
}

pub fn sample_self() -> ProcSample {
    sample(std::process::id()).unwrap_or_default()
}

/// Resets the process's peak RSS to its current RSS (Linux >= 4.0). Returns whether it worked.
pub fn reset_peak(pid: u32) -> bool {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").is_ok()
}

/// Broker figures over a run.
#[derive(Debug, Clone, Serialize, Default)]
pub struct BrokerReport {
    pub pid: u32,
    pub cpu_s: f64,
    /// Broker CPU time as a percentage of one core over the measured interval.
    pub cpu_pct: f64,
    /// Broker CPU microseconds per message (see `per_msg_basis`).
    pub cpu_us_per_msg: Option<f64>,
    /// Which count `cpu_us_per_msg` divides by: "consumed" (each publish + deliver + ack) when
    /// there are consumers, else "published".
    pub per_msg_basis: &'static str,
    /// Broker CPU microseconds per message published (whatever became of it): the figure to
    /// read when the producers outpace the consumers and most messages are only stored.
    pub cpu_us_per_published: Option<f64>,
    pub rss_start_kb: u64,
    pub rss_end_kb: u64,
    pub rss_delta_kb: i64,
    /// The highest of the sampled RSS and VmHWM at the end.
    pub rss_peak_kb: u64,
    /// Whether VmHWM was reset at the start (so the peak belongs to this run).
    pub peak_reset: bool,
}

impl BrokerReport {
    pub fn new(
        pid: u32,
        start: ProcSample,
        end: ProcSample,
        sampled_max_kb: u64,
        secs: f64,
        peak_reset: bool,
    ) -> Self {
        let cpu_s = (end.cpu_s - start.cpu_s).max(0.0);
        Self {
            pid,
            cpu_s: round3(cpu_s),
            cpu_pct: if secs > 0.0 {
                round1(cpu_s / secs * 100.0)
            } else {
                0.0
            },
            cpu_us_per_msg: None,
            per_msg_basis: "",
            cpu_us_per_published: None,
            rss_start_kb: start.rss_kb,
            rss_end_kb: end.rss_kb,
            rss_delta_kb: end.rss_kb as i64 - start.rss_kb as i64,
            rss_peak_kb: sampled_max_kb.max(end.rss_kb).max(if peak_reset {
                end.hwm_kb
            } else {
                0
            }),
            peak_reset,
        }
    }

    pub fn set_per_published(&mut self, published: u64) {
        if published > 0 {
            self.cpu_us_per_published = Some(round3(self.cpu_s * 1e6 / published as f64));
        }
    }

    pub fn set_per_msg(&mut self, msgs: u64, basis: &'static str) {
        if msgs > 0 {
            self.cpu_us_per_msg = Some(round3(self.cpu_s * 1e6 / msgs as f64));
            self.per_msg_basis = basis;
        }
    }
}

pub fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

pub fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_percentiles() {
        let mut h = new_histogram();
        for v in 1..=10_000u64 {
            h.record(v).unwrap();
        }
        let s = LatencySummary::from_histogram(&h).unwrap();
        assert_eq!(s.count, 10_000);
        assert_eq!(s.min_us, 1);
        // 3 significant digits: within 0.1%.
        assert!((4995..=5005).contains(&s.p50_us), "{s:?}");
        assert!((9490..=9510).contains(&s.p95_us), "{s:?}");
        assert!((9890..=9910).contains(&s.p99_us), "{s:?}");
        assert!((9995..=10_010).contains(&s.max_us), "{s:?}");
        assert!((s.mean_us - 5000.5).abs() < 5.0);
        assert!(LatencySummary::from_histogram(&new_histogram()).is_none());
        // Out-of-range values saturate instead of failing.
        h.saturating_record(u64::MAX);
        assert!(h.max() >= 3_600_000_000);
    }

    #[test]
    fn histograms_merge() {
        let mut a = new_histogram();
        let mut b = new_histogram();
        a.record(100).unwrap();
        b.record(300).unwrap();
        a.add(&b).unwrap();
        let s = LatencySummary::from_histogram(&a).unwrap();
        assert_eq!((s.count, s.min_us), (2, 100));
        assert!((299..=301).contains(&s.max_us));
    }

    #[test]
    fn proc_parsing() {
        let stat = "4078 (beam.smp) S 1 4077 4077 0 -1 4194560 99 0 0 0 1234 567 0 0 20 0 30 0";
        assert_eq!(parse_stat_ticks(stat), Some(1801));
        let odd = "42 (a) b (c)) R 1 2 3 4 5 6 7 8 9 10 11 12 0 0";
        assert_eq!(parse_stat_ticks(odd), Some(23));
        let status = "Name:\tbeam.smp\nVmHWM:\t  204800 kB\nVmRSS:\t  102400 kB\n";
        assert_eq!(parse_status_kb(status, "VmRSS"), Some(102_400));
        assert_eq!(parse_status_kb(status, "VmHWM"), Some(204_800));
        assert_eq!(parse_status_kb(status, "VmSwap"), None);
        let me = sample_self();
        assert!(me.rss_kb > 0);
    }

    #[test]
    fn clock_is_monotonic() {
        let a = now_ns();
        let b = now_ns();
        assert!(b >= a);
        assert!(a > 1_600_000_000_000_000_000, "anchored to the wall clock");
    }

    #[test]
    fn formatting() {
        assert_eq!(fmt_us(850), "850us");
        assert_eq!(fmt_us(12_345), "12.3ms");
        assert_eq!(fmt_us(1_200_000), "1.20s");
    }
}
