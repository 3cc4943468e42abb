//! `warren ctl set_parameter / clear_parameter / list_parameters` with rabbitmqctl's
//! arguments (`set_parameter [-p vhost] component name value`), and the shovel plugin's
//! `shovel_status`, `restart_shovel` and `delete_shovel`, through the management API's
//! `/api/parameters` and `/api/shovels`.

use serde_json::{json, Value};

use super::api::{enc, Api};
use super::ctl::{list, Vhost};
use super::table::{col, Column};
use super::{CliError, Format};

#[derive(clap::Subcommand, Debug, Clone)]
pub enum ParameterCmd {
    /// Sets (or replaces) a runtime parameter: COMPONENT `shovel` declares a dynamic shovel,
    /// e.g. set_parameter shovel move-jobs '{"src-uri": "amqp://", "src-queue": "jobs",
    /// "dest-uri": "amqp://other-host", "dest-queue": "jobs"}'
    #[command(name = "set_parameter", alias = "set-parameter")]
    SetParameter(SetArgs),
    /// Clears a runtime parameter (a shovel stops and is gone)
    #[command(name = "clear_parameter", alias = "clear-parameter")]
    ClearParameter(ClearArgs),
    /// Lists a vhost's runtime parameters
    #[command(name = "list_parameters", alias = "list-parameters")]
    ListParameters(ListArgs),
    /// Shows every shovel's state on the node that runs it
    #[command(name = "shovel_status", alias = "shovel-status")]
    ShovelStatus(StatusArgs),
    /// Restarts a shovel: it reconnects to both ends (what was in flight goes back to its
    /// source first)
    #[command(name = "restart_shovel", alias = "restart-shovel")]
    RestartShovel(ShovelArgs),
    /// Deletes a shovel (the same as clear_parameter shovel NAME)
    #[command(name = "delete_shovel", alias = "delete-shovel")]
    DeleteShovel(ShovelArgs),
}

#[derive(clap::Args, Debug, Clone)]
pub struct SetArgs {
    /// The component: `shovel`
    pub component: String,
    /// The parameter's name
    pub name: String,
    /// Its value, JSON
    pub value: String,
    #[command(flatten)]
    pub at: Vhost,
}

#[derive(clap::Args, Debug, Clone)]
pub struct ClearArgs {
    /// The component: `shovel`
    pub component: String,
    /// The parameter's name
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

#[derive(clap::Args, Debug, Clone)]
pub struct StatusArgs {
    #[command(flatten)]
    pub at: Vhost,
    /// Output format: an aligned table, or the API's JSON
    #[arg(long, value_enum, default_value_t)]
    pub format: Format,
}

#[derive(clap::Args, Debug, Clone)]
pub struct ShovelArgs {
    /// The shovel's name
    pub name: String,
    #[command(flatten)]
    pub at: Vhost,
}

const PARAMETERS: &[Column] = &[
    col("component", "component"),
    col("name", "name"),
    col("value", "value"),
];

const SHOVELS: &[Column] = &[
    col("name", "name"),
    col("vhost", "vhost"),
    col("type", "type"),
    col("state", "state"),
    col("source", "src_uri"),
    col("source queue", "src_queue"),
    col("destination", "dest_uri"),
    col("destination queue", "dest_queue"),
    col("forwarded", "forwarded"),
    col("reason", "reason"),
    col("last changed", "timestamp"),
];

pub fn name(c: &ParameterCmd) -> &'static str {
    match c {
        ParameterCmd::SetParameter(_) => "ctl set_parameter",
        ParameterCmd::ClearParameter(_) => "ctl clear_parameter",
        ParameterCmd::ListParameters(_) => "ctl list_parameters",
        ParameterCmd::ShovelStatus(_) => "ctl shovel_status",
        ParameterCmd::RestartShovel(_) => "ctl restart_shovel",
        ParameterCmd::DeleteShovel(_) => "ctl delete_shovel",
    }
}

fn no_vhost(vhost: &str) -> String {
    format!("vhost '{vhost}' does not exist (see `warren ctl list_vhosts`; pass -p)")
}

/// The body of a PUT, from rabbitmqctl's arguments.
pub fn body(value: &str) -> Result<Value, CliError> {
    match serde_json::from_str::<Value>(value) {
        Ok(v) => Ok(json!({ "value": v })),
        Err(e) => Err(CliError::Usage(format!(
            "the value must be JSON, such as '{{\"src-uri\": \"amqp://\", \"src-queue\": \"jobs\", \
             \"dest-uri\": \"amqp://other-host\"}}': {e}"
        ))),
    }
}

pub fn main(c: &ParameterCmd) -> Result<(), CliError> {
    match c {
        ParameterCmd::SetParameter(a) => {
            let path = format!(
                "/parameters/{}/{}/{}",
                enc(&a.component),
                enc(&a.at.vhost),
                enc(&a.name)
            );
            let api: Api = a.at.conn.api();
            api.call(
                "PUT",
                &path,
                Some(&body(&a.value)?),
                &[],
                &no_vhost(&a.at.vhost),
            )?;
            println!(
                "set runtime parameter '{}' for component '{}' to '{}' in vhost '{}'",
                a.name, a.component, a.value, a.at.vhost
            );
        }
        ParameterCmd::ClearParameter(a) => clear(&a.at, &a.component, &a.name)?,
        ParameterCmd::DeleteShovel(a) => clear(&a.at, crate::shovel::COMPONENT, &a.name)?,
        ParameterCmd::ListParameters(a) => list(
            &a.at.conn.api(),
            &format!("/parameters/shovel/{}", enc(&a.at.vhost)),
            &no_vhost(&a.at.vhost),
            PARAMETERS,
            a.format,
        )?,
        ParameterCmd::ShovelStatus(a) => {
            list(&a.at.conn.api(), "/shovels", "shovels", SHOVELS, a.format)?
        }
        ParameterCmd::RestartShovel(a) => {
            let path = format!(
                "/shovels/vhost/{}/{}/restart",
                enc(&a.at.vhost),
                enc(&a.name)
            );
            let missing = format!(
                "no shovel '{}' runs in vhost '{}' on this node (see `warren ctl shovel_status`)",
                a.name, a.at.vhost
            );
            a.at.conn.api().call("DELETE", &path, None, &[], &missing)?;
            println!("restarted shovel '{}' in vhost '{}'", a.name, a.at.vhost);
        }
    }
    Ok(())
}

fn clear(at: &Vhost, component: &str, name: &str) -> Result<(), CliError> {
    let path = format!(
        "/parameters/{}/{}/{}",
        enc(component),
        enc(&at.vhost),
        enc(name)
    );
    let missing = format!(
        "no runtime parameter '{name}' of component '{component}' in vhost '{}' \
         (see `warren ctl list_parameters`)",
        at.vhost
    );
    at.conn.api().call("DELETE", &path, None, &[], &missing)?;
    println!(
        "cleared runtime parameter '{name}' of component '{component}' in vhost '{}'",
        at.vhost
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_value_must_be_json() {
        assert_eq!(
            body(r#"{"src-uri": "amqp://"}"#).expect("json"),
            json!({"value": {"src-uri": "amqp://"}})
        );
        assert!(matches!(body("src-uri=amqp://"), Err(CliError::Usage(_))));
    }
}
