//! warren-codec: a sans-IO AMQP 0-9-1 codec for the Warren broker.
//!
//! - [`FrameDecoder`] takes frames off a read buffer incrementally, checking the frame
//!   header (type, size against frame_max) before any payload is buffered; payloads,
//!   strings and bodies are zero-copy [`bytes::Bytes`] slices of the read buffer.
//! - [`Method`] covers every 0-9-1 method plus RabbitMQ's extensions, one struct each.
//! - [`ContentHeader`] keeps the raw properties for byte-exact forwarding;
//!   [`BasicProperties`] and the [`properties`] accessors read them when needed.
//! - [`FieldTable`] / [`FieldValue`] use RabbitMQ's type tags and re-encode
//!   byte-identically.
//! - The `encode_*` functions write whole frames (deliver, get-ok, return, ack, nack,
//!   content split at frame_max) straight into an output buffer.
//! - [`CodecError`] / [`DecodeError`] say which `connection.close` RabbitMQ would send;
//!   [`ReplyCode`] and [`AmqpError`] are the protocol errors shared by broker and session.
//!
//! No I/O, no clock, no async runtime.

pub mod encode;
pub mod error;
pub mod frame;
pub mod method;
pub mod properties;
pub mod reply;
pub mod strings;
pub mod table;
mod wire;

#[doc(hidden)]
pub mod fuzzing;

#[cfg(test)]
#[path = "tests/oracle.rs"]
mod oracle;
#[cfg(test)]
#[path = "tests/proptests.rs"]
mod proptests;
#[cfg(test)]
#[path = "tests/testing.rs"]
mod testing;

pub use encode::{
    content_header_frame_len, encode_ack, encode_content, encode_deliver, encode_get_ok,
    encode_heartbeat, encode_method, encode_nack, encode_return, frame_fits,
};
pub use error::{CodecError, DecodeError, MAX_TABLE_DEPTH};
pub use frame::{
    decode_protocol_header, ContentHeader, Frame, FrameDecoder, FRAME_BODY, FRAME_END,
    FRAME_HEADER, FRAME_HEADER_LEN, FRAME_HEARTBEAT, FRAME_METHOD, FRAME_MIN_SIZE, FRAME_OVERHEAD,
    FRAME_SIZE_FUDGE, PROTOCOL_HEADER,
};
pub use method::*;
pub use properties::BasicProperties;
pub use reply::{format_reply_text, AmqpError, ReplyCode};
pub use strings::ShortStr;
pub use table::{FieldTable, FieldValue};
