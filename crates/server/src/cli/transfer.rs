//! `warren move` and `warren redrive`: move messages out of a queue into another over AMQP, at
//! a chosen rate. `redrive` is a move whose target defaults, message by message, to the queue
//! each was dead-lettered from; both run [`transfer`].
//!
//! Each message is taken with `basic.get`, published to the target through the default
//! exchange on a confirm channel (mandatory, so a missing target is noticed), and acked in
//! the source only once the target confirmed it: an interruption loses nothing, and a rerun
//! carries on with what is left. Only the messages present at the start are moved (at most),
//! so a target that dead-letters back into the source cannot make it run for ever. It speaks
//! plain AMQP, so it works against RabbitMQ as well.
//!
//! Each moved copy carries the header `x-moved-from` (the source queue): Warren's
//! deduplication judges only new messages, and without it a target with
//! `x-message-deduplication` that saw the key within its window would confirm the copy and
//! drop it, and the ack at the source would lose the message.

use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Args;
use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};

/// Moves messages from a dead-letter queue back to where they came from, or to another queue.
#[derive(Args, Debug, Clone)]
pub struct RedriveArgs {
    /// The queue to take messages from.
    #[arg(long)]
    pub from: String,
    /// The queue to move them to [default: each message's own source queue, from its
    /// `x-first-death-queue` header or its first `x-death` entry]
    #[arg(long)]
    pub to: Option<String>,
    #[command(flatten)]
    pub pace: Pace,
}

/// Moves messages from one queue to another.
#[derive(Args, Debug, Clone)]
pub struct MoveArgs {
    /// The queue to take messages from.
    #[arg(long)]
    pub from: String,
    /// The queue to move them to.
    #[arg(long)]
    pub to: String,
    #[command(flatten)]
    pub pace: Pace,
}

/// How fast, how many, and where the broker is (AMQP, for the confirmed hand-over).
#[derive(Args, Debug, Clone)]
pub struct Pace {
    /// Most messages moved per second [default: as fast as confirms come back]
    #[arg(long)]
    pub rate: Option<u32>,
    /// Most messages to move [default: all those in the queue when the move starts]
    #[arg(long)]
    pub limit: Option<u64>,
    /// The broker's AMQP address (vhost "/" is %2f)
    #[arg(
        long,
        env = "WARREN_URL",
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    pub url: String,
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum TransferError {
    #[error(
        "cannot connect to {url}: {source} (is the broker running? pass --url amqp://user:pass@host:port/vhost)"
    )]
    Connect { url: String, source: lapin::Error },
    #[error("queue '{0}' does not exist (check the name and the vhost in --url)")]
    NoQueue(String),
    #[error(
        "a message in '{0}' has no x-death header saying where it came from: pass --to QUEUE \
         (it was left in '{0}')"
    )]
    NoOrigin(String),
    #[error(
        "the broker did not route a message to queue '{0}' (no such queue?): it was left in the \
         source; declare the queue or pass another --to"
    )]
    Unroutable(String),
    #[error(
        "the broker refused a message for '{0}' (nack; a full queue?): it was left in the source"
    )]
    Refused(String),
    #[error("AMQP error: {0}")]
    Amqp(#[from] lapin::Error),
}

/// `warren redrive`: exit 0 when the messages were moved (or there were none).
pub fn main_redrive(a: RedriveArgs) -> ExitCode {
    run("redrive", &a.from, a.to.as_deref(), &a.pace)
}

/// `warren move`: the same, to one named queue.
pub fn main_move(a: MoveArgs) -> ExitCode {
    run("move", &a.from, Some(&a.to), &a.pace)
}

