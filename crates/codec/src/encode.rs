//! Hot-path encoders writing whole frames straight into an output buffer. They allocate
//! nothing besides the growth of `out` (reserved once per call).
//!
//! Shortstr arguments given as `&str` are cut to 255 bytes (on a char boundary) if
//! longer; callers pass names that were validated when they came in.

use bytes::{BufMut, BytesMut};

use crate::frame::{
    CONTENT_HEADER_FIXED_LEN, FRAME_BODY, FRAME_END, FRAME_HEADER, FRAME_HEADER_LEN,
    FRAME_HEARTBEAT, FRAME_METHOD, FRAME_OVERHEAD,
};
use crate::method::{class, Method};
use crate::wire::{patch_u32, put_shortstr};

/// Writes a frame header with a known payload size.
#[inline]
pub(crate) fn write_frame_header(out: &mut BytesMut, frame_type: u8, channel: u16, size: usize) {
    out.put_u8(frame_type);
    out.put_u16(channel);
    out.put_u32(u32::try_from(size).unwrap_or(u32::MAX));
}

/// Starts a frame whose size is patched by [`end_frame`]; returns its start.
#[inline]
fn begin_frame(out: &mut BytesMut, frame_type: u8, channel: u16) -> usize {
    let start = out.len();
    write_frame_header(out, frame_type, channel, 0);
    start
}

#[inline]
fn end_frame(out: &mut BytesMut, start: usize) {
    let size = out.len() - start - FRAME_HEADER_LEN;
    patch_u32(out, start + 3, u32::try_from(size).unwrap_or(u32::MAX));
    out.put_u8(FRAME_END);
}

/// A method frame.
pub fn encode_method(out: &mut BytesMut, channel: u16, method: &Method) {
    let start = begin_frame(out, FRAME_METHOD, channel);
    method.encode(out);
    end_frame(out, start);
}

/// A heartbeat frame (channel 0).
pub fn encode_heartbeat(out: &mut BytesMut) {
    encode_heartbeat_on(out, 0);
}

pub(crate) fn encode_heartbeat_on(out: &mut BytesMut, channel: u16) {
    write_frame_header(out, FRAME_HEARTBEAT, channel, 0);
    out.put_u8(FRAME_END);
}

/// The largest body payload per frame for a frame_max (0 = unlimited).
#[inline]
fn body_chunk(frame_max: u32, body_len: usize) -> usize {
    let max = if frame_max == 0 {
        u32::MAX as usize
    } else {
        (frame_max as usize).saturating_sub(FRAME_OVERHEAD).max(1)
    };
    max.min(body_len.max(1))
}

/// The size of the content header frame that carries `properties_len` bytes of properties,
/// overhead included. A header is never split: unlike a body, it must fit one frame.
pub fn content_header_frame_len(properties_len: usize) -> usize {
    FRAME_OVERHEAD + CONTENT_HEADER_FIXED_LEN + properties_len
}

/// Whether a frame of `frame_len` bytes, overhead included, may be sent to a peer that
/// negotiated `frame_max` (0 = no limit). The encoders here do not check content headers:
/// callers do, since a client that gets a larger frame closes its connection.
pub fn frame_fits(frame_len: usize, frame_max: u32) -> bool {
    frame_max == 0 || frame_len <= frame_max as usize
}

/// Bytes that [`encode_content`] writes.
fn content_len(properties: &[u8], body: &[u8], frame_max: u32) -> usize {
    let chunk = body_chunk(frame_max, body.len());
    let frames = body.len().div_ceil(chunk);
    FRAME_OVERHEAD
        + CONTENT_HEADER_FIXED_LEN
        + properties.len()
        + frames * FRAME_OVERHEAD
        + body.len()
}

fn write_content(
    out: &mut BytesMut,
    channel: u16,
    class_id: u16,
    properties: &[u8],
    body: &[u8],
    frame_max: u32,
) {
    write_frame_header(
        out,
        FRAME_HEADER,
        channel,
        CONTENT_HEADER_FIXED_LEN + properties.len(),
    );
    out.put_u16(class_id);
    out.put_u16(0);
    out.put_u64(body.len() as u64);
    out.put_slice(properties);
    out.put_u8(FRAME_END);
    let chunk = body_chunk(frame_max, body.len());
    for part in body.chunks(chunk) {
        write_frame_header(out, FRAME_BODY, channel, part.len());
        out.put_slice(part);
        out.put_u8(FRAME_END);
    }
}

/// Writes a content header frame and the body split into frames of at most frame_max
/// bytes, overhead included (frame_max 0 = unlimited). An empty body gets no body frame.
pub fn encode_content(
    out: &mut BytesMut,
    channel: u16,
    class_id: u16,
    properties: &[u8],
    body: &[u8],
    frame_max: u32,
) {
    out.reserve(content_len(properties, body, frame_max));
    write_content(out, channel, class_id, properties, body, frame_max);
}

