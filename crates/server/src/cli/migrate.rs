//! `warren migrate`: a whole running broker (RabbitMQ, or another Warren) into Warren, or back.
//!
//! 1. It reads the source's definitions (users with their password hashes, vhosts,
//!    permissions, limits, policies, exchanges, queues, bindings, shovels), leaves out what
//!    Warren cannot carry (saying so) and imports the rest through the destination's API.
//! 2. It moves each queue's messages with a shovel session per queue (`on-confirm`: a message
//!    is acked at the source only once the destination confirmed its copy), showing progress
//!    per queue and in total, with rate and time left.
//! 3. It keeps moving while producers still publish to the source, until every source queue
//!    has been empty for `--quiet` seconds; producers can then switch, and consumers after.
//!
//! Interrupted (Ctrl-C, a kill, a lost connection), it loses nothing: what was in flight goes
//! back to its source queue. Run again, it carries on; at most the messages in flight when it
//! stopped (`--prefetch` per queue) arrive twice.

use std::collections::BTreeMap;
use std::io::Write;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Args;
use serde_json::{Map, Value};
use tokio::sync::watch;

use super::api::{enc, Api};
use super::{CliError, Conn};
use crate::shovel::definition::{AckMode, DeleteAfter, Destination, ShovelDef, Source};
use crate::shovel::worker::{Migration, Worker};
use crate::shovel::{self, Shovels, State};

/// Moves a whole broker into this one: definitions, then every queue's messages.
#[derive(Args, Debug, Clone)]
pub struct MigrateArgs {
    /// The source's management API, with its credentials: http://user:pass@rabbit:15672
    #[arg(long)]
    pub from_api: String,
    /// The source's AMQP address, with its credentials: amqp://user:pass@rabbit:5672 (each
    /// queue's vhost is added)
    #[arg(long)]
    pub from_amqp: String,
    /// Only this vhost [default: all]
    #[arg(long)]
    pub vhost: Option<String>,
    /// Only the queues whose names match this regular expression [default: all]
    #[arg(long)]
    pub queues: Option<String>,
    /// The destination's AMQP address (each queue's vhost is added)
    #[arg(
        long,
        env = "WARREN_URL",
        default_value = "amqp://guest:guest@127.0.0.1:5672"
    )]
    pub url: String,
    /// The destination's management API (for the definitions)
    #[command(flatten)]
    pub to: Conn,
    /// Done once every source queue has been empty this many seconds
    #[arg(long, default_value_t = 10.0)]
    pub quiet: f64,
    /// Messages in flight per queue (what a rerun may move twice)
    #[arg(long, default_value_t = 500)]
    pub prefetch: u16,
    /// Move messages only (the definitions are there already)
    #[arg(long)]
    pub skip_definitions: bool,
    /// Carry the definitions only, no messages
    #[arg(long, conflicts_with = "skip_definitions")]
    pub definitions_only: bool,
}

