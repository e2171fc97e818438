//! The answer to a gRPC request through the tower layer is judged as tonic's client reads it,
//! so that a call counts the same through the layer as through `Endpoint::call` with a
//! generated client: a `grpc-status` in the head whatever the content type, and a proxy's
//! HTTP status mapped to the gRPC code tonic gives it (judged by `retry_on.grpc_status`).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::convert::Infallible;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use retryplane_agent::layer::{Idempotent, ReplayBody, RetryLayer};
use support::{agent, policy};
use tower::{Layer as _, ServiceExt as _, service_fn};

/// A unary gRPC request, declared idempotent.
fn grpc_request() -> Request<Full<Bytes>> {
    let mut request = Request::post("http://up/pkg.Svc/Get")
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(Full::new(Bytes::from_static(b"\0\0\0\0\0")))
        .unwrap();
    request.extensions_mut().insert(Idempotent(true));
    request
}

/// Calls `policy_lines` through the layer over an upstream answering every attempt with
/// `answer()`; returns how many attempts it made.
async fn attempts(policy_lines: &str, answer: fn() -> Response<Full<Bytes>>) -> u32 {
    let agent = agent(&policy(policy_lines));
    let seen = Arc::new(Mutex::new(0_u32));
    let counted = seen.clone();
    let svc = service_fn(move |_req: Request<ReplayBody<Full<Bytes>>>| {
        *counted.lock().unwrap() += 1;
        async move { Ok::<_, Infallible>(answer()) }
    });
    let client = RetryLayer::new(agent.endpoint("ep")).layer(svc);
    let _ = client.oneshot(grpc_request()).await;
    let n = *seen.lock().unwrap();
    assert_eq!(agent.endpoint("ep").pending_counts().attempts, u64::from(n));
    n
}

fn proxy(status: u16) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header("content-type", "text/html")
        .body(Full::new(Bytes::from_static(b"<html>bad gateway</html>")))
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn a_proxys_http_status_is_judged_by_the_grpc_code_tonic_maps_it_to() {
    // 500 is `UNKNOWN` for a gRPC client: not retried by default, although `http_status`
    // lists 500.
    assert_eq!(attempts("max_attempts: 3", || proxy(500)).await, 1);
    // 503 is `UNAVAILABLE`: retried by `grpc_status`, although `http_status` does not list it.
    let lines = "max_attempts: 3\nretry_on: {grpc_status: [UNAVAILABLE], http_status: [429]}";
    assert_eq!(attempts(lines, || proxy(503)).await, 3);
    // And without `UNAVAILABLE` in `grpc_status`, a 503 is not retried.
    let lines =
        "max_attempts: 3\nretry_on: {grpc_status: [RESOURCE_EXHAUSTED], http_status: [503]}";
    assert_eq!(attempts(lines, || proxy(503)).await, 1);
}

#[tokio::test(start_paused = true)]
async fn a_grpc_status_in_the_head_counts_whatever_the_content_type() {
    let answer = || {
        Response::builder()
            .header("content-type", "application/octet-stream")
            .header("grpc-status", "14")
            .body(Full::new(Bytes::new()))
            .unwrap()
    };
    assert_eq!(attempts("max_attempts: 3", answer).await, 3);
}

#[tokio::test(start_paused = true)]
async fn an_http_answer_to_an_http_request_is_still_judged_by_its_status() {
    // The same 500 to a plain HTTP request: `http_status` lists it.
    let agent = agent(&policy("max_attempts: 3"));
    let seen = Arc::new(Mutex::new(0_u32));
    let counted = seen.clone();
    let svc = service_fn(move |_req: Request<ReplayBody<Full<Bytes>>>| {
        *counted.lock().unwrap() += 1;
        async move { Ok::<_, Infallible>(proxy(500)) }
    });
    let client = RetryLayer::new(agent.endpoint("ep")).layer(svc);
    let request = Request::get("http://up/v1/things")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let response = client.oneshot(request).await.unwrap();
    assert_eq!(response.status(), 500);
    assert_eq!(*seen.lock().unwrap(), 3);
}
