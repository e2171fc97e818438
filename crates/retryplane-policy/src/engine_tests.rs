//! Tests of the per-call state machine, one SPEC §2 rule each.

use std::time::Duration;

use proptest::prelude::*;
use tokio::time::Instant;

use super::*;
use crate::breaker::BreakerState;
use crate::codes::GrpcCode;
use crate::model::{BackoffConfig, BudgetConfig, Jitter};
use crate::retry_after::RetryAfterError;
use crate::rng::SeededRng;

fn policy() -> RetryPolicy {
    RetryPolicy {
        backoff: BackoffConfig {
            base: Duration::from_millis(100),
            max: Duration::from_secs(2),
            multiplier: 2.0,
            jitter: Jitter::None,
        },
        ..RetryPolicy::default()
    }
}

/// [`policy`] with a breaker that opens once `min_requests` calls have failed half of them.
fn breaking_after(min_requests: u32) -> RetryPolicy {
    let mut p = policy();
    if let Some(b) = p.circuit_breaker.as_mut() {
        b.min_requests = min_requests;
        b.failure_ratio = 0.5;
    }
    p
}

fn http(status: u16) -> Outcome {
    Outcome::Http {
        status,
        retry_after: None,
    }
}

fn get() -> CallInfo {
    CallInfo::new(true, false)
}

fn post(key: bool) -> CallInfo {
    CallInfo::new(false, key)
}

#[test]
fn call_info_is_replayable_unless_told_otherwise() {
    let info = CallInfo::new(false, true);
    assert_eq!(
        (info.idempotent, info.has_idempotency_key, info.replayable),
        (false, true, true)
    );
    assert!(!info.with_replayable(false).replayable);
    assert_eq!(info.with_replayable(false).with_replayable(true), info);
    assert_eq!(CallInfo::http(&RetryPolicy::default(), "GET", false), get());
}

/// Runs one attempt at `now` with `outcome` and returns the decision.
fn step(call: &mut RetryCall<'_>, outcome: Outcome, now: Instant) -> Decision {
    let mut rng = SeededRng::with_seed(1);
    call.start_attempt(now).expect("attempt allowed");
    call.on_outcome(outcome, now, &mut rng)
}

/// The decision on `outcome` as the first attempt of a new call with `info` under `p`, on a
/// new endpoint state.
fn first(p: &RetryPolicy, info: CallInfo, outcome: Outcome) -> Decision {
    let t0 = Instant::now();
    let state = EndpointState::new(p, t0);
    let mut call = RetryCall::new(p, &state, info, t0);
    step(&mut call, outcome, t0)
}

#[test]
fn success_returns_at_once() {
    let p = policy();
    let t0 = Instant::now();
    let state = EndpointState::new(&p, t0);
    let mut call = RetryCall::new(&p, &state, get(), t0);
    assert_eq!(step(&mut call, http(200), t0), Decision::Return);
    assert_eq!(call.attempts(), 1);
    assert_eq!(call.last_failure(), None);
}

#[test]
fn retryable_status_is_retried_after_the_backoff_ceiling() {
    let p = policy();
    let t0 = Instant::now();
    let state = EndpointState::new(&p, t0);
    let mut call = RetryCall::new(&p, &state, get(), t0);
    assert_eq!(
        step(&mut call, http(503), t0),
        Decision::Retry {
            pause: Duration::from_millis(100),
            hinted: false
        }
    );
    let t1 = t0 + Duration::from_millis(100);
    assert_eq!(
        step(&mut call, http(503), t1),
        Decision::Retry {
            pause: Duration::from_millis(200),
            hinted: false
        }
    );
}

#[test]
fn unlisted_status_is_not_retried() {
    let p = policy();
    let t0 = Instant::now();
    let state = EndpointState::new(&p, t0);
    let mut call = RetryCall::new(&p, &state, get(), t0);
    assert_eq!(
        step(&mut call, http(404), t0),
        Decision::GiveUp(GiveUpCause::NotRetryable)
    );
    assert_eq!(call.last_failure(), Some(&http(404)));
}

#[test]
fn post_without_key_is_not_retried() {
    assert_eq!(
        first(&policy(), post(false), http(503)),
        Decision::GiveUp(GiveUpCause::NotRetryable)
    );
}

#[test]
fn post_with_key_is_retried() {
    assert!(matches!(
        first(&policy(), post(true), http(503)),
        Decision::Retry { .. }
    ));
}

#[test]
fn post_connect_failure_is_retried_without_key_since_nothing_was_sent() {
    assert!(matches!(
        first(
            &policy(),
            post(false),
            Outcome::Transport(ErrorClass::Connect)
        ),
        Decision::Retry { .. }
    ));
}

#[test]
fn a_request_that_cannot_be_sent_again_gets_one_attempt_whatever_the_failure() {
    // No budget or breaker: the many failures below must not run the one dry or open the
    // other.
    let p = RetryPolicy {
        budget: None,
        circuit_breaker: None,
        ..policy()
    };
    let t0 = Instant::now();
    let state = EndpointState::new(&p, t0);
    let once = |info: CallInfo| CallInfo {
        replayable: false,
        ..info
    };
    let failures = [
        Outcome::Transport(ErrorClass::Connect),
        Outcome::Transport(ErrorClass::Reset),
        Outcome::Transport(ErrorClass::Timeout),
        http(503),
    ];
    for info in [get(), post(true), post(false)] {
        for outcome in failures.clone() {
            let mut call = RetryCall::new(&p, &state, once(info), t0);
            assert_eq!(
                step(&mut call, outcome.clone(), t0),
                Decision::GiveUp(GiveUpCause::NotRetryable),
                "{info:?} {outcome:?}"
            );
            assert_eq!(
                call.start_attempt(t0),
                Err(GiveUpCause::AttemptsExhausted),
                "nothing more starts"
            );
            // The same request kept for replay is retried.
            let mut kept = RetryCall::new(&p, &state, info, t0);
            let retried = matches!(step(&mut kept, outcome.clone(), t0), Decision::Retry { .. });
            let may = info.idempotent
                || info.has_idempotency_key
                || outcome == Outcome::Transport(ErrorClass::Connect);
            assert_eq!(retried, may, "{info:?} {outcome:?}");
        }
    }
}

