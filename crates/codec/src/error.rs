//! Decoding errors and the reply RabbitMQ sends for each.
//!
//! What RabbitMQ 3.x does (rabbit_reader / rabbit_command_assembler / rabbit_misc):
//! - a frame whose size field exceeds the negotiated frame_max (with an 8-byte fudge),
//!   a bad frame-end octet, an unknown frame type, or a method/header frame too short
//!   for its fixed fields: `connection.close` 501 FRAME_ERROR, text like
//!   `type 1, all octets = <<>>: {frame_too_large,200000,131064}`;
//! - a heartbeat frame on a channel other than 0: 505 UNEXPECTED_FRAME;
//! - method arguments that do not decode (too short, trailing bytes, bad table):
//!   501 FRAME_ERROR `cannot decode <<...>>`, with the method's class and method ids;
//! - an unknown class/method id: RabbitMQ's reader crashes without a close frame; Warren
//!   answers 540 NOT_IMPLEMENTED with the unknown ids.
//!
//! All of them are connection-level errors.

use bytes::Bytes;

use crate::method::method_name;
use crate::reply::{format_reply_text, AmqpError, ReplyCode};

/// Maximum nesting of field tables and arrays accepted by the decoder.
pub const MAX_TABLE_DEPTH: usize = 64;

/// Why bytes could not be decoded.
#[derive(thiserror::Error, Debug, Clone, PartialEq)]
pub enum CodecError {
    /// The 8-byte protocol header is not `AMQP 0-0-9-1` (nor 0-9's `AMQP 1-1-0-9`): the
    /// server answers with its own header and closes the socket.
    #[error("bad protocol header {received:?}")]
    BadProtocolHeader { received: [u8; 8] },
    /// The frame header's size field exceeds frame_max (checked before any payload is
    /// buffered). `size` is the payload size from the header, `max` the negotiated
    /// frame_max.
    #[error("frame of type {frame_type} with payload size {size} exceeds frame_max {max}")]
    FrameTooLarge { frame_type: u8, size: u32, max: u32 },
    /// The octet after the payload is not 0xCE.
    #[error("invalid frame end marker {marker:#04x} after a frame of type {frame_type}")]
    BadFrameEnd { frame_type: u8, marker: u8 },
    /// Frame type other than 1 (method), 2 (header), 3 (body), 8 (heartbeat).
    #[error("unknown frame type {0}")]
    UnknownFrameType(u8),
    /// A heartbeat frame with a non-empty payload.
    #[error("heartbeat frame with a {0}-byte payload")]
    BadHeartbeat(u32),
    /// A heartbeat frame on a channel other than 0 (505 UNEXPECTED_FRAME).
    #[error("heartbeat frame on channel {channel}")]
    UnexpectedHeartbeat { channel: u16 },
    /// A complete frame whose payload is too short for what it must hold.
    #[error("frame payload too short")]
    Truncated,
    /// Class/method ids that name no AMQP 0-9-1 (or RabbitMQ extension) method.
    #[error("unknown method class {class_id} method {method_id}")]
    UnknownMethod { class_id: u16, method_id: u16 },
    /// Bytes left over after the last argument of a method.
    #[error("{0} bytes left over after the method arguments")]
    TrailingBytes(usize),
    /// The arguments of a known method do not decode; `cause` says why and `args` holds
    /// the argument bytes (a zero-copy slice, used for RabbitMQ's `cannot decode` text).
    #[error("cannot decode the arguments of {}: {cause}", method_name(*class_id, *method_id))]
    BadMethodArgs {
        class_id: u16,
        method_id: u16,
        cause: Box<CodecError>,
        args: Bytes,
    },
    /// A field table or array value with a type tag RabbitMQ does not parse.
    #[error("unknown field value type {0:#04x}")]
    BadFieldType(u8),
    /// A shortstr (or table key) that is not valid UTF-8.
    #[error("malformed UTF-8 in shortstr")]
    InvalidUtf8,
    /// A string longer than 255 bytes where a shortstr is required.
    #[error("shortstr of {0} bytes is longer than 255")]
    ShortStrTooLong(usize),
    /// Field tables/arrays nested deeper than [`MAX_TABLE_DEPTH`].
    #[error("field table nested deeper than {MAX_TABLE_DEPTH} levels")]
    TableTooDeep,
    /// Content property flags naming properties that do not exist.
    #[error("invalid property flags {0:#06x}")]
    BadPropertyFlags(u16),
}

