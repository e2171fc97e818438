//! A failed attempt's answer through the tower layer, around a hyper-util legacy client
//! (HTTP/1) and a real hyper server on 127.0.0.1:0: its body is read before the pause, so the
//! connection goes back to the client's pool and the retry reuses it, and the caller still
//! gets every byte of the answer it is handed.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body::Frame;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt as _, Full, StreamBody};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use retryplane_agent::Agent;
use retryplane_agent::layer::{BoxError, GaveUp, RefreshCredentials, ResponseBody, RetryLayer};
use tokio::net::TcpListener;
use tower::{Layer as _, ServiceExt as _};

/// The longest any single wait may take before the test fails.
const WAIT: Duration = Duration::from_secs(10);

/// What the server counted: connections accepted and requests answered.
#[derive(Clone, Default)]
struct Counts {
    connections: Arc<AtomicU32>,
    requests: Arc<AtomicU32>,
}

/// The body the test servers answer with.
type TestBody = BoxBody<Bytes, Infallible>;

/// An HTTP/1.1 server on 127.0.0.1:0 whose `n`th request (from 0) gets `respond(n)`; each
/// connection keeps alive.
async fn serve<F>(respond: F) -> (String, Counts)
where
    F: Fn(u32) -> http::Response<TestBody> + Clone + Send + Sync + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1/items", listener.local_addr().unwrap());
    let counts = Counts::default();
    let c = counts.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            c.connections.fetch_add(1, Ordering::SeqCst);
            let requests = c.requests.clone();
            let respond = respond.clone();
            let service = service_fn(move |_req: http::Request<hyper::body::Incoming>| {
                let response = respond(requests.fetch_add(1, Ordering::SeqCst));
                async move { Ok::<_, Infallible>(response) }
            });
            tokio::spawn(http1::Builder::new().serve_connection(TokioIo::new(stream), service));
        }
    });
    (url, counts)
}

/// A server that answers its first `failures` requests `503` with a body of `failure_len`
/// bytes (`x` repeated), then `200 ok`.
async fn server(failures: u32, failure_len: usize) -> (String, Counts) {
    serve(move |n| {
        let (status, body) = if n < failures {
            (503, Bytes::from(vec![b'x'; failure_len]))
        } else {
            (200, Bytes::from_static(b"ok"))
        };
        let body = Full::new(body).boxed();
        http::Response::builder().status(status).body(body).unwrap()
    })
    .await
}

/// Three attempts, short fixed pauses, no budget or breaker.
fn agent() -> Agent {
    support::agent(&support::policy(
        "max_attempts: 3\nbackoff: {base: 5ms, max: 20ms, multiplier: 2.0, jitter: none}",
    ))
}

/// A `method` request to `url` with no body, through `layer` around a legacy HTTP/1 client:
/// its answer, body unread.
async fn send(
    layer: RetryLayer,
    method: &str,
    url: &str,
) -> http::Response<ResponseBody<hyper::body::Incoming>> {
    let client = Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let request = http::Request::builder()
        .method(method)
        .uri(url)
        .body(Full::<Bytes>::default())
        .unwrap();
    tokio::time::timeout(WAIT, layer.layer(client).oneshot(request))
        .await
        .expect("the call ends")
        .expect("an answer")
}

/// A GET of `url` through the layer around a legacy HTTP/1 client: the response and its body.
async fn get(agent: &Agent, url: &str) -> (http::Response<()>, Bytes) {
    let response = send(RetryLayer::new(agent.endpoint("ep")), "GET", url).await;
    let (parts, body) = response.into_parts();
    let body = tokio::time::timeout(WAIT, body.collect())
        .await
        .expect("the body ends")
        .expect("the body reads")
        .to_bytes();
    (http::Response::from_parts(parts, ()), body)
}