#[test]
fn post_timeout_or_reset_without_key_is_an_unknown_outcome_and_not_retried() {
    let p = policy();
    let t0 = Instant::now();
    let state = EndpointState::new(&p, t0);
    for class in [ErrorClass::Timeout, ErrorClass::Reset] {
        let mut call = RetryCall::new(&p, &state, post(false), t0);
        assert_eq!(
            step(&mut call, Outcome::Transport(class), t0),
            Decision::GiveUp(GiveUpCause::NotRetryable)
        );
        let mut keyed = RetryCall::new(&p, &state, post(true), t0);
        assert!(matches!(
            step(&mut keyed, Outcome::Transport(class), t0),
            Decision::Retry { .. }
        ));
    }
}

#[test]
fn the_last_allowed_attempt_gives_up_with_attempts_exhausted() {
    let p = RetryPolicy {
        max_attempts: 3,
        ..policy()
    };
    let t0 = Instant::now();
    let state = EndpointState::new(&p, t0);
    let mut call = RetryCall::new(&p, &state, get(), t0);
    assert!(matches!(
        step(&mut call, http(503), t0),
        Decision::Retry { .. }
    ));
    assert!(matches!(
        step(&mut call, http(503), t0),
        Decision::Retry { .. }
    ));
    assert_eq!(
        step(&mut call, http(502), t0),
        Decision::GiveUp(GiveUpCause::AttemptsExhausted)
    );
    // The call keeps the count itself: a caller that asks again starts nothing.
    for _ in 0..3 {
        assert_eq!(call.start_attempt(t0), Err(GiveUpCause::AttemptsExhausted));
    }
    assert_eq!(call.attempts(), 3);
    assert_eq!(call.last_failure(), Some(&http(502)));
}

#[test]
fn max_attempts_of_one_never_retries() {
    let p = RetryPolicy {
        max_attempts: 1,
        ..policy()
    };
    assert_eq!(
        first(&p, get(), http(503)),
        Decision::GiveUp(GiveUpCause::AttemptsExhausted)
    );
}

#[test]
fn budget_refuses_retries_past_the_reserve_and_first_attempts_never_consume_it() {
    let p = RetryPolicy {
        budget: Some(BudgetConfig {
            ratio: 0.0,
            min_per_second: 1,
            window: Duration::from_secs(2),
        }),
        ..policy()
    };
    let t0 = Instant::now();
    let state = EndpointState::new(&p, t0);
    // Reserve: 1/s × 2 s = 2 retries in the window, whatever the number of calls.
    let mut decisions = Vec::new();
    // Kept: a call dropped in its pause would hand its retry back.
    let mut pausing = Vec::new();
    for _ in 0..4 {
        let mut call = RetryCall::new(&p, &state, get(), t0);
        decisions.push(step(&mut call, http(503), t0));
        pausing.push(call);
    }
    let retried = decisions
        .iter()
        .filter(|d| matches!(d, Decision::Retry { .. }))
        .count();
    assert_eq!(retried, 2);
    assert_eq!(decisions[3], Decision::GiveUp(GiveUpCause::BudgetExhausted));
    // Successful first attempts keep working: they never need budget.
    let mut call = RetryCall::new(&p, &state, get(), t0);
    assert_eq!(step(&mut call, http(200), t0), Decision::Return);
}

#[test]
fn retry_after_lengthens_the_pause() {
    let outcome = Outcome::Http {
        status: 429,
        retry_after: Some(Ok(Duration::from_secs(3))),
    };
    assert_eq!(
        first(&policy(), get(), outcome),
        Decision::Retry {
            pause: Duration::from_secs(3),
            hinted: true
        }
    );
}

#[test]
fn retry_after_shorter_than_the_backoff_keeps_the_backoff() {
    // Honored all the same (the pause is not shorter than the hint): whether a hint lengthens a
    // jittered pause is the draw's doing, and the count of honored hints must not depend on it.
    for hint in [Duration::ZERO, Duration::from_millis(100)] {
        let outcome = Outcome::Http {
            status: 503,
            retry_after: Some(Ok(hint)),
        };
        assert_eq!(
            first(&policy(), get(), outcome),
            Decision::Retry {
                pause: Duration::from_millis(100),
                hinted: true
            },
            "{hint:?}"
        );
    }
}

#[test]
fn retry_after_above_the_max_gives_up_instead_of_retrying_early() {
    let outcome = Outcome::Http {
        status: 429,
        retry_after: Some(Ok(Duration::from_secs(31))),
    };
    assert_eq!(
        first(&policy(), get(), outcome),
        Decision::GiveUp(GiveUpCause::RetryAfterTooLong)
    );
}

