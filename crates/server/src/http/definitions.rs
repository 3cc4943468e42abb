//! Definitions in RabbitMQ's format (`GET`/`POST /api/definitions`): what a RabbitMQ export
//! holds loads into Warren, and Warren's export loads into RabbitMQ.

use serde_json::{json, Value};
use warren_broker::access::{AccessError, PermissionDef, TopicPermissionDef};
use warren_broker::limits::{LimitScope, Limits};
use warren_broker::policy::PolicyKind;
use warren_broker::DeclareQueue;
use warren_codec::{FieldValue, ShortStr};
use warren_session::manage::API_CONN;

use super::json::{table, to_table};
use super::{Api, ApiError};

/// System objects RabbitMQ leaves out of an export: the default exchange and `amq.*`.
fn exported_exchange(name: &str) -> bool {
    !name.is_empty() && !name.starts_with("amq.")
}

pub fn export(api: &Api, vhost: Option<&str>) -> Value {
    let limits: Vec<Value> = api.node.read(|n, _| {
        n.broker()
            .limits()
            .all(LimitScope::Vhost)
            .filter(|(v, _)| vhost.is_none_or(|only| only == *v))
            .map(|(v, l)| super::parameters::vhost_limits_json(v, l))
            .collect()
    });
    // Runtime parameters (shovels) after the limits, as RabbitMQ lists them together.
    let limits: Vec<Value> = limits
        .into_iter()
        .chain(api.node.read(|n, _| {
            n.broker()
                .parameters()
                .list(None, vhost)
                .map(|p| {
                    let mut v = super::parameters::parameter_json(p);
                    if let (Some(m), Some(_)) = (v.as_object_mut(), vhost) {
                        m.remove("vhost");
                    }
                    v
                })
                .collect::<Vec<_>>()
        }))
        .collect();
    let (policies, operator_policies): (Vec<Value>, Vec<Value>) = api.node.read(|n, _| {
        let p = n.broker().policies();
        // Operator policies go as RabbitMQ exports them: `operator_policy` parameters.
        let of = |kind, json: fn(&warren_broker::policy::PolicyDef) -> Value| {
            p.list(kind, vhost)
                .map(|d| {
                    let mut v = json(d);
                    if let (Some(m), Some(_)) = (v.as_object_mut(), vhost) {
                        m.remove("vhost");
                    }
                    v
                })
                .collect()
        };
        (
            of(PolicyKind::User, super::policies::policy_json),
            of(
                PolicyKind::Operator,
                super::policies::operator_policy_parameter,
            ),
        )
    });
    let (queues, exchanges, bindings, vhosts, users, perms, topics) = api.node.read(|n, _| {
        let b = n.broker();
        let a = b.access();
        (
            b.queue_snapshots(vhost),
            b.exchange_snapshots(vhost),
            b.binding_snapshots(vhost),
            b.vhost_names()
                .into_iter()
                .map(|v| {
                    let meta = b.vhost_meta(&v).cloned().unwrap_or_default();
                    (v, meta)
                })
                .collect::<Vec<_>>(),
            super::access::users_json(b, a.users()),
            a.permissions().cloned().collect::<Vec<_>>(),
            a.topic_permissions().cloned().collect::<Vec<_>>(),
        )
    });
    // In a one-vhost export objects carry no vhost (RabbitMQ's format): it is the target's.
    let with_vhost = |mut v: Value, name: &str| {
        if vhost.is_none() {
            if let Some(m) = v.as_object_mut() {
                m.insert("vhost".into(), name.into());
            }
        }
        v
    };
    let mut queue_list: Vec<Value> = queues
        .iter()
        .filter(|q| q.owner.is_none())
        .map(|q| {
            with_vhost(
                // `type` as RabbitMQ 3.13 exports it: a queue declared without
                // `x-queue-type` comes back as the type it is, whatever the importing node's
                // default queue type.
                json!({"name": q.name.as_str(), "durable": q.durable,
                       "auto_delete": q.auto_delete, "arguments": table(&q.arguments),
                       "type": q.queue_type}),
                &q.vhost,
            )
        })
        .collect();
    let mut exchange_list: Vec<Value> = exchanges
        .iter()
        .filter(|x| exported_exchange(&x.name))
        .map(|x| {
            with_vhost(
                json!({"name": x.name.as_str(), "type": x.kind, "durable": x.durable,
                       "auto_delete": x.auto_delete, "internal": x.internal,
                       "arguments": table(&x.arguments)}),
                &x.vhost,
            )
        })
        .collect();
    let exclusive: Vec<(&str, &str)> = queues
        .iter()
        .filter(|q| q.owner.is_some())
        .map(|q| (q.vhost.as_str(), q.name.as_str()))
        .collect();
    let mut binding_list: Vec<Value> = bindings
        .iter()
        .filter(|b| !b.source.is_empty())
        .filter(|b| {
            !(b.to_queue && exclusive.contains(&(b.vhost.as_str(), b.destination.as_str())))
        })
        .map(|b| {
            with_vhost(
                json!({"source": b.source.as_str(), "destination": b.destination.as_str(),
                       "destination_type": if b.to_queue { "queue" } else { "exchange" },
                       "routing_key": b.routing_key.as_str(), "arguments": table(&b.arguments)}),
                &b.vhost,
            )
        })
        .collect();
    let key = |v: &Value| {
        (
            v["vhost"].as_str().unwrap_or("").to_owned(),
            v["name"].as_str().unwrap_or("").to_owned(),
        )
    };
    queue_list.sort_by_key(key);
    exchange_list.sort_by_key(key);
    binding_list.sort_by_key(|v| v.to_string());
    let version = env!("CARGO_PKG_VERSION");
    let mut out = json!({
        "rabbit_version": "3.10.8",
        "rabbitmq_version": "3.10.8",
        "product_name": "Warren",
        "product_version": version,
        "parameters": limits,
        "policies": policies,
        "queues": queue_list,
        "exchanges": exchange_list,
        "bindings": binding_list,
    });
    if let Some(params) = out.get_mut("parameters").and_then(Value::as_array_mut) {
        params.extend(operator_policies);
    }
    if vhost.is_none() {
        if let Some(m) = out.as_object_mut() {
            m.insert("users".into(), users);
            m.insert(
                "vhosts".into(),
                vhosts
                    .iter()
                    .map(|(v, meta)| {
                        json!({"name": v, "limits": [],
                               "metadata": super::routes::vhost_metadata_json(meta)})
                    })
                    .collect(),
            );
            m.insert(
                "permissions".into(),
                perms.iter().map(super::access::permission_json).collect(),
            );
            m.insert(
                "topic_permissions".into(),
                topics.iter().map(super::access::topic_json).collect(),
            );
            m.insert(
                "global_parameters".into(),
                Value::Array(super::global::global_parameters(api)),
            );
        }
    }
    out
}

