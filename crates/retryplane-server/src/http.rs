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
//! A `/metrics` answer is rendered on a blocking thread, one render at a time, and shared by
//! every request that was waiting when it finished: at the agent metrics' series cap the text is
//! 20 to 106 MB (by the length of the names) and takes a few hundred milliseconds, and the
//! listener asks no token, so scrapes that come together must neither stall the agent and admin
//! listeners (which share the runtime) nor hold a copy each. An answer is never older than its
//! request: a request uses a render that started after it arrived, or starts one. To a request
//! whose `Accept-Encoding` takes gzip (Prometheus' does) it is sent gzip-compressed (a seventh
//! of the size or less), compressed on a blocking thread too, once per render and format.
//! (Compressed here rather than by a compression layer, which would compress each answer on the
//! threads that serve the agents.)
//!
//! [`router`] builds the whole app, so tests drive it without a socket; the listener adds its
//! connections' wiring (HTTP/1.1 only, requests counted in flight: `crate::idle::serve`).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use bytes::Bytes;
use tokio::sync::Mutex;
use tokio::time::Instant;
use tracing::error;

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
        .with_state(App {
            state,
            renders: Arc::new(Renders::default()),
        })
}

/// The router's state: the handlers' inputs and the `/metrics` renders.
#[derive(Clone)]
struct App {
    state: HttpState,
    renders: Arc<Renders>,
}

/// The last `/metrics` render, kept while requests wait for it (see the module's docs).
#[derive(Default)]
struct Renders {
    /// Owned by the task that renders (see [`Renders::exposition`]).
    last: Arc<Mutex<Option<Rendered>>>,
    /// Requests between their arrival and the end of their render task.
    waiting: AtomicUsize,
    /// Tests: the next full render waits for a message (or a hang-up) on this first.
    #[cfg(test)]
    gate: std::sync::Mutex<Option<std::sync::mpsc::Receiver<()>>>,
}

/// One render of the exposition, in the two formats as they are asked for, each also
/// gzip-compressed once asked for so.
struct Rendered {
    started: Instant,
    openmetrics: Bytes,
    text: Option<Bytes>,
    openmetrics_gzip: Option<Bytes>,
    text_gzip: Option<Bytes>,
}

/// How a `/metrics` answer is asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Asked {
    /// OpenMetrics, else the text format 0.0.4.
    openmetrics: bool,
    /// gzip-compressed.
    gzip: bool,
}

/// Whether an `Accept-Encoding` header takes gzip: listed (by name, or `x-gzip`) with no
/// `q=0`, or, when it is not listed, `*` with no `q=0` (RFC 9110 §12.5.3: `*` stands for
/// every coding the header does not name).
fn accepts_gzip(header: Option<&axum::http::HeaderValue>) -> bool {
    let Some(value) = header.and_then(|h| h.to_str().ok()) else {
        return false;
    };
    // Whether gzip, and `*`, are listed, and taken (no `q=0`).
    let (mut gzip, mut star) = (None, None);
    for coding in value.split(',') {
        let mut parts = coding.split(';');
        let name = parts.next().unwrap_or_default().trim();
        let refused = parts.any(|p| {
            let p = p.trim();
            p.strip_prefix("q=")
                .or_else(|| p.strip_prefix("Q="))
                .and_then(|q| q.trim().parse::<f64>().ok())
                .is_some_and(|q| q <= 0.0)
        });
        if name.eq_ignore_ascii_case("gzip") || name.eq_ignore_ascii_case("x-gzip") {
            gzip = Some(gzip.unwrap_or(false) || !refused);
        } else if name == "*" {
            star = Some(!refused);
        }
    }
    gzip.or(star).unwrap_or(false)
}

/// `bytes` gzip-compressed, at the fast level (the exposition's repeated names and labels
/// compress to a seventh of its size or less).
fn gzip(bytes: &[u8]) -> Bytes {
    use std::io::Write as _;
    let mut encoder = flate2::write::GzEncoder::new(
        Vec::with_capacity(bytes.len() / 8),
        flate2::Compression::fast(),
    );
    // Writes to a `Vec` do not fail.
    let _ = encoder.write_all(bytes);
    Bytes::from(encoder.finish().unwrap_or_default())
}

