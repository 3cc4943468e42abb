//! A dynamic shovel's definition: the JSON value of a `shovel` runtime parameter, checked as
//! RabbitMQ 3.10's `rabbit_shovel_parameters` checks it (the same keys, defaults and texts;
//! RabbitMQ escapes `<` and `>` in the reason as HTML, Warren does not, as with policies).

use std::time::Duration;

use serde_json::{Map, Value};

/// How the shovel acknowledges at the source.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AckMode {
    /// After the destination confirmed the copy: nothing is lost (the default).
    OnConfirm,
    /// After the copy was written to the destination's socket.
    OnPublish,
    /// The source does not wait for acks at all.
    NoAck,
}

/// When the shovel deletes itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeleteAfter {
    Never,
    /// After as many messages as the source queue held when the shovel started.
    QueueLength,
    /// After this many messages.
    Count(u64),
}

/// Where messages come from.
#[derive(Clone, Debug, PartialEq)]
pub enum Source {
    /// A queue, declared durable (with `args`) if it does not exist.
    Queue {
        name: String,
        args: Map<String, Value>,
    },
    /// An exchange: the shovel binds an exclusive queue of its own to it with `key`.
    Exchange { name: String, key: String },
}

/// Where messages go.
#[derive(Clone, Debug, PartialEq)]
pub enum Destination {
    /// A queue (through the default exchange), declared durable (with `args`) if missing.
    Queue {
        name: String,
        args: Map<String, Value>,
    },
    /// An exchange, with this routing key or the message's own.
    Exchange { name: String, key: Option<String> },
    /// Neither: each message goes to the exchange and routing key it was published with.
    AsPublished,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ShovelDef {
    pub src_uris: Vec<String>,
    pub src: Source,
    pub dest_uris: Vec<String>,
    pub dest: Destination,
    pub ack_mode: AckMode,
    pub delete_after: DeleteAfter,
    pub prefetch: u16,
    pub reconnect_delay: Duration,
    pub add_forward_headers: bool,
    pub add_timestamp_header: bool,
    /// Basic properties the copies get (`delivery_mode`, `content_type`, ...).
    pub publish_properties: Map<String, Value>,
}

/// RabbitMQ's default `src-prefetch-count`.
const DEFAULT_PREFETCH: u16 = 1000;

/// Every key RabbitMQ 3.10 accepts for an AMQP 0-9-1 shovel (the unprefixed ones are its
/// older names, still accepted).
const KNOWN: &[&str] = &[
    "src-protocol",
    "dest-protocol",
    "src-uri",
    "dest-uri",
    "src-queue",
    "src-queue-args",
    "src-exchange",
    "src-exchange-key",
    "src-consumer-args",
    "src-prefetch-count",
    "prefetch-count",
    "src-delete-after",
    "delete-after",
    "dest-queue",
    "dest-queue-args",
    "dest-exchange",
    "dest-exchange-key",
    "dest-publish-properties",
    "publish-properties",
    "dest-add-forward-headers",
    "add-forward-headers",
    "dest-add-timestamp-header",
    "ack-mode",
    "reconnect-delay",
];

/// A JSON term as RabbitMQ's validation texts print it (Erlang's `~p`), as for policies.
pub(crate) use crate::http::policies::erl;

fn quoted(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_default()
}

/// Checks a shovel's value: `Err` holds RabbitMQ's lines, each its own problem (the API
/// answers them after "Validation failed").
pub fn parse(name: &str, value: &Value) -> Result<ShovelDef, Vec<String>> {
    let Value::Object(m) = value else {
        return Err(vec![format!(
            "{} is not a valid shovel definition (an object)",
            erl(value)
        )]);
    };
    let mut errors = Vec::new();
    for key in ["src-protocol", "dest-protocol"] {
        match m.get(key) {
            None => {}
            Some(Value::String(p)) if p == "amqp091" => {}
            Some(Value::String(p)) if p == "amqp10" => errors.push(format!(
                "{key} amqp10: Warren's shovels speak AMQP 0-9-1 only (amqp091)"
            )),
            Some(other) => errors.push(format!(
                "{key} should be one of [<<\"amqp10\">>,<<\"amqp091\">>], actually was {}",
                erl(other)
            )),
        }
    }
    let pair = |a: &str, b: &str| match (m.get(a), m.get(b)) {
        (None, None) => 0,
        (Some(_), Some(_)) => 2,
        _ => 1,
    };
    match pair("src-exchange", "src-queue") {
        0 => errors.push("Must specify 'src-exchange' or 'src-queue'".into()),
        2 => errors.push("Cannot specify 'src-exchange' and 'src-queue'".into()),
        _ => {}
    }
    if pair("dest-exchange", "dest-queue") == 2 {
        errors.push("Cannot specify 'dest-exchange' and 'dest-queue'".into());
    }
    let delete_after = m.get("src-delete-after").or_else(|| m.get("delete-after"));
    let ack_mode = m.get("ack-mode");
    if delete_after.is_some_and(Value::is_number)
        && ack_mode.and_then(Value::as_str) == Some("no-ack")
    {
        errors.push("Cannot specify 'no-ack' and numerical 'delete-after'".into());
    }
    let unknown: Vec<String> = m
        .iter()
        .filter(|(k, _)| !KNOWN.contains(&k.as_str()))
        .map(|(k, v)| format!("{{<<{}>>,{}}}", quoted(k), erl(v)))
        .collect();
    if !unknown.is_empty() {
        errors.push(format!(
            "Unrecognised terms [{}] in {name}",
            unknown.join(",")
        ));
    }
    let mut get = Fields {
        m,
        name,
        errors: &mut errors,
    };
    let src_uris = get.uris("src-uri");
    let dest_uris = get.uris("dest-uri");
    let src = match (get.text("src-queue"), get.text("src-exchange")) {
        (Some(name), _) => Some(Source::Queue {
            name,
            args: get.object("src-queue-args").unwrap_or_default(),
        }),
        (None, Some(name)) => Some(Source::Exchange {
            name,
            key: get.text("src-exchange-key").unwrap_or_default(),
        }),
        (None, None) => None,
    };
    get.object("src-consumer-args");
    let dest = match (get.text("dest-queue"), get.text("dest-exchange")) {
        (Some(name), _) => Destination::Queue {
            name,
            args: get.object("dest-queue-args").unwrap_or_default(),
        },
        (None, Some(name)) => Destination::Exchange {
            name,
            key: get.text("dest-exchange-key"),
        },
        (None, None) => Destination::AsPublished,
    };
    let prefetch = get
        .number("src-prefetch-count")
        .or_else(|| get.number("prefetch-count"));
    let reconnect = get.number("reconnect-delay");
    let add_forward_headers = get
        .boolean("dest-add-forward-headers")
        .or_else(|| get.boolean("add-forward-headers"))
        .unwrap_or(false);
    let add_timestamp_header = get.boolean("dest-add-timestamp-header").unwrap_or(false);
    let publish_properties = get
        .properties("dest-publish-properties")
        .or_else(|| get.properties("publish-properties"))
        .unwrap_or_default();
    let ack_mode = match ack_mode {
        None => AckMode::OnConfirm,
        Some(Value::String(s)) if s == "on-confirm" => AckMode::OnConfirm,
        Some(Value::String(s)) if s == "on-publish" => AckMode::OnPublish,
        Some(Value::String(s)) if s == "no-ack" => AckMode::NoAck,
        Some(other) => {
            errors.push(format!(
                "ack-mode should be one of [<<\"no-ack\">>,<<\"on-publish\">>,<<\"on-confirm\">>], actually was {}",
                erl(other)
            ));
            AckMode::OnConfirm
        }
    };
    let delete_key = if m.contains_key("src-delete-after") {
        "src-delete-after"
    } else {
        "delete-after"
    };
    let delete_after = match delete_after {
        None => DeleteAfter::Never,
        Some(Value::String(s)) if s == "never" => DeleteAfter::Never,
        Some(Value::String(s)) if s == "queue-length" => DeleteAfter::QueueLength,
        Some(Value::Number(n)) if n.as_u64().is_some() => {
            DeleteAfter::Count(n.as_u64().unwrap_or(0))
        }
        Some(other) => {
            errors.push(format!(
                "{delete_key} should be a number greater than or equal to 0, \"never\" or \"queue-length\", actually was {}",
                erl(other)
            ));
            DeleteAfter::Never
        }
    };
    for uri in src_uris.iter().chain(&dest_uris) {
        if let Err(e) = super::uri::check(uri) {
            errors.push(format!("{} not a valid URI: {e}", quoted(uri)));
        }
    }
    if !errors.is_empty() {
        return Err(errors);
    }
    let Some(src) = src else {
        return Err(vec!["Must specify 'src-exchange' or 'src-queue'".into()]);
    };
    Ok(ShovelDef {
        src_uris,
        src,
        dest_uris,
        dest,
        ack_mode,
        delete_after,
        // RabbitMQ takes any number; AMQP's prefetch is 16 bits (0: no limit).
        prefetch: prefetch.map_or(DEFAULT_PREFETCH, |p| {
            u16::try_from(p.max(0.0) as u64).unwrap_or(u16::MAX)
        }),
        reconnect_delay: Duration::from_secs_f64(reconnect.map_or(1.0, |s| s.clamp(0.0, 86_400.0))),
        add_forward_headers,
        add_timestamp_header,
        publish_properties,
    })
}

/// Typed reads of a definition's keys, each wrong type noted with RabbitMQ's text.
struct Fields<'a> {
    m: &'a Map<String, Value>,
    name: &'a str,
    errors: &'a mut Vec<String>,
}

