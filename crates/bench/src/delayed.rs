//! Delayed-message modes, for an `x-delayed-message` exchange (Warren's, or RabbitMQ's
//! delayed-message plugin): messages carry an `x-delay` header (milliseconds) and the exchange
//! routes them when they are due.
//!
//! - `--delayed-schedule N`: publish N messages due far in the future (1 to 2 hours by default)
//!   and read what holding them costs the broker (RSS after publishing and after a pause).
//! - `--delayed-rate R`: a steady R msg/s with a short delay, and a consumer that measures how
//!   late each message arrives: receive time minus the due time the publisher wrote in the body.
//!
//! Body layout: bytes 0..8 the due time (ms since the Unix epoch, little-endian: the publish
//! time on [`now_ns`]'s clock plus the message's x-delay), bytes 8..16 a sequence number unique
//! in the run, then zeros.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use futures_util::{FutureExt, StreamExt};
use hdrhistogram::Histogram;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection, Consumer, ExchangeKind};
use serde::Serialize;
use tokio::sync::{mpsc, watch, Semaphore};

use crate::opts::{ExchangeType, Opts};
use crate::rate::RateLimiter;
use crate::run::{
    close_all, confirm_task, connect, finish_producer, queue_depth, rate, BoxError, ProducerResult,
    Progress, Shared,
};
use crate::stats::{self, new_histogram, now_ns, BrokerReport, LatencySummary};

/// The exchange type of RabbitMQ's delayed-message plugin, which Warren implements.
pub const DELAYED_TYPE: &str = "x-delayed-message";

/// Sequence numbers above this are not ours (the lost/duplicate bitmap would be too large).
const MAX_SEQ: u64 = 1 << 36;

/// x-delay and the broker's clock count whole milliseconds: a message published at T with
/// x-delay D may be released as early as T + D - 1 ms (a broker that truncates T to the
/// millisecond, as Warren and RabbitMQ do). Deliveries less than this before their due time are
/// counted apart (`early_sub_ms`); `early` counts only those before it.
pub const RESOLUTION_US: u64 = 1_000;

/// Lateness percentiles, in microseconds (deliveries before their due time count as 0 here and
/// are counted in `early` or `early_sub_ms`).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct LatenessSummary {
    pub count: u64,
    pub min_us: u64,
    pub mean_us: f64,
    pub p50_us: u64,
    pub p90_us: u64,
    pub p99_us: u64,
    pub p999_us: u64,
    pub max_us: u64,
}

impl LatenessSummary {
    pub fn from_histogram(h: &Histogram<u64>) -> Option<Self> {
        if h.is_empty() {
            return None;
        }
        Some(Self {
            count: h.len(),
            min_us: h.min(),
            mean_us: stats::round1(h.mean()),
            p50_us: h.value_at_quantile(0.50),
            p90_us: h.value_at_quantile(0.90),
            p99_us: h.value_at_quantile(0.99),
            p999_us: h.value_at_quantile(0.999),
            max_us: h.max(),
        })
    }
}

#[derive(Debug, Serialize)]
pub struct ScheduleReport {
    pub mode: &'static str,
    pub label: Option<String>,
    pub config: Opts,
    pub exchange: String,
    pub queue: String,
    /// The x-delay range of the messages, in ms.
    pub delay_min_ms: u64,
    pub delay_max_ms: u64,
    pub published: u64,
    pub confirmed: u64,
    pub nacked: u64,
    /// From the first publish until the last producer finished (confirms included).
    pub publish_s: f64,
    pub publish_rate: f64,
    pub confirm_latency: Option<LatencySummary>,
    /// Messages in the queue after the pause (a passive declare): any that fell due already.
    pub queue_depth_end: Option<u64>,
    /// Broker CPU and memory over the publishing (peak included).
    pub broker: Option<BrokerReport>,
    /// Broker RSS right after the last confirm, and after --settle seconds more.
    pub rss_after_publish_kb: Option<u64>,
    pub rss_after_pause_kb: Option<u64>,
    pub pause_s: f64,
    /// Broker RSS growth (start to after the pause) per scheduled message, in bytes.
    pub bytes_per_scheduled: Option<f64>,
    pub client_cpu_s: f64,
    pub errors: Vec<String>,
}

