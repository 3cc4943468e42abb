//! Policies, as RabbitMQ 3.10 has them: per vhost, a name, a pattern matched against queue and
//! exchange names, what they apply to, a priority and a definition of keys that stand for
//! queue and exchange arguments (`message-ttl` for `x-message-ttl`...). User policies set
//! what a queue did not declare; operator policies cap both (`rabbit_policy`,
//! `rabbit_policies`).

use std::collections::BTreeMap;

use warren_codec::{FieldTable, FieldValue};

use crate::queue::args::{QueueType, WARREN_ARGS};

/// User policies (`/api/policies`) or operator policies (`/api/operator-policies`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PolicyKind {
    User,
    Operator,
}

/// `apply-to`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ApplyTo {
    #[default]
    All,
    Queues,
    ClassicQueues,
    QuorumQueues,
    Exchanges,
}

impl ApplyTo {
    pub fn as_str(self) -> &'static str {
        match self {
            ApplyTo::All => "all",
            ApplyTo::Queues => "queues",
            ApplyTo::ClassicQueues => "classic_queues",
            ApplyTo::QuorumQueues => "quorum_queues",
            ApplyTo::Exchanges => "exchanges",
        }
    }

    pub fn parse(s: &str) -> Option<ApplyTo> {
        Some(match s {
            "all" => ApplyTo::All,
            "queues" => ApplyTo::Queues,
            "classic_queues" => ApplyTo::ClassicQueues,
            "quorum_queues" => ApplyTo::QuorumQueues,
            "exchanges" => ApplyTo::Exchanges,
            _ => return None,
        })
    }

    fn queues(self, qtype: QueueType) -> bool {
        match self {
            ApplyTo::All | ApplyTo::Queues => true,
            ApplyTo::ClassicQueues => qtype == QueueType::Classic,
            ApplyTo::QuorumQueues => qtype == QueueType::Quorum,
            ApplyTo::Exchanges => false,
        }
    }

    fn exchanges(self) -> bool {
        matches!(self, ApplyTo::All | ApplyTo::Exchanges)
    }
}

/// A value in a policy's definition (a JSON value as the management API got it).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum PolicyValue {
    Str(String),
    Int(i64),
    Bool(bool),
    /// Anything else (a float, a list, an object, null): valid only for the mirroring keys
    /// Warren accepts and ignores. Kept as its JSON text (to be shown and exported as given)
    /// and as Erlang's `~p` prints it (for error texts).
    Other {
        json: String,
        erl: String,
    },
}

impl PolicyValue {
    /// As Erlang's `~p` prints the term: `<<"dlx">>`, `5`, `true`.
    pub fn erl(&self) -> String {
        match self {
            PolicyValue::Str(s) => crate::erl::binary(s.as_bytes()),
            PolicyValue::Int(i) => i.to_string(),
            PolicyValue::Bool(b) => b.to_string(),
            PolicyValue::Other { erl, .. } => erl.clone(),
        }
    }

    fn field(&self) -> Option<FieldValue> {
        Some(match self {
            PolicyValue::Str(s) => FieldValue::long_str(s.as_str()),
            PolicyValue::Int(i) => FieldValue::I64(*i),
            PolicyValue::Bool(b) => FieldValue::Bool(*b),
            PolicyValue::Other { .. } => return None,
        })
    }

    fn int(&self) -> Option<i64> {
        match self {
            PolicyValue::Int(i) => Some(*i),
            _ => None,
        }
    }
}

/// A definition: key -> value, sorted by key (as RabbitMQ lists it).
pub type Definition = BTreeMap<String, PolicyValue>;

/// A policy as set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PolicyDef {
    pub vhost: String,
    pub name: String,
    pub kind: PolicyKind,
    pub pattern: String,
    pub apply_to: ApplyTo,
    pub priority: i64,
    pub definition: Definition,
}

/// A refused policy: the reason, in RabbitMQ's words.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    /// `rabbit_runtime_parameters`' `"Validation failed~n~n" ++ Reason ++ "~n"`.
    #[error("Validation failed\n\n{0}\n")]
    Invalid(String),
    #[error("vhost {0} not found")]
    NoVhost(String),
}

/// How a key is checked, and what a queue does when both an argument and a policy set it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Check {
    Str,
    /// An integer >= the bound.
    IntAtLeast(i64),
    OneOf(&'static [&'static str]),
    Bool,
    /// Accepted for compatibility, no effect in Warren (mirroring).
    Any,
}

struct Key {
    name: &'static str,
    check: Check,
    /// The end of `~p is not a valid ...`.
    what: &'static str,
    /// The lower of argument and policy wins (`res_min`); otherwise the argument does.
    min: bool,
    /// Operator policies may set it (`operator_policy_validator`).
    operator: bool,
    /// A quorum queue takes a policy with it (`rabbit_quorum_queue:is_policy_applicable/2`).
    quorum: bool,
}

