//! Field tables and field values, with RabbitMQ's type tags.
//!
//! RabbitMQ (rabbit_binary_parser / rabbit_binary_generator, following its 0-9-1 errata
//! rather than the spec's table) parses and generates these tags:
//!
//! | tag | RabbitMQ type   | wire                     | [`FieldValue`]        |
//! |-----|-----------------|--------------------------|-----------------------|
//! | `t` | bool            | octet, non-zero = true   | `Bool`                |
//! | `b` | byte            | signed 8                 | `I8`                  |
//! | `B` | unsignedbyte    | unsigned 8               | `U8`                  |
//! | `s` | short           | signed 16                | `I16`                 |
//! | `u` | unsignedshort   | unsigned 16              | `U16`                 |
//! | `I` | signedint       | signed 32                | `I32`                 |
//! | `i` | unsignedint     | unsigned 32              | `U32`                 |
//! | `l` | long            | signed 64                | `I64`                 |
//! | `L` | long (parsed only; read as *signed* 64) | 64 | `U64` (raw bits)   |
//! | `f` | float           | IEEE 754 32              | `F32`                 |
//! | `d` | double          | IEEE 754 64              | `F64`                 |
//! | `D` | decimal         | scale octet + u32        | `Decimal`             |
//! | `S` | longstr         | u32 length + bytes       | `LongStr`             |
//! | `x` | binary          | u32 length + bytes       | `ByteArray`           |
//! | `A` | array           | u32 length + values      | `Array`               |
//! | `T` | timestamp       | unsigned 64              | `Timestamp`           |
//! | `F` | table           | u32 length + pairs       | `Table`               |
//! | `V` | void            | nothing                  | `Void`                |
//!
//! The spec's `U` (signed 16) and `s` as shortstr are *not* accepted: RabbitMQ rejects
//! them too. Each variant re-encodes with the tag it was read with, so decode + encode
//! is byte-identical (except a `t` octet other than 0/1, which becomes 1), key order
//! and duplicate keys are kept.

use std::fmt;

use bytes::{BufMut, Bytes, BytesMut};

use crate::error::{CodecError, MAX_TABLE_DEPTH};
use crate::strings::ShortStr;
use crate::wire::{get_longstr, get_shortstr, get_u16, get_u32, get_u64, get_u8, patch_u32, take};

/// A field value. Floats compare by bit pattern (so `NaN == NaN` with the same bits and
/// `0.0 != -0.0`): equality means "same wire bytes".
#[derive(Clone, Debug)]
pub enum FieldValue {
    Bool(bool),
    I8(i8),
    U8(u8),
    I16(i16),
    U16(u16),
    I32(i32),
    U32(u32),
    I64(i64),
    /// Tag `L`. RabbitMQ reads it as a *signed* 64-bit integer; see [`FieldValue::as_i64`].
    U64(u64),
    F32(f32),
    F64(f64),
    /// `value / 10^scale`.
    Decimal {
        scale: u8,
        value: u32,
    },
    LongStr(Bytes),
    ByteArray(Bytes),
    Array(Vec<FieldValue>),
    Timestamp(u64),
    Table(FieldTable),
    Void,
}

impl PartialEq for FieldValue {
    fn eq(&self, other: &Self) -> bool {
        use FieldValue::*;
        match (self, other) {
            (Bool(a), Bool(b)) => a == b,
            (I8(a), I8(b)) => a == b,
            (U8(a), U8(b)) => a == b,
            (I16(a), I16(b)) => a == b,
            (U16(a), U16(b)) => a == b,
            (I32(a), I32(b)) => a == b,
            (U32(a), U32(b)) => a == b,
            (I64(a), I64(b)) => a == b,
            (U64(a), U64(b)) => a == b,
            (F32(a), F32(b)) => a.to_bits() == b.to_bits(),
            (F64(a), F64(b)) => a.to_bits() == b.to_bits(),
            (
                Decimal {
                    scale: s1,
                    value: v1,
                },
                Decimal {
                    scale: s2,
                    value: v2,
                },
            ) => s1 == s2 && v1 == v2,
            (LongStr(a), LongStr(b)) => a == b,
            (ByteArray(a), ByteArray(b)) => a == b,
            (Array(a), Array(b)) => a == b,
            (Timestamp(a), Timestamp(b)) => a == b,
            (Table(a), Table(b)) => a == b,
            (Void, Void) => true,
            _ => false,
        }
    }
}

