//! A scripted upstream for the agent's tests: each attempt takes the next step of a script.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, dead_code)]

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::BodyExt as _;
use retryplane_agent::layer::ReplayBody;
use retryplane_agent::{Agent, AttemptInfo, CallError, CallMeta};
use tokio::time::Instant;
use tower::service_fn;

/// What one attempt does.
#[derive(Clone, Debug)]
pub enum Step {
    /// Answers with this status.
    Status(u16),
    /// Answers with this status and `Retry-After` value.
    RetryAfter(u16, String),
    /// Fails with this I/O error kind.
    Io(io::ErrorKind),
    /// Never answers.
    Hang,
}

/// A scripted upstream that records when each attempt started and what it was told.
#[derive(Debug, Default)]
pub struct Upstream {
    steps: Mutex<VecDeque<Step>>,
    seen: Mutex<Vec<(Duration, AttemptInfo)>>,
    origin: Mutex<Option<Instant>>,
}

pub type Reply = Result<http::Response<()>, io::Error>;
pub type Fut = Pin<Box<dyn Future<Output = Reply> + Send>>;

impl Upstream {
    /// An upstream that plays `steps`, then answers 200.
    pub fn new(steps: impl IntoIterator<Item = Step>) -> Arc<Self> {
        let u = Upstream::default();
        *u.steps.lock().unwrap() = steps.into_iter().collect();
        *u.origin.lock().unwrap() = Some(Instant::now());
        Arc::new(u)
    }

    /// The attempt closure for `Endpoint::call`.
    pub fn attempt(self: &Arc<Self>) -> impl FnMut(AttemptInfo) -> Fut + use<> {
        let me = self.clone();
        move |info| {
            let origin = me.origin.lock().unwrap().unwrap();
            me.seen
                .lock()
                .unwrap()
                .push((Instant::now().duration_since(origin), info));
            let step = me.steps.lock().unwrap().pop_front();
            Box::pin(async move {
                match step {
                    None | Some(Step::Status(200)) => Ok(response(200, None)),
                    Some(Step::Status(s)) => Ok(response(s, None)),
                    Some(Step::RetryAfter(s, v)) => Ok(response(s, Some(&v))),
                    Some(Step::Io(kind)) => Err(io::Error::from(kind)),
                    Some(Step::Hang) => std::future::pending().await,
                }
            })
        }
    }

    /// One call of `meta` through `agent`'s endpoint `ep`, each attempt taking the next step.
    pub async fn call(
        self: &Arc<Self>,
        agent: &Agent,
        meta: CallMeta<'_>,
    ) -> Result<http::Response<()>, CallError<http::Response<()>, io::Error>> {
        agent.endpoint("ep").call(meta, self.attempt()).await
    }

    /// Attempts made.
    pub fn attempts(&self) -> usize {
        self.seen.lock().unwrap().len()
    }

    /// Yields (a bounded number of times; no time passes) until `n` attempts have started.
    #[allow(dead_code, reason = "not every test file waits for attempts")]
    pub async fn until_attempts(&self, n: usize) {
        for _ in 0..10_000 {
            if self.attempts() >= n {
                break;
            }
            tokio::task::yield_now().await;
        }
        assert_eq!(self.attempts(), n, "{n} attempt(s) started");
    }

    /// When each attempt started, from the upstream's creation, in milliseconds.
    pub fn starts_ms(&self) -> Vec<u64> {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .map(|(t, _)| t.as_millis() as u64)
            .collect()
    }

    /// What each attempt was told.
    pub fn infos(&self) -> Vec<AttemptInfo> {
        self.seen.lock().unwrap().iter().map(|(_, i)| *i).collect()
    }
}

pub fn response(status: u16, retry_after: Option<&str>) -> http::Response<()> {
    let mut b = http::Response::builder().status(status);
    if let Some(v) = retry_after {
        b = b.header(http::header::RETRY_AFTER, v);
    }
    b.body(()).unwrap()
}

/// One request a [`status_upstream`] saw.
#[derive(Clone, Debug)]
pub struct Sent {
    /// Its method.
    pub method: String,
    /// Its `Authorization` value (empty without one).
    pub auth: String,
    /// Its whole body.
    pub body: Bytes,
    /// When it came, from the upstream's creation.
    pub at: Duration,
    /// Its `grpc-timeout` header, if any.
    pub grpc_timeout: Option<String>,
}

/// What a [`status_upstream`] saw, in order.
pub type Seen = Arc<Mutex<Vec<Sent>>>;

