//! Arbitrary bytes decoded as a field table (4-byte length prefix, then pairs). Whenever
//! it decodes: the encoding is as long as what was consumed, decodes again to an equal
//! table, and encodes a second time to the same bytes; printing it and detaching it
//! never panic.
#![no_main]

use bytes::{Bytes, BytesMut};
use libfuzzer_sys::fuzz_target;
use warren_codec::FieldTable;

fuzz_target!(|data: &[u8]| {
    let mut buf = Bytes::copy_from_slice(data);
    let Ok(table) = FieldTable::decode(&mut buf) else {
        return;
    };
    let consumed = data.len() - buf.len();
    let _ = format!("{table}");
    assert_eq!(table.detached(), table, "detached copy differs");

    let mut first = BytesMut::new();
    table.encode(&mut first);
    // Only a `t` octet other than 0/1 changes on the way back, never the length.
    assert_eq!(
        first.len(),
        consumed,
        "re-encoding changed the length of {table:?}"
    );
    let first = first.freeze();
    let mut again_buf = first.clone();
    let again = FieldTable::decode(&mut again_buf)
        .unwrap_or_else(|e| panic!("re-decode of {table:?} failed: {e}"));
    assert!(
        again_buf.is_empty(),
        "re-decode left {} bytes",
        again_buf.len()
    );
    assert_eq!(again, table, "round trip changed the table");
    let mut second = BytesMut::new();
    again.encode(&mut second);
    assert_eq!(
        &second[..],
        &first[..],
        "second encoding differs for {table:?}"
    );
});
