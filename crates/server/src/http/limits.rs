//! Vhost and user limits over the management API, with RabbitMQ's paths, bodies and answers:
//! `/api/vhost-limits[/{vhost}[/{name}]]` (`max-connections`, `max-queues`) and
//! `/api/user-limits[/{user}[/{name}]]` (`max-connections`, `max-channels`). Setting and
//! clearing needs the administrator tag; others see the limits of the vhosts they may open
//! and their own.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, put};
use axum::{Json, Router};
use serde_json::{json, Value};
use warren_broker::limits::{LimitScope, Limits};

use super::{Admin, Api, ApiError, LoggedIn};

type ApiState = State<Arc<Api>>;
type Answer = Result<Response, ApiError>;

pub fn routes() -> Router<Arc<Api>> {
    Router::new()
        .route("/api/vhost-limits", get(all_vhost_limits))
        .route("/api/vhost-limits/{vhost}", get(one_vhost_limits))
        .route(
            "/api/vhost-limits/{vhost}/{name}",
            put(put_vhost_limit).delete(delete_vhost_limit),
        )
        .route("/api/user-limits", get(all_user_limits))
        .route("/api/user-limits/{user}", get(one_user_limits))
        .route(
            "/api/user-limits/{user}/{name}",
            put(put_user_limit).delete(delete_user_limit),
        )
}

/// Limits as a JSON object, name -> value.
pub fn limits_json(limits: &Limits) -> Value {
    limits
        .iter()
        .map(|(name, value)| (name.to_owned(), Value::from(value)))
        .collect::<serde_json::Map<String, Value>>()
        .into()
}

fn entry(scope: LimitScope, name: &str, limits: &Limits) -> Value {
    let key = match scope {
        LimitScope::Vhost => "vhost",
        LimitScope::User => "user",
    };
    json!({ key: name, "value": limits_json(limits) })
}

/// Every entry of a scope that `visible` keeps.
fn listing(api: &Api, scope: LimitScope, visible: impl Fn(&str) -> bool) -> Value {
    api.node.read(|n, _| {
        n.broker()
            .limits()
            .all(scope)
            .filter(|(name, _)| visible(name))
            .map(|(name, limits)| entry(scope, name, limits))
            .collect()
    })
}

fn ok(v: Value) -> Answer {
    Ok(Json(v).into_response())
}

fn done() -> Answer {
    Ok(axum::http::StatusCode::NO_CONTENT.into_response())
}

/// A JSON term as Erlang prints it in RabbitMQ's validation messages (`<<"x">>` for a string).
fn erlang_term(v: &Value) -> String {
    match v {
        Value::String(s) => format!("<<\"{s}\">>"),
        other => other.to_string(),
    }
}

/// The value of a `{"value": N}` body, checked as RabbitMQ checks it: present, an integer,
/// under a name the scope knows. Texts as RabbitMQ 3.10 words them per scope.
fn limit_value(scope: LimitScope, name: &str, body: &Bytes) -> Result<i64, ApiError> {
    let body: serde_json::Map<String, Value> = if body.is_empty() {
        serde_json::Map::new()
    } else {
        match serde_json::from_slice::<Value>(body) {
            Ok(Value::Object(m)) => m,
            _ => return Err(ApiError::bad_request("body must be a JSON object")),
        }
    };
    let value = body
        .get("value")
        .ok_or_else(|| ApiError::bad_request("[{key_missing,value}]"))?;
    checked_limit(scope, name, value)
}

/// One limit's value, checked as RabbitMQ checks it (texts as RabbitMQ 3.10 words them per
/// scope; their angle brackets are not escaped, as RabbitMQ leaves them here).
pub fn checked_limit(scope: LimitScope, name: &str, value: &Value) -> Result<i64, ApiError> {
    let (prefix, suffix, noun) = match scope {
        LimitScope::Vhost => ("Validation failed\n\n", "\n", "limits"),
        LimitScope::User => ("", "", "user-limits"),
    };
    if !scope.accepts(name) {
        return Err(ApiError::bad_request(format!(
            "{prefix}Unrecognised terms [{{<<\"{name}\">>,{}}}] in {noun}{suffix}",
            erlang_term(value)
        )));
    }
    value.as_i64().ok_or_else(|| {
        ApiError::bad_request(format!(
            "{prefix}{name} should be a number, actually was {}{suffix}",
            erlang_term(value)
        ))
    })
}

// ------------------------------------------------------------------ vhost limits

async fn all_vhost_limits(State(api): ApiState, LoggedIn(who): LoggedIn) -> Answer {
    let open = |vhost: &str| {
        who.sees_all()
            || api
                .node
                .read(|n, _| n.broker().access().may_open(&who.name, vhost))
    };
    ok(listing(&api, LimitScope::Vhost, open))
}