/// Counts a request in [`Renders::waiting`] until dropped.
struct Waiting(Arc<Renders>);

impl Waiting {
    fn enter(renders: &Arc<Renders>) -> Self {
        renders.waiting.fetch_add(1, Ordering::SeqCst);
        Self(renders.clone())
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Renders {
    /// The exposition in OpenMetrics (`openmetrics`) or in the text format 0.0.4, from a render
    /// that started after this call.
    ///
    /// The lock is taken, and the render done, by a task of its own that the request waits
    /// for: a request dropped meanwhile (its client gone) neither gives the lock back while its
    /// render still runs, which let a client that hangs up at once start renders without end,
    /// nor throws the render away.
    async fn exposition(
        self: &Arc<Self>,
        metrics: &Arc<ServerMetrics>,
        asked: Asked,
    ) -> Result<Bytes, tokio::task::JoinError> {
        let Asked { openmetrics, gzip } = asked;
        let arrived = Instant::now();
        let waiting = Waiting::enter(self);
        let last = self.last.clone();
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let mut last = last.lock_owned().await;
            let mut rendered = match last.take().filter(|r| r.started >= arrived) {
                Some(rendered) => rendered,
                None => render(&waiting.0, metrics).await?,
            };
            if !openmetrics && rendered.text.is_none() {
                let source = rendered.openmetrics.clone();
                rendered.text = Some(
                    tokio::task::spawn_blocking(move || {
                        // A render is a `String`, so this never fails.
                        let text = std::str::from_utf8(&source)
                            .map_or_else(|_| String::new(), text_format::from_openmetrics);
                        Bytes::from(text)
                    })
                    .await?,
                );
            }
            let plain = if openmetrics {
                rendered.openmetrics.clone()
            } else {
                rendered.text.clone().unwrap_or_default()
            };
            let answer = if gzip {
                let kept = if openmetrics {
                    &mut rendered.openmetrics_gzip
                } else {
                    &mut rendered.text_gzip
                };
                match kept {
                    Some(compressed) => compressed.clone(),
                    None => {
                        let compressed =
                            tokio::task::spawn_blocking(move || self::gzip(&plain)).await?;
                        *kept = Some(compressed.clone());
                        compressed
                    }
                }
            } else {
                plain
            };
            let renders = waiting.0.clone();
            drop(waiting);
            // Kept only for requests already waiting: a later one needs a render of its own.
            if renders.waiting.load(Ordering::SeqCst) > 0 {
                *last = Some(rendered);
            }
            Ok(answer)
        })
        .await?
    }
}

/// A new render of the exposition in OpenMetrics, on a blocking thread (the text format is
/// made from it when a request asks for it).
async fn render(
    #[cfg_attr(not(test), allow(unused_variables))] renders: &Renders,
    metrics: Arc<ServerMetrics>,
) -> Result<Rendered, tokio::task::JoinError> {
    let started = Instant::now();
    #[cfg(test)]
    let gate = renders
        .gate
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .take();
    tokio::task::spawn_blocking(move || {
        #[cfg(test)]
        if let Some(gate) = gate {
            let _ = gate.recv();
        }
        Rendered {
            started,
            openmetrics: Bytes::from(metrics.render()),
            text: None,
            openmetrics_gzip: None,
            text_gzip: None,
        }
    })
    .await
}

async fn healthz() -> &'static str {
    "ok"
}

async fn readyz(State(app): State<App>) -> (StatusCode, &'static str) {
    if app.state.publisher.current().is_some() {
        (StatusCode::OK, "ready")
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: no valid policy snapshot is loaded yet",
        )
    }
}

