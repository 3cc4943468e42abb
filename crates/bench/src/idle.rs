//! Idle-queue and idle-connection modes: what one more idle item costs the broker.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
use lapin::Channel;
use serde::Serialize;
use tokio::sync::watch;

use crate::opts::Opts;
use crate::rawconn::{IdleConnection, Target};
use crate::run::{connect, BoxError};
use crate::stats::{self, BrokerReport};

#[derive(Debug, Serialize)]
pub struct IdleReport {
    pub mode: &'static str,
    pub label: Option<String>,
    pub config: Opts,
    /// Queues declared or connections opened.
    pub items: u64,
    /// Seconds to declare / open them all.
    pub create_s: f64,
    /// Items per second.
    pub create_rate: f64,
    /// Broker RSS growth per item, in bytes, after --settle seconds.
    pub bytes_per_item: Option<f64>,
    /// The same over the second half of the items only (RSS after --settle at the half-way point
    /// to RSS at the end). Memory the allocator kept from earlier work is mostly used up by the
    /// first half, so this is the steadier figure of what one more item costs.
    pub bytes_per_item_second_half: Option<f64>,
    /// Broker RSS at the half-way point (after --settle seconds).
    pub rss_mid_kb: Option<u64>,
    /// Broker CPU and memory from before the first item until after the settle time.
    pub broker: Option<BrokerReport>,
    pub client_cpu_s: f64,
    pub errors: Vec<String>,
}

/// Prints "created n/N (rate/s)" once a second until `done` reaches `total`.
fn spawn_progress(
    done: Arc<AtomicU64>,
    total: u64,
    what: &'static str,
    pid: Option<u32>,
    quiet: bool,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let start = Instant::now();
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.tick().await;
        let mut last = 0;
        loop {
            tick.tick().await;
            let n = done.load(Relaxed);
            if !quiet {
                let rss = pid
                    .and_then(|p| stats::sample(p).ok())
                    .map(|s| format!("  broker rss {} MiB", s.rss_kb / 1024))
                    .unwrap_or_default();
                eprintln!(
                    "{:>5.0}s  {what} {n}/{total}  {}/s{rss}",
                    start.elapsed().as_secs_f64(),
                    n - last
                );
            }
            last = n;
            if n >= total {
                break;
            }
        }
    })
}

/// Splits `0..n` into `parts` contiguous ranges.
pub fn split_range(n: u64, parts: u64) -> Vec<std::ops::Range<u64>> {
    let parts = parts.clamp(1, n.max(1));
    (0..parts)
        .map(|i| (n * i / parts)..(n * (i + 1) / parts))
        .collect()
}

struct Before {
    peak_reset: bool,
    broker: Option<stats::ProcSample>,
    client: stats::ProcSample,
    start: Instant,
}

/// Waits (at most `max`) until the broker's RSS has stopped moving, so that memory a previous
/// run is still giving back is not counted against this one. Returns the seconds waited.
async fn wait_quiet(pid: u32, max: Duration, quiet: bool) -> f64 {
    let start = Instant::now();
    let mut prev = stats::sample(pid).map(|s| s.rss_kb).unwrap_or(0);
    while start.elapsed() < max {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let now = stats::sample(pid).map(|s| s.rss_kb).unwrap_or(0);
        let moved = now.abs_diff(prev);
        if moved <= 512.max(now / 500) {
            break;
        }
        if !quiet {
            eprintln!("waiting for the broker's RSS to settle: {prev} -> {now} kB");
        }
        prev = now;
    }
    start.elapsed().as_secs_f64()
}

async fn before(opts: &Opts) -> Result<Before, BoxError> {
    if let Some(pid) = opts.broker_pid {
        wait_quiet(pid, Duration::from_secs_f64(opts.quiesce), opts.quiet).await;
    }
    let peak_reset = match opts.broker_pid {
        Some(pid) if !opts.no_reset_peak => stats::reset_peak(pid),
        _ => false,
    };
    Ok(Before {
        peak_reset,
        broker: opts.broker_pid.map(stats::sample).transpose()?,
        client: stats::sample_self(),
        start: Instant::now(),
    })
}

/// The half-way reading: items created so far and the broker's RSS after the settle time.
struct Mid {
    items: u64,
    rss_kb: Option<u64>,
}

async fn midpoint(opts: &Opts, items: u64) -> Mid {
    tokio::time::sleep(Duration::from_secs_f64(opts.settle)).await;
    Mid {
        items,
        rss_kb: opts
            .broker_pid
            .and_then(|p| stats::sample(p).ok())
            .map(|s| s.rss_kb),
    }
}

