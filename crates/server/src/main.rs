//! The `warren` binary: an AMQP 0-9-1 broker, and the commands that manage one (`cli`).

mod alarms;
mod allocations;
mod cli;
mod cluster;
mod config;
mod connection_threads;
mod driver;
mod http;
mod joining;
mod metrics;
mod relay;
mod shovel;
mod sqs;
mod storage;
mod tls;

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tracing_subscriber::EnvFilter;
use warren_broker::{Broker, BrokerConfig};
use warren_session::Node;

use crate::config::{Args, Config};

#[global_allocator]
static ALLOCATOR: allocations::Counting = allocations::Counting;

fn main() -> ExitCode {
    let args = Args::parse();
    match args.command {
        Some(config::Command::Redrive(r)) => return cli::transfer::main_redrive(r),
        Some(config::Command::Migrate(m)) => return cli::migrate::main_migrate(m),
        Some(config::Command::Cli(c)) => return cli::main(c),
        None => {}
    }
    if let Some(path) = &args.replay_commands {
        return replay_commands(path);
    }
    let config = match Config::resolve(args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("warren: {e}");
            return ExitCode::from(2);
        }
    };
    allocations::enable_from_env();
    let filter = EnvFilter::try_new(&config.log_level).unwrap_or_else(|_| EnvFilter::new("info"));
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match config.log_format {
        config::LogFormat::Json => logs.json().flatten_event(true).init(),
        config::LogFormat::Text => logs
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("warren: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(config)) {
        Ok(Stopped::ForGood) => ExitCode::SUCCESS,
        Ok(Stopped::Again) => {
            // Everything that held the data directory was closed by `run`. A stop signal from
            // here to the new run's start is not seen (the run before took it): keep this short.
            runtime.shutdown_background();
            tracing::warn!("starting again");
            let e = joining::restart();
            eprintln!(
                "warren: cannot start again ({e}): start it again as it was started; with the \
                 settings saved in its data directory it joins the cluster"
            );
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("warren: {e}");
            ExitCode::FAILURE
        }
    }
}

/// How the node's run ended.
enum Stopped {
    /// Stopped (a signal): the process ends.
    ForGood,
    /// Stopped to start again in this process: as a node of a cluster (`warren ctl
    /// join_cluster`), or on its own once that was called off.
    Again,
}

/// `--replay-commands FILE`: checks that a command log rebuilds the queues it recorded.
fn replay_commands(path: &std::path::Path) -> ExitCode {
    let data = match std::fs::read(path) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("warren: cannot read {}: {e}", path.display());
            return ExitCode::from(2);
        }
    };
    match warren_broker::queue::log::replay(data.into()) {
        Ok(s) => {
            println!(
                "{}: {} commands on {} queues replayed, {} state digests matched{}",
                path.display(),
                s.records,
                s.queues,
                s.state_checks,
                if s.truncated {
                    " (the log ends inside a record: the writer was killed; ignored)"
                } else {
                    ""
                }
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("warren: {}: replay failed: {e}", path.display());
            ExitCode::FAILURE
        }
    }
}

/// Connections the kernel completes and holds until they are accepted (the kernel caps it at
/// `net.core.somaxconn`). With the usual 128 a burst of connects (clients reconnecting after a
/// restart, or a flood of idle ones) overflows it, and each connect past it waits for a SYN
/// retransmit, a second or more; RabbitMQ's networking guide advises raising its 128 to 4096
/// for such bursts. Entries cost the kernel little, and the handshake timeout bounds what each
/// accepted connection may hold.
const LISTEN_BACKLOG: u32 = 4096;

