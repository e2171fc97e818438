//! Half-open probes and openings across a line of breakers that several pushes built (calls
//! still running on each outgoing state), with chosen instants.

use std::sync::Arc;
use std::time::Duration;

use retryplane_policy::breaker::{BreakerState, CircuitBreaker};
use retryplane_policy::engine::EndpointState;
use retryplane_policy::model::{BreakerConfig, RetryPolicy};
use tokio::time::Instant;

fn ms(t: Instant, ms: u64) -> Instant {
    t + Duration::from_millis(ms)
}

fn policy(breaker: BreakerConfig) -> RetryPolicy {
    RetryPolicy {
        circuit_breaker: Some(breaker),
        ..RetryPolicy::default()
    }
}

fn breaker_cfg(half_open_probes: u32) -> BreakerConfig {
    BreakerConfig {
        min_requests: 20,
        half_open_probes,
        ..BreakerConfig::default()
    }
}

/// Opens `b` by its own rule at `at` (20 failures, min_requests 20).
fn trip(b: &CircuitBreaker, at: Instant) {
    for _ in 0..20 {
        if let Ok(p) = b.try_acquire(at) {
            b.record(p, false, at);
        }
    }
    assert_eq!(b.state(at), BreakerState::Open);
}

/// Probes `b` grants at `at`, up to `max` asks (none recorded: the attempts are still out).
fn probes_granted(b: &CircuitBreaker, at: Instant, max: u32) -> u32 {
    (0..max).filter(|_| b.try_acquire(at).is_ok()).count() as u32
}

/// Three pushes lower `half_open_probes` from 10 to 5 to 1 (the upstream can take only one
/// probe); calls are still running on each outgoing state. The newest breaker opens by its
/// own rule and opens the line. When the open period ends, every breaker of the line is
/// half-open with probes of its own: 10 + 5 + 1 = 16 probes go out at once to the upstream
/// the newest settings allow one probe.
#[test]
fn half_open_probes_across_a_line_of_three_pushes_stay_near_what_the_newest_allows() {
    let t0 = Instant::now();
    let v1 = EndpointState::new(&policy(breaker_cfg(10)), t0);
    let v2 = v1.carry(&policy(breaker_cfg(5)), ms(t0, 100));
    let v3 = v2.carry(&policy(breaker_cfg(1)), ms(t0, 200));
    let newest = v3.breaker().unwrap();
    trip(newest, ms(t0, 1_000));
    for s in [&v1, &v2] {
        assert_eq!(
            s.breaker().unwrap().state(ms(t0, 1_000)),
            BreakerState::Open
        );
    }
    let half_open = ms(t0, 31_001);
    let total = probes_granted(v1.breaker().unwrap(), half_open, 10)
        + probes_granted(v2.breaker().unwrap(), half_open, 5)
        + probes_granted(newest, half_open, 1);
    assert!(
        total <= 2,
        "{total} probes went out at once across the line; the newest breaker allows 1"
    );
}

/// The endpoint's newest breaker (1 probe) is half-open and its probe is out. Calls that read
/// the policies just before the push reach the endpoint now, each given a state behind the
/// newest (`States::runtime` builds one per such call): each of their breakers joins the
/// line half-open, with a fresh probe of its own, so five stragglers send five more probes.
#[test]
fn calls_that_join_a_half_open_line_behind_the_newest_get_no_probes_of_their_own() {
    let t0 = Instant::now();
    let old = policy(BreakerConfig {
        window: Duration::from_secs(20),
        ..breaker_cfg(1)
    });
    let v2 = EndpointState::new(&policy(breaker_cfg(1)), t0);
    let newest = v2.breaker().unwrap();
    trip(newest, ms(t0, 1_000));
    let half_open = ms(t0, 31_001);
    assert!(newest.try_acquire(half_open).unwrap().is_probe());
    assert!(newest.would_refuse(half_open), "its one probe is out");
    let stragglers: Vec<EndpointState> = (0..5).map(|_| v2.behind(&old)).collect();
    let extra = stragglers
        .iter()
        .filter(|s| s.breaker().unwrap().try_acquire(ms(t0, 31_002)).is_ok())
        .count();
    assert_eq!(
        extra, 0,
        "{extra} straggler calls got probes of their own beside the newest breaker's one"
    );
}

/// A push changes only `open_for`; calls are still running on the old breaker. The newest
/// opens (and the old with it); both go half-open. Before, the old breaker sent a probe of its
/// own and, when it failed, opened alone while the newest had closed on its probe: the calls
/// started before the push were refused for 30 s while new calls went through. The probes are
/// the newest's now, and its closing closes the line.
#[test]
fn a_breaker_taken_over_from_does_not_open_alone_while_the_newest_stays_closed() {
    let t0 = Instant::now();
    let old = Arc::new(CircuitBreaker::new(&breaker_cfg(1), t0));
    let new_cfg = BreakerConfig {
        open_for: Duration::from_secs(30),
        window: Duration::from_secs(20),
        ..breaker_cfg(1)
    };
    let new = CircuitBreaker::taking_over(&new_cfg, &old);
    trip(&new, ms(t0, 1_000));
    assert_eq!(old.state(ms(t0, 1_000)), BreakerState::Open);
    let at = ms(t0, 31_001);
    assert!(
        old.try_acquire(at).is_err(),
        "the old breaker sends no probe"
    );
    let new_probe = new.try_acquire(at).expect("new is half-open");
    new.record(new_probe, true, at);
    let later = ms(t0, 31_003);
    assert_eq!(new.state(later), BreakerState::Closed);
    assert_eq!(
        old.state(later),
        new.state(later),
        "the line's breakers disagree"
    );
}

/// A push lowers `min_requests` from 100 to 20 and `half_open_probes` to 1; calls still run on
/// the old breaker. The newest opens and opens the line. Before, when the open period ended
/// the old breaker's own probe closed it while the newest was still half-open, and from then
/// on every old call went through, counted by the old breaker's rule alone: 100 failing
/// attempts before it opened the line again. The old breaker sends no probe of its own now.
#[test]
fn an_old_breaker_closed_on_its_own_probe_does_not_send_full_traffic_while_the_newest_is_half_open()
{
    let t0 = Instant::now();
    let old = Arc::new(CircuitBreaker::new(
        &BreakerConfig {
            min_requests: 100,
            ..breaker_cfg(1)
        },
        t0,
    ));
    let new = CircuitBreaker::taking_over(&breaker_cfg(1), &old);
    trip(&new, ms(t0, 1_000));
    let at = ms(t0, 31_001);
    assert!(
        old.try_acquire(at).is_err(),
        "the old breaker sends no probe"
    );
    assert_eq!(new.state(at), BreakerState::HalfOpen);
    let mut through = 0;
    for i in 0..200 {
        let now = ms(t0, 31_002 + i);
        if let Ok(p) = old.try_acquire(now) {
            through += 1;
            old.record(p, false, now);
        }
    }
    assert!(
        through <= 3,
        "{through} failing attempts of the old calls went out while the newest breaker was \
         half-open with one probe"
    );
}