const fn key(name: &'static str, check: Check, what: &'static str) -> Key {
    Key {
        name,
        check,
        what,
        min: false,
        operator: false,
        quorum: true,
    }
}

const fn capped(name: &'static str, what: &'static str) -> Key {
    Key {
        name,
        check: Check::IntAtLeast(0),
        what,
        min: true,
        operator: true,
        quorum: true,
    }
}

const fn classic(k: Key) -> Key {
    Key { quorum: false, ..k }
}

/// Every policy key Warren accepts: RabbitMQ 3.10's (`rabbit_policies:register/0`), the
/// mirroring keys (accepted so that RabbitMQ definitions import; no effect) and Warren's
/// task-queue arguments without their `x-`.
const KEYS: &[Key] = &[
    key("alternate-exchange", Check::Str, "alternate exchange name"),
    key(
        "dead-letter-exchange",
        Check::Str,
        "dead letter exchange name",
    ),
    key(
        "dead-letter-routing-key",
        Check::Str,
        "dead letter routing key",
    ),
    key(
        "dead-letter-strategy",
        Check::OneOf(&["at-most-once", "at-least-once"]),
        "dead letter strategy",
    ),
    Key {
        check: Check::IntAtLeast(0),
        ..capped("message-ttl", "message TTL")
    },
    Key {
        check: Check::IntAtLeast(1),
        ..capped("expires", "queue expiry")
    },
    capped("max-length", "maximum length"),
    capped("max-length-bytes", "maximum length in bytes"),
    capped("max-in-memory-length", "maximum memory length"),
    capped("max-in-memory-bytes", "maximum memory in bytes"),
    capped("delivery-limit", "delivery limit"),
    classic(key(
        "queue-mode",
        Check::OneOf(&["default", "lazy"]),
        "queue-mode value",
    )),
    classic(key(
        "queue-version",
        Check::IntAtLeast(1),
        "queue-version value",
    )),
    key(
        "overflow",
        Check::OneOf(&["drop-head", "reject-publish", "reject-publish-dlx"]),
        "overflow value",
    ),
    classic(key("ha-mode", Check::Any, "")),
    classic(key("ha-params", Check::Any, "")),
    classic(key("ha-sync-mode", Check::Any, "")),
    classic(key("ha-sync-batch-size", Check::Any, "")),
    classic(key("ha-promote-on-shutdown", Check::Any, "")),
    classic(key("ha-promote-on-failure", Check::Any, "")),
    classic(key("queue-master-locator", Check::Any, "")),
    // A new quorum queue's first leader (3.10's values), read when it is declared.
    key(
        "queue-leader-locator",
        Check::OneOf(&["client-local", "balanced"]),
        "queue leader locator value",
    ),
    Key {
        check: Check::IntAtLeast(1),
        operator: false,
        ..capped("consumer-timeout", "consumer timeout")
    },
    key(
        "visibility-timeout",
        Check::IntAtLeast(1),
        "visibility timeout",
    ),
    key("delivery-delay", Check::IntAtLeast(1), "delivery delay"),
    key("group-header", Check::Str, "group header"),
    // RabbitMQ 3.13's: the size membership reconciliation grows a quorum queue to.
    key(
        "target-group-size",
        Check::IntAtLeast(1),
        "target group size",
    ),
    key("message-deduplication", Check::Bool, "deduplication flag"),
    key("cache-size", Check::IntAtLeast(1), "cache size"),
    key("cache-ttl", Check::IntAtLeast(0), "cache TTL"),
    key("deduplication-header", Check::Str, "deduplication header"),
    key(
        "delayed-retry-type",
        Check::OneOf(&["all", "failed", "returned", "disabled"]),
        "delayed retry type",
    ),
    key(
        "delayed-retry-min",
        Check::IntAtLeast(1),
        "delayed retry minimum",
    ),
    key(
        "delayed-retry-max",
        Check::IntAtLeast(1),
        "delayed retry maximum",
    ),
    key(
        "delayed-retry-multiplier",
        Check::IntAtLeast(1),
        "delayed retry multiplier",
    ),
    key(
        "delayed-retry-jitter",
        Check::IntAtLeast(0),
        "delayed retry jitter",
    ),
];

/// Keys of RabbitMQ plugins and queue types Warren does not have. A RabbitMQ definitions file
/// may hold them (its node had the plugin): an import leaves them out and says so, where the
/// API refuses them as a RabbitMQ without the plugin does.
const FOREIGN_KEYS: &[(&str, &str)] = &[
    ("federation-upstream", "federation"),
    ("federation-upstream-set", "federation"),
    ("federation-upstream-pattern", "federation"),
    ("max-age", "streams"),
    ("stream-max-segment-size-bytes", "streams"),
    ("stream-filter-size-bytes", "streams"),
    ("initial-cluster-size", "streams"),
];