#[test]
fn malformed_retry_after_is_ignored() {
    let outcome = Outcome::Http {
        status: 503,
        retry_after: Some(Err(RetryAfterError::Malformed)),
    };
    assert_eq!(
        first(&policy(), get(), outcome),
        Decision::Retry {
            pause: Duration::from_millis(100),
            hinted: false
        }
    );
}

#[test]
fn hints_are_ignored_when_not_honored() {
    let mut p = policy();
    p.retry_after.honor = false;
    let outcome = Outcome::Http {
        status: 429,
        retry_after: Some(Ok(Duration::from_secs(60))),
    };
    assert_eq!(
        first(&p, get(), outcome),
        Decision::Retry {
            pause: Duration::from_millis(100),
            hinted: false
        }
    );
}

#[test]
fn grpc_pushback_replaces_the_computed_pause() {
    let outcome = Outcome::Grpc {
        code: GrpcCode::Unavailable,
        pushback: Some(Pushback::After(Duration::from_millis(10))),
    };
    assert_eq!(
        first(&policy(), get(), outcome),
        Decision::Retry {
            pause: Duration::from_millis(10),
            hinted: true
        }
    );
}

#[test]
fn grpc_pushback_that_is_negative_or_garbage_means_do_not_retry() {
    let outcome = Outcome::Grpc {
        code: GrpcCode::Unavailable,
        pushback: Some(Pushback::DoNotRetry),
    };
    assert_eq!(
        first(&policy(), get(), outcome),
        Decision::GiveUp(GiveUpCause::NotRetryable)
    );
}

/// [`policy`] with a 1 s deadline and a 500 ms per-try timeout.
fn one_second_deadline() -> RetryPolicy {
    RetryPolicy {
        deadline: Duration::from_millis(1000),
        per_try_timeout: Duration::from_millis(500),
        ..policy()
    }
}

#[test]
fn a_pause_that_does_not_fit_the_deadline_gives_up_without_sleeping() {
    let p = one_second_deadline();
    let t0 = Instant::now();
    let state = EndpointState::new(&p, t0);
    let mut call = RetryCall::new(&p, &state, get(), t0);
    // 950 ms in, a 100 ms pause would end past the deadline.
    assert_eq!(
        step(&mut call, http(503), t0 + Duration::from_millis(950)),
        Decision::GiveUp(GiveUpCause::DeadlineExceeded)
    );
}

#[test]
fn a_callers_shorter_deadline_caps_the_call_and_a_longer_one_changes_nothing() {
    let p = one_second_deadline();
    let t0 = Instant::now();
    let state = EndpointState::new(&p, t0);
    let mut call = RetryCall::new(&p, &state, get(), t0);
    call.cap_deadline(Duration::from_secs(5));
    assert_eq!(call.deadline(), t0 + Duration::from_millis(1000));
    call.cap_deadline(Duration::from_millis(300));
    call.cap_deadline(Duration::from_millis(400));
    assert_eq!(call.deadline(), t0 + Duration::from_millis(300));
    // The first attempt gets what is left of the caller's 300 ms, not the per-try 500 ms.
    assert_eq!(
        call.start_attempt(t0).map(|a| a.timeout),
        Ok(Duration::from_millis(300))
    );
    // Answered 250 ms in: a 100 ms pause would end past the caller's deadline (not the
    // policy's).
    let mut rng = SeededRng::with_seed(1);
    assert_eq!(
        call.on_outcome(http(503), t0 + Duration::from_millis(250), &mut rng),
        Decision::GiveUp(GiveUpCause::DeadlineExceeded)
    );
}

#[test]
fn the_attempt_timeout_is_capped_by_what_is_left_of_the_deadline() {
    let p = one_second_deadline();
    let t0 = Instant::now();
    let state = EndpointState::new(&p, t0);
    let mut call = RetryCall::new(&p, &state, get(), t0);
    assert_eq!(
        call.start_attempt(t0).map(|a| a.timeout),
        Ok(Duration::from_millis(500))
    );
    let mut rng = SeededRng::with_seed(1);
    let _ = call.on_outcome(http(503), t0, &mut rng);
    let late = t0 + Duration::from_millis(800);
    assert_eq!(
        call.start_attempt(late),
        Ok(Attempt {
            number: 2,
            timeout: Duration::from_millis(200)
        })
    );
    // At the deadline nothing starts.
    let mut other = RetryCall::new(&p, &state, get(), t0);
    assert_eq!(
        other.start_attempt(t0 + Duration::from_secs(1)),
        Err(GiveUpCause::DeadlineExceeded)
    );
}

#[test]
fn an_open_breaker_fails_fast_without_an_attempt() {
    let mut p = breaking_after(2);
    p.budget = None;
    let t0 = Instant::now();
    let state = EndpointState::new(&p, t0);
    for _ in 0..2 {
        let mut call = RetryCall::new(&p, &state, get(), t0);
        let _ = step(&mut call, http(404), t0); // not a health failure
    }
    let mut call = RetryCall::new(&p, &state, get(), t0);
    let _ = step(&mut call, http(503), t0);
    let _ = step(&mut call, http(503), t0);
    let mut next = RetryCall::new(&p, &state, get(), t0);
    assert_eq!(next.start_attempt(t0), Err(GiveUpCause::CircuitOpen));
    assert_eq!(next.attempts(), 0);
}

