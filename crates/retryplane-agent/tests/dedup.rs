//! De-duplication of identical in-flight reads through the tower layer, against a scripted
//! upstream that holds every request at a gate until the test opens it.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::collections::VecDeque;
use std::future::Future as _;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt as _, Full};
use retryplane_agent::Agent;
use retryplane_agent::layer::{
    BoxError, Dedup, DedupStats, Deduplicated, GaveUp, Idempotent, ReplayBody, ResponseBody, Retry,
    RetryLayer,
};
use support::{agent, policy};
use tokio::sync::{Semaphore, mpsc};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tower::{Layer as _, ServiceExt as _, service_fn};

/// Long per-try timeout and deadline: requests held at the gate never time out in a test.
const POLICY: &str = "max_attempts: 3\ndeadline: 600s\nper_try_timeout: 600s";

/// A deadline the tests that wait for it reach (on tokio's paused clock).
const SHORT: &str = "max_attempts: 3\ndeadline: 10s\nper_try_timeout: 10s";
const DEADLINE: Duration = Duration::from_secs(10);

/// One attempt, a 10 s deadline, and a breaker that two failures open for 30 s.
const BREAKER: &str = "max_attempts: 1\ndeadline: 10s\nper_try_timeout: 10s\ncircuit_breaker: {enabled: true, failure_ratio: 0.5, min_requests: 2, open_for: 30s}";

/// What one request to the upstream does once the gate lets it through.
#[derive(Clone, Copy, Debug)]
enum Step {
    Status(u16),
    /// 200 with this header.
    Header(&'static str, &'static str),
    Refused,
}

/// The upstream's side: requests seen (in order of arrival), the gate, the script.
struct Upstream {
    seen: Mutex<Vec<Request<Bytes>>>,
    gate: Semaphore,
    script: Mutex<VecDeque<Step>>,
}

impl Upstream {
    fn seen(&self) -> usize {
        self.seen.lock().unwrap().len()
    }

    /// Lets `n` more requests through.
    fn open(&self, n: usize) {
        self.gate.add_permits(n);
    }
}

type Body = ReplayBody<Full<Bytes>>;

/// A service below the layer, as the tests' upstreams are: it takes the layer's requests and
/// answers with a whole body.
trait Below:
    tower::Service<Request<Body>, Response = Response<Full<Bytes>>, Error = io::Error, Future: Send>
    + Clone
    + Send
    + 'static
{
}

impl<S> Below for S where
    S: tower::Service<
            Request<Body>,
            Response = Response<Full<Bytes>>,
            Error = io::Error,
            Future: Send,
        > + Clone
        + Send
        + 'static
{
}

/// A client the tests send their requests through on tasks: the de-duplicating layer over a
/// service [`Below`].
trait Sends:
    tower::Service<
        Request<Full<Bytes>>,
        Response = Response<ResponseBody<Full<Bytes>>>,
        Error = BoxError,
        Future: Send,
    > + Clone
    + Send
    + 'static
{
}

impl<C> Sends for C where
    C: tower::Service<
            Request<Full<Bytes>>,
            Response = Response<ResponseBody<Full<Bytes>>>,
            Error = BoxError,
            Future: Send,
        > + Clone
        + Send
        + 'static
{
}

/// An upstream answering request number `n` (from 0) with `answer n`, an `x-call: n` header,
/// and the scripted status (then 200), once the gate lets it through.
fn upstream(script: &[Step]) -> (impl Below, Arc<Upstream>) {
    let up = Arc::new(Upstream {
        seen: Mutex::default(),
        gate: Semaphore::new(0),
        script: Mutex::new(script.iter().copied().collect()),
    });
    let state = up.clone();
    let svc = service_fn(move |req: Request<Body>| {
        let up = state.clone();
        async move {
            let (parts, body) = req.into_parts();
            let body = body.collect().await.unwrap().to_bytes();
            let n = {
                let mut seen = up.seen.lock().unwrap();
                seen.push(Request::from_parts(parts, body));
                seen.len() - 1
            };
            up.gate.acquire().await.unwrap().forget();
            let step = up.script.lock().unwrap().pop_front();
            let (status, header) = match step {
                Some(Step::Refused) => return Err(io::ErrorKind::ConnectionRefused.into()),
                Some(Step::Status(s)) => (s, None),
                Some(Step::Header(name, value)) => (200, Some((name, value))),
                None => (200, None),
            };
            let mut answer = Response::builder().status(status);
            if let Some((name, value)) = header {
                answer = answer.header(name, value);
            }
            Ok(answer
                .header("x-call", n.to_string())
                .body(Full::new(Bytes::from(format!("answer {n}"))))
                .unwrap())
        }
    });
    (svc, up)
}

type Client<S> = Retry<S, Dedup>;

fn client<S>(svc: S, dedup: &Dedup) -> Client<S> {
    client_with(svc, dedup, POLICY)
}

fn client_with<S>(svc: S, dedup: &Dedup, yaml: &str) -> Client<S> {
    client_of(&agent(&policy(yaml)), svc, dedup)
}

/// The de-duplicating client of `agent`'s endpoint `ep`, for a test that reads its counters.
fn client_of<S>(agent: &retryplane_agent::Agent, svc: S, dedup: &Dedup) -> Client<S> {
    RetryLayer::new(agent.endpoint("ep"))
        .with_dedup(dedup.clone())
        .layer(svc)
}

/// A de-duplicating client (`dedup`, the endpoint's policy lines `yaml`) of an [`upstream`]
/// playing `script`, and that upstream.
fn gated(script: &[Step], dedup: &Dedup, yaml: &str) -> (Client<impl Below>, Arc<Upstream>) {
    let (svc, up) = upstream(script);
    (client_with(svc, dedup, yaml), up)
}

fn get(uri: &str) -> http::request::Builder {
    Request::builder().method("GET").uri(uri)
}

fn req(b: http::request::Builder, body: &'static str) -> Request<Full<Bytes>> {
    b.body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap()
}

type Answer = Result<(u16, Option<String>, Bytes, bool), String>;

/// Sends `request` on a task; the answer is status, `x-call`, body and whether it was a
/// copy of another's response.
fn spawn<S>(client: &Client<S>, request: Request<Full<Bytes>>) -> JoinHandle<Answer>
where
    Client<S>: Sends,
{
    let client = client.clone();
    tokio::spawn(async move {
        let response = client.oneshot(request).await.map_err(|e| e.to_string())?;
        let status = response.status().as_u16();
        let call = response
            .headers()
            .get("x-call")
            .map(|v| v.to_str().unwrap().to_owned());
        let copy = response.extensions().get::<Deduplicated>().is_some();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        Ok((status, call, body, copy))
    })
}

