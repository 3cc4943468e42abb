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

/// One fuzz input: a frame_max selector byte, then valid frames with a few mutations
/// (byte overwrites, insertions, deletions, truncation), or plain random bytes.
pub(crate) fn arb_fuzz_input() -> impl Strategy<Value = Vec<u8>> {
    // mostly frame_max 0, 4096 or 131072 so that valid frames get through
    let selector = prop_oneof![1 => any::<u8>(), 3 => prop::sample::select(vec![0u8, 4, 5])];
    let structured = (
        selector,
        vec(arb_frame(), 0..6),
        vec((any::<prop::sample::Index>(), any::<u8>(), 0u8..4), 0..4),
    )
        .prop_map(|(selector, frames, edits)| {
            let mut out = BytesMut::new();
            for f in &frames {
                f.encode(&mut out);
            }
            let mut data = out.to_vec();
            for (at, byte, op) in edits {
                if data.is_empty() {
                    break;
                }
                let i = at.index(data.len());
                match op {
                    0 => data[i] = byte,
                    1 => data.insert(i, byte),
                    2 => {
                        data.remove(i);
                    }
                    _ => data.truncate(i),
                }
            }
            data.insert(0, selector);
            data
        });
    prop_oneof![
        4 => structured,
        1 => vec(any::<u8>(), 0..512),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    #[test]
    fn fuzz_oracle_holds(data in arb_fuzz_input()) {
        crate::fuzzing::check_frames(&data).map_err(TestCaseError::fail)?;
    }
}

/// The long randomized run standing in for cargo-fuzz on stable:
/// `WARREN_FUZZ_SECS=600 cargo test -p warren-codec --lib fuzz_loop -- --ignored --nocapture`
/// (default 10 seconds). Prints how many inputs ran.
#[test]
#[ignore]
fn fuzz_loop() {
    use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
    use std::time::{Duration, Instant};

    let secs: u64 = std::env::var("WARREN_FUZZ_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10);
    let seed: u64 = std::env::var("WARREN_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
        });
    let mut seed_bytes = [0u8; 32];
    seed_bytes[..8].copy_from_slice(&seed.to_le_bytes());
    let mut runner = TestRunner::new_with_rng(
        Config::default(),
        TestRng::from_seed(RngAlgorithm::ChaCha, &seed_bytes),
    );
    let strategy = arb_fuzz_input();
    let deadline = Instant::now() + Duration::from_secs(secs);
    let (mut inputs, mut frames, mut bytes) = (0u64, 0u64, 0u64);
    while Instant::now() < deadline {
        let tree = strategy.new_tree(&mut runner).expect("strategy");
        let data = proptest::strategy::ValueTree::current(&tree);
        match crate::fuzzing::check_frames(&data) {
            Ok(n) => frames += n as u64,
            Err(e) => panic!("seed {seed}, input {inputs}: {e}\ninput: {data:?}"),
        }
        inputs += 1;
        bytes += data.len() as u64;
    }
    println!(
        "fuzz_loop: seed {seed}, {inputs} inputs, {bytes} bytes, {frames} frames decoded in {secs}s, no failure"
    );
}