use super::parameters::VHOST_LIMITS;

/// Limits from a definitions object (`{"max-queues": 10}`; RabbitMQ writes `[]` for none).
fn limits_from(v: Option<&Value>, scope: LimitScope) -> Result<Limits, ApiError> {
    let Some(Value::Object(m)) = v else {
        return Ok(Limits::default());
    };
    m.iter()
        .map(|(name, value)| {
            if !scope.accepts(name) {
                return Err(ApiError::bad_request(format!("unknown limit '{name}'")));
            }
            value
                .as_i64()
                .map(|v| (name.clone(), v))
                .ok_or_else(|| ApiError::bad_request(format!("limit '{name}' must be an integer")))
        })
        .collect()
}

/// The runtime parameter component RabbitMQ keeps operator policies under.
pub const OPERATOR_POLICY: &str = "operator_policy";

/// A policy's body with the definition keys `why` names left out, and each key left out with
/// why ("max-age (streams)"). The body is None when that left its definition empty: such a
/// policy goes (one that came empty stays, to be refused as RabbitMQ refuses it).
pub fn policy_without(
    body: &Value,
    why: impl Fn(&str) -> Option<&'static str>,
) -> (Option<Value>, Vec<String>) {
    let mut body = body.clone();
    let mut dropped = Vec::new();
    if let Some(def) = body.get_mut("definition").and_then(Value::as_object_mut) {
        def.retain(|k, _| match why(k) {
            Some(what) => {
                dropped.push(format!("{k} ({what})"));
                false
            }
            None => true,
        });
        if def.is_empty() && !dropped.is_empty() {
            return (None, dropped);
        }
    }
    (Some(body), dropped)
}

