//! AMQP reply codes and the protocol error type shared by the broker and the session.

use std::fmt;

use crate::strings::{truncate_str, ShortStr};

/// The reply codes of AMQP 0-9-1 (the `reply-code` of `connection.close`,
/// `channel.close` and `basic.return`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum ReplyCode {
    Success = 200,
    ContentTooLarge = 311,
    NoRoute = 312,
    NoConsumers = 313,
    ConnectionForced = 320,
    InvalidPath = 402,
    AccessRefused = 403,
    NotFound = 404,
    ResourceLocked = 405,
    PreconditionFailed = 406,
    FrameError = 501,
    SyntaxError = 502,
    CommandInvalid = 503,
    ChannelError = 504,
    UnexpectedFrame = 505,
    ResourceError = 506,
    NotAllowed = 530,
    NotImplemented = 540,
    InternalError = 541,
}

impl ReplyCode {
    /// Every reply code, in numeric order.
    pub const ALL: [ReplyCode; 19] = [
        ReplyCode::Success,
        ReplyCode::ContentTooLarge,
        ReplyCode::NoRoute,
        ReplyCode::NoConsumers,
        ReplyCode::ConnectionForced,
        ReplyCode::InvalidPath,
        ReplyCode::AccessRefused,
        ReplyCode::NotFound,
        ReplyCode::ResourceLocked,
        ReplyCode::PreconditionFailed,
        ReplyCode::FrameError,
        ReplyCode::SyntaxError,
        ReplyCode::CommandInvalid,
        ReplyCode::ChannelError,
        ReplyCode::UnexpectedFrame,
        ReplyCode::ResourceError,
        ReplyCode::NotAllowed,
        ReplyCode::NotImplemented,
        ReplyCode::InternalError,
    ];

    /// The numeric code.
    pub fn code(self) -> u16 {
        self as u16
    }

    /// The code for a number, if it is one of AMQP 0-9-1's.
    pub fn from_u16(code: u16) -> Option<ReplyCode> {
        ReplyCode::ALL.iter().copied().find(|c| c.code() == code)
    }

    /// The constant's name as RabbitMQ prints it at the start of a reply text
    /// (`NOT_FOUND`, `PRECONDITION_FAILED`, ...).
    pub fn name(self) -> &'static str {
        match self {
            ReplyCode::Success => "SUCCESS",
            ReplyCode::ContentTooLarge => "CONTENT_TOO_LARGE",
            ReplyCode::NoRoute => "NO_ROUTE",
            ReplyCode::NoConsumers => "NO_CONSUMERS",
            ReplyCode::ConnectionForced => "CONNECTION_FORCED",
            ReplyCode::InvalidPath => "INVALID_PATH",
            ReplyCode::AccessRefused => "ACCESS_REFUSED",
            ReplyCode::NotFound => "NOT_FOUND",
            ReplyCode::ResourceLocked => "RESOURCE_LOCKED",
            ReplyCode::PreconditionFailed => "PRECONDITION_FAILED",
            ReplyCode::FrameError => "FRAME_ERROR",
            ReplyCode::SyntaxError => "SYNTAX_ERROR",
            ReplyCode::CommandInvalid => "COMMAND_INVALID",
            ReplyCode::ChannelError => "CHANNEL_ERROR",
            ReplyCode::UnexpectedFrame => "UNEXPECTED_FRAME",
            ReplyCode::ResourceError => "RESOURCE_ERROR",
            ReplyCode::NotAllowed => "NOT_ALLOWED",
            ReplyCode::NotImplemented => "NOT_IMPLEMENTED",
            ReplyCode::InternalError => "INTERNAL_ERROR",
        }
    }

    /// True for a hard error (closes the connection), per the 0-9-1 spec's constant
    /// classes: 320, 402, 501-506, 530, 540, 541. 311-313 and 403-406 are soft (channel)
    /// errors; 200 is neither and returns false.
    pub fn is_hard(self) -> bool {
        matches!(
            self,
            ReplyCode::ConnectionForced
                | ReplyCode::InvalidPath
                | ReplyCode::FrameError
                | ReplyCode::SyntaxError
                | ReplyCode::CommandInvalid
                | ReplyCode::ChannelError
                | ReplyCode::UnexpectedFrame
                | ReplyCode::ResourceError
                | ReplyCode::NotAllowed
                | ReplyCode::NotImplemented
                | ReplyCode::InternalError
        )
    }
}

