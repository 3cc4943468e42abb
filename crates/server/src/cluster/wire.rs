//! The cluster's wire format. A frame is a `u32` big-endian payload length and the payload; a
//! payload is one [`NodeBatch`]: `from`, `boot`, `to` (`u64` each), then per envelope its group
//! (`u64`), the message's length (`u32`) and the raft-rs message (protobuf 2), all big-endian.
//! A forwarded proposal is an envelope whose group has its top bit set ([`FORWARD_BIT`]; group
//! numbers stay below it), carrying the proposal's bytes instead of a message. A sender in
//! maintenance mode starts each frame with an empty envelope of group [`DRAINING`] (a node
//! that does not know it takes it for a forward to a group that does not exist, and drops it).
//!
//! Decoding trusts nothing: lengths are checked against what is there, and a frame's declared
//! length never sizes an allocation (its bytes are read as they come).

use bytes::{Buf, BufMut, Bytes};
use protobuf::Message as _;
use tokio::io::{AsyncRead, AsyncReadExt};
use warren_replication::raft::eraftpb::Message;
use warren_replication::{Envelope, Forward, GroupId, NodeBatch};

/// The largest payload a frame may declare; a larger one ends the connection.
pub const MAX_FRAME: usize = 64 << 20;
pub(super) const BATCH_HEADER: usize = 24;
pub(super) const ENVELOPE_HEADER: usize = 12;
/// Marks an envelope as a forwarded proposal.
pub const FORWARD_BIT: u64 = 1 << 63;
/// The envelope that says the sender is draining ([`NodeBatch::draining`]).
pub const DRAINING: u64 = u64::MAX;

#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("frame of {0} bytes is above the {MAX_FRAME}-byte maximum")]
    TooLarge(u64),
    #[error("frame cut short: {0} bytes missing")]
    Truncated(usize),
    #[error("message in pieces: {0}")]
    Piece(&'static str),
    #[error("raft message: {0}")]
    Protobuf(#[from] protobuf::ProtobufError),
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
}

/// What [`encode_batch`] could not put on the wire.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Encoded {
    pub frames: usize,
    /// Messages left out: too large for a frame, or protobuf refused them.
    pub skipped: usize,
}

/// Appends `batch` to `out` as frames of at most `max_payload` payload bytes each (a batch that
/// does not fit is split; every frame carries the header, so an empty batch is one small frame).
pub fn encode_batch(batch: &NodeBatch, max_payload: usize, out: &mut Vec<u8>) -> Encoded {
    let mut done = Encoded::default();
    let header = BATCH_HEADER + if batch.draining { ENVELOPE_HEADER } else { 0 };
    let mut frame = start_frame(&Header::of(batch), out);
    for env in &batch.msgs {
        let size = env.msg.compute_size() as usize;
        if header + ENVELOPE_HEADER + size > max_payload {
            done.skipped += 1;
            continue;
        }
        if out.len() - frame - 4 + ENVELOPE_HEADER + size > max_payload {
            finish_frame(frame, out);
            done.frames += 1;
            frame = start_frame(&Header::of(batch), out);
        }
        let at = out.len();
        out.put_u64(env.group.0);
        out.put_u32(size as u32);
        let mut os = protobuf::CodedOutputStream::vec(out);
        let written = env
            .msg
            .write_to_with_cached_sizes(&mut os)
            .and_then(|()| os.flush());
        drop(os);
        if written.is_err() || out.len() != at + ENVELOPE_HEADER + size {
            out.truncate(at);
            done.skipped += 1;
        }
    }
    for f in &batch.forwards {
        let size = f.data.len();
        // The one group number whose marked form is the DRAINING marker cannot travel either.
        if header + ENVELOPE_HEADER + size > max_payload
            || f.group.0 & FORWARD_BIT != 0
            || f.group.0 | FORWARD_BIT == DRAINING
        {
            done.skipped += 1;
            continue;
        }
        if out.len() - frame - 4 + ENVELOPE_HEADER + size > max_payload {
            finish_frame(frame, out);
            done.frames += 1;
            frame = start_frame(&Header::of(batch), out);
        }
        out.put_u64(f.group.0 | FORWARD_BIT);
        out.put_u32(size as u32);
        out.extend_from_slice(&f.data);
    }
    finish_frame(frame, out);
    done.frames += 1;
    done
}