#[test]
fn a_failure_that_opens_the_breaker_gives_up_at_once_and_spends_no_budget() {
    let p = breaking_after(1);
    let t0 = Instant::now();
    let state = EndpointState::new(&p, t0);
    let mut call = RetryCall::new(&p, &state, get(), t0);
    // The attempt's failure opens the breaker for 30 s: the retry it would plan, 100 ms later,
    // could not start, so the call ends now, with the failure kept.
    assert_eq!(
        step(&mut call, http(503), t0),
        Decision::GiveUp(GiveUpCause::CircuitOpen)
    );
    assert_eq!(call.last_failure(), Some(&http(503)));
    assert_eq!(call.start_attempt(t0), Err(GiveUpCause::AttemptsExhausted));
    let budget = state.budget().map(|b| b.snapshot(t0));
    assert_eq!(budget.map(|b| (b.requests, b.retries)), Some((1, 0)));
}

/// The retries `state`'s budget counts at `now`.
fn budget_retries(state: &EndpointState, now: Instant) -> Option<u64> {
    state.budget().map(|b| b.snapshot(now).retries)
}

#[test]
fn a_retry_released_before_it_starts_is_handed_back_to_the_budget() {
    let p = policy();
    let t0 = Instant::now();
    let state = EndpointState::new(&p, t0);
    let mut call = RetryCall::new(&p, &state, get(), t0);
    assert!(matches!(
        step(&mut call, http(503), t0),
        Decision::Retry { .. }
    ));
    assert_eq!(budget_retries(&state, t0), Some(1), "counted when decided");
    // The call is cancelled (or its future dropped) during the pause: the retry never goes.
    call.release();
    assert_eq!(budget_retries(&state, t0), Some(0));
    call.release();
    assert_eq!(budget_retries(&state, t0), Some(0), "handed back once");
}

#[test]
fn a_call_dropped_during_its_pause_hands_its_retry_and_its_probe_back() {
    let p = policy();
    let t0 = Instant::now();
    let state = EndpointState::new(&p, t0);
    let mut call = RetryCall::new(&p, &state, get(), t0);
    assert!(matches!(
        step(&mut call, http(503), t0),
        Decision::Retry { .. }
    ));
    assert_eq!(budget_retries(&state, t0), Some(1), "counted when decided");
    // Dropped, not released: what a caller that owns the call and forgets it does.
    drop(call);
    assert_eq!(budget_retries(&state, t0), Some(0));

    // And an attempt dropped before its outcome gives its half-open probe back.
    let mut p = breaking_after(1);
    if let Some(b) = p.circuit_breaker.as_mut() {
        b.half_open_probes = 1;
    }
    let open_for = p.circuit_breaker.as_ref().map(|b| b.open_for).unwrap();
    let state = EndpointState::new(&p, t0);
    let mut call = RetryCall::new(&p, &state, get(), t0);
    let _ = step(&mut call, http(503), t0);
    let half = t0 + open_for;
    let mut probing = RetryCall::new(&p, &state, get(), half);
    assert!(probing.start_attempt(half).is_ok());
    drop(probing);
    let mut next = RetryCall::new(&p, &state, get(), half);
    assert!(
        next.start_attempt(half).is_ok(),
        "the probe was handed back"
    );
}

#[test]
fn a_retry_that_started_stays_counted_when_its_call_ends() {
    let p = policy();
    let t0 = Instant::now();
    let state = EndpointState::new(&p, t0);
    let mut call = RetryCall::new(&p, &state, get(), t0);
    let Decision::Retry { pause, .. } = step(&mut call, http(503), t0) else {
        panic!("a retry");
    };
    let at = t0 + pause;
    call.start_attempt(at).expect("the retry starts");
    call.release();
    assert_eq!(budget_retries(&state, at), Some(1));
}

#[test]
fn a_retry_the_breaker_refuses_after_its_pause_is_handed_back_to_the_budget() {
    let p = breaking_after(2);
    let t0 = Instant::now();
    let state = EndpointState::new(&p, t0);
    let mut call = RetryCall::new(&p, &state, get(), t0);
    let Decision::Retry { pause, .. } = step(&mut call, http(503), t0) else {
        panic!("one failure of one does not reach min_requests");
    };
    // Another call's failure opens the breaker during the pause.
    let mut other = RetryCall::new(&p, &state, get(), t0);
    assert_eq!(
        step(&mut other, http(503), t0),
        Decision::GiveUp(GiveUpCause::CircuitOpen)
    );
    let at = t0 + pause;
    assert_eq!(call.start_attempt(at), Err(GiveUpCause::CircuitOpen));
    assert_eq!(budget_retries(&state, at), Some(0));
}

#[test]
fn a_retry_planned_past_the_open_period_still_goes_ahead() {
    let mut p = breaking_after(1);
    if let Some(b) = p.circuit_breaker.as_mut() {
        b.open_for = Duration::from_millis(50);
    }
    let t0 = Instant::now();
    let state = EndpointState::new(&p, t0);
    let mut call = RetryCall::new(&p, &state, get(), t0);
    // Open until 50 ms; the pause of 100 ms ends in the half-open period, where a probe may go.
    let pause = Duration::from_millis(100);
    assert_eq!(
        step(&mut call, http(503), t0),
        Decision::Retry {
            pause,
            hinted: false
        }
    );
    let probe = call
        .start_attempt(t0 + pause)
        .expect("the probe is let through");
    assert_eq!(probe.number, 2);
}

