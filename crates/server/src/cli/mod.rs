//! `warren status`, `list`, `declare`, `delete`, `purge`, `publish`, `get`, `export`, `import`,
//! `close`, and `ctl` (users, vhosts and permissions under `rabbitmqctl`'s names): commands
//! over the management HTTP API, so they work against RabbitMQ's management plugin too; and
//! `move` / `redrive`, which speak AMQP for a confirmed hand-over.
//!
//! Exit codes: 0 done, 1 the operation failed, 2 a usage error (clap's own code).

mod api;
mod cluster_status;
mod ctl;
mod definitions;
mod maintenance;
mod members;
mod messages;
pub mod migrate;
mod objects;
mod parameters;
mod policies;
mod show;
mod table;
pub mod transfer;
mod values;

use std::process::ExitCode;

use clap::{Args, Subcommand};

pub use api::Api;

/// Where the management API is and who asks.
#[derive(Args, Debug, Clone)]
pub struct Conn {
    /// The management HTTP API (Warren's or RabbitMQ's management plugin)
    #[arg(long, env = "WARREN_API", default_value = "http://127.0.0.1:15672")]
    pub api: String,
    /// User name for the API
    #[arg(long, env = "WARREN_USER", default_value = "guest")]
    pub user: String,
    /// Password for the API
    #[arg(
        long,
        env = "WARREN_PASSWORD",
        default_value = "guest",
        hide_env_values = true
    )]
    pub password: String,
}

impl Conn {
    fn api(&self) -> Api {
        Api::new(&self.api, &self.user, &self.password)
    }
}

/// `Conn` plus the virtual host the command works in.
#[derive(Args, Debug, Clone)]
pub struct InVhost {
    #[command(flatten)]
    pub conn: Conn,
    /// Virtual host
    #[arg(long, default_value = "/")]
    pub vhost: String,
}

/// Table or the API's JSON.
#[derive(clap::ValueEnum, Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Format {
    #[default]
    Table,
    Json,
}

/// The commands over the management API, and `move`.
#[derive(Subcommand, Debug, Clone)]
pub enum Command {
    /// The broker at a glance: version, node, totals, listeners
    Status {
        #[command(flatten)]
        conn: Conn,
        /// Output format
        #[arg(long, value_enum, default_value_t)]
        format: Format,
    },
    /// Lists queues, exchanges, bindings, connections, channels, consumers, vhosts or users
    List(show::ListArgs),
    /// Declares a queue, an exchange or a binding
    #[command(subcommand)]
    Declare(objects::Declare),
    /// Deletes a queue, an exchange or a binding
    #[command(subcommand)]
    Delete(objects::Delete),
    /// Removes every ready message of a queue
    Purge {
        /// The queue
        queue: String,
        #[command(flatten)]
        at: InVhost,
    },
    /// Publishes one message through an exchange (exit 1 when no queue got it)
    Publish(messages::PublishArgs),
    /// Shows messages of a queue; by default they are put back (a peek)
    Get(messages::GetArgs),
    /// Writes the definitions (queues, exchanges, bindings, users, ...) to FILE or stdout
    Export {
        /// Where to write them [default: stdout]
        file: Option<std::path::PathBuf>,
        #[command(flatten)]
        conn: Conn,
        /// Only this virtual host's definitions [default: all]
        #[arg(long)]
        vhost: Option<String>,
    },
    /// Loads definitions written by `warren export` or RabbitMQ's export ("-" reads stdin)
    Import {
        /// The definitions file
        file: std::path::PathBuf,
        #[command(flatten)]
        conn: Conn,
        /// Into this virtual host only (the file then holds one vhost's definitions)
        #[arg(long)]
        vhost: Option<String>,
    },
    /// Closes a client connection (names as `warren list connections` shows them)
    Close {
        /// The connection's name, e.g. "127.0.0.1:50812 -> 127.0.0.1:5672"
        connection: String,
        /// Why: the client sees it in the connection.close
        #[arg(long, default_value = "Closed via management plugin")]
        reason: String,
        #[command(flatten)]
        conn: Conn,
    },
    /// Moves messages from one queue to another over AMQP, each acked in the source only once
    /// the target confirmed it (interrupt and rerun at will)
    Move(transfer::MoveArgs),
    /// Users, vhosts and permissions, with rabbitmqctl's command names and arguments
    /// (`warren ctl add_user app`, `warren ctl set_permissions -p / app '.*' '.*' '.*'`)
    #[command(subcommand)]
    Ctl(ctl::Ctl),
}

/// Why a command failed, worded to say what to do next.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error(
        "cannot reach the management API at {api}: {detail} (is the broker running with its \
         management port on? pass --api http://host:15672)"
    )]
    Unreachable { api: String, detail: String },
    #[error(
        "the management API at {api} refused user '{user}' (401): pass the right --user and \
         --password (or WARREN_USER / WARREN_PASSWORD)"
    )]
    Unauthorized { user: String, api: String },
    /// The message says what is missing, and where.
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Failed(String),
    #[error("{0}")]
    Usage(String),
}

impl CliError {
    fn exit_code(&self) -> ExitCode {
        match self {
            CliError::Usage(_) => ExitCode::from(2),
            _ => ExitCode::FAILURE,
        }
    }
}

/// The message for a 404 about a queue, exchange, ... in a vhost.
fn missing(kind: &str, name: &str, vhost: &str) -> String {
    format!(
        "{kind} '{name}' does not exist in vhost '{vhost}' (or the vhost does not exist): check \
         the name, or pass --vhost"
    )
}

