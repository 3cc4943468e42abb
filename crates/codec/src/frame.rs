//! Frames and the incremental frame decoder.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::encode::{encode_heartbeat_on, encode_method, write_frame_header};
use crate::error::{CodecError, DecodeError};
use crate::method::Method;
use crate::properties::{validate, BasicProperties};
use crate::wire::{get_u16, get_u64};

/// The protocol header a 0-9-1 client sends, and the one the server answers with when
/// it refuses another version.
pub const PROTOCOL_HEADER: &[u8; 8] = b"AMQP\x00\x00\x09\x01";
/// The frame-end octet.
pub const FRAME_END: u8 = 0xCE;
/// Type (1) + channel (2) + size (4).
pub const FRAME_HEADER_LEN: usize = 7;
/// Header + frame-end: what a frame costs beyond its payload.
pub const FRAME_OVERHEAD: usize = 8;
/// The smallest frame_max a peer may negotiate.
pub const FRAME_MIN_SIZE: u32 = 4096;
/// RabbitMQ tolerates frames up to this many bytes over frame_max, "since quite a few
/// \[clients\] get it wrong - off-by 1 or 8 (empty frame size) are typical": a frame is too
/// large when its payload size exceeds frame_max - 8 + 8.
pub const FRAME_SIZE_FUDGE: u32 = 8;

pub const FRAME_METHOD: u8 = 1;
pub const FRAME_HEADER: u8 = 2;
pub const FRAME_BODY: u8 = 3;
pub const FRAME_HEARTBEAT: u8 = 8;

/// The fixed part of a content header payload: class, weight, body size.
pub const CONTENT_HEADER_FIXED_LEN: usize = 12;

/// A content header. `properties` holds the raw property flags and list, forwarded byte
/// for byte; decode them with [`ContentHeader::basic_properties`] or read single
/// properties with the functions of [`crate::properties`].
#[derive(Clone, Debug, PartialEq)]
pub struct ContentHeader {
    pub class_id: u16,
    pub weight: u16,
    pub body_size: u64,
    pub properties: Bytes,
}

impl ContentHeader {
    /// Decodes a header frame payload. For the basic class (60) the raw properties are
    /// validated (structure, UTF-8, table nesting) without allocating, so they are safe to
    /// forward.
    pub fn decode(payload: Bytes) -> Result<Self, CodecError> {
        let mut p = payload;
        if p.len() < CONTENT_HEADER_FIXED_LEN + 2 {
            return Err(CodecError::Truncated);
        }
        let class_id = get_u16(&mut p)?;
        let weight = get_u16(&mut p)?;
        let body_size = get_u64(&mut p)?;
        if class_id == crate::method::class::BASIC {
            validate(&p)?;
        }
        Ok(ContentHeader {
            class_id,
            weight,
            body_size,
            properties: p,
        })
    }

    /// Appends the header frame payload.
    pub fn encode(&self, out: &mut BytesMut) {
        out.put_u16(self.class_id);
        out.put_u16(self.weight);
        out.put_u64(self.body_size);
        out.put_slice(&self.properties);
    }

    /// Decodes the properties (zero copy).
    pub fn basic_properties(&self) -> Result<BasicProperties, CodecError> {
        BasicProperties::decode_bytes(self.properties.clone())
    }
}

/// One AMQP frame.
#[derive(Clone, Debug, PartialEq)]
pub enum Frame {
    Method { channel: u16, method: Method },
    Header { channel: u16, header: ContentHeader },
    Body { channel: u16, payload: Bytes },
    Heartbeat { channel: u16 },
}

impl Frame {
    pub fn channel(&self) -> u16 {
        match *self {
            Frame::Method { channel, .. }
            | Frame::Header { channel, .. }
            | Frame::Body { channel, .. }
            | Frame::Heartbeat { channel } => channel,
        }
    }

    /// The frame type octet.
    pub fn frame_type(&self) -> u8 {
        match self {
            Frame::Method { .. } => FRAME_METHOD,
            Frame::Header { .. } => FRAME_HEADER,
            Frame::Body { .. } => FRAME_BODY,
            Frame::Heartbeat { .. } => FRAME_HEARTBEAT,
        }
    }

