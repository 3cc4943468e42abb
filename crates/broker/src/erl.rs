//! Erlang-flavoured helpers, so error texts and comparisons match RabbitMQ's exactly.
//!
//! RabbitMQ stores an AMQP field as `{Type, Value}` with Erlang values, compares argument
//! values with Erlang's `==` (numbers compare by value across integer and float) and prints
//! them with `~p` / `~s`.

use std::fmt::Write as _;

use warren_codec::FieldValue;

/// `rabbit_misc:rs/1` for a queue or exchange: `queue 'q' in vhost '/'`.
pub fn rs(kind: &str, name: &str, vhost: &str) -> String {
    format!("{kind} '{name}' in vhost '{vhost}'")
}

/// The value of an integer argument, for RabbitMQ's `?INTEGER_ARG_TYPES` (byte, short,
/// signedint, long, unsignedbyte, unsignedshort, unsignedint). Timestamps, decimals and
/// floats are not integers there.
pub fn int_arg(v: &FieldValue) -> Option<i64> {
    v.as_i64()
}

/// `rabbit_misc:type_class/1`: integer types (and decimal) are one class, floats another.
pub fn type_class(v: &FieldValue) -> &'static str {
    match v {
        FieldValue::I8(_)
        | FieldValue::U8(_)
        | FieldValue::I16(_)
        | FieldValue::U16(_)
        | FieldValue::I32(_)
        | FieldValue::U32(_)
        | FieldValue::I64(_)
        | FieldValue::U64(_)
        | FieldValue::Decimal { .. } => "int",
        FieldValue::F32(_) | FieldValue::F64(_) => "float",
        other => other.type_name(),
    }
}

enum Num {
    Int(i128),
    Float(f64),
}

fn num(v: &FieldValue) -> Option<Num> {
    match v {
        FieldValue::Timestamp(t) => Some(Num::Int(i128::from(*t))),
        FieldValue::F32(f) => Some(Num::Float(f64::from(*f))),
        FieldValue::F64(f) => Some(Num::Float(*f)),
        other => other.as_i64().map(|i| Num::Int(i128::from(i))),
    }
}

/// Erlang's `==` on the values (not the type tags) of two fields: integers and floats compare
/// by value, strings and byte arrays (both binaries) by bytes; inside arrays and tables the
/// type tags must match too, as they are part of the Erlang terms there.
pub fn value_eq(a: &FieldValue, b: &FieldValue) -> bool {
    if let (Some(x), Some(y)) = (num(a), num(b)) {
        return match (x, y) {
            (Num::Int(x), Num::Int(y)) => x == y,
            (Num::Float(x), Num::Float(y)) => x == y,
            // Erlang compares an integer and a float by value.
            (Num::Int(i), Num::Float(f)) | (Num::Float(f), Num::Int(i)) => (i as f64) == f,
        };
    }
    match (a, b) {
        (
            FieldValue::LongStr(x) | FieldValue::ByteArray(x),
            FieldValue::LongStr(y) | FieldValue::ByteArray(y),
        ) => x == y,
        (FieldValue::Bool(x), FieldValue::Bool(y)) => x == y,
        (FieldValue::Void, FieldValue::Void) => true,
        (FieldValue::Decimal { .. }, FieldValue::Decimal { .. }) => a == b,
        (FieldValue::Array(x), FieldValue::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| typed_eq(p, q))
        }
        (FieldValue::Table(x), FieldValue::Table(y)) => {
            x.len() == y.len()
                && x.iter()
                    .zip(y.iter())
                    .all(|((k1, v1), (k2, v2))| k1 == k2 && typed_eq(v1, v2))
        }
        _ => false,
    }
}

/// `{Type, Value} == {Type2, Value2}` in Erlang.
fn typed_eq(a: &FieldValue, b: &FieldValue) -> bool {
    a.type_name() == b.type_name() && value_eq(a, b)
}

/// How `~p` / `~s` print a value in RabbitMQ's texts (strings bare, numbers plain).
pub fn val(v: &FieldValue) -> String {
    v.to_string()
}

/// `~p` of an Erlang string: double quotes, with `"` and `\` escaped.
pub fn quoted(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}

/// `~p` of an Erlang binary: `<<"abc">>`.
pub fn binary(s: &[u8]) -> String {
    let mut out = String::from("<<");
    match std::str::from_utf8(s) {
        Ok(text) if text.chars().all(|c| (' '..='~').contains(&c)) => out.push_str(&quoted(text)),
        _ => {
            for (i, b) in s.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                let _ = write!(out, "{b}");
            }
        }
    }
    out.push_str(">>");
    out
}

/// `~p` of a `{Type, Value}` pair's value: binaries as `<<"...">>`, others as printed.
pub fn term(v: &FieldValue) -> String {
    match v {
        FieldValue::LongStr(b) | FieldValue::ByteArray(b) => binary(b),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    #[test]
    fn erlang_equality() {
        assert!(value_eq(&FieldValue::I32(10), &FieldValue::I64(10)));
        assert!(value_eq(&FieldValue::I64(10), &FieldValue::F64(10.0)));
        assert!(!value_eq(&FieldValue::I64(10), &FieldValue::long_str("10")));
        assert!(value_eq(
            &FieldValue::long_str("a"),
            &FieldValue::ByteArray(Bytes::from_static(b"a"))
        ));
        assert!(!value_eq(
            &FieldValue::Array(vec![FieldValue::I32(1)]),
            &FieldValue::Array(vec![FieldValue::I64(1)])
        ));
        assert_eq!(type_class(&FieldValue::U8(1)), "int");
        assert_eq!(type_class(&FieldValue::F32(1.0)), "float");
        assert_eq!(type_class(&FieldValue::long_str("x")), "longstr");
    }

    #[test]
    fn printing() {
        assert_eq!(quoted("a\"b"), "\"a\\\"b\"");
        assert_eq!(binary(b"foo"), "<<\"foo\">>");
        assert_eq!(binary(&[0, 255]), "<<0,255>>");
        assert_eq!(term(&FieldValue::I64(5)), "5");
        assert_eq!(rs("queue", "q", "/"), "queue 'q' in vhost '/'");
    }
}