#[derive(Debug, Serialize)]
pub struct LatenessReport {
    pub mode: &'static str,
    pub label: Option<String>,
    pub config: Opts,
    pub exchange: String,
    pub queue: String,
    pub delay_min_ms: u64,
    pub delay_max_ms: u64,
    /// Seconds of publishing (--duration).
    pub publish_s: f64,
    pub published: u64,
    pub publish_rate: f64,
    pub confirmed: u64,
    pub nacked: u64,
    /// Messages the rate limiter gave up on because the producer fell more than 100 ms behind.
    pub rate_skipped: u64,
    /// Seconds from the end of publishing until the last message arrived (or the wait ended).
    pub drain_s: f64,
    /// Deliveries, duplicates included.
    pub received: u64,
    /// Distinct messages received.
    pub unique: u64,
    pub duplicates: u64,
    /// Published and never received: not there --idle-timeout seconds after the last due time.
    pub lost: u64,
    /// Received more than 1 ms (the resolution of x-delay) before the due time in their body.
    pub early: u64,
    /// Received before their due time by less than 1 ms (see [`RESOLUTION_US`]).
    pub early_sub_ms: u64,
    /// The most any message arrived before its due time (us).
    pub early_max_us: u64,
    /// Receive time minus due time, over the first delivery of every message.
    pub lateness: Option<LatenessSummary>,
    pub confirm_latency: Option<LatencySummary>,
    /// Broker CPU and memory from the first publish until the last message arrived.
    pub broker: Option<BrokerReport>,
    pub client_cpu_s: f64,
    pub client_cpu_pct: f64,
    pub errors: Vec<String>,
}

/// splitmix64: a small, fast, seeded generator for the random part of the delays.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (0 when n is 0).
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            ((u128::from(self.next()) * u128::from(n)) >> 64) as u64
        }
    }
}

/// Writes a body's due time and sequence number; the rest stays as it is (zeros).
pub fn write_body(body: &mut [u8], due_ms: u64, seq: u64) {
    body[..8].copy_from_slice(&due_ms.to_le_bytes());
    body[8..16].copy_from_slice(&seq.to_le_bytes());
}

/// The due time and sequence number of a body, if it is long enough.
pub fn read_body(body: &[u8]) -> Option<(u64, u64)> {
    let due = <[u8; 8]>::try_from(body.get(..8)?).ok()?;
    let seq = <[u8; 8]>::try_from(body.get(8..16)?).ok()?;
    Some((u64::from_le_bytes(due), u64::from_le_bytes(seq)))
}

/// Receive time (ns on [`now_ns`]'s clock) minus due time (ms), in microseconds.
pub fn lateness_us(received_ns: u64, due_ms: u64) -> i64 {
    (received_ns / 1_000) as i64 - due_ms.saturating_mul(1_000) as i64
}

/// Which messages arrived: one bit per sequence number.
#[derive(Default)]
struct Seen(Vec<u64>);

impl Seen {
    /// Marks `seq`; returns whether it was new.
    fn insert(&mut self, seq: u64) -> bool {
        let (word, bit) = ((seq / 64) as usize, seq % 64);
        if word >= self.0.len() {
            self.0.resize((word + 1).max(self.0.len() * 2), 0);
        }
        let new = self.0[word] & (1 << bit) == 0;
        self.0[word] |= 1 << bit;
        new
    }
}

fn delayed_type(t: ExchangeType) -> &'static str {
    match t {
        ExchangeType::Direct => "direct",
        ExchangeType::Fanout => "fanout",
        ExchangeType::Topic => "topic",
    }
}

