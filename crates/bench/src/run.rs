//! The throughput / latency run: producers and consumers over a set of queues.

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
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, Consumer,
    ExchangeKind, PublisherConfirm,
};
use serde::Serialize;
use tokio::sync::{mpsc, watch, Semaphore};

use crate::opts::{ExchangeType, Opts};
use crate::rate::RateLimiter;
use crate::stats::{self, new_histogram, now_ns, BrokerReport, LatencySummary, ProcSample};

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Counters shared with the progress line. Each task also keeps its own exact figures.
#[derive(Default)]
pub struct Shared {
    pub published: AtomicU64,
    pub confirmed: AtomicU64,
    pub nacked: AtomicU64,
    pub consumed: AtomicU64,
    /// Sum and max of end-to-end latency (us) since the last progress line.
    pub lat_sum_us: AtomicU64,
    pub lat_n: AtomicU64,
    pub lat_max_us: AtomicU64,
}

#[derive(Debug, Serialize)]
pub struct RunReport {
    pub mode: &'static str,
    pub label: Option<String>,
    pub config: Opts,
    /// Seconds from the start (all connections open, consumers registered) to the end.
    pub elapsed_s: f64,
    pub published: u64,
    /// Messages per second over the publishing interval (until the last producer finished,
    /// confirms included).
    pub publish_rate: f64,
    pub publish_elapsed_s: f64,
    pub confirmed: u64,
    pub nacked: u64,
    /// Messages the rate limiter gave up on because the producer fell more than 100 ms behind.
    pub rate_skipped: u64,
    pub consumed: u64,
    /// Messages per second from the consumers' start to the last message received.
    pub consume_rate: f64,
    pub consume_elapsed_s: f64,
    /// Messages published (times the fanout factor) but not consumed when the run stopped: in
    /// the queues, or delivered and not yet handled. It grows for the whole run when the
    /// producers outpace the consumers.
    pub backlog_end: i64,
    /// `backlog_end` over the run's duration: how fast the queues grew, in messages per second.
    pub backlog_growth_rate: f64,
    /// The broker's own count of ready messages over all queues (a passive queue.declare on the
    /// admin connection right after the run stopped), if it answered within 5 s.
    pub queue_depth_end: Option<u64>,
    pub latency: Option<LatencySummary>,
    pub confirm_latency: Option<LatencySummary>,
    pub broker: Option<BrokerReport>,
    /// This process's own CPU seconds and share of one core over the run.
    pub client_cpu_s: f64,
    pub client_cpu_pct: f64,
    pub errors: Vec<String>,
}

pub(crate) struct ProducerResult {
    pub published: u64,
    pub confirmed: u64,
    pub nacked: u64,
    pub skipped: u64,
    pub confirm_hist: Histogram<u64>,
    pub end: Instant,
}

struct ConsumerResult {
    consumed: u64,
    hist: Histogram<u64>,
    last: Option<Instant>,
    error: Option<String>,
}

pub async fn connect(url: &str, name: &str) -> Result<Connection, BoxError> {
    let props = ConnectionProperties::default().with_connection_name(name.into());
    Ok(Connection::connect(url, props).await?)
}

