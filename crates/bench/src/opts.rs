//! Command-line options, in the spirit of RabbitMQ's PerfTest.

use std::time::Duration;

use clap::{Parser, ValueEnum};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use serde::Serialize;

/// AMQP 0-9-1 load generator: publish, consume and measure any broker (Warren or RabbitMQ).
///
/// Producers and consumers run in this one process, so the first 8 bytes of every body carry the
/// publish time and the consumer measures end-to-end latency. With --broker-pid the broker's CPU
/// time and memory are read from /proc at the start and the end of the run.
#[derive(Parser, Debug, Clone, Serialize)]
#[command(name = "warren-bench", version, about, long_about)]
pub struct Opts {
    /// Broker URL (vhost "/" is %2f).
    #[arg(
        long,
        short = 'u',
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    #[serde(skip)]
    pub url: String,

    /// Number of producers; each has its own connection and channel.
    #[arg(long, short = 'x', default_value_t = 1)]
    pub producers: usize,

    /// Number of consumers; each has its own connection and channel.
    /// Consumer i consumes queue i modulo --queues.
    #[arg(long, short = 'y', default_value_t = 1)]
    pub consumers: usize,

    /// Number of queues. Producer i publishes to queue i modulo --queues (or to --exchange).
    #[arg(long, default_value_t = 1)]
    pub queues: usize,

    /// Queue name pattern; %d is replaced by the queue number (1-based). The default holds this
    /// process's pid so that concurrent runs never share a queue.
    #[arg(long)]
    pub queue_pattern: Option<String>,

    /// Exchange to publish to ("" = the default exchange, routing key = queue name). A named
    /// exchange is declared and every queue is bound to it with its own name as the binding key.
    #[arg(long, short = 'e', default_value = "")]
    pub exchange: String,

    /// Type of --exchange. With fanout every message goes to every queue.
    #[arg(long, short = 't', value_enum, default_value_t = ExchangeType::Direct)]
    pub exchange_type: ExchangeType,

    /// Message body size in bytes (at least 8: the first 8 bytes carry the publish timestamp).
    #[arg(long, short = 's', default_value_t = 16, value_parser = clap::value_parser!(u32).range(8..))]
    pub size: u32,

    /// Publish persistent messages (delivery-mode 2).
    #[arg(long, short = 'f')]
    pub persistent: bool,

    /// Message groups: each message carries the header --group-header set to one of this many
    /// group names, in turn (0 = no header). Declare the queue with x-group-header naming it.
    #[arg(long, default_value_t = 0)]
    pub groups: u32,

    /// The header that names a message's group (with --groups).
    #[arg(long, default_value = "x-group-id")]
    pub group_header: String,

    /// Declare durable queues (and exchange).
    #[arg(long)]
    pub durable: bool,

    /// Publisher confirms with at most this many unconfirmed messages per producer (0 = off).
    #[arg(long, short = 'c', default_value_t = 0)]
    pub confirm: u32,

    /// Consumer prefetch (basic.qos per consumer; 0 = unlimited).
    #[arg(long, short = 'q', default_value_t = 200)]
    pub prefetch: u16,

    /// Acknowledge every N messages with multiple=true (1 = ack each message on its own).
    #[arg(long, short = 'A', default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub multi_ack_every: u32,

    /// Consume with no-ack (auto-ack): the broker forgets a message once it is sent.
    #[arg(long, short = 'a', conflicts_with_all = ["ack_wait", "ack_batched"])]
    pub auto_ack: bool,

    /// Worker-style consumer (the default), as a pika or Celery worker acks: ack each message
    /// on its own and wait until the ack has been written to the socket before taking the next
    /// delivery (one write per ack). Accepted for scripts written when it was not the default.
    #[arg(long, conflicts_with = "ack_batched")]
    pub ack_wait: bool,

    /// Batched acks, the flattering shape: acks are queued without waiting, so lapin writes
    /// many of them at once (also implied by --multi-ack-every above 1). Real workers rarely
    /// consume this way; measure it beside the default, not instead of it.
    #[arg(long)]
    pub ack_batched: bool,

