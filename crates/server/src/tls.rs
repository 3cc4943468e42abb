//! TLS for AMQP (amqps, RabbitMQ's port 5671) and the HTTP ports: rustls with the ring
//! provider, TLS 1.2 and 1.3, the certificate chain and key read from PEM files and read again
//! on SIGHUP (connections already open keep what they negotiated).
//!
//! Client certificates follow RabbitMQ's `ssl_options`: `--tls-verify none` asks for none
//! (`verify_none`), `optional` asks and checks one if sent (`verify_peer`), `required` refuses a
//! client without one (`verify_peer` + `fail_if_no_peer_cert = true`). A verified certificate
//! names a user for the EXTERNAL mechanism (RabbitMQ's `rabbitmq_auth_mechanism_ssl`, whose
//! `ssl_cert_login_from` setting `--tls-login-from` mirrors).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use rustls::server::WebPkiClientVerifier;
use rustls::ServerConfig;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use serde::Deserialize;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;
use warren_session::manage::TlsInfo;

/// Whether clients are asked for a certificate (RabbitMQ's `verify` and `fail_if_no_peer_cert`).
#[derive(clap::ValueEnum, Deserialize, Debug, Clone, Copy, Default, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Verify {
    /// No client certificate is asked for (`verify_none`).
    #[default]
    None,
    /// A client may send one; if it does, it must chain to --tls-ca (`verify_peer`).
    Optional,
    /// A client must send one that chains to --tls-ca (`verify_peer`, `fail_if_no_peer_cert`).
    Required,
}

/// Which part of a client certificate names the user for EXTERNAL (RabbitMQ's
/// `ssl_cert_login_from`).
#[derive(clap::ValueEnum, Deserialize, Debug, Clone, Copy, Default, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
// RabbitMQ's value names, shared suffix and all.
#[allow(clippy::enum_variant_names)]
pub enum LoginFrom {
    /// The subject's CN.
    #[default]
    CommonName,
    /// The whole subject as RabbitMQ writes it: `CN=app,O=Example,C=GB` (RFC 4514 order).
    DistinguishedName,
    /// The first DNS name among the subject alternative names, else the first e-mail address.
    SubjectAlternativeName,
}

/// Where the certificate, key and client trust roots are, and what to ask of clients.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: Option<PathBuf>,
    pub verify: Verify,
    pub login_from: LoginFrom,
}

/// The configurations in force: one for AMQP (client certificates as configured), one for HTTP
/// (no client certificates; ALPN http/1.1).
struct Loaded {
    amqp: Arc<ServerConfig>,
    http: Arc<ServerConfig>,
}

/// The server's TLS settings, shared by every listener; [`Tls::reload`] swaps them for new
/// connections.
#[derive(Clone)]
pub struct Tls {
    files: Arc<TlsFiles>,
    current: Arc<RwLock<Arc<Loaded>>>,
}

impl Tls {
    /// Reads the files; the error says which flag names the file at fault.
    pub fn load(files: TlsFiles) -> Result<Tls, String> {
        let loaded = build(&files)?;
        Ok(Tls {
            files: Arc::new(files),
            current: Arc::new(RwLock::new(Arc::new(loaded))),
        })
    }

    /// Reads the files again; on an error the configuration in force stays.
    pub fn reload(&self) -> Result<(), String> {
        let loaded = build(&self.files)?;
        *self
            .current
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = Arc::new(loaded);
        Ok(())
    }

    fn loaded(&self) -> Arc<Loaded> {
        self.current
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }

    pub fn amqp_acceptor(&self) -> TlsAcceptor {
        TlsAcceptor::from(self.loaded().amqp.clone())
    }

    pub fn http_acceptor(&self) -> TlsAcceptor {
        TlsAcceptor::from(self.loaded().http.clone())
    }

    pub fn files(&self) -> &TlsFiles {
        &self.files
    }

    /// The user name a verified client certificate gives EXTERNAL, if the client sent one and
    /// the chosen part of it holds a name.
    pub fn external_identity(&self, stream: &TlsStream<TcpStream>) -> Option<String> {
        if self.files.verify == Verify::None {
            return None;
        }
        // rustls only completes a handshake with a certificate its verifier accepted.
        let cert = stream.get_ref().1.peer_certificates()?.first()?;
        login_name(cert.as_ref(), self.files.login_from)
    }