impl FieldValue {
    /// A deep copy that owns all its bytes (see [`FieldTable::detached`]).
    pub fn detached(&self) -> Self {
        match self {
            FieldValue::LongStr(b) => FieldValue::LongStr(Bytes::copy_from_slice(b)),
            FieldValue::ByteArray(b) => FieldValue::ByteArray(Bytes::copy_from_slice(b)),
            FieldValue::Array(items) => {
                FieldValue::Array(items.iter().map(FieldValue::detached).collect())
            }
            FieldValue::Table(t) => FieldValue::Table(t.detached()),
            other => other.clone(),
        }
    }

    /// The wire type tag.
    pub fn tag(&self) -> u8 {
        match self {
            FieldValue::Bool(_) => b't',
            FieldValue::I8(_) => b'b',
            FieldValue::U8(_) => b'B',
            FieldValue::I16(_) => b's',
            FieldValue::U16(_) => b'u',
            FieldValue::I32(_) => b'I',
            FieldValue::U32(_) => b'i',
            FieldValue::I64(_) => b'l',
            FieldValue::U64(_) => b'L',
            FieldValue::F32(_) => b'f',
            FieldValue::F64(_) => b'd',
            FieldValue::Decimal { .. } => b'D',
            FieldValue::LongStr(_) => b'S',
            FieldValue::ByteArray(_) => b'x',
            FieldValue::Array(_) => b'A',
            FieldValue::Timestamp(_) => b'T',
            FieldValue::Table(_) => b'F',
            FieldValue::Void => b'V',
        }
    }