/// Whether a policy key is Warren's own (its task-queue arguments without their `x-`, and
/// `consumer-timeout`, a later RabbitMQ's): RabbitMQ 3.10 refuses a policy that holds one, so a
/// migration into it leaves them out.
pub fn warren_only_key(name: &str) -> bool {
    WARREN_ARGS
        .iter()
        .any(|a| a.strip_prefix("x-") == Some(name))
}

/// What Warren lacks for a policy key of a RabbitMQ plugin ("federation", "streams"), if it
/// is one.
pub fn foreign_key(name: &str) -> Option<&'static str> {
    FOREIGN_KEYS
        .iter()
        .find(|(k, _)| *k == name)
        .map(|(_, what)| *what)
}

fn lookup(name: &str) -> Option<&'static Key> {
    KEYS.iter().find(|k| k.name == name)
}

/// `rabbit_policy:validation/3`: every key known (to this kind), every value valid.
pub fn validate_definition(kind: PolicyKind, def: &Definition) -> Result<(), PolicyError> {
    if def.is_empty() {
        return Err(PolicyError::Invalid("no policy provided".to_string()));
    }
    let mut unknown = Vec::new();
    for (name, value) in def {
        let Some(k) = lookup(name).filter(|k| kind == PolicyKind::User || k.operator) else {
            unknown.push(format!(
                "{{{},{}}}",
                crate::erl::binary(name.as_bytes()),
                value.erl()
            ));
            continue;
        };
        let ok = match (k.check, value) {
            (Check::Any, _) => true,
            (Check::Str, PolicyValue::Str(_)) => true,
            (Check::Bool, PolicyValue::Bool(_)) => true,
            (Check::IntAtLeast(min), PolicyValue::Int(i)) => *i >= min,
            (Check::OneOf(known), PolicyValue::Str(s)) => known.contains(&s.as_str()),
            _ => false,
        };
        if !ok {
            return Err(PolicyError::Invalid(format!(
                "{} is not a valid {}",
                value.erl(),
                k.what
            )));
        }
    }
    if !unknown.is_empty() {
        return Err(PolicyError::Invalid(format!(
            "[{}] are not recognised policy settings",
            unknown.join(",")
        )));
    }
    Ok(())
}

/// `rabbit_policy`'s checks of a whole policy: the pattern a regular expression, `apply-to`
/// one RabbitMQ knows (the pattern and apply-to come as given), the definition valid.
pub fn validate_pattern(pattern: &str) -> Result<fancy_regex::Regex, PolicyError> {
    crate::pattern::compile(pattern).map_err(|e| {
        PolicyError::Invalid(format!(
            "pattern should be regular expression but is invalid: {}",
            crate::erl::quoted(&e.to_string())
        ))
    })
}

pub fn parse_apply_to(s: &str) -> Result<ApplyTo, PolicyError> {
    ApplyTo::parse(s).ok_or_else(|| {
        PolicyError::Invalid(format!(
            "apply-to '{s}' unrecognised; should be 'queues', 'classic_queues', \
             'quorum_queues', 'exchanges' or 'all'"
        ))
    })
}

#[derive(Clone, Debug)]
struct Entry {
    def: PolicyDef,
    regex: fancy_regex::Regex,
}

/// Every vhost's policies.
#[derive(Clone, Debug, Default)]
pub struct PolicyTable {
    table: BTreeMap<(String, PolicyKind, String), Entry>,
}

/// What a resource is, for matching.
#[derive(Clone, Copy, Debug)]
pub enum Target {
    Queue(QueueType),
    Exchange,
}

impl PolicyTable {
    /// Validates and keeps a policy (replacing one of the same vhost, kind and name).
    pub fn put(&mut self, def: PolicyDef) -> Result<(), PolicyError> {
        let regex = validate_pattern(&def.pattern)?;
        validate_definition(def.kind, &def.definition)?;
        let key = (def.vhost.clone(), def.kind, def.name.clone());
        self.table.insert(key, Entry { def, regex });
        Ok(())
    }

    pub fn remove(&mut self, vhost: &str, kind: PolicyKind, name: &str) -> Option<PolicyDef> {
        self.table
            .remove(&(vhost.to_owned(), kind, name.to_owned()))
            .map(|e| e.def)
    }

    pub fn get(&self, vhost: &str, kind: PolicyKind, name: &str) -> Option<&PolicyDef> {
        self.table
            .get(&(vhost.to_owned(), kind, name.to_owned()))
            .map(|e| &e.def)
    }

