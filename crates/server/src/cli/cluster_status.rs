//! `warren ctl cluster_status`: RabbitMQ's `rabbitmqctl cluster_status`, from the management
//! API that `--api` names. The nodes of the cluster, those running, each one's version,
//! maintenance state, alarms and listeners, as RabbitMQ's sections and JSON keys give them, then
//! Warren's own: which node leads the cluster's metadata, and the cluster's feature level.
//! Another node's version and listeners come from the figures it shares (fresh while it runs).

use std::fmt::Write as _;

use serde_json::{json, Map, Value};

use super::api::Api;
use super::print_json;
use super::{CliError, Format};

pub fn cluster_status(api: &Api, format: Format) -> Result<(), CliError> {
    let overview = api.get("/overview", "the overview")?;
    let nodes = api.get("/nodes", "the nodes")?;
    let status = Status::read(&overview, &nodes);
    match format {
        Format::Json => print_json(&status.json()),
        Format::Table => print!("{}", status.text()),
    }
    Ok(())
}

/// One listener of a node.
#[derive(Debug, PartialEq)]
struct Listener {
    node: String,
    interface: String,
    port: u64,
    protocol: String,
}

impl Listener {
    /// What RabbitMQ says the listener is for.
    fn purpose(&self) -> &'static str {
        match self.protocol.as_str() {
            "amqp" => "AMQP 0-9-1",
            "amqp/ssl" => "AMQP 0-9-1 over TLS",
            "http" => "HTTP API",
            "https" => "HTTP API over TLS (HTTPS)",
            "http/prometheus" => "Prometheus exporter API over HTTP",
            "https/prometheus" => "Prometheus exporter API over TLS (HTTPS)",
            "sqs" => "Amazon SQS API",
            _ => "",
        }
    }
}

/// What the API said of the cluster.
#[derive(Debug, Default, PartialEq)]
struct Status {
    node: String,
    cluster_name: String,
    nodes: Vec<String>,
    running: Vec<String>,
    /// Each node's product and version, where known.
    versions: Vec<(String, Option<(String, String)>)>,
    maintenance: Vec<(String, bool)>,
    /// (node, "memory" or "disk").
    alarms: Vec<(String, &'static str)>,
    partitions: Vec<(String, Vec<String>)>,
    listeners: Vec<Listener>,
    metadata_leader: Option<String>,
    feature_level: Option<u64>,
}

fn text_of(v: &Value) -> String {
    v.as_str().unwrap_or_default().to_owned()
}

/// An address as rabbitmqctl prints an interface: an IPv6 one in brackets (`[::]`).
fn interface(address: &str) -> String {
    if address.contains(':') && !address.starts_with('[') {
        format!("[{address}]")
    } else {
        address.to_owned()
    }
}

fn listeners_of(node: &str, list: &Value) -> Vec<Listener> {
    list.as_array()
        .map(|l| {
            l.iter()
                .map(|x| Listener {
                    node: x["node"].as_str().unwrap_or(node).to_owned(),
                    interface: interface(&text_of(&x["ip_address"])),
                    port: x["port"].as_u64().unwrap_or(0),
                    protocol: text_of(&x["protocol"]),
                })
                .collect()
        })
        .unwrap_or_default()
}

impl Status {
    /// From `GET /api/overview` and `GET /api/nodes` (RabbitMQ's answers too: it has no
    /// `cluster` object, so only its answering node's listeners and version are known).
    fn read(overview: &Value, nodes: &Value) -> Status {
        let node = text_of(&overview["node"]);
        let mut s = Status {
            cluster_name: text_of(&overview["cluster_name"]),
            node: node.clone(),
            ..Status::default()
        };
        let empty = Vec::new();
        let list = nodes.as_array().unwrap_or(&empty);
        let name_of = |number: u64| {
            list.iter()
                .find(|n| n["cluster"]["node"].as_u64() == Some(number))
                .map(|n| text_of(&n["name"]))
        };
        for n in list {
            let name = text_of(&n["name"]);
            let cluster = &n["cluster"];
            let running = n["running"] == true;
            s.nodes.push(name.clone());
            if running {
                s.running.push(name.clone());
            }
            let own = name == node;
            let version = if own {
                let product = overview["product_name"].as_str().unwrap_or("RabbitMQ");
                let version = overview["product_version"]
                    .as_str()
                    .or_else(|| overview["rabbitmq_version"].as_str());
                version.map(|v| (product.to_owned(), v.to_owned()))
            } else {
                cluster["version"]
                    .as_str()
                    .filter(|_| running)
                    .map(|v| ("Warren".to_owned(), v.to_owned()))
            };
            s.versions.push((name.clone(), version));
            s.maintenance
                .push((name.clone(), n["being_drained"] == true));
            if running {
                if n["mem_alarm"] == true {
                    s.alarms.push((name.clone(), "memory"));
                }
                if n["disk_free_alarm"] == true {
                    s.alarms.push((name.clone(), "disk"));
                }
            }
            let partitions: Vec<String> = n["partitions"]
                .as_array()
                .map(|p| p.iter().map(text_of).collect())
                .unwrap_or_default();
            if !partitions.is_empty() {
                s.partitions.push((name.clone(), partitions));
            }
            if own {
                s.listeners
                    .extend(listeners_of(&name, &overview["listeners"]));
                s.feature_level = cluster["feature_level"].as_u64();
                s.metadata_leader = cluster["metadata_leader"].as_u64().and_then(name_of);
            } else if running {
                s.listeners
                    .extend(listeners_of(&name, &cluster["listeners"]));
            }
        }
        s
    }

