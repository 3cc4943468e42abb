//! Changing an existing queue's arguments. AMQP has no way to do it (a redeclare with other
//! arguments is refused), but SQS clients change a queue's attributes in place
//! (SetQueueAttributes, TagQueue): the queue keeps its messages and consumers, and acts on its
//! new arguments from then on, as a policy change makes it (policies still win where they
//! would at a declare).
//!
//! A change travels through the cluster as the keys it changes, not as the whole table: two
//! nodes changing different attributes (or tags) of one queue at once both keep their change,
//! and every node applies the changes in the log's order.

use super::*;

/// One change to a queue's arguments: `key` set to `value` (`None`: removed), or, with an
/// `entry`, that entry of the table kept at `key` (a table left empty is removed).
#[derive(Clone, Debug, PartialEq)]
pub struct ArgumentChange {
    pub key: String,
    pub entry: Option<String>,
    pub value: Option<FieldValue>,
}

/// The changes that make `old` into `new`; tables on both sides are compared entry by entry.
pub fn argument_changes(old: &FieldTable, new: &FieldTable) -> Vec<ArgumentChange> {
    let mut out = Vec::new();
    for (k, v) in new.iter() {
        match (old.get(k.as_str()), v) {
            (Some(o), _) if o == v => {}
            (Some(FieldValue::Table(o)), FieldValue::Table(n)) => {
                for (e, ev) in n.iter() {
                    if o.get(e.as_str()) != Some(ev) {
                        out.push(ArgumentChange {
                            key: k.to_string(),
                            entry: Some(e.to_string()),
                            value: Some(ev.detached()),
                        });
                    }
                }
                for (e, _) in o.iter().filter(|(e, _)| !n.contains_key(e.as_str())) {
                    out.push(ArgumentChange {
                        key: k.to_string(),
                        entry: Some(e.to_string()),
                        value: None,
                    });
                }
            }
            _ => out.push(ArgumentChange {
                key: k.to_string(),
                entry: None,
                value: Some(v.detached()),
            }),
        }
    }
    for (k, _) in old.iter().filter(|(k, _)| !new.contains_key(k.as_str())) {
        out.push(ArgumentChange {
            key: k.to_string(),
            entry: None,
            value: None,
        });
    }
    out
}

/// `args` with `changes` made, in order. A change whose key or entry is not a field-table
/// name (too long) is left out.
pub fn with_changes(args: &FieldTable, changes: &[ArgumentChange]) -> FieldTable {
    let mut out = args.detached();
    for c in changes {
        let Ok(key) = ShortStr::try_from_str(&c.key) else {
            continue;
        };
        match (&c.entry, &c.value) {
            (None, Some(v)) => {
                out.remove(&c.key);
                out.insert(key, v.detached());
            }
            (None, None) => {
                out.remove(&c.key);
            }
            (Some(entry), value) => {
                let Ok(entry_key) = ShortStr::try_from_str(entry) else {
                    continue;
                };
                let mut table = match out.get(&c.key) {
                    Some(FieldValue::Table(t)) => t.detached(),
                    _ => FieldTable::new(),
                };
                table.remove(entry);
                if let Some(v) = value {
                    table.insert(entry_key, v.detached());
                }
                out.remove(&c.key);
                if !table.is_empty() {
                    out.insert(key, FieldValue::Table(table));
                }
            }
        }
    }
    out
}

impl Broker {
    /// Replaces the arguments `vhost`'s queue `name` was declared with by `arguments`, as
    /// `user` (checked as for a declare: configure on the queue, and for a dead-letter
    /// exchange read on the queue and write on the exchange; `None`: not checked). The
    /// queue's type cannot change. Stored before the change is answered (in the batch being
    /// filled) and, for a replicated queue, sent to every node of the cluster as the keys it
    /// changes.
    pub fn set_queue_arguments(
        &mut self,
        vhost: &str,
        name: &str,
        arguments: FieldTable,
        user: Option<&str>,
    ) -> Result<(), AmqpError> {
        let current = &self.queue_by_name(vhost, name)?.arguments;
        let changes = argument_changes(current, &arguments);
        self.change_queue_arguments(vhost, name, &changes, user)
    }

