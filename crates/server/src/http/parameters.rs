//! Runtime parameters and shovels over the management API, with RabbitMQ's paths, bodies and
//! answers: `/api/parameters[/{component}[/{vhost}[/{name}]]]` (administrators and
//! policymakers; the components are `shovel` and `vhost-limits`, which RabbitMQ lists here
//! as well as under `/api/vhost-limits`), and the shovel plugin's
//! `/api/shovels[/{vhost}]`, `/api/shovels/vhost/{vhost}/{name}[/restart]`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get};
use axum::{Json, Router};
use serde_json::{json, Value};
use warren_broker::limits::{LimitScope, Limits};
use warren_broker::parameters::ParameterDef;
use warren_broker::policy::PolicyKind;

use super::{Api, ApiError, Level, LoggedIn, Login};
use crate::shovel::{self, COMPONENT};

type ApiState = State<Arc<Api>>;
type Answer = Result<Response, ApiError>;

pub fn routes() -> Router<Arc<Api>> {
    Router::new()
        .route("/api/parameters", get(list_all))
        .route("/api/parameters/{component}", get(list_component))
        .route("/api/parameters/{component}/{vhost}", get(list_vhost))
        .route(
            "/api/parameters/{component}/{vhost}/{name}",
            get(get_one).put(put_one).delete(delete_one),
        )
        .route("/api/shovels", get(shovels_all))
        .route("/api/shovels/{vhost}", get(shovels_vhost))
        .route("/api/shovels/vhost/{vhost}/{name}", get(shovel_one))
        .route(
            "/api/shovels/vhost/{vhost}/{name}/restart",
            delete(restart_shovel),
        )
}

/// `rabbit_mgmt_util:is_authorized_policies/2`: administrators and policymakers.
fn allowed(who: &Login) -> Result<(), ApiError> {
    if who.level == Level::Administrator || who.tags.iter().any(|t| t == "policymaker") {
        Ok(())
    } else {
        Err(ApiError::not_allowed(
            "User not authorised to access object",
        ))
    }
}

/// A parameter as RabbitMQ lists it (its value as the JSON it was set with).
pub fn parameter_json(p: &ParameterDef) -> Value {
    json!({
        "value": serde_json::from_str::<Value>(&p.value).unwrap_or_else(|_| p.value.as_str().into()),
        "vhost": p.vhost,
        "component": p.component,
        "name": p.name,
    })
}

/// RabbitMQ's answer to a value its component refuses.
fn validation_failed(lines: &[String]) -> ApiError {
    ApiError::validation(&format!("Validation failed\n\n{}\n", lines.join("\n")))
}

/// Checks a value for `component`, as it will be stored (its JSON text).
pub fn checked_value(component: &str, name: &str, value: &Value) -> Result<String, ApiError> {
    if component != COMPONENT {
        return Err(validation_failed(&[format!(
            "component {component} not found"
        )]));
    }
    shovel::definition::parse(name, value).map_err(|e| validation_failed(&e))?;
    Ok(value.to_string())
}

/// A vhost's limits are RabbitMQ's runtime parameter `vhost-limits`, named `limits`, whose
/// value is every limit of the vhost.
pub(super) const VHOST_LIMITS: &str = "vhost-limits";
const LIMITS: &str = "limits";

pub(super) fn vhost_limits_json(vhost: &str, limits: &Limits) -> Value {
    json!({
        "value": super::limits::limits_json(limits),
        "vhost": vhost,
        "component": VHOST_LIMITS,
        "name": LIMITS,
    })
}

fn listing(api: &Api, who: &Login, component: Option<&str>, vhost: Option<&str>) -> Value {
    api.node.read(|n, _| {
        let b = n.broker();
        // The limits first, as RabbitMQ lists them.
        let mut out: Vec<Value> = Vec::new();
        if component.is_none_or(|c| c == VHOST_LIMITS) {
            out.extend(
                b.limits()
                    .all(LimitScope::Vhost)
                    .filter(|(v, _)| vhost.is_none_or(|x| x == *v))
                    .filter(|(v, _)| who.sees_vhost(b.access(), v))
                    .map(|(v, limits)| vhost_limits_json(v, limits)),
            );
        }
        if component.is_none_or(|c| c == super::definitions::OPERATOR_POLICY) {
            out.extend(
                b.policies()
                    .list(PolicyKind::Operator, vhost)
                    .filter(|p| who.sees_vhost(b.access(), &p.vhost))
                    .map(super::policies::operator_policy_parameter),
            );
        }
        out.extend(
            b.parameters()
                .list(component, vhost)
                .filter(|p| who.sees_vhost(b.access(), &p.vhost))
                .map(parameter_json),
        );
        Value::Array(out)
    })
}

