//! The once-only credential refresh on 401 through an endpoint handle
//! (`Endpoint::call_with_auth_refresh`), against a scripted upstream, under paused tokio time.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use retryplane_agent::{Agent, AttemptInfo, CallError, CallMeta, Cause, GiveUpCause};
use support::{agent, policy, response};
use tokio::time::Instant;

type Answer = Result<http::Response<()>, std::io::Error>;

/// An upstream that answers 401 to the token `old` (or to every token, when `always_401`)
/// and 200 otherwise, recording the token and attempt number of every send.
#[derive(Clone, Default)]
struct Upstream {
    token: Arc<Mutex<String>>,
    seen: Arc<Mutex<Vec<(String, u32)>>>,
    refreshes: Arc<AtomicUsize>,
    always_401: bool,
}

impl Upstream {
    fn new(always_401: bool) -> Self {
        let u = Upstream {
            always_401,
            ..Upstream::default()
        };
        *u.token.lock().unwrap() = "old".into();
        u
    }

    fn seen(&self) -> Vec<(String, u32)> {
        self.seen.lock().unwrap().clone()
    }

    fn refreshes(&self) -> usize {
        self.refreshes.load(Ordering::SeqCst)
    }

    /// One logical call through `agent`'s endpoint `ep`; the refresh sets `new-<n>` and
    /// returns `refresh_ok`.
    async fn call(
        &self,
        agent: &Agent,
        refresh_ok: bool,
    ) -> Result<u16, CallError<http::Response<()>, std::io::Error>> {
        let attempt = |info: AttemptInfo| {
            let token = self.token.lock().unwrap().clone();
            self.seen.lock().unwrap().push((token.clone(), info.number));
            let status = if self.always_401 || token == "old" {
                401
            } else {
                200
            };
            async move { Ok::<_, std::io::Error>(response(status, None)) }
        };
        let refresh = || {
            let n = self.refreshes.fetch_add(1, Ordering::SeqCst) + 1;
            let token = self.token.clone();
            async move {
                if refresh_ok {
                    *token.lock().unwrap() = format!("new-{n}");
                }
                refresh_ok
            }
        };
        agent
            .endpoint("ep")
            .call_with_auth_refresh(
                CallMeta::http("GET", "/v1/me"),
                attempt,
                |answer: &Answer| matches!(answer, Ok(r) if r.status() == 401),
                refresh,
            )
            .await
            .map(|r| r.status().as_u16())
    }
}

#[tokio::test(start_paused = true)]
async fn a_401_refreshes_once_and_the_attempt_is_sent_again_with_the_new_credentials() {
    let agent = agent(&policy("max_attempts: 3"));
    let upstream = Upstream::new(false);
    let started = Instant::now();
    assert_eq!(upstream.call(&agent, true).await.unwrap(), 200);
    assert_eq!(upstream.refreshes(), 1);
    assert_eq!(upstream.seen(), [("old".into(), 1), ("new-1".into(), 1)]);
    assert_eq!(
        started.elapsed(),
        Duration::ZERO,
        "no pause before the second send"
    );
    let c = agent.endpoint("ep").pending_counts();
    assert_eq!((c.calls, c.attempts, c.retries), (1, 1, 0));
    assert_eq!(c.success_first_try, 1);

    // The next call starts over: one refresh per call.
    *upstream.token.lock().unwrap() = "old".into();
    assert_eq!(upstream.call(&agent, true).await.unwrap(), 200);
    assert_eq!(upstream.refreshes(), 2);
}

#[tokio::test(start_paused = true)]
async fn a_second_401_is_judged_by_the_policy_and_the_hook_is_not_called_again() {
    let agent = agent(&policy("max_attempts: 3"));
    let upstream = Upstream::new(true);
    let err = upstream.call(&agent, true).await.unwrap_err();
    assert_eq!(err.gave_up(), Some(GiveUpCause::NotRetryable));
    assert_eq!(err.response().map(|r| r.status().as_u16()), Some(401));
    assert_eq!(err.attempts, 1);
    assert_eq!(upstream.refreshes(), 1);
    assert_eq!(upstream.seen(), [("old".into(), 1), ("new-1".into(), 1)]);
    let c = agent.endpoint("ep").pending_counts();
    assert_eq!((c.calls, c.attempts, c.gave_up_not_retryable), (1, 1, 1));
}

#[tokio::test(start_paused = true)]
async fn a_refresh_that_fails_leaves_the_401_and_sends_nothing_more() {
    let agent = agent(&policy("max_attempts: 3"));
    let upstream = Upstream::new(false);
    let err = upstream.call(&agent, false).await.unwrap_err();
    assert_eq!(err.response().map(|r| r.status().as_u16()), Some(401));
    assert_eq!(err.attempts, 1);
    assert_eq!(upstream.refreshes(), 1);
    assert_eq!(upstream.seen(), [("old".into(), 1)]);
}

/// A send again after a refresh is given what is left of the call's deadline: when that is
/// under half the per-try timeout and the send runs out with the deadline, the breaker takes no
/// verdict from it (the engine's `RetryCall::resent_within`), though the first send was given
/// more. Five such calls leave the breaker closed; the same calls with no deadline open it.
#[tokio::test(start_paused = true)]
async fn a_send_again_cut_short_by_the_deadline_gives_the_breaker_no_verdict() {
    let agent = agent(&policy(
        "max_attempts: 1\nper_try_timeout: 2s\ncircuit_breaker: {enabled: true, failure_ratio: 0.5, min_requests: 3, window: 10s, open_for: 30s}",
    ));
    let ep = agent.endpoint("ep");
    // The first send answers 401 after 1.2 s; the one after the refresh hangs.
    let call = |meta: CallMeta<'static>| {
        let sends = Arc::new(AtomicUsize::new(0));
        let counted = sends.clone();
        let attempt = move |_: AttemptInfo| {
            let first = counted.fetch_add(1, Ordering::SeqCst) == 0;
            async move {
                if !first {
                    std::future::pending::<()>().await;
                }
                tokio::time::sleep(Duration::from_millis(1200)).await;
                Ok::<_, std::io::Error>(response(401, None))
            }
        };
        let ep = ep.clone();
        async move {
            let result = ep
                .call_with_auth_refresh(
                    meta,
                    attempt,
                    |answer: &Answer| matches!(answer, Ok(r) if r.status() == 401),
                    || async { true },
                )
                .await;
            (
                result.map(|r| r.status().as_u16()),
                sends.load(Ordering::SeqCst),
            )
        }
    };
    for _ in 0..5 {
        let started = Instant::now();
        let meta = CallMeta::http("GET", "/v1/me").deadline_within(Duration::from_millis(1500));
        let (result, sends) = call(meta).await;
        let err = result.unwrap_err();
        assert_eq!(err.cause, Cause::GaveUp(GiveUpCause::AttemptsExhausted));
        assert_eq!(sends, 2);
        assert_eq!(started.elapsed(), Duration::from_millis(1500));
    }
    let (result, sends) = call(CallMeta::http("GET", "/v1/me")).await;
    assert!(result.is_err());
    assert_eq!(sends, 2, "the breaker let the call through");
    // With the whole per-try timeout for the send again, its timeouts open the breaker.
    for _ in 0..2 {
        call(CallMeta::http("GET", "/v1/me")).await.0.unwrap_err();
    }
    let (result, sends) = call(CallMeta::http("GET", "/v1/me")).await;
    assert_eq!(
        result.unwrap_err().cause,
        Cause::GaveUp(GiveUpCause::CircuitOpen)
    );
    assert_eq!(sends, 0);
}
