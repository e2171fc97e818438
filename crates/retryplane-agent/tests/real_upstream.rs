//! SPEC §2 end to end over real sockets: the tower layer around a hyper-util legacy client,
//! against an HTTP/1 upstream on 127.0.0.1:0 that a test scripts byte by byte (503s, 429 with
//! `Retry-After` in seconds and as a date, resets, slow heads, a body cut off mid-way).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use retryplane_agent::layer::{GaveUp, ReplayBody, RetryLayer};
use retryplane_agent::{Agent, Cause, GiveUpCause};
use retryplane_policy::retry_after::format_http_date;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;
use tower::{Layer as _, ServiceExt as _};

/// The longest any single wait may take before the test fails.
const WAIT: Duration = Duration::from_secs(10);

/// What the upstream does with one request, once it has read it whole.
#[derive(Clone, Debug)]
enum Step {
    /// Writes these bytes (a whole answer) and keeps the connection.
    Answer(String),
    /// Writes the first bytes, waits, writes the second.
    Split(String, Duration, String),
    /// Writes these bytes, then closes the connection (FIN).
    ThenClose(String),
    /// Resets the connection (RST) without a byte.
    Reset,
    /// Says nothing for this long, then closes.
    Silent(Duration),
}

fn answer(status: u16, headers: &str, body: &str) -> String {
    format!(
        "HTTP/1.1 {status} X\r\ncontent-length: {}\r\n{headers}\r\n{body}",
        body.len()
    )
}

/// One request the upstream read: when, method, path.
#[derive(Clone, Debug)]
struct Seen {
    at: Instant,
    method: String,
}

/// An answer made when its request comes, from the wall clock then.
type Dated = fn(SystemTime) -> String;

#[derive(Clone, Default)]
struct Upstream {
    steps: Arc<Mutex<VecDeque<Step>>>,
    seen: Arc<Mutex<Vec<Seen>>>,
    /// A step built at the time of the request (for dates).
    dated: Arc<Mutex<Option<Dated>>>,
}

impl Upstream {
    fn requests(&self) -> usize {
        self.seen.lock().unwrap().len()
    }
    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

/// Reads one request (head and `content-length` body); `None` at the connection's end.
async fn read_request(s: &mut TcpStream) -> Option<String> {
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        if buf.len() > 64 * 1024 {
            return None;
        }
        match s.read(&mut byte).await {
            Ok(1) => buf.push(byte[0]),
            _ => return None,
        }
    }
    let head = String::from_utf8_lossy(&buf).into_owned();
    let len = head
        .lines()
        .find_map(|l| {
            let (n, v) = l.split_once(':')?;
            n.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse::<usize>().ok())?
        })
        .unwrap_or(0);
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).await.ok()?;
    Some(head)
}

/// An upstream on 127.0.0.1:0 playing `steps` (then 200 with an empty body).
async fn upstream(steps: impl IntoIterator<Item = Step>) -> (String, Upstream) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let up = Upstream::default();
    *up.steps.lock().unwrap() = steps.into_iter().collect();
    let me = up.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let me = me.clone();
            tokio::spawn(async move {
                while let Some(head) = read_request(&mut s).await {
                    let method = head.split(' ').next().unwrap_or("").to_owned();
                    me.seen.lock().unwrap().push(Seen {
                        at: Instant::now(),
                        method,
                    });
                    let step = me.steps.lock().unwrap().pop_front();
                    let dated = *me.dated.lock().unwrap();
                    let step = match (step, dated) {
                        (Some(step), _) => step,
                        (None, Some(f)) => {
                            *me.dated.lock().unwrap() = None;
                            Step::Answer(f(SystemTime::now()))
                        }
                        (None, None) => Step::Answer(answer(200, "", "")),
                    };
                    match step {
                        Step::Answer(a) => {
                            if s.write_all(a.as_bytes()).await.is_err() {
                                return;
                            }
                        }
                        Step::Split(a, wait, b) => {
                            if s.write_all(a.as_bytes()).await.is_err() {
                                return;
                            }
                            tokio::time::sleep(wait).await;
                            if s.write_all(b.as_bytes()).await.is_err() {
                                return;
                            }
                        }
                        Step::ThenClose(a) => {
                            let _ = s.write_all(a.as_bytes()).await;
                            return;
                        }
                        Step::Reset => {
                            let _ = s.set_zero_linger();
                            return;
                        }
                        Step::Silent(d) => {
                            tokio::time::sleep(d).await;
                            return;
                        }
                    }
                }
            });
        }
    });
    (format!("http://{addr}"), up)
}

fn agent(lines: &str) -> Agent {
    support::agent(&support::policy(lines))
}

