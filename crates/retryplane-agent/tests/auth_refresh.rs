//! The once-only credential refresh on 401 through the tower layer, against a scripted
//! upstream, under paused tokio time.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::header::{AUTHORIZATION, HeaderValue};
use http::request::Parts;
use http::{Request, Response};
use http_body_util::{Empty, Full};
use retryplane_agent::layer::{
    BoxError, GaveUp, RefreshCredentials, RefreshFailed, ReplayBody, ResponseBody, RetryLayer,
};
use retryplane_agent::{Agent, Cause, GiveUpCause};
use support::{Seen, agent, policy, status_upstream as upstream};
use tokio::time::Instant;
use tower::{Layer as _, ServiceExt as _};

/// A hook that sets `Authorization: Bearer new-<n>` on its n-th call (from 1), fails when
/// told to, or never finishes.
#[derive(Clone, Default)]
struct Hook {
    calls: Arc<AtomicUsize>,
    fail: bool,
    hang: bool,
}

impl RefreshCredentials for Hook {
    async fn refresh(&self, parts: &mut Parts) -> Result<(), BoxError> {
        let n = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        if self.hang {
            std::future::pending::<()>().await;
        }
        if self.fail {
            return Err("the token service said no".into());
        }
        parts.headers.insert(
            AUTHORIZATION,
            HeaderValue::from_str(&format!("Bearer new-{n}"))?,
        );
        Ok(())
    }
}

fn request(method: &str, body: &'static str) -> Request<Full<Bytes>> {
    Request::builder()
        .method(method)
        .uri("http://up/v1/me")
        .header(AUTHORIZATION, "Bearer old")
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap()
}

fn auths(seen: &Seen) -> Vec<String> {
    seen.lock()
        .unwrap()
        .iter()
        .map(|sent| sent.auth.clone())
        .collect()
}

async fn send(
    agent: &Agent,
    hook: &Hook,
    statuses: &[u16],
    req: Request<Full<Bytes>>,
) -> (Response<ResponseBody<Empty<Bytes>>>, Seen) {
    let (svc, seen) = upstream(statuses);
    let client = RetryLayer::new(agent.endpoint("ep"))
        .with_auth_refresh(hook.clone())
        .layer(svc);
    (client.oneshot(req).await.unwrap(), seen)
}

#[tokio::test(start_paused = true)]
async fn a_401_refreshes_once_and_the_request_is_sent_again_with_the_new_credentials() {
    let agent = agent(&policy("max_attempts: 3"));
    let hook = Hook::default();
    let started = Instant::now();
    let (response, seen) = send(&agent, &hook, &[401], request("PUT", "data")).await;
    assert_eq!(response.status(), 200);
    assert!(response.extensions().get::<GaveUp>().is_none());
    assert_eq!(hook.calls.load(Ordering::SeqCst), 1);
    assert_eq!(auths(&seen), ["Bearer old", "Bearer new-1"]);
    // The body is sent again, whole; no pause before the second send.
    assert!(seen.lock().unwrap().iter().all(|sent| sent.body == "data"));
    assert_eq!(started.elapsed(), Duration::ZERO);
    // One attempt, no retry, in the counters.
    let counts = agent.endpoint("ep").pending_counts();
    assert_eq!((counts.calls, counts.attempts, counts.retries), (1, 1, 0));
    assert_eq!(counts.success_first_try, 1);
}

#[tokio::test(start_paused = true)]
async fn a_second_401_is_returned_without_a_third_send() {
    let agent = agent(&policy("max_attempts: 3"));
    let hook = Hook::default();
    let (response, seen) = send(&agent, &hook, &[401, 401, 401], request("GET", "")).await;
    assert_eq!(response.status(), 401);
    assert_eq!(
        response.extensions().get::<GaveUp>(),
        Some(&GaveUp {
            cause: Cause::GaveUp(GiveUpCause::NotRetryable),
            attempts: 1
        })
    );
    assert!(response.extensions().get::<RefreshFailed>().is_none());
    assert_eq!(hook.calls.load(Ordering::SeqCst), 1);
    assert_eq!(auths(&seen), ["Bearer old", "Bearer new-1"]);
}