/// A vhost's limits, as a parameter (`None`: it has none, or the user may not see them).
fn vhost_limits(api: &Api, who: &Login, vhost: &str) -> Option<Value> {
    api.node.read(|n, _| {
        let b = n.broker();
        if !who.sees_vhost(b.access(), vhost) {
            return None;
        }
        b.limits()
            .of(LimitScope::Vhost, vhost)
            .map(|l| vhost_limits_json(vhost, l))
    })
}

/// `PUT /api/parameters/vhost-limits/{vhost}/limits`: the value replaces every limit of the
/// vhost. Setting limits needs the administrator tag, as `/api/vhost-limits` does (RabbitMQ
/// lets a policymaker do it through this path).
fn put_vhost_limits(api: &Api, who: &Login, vhost: &str, name: &str, value: &Value) -> Answer {
    if who.level != Level::Administrator {
        return Err(ApiError::not_allowed(
            "User not authorised to access object",
        ));
    }
    if name != LIMITS {
        return Err(ApiError::not_found());
    }
    let Some(map) = value.as_object() else {
        return Err(ApiError::bad_request(format!(
            "Validation failed\n\n{value} is not a JSON object of limits\n"
        )));
    };
    let mut limits = Limits::default();
    for (k, v) in map {
        limits.set(k, super::limits::checked_limit(LimitScope::Vhost, k, v)?);
    }
    let existed = api.node.write(|n, _| {
        let b = n.broker_mut();
        let existed = b.limits().of(LimitScope::Vhost, vhost).is_some();
        b.put_limits(LimitScope::Vhost, vhost, limits);
        existed
    })?;
    Ok(if existed {
        StatusCode::NO_CONTENT
    } else {
        StatusCode::CREATED
    }
    .into_response())
}

async fn list_all(State(api): ApiState, LoggedIn(who): LoggedIn) -> Answer {
    allowed(&who)?;
    Ok(Json(listing(&api, &who, None, None)).into_response())
}

async fn list_component(
    State(api): ApiState,
    LoggedIn(who): LoggedIn,
    Path(component): Path<String>,
) -> Answer {
    allowed(&who)?;
    Ok(Json(listing(&api, &who, Some(&component), None)).into_response())
}

async fn list_vhost(
    State(api): ApiState,
    LoggedIn(who): LoggedIn,
    Path((component, vhost)): Path<(String, String)>,
) -> Answer {
    allowed(&who)?;
    if !api.node.read(|n, _| n.broker().vhost_exists(&vhost)) {
        return Err(ApiError::not_found());
    }
    Ok(Json(listing(&api, &who, Some(&component), Some(&vhost))).into_response())
}

async fn get_one(
    State(api): ApiState,
    LoggedIn(who): LoggedIn,
    Path((component, vhost, name)): Path<(String, String, String)>,
) -> Answer {
    allowed(&who)?;
    if component == super::definitions::OPERATOR_POLICY {
        return super::policies::operator_parameter(&api, &who, &vhost, &name);
    }
    if component == VHOST_LIMITS {
        return vhost_limits(&api, &who, &vhost)
            .filter(|_| name == LIMITS)
            .map(|p| Json(p).into_response())
            .ok_or_else(ApiError::not_found);
    }
    api.node
        .read(|n, _| {
            let b = n.broker();
            b.parameters()
                .get(&component, &vhost, &name)
                .filter(|p| who.sees_vhost(b.access(), &p.vhost))
                .map(parameter_json)
        })
        .map(|p| Json(p).into_response())
        .ok_or_else(ApiError::not_found)
}

