//! Budgets and breakers of calls that read the policies just before a push that turned them
//! off, with chosen instants.

use std::time::Duration;

use retryplane_policy::breaker::BreakerState;
use retryplane_policy::engine::EndpointState;
use retryplane_policy::model::{BreakerConfig, BudgetConfig, RetryPolicy};
use tokio::time::Instant;

fn ms(t: Instant, ms: u64) -> Instant {
    t + Duration::from_millis(ms)
}

/// A budget of 2 retries per second (20 per 10 s window) and no ratio.
fn with_budget() -> RetryPolicy {
    RetryPolicy {
        budget: Some(BudgetConfig {
            ratio: 0.0,
            min_per_second: 2,
            window: Duration::from_secs(10),
        }),
        circuit_breaker: None,
        ..RetryPolicy::default()
    }
}

/// A push turns the budget off for an endpoint the policies do not name. Calls that read the
/// policies just before it reach the endpoint after it, and each gets a state behind the
/// newest (the agent builds one per such call). Their policy still has the budget (they keep
/// their policy), and they share one: each with a fresh budget of its own, 60 such calls sent
/// 60 retries in one second where their budget allows 20 per window.
#[test]
fn calls_behind_a_newest_state_without_a_budget_share_one_budget_of_their_own_settings() {
    let t0 = Instant::now();
    let newest = EndpointState::new(
        &RetryPolicy {
            budget: None,
            ..with_budget()
        },
        t0,
    );
    let old = with_budget();
    let stragglers: Vec<EndpointState> = (0..60).map(|_| newest.behind(&old)).collect();
    let sent = stragglers
        .iter()
        .enumerate()
        .filter(|(i, s)| {
            let now = ms(t0, 100 + *i as u64);
            s.budget().unwrap().deposit(now);
            s.budget().unwrap().try_withdraw(now)
        })
        .count();
    assert!(
        sent <= 20,
        "{sent} retries in one second, each straggler call with a fresh budget of 20 per window"
    );
}

/// The same for a breaker the push turned off: the calls behind the newest state share one,
/// which opens on their failures (each with a breaker of its own, none ever saw enough calls
/// to open).
#[test]
fn calls_behind_a_newest_state_without_a_breaker_share_one_breaker_of_their_own_settings() {
    let t0 = Instant::now();
    let old = RetryPolicy {
        budget: None,
        circuit_breaker: Some(BreakerConfig {
            min_requests: 5,
            ..BreakerConfig::default()
        }),
        ..RetryPolicy::default()
    };
    let newest = EndpointState::new(
        &RetryPolicy {
            circuit_breaker: None,
            ..old.clone()
        },
        t0,
    );
    let stragglers: Vec<EndpointState> = (0..10).map(|_| newest.behind(&old)).collect();
    for (i, s) in stragglers.iter().enumerate() {
        let now = ms(t0, 100 + i as u64);
        let breaker = s.breaker().unwrap();
        if let Ok(permit) = breaker.try_acquire(now) {
            breaker.record(permit, false, now);
        }
    }
    let now = ms(t0, 200);
    assert_eq!(
        stragglers[9].breaker().unwrap().state(now),
        BreakerState::Open,
        "ten failures of ten calls where five open it"
    );
}
