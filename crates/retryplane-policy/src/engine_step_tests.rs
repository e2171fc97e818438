//! Tests of how the engine keeps SPEC §2 while doing less work per step: one read of the budget
//! (its cause still comes first), one time conversion per step, state built only when needed.

use std::time::Duration;

use tokio::time::Instant;

use super::*;
use crate::codes::GrpcCode;
use crate::model::{BackoffConfig, BudgetConfig, Jitter};
use crate::rng::SeededRng;

/// Counts the values it hands out.
struct Counting(SeededRng, u32);

impl Rng for Counting {
    fn next_u64(&mut self) -> u64 {
        self.1 += 1;
        self.0.next_u64()
    }
}

fn policy(min_per_second: u32) -> RetryPolicy {
    RetryPolicy {
        backoff: BackoffConfig {
            base: Duration::from_millis(100),
            max: Duration::from_secs(2),
            multiplier: 2.0,
            jitter: Jitter::Full,
        },
        deadline: Duration::from_secs(1),
        per_try_timeout: Duration::from_millis(500),
        budget: Some(BudgetConfig {
            ratio: 0.0,
            min_per_second,
            window: Duration::from_secs(1),
        }),
        circuit_breaker: None,
        ..RetryPolicy::default()
    }
}

/// [`policy`] with a breaker that three failed attempts of three open.
fn with_breaker_of_three() -> RetryPolicy {
    RetryPolicy {
        circuit_breaker: Some(crate::model::BreakerConfig {
            min_requests: 3,
            failure_ratio: 1.0,
            ..Default::default()
        }),
        ..policy(10)
    }
}

const GET: CallInfo = CallInfo {
    idempotent: true,
    has_idempotency_key: false,
    replayable: true,
};

fn http(status: u16, retry_after: Option<Duration>) -> Outcome {
    Outcome::Http {
        status,
        retry_after: retry_after.map(Ok),
    }
}

fn grpc(code: GrpcCode) -> Outcome {
    Outcome::Grpc {
        code,
        pushback: None,
    }
}

/// One attempt at `now` answered by `outcome`.
fn step(call: &mut RetryCall<'_>, outcome: Outcome, now: Instant, rng: &mut Counting) -> Decision {
    call.start_attempt(now).expect("attempt allowed");
    call.on_outcome(outcome, now, rng)
}

#[test]
fn an_exhausted_budget_is_the_cause_even_when_the_pause_would_not_fit_either() {
    let p = policy(0); // no reserve, no ratio: every retry is refused
    let t0 = Instant::now();
    let state = EndpointState::new(&p, t0);
    let mut rng = Counting(SeededRng::with_seed(1), 0);
    let late = t0 + Duration::from_millis(990);
    for outcome in [http(503, None), http(429, Some(Duration::from_secs(60)))] {
        let mut call = RetryCall::new(&p, &state, GET, t0);
        assert_eq!(
            step(&mut call, outcome, late, &mut rng),
            Decision::GiveUp(GiveUpCause::BudgetExhausted)
        );
    }
    assert_eq!(rng.1, 0, "no pause is drawn for a retry the budget refuses");
}

#[test]
fn a_retry_refused_by_the_deadline_or_a_long_hint_does_not_spend_budget() {
    let p = policy(1); // a reserve of one retry
    let t0 = Instant::now();
    let state = EndpointState::new(&p, t0);
    let budget = state.budget().expect("budget on");
    let mut rng = Counting(SeededRng::with_seed(1), 0);
    let mut call = RetryCall::new(&p, &state, GET, t0);
    let long_hint = http(429, Some(Duration::from_secs(31)));
    assert_eq!(
        step(&mut call, long_hint, t0, &mut rng),
        Decision::GiveUp(GiveUpCause::RetryAfterTooLong)
    );
    let mut call = RetryCall::new(&p, &state, GET, t0);
    let hint_past_deadline = http(503, Some(Duration::from_millis(1500)));
    assert_eq!(
        step(&mut call, hint_past_deadline, t0, &mut rng),
        Decision::GiveUp(GiveUpCause::DeadlineExceeded)
    );
    assert_eq!(budget.snapshot(t0).retries, 0);
    let mut call = RetryCall::new(&p, &state, GET, t0);
    assert!(matches!(
        step(&mut call, http(503, None), t0, &mut rng),
        Decision::Retry { .. }
    ));
    assert_eq!(budget.snapshot(t0).retries, 1);
}

