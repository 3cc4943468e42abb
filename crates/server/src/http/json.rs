//! AMQP field tables and message properties as the management API writes and reads them in
//! JSON, with RabbitMQ's conversions: strings and numbers as themselves, tables as objects;
//! from JSON, integers become signed 64-bit (`l`) and strings long strings.

use bytes::Bytes;
use serde_json::{Map, Number, Value};
use warren_codec::properties::BasicProperties;
use warren_codec::{FieldTable, FieldValue, ShortStr};

/// Deepest nesting accepted from a client (a table or array inside another).
const MAX_DEPTH: usize = 32;

pub fn table(t: &FieldTable) -> Value {
    let mut m = Map::new();
    for (k, v) in t.iter() {
        m.insert(k.to_string(), value(v));
    }
    Value::Object(m)
}

pub fn value(v: &FieldValue) -> Value {
    match v {
        FieldValue::Bool(b) => Value::Bool(*b),
        FieldValue::I8(n) => (*n).into(),
        FieldValue::U8(n) => (*n).into(),
        FieldValue::I16(n) => (*n).into(),
        FieldValue::U16(n) => (*n).into(),
        FieldValue::I32(n) => (*n).into(),
        FieldValue::U32(n) => (*n).into(),
        FieldValue::I64(n) => (*n).into(),
        FieldValue::U64(n) => (*n).into(),
        FieldValue::F32(f) => Number::from_f64(f64::from(*f)).map_or(Value::Null, Value::Number),
        FieldValue::F64(f) => Number::from_f64(*f).map_or(Value::Null, Value::Number),
        FieldValue::Decimal { scale, value } => {
            let f = f64::from(*value) / 10f64.powi(i32::from(*scale));
            Number::from_f64(f).map_or(Value::Null, Value::Number)
        }
        FieldValue::LongStr(b) | FieldValue::ByteArray(b) => {
            Value::String(String::from_utf8_lossy(b).into_owned())
        }
        FieldValue::Array(a) => Value::Array(a.iter().map(value).collect()),
        FieldValue::Timestamp(t) => (*t).into(),
        FieldValue::Table(t) => table(t),
        FieldValue::Void => Value::Null,
    }
}

/// A JSON object as a field table (queue and binding arguments, headers).
pub fn to_table(v: &Value) -> Result<FieldTable, String> {
    to_table_at(v, 0)
}

fn to_table_at(v: &Value, depth: usize) -> Result<FieldTable, String> {
    match v {
        Value::Null => Ok(FieldTable::new()),
        Value::Object(m) => {
            let mut t = FieldTable::new();
            for (k, v) in m {
                let key = ShortStr::try_from_str(k.as_str())
                    .map_err(|_| format!("argument name too long: {k:.40}..."))?;
                t.0.push((key, to_value(v, depth + 1)?));
            }
            Ok(t)
        }
        other => Err(format!("expected an object, got {other}")),
    }
}

fn to_value(v: &Value, depth: usize) -> Result<FieldValue, String> {
    if depth > MAX_DEPTH {
        return Err("arguments nested too deeply".into());
    }
    Ok(match v {
        Value::Null => FieldValue::Void,
        Value::Bool(b) => FieldValue::Bool(*b),
        Value::Number(n) => match (n.as_i64(), n.as_f64()) {
            (Some(i), _) => FieldValue::I64(i),
            (None, Some(f)) => FieldValue::F64(f),
            (None, None) => return Err(format!("number out of range: {n}")),
        },
        Value::String(s) => FieldValue::LongStr(Bytes::copy_from_slice(s.as_bytes())),
        Value::Array(a) => FieldValue::Array(
            a.iter()
                .map(|v| to_value(v, depth + 1))
                .collect::<Result<_, _>>()?,
        ),
        Value::Object(_) => FieldValue::Table(to_table_at(v, depth + 1)?),
    })
}

/// Message properties as RabbitMQ's `POST /api/queues/.../get` shows them (only those set;
/// none at all is an empty array there, not an object).
pub fn properties(raw: &Bytes) -> Value {
    let Ok(p) = BasicProperties::decode_bytes(raw.clone()) else {
        return Value::Array(Vec::new());
    };
    if p == BasicProperties::default() {
        return Value::Array(Vec::new());
    }
    let mut m = Map::new();
    let mut s = |k: &str, v: &Option<ShortStr>| {
        if let Some(v) = v {
            m.insert(k.into(), Value::String(v.to_string()));
        }
    };
    s("content_type", &p.content_type);
    s("content_encoding", &p.content_encoding);
    s("correlation_id", &p.correlation_id);
    s("reply_to", &p.reply_to);
    s("expiration", &p.expiration);
    s("message_id", &p.message_id);
    s("type", &p.kind);
    s("user_id", &p.user_id);
    s("app_id", &p.app_id);
    s("cluster_id", &p.cluster_id);
    if let Some(h) = &p.headers {
        m.insert("headers".into(), table(h));
    }
    if let Some(d) = p.delivery_mode {
        m.insert("delivery_mode".into(), d.into());
    }
    if let Some(pr) = p.priority {
        m.insert("priority".into(), pr.into());
    }
    if let Some(t) = p.timestamp {
        m.insert("timestamp".into(), t.into());
    }
    Value::Object(m)
}