/// What every frame of a batch starts with.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Header {
    pub from: u64,
    pub boot: u64,
    pub to: u64,
    pub draining: bool,
}

impl Header {
    pub fn of(b: &NodeBatch) -> Header {
        Header {
            from: b.from,
            boot: b.boot,
            to: b.to,
            draining: b.draining,
        }
    }
}

/// Writes a frame's length placeholder and the batch header; returns where the frame starts.
fn start_frame(h: &Header, out: &mut Vec<u8>) -> usize {
    let at = out.len();
    out.put_u32(0);
    out.put_u64(h.from);
    out.put_u64(h.boot);
    out.put_u64(h.to);
    if h.draining {
        out.put_u64(DRAINING);
        out.put_u32(0);
    }
    at
}

/// Appends a frame holding one forward to `group` whose bytes are `parts` one after the other
/// (their total is at most [`MAX_FRAME`] less the headers: the caller sizes them).
pub fn encode_forward_frame(h: &Header, group: u64, parts: &[&[u8]], out: &mut Vec<u8>) {
    let frame = start_frame(h, out);
    let len: usize = parts.iter().map(|p| p.len()).sum();
    out.put_u64(group | FORWARD_BIT);
    // Bounded by the caller far below u32::MAX.
    out.put_u32(len as u32);
    for p in parts {
        out.extend_from_slice(p);
    }
    finish_frame(frame, out);
}

fn finish_frame(at: usize, out: &mut [u8]) {
    // Payloads are bounded by MAX_FRAME, far below u32::MAX.
    let len = (out.len() - at - 4) as u32;
    if let Some(head) = out.get_mut(at..at + 4) {
        head.copy_from_slice(&len.to_be_bytes());
    }
}

/// Decodes one frame's payload. Message bytes are shared with `payload`, not copied.
pub fn decode_batch(mut payload: Bytes) -> Result<NodeBatch, WireError> {
    need(&payload, BATCH_HEADER)?;
    let from = payload.get_u64();
    let boot = payload.get_u64();
    let to = payload.get_u64();
    let mut msgs = Vec::new();
    let mut forwards = Vec::new();
    let mut draining = false;
    while payload.has_remaining() {
        need(&payload, ENVELOPE_HEADER)?;
        let group = payload.get_u64();
        let len = payload.get_u32() as usize;
        need(&payload, len)?;
        let bytes = payload.split_to(len);
        if group == DRAINING {
            draining = true;
            continue;
        }
        if group & FORWARD_BIT != 0 {
            forwards.push(Forward {
                group: GroupId(group & !FORWARD_BIT),
                data: bytes,
            });
            continue;
        }
        let msg = Message::parse_from_carllerche_bytes(&bytes)?;
        msgs.push(Envelope {
            group: GroupId(group),
            msg,
        });
    }
    Ok(NodeBatch {
        from,
        boot,
        to,
        draining,
        msgs,
        forwards,
    })
}

fn need(b: &Bytes, n: usize) -> Result<(), WireError> {
    match n.checked_sub(b.remaining()) {
        Some(missing) if missing > 0 => Err(WireError::Truncated(missing)),
        _ => Ok(()),
    }
}

