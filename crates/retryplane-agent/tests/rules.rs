//! SPEC §2, rule by rule, under paused tokio time against a scripted upstream.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::io::ErrorKind;
use std::time::{Duration, SystemTime};

use retryplane_agent::{CallMeta, Cause, GiveUpCause, Last};
use retryplane_policy::retry_after::format_http_date;
use support::{Step, Upstream, agent, policy};

fn get() -> CallMeta<'static> {
    CallMeta::http("GET", "/v1/items?secret=1")
}

fn gave_up(cause: GiveUpCause) -> Cause {
    Cause::GaveUp(cause)
}

#[tokio::test(start_paused = true)]
async fn retryable_statuses_are_retried_on_the_backoff_schedule() {
    let agent = agent(&policy("max_attempts: 4"));
    let up = Upstream::new([Step::Status(503), Step::Status(502), Step::Status(429)]);
    let res = agent
        .endpoint("ep")
        .call(get(), up.attempt())
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(up.starts_ms(), [0, 100, 300, 700]);
    let numbers: Vec<u32> = up.infos().iter().map(|i| i.number).collect();
    assert_eq!(numbers, [1, 2, 3, 4]);
}

#[tokio::test(start_paused = true)]
async fn statuses_not_in_retry_on_are_returned_at_once_with_the_response() {
    let agent = agent(&policy(""));
    for status in [400, 401, 404, 409, 501] {
        let up = Upstream::new([Step::Status(status)]);
        let err = agent
            .endpoint("ep")
            .call(get(), up.attempt())
            .await
            .unwrap_err();
        assert_eq!(err.cause, gave_up(GiveUpCause::NotRetryable), "{status}");
        assert_eq!(err.attempts, 1);
        assert_eq!(err.response().unwrap().status(), status);
    }
}

#[tokio::test(start_paused = true)]
async fn the_last_failure_is_returned_when_attempts_run_out() {
    let agent = agent(&policy("max_attempts: 3"));
    let up = Upstream::new([Step::Status(503), Step::Status(503), Step::Status(504)]);
    let err = agent
        .endpoint("ep")
        .call(get(), up.attempt())
        .await
        .unwrap_err();
    assert_eq!(err.cause, gave_up(GiveUpCause::AttemptsExhausted));
    assert_eq!(err.attempts, 3);
    assert_eq!(err.response().unwrap().status(), 504);
}

#[tokio::test(start_paused = true)]
async fn retry_after_seconds_lengthen_the_pause() {
    let agent = agent(&policy(""));
    let up = Upstream::new([Step::RetryAfter(503, "3".into())]);
    agent
        .endpoint("ep")
        .call(get(), up.attempt())
        .await
        .unwrap();
    assert_eq!(up.starts_ms(), [0, 3000]);
    assert_eq!(agent.endpoint("ep").pending_counts().retry_after_honored, 1);
}

#[tokio::test(start_paused = true)]
async fn retry_after_shorter_than_the_backoff_does_not_shorten_it() {
    let agent = agent(&policy(""));
    let up = Upstream::new([Step::RetryAfter(503, "0".into())]);
    agent
        .endpoint("ep")
        .call(get(), up.attempt())
        .await
        .unwrap();
    assert_eq!(up.starts_ms(), [0, 100]);
}

#[tokio::test(start_paused = true)]
async fn retry_after_as_an_http_date_is_honored() {
    let agent = agent(&policy(""));
    let date = format_http_date(SystemTime::now() + Duration::from_secs(5));
    let up = Upstream::new([Step::RetryAfter(429, date)]);
    agent
        .endpoint("ep")
        .call(get(), up.attempt())
        .await
        .unwrap();
    let starts = up.starts_ms();
    // The date has whole seconds: the wait is in (4 s, 5 s].
    assert!(starts[1] > 4000 && starts[1] <= 5000, "{starts:?}");
}

#[tokio::test(start_paused = true)]
async fn a_malformed_or_negative_retry_after_is_ignored() {
    let agent = agent(&policy(""));
    for bad in ["soon", "-5", "1.5"] {
        let up = Upstream::new([Step::RetryAfter(503, bad.into())]);
        agent
            .endpoint("ep")
            .call(get(), up.attempt())
            .await
            .unwrap();
        assert_eq!(up.starts_ms(), [0, 100], "{bad}");
    }
}

