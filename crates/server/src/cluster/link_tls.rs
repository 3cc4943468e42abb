//! TLS on the links between cluster nodes (`--cluster-tls-cert`, `--cluster-tls-key`,
//! `--cluster-tls-ca`): TLS 1.3 both ways, each node presenting its certificate and checking the
//! other's against the cluster's CA (RabbitMQ's inter-node TLS with `verify_peer` and
//! `fail_if_no_peer_cert`), the dialer also checking that the certificate names the host it
//! dialed as `--cluster-nodes` writes it. The shared secret's handshake ([`super::auth`]) runs
//! inside it, so a node needs both a certificate from the CA and the secret.
//!
//! The files are read again when one of them changes (checked at each new connection: a
//! certificate renewed on disk, as cert-manager does, is used from the next link on; the links
//! already open keep theirs). Files that no longer read leave the last good configuration in
//! force and are logged.

use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, ServerConfig};

use crate::tls::{read_certs, read_key, read_roots};

/// The PEM files of a node's cluster TLS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterTlsFiles {
    /// This node's certificate chain.
    pub cert: PathBuf,
    /// Its private key.
    pub key: PathBuf,
    /// The CA that signs every node's certificate.
    pub ca: PathBuf,
}

impl ClusterTlsFiles {
    /// Whether the files make a usable configuration: the error names the option at fault.
    pub fn check(&self) -> Result<(), String> {
        build(self).map(|_| ())
    }

    /// What tells a changed file: its modification time, size and inode (a file replaced by
    /// a rename, or rewritten within one tick of a coarse clock).
    fn stamps(&self) -> [Option<Stamp>; 3] {
        let at = |p: &PathBuf| {
            let m = std::fs::metadata(p).ok()?;
            Some((m.modified().ok(), m.len(), m.ino()))
        };
        [at(&self.cert), at(&self.key), at(&self.ca)]
    }
}

/// The configurations both sides of a link use.
#[derive(Clone)]
pub(crate) struct Configs {
    pub(crate) dial: Arc<ClientConfig>,
    pub(crate) accept: Arc<ServerConfig>,
}

type Stamp = (Option<SystemTime>, u64, u64);

/// How often a new link looks at the files at most (a peer that is down is dialled every
/// second or so; the files need not be looked at each time).
const CHECK_EVERY: Duration = Duration::from_secs(1);
/// After files that did not make a configuration, how long until they are read again even
/// if they look unchanged (one caught half-written keeps its stamps once complete).
const RETRY_AFTER: Duration = Duration::from_secs(5);

struct Current {
    stamps: [Option<Stamp>; 3],
    configs: Configs,
    checked: Instant,
    /// The files last read did not make a configuration.
    failed: Option<Instant>,
}

/// A node's cluster TLS: what the files said when last read.
pub(crate) struct ClusterTls {
    files: ClusterTlsFiles,
    current: Mutex<Current>,
}

impl ClusterTls {
    /// Reads the files; the error names the option whose file is at fault.
    pub(crate) fn load(files: ClusterTlsFiles) -> Result<ClusterTls, String> {
        let stamps = files.stamps();
        let configs = build(&files)?;
        Ok(ClusterTls {
            files,
            current: Mutex::new(Current {
                stamps,
                configs,
                checked: Instant::now(),
                failed: None,
            }),
        })
    }

    /// The configurations for a new link, read again first if a file changed since.
    pub(crate) fn configs(&self) -> Configs {
        let mut cur = self
            .current
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let now = Instant::now();
        if now.duration_since(cur.checked) < CHECK_EVERY {
            return cur.configs.clone();
        }
        cur.checked = now;
        let stamps = self.files.stamps();
        let retry = cur
            .failed
            .is_some_and(|at| now.duration_since(at) >= RETRY_AFTER);
        if stamps != cur.stamps || retry {
            cur.stamps = stamps;
            match build(&self.files) {
                Ok(c) => {
                    tracing::info!("cluster TLS files read again");
                    cur.configs = c;
                    cur.failed = None;
                }
                Err(e) => {
                    if cur.failed.is_none() {
                        tracing::error!(error = %e, "cluster TLS files changed and cannot be used; the previous ones stay in force");
                    }
                    cur.failed = Some(now);
                }
            }
        }
        cur.configs.clone()
    }
}

fn build(files: &ClusterTlsFiles) -> Result<Configs, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let certs = read_certs(&files.cert, "--cluster-tls-cert")?;
    let key = read_key(&files.key, "--cluster-tls-key")?;
    let roots = Arc::new(read_roots(&files.ca, "--cluster-tls-ca")?);
    let versions: &[&rustls::SupportedProtocolVersion] = &[&rustls::version::TLS13];
    let setup = |e: rustls::Error| format!("cluster TLS setup failed: {e}");
    let mismatch = |e: rustls::Error| {
        format!(
            "the certificate {} (--cluster-tls-cert) and the key {} (--cluster-tls-key) cannot \
             be used together: {e}",
            files.cert.display(),
            files.key.display()
        )
    };
    let verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
        .build()
        .map_err(|e| {
            format!(
                "cannot use {} (--cluster-tls-ca) as trust roots: {e}",
                files.ca.display()
            )
        })?;
    let mut accept = ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(versions)
        .map_err(setup)?
        .with_client_cert_verifier(verifier)
        .with_single_cert(certs.clone(), key.clone_key())
        .map_err(mismatch)?;
    // Links are long-lived and never resumed: no session tickets to send or keep.
    accept.send_tls13_tickets = 0;
    accept.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
    let dial = ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(versions)
        .map_err(setup)?
        .with_root_certificates(roots)
        .with_client_auth_cert(certs, key)
        .map_err(mismatch)?;
    Ok(Configs {
        dial: Arc::new(dial),
        accept: Arc::new(accept),
    })
}

/// Whether `cert` (a peer's end-entity certificate, already checked against the CA) names
/// `host`, the peer's host in `--cluster-nodes`.
pub(crate) fn names_host(
    cert: &rustls_pki_types::CertificateDer<'_>,
    host: &str,
) -> Result<(), String> {
    let name = server_name(host)
        .map_err(|e| format!("`{host}` cannot be checked against a certificate: {e}"))?;
    let parsed = rustls::server::ParsedCertificate::try_from(cert).map_err(|e| e.to_string())?;
    rustls::client::verify_server_name(&parsed, &name)
        .map_err(|e| format!("its certificate does not name {host}: {e}"))
}

/// The rustls error inside an I/O error of a TLS stream, if that is what it is: a peer that
/// refused the handshake (an alert) or a certificate that did not check out, as opposed to a
/// connection that failed.
pub(crate) fn refusal(e: &std::io::Error) -> Option<String> {
    e.get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        .map(|r| r.to_string())
}

/// The name a dialer checks the peer's certificate against: the host of its address.
pub(crate) fn server_name(
    host: &str,
) -> Result<rustls_pki_types::ServerName<'static>, rustls_pki_types::InvalidDnsNameError> {
    rustls_pki_types::ServerName::try_from(host.to_owned())
}
