//! `warren ctl ...`: users, vhosts and permissions under `rabbitmqctl`'s command names and
//! arguments, so that an operator's `rabbitmqctl add_user app s3cret` becomes
//! `warren ctl add_user app s3cret`. They go through the management API (administrator
//! users), so they work against RabbitMQ's management plugin too.

use std::io::{BufRead, IsTerminal};
use std::process::ExitCode;

use serde_json::{json, Value};

use super::api::{enc, Api};
use super::table::{col, render, Column};
use super::{print_json, CliError, Conn, Format};

#[derive(clap::Subcommand, Debug, Clone)]
pub enum Ctl {
    /// Adds a user (fails if it exists). Without PASSWORD, the first line of stdin is the
    /// password, which keeps it out of the shell's history
    #[command(name = "add_user", alias = "add-user")]
    AddUser {
        /// The user
        username: String,
        /// The new user's password [default: stdin's first line]
        #[arg(id = "new_password", value_name = "PASSWORD")]
        password: Option<String>,
        /// Tags, comma-separated (administrator, monitoring, management, policymaker)
        #[arg(long, value_delimiter = ',')]
        tags: Vec<String>,
        #[command(flatten)]
        conn: Conn,
    },
    /// Deletes a user, its permissions, and closes its connections
    #[command(name = "delete_user", alias = "delete-user")]
    DeleteUser {
        /// The user
        username: String,
        #[command(flatten)]
        conn: Conn,
    },
    /// Sets a user's password (without PASSWORD: the first line of stdin); tags are kept
    #[command(name = "change_password", alias = "change-password")]
    ChangePassword {
        /// The user
        username: String,
        /// The new user's password [default: stdin's first line]
        #[arg(id = "new_password", value_name = "PASSWORD")]
        password: Option<String>,
        #[command(flatten)]
        conn: Conn,
    },
    /// Replaces a user's tags (none: no tags); the password is kept
    #[command(name = "set_user_tags", alias = "set-user-tags")]
    SetUserTags {
        /// The user
        username: String,
        /// The new tags (administrator, monitoring, management, policymaker)
        tags: Vec<String>,
        #[command(flatten)]
        conn: Conn,
    },
    /// Lists users and their tags
    #[command(name = "list_users", alias = "list-users")]
    ListUsers {
        #[command(flatten)]
        out: Out,
    },
    /// Makes an access key for the SQS API for a user: prints its id and secret (the secret
    /// is shown this once; Warren keeps it to check signatures)
    #[command(name = "add_access_key", alias = "add-access-key")]
    AddAccessKey {
        /// The user the key signs as
        username: String,
        #[command(flatten)]
        conn: Conn,
    },
    /// Deletes a user's SQS access key: requests signed with it are refused from now on
    #[command(name = "delete_access_key", alias = "delete-access-key")]
    DeleteAccessKey {
        /// The user
        username: String,
        /// The key's id (see list_access_keys)
        key_id: String,
        #[command(flatten)]
        conn: Conn,
    },
    /// Lists SQS access keys (ids, never secrets): a user's, or everyone's
    #[command(name = "list_access_keys", alias = "list-access-keys")]
    ListAccessKeys {
        /// Only this user's keys
        username: Option<String>,
        #[command(flatten)]
        out: Out,
    },
    /// Adds a virtual host (its maker gets every permission in it, as through RabbitMQ's API)
    #[command(name = "add_vhost", alias = "add-vhost")]
    AddVhost {
        /// The virtual host
        vhost: String,
        #[command(flatten)]
        meta: VhostMetaArgs,
        #[command(flatten)]
        conn: Conn,
    },
    /// Changes a virtual host's description, tags or default queue type (what is not given
    /// stays as it is)
    #[command(name = "update_vhost_metadata", alias = "update-vhost-metadata")]
    UpdateVhostMetadata {
        /// The virtual host
        vhost: String,
        #[command(flatten)]
        meta: VhostMetaArgs,
        #[command(flatten)]
        conn: Conn,
    },
    /// Deletes a virtual host with its queues, exchanges and permissions
    #[command(name = "delete_vhost", alias = "delete-vhost")]
    DeleteVhost {
        /// The virtual host
        vhost: String,
        #[command(flatten)]
        conn: Conn,
    },
    /// Names the cluster (every node's overview, metrics and cluster_status show it), as
    /// RabbitMQ's set_cluster_name
    #[command(name = "set_cluster_name", alias = "set-cluster-name")]
    SetClusterName {
        /// The cluster's new name
        name: String,
        #[command(flatten)]
        conn: Conn,
    },
    /// Lists virtual hosts
    #[command(name = "list_vhosts", alias = "list-vhosts")]
    ListVhosts {
        #[command(flatten)]
        out: Out,
    },
    /// Sets a user's configure, write and read regular expressions in a vhost ("" allows
    /// nothing, ".*" everything)
    #[command(name = "set_permissions", alias = "set-permissions")]
    SetPermissions {
        /// The user
        username: String,
        /// Resources it may declare and delete (a regular expression)
        configure: String,
        /// What it may publish to or bind to (write); for topics, routing keys it may publish with
        write: String,
        /// What it may consume, get, purge or bind from (read); for topics, keys it may bind with
        read: String,
        #[command(flatten)]
        at: Vhost,
    },
    /// Removes a user's permissions in a vhost
    #[command(name = "clear_permissions", alias = "clear-permissions")]
    ClearPermissions {
        /// The user
        username: String,
        #[command(flatten)]
        at: Vhost,
    },
    /// Lists the permissions of every user in a vhost
    #[command(name = "list_permissions", alias = "list-permissions")]
    ListPermissions {
        #[command(flatten)]
        at: Vhost,
        #[arg(long, value_enum, default_value_t)]
        format: Format,
    },
    /// Lists a user's permissions in every vhost
    #[command(name = "list_user_permissions", alias = "list-user-permissions")]
    ListUserPermissions {
        /// The user
        username: String,
        #[command(flatten)]
        out: Out,
    },
    /// Sets which routing keys a user may publish with (write) and bind with (read) on a
    /// topic exchange
    #[command(name = "set_topic_permissions", alias = "set-topic-permissions")]
    SetTopicPermissions {
        /// The user
        username: String,
        /// The topic exchange
        exchange: String,
        /// What it may publish to or bind to (write); for topics, routing keys it may publish with
        write: String,
        /// What it may consume, get, purge or bind from (read); for topics, keys it may bind with
        read: String,
        #[command(flatten)]
        at: Vhost,
    },
    /// Removes a user's topic permissions in a vhost: on one exchange, or on all
    #[command(name = "clear_topic_permissions", alias = "clear-topic-permissions")]
    ClearTopicPermissions {
        /// The user
        username: String,
        /// Only this exchange's [default: every exchange's]
        exchange: Option<String>,
        #[command(flatten)]
        at: Vhost,
    },
    /// Lists the topic permissions of every user in a vhost
    #[command(name = "list_topic_permissions", alias = "list-topic-permissions")]
    ListTopicPermissions {
        #[command(flatten)]
        at: Vhost,
        #[arg(long, value_enum, default_value_t)]
        format: Format,
    },
    /// Lists a user's topic permissions in every vhost
    #[command(
        name = "list_user_topic_permissions",
        alias = "list-user-topic-permissions"
    )]
    ListUserTopicPermissions {
        /// The user
        username: String,
        #[command(flatten)]
        out: Out,
    },
    /// Sets a vhost's limits from a JSON object, as rabbitmqctl takes it:
    /// '{"max-connections": 100, "max-queues": 500}' (negative: no limit; 0: none allowed)
    #[command(name = "set_vhost_limits", alias = "set-vhost-limits")]
    SetVhostLimits {
        /// The limits, a JSON object (max-connections, max-queues)
        definition: String,
        #[command(flatten)]
        at: Vhost,
    },
    /// Clears every limit of a vhost
    #[command(name = "clear_vhost_limits", alias = "clear-vhost-limits")]
    ClearVhostLimits {
        #[command(flatten)]
        at: Vhost,
    },
    /// Lists a vhost's limits (--global: every vhost's)
    #[command(name = "list_vhost_limits", alias = "list-vhost-limits")]
    ListVhostLimits {
        /// Every vhost's limits
        #[arg(long)]
        global: bool,
        #[command(flatten)]
        at: Vhost,
        #[arg(long, value_enum, default_value_t)]
        format: Format,
    },
    /// Sets a user's limits from a JSON object: '{"max-connections": 10, "max-channels": 100}'
    #[command(name = "set_user_limits", alias = "set-user-limits")]
    SetUserLimits {
        /// The user
        username: String,
        /// The limits, a JSON object (max-connections, max-channels)
        definition: String,
        #[command(flatten)]
        conn: Conn,
    },
    /// Clears one limit of a user (max-connections, max-channels), or all of them
    #[command(name = "clear_user_limits", alias = "clear-user-limits")]
    ClearUserLimits {
        /// The user
        username: String,
        /// The limit, or `all`
        limit: String,
        #[command(flatten)]
        conn: Conn,
    },
    /// Lists a user's limits, or every user's (rabbitmqctl's `--user NAME` is a plain argument
    /// here: `--user` is the API login)
    #[command(name = "list_user_limits", alias = "list-user-limits")]
    ListUserLimits {
        /// Only this user's
        #[arg(id = "limits_of", value_name = "USERNAME")]
        user: Option<String>,
        #[command(flatten)]
        out: Out,
    },
    #[command(flatten)]
    Policies(super::policies::PolicyCmd),
    #[command(flatten)]
    Parameters(super::parameters::ParameterCmd),
    #[command(flatten)]
    Maintenance(super::maintenance::MaintenanceCmd),
    #[command(flatten)]
    Members(super::members::MembersCmd),
}

