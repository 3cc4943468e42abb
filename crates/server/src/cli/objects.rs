//! `warren declare`, `delete`, `purge` and `close`.

use std::process::ExitCode;

use serde_json::{json, Value};

use super::api::{enc, Api};
use super::values::{key_value, object};
use super::{missing, CliError, InVhost};

#[derive(clap::Subcommand, Debug, Clone)]
pub enum Declare {
    /// Declares a queue (201 made, 204 it was already there, the same)
    Queue(DeclareQueue),
    /// Declares an exchange
    Exchange(DeclareExchange),
    /// Binds a queue (or an exchange) to an exchange
    Binding(BindingArgs),
}

#[derive(clap::Args, Debug, Clone)]
pub struct DeclareQueue {
    /// The queue's name
    pub name: String,
    /// Survives a broker restart (quorum and stream queues always do)
    #[arg(long)]
    pub durable: bool,
    /// Deleted when its last consumer leaves
    #[arg(long)]
    pub auto_delete: bool,
    /// Queue type (x-queue-type) [default: the vhost's default, classic]
    #[arg(long = "type", value_name = "classic|quorum|stream", value_parser = ["classic", "quorum", "stream"])]
    pub queue_type: Option<String>,
    /// An x-argument, KEY=VALUE; a JSON value keeps its type (x-max-length=10 is a number)
    #[arg(long = "argument", value_name = "KEY=VALUE", value_parser = key_value)]
    pub arguments: Vec<(String, Value)>,
    #[command(flatten)]
    pub at: InVhost,
}

#[derive(clap::Args, Debug, Clone)]
pub struct DeclareExchange {
    /// The exchange's name
    pub name: String,
    /// direct, fanout, topic, headers, x-delayed-message, ...
    #[arg(long = "type", value_name = "TYPE")]
    pub exchange_type: String,
    /// Survives a broker restart
    #[arg(long)]
    pub durable: bool,
    /// Deleted when its last binding goes
    #[arg(long)]
    pub auto_delete: bool,
    /// Clients cannot publish to it, only other exchanges
    #[arg(long)]
    pub internal: bool,
    /// An argument, KEY=VALUE (x-delayed-type=direct); a JSON value keeps its type
    #[arg(long = "argument", value_name = "KEY=VALUE", value_parser = key_value)]
    pub arguments: Vec<(String, Value)>,
    #[command(flatten)]
    pub at: InVhost,
}

#[derive(clap::Args, Debug, Clone)]
pub struct BindingArgs {
    /// The exchange messages come from
    #[arg(long)]
    pub source: String,
    /// The queue (or exchange) they go to
    #[arg(long)]
    pub destination: String,
    /// What the destination is
    #[arg(long, default_value = "queue", value_parser = ["queue", "exchange"])]
    pub destination_type: String,
    /// The binding key
    #[arg(long, default_value = "")]
    pub routing_key: String,
    /// A binding argument, KEY=VALUE (for headers exchanges: x-match=all)
    #[arg(long = "argument", value_name = "KEY=VALUE", value_parser = key_value)]
    pub arguments: Vec<(String, Value)>,
    #[command(flatten)]
    pub at: InVhost,
}

impl BindingArgs {
    /// `/bindings/{vhost}/e/{source}/{q|e}/{destination}`
    fn path(&self) -> String {
        let kind = if self.destination_type == "exchange" {
            "e"
        } else {
            "q"
        };
        format!(
            "/bindings/{}/e/{}/{kind}/{}",
            enc(&self.at.vhost),
            enc(exchange_in_path(&self.source)),
            enc(&self.destination)
        )
    }

    fn missing(&self) -> String {
        format!(
            "exchange '{}' or {} '{}' does not exist in vhost '{}': check the names, or pass --vhost",
            self.source, self.destination_type, self.destination, self.at.vhost
        )
    }
}

#[derive(clap::Subcommand, Debug, Clone)]
pub enum Delete {
    /// Deletes a queue and its messages
    Queue {
        /// The queue's name
        name: String,
        /// Only if it has no messages
        #[arg(long)]
        if_empty: bool,
        /// Only if it has no consumers
        #[arg(long)]
        if_unused: bool,
        #[command(flatten)]
        at: InVhost,
    },
    /// Deletes an exchange and its bindings
    Exchange {
        /// The exchange's name
        name: String,
        /// Only if nothing is bound to it
        #[arg(long)]
        if_unused: bool,
        #[command(flatten)]
        at: InVhost,
    },
    /// Deletes the binding(s) from --source to --destination with --routing-key
    Binding(BindingArgs),
}

/// The default exchange is "amq.default" in the API's paths.
pub fn exchange_in_path(name: &str) -> &str {
    if name.is_empty() {
        "amq.default"
    } else {
        name
    }
}

