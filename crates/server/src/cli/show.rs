//! `warren status` and `warren list ...`.

use std::process::ExitCode;

use serde_json::Value;

use super::api::{enc, Api};
use super::table::{cell, col, render, Column};
use super::{print_json, CliError, Conn, Format};

/// What `warren list` lists.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum What {
    Queues,
    Exchanges,
    Bindings,
    Connections,
    Channels,
    Consumers,
    Vhosts,
    Users,
}

#[derive(clap::Args, Debug, Clone)]
pub struct ListArgs {
    /// What to list
    #[arg(value_enum)]
    pub what: What,
    #[command(flatten)]
    pub conn: Conn,
    /// Virtual host (not for vhosts and users)
    #[arg(long, default_value = "/")]
    pub vhost: String,
    /// Only names matching this regular expression (the API's `name` and `use_regex`)
    #[arg(long, value_name = "REGEX")]
    pub filter: Option<String>,
    /// Output format: an aligned table, or the API's JSON (one array)
    #[arg(long, value_enum, default_value_t)]
    pub format: Format,
}

/// `GET /api/overview`, summed up.
pub fn status(api: &Api, format: Format) -> Result<ExitCode, CliError> {
    let o = api.get("/overview", "the overview")?;
    if format == Format::Json {
        print_json(&o);
        return Ok(ExitCode::SUCCESS);
    }
    let s = |path: &str| cell(path.split('.').try_fold(&o, |v, k| v.get(k)));
    let product = match o.get("product_name").and_then(Value::as_str) {
        Some(p) => format!("{p} {}", s("product_version")),
        None => format!("RabbitMQ {}", s("rabbitmq_version")),
    };
    let listeners: Vec<String> = o
        .get("listeners")
        .and_then(Value::as_array)
        .map(|l| {
            l.iter()
                .map(|x| format!("{} {}", cell(x.get("protocol")), cell(x.get("port"))))
                .collect()
        })
        .unwrap_or_default();
    let lines = [
        (
            "version",
            format!("{product} (management API {})", s("management_version")),
        ),
        ("node", s("node")),
        ("queues", s("object_totals.queues")),
        ("exchanges", s("object_totals.exchanges")),
        ("connections", s("object_totals.connections")),
        ("channels", s("object_totals.channels")),
        ("consumers", s("object_totals.consumers")),
        ("messages ready", s("queue_totals.messages_ready")),
        (
            "messages unacked",
            s("queue_totals.messages_unacknowledged"),
        ),
        ("listeners", listeners.join(", ")),
    ];
    for (k, v) in lines {
        println!("{:<17} {v}", format!("{k}:"));
    }
    Ok(ExitCode::SUCCESS)
}

const QUEUE_COLUMNS: &[Column] = &[
    col("name", "name"),
    col("type", "type"),
    col("ready", "messages_ready"),
    col("unacked", "messages_unacknowledged"),
    col("consumers", "consumers"),
    col("oldest_ready_s", "oldest_ready_age_seconds"),
    col("state", "state"),
];
const EXCHANGE_COLUMNS: &[Column] = &[
    col("name", "name"),
    col("type", "type"),
    col("durable", "durable"),
    col("auto_delete", "auto_delete"),
    col("internal", "internal"),
];
const BINDING_COLUMNS: &[Column] = &[
    col("source", "source"),
    col("destination", "destination"),
    col("destination_type", "destination_type"),
    col("routing_key", "routing_key"),
    col("arguments", "arguments"),
];
const CONNECTION_COLUMNS: &[Column] = &[
    col("name", "name"),
    col("user", "user"),
    col("vhost", "vhost"),
    col("channels", "channels"),
    col("state", "state"),
    col("client", "client_properties.product"),
];
const CHANNEL_COLUMNS: &[Column] = &[
    col("name", "name"),
    col("user", "user"),
    col("consumers", "consumer_count"),
    col("unacked", "messages_unacknowledged"),
    col("prefetch", "prefetch_count"),
    col("confirm", "confirm"),
    col("state", "state"),
];
const CONSUMER_COLUMNS: &[Column] = &[
    col("queue", "queue.name"),
    col("consumer_tag", "consumer_tag"),
    col("channel", "channel_details.name"),
    col("ack_required", "ack_required"),
    col("prefetch", "prefetch_count"),
    col("active", "active"),
];
const VHOST_COLUMNS: &[Column] = &[
    col("name", "name"),
    col("messages", "messages"),
    col("ready", "messages_ready"),
    col("unacked", "messages_unacknowledged"),
];
const USER_COLUMNS: &[Column] = &[col("name", "name"), col("tags", "tags")];

