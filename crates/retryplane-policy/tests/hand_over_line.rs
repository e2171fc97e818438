//! Budgets and breakers that a push took over from, and the calls still running on them, with
//! chosen instants.

use std::time::Duration;

use retryplane_policy::breaker::{BreakerState, CircuitBreaker};
use retryplane_policy::model::BreakerConfig;
use tokio::time::Instant;

fn ms(t: Instant, ms: u64) -> Instant {
    t + Duration::from_millis(ms)
}

/// A push that changes only `open_for`: the old breaker's in-flight calls fail, the new
/// breaker's calls succeed. The new breaker counts every one of these outcomes (the old calls'
/// are forwarded to it) and its own rule says "stay closed" (10 failures of 110 attempts,
/// ratio 0.5). The old breaker, which saw only its 10 failing calls, opened before by its own
/// rule and passed its opening on, cutting the whole endpoint off.
#[test]
fn failures_forwarded_to_the_newest_breaker_do_not_open_it_again_through_the_old_one() {
    let t0 = Instant::now();
    let old_cfg = BreakerConfig {
        min_requests: 10,
        ..BreakerConfig::default()
    };
    let old = std::sync::Arc::new(CircuitBreaker::new(&old_cfg, t0));
    // Ten calls in flight on the old settings.
    let permits: Vec<_> = (0..10).map(|_| old.try_acquire(t0).unwrap()).collect();
    let new_cfg = BreakerConfig {
        open_for: Duration::from_secs(60),
        ..old_cfg
    };
    let new = CircuitBreaker::taking_over(&new_cfg, &old);
    // 100 new calls succeed.
    for i in 0..100 {
        let now = ms(t0, 10 + i);
        let p = new.try_acquire(now).unwrap();
        new.record(p, true, now);
    }
    // The ten old calls time out.
    let at = ms(t0, 200);
    for p in permits {
        old.record(p, false, at);
    }
    assert_eq!(
        new.state(at),
        BreakerState::Closed,
        "the newest breaker counted 10 failures in 110 attempts (ratio 0.5): it must stay closed"
    );
}

/// The newest breaker opened and closed again on its probes; the old breaker, opened with it,
/// is half-open and serves the calls started before the push. One of them fails one attempt:
/// a failed probe of the old breaker, which opens it again; before, it opened the newest with
/// it too, though the newest counts that failure (1 attempt, min_requests 11), cutting the
/// recovered endpoint off for another 30 s.
#[test]
fn one_failure_of_a_call_started_before_a_push_does_not_reopen_the_recovered_newest_breaker() {
    let t0 = Instant::now();
    let old_cfg = BreakerConfig {
        min_requests: 10,
        ..BreakerConfig::default()
    };
    let old = std::sync::Arc::new(CircuitBreaker::new(&old_cfg, t0));
    let new = CircuitBreaker::taking_over(
        &BreakerConfig {
            min_requests: 11,
            ..old_cfg
        },
        &old,
    );
    let tripped = ms(t0, 1_000);
    for _ in 0..11 {
        if let Ok(p) = new.try_acquire(tripped) {
            new.record(p, false, tripped);
        }
    }
    assert_eq!(new.state(tripped), BreakerState::Open);
    assert_eq!(old.state(tripped), BreakerState::Open);
    // 30 s later the newest probes and closes.
    let probing = ms(t0, 31_000);
    let probes: Vec<_> = (0..3).map(|_| new.try_acquire(probing).unwrap()).collect();
    probes
        .into_iter()
        .for_each(|p| new.record(p, true, probing));
    assert_eq!(new.state(probing), BreakerState::Closed);
    // A call started before the push fails one attempt.
    let at = ms(t0, 31_100);
    let p = old.try_acquire(at).expect("the old breaker is half-open");
    old.record(p, false, at);
    assert_eq!(
        new.state(at),
        BreakerState::Closed,
        "one failure among the calls of the newest breaker (min_requests 11)"
    );
}
