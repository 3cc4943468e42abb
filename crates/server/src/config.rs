//! Settings: command-line flags, then `WARREN_*` environment variables, then an optional TOML file, then defaults.

use std::net::IpAddr;
use std::path::PathBuf;

use clap::Parser;
use serde::Deserialize;
use warren_session::{SessionConfig, User};

/// What `warren` can run besides the broker.
#[derive(clap::Subcommand, Debug, Clone)]
pub enum Command {
    /// Moves messages from a queue (a dead-letter queue) back to where they came from, or to
    /// another queue, at a chosen rate, without losing any (see docs/task-queues.md)
    Redrive(crate::cli::transfer::RedriveArgs),
    /// Moves a running broker (RabbitMQ, or another Warren) into this one: its definitions,
    /// then every queue's messages with confirmed hand-over, until the source stays empty
    /// (docs/operations.md, "Migrating from RabbitMQ")
    Migrate(crate::cli::migrate::MigrateArgs),
    /// The commands over the management HTTP API (docs/operations.md, "CLI"), and move.
    #[command(flatten)]
    Cli(crate::cli::Command),
}

#[derive(Parser, Debug, Default)]
#[command(
    name = "warren",
    version,
    about = "Warren: an AMQP 0-9-1 message broker for task queues",
    long_about = "Warren: an AMQP 0-9-1 message broker for task queues.\n\n\
        Without a command, runs the broker (its settings are the options below). With one, \
        talks to a running broker: status, list, declare, delete, purge, publish, get, export, \
        import and close use the management HTTP API (--api, default http://127.0.0.1:15672; \
        RabbitMQ's management plugin too); move and redrive use AMQP (--url). \
        `warren COMMAND --help` for each."
)]
pub struct Args {
    /// Runs a command instead of the broker.
    #[command(subcommand)]
    pub command: Option<Command>,
    /// Address to listen on for AMQP clients [default: 0.0.0.0]
    #[arg(long, env = "WARREN_BIND")]
    pub bind: Option<IpAddr>,
    /// AMQP port [default: 5672]
    #[arg(long, env = "WARREN_PORT")]
    pub port: Option<u16>,
    /// A TOML file with any of these settings (keys as the long flags, with underscores), and `[[users]]`.
    #[arg(long, env = "WARREN_CONFIG")]
    pub config: Option<PathBuf>,
    /// Log filter, e.g. `info`, `warn`, `warren_session=debug` [default: info]
    #[arg(long, env = "WARREN_LOG")]
    pub log_level: Option<String>,
    /// Heartbeat interval proposed to clients, in seconds; 0 disables [default: 60]
    #[arg(long, env = "WARREN_HEARTBEAT")]
    pub heartbeat: Option<u16>,
    /// Largest frame accepted and sent, in bytes [default: 131072]
    #[arg(long, env = "WARREN_FRAME_MAX")]
    pub frame_max: Option<u32>,
    /// Highest channel number per connection [default: 2047]
    #[arg(long, env = "WARREN_CHANNEL_MAX")]
    pub channel_max: Option<u16>,
    /// Largest message body accepted, in bytes [default: 134217728]
    #[arg(long, env = "WARREN_MAX_MESSAGE_SIZE")]
    pub max_message_size: Option<u64>,
    /// Most client connections the node keeps open (RabbitMQ's connection_max); past it a
    /// connection.open is refused with 530 [default: no limit]
    #[arg(long, env = "WARREN_CONNECTION_MAX", value_name = "N")]
    pub connection_max: Option<usize>,
    /// Threads that run client connections, each connection staying on one; 0 runs them on the
    /// shared worker threads instead [default: one per two cores, at least one]
    #[arg(long, env = "WARREN_CONNECTION_THREADS", value_name = "N")]
    pub connection_threads: Option<usize>,
    /// Most consumers on one channel (RabbitMQ's consumer_max_per_channel); past it
    /// basic.consume closes the connection with 530 [default: no limit]
    #[arg(long, env = "WARREN_CONSUMER_MAX_PER_CHANNEL", value_name = "N")]
    pub consumer_max_per_channel: Option<usize>,
    /// Most consumers on one queue (Warren's own; RabbitMQ has none); past it basic.consume
    /// closes the channel with 406 [default: no limit]
    #[arg(long, env = "WARREN_CONSUMER_MAX_PER_QUEUE", value_name = "N")]
    pub consumer_max_per_queue: Option<usize>,
    /// Seconds a client has to complete the AMQP handshake [default: 10]
    #[arg(long, env = "WARREN_HANDSHAKE_TIMEOUT")]
    pub handshake_timeout: Option<u64>,
    /// A consumer past its x-consumer-timeout gets its channel closed with 406, as RabbitMQ
    /// before 4.3 did, instead of basic.cancel (RabbitMQ 4.3's behaviour, the default)
    #[arg(long, env = "WARREN_CONSUMER_TIMEOUT_CLOSES_CHANNEL")]
    pub consumer_timeout_closes_channel: bool,
    /// Where durable queues, exchanges, bindings and persistent messages are kept
    /// [default: $XDG_DATA_HOME/warren, else ~/.local/share/warren]
    #[arg(long, env = "WARREN_DATA_DIR", value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
    /// Publishers are blocked while the broker's memory (RSS) is above this fraction of the
    /// machine's RAM, as RabbitMQ's vm_memory_high_watermark [default: 0.4]
    #[arg(long, env = "WARREN_MEMORY_HIGH_WATERMARK", value_name = "FRACTION")]
    pub memory_high_watermark: Option<f64>,
    /// The same limit in bytes; wins over --memory-high-watermark
    #[arg(long, env = "WARREN_MEMORY_LIMIT", value_name = "BYTES")]
    pub memory_limit: Option<u64>,
    /// Above this fraction of the memory limit, transient messages reaching a deep queue go to
    /// disk too, as RabbitMQ's vm_memory_high_watermark_paging_ratio; 0 = always [default: 0.5]
    #[arg(long, env = "WARREN_MEMORY_PAGING_RATIO", value_name = "FRACTION")]
    pub memory_paging_ratio: Option<f64>,
    /// Publishers are blocked while the data directory's disk has less free space than this,
    /// as RabbitMQ's disk_free_limit; 0 disables [default: 50000000]
    #[arg(long, env = "WARREN_DISK_FREE_LIMIT", value_name = "BYTES")]
    pub disk_free_limit: Option<u64>,
    /// Ready messages a queue with consumers keeps in memory at its head (at most 1 MiB of
    /// bodies); persistent messages past it stay on disk until consumers come near them.
    /// A queue without consumers keeps a 256th of it [default: 1024]
    #[arg(long, env = "WARREN_QUEUE_WINDOW", value_name = "MESSAGES")]
    pub queue_window: Option<u32>,
    /// The type of a queue declared without `x-queue-type` (RabbitMQ's `default_queue_type`):
    /// `classic` or `quorum`. It applies to a new durable queue that is neither exclusive nor
    /// auto-delete, and is kept in its arguments; others stay classic [default: classic]
    #[arg(long, env = "WARREN_DEFAULT_QUEUE_TYPE", value_name = "TYPE")]
    pub default_queue_type: Option<String>,
    /// Tests: wait this long before each queue that recovery brings back (to observe a
    /// broker that serves connections while it recovers)
    #[arg(long, hide = true, value_name = "MS")]
    pub test_recovery_step_ms: Option<u64>,
    /// Tests: every store write batch reaches the disk this much later (a slow disk)
    #[arg(long, hide = true, value_name = "MS")]
    pub test_store_delay_ms: Option<u64>,
    /// Tests: how long a management API change waits for the disk before it is refused
    /// [default: 10000]
    #[arg(long, hide = true, value_name = "MS")]
    pub test_api_write_wait_ms: Option<u64>,
    /// This node's number in a cluster (1 to 65535): with it, queues declared with
    /// `x-queue-type: quorum` are replicated on every node (docs/operations.md, "Cluster").
    /// Or a StatefulSet pod's name, whose ordinal plus one is the number (`warren-0` is node 1)
    /// [default: no cluster]
    #[arg(long, env = "WARREN_CLUSTER_NODE", value_name = "N", value_parser = parse_cluster_node)]
    pub cluster_node: Option<u64>,
    /// Every node of the cluster and its cluster address, this one included, the same on
    /// every node: `1=10.0.0.1:25672,2=10.0.0.2:25672,3=10.0.0.3:25672`
    #[arg(long, env = "WARREN_CLUSTER_NODES", value_name = "LIST")]
    pub cluster_nodes: Option<String>,
    /// A file holding the secret every node of the cluster shares (at least 16 bytes; like
    /// Erlang's cookie); only nodes that know it may join
    #[arg(long, env = "WARREN_CLUSTER_SECRET_FILE", value_name = "FILE")]
    pub cluster_secret_file: Option<PathBuf>,
    /// Turns TLS on for the links between cluster nodes: this node's certificate chain, a PEM
    /// file; it must name this node's host as --cluster-nodes gives it (a DNS name or an IP
    /// address among its subject alternative names). Needs --cluster-tls-key and
    /// --cluster-tls-ca, and every node of the cluster must use TLS
    #[arg(long, env = "WARREN_CLUSTER_TLS_CERT", value_name = "FILE")]
    pub cluster_tls_cert: Option<PathBuf>,
    /// The private key of --cluster-tls-cert, a PEM file
    #[arg(long, env = "WARREN_CLUSTER_TLS_KEY", value_name = "FILE")]
    pub cluster_tls_key: Option<PathBuf>,
    /// The CA that signs every node's cluster certificate, a PEM file: a peer must present a
    /// certificate it signed. The three files are read again when they change
    #[arg(long, env = "WARREN_CLUSTER_TLS_CA", value_name = "FILE")]
    pub cluster_tls_ca: Option<PathBuf>,
    /// Joins a running cluster (RabbitMQ's `join_cluster`): on its first start, with an empty
    /// data directory, this node asks the nodes of --cluster-nodes to add it, and takes every
    /// queue from their snapshots. Its number must not be a node of the cluster's (a new one, or one it forgot); --cluster-nodes
    /// lists this node and at least one running node. Harmless on later starts
    #[arg(long, env = "WARREN_CLUSTER_JOIN")]
    pub cluster_join: bool,
    /// Grows the quorum queues this node leads to their target size, one voter at a time and
    /// to odd sizes, from the running nodes (RabbitMQ's continuous membership reconciliation,
    /// quorum_membership_reconciliation_enabled). A queue's target is the largest of
    /// --quorum-membership-reconciliation-target-group-size, its policy's `target-group-size`
    /// and its `x-quorum-target-group-size` argument
    #[arg(long, env = "WARREN_QUORUM_MEMBERSHIP_RECONCILIATION")]
    pub quorum_membership_reconciliation: bool,
    /// The size every quorum queue grows to with --quorum-membership-reconciliation
    /// [default: none, only a policy's or argument's]
    #[arg(
        long,
        env = "WARREN_QUORUM_MEMBERSHIP_RECONCILIATION_TARGET_GROUP_SIZE",
        value_name = "N"
    )]
    pub quorum_membership_reconciliation_target_group_size: Option<usize>,
    /// Time between two looks at the queues' sizes with nothing to do [default: 3600000]
    #[arg(
        long,
        env = "WARREN_QUORUM_MEMBERSHIP_RECONCILIATION_INTERVAL",
        value_name = "MS"
    )]
    pub quorum_membership_reconciliation_interval: Option<u64>,
    /// Time from a change (a node up or down, a queue led here, a policy set) to the next
    /// look, and between looks while queues grow [default: 10000]
    #[arg(
        long,
        env = "WARREN_QUORUM_MEMBERSHIP_RECONCILIATION_TRIGGER_INTERVAL",
        value_name = "MS"
    )]
    pub quorum_membership_reconciliation_trigger_interval: Option<u64>,
    /// Tests: Raft's tick in milliseconds [default: 50]
    #[arg(long, hide = true, value_name = "MS")]
    pub test_cluster_tick_ms: Option<u64>,
    /// Tests: entries between two snapshots of a replicated queue, and kept behind one for a
    /// lagging follower [default: 4096]
    #[arg(long, hide = true, value_name = "N")]
    pub test_snapshot_entries: Option<u64>,
    /// Tests: a replicated queue's snapshot above this many bytes goes to a follower in
    /// pieces [default: a frame of the cluster's transport, 64 MiB less a margin]
    #[arg(long, hide = true, value_name = "BYTES")]
    pub test_snapshot_inline_bytes: Option<usize>,
    /// Port of the management HTTP API and web page, as RabbitMQ's management plugin
    /// [default: 15672]
    #[arg(long, env = "WARREN_MANAGEMENT_PORT", value_name = "PORT")]
    pub management_port: Option<u16>,
    /// Turns the management HTTP API and web page off
    #[arg(long, env = "WARREN_NO_MANAGEMENT")]
    pub no_management: bool,
    /// Port of the Prometheus endpoint (/metrics), as RabbitMQ's prometheus plugin
    /// [default: 15692]
    #[arg(long, env = "WARREN_PROMETHEUS_PORT", value_name = "PORT")]
    pub prometheus_port: Option<u16>,
    /// Turns the Prometheus endpoint off
    #[arg(long, env = "WARREN_NO_PROMETHEUS")]
    pub no_prometheus: bool,
    /// Port of the SQS API (AWS's JSON protocol), ElasticMQ's [default: 9324]
    #[arg(long, env = "WARREN_SQS_PORT", value_name = "PORT")]
    pub sqs_port: Option<u16>,
    /// Turns the SQS API off
    #[arg(long, env = "WARREN_NO_SQS")]
    pub no_sqs: bool,
    /// Turns amqps on: the server's certificate chain, a PEM file (RabbitMQ's
    /// ssl_options.certfile); read again on SIGHUP
    #[arg(long, env = "WARREN_TLS_CERT", value_name = "FILE")]
    pub tls_cert: Option<PathBuf>,
    /// The certificate's private key, a PEM file (ssl_options.keyfile)
    #[arg(long, env = "WARREN_TLS_KEY", value_name = "FILE")]
    pub tls_key: Option<PathBuf>,
    /// The amqps port, beside the plain one (listeners.ssl.default) [default: 5671]
    #[arg(long, env = "WARREN_TLS_PORT", value_name = "PORT")]
    pub tls_port: Option<u16>,
    /// Trust roots for client certificates, a PEM file (ssl_options.cacertfile)
    #[arg(long, env = "WARREN_TLS_CA", value_name = "FILE")]
    pub tls_ca: Option<PathBuf>,
    /// Client certificates: none asks for none (verify_none), optional checks one if sent
    /// (verify_peer), required refuses clients without one (fail_if_no_peer_cert) [default: none]
    #[arg(long, env = "WARREN_TLS_VERIFY", value_name = "none|optional|required")]
    pub tls_verify: Option<crate::tls::Verify>,
    /// Where the EXTERNAL mechanism finds the user name in a client certificate
    /// (ssl_cert_login_from) [default: common_name]
    #[arg(long, env = "WARREN_TLS_LOGIN_FROM", value_name = "FIELD")]
    pub tls_login_from: Option<crate::tls::LoginFrom>,
    /// Serves the management API over HTTPS with the --tls-cert certificate
    #[arg(long, env = "WARREN_MANAGEMENT_TLS")]
    pub management_tls: bool,
    /// Serves /metrics over HTTPS with the --tls-cert certificate
    #[arg(long, env = "WARREN_PROMETHEUS_TLS")]
    pub prometheus_tls: bool,
    /// Log lines as text or as JSON objects, one per line [default: text]
    #[arg(long, env = "WARREN_LOG_FORMAT", value_name = "text|json")]
    pub log_format: Option<LogFormat>,
    /// Debugging: append every command applied to every queue to FILE (see docs/design.md)
    #[arg(long, env = "WARREN_RECORD_COMMANDS", value_name = "FILE")]
    pub record_commands: Option<PathBuf>,
    /// Debugging: replay a command log written by --record-commands, check that it rebuilds
    /// the same queues, and exit
    #[arg(long, value_name = "FILE")]
    pub replay_commands: Option<PathBuf>,
}