/// Runs one command; its output goes to stdout, errors to stderr.
pub fn main(cmd: Command) -> ExitCode {
    let name = command_name(&cmd);
    let result = match cmd {
        Command::Move(m) => return transfer::main_move(m),
        Command::Ctl(c) => ctl::main(&c),
        Command::Status { conn, format } => show::status(&conn.api(), format),
        Command::List(l) => show::list(&l),
        Command::Declare(d) => objects::declare(&d),
        Command::Delete(d) => objects::delete(&d),
        Command::Purge { queue, at } => objects::purge(&at, &queue),
        Command::Publish(p) => messages::publish(&p),
        Command::Get(g) => messages::get(&g),
        Command::Export { file, conn, vhost } => {
            definitions::export(&conn.api(), file.as_deref(), vhost.as_deref())
        }
        Command::Import { file, conn, vhost } => {
            definitions::import(&conn.api(), &file, vhost.as_deref())
        }
        Command::Close {
            connection,
            reason,
            conn,
        } => objects::close(&conn.api(), &connection, &reason),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("warren {name}: {e}");
            e.exit_code()
        }
    }
}

fn command_name(cmd: &Command) -> &'static str {
    match cmd {
        Command::Status { .. } => "status",
        Command::List(_) => "list",
        Command::Declare(_) => "declare",
        Command::Delete(_) => "delete",
        Command::Purge { .. } => "purge",
        Command::Publish(_) => "publish",
        Command::Get(_) => "get",
        Command::Export { .. } => "export",
        Command::Import { .. } => "import",
        Command::Close { .. } => "close",
        Command::Move(_) => "move",
        Command::Ctl(c) => ctl::name(c),
    }
}

/// Prints JSON for people (indented).
pub(super) fn print_json(v: &serde_json::Value) {
    match serde_json::to_string_pretty(v) {
        Ok(s) => println!("{s}"),
        Err(_) => println!("{v}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(subcommand)]
        cmd: Command,
    }

    fn parse(args: &[&str]) -> Result<Command, clap::Error> {
        Cli::try_parse_from(std::iter::once("warren").chain(args.iter().copied())).map(|c| c.cmd)
    }

    /// clap checks a command's definition (unique argument names...) only when it is built:
    /// this builds every subcommand, so a clash fails here rather than at a user's prompt.
    #[test]
    fn every_subcommand_is_well_formed() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
        crate::config::Args::command().debug_assert();
    }

    #[test]
    fn common_flags_have_rabbitmq_defaults() {
        let Ok(Command::Purge { queue, at }) = parse(&["purge", "jobs"]) else {
            panic!("purge did not parse");
        };
        assert_eq!(queue, "jobs");
        assert_eq!(at.vhost, "/");
        assert_eq!(at.conn.user, "guest");
        assert_eq!(at.conn.password, "guest");
        assert_eq!(at.conn.api, "http://127.0.0.1:15672");
    }

    #[test]
    fn declare_takes_typed_arguments() {
        let Ok(Command::Declare(objects::Declare::Queue(q))) = parse(&[
            "declare",
            "queue",
            "jobs",
            "--type",
            "quorum",
            "--argument",
            "x-max-length=10",
            "--vhost",
            "v1",
            "--api",
            "http://h:1",
        ]) else {
            panic!("declare queue did not parse");
        };
        assert_eq!(q.name, "jobs");
        assert_eq!(
            q.arguments,
            [("x-max-length".to_owned(), serde_json::json!(10))]
        );
        assert_eq!(q.at.vhost, "v1");
        assert_eq!(q.at.conn.api, "http://h:1");
    }

    #[test]
    fn usage_errors_are_clap_errors() {
        let e = parse(&["declare", "queue", "q", "--argument", "novalue"]).unwrap_err();
        assert_eq!(e.exit_code(), 2);
        assert!(parse(&["list", "nonsense"]).is_err());
        assert!(parse(&["get", "q", "--ackmode", "nope"]).is_err());
        assert!(parse(&["move", "--from", "a"]).is_err(), "move needs --to");
    }

    #[test]
    fn ctl_takes_rabbitmqctl_arguments() {
        let Ok(Command::Ctl(ctl::Ctl::SetPermissions {
            username,
            configure,
            write,
            read,
            at,
        })) = parse(&[
            "ctl",
            "set_permissions",
            "-p",
            "v1",
            "app",
            "^app\\.",
            ".*",
            "",
            "--user",
            "admin",
        ])
        else {
            panic!("set_permissions did not parse");
        };
        assert_eq!(
            (
                username.as_str(),
                configure.as_str(),
                write.as_str(),
                read.as_str()
            ),
            ("app", "^app\\.", ".*", "")
        );
        assert_eq!((at.vhost.as_str(), at.conn.user.as_str()), ("v1", "admin"));
        let Ok(Command::Ctl(ctl::Ctl::AddUser {
            password,
            tags,
            conn,
            ..
        })) = parse(&[
            "ctl",
            "add-user",
            "app",
            "--tags",
            "management,monitoring",
            "--password",
            "apipw",
        ])
        else {
            panic!("add_user did not parse");
        };
        // The new user's password is positional; --password stays the API login's.
        assert_eq!(password, None);
        assert_eq!(tags, ["management", "monitoring"]);
        assert_eq!(conn.password, "apipw");
        assert!(parse(&["ctl", "set_permissions", "app", ".*"]).is_err());
    }

    #[test]
    fn list_pages_and_filters() {
        let Ok(Command::List(l)) =
            parse(&["list", "queues", "--filter", "^jobs", "--format", "json"])
        else {
            panic!("list did not parse");
        };
        assert_eq!(l.filter.as_deref(), Some("^jobs"));
        assert_eq!(l.format, Format::Json);
    }
}
