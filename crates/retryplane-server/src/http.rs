//! The plain-HTTP listener: liveness, readiness and Prometheus metrics (issue 3).
//!
//! - `GET /healthz`: `200 ok` while the process serves at all;
//! - `GET /readyz`: `200 ready` once a valid snapshot is published, `503` before (an API-mode
//!   server with an empty store is not ready until the first `retryplane apply`);
//! - `GET /metrics`: the server's own figures ([`ServerMetrics`]) and the agents' aggregated
//!   retry metrics and fleet gauges ([`crate::aggregate::prometheus`]) in the OpenMetrics text
//!   format that Prometheus scrapes.
//!
//! [`router`] builds the whole app, so tests drive it without a socket.

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;

use crate::metrics::ServerMetrics;
use crate::publisher::Publisher;

/// The `Content-Type` of `/metrics` (prometheus-client writes OpenMetrics text).
pub const METRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// What the HTTP handlers read.
#[derive(Clone, Debug)]
pub struct HttpState {
    /// Readiness: whether a snapshot is published.
    pub publisher: Arc<Publisher>,
    /// The figures `/metrics` renders.
    pub metrics: Arc<ServerMetrics>,
}

/// The HTTP app: `/healthz`, `/readyz`, `/metrics`.
pub fn router(state: HttpState) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(state)
}

async fn healthz() -> &'static str {
    "ok"
}

async fn readyz(State(state): State<HttpState>) -> (StatusCode, &'static str) {
    if state.publisher.current().is_some() {
        (StatusCode::OK, "ready")
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: no valid policy snapshot is loaded yet",
        )
    }
}

async fn metrics(State(state): State<HttpState>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, METRICS_CONTENT_TYPE)],
        state.metrics.render(),
    )
}

#[cfg(test)]
mod tests {
    use axum::body::Body;
    use axum::http::Request;
    use retryplane_proto::pb;
    use tonic::codegen::Service as _;

    use super::*;
    use crate::store::VersionRecord;

    fn state() -> HttpState {
        HttpState {
            publisher: Arc::new(Publisher::new(10_000)),
            metrics: Arc::new(ServerMetrics::new()),
        }
    }

    async fn get(state: &HttpState, path: &str) -> (StatusCode, String, Option<String>) {
        let mut app = router(state.clone());
        let request = Request::get(path).body(Body::empty()).unwrap();
        let response = app.call(request).await.unwrap();
        let status = response.status();
        let content_type = response
            .headers()
            .get(header::CONTENT_TYPE)
            .map(|v| v.to_str().unwrap().to_owned());
        let body = axum::body::to_bytes(response.into_body(), 1 << 20)
            .await
            .unwrap();
        (
            status,
            String::from_utf8(body.to_vec()).unwrap(),
            content_type,
        )
    }

    fn record(version: u64) -> VersionRecord {
        VersionRecord::of_version(version, pb::PolicyDocument::default())
    }

    #[tokio::test]
    async fn healthz_is_always_ok() {
        let (status, body, _) = get(&state(), "/healthz").await;
        assert_eq!((status, body.as_str()), (StatusCode::OK, "ok"));
    }

    #[tokio::test]
    async fn readyz_is_503_until_a_snapshot_is_published() {
        let state = state();
        assert_eq!(
            get(&state, "/readyz").await.0,
            StatusCode::SERVICE_UNAVAILABLE
        );
        state.publisher.publish(&record(1));
        assert_eq!(get(&state, "/readyz").await.0, StatusCode::OK);
    }

    #[tokio::test]
    async fn metrics_are_openmetrics_text_with_the_server_figures() {
        let state = state();
        state.metrics.agents_connected.set(3);
        let (status, body, content_type) = get(&state, "/metrics").await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(content_type.as_deref(), Some(METRICS_CONTENT_TYPE));
        assert!(
            body.contains("retryplane_server_agents_connected 3"),
            "{body}"
        );
        assert!(body.contains("retryplane_server_current_version"), "{body}");
        assert!(body.ends_with("# EOF\n"), "{body}");
    }

    #[tokio::test]
    async fn unknown_paths_are_404() {
        assert_eq!(get(&state(), "/nope").await.0, StatusCode::NOT_FOUND);
    }
}
