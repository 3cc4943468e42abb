//! AWS Signature Version 4, checked as the server side: the request's `Authorization` header
//! is parsed, the canonical request rebuilt from what arrived, and the signature computed
//! again with the secret of the key the header names.

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

type HmacSha256 = Hmac<Sha256>;

/// AWS refuses a request whose `X-Amz-Date` is further than this from its clock.
pub const MAX_SKEW_MS: u64 = 15 * 60 * 1000;

/// What the `Authorization` header says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Authorization {
    pub access_key: String,
    /// `YYYYMMDD` of the credential scope.
    pub date: String,
    pub region: String,
    pub service: String,
    /// Lower-case header names, in the order signed (`;`-separated in the header).
    pub signed_headers: Vec<String>,
    /// Hex, as sent.
    pub signature: String,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AuthError {
    #[error("the Authorization header is malformed: {0}")]
    Incomplete(&'static str),
    #[error("the X-Amz-Date header is missing or malformed")]
    BadDate,
    #[error("the request's date is more than 15 minutes from the server's")]
    Expired,
}

/// Parses `AWS4-HMAC-SHA256 Credential=AKID/20150830/us-east-1/sqs/aws4_request,
/// SignedHeaders=host;x-amz-date, Signature=hex`.
pub fn parse_authorization(value: &str) -> Result<Authorization, AuthError> {
    let rest = value
        .strip_prefix("AWS4-HMAC-SHA256")
        .ok_or(AuthError::Incomplete("only AWS4-HMAC-SHA256 is supported"))?;
    let (mut credential, mut signed, mut signature) = (None, None, None);
    for part in rest.split(',') {
        let Some((k, v)) = part.trim().split_once('=') else {
            continue;
        };
        match k.trim() {
            "Credential" => credential = Some(v.trim()),
            "SignedHeaders" => signed = Some(v.trim()),
            "Signature" => signature = Some(v.trim()),
            _ => {}
        }
    }
    let credential = credential.ok_or(AuthError::Incomplete("no Credential"))?;
    let signed = signed.ok_or(AuthError::Incomplete("no SignedHeaders"))?;
    let signature = signature.ok_or(AuthError::Incomplete("no Signature"))?;
    // The key id may itself hold '/'? AWS's do not; Warren's user names might, so the scope
    // is taken from the right.
    let mut scope = credential.rsplitn(5, '/');
    let terminator = scope.next();
    let service = scope.next();
    let region = scope.next();
    let date = scope.next();
    let key = scope.next();
    let (Some("aws4_request"), Some(service), Some(region), Some(date), Some(key)) =
        (terminator, service, region, date, key)
    else {
        return Err(AuthError::Incomplete(
            "Credential must be key/date/region/service/aws4_request",
        ));
    };
    if date.len() != 8 || !date.bytes().all(|b| b.is_ascii_digit()) {
        return Err(AuthError::Incomplete(
            "the credential's date must be YYYYMMDD",
        ));
    }
    Ok(Authorization {
        access_key: key.to_owned(),
        date: date.to_owned(),
        region: region.to_owned(),
        service: service.to_owned(),
        signed_headers: signed.split(';').map(str::to_ascii_lowercase).collect(),
        signature: signature.to_ascii_lowercase(),
    })
}

/// `YYYYMMDDTHHMMSSZ` as ms since the epoch.
pub fn parse_amz_date(s: &str) -> Option<u64> {
    let b = s.as_bytes();
    if b.len() != 16 || b[8] != b'T' || b[15] != b'Z' {
        return None;
    }
    let num = |r: std::ops::Range<usize>| -> Option<u64> { s.get(r)?.parse().ok() };
    let (y, mo, d) = (num(0..4)?, num(4..6)?, num(6..8)?);
    let (h, mi, sec) = (num(9..11)?, num(11..13)?, num(13..15)?);
    if !(1..=12).contains(&mo) || !(1..=31).contains(&d) || h > 23 || mi > 59 || sec > 60 {
        return None;
    }
    let days = days_from_civil(y as i64, mo as i64, d as i64);
    let secs = u64::try_from(days).ok()? * 86_400 + h * 3600 + mi * 60 + sec;
    Some(secs * 1000)
}

/// Days since 1970-01-01 (Howard Hinnant's algorithm).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = if y >= 0 { y } else { y - 399 } / 400;
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// AWS's URI encoding: every byte but the unreserved ones as `%XX` (upper-case), `/` kept
/// where `keep_slash`.
pub fn uri_encode(s: &str, keep_slash: bool) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric()
            || matches!(b, b'-' | b'_' | b'.' | b'~')
            || (keep_slash && b == b'/')
        {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The request as it arrived, for [`string_to_sign`].
pub struct Request<'a> {
    pub method: &'a str,
    /// The path as sent (still percent-encoded).
    pub path: &'a str,
    /// The query string as sent, without `?`.
    pub query: &'a str,
    /// Every header (name, value); names compared case-insensitively.
    pub headers: &'a [(String, String)],
    pub body: &'a [u8],
}

fn canonical_query(query: &str) -> String {
    let decode = |s: &str| {
        percent_encoding::percent_decode_str(&s.replace('+', " "))
            .decode_utf8_lossy()
            .into_owned()
    };
    let mut pairs: Vec<(String, String)> = query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (uri_encode(&decode(k), false), uri_encode(&decode(v), false))
        })
        .collect();
    pairs.sort();
    pairs
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join("&")
}