    /// The type name RabbitMQ uses in error texts (`"expected integer, got longstr"`).
    pub fn type_name(&self) -> &'static str {
        match self {
            FieldValue::Bool(_) => "bool",
            FieldValue::I8(_) => "byte",
            FieldValue::U8(_) => "unsignedbyte",
            FieldValue::I16(_) => "short",
            FieldValue::U16(_) => "unsignedshort",
            FieldValue::I32(_) => "signedint",
            FieldValue::U32(_) => "unsignedint",
            FieldValue::I64(_) | FieldValue::U64(_) => "long",
            FieldValue::F32(_) => "float",
            FieldValue::F64(_) => "double",
            FieldValue::Decimal { .. } => "decimal",
            FieldValue::LongStr(_) => "longstr",
            FieldValue::ByteArray(_) => "binary",
            FieldValue::Array(_) => "array",
            FieldValue::Timestamp(_) => "timestamp",
            FieldValue::Table(_) => "table",
            FieldValue::Void => "void",
        }
    }

    /// Any integer variant as i64. `U64` (tag `L`) is reinterpreted as signed, as
    /// RabbitMQ does. Timestamps, floats and decimals are not integers here.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            FieldValue::I8(v) => Some(v.into()),
            FieldValue::U8(v) => Some(v.into()),
            FieldValue::I16(v) => Some(v.into()),
            FieldValue::U16(v) => Some(v.into()),
            FieldValue::I32(v) => Some(v.into()),
            FieldValue::U32(v) => Some(v.into()),
            FieldValue::I64(v) => Some(v),
            FieldValue::U64(v) => Some(v as i64),
            _ => None,
        }
    }

    /// [`FieldValue::as_i64`] if it is not negative.
    pub fn as_u64(&self) -> Option<u64> {
        self.as_i64().and_then(|v| u64::try_from(v).ok())
    }

    /// The value of a `Bool`.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            FieldValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// A `LongStr` that is valid UTF-8.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            FieldValue::LongStr(b) => std::str::from_utf8(b).ok(),
            _ => None,
        }
    }

    /// The bytes of a `LongStr` or `ByteArray`.
    pub fn as_bytes(&self) -> Option<&Bytes> {
        match self {
            FieldValue::LongStr(b) | FieldValue::ByteArray(b) => Some(b),
            _ => None,
        }
    }

    /// A float, double, or integer as f64.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            FieldValue::F32(v) => Some(v.into()),
            FieldValue::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    pub fn as_table(&self) -> Option<&FieldTable> {
        match self {
            FieldValue::Table(t) => Some(t),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[FieldValue]> {
        match self {
            FieldValue::Array(a) => Some(a),
            _ => None,
        }
    }

    /// A `LongStr` from a string (copies).
    pub fn long_str(s: impl AsRef<str>) -> FieldValue {
        FieldValue::LongStr(Bytes::copy_from_slice(s.as_ref().as_bytes()))
    }

    /// Decodes one tagged value.
    pub fn decode(buf: &mut Bytes) -> Result<FieldValue, CodecError> {
        decode_value(buf, 0)
    }

    /// Encodes the tag and the value.
    pub fn encode(&self, out: &mut BytesMut) {
        out.put_u8(self.tag());
        match self {
            FieldValue::Bool(b) => out.put_u8(u8::from(*b)),
            FieldValue::I8(v) => out.put_i8(*v),
            FieldValue::U8(v) => out.put_u8(*v),
            FieldValue::I16(v) => out.put_i16(*v),
            FieldValue::U16(v) => out.put_u16(*v),
            FieldValue::I32(v) => out.put_i32(*v),
            FieldValue::U32(v) => out.put_u32(*v),
            FieldValue::I64(v) => out.put_i64(*v),
            FieldValue::U64(v) => out.put_u64(*v),
            FieldValue::F32(v) => out.put_f32(*v),
            FieldValue::F64(v) => out.put_f64(*v),
            FieldValue::Decimal { scale, value } => {
                out.put_u8(*scale);
                out.put_u32(*value);
            }
            FieldValue::LongStr(b) | FieldValue::ByteArray(b) => crate::wire::put_longstr(out, b),
            FieldValue::Array(items) => {
                let pos = out.len();
                out.put_u32(0);
                for item in items {
                    item.encode(out);
                }
                let len = out.len() - pos - 4;
                patch_u32(out, pos, u32::try_from(len).unwrap_or(u32::MAX));
            }
            FieldValue::Timestamp(v) => out.put_u64(*v),
            FieldValue::Table(t) => t.encode(out),
            FieldValue::Void => {}
        }
    }
}

fn write_float(f: &mut fmt::Formatter<'_>, v: f64) -> fmt::Result {
    // Erlang prints floats with a fractional part: 1.0, 0.5, 1.0e20.
    if v.is_finite() && v.fract() == 0.0 && v.abs() < 1e16 {
        write!(f, "{v:.1}")
    } else {
        write!(f, "{v}")
    }
}

/// Close to how RabbitMQ prints values in error texts: integers as numbers, `true` /
/// `false`, strings as their text (`abc`), void as `undefined`.
impl fmt::Display for FieldValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FieldValue::Bool(b) => write!(f, "{b}"),
            FieldValue::I8(v) => write!(f, "{v}"),
            FieldValue::U8(v) => write!(f, "{v}"),
            FieldValue::I16(v) => write!(f, "{v}"),
            FieldValue::U16(v) => write!(f, "{v}"),
            FieldValue::I32(v) => write!(f, "{v}"),
            FieldValue::U32(v) => write!(f, "{v}"),
            FieldValue::I64(v) => write!(f, "{v}"),
            FieldValue::U64(v) => write!(f, "{}", *v as i64),
            FieldValue::F32(v) => write_float(f, (*v).into()),
            FieldValue::F64(v) => write_float(f, *v),
            FieldValue::Decimal { scale, value } => {
                let digits = value.to_string();
                let scale = *scale as usize;
                if scale == 0 {
                    f.write_str(&digits)
                } else if digits.len() > scale {
                    let (int, frac) = digits.split_at(digits.len() - scale);
                    write!(f, "{int}.{frac}")
                } else {
                    write!(f, "0.{}{digits}", "0".repeat(scale - digits.len()))
                }
            }
            FieldValue::LongStr(b) | FieldValue::ByteArray(b) => {
                f.write_str(&String::from_utf8_lossy(b))
            }
            FieldValue::Array(items) => {
                f.write_str("[")?;
                for (i, v) in items.iter().enumerate() {
                    if i > 0 {
                        f.write_str(",")?;
                    }
                    write!(f, "{v}")?;
                }
                f.write_str("]")
            }
            FieldValue::Timestamp(v) => write!(f, "{v}"),
            FieldValue::Table(t) => write!(f, "{t}"),
            FieldValue::Void => f.write_str("undefined"),
        }
    }
}