const VHOST_LIMIT_NAMES: &[&str] = &["max-connections", "max-queues"];
const USER_LIMIT_NAMES: &[&str] = &["max-connections", "max-channels"];

/// The API and a vhost given as rabbitmqctl gives it (`-p`).
#[derive(clap::Args, Debug, Clone)]
pub struct Vhost {
    #[command(flatten)]
    pub conn: Conn,
    /// Virtual host
    #[arg(short = 'p', long, default_value = "/")]
    pub vhost: String,
}

/// A vhost's metadata, as RabbitMQ's `add_vhost` and `update_vhost_metadata` take it.
#[derive(clap::Args, Debug, Clone)]
pub struct VhostMetaArgs {
    /// A description of the virtual host
    #[arg(long)]
    pub description: Option<String>,
    /// Its tags, separated by commas
    #[arg(long)]
    pub tags: Option<String>,
    /// The type of the queues declared in it without x-queue-type: classic or quorum
    /// (unset: the node's --default-queue-type)
    #[arg(long)]
    pub default_queue_type: Option<String>,
}

impl VhostMetaArgs {
    /// The `PUT /api/vhosts/{name}` body that makes these changes to `now`, the vhost as the
    /// API shows it (a PUT empties the description and tags it does not give).
    fn body(&self, now: &Value) -> Value {
        let mut b = serde_json::Map::new();
        let description = self
            .description
            .clone()
            .or_else(|| now["description"].as_str().map(str::to_owned));
        if let Some(d) = description {
            b.insert("description".into(), d.into());
        }
        match &self.tags {
            Some(t) => {
                b.insert("tags".into(), t.clone().into());
            }
            None => {
                if let Some(t) = now.get("tags").filter(|t| !t.is_null()) {
                    b.insert("tags".into(), t.clone());
                }
            }
        }
        if let Some(q) = &self.default_queue_type {
            b.insert("default_queue_type".into(), q.clone().into());
        }
        Value::Object(b)
    }

