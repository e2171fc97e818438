//! The plain-HTTP listener: liveness, readiness and Prometheus metrics (issue 3).
//!
//! - `GET /healthz`: `200 ok` while the process serves at all;
//! - `GET /readyz`: `200 ready` once a valid snapshot is published, `503` before (an API-mode
//!   server with an empty store is not ready until the first `retryplane apply`);
//! - `GET /metrics`: the server's own figures ([`ServerMetrics`]) and the agents' aggregated
//!   retry metrics and fleet gauges ([`crate::aggregate::prometheus`]): in the OpenMetrics text
//!   format to a scraper that asks for it (Prometheus does), else in Prometheus' text format
//!   0.0.4 ([`crate::text_format`]).
//!
//! [`router`] builds the whole app, so tests drive it without a socket.

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;

use crate::metrics::ServerMetrics;
use crate::publisher::Publisher;
use crate::text_format;

/// The `Content-Type` of `/metrics` in OpenMetrics (what prometheus-client writes).
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

async fn metrics(State(state): State<HttpState>, headers: HeaderMap) -> impl IntoResponse {
    let openmetrics = state.metrics.render();
    if text_format::wants_openmetrics(headers.get(header::ACCEPT)) {
        ([(header::CONTENT_TYPE, METRICS_CONTENT_TYPE)], openmetrics)
    } else {
        (
            [(header::CONTENT_TYPE, text_format::TEXT_CONTENT_TYPE)],
            text_format::from_openmetrics(&openmetrics),
        )
    }
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
        get_accepting(state, path, None).await
    }

    async fn get_accepting(
        state: &HttpState,
        path: &str,
        accept: Option<&str>,
    ) -> (StatusCode, String, Option<String>) {
        let mut app = router(state.clone());
        let mut request = Request::get(path);
        if let Some(accept) = accept {
            request = request.header(header::ACCEPT, accept);
        }
        let request = request.body(Body::empty()).unwrap();
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
    async fn metrics_are_openmetrics_text_to_a_scraper_that_asks_for_it() {
        let state = state();
        state.metrics.agents_connected.set(3);
        state.metrics.pushes.inc();
        let accept = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5";
        let (status, body, content_type) = get_accepting(&state, "/metrics", Some(accept)).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(content_type.as_deref(), Some(METRICS_CONTENT_TYPE));
        assert!(
            body.contains("retryplane_server_agents_connected 3"),
            "{body}"
        );
        assert!(body.contains("retryplane_server_current_version"), "{body}");
        assert!(
            body.contains("# TYPE retryplane_server_pushes counter\n"),
            "{body}"
        );
        assert!(body.ends_with("# EOF\n"), "{body}");
    }

    #[tokio::test]
    async fn metrics_are_prometheus_text_0_0_4_otherwise() {
        let state = state();
        state.metrics.agents_connected.set(3);
        state.metrics.pushes.inc();
        for accept in [None, Some("*/*"), Some("text/plain")] {
            let (status, body, content_type) = get_accepting(&state, "/metrics", accept).await;
            assert_eq!(status, StatusCode::OK);
            assert_eq!(
                content_type.as_deref(),
                Some(text_format::TEXT_CONTENT_TYPE)
            );
            assert!(
                body.contains("retryplane_server_agents_connected 3"),
                "{body}"
            );
            assert!(
                body.contains(
                    "# TYPE retryplane_server_pushes_total counter\nretryplane_server_pushes_total 1\n"
                ),
                "{body}"
            );
            assert!(!body.contains("# EOF"), "{body}");
            assert!(!body.contains("# UNIT"), "{body}");
        }
    }

    #[tokio::test]
    async fn unknown_paths_are_404() {
        assert_eq!(get(&state(), "/nope").await.0, StatusCode::NOT_FOUND);
    }
}