/// `warren migrate`: exit 0 once everything was carried and the source stayed empty.
pub fn main_migrate(a: MigrateArgs) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("warren migrate: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(migrate(&a)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("warren migrate: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `http://user:pass@host:15672` as an API client (the credentials out of the URL).
fn api_of(url: &str) -> Result<Api, CliError> {
    let usage = || {
        CliError::Usage(format!(
            "--from-api must be http://user:password@host:port, not {url}"
        ))
    };
    let (scheme, rest) = url.split_once("://").ok_or_else(usage)?;
    let (info, host) = rest.rsplit_once('@').ok_or_else(usage)?;
    let (user, password) = info.split_once(':').unwrap_or((info, ""));
    let decode = |s: &str| {
        percent_encoding::percent_decode_str(s)
            .decode_utf8()
            .map(|c| c.into_owned())
            .map_err(|_| usage())
    };
    Ok(Api::new(
        &format!("{scheme}://{host}"),
        &decode(user)?,
        &decode(password)?,
    ))
}

/// An AMQP URI with its path set to `vhost`.
fn with_vhost(uri: &str, vhost: &str) -> Result<String, CliError> {
    let (scheme, rest) = uri.split_once("://").ok_or_else(|| {
        CliError::Usage(format!(
            "{uri} is not an AMQP URI (amqp://user:pass@host:port)"
        ))
    })?;
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    if crate::shovel::uri::is_local(uri) || authority.rsplit('@').next().unwrap_or("").is_empty() {
        return Err(CliError::Usage(format!(
            "{uri} names no host: pass amqp://user:pass@host:port"
        )));
    }
    let query = tail.find('?').map_or("", |i| &tail[i..]);
    Ok(format!("{scheme}://{authority}/{}{query}", enc(vhost)))
}

/// The definitions to carry, and what was left out (one line each).
pub fn select(
    defs: &Value,
    vhost: Option<&str>,
    queues: Option<&regex_lite::Regex>,
) -> (Value, Vec<String>) {
    let mut left_out = Vec::new();
    let list = |k: &str| {
        defs.get(k)
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default()
    };
    let in_vhost = |v: &Value| vhost.is_none_or(|only| v["vhost"].as_str() == Some(only));
    let mut out = Map::new();
    for key in [
        "rabbit_version",
        "rabbitmq_version",
        "product_name",
        "product_version",
    ] {
        if let Some(v) = defs.get(key) {
            out.insert(key.into(), v.clone());
        }
    }
    out.insert("users".into(), list("users").into());
    out.insert(
        "vhosts".into(),
        list("vhosts")
            .into_iter()
            .filter(|v| vhost.is_none_or(|only| v["name"].as_str() == Some(only)))
            .collect::<Vec<_>>()
            .into(),
    );
    out.insert(
        "policies".into(),
        list("policies")
            .into_iter()
            .filter(|v| in_vhost(v))
            .collect::<Vec<_>>()
            .into(),
    );
    // Warren's older key held operator policies as bodies: they go as RabbitMQ keeps them.
    let operator_policies: Vec<Value> = list("operator_policies")
        .into_iter()
        .filter(|v| in_vhost(v))
        .map(|mut value| {
            let (name, vhost) = (value["name"].clone(), value["vhost"].clone());
            if let Some(m) = value.as_object_mut() {
                m.remove("name");
                m.remove("vhost");
            }
            serde_json::json!({"value": value, "name": name, "vhost": vhost,
                   "component": crate::http::definitions::OPERATOR_POLICY})
        })
        .collect();
    for key in ["permissions", "topic_permissions", "exchanges"] {
        out.insert(
            key.into(),
            list(key)
                .into_iter()
                .filter(|v| in_vhost(v))
                .collect::<Vec<_>>()
                .into(),
        );
    }
    let mut kept_queues = Vec::new();
    for q in list("queues").into_iter().filter(|v| in_vhost(v)) {
        let name = q["name"].as_str().unwrap_or("");
        if queues.is_some_and(|p| !p.is_match(name)) {
            continue;
        }
        if q["arguments"]["x-queue-type"].as_str() == Some("stream") {
            left_out.push(format!(
                "stream '{name}' in vhost '{}': Warren has no streams",
                q["vhost"].as_str().unwrap_or("")
            ));
            continue;
        }
        kept_queues.push(q);
    }
    let kept = |vhost: &str, name: &str| {
        kept_queues
            .iter()
            .any(|q| q["vhost"].as_str() == Some(vhost) && q["name"].as_str() == Some(name))
    };
    let bindings: Vec<Value> = list("bindings")
        .into_iter()
        .filter(|b| in_vhost(b))
        .filter(|b| {
            b["destination_type"] != "queue"
                || kept(
                    b["vhost"].as_str().unwrap_or(""),
                    b["destination"].as_str().unwrap_or(""),
                )
        })
        .collect();
    let mut parameters = operator_policies;
    for p in list("parameters").into_iter().filter(|v| in_vhost(v)) {
        let component = p["component"].as_str().unwrap_or("");
        let name = p["name"].as_str().unwrap_or("");
        match component {
            "vhost-limits" => parameters.push(p),
            crate::http::definitions::OPERATOR_POLICY => parameters.push(p),
            shovel::COMPONENT => match shovel::definition::parse(name, &p["value"]) {
                Ok(_) => parameters.push(p),
                Err(e) => left_out.push(format!("shovel '{name}': {}", e.join("; "))),
            },
            other => left_out.push(format!(
                "{other} parameter '{name}': Warren has no {other} (federation)"
            )),
        }
    }
    out.insert("queues".into(), kept_queues.into());
    out.insert("bindings".into(), bindings.into());
    out.insert("parameters".into(), parameters.into());
    let mut out = Value::Object(out);
    // Policy keys of plugins Warren lacks are left out.
    left_out.extend(policies_without(
        &mut out,
        warren_broker::policy::foreign_key,
    ));
    (out, left_out)
}

/// Leaves the definition keys `why` names out of every policy and operator policy of `defs`
/// (a policy with nothing else goes); what was left out, a line each.
fn policies_without(defs: &mut Value, why: impl Fn(&str) -> Option<&'static str>) -> Vec<String> {
    let mut left_out = Vec::new();
    let mut said = |what: &str, name: &Value, kept: bool, dropped: &[String]| {
        if !dropped.is_empty() {
            left_out.push(format!(
                "{what} '{}'{}: {}",
                name.as_str().unwrap_or(""),
                if kept { ", its keys" } else { "" },
                dropped.join(", ")
            ));
        }
    };
    if let Some(list) = defs.get_mut("policies").and_then(Value::as_array_mut) {
        list.retain_mut(|p| {
            let (body, dropped) = crate::http::definitions::policy_without(p, &why);
            said("policy", &p["name"], body.is_some(), &dropped);
            body.map(|b| *p = b).is_some()
        });
    }
    if let Some(list) = defs.get_mut("parameters").and_then(Value::as_array_mut) {
        list.retain_mut(|p| {
            if p["component"] != crate::http::definitions::OPERATOR_POLICY {
                return true;
            }
            let (body, dropped) = crate::http::definitions::policy_without(&p["value"], &why);
            said("operator policy", &p["name"], body.is_some(), &dropped);
            body.map(|b| p["value"] = b).is_some()
        });
    }
    left_out
}

/// Leaves out of `defs` what a destination that is not a Warren refuses (RabbitMQ refuses the
/// whole import for one of them): Warren's own policy keys, and queue arguments Warren takes
/// for a type RabbitMQ does not (`x-delivery-limit` on a classic queue); what was left out, a
/// line each. Warren's own queue arguments stay: RabbitMQ ignores those it does not know.
fn without_warren_keys(defs: &mut Value) -> Vec<String> {
    let mut left_out = policies_without(defs, |k| {
        warren_broker::policy::warren_only_key(k)
            .then_some("Warren's own; the destination has none")
    });
    if let Some(list) = defs.get_mut("queues").and_then(Value::as_array_mut) {
        for q in list {
            let name = q["name"].as_str().unwrap_or("").to_owned();
            let qtype = match q["arguments"]["x-queue-type"].as_str() {
                Some("quorum") => warren_broker::QueueType::Quorum,
                Some("stream") => warren_broker::QueueType::Stream,
                _ => warren_broker::QueueType::Classic,
            };
            let Some(args) = q.get_mut("arguments").and_then(Value::as_object_mut) else {
                continue;
            };
            let refused: Vec<String> = args
                .keys()
                .filter(|k| warren_broker::queue::args::refused_by_rabbitmq(qtype, k))
                .cloned()
                .collect();
            for k in &refused {
                args.remove(k);
            }
            if !refused.is_empty() {
                left_out.push(format!(
                    "queue '{name}', its arguments: {} (Warren's for a {} queue; the destination \
                     refuses them there)",
                    refused.join(", "),
                    qtype.as_str()
                ));
            }
        }
    }
    left_out
}

/// A source queue's message TTL (ms): the lower of its `x-message-ttl` and its policies'
/// (`effective_policy_definition` merges the user's and the operator's, as on RabbitMQ). None
/// when it has none, or its statistics do not say yet (its messages then count their time to
/// live again on arrival: late, never early).
fn queue_ttl(source: &Api, vhost: &str, name: &str) -> Option<u64> {
    let path = format!("/queues/{}/{}", enc(vhost), enc(name));
    let q = source.get(&path, "a queue").ok()?;
    [
        &q["arguments"]["x-message-ttl"],
        &q["effective_policy_definition"]["message-ttl"],
    ]
    .into_iter()
    .filter_map(Value::as_u64)
    .min()
}

/// What every round moves, and how.
struct Plan {
    /// (vhost, name) of each queue.
    queues: Vec<(String, String)>,
    /// Each source queue's message TTL ([`queue_ttl`]).
    ttls: BTreeMap<(String, String), Option<u64>>,
    /// The destination is a Warren (which reads `x-redelivered`).
    into_warren: bool,
}

/// One queue being moved.
struct Moving {
    vhost: String,
    name: String,
    counters: std::sync::Arc<shovel::Counters>,
    /// Ready and unacked at the source, at the last look.
    left: u64,
}

async fn migrate(a: &MigrateArgs) -> Result<(), CliError> {
    let source = api_of(&a.from_api)?;
    // A URI the shovels would refuse (or a TLS file that does not read) would only show up as
    // sessions retrying for ever.
    crate::shovel::uri::check(&a.from_amqp)
        .map_err(|e| CliError::Usage(format!("--from-amqp: {e}")))?;
    if crate::shovel::uri::is_tls(&a.from_amqp) {
        crate::shovel::uri::tls_connector(&a.from_amqp)
            .map_err(|e| CliError::Usage(format!("--from-amqp: {e}")))?;
    }
    let pattern = match &a.queues {
        Some(p) => Some(regex_lite::Regex::new(p).map_err(|e| {
            CliError::Usage(format!("--queues {p} is not a regular expression: {e}"))
        })?),
        None => None,
    };
    let defs = tokio::task::block_in_place(|| source.get("/definitions", "definitions"))?;
    let (mut defs, mut left_out) = select(&defs, a.vhost.as_deref(), pattern.as_ref());
    let into_warren = {
        let dest = a.to.api();
        let overview = tokio::task::block_in_place(|| dest.get("/overview", "the overview"))?;
        overview["product_name"].as_str() == Some("Warren")
    };
    if !a.skip_definitions && !into_warren {
        left_out.extend(without_warren_keys(&mut defs));
    }
    for line in &left_out {
        println!("not carried: {line}");
    }
    let count = |k: &str| defs[k].as_array().map_or(0, Vec::len);
    if !a.skip_definitions {
        let dest = a.to.api();
        tokio::task::block_in_place(|| {
            dest.call("POST", "/definitions", Some(&defs), &[], "the definitions")
        })?;
        println!(
            "definitions imported: {} user(s), {} vhost(s), {} permission(s), {} policy(ies), \
             {} exchange(s), {} queue(s), {} binding(s), {} parameter(s)",
            count("users"),
            count("vhosts"),
            count("permissions"),
            count("policies"),
            count("exchanges"),
            count("queues"),
            count("bindings"),
            count("parameters"),
        );
    }
    if a.definitions_only {
        return Ok(());
    }
    let queues: Vec<(String, String)> = defs["queues"]
        .as_array()
        .map(|l| {
            l.iter()
                .map(|q| {
                    (
                        q["vhost"].as_str().unwrap_or("/").to_owned(),
                        q["name"].as_str().unwrap_or("").to_owned(),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    if queues.is_empty() {
        println!("no queues to move");
        return Ok(());
    }
    // Each source queue's TTL, so that a moved message keeps only what is left of it.
    let ttls = tokio::task::block_in_place(|| {
        queues
            .iter()
            .map(|q| (q.clone(), queue_ttl(&source, &q.0, &q.1)))
            .collect()
    });
    let plan = Plan {
        queues,
        ttls,
        into_warren,
    };
    let quiet = super::maintenance::seconds(a.quiet);
    let started = Instant::now();
    let mut depths = Depths::new(&a.from_amqp);
    let mut moved_before = 0u64;
    loop {
        let round = move_round(a, &plan, &mut depths, quiet, moved_before).await?;
        moved_before += round
            .moving
            .iter()
            .map(|m| m.counters.forwarded())
            .sum::<u64>();
        round.outcome?;
        if !round.clean {
            // A connection that did not close may still hold unacked messages, which the
            // source counts as neither ready nor gone until it notices: another round.
            eprintln!("a session did not close cleanly: moving again what it held");
            continue;
        }
        // What was in flight as the sessions closed went back to the source, and a producer
        // may have published in the last moment: only an empty source ends the migration.
        // A consumer still attached there (the migration's own are closed by now) may hold
        // unacked messages, which come back to the source queue when it leaves: while any
        // does, the migration goes on (see `held_at_source`).
        let mut left = 0;
        let mut attached = Vec::new();
        for (vhost, name) in &plan.queues {
            let (ready, consumers) = depths.depth(vhost, name).await.unwrap_or((1, 0));
            left += ready;
            if consumers > 0 {
                attached.push((vhost.as_str(), name.as_str()));
            }
        }
        if left == 0 && !attached.is_empty() {
            let held = held_at_source(&source, &mut depths, &attached).await;
            if !held.is_empty() {
                eprintln!(
                    "the source queues are empty, but consumers still attached there hold \
                     messages unacked, which go back to the source when they leave ({}): switch \
                     them to Warren (runbook step 4); the migration carries on until none is held",
                    held.join(", ")
                );
                continue;
            }
        }
        if left == 0 {
            let secs = started.elapsed().as_secs_f64();
            println!(
                "moved {moved_before} message(s) from {} queue(s) in {secs:.1} s ({:.0} msg/s); \
                 the source queues stayed empty for {:.0} s: switch producers to Warren, then \
                 consumers",
                plan.queues.len(),
                moved_before as f64 / secs.max(1e-3),
                quiet.as_secs_f64()
            );
            return Ok(());
        }
        eprintln!("{left} message(s) reached the source as the sessions stopped: moving them too");
    }
}

/// RabbitMQ publishes a queue's statistics every 5 seconds: a reading at least this much
/// later includes what consumers took before the first one.
const STATS_INTERVAL: Duration = Duration::from_secs(6);

/// The `attached` queues (vhost, name) whose consumers hold messages unacked, each described.
/// Only the management API's statistics tell what other clients hold, and they run behind: a
/// queue that reads 0 is read again once they have caught up with the first reading (a
/// message taken since then is one a producer still sent to the source after it emptied).
/// A queue that still reads ready messages, or cannot be read, counts as held.
async fn held_at_source(
    source: &Api,
    depths: &mut Depths,
    attached: &[(&str, &str)],
) -> Vec<String> {
    let unacked = |vhost: &str, name: &str| {
        let path = format!("/queues/{}/{}", enc(vhost), enc(name));
        tokio::task::block_in_place(|| source.get(&path, "a source queue"))
            .ok()
            .and_then(|q| q["messages_unacknowledged"].as_u64())
    };
    let mut held = Vec::new();
    let mut again = Vec::new();
    for &(vhost, name) in attached {
        match unacked(vhost, name) {
            Some(0) => again.push((vhost, name)),
            n => held.push(format!(
                "{name} in vhost '{vhost}': {} unacked",
                n.map_or("?".into(), |n| n.to_string())
            )),
        }
    }
    if !held.is_empty() || again.is_empty() {
        return held;
    }
    tokio::time::sleep(STATS_INTERVAL).await;
    for (vhost, name) in again {
        let (ready, consumers) = depths.depth(vhost, name).await.unwrap_or((1, 1));
        let n = if consumers == 0 {
            Some(0)
        } else {
            unacked(vhost, name)
        };
        if ready > 0 || n != Some(0) {
            held.push(format!(
                "{name} in vhost '{vhost}': {} unacked, {ready} ready",
                n.map_or("?".into(), |n| n.to_string())
            ));
        }
    }
    held
}

/// One round: a shovel session per queue until every source queue has been empty and no
/// message moved for `quiet`; the sessions are stopped (and their connections closed) before
/// it returns.
async fn move_round(
    a: &MigrateArgs,
    plan: &Plan,
    depths: &mut Depths,
    quiet: Duration,
    moved_before: u64,
) -> Result<Round, CliError> {
    let shovels = Shovels::new("warren migrate".into());
    let (stop, stopped) = watch::channel(false);
    let mut moving = Vec::new();
    let mut tasks = Vec::new();
    for (vhost, name) in &plan.queues {
        let def = ShovelDef {
            src_uris: vec![with_vhost(&a.from_amqp, vhost)?],
            src: Source::Queue {
                name: name.clone(),
                args: Map::new(),
            },
            dest_uris: vec![with_vhost(&a.url, vhost)?],
            dest: Destination::Queue {
                name: name.clone(),
                args: Map::new(),
            },
            ack_mode: AckMode::OnConfirm,
            delete_after: DeleteAfter::Never,
            prefetch: a.prefetch,
            reconnect_delay: Duration::from_secs(1),
            add_forward_headers: false,
            add_timestamp_header: false,
            publish_properties: Map::new(),
        };
        let counters = shovels.track(vhost, name, def.clone());
        let worker = Worker {
            vhost: vhost.clone(),
            name: name.clone(),
            def,
            local: shovel::Local {
                addr: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
                secret: String::new(),
            },
            shovels: shovels.clone(),
            cluster_name: "warren migrate".into(),
            counters: counters.clone(),
            migration: Some(Migration {
                queue_ttl_ms: plan
                    .ttls
                    .get(&(vhost.clone(), name.clone()))
                    .copied()
                    .flatten(),
                into_warren: plan.into_warren,
            }),
        };
        tasks.push(tokio::spawn(worker.run(stopped.clone())));
        moving.push(Moving {
            vhost: vhost.clone(),
            name: name.clone(),
            counters,
            left: u64::MAX,
        });
    }
    let mut quiet_since: Option<Instant> = None;
    let mut last = (Instant::now(), 0u64);
    let outcome = loop {
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            _ = tokio::signal::ctrl_c() => break Err(CliError::Failed(
                "interrupted: what was in flight went back to the source; run the same command \
                 again to carry on".into())),
        }
        // Exact counts (a passive declare), not the API's statistics, which lag by seconds.
        let mut known = true;
        for m in &mut moving {
            match depths.depth(&m.vhost, &m.name).await {
                Some((n, _)) => m.left = n,
                None => known = false,
            }
        }
        let moved: u64 = moving.iter().map(|m| m.counters.forwarded()).sum();
        let left: u64 = moving.iter().map(|m| m.left.min(u64::MAX / 1024)).sum();
        let rate = (moved - last.1) as f64 / last.0.elapsed().as_secs_f64().max(1e-3);
        let still = moved == last.1;
        last = (Instant::now(), moved);
        show(&moving, &shovels, moved_before + moved, left, rate);
        if known && left == 0 && still {
            let since = *quiet_since.get_or_insert_with(Instant::now);
            if since.elapsed() >= quiet {
                break Ok(());
            }
        } else {
            quiet_since = None;
        }
    };
    let mut clean = true;
    for t in tasks {
        clean &= shovel::stop_worker(&stop, t).await;
    }
    Ok(Round {
        moving,
        outcome,
        clean,
    })
}

/// What a round of [`move_round`] did.
struct Round {
    moving: Vec<Moving>,
    outcome: Result<(), CliError>,
    /// Every session closed its connections: nothing it held is still unacked at the source.
    clean: bool,
}

/// Ready and consumer counts at the source, read over AMQP with a passive declare (one connection per
/// vhost, opened again after a failure).
struct Depths {
    base: String,
    open: BTreeMap<String, (lapin::Connection, lapin::Channel)>,
}

impl Depths {
    fn new(base: &str) -> Depths {
        Depths {
            base: base.to_owned(),
            open: BTreeMap::new(),
        }
    }

    /// The queue's ready messages and consumers; `None` when the source cannot be asked now
    /// (or the queue is gone).
    async fn depth(&mut self, vhost: &str, queue: &str) -> Option<(u64, u32)> {
        if !self.open.contains_key(vhost) {
            let url = with_vhost(&self.base, vhost).ok()?;
            let target = url.parse::<lapin::uri::AMQPUri>().ok()?;
            let conn = crate::shovel::uri::connect(&url, target, Default::default())
                .await
                .ok()?;
            let ch = conn.create_channel().await.ok()?;
            self.open.insert(vhost.to_owned(), (conn, ch));
        }
        let (_, ch) = self.open.get(vhost)?;
        let passive = lapin::options::QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        match ch
            .queue_declare(queue.into(), passive, lapin::types::FieldTable::default())
            .await
        {
            Ok(q) => Some((u64::from(q.message_count()), q.consumer_count())),
            Err(_) => {
                // A refused declare closes the channel: start again next time.
                self.open.remove(vhost);
                None
            }
        }
    }
}

/// A progress line (and the busiest queues) on stderr.
fn show(moving: &[Moving], shovels: &Shovels, moved: u64, left: u64, rate: f64) {
    let eta = if left == 0 {
        "empty".to_owned()
    } else if rate >= 1.0 {
        format!("{:.0} s left", left as f64 / rate)
    } else {
        "waiting".to_owned()
    };
    let mut err = std::io::stderr();
    let _ = writeln!(
        err,
        "moved {moved}, {left} left at the source ({rate:.0} msg/s, {eta})"
    );
    let mut busiest: Vec<&Moving> = moving.iter().filter(|m| m.left > 0).collect();
    busiest.sort_by_key(|m| std::cmp::Reverse(m.left));
    for m in busiest.iter().take(5) {
        let state = match shovels.state_of(&m.vhost, &m.name) {
            Some((State::Running, _)) => String::new(),
            Some((_, Some(reason))) => format!(" (reconnecting: {reason})"),
            _ => " (starting)".to_owned(),
        };
        let _ = writeln!(
            err,
            "  {} in vhost '{}': moved {}, {} left{state}",
            m.name,
            m.vhost,
            m.counters.forwarded(),
            m.left
        );
    }
    let _ = err.flush();
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn what_warren_cannot_carry_is_left_out_and_said() {
        let defs = json!({
            "users": [{"name": "app"}],
            "vhosts": [{"name": "/"}, {"name": "other"}],
            "permissions": [{"user": "app", "vhost": "/"}, {"user": "app", "vhost": "other"}],
            "queues": [
                {"name": "jobs", "vhost": "/", "arguments": {}},
                {"name": "events", "vhost": "/", "arguments": {"x-queue-type": "stream"}},
                {"name": "skipped", "vhost": "/", "arguments": {}},
                {"name": "jobs", "vhost": "other", "arguments": {}}
            ],
            "bindings": [
                {"vhost": "/", "source": "x", "destination": "jobs", "destination_type": "queue"},
                {"vhost": "/", "source": "x", "destination": "skipped", "destination_type": "queue"},
                {"vhost": "/", "source": "x", "destination": "y", "destination_type": "exchange"}
            ],
            "parameters": [
                {"vhost": "/", "component": "federation-upstream", "name": "up", "value": {}},
                {"vhost": "/", "component": "shovel", "name": "tls", "value":
                    {"src-uri": "amqps://h?password=secret", "src-queue": "a", "dest-uri": "amqp://"}},
                {"vhost": "/", "component": "shovel", "name": "ok", "value":
                    {"src-uri": "amqp://", "src-queue": "a", "dest-uri": "amqp://h"}},
                {"vhost": "/", "component": "vhost-limits", "name": "limits", "value": {"max-queues": 5}},
                {"vhost": "/", "component": "operator_policy", "name": "cap", "value":
                    {"pattern": "^(?!amq\\.).*", "definition": {"max-length": 9, "max-age": "1D"}}},
                {"vhost": "other", "component": "operator_policy", "name": "elsewhere", "value":
                    {"pattern": ".*", "definition": {"max-length": 9}}}
            ],
            "policies": [
                {"vhost": "/", "name": "ha", "pattern": "^(?!amq\\.).*",
                 "definition": {"ha-mode": "all", "message-ttl": 10}},
                {"vhost": "/", "name": "fed", "pattern": ".*",
                 "definition": {"federation-upstream-set": "all"}},
                {"vhost": "/", "name": "mixed", "pattern": ".*",
                 "definition": {"federation-upstream": "up", "expires": 1000}}
            ]
        });
        let pattern = regex_lite::Regex::new("^(jobs|events)$").expect("regex");
        let (out, left_out) = select(&defs, Some("/"), Some(&pattern));
        let names = |k: &str| -> Vec<String> {
            out[k]
                .as_array()
                .expect("list")
                .iter()
                .map(|v| v["name"].as_str().unwrap_or("").to_owned())
                .collect()
        };
        assert_eq!(names("queues"), ["jobs"]);
        assert_eq!(names("vhosts"), ["/"]);
        assert_eq!(names("parameters"), ["ok", "limits", "cap"]);
        assert_eq!(
            out["parameters"][2]["value"]["definition"],
            json!({"max-length": 9}),
            "a stream key left out of an operator policy"
        );
        assert_eq!(names("policies"), ["ha", "mixed"]);
        assert_eq!(out["policies"][1]["definition"], json!({"expires": 1000}));
        assert_eq!(out["bindings"].as_array().map(Vec::len), Some(2));
        assert_eq!(out["permissions"].as_array().map(Vec::len), Some(1));
        assert_eq!(left_out.len(), 6, "{left_out:?}");
        let said = left_out.join("\n");
        for line in [
            "policy 'fed': federation-upstream-set (federation)",
            "policy 'mixed', its keys: federation-upstream (federation)",
            "operator policy 'cap', its keys: max-age (streams)",
            "stream 'events'",
        ] {
            assert!(said.contains(line), "{line} in {said}");
        }
    }

    #[test]
    fn uris_get_each_queues_vhost() {
        assert_eq!(
            with_vhost("amqp://u:p@rabbit:5672", "/").expect("uri"),
            "amqp://u:p@rabbit:5672/%2F"
        );
        assert_eq!(
            with_vhost("amqp://u:p@rabbit:5672/old?heartbeat=5", "billing").expect("uri"),
            "amqp://u:p@rabbit:5672/billing?heartbeat=5"
        );
        assert!(with_vhost("amqp://", "/").is_err());
        assert!(
            api_of("http://rabbit:15672").is_err(),
            "credentials are needed"
        );
        assert!(api_of("http://admin:s%40cret@rabbit:15672").is_ok());
    }
}