type Layered = retryplane_agent::layer::Retry<
    Client<HttpConnector, ReplayBody<Full<Bytes>>>,
    retryplane_agent::layer::NoDedup,
>;

fn layered(agent: &Agent) -> Layered {
    let client = Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    RetryLayer::new(agent.endpoint("ep")).layer(client)
}

fn request(method: &str, url: &str, headers: &[(&str, &str)]) -> http::Request<Full<Bytes>> {
    let mut b = http::Request::builder()
        .method(method)
        .uri(format!("{url}/v1/x"));
    for (n, v) in headers {
        b = b.header(*n, *v);
    }
    b.body(Full::new(Bytes::from_static(b"pay"))).unwrap()
}

/// Status and, for a response the call gave up on, its cause.
async fn send(
    svc: &Layered,
    req: http::Request<Full<Bytes>>,
) -> Result<(u16, Option<GaveUp>, Bytes), retryplane_agent::layer::BoxError> {
    let r = tokio::time::timeout(WAIT, svc.clone().oneshot(req))
        .await
        .expect("the call ends")?;
    let status = r.status().as_u16();
    let gave_up = r.extensions().get::<GaveUp>().copied();
    let body = tokio::time::timeout(WAIT, r.into_body().collect())
        .await
        .expect("the body ends")
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    Ok((status, gave_up, body))
}

#[tokio::test]
async fn a_503_whose_connection_closes_mid_body_is_retried_and_the_next_answer_returned() {
    let cut = "HTTP/1.1 503 X\r\ncontent-length: 100\r\n\r\nabc".to_owned();
    let (url, up) = upstream([Step::ThenClose(cut)]).await;
    let agent = agent("max_attempts: 3\nbackoff: {base: 5ms, max: 5ms, jitter: none}");
    let svc = layered(&agent);
    let (status, gave_up, _) = send(&svc, request("GET", &url, &[])).await.unwrap();
    assert_eq!((status, gave_up), (200, None));
    assert_eq!(up.requests(), 2);
    let c = agent.endpoint("ep").pending_counts();
    assert_eq!(
        (c.calls, c.attempts, c.retries, c.success_after_retry),
        (1, 2, 1, 1)
    );
}

#[tokio::test]
async fn a_429_with_retry_after_in_seconds_is_waited_before_the_retry() {
    let (url, up) = upstream([Step::Answer(answer(429, "retry-after: 1\r\n", ""))]).await;
    let agent = agent("max_attempts: 3\nbackoff: {base: 5ms, max: 5ms, jitter: none}");
    let svc = layered(&agent);
    let (status, _, _) = send(&svc, request("GET", &url, &[])).await.unwrap();
    assert_eq!(status, 200);
    let seen = up.seen();
    assert_eq!(seen.len(), 2);
    let gap = seen[1].at - seen[0].at;
    assert!(gap >= Duration::from_secs(1), "{gap:?}");
    assert!(gap < Duration::from_secs(3), "{gap:?}");
    assert_eq!(agent.endpoint("ep").pending_counts().retry_after_honored, 1);
}

fn dated_429(now: SystemTime) -> String {
    answer(
        429,
        &format!(
            "date: {}\r\nretry-after: {}\r\n",
            format_http_date(now),
            format_http_date(now + Duration::from_secs(2))
        ),
        "",
    )
}

#[tokio::test]
async fn a_429_with_retry_after_as_a_date_is_waited_before_the_retry() {
    let (url, up) = upstream([]).await;
    *up.dated.lock().unwrap() = Some(dated_429);
    let agent = agent("max_attempts: 3\nbackoff: {base: 5ms, max: 5ms, jitter: none}");
    let svc = layered(&agent);
    let (status, _, _) = send(&svc, request("GET", &url, &[])).await.unwrap();
    assert_eq!(status, 200);
    let seen = up.seen();
    assert_eq!(seen.len(), 2);
    let gap = seen[1].at - seen[0].at;
    assert!(gap >= Duration::from_secs(2), "{gap:?}");
    assert!(gap < Duration::from_secs(4), "{gap:?}");
}

#[tokio::test]
async fn a_retry_after_above_its_max_gives_up_at_once_with_the_429() {
    let (url, up) = upstream([Step::Answer(answer(429, "retry-after: 31\r\n", "slow"))]).await;
    let agent = agent(
        "max_attempts: 3\nbackoff: {base: 5ms, max: 5ms, jitter: none}\nretry_after: {honor: true, max: 30s}",
    );
    let svc = layered(&agent);
    let started = Instant::now();
    let (status, gave_up, body) = send(&svc, request("GET", &url, &[])).await.unwrap();
    assert!(started.elapsed() < Duration::from_secs(2));
    assert_eq!(status, 429);
    assert_eq!(&body[..], b"slow");
    assert_eq!(
        gave_up.map(|g| (g.cause, g.attempts)),
        Some((Cause::GaveUp(GiveUpCause::RetryAfterTooLong), 1))
    );
    assert_eq!(up.requests(), 1);
    assert_eq!(agent.endpoint("ep").pending_counts().gave_up_retry_after, 1);
}