    /// Appends the whole frame (header, payload, frame-end). A body frame is written as
    /// is, not split.
    pub fn encode(&self, out: &mut BytesMut) {
        match self {
            Frame::Method { channel, method } => encode_method(out, *channel, method),
            Frame::Header { channel, header } => {
                let size = CONTENT_HEADER_FIXED_LEN + header.properties.len();
                write_frame_header(out, FRAME_HEADER, *channel, size);
                header.encode(out);
                out.put_u8(FRAME_END);
            }
            Frame::Body { channel, payload } => {
                write_frame_header(out, FRAME_BODY, *channel, payload.len());
                out.put_slice(payload);
                out.put_u8(FRAME_END);
            }
            Frame::Heartbeat { channel } => encode_heartbeat_on(out, *channel),
        }
    }
}

/// Incremental, zero-copy frame decoder.
///
/// Feed it the connection's read buffer; each call takes at most one frame off the
/// front. The 7-byte frame header is checked (type, size against frame_max) before any
/// payload is awaited, so a huge size field fails at once. Payloads are split off the
/// buffer without copying.
///
/// Errors are connection errors (see [`DecodeError`]). After a framing error (too large,
/// bad frame end, unknown type) the buffer is left as it was and the stream is out of
/// sync: close the connection. After a method or header error the frame has been
/// consumed.
#[derive(Clone, Debug)]
pub struct FrameDecoder {
    frame_max: u32,
}

impl Default for FrameDecoder {
    /// A decoder for the handshake: frame_max = [`FRAME_MIN_SIZE`] until tune-ok.
    fn default() -> Self {
        FrameDecoder::new(FRAME_MIN_SIZE)
    }
}

impl FrameDecoder {
    /// `frame_max` is the largest frame accepted, overhead included (0 = no limit: avoid,
    /// the size field of an untrusted peer then goes unchecked).
    pub fn new(frame_max: u32) -> Self {
        FrameDecoder { frame_max }
    }

    pub fn set_frame_max(&mut self, frame_max: u32) {
        self.frame_max = frame_max;
    }

    pub fn frame_max(&self) -> u32 {
        self.frame_max
    }

    /// Takes one frame off the front of `buf`. `Ok(None)`: more bytes are needed.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<Frame>, DecodeError> {
        let Some(header) = buf.get(..FRAME_HEADER_LEN) else {
            return Ok(None);
        };
        let Ok([frame_type, c0, c1, s0, s1, s2, s3]) = <[u8; FRAME_HEADER_LEN]>::try_from(header)
        else {
            return Ok(None);
        };
        let channel = u16::from_be_bytes([c0, c1]);
        let size = u32::from_be_bytes([s0, s1, s2, s3]);
        let err = |error| Err(DecodeError { channel, error });
        if !matches!(
            frame_type,
            FRAME_METHOD | FRAME_HEADER | FRAME_BODY | FRAME_HEARTBEAT
        ) {
            return err(CodecError::UnknownFrameType(frame_type));
        }
        if self.frame_max != 0
            && u64::from(size) + u64::from(FRAME_OVERHEAD as u32)
                > u64::from(self.frame_max) + u64::from(FRAME_SIZE_FUDGE)
        {
            return err(CodecError::FrameTooLarge {
                frame_type,
                size,
                max: self.frame_max,
            });
        }
        let total = FRAME_HEADER_LEN + size as usize + 1;
        if buf.len() < total {
            if self.frame_max != 0 {
                // bounded by frame_max, checked above
                buf.reserve(total - buf.len());
            }
            return Ok(None);
        }
        let marker = buf.get(total - 1).copied().unwrap_or(0);
        if marker != FRAME_END {
            return err(CodecError::BadFrameEnd { frame_type, marker });
        }
        let mut frame = buf.split_to(total);
        frame.advance(FRAME_HEADER_LEN);
        frame.truncate(size as usize);
        let payload = frame.freeze();
        let result = match frame_type {
            FRAME_METHOD => Method::decode(payload).map(|method| Frame::Method { channel, method }),
            FRAME_HEADER => {
                ContentHeader::decode(payload).map(|header| Frame::Header { channel, header })
            }
            FRAME_BODY => Ok(Frame::Body { channel, payload }),
            _ => {
                if size != 0 {
                    Err(CodecError::BadHeartbeat(size))
                } else if channel != 0 {
                    Err(CodecError::UnexpectedHeartbeat { channel })
                } else {
                    Ok(Frame::Heartbeat { channel })
                }
            }
        };
        result
            .map(Some)
            .map_err(|error| DecodeError { channel, error })
    }
}

