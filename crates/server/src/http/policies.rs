//! Policies over the management API, with RabbitMQ's paths, bodies and answers:
//! `/api/policies[/{vhost}[/{name}]]` (administrators and policymakers, in the vhosts they
//! may open) and `/api/operator-policies[/{vhost}[/{name}]]` (administrators).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::{json, Map, Value};
use warren_broker::policy::{self, Definition, PolicyDef, PolicyError, PolicyKind, PolicyValue};

use super::{Api, ApiError, Level, LoggedIn, Login};

type ApiState = State<Arc<Api>>;
type Answer = Result<Response, ApiError>;

pub fn routes() -> Router<Arc<Api>> {
    Router::new()
        .route("/api/policies", get(list_all))
        .route("/api/policies/{vhost}", get(list_vhost))
        .route(
            "/api/policies/{vhost}/{name}",
            get(get_one).put(put_one).delete(delete_one),
        )
        .route("/api/operator-policies", get(op_list_all))
        .route("/api/operator-policies/{vhost}", get(op_list_vhost))
        .route(
            "/api/operator-policies/{vhost}/{name}",
            get(op_get_one).put(op_put_one).delete(op_delete_one),
        )
}

/// `rabbit_mgmt_util:is_authorized_policies/2` (administrators, policymakers) and
/// `is_authorized_admin/2` for operator policies.
fn allowed(who: &Login, kind: PolicyKind) -> Result<(), ApiError> {
    match kind {
        PolicyKind::Operator => who.require(Level::Administrator),
        PolicyKind::User
            if who.level == Level::Administrator || who.tags.iter().any(|t| t == "policymaker") =>
        {
            Ok(())
        }
        PolicyKind::User => Err(ApiError::not_allowed(
            "User not authorised to access object",
        )),
    }
}

fn value_json(v: &PolicyValue) -> Value {
    match v {
        PolicyValue::Str(s) => s.as_str().into(),
        PolicyValue::Int(i) => (*i).into(),
        PolicyValue::Bool(b) => (*b).into(),
        PolicyValue::Other { json, .. } => {
            serde_json::from_str(json).unwrap_or_else(|_| json.as_str().into())
        }
    }
}

/// A definition as a JSON object.
pub fn definition_json(d: &Definition) -> Value {
    d.iter()
        .map(|(k, v)| (k.clone(), value_json(v)))
        .collect::<Map<String, Value>>()
        .into()
}

/// A policy as RabbitMQ lists it.
pub fn policy_json(p: &PolicyDef) -> Value {
    json!({
        "vhost": p.vhost,
        "name": p.name,
        "pattern": p.pattern,
        "apply-to": p.apply_to.as_str(),
        "definition": definition_json(&p.definition),
        "priority": p.priority,
    })
}

/// An operator policy as RabbitMQ keeps it, lists it under `/api/parameters` and exports it: a
/// runtime parameter of the `operator_policy` component whose value is the policy's body.
pub fn operator_policy_parameter(p: &PolicyDef) -> Value {
    json!({
        "value": {
            "pattern": p.pattern,
            "definition": definition_json(&p.definition),
            "priority": p.priority,
            "apply-to": p.apply_to.as_str(),
        },
        "vhost": p.vhost,
        "component": super::definitions::OPERATOR_POLICY,
        "name": p.name,
    })
}

/// A JSON term as Erlang's `~p` prints what RabbitMQ decoded it to.
pub(crate) fn erl(v: &Value) -> String {
    match v {
        Value::String(s) => format!("<<{}>>", quoted(s)),
        Value::Array(a) => format!("[{}]", a.iter().map(erl).collect::<Vec<_>>().join(",")),
        Value::Object(m) => format!(
            "#{{{}}}",
            m.iter()
                .map(|(k, v)| format!("<<{}>> => {}", quoted(k), erl(v)))
                .collect::<Vec<_>>()
                .join(",")
        ),
        other => other.to_string(),
    }
}

