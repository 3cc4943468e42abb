//! The web page: one self-contained HTML file (no build step), served at `/`. It logs in with
//! HTTP basic auth and reads the same API as any tool.

use axum::http::header;
use axum::response::IntoResponse;

const PAGE: &str = include_str!("ui/index.html");

pub async fn page() -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        PAGE,
    )
}