macro_rules! from_impls {
    ($($t:ty => $v:ident),* $(,)?) => {$(
        impl From<$t> for FieldValue {
            fn from(v: $t) -> FieldValue { FieldValue::$v(v) }
        }
    )*};
}
from_impls!(bool => Bool, i8 => I8, u8 => U8, i16 => I16, u16 => U16, i32 => I32,
    u32 => U32, i64 => I64, u64 => U64, f32 => F32, f64 => F64, FieldTable => Table,
    Vec<FieldValue> => Array);

impl From<&str> for FieldValue {
    fn from(s: &str) -> FieldValue {
        FieldValue::long_str(s)
    }
}

/// A `LongStr` sharing the string's buffer.
impl From<ShortStr> for FieldValue {
    fn from(s: ShortStr) -> FieldValue {
        FieldValue::LongStr(s.into_bytes())
    }
}

impl From<Bytes> for FieldValue {
    fn from(b: Bytes) -> FieldValue {
        FieldValue::LongStr(b)
    }
}

impl From<String> for FieldValue {
    fn from(s: String) -> FieldValue {
        FieldValue::LongStr(Bytes::from(s))
    }
}

/// An AMQP field table: ordered pairs, duplicates kept as received.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FieldTable(pub Vec<(ShortStr, FieldValue)>);

impl FieldTable {
    pub fn new() -> Self {
        FieldTable(Vec::new())
    }

    /// A deep copy that owns all its bytes, for tables kept long after the frame they came in (queue
    /// and binding arguments): a decoded table's strings are slices of the network read buffer.
    pub fn detached(&self) -> Self {
        FieldTable(
            self.0
                .iter()
                .map(|(k, v)| (k.detached(), v.detached()))
                .collect(),
        )
    }

    /// The first value with this key (RabbitMQ's `table_lookup` also takes the first).
    pub fn get(&self, key: &str) -> Option<&FieldValue> {
        self.0
            .iter()
            .find(|(k, _)| k.as_str() == key)
            .map(|(_, v)| v)
    }

    pub fn get_mut(&mut self, key: &str) -> Option<&mut FieldValue> {
        self.0
            .iter_mut()
            .find(|(k, _)| k.as_str() == key)
            .map(|(_, v)| v)
    }

    pub fn contains_key(&self, key: &str) -> bool {
        self.get(key).is_some()
    }

    /// Replaces the value of the first entry with this key, or appends a new entry.
    /// Returns the old value.
    pub fn insert(
        &mut self,
        key: impl Into<ShortStr>,
        value: impl Into<FieldValue>,
    ) -> Option<FieldValue> {
        let key = key.into();
        let value = value.into();
        match self.0.iter_mut().find(|(k, _)| *k == key) {
            Some((_, v)) => Some(std::mem::replace(v, value)),
            None => {
                self.0.push((key, value));
                None
            }
        }
    }