fn quoted(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_default()
}

fn policy_value(v: &Value) -> PolicyValue {
    match v {
        Value::String(s) => PolicyValue::Str(s.clone()),
        Value::Bool(b) => PolicyValue::Bool(*b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => PolicyValue::Int(i),
            None => PolicyValue::Other {
                json: n.to_string(),
                erl: n.to_string(),
            },
        },
        other => PolicyValue::Other {
            json: other.to_string(),
            erl: erl(other),
        },
    }
}

fn invalid(reason: String) -> ApiError {
    ApiError::validation(&PolicyError::Invalid(reason).to_string())
}

/// A policy from a PUT body or a definitions entry (`pattern` and `definition` required,
/// `priority` 0 and `apply-to` `all` unless given), checked as `rabbit_policy` checks it.
pub fn policy_from(
    vhost: &str,
    name: &str,
    kind: PolicyKind,
    body: &Map<String, Value>,
) -> Result<PolicyDef, ApiError> {
    let field = |key: &str| {
        body.get(key)
            .ok_or_else(|| ApiError::bad_request(format!("[{{key_missing,{key}}}]")))
    };
    let (pattern, definition) = (field("pattern")?, field("definition")?);
    let pattern = match pattern {
        Value::String(s) => s.clone(),
        other => {
            return Err(invalid(format!(
                "pattern should be a binary but is {}",
                erl(other)
            )))
        }
    };
    let priority = match body.get("priority") {
        None | Some(Value::Null) => 0,
        Some(Value::Number(n)) if n.as_i64().is_some() => n.as_i64().unwrap_or(0),
        // RabbitMQ takes any number; a whole one written as a float is the same priority.
        Some(Value::Number(n))
            if n.as_f64()
                .is_some_and(|f| f.fract() == 0.0 && f.abs() < 9.0e15) =>
        {
            n.as_f64().map_or(0, |f| f as i64)
        }
        // rabbitmqadmin and the web page send it as a string.
        Some(Value::String(s)) if s.trim().parse::<i64>().is_ok() => s.trim().parse().unwrap_or(0),
        Some(other) => {
            return Err(invalid(format!(
                "priority should be a number, actually was {}",
                erl(other)
            )))
        }
    };
    let apply_to = match body.get("apply-to") {
        None | Some(Value::Null) => policy::ApplyTo::All,
        Some(Value::String(s)) => policy::parse_apply_to(s).map_err(policy_error)?,
        Some(other) => policy::parse_apply_to(&erl(other)).map_err(policy_error)?,
    };
    let definition: Definition = match definition {
        Value::Object(m) => m
            .iter()
            .map(|(k, v)| (k.clone(), policy_value(v)))
            .collect(),
        other => {
            return Err(invalid(format!(
                "definition must be a dictionary: {}",
                erl(other)
            )))
        }
    };
    policy::validate_pattern(&pattern).map_err(policy_error)?;
    policy::validate_definition(kind, &definition).map_err(policy_error)?;
    Ok(PolicyDef {
        vhost: vhost.to_owned(),
        name: name.to_owned(),
        kind,
        pattern,
        apply_to,
        priority,
        definition,
    })
}

fn policy_error(e: PolicyError) -> ApiError {
    match e {
        PolicyError::NoVhost(_) => ApiError::vhost_not_found(),
        PolicyError::Invalid(_) => ApiError::validation(&e.to_string()),
    }
}

fn listing(api: &Api, who: &Login, kind: PolicyKind, vhost: Option<&str>) -> Value {
    api.node.read(|n, _| {
        let b = n.broker();
        b.policies()
            .list(kind, vhost)
            .filter(|p| who.sees_vhost(b.access(), &p.vhost))
            .map(policy_json)
            .collect()
    })
}

