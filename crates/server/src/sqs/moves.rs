//! Message move tasks (StartMessageMoveTask, ListMessageMoveTasks, CancelMessageMoveTask):
//! SQS's redrive of a dead-letter queue, back to the queues its messages came from or to one
//! named queue. A task is `warren redrive` run inside the node, over its own AMQP listener as
//! the node's internal user: each message is acked in the dead-letter queue only once its
//! destination confirmed the copy, so a task cancelled, failed or cut short by a restart
//! loses nothing (what it held goes back to the dead-letter queue).
//!
//! Tasks live in the memory of the node that runs them (SQS keeps them 14 days): a restart
//! forgets them, and the messages not moved yet stay in the dead-letter queue.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use lapin::{Connection, ConnectionProperties};
use serde_json::{Map, Value};
use tokio::sync::watch;
use warren_broker::access::{Perm, Resource};

use super::{integer, required, text, Ctx, Sqs, SqsError};
use crate::cli::transfer::{move_messages, TransferError};
use crate::shovel::{self, Local};

/// SQS's highest `MaxNumberOfMessagesPerSecond`.
const MAX_RATE: i64 = 500;

/// Tasks kept per source queue (ListMessageMoveTasks shows the latest 10).
const KEPT_PER_SOURCE: usize = 10;

/// Tasks kept on a node in all (of queues deleted since, too), running ones included.
const KEPT: usize = 1_000;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Status {
    Running,
    Cancelling,
    Cancelled,
    Completed,
    Failed,
}

impl Status {
    fn name(self) -> &'static str {
        match self {
            Status::Running => "RUNNING",
            Status::Cancelling => "CANCELLING",
            Status::Cancelled => "CANCELLED",
            Status::Completed => "COMPLETED",
            Status::Failed => "FAILED",
        }
    }
}

struct Task {
    handle: String,
    vhost: String,
    source: String,
    source_arn: String,
    dest: Option<String>,
    dest_arn: Option<String>,
    rate: Option<u32>,
    started_ms: u64,
    to_move: AtomicU64,
    moved: AtomicU64,
    state: Mutex<(Status, Option<String>)>,
    stop: watch::Sender<bool>,
}

impl Task {
    fn status(&self) -> (Status, Option<String>) {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Running becomes cancelling; false if the task is not running (any more).
    fn cancel(&self) -> bool {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if state.0 != Status::Running {
            return false;
        }
        state.0 = Status::Cancelling;
        true
    }

    /// The task's end: cancelled if a cancel came first, else as `outcome` says.
    fn end(&self, outcome: Result<(), String>) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        *state = match outcome {
            Ok(()) if state.0 == Status::Cancelling => (Status::Cancelled, None),
            Ok(()) => (Status::Completed, None),
            Err(reason) => (Status::Failed, Some(reason)),
        };
    }

    fn entry(&self) -> Map<String, Value> {
        let (status, reason) = self.status();
        let mut m = Map::new();
        if status == Status::Running {
            m.insert("TaskHandle".into(), self.handle.clone().into());
        }
        m.insert("Status".into(), status.name().into());
        m.insert("SourceArn".into(), self.source_arn.clone().into());
        if let Some(d) = &self.dest_arn {
            m.insert("DestinationArn".into(), d.clone().into());
        }
        if let Some(r) = self.rate {
            m.insert("MaxNumberOfMessagesPerSecond".into(), r.into());
        }
        m.insert(
            "ApproximateNumberOfMessagesMoved".into(),
            self.moved.load(Ordering::Relaxed).into(),
        );
        m.insert(
            "ApproximateNumberOfMessagesToMove".into(),
            self.to_move.load(Ordering::Relaxed).into(),
        );
        if let Some(r) = reason {
            m.insert("FailureReason".into(), r.into());
        }
        m.insert("StartedTimestamp".into(), self.started_ms.into());
        m
    }
}

/// The node's message move tasks.
pub struct MoveTasks {
    /// How a task reaches this node's listener (`None`: tasks cannot run here).
    local: Option<Local>,
    tasks: Mutex<Vec<Arc<Task>>>,
    next: AtomicU64,
}

