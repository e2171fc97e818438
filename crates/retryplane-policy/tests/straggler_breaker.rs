//! A breaker behind the newest of its line (a call that read the policies just before a push),
//! after the line has opened: what its own probes and the failures that follow do.

use std::sync::Arc;
use std::time::Duration;

use retryplane_policy::breaker::{BreakerState, CircuitBreaker};
use retryplane_policy::model::BreakerConfig;
use tokio::time::Instant;

fn ms(t: Instant, ms: u64) -> Instant {
    t + Duration::from_millis(ms)
}

/// The newest breaker opens; the straggler's breaker behind it opens with it. When the open
/// period ends both are half-open; only the straggler's calls come. Before, its own probes
/// succeeded and closed it while the newest stayed half-open, and then it forwarded each
/// failure to the newest, which, half-open, counted none: 200 failing attempts let through.
#[test]
fn a_straggler_breaker_that_closed_on_its_own_probes_opens_again_when_its_calls_keep_failing() {
    let t0 = Instant::now();
    let new_cfg = BreakerConfig {
        min_requests: 5,
        ..BreakerConfig::default()
    };
    let newest = Arc::new(CircuitBreaker::new(&new_cfg, t0));
    let old_cfg = BreakerConfig {
        min_requests: 6,
        ..new_cfg
    };
    let straggler = CircuitBreaker::behind(&old_cfg, &newest);
    let tripped = ms(t0, 1_000);
    for _ in 0..5 {
        if let Ok(p) = newest.try_acquire(tripped) {
            newest.record(p, false, tripped);
        }
    }
    assert_eq!(newest.state(tripped), BreakerState::Open);
    assert_eq!(straggler.state(tripped), BreakerState::Open);
    // 30 s later only the straggler's calls come: the probes are the newest's, so it sends
    // none of its own (it closed on them before, while the newest stayed half-open).
    let probing = ms(t0, 31_100);
    assert!(straggler.try_acquire(probing).is_err());
    assert_eq!(newest.state(probing), BreakerState::HalfOpen);
    // Then every call of the straggler fails.
    let mut let_through = 0;
    for i in 0..200 {
        let at = ms(t0, 31_200 + i);
        if let Ok(p) = straggler.try_acquire(at) {
            let_through += 1;
            straggler.record(p, false, at);
        }
    }
    assert!(
        let_through <= 10,
        "{let_through} failing attempts let through by the straggler's breaker (its rule: 5 of \
         6; the newest, half-open, allows 3 probes); newest {:?}, straggler {:?}",
        newest.state(ms(t0, 31_400)),
        straggler.state(ms(t0, 31_400)),
    );
}
