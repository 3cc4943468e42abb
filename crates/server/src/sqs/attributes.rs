//! Message attributes: SQS's typed name/value pairs, carried as AMQP headers, and the MD5
//! digests SQS answers with (the SDKs check them).

use md5::{Digest, Md5};
use serde_json::{json, Map, Value};
use warren_codec::{FieldTable, FieldValue, ShortStr};

use super::error::SqsError;

/// The header that keeps each attribute's SQS data type where the AMQP type does not say it
/// (`Number`, and custom types such as `String.json`): a table of name -> data type.
pub const TYPES_HEADER: &str = "x-sqs-data-types";

/// One attribute as SendMessage gives it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attribute {
    pub name: String,
    /// `String`, `Number` or `Binary`, with an optional `.custom` suffix.
    pub data_type: String,
    pub value: AttrValue,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AttrValue {
    Text(String),
    Binary(Vec<u8>),
}

/// Longest attribute name: SQS allows 256 bytes, an AMQP header name (a shortstr) 255.
pub const MAX_NAME: usize = 255;

/// SQS's limit: 10 attributes per message.
pub const MAX_ATTRIBUTES: usize = 10;

/// Reads `MessageAttributes` of a request (`{"name": {"DataType", "StringValue" | "BinaryValue"}}`).
pub fn parse(v: Option<&Value>) -> Result<Vec<Attribute>, SqsError> {
    let Some(v) = v else { return Ok(Vec::new()) };
    let m = v
        .as_object()
        .ok_or_else(|| SqsError::invalid_parameter("MessageAttributes must be a map"))?;
    if m.len() > MAX_ATTRIBUTES {
        return Err(SqsError::invalid_parameter(format!(
            "Number of message attributes [{}] exceeds the allowed maximum [{MAX_ATTRIBUTES}].",
            m.len()
        )));
    }
    let mut out = Vec::with_capacity(m.len());
    for (name, a) in m {
        if name.is_empty()
            || name.len() > MAX_NAME
            || name.starts_with("x-")
            || name.starts_with("AWS.")
            || name.starts_with("Amazon.")
        {
            return Err(SqsError::invalid_parameter(format!(
                "Message attribute name '{name}' is reserved or invalid."
            )));
        }
        let data_type = a
            .get("DataType")
            .and_then(Value::as_str)
            .ok_or_else(|| {
                SqsError::invalid_parameter(format!(
                    "The message attribute '{name}' must contain a non-empty attribute type."
                ))
            })?
            .to_owned();
        let base = data_type.split('.').next().unwrap_or_default();
        let value = match base {
            "String" | "Number" => AttrValue::Text(
                a.get("StringValue")
                    .and_then(Value::as_str)
                    .ok_or_else(|| {
                        SqsError::invalid_parameter(format!(
                            "The message attribute '{name}' must contain a non-empty message attribute value for message attribute type '{base}'."
                        ))
                    })?
                    .to_owned(),
            ),
            "Binary" => {
                let b64 = a.get("BinaryValue").and_then(Value::as_str).ok_or_else(|| {
                    SqsError::invalid_parameter(format!(
                        "The message attribute '{name}' must contain a non-empty message attribute value for message attribute type 'Binary'."
                    ))
                })?;
                AttrValue::Binary(
                    base64::Engine::decode(&base64::engine::general_purpose::STANDARD, b64)
                        .map_err(|_| {
                            SqsError::invalid_parameter(format!(
                                "The message attribute '{name}' has an invalid binary value."
                            ))
                        })?,
                )
            }
            _ => {
                return Err(SqsError::invalid_parameter(format!(
                    "The type of message attribute '{name}' is invalid. You must use only the following supported type prefixes: Binary, Number, String."
                )))
            }
        };
        if base == "Number" {
            if let AttrValue::Text(t) = &value {
                if t.trim().parse::<f64>().is_err() {
                    return Err(SqsError::invalid_parameter(format!(
                        "Can't cast the value of message (user) attribute '{name}' to a number."
                    )));
                }
            }
        }
        out.push(Attribute {
            name: name.clone(),
            data_type,
            value,
        });
    }
    Ok(out)
}

/// The size SQS counts against the 256 KiB limit: each name, type and value.
pub fn size(attrs: &[Attribute]) -> usize {
    attrs
        .iter()
        .map(|a| {
            a.name.len()
                + a.data_type.len()
                + match &a.value {
                    AttrValue::Text(t) => t.len(),
                    AttrValue::Binary(b) => b.len(),
                }
        })
        .sum()
}

