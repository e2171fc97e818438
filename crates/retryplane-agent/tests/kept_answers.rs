//! The failed answer a call keeps between attempts, through the tower layer around one HTTP/1
//! connection (hyper's `SendRequest`, ready only once the previous answer's body is read to
//! its end) and a real hyper server on 127.0.0.1:0: the kept answer's body, read on while the
//! call waits (its pause, the wait for the connection, a credential refresh), frees the
//! connection the next send needs; and a call that ends before that send returns every byte.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::Frame;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt as _, Full, StreamBody};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use retryplane_agent::layer::{BoxError, GaveUp, ReplayBody, RetryLayer};
use tokio::net::TcpListener;
use tower::{Layer as _, ServiceExt as _};

/// The longest any single wait may take before the test fails.
const WAIT: Duration = Duration::from_secs(10);

type ReqBody = ReplayBody<Full<Bytes>>;

/// A service over one HTTP/1 connection (hyper's `SendRequest`): ready when the connection
/// can take a request, i.e. once the previous response's body has been read to its end.
#[derive(Clone)]
struct OneConnection(Arc<Mutex<hyper::client::conn::http1::SendRequest<ReqBody>>>);

impl OneConnection {
    /// A new connection to `addr`.
    async fn to(addr: std::net::SocketAddr) -> Self {
        let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .unwrap();
        tokio::spawn(conn);
        Self(Arc::new(Mutex::new(send)))
    }
}

/// `GET http://{addr}/v1/items`, no body.
fn get_items(addr: std::net::SocketAddr) -> http::Request<Full<Bytes>> {
    http::Request::builder()
        .uri(format!("http://{addr}/v1/items"))
        .body(Full::<Bytes>::default())
        .unwrap()
}

impl tower::Service<http::Request<ReqBody>> for OneConnection {
    type Response = http::Response<Incoming>;
    type Error = hyper::Error;
    type Future = Pin<
        Box<
            dyn std::future::Future<Output = Result<http::Response<Incoming>, hyper::Error>> + Send,
        >,
    >;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), hyper::Error>> {
        self.0.lock().unwrap().poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<ReqBody>) -> Self::Future {
        let sent = self.0.lock().unwrap().send_request(request);
        Box::pin(sent)
    }
}

/// The body `parts`, each `gap` after the one before (the first at once).
fn spaced(parts: &'static [&'static str], gap: Duration) -> BoxBody<Bytes, Infallible> {
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tokio::spawn(async move {
        for (i, part) in parts.iter().enumerate() {
            if i > 0 {
                tokio::time::sleep(gap).await;
            }
            if tx
                .send(Ok(Frame::data(Bytes::from_static(part.as_bytes()))))
                .await
                .is_err()
            {
                return;
            }
        }
    });
    StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx)).boxed()
}

/// An HTTP/1.1 server on 127.0.0.1:0 (keep-alive) whose first answer is a `503` with a
/// `content-length` of 8 and a body in four parts 100 ms apart (`bu` at once, the rest
/// after the attempt's read and after the pause), then `200 ok`. Returns the address and the
/// number of requests answered.
async fn slow_503_server() -> (std::net::SocketAddr, Arc<AtomicU32>) {
    slow_first_server(503).await
}

/// [`slow_503_server`] whose first answer has status `status`.
async fn slow_first_server(status: u16) -> (std::net::SocketAddr, Arc<AtomicU32>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let requests = Arc::new(AtomicU32::new(0));
    let r = requests.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let r = r.clone();
            let service = service_fn(move |_req: http::Request<Incoming>| {
                let first = r.fetch_add(1, Ordering::SeqCst) == 0;
                let response = if first {
                    http::Response::builder()
                        .status(status)
                        .header("content-length", "8")
                        .body(spaced(
                            &["bu", "sy", "bu", "sy"],
                            Duration::from_millis(100),
                        ))
                } else {
                    http::Response::builder()
                        .status(200)
                        .body(Full::new(Bytes::from_static(b"ok")).boxed())
                };
                async move { Ok::<_, Infallible>(response.unwrap()) }
            });
            tokio::spawn(
                hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service),
            );
        }
    });
    (addr, requests)
}

#[tokio::test]
async fn a_kept_body_that_ends_after_the_pause_does_not_hold_the_one_connection_the_retry_waits_for()
 {
    // The body of the 503 ends 300 ms after its head: after the attempt's 20 ms read and the
    // 10 ms pause, well within the call's 3 s deadline. The retry waits for the connection
    // (`poll_ready`), which is free once that body is read; nothing reads it while the call
    // waits, so the connection never frees and the call waits out its whole deadline, then
    // returns the 503 with the retry never sent.
    let (addr, requests) = slow_503_server().await;
    let svc = OneConnection::to(addr).await;
    let agent = support::agent(&support::policy(
        "max_attempts: 2\ndeadline: 3s\nper_try_timeout: 1s\nbackoff: {base: 10ms, max: 10ms, jitter: none}",
    ));
    let client = RetryLayer::new(agent.endpoint("ep")).layer(svc);
    let request = get_items(addr);
    let started = tokio::time::Instant::now();
    let response = tokio::time::timeout(WAIT, client.oneshot(request))
        .await
        .expect("the call ends")
        .expect("an answer");
    let took = started.elapsed();
    let gave_up = response.extensions().get::<GaveUp>().cloned();
    let status = response.status();
    let body = tokio::time::timeout(WAIT, response.into_body().collect())
        .await
        .expect("the body ends")
        .map(|c| c.to_bytes());
    assert_eq!(
        (status.as_u16(), requests.load(Ordering::SeqCst)),
        (200, 2),
        "the retry never went out: {status} after {took:?}, {gave_up:?}, body {body:?}"
    );
}

