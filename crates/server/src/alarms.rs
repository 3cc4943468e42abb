//! Resource alarms, as RabbitMQ raises them: the broker's memory above its high watermark, or
//! too little free disk where the data lives. While one is on, publishers are blocked (see
//! `Node::set_alarms`); consumers keep draining queues, which is what ends a memory alarm.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use crate::config::AlarmConfig;

/// How often memory and disk are measured (RabbitMQ: memory every 2.5 s, disk every 1-10 s).
const CHECK_EVERY: Duration = Duration::from_secs(1);
/// Free heap memory is looked at every this many checks (10 s).
const TRIM_EVERY: u64 = 10;

/// The broker's resident memory, from /proc (Linux); `None` elsewhere.
pub fn rss_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf only reads a configuration value.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    Some(pages.saturating_mul(u64::try_from(page).ok()?))
}

/// The machine's RAM, from /proc/meminfo.
pub fn total_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib.saturating_mul(1024))
}

/// Free bytes available to the broker on the filesystem holding `dir`.
pub fn free_disk(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: statvfs writes into the zeroed struct we own; the path is NUL-terminated.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(path.as_ptr(), &mut st) } != 0 {
        return None;
    }
    // The field types differ between targets (32-bit on some): widen whatever they are.
    #[allow(clippy::useless_conversion)]
    let (blocks, size) = (u64::from(st.f_bavail), u64::from(st.f_frsize));
    Some(blocks.saturating_mul(size))
}

/// The memory limit in bytes, if it can be known.
pub fn memory_limit(config: &AlarmConfig) -> Option<u64> {
    config.memory_limit.or_else(|| {
        total_memory().map(|total| (total as f64 * config.memory_high_watermark) as u64)
    })
}

/// What the monitor found: alarms, and whether queues should page transient messages out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pressure {
    pub memory: bool,
    pub disk: bool,
    /// Memory above the paging ratio of the limit.
    pub paging: bool,
}

/// Measures memory and disk every second and tells the node.
pub async fn monitor(
    config: AlarmConfig,
    data_dir: std::path::PathBuf,
    set: Arc<dyn Fn(Pressure) + Send + Sync>,
) {
    let limit = memory_limit(&config);
    let paging_at = limit.map(|l| (l as f64 * config.paging_ratio) as u64);
    tracing::info!(
        memory_limit = limit,
        paging_at,
        disk_free_limit = config.disk_free_limit,
        "resource alarms armed"
    );
    let mut trimmer = crate::allocations::Trimmer::default();
    let mut checks: u64 = 0;
    loop {
        // Before measuring, now and then (reading the allocator's figures walks its free
        // lists under their locks): memory freed in bulk since the last look is handed
        // back, so that neither RSS nor the alarm counts what the node no longer holds.
        if checks.is_multiple_of(TRIM_EVERY) {
            let (t, free) = tokio::task::spawn_blocking(move || {
                let free = trimmer.check();
                (trimmer, free)
            })
            .await
            .unwrap_or_default();
            trimmer = t;
            if let Some(free) = free {
                tracing::debug!(free, "free heap memory handed back to the system");
            }
        }
        checks = checks.wrapping_add(1);
        let rss = rss_bytes();
        let memory = matches!((rss, limit), (Some(rss), Some(limit)) if rss > limit);
        let paging = matches!((rss, paging_at), (Some(rss), Some(at)) if rss >= at);
        let disk = config.disk_free_limit > 0
            && free_disk(&data_dir).is_some_and(|free| free < config.disk_free_limit);
        set(Pressure {
            memory,
            disk,
            paging,
        });
        tokio::time::sleep(CHECK_EVERY).await;
    }
}