    /// Removes every entry with this key; returns the first removed value.
    pub fn remove(&mut self, key: &str) -> Option<FieldValue> {
        let mut first = None;
        let mut i = 0;
        while i < self.0.len() {
            if self.0.get(i).is_some_and(|(k, _)| k.as_str() == key) {
                let (_, v) = self.0.remove(i);
                if first.is_none() {
                    first = Some(v);
                }
            } else {
                i += 1;
            }
        }
        first
    }

    pub fn iter(&self) -> std::slice::Iter<'_, (ShortStr, FieldValue)> {
        self.0.iter()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn into_inner(self) -> Vec<(ShortStr, FieldValue)> {
        self.0
    }

    /// Decodes a table with its 4-byte length prefix from the front of `buf`, advancing
    /// it. Strings are zero-copy slices of `buf`.
    pub fn decode(buf: &mut Bytes) -> Result<FieldTable, CodecError> {
        decode_table(buf, 0)
    }

    /// Decodes a table body (the bytes after the length prefix).
    pub fn decode_body(body: Bytes) -> Result<FieldTable, CodecError> {
        decode_table_body(body, 0)
    }

    /// Decodes a table with its length prefix from a slice (copies the slice once).
    /// Trailing bytes after the table are ignored.
    pub fn from_slice(raw: &[u8]) -> Result<FieldTable, CodecError> {
        let mut b = Bytes::copy_from_slice(raw);
        Self::decode(&mut b)
    }

    /// Encodes the 4-byte length and the body.
    pub fn encode(&self, out: &mut BytesMut) {
        let pos = out.len();
        out.put_u32(0);
        self.encode_body(out);
        let len = out.len() - pos - 4;
        patch_u32(out, pos, u32::try_from(len).unwrap_or(u32::MAX));
    }

    /// Encodes the pairs without the length prefix.
    pub fn encode_body(&self, out: &mut BytesMut) {
        for (k, v) in &self.0 {
            crate::wire::put_shortstr(out, k.as_str());
            v.encode(out);
        }
    }

    /// The encoding (with length prefix) as `Bytes`.
    pub fn to_bytes(&self) -> Bytes {
        let mut out = BytesMut::new();
        self.encode(&mut out);
        out.freeze()
    }
}

impl fmt::Display for FieldTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, (k, v)) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{{{k},{v}}}")?;
        }
        f.write_str("]")
    }
}

impl<'a> IntoIterator for &'a FieldTable {
    type Item = &'a (ShortStr, FieldValue);
    type IntoIter = std::slice::Iter<'a, (ShortStr, FieldValue)>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.iter()
    }
}

impl IntoIterator for FieldTable {
    type Item = (ShortStr, FieldValue);
    type IntoIter = std::vec::IntoIter<(ShortStr, FieldValue)>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.into_iter()
    }
}

impl FromIterator<(ShortStr, FieldValue)> for FieldTable {
    fn from_iter<I: IntoIterator<Item = (ShortStr, FieldValue)>>(iter: I) -> Self {
        FieldTable(iter.into_iter().collect())
    }
}

impl From<Vec<(ShortStr, FieldValue)>> for FieldTable {
    fn from(v: Vec<(ShortStr, FieldValue)>) -> Self {
        FieldTable(v)
    }
}

fn decode_table(buf: &mut Bytes, depth: usize) -> Result<FieldTable, CodecError> {
    let len = get_u32(buf)? as usize;
    let body = take(buf, len)?;
    decode_table_body(body, depth)
}

fn decode_table_body(mut body: Bytes, depth: usize) -> Result<FieldTable, CodecError> {
    if depth > MAX_TABLE_DEPTH {
        return Err(CodecError::TableTooDeep);
    }
    let mut entries = Vec::new();
    while !body.is_empty() {
        let key = get_shortstr(&mut body)?;
        let value = decode_value(&mut body, depth)?;
        entries.push((key, value));
    }
    Ok(FieldTable(entries))
}

