//! Queues: the broker's record of a queue around its state machine.

pub mod args;
pub mod machine;

use warren_codec::{FieldTable, ShortStr};

use crate::{ConnId, ConsumerKey, Message, QueueId};
use args::QueueArgs;
use machine::QueueMachine;

/// What the broker knows about one consumer besides its place in the machine.
#[derive(Clone, Debug, PartialEq)]
pub struct ConsumerInfo {
    pub no_ack: bool,
    pub exclusive: bool,
    /// `x-priority` (0 when absent); consumer priorities come later.
    pub priority: i64,
    pub arguments: FieldTable,
}

/// A queue: its declaration, bindings and state machine.
#[derive(Clone, Debug)]
pub struct Queue {
    pub id: QueueId,
    pub name: ShortStr,
    pub vhost: String,
    pub durable: bool,
    pub auto_delete: bool,
    /// The connection of an exclusive queue.
    pub owner: Option<ConnId>,
    /// The arguments as declared (compared on redeclare).
    pub arguments: FieldTable,
    /// The arguments, validated and parsed.
    pub args: QueueArgs,
    pub machine: QueueMachine<ConsumerKey, Message>,
    pub consumers: Vec<(ConsumerKey, ConsumerInfo)>,
    /// The exclusive consumer, if one holds the queue.
    pub exclusive_consumer: Option<ConsumerKey>,
    /// auto-delete queues are deleted when their last consumer goes, if they ever had one.
    pub has_had_consumers: bool,
    /// Bindings to this queue: (exchange, key, arguments).
    pub bindings: Vec<(ShortStr, ShortStr, FieldTable)>,
    /// In the broker's dirty list (has work for dispatch).
    pub dirty: bool,
}

impl Queue {
    /// `rabbit_misc:rs/1`: `queue 'q' in vhost '/'`.
    pub fn rs(&self) -> String {
        crate::erl::rs("queue", &self.name, &self.vhost)
    }

    pub fn consumer(&self, key: &ConsumerKey) -> Option<&ConsumerInfo> {
        self.consumers
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, c)| c)
    }

    /// `check_exclusive_access(Q, ConnPid, lax)`: a non-exclusive queue or our own.
    pub fn accessible_by(&self, conn: ConnId) -> bool {
        self.owner.is_none_or(|o| o == conn)
    }

    pub fn ready_count(&self) -> u32 {
        u32::try_from(self.machine.ready_count()).unwrap_or(u32::MAX)
    }

    pub fn consumer_count(&self) -> u32 {
        u32::try_from(self.consumers.len()).unwrap_or(u32::MAX)
    }
}