fn report(
    mode: &'static str,
    opts: &Opts,
    b: Before,
    mid: Mid,
    items: u64,
    create_s: f64,
    errors: Vec<String>,
) -> Result<IdleReport, BoxError> {
    let total_s = b.start.elapsed().as_secs_f64();
    let mut errors = errors;
    let broker = match (opts.broker_pid, b.broker) {
        (Some(pid), Some(start)) => match stats::sample(pid) {
            Ok(end) => Some(BrokerReport::new(pid, start, end, 0, total_s, b.peak_reset)),
            Err(e) => {
                errors.push(format!("broker process: {e}"));
                None
            }
        },
        _ => None,
    };
    let bytes_per_item = broker
        .as_ref()
        .filter(|_| items > 0)
        .map(|br| stats::round1(br.rss_delta_kb as f64 * 1024.0 / items as f64));
    let second_half = items.saturating_sub(mid.items);
    let bytes_per_item_second_half = match (&broker, mid.rss_kb) {
        (Some(br), Some(mid_kb)) if second_half > 0 => Some(stats::round1(
            (br.rss_end_kb as f64 - mid_kb as f64) * 1024.0 / second_half as f64,
        )),
        _ => None,
    };
    Ok(IdleReport {
        mode,
        label: opts.label.clone(),
        config: opts.clone(),
        items,
        create_s: stats::round3(create_s),
        create_rate: if create_s > 0.0 {
            stats::round1(items as f64 / create_s)
        } else {
            0.0
        },
        bytes_per_item,
        bytes_per_item_second_half,
        rss_mid_kb: mid.rss_kb,
        broker,
        client_cpu_s: stats::round3((stats::sample_self().cpu_s - b.client.cpu_s).max(0.0)),
        errors,
    })
}

pub async fn idle_queues(opts: Opts, n: u64) -> Result<IdleReport, BoxError> {
    let conn = connect(&opts.url, "warren-bench idle-queues").await?;
    let parallel = u64::from(opts.parallel);
    let mut channels = Vec::new();
    for _ in 0..parallel.max(8) {
        channels.push(conn.create_channel().await?);
    }
    let names: Arc<Vec<String>> = Arc::new(opts.queue_names(n as usize));
    let done = Arc::new(AtomicU64::new(0));
    let b = before(&opts).await?;
    let progress = spawn_progress(done.clone(), n, "declared", opts.broker_pid, opts.quiet);
    let mut errors = Vec::new();
    let t0 = Instant::now();
    errors.extend(declare(&opts, &channels, &names, 0..n / 2, &done).await?);
    let mut create_s = t0.elapsed().as_secs_f64();
    let mid = midpoint(&opts, done.load(Relaxed)).await;
    let t1 = Instant::now();
    errors.extend(declare(&opts, &channels, &names, n / 2..n, &done).await?);
    create_s += t1.elapsed().as_secs_f64();
    let declared = done.load(Relaxed);
    progress.abort();
    tokio::time::sleep(Duration::from_secs_f64(opts.settle)).await;
    let r = report("idle-queues", &opts, b, mid, declared, create_s, errors)?;
    if !opts.keep {
        delete_queues(&channels, &names).await;
    }
    let _ = conn.close(200, "bye".into()).await;
    Ok(r)
}

/// Declares the queues `range` of `names`, --parallel channels at a time.
async fn declare(
    opts: &Opts,
    channels: &[Channel],
    names: &Arc<Vec<String>>,
    range: std::ops::Range<u64>,
    done: &Arc<AtomicU64>,
) -> Result<Vec<String>, BoxError> {
    let args = opts.queue_arguments();
    let mut tasks = Vec::new();
    let len = range.end - range.start;
    for (part, ch) in split_range(len, u64::from(opts.parallel))
        .into_iter()
        .zip(channels.iter().cloned())
    {
        let (names, args, done) = (names.clone(), args.clone(), done.clone());
        let durable = opts.durable;
        let base = range.start;
        tasks.push(tokio::spawn(async move {
            for i in part {
                ch.queue_declare(
                    names[(base + i) as usize].as_str().into(),
                    QueueDeclareOptions {
                        durable,
                        ..Default::default()
                    },
                    args.clone(),
                )
                .await?;
                done.fetch_add(1, Relaxed);
            }
            Ok::<_, lapin::Error>(())
        }));
    }
    let mut errors = Vec::new();
    for t in tasks {
        if let Err(e) = t.await? {
            errors.push(format!("declare: {e}"));
        }
    }
    Ok(errors)
}

