//! A shovel's AMQP URIs (RabbitMQ's URI specification). A URI with an empty host
//! (`amqp://`, `amqp:///vhost`) means this node, as RabbitMQ's direct connection does: the
//! shovel connects to the node's own listener with the node's internal secret, as the internal
//! user with every permission (or as the user the URI names, with that user's permissions).
//!
//! `amqps://` reaches a remote broker over TLS (rustls, TLS 1.2 and 1.3), checking its
//! certificate against the system's CAs and the URI's `cacertfile`, with a client certificate
//! from `certfile` and `keyfile`: the query parameters of RabbitMQ's Erlang client
//! (uri-query-parameters). The certificate is checked unless the URI says `verify=verify_none`
//! (RabbitMQ 4's default, where RabbitMQ 3 checked nothing unless told): a definitions file
//! written for a broker with a self-signed certificate then works as it did, the handshake's
//! signatures still checked, and the shovel logs once per connection that the peer is unchecked.
//! `server_name_indication=NAME` sends NAME and checks the certificate against it (Erlang's
//! ssl does both with that one option); `disable` sends none and checks the chain only, not
//! the name, as Erlang's ssl does.

use lapin::uri::{AMQPAuthority, AMQPQueryString, AMQPScheme, AMQPUri, AMQPUserInfo};
use percent_encoding::percent_decode_str;
use warren_session::INTERNAL_USER;

/// How a shovel reaches this node's own listener.
#[derive(Clone, Debug)]
pub struct Local {
    pub addr: std::net::SocketAddr,
    pub secret: String,
}

/// The parts of a URI before its path: `(scheme, authority, path and query)`.
fn split(uri: &str) -> Result<(&str, &str, &str), String> {
    let Some((scheme, rest)) = uri.split_once("://") else {
        return Err(format!(
            "{{{{unable_to_parse_uri,no_scheme}},{}}}",
            quoted(uri)
        ));
    };
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    Ok((scheme, &rest[..end], &rest[end..]))
}

fn quoted(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_default()
}

/// The host of an authority (`user:pass@host:port`), brackets of an IPv6 address kept.
fn host_of(authority: &str) -> &str {
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    if host_port.starts_with('[') {
        return host_port.find(']').map_or(host_port, |i| &host_port[..=i]);
    }
    host_port.split(':').next().unwrap_or("")
}

/// Is the URI this node (an empty host)?
pub fn is_local(uri: &str) -> bool {
    split(uri).is_ok_and(|(_, authority, _)| host_of(authority).is_empty())
}

/// Checks a URI as the API takes it; the error is the text after "not a valid URI: ".
pub fn check(uri: &str) -> Result<(), String> {
    let (scheme, authority, _) = split(uri)?;
    match scheme {
        "amqp" => {}
        "amqps" => {
            if host_of(authority).is_empty() {
                return Err(
                    "amqps:// needs a host: this node is reached with amqp:// (an empty host)"
                        .into(),
                );
            }
            tls_params(uri)?;
        }
        other => {
            return Err(format!(
                "{{{{unexpected_uri_scheme,{}}},{}}}",
                quoted(other),
                quoted(uri)
            ))
        }
    }
    if host_of(authority).is_empty() {
        return local_parts(uri, "/").map(|_| ());
    }
    if host_of(authority).starts_with('[') {
        // lapin's URI parser takes no IPv6 literal (it would go to localhost instead).
        return Err(format!(
            "{} is an IPv6 address: give the broker a host name that resolves to it",
            host_of(authority)
        ));
    }
    uri.parse::<AMQPUri>()
        .map(|_| ())
        .map_err(|e| format!("{{{{unable_to_parse_uri,{}}},{}}}", quoted(&e), quoted(uri)))
}

