//! SQS's errors as the JSON protocol sends them: a status, a body
//! `{"__type": "com.amazonaws.sqs#Shape", "message": ...}`, and the query protocol's code in
//! `x-amzn-query-error` (the SDKs read it for SQS, which is "query compatible").

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

#[derive(Debug, Clone)]
pub struct SqsError {
    pub status: StatusCode,
    /// The JSON protocol's shape name.
    pub shape: &'static str,
    /// The query protocol's code.
    pub code: &'static str,
    pub message: String,
    /// The client's fault (`Sender`), or the server's (`Receiver`).
    pub sender: bool,
}

impl SqsError {
    pub fn new(
        status: u16,
        shape: &'static str,
        code: &'static str,
        message: impl Into<String>,
    ) -> Self {
        SqsError {
            status: StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_REQUEST),
            shape,
            code,
            message: message.into(),
            sender: status < 500,
        }
    }
    pub fn invalid_parameter(m: impl Into<String>) -> Self {
        Self::new(
            400,
            "InvalidParameterValueException",
            "InvalidParameterValue",
            m,
        )
    }
    pub fn missing_parameter(name: &str) -> Self {
        Self::new(
            400,
            "MissingRequiredParameterException",
            "MissingParameter",
            format!("The request must contain the parameter {name}."),
        )
    }
    pub fn no_queue() -> Self {
        Self::new(
            400,
            "QueueDoesNotExist",
            "AWS.SimpleQueueService.NonExistentQueue",
            "The specified queue does not exist.",
        )
    }
    pub fn queue_exists(name: &str) -> Self {
        Self::new(
            400,
            "QueueNameExists",
            "QueueAlreadyExists",
            format!("A queue already exists with the same name and a different value for attribute(s): {name}"),
        )
    }
    pub fn invalid_attribute_name(name: &str) -> Self {
        Self::new(
            400,
            "InvalidAttributeName",
            "InvalidAttributeName",
            format!("Unknown Attribute {name}."),
        )
    }
    pub fn invalid_attribute_value(m: impl Into<String>) -> Self {
        Self::new(400, "InvalidAttributeValue", "InvalidAttributeValue", m)
    }
    pub fn receipt_invalid(handle: &str) -> Self {
        Self::new(
            400,
            "ReceiptHandleIsInvalid",
            "ReceiptHandleIsInvalid",
            format!("The input receipt handle \"{handle}\" is not a valid receipt handle."),
        )
    }
    pub fn not_inflight() -> Self {
        Self::new(
            400,
            "MessageNotInflight",
            "AWS.SimpleQueueService.MessageNotInflight",
            "The message referred to isn't in flight.",
        )
    }
    pub fn access_denied(m: impl Into<String>) -> Self {
        Self::new(403, "AccessDeniedException", "AccessDenied", m)
    }
    pub fn internal(m: impl Into<String>) -> Self {
        Self::new(500, "InternalError", "InternalError", m)
    }
    pub fn unavailable(m: impl Into<String>) -> Self {
        Self::new(503, "ServiceUnavailable", "ServiceUnavailable", m)
    }
    pub fn empty_batch() -> Self {
        Self::new(
            400,
            "EmptyBatchRequest",
            "AWS.SimpleQueueService.EmptyBatchRequest",
            "There should be at least one entry in the request.",
        )
    }
    pub fn too_many_entries(n: usize) -> Self {
        Self::new(
            400,
            "TooManyEntriesInBatchRequest",
            "AWS.SimpleQueueService.TooManyEntriesInBatchRequest",
            format!("Maximum number of entries per request are 10. You have sent {n}."),
        )
    }
    pub fn ids_not_distinct(id: &str) -> Self {
        Self::new(
            400,
            "BatchEntryIdsNotDistinct",
            "AWS.SimpleQueueService.BatchEntryIdsNotDistinct",
            format!("Id {id} repeated."),
        )
    }
    pub fn invalid_batch_id(id: &str) -> Self {
        Self::new(
            400,
            "InvalidBatchEntryId",
            "AWS.SimpleQueueService.InvalidBatchEntryId",
            format!("A batch entry id can only contain alphanumeric characters, hyphens and underscores. It can be at most 80 letters long: {id}"),
        )
    }
}

impl From<crate::driver::WriteError> for SqsError {
    fn from(e: crate::driver::WriteError) -> Self {
        match e {
            crate::driver::WriteError::Recovering => {
                SqsError::unavailable("the node is starting: it is still recovering its queues")
            }
            crate::driver::WriteError::Stopping => {
                SqsError::unavailable("the node is stopping: send to another node")
            }
            other => SqsError::internal(other.to_string()),
        }
    }
}

impl IntoResponse for SqsError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({
            "__type": format!("com.amazonaws.sqs#{}", self.shape),
            "message": self.message,
        });
        let mut r = (self.status, body.to_string()).into_response();
        let h = r.headers_mut();
        h.insert(
            "content-type",
            HeaderValue::from_static("application/x-amz-json-1.0"),
        );
        let fault = if self.sender { "Sender" } else { "Receiver" };
        if let Ok(v) = HeaderValue::from_str(&format!("{};{fault}", self.code)) {
            h.insert("x-amzn-query-error", v);
        }
        r
    }
}