/// How log lines are written.
#[derive(clap::ValueEnum, Deserialize, Debug, Clone, Copy, Default, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub bind: Option<IpAddr>,
    pub port: Option<u16>,
    pub log_level: Option<String>,
    pub heartbeat: Option<u16>,
    pub frame_max: Option<u32>,
    pub channel_max: Option<u16>,
    pub max_message_size: Option<u64>,
    pub handshake_timeout: Option<u64>,
    pub connection_max: Option<usize>,
    pub connection_threads: Option<usize>,
    pub consumer_max_per_channel: Option<usize>,
    pub consumer_max_per_queue: Option<usize>,
    pub consumer_timeout_closes_channel: Option<bool>,
    pub data_dir: Option<PathBuf>,
    pub memory_high_watermark: Option<f64>,
    pub memory_limit: Option<u64>,
    pub memory_paging_ratio: Option<f64>,
    pub disk_free_limit: Option<u64>,
    pub queue_window: Option<u32>,
    pub default_queue_type: Option<String>,
    pub management_port: Option<u16>,
    /// `false` turns the management API off.
    pub management: Option<bool>,
    pub cluster_node: Option<u64>,
    pub cluster_nodes: Option<String>,
    pub cluster_secret_file: Option<PathBuf>,
    pub cluster_tls_cert: Option<PathBuf>,
    pub cluster_tls_key: Option<PathBuf>,
    pub cluster_tls_ca: Option<PathBuf>,
    pub cluster_join: Option<bool>,
    pub quorum_membership_reconciliation_enabled: Option<bool>,
    pub quorum_membership_reconciliation_target_group_size: Option<usize>,
    pub quorum_membership_reconciliation_interval: Option<u64>,
    pub quorum_membership_reconciliation_trigger_interval: Option<u64>,
    pub prometheus_port: Option<u16>,
    /// `false` turns the Prometheus endpoint off.
    pub prometheus: Option<bool>,
    pub sqs_port: Option<u16>,
    /// `false` turns the SQS API off.
    pub sqs: Option<bool>,
    pub log_format: Option<LogFormat>,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    pub tls_port: Option<u16>,
    pub tls_ca: Option<PathBuf>,
    pub tls_verify: Option<crate::tls::Verify>,
    pub tls_login_from: Option<crate::tls::LoginFrom>,
    pub management_tls: Option<bool>,
    pub prometheus_tls: Option<bool>,
    /// Replaces the default guest user when present.
    pub users: Option<Vec<FileUser>>,
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub struct FileUser {
    pub name: String,
    pub password: String,
    #[serde(default)]
    pub loopback_only: bool,
    /// RabbitMQ's user tags (`administrator`, `monitoring`, `management`): what the user may
    /// see and do in the management API.
    #[serde(default)]
    pub tags: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("invalid config file {path}: {source}")]
    Parse {
        path: PathBuf,
        source: toml::de::Error,
    },
    #[error("frame_max must be at least 4096, got {0}")]
    FrameMax(u32),
    #[error("memory_paging_ratio must be a fraction between 0 and 1 (RabbitMQ's default is 0.5), got {0}")]
    PagingRatio(f64),
    #[error("queue_window must be at least 1, got 0")]
    QueueWindow,
    #[error("default_queue_type must be classic or quorum, got '{0}' (streams are not supported)")]
    DefaultQueueType(String),
    #[error(
        "connection_threads must be at most {max} (0 runs connections on the shared runtime; \
         the default is one per two cores), got {0}",
        max = crate::connection_threads::MAX_THREADS
    )]
    ConnectionThreads(usize),
    #[error("memory_high_watermark must be a fraction between 0 and 1 (RabbitMQ's default is 0.4), got {0}")]
    Watermark(f64),
    #[error("{0}")]
    Tls(String),
    #[error(
        "no data directory: neither XDG_DATA_HOME nor HOME is set; give one with --data-dir DIR \
         or WARREN_DATA_DIR"
    )]
    NoDataDir,
    #[error("{0}")]
    Cluster(String),
}

