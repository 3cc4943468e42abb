//! Vhosts, users, permissions and topic permissions over the management API, with RabbitMQ's
//! paths, bodies and answers (201 made, 204 changed or deleted, 404 missing, 400 with
//! RabbitMQ's reasons). Administrators only, as in RabbitMQ.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::{json, Value};
use warren_broker::access::{
    AccessError, AccessKeyDef, HashAlgorithm, PermissionDef, TopicPermissionDef, UserDef,
};
use warren_broker::limits::{LimitScope, Limits};
use warren_broker::{Broker, VhostMetaChange};

use super::{passwords, Admin, Api, ApiError};

type ApiState = State<Arc<Api>>;
type Answer = Result<Response, ApiError>;

pub fn routes() -> Router<Arc<Api>> {
    Router::new()
        .route(
            "/api/vhosts/{vhost}",
            get(one_vhost).put(put_vhost).delete(delete_vhost),
        )
        .route("/api/vhosts/{vhost}/permissions", get(vhost_permissions))
        .route(
            "/api/vhosts/{vhost}/topic-permissions",
            get(vhost_topic_permissions),
        )
        .route("/api/users", get(users))
        .route(
            "/api/users/{user}",
            get(one_user).put(put_user).delete(delete_user),
        )
        .route("/api/users/{user}/permissions", get(user_permissions))
        .route(
            "/api/users/{user}/access-keys",
            get(user_access_keys).post(add_access_key),
        )
        .route(
            "/api/users/{user}/access-keys/{id}",
            axum::routing::delete(delete_access_key),
        )
        .route("/api/access-keys", get(access_keys))
        .route(
            "/api/users/{user}/topic-permissions",
            get(user_topic_permissions),
        )
        .route("/api/permissions", get(permissions))
        .route(
            "/api/permissions/{vhost}/{user}",
            get(one_permission)
                .put(put_permission)
                .delete(delete_permission),
        )
        .route("/api/topic-permissions", get(topic_permissions))
        .route(
            "/api/topic-permissions/{vhost}/{user}",
            get(one_topic_permission)
                .put(put_topic_permission)
                .delete(delete_topic_permission),
        )
}

fn ok(v: Value) -> Answer {
    Ok(Json(v).into_response())
}

fn made(new: bool) -> Answer {
    let status = if new {
        axum::http::StatusCode::CREATED
    } else {
        axum::http::StatusCode::NO_CONTENT
    };
    Ok(status.into_response())
}

fn found(yes: bool) -> Answer {
    if yes {
        made(false)
    } else {
        Err(ApiError::not_found())
    }
}

/// A JSON object body (an empty body is an empty object, as RabbitMQ reads it).
fn object(body: &Bytes) -> Result<serde_json::Map<String, Value>, ApiError> {
    if body.is_empty() {
        return Ok(serde_json::Map::new());
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Ok(m),
        _ => Err(ApiError::bad_request("body must be a JSON object")),
    }
}

/// RabbitMQ's answer to missing keys: `[{key_missing,write},{key_missing,read}]`.
fn required<'a>(
    body: &'a serde_json::Map<String, Value>,
    keys: &[&str],
) -> Result<Vec<&'a str>, ApiError> {
    let missing: Vec<String> = keys
        .iter()
        .filter(|k| !body.contains_key(**k))
        .map(|k| format!("{{key_missing,{k}}}"))
        .collect();
    if !missing.is_empty() {
        return Err(ApiError::bad_request(format!("[{}]", missing.join(","))));
    }
    keys.iter()
        .map(|k| {
            body.get(*k)
                .and_then(Value::as_str)
                .ok_or_else(|| ApiError::bad_request(format!("{k} must be a string")))
        })
        .collect()
}

fn refused(e: AccessError) -> ApiError {
    match e {
        AccessError::NoUser(_) | AccessError::NoVhost(_) => {
            ApiError::bad_request("vhost_or_user_not_found")
        }
        AccessError::BadPattern(..) => ApiError::bad_request(e.to_string()),
    }
}