/// Declares the delayed exchange and its queue, bound with the queue's name.
async fn declare(opts: &Opts, ch: &Channel, queue: &str, purge: bool) -> Result<(), BoxError> {
    let mut args = FieldTable::default();
    args.insert(
        ShortString::from("x-delayed-type"),
        AMQPValue::LongString(LongString::from(delayed_type(opts.exchange_type))),
    );
    ch.exchange_declare(
        opts.delayed_exchange().into(),
        ExchangeKind::Custom(DELAYED_TYPE.to_string()),
        ExchangeDeclareOptions {
            durable: opts.durable,
            ..Default::default()
        },
        args,
    )
    .await?;
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions {
            durable: opts.durable,
            ..Default::default()
        },
        opts.queue_arguments(),
    )
    .await?;
    if purge {
        // A queue left over from an interrupted run would count as duplicates.
        ch.queue_purge(queue.into(), Default::default()).await?;
    }
    ch.queue_bind(
        queue.into(),
        opts.delayed_exchange().into(),
        queue.into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await?;
    Ok(())
}

async fn delete(opts: &Opts, ch: &Channel, queue: &str) -> Result<(), BoxError> {
    ch.queue_delete(queue.into(), QueueDeleteOptions::default())
        .await?;
    ch.exchange_delete(
        opts.delayed_exchange().into(),
        ExchangeDeleteOptions::default(),
    )
    .await?;
    Ok(())
}

/// What one publisher sends.
struct Plan {
    routing_key: ShortString,
    /// Messages to send (None: until stopped).
    quota: Option<u64>,
    /// Messages per second (None: as fast as confirms allow).
    rate: Option<f64>,
    /// Sequence numbers `first, first + step, ...`.
    first_seq: u64,
    step: u64,
}

type PublishResult = ProducerResult;