#[tokio::test]
async fn a_reset_get_is_retried_a_reset_post_only_with_its_key() {
    let lines = "max_attempts: 3\nbackoff: {base: 5ms, max: 5ms, jitter: none}";
    let (url, up) = upstream([Step::Reset]).await;
    let svc = layered(&agent(lines));
    let (status, _, _) = send(&svc, request("GET", &url, &[])).await.unwrap();
    assert_eq!((status, up.requests()), (200, 2));

    let (url, up) = upstream([Step::Reset]).await;
    let svc = layered(&agent(lines));
    send(&svc, request("POST", &url, &[]))
        .await
        .expect_err("a reset POST is not retried");
    assert_eq!(up.requests(), 1);

    let (url, up) = upstream([Step::Reset]).await;
    let svc = layered(&agent(lines));
    let (status, _, _) = send(&svc, request("POST", &url, &[("idempotency-key", "k1")]))
        .await
        .unwrap();
    assert_eq!((status, up.requests()), (200, 2));
    assert!(up.seen().iter().all(|s| s.method == "POST"));
}

#[tokio::test]
async fn a_slow_head_is_cut_by_the_per_try_timeout_and_retried() {
    let (url, up) = upstream([Step::Silent(Duration::from_secs(5))]).await;
    let agent = agent(
        "max_attempts: 2\nbackoff: {base: 5ms, max: 5ms, jitter: none}\nper_try_timeout: 300ms\ndeadline: 5s",
    );
    let svc = layered(&agent);
    let started = Instant::now();
    let (status, _, _) = send(&svc, request("GET", &url, &[])).await.unwrap();
    assert_eq!(status, 200);
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(4),
        "{took:?}"
    );
    assert_eq!(up.requests(), 2);
}

#[tokio::test]
async fn a_slow_head_past_the_deadline_ends_the_call_by_its_deadline() {
    let (url, up) = upstream([Step::Silent(Duration::from_secs(5))]).await;
    let agent = agent(
        "max_attempts: 3\nbackoff: {base: 5ms, max: 5ms, jitter: none}\nper_try_timeout: 400ms\ndeadline: 400ms",
    );
    let svc = layered(&agent);
    let started = Instant::now();
    let err = send(&svc, request("GET", &url, &[]))
        .await
        .expect_err("timed out");
    let took = started.elapsed();
    assert!(took < Duration::from_secs(3), "{took:?}");
    let e = err
        .downcast_ref::<retryplane_agent::layer::RetryError>()
        .expect("a retry error");
    assert!(
        matches!(e, retryplane_agent::layer::RetryError::TimedOut { .. }),
        "{e:?}"
    );
    assert_eq!(up.requests(), 1);
}

#[tokio::test]
async fn a_503_with_a_slow_head_then_200_keeps_the_backoff_schedule() {
    let (url, up) = upstream([
        Step::Split(
            String::new(),
            Duration::from_millis(50),
            answer(503, "", ""),
        ),
        Step::Answer(answer(503, "", "")),
    ])
    .await;
    let agent =
        agent("max_attempts: 3\nbackoff: {base: 100ms, max: 1s, multiplier: 2.0, jitter: none}");
    let svc = layered(&agent);
    let (status, _, _) = send(&svc, request("GET", &url, &[])).await.unwrap();
    assert_eq!(status, 200);
    let seen = up.seen();
    assert_eq!(seen.len(), 3);
    let g1 = seen[1].at - seen[0].at;
    let g2 = seen[2].at - seen[1].at;
    assert!(
        g1 >= Duration::from_millis(150) && g1 < Duration::from_secs(2),
        "{g1:?}"
    );
    assert!(
        g2 >= Duration::from_millis(200) && g2 < Duration::from_secs(2),
        "{g2:?}"
    );
}

#[tokio::test]
async fn dropping_the_call_during_its_pause_sends_nothing_more() {
    let (url, up) = upstream([Step::Answer(answer(503, "", ""))]).await;
    let agent = agent("max_attempts: 3\nbackoff: {base: 1500ms, max: 1500ms, jitter: none}");
    let svc = layered(&agent);
    let call = svc.clone().oneshot(request("GET", &url, &[]));
    // Long enough for the first answer (also on a loaded machine), well inside the pause.
    let r = tokio::time::timeout(Duration::from_millis(700), call).await;
    assert!(r.is_err(), "the call is still pausing");
    assert_eq!(up.requests(), 1);
    // Past where the pause would have ended (about 1.5 s after the first answer).
    tokio::time::sleep(Duration::from_millis(1_300)).await;
    assert_eq!(up.requests(), 1, "no attempt after the drop");
    let c = agent.endpoint("ep").pending_counts();
    assert_eq!((c.calls, c.attempts, c.retries), (1, 1, 0), "{c:?}");
}