fn bind_listener(addr: std::net::SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    // As std's and tokio's own bind: a restart can listen while old connections linger in TIME_WAIT.
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// Listens on `port`, or says which flag moves it.
async fn listen(
    config: &Config,
    port: u16,
    what: &str,
    flag: &str,
) -> std::io::Result<TcpListener> {
    bind_listener((config.bind, port).into()).map_err(|e| {
        let hint = match e.kind() {
            std::io::ErrorKind::AddrInUse => format!(
                " (another program, a RabbitMQ perhaps, is listening there: pick another port with \
                 {flag} N, e.g. scripts/run {flag} {0}, or through cargo: \
                 cargo run --release -- {flag} {0})",
                port.saturating_add(1)
            ),
            std::io::ErrorKind::PermissionDenied => {
                format!(" (ports below 1024 need privileges: choose another with {flag} N)")
            }
            std::io::ErrorKind::AddrNotAvailable => {
                " (no interface has that address: choose another with --bind ADDR)".to_string()
            }
            _ => String::new(),
        };
        std::io::Error::new(
            e.kind(),
            format!(
                "cannot listen on {}:{port} ({what}): {e}{hint}",
                config.bind
            ),
        )
    })
}

/// Binds an optional HTTP listener (so that a busy port stops the start, naming the flag that
/// moves it and the one that turns it off).
async fn optional_listener(
    config: &Config,
    port: Option<u16>,
    (what, flag, off): (&str, &str, &str),
) -> std::io::Result<Option<TcpListener>> {
    let Some(p) = port else { return Ok(None) };
    listen(config, p, what, flag)
        .await
        .map(Some)
        .map_err(|e| std::io::Error::new(e.kind(), format!("{e}; {off} turns it off")))
}

/// Binds the management API's, metrics' and SQS API's ports.
async fn http_listeners(
    config: &Config,
) -> std::io::Result<(
    Option<TcpListener>,
    Option<TcpListener>,
    Option<TcpListener>,
)> {
    let management = optional_listener(
        config,
        config.management_port,
        ("the management API", "--management-port", "--no-management"),
    )
    .await?;
    let prometheus = optional_listener(
        config,
        config.prometheus_port,
        ("Prometheus", "--prometheus-port", "--no-prometheus"),
    )
    .await?;
    let sqs = optional_listener(
        config,
        config.sqs_port,
        ("the SQS API", "--sqs-port", "--no-sqs"),
    )
    .await?;
    Ok((management, prometheus, sqs))
}

async fn run(config: Config) -> std::io::Result<Stopped> {
    // A join asked for whose node did not stop cleanly was not counted: not done.
    if joining::drop_interrupted(&config.data_dir)? {
        tracing::warn!(
            "joining a cluster was asked for, but the node did not stop cleanly: it starts on \
             its own, keeping what it holds (ask again)"
        );
    }
    // A node that `warren ctl join_cluster` stopped starts from an empty data directory.
    if joining::reset_if_asked(&config.data_dir).map_err(std::io::Error::other)? {
        tracing::warn!(data_dir = %config.data_dir.display(), "data directory reset: this node joins the cluster as a new node");
    }
    let tls = match &config.tls {
        Some(files) => Some(
            tls::Tls::load(files.clone())
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?,
        ),
        None => None,
    };
    let listener = listen(&config, config.port, "AMQP clients", "--port").await?;
    let tls_listener = match &tls {
        Some(t) => Some((
            listen(
                &config,
                config.tls_port,
                "AMQP clients over TLS",
                "--tls-port",
            )
            .await?,
            t.clone(),
        )),
        None => None,
    };
    let (management, prometheus, sqs) = http_listeners(&config).await?;
    tracing::info!(address = %listener.local_addr()?, "warren listening for AMQP 0-9-1 clients");
    if let Some((l, t)) = &tls_listener {
        tracing::info!(
            address = %l.local_addr()?,
            cert = %t.files().cert.display(),
            verify = ?t.files().verify,
            "warren listening for AMQP 0-9-1 clients over TLS (amqps); SIGHUP reloads the certificate"
        );
    }
    let scheme = |on: bool| if on { "https" } else { "http" };
    if let Some(l) = &management {
        tracing::info!(address = %l.local_addr()?, "management API and web page at {}://{}/", scheme(config.management_tls), l.local_addr()?);
    }
    if let Some(l) = &prometheus {
        tracing::info!(address = %l.local_addr()?, "Prometheus metrics at {}://{}/metrics", scheme(config.prometheus_tls), l.local_addr()?);
    }
    if let Some(l) = &sqs {
        tracing::info!(address = %l.local_addr()?, "SQS API (JSON protocol) at http://{}/", l.local_addr()?);
    }
    if let Some(t) = &tls {
        tokio::spawn(reload_on_sighup(t.clone()));
    }
    // Server-named queues must not be predictable across restarts.
    let name_seed = {
        use std::hash::{BuildHasher, Hasher};
        std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish()
    };
    let mut broker = Broker::new(BrokerConfig {
        name_seed,
        max_message_size: usize::try_from(config.session.max_message_size).unwrap_or(usize::MAX),
        persistence: true,
        page_window: config.queue_window,
        page_window_idle: (config.queue_window / 256).max(1),
        consumer_max_per_queue: config.consumer_max_per_queue,
        default_queue_type: config.default_queue_type,
        ..BrokerConfig::default()
    });
    let recorder = match &config.record_commands {
        Some(path) => {
            let file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map_err(|e| {
                    std::io::Error::new(
                        e.kind(),
                        format!(
                            "cannot open the command log {} (--record-commands): {e}",
                            path.display()
                        ),
                    )
                })?;
            broker.set_recording(true);
            tracing::warn!(path = %path.display(), "recording every queue command (a debugging option: it slows the broker)");
            Some(driver::Recorder::new(file))
        }
        None => None,
    };
    // A cluster node replicates the quorum queues it recovers from the store: it joins before.
    let cluster = config.cluster.as_ref().map(|c| {
        let boot = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
            .max(1);
        let nodes: Vec<u64> = c.nodes.keys().copied().collect();
        broker.join_cluster(c.node, &nodes, boot);
        broker.set_cluster_addresses(c.nodes.iter().map(|(n, a)| (*n, a.to_string())).collect());
        // What the cluster's transport can carry to a follower: one frame, or pieces once
        // every node takes them.
        broker.set_snapshot_policy(
            c.snapshot_entries,
            warren_broker::SnapshotLimits {
                frame: c.snapshot_inline_max,
                pieced: cluster::MAX_SNAPSHOT,
                large: cluster::MAX_SNAPSHOT_LARGE,
            },
        );
        broker.set_snapshot_interval(c.snapshot_interval_ms);
        broker.set_membership_reconciliation(c.reconciliation);
        let mut peers = c.nodes.clone();
        // `Config::resolve` checked that the list holds this node.
        let own = peers.remove(&c.node);
        cluster::ClusterConfig {
            node: c.node,
            peers,
            listen: own.map_or_else(
                || std::net::SocketAddr::from(([0, 0, 0, 0], 0)),
                |a| cluster_listen(c.node, &a),
            ),
            secret: c.secret.clone(),
            tls: c.tls.clone(),
            dir: config.data_dir.join("raft"),
            tick_ms: c.tick_ms,
            boot,
            snapshot_keep: c.snapshot_entries,
            join: c.join.then(|| cluster_address(c)),
            inline_max: c.snapshot_inline_max,
        }
    });
    if let Some(c) = &cluster {
        tracing::info!(node = c.node, listen = %c.listen, peers = c.peers.len(), "cluster node: quorum queues are replicated on every node");
    }
    let store = warren_store::Store::open(&config.data_dir)
        .map(std::sync::Arc::new)
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    // Deep queues keep their messages on disk and read them back through the store.
    broker.set_pager(Box::new(warren_store::StorePager(store.clone())));
    // Deep replicated queues keep only their messages' logical parts in memory; the contents
    // go to segment files beside the store (their group's log stays the durable record).
    let away = warren_store::AwayFiles::open(&config.data_dir.join("away")).map_err(|e| {
        std::io::Error::other(format!("{}: {e}", config.data_dir.join("away").display()))
    })?;
    broker.set_away_store(std::sync::Arc::new(away));
    // Definitions now; the queues' messages in the background, one queue at a time, while
    // connections are accepted (and held after their handshake until it is over).
    let started = std::time::Instant::now();
    let recovery = store
        .begin_recovery(&mut broker)
        .map_err(|e| std::io::Error::other(format!("{}: {e}", config.data_dir.display())))?;
    tracing::info!(
        data_dir = %config.data_dir.display(),
        queues = recovery.queues_left(),
        ms = started.elapsed().as_millis() as u64,
        "definitions recovered; restoring the queues' messages"
    );
    // The node's shovels reach its own listener as its internal user, with a secret made now.
    let mut session = config.session.clone();
    let secret = internal_secret()?;
    session.internal_secret = Some(secret.clone());
    let local = shovel::Local {
        addr: own_address(listener.local_addr()?),
        secret,
    };
    let mut node = Node::new(session, broker);
    // Users come after the stored ones: a user deleted through the API stays deleted, and
    // the built-in guest is made on a new node only.
    let fresh = node.broker().access().is_empty();
    node.apply_config_users(fresh, &mut http::passwords::salt);
    node.set_recovering(true, 0);
    let (stop_tx, stop_rx) = watch::channel(false);
    let restart = std::sync::Arc::new(joining::Restart::new(std::sync::Arc::new(stop_tx)));
    let on_signal = restart.clone();
    tokio::spawn(async move {
        wait_for_signal().await;
        on_signal.signalled();
    });
    let restart_api = restart.clone();
    let served = driver::serve(
        (listener, tls_listener),
        node,
        recorder,
        (
            Some(store),
            Some(driver::PendingRecovery {
                recovery,
                step_pause: config.recovery_step_delay,
            }),
        ),
        (
            config.alarms,
            config.data_dir.clone(),
            config.api_writes,
            connection_threads::ConnectionThreads::start(config.connection_threads)?,
        ),
        (stop_rx, cluster),
        |node| {
            let shovels = shovel::Shovels::new(node_name(&config));
            let restarter = shovels.clone();
            node.set_shovel_restarter(move |vhost, name| restarter.restart(vhost, name));
            let sqs_port = sqs
                .as_ref()
                .and_then(|l| l.local_addr().ok())
                .map(|a| a.port());
            if let Some(l) = sqs {
                tokio::spawn(sqs::serve(
                    l,
                    std::sync::Arc::new(sqs::Sqs::new(
                        node.clone(),
                        node_name(&config),
                        Some(local.clone()),
                    )),
                ));
            }
            tokio::spawn(shovel::supervise(node.clone(), shovels.clone(), local));
            let listeners = HttpListeners {
                management,
                prometheus,
                sqs_port,
            };
            start_http(
                node,
                shovels,
                &config,
                tls.as_ref(),
                (listeners, restart_api),
            )
        },
    )
    .await?;
    // Give writer tasks a moment to put the last close frames on the wire.
    tokio::time::sleep(Duration::from_millis(100)).await;
    if let Some(store) = served.store {
        store
            .close_clean()
            .map_err(|e| std::io::Error::other(e.to_string()))?;
    }
    let dir = &config.data_dir;
    let (force, signalled) = match restart.decide() {
        joining::Outcome::NoJoin => return Ok(Stopped::ForGood),
        joining::Outcome::Join { force, signalled } => (force, signalled),
    };
    let again = if signalled {
        Stopped::ForGood
    } else {
        Stopped::Again
    };
    if served.held > 0 && !force {
        // Counted when asked, but more came before the node stopped taking them: it keeps
        // them, on its own.
        joining::Asked::withdraw(dir).map_err(|e| {
            std::io::Error::other(format!(
                "cannot remove {} from {}: {e}; remove it before starting again",
                joining::ASKED,
                dir.display()
            ))
        })?;
        tracing::error!(
            held = served.held,
            "joining the cluster is called off: messages came while the node stopped; it \
             keeps them, on its own (move them, then ask again)"
        );
        return Ok(again);
    }
    joining::Asked::confirm(dir).map_err(|e| {
        std::io::Error::other(format!(
            "cannot make the cluster settings in {} the node's: {e}; it stays on its own",
            dir.display()
        ))
    })?;
    if signalled {
        tracing::warn!("stopped by a signal while joining a cluster: the next start resets this node and joins");
    }
    Ok(again)
}

/// 64 random bytes, hex: what the node's connections to itself log in with.
fn internal_secret() -> std::io::Result<String> {
    let mut bytes = [0u8; 32];
    getrandom::getrandom(&mut bytes).map_err(|e| {
        std::io::Error::other(format!("no randomness for the internal secret: {e}"))
    })?;
    Ok(hex::encode(bytes))
}

/// Where this node's own AMQP listener is reached from inside the node (a listener on every
/// interface is reached on loopback).
fn own_address(listening: std::net::SocketAddr) -> std::net::SocketAddr {
    let ip = match listening.ip() {
        std::net::IpAddr::V4(v4) if v4.is_unspecified() => std::net::Ipv4Addr::LOCALHOST.into(),
        std::net::IpAddr::V6(v6) if v6.is_unspecified() => std::net::Ipv6Addr::LOCALHOST.into(),
        ip => ip,
    };
    std::net::SocketAddr::new(ip, listening.port())
}

/// This node's own entry of `--cluster-nodes`, as the other nodes are to reach it.
fn cluster_address(c: &config::ClusterSettings) -> String {
    c.nodes
        .get(&c.node)
        .map(|a| a.to_string())
        .unwrap_or_default()
}

/// Where this node listens for its peers: its own entry of `--cluster-nodes`, looked up now;
/// a name that does not resolve yet (a Kubernetes pod's, before it is published) means every
/// interface, on that port.
fn cluster_listen(node: u64, own: &cluster::PeerAddr) -> std::net::SocketAddr {
    let every = std::net::SocketAddr::from(([0, 0, 0, 0], own.port()));
    match own.resolve_now() {
        // A name can still resolve to an address this host no longer has (a recreated
        // Kubernetes pod, while DNS keeps its old record for a few seconds): listening there
        // would fail and the node would not start.
        Ok(addr) => match std::net::TcpListener::bind(addr) {
            Err(error) if error.kind() == std::io::ErrorKind::AddrNotAvailable => {
                tracing::warn!(node, address = %own, resolved = %addr, "this node's cluster name resolves to an address this host does not have: listening on every interface");
                every
            }
            _ => addr,
        },
        Err(error) => {
            tracing::warn!(node, address = %own, %error, "this node's cluster name does not resolve yet: listening on every interface");
            every
        }
    }
}

/// The node's name in the API: `warren@<hostname>`, or its cluster name.
fn node_name(config: &Config) -> String {
    config
        .cluster
        .as_ref()
        .and_then(|c| {
            c.nodes
                .get(&c.node)
                .map(|addr| http::cluster_node_name(c.node, addr))
        })
        .unwrap_or_else(|| format!("warren@{}", http::hostname()))
}

/// The HTTP endpoints' listeners (the SQS endpoint's port, which its figures announce).
struct HttpListeners {
    management: Option<TcpListener>,
    prometheus: Option<TcpListener>,
    sqs_port: Option<u16>,
}

/// Starts the management API, the metrics endpoint and the rate sampler behind them, and
/// the sharing of this node's figures with its peers (which SQS needs too: another node
/// sends an SQS call on a quorum queue this node leads to the endpoint they announce).
fn start_http(
    node: driver::NodeHandle,
    shovels: shovel::Shovels,
    config: &Config,
    tls: Option<&tls::Tls>,
    (listeners, restart): (HttpListeners, std::sync::Arc<joining::Restart>),
) {
    let HttpListeners {
        management,
        prometheus,
        sqs_port,
    } = listeners;
    if management.is_none() && prometheus.is_none() && sqs_port.is_none() {
        return;
    }
    let port_of = |l: &Option<TcpListener>| {
        l.as_ref()
            .and_then(|l| l.local_addr().ok())
            .map(|a| a.port())
    };
    let rates = std::sync::Arc::new(http::rates::Rates::default());
    let cluster_names: std::collections::BTreeMap<u64, String> = config
        .cluster
        .iter()
        .flat_map(|c| c.nodes.iter())
        .map(|(n, addr)| (*n, http::cluster_node_name(*n, addr)))
        .collect();
    let node_name = node_name(config);
    let api = std::sync::Arc::new(http::Api {
        started_ms: node.read(|_, now| now),
        node,
        node_name,
        cluster_names,
        amqp_port: config.port,
        http_port: port_of(&management).unwrap_or(0),
        prometheus_port: port_of(&prometheus),
        sqs_port,
        amqps_port: tls.map(|_| config.tls_port),
        http_tls: (config.management_tls, config.prometheus_tls),
        tls_files: config.tls.as_ref().map(|t| (t.cert.clone(), t.ca.clone())),
        rates: rates.clone(),
        data_dir: config.data_dir.clone(),
        alarms: config.alarms,
        shovels,
        restart: Some(restart),
    });
    if management.is_some() || prometheus.is_some() {
        tokio::spawn(http::rates::run(rates, api.node.clone()));
    }
    tokio::spawn(http::share_figures(api.clone()));
    // Config::resolve refuses --management-tls / --prometheus-tls without a certificate.
    let https = |on: bool| tls.filter(|_| on).cloned();
    if let Some(l) = management {
        match https(config.management_tls) {
            Some(t) => match tls::HttpsListener::new(l, t, "management API") {
                Ok(l) => {
                    tokio::spawn(http::serve(l, api.clone()));
                }
                Err(e) => tracing::error!(error = %e, "the management API cannot start"),
            },
            None => {
                tokio::spawn(http::serve(l, api.clone()));
            }
        }
    }
    if let Some(l) = prometheus {
        match https(config.prometheus_tls) {
            Some(t) => match tls::HttpsListener::new(l, t, "metrics") {
                Ok(l) => {
                    tokio::spawn(metrics::serve(l, api));
                }
                Err(e) => tracing::error!(error = %e, "the metrics endpoint cannot start"),
            },
            None => {
                tokio::spawn(metrics::serve(l, api));
            }
        }
    }
}

/// SIGHUP reads the TLS certificate, key and CA files again: new connections get them, open
/// ones keep what they negotiated; a file that does not load leaves the old settings in force.
async fn reload_on_sighup(tls: tls::Tls) {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut hup = match signal(SignalKind::hangup()) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "cannot watch SIGHUP: TLS files are not reloadable");
                return;
            }
        };
        while hup.recv().await.is_some() {
            match tls.reload() {
                Ok(()) => tracing::info!(
                    cert = %tls.files().cert.display(),
                    "SIGHUP: TLS certificate and key reloaded; new connections use them"
                ),
                Err(e) => tracing::error!(
                    error = %e,
                    "SIGHUP: TLS reload failed; the previous certificate stays in use"
                ),
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tls;
    }
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A node listens on its own cluster address when this host has it, and on every
    /// interface when the address is not this host's (a stale DNS record after a pod moved).
    #[test]
    fn the_cluster_listener_falls_back_to_every_interface_for_an_address_not_here() {
        let local = cluster::PeerAddr::parse("127.0.0.1:25999").expect("an address");
        assert_eq!(
            cluster_listen(1, &local),
            "127.0.0.1:25999"
                .parse::<std::net::SocketAddr>()
                .expect("addr")
        );
        // TEST-NET-1: documentation addresses no host has.
        let elsewhere = cluster::PeerAddr::parse("192.0.2.1:25999").expect("an address");
        assert_eq!(
            cluster_listen(1, &elsewhere),
            "0.0.0.0:25999"
                .parse::<std::net::SocketAddr>()
                .expect("addr")
        );
    }
}
