//! Admin calls that carry a policy (Validate, Apply) take a turn before their message is
//! decoded, and only once it has been received. The admin service checks
//! [`MAX_CONCURRENT_CHECKS`](crate::admin::MAX_CONCURRENT_CHECKS) documents at once, but tonic
//! decodes a request before its handler runs: every call waiting for a check held its decoded
//! document (a viewer's two dozen Validate calls of a 4 MB document held about 170 MB each).
//! Here a call's message is first read as bytes (at most the decoding limit, and a little
//! more), holding no turn, so a client that sends slowly, or never finishes, keeps nobody
//! else waiting; then, past [`MAX_DECODED`] calls at once, it waits with its message
//! undecoded.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http::HeaderMap;
use http_body::Frame;
use http_body_util::BodyExt as _;
use tokio::sync::Semaphore;
use tonic::Status;
use tonic::body::Body;
use tonic::codegen::Service;
use tonic::server::NamedService;

/// The most calls that carry a policy decoded at once: those being checked and as many waiting
/// for a check.
pub const MAX_DECODED: usize = 2 * crate::admin::MAX_CONCURRENT_CHECKS;

/// The admin methods whose request carries a policy document.
const CARRY_A_POLICY: [&str; 2] = [
    "/retryplane.v1.AdminService/Validate",
    "/retryplane.v1.AdminService/Apply",
];

/// A gRPC message's frame header: a compression flag and a 4-byte length.
const FRAME_HEADER: usize = 5;

/// `S` (the admin service), with the calls that carry a policy received whole before they take
/// one of [`MAX_DECODED`] turns.
#[derive(Clone, Debug)]
pub struct DecodeTurns<S> {
    inner: S,
    turns: Arc<Semaphore>,
    /// The most bytes of a message read ahead: the decoding limit and a frame header. A longer
    /// body is handed on as it comes, without a turn: the service refuses it by its length.
    read_ahead: usize,
}

impl<S> DecodeTurns<S> {
    /// Wraps `inner`, which decodes messages of at most `max_message_bytes`.
    pub fn new(inner: S, max_message_bytes: usize) -> Self {
        Self::with_turns(inner, max_message_bytes, MAX_DECODED)
    }

    fn with_turns(inner: S, max_message_bytes: usize, turns: usize) -> Self {
        Self {
            inner,
            turns: Arc::new(Semaphore::new(turns)),
            read_ahead: max_message_bytes.saturating_add(FRAME_HEADER),
        }
    }
}

impl<S: NamedService> NamedService for DecodeTurns<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> Service<http::Request<Body>> for DecodeTurns<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        if !CARRY_A_POLICY.contains(&request.uri().path()) {
            return Box::pin(self.inner.call(request));
        }
        // The service made ready goes with the call; a clone takes its place (tower's way).
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let (turns, limit) = (self.turns.clone(), self.read_ahead);
        Box::pin(async move {
            let (parts, body) = request.into_parts();
            let (body, whole) = read_ahead(body, limit).await;
            // The semaphore is never closed; should it be, the call goes on without a turn.
            let _turn = match whole {
                true => turns.acquire_owned().await.ok(),
                false => None,
            };
            inner
                .call(http::Request::from_parts(parts, Body::new(body)))
                .await
        })
    }
}

/// Reads `body` until it ends or passes `limit` bytes: what was read, then the rest (its
/// trailers, the body where the read stopped, or its error), and whether it ended within the
/// limit.
async fn read_ahead(mut body: Body, limit: usize) -> (ReadAhead, bool) {
    let mut read = BytesMut::new();
    let mut ahead = ReadAhead {
        prefix: None,
        trailers: None,
        rest: None,
        error: None,
    };
    let whole = loop {
        match body.frame().await {
            None => break true,
            Some(Err(e)) => {
                ahead.error = Some(e);
                break false;
            }
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => {
                    read.extend_from_slice(&data);
                    if read.len() > limit {
                        ahead.rest = Some(body);
                        break false;
                    }
                }
                Err(frame) => {
                    if let Ok(trailers) = frame.into_trailers() {
                        ahead.trailers = Some(trailers);
                        break true;
                    }
                }
            },
        }
    };
    ahead.prefix = (!read.is_empty()).then(|| read.freeze());
    (ahead, whole)
}

/// A request body read ahead ([`read_ahead`]): the bytes read, then its trailers, the rest of
/// the body, or its error.
struct ReadAhead {
    prefix: Option<Bytes>,
    trailers: Option<HeaderMap>,
    rest: Option<Body>,
    error: Option<Status>,
}

impl http_body::Body for ReadAhead {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        if let Some(prefix) = self.prefix.take() {
            return Poll::Ready(Some(Ok(Frame::data(prefix))));
        }
        if let Some(error) = self.error.take() {
            return Poll::Ready(Some(Err(error)));
        }
        if let Some(rest) = self.rest.as_mut() {
            return Pin::new(rest).poll_frame(cx);
        }
        Poll::Ready(self.trailers.take().map(|t| Ok(Frame::trailers(t))))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use tokio::sync::Notify;

    use super::*;

