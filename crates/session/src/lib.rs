//! warren-session
