//! `GET /api/health/checks/certificate-expiration/{within}/{unit}`, as RabbitMQ answers it:
//! 503 when a TLS listener's certificate file (or its CA file) holds a certificate that expires
//! within that time, read from the files each time (a reload on SIGHUP is seen).

use std::path::Path;

use serde_json::{json, Value};

use super::ApiError;

/// Seconds in `within` `unit`s (RabbitMQ's: a month is a twelfth of 365 days).
pub fn period(within: &str, unit: &str) -> Result<u64, ApiError> {
    let n: u64 = within
        .parse()
        .map_err(|_| ApiError::bad_request("Invalid expiration value."))?;
    const DAY: u64 = 86_400;
    let per = match unit.to_ascii_lowercase().as_str() {
        "days" => DAY,
        "weeks" => 7 * DAY,
        "months" => 365 * DAY / 12,
        "years" => 365 * DAY,
        _ => {
            return Err(ApiError::bad_request(
                "Time unit not recognised. Supported units: days, weeks, months, years.",
            ))
        }
    };
    Ok(n.saturating_mul(per))
}

/// What is wrong with one PEM file: the expiry dates of its certificates that end before
/// `deadline` (seconds since the epoch), or why it cannot be read; `Ok(empty)` when fine.
pub fn expiring(path: &Path, now: i64, deadline: i64) -> Result<Vec<String>, String> {
    let data = std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let mut out = Vec::new();
    let mut any = false;
    for pem in x509_parser::pem::Pem::iter_from_buffer(&data) {
        let pem = pem.map_err(|e| format!("not a PEM file: {e}"))?;
        any = true;
        if pem.label != "CERTIFICATE" {
            return Err(format!(
                "The certificate file provided contains a {} entry",
                pem.label
            ));
        }
        let cert = pem
            .parse_x509()
            .map_err(|e| format!("an unreadable certificate: {e}"))?;
        let validity = cert.validity();
        if validity.not_before.timestamp() > now {
            return Err("Certificate is not yet valid".into());
        }
        let end = validity.not_after.timestamp();
        if end < deadline {
            out.push(date(end));
        }
    }
    if !any {
        return Err("The certificate file provided does not contain any PEM entry.".into());
    }
    Ok(out)
}

/// `2027-03-01 9:05:00`, as RabbitMQ writes a time (UTC): a certificate's expiry, a
/// shovel's last change.
pub fn date(unix: i64) -> String {
    let days = unix.div_euclid(86_400);
    let secs = unix.rem_euclid(86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y}-{m:02}-{d:02} {}:{:02}:{:02}",
        secs / 3600,
        (secs / 60) % 60,
        secs % 60
    )
}

/// One listener's entry in the answer, if its files have a problem.
pub fn listener_entry(
    node: &str,
    (protocol, port): (&str, u16),
    cert: &Path,
    ca: Option<&Path>,
    (now, deadline): (i64, i64),
) -> Option<Value> {
    let cert_exp = expiring(cert, now, deadline);
    let ca_exp = ca.map(|p| expiring(p, now, deadline));
    let fine = |r: &Result<Vec<String>, String>| r.as_ref().is_ok_and(Vec::is_empty);
    if fine(&cert_exp) && ca_exp.as_ref().is_none_or(fine) {
        return None;
    }
    let shown = |r: Result<Vec<String>, String>| match r {
        Ok(dates) => json!(dates),
        Err(e) => json!({"error": e}),
    };
    Some(json!({
        "node": node,
        "protocol": protocol,
        "interface": "::",
        "port": port,
        "certfile": cert.display().to_string(),
        "cacertfile": ca.map(|p| p.display().to_string()),
        "certfile_expires_on": shown(cert_exp),
        "cacertfile_expires_on": ca_exp.map_or(json!([]), shown),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn periods_are_rabbitmqs() {
        assert_eq!(period("2", "weeks").ok(), Some(2 * 7 * 86_400));
        assert_eq!(period("1", "Months").ok(), Some(2_628_000));
        assert!(period("x", "days").is_err());
        assert!(period("1", "fortnights").is_err());
        assert_eq!(date(0), "1970-01-01 0:00:00");
        assert_eq!(date(1_803_891_900), "2027-03-01 9:05:00");
    }
}