fn decode_array(buf: &mut Bytes, depth: usize) -> Result<Vec<FieldValue>, CodecError> {
    if depth > MAX_TABLE_DEPTH {
        return Err(CodecError::TableTooDeep);
    }
    let len = get_u32(buf)? as usize;
    let mut body = take(buf, len)?;
    let mut items = Vec::new();
    while !body.is_empty() {
        items.push(decode_value(&mut body, depth)?);
    }
    Ok(items)
}

/// Decodes one tagged value; `depth` is the nesting level of the container holding it.
fn decode_value(buf: &mut Bytes, depth: usize) -> Result<FieldValue, CodecError> {
    let tag = get_u8(buf)?;
    Ok(match tag {
        b't' => FieldValue::Bool(get_u8(buf)? != 0),
        b'b' => FieldValue::I8(get_u8(buf)? as i8),
        b'B' => FieldValue::U8(get_u8(buf)?),
        b's' => FieldValue::I16(get_u16(buf)? as i16),
        b'u' => FieldValue::U16(get_u16(buf)?),
        b'I' => FieldValue::I32(get_u32(buf)? as i32),
        b'i' => FieldValue::U32(get_u32(buf)?),
        b'l' => FieldValue::I64(get_u64(buf)? as i64),
        b'L' => FieldValue::U64(get_u64(buf)?),
        b'f' => FieldValue::F32(f32::from_bits(get_u32(buf)?)),
        b'd' => FieldValue::F64(f64::from_bits(get_u64(buf)?)),
        b'D' => {
            let scale = get_u8(buf)?;
            let value = get_u32(buf)?;
            FieldValue::Decimal { scale, value }
        }
        b'S' => FieldValue::LongStr(get_longstr(buf)?),
        b'x' => FieldValue::ByteArray(get_longstr(buf)?),
        b'A' => FieldValue::Array(decode_array(buf, depth + 1)?),
        b'T' => FieldValue::Timestamp(get_u64(buf)?),
        b'F' => FieldValue::Table(decode_table(buf, depth + 1)?),
        b'V' => FieldValue::Void,
        other => return Err(CodecError::BadFieldType(other)),
    })
}

/// Checks that `body` is a well-formed table body without building it (no allocation).
pub(crate) fn validate_table_body(mut body: Bytes, depth: usize) -> Result<(), CodecError> {
    if depth > MAX_TABLE_DEPTH {
        return Err(CodecError::TableTooDeep);
    }
    while !body.is_empty() {
        let len = get_u8(&mut body)? as usize;
        let key = take(&mut body, len)?;
        std::str::from_utf8(&key).map_err(|_| CodecError::InvalidUtf8)?;
        validate_value(&mut body, depth)?;
    }
    Ok(())
}

fn validate_value(buf: &mut Bytes, depth: usize) -> Result<(), CodecError> {
    let tag = get_u8(buf)?;
    let skip = match tag {
        b't' | b'b' | b'B' => 1,
        b's' | b'u' => 2,
        b'I' | b'i' | b'f' => 4,
        b'l' | b'L' | b'd' | b'T' => 8,
        b'D' => 5,
        b'V' => 0,
        b'S' | b'x' => {
            get_longstr(buf)?;
            return Ok(());
        }
        b'F' => {
            let body = get_longstr(buf)?;
            return validate_table_body(body, depth + 1);
        }
        b'A' => {
            if depth + 1 > MAX_TABLE_DEPTH {
                return Err(CodecError::TableTooDeep);
            }
            let mut body = get_longstr(buf)?;
            while !body.is_empty() {
                validate_value(&mut body, depth + 1)?;
            }
            return Ok(());
        }
        other => return Err(CodecError::BadFieldType(other)),
    };
    take(buf, skip)?;
    Ok(())
}

#[cfg(test)]
mod tests {