/// This node's place in a cluster, resolved.
#[derive(Debug, Clone)]
pub struct ClusterSettings {
    pub node: u64,
    /// Every node's cluster address, this one's included (names are looked up at each dial).
    pub nodes: std::collections::BTreeMap<u64, crate::cluster::PeerAddr>,
    pub secret: Vec<u8>,
    /// TLS on the links between nodes.
    pub tls: Option<crate::cluster::ClusterTlsFiles>,
    pub tick_ms: u64,
    /// Entries between two snapshots of a replicated queue, and kept behind one.
    pub snapshot_entries: u64,
    /// Time between two snapshots of a replicated queue, at least (ms): none when a test
    /// sets the entries, which then decide alone.
    pub snapshot_interval_ms: u64,
    /// A snapshot larger than this goes to a follower in pieces.
    pub snapshot_inline_max: usize,
    /// Asks a running cluster to add it (`--cluster-join`).
    pub join: bool,
    /// Grows its quorum queues to their target size (`--quorum-membership-reconciliation`).
    pub reconciliation: Option<warren_broker::Reconciliation>,
}

/// The shortest interval between two looks of membership reconciliation (each looks at every
/// queue led here), in milliseconds.
const MIN_RECONCILIATION_MS: u64 = 100;

/// The smallest cluster secret accepted, in bytes.
const MIN_CLUSTER_SECRET: usize = 16;

