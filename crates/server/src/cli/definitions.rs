//! `warren export` and `warren import`: RabbitMQ's definitions format, whole or per vhost.

use std::io::Read;
use std::path::Path;
use std::process::ExitCode;

use serde_json::Value;

use super::api::{enc, Api};
use super::CliError;

fn path(vhost: Option<&str>) -> String {
    match vhost {
        Some(v) => format!("/definitions/{}", enc(v)),
        None => "/definitions".to_owned(),
    }
}

fn vhost_missing(vhost: Option<&str>) -> String {
    format!(
        "vhost '{}' does not exist (see `warren list vhosts`)",
        vhost.unwrap_or("/")
    )
}

/// `GET /api/definitions` to FILE, or stdout.
pub fn export(api: &Api, file: Option<&Path>, vhost: Option<&str>) -> Result<ExitCode, CliError> {
    let defs = api.get(&path(vhost), &vhost_missing(vhost))?;
    let text = serde_json::to_string_pretty(&defs)
        .map_err(|e| CliError::Failed(format!("cannot write the definitions: {e}")))?;
    match file {
        None => println!("{text}"),
        Some(f) => {
            std::fs::write(f, text + "\n")
                .map_err(|e| CliError::Failed(format!("cannot write {}: {e}", f.display())))?;
            let count = |k: &str| defs.get(k).and_then(Value::as_array).map_or(0, Vec::len);
            eprintln!(
                "exported {} queue(s), {} exchange(s), {} binding(s), {} user(s) to {}",
                count("queues"),
                count("exchanges"),
                count("bindings"),
                count("users"),
                f.display()
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `POST /api/definitions` with the file's contents ("-": stdin).
pub fn import(api: &Api, file: &Path, vhost: Option<&str>) -> Result<ExitCode, CliError> {
    let text = if file == Path::new("-") {
        let mut s = String::new();
        std::io::stdin()
            .read_to_string(&mut s)
            .map_err(|e| CliError::Failed(format!("cannot read stdin: {e}")))?;
        s
    } else {
        std::fs::read_to_string(file)
            .map_err(|e| CliError::Failed(format!("cannot read {}: {e}", file.display())))?
    };
    let defs: Value = serde_json::from_str(&text).map_err(|e| {
        CliError::Failed(format!(
            "{} is not a definitions file (JSON): {e}",
            file.display()
        ))
    })?;
    api.call(
        "POST",
        &path(vhost),
        Some(&defs),
        &[],
        &vhost_missing(vhost),
    )?;
    println!("imported definitions from {}", file.display());
    Ok(ExitCode::SUCCESS)
}