    /// As `rabbitmqctl cluster_status --formatter json` gives it, with Warren's two keys.
    fn json(&self) -> Value {
        let mut versions = Map::new();
        for (n, v) in &self.versions {
            if let Some((product, version)) = v {
                versions.insert(
                    n.clone(),
                    json!({"rabbitmq_name": product, "rabbitmq_version": version}),
                );
            }
        }
        let mut listeners = Map::new();
        for l in &self.listeners {
            let entry = listeners
                .entry(l.node.clone())
                .or_insert_with(|| Value::Array(Vec::new()));
            if let Value::Array(a) = entry {
                a.push(
                    json!({"node": l.node, "interface": l.interface, "port": l.port,
                              "protocol": l.protocol, "purpose": l.purpose()}),
                );
            }
        }
        let maintenance: Map<String, Value> = self
            .maintenance
            .iter()
            .map(|(n, drained)| (n.clone(), json!(maintenance_text(*drained))))
            .collect();
        let partitions: Map<String, Value> = self
            .partitions
            .iter()
            .map(|(n, p)| (n.clone(), json!(p)))
            .collect();
        json!({
            "cluster_name": self.cluster_name,
            "disk_nodes": self.nodes,
            "ram_nodes": [],
            "running_nodes": self.running,
            "versions": versions,
            "maintenance_status": maintenance,
            "alarms": self.alarms.iter().map(|(n, r)| json!({"node": n, "resource": r, "type": "resource_alarm"})).collect::<Vec<_>>(),
            "partitions": partitions,
            "listeners": listeners,
            "metadata_leader": self.metadata_leader,
            "feature_level": self.feature_level,
        })
    }

