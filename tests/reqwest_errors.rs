//! `Classify for reqwest::Error` (the agent's `reqwest` feature) against loopback servers that
//! misbehave: a refused connection is `connect`, a connection reset before or during the
//! response is `reset`, a server that never answers is `timeout` (reqwest's own timeout); and
//! calls through an endpoint handle retry them as SPEC §2 says (reset and timeout are unknown
//! outcomes: a GET is retried, a POST without the key is not).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use retryplane_agent::{Agent, CallMeta, Classification, Classify as _, GiveUpCause, Outcome};
use retryplane_policy::ErrorClass;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpListener;

/// reqwest's whole-request timeout against a server that never answers: far below the
/// policy's per-try timeout, so the error is reqwest's, not the agent's.
const SILENT_TIMEOUT: Duration = Duration::from_millis(500);
/// reqwest's timeout against a server that resets: long enough that a loaded machine never
/// turns a reset into a timeout.
const RESET_TIMEOUT: Duration = Duration::from_secs(10);

/// What a scripted server does with each connection once it has read the request head.
#[derive(Clone, Copy, Debug)]
enum Behaviour {
    /// Resets the connection (RST, zero linger) without a byte of response.
    Reset,
    /// Sends half a response head, then resets.
    ResetMidResponse,
    /// Never answers (keeps the connection open, reading).
    Silent,
}

impl Behaviour {
    /// The client's timeout against this behaviour.
    fn client_timeout(self) -> Duration {
        match self {
            Behaviour::Silent => SILENT_TIMEOUT,
            Behaviour::Reset | Behaviour::ResetMidResponse => RESET_TIMEOUT,
        }
    }
}

/// Waits until `seen` reaches `n` (at most 10 s) and returns it, for the caller to check it is
/// exactly `n`: a request that timed out on the client's side may not yet be counted.
async fn seen_reaches(seen: &AtomicU32, n: u32) -> u32 {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while seen.load(Ordering::SeqCst) < n && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    seen.load(Ordering::SeqCst)
}

/// A server on 127.0.0.1:0 that behaves as told on every connection; counts requests.
async fn server(how: Behaviour) -> (String, Arc<AtomicU32>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1/things", l.local_addr().unwrap());
    let seen = Arc::new(AtomicU32::new(0));
    let count = seen.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let count = count.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 1024];
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                count.fetch_add(1, Ordering::SeqCst);
                match how {
                    Behaviour::Reset => {
                        s.set_zero_linger().unwrap();
                        drop(s);
                    }
                    Behaviour::ResetMidResponse => {
                        let _ = s.write_all(b"HTTP/1.1 200 OK\r\nContent-Le").await;
                        let _ = s.flush().await;
                        s.set_zero_linger().unwrap();
                        drop(s);
                    }
                    Behaviour::Silent => {
                        while let Ok(n) = s.read(&mut chunk).await {
                            if n == 0 {
                                break;
                            }
                        }
                    }
                }
            });
        }
    });
    (url, seen)
}

fn client(timeout: Duration) -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(timeout)
        // One request per connection: each attempt meets the server's behaviour afresh.
        .pool_max_idle_per_host(0)
        .build()
        .unwrap()
}

fn transport(class: ErrorClass) -> Classification {
    Classification::Outcome(Outcome::Transport(class))
}

/// The error of one GET to `url`, with the client's `timeout`.
async fn get_error(url: &str, timeout: Duration) -> reqwest::Error {
    client(timeout).get(url).send().await.unwrap_err()
}

#[tokio::test]
async fn a_refused_connection_is_a_connect_error() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/", l.local_addr().unwrap());
    drop(l);
    let e = get_error(&url, RESET_TIMEOUT).await;
    assert!(e.is_connect(), "{e:?}");
    assert_eq!(e.classify(), transport(ErrorClass::Connect));
}

#[tokio::test]
async fn a_connection_reset_before_the_response_is_a_reset() {
    let (url, seen) = server(Behaviour::Reset).await;
    let e = get_error(&url, RESET_TIMEOUT).await;
    assert!(!e.is_connect() && !e.is_timeout(), "{e:?}");
    assert_eq!(e.classify(), transport(ErrorClass::Reset), "{e:?}");
    assert_eq!(
        seen.load(Ordering::SeqCst),
        1,
        "the request reached the server"
    );
}

#[tokio::test]
async fn a_connection_reset_mid_response_is_a_reset() {
    let (url, _) = server(Behaviour::ResetMidResponse).await;
    let e = get_error(&url, RESET_TIMEOUT).await;
    assert_eq!(e.classify(), transport(ErrorClass::Reset), "{e:?}");
}

#[tokio::test]
async fn a_server_that_never_answers_is_a_timeout() {
    let (url, seen) = server(Behaviour::Silent).await;
    let e = get_error(&url, SILENT_TIMEOUT).await;
    assert!(e.is_timeout(), "{e:?}");
    assert_eq!(e.classify(), transport(ErrorClass::Timeout), "{e:?}");
    assert_eq!(seen_reaches(&seen, 1).await, 1);
}

/// An agent whose `ep` has 3 attempts, tiny pauses, a per-try timeout above reqwest's.
fn agent() -> Agent {
    let yaml = "version: 1\ndefaults:\n  backoff: {base: 5ms, max: 20ms, jitter: none}\n  budget: {enabled: false}\n  circuit_breaker: {enabled: false}\nendpoints:\n  ep:\n    max_attempts: 3\n    per_try_timeout: 5s\n";
    Agent::from_policies_seeded(
        retryplane_policy::load(yaml.as_bytes()).policies.unwrap(),
        1,
    )
}

/// One logical call of `method` to `url` through `agent`'s `ep`: the give-up cause and
/// attempts.
async fn call(
    agent: &Agent,
    method: reqwest::Method,
    url: &str,
    timeout: Duration,
) -> (Option<GiveUpCause>, u32) {
    let client = client(timeout);
    let err = agent
        .endpoint("ep")
        .call(CallMeta::http(method.as_str(), "/v1/things"), |_| {
            let request = client.request(method.clone(), url);
            async move {
                request.send().await.map(|r| {
                    http::Response::builder()
                        .status(r.status())
                        .body(())
                        .unwrap()
                })
            }
        })
        .await
        .unwrap_err();
    assert!(err.error().is_some(), "ends with the reqwest error");
    (err.gave_up(), err.attempts)
}

#[tokio::test]
async fn a_reset_or_timed_out_get_is_retried_and_a_post_is_not() {
    for how in [Behaviour::Reset, Behaviour::Silent] {
        let (url, seen) = server(how).await;
        let agent = agent();
        let timeout = how.client_timeout();
        assert_eq!(
            call(&agent, reqwest::Method::GET, &url, timeout).await,
            (Some(GiveUpCause::AttemptsExhausted), 3),
            "{how:?}"
        );
        assert_eq!(seen_reaches(&seen, 3).await, 3, "{how:?}");
        assert_eq!(
            call(&agent, reqwest::Method::POST, &url, timeout).await,
            (Some(GiveUpCause::NotRetryable), 1),
            "{how:?}"
        );
        assert_eq!(seen_reaches(&seen, 4).await, 4, "{how:?}");
    }
}
