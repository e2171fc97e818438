//! The tower [`RetryLayer`] on the success path against the bare service and `tower::retry`
//! over the same service, all measured the same way in the same run.
//!
//! The service is what an HTTP client is to the layer: a `Service<http::Request<B>>` that
//! answers `200 OK` with an empty `Full<Bytes>` body at once, ready at every `poll_ready`. The
//! layer's extra work is what a user pays per request on top of the client: the policy read,
//! the request's body made replayable, the boxed future, the answer's classification (status,
//! `Retry-After`, the mark of a layer below that gave up), counters, budget and breaker. A real
//! client's own work (connection pool, encoding, the network) comes on top of both and is not
//! here.
//!
//! Every variant runs a batch of `iters` requests (`poll_ready` then `call`, as a tower user
//! does) inside one `block_on` of a current-thread tokio runtime, so the figure is the time per
//! request and the executor's cost is paid once per batch (its I/O driver is on for the
//! loopback series). The agent is the `call` bench's:
//! 1,000 endpoints, budget and breaker on, the layer on the endpoint in the middle
//! (`svc-0500`), whose second route matches the request `GET /v1/items/12345`.
//!
//! Group `layer`:
//! - `bare_get`: the service alone, `GET` with an empty body;
//! - `tower_retry_get`: `tower::retry::Retry` over it with a policy that never retries an
//!   `Ok` and copies the request for a retry (method, URI, headers and body);
//! - `retryplane_layer_get`: `RetryLayer::new(endpoint)` over it;
//! - `retryplane_layer_dedup_get`: the same with de-duplication on (`Dedup::default()`), one
//!   request at a time, so each leads its own call;
//! - `bare_post_1k`, `retryplane_layer_post_1k`: `POST` with a 1 KiB body (read and kept by the
//!   layer for a resend, though a `POST` without an `Idempotency-Key` is not retried);
//! - `loopback/hyper_get` and `loopback/retryplane_layer_hyper_get`: the same `GET` through
//!   hyper-util's pooled HTTP/1 client to a hyper server on 127.0.0.1, served on the same
//!   thread (one connection, kept alive): what the layer's work weighs against a request that
//!   goes over a socket, the cheapest one a service makes. The figure counts the client, the
//!   server and the kernel's socket work of that thread.
//!
//! Every answer's body is read to its end (a pooled client reuses the connection only then).
//!
//! With `RETRYPLANE_BENCH_CPU_TIME=1` every batch is timed by its thread's CPU time
//! (`CLOCK_THREAD_CPUTIME_ID`) instead of the wall clock.
//!
//! Run (results in BENCHMARKS.md):
//!
//! ```text
//! cargo bench -p retryplane-agent --bench layer
//! RETRYPLANE_BENCH_CPU_TIME=1 cargo bench -p retryplane-agent --bench layer
//! ```
//!
//! [`RetryLayer`]: retryplane_agent::layer::RetryLayer

// The criterion macros generate undocumented public items.
#![allow(missing_docs)]
#![allow(
    clippy::expect_used,
    reason = "bench set-up that fails must stop the run loudly"
)]

#[allow(
    dead_code,
    reason = "shared with the call benches, which use more of it"
)]
mod support;

use std::convert::Infallible;
use std::future::{Ready, poll_fn, ready};
use std::hint::black_box;

use bytes::Bytes;
use criterion::{Criterion, criterion_group, criterion_main};
use http::{Request, Response};
use http_body::Body;
use http_body_util::{BodyExt, Full};
use hyper::server::conn::http1;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use retryplane_agent::layer::{Dedup, ReplayBody, RetryLayer};
use support::cpu_clock::cpu_time_mode;
use support::{HOT, METHOD, PATH, Stopwatch, agent};
use tower::{Layer, Service};

/// The URI of every in-memory request: [`PATH`] on an upstream the layer never reaches.
const URI: &str = "http://upstream.test/v1/items/12345";

/// The 1 KiB body of the `POST` variants.
static BODY_1K: [u8; 1024] = [b'x'; 1024];

/// The upstream: `200 OK`, an empty body, at once, whatever the request's body type.
#[derive(Clone, Copy)]
struct Upstream;

impl<B> Service<Request<B>> for Upstream {
    type Response = Response<Full<Bytes>>;
    type Error = Infallible;
    type Future = Ready<Result<Self::Response, Infallible>>;

    fn poll_ready(
        &mut self,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Infallible>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        drop(black_box(request));
        ready(Ok(Response::new(Full::new(Bytes::new()))))
    }
}

/// A tower retry policy that retries errors only, copying the request for a retry as a tower
/// user must (`http::Request` is not `Clone`).
#[derive(Clone, Copy)]
struct TowerPolicy;

impl<Res, E> tower::retry::Policy<Request<Full<Bytes>>, Res, E> for TowerPolicy {
    type Future = Ready<()>;

    fn retry(
        &mut self,
        _req: &mut Request<Full<Bytes>>,
        result: &mut Result<Res, E>,
    ) -> Option<Self::Future> {
        result.is_err().then(|| ready(()))
    }