#[test]
fn the_deadline_is_exact_for_calls_before_the_state_origin() {
    let mut p = policy(10);
    p.backoff.jitter = Jitter::None;
    let t0 = Instant::now();
    // The state was created an hour "after" the call: the budget counts the call at its origin,
    // the deadline still runs from the call's own start.
    let state = EndpointState::new(&p, t0 + Duration::from_secs(3600));
    let mut rng = Counting(SeededRng::with_seed(1), 0);
    let mut call = RetryCall::new(&p, &state, GET, t0);
    assert_eq!(call.deadline(), t0 + Duration::from_secs(1));
    let at = t0 + Duration::from_millis(850);
    assert_eq!(
        call.start_attempt(at).map(|a| a.timeout),
        Ok(Duration::from_millis(150))
    );
    // 150 ms are left: a 100 ms pause fits, then 50 ms are left for a 200 ms one.
    assert_eq!(
        call.on_outcome(http(503, None), at, &mut rng),
        Decision::Retry {
            pause: Duration::from_millis(100),
            hinted: false
        }
    );
    assert_eq!(
        step(
            &mut call,
            http(503, None),
            at + Duration::from_millis(100),
            &mut rng
        ),
        Decision::GiveUp(GiveUpCause::DeadlineExceeded)
    );
    let snap = state.budget().expect("budget on").snapshot(t0);
    assert_eq!((snap.requests, snap.retries), (1, 1));
    // The call is over; another that starts at the same instant has no time left at its
    // deadline.
    assert_eq!(
        call.start_attempt(t0 + Duration::from_secs(1)),
        Err(GiveUpCause::AttemptsExhausted)
    );
    let mut other = RetryCall::new(&p, &state, GET, t0);
    assert_eq!(
        other.start_attempt(t0 + Duration::from_secs(1)),
        Err(GiveUpCause::DeadlineExceeded)
    );
}

#[test]
fn a_deadline_too_long_for_an_instant_neither_panics_nor_ends() {
    let mut p = policy(10);
    p.deadline = Duration::MAX;
    p.per_try_timeout = Duration::MAX;
    let t0 = Instant::now();
    let state = EndpointState::new(&p, t0);
    let mut call = RetryCall::new(&p, &state, GET, t0);
    let later = t0 + Duration::from_secs(86_400 * 365);
    assert_eq!(
        call.start_attempt(later).map(|a| a.timeout),
        Ok(Duration::MAX - Duration::from_secs(86_400 * 365))
    );
    assert!(call.deadline() > later);
}

#[test]
fn a_success_is_never_an_upstream_failure() {
    let mut p = policy(10);
    p.retry_on.http_status = std::sync::Arc::from([200, 503]);
    assert!(!http(200, None).is_upstream_failure(&p));
    assert!(http(503, None).is_upstream_failure(&p));
    assert!(Outcome::Transport(ErrorClass::Connect).is_upstream_failure(&p));
}