    fn is_empty(&self) -> bool {
        self.description.is_none() && self.tags.is_none() && self.default_queue_type.is_none()
    }
}

/// The API and an output format, for the lists.
#[derive(clap::Args, Debug, Clone)]
pub struct Out {
    #[command(flatten)]
    pub conn: Conn,
    /// Output format: an aligned table, or the API's JSON
    #[arg(long, value_enum, default_value_t)]
    pub format: Format,
}

const USERS: &[Column] = &[col("user", "name"), col("tags", "tags")];
const ACCESS_KEYS: &[Column] = &[
    col("access_key_id", "access_key_id"),
    col("user", "user"),
    col("created", "created"),
];
const VHOST_LIMITS: &[Column] = &[col("vhost", "vhost"), col("limits", "value")];
const USER_LIMITS: &[Column] = &[col("user", "user"), col("limits", "value")];
const VHOSTS: &[Column] = &[
    col("name", "name"),
    col("description", "description"),
    col("tags", "tags"),
    col("default_queue_type", "default_queue_type"),
];
const VHOST_PERMISSIONS: &[Column] = &[
    col("user", "user"),
    col("configure", "configure"),
    col("write", "write"),
    col("read", "read"),
];
const USER_PERMISSIONS: &[Column] = &[
    col("vhost", "vhost"),
    col("configure", "configure"),
    col("write", "write"),
    col("read", "read"),
];
const VHOST_TOPICS: &[Column] = &[
    col("user", "user"),
    col("exchange", "exchange"),
    col("write", "write"),
    col("read", "read"),
];
const USER_TOPICS: &[Column] = &[
    col("vhost", "vhost"),
    col("exchange", "exchange"),
    col("write", "write"),
    col("read", "read"),
];