// ------------------------------------------------------------------ vhosts

/// Administrators only: RabbitMQ 3.10 answers 401 "Not administrator user" to anyone else,
/// even for a vhost they may use (they see theirs in `/api/vhosts`).
async fn one_vhost(State(api): ApiState, _: Admin, Path(vhost): Path<String>) -> Answer {
    if !api.node.read(|n, _| n.broker().vhost_exists(&vhost)) {
        return Err(ApiError::not_found());
    }
    ok(super::routes::vhost_json(&api, &vhost))
}

/// A change to a vhost's metadata from a `PUT /api/vhosts/{name}` body or a definitions
/// entry (whose fields may sit in `metadata`, as RabbitMQ 3.11 exports them): `description`,
/// `tags` (a list or a comma-separated string) and `default_queue_type`. As in RabbitMQ, a
/// description or tags the body leaves out are emptied, and a default queue type it leaves
/// out is kept (a vhost's queues do not change type because a script made it again).
pub fn vhost_change(body: &serde_json::Map<String, Value>) -> Result<VhostMetaChange, ApiError> {
    let nested = body.get("metadata").and_then(Value::as_object);
    let field = |k: &str| body.get(k).or_else(|| nested.and_then(|m| m.get(k)));
    // `defaultqueuetype` is the older key, which RabbitMQ's web page sent; `undefined`
    // (3.12's exports) names no type and leaves the vhost's as it is.
    let default_queue_type = match field("default_queue_type").or_else(|| field("defaultqueuetype"))
    {
        None | Some(Value::Null) => None,
        Some(Value::String(t)) => warren_broker::vhost_meta::parse_default_queue_type(t)
            .map_err(|e| ApiError::bad_request(e.to_string()))?
            .map(Some),
        Some(_) => return Err(ApiError::bad_request("default_queue_type must be a string")),
    };
    Ok(VhostMetaChange {
        description: match field("description") {
            None | Some(Value::Null) => Some(String::new()),
            Some(Value::String(d)) => Some(d.clone()),
            Some(_) => return Err(ApiError::bad_request("description must be a string")),
        },
        tags: Some(tags(field("tags"))),
        default_queue_type,
    })
}

async fn put_vhost(
    State(api): ApiState,
    Admin(who): Admin,
    Path(vhost): Path<String>,
    body: Bytes,
) -> Answer {
    let change = vhost_change(&object(&body)?)?;
    // As RabbitMQ does, whoever makes a vhost through the API may do everything in it; a
    // PUT of one that exists changes its metadata (RabbitMQ 3.11).
    made(api.node.write(|n, _| -> Result<bool, ApiError> {
        let new = n
            .broker_mut()
            .put_vhost(&vhost, &change)
            .map_err(|e| ApiError::bad_request(e.to_string()))?;
        if new {
            let all = PermissionDef {
                user: who.name.clone(),
                vhost: vhost.clone(),
                configure: ".*".into(),
                write: ".*".into(),
                read: ".*".into(),
            };
            if let Err(e) = n.broker_mut().set_permission(all) {
                tracing::warn!(user = %who.name, vhost = %vhost, error = %e, "no permissions for the vhost's maker");
            }
        }
        Ok(new)
    })??)
}

async fn delete_vhost(State(api): ApiState, _: Admin, Path(vhost): Path<String>) -> Answer {
    found(api.node.write(|n, now| n.delete_vhost(&vhost, now))?)
}

// ------------------------------------------------------------------ users

pub fn user_json(u: &UserDef, limits: Option<&Limits>) -> Value {
    json!({
        "name": u.name,
        "password_hash": u.hash.as_ref().map(passwords::encode).unwrap_or_default(),
        "hashing_algorithm": u.hash.as_ref().map_or(HashAlgorithm::Sha256, |h| h.algorithm).rabbitmq_name(),
        "tags": u.tags,
        "limits": limits.map_or_else(|| json!({}), super::limits::limits_json),
    })
}