    /// [`Broker::set_queue_arguments`] with the changes given: applied to the arguments the
    /// queue has here now.
    pub(super) fn change_queue_arguments(
        &mut self,
        vhost: &str,
        name: &str,
        changes: &[ArgumentChange],
        user: Option<&str>,
    ) -> Result<(), AmqpError> {
        use crate::access::{Perm, Resource};
        let q = self.queue_by_name(vhost, name)?;
        let (id, rs) = (q.id, q.rs());
        if let Some(u) = user {
            self.access
                .check(u, vhost, Perm::Configure, Resource::Queue(name))?;
        }
        if q.owner.is_some() {
            return Err(locked(q));
        }
        if changes.is_empty() {
            return Ok(());
        }
        let arguments = with_changes(&q.arguments, changes);
        args::check_dlx_type(&arguments, &rs)?;
        let parsed = args::validate(&arguments, &rs)?;
        if parsed.queue_type != q.args.queue_type {
            return Err(AmqpError::precondition_failed(format!(
                "the type of {rs} cannot be changed"
            )));
        }
        // A priority queue and a plain one keep their messages differently, and a single
        // active consumer is chosen when consumers come: both are fixed at the declare.
        for fixed in ["x-max-priority", "x-single-active-consumer"] {
            if arguments.get(fixed) != q.arguments.get(fixed) {
                return Err(AmqpError::precondition_failed(format!(
                    "{fixed} of {rs} cannot be changed"
                )));
            }
        }
        let dlx_changed =
            arguments.get("x-dead-letter-exchange") != q.arguments.get("x-dead-letter-exchange");
        if let (Some(u), Some(FieldValue::LongStr(dlx)), true) =
            (user, arguments.get("x-dead-letter-exchange"), dlx_changed)
        {
            self.access
                .check(u, vhost, Perm::Read, Resource::Queue(name))?;
            let dlx = String::from_utf8_lossy(dlx);
            self.access
                .check(u, vhost, Perm::Write, Resource::Exchange(&dlx))?;
        }
        self.replace_queue_arguments(id, arguments);
        if self.queues.get(&id).is_some_and(|q| q.replica.is_some()) {
            self.announce(super::metadata_ops::MetaOp::SetQueueArguments {
                vhost: vhost.to_owned(),
                name: ShortStr::from_string(name.to_owned()),
                changes: changes.to_vec(),
            });
        }
        Ok(())
    }

    /// Puts `arguments` in place of queue `id`'s (checked by the caller), stores them, and
    /// has the queue act on them.
    fn replace_queue_arguments(&mut self, id: QueueId, arguments: FieldTable) {
        let Some(q) = self.queues.get_mut(&id) else {
            return;
        };
        q.arguments = arguments;
        if let (Some(key), Some(p)) = (q.store_key, self.persist.as_mut()) {
            p.push(
                StoreOp::PutQueue(QueueDef {
                    vhost: q.vhost.clone(),
                    name: q.name.clone(),
                    key,
                    auto_delete: q.auto_delete,
                    arguments: q.arguments.detached(),
                    group: super::replicated::stored_group(q),
                    voters: q.replica.as_ref().and_then(|r| r.voters.clone()),
                }),
                true,
            );
        }
        tracing::info!(queue = %q.name, vhost = %q.vhost, "queue arguments changed");
        self.reapply_queue(id);
        // What a lowered limit dropped goes to its dead-letter exchange now.
        self.dead_letter_pending();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tags(pairs: &[(&'static str, &'static str)]) -> FieldValue {
        let mut t = FieldTable::new();
        for (k, v) in pairs {
            t.insert(*k, FieldValue::long_str(v));
        }
        FieldValue::Table(t)
    }

    #[test]
    fn changes_made_on_top_of_other_changes_keep_both() {
        let mut base = FieldTable::new();
        base.insert("x-message-ttl", FieldValue::I64(60_000));
        base.insert("x-sqs-tags", tags(&[("team", "billing")]));
        // Two requests read the same arguments and change different things.
        let mut one = base.detached();
        one.remove("x-message-ttl");
        one.insert("x-visibility-timeout", FieldValue::I64(5_000));
        let mut two = base.detached();
        two.remove("x-sqs-tags");
        two.insert(
            "x-sqs-tags",
            tags(&[("team", "billing"), ("env", "staging")]),
        );
        let a = argument_changes(&base, &one);
        let b = argument_changes(&base, &two);
        assert_eq!(b.len(), 1, "one tag added: {b:?}");
        // In either order, both changes are kept.
        let ab = with_changes(&with_changes(&base, &a), &b);
        let ba = with_changes(&with_changes(&base, &b), &a);
        for got in [ab, ba] {
            assert_eq!(got.get("x-message-ttl"), None);
            assert_eq!(
                got.get("x-visibility-timeout"),
                Some(&FieldValue::I64(5_000))
            );
            let t = got
                .get("x-sqs-tags")
                .and_then(FieldValue::as_table)
                .expect("tags");
            assert_eq!(t.len(), 2);
        }
        // The last tag removed takes its table with it; no change changes nothing.
        let untag = argument_changes(&base, &{
            let mut t = base.detached();
            t.remove("x-sqs-tags");
            t
        });
        assert_eq!(with_changes(&base, &untag).get("x-sqs-tags"), None);
        assert!(argument_changes(&base, &base).is_empty());
        let untag_entry = [ArgumentChange {
            key: "x-sqs-tags".into(),
            entry: Some("team".into()),
            value: None,
        }];
        assert_eq!(with_changes(&base, &untag_entry).get("x-sqs-tags"), None);
    }
}