/// A local URI's user (if it names one) and vhost (`default_vhost` if it names none).
fn local_parts(uri: &str, default_vhost: &str) -> Result<(Option<String>, String), String> {
    let (_, authority, path) = split(uri)?;
    let decode = |s: &str| {
        percent_decode_str(s)
            .decode_utf8()
            .map(|c| c.into_owned())
            .map_err(|_| {
                format!(
                    "{{{{unable_to_parse_uri,bad_percent_encoding}},{}}}",
                    quoted(uri)
                )
            })
    };
    let user = match authority.rsplit_once('@') {
        Some((info, _)) => {
            let name = info.split(':').next().unwrap_or("");
            (!name.is_empty()).then(|| decode(name)).transpose()?
        }
        None => None,
    };
    let path = path.split(['?', '#']).next().unwrap_or("");
    let vhost = match path.strip_prefix('/') {
        None => default_vhost.to_owned(),
        Some(v) => decode(v)?,
    };
    Ok((user, vhost))
}

/// The password a local URI gives (`amqp://user:pass@/vhost`), percent-decoded.
fn local_password(uri: &str) -> String {
    let Ok((_, authority, _)) = split(uri) else {
        return String::new();
    };
    let info = authority.rsplit_once('@').map_or("", |(i, _)| i);
    let pass = info.split_once(':').map_or("", |(_, p)| p);
    percent_decode_str(pass).decode_utf8_lossy().into_owned()
}

/// The vhost a local URI runs in, with every permission when it names no user: `None` for
/// a remote URI or one that names a user.
pub fn trusted_vhost(uri: &str, default_vhost: &str) -> Option<String> {
    if !is_local(uri) {
        return None;
    }
    match local_parts(uri, default_vhost) {
        Ok((None, vhost)) => Some(vhost),
        _ => None,
    }
}

/// What lapin connects to for `uri` (which passed [`check`]): a remote broker as written, or
/// this node's listener with the internal secret.
pub fn target(uri: &str, local: &Local, default_vhost: &str) -> Result<AMQPUri, String> {
    if !is_local(uri) {
        return uri.parse::<AMQPUri>();
    }
    let (user, vhost) = local_parts(uri, default_vhost)?;
    // A URI that names a user logs in as that user, with the password it gives.
    let (username, password) = match user {
        Some(u) => (u, local_password(uri)),
        None => (INTERNAL_USER.to_owned(), local.secret.clone()),
    };
    Ok(AMQPUri {
        scheme: AMQPScheme::AMQP,
        authority: AMQPAuthority {
            userinfo: AMQPUserInfo { username, password },
            host: local.addr.ip().to_string(),
            port: local.addr.port(),
        },
        vhost,
        query: AMQPQueryString::default(),
    })
}

/// The TLS settings of an `amqps://` URI, as RabbitMQ's Erlang client takes them.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct TlsParams {
    /// More CAs to trust than the system's (a PEM file on this node).
    pub cacertfile: Option<std::path::PathBuf>,
    /// A client certificate and its key (PEM files on this node).
    pub identity: Option<(std::path::PathBuf, std::path::PathBuf)>,
    /// `verify=verify_none`: the server's certificate is not checked.
    pub unchecked: bool,
    /// The name sent (SNI) and checked against the certificate: the host unless
    /// `server_name_indication` names another.
    pub server_name: String,
    /// `server_name_indication=disable`: no SNI is sent.
    pub no_sni: bool,
}