/// The `properties` object of `POST /api/exchanges/.../publish` as raw AMQP properties.
pub fn to_properties(v: &Value) -> Result<Bytes, String> {
    let Some(m) = v.as_object() else {
        return match v {
            Value::Null => Ok(BasicProperties::default().encode()),
            _ => Err("properties must be an object".into()),
        };
    };
    let mut p = BasicProperties::default();
    for (k, v) in m {
        let text = || -> Result<ShortStr, String> {
            let s = match v {
                Value::String(s) => s.clone(),
                Value::Number(n) => n.to_string(),
                _ => return Err(format!("property {k} must be a string")),
            };
            ShortStr::try_from_str(s.as_str()).map_err(|_| format!("property {k} is too long"))
        };
        let small = |max: u64| -> Result<u8, String> {
            v.as_u64()
                .filter(|n| *n <= max)
                .and_then(|n| u8::try_from(n).ok())
                .ok_or_else(|| format!("property {k} must be an integer from 0 to {max}"))
        };
        match k.as_str() {
            "content_type" => p.content_type = Some(text()?),
            "content_encoding" => p.content_encoding = Some(text()?),
            "correlation_id" => p.correlation_id = Some(text()?),
            "reply_to" => p.reply_to = Some(text()?),
            "expiration" => p.expiration = Some(text()?),
            "message_id" => p.message_id = Some(text()?),
            "type" => p.kind = Some(text()?),
            "user_id" => p.user_id = Some(text()?),
            "app_id" => p.app_id = Some(text()?),
            "cluster_id" => p.cluster_id = Some(text()?),
            "delivery_mode" => p.delivery_mode = Some(small(2)?),
            "priority" => p.priority = Some(small(255)?),
            "timestamp" => {
                p.timestamp = Some(
                    v.as_u64()
                        .ok_or_else(|| "property timestamp must be an integer".to_string())?,
                )
            }
            "headers" => p.headers = Some(to_table(v)?),
            other => return Err(format!("unknown property {other}")),
        }
    }
    Ok(p.encode())
}

/// A JSON boolean as RabbitMQ's management API reads one (`rabbit_mgmt_util:parse_bool`):
/// `true`, `false`, or the strings "true" and "false".
pub fn boolean(v: &Value) -> Option<bool> {
    match v {
        Value::Bool(b) => Some(*b),
        Value::String(s) if s == "true" => Some(true),
        Value::String(s) if s == "false" => Some(false),
        _ => None,
    }
}

/// A non-negative integer as RabbitMQ's management API reads one (`rabbit_mgmt_util:parse_int`):
/// a JSON number (a fraction is truncated) or a string of digits (rabbitmqadmin sends `"1"`).
pub fn integer(v: &Value) -> Option<u64> {
    match v {
        Value::Number(n) => n.as_u64().or_else(|| {
            n.as_f64()
                .filter(|f| f.is_finite() && *f >= 0.0 && *f < u64::MAX as f64)
                .map(|f| f.trunc() as u64)
        }),
        Value::String(s) => s.parse().ok(),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn arguments_round_trip_as_rabbitmq_types() {
        let v = json!({"x-message-ttl": 60000, "x-dead-letter-exchange": "dlx",
                       "x-ratio": 0.5, "flag": true, "list": [1, "a"], "nested": {"k": null}});
        let t = to_table(&v).unwrap();
        assert_eq!(t.get("x-message-ttl"), Some(&FieldValue::I64(60000)));
        assert_eq!(
            t.get("x-dead-letter-exchange"),
            Some(&FieldValue::LongStr(Bytes::from_static(b"dlx")))
        );
        assert_eq!(table(&t), v);
    }

    #[test]
    fn rejects_what_is_not_a_table() {
        assert!(to_table(&json!([1, 2])).is_err());
        let mut deep = json!(1);
        for _ in 0..100 {
            deep = json!({ "a": deep });
        }
        assert!(to_table(&deep).is_err());
    }

    #[test]
    fn properties_round_trip() {
        let v = json!({"delivery_mode": 2, "headers": {"x-n": 1}, "content_type": "text/plain",
                       "priority": 3, "timestamp": 1700000000});
        let raw = to_properties(&v).unwrap();
        assert_eq!(properties(&raw), v);
        assert!(to_properties(&json!({"delivery_mode": 7})).is_err());
        assert!(to_properties(&json!({"bogus": 1})).is_err());
    }

    #[test]
    fn booleans_and_integers_as_rabbitmq_reads_them() {
        assert_eq!(boolean(&json!(true)), Some(true));
        assert_eq!(boolean(&json!("false")), Some(false));
        assert_eq!(boolean(&json!("yes")), None);
        assert_eq!(boolean(&json!(1)), None);
        assert_eq!(integer(&json!(3)), Some(3));
        assert_eq!(integer(&json!(2.7)), Some(2));
        assert_eq!(integer(&json!("12")), Some(12));
        assert_eq!(integer(&json!("1.5")), None);
        assert_eq!(integer(&json!(-1)), None);
        assert_eq!(integer(&json!(true)), None);
    }
}