/// A client for the tower layer to wrap: it answers the scripted `statuses` (then 200), reads
/// every body whole and records each request.
pub fn status_upstream<B>(
    statuses: &[u16],
) -> (
    impl tower::Service<
        Request<ReplayBody<B>>,
        Response = http::Response<http_body_util::Empty<Bytes>>,
        Error = Infallible,
        Future = impl Send,
    > + Clone
    + Send
    + Sync
    + 'static,
    Seen,
)
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: std::fmt::Debug,
{
    let script = Arc::new(Mutex::new(
        statuses.iter().copied().collect::<VecDeque<_>>(),
    ));
    let seen: Seen = Arc::default();
    let log = seen.clone();
    let origin = Instant::now();
    let svc = service_fn(move |req: Request<ReplayBody<B>>| {
        let script = script.clone();
        let log = log.clone();
        async move {
            let method = req.method().to_string();
            let auth = req
                .headers()
                .get(http::header::AUTHORIZATION)
                .map(|v| v.to_str().unwrap().to_owned())
                .unwrap_or_default();
            let grpc_timeout = req
                .headers()
                .get("grpc-timeout")
                .map(|v| v.to_str().unwrap().to_owned());
            let body = req.into_body().collect().await.unwrap().to_bytes();
            let at = origin.elapsed();
            log.lock().unwrap().push(Sent {
                method,
                auth,
                body,
                at,
                grpc_timeout,
            });
            let status = script.lock().unwrap().pop_front().unwrap_or(200);
            Ok::<_, Infallible>(response(status, None).map(|()| http_body_util::Empty::new()))
        }
    });
    (svc, seen)
}

/// An agent on the policy file `yaml`, seeded.
pub fn agent(yaml: &str) -> Agent {
    seeded(yaml, 7)
}

/// An agent on the policy file `yaml` whose RNG is seeded with `seed`.
pub fn seeded(yaml: &str, seed: u64) -> Agent {
    let loaded = retryplane_policy::load(yaml.as_bytes());
    assert!(!loaded.has_errors(), "{:?}", loaded.diagnostics);
    Agent::from_policies_seeded(loaded.policies.unwrap(), seed)
}

/// A policy with one endpoint `ep`, deterministic pauses (base 100ms, ×2, no jitter), budget
/// and breaker off unless `extra` turns them on, and `extra` lines under the endpoint.
pub fn policy(extra: &str) -> String {
    let mut s = String::from(
        "version: 1\ndefaults:\n  backoff: {base: 100ms, max: 2s, multiplier: 2.0, jitter: none}\n  budget: {enabled: false}\n  circuit_breaker: {enabled: false}\nendpoints:\n  ep:\n",
    );
    if extra.is_empty() {
        s.push_str("    max_attempts: 3\n");
    }
    for line in extra.lines() {
        s.push_str("    ");
        s.push_str(line);
        s.push('\n');
    }
    s
}
/// A listener on 127.0.0.1 whose accept queue is full, with the connections that fill it:
/// one more connection attempt hangs in SYN-SENT (a connector's `connect_timeout` fires).
pub async fn full_backlog() -> (tokio::net::TcpListener, Vec<tokio::net::TcpStream>) {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let l = socket.listen(1).unwrap();
    let addr = l.local_addr().unwrap();
    let mut held = Vec::new();
    for _ in 0..16 {
        let connect = tokio::net::TcpStream::connect(addr);
        match tokio::time::timeout(Duration::from_millis(200), connect).await {
            Ok(Ok(s)) => held.push(s),
            Ok(Err(e)) => panic!("{e}"),
            Err(_) => return (l, held),
        }
    }
    panic!("the accept queue never filled");
}

pub mod plane;
pub mod proxy;
pub mod raw;
pub mod script;

/// The agent's log lines, captured for a test (see [`capture_logs`]).
#[derive(Clone, Default)]
pub struct LogSink(Arc<Mutex<Vec<u8>>>);

impl io::Write for LogSink {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl LogSink {
    /// Every line so far.
    pub fn text(&self) -> String {
        String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
    }

    /// Forgets the lines so far.
    pub fn clear(&self) {
        self.0.lock().unwrap().clear();
    }
}

/// Captures this thread's log lines that pass `filter` (an env-filter directive such as
/// `retryplane_agent=info`), without colours, until the guard is dropped.
pub fn capture_logs(filter: &str) -> (LogSink, tracing::subscriber::DefaultGuard) {
    let sink = LogSink::default();
    let writer = sink.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    (sink, tracing::subscriber::set_default(subscriber))
}
