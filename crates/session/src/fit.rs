//! Content headers within the receiving connection's `frame_max`.
//!
//! A content header cannot be split across frames, and a client that receives a frame larger
//! than the `frame_max` it negotiated closes its connection (lapin, amqplib): the message then
//! comes back and is sent again, forever. A header can outgrow a connection's `frame_max`
//! after it was accepted: the queue adds `x-delivery-count` to a redelivery, dead-lettering
//! adds `x-death`, and the consumer may have negotiated a smaller `frame_max` than the
//! publisher. So every content header is checked where it is sent.

use bytes::Bytes;
use warren_codec::{content_header_frame_len, frame_fits, BasicProperties};

/// Header added to a delivery by its queue, not by its publisher: the one thing a delivery
/// can go without to fit (the queue still counts and enforces its delivery limit).
const DELIVERY_COUNT: &str = "x-delivery-count";

/// How a delivery's properties go out.
#[derive(Debug, PartialEq)]
pub(crate) enum Fit {
    /// As they are.
    AsIs,
    /// Without `x-delivery-count`, which alone made the header too large.
    Without(Bytes),
    /// The content header frame would be this many bytes, over `frame_max` either way.
    TooLarge(usize),
}

/// How `properties` can go out in a content header on a connection with `frame_max`.
pub(crate) fn fit(properties: &Bytes, frame_max: u32) -> Fit {
    let len = content_header_frame_len(properties.len());
    if frame_fits(len, frame_max) {
        return Fit::AsIs;
    }
    let Ok(mut decoded) = BasicProperties::decode_bytes(properties.clone()) else {
        return Fit::TooLarge(len);
    };
    let removed = decoded
        .headers
        .as_mut()
        .and_then(|h| h.remove(DELIVERY_COUNT))
        .is_some();
    if removed {
        let smaller = decoded.encode();
        if frame_fits(content_header_frame_len(smaller.len()), frame_max) {
            return Fit::Without(smaller);
        }
    }
    Fit::TooLarge(len)
}

/// Whether `properties` fit a content header frame on a connection with `frame_max`.
pub(crate) fn fits(properties: &[u8], frame_max: u32) -> bool {
    frame_fits(content_header_frame_len(properties.len()), frame_max)
}

/// The reply text of the channel error for a message whose header a connection cannot take.
pub(crate) fn too_large_text(queue: &str, vhost: &str, len: usize, frame_max: u32) -> String {
    format!(
        "message in queue '{queue}' in vhost '{vhost}' needs a content header frame of {len} bytes, more than this connection's frame_max of {frame_max}; it stays in the queue"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use warren_codec::{FieldTable, FieldValue, ShortStr};

    fn props(filler: usize, count: Option<i64>) -> Bytes {
        let mut headers = FieldTable::new();
        headers.insert(
            ShortStr::from("filler"),
            FieldValue::long_str("x".repeat(filler)),
        );
        if let Some(n) = count {
            headers.insert(ShortStr::from(DELIVERY_COUNT), FieldValue::I64(n));
        }
        BasicProperties {
            headers: Some(headers),
            ..Default::default()
        }
        .encode()
    }

    #[test]
    fn a_header_that_fits_goes_as_it_is() {
        let p = props(100, Some(1));
        assert_eq!(fit(&p, 4096), Fit::AsIs);
        assert_eq!(fit(&p, 0), Fit::AsIs, "0 is no limit");
        // Exactly frame_max, overhead included, fits; one byte more does not.
        let exact = content_header_frame_len(p.len()) as u32;
        assert_eq!(fit(&p, exact), Fit::AsIs);
        assert_ne!(fit(&p, exact - 1), Fit::AsIs);
    }

    #[test]
    fn only_the_delivery_count_is_left_out_and_only_when_that_is_enough() {
        let without = props(4000, None);
        let with = props(4000, Some(3));
        let frame_max = content_header_frame_len(without.len()) as u32;
        assert!(!fits(&with, frame_max));
        match fit(&with, frame_max) {
            Fit::Without(p) => {
                let decoded = BasicProperties::decode_bytes(p).unwrap();
                let h = decoded.headers.unwrap();
                assert!(h.get(DELIVERY_COUNT).is_none());
                assert!(h.get("filler").is_some());
            }
            other => panic!("{other:?}"),
        }
        // The publisher's own headers are never dropped.
        assert_eq!(
            fit(&without, frame_max - 1),
            Fit::TooLarge(frame_max as usize)
        );
        assert!(matches!(fit(&with, frame_max - 1), Fit::TooLarge(_)));
    }
}
