//! A small blocking client of the management HTTP API (RabbitMQ's paths, so it works against
//! RabbitMQ's management plugin too): basic auth, JSON in and out, errors that say what to do.

use std::time::Duration;

use base64::Engine;
use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use serde_json::Value;

use super::CliError;

/// What stays unescaped in a path segment: RFC 3986's unreserved characters.
const SEGMENT: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// Largest response read (a definitions export of many thousand queues fits easily).
const MAX_BODY: u64 = 1 << 30;

/// One path segment, percent-encoded: vhost "/" becomes "%2F".
pub fn enc(segment: &str) -> String {
    utf8_percent_encode(segment, SEGMENT).to_string()
}

/// The API at `base` (`http://host:15672`), as one user.
pub struct Api {
    base: String,
    user: String,
    auth: String,
    agent: ureq::Agent,
}

/// A successful answer: its status and its JSON body (`Null` when empty).
pub struct Reply {
    pub status: u16,
    pub body: Value,
}

impl Api {
    pub fn new(base: &str, user: &str, password: &str) -> Api {
        let config = ureq::Agent::config_builder()
            // Statuses are ours to explain (401, 404, ...), not transport errors.
            .http_status_as_error(false)
            .timeout_connect(Some(Duration::from_secs(10)))
            .timeout_global(Some(Duration::from_secs(300)))
            // The management port is usually local: a proxy from the environment would only
            // get in the way.
            .proxy(None)
            .user_agent(concat!("warren/", env!("CARGO_PKG_VERSION")))
            .build();
        let token = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
        Api {
            base: base.trim_end_matches('/').to_owned(),
            user: user.to_owned(),
            auth: format!("Basic {token}"),
            agent: ureq::Agent::new_with_config(config),
        }
    }

    /// `GET /api{path}`; `what` is the message for a 404 (see `super::missing`).
    pub fn get(&self, path: &str, what: &str) -> Result<Value, CliError> {
        Ok(self.call("GET", path, None, &[], what)?.body)
    }

    /// `GET /api{path}`, or `None` where it is not found (404).
    pub fn get_opt(&self, path: &str) -> Result<Option<Value>, CliError> {
        let (status, body) = self.send("GET", path, None, &[])?;
        if status == 404 {
            return Ok(None);
        }
        Ok(Some(self.answer("GET", path, path, status, body)?.body))
    }

