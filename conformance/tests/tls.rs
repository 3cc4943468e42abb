//! amqps and HTTPS: the broker serves TLS 1.2 and 1.3 with a certificate from PEM files,
//! reloads it on SIGHUP, checks client certificates (`--tls-verify`, `--tls-ca`) and logs a
//! client in by its certificate with EXTERNAL (RabbitMQ's `rabbitmq_auth_mechanism_ssl`).
//!
//! Every key and certificate is made here, at test time, with rcgen: a test CA, a server
//! certificate for 127.0.0.1/localhost, client certificates, and a second CA nobody trusts.
//!
//! lapin and the raw client reach the broker through a TLS tunnel made here with tokio-rustls:
//! they speak plain AMQP to a local port, and the tunnel carries it over TLS with the protocol
//! version and client certificate the test chooses (lapin's own TLS cannot pick a version).
//! A shovel's `amqps://` source uses lapin's own TLS (rustls with ring). pika and amqplib speak
//! TLS themselves (`clients/tls_flows.py`, `clients/tls_flows.js`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use amq_protocol::protocol::{connection, AMQPClass};
use lapin::options::{BasicPublishOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::BasicProperties;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsConnector;
use warren_conformance::raw::{Handshake, Raw};
use warren_conformance::{within, TestBroker, WAIT};

// ---------------------------------------------------------------------------------------------
// Certificates

/// A CA that signs certificates, kept as params + key (rcgen's issuer).
struct Ca {
    cert_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl Ca {
    fn new(name: &str) -> Ca {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        Ca {
            cert_pem: cert.pem(),
            issuer: Issuer::new(params, key),
        }
    }

    /// A server certificate for 127.0.0.1 and localhost; `cn` tells reloads apart.
    fn server(&self, cn: &str) -> (String, String) {
        self.server_for(cn, &["localhost", "127.0.0.1"])
    }

    /// A server certificate for these names only.
    fn server_for(&self, cn: &str, names: &[&str]) -> (String, String) {
        let mut params =
            CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
                .unwrap();
        params.distinguished_name.push(DnType::CommonName, cn);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    /// A client certificate with subject `CN=<cn>,O=Warren tests` and the given SANs.
    fn client(&self, cn: &str, sans: Vec<SanType>) -> (String, String) {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        // rcgen's default subject holds a CN already; start empty to choose the order
        // (the most general first, as CAs issue them).
        params.distinguished_name = DistinguishedName::new();
        params
            .distinguished_name
            .push(DnType::OrganizationName, "Warren tests");
        params.distinguished_name.push(DnType::CommonName, cn);
        params.subject_alt_names = sans;
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    }
}

/// A directory of PEM files for one test, removed at the end.
struct Pki {
    dir: PathBuf,
    ca: Ca,
}

impl Pki {
    fn new(test: &str) -> Pki {
        let dir = std::env::temp_dir().join(format!(
            "warren-tls-{test}-{}-{}",
            std::process::id(),
            Instant::now().elapsed().as_nanos()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let ca = Ca::new("Warren test CA");
        let pki = Pki { dir, ca };
        pki.write("ca.pem", &pki.ca.cert_pem);
        let (cert, key) = pki.ca.server("warren-server-1");
        pki.write("server.pem", &cert);
        pki.write("server.key", &key);
        pki
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    fn write(&self, name: &str, text: &str) -> PathBuf {
        let p = self.path(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    fn arg(&self, name: &str) -> String {
        self.path(name).display().to_string()
    }

    /// The broker flags for amqps on a free port, plus `extra`.
    fn broker(&self, extra: &[&str]) -> (TestBroker, u16) {
        let port = free_port();
        let mut args = vec![
            "--tls-cert".to_string(),
            self.arg("server.pem"),
            "--tls-key".to_string(),
            self.arg("server.key"),
            "--tls-port".to_string(),
            port.to_string(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let broker = TestBroker::start_with(&args);
        (broker, port)
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn certs(pem: &str) -> Vec<CertificateDer<'static>> {
    CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<_, _>>()
        .unwrap()
}

// ---------------------------------------------------------------------------------------------
// A TLS client

#[derive(Clone, Copy, Debug, PartialEq)]
enum Version {
    Tls12,
    Tls13,
}

/// A client configuration trusting `ca_pem`, speaking only `version`, presenting `identity`.
fn client_config(
    ca_pem: &str,
    version: Version,
    identity: Option<(&str, &str)>,
) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    for c in certs(ca_pem) {
        roots.add(c).unwrap();
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let versions: &[&rustls::SupportedProtocolVersion] = match version {
        Version::Tls12 => &[&rustls::version::TLS12],
        Version::Tls13 => &[&rustls::version::TLS13],
    };
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(versions)
        .unwrap()
        .with_root_certificates(roots);
    let config = match identity {
        Some((cert, key)) => builder
            .with_client_auth_cert(
                certs(cert),
                PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap(),
            )
            .unwrap(),
        None => builder.with_no_client_auth(),
    };
    Arc::new(config)
}

type TlsClient = tokio_rustls::client::TlsStream<TcpStream>;

async fn tls_connect(port: u16, config: Arc<rustls::ClientConfig>) -> std::io::Result<TlsClient> {
    let tcp = TcpStream::connect(("127.0.0.1", port)).await?;
    let name = ServerName::try_from("127.0.0.1").unwrap();
    TlsConnector::from(config).connect(name, tcp).await
}

/// The CN of the certificate the server presented.
fn server_cn(stream: &TlsClient) -> String {
    let cert = stream.get_ref().1.peer_certificates().unwrap()[0].clone();
    let (_, parsed) = x509_cn(cert.as_ref());
    parsed
}

/// A tiny DER walk for the test's own certificates: the last CN (OID 2.5.4.3) string in the
/// certificate is the subject's (the issuer's comes first).
fn x509_cn(der: &[u8]) -> ((), String) {
    const CN_OID: [u8; 5] = [0x06, 0x03, 0x55, 0x04, 0x03];
    let mut last = String::new();
    let mut i = 0;
    while i + CN_OID.len() + 2 <= der.len() {
        if der[i..i + CN_OID.len()] == CN_OID {
            let len = der[i + CN_OID.len() + 1] as usize;
            let start = i + CN_OID.len() + 2;
            if let Some(v) = der.get(start..start + len) {
                last = String::from_utf8_lossy(v).into_owned();
            }
        }
        i += 1;
    }
    ((), last)
}

/// A plain local port whose connections are carried over TLS to the broker's amqps port.
struct Tunnel {
    addr: SocketAddr,
}

impl Tunnel {
    async fn start(port: u16, config: Arc<rustls::ClientConfig>) -> Tunnel {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut plain, _)) = listener.accept().await {
                let config = config.clone();
                tokio::spawn(async move {
                    let Ok(mut tls) = tls_connect(port, config).await else {
                        return;
                    };
                    let _ = tokio::io::copy_bidirectional(&mut plain, &mut tls).await;
                });
            }
        });
        Tunnel { addr }
    }

    fn url(&self) -> String {
        format!("amqp://guest:guest@{}/%2f", self.addr)
    }
}

/// Sends the AMQP header over an established TLS stream and reads connection.start's first
/// bytes: Ok if the broker answered, Err if the stream failed or ended first.
async fn amqp_hello(stream: &mut TlsClient) -> std::io::Result<()> {
    stream.write_all(b"AMQP\x00\x00\x09\x01").await?;
    stream.flush().await?;
    let mut buf = [0u8; 7];
    tokio::time::timeout(WAIT, stream.read_exact(&mut buf))
        .await
        .map_err(|_| std::io::Error::other("no answer"))??;
    // A method frame on channel 0: connection.start.
    assert_eq!(buf[0], 1, "expected a method frame, got {buf:?}");
    Ok(())
}

async fn wait_for_output(broker: &TestBroker, needle: &str) {
    let deadline = Instant::now() + WAIT;
    while !broker.output().contains(needle) {
        assert!(
            Instant::now() < deadline,
            "the broker never logged {needle:?}; its output:\n{}",
            broker.output()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

// ---------------------------------------------------------------------------------------------
// AMQP over TLS with lapin

async fn lapin_round_trip(version: Version) {
    let pki = Pki::new("lapin");
    let (broker, port) = pki.broker(&[]);
    if broker.is_external() {
        return;
    }
    // The handshake itself, and which version it agreed on.
    let config = client_config(&pki.ca.cert_pem, version, None);
    let stream = within("TLS handshake", tls_connect(port, config.clone()))
        .await
        .expect("TLS handshake");
    let negotiated = stream.get_ref().1.protocol_version().unwrap();
    assert_eq!(
        negotiated,
        match version {
            Version::Tls12 => rustls::ProtocolVersion::TLSv1_2,
            Version::Tls13 => rustls::ProtocolVersion::TLSv1_3,
        }
    );
    drop(stream);
    let tunnel = Tunnel::start(port, config).await;
    let conn = within(
        "lapin connect",
        lapin::Connection::connect(&tunnel.url(), lapin::ConnectionProperties::default()),
    )
    .await
    .expect("lapin over TLS");
    let ch = conn.create_channel().await.unwrap();
    let q = ch
        .queue_declare(
            "tls-q".into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    assert_eq!(q.message_count(), 0);
    // Bodies larger than one TLS record (16 KiB) and than one frame.
    let body = vec![7u8; 300_000];
    for _ in 0..20 {
        ch.basic_publish(
            "".into(),
            "tls-q".into(),
            BasicPublishOptions::default(),
            &body,
            BasicProperties::default(),
        )
        .await
        .unwrap();
    }
    for _ in 0..20 {
        let got = within("basic.get", async {
            loop {
                if let Some(m) = ch
                    .basic_get(
                        "tls-q".into(),
                        lapin::options::BasicGetOptions { no_ack: true },
                    )
                    .await
                    .unwrap()
                {
                    return m;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        assert_eq!(got.delivery.data, body);
    }
    conn.close(200, "bye".into()).await.unwrap();
}

#[tokio::test]
async fn lapin_over_tls_1_2() {
    lapin_round_trip(Version::Tls12).await;
}

#[tokio::test]
async fn lapin_over_tls_1_3() {
    lapin_round_trip(Version::Tls13).await;
}

#[tokio::test]
async fn plain_port_still_serves_beside_amqps() {
    let pki = Pki::new("plain");
    let (broker, _) = pki.broker(&[]);
    let conn = broker.connect().await;
    conn.close(200, "bye".into()).await.unwrap();
}

// ---------------------------------------------------------------------------------------------
// Client certificates and EXTERNAL

fn mechanisms(raw: &Raw) -> String {
    raw.start
        .as_ref()
        .map(|s| s.mechanisms.to_string())
        .unwrap_or_default()
}

async fn start_over(tunnel: &Tunnel) -> Raw {
    let mut raw = Raw::tcp(tunnel.addr).await;
    raw.send_bytes(b"AMQP\x00\x00\x09\x01").await;
    raw.expect_start().await;
    raw
}

#[tokio::test]
async fn external_login_with_a_client_certificate() {
    let pki = Pki::new("external");
    let (cert, key) = pki.ca.client("guest", vec![]);
    let (broker, port) = pki.broker(&["--tls-ca", &pki.arg("ca.pem"), "--tls-verify", "optional"]);
    if broker.is_external() {
        return;
    }
    // With a verified certificate: EXTERNAL is offered and logs in as the CN, no password.
    let with_cert = Tunnel::start(
        port,
        client_config(&pki.ca.cert_pem, Version::Tls13, Some((&cert, &key))),
    )
    .await;
    let mut raw = start_over(&with_cert).await;
    assert!(
        mechanisms(&raw).split(' ').any(|m| m == "EXTERNAL"),
        "{}",
        mechanisms(&raw)
    );
    let hs = Handshake {
        mechanism: "EXTERNAL".into(),
        response: Vec::new(),
        ..Handshake::default()
    };
    raw.send_start_ok(&hs).await;
    match raw.recv_method().await {
        (0, AMQPClass::Connection(connection::AMQPMethod::Tune(_))) => {}
        other => panic!("EXTERNAL with a good certificate: expected tune, got {other:?}"),
    }
    // Without one (optional): not offered, and refused as an unknown mechanism if tried.
    let without = Tunnel::start(port, client_config(&pki.ca.cert_pem, Version::Tls13, None)).await;
    let mut raw = start_over(&without).await;
    assert_eq!(mechanisms(&raw), "PLAIN AMQPLAIN");
    raw.send_start_ok(&hs).await;
    raw.expect_connection_close(
        503,
        "COMMAND_INVALID - unknown authentication mechanism 'EXTERNAL'",
        10,
        11,
    )
    .await;
    // PLAIN still works on a TLS connection without a certificate.
    let conn = lapin::Connection::connect(&without.url(), lapin::ConnectionProperties::default())
        .await
        .expect("PLAIN over TLS");
    conn.close(200, "bye".into()).await.unwrap();
    // The plain port never offers EXTERNAL.
    let mut raw = Raw::tcp(broker.addr()).await;
    raw.send_bytes(b"AMQP\x00\x00\x09\x01").await;
    raw.expect_start().await;
    assert_eq!(mechanisms(&raw), "PLAIN AMQPLAIN");
}

#[tokio::test]
async fn external_refuses_a_certificate_naming_no_user() {
    let pki = Pki::new("external-nouser");
    let (cert, key) = pki.ca.client("nobody", vec![]);
    let (broker, port) = pki.broker(&["--tls-ca", &pki.arg("ca.pem"), "--tls-verify", "required"]);
    if broker.is_external() {
        return;
    }
    let tunnel = Tunnel::start(
        port,
        client_config(&pki.ca.cert_pem, Version::Tls12, Some((&cert, &key))),
    )
    .await;
    let mut raw = start_over(&tunnel).await;
    let hs = Handshake {
        mechanism: "EXTERNAL".into(),
        response: Vec::new(),
        ..Handshake::default()
    };
    raw.send_start_ok(&hs).await;
    raw.expect_connection_close(
        403,
        "ACCESS_REFUSED - Login was refused using authentication mechanism EXTERNAL. For details see the broker logfile.",
        0,
        0,
    )
    .await;
}

#[tokio::test]
async fn external_user_from_the_subject_alternative_name_or_the_whole_subject() {
    let pki = Pki::new("external-san");
    // The users: the SAN's DNS name, the DN as RabbitMQ writes it, and one for the API.
    pki.write(
        "users.toml",
        "[[users]]\nname = \"admin\"\npassword = \"admin\"\ntags = [\"administrator\"]\n\
         [[users]]\nname = \"svc.example.com\"\npassword = \"x\"\n\
         [[users]]\nname = \"CN=dn-user,O=Warren tests\"\npassword = \"x\"\n",
    );
    let (cert, key) = pki.ca.client(
        "dn-user",
        vec![
            SanType::Rfc822Name("ops@example.com".try_into().unwrap()),
            SanType::DnsName("svc.example.com".try_into().unwrap()),
        ],
    );
    for (from, user) in [
        ("subject_alternative_name", "svc.example.com"),
        ("distinguished_name", "CN=dn-user,O=Warren tests"),
    ] {
        let (broker, port) = pki.broker(&[
            "--tls-ca",
            &pki.arg("ca.pem"),
            "--tls-verify",
            "required",
            "--tls-login-from",
            from,
            "--config",
            &pki.arg("users.toml"),
        ]);
        if broker.is_external() {
            return;
        }
        let tunnel = Tunnel::start(
            port,
            client_config(&pki.ca.cert_pem, Version::Tls13, Some((&cert, &key))),
        )
        .await;
        let mut raw = start_over(&tunnel).await;
        let hs = Handshake {
            mechanism: "EXTERNAL".into(),
            response: Vec::new(),
            ..Handshake::default()
        };
        raw.send_start_ok(&hs).await;
        match raw.recv_method().await {
            (0, AMQPClass::Connection(connection::AMQPMethod::Tune(_))) => {}
            other => panic!(
                "--tls-login-from {from}: expected tune, got {other:?}; the broker said:\n{}",
                broker.output()
            ),
        }
        raw.send_tune_ok(0, 131_072, 0).await;
        raw.send(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
                virtual_host: "/".into(),
            })),
        )
        .await;
        match raw.recv_method().await {
            (0, AMQPClass::Connection(connection::AMQPMethod::OpenOk(_))) => {}
            other => panic!("expected open-ok, got {other:?}"),
        }
        // The management API names the connection's user.
        let http = broker.http_url().unwrap().to_string();
        let deadline = Instant::now() + WAIT;
        loop {
            let conns = warren_conformance::http::request(
                "GET",
                &format!("{http}/api/connections"),
                Some(("admin", "admin")),
                &[],
                None,
            )
            .text();
            if conns.contains(user) {
                // And shows it as TLS, as RabbitMQ does: protocol, cipher, the certificate.
                let all: serde_json::Value = serde_json::from_str(&conns).expect("JSON");
                let c = all
                    .as_array()
                    .and_then(|a| a.iter().find(|c| c["user"] == user))
                    .expect("the connection");
                assert_eq!(c["ssl"], true, "{c}");
                assert_eq!(c["ssl_protocol"], "tlsv1.3", "{c}");
                assert_eq!(c["ssl_key_exchange"], "any", "{c}");
                assert!(
                    c["ssl_cipher"].as_str().is_some_and(|s| !s.is_empty()),
                    "{c}"
                );
                assert_eq!(c["auth_mechanism"], "EXTERNAL", "{c}");
                assert_eq!(c["peer_cert_subject"], "CN=dn-user,O=Warren tests", "{c}");
                assert!(
                    c["peer_cert_issuer"]
                        .as_str()
                        .is_some_and(|s| s.starts_with("CN=")),
                    "{c}"
                );
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{from}: no connection of {user}: {conns}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

#[tokio::test]
async fn required_client_certificate_refuses_a_client_without_one() {
    let pki = Pki::new("required");
    let (broker, port) = pki.broker(&["--tls-ca", &pki.arg("ca.pem"), "--tls-verify", "required"]);
    if broker.is_external() {
        return;
    }
    for version in [Version::Tls12, Version::Tls13] {
        let config = client_config(&pki.ca.cert_pem, version, None);
        // TLS 1.2 fails in the handshake; with 1.3 the client finishes first and learns of the
        // refusal on its first read.
        let outcome = match tls_connect(port, config).await {
            Err(e) => Err(e),
            Ok(mut s) => amqp_hello(&mut s).await,
        };
        assert!(
            outcome.is_err(),
            "{version:?}: a client without a certificate got in"
        );
    }
    wait_for_output(&broker, "TLS handshake failed").await;
}

#[tokio::test]
async fn a_client_certificate_from_an_unknown_ca_is_refused() {
    let pki = Pki::new("unknown-ca");
    let stranger = Ca::new("Somebody else's CA");
    let (cert, key) = stranger.client("guest", vec![]);
    // optional: a certificate that is sent must still verify.
    let (broker, port) = pki.broker(&["--tls-ca", &pki.arg("ca.pem"), "--tls-verify", "optional"]);
    if broker.is_external() {
        return;
    }
    for version in [Version::Tls12, Version::Tls13] {
        let config = client_config(&pki.ca.cert_pem, version, Some((&cert, &key)));
        let outcome = match tls_connect(port, config).await {
            Err(e) => Err(e),
            Ok(mut s) => amqp_hello(&mut s).await,
        };
        assert!(
            outcome.is_err(),
            "{version:?}: a certificate of an unknown CA got in"
        );
    }
    // The same client with a certificate of the trusted CA gets in.
    let (cert, key) = pki.ca.client("guest", vec![]);
    let mut s = tls_connect(
        port,
        client_config(&pki.ca.cert_pem, Version::Tls13, Some((&cert, &key))),
    )
    .await
    .unwrap();
    amqp_hello(&mut s).await.unwrap();
}

// ---------------------------------------------------------------------------------------------
// Reload, startup errors

#[tokio::test]
async fn sighup_reloads_the_certificate_for_new_connections() {
    let pki = Pki::new("reload");
    let (broker, port) = pki.broker(&[]);
    if broker.is_external() {
        return;
    }
    let config = client_config(&pki.ca.cert_pem, Version::Tls13, None);
    let mut before = tls_connect(port, config.clone()).await.unwrap();
    assert_eq!(server_cn(&before), "warren-server-1");
    amqp_hello(&mut before).await.unwrap();

    // A bad new file: the old certificate stays, and the log says so.
    pki.write("server.pem", "not a certificate\n");
    let pid = broker.pid().unwrap() as libc::pid_t;
    assert_eq!(unsafe { libc::kill(pid, libc::SIGHUP) }, 0);
    wait_for_output(&broker, "TLS reload failed").await;
    let s = tls_connect(port, config.clone()).await.unwrap();
    assert_eq!(server_cn(&s), "warren-server-1");

    // A good one: new connections get it; the connection opened before is still served.
    let (cert, key) = pki.ca.server("warren-server-2");
    pki.write("server.pem", &cert);
    pki.write("server.key", &key);
    assert_eq!(unsafe { libc::kill(pid, libc::SIGHUP) }, 0);
    wait_for_output(&broker, "TLS certificate and key reloaded").await;
    let s = tls_connect(port, config.clone()).await.unwrap();
    assert_eq!(server_cn(&s), "warren-server-2");
    assert_eq!(server_cn(&before), "warren-server-1");
    // connection.start arrived on `before`; a start-ok goes through on the old session.
    let mut rest = [0u8; 64];
    let _ = tokio::time::timeout(Duration::from_millis(200), before.read(&mut rest)).await;
    let tunnel = Tunnel::start(port, config).await;
    let conn = lapin::Connection::connect(&tunnel.url(), lapin::ConnectionProperties::default())
        .await
        .expect("AMQP after the reload");
    conn.close(200, "bye".into()).await.unwrap();
}

fn warren() -> Command {
    Command::new(warren_conformance::warren_binary())
}

fn start_fails(args: &[&str]) -> String {
    let dir = std::env::temp_dir().join(format!("warren-tls-fail-{}", std::process::id()));
    let out = warren()
        .args([
            "--bind",
            "127.0.0.1",
            "--no-management",
            "--no-prometheus",
            "--no-sqs",
        ])
        .args(["--port", &free_port().to_string()])
        .arg("--data-dir")
        .arg(&dir)
        .args(args)
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(!out.status.success(), "warren started with {args:?}");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn startup_errors_name_the_flag_to_fix() {
    let pki = Pki::new("startup");
    let missing = pki.dir.join("missing.pem").display().to_string();
    let e = start_fails(&["--tls-cert", &missing, "--tls-key", &pki.arg("server.key")]);
    assert!(e.contains("--tls-cert") && e.contains("missing.pem"), "{e}");
    let e = start_fails(&["--tls-cert", &pki.arg("server.pem"), "--tls-key", &missing]);
    assert!(e.contains("--tls-key"), "{e}");
    let e = start_fails(&["--tls-cert", &pki.arg("server.pem")]);
    assert!(e.contains("--tls-key"), "{e}");
    let e = start_fails(&[
        "--tls-cert",
        &pki.arg("server.pem"),
        "--tls-key",
        &pki.arg("server.key"),
        "--tls-verify",
        "required",
    ]);
    assert!(e.contains("--tls-ca"), "{e}");
    // A busy amqps port names --tls-port.
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = busy.local_addr().unwrap().port().to_string();
    let e = start_fails(&[
        "--tls-cert",
        &pki.arg("server.pem"),
        "--tls-key",
        &pki.arg("server.key"),
        "--tls-port",
        &port,
    ]);
    assert!(e.contains("--tls-port"), "{e}");
}

/// RabbitMQ's certificate-expiration check reads the listeners' certificate files: fine for a
/// day (the test certificates run to the year 4096), expiring within 3,000 years (503 with the
/// amqp/ssl listener and the date), a unit it does not know refused (400).
#[test]
fn the_certificate_expiration_check_reads_the_certificates() {
    let pki = Pki::new("expiry");
    let (broker, port) = pki.broker(&["--tls-ca", &pki.arg("ca.pem")]);
    if broker.is_external() {
        return;
    }
    let api = broker.http_url().expect("management API on").to_string();
    let check = |path: &str| {
        let r = warren_conformance::http::request(
            "GET",
            &format!("{api}/api/health/checks/certificate-expiration/{path}"),
            Some(("guest", "guest")),
            &[],
            None,
        );
        let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap_or_default();
        (r.status, v)
    };
    let (status, v) = check("1/days");
    assert_eq!(
        (status, &v["status"]),
        (200, &serde_json::json!("ok")),
        "{v}"
    );
    let (status, v) = check("3000/years");
    assert_eq!(status, 503, "{v}");
    assert_eq!(v["reason"], "Certificates expiring");
    let l = &v["expired"][0];
    assert_eq!(
        (&l["protocol"], &l["port"]),
        (&serde_json::json!("amqp/ssl"), &serde_json::json!(port)),
        "{v}"
    );
    assert!(
        l["certfile_expires_on"][0]
            .as_str()
            .is_some_and(|d| d.starts_with("4096-01-01")),
        "{v}"
    );
    assert!(
        l["cacertfile"]
            .as_str()
            .is_some_and(|f| f.ends_with("ca.pem")),
        "{v}"
    );
    let (status, v) = check("1/fortnights");
    assert_eq!(status, 400, "{v}");
    assert!(
        v["reason"]
            .as_str()
            .is_some_and(|r| r.contains("Supported units")),
        "{v}"
    );
}

// ---------------------------------------------------------------------------------------------
// HTTPS

/// GET `path` over HTTPS with guest's basic auth; the status line and body.
async fn https_get(port: u16, ca_pem: &str, path: &str) -> std::io::Result<String> {
    let mut s = tls_connect(port, client_config(ca_pem, Version::Tls13, None)).await?;
    let req = format!(
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Basic Z3Vlc3Q6Z3Vlc3Q=\r\n\
         Connection: close\r\n\r\n"
    );
    s.write_all(req.as_bytes()).await?;
    let mut out = Vec::new();
    let _ = tokio::time::timeout(WAIT, s.read_to_end(&mut out)).await;
    Ok(String::from_utf8_lossy(&out).into_owned())
}

#[tokio::test]
async fn management_api_and_metrics_over_https() {
    let pki = Pki::new("https");
    let (mgmt, prom) = (free_port(), free_port());
    let (broker, _) = pki.broker(&[
        "--management-tls",
        "--prometheus-tls",
        "--management-port",
        &mgmt.to_string(),
        "--prometheus-port",
        &prom.to_string(),
    ]);
    if broker.is_external() {
        return;
    }
    let overview = within("HTTPS", https_get(mgmt, &pki.ca.cert_pem, "/api/overview"))
        .await
        .unwrap();
    assert!(overview.starts_with("HTTP/1.1 200"), "{overview}");
    assert!(overview.contains("\"product_name\""), "{overview}");
    // The listeners as RabbitMQ names them.
    assert!(overview.contains("\"amqp/ssl\""), "{overview}");
    assert!(overview.contains("\"https\""), "{overview}");
    let metrics = within("HTTPS", https_get(prom, &pki.ca.cert_pem, "/metrics"))
        .await
        .unwrap();
    assert!(metrics.starts_with("HTTP/1.1 200"), "{metrics}");
    assert!(metrics.contains("rabbitmq_"), "{metrics}");
    // Plain HTTP on the HTTPS port gets nothing useful.
    let mut plain = TcpStream::connect(("127.0.0.1", mgmt)).await.unwrap();
    plain
        .write_all(b"GET /api/overview HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(3), plain.read_to_end(&mut out)).await;
    assert!(!String::from_utf8_lossy(&out).contains("200 OK"));
    // curl, when the machine has it, agrees (a client that is not ours).
    if let Ok(out) = Command::new("curl")
        .args(["-sS", "--cacert", &pki.arg("ca.pem"), "-u", "guest:guest"])
        .arg(format!("https://127.0.0.1:{mgmt}/api/overview"))
        .output()
    {
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(String::from_utf8_lossy(&out.stdout).contains("product_name"));
    }
}

// ---------------------------------------------------------------------------------------------
// pika and amqplib

fn clients_dir() -> PathBuf {
    warren_conformance::conformance_dir()
        .join("..")
        .join("clients")
}

fn python_path() -> String {
    let local = clients_dir().join(".deps").join("python");
    match std::env::var("PYTHONPATH") {
        Ok(p) if !p.is_empty() => format!("{}:{p}", local.display()),
        _ => local.display().to_string(),
    }
}

fn run_client(mut cmd: Command) -> String {
    let desc = format!("{cmd:?}");
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {desc}: {e} (scripts/test installs the clients)"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{desc} failed:\n{text}");
    text
}

#[test]
fn pika_over_tls_with_plain_and_external_login() {
    let pki = Pki::new("pika");
    let (cert, key) = pki.ca.client("guest", vec![]);
    pki.write("client.pem", &cert);
    pki.write("client.key", &key);
    let (broker, port) = pki.broker(&["--tls-ca", &pki.arg("ca.pem"), "--tls-verify", "optional"]);
    if broker.is_external() {
        return;
    }
    let mut cmd = Command::new(std::env::var("WARREN_PYTHON").unwrap_or_else(|_| "python3".into()));
    cmd.arg(clients_dir().join("tls_flows.py"))
        .arg(port.to_string())
        .arg(pki.arg("ca.pem"))
        .arg(pki.arg("client.pem"))
        .arg(pki.arg("client.key"))
        .env("PYTHONPATH", python_path());
    let out = run_client(cmd);
    assert!(out.contains("plain login over TLS: ok"), "{out}");
    assert!(out.contains("EXTERNAL login: ok"), "{out}");
}

#[test]
fn amqplib_over_tls() {
    let pki = Pki::new("amqplib");
    let (cert, key) = pki.ca.client("guest", vec![]);
    pki.write("client.pem", &cert);
    pki.write("client.key", &key);
    let (broker, port) = pki.broker(&["--tls-ca", &pki.arg("ca.pem"), "--tls-verify", "optional"]);
    if broker.is_external() {
        return;
    }
    let mut cmd = Command::new(std::env::var("WARREN_NODE").unwrap_or_else(|_| "node".into()));
    cmd.arg(clients_dir().join("tls_flows.js"))
        .arg(port.to_string())
        .arg(pki.arg("ca.pem"))
        .arg(pki.arg("client.pem"))
        .arg(pki.arg("client.key"))
        .current_dir(clients_dir());
    let out = run_client(cmd);
    assert!(out.contains("amqps with the CA: ok"), "{out}");
    assert!(out.contains("EXTERNAL login: ok"), "{out}");
}

// ---------------------------------------------------------------------------------------------
// Many deliveries to a client that stops reading for a while: the broker's TLS writer falls
// behind with output queued, then catches up; order and content must come through intact.

#[tokio::test]
async fn many_small_deliveries_arrive_in_order_over_tls() {
    let pki = Pki::new("many");
    let (broker, port) = pki.broker(&[]);
    if broker.is_external() {
        return;
    }
    let tunnel = Tunnel::start(port, client_config(&pki.ca.cert_pem, Version::Tls13, None)).await;
    let conn = lapin::Connection::connect(&tunnel.url(), lapin::ConnectionProperties::default())
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    ch.queue_declare(
        "tls-many".into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    const N: u32 = 10_000;
    let mut body = vec![b'x'; 1000];
    for i in 0..N {
        body[..4].copy_from_slice(&i.to_be_bytes());
        ch.basic_publish(
            "".into(),
            "tls-many".into(),
            BasicPublishOptions::default(),
            &body,
            BasicProperties::default(),
        )
        .await
        .unwrap();
    }
    let mut raw = Raw::open(tunnel.addr).await;
    raw.channel_open(1).await;
    raw.wait_ready(1, "tls-many", N).await;
    raw.send(
        1,
        AMQPClass::Basic(amq_protocol::protocol::basic::AMQPMethod::Consume(
            amq_protocol::protocol::basic::Consume {
                queue: "tls-many".into(),
                consumer_tag: "c".into(),
                no_local: false,
                no_ack: true,
                exclusive: false,
                nowait: false,
                arguments: Default::default(),
            },
        )),
    )
    .await;
    // Not reading for a while: the sockets fill up, and the broker's writer falls behind.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut next = 0u32;
    while next < N {
        match raw.recv_method().await {
            (1, AMQPClass::Basic(amq_protocol::protocol::basic::AMQPMethod::ConsumeOk(_))) => {}
            (1, m @ AMQPClass::Basic(amq_protocol::protocol::basic::AMQPMethod::Deliver(_))) => {
                let d = raw.recv_content(1, m).await;
                assert_eq!(d.body.len(), 1000);
                assert_eq!(
                    d.body[..4],
                    next.to_be_bytes(),
                    "delivery {next} out of order"
                );
                next += 1;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    conn.close(200, "bye".into()).await.unwrap();
}

/// A shovel reads from a broker over amqps (`cacertfile` names the CA that signed its
/// certificate) and moves what it holds to this one; without the CA the certificate is refused
/// and the shovel says why.
#[tokio::test]
async fn a_shovel_reads_from_a_broker_over_amqps() {
    let pki = Pki::new("shovel");
    let (source, tls_port) = pki.broker(&[]);
    if source.is_external() {
        return;
    }
    let dest = TestBroker::start();
    let conn = source.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.queue_declare(
        "tls-src".into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    for i in 0..3 {
        ch.basic_publish(
            "".into(),
            "tls-src".into(),
            BasicPublishOptions::default(),
            format!("m{i}").as_bytes(),
            BasicProperties::default(),
        )
        .await
        .unwrap();
    }
    let api = warren_conformance::http::Api::of(&dest);
    let ca = pki.arg("ca.pem");
    let uri = |query: &str| format!("amqps://guest:guest@localhost:{tls_port}/%2F{query}");
    api.put(
        "/parameters/shovel/%2F/untrusted",
        serde_json::json!({"value": {"src-uri": uri(""), "src-queue": "tls-src",
            "dest-uri": "amqp://", "dest-queue": "tls-never"}}),
    );
    api.put(
        "/parameters/shovel/%2F/over-tls",
        serde_json::json!({"value": {"src-uri": uri(&format!("?cacertfile={ca}&verify=verify_peer")),
            "src-queue": "tls-src", "dest-uri": "amqp://", "dest-queue": "tls-dest"}}),
    );
    let bad = moved_and_refused(&api, &[("tls-dest", 3)], "untrusted").await;
    let reason = bad["reason"].as_str().unwrap_or("");
    assert!(
        !reason.contains("guest:guest"),
        "no password in the reason: {reason}"
    );
    // verify=verify_none takes the test CA's certificate without knowing the CA (RabbitMQ 3's
    // default, written out in definitions made for self-signed brokers). server_name_indication
    // is the name the certificate is checked against: a name it lacks fails.
    one_message_each(&ch, &["tls-src-unchecked", "tls-src-named"]).await;
    api.put(
        "/parameters/shovel/%2F/unchecked",
        serde_json::json!({"value": {"src-uri": uri("?verify=verify_none"),
            "src-queue": "tls-src-unchecked", "dest-uri": "amqp://", "dest-queue": "tls-unchecked"}}),
    );
    api.put(
        "/parameters/shovel/%2F/other-name",
        serde_json::json!({"value": {
            "src-uri": uri(&format!("?cacertfile={ca}&server_name_indication=other.example")),
            "src-queue": "tls-src-named", "dest-uri": "amqp://", "dest-queue": "tls-never"}}),
    );
    moved_and_refused(&api, &[("tls-unchecked", 1)], "other-name").await;
    // A broker whose certificate names another host: checked against the URI's host it fails;
    // server_name_indication names it, or disable checks the chain only (as Erlang's ssl).
    let (cert, key) = pki
        .ca
        .server_for("elsewhere", &["broker.elsewhere.example"]);
    pki.write("server.pem", &cert);
    pki.write("server.key", &key);
    let (other, other_port) = pki.broker(&[]);
    let conn = other.connect().await;
    let och = conn.create_channel().await.unwrap();
    one_message_each(&och, &["named-src", "disabled-src", "host-src"]).await;
    let other_uri = |query: &str| {
        format!("amqps://guest:guest@localhost:{other_port}/%2F?cacertfile={ca}{query}")
    };
    for (name, query) in [
        ("named", "&server_name_indication=broker.elsewhere.example"),
        ("disabled", "&server_name_indication=disable"),
        ("host", ""),
    ] {
        api.put(
            &format!("/parameters/shovel/%2F/{name}"),
            serde_json::json!({"value": {"src-uri": other_uri(query), "src-queue": format!("{name}-src"),
                "dest-uri": "amqp://", "dest-queue": format!("{name}-dest")}}),
        );
    }
    moved_and_refused(&api, &[("named-dest", 1), ("disabled-dest", 1)], "host").await;
}

/// Declares each queue and publishes one message to it.
async fn one_message_each(ch: &lapin::Channel, queues: &[&str]) {
    for q in queues {
        ch.queue_declare(
            (*q).into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
        ch.basic_publish(
            "".into(),
            (*q).into(),
            BasicPublishOptions::default(),
            b"m",
            BasicProperties::default(),
        )
        .await
        .unwrap();
    }
}

/// Waits until each queue holds its count and shovel `refused` has stopped over the server's
/// certificate; returns that shovel's status.
async fn moved_and_refused(
    api: &warren_conformance::http::Api,
    moved: &[(&str, u64)],
    refused: &str,
) -> serde_json::Value {
    let start = Instant::now();
    loop {
        let depths: Vec<_> = moved
            .iter()
            .map(|(q, _)| api.call("GET", &format!("/queues/%2F/{q}"), None).1["messages"].clone())
            .collect();
        let (_, status) = api.call("GET", &format!("/shovels/vhost/%2F/{refused}"), None);
        let reason = status["reason"].as_str().unwrap_or("");
        if moved.iter().zip(&depths).all(|((_, n), d)| d == n) && reason.contains("certificate") {
            assert_ne!(status["state"], "running", "{status}");
            return status;
        }
        assert!(
            start.elapsed() < WAIT,
            "moved {depths:?} of {moved:?}; {refused} not refused over its certificate: {status}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