fn text<'a>(v: &'a Value, k: &str, what: &str) -> Result<&'a str, ApiError> {
    v.get(k)
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::bad_request(format!("{what}: {k} missing or not a string")))
}

fn boolean(v: &Value, k: &str, default: bool) -> bool {
    v.get(k).and_then(super::json::boolean).unwrap_or(default)
}

fn list<'a>(defs: &'a Value, k: &str) -> &'a [Value] {
    defs.get(k)
        .and_then(Value::as_array)
        .map_or(&[][..], Vec::as_slice)
}

/// Declares what `defs` holds: vhosts, users, permissions, exchanges, queues, bindings, in
/// that order (as RabbitMQ does), with user and vhost limits, policies and shovels. Objects
/// that exist already must be equivalent. Runtime parameters of other components (federation)
/// are not imported (logged). In a cluster, quorum queues are made by the metadata log:
/// their tickets are returned, for the caller to wait on ([`NodeHandle::declared`]), and
/// bindings to them go to the log after them.
///
/// [`NodeHandle::declared`]: crate::driver::NodeHandle::declared
pub fn import(api: &Api, defs: &Value, only_vhost: Option<&str>) -> Result<Vec<u64>, ApiError> {
    if !defs.is_object() {
        return Err(ApiError::bad_request("definitions must be a JSON object"));
    }
    let vhost_of = |v: &Value| -> Result<String, ApiError> {
        match only_vhost {
            Some(t) => Ok(t.to_owned()),
            None => Ok(text(v, "vhost", "definition")?.to_owned()),
        }
    };
    let component = |p: &Value| {
        p.get("component")
            .and_then(Value::as_str)
            .map(str::to_owned)
    };
    let (vhost_limits, others): (Vec<&Value>, Vec<&Value>) = list(defs, "parameters")
        .iter()
        .partition(|p| component(p).as_deref() == Some(VHOST_LIMITS));
    let (shovels, others): (Vec<&Value>, Vec<&Value>) = others
        .into_iter()
        .partition(|p| component(p).as_deref() == Some(crate::shovel::COMPONENT));
    // RabbitMQ keeps operator policies as runtime parameters and exports them so.
    let (operator_params, others): (Vec<&Value>, Vec<&Value>) = others
        .into_iter()
        .partition(|p| component(p).as_deref() == Some(OPERATOR_POLICY));
    if !others.is_empty() {
        let components: std::collections::BTreeSet<String> =
            others.iter().filter_map(|p| component(p)).collect();
        tracing::warn!(
            parameters = others.len(),
            ?components,
            "definitions import: runtime parameters of components Warren does not have (federation?) are not imported"
        );
    }
    let shovels = shovels
        .into_iter()
        .map(|p| {
            let name = text(p, "name", "parameter")?;
            let value = p.get("value").unwrap_or(&Value::Null);
            Ok(warren_broker::parameters::ParameterDef {
                component: crate::shovel::COMPONENT.to_owned(),
                vhost: vhost_of(p)?,
                name: name.to_owned(),
                value: super::parameters::checked_value(crate::shovel::COMPONENT, name, value)?,
            })
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    let operator_params = operator_params
        .into_iter()
        .map(|p| {
            // The parameter's value is the policy's body; its name and vhost are beside it.
            let mut body = p.get("value").cloned().unwrap_or(Value::Null);
            if let (Some(m), Some(name)) = (body.as_object_mut(), p.get("name")) {
                m.insert("name".into(), name.clone());
                if let Some(v) = p.get("vhost") {
                    m.insert("vhost".into(), v.clone());
                }
            }
            (PolicyKind::Operator, body)
        })
        .collect::<Vec<_>>();
    let policies = [
        ("policies", PolicyKind::User),
        // An earlier Warren exported them under a key of its own.
        ("operator_policies", PolicyKind::Operator),
    ]
    .into_iter()
    .flat_map(|(key, kind)| list(defs, key).iter().map(move |p| (kind, p.clone())))
    .chain(operator_params)
    .filter_map(|(kind, p)| {
        let name = match text(&p, "name", "policy") {
            Ok(n) => n.to_owned(),
            Err(e) => return Some(Err(e)),
        };
        let (p, dropped) = policy_without(&p, warren_broker::policy::foreign_key);
        if !dropped.is_empty() {
            tracing::warn!(policy = %name, keys = ?dropped, "definitions import: policy keys of RabbitMQ plugins Warren does not have are left out");
        }
        let Some(p) = p else {
            tracing::warn!(policy = %name, "definitions import: a policy of plugin keys only is not imported");
            return None;
        };
        let body = match p.as_object() {
            Some(b) => b,
            None => return Some(Err(ApiError::bad_request("policy: not a JSON object"))),
        };
        Some(
            vhost_of(&p)
                .and_then(|v| super::policies::policy_from(&v, &name, kind, body)),
        )
    })
    .collect::<Result<Vec<_>, ApiError>>()?;
    let vhost_limits = vhost_limits
        .into_iter()
        .map(|p| {
            Ok((
                vhost_of(p)?,
                limits_from(p.get("value"), LimitScope::Vhost)?,
            ))
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    let user_limits = list(defs, "users")
        .iter()
        .filter(|u| u.get("limits").is_some())
        .map(|u| {
            Ok((
                text(u, "name", "user")?.to_owned(),
                limits_from(u.get("limits"), LimitScope::User)?,
            ))
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    // Users are read (and passwords hashed) before the node is locked.
    let vhosts = list(defs, "vhosts")
        .iter()
        .map(|v| {
            let name = text(v, "name", "vhost")?;
            let mut body = v.as_object().cloned().unwrap_or_default();
            let change = match super::access::vhost_change(&body) {
                Ok(c) => c,
                Err(e) => {
                    // A RabbitMQ vhost whose queues default to streams: the rest of it is
                    // kept, and its queues get the node's default.
                    tracing::warn!(vhost = %name, error = %e.reason, "a vhost's default queue type is not kept");
                    for key in ["default_queue_type", "defaultqueuetype"] {
                        body.remove(key);
                        if let Some(Value::Object(m)) = body.get_mut("metadata") {
                            m.remove(key);
                        }
                    }
                    super::access::vhost_change(&body)?
                }
            };
            Ok((name.to_owned(), change))
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    let users = list(defs, "users")
        .iter()
        .map(|u| {
            let name = text(u, "name", "user")?;
            let body = u.as_object().cloned().unwrap_or_default();
            super::access::user_from(name, &body)
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    let field = |v: &Value, k: &str| text(v, k, "permission").map(str::to_owned);
    let waiting = api.node.write(|n, _| -> Result<Vec<u64>, ApiError> {
        let mut waiting: Vec<u64> = Vec::new();
        let mut made_by_log: std::collections::BTreeSet<(String, String)> = Default::default();
        if only_vhost.is_none() {
            for (name, change) in &vhosts {
                if let Err(e) = n.broker_mut().put_vhost(name, change) {
                    tracing::warn!(vhost = %name, error = %e, "a vhost's metadata is not kept");
                    n.broker_mut().declare_vhost(name);
                }
            }
            for u in users {
                n.broker_mut().put_user(u);
            }
            for (user, limits) in user_limits {
                n.broker_mut().put_limits(LimitScope::User, &user, limits);
            }
            let refused = |e: AccessError| ApiError::bad_request(e.to_string());
            for p in list(defs, "permissions") {
                n.broker_mut()
                    .set_permission(PermissionDef {
                        user: field(p, "user")?,
                        vhost: field(p, "vhost")?,
                        configure: field(p, "configure")?,
                        write: field(p, "write")?,
                        read: field(p, "read")?,
                    })
                    .map_err(refused)?;
            }
            for t in list(defs, "topic_permissions") {
                n.broker_mut()
                    .set_topic_permission(TopicPermissionDef {
                        user: field(t, "user")?,
                        vhost: field(t, "vhost")?,
                        exchange: field(t, "exchange")?,
                        write: field(t, "write")?,
                        read: field(t, "read")?,
                    })
                    .map_err(refused)?;
            }
        }
        for (vhost, limits) in vhost_limits {
            if !n.broker().vhost_exists(&vhost) {
                return Err(ApiError::bad_request(format!(
                    "vhost limits: vhost '{vhost}' does not exist"
                )));
            }
            n.broker_mut().put_limits(LimitScope::Vhost, &vhost, limits);
        }
        // Before queues and exchanges, as RabbitMQ imports them: each is declared under its
        // policy from the start.
        for p in policies {
            n.broker_mut()
                .set_policy(p)
                .map_err(|e| ApiError::bad_request(e.to_string()))?;
        }
        for x in list(defs, "exchanges") {
            let vhost = vhost_of(x)?;
            let name = text(x, "name", "exchange")?;
            let kind = text(x, "type", "exchange")?;
            let args = to_table(x.get("arguments").unwrap_or(&Value::Null))
                .map_err(ApiError::bad_request)?;
            n.broker_mut().declare_exchange(
                &vhost,
                name,
                kind,
                false,
                boolean(x, "durable", true),
                boolean(x, "auto_delete", false),
                boolean(x, "internal", false),
                &args,
            )?;
        }
        for q in list(defs, "queues") {
            let vhost = vhost_of(q)?;
            let name = text(q, "name", "queue")?;
            let mut arguments = to_table(q.get("arguments").unwrap_or(&Value::Null))
                .map_err(ApiError::bad_request)?;
            // A definition's own type, when its arguments name none: an exported classic
            // queue stays classic on a node whose default type is quorum (where it might not
            // even be valid: priorities, say). Without either, the node's default applies,
            // as to a declaration.
            if arguments.get("x-queue-type").is_none() {
                if let Some(t) = q["type"].as_str() {
                    arguments.insert("x-queue-type", FieldValue::long_str(t));
                }
            }
            let req = DeclareQueue {
                name: ShortStr::try_from_str(name)
                    .map_err(|_| ApiError::bad_request("queue name too long"))?,
                passive: false,
                durable: boolean(q, "durable", true),
                exclusive: false,
                auto_delete: boolean(q, "auto_delete", false),
                arguments,
            };
            match n
                .broker_mut()
                .declare_queue_as(&vhost, req, API_CONN, None)?
            {
                warren_broker::Declared::Now(_) => {}
                warren_broker::Declared::Waiting(ticket) => {
                    waiting.push(ticket);
                    made_by_log.insert((vhost, name.to_owned()));
                }
            }
        }
        for b in list(defs, "bindings") {
            let vhost = vhost_of(b)?;
            let source = text(b, "source", "binding")?;
            let dest = text(b, "destination", "binding")?;
            let key = b.get("routing_key").and_then(Value::as_str).unwrap_or("");
            let args = to_table(b.get("arguments").unwrap_or(&Value::Null))
                .map_err(ApiError::bad_request)?;
            let kind = text(b, "destination_type", "binding")?;
            if kind == "queue" && made_by_log.contains(&(vhost.clone(), dest.to_owned())) {
                n.broker_mut()
                    .bind_declared_queue(&vhost, dest, source, key, &args)?;
                continue;
            }
            match kind {
                "queue" => n
                    .broker_mut()
                    .bind_queue(&vhost, dest, source, key, &args, API_CONN)?,
                "exchange" => n
                    .broker_mut()
                    .bind_exchange(&vhost, dest, source, key, &args)?,
                other => {
                    return Err(ApiError::bad_request(format!(
                        "binding: unknown destination_type {other}"
                    )))
                }
            }
        }
        // Last, as RabbitMQ imports parameters after the topology: a shovel finds its
        // queues declared with their arguments.
        for p in shovels {
            let vhost = p.vhost.clone();
            n.broker_mut().set_parameter(p).map_err(|_| {
                ApiError::bad_request(format!("shovel: vhost '{vhost}' does not exist"))
            })?;
        }
        Ok(waiting)
    })??;
    if only_vhost.is_none() {
        // The cluster's name, as RabbitMQ imports it.
        super::global::import(api, list(defs, "global_parameters"))?;
    }
    Ok(waiting)
}

/// Waits for the quorum queues an import declared through the cluster's metadata log.
pub async fn made(api: &Api, waiting: Vec<u64>) -> Result<(), ApiError> {
    for ticket in waiting {
        api.node.declared(ticket).await?;
    }
    Ok(())
}
