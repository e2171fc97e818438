//! The tower layer against a scripted `service_fn`, under paused tokio time.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body::Frame;
use http_body_util::{BodyExt as _, Empty, Full, StreamBody};
use retryplane_agent::layer::{
    BoxError, GaveUp, ReplayBody, ResponseBody, Retry, RetryError, RetryLayer,
};
use retryplane_agent::{Agent, Cause, GiveUpCause};
use support::{Sent, agent, capture_logs, policy, status_upstream as upstream};
use tokio::time::Instant;
use tower::{Layer as _, ServiceExt as _, service_fn};

fn request(method: &str, key: bool, body: &'static str) -> Request<Full<Bytes>> {
    let mut b = Request::builder()
        .method(method)
        .uri("http://up/v1/things?x=1");
    if key {
        b = b.header("idempotency-key", "k-1");
    }
    b.body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap()
}

/// The plain layer of `agent`'s endpoint `ep` over an upstream answering `statuses` (then
/// 200), and what that upstream sees.
#[allow(clippy::type_complexity)]
fn client<B>(
    agent: &Agent,
    statuses: &[u16],
) -> (
    Retry<
        impl tower::Service<
            Request<ReplayBody<B>>,
            Response = Response<Empty<Bytes>>,
            Error = Infallible,
            Future = impl Send,
        > + Clone
        + Send
        + Sync
        + 'static,
    >,
    support::Seen,
)
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: std::fmt::Debug,
{
    let (svc, seen) = upstream(statuses);
    (RetryLayer::new(agent.endpoint("ep")).layer(svc), seen)
}

/// Sends `req` once through the client `layer` makes of an upstream answering `statuses`
/// (then 200): the response, and what the upstream saw.
async fn call_through<B>(
    layer: RetryLayer,
    statuses: &[u16],
    req: Request<B>,
) -> (Response<ResponseBody<Empty<Bytes>>>, Vec<Sent>)
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError> + std::fmt::Debug,
{
    let (svc, seen) = upstream(statuses);
    let response = layer.layer(svc).oneshot(req).await.unwrap();
    let seen = seen.lock().unwrap().clone();
    (response, seen)
}

/// [`call_through`] the plain layer of `agent`'s endpoint `ep`.
async fn call<B>(
    agent: &Agent,
    statuses: &[u16],
    req: Request<B>,
) -> (Response<ResponseBody<Empty<Bytes>>>, Vec<Sent>)
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError> + std::fmt::Debug,
{
    call_through(RetryLayer::new(agent.endpoint("ep")), statuses, req).await
}

/// `response` is a `status` the call gave up on for `cause`, after one attempt.
fn assert_gave_up_after_one<B>(response: &Response<B>, status: u16, cause: GiveUpCause) {
    assert_eq!(response.status(), status);
    let gave_up = response.extensions().get::<GaveUp>().unwrap();
    assert_eq!(gave_up.cause, Cause::GaveUp(cause));
    assert_eq!(gave_up.attempts, 1);
}

#[tokio::test(start_paused = true)]
async fn a_503_then_200_is_retried_with_the_body_replayed() {
    let agent = agent(&policy("max_attempts: 3"));
    let (response, seen) = call(&agent, &[503], request("PUT", false, "hello")).await;
    assert_eq!(response.status(), 200);
    assert!(response.extensions().get::<GaveUp>().is_none());
    assert_eq!(seen.len(), 2);
    for sent in &seen {
        assert_eq!(sent.method, "PUT");
        assert_eq!(sent.body, "hello");
    }
    assert_eq!(seen[1].at - seen[0].at, Duration::from_millis(100));
}

#[tokio::test(start_paused = true)]
async fn a_body_over_the_limit_is_sent_once_and_whole() {
    let agent = agent(&policy("max_attempts: 3"));
    let limited = || RetryLayer::new(agent.endpoint("ep")).with_body_limit(4);
    // A known size over the limit.
    let (response, seen) =
        call_through(limited(), &[503], request("PUT", true, "hello world")).await;
    assert_gave_up_after_one(&response, 503, GiveUpCause::NotRetryable);
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].body, "hello world");

    // An unknown size, found over the limit while reading: the bytes read are sent first.
    let chunks = ["abc", "def", "ghi"]
        .map(|c| Ok::<_, Infallible>(Frame::data(Bytes::from_static(c.as_bytes()))));
    let body = StreamBody::new(tokio_stream::iter(chunks));
    let req = Request::builder()
        .method("GET")
        .uri("/s")
        .body(body)
        .unwrap();
    let (response, seen) = call_through(limited(), &[503], req).await;
    assert_eq!(response.status(), 503);
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].body, "abcdefghi");
    // Each call is in the endpoint's counts as one attempt given up as not retryable.
    let c = agent.endpoint("ep").pending_counts();
    assert_eq!(
        (c.calls, c.attempts, c.retries, c.gave_up_not_retryable),
        (2, 2, 0, 2)
    );
}

#[tokio::test(start_paused = true)]
async fn post_without_the_key_is_not_retried_and_with_it_is() {
    let agent = agent(&policy("max_attempts: 3"));
    let (response, seen) = call(&agent, &[503], request("POST", false, "pay")).await;
    assert_eq!(response.status(), 503);
    assert_eq!(
        response.extensions().get::<GaveUp>().unwrap().cause,
        Cause::GaveUp(GiveUpCause::NotRetryable)
    );
    assert_eq!(seen.len(), 1);

    let (response, seen) = call(&agent, &[503], request("POST", true, "pay")).await;
    assert_eq!(response.status(), 200);
    assert_eq!(seen.len(), 2);
}