/// The canonical request of SigV4 (for every service but S3: the path is encoded again).
pub fn canonical_request(req: &Request<'_>, signed: &[String]) -> String {
    let path = if req.path.is_empty() { "/" } else { req.path };
    let mut out = String::new();
    out.push_str(req.method);
    out.push('\n');
    out.push_str(&uri_encode(path, true));
    out.push('\n');
    out.push_str(&canonical_query(req.query));
    out.push('\n');
    for name in signed {
        let values: Vec<String> = req
            .headers
            .iter()
            .filter(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.split_whitespace().collect::<Vec<_>>().join(" "))
            .collect();
        out.push_str(name);
        out.push(':');
        out.push_str(&values.join(","));
        out.push('\n');
    }
    out.push('\n');
    out.push_str(&signed.join(";"));
    out.push('\n');
    let payload = req
        .headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("x-amz-content-sha256"))
        .map(|(_, v)| v.clone())
        .unwrap_or_else(|| hex::encode(Sha256::digest(req.body)));
    out.push_str(&payload);
    out
}

pub fn string_to_sign(amz_date: &str, auth: &Authorization, canonical: &str) -> String {
    format!(
        "AWS4-HMAC-SHA256\n{amz_date}\n{}/{}/{}/aws4_request\n{}",
        auth.date,
        auth.region,
        auth.service,
        hex::encode(Sha256::digest(canonical.as_bytes()))
    )
}

fn hmac(key: &[u8], data: &[u8]) -> Vec<u8> {
    // HMAC takes a key of any length: the error cannot happen, and an empty result would
    // only make the signature not match.
    let Ok(mut mac) = HmacSha256::new_from_slice(key) else {
        return Vec::new();
    };
    mac.update(data);
    mac.finalize().into_bytes().to_vec()
}

/// The hex signature of `to_sign` under `secret`.
pub fn signature(secret: &str, auth: &Authorization, to_sign: &str) -> String {
    let k = hmac(format!("AWS4{secret}").as_bytes(), auth.date.as_bytes());
    let k = hmac(&k, auth.region.as_bytes());
    let k = hmac(&k, auth.service.as_bytes());
    let k = hmac(&k, b"aws4_request");
    hex::encode(hmac(&k, to_sign.as_bytes()))
}