/// basic.deliver method frame + header + body frames, without building a Method value. The
/// content header is one frame whatever its size: the caller checks it with [`frame_fits`].
#[allow(clippy::too_many_arguments)]
pub fn encode_deliver(
    out: &mut BytesMut,
    channel: u16,
    consumer_tag: &str,
    delivery_tag: u64,
    redelivered: bool,
    exchange: &str,
    routing_key: &str,
    properties: &[u8],
    body: &[u8],
    frame_max: u32,
) {
    let method_len = FRAME_OVERHEAD
        + 4
        + 1
        + consumer_tag.len().min(255)
        + 8
        + 1
        + 1
        + exchange.len().min(255)
        + 1
        + routing_key.len().min(255);
    out.reserve(method_len + content_len(properties, body, frame_max));
    let start = begin_frame(out, FRAME_METHOD, channel);
    out.put_u16(class::BASIC);
    out.put_u16(60);
    put_shortstr(out, consumer_tag);
    out.put_u64(delivery_tag);
    out.put_u8(u8::from(redelivered));
    put_shortstr(out, exchange);
    put_shortstr(out, routing_key);
    end_frame(out, start);
    write_content(out, channel, class::BASIC, properties, body, frame_max);
}

/// basic.get-ok method frame + header + body frames.
#[allow(clippy::too_many_arguments)]
pub fn encode_get_ok(
    out: &mut BytesMut,
    channel: u16,
    delivery_tag: u64,
    redelivered: bool,
    exchange: &str,
    routing_key: &str,
    message_count: u32,
    properties: &[u8],
    body: &[u8],
    frame_max: u32,
) {
    let method_len = FRAME_OVERHEAD
        + 4
        + 8
        + 1
        + 1
        + exchange.len().min(255)
        + 1
        + routing_key.len().min(255)
        + 4;
    out.reserve(method_len + content_len(properties, body, frame_max));
    let start = begin_frame(out, FRAME_METHOD, channel);
    out.put_u16(class::BASIC);
    out.put_u16(71);
    out.put_u64(delivery_tag);
    out.put_u8(u8::from(redelivered));
    put_shortstr(out, exchange);
    put_shortstr(out, routing_key);
    out.put_u32(message_count);
    end_frame(out, start);
    write_content(out, channel, class::BASIC, properties, body, frame_max);
}

/// basic.return method frame + header + body frames.
#[allow(clippy::too_many_arguments)]
pub fn encode_return(
    out: &mut BytesMut,
    channel: u16,
    reply_code: u16,
    reply_text: &str,
    exchange: &str,
    routing_key: &str,
    properties: &[u8],
    body: &[u8],
    frame_max: u32,
) {
    let method_len = FRAME_OVERHEAD
        + 4
        + 2
        + 1
        + reply_text.len().min(255)
        + 1
        + exchange.len().min(255)
        + 1
        + routing_key.len().min(255);
    out.reserve(method_len + content_len(properties, body, frame_max));
    let start = begin_frame(out, FRAME_METHOD, channel);
    out.put_u16(class::BASIC);
    out.put_u16(50);
    out.put_u16(reply_code);
    put_shortstr(out, reply_text);
    put_shortstr(out, exchange);
    put_shortstr(out, routing_key);
    end_frame(out, start);
    write_content(out, channel, class::BASIC, properties, body, frame_max);
}

/// basic.ack (publisher confirms).
pub fn encode_ack(out: &mut BytesMut, channel: u16, delivery_tag: u64, multiple: bool) {
    write_frame_header(out, FRAME_METHOD, channel, 13);
    out.put_u16(class::BASIC);
    out.put_u16(80);
    out.put_u64(delivery_tag);
    out.put_u8(u8::from(multiple));
    out.put_u8(FRAME_END);
}

