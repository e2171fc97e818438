//! A gRPC answer whose head (200, no `grpc-status`) is followed by its status in trailers with
//! no message before them, from a real hyper HTTP/2 server on 127.0.0.1:0 (what a tonic server
//! stream whose first item is an error sends, and servers that flush their head early): through
//! the layer it counts as the failure its code is, and is retried as that code says, as through
//! `Endpoint::call`. An answer with a message first, or whose first message is slow, is a
//! success that the caller gets whole.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use http::HeaderMap;
use http_body::Frame;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use prost::Message as _;
use retryplane_agent::Agent;
use retryplane_agent::layer::{Idempotent, RetryLayer, into_tonic_request};
use retryplane_proto::pb;
use retryplane_proto::pb::admin_service_client::AdminServiceClient;
use tokio::net::TcpListener;
use tonic::transport::Channel;
use tonic::{Code, Request, Status};

const WAIT: Duration = Duration::from_secs(15);

/// What the server sends after its head.
#[derive(Clone, Copy)]
enum After {
    /// Trailers with `grpc-status: 14` (`UNAVAILABLE`), no message, after `delay`.
    Unavailable { delay: Duration },
    /// One `GetResponse` message, after `delay`, then `grpc-status: 0`.
    Message { delay: Duration },
}

/// A body of frames made in turn: an optional wait, then each frame.
struct Frames {
    delay: Option<Pin<Box<tokio::time::Sleep>>>,
    frames: Vec<Frame<Bytes>>,
}

impl http_body::Body for Frames {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if let Some(delay) = self.delay.as_mut() {
            if delay.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            self.delay = None;
        }
        if self.frames.is_empty() {
            Poll::Ready(None)
        } else {
            Poll::Ready(Some(Ok(self.frames.remove(0))))
        }
    }
}

fn trailers(code: u8) -> HeaderMap {
    let mut t = HeaderMap::new();
    t.insert("grpc-status", code.to_string().parse().unwrap());
    if code != 0 {
        t.insert("grpc-message", "down".parse().unwrap());
    }
    t
}

/// A gRPC message frame (uncompressed) holding a `GetResponse` with no record.
fn message() -> Bytes {
    let encoded = pb::GetResponse::default().encode_to_vec();
    let mut framed = BytesMut::with_capacity(5 + encoded.len());
    framed.put_u8(0);
    framed.put_u32(u32::try_from(encoded.len()).unwrap());
    framed.put_slice(&encoded);
    framed.freeze()
}

/// An HTTP/2 gRPC server answering every request with a head (200, `application/grpc`) and
/// then what `after` says; it counts the requests.
async fn server(after: After) -> (Arc<AtomicU32>, Channel) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(AtomicU32::new(0));
    let counted = seen.clone();
    tokio::spawn(async move {
        for _ in 0..64 {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let counted = counted.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |_req: http::Request<hyper::body::Incoming>| {
                    counted.fetch_add(1, Ordering::SeqCst);
                    let body = match after {
                        After::Unavailable { delay } => Frames {
                            delay: Some(Box::pin(tokio::time::sleep(delay))),
                            frames: vec![Frame::trailers(trailers(14))],
                        },
                        After::Message { delay } => Frames {
                            delay: Some(Box::pin(tokio::time::sleep(delay))),
                            frames: vec![Frame::data(message()), Frame::trailers(trailers(0))],
                        },
                    };
                    async move {
                        Ok::<_, Infallible>(
                            http::Response::builder()
                                .status(200)
                                .header("content-type", "application/grpc")
                                .body(body)
                                .unwrap(),
                        )
                    }
                });
                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(WAIT)
        .connect()
        .await
        .unwrap();
    (seen, channel)
}

fn agent() -> Agent {
    let yaml = "version: 1\ndefaults:\n  backoff: {base: 5ms, max: 20ms, jitter: none}\n  budget: {enabled: false}\n  circuit_breaker: {enabled: false}\nendpoints:\n  upstream:\n    max_attempts: 3\n    retry_on: {grpc_status: [UNAVAILABLE]}\n";
    let loaded = retryplane_policy::load(yaml.as_bytes());
    assert!(!loaded.has_errors(), "{:?}", loaded.diagnostics);
    Agent::from_policies_seeded(loaded.policies.unwrap(), 1)
}

/// A `Get` through the layer with a generated client, declared idempotent or not.
async fn get(agent: &Agent, channel: Channel, idempotent: bool) -> Result<pb::GetResponse, Status> {
    let service = tower::ServiceBuilder::new()
        .layer(RetryLayer::new(agent.endpoint("upstream")))
        .map_request(into_tonic_request)
        .service(channel);
    let mut client = AdminServiceClient::new(service);
    let mut request = Request::new(pb::GetRequest { version: 0 });
    request.extensions_mut().insert(Idempotent(idempotent));
    tokio::time::timeout(WAIT, client.get(request))
        .await
        .expect("the call ends in time")
        .map(tonic::Response::into_inner)
}

/// Also when the trailers come a while after the head, as from a server with Nagle on (a
/// tonic server started with `serve_with_incoming`), whose trailers wait behind its head for
/// the client's delayed ACK (40 ms on Linux). Here 50 ms, past that, within the layer's 100 ms
/// look for a first frame; on two threads, so that a stall of the server's does not also hold
/// the client's look (on one, a 40 ms stall between the two once ended the look first).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_in_trailers_right_after_the_head_is_retried_and_counted_as_a_failure() {
    for delay in [Duration::ZERO, Duration::from_millis(50)] {
        let (seen, channel) = server(After::Unavailable { delay }).await;
        let agent = agent();
        let status = get(&agent, channel, true)
            .await
            .expect_err("the call fails");
        assert_eq!(status.code(), Code::Unavailable, "{delay:?}: {status:?}");
        assert_eq!(status.message(), "down");
        let seen = seen.load(Ordering::SeqCst);
        assert_eq!(seen, 3, "{delay:?}: retried as UNAVAILABLE is");
        let c = agent.endpoint("upstream").pending_counts();
        assert_eq!((c.calls, c.attempts, c.retries), (1, 3, 2), "{delay:?}");
        assert_eq!(c.success_first_try, 0, "{delay:?}: counted as a success");
        assert_eq!(c.gave_up_attempts, 1);
    }
}