    /// Consume at most this many messages per second PER CONSUMER (0 = as fast as they arrive):
    /// a slow worker. With an unthrottled producer the queue then grows for the whole run.
    #[arg(long, default_value_t = 0.0)]
    pub consume_rate: f64,

    /// Publish rate limit in messages per second PER PRODUCER (0 = as fast as possible).
    /// The total offered rate is --rate times --producers.
    #[arg(long, short = 'r', default_value_t = 0.0)]
    pub rate: f64,

    /// Hold the producers back while more than this many messages are in flight (published but
    /// not yet consumed, counting each fanout copy), so that an unthrottled run measures the
    /// sustainable rate instead of a queue that grows for the whole run (0 = no limit).
    #[arg(long, default_value_t = 0)]
    pub max_inflight: u64,

    /// Run for this many seconds (fractions allowed). Default 10 unless --count is given.
    #[arg(long, short = 'z')]
    pub duration: Option<f64>,

    /// Publish this many messages in total (split evenly over producers), then wait until the
    /// consumers have received all of them (times the queue count for a fanout exchange). With
    /// --producers 0 the consumers stop after receiving this many.
    #[arg(long, short = 'C')]
    pub count: Option<u64>,

    /// Queue argument k=v, repeatable (x-max-length=1000, x-queue-type=quorum). Integers are sent
    /// as signed 64-bit, true/false as booleans, anything else as a string.
    #[arg(long = "queue-arg", value_name = "K=V", value_parser = parse_queue_arg)]
    pub queue_args: Vec<(String, QueueArgValue)>,

    /// The queues (and exchange) already exist: do not declare, bind or delete them.
    #[arg(long)]
    pub predeclare: bool,

    /// Every producer publishes to every queue in turn (routing key = queue name), instead of
    /// producer i to queue i: fills many queues from a few producers.
    #[arg(long)]
    pub spread: bool,

    /// Do not start consumers and keep the queues at the end (publish a backlog for a later
    /// --predeclare run to drain).
    #[arg(long)]
    pub no_consume: bool,

    /// Do not delete the queues and exchange at the end.
    #[arg(long)]
    pub keep: bool,

    /// Idle-queues mode: declare N queues, wait --settle seconds, report the declare rate and the
    /// broker's memory per queue, then delete them.
    #[arg(long, value_name = "N", conflicts_with = "idle_connections")]
    pub idle_queues: Option<u64>,

    /// Idle-connections mode: open N connections with one channel each, wait --settle seconds,
    /// report the open rate and the broker's memory per connection, then close them.
    #[arg(long, value_name = "N")]
    pub idle_connections: Option<u64>,

    /// Holds N more connections open (one channel each, idle, answering heartbeats) for the
    /// whole run, opened before the timed part starts: many connected clients of which few are
    /// busy. Their connections count in no figure but the broker's CPU and memory.
    #[arg(long, value_name = "N", conflicts_with_all = ["idle_queues", "idle_connections", "delayed_schedule", "delayed_rate"])]
    pub hold_connections: Option<u64>,

    /// Delayed-schedule mode: publish N messages (split over --producers) to an
    /// x-delayed-message exchange (--exchange, default warren-bench-delayed; x-delayed-type =
    /// --exchange-type) bound to one queue, each with an x-delay of --delay-ms plus a uniformly
    /// random 0..--delay-spread-ms (default 1 to 2 hours: none falls due during the run). Reports
    /// the publish rate and the broker's RSS after publishing and after --settle seconds. The
    /// exchange, the queue and the scheduled messages are kept (--delete removes the first two).
    #[arg(long, value_name = "N", conflicts_with_all = ["idle_queues", "idle_connections", "delayed_rate"])]
    pub delayed_schedule: Option<u64>,

    /// Delayed-lateness mode: publish R msg/s in total (split over --producers) with an x-delay
    /// of --delay-ms (default 2,000) for --duration seconds to an x-delayed-message exchange,
    /// while one consumer with acks receives them. Each body carries its due time (ms since the
    /// Unix epoch: publish time + x-delay) and a sequence number; reports the lateness (receive
    /// time minus due time), early deliveries, duplicates and messages lost.
    #[arg(long, value_name = "R", conflicts_with_all = ["idle_queues", "idle_connections"])]
    pub delayed_rate: Option<f64>,

