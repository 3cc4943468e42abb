//! `warren ctl set_policy / clear_policy / list_policies` and the operator-policy forms,
//! with rabbitmqctl's arguments (`set_policy [-p vhost] [--priority N] [--apply-to X] name
//! pattern definition`), through the management API's `/api/policies` and
//! `/api/operator-policies`.

use serde_json::{json, Value};

use super::api::{enc, Api};
use super::ctl::{list, Vhost};
use super::table::{col, Column};
use super::{CliError, Format};

#[derive(clap::Subcommand, Debug, Clone)]
pub enum PolicyCmd {
    /// Sets (or replaces) a policy: queues and exchanges whose names match PATTERN (a regular
    /// expression) take the DEFINITION's keys, e.g. '{"max-length": 1000,
    /// "dead-letter-exchange": "dlx"}'
    #[command(name = "set_policy", alias = "set-policy")]
    SetPolicy(SetArgs),
    /// Clears a policy
    #[command(name = "clear_policy", alias = "clear-policy")]
    ClearPolicy(ClearArgs),
    /// Lists a vhost's policies
    #[command(name = "list_policies", alias = "list-policies")]
    ListPolicies(ListArgs),
    /// Sets an operator policy: a cap on max-length, max-length-bytes, message-ttl, expires
    /// and delivery-limit that queue arguments and user policies cannot exceed
    #[command(name = "set_operator_policy", alias = "set-operator-policy")]
    SetOperatorPolicy(SetArgs),
    /// Clears an operator policy
    #[command(name = "clear_operator_policy", alias = "clear-operator-policy")]
    ClearOperatorPolicy(ClearArgs),
    /// Lists a vhost's operator policies
    #[command(name = "list_operator_policies", alias = "list-operator-policies")]
    ListOperatorPolicies(ListArgs),
}

#[derive(clap::Args, Debug, Clone)]
pub struct SetArgs {
    /// The policy's name
    pub name: String,
    /// A regular expression matched against queue and exchange names
    pub pattern: String,
    /// The keys it sets, a JSON object
    pub definition: String,
    /// Among policies matching a name, the highest priority applies
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    pub priority: i64,
    /// What it applies to: queues, classic_queues, quorum_queues, exchanges or all
    #[arg(long, default_value = "all")]
    pub apply_to: String,
    #[command(flatten)]
    pub at: Vhost,
}

#[derive(clap::Args, Debug, Clone)]
pub struct ClearArgs {
    /// The policy's name
    pub name: String,
    #[command(flatten)]
    pub at: Vhost,
}

#[derive(clap::Args, Debug, Clone)]
pub struct ListArgs {
    #[command(flatten)]
    pub at: Vhost,
    /// Output format: an aligned table, or the API's JSON
    #[arg(long, value_enum, default_value_t)]
    pub format: Format,
}

const POLICIES: &[Column] = &[
    col("vhost", "vhost"),
    col("name", "name"),
    col("pattern", "pattern"),
    col("apply-to", "apply-to"),
    col("definition", "definition"),
    col("priority", "priority"),
];

pub fn name(c: &PolicyCmd) -> &'static str {
    match c {
        PolicyCmd::SetPolicy(_) => "ctl set_policy",
        PolicyCmd::ClearPolicy(_) => "ctl clear_policy",
        PolicyCmd::ListPolicies(_) => "ctl list_policies",
        PolicyCmd::SetOperatorPolicy(_) => "ctl set_operator_policy",
        PolicyCmd::ClearOperatorPolicy(_) => "ctl clear_operator_policy",
        PolicyCmd::ListOperatorPolicies(_) => "ctl list_operator_policies",
    }
}

/// The body of a PUT, from rabbitmqctl's arguments.
pub fn body(a: &SetArgs) -> Result<Value, CliError> {
    let definition: Value = match serde_json::from_str(&a.definition) {
        Ok(v @ Value::Object(_)) => v,
        _ => {
            return Err(CliError::Usage(format!(
                "the definition must be a JSON object such as '{{\"max-length\": 1000}}', not {}",
                a.definition
            )))
        }
    };
    Ok(json!({
        "pattern": a.pattern,
        "definition": definition,
        "priority": a.priority,
        "apply-to": a.apply_to,
    }))
}

fn no_vhost(vhost: &str) -> String {
    format!("vhost '{vhost}' does not exist (see `warren ctl list_vhosts`; pass -p)")
}

pub fn main(c: &PolicyCmd) -> Result<(), CliError> {
    let (base, noun) = match c {
        PolicyCmd::SetPolicy(_) | PolicyCmd::ClearPolicy(_) | PolicyCmd::ListPolicies(_) => {
            ("/policies", "policy")
        }
        _ => ("/operator-policies", "operator policy"),
    };
    match c {
        PolicyCmd::SetPolicy(a) | PolicyCmd::SetOperatorPolicy(a) => {
            let path = format!("{base}/{}/{}", enc(&a.at.vhost), enc(&a.name));
            let api: Api = a.at.conn.api();
            api.call("PUT", &path, Some(&body(a)?), &[], &no_vhost(&a.at.vhost))?;
            println!(
                "set {noun} '{}' for pattern '{}' to {} with priority {} for vhost '{}'",
                a.name, a.pattern, a.definition, a.priority, a.at.vhost
            );
        }
        PolicyCmd::ClearPolicy(a) | PolicyCmd::ClearOperatorPolicy(a) => {
            let path = format!("{base}/{}/{}", enc(&a.at.vhost), enc(&a.name));
            let missing = format!(
                "no {noun} '{}' in vhost '{}' (see `warren ctl list_{}`)",
                a.name,
                a.at.vhost,
                if noun == "policy" {
                    "policies"
                } else {
                    "operator_policies"
                }
            );
            a.at.conn.api().call("DELETE", &path, None, &[], &missing)?;
            println!("cleared {noun} '{}' in vhost '{}'", a.name, a.at.vhost);
        }
        PolicyCmd::ListPolicies(a) | PolicyCmd::ListOperatorPolicies(a) => list(
            &a.at.conn.api(),
            &format!("{base}/{}", enc(&a.at.vhost)),
            &no_vhost(&a.at.vhost),
            POLICIES,
            a.format,
        )?,
    }
    Ok(())
}
