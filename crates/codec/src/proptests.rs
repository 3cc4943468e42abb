//! Property tests: round trips of every method, field tables, properties, frames, body
//! splitting, and robustness of the decoder on arbitrary bytes.

use bytes::{BufMut, Bytes, BytesMut};
use proptest::collection::vec;
use proptest::prelude::*;

use crate::frame::{ContentHeader, Frame, FrameDecoder};
use crate::method::Method;
use crate::properties::{self, BasicProperties};
use crate::strings::ShortStr;
use crate::table::FieldTable;
use crate::testing::{arb_shortstr, arb_table};
use crate::{encode_content, encode_deliver, FRAME_OVERHEAD};

pub(crate) fn arb_opt_shortstr() -> impl Strategy<Value = Option<ShortStr>> {
    proptest::option::of(arb_shortstr())
}

pub(crate) fn arb_properties() -> impl Strategy<Value = BasicProperties> {
    (
        (
            arb_opt_shortstr(),
            arb_opt_shortstr(),
            proptest::option::of(arb_table()),
            proptest::option::of(any::<u8>()),
            proptest::option::of(any::<u8>()),
            arb_opt_shortstr(),
            arb_opt_shortstr(),
        ),
        (
            arb_opt_shortstr(),
            arb_opt_shortstr(),
            proptest::option::of(any::<u64>()),
            arb_opt_shortstr(),
            arb_opt_shortstr(),
            arb_opt_shortstr(),
            arb_opt_shortstr(),
        ),
    )
        .prop_map(
            |(
                (
                    content_type,
                    content_encoding,
                    headers,
                    delivery_mode,
                    priority,
                    correlation_id,
                    reply_to,
                ),
                (expiration, message_id, timestamp, kind, user_id, app_id, cluster_id),
            )| BasicProperties {
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
            },
        )
}

pub(crate) fn arb_frame() -> impl Strategy<Value = Frame> {
    let channel = any::<u16>();
    prop_oneof![
        4 => (channel, Method::arbitrary()).prop_map(|(channel, method)| Frame::Method { channel, method }),
        2 => (channel, any::<u16>(), any::<u64>(), arb_properties()).prop_map(
            |(channel, weight, body_size, p)| Frame::Header {
                channel,
                header: ContentHeader { class_id: 60, weight, body_size, properties: p.encode() },
            }
        ),
        2 => (channel, vec(any::<u8>(), 0..300))
            .prop_map(|(channel, b)| Frame::Body { channel, payload: Bytes::from(b) }),
        1 => Just(Frame::Heartbeat { channel: 0 }),
    ]
}

