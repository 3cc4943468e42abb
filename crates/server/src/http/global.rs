//! The cluster's name and RabbitMQ's other global parameters: `GET`/`PUT /api/cluster-name`
//! and `/api/global-parameters[/{name}]`, as RabbitMQ's management API has them
//! (administrators only, except reading the name). They are runtime parameters of the
//! component `global`, replicated to every node, so that every node (its overview, its
//! metrics' `rabbitmq_identity_info`, `warren ctl cluster_status`) names the cluster alike.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::{json, Value};
use warren_broker::parameters::{ParameterDef, CLUSTER_NAME, GLOBAL};

use super::{Admin, Api, ApiError, LoggedIn};

type ApiState = State<Arc<Api>>;
type Answer = Result<Response, ApiError>;

/// RabbitMQ's id of a cluster, which Warren does not keep: an import leaves it out, as it
/// would make every cluster imported from one RabbitMQ look like the same cluster.
const INTERNAL_CLUSTER_ID: &str = "internal_cluster_id";

pub fn routes() -> Router<Arc<Api>> {
    Router::new()
        .route("/api/cluster-name", get(get_name).put(put_name))
        .route("/api/global-parameters", get(list))
        .route(
            "/api/global-parameters/{name}",
            get(get_one).put(put_one).delete(delete_one),
        )
}

/// Every global parameter set, and the cluster's name whether set or not (RabbitMQ always
/// has one).
pub fn global_parameters(api: &Api) -> Vec<Value> {
    let mut out: Vec<Value> = api.node.read(|n, _| {
        n.broker()
            .parameters()
            .list(Some(GLOBAL), Some(""))
            .map(one_json)
            .collect()
    });
    if !out.iter().any(|p| p["name"] == CLUSTER_NAME) {
        out.insert(
            0,
            json!({"name": CLUSTER_NAME, "value": api.cluster_name()}),
        );
    }
    out
}

fn one_json(p: &ParameterDef) -> Value {
    json!({
        "name": p.name,
        "value": serde_json::from_str::<Value>(&p.value).unwrap_or_else(|_| p.value.as_str().into()),
    })
}

/// Sets global parameter `name` to `value`; true if it was set before. The cluster's name must
/// be a string that is not empty.
pub fn set(api: &Api, name: &str, value: &Value) -> Result<bool, ApiError> {
    if name == CLUSTER_NAME && value.as_str().is_none_or(str::is_empty) {
        return Err(ApiError::bad_request(
            "the cluster's name must be a string that is not empty",
        ));
    }
    let def = ParameterDef {
        component: GLOBAL.to_owned(),
        vhost: String::new(),
        name: name.to_owned(),
        value: value.to_string(),
    };
    api.node.write(|n, _| {
        let b = n.broker_mut();
        let existed = b.parameters().get(GLOBAL, "", name).is_some();
        b.set_parameter(def)
            .map(|()| existed)
            .map_err(|e| ApiError::bad_request(e.to_string()))
    })?
}

/// The global parameters of a definitions import (`global_parameters`), but RabbitMQ's
/// cluster id.
pub fn import(api: &Api, list: &[Value]) -> Result<(), ApiError> {
    for p in list {
        let Some(name) = p["name"].as_str() else {
            return Err(ApiError::bad_request("a global parameter without a name"));
        };
        if name != INTERNAL_CLUSTER_ID {
            set(api, name, &p["value"])?;
        }
    }
    Ok(())
}

async fn get_name(State(api): ApiState, _: LoggedIn) -> Answer {
    Ok(Json(json!({ "name": api.cluster_name() })).into_response())
}

async fn put_name(State(api): ApiState, _: Admin, body: Bytes) -> Answer {
    let v: Value = serde_json::from_slice(&body)
        .map_err(|_| ApiError::bad_request("body must be a JSON object"))?;
    set(&api, CLUSTER_NAME, &v["name"])?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn list(State(api): ApiState, _: Admin) -> Answer {
    Ok(Json(Value::Array(global_parameters(&api))).into_response())
}

async fn get_one(State(api): ApiState, _: Admin, Path(name): Path<String>) -> Answer {
    global_parameters(&api)
        .into_iter()
        .find(|p| p["name"] == name.as_str())
        .map(|p| Json(p).into_response())
        .ok_or_else(ApiError::not_found)
}

async fn put_one(State(api): ApiState, _: Admin, Path(name): Path<String>, body: Bytes) -> Answer {
    let v: Value = serde_json::from_slice(&body)
        .map_err(|_| ApiError::bad_request("body must be a JSON object"))?;
    let Some(value) = v.get("value") else {
        return Err(ApiError::bad_request("a global parameter needs a value"));
    };
    let existed = set(&api, &name, value)?;
    Ok(if existed {
        StatusCode::NO_CONTENT
    } else {
        StatusCode::CREATED
    }
    .into_response())
}

async fn delete_one(State(api): ApiState, _: Admin, Path(name): Path<String>) -> Answer {
    let gone = api
        .node
        .write(|n, _| n.broker_mut().clear_parameter(GLOBAL, "", &name))?;
    if gone {
        Ok(StatusCode::NO_CONTENT.into_response())
    } else {
        Err(ApiError::not_found())
    }
}