pub fn name(c: &Ctl) -> &'static str {
    match c {
        Ctl::AddUser { .. } => "ctl add_user",
        Ctl::DeleteUser { .. } => "ctl delete_user",
        Ctl::ChangePassword { .. } => "ctl change_password",
        Ctl::SetUserTags { .. } => "ctl set_user_tags",
        Ctl::ListUsers { .. } => "ctl list_users",
        Ctl::AddAccessKey { .. } => "ctl add_access_key",
        Ctl::DeleteAccessKey { .. } => "ctl delete_access_key",
        Ctl::ListAccessKeys { .. } => "ctl list_access_keys",
        Ctl::AddVhost { .. } => "ctl add_vhost",
        Ctl::UpdateVhostMetadata { .. } => "ctl update_vhost_metadata",
        Ctl::DeleteVhost { .. } => "ctl delete_vhost",
        Ctl::ListVhosts { .. } => "ctl list_vhosts",
        Ctl::SetClusterName { .. } => "ctl set_cluster_name",
        Ctl::SetPermissions { .. } => "ctl set_permissions",
        Ctl::ClearPermissions { .. } => "ctl clear_permissions",
        Ctl::ListPermissions { .. } => "ctl list_permissions",
        Ctl::ListUserPermissions { .. } => "ctl list_user_permissions",
        Ctl::SetTopicPermissions { .. } => "ctl set_topic_permissions",
        Ctl::ClearTopicPermissions { .. } => "ctl clear_topic_permissions",
        Ctl::ListTopicPermissions { .. } => "ctl list_topic_permissions",
        Ctl::ListUserTopicPermissions { .. } => "ctl list_user_topic_permissions",
        Ctl::SetVhostLimits { .. } => "ctl set_vhost_limits",
        Ctl::ClearVhostLimits { .. } => "ctl clear_vhost_limits",
        Ctl::ListVhostLimits { .. } => "ctl list_vhost_limits",
        Ctl::SetUserLimits { .. } => "ctl set_user_limits",
        Ctl::ClearUserLimits { .. } => "ctl clear_user_limits",
        Ctl::ListUserLimits { .. } => "ctl list_user_limits",
        Ctl::Policies(p) => super::policies::name(p),
        Ctl::Parameters(p) => super::parameters::name(p),
        Ctl::Maintenance(m) => super::maintenance::name(m),
        Ctl::Members(m) => super::members::name(m),
    }
}

/// A limits definition as rabbitmqctl takes it: a JSON object of names to integers.
fn limits_definition(text: &str, known: &[&str]) -> Result<Vec<(String, i64)>, CliError> {
    let usage = |why: String| {
        CliError::Usage(format!(
            "{why}: give a JSON object such as '{{\"{}\": 10}}' (limits: {})",
            known[0],
            known.join(", ")
        ))
    };
    let Ok(Value::Object(m)) = serde_json::from_str::<Value>(text) else {
        return Err(usage(format!("'{text}' is not a JSON object")));
    };
    m.into_iter()
        .map(|(name, v)| {
            if !known.contains(&name.as_str()) {
                return Err(usage(format!("unknown limit '{name}'")));
            }
            v.as_i64()
                .map(|n| (name.clone(), n))
                .ok_or_else(|| usage(format!("limit '{name}' must be an integer, not {v}")))
        })
        .collect()
}