/// Decodes everything in `bytes`, fed in pieces of the given sizes.
fn decode_chunked(bytes: &[u8], cuts: &[usize], frame_max: u32) -> Vec<Frame> {
    let mut dec = FrameDecoder::new(frame_max);
    let mut buf = BytesMut::new();
    let mut out = Vec::new();
    let mut rest = bytes;
    let mut cuts = cuts.iter().cycle();
    while !rest.is_empty() {
        let n = (*cuts.next().unwrap_or(&1)).clamp(1, rest.len());
        let (head, tail) = rest.split_at(n);
        buf.put_slice(head);
        rest = tail;
        while let Some(f) = dec.decode(&mut buf).unwrap() {
            out.push(f);
        }
    }
    assert!(buf.is_empty());
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn method_round_trip(m in Method::arbitrary()) {
        let mut out = BytesMut::new();
        m.encode(&mut out);
        let bytes = out.freeze();
        let back = Method::decode(bytes.clone()).unwrap();
        prop_assert_eq!(&back, &m);
        let mut again = BytesMut::new();
        back.encode(&mut again);
        prop_assert_eq!(&again[..], &bytes[..]);
        // every strict prefix fails cleanly
        for cut in 0..bytes.len() {
            prop_assert!(Method::decode(bytes.slice(..cut)).is_err());
        }
    }

    #[test]
    fn field_table_round_trip(t in arb_table()) {
        let bytes = t.to_bytes();
        let mut b = bytes.clone();
        let back = FieldTable::decode(&mut b).unwrap();
        prop_assert!(b.is_empty());
        prop_assert_eq!(&back, &t);
        prop_assert_eq!(back.to_bytes(), bytes.clone());
        crate::table::validate_table_body(bytes.slice(4..), 0).unwrap();
        for cut in 4..bytes.len() {
            // a shorter length prefix makes a truncated table
            let mut short = BytesMut::new();
            short.put_u32((cut - 4) as u32);
            short.put_slice(&bytes[4..cut]);
            let _ = FieldTable::decode(&mut short.freeze());
        }
    }

    #[test]
    fn properties_round_trip(p in arb_properties()) {
        let raw = p.encode();
        prop_assert_eq!(&BasicProperties::decode(&raw).unwrap(), &p);
        properties::validate(&raw).unwrap();
        prop_assert_eq!(properties::delivery_mode(&raw), p.delivery_mode);
        prop_assert_eq!(properties::priority(&raw), p.priority);
        prop_assert_eq!(properties::timestamp(&raw), p.timestamp);
        prop_assert_eq!(properties::expiration(&raw), p.expiration.as_deref());
        prop_assert_eq!(properties::content_type(&raw), p.content_type.as_deref());
        prop_assert_eq!(properties::message_id(&raw), p.message_id.as_deref());
        prop_assert_eq!(properties::user_id(&raw), p.user_id.as_deref());
        prop_assert_eq!(properties::app_id(&raw), p.app_id.as_deref());
        prop_assert_eq!(properties::kind(&raw), p.kind.as_deref());
        prop_assert_eq!(properties::reply_to(&raw), p.reply_to.as_deref());
        prop_assert_eq!(properties::correlation_id(&raw), p.correlation_id.as_deref());
        prop_assert_eq!(properties::headers(&raw).unwrap(), p.headers.clone());
    }

    #[test]
    fn frames_round_trip_in_any_chunking(
        frames in vec(arb_frame(), 1..12),
        cuts in vec(1usize..64, 1..16),
    ) {
        let mut out = BytesMut::new();
        for f in &frames {
            f.encode(&mut out);
        }
        let back = decode_chunked(&out, &cuts, 0);
        prop_assert_eq!(back, frames);
    }

    #[test]
    fn body_split_respects_frame_max(
        len in 0usize..20_000,
        frame_max in prop_oneof![Just(0u32), 9u32..64, 4096u32..9000],
        props in arb_properties(),
    ) {
        let body: Vec<u8> = (0..len).map(|i| (i * 31) as u8).collect();
        let raw = props.encode();
        let mut out = BytesMut::new();
        encode_deliver(&mut out, 5, "ctag", 1, false, "ex", "rk", &raw, &body, frame_max);
        encode_content(&mut out, 5, 60, &raw, &body, frame_max);
        // the header frame may exceed a tiny frame_max, so check body frames by hand
        let frames = decode_chunked(&out, &[4096], 0);
        let mut seen = BytesMut::new();
        for f in &frames {
            if let Frame::Body { payload, .. } = f {
                if frame_max != 0 {
                    prop_assert!(payload.len() + FRAME_OVERHEAD <= frame_max as usize);
                    prop_assert!(!payload.is_empty());
                }
                seen.put_slice(payload);
            }
        }
        prop_assert_eq!(seen.len(), 2 * len);
        prop_assert_eq!(&seen[..len], &body[..]);
        prop_assert_eq!(&seen[len..], &body[..]);
    }

    #[test]
    fn decoder_never_panics_and_reencodes(data in vec(any::<u8>(), 0..600), fm in prop_oneof![Just(0u32), 8u32..300, Just(4096u32)]) {
        let mut dec = FrameDecoder::new(fm);
        let mut buf = BytesMut::from(&data[..]);
        while let Ok(Some(f)) = dec.decode(&mut buf) {
            let mut out = BytesMut::new();
            f.encode(&mut out);
            let again = FrameDecoder::new(0).decode(&mut out).unwrap().unwrap();
            prop_assert_eq!(again, f);
            prop_assert!(out.is_empty());
        }
    }

    #[test]
    fn corrupted_valid_frames_never_panic(
        frames in vec(arb_frame(), 1..4),
        flips in vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
    ) {
        let mut out = BytesMut::new();
        for f in &frames {
            f.encode(&mut out);
        }
        for (at, v) in flips {
            let i = at.index(out.len());
            out[i] = v;
        }
        let mut dec = FrameDecoder::new(0);
        while let Ok(Some(f)) = dec.decode(&mut out) {
            let mut re = BytesMut::new();
            f.encode(&mut re);
            prop_assert_eq!(FrameDecoder::new(0).decode(&mut re).unwrap().unwrap(), f);
        }
    }
}