#[tokio::test]
async fn the_breaker_opens_refuses_without_a_request_and_closes_after_a_good_probe() {
    let (url, up) = upstream([
        Step::Answer(answer(503, "", "")),
        Step::Answer(answer(503, "", "")),
    ])
    .await;
    let agent = support::agent(
        "version: 1\ndefaults:\n  backoff: {base: 5ms, max: 5ms, jitter: none}\n  budget: {enabled: false}\n  circuit_breaker: {failure_ratio: 0.5, min_requests: 2, window: 10s, open_for: 300ms, half_open_probes: 1}\nendpoints:\n  ep:\n    max_attempts: 1\n",
    );
    let svc = layered(&agent);
    for _ in 0..2 {
        let (status, _, _) = send(&svc, request("GET", &url, &[])).await.unwrap();
        assert_eq!(status, 503);
    }
    let err = send(&svc, request("GET", &url, &[]))
        .await
        .expect_err("open");
    let e = err
        .downcast_ref::<retryplane_agent::layer::RetryError>()
        .expect("a retry error");
    assert!(format!("{e}").contains("circuit_open"), "{e}");
    assert_eq!(up.requests(), 2);
    tokio::time::sleep(Duration::from_millis(350)).await;
    let (status, _, _) = send(&svc, request("GET", &url, &[])).await.unwrap();
    assert_eq!(status, 200);
    let (status, _, _) = send(&svc, request("GET", &url, &[])).await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(up.requests(), 4);
    assert_eq!(agent.endpoint("ep").pending_counts().circuit_open, 1);
}