/// Publishes delayed messages as `plan` says, in batches, within the confirm window.
async fn publisher(
    ch: Channel,
    opts: Arc<Opts>,
    plan: Plan,
    shared: Arc<Shared>,
    mut stop: watch::Receiver<bool>,
    start: Instant,
) -> Result<PublishResult, BoxError> {
    let size = opts.size as usize;
    let base = if opts.persistent {
        BasicProperties::default().with_delivery_mode(2)
    } else {
        BasicProperties::default()
    };
    let exchange = ShortString::from(opts.delayed_exchange());
    let (delay, spread) = (opts.delay_base_ms(), opts.delay_spread());
    let mut rng = SplitMix(0x5EED_0000 ^ plan.first_seq);
    let mut batch_max = u64::from(opts.batch);
    if opts.confirm > 0 {
        batch_max = batch_max.min(u64::from(opts.confirm));
    }
    let mut buf = vec![0u8; batch_max as usize * size];
    let mut delays = Vec::with_capacity(batch_max as usize);
    let confirms = (opts.confirm > 0).then(|| {
        let window = Arc::new(Semaphore::new(opts.confirm as usize));
        let (tx, rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(confirm_task(rx, window.clone(), shared.clone()));
        (window, tx, task)
    });
    let slice = Duration::from_secs_f64(opts.slice_ms / 1000.0);
    let mut limiter = plan
        .rate
        .map(|r| RateLimiter::new(r, Duration::from_millis(100)));
    let mut sent = 0u64;
    let mut error = None;
    loop {
        if *stop.borrow() {
            break;
        }
        let remaining = plan.quota.map_or(u64::MAX, |q| q - sent);
        if remaining == 0 {
            break;
        }
        let mut n = batch_max.min(remaining);
        if let Some(rl) = limiter.as_mut() {
            let elapsed = start.elapsed();
            let due = rl.due(elapsed);
            if due == 0 {
                let wake = start + rl.next_wake(elapsed, slice);
                tokio::select! {
                    _ = tokio::time::sleep_until(wake.into()) => {}
                    _ = stop.changed() => break,
                }
                continue;
            }
            n = n.min(due);
        }
        if let Some((window, _, _)) = &confirms {
            tokio::select! {
                permit = window.acquire_many(n as u32) => permit?.forget(),
                _ = stop.changed() => break,
            }
        }
        let sent_ns = now_ns();
        let now_ms = sent_ns / 1_000_000;
        let bodies = &mut buf[..n as usize * size];
        delays.clear();
        for (i, body) in bodies.chunks_exact_mut(size).enumerate() {
            let d = delay + rng.below(spread);
            let seq = plan.first_seq + (sent + i as u64) * plan.step;
            write_body(body, now_ms + d, seq);
            delays.push(d);
        }
        let publishes = bodies.chunks_exact(size).zip(&delays).map(|(body, &d)| {
            let mut headers = FieldTable::default();
            // validate() keeps every delay within i64.
            headers.insert(
                ShortString::from("x-delay"),
                AMQPValue::LongLongInt(d as i64),
            );
            ch.basic_publish(
                exchange.clone(),
                plan.routing_key.clone(),
                BasicPublishOptions::default(),
                body,
                base.clone().with_headers(headers),
            )
        });
        // A stop lets the batch finish, so that the count of published messages is exact,
        // unless the broker does not read its socket for 5 s (its frames are then left unsent).
        let mut all = std::pin::pin!(join_all(publishes));
        let results = tokio::select! {
            r = &mut all => r,
            _ = stop.changed() => match tokio::time::timeout(Duration::from_secs(5), all).await {
                Ok(r) => r,
                Err(_) => break,
            },
        };
        let mut pending = Vec::with_capacity(if confirms.is_some() { results.len() } else { 0 });
        for r in results {
            match r {
                Ok(c) => {
                    if confirms.is_some() {
                        pending.push(c);
                    }
                }
                Err(e) => {
                    error = Some(e.into());
                    break;
                }
            }
        }
        if error.is_some() {
            break;
        }
        if let Some((_, tx, _)) = &confirms {
            let _ = tx.send((sent_ns, pending));
        }
        if let Some(rl) = limiter.as_mut() {
            rl.sent(n);
        }
        sent += n;
        shared.published.fetch_add(n, Relaxed);
    }
    finish_producer(
        confirms,
        &stop,
        sent,
        limiter.map_or(0, |l| l.skipped),
        error,
    )
    .await
}

/// The publishers' connections and channels (confirm mode as asked).
async fn open_publishers(opts: &Opts) -> Result<Vec<(Connection, Channel)>, BoxError> {
    let mut out = Vec::new();
    for i in 0..opts.producers {
        let conn = connect(&opts.url, &format!("warren-bench delayed producer {i}")).await?;
        let ch = conn.create_channel().await?;
        if opts.confirm > 0 {
            ch.confirm_select(ConfirmSelectOptions::default()).await?;
        }
        out.push((conn, ch));
    }
    Ok(out)
}

/// Sums the publishers' results (errors go to `errors`).
async fn join_publishers(
    tasks: Vec<tokio::task::JoinHandle<Result<PublishResult, BoxError>>>,
    start: Instant,
    errors: &mut Vec<String>,
) -> Result<PublishResult, BoxError> {
    let mut total = PublishResult {
        published: 0,
        confirmed: 0,
        nacked: 0,
        skipped: 0,
        confirm_hist: new_histogram(),
        end: start,
    };
    for t in tasks {
        match t.await? {
            Ok(r) => {
                total.published += r.published;
                total.confirmed += r.confirmed;
                total.nacked += r.nacked;
                total.skipped += r.skipped;
                total.confirm_hist.add(&r.confirm_hist)?;
                total.end = total.end.max(r.end);
            }
            Err(e) => errors.push(format!("producer: {e}")),
        }
    }
    Ok(total)
}

/// Splits `total` over `parts` as evenly as possible; part `i`'s share.
fn share(total: u64, parts: u64, i: u64) -> u64 {
    total / parts + u64::from(i < total % parts)
}

pub async fn schedule(opts: Opts, n: u64) -> Result<ScheduleReport, BoxError> {
    let queue = opts.queue_name(0);
    let mut errors = Vec::new();
    let admin = connect(&opts.url, "warren-bench delayed admin").await?;
    let admin_ch = admin.create_channel().await?;
    if !opts.predeclare {
        declare(&opts, &admin_ch, &queue, false).await?;
    }
    let publishers = open_publishers(&opts).await?;
    let shared = Arc::new(Shared::default());
    let pid = opts.broker_pid;
    let peak_reset = match pid {
        Some(p) if !opts.no_reset_peak => stats::reset_peak(p),
        _ => false,
    };
    let broker_start = pid.map(stats::sample).transpose()?;
    let client_start = stats::sample_self();
    let (stop_tx, stop_rx) = watch::channel(false);
    let cfg = Arc::new(opts.clone());
    let start = Instant::now();
    let parts = publishers.len() as u64;
    let tasks: Vec<_> = publishers
        .iter()
        .enumerate()
        .map(|(i, (_, ch))| {
            let plan = Plan {
                routing_key: queue.as_str().into(),
                quota: Some(share(n, parts, i as u64)),
                rate: None,
                first_seq: i as u64,
                step: parts,
            };
            tokio::spawn(publisher(
                ch.clone(),
                cfg.clone(),
                plan,
                shared.clone(),
                stop_rx.clone(),
                start,
            ))
        })
        .collect();

    let mut progress = Progress::new(&shared, pid, start, opts.confirm > 0);
    let mut tick = tokio::time::interval(Duration::from_millis(20));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut ctrl_c = std::pin::pin!(tokio::signal::ctrl_c());
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = &mut ctrl_c => {
                errors.push("interrupted".to_string());
                let _ = stop_tx.send(true);
                break;
            }
        }
        progress.maybe_print(Instant::now(), opts.quiet);
        if tasks.iter().all(|t| t.is_finished()) {
            break;
        }
    }
    let total = join_publishers(tasks, start, &mut errors).await?;
    let broker_end = match pid.map(stats::sample) {
        Some(Err(e)) => {
            errors.push(format!("broker process: {e}"));
            None
        }
        other => other.and_then(Result::ok),
    };
    let publish_s = (total.end - start).as_secs_f64();
    let client_end = stats::sample_self();
    close_all(publishers.iter().map(|(c, _)| c)).await;

    if !opts.quiet {
        eprintln!(
            "published {}; waiting {:.0}s for the broker's memory to settle",
            total.published, opts.settle
        );
    }
    tokio::time::sleep(Duration::from_secs_f64(opts.settle)).await;
    let rss_after_pause_kb = pid.and_then(|p| stats::sample(p).ok()).map(|s| s.rss_kb);
    let queue_depth_end = queue_depth(&admin_ch, std::slice::from_ref(&queue)).await;
    if let Some(d) = queue_depth_end.filter(|d| *d > 0) {
        errors.push(format!(
            "{d} messages already in the queue: they fell due during the run"
        ));
    }
    if opts.delete {
        if let Err(e) = delete(&opts, &admin_ch, &queue).await {
            errors.push(format!("cleanup: {e}"));
        }
    }
    let _ = admin.close(200, "bye".into()).await;

    let broker = match (pid, broker_start, broker_end) {
        (Some(p), Some(s), Some(e)) => {
            let mut b = BrokerReport::new(p, s, e, progress.rss_max_kb, publish_s, peak_reset);
            b.set_per_msg(total.published, "published");
            b.set_per_published(total.published);
            Some(b)
        }
        _ => None,
    };
    let bytes_per_scheduled = match (broker_start, rss_after_pause_kb) {
        (Some(s), Some(after)) if total.published > 0 => Some(stats::round1(
            (after as f64 - s.rss_kb as f64) * 1024.0 / total.published as f64,
        )),
        _ => None,
    };
    Ok(ScheduleReport {
        mode: "delayed-schedule",
        label: opts.label.clone(),
        exchange: opts.delayed_exchange().to_string(),
        queue,
        delay_min_ms: opts.delay_base_ms(),
        delay_max_ms: opts.delay_base_ms() + opts.delay_spread(),
        published: total.published,
        confirmed: total.confirmed,
        nacked: total.nacked,
        publish_s: stats::round3(publish_s),
        publish_rate: rate(total.published, publish_s),
        confirm_latency: LatencySummary::from_histogram(&total.confirm_hist),
        queue_depth_end,
        rss_after_publish_kb: broker_end.map(|s| s.rss_kb),
        rss_after_pause_kb,
        pause_s: opts.settle,
        bytes_per_scheduled,
        broker,
        client_cpu_s: stats::round3((client_end.cpu_s - client_start.cpu_s).max(0.0)),
        errors,
        config: opts,
    })
}