/// Checks the protocol header at the start of a connection and consumes it.
///
/// `Ok(true)`: a 0-9-1 header (or 0-9's `AMQP 1 1 0 9`, which RabbitMQ also treats as
/// 0-9-1) was taken off `buf`. `Ok(false)`: fewer than 8 bytes so far, and they could
/// still be a valid header. `Err(BadProtocolHeader)`: answer with [`PROTOCOL_HEADER`] and
/// close the socket (bytes not received yet are shown as 0).
pub fn decode_protocol_header(buf: &mut BytesMut) -> Result<bool, CodecError> {
    let mut received = [0u8; 8];
    for (dst, src) in received.iter_mut().zip(buf.iter()) {
        *dst = *src;
    }
    let have = buf.len().min(8);
    let prefix_ok = received.iter().zip(b"AMQP").take(have).all(|(a, b)| a == b);
    if !prefix_ok {
        return Err(CodecError::BadProtocolHeader { received });
    }
    if buf.len() < 8 {
        return Ok(false);
    }
    match received {
        [b'A', b'M', b'Q', b'P', 0, 0, 9, 1] | [b'A', b'M', b'Q', b'P', 1, 1, 0, 9] => {
            buf.advance(8);
            Ok(true)
        }
        _ => Err(CodecError::BadProtocolHeader { received }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::encode::{encode_content, encode_heartbeat};
    use crate::method::{BasicAck, BasicPublish, ChannelOpen};

    fn publish_batch() -> BytesMut {
        let mut out = BytesMut::new();
        encode_method(
            &mut out,
            1,
            &Method::from(BasicPublish {
                exchange: "ex".into(),
                routing_key: "rk".into(),
                mandatory: true,
                ..Default::default()
            }),
        );
        encode_content(&mut out, 1, 60, &[0x10, 0, 2], b"hello world", 4096);
        encode_heartbeat(&mut out);
        encode_method(
            &mut out,
            1,
            &Method::from(BasicAck {
                delivery_tag: 9,
                multiple: true,
            }),
        );
        out
    }

    fn expected() -> Vec<Frame> {
        vec![
            Frame::Method {
                channel: 1,
                method: Method::from(BasicPublish {
                    exchange: "ex".into(),
                    routing_key: "rk".into(),
                    mandatory: true,
                    ..Default::default()
                }),
            },
            Frame::Header {
                channel: 1,
                header: ContentHeader {
                    class_id: 60,
                    weight: 0,
                    body_size: 11,
                    properties: Bytes::from_static(&[0x10, 0, 2]),
                },
            },
            Frame::Body {
                channel: 1,
                payload: Bytes::from_static(b"hello world"),
            },
            Frame::Heartbeat { channel: 0 },
            Frame::Method {
                channel: 1,
                method: Method::from(BasicAck {
                    delivery_tag: 9,
                    multiple: true,
                }),
            },
        ]
    }

    #[test]
    fn many_frames_in_one_buffer() {
        let mut buf = publish_batch();
        let mut dec = FrameDecoder::new(4096);
        let mut frames = Vec::new();
        while let Some(f) = dec.decode(&mut buf).unwrap() {
            frames.push(f);
        }
        assert!(buf.is_empty());
        assert_eq!(frames, expected());
    }

    #[test]
    fn one_byte_at_a_time() {
        let all = publish_batch();
        let mut dec = FrameDecoder::new(4096);
        let mut buf = BytesMut::new();
        let mut frames = Vec::new();
        for &b in all.iter() {
            buf.put_u8(b);
            if let Some(f) = dec.decode(&mut buf).unwrap() {
                frames.push(f);
                // nothing else is complete yet
                assert_eq!(dec.decode(&mut buf).unwrap(), None);
            }
        }
        assert!(buf.is_empty());
        assert_eq!(frames, expected());
    }

    #[test]
    fn oversize_rejected_from_header_alone() {
        let mut dec = FrameDecoder::new(131072);
        let mut buf = BytesMut::from(&[1u8, 0, 1, 0xff, 0xff, 0xff, 0xff][..]);
        let e = dec.decode(&mut buf).unwrap_err();
        assert_eq!(e.channel, 1);
        assert_eq!(
            e.error,
            CodecError::FrameTooLarge {
                frame_type: 1,
                size: u32::MAX,
                max: 131072
            }
        );
        assert_eq!(e.reply_code(), crate::ReplyCode::FrameError);
        // nothing was reserved for the payload
        assert!(buf.capacity() < 1024);
        // RabbitMQ's fudge: payload == frame_max is accepted, frame_max + 1 is not
        let mut dec = FrameDecoder::new(4096);
        let mut ok = BytesMut::new();
        write_frame_header(&mut ok, FRAME_BODY, 1, 4096);
        assert_eq!(dec.decode(&mut ok).unwrap(), None);
        let mut bad = BytesMut::new();
        write_frame_header(&mut bad, FRAME_BODY, 1, 4097);
        assert!(matches!(
            dec.decode(&mut bad).unwrap_err().error,
            CodecError::FrameTooLarge { size: 4097, .. }
        ));
    }

    #[test]
    fn bad_frame_end() {
        let mut buf = BytesMut::new();
        encode_heartbeat(&mut buf);
        let last = buf.len() - 1;
        buf[last] = 0xCD;
        let e = FrameDecoder::new(4096).decode(&mut buf).unwrap_err();
        assert_eq!(
            e.error,
            CodecError::BadFrameEnd {
                frame_type: 8,
                marker: 0xCD
            }
        );
        assert_eq!(e.reply_code(), crate::ReplyCode::FrameError);
    }

    #[test]
    fn frame_types() {
        let mut dec = FrameDecoder::new(4096);
        // unknown type 4 (0-8's oob-method), rejected from the header
        let mut buf = BytesMut::from(&[4u8, 0, 0, 0, 0, 0, 0][..]);
        assert_eq!(
            dec.decode(&mut buf).unwrap_err().error,
            CodecError::UnknownFrameType(4)
        );
        // heartbeat on channel 3: 505
        let mut buf = BytesMut::from(&[8u8, 0, 3, 0, 0, 0, 0, 0xCE][..]);
        let e = dec.decode(&mut buf).unwrap_err();
        assert_eq!(e.error, CodecError::UnexpectedHeartbeat { channel: 3 });
        assert_eq!(e.reply_code(), crate::ReplyCode::UnexpectedFrame);
        // heartbeat with a payload
        let mut buf = BytesMut::from(&[8u8, 0, 0, 0, 0, 0, 1, 0, 0xCE][..]);
        assert_eq!(
            dec.decode(&mut buf).unwrap_err().error,
            CodecError::BadHeartbeat(1)
        );
        // method frame too short for its ids
        let mut buf = BytesMut::from(&[1u8, 0, 0, 0, 0, 0, 2, 0, 10, 0xCE][..]);
        assert_eq!(
            dec.decode(&mut buf).unwrap_err().error,
            CodecError::Truncated
        );
        // header frame too short
        let mut buf = BytesMut::from(&[2u8, 0, 1, 0, 0, 0, 2, 0, 60, 0xCE][..]);
        assert_eq!(
            dec.decode(&mut buf).unwrap_err().error,
            CodecError::Truncated
        );
        // a method error reports the channel and the method, and consumes the frame
        let mut buf = BytesMut::new();
        encode_method(&mut buf, 7, &Method::from(ChannelOpen::default()));
        // corrupt the shortstr length: 1 byte claimed, none present
        let len_at = FRAME_HEADER_LEN + 4;
        buf[len_at] = 1;
        let e = dec.decode(&mut buf).unwrap_err();
        assert_eq!(e.channel, 7);
        assert_eq!(e.class_method(), (20, 10));
        assert!(buf.is_empty());
    }

    #[test]
    fn protocol_header() {
        let mut buf = BytesMut::from(&b"AMQ"[..]);
        assert_eq!(decode_protocol_header(&mut buf), Ok(false));
        buf.put_slice(b"P\x00\x00\x09\x01\x01");
        assert_eq!(decode_protocol_header(&mut buf), Ok(true));
        assert_eq!(&buf[..], &[1]);
        let mut buf = BytesMut::from(&b"AMQP\x01\x01\x00\x09"[..]);
        assert_eq!(decode_protocol_header(&mut buf), Ok(true));
        let mut buf = BytesMut::from(&b"AMQP\x00\x00\x08\x00"[..]);
        assert!(decode_protocol_header(&mut buf).is_err());
        let mut buf = BytesMut::from(&b"GET"[..]);
        assert!(matches!(
            decode_protocol_header(&mut buf),
            Err(CodecError::BadProtocolHeader { received }) if &received[..3] == b"GET"
        ));
    }

    #[test]
    fn frame_encode_round_trip() {
        for f in expected() {
            let mut out = BytesMut::new();
            f.encode(&mut out);
            let back = FrameDecoder::new(4096).decode(&mut out).unwrap().unwrap();
            assert_eq!(back, f);
            assert!(out.is_empty());
        }
    }
}