    fn clone_request(&mut self, req: &Request<Full<Bytes>>) -> Option<Request<Full<Bytes>>> {
        let mut copy = Request::new(req.body().clone());
        *copy.method_mut() = req.method().clone();
        *copy.uri_mut() = req.uri().clone();
        *copy.headers_mut() = req.headers().clone();
        Some(copy)
    }
}

/// What one series sends: `GET` with no body, or `POST` with 1 KiB, to `uri`.
#[derive(Clone, Copy)]
struct Send {
    post: bool,
    uri: &'static str,
}

impl Send {
    /// The request of one call.
    fn request(self) -> Request<Full<Bytes>> {
        let (method, body) = if self.post {
            ("POST", Bytes::from_static(&BODY_1K))
        } else {
            (METHOD, Bytes::new())
        };
        Request::builder()
            .method(method)
            .uri(self.uri)
            .body(Full::new(body))
            .expect("a valid request")
    }
}

/// `iters` requests through `svc`, one after the other, each answered `200` and its body read.
async fn batch<S, RB>(svc: &mut S, send: Send, iters: u64)
where
    S: Service<Request<Full<Bytes>>, Response = Response<RB>>,
    S::Error: std::fmt::Debug,
    RB: Body,
    RB::Error: std::fmt::Debug,
{
    for _ in 0..iters {
        poll_fn(|cx| svc.poll_ready(cx)).await.expect("ready");
        let answer = svc.call(send.request()).await.expect("an answer");
        assert_eq!(answer.status(), http::StatusCode::OK);
        black_box(answer.into_body().collect().await.expect("the body"));
    }
}

/// Times `svc` under `name` in `g`, after a check that it answers.
fn bench<S, RB>(
    g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    rt: &tokio::runtime::Runtime,
    name: &str,
    mut svc: S,
    send: Send,
) where
    S: Service<Request<Full<Bytes>>, Response = Response<RB>>,
    S::Error: std::fmt::Debug,
    RB: Body,
    RB::Error: std::fmt::Debug,
{
    let cpu = cpu_time_mode();
    // Every variant really runs (and succeeds) before it is timed.
    rt.block_on(batch(&mut svc, send, 10));
    g.bench_function(name, |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let t0 = Stopwatch::start(cpu);
                batch(&mut svc, send, iters).await;
                t0.elapsed()
            })
        });
    });
}

/// An HTTP/1.1 server on 127.0.0.1:0, run by `rt`'s thread whenever it waits (inside each
/// `block_on`), that answers every request `200 OK` with an empty body; its URI for [`PATH`].
/// Leaked: the bench's requests go to it until the process ends.
fn loopback_server(rt: &tokio::runtime::Runtime) -> &'static str {
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .expect("a loopback port");
    let addr = listener.local_addr().expect("its address");
    rt.spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let service = hyper::service::service_fn(|_: Request<hyper::body::Incoming>| {
                ready(Ok::<_, Infallible>(Response::new(Full::new(Bytes::new()))))
            });
            tokio::spawn(http1::Builder::new().serve_connection(TokioIo::new(stream), service));
        }
    });
    format!("http://{addr}{PATH}").leak()
}

fn layer(c: &mut Criterion) {
    // The `call` bench's runtime, with the I/O driver too (the loopback series need it).
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a current-thread runtime");
    let agent = agent();
    let ep = agent.endpoint(HOT);
    assert_eq!(
        PATH, "/v1/items/12345",
        "URI holds the path the policy matches"
    );
    let get = Send {
        post: false,
        uri: URI,
    };
    let post = Send {
        post: true,
        uri: URI,
    };
    let mut g = c.benchmark_group("layer");
    bench(&mut g, &rt, "bare_get", Upstream, get);
    bench(
        &mut g,
        &rt,
        "tower_retry_get",
        tower::retry::Retry::new(TowerPolicy, Upstream),
        get,
    );
    bench(
        &mut g,
        &rt,
        "retryplane_layer_get",
        RetryLayer::new(ep.clone()).layer(Upstream),
        get,
    );
    bench(
        &mut g,
        &rt,
        "retryplane_layer_dedup_get",
        RetryLayer::new(ep.clone())
            .with_dedup(Dedup::default())
            .layer(Upstream),
        get,
    );
    bench(&mut g, &rt, "bare_post_1k", Upstream, post);
    bench(
        &mut g,
        &rt,
        "retryplane_layer_post_1k",
        RetryLayer::new(ep.clone()).layer(Upstream),
        post,
    );
    let loopback = Send {
        post: false,
        uri: loopback_server(&rt),
    };
    let client =
        Client::builder(TokioExecutor::new()).build::<_, Full<Bytes>>(HttpConnector::new());
    bench(&mut g, &rt, "loopback/hyper_get", client, loopback);
    // The client under the layer sends the layer's replayable body.
    let client = Client::builder(TokioExecutor::new())
        .build::<_, ReplayBody<Full<Bytes>>>(HttpConnector::new());
    bench(
        &mut g,
        &rt,
        "loopback/retryplane_layer_hyper_get",
        RetryLayer::new(ep).layer(client),
        loopback,
    );
    g.finish();
}

criterion_group!(benches, layer);
criterion_main!(benches);
