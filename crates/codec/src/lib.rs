//! warren-codec