#[tokio::test(start_paused = true)]
async fn a_retry_after_above_the_max_gives_up_instead_of_waiting() {
    let agent = agent(&policy(
        "max_attempts: 3\nretry_after: {honor: true, max: 30s}",
    ));
    let up = Upstream::new([Step::RetryAfter(503, "31".into())]);
    let err = agent
        .endpoint("ep")
        .call(get(), up.attempt())
        .await
        .unwrap_err();
    assert_eq!(err.cause, gave_up(GiveUpCause::RetryAfterTooLong));
    assert_eq!(up.attempts(), 1);
}

#[tokio::test(start_paused = true)]
async fn retry_after_is_ignored_when_not_honored() {
    let agent = agent(&policy("max_attempts: 3\nretry_after: {honor: false}"));
    let up = Upstream::new([Step::RetryAfter(503, "60".into())]);
    agent
        .endpoint("ep")
        .call(get(), up.attempt())
        .await
        .unwrap();
    assert_eq!(up.starts_ms(), [0, 100]);
}

#[tokio::test(start_paused = true)]
async fn post_without_the_key_is_not_retried() {
    let agent = agent(&policy(""));
    let up = Upstream::new([Step::Status(503)]);
    let err = agent
        .endpoint("ep")
        .call(CallMeta::http("POST", "/v1/charges"), up.attempt())
        .await
        .unwrap_err();
    assert_eq!(err.cause, gave_up(GiveUpCause::NotRetryable));
    assert_eq!(up.attempts(), 1);
}

#[tokio::test(start_paused = true)]
async fn post_with_the_key_header_is_retried() {
    let agent = agent(&policy(""));
    let mut headers = http::HeaderMap::new();
    headers.insert("idempotency-key", "k-1".parse().unwrap());
    let up = Upstream::new([Step::Status(503), Step::Io(ErrorKind::ConnectionReset)]);
    let meta = CallMeta::http("POST", "/v1/charges").with_headers(&headers);
    agent.endpoint("ep").call(meta, up.attempt()).await.unwrap();
    assert_eq!(up.attempts(), 3);
}

#[tokio::test(start_paused = true)]
async fn a_reset_on_post_without_the_key_has_an_unknown_outcome_and_is_not_retried() {
    let agent = agent(&policy(""));
    let up = Upstream::new([Step::Io(ErrorKind::ConnectionReset)]);
    let err = agent
        .endpoint("ep")
        .call(CallMeta::http("POST", "/"), up.attempt())
        .await
        .unwrap_err();
    assert_eq!(err.cause, gave_up(GiveUpCause::NotRetryable));
    assert_eq!(err.error().unwrap().kind(), ErrorKind::ConnectionReset);
}

#[tokio::test(start_paused = true)]
async fn a_refused_connection_is_retried_even_for_post() {
    let agent = agent(&policy(""));
    let up = Upstream::new([Step::Io(ErrorKind::ConnectionRefused)]);
    agent
        .endpoint("ep")
        .call(CallMeta::http("POST", "/"), up.attempt())
        .await
        .unwrap();
    assert_eq!(up.attempts(), 2);
}

#[tokio::test(start_paused = true)]
async fn an_io_error_that_is_no_transport_failure_is_not_retried() {
    let agent = agent(&policy(""));
    let up = Upstream::new([Step::Io(ErrorKind::InvalidData)]);
    let err = agent
        .endpoint("ep")
        .call(get(), up.attempt())
        .await
        .unwrap_err();
    assert_eq!(err.cause, gave_up(GiveUpCause::NotRetryable));
    assert_eq!(err.error().unwrap().kind(), ErrorKind::InvalidData);
}

#[tokio::test(start_paused = true)]
async fn the_per_try_timeout_drops_a_slow_attempt_and_retries() {
    let agent = agent(&policy(
        "max_attempts: 3\nper_try_timeout: 1s\ndeadline: 10s",
    ));
    let up = Upstream::new([Step::Hang]);
    agent
        .endpoint("ep")
        .call(get(), up.attempt())
        .await
        .unwrap();
    assert_eq!(up.starts_ms(), [0, 1100]);
    assert_eq!(up.infos()[0].timeout, Duration::from_secs(1));
}

