//! What a vhost carries besides its objects (RabbitMQ 3.11's vhost metadata): a description,
//! tags, and the type of the queues declared in it without `x-queue-type`.

use thiserror::Error;

use crate::queue::args::QueueType;

/// A vhost's metadata. The default (no description, no tags, no default queue type) is what
/// a vhost made by an earlier version has.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VhostMeta {
    pub description: String,
    pub tags: Vec<String>,
    /// `None`: the node's `--default-queue-type` applies.
    pub default_queue_type: Option<QueueType>,
}

/// A change to a vhost's metadata: what is `None` stays as it is (a `PUT` that names only
/// the description keeps the tags and the default queue type).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VhostMetaChange {
    pub description: Option<String>,
    pub tags: Option<Vec<String>>,
    /// `Some(None)` takes the vhost's default away (the node's applies again). The broker's
    /// own: RabbitMQ's API has no way to, and Warren's follows it.
    pub default_queue_type: Option<Option<QueueType>>,
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum VhostMetaError {
    #[error("default_queue_type must be classic or quorum, got '{0}' (streams are not supported)")]
    QueueType(String),
    #[error(
        "a node of the cluster runs a version that drops a vhost's metadata (cluster feature \
         level {level}, needs {needs}): upgrade every node first"
    )]
    ClusterTooOld { level: u64, needs: u64 },
}

impl VhostMeta {
    /// This metadata with `change` made to it.
    pub fn changed(&self, change: &VhostMetaChange) -> VhostMeta {
        VhostMeta {
            description: change
                .description
                .clone()
                .unwrap_or_else(|| self.description.clone()),
            tags: change.tags.clone().unwrap_or_else(|| self.tags.clone()),
            default_queue_type: change.default_queue_type.unwrap_or(self.default_queue_type),
        }
    }
}

/// A default queue type as a vhost may name it: `classic` or `quorum`; `None` for RabbitMQ's
/// `undefined` (which its 3.12 exports write for every vhost without one) and an empty name,
/// which name no type. RabbitMQ also takes `stream`, which Warren does not have.
pub fn parse_default_queue_type(name: &str) -> Result<Option<QueueType>, VhostMetaError> {
    match name {
        "" | "undefined" => Ok(None),
        "classic" => Ok(Some(QueueType::Classic)),
        "quorum" => Ok(Some(QueueType::Quorum)),
        other => Err(VhostMetaError::QueueType(other.to_owned())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_change_keeps_what_it_does_not_name() {
        let m = VhostMeta {
            description: "billing".into(),
            tags: vec!["eu".into()],
            default_queue_type: Some(QueueType::Quorum),
        };
        let only_tags = VhostMetaChange {
            tags: Some(vec![]),
            ..Default::default()
        };
        assert_eq!(
            m.changed(&only_tags),
            VhostMeta {
                tags: vec![],
                ..m.clone()
            }
        );
        assert_eq!(m.changed(&VhostMetaChange::default()), m);
        let node_default = VhostMetaChange {
            default_queue_type: Some(None),
            ..Default::default()
        };
        assert_eq!(m.changed(&node_default).default_queue_type, None);
    }

    #[test]
    fn a_vhost_default_is_classic_or_quorum_and_never_a_stream() {
        assert_eq!(
            parse_default_queue_type("quorum"),
            Ok(Some(QueueType::Quorum))
        );
        assert_eq!(
            parse_default_queue_type("classic"),
            Ok(Some(QueueType::Classic))
        );
        assert_eq!(parse_default_queue_type("undefined"), Ok(None));
        assert!(parse_default_queue_type("stream").is_err());
        assert!(parse_default_queue_type("Quorum").is_err());
    }
}
