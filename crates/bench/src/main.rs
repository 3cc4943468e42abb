//! `warren-bench`: an AMQP 0-9-1 load generator for comparing Warren with RabbitMQ.

mod delayed;
mod idle;
mod opts;
mod rate;
mod rawconn;
mod run;
mod stats;

use clap::Parser;

use crate::delayed::{LatenessReport, ScheduleReport};
use crate::idle::IdleReport;
use crate::opts::{Mode, Opts};
use crate::run::{BoxError, RunReport};
use crate::stats::fmt_us;

fn main() {
    let mut opts = Opts::parse();
    if let Err(e) = opts.validate() {
        eprintln!("warren-bench: {e}");
        std::process::exit(2);
    }
    if let Some(pid) = opts.broker_pid {
        if let Err(e) = stats::sample(pid) {
            eprintln!("warren-bench: cannot read /proc/{pid}: {e}");
            std::process::exit(2);
        }
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(opts.threads as usize)
        .enable_all()
        .build()
        // The load generator cannot run without its runtime (only fails if the OS refuses threads).
        .expect("tokio runtime");
    match runtime.block_on(run_mode(opts)) {
        Ok(ok) => std::process::exit(if ok { 0 } else { 1 }),
        Err(e) => {
            eprintln!("warren-bench: {e}");
            std::process::exit(1);
        }
    }
}

/// Runs the selected mode and prints the result; returns whether the run was clean.
async fn run_mode(opts: Opts) -> Result<bool, BoxError> {
    let json = opts.json;
    match opts.mode() {
        Mode::Throughput => {
            let r = run::run(opts).await?;
            print(json, &r, summary_run(&r))?;
            Ok(r.errors.is_empty())
        }
        Mode::IdleQueues(n) => {
            let r = idle::idle_queues(opts, n).await?;
            print(json, &r, summary_idle(&r, "queues", "queue"))?;
            Ok(r.errors.is_empty())
        }
        Mode::IdleConnections(n) => {
            let r = idle::idle_connections(opts, n).await?;
            print(json, &r, summary_idle(&r, "connections", "connection"))?;
            Ok(r.errors.is_empty())
        }
        Mode::DelayedSchedule(n) => {
            let r = delayed::schedule(opts, n).await?;
            print(json, &r, summary_schedule(&r))?;
            Ok(r.errors.is_empty())
        }
        Mode::DelayedRate => {
            let rate = opts.delayed_rate.unwrap_or(0.0);
            let r = delayed::lateness(opts, rate).await?;
            print(json, &r, summary_lateness(&r))?;
            Ok(r.errors.is_empty())
        }
    }
}

fn print<T: serde::Serialize>(json: bool, report: &T, summary: String) -> Result<(), BoxError> {
    if json {
        println!("{}", serde_json::to_string(report)?);
    } else {
        println!("{summary}");
    }
    Ok(())
}

fn summary_run(r: &RunReport) -> String {
    let mut s = format!(
        "{:.1}s: published {} ({:.0}/s), consumed {} ({:.0}/s)",
        r.elapsed_s, r.published, r.publish_rate, r.consumed, r.consume_rate
    );
    if let Some(l) = &r.latency {
        s += &format!(
            " | latency p50 {} p95 {} p99 {} max {}",
            fmt_us(l.p50_us),
            fmt_us(l.p95_us),
            fmt_us(l.p99_us),
            fmt_us(l.max_us)
        );
    }
    if let Some(l) = &r.confirm_latency {
        s += &format!(
            " | confirm p50 {} p99 {} max {}",
            fmt_us(l.p50_us),
            fmt_us(l.p99_us),
            fmt_us(l.max_us)
        );
    }
    if r.config.producers > 0 && r.config.consumers > 0 && r.config.max_inflight == 0 {
        s += &format!(
            " | backlog {} ({:+.0}/s)",
            r.backlog_end, r.backlog_growth_rate
        );
        if let Some(d) = r.queue_depth_end {
            s += &format!(", {d} ready on the broker");
        }
    }
    if r.nacked > 0 {
        s += &format!(" | {} nacked", r.nacked);
    }
    if r.rate_skipped > 0 {
        s += &format!(" | {} behind rate", r.rate_skipped);
    }
    broker_and_errors(&mut s, r.broker.as_ref(), r.client_cpu_pct, &r.errors);
    s
}

/// The end of a run's summary line: the broker's CPU and memory, the client's CPU, the errors.
fn broker_and_errors(
    s: &mut String,
    broker: Option<&stats::BrokerReport>,
    client_cpu_pct: f64,
    errors: &[String],
) {
    if let Some(b) = broker {
        *s += &format!(" | broker cpu {:.2}s ({:.0}%)", b.cpu_s, b.cpu_pct);
        if let Some(us) = b.cpu_us_per_msg {
            *s += &format!(" {us:.1}us/msg");
        }
        *s += &format!(
            " rss {}->{} MiB peak {} MiB",
            b.rss_start_kb / 1024,
            b.rss_end_kb / 1024,
            b.rss_peak_kb / 1024
        );
    }
    *s += &format!(" | client cpu {:.0}%", client_cpu_pct);
    for e in errors {
        *s += &format!(" | ERROR {e}");
    }
}

fn summary_idle(r: &IdleReport, what: &str, one: &str) -> String {
    let mut s = format!(
        "{} {what} in {:.2}s ({:.0}/s)",
        r.items, r.create_s, r.create_rate
    );
    if let Some(b) = &r.broker {
        s += &format!(
            " | broker rss {}->{} MiB",
            b.rss_start_kb / 1024,
            b.rss_end_kb / 1024
        );
    }
    if let Some(per) = r.bytes_per_item {
        s += &format!(" | {:.1} KB per {one}", per / 1000.0);
    }
    if let Some(per) = r.bytes_per_item_second_half {
        s += &format!(" ({:.1} KB over the second half)", per / 1000.0);
    }
    for e in &r.errors {
        s += &format!(" | ERROR {e}");
    }
    s
}

fn summary_schedule(r: &ScheduleReport) -> String {
    let mut s = format!(
        "scheduled {} (x-delay {}-{} s) in {:.1}s ({:.0}/s)",
        r.published,
        r.delay_min_ms / 1000,
        r.delay_max_ms / 1000,
        r.publish_s,
        r.publish_rate
    );
    if let Some(l) = &r.confirm_latency {
        s += &format!(
            " | confirm p50 {} p99 {} max {}",
            fmt_us(l.p50_us),
            fmt_us(l.p99_us),
            fmt_us(l.max_us)
        );
    }
    if r.nacked > 0 {
        s += &format!(" | {} nacked", r.nacked);
    }
    if let Some(b) = &r.broker {
        s += &format!(
            " | broker cpu {:.2}s rss {}->{} MiB peak {} MiB",
            b.cpu_s,
            b.rss_start_kb / 1024,
            b.rss_end_kb / 1024,
            b.rss_peak_kb / 1024
        );
    }
    if let Some(kb) = r.rss_after_pause_kb {
        s += &format!(", {} MiB after {:.0}s", kb / 1024, r.pause_s);
    }
    for e in &r.errors {
        s += &format!(" | ERROR {e}");
    }
    s
}

fn summary_lateness(r: &LatenessReport) -> String {
    let mut s = format!(
        "{:.1}s: published {} ({:.0}/s, x-delay {} ms), received {} | lost {} early {} duplicates {}",
        r.publish_s, r.published, r.publish_rate, r.delay_min_ms, r.unique, r.lost, r.early, r.duplicates
    );
    if r.early_sub_ms > 0 {
        s += &format!(
            " ({} early by under 1 ms, at most {})",
            r.early_sub_ms,
            fmt_us(r.early_max_us)
        );
    }
    if let Some(l) = &r.lateness {
        s += &format!(
            " | lateness p50 {} p90 {} p99 {} p99.9 {} max {}",
            fmt_us(l.p50_us),
            fmt_us(l.p90_us),
            fmt_us(l.p99_us),
            fmt_us(l.p999_us),
            fmt_us(l.max_us)
        );
    }
    if r.rate_skipped > 0 {
        s += &format!(" | {} behind rate", r.rate_skipped);
    }
    broker_and_errors(&mut s, r.broker.as_ref(), r.client_cpu_pct, &r.errors);
    s
}