/// Compares in time independent of where the strings differ.
pub fn same(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

/// Checks the request's date against `now_ms`: the `X-Amz-Date` header (or `Date`) must be
/// within 15 minutes and on the credential's day.
pub fn check_date(
    req: &Request<'_>,
    auth: &Authorization,
    now_ms: u64,
) -> Result<String, AuthError> {
    let date = req
        .headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("x-amz-date"))
        .map(|(_, v)| v.trim().to_owned())
        .ok_or(AuthError::BadDate)?;
    let at = parse_amz_date(&date).ok_or(AuthError::BadDate)?;
    if at.abs_diff(now_ms) > MAX_SKEW_MS {
        return Err(AuthError::Expired);
    }
    if !date.starts_with(&auth.date) {
        return Err(AuthError::Incomplete(
            "the credential's date is not the request's",
        ));
    }
    Ok(date)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(h: &[(&str, &str)]) -> Vec<(String, String)> {
        h.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    /// AWS's SigV4 test suite, `get-vanilla`: secret `wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY`.
    #[test]
    fn aws_test_suite_get_vanilla() {
        let h = headers(&[
            ("Host", "example.amazonaws.com"),
            ("X-Amz-Date", "20150830T123600Z"),
        ]);
        let req = Request {
            method: "GET",
            path: "/",
            query: "",
            headers: &h,
            body: b"",
        };
        let auth = parse_authorization(
            "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20150830/us-east-1/service/aws4_request, \
             SignedHeaders=host;x-amz-date, \
             Signature=5fa00fa31553b73ebf1942676e86291e8372ff2a2260956d9b8aae1d763fbf31",
        )
        .expect("parses");
        let canonical = canonical_request(&req, &auth.signed_headers);
        let to_sign = string_to_sign("20150830T123600Z", &auth, &canonical);
        let sig = signature("wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", &auth, &to_sign);
        assert_eq!(sig, auth.signature);
    }

    /// AWS's documented IAM `ListUsers` example (the signing guide's worked example).
    #[test]
    fn aws_documented_iam_example() {
        let h = headers(&[
            (
                "Content-Type",
                "application/x-www-form-urlencoded; charset=utf-8",
            ),
            ("Host", "iam.amazonaws.com"),
            ("X-Amz-Date", "20150830T123600Z"),
        ]);
        let req = Request {
            method: "GET",
            path: "/",
            query: "Action=ListUsers&Version=2010-05-08",
            headers: &h,
            body: b"",
        };
        let auth = Authorization {
            access_key: "AKIDEXAMPLE".into(),
            date: "20150830".into(),
            region: "us-east-1".into(),
            service: "iam".into(),
            signed_headers: vec!["content-type".into(), "host".into(), "x-amz-date".into()],
            signature: String::new(),
        };
        let canonical = canonical_request(&req, &auth.signed_headers);
        assert_eq!(
            hex::encode(Sha256::digest(canonical.as_bytes())),
            "f536975d06c0309214f805bb90ccff089219ecd68b2577efef23edd43b7e1a59"
        );
        let to_sign = string_to_sign("20150830T123600Z", &auth, &canonical);
        assert_eq!(
            signature("wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", &auth, &to_sign),
            "5d672d79c15b13162d9279b0855cfba6789a8edb4c82c400e06b5924a6f2b5d7"
        );
    }

    /// A POST that botocore 1.43 signed (guest/guest, the JSON protocol's ListQueues).
    #[test]
    fn botocore_signed_post() {
        let body = br#"{}"#;
        let h = headers(&[
            ("Host", "localhost:9324"),
            ("X-Amz-Target", "AmazonSQS.ListQueues"),
            ("Content-Type", "application/x-amz-json-1.0"),
            ("X-Amz-Date", "20261201T172339Z"),
        ]);
        let req = Request {
            method: "POST",
            path: "/",
            query: "",
            headers: &h,
            body,
        };
        let auth = parse_authorization(BOTOCORE_AUTH).expect("parses");
        assert_eq!(auth.access_key, "guest");
        let canonical = canonical_request(&req, &auth.signed_headers);
        let to_sign = string_to_sign("20261201T172339Z", &auth, &canonical);
        assert!(same(&signature("guest", &auth, &to_sign), &auth.signature));
        assert!(!same(&signature("guesT", &auth, &to_sign), &auth.signature));
    }

    /// Made with `botocore.auth.SigV4Auth(Credentials("guest", "guest"), "sqs", "us-east-1")`
    /// on the request of [`botocore_signed_post`] (the date fixed).
    const BOTOCORE_AUTH: &str = "AWS4-HMAC-SHA256 Credential=guest/20261201/us-east-1/sqs/aws4_request, SignedHeaders=content-type;host;x-amz-date;x-amz-target, Signature=0302d2824461f69134a8def245b69aad364ad4adb4e9540c79ee0791c9d21217";

    #[test]
    fn dates() {
        assert_eq!(parse_amz_date("19700101T000000Z"), Some(0));
        assert_eq!(parse_amz_date("20150830T123600Z"), Some(1_440_938_160_000));
        assert_eq!(parse_amz_date("2015-08-30T12:36"), None);
        assert_eq!(parse_amz_date("20151330T123600Z"), None);
    }

    #[test]
    fn skew_and_missing_parts() {
        let h = headers(&[("X-Amz-Date", "20150830T123600Z")]);
        let req = Request {
            method: "POST",
            path: "/",
            query: "",
            headers: &h,
            body: b"",
        };
        let auth = parse_authorization(
            "AWS4-HMAC-SHA256 Credential=a/20150830/r/sqs/aws4_request, SignedHeaders=host, Signature=00",
        )
        .expect("parses");
        let at = 1_440_938_160_000;
        assert!(check_date(&req, &auth, at + MAX_SKEW_MS).is_ok());
        assert_eq!(
            check_date(&req, &auth, at + MAX_SKEW_MS + 1),
            Err(AuthError::Expired)
        );
        assert_eq!(
            check_date(&req, &auth, at - MAX_SKEW_MS - 1),
            Err(AuthError::Expired)
        );
        assert!(parse_authorization("Basic Z3Vlc3Q6Z3Vlc3Q=").is_err());
        assert!(parse_authorization(
            "AWS4-HMAC-SHA256 Credential=a/b, SignedHeaders=host, Signature=0"
        )
        .is_err());
    }
}