/// Waits (yielding, bounded) until `f` holds.
async fn until(what: &str, mut f: impl FnMut() -> bool) {
    for _ in 0..10_000 {
        if f() {
            return;
        }
        tokio::task::yield_now().await;
    }
    panic!("never happened: {what}");
}

async fn join(h: JoinHandle<Answer>) -> Answer {
    tokio::time::timeout(Duration::from_secs(60), h)
        .await
        .expect("a request hung")
        .expect("task failed")
}

/// Checks that `answer` is the upstream's `200` to request number `call` (its `x-call` and
/// its body), and whether it was a copy of another's response.
fn assert_answered(answer: Answer, call: usize, copy: bool) {
    let (status, got, body, was_copy) = answer.unwrap();
    let (call, text) = (call.to_string(), format!("answer {call}"));
    assert_eq!(
        (status, got.as_deref(), &body[..], was_copy),
        (200, Some(call.as_str()), text.as_bytes(), copy)
    );
}

/// A leader sent first and held at the upstream, then `n` followers of the same request, once
/// every one of them waits for it.
async fn leader_and_followers<S>(
    client: &Client<S>,
    dedup: &Dedup,
    up: &Upstream,
    request: impl Fn() -> Request<Full<Bytes>>,
    n: usize,
) -> (JoinHandle<Answer>, Vec<JoinHandle<Answer>>)
where
    Client<S>: Sends,
{
    let leader = spawn(client, request());
    until("the leader reaches the upstream", || up.seen() == 1).await;
    let followers: Vec<_> = (0..n).map(|_| spawn(client, request())).collect();
    until("the followers wait", || dedup.stats().waiting == n as u64).await;
    (leader, followers)
}

/// Lets the leader's call through: the leader gets the upstream's answer, and every follower
/// a copy of it, from that one call.
async fn one_call_answers_all(
    up: &Upstream,
    leader: JoinHandle<Answer>,
    followers: Vec<JoinHandle<Answer>>,
) {
    up.open(1);
    assert_answered(join(leader).await, 0, false);
    for f in followers {
        assert_answered(join(f).await, 0, true);
    }
    assert_eq!(up.seen(), 1);
}

/// [`leader_and_followers`] of `GET http://up/x` through [`gated`]`(script, dedup, yaml)`:
/// the upstream, the leader and the followers.
async fn x_led(
    script: &[Step],
    dedup: &Dedup,
    yaml: &str,
    n: usize,
) -> (Arc<Upstream>, JoinHandle<Answer>, Vec<JoinHandle<Answer>>) {
    let (client, up) = gated(script, dedup, yaml);
    let (leader, followers) =
        leader_and_followers(&client, dedup, &up, || req(get("http://up/x"), ""), n).await;
    (up, leader, followers)
}

#[tokio::test(start_paused = true)]
async fn identical_gets_share_one_call_and_its_response() {
    let dedup = Dedup::default();
    let (client, up) = gated(&[], &dedup, POLICY);
    let request = || {
        req(
            get("http://up/items?page=2")
                .header("authorization", "Bearer a")
                .header("accept-language", "uk"),
            "",
        )
    };
    let (leader, followers) = leader_and_followers(&client, &dedup, &up, request, 4).await;
    one_call_answers_all(&up, leader, followers).await;
    assert_eq!(
        dedup.stats(),
        DedupStats {
            led: 1,
            shared: 4,
            own_calls: 0,
            waiting: 0,
            in_flight: 0
        }
    );

    // The call left the table when it ended: the same request now makes a new call.
    up.open(1);
    let again = join(spawn(&client, request())).await.unwrap();
    assert_eq!(again.1.as_deref(), Some("1"));
    assert_eq!(up.seen(), 2);
}

#[tokio::test(start_paused = true)]
async fn a_response_the_call_gave_up_on_is_shared_with_its_mark() {
    let dedup = Dedup::default();
    let (client, up) = gated(&[Step::Status(404)], &dedup, POLICY);
    let leader = spawn(&client, req(get("http://up/x"), ""));
    until("the leader reaches the upstream", || up.seen() == 1).await;
    let c = client.clone();
    let follower = tokio::spawn(async move { c.oneshot(req(get("http://up/x"), "")).await });
    until("one follower waits", || dedup.stats().waiting == 1).await;
    up.open(1);
    assert_eq!(join(leader).await.unwrap().0, 404);
    let copy = follower.await.unwrap().unwrap();
    assert_eq!(copy.status(), 404);
    assert!(copy.extensions().get::<GaveUp>().is_some());
    assert!(copy.extensions().get::<Deduplicated>().is_some());
    assert_eq!(up.seen(), 1);
}

/// Sends `a`, then `b` while `a` is held at the gate, and says whether `b` was shared
/// (checking that both got the answer that goes with it).
async fn shared(dedup: Dedup, a: Request<Full<Bytes>>, b: Request<Full<Bytes>>) -> bool {
    shared_under(POLICY, dedup, a, b).await
}

/// [`shared`] with the endpoint's policy lines `yaml`.
async fn shared_under(
    yaml: &str,
    dedup: Dedup,
    a: Request<Full<Bytes>>,
    b: Request<Full<Bytes>>,
) -> bool {
    let (client, up) = gated(&[], &dedup, yaml);
    let first = spawn(&client, a);
    until("the first request reaches the upstream", || up.seen() == 1).await;
    let second = spawn(&client, b);
    until("the second request waits or reaches the upstream", || {
        dedup.stats().waiting == 1 || up.seen() == 2
    })
    .await;
    let was_shared = dedup.stats().waiting == 1;
    up.open(2);
    let first = join(first).await.unwrap();
    let second = join(second).await.unwrap();
    assert_eq!(first.1.as_deref(), Some("0"));
    if was_shared {
        assert_eq!(second.1.as_deref(), Some("0"));
        assert!(second.3);
        assert_eq!(up.seen(), 1);
    } else {
        assert_eq!(second.1.as_deref(), Some("1"));
        assert!(!second.3);
        assert_eq!(up.seen(), 2);
    }
    assert_eq!(dedup.stats().in_flight, 0);
    was_shared
}