impl Fields<'_> {
    fn text(&mut self, key: &str) -> Option<String> {
        match self.m.get(key)? {
            Value::String(s) => Some(s.clone()),
            other => {
                self.errors.push(format!(
                    "{key} should be binary, actually was {}",
                    erl(other)
                ));
                None
            }
        }
    }

    fn number(&mut self, key: &str) -> Option<f64> {
        match self.m.get(key)? {
            Value::Number(n) => n.as_f64(),
            other => {
                self.errors.push(format!(
                    "{key} should be a number, actually was {}",
                    erl(other)
                ));
                None
            }
        }
    }

    fn boolean(&mut self, key: &str) -> Option<bool> {
        match self.m.get(key)? {
            Value::Bool(b) => Some(*b),
            other => {
                self.errors.push(format!(
                    "{key} should be boolean, actually was {}",
                    erl(other)
                ));
                None
            }
        }
    }

    fn object(&mut self, key: &str) -> Option<Map<String, Value>> {
        match self.m.get(key)? {
            Value::Object(o) => Some(o.clone()),
            other => {
                self.errors.push(format!(
                    "{key} should be a map, actually was {}",
                    erl(other)
                ));
                None
            }
        }
    }

    /// `dest-publish-properties`: an object of basic properties.
    fn properties(&mut self, key: &str) -> Option<Map<String, Value>> {
        match self.m.get(key)? {
            Value::Object(o) => {
                for (k, v) in o {
                    if let Err(e) = super::worker::check_property(k, v) {
                        self.errors.push(format!("{key}: {e}"));
                    }
                }
                Some(o.clone())
            }
            other => {
                self.errors.push(format!("{key} not a list {}", erl(other)));
                None
            }
        }
    }

    /// `src-uri` / `dest-uri`: one URI, or a list to pick from.
    fn uris(&mut self, key: &str) -> Vec<String> {
        match self.m.get(key) {
            None => {
                self.errors
                    .push(format!("Key {} not found in {}", quoted(key), self.name));
                Vec::new()
            }
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Array(a)) if !a.is_empty() => {
                let mut out = Vec::new();
                for v in a {
                    match v {
                        Value::String(s) => out.push(s.clone()),
                        other => self.errors.push(format!(
                            "{key} should be binary, actually was {}",
                            erl(other)
                        )),
                    }
                }
                out
            }
            Some(other) => {
                self.errors
                    .push(format!("{key} should be list, actually was {}", erl(other)));
                Vec::new()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn errors(v: Value) -> Vec<String> {
        parse("s", &v).expect_err("refused")
    }

    #[test]
    fn the_defaults_are_rabbitmqs() {
        let d = parse(
            "s",
            &json!({"src-uri": "amqp://", "src-queue": "a", "dest-uri": "amqp://remote"}),
        )
        .expect("valid");
        assert_eq!(d.ack_mode, AckMode::OnConfirm);
        assert_eq!(d.delete_after, DeleteAfter::Never);
        assert_eq!(d.prefetch, 1000);
        assert_eq!(d.reconnect_delay, Duration::from_secs(1));
        assert_eq!(d.dest, Destination::AsPublished);
        assert!(!d.add_forward_headers && !d.add_timestamp_header);
        let legacy = parse(
            "s",
            &json!({"src-uri": ["amqp://a", "amqp://b"], "src-exchange": "x", "src-exchange-key": "k",
                    "dest-uri": "amqp://", "dest-exchange": "y", "delete-after": "queue-length",
                    "prefetch-count": 5, "add-forward-headers": true, "ack-mode": "on-publish"}),
        )
        .expect("the older names");
        assert_eq!(legacy.src_uris.len(), 2);
        assert_eq!(
            legacy.src,
            Source::Exchange {
                name: "x".into(),
                key: "k".into()
            }
        );
        assert_eq!(
            legacy.dest,
            Destination::Exchange {
                name: "y".into(),
                key: None
            }
        );
        assert_eq!(legacy.delete_after, DeleteAfter::QueueLength);
        assert_eq!((legacy.prefetch, legacy.add_forward_headers), (5, true));
        assert_eq!(legacy.ack_mode, AckMode::OnPublish);
    }

    #[test]
    fn refusals_say_what_rabbitmq_says() {
        assert_eq!(
            errors(json!({"src-uri": "amqp://", "src-queue": "a"})),
            ["Key \"dest-uri\" not found in s"]
        );
        assert_eq!(
            errors(json!({"src-uri": "amqp://", "dest-uri": "amqp://"})),
            ["Must specify 'src-exchange' or 'src-queue'"]
        );
        assert_eq!(
            errors(
                json!({"src-uri": "amqp://", "src-queue": "a", "src-exchange": "x", "dest-uri": "amqp://"})
            ),
            ["Cannot specify 'src-exchange' and 'src-queue'"]
        );
        assert_eq!(
            errors(
                json!({"src-uri": "amqp://", "src-queue": "a", "dest-queue": "b", "dest-exchange": "x", "dest-uri": "amqp://"})
            ),
            ["Cannot specify 'dest-exchange' and 'dest-queue'"]
        );
        assert_eq!(
            errors(
                json!({"src-uri": "amqp://", "src-queue": "a", "dest-uri": "amqp://", "foo": 1})
            ),
            ["Unrecognised terms [{<<\"foo\">>,1}] in s"]
        );
        assert_eq!(
            errors(json!({"src-uri": "amqp://", "src-queue": "a", "dest-uri": "amqp://", "ack-mode": "sometimes"})),
            ["ack-mode should be one of [<<\"no-ack\">>,<<\"on-publish\">>,<<\"on-confirm\">>], actually was <<\"sometimes\">>"]
        );
        assert_eq!(
            errors(json!({"src-uri": "amqp://", "src-queue": "a", "dest-uri": "amqp://", "src-delete-after": -1})),
            ["src-delete-after should be a number greater than or equal to 0, \"never\" or \"queue-length\", actually was -1"]
        );
        assert_eq!(
            errors(
                json!({"src-uri": "amqp://", "src-queue": "a", "dest-uri": "amqp://", "src-delete-after": 5, "ack-mode": "no-ack"})
            ),
            ["Cannot specify 'no-ack' and numerical 'delete-after'"]
        );
        assert_eq!(
            errors(json!({"src-uri": "amqp://", "src-queue": 5, "dest-uri": "amqp://"})),
            ["src-queue should be binary, actually was 5"]
        );
        assert_eq!(
            errors(json!({"src-uri": "amqp://", "src-queue": "a", "dest-uri": 5})),
            ["dest-uri should be list, actually was 5"]
        );
        assert_eq!(
            errors(
                json!({"src-uri": "amqp://", "src-queue": "a", "dest-uri": "amqp://", "src-prefetch-count": "x"})
            ),
            ["src-prefetch-count should be a number, actually was <<\"x\">>"]
        );
        assert_eq!(
            errors(
                json!({"src-uri": "amqp://", "src-queue": "a", "dest-uri": "amqp://", "dest-add-forward-headers": "x"})
            ),
            ["dest-add-forward-headers should be boolean, actually was <<\"x\">>"]
        );
        assert_eq!(
            errors(
                json!({"src-uri": "amqp://", "src-queue": "a", "dest-uri": "amqp://", "dest-publish-properties": "x"})
            ),
            ["dest-publish-properties not a list <<\"x\">>"]
        );
        assert_eq!(
            errors(json!({"src-uri": "foo://x", "src-queue": "a", "dest-uri": "amqp://"})),
            ["\"foo://x\" not a valid URI: {{unexpected_uri_scheme,\"foo\"},\"foo://x\"}"]
        );
        assert_eq!(errors(json!("hello")).len(), 1);
    }
}