    #[test]
    fn detached_tables_share_no_bytes_with_the_frame() {
        let mut inner = FieldTable::new();
        inner.insert("k", FieldValue::LongStr(Bytes::from_static(b"v")));
        let mut t = FieldTable::new();
        t.insert(
            "x-dead-letter-exchange",
            FieldValue::LongStr(Bytes::from_static(b"dlx")),
        );
        t.insert("nested", FieldValue::Table(inner));
        let mut wire = BytesMut::new();
        t.encode(&mut wire);
        let frame = wire.freeze();
        let decoded = FieldTable::decode(&mut frame.clone()).unwrap();
        let copy = decoded.detached();
        assert_eq!(copy, t);
        let range = frame.as_ptr() as usize..frame.as_ptr() as usize + frame.len();
        let Some(FieldValue::LongStr(v)) = copy.get("x-dead-letter-exchange") else {
            panic!()
        };
        assert!(!range.contains(&(v.as_ptr() as usize)));
        let (k, _) = &copy.0[0];
        assert!(!range.contains(&(k.as_bytes().as_ptr() as usize)));
    }
    use super::*;

    fn every_tag_table() -> FieldTable {
        let mut inner = FieldTable::new();
        inner.insert("k", FieldValue::I32(-7));
        FieldTable(vec![
            ("bool".into(), FieldValue::Bool(true)),
            ("i8".into(), FieldValue::I8(-5)),
            ("u8".into(), FieldValue::U8(250)),
            ("i16".into(), FieldValue::I16(-300)),
            ("u16".into(), FieldValue::U16(65000)),
            ("i32".into(), FieldValue::I32(-70000)),
            ("u32".into(), FieldValue::U32(4_000_000_000)),
            ("i64".into(), FieldValue::I64(-5_000_000_000)),
            ("u64".into(), FieldValue::U64(u64::MAX)),
            ("f32".into(), FieldValue::F32(1.5)),
            ("f64".into(), FieldValue::F64(-2.25)),
            (
                "dec".into(),
                FieldValue::Decimal {
                    scale: 2,
                    value: 12345,
                },
            ),
            ("str".into(), FieldValue::long_str("héllo")),
            (
                "bin".into(),
                FieldValue::ByteArray(Bytes::from_static(&[0, 1, 255])),
            ),
            (
                "arr".into(),
                FieldValue::Array(vec![
                    FieldValue::I8(1),
                    FieldValue::long_str("x"),
                    FieldValue::Void,
                    FieldValue::Array(vec![]),
                    FieldValue::Table(inner.clone()),
                ]),
            ),
            ("ts".into(), FieldValue::Timestamp(1_700_000_000)),
            ("tbl".into(), FieldValue::Table(inner)),
            ("void".into(), FieldValue::Void),
            // duplicate key, kept in place
            ("bool".into(), FieldValue::Bool(false)),
        ])
    }

