//! `warren ctl add_member`, `delete_member`, `grow` and `shrink`: RabbitMQ's
//! `rabbitmq-queues` commands of those names, over the management API's routes for them
//! (`/api/queues/quorum/...`). A node taken off a queue's members keeps the queue as a
//! learner (it holds the log without a vote; see docs/compatibility.md).

use clap::Subcommand;
use serde_json::{json, Value};

use super::api::enc;
use super::{CliError, Conn, InVhost};

#[derive(Subcommand, Debug, Clone)]
pub enum MembersCmd {
    /// Makes a node a member (a voter) of a quorum queue; it votes once it has the queue's
    /// log. Nothing to do if it is one already
    #[command(name = "add_member", alias = "add-member")]
    AddMember {
        /// The queue
        queue: String,
        /// The node: its name as /api/nodes gives it (warren-3@host), or its number
        node: String,
        #[command(flatten)]
        conn: InVhost,
    },
    /// Takes a node off a quorum queue's members; it keeps the queue as a learner. The last
    /// member cannot go
    #[command(name = "delete_member", alias = "delete-member")]
    DeleteMember {
        /// The queue
        queue: String,
        /// The node: its name as /api/nodes gives it, or its number
        node: String,
        #[command(flatten)]
        conn: InVhost,
    },
    /// Makes a node a member of every quorum queue (`all`), or of those with an even number
    /// of members (`even`), whose vhost and name match the patterns
    Grow {
        /// The node: its name as /api/nodes gives it, or its number
        node: String,
        /// `all` or `even`
        #[arg(value_parser = ["all", "even"])]
        strategy: String,
        /// Only queues of vhosts matching this regular expression
        #[arg(long, default_value = ".*")]
        vhost_pattern: String,
        /// Only queues whose names match this regular expression
        #[arg(long, default_value = ".*")]
        queue_pattern: String,
        #[command(flatten)]
        conn: Conn,
    },
    /// Takes a node off the members of every quorum queue it is one of (but those it is the
    /// last member of), listing each queue's outcome
    Shrink {
        /// The node: its name as /api/nodes gives it, or its number
        node: String,
        /// Only list the queues that could not shrink
        #[arg(long)]
        errors_only: bool,
        #[command(flatten)]
        conn: Conn,
    },
}

pub fn name(c: &MembersCmd) -> &'static str {
    match c {
        MembersCmd::AddMember { .. } => "ctl add_member",
        MembersCmd::DeleteMember { .. } => "ctl delete_member",
        MembersCmd::Grow { .. } => "ctl grow",
        MembersCmd::Shrink { .. } => "ctl shrink",
    }
}

pub fn main(c: &MembersCmd) -> Result<(), CliError> {
    match c {
        MembersCmd::AddMember { queue, node, conn } => {
            replica_call(conn, queue, node, true)?;
            println!(
                "{node} is a member of quorum queue '{queue}' in vhost '{}'",
                conn.vhost
            );
        }
        MembersCmd::DeleteMember { queue, node, conn } => {
            replica_call(conn, queue, node, false)?;
            println!(
                "{node} is no member of quorum queue '{queue}' in vhost '{}' (it keeps the queue as a learner)",
                conn.vhost
            );
        }
        MembersCmd::Grow {
            node,
            strategy,
            vhost_pattern,
            queue_pattern,
            conn,
        } => {
            conn.api().call(
                "POST",
                &format!("/queues/quorum/replicas/on/{}/grow", enc(node)),
                Some(&json!({
                    "strategy": strategy,
                    "vhost_pattern": vhost_pattern,
                    "queue_pattern": queue_pattern,
                })),
                &[],
                "the node",
            )?;
            println!("{node} is a member of the quorum queues asked for");
        }
        MembersCmd::Shrink {
            node,
            errors_only,
            conn,
        } => {
            let reply = conn.api().call(
                "DELETE",
                &format!("/queues/quorum/replicas/on/{}/shrink", enc(node)),
                None,
                &[],
                "the node",
            )?;
            for q in reply.body.as_array().into_iter().flatten() {
                let ok = q["result"] == "ok";
                if *errors_only && ok {
                    continue;
                }
                println!("{}", shrink_line(q));
            }
        }
    }
    Ok(())
}

/// RabbitMQ's `replicas/add` (a POST) or `replicas/delete` (a DELETE) of one queue, with the
/// node in the body.
fn replica_call(conn: &InVhost, queue: &str, node: &str, add: bool) -> Result<(), CliError> {
    let (method, verb) = if add {
        ("POST", "add")
    } else {
        ("DELETE", "delete")
    };
    conn.conn.api().call(
        method,
        &format!(
            "/queues/quorum/{}/{}/replicas/{verb}",
            enc(&conn.vhost),
            enc(queue)
        ),
        Some(&json!({ "node": node })),
        &[],
        "the queue",
    )?;
    Ok(())
}

/// One queue's outcome of a shrink, as `rabbitmq-queues shrink` prints it.
fn shrink_line(q: &Value) -> String {
    let (vhost, name) = (
        q["vhost"].as_str().unwrap_or_default(),
        q["name"].as_str().unwrap_or_default(),
    );
    match q["size"].as_u64() {
        Some(size) => format!("vhost: {vhost}\tname: {name}\tsize: {size}\tresult: ok"),
        None => format!(
            "vhost: {vhost}\tname: {name}\tresult: error: {}",
            q["error"].as_str().unwrap_or_default()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shrinks_outcomes_read_as_rabbitmq_queues_prints_them() {
        let ok = json!({"vhost": "/", "name": "jobs", "size": 2, "result": "ok"});
        assert_eq!(
            shrink_line(&ok),
            "vhost: /\tname: jobs\tsize: 2\tresult: ok"
        );
        let failed = json!({"vhost": "/", "name": "solo", "result": "error", "error": "last"});
        assert_eq!(
            shrink_line(&failed),
            "vhost: /\tname: solo\tresult: error: last"
        );
    }
}