pub fn declare(d: &Declare) -> Result<ExitCode, CliError> {
    match d {
        Declare::Queue(q) => {
            let mut arguments = object(&q.arguments);
            if let Some(t) = &q.queue_type {
                arguments.insert("x-queue-type".into(), json!(t));
            }
            // RabbitMQ refuses a transient quorum or stream queue.
            let durable = q.durable || matches!(q.queue_type.as_deref(), Some("quorum" | "stream"));
            let body =
                json!({"durable": durable, "auto_delete": q.auto_delete, "arguments": arguments});
            let path = format!("/queues/{}/{}", enc(&q.at.vhost), enc(&q.name));
            let vhost_missing = format!(
                "vhost '{}' does not exist: pass --vhost (see `warren list vhosts`)",
                q.at.vhost
            );
            let r =
                q.at.conn
                    .api()
                    .call("PUT", &path, Some(&body), &[], &vhost_missing)?;
            println!("{} queue '{}'", made_or_kept(r.status), q.name);
        }
        Declare::Exchange(x) => {
            let body = json!({
                "type": x.exchange_type, "durable": x.durable, "auto_delete": x.auto_delete,
                "internal": x.internal, "arguments": object(&x.arguments),
            });
            let path = format!("/exchanges/{}/{}", enc(&x.at.vhost), enc(&x.name));
            let vhost_missing = format!(
                "vhost '{}' does not exist: pass --vhost (see `warren list vhosts`)",
                x.at.vhost
            );
            let r =
                x.at.conn
                    .api()
                    .call("PUT", &path, Some(&body), &[], &vhost_missing)?;
            println!("{} exchange '{}'", made_or_kept(r.status), x.name);
        }
        Declare::Binding(b) => {
            let body = json!({"routing_key": b.routing_key, "arguments": object(&b.arguments)});
            b.at.conn
                .api()
                .call("POST", &b.path(), Some(&body), &[], &b.missing())?;
            println!(
                "bound {} '{}' to exchange '{}' with routing key '{}'",
                b.destination_type, b.destination, b.source, b.routing_key
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn made_or_kept(status: u16) -> &'static str {
    if status == 201 {
        "declared"
    } else {
        "already there, unchanged:"
    }
}

pub fn delete(d: &Delete) -> Result<ExitCode, CliError> {
    match d {
        Delete::Queue {
            name,
            if_empty,
            if_unused,
            at,
        } => {
            let mut path = format!("/queues/{}/{}", enc(&at.vhost), enc(name));
            let conditions: Vec<&str> =
                [(*if_empty, "if-empty=true"), (*if_unused, "if-unused=true")]
                    .into_iter()
                    .filter_map(|(on, q)| on.then_some(q))
                    .collect();
            if !conditions.is_empty() {
                path = format!("{path}?{}", conditions.join("&"));
            }
            at.conn.api().call(
                "DELETE",
                &path,
                None,
                &[],
                &missing("queue", name, &at.vhost),
            )?;
            println!("deleted queue '{name}'");
        }
        Delete::Exchange {
            name,
            if_unused,
            at,
        } => {
            let mut path = format!("/exchanges/{}/{}", enc(&at.vhost), enc(name));
            if *if_unused {
                path.push_str("?if-unused=true");
            }
            at.conn.api().call(
                "DELETE",
                &path,
                None,
                &[],
                &missing("exchange", name, &at.vhost),
            )?;
            println!("deleted exchange '{name}'");
        }
        Delete::Binding(b) => delete_binding(b)?,
    }
    Ok(ExitCode::SUCCESS)
}

/// Finds the bindings between the two ends with that key, and deletes each by the
/// `properties_key` the API gave it (so bindings with arguments can be deleted too).
fn delete_binding(b: &BindingArgs) -> Result<(), CliError> {
    let api = b.at.conn.api();
    let all = api.get(&b.path(), &b.missing())?;
    let keys: Vec<String> = all
        .as_array()
        .into_iter()
        .flatten()
        .filter(|x| x.get("routing_key").and_then(Value::as_str) == Some(b.routing_key.as_str()))
        .filter_map(|x| {
            x.get("properties_key")
                .and_then(Value::as_str)
                .map(str::to_owned)
        })
        .collect();
    if keys.is_empty() {
        return Err(CliError::NotFound(format!(
            "no binding from exchange '{}' to {} '{}' with routing key '{}' in vhost '{}' \
             (see `warren list bindings`)",
            b.source, b.destination_type, b.destination, b.routing_key, b.at.vhost
        )));
    }
    for key in &keys {
        let path = format!("{}/{}", b.path(), enc(key));
        api.call("DELETE", &path, None, &[], &b.missing())?;
    }
    println!(
        "deleted {} binding(s) from exchange '{}' to {} '{}' with routing key '{}'",
        keys.len(),
        b.source,
        b.destination_type,
        b.destination,
        b.routing_key
    );
    Ok(())
}

/// `DELETE /api/queues/{vhost}/{name}/contents`
pub fn purge(at: &InVhost, queue: &str) -> Result<ExitCode, CliError> {
    let path = format!("/queues/{}/{}/contents", enc(&at.vhost), enc(queue));
    at.conn.api().call(
        "DELETE",
        &path,
        None,
        &[],
        &missing("queue", queue, &at.vhost),
    )?;
    println!("purged queue '{queue}'");
    Ok(ExitCode::SUCCESS)
}

/// `DELETE /api/connections/{name}` with the reason in `X-Reason`.
pub fn close(api: &Api, name: &str, reason: &str) -> Result<ExitCode, CliError> {
    let path = format!("/connections/{}", enc(name));
    let gone = format!(
        "connection '{name}' does not exist (it may have closed already; see `warren list connections`)"
    );
    api.call("DELETE", &path, None, &[("x-reason", reason)], &gone)?;
    println!("closed connection '{name}'");
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_exchange_has_a_name_in_paths() {
        assert_eq!(exchange_in_path(""), "amq.default");
        assert_eq!(exchange_in_path("jobs"), "jobs");
    }
}