#[tokio::test(start_paused = true)]
async fn a_route_is_chosen_by_the_path_the_server_serves_not_by_a_prefix_it_only_seems_to_have() {
    // Searches are POSTs that may be repeated; charges are not. `/v1/search/../charges` is a
    // charge to the server (it resolves dot segments, as an `http::Uri` does not): not retried.
    let agent = agent(&policy(
        "max_attempts: 3\nroutes:\n  - match: {method: POST, path_prefix: /v1/search}\n    idempotent_methods: [POST]",
    ));
    let post = |uri: &str| {
        Request::builder()
            .method("POST")
            .uri(uri)
            .body(Full::new(Bytes::from_static(b"q")))
            .unwrap()
    };
    let (response, seen) = call(&agent, &[503], post("http://up/v1/search/../charges")).await;
    assert_gave_up_after_one(&response, 503, GiveUpCause::NotRetryable);
    assert_eq!(seen.len(), 1);
    // Spelled with escaped dots, or with `\` (a URL parser's, and IIS', `/`), too; and a
    // search reached through dots is one.
    for uri in [
        "http://up/v1/search/%2e%2E/charges",
        "http://up/v1/search\\..\\charges",
    ] {
        let (_, seen) = call(&agent, &[503], post(uri)).await;
        assert_eq!(seen.len(), 1, "{uri}");
    }
    let (response, seen) = call(&agent, &[503], post("http://up/v1/charges/../search?q=1")).await;
    assert_eq!(response.status(), 200);
    assert_eq!(seen.len(), 2);
}

#[tokio::test(start_paused = true)]
async fn an_extension_method_in_lower_case_is_not_taken_for_its_standard_namesake() {
    // Methods are case-sensitive (RFC 9110 §9.1): `get` is not `GET`, so not idempotent.
    let agent = agent(&policy("max_attempts: 3"));
    let (response, seen) = call(&agent, &[503], request("get", false, "")).await;
    assert_eq!(response.status(), 503);
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].method, "get");

    let (response, seen) = call(&agent, &[503], request("GET", false, "")).await;
    assert_eq!(response.status(), 200);
    assert_eq!(seen.len(), 2);
}

#[tokio::test(start_paused = true)]
async fn attempts_running_out_return_the_last_response_marked() {
    let agent = agent(&policy("max_attempts: 2"));
    let (response, seen) = call(&agent, &[503, 502], request("GET", false, "")).await;
    assert_eq!(response.status(), 502);
    assert_eq!(
        response.extensions().get::<GaveUp>(),
        Some(&GaveUp {
            cause: Cause::GaveUp(GiveUpCause::AttemptsExhausted),
            attempts: 2
        })
    );
    assert_eq!(seen.len(), 2);
}

#[tokio::test(start_paused = true)]
async fn connection_refused_errors_are_retried_and_returned() {
    let agent = agent(&policy("max_attempts: 2"));
    let calls = Arc::new(Mutex::new(0));
    let counted = calls.clone();
    let svc = service_fn(move |_req: Request<ReplayBody<Full<Bytes>>>| {
        *counted.lock().unwrap() += 1;
        async {
            Err::<Response<Empty<Bytes>>, _>(std::io::Error::from(
                std::io::ErrorKind::ConnectionRefused,
            ))
        }
    });
    let client = RetryLayer::new(agent.endpoint("ep")).layer(svc);
    let err = client.oneshot(request("GET", false, "")).await.unwrap_err();
    assert_eq!(
        err.downcast_ref::<std::io::Error>().unwrap().kind(),
        std::io::ErrorKind::ConnectionRefused
    );
    assert_eq!(*calls.lock().unwrap(), 2);
}

/// Long enough for any call below on tokio's paused clock (its pauses are 100 ms); a call
/// that waits for capacity nobody will release ends the test there.
const BOUND: Duration = Duration::from_secs(30);