    /// Delayed modes: the x-delay of each message, in milliseconds (default 3,600,000 with
    /// --delayed-schedule, 2,000 with --delayed-rate).
    #[arg(long, value_name = "MS")]
    pub delay_ms: Option<u64>,

    /// Delayed modes: add a uniformly random 0..MS to each message's delay (default 3,600,000
    /// with --delayed-schedule, 0 with --delayed-rate).
    #[arg(long, value_name = "MS")]
    pub delay_spread_ms: Option<u64>,

    /// Idle modes: how many declares or connection opens run concurrently.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub parallel: u32,

    /// Idle modes and --delayed-schedule: seconds to wait before the final memory reading.
    #[arg(long, default_value_t = 3.0)]
    pub settle: f64,

    /// Idle modes: before the first reading, wait up to this many seconds for the broker's RSS
    /// to stop moving (memory given back after an earlier run would skew the per-item figure).
    #[arg(long, default_value_t = 30.0)]
    pub quiesce: f64,

    /// Delete the queues (and exchange) at the end even with --predeclare or --no-consume
    /// (the drain half of a backlog run).
    #[arg(long, conflicts_with = "keep")]
    pub delete: bool,

    /// Broker process id: report its CPU time (utime+stime) and memory (VmRSS, VmHWM).
    #[arg(long, short = 'p')]
    pub broker_pid: Option<u32>,

    /// Do not reset the broker's peak RSS (VmHWM) at the start (resetting needs write access to
    /// /proc/<pid>/clear_refs; without it the peak is the process's lifetime peak).
    #[arg(long)]
    pub no_reset_peak: bool,

    /// Print the result as one JSON object on stdout instead of the one-line summary.
    #[arg(long)]
    pub json: bool,

    /// No progress line on stderr.
    #[arg(long)]
    pub quiet: bool,

    /// Free-form label copied into the JSON output.
    #[arg(long)]
    pub label: Option<String>,

    /// Messages per publish batch when not rate limited (bounded by --confirm).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
    pub batch: u32,

    /// Rate limiter time slice in milliseconds: a producer wakes at most once per slice and sends
    /// what is due.
    #[arg(long, default_value_t = 1.0)]
    pub slice_ms: f64,

    /// Count mode: give up when no message arrives for this many seconds.
    #[arg(long, default_value_t = 30.0)]
    pub idle_timeout: f64,

    /// Tokio worker threads (lapin adds one I/O thread per connection).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub threads: u32,
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ExchangeType {
    Direct,
    Fanout,
    Topic,
}

/// A typed queue argument value.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum QueueArgValue {
    Int(i64),
    Bool(bool),
    Str(String),
}

pub fn parse_queue_arg(s: &str) -> Result<(String, QueueArgValue), String> {
    let (k, v) = s
        .split_once('=')
        .ok_or_else(|| format!("expected K=V, got {s:?}"))?;
    if k.is_empty() {
        return Err(format!("empty argument name in {s:?}"));
    }
    let value = if let Ok(i) = v.parse::<i64>() {
        QueueArgValue::Int(i)
    } else if v == "true" || v == "false" {
        QueueArgValue::Bool(v == "true")
    } else {
        QueueArgValue::Str(v.to_string())
    };
    Ok((k.to_string(), value))
}

/// What a run does, decided from the options.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Throughput,
    IdleQueues(u64),
    IdleConnections(u64),
    /// Schedule this many delayed messages.
    DelayedSchedule(u64),
    /// Delayed messages at --delayed-rate: their lateness.
    DelayedRate,
}

/// The exchange of the delayed modes when --exchange is not given.
pub const DEFAULT_DELAYED_EXCHANGE: &str = "warren-bench-delayed";