/// `1=host:port,2=host:port`: every node and its cluster address.
pub(crate) fn parse_cluster_nodes(
    list: &str,
) -> Result<std::collections::BTreeMap<u64, crate::cluster::PeerAddr>, String> {
    let mut nodes = std::collections::BTreeMap::new();
    for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let (id, addr) = item
            .split_once('=')
            .ok_or_else(|| format!("--cluster-nodes: `{item}` is not NODE=HOST:PORT"))?;
        let id: u64 = id
            .trim()
            .parse()
            .ok()
            .filter(|n| (1..=u64::from(u16::MAX)).contains(n))
            .ok_or_else(|| {
                format!("--cluster-nodes: node `{id}` is not a number from 1 to 65535")
            })?;
        // A name is not looked up here: each dial does (a peer's may not resolve yet).
        let addr = crate::cluster::PeerAddr::parse(addr).ok_or_else(|| {
            format!(
                "--cluster-nodes: `{}` (node {id}) is not HOST:PORT (a name or an IP address, \
                 an IPv6 one in brackets, and a port from 1 to 65535)",
                addr.trim()
            )
        })?;
        if nodes.insert(id, addr).is_some() {
            return Err(format!("--cluster-nodes: node {id} is listed twice"));
        }
    }
    Ok(nodes)
}

/// `--cluster-node`: a number, or a name ending in `-K` (a StatefulSet pod's, given through the
/// downward API), which is node K + 1, since ordinals start at 0 and node numbers at 1.
fn parse_cluster_node(text: &str) -> Result<u64, String> {
    let text = text.trim();
    if let Ok(n) = text.parse::<u64>() {
        return Ok(n);
    }
    let ordinal = text
        .rsplit_once('-')
        .filter(|(name, _)| !name.is_empty())
        .and_then(|(_, k)| {
            k.parse::<u64>()
                .ok()
                .filter(|_| k.bytes().all(|b| b.is_ascii_digit()))
        });
    match ordinal {
        Some(k) if k < 65_535 => Ok(k + 1),
        _ => Err(format!(
            "`{text}` is neither a node number (1 to 65535) nor a StatefulSet pod's name ending in its \
             ordinal (warren-0 is node 1)"
        )),
    }
}

/// `--cluster-tls-cert`, `--cluster-tls-key` and `--cluster-tls-ca`: all three, or none.
type ClusterTlsArgs = (Option<PathBuf>, Option<PathBuf>, Option<PathBuf>);

fn cluster_tls(
    (cert, key, ca): ClusterTlsArgs,
) -> Result<Option<crate::cluster::ClusterTlsFiles>, String> {
    match (cert, key, ca) {
        (None, None, None) => Ok(None),
        (Some(cert), Some(key), Some(ca)) => {
            let files = crate::cluster::ClusterTlsFiles { cert, key, ca };
            files.check()?;
            Ok(Some(files))
        }
        (cert, key, ca) => {
            let missing: Vec<&str> = [
                (
                    cert.is_none(),
                    "--cluster-tls-cert (this node's certificate)",
                ),
                (key.is_none(), "--cluster-tls-key (its private key)"),
                (
                    ca.is_none(),
                    "--cluster-tls-ca (the CA that signs every node's certificate)",
                ),
            ]
            .into_iter()
            .filter_map(|(m, what)| m.then_some(what))
            .collect();
            Err(format!(
                "cluster TLS needs three files; also give {}",
                missing.join(" and ")
            ))
        }
    }
}

