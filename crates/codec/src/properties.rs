//! Content properties of the basic class.
//!
//! Warren forwards the raw property bytes (flags + property list) of a published
//! message byte for byte; [`BasicProperties`] is for the rare paths that must read or
//! rewrite them, and the free functions here read single properties straight from the
//! raw bytes without allocating.
//!
//! Layout: one or more 16-bit flag words (bit 0 set = another flag word follows), then
//! the present properties in flag order, most significant bit first.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::error::CodecError;
use crate::strings::ShortStr;
use crate::table::{validate_table_body, FieldTable};
use crate::wire::{get_longstr, get_shortstr, get_u16, get_u64, get_u8, put_shortstr, take};

/// Property flag bits (first flag word).
pub mod flags {
    pub const CONTENT_TYPE: u16 = 1 << 15;
    pub const CONTENT_ENCODING: u16 = 1 << 14;
    pub const HEADERS: u16 = 1 << 13;
    pub const DELIVERY_MODE: u16 = 1 << 12;
    pub const PRIORITY: u16 = 1 << 11;
    pub const CORRELATION_ID: u16 = 1 << 10;
    pub const REPLY_TO: u16 = 1 << 9;
    pub const EXPIRATION: u16 = 1 << 8;
    pub const MESSAGE_ID: u16 = 1 << 7;
    pub const TIMESTAMP: u16 = 1 << 6;
    pub const TYPE: u16 = 1 << 5;
    pub const USER_ID: u16 = 1 << 4;
    pub const APP_ID: u16 = 1 << 3;
    pub const CLUSTER_ID: u16 = 1 << 2;
    /// Another flag word follows.
    pub const CONTINUATION: u16 = 1;
}

/// The raw form of "no properties": a single zero flag word.
pub const EMPTY_PROPERTIES: &[u8] = &[0, 0];

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    ShortStr,
    Table,
    Octet,
    Timestamp,
}

/// The properties in wire order with their flag and type.
const LAYOUT: [(u16, Kind); 14] = [
    (flags::CONTENT_TYPE, Kind::ShortStr),
    (flags::CONTENT_ENCODING, Kind::ShortStr),
    (flags::HEADERS, Kind::Table),
    (flags::DELIVERY_MODE, Kind::Octet),
    (flags::PRIORITY, Kind::Octet),
    (flags::CORRELATION_ID, Kind::ShortStr),
    (flags::REPLY_TO, Kind::ShortStr),
    (flags::EXPIRATION, Kind::ShortStr),
    (flags::MESSAGE_ID, Kind::ShortStr),
    (flags::TIMESTAMP, Kind::Timestamp),
    (flags::TYPE, Kind::ShortStr),
    (flags::USER_ID, Kind::ShortStr),
    (flags::APP_ID, Kind::ShortStr),
    (flags::CLUSTER_ID, Kind::ShortStr),
];

/// The properties of the basic class, decoded.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BasicProperties {
    pub content_type: Option<ShortStr>,
    pub content_encoding: Option<ShortStr>,
    pub headers: Option<FieldTable>,
    /// 1 = transient, 2 = persistent.
    pub delivery_mode: Option<u8>,
    pub priority: Option<u8>,
    pub correlation_id: Option<ShortStr>,
    pub reply_to: Option<ShortStr>,
    /// Per-message TTL in milliseconds, as a decimal string.
    pub expiration: Option<ShortStr>,
    pub message_id: Option<ShortStr>,
    pub timestamp: Option<u64>,
    /// The `type` property.
    pub kind: Option<ShortStr>,
    pub user_id: Option<ShortStr>,
    pub app_id: Option<ShortStr>,
    pub cluster_id: Option<ShortStr>,
}

/// Reads the flag words; returns the first word without its continuation bit.
/// Continuation words must not name properties (the basic class has 14).
fn read_flags(buf: &mut Bytes) -> Result<u16, CodecError> {
    let first = get_u16(buf)?;
    let mut word = first;
    while word & flags::CONTINUATION != 0 {
        word = get_u16(buf)?;
        if word & !flags::CONTINUATION != 0 {
            return Err(CodecError::BadPropertyFlags(word));
        }
    }
    Ok(first & !flags::CONTINUATION)
}

impl BasicProperties {
    /// Decodes raw properties (copies `raw` once; strings then share that copy).
    pub fn decode(raw: &[u8]) -> Result<Self, CodecError> {
        Self::decode_bytes(Bytes::copy_from_slice(raw))
    }