    /// The policies of a kind (in one vhost, or all), sorted by vhost and name.
    pub fn list<'a>(
        &'a self,
        kind: PolicyKind,
        vhost: Option<&'a str>,
    ) -> impl Iterator<Item = &'a PolicyDef> + 'a {
        self.table
            .values()
            .map(|e| &e.def)
            .filter(move |d| d.kind == kind && vhost.is_none_or(|v| d.vhost == v))
    }

    /// Forgets a vhost's policies; the names of those removed.
    pub fn forget_vhost(&mut self, vhost: &str) -> Vec<(PolicyKind, String)> {
        let gone: Vec<_> = self
            .table
            .keys()
            .filter(|(v, _, _)| v == vhost)
            .cloned()
            .collect();
        gone.into_iter()
            .filter_map(|k| self.table.remove(&k).map(|_| (k.1, k.2)))
            .collect()
    }

    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    /// `rabbit_policy:match/2`: among the policies of a kind that apply to the resource and
    /// whose pattern matches its name, the highest priority. RabbitMQ leaves the choice among
    /// equal priorities open; Warren takes the first by name, so every node and restart
    /// picks the same one.
    pub fn matching(
        &self,
        vhost: &str,
        kind: PolicyKind,
        name: &str,
        target: Target,
    ) -> Option<&PolicyDef> {
        let mut best: Option<&PolicyDef> = None;
        let lo = (vhost.to_owned(), kind, String::new());
        for (key, e) in self.table.range(lo..) {
            if key.0 != vhost || key.1 != kind {
                break;
            }
            let applies = match target {
                Target::Queue(t) => {
                    e.def.apply_to.queues(t)
                        && (t != QueueType::Quorum
                            || e.def
                                .definition
                                .keys()
                                .all(|k| lookup(k).is_some_and(|k| k.quorum)))
                }
                Target::Exchange => e.def.apply_to.exchanges(),
            };
            if applies
                && e.regex.is_match(name).unwrap_or(false)
                && best.is_none_or(|b| e.def.priority > b.priority)
            {
                best = Some(&e.def);
            }
        }
        best
    }
}

/// `rabbit_policy:effective_definition/1`: the user policy's keys and the operator policy's,
/// the lower value where both set a capped key.
pub fn effective_definition(user: Option<&PolicyDef>, op: Option<&PolicyDef>) -> Definition {
    let mut out = user.map(|p| p.definition.clone()).unwrap_or_default();
    if let Some(op) = op {
        for (k, v) in &op.definition {
            match (out.get(k).and_then(PolicyValue::int), v.int()) {
                (Some(a), Some(b)) if lookup(k).is_some_and(|k| k.min) => {
                    out.insert(k.clone(), PolicyValue::Int(a.min(b)));
                }
                _ => {
                    out.insert(k.clone(), v.clone());
                }
            }
        }
    }
    out
}

/// The arguments a queue acts on: its declared ones, with the effective policy definition's
/// keys it did not declare, and where both set a capped key (`message-ttl`, `max-length`...)
/// the lower value (`res_min` in `rabbit_amqqueue_process`). A quorum queue takes the
/// policy's `overflow` over its own (`rabbit_quorum_queue`'s `policy_has_precedence`).
pub fn effective_arguments(
    declared: &FieldTable,
    qtype: QueueType,
    def: &Definition,
) -> FieldTable {
    let mut out = declared.clone();
    for (k, v) in def {
        let Some(spec) = lookup(k) else { continue };
        if spec.check == Check::Any || k == "alternate-exchange" {
            continue;
        }
        let arg = format!("x-{k}");
        if !qtype.supports(&arg) && !WARREN_ARGS.contains(&arg.as_str()) {
            continue;
        }
        let Some(value) = v.field() else { continue };
        let merged = match declared.get(&arg) {
            None => value,
            Some(own) if spec.min => match (own.as_i64(), v.int()) {
                (Some(a), Some(b)) => FieldValue::I64(a.min(b)),
                _ => continue,
            },
            Some(_) if k == "overflow" && qtype == QueueType::Quorum => value,
            Some(_) => continue,
        };
        out.insert(warren_codec::ShortStr::from_string(arg), merged);
    }
    // A routing key without a dead-letter exchange is an error in a declaration; from a
    // policy it is only unused (the rest of the policy still applies).
    if out.get("x-dead-letter-exchange").is_none() {
        out.remove("x-dead-letter-routing-key");
    }
    out
}

/// An exchange's alternate exchange: its argument, else its policy's
/// (`rabbit_policy:get_arg/3`).
pub fn alternate_exchange(def: Option<&PolicyDef>) -> Option<String> {
    match def?.definition.get("alternate-exchange")? {
        PolicyValue::Str(s) => Some(s.clone()),
        _ => None,
    }
}

#[cfg(test)]
mod tests;
