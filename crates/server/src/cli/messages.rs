//! `warren publish` and `warren get`, through the API's publish and get endpoints.

use std::io::Read;
use std::process::ExitCode;

use base64::Engine;
use serde_json::{json, Value};

use super::api::enc;
use super::objects::exchange_in_path;
use super::table::cell;
use super::values::{key_value, object};
use super::{missing, print_json, CliError, Format, InVhost};

#[derive(clap::Args, Debug, Clone)]
pub struct PublishArgs {
    /// The exchange [default: the default exchange, which routes by queue name]
    #[arg(long, default_value = "")]
    pub exchange: String,
    /// The routing key (with the default exchange: the queue's name)
    #[arg(long, default_value = "")]
    pub routing_key: String,
    /// The body [default: read from stdin]
    #[arg(long)]
    pub body: Option<String>,
    /// A property, KEY=VALUE: content_type=text/plain, delivery_mode=2, priority=5, ...
    #[arg(long = "property", value_name = "KEY=VALUE", value_parser = key_value)]
    pub properties: Vec<(String, Value)>,
    /// A header, KEY=VALUE; a JSON value keeps its type (x-delay=5000 is a number)
    #[arg(long = "header", value_name = "KEY=VALUE", value_parser = key_value)]
    pub headers: Vec<(String, Value)>,
    #[command(flatten)]
    pub at: InVhost,
}

/// What the get endpoint does with the messages it took.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
#[value(rename_all = "snake_case")]
pub enum AckMode {
    /// Put them back (marked redelivered): a peek
    AckRequeueTrue,
    /// Remove them from the queue
    AckRequeueFalse,
    /// Reject them back into the queue
    RejectRequeueTrue,
}

#[derive(clap::Args, Debug, Clone)]
pub struct GetArgs {
    /// The queue
    pub queue: String,
    /// How many messages at most
    #[arg(long, default_value_t = 1)]
    pub count: u32,
    /// What happens to them: the default puts them back
    #[arg(long, value_enum, default_value = "ack_requeue_true")]
    pub ackmode: AckMode,
    /// Show at most this many bytes of each body
    #[arg(long, value_name = "BYTES")]
    pub truncate: Option<u64>,
    /// Output format
    #[arg(long, value_enum, default_value_t)]
    pub format: Format,
    #[command(flatten)]
    pub at: InVhost,
}

/// The body of a publish request: text as a string, anything else in base64.
fn payload(body: Vec<u8>) -> (String, &'static str) {
    match String::from_utf8(body) {
        Ok(text) => (text, "string"),
        Err(e) => (
            base64::engine::general_purpose::STANDARD.encode(e.as_bytes()),
            "base64",
        ),
    }
}

pub fn publish(p: &PublishArgs) -> Result<ExitCode, CliError> {
    let body = match &p.body {
        Some(b) => b.clone().into_bytes(),
        None => {
            let mut buf = Vec::new();
            std::io::stdin()
                .read_to_end(&mut buf)
                .map_err(|e| CliError::Failed(format!("cannot read the body from stdin: {e}")))?;
            buf
        }
    };
    let (payload, encoding) = payload(body);
    let mut properties = object(&p.properties);
    if !p.headers.is_empty() {
        properties.insert("headers".into(), Value::Object(object(&p.headers)));
    }
    let request = json!({
        "routing_key": p.routing_key,
        "payload": payload,
        "payload_encoding": encoding,
        "properties": properties,
    });
    let path = format!(
        "/exchanges/{}/{}/publish",
        enc(&p.at.vhost),
        enc(exchange_in_path(&p.exchange))
    );
    let shown = if p.exchange.is_empty() {
        "(default)"
    } else {
        &p.exchange
    };
    let r = p.at.conn.api().call(
        "POST",
        &path,
        Some(&request),
        &[],
        &missing("exchange", shown, &p.at.vhost),
    )?;
    let routed = r
        .body
        .get("routed")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    println!("routed: {routed}");
    if routed {
        Ok(ExitCode::SUCCESS)
    } else {
        eprintln!(
            "warren publish: no queue got the message: nothing is bound to exchange {shown} with \
             routing key '{}' in vhost '{}'",
            p.routing_key, p.at.vhost
        );
        Ok(ExitCode::FAILURE)
    }
}

pub fn get(g: &GetArgs) -> Result<ExitCode, CliError> {
    let ackmode = match g.ackmode {
        AckMode::AckRequeueTrue => "ack_requeue_true",
        AckMode::AckRequeueFalse => "ack_requeue_false",
        AckMode::RejectRequeueTrue => "reject_requeue_true",
    };
    let mut request = json!({"count": g.count, "ackmode": ackmode, "encoding": "auto"});
    if let Some(t) = g.truncate {
        request["truncate"] = json!(t);
    }
    let path = format!("/queues/{}/{}/get", enc(&g.at.vhost), enc(&g.queue));
    let r = g.at.conn.api().call(
        "POST",
        &path,
        Some(&request),
        &[],
        &missing("queue", &g.queue, &g.at.vhost),
    )?;
    let messages = r.body.as_array().cloned().unwrap_or_default();
    if g.format == Format::Json {
        print_json(&Value::Array(messages));
        return Ok(ExitCode::SUCCESS);
    }
    if messages.is_empty() {
        eprintln!("queue '{}' has no ready messages", g.queue);
    }
    for (i, m) in messages.iter().enumerate() {
        print!("{}", describe(i + 1, m));
    }
    Ok(ExitCode::SUCCESS)
}

/// One message of a get, for people: a line about it, its properties, then its body.
fn describe(n: usize, m: &Value) -> String {
    let f = |k: &str| cell(m.get(k));
    let exchange = match f("exchange") {
        e if e.is_empty() => "(default)".to_owned(),
        e => format!("'{e}'"),
    };
    let mut out = format!(
        "message {n}: exchange {exchange}, routing key '{}', redelivered {}, {} bytes, {} left in the queue\n",
        f("routing_key"),
        f("redelivered"),
        f("payload_bytes"),
        f("message_count"),
    );
    if let Some(p) = m
        .get("properties")
        .filter(|p| p.as_object().is_some_and(|o| !o.is_empty()))
    {
        out.push_str(&format!("properties: {p}\n"));
    }
    if f("payload_encoding") == "base64" {
        out.push_str("body (base64): ");
    }
    out.push_str(&f("payload"));
    out.push('\n');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binary_bodies_go_as_base64() {
        assert_eq!(payload(b"hello".to_vec()), ("hello".to_owned(), "string"));
        assert_eq!(payload(vec![0xff, 0x00]), ("/wA=".to_owned(), "base64"));
    }

    #[test]
    fn a_message_is_described_in_a_few_lines() {
        let m = json!({
            "exchange": "", "routing_key": "jobs", "redelivered": true, "payload_bytes": 5,
            "message_count": 2, "properties": {"delivery_mode": 2}, "payload": "hello",
            "payload_encoding": "string",
        });
        assert_eq!(
            describe(1, &m),
            "message 1: exchange (default), routing key 'jobs', redelivered true, 5 bytes, 2 left in the queue\n\
             properties: {\"delivery_mode\":2}\n\
             hello\n"
        );
    }
}
