//! Receipt handles: which queue and which delivery of which message (the queue machine's
//! receipt: message id and attempt), so that a handle of an earlier delivery of a message
//! that was delivered again since settles nothing. Opaque to clients (base64url); the queue
//! is named by vhost and name and checked against the request's queue URL.

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use warren_broker::queue::machine::Receipt;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Handle {
    pub vhost: String,
    pub queue: String,
    pub receipt: Receipt,
}

/// Longest handle read back (SQS's handles are at most 1,024 characters).
const MAX_LEN: usize = 1024;

impl Handle {
    pub fn encode(&self) -> String {
        let raw = format!(
            "w1\n{}\n{}\n{}\n{}",
            self.receipt.msg_id, self.receipt.attempt, self.vhost, self.queue
        );
        URL_SAFE_NO_PAD.encode(raw)
    }

    pub fn decode(s: &str) -> Option<Handle> {
        if s.len() > MAX_LEN {
            return None;
        }
        let raw = URL_SAFE_NO_PAD.decode(s).ok()?;
        let text = String::from_utf8(raw).ok()?;
        let mut parts = text.splitn(5, '\n');
        if parts.next()? != "w1" {
            return None;
        }
        let msg_id = parts.next()?.parse().ok()?;
        let attempt = parts.next()?.parse().ok()?;
        let vhost = parts.next()?.to_owned();
        let queue = parts.next()?.to_owned();
        Some(Handle {
            vhost,
            queue,
            receipt: Receipt { msg_id, attempt },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let h = Handle {
            vhost: "/".into(),
            queue: "jobs\nodd".into(),
            receipt: Receipt {
                msg_id: 42,
                attempt: 3,
            },
        };
        assert_eq!(Handle::decode(&h.encode()), Some(h));
    }

    #[test]
    fn garbage_is_refused() {
        assert_eq!(Handle::decode("not a handle"), None);
        assert_eq!(Handle::decode(""), None);
        assert_eq!(
            Handle::decode(&URL_SAFE_NO_PAD.encode("w1\nx\n1\n/\nq")),
            None
        );
        assert_eq!(
            Handle::decode(&URL_SAFE_NO_PAD.encode("w2\n1\n1\n/\nq")),
            None
        );
        assert_eq!(Handle::decode(&"A".repeat(2000)), None);
    }
}
