//! SPEC §2, rule by rule, under paused tokio time against a scripted upstream.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::io::ErrorKind;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use retryplane_agent::{CallMeta, Cause, GiveUpCause, Last};
use retryplane_policy::retry_after::format_http_date;
use support::{Step, Upstream, agent, policy, seeded};

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
    let res = up.call(&agent, get()).await.unwrap();
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
        let err = up.call(&agent, get()).await.unwrap_err();
        assert_eq!(err.cause, gave_up(GiveUpCause::NotRetryable), "{status}");
        assert_eq!(err.attempts, 1);
        assert_eq!(err.response().unwrap().status(), status);
    }
}

#[tokio::test(start_paused = true)]
async fn the_last_failure_is_returned_when_attempts_run_out() {
    let agent = agent(&policy("max_attempts: 3"));
    let up = Upstream::new([Step::Status(503), Step::Status(503), Step::Status(504)]);
    let err = up.call(&agent, get()).await.unwrap_err();
    assert_eq!(err.cause, gave_up(GiveUpCause::AttemptsExhausted));
    assert_eq!(err.attempts, 3);
    assert_eq!(err.response().unwrap().status(), 504);
}

#[tokio::test(start_paused = true)]
async fn retry_after_seconds_lengthen_the_pause() {
    let agent = agent(&policy(""));
    let up = Upstream::new([Step::RetryAfter(503, "3".into())]);
    up.call(&agent, get()).await.unwrap();
    assert_eq!(up.starts_ms(), [0, 3000]);
    assert_eq!(agent.endpoint("ep").pending_counts().retry_after_honored, 1);
}

#[tokio::test(start_paused = true)]
async fn retry_after_shorter_than_the_backoff_does_not_shorten_it() {
    let agent = agent(&policy(""));
    let up = Upstream::new([Step::RetryAfter(503, "0".into())]);
    up.call(&agent, get()).await.unwrap();
    assert_eq!(up.starts_ms(), [0, 100]);
}

#[tokio::test(start_paused = true)]
async fn retry_after_as_an_http_date_is_honored() {
    let agent = agent(&policy(""));
    // The date has whole seconds; the agent reads the wall clock somewhen between `before` and
    // `after`, so the wait is the time from then to the date.
    let before = SystemTime::now();
    let at = before + Duration::from_secs(5);
    let at = UNIX_EPOCH + Duration::from_secs(at.duration_since(UNIX_EPOCH).unwrap().as_secs());
    let up = Upstream::new([Step::RetryAfter(429, format_http_date(at))]);
    up.call(&agent, get()).await.unwrap();
    let after = SystemTime::now();
    let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap();
    let longest = ms(at.duration_since(before).unwrap()) + 1;
    let shortest = ms(at.duration_since(after).unwrap_or_default()).saturating_sub(1);
    let starts = up.starts_ms();
    assert!(
        shortest > 3000,
        "{shortest} ms: the machine stalled for seconds"
    );
    assert!(
        (shortest..=longest).contains(&starts[1]),
        "{starts:?} not in [{shortest}, {longest}]"
    );
}

#[tokio::test(start_paused = true)]
async fn a_malformed_or_negative_retry_after_is_ignored() {
    let agent = agent(&policy(""));
    for bad in ["soon", "-5", "1.5"] {
        let up = Upstream::new([Step::RetryAfter(503, bad.into())]);
        up.call(&agent, get()).await.unwrap();
        assert_eq!(up.starts_ms(), [0, 100], "{bad}");
    }
}

#[tokio::test(start_paused = true)]
async fn a_retry_after_longer_than_backoff_max_is_waited_in_full() {
    let agent = agent(&policy(
        "backoff: {base: 100ms, max: 1s}\nretry_after: {honor: true, max: 30s}",
    ));
    let up = Upstream::new([Step::RetryAfter(503, "10".into())]);
    up.call(&agent, get()).await.unwrap();
    assert_eq!(up.starts_ms(), [0, 10_000]);
}

#[tokio::test(start_paused = true)]
async fn a_retry_after_that_ends_past_the_deadline_gives_up_at_once() {
    let agent = agent(&policy(
        "max_attempts: 3\ndeadline: 5s\nper_try_timeout: 1s\nretry_after: {honor: true, max: 30s}",
    ));
    let up = Upstream::new([Step::RetryAfter(503, "10".into())]);
    let start = tokio::time::Instant::now();
    let err = up.call(&agent, get()).await.unwrap_err();
    assert_eq!(err.cause, gave_up(GiveUpCause::DeadlineExceeded));
    assert_eq!(err.response().unwrap().status(), 503);
    assert_eq!(up.attempts(), 1);
    assert_eq!(start.elapsed(), Duration::ZERO, "no sleep");
}

