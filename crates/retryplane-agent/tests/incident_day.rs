//! An incident day end to end, against SPEC §2 (budget rule 6, the circuit breaker, jitter rule
//! 7) and SPEC §4 (the counters, the retry-ratio flag): a real control plane in API mode, four
//! agents of two services (`checkout` through `Endpoint::call`, `search` through the tower
//! layer) calling one upstream on loopback that falls over (503s, then connection resets, then
//! 429 with `Retry-After: 1`) and comes back. During the outage an operator lowers
//! `max_attempts`, tightens the budget and turns the breaker on; after it, rolls back. What the
//! upstream saw, what the calls returned and what the control plane shows must agree exactly.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use retryplane_agent::layer::{GaveUp, ReplayBody, RetryError, RetryLayer};
use retryplane_agent::{Agent, AttemptInfo, CallMeta};
use retryplane_proto::pb;
use retryplane_server::server::Running;
use support::plane::{admin, apply, eventually, plane_with};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;
use tower::{Layer as _, ServiceExt as _};

/// The longest one call may take before the test fails.
const WAIT: Duration = Duration::from_secs(15);

/// Before the incident: four attempts, a generous budget, no breaker.
const V1: &str = "version: 1
defaults:
  max_attempts: 4
  backoff: {base: 20ms, max: 80ms, multiplier: 2.0, jitter: full}
  deadline: 10s
  per_try_timeout: 2s
  retry_after: {honor: true, max: 5s}
  budget: {enabled: true, ratio: 0.5, min_per_second: 100, window: 2s}
  circuit_breaker: {enabled: false}
endpoints:
  up: {}
";

/// During it: two attempts, a budget of 4 retries per 2 s window, the breaker on.
const V2: &str = "version: 1
defaults:
  max_attempts: 2
  backoff: {base: 20ms, max: 80ms, multiplier: 2.0, jitter: full}
  deadline: 10s
  per_try_timeout: 2s
  retry_after: {honor: true, max: 5s}
  budget: {enabled: true, ratio: 0.1, min_per_second: 2, window: 2s}
  circuit_breaker: {enabled: true, failure_ratio: 0.5, min_requests: 8, window: 2s, open_for: 800ms, half_open_probes: 2}
endpoints:
  up: {}
";

const OPEN_FOR: Duration = Duration::from_millis(800);
const MIN_REQUESTS: usize = 8;

/// `(window, reserve, ratio)` of a stage's budget.
fn budget_of(stage: u8) -> (Duration, u64, f64) {
    match stage {
        3 => (Duration::from_secs(2), 4, 0.1),
        _ => (Duration::from_secs(2), 200, 0.5),
    }
}

const HEALTHY: u8 = 0;
const UNAVAILABLE: u8 = 1;
const RESETS: u8 = 2;
const THROTTLED: u8 = 3;
/// 200 after 1 s (the half-open probes: the calls beside them, begun at once, all meet the
/// breaker before a probe's answer closes it, even on a loaded machine).
const SLOW_OK: u8 = 4;
/// 429 with `Retry-After: 3`.
const THROTTLED_LONG: u8 = 5;

/// One request the upstream read.
#[derive(Clone, Debug)]
struct Hit {
    agent: String,
    call: u64,
    at: Instant,
    /// What it answered: one of the phases.
    phase: u8,
}

#[derive(Clone, Default)]
struct Upstream {
    phase: Arc<AtomicU8>,
    hits: Arc<Mutex<Vec<Hit>>>,
}

impl Upstream {
    fn set(&self, phase: u8) {
        self.phase.store(phase, Ordering::SeqCst);
    }
    fn hits(&self) -> Vec<Hit> {
        self.hits.lock().unwrap().clone()
    }
}

async fn read_head(s: &mut TcpStream) -> Option<String> {
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
    Some(String::from_utf8_lossy(&buf).into_owned())
}

fn header(head: &str, name: &str) -> String {
    head.lines()
        .find_map(|l| {
            let (n, v) = l.split_once(':')?;
            n.trim()
                .eq_ignore_ascii_case(name)
                .then(|| v.trim().to_owned())
        })
        .unwrap_or_default()
}

