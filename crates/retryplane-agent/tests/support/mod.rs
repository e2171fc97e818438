//! A scripted upstream for the agent's tests: each attempt takes the next step of a script.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, dead_code)]

use std::collections::VecDeque;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use retryplane_agent::{Agent, AttemptInfo};
use tokio::time::Instant;

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

/// An agent on the policy file `yaml`, seeded.
pub fn agent(yaml: &str) -> Agent {
    let loaded = retryplane_policy::load(yaml.as_bytes());
    assert!(!loaded.has_errors(), "{:?}", loaded.diagnostics);
    Agent::from_policies_seeded(loaded.policies.unwrap(), 7)
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
pub mod plane;
pub mod proxy;
pub mod script;
