//! `warren ctl drain` and `warren ctl revive`: RabbitMQ's `rabbitmq-upgrade drain` and
//! `revive`, for the node whose management API `--api` names (drain acts on the node that
//! answers, as rabbitmq-upgrade acts on its `-n` node).

use std::time::{Duration, Instant};

use serde_json::Value;

use super::api::{enc, Api};
use super::{CliError, Conn};

#[derive(clap::Subcommand, Debug, Clone)]
pub enum MaintenanceCmd {
    /// Puts the node into maintenance mode: it takes no new client connection, closes those
    /// it has (clients reconnect to another node), and hands the leadership of its quorum
    /// queues to the other nodes; it keeps running. Returns once it leads no queue.
    Drain {
        /// How long to wait for the leaderships to move, in seconds
        #[arg(long, default_value_t = 60.0)]
        wait: f64,
        #[command(flatten)]
        conn: Conn,
    },
    /// Takes the node out of maintenance mode: it serves clients again
    Revive {
        #[command(flatten)]
        conn: Conn,
    },
}

pub fn name(c: &MaintenanceCmd) -> &'static str {
    match c {
        MaintenanceCmd::Drain { .. } => "ctl drain",
        MaintenanceCmd::Revive { .. } => "ctl revive",
    }
}

/// The name of the node that answers at `api`.
fn node_name(api: &Api) -> Result<String, CliError> {
    let overview = api.get("/overview", "the node's overview")?;
    overview["node"]
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| CliError::Failed("the API's overview names no node".into()))
}

/// Replicated queues the node still leads (0 outside a cluster).
fn still_leading(node: &Value) -> u64 {
    node["cluster"]["queues_led"].as_u64().unwrap_or(0)
}

pub fn main(c: &MaintenanceCmd) -> Result<(), CliError> {
    match c {
        MaintenanceCmd::Drain { wait, conn } => {
            let api = conn.api();
            let node = node_name(&api)?;
            let path = format!("/nodes/{}", enc(&node));
            let r = api.call("POST", &format!("{path}/drain"), None, &[], "the node")?;
            println!(
                "{node} is in maintenance mode: it takes no new client connection; {} \
                 connection(s) closed",
                r.body["connections_closed"].as_u64().unwrap_or(0)
            );
            let deadline = Instant::now() + Duration::from_secs_f64(wait.max(0.0));
            loop {
                let left = still_leading(&api.get(&path, "the node")?);
                if left == 0 {
                    println!("{node} leads no queue: it can be stopped");
                    return Ok(());
                }
                if Instant::now() >= deadline {
                    return Err(CliError::Failed(format!(
                        "{node} still leads {left} queue(s) after {wait} s: no other node can \
                         take them (are the other nodes running? see /api/nodes); \
                         it stays in maintenance mode"
                    )));
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        }
        MaintenanceCmd::Revive { conn } => {
            let api = conn.api();
            let node = node_name(&api)?;
            let path = format!("/nodes/{}/revive", enc(&node));
            api.call("POST", &path, None, &[], "the node")?;
            println!("{node} is out of maintenance mode: it serves clients again");
            Ok(())
        }
    }
}