/// Readies `client` and sends `req` through it, within [`BOUND`].
async fn ready_and_call<S>(client: &mut S, req: Request<Full<Bytes>>) -> S::Response
where
    S: tower::Service<Request<Full<Bytes>>>,
    S::Error: std::fmt::Debug,
{
    let call = async { client.ready().await?.call(req).await };
    tokio::time::timeout(BOUND, call)
        .await
        .expect("the call ends: the capacity readied for it is the one it uses")
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn an_inner_service_that_reserves_capacity_in_poll_ready_is_called_on_it() {
    // `ConcurrencyLimit` takes its permit in `poll_ready`, for that instance only: a call
    // made on a clone waits for a permit of its own, which the readied instance holds.
    let agent = agent(&policy("max_attempts: 3"));
    let (svc, seen) = upstream(&[503]);
    let limited = tower::limit::ConcurrencyLimit::new(svc, 1);
    let mut client = RetryLayer::new(agent.endpoint("ep")).layer(limited);

    // A 503, then a 200 on the second attempt (which readies a permit of its own, released
    // by the first).
    let first = ready_and_call(&mut client, request("GET", false, "")).await;
    assert_eq!(first.status(), 200);
    // The same client again: the permit of the first call went back.
    let second = ready_and_call(&mut client, request("GET", false, "")).await;
    assert_eq!(second.status(), 200);
    assert_eq!(seen.lock().unwrap().len(), 3);
    // A body over the limit (sent once) goes through the readied instance too.
    let mut once = RetryLayer::new(agent.endpoint("ep"))
        .with_body_limit(4)
        .layer(tower::limit::ConcurrencyLimit::new(upstream(&[]).0, 1));
    let answer = ready_and_call(&mut once, request("PUT", false, "hello world")).await;
    assert_eq!(answer.status(), 200);
}

#[tokio::test(start_paused = true)]
async fn a_retry_that_waits_for_capacity_gets_it_within_its_call() {
    // Two clients share one permit: the second's retry readies after the first is done.
    let agent = agent(&policy("max_attempts: 3"));
    let (svc, seen) = upstream(&[503, 503]);
    let limited = tower::limit::ConcurrencyLimit::new(svc, 1);
    let client = RetryLayer::new(agent.endpoint("ep")).layer(limited);
    let (a, b) = tokio::join!(
        tokio::time::timeout(BOUND, client.clone().oneshot(request("GET", false, ""))),
        tokio::time::timeout(BOUND, client.clone().oneshot(request("GET", false, ""))),
    );
    assert_eq!(a.expect("ends").unwrap().status(), 200);
    assert_eq!(b.expect("ends").unwrap().status(), 200);
    assert_eq!(seen.lock().unwrap().len(), 4);
    assert_eq!(agent.endpoint("ep").pending_counts().retries, 2);
}

#[tokio::test(start_paused = true)]
async fn a_refused_body_over_the_limit_is_tried_once_and_its_error_returned_at_once() {
    let agent = agent(&policy("max_attempts: 3"));
    let calls = Arc::new(Mutex::new(0));
    let counted = calls.clone();
    let svc = service_fn(move |req: Request<ReplayBody<Full<Bytes>>>| {
        *counted.lock().unwrap() += 1;
        async move {
            let body = req.into_body().collect().await.unwrap().to_bytes();
            assert_eq!(body, "hello world", "sent whole");
            Err::<Response<Empty<Bytes>>, _>(std::io::Error::from(
                std::io::ErrorKind::ConnectionRefused,
            ))
        }
    });
    let ep = agent.endpoint("ep");
    let client = RetryLayer::new(ep.clone()).with_body_limit(4).layer(svc);
    let start = Instant::now();
    // Keyed and idempotent: a buffered body would be retried on any of these failures.
    let err = client
        .oneshot(request("PUT", true, "hello world"))
        .await
        .unwrap_err();
    assert_eq!(start.elapsed(), Duration::ZERO, "no pause slept");
    assert_eq!(
        err.downcast_ref::<std::io::Error>().unwrap().kind(),
        std::io::ErrorKind::ConnectionRefused
    );
    assert_eq!(*calls.lock().unwrap(), 1);
    let counts = ep.pending_counts();
    assert_eq!(
        (
            counts.calls,
            counts.attempts,
            counts.retries,
            counts.gave_up_not_retryable,
            counts.backoff_ms
        ),
        (1, 1, 0, 1, 0)
    );
}

#[tokio::test(start_paused = true)]
async fn a_stalled_request_body_ends_the_call_at_its_deadline_with_nothing_sent() {
    let agent = agent(&policy("max_attempts: 3\ndeadline: 2s"));
    // The caller's upload sends three bytes, then nothing more, ever.
    let chunks = tokio_stream::iter([Ok::<_, Infallible>(Frame::data(Bytes::from_static(b"abc")))]);
    let stalled = StreamBody::new(tokio_stream::StreamExt::chain(
        chunks,
        tokio_stream::pending(),
    ));
    type Stalled = StreamBody<
        tokio_stream::adapters::Chain<
            tokio_stream::Iter<std::array::IntoIter<Result<Frame<Bytes>, Infallible>, 1>>,
            tokio_stream::Pending<Result<Frame<Bytes>, Infallible>>,
        >,
    >;
    let start = Instant::now();
    let called: Arc<Mutex<Vec<Duration>>> = Arc::default();
    let log = called.clone();
    let svc = service_fn(move |_req: Request<ReplayBody<Stalled>>| {
        log.lock().unwrap().push(start.elapsed());
        async { Ok::<_, Infallible>(Response::new(Empty::<Bytes>::new())) }
    });
    let client = RetryLayer::new(agent.endpoint("ep")).layer(svc);
    let req = Request::builder()
        .method("PUT")
        .uri("/s")
        .body(stalled)
        .unwrap();
    let err = tokio::time::timeout(Duration::from_secs(60), client.oneshot(req))
        .await
        .expect("the call waited for the body for ever")
        .unwrap_err();
    assert_eq!(start.elapsed(), Duration::from_secs(2));
    match err.downcast_ref::<RetryError>() {
        Some(RetryError::NoAnswer { cause }) => {
            assert_eq!(*cause, Cause::GaveUp(GiveUpCause::DeadlineExceeded));
        }
        other => panic!("expected no answer at the deadline, got {other:?}"),
    }
    assert!(called.lock().unwrap().is_empty(), "nothing is sent");
}

#[tokio::test(start_paused = true)]
async fn reading_the_request_body_counts_in_the_calls_deadline() {
    let agent = agent(&policy(
        "max_attempts: 3\ndeadline: 3s\nper_try_timeout: 1s\nbackoff: {base: 100ms, max: 100ms, jitter: none}",
    ));
    // The body's last bytes come 2.9 s after the call starts.
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, Infallible>>(1);
    let body = StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx));
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(2_900)).await;
        let _ = tx
            .send(Ok(Frame::data(Bytes::from_static(b"payload"))))
            .await;
    });
    let attempts: Arc<Mutex<Vec<Duration>>> = Arc::default();
    let log = attempts.clone();
    let start = Instant::now();
    // An upstream that never answers.
    let svc = service_fn(move |_req: Request<ReplayBody<_>>| {
        log.lock().unwrap().push(start.elapsed());
        std::future::pending::<Result<Response<Empty<Bytes>>, Infallible>>()
    });
    let client = RetryLayer::new(agent.endpoint("ep")).layer(svc);
    let req = Request::builder()
        .method("PUT")
        .uri("/s")
        .body(body)
        .unwrap();
    let err = client.oneshot(req).await.unwrap_err();
    // One attempt in the 0.1 s left; no pause fits after it.
    assert_eq!(start.elapsed(), Duration::from_secs(3));
    assert_eq!(*attempts.lock().unwrap(), [Duration::from_millis(2_900)]);
    assert!(
        matches!(
            err.downcast_ref::<RetryError>(),
            Some(RetryError::TimedOut { attempts: 1, .. })
        ),
        "{err:?}"
    );
}

/// A request body whose bytes come 2 s after the call starts, with the endpoint's policy
/// swapped at 0.5 s, while the body is being read, from `before` to `after`.
fn a_slow_body_across_a_swap(
    agent: &retryplane_agent::Agent,
    after: &str,
) -> StreamBody<tokio_stream::wrappers::ReceiverStream<Result<Frame<Bytes>, Infallible>>> {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, Infallible>>(1);
    let after = retryplane_policy::load(policy(after).as_bytes())
        .policies
        .unwrap();
    let agent = agent.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(500)).await;
        agent.set_policies(after);
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        let _ = tx
            .send(Ok(Frame::data(Bytes::from_static(b"payload"))))
            .await;
    });
    StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx))
}