async fn list(api: Arc<Api>, who: Login, kind: PolicyKind, vhost: Option<String>) -> Answer {
    allowed(&who, kind)?;
    if let Some(v) = &vhost {
        if !api.node.read(|n, _| n.broker().vhost_exists(v)) {
            return Err(ApiError::not_found());
        }
    }
    Ok(Json(listing(&api, &who, kind, vhost.as_deref())).into_response())
}

async fn one(api: Arc<Api>, who: Login, kind: PolicyKind, vhost: String, name: String) -> Answer {
    shown(&api, &who, kind, &vhost, &name, policy_json)
}

/// One policy, as `json` shows it: 404 if there is none.
fn shown(
    api: &Api,
    who: &Login,
    kind: PolicyKind,
    vhost: &str,
    name: &str,
    json: fn(&PolicyDef) -> Value,
) -> Answer {
    allowed(who, kind)?;
    api.node
        .read(|n, _| n.broker().policies().get(vhost, kind, name).map(json))
        .map(|p| Json(p).into_response())
        .ok_or_else(ApiError::not_found)
}

/// An operator policy as the runtime parameter RabbitMQ keeps it as
/// (`/api/parameters/operator_policy/V/N`).
pub(super) fn operator_parameter(api: &Api, who: &Login, vhost: &str, name: &str) -> Answer {
    shown(
        api,
        who,
        PolicyKind::Operator,
        vhost,
        name,
        operator_policy_parameter,
    )
}

/// 201 for a new policy, 204 for a replaced one (as RabbitMQ's REST handler answers).
pub(super) async fn put(
    api: Arc<Api>,
    who: Login,
    kind: PolicyKind,
    vhost: String,
    name: String,
    body: Bytes,
) -> Answer {
    allowed(&who, kind)?;
    if !api.node.read(|n, _| n.broker().vhost_exists(&vhost)) {
        return Err(ApiError::vhost_not_found());
    }
    let body = match serde_json::from_slice::<Value>(&body) {
        Ok(Value::Object(m)) => m,
        _ => return Err(ApiError::bad_request("body must be a JSON object")),
    };
    let def = policy_from(&vhost, &name, kind, &body)?;
    let existed = api.node.write(|n, _| {
        let b = n.broker_mut();
        let existed = b.policies().get(&vhost, kind, &name).is_some();
        b.set_policy(def).map(|()| existed)
    })?;
    match existed.map_err(policy_error)? {
        true => Ok(StatusCode::NO_CONTENT.into_response()),
        false => Ok(StatusCode::CREATED.into_response()),
    }
}

pub(super) async fn delete(
    api: Arc<Api>,
    who: Login,
    kind: PolicyKind,
    vhost: String,
    name: String,
) -> Answer {
    allowed(&who, kind)?;
    if api
        .node
        .write(|n, _| n.broker_mut().clear_policy(&vhost, kind, &name))?
    {
        Ok(StatusCode::NO_CONTENT.into_response())
    } else {
        Err(ApiError::not_found())
    }
}

async fn list_all(State(api): ApiState, LoggedIn(who): LoggedIn) -> Answer {
    list(api, who, PolicyKind::User, None).await
}

async fn list_vhost(
    State(api): ApiState,
    LoggedIn(who): LoggedIn,
    Path(vhost): Path<String>,
) -> Answer {
    list(api, who, PolicyKind::User, Some(vhost)).await
}

async fn get_one(
    State(api): ApiState,
    LoggedIn(who): LoggedIn,
    Path((vhost, name)): Path<(String, String)>,
) -> Answer {
    one(api, who, PolicyKind::User, vhost, name).await
}

async fn put_one(
    State(api): ApiState,
    LoggedIn(who): LoggedIn,
    Path((vhost, name)): Path<(String, String)>,
    body: Bytes,
) -> Answer {
    put(api, who, PolicyKind::User, vhost, name, body).await
}

async fn delete_one(
    State(api): ApiState,
    LoggedIn(who): LoggedIn,
    Path((vhost, name)): Path<(String, String)>,
) -> Answer {
    delete(api, who, PolicyKind::User, vhost, name).await
}