/// PUTs each limit of a definition under `base` (`/vhost-limits/V` or `/user-limits/U`).
fn put_limits(
    api: &Api,
    base: &str,
    limits: &[(String, i64)],
    missing: &str,
) -> Result<(), CliError> {
    for (name, value) in limits {
        api.call(
            "PUT",
            &format!("{base}/{}", enc(name)),
            Some(&json!({ "value": value })),
            &[],
            missing,
        )?;
    }
    Ok(())
}

/// DELETEs each named limit under `base`.
fn clear_limits(api: &Api, base: &str, names: &[&str], missing: &str) -> Result<(), CliError> {
    for name in names {
        api.call(
            "DELETE",
            &format!("{base}/{}", enc(name)),
            None,
            &[],
            missing,
        )?;
    }
    Ok(())
}

fn no_user(user: &str) -> String {
    format!("user '{user}' does not exist (see `warren ctl list_users`)")
}

fn no_vhost(vhost: &str) -> String {
    format!("vhost '{vhost}' does not exist (see `warren ctl list_vhosts`; pass -p)")
}

fn no_user_or_vhost(user: &str, vhost: &str) -> String {
    format!("user '{user}' or vhost '{vhost}' does not exist (see `warren ctl list_users`, `list_vhosts`)")
}

/// The password given, else the first line of stdin (its line ending removed); typed at a
/// terminal, it is not echoed.
fn password_or_stdin(given: &Option<String>) -> Result<String, CliError> {
    if let Some(p) = given {
        return Ok(p.clone());
    }
    let stdin = std::io::stdin();
    let line = if stdin.is_terminal() {
        rpassword::prompt_password("Password: ")
            .map_err(|e| CliError::Failed(format!("cannot read the password: {e}")))?
    } else {
        let mut line = String::new();
        stdin
            .lock()
            .read_line(&mut line)
            .map_err(|e| CliError::Failed(format!("cannot read the password from stdin: {e}")))?;
        line
    };
    let password = line.trim_end_matches(['\n', '\r']).to_owned();
    if password.is_empty() {
        return Err(CliError::Usage(
            "no password: give it as an argument or on stdin's first line".into(),
        ));
    }
    Ok(password)
}

/// A user as the API shows it (None: there is none).
fn user(api: &Api, name: &str) -> Result<Option<Value>, CliError> {
    match api.get(&format!("/users/{}", enc(name)), &no_user(name)) {
        Ok(v) => Ok(Some(v)),
        Err(CliError::NotFound(_)) => Ok(None),
        Err(e) => Err(e),
    }
}

pub(super) fn list(
    api: &Api,
    path: &str,
    what: &str,
    columns: &[Column],
    format: Format,
) -> Result<(), CliError> {
    let items = match api.get(path, what)? {
        Value::Array(items) => items,
        other => {
            return Err(CliError::Failed(format!(
                "GET {path}: expected a list, got {other}"
            )))
        }
    };
    if format == Format::Json {
        print_json(&Value::Array(items));
    } else {
        print!("{}", render(columns, &items));
    }
    Ok(())
}

