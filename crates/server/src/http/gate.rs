//! The management API while the node starts: until recovery has brought every durable queue
//! back, no route reaches the broker. Store keys, shared-body counts and message ids are
//! restored queue by queue, so a declare, publish or get meanwhile would reuse them, and a
//! listing would show queues half restored.
//!
//! RabbitMQ opens its management listener only once the node has booted (a client meets a
//! refused connection). Warren listens from the start and answers 503 with a reason, so that
//! a health check or a dashboard can tell "starting" from "down". A request waits up to
//! [`HOLD`] for the end first, so that one sent right after a start (which still takes a
//! step when there is nothing to restore) is served. The web page itself is served (it shows
//! the API's answer); `/metrics` refuses too (see `crate::metrics`).

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use super::{recovering_reason, Api, ApiError};

/// How long a request that comes during recovery waits for its end before it is refused.
pub const HOLD: Duration = Duration::from_secs(1);

pub async fn while_recovering(State(api): State<Arc<Api>>, req: Request, next: Next) -> Response {
    let path = req.uri().path();
    if !path.starts_with("/api/") && path != "/api" {
        return next.run(req).await;
    }
    // Once recovered, for good: a request let through here cannot meet a recovering node.
    let Some(left) = api.node.recovering_after(HOLD).await else {
        return next.run(req).await;
    };
    if path.starts_with("/api/health/checks/") || path.starts_with("/api/aliveness-test/") {
        // A failed check, in the shape RabbitMQ's health checks answer.
        let body = json!({"status": "failed", "reason": recovering_reason(left)});
        let mut r = (StatusCode::SERVICE_UNAVAILABLE, axum::Json(body)).into_response();
        r.headers_mut().insert(
            axum::http::header::RETRY_AFTER,
            axum::http::HeaderValue::from(1u32),
        );
        return r;
    }
    ApiError::recovering(left).into_response()
}