#[test]
fn a_server_error_is_an_upstream_failure_whatever_retry_on_lists() {
    let mut p = policy(10);
    p.retry_on.http_status = std::sync::Arc::from([]);
    p.retry_on.grpc_status = std::sync::Arc::from([]);
    for status in [500, 501, 502, 503, 504, 599] {
        assert!(http(status, None).is_upstream_failure(&p), "{status}");
    }
    // Listed or not, a client error says nothing about health unless `retry_on` lists it.
    for status in [400, 404, 429, 499] {
        assert!(!http(status, None).is_upstream_failure(&p), "{status}");
    }
    for code in [
        GrpcCode::Unavailable,
        GrpcCode::Internal,
        GrpcCode::DataLoss,
        GrpcCode::DeadlineExceeded,
    ] {
        assert!(grpc(code).is_upstream_failure(&p), "{code:?}");
    }
    for code in [
        GrpcCode::Unknown,
        GrpcCode::NotFound,
        GrpcCode::InvalidArgument,
        GrpcCode::ResourceExhausted,
        GrpcCode::Unimplemented,
        GrpcCode::PermissionDenied,
    ] {
        assert!(!grpc(code).is_upstream_failure(&p), "{code:?}");
    }
    p.retry_on.http_status = std::sync::Arc::from([408, 429]);
    assert!(http(408, None).is_upstream_failure(&p));
    // A throttling answer never is, listed or not: the upstream is up and pacing its callers.
    p.retry_on.grpc_status = std::sync::Arc::from([GrpcCode::ResourceExhausted]);
    assert!(!http(429, None).is_upstream_failure(&p));
    assert!(!grpc(GrpcCode::ResourceExhausted).is_upstream_failure(&p));
}

#[test]
fn the_breaker_counts_transport_failures_server_errors_and_listed_statuses_only() {
    let p = with_breaker_of_three();
    let t0 = Instant::now();
    let state = EndpointState::new(&p, t0);
    let mut rng = Counting(SeededRng::with_seed(1), 0);
    let breaker = state.breaker().expect("breaker on");
    for outcome in [http(404, None), http(503, None), http(503, None)] {
        let mut call = RetryCall::new(&p, &state, GET, t0);
        let _ = step(&mut call, outcome, t0, &mut rng);
    }
    // 1 of 3 attempts was healthy (a 404 says nothing about health): below a ratio of 1.
    assert_eq!(breaker.state(t0), crate::breaker::BreakerState::Closed);
    let mut call = RetryCall::new(&p, &state, GET, t0);
    let _ = step(
        &mut call,
        Outcome::Transport(ErrorClass::Reset),
        t0,
        &mut rng,
    );
    let mut call = RetryCall::new(&p, &state, GET, t0);
    let _ = step(&mut call, http(503, None), t0, &mut rng);
    // Still 1 healthy of 5: the check compares failures with every attempt in the window.
    assert_eq!(breaker.state(t0), crate::breaker::BreakerState::Closed);
    let fresh = EndpointState::new(&p, t0);
    for outcome in [
        Outcome::Transport(ErrorClass::Timeout),
        http(503, None),
        http(502, None),
    ] {
        let mut call = RetryCall::new(&p, &fresh, GET, t0);
        let _ = step(&mut call, outcome, t0, &mut rng);
    }
    let open = fresh.breaker().expect("breaker on").state(t0);
    assert_eq!(open, crate::breaker::BreakerState::Open);
    // A 500 that `retry_on` does not list (it is not retried) counts all the same.
    let mut unlisted = p.clone();
    unlisted.retry_on.http_status = std::sync::Arc::from([503]);
    let fresh = EndpointState::new(&unlisted, t0);
    for _ in 0..3 {
        let mut call = RetryCall::new(&unlisted, &fresh, GET, t0);
        let _ = step(&mut call, http(500, None), t0, &mut rng);
    }
    let open = fresh.breaker().expect("breaker on").state(t0);
    assert_eq!(open, crate::breaker::BreakerState::Open);
    // Throttling answers, listed by default, give no verdict: a breaker fed nothing else
    // stays closed, where the same count of 408s (listed too) opens it.
    for (throttled, opens) in [
        (http(429, Some(Duration::from_secs(1))), false),
        (grpc(GrpcCode::ResourceExhausted), false),
        (http(408, None), true),
    ] {
        let fresh = EndpointState::new(&p, t0);
        for _ in 0..3 {
            let mut call = RetryCall::new(&p, &fresh, GET, t0);
            let _ = step(&mut call, throttled.clone(), t0, &mut rng);
        }
        let state = fresh.breaker().expect("breaker on").state(t0);
        assert_eq!(
            state == crate::breaker::BreakerState::Open,
            opens,
            "{throttled:?}"
        );
    }
}

