//! SASL mechanisms RabbitMQ offers by default: PLAIN and AMQPLAIN; and EXTERNAL (RabbitMQ's
//! `rabbitmq_auth_mechanism_ssl`) on TLS connections that presented a verified client certificate.

use std::net::IpAddr;

use bytes::Bytes;
use warren_codec::{FieldTable, FieldValue};

use warren_broker::access::Access;

use crate::config::SessionConfig;

pub const MECHANISMS: &str = "PLAIN AMQPLAIN";
/// What a connection with a verified client certificate is offered.
pub const MECHANISMS_WITH_EXTERNAL: &str = "PLAIN AMQPLAIN EXTERNAL";
pub const EXTERNAL: &str = "EXTERNAL";

#[derive(Debug, PartialEq, Eq)]
pub struct Credentials {
    pub user: String,
    pub password: String,
}

/// Why a login failed; each maps to the connection.close RabbitMQ sends.
#[derive(Debug, PartialEq, Eq)]
pub enum AuthError {
    UnknownMechanism(String),
    /// The response could not be parsed for this mechanism.
    Malformed,
    Refused,
}

pub fn parse_response(mechanism: &str, response: &Bytes) -> Result<Credentials, AuthError> {
    match mechanism {
        "PLAIN" => parse_plain(response),
        "AMQPLAIN" => parse_amqplain(response),
        other => Err(AuthError::UnknownMechanism(other.to_string())),
    }
}

/// RFC 4616: `[authzid] NUL authcid NUL passwd`.
fn parse_plain(response: &[u8]) -> Result<Credentials, AuthError> {
    let mut parts = response.split(|b| *b == 0);
    let _authzid = parts.next().ok_or(AuthError::Malformed)?;
    let user = parts.next().ok_or(AuthError::Malformed)?;
    let password = parts.next().ok_or(AuthError::Malformed)?;
    if parts.next().is_some() {
        return Err(AuthError::Malformed);
    }
    Ok(Credentials {
        user: String::from_utf8(user.to_vec()).map_err(|_| AuthError::Malformed)?,
        password: String::from_utf8(password.to_vec()).map_err(|_| AuthError::Malformed)?,
    })
}

/// AMQPLAIN: a field table without its length prefix, holding LOGIN and PASSWORD.
fn parse_amqplain(response: &Bytes) -> Result<Credentials, AuthError> {
    let len = u32::try_from(response.len()).map_err(|_| AuthError::Malformed)?;
    let mut framed = Vec::with_capacity(response.len() + 4);
    framed.extend_from_slice(&len.to_be_bytes());
    framed.extend_from_slice(response);
    let table = FieldTable::decode(&mut Bytes::from(framed)).map_err(|_| AuthError::Malformed)?;
    let text = |key: &str| -> Result<String, AuthError> {
        match table.get(key) {
            Some(FieldValue::LongStr(b)) => {
                String::from_utf8(b.to_vec()).map_err(|_| AuthError::Malformed)
            }
            _ => Err(AuthError::Malformed),
        }
    };
    Ok(Credentials {
        user: text("LOGIN")?,
        password: text("PASSWORD")?,
    })
}

/// Checks a password login against the broker's users, and that a loopback-only user (see
/// [`SessionConfig::loopback_only`]) comes from this machine.
pub fn authenticate(
    access: &Access,
    config: &SessionConfig,
    creds: &Credentials,
    peer: Option<IpAddr>,
) -> Result<(), AuthError> {
    access
        .login(&creds.user, &creds.password)
        .ok_or(AuthError::Refused)?;
    if config.loopback_only(&creds.user)
        && !peer.is_some_and(|ip| ip.is_loopback() || is_mapped_loopback(ip))
    {
        return Err(AuthError::Refused);
    }
    Ok(())
}

/// The name a connection of the node to itself logs in with to act with every permission
/// (RabbitMQ's direct connection without a user). It can only be used with the node's internal
/// secret; a user of that name in the user table gains nothing from it.
pub const INTERNAL_USER: &str = "warren-internal";

/// A login of the node to itself: the password is the node's internal secret (made at start,
/// never stored or sent anywhere but the node's own loopback connections). `Some(true)`: as
/// [`INTERNAL_USER`], with every permission; `None`: not an internal login (checked as any
/// other; the secret is no password of any user).
pub fn authenticate_internal(
    access: &Access,
    config: &SessionConfig,
    creds: &Credentials,
) -> Option<bool> {
    let secret = config
        .internal_secret
        .as_deref()
        .filter(|s| !s.is_empty())?;
    if !same_secret(secret.as_bytes(), creds.password.as_bytes()) {
        return None;
    }
    let _ = access;
    (creds.user == INTERNAL_USER).then_some(true)
}