    /// As `rabbitmqctl cluster_status` prints it.
    fn text(&self) -> String {
        let mut out = String::new();
        let none = |out: &mut String, empty: bool| {
            if empty {
                out.push_str("(none)\n");
            }
        };
        let _ = writeln!(out, "Cluster status of node {} ...", self.node);
        let _ = writeln!(out, "Basics\n\nCluster name: {}\n", self.cluster_name);
        out.push_str("Disk Nodes\n\n");
        for n in &self.nodes {
            let _ = writeln!(out, "{n}");
        }
        out.push_str("\nRunning Nodes\n\n");
        for n in &self.running {
            let _ = writeln!(out, "{n}");
        }
        none(&mut out, self.running.is_empty());
        out.push_str("\nVersions\n\n");
        for (n, v) in &self.versions {
            match v {
                Some((product, version)) => {
                    let _ = writeln!(out, "{n}: {product} {version}");
                }
                None => {
                    let _ = writeln!(out, "{n}: unknown (not running, or no figures from it yet)");
                }
            }
        }
        out.push_str("\nMaintenance status\n\n");
        for (n, drained) in &self.maintenance {
            let _ = writeln!(out, "Node: {n}, status: {}", maintenance_text(*drained));
        }
        out.push_str("\nAlarms\n\n");
        for (n, r) in &self.alarms {
            let what = if *r == "disk" {
                "Free disk space alarm"
            } else {
                "Memory alarm"
            };
            let _ = writeln!(out, "{what} on node {n}");
        }
        none(&mut out, self.alarms.is_empty());
        out.push_str("\nNetwork Partitions\n\n");
        for (n, p) in &self.partitions {
            let _ = writeln!(out, "Node {n} cannot communicate with {}", p.join(", "));
        }
        none(&mut out, self.partitions.is_empty());
        out.push_str("\nListeners\n\n");
        for l in &self.listeners {
            let _ = writeln!(
                out,
                "Node: {}, interface: {}, port: {}, protocol: {}, purpose: {}",
                l.node,
                l.interface,
                l.port,
                l.protocol,
                l.purpose()
            );
        }
        none(&mut out, self.listeners.is_empty());
        if self.metadata_leader.is_some() || self.feature_level.is_some() {
            out.push_str("\nMetadata\n\n");
            if let Some(l) = &self.metadata_leader {
                let _ = writeln!(out, "Leader: {l}");
            }
            if let Some(f) = self.feature_level {
                let _ = writeln!(out, "Cluster feature level: {f}");
            }
        }
        out
    }
}

fn maintenance_text(drained: bool) -> &'static str {
    if drained {
        "under maintenance"
    } else {
        "not under maintenance"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn overview() -> Value {
        json!({
            "node": "warren-1@h1", "cluster_name": "warren-1@h1",
            "product_name": "Warren", "product_version": "0.1.0",
            "listeners": [{"node": "warren-1@h1", "protocol": "amqp", "ip_address": "::", "port": 5672}],
        })
    }

    fn nodes() -> Value {
        json!([
            {"name": "warren-1@h1", "running": true, "being_drained": false, "partitions": [],
             "mem_alarm": false, "disk_free_alarm": true,
             "cluster": {"node": 1, "nodes": [1, 2, 3], "metadata_leader": 2, "feature_level": 11}},
            {"name": "warren-2@h2", "running": true, "being_drained": true, "partitions": [],
             "cluster": {"node": 2, "version": "0.1.0", "figures_age_ms": 300,
                         "listeners": [{"node": "warren-2@h2", "protocol": "http", "ip_address": "::", "port": 15672}]}},
            {"name": "warren-3@h3", "running": false, "being_drained": false, "partitions": [],
             "cluster": {"node": 3}},
        ])
    }

    #[test]
    fn a_clusters_status_reads_as_rabbitmqs() {
        let s = Status::read(&overview(), &nodes());
        let j = s.json();
        assert_eq!(
            j["disk_nodes"],
            json!(["warren-1@h1", "warren-2@h2", "warren-3@h3"])
        );
        assert_eq!(j["running_nodes"], json!(["warren-1@h1", "warren-2@h2"]));
        assert_eq!(j["versions"]["warren-2@h2"]["rabbitmq_version"], "0.1.0");
        assert!(j["versions"].get("warren-3@h3").is_none());
        assert_eq!(j["maintenance_status"]["warren-2@h2"], "under maintenance");
        assert_eq!(
            j["alarms"],
            json!([{"node": "warren-1@h1", "resource": "disk", "type": "resource_alarm"}])
        );
        assert_eq!(j["listeners"]["warren-2@h2"][0]["purpose"], "HTTP API");
        assert_eq!(j["metadata_leader"], "warren-2@h2");
        assert_eq!(j["feature_level"], 11);
        let t = s.text();
        assert!(
            t.starts_with("Cluster status of node warren-1@h1 ...\n"),
            "{t}"
        );
        assert!(
            t.contains("Running Nodes\n\nwarren-1@h1\nwarren-2@h2\n"),
            "{t}"
        );
        assert!(
            t.contains("Free disk space alarm on node warren-1@h1"),
            "{t}"
        );
        assert!(
            t.contains("Node: warren-2@h2, status: under maintenance"),
            "{t}"
        );
        assert!(t.contains("warren-3@h3: unknown"), "{t}");
        assert!(
            t.contains(
                "Node: warren-1@h1, interface: [::], port: 5672, protocol: amqp, purpose: AMQP 0-9-1"
            ),
            "{t}"
        );
        assert!(t.contains("Network Partitions\n\n(none)\n"), "{t}");
        assert!(
            t.contains("Leader: warren-2@h2\nCluster feature level: 11"),
            "{t}"
        );
    }

    #[test]
    fn a_node_on_its_own_has_no_metadata_lines() {
        let nodes = json!([{"name": "warren-1@h1", "running": true, "being_drained": false,
                            "partitions": [], "cluster": null}]);
        let s = Status::read(&overview(), &nodes);
        assert_eq!(s.running, vec!["warren-1@h1".to_owned()]);
        assert!(!s.text().contains("Metadata"));
        assert_eq!(s.json()["metadata_leader"], Value::Null);
    }
}