impl fmt::Display for ReplyCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl From<ReplyCode> for u16 {
    fn from(c: ReplyCode) -> u16 {
        c.code()
    }
}

/// Builds a reply text the way RabbitMQ does (`rabbit_binary_generator:
/// amqp_exception_explanation`): `"NAME - explanation"`, and when that is longer than
/// 255 bytes, its first 252 bytes followed by `"..."` (cut on a UTF-8 boundary here).
pub fn format_reply_text(code: ReplyCode, explanation: &str) -> String {
    let name = code.name();
    let full_len = name.len() + 3 + explanation.len();
    if full_len <= ShortStr::MAX_LEN {
        let mut s = String::with_capacity(full_len);
        s.push_str(name);
        s.push_str(" - ");
        s.push_str(explanation);
        return s;
    }
    let mut s = String::with_capacity(ShortStr::MAX_LEN);
    s.push_str(name);
    s.push_str(" - ");
    let room = 252usize.saturating_sub(s.len());
    s.push_str(truncate_str(explanation, room));
    s.push_str("...");
    s
}

/// A protocol error as the broker reports it: `text` is the part after `"NAME - "`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{} - {text}", code.name())]
pub struct AmqpError {
    pub code: ReplyCode,
    pub text: String,
}

impl AmqpError {
    pub fn new(code: ReplyCode, text: impl Into<String>) -> Self {
        AmqpError {
            code,
            text: text.into(),
        }
    }
    /// 403 ACCESS_REFUSED (channel).
    pub fn access_refused(text: impl Into<String>) -> Self {
        Self::new(ReplyCode::AccessRefused, text)
    }
    /// 404 NOT_FOUND (channel).
    pub fn not_found(text: impl Into<String>) -> Self {
        Self::new(ReplyCode::NotFound, text)
    }
    /// 405 RESOURCE_LOCKED (channel).
    pub fn resource_locked(text: impl Into<String>) -> Self {
        Self::new(ReplyCode::ResourceLocked, text)
    }
    /// 406 PRECONDITION_FAILED (channel).
    pub fn precondition_failed(text: impl Into<String>) -> Self {
        Self::new(ReplyCode::PreconditionFailed, text)
    }
    /// 320 CONNECTION_FORCED (connection).
    pub fn connection_forced(text: impl Into<String>) -> Self {
        Self::new(ReplyCode::ConnectionForced, text)
    }
    /// 402 INVALID_PATH (connection).
    pub fn invalid_path(text: impl Into<String>) -> Self {
        Self::new(ReplyCode::InvalidPath, text)
    }
    /// 501 FRAME_ERROR (connection).
    pub fn frame_error(text: impl Into<String>) -> Self {
        Self::new(ReplyCode::FrameError, text)
    }
    /// 502 SYNTAX_ERROR (connection).
    pub fn syntax_error(text: impl Into<String>) -> Self {
        Self::new(ReplyCode::SyntaxError, text)
    }
    /// 503 COMMAND_INVALID (connection).
    pub fn command_invalid(text: impl Into<String>) -> Self {
        Self::new(ReplyCode::CommandInvalid, text)
    }
    /// 504 CHANNEL_ERROR (connection).
    pub fn channel_error(text: impl Into<String>) -> Self {
        Self::new(ReplyCode::ChannelError, text)
    }
    /// 505 UNEXPECTED_FRAME (connection).
    pub fn unexpected_frame(text: impl Into<String>) -> Self {
        Self::new(ReplyCode::UnexpectedFrame, text)
    }
    /// 506 RESOURCE_ERROR (connection).
    pub fn resource_error(text: impl Into<String>) -> Self {
        Self::new(ReplyCode::ResourceError, text)
    }
    /// 530 NOT_ALLOWED (connection).
    pub fn not_allowed(text: impl Into<String>) -> Self {
        Self::new(ReplyCode::NotAllowed, text)
    }
    /// 540 NOT_IMPLEMENTED (connection).
    pub fn not_implemented(text: impl Into<String>) -> Self {
        Self::new(ReplyCode::NotImplemented, text)
    }
    /// 541 INTERNAL_ERROR (connection).
    pub fn internal_error(text: impl Into<String>) -> Self {
        Self::new(ReplyCode::InternalError, text)
    }