    /// Decodes raw properties, zero copy.
    pub fn decode_bytes(mut raw: Bytes) -> Result<Self, CodecError> {
        let f = read_flags(&mut raw)?;
        let buf = &mut raw;
        let s = |buf: &mut Bytes, flag: u16| -> Result<Option<ShortStr>, CodecError> {
            if f & flag != 0 {
                get_shortstr(buf).map(Some)
            } else {
                Ok(None)
            }
        };
        let content_type = s(buf, flags::CONTENT_TYPE)?;
        let content_encoding = s(buf, flags::CONTENT_ENCODING)?;
        let headers = if f & flags::HEADERS != 0 {
            Some(FieldTable::decode(buf)?)
        } else {
            None
        };
        let delivery_mode = if f & flags::DELIVERY_MODE != 0 {
            Some(get_u8(buf)?)
        } else {
            None
        };
        let priority = if f & flags::PRIORITY != 0 {
            Some(get_u8(buf)?)
        } else {
            None
        };
        let correlation_id = s(buf, flags::CORRELATION_ID)?;
        let reply_to = s(buf, flags::REPLY_TO)?;
        let expiration = s(buf, flags::EXPIRATION)?;
        let message_id = s(buf, flags::MESSAGE_ID)?;
        let timestamp = if f & flags::TIMESTAMP != 0 {
            Some(get_u64(buf)?)
        } else {
            None
        };
        let kind = s(buf, flags::TYPE)?;
        let user_id = s(buf, flags::USER_ID)?;
        let app_id = s(buf, flags::APP_ID)?;
        let cluster_id = s(buf, flags::CLUSTER_ID)?;
        Ok(BasicProperties {
            content_type,
            content_encoding,
            headers,
            delivery_mode,
            priority,
            correlation_id,
            reply_to,
            expiration,
            message_id,
            timestamp,
            kind,
            user_id,
            app_id,
            cluster_id,
        })
    }

    /// The flag word for the present properties.
    pub fn flags(&self) -> u16 {
        let mut f = 0;
        let mut set = |present: bool, flag: u16| {
            if present {
                f |= flag;
            }
        };
        set(self.content_type.is_some(), flags::CONTENT_TYPE);
        set(self.content_encoding.is_some(), flags::CONTENT_ENCODING);
        set(self.headers.is_some(), flags::HEADERS);
        set(self.delivery_mode.is_some(), flags::DELIVERY_MODE);
        set(self.priority.is_some(), flags::PRIORITY);
        set(self.correlation_id.is_some(), flags::CORRELATION_ID);
        set(self.reply_to.is_some(), flags::REPLY_TO);
        set(self.expiration.is_some(), flags::EXPIRATION);
        set(self.message_id.is_some(), flags::MESSAGE_ID);
        set(self.timestamp.is_some(), flags::TIMESTAMP);
        set(self.kind.is_some(), flags::TYPE);
        set(self.user_id.is_some(), flags::USER_ID);
        set(self.app_id.is_some(), flags::APP_ID);
        set(self.cluster_id.is_some(), flags::CLUSTER_ID);
        f
    }

    /// Appends the raw form (one flag word + property list).
    pub fn encode_to(&self, out: &mut BytesMut) {
        out.put_u16(self.flags());
        let s = |out: &mut BytesMut, v: &Option<ShortStr>| {
            if let Some(v) = v {
                put_shortstr(out, v);
            }
        };
        s(out, &self.content_type);
        s(out, &self.content_encoding);
        if let Some(h) = &self.headers {
            h.encode(out);
        }
        if let Some(v) = self.delivery_mode {
            out.put_u8(v);
        }
        if let Some(v) = self.priority {
            out.put_u8(v);
        }
        s(out, &self.correlation_id);
        s(out, &self.reply_to);
        s(out, &self.expiration);
        s(out, &self.message_id);
        if let Some(v) = self.timestamp {
            out.put_u64(v);
        }
        s(out, &self.kind);
        s(out, &self.user_id);
        s(out, &self.app_id);
        s(out, &self.cluster_id);
    }

    /// The raw form used in [`crate::ContentHeader::properties`].
    pub fn encode(&self) -> Bytes {
        let mut out = BytesMut::new();
        self.encode_to(&mut out);
        out.freeze()
    }

    /// True when `delivery_mode` is 2.
    pub fn is_persistent(&self) -> bool {
        self.delivery_mode == Some(2)
    }
}