#[test]
fn a_call_the_open_breaker_stops_is_no_request_for_the_budget() {
    let p = breaking_after(2);
    let t0 = Instant::now();
    let state = EndpointState::new(&p, t0);
    let requests = || state.budget().map(|b| b.snapshot(t0).requests);
    // Creating a call counts nothing; its first attempt does.
    let mut call = RetryCall::new(&p, &state, get(), t0);
    assert_eq!(requests(), Some(0));
    let _ = step(&mut call, http(503), t0);
    assert_eq!(requests(), Some(1));
    let mut call = RetryCall::new(&p, &state, get(), t0);
    let _ = step(&mut call, http(503), t0);
    assert_eq!(requests(), Some(2));
    // Two failed requests of two: the breaker is open, and the calls it stops send nothing.
    for _ in 0..5 {
        let mut stopped = RetryCall::new(&p, &state, get(), t0);
        assert_eq!(stopped.start_attempt(t0), Err(GiveUpCause::CircuitOpen));
    }
    assert_eq!(requests(), Some(2));
}

fn grpc(pushback: Option<Pushback>) -> Outcome {
    Outcome::Grpc {
        code: GrpcCode::Unavailable,
        pushback,
    }
}

/// The pauses of `outcomes`, one attempt each at `t0`, until the call stops retrying.
fn pauses(p: &RetryPolicy, outcomes: Vec<Outcome>) -> Vec<Duration> {
    let t0 = Instant::now();
    let state = EndpointState::new(p, t0);
    let mut call = RetryCall::new(p, &state, get(), t0);
    let mut out = Vec::new();
    for outcome in outcomes {
        match step(&mut call, outcome, t0) {
            Decision::Retry { pause, .. } => out.push(pause),
            other => panic!("expected a retry, got {other:?}"),
        }
    }
    out
}

#[test]
fn after_a_grpc_pushback_the_backoff_starts_over() {
    // gRFC A6: base 100ms, multiplier 2, jitter none; a pushback of 50ms paces retry 2, and
    // the retries after it start again from the initial backoff.
    let mut p = policy();
    p.max_attempts = 5;
    let ms = Duration::from_millis;
    let pushback = Some(Pushback::After(ms(50)));
    assert_eq!(
        pauses(&p, vec![grpc(None), grpc(pushback), grpc(None), grpc(None)]),
        [ms(100), ms(50), ms(100), ms(200)]
    );
    // A pushback first, then the schedule from its start.
    assert_eq!(
        pauses(&p, vec![grpc(pushback), grpc(None), grpc(None)]),
        [ms(50), ms(100), ms(200)]
    );
}

#[test]
fn after_an_http_retry_after_the_backoff_goes_on() {
    // SPEC §2 step 7: `Retry-After` lengthens the computed pause and does not reset it.
    let mut p = policy();
    p.max_attempts = 5;
    let ms = Duration::from_millis;
    let retry_after = |d| Outcome::Http {
        status: 429,
        retry_after: Some(Ok(d)),
    };
    assert_eq!(
        pauses(
            &p,
            vec![http(503), retry_after(ms(50)), http(503), http(503)]
        ),
        [ms(100), ms(200), ms(400), ms(800)]
    );
    assert_eq!(
        pauses(&p, vec![http(503), retry_after(ms(1500)), http(503)]),
        [ms(100), ms(1500), ms(400)]
    );
}

#[test]
fn decorrelated_jitter_goes_on_from_the_pause_a_retry_after_lengthened() {
    // SPEC §2 step 7: `uniform[base, previous_pause × 3]`, where the previous pause is the one
    // taken. An RNG that always draws the top of the range: 300ms (3 × base), then the
    // `Retry-After` of 2s is waited, so the next draw reaches 6s (3 × 2s), not 900ms.
    struct Top;
    impl crate::rng::Rng for Top {
        fn next_u64(&mut self) -> u64 {
            u64::MAX
        }
    }
    let ms = Duration::from_millis;
    let mut p = policy();
    p.max_attempts = 4;
    p.backoff.jitter = Jitter::Decorrelated;
    p.backoff.max = Duration::from_secs(30);
    let t0 = Instant::now();
    let state = EndpointState::new(&p, t0);
    let mut call = RetryCall::new(&p, &state, get(), t0);
    let retry_after = Outcome::Http {
        status: 429,
        retry_after: Some(Ok(ms(2000))),
    };
    let mut pauses = Vec::new();
    for outcome in [http(503), retry_after, http(503)] {
        call.start_attempt(t0).expect("attempt allowed");
        match call.on_outcome(outcome, t0, &mut Top) {
            Decision::Retry { pause, .. } => pauses.push(pause),
            other => panic!("expected a retry, got {other:?}"),
        }
    }
    assert_eq!(pauses, [ms(300), ms(2000), ms(6000)]);
}

#[test]
fn a_call_that_is_over_starts_no_more_attempts() {
    let mut p = policy();
    p.circuit_breaker = None;
    let t0 = Instant::now();
    let state = EndpointState::new(&p, t0);
    // Attempts exhausted: `the_last_allowed_attempt_gives_up_with_attempts_exhausted`.
    // Returned, or gave up early.
    for outcome in [http(200), http(404)] {
        let mut call = RetryCall::new(&p, &state, get(), t0);
        let _ = step(&mut call, outcome, t0);
        assert_eq!(call.start_attempt(t0), Err(GiveUpCause::AttemptsExhausted));
        assert_eq!(call.attempts(), 1);
    }
    // An attempt in flight: the next one waits for its outcome and a retry.
    let mut call = RetryCall::new(&p, &state, get(), t0);
    assert!(call.start_attempt(t0).is_ok());
    assert_eq!(call.start_attempt(t0), Err(GiveUpCause::AttemptsExhausted));
    // A refusal at the start ends the call too.
    let mut call = RetryCall::new(&p, &state, get(), t0);
    let late = t0 + p.deadline;
    assert_eq!(call.start_attempt(late), Err(GiveUpCause::DeadlineExceeded));
    assert_eq!(call.start_attempt(t0), Err(GiveUpCause::AttemptsExhausted));
    assert_eq!(call.attempts(), 0);
    // A policy built in code with `max_attempts: 0` starts nothing.
    let none = RetryPolicy {
        max_attempts: 0,
        ..p.clone()
    };
    let mut call = RetryCall::new(&none, &state, get(), t0);
    assert_eq!(call.start_attempt(t0), Err(GiveUpCause::AttemptsExhausted));
}

