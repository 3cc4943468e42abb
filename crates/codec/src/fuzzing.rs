//! The fuzz oracle shared by the cargo-fuzz target (`fuzz/`) and the stable randomized
//! loop (`cargo test -p warren-codec --lib fuzz_loop -- --ignored`). Not part of the
//! codec's API.
//!
//! [`check_frames`] decodes arbitrary bytes with a small frame_max and checks that:
//! decoding the whole input at once and byte by byte gives the same frames and the same
//! error; every decoded frame re-encodes and re-decodes to itself, byte-identically the
//! second time; raw property accessors agree with [`BasicProperties::decode`] and the
//! header validation accepted nothing `decode` rejects; field tables round trip.
//! It returns a description of the first disagreement instead of panicking.

use bytes::{Bytes, BytesMut};

use crate::frame::{Frame, FrameDecoder};
use crate::properties::{self, BasicProperties};
use crate::table::FieldTable;

/// frame_max values picked by the first input byte.
const FRAME_MAXES: [u32; 6] = [0, 16, 64, 300, 4096, 131072];

fn decode_stream(data: &[u8], frame_max: u32, chunk: usize) -> (Vec<Frame>, Option<String>) {
    let mut dec = FrameDecoder::new(frame_max);
    let mut buf = BytesMut::new();
    let mut frames = Vec::new();
    for part in data.chunks(chunk.max(1)) {
        buf.extend_from_slice(part);
        loop {
            match dec.decode(&mut buf) {
                Ok(Some(f)) => frames.push(f),
                Ok(None) => break,
                Err(e) => {
                    // reply text and ids must be computable for any error
                    let _ = (e.reply_code(), e.reply_text(), e.class_method());
                    return (frames, Some(format!("{e:?}")));
                }
            }
        }
    }
    (frames, None)
}

fn check_frame(f: &Frame) -> Result<(), String> {
    let mut first = BytesMut::new();
    f.encode(&mut first);
    let first = first.freeze();
    let mut buf = BytesMut::from(&first[..]);
    let again = FrameDecoder::new(0)
        .decode(&mut buf)
        .map_err(|e| format!("re-decode of {f:?} failed: {e}"))?
        .ok_or_else(|| format!("re-decode of {f:?} incomplete"))?;
    if !buf.is_empty() {
        return Err(format!("re-decode of {f:?} left {} bytes", buf.len()));
    }
    if &again != f {
        return Err(format!("re-decode differs: {f:?} vs {again:?}"));
    }
    let mut second = BytesMut::new();
    again.encode(&mut second);
    if second != first {
        return Err(format!("second encoding differs for {f:?}"));
    }
    if let Frame::Header { header, .. } = f {
        if header.class_id == crate::method::class::BASIC {
            check_properties(&header.properties)?;
        }
    }
    Ok(())
}

fn check_properties(raw: &Bytes) -> Result<(), String> {
    let p = BasicProperties::decode_bytes(raw.clone())
        .map_err(|e| format!("validated properties do not decode: {e} {raw:?}"))?;
    let same = properties::delivery_mode(raw) == p.delivery_mode
        && properties::priority(raw) == p.priority
        && properties::timestamp(raw) == p.timestamp
        && properties::expiration(raw) == p.expiration.as_deref()
        && properties::message_id(raw) == p.message_id.as_deref()
        && properties::user_id(raw) == p.user_id.as_deref()
        && properties::headers(raw).ok().flatten() == p.headers;
    if !same {
        return Err(format!("raw accessors disagree with decode for {raw:?}"));
    }
    // re-encoding normalises flags (no continuation words) and bool octets only
    let re = BasicProperties::decode_bytes(p.encode())
        .map_err(|e| format!("re-encoded properties do not decode: {e}"))?;
    if re != p {
        return Err(format!("properties re-decode differs: {p:?} vs {re:?}"));
    }
    Ok(())
}

fn check_table(data: &[u8]) -> Result<(), String> {
    if let Ok(t) = FieldTable::decode_body(Bytes::copy_from_slice(data)) {
        let mut out = BytesMut::new();
        t.encode_body(&mut out);
        let back = FieldTable::decode_body(out.clone().freeze())
            .map_err(|e| format!("re-encoded table does not decode: {e}"))?;
        if back != t {
            return Err(format!("table re-decode differs: {t:?} vs {back:?}"));
        }
        let mut again = BytesMut::new();
        back.encode_body(&mut again);
        if again != out {
            return Err("table second encoding differs".to_owned());
        }
    }
    Ok(())
}

/// Runs every check on one input; returns how many frames it decoded.
pub fn check_frames(data: &[u8]) -> Result<usize, String> {
    let Some((&selector, rest)) = data.split_first() else {
        return Ok(0);
    };
    let frame_max = FRAME_MAXES
        .get(usize::from(selector) % FRAME_MAXES.len())
        .copied()
        .unwrap_or(0);
    let (whole, whole_err) = decode_stream(rest, frame_max, rest.len());
    let (bytewise, bytewise_err) = decode_stream(rest, frame_max, 1);
    if whole != bytewise || whole_err != bytewise_err {
        return Err(format!(
            "incremental decoding differs: {whole:?} {whole_err:?} vs {bytewise:?} {bytewise_err:?}"
        ));
    }
    for f in &whole {
        check_frame(f)?;
    }
    check_table(rest)?;
    Ok(whole.len())
}