/// basic.nack (publisher confirms).
pub fn encode_nack(
    out: &mut BytesMut,
    channel: u16,
    delivery_tag: u64,
    multiple: bool,
    requeue: bool,
) {
    write_frame_header(out, FRAME_METHOD, channel, 13);
    out.put_u16(class::BASIC);
    out.put_u16(120);
    out.put_u64(delivery_tag);
    out.put_u8(u8::from(multiple) | (u8::from(requeue) << 1));
    out.put_u8(FRAME_END);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::{ContentHeader, Frame, FrameDecoder};
    use crate::method::{BasicAck, BasicDeliver, BasicGetOk, BasicNack, BasicReturn};
    use bytes::Bytes;

    fn decode_all(mut buf: BytesMut, frame_max: u32) -> Vec<Frame> {
        let mut dec = FrameDecoder::new(frame_max);
        let mut v = Vec::new();
        while let Some(f) = dec.decode(&mut buf).unwrap() {
            v.push(f);
        }
        assert!(buf.is_empty());
        v
    }

    fn body_sizes(frames: &[Frame]) -> Vec<usize> {
        frames
            .iter()
            .filter_map(|f| match f {
                Frame::Body { payload, .. } => Some(payload.len()),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn body_splitting_at_frame_max() {
        let fm = 4096u32;
        let max = fm as usize - 8;
        for (len, expect) in [
            (0usize, vec![]),
            (1, vec![1]),
            (max - 1, vec![max - 1]),
            (max, vec![max]),
            (max + 1, vec![max, 1]),
            (3 * max, vec![max, max, max]),
        ] {
            let body: Vec<u8> = (0..len).map(|i| i as u8).collect();
            let mut out = BytesMut::new();
            encode_content(&mut out, 3, 60, &[0, 0], &body, fm);
            assert_eq!(out.len(), content_len(&[0, 0], &body, fm));
            // every frame fits in frame_max exactly
            let frames = decode_all(out, fm - crate::frame::FRAME_SIZE_FUDGE);
            assert_eq!(body_sizes(&frames), expect, "len {len}");
            let joined: Vec<u8> = frames
                .iter()
                .filter_map(|f| match f {
                    Frame::Body { payload, .. } => Some(payload.to_vec()),
                    _ => None,
                })
                .flatten()
                .collect();
            assert_eq!(joined, body);
            match frames.first() {
                Some(Frame::Header { channel: 3, header }) => {
                    assert_eq!(header.body_size, len as u64)
                }
                other => panic!("{other:?}"),
            }
        }
        // frame_max 0: one body frame
        let body = vec![7u8; 100_000];
        let mut out = BytesMut::new();
        encode_content(&mut out, 1, 60, &[0, 0], &body, 0);
        assert_eq!(body_sizes(&decode_all(out, 0)), vec![100_000]);
    }

    #[test]
    fn deliver_get_ok_return_match_method_encoding() {
        let props = crate::properties::BasicProperties {
            delivery_mode: Some(2),
            ..Default::default()
        }
        .encode();
        let body = b"payload";
        let header = Frame::Header {
            channel: 2,
            header: ContentHeader {
                class_id: 60,
                weight: 0,
                body_size: body.len() as u64,
                properties: props.clone(),
            },
        };
        let body_frame = Frame::Body {
            channel: 2,
            payload: Bytes::from_static(body),
        };

        let mut out = BytesMut::new();
        encode_deliver(
            &mut out, 2, "ctag", 42, true, "ex", "rk", &props, body, 4096,
        );
        let expected = vec![
            Frame::Method {
                channel: 2,
                method: Method::from(BasicDeliver {
                    consumer_tag: "ctag".into(),
                    delivery_tag: 42,
                    redelivered: true,
                    exchange: "ex".into(),
                    routing_key: "rk".into(),
                }),
            },
            header.clone(),
            body_frame.clone(),
        ];
        let mut via_method = BytesMut::new();
        for f in &expected {
            f.encode(&mut via_method);
        }
        assert_eq!(out, via_method);
        assert_eq!(decode_all(out, 4096), expected);

        let mut out = BytesMut::new();
        encode_get_ok(&mut out, 2, 5, false, "ex", "rk", 17, &props, body, 4096);
        let expected = vec![
            Frame::Method {
                channel: 2,
                method: Method::from(BasicGetOk {
                    delivery_tag: 5,
                    redelivered: false,
                    exchange: "ex".into(),
                    routing_key: "rk".into(),
                    message_count: 17,
                }),
            },
            header.clone(),
            body_frame.clone(),
        ];
        assert_eq!(decode_all(out, 4096), expected);

        let mut out = BytesMut::new();
        encode_return(&mut out, 2, 312, "NO_ROUTE", "ex", "rk", &props, body, 4096);
        let expected = vec![
            Frame::Method {
                channel: 2,
                method: Method::from(BasicReturn {
                    reply_code: 312,
                    reply_text: "NO_ROUTE".into(),
                    exchange: "ex".into(),
                    routing_key: "rk".into(),
                }),
            },
            header,
            body_frame,
        ];
        assert_eq!(decode_all(out, 4096), expected);
    }

    #[test]
    fn ack_nack() {
        for multiple in [false, true] {
            let mut a = BytesMut::new();
            encode_ack(&mut a, 9, u64::MAX, multiple);
            let mut b = BytesMut::new();
            encode_method(
                &mut b,
                9,
                &Method::from(BasicAck {
                    delivery_tag: u64::MAX,
                    multiple,
                }),
            );
            assert_eq!(a, b);
            for requeue in [false, true] {
                let mut a = BytesMut::new();
                encode_nack(&mut a, 9, 3, multiple, requeue);
                let mut b = BytesMut::new();
                encode_method(
                    &mut b,
                    9,
                    &Method::from(BasicNack {
                        delivery_tag: 3,
                        multiple,
                        requeue,
                    }),
                );
                assert_eq!(a, b);
            }
        }
        let mut h = BytesMut::new();
        encode_heartbeat(&mut h);
        assert_eq!(&h[..], &[8, 0, 0, 0, 0, 0, 0, 0xCE]);
    }

    #[test]
    fn long_names_are_cut_not_panicking() {
        let long = "x".repeat(300);
        let mut out = BytesMut::new();
        encode_deliver(
            &mut out,
            1,
            &long,
            1,
            false,
            &long,
            &long,
            &[0, 0],
            b"",
            4096,
        );
        let frames = decode_all(out, 4096);
        match frames.first() {
            Some(Frame::Method {
                method: Method::BasicDeliver(d),
                ..
            }) => assert_eq!(d.consumer_tag.len(), 255),
            other => panic!("{other:?}"),
        }
    }
}