#[tokio::test(start_paused = true)]
async fn requests_that_may_get_different_answers_are_not_shared() {
    let d = Dedup::default;
    let auth = |v: &str| get("http://up/me").header("authorization", v);
    assert!(shared(d(), req(auth("Bearer a"), ""), req(auth("Bearer a"), "")).await);
    assert!(!shared(d(), req(auth("Bearer a"), ""), req(auth("Bearer b"), "")).await);

    let lang = |v: &str| get("http://up/me").header("accept-language", v);
    assert!(!shared(d(), req(lang("en"), ""), req(lang("uk"), "")).await);
    // The same values, one header missing.
    assert!(!shared(d(), req(lang("en"), ""), req(get("http://up/me"), "")).await);
    let cookie = |v: &str| get("http://up/me").header("cookie", v);
    assert!(!shared(d(), req(cookie("s=1"), ""), req(cookie("s=2"), "")).await);

    // The query string and the host are part of the URI.
    let uris = |a: &str, b: &str| shared(d(), req(get(a), ""), req(get(b), ""));
    assert!(!uris("http://up/a?x=1", "http://up/a?x=2").await);
    assert!(!uris("http://up/a", "http://other/a").await);
    let host = |v: &str| req(get("/a").header("host", v), "");
    assert!(!shared(d(), host("up"), host("other")).await);

    // The body.
    let bodies = |a, b| shared(d(), req(get("http://up/q"), a), req(get("http://up/q"), b));
    assert!(bodies("same", "same").await);
    assert!(!bodies("one", "two").await);

    // Another method.
    let head = Request::builder().method("HEAD").uri("http://up/me");
    assert!(!shared(d(), req(get("http://up/me"), ""), req(head, "")).await);
}

/// A request that carries its caller's own deadline or cancellation token is never shared: a
/// leader's would decide the followers' answer.
#[tokio::test(start_paused = true)]
async fn a_request_with_its_own_deadline_or_cancellation_is_not_shared() {
    let d = Dedup::default;
    let plain = || req(get("http://up/me"), "");
    let within = || {
        let mut r = plain();
        r.extensions_mut()
            .insert(retryplane_agent::layer::Within(Duration::from_secs(5)));
        r
    };
    let token = || {
        let mut r = plain();
        r.extensions_mut()
            .insert(retryplane_agent::CancellationToken::new());
        r
    };
    assert!(shared(d(), plain(), plain()).await, "the test can tell");
    assert!(!shared(d(), within(), within()).await);
    assert!(!shared(d(), token(), token()).await);
    assert!(!shared(d(), plain(), within()).await);
    assert!(!shared(d(), token(), plain()).await);
}

#[tokio::test(start_paused = true)]
async fn which_headers_count_is_configurable() {
    let id = |v: &str| get("http://up/me").header("x-request-id", v);
    let tenant = |v: &str| get("http://up/me").header("x-tenant", v);
    let debug = |v: &str| get("http://up/me").header("x-debug-id", v);
    // A request id is ignored by default; a header the layer does not know is compared, so
    // two tenants never share an answer.
    assert!(shared(Dedup::default(), req(id("1"), ""), req(id("2"), "")).await);
    assert!(!shared(Dedup::default(), req(tenant("a"), ""), req(tenant("b"), "")).await);
    assert!(shared(Dedup::default(), req(tenant("a"), ""), req(tenant("a"), "")).await);
    let no_debug = || Dedup::default().ignore_header(http::HeaderName::from_static("x-debug-id"));
    assert!(!shared(Dedup::default(), req(debug("1"), ""), req(debug("2"), "")).await);
    assert!(shared(no_debug(), req(debug("1"), ""), req(debug("2"), "")).await);
    // A fixed list: only those headers count, and the credential headers always do.
    let by_tenant = || Dedup::default().vary_only_on([http::HeaderName::from_static("x-tenant")]);
    assert!(!shared(by_tenant(), req(tenant("a"), ""), req(tenant("b"), "")).await);
    assert!(shared(by_tenant(), req(debug("1"), ""), req(debug("2"), "")).await);
    let user = |v: &str| req(get("http://up/me").header("authorization", v), "");
    assert!(!shared(by_tenant(), user("Bearer a"), user("Bearer b")).await);
    // Every header: any difference counts, the order of names does not.
    let all = || Dedup::default().vary_on_all_headers();
    assert!(!shared(all(), req(id("1"), ""), req(id("2"), "")).await);
    let two = |first: (&str, &str), second: (&str, &str)| {
        req(
            get("http://up/me")
                .header(first.0, first.1)
                .header(second.0, second.1),
            "",
        )
    };
    assert!(
        shared(
            all(),
            two(("x-a", "1"), ("x-b", "2")),
            two(("x-b", "2"), ("x-a", "1"))
        )
        .await
    );
}

/// Headers that make an answer partial or conditional are in the key whatever the headers
/// chosen: a 206 for another range, or a 304 with no body, is a wrong answer to a request
/// that did not ask for it.
#[tokio::test(start_paused = true)]
async fn range_and_conditions_are_always_in_the_key() {
    let by_accept = || Dedup::default().vary_only_on([http::header::ACCEPT]);
    let plain = || req(get("http://up/file"), "");
    assert!(
        shared(by_accept(), plain(), plain()).await,
        "the test can tell"
    );
    for (name, a, b) in [
        ("range", "bytes=0-1", "bytes=2-3"),
        ("if-range", "\"v1\"", "\"v2\""),
        ("if-none-match", "\"v1\"", "\"v2\""),
        ("if-match", "\"v1\"", "\"v2\""),
        (
            "if-modified-since",
            "Sun, 06 Nov 1994 08:49:37 GMT",
            "Mon, 07 Nov 1994 08:49:37 GMT",
        ),
        (
            "if-unmodified-since",
            "Sun, 06 Nov 1994 08:49:37 GMT",
            "Mon, 07 Nov 1994 08:49:37 GMT",
        ),
    ] {
        let with = |v: &'static str| req(get("http://up/file").header(name, v), "");
        assert!(!shared(by_accept(), with(a), with(b)).await, "{name}");
        assert!(!shared(by_accept(), with(a), plain()).await, "{name}");
        let ignoring = Dedup::default().ignore_header(http::HeaderName::from_static(name));
        assert!(!shared(ignoring, with(a), with(b)).await, "{name} ignored");
    }
}