async fn delete_queues(channels: &[Channel], names: &Arc<Vec<String>>) {
    let mut tasks = Vec::new();
    for (range, ch) in split_range(names.len() as u64, channels.len() as u64)
        .into_iter()
        .zip(channels.iter().cloned())
    {
        let names = names.clone();
        tasks.push(tokio::spawn(async move {
            for i in range {
                let _ = ch
                    .queue_delete(
                        names[i as usize].as_str().into(),
                        QueueDeleteOptions::default(),
                    )
                    .await;
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
}

const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

pub async fn idle_connections(opts: Opts, n: u64) -> Result<IdleReport, BoxError> {
    let target = Arc::new(Target::from_url(&opts.url)?);
    let done = Arc::new(AtomicU64::new(0));
    let (stop_tx, stop_rx) = watch::channel(false);
    let b = before(&opts).await?;
    let progress = spawn_progress(done.clone(), n, "connections", opts.broker_pid, opts.quiet);
    let mut errors = Vec::new();
    let mut idlers = Vec::new();
    let t0 = Instant::now();
    open(
        &opts,
        &target,
        n / 2,
        &done,
        &stop_rx,
        &mut idlers,
        &mut errors,
    )
    .await?;
    let mut create_s = t0.elapsed().as_secs_f64();
    let mid = midpoint(&opts, idlers.len() as u64).await;
    let t1 = Instant::now();
    if errors.is_empty() {
        open(
            &opts,
            &target,
            n - n / 2,
            &done,
            &stop_rx,
            &mut idlers,
            &mut errors,
        )
        .await?;
    }
    create_s += t1.elapsed().as_secs_f64();
    let opened = idlers.len() as u64;
    progress.abort();
    tokio::time::sleep(Duration::from_secs_f64(opts.settle)).await;
    // A connection the broker dropped while idle would make the figure a lie.
    let dropped = idlers.iter().filter(|t| t.is_finished()).count();
    if dropped > 0 {
        errors.push(format!("{dropped} connections ended while idle"));
    }
    let r = report("idle-connections", &opts, b, mid, opened, create_s, errors)?;
    let _ = stop_tx.send(true);
    let _ = tokio::time::timeout(Duration::from_secs(30), join_all(idlers)).await;
    Ok(r)
}

/// Connections held open beside a run (`--hold-connections`), idle until [`Held::release`].
pub struct Held {
    stop: watch::Sender<bool>,
    idlers: Vec<tokio::task::JoinHandle<Result<(), BoxError>>>,
}

impl Held {
    /// Opens `n` idle connections, --parallel at a time.
    pub async fn open(opts: &Opts, n: u64) -> Result<Held, BoxError> {
        let target = Arc::new(Target::from_url(&opts.url)?);
        let done = Arc::new(AtomicU64::new(0));
        let (stop, stop_rx) = watch::channel(false);
        let mut idlers = Vec::new();
        let mut errors = Vec::new();
        open(opts, &target, n, &done, &stop_rx, &mut idlers, &mut errors).await?;
        if let Some(e) = errors.first() {
            return Err(format!("holding {n} connections: {e}").into());
        }
        Ok(Held { stop, idlers })
    }

    /// How many of the held connections ended before the run did (the broker closed them).
    pub fn dropped(&self) -> usize {
        self.idlers.iter().filter(|t| t.is_finished()).count()
    }

    /// Closes them.
    pub async fn release(self) {
        let _ = self.stop.send(true);
        let _ = tokio::time::timeout(Duration::from_secs(30), join_all(self.idlers)).await;
    }
}

/// Opens `n` more idle connections, --parallel at a time; each then idles on its own task.
async fn open(
    opts: &Opts,
    target: &Arc<Target>,
    n: u64,
    done: &Arc<AtomicU64>,
    stop_rx: &watch::Receiver<bool>,
    idlers: &mut Vec<tokio::task::JoinHandle<Result<(), BoxError>>>,
    errors: &mut Vec<String>,
) -> Result<(), BoxError> {
    let mut openers = Vec::new();
    for range in split_range(n, u64::from(opts.parallel)) {
        let (target, done, stop_rx) = (target.clone(), done.clone(), stop_rx.clone());
        openers.push(tokio::spawn(async move {
            let mut opened = Vec::new();
            for _ in range {
                // A broker out of sockets accepts at the TCP level and then never answers.
                let conn = tokio::time::timeout(HANDSHAKE_TIMEOUT, IdleConnection::open(&target))
                    .await
                    .map_err(|_| "handshake timed out (is the broker out of sockets?)");
                match conn {
                    Ok(Ok(conn)) => opened.push(tokio::spawn(conn.idle(stop_rx.clone()))),
                    Ok(Err(e)) => return (opened, Some(e.to_string())),
                    Err(e) => return (opened, Some(e.to_string())),
                }
                done.fetch_add(1, Relaxed);
            }
            (opened, None)
        }));
    }
    for t in openers {
        let (opened, error) = t.await?;
        idlers.extend(opened);
        if let Some(e) = error {
            errors.push(format!("connect: {e}"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::split_range;

    #[test]
    fn ranges_cover_everything_once() {
        assert_eq!(split_range(10, 3), vec![0..3, 3..6, 6..10]);
        assert_eq!(split_range(2, 8), vec![0..1, 1..2]);
        assert_eq!(split_range(0, 4), vec![0..0]);
    }
}