    /// A service whose answers wait for `release`, counting the calls it has begun.
    #[derive(Clone)]
    struct Held {
        begun: Arc<AtomicUsize>,
        release: Arc<Notify>,
    }

    impl Service<http::Request<Body>> for Held {
        type Response = http::Response<Body>;
        type Error = std::convert::Infallible;
        type Future =
            Pin<Box<dyn Future<Output = Result<http::Response<Body>, Self::Error>> + Send>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, _: http::Request<Body>) -> Self::Future {
            let (begun, release) = (self.begun.clone(), self.release.clone());
            Box::pin(async move {
                begun.fetch_add(1, Ordering::SeqCst);
                release.notified().await;
                Ok(http::Response::new(Body::empty()))
            })
        }
    }

    fn request(path: &str) -> http::Request<Body> {
        http::Request::builder()
            .uri(format!("http://localhost{path}"))
            .body(Body::empty())
            .unwrap()
    }

    /// Past its turns, a Validate or Apply call is not begun (its message not decoded) until one
    /// ends; other calls are not held.
    #[tokio::test]
    async fn calls_that_carry_a_policy_begin_only_with_a_turn() {
        let held = Held {
            begun: Arc::new(AtomicUsize::new(0)),
            release: Arc::new(Notify::new()),
        };
        let mut service = DecodeTurns::with_turns(held.clone(), 1024, 2);
        let mut calls = tokio::task::JoinSet::new();
        for path in [
            "/retryplane.v1.AdminService/Validate",
            "/retryplane.v1.AdminService/Apply",
            "/retryplane.v1.AdminService/Validate",
            "/retryplane.v1.AdminService/FleetStatus",
        ] {
            calls.spawn(service.call(request(path)));
        }
        let begun = || held.begun.load(Ordering::SeqCst);
        let wait = std::time::Duration::from_secs(10);
        tokio::time::timeout(wait, async {
            while begun() < 3 {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("two with a turn and FleetStatus begin");
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert_eq!(
            begun(),
            3,
            "a third call carrying a policy began without a turn"
        );
        held.release.notify_one();
        tokio::time::timeout(wait, async {
            while begun() < 4 {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("the third begins once one ends");
        held.release.notify_waiters();
        held.release.notify_one();
    }

    /// A body that never ends.
    struct Never;

    impl http_body::Body for Never {
        type Data = Bytes;
        type Error = Status;

        fn poll_frame(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
            Poll::Pending
        }
    }

    fn validate(body: Body) -> http::Request<Body> {
        http::Request::builder()
            .uri("http://localhost/retryplane.v1.AdminService/Validate")
            .body(body)
            .unwrap()
    }

    /// A call whose message never finishes coming holds no turn (a client that sends slowly
    /// kept every Validate and Apply waiting); one longer than the limit is handed on without
    /// one, to be refused by its length.
    #[tokio::test]
    async fn a_call_takes_its_turn_only_once_its_message_has_come() {
        let held = Held {
            begun: Arc::new(AtomicUsize::new(0)),
            release: Arc::new(Notify::new()),
        };
        let mut service = DecodeTurns::with_turns(held.clone(), 4, 1);
        let mut calls = tokio::task::JoinSet::new();
        calls.spawn(service.call(validate(Body::new(Never))));
        calls.spawn(service.call(validate(Body::new(http_body_util::Full::new(
            Bytes::from_static(b"12345"),
        )))));
        let begun = || held.begun.load(Ordering::SeqCst);
        let wait = std::time::Duration::from_secs(10);
        tokio::time::timeout(wait, async {
            while begun() < 1 {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("the call whose message came begins with the turn");
        // The only turn is held: a message past the limit (4 + 5 bytes) still goes on.
        calls.spawn(service.call(validate(Body::new(http_body_util::Full::new(
            Bytes::from_static(b"0123456789"),
        )))));
        tokio::time::timeout(wait, async {
            while begun() < 2 {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("a message past the limit is handed on without a turn");
    }

    /// What was read ahead is handed on whole: its bytes, then its trailers, or the rest of
    /// the body where the read stopped.
    #[tokio::test]
    async fn a_body_read_ahead_is_handed_on_whole() {
        let mut trailers = HeaderMap::new();
        trailers.insert("x-t", "1".parse().unwrap());
        let body = || {
            let frames: Vec<Result<Frame<Bytes>, Status>> = vec![
                Ok(Frame::data(Bytes::from_static(b"ab"))),
                Ok(Frame::data(Bytes::from_static(b"cd"))),
                Ok(Frame::trailers(trailers.clone())),
            ];
            Body::new(http_body_util::StreamBody::new(tokio_stream::iter(frames)))
        };
        let (ahead, whole) = read_ahead(body(), 16).await;
        assert!(whole);
        let collected = ahead.collect().await.unwrap();
        assert_eq!(collected.trailers(), Some(&trailers));
        assert_eq!(collected.to_bytes(), "abcd");
        // Past the limit: the first two bytes, then the rest as it comes.
        let (ahead, whole) = read_ahead(body(), 1).await;
        assert!(!whole);
        let collected = ahead.collect().await.unwrap();
        assert_eq!(collected.trailers(), Some(&trailers));
        assert_eq!(collected.to_bytes(), "abcd");
    }
}