#[tokio::test]
async fn an_error_in_trailers_right_after_the_head_of_a_call_that_may_not_be_retried_is_a_failure()
{
    let (seen, channel) = server(After::Unavailable {
        delay: Duration::ZERO,
    })
    .await;
    let agent = agent();
    let status = get(&agent, channel, false)
        .await
        .expect_err("the call fails");
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert_eq!(seen.load(Ordering::SeqCst), 1, "not idempotent: sent once");
    let c = agent.endpoint("upstream").pending_counts();
    assert_eq!((c.calls, c.attempts, c.retries), (1, 1, 0));
    assert_eq!(c.success_first_try, 0, "counted as a success");
}

#[tokio::test]
async fn a_message_after_the_head_is_a_success_the_caller_gets_whole() {
    let (seen, channel) = server(After::Message {
        delay: Duration::ZERO,
    })
    .await;
    let agent = agent();
    let response = get(&agent, channel, true).await.expect("the call succeeds");
    assert_eq!(response, pb::GetResponse::default());
    assert_eq!(seen.load(Ordering::SeqCst), 1);
    let c = agent.endpoint("upstream").pending_counts();
    assert_eq!((c.calls, c.attempts, c.success_first_try), (1, 1, 1));
}

/// The look at the first frame waits a little only: a first message that comes later (a slow
/// stream) is still a success, sent once, and reaches the caller.
#[tokio::test]
async fn a_slow_first_message_is_a_success_sent_once() {
    let (seen, channel) = server(After::Message {
        delay: Duration::from_millis(200),
    })
    .await;
    let agent = agent();
    let response = get(&agent, channel, true).await.expect("the call succeeds");
    assert_eq!(response, pb::GetResponse::default());
    assert_eq!(seen.load(Ordering::SeqCst), 1);
    let c = agent.endpoint("upstream").pending_counts();
    assert_eq!((c.calls, c.attempts, c.success_first_try), (1, 1, 1));
}

/// A request over the layer's body limit is sent once (its body streamed): its answer's status
/// after the head is still counted as the failure it is.
#[tokio::test]
async fn an_error_in_trailers_right_after_the_head_of_a_request_sent_once_is_a_failure() {
    let (seen, channel) = server(After::Unavailable {
        delay: Duration::ZERO,
    })
    .await;
    let agent = agent();
    let service = tower::ServiceBuilder::new()
        .layer(RetryLayer::new(agent.endpoint("upstream")))
        .map_request(into_tonic_request)
        .service(channel);
    let mut client = AdminServiceClient::new(service);
    let source = pb::PolicySource {
        kind: Some(pb::policy_source::Kind::Yaml(
            "#".repeat(retryplane_agent::layer::DEFAULT_BODY_LIMIT * 2),
        )),
        origin: String::new(),
    };
    let mut request = Request::new(pb::ValidateRequest {
        source: Some(source),
    });
    request.extensions_mut().insert(Idempotent(true));
    let status = tokio::time::timeout(WAIT, client.validate(request))
        .await
        .expect("the call ends in time")
        .expect_err("the call fails");
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert_eq!(seen.load(Ordering::SeqCst), 1, "over the limit: sent once");
    let c = agent.endpoint("upstream").pending_counts();
    assert_eq!((c.calls, c.attempts), (1, 1));
    assert_eq!(c.success_first_try, 0, "counted as a success");
}
