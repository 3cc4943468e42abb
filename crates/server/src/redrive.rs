//! `warren redrive`: moves messages out of a queue (a dead-letter queue, typically) back to the
//! queue each was dead-lettered from, or to a named queue, over AMQP at a chosen rate.
//!
//! Each message is taken with `basic.get`, published to the target through the default
//! exchange on a confirm channel (mandatory, so a missing target is noticed), and acked in
//! the source only once the target confirmed it: an interruption loses nothing, and a rerun
//! carries on with what is left. Only the messages present at the start are moved (at most),
//! so a target that dead-letters back into the source cannot make it run for ever. It speaks
//! plain AMQP, so it works against RabbitMQ as well.

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

/// Moves messages from one queue to another: a dead-letter queue back to where its messages
/// came from, or any queue into any other.
#[derive(Args, Debug, Clone)]
pub struct RedriveArgs {
    /// The queue to take messages from.
    #[arg(long)]
    pub from: String,
    /// The queue to move them to [default: each message's own source queue, from its
    /// `x-first-death-queue` header or its first `x-death` entry]
    #[arg(long)]
    pub to: Option<String>,
    /// Most messages moved per second [default: as fast as confirms come back]
    #[arg(long)]
    pub rate: Option<u32>,
    /// Most messages to move [default: all those in the queue when the move starts]
    #[arg(long)]
    pub limit: Option<u64>,
    /// The broker (vhost "/" is %2f)
    #[arg(
        long,
        env = "WARREN_URL",
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    pub url: String,
}

#[derive(Debug, thiserror::Error)]
enum RedriveError {
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

/// Runs the command: exit 0 when the messages were moved (or there were none).
pub fn main(args: RedriveArgs) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("warren redrive: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(redrive(&args)) {
        Ok(moved) => {
            let to = args
                .to
                .as_deref()
                .map_or_else(|| "their source queues".to_string(), |q| format!("'{q}'"));
            println!("moved {moved} message(s) from '{}' to {to}", args.from);
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("warren redrive: {e}");
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

async fn message_count(ch: &Channel, queue: &str) -> Result<u32, RedriveError> {
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    match ch
        .queue_declare(queue.into(), passive, FieldTable::default())
        .await
    {
        Ok(q) => Ok(q.message_count()),
        Err(_) => Err(RedriveError::NoQueue(queue.to_string())),
    }
}

/// Shows progress: a line rewritten in place on a terminal, a line a second otherwise.
struct Progress {
    start: Instant,
    shown: Instant,
    total: u64,
    tty: bool,
}

impl Progress {
    fn show(&mut self, moved: u64, done: bool) {
        if !done && self.shown.elapsed() < Duration::from_millis(if self.tty { 100 } else { 1000 })
        {
            return;
        }
        self.shown = Instant::now();
        let secs = self.start.elapsed().as_secs_f64().max(1e-3);
        let line = format!(
            "moved {moved}/{} ({:.0} msg/s)",
            self.total,
            moved as f64 / secs
        );
        let mut err = std::io::stderr();
        if self.tty {
            let _ = write!(err, "\r{line}{}", if done { "\n" } else { "" });
        } else {
            let _ = writeln!(err, "{line}");
        }
        let _ = err.flush();
    }
}

async fn redrive(a: &RedriveArgs) -> Result<u64, RedriveError> {
    let conn = Connection::connect(&a.url, ConnectionProperties::default())
        .await
        .map_err(|source| RedriveError::Connect {
            url: a.url.clone(),
            source,
        })?;
    // One channel for the checks (a failed passive declare closes it), one for the move.
    let check = conn.create_channel().await?;
    let present = u64::from(message_count(&check, &a.from).await?);
    if let Some(to) = &a.to {
        message_count(&check, to).await?;
    }
    let total = a.limit.map_or(present, |l| l.min(present));
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    // Batches small enough that a rate limit is kept smoothly.
    let batch = a.rate.map_or(100, |r| (r / 10).clamp(1, 100)) as u64;
    let tty = std::io::stderr().is_terminal();
    let mut progress = Progress {
        start: Instant::now(),
        shown: Instant::now(),
        total,
        tty,
    };
    let mut moved = 0u64;
    let result = async {
        while moved < total {
            let mut taken = Vec::new();
            while (taken.len() as u64) < batch.min(total - moved) {
                match ch
                    .basic_get(a.from.as_str().into(), BasicGetOptions { no_ack: false })
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
                let Some(to) = a.to.clone().or_else(|| origin(&d.properties)) else {
                    stop = Some(RedriveError::NoOrigin(a.from.clone()));
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
                        d.properties.clone(),
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
                        stop.get_or_insert(RedriveError::Unroutable(to));
                    }
                    Confirmation::Nack(_) => {
                        stop.get_or_insert(RedriveError::Refused(to));
                    }
                }
            }
            if let Some(e) = stop {
                return Err(e);
            }
            progress.show(moved, false);
            if let Some(rate) = a.rate.filter(|r| *r > 0) {
                let due = Duration::from_secs_f64(moved as f64 / f64::from(rate));
                let elapsed = progress.start.elapsed();
                if due > elapsed {
                    tokio::time::sleep(due - elapsed).await;
                }
            }
        }
        Ok(())
    }
    .await;
    progress.show(moved, true);
    // Closing returns whatever was taken and not moved to the source at once.
    let _ = conn.close(200, "redrive done".into()).await;
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