/// The TLS query parameters of `uri`; an error for what Warren does not do.
pub fn tls_params(uri: &str) -> Result<TlsParams, String> {
    let (_, authority, rest) = split(uri)?;
    let query = rest
        .split_once('?')
        .map_or("", |(_, q)| q.split('#').next().unwrap_or(""));
    let host = host_of(authority)
        .trim_start_matches('[')
        .trim_end_matches(']');
    let mut params = TlsParams {
        server_name: host.to_owned(),
        ..TlsParams::default()
    };
    let (mut certfile, mut keyfile) = (None, None);
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        let value = percent_decode_str(value).decode_utf8_lossy().into_owned();
        match key {
            "cacertfile" => params.cacertfile = Some(value.into()),
            "certfile" => certfile = Some(std::path::PathBuf::from(value)),
            "keyfile" => keyfile = Some(std::path::PathBuf::from(value)),
            "verify" => match value.as_str() {
                "verify_peer" => params.unchecked = false,
                "verify_none" => params.unchecked = true,
                _ => {
                    return Err(format!(
                        "verify={value}: give verify_peer (check the server's certificate) or \
                         verify_none (do not)"
                    ))
                }
            },
            "server_name_indication" if value == "disable" => params.no_sni = true,
            "server_name_indication" => {
                if rustls_pki_types::ServerName::try_from(value.as_str()).is_err() {
                    return Err(format!(
                        "server_name_indication={value}: not a host name; give the name the \
                         server's certificate holds, or disable"
                    ));
                }
                params.server_name = value;
            }
            "password" => return Err(
                "password=...: an encrypted keyfile is not supported; give an unencrypted PEM key"
                    .into(),
            ),
            // Taken as RabbitMQ takes them, or of no effect here.
            _ => {}
        }
    }
    params.identity = match (certfile, keyfile) {
        (Some(c), Some(k)) => Some((c, k)),
        (None, None) => None,
        _ => return Err("certfile and keyfile go together: give both, or neither".into()),
    };
    Ok(params)
}

/// The TLS connector an `amqps://` URI asks for, and the parameters it was built from (the
/// server name to give it among them): its CAs and client identity read now (a shovel builds
/// one at each connection, so renewed files are used).
pub fn tls_connector(uri: &str) -> Result<(lapin::tcp::RustlsConnector, TlsParams), String> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    let params = tls_params(uri)?;
    let read = |path: &std::path::Path, what: &str| {
        std::fs::read(path).map_err(|e| format!("cannot read {what} {}: {e}", path.display()))
    };
    let certs_of = |path: &std::path::Path, what: &str| {
        let pem = read(path, what)?;
        let certs = CertificateDer::pem_slice_iter(&pem)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("{what} {} is not a PEM file: {e}", path.display()))?;
        if certs.is_empty() {
            return Err(format!(
                "{what} {} holds no certificate (a PEM file with BEGIN CERTIFICATE)",
                path.display()
            ));
        }
        Ok(certs)
    };
    let identity = match &params.identity {
        Some((cert, key)) => {
            let chain = certs_of(cert, "certfile")?;
            let key = PrivateKeyDer::from_pem_slice(&read(key, "keyfile")?)
                .map_err(|e| format!("keyfile {} holds no unencrypted key: {e}", key.display()))?;
            Some((chain, key))
        }
        None => None,
    };
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS: {e}"))?;
    let builder = if params.unchecked {
        builder
            .dangerous()
            .with_custom_certificate_verifier(std::sync::Arc::new(Lenient {
                provider,
                chain: None,
            }))
    } else {
        let mut roots = rustls::RootCertStore::empty();
        // The system's CAs (none is fine when cacertfile names the one that matters).
        let native = rustls_native_certs::load_native_certs();
        roots.add_parsable_certificates(native.certs);
        if let Some(path) = &params.cacertfile {
            roots.add_parsable_certificates(certs_of(path, "cacertfile")?);
        }
        if roots.is_empty() {
            return Err(
                "no CA to check the server's certificate against: install the system's \
                        CA certificates (ca-certificates), or give cacertfile=..."
                    .into(),
            );
        }
        if params.no_sni {
            // Erlang's ssl with server_name_indication=disable checks the chain, not the name.
            let chain = rustls::client::WebPkiServerVerifier::builder_with_provider(
                std::sync::Arc::new(roots),
                provider.clone(),
            )
            .build()
            .map_err(|e| format!("TLS: {e}"))?;
            builder
                .dangerous()
                .with_custom_certificate_verifier(std::sync::Arc::new(Lenient {
                    provider,
                    chain: Some(chain),
                }))
        } else {
            builder.with_root_certificates(roots)
        }
    };
    let mut config = match identity {
        Some((chain, key)) => builder
            .with_client_auth_cert(chain, key)
            .map_err(|e| format!("certfile and keyfile do not make a client identity: {e}"))?,
        None => builder.with_no_client_auth(),
    };
    config.enable_sni = !params.no_sni;
    Ok((
        lapin::tcp::RustlsConnector::from(std::sync::Arc::new(config)),
        params,
    ))
}

