//! Server-generated names, like RabbitMQ's `rabbit_guid:binary(gen_secure(), "amq.gen")`:
//! `amq.gen-` followed by 16 random bytes in unpadded URL-safe base64 (22 characters).
//!
//! The randomness is a seeded SplitMix64 stream, so a broker with a given seed always
//! generates the same names (tests, simulation); the server seeds it from the OS.

const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";

/// A deterministic name generator.
#[derive(Clone, Debug)]
pub struct NameGen {
    state: u64,
}

impl NameGen {
    pub fn new(seed: u64) -> Self {
        NameGen { state: seed }
    }

    fn next_u64(&mut self) -> u64 {
        // SplitMix64.
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// `prefix` + `-` + 22 base64url characters.
    pub fn generate(&mut self, prefix: &str) -> String {
        let mut bytes = [0u8; 16];
        let (a, b) = bytes.split_at_mut(8);
        a.copy_from_slice(&self.next_u64().to_be_bytes());
        b.copy_from_slice(&self.next_u64().to_be_bytes());
        let mut out = String::with_capacity(prefix.len() + 23);
        out.push_str(prefix);
        out.push('-');
        base64url(&bytes, &mut out);
        out
    }
}

/// Unpadded URL-safe base64.
fn base64url(input: &[u8], out: &mut String) {
    let sym = |i: u32| char::from(ALPHABET.get((i & 63) as usize).copied().unwrap_or(b'A'));
    for chunk in input.chunks(3) {
        let b = |i: usize| u32::from(chunk.get(i).copied().unwrap_or(0));
        let n = (b(0) << 16) | (b(1) << 8) | b(2);
        out.push(sym(n >> 18));
        out.push(sym(n >> 12));
        if chunk.len() > 1 {
            out.push(sym(n >> 6));
        }
        if chunk.len() > 2 {
            out.push(sym(n));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_and_determinism() {
        let mut g = NameGen::new(1);
        let a = g.generate("amq.gen");
        let b = g.generate("amq.gen");
        assert_ne!(a, b);
        assert_eq!(a.len(), "amq.gen-".len() + 22);
        assert!(a.starts_with("amq.gen-"));
        assert!(a["amq.gen-".len()..]
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_'));
        assert_eq!(NameGen::new(1).generate("amq.gen"), a);
        assert_ne!(NameGen::new(2).generate("amq.gen"), a);
    }

    #[test]
    fn base64_vectors() {
        let enc = |s: &[u8]| {
            let mut o = String::new();
            base64url(s, &mut o);
            o
        };
        assert_eq!(enc(b"f"), "Zg");
        assert_eq!(enc(b"fo"), "Zm8");
        assert_eq!(enc(b"foo"), "Zm9v");
        assert_eq!(enc(&[0xfb, 0xff]), "-_8");
    }
}