#[tokio::test(start_paused = true)]
async fn a_timed_out_post_without_the_key_is_not_retried() {
    let agent = agent(&policy("per_try_timeout: 1s"));
    let up = Upstream::new([Step::Hang]);
    let err = agent
        .endpoint("ep")
        .call(CallMeta::http("POST", "/"), up.attempt())
        .await
        .unwrap_err();
    assert_eq!(err.cause, gave_up(GiveUpCause::NotRetryable));
    assert!(matches!(err.last, Some(Last::TimedOut)));
    assert_eq!(up.attempts(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_pause_that_does_not_fit_the_deadline_gives_up_without_sleeping() {
    let agent = agent(&policy(
        "max_attempts: 5\ndeadline: 1s\nper_try_timeout: 1s\nbackoff: {base: 400ms}",
    ));
    let up = Upstream::new([Step::Status(503), Step::Status(503)]);
    let start = tokio::time::Instant::now();
    let err = agent
        .endpoint("ep")
        .call(get(), up.attempt())
        .await
        .unwrap_err();
    assert_eq!(err.cause, gave_up(GiveUpCause::DeadlineExceeded));
    assert_eq!(err.response().unwrap().status(), 503);
    assert_eq!(up.starts_ms(), [0, 400]);
    assert_eq!(
        start.elapsed(),
        Duration::from_millis(400),
        "no sleep past the deadline"
    );
}

#[tokio::test(start_paused = true)]
async fn an_attempt_never_runs_past_the_deadline() {
    let agent = agent(&policy(
        "max_attempts: 5\ndeadline: 1s\nper_try_timeout: 800ms\nbackoff: {base: 300ms}",
    ));
    let up = Upstream::new([Step::Status(503), Step::Hang]);
    let start = tokio::time::Instant::now();
    let err = agent
        .endpoint("ep")
        .call(get(), up.attempt())
        .await
        .unwrap_err();
    assert_eq!(up.infos()[1].timeout, Duration::from_millis(700));
    assert_eq!(err.cause, gave_up(GiveUpCause::DeadlineExceeded));
    assert_eq!(start.elapsed(), Duration::from_secs(1));
}

#[tokio::test(start_paused = true)]
async fn an_exhausted_budget_stops_retries_but_not_first_attempts() {
    let agent = agent(&policy(
        "max_attempts: 3\nbudget: {enabled: true, ratio: 0.0, min_per_second: 1, window: 1s}",
    ));
    let ep = agent.endpoint("ep");
    let up = Upstream::new([Step::Status(503)]);
    ep.call(get(), up.attempt()).await.unwrap();
    let up = Upstream::new([Step::Status(503)]);
    let err = ep.call(get(), up.attempt()).await.unwrap_err();
    assert_eq!(err.cause, gave_up(GiveUpCause::BudgetExhausted));
    assert_eq!(up.attempts(), 1, "the first attempt still ran");
    assert_eq!(ep.pending_counts().gave_up_budget, 1);
}

#[tokio::test(start_paused = true)]
async fn an_open_breaker_fails_fast_without_calling_the_upstream() {
    let agent = agent(&policy(
        "max_attempts: 1\ncircuit_breaker: {enabled: true, failure_ratio: 0.5, min_requests: 2, open_for: 30s}",
    ));
    let ep = agent.endpoint("ep");
    for _ in 0..2 {
        let up = Upstream::new([Step::Status(503)]);
        ep.call(get(), up.attempt()).await.unwrap_err();
    }
    let up = Upstream::new([]);
    let err = ep.call(get(), up.attempt()).await.unwrap_err();
    assert_eq!(err.cause, gave_up(GiveUpCause::CircuitOpen));
    assert_eq!((err.attempts, up.attempts()), (0, 0));
    assert!(err.last.is_none());
    assert_eq!(ep.pending_counts().circuit_open, 1);
}