impl CodecError {
    /// The reply code RabbitMQ closes the connection with.
    pub fn reply_code(&self) -> ReplyCode {
        match self {
            CodecError::UnexpectedHeartbeat { .. } => ReplyCode::UnexpectedFrame,
            CodecError::UnknownMethod { .. } => ReplyCode::NotImplemented,
            _ => ReplyCode::FrameError,
        }
    }

    /// Class and method ids of the offending method, (0, 0) when none is known.
    pub fn class_method(&self) -> (u16, u16) {
        match self {
            CodecError::UnknownMethod {
                class_id,
                method_id,
            }
            | CodecError::BadMethodArgs {
                class_id,
                method_id,
                ..
            } => (*class_id, *method_id),
            _ => (0, 0),
        }
    }

    /// The explanation part of the reply text (after `"FRAME_ERROR - "`), in RabbitMQ's
    /// words where it has some.
    pub fn explanation(&self) -> String {
        match self {
            CodecError::FrameTooLarge {
                frame_type,
                size,
                max,
            } => format!(
                "type {frame_type}, all octets = <<>>: {{frame_too_large,{size},{}}}",
                max.saturating_sub(8)
            ),
            CodecError::BadFrameEnd { frame_type, marker } => {
                format!("type {frame_type}: {{invalid_frame_end_marker,{marker}}}")
            }
            CodecError::UnknownFrameType(t) => format!("type {t}: unknown_frame"),
            CodecError::BadHeartbeat(_) => "type 8: unknown_frame".to_owned(),
            CodecError::UnexpectedHeartbeat { .. } => "type 8, all octets = <<>>".to_owned(),
            CodecError::BadMethodArgs { args, .. } => {
                format!("cannot decode {}", erlang_binary(args))
            }
            CodecError::UnknownMethod {
                class_id,
                method_id,
            } => format!("unknown method {{{class_id},{method_id}}}"),
            CodecError::InvalidUtf8 => "Malformed UTF-8 in shortstr".to_owned(),
            other => other.to_string(),
        }
    }

    /// The full reply text, e.g. `"FRAME_ERROR - cannot decode <<...>>"`, cut to 255
    /// bytes.
    pub fn reply_text(&self) -> String {
        format_reply_text(self.reply_code(), &self.explanation())
    }

    /// The error as the broker reports it (code + explanation).
    pub fn to_amqp_error(&self) -> AmqpError {
        AmqpError::new(self.reply_code(), self.explanation())
    }

    /// Every decode error closes the connection.
    pub fn is_hard(&self) -> bool {
        true
    }

    pub(crate) fn in_method(self, class_id: u16, method_id: u16, args: Bytes) -> CodecError {
        match self {
            e @ (CodecError::BadMethodArgs { .. } | CodecError::UnknownMethod { .. }) => e,
            cause => CodecError::BadMethodArgs {
                class_id,
                method_id,
                cause: Box::new(cause),
                args,
            },
        }
    }
}

impl From<CodecError> for AmqpError {
    fn from(e: CodecError) -> AmqpError {
        e.to_amqp_error()
    }
}

/// An error from [`crate::FrameDecoder::decode`]: the channel of the offending frame (0
/// when unknown or for connection frames) and what went wrong. All decoder errors are
/// connection errors: send `connection.close` with [`DecodeError::reply_code`],
/// [`DecodeError::reply_text`] and [`DecodeError::class_method`], then stop reading.
#[derive(thiserror::Error, Debug, Clone, PartialEq)]
#[error("channel {channel}: {error}")]
pub struct DecodeError {
    pub channel: u16,
    #[source]
    pub error: CodecError,
}