#[test]
fn a_released_attempt_hands_its_half_open_probe_to_the_next_call() {
    let mut p = breaking_after(1);
    if let Some(b) = p.circuit_breaker.as_mut() {
        b.half_open_probes = 1;
    }
    p.budget = None;
    let open_for = p.circuit_breaker.as_ref().map(|b| b.open_for).unwrap();
    let t0 = Instant::now();
    let state = EndpointState::new(&p, t0);
    let mut call = RetryCall::new(&p, &state, get(), t0);
    let _ = step(&mut call, http(503), t0);
    let half = t0 + open_for;
    // The one probe is taken, and the attempt ends with no outcome (a local error, a cancel).
    let mut probing = RetryCall::new(&p, &state, get(), half);
    assert!(probing.start_attempt(half).is_ok());
    let mut blocked = RetryCall::new(&p, &state, get(), half);
    assert_eq!(blocked.start_attempt(half), Err(GiveUpCause::CircuitOpen));
    probing.release();
    let mut next = RetryCall::new(&p, &state, get(), half);
    assert!(
        next.start_attempt(half).is_ok(),
        "the probe was handed back"
    );
    // Neither a success nor a failure was counted: still half-open, the probe out again.
    assert_eq!(
        state.breaker().map(|b| b.state(half)),
        Some(BreakerState::HalfOpen)
    );
    // The released call is over: no outcome is taken and nothing more starts.
    let mut rng = SeededRng::with_seed(1);
    assert_eq!(
        probing.on_outcome(http(200), half, &mut rng),
        Decision::GiveUp(GiveUpCause::AttemptsExhausted)
    );
    assert_eq!(
        probing.start_attempt(half),
        Err(GiveUpCause::AttemptsExhausted)
    );
    // Released again, or after its outcome: the breaker is left alone.
    probing.release();
    let mut rng = SeededRng::with_seed(1);
    assert_eq!(next.on_outcome(http(200), half, &mut rng), Decision::Return);
    next.release();
    assert_eq!(
        state.breaker().map(|b| b.state(half)),
        Some(BreakerState::Closed)
    );
}

fn arb_outcome() -> impl Strategy<Value = Outcome> {
    prop_oneof![
        prop::sample::select(vec![200u16, 404, 408, 429, 500, 502, 503, 504]).prop_map(http),
        (0u64..5_000).prop_map(|ms| Outcome::Http {
            status: 429,
            retry_after: Some(Ok(Duration::from_millis(ms)))
        }),
        prop::sample::select(ErrorClass::ALL.to_vec()).prop_map(Outcome::Transport),
        (0u64..3_000).prop_map(|ms| Outcome::Grpc {
            code: GrpcCode::Unavailable,
            pushback: Some(Pushback::After(Duration::from_millis(ms)))
        }),
    ]
}

proptest! {
    #[test]
    fn never_more_than_max_attempts_and_never_a_pause_past_the_deadline(
        max_attempts in 1u32..=10,
        deadline_ms in 1u64..20_000,
        jitter in prop::sample::select(Jitter::ALL.to_vec()),
        seed in any::<u64>(),
        outcomes in prop::collection::vec((arb_outcome(), 0u64..3_000), 1..30),
    ) {
        let mut p = policy();
        p.max_attempts = max_attempts;
        p.deadline = Duration::from_millis(deadline_ms);
        p.per_try_timeout = p.deadline;
        p.backoff.jitter = jitter;
        p.circuit_breaker = None;
        let t0 = Instant::now();
        let state = EndpointState::new(&p, t0);
        let mut rng = SeededRng::with_seed(seed);
        let mut call = RetryCall::new(&p, &state, get(), t0);
        let mut now = t0;
        // Whether the call is over (it returned or gave up): the outcomes left are still
        // offered, as a careless caller would, and must start nothing.
        let mut over = false;
        for (outcome, took_ms) in outcomes {
            let attempt = match call.start_attempt(now) {
                Ok(attempt) => attempt,
                Err(cause) => {
                    if over {
                        prop_assert_eq!(cause, GiveUpCause::AttemptsExhausted);
                    }
                    over = true;
                    continue;
                }
            };
            prop_assert!(!over, "attempt {} started after the call was over", attempt.number);
            prop_assert!(attempt.number <= max_attempts);
            prop_assert_eq!(attempt.number, call.attempts());
            prop_assert!(now + attempt.timeout <= call.deadline());
            now += Duration::from_millis(took_ms).min(attempt.timeout);
            match call.on_outcome(outcome, now, &mut rng) {
                Decision::Retry { pause, .. } => {
                    prop_assert!(now + pause < call.deadline(), "pause ends past the deadline");
                    now += pause;
                }
                Decision::Return | Decision::GiveUp(_) => over = true,
            }
            prop_assert!(call.attempts() <= max_attempts);
        }
        prop_assert!(call.attempts() <= max_attempts);
    }
}