#[tokio::test(start_paused = true)]
async fn a_retry_after_above_the_max_gives_up_instead_of_waiting() {
    let agent = agent(&policy(
        "max_attempts: 3\nretry_after: {honor: true, max: 30s}",
    ));
    let up = Upstream::new([Step::RetryAfter(503, "31".into())]);
    let err = up.call(&agent, get()).await.unwrap_err();
    assert_eq!(err.cause, gave_up(GiveUpCause::RetryAfterTooLong));
    assert_eq!(up.attempts(), 1);
}

#[tokio::test(start_paused = true)]
async fn retry_after_is_ignored_when_not_honored() {
    let agent = agent(&policy("max_attempts: 3\nretry_after: {honor: false}"));
    let up = Upstream::new([Step::RetryAfter(503, "60".into())]);
    up.call(&agent, get()).await.unwrap();
    assert_eq!(up.starts_ms(), [0, 100]);
}

#[tokio::test(start_paused = true)]
async fn post_without_the_key_is_not_retried() {
    let agent = agent(&policy(""));
    let up = Upstream::new([Step::Status(503)]);
    let err = up
        .call(&agent, CallMeta::http("POST", "/v1/charges"))
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
    up.call(&agent, meta).await.unwrap();
    assert_eq!(up.attempts(), 3);
}

#[tokio::test(start_paused = true)]
async fn a_reset_on_post_without_the_key_has_an_unknown_outcome_and_is_not_retried() {
    let agent = agent(&policy(""));
    let up = Upstream::new([Step::Io(ErrorKind::ConnectionReset)]);
    let err = up
        .call(&agent, CallMeta::http("POST", "/"))
        .await
        .unwrap_err();
    assert_eq!(err.cause, gave_up(GiveUpCause::NotRetryable));
    assert_eq!(err.error().unwrap().kind(), ErrorKind::ConnectionReset);
}

#[tokio::test(start_paused = true)]
async fn a_refused_connection_is_retried_even_for_post() {
    let agent = agent(&policy(""));
    let up = Upstream::new([Step::Io(ErrorKind::ConnectionRefused)]);
    up.call(&agent, CallMeta::http("POST", "/")).await.unwrap();
    assert_eq!(up.attempts(), 2);
}

#[tokio::test(start_paused = true)]
async fn an_io_error_that_is_no_transport_failure_is_not_retried() {
    let agent = agent(&policy(""));
    let up = Upstream::new([Step::Io(ErrorKind::InvalidData)]);
    let err = up.call(&agent, get()).await.unwrap_err();
    assert_eq!(err.cause, gave_up(GiveUpCause::NotRetryable));
    assert_eq!(err.error().unwrap().kind(), ErrorKind::InvalidData);
}

#[tokio::test(start_paused = true)]
async fn the_per_try_timeout_drops_a_slow_attempt_and_retries() {
    let agent = agent(&policy(
        "max_attempts: 3\nper_try_timeout: 1s\ndeadline: 10s",
    ));
    let up = Upstream::new([Step::Hang]);
    up.call(&agent, get()).await.unwrap();
    assert_eq!(up.starts_ms(), [0, 1100]);
    assert_eq!(up.infos()[0].timeout, Duration::from_secs(1));
}