/// Checks that raw basic properties are well formed (flags, lengths, UTF-8 of the
/// shortstrs, header table structure and nesting) without allocating. Bytes after the
/// last property are tolerated.
pub fn validate(raw: &Bytes) -> Result<(), CodecError> {
    let mut buf = raw.clone();
    let f = read_flags(&mut buf)?;
    for (flag, kind) in LAYOUT {
        if f & flag == 0 {
            continue;
        }
        match kind {
            Kind::ShortStr => {
                let len = get_u8(&mut buf)? as usize;
                let s = take(&mut buf, len)?;
                std::str::from_utf8(&s).map_err(|_| CodecError::InvalidUtf8)?;
            }
            Kind::Table => validate_table_body(get_longstr(&mut buf)?, 0)?,
            Kind::Octet => {
                take(&mut buf, 1)?;
            }
            Kind::Timestamp => {
                take(&mut buf, 8)?;
            }
        }
    }
    Ok(())
}

/// The raw bytes starting at the property `flag`, if present; `None` if absent or if
/// the bytes before it are malformed.
fn locate(raw: &[u8], flag: u16) -> Option<&[u8]> {
    let mut rest = raw;
    let first = read_u16(&mut rest)?;
    let mut word = first;
    while word & flags::CONTINUATION != 0 {
        word = read_u16(&mut rest)?;
    }
    if first & flag == 0 {
        return None;
    }
    for (f, kind) in LAYOUT {
        if f == flag {
            return Some(rest);
        }
        if first & f == 0 {
            continue;
        }
        let skip = match kind {
            Kind::ShortStr => 1 + *rest.first()? as usize,
            Kind::Table => {
                let len = rest.get(..4)?;
                4 + u32::from_be_bytes([*len.first()?, *len.get(1)?, *len.get(2)?, *len.get(3)?])
                    as usize
            }
            Kind::Octet => 1,
            Kind::Timestamp => 8,
        };
        rest = rest.get(skip..)?;
    }
    None
}

fn read_u16(rest: &mut &[u8]) -> Option<u16> {
    let mut b = *rest;
    if b.remaining() < 2 {
        return None;
    }
    let v = b.get_u16();
    *rest = b;
    Some(v)
}

fn raw_shortstr(raw: &[u8], flag: u16) -> Option<&str> {
    let at = locate(raw, flag)?;
    let len = *at.first()? as usize;
    std::str::from_utf8(at.get(1..1 + len)?).ok()
}

fn raw_octet(raw: &[u8], flag: u16) -> Option<u8> {
    locate(raw, flag)?.first().copied()
}

/// `delivery-mode` from raw properties (2 = persistent).
pub fn delivery_mode(raw: &[u8]) -> Option<u8> {
    raw_octet(raw, flags::DELIVERY_MODE)
}

/// True when the raw properties say `delivery-mode` 2.
pub fn is_persistent(raw: &[u8]) -> bool {
    delivery_mode(raw) == Some(2)
}

/// `priority` from raw properties.
pub fn priority(raw: &[u8]) -> Option<u8> {
    raw_octet(raw, flags::PRIORITY)
}

/// `expiration` from raw properties (a decimal TTL in ms, unparsed).
pub fn expiration(raw: &[u8]) -> Option<&str> {
    raw_shortstr(raw, flags::EXPIRATION)
}

/// `timestamp` from raw properties.
pub fn timestamp(raw: &[u8]) -> Option<u64> {
    let at = locate(raw, flags::TIMESTAMP)?;
    let mut b = at.get(..8)?;
    Some(b.get_u64())
}

/// `content-type` from raw properties.
pub fn content_type(raw: &[u8]) -> Option<&str> {
    raw_shortstr(raw, flags::CONTENT_TYPE)
}

/// `correlation-id` from raw properties.
pub fn correlation_id(raw: &[u8]) -> Option<&str> {
    raw_shortstr(raw, flags::CORRELATION_ID)
}

/// `reply-to` from raw properties.
pub fn reply_to(raw: &[u8]) -> Option<&str> {
    raw_shortstr(raw, flags::REPLY_TO)
}

/// `message-id` from raw properties.
pub fn message_id(raw: &[u8]) -> Option<&str> {
    raw_shortstr(raw, flags::MESSAGE_ID)
}

/// `type` from raw properties.
pub fn kind(raw: &[u8]) -> Option<&str> {
    raw_shortstr(raw, flags::TYPE)
}

/// `user-id` from raw properties.
pub fn user_id(raw: &[u8]) -> Option<&str> {
    raw_shortstr(raw, flags::USER_ID)
}

/// `app-id` from raw properties.
pub fn app_id(raw: &[u8]) -> Option<&str> {
    raw_shortstr(raw, flags::APP_ID)
}

/// The `headers` table *body* (the bytes after its 4-byte length), if present; decode
/// it with [`FieldTable::decode_body`].
pub fn headers_raw(raw: &[u8]) -> Option<&[u8]> {
    let at = locate(raw, flags::HEADERS)?;
    let len = at.get(..4)?;
    let len = u32::from_be_bytes([*len.first()?, *len.get(1)?, *len.get(2)?, *len.get(3)?]);
    at.get(4..4 + len as usize)
}