    /// What the management API shows of a TLS connection, as RabbitMQ words it.
    pub fn info(&self, stream: &TlsStream<TcpStream>) -> TlsInfo {
        let session = stream.get_ref().1;
        let protocol = match session.protocol_version() {
            Some(rustls::ProtocolVersion::TLSv1_3) => "tlsv1.3",
            Some(rustls::ProtocolVersion::TLSv1_2) => "tlsv1.2",
            _ => "unknown",
        };
        let (key_exchange, cipher) = session
            .negotiated_cipher_suite()
            .and_then(|s| s.suite().as_str())
            .map(suite_parts)
            .unwrap_or_default();
        let cert = session
            .peer_certificates()
            .and_then(|c| c.first())
            .and_then(|c| {
                x509_parser::parse_x509_certificate(c.as_ref())
                    .ok()
                    .map(|(_, c)| c)
            });
        TlsInfo {
            protocol: protocol.to_owned(),
            key_exchange,
            cipher,
            // Every suite rustls offers is an AEAD one (Erlang's `mac` is then `aead`).
            hash: "aead".to_owned(),
            peer_cert_subject: cert.as_ref().and_then(|c| distinguished_name(c.subject())),
            peer_cert_issuer: cert.as_ref().and_then(|c| distinguished_name(c.issuer())),
            peer_cert_validity: cert.as_ref().map(|c| {
                let v = c.validity();
                format!("{} - {}", v.not_before, v.not_after)
            }),
            external: self.external_identity(stream),
        }
    }
}

fn build(files: &TlsFiles) -> Result<Loaded, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let certs = read_certs(&files.cert, "--tls-cert")?;
    let key = read_key(&files.key, "--tls-key")?;
    let versions: &[&rustls::SupportedProtocolVersion] =
        &[&rustls::version::TLS13, &rustls::version::TLS12];
    let builder = || {
        ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(versions)
            .map_err(|e| format!("TLS setup failed: {e}"))
    };
    let amqp_verifier = match files.verify {
        Verify::None => None,
        Verify::Optional | Verify::Required => {
            let Some(ca) = &files.ca else {
                return Err(format!(
                    "--tls-verify {} needs the CA that signs client certificates: give it with \
                     --tls-ca FILE",
                    if files.verify == Verify::Optional {
                        "optional"
                    } else {
                        "required"
                    }
                ));
            };
            let roots = read_roots(ca, "--tls-ca")?;
            let v = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone());
            let v = if files.verify == Verify::Optional {
                v.allow_unauthenticated()
            } else {
                v
            };
            Some(v.build().map_err(|e| {
                format!("cannot use {} (--tls-ca) as trust roots: {e}", ca.display())
            })?)
        }
    };
    let mismatch = |e: rustls::Error| {
        format!(
            "the certificate {} (--tls-cert) and the key {} (--tls-key) cannot be used together: {e}",
            files.cert.display(),
            files.key.display()
        )
    };
    let amqp = match amqp_verifier {
        Some(v) => builder()?.with_client_cert_verifier(v),
        None => builder()?.with_no_client_auth(),
    }
    .with_single_cert(certs.clone(), key.clone_key())
    .map_err(mismatch)?;
    let mut http = builder()?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(mismatch)?;
    http.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Loaded {
        amqp: Arc::new(amqp),
        http: Arc::new(http),
    })
}

/// The private key in a PEM file; the error names `flag`, the option that gave the file.
pub(crate) fn read_key(path: &Path, flag: &str) -> Result<PrivateKeyDer<'static>, String> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| {
        format!(
            "cannot read the TLS private key {} ({flag}): {}; give a PEM file with one \
             PKCS#8, PKCS#1 or SEC1 key",
            path.display(),
            pem_error(&e)
        )
    })
}