#[tokio::test(start_paused = true)]
async fn a_timed_out_post_without_the_key_is_not_retried() {
    let agent = agent(&policy("per_try_timeout: 1s"));
    let up = Upstream::new([Step::Hang]);
    let err = up
        .call(&agent, CallMeta::http("POST", "/"))
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
    let err = up.call(&agent, get()).await.unwrap_err();
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
    let err = up.call(&agent, get()).await.unwrap_err();
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

#[tokio::test(start_paused = true)]
async fn a_failure_that_opens_the_breaker_ends_the_call_without_a_pause() {
    let agent = agent(&policy(
        "max_attempts: 3\nbackoff: {base: 3s, max: 5s, jitter: none}\ncircuit_breaker: {enabled: true, failure_ratio: 0.1, min_requests: 1, open_for: 30s}",
    ));
    let ep = agent.endpoint("ep");
    let up = Upstream::new([Step::Status(503), Step::Status(200)]);
    let started = tokio::time::Instant::now();
    let err = ep.call(get(), up.attempt()).await.unwrap_err();
    // The first 503 opens the breaker for 30 s: the retry 3 s later could not be sent, so the
    // call ends at once with the 503, instead of sleeping 3 s to be refused.
    assert_eq!(err.cause, gave_up(GiveUpCause::CircuitOpen));
    assert_eq!(started.elapsed(), Duration::ZERO);
    assert_eq!((err.attempts, up.attempts()), (1, 1));
    assert_eq!(err.response().map(|r| r.status().as_u16()), Some(503));
    let counts = ep.pending_counts();
    assert_eq!(
        (counts.circuit_open, counts.retries, counts.backoff_ms),
        (1, 0, 0)
    );
}

/// The pauses before retries 1, 2, … of one call that fails every attempt but the last, as the
/// agent reports them; each is checked against the time the upstream saw pass between the
/// attempts (paused time wakes a sleep on the next whole millisecond).
async fn jittered_pauses(jitter: &str, seed: u64) -> Vec<Duration> {
    let agent = seeded(
        &policy(&format!(
            "max_attempts: 6\ndeadline: 60s\nbackoff: {{base: 100ms, max: 1s, multiplier: 2.0, jitter: {jitter}}}"
        )),
        seed,
    );
    let up = Upstream::new(vec![Step::Status(503); 5]);
    up.call(&agent, get()).await.unwrap();
    let infos = up.infos();
    assert_eq!(infos.len(), 6, "{jitter}, seed {seed}");
    assert_eq!(infos[0].pause_before, None);
    let pauses: Vec<Duration> = infos[1..].iter().map(|i| i.pause_before.unwrap()).collect();
    let starts = up.starts_ms();
    for (i, pause) in pauses.iter().enumerate() {
        let slept = starts[i + 1] - starts[i];
        let asked = pause.as_millis() as u64;
        assert!(
            slept + 1 >= asked && slept <= asked + 2,
            "{jitter}, seed {seed}: retry {} paused {pause:?} but the upstream saw {slept} ms",
            i + 1
        );
    }
    pauses
}

/// The ceilings of retries 1 to 5 under base 100ms, ×2, max 1s.
const CEILINGS_MS: [u64; 5] = [100, 200, 400, 800, 1000];
const SEEDS: std::ops::Range<u64> = 0..200;

#[tokio::test(start_paused = true)]
async fn jitter_none_pauses_exactly_at_the_ceiling_whatever_the_seed() {
    for seed in [0, 1, 7, 12_345, u64::MAX] {
        let pauses = jittered_pauses("none", seed).await;
        let ceilings: Vec<Duration> = CEILINGS_MS.map(Duration::from_millis).into();
        assert_eq!(pauses, ceilings, "seed {seed}");
    }
}

/// For each retry, the lowest and the highest of its pauses over [`SEEDS`] as a share of its
/// ceiling; every pause is checked to lie between `low` times the ceiling and the ceiling.
async fn pause_shares(jitter: &str, low: f64) -> Vec<(f64, f64)> {
    let mut spans = vec![(f64::MAX, 0.0f64); CEILINGS_MS.len()];
    for seed in SEEDS {
        for (n, pause) in jittered_pauses(jitter, seed).await.into_iter().enumerate() {
            let ceiling = Duration::from_millis(CEILINGS_MS[n]);
            assert!(
                pause >= ceiling.mul_f64(low) && pause <= ceiling,
                "{jitter}, seed {seed}, retry {}: {pause:?}",
                n + 1
            );
            let share = pause.as_secs_f64() / ceiling.as_secs_f64();
            let (lo, hi) = spans[n];
            spans[n] = (lo.min(share), hi.max(share));
        }
    }
    spans
}

#[tokio::test(start_paused = true)]
async fn jitter_full_pauses_anywhere_from_zero_to_the_ceiling() {
    // The whole range is used: the low tenth and the high tenth both occur (a pause stuck at
    // the ceiling, or at its upper half, fails here).
    for (n, (lo, hi)) in pause_shares("full", 0.0).await.into_iter().enumerate() {
        assert!(lo < 0.1 && hi > 0.9, "retry {}: [{lo}, {hi}]", n + 1);
    }
}

#[tokio::test(start_paused = true)]
async fn jitter_equal_pauses_from_half_the_ceiling_to_the_ceiling() {
    for (n, (lo, hi)) in pause_shares("equal", 0.5).await.into_iter().enumerate() {
        assert!(lo < 0.55 && hi > 0.95, "retry {}: [{lo}, {hi}]", n + 1);
    }
}

#[tokio::test(start_paused = true)]
async fn jitter_decorrelated_pauses_from_base_to_three_times_the_previous_pause_capped() {
    let (base, max) = (Duration::from_millis(100), Duration::from_secs(1));
    // How far into its range [base, high] each pause fell, and how often the cap cut it.
    let (mut lo, mut hi, mut capped) = (f64::MAX, 0.0f64, 0);
    for seed in SEEDS {
        // Retry 1's previous pause is `base` (SPEC §2 step 7, AWS's decorrelated jitter).
        let mut previous = base;
        for (n, pause) in jittered_pauses("decorrelated", seed)
            .await
            .into_iter()
            .enumerate()
        {
            let high = max.min(previous * 3);
            assert!(
                pause >= base && pause <= high,
                "seed {seed}, retry {}: {pause:?} outside [{base:?}, {high:?}] after {previous:?}",
                n + 1
            );
            if previous * 3 <= max {
                let at = (pause - base).as_secs_f64() / (high - base).as_secs_f64();
                (lo, hi) = (lo.min(at), hi.max(at));
            }
            capped += usize::from(pause == max);
            previous = pause;
        }
    }
    assert!(lo < 0.05 && hi > 0.95, "[{lo}, {hi}]");
    assert!(capped > 0, "the cap at backoff.max is reached");
}

#[tokio::test(start_paused = true)]
async fn the_pause_stops_growing_at_backoff_max() {
    let agent = agent(&policy(
        "max_attempts: 5\nbackoff: {base: 100ms, multiplier: 2.0, max: 300ms}",
    ));
    let up = Upstream::new(vec![Step::Status(503); 4]);
    up.call(&agent, get()).await.unwrap();
    let pauses: Vec<_> = up.infos().iter().map(|i| i.pause_before).collect();
    let ms = |n| Some(Duration::from_millis(n));
    assert_eq!(pauses, [None, ms(100), ms(200), ms(300), ms(300)]);
    assert_eq!(up.starts_ms(), [0, 100, 300, 600, 900]);
}

#[tokio::test(start_paused = true)]
async fn a_timed_out_post_with_the_key_is_retried() {
    let agent = agent(&policy("per_try_timeout: 1s"));
    let mut headers = http::HeaderMap::new();
    headers.insert("idempotency-key", "k-2".parse().unwrap());
    let up = Upstream::new([Step::Hang]);
    let meta = CallMeta::http("POST", "/v1/charges").with_headers(&headers);
    let res = up.call(&agent, meta).await.unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(
        up.starts_ms(),
        [0, 1100],
        "a 1 s timeout, then the 100 ms pause"
    );
}

#[tokio::test(start_paused = true)]
async fn the_budget_allows_ratio_times_the_calls_in_the_window() {
    // Reserve floor(1/s × 2s) = 2; ratio 0.25. Pauses of 1ms keep every call in the window's
    // first slot (a tenth of it), so every count is exact.
    let agent = agent(&policy(
        "max_attempts: 2\nbackoff: {base: 1ms, max: 1ms}\nbudget: {enabled: true, ratio: 0.25, min_per_second: 1, window: 2s}",
    ));
    let ep = agent.endpoint("ep");
    for _ in 0..20 {
        ep.call(get(), Upstream::new([]).attempt()).await.unwrap();
    }
    // The k-th failing call is call 20 + k; its retry is retry k if allowed, and a retry is
    // allowed iff retries + 1 <= max(2, floor(0.25 × calls)):
    // k = 1..=6: k <= floor((20 + k) / 4) = 5, 5, 5, 6, 6, 6 → allowed;
    // k = 7: 7 > floor(27 / 4) = 6 → refused (and not counted);
    // k = 8: 7 <= floor(28 / 4) = 7 → allowed; k = 9: 8 > floor(29 / 4) = 7 → refused.
    let mut outcomes = Vec::new();
    for _ in 0..9 {
        let up = Upstream::new([Step::Status(503)]);
        let cause = ep.call(get(), up.attempt()).await.err().map(|e| e.cause);
        assert_eq!(up.attempts(), if cause.is_none() { 2 } else { 1 });
        outcomes.push(cause);
    }
    let refused = Some(gave_up(GiveUpCause::BudgetExhausted));
    let mut expected = vec![None; 9];
    expected[6] = refused;
    expected[8] = refused;
    assert_eq!(outcomes, expected);
    let c = ep.pending_counts();
    assert_eq!((c.calls, c.retries, c.gave_up_budget), (29, 7, 2));
}