#[tokio::test(start_paused = true)]
async fn later_attempts_keep_the_refreshed_credentials_and_the_hook_runs_once() {
    let agent = agent(&policy("max_attempts: 3"));
    let hook = Hook::default();
    // 401 → refresh → 503 → (100ms) retry → 401: judged by the policy, returned.
    let started = Instant::now();
    let (response, seen) = send(&agent, &hook, &[401, 503, 401], request("GET", "")).await;
    assert_eq!(response.status(), 401);
    assert_eq!(hook.calls.load(Ordering::SeqCst), 1);
    assert_eq!(auths(&seen), ["Bearer old", "Bearer new-1", "Bearer new-1"]);
    assert_eq!(started.elapsed(), Duration::from_millis(100));
    assert_eq!(response.extensions().get::<GaveUp>().unwrap().attempts, 2);

    // 503 → retry → 401 → refresh → 200: the refresh may come on a later attempt.
    let (response, seen) = send(&agent, &hook, &[503, 401], request("GET", "")).await;
    assert_eq!(response.status(), 200);
    assert_eq!(hook.calls.load(Ordering::SeqCst), 2);
    assert_eq!(auths(&seen), ["Bearer old", "Bearer old", "Bearer new-2"]);
}

#[tokio::test(start_paused = true)]
async fn the_second_send_is_one_more_than_max_attempts_allows() {
    let agent = agent(&policy("max_attempts: 1"));
    let hook = Hook::default();
    let (response, seen) = send(&agent, &hook, &[401], request("GET", "")).await;
    assert_eq!(response.status(), 200);
    assert_eq!(seen.lock().unwrap().len(), 2);

    // With attempts left, the second send does not use one of them: 401, 503, 503, 200.
    let agent = support::agent(&policy("max_attempts: 3"));
    let (response, seen) = send(&agent, &hook, &[401, 503, 503], request("GET", "")).await;
    assert_eq!(response.status(), 200);
    assert_eq!(seen.lock().unwrap().len(), 4);
}

#[tokio::test(start_paused = true)]
async fn a_failing_hook_leaves_the_401_with_its_error() {
    let agent = agent(&policy("max_attempts: 3"));
    let hook = Hook {
        fail: true,
        ..Hook::default()
    };
    let (response, seen) = send(&agent, &hook, &[401], request("GET", "")).await;
    assert_eq!(response.status(), 401);
    let failed = response.extensions().get::<RefreshFailed>().unwrap();
    assert_eq!(failed.0.to_string(), "the token service said no");
    assert_eq!(hook.calls.load(Ordering::SeqCst), 1);
    assert_eq!(auths(&seen), ["Bearer old"]);
}

