//! Warren's protocol layer: the AMQP 0-9-1 connection and channel state machines.
//!
//! Sans-IO, like the rest of the core: [`Node`] takes decoded frames and the current time, and gives back the
//! bytes each connection must write. The tokio driver lives in `warren-server`.

mod auth;
mod channel;
pub mod config;
mod connection;
mod fit;
pub mod latency;
pub mod manage;
mod node;
mod out;
mod tag_map;

pub use auth::INTERNAL_USER;
pub use config::{SessionConfig, User};
pub use node::{Node, Transmit};

#[cfg(test)]
mod tests;