/// Reads one frame's payload; `None` at a clean end of stream before a frame starts.
pub async fn read_frame<R: AsyncRead + Unpin>(r: &mut R) -> Result<Option<Bytes>, WireError> {
    let mut head = [0u8; 4];
    match r.read_exact(&mut head).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let len = u32::from_be_bytes(head) as usize;
    if len > MAX_FRAME {
        return Err(WireError::TooLarge(len as u64));
    }
    let mut payload = Vec::new();
    // `read_to_end` grows the buffer as bytes arrive: a peer that declares 64 MiB and sends
    // nothing costs nothing.
    (&mut *r).take(len as u64).read_to_end(&mut payload).await?;
    if payload.len() < len {
        return Err(WireError::Truncated(len - payload.len()));
    }
    Ok(Some(payload.into()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use warren_replication::raft::eraftpb::{Entry, MessageType};

    fn batch(entries: usize, size: usize) -> NodeBatch {
        let mut msg = Message::default();
        msg.set_msg_type(MessageType::MsgAppend);
        msg.from = 1;
        msg.to = 2;
        msg.term = 3;
        msg.entries = (1..=entries as u64)
            .map(|i| Entry {
                index: i,
                term: 3,
                data: vec![i as u8; size].into(),
                ..Default::default()
            })
            .collect::<Vec<_>>()
            .into();
        NodeBatch {
            forwards: vec![],
            from: 1,
            boot: 7,
            to: 2,
            draining: false,
            msgs: vec![
                Envelope {
                    group: GroupId(9),
                    msg: msg.clone(),
                },
                Envelope {
                    group: GroupId(10),
                    msg,
                },
            ],
        }
    }

    /// Splits `out` into frame payloads, checking every length prefix.
    fn frames(mut out: &[u8]) -> Vec<Bytes> {
        let mut v = Vec::new();
        while !out.is_empty() {
            let len = u32::from_be_bytes(out[..4].try_into().unwrap()) as usize;
            v.push(Bytes::copy_from_slice(&out[4..4 + len]));
            out = &out[4 + len..];
        }
        v
    }

    #[test]
    fn a_batch_comes_back_as_it_went() {
        let b = batch(3, 100);
        let mut out = Vec::new();
        assert_eq!(
            encode_batch(&b, MAX_FRAME, &mut out),
            Encoded {
                frames: 1,
                skipped: 0
            }
        );
        let f = frames(&out);
        let got = decode_batch(f[0].clone()).unwrap();
        assert_eq!((got.from, got.boot, got.to), (1, 7, 2));
        assert_eq!(got.msgs.len(), 2);
        assert_eq!(got.msgs[1].group, GroupId(10));
        assert_eq!(got.msgs[0].msg, b.msgs[0].msg);
    }

    #[test]
    fn forwarded_proposals_travel_beside_the_messages() {
        let mut b = batch(1, 10);
        let data = Bytes::from_static(b"a forwarded publish");
        b.forwards = vec![
            Forward {
                group: GroupId(9),
                data: data.clone(),
            },
            Forward {
                // A group number with the marker bit cannot be told apart: never sent.
                group: GroupId(FORWARD_BIT | 4),
                data: data.clone(),
            },
        ];
        let mut out = Vec::new();
        assert_eq!(encode_batch(&b, MAX_FRAME, &mut out).skipped, 1);
        let got = decode_batch(frames(&out)[0].clone()).unwrap();
        assert_eq!(got.msgs.len(), 2);
        assert_eq!(
            got.forwards,
            vec![Forward {
                group: GroupId(9),
                data
            }]
        );
    }

    #[test]
    fn every_frame_of_a_draining_node_says_so() {
        let mut b = batch(4, 1000);
        b.draining = true;
        let mut out = Vec::new();
        // Small frames: each message in a frame of its own.
        let done = encode_batch(&b, 6000, &mut out);
        assert_eq!(done.skipped, 0);
        let f = frames(&out);
        assert_eq!(f.len(), done.frames);
        assert!(f.len() >= 2);
        let mut msgs = 0;
        for frame in f {
            assert!(frame.len() <= 6000);
            let got = decode_batch(frame).unwrap();
            assert!(got.draining);
            msgs += got.msgs.len();
        }
        assert_eq!(msgs, 2);
        b.draining = false;
        let mut out = Vec::new();
        encode_batch(&b, MAX_FRAME, &mut out);
        assert!(!decode_batch(frames(&out)[0].clone()).unwrap().draining);
    }

    #[test]
    fn an_empty_batch_is_a_header_only_frame() {
        let b = NodeBatch {
            from: 3,
            boot: 1,
            to: 1,
            draining: false,
            msgs: vec![],
            forwards: vec![],
        };
        let mut out = Vec::new();
        encode_batch(&b, MAX_FRAME, &mut out);
        assert_eq!(out.len(), 4 + BATCH_HEADER);
        assert!(decode_batch(frames(&out)[0].clone())
            .unwrap()
            .msgs
            .is_empty());
    }

    #[test]
    fn a_batch_larger_than_a_frame_is_split_and_a_message_larger_than_a_frame_is_left_out() {
        let b = batch(4, 1000);
        let one = b.msgs[0].msg.compute_size() as usize;
        let max = BATCH_HEADER + ENVELOPE_HEADER + one;
        let mut out = Vec::new();
        assert_eq!(
            encode_batch(&b, max, &mut out),
            Encoded {
                frames: 2,
                skipped: 0
            }
        );
        let got: Vec<NodeBatch> = frames(&out)
            .into_iter()
            .map(|f| decode_batch(f).unwrap())
            .collect();
        assert!(got.iter().all(|g| g.msgs.len() == 1 && g.to == 2));
        out.clear();
        assert_eq!(
            encode_batch(&b, max - 1, &mut out),
            Encoded {
                frames: 1,
                skipped: 2
            }
        );
    }

    #[test]
    fn every_truncation_and_corruption_is_an_error_not_a_panic() {
        let mut out = Vec::new();
        encode_batch(&batch(2, 10), MAX_FRAME, &mut out);
        let payload = frames(&out).remove(0);
        let one = ENVELOPE_HEADER + batch(2, 10).msgs[0].msg.compute_size() as usize;
        // A cut between envelopes leaves a shorter batch; any other cut is an error.
        let boundaries = [BATCH_HEADER, BATCH_HEADER + one];
        for cut in 0..payload.len() {
            let got = decode_batch(payload.slice(..cut));
            if let Some(n) = boundaries.iter().position(|b| *b == cut) {
                assert_eq!(got.unwrap().msgs.len(), n);
            } else {
                assert!(got.is_err(), "a payload cut at {cut} decoded");
            }
        }
        // A length field pointing past the end, and garbage where a message should be.
        let mut bad = payload.to_vec();
        bad[BATCH_HEADER + 8..BATCH_HEADER + 12].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(matches!(
            decode_batch(bad.into()),
            Err(WireError::Truncated(_))
        ));
        let mut garbage = payload[..BATCH_HEADER].to_vec();
        garbage.extend_from_slice(&[
            0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 5, 0xff, 0xff, 0xff, 0xff, 0xff,
        ]);
        assert!(matches!(
            decode_batch(garbage.into()),
            Err(WireError::Protobuf(_))
        ));
    }

    #[tokio::test]
    async fn a_frame_above_the_maximum_is_refused_before_its_bytes_are_read() {
        let mut input: &[u8] = &[0xff, 0xff, 0xff, 0xff, 1, 2, 3];
        assert!(matches!(
            read_frame(&mut input).await,
            Err(WireError::TooLarge(_))
        ));
        let mut short: &[u8] = &[0, 0, 0, 10, 1, 2, 3];
        assert!(matches!(
            read_frame(&mut short).await,
            Err(WireError::Truncated(7))
        ));
        let mut two: &[u8] = &[0, 0, 0, 1, 9, 0, 0, 0, 0];
        assert_eq!(read_frame(&mut two).await.unwrap().unwrap(), &[9][..]);
        assert_eq!(read_frame(&mut two).await.unwrap().unwrap(), &[][..]);
        assert!(read_frame(&mut two).await.unwrap().is_none());
    }
}