async fn op_list_all(State(api): ApiState, LoggedIn(who): LoggedIn) -> Answer {
    list(api, who, PolicyKind::Operator, None).await
}

async fn op_list_vhost(
    State(api): ApiState,
    LoggedIn(who): LoggedIn,
    Path(vhost): Path<String>,
) -> Answer {
    list(api, who, PolicyKind::Operator, Some(vhost)).await
}

async fn op_get_one(
    State(api): ApiState,
    LoggedIn(who): LoggedIn,
    Path((vhost, name)): Path<(String, String)>,
) -> Answer {
    one(api, who, PolicyKind::Operator, vhost, name).await
}

async fn op_put_one(
    State(api): ApiState,
    LoggedIn(who): LoggedIn,
    Path((vhost, name)): Path<(String, String)>,
    body: Bytes,
) -> Answer {
    put(api, who, PolicyKind::Operator, vhost, name, body).await
}

async fn op_delete_one(
    State(api): ApiState,
    LoggedIn(who): LoggedIn,
    Path((vhost, name)): Path<(String, String)>,
) -> Answer {
    delete(api, who, PolicyKind::Operator, vhost, name).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(s: &str) -> Map<String, Value> {
        match serde_json::from_str(s) {
            Ok(Value::Object(m)) => m,
            _ => panic!("not an object: {s}"),
        }
    }

    fn reason(s: &str) -> String {
        let e = policy_from("/", "p", PolicyKind::User, &body(s)).unwrap_err();
        format!("{e:?}")
    }

    #[test]
    fn bodies_are_checked_with_rabbitmq_texts() {
        let p = policy_from(
            "/",
            "p",
            PolicyKind::User,
            &body(r#"{"pattern":"^a","definition":{"max-length":5},"priority":"2","apply-to":"queues"}"#),
        )
        .expect("valid");
        assert_eq!((p.priority, p.apply_to.as_str()), (2, "queues"));
        let f = policy_from(
            "/",
            "p",
            PolicyKind::User,
            &body(r#"{"pattern":".*","definition":{"max-length":5},"priority":3.0}"#),
        )
        .expect("a whole float");
        assert_eq!(f.priority, 3);
        assert_eq!(p.definition.get("max-length"), Some(&PolicyValue::Int(5)));
        // Mirroring keys are kept as given (RabbitMQ 3.x definitions carry them).
        let ha = policy_from(
            "/",
            "ha",
            PolicyKind::User,
            &body(r#"{"pattern":".*","definition":{"ha-mode":"nodes","ha-params":["rabbit@a"]}}"#),
        )
        .expect("valid");
        assert_eq!(
            definition_json(&ha.definition),
            json!({"ha-mode": "nodes", "ha-params": ["rabbit@a"]})
        );
        assert!(reason(r#"{"definition":{}}"#).contains("[{key_missing,pattern}]"));
        assert!(
            reason(r#"{"pattern":".*","definition":{"max-length":"ten"}}"#).contains(
                r#"Validation failed\n\n&lt;&lt;\"ten\"&gt;&gt; is not a valid maximum length\n"#
            )
        );
        assert!(
            reason(r#"{"pattern":".*","definition":{"message-ttl":1.5}}"#)
                .contains(r#"1.5 is not a valid message TTL"#)
        );
        assert!(reason(r#"{"pattern":".*","definition":{"foo":[1]}}"#)
            .contains(r#"[{&lt;&lt;\"foo\"&gt;&gt;,[1]}] are not recognised policy settings"#));
        assert!(
            reason(r#"{"pattern":".*","definition":{"max-length":1},"priority":"x"}"#)
                .contains(r#"priority should be a number, actually was &lt;&lt;\"x\"&gt;&gt;"#)
        );
        assert!(
            reason(r#"{"pattern":".*","definition":{"max-length":1},"apply-to":"bindings"}"#)
                .contains("apply-to 'bindings' unrecognised")
        );
    }
}