    #[test]
    fn every_tag_round_trips_byte_identically() {
        let t = every_tag_table();
        let bytes = t.to_bytes();
        let mut b = bytes.clone();
        let back = FieldTable::decode(&mut b).unwrap();
        assert!(b.is_empty());
        assert_eq!(back, t);
        assert_eq!(back.to_bytes(), bytes);
        assert_eq!(back.len(), 19);
        assert_eq!(back.get("bool"), Some(&FieldValue::Bool(true)));
        let keys: Vec<&str> = back.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys.first(), Some(&"bool"));
        assert_eq!(keys.last(), Some(&"bool"));
        validate_table_body(bytes.slice(4..), 0).unwrap();
    }

    #[test]
    fn hand_written_bytes_keep_their_tags() {
        // 'L' and 'l', 'I' and 'i', 't' 1, in a non-sorted key order
        let body: &[u8] = b"\x01zL\x00\x00\x00\x00\x00\x00\x00\x05\x01al\xff\xff\xff\xff\xff\xff\xff\xfb\x01mi\x00\x00\x00\x09\x01bI\xff\xff\xff\xf7\x01ct\x01";
        let t = FieldTable::decode_body(Bytes::from_static(body)).unwrap();
        let mut out = BytesMut::new();
        t.encode_body(&mut out);
        assert_eq!(&out[..], body);
        assert_eq!(t.get("z").and_then(|v| v.as_i64()), Some(5));
        assert_eq!(t.get("a").and_then(|v| v.as_i64()), Some(-5));
        assert_eq!(t.get("b").and_then(|v| v.as_i64()), Some(-9));
        assert_eq!(t.get("c").and_then(|v| v.as_bool()), Some(true));
    }

    #[test]
    fn rejects_bad_input() {
        // unknown tag 'U'
        let e = FieldTable::decode_body(Bytes::from_static(b"\x01aU\x00\x01")).unwrap_err();
        assert_eq!(e, CodecError::BadFieldType(b'U'));
        // truncated value
        let e = FieldTable::decode_body(Bytes::from_static(b"\x01aI\x00\x01")).unwrap_err();
        assert_eq!(e, CodecError::Truncated);
        // length prefix larger than the data: an error, not an allocation
        let e = FieldTable::from_slice(b"\xff\xff\xff\xff\x01a").unwrap_err();
        assert_eq!(e, CodecError::Truncated);
        // invalid utf-8 key
        let e = FieldTable::decode_body(Bytes::from_static(b"\x01\xffV")).unwrap_err();
        assert_eq!(e, CodecError::InvalidUtf8);
        assert!(validate_table_body(Bytes::from_static(b"\x01\xffV"), 0).is_err());
        assert!(validate_table_body(Bytes::from_static(b"\x01aU"), 0).is_err());
    }

    #[test]
    fn nesting_limit() {
        fn nested_arrays(levels: usize) -> Bytes {
            // key "k" then `levels` arrays, each holding the next one
            let mut t = BytesMut::new();
            t.put_u8(1);
            t.put_u8(b'k');
            for i in 0..levels {
                t.put_u8(b'A');
                t.put_u32((5 * (levels - 1 - i)) as u32);
            }
            t.freeze()
        }
        assert!(FieldTable::decode_body(nested_arrays(MAX_TABLE_DEPTH)).is_ok());
        assert!(validate_table_body(nested_arrays(MAX_TABLE_DEPTH), 0).is_ok());
        assert_eq!(
            FieldTable::decode_body(nested_arrays(MAX_TABLE_DEPTH + 1)),
            Err(CodecError::TableTooDeep)
        );
        assert_eq!(
            validate_table_body(nested_arrays(MAX_TABLE_DEPTH + 1), 0),
            Err(CodecError::TableTooDeep)
        );
        // a very deep input fails fast instead of overflowing the stack
        assert_eq!(
            FieldTable::decode_body(nested_arrays(100_000)),
            Err(CodecError::TableTooDeep)
        );
    }

    #[test]
    fn table_ops_and_display() {
        let mut t = FieldTable::new();
        assert!(t.insert("a", 1i32).is_none());
        assert_eq!(t.insert("a", 2i32), Some(FieldValue::I32(1)));
        t.0.push(("a".into(), FieldValue::I32(3)));
        t.insert("s", "abc");
        assert_eq!(t.len(), 3);
        assert_eq!(t.remove("a"), Some(FieldValue::I32(2)));
        assert_eq!(t.len(), 1);
        assert_eq!(t.get("s").and_then(|v| v.as_str()), Some("abc"));
        assert_eq!(FieldValue::long_str("abc").to_string(), "abc");
        assert_eq!(FieldValue::I64(10).to_string(), "10");
        assert_eq!(FieldValue::Bool(true).to_string(), "true");
        assert_eq!(FieldValue::F64(1.0).to_string(), "1.0");
        assert_eq!(
            FieldValue::Decimal { scale: 2, value: 5 }.to_string(),
            "0.05"
        );
        assert_eq!(
            FieldValue::Decimal {
                scale: 1,
                value: 15
            }
            .to_string(),
            "1.5"
        );
        assert_eq!(FieldValue::long_str("x").type_name(), "longstr");
        assert_eq!(FieldValue::I32(1).type_name(), "signedint");
        assert_eq!(FieldValue::F32(f32::NAN), FieldValue::F32(f32::NAN));
        assert_ne!(FieldValue::F64(0.0), FieldValue::F64(-0.0));
    }
}
