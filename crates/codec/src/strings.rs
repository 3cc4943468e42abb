//! AMQP short strings.
//!
//! A `shortstr` is at most 255 octets. Warren requires it to be valid UTF-8 (RabbitMQ
//! treats shortstrs as binaries but rejects malformed UTF-8 where it checks names), so a
//! [`ShortStr`] is a cheaply clonable, reference-counted `str` of at most 255 bytes.
//! Long strings (`longstr`) are plain [`bytes::Bytes`].

use std::borrow::Borrow;
use std::cmp::Ordering;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::ops::Deref;

use bytes::Bytes;
use bytestring::ByteString;

use crate::error::CodecError;

/// An AMQP `shortstr`: valid UTF-8, at most [`ShortStr::MAX_LEN`] bytes.
///
/// Cloning bumps a reference count; decoding slices the frame payload without copying.
#[derive(Clone, Default)]
pub struct ShortStr(ByteString);

impl ShortStr {
    /// The longest shortstr, in bytes.
    pub const MAX_LEN: usize = 255;

    /// The empty string.
    pub fn empty() -> Self {
        ShortStr(ByteString::from_static(""))
    }

    /// Wraps a static string without copying. Longer strings than 255 bytes are cut at
    /// the last character boundary at or below 255 bytes (a programming error, caught by a
    /// debug assertion).
    pub fn from_static(s: &'static str) -> Self {
        debug_assert!(s.len() <= Self::MAX_LEN, "shortstr longer than 255 bytes");
        ShortStr(ByteString::from_static(truncate_str(s, Self::MAX_LEN)))
    }

    /// Takes ownership of a `String`. Longer strings than 255 bytes are cut at the last
    /// character boundary at or below 255 bytes (use [`ShortStr::try_from_string`] to get
    /// an error instead).
    pub fn from_string(mut s: String) -> Self {
        if s.len() > Self::MAX_LEN {
            let cut = truncate_str(&s, Self::MAX_LEN).len();
            s.truncate(cut);
        }
        ShortStr(ByteString::from(s))
    }

    /// Takes ownership of a `String`, failing if it is longer than 255 bytes.
    pub fn try_from_string(s: String) -> Result<Self, CodecError> {
        if s.len() > Self::MAX_LEN {
            return Err(CodecError::ShortStrTooLong(s.len()));
        }
        Ok(ShortStr(ByteString::from(s)))
    }

    /// Copies a `&str`, failing if it is longer than 255 bytes.
    pub fn try_from_str(s: &str) -> Result<Self, CodecError> {
        if s.len() > Self::MAX_LEN {
            return Err(CodecError::ShortStrTooLong(s.len()));
        }
        Ok(ShortStr(ByteString::from(s)))
    }

    /// A copy with its own allocation. Decoded strings are slices of the network read buffer; one that lives
    /// long (a queue name, a consumer tag) would keep that whole buffer alive.
    pub fn detached(&self) -> Self {
        ShortStr(ByteString::from(self.as_str()))
    }

    /// Wraps bytes (zero copy), checking the length and UTF-8.
    pub fn try_from_bytes(bytes: Bytes) -> Result<Self, CodecError> {
        if bytes.len() > Self::MAX_LEN {
            return Err(CodecError::ShortStrTooLong(bytes.len()));
        }
        ByteString::try_from(bytes)
            .map(ShortStr)
            .map_err(|_| CodecError::InvalidUtf8)
    }

    /// The string.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The UTF-8 bytes.
    pub fn as_bytes(&self) -> &[u8] {
        self.0.as_bytes()
    }

    /// Length in bytes (at most 255).
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// True for the empty string.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The underlying shared buffer.
    pub fn into_bytes(self) -> Bytes {
        self.0.into_bytes()
    }

    /// The underlying `ByteString`.
    pub fn into_inner(self) -> ByteString {
        self.0
    }
}

/// The longest prefix of `s` that is at most `max` bytes and ends on a char boundary.
pub(crate) fn truncate_str(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut cut = max;
    while cut > 0 && !s.is_char_boundary(cut) {
        cut -= 1;
    }
    s.get(..cut).unwrap_or("")
}

impl Deref for ShortStr {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for ShortStr {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl AsRef<[u8]> for ShortStr {
    fn as_ref(&self) -> &[u8] {
        self.0.as_bytes()
    }
}

impl Borrow<str> for ShortStr {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl From<&'static str> for ShortStr {
    fn from(s: &'static str) -> Self {
        ShortStr::from_static(s)
    }
}

impl TryFrom<String> for ShortStr {
    type Error = CodecError;
    fn try_from(s: String) -> Result<Self, CodecError> {
        ShortStr::try_from_string(s)
    }
}

impl TryFrom<Bytes> for ShortStr {
    type Error = CodecError;
    fn try_from(b: Bytes) -> Result<Self, CodecError> {
        ShortStr::try_from_bytes(b)
    }
}

impl From<ShortStr> for String {
    fn from(s: ShortStr) -> String {
        s.as_str().to_owned()
    }
}

impl PartialEq for ShortStr {
    fn eq(&self, other: &ShortStr) -> bool {
        self.as_str() == other.as_str()
    }
}

impl Eq for ShortStr {}

impl PartialEq<str> for ShortStr {
    fn eq(&self, other: &str) -> bool {
        self.as_str() == other
    }
}

impl PartialEq<&str> for ShortStr {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl PartialEq<String> for ShortStr {
    fn eq(&self, other: &String) -> bool {
        self.as_str() == other.as_str()
    }
}

impl PartialEq<ShortStr> for str {
    fn eq(&self, other: &ShortStr) -> bool {
        self == other.as_str()
    }
}

impl PartialEq<ShortStr> for &str {
    fn eq(&self, other: &ShortStr) -> bool {
        *self == other.as_str()
    }
}

/// Hashes exactly like `str`, so `HashMap<ShortStr, _>` can be queried with `&str`.
impl Hash for ShortStr {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.as_str().hash(state)
    }
}

impl PartialOrd for ShortStr {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for ShortStr {
    fn cmp(&self, other: &Self) -> Ordering {
        self.as_str().cmp(other.as_str())
    }
}

impl fmt::Debug for ShortStr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl fmt::Display for ShortStr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self.as_str(), f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn basics() {
        let s = ShortStr::from("amq.direct");
        assert_eq!(s, "amq.direct");
        assert_eq!(s.len(), 10);
        assert!(!s.is_empty());
        assert!(ShortStr::default().is_empty());
        assert_eq!(format!("{s}"), "amq.direct");
        assert_eq!(format!("{s:?}"), "\"amq.direct\"");
        let mut m = HashMap::new();
        m.insert(s.clone(), 1);
        assert_eq!(m.get("amq.direct"), Some(&1));
    }

    #[test]
    fn limits() {
        let long = "é".repeat(200); // 400 bytes
        let cut = ShortStr::from_string(long.clone());
        assert_eq!(cut.len(), 254);
        assert!(ShortStr::try_from_string(long).is_err());
        assert!(ShortStr::try_from_bytes(Bytes::from_static(b"\xff")).is_err());
        assert_eq!(
            ShortStr::try_from_bytes(Bytes::from(vec![b'a'; 256])),
            Err(CodecError::ShortStrTooLong(256))
        );
        assert!(ShortStr::try_from_bytes(Bytes::from(vec![b'a'; 255])).is_ok());
    }
}
