//! Several proposals of one group in one Raft entry.
//!
//! Under load a leader proposes many commands to a group between two log writes (a publisher's
//! window, a dispatch's checkouts). Each Raft entry costs the same whatever it carries: an index
//! record in the node-wide log's memory until the next snapshot (about 48 bytes, one per queued
//! message of a deep queue), protobuf framing, and a step through raft-rs on every member. The
//! node's Raft thread therefore joins the proposals a pass takes for one group into one entry,
//! and every member splits it back into the same commands, in the same order, as it applies it.
//!
//! Layout: [`MARK`] (8 bytes no single proposal starts with: a queue entry starts with its
//! leader's time in milliseconds, big-endian, whose first bytes are zero for millions of
//! years), the number of parts (`u32`, big-endian), then each part as its length (`u32`,
//! big-endian) and its bytes. Each part keeps its own checksum (the queue entry format's).

use bytes::{BufMut, Bytes};

/// The first bytes of a joined entry.
pub const MARK: [u8; 8] = [0xFF, 0xFF, 0xFF, 0xFF, b'W', b'B', 0x00, 0x01];

const COUNT_LEN: usize = 4;
const LEN_LEN: usize = 4;

/// What a joined entry adds to its parts.
pub const fn overhead(parts: usize) -> usize {
    MARK.len() + COUNT_LEN + parts * LEN_LEN
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BatchError {
    #[error("joined entry of {0} bytes is too short for its header")]
    Short(usize),
    #[error("joined entry's part {part} runs past its end")]
    Truncated { part: u32 },
    #[error("joined entry has {extra} bytes after its last part")]
    Trailing { extra: usize },
    #[error("a part of {0} bytes does not fit in a joined entry")]
    TooLarge(usize),
}

/// Is `data` a joined entry?
pub fn is_joined(data: &[u8]) -> bool {
    data.starts_with(&MARK)
}

/// One entry holding `parts`, in order.
pub fn join<P: AsRef<[u8]>>(parts: &[P]) -> Result<Vec<u8>, BatchError> {
    let body: usize = parts.iter().map(|p| p.as_ref().len()).sum();
    let count = u32::try_from(parts.len()).map_err(|_| BatchError::TooLarge(body))?;
    let mut out = Vec::with_capacity(overhead(parts.len()) + body);
    out.put_slice(&MARK);
    out.put_u32(count);
    for p in parts {
        let p = p.as_ref();
        let len = u32::try_from(p.len()).map_err(|_| BatchError::TooLarge(p.len()))?;
        out.put_u32(len);
        out.put_slice(p);
    }
    Ok(out)
}

/// The parts of a joined entry, as slices of it (no copy), pushed onto `out`. `Ok(false)`
/// (nothing pushed) for an entry that is not joined: it is one proposal. On an error nothing
/// is pushed: every member refuses the same bytes alike.
pub fn split_into(data: &Bytes, out: &mut Vec<Bytes>) -> Result<bool, BatchError> {
    if !is_joined(data) {
        return Ok(false);
    }
    let start = out.len();
    let result = parse(data, |from, to| out.push(data.slice(from..to)));
    if result.is_err() {
        out.truncate(start);
    }
    result.map(|()| true)
}

/// [`split_into`] for an entry given back as it was proposed (refused, or held through a
/// leadership transfer): its parts, or the entry itself when it is not joined or unreadable.
pub fn split_owned(data: Vec<u8>) -> Vec<Vec<u8>> {
    if !is_joined(&data) {
        return vec![data];
    }
    let mut parts = Vec::new();
    match parse(&data, |from, to| parts.push(data[from..to].to_vec())) {
        Ok(()) => parts,
        Err(_) => vec![data],
    }
}

/// Walks the parts of a joined entry, handing each one's byte range to `part`. Lengths are
/// checked against what is left before anything is taken: nothing is allocated from them.
fn parse(data: &[u8], mut part: impl FnMut(usize, usize)) -> Result<(), BatchError> {
    let header = MARK.len() + COUNT_LEN;
    let count_bytes = data
        .get(MARK.len()..header)
        .ok_or(BatchError::Short(data.len()))?;
    let count = u32::from_be_bytes([
        count_bytes[0],
        count_bytes[1],
        count_bytes[2],
        count_bytes[3],
    ]);
    let mut at = header;
    for n in 0..count {
        let len_bytes = data
            .get(at..at + LEN_LEN)
            .ok_or(BatchError::Truncated { part: n })?;
        let len = u32::from_be_bytes([len_bytes[0], len_bytes[1], len_bytes[2], len_bytes[3]]);
        let from = at + LEN_LEN;
        let to = usize::try_from(len)
            .ok()
            .and_then(|len| from.checked_add(len))
            .filter(|to| *to <= data.len())
            .ok_or(BatchError::Truncated { part: n })?;
        part(from, to);
        at = to;
    }
    if at != data.len() {
        return Err(BatchError::Trailing {
            extra: data.len() - at,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn split(data: Vec<u8>) -> Result<Option<Vec<Vec<u8>>>, BatchError> {
        let data = Bytes::from(data);
        let mut out = Vec::new();
        Ok(split_into(&data, &mut out)?.then(|| out.iter().map(|b| b.to_vec()).collect()))
    }

    proptest! {
        #[test]
        fn joined_parts_split_back_in_order(parts in proptest::collection::vec(
            proptest::collection::vec(any::<u8>(), 0..64), 0..20)) {
            let joined = join(&parts).unwrap();
            prop_assert_eq!(joined.len(), overhead(parts.len()) + parts.iter().map(Vec::len).sum::<usize>());
            prop_assert_eq!(split(joined.clone()).unwrap(), Some(parts.clone()));
            prop_assert_eq!(split_owned(joined), parts);
        }

        #[test]
        fn a_damaged_joined_entry_is_refused_whole_and_never_panics(
            parts in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..16), 1..6),
            cut in any::<prop::sample::Index>(),
            junk in proptest::collection::vec(any::<u8>(), 0..40),
        ) {
            let joined = join(&parts).unwrap();
            // Cut anywhere past the mark: the count or a length no longer matches.
            let at = MARK.len() + cut.index(joined.len() - MARK.len());
            let cut_short = joined[..at].to_vec();
            prop_assert!(split(cut_short.clone()).is_err());
            prop_assert_eq!(split_owned(cut_short.clone()), vec![cut_short]);
            // Whatever follows the mark, reading it never panics nor allocates from it.
            let mut any = MARK.to_vec();
            any.extend_from_slice(&junk);
            let _ = split(any);
        }
    }

    #[test]
    fn an_entry_that_is_not_joined_is_one_proposal() {
        let entry = vec![0u8, 0, 1, 0x8c, 9, 9, 9, 9, 1, 2, 3];
        assert_eq!(split(entry.clone()), Ok(None));
        assert_eq!(split_owned(entry.clone()), vec![entry]);
        assert!(!is_joined(&[0xFF; 7]));
    }

    #[test]
    fn trailing_bytes_after_the_last_part_are_refused() {
        let mut joined = join(&[b"one".as_slice(), b"two"]).unwrap();
        joined.push(7);
        assert_eq!(split(joined), Err(BatchError::Trailing { extra: 1 }));
    }

    #[test]
    fn a_huge_count_with_no_parts_is_refused_without_allocating() {
        let mut data = MARK.to_vec();
        data.extend_from_slice(&u32::MAX.to_be_bytes());
        assert_eq!(split(data), Err(BatchError::Truncated { part: 0 }));
    }
}
