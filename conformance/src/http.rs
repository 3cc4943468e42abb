//! A minimal HTTP/1.1 client for the management API and metrics tests: one request per
//! connection (`Connection: close`), basic auth, JSON bodies. Enough to check status codes,
//! headers and bodies exactly as a tool would see them.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// A response: status, headers (names lowercased) and body.
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// Sends `method url` with optional basic-auth credentials, extra headers and a body.
pub fn request(
    method: &str,
    url: &str,
    auth: Option<(&str, &str)>,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> Response {
    use base64::Engine;
    let rest = url.strip_prefix("http://").expect("http:// URL");
    let (host, path) = rest
        .split_once('/')
        .map_or((rest, "/".to_string()), |(h, p)| (h, format!("/{p}")));
    let mut stream = TcpStream::connect(host).unwrap_or_else(|e| panic!("connect {host}: {e}"));
    stream.set_read_timeout(Some(Duration::from_secs(10))).ok();
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n");
    if let Some((u, p)) = auth {
        let token = base64::engine::general_purpose::STANDARD.encode(format!("{u}:{p}"));
        req.push_str(&format!("Authorization: Basic {token}\r\n"));
    }
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    let body = body.unwrap_or("");
    if !body.is_empty() || method == "PUT" || method == "POST" {
        req.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        ));
    }
    req.push_str("\r\n");
    req.push_str(body);
    stream.write_all(req.as_bytes()).expect("send request");
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).expect("read response");
    parse(&raw)
}

fn parse(raw: &[u8]) -> Response {
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("end of headers");
    let head = String::from_utf8_lossy(&raw[..end]);
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .expect("status line");
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_lowercase(), v.trim().to_string()))
        .collect();
    let mut body = raw[end + 4..].to_vec();
    if headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"))
    {
        body = dechunk(&body);
    }
    Response {
        status,
        headers,
        body,
    }
}

fn dechunk(mut data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let Some(eol) = data.windows(2).position(|w| w == b"\r\n") else {
            return out;
        };
        let size =
            usize::from_str_radix(String::from_utf8_lossy(&data[..eol]).trim(), 16).unwrap_or(0);
        if size == 0 || data.len() < eol + 2 + size {
            return out;
        }
        out.extend_from_slice(&data[eol + 2..eol + 2 + size]);
        data = &data[(eol + 4 + size).min(data.len())..];
    }
}

/// How long [`eventually`] waits. RabbitMQ's management API shows a queue's message counts and
/// a new connection only after its stats are next emitted (`collect_statistics_interval`, 5 s by
/// default), so a test that reads them right after acting must poll; Warren answers at once.
pub const STATS_WAIT: Duration = Duration::from_secs(15);

/// Calls `check` until it returns `Ok` (at most [`STATS_WAIT`]), else panics with `what` and
/// the last `Err` it returned.
pub fn eventually<T>(what: &str, mut check: impl FnMut() -> Result<T, String>) -> T {
    let deadline = std::time::Instant::now() + STATS_WAIT;
    loop {
        match check() {
            Ok(v) => return v,
            Err(last) if std::time::Instant::now() > deadline => {
                panic!("timed out after {STATS_WAIT:?} waiting for {what}; last: {last}")
            }
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

/// The management API of a test broker, as guest: JSON in, status and JSON out.
pub struct Api {
    base: String,
}

impl Api {
    pub fn of(b: &crate::TestBroker) -> Api {
        Api {
            base: format!("{}/api", b.http_url().expect("management API on")),
        }
    }

    /// `method` on `/api{path}`; the body that came back as JSON (`Null` when empty or not JSON).
    pub fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> (u16, serde_json::Value) {
        let r = request(
            method,
            &format!("{}{path}", self.base),
            Some(("guest", "guest")),
            &[],
            body.map(|b| b.to_string()).as_deref(),
        );
        let v = if r.body.is_empty() {
            serde_json::Value::Null
        } else {
            serde_json::from_slice(&r.body).unwrap_or(serde_json::Value::Null)
        };
        (r.status, v)
    }

    /// A PUT that must create or replace (201 or 204).
    pub fn put(&self, path: &str, body: serde_json::Value) {
        let (status, v) = self.call("PUT", path, Some(body));
        assert!(status == 201 || status == 204, "PUT {path}: {status} {v}");
    }
}