// ---------------------------------------------------------------------------------------------
#[tokio::test]
async fn the_kept_answer_a_deadline_returns_keeps_every_byte_in_order() {
    // 503 whose body is `bu` at once, then 70 KiB of numbered bytes 150 ms later (inside the
    // 300 ms pause, after the attempt's 20 ms read, read on up to 64 KiB there), then `END` 1.5 s later. The call's deadline
    // (800 ms) ends it while it waits for the one connection (the retry never starts, nothing
    // is cut): the caller reads `bu` + 70 KiB + `END`, in order. (Each step has hundreds of
    // milliseconds to spare, for a loaded machine.)
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let big: &'static [u8] = Box::leak(
        (0..70 * 1024)
            .map(|i| (i % 251) as u8)
            .collect::<Vec<u8>>()
            .into_boxed_slice(),
    );
    tokio::spawn(async move {
        let (stream, _) = listener.accept().await.unwrap();
        let service = service_fn(move |_req: http::Request<Incoming>| {
            let (tx, rx) = tokio::sync::mpsc::channel(4);
            tokio::spawn(async move {
                let _ = tx
                    .send(Ok::<_, Infallible>(Frame::data(Bytes::from_static(b"bu"))))
                    .await;
                tokio::time::sleep(Duration::from_millis(150)).await;
                for chunk in big.chunks(8 * 1024) {
                    let _ = tx.send(Ok(Frame::data(Bytes::from_static(chunk)))).await;
                }
                tokio::time::sleep(Duration::from_millis(1_500)).await;
                let _ = tx.send(Ok(Frame::data(Bytes::from_static(b"END")))).await;
            });
            let body = StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx)).boxed();
            async move { Ok::<_, Infallible>(http::Response::builder().status(503).body(body).unwrap()) }
        });
        let _ = hyper::server::conn::http1::Builder::new()
            .serve_connection(TokioIo::new(stream), service)
            .await;
    });
    let svc = OneConnection::to(addr).await;
    let agent = support::agent(&support::policy(
        "max_attempts: 2\ndeadline: 800ms\nper_try_timeout: 700ms\nbackoff: {base: 300ms, max: 300ms, jitter: none}",
    ));
    let client = RetryLayer::new(agent.endpoint("ep")).layer(svc);
    let request = get_items(addr);
    let response = tokio::time::timeout(WAIT, client.oneshot(request))
        .await
        .expect("the call ends")
        .expect("an answer");
    assert_eq!(response.status(), 503);
    let gave_up = response.extensions().get::<GaveUp>().cloned();
    let body: Result<Bytes, BoxError> = tokio::time::timeout(WAIT, response.into_body().collect())
        .await
        .expect("the body ends")
        .map(|c| c.to_bytes());
    let body = body.unwrap();
    let mut want = b"bu".to_vec();
    want.extend_from_slice(big);
    want.extend_from_slice(b"END");
    assert_eq!(body.len(), want.len(), "{gave_up:?}");
    assert!(body == want, "bytes reordered or changed");
}

/// A credential refresh that always works.
struct Fresh;

impl retryplane_agent::layer::RefreshCredentials for Fresh {
    async fn refresh(&self, parts: &mut http::request::Parts) -> Result<(), BoxError> {
        parts.headers.insert(
            "authorization",
            http::HeaderValue::from_static("Bearer new"),
        );
        Ok(())
    }
}

#[tokio::test]
async fn a_401_whose_body_ends_late_does_not_hold_the_one_connection_its_resend_waits_for() {
    // As the 503 above, with a 401 and a refresh hook (SPEC: a 401 is sent again once after
    // the refresh): the resend waits for the connection the 401's unread body holds, and
    // nothing reads it meanwhile (the answer is dropped only once the resend is ready).
    let (addr, requests) = slow_first_server(401).await;
    let svc = OneConnection::to(addr).await;
    let agent = support::agent(&support::policy(
        "max_attempts: 2\ndeadline: 3s\nper_try_timeout: 1s\nbackoff: {base: 10ms, max: 10ms, jitter: none}",
    ));
    let client = RetryLayer::new(agent.endpoint("ep"))
        .with_auth_refresh(Fresh)
        .layer(svc);
    let request = get_items(addr);
    let started = tokio::time::Instant::now();
    let response = tokio::time::timeout(WAIT, client.oneshot(request))
        .await
        .expect("the call ends")
        .expect("an answer");
    let took = started.elapsed();
    let status = response.status();
    let gave_up = response.extensions().get::<GaveUp>().cloned();
    assert_eq!(
        (status.as_u16(), requests.load(Ordering::SeqCst)),
        (200, 2),
        "the resend never went out: {status} after {took:?}, {gave_up:?}"
    );
}