pub(crate) fn cluster_settings(
    node: Option<u64>,
    nodes: Option<String>,
    secret_file: Option<PathBuf>,
    tls: ClusterTlsArgs,
    (tick_ms, snapshot_entries, inline_max): (Option<u64>, Option<u64>, Option<usize>),
) -> Result<Option<ClusterSettings>, ConfigError> {
    let err = |m: String| Err(ConfigError::Cluster(m));
    let Some(node) = node else {
        let any_tls = tls.0.is_some() || tls.1.is_some() || tls.2.is_some();
        if nodes.is_some() || secret_file.is_some() || any_tls {
            return err("--cluster-nodes, --cluster-secret-file and --cluster-tls-* need --cluster-node N (this node's number)".into());
        }
        return Ok(None);
    };
    let Some(list) = nodes else {
        return err(format!(
            "--cluster-node {node} needs --cluster-nodes, every node's cluster address, e.g. \
             1=127.0.0.1:25701,2=127.0.0.1:25702,3=127.0.0.1:25703"
        ));
    };
    let nodes = parse_cluster_nodes(&list).map_err(ConfigError::Cluster)?;
    let tls = cluster_tls(tls).map_err(ConfigError::Cluster)?;
    if !nodes.contains_key(&node) {
        return err(format!(
            "--cluster-nodes does not list this node ({node}): add {node}=HOST:PORT, the address peers reach it at"
        ));
    }
    let Some(path) = secret_file else {
        return err(
            "a cluster needs a shared secret: write one to a file (e.g. `head -c 32 /dev/urandom | base64 > cluster.secret`), \
             copy it to every node and give it with --cluster-secret-file FILE"
                .into(),
        );
    };
    let secret = std::fs::read(&path).map_err(|e| {
        ConfigError::Cluster(format!(
            "cannot read the cluster secret {}: {e}",
            path.display()
        ))
    })?;
    let secret = secret.trim_ascii().to_vec();
    if secret.starts_with(b"CHANGE-ME") {
        return err(format!(
            "the cluster secret in {} is the example's placeholder: write a random one (e.g. \
             `head -c 32 /dev/urandom | base64`) and give every node the same",
            path.display()
        ));
    }
    if secret.len() < MIN_CLUSTER_SECRET {
        return err(format!(
            "the cluster secret in {} is {} bytes; it needs at least {MIN_CLUSTER_SECRET}",
            path.display(),
            secret.len()
        ));
    }
    Ok(Some(ClusterSettings {
        node,
        nodes,
        secret,
        tls,
        tick_ms: tick_ms.unwrap_or(50).max(1),
        snapshot_entries: snapshot_entries
            .unwrap_or(warren_broker::SNAPSHOT_ENTRIES)
            .max(1),
        snapshot_interval_ms: if snapshot_entries.is_some() {
            0
        } else {
            warren_broker::SNAPSHOT_INTERVAL_MS
        },
        snapshot_inline_max: inline_max
            .unwrap_or(crate::cluster::MAX_PROPOSAL)
            .clamp(1, crate::cluster::MAX_PROPOSAL),
        join: false,
        reconciliation: None,
    }))
}

/// `$XDG_DATA_HOME/warren`, else `$HOME/.local/share/warren` (the XDG default).
fn default_data_dir() -> Option<PathBuf> {
    let non_empty = |v: std::ffi::OsString| (!v.is_empty()).then(|| PathBuf::from(v));
    if let Some(d) = std::env::var_os("XDG_DATA_HOME").and_then(non_empty) {
        return Some(d.join("warren"));
    }
    std::env::var_os("HOME")
        .and_then(non_empty)
        .map(|h| h.join(".local/share/warren"))
}

/// When publishers are blocked (RabbitMQ's resource alarms).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AlarmConfig {
    /// Fraction of the machine's RAM.
    pub memory_high_watermark: f64,
    /// Absolute bytes; wins over the fraction.
    pub memory_limit: Option<u64>,
    /// Free bytes on the data directory's disk; 0 = no disk alarm.
    pub disk_free_limit: u64,
    /// Fraction of the memory limit above which transient messages of deep queues page out.
    pub paging_ratio: f64,
}

/// Everything the server needs, resolved.
#[derive(Debug, Clone)]
pub struct Config {
    pub bind: IpAddr,
    pub port: u16,
    pub log_level: String,
    pub session: SessionConfig,
    pub data_dir: PathBuf,
    pub alarms: AlarmConfig,
    /// Messages kept in memory at the head of a queue with consumers (`--queue-window`).
    pub queue_window: u32,
    /// The type of a queue declared without one (`--default-queue-type`).
    pub default_queue_type: warren_broker::QueueType,
    /// Most consumers on one queue (`--consumer-max-per-queue`).
    pub consumer_max_per_queue: Option<usize>,
    /// Threads of their own for client connections (`--connection-threads`; 0: none).
    pub connection_threads: usize,
    /// Tests only: a pause before each queue recovery brings back.
    pub recovery_step_delay: Option<std::time::Duration>,
    /// How the management API's changes wait for the disk (test options only).
    pub api_writes: crate::driver::ApiWrites,
    pub record_commands: Option<PathBuf>,
    /// The management API's port (`None`: turned off).
    pub management_port: Option<u16>,
    /// The Prometheus endpoint's port (`None`: turned off).
    pub prometheus_port: Option<u16>,
    /// The SQS API's port (`None`: turned off).
    pub sqs_port: Option<u16>,
    pub log_format: LogFormat,
    /// amqps (`None`: no certificate given, TLS off).
    pub tls: Option<crate::tls::TlsFiles>,
    pub tls_port: u16,
    /// The management API and the metrics endpoint over HTTPS.
    pub management_tls: bool,
    pub prometheus_tls: bool,
    /// This node's cluster (`None`: a node on its own).
    pub cluster: Option<ClusterSettings>,
}