/// Three attempts in 10 s before the swap; one in 1 s after it (over by the time the body is
/// read).
const BEFORE_THE_SWAP: &str = "max_attempts: 3\ndeadline: 10s\nper_try_timeout: 5s";
const AFTER_THE_SWAP: &str = "max_attempts: 1\ndeadline: 1s\nper_try_timeout: 1s";

#[tokio::test(start_paused = true)]
async fn a_call_goes_by_the_policy_read_when_it_began_though_a_swap_comes_during_its_body_read() {
    let agent = agent(&policy(BEFORE_THE_SWAP));
    let req = Request::builder()
        .method("PUT")
        .uri("/s")
        .body(a_slow_body_across_a_swap(&agent, AFTER_THE_SWAP))
        .unwrap();
    let (response, seen) = call(&agent, &[503, 503], req).await;
    // The policy of the call's start: its deadline (10 s, not 1 s already past when the body
    // came) and its three attempts.
    assert_eq!(response.status(), 200);
    assert!(response.extensions().get::<GaveUp>().is_none());
    let at: Vec<_> = seen.iter().map(|s| s.at).collect();
    assert_eq!(
        at,
        [2_000, 2_100, 2_300].map(Duration::from_millis),
        "three attempts once the body came"
    );
    // The swap did happen: the next call goes by the new policy (one attempt).
    let (response, seen) = call(&agent, &[503], request("PUT", false, "x")).await;
    assert_eq!(response.status(), 503);
    assert_eq!(seen.len(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_deduplicated_call_goes_by_the_policy_read_when_it_began_though_a_swap_comes_during_its_body_read()
 {
    let agent = agent(&policy(BEFORE_THE_SWAP));
    let (svc, seen) = upstream(&[503, 503]);
    let svc = svc.map_response(|r| r.map(|_| Full::new(Bytes::new())));
    let client = RetryLayer::new(agent.endpoint("ep"))
        .with_dedup(retryplane_agent::layer::Dedup::default())
        .layer(svc);
    let req = Request::builder()
        .method("GET")
        .uri("/s")
        .body(a_slow_body_across_a_swap(&agent, AFTER_THE_SWAP))
        .unwrap();
    let response = client.oneshot(req).await.unwrap();
    assert_eq!(response.status(), 200);
    assert!(response.extensions().get::<GaveUp>().is_none());
    let at: Vec<_> = seen.lock().unwrap().iter().map(|s| s.at).collect();
    assert_eq!(at, [2_000, 2_100, 2_300].map(Duration::from_millis));
}

#[tokio::test(start_paused = true)]
async fn a_follower_waits_for_its_leader_by_the_policy_read_when_it_began_though_a_swap_came_since()
{
    use retryplane_agent::layer::{Dedup, Deduplicated};
    let agent = agent(&policy(BEFORE_THE_SWAP));
    let start = Instant::now();
    let calls: Arc<Mutex<Vec<Duration>>> = Arc::default();
    let log = calls.clone();
    // Answers 3 s after it is called.
    let svc = service_fn(move |_req: Request<ReplayBody<_>>| {
        log.lock().unwrap().push(start.elapsed());
        async {
            tokio::time::sleep(Duration::from_secs(3)).await;
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"answer"))))
        }
    });
    let client = RetryLayer::new(agent.endpoint("ep"))
        .with_dedup(Dedup::default())
        .layer(svc);
    // The leader's body is there at once: it calls at 0 s. The follower's comes at 2 s, the
    // policy swapped meanwhile to a 1 s deadline; it began at 0 s under a 10 s one.
    let leader = Request::builder()
        .method("GET")
        .uri("/s")
        .body(http_body_util::Either::Left(Full::new(Bytes::from_static(
            b"payload",
        ))))
        .unwrap();
    let follower = Request::builder()
        .method("GET")
        .uri("/s")
        .body(http_body_util::Either::Right(a_slow_body_across_a_swap(
            &agent,
            AFTER_THE_SWAP,
        )))
        .unwrap();
    let (leader, follower) = tokio::join!(
        client.clone().oneshot(leader),
        client.clone().oneshot(follower)
    );
    let (leader, follower) = (leader.unwrap(), follower.unwrap());
    assert_eq!(start.elapsed(), Duration::from_secs(3));
    assert_eq!(
        (leader.status(), follower.status()),
        (http::StatusCode::OK, http::StatusCode::OK)
    );
    assert!(
        follower.extensions().get::<Deduplicated>().is_some(),
        "the follower waited for the leader's answer (by its 10 s deadline) and got a copy"
    );
    assert_eq!(*calls.lock().unwrap(), [Duration::ZERO]);
}

#[tokio::test(start_paused = true)]
async fn by_default_a_body_of_64_kib_is_replayed_and_one_byte_more_is_sent_once() {
    let agent = agent(&policy("max_attempts: 3"));
    let limit = retryplane_agent::layer::DEFAULT_BODY_LIMIT;
    assert_eq!(limit, 64 * 1024);
    for (size, sends) in [(limit, 2), (limit + 1, 1)] {
        let body = Bytes::from(vec![b'x'; size]);
        // A known size, and the same bytes in chunks of unknown total size.
        let known = Request::builder()
            .method("PUT")
            .uri("/v1/things")
            .body(Full::new(body.clone()).boxed_unsync())
            .unwrap();
        let chunks: Vec<Result<Frame<Bytes>, Infallible>> = body
            .chunks(10_000)
            .map(|c| Ok(Frame::data(Bytes::copy_from_slice(c))))
            .collect();
        let unknown = Request::builder()
            .method("PUT")
            .uri("/v1/things")
            .body(StreamBody::new(tokio_stream::iter(chunks)).boxed_unsync())
            .unwrap();
        for (what, req) in [("known", known), ("unknown", unknown)] {
            let (response, seen) = call(&agent, &[503], req).await;
            assert_eq!(seen.len(), sends, "{size} bytes, {what} size");
            assert!(seen.iter().all(|s| s.body == body), "{size} bytes, {what}");
            let expected = if sends == 2 { 200 } else { 503 };
            assert_eq!(response.status(), expected, "{size} bytes, {what} size");
        }
    }
}