/// An answer that sets a cookie or is marked for one client (`Cache-Control: private` or
/// `no-store`) is not handed to another: each follower makes its own call.
#[tokio::test(start_paused = true)]
async fn an_answer_for_one_client_only_is_not_shared() {
    for (name, value) in [
        ("set-cookie", "sid=session-0"),
        ("cache-control", "private"),
        ("cache-control", "max-age=60, no-store"),
        ("cache-control", "Private=\"set-cookie\""),
        // Another directive's argument with a byte outside ASCII.
        ("cache-control", "no-store, ext=\"caf\u{e9}\""),
    ] {
        let dedup = Dedup::default();
        let (up, leader, followers) = x_led(&[Step::Header(name, value)], &dedup, POLICY, 2).await;
        up.open(3);
        assert_answered(join(leader).await, 0, false);
        let mut calls: Vec<String> = Vec::new();
        for f in followers {
            let (status, call, _, copy) = join(f).await.unwrap();
            assert_eq!((status, copy), (200, false), "{name}: {value}");
            calls.push(call.unwrap());
        }
        calls.sort();
        assert_eq!(calls, ["1", "2"], "{name}: {value}");
        assert_eq!(up.seen(), 3);
        assert_eq!(dedup.stats().own_calls, 2);
    }
    // Cache-Control that allows a shared cache to keep the answer: shared.
    let dedup = Dedup::default();
    let (up, leader, followers) = x_led(
        &[Step::Header(
            "cache-control",
            "public, max-age=60, no-cache",
        )],
        &dedup,
        POLICY,
        2,
    )
    .await;
    one_call_answers_all(&up, leader, followers).await;
}

/// A leader's answer given up on because the leader's deadline left no room for a retry is
/// not a follower's: one that joined later has time left, and makes its own call.
#[tokio::test(start_paused = true)]
async fn an_answer_the_leaders_deadline_gave_up_on_is_not_shared() {
    let dedup = Dedup::default();
    let (client, up) = gated(&[Step::Status(503)], &dedup, SHORT);
    let leader = spawn(&client, req(get("http://up/x"), ""));
    until("the leader reaches the upstream", || up.seen() == 1).await;
    tokio::time::sleep(Duration::from_secs(8)).await;
    let follower = spawn(&client, req(get("http://up/x"), ""));
    until("the follower waits", || dedup.stats().waiting == 1).await;
    // 50 ms before the leader's deadline: its 100 ms pause does not fit.
    tokio::time::sleep(Duration::from_millis(1950)).await;
    up.open(1);
    let (status, call, _, copy) = join(leader).await.unwrap();
    assert_eq!((status, call.as_deref(), copy), (503, Some("0"), false));
    until("the follower makes its own call", || up.seen() == 2).await;
    up.open(1);
    assert_answered(join(follower).await, 1, false);
    assert_eq!(dedup.stats().own_calls, 1);
}

/// A refresh hook that fails its first run (a token service's passing error) and succeeds
/// after.
struct FailsOnce(std::sync::atomic::AtomicUsize);

impl retryplane_agent::layer::RefreshCredentials for FailsOnce {
    async fn refresh(&self, _parts: &mut http::request::Parts) -> Result<(), BoxError> {
        match self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed) {
            0 => Err("token service unavailable".into()),
            _ => Ok(()),
        }
    }
}

/// A 401 whose credential refresh failed is the leader's: a follower runs its own refresh.
#[tokio::test(start_paused = true)]
async fn a_401_whose_refresh_failed_is_not_shared() {
    let dedup = Dedup::default();
    let (svc, up) = upstream(&[Step::Status(401)]);
    let client = RetryLayer::new(agent(&policy(POLICY)).endpoint("ep"))
        .with_auth_refresh(FailsOnce(Default::default()))
        .with_dedup(dedup.clone())
        .layer(svc);
    let (leader, follower) =
        leader_and_followers(&client, &dedup, &up, || req(get("http://up/x"), ""), 1).await;
    up.open(2);
    let (status, call, _, copy) = join(leader).await.unwrap();
    assert_eq!((status, call.as_deref(), copy), (401, Some("0"), false));
    for f in follower {
        assert_answered(join(f).await, 1, false);
    }
    assert_eq!(dedup.stats().own_calls, 1);
}

#[tokio::test(start_paused = true)]
async fn requests_to_different_hosts_are_never_shared() {
    // A bare path names its upstream in `Host` (as HTTP/1 carries it): two hosts are two
    // upstreams, whichever headers the key is told to cover.
    let host = |v: &str| req(get("/v1/items").header("host", v), "");
    let host_name = http::header::HOST;
    let modes = [
        Dedup::default(),
        Dedup::default().vary_only_on([http::HeaderName::from_static("accept")]),
        Dedup::default().vary_only_on([]),
        Dedup::default().ignore_header(host_name.clone()),
        Dedup::default()
            .vary_only_on([host_name.clone()])
            .ignore_header(host_name),
    ];
    for dedup in modes {
        assert!(
            !shared(dedup.clone(), host("a.internal"), host("b.internal")).await,
            "{dedup:?}"
        );
        assert!(
            shared(dedup.clone(), host("a.internal"), host("a.internal")).await,
            "{dedup:?}"
        );
    }
    // Nor are requests to one authority that name different hosts.
    let both = |v: &str| req(get("http://10.0.0.1/v1/items").header("host", v), "");
    let listed = Dedup::default().vary_only_on([]);
    assert!(!shared(listed, both("a.internal"), both("b.internal")).await);
}

#[tokio::test(start_paused = true)]
async fn writes_are_not_shared_unless_their_method_is_added() {
    let post = || {
        req(
            Request::builder().method("POST").uri("http://up/search"),
            "q",
        )
    };
    assert!(!shared(Dedup::default(), post(), post()).await);
    let options = || req(Request::builder().method("OPTIONS").uri("http://up/"), "");
    assert!(!shared(Dedup::default(), options(), options()).await);
    // An added method is shared only for requests declared idempotent (or that the policy
    // calls idempotent).
    let declared = || {
        let mut r = post();
        r.extensions_mut().insert(Idempotent(true));
        r
    };
    let share_post = || Dedup::default().share_method(http::Method::POST);
    assert!(!shared(share_post(), post(), post()).await);
    assert!(shared(share_post(), declared(), declared()).await);
}

#[tokio::test(start_paused = true)]
async fn reads_that_are_not_idempotent_under_the_policy_in_force_are_not_shared() {
    let d = Dedup::default;
    let me = || req(get("http://up/me"), "");
    let marked = |idempotent: bool| {
        let mut r = me();
        r.extensions_mut().insert(Idempotent(idempotent));
        r
    };
    assert!(shared(d(), me(), me()).await);
    assert!(!shared(d(), marked(false), marked(false)).await);
    assert!(shared(d(), marked(true), marked(true)).await);

    // The endpoint's method list, then a route's.
    let no_get = format!("{POLICY}\nidempotent_methods: [HEAD, PUT]");
    assert!(!shared_under(&no_get, d(), me(), me()).await);
    assert!(shared_under(&no_get, d(), marked(true), marked(true)).await);
    let live = || req(get("http://up/live/feed"), "");
    let route = format!(
        "{POLICY}\nroutes:\n  - match: {{method: GET, path_prefix: /live}}\n    idempotent_methods: [PUT]"
    );
    assert!(!shared_under(&route, d(), live(), live()).await);
    assert!(shared_under(&route, d(), me(), me()).await);
}