struct ConsumeResult {
    received: u64,
    duplicates: u64,
    early: u64,
    early_sub_ms: u64,
    early_max_us: u64,
    hist: Histogram<u64>,
    last: Option<Instant>,
    error: Option<String>,
}

/// Receives, acks and measures every delivery until stopped. `unique` counts distinct
/// messages for the supervisor.
async fn consume(
    ch: Channel,
    mut consumer: Consumer,
    shared: Arc<Shared>,
    unique: Arc<AtomicU64>,
    mut stop: watch::Receiver<bool>,
) -> ConsumeResult {
    let mut r = ConsumeResult {
        received: 0,
        duplicates: 0,
        early: 0,
        early_sub_ms: 0,
        early_max_us: 0,
        hist: new_histogram(),
        last: None,
        error: None,
    };
    let mut seen = Seen::default();
    loop {
        let delivery = tokio::select! {
            biased;
            _ = stop.changed() => break,
            d = consumer.next() => d,
        };
        let delivery = match delivery {
            Some(Ok(d)) => d,
            Some(Err(e)) => {
                r.error = Some(e.to_string());
                break;
            }
            None => break,
        };
        let now = now_ns();
        r.received += 1;
        r.last = Some(Instant::now());
        shared.consumed.fetch_add(1, Relaxed);
        // Queued without waiting for lapin's I/O thread, which writes the acks queued meanwhile
        // together (as the throughput consumer does).
        let _ = ch
            .basic_ack(delivery.delivery_tag, BasicAckOptions { multiple: false })
            .now_or_never();
        let Some((due_ms, seq)) = read_body(&delivery.data).filter(|(_, s)| *s < MAX_SEQ) else {
            r.error = Some("a message without a due time and sequence number".into());
            continue;
        };
        if !seen.insert(seq) {
            r.duplicates += 1;
            continue;
        }
        unique.fetch_add(1, Relaxed);
        let late = lateness_us(now, due_ms);
        if late < 0 {
            let by = late.unsigned_abs();
            if by > RESOLUTION_US {
                r.early += 1;
            } else {
                r.early_sub_ms += 1;
            }
            r.early_max_us = r.early_max_us.max(by);
        }
        let late = late.max(0) as u64;
        r.hist.saturating_record(late);
        shared.lat_sum_us.fetch_add(late, Relaxed);
        shared.lat_n.fetch_add(1, Relaxed);
        shared.lat_max_us.fetch_max(late, Relaxed);
    }
    r
}