#[tokio::test(start_paused = true)]
async fn a_retrys_wait_for_capacity_below_is_not_part_of_its_per_try_timeout() {
    // One permit below. A read's first attempt gets a 503; during its 100 ms pause a slow call
    // (800 ms) takes the permit. The retry waits 700 ms for it: that wait is the call's, within
    // its deadline, not the retry's 500 ms per-try timeout, so the retry is sent and answered.
    let seen = Arc::new(Mutex::new(Vec::<(String, Duration)>::new()));
    let log = seen.clone();
    let origin = Instant::now();
    let flaky = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let svc = service_fn(move |req: Request<ReplayBody<Full<Bytes>>>| {
        let path = req.uri().path().to_owned();
        log.lock().unwrap().push((path.clone(), origin.elapsed()));
        let flaky = flaky.clone();
        async move {
            let status = match path.as_str() {
                "/slow" => {
                    tokio::time::sleep(Duration::from_millis(800)).await;
                    200
                }
                _ if flaky.swap(false, std::sync::atomic::Ordering::SeqCst) => 503,
                _ => 200,
            };
            Ok::<_, Infallible>(
                Response::builder()
                    .status(status)
                    .body(Empty::<Bytes>::new())
                    .unwrap(),
            )
        }
    });
    let agent = agent(&policy(
        "max_attempts: 2\ndeadline: 10s\nper_try_timeout: 500ms",
    ));
    let limited = tower::limit::ConcurrencyLimit::new(svc, 1);
    let client = RetryLayer::new(agent.endpoint("ep")).layer(limited.clone());
    let read = tokio::spawn(tokio::time::timeout(
        BOUND,
        client.clone().oneshot(
            Request::get("http://up/flaky")
                .body(Full::new(Bytes::new()))
                .unwrap(),
        ),
    ));
    for _ in 0..10_000 {
        if !seen.lock().unwrap().is_empty() {
            break;
        }
        tokio::task::yield_now().await;
    }
    // Another endpoint (the defaults: a 2 s per-try timeout) through the same limit.
    let other = RetryLayer::new(agent.endpoint("other")).layer(limited);
    let slow = tokio::spawn(
        other.oneshot(
            Request::post("http://up/slow")
                .body(Full::new(Bytes::new()))
                .unwrap(),
        ),
    );
    let answer = read.await.unwrap().expect("ends").unwrap();
    assert_eq!(answer.status(), 200);
    assert!(answer.extensions().get::<GaveUp>().is_none());
    assert_eq!(slow.await.unwrap().unwrap().status(), 200);
    let seen = seen.lock().unwrap().clone();
    assert_eq!(
        seen,
        vec![
            ("/flaky".to_owned(), Duration::ZERO),
            ("/slow".to_owned(), Duration::ZERO),
            ("/flaky".to_owned(), Duration::from_millis(800)),
        ]
    );
    let counts = agent.endpoint("ep").pending_counts();
    assert_eq!(
        (counts.calls, counts.attempts, counts.success_after_retry),
        (1, 2, 1),
        "{counts:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_refused_connect_getting_ready_for_a_retry_is_that_retrys_failure_and_is_retried() {
    // Answers its first request 503; then its next `poll_ready` fails with a refused connect
    // (as tower's `Reconnect` reports a failed dial), once; then it answers 200. The failed
    // readiness is the second attempt's failure, a connect error, retried as one: the third
    // attempt succeeds.
    #[derive(Clone)]
    struct Redials {
        sent: Arc<std::sync::atomic::AtomicUsize>,
        refused: Arc<std::sync::atomic::AtomicBool>,
    }
    impl tower::Service<Request<ReplayBody<Full<Bytes>>>> for Redials {
        type Response = Response<Empty<Bytes>>;
        type Error = std::io::Error;
        type Future = std::future::Ready<Result<Self::Response, std::io::Error>>;
        fn poll_ready(
            &mut self,
            _cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Result<(), std::io::Error>> {
            let sent = self.sent.load(std::sync::atomic::Ordering::SeqCst);
            let refuse = sent == 1 && !self.refused.swap(true, std::sync::atomic::Ordering::SeqCst);
            std::task::Poll::Ready(if refuse {
                Err(std::io::ErrorKind::ConnectionRefused.into())
            } else {
                Ok(())
            })
        }
        fn call(&mut self, _req: Request<ReplayBody<Full<Bytes>>>) -> Self::Future {
            let n = self.sent.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let status = if n == 0 { 503 } else { 200 };
            std::future::ready(Ok(Response::builder()
                .status(status)
                .body(Empty::new())
                .unwrap()))
        }
    }
    let svc = Redials {
        sent: Arc::default(),
        refused: Arc::default(),
    };
    let agent = agent(&policy("max_attempts: 3"));
    let client = RetryLayer::new(agent.endpoint("ep")).layer(svc.clone());
    let answer = tokio::time::timeout(BOUND, client.oneshot(request("GET", false, "")))
        .await
        .expect("ends")
        .unwrap();
    assert_eq!(answer.status(), 200);
    assert_eq!(svc.sent.load(std::sync::atomic::Ordering::SeqCst), 2);
    let counts = agent.endpoint("ep").pending_counts();
    assert_eq!(
        (
            counts.calls,
            counts.attempts,
            counts.retries,
            counts.success_after_retry
        ),
        (1, 3, 2, 1),
        "{counts:?}"
    );
}

/// Two attempts, a 10 s deadline, and a breaker that two failures open for 30 s.
const BREAKER: &str = "max_attempts: 2\ndeadline: 10s\nper_try_timeout: 5s\ncircuit_breaker: {enabled: true, failure_ratio: 0.5, min_requests: 2, open_for: 30s}";

#[tokio::test(start_paused = true)]
async fn a_retry_waiting_for_capacity_stops_when_the_breaker_opens() {
    // One permit below, held by a slow call of another endpoint (until its 2 s per-try
    // timeout). A read's first
    // attempt gets a 503 and its retry waits for the permit; meanwhile another call fails and
    // the breaker opens. The retry would be refused whenever it got the permit, so the call
    // ends within a tenth of a second with `circuit_open` and the 503, not at its deadline.
    let origin = Instant::now();
    let seen = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = seen.clone();
    let svc = service_fn(move |req: Request<ReplayBody<Full<Bytes>>>| {
        counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let path = req.uri().path().to_owned();
        async move {
            let status = if path == "/slow" {
                tokio::time::sleep(Duration::from_secs(20)).await;
                200
            } else {
                503
            };
            Ok::<_, Infallible>(
                Response::builder()
                    .status(status)
                    .body(Empty::<Bytes>::new())
                    .unwrap(),
            )
        }
    });
    let agent = agent(&policy(BREAKER));
    let limited = tower::limit::ConcurrencyLimit::new(svc.clone(), 1);
    let client = RetryLayer::new(agent.endpoint("ep")).layer(limited.clone());
    let plain = RetryLayer::new(agent.endpoint("ep")).layer(svc);
    let other = RetryLayer::new(agent.endpoint("other")).layer(limited);
    let read = tokio::spawn(client.oneshot(request("GET", false, "")));
    // The read's first attempt is answered at once; its pause is 100 ms.
    for _ in 0..10_000 {
        if seen.load(std::sync::atomic::Ordering::SeqCst) == 1 {
            break;
        }
        tokio::task::yield_now().await;
    }
    let slow = Request::post("http://up/slow")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let slow = tokio::spawn(other.oneshot(slow));
    // (Less than the slow call's 2 s per-try timeout, which would free the permit.)
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!read.is_finished(), "the retry waits for the permit");
    let failed = plain.oneshot(request("PUT", true, "")).await.unwrap();
    assert_eq!(failed.status(), 503);
    let opened = Instant::now();
    let answer = read.await.unwrap().unwrap();
    assert!(
        opened.elapsed() <= Duration::from_millis(100),
        "{:?}",
        opened.elapsed()
    );
    assert_gave_up_after_one(&answer, 503, GiveUpCause::CircuitOpen);
    assert!(origin.elapsed() < Duration::from_secs(10));
    assert_eq!(
        seen.load(std::sync::atomic::Ordering::SeqCst),
        3,
        "no retry sent"
    );
    slow.abort();
}

#[tokio::test(start_paused = true)]
async fn a_retry_the_breaker_opened_for_during_its_pause_is_refused_before_the_service_below_is_asked()
 {
    // The first attempt gets a 503; during its pause other calls open the breaker. The service
    // below would fail to get ready for the retry: it is not asked, and the call ends as the
    // breaker's refusal, with the 503.
    #[derive(Clone)]
    struct OnceThenClosed(Arc<std::sync::atomic::AtomicUsize>);
    impl tower::Service<Request<ReplayBody<Full<Bytes>>>> for OnceThenClosed {
        type Response = Response<Empty<Bytes>>;
        type Error = std::io::Error;
        type Future = std::future::Ready<Result<Self::Response, std::io::Error>>;
        fn poll_ready(
            &mut self,
            _cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Result<(), std::io::Error>> {
            assert_eq!(
                self.0.load(std::sync::atomic::Ordering::SeqCst),
                0,
                "asked to get ready while the breaker is open"
            );
            std::task::Poll::Ready(Ok(()))
        }
        fn call(&mut self, _req: Request<ReplayBody<Full<Bytes>>>) -> Self::Future {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            std::future::ready(Ok(Response::builder()
                .status(503)
                .body(Empty::new())
                .unwrap()))
        }
    }
    let agent = agent(&policy(BREAKER));
    let (plain, _) = client(&agent, &[503, 503]);
    let client = RetryLayer::new(agent.endpoint("ep")).layer(OnceThenClosed(Arc::default()));
    let read = tokio::spawn(client.oneshot(request("GET", false, "")));
    tokio::time::sleep(Duration::from_millis(50)).await;
    let failed = plain.oneshot(request("PUT", true, "")).await.unwrap();
    assert_eq!(failed.status(), 503);
    let answer = read.await.unwrap().unwrap();
    assert_gave_up_after_one(&answer, 503, GiveUpCause::CircuitOpen);
}

/// A request body of boxed frames: complete, or stalled after its first.
type Uploaded = StreamBody<
    std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<Frame<Bytes>, Infallible>> + Send>>,
>;

/// 100 bytes, then the end (`stalls: false`) or nothing more, ever (a stalled upload).
fn upload(stalls: bool) -> Request<Uploaded> {
    let first = tokio_stream::once(Ok(Frame::data(Bytes::from(vec![b'a'; 100]))));
    let frames: std::pin::Pin<Box<dyn tokio_stream::Stream<Item = _> + Send>> = if stalls {
        Box::pin(tokio_stream::StreamExt::chain(
            first,
            tokio_stream::pending(),
        ))
    } else {
        Box::pin(first)
    };
    Request::put("http://up/v1/things")
        .body(StreamBody::new(frames))
        .unwrap()
}

/// `err` is the call's `circuit_open` give-up, with no answer.
fn assert_refused_by_the_circuit(err: &(dyn std::error::Error + 'static)) {
    assert!(
        matches!(
            err.downcast_ref::<RetryError>(),
            Some(RetryError::NoAnswer {
                cause: Cause::GaveUp(GiveUpCause::CircuitOpen)
            })
        ),
        "{err:?}"
    );
}

/// Two uploads answered 503 through `client`: with `min_requests: 2`, they open the circuit.
async fn open_the_circuit<S, B>(client: &S)
where
    S: tower::Service<Request<Uploaded>, Response = Response<B>> + Clone,
    S::Error: std::fmt::Debug,
{
    for _ in 0..2 {
        let r = client.clone().oneshot(upload(false)).await.unwrap();
        assert_eq!(r.status(), 503);
    }
}

const OPENS_AFTER_TWO: &str = "max_attempts: 1\ndeadline: 3s\ncircuit_breaker: {enabled: true, failure_ratio: 0.5, min_requests: 2, open_for: 30s}";

#[tokio::test(start_paused = true)]
async fn an_open_circuit_refuses_a_call_without_waiting_for_its_request_body() {
    let agent = agent(&policy(OPENS_AFTER_TWO));
    let (client, seen) = client::<Uploaded>(&agent, &[503, 503]);
    open_the_circuit(&client).await;
    let start = Instant::now();
    let err = tokio::time::timeout(Duration::from_secs(60), client.oneshot(upload(true)))
        .await
        .expect("the call waited for the body")
        .unwrap_err();
    // At once (not at the 3 s deadline), as the open circuit's refusal, nothing sent.
    assert_eq!(start.elapsed(), Duration::ZERO);
    assert_refused_by_the_circuit(&*err);
    assert_eq!(seen.lock().unwrap().len(), 2);
    let counts = agent.endpoint("ep").pending_counts();
    assert_eq!((counts.circuit_open, counts.gave_up_deadline), (1, 0));
}

#[tokio::test(start_paused = true)]
async fn a_refused_call_is_not_logged_as_one_that_could_not_be_sent_again() {
    // `replayable=false` says why a failure the policy retries was not retried: a call the
    // breaker refused sent nothing, whatever its body.
    let agent = agent(&policy(OPENS_AFTER_TWO));
    let (client, _seen) = client::<Uploaded>(&agent, &[503, 503]);
    open_the_circuit(&client).await;
    let (logs, _guard) = capture_logs("retryplane_agent=info");
    // A call whose body read the refusal stopped (so its body is not kept to be sent again).
    let err = client.clone().oneshot(upload(true)).await.unwrap_err();
    assert_refused_by_the_circuit(&*err);
    let text = logs.text();
    let line = text.lines().find(|l| l.contains("call failed"));
    let line = line.unwrap_or_else(|| panic!("a warn line: {text}"));
    assert!(line.contains("cause=circuit_open"), "{line}");
    assert!(!line.contains("replayable"), "{line}");
}

#[tokio::test(start_paused = true)]
async fn a_circuit_that_opens_while_a_request_body_is_read_ends_the_read() {
    let agent = agent(&policy(OPENS_AFTER_TWO));
    let (client, seen) = client::<Uploaded>(&agent, &[503, 503]);
    // A call whose upload stalls, begun while the circuit is closed.
    let start = Instant::now();
    let stalled = tokio::spawn(client.clone().oneshot(upload(true)));
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert!(!stalled.is_finished());
    // Two failures open the circuit meanwhile.
    open_the_circuit(&client).await;
    let err = tokio::time::timeout(Duration::from_secs(60), stalled)
        .await
        .expect("the call waited for the body")
        .unwrap()
        .unwrap_err();
    // The breaker is asked again 100 ms after the call began, not at its 3 s deadline.
    assert_eq!(start.elapsed(), Duration::from_millis(100));
    assert_refused_by_the_circuit(&*err);
    assert_eq!(seen.lock().unwrap().len(), 2);
}

/// A body of `data` whose size hint claims at least `lower` bytes (breaking `size_hint`'s
/// contract: it has fewer).
struct Overstated {
    data: Option<Bytes>,
    lower: u64,
}

impl http_body::Body for Overstated {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        std::task::Poll::Ready(self.data.take().map(|d| Ok(Frame::data(d))))
    }

    fn size_hint(&self) -> http_body::SizeHint {
        let mut hint = http_body::SizeHint::new();
        hint.set_lower(self.lower);
        hint
    }
}

#[tokio::test(start_paused = true)]
async fn a_small_body_whose_size_hint_overstates_it_is_still_buffered_and_retried() {
    let agent = agent(&policy("max_attempts: 3"));
    let (client, seen) = client::<Overstated>(&agent, &[503]);
    let body = Overstated {
        data: Some(Bytes::from_static(b"0123456789")),
        lower: 1 << 20,
    };
    let r = client
        .oneshot(Request::put("http://up/v1/things").body(body).unwrap())
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let bodies: Vec<Bytes> = seen
        .lock()
        .unwrap()
        .iter()
        .map(|s| s.body.clone())
        .collect();
    assert_eq!(bodies, [&b"0123456789"[..], &b"0123456789"[..]]);
}

/// A request body that fails after its first 100 bytes.
type Failing = StreamBody<
    std::pin::Pin<
        Box<dyn tokio_stream::Stream<Item = Result<Frame<Bytes>, std::io::Error>> + Send>,
    >,
>;

#[tokio::test(start_paused = true)]
async fn a_request_body_that_fails_while_it_is_read_ends_the_call_with_its_error_uncounted() {
    let agent = agent(&policy("max_attempts: 3"));
    let (client, seen) = client::<Failing>(&agent, &[]);
    let frames: std::pin::Pin<Box<dyn tokio_stream::Stream<Item = _> + Send>> =
        Box::pin(tokio_stream::iter([
            Ok(Frame::data(Bytes::from(vec![b'a'; 100]))),
            Err(std::io::Error::other("the caller's upload broke")),
        ]));
    let request = Request::put("http://up/v1/things")
        .body(StreamBody::new(frames))
        .unwrap();
    let err = client.oneshot(request).await.unwrap_err();
    assert!(
        err.to_string().contains("the caller's upload broke"),
        "{err}"
    );
    assert!(seen.lock().unwrap().is_empty(), "nothing sent");
    let counts = agent.endpoint("ep").pending_counts();
    assert_eq!((counts.calls, counts.attempts), (0, 0), "{counts:?}");
}

/// A caller's deadline in the request (`Within`) ends the call before the policy's: the pause
/// that would end past it is not taken.
#[tokio::test(start_paused = true)]
async fn a_callers_deadline_in_the_request_ends_the_call_before_the_policys() {
    let agent = agent(&policy("max_attempts: 5\ndeadline: 10s"));
    let mut req = request("GET", false, "");
    req.extensions_mut()
        .insert(retryplane_agent::layer::Within(Duration::from_millis(250)));
    let started = Instant::now();
    let (response, seen) = call(&agent, &[503, 503, 503, 503], req).await;
    // Attempts at 0 and 100 ms; the next pause (200 ms) would end past 250 ms.
    assert_eq!(response.status(), 503);
    assert_eq!(
        response.extensions().get::<GaveUp>(),
        Some(&GaveUp {
            cause: Cause::GaveUp(GiveUpCause::DeadlineExceeded),
            attempts: 2
        })
    );
    assert_eq!(seen.len(), 2);
    assert!(started.elapsed() < Duration::from_millis(250));
    // An HTTP request says nothing of it to the upstream.
    assert!(seen.iter().all(|s| s.grpc_timeout.is_none()), "{seen:?}");
    // Without it, the policy's deadline leaves room for every attempt: the fifth is answered.
    let (response, seen) = call(&agent, &[503, 503, 503, 503], request("GET", false, "")).await;
    assert_eq!(response.status(), 200);
    assert_eq!(seen.len(), 5);
}

/// A cancellation token in the request cancels the call during its pause: no attempt more.
#[tokio::test(start_paused = true)]
async fn a_cancellation_token_in_the_request_cancels_the_call_during_a_pause() {
    let agent = agent(&policy("max_attempts: 3"));
    let token = retryplane_agent::CancellationToken::new();
    let mut req = request("GET", false, "");
    req.extensions_mut().insert(token.clone());
    let (svc, seen) = upstream(&[503, 503]);
    let call = tokio::spawn(
        RetryLayer::new(agent.endpoint("ep"))
            .layer(svc)
            .oneshot(req),
    );
    // The first attempt is answered at once; its pause is 100 ms.
    tokio::time::sleep(Duration::from_millis(50)).await;
    token.cancel();
    let response = call.await.unwrap().unwrap();
    assert_eq!(response.status(), 503);
    assert_eq!(
        response.extensions().get::<GaveUp>(),
        Some(&GaveUp {
            cause: Cause::Cancelled,
            attempts: 1
        })
    );
    assert_eq!(seen.lock().unwrap().len(), 1);
}

/// Two endpoints for two layers stacked over one upstream: `outer` (3 attempts) above
/// `inner` (2 attempts; or 1, with a breaker that opens on one failure, when `breaker`).
fn stacked(breaker: bool) -> Agent {
    let inner = if breaker {
        "    max_attempts: 1\n    circuit_breaker: {enabled: true, failure_ratio: 0.5, min_requests: 1, open_for: 60s}\n"
    } else {
        "    max_attempts: 2\n"
    };
    agent(&format!(
        "version: 1\ndefaults:\n  backoff: {{base: 100ms, max: 2s, multiplier: 2.0, jitter: none}}\n  budget: {{enabled: false}}\n  circuit_breaker: {{enabled: false}}\nendpoints:\n  outer:\n    max_attempts: 3\n  inner:\n{inner}"
    ))
}

/// `outer`'s layer over `inner`'s over an upstream answering `statuses` (then 200).
#[allow(clippy::type_complexity)]
fn stack(
    agent: &Agent,
    statuses: &[u16],
) -> (
    impl tower::Service<
        Request<Full<Bytes>>,
        Response = Response<ResponseBody<ResponseBody<Empty<Bytes>>>>,
        Error = BoxError,
    > + Clone,
    support::Seen,
) {
    let (svc, seen) = upstream::<ReplayBody<Full<Bytes>>>(statuses);
    let client = tower::ServiceBuilder::new()
        .layer(RetryLayer::new(agent.endpoint("outer")))
        .layer(RetryLayer::new(agent.endpoint("inner")))
        .service(svc);
    (client, seen)
}

/// A layer stacked above one that gave up on an answer does not send it again (retried at
/// one layer only): the answer comes back as the layer below marked it.
#[tokio::test(start_paused = true)]
async fn a_layer_stacked_above_does_not_retry_an_answer_the_one_below_gave_up_on() {
    let agent = stacked(false);
    let (client, seen) = stack(&agent, &[503, 503, 503, 503, 503, 503]);
    let response = tokio::time::timeout(BOUND, client.oneshot(request("GET", false, "")))
        .await
        .expect("the call ends in time")
        .unwrap();
    assert_eq!(response.status(), 503);
    assert_eq!(
        response.extensions().get::<GaveUp>(),
        Some(&GaveUp {
            cause: Cause::GaveUp(GiveUpCause::AttemptsExhausted),
            attempts: 2
        }),
        "the cause and attempts of the layer that retried"
    );
    assert_eq!(seen.lock().unwrap().len(), 2, "2 attempts, not 2 × 3");
    let outer = agent.endpoint("outer").pending_counts();
    assert_eq!(
        (outer.attempts, outer.retries, outer.gave_up_not_retryable),
        (1, 0, 1),
        "{outer:?}"
    );
}

/// Nor what the one below refused with no answer (its circuit open): an HTTP call's
/// `RetryError` is not taken for a reset and sent again.
#[tokio::test(start_paused = true)]
async fn a_layer_stacked_above_does_not_retry_what_the_one_below_refused_with_no_answer() {
    let agent = stacked(true);
    let (client, seen) = stack(&agent, &[503]);
    // The upstream's 503 opens the inner breaker.
    let response = tokio::time::timeout(BOUND, client.clone().oneshot(request("GET", false, "")))
        .await
        .expect("the call ends in time")
        .unwrap();
    assert_eq!(response.status(), 503);
    let err = tokio::time::timeout(BOUND, client.oneshot(request("GET", false, "")))
        .await
        .expect("the call ends in time")
        .unwrap_err();
    assert_refused_by_the_circuit(&*err);
    assert_eq!(seen.lock().unwrap().len(), 1);
    assert_eq!(
        agent.endpoint("inner").pending_counts().circuit_open,
        1,
        "refused once, not once an outer attempt"
    );
    let outer = agent.endpoint("outer").pending_counts();
    assert_eq!(
        (outer.calls, outer.retries, outer.gave_up_not_retryable),
        (2, 0, 2),
        "{outer:?}"
    );
}