#[tokio::test(start_paused = true)]
async fn an_inner_service_that_reserves_capacity_in_poll_ready_is_called_on_it() {
    // `ConcurrencyLimit` takes its permit in `poll_ready`, for the readied instance only.
    let (svc, up) = upstream(&[Step::Status(503)]);
    let client = client(
        tower::limit::ConcurrencyLimit::new(svc, 1),
        &Dedup::default(),
    );
    up.open(3);
    let first = join(spawn(&client, req(get("http://up/a"), "")))
        .await
        .unwrap();
    assert_eq!(
        (first.0, first.1.as_deref()),
        (200, Some("1")),
        "retried once"
    );
    let second = join(spawn(&client, req(get("http://up/a"), "")))
        .await
        .unwrap();
    assert_eq!((second.0, second.1.as_deref()), (200, Some("2")));
    assert_eq!(up.seen(), 3);
}

#[tokio::test(start_paused = true)]
async fn a_body_over_the_request_limit_is_not_shared() {
    let (svc, up) = upstream(&[]);
    let dedup = Dedup::default();
    let agent = agent(&policy(POLICY));
    let client = RetryLayer::new(agent.endpoint("ep"))
        .with_body_limit(2)
        .with_dedup(dedup.clone())
        .layer(svc);
    let a = spawn(&client, req(get("http://up/q"), "long"));
    let b = spawn(&client, req(get("http://up/q"), "long"));
    until("both reach the upstream", || up.seen() == 2).await;
    up.open(2);
    assert_eq!(join(a).await.unwrap().0, 200);
    assert_eq!(join(b).await.unwrap().0, 200);
    assert_eq!(dedup.stats().led, 0);
}

#[tokio::test(start_paused = true)]
async fn followers_of_a_cancelled_leader_complete_one_leading() {
    let dedup = Dedup::default();
    let (up, leader, followers) = x_led(&[], &dedup, POLICY, 3).await;

    leader.abort();
    // One follower takes the lead and calls; the other two follow it.
    until("a new leader calls and two follow it", || {
        up.seen() == 2 && dedup.stats().waiting == 2
    })
    .await;
    up.open(1);
    let mut copies = 0;
    for f in followers {
        let (status, call, body, copy) = join(f).await.unwrap();
        assert_eq!(
            (status, call.as_deref(), &body[..]),
            (200, Some("1"), &b"answer 1"[..])
        );
        copies += usize::from(copy);
    }
    assert_eq!(copies, 2);
    assert_eq!(up.seen(), 2);
    let stats = dedup.stats();
    assert_eq!(
        (stats.led, stats.shared, stats.waiting, stats.in_flight),
        (2, 2, 0, 0)
    );
}

#[tokio::test(start_paused = true)]
async fn a_dropped_follower_leaves_the_others_waiting() {
    let dedup = Dedup::default();
    let (up, leader, followers) = x_led(&[], &dedup, POLICY, 2).await;
    let [gone, stays] = <[_; 2]>::try_from(followers).unwrap();
    gone.abort();
    until("one follower waits", || dedup.stats().waiting == 1).await;
    up.open(1);
    assert_eq!(join(leader).await.unwrap().1.as_deref(), Some("0"));
    assert_eq!(join(stays).await.unwrap().1.as_deref(), Some("0"));
    assert_eq!(up.seen(), 1);
}

#[tokio::test(start_paused = true)]
async fn over_the_response_limit_followers_make_their_own_calls() {
    // "answer n" is 8 bytes.
    let dedup = Dedup::default().with_response_limit(4);
    let (client, up) = gated(&[], &dedup, POLICY);
    let (leader, followers) =
        leader_and_followers(&client, &dedup, &up, || req(get("http://up/big"), ""), 3).await;
    up.open(4);
    // The leader gets its whole body, streamed past the limit.
    assert_answered(join(leader).await, 0, false);
    let mut calls = Vec::new();
    for f in followers {
        let (status, call, body, copy) = join(f).await.unwrap();
        let call = call.unwrap();
        assert_eq!((status, copy), (200, false));
        assert_eq!(body, format!("answer {call}"));
        calls.push(call);
    }
    calls.sort();
    assert_eq!(calls, ["1", "2", "3"]);
    assert_eq!(up.seen(), 4);
    let stats = dedup.stats();
    assert_eq!((stats.led, stats.shared, stats.own_calls), (1, 0, 3));
    assert_eq!(stats.in_flight, 0);
}

#[tokio::test(start_paused = true)]
async fn a_leader_error_sends_followers_to_their_own_calls() {
    // Refused, and not retried (max_attempts 1): the leader returns the error.
    let dedup = Dedup::default();
    let once = "max_attempts: 1\ndeadline: 600s\nper_try_timeout: 600s";
    let (up, leader, followers) = x_led(&[Step::Refused], &dedup, once, 2).await;
    up.open(3);
    let err = join(leader).await.unwrap_err();
    assert!(err.contains("refused"), "{err}");
    for f in followers {
        let (status, _, _, copy) = join(f).await.unwrap();
        assert_eq!((status, copy), (200, false));
    }
    assert_eq!(up.seen(), 3);
    assert_eq!(dedup.stats().own_calls, 2);
}

#[tokio::test(start_paused = true)]
async fn without_dedup_identical_requests_each_make_a_call() {
    let (svc, up) = upstream(&[]);
    let agent = agent(&policy(POLICY));
    let client = RetryLayer::new(agent.endpoint("ep")).layer(svc);
    let handles: Vec<_> = (0..2)
        .map(|_| {
            let c = client.clone();
            tokio::spawn(async move { c.oneshot(req(get("http://up/x"), "")).await.unwrap() })
        })
        .collect();
    until("both reach the upstream", || up.seen() == 2).await;
    up.open(2);
    for h in handles {
        let response = h.await.unwrap();
        assert_eq!(response.status(), 200);
        assert!(response.extensions().get::<Deduplicated>().is_none());
    }
}

#[tokio::test(start_paused = true)]
async fn requests_that_differ_only_in_proxy_authorization_are_not_shared() {
    let proxy = |v: &str| req(get("http://up/me").header("proxy-authorization", v), "");
    assert!(!shared(Dedup::default(), proxy("Basic a"), proxy("Basic b")).await);
    assert!(shared(Dedup::default(), proxy("Basic a"), proxy("Basic a")).await);
}