/// 201 for a new parameter, 204 for a replaced one.
async fn put_one(
    State(api): ApiState,
    LoggedIn(who): LoggedIn,
    Path((component, vhost, name)): Path<(String, String, String)>,
    body: Bytes,
) -> Answer {
    allowed(&who)?;
    if !api.node.read(|n, _| n.broker().vhost_exists(&vhost)) {
        return Err(ApiError::vhost_not_found());
    }
    let body = match serde_json::from_slice::<Value>(&body) {
        Ok(Value::Object(m)) => m,
        _ => return Err(ApiError::bad_request("body must be a JSON object")),
    };
    let Some(value) = body.get("value") else {
        return Err(ApiError::bad_request("[{key_missing,value}]"));
    };
    let may_open = |v: &str| api.node.read(|n, _| who.sees_vhost(n.broker().access(), v));
    if !may_open(&vhost) {
        return Err(ApiError::not_allowed(
            "User not authorised to access object",
        ));
    }
    if component == VHOST_LIMITS {
        return put_vhost_limits(&api, &who, &vhost, &name, value);
    }
    if component == super::definitions::OPERATOR_POLICY {
        // The value is the policy's body, as `/api/operator-policies` takes it.
        let body = Bytes::from(serde_json::to_vec(value).unwrap_or_default());
        return super::policies::put(api, who, PolicyKind::Operator, vhost, name, body).await;
    }
    // A shovel's end on this node without a user runs with every permission: as RabbitMQ
    // checks it, only in vhosts the user setting it may open.
    for key in ["src-uri", "dest-uri"] {
        let uris: Vec<&str> = match value.get(key) {
            Some(Value::String(u)) => vec![u.as_str()],
            Some(Value::Array(a)) => a.iter().filter_map(Value::as_str).collect(),
            _ => Vec::new(),
        };
        for u in uris {
            if let Some(v) = shovel::uri::trusted_vhost(u, &vhost) {
                if !may_open(&v) {
                    return Err(ApiError::bad_request(format!(
                        "Validation failed\n\nUser \"{}\" does not have permissions to access virtual host \"{v}\"\n",
                        who.name
                    )));
                }
            }
        }
    }
    let value = checked_value(&component, &name, value)?;
    let def = ParameterDef {
        component,
        vhost,
        name,
        value,
    };
    let existed = api.node.write(|n, _| {
        let b = n.broker_mut();
        let existed = b
            .parameters()
            .get(&def.component, &def.vhost, &def.name)
            .is_some();
        b.set_parameter(def).map(|()| existed)
    })?;
    match existed {
        Ok(true) => Ok(StatusCode::NO_CONTENT.into_response()),
        Ok(false) => Ok(StatusCode::CREATED.into_response()),
        Err(_) => Err(ApiError::vhost_not_found()),
    }
}

async fn delete_one(
    State(api): ApiState,
    LoggedIn(who): LoggedIn,
    Path((component, vhost, name)): Path<(String, String, String)>,
) -> Answer {
    allowed(&who)?;
    if !api
        .node
        .read(|n, _| who.sees_vhost(n.broker().access(), &vhost))
    {
        return Err(ApiError::not_found());
    }
    if component == super::definitions::OPERATOR_POLICY {
        return super::policies::delete(api, who, PolicyKind::Operator, vhost, name).await;
    }
    if component == VHOST_LIMITS {
        if who.level != Level::Administrator {
            return Err(ApiError::not_allowed(
                "User not authorised to access object",
            ));
        }
        let cleared = name == LIMITS
            && api.node.write(|n, _| {
                let b = n.broker_mut();
                let had = b.limits().of(LimitScope::Vhost, &vhost).is_some();
                if had {
                    b.put_limits(LimitScope::Vhost, &vhost, Limits::default());
                }
                had
            })?;
        return if cleared {
            Ok(StatusCode::NO_CONTENT.into_response())
        } else {
            Err(ApiError::not_found())
        };
    }
    if api
        .node
        .write(|n, _| n.broker_mut().clear_parameter(&component, &vhost, &name))?
    {
        Ok(StatusCode::NO_CONTENT.into_response())
    } else {
        Err(ApiError::not_found())
    }
}