/// Users with their limits, as `/api/users` and definitions show them.
pub fn users_json<'a>(broker: &Broker, users: impl Iterator<Item = &'a UserDef>) -> Value {
    users
        .map(|u| user_json(u, broker.limits().of(LimitScope::User, &u.name)))
        .collect()
}

/// Tags as RabbitMQ takes them: a comma-separated string or a list.
pub fn tags(v: Option<&Value>) -> Vec<String> {
    match v {
        Some(Value::String(s)) => s
            .split(',')
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .map(str::to_owned)
            .collect(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(Value::as_str)
            .map(str::to_owned)
            .collect(),
        _ => Vec::new(),
    }
}

/// A user from a PUT body or a definitions entry: `password` (hashed here), or
/// `password_hash` with `hashing_algorithm`; neither makes a user without a password.
pub fn user_from(name: &str, body: &serde_json::Map<String, Value>) -> Result<UserDef, ApiError> {
    let algorithm = match body.get("hashing_algorithm").and_then(Value::as_str) {
        None => HashAlgorithm::Sha256,
        Some(a) => HashAlgorithm::from_rabbitmq_name(a)
            .ok_or_else(|| ApiError::bad_request(format!("unknown hashing_algorithm {a}")))?,
    };
    let hash = match (
        body.get("password").and_then(Value::as_str),
        body.get("password_hash").and_then(Value::as_str),
    ) {
        (Some(p), _) => Some(passwords::hash(p)),
        (None, Some("")) | (None, None) => None,
        (None, Some(h)) => Some(passwords::decode(h, algorithm).ok_or_else(|| {
            ApiError::bad_request("password_hash is not a hash of its hashing_algorithm")
        })?),
    };
    Ok(UserDef {
        name: name.to_owned(),
        hash,
        tags: tags(body.get("tags")),
    })
}

async fn users(State(api): ApiState, _: Admin) -> Answer {
    ok(api
        .node
        .read(|n, _| users_json(n.broker(), n.broker().access().users())))
}

async fn one_user(State(api): ApiState, _: Admin, Path(user): Path<String>) -> Answer {
    let u = api.node.read(|n, _| {
        let b = n.broker();
        b.access()
            .user(&user)
            .map(|u| user_json(u, b.limits().of(LimitScope::User, &u.name)))
    });
    ok(u.ok_or_else(ApiError::not_found)?)
}

async fn put_user(State(api): ApiState, _: Admin, Path(user): Path<String>, body: Bytes) -> Answer {
    let def = user_from(&user, &object(&body)?)?;
    made(api.node.write(|n, _| {
        let new = n.broker().access().user(&user).is_none();
        n.broker_mut().put_user(def);
        new
    })?)
}

async fn delete_user(State(api): ApiState, _: Admin, Path(user): Path<String>) -> Answer {
    found(api.node.write(|n, now| n.delete_user(&user, now))?)
}

// ------------------------------------------------------------------ SQS access keys

/// A key as listed: never its secret, which is shown once, when it is made.
fn access_key_json(k: &AccessKeyDef) -> Value {
    json!({"access_key_id": k.id, "user": k.user, "created": k.created_ms})
}

/// Random characters from `alphabet` (its length divides 256, so each is equally likely).
fn random_text(alphabet: &[u8], n: usize) -> Result<String, ApiError> {
    let mut bytes = vec![0u8; n];
    getrandom::getrandom(&mut bytes)
        .map_err(|e| ApiError::internal(format!("no randomness for an access key: {e}")))?;
    Ok(bytes
        .iter()
        .map(|b| char::from(alphabet[usize::from(*b) % alphabet.len()]))
        .collect())
}

/// A new key: an id of 20 capitals and digits (`WKIA` then 16 of base32's alphabet, in the
/// shape of AWS's key ids) and a secret of 40 base64 characters, as AWS's are.
fn new_access_key(user: &str, now_ms: u64) -> Result<AccessKeyDef, ApiError> {
    const ID: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
    const SECRET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    Ok(AccessKeyDef {
        id: format!("WKIA{}", random_text(ID, 16)?),
        secret: random_text(SECRET, 40)?,
        user: user.to_owned(),
        created_ms: now_ms,
    })
}

async fn user_access_keys(State(api): ApiState, _: Admin, Path(user): Path<String>) -> Answer {
    let keys = api.node.read(|n, _| {
        let access = n.broker().access();
        access.user(&user).map(|_| {
            access
                .access_keys()
                .filter(|k| k.user == user)
                .map(access_key_json)
                .collect::<Vec<_>>()
        })
    });
    ok(Value::Array(keys.ok_or_else(ApiError::not_found)?))
}

async fn access_keys(State(api): ApiState, _: Admin) -> Answer {
    ok(api.node.read(|n, _| {
        n.broker()
            .access()
            .access_keys()
            .map(access_key_json)
            .collect()
    }))
}

/// Makes a key for the user: 201 with its id and secret (the only time the secret is shown).
async fn add_access_key(State(api): ApiState, _: Admin, Path(user): Path<String>) -> Answer {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    let key = new_access_key(&user, now)?;
    api.node
        .write(|n, _| n.broker_mut().put_access_key(key.clone()))?
        .map_err(|_| ApiError::not_found())?;
    tracing::info!(user = %user, key = %key.id, "SQS access key made");
    let body = json!({
        "access_key_id": key.id,
        "secret_access_key": key.secret,
        "user": key.user,
        "created": key.created_ms,
    });
    Ok((axum::http::StatusCode::CREATED, Json(body)).into_response())
}

async fn delete_access_key(
    State(api): ApiState,
    _: Admin,
    Path((user, id)): Path<(String, String)>,
) -> Answer {
    let deleted = api.node.write(|n, _| {
        let theirs = n
            .broker()
            .access()
            .access_key(&id)
            .is_some_and(|k| k.user == user);
        theirs && n.broker_mut().delete_access_key(&id)
    })?;
    if deleted {
        tracing::info!(user = %user, key = %id, "SQS access key deleted");
    }
    found(deleted)
}

// ------------------------------------------------------------------ permissions

pub fn permission_json(p: &PermissionDef) -> Value {
    json!({"user": p.user, "vhost": p.vhost, "configure": p.configure, "write": p.write, "read": p.read})
}

pub fn topic_json(t: &TopicPermissionDef) -> Value {
    json!({"user": t.user, "vhost": t.vhost, "exchange": t.exchange, "write": t.write, "read": t.read})
}

fn permissions_where(api: &Api, keep: impl Fn(&PermissionDef) -> bool) -> Value {
    api.node.read(|n, _| {
        n.broker()
            .access()
            .permissions()
            .filter(|p| keep(p))
            .map(permission_json)
            .collect()
    })
}

fn topics_where(api: &Api, keep: impl Fn(&TopicPermissionDef) -> bool) -> Value {
    api.node.read(|n, _| {
        n.broker()
            .access()
            .topic_permissions()
            .filter(|t| keep(t))
            .map(topic_json)
            .collect()
    })
}

async fn permissions(State(api): ApiState, _: Admin) -> Answer {
    ok(permissions_where(&api, |_| true))
}

async fn topic_permissions(State(api): ApiState, _: Admin) -> Answer {
    ok(topics_where(&api, |_| true))
}

fn user_must_exist(api: &Api, user: &str) -> Result<(), ApiError> {
    if api
        .node
        .read(|n, _| n.broker().access().user(user).is_some())
    {
        Ok(())
    } else {
        Err(ApiError::not_found())
    }
}

fn vhost_must_exist(api: &Api, vhost: &str) -> Result<(), ApiError> {
    if api.node.read(|n, _| n.broker().vhost_exists(vhost)) {
        Ok(())
    } else {
        Err(ApiError::not_found())
    }
}

async fn user_permissions(State(api): ApiState, _: Admin, Path(user): Path<String>) -> Answer {
    user_must_exist(&api, &user)?;
    ok(permissions_where(&api, |p| p.user == user))
}

async fn user_topic_permissions(
    State(api): ApiState,
    _: Admin,
    Path(user): Path<String>,
) -> Answer {
    user_must_exist(&api, &user)?;
    ok(topics_where(&api, |t| t.user == user))
}

async fn vhost_permissions(State(api): ApiState, _: Admin, Path(vhost): Path<String>) -> Answer {
    vhost_must_exist(&api, &vhost)?;
    ok(permissions_where(&api, |p| p.vhost == vhost))
}

async fn vhost_topic_permissions(
    State(api): ApiState,
    _: Admin,
    Path(vhost): Path<String>,
) -> Answer {
    vhost_must_exist(&api, &vhost)?;
    ok(topics_where(&api, |t| t.vhost == vhost))
}

async fn one_permission(
    State(api): ApiState,
    _: Admin,
    Path((vhost, user)): Path<(String, String)>,
) -> Answer {
    let p = api.node.read(|n, _| {
        n.broker()
            .access()
            .permission(&user, &vhost)
            .map(permission_json)
    });
    ok(p.ok_or_else(ApiError::not_found)?)
}

async fn put_permission(
    State(api): ApiState,
    _: Admin,
    Path((vhost, user)): Path<(String, String)>,
    body: Bytes,
) -> Answer {
    let body = object(&body)?;
    let v = required(&body, &["configure", "write", "read"])?;
    let def = PermissionDef {
        user: user.clone(),
        vhost: vhost.clone(),
        configure: v[0].to_owned(),
        write: v[1].to_owned(),
        read: v[2].to_owned(),
    };
    let new = api.node.write(|n, _| {
        let new = n.broker().access().permission(&user, &vhost).is_none();
        n.broker_mut().set_permission(def).map(|()| new)
    })?;
    made(new.map_err(refused)?)
}

async fn delete_permission(
    State(api): ApiState,
    _: Admin,
    Path((vhost, user)): Path<(String, String)>,
) -> Answer {
    found(
        api.node
            .write(|n, _| n.broker_mut().clear_permission(&user, &vhost))?,
    )
}

async fn one_topic_permission(
    State(api): ApiState,
    _: Admin,
    Path((vhost, user)): Path<(String, String)>,
) -> Answer {
    let list = topics_where(&api, |t| t.user == user && t.vhost == vhost);
    if list.as_array().is_some_and(Vec::is_empty) {
        return Err(ApiError::not_found());
    }
    ok(list)
}

async fn put_topic_permission(
    State(api): ApiState,
    _: Admin,
    Path((vhost, user)): Path<(String, String)>,
    body: Bytes,
) -> Answer {
    let body = object(&body)?;
    let v = required(&body, &["exchange", "write", "read"])?;
    let def = TopicPermissionDef {
        user: user.clone(),
        vhost: vhost.clone(),
        exchange: v[0].to_owned(),
        write: v[1].to_owned(),
        read: v[2].to_owned(),
    };
    let new = api.node.write(|n, _| {
        let new = !n
            .broker()
            .access()
            .topic_permissions()
            .any(|t| t.user == user && t.vhost == vhost && t.exchange == def.exchange);
        n.broker_mut().set_topic_permission(def).map(|()| new)
    })?;
    made(new.map_err(refused)?)
}

async fn delete_topic_permission(
    State(api): ApiState,
    _: Admin,
    Path((vhost, user)): Path<(String, String)>,
) -> Answer {
    found(api.node.write(|n, _| {
        let any = n
            .broker()
            .access()
            .topic_permissions()
            .any(|t| t.user == user && t.vhost == vhost);
        n.broker_mut().clear_topic_permission(&user, &vhost, None);
        any
    })?)
}