/// AWS's MD5OfMessageAttributes: the attributes sorted by name, each as its name, its data
/// type (each a 4-byte big-endian length and the UTF-8 bytes), a transport byte (1 for a
/// string value, 2 for a binary one) and the value (length and bytes); the MD5 of it all, in
/// lower-case hex. `None` for no attributes (SQS then sends no digest).
pub fn md5_of_attributes(attrs: &[Attribute]) -> Option<String> {
    if attrs.is_empty() {
        return None;
    }
    let mut sorted: Vec<&Attribute> = attrs.iter().collect();
    sorted.sort_by(|a, b| a.name.as_bytes().cmp(b.name.as_bytes()));
    let mut h = Md5::new();
    let field = |h: &mut Md5, bytes: &[u8]| {
        h.update((bytes.len() as u32).to_be_bytes());
        h.update(bytes);
    };
    for a in sorted {
        field(&mut h, a.name.as_bytes());
        field(&mut h, a.data_type.as_bytes());
        match &a.value {
            AttrValue::Text(t) => {
                h.update([1u8]);
                field(&mut h, t.as_bytes());
            }
            AttrValue::Binary(b) => {
                h.update([2u8]);
                field(&mut h, b);
            }
        }
    }
    Some(hex::encode(h.finalize()))
}

pub fn md5_hex(data: &[u8]) -> String {
    hex::encode(Md5::digest(data))
}

/// Puts the attributes into AMQP headers: a string as a long string, a binary as a byte
/// array, and every type AMQP cannot tell apart from these in [`TYPES_HEADER`].
pub fn to_headers(attrs: &[Attribute], headers: &mut FieldTable) {
    let mut types = FieldTable::new();
    for a in attrs {
        let value = match &a.value {
            AttrValue::Text(t) => FieldValue::long_str(t),
            AttrValue::Binary(b) => FieldValue::ByteArray(bytes::Bytes::copy_from_slice(b)),
        };
        // Names are at most 255 bytes (checked in `parse`): a shortstr holds them.
        let Ok(key) = ShortStr::try_from_str(&a.name) else {
            continue;
        };
        if a.data_type != "String" && a.data_type != "Binary" {
            types.insert(key.clone(), FieldValue::long_str(&a.data_type));
        }
        headers.insert(key, value);
    }
    if !types.is_empty() {
        headers.insert(
            ShortStr::from_static(TYPES_HEADER),
            FieldValue::Table(types),
        );
    }
}

/// Reads message attributes back from AMQP headers: what SQS sent, and what an AMQP
/// publisher put there (strings, byte arrays, numbers, booleans as strings); `x-` headers
/// are the broker's and stay out, and so do tables and arrays.
pub fn from_headers(headers: Option<&FieldTable>) -> Vec<Attribute> {
    let Some(h) = headers else { return Vec::new() };
    let types = h.get(TYPES_HEADER).and_then(FieldValue::as_table);
    let mut out = Vec::new();
    for (k, v) in h.iter() {
        let name = k.as_str();
        if name.starts_with("x-") || out.len() >= MAX_ATTRIBUTES {
            continue;
        }
        let given = types
            .and_then(|t| t.get(name))
            .and_then(FieldValue::as_str)
            .map(str::to_owned);
        let (kind, value) = match v {
            FieldValue::LongStr(_) => match v.as_str() {
                Some(s) => ("String", AttrValue::Text(s.to_owned())),
                None => continue,
            },
            FieldValue::ByteArray(b) => ("Binary", AttrValue::Binary(b.to_vec())),
            FieldValue::Bool(b) => ("String", AttrValue::Text(b.to_string())),
            FieldValue::F32(f) => ("Number", AttrValue::Text(f.to_string())),
            FieldValue::F64(f) => ("Number", AttrValue::Text(f.to_string())),
            other => match other.as_i64() {
                Some(n) => ("Number", AttrValue::Text(n.to_string())),
                None => continue,
            },
        };
        out.push(Attribute {
            name: name.to_owned(),
            data_type: given.unwrap_or_else(|| kind.to_owned()),
            value,
        });
    }
    out
}

