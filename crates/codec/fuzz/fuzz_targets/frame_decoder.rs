//! Arbitrary bytes into FrameDecoder (frame_max chosen by the first byte, small ones
//! included); every decoded frame is re-encoded and re-decoded and must be equal. See
//! `warren_codec::fuzzing::check_frames` for the full list of checks.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Err(e) = warren_codec::fuzzing::check_frames(data) {
        panic!("{e}");
    }
});
