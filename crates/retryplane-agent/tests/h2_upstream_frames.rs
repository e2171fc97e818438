//! HTTP/2 upstreams that misbehave at the frame level, scripted with the `h2` crate on
//! loopback: what the agent makes of a stream reset after its answer's head.
//!
//! RFC 9113 §8.7: `REFUSED_STREAM` says the stream was closed "prior to any processing having
//! occurred". An upstream (or a proxy) that sends it after a response head has already
//! answered the request: the head says it was processed, whatever the reset's code.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use bytes::Bytes;
use tokio::net::TcpListener;

/// The longest any single wait may take before the test fails.
const WAIT: Duration = Duration::from_secs(10);

/// An HTTP/2 server (prior knowledge) on loopback that answers every request with a `200`
/// head and a first piece of body, then, once the client says through the returned sender
/// that it holds the head, resets the stream with `reason`; counts the requests it answered.
/// (h2 drops a head that comes in the same read as the stream's reset: the client must have
/// taken it first.)
async fn answers_then_resets(
    reason: h2::Reason,
) -> (u16, Arc<AtomicU32>, tokio::sync::mpsc::UnboundedSender<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let answered = Arc::new(AtomicU32::new(0));
    let count = answered.clone();
    let (head_taken, taken) = tokio::sync::mpsc::unbounded_channel::<()>();
    let taken = Arc::new(tokio::sync::Mutex::new(taken));
    tokio::spawn(async move {
        loop {
            let Ok((socket, _)) = listener.accept().await else {
                return;
            };
            let count = count.clone();
            let taken = taken.clone();
            tokio::spawn(async move {
                let Ok(mut conn) = h2::server::handshake(socket).await else {
                    return;
                };
                // Each stream in a task of its own: `accept` drives the connection.
                while let Some(Ok((_request, mut respond))) = conn.accept().await {
                    let (count, taken) = (count.clone(), taken.clone());
                    tokio::spawn(async move {
                        let Ok(mut body) = respond.send_response(http::Response::new(()), false)
                        else {
                            return;
                        };
                        count.fetch_add(1, Ordering::SeqCst);
                        let _ = body.send_data(Bytes::from_static(b"{\"charge\":"), false);
                        if taken.lock().await.recv().await.is_some() {
                            body.send_reset(reason);
                        }
                    });
                }
            });
        }
    });
    (port, answered, head_taken)
}

/// An agent whose endpoint `ep` makes 3 attempts with short pauses.
#[cfg(feature = "reqwest")]
fn agent() -> retryplane_agent::Agent {
    support::agent(&support::policy(
        "max_attempts: 3\nbackoff: {base: 5ms, max: 20ms, multiplier: 2.0, jitter: none}",
    ))
}

#[cfg(feature = "reqwest")]
#[tokio::test]
async fn a_post_whose_answer_head_came_before_a_refused_stream_reset_is_not_sent_again() {
    // The upstream answered the POST (a 200 head, part of its body) and then reset the stream
    // with REFUSED_STREAM. The head proves the request was processed: the outcome is at best
    // unknown, and a POST without the idempotency key must not be sent again (SPEC §2).
    let (port, answered, head_taken) = answers_then_resets(h2::Reason::REFUSED_STREAM).await;
    let client = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    let url = format!("http://127.0.0.1:{port}/charges");
    let ep = agent().endpoint("ep");
    let err = tokio::time::timeout(
        WAIT,
        ep.call(retryplane_agent::CallMeta::http("POST", "/charges"), |_| {
            let sent = client.post(&url).body("{}").send();
            let head_taken = head_taken.clone();
            async move {
                // The answer read whole, as a caller does with `bytes()`: its head is what
                // the call is judged by.
                let response = sent.await?;
                assert_eq!(response.status(), 200);
                head_taken.send(()).unwrap();
                let mut head = http::Response::new(());
                *head.status_mut() = response.status();
                response.bytes().await?;
                Ok::<_, reqwest::Error>(head)
            }
        }),
    )
    .await
    .expect("the call ends")
    .expect_err("every answer is cut");
    assert_eq!(
        (
            ep.pending_counts().attempts,
            answered.load(Ordering::SeqCst)
        ),
        (1, 1),
        "a processed POST without its key was charged again: {err}"
    );
}

#[tokio::test]
async fn a_hyper_body_cut_by_a_refused_stream_after_its_head_is_a_reset_not_a_connect_error() {
    // The same through hyper-util's client: the body's error is a `hyper::Error` over the h2
    // reset. The request was answered, so it cannot count as never having reached the server.
    use http_body_util::{BodyExt as _, Full};
    use hyper_util::client::legacy::Client;
    use hyper_util::client::legacy::connect::HttpConnector;
    use hyper_util::rt::TokioExecutor;
    use retryplane_agent::{Classification, Classify as _, Outcome};
    use retryplane_policy::ErrorClass;

    let (port, answered, head_taken) = answers_then_resets(h2::Reason::REFUSED_STREAM).await;
    let client: Client<HttpConnector, Full<Bytes>> = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build(HttpConnector::new());
    let post = http::Request::post(format!("http://127.0.0.1:{port}/charges"))
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap();
    let response = tokio::time::timeout(WAIT, client.request(post))
        .await
        .expect("the head comes")
        .expect("a 200 head");
    assert_eq!(response.status(), 200);
    head_taken.send(()).unwrap();
    let err = tokio::time::timeout(WAIT, response.into_body().collect())
        .await
        .expect("the body ends")
        .expect_err("the body is cut");
    assert_eq!(answered.load(Ordering::SeqCst), 1);
    assert_eq!(
        err.classify(),
        Classification::Outcome(Outcome::Transport(ErrorClass::Reset)),
        "{err:?}"
    );
}

#[tokio::test]
async fn a_grpc_status_made_of_a_body_cut_by_a_refused_stream_after_its_head_is_not_a_connect_error()
 {
    // What a tonic client returns when its answer's body is cut so: tonic's channel body maps
    // the hyper error to a status with `Status::from_error` (code UNAVAILABLE, the hyper error
    // kept as its source). The answer's head had come: the call was processed, and a
    // non-idempotent gRPC call must not be sent again, as it would be for a connect error.
    use http_body_util::{BodyExt as _, Full};
    use hyper_util::client::legacy::Client;
    use hyper_util::client::legacy::connect::HttpConnector;
    use hyper_util::rt::TokioExecutor;
    use retryplane_agent::{Classification, Classify as _, Outcome};
    use retryplane_policy::ErrorClass;

    let (port, _, head_taken) = answers_then_resets(h2::Reason::REFUSED_STREAM).await;
    let client: Client<HttpConnector, Full<Bytes>> = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build(HttpConnector::new());
    let call = http::Request::post(format!(
        "http://127.0.0.1:{port}/retryplane.v1.AdminService/Apply"
    ))
    .header("content-type", "application/grpc")
    .body(Full::new(Bytes::from_static(&[0, 0, 0, 0, 0])))
    .unwrap();
    let response = tokio::time::timeout(WAIT, client.request(call))
        .await
        .expect("the head comes")
        .expect("a 200 head");
    head_taken.send(()).unwrap();
    let err = tokio::time::timeout(WAIT, response.into_body().collect())
        .await
        .expect("the body ends")
        .expect_err("the body is cut");
    let status = tonic::Status::from_error(Box::new(err));
    assert_ne!(
        status.classify(),
        Classification::Outcome(Outcome::Transport(ErrorClass::Connect)),
        "{status:?}"
    );
}
