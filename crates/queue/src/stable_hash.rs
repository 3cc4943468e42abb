//! The hash behind message groups and machine digests: XXH3-64 with seed 0 over a byte stream
//! that does not depend on the platform.
//!
//! `std`'s `DefaultHasher` is documented as unspecified and free to change between Rust
//! releases, and `Hasher`'s default integer writes use the platform's byte order. A digest
//! compared between two replicas, or a group key computed by one node and used by another, needs
//! the same value on every node and every build: integers are fed as little-endian bytes of a
//! fixed width (`usize` and `isize` as 8 bytes), and the algorithm is XXH3 as its specification
//! defines it.

use std::hash::Hasher;

use xxhash_rust::xxh3::{xxh3_64, Xxh3};

/// XXH3-64 (seed 0) of `bytes`: what a message group's key is derived from.
pub fn hash_bytes(bytes: &[u8]) -> u64 {
    xxh3_64(bytes)
}

/// A [`Hasher`] whose result is the same on every platform: XXH3-64 over the bytes written,
/// integers as fixed-width little-endian.
#[derive(Clone, Default)]
pub struct StableHasher(Xxh3);

impl StableHasher {
    pub fn new() -> Self {
        Self::default()
    }
}

impl Hasher for StableHasher {
    fn finish(&self) -> u64 {
        self.0.digest()
    }

    fn write(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    fn write_u8(&mut self, i: u8) {
        self.0.update(&[i]);
    }

    fn write_u16(&mut self, i: u16) {
        self.0.update(&i.to_le_bytes());
    }

    fn write_u32(&mut self, i: u32) {
        self.0.update(&i.to_le_bytes());
    }

    fn write_u64(&mut self, i: u64) {
        self.0.update(&i.to_le_bytes());
    }

    fn write_u128(&mut self, i: u128) {
        self.0.update(&i.to_le_bytes());
    }

    fn write_usize(&mut self, i: usize) {
        self.write_u64(i as u64);
    }

    fn write_i8(&mut self, i: i8) {
        self.write_u8(i as u8);
    }

    fn write_i16(&mut self, i: i16) {
        self.write_u16(i as u16);
    }

    fn write_i32(&mut self, i: i32) {
        self.write_u32(i as u32);
    }

    fn write_i64(&mut self, i: i64) {
        self.write_u64(i as u64);
    }

    fn write_i128(&mut self, i: i128) {
        self.write_u128(i as u128);
    }

    fn write_isize(&mut self, i: isize) {
        self.write_u64(i as i64 as u64);
    }
}

#[cfg(test)]
mod tests {
    use std::hash::Hash;

    use super::*;

    // Fixed values: if one of these changes, group keys and digests differ between builds, and
    // replicas of different versions would disagree.
    #[test]
    fn values_are_fixed() {
        assert_eq!(hash_bytes(b""), 0x2d06_8005_38d3_94c2);
        assert_eq!(hash_bytes(b"order-42"), hash_bytes(b"order-42"));
        let mut h = StableHasher::new();
        h.write_u64(1);
        h.write_usize(2);
        h.write_u16(3);
        let mut le = Vec::new();
        le.extend_from_slice(&1u64.to_le_bytes());
        le.extend_from_slice(&2u64.to_le_bytes());
        le.extend_from_slice(&3u16.to_le_bytes());
        assert_eq!(h.finish(), hash_bytes(&le));
    }

    #[test]
    fn integers_are_hashed_as_little_endian_whatever_the_platform() {
        let mut a = StableHasher::new();
        0x0102_0304u32.hash(&mut a);
        let mut b = StableHasher::new();
        b.write(&[4, 3, 2, 1]);
        assert_eq!(a.finish(), b.finish());
    }
}