impl MoveTasks {
    pub fn new(local: Option<Local>) -> MoveTasks {
        MoveTasks {
            local,
            tasks: Mutex::new(Vec::new()),
            next: AtomicU64::new(1),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Arc<Task>>> {
        self.tasks.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn not_found(m: impl Into<String>) -> SqsError {
    SqsError::new(
        400,
        "ResourceNotFoundException",
        "ResourceNotFoundException",
        m,
    )
}

fn unsupported(m: impl Into<String>) -> SqsError {
    SqsError::new(
        400,
        "UnsupportedOperation",
        "AWS.SimpleQueueService.UnsupportedOperation",
        m,
    )
}

/// The (vhost, queue) an SQS queue ARN names: `arn:aws:sqs:<region>:<account>:<name>`.
fn queue_of_arn(arn: &str, key: &str) -> Result<(String, String), SqsError> {
    let parts: Vec<&str> = arn.splitn(6, ':').collect();
    match parts.as_slice() {
        ["arn", _, "sqs", _, account, name] if !name.is_empty() => {
            Ok((super::vhost_of(account), (*name).to_owned()))
        }
        _ => Err(SqsError::invalid_parameter(format!(
            "Value {arn} for parameter {key} is invalid. Reason: not an SQS queue ARN."
        ))),
    }
}

/// StartMessageMoveTask.
pub fn start(
    sqs: &Sqs,
    ctx: &Ctx,
    input: &Map<String, Value>,
) -> Result<Map<String, Value>, SqsError> {
    let source_arn = required(input, "SourceArn")?.to_owned();
    let (vhost, source) = queue_of_arn(&source_arn, "SourceArn")?;
    let dest_arn = text(input, "DestinationArn")?.map(str::to_owned);
    let dest = match &dest_arn {
        Some(arn) => {
            let (v, q) = queue_of_arn(arn, "DestinationArn")?;
            if v != vhost {
                return Err(SqsError::invalid_parameter(
                    "The destination queue must be in the same vhost (account) as the source.",
                ));
            }
            Some(q)
        }
        None => None,
    };
    let rate = integer(input, "MaxNumberOfMessagesPerSecond", 1..=MAX_RATE)?
        .and_then(|r| u32::try_from(r).ok());
    let to_move = sqs.node.read(|n, _| {
        let mut needs = vec![
            (Perm::Read, Resource::Queue(source.as_str())),
            (Perm::Write, Resource::Exchange("")),
        ];
        if let Some(d) = &dest {
            needs.push((Perm::Write, Resource::Queue(d.as_str())));
        }
        ctx.permit(n.broker().access(), &vhost, &needs)?;
        let snap = n
            .broker()
            .queue_snapshot(&vhost, &source)
            .ok_or_else(|| not_found("The resource that you specified for the SourceArn parameter doesn't exist."))?;
        if let Some(d) = &dest {
            n.broker().queue_snapshot(&vhost, d).ok_or_else(|| {
                not_found("The resource that you specified for the DestinationArn parameter doesn't exist.")
            })?;
        }
        if super::queues::dead_letter_sources_of(n, &vhost, &source).is_empty() {
            return Err(unsupported(
                "Source queue must be configured as a Dead Letter Queue.",
            ));
        }
        Ok(snap.ready)
    })?;
    let Some(local) = sqs.moves.local.clone() else {
        return Err(SqsError::unavailable(
            "message move tasks cannot run on this node (no AMQP listener of its own)",
        ));
    };
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let (stop, stopped) = watch::channel(false);
    let task = {
        let mut tasks = sqs.moves.lock();
        let running = tasks.iter().any(|t| {
            t.vhost == vhost
                && t.source == source
                && matches!(t.status().0, Status::Running | Status::Cancelling)
        });
        if running {
            return Err(unsupported(
                "There is already a task running. Only one active task is allowed for each source queue arn at a given time.",
            ));
        }
        let seq = sqs.moves.next.fetch_add(1, Ordering::Relaxed);
        let handle = base64::Engine::encode(
            &base64::engine::general_purpose::URL_SAFE_NO_PAD,
            format!("{now_ms}:{seq}:{source_arn}"),
        );
        let task = Arc::new(Task {
            handle,
            vhost: vhost.clone(),
            source: source.clone(),
            source_arn: source_arn.clone(),
            dest: dest.clone(),
            dest_arn,
            rate,
            started_ms: now_ms,
            to_move: AtomicU64::new(to_move),
            moved: AtomicU64::new(0),
            state: Mutex::new((Status::Running, None)),
            stop,
        });
        // The latest tasks of each source are kept; older finished ones go.
        let mut same: Vec<usize> = (0..tasks.len())
            .filter(|&i| tasks[i].vhost == vhost && tasks[i].source == source)
            .collect();
        while same.len() >= KEPT_PER_SOURCE {
            let oldest = same.remove(0);
            tasks.remove(oldest);
            same.iter_mut().for_each(|i| *i -= 1);
        }
        // And at most so many in all: the oldest finished ones go first.
        while tasks.len() >= KEPT {
            let Some(i) = tasks
                .iter()
                .position(|t| !matches!(t.status().0, Status::Running | Status::Cancelling))
            else {
                return Err(SqsError::new(
                    400,
                    "RequestThrottled",
                    "RequestThrottled",
                    format!(
                        "{KEPT} message move tasks are running on this node: wait for one to end."
                    ),
                ));
            };
            tasks.remove(i);
        }
        tasks.push(task.clone());
        task
    };
    tracing::info!(vhost = %vhost, source = %source, dest = ?dest, user = %ctx.user, "SQS message move task started");
    tokio::spawn(run(task.clone(), local, stopped));
    let mut out = Map::new();
    out.insert("TaskHandle".into(), task.handle.clone().into());
    Ok(out)
}

/// Runs a task to its end over the node's own listener.
async fn run(task: Arc<Task>, local: Local, stopped: watch::Receiver<bool>) {
    let vhost =
        percent_encoding::utf8_percent_encode(&task.vhost, percent_encoding::NON_ALPHANUMERIC);
    let uri = format!("amqp:///{vhost}");
    let outcome = async {
        let target = shovel::uri::target(&uri, &local, "/")
            .map_err(|e| format!("cannot reach the node's listener: {e}"))?;
        let conn = Connection::connect_uri(target, ConnectionProperties::default())
            .await
            .map_err(|e| format!("cannot reach the node's listener: {e}"))?;
        let moved = &task.moved;
        let to_move = &task.to_move;
        let mut report = |n: u64, total: u64, _done: bool| {
            moved.store(n, Ordering::Relaxed);
            to_move.store(total, Ordering::Relaxed);
        };
        let result = move_messages(
            &conn,
            &task.source,
            task.dest.as_deref(),
            (task.rate, None),
            &mut report,
            Some(stopped),
        )
        .await;
        // What was taken and not moved goes back to the dead-letter queue now.
        let _ = conn.close(200, "move task ended".into()).await;
        result.map_err(|e| failure_reason(&e, &task.source))
    }
    .await;
    if let Err(reason) = &outcome {
        tracing::warn!(vhost = %task.vhost, source = %task.source, %reason, "SQS message move task failed");
    }
    task.end(outcome.map(|_| ()));
}

/// A failed task's `FailureReason`, in SQS's terms rather than the CLI's.
fn failure_reason(e: &TransferError, source: &str) -> String {
    match e {
        TransferError::NoOrigin(_) => format!(
            "A message in {source} was not dead-lettered from another queue, so it has no source queue to go back to: start the task with a DestinationArn."
        ),
        TransferError::Unroutable(q) => format!(
            "The destination queue {q} does not exist (it was deleted?)."
        ),
        TransferError::Refused(q) => format!("The destination queue {q} refused a message (full?)."),
        TransferError::NoQueue(q) => format!("The queue {q} does not exist (it was deleted?)."),
        other => other.to_string(),
    }
}

/// CancelMessageMoveTask: a running task stops after the batch in hand; the messages it
/// moved stay moved, the others stay in the dead-letter queue.
pub fn cancel(
    sqs: &Sqs,
    ctx: &Ctx,
    input: &Map<String, Value>,
) -> Result<Map<String, Value>, SqsError> {
    let handle = required(input, "TaskHandle")?;
    let task = sqs
        .moves
        .lock()
        .iter()
        .find(|t| t.handle == handle)
        .cloned()
        .ok_or_else(|| {
            not_found("The resource that you specified for the TaskHandle parameter doesn't exist.")
        })?;
    sqs.node.read(|n, _| {
        ctx.permit(
            n.broker().access(),
            &task.vhost,
            &[(Perm::Read, Resource::Queue(task.source.as_str()))],
        )
    })?;
    if !task.cancel() {
        return Err(unsupported("Only active tasks can be cancelled."));
    }
    let _ = task.stop.send(true);
    tracing::info!(vhost = %task.vhost, source = %task.source, user = %ctx.user, "SQS message move task cancelled");
    let mut out = Map::new();
    out.insert(
        "ApproximateNumberOfMessagesMoved".into(),
        task.moved.load(Ordering::Relaxed).into(),
    );
    Ok(out)
}

/// ListMessageMoveTasks: the latest tasks of a source queue, the newest first.
pub fn list(
    sqs: &Sqs,
    ctx: &Ctx,
    input: &Map<String, Value>,
) -> Result<Map<String, Value>, SqsError> {
    let source_arn = required(input, "SourceArn")?;
    let (vhost, source) = queue_of_arn(source_arn, "SourceArn")?;
    let max = usize::try_from(integer(input, "MaxResults", 1..=10)?.unwrap_or(1)).unwrap_or(1);
    sqs.node.read(|n, _| {
        ctx.permit(
            n.broker().access(),
            &vhost,
            &[(Perm::Read, Resource::Queue(source.as_str()))],
        )?;
        n.broker()
            .queue_snapshot(&vhost, &source)
            .map(|_| ())
            .ok_or_else(|| {
                not_found(
                    "The resource that you specified for the SourceArn parameter doesn't exist.",
                )
            })
    })?;
    let results: Vec<Value> = sqs
        .moves
        .lock()
        .iter()
        .rev()
        .filter(|t| t.vhost == vhost && t.source == source)
        .take(max)
        .map(|t| Value::Object(t.entry()))
        .collect();
    let mut out = Map::new();
    out.insert("Results".into(), Value::Array(results));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_arn_names_its_vhost_and_queue() {
        let got = queue_of_arn("arn:aws:sqs:us-east-1:000000000000:jobs-dlq", "SourceArn").ok();
        assert_eq!(got, Some(("/".into(), "jobs-dlq".into())));
        let got = queue_of_arn("arn:aws:sqs:eu-west-1:billing:invoices", "SourceArn").ok();
        assert_eq!(got, Some(("billing".into(), "invoices".into())));
        for bad in [
            "jobs",
            "arn:aws:sns:us-east-1:000000000000:t",
            "arn:aws:sqs:r:a:",
        ] {
            let e = queue_of_arn(bad, "SourceArn").expect_err(bad);
            assert_eq!(e.code, "InvalidParameterValue", "{bad}");
        }
    }

    #[test]
    fn only_a_running_task_shows_its_handle_and_a_failed_one_says_why() {
        let (stop, _) = watch::channel(false);
        let task = Task {
            handle: "h".into(),
            vhost: "/".into(),
            source: "dlq".into(),
            source_arn: "arn:aws:sqs:us-east-1:000000000000:dlq".into(),
            dest: None,
            dest_arn: None,
            rate: Some(5),
            started_ms: 7,
            to_move: AtomicU64::new(3),
            moved: AtomicU64::new(1),
            state: Mutex::new((Status::Running, None)),
            stop,
        };
        let e = task.entry();
        assert_eq!(e["TaskHandle"], "h");
        assert_eq!(e["Status"], "RUNNING");
        assert_eq!(e["MaxNumberOfMessagesPerSecond"], 5);
        assert!(e.get("DestinationArn").is_none());
        assert!(task.cancel(), "a running task is cancelled");
        assert!(!task.cancel(), "once");
        task.end(Ok(()));
        assert_eq!(
            task.status().0,
            Status::Cancelled,
            "a cancel that came first wins"
        );
        task.end(Err("why".into()));
        let e = task.entry();
        assert!(e.get("TaskHandle").is_none());
        assert_eq!(
            (e["Status"].as_str(), e["FailureReason"].as_str()),
            (Some("FAILED"), Some("why"))
        );
        assert_eq!(
            (
                e["ApproximateNumberOfMessagesMoved"].as_u64(),
                e["ApproximateNumberOfMessagesToMove"].as_u64()
            ),
            (Some(1), Some(3))
        );
    }
}
