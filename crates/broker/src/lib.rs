//! warren-broker
