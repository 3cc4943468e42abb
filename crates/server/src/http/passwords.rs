//! RabbitMQ's password hash format (`rabbit_password_hashing_sha256`): base64 of a 4-byte
//! salt followed by SHA-256(salt ++ password), so exported users load into RabbitMQ.

use base64::Engine;
use sha2::{Digest, Sha256};

/// A fresh salt: RabbitMQ uses 4 random bytes.
fn salt() -> [u8; 4] {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64),
    );
    let v = h.finish().to_be_bytes();
    [v[0], v[1], v[2], v[3]]
}

pub fn sha256_hash(password: &str) -> String {
    sha256_with_salt(salt(), password)
}

fn sha256_with_salt(salt: [u8; 4], password: &str) -> String {
    let mut h = Sha256::new();
    h.update(salt);
    h.update(password.as_bytes());
    let mut out = salt.to_vec();
    out.extend_from_slice(&h.finalize());
    base64::engine::general_purpose::STANDARD.encode(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_rabbitmqs_format() {
        // The salt leads, then SHA-256(salt ++ password): 36 bytes, 48 base64 characters.
        let h = sha256_with_salt([0x90, 0x8d, 0xc6, 0x0a], "test12");
        let raw = base64::engine::general_purpose::STANDARD
            .decode(&h)
            .unwrap();
        assert_eq!(raw.len(), 36);
        assert_eq!(&raw[..4], &[0x90, 0x8d, 0xc6, 0x0a]);
        let mut d = Sha256::new();
        d.update([0x90, 0x8d, 0xc6, 0x0a]);
        d.update(b"test12");
        assert_eq!(&raw[4..], &d.finalize()[..]);
        assert_ne!(sha256_hash("x"), sha256_hash("x"), "salted");
    }
}