/// A verifier for what RabbitMQ's URIs ask to check less: `verify=verify_none` takes any
/// certificate (`chain` None), `server_name_indication=disable` checks the chain against the
/// CAs but not the name. Either way the handshake's signatures are checked (the peer holds the
/// key of the certificate it sent).
#[derive(Debug)]
struct Lenient {
    provider: std::sync::Arc<rustls::crypto::CryptoProvider>,
    chain: Option<std::sync::Arc<rustls::client::WebPkiServerVerifier>>,
}

impl rustls::client::danger::ServerCertVerifier for Lenient {
    fn verify_server_cert(
        &self,
        end_entity: &rustls_pki_types::CertificateDer<'_>,
        intermediates: &[rustls_pki_types::CertificateDer<'_>],
        server_name: &rustls_pki_types::ServerName<'_>,
        ocsp_response: &[u8],
        now: rustls_pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        use rustls::{CertificateError, Error};
        let Some(chain) = &self.chain else {
            return Ok(rustls::client::danger::ServerCertVerified::assertion());
        };
        match chain.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now) {
            Err(Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(rustls::client::danger::ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls_pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls_pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// Connects lapin to `target` (what [`target`] made of `uri`): over TLS with the URI's
/// settings for `amqps://`.
pub async fn connect(
    uri: &str,
    target: AMQPUri,
    props: lapin::ConnectionProperties,
) -> Result<lapin::Connection, ConnectError> {
    if !is_tls(uri) {
        return Ok(lapin::Connection::connect_uri(target, props).await?);
    }
    let (connector, params) = tls_connector(uri).map_err(ConnectError::Settings)?;
    if params.unchecked {
        tracing::warn!(
            uri = %redacted(uri),
            "connecting without checking the server's certificate (verify=verify_none)"
        );
    }
    let runtime = lapin::runtime::default_runtime()?;
    Ok(lapin::Connection::connector(
        target,
        runtime,
        async move |uri: AMQPUri, runtime| {
            let addrs = runtime.to_socket_addrs((uri.authority.host.clone(), uri.authority.port));
            let plain = lapin::tcp::AsyncTcpStream::connect(&runtime, addrs).await?;
            Ok(plain.into_rustls(&connector, &params.server_name).await?)
        },
        props,
    )
    .await?)
}

/// Why [`connect`] failed.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The URI's TLS settings: a file that does not read.
    #[error("{0}")]
    Settings(String),
    #[error(transparent)]
    Amqp(#[from] lapin::Error),
}

/// Whether `uri` reaches its broker over TLS.
pub fn is_tls(uri: &str) -> bool {
    split(uri).is_ok_and(|(scheme, _, _)| scheme == "amqps")
}

/// A URI as the status shows it: without its password.
pub fn redacted(uri: &str) -> String {
    let Ok((scheme, authority, rest)) = split(uri) else {
        return uri.to_owned();
    };
    match authority.rsplit_once('@') {
        Some((info, host)) => {
            let user = info.split(':').next().unwrap_or("");
            format!("{scheme}://{user}@{host}{rest}")
        }
        None => uri.to_owned(),
    }
}

/// A URI with no user or password at all (RabbitMQ's `amqp_uri:remove_credentials`, for the
/// `x-shovelled` header that travels with every message).
pub fn without_credentials(uri: &str) -> String {
    let Ok((scheme, authority, rest)) = split(uri) else {
        return uri.to_owned();
    };
    let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    format!("{scheme}://{host}{rest}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn local() -> Local {
        Local {
            addr: "127.0.0.1:5679".parse().expect("addr"),
            secret: "s".into(),
        }
    }

    #[test]
    fn an_empty_host_is_this_node() {
        assert!(is_local("amqp://"));
        assert!(is_local("amqp:///staging"));
        assert!(is_local("amqp://alice@/staging"));
        assert!(!is_local("amqp://localhost"));
        assert!(!is_local("amqp://u:p@[::1]:5672/%2f"));
        let t = target("amqp://", &local(), "billing").expect("local");
        assert_eq!(t.authority.userinfo.username, INTERNAL_USER);
        assert_eq!(t.authority.userinfo.password, "s");
        assert_eq!(
            (t.authority.host.as_str(), t.authority.port),
            ("127.0.0.1", 5679)
        );
        assert_eq!(t.vhost, "billing", "no path: the shovel's own vhost");
        assert_eq!(trusted_vhost("amqp:///v", "/").as_deref(), Some("v"));
        assert_eq!(trusted_vhost("amqp://alice:pw@/v", "/"), None);
        assert_eq!(trusted_vhost("amqp://h/v", "/"), None);
        let named = target("amqp://alice:pw@/v", &local(), "/").expect("local");
        assert_eq!(
            named.authority.userinfo.password, "pw",
            "a named user gets no secret"
        );
        let t = target("amqp://alice@/%2f", &local(), "billing").expect("local");
        assert_eq!(
            (t.authority.userinfo.username.as_str(), t.vhost.as_str()),
            ("alice", "/")
        );
        let r = target("amqp://u:p@rabbit.example:5673/v%2f1", &local(), "/").expect("remote");
        assert_eq!(r.authority.host, "rabbit.example");
        assert_eq!((r.authority.port, r.vhost.as_str()), (5673, "v/1"));
    }

    #[test]
    fn bad_uris_are_named() {
        assert!(check("amqp://").is_ok());
        assert!(check("amqp://guest:guest@localhost:5673/%2f?heartbeat=10").is_ok());
        assert_eq!(
            check("foo://x").unwrap_err(),
            "{{unexpected_uri_scheme,\"foo\"},\"foo://x\"}"
        );
        assert!(check("amqp://h:notaport").is_err());
        assert!(check("amqps://h").is_ok());
        assert!(check("amqps://u:p@h:5671/v?cacertfile=/ca.pem&verify=verify_peer").is_ok());
        assert!(check("amqps://").unwrap_err().contains("needs a host"));
        assert!(check("amqps://h?verify=verify_none").is_ok());
        assert!(check("amqps://h?verify=maybe")
            .unwrap_err()
            .contains("verify_peer"));
        assert!(check("amqps://h?certfile=/c.pem")
            .unwrap_err()
            .contains("go together"));
        assert!(check("amqps://h?server_name_indication=rabbit.example").is_ok());
        assert!(check("amqps://h?server_name_indication=not%20a%20name")
            .unwrap_err()
            .contains("not a host name"));
        assert!(check("amqp://u:p@[::1]:5672/%2f")
            .unwrap_err()
            .contains("IPv6"));
        assert_eq!(
            tls_params("amqps://h?cacertfile=%2Fetc%2Fca.pem&certfile=/c&keyfile=/k&depth=2"),
            Ok(TlsParams {
                cacertfile: Some("/etc/ca.pem".into()),
                identity: Some(("/c".into(), "/k".into())),
                unchecked: false,
                server_name: "h".into(),
                no_sni: false,
            })
        );
        let p = tls_params("amqps://h?verify=verify_none&server_name_indication=disable")
            .expect("params");
        assert!(p.unchecked && p.no_sni && p.server_name == "h");
        let p =
            tls_params("amqps://10.0.0.1?server_name_indication=rabbit.example").expect("params");
        assert_eq!(p.server_name, "rabbit.example");
        assert!(tls_connector("amqps://h?cacertfile=/nonexistent/ca.pem")
            .unwrap_err()
            .contains("cannot read cacertfile /nonexistent/ca.pem"));
        assert!(
            tls_connector("amqps://h?verify=verify_none").is_ok(),
            "no CA is needed when nothing is checked"
        );
        assert!(check("no scheme").is_err());
        assert_eq!(
            redacted("amqp://u:secret@h:1/v"),
            "amqp://u@h:1/v",
            "passwords stay out of the status"
        );
        assert_eq!(without_credentials("amqp://u:secret@h:1/v"), "amqp://h:1/v");
    }
}
