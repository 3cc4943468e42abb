//! Writing frames into a connection's output buffer.

use bytes::BytesMut;
use warren_codec::{encode_method, Method};

/// Appends one method frame; the buffer is handed to the socket writer in one piece per batch.
pub(crate) fn send(out: &mut BytesMut, channel: u16, method: impl Into<Method>) {
    encode_method(out, channel, &method.into());
}