/// A response body whose chunks come when the test sends them; it ends when the sender is
/// dropped.
struct ChanBody(mpsc::UnboundedReceiver<Bytes>);

impl http_body::Body for ChanBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, io::Error>>> {
        self.0
            .poll_recv(cx)
            .map(|chunk| chunk.map(|c| Ok(http_body::Frame::data(c))))
    }
}

/// An upstream that answers at once: request 0 with its head and `first`, the rest of its
/// body held until the test sends it (through the sender it leaves in the returned slot);
/// request `n` > 0 with `answer n`, whole. Counts the requests it saw.
#[allow(clippy::type_complexity)]
fn stalling_upstream(
    first: &'static str,
) -> (
    impl tower::Service<
        Request<Body>,
        Response = Response<ChanBody>,
        Error = io::Error,
        Future = impl Send,
    > + Clone
    + Send
    + 'static,
    Arc<Mutex<Option<mpsc::UnboundedSender<Bytes>>>>,
    Arc<Mutex<usize>>,
) {
    let stalled = Arc::new(Mutex::new(None));
    let seen = Arc::new(Mutex::new(0usize));
    let (slot, count) = (stalled.clone(), seen.clone());
    let svc = service_fn(move |_req: Request<Body>| {
        let (slot, count) = (slot.clone(), count.clone());
        async move {
            let n = {
                let mut seen = count.lock().unwrap();
                *seen += 1;
                *seen - 1
            };
            let (tx, rx) = mpsc::unbounded_channel();
            if n == 0 {
                tx.send(Bytes::from_static(first.as_bytes())).unwrap();
                *slot.lock().unwrap() = Some(tx);
            } else {
                tx.send(Bytes::from(format!("answer {n}"))).unwrap();
            }
            Ok::<_, io::Error>(
                Response::builder()
                    .header("x-call", n.to_string())
                    .body(ChanBody(rx))
                    .unwrap(),
            )
        }
    });
    (svc, stalled, seen)
}

#[tokio::test(start_paused = true)]
async fn a_leader_whose_body_stalls_hands_its_followers_to_their_own_calls_by_its_deadline() {
    let (svc, stalled, seen) = stalling_upstream("part one, ");
    let dedup = Dedup::default();
    let client = client_with(svc, &dedup, SHORT);
    let t0 = Instant::now();
    let c = client.clone();
    let leader = tokio::spawn(async move { c.oneshot(req(get("http://up/slow"), "")).await });
    until("the upstream answers the leader's head", || {
        stalled.lock().unwrap().is_some()
    })
    .await;
    // Followers come later: their own deadlines are after the leader's.
    tokio::time::sleep(DEADLINE / 2).await;
    let followers: Vec<_> = (0..2)
        .map(|_| {
            let c = client.clone();
            tokio::spawn(async move {
                let response = c.oneshot(req(get("http://up/slow"), "")).await.unwrap();
                let at = t0.elapsed();
                let call = response.headers()["x-call"].to_str().unwrap().to_owned();
                let copy = response.extensions().get::<Deduplicated>().is_some();
                let body = response.into_body().collect().await.unwrap().to_bytes();
                (at, call, copy, body)
            })
        })
        .collect();
    until("two followers wait", || dedup.stats().waiting == 2).await;

    // The leader's body read ends at its deadline: each follower makes its own call then.
    let mut calls = Vec::new();
    for f in followers {
        let (at, call, copy, body) = tokio::time::timeout(Duration::from_secs(60), f)
            .await
            .expect("a follower hung")
            .unwrap();
        assert!(
            at >= DEADLINE && at <= DEADLINE + Duration::from_millis(1),
            "{at:?}"
        );
        assert!(!copy);
        assert_eq!(body, format!("answer {call}"));
        calls.push(call);
    }
    calls.sort();
    assert_eq!(calls, ["1", "2"]);

    // The leader's caller has the response head, before the upstream sends the rest.
    let response = tokio::time::timeout(Duration::from_secs(60), leader)
        .await
        .expect("the leader hung")
        .unwrap()
        .unwrap();
    assert!(t0.elapsed() <= DEADLINE + Duration::from_millis(1));
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["x-call"], "0");
    assert!(response.extensions().get::<Deduplicated>().is_none());
    let rest = stalled.lock().unwrap().take().unwrap();
    rest.send(Bytes::from_static(b"part two")).unwrap();
    drop(rest);
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], b"part one, part two");

    assert_eq!(*seen.lock().unwrap(), 3);
    assert_eq!(
        dedup.stats(),
        DedupStats {
            led: 1,
            shared: 0,
            own_calls: 2,
            waiting: 0,
            in_flight: 0
        }
    );
}

#[tokio::test(start_paused = true)]
async fn a_follower_of_a_leader_that_is_not_polled_gives_up_at_its_deadline() {
    let dedup = Dedup::default();
    let (client, up) = gated(&[], &dedup, SHORT);
    // Polled once: the leader reaches the upstream and waits at the gate. Its caller holds it
    // and never polls it again.
    let mut leader = Box::pin(client.clone().oneshot(req(get("http://up/x"), "")));
    let polled = std::future::poll_fn(|cx| Poll::Ready(leader.as_mut().poll(cx))).await;
    assert!(polled.is_pending());
    assert_eq!(up.seen(), 1);

    let t0 = Instant::now();
    let follower = spawn(&client, req(get("http://up/x"), ""));
    until("the follower waits", || dedup.stats().waiting == 1).await;
    // Its deadline counts from when its call began: waiting used all of it, so it makes no
    // call of its own and gives up then.
    let err = join(follower).await.unwrap_err();
    assert_eq!(t0.elapsed(), DEADLINE);
    assert!(err.contains("deadline"), "{err}");
    assert_eq!(up.seen(), 1);
    let stats = dedup.stats();
    assert_eq!((stats.own_calls, stats.waiting, stats.in_flight), (1, 0, 1));
    drop(leader);
    assert_eq!(dedup.stats().in_flight, 0);
}

#[tokio::test(start_paused = true)]
async fn followers_answered_with_a_copy_are_not_counted_only_the_leaders_call_is() {
    let agent = agent(&policy(POLICY));
    let (svc, up) = upstream(&[Step::Status(503)]);
    let dedup = Dedup::default();
    let client = client_of(&agent, svc, &dedup);
    let (leader, followers) =
        leader_and_followers(&client, &dedup, &up, || req(get("http://up/x"), ""), 3).await;
    // A 503, then the retry's 200.
    up.open(2);
    assert_eq!(join(leader).await.unwrap().0, 200);
    for f in followers {
        let (status, _, _, copy) = join(f).await.unwrap();
        assert_eq!((status, copy), (200, true));
    }
    assert_eq!(dedup.stats().shared, 3);
    // One logical call (the leader's: two attempts), none for the three copies.
    let c = agent.endpoint("ep").pending_counts();
    assert_eq!(
        (c.calls, c.attempts, c.retries, c.success_after_retry),
        (1, 2, 1, 1)
    );
    assert_eq!(c.success_first_try, 0);
}