async fn one_vhost_limits(
    State(api): ApiState,
    LoggedIn(who): LoggedIn,
    Path(vhost): Path<String>,
) -> Answer {
    let (exists, may_open) = api.node.read(|n, _| {
        let b = n.broker();
        (
            b.vhost_exists(&vhost),
            b.access().may_open(&who.name, &vhost),
        )
    });
    if !exists || !(who.sees_all() || may_open) {
        return Err(ApiError::not_found());
    }
    ok(listing(&api, LimitScope::Vhost, |v| v == vhost))
}

async fn put_vhost_limit(
    State(api): ApiState,
    _: Admin,
    Path((vhost, name)): Path<(String, String)>,
    body: Bytes,
) -> Answer {
    if !api.node.read(|n, _| n.broker().vhost_exists(&vhost)) {
        return Err(ApiError::vhost_not_found());
    }
    let value = limit_value(LimitScope::Vhost, &name, &body)?;
    api.node
        .write(|n, _| {
            n.broker_mut()
                .set_limit(LimitScope::Vhost, &vhost, &name, value)
        })?
        .map_err(|_| ApiError::vhost_not_found())?;
    done()
}

/// RabbitMQ answers a missing vhost or user here with a bare 500; Warren with 404.
async fn delete_vhost_limit(
    State(api): ApiState,
    _: Admin,
    Path((vhost, name)): Path<(String, String)>,
) -> Answer {
    api.node
        .write(|n, _| n.broker_mut().clear_limit(LimitScope::Vhost, &vhost, &name))?
        .map_err(|_| ApiError::vhost_not_found())?;
    done()
}

// ------------------------------------------------------------------ user limits

async fn all_user_limits(State(api): ApiState, LoggedIn(who): LoggedIn) -> Answer {
    ok(listing(&api, LimitScope::User, |u| {
        who.sees_all() || u == who.name
    }))
}

async fn one_user_limits(
    State(api): ApiState,
    LoggedIn(who): LoggedIn,
    Path(user): Path<String>,
) -> Answer {
    let exists = api
        .node
        .read(|n, _| n.broker().access().user(&user).is_some());
    if !exists || !(who.sees_all() || user == who.name) {
        return Err(ApiError::not_found());
    }
    ok(listing(&api, LimitScope::User, |u| u == user))
}

fn no_such_user(user: &str) -> ApiError {
    ApiError::bad_request_term(json!(["no_such_user", user]))
}

async fn put_user_limit(
    State(api): ApiState,
    _: Admin,
    Path((user, name)): Path<(String, String)>,
    body: Bytes,
) -> Answer {
    let value = limit_value(LimitScope::User, &name, &body)?;
    api.node
        .write(|n, _| {
            n.broker_mut()
                .set_limit(LimitScope::User, &user, &name, value)
        })?
        .map_err(|_| no_such_user(&user))?;
    done()
}

async fn delete_user_limit(
    State(api): ApiState,
    _: Admin,
    Path((user, name)): Path<(String, String)>,
) -> Answer {
    api.node
        .write(|n, _| n.broker_mut().clear_limit(LimitScope::User, &user, &name))?
        .map_err(|_| ApiError::not_found())?;
    done()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_checked_with_rabbitmq_texts() {
        let body = |s: &str| Bytes::copy_from_slice(s.as_bytes());
        let reason = |r: Result<i64, ApiError>| format!("{:?}", r.unwrap_err());
        assert_eq!(
            limit_value(LimitScope::Vhost, "max-queues", &body(r#"{"value":-1}"#)).ok(),
            Some(-1)
        );
        assert!(reason(limit_value(
            LimitScope::Vhost,
            "max-queues",
            &body(r#"{"value":"x"}"#)
        ))
        .contains(
            r#"Validation failed\n\nmax-queues should be a number, actually was <<\"x\">>\n"#
        ));
        assert!(reason(limit_value(
            LimitScope::Vhost,
            "max-channels",
            &body(r#"{"value":3}"#)
        ))
        .contains(r#"Unrecognised terms [{<<\"max-channels\">>,3}] in limits\n"#));
        assert!(reason(limit_value(
            LimitScope::User,
            "max-channels",
            &body(r#"{"value":2.5}"#)
        ))
        .contains(r#"reason: "max-channels should be a number, actually was 2.5""#));
        assert!(
            reason(limit_value(LimitScope::User, "max-channels", &body("{}")))
                .contains("[{key_missing,value}]")
        );
    }
}