fn arb_any_outcome() -> impl Strategy<Value = Outcome> {
    let hint = prop_oneof![
        Just(None),
        (0u64..120_000).prop_map(|ms| Some(Ok(Duration::from_millis(ms)))),
        Just(Some(Err(RetryAfterError::Negative))),
    ];
    let pushback = prop_oneof![
        Just(None),
        Just(Some(Pushback::DoNotRetry)),
        (0u64..120_000).prop_map(|ms| Some(Pushback::After(Duration::from_millis(ms)))),
    ];
    prop_oneof![
        (
            prop::sample::select(vec![200u16, 304, 401, 404, 408, 429, 500, 502, 503, 504]),
            hint
        )
            .prop_map(|(status, retry_after)| Outcome::Http {
                status,
                retry_after
            }),
        (0i32..=16, pushback).prop_map(|(code, pushback)| Outcome::Grpc {
            code: GrpcCode::from_i32(code).unwrap_or(GrpcCode::Unavailable),
            pushback,
        }),
        prop::sample::select(ErrorClass::ALL.to_vec()).prop_map(Outcome::Transport),
    ]
}

proptest! {
    /// `RetryRules::may_retry` is the part of the decision the outcome, the call and the policy alone
    /// make: with nothing else in the way (no budget, no breaker, a deadline far off), it
    /// answers `true` exactly when the engine retries, whatever the attempt.
    #[test]
    fn retry_rules_answer_as_the_engine_decides(
        outcome in arb_any_outcome(),
        (idempotent, keyed, replayable) in any::<(bool, bool, bool)>(),
        (max_attempts, attempt) in (1u32..=10).prop_flat_map(|m| (Just(m), 1..=m)),
        honor in any::<bool>(),
        hint_max_ms in 0u64..90_000,
    ) {
        let mut p = policy();
        p.max_attempts = max_attempts;
        p.deadline = Duration::from_secs(3_600);
        p.per_try_timeout = Duration::from_secs(1);
        p.retry_after.honor = honor;
        p.retry_after.max = Duration::from_millis(hint_max_ms);
        p.budget = None;
        p.circuit_breaker = None;
        let info = CallInfo::new(idempotent, keyed).with_replayable(replayable);
        let t0 = Instant::now();
        let state = EndpointState::new(&p, t0);
        let mut call = RetryCall::new(&p, &state, info, t0);
        let mut rng = SeededRng::with_seed(7);
        // Earlier attempts fail with a retried 503, so that the call reaches `attempt`.
        for _ in 1..attempt {
            call.start_attempt(t0).expect("an earlier attempt may start");
            let earlier = call.on_outcome(http(503), t0, &mut rng);
            // A call that may not retry a 503 ends at its first attempt (checked there).
            if !matches!(earlier, Decision::Retry { .. }) {
                return Ok(());
            }
        }
        call.start_attempt(t0).expect("the attempt may start");
        let decision = call.on_outcome(outcome.clone(), t0, &mut rng);
        prop_assert_eq!(
            RetryRules::new(&p, info).may_retry(&outcome, attempt),
            matches!(decision, Decision::Retry { .. }),
            "{:?} on attempt {} of {}: {:?}", outcome, attempt, max_attempts, decision
        );
    }

    /// With the budget, the breaker and the deadline in play too, a `false` still means the
    /// call gives up.
    #[test]
    fn the_engine_never_retries_what_the_rules_refuse(
        outcomes in prop::collection::vec((arb_any_outcome(), 0u64..3_000), 1..12),
        (idempotent, keyed) in any::<(bool, bool)>(),
        deadline_ms in 1u64..20_000,
        min_per_second in 0u32..3,
    ) {
        let mut p = policy();
        p.deadline = Duration::from_millis(deadline_ms);
        p.max_attempts = 5;
        if let Some(b) = p.budget.as_mut() {
            b.min_per_second = min_per_second;
        }
        let info = CallInfo::new(idempotent, keyed);
        let t0 = Instant::now();
        let state = EndpointState::new(&p, t0);
        let mut rng = SeededRng::with_seed(3);
        let mut now = t0;
        let mut call = RetryCall::new(&p, &state, info, t0);
        for (outcome, took_ms) in outcomes {
            let Ok(attempt) = call.start_attempt(now) else {
                // Over: the next outcomes start a new call on the same shared state.
                call = RetryCall::new(&p, &state, info, now);
                continue;
            };
            now += Duration::from_millis(took_ms).min(attempt.timeout);
            let allowed = RetryRules::new(&p, info).may_retry(&outcome, attempt.number);
            match call.on_outcome(outcome.clone(), now, &mut rng) {
                Decision::Retry { pause, .. } => {
                    prop_assert!(allowed, "{:?} retried on attempt {}", outcome, attempt.number);
                    now += pause;
                }
                Decision::Return | Decision::GiveUp(_) => {
                    call = RetryCall::new(&p, &state, info, now);
                }
            }
        }
    }
}