pub fn main(c: &Ctl) -> Result<ExitCode, CliError> {
    match c {
        Ctl::AddUser {
            username,
            password,
            tags,
            conn,
        } => {
            let api = conn.api();
            // As rabbitmqctl: adding never resets an existing user's password.
            if user(&api, username)?.is_some() {
                return Err(CliError::Failed(format!(
                    "user '{username}' already exists (change_password or set_user_tags change it)"
                )));
            }
            let password = password_or_stdin(password)?;
            let path = format!("/users/{}", enc(username));
            let body = json!({"password": password, "tags": tags.join(",")});
            api.call("PUT", &path, Some(&body), &[], &no_user(username))?;
            println!("added user '{username}'");
        }
        Ctl::DeleteUser { username, conn } => {
            let path = format!("/users/{}", enc(username));
            conn.api()
                .call("DELETE", &path, None, &[], &no_user(username))?;
            println!("deleted user '{username}'");
        }
        Ctl::ChangePassword {
            username,
            password,
            conn,
        } => {
            let api = conn.api();
            let u = user(&api, username)?.ok_or_else(|| CliError::NotFound(no_user(username)))?;
            let password = password_or_stdin(password)?;
            let body =
                json!({"password": password, "tags": u.get("tags").cloned().unwrap_or(json!(""))});
            let path = format!("/users/{}", enc(username));
            api.call("PUT", &path, Some(&body), &[], &no_user(username))?;
            println!("changed the password of user '{username}'");
        }
        Ctl::SetUserTags {
            username,
            tags,
            conn,
        } => {
            let api = conn.api();
            let u = user(&api, username)?.ok_or_else(|| CliError::NotFound(no_user(username)))?;
            // A PUT replaces the user: its hash goes back as it came, or the password would
            // be lost.
            let body = json!({
                "password_hash": u.get("password_hash").cloned().unwrap_or(json!("")),
                "hashing_algorithm": u.get("hashing_algorithm").cloned()
                    .unwrap_or(json!("rabbit_password_hashing_sha256")),
                "tags": tags.join(","),
            });
            let path = format!("/users/{}", enc(username));
            api.call("PUT", &path, Some(&body), &[], &no_user(username))?;
            println!("set the tags of user '{username}' to [{}]", tags.join(","));
        }
        Ctl::ListUsers { out } => list(&out.conn.api(), "/users", "users", USERS, out.format)?,
        Ctl::AddAccessKey { username, conn } => {
            let path = format!("/users/{}/access-keys", enc(username));
            let r = conn
                .api()
                .call("POST", &path, None, &[], &no_user(username))?;
            let field = |k: &str| {
                r.body
                    .get(k)
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned()
            };
            println!("added an access key for user '{username}' (the secret is not shown again):");
            println!("access key id:     {}", field("access_key_id"));
            println!("secret access key: {}", field("secret_access_key"));
        }
        Ctl::DeleteAccessKey {
            username,
            key_id,
            conn,
        } => {
            let path = format!("/users/{}/access-keys/{}", enc(username), enc(key_id));
            let none = format!(
                "user '{username}' has no access key '{key_id}' (see `warren ctl list_access_keys {username}`)"
            );
            conn.api().call("DELETE", &path, None, &[], &none)?;
            println!("deleted access key '{key_id}' of user '{username}'");
        }
        Ctl::ListAccessKeys { username, out } => {
            let path = match username {
                Some(u) => format!("/users/{}/access-keys", enc(u)),
                None => "/access-keys".to_owned(),
            };
            let what = username
                .as_deref()
                .map_or_else(|| "access keys".to_owned(), no_user);
            list(&out.conn.api(), &path, &what, ACCESS_KEYS, out.format)?
        }
        Ctl::AddVhost { vhost, meta, conn } => {
            let path = format!("/vhosts/{}", enc(vhost));
            let api = conn.api();
            // A vhost that exists keeps its metadata: `update_vhost_metadata` changes it.
            let exists = api.get_opt(&path)?.is_some();
            if exists {
                println!("vhost '{vhost}' already exists, unchanged");
            } else {
                api.call(
                    "PUT",
                    &path,
                    Some(&meta.body(&Value::Null)),
                    &[],
                    &no_vhost(vhost),
                )?;
                println!("added vhost '{vhost}'");
            }
        }
        Ctl::UpdateVhostMetadata { vhost, meta, conn } => {
            if meta.is_empty() {
                return Err(CliError::Usage(
                    "nothing to change: give --description, --tags or --default-queue-type".into(),
                ));
            }
            let path = format!("/vhosts/{}", enc(vhost));
            let api = conn.api();
            // A PUT would make a vhost that is not there.
            let Some(now) = api.get_opt(&path)? else {
                return Err(CliError::NotFound(no_vhost(vhost)));
            };
            api.call("PUT", &path, Some(&meta.body(&now)), &[], &no_vhost(vhost))?;
            println!("updated the metadata of vhost '{vhost}'");
        }
        Ctl::DeleteVhost { vhost, conn } => {
            let path = format!("/vhosts/{}", enc(vhost));
            conn.api()
                .call("DELETE", &path, None, &[], &no_vhost(vhost))?;
            println!("deleted vhost '{vhost}'");
        }
        Ctl::ListVhosts { out } => list(&out.conn.api(), "/vhosts", "vhosts", VHOSTS, out.format)?,
        Ctl::SetClusterName { name, conn } => {
            let body = json!({ "name": name });
            conn.api().call(
                "PUT",
                "/cluster-name",
                Some(&body),
                &[],
                "the cluster's name",
            )?;
            println!("the cluster is named '{name}'");
        }
        Ctl::SetPermissions {
            username,
            configure,
            write,
            read,
            at,
        } => {
            let path = format!("/permissions/{}/{}", enc(&at.vhost), enc(username));
            let body = json!({"configure": configure, "write": write, "read": read});
            at.conn.api().call(
                "PUT",
                &path,
                Some(&body),
                &[],
                &no_user_or_vhost(username, &at.vhost),
            )?;
            println!(
                "set permissions of user '{username}' in vhost '{}': configure '{configure}', write '{write}', read '{read}'",
                at.vhost
            );
        }
        Ctl::ClearPermissions { username, at } => {
            let path = format!("/permissions/{}/{}", enc(&at.vhost), enc(username));
            let none = format!(
                "user '{username}' has no permissions in vhost '{}' (see `warren ctl list_permissions -p {}`)",
                at.vhost, at.vhost
            );
            at.conn.api().call("DELETE", &path, None, &[], &none)?;
            println!(
                "cleared permissions of user '{username}' in vhost '{}'",
                at.vhost
            );
        }
        Ctl::ListPermissions { at, format } => list(
            &at.conn.api(),
            &format!("/vhosts/{}/permissions", enc(&at.vhost)),
            &no_vhost(&at.vhost),
            VHOST_PERMISSIONS,
            *format,
        )?,
        Ctl::ListUserPermissions { username, out } => list(
            &out.conn.api(),
            &format!("/users/{}/permissions", enc(username)),
            &no_user(username),
            USER_PERMISSIONS,
            out.format,
        )?,
        Ctl::SetTopicPermissions {
            username,
            exchange,
            write,
            read,
            at,
        } => {
            let path = format!("/topic-permissions/{}/{}", enc(&at.vhost), enc(username));
            let body = json!({"exchange": exchange, "write": write, "read": read});
            at.conn.api().call(
                "PUT",
                &path,
                Some(&body),
                &[],
                &no_user_or_vhost(username, &at.vhost),
            )?;
            println!(
                "set topic permissions of user '{username}' on exchange '{exchange}' in vhost '{}': write '{write}', read '{read}'",
                at.vhost
            );
        }
        Ctl::ClearTopicPermissions {
            username,
            exchange,
            at,
        } => clear_topic_permissions(&at.conn.api(), username, exchange.as_deref(), &at.vhost)?,
        Ctl::ListTopicPermissions { at, format } => list(
            &at.conn.api(),
            &format!("/vhosts/{}/topic-permissions", enc(&at.vhost)),
            &no_vhost(&at.vhost),
            VHOST_TOPICS,
            *format,
        )?,
        Ctl::ListUserTopicPermissions { username, out } => list(
            &out.conn.api(),
            &format!("/users/{}/topic-permissions", enc(username)),
            &no_user(username),
            USER_TOPICS,
            out.format,
        )?,
        Ctl::SetVhostLimits { definition, at } => {
            let limits = limits_definition(definition, VHOST_LIMIT_NAMES)?;
            let base = format!("/vhost-limits/{}", enc(&at.vhost));
            put_limits(&at.conn.api(), &base, &limits, &no_vhost(&at.vhost))?;
            println!("set limits of vhost '{}': {definition}", at.vhost);
        }
        Ctl::ClearVhostLimits { at } => {
            let base = format!("/vhost-limits/{}", enc(&at.vhost));
            clear_limits(
                &at.conn.api(),
                &base,
                VHOST_LIMIT_NAMES,
                &no_vhost(&at.vhost),
            )?;
            println!("cleared the limits of vhost '{}'", at.vhost);
        }
        Ctl::ListVhostLimits { global, at, format } => {
            let path = if *global {
                "/vhost-limits".to_owned()
            } else {
                format!("/vhost-limits/{}", enc(&at.vhost))
            };
            list(
                &at.conn.api(),
                &path,
                &no_vhost(&at.vhost),
                VHOST_LIMITS,
                *format,
            )?
        }
        Ctl::SetUserLimits {
            username,
            definition,
            conn,
        } => {
            let limits = limits_definition(definition, USER_LIMIT_NAMES)?;
            let base = format!("/user-limits/{}", enc(username));
            put_limits(&conn.api(), &base, &limits, &no_user(username))?;
            println!("set limits of user '{username}': {definition}");
        }
        Ctl::ClearUserLimits {
            username,
            limit,
            conn,
        } => {
            let names: Vec<&str> = if limit == "all" {
                USER_LIMIT_NAMES.to_vec()
            } else if USER_LIMIT_NAMES.contains(&limit.as_str()) {
                vec![limit.as_str()]
            } else {
                return Err(CliError::Usage(format!(
                    "unknown limit '{limit}': give {} or all",
                    USER_LIMIT_NAMES.join(", ")
                )));
            };
            let base = format!("/user-limits/{}", enc(username));
            clear_limits(&conn.api(), &base, &names, &no_user(username))?;
            println!("cleared {limit} of user '{username}'");
        }
        Ctl::ListUserLimits { user, out } => {
            let (path, missing) = match user {
                Some(u) => (format!("/user-limits/{}", enc(u)), no_user(u)),
                None => ("/user-limits".to_owned(), "user limits".to_owned()),
            };
            list(&out.conn.api(), &path, &missing, USER_LIMITS, out.format)?
        }
        Ctl::Policies(p) => super::policies::main(p)?,
        Ctl::Parameters(p) => super::parameters::main(p)?,
        Ctl::Maintenance(m) => super::maintenance::main(m)?,
        Ctl::Members(m) => super::members::main(m)?,
    }
    Ok(ExitCode::SUCCESS)
}