/// Trust roots: every certificate of a PEM file; the error names `flag`.
pub(crate) fn read_roots(path: &Path, flag: &str) -> Result<rustls::RootCertStore, String> {
    let mut roots = rustls::RootCertStore::empty();
    for c in read_certs(path, flag)? {
        roots.add(c).map_err(|e| {
            format!(
                "a certificate in {} ({flag}) is not usable: {e}",
                path.display()
            )
        })?;
    }
    Ok(roots)
}

/// The certificates in a PEM file, at least one; the error names `flag`.
pub(crate) fn read_certs(path: &Path, flag: &str) -> Result<Vec<CertificateDer<'static>>, String> {
    let what = |e: &rustls_pki_types::pem::Error| {
        format!(
            "cannot read the certificates in {} ({flag}): {}",
            path.display(),
            pem_error(e)
        )
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| what(&e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| what(&e))?;
    if certs.is_empty() {
        return Err(format!(
            "no certificate in {} ({flag}): give a PEM file with BEGIN CERTIFICATE blocks",
            path.display()
        ));
    }
    Ok(certs)
}

fn pem_error(e: &rustls_pki_types::pem::Error) -> String {
    match e {
        rustls_pki_types::pem::Error::Io(io) => io.to_string(),
        rustls_pki_types::pem::Error::NoItemsFound => "no PEM item of that kind in it".into(),
        other => format!("{other:?}"),
    }
}

/// The user name in a certificate (DER), as RabbitMQ's `ssl_cert_login_from` picks it.
pub fn login_name(der: &[u8], from: LoginFrom) -> Option<String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    match from {
        LoginFrom::CommonName => cert
            .subject()
            .iter_common_name()
            .next()
            .and_then(|cn| cn.as_str().ok())
            .map(str::to_owned),
        LoginFrom::DistinguishedName => distinguished_name(cert.subject()),
        LoginFrom::SubjectAlternativeName => {
            let san = cert.subject_alternative_name().ok()??;
            let names = &san.value.general_names;
            let dns = names.iter().find_map(|n| match n {
                x509_parser::extensions::GeneralName::DNSName(d) => Some(*d),
                _ => None,
            });
            let email = || {
                names.iter().find_map(|n| match n {
                    x509_parser::extensions::GeneralName::RFC822Name(m) => Some(*m),
                    _ => None,
                })
            };
            dns.or_else(email).map(str::to_owned)
        }
    }
}

/// A name as RabbitMQ writes it: `CN=app,O=Example,C=GB` (RFC 4514, the last RDN first).
fn distinguished_name(name: &x509_parser::x509::X509Name<'_>) -> Option<String> {
    let registry = x509_parser::objects::oid_registry();
    let mut rdns = Vec::new();
    for rdn in name.iter_rdn() {
        let mut parts = Vec::new();
        for attr in rdn.iter() {
            let key = x509_parser::objects::oid2abbrev(attr.attr_type(), registry)
                .map(str::to_owned)
                .unwrap_or_else(|_| attr.attr_type().to_id_string());
            let value = attr.as_str().ok()?;
            parts.push(format!("{key}={}", escape_dn_value(value)));
        }
        rdns.push(parts.join("+"));
    }
    rdns.reverse();
    Some(rdns.join(","))
}

/// Erlang's key exchange and cipher names from a rustls suite name:
/// `TLS13_AES_256_GCM_SHA384` is (`any`, `aes_256_gcm`),
/// `TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256` is (`ecdhe_rsa`, `aes_128_gcm`).
fn suite_parts(name: &str) -> (String, String) {
    let lower = name.to_ascii_lowercase();
    let (kx, rest) = match lower.strip_prefix("tls13_") {
        Some(rest) => ("any".to_owned(), rest.to_owned()),
        None => {
            let rest = lower.strip_prefix("tls_").unwrap_or(&lower);
            match rest.split_once("_with_") {
                Some((kx, cipher)) => (kx.to_owned(), cipher.to_owned()),
                None => (String::new(), rest.to_owned()),
            }
        }
    };
    let cipher = rest
        .strip_suffix("_sha256")
        .or_else(|| rest.strip_suffix("_sha384"))
        .unwrap_or(&rest)
        .to_owned();
    (kx, cipher)
}