#[tokio::test]
async fn a_retry_reuses_the_connection_of_the_failed_attempt() {
    // Before, the 503 was kept through the pause with its body unread, so its connection
    // could not go back to the pool: each retry opened a new connection (3 here), and the old
    // one was closed when the answer was dropped. (hyper frees the connection of a body that
    // came whole with the head by itself; one of 32 KiB does not.)
    let (url, counts) = server(2, 32 * 1024).await;
    let agent = agent();
    let (response, body) = get(&agent, &url).await;
    assert_eq!(response.status(), 200);
    assert_eq!(body, "ok");
    assert_eq!(counts.requests.load(Ordering::SeqCst), 3);
    assert_eq!(counts.connections.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_call_that_gives_up_returns_the_whole_body_of_its_last_answer() {
    // Read into memory (small) or partly read and then streamed (over the layer's 64 KiB):
    // the caller gets every byte either way.
    for len in [32 * 1024, 200 * 1024] {
        let (url, counts) = server(3, len).await;
        let agent = agent();
        let (response, body) = get(&agent, &url).await;
        assert_eq!(response.status(), 503, "{len}");
        assert_eq!(response.extensions().get::<GaveUp>().unwrap().attempts, 3);
        assert_eq!(body.len(), len);
        assert!(body.iter().all(|&b| b == b'x'));
        assert_eq!(counts.requests.load(Ordering::SeqCst), 3);
        if len == 32 * 1024 {
            assert_eq!(counts.connections.load(Ordering::SeqCst), 1, "{len}");
        }
    }
}

/// A server that answers every request `status` with 5 bytes of body and then a body that
/// never ends, with a `Retry-After` of `retry_after` if given.
async fn stalled_server(status: u16, retry_after: Option<&'static str>) -> (String, Counts) {
    serve(move |_| {
        let first = tokio_stream::once(Ok(Frame::data(Bytes::from_static(b"hello"))));
        let body = StreamBody::new(tokio_stream::StreamExt::chain(
            first,
            tokio_stream::pending(),
        ));
        let mut response = http::Response::builder().status(status);
        if let Some(hint) = retry_after {
            response = response.header(http::header::RETRY_AFTER, hint);
        }
        response.body(body.boxed()).unwrap()
    })
    .await
}

#[tokio::test]
async fn a_failed_answer_that_will_be_returned_is_handed_over_unread() {
    // Reading it would only delay it: its last attempt (`max_attempts: 1`), a call whose
    // answers are never sent again (a POST without the idempotency key), a status the
    // policy does not retry (404), or a `Retry-After` longer than the policy waits for. A
    // body read in part would show in the size hint (the 5 bytes read first).
    let hint_max = "max_attempts: 3\nretry_after: {honor: true, max: 1s}";
    for (yaml, method, status, retry_after) in [
        ("max_attempts: 1", "GET", 503, None),
        ("max_attempts: 3", "POST", 503, None),
        ("max_attempts: 3", "GET", 404, None),
        (hint_max, "GET", 429, Some("60")),
        (hint_max, "GET", 503, Some("Wed, 21 Oct 2099 07:28:00 GMT")),
    ] {
        let (url, counts) = stalled_server(status, retry_after).await;
        let agent = support::agent(&support::policy(yaml));
        let response = send(RetryLayer::new(agent.endpoint("ep")), method, &url).await;
        assert_eq!(response.status(), status);
        let hint = http_body::Body::size_hint(response.body());
        assert_eq!(hint.lower(), 0, "{yaml} {method}");
        assert_eq!(counts.requests.load(Ordering::SeqCst), 1);
    }
}

/// A credential refresh that always works.
struct Fresh;

impl RefreshCredentials for Fresh {
    async fn refresh(&self, parts: &mut http::request::Parts) -> Result<(), BoxError> {
        let value = http::HeaderValue::from_static("Bearer new");
        parts.headers.insert(http::header::AUTHORIZATION, value);
        Ok(())
    }
}

#[tokio::test]
async fn a_401_sent_again_after_a_credential_refresh_reuses_its_connection() {
    // The refresh hook sends a 401 again whatever the method or the attempt: its body is read
    // as a retried answer's is.
    for (method, yaml) in [("POST", "max_attempts: 3"), ("GET", "max_attempts: 1")] {
        let (url, counts) = serve(|n| {
            let (status, body) = match n {
                0 => (401, Bytes::from(vec![b'x'; 32 * 1024])),
                _ => (200, Bytes::from_static(b"ok")),
            };
            let body = Full::new(body).boxed();
            http::Response::builder().status(status).body(body).unwrap()
        })
        .await;
        let agent = support::agent(&support::policy(yaml));
        let layer = RetryLayer::new(agent.endpoint("ep")).with_auth_refresh(Fresh);
        let response = send(layer, method, &url).await;
        assert_eq!(response.status(), 200);
        assert_eq!(counts.requests.load(Ordering::SeqCst), 2);
        assert_eq!(
            counts.connections.load(Ordering::SeqCst),
            1,
            "{method} {yaml}"
        );
    }
}

#[tokio::test]
async fn a_second_401_after_the_refresh_is_handed_over_unread() {
    // The hook runs once per call: the first 401's body is read (the request is sent again),
    // the second one's is not, since nothing will send it again. A body read in part would
    // show in the size hint (the 5 bytes read first).
    let (url, counts) = stalled_server(401, None).await;
    let agent = support::agent(&support::policy("max_attempts: 3"));
    let layer = RetryLayer::new(agent.endpoint("ep")).with_auth_refresh(Fresh);
    let response = send(layer, "GET", &url).await;
    assert_eq!(response.status(), 401);
    assert_eq!(http_body::Body::size_hint(response.body()).lower(), 0);
    assert_eq!(counts.requests.load(Ordering::SeqCst), 2);
}

/// The body `busy`, in two parts: `bu` at once, `sy` `gap` later.
fn two_parts(gap: Duration) -> TestBody {
    let (tx, rx) = tokio::sync::mpsc::channel(2);
    tokio::spawn(async move {
        let _ = tx.send(Ok(Frame::data(Bytes::from_static(b"bu")))).await;
        tokio::time::sleep(gap).await;
        let _ = tx.send(Ok(Frame::data(Bytes::from_static(b"sy")))).await;
    });
    StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx)).boxed()
}