/// Compares in time that does not depend on where the first difference is.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// EXTERNAL: the user named by the client certificate (the driver verified it and extracted the
/// name) must exist; there is no password. The loopback-only rule still applies, as in RabbitMQ.
pub fn authenticate_external(
    access: &Access,
    config: &SessionConfig,
    name: &str,
    peer: Option<IpAddr>,
) -> Result<(), AuthError> {
    access.user(name).ok_or(AuthError::Refused)?;
    if config.loopback_only(name)
        && !peer.is_some_and(|ip| ip.is_loopback() || is_mapped_loopback(ip))
    {
        return Err(AuthError::Refused);
    }
    Ok(())
}

fn is_mapped_loopback(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback()),
        IpAddr::V4(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::BytesMut;

    /// The default configuration's guest, as a fresh node makes it.
    fn guest() -> (Access, SessionConfig) {
        let config = SessionConfig::default();
        let mut b = warren_broker::Broker::new(Default::default());
        crate::manage::apply_config_users(&mut b, &config, true, &mut || [1, 2, 3, 4]);
        (b.access().clone(), config)
    }

    #[test]
    fn the_internal_secret_logs_in_as_the_internal_user_or_an_existing_one() {
        let (a, mut cfg) = guest();
        let creds = |user: &str, password: &str| Credentials {
            user: user.into(),
            password: password.into(),
        };
        assert_eq!(
            authenticate_internal(&a, &cfg, &creds(INTERNAL_USER, "")),
            None,
            "no secret configured: no internal login"
        );
        cfg.internal_secret = Some("s3cret".into());
        assert_eq!(
            authenticate_internal(&a, &cfg, &creds(INTERNAL_USER, "s3cret")),
            Some(true)
        );
        assert_eq!(
            authenticate_internal(&a, &cfg, &creds("guest", "s3cret")),
            None,
            "the secret is no password of any user"
        );
        assert_eq!(
            authenticate_internal(&a, &cfg, &creds("nobody", "s3cret")),
            None
        );
        assert_eq!(
            authenticate_internal(&a, &cfg, &creds(INTERNAL_USER, "s3cre")),
            None
        );
        assert_eq!(
            authenticate_internal(&a, &cfg, &creds(INTERNAL_USER, "guest")),
            None
        );
    }

    #[test]
    fn plain_parses_and_checks() {
        let c = parse_response("PLAIN", &Bytes::from_static(b"\0guest\0guest")).unwrap();
        assert_eq!(c.user, "guest");
        let lo: IpAddr = "127.0.0.1".parse().unwrap();
        let (a, cfg) = guest();
        assert_eq!(authenticate(&a, &cfg, &c, Some(lo)), Ok(()));
        let bad = parse_response("PLAIN", &Bytes::from_static(b"\0guest\0wrong")).unwrap();
        assert_eq!(
            authenticate(&a, &cfg, &bad, Some(lo)),
            Err(AuthError::Refused)
        );
    }

    #[test]
    fn guest_is_refused_from_remote_addresses() {
        let c = parse_response("PLAIN", &Bytes::from_static(b"\0guest\0guest")).unwrap();
        let remote: IpAddr = "10.1.2.3".parse().unwrap();
        let (a, cfg) = guest();
        assert_eq!(
            authenticate(&a, &cfg, &c, Some(remote)),
            Err(AuthError::Refused)
        );
        let mapped: IpAddr = "::ffff:127.0.0.1".parse().unwrap();
        assert_eq!(authenticate(&a, &cfg, &c, Some(mapped)), Ok(()));
    }

    #[test]
    fn external_needs_an_existing_user_and_no_password() {
        let lo: IpAddr = "127.0.0.1".parse().unwrap();
        let remote: IpAddr = "10.1.2.3".parse().unwrap();
        let (a, cfg) = guest();
        assert_eq!(authenticate_external(&a, &cfg, "guest", Some(lo)), Ok(()));
        assert_eq!(
            authenticate_external(&a, &cfg, "nobody", Some(lo)),
            Err(AuthError::Refused)
        );
        assert_eq!(
            authenticate_external(&a, &cfg, "guest", Some(remote)),
            Err(AuthError::Refused)
        );
    }

    #[test]
    fn plain_rejects_garbage() {
        assert_eq!(
            parse_response("PLAIN", &Bytes::from_static(b"guest")),
            Err(AuthError::Malformed)
        );
        assert!(matches!(
            parse_response("SCRAM", &Bytes::new()),
            Err(AuthError::UnknownMechanism(_))
        ));
    }

    #[test]
    fn amqplain_parses() {
        let mut t = FieldTable::default();
        t.insert("LOGIN", FieldValue::LongStr(Bytes::from_static(b"guest")));
        t.insert("PASSWORD", FieldValue::LongStr(Bytes::from_static(b"pw")));
        let mut buf = BytesMut::new();
        t.encode(&mut buf);
        let body = Bytes::from(buf).slice(4..);
        let c = parse_response("AMQPLAIN", &body).unwrap();
        assert_eq!(
            c,
            Credentials {
                user: "guest".into(),
                password: "pw".into()
            }
        );
    }
}
