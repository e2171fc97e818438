//! What a user of the agent crate alone can write: a `Classify` implementation and a policy
//! built with the re-exported policy crate, and (feature `reqwest`) a reqwest call through
//! `Endpoint::call` against an HTTP/1.1 upstream on 127.0.0.1:0 (one response per connection).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use retryplane_agent::{
    Agent, CallMeta, Cause, Classification, Classify, ErrorClass, GiveUpCause, GrpcCode, Outcome,
    Pushback, RetryAfterError, RetryPolicy, fallback_policy, policy,
};

/// An application's own answer type.
enum Answer {
    Ok,
    Busy { retry_in_ms: u64 },
    BadHint,
    Overloaded,
    Dropped,
}

impl Classify for Answer {
    fn classify(&self) -> Classification {
        match self {
            Answer::Ok => Classification::Success,
            Answer::Busy { retry_in_ms } => Classification::Outcome(Outcome::Grpc {
                code: GrpcCode::Unavailable,
                pushback: Some(Pushback::After(Duration::from_millis(*retry_in_ms))),
            }),
            Answer::BadHint => Classification::Outcome(Outcome::Http {
                status: 503,
                retry_after: Some(Err(RetryAfterError::Malformed)),
            }),
            Answer::Overloaded => Classification::Outcome(Outcome::Grpc {
                code: GrpcCode::ResourceExhausted,
                pushback: Some(Pushback::DoNotRetry),
            }),
            Answer::Dropped => Classification::Outcome(Outcome::Transport(ErrorClass::Reset)),
        }
    }
}

const POLICY: &str = "version: 1\ndefaults:\n  backoff: {base: 1ms, max: 2ms, jitter: none}\n  budget: {enabled: false}\n  circuit_breaker: {enabled: false}\nendpoints:\n  ep:\n    max_attempts: 3\n";

fn agent() -> Agent {
    let loaded = policy::load(POLICY.as_bytes());
    assert!(!loaded.has_errors(), "{:?}", loaded.diagnostics);
    Agent::from_policies(loaded.policies.unwrap())
}

#[tokio::test]
async fn a_classify_of_its_own_and_a_policy_need_only_the_agent_crate() {
    let fallback: RetryPolicy = fallback_policy();
    assert_eq!(fallback.max_attempts, 2);
    let agent = agent();
    let ep = agent.endpoint("ep");
    let mut answers = vec![Answer::Ok, Answer::BadHint, Answer::Busy { retry_in_ms: 1 }];
    let r = ep
        .call(CallMeta::endpoint(), |_| {
            let next = answers.pop().unwrap();
            async move { Ok::<_, Answer>(next) }
        })
        .await;
    assert!(matches!(r, Ok(Answer::Ok)));
    let mut answers = vec![Answer::Overloaded, Answer::Dropped];
    let err = ep
        .call(CallMeta::endpoint(), |_| {
            let next = answers.pop().unwrap();
            async move { Err::<Answer, _>(next) }
        })
        .await
        .err()
        .unwrap();
    assert_eq!(err.cause, Cause::GaveUp(GiveUpCause::NotRetryable));
    assert_eq!(err.attempts, 2);
}

#[cfg(feature = "reqwest")]
mod with_reqwest {
    use std::collections::VecDeque;
    use std::sync::{Arc, Mutex};

    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    use tokio::net::TcpListener;

    use super::*;

    /// An upstream that answers each connection with the next head of `script` (status line
    /// and header lines), then 200; returns its URL and the requests it saw.
    async fn upstream(script: &[&'static str]) -> (String, Arc<Mutex<u32>>) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/v1/things", l.local_addr().unwrap());
        let script = Arc::new(Mutex::new(script.iter().copied().collect::<VecDeque<_>>()));
        let seen = Arc::new(Mutex::new(0));
        let count = seen.clone();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                let head = script.lock().unwrap().pop_front().unwrap_or("200 OK\r\n");
                *count.lock().unwrap() += 1;
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 1024];
                    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                        match s.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                    let response =
                        format!("HTTP/1.1 {head}content-length: 0\r\nconnection: close\r\n\r\n");
                    let _ = s.write_all(response.as_bytes()).await;
                    let _ = s.shutdown().await;
                });
            }
        });
        (url, seen)
    }

    #[tokio::test]
    async fn a_reqwest_send_is_a_call_attempt_as_it_is() {
        let (url, seen) = upstream(&["503 X\r\nretry-after: 0\r\n", "503 X\r\n"]).await;
        let client = reqwest::Client::new();
        let agent = agent();
        let ep = agent.endpoint("ep");
        let response = ep
            .call(CallMeta::http("GET", "/v1/things"), |_| {
                client.get(&url).send()
            })
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(*seen.lock().unwrap(), 3);

        // A 404 is returned at once, as the upstream sent it.
        let (url, seen) = upstream(&["404 X\r\n"]).await;
        let err = ep
            .call(CallMeta::http("GET", "/v1/things"), |_| {
                client.get(&url).send()
            })
            .await
            .err()
            .unwrap();
        assert_eq!(err.cause, Cause::GaveUp(GiveUpCause::NotRetryable));
        assert_eq!(err.response().map(|r| r.status().as_u16()), Some(404));
        assert_eq!(*seen.lock().unwrap(), 1);
    }

    #[tokio::test]
    async fn a_reqwest_response_is_classified_as_an_http_response_is() {
        let (url, _) = upstream(&[
            "429 X\r\nretry-after: 3\r\n",
            "200 OK\r\ncontent-type: application/grpc\r\ngrpc-status: 14\r\ngrpc-retry-pushback-ms: 250\r\n",
        ])
        .await;
        let client = reqwest::Client::new();
        let r = client.get(&url).send().await.unwrap();
        assert_eq!(
            r.classify(),
            Classification::Outcome(Outcome::Http {
                status: 429,
                retry_after: Some(Ok(Duration::from_secs(3)))
            })
        );
        let r = client.get(&url).send().await.unwrap();
        assert_eq!(
            r.classify(),
            Classification::Outcome(Outcome::Grpc {
                code: GrpcCode::Unavailable,
                pushback: Some(Pushback::After(Duration::from_millis(250)))
            })
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_tower_stacks_boxed_error_is_classified_by_what_it_holds() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};
    use tower::{BoxError, Service as _, ServiceBuilder, ServiceExt as _};

    // A tower stack returns `tower::BoxError`: here, its timeout layer's error on the first
    // send (the upstream hangs), which counts as a timeout, so the GET is sent again.
    let sent = Arc::new(AtomicU32::new(0));
    let upstream = {
        let sent = sent.clone();
        tower::service_fn(move |_: http::Request<()>| {
            let n = sent.fetch_add(1, Ordering::SeqCst);
            async move {
                if n == 0 {
                    std::future::pending::<()>().await;
                }
                Ok::<_, std::io::Error>(http::Response::new(()))
            }
        })
    };
    let service = ServiceBuilder::new()
        .timeout(Duration::from_millis(100))
        .service(upstream);
    let agent = agent();
    let response = agent
        .endpoint("ep")
        .call(CallMeta::http("GET", "/v1/items"), |_| {
            let mut service = service.clone();
            async move {
                let response: Result<http::Response<()>, BoxError> =
                    service.ready().await?.call(http::Request::new(())).await;
                response
            }
        })
        .await
        .expect("the second send answers");
    assert_eq!(response.status(), http::StatusCode::OK);
    assert_eq!(sent.load(Ordering::SeqCst), 2);
    let counts = agent.endpoint("ep").pending_counts();
    assert_eq!(counts.attempts, 2);
}