/// The `headers` table, decoded zero-copy from `raw`. `Ok(None)` when absent.
pub fn headers(raw: &Bytes) -> Result<Option<FieldTable>, CodecError> {
    match headers_raw(raw) {
        None => Ok(None),
        Some(body) => {
            // `body` lies inside `raw`: slice it rather than copy.
            let start = body.as_ptr() as usize - raw.as_ptr() as usize;
            FieldTable::decode_body(raw.slice(start..start + body.len())).map(Some)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::table::FieldValue;

    fn full() -> BasicProperties {
        let mut h = FieldTable::new();
        h.insert("x-delay", FieldValue::I32(5000));
        h.insert("k", FieldValue::long_str("v"));
        BasicProperties {
            content_type: Some("application/json".into()),
            content_encoding: Some("gzip".into()),
            headers: Some(h),
            delivery_mode: Some(2),
            priority: Some(7),
            correlation_id: Some("corr".into()),
            reply_to: Some("amq.rabbitmq.reply-to".into()),
            expiration: Some("60000".into()),
            message_id: Some("m1".into()),
            timestamp: Some(1_700_000_000),
            kind: Some("t".into()),
            user_id: Some("guest".into()),
            app_id: Some("app".into()),
            cluster_id: Some("c".into()),
        }
    }

    #[test]
    fn round_trip_and_raw_accessors() {
        let p = full();
        let raw = p.encode();
        assert_eq!(BasicProperties::decode(&raw).unwrap(), p);
        validate(&raw).unwrap();
        assert_eq!(delivery_mode(&raw), Some(2));
        assert!(is_persistent(&raw));
        assert_eq!(priority(&raw), Some(7));
        assert_eq!(expiration(&raw), Some("60000"));
        assert_eq!(timestamp(&raw), Some(1_700_000_000));
        assert_eq!(content_type(&raw), Some("application/json"));
        assert_eq!(correlation_id(&raw), Some("corr"));
        assert_eq!(reply_to(&raw), Some("amq.rabbitmq.reply-to"));
        assert_eq!(message_id(&raw), Some("m1"));
        assert_eq!(kind(&raw), Some("t"));
        assert_eq!(user_id(&raw), Some("guest"));
        assert_eq!(app_id(&raw), Some("app"));
        let h = headers(&raw).unwrap().unwrap();
        assert_eq!(h.get("x-delay"), Some(&FieldValue::I32(5000)));
        let body = headers_raw(&raw).unwrap();
        assert_eq!(
            FieldTable::decode_body(Bytes::copy_from_slice(body)).unwrap(),
            h
        );
    }

    #[test]
    fn sparse_and_empty() {
        let p = BasicProperties {
            expiration: Some("10".into()),
            ..Default::default()
        };
        let raw = p.encode();
        assert_eq!(&raw[..], &[0x01, 0x00, 2, b'1', b'0']);
        assert_eq!(expiration(&raw), Some("10"));
        assert_eq!(delivery_mode(&raw), None);
        assert_eq!(headers_raw(&raw), None);
        let empty = BasicProperties::default().encode();
        assert_eq!(&empty[..], EMPTY_PROPERTIES);
        assert_eq!(
            BasicProperties::decode(EMPTY_PROPERTIES).unwrap(),
            BasicProperties::default()
        );
    }

    #[test]
    fn continuation_words() {
        // delivery-mode 1 with the continuation bit and one empty extra flag word
        let raw = Bytes::from_static(&[0x10, 0x01, 0x00, 0x00, 1]);
        let p = BasicProperties::decode(&raw).unwrap();
        assert_eq!(p.delivery_mode, Some(1));
        assert_eq!(delivery_mode(&raw), Some(1));
        validate(&raw).unwrap();
        // a continuation word naming a property is rejected
        let raw = Bytes::from_static(&[0x00, 0x01, 0x80, 0x00]);
        assert_eq!(
            BasicProperties::decode(&raw),
            Err(CodecError::BadPropertyFlags(0x8000))
        );
        assert!(validate(&raw).is_err());
    }

    #[test]
    fn malformed_raw_never_panics() {
        let raw = full().encode();
        for cut in 0..raw.len() {
            let part = raw.slice(..cut);
            let _ = delivery_mode(&part);
            let _ = expiration(&part);
            let _ = headers_raw(&part);
            let _ = priority(&part);
            let _ = timestamp(&part);
            let _ = headers(&part);
            assert!(BasicProperties::decode(&part).is_err());
            assert!(validate(&part).is_err());
        }
    }
}