impl Opts {
    pub fn mode(&self) -> Mode {
        if let Some(n) = self.idle_queues {
            Mode::IdleQueues(n)
        } else if let Some(n) = self.idle_connections {
            Mode::IdleConnections(n)
        } else if let Some(n) = self.delayed_schedule {
            Mode::DelayedSchedule(n)
        } else if self.delayed_rate.is_some() {
            Mode::DelayedRate
        } else {
            Mode::Throughput
        }
    }

    /// Delayed modes: the x-delay before the random spread, in ms.
    pub fn delay_base_ms(&self) -> u64 {
        self.delay_ms.unwrap_or(match self.mode() {
            Mode::DelayedSchedule(_) => 3_600_000,
            _ => 2_000,
        })
    }

    /// Delayed modes: the width of the uniformly random part of the delay, in ms.
    pub fn delay_spread(&self) -> u64 {
        self.delay_spread_ms.unwrap_or(match self.mode() {
            Mode::DelayedSchedule(_) => 3_600_000,
            _ => 0,
        })
    }

    /// Delayed modes: the exchange (--exchange, or a default name).
    pub fn delayed_exchange(&self) -> &str {
        if self.exchange.is_empty() {
            DEFAULT_DELAYED_EXCHANGE
        } else {
            &self.exchange
        }
    }

    fn validate_delayed(&mut self) -> Result<(), String> {
        if let Some(r) = self.delayed_rate {
            if r <= 0.0 || !r.is_finite() {
                return Err("--delayed-rate must be > 0".into());
            }
            if self.duration.is_none() {
                self.duration = Some(10.0);
            }
        }
        if self.size < 16 {
            return Err(
                "delayed modes need --size >= 16 (the body carries its due time and a sequence number)"
                    .into(),
            );
        }
        if self.producers == 0 {
            return Err("delayed modes need at least one producer".into());
        }
        if self.delay_base_ms() == 0 {
            return Err("--delay-ms must be >= 1 (an x-delay of 0 does not delay)".into());
        }
        match self.delay_base_ms().checked_add(self.delay_spread()) {
            Some(max) if max <= i64::MAX as u64 => Ok(()),
            _ => Err("--delay-ms plus --delay-spread-ms is too large".into()),
        }
    }

    /// Checks combinations that clap cannot express.
    pub fn validate(&mut self) -> Result<(), String> {
        if self.rate < 0.0 || !self.rate.is_finite() {
            return Err("--rate must be >= 0".into());
        }
        if self.consume_rate < 0.0 || !self.consume_rate.is_finite() {
            return Err("--consume-rate must be >= 0".into());
        }
        if self.slice_ms <= 0.0 {
            return Err("--slice-ms must be > 0".into());
        }
        if let Some(d) = self.duration {
            if d <= 0.0 || !d.is_finite() {
                return Err("--duration must be > 0".into());
            }
        }
        match self.mode() {
            Mode::Throughput => {}
            Mode::DelayedSchedule(_) | Mode::DelayedRate => return self.validate_delayed(),
            Mode::IdleQueues(_) | Mode::IdleConnections(_) => return Ok(()),
        }
        if self.queues == 0 {
            return Err("--queues must be >= 1".into());
        }
        if self.no_consume {
            self.consumers = 0;
        }
        if self.producers == 0 && self.consumers == 0 {
            return Err("nothing to do: no producers and no consumers".into());
        }
        if self.producers == 0 && self.count.is_none() && self.duration.is_none() {
            return Err("--producers 0 needs --count or --duration".into());
        }
        if self.duration.is_none() && self.count.is_none() {
            self.duration = Some(10.0);
        }
        if !self.auto_ack && self.prefetch > 0 && self.multi_ack_every > u32::from(self.prefetch) {
            return Err(format!(
                "--multi-ack-every {} exceeds --prefetch {}: the consumer would stall",
                self.multi_ack_every, self.prefetch
            ));
        }
        if self.ack_wait && self.multi_ack_every > 1 {
            return Err("--ack-wait acks each message on its own: drop --multi-ack-every".into());
        }
        // The worker shape unless the consumer was asked for another.
        self.ack_wait = !self.auto_ack && !self.ack_batched && self.multi_ack_every == 1;
        if self.exchange.is_empty() && self.exchange_type != ExchangeType::Direct {
            return Err("--exchange-type needs a named --exchange".into());
        }
        Ok(())
    }