#[tokio::test(start_paused = true)]
async fn two_layered_services_sharing_one_dedup_never_share_an_answer() {
    // What a service below the layer adds (a tenant's credential, the upstream of a bare
    // path) is not in the key: requests through two `layer` calls are never shared, even with
    // one `Dedup` and one endpoint.
    let (svc, up) = upstream(&[]);
    let dedup = Dedup::default();
    let agent = agent(&policy(POLICY));
    let (a, b) = (
        client_of(&agent, svc.clone(), &dedup),
        client_of(&agent, svc, &dedup),
    );
    let request = || req(get("/v1/me"), "");
    let first = spawn(&a, request());
    until("a's request reaches the upstream", || up.seen() == 1).await;
    let second = spawn(&b, request());
    until("b's request reaches the upstream", || up.seen() == 2).await;
    assert_eq!(dedup.stats().waiting, 0);
    // A clone of a layered service is the same client: it shares.
    let third = spawn(&a.clone(), request());
    until("a's clone waits for a's call", || {
        dedup.stats().waiting == 1
    })
    .await;
    up.open(2);
    let answers = [join(first).await, join(second).await, join(third).await];
    let calls: Vec<_> = answers
        .iter()
        .map(|a| {
            let (_, call, _, copy) = a.as_ref().unwrap();
            (call.clone().unwrap(), *copy)
        })
        .collect();
    assert_eq!(
        calls,
        [
            ("0".to_owned(), false),
            ("1".to_owned(), false),
            ("0".to_owned(), true)
        ]
    );
    assert_eq!(up.seen(), 2);
}

#[tokio::test(start_paused = true)]
async fn a_concurrency_limit_below_the_layer_does_not_stop_sharing() {
    // With one request at a time below, the followers must still join the leader's call
    // instead of waiting for capacity and each calling the upstream in turn.
    let (svc, up) = upstream(&[]);
    let dedup = Dedup::default();
    let limited = tower::limit::ConcurrencyLimitLayer::new(1).layer(svc);
    let client = client(limited, &dedup);
    let request = || req(get("http://up/x"), "");
    let (leader, followers) = leader_and_followers(&client, &dedup, &up, request, 4).await;
    one_call_answers_all(&up, leader, followers).await;
    assert_eq!(dedup.stats().shared, 4);
}

#[tokio::test(start_paused = true)]
async fn waiting_for_capacity_below_the_layer_is_not_part_of_the_first_attempt() {
    // Four different reads through a limit of one, each answered in 800 ms: the fourth waits
    // 2.4 s for capacity. Its 1 s per-try timeout starts when it is sent, so every call
    // succeeds at once; the wait is bounded by the 10 s deadline only.
    let upstream = service_fn(|_req: Request<Body>| async {
        tokio::time::sleep(Duration::from_millis(800)).await;
        Ok::<_, io::Error>(Response::new(Full::new(Bytes::from_static(b"ok"))))
    });
    let dedup = Dedup::default();
    let agent = agent(&policy(
        "max_attempts: 3\ndeadline: 10s\nper_try_timeout: 1s",
    ));
    let limited = tower::limit::ConcurrencyLimitLayer::new(1).layer(upstream);
    let client = client_of(&agent, limited, &dedup);
    let calls: Vec<_> = (0..4)
        .map(|i| {
            let client = client.clone();
            let request = req(get(&format!("http://up/item/{i}")), "");
            tokio::spawn(async move { client.oneshot(request).await.map(|r| r.status()) })
        })
        .collect();
    for call in calls {
        assert_eq!(call.await.unwrap().unwrap(), 200);
    }
    let counts = agent.endpoint("ep").pending_counts();
    assert_eq!(
        (counts.calls, counts.success_first_try),
        (4, 4),
        "{counts:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn an_inner_service_that_cannot_get_ready_ends_the_call_at_once_uncounted() {
    #[derive(Clone)]
    struct Closed;
    impl tower::Service<Request<Body>> for Closed {
        type Response = Response<Full<Bytes>>;
        type Error = io::Error;
        type Future = std::future::Ready<Result<Self::Response, io::Error>>;
        fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), io::Error>> {
            Poll::Ready(Err(io::Error::other("the worker is gone")))
        }
        fn call(&mut self, _req: Request<Body>) -> Self::Future {
            panic!("called without being ready");
        }
    }
    let dedup = Dedup::default();
    let agent = agent(&policy(POLICY));
    let client = client_of(&agent, Closed, &dedup);
    let began = Instant::now();
    let error = client
        .oneshot(req(get("http://up/x"), ""))
        .await
        .unwrap_err();
    assert!(error.to_string().contains("the worker is gone"), "{error}");
    assert_eq!(began.elapsed(), Duration::ZERO, "no attempt, no pause");
    let counts = agent.endpoint("ep").pending_counts();
    assert_eq!((counts.calls, counts.attempts), (0, 0), "{counts:?}");
}

#[tokio::test(start_paused = true)]
async fn an_open_breaker_refuses_at_once_a_call_that_would_wait_for_capacity() {
    // The only permit below is held by a slow call; the breaker opens meanwhile. A read that
    // would wait for that permit is refused at once (`circuit_open`), as SPEC §2 step 2 says,
    // not held until its deadline.
    let agent = agent(&policy(BREAKER));
    let (limited, plain, seen) = breaker_clients(&agent);
    let slow = holding_the_permit(&limited, "the slow call", &seen, 1).await;
    fail_twice(&plain).await;
    refused_at_once(&limited).await;
    let counts = agent.endpoint("ep").pending_counts();
    assert_eq!(counts.circuit_open, 1, "{counts:?}");
    slow.abort();
}

/// An upstream for the breaker tests: `/slow` answers 200 after 20 s, `/fail` 503 at once,
/// anything else 200 at once; `seen` counts the requests.
fn breaker_upstream(seen: &Arc<std::sync::atomic::AtomicUsize>) -> impl Below + use<> {
    let counter = seen.clone();
    service_fn(move |req: Request<Body>| {
        counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        async move {
            let status = match req.uri().path() {
                "/slow" => {
                    tokio::time::sleep(Duration::from_secs(20)).await;
                    200
                }
                "/fail" => 503,
                _ => 200,
            };
            let response = Response::builder()
                .status(status)
                .body(Full::new(Bytes::new()))
                .unwrap();
            Ok::<_, io::Error>(response)
        }
    })
}