/// A server whose first `failures` answers are `503` with a body of two parts, the second
/// `gap` after the head (an error body behind a slow upstream, or a delayed ACK), then
/// `200 ok`.
async fn late_body_server(failures: u32, gap: Duration) -> (String, Counts) {
    serve(move |n| {
        if n >= failures {
            let body = Full::new(Bytes::from_static(b"ok")).boxed();
            return http::Response::builder().status(200).body(body).unwrap();
        }
        http::Response::builder()
            .status(503)
            .body(two_parts(gap))
            .unwrap()
    })
    .await
}

#[tokio::test]
async fn a_failed_answer_whose_body_ends_after_the_attempt_is_read_in_the_pause() {
    // The body's end comes 150 ms after its head, after the attempt's 20 ms read of it, and
    // within the 500 ms pause (with room either side for a loaded machine): read then, it
    // frees the connection for the retry. (Before, it was kept unread through the pause and
    // each retry opened a new connection.)
    let (url, counts) = late_body_server(2, Duration::from_millis(150)).await;
    let agent = support::agent(&support::policy(
        "max_attempts: 3\nbackoff: {base: 500ms, max: 500ms, jitter: none}",
    ));
    let (response, body) = get(&agent, &url).await;
    assert_eq!(response.status(), 200);
    assert_eq!(body, "ok");
    assert_eq!(counts.requests.load(Ordering::SeqCst), 3);
    assert_eq!(counts.connections.load(Ordering::SeqCst), 1);
}

/// An HTTP/2 server on 127.0.0.1:0 that takes one stream at a time, whose first answer is a
/// `503` whose body stops after 2 bytes for 5 s, then `200 ok`.
async fn one_stream_h2_server() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1/items", listener.local_addr().unwrap());
    let requests = Arc::new(AtomicU32::new(0));
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let requests = requests.clone();
            let service = service_fn(move |_req: http::Request<hyper::body::Incoming>| {
                let response = if requests.fetch_add(1, Ordering::SeqCst) == 0 {
                    let body = two_parts(Duration::from_secs(5));
                    http::Response::builder().status(503).body(body)
                } else {
                    let body = Full::new(Bytes::from_static(b"ok")).boxed();
                    http::Response::builder().status(200).body(body)
                };
                async move { Ok::<_, Infallible>(response.unwrap()) }
            });
            tokio::spawn(
                hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .max_concurrent_streams(1)
                    .serve_connection(TokioIo::new(stream), service),
            );
        }
    });
    url
}

#[tokio::test]
async fn over_http2_the_kept_answer_does_not_hold_the_stream_its_retry_needs() {
    // The retry goes out once the answer's body is let go: it gets the server's only stream
    // and is answered. (Before, the kept 503 held that stream through the retry, which timed
    // out waiting for it: two attempts, and the call failed.)
    let url = one_stream_h2_server().await;
    let agent = support::agent(&support::policy(
        "max_attempts: 2\nper_try_timeout: 1s\nbackoff: {base: 10ms, max: 10ms, jitter: none}",
    ));
    let client = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build(HttpConnector::new());
    let request = http::Request::builder()
        .uri(&url)
        .body(Full::<Bytes>::default())
        .unwrap();
    let layer = RetryLayer::new(agent.endpoint("ep")).layer(client);
    let response = tokio::time::timeout(WAIT, layer.oneshot(request))
        .await
        .expect("the call ends")
        .expect("an answer");
    assert_eq!(response.status(), 200);
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "ok");
}