async fn metrics(State(app): State<App>, headers: HeaderMap) -> Response {
    let asked = Asked {
        openmetrics: text_format::wants_openmetrics(headers.get(header::ACCEPT)),
        gzip: accepts_gzip(headers.get(header::ACCEPT_ENCODING)),
    };
    let content_type = if asked.openmetrics {
        METRICS_CONTENT_TYPE
    } else {
        text_format::TEXT_CONTENT_TYPE
    };
    match app.renders.exposition(&app.state.metrics, asked).await {
        Ok(body) if asked.gzip => (
            [
                (header::CONTENT_TYPE, content_type),
                (header::CONTENT_ENCODING, "gzip"),
                (header::VARY, "accept, accept-encoding"),
            ],
            body,
        )
            .into_response(),
        Ok(body) => (
            [
                (header::CONTENT_TYPE, content_type),
                (header::VARY, "accept, accept-encoding"),
            ],
            body,
        )
            .into_response(),
        Err(e) => {
            error!(error = %e, "rendering /metrics did not finish");
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                "the metrics could not be rendered; see the control plane's log",
            )
                .into_response()
        }
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

    /// An uncompressed answer in OpenMetrics (`openmetrics`) or the text format 0.0.4.
    fn plain(openmetrics: bool) -> Asked {
        Asked {
            openmetrics,
            gzip: false,
        }
    }

    #[test]
    fn gzip_is_taken_when_named_without_q_0() {
        let takes =
            |value: &str| accepts_gzip(Some(&axum::http::HeaderValue::from_str(value).unwrap()));
        assert!(takes("gzip"));
        assert!(takes("gzip, deflate, br"));
        assert!(takes("identity;q=1, GZIP;q=0.5"));
        assert!(takes("x-gzip"));
        assert!(!takes("gzip;q=0"));
        assert!(!takes("gzip;Q=0"));
        assert!(!takes("gzip; q=0.0, deflate"));
        assert!(!takes("deflate, br"));
        // `*` stands for every coding not named (RFC 9110 §12.5.3).
        assert!(takes("*"));
        assert!(takes("br, *;q=0.1"));
        assert!(!takes("*;q=0"));
        assert!(!takes("gzip;q=0, *"));
        assert!(!takes(""));
        assert!(!accepts_gzip(None));
    }

    /// Prometheus' request (OpenMetrics, gzip) gets the exposition gzip-compressed, with its
    /// headers saying so; the same bytes as the plain answer once decompressed. A request
    /// that does not take gzip gets it plain.
    #[tokio::test]
    async fn metrics_are_gzip_compressed_to_a_scraper_that_takes_gzip() {
        use std::io::Read as _;
        let state = state();
        state.metrics.agents_connected.set(3);
        for accept in [Some("application/openmetrics-text;version=1.0.0"), None] {
            let ask = |gzip: bool| {
                let mut request = Request::get("/metrics");
                if let Some(accept) = accept {
                    request = request.header(header::ACCEPT, accept);
                }
                if gzip {
                    request = request.header(header::ACCEPT_ENCODING, "gzip");
                }
                request.body(Body::empty()).unwrap()
            };
            let mut app = router(state.clone());
            let compressed = app.call(ask(true)).await.unwrap();
            assert_eq!(compressed.headers()[header::CONTENT_ENCODING], "gzip");
            assert_eq!(
                compressed.headers()[header::VARY],
                "accept, accept-encoding"
            );
            let compressed = axum::body::to_bytes(compressed.into_body(), usize::MAX)
                .await
                .unwrap();
            let mut text = String::new();
            flate2::read::GzDecoder::new(&compressed[..])
                .read_to_string(&mut text)
                .unwrap();
            let plain = app.call(ask(false)).await.unwrap();
            assert!(plain.headers().get(header::CONTENT_ENCODING).is_none());
            let plain = axum::body::to_bytes(plain.into_body(), usize::MAX)
                .await
                .unwrap();
            assert_eq!(text.as_bytes(), &plain[..], "{accept:?}");
            assert!(
                text.contains("retryplane_server_agents_connected 3"),
                "{text}"
            );
        }
    }

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

    /// Waits (bounded) until `n` requests wait for a render.
    async fn until_waiting(renders: &Renders, n: usize) {
        for _ in 0..5_000 {
            if renders.waiting.load(Ordering::SeqCst) == n {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        panic!("{n} requests did not come to wait for a render");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn scrapes_that_wait_together_share_one_render_of_each_format() {
        let state = state();
        let renders = Arc::new(Renders::default());
        let held = renders.last.lock().await;
        let scrapes: Vec<_> = (0..8)
            .map(|i| {
                let renders = renders.clone();
                let metrics = state.metrics.clone();
                tokio::spawn(async move { renders.exposition(&metrics, plain(i % 2 == 0)).await })
            })
            .collect();
        until_waiting(&renders, 8).await;
        drop(held);
        let mut bodies = Vec::new();
        for scrape in scrapes {
            bodies.push(scrape.await.unwrap().unwrap());
        }
        let (openmetrics, text): (Vec<_>, Vec<_>) =
            bodies.iter().enumerate().partition(|(i, _)| i % 2 == 0);
        for (_, body) in &openmetrics {
            assert_eq!(body.as_ptr(), openmetrics[0].1.as_ptr(), "one copy shared");
            assert!(body.ends_with(b"# EOF\n"));
        }
        for (_, body) in &text {
            assert_eq!(body.as_ptr(), text[0].1.as_ptr(), "one copy shared");
            assert!(!body.ends_with(b"# EOF\n") && !body.is_empty());
        }
        // Nothing is kept once no request waits, and a later request renders anew.
        assert!(renders.last.lock().await.is_none());
        let later = renders
            .exposition(&state.metrics, plain(true))
            .await
            .unwrap();
        assert_ne!(later.as_ptr(), openmetrics[0].1.as_ptr());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_scrape_dropped_during_its_render_keeps_the_lock_until_the_render_ends() {
        let state = state();
        let renders = Arc::new(Renders::default());
        let (release, gate) = std::sync::mpsc::channel();
        *renders.gate.lock().unwrap() = Some(gate);
        let scrape = {
            let renders = renders.clone();
            let metrics = state.metrics.clone();
            tokio::spawn(async move { renders.exposition(&metrics, plain(true)).await })
        };
        // Bounded: until its render has begun (it took the gate).
        for _ in 0..5_000 {
            if renders.gate.lock().unwrap().is_none() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        assert!(
            renders.gate.lock().unwrap().is_none(),
            "the render never began"
        );
        scrape.abort();
        assert!(scrape.await.unwrap_err().is_cancelled());
        // The client is gone; its render still runs, so no other may start.
        assert!(renders.last.try_lock().is_err(), "the lock was given back");
        assert_eq!(renders.waiting.load(Ordering::SeqCst), 1);
        release.send(()).unwrap();
        until_waiting(&renders, 0).await;
        // Once it ended, nothing is kept (no one waited) and scrapes go on.
        assert!(renders.last.lock().await.is_none());
        let body = renders
            .exposition(&state.metrics, plain(true))
            .await
            .unwrap();
        assert!(body.ends_with(b"# EOF\n"));
    }

    #[tokio::test]
    async fn a_scrape_never_gets_a_render_that_started_before_it_arrived() {
        let state = state();
        let renders = Arc::new(Renders::default());
        *renders.last.lock().await = Some(Rendered {
            started: Instant::now(),
            openmetrics: Bytes::from_static(b"stale"),
            text: Some(Bytes::from_static(b"stale")),
            openmetrics_gzip: None,
            text_gzip: None,
        });
        state.metrics.publishes.inc();
        for openmetrics in [true, false] {
            let body = renders
                .exposition(&state.metrics, plain(openmetrics))
                .await
                .unwrap();
            let body = String::from_utf8(body.to_vec()).unwrap();
            assert!(body.contains("publishes_total 1"), "{body}");
        }
    }
}