/// A timeout of an attempt the deadline cut short (the caller's own, or what was left of the
/// policy's) says the call's time was up, not that the upstream fails: the breaker takes no
/// verdict from it when the attempt had less than half its `per_try_timeout`. A timeout of an
/// attempt given half or more, or one reported while time is left, counts.
#[test]
fn a_timeout_the_deadline_cut_short_does_not_count_in_the_breaker() {
    let mut p = with_breaker_of_three();
    let t0 = Instant::now();
    let mut rng = Counting(SeededRng::with_seed(1), 0);
    let ms = Duration::from_millis;
    let deadline_exceeded = grpc(GrpcCode::DeadlineExceeded);
    // (the caller's deadline, when the outcome comes, the outcome, whether the breaker opens)
    let cases = [
        // A caller's 100 ms deadline, under the 500 ms per-try timeout.
        (
            Some(ms(100)),
            ms(100),
            Outcome::Transport(ErrorClass::Timeout),
            false,
        ),
        (Some(ms(100)), ms(101), deadline_exceeded.clone(), false),
        // The same timeout reported with time left: an upstream's own timeout.
        (
            Some(ms(100)),
            ms(99),
            Outcome::Transport(ErrorClass::Timeout),
            true,
        ),
        (Some(ms(100)), ms(50), deadline_exceeded, true),
        // A reset at the deadline is no timeout: it counts.
        (
            Some(ms(100)),
            ms(100),
            Outcome::Transport(ErrorClass::Reset),
            true,
        ),
        // The whole per-try timeout, with no deadline of the caller's.
        (None, ms(500), Outcome::Transport(ErrorClass::Timeout), true),
        // A caller's deadline equal to the per-try timeout cuts nothing short, and one of
        // half of it or more gives the attempt enough time to judge the upstream.
        (
            Some(ms(500)),
            ms(500),
            Outcome::Transport(ErrorClass::Timeout),
            true,
        ),
        (
            Some(ms(250)),
            ms(250),
            Outcome::Transport(ErrorClass::Timeout),
            true,
        ),
        (
            Some(ms(249)),
            ms(249),
            Outcome::Transport(ErrorClass::Timeout),
            false,
        ),
    ];
    for (within, at, outcome, opens) in cases {
        let state = EndpointState::new(&p, t0);
        for _ in 0..3 {
            let mut call = RetryCall::new(&p, &state, GET, t0);
            if let Some(within) = within {
                call.cap_deadline(within);
            }
            call.start_attempt(t0).expect("attempt allowed");
            let _ = call.on_outcome(outcome.clone(), t0 + at, &mut rng);
        }
        let open = state.breaker().expect("breaker on").state(t0 + at);
        assert_eq!(
            open == crate::breaker::BreakerState::Open,
            opens,
            "{within:?} {at:?} {outcome:?}"
        );
    }
    // The last attempt of a call gets what is left of the policy's own deadline (1 s): a
    // timeout there is the call's time running out too. Four attempts in the window open the
    // breaker: three 503s alone do not.
    if let Some(b) = p.circuit_breaker.as_mut() {
        b.min_requests = 4;
    }
    let state = EndpointState::new(&p, t0);
    for _ in 0..3 {
        let mut call = RetryCall::new(&p, &state, GET, t0);
        let first = call.start_attempt(t0).expect("attempt allowed");
        assert_eq!(first.timeout, ms(500));
        let Decision::Retry { pause, .. } =
            call.on_outcome(http(503, None), t0 + ms(760), &mut rng)
        else {
            panic!("a 503 with time left is retried");
        };
        let second = t0 + ms(760) + pause;
        let attempt = call.start_attempt(second).expect("attempt allowed");
        assert!(attempt.timeout < ms(250), "{attempt:?}");
        let _ = call.on_outcome(
            Outcome::Transport(ErrorClass::Timeout),
            second + attempt.timeout,
            &mut rng,
        );
    }
    // The three 503s are all the breaker saw.
    let breaker = state.breaker().expect("breaker on");
    assert_eq!(
        breaker.state(t0 + ms(1_000)),
        crate::breaker::BreakerState::Closed
    );
}