#[test]
fn a_carried_state_keeps_the_part_whose_settings_did_not_change() {
    let t0 = Instant::now();
    let p = policy();
    let old = EndpointState::new(&p, t0);
    assert!(old.fits(&p));
    let (Some(old_budget), Some(old_breaker)) = (old.budget(), old.breaker()) else {
        panic!("the default policy has a budget and a breaker");
    };

    // Only the budget changes: the breaker (and whatever state it is in) is the same one.
    let mut budget_changed = p.clone();
    budget_changed.budget = Some(BudgetConfig {
        ratio: 0.1,
        ..BudgetConfig::default()
    });
    assert!(!old.fits(&budget_changed));
    let carried = old.carry(&budget_changed, t0);
    assert!(carried.fits(&budget_changed));
    assert!(
        carried
            .breaker()
            .is_some_and(|b| std::ptr::eq(b, old_breaker))
    );
    assert!(
        carried
            .budget()
            .is_some_and(|b| !std::ptr::eq(b, old_budget))
    );

    // Only the breaker changes: the budget's window is the same one.
    let mut breaker_changed = p.clone();
    breaker_changed.circuit_breaker = Some(BreakerConfig {
        min_requests: 5,
        ..BreakerConfig::default()
    });
    let carried = old.carry(&breaker_changed, t0);
    assert!(
        carried
            .budget()
            .is_some_and(|b| std::ptr::eq(b, old_budget))
    );
    assert!(
        carried
            .breaker()
            .is_some_and(|b| !std::ptr::eq(b, old_breaker))
    );

    // Turned off, then on again with the same settings while calls on the old state still
    // run (`old` is alive): the same ones, which those calls still use.
    let mut off = p.clone();
    off.budget = None;
    off.circuit_breaker = None;
    let carried = old.carry(&off, t0);
    assert!(carried.budget().is_none() && carried.breaker().is_none());
    let again = carried.carry(&p, t0);
    assert!(again.fits(&p));
    assert!(again.budget().is_some_and(|b| std::ptr::eq(b, old_budget)));
    assert!(
        again
            .breaker()
            .is_some_and(|b| std::ptr::eq(b, old_breaker))
    );
    // With other settings: new ones.
    let mut other = p.clone();
    other.budget = Some(BudgetConfig {
        min_per_second: 7,
        ..BudgetConfig::default()
    });
    other.circuit_breaker = Some(BreakerConfig {
        min_requests: 7,
        ..BreakerConfig::default()
    });
    let again = carried.carry(&other, t0);
    assert!(again.budget().is_some_and(|b| !std::ptr::eq(b, old_budget)));
    assert!(
        again
            .breaker()
            .is_some_and(|b| !std::ptr::eq(b, old_breaker))
    );
    // The state with them turned off keeps them for the calls that still use them: it is
    // not idle until none does (and they count nothing).
    let running = EndpointState::new(&p, t0);
    let turned_off = running.carry(&off, t0);
    assert!(!turned_off.is_idle(t0));
    drop(running);
    assert!(turned_off.is_idle(t0));
}

#[test]
fn a_carried_state_keeps_an_open_breaker_open_when_its_settings_change() {
    let t0 = Instant::now();
    let mut p = policy();
    p.circuit_breaker = Some(BreakerConfig {
        min_requests: 2,
        ..BreakerConfig::default()
    });
    let old = EndpointState::new(&p, t0);
    let breaker = old.breaker().unwrap();
    for _ in 0..2 {
        let permit = breaker.try_acquire(t0).unwrap();
        breaker.record(permit, false, t0);
    }
    assert_eq!(breaker.state(t0), BreakerState::Open);
    let mut changed = p.clone();
    changed.circuit_breaker = Some(BreakerConfig {
        min_requests: 20,
        open_for: Duration::from_secs(1),
        ..BreakerConfig::default()
    });
    let carried = old.carry(&changed, t0);
    let at = t0 + Duration::from_secs(2);
    assert_eq!(carried.breaker().unwrap().state(at), BreakerState::Open);
}

#[test]
fn a_budget_tightened_during_a_storm_refuses_at_once() {
    // A storm used the budget up; the change shortens its window (a smaller reserve).
    let t0 = Instant::now();
    let mut p = policy();
    p.budget = Some(BudgetConfig {
        ratio: 0.1,
        min_per_second: 1,
        window: Duration::from_secs(10),
    });
    let old = EndpointState::new(&p, t0);
    let budget = old.budget().unwrap();
    let now = t0 + Duration::from_millis(500);
    for _ in 0..7 {
        budget.deposit(now);
    }
    while budget.try_withdraw(now) {}
    assert_eq!(budget.snapshot(now).retries, 10);
    let mut tightened = p.clone();
    tightened.budget = Some(BudgetConfig {
        window: Duration::from_secs(5),
        ..p.budget.clone().unwrap()
    });
    let now = now + Duration::from_millis(800);
    let carried = old.carry(&tightened, now);
    let new = carried.budget().unwrap();
    assert!(!std::ptr::eq(new, budget));
    assert!(!new.can_withdraw(now), "{:?}", new.snapshot(now));
    assert_eq!(
        (new.snapshot(now).requests, new.snapshot(now).retries),
        (7, 10)
    );
    // Loosened instead, it allows what is left of the larger allowance only.
    let mut loosened = p.clone();
    loosened.budget = Some(BudgetConfig {
        min_per_second: 2,
        ..p.budget.clone().unwrap()
    });
    let carried = old.carry(&loosened, now);
    let new = carried.budget().unwrap();
    let mut allowed = 0;
    while new.try_withdraw(now) {
        allowed += 1;
        assert!(allowed <= 100);
    }
    assert_eq!(allowed, 10, "20 allowed, 10 used");
    // Taken-over counts leave one new window after the change.
    let later = now + Duration::from_secs(11);
    assert_eq!(new.snapshot(later).retries, 0);
}