fn run(command: &str, from: &str, to: Option<&str>, pace: &Pace) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("warren {command}: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(transfer(from, to, pace)) {
        Ok(moved) => {
            let to = to.map_or_else(|| "their source queues".to_string(), |q| format!("'{q}'"));
            println!("moved {moved} message(s) from '{from}' to {to}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("warren {command}: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The queue a dead-lettered message came from.
fn origin(props: &BasicProperties) -> Option<String> {
    let headers = props.headers().as_ref()?;
    let text = |v: &AMQPValue| match v {
        AMQPValue::LongString(s) => Some(s.to_string()),
        AMQPValue::ShortString(s) => Some(s.to_string()),
        _ => None,
    };
    if let Some(q) = headers.inner().get("x-first-death-queue").and_then(text) {
        return Some(q);
    }
    let AMQPValue::FieldArray(deaths) = headers.inner().get("x-death")? else {
        return None;
    };
    // Most recent first: the last entry is the first death.
    deaths.as_slice().iter().rev().find_map(|d| match d {
        AMQPValue::FieldTable(t) => t.inner().get("queue").and_then(text),
        _ => None,
    })
}

/// A message's properties as moved out of queue `from`: marked, so that the target does not
/// take it for a new publish of a message it has seen (and drop it as a duplicate).
fn as_moved(props: &BasicProperties, from: &str) -> BasicProperties {
    let mut headers = props.headers().clone().unwrap_or_default();
    headers.insert(
        warren_broker::dedup::MOVED_HEADER.into(),
        AMQPValue::LongString(from.into()),
    );
    props.clone().with_headers(headers)
}

async fn message_count(ch: &Channel, queue: &str) -> Result<u32, TransferError> {
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    match ch
        .queue_declare(queue.into(), passive, FieldTable::default())
        .await
    {
        Ok(q) => Ok(q.message_count()),
        Err(_) => Err(TransferError::NoQueue(queue.to_string())),
    }
}

/// Shows progress: a bar on a terminal (indicatif), a line a second otherwise (logs).
enum Progress {
    Bar(indicatif::ProgressBar),
    Lines {
        start: Instant,
        shown: Instant,
        total: u64,
    },
}

impl Progress {
    fn new(total: u64) -> Progress {
        if std::io::stderr().is_terminal() {
            let bar = indicatif::ProgressBar::new(total);
            if let Ok(style) = indicatif::ProgressStyle::with_template(
                "{bar:40} {pos}/{len} moved, {rate} msg/s, {eta} left",
            ) {
                bar.set_style(style.with_key(
                    "rate",
                    |s: &indicatif::ProgressState, w: &mut dyn std::fmt::Write| {
                        let _ = write!(w, "{:.0}", s.per_sec());
                    },
                ));
            }
            Progress::Bar(bar)
        } else {
            Progress::Lines {
                start: Instant::now(),
                shown: Instant::now(),
                total,
            }
        }
    }

    fn show(&mut self, moved: u64, done: bool) {
        match self {
            Progress::Bar(bar) => {
                bar.set_position(moved);
                if done {
                    // The summary line that follows says what was moved.
                    bar.finish_and_clear();
                }
            }
            Progress::Lines {
                start,
                shown,
                total,
            } => {
                if !done && shown.elapsed() < Duration::from_secs(1) {
                    return;
                }
                *shown = Instant::now();
                let secs = start.elapsed().as_secs_f64().max(1e-3);
                let mut err = std::io::stderr();
                let _ = writeln!(
                    err,
                    "moved {moved}/{total} ({:.0} msg/s)",
                    moved as f64 / secs
                );
                let _ = err.flush();
            }
        }
    }
}

/// Moves the messages of `from` (those present at the start, at most `pace.limit`) to `to`,
/// or each to its dead-letter origin; returns how many were moved.
async fn transfer(from: &str, to: Option<&str>, pace: &Pace) -> Result<u64, TransferError> {
    let conn = Connection::connect(&pace.url, ConnectionProperties::default())
        .await
        .map_err(|source| TransferError::Connect {
            url: pace.url.clone(),
            source,
        })?;
    let mut progress: Option<Progress> = None;
    let mut report = |moved: u64, total: u64, done: bool| {
        progress
            .get_or_insert_with(|| Progress::new(total))
            .show(moved, done);
    };
    let moved = move_messages(&conn, from, to, (pace.rate, pace.limit), &mut report, None).await;
    // Closing returns whatever was taken and not moved to the source at once.
    let _ = conn.close(200, "move done".into()).await;
    moved
}

/// The move itself, on `conn`: at most `limit` of the messages in `from` at the start, at
/// most `rate` a second, each to `to` or its dead-letter origin. `report(moved, total, done)`
/// hears of the progress (first with 0 moved); a `stop` that turns true ends the move after
/// the batch in hand. Returns how many were moved; what was taken and not moved goes back to
/// `from` when the caller closes `conn`.
pub(crate) async fn move_messages(
    conn: &Connection,
    from: &str,
    to: Option<&str>,
    (rate, limit): (Option<u32>, Option<u64>),
    report: &mut (dyn FnMut(u64, u64, bool) + Send),
    stop: Option<tokio::sync::watch::Receiver<bool>>,
) -> Result<u64, TransferError> {
    // One channel for the checks (a failed passive declare closes it), one for the move.
    let check = conn.create_channel().await?;
    let present = u64::from(message_count(&check, from).await?);
    if let Some(to) = to {
        message_count(&check, to).await?;
    }
    let total = limit.map_or(present, |l| l.min(present));
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    // Batches small enough that a rate limit is kept smoothly.
    let batch = rate.map_or(100, |r| (r / 10).clamp(1, 100)) as u64;
    let start = Instant::now();
    report(0, total, false);
    let mut moved = 0u64;
    let result = async {
        while moved < total && !stop.as_ref().is_some_and(|s| *s.borrow()) {
            let mut taken = Vec::new();
            while (taken.len() as u64) < batch.min(total - moved) {
                match ch
                    .basic_get(from.into(), BasicGetOptions { no_ack: false })
                    .await?
                {
                    Some(m) => taken.push(m),
                    None => break,
                }
            }
            if taken.is_empty() {
                break;
            }
            let mut pending = Vec::with_capacity(taken.len());
            // A message that cannot be moved stops the move, after those before it are.
            let mut stop = None;
            for m in &taken {
                let d = &m.delivery;
                let Some(to) = to.map(str::to_owned).or_else(|| origin(&d.properties)) else {
                    stop = Some(TransferError::NoOrigin(from.to_owned()));
                    break;
                };
                let confirm = ch
                    .basic_publish(
                        "".into(),
                        to.as_str().into(),
                        BasicPublishOptions {
                            mandatory: true,
                            ..Default::default()
                        },
                        &d.data,
                        as_moved(&d.properties, from),
                    )
                    .await?;
                pending.push((confirm, to, d.delivery_tag));
            }
            // Each message leaves the source only once its copy is confirmed in the target.
            for (confirm, to, tag) in pending {
                match confirm.await? {
                    Confirmation::Ack(None) | Confirmation::NotRequested => {
                        ch.basic_ack(tag, BasicAckOptions::default()).await?;
                        moved += 1;
                    }
                    Confirmation::Ack(Some(_)) => {
                        stop.get_or_insert(TransferError::Unroutable(to));
                    }
                    Confirmation::Nack(_) => {
                        stop.get_or_insert(TransferError::Refused(to));
                    }
                }
            }
            if let Some(e) = stop {
                return Err(e);
            }
            report(moved, total, false);
            if let Some(rate) = rate.filter(|r| *r > 0) {
                let due = Duration::from_secs_f64(moved as f64 / f64::from(rate));
                let elapsed = start.elapsed();
                if due > elapsed {
                    tokio::time::sleep(due - elapsed).await;
                }
            }
        }
        Ok(())
    }
    .await;
    report(moved, total, true);
    result.map(|()| moved)
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::types::{FieldArray, LongString};

    fn death(queue: &str) -> AMQPValue {
        let mut t = FieldTable::default();
        t.insert(
            "queue".into(),
            AMQPValue::LongString(LongString::from(queue)),
        );
        AMQPValue::FieldTable(t)
    }

    #[test]
    fn a_moved_copy_says_where_it_came_from_and_keeps_the_rest() {
        let mut h = FieldTable::default();
        h.insert("order-id".into(), AMQPValue::LongString("o-7".into()));
        let p = BasicProperties::default()
            .with_message_id("m-1".into())
            .with_headers(h);
        let m = as_moved(&p, "jobs.dead");
        assert_eq!(m.message_id(), p.message_id());
        let headers = m.headers().as_ref().expect("headers");
        assert_eq!(
            headers.inner().get("order-id"),
            Some(&AMQPValue::LongString("o-7".into()))
        );
        assert_eq!(
            headers.inner().get("x-moved-from"),
            Some(&AMQPValue::LongString("jobs.dead".into()))
        );
        let bare = as_moved(&BasicProperties::default(), "q");
        assert!(bare
            .headers()
            .as_ref()
            .is_some_and(|h| h.inner().len() == 1));
    }

    #[test]
    fn the_origin_is_the_first_death_queue() {
        let mut h = FieldTable::default();
        assert_eq!(origin(&BasicProperties::default()), None);
        h.insert(
            "x-death".into(),
            AMQPValue::FieldArray(FieldArray::from(vec![death("retry"), death("jobs")])),
        );
        let p = BasicProperties::default().with_headers(h.clone());
        assert_eq!(
            origin(&p).as_deref(),
            Some("jobs"),
            "the oldest entry is last"
        );
        h.insert(
            "x-first-death-queue".into(),
            AMQPValue::LongString(LongString::from("first")),
        );
        let p = BasicProperties::default().with_headers(h);
        assert_eq!(origin(&p).as_deref(), Some("first"));
    }
}