    pub fn queue_name(&self, index: usize) -> String {
        let default;
        let pattern = match &self.queue_pattern {
            Some(p) => p.as_str(),
            None => {
                default = format!("warren-bench-{}-%d", std::process::id());
                default.as_str()
            }
        };
        expand_pattern(pattern, index + 1)
    }

    pub fn queue_names(&self, n: usize) -> Vec<String> {
        (0..n).map(|i| self.queue_name(i)).collect()
    }

    pub fn queue_arguments(&self) -> FieldTable {
        let mut table = FieldTable::default();
        for (k, v) in &self.queue_args {
            let value = match v {
                QueueArgValue::Int(i) => AMQPValue::LongLongInt(*i),
                QueueArgValue::Bool(b) => AMQPValue::Boolean(*b),
                QueueArgValue::Str(s) => AMQPValue::LongString(LongString::from(s.as_str())),
            };
            table.insert(ShortString::from(k.as_str()), value);
        }
        table
    }

    /// How many copies of each published message the consumers receive in total.
    pub fn fanout_factor(&self) -> u64 {
        if !self.exchange.is_empty() && self.exchange_type == ExchangeType::Fanout {
            self.queues as u64
        } else {
            1
        }
    }

    pub fn duration(&self) -> Option<Duration> {
        self.duration.map(Duration::from_secs_f64)
    }
}