/// The upstream on 127.0.0.1:0: answers by its phase (200, 503, a reset, 429 with
/// `Retry-After: 1`), recording every request it read before answering.
async fn upstream() -> (String, Upstream) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let up = Upstream::default();
    let me = up.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let me = me.clone();
            tokio::spawn(async move {
                while let Some(head) = read_head(&mut s).await {
                    let phase = me.phase.load(Ordering::SeqCst);
                    me.hits.lock().unwrap().push(Hit {
                        agent: header(&head, "x-agent"),
                        call: header(&head, "x-call").parse().unwrap_or(0),
                        at: Instant::now(),
                        phase,
                    });
                    let answer = match phase {
                        HEALTHY => "HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
                        UNAVAILABLE => "HTTP/1.1 503 X\r\ncontent-length: 0\r\n\r\n",
                        THROTTLED => {
                            "HTTP/1.1 429 X\r\nretry-after: 1\r\ncontent-length: 0\r\n\r\n"
                        }
                        THROTTLED_LONG => {
                            "HTTP/1.1 429 X\r\nretry-after: 3\r\ncontent-length: 0\r\n\r\n"
                        }
                        SLOW_OK => {
                            tokio::time::sleep(Duration::from_secs(1)).await;
                            "HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"
                        }
                        _ => {
                            let _ = s.set_zero_linger();
                            return;
                        }
                    };
                    if s.write_all(answer.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (format!("http://{addr}/x"), up)
}

/// One attempt an agent's `Endpoint::call` made, as the attempt was told.
#[derive(Clone, Debug)]
struct Tried {
    call: u64,
    number: u32,
    pause_before: Option<Duration>,
}

/// One logical call and how it ended.
#[derive(Clone, Debug)]
struct Called {
    call: u64,
    stage: u8,
    /// Just before the call began (its budget deposit comes after).
    start: Instant,
    ok: bool,
    /// The give-up cause; `transport` for a layer call that ended on the inner error.
    cause: Option<String>,
    /// Attempts, as the call said them (`None` when it does not say).
    attempts: Option<u32>,
}

type Inner = tower::util::BoxCloneSyncService<
    http::Request<ReplayBody<Full<Bytes>>>,
    http::Response<hyper::body::Incoming>,
    hyper_util::client::legacy::Error,
>;
type Layered = retryplane_agent::layer::Retry<Inner, retryplane_agent::layer::NoDedup>;

/// When each attempt's answer (or error) came back to the agent, by call: the instant the
/// retry after it is decided.
type Ends = Arc<Mutex<Vec<(u64, Instant)>>>;

struct Member {
    id: String,
    service: &'static str,
    agent: Agent,
    plain: Client<HttpConnector, Full<Bytes>>,
    layered: Option<Layered>,
    tried: Arc<Mutex<Vec<Tried>>>,
    ends: Ends,
    calls: Mutex<Vec<Called>>,
}

static NEXT_CALL: AtomicU64 = AtomicU64::new(1);

impl Member {
    fn new(running: &Running, id: &str, service: &'static str, layer: bool) -> Arc<Member> {
        // No `rng_seed`: each agent seeds its jitter as a deployed one does.
        let agent = builder_unseeded(running, id, service);
        let ends = Ends::default();
        let layered = layer.then(|| {
            let client = Client::builder(TokioExecutor::new()).build(HttpConnector::new());
            let ends = ends.clone();
            let inner = tower::service_fn(move |req: http::Request<ReplayBody<Full<Bytes>>>| {
                let call: u64 = req.headers()["x-call"].to_str().unwrap().parse().unwrap();
                let sent = client.request(req);
                let ends = ends.clone();
                async move {
                    let r = sent.await;
                    ends.lock().unwrap().push((call, Instant::now()));
                    r
                }
            });
            RetryLayer::new(agent.endpoint("up")).layer(Inner::new(inner))
        });
        Arc::new(Member {
            id: id.to_owned(),
            service,
            plain: Client::builder(TokioExecutor::new()).build(HttpConnector::new()),
            agent,
            layered,
            tried: Arc::default(),
            ends,
            calls: Mutex::default(),
        })
    }

    fn calls(&self) -> Vec<Called> {
        self.calls.lock().unwrap().clone()
    }

    /// One logical GET through the agent, recorded.
    async fn call(&self, url: &str, stage: u8) -> Called {
        let call = NEXT_CALL.fetch_add(1, Ordering::SeqCst);
        let start = Instant::now();
        let called = match &self.layered {
            None => {
                let client = self.plain.clone();
                let tried = self.tried.clone();
                let ends = self.ends.clone();
                let (url, id) = (url.to_owned(), self.id.clone());
                let result = tokio::time::timeout(
                    WAIT,
                    self.agent.endpoint("up").call(
                        CallMeta::http("GET", "/x"),
                        move |info: AttemptInfo| {
                            tried.lock().unwrap().push(Tried {
                                call,
                                number: info.number,
                                pause_before: info.pause_before,
                            });
                            let req = http::Request::builder()
                                .uri(&url)
                                .header("x-agent", &id)
                                .header("x-call", call.to_string())
                                .body(Full::new(Bytes::new()))
                                .unwrap();
                            let client = client.clone();
                            let ends = ends.clone();
                            async move {
                                let r = client.request(req).await;
                                let r = match r {
                                    Ok(r) => {
                                        let (parts, body) = r.into_parts();
                                        let _ = body.collect().await;
                                        Ok(http::Response::from_parts(parts, ()))
                                    }
                                    Err(e) => Err(e),
                                };
                                ends.lock().unwrap().push((call, Instant::now()));
                                r
                            }
                        },
                    ),
                )
                .await
                .expect("the call ends");
                match result {
                    Ok(r) => Called {
                        call,
                        stage,
                        start,
                        ok: r.status() == 200,
                        cause: None,
                        attempts: None,
                    },
                    Err(e) => Called {
                        call,
                        stage,
                        start,
                        ok: false,
                        cause: Some(e.cause.to_string()),
                        attempts: Some(e.attempts),
                    },
                }
            }
            Some(svc) => {
                let req = http::Request::builder()
                    .uri(url)
                    .header("x-agent", &self.id)
                    .header("x-call", call.to_string())
                    .body(Full::new(Bytes::new()))
                    .unwrap();
                let r = tokio::time::timeout(WAIT, svc.clone().oneshot(req))
                    .await
                    .expect("the call ends");
                let (ok, cause, attempts) = match r {
                    Ok(resp) => match resp.extensions().get::<GaveUp>() {
                        Some(g) => (false, Some(g.cause.to_string()), Some(g.attempts)),
                        None => (resp.status() == 200, None, None),
                    },
                    Err(e) => match e.downcast_ref::<RetryError>() {
                        Some(RetryError::NoAnswer { cause }) => {
                            (false, Some(cause.to_string()), Some(0))
                        }
                        Some(RetryError::TimedOut { cause, attempts }) => {
                            (false, Some(cause.to_string()), Some(*attempts))
                        }
                        None => (false, Some("transport".to_owned()), None),
                    },
                };
                Called {
                    call,
                    stage,
                    start,
                    ok,
                    cause,
                    attempts,
                }
            }
        };
        self.calls.lock().unwrap().push(called.clone());
        called
    }
}

/// A fleet agent as a service deploys it: no fixed seed.
fn builder_unseeded(running: &Running, id: &str, service: &str) -> Agent {
    Agent::builder()
        .url(format!("http://{}", running.agent_addr))
        .service(service)
        .agent_id(id)
        .metrics_interval(Duration::from_millis(200))
        .reconnect_backoff(retryplane_agent::ReconnectBackoff::new(
            Duration::from_millis(20),
            Duration::from_millis(300),
            Duration::from_secs(10),
        ))
        .connect()
        .unwrap()
}

/// One agent of each service: `checkout` through `Endpoint::call`, `search` through the layer.
const PAIR: &[(&str, &str, bool)] = &[
    ("checkout-1", "checkout", false),
    ("search-1", "search", true),
];

/// One test's world: a control plane in API mode (metrics every 200 ms), the upstream, and
/// the agents.
struct Day {
    _dir: tempfile::TempDir,
    running: Running,
    url: String,
    up: Upstream,
    members: Vec<Arc<Member>>,
}

impl Day {
    /// The control plane on `seed` as version 1, the upstream healthy, and `members` (`(agent
    /// id, service, through the tower layer)`) connected and on version 1.
    async fn start(seed: &str, members: &[(&str, &'static str, bool)]) -> Day {
        let dir = tempfile::tempdir().unwrap();
        let running = plane_with(dir.path(), seed, None, |c| {
            c.metrics_interval = Duration::from_millis(200);
        })
        .await;
        let (url, up) = upstream().await;
        let members = members
            .iter()
            .map(|&(id, service, layer)| Member::new(&running, id, service, layer))
            .collect();
        let day = Day {
            _dir: dir,
            running,
            url,
            up,
            members,
        };
        day.all_on(1).await;
        day
    }

    /// The operator applies `yaml`, which becomes `version`; returns once every agent runs it.
    async fn apply(&self, yaml: &str, version: u64) {
        assert_eq!(apply(&self.running, yaml.to_owned()).await, version);
        self.all_on(version).await;
    }

    /// The operator rolls back to `to`, which comes back as `version`; returns once every
    /// agent runs it.
    async fn roll_back(&self, to: u64, version: u64) {
        let rolled = admin(&self.running)
            .await
            .rollback(pb::RollbackRequest {
                version: to,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(rolled.version, version);
        self.all_on(version).await;
    }

    /// Waits until every agent runs `version` and the control plane has seen each ack it.
    async fn all_on(&self, version: u64) {
        let members = &self.members;
        eventually(&format!("every agent on v{version}"), || async {
            members
                .iter()
                .all(|m| m.agent.policies().version() == version)
        })
        .await;
        eventually(
            &format!("the control plane sees every agent ack v{version}"),
            || async {
                let fleet = self.fleet().await;
                members.iter().all(|m| {
                    fleet.agents.iter().any(|a| {
                        a.agent_id == m.id
                            && a.service == m.service
                            && a.connected
                            && a.applied_version == version
                            && a.last_response == "ack"
                    })
                })
            },
        )
        .await;
    }

    async fn fleet(&self) -> pb::FleetStatusResponse {
        admin(&self.running)
            .await
            .fleet_status(pb::FleetStatusRequest::default())
            .await
            .unwrap()
            .into_inner()
    }

    /// Runs `f` for every member at once, with the upstream's URL, and waits for all.
    async fn each<F, Fut>(&self, f: F)
    where
        F: Fn(Arc<Member>, String) -> Fut,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let mut set = tokio::task::JoinSet::new();
        for m in &self.members {
            set.spawn(f(m.clone(), self.url.clone()));
        }
        while let Some(r) = set.join_next().await {
            r.unwrap();
        }
    }

    /// Every member makes calls of `stage`, 20 ms apart, until the upstream has read `n` of
    /// its requests since now; `what` names what did not come.
    async fn until_hits(&self, stage: u8, n: usize, what: &'static str) {
        let up = self.up.clone();
        let since = up.hits().len();
        self.each(move |m, u| {
            let up = up.clone();
            async move {
                let end = Instant::now() + WAIT;
                while up.hits()[since..]
                    .iter()
                    .filter(|h| h.agent == m.id)
                    .count()
                    < n
                {
                    assert!(Instant::now() < end, "{}: {what}", m.id);
                    m.call(&u, stage).await;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        })
        .await;
    }

    /// Waits until the control plane's lifetime counters of `service` pass `check`; `what`
    /// names what is waited for.
    async fn reported(&self, service: &str, what: &str, check: impl Fn(&pb::Counters) -> bool) {
        eventually(what, || async {
            series(&self.running, service)
                .await
                .and_then(|s| s.lifetime)
                .is_some_and(|c| check(&c))
        })
        .await;
    }

    /// Shuts every agent and the control plane down, then fails with `problems` if any.
    async fn end(self, problems: Vec<String>) {
        for m in &self.members {
            m.agent.shutdown().await;
        }
        self.running.shutdown().await.unwrap();
        assert!(problems.is_empty(), "{}", problems.join("\n"));
    }
}

/// `tasks` tasks at once, each making `calls` calls of `stage` from `m` one after another;
/// returns once all have ended, with every call's outcome.
async fn at_once(m: &Arc<Member>, url: &str, stage: u8, tasks: usize, calls: u64) -> Vec<Called> {
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..tasks {
        let (m, u) = (m.clone(), url.to_owned());
        set.spawn(async move {
            let mut out = Vec::new();
            for _ in 0..calls {
                out.push(m.call(&u, stage).await);
            }
            out
        });
    }
    let mut out = Vec::new();
    while let Some(r) = set.join_next().await {
        out.extend(r.unwrap());
    }
    out
}

/// The hits per call id, in order.
fn by_call(hits: &[Hit]) -> BTreeMap<u64, Vec<Hit>> {
    let mut out: BTreeMap<u64, Vec<Hit>> = BTreeMap::new();
    for h in hits {
        out.entry(h.call).or_default().push(h.clone());
    }
    out
}

/// `name{service="S",endpoint="up"[,extra]} V` from the control plane's `/metrics`.
async fn scrape(running: &Running) -> String {
    let mut tcp = TcpStream::connect(running.http_addr).await.unwrap();
    tcp.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut response = String::new();
    tcp.read_to_string(&mut response).await.unwrap();
    response
}

fn sample(text: &str, name: &str, service: &str, extra: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(name)?.strip_prefix('{')?;
        let (labels, value) = rest.split_once("} ")?;
        let mut want = vec![
            format!("service=\"{service}\""),
            "endpoint=\"up\"".to_owned(),
        ];
        if !extra.is_empty() {
            want.push(extra.to_owned());
        }
        let have: Vec<&str> = labels.split(',').collect();
        (have.len() == want.len() && want.iter().all(|w| have.contains(&w.as_str())))
            .then(|| value.trim().split(' ').next().unwrap().parse().unwrap())
    })
}

async fn series(running: &Running, service: &str) -> Option<pb::SeriesStats> {
    admin(running)
        .await
        .stats(pb::StatsRequest::default())
        .await
        .ok()?
        .into_inner()
        .series
        .into_iter()
        .find(|s| s.service == service && s.endpoint == "up")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_incident_day_follows_every_version_and_the_control_plane_adds_up_to_what_the_upstream_saw()
 {
    let day = Day::start(
        V1,
        &[
            ("checkout-1", "checkout", false),
            ("checkout-2", "checkout", false),
            ("search-1", "search", true),
            ("search-2", "search", true),
        ],
    )
    .await;
    let up = &day.up;

    // 1. A quiet morning.
    day.each(|m, u| async move {
        for _ in 0..5 {
            assert!(m.call(&u, 1).await.ok);
        }
    })
    .await;

    // 2. The upstream falls over: 503s. Under v1 every call makes its 4 attempts.
    up.set(UNAVAILABLE);
    day.each(|m, u| async move {
        for _ in 0..8 {
            let c = m.call(&u, 2).await;
            assert_eq!(
                (c.ok, c.cause.as_deref()),
                (false, Some("attempts_exhausted")),
                "{}: {c:?}",
                m.id
            );
        }
    })
    .await;

    // 3. The operator tightens everything.
    day.apply(V2, 2).await;
    // The next call after the swap follows v2: its budget took over the storm's retries, so
    // the first failure is not retried (v1 would have retried it).
    day.each(|m, u| async move {
        let c = m.call(&u, 3).await;
        assert_eq!(
            (c.cause.as_deref(), c.attempts),
            (Some("budget_exhausted"), Some(1)),
            "{}: the first call after the swap: {c:?}",
            m.id
        );
    })
    .await;
    // 503s go on until each agent's breaker opens.
    day.each(|m, u| async move {
        for _ in 0..40 {
            if m.call(&u, 3).await.cause.as_deref() == Some("circuit_open") {
                return;
            }
        }
        panic!("{}: the breaker never opened", m.id);
    })
    .await;
    // Then connection resets, until each agent has had two (its breaker's probes).
    up.set(RESETS);
    day.until_hits(3, 2, "no probe reached the upstream").await;
    // Then 429 with Retry-After: 1, until each agent has had two.
    up.set(THROTTLED);
    day.until_hits(3, 2, "no 429 reached it").await;
    // The upstream comes back: each breaker closes, and then every call goes through.
    up.set(HEALTHY);
    day.each(|m, u| async move {
        let end = Instant::now() + WAIT;
        let mut in_a_row = 0;
        while in_a_row < 10 {
            assert!(Instant::now() < end, "{}: the breaker never closed", m.id);
            let c = m.call(&u, 3).await;
            if c.ok {
                in_a_row += 1;
            } else {
                assert_eq!(
                    in_a_row, 0,
                    "{}: a refusal after the breaker closed: {c:?}",
                    m.id
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    })
    .await;

    // 4. The operator rolls back to v1 (as v3): 4 attempts again, no breaker.
    day.roll_back(1, 3).await;
    up.set(UNAVAILABLE);
    day.each(|m, u| async move {
        for _ in 0..12 {
            let c = m.call(&u, 4).await;
            assert_eq!(
                c.cause.as_deref(),
                Some("attempts_exhausted"),
                "{}: after the rollback: {c:?}",
                m.id
            );
            if let Some(a) = c.attempts {
                assert_eq!(a, 4, "{}: {c:?}", m.id);
            }
        }
    })
    .await;
    up.set(HEALTHY);
    day.each(|m, u| async move {
        for _ in 0..3 {
            assert!(m.call(&u, 4).await.ok);
        }
    })
    .await;

    // What the upstream saw, per agent.
    let hits = up.hits();
    let mut problems: Vec<String> = Vec::new();
    for m in &day.members {
        let mine: Vec<Hit> = hits.iter().filter(|h| h.agent == m.id).cloned().collect();
        let calls = m.calls();
        let stage_of: HashMap<u64, u8> = calls.iter().map(|c| (c.call, c.stage)).collect();
        let per_call = by_call(&mine);
        // Every call's attempts: at most what its version allows, and as many as it said.
        for c in &calls {
            let n = per_call.get(&c.call).map_or(0, Vec::len);
            let max = if c.stage == 3 { 2 } else { 4 };
            if n > max {
                problems.push(format!(
                    "{}: call {} made {n} attempts under stage {}",
                    m.id, c.call, c.stage
                ));
            }
            if let Some(a) = c.attempts
                && usize::try_from(a).unwrap() != n
            {
                problems.push(format!(
                    "{}: call {c:?} says {a} attempts, the upstream saw {n}",
                    m.id
                ));
            }
        }
        // Budget (SPEC §2 rule 6), per window, at each retry's decision.
        problems.extend(budget_breaches(m, budget_of));
        // Breaker (v2): exactly `min_requests` failed attempts before it first stops a call,
        // and no attempt while it is open.
        let stage3: Vec<&Called> = calls.iter().filter(|c| c.stage == 3).collect();
        let first3 = stage3[0].call;
        let first_refusal = stage3
            .iter()
            .find(|c| c.cause.as_deref() == Some("circuit_open"))
            .unwrap()
            .call;
        let before_open = mine
            .iter()
            .filter(|h| h.call >= first3 && h.call <= first_refusal)
            .count();
        if before_open != MIN_REQUESTS {
            problems.push(format!(
                "{}: the breaker first stopped a call after {before_open} failed attempts, min_requests is {MIN_REQUESTS}",
                m.id
            ));
        }
        let refused_between = |a: u64, b: u64| {
            stage3
                .iter()
                .any(|c| c.call > a && c.call < b && c.attempts == Some(0))
        };
        let hits3: Vec<&Hit> = mine
            .iter()
            .filter(|h| stage_of.get(&h.call) == Some(&3))
            .collect();
        for w in hits3.windows(2) {
            if w[0].phase != HEALTHY
                && refused_between(w[0].call, w[1].call)
                && w[1].at.duration_since(w[0].at) < OPEN_FOR
            {
                problems.push(format!(
                    "{}: an attempt {:?} after the failure that opened the breaker (open_for {OPEN_FOR:?})",
                    m.id,
                    w[1].at.duration_since(w[0].at)
                ));
            }
        }
        // After a 429 with Retry-After: 1, the next attempt of the call comes a second later
        // (no ceiling of v2 comes near it), whichever way the agent is called.
        for v in per_call.values() {
            for w in v.windows(2) {
                let gap = w[1].at.duration_since(w[0].at);
                if w[0].phase == THROTTLED && gap < Duration::from_secs(1) {
                    problems.push(format!("{}: retried {gap:?} after Retry-After: 1", m.id));
                }
            }
        }
        // Pauses (SPEC §2 rule 7), as each attempt was told: full jitter within the ceiling,
        // and exactly the Retry-After after a 429 (the hint is longer than any ceiling).
        let tried = m.tried.lock().unwrap().clone();
        for t in tried.iter().filter(|t| t.number > 1) {
            let pause = t.pause_before.unwrap();
            let prev = &per_call[&t.call][usize::try_from(t.number).unwrap() - 2];
            if prev.phase == THROTTLED {
                if pause != Duration::from_secs(1) {
                    problems.push(format!(
                        "{}: a pause of {pause:?} after Retry-After: 1",
                        m.id
                    ));
                }
            } else {
                let ceiling = Duration::from_millis((20u64 << (t.number - 2)).min(80));
                if pause > ceiling {
                    problems.push(format!(
                        "{}: a pause of {pause:?} over its ceiling {ceiling:?} before attempt {}",
                        m.id, t.number
                    ));
                }
            }
        }
    }
    // Jitter: no two agents pause in lock-step (the storm's gaps between attempts).
    let gaps = |m: &Member| -> Vec<Duration> {
        let mine: Vec<Hit> = hits.iter().filter(|h| h.agent == m.id).cloned().collect();
        let stage_of: HashMap<u64, u8> = m.calls().iter().map(|c| (c.call, c.stage)).collect();
        by_call(&mine)
            .iter()
            .filter(|(c, _)| stage_of[*c] == 2)
            .flat_map(|(_, v)| {
                v.windows(2)
                    .map(|w| w[1].at.duration_since(w[0].at))
                    .collect::<Vec<_>>()
            })
            .collect()
    };
    for (i, a) in day.members.iter().enumerate() {
        for b in &day.members[i + 1..] {
            let (ga, gb) = (gaps(a), gaps(b));
            assert_eq!(ga.len(), 24);
            let same = ga
                .iter()
                .zip(&gb)
                .filter(|(x, y)| x.abs_diff(**y) < Duration::from_millis(1))
                .count();
            if same > 12 {
                problems.push(format!(
                    "{} and {} paused in lock-step: {same} of 24 gaps within 1 ms",
                    a.id, b.id
                ));
            }
        }
    }

    // What the control plane shows (SPEC §4): exactly what the upstream saw and the calls
    // returned, per service.
    for service in ["checkout", "search"] {
        let ms: Vec<&Arc<Member>> = day
            .members
            .iter()
            .filter(|m| m.service == service)
            .collect();
        let calls: Vec<Called> = ms.iter().flat_map(|m| m.calls()).collect();
        let mine: Vec<Hit> = hits
            .iter()
            .filter(|h| ms.iter().any(|m| m.id == h.agent))
            .cloned()
            .collect();
        let per_call = by_call(&mine);
        let n_calls = calls.len() as u64;
        day.reported(service, &format!("{service}'s calls reported"), |c| {
            c.calls == n_calls
        })
        .await;
        let s = series(&day.running, service).await.unwrap();
        let life = s.lifetime.unwrap();
        let attempts = mine.len() as u64;
        let sent_first = per_call.len() as u64;
        let count = |f: &dyn Fn(&Called) -> bool| calls.iter().filter(|c| f(c)).count() as u64;
        let hits_of = |c: &Called| per_call.get(&c.call).map_or(0, Vec::len);
        let honored = per_call
            .values()
            .map(|v| {
                v[..v.len() - 1]
                    .iter()
                    .filter(|h| h.phase == THROTTLED)
                    .count() as u64
            })
            .sum::<u64>();
        let mut want = pb::Counters {
            calls: n_calls,
            attempts,
            retries: attempts - sent_first,
            success_first_try: count(&|c| c.ok && hits_of(c) == 1),
            success_after_retry: count(&|c| c.ok && hits_of(c) > 1),
            gave_up_attempts: count(&|c| c.cause.as_deref() == Some("attempts_exhausted")),
            gave_up_budget: count(&|c| c.cause.as_deref() == Some("budget_exhausted")),
            gave_up_deadline: count(&|c| c.cause.as_deref() == Some("deadline_exceeded")),
            gave_up_retry_after: count(&|c| c.cause.as_deref() == Some("retry_after_too_long")),
            gave_up_not_retryable: count(&|c| c.cause.as_deref() == Some("not_retryable")),
            circuit_open: count(&|c| c.cause.as_deref() == Some("circuit_open")),
            backoff_ms: life.backoff_ms,
            retry_after_honored: honored,
            cancelled: 0,
        };
        let unknown = count(&|c| c.cause.as_deref() == Some("transport"));
        if unknown > 0 {
            // The layer hands back the inner error of a call that gave up on one, without its
            // cause: those calls are in one of the give-up counts.
            let known = want.gave_up_attempts
                + want.gave_up_budget
                + want.circuit_open
                + want.gave_up_deadline;
            let shown = life.gave_up_attempts
                + life.gave_up_budget
                + life.circuit_open
                + life.gave_up_deadline;
            if shown != known + unknown {
                problems.push(format!(
                    "{service}: {shown} give-ups shown, {} made",
                    known + unknown
                ));
            }
            want.gave_up_attempts = life.gave_up_attempts;
            want.gave_up_budget = life.gave_up_budget;
            want.circuit_open = life.circuit_open;
            want.gave_up_deadline = life.gave_up_deadline;
        }
        if life != want {
            problems.push(format!(
                "{service}: Stats shows {life:?}\n  the upstream and the calls say {want:?}"
            ));
        }
        let outcomes = life.success_first_try
            + life.success_after_retry
            + life.gave_up_attempts
            + life.gave_up_budget
            + life.gave_up_deadline
            + life.gave_up_retry_after
            + life.gave_up_not_retryable
            + life.circuit_open
            + life.cancelled;
        if outcomes != life.calls {
            problems.push(format!(
                "{service}: {outcomes} outcomes for {} calls",
                life.calls
            ));
        }
        if service == "checkout" {
            let paused: Duration = ms
                .iter()
                .flat_map(|m| m.tried.lock().unwrap().clone())
                .filter_map(|t| t.pause_before)
                .sum();
            let pauses = ms
                .iter()
                .map(|m| {
                    m.tried
                        .lock()
                        .unwrap()
                        .iter()
                        .filter(|t| t.pause_before.is_some())
                        .count()
                })
                .sum::<usize>() as u64;
            let ms_paused = u64::try_from(paused.as_millis()).unwrap();
            if life.backoff_ms.abs_diff(ms_paused) > pauses {
                problems.push(format!(
                    "{service}: backoff {} ms shown, {ms_paused} ms paused",
                    life.backoff_ms
                ));
            }
        }
        // Per version: v1's calls before the change, v2's during it, v3's after the rollback.
        let mut by_version: Vec<(u64, u64)> = s
            .versions
            .iter()
            .map(|v| (v.policy_version, v.lifetime.unwrap_or_default().calls))
            .collect();
        by_version.sort_unstable();
        let want_versions = vec![
            (1, count(&|c| c.stage <= 2)),
            (2, count(&|c| c.stage == 3)),
            (3, count(&|c| c.stage == 4)),
        ];
        if by_version != want_versions {
            problems.push(format!(
                "{service}: calls per version {by_version:?}, made {want_versions:?}"
            ));
        }
        // Every window (1, 5 and 15 minutes) holds the whole day, which lasted under a minute.
        for w in &s.windows {
            if w.counters != Some(life) {
                problems.push(format!(
                    "{service}: the {} s window shows {:?}, lifetime {life:?}",
                    w.window_seconds, w.counters
                ));
            }
        }
        if s.policy_version != 3 {
            problems.push(format!(
                "{service}: series policy_version {}",
                s.policy_version
            ));
        }
        // The retry-ratio flag: far past 5 %, over far more than 20 calls.
        let alert = s.alert.unwrap();
        let five = s
            .windows
            .iter()
            .find(|w| w.window_seconds == 300)
            .unwrap()
            .counters
            .unwrap();
        if !alert.firing {
            problems.push(format!(
                "{service}: the retry-ratio alert is not firing: {alert:?}"
            ));
        }
        let ratio = five.retries as f64 / five.calls as f64;
        if (alert.ratio - ratio).abs() > 1e-9 {
            problems.push(format!(
                "{service}: alert ratio {} but the 5m window says {ratio}",
                alert.ratio
            ));
        }
        // `/metrics`: the same figures.
        let text = scrape(&day.running).await;
        for (name, extra, v) in [
            ("retryplane_calls_total", "", life.calls),
            ("retryplane_attempts_total", "", life.attempts),
            ("retryplane_retries_total", "", life.retries),
            ("retryplane_circuit_open_total", "", life.circuit_open),
            (
                "retryplane_retry_after_honored_total",
                "",
                life.retry_after_honored,
            ),
            (
                "retryplane_giveups_total",
                "cause=\"budget_exhausted\"",
                life.gave_up_budget,
            ),
            (
                "retryplane_giveups_total",
                "cause=\"attempts_exhausted\"",
                life.gave_up_attempts,
            ),
        ] {
            let got = sample(&text, name, service, extra);
            if got != Some(v as f64) {
                problems.push(format!(
                    "{service}: /metrics {name}{{{extra}}} is {got:?}, Stats says {v}"
                ));
            }
        }
        let got = sample(&text, "retryplane_retry_ratio", service, "window=\"5m\"");
        if got.is_none_or(|g| (g - ratio).abs() > 1e-9) {
            problems.push(format!(
                "{service}: /metrics retry ratio 5m {got:?}, want {ratio}"
            ));
        }
        if sample(&text, "retryplane_retry_ratio_alert", service, "") != Some(1.0) {
            problems.push(format!(
                "{service}: /metrics retryplane_retry_ratio_alert is not 1"
            ));
        }
    }
    let fleet = day.fleet().await;
    if fleet.current_version != 3 {
        problems.push(format!(
            "FleetStatus current_version {}",
            fleet.current_version
        ));
    }
    let text = scrape(&day.running).await;
    let agents_on = |v: &str| {
        text.lines().find_map(|l| {
            l.strip_prefix(&format!("retryplane_agents{{applied_version=\"{v}\"}} "))
                .map(|x| x.trim().parse::<f64>().unwrap())
        })
    };
    if agents_on("3") != Some(4.0)
        || [agents_on("1"), agents_on("2")]
            .iter()
            .any(|n| n.is_some_and(|n| n != 0.0))
    {
        problems.push(format!(
            "/metrics retryplane_agents: v1 {:?}, v2 {:?}, v3 {:?}; want 4 on v3",
            agents_on("1"),
            agents_on("2"),
            agents_on("3")
        ));
    }
    if fleet.alerting_endpoints != vec!["up".to_owned()] {
        problems.push(format!("FleetStatus flags {:?}", fleet.alerting_endpoints));
    }
    day.end(problems).await;
}

/// How long after a failed answer the agent may read its budget's window (a thread of a
/// loaded machine descheduled between the answer and the read): the window it reads may end
/// that much later than the answer, so calls begun meanwhile count, and retries that left it
/// meanwhile do not.
const SETTLE: Duration = Duration::from_millis(100);

/// Budget breaches of `m`'s retries against SPEC §2 rule 6, with `(window, reserve, ratio)`
/// by the stage of the retry's call, in the agent's own times: a call counts from just before
/// it began, a retry from the moment the failed answer before it came back (when the agent
/// decides it).
fn budget_breaches(m: &Member, budget: impl Fn(u8) -> (Duration, u64, f64)) -> Vec<String> {
    let calls = m.calls();
    let stage_of: HashMap<u64, u8> = calls.iter().map(|c| (c.call, c.stage)).collect();
    let starts: Vec<Instant> = calls.iter().map(|c| c.start).collect();
    let mut ends: BTreeMap<u64, Vec<Instant>> = BTreeMap::new();
    for (call, at) in m.ends.lock().unwrap().iter() {
        ends.entry(*call).or_default().push(*at);
    }
    // Each end but a call's last was followed by a retry.
    let mut retries: Vec<(Instant, u8)> = Vec::new();
    for (call, v) in &ends {
        for at in &v[..v.len() - 1] {
            retries.push((*at, stage_of[call]));
        }
    }
    retries.sort_by_key(|r| r.0);
    let mut out = Vec::new();
    for (t, stage) in &retries {
        let (window, reserve, ratio) = budget(*stage);
        let from = *t - window;
        let in_window = retries
            .iter()
            .filter(|(r, _)| *r > from + SETTLE && r <= t)
            .count() as u64;
        let calls_in = starts
            .iter()
            .filter(|s| **s > from && **s <= *t + SETTLE)
            .count() as f64;
        let allowed = reserve.max((ratio * calls_in + 1e-9) as u64);
        if in_window > allowed {
            out.push(format!(
                "{}: {in_window} retries in the {window:?} up to a retry of a stage-{stage} call, {calls_in} calls begun, allowed {allowed}",
                m.id
            ));
        }
    }
    out
}

const BREAKER_OFF: &str = "version: 1
defaults:
  max_attempts: 1
  budget: {enabled: false}
  circuit_breaker: {enabled: false}
endpoints:
  up: {}
";

const BREAKER_ON: &str = "version: 1
defaults:
  max_attempts: 1
  budget: {enabled: false}
  circuit_breaker: {enabled: true, failure_ratio: 0.5, min_requests: 4, window: 10s, open_for: 500ms, half_open_probes: 2}
endpoints:
  up: {}
";

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_breaker_turned_on_mid_outage_opens_at_min_requests_and_lets_exactly_its_probes_through()
{
    let day = Day::start(BREAKER_OFF, PAIR).await;
    let (up, url) = (&day.up, &day.url);
    up.set(UNAVAILABLE);
    for m in &day.members {
        for _ in 0..6 {
            assert_eq!(
                m.call(url, 1).await.cause.as_deref(),
                Some("attempts_exhausted")
            );
        }
    }
    day.apply(BREAKER_ON, 2).await;
    let mut problems = Vec::new();
    let mut tripped = Vec::new();
    for m in &day.members {
        let before = up.hits().iter().filter(|h| h.agent == m.id).count();
        let mut refused = false;
        for _ in 0..10 {
            if m.call(url, 2).await.cause.as_deref() == Some("circuit_open") {
                refused = true;
                break;
            }
        }
        assert!(refused, "{}: the breaker never opened", m.id);
        // Open by now: the upstream's own time of the last failure is earlier, by however
        // long the agent took to read its answer.
        tripped.push(Instant::now());
        let mine: Vec<Hit> = up.hits().into_iter().filter(|h| h.agent == m.id).collect();
        if mine.len() - before != 4 {
            problems.push(format!(
                "{}: opened after {} failed attempts, min_requests 4",
                m.id,
                mine.len() - before
            ));
        }
    }
    // Half-open: once open_for has passed, ten calls at once; exactly two are probes.
    up.set(SLOW_OK);
    let last_trip = *tripped.iter().max().unwrap();
    tokio::time::sleep_until(last_trip + Duration::from_millis(550)).await;
    for (round, want_through) in [(3u8, 2usize), (4, 10)] {
        let before = up.hits().len();
        day.each(move |m, u| async move {
            at_once(&m, &u, round, 10, 1).await;
        })
        .await;
        for m in &day.members {
            let through = up.hits()[before..]
                .iter()
                .filter(|h| h.agent == m.id)
                .count();
            let calls: Vec<Called> = m.calls().into_iter().filter(|c| c.stage == round).collect();
            let refused = calls
                .iter()
                .filter(|c| c.cause.as_deref() == Some("circuit_open"))
                .count();
            let ok = calls.iter().filter(|c| c.ok).count();
            if (through, ok, refused) != (want_through, want_through, 10 - want_through) {
                problems.push(format!(
                    "{}: round {round}: {through} reached the upstream, {ok} succeeded, {refused} refused; want {want_through}, {want_through}, {}",
                    m.id,
                    10 - want_through
                ));
            }
        }
    }
    day.end(problems).await;
}

const STORM_V1: &str = "version: 1
defaults:
  max_attempts: 5
  backoff: {base: 10ms, max: 10ms, jitter: full}
  budget: {enabled: true, ratio: 0.2, min_per_second: 2, window: 1s}
  circuit_breaker: {enabled: false}
endpoints:
  up: {}
";

const STORM_V2: &str = "version: 1
defaults:
  max_attempts: 5
  backoff: {base: 10ms, max: 10ms, jitter: full}
  budget: {enabled: true, ratio: 0.05, min_per_second: 2, window: 1s}
  circuit_breaker: {enabled: false}
endpoints:
  up: {}
";

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn many_concurrent_callers_never_retry_past_the_budget_in_any_window_also_across_a_tightening()
 {
    let day = Day::start(STORM_V1, PAIR).await;
    let up = &day.up;
    up.set(UNAVAILABLE);
    // 0: before the change; 1: while it goes out; 2: once every agent runs it.
    let stage = Arc::new(AtomicU8::new(0));
    let stop = Arc::new(AtomicU8::new(0));
    let mut storm = tokio::task::JoinSet::new();
    for m in &day.members {
        for _ in 0..16 {
            let (m, u, stage, stop) = (m.clone(), day.url.clone(), stage.clone(), stop.clone());
            storm.spawn(async move {
                while stop.load(Ordering::SeqCst) == 0 {
                    m.call(&u, stage.load(Ordering::SeqCst)).await;
                }
            });
        }
    }
    let started = Instant::now();
    eventually("a second of storm", || async {
        started.elapsed() > Duration::from_millis(1500)
    })
    .await;
    stage.store(1, Ordering::SeqCst);
    day.apply(STORM_V2, 2).await;
    stage.store(2, Ordering::SeqCst);
    let swapped = Instant::now();
    eventually("a second of storm under v2", || async {
        swapped.elapsed() > Duration::from_millis(1500)
    })
    .await;
    stop.store(1, Ordering::SeqCst);
    while let Some(r) = storm.join_next().await {
        r.unwrap();
    }
    let hits = up.hits();
    let mut problems = Vec::new();
    for m in &day.members {
        let calls = m.calls().len();
        let breaches = budget_breaches(m, |s| match s {
            0 => (Duration::from_secs(1), 2, 0.2),
            // Either version's.
            1 => (Duration::from_secs(1), 2, 0.2),
            _ => (Duration::from_secs(1), 2, 0.05),
        });
        problems.extend(breaches.into_iter().take(5));
        // The control plane's counts are the upstream's and the calls'.
        let n = calls as u64;
        day.reported(m.service, &format!("{}'s calls reported", m.id), |c| {
            c.calls == n
        })
        .await;
        let life = series(&day.running, m.service)
            .await
            .unwrap()
            .lifetime
            .unwrap();
        let seen = hits.iter().filter(|h| h.agent == m.id).count() as u64;
        let first = by_call(
            &hits
                .iter()
                .filter(|h| h.agent == m.id)
                .cloned()
                .collect::<Vec<_>>(),
        )
        .len() as u64;
        if (life.attempts, life.retries) != (seen, seen - first) {
            problems.push(format!(
                "{}: Stats {} attempts, {} retries; the upstream saw {seen}, {}",
                m.id,
                life.attempts,
                life.retries,
                seen - first
            ));
        }
    }
    // The storm is over: once retries fall back under 5 % of the calls over 5 minutes, the
    // flag ends (SPEC §4), in Stats, FleetStatus and /metrics.
    up.set(HEALTHY);
    // Enough healthy calls to bring every service's retries well under 5 % of its calls: the
    // storm's own share depends on how fast the machine made its calls.
    let mut healthy_per_task = 2_500;
    for m in &day.members {
        let s = series(&day.running, m.service).await.unwrap();
        let c = s.lifetime.unwrap();
        let needed = (c.retries * 25).saturating_sub(c.calls);
        healthy_per_task = healthy_per_task.max(needed.div_ceil(8));
    }
    day.each(move |m, u| async move {
        let calls = at_once(&m, &u, 3, 8, healthy_per_task).await;
        let failed = calls.iter().find(|c| !c.ok);
        assert!(
            failed.is_none(),
            "{}: a healthy call failed: {failed:?}",
            m.id
        );
    })
    .await;
    for m in &day.members {
        let retries = series(&day.running, m.service)
            .await
            .unwrap()
            .lifetime
            .unwrap()
            .retries;
        let total = m.calls().len() as u64;
        assert!(
            retries * 20 < total,
            "{}: still {retries} retries for {total} calls",
            m.id
        );
        day.reported(
            m.service,
            &format!("{}'s healthy calls reported", m.id),
            |c| c.calls == total,
        )
        .await;
        eventually(&format!("{}'s retry-ratio flag ends", m.id), || async {
            series(&day.running, m.service)
                .await
                .and_then(|s| s.alert)
                .is_some_and(|a| !a.firing)
        })
        .await;
    }
    let fleet = day.fleet().await;
    if !fleet.alerting_endpoints.is_empty() {
        problems.push(format!(
            "FleetStatus still flags {:?}",
            fleet.alerting_endpoints
        ));
    }
    let text = scrape(&day.running).await;
    for m in &day.members {
        if sample(&text, "retryplane_retry_ratio_alert", m.service, "") != Some(0.0) {
            problems.push(format!(
                "{}: /metrics retryplane_retry_ratio_alert is not 0",
                m.service
            ));
        }
    }
    day.end(problems).await;
}

const BREAKER_LONG: &str = "version: 1
defaults:
  max_attempts: 1
  budget: {enabled: false}
  circuit_breaker: {enabled: true, failure_ratio: 0.5, min_requests: 4, window: 10s, open_for: 60s, half_open_probes: 1}
endpoints:
  up: {}
";

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rolling_back_to_a_policy_without_a_breaker_lets_the_next_call_through_an_open_one() {
    let day = Day::start(BREAKER_OFF, PAIR).await;
    let (up, url) = (&day.up, &day.url);
    day.apply(BREAKER_LONG, 2).await;
    up.set(UNAVAILABLE);
    for m in &day.members {
        for _ in 0..4 {
            assert_eq!(
                m.call(url, 2).await.cause.as_deref(),
                Some("attempts_exhausted")
            );
        }
        let c = m.call(url, 2).await;
        assert_eq!(
            (c.cause.as_deref(), c.attempts),
            (Some("circuit_open"), Some(0)),
            "{}",
            m.id
        );
    }
    // The upstream is back; the operator rolls back to the version without a breaker.
    up.set(HEALTHY);
    day.roll_back(1, 3).await;
    let mut problems = Vec::new();
    for m in &day.members {
        let c = m.call(url, 3).await;
        if !c.ok {
            problems.push(format!(
                "{}: the first call after the rollback to no breaker: {c:?}",
                m.id
            ));
        }
    }
    day.end(problems).await;
}

const STRADDLE_V1: &str = "version: 1
defaults:
  max_attempts: 2
  retry_after: {honor: true, max: 5s}
  budget: {enabled: false}
  circuit_breaker: {enabled: false}
endpoints:
  up: {}
";

const STRADDLE_V2: &str = "version: 1
defaults:
  max_attempts: 3
  retry_after: {honor: true, max: 5s}
  budget: {enabled: false}
  circuit_breaker: {enabled: false}
endpoints:
  up: {}
";

/// README ("Metrics delivery"): counts are reported under the policy version they were made
/// under, and Stats gives the aggregates per version; every call that has ended is in exactly
/// one outcome. A call in its pause when the operator applies a change runs to its end under
/// the version it read (SPEC §2 rule 1), so all of its counts belong to that version.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_call_in_its_pause_across_a_policy_change_is_counted_under_the_version_it_ran_under() {
    let day = Day::start(STRADDLE_V1, &[("checkout-1", "checkout", false)]).await;
    let (up, m) = (&day.up, &day.members[0]);
    up.set(THROTTLED_LONG);
    let call = {
        let (m, url) = (m.clone(), day.url.clone());
        tokio::spawn(async move { m.call(&url, 1).await })
    };
    eventually(
        "the first attempt answered 429 with Retry-After: 3",
        || async { up.hits().len() == 1 },
    )
    .await;
    // During the call's 3 s pause: a new version, and the upstream now answers 503.
    day.apply(STRADDLE_V2, 2).await;
    up.set(UNAVAILABLE);
    let called = call.await.unwrap();
    assert!(
        up.hits().len() == 2 && up.hits()[1].phase == UNAVAILABLE,
        "the swap did not land in the pause: {:?}",
        up.hits()
    );
    // The call followed v1 (2 attempts), as SPEC §2 rule 1 says.
    assert_eq!(
        (called.cause.as_deref(), called.attempts),
        (Some("attempts_exhausted"), Some(2))
    );
    day.reported("checkout", "the call's give-up reported", |c| {
        c.gave_up_attempts == 1
    })
    .await;
    let s = series(&day.running, "checkout").await.unwrap();
    let mut per_version: Vec<(u64, pb::Counters)> = s
        .versions
        .iter()
        .map(|v| {
            let mut c = v.lifetime.unwrap_or_default();
            c.backoff_ms = 0;
            (v.policy_version, c)
        })
        .filter(|(_, c)| *c != pb::Counters::default())
        .collect();
    per_version.sort_by_key(|v| v.0);
    let want = vec![(
        1,
        pb::Counters {
            calls: 1,
            attempts: 2,
            retries: 1,
            gave_up_attempts: 1,
            retry_after_honored: 1,
            ..Default::default()
        },
    )];
    let problems = if per_version == want {
        Vec::new()
    } else {
        vec![format!(
            "the counts of one v1 call (backoff left out), per version: {per_version:?}, want {want:?}"
        )]
    };
    day.end(problems).await;
}