#[tokio::test(start_paused = true)]
async fn a_hook_that_never_finishes_is_cut_at_the_deadline() {
    let agent = agent(&policy("max_attempts: 3\ndeadline: 3s"));
    let hook = Hook {
        hang: true,
        ..Hook::default()
    };
    let started = Instant::now();
    let (response, seen) = send(&agent, &hook, &[401], request("GET", "")).await;
    assert_eq!(response.status(), 401);
    assert_eq!(started.elapsed(), Duration::from_secs(3));
    assert_eq!(seen.lock().unwrap().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn other_statuses_never_call_the_hook() {
    let agent = agent(&policy("max_attempts: 3"));
    let hook = Hook::default();
    let (response, seen) = send(&agent, &hook, &[403], request("GET", "")).await;
    assert_eq!(response.status(), 403);
    assert_eq!(seen.lock().unwrap().len(), 1);
    let (response, seen) = send(&agent, &hook, &[200], request("GET", "")).await;
    assert_eq!(response.status(), 200);
    assert_eq!(seen.lock().unwrap().len(), 1);
    let (response, seen) = send(&agent, &hook, &[503, 200], request("GET", "")).await;
    assert_eq!(response.status(), 200);
    assert_eq!(seen.lock().unwrap().len(), 2);
    assert_eq!(hook.calls.load(Ordering::SeqCst), 0);
}

#[tokio::test(start_paused = true)]
async fn a_body_over_the_limit_is_not_sent_again() {
    let agent = agent(&policy("max_attempts: 3"));
    let hook = Hook::default();
    let (svc, seen) = upstream(&[401]);
    let client = RetryLayer::new(agent.endpoint("ep"))
        .with_body_limit(2)
        .with_auth_refresh(hook.clone())
        .layer(svc);
    let response = client.oneshot(request("GET", "long")).await.unwrap();
    assert_eq!(response.status(), 401);
    assert_eq!(hook.calls.load(Ordering::SeqCst), 0);
    assert_eq!(auths(&seen), ["Bearer old"]);
}

#[tokio::test(start_paused = true)]
async fn without_a_hook_a_401_is_returned_as_it_is() {
    let agent = agent(&policy("max_attempts: 3"));
    let (svc, seen) = upstream(&[401]);
    let client = RetryLayer::new(agent.endpoint("ep")).layer(svc);
    let response = client.oneshot(request("GET", "")).await.unwrap();
    assert_eq!(response.status(), 401);
    assert_eq!(seen.lock().unwrap().len(), 1);
}

type Boxed = tower::util::BoxCloneSyncService<
    Request<retryplane_agent::layer::ReplayBody<Full<Bytes>>>,
    Response<Empty<Bytes>>,
    std::convert::Infallible,
>;
type Limited = tower::limit::ConcurrencyLimit<Boxed>;
/// Each request's path and when it arrived (from the upstream's creation).
type Arrivals = Arc<std::sync::Mutex<Vec<(String, Duration)>>>;

/// An upstream, bare and behind one permit: `/slow` answers 200 after `slow`, `/fail` 503,
/// any other path 401 to `Bearer old` and 200 otherwise.
fn permit_upstream(slow: Duration) -> (Boxed, Limited, Arrivals) {
    let arrivals = Arrivals::default();
    let log = arrivals.clone();
    let origin = Instant::now();
    let svc = tower::service_fn(move |req: Request<ReplayBody<Full<Bytes>>>| {
        let path = req.uri().path().to_owned();
        let old = req
            .headers()
            .get(AUTHORIZATION)
            .is_some_and(|v| v == "Bearer old");
        log.lock().unwrap().push((path.clone(), origin.elapsed()));
        async move {
            let status = match path.as_str() {
                "/slow" => {
                    tokio::time::sleep(slow).await;
                    200
                }
                "/fail" => 503,
                _ if old => 401,
                _ => 200,
            };
            let response = Response::builder()
                .status(status)
                .body(Empty::<Bytes>::new())
                .unwrap();
            Ok::<_, std::convert::Infallible>(response)
        }
    });
    let boxed = Boxed::new(svc);
    let limited = tower::limit::ConcurrencyLimit::new(boxed.clone(), 1);
    (boxed, limited, arrivals)
}

/// A hook that, while it refreshes, has a slow call of another endpoint (`other`) take the
/// only permit below and waits until it arrives; then, if given `fail`, fails a call of the
/// same endpoint through it (two 503s: the breaker opens); then sets `Bearer new`.
#[derive(Clone)]
struct TakesThePermit {
    other: retryplane_agent::layer::Retry<Limited>,
    fail: Option<retryplane_agent::layer::Retry<Boxed>>,
    arrivals: Arrivals,
}

impl RefreshCredentials for TakesThePermit {
    async fn refresh(&self, parts: &mut Parts) -> Result<(), BoxError> {
        let slow = Request::post("http://up/slow")
            .body(Full::new(Bytes::new()))
            .unwrap();
        tokio::spawn(self.other.clone().oneshot(slow));
        for _ in 0..10_000 {
            if self.arrivals.lock().unwrap().len() == 2 {
                break;
            }
            tokio::task::yield_now().await;
        }
        if let Some(fail) = &self.fail {
            let fail_req = Request::put("http://up/fail")
                .body(Full::new(Bytes::new()))
                .unwrap();
            let failed = fail.clone().oneshot(fail_req).await?;
            assert_eq!(failed.status(), 503);
        }
        parts
            .headers
            .insert(AUTHORIZATION, HeaderValue::from_static("Bearer new"));
        Ok(())
    }
}

#[tokio::test(start_paused = true)]
async fn the_resend_waits_for_capacity_below_outside_its_per_try_timeout() {
    // One permit below. The first send gets a 401; while the hook refreshes, a slow call
    // (800 ms, another endpoint) takes the permit. The resend waits 800 ms for it: the call's
    // wait, not the resend's 500 ms per-try timeout, so it is sent and answered.
    let (_, limited, arrivals) = permit_upstream(Duration::from_millis(800));
    let agent = agent(&policy(
        "max_attempts: 1\ndeadline: 10s\nper_try_timeout: 500ms",
    ));
    // The slow call's endpoint has the defaults: a 2 s per-try timeout.
    let hook = TakesThePermit {
        other: RetryLayer::new(agent.endpoint("other")).layer(limited.clone()),
        fail: None,
        arrivals: arrivals.clone(),
    };
    let client = RetryLayer::new(agent.endpoint("ep"))
        .with_auth_refresh(hook)
        .layer(limited);
    let response =
        tokio::time::timeout(Duration::from_secs(30), client.oneshot(request("GET", "")))
            .await
            .expect("ends")
            .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(
        *arrivals.lock().unwrap(),
        [
            ("/v1/me".to_owned(), Duration::ZERO),
            ("/slow".to_owned(), Duration::ZERO),
            ("/v1/me".to_owned(), Duration::from_millis(800)),
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn a_resend_waiting_for_capacity_is_not_sent_once_the_breaker_opens() {
    // One permit below. The first send gets a 401; while the hook refreshes, a slow call of
    // another endpoint takes the permit and other calls open `ep`'s breaker. The resend would
    // go to an upstream the breaker cut off: it is not sent, and the 401 stands.
    let (boxed, limited, arrivals) = permit_upstream(Duration::from_millis(1500));
    let agent = agent(&policy(
        "max_attempts: 2\ndeadline: 10s\nper_try_timeout: 5s\ncircuit_breaker: {enabled: true, failure_ratio: 0.5, min_requests: 2, open_for: 30s}",
    ));
    let hook = TakesThePermit {
        other: RetryLayer::new(agent.endpoint("other")).layer(limited.clone()),
        fail: Some(RetryLayer::new(agent.endpoint("ep")).layer(boxed)),
        arrivals: arrivals.clone(),
    };
    let client = RetryLayer::new(agent.endpoint("ep"))
        .with_auth_refresh(hook)
        .layer(limited);
    let began = Instant::now();
    let response =
        tokio::time::timeout(Duration::from_secs(30), client.oneshot(request("GET", "")))
            .await
            .expect("ends")
            .unwrap();
    assert_eq!(response.status(), 401);
    assert!(
        began.elapsed() < Duration::from_millis(1500),
        "{:?}",
        began.elapsed()
    );
    let paths: Vec<_> = arrivals
        .lock()
        .unwrap()
        .iter()
        .map(|(p, _)| p.clone())
        .collect();
    assert_eq!(paths, ["/v1/me", "/slow", "/fail", "/fail"]);
}

#[tokio::test(start_paused = true)]
async fn a_half_open_probe_answered_401_is_sent_again_with_fresh_credentials() {
    // The breaker opened, then went half-open with one probe. The probe's first send gets a
    // 401: the resend belongs to the same attempt and its permit, so the probe itself does not
    // hold it back; it is sent with the fresh credentials and answered 200.
    let agent = agent(&policy(
        "max_attempts: 1\ncircuit_breaker: {enabled: true, failure_ratio: 0.5, min_requests: 2, open_for: 1s, half_open_probes: 1}",
    ));
    let hook = Hook::default();
    let (svc, seen) = upstream(&[503, 503, 401]);
    let client = RetryLayer::new(agent.endpoint("ep"))
        .with_auth_refresh(hook.clone())
        .layer(svc);
    for _ in 0..2 {
        let failed = client.clone().oneshot(request("GET", "")).await.unwrap();
        assert_eq!(failed.status(), 503);
    }
    tokio::time::advance(Duration::from_millis(1001)).await;
    let response = client.oneshot(request("GET", "")).await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(hook.calls.load(Ordering::SeqCst), 1);
    assert_eq!(
        auths(&seen),
        ["Bearer old", "Bearer old", "Bearer old", "Bearer new-1"]
    );
}

/// An upstream of gRPC answers: `UNAUTHENTICATED` in the head ("Trailers-Only", HTTP 200) to
/// a request without `Bearer new-1`, `OK` to one with it; counts the sends.
fn grpc_upstream() -> (Boxed, Arc<AtomicUsize>) {
    let sends = Arc::new(AtomicUsize::new(0));
    let counted = sends.clone();
    let svc = tower::service_fn(move |req: Request<ReplayBody<Full<Bytes>>>| {
        counted.fetch_add(1, Ordering::SeqCst);
        let fresh = req
            .headers()
            .get(AUTHORIZATION)
            .is_some_and(|v| v == "Bearer new-1");
        async move {
            let response = Response::builder()
                .header("content-type", "application/grpc")
                .header("grpc-status", if fresh { "0" } else { "16" })
                .body(Empty::<Bytes>::new())
                .unwrap();
            Ok::<_, std::convert::Infallible>(response)
        }
    });
    (Boxed::new(svc), sends)
}

fn grpc_request() -> Request<Full<Bytes>> {
    Request::post("http://up/pkg.Users/Me")
        .header("content-type", "application/grpc")
        .header(AUTHORIZATION, "Bearer old")
        .body(Full::new(Bytes::from_static(b"\0\0\0\0\0")))
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn a_grpc_unauthenticated_answer_refreshes_once_and_the_call_is_sent_again() {
    // A gRPC server answers an expired token with `UNAUTHENTICATED` in an HTTP 200, never a
    // 401: the hook runs for it as for a 401.
    let agent = agent(&policy("max_attempts: 3"));
    let hook = Hook::default();
    let (svc, sends) = grpc_upstream();
    let client = RetryLayer::new(agent.endpoint("ep"))
        .with_auth_refresh(hook.clone())
        .layer(svc);
    let response = client.oneshot(grpc_request()).await.unwrap();
    assert_eq!(response.headers()["grpc-status"], "0");
    assert_eq!(hook.calls.load(Ordering::SeqCst), 1);
    assert_eq!(sends.load(Ordering::SeqCst), 2);
    let counts = agent.endpoint("ep").pending_counts();
    assert_eq!((counts.attempts, counts.success_first_try), (1, 1));
}

#[tokio::test(start_paused = true)]
async fn a_failing_hook_leaves_the_grpc_unauthenticated_answer_with_its_error() {
    let agent = agent(&policy("max_attempts: 3"));
    let hook = Hook {
        fail: true,
        ..Hook::default()
    };
    let (svc, sends) = grpc_upstream();
    let client = RetryLayer::new(agent.endpoint("ep"))
        .with_auth_refresh(hook.clone())
        .layer(svc);
    let response = client.oneshot(grpc_request()).await.unwrap();
    assert_eq!(response.headers()["grpc-status"], "16");
    assert!(response.extensions().get::<RefreshFailed>().is_some());
    assert_eq!(sends.load(Ordering::SeqCst), 1);
}

/// A body of trailers only.
struct TrailersOnly(Option<http::HeaderMap>);

impl http_body::Body for TrailersOnly {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        std::task::Poll::Ready(self.0.take().map(|t| Ok(http_body::Frame::trailers(t))))
    }
}

/// `UNAUTHENTICATED` in trailers right after the head (a 200 with no message; what a tonic
/// server stream whose first item is that error sends) refreshes as one in the head does.
#[tokio::test(start_paused = true)]
async fn a_grpc_unauthenticated_in_trailers_right_after_the_head_refreshes_once() {
    let agent = agent(&policy("max_attempts: 3"));
    let hook = Hook::default();
    let sends = Arc::new(AtomicUsize::new(0));
    let counted = sends.clone();
    let svc = tower::service_fn(move |req: Request<ReplayBody<Full<Bytes>>>| {
        counted.fetch_add(1, Ordering::SeqCst);
        let fresh = req
            .headers()
            .get(AUTHORIZATION)
            .is_some_and(|v| v == "Bearer new-1");
        async move {
            let mut trailers = http::HeaderMap::new();
            trailers.insert(
                "grpc-status",
                HeaderValue::from_static(if fresh { "0" } else { "16" }),
            );
            let response = Response::builder()
                .header("content-type", "application/grpc")
                .body(TrailersOnly(Some(trailers)))
                .unwrap();
            Ok::<_, std::convert::Infallible>(response)
        }
    });
    let client = RetryLayer::new(agent.endpoint("ep"))
        .with_auth_refresh(hook.clone())
        .layer(svc);
    let response = client.oneshot(grpc_request()).await.unwrap();
    let trailers = http_body_util::BodyExt::collect(response.into_body())
        .await
        .unwrap()
        .trailers()
        .cloned()
        .unwrap();
    assert_eq!(trailers["grpc-status"], "0");
    assert_eq!(hook.calls.load(Ordering::SeqCst), 1);
    assert_eq!(sends.load(Ordering::SeqCst), 2);
    let counts = agent.endpoint("ep").pending_counts();
    assert_eq!((counts.attempts, counts.success_first_try), (1, 1));
}