/// The `MessageAttributes` of a ReceiveMessage answer, those `wanted` names (`All` or
/// `.*` for all, a `prefix.*` for those under it).
pub fn to_json(attrs: &[Attribute], wanted: &[String]) -> Map<String, Value> {
    let mut m = Map::new();
    for a in attrs {
        let take = wanted.iter().any(|w| {
            w == "All"
                || w == ".*"
                || w == &a.name
                || w.strip_suffix(".*").is_some_and(|p| a.name.starts_with(p))
        });
        if !take {
            continue;
        }
        let v = match &a.value {
            AttrValue::Text(t) => json!({"DataType": a.data_type, "StringValue": t}),
            AttrValue::Binary(b) => json!({
                "DataType": a.data_type,
                "BinaryValue": base64::Engine::encode(&base64::engine::general_purpose::STANDARD, b),
            }),
        };
        m.insert(a.name.clone(), v);
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(name: &str, ty: &str, v: &str) -> Attribute {
        Attribute {
            name: name.into(),
            data_type: ty.into(),
            value: AttrValue::Text(v.into()),
        }
    }

    /// The digest, computed by hand from AWS's description: one attribute
    /// `{"a": String "b"}` is the bytes 00000001 'a' 00000006 "String" 01 00000001 'b'.
    #[test]
    fn md5_follows_the_documented_encoding() {
        let mut raw = Vec::new();
        raw.extend_from_slice(&1u32.to_be_bytes());
        raw.extend_from_slice(b"a");
        raw.extend_from_slice(&6u32.to_be_bytes());
        raw.extend_from_slice(b"String");
        raw.push(1);
        raw.extend_from_slice(&1u32.to_be_bytes());
        raw.extend_from_slice(b"b");
        assert_eq!(
            md5_of_attributes(&[text("a", "String", "b")]),
            Some(md5_hex(&raw))
        );
        assert_eq!(md5_of_attributes(&[]), None);
    }

    /// A digest computed apart, by a Python rendering of the algorithm of AWS's developer
    /// guide (the one the Java SDK checks): sorted by name, binary with transport byte 2.
    #[test]
    fn md5_matches_an_independent_rendering() {
        let attrs = vec![
            text("zeta", "Number", "42"),
            Attribute {
                name: "blob".into(),
                data_type: "Binary".into(),
                value: AttrValue::Binary(vec![0, 1, 2, 255]),
            },
            text("alpha", "String", "héllo"),
        ];
        assert_eq!(md5_of_attributes(&attrs).as_deref(), Some(BOTOCORE_MD5));
        // The order given does not matter.
        let mut reversed = attrs.clone();
        reversed.reverse();
        assert_eq!(md5_of_attributes(&reversed), md5_of_attributes(&attrs));
    }

    const BOTOCORE_MD5: &str = "b532204c51b8d5c317952d5f44822733";

    #[test]
    fn headers_round_trip() {
        let attrs = vec![
            text("s", "String", "v"),
            text("n", "Number", "1.5"),
            text("j", "String.json", "{}"),
            Attribute {
                name: "b".into(),
                data_type: "Binary".into(),
                value: AttrValue::Binary(vec![9, 8]),
            },
        ];
        let mut h = FieldTable::new();
        to_headers(&attrs, &mut h);
        let mut back = from_headers(Some(&h));
        back.sort_by(|a, b| a.name.cmp(&b.name));
        let mut want = attrs.clone();
        want.sort_by(|a, b| a.name.cmp(&b.name));
        assert_eq!(back, want);
        assert_eq!(md5_of_attributes(&back), md5_of_attributes(&attrs));
    }

    #[test]
    fn amqp_headers_become_attributes() {
        let mut h = FieldTable::new();
        h.insert("count", FieldValue::I32(7));
        h.insert("x-death", FieldValue::long_str("skipped"));
        let a = from_headers(Some(&h));
        assert_eq!(a, vec![text("count", "Number", "7")]);
    }

    #[test]
    fn parse_checks_types_and_numbers() {
        let v: Value = serde_json::json!({"n": {"DataType": "Number", "StringValue": "abc"}});
        assert!(parse(Some(&v)).is_err());
        let v: Value = serde_json::json!({"n": {"DataType": "Map", "StringValue": "1"}});
        assert!(parse(Some(&v)).is_err());
        let v: Value = serde_json::json!({"b": {"DataType": "Binary", "BinaryValue": "AAEC"}});
        assert_eq!(
            parse(Some(&v)).expect("valid")[0].value,
            AttrValue::Binary(vec![0, 1, 2])
        );
    }
}