    /// Sends `method /api{path}` with an optional JSON body and extra headers.
    pub fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
        headers: &[(&str, &str)],
        what: &str,
    ) -> Result<Reply, CliError> {
        let (status, reply) = self.send(method, path, body, headers)?;
        self.answer(method, path, what, status, reply)
    }

    /// `GET /api{path}` of a health check: whether it passed (200) or failed (503, RabbitMQ's
    /// answer for a failed check), with the body either way; other statuses are errors as
    /// for [`Self::call`].
    pub fn health(&self, path: &str, what: &str) -> Result<(bool, Value), CliError> {
        let (status, body) = self.send("GET", path, None, &[])?;
        if status == 503 {
            return Ok((false, body));
        }
        Ok((true, self.answer("GET", path, what, status, body)?.body))
    }

    /// Sends `method /api{path}`: the status and the JSON body, whatever the status.
    fn send(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
        headers: &[(&str, &str)],
    ) -> Result<(u16, Value), CliError> {
        let url = format!("{}/api{path}", self.base);
        let sent = match method {
            // A DELETE with a body (RabbitMQ's `replicas/delete` takes the node in it).
            "GET" | "DELETE" if method == "GET" || body.is_none() => {
                let mut r = if method == "GET" {
                    self.agent.get(&url)
                } else {
                    self.agent.delete(&url)
                };
                r = r.header("authorization", &self.auth);
                for (k, v) in headers {
                    r = r.header(*k, *v);
                }
                r.call()
            }
            _ => {
                let mut r = match method {
                    "PUT" => self.agent.put(&url),
                    "DELETE" => self.agent.delete(&url).force_send_body(),
                    _ => self.agent.post(&url),
                };
                r = r
                    .header("authorization", &self.auth)
                    .header("content-type", "application/json");
                for (k, v) in headers {
                    r = r.header(*k, *v);
                }
                let text = body.map_or_else(|| "{}".to_owned(), Value::to_string);
                r.send(text.as_bytes())
            }
        };
        let mut resp = sent.map_err(|e| self.transport_error(e))?;
        let status = resp.status().as_u16();
        let bytes = resp
            .body_mut()
            .with_config()
            .limit(MAX_BODY)
            .read_to_vec()
            .map_err(|e| self.transport_error(e))?;
        let body = if bytes.iter().all(u8::is_ascii_whitespace) {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).unwrap_or_else(|_| {
                Value::String(String::from_utf8_lossy(&bytes).trim().to_owned())
            })
        };
        Ok((status, body))
    }

    /// A status and body as [`Self::call`] returns them: the reply, or the error that says
    /// what to do.
    fn answer(
        &self,
        method: &str,
        path: &str,
        what: &str,
        status: u16,
        body: Value,
    ) -> Result<Reply, CliError> {
        match status {
            200..=299 => Ok(Reply { status, body }),
            // Logged in, but refused: a tag or a vhost permission is missing (RabbitMQ spells
            // it not_authorised, a failed login not_authorized).
            401 if body.get("error").and_then(Value::as_str) == Some("not_authorised") => {
                Err(CliError::Failed(format!(
                    "user '{}' may not {method} {path}: {} (it needs a permission in the vhost \
                     or a user tag that allows it; pass another --user/--password)",
                    self.user,
                    reason(&body)
                )))
            }
            401 => Err(CliError::Unauthorized {
                user: self.user.clone(),
                api: self.base.clone(),
            }),
            403 => Err(CliError::Failed(format!(
                "user '{}' may not do this ({}): it needs a user tag that allows it, such as \
                 administrator; pass another --user/--password",
                self.user,
                reason(&body)
            ))),
            404 => Err(CliError::NotFound(what.to_owned())),
            _ => Err(CliError::Failed(format!(
                "the management API refused {method} {path}: {status} {}",
                reason(&body)
            ))),
        }
    }

    /// Every item of a list endpoint, page by page (`page_size` 500, RabbitMQ's largest),
    /// filtered by `name` (a regular expression) on the server. An endpoint that does not
    /// page answers a plain array, which is then the whole list.
    pub fn list(
        &self,
        path: &str,
        filter: Option<&str>,
        what: &str,
    ) -> Result<Vec<Value>, CliError> {
        let mut items = Vec::new();
        let mut page = 1u64;
        loop {
            // Sorted by name so that pages do not shift between requests.
            let mut query = format!("{path}?page={page}&page_size=500&sort=name");
            if let Some(f) = filter {
                query.push_str(&format!("&name={}&use_regex=true", enc(f)));
            }
            match self.get(&query, what)? {
                Value::Array(all) => return Ok(all),
                Value::Object(mut o) => {
                    if let Some(Value::Array(page_items)) = o.remove("items") {
                        items.extend(page_items);
                    }
                    let count = o.get("page_count").and_then(Value::as_u64).unwrap_or(0);
                    if page >= count {
                        return Ok(items);
                    }
                    page += 1;
                }
                other => {
                    return Err(CliError::Failed(format!(
                        "GET {path}: expected a list, got {other}"
                    )))
                }
            }
        }
    }

    fn transport_error(&self, e: ureq::Error) -> CliError {
        match e {
            ureq::Error::BadUri(_) | ureq::Error::Http(_) => CliError::Usage(format!(
                "{} is not a usable address for the management API ({e}): pass --api \
                 http://host:15672",
                self.base
            )),
            _ => CliError::Unreachable {
                api: self.base.clone(),
                detail: e.to_string(),
            },
        }
    }
}

/// The `reason` of an API error body (`{"error": ..., "reason": ...}`), else the body.
fn reason(body: &Value) -> String {
    match body.get("reason").or_else(|| body.get("error")) {
        Some(Value::String(s)) => s.clone(),
        Some(v) => v.to_string(),
        None if body.is_null() => "(no details)".to_owned(),
        None => body.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn path_segments_are_percent_encoded() {
        assert_eq!(enc("/"), "%2F");
        assert_eq!(enc("my-vhost"), "my-vhost");
        assert_eq!(enc("a b/c?d#e%"), "a%20b%2Fc%3Fd%23e%25");
        assert_eq!(enc("jobs.dead_1~x"), "jobs.dead_1~x");
        assert_eq!(enc("é"), "%C3%A9");
    }

    #[test]
    fn error_reasons_are_read_from_the_body() {
        assert_eq!(
            reason(&json!({"error": "bad_request", "reason": "nope"})),
            "nope"
        );
        assert_eq!(reason(&json!({"error": "not_found"})), "not_found");
        assert_eq!(reason(&Value::Null), "(no details)");
    }
}