/// RFC 4514 escaping of an attribute value.
fn escape_dn_value(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for (i, ch) in v.chars().enumerate() {
        let special = matches!(ch, ',' | '+' | '"' | '\\' | '<' | '>' | ';')
            || (i == 0 && (ch == '#' || ch == ' '))
            || (i + 1 == v.chars().count() && ch == ' ');
        if special {
            out.push('\\');
        }
        out.push(ch);
    }
    out
}

/// How long an HTTPS client has to finish its TLS handshake.
const HTTP_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Handshakes finished and not yet taken by the HTTP server.
const HTTP_ACCEPT_QUEUE: usize = 64;

/// An HTTPS listener for axum: a task accepts TCP connections and runs each TLS handshake in a
/// task of its own (a slow client delays no other), handing finished ones over.
pub struct HttpsListener {
    local: SocketAddr,
    ready: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
}

impl HttpsListener {
    pub fn new(listener: TcpListener, tls: Tls, what: &'static str) -> std::io::Result<Self> {
        let local = listener.local_addr()?;
        let (tx, ready) = mpsc::channel(HTTP_ACCEPT_QUEUE);
        tokio::spawn(async move {
            loop {
                let (stream, peer) = match listener.accept().await {
                    Ok(a) => a,
                    Err(e) => {
                        tracing::warn!(error = %e, what, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                if tx.is_closed() {
                    return;
                }
                let acceptor = tls.http_acceptor();
                let tx = tx.clone();
                tokio::spawn(async move {
                    match tokio::time::timeout(HTTP_HANDSHAKE_TIMEOUT, acceptor.accept(stream))
                        .await
                    {
                        Ok(Ok(s)) => {
                            let _ = tx.send((s, peer)).await;
                        }
                        Ok(Err(e)) => {
                            tracing::debug!(%peer, error = %e, what, "TLS handshake failed")
                        }
                        Err(_) => tracing::debug!(%peer, what, "TLS handshake timed out"),
                    }
                });
            }
        });
        Ok(HttpsListener { local, ready })
    }
}

impl axum::serve::Listener for HttpsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(s) => s,
            // The accepting task is gone (it never returns while this end lives).
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn client_cert() -> Vec<u8> {
        use rcgen::{CertificateParams, DistinguishedName, DnType, KeyPair, SanType};
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name = DistinguishedName::new();
        params.distinguished_name.push(DnType::CountryName, "GB");
        params
            .distinguished_name
            .push(DnType::OrganizationName, "Example, Ltd");
        params.distinguished_name.push(DnType::CommonName, "app");
        params.subject_alt_names = vec![
            SanType::Rfc822Name("ops@example.com".try_into().unwrap()),
            SanType::DnsName("app.example.com".try_into().unwrap()),
        ];
        let key = KeyPair::generate().unwrap();
        params.self_signed(&key).unwrap().der().to_vec()
    }

    #[test]
    fn suites_in_erlang_words() {
        assert_eq!(
            suite_parts("TLS13_AES_256_GCM_SHA384"),
            ("any".into(), "aes_256_gcm".into())
        );
        assert_eq!(
            suite_parts("TLS13_CHACHA20_POLY1305_SHA256"),
            ("any".into(), "chacha20_poly1305".into())
        );
        assert_eq!(
            suite_parts("TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256"),
            ("ecdhe_rsa".into(), "aes_128_gcm".into())
        );
    }

    #[test]
    fn login_names_as_rabbitmq_takes_them() {
        let der = client_cert();
        assert_eq!(
            login_name(&der, LoginFrom::CommonName).as_deref(),
            Some("app")
        );
        assert_eq!(
            login_name(&der, LoginFrom::DistinguishedName).as_deref(),
            Some("CN=app,O=Example\\, Ltd,C=GB")
        );
        assert_eq!(
            login_name(&der, LoginFrom::SubjectAlternativeName).as_deref(),
            Some("app.example.com")
        );
        assert_eq!(
            login_name(b"not a certificate", LoginFrom::CommonName),
            None
        );
    }

    #[test]
    fn dn_values_are_escaped() {
        assert_eq!(escape_dn_value("a,b"), "a\\,b");
        assert_eq!(escape_dn_value(" x "), "\\ x\\ ");
        assert_eq!(escape_dn_value("plain"), "plain");
    }
}