/// The shovels of the whole cluster a user may see (those of the vhosts they may open): those
/// this node runs, and those its running peers said they run (sent every
/// [`super::FIGURES_EVERY`], shown up to [`super::FIGURES_STALE`] old), each naming its `node`.
fn shovel_listing(api: &Api, who: &Login, vhost: Option<&str>) -> Vec<Value> {
    let mut list = api.shovels.list(vhost);
    for node in api.names().keys() {
        let Some((_, mut figures)) = super::peer_figures(api, *node) else {
            continue;
        };
        if let Value::Array(theirs) = figures["shovels"].take() {
            for s in theirs {
                // One that moved between nodes lately may be in two lists: the first (this
                // node's own, then the lowest-numbered) is kept.
                let seen = list
                    .iter()
                    .any(|o| o["vhost"] == s["vhost"] && o["name"] == s["name"]);
                if !seen && vhost.is_none_or(|v| s["vhost"] == v) {
                    list.push(s);
                }
            }
        }
    }
    list.retain(|s| {
        let v = s["vhost"].as_str().unwrap_or("");
        api.node.read(|n, _| who.sees_vhost(n.broker().access(), v))
    });
    list
}

async fn shovels_all(State(api): ApiState, LoggedIn(who): LoggedIn) -> Answer {
    Ok(Json(shovel_listing(&api, &who, None)).into_response())
}

async fn shovels_vhost(
    State(api): ApiState,
    LoggedIn(who): LoggedIn,
    Path(vhost): Path<String>,
) -> Answer {
    if !api.node.read(|n, _| n.broker().vhost_exists(&vhost)) {
        return Err(ApiError::not_found());
    }
    Ok(Json(shovel_listing(&api, &who, Some(&vhost))).into_response())
}

/// One shovel's status (RabbitMQ 3.10 answered with its vhost's whole list here; newer ones,
/// and Warren, with the one object).
async fn shovel_one(
    State(api): ApiState,
    LoggedIn(who): LoggedIn,
    Path((vhost, name)): Path<(String, String)>,
) -> Answer {
    shovel_listing(&api, &who, Some(&vhost))
        .into_iter()
        .find(|s| s["name"].as_str() == Some(name.as_str()))
        .map(|s| Json(s).into_response())
        .ok_or_else(ApiError::not_found)
}

async fn restart_shovel(
    State(api): ApiState,
    LoggedIn(who): LoggedIn,
    Path((vhost, name)): Path<(String, String)>,
) -> Answer {
    allowed(&who)?;
    if !api
        .node
        .read(|n, _| who.sees_vhost(n.broker().access(), &vhost))
    {
        return Err(ApiError::not_found());
    }
    if api.shovels.restart(&vhost, &name) {
        return Ok(StatusCode::NO_CONTENT.into_response());
    }
    // In a cluster another node may run it: that node is asked, as RabbitMQ's API restarts a
    // shovel on whichever node runs it.
    for node in api.names().keys() {
        let Some((_, figures)) = super::peer_figures(&api, *node) else {
            continue;
        };
        let runs = figures["shovels"].as_array().is_some_and(|l| {
            l.iter()
                .any(|s| s["vhost"] == vhost.as_str() && s["name"] == name.as_str())
        });
        if runs {
            api.node.restart_shovel_on(*node, &vhost, &name);
            return Ok(StatusCode::NO_CONTENT.into_response());
        }
    }
    Err(ApiError::not_found())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_checked_by_their_component() {
        let e = checked_value("federation-upstream", "u", &json!({})).unwrap_err();
        assert!(format!("{e:?}").contains("component federation-upstream not found"));
        // RabbitMQ escapes the angle brackets of a parameter's validation text.
        let e = checked_value(
            "shovel",
            "s",
            &json!({"src-uri": "amqp://", "src-queue": "q", "dest-uri": "amqp://",
                    "dest-queue": "d", "ack-mode": "sometimes"}),
        )
        .unwrap_err();
        assert!(
            format!("{e:?}").contains(r#"actually was &lt;&lt;\"sometimes\"&gt;&gt;"#),
            "{e:?}"
        );
        let e = checked_value("shovel", "s", &json!({"src-uri": "amqp://"})).unwrap_err();
        assert!(format!("{e:?}").contains(r#"Validation failed\n\nMust specify 'src-exchange' or 'src-queue'\nKey \"dest-uri\" not found in s\n"#));
        let v = checked_value(
            "shovel",
            "s",
            &json!({"src-uri": "amqp://", "src-queue": "a", "dest-uri": "amqp://"}),
        )
        .expect("valid");
        assert_eq!(
            v, r#"{"dest-uri":"amqp://","src-queue":"a","src-uri":"amqp://"}"#,
            "kept as JSON with its keys in order, as RabbitMQ lists them"
        );
    }
}
