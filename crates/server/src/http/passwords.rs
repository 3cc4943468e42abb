//! RabbitMQ's password hash format in definitions and the API (`password_hash`): base64 of a
//! 4-byte salt followed by SHA-256 (or SHA-512) of salt and password.

use base64::Engine;
use warren_broker::access::{HashAlgorithm, PasswordHash};

/// A fresh salt, from the standard library's randomly seeded hasher (salts must differ, not
/// be secret).
pub fn salt() -> [u8; 4] {
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

/// A new hash of a password, as RabbitMQ makes one by default.
pub fn hash(password: &str) -> PasswordHash {
    PasswordHash::new(password, salt(), HashAlgorithm::Sha256)
}

pub fn encode(h: &PasswordHash) -> String {
    base64::engine::general_purpose::STANDARD.encode(&h.bytes)
}

/// A `password_hash` as definitions carry it; None if it is not one.
pub fn decode(text: &str, algorithm: HashAlgorithm) -> Option<PasswordHash> {
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(text)
        .ok()?;
    PasswordHash::from_bytes(bytes, algorithm)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_rabbitmqs_hashes() {
        // Made by RabbitMQ 3.10.8 for the password "y" (PUT /api/users).
        let h = decode(
            "LDkFZb3phSVksKWJAPytxd+y9RK3iHIfsf78LoWDS2Y/xkSW",
            HashAlgorithm::Sha256,
        )
        .expect("a sha256 hash");
        assert!(h.matches("y"));
        assert!(!h.matches("x"));
        assert_eq!(
            encode(&h),
            "LDkFZb3phSVksKWJAPytxd+y9RK3iHIfsf78LoWDS2Y/xkSW"
        );
        assert!(decode("short", HashAlgorithm::Sha256).is_none());
        assert!(hash("x").matches("x"));
        assert_ne!(encode(&hash("x")), encode(&hash("x")), "salted");
    }
}