/// The API deletes a user's topic permissions of a vhost all at once (RabbitMQ ignores an
/// exchange there): clearing one exchange's deletes them all and puts the others back.
fn clear_topic_permissions(
    api: &Api,
    user: &str,
    exchange: Option<&str>,
    vhost: &str,
) -> Result<(), CliError> {
    let path = format!("/topic-permissions/{}/{}", enc(vhost), enc(user));
    let none = format!("user '{user}' has no topic permissions in vhost '{vhost}'");
    let keep: Vec<Value> = match exchange {
        None => Vec::new(),
        Some(x) => {
            let all = api.get(
                &format!("/users/{}/topic-permissions", enc(user)),
                &no_user(user),
            )?;
            let mine: Vec<Value> = all
                .as_array()
                .into_iter()
                .flatten()
                .filter(|t| t.get("vhost").and_then(Value::as_str) == Some(vhost))
                .cloned()
                .collect();
            if !mine
                .iter()
                .any(|t| t.get("exchange").and_then(Value::as_str) == Some(x))
            {
                return Err(CliError::NotFound(format!(
                    "user '{user}' has no topic permissions on exchange '{x}' in vhost '{vhost}'"
                )));
            }
            mine.into_iter()
                .filter(|t| t.get("exchange").and_then(Value::as_str) != Some(x))
                .collect()
        }
    };
    api.call("DELETE", &path, None, &[], &none)?;
    for t in &keep {
        let body =
            json!({"exchange": t.get("exchange"), "write": t.get("write"), "read": t.get("read")});
        api.call(
            "PUT",
            &path,
            Some(&body),
            &[],
            &no_user_or_vhost(user, vhost),
        )?;
    }
    match exchange {
        Some(x) => println!(
            "cleared topic permissions of user '{user}' on exchange '{x}' in vhost '{vhost}'"
        ),
        None => println!("cleared topic permissions of user '{user}' in vhost '{vhost}'"),
    }
    Ok(())
}
