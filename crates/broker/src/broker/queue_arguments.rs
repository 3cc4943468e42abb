//! Changing an existing queue's arguments. AMQP has no way to do it (a redeclare with other
//! arguments is refused), but SQS clients change a queue's attributes in place
//! (SetQueueAttributes, TagQueue): the queue keeps its messages and consumers, and acts on its
//! new arguments from then on, as a policy change makes it (policies still win where they
//! would at a declare).

use super::*;

impl Broker {
    /// Replaces the arguments `vhost`'s queue `name` was declared with by `arguments`, as
    /// `user` (checked as for a declare: configure on the queue, and for a dead-letter
    /// exchange read on the queue and write on the exchange; `None`: not checked). The
    /// queue's type cannot change. Stored before the change is answered (in the batch being
    /// filled) and, for a replicated queue, sent to every node of the cluster.
    pub fn set_queue_arguments(
        &mut self,
        vhost: &str,
        name: &str,
        arguments: FieldTable,
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
        args::check_dlx_type(&arguments, &rs)?;
        let parsed = args::validate(&arguments, &rs)?;
        if parsed.queue_type != q.args.queue_type {
            return Err(AmqpError::precondition_failed(format!(
                "the type of {rs} cannot be changed"
            )));
        }
        if let (Some(u), Some(FieldValue::LongStr(dlx))) =
            (user, arguments.get("x-dead-letter-exchange"))
        {
            self.access
                .check(u, vhost, Perm::Read, Resource::Queue(name))?;
            let dlx = String::from_utf8_lossy(dlx);
            self.access
                .check(u, vhost, Perm::Write, Resource::Exchange(&dlx))?;
        }
        let Some(q) = self.queues.get_mut(&id) else {
            return Err(no_queue(name, vhost));
        };
        if q.arguments == arguments {
            return Ok(());
        }
        q.arguments = arguments.detached();
        let replicated = q.replica.is_some();
        if let (Some(key), Some(p)) = (q.store_key, self.persist.as_mut()) {
            p.push(
                StoreOp::PutQueue(QueueDef {
                    vhost: q.vhost.clone(),
                    name: q.name.clone(),
                    key,
                    auto_delete: q.auto_delete,
                    arguments: q.arguments.detached(),
                }),
                true,
            );
        }
        tracing::info!(queue = %name, vhost, "queue arguments changed");
        if replicated {
            self.announce(super::metadata_ops::MetaOp::SetQueueArguments {
                vhost: vhost.to_owned(),
                name: ShortStr::from_string(name.to_owned()),
                arguments: arguments.detached(),
            });
        }
        self.reapply_queue(id);
        // What a lowered limit dropped goes to its dead-letter exchange now.
        self.dead_letter_pending();
        Ok(())
    }
}