#[tokio::test]
async fn a_body_over_the_limit_is_sent_once_whatever_the_answer() {
    let (url, up) = upstream([Step::Answer(answer(503, "", ""))]).await;
    let agent = agent("max_attempts: 3\nbackoff: {base: 5ms, max: 5ms, jitter: none}");
    let client = Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let svc = RetryLayer::new(agent.endpoint("ep"))
        .with_body_limit(2)
        .layer(client);
    let r = tokio::time::timeout(
        WAIT,
        svc.oneshot(request("PUT", &url, &[("idempotency-key", "k")])),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(r.status(), 503);
    assert_eq!(
        r.extensions().get::<GaveUp>().map(|g| g.cause),
        Some(Cause::GaveUp(GiveUpCause::NotRetryable))
    );
    assert_eq!(up.requests(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_calls_under_budget_and_breaker_count_every_request_the_upstream_saw() {
    // Two of every three answers are 503s; some requests are reset or slow.
    let mut steps = Vec::new();
    for i in 0..400 {
        steps.push(match i % 7 {
            0 | 3 => Step::Answer(answer(200, "", "ok")),
            1 => Step::Reset,
            2 => Step::Silent(Duration::from_millis(400)),
            4 => Step::Answer(answer(429, "retry-after: 0\r\n", "")),
            5 => Step::ThenClose("HTTP/1.1 503 X\r\ncontent-length: 10\r\n\r\nab".to_owned()),
            _ => Step::Answer(answer(503, "", "no")),
        });
    }
    let (url, up) = upstream(steps).await;
    let agent = support::agent(
        "version: 1\ndefaults:\n  backoff: {base: 5ms, max: 20ms, jitter: full}\n  per_try_timeout: 150ms\n  deadline: 2s\n  budget: {ratio: 0.3, min_per_second: 2, window: 10s}\n  circuit_breaker: {failure_ratio: 0.9, min_requests: 50, window: 10s, open_for: 100ms, half_open_probes: 2}\nendpoints:\n  ep:\n    max_attempts: 4\n",
    );
    let svc = layered(&agent);
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..60 {
        let svc = svc.clone();
        let url = url.clone();
        tasks.spawn(async move {
            let method = if i % 4 == 0 { "POST" } else { "GET" };
            send(&svc, request(method, &url, &[])).await.map(|r| r.0)
        });
    }
    let mut ok = 0;
    while let Some(r) = tasks.join_next().await {
        if matches!(r.unwrap(), Ok(200)) {
            ok += 1;
        }
    }
    let c = agent.endpoint("ep").pending_counts();
    let outcomes = c.success_first_try
        + c.success_after_retry
        + c.gave_up_attempts
        + c.gave_up_budget
        + c.gave_up_deadline
        + c.gave_up_retry_after
        + c.gave_up_not_retryable
        + c.circuit_open
        + c.cancelled;
    assert_eq!(c.calls, 60, "{c:?}");
    assert_eq!(outcomes, 60, "{c:?}");
    assert_eq!(c.success_first_try + c.success_after_retry, ok, "{c:?}");
    assert!(c.attempts - c.retries <= c.calls, "{c:?}");
    assert_eq!(up.requests() as u64, c.attempts, "{c:?}");
}

#[tokio::test]
async fn a_failed_calls_log_lines_hold_no_query_userinfo_header_or_body() {
    let (url, _up) = upstream([
        Step::Answer(answer(503, "x-secret: HDRSECRET\r\n", "BODYSECRET")),
        Step::Answer(answer(503, "", "BODYSECRET")),
        Step::Answer(answer(503, "", "BODYSECRET")),
    ])
    .await;
    let (logs, _guard) = support::capture_logs("retryplane_agent=debug");
    let agent = agent("max_attempts: 3\nbackoff: {base: 5ms, max: 5ms, jitter: none}");
    let svc = layered(&agent);
    let url = url.replace("http://", "http://USERSECRET:PASSSECRET@");
    let req = http::Request::get(format!("{url}/v1/items?token=QUERYSECRET"))
        .header("authorization", "Bearer AUTHSECRET")
        .body(Full::new(Bytes::from_static(b"REQSECRET")))
        .unwrap();
    let (status, _, _) = send(&svc, req).await.unwrap();
    assert_eq!(status, 503);
    let text = logs.text();
    assert!(text.contains("call failed"), "{text}");
    assert!(text.contains("/v1/items"), "{text}");
    assert!(!text.contains("SECRET"), "{text}");
}

/// An agent whose `ep` makes 3 attempts, with a breaker that opens at half of 4 attempts.
fn guarded() -> Agent {
    support::agent(
        "version: 1\ndefaults:\n  backoff: {base: 5ms, max: 5ms, jitter: none}\n  budget: {enabled: false}\n  circuit_breaker: {failure_ratio: 0.5, min_requests: 4, window: 10s, open_for: 30s, half_open_probes: 1}\nendpoints:\n  ep:\n    max_attempts: 3\n",
    )
}

#[tokio::test]
async fn a_request_the_client_refuses_to_send_is_not_retried_nor_held_against_the_upstream() {
    // A call site that builds a relative URI (a bug of its own: hyper-util refuses it before
    // any connection) sends nothing. It should fail at once, not be retried as if the
    // upstream had reset it, and not open the breaker on the upstream that every other call
    // site reaches fine.
    let (url, up) = upstream([]).await;
    let agent = guarded();
    let svc = layered(&agent);
    let relative = || {
        http::Request::get("/v1/x")
            .body(Full::new(Bytes::new()))
            .unwrap()
    };
    send(&svc, relative()).await.expect_err("no absolute URI");
    let c = agent.endpoint("ep").pending_counts();
    assert_eq!(c.attempts, 1, "the client's refusal was retried: {c:?}");
    for _ in 0..3 {
        send(&svc, relative()).await.expect_err("no absolute URI");
    }
    let served = send(&svc, request("GET", &url, &[])).await;
    assert!(
        matches!(served, Ok((200, None, _))),
        "a good request to a healthy upstream was refused: {served:?}"
    );
    assert_eq!(up.requests(), 1);
}

#[tokio::test]
async fn an_https_url_through_an_http_only_connector_does_not_open_the_breaker() {
    // The same for a URL whose scheme the connector refuses (hyper-util's `HttpConnector`
    // enforces `http`): nothing was sent, nothing about the upstream was learnt.
    let (url, up) = upstream([]).await;
    let agent = guarded();
    let svc = layered(&agent);
    for _ in 0..4 {
        let https = url.replace("http://", "https://");
        send(&svc, request("GET", &https, &[]))
            .await
            .expect_err("no TLS connector");
    }
    let served = send(&svc, request("GET", &url, &[])).await;
    assert!(
        matches!(served, Ok((200, None, _))),
        "a good request to a healthy upstream was refused: {served:?}"
    );
    assert_eq!(up.requests(), 1);
}

/// An agent whose `ep` retries 503 only, with a breaker that opens at half of 4 attempts.
fn narrowed_retry_on() -> Agent {
    support::agent(
        "version: 1\ndefaults:\n  backoff: {base: 5ms, max: 5ms, jitter: none}\n  budget: {enabled: false}\n  retry_on: {http_status: [503], errors: [connect, reset, timeout]}\n  circuit_breaker: {failure_ratio: 0.5, min_requests: 4, window: 10s, open_for: 30s, half_open_probes: 1}\nendpoints:\n  ep:\n    max_attempts: 1\n",
    )
}

#[tokio::test]
async fn an_upstream_answering_only_500s_opens_the_breaker_though_retry_on_lists_503_alone() {
    // The breaker guards the upstream's health; which statuses are worth a retry is another
    // question. An upstream that answers every request with a 500 (or 502, 504) is failing
    // whatever `retry_on` says, as a reset one is (a reset counts even when `errors` is empty).
    let steps = (0..10).map(|_| Step::Answer(answer(500, "", "down")));
    let (url, up) = upstream(steps).await;
    let agent = narrowed_retry_on();
    let svc = layered(&agent);
    for _ in 0..8 {
        let _ = send(&svc, request("GET", &url, &[])).await;
    }
    assert!(
        up.requests() < 8,
        "{} requests reached an upstream that failed every one; the breaker never opened",
        up.requests()
    );
    assert!(agent.endpoint("ep").pending_counts().circuit_open > 0);
}

#[tokio::test]
async fn an_upstream_resetting_every_request_opens_the_breaker_whatever_retry_on_lists() {
    // The counterpart that holds: transport failures count whether or not `retry_on` lists them.
    let steps = (0..10).map(|_| Step::Reset);
    let (url, up) = upstream(steps).await;
    let agent = support::agent(
        "version: 1\ndefaults:\n  backoff: {base: 5ms, max: 5ms, jitter: none}\n  budget: {enabled: false}\n  retry_on: {http_status: [503], errors: []}\n  circuit_breaker: {failure_ratio: 0.5, min_requests: 4, window: 10s, open_for: 30s, half_open_probes: 1}\nendpoints:\n  ep:\n    max_attempts: 1\n",
    );
    let svc = layered(&agent);
    for _ in 0..8 {
        let _ = send(&svc, request("GET", &url, &[])).await;
    }
    assert_eq!(up.requests(), 4);
    assert_eq!(agent.endpoint("ep").pending_counts().circuit_open, 4);
}

/// `Endpoint::call` with reqwest, the whole answer read inside each attempt.
#[cfg(feature = "reqwest")]
mod through_reqwest {
    use super::*;
    use retryplane_agent::{CallMeta, CancellationToken};

    /// One GET of `url` under `agent`'s `ep`, each attempt reading the body whole.
    async fn get(
        agent: &Agent,
        url: &str,
        meta: CallMeta<'_>,
    ) -> Result<
        http::Response<Bytes>,
        retryplane_agent::CallError<http::Response<Bytes>, reqwest::Error>,
    > {
        let client = reqwest::Client::new();
        let url = format!("{url}/v1/x");
        let ep = agent.endpoint("ep");
        let call = ep.call(meta, move |_| {
            let req = client.get(&url);
            async move {
                let r = req.send().await?;
                let (status, headers) = (r.status(), r.headers().clone());
                let body = r.bytes().await?;
                let mut answer = http::Response::new(body);
                *answer.status_mut() = status;
                *answer.headers_mut() = headers;
                Ok(answer)
            }
        });
        tokio::time::timeout(WAIT, call)
            .await
            .expect("the call ends")
    }

    #[tokio::test]
    async fn a_body_slower_than_the_per_try_timeout_is_cut_and_the_read_retried() {
        let slow = Step::Split(
            "HTTP/1.1 200 X\r\ncontent-length: 4\r\n\r\nab".to_owned(),
            Duration::from_secs(3),
            "cd".to_owned(),
        );
        let (url, up) = upstream([slow, Step::Answer(answer(200, "", "fast"))]).await;
        let agent = agent(
            "max_attempts: 2\nbackoff: {base: 5ms, max: 5ms, jitter: none}\nper_try_timeout: 300ms\ndeadline: 5s",
        );
        let started = Instant::now();
        let r = get(&agent, &url, CallMeta::http("GET", "/v1/x"))
            .await
            .unwrap();
        assert_eq!(&r.body()[..], b"fast");
        assert!(started.elapsed() < Duration::from_secs(2));
        assert_eq!(up.requests(), 2);
    }

    #[tokio::test]
    async fn a_body_the_upstream_cuts_off_is_a_reset_and_a_read_is_retried() {
        let cut = "HTTP/1.1 200 X\r\ncontent-length: 100\r\n\r\nabc".to_owned();
        let (url, up) = upstream([Step::ThenClose(cut)]).await;
        let agent = agent("max_attempts: 2\nbackoff: {base: 5ms, max: 5ms, jitter: none}");
        let r = get(&agent, &url, CallMeta::http("GET", "/v1/x"))
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(up.requests(), 2);
    }

    #[tokio::test]
    async fn a_429_with_a_dated_retry_after_is_waited() {
        let (url, up) = upstream([]).await;
        *up.dated.lock().unwrap() = Some(dated_429);
        let agent = agent("max_attempts: 2\nbackoff: {base: 5ms, max: 5ms, jitter: none}");
        let r = get(&agent, &url, CallMeta::http("GET", "/v1/x"))
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let seen = up.seen();
        let gap = seen[1].at - seen[0].at;
        assert!(
            gap >= Duration::from_secs(2) && gap < Duration::from_secs(4),
            "{gap:?}"
        );
    }

    #[tokio::test]
    async fn a_token_cancelled_mid_attempt_ends_the_call_and_nothing_more_is_sent() {
        let (url, up) = upstream([Step::Silent(Duration::from_secs(5))]).await;
        let agent = agent(
            "max_attempts: 3\nbackoff: {base: 5ms, max: 5ms, jitter: none}\nper_try_timeout: 2s\ndeadline: 6s",
        );
        let token = CancellationToken::new();
        let cancel = token.clone();
        let watcher = up.clone();
        tokio::spawn(async move {
            for _ in 0..1000 {
                if watcher.requests() == 1 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            cancel.cancel();
        });
        let started = Instant::now();
        let err = get(
            &agent,
            &url,
            CallMeta::http("GET", "/v1/x").with_cancel(token),
        )
        .await
        .unwrap_err();
        assert_eq!(err.cause, Cause::Cancelled);
        assert!(started.elapsed() < Duration::from_secs(1));
        let c = agent.endpoint("ep").pending_counts();
        assert_eq!(
            (c.calls, c.attempts, c.retries, c.cancelled),
            (1, 1, 0, 1),
            "{c:?}"
        );
        assert_eq!(up.requests(), 1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_open_lets_exactly_its_probes_through_and_closes_when_they_succeed() {
    let mut steps = vec![
        Step::Answer(answer(503, "", "")),
        Step::Answer(answer(503, "", "")),
    ];
    // The probes answer after a while (1 s: long for a loaded machine too), so that the other
    // calls meet the breaker half-open.
    for _ in 0..2 {
        steps.push(Step::Split(
            String::new(),
            Duration::from_secs(1),
            answer(200, "", "ok"),
        ));
    }
    let (url, up) = upstream(steps).await;
    let agent = support::agent(
        "version: 1\ndefaults:\n  backoff: {base: 5ms, max: 5ms, jitter: none}\n  budget: {enabled: false}\n  circuit_breaker: {failure_ratio: 0.5, min_requests: 2, window: 10s, open_for: 200ms, half_open_probes: 2}\nendpoints:\n  ep:\n    max_attempts: 1\n",
    );
    let svc = layered(&agent);
    for _ in 0..2 {
        assert_eq!(send(&svc, request("GET", &url, &[])).await.unwrap().0, 503);
    }
    tokio::time::sleep(Duration::from_millis(250)).await;
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..5 {
        let (svc, url) = (svc.clone(), url.clone());
        tasks.spawn(async move { send(&svc, request("GET", &url, &[])).await.map(|r| r.0) });
    }
    let (mut ok, mut refused) = (0, 0);
    while let Some(r) = tasks.join_next().await {
        match r.unwrap() {
            Ok(200) => ok += 1,
            Err(e) if e.to_string().contains("circuit_open") => refused += 1,
            other => panic!("{other:?}"),
        }
    }
    assert_eq!((ok, refused), (2, 3));
    assert_eq!(up.requests(), 4);
    // Closed: every call goes through again.
    for _ in 0..5 {
        assert_eq!(send(&svc, request("GET", &url, &[])).await.unwrap().0, 200);
    }
    assert_eq!(up.requests(), 9);
}

#[tokio::test]
async fn dropping_the_call_mid_attempt_sends_nothing_more_and_counts_it_cancelled() {
    let (url, up) = upstream([Step::Silent(Duration::from_secs(3))]).await;
    let agent = agent(
        "max_attempts: 3\nbackoff: {base: 5ms, max: 5ms, jitter: none}\nper_try_timeout: 200ms\ndeadline: 5s",
    );
    let svc = layered(&agent);
    let call = svc.clone().oneshot(request("GET", &url, &[]));
    let watcher = up.clone();
    let seen = async move {
        for _ in 0..1000 {
            if watcher.requests() == 1 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        panic!("the first attempt never came");
    };
    tokio::select! {
        r = call => panic!("the call ended first: {:?}", r.map(|r| r.status())),
        () = seen => {}
    }
    // Past the per-try timeout and the pause, when a retry would have gone.
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(up.requests(), 1, "no attempt after the drop");
    let c = agent.endpoint("ep").pending_counts();
    assert_eq!(
        (c.calls, c.attempts, c.retries, c.cancelled),
        (1, 1, 0, 1),
        "{c:?}"
    );
}

#[tokio::test]
async fn a_route_that_retries_no_status_still_feeds_its_503s_to_the_endpoints_breaker() {
    // `retry_on: {http_status: []}` on a POST route says "do not retry its answers"; the
    // breaker is the endpoint's, shared by every route, and the upstream behind it answers
    // every request with a 503.
    let steps = (0..10).map(|_| Step::Answer(answer(503, "", "down")));
    let (url, up) = upstream(steps).await;
    let agent = support::agent(
        "version: 1\ndefaults:\n  backoff: {base: 5ms, max: 5ms, jitter: none}\n  budget: {enabled: false}\n  circuit_breaker: {failure_ratio: 0.5, min_requests: 4, window: 10s, open_for: 30s, half_open_probes: 1}\nendpoints:\n  ep:\n    max_attempts: 1\n    routes:\n      - match: {method: POST, path_prefix: /v1/x}\n        retry_on: {http_status: []}\n",
    );
    let svc = layered(&agent);
    for _ in 0..8 {
        let _ = send(&svc, request("POST", &url, &[])).await;
    }
    assert!(
        up.requests() < 8,
        "{} requests reached an upstream that answered 503 to every one; the breaker never opened",
        up.requests()
    );
}

#[tokio::test]
async fn the_budget_lets_its_reserve_of_retries_through_then_returns_the_503() {
    // Reserve: 1/s × 2 s = 2 retries; no ratio. Every first attempt is a 503, every retry a 200.
    let steps = [503, 200, 503, 200, 503, 503].map(|s| Step::Answer(answer(s, "", "")));
    let (url, up) = upstream(steps).await;
    let agent = agent(
        "max_attempts: 2\nbackoff: {base: 5ms, max: 5ms, jitter: none}\nbudget: {enabled: true, ratio: 0.0, min_per_second: 1, window: 2s}",
    );
    let svc = layered(&agent);
    let mut got = Vec::new();
    for _ in 0..4 {
        let (status, gave_up, _) = send(&svc, request("GET", &url, &[])).await.unwrap();
        got.push((status, gave_up.map(|g| g.cause)));
    }
    let budget = Some(Cause::GaveUp(GiveUpCause::BudgetExhausted));
    assert_eq!(
        got,
        [(200, None), (200, None), (503, budget), (503, budget)]
    );
    assert_eq!(up.requests(), 6);
    let c = agent.endpoint("ep").pending_counts();
    assert_eq!((c.calls, c.retries, c.gave_up_budget), (4, 2, 2), "{c:?}");
}

/// The layer over a `reqwest::Client`, through the `service_fn` adapter the layer's docs
/// give: a 503 is retried with its body sent again, a reset GET is retried, a reset POST is
/// not (reqwest's error judged by the hyper error below it), and a 503 given up on comes back
/// marked.
#[tokio::test]
async fn the_layer_over_reqwest_through_the_documented_adapter_follows_the_policy() {
    use retryplane_agent::layer::BoxError;
    use tower::service_fn;

    let http = reqwest::Client::new();
    let send = service_fn(move |request: http::Request<ReplayBody<Full<Bytes>>>| {
        let http = http.clone();
        async move {
            let request = reqwest::Request::try_from(request.map(reqwest::Body::wrap))?;
            let response = http.execute(request).await?;
            Ok::<_, BoxError>(http::Response::<reqwest::Body>::from(response))
        }
    });
    let agent = agent("max_attempts: 2\nbackoff: {base: 5ms, max: 5ms, jitter: none}");
    let client = RetryLayer::new(agent.endpoint("ep")).layer(send);
    let call = |req| {
        let client = client.clone();
        async move {
            tokio::time::timeout(WAIT, client.oneshot(req))
                .await
                .expect("the call ends")
        }
    };

    let (url, up) = upstream([Step::Answer(answer(503, "", "busy"))]).await;
    let response = call(request("PUT", &url, &[])).await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(up.requests(), 2);

    let (url, up) = upstream([Step::Reset]).await;
    let response = call(request("GET", &url, &[])).await.unwrap();
    assert_eq!((response.status().as_u16(), up.requests()), (200, 2));

    let (url, up) = upstream([Step::Reset]).await;
    call(request("POST", &url, &[]))
        .await
        .expect_err("a reset POST is not retried");
    assert_eq!(up.requests(), 1);

    let busy = Step::Answer(answer(503, "", "busy"));
    let (url, up) = upstream([busy.clone(), busy]).await;
    let response = call(request("GET", &url, &[])).await.unwrap();
    assert_eq!(response.status(), 503);
    assert_eq!(
        response
            .extensions()
            .get::<GaveUp>()
            .map(|g| (g.cause, g.attempts)),
        Some((Cause::GaveUp(GiveUpCause::AttemptsExhausted), 2))
    );
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], b"busy");
    assert_eq!(up.requests(), 2);
}