pub async fn run(opts: Opts) -> Result<RunReport, BoxError> {
    let shared = Arc::new(Shared::default());
    let queues = opts.queue_names(opts.queues);
    let mut errors = Vec::new();

    // Topology, on a connection of its own that also tears it down at the end.
    let admin = connect(&opts.url, "warren-bench admin").await?;
    let admin_ch = admin.create_channel().await?;
    if !opts.predeclare {
        declare_topology(&opts, &admin_ch, &queues).await?;
    }

    // Consumers first, so that nothing published is missed.
    let mut consumers = Vec::new();
    for i in 0..opts.consumers {
        let conn = connect(&opts.url, &format!("warren-bench consumer {i}")).await?;
        let ch = conn.create_channel().await?;
        if !opts.auto_ack {
            ch.basic_qos(opts.prefetch, BasicQosOptions::default())
                .await?;
        }
        let queue = &queues[i % queues.len()];
        let consumer = ch
            .basic_consume(
                queue.as_str().into(),
                format!("warren-bench-{i}").as_str().into(),
                BasicConsumeOptions {
                    no_ack: opts.auto_ack,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await?;
        consumers.push((conn, ch, Some(consumer)));
    }
    let mut producers = Vec::new();
    for i in 0..opts.producers {
        let conn = connect(&opts.url, &format!("warren-bench producer {i}")).await?;
        let ch = conn.create_channel().await?;
        if opts.confirm > 0 {
            ch.confirm_select(ConfirmSelectOptions::default()).await?;
        }
        let routing_key = if opts.exchange.is_empty() || opts.exchange_type != ExchangeType::Fanout
        {
            queues[i % queues.len()].clone()
        } else {
            String::new()
        };
        producers.push((conn, ch, routing_key));
    }

    let held = match opts.hold_connections {
        Some(n) if n > 0 => Some(crate::idle::Held::open(&opts, n).await?),
        _ => None,
    };

    let (stop_tx, stop_rx) = watch::channel(false);
    let broker_pid = opts.broker_pid;
    let peak_reset = match broker_pid {
        Some(pid) if !opts.no_reset_peak => stats::reset_peak(pid),
        _ => false,
    };
    let broker_start = broker_pid.map(stats::sample).transpose()?;
    let client_start = stats::sample_self();
    let start = Instant::now();

    let cfg = Arc::new(opts.clone());
    let n_producers = producers.len() as u64;
    let mut producer_tasks = Vec::new();
    for (i, (_conn, ch, rk)) in producers.iter().enumerate() {
        let quota = opts
            .count
            .map(|c| c / n_producers + u64::from((i as u64) < c % n_producers));
        let keys = if cfg.spread && cfg.exchange_type != ExchangeType::Fanout {
            queues.clone()
        } else {
            vec![rk.clone()]
        };
        producer_tasks.push(tokio::spawn(producer(
            ch.clone(),
            cfg.clone(),
            keys,
            quota,
            shared.clone(),
            stop_rx.clone(),
            start,
        )));
    }
    let mut consumer_tasks = Vec::new();
    for (_conn, ch, consumer) in consumers.iter_mut() {
        consumer_tasks.push(tokio::spawn(consume(
            ch.clone(),
            // Every slot was filled when the consumers were set up, and is taken once here.
            consumer.take().expect("consumer"),
            cfg.clone(),
            shared.clone(),
            stop_rx.clone(),
            start,
        )));
    }

    // Supervise: progress once a second, stop on the deadline or when the count is reached.
    let deadline = opts.duration().map(|d| start + d);
    let expected = opts.count.map(|c| {
        if opts.producers == 0 {
            c
        } else {
            c * opts.fanout_factor()
        }
    });
    let idle_timeout = Duration::from_secs_f64(opts.idle_timeout);
    let mut progress = Progress::new(&shared, broker_pid, start, opts.confirm > 0);
    if opts.producers > 0 && opts.consumers > 0 {
        progress.show_backlog(opts.fanout_factor());
    }
    let mut last_consumed = 0;
    let mut last_change = Instant::now();
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
        if deadline.is_some_and(|d| now >= d) {
            break;
        }
        let producers_done = producer_tasks.iter().all(|t| t.is_finished());
        let consumed = shared.consumed.load(Relaxed);
        if consumed != last_consumed {
            last_consumed = consumed;
            last_change = now;
        }
        if producers_done && opts.duration.is_none() {
            if opts.consumers == 0 {
                break;
            }
            if expected.is_some_and(|e| consumed >= e) {
                break;
            }
            if now - last_change > idle_timeout {
                errors.push(format!(
                    "no message for {:.0}s: stopped with {consumed} of {} consumed",
                    opts.idle_timeout,
                    expected.unwrap_or(0)
                ));
                break;
            }
        }
        if deadline.is_some() && opts.producers > 0 && producers_done {
            // Producers only end early in a timed run when they failed.
            break;
        }
    }
    let _ = stop_tx.send(true);
    let end = Instant::now();
    let broker_end = match broker_pid.map(stats::sample) {
        Some(Err(e)) => {
            errors.push(format!("broker process: {e}"));
            None
        }
        other => other.and_then(Result::ok),
    };
    let client_end = stats::sample_self();
    if let Some(held) = held {
        let dropped = held.dropped();
        if dropped > 0 {
            errors.push(format!("{dropped} held connections ended during the run"));
        }
        held.release().await;
    }
    let queue_depth_end = if opts.producers > 0 {
        queue_depth(&admin_ch, &queues).await
    } else {
        None
    };

    let mut published = 0;
    let mut confirmed = 0;
    let mut nacked = 0;
    let mut skipped = 0;
    let mut confirm_hist = new_histogram();
    let mut publish_end = start;
    for t in producer_tasks {
        match t.await? {
            Ok(r) => {
                published += r.published;
                confirmed += r.confirmed;
                nacked += r.nacked;
                skipped += r.skipped;
                confirm_hist.add(&r.confirm_hist)?;
                publish_end = publish_end.max(r.end);
            }
            Err(e) => errors.push(format!("producer: {e}")),
        }
    }
    let mut consumed = 0;
    let mut hist = new_histogram();
    let mut consume_end = start;
    for t in consumer_tasks {
        let r = t.await?;
        if let Some(e) = r.error {
            errors.push(format!("consumer: {e}"));
        }
        consumed += r.consumed;
        hist.add(&r.hist)?;
        if let Some(last) = r.last {
            consume_end = consume_end.max(last);
        }
    }
    // In duration mode the interval is the duration; in count mode it ends with the last event.
    if opts.count.is_none() {
        publish_end = end;
        consume_end = end;
    }

    // Tear down: consumers, then the queues (which also relieves a broker that is throttling the
    // producers), then the producers. A broker that does not answer a close in time is left to
    // notice the closed socket when this process exits.
    close_all(consumers.iter().map(|(c, _, _)| c)).await;
    if opts.delete || (!opts.predeclare && !opts.no_consume && !opts.keep) {
        if let Err(e) = delete_topology(&opts, &admin_ch, &queues).await {
            errors.push(format!("cleanup: {e}"));
        }
    }
    close_all(producers.iter().map(|(c, _, _)| c)).await;
    let _ = admin.close(200, "bye".into()).await;

    let elapsed = (end - start).as_secs_f64();
    let publish_elapsed = (publish_end - start).as_secs_f64();
    let consume_elapsed = (consume_end - start).as_secs_f64();
    let broker = match (broker_pid, broker_start, broker_end) {
        (Some(pid), Some(s), Some(e)) => {
            let mut b = BrokerReport::new(pid, s, e, progress.rss_max_kb, elapsed, peak_reset);
            if consumed > 0 {
                b.set_per_msg(consumed, "consumed");
            } else {
                b.set_per_msg(published, "published");
            }
            b.set_per_published(published);
            Some(b)
        }
        _ => None,
    };
    let client_cpu = (client_end.cpu_s - client_start.cpu_s).max(0.0);
    let backlog_end = if opts.producers > 0 {
        (published * opts.fanout_factor()) as i64 - consumed as i64
    } else {
        0
    };
    Ok(RunReport {
        mode: "throughput",
        label: opts.label.clone(),
        elapsed_s: stats::round3(elapsed),
        published,
        publish_rate: rate(published, publish_elapsed),
        publish_elapsed_s: stats::round3(publish_elapsed),
        confirmed,
        nacked,
        rate_skipped: skipped,
        consumed,
        consume_rate: rate(consumed, consume_elapsed),
        consume_elapsed_s: stats::round3(consume_elapsed),
        backlog_end,
        backlog_growth_rate: if elapsed > 0.0 {
            stats::round1(backlog_end as f64 / elapsed)
        } else {
            0.0
        },
        queue_depth_end,
        latency: LatencySummary::from_histogram(&hist),
        confirm_latency: LatencySummary::from_histogram(&confirm_hist),
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

/// The ready messages over all `queues`, by passive declares; None if the broker does not answer
/// within 5 s (a broker busy with a flood of publishes may take a while).
pub(crate) async fn queue_depth(ch: &Channel, queues: &[String]) -> Option<u64> {
    let declares = queues.iter().map(|q| {
        ch.queue_declare(
            q.as_str().into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
    });
    let results = tokio::time::timeout(Duration::from_secs(5), join_all(declares))
        .await
        .ok()?;
    let mut depth = 0;
    for r in results {
        depth += u64::from(r.ok()?.message_count());
    }
    Some(depth)
}

/// Closes connections concurrently, giving up after a few seconds.
pub(crate) async fn close_all<'a>(conns: impl Iterator<Item = &'a Connection>) {
    let closes = conns.map(|c| c.close(200, "bye".into()));
    let _ = tokio::time::timeout(Duration::from_secs(3), join_all(closes)).await;
}

pub(crate) fn rate(n: u64, secs: f64) -> f64 {
    if secs > 0.0 {
        stats::round1(n as f64 / secs)
    } else {
        0.0
    }
}

fn exchange_kind(t: ExchangeType) -> ExchangeKind {
    match t {
        ExchangeType::Direct => ExchangeKind::Direct,
        ExchangeType::Fanout => ExchangeKind::Fanout,
        ExchangeType::Topic => ExchangeKind::Topic,
    }
}

async fn declare_topology(opts: &Opts, ch: &Channel, queues: &[String]) -> Result<(), BoxError> {
    if !opts.exchange.is_empty() {
        ch.exchange_declare(
            opts.exchange.as_str().into(),
            exchange_kind(opts.exchange_type),
            ExchangeDeclareOptions {
                durable: opts.durable,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    }
    let args = opts.queue_arguments();
    for q in queues {
        ch.queue_declare(
            q.as_str().into(),
            QueueDeclareOptions {
                durable: opts.durable,
                ..Default::default()
            },
            args.clone(),
        )
        .await?;
        // A queue left over from an interrupted run with the same name would skew the figures.
        if opts.producers > 0 {
            ch.queue_purge(q.as_str().into(), Default::default())
                .await?;
        }
        if !opts.exchange.is_empty() {
            ch.queue_bind(
                q.as_str().into(),
                opts.exchange.as_str().into(),
                q.as_str().into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
        }
    }
    Ok(())
}

async fn delete_topology(opts: &Opts, ch: &Channel, queues: &[String]) -> Result<(), BoxError> {
    for q in queues {
        ch.queue_delete(q.as_str().into(), QueueDeleteOptions::default())
            .await?;
    }
    if !opts.exchange.is_empty() {
        ch.exchange_delete(
            opts.exchange.as_str().into(),
            ExchangeDeleteOptions::default(),
        )
        .await?;
    }
    Ok(())
}

pub(crate) struct ConfirmResult {
    pub confirmed: u64,
    pub nacked: u64,
    pub hist: Histogram<u64>,
}

/// Awaits the confirms of one producer in publish order, records their latency and gives the
/// window back to the producer.
pub(crate) async fn confirm_task(
    mut rx: mpsc::UnboundedReceiver<(u64, Vec<PublisherConfirm>)>,
    window: Arc<Semaphore>,
    shared: Arc<Shared>,
) -> Result<ConfirmResult, BoxError> {
    let mut r = ConfirmResult {
        confirmed: 0,
        nacked: 0,
        hist: new_histogram(),
    };
    while let Some((sent_ns, confirms)) = rx.recv().await {
        let mut released = 0;
        for mut c in confirms {
            let result = match (&mut c).now_or_never() {
                Some(res) => res,
                None => {
                    // Give back what is done before waiting for more.
                    if released > 0 {
                        window.add_permits(released);
                        released = 0;
                    }
                    c.await
                }
            };
            match result? {
                Confirmation::Nack(_) => {
                    r.nacked += 1;
                    shared.nacked.fetch_add(1, Relaxed);
                }
                _ => {
                    r.confirmed += 1;
                    shared.confirmed.fetch_add(1, Relaxed);
                }
            }
            r.hist
                .saturating_record(now_ns().saturating_sub(sent_ns) / 1_000);
            released += 1;
        }
        window.add_permits(released);
    }
    Ok(r)
}

async fn producer(
    ch: Channel,
    opts: Arc<Opts>,
    routing_keys: Vec<String>,
    quota: Option<u64>,
    shared: Arc<Shared>,
    mut stop: watch::Receiver<bool>,
    start: Instant,
) -> Result<ProducerResult, BoxError> {
    let size = opts.size as usize;
    let props = if opts.persistent {
        BasicProperties::default().with_delivery_mode(2)
    } else {
        BasicProperties::default()
    };
    let exchange = ShortString::from(opts.exchange.as_str());
    let routing_keys: Vec<ShortString> = routing_keys
        .iter()
        .map(|k| ShortString::from(k.as_str()))
        .collect();
    let mut next_key = 0usize;
    // --groups: the names each message's group header takes, in turn.
    let group_header = ShortString::from(opts.group_header.as_str());
    let group_names: Vec<lapin::types::LongString> = (0..opts.groups)
        .map(|g| lapin::types::LongString::from(format!("g{g}")))
        .collect();
    let mut next_group = 0usize;
    let mut batch_max = opts.batch as u64;
    if opts.confirm > 0 {
        batch_max = batch_max.min(opts.confirm as u64);
    }
    // One reusable buffer holding a batch of bodies; lapin copies them into frames.
    let mut buf = vec![0u8; batch_max as usize * size];
    let confirms = (opts.confirm > 0).then(|| {
        let window = Arc::new(Semaphore::new(opts.confirm as usize));
        let (tx, rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(confirm_task(rx, window.clone(), shared.clone()));
        (window, tx, task)
    });
    let slice = Duration::from_secs_f64(opts.slice_ms / 1000.0);
    let mut limiter =
        (opts.rate > 0.0).then(|| RateLimiter::new(opts.rate, Duration::from_millis(100)));
    let mut sent = 0u64;
    let mut error = None;
    let fanout = opts.fanout_factor();
    let inflight_limit = if opts.consumers > 0 {
        opts.max_inflight
    } else {
        0
    };
    'outer: loop {
        if *stop.borrow() {
            break;
        }
        let remaining = quota.map_or(u64::MAX, |q| q - sent);
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
        if inflight_limit > 0 {
            // End-to-end back-pressure; checked once per batch, polled on the timer.
            while shared.published.load(Relaxed) * fanout
                > shared.consumed.load(Relaxed) + inflight_limit
            {
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(1)) => {}
                    _ = stop.changed() => break 'outer,
                }
            }
        }
        if let Some((window, _, _)) = &confirms {
            tokio::select! {
                permit = window.acquire_many(n as u32) => permit?.forget(),
                _ = stop.changed() => break,
            }
        }
        let ts = now_ns().to_le_bytes();
        let bodies = &mut buf[..n as usize * size];
        for body in bodies.chunks_exact_mut(size) {
            body[..8].copy_from_slice(&ts);
        }
        let publishes = bodies.chunks_exact(size).map(|body| {
            let key = routing_keys
                .get(next_key % routing_keys.len().max(1))
                .cloned()
                .unwrap_or_default();
            next_key = next_key.wrapping_add(1);
            let props = match group_names.get(next_group % group_names.len().max(1)) {
                Some(name) => {
                    next_group = next_group.wrapping_add(1);
                    let mut headers = FieldTable::default();
                    headers.insert(group_header.clone(), AMQPValue::LongString(name.clone()));
                    props.clone().with_headers(headers)
                }
                None => props.clone(),
            };
            ch.basic_publish(
                exchange.clone(),
                key,
                BasicPublishOptions::default(),
                body,
                props,
            )
        });
        // A broker applying flow control may not read the socket for a long time: do not let
        // that hold the end of the run (the frames of this batch are then left unsent).
        let results = tokio::select! {
            r = join_all(publishes) => r,
            _ = stop.changed() => break,
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
                    break 'outer;
                }
            }
        }
        if let Some((_, tx, _)) = &confirms {
            let _ = tx.send((u64::from_le_bytes(ts), pending));
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

/// A producer's confirm window, the sender of its pending confirms, and the task collecting them.
pub(crate) type Confirms = (
    Arc<Semaphore>,
    mpsc::UnboundedSender<(u64, Vec<PublisherConfirm>)>,
    tokio::task::JoinHandle<Result<ConfirmResult, BoxError>>,
);

/// The end of a producer: its outstanding confirms (waited for a little after a stop by
/// deadline, when they still arrive), its counts, or the error that stopped it.
pub(crate) async fn finish_producer(
    confirms: Option<Confirms>,
    stop: &watch::Receiver<bool>,
    sent: u64,
    skipped: u64,
    error: Option<BoxError>,
) -> Result<ProducerResult, BoxError> {
    let (mut confirmed, mut nacked, mut confirm_hist) = (0, 0, new_histogram());
    if let Some((_, tx, task)) = confirms {
        drop(tx);
        let waited = if *stop.borrow() {
            tokio::time::timeout(Duration::from_secs(5), task)
                .await
                .ok()
        } else {
            Some(task.await)
        };
        if let Some(r) = waited {
            let r = r??;
            confirmed = r.confirmed;
            nacked = r.nacked;
            confirm_hist = r.hist;
        }
    }
    if let Some(e) = error {
        return Err(e);
    }
    Ok(ProducerResult {
        published: sent,
        confirmed,
        nacked,
        skipped,
        confirm_hist,
        end: Instant::now(),
    })
}

async fn consume(
    ch: Channel,
    mut consumer: Consumer,
    opts: Arc<Opts>,
    shared: Arc<Shared>,
    mut stop: watch::Receiver<bool>,
    start: Instant,
) -> ConsumerResult {
    let mut hist = new_histogram();
    let every = opts.multi_ack_every as u64;
    let multiple = every > 1;
    let mut consumed = 0u64;
    let mut unacked = 0u64;
    let mut last_tag = 0;
    let mut last = None;
    let mut error = None;
    // A slow worker takes the next delivery only once it is due (the producer's limiter, reused:
    // woken once per slice, and a stall of more than 100 ms is not caught up with a burst).
    let slice = Duration::from_secs_f64(opts.slice_ms / 1000.0);
    let mut limiter = (opts.consume_rate > 0.0)
        .then(|| RateLimiter::new(opts.consume_rate, Duration::from_millis(100)));
    loop {
        if let Some(rl) = limiter.as_mut() {
            let elapsed = start.elapsed();
            if rl.due(elapsed) == 0 {
                let wake = start + rl.next_wake(elapsed, slice);
                tokio::select! {
                    biased;
                    _ = stop.changed() => break,
                    _ = tokio::time::sleep_until(wake.into()) => {}
                }
                continue;
            }
            rl.sent(1);
        }
        let delivery = tokio::select! {
            biased;
            _ = stop.changed() => break,
            d = consumer.next() => d,
        };
        let delivery = match delivery {
            Some(Ok(d)) => d,
            _ => break,
        };
        let now = now_ns();
        let lat_us = match delivery
            .data
            .get(..8)
            .and_then(|ts| <[u8; 8]>::try_from(ts).ok())
        {
            Some(ts) => now.saturating_sub(u64::from_le_bytes(ts)) / 1_000,
            None => 0,
        };
        hist.saturating_record(lat_us);
        consumed += 1;
        last = Some(Instant::now());
        shared.consumed.fetch_add(1, Relaxed);
        shared.lat_sum_us.fetch_add(lat_us, Relaxed);
        shared.lat_n.fetch_add(1, Relaxed);
        shared.lat_max_us.fetch_max(lat_us, Relaxed);
        if opts.ack_wait {
            // What is awaited (lapin 4.12): `Channel::basic_ack` queues the ack frame and returns
            // a promise that lapin's I/O thread resolves in `IoLoop::write_to_stream` once the
            // socket's write has taken every byte of that frame, that is once the ack has been
            // handed to the kernel (not when the broker has read it: basic.ack has no reply).
            // So each ack costs its own write(2) and a wake-up of this task, as in a pika or
            // Celery worker, and is never merged with the next message's ack.
            let ack = ch.basic_ack(delivery.delivery_tag, BasicAckOptions { multiple: false });
            tokio::select! {
                biased;
                r = ack => if let Err(e) = r {
                    error = Some(format!("ack: {e}"));
                    break;
                },
                _ = stop.changed() => break,
            }
        } else if !opts.auto_ack {
            unacked += 1;
            last_tag = delivery.delivery_tag;
            if unacked >= every {
                // The ack frame is queued on the first poll; not waiting for lapin's I/O thread
                // to write it lets the next delivery be handled at once (and lapin writes the
                // acks queued meanwhile together).
                let _ = ch
                    .basic_ack(last_tag, BasicAckOptions { multiple })
                    .now_or_never();
                unacked = 0;
            }
        }
    }
    if unacked > 0 {
        let _ = ch
            .basic_ack(last_tag, BasicAckOptions { multiple: true })
            .await;
    }
    ConsumerResult {
        consumed,
        hist,
        last,
        error,
    }
}

/// The once-a-second progress line on stderr, and RSS sampling for the peak.
pub struct Progress {
    shared: Arc<Shared>,
    pid: Option<u32>,
    start: Instant,
    next: Instant,
    last: Instant,
    last_pub: u64,
    last_conf: u64,
    last_cons: u64,
    last_cpu: Option<ProcSample>,
    confirms: bool,
    /// Show the backlog (published times this fanout factor, minus consumed).
    backlog_fanout: Option<u64>,
    pub rss_max_kb: u64,
}

impl Progress {
    pub fn new(shared: &Arc<Shared>, pid: Option<u32>, start: Instant, confirms: bool) -> Self {
        let last_cpu = pid.and_then(|p| stats::sample(p).ok());
        Self {
            shared: shared.clone(),
            pid,
            start,
            next: start + Duration::from_secs(1),
            last: start,
            last_pub: 0,
            last_conf: 0,
            last_cons: 0,
            rss_max_kb: last_cpu.map_or(0, |s| s.rss_kb),
            last_cpu,
            confirms,
            backlog_fanout: None,
        }
    }

    pub fn show_backlog(&mut self, fanout: u64) {
        self.backlog_fanout = Some(fanout);
    }

    pub fn maybe_print(&mut self, now: Instant, quiet: bool) {
        if now < self.next {
            return;
        }
        self.next += Duration::from_secs(1);
        let secs = (now - self.last).as_secs_f64();
        self.last = now;
        let s = &self.shared;
        let (p, c, k) = (
            s.published.load(Relaxed),
            s.confirmed.load(Relaxed),
            s.consumed.load(Relaxed),
        );
        let lat_n = s.lat_n.swap(0, Relaxed);
        let lat_sum = s.lat_sum_us.swap(0, Relaxed);
        let lat_max = s.lat_max_us.swap(0, Relaxed);
        let mut line = format!(
            "{:>5.0}s  pub {:>7.0}/s",
            (now - self.start).as_secs_f64(),
            (p - self.last_pub) as f64 / secs,
        );
        if self.confirms {
            line += &format!("  conf {:>7.0}/s", (c - self.last_conf) as f64 / secs);
        }
        line += &format!("  cons {:>7.0}/s", (k - self.last_cons) as f64 / secs);
        if let Some(fanout) = self.backlog_fanout {
            line += &format!("  backlog {:>8}", (p * fanout) as i64 - k as i64);
        }
        if let Some(avg) = lat_sum.checked_div(lat_n) {
            line += &format!(
                "  lat avg {} max {}",
                stats::fmt_us(avg),
                stats::fmt_us(lat_max)
            );
        }
        (self.last_pub, self.last_conf, self.last_cons) = (p, c, k);
        if let Some(pid) = self.pid {
            if let Ok(sample) = stats::sample(pid) {
                self.rss_max_kb = self.rss_max_kb.max(sample.rss_kb);
                if let Some(prev) = self.last_cpu {
                    line += &format!(
                        "  broker cpu {:>3.0}% rss {} MiB",
                        (sample.cpu_s - prev.cpu_s) / secs * 100.0,
                        sample.rss_kb / 1024
                    );
                }
                self.last_cpu = Some(sample);
            }
        }
        if !quiet {
            eprintln!("{line}");
        }
    }
}