impl DecodeError {
    pub fn new(channel: u16, error: CodecError) -> Self {
        DecodeError { channel, error }
    }
    pub fn reply_code(&self) -> ReplyCode {
        self.error.reply_code()
    }
    pub fn reply_text(&self) -> String {
        self.error.reply_text()
    }
    pub fn class_method(&self) -> (u16, u16) {
        self.error.class_method()
    }
    pub fn to_amqp_error(&self) -> AmqpError {
        self.error.to_amqp_error()
    }
}

impl From<DecodeError> for CodecError {
    fn from(e: DecodeError) -> CodecError {
        e.error
    }
}

impl From<DecodeError> for AmqpError {
    fn from(e: DecodeError) -> AmqpError {
        e.error.to_amqp_error()
    }
}

/// Formats bytes as Erlang's `~w` prints a binary: `<<"text">>` when every byte is
/// printable ASCII, `<<1,2,3>>` otherwise. At most 256 bytes are shown (the reply text
/// is cut to 255 anyway).
pub(crate) fn erlang_binary(bytes: &[u8]) -> String {
    let shown = bytes.get(..256).unwrap_or(bytes);
    let mut s = String::with_capacity(shown.len() * 2 + 4);
    s.push_str("<<");
    if !shown.is_empty() && shown.iter().all(|b| (0x20..0x7f).contains(b)) {
        s.push('"');
        for &b in shown {
            if b == b'"' || b == b'\\' {
                s.push('\\');
            }
            s.push(b as char);
        }
        s.push('"');
    } else {
        for (i, b) in shown.iter().enumerate() {
            if i > 0 {
                s.push(',');
            }
            s.push_str(&b.to_string());
        }
    }
    s.push_str(">>");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reply_codes_and_texts() {
        let e = CodecError::FrameTooLarge {
            frame_type: 1,
            size: 200000,
            max: 131072,
        };
        assert_eq!(e.reply_code(), ReplyCode::FrameError);
        assert_eq!(
            e.reply_text(),
            "FRAME_ERROR - type 1, all octets = <<>>: {frame_too_large,200000,131064}"
        );
        let e = CodecError::UnexpectedHeartbeat { channel: 3 };
        assert_eq!(e.reply_code(), ReplyCode::UnexpectedFrame);
        assert_eq!(
            e.reply_text(),
            "UNEXPECTED_FRAME - type 8, all octets = <<>>"
        );
        let e = CodecError::UnknownMethod {
            class_id: 60,
            method_id: 99,
        };
        assert_eq!(e.reply_code(), ReplyCode::NotImplemented);
        assert_eq!(e.class_method(), (60, 99));
        let e = CodecError::Truncated.in_method(60, 40, Bytes::from_static(&[0, 0, 3]));
        assert_eq!(e.class_method(), (60, 40));
        assert_eq!(e.reply_text(), "FRAME_ERROR - cannot decode <<0,0,3>>");
        assert_eq!(
            e.to_string(),
            "cannot decode the arguments of basic.publish: frame payload too short"
        );
        let e = CodecError::InvalidUtf8.in_method(50, 10, Bytes::from_static(b"ab\"c"));
        assert_eq!(
            e.reply_text(),
            "FRAME_ERROR - cannot decode <<\"ab\\\"c\">>"
        );
        let d = DecodeError::new(
            5,
            CodecError::BadFrameEnd {
                frame_type: 3,
                marker: 0,
            },
        );
        assert_eq!(d.reply_code(), ReplyCode::FrameError);
        assert_eq!(
            d.to_string(),
            "channel 5: invalid frame end marker 0x00 after a frame of type 3"
        );
        let a: AmqpError = d.into();
        assert_eq!(a.code, ReplyCode::FrameError);
    }
}