/// The breaker tests' clients of `agent`'s endpoint `ep`, over one [`breaker_upstream`]: a
/// de-duplicating one through a limit of one request at a time below, a plain one, and the
/// upstream's count of requests.
fn breaker_clients(
    agent: &Agent,
) -> (
    Client<impl Below>,
    Retry<impl Below>,
    Arc<std::sync::atomic::AtomicUsize>,
) {
    let seen = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let upstream = breaker_upstream(&seen);
    let dedup = Dedup::default();
    let limited = client_of(
        agent,
        tower::limit::ConcurrencyLimitLayer::new(1).layer(upstream.clone()),
        &dedup,
    );
    let plain = RetryLayer::new(agent.endpoint("ep")).layer(upstream);
    (limited, plain, seen)
}

/// A slow call (`POST http://up/slow`) through `limited`, on a task, once it holds the permit
/// below: once the upstream's count of requests, `seen`, is `count` (`what` names the call).
async fn holding_the_permit<S>(
    limited: &Client<S>,
    what: &str,
    seen: &std::sync::atomic::AtomicUsize,
    count: usize,
) -> JoinHandle<Result<Response<ResponseBody<Full<Bytes>>>, BoxError>>
where
    Client<S>: Sends,
{
    let slow = tokio::spawn(limited.clone().oneshot(req(
        Request::builder().method("POST").uri("http://up/slow"),
        "",
    )));
    until(&format!("{what} holds the permit"), || {
        seen.load(std::sync::atomic::Ordering::SeqCst) == count
    })
    .await;
    slow
}

/// A read (`GET http://up/b`) through `limited` is refused at once, by the open breaker.
async fn refused_at_once<S>(limited: &Client<S>)
where
    Client<S>: Sends,
{
    let began = Instant::now();
    let refused = limited
        .clone()
        .oneshot(req(get("http://up/b"), ""))
        .await
        .unwrap_err();
    assert_eq!(began.elapsed(), Duration::ZERO, "{refused}");
    assert!(refused.to_string().contains("circuit_open"), "{refused}");
}

/// Two reads answered 503 through `plain`: with `min_requests: 2`, they open the breaker.
async fn fail_twice<S, B>(plain: &S)
where
    S: tower::Service<Request<Full<Bytes>>, Response = Response<B>> + Clone,
    S::Error: std::fmt::Debug,
{
    for _ in 0..2 {
        let failed = plain.clone().oneshot(req(get("http://up/fail"), "")).await;
        assert_eq!(failed.unwrap().status(), 503);
    }
}

#[tokio::test(start_paused = true)]
async fn a_half_open_breaker_with_its_probe_out_refuses_at_once_a_call_that_would_wait_for_capacity()
 {
    // The breaker opened, then went half-open; its one probe is a slow call that also holds the
    // only permit below. A read that would wait for that permit would be refused whenever it
    // got it (the probe is out), so it is refused at once, not held until its deadline.
    let agent = agent(&policy(
        "max_attempts: 1\ndeadline: 10s\nper_try_timeout: 10s\ncircuit_breaker: {enabled: true, failure_ratio: 0.5, min_requests: 2, open_for: 1s, half_open_probes: 1}",
    ));
    let (limited, plain, seen) = breaker_clients(&agent);
    fail_twice(&plain).await;
    tokio::time::advance(Duration::from_secs(1)).await;
    let probe = holding_the_permit(&limited, "the probe", &seen, 3).await;
    refused_at_once(&limited).await;
    assert_eq!(agent.endpoint("ep").pending_counts().circuit_open, 1);
    probe.abort();
}

#[tokio::test(start_paused = true)]
async fn a_call_waiting_for_capacity_fails_fast_when_the_breaker_opens_meanwhile() {
    // A read waits for the only permit below, held by a slow call. Meanwhile other calls fail
    // and open the breaker: the waiting read would be refused whenever it got the permit, so
    // it ends within a tenth of a second with `circuit_open`, not at its deadline.
    let agent = agent(&policy(BREAKER));
    let (limited, plain, seen) = breaker_clients(&agent);
    let slow = holding_the_permit(&limited, "the slow call", &seen, 1).await;
    let began = Instant::now();
    let waiting = tokio::spawn(limited.clone().oneshot(req(get("http://up/b"), "")));
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!waiting.is_finished(), "it waits for the permit");
    fail_twice(&plain).await;
    let opened = Instant::now();
    let refused = waiting.await.unwrap().unwrap_err();
    assert!(refused.to_string().contains("circuit_open"), "{refused}");
    let after = opened.elapsed();
    assert!(
        after <= Duration::from_millis(100),
        "{after:?} after the breaker opened"
    );
    assert!(began.elapsed() < DEADLINE);
    assert_eq!(
        seen.load(std::sync::atomic::Ordering::SeqCst),
        3,
        "never sent"
    );
    assert_eq!(agent.endpoint("ep").pending_counts().circuit_open, 1);
    slow.abort();
}

#[tokio::test(start_paused = true)]
async fn an_open_breaker_refuses_a_call_before_the_service_below_is_asked_to_get_ready() {
    // The breaker is open. The service below would fail to get ready (and could dial the
    // upstream the breaker cut off to try): it is not asked, and the call is the breaker's
    // refusal, counted as one.
    #[derive(Clone)]
    struct Closed;
    impl tower::Service<Request<Body>> for Closed {
        type Response = Response<Full<Bytes>>;
        type Error = io::Error;
        type Future = std::future::Ready<Result<Self::Response, io::Error>>;
        fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), io::Error>> {
            panic!("asked to get ready while the breaker is open");
        }
        fn call(&mut self, _req: Request<Body>) -> Self::Future {
            panic!("called while the breaker is open");
        }
    }
    let seen = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let agent = agent(&policy(BREAKER));
    let plain = RetryLayer::new(agent.endpoint("ep")).layer(breaker_upstream(&seen));
    fail_twice(&plain).await;
    let dedup = Dedup::default();
    let refused = client_of(&agent, Closed, &dedup)
        .oneshot(req(get("http://up/x"), ""))
        .await
        .unwrap_err();
    assert!(refused.to_string().contains("circuit_open"), "{refused}");
    let counts = agent.endpoint("ep").pending_counts();
    assert_eq!((counts.calls, counts.circuit_open), (3, 1), "{counts:?}");
}