    /// The reply text to send: `"NOT_FOUND - no queue 'x' in vhost '/'"`, cut to 255
    /// bytes as RabbitMQ does.
    pub fn reply_text(&self) -> String {
        format_reply_text(self.code, &self.text)
    }

    /// [`AmqpError::reply_text`] as a [`ShortStr`], ready for `connection.close` /
    /// `channel.close`.
    pub fn reply_text_short(&self) -> ShortStr {
        ShortStr::from_string(self.reply_text())
    }

    /// True when the error closes the connection rather than the channel.
    pub fn is_hard(&self) -> bool {
        self.code.is_hard()
    }

    /// The numeric reply code.
    pub fn reply_code(&self) -> u16 {
        self.code.code()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes() {
        for c in ReplyCode::ALL {
            assert_eq!(ReplyCode::from_u16(c.code()), Some(c));
        }
        assert_eq!(ReplyCode::from_u16(999), None);
        assert_eq!(ReplyCode::NotFound.code(), 404);
        assert_eq!(ReplyCode::PreconditionFailed.name(), "PRECONDITION_FAILED");
        assert!(!ReplyCode::NotFound.is_hard());
        assert!(!ReplyCode::AccessRefused.is_hard());
        assert!(!ReplyCode::ResourceLocked.is_hard());
        assert!(!ReplyCode::PreconditionFailed.is_hard());
        assert!(ReplyCode::NotAllowed.is_hard());
        assert!(ReplyCode::ConnectionForced.is_hard());
        assert!(ReplyCode::FrameError.is_hard());
        assert!(ReplyCode::NotImplemented.is_hard());
        assert!(!ReplyCode::Success.is_hard());
    }

    #[test]
    fn amqp_error_text() {
        let e = AmqpError::not_found("no queue 'x' in vhost '/'");
        assert_eq!(e.reply_text(), "NOT_FOUND - no queue 'x' in vhost '/'");
        assert_eq!(e.to_string(), "NOT_FOUND - no queue 'x' in vhost '/'");
        assert!(!e.is_hard());
        assert!(AmqpError::not_allowed("x").is_hard());
        assert_eq!(
            e.reply_text_short(),
            "NOT_FOUND - no queue 'x' in vhost '/'"
        );
    }

    #[test]
    fn long_text_is_cut_like_rabbitmq() {
        let e = AmqpError::resource_locked("a".repeat(300));
        let t = e.reply_text();
        assert_eq!(t.len(), 255);
        assert!(t.starts_with("RESOURCE_LOCKED - aaa"));
        assert!(t.ends_with("a..."));
        // exactly 255 is kept whole
        let name_len = "NOT_FOUND - ".len();
        let e = AmqpError::not_found("b".repeat(255 - name_len));
        assert_eq!(e.reply_text().len(), 255);
        assert!(!e.reply_text().ends_with("..."));
        // multi-byte text is cut on a char boundary
        let e = AmqpError::not_found("é".repeat(200));
        let t = e.reply_text();
        assert!(t.len() <= 255 && t.ends_with("..."));
    }
}