pub async fn lateness(opts: Opts, total_rate: f64) -> Result<LatenessReport, BoxError> {
    let queue = opts.queue_name(0);
    let mut errors = Vec::new();
    let admin = connect(&opts.url, "warren-bench delayed admin").await?;
    let admin_ch = admin.create_channel().await?;
    if !opts.predeclare {
        declare(&opts, &admin_ch, &queue, true).await?;
    }
    // The consumer first, so that nothing is missed.
    let cconn = connect(&opts.url, "warren-bench delayed consumer").await?;
    let cch = cconn.create_channel().await?;
    cch.basic_qos(opts.prefetch, BasicQosOptions::default())
        .await?;
    let consumer = cch
        .basic_consume(
            queue.as_str().into(),
            "warren-bench-delayed".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let publishers = open_publishers(&opts).await?;

    let shared = Arc::new(Shared::default());
    let unique = Arc::new(AtomicU64::new(0));
    let pid = opts.broker_pid;
    let peak_reset = match pid {
        Some(p) if !opts.no_reset_peak => stats::reset_peak(p),
        _ => false,
    };
    let broker_start = pid.map(stats::sample).transpose()?;
    let client_start = stats::sample_self();
    let (stop_pub_tx, stop_pub_rx) = watch::channel(false);
    let (stop_cons_tx, stop_cons_rx) = watch::channel(false);
    let cfg = Arc::new(opts.clone());
    let start = Instant::now();
    let consumer_task = tokio::spawn(consume(
        cch.clone(),
        consumer,
        shared.clone(),
        unique.clone(),
        stop_cons_rx,
    ));
    let parts = publishers.len() as u64;
    let tasks: Vec<_> = publishers
        .iter()
        .enumerate()
        .map(|(i, (_, ch))| {
            let plan = Plan {
                routing_key: queue.as_str().into(),
                quota: None,
                rate: Some(total_rate / parts as f64),
                first_seq: i as u64,
                step: parts,
            };
            tokio::spawn(publisher(
                ch.clone(),
                cfg.clone(),
                plan,
                shared.clone(),
                stop_pub_rx.clone(),
                start,
            ))
        })
        .collect();

    let publish_for = opts.duration().unwrap_or(Duration::from_secs(10));
    let max_delay = Duration::from_millis(opts.delay_base_ms() + opts.delay_spread());
    let grace = Duration::from_secs_f64(opts.idle_timeout);
    let mut publish_end: Option<Instant> = None;
    let mut progress = Progress::new(&shared, pid, start, opts.confirm > 0);
    progress.show_backlog(1);
    let mut tick = tokio::time::interval(Duration::from_millis(20));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut ctrl_c = std::pin::pin!(tokio::signal::ctrl_c());
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = &mut ctrl_c => {
                errors.push("interrupted".to_string());
                break;
            }
        }
        let now = Instant::now();
        progress.maybe_print(now, opts.quiet);
        match publish_end {
            None => {
                if now - start >= publish_for || tasks.iter().all(|t| t.is_finished()) {
                    let _ = stop_pub_tx.send(true);
                    publish_end = Some(now);
                }
            }
            Some(end) => {
                if tasks.iter().all(|t| t.is_finished())
                    && unique.load(Relaxed) >= shared.published.load(Relaxed)
                {
                    break;
                }
                if now - end > max_delay + grace {
                    break;
                }
            }
        }
    }
    let _ = stop_pub_tx.send(true);
    let _ = stop_cons_tx.send(true);
    let end = Instant::now();
    let broker_end = match pid.map(stats::sample) {
        Some(Err(e)) => {
            errors.push(format!("broker process: {e}"));
            None
        }
        other => other.and_then(Result::ok),
    };
    let client_end = stats::sample_self();
    let total = join_publishers(tasks, start, &mut errors).await?;
    let c = consumer_task.await?;
    if let Some(e) = c.error {
        errors.push(format!("consumer: {e}"));
    }
    let unique = unique.load(Relaxed);
    let lost = total.published.saturating_sub(unique);
    if lost > 0 {
        errors.push(format!(
            "{lost} of {} messages never arrived (waited {:.0}s past the last due time)",
            total.published, opts.idle_timeout
        ));
    }
    if c.early > 0 {
        errors.push(format!(
            "{} messages arrived over 1 ms before their due time (by up to {})",
            c.early,
            stats::fmt_us(c.early_max_us)
        ));
    }

    close_all(std::iter::once(&cconn)).await;
    if !opts.keep && !opts.predeclare {
        if let Err(e) = delete(&opts, &admin_ch, &queue).await {
            errors.push(format!("cleanup: {e}"));
        }
    }
    close_all(publishers.iter().map(|(c, _)| c)).await;
    let _ = admin.close(200, "bye".into()).await;

    let publish_end = publish_end.unwrap_or(end);
    let publish_s = (publish_end - start).as_secs_f64();
    let elapsed = (end - start).as_secs_f64();
    let drain_end = c.last.unwrap_or(end).max(publish_end);
    let broker = match (pid, broker_start, broker_end) {
        (Some(p), Some(s), Some(e)) => {
            let mut b = BrokerReport::new(p, s, e, progress.rss_max_kb, elapsed, peak_reset);
            b.set_per_msg(c.received, "consumed");
            b.set_per_published(total.published);
            Some(b)
        }
        _ => None,
    };
    let client_cpu = (client_end.cpu_s - client_start.cpu_s).max(0.0);
    Ok(LatenessReport {
        mode: "delayed-rate",
        label: opts.label.clone(),
        exchange: opts.delayed_exchange().to_string(),
        queue,
        delay_min_ms: opts.delay_base_ms(),
        delay_max_ms: opts.delay_base_ms() + opts.delay_spread(),
        publish_s: stats::round3(publish_s),
        published: total.published,
        publish_rate: rate(total.published, publish_s),
        confirmed: total.confirmed,
        nacked: total.nacked,
        rate_skipped: total.skipped,
        drain_s: stats::round3((drain_end - publish_end).as_secs_f64()),
        received: c.received,
        unique,
        duplicates: c.duplicates,
        lost,
        early: c.early,
        early_sub_ms: c.early_sub_ms,
        early_max_us: c.early_max_us,
        lateness: LatenessSummary::from_histogram(&c.hist),
        confirm_latency: LatencySummary::from_histogram(&total.confirm_hist),
        broker,
        client_cpu_s: stats::round3(client_cpu),
        client_cpu_pct: if elapsed > 0.0 {
            stats::round1(client_cpu / elapsed * 100.0)
        } else {
            0.0
        },
        errors,
        config: opts,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_round_trip() {
        let mut body = vec![0u8; 32];
        write_body(&mut body, 1_700_000_000_123, 42);
        assert_eq!(read_body(&body), Some((1_700_000_000_123, 42)));
        assert!(body[16..].iter().all(|b| *b == 0));
        assert_eq!(read_body(&body[..15]), None);
    }

    #[test]
    fn lateness_sign() {
        assert_eq!(lateness_us(2_000_500_000, 2_000), 500);
        assert_eq!(lateness_us(1_999_000_000, 2_000), -1_000);
    }

    #[test]
    fn seen_counts_each_sequence_once() {
        let mut s = Seen::default();
        assert!(s.insert(0));
        assert!(s.insert(1000));
        assert!(!s.insert(1000));
        assert!(s.insert(63) && s.insert(64));
        assert!(!s.insert(0));
    }

    #[test]
    fn delays_are_uniform_and_in_range() {
        let mut r = SplitMix(7);
        let n = 100_000;
        let mut buckets = [0u32; 10];
        for _ in 0..n {
            let v = r.below(3_600_000);
            assert!(v < 3_600_000);
            buckets[(v / 360_000) as usize] += 1;
        }
        for b in buckets {
            assert!((9_000..11_000).contains(&b), "{buckets:?}");
        }
        assert_eq!(r.below(0), 0);
    }

    #[test]
    fn shares_add_up() {
        assert_eq!(
            (0..3).map(|i| share(10, 3, i)).collect::<Vec<_>>(),
            [4, 3, 3]
        );
        assert_eq!((0..4).map(|i| share(2, 4, i)).sum::<u64>(), 2);
    }
}