/// Replaces every `%d` in `pattern` with `n`; a pattern without `%d` gets `-n` appended when
/// `n > 1` would otherwise collide.
pub fn expand_pattern(pattern: &str, n: usize) -> String {
    if pattern.contains("%d") {
        pattern.replace("%d", &n.to_string())
    } else if n == 1 {
        pattern.to_string()
    } else {
        format!("{pattern}-{n}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Opts, String> {
        let mut v = vec!["warren-bench"];
        v.extend_from_slice(args);
        let mut o = Opts::try_parse_from(v).map_err(|e| e.to_string())?;
        o.validate()?;
        Ok(o)
    }

    #[test]
    fn defaults() {
        let o = parse(&[]).unwrap();
        assert_eq!(o.producers, 1);
        assert_eq!(o.consumers, 1);
        assert_eq!(o.size, 16);
        assert_eq!(o.prefetch, 200);
        assert_eq!(o.duration, Some(10.0));
        assert_eq!(o.mode(), Mode::Throughput);
        assert_eq!(o.fanout_factor(), 1);
        assert!(o.queue_name(0).starts_with("warren-bench-"));
    }

    #[test]
    fn perftest_like_flags() {
        let o = parse(&[
            "-x",
            "2",
            "-y",
            "3",
            "--queues",
            "4",
            "--queue-pattern",
            "bench-%d",
            "-s",
            "1024",
            "--persistent",
            "--durable",
            "--confirm",
            "1000",
            "-q",
            "500",
            "--multi-ack-every",
            "100",
            "--rate",
            "5000",
            "-C",
            "1000",
            "--queue-arg",
            "x-max-length=10",
            "--queue-arg",
            "x-queue-type=quorum",
            "--queue-arg",
            "x-single-active-consumer=true",
        ])
        .unwrap();
        assert_eq!((o.producers, o.consumers, o.queues), (2, 3, 4));
        assert_eq!(o.queue_names(2), vec!["bench-1", "bench-2"]);
        assert!(o.persistent && o.durable);
        assert_eq!(o.confirm, 1000);
        assert_eq!(o.multi_ack_every, 100);
        assert_eq!(o.rate, 5000.0);
        assert_eq!(o.count, Some(1000));
        assert_eq!(o.duration, None);
        assert_eq!(
            o.queue_args,
            vec![
                ("x-max-length".into(), QueueArgValue::Int(10)),
                ("x-queue-type".into(), QueueArgValue::Str("quorum".into())),
                ("x-single-active-consumer".into(), QueueArgValue::Bool(true)),
            ]
        );
        let table = o.queue_arguments();
        assert_eq!(
            table.inner().get("x-max-length"),
            Some(&AMQPValue::LongLongInt(10))
        );
    }

    #[test]
    fn fanout_and_modes() {
        let o = parse(&["-e", "fan", "-t", "fanout", "--queues", "10", "-y", "10"]).unwrap();
        assert_eq!(o.fanout_factor(), 10);
        let o = parse(&["--idle-queues", "10000"]).unwrap();
        assert_eq!(o.mode(), Mode::IdleQueues(10000));
        let o = parse(&["--idle-connections", "1000", "--parallel", "8"]).unwrap();
        assert_eq!(o.mode(), Mode::IdleConnections(1000));
        let o = parse(&["--no-consume", "-C", "100"]).unwrap();
        assert_eq!(o.consumers, 0);
        let o = parse(&["--ack-wait", "--consume-rate", "5000"]).unwrap();
        assert!(o.ack_wait);
        assert_eq!(o.consume_rate, 5000.0);
        // The worker shape is the default; batched acks only when asked for.
        assert!(parse(&[]).unwrap().ack_wait);
        assert!(!parse(&["--ack-batched"]).unwrap().ack_wait);
        assert!(!parse(&["--multi-ack-every", "10"]).unwrap().ack_wait);
        assert!(!parse(&["--auto-ack"]).unwrap().ack_wait);
    }

    #[test]
    fn rejects_bad_combinations() {
        assert!(parse(&["-s", "4"]).is_err());
        assert!(parse(&["-q", "10", "--multi-ack-every", "20"]).is_err());
        assert!(parse(&["-t", "fanout"]).is_err());
        assert!(parse(&["-x", "0", "-y", "0"]).is_err());
        assert!(parse(&["--queue-arg", "novalue"]).is_err());
        assert!(parse(&["--rate", "-5"]).is_err());
        assert!(parse(&["--consume-rate", "-5"]).is_err());
        assert!(parse(&["--ack-wait", "--auto-ack"]).is_err());
        assert!(parse(&["--ack-wait", "--multi-ack-every", "10"]).is_err());
        assert!(parse(&["--ack-wait", "--ack-batched"]).is_err());
        assert!(parse(&["--idle-queues", "1", "--idle-connections", "1"]).is_err());
        assert!(parse(&["--delayed-schedule", "1", "--delayed-rate", "10"]).is_err());
        assert!(parse(&["--delayed-schedule", "1", "--idle-queues", "1"]).is_err());
        assert!(parse(&["--delayed-rate", "0"]).is_err());
        assert!(parse(&["--delayed-rate", "10", "-s", "8"]).is_err());
        assert!(parse(&["--delayed-rate", "10", "--delay-ms", "0"]).is_err());
        assert!(parse(&["--delayed-schedule", "10", "-x", "0"]).is_err());
    }

    #[test]
    fn delayed_modes() {
        let o = parse(&["--delayed-schedule", "10000000"]).unwrap();
        assert_eq!(o.mode(), Mode::DelayedSchedule(10_000_000));
        assert_eq!(
            (o.delay_base_ms(), o.delay_spread()),
            (3_600_000, 3_600_000)
        );
        assert_eq!(o.delayed_exchange(), DEFAULT_DELAYED_EXCHANGE);
        let o = parse(&["--delayed-rate", "10000", "--delay-ms", "2000", "-z", "60"]).unwrap();
        assert_eq!(o.mode(), Mode::DelayedRate);
        assert_eq!((o.delay_base_ms(), o.delay_spread()), (2000, 0));
        assert_eq!(o.duration, Some(60.0));
        let o = parse(&[
            "--delayed-rate",
            "5",
            "-e",
            "later",
            "--delay-spread-ms",
            "10",
        ])
        .unwrap();
        assert_eq!(o.duration, Some(10.0));
        assert_eq!((o.delayed_exchange(), o.delay_spread()), ("later", 10));
    }

    #[test]
    fn pattern_expansion() {
        assert_eq!(expand_pattern("q-%d", 7), "q-7");
        assert_eq!(expand_pattern("q", 1), "q");
        assert_eq!(expand_pattern("q", 2), "q-2");
    }
}