impl Config {
    pub fn resolve(args: Args) -> Result<Config, ConfigError> {
        let file = match &args.config {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                    path: path.clone(),
                    source,
                })?;
                toml::from_str(&text).map_err(|source| ConfigError::Parse {
                    path: path.clone(),
                    source,
                })?
            }
            None => FileConfig::default(),
        };
        let mut session = SessionConfig::default();
        if let Some(v) = args.heartbeat.or(file.heartbeat) {
            session.heartbeat_secs = v;
        }
        if let Some(v) = args.frame_max.or(file.frame_max) {
            if v < 4096 {
                return Err(ConfigError::FrameMax(v));
            }
            session.frame_max = v;
        }
        if let Some(v) = args.channel_max.or(file.channel_max) {
            session.channel_max = v;
        }
        if let Some(v) = args.max_message_size.or(file.max_message_size) {
            session.max_message_size = v;
        }
        if let Some(v) = args.handshake_timeout.or(file.handshake_timeout) {
            session.handshake_timeout_ms = v.saturating_mul(1000);
        }
        session.connection_max = args.connection_max.or(file.connection_max);
        session.consumer_max_per_channel = args
            .consumer_max_per_channel
            .or(file.consumer_max_per_channel);
        session.consumer_timeout_closes_channel = args.consumer_timeout_closes_channel
            || file.consumer_timeout_closes_channel.unwrap_or(false);
        if let Some(users) = file.users {
            session.users = users
                .into_iter()
                .map(|u| User {
                    name: u.name,
                    password: u.password,
                    loopback_only: u.loopback_only,
                    tags: u.tags,
                })
                .collect();
            session.explicit_users = true;
        }
        let data_dir = match args.data_dir.or(file.data_dir) {
            Some(d) => d,
            None => default_data_dir().ok_or(ConfigError::NoDataDir)?,
        };
        let memory_high_watermark = args
            .memory_high_watermark
            .or(file.memory_high_watermark)
            .unwrap_or(0.4);
        if !(memory_high_watermark > 0.0 && memory_high_watermark <= 1.0) {
            return Err(ConfigError::Watermark(memory_high_watermark));
        }
        let paging_ratio = args
            .memory_paging_ratio
            .or(file.memory_paging_ratio)
            .unwrap_or(0.5);
        if !(0.0..=1.0).contains(&paging_ratio) {
            return Err(ConfigError::PagingRatio(paging_ratio));
        }
        let alarms = AlarmConfig {
            paging_ratio,
            memory_high_watermark,
            memory_limit: args.memory_limit.or(file.memory_limit),
            disk_free_limit: args
                .disk_free_limit
                .or(file.disk_free_limit)
                .unwrap_or(50_000_000),
        };
        let tls = match (
            args.tls_cert.or(file.tls_cert),
            args.tls_key.or(file.tls_key),
        ) {
            (Some(cert), Some(key)) => Some(crate::tls::TlsFiles {
                cert,
                key,
                ca: args.tls_ca.or(file.tls_ca),
                verify: args.tls_verify.or(file.tls_verify).unwrap_or_default(),
                login_from: args
                    .tls_login_from
                    .or(file.tls_login_from)
                    .unwrap_or_default(),
            }),
            (Some(cert), None) => {
                let e = format!(
                    "--tls-cert {} needs the certificate's private key: give it with --tls-key FILE",
                    cert.display()
                );
                return Err(ConfigError::Tls(e));
            }
            (None, Some(_)) => {
                return Err(ConfigError::Tls(
                    "--tls-key needs the certificate: give it with --tls-cert FILE".into(),
                ))
            }
            (None, None) => None,
        };
        let management_tls = args.management_tls || file.management_tls.unwrap_or(false);
        let prometheus_tls = args.prometheus_tls || file.prometheus_tls.unwrap_or(false);
        if tls.is_none() && (management_tls || prometheus_tls) {
            return Err(ConfigError::Tls(format!(
                "{} uses the --tls-cert certificate: give --tls-cert FILE and --tls-key FILE",
                if management_tls {
                    "--management-tls"
                } else {
                    "--prometheus-tls"
                }
            )));
        }
        let mut node = args.cluster_node.or(file.cluster_node);
        let mut nodes = args.cluster_nodes.or(file.cluster_nodes);
        let mut secret_file = args.cluster_secret_file.or(file.cluster_secret_file);
        let mut cluster_tls = (
            args.cluster_tls_cert.or(file.cluster_tls_cert),
            args.cluster_tls_key.or(file.cluster_tls_key),
            args.cluster_tls_ca.or(file.cluster_tls_ca),
        );
        let mut join = args.cluster_join || file.cluster_join.unwrap_or(false);
        // A node that `warren ctl join_cluster` made a cluster's keeps the settings it saved,
        // unless its flags or file give others.
        if node.is_none() && nodes.is_none() && secret_file.is_none() {
            if let Some(saved) =
                crate::joining::Saved::read(&data_dir).map_err(ConfigError::Cluster)?
            {
                node = Some(saved.node);
                nodes = Some(saved.nodes);
                secret_file = Some(saved.secret_file);
                if saved.tls_cert.is_some() {
                    cluster_tls = (saved.tls_cert, saved.tls_key, saved.tls_ca);
                }
                join = true;
            }
        }
        let cluster = cluster_settings(
            node,
            nodes,
            secret_file,
            cluster_tls,
            (
                args.test_cluster_tick_ms,
                args.test_snapshot_entries,
                args.test_snapshot_inline_bytes,
            ),
        )?;
        let reconciliation = (args.quorum_membership_reconciliation
            || file
                .quorum_membership_reconciliation_enabled
                .unwrap_or(false))
        .then(|| {
            let defaults = warren_broker::Reconciliation::default();
            warren_broker::Reconciliation {
                target_group_size: args
                    .quorum_membership_reconciliation_target_group_size
                    .or(file.quorum_membership_reconciliation_target_group_size)
                    .filter(|n| *n > 0),
                interval_ms: args
                    .quorum_membership_reconciliation_interval
                    .or(file.quorum_membership_reconciliation_interval)
                    .unwrap_or(defaults.interval_ms)
                    .max(MIN_RECONCILIATION_MS),
                trigger_interval_ms: args
                    .quorum_membership_reconciliation_trigger_interval
                    .or(file.quorum_membership_reconciliation_trigger_interval)
                    .unwrap_or(defaults.trigger_interval_ms)
                    .max(MIN_RECONCILIATION_MS),
            }
        });
        let cluster = match cluster {
            Some(c) => Some(ClusterSettings {
                join,
                reconciliation,
                ..c
            }),
            None if reconciliation.is_some() => {
                return Err(ConfigError::Cluster(
                    "--quorum-membership-reconciliation grows quorum queues over a cluster's \
                     nodes: it needs --cluster-node N, --cluster-nodes and \
                     --cluster-secret-file"
                        .into(),
                ))
            }
            None if join => {
                return Err(ConfigError::Cluster(
                    "--cluster-join needs --cluster-node N (this node's new number), \
                     --cluster-nodes (this node and at least one running node) and \
                     --cluster-secret-file"
                        .into(),
                ))
            }
            None => None,
        };
        let queue_window = args.queue_window.or(file.queue_window).unwrap_or(1024);
        if queue_window == 0 {
            return Err(ConfigError::QueueWindow);
        }
        let default_queue_type = match args
            .default_queue_type
            .or(file.default_queue_type)
            .as_deref()
        {
            None | Some("classic") => warren_broker::QueueType::Classic,
            Some("quorum") => warren_broker::QueueType::Quorum,
            Some(other) => return Err(ConfigError::DefaultQueueType(other.to_owned())),
        };
        let connection_threads = args
            .connection_threads
            .or(file.connection_threads)
            .unwrap_or_else(crate::connection_threads::ConnectionThreads::default_count);
        if connection_threads > crate::connection_threads::MAX_THREADS {
            return Err(ConfigError::ConnectionThreads(connection_threads));
        }
        Ok(Config {
            cluster,
            data_dir,
            alarms,
            queue_window,
            default_queue_type,
            consumer_max_per_queue: args.consumer_max_per_queue.or(file.consumer_max_per_queue),
            connection_threads,
            recovery_step_delay: args
                .test_recovery_step_ms
                .map(std::time::Duration::from_millis),
            api_writes: crate::driver::ApiWrites {
                wait: args
                    .test_api_write_wait_ms
                    .map_or(crate::driver::WRITE_WAIT, std::time::Duration::from_millis),
                store_delay: args
                    .test_store_delay_ms
                    .map(std::time::Duration::from_millis),
            },
            bind: args
                .bind
                .or(file.bind)
                .unwrap_or(IpAddr::from([0, 0, 0, 0])),
            port: args.port.or(file.port).unwrap_or(5672),
            log_level: args
                .log_level
                .or(file.log_level)
                .unwrap_or_else(|| "info".into()),
            session,
            record_commands: args.record_commands,
            management_port: (!args.no_management && file.management != Some(false)).then(|| {
                args.management_port
                    .or(file.management_port)
                    .unwrap_or(15672)
            }),
            prometheus_port: (!args.no_prometheus && file.prometheus != Some(false)).then(|| {
                args.prometheus_port
                    .or(file.prometheus_port)
                    .unwrap_or(15692)
            }),
            sqs_port: (!args.no_sqs && file.sqs != Some(false))
                .then(|| args.sqs_port.or(file.sqs_port).unwrap_or(9324)),
            log_format: args.log_format.or(file.log_format).unwrap_or_default(),
            tls,
            tls_port: args.tls_port.or(file.tls_port).unwrap_or(5671),
            management_tls,
            prometheus_tls,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_match_rabbitmq() {
        let c = Config::resolve(Args::default()).unwrap();
        assert_eq!(c.port, 5672);
        assert_eq!(c.session.frame_max, 131_072);
        assert_eq!(c.session.heartbeat_secs, 60);
        assert_eq!(c.session.channel_max, 2047);
        assert_eq!(c.session.users[0].name, "guest");
        assert!(c.session.users[0].loopback_only);
        assert_eq!(c.session.users[0].tags, ["administrator"]);
        assert_eq!(c.management_port, Some(15672));
        assert_eq!(c.prometheus_port, Some(15692));
        assert_eq!(c.log_format, LogFormat::Text);
    }

    #[test]
    fn connection_threads_are_bounded_and_zero_means_the_shared_runtime() {
        let c = Config::resolve(Args::default()).unwrap();
        assert!(c.connection_threads >= 1);
        let shared = Args {
            connection_threads: Some(0),
            ..Args::default()
        };
        assert_eq!(Config::resolve(shared).unwrap().connection_threads, 0);
        let most = crate::connection_threads::MAX_THREADS;
        let too_many = Args {
            connection_threads: Some(most + 1),
            ..Args::default()
        };
        let e = Config::resolve(too_many).unwrap_err();
        assert!(matches!(e, ConfigError::ConnectionThreads(n) if n == most + 1));
        assert!(e.to_string().contains("at most 1024"), "{e}");
    }

    #[test]
    fn http_listeners_can_be_moved_or_turned_off() {
        let args = Args {
            management_port: Some(25672),
            no_prometheus: true,
            ..Args::default()
        };
        let c = Config::resolve(args).unwrap();
        assert_eq!(c.management_port, Some(25672));
        assert_eq!(c.prometheus_port, None);
    }

    #[test]
    fn flags_override_the_file() {
        let dir = std::env::temp_dir().join(format!("warren-config-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("warren.toml");
        std::fs::write(
            &path,
            "port = 5999\nheartbeat = 5\n[[users]]\nname = \"app\"\npassword = \"s3cret\"\n",
        )
        .unwrap();
        let args = Args {
            config: Some(path),
            heartbeat: Some(7),
            ..Args::default()
        };
        let c = Config::resolve(args).unwrap();
        assert_eq!(c.port, 5999);
        assert_eq!(c.session.heartbeat_secs, 7);
        assert_eq!(c.session.users.len(), 1);
        assert_eq!(c.session.users[0].name, "app");
        assert!(!c.session.users[0].loopback_only);
        std::fs::remove_dir_all(dir).ok();
    }

    #[test]
    fn tls_is_off_without_a_certificate_and_needs_both_files() {
        let c = Config::resolve(Args::default()).unwrap();
        assert!(c.tls.is_none());
        assert_eq!(c.tls_port, 5671);
        let half = Args {
            tls_cert: Some("server.pem".into()),
            ..Args::default()
        };
        let e = Config::resolve(half).unwrap_err().to_string();
        assert!(e.contains("--tls-key"), "{e}");
        let https = Args {
            management_tls: true,
            ..Args::default()
        };
        let e = Config::resolve(https).unwrap_err().to_string();
        assert!(e.contains("--tls-cert"), "{e}");
    }

    /// Peers' names are not looked up when the list is read (a StatefulSet's pods resolve
    /// only once they run): a name that does not resolve yet is accepted; what is not
    /// `HOST:PORT` is refused with what to write instead.
    #[test]
    fn cluster_nodes_take_names_that_do_not_resolve_yet() {
        let nodes =
            parse_cluster_nodes("1=127.0.0.1:25701, 2=warren-1.warren.invalid:25701,3=[::1]:25703")
                .expect("parsed");
        let hosts: Vec<&str> = nodes.values().map(|a| a.host()).collect();
        assert_eq!(hosts, ["127.0.0.1", "warren-1.warren.invalid", "::1"]);
        for bad in [
            "1=warren-1",
            "1=warren-1:0",
            "1=:25701",
            "x=a:1",
            "1=a:1,1=b:2",
        ] {
            let e = parse_cluster_nodes(bad).expect_err(bad);
            assert!(e.starts_with("--cluster-nodes:"), "{e}");
        }
        let e = parse_cluster_nodes("2=warren 1:25701").expect_err("a space");
        assert!(e.contains("is not HOST:PORT"), "{e}");
    }

    /// In a StatefulSet each pod is given its own name (`fieldRef: metadata.name`), from which
    /// its node number follows.
    #[test]
    fn a_cluster_node_may_be_a_statefulset_pods_name() {
        assert_eq!(parse_cluster_node("3"), Ok(3));
        assert_eq!(parse_cluster_node("warren-0"), Ok(1));
        assert_eq!(parse_cluster_node("my-broker-2"), Ok(3));
        for bad in [
            "warren",
            "warren-",
            "-3",
            "warren-x",
            "warren-+1",
            "warren-65535",
            "",
        ] {
            let e = parse_cluster_node(bad).expect_err(bad);
            assert!(e.contains("warren-0 is node 1"), "{e}");
        }
        let args = Args {
            cluster_node: Some(parse_cluster_node("warren-1").expect("a pod name")),
            cluster_nodes: Some("1=warren-0.h:25672,2=warren-1.h:25672".into()),
            ..Args::default()
        };
        let e = Config::resolve(args).unwrap_err().to_string();
        assert!(e.contains("shared secret"), "node 2 is in the list: {e}");
    }

    /// The deploy/ examples' placeholder is long enough to pass for a secret: a node refuses it.
    #[test]
    fn the_examples_placeholder_is_not_a_cluster_secret() {
        let dir = std::env::temp_dir().join(format!("warren-secret-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let file = dir.join("secret");
        let with_secret = |text: &str| {
            std::fs::write(&file, text).expect("write");
            Config::resolve(Args {
                cluster_node: Some(1),
                cluster_nodes: Some("1=127.0.0.1:25672".into()),
                cluster_secret_file: Some(file.clone()),
                ..Args::default()
            })
        };
        let placeholder = with_secret("CHANGE-ME-at-least-16-random-bytes\n");
        let real = with_secret("a real secret of more than sixteen bytes");
        let _ = std::fs::remove_dir_all(&dir);
        let e = placeholder.unwrap_err().to_string();
        assert!(e.contains("placeholder"), "{e}");
        assert!(real.is_ok(), "{:?}", real.err());
    }

    /// A node that `warren ctl join_cluster` made a cluster's starts as that node with no
    /// cluster flags, asking to join (harmless once it has); flags of its own win.
    #[test]
    fn the_cluster_settings_join_cluster_saved_are_taken_unless_flags_give_others() {
        let dir = std::env::temp_dir().join(format!("warren-saved-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let secret = dir.join("secret");
        std::fs::write(&secret, "a real secret of more than sixteen bytes").expect("write");
        crate::joining::Saved {
            node: 4,
            nodes: "1=127.0.0.1:25701,4=127.0.0.1:25704".into(),
            secret_file: secret.clone(),
            tls_cert: None,
            tls_key: None,
            tls_ca: None,
            reset: false,
        }
        .write(&dir)
        .expect("saved");
        let saved = Config::resolve(Args {
            data_dir: Some(dir.clone()),
            ..Args::default()
        });
        let flagged = Config::resolve(Args {
            data_dir: Some(dir.clone()),
            cluster_node: Some(1),
            cluster_nodes: Some("1=127.0.0.1:25701".into()),
            cluster_secret_file: Some(secret),
            ..Args::default()
        });
        let _ = std::fs::remove_dir_all(&dir);
        let c = saved.expect("config").cluster.expect("a cluster node");
        assert_eq!((c.node, c.join), (4, true));
        assert_eq!(c.nodes.keys().copied().collect::<Vec<_>>(), [1, 4]);
        let c = flagged.expect("config").cluster.expect("a cluster node");
        assert_eq!((c.node, c.join), (1, false));
    }

    #[test]
    fn cluster_tls_takes_three_readable_files_and_says_which_are_missing() {
        let dir = std::env::temp_dir().join(format!("warren-ctls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let secret = dir.join("secret");
        std::fs::write(&secret, "a real secret of more than sixteen bytes").expect("write");
        let with = |cert: Option<&str>, key: Option<&str>, ca: Option<&str>| {
            Config::resolve(Args {
                cluster_node: Some(1),
                cluster_nodes: Some("1=127.0.0.1:25672".into()),
                cluster_secret_file: Some(secret.clone()),
                cluster_tls_cert: cert.map(|f| dir.join(f)),
                cluster_tls_key: key.map(|f| dir.join(f)),
                cluster_tls_ca: ca.map(|f| dir.join(f)),
                ..Args::default()
            })
        };
        let partial = with(Some("node.pem"), None, None);
        let unreadable = with(Some("node.pem"), Some("node.key"), Some("ca.pem"));
        let none = with(None, None, None);
        let _ = std::fs::remove_dir_all(&dir);
        let e = partial.unwrap_err().to_string();
        assert!(
            e.contains("--cluster-tls-key") && e.contains("--cluster-tls-ca"),
            "{e}"
        );
        let e = unreadable.unwrap_err().to_string();
        assert!(
            e.contains("node.pem") && e.contains("(--cluster-tls-cert)"),
            "{e}"
        );
        assert!(none
            .expect("no TLS")
            .cluster
            .expect("a cluster")
            .tls
            .is_none());
        // Without a cluster, the TLS flags are a mistake, not ignored.
        let alone = Config::resolve(Args {
            cluster_tls_ca: Some("ca.pem".into()),
            ..Args::default()
        });
        assert!(alone.unwrap_err().to_string().contains("--cluster-node"));
    }

    /// Off unless asked for, RabbitMQ's defaults when asked for, and only on a cluster node.
    #[test]
    fn membership_reconciliation_is_off_by_default_and_needs_a_cluster() {
        let dir = std::env::temp_dir().join(format!("warren-cmr-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let secret = dir.join("secret");
        std::fs::write(&secret, "a real secret of more than sixteen bytes").expect("write");
        let node = |on: bool, size: Option<usize>| Args {
            cluster_node: Some(1),
            cluster_nodes: Some("1=127.0.0.1:25672".into()),
            cluster_secret_file: Some(secret.clone()),
            quorum_membership_reconciliation: on,
            quorum_membership_reconciliation_target_group_size: size,
            ..Args::default()
        };
        let reconciliation = |a: Args| {
            Config::resolve(a)
                .expect("config")
                .cluster
                .expect("a cluster")
                .reconciliation
        };
        let off = reconciliation(node(false, Some(3)));
        let on = reconciliation(node(true, Some(3)));
        let alone = Config::resolve(Args {
            quorum_membership_reconciliation: true,
            ..Args::default()
        });
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(off, None);
        assert_eq!(
            on,
            Some(warren_broker::Reconciliation {
                target_group_size: Some(3),
                interval_ms: 3_600_000,
                trigger_interval_ms: 10_000,
            })
        );
        let e = alone.unwrap_err().to_string();
        assert!(e.contains("--cluster-node"), "{e}");
    }

    #[test]
    fn the_default_queue_type_is_classic_unless_set_and_never_a_stream() {
        let c = Config::resolve(Args::default()).unwrap();
        assert_eq!(c.default_queue_type, warren_broker::QueueType::Classic);
        let quorum = Args {
            default_queue_type: Some("quorum".into()),
            ..Args::default()
        };
        assert_eq!(
            Config::resolve(quorum).unwrap().default_queue_type,
            warren_broker::QueueType::Quorum
        );
        let stream = Args {
            default_queue_type: Some("stream".into()),
            ..Args::default()
        };
        let e = Config::resolve(stream).unwrap_err().to_string();
        assert!(e.contains("classic or quorum"), "{e}");
    }

    #[test]
    fn rejects_a_tiny_frame_max() {
        let args = Args {
            frame_max: Some(100),
            ..Args::default()
        };
        assert!(matches!(
            Config::resolve(args),
            Err(ConfigError::FrameMax(100))
        ));
    }
}