/// A resend after a credential refresh given less than half the per-try timeout (what was
/// left of the deadline) is judged as an attempt given that: its timeout at the deadline is no
/// verdict. Without the resend's time told, the attempt had its whole per-try timeout.
#[test]
fn a_resend_cut_short_by_the_deadline_gives_no_verdict() {
    let p = with_breaker_of_three();
    let t0 = Instant::now();
    let mut rng = Counting(SeededRng::with_seed(1), 0);
    for (resent, opens) in [(true, false), (false, true)] {
        let state = EndpointState::new(&p, t0);
        for _ in 0..3 {
            let mut call = RetryCall::new(&p, &state, GET, t0);
            call.cap_deadline(Duration::from_millis(700));
            let attempt = call.start_attempt(t0).expect("attempt allowed");
            assert_eq!(attempt.timeout, Duration::from_millis(500));
            if resent {
                call.resent_within(Duration::from_millis(200));
            }
            let _ = call.on_outcome(
                Outcome::Transport(ErrorClass::Timeout),
                t0 + Duration::from_millis(700),
                &mut rng,
            );
        }
        let open = state.breaker().expect("breaker on").state(t0);
        assert_eq!(
            open == crate::breaker::BreakerState::Open,
            opens,
            "{resent}"
        );
    }
}

#[test]
fn one_outcome_per_attempt_and_none_after_the_call_is_over() {
    let p = policy(10); // a reserve of ten retries
    let t0 = Instant::now();
    let state = EndpointState::new(&p, t0);
    let budget = state.budget().expect("budget on");
    let mut rng = Counting(SeededRng::with_seed(1), 0);
    let refused = Decision::GiveUp(GiveUpCause::AttemptsExhausted);

    // After a return, a late failure reopens nothing.
    let mut call = RetryCall::new(&p, &state, GET, t0);
    assert_eq!(
        step(&mut call, http(200, None), t0, &mut rng),
        Decision::Return
    );
    assert_eq!(call.on_outcome(http(503, None), t0, &mut rng), refused);
    assert_eq!(call.start_attempt(t0), Err(GiveUpCause::AttemptsExhausted));
    assert_eq!(budget.snapshot(t0).retries, 0);

    // A failure reported twice for one attempt is one retry: budget and backoff move once.
    let mut call = RetryCall::new(&p, &state, GET, t0);
    assert!(matches!(
        step(&mut call, http(503, None), t0, &mut rng),
        Decision::Retry { .. }
    ));
    let draws = rng.1;
    assert_eq!(call.on_outcome(http(503, None), t0, &mut rng), refused);
    assert_eq!(budget.snapshot(t0).retries, 1);
    assert_eq!(rng.1, draws, "no second pause drawn");
    // The retry it earned still runs, once.
    assert!(call.start_attempt(t0).is_ok());
    assert_eq!(call.start_attempt(t0), Err(GiveUpCause::AttemptsExhausted));

    // No outcome before any attempt started.
    let mut call = RetryCall::new(&p, &state, GET, t0);
    assert_eq!(call.on_outcome(http(503, None), t0, &mut rng), refused);

    // After a give-up, nothing more either.
    let mut call = RetryCall::new(&p, &state, GET, t0);
    assert_eq!(
        step(&mut call, http(404, None), t0, &mut rng),
        Decision::GiveUp(GiveUpCause::NotRetryable)
    );
    assert_eq!(call.on_outcome(http(503, None), t0, &mut rng), refused);
    assert_eq!(call.start_attempt(t0), Err(GiveUpCause::AttemptsExhausted));
    assert_eq!(budget.snapshot(t0).retries, 1);
}