/// `warren list WHAT`: every item (all pages), as a table or as JSON.
pub fn list(a: &ListArgs) -> Result<ExitCode, CliError> {
    let api = a.conn.api();
    let v = enc(&a.vhost);
    let vhost_missing = format!(
        "vhost '{}' does not exist (see `warren list vhosts`; pass --vhost)",
        a.vhost
    );
    let (path, paged, columns) = match a.what {
        What::Queues => (format!("/queues/{v}"), true, QUEUE_COLUMNS),
        What::Exchanges => (format!("/exchanges/{v}"), true, EXCHANGE_COLUMNS),
        What::Bindings => (format!("/bindings/{v}"), false, BINDING_COLUMNS),
        What::Connections => (format!("/vhosts/{v}/connections"), true, CONNECTION_COLUMNS),
        What::Channels => (format!("/vhosts/{v}/channels"), true, CHANNEL_COLUMNS),
        What::Consumers => (format!("/consumers/{v}"), false, CONSUMER_COLUMNS),
        What::Vhosts => ("/vhosts".to_owned(), true, VHOST_COLUMNS),
        What::Users => ("/users".to_owned(), false, USER_COLUMNS),
    };
    let items = if paged {
        api.list(&path, a.filter.as_deref(), &vhost_missing)?
    } else {
        let all = match api.get(&path, &vhost_missing)? {
            Value::Array(all) => all,
            other => {
                return Err(CliError::Failed(format!(
                    "GET {path}: expected a list, got {other}"
                )))
            }
        };
        // These endpoints do not page: the filter is applied here, to the field that names them.
        filter_here(all, a.what, a.filter.as_deref())?
    };
    if a.format == Format::Json {
        print_json(&Value::Array(items));
        return Ok(ExitCode::SUCCESS);
    }
    // The oldest ready message's age is Warren's own field: shown when the broker has it.
    let columns: Vec<Column> = columns
        .iter()
        .filter(|c| {
            c.field != "oldest_ready_age_seconds" || items.iter().any(|i| i.get(c.field).is_some())
        })
        .copied()
        .collect();
    print!("{}", render(&columns, &items));
    Ok(ExitCode::SUCCESS)
}

/// The `--filter` of lists that the API does not filter (bindings, consumers, users).
fn filter_here(
    items: Vec<Value>,
    what: What,
    filter: Option<&str>,
) -> Result<Vec<Value>, CliError> {
    let Some(f) = filter else {
        return Ok(items);
    };
    let re = regex_lite::Regex::new(f)
        .map_err(|e| CliError::Usage(format!("--filter is not a regular expression: {e}")))?;
    let names = |v: &Value| -> Vec<String> {
        let s = |k: &str| cell(k.split('.').try_fold(v, |v, k| v.get(k)));
        match what {
            What::Bindings => vec![s("source"), s("destination")],
            What::Consumers => vec![s("queue.name"), s("consumer_tag")],
            _ => vec![s("name")],
        }
    };
    Ok(items
        .into_iter()
        .filter(|v| names(v).iter().any(|n| re.is_match(n)))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn unpaged_lists_are_filtered_by_their_names() {
        let b = vec![
            json!({"source": "jobs.x", "destination": "a"}),
            json!({"source": "other", "destination": "jobs"}),
            json!({"source": "other", "destination": "b"}),
        ];
        let kept = filter_here(b, What::Bindings, Some("^jobs")).unwrap();
        assert_eq!(kept.len(), 2);
        let bad = filter_here(vec![], What::Users, Some("("));
        assert!(matches!(bad, Err(CliError::Usage(_))));
    }
}
