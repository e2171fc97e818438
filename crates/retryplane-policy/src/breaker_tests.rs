//! Tests of the circuit breaker: opening, half-open probes, stale permits.

use std::sync::Arc;
use std::time::Duration;

use super::BreakerState::{Closed, HalfOpen, Open};
use super::*;

/// The default settings (ratio 0.5, window 10 s, open for 30 s, 3 probes).
fn breaker(min_requests: u32, t0: Instant) -> CircuitBreaker {
    let cfg = BreakerConfig {
        min_requests,
        ..BreakerConfig::default()
    };
    CircuitBreaker::new(&cfg, t0)
}

fn ms(t: Instant, ms: u64) -> Instant {
    t + Duration::from_millis(ms)
}

fn call(b: &CircuitBreaker, success: bool, now: Instant) -> Result<(), BreakerOpen> {
    let permit = b.try_acquire(now)?;
    b.record(permit, success, now);
    Ok(())
}

/// Opens `b` at `t0` + 1 s with 10 failures.
fn trip(b: &CircuitBreaker, t0: Instant) -> Instant {
    let at = t0 + Duration::from_secs(1);
    (0..10).for_each(|_| call(b, false, at).unwrap_or(()));
    assert_eq!(b.state(at), Open);
    at
}

#[test]
fn opens_at_the_failure_ratio_with_enough_requests() {
    let t0 = Instant::now();
    let b = breaker(10, t0);
    for i in 0..5 {
        call(&b, true, ms(t0, i)).unwrap();
    }
    for i in 0..4 {
        call(&b, false, ms(t0, 10 + i)).unwrap();
    }
    assert_eq!(b.state(ms(t0, 20)), Closed);
    call(&b, false, ms(t0, 20)).unwrap();
    assert_eq!(b.state(ms(t0, 20)), Open);
}

#[test]
fn a_failure_ratio_of_zero_opens_on_the_first_failure_once_min_requests_is_met() {
    let t0 = Instant::now();
    let cfg = BreakerConfig {
        failure_ratio: 0.0,
        min_requests: 5,
        ..BreakerConfig::default()
    };
    let b = CircuitBreaker::new(&cfg, t0);
    (0..5).for_each(|_| call(&b, true, t0).unwrap());
    assert_eq!(b.state(t0), Closed, "successes alone never open it");
    call(&b, false, t0).unwrap();
    assert_eq!(b.state(t0), Open);
    // Below min_requests, a failure does not open it.
    let b = CircuitBreaker::new(&cfg, t0);
    (0..4).for_each(|_| call(&b, false, t0).unwrap());
    assert_eq!(b.state(t0), Closed);
}

#[test]
fn does_not_open_below_min_requests_or_below_the_ratio() {
    let t0 = Instant::now();
    let b = breaker(20, t0);
    (0..19).for_each(|_| call(&b, false, t0).unwrap());
    assert_eq!(b.state(t0), Closed);
    let b = breaker(10, t0);
    (0..11).for_each(|_| call(&b, true, t0).unwrap());
    (0..10).for_each(|_| call(&b, false, t0).unwrap());
    assert_eq!(b.state(t0), Closed);
}

#[test]
fn rejects_while_open() {
    let t0 = Instant::now();
    let b = breaker(10, t0);
    let opened = trip(&b, t0);
    for wait in [0, 1, 29_999] {
        let now = ms(opened, wait);
        assert_eq!(b.try_acquire(now), Err(BreakerOpen));
        assert_eq!(b.state(now), Open);
    }
}

#[test]
fn half_open_after_open_for_lets_exactly_n_probes() {
    let t0 = Instant::now();
    let b = breaker(10, t0);
    let half = trip(&b, t0) + Duration::from_secs(30);
    assert_eq!(b.state(half), HalfOpen);
    let probes: Vec<_> = (0..3).map(|_| b.try_acquire(half)).collect();
    assert!(probes.iter().all(|p| p.is_ok_and(Permit::is_probe)));
    assert_eq!(b.try_acquire(half), Err(BreakerOpen));
    assert_eq!(
        b.try_acquire(half + Duration::from_secs(29)),
        Err(BreakerOpen)
    );
}

#[test]
fn would_refuse_answers_as_try_acquire_would_without_taking_a_probe_and_is_closed_only_when_closed()
{
    let t0 = Instant::now();
    let b = breaker(10, t0);
    assert!(!b.would_refuse(t0), "closed");
    assert!(b.is_closed());
    let opened = trip(&b, t0);
    assert!(b.would_refuse(opened), "open");
    assert!(!b.is_closed());
    assert!(b.would_refuse(ms(opened, 29_999)), "open");
    let half = opened + Duration::from_secs(30);
    // Half-open with probes free: asking takes none of them.
    for _ in 0..5 {
        assert!(!b.would_refuse(half));
    }
    let probes: Vec<_> = (0..3).map(|_| b.try_acquire(half)).collect();
    assert!(probes.iter().all(Result::is_ok), "asking took a probe");
    // Every probe out: refused, as `try_acquire` is, until they count as lost.
    assert!(b.would_refuse(half));
    assert_eq!(b.try_acquire(half), Err(BreakerOpen));
    let nearly_lost = half + Duration::from_millis(29_999);
    assert!(b.would_refuse(nearly_lost));
    assert_eq!(b.try_acquire(nearly_lost), Err(BreakerOpen));
    let lost = half + Duration::from_secs(30);
    assert!(!b.would_refuse(lost));
    assert!(b.try_acquire(lost).is_ok_and(Permit::is_probe));
    // A probe handed back is free again.
    let b = breaker(10, t0);
    let half = trip(&b, t0) + Duration::from_secs(30);
    let probes: Vec<_> = (0..3).filter_map(|_| b.try_acquire(half).ok()).collect();
    assert!(b.would_refuse(half));
    b.release(probes[0]);
    assert!(!b.would_refuse(half));
    // Closed again by its probes.
    probes[1..].iter().for_each(|p| b.record(*p, true, half));
    let last = b.try_acquire(half).unwrap();
    b.record(last, true, half);
    assert_eq!(b.state(half), Closed);
    assert!(!b.would_refuse(half));
    assert!(b.is_closed());
}

#[test]
fn concurrent_acquires_while_half_open_get_exactly_n_probes() {
    let t0 = Instant::now();
    let b = breaker(10, t0);
    let half = trip(&b, t0) + Duration::from_secs(30);
    let granted: usize = std::thread::scope(|s| {
        let racers: Vec<_> = (0..2)
            .map(|_| s.spawn(|| (0..1000).filter(|_| b.try_acquire(half).is_ok()).count()))
            .collect();
        racers.into_iter().map(|r| r.join().unwrap_or(0)).sum()
    });
    assert_eq!(granted, 3);
}

#[test]
fn n_probe_successes_close_it_with_counts_reset() {
    let t0 = Instant::now();
    let cfg = BreakerConfig {
        min_requests: 4,
        window: Duration::from_secs(60),
        ..BreakerConfig::default()
    };
    let b = CircuitBreaker::new(&cfg, t0);
    (0..4).for_each(|_| call(&b, false, t0).unwrap());
    let half = t0 + Duration::from_secs(30);
    let probes: Vec<_> = (0..3).filter_map(|_| b.try_acquire(half).ok()).collect();
    for (i, p) in probes.into_iter().enumerate() {
        assert_eq!(b.state(half), HalfOpen, "after {i} successes");
        b.record(p, true, half);
    }
    assert_eq!(b.state(half), Closed);
    // The 4 failures before opening are still inside the 60 s window, but do not count.
    (0..3).for_each(|_| call(&b, false, half).unwrap());
    assert_eq!(b.state(half), Closed);
    call(&b, false, half).unwrap();
    assert_eq!(b.state(half), Open);
}

#[test]
fn one_probe_failure_reopens_for_a_new_open_for() {
    let t0 = Instant::now();
    let b = breaker(10, t0);
    let half = trip(&b, t0) + Duration::from_secs(30);
    let first = b.try_acquire(half).unwrap();
    let second = b.try_acquire(half).unwrap();
    b.record(first, true, half);
    let failed_at = ms(half, 1500);
    b.record(second, false, failed_at);
    let reopened_until = failed_at + Duration::from_secs(30);
    assert_eq!(b.state(reopened_until - Duration::from_millis(1)), Open);
    assert_eq!(
        b.try_acquire(half + Duration::from_secs(30)),
        Err(BreakerOpen)
    );
    assert_eq!(b.state(reopened_until), HalfOpen);
    let fresh = (0..4)
        .filter(|_| b.try_acquire(reopened_until).is_ok())
        .count();
    assert_eq!(fresh, 3);
}

#[test]
fn counts_expire_with_the_window() {
    let t0 = Instant::now();
    let b = breaker(10, t0);
    (0..9).for_each(|_| call(&b, false, t0).unwrap());
    call(&b, false, t0 + Duration::from_secs(10)).unwrap();
    assert_eq!(b.state(t0 + Duration::from_secs(10)), Closed);
}

#[test]
fn outcomes_from_an_earlier_period_are_ignored() {
    let t0 = Instant::now();
    let b = breaker(10, t0);
    let in_flight = b.try_acquire(t0).unwrap();
    let half = trip(&b, t0) + Duration::from_secs(30);
    b.record(in_flight, true, half);
    let probes: Vec<_> = (0..3).filter_map(|_| b.try_acquire(half).ok()).collect();
    assert_eq!(b.state(half), HalfOpen);
    probes.iter().for_each(|p| b.record(*p, true, half));
    assert_eq!(b.state(half), Closed);
    b.record(probes[0], false, half); // reported twice: ignored
    assert_eq!(b.state(half), Closed);
}

#[test]
fn lost_probes_are_replaced_after_another_open_for() {
    let t0 = Instant::now();
    let b = breaker(10, t0);
    let half = trip(&b, t0) + Duration::from_secs(30);
    let lost: Vec<_> = (0..3).filter_map(|_| b.try_acquire(half).ok()).collect();
    let later = half + Duration::from_secs(30);
    let fresh: Vec<_> = (0..4).filter_map(|_| b.try_acquire(later).ok()).collect();
    assert_eq!(fresh.len(), 3);
    b.record(lost[0], false, later); // a late report of the lost period is ignored
    fresh.iter().for_each(|p| b.record(*p, true, later));
    assert_eq!(b.state(later), Closed);
}

#[test]
fn zero_probes_means_one_and_instants_before_origin_do_not_panic() {
    let t0 = Instant::now();
    let cfg = BreakerConfig {
        min_requests: 1,
        half_open_probes: 0,
        ..BreakerConfig::default()
    };
    let b = CircuitBreaker::new(&cfg, t0 + Duration::from_secs(5));
    call(&b, false, t0).unwrap();
    assert_eq!(b.state(t0), Open);
    let half = t0 + Duration::from_secs(35);
    let probe = b.try_acquire(half).unwrap();
    assert_eq!(b.try_acquire(half), Err(BreakerOpen));
    b.record(probe, true, half);
    assert_eq!(b.state(half), Closed);
}

#[test]
fn a_success_from_before_the_breaker_last_opened_is_not_counted() {
    let t0 = Instant::now();
    let b = breaker(10, t0);
    // Permits taken while closed, answered only once the breaker has opened and closed again.
    let stale: Vec<Permit> = (0..100).map(|_| b.try_acquire(t0).unwrap()).collect();
    let opened = trip(&b, t0);
    let half = opened + Duration::from_secs(31);
    let probes: Vec<Permit> = (0..3).map(|_| b.try_acquire(half).unwrap()).collect();
    probes.into_iter().for_each(|p| b.record(p, true, half));
    assert_eq!(b.state(half), Closed);
    stale.into_iter().for_each(|p| b.record(p, true, half));
    // Had they counted, 100 successes would keep 10 failures under the ratio.
    (0..10).for_each(|_| call(&b, false, half).unwrap());
    assert_eq!(b.state(half), Open);
}

#[test]
fn a_released_probe_goes_back_to_the_pool_without_an_outcome() {
    let t0 = Instant::now();
    let b = breaker(10, t0);
    let half = trip(&b, t0) + Duration::from_secs(30);
    let probes: Vec<_> = (0..3).map(|_| b.try_acquire(half).unwrap()).collect();
    assert_eq!(b.try_acquire(half), Err(BreakerOpen));
    // Handed back: the next call gets a probe at once, and the breaker stays half-open.
    b.release(probes[0]);
    assert_eq!(b.state(half), HalfOpen);
    let again = b.try_acquire(half).unwrap();
    assert!(again.is_probe());
    assert_eq!(b.try_acquire(half), Err(BreakerOpen));
    // The released probe counted as neither: three successes are still needed to close.
    b.record(probes[1], true, half);
    b.record(probes[2], true, half);
    assert_eq!(b.state(half), HalfOpen);
    b.record(again, true, half);
    assert_eq!(b.state(half), Closed);
}

#[test]
fn releasing_a_stale_or_closed_period_permit_changes_nothing() {
    let t0 = Instant::now();
    let b = breaker(10, t0);
    let closed = b.try_acquire(t0).unwrap();
    assert!(!closed.is_probe());
    b.release(closed);
    assert_eq!(b.state(t0), Closed);
    let half = trip(&b, t0) + Duration::from_secs(30);
    let probe = b.try_acquire(half).unwrap();
    // The probes of this period run out and a failure opens it again: the old probe is stale.
    let other = b.try_acquire(half).unwrap();
    b.record(other, false, half);
    let reopened = half + Duration::from_secs(30);
    assert_eq!(b.state(reopened), HalfOpen);
    // A probe of the new period is out when the stale one comes back: handing the stale one
    // back must not free a slot of the new period.
    let current = b.try_acquire(reopened).unwrap();
    assert!(current.is_probe());
    b.release(probe);
    let fresh = (0..4).filter(|_| b.try_acquire(reopened).is_ok()).count();
    assert_eq!(
        fresh, 2,
        "the stale release gave the new period no extra probe"
    );
}

#[test]
fn a_breaker_taking_over_an_open_one_stays_open_until_its_period_ends() {
    let t0 = Instant::now();
    let old = Arc::new(breaker(10, t0));
    let opened = trip(&old, t0);
    let cfg = BreakerConfig {
        min_requests: 5,
        open_for: Duration::from_secs(5),
        half_open_probes: 1,
        ..BreakerConfig::default()
    };
    let new = CircuitBreaker::taking_over(&cfg, &old);
    // Still open under the old period (30 s), not the new `open_for` (5 s).
    assert_eq!(new.state(opened + Duration::from_secs(6)), Open);
    assert!(new.try_acquire(opened + Duration::from_secs(29)).is_err());
    // Then half-open with the new number of probes.
    let after = opened + Duration::from_secs(30);
    assert_eq!(new.state(after), HalfOpen);
    let probe = new.try_acquire(after).unwrap();
    assert!(new.try_acquire(after).is_err());
    new.record(probe, true, after);
    assert_eq!(new.state(after), Closed);
}

#[test]
fn a_breaker_taking_over_a_half_open_one_is_half_open_with_no_probe_out() {
    let t0 = Instant::now();
    let old = Arc::new(breaker(10, t0));
    let opened = trip(&old, t0);
    let after = opened + Duration::from_secs(30);
    let _probe = old.try_acquire(after).unwrap();
    let new = CircuitBreaker::taking_over(&BreakerConfig::default(), &old);
    assert_eq!(new.state(after), HalfOpen);
    for _ in 0..3 {
        assert!(new.try_acquire(after).is_ok());
    }
    assert!(new.try_acquire(after).is_err());
}

#[test]
fn a_breaker_taking_over_a_closed_one_is_closed_and_keeps_its_counts() {
    // A storm seen by a breaker that needs 20 calls; the change asks for 10. The next failure
    // opens it (the 15 already seen count), but not once they have left the window: counts
    // leave no later than they would have.
    let t0 = Instant::now();
    for (after, then) in [(1, Open), (11, Closed)] {
        let old = Arc::new(breaker(20, t0));
        (0..15).for_each(|_| call(&old, false, t0).unwrap());
        let tightened = BreakerConfig {
            min_requests: 10,
            ..BreakerConfig::default()
        };
        let new = CircuitBreaker::taking_over(&tightened, &old);
        assert_eq!(new.state(t0), Closed);
        let at = t0 + Duration::from_secs(after);
        call(&new, false, at).unwrap();
        assert_eq!(new.state(at), then, "{after} s after");
    }
}

/// Settings for a breaker taking over: 5 s open, one probe.
fn short_open() -> BreakerConfig {
    BreakerConfig {
        min_requests: 5,
        open_for: Duration::from_secs(5),
        half_open_probes: 1,
        ..BreakerConfig::default()
    }
}

/// Ten permits of `b`, taken at `t0` by calls that will report failures later.
fn in_flight(b: &CircuitBreaker, t0: Instant) -> Vec<Permit> {
    (0..10).map(|_| b.try_acquire(t0).unwrap()).collect()
}

/// Reports `permits` as failures at `t0` + 1 s; `old` is open then.
fn fail(old: &CircuitBreaker, permits: Vec<Permit>, t0: Instant) -> Instant {
    let at = t0 + Duration::from_secs(1);
    permits.into_iter().for_each(|p| old.record(p, false, at));
    assert_eq!(old.state(at), Open);
    at
}

#[test]
fn a_breaker_taking_over_a_closed_one_opens_by_its_own_rule_on_the_old_calls_failures() {
    let t0 = Instant::now();
    let old = Arc::new(breaker(10, t0));
    let permits = in_flight(&old, t0);
    let new = CircuitBreaker::taking_over(&short_open(), &old);
    assert_eq!(new.state(t0), Closed);
    // The old calls' failures count in the new breaker, which opens at its own fifth, for
    // its own period, and opens the old one with it.
    let opened = fail(&old, permits, t0);
    assert_eq!(new.try_acquire(opened), Err(BreakerOpen));
    assert_eq!(new.state(opened + Duration::from_millis(4_900)), Open);
    assert_eq!(old.try_acquire(opened), Err(BreakerOpen));
    // Then it probes under its own settings (one probe).
    let after = opened + Duration::from_secs(5);
    let probe = new.try_acquire(after).unwrap();
    assert!(probe.is_probe());
    assert_eq!(new.try_acquire(after), Err(BreakerOpen));
    new.record(probe, true, after);
    assert_eq!(new.state(after), Closed);
}

#[test]
fn the_outcomes_of_calls_still_on_a_breaker_taken_over_from_count_in_the_newest() {
    // Settings changed more often than calls end: each breaker's own calls reported only to
    // it, so none reached `min_requests` and the newest never opened.
    let t0 = Instant::now();
    let first = Arc::new(breaker(100, t0));
    let early = in_flight(&first, t0);
    let second = CircuitBreaker::taking_over(&short_open(), &first);
    let later: Vec<Permit> = (0..2).map(|_| second.try_acquire(t0).unwrap()).collect();
    let third = CircuitBreaker::taking_over(&short_open(), &second);
    let at = t0 + Duration::from_secs(1);
    // Three failures of calls on the first, two on the second: five in the newest.
    early
        .into_iter()
        .take(3)
        .for_each(|p| first.record(p, false, at));
    assert_eq!(third.state(at), Closed);
    later.into_iter().for_each(|p| second.record(p, false, at));
    assert_eq!(third.try_acquire(at), Err(BreakerOpen));
    // Its opening reaches the others of the line, as any opening does.
    assert_eq!(first.state(at), Open);
}

#[test]
fn an_opening_of_the_breaker_that_took_over_stops_the_calls_still_on_the_old_one() {
    let t0 = Instant::now();
    let old = Arc::new(breaker(100, t0));
    let new = CircuitBreaker::taking_over(&short_open(), &old);
    let opened = trip(&new, t0);
    // The old breaker, which calls started before the change ask, refuses for the new one's
    // period (5 s), as the new one does.
    assert_eq!(old.try_acquire(opened), Err(BreakerOpen));
    assert_eq!(old.state(opened + Duration::from_millis(4_900)), Open);
    assert_eq!(old.state(opened + Duration::from_secs(5)), HalfOpen);
}

#[test]
fn a_failed_probe_of_the_old_breaker_reopens_a_half_open_new_one_too() {
    // The new breaker, half-open, counts no outcome; the old one's failed probe is the only
    // word on the upstream, and opens both (a closed new one would count it instead, and
    // decide by its own rule: `tests/hand_over_line.rs`).
    let t0 = Instant::now();
    let old = Arc::new(breaker(10, t0));
    let half = trip(&old, t0) + Duration::from_secs(30);
    let probe = old.try_acquire(half).unwrap();
    let new = CircuitBreaker::taking_over(&short_open(), &old);
    assert_eq!(new.state(half), HalfOpen);
    let failed = half + Duration::from_secs(1);
    old.record(probe, false, failed);
    assert_eq!(old.try_acquire(failed), Err(BreakerOpen));
    assert_eq!(new.try_acquire(failed), Err(BreakerOpen));
    assert_eq!(new.state(failed + Duration::from_secs(29)), Open);
}

#[test]
fn a_breaker_already_open_for_longer_keeps_its_own_period() {
    let t0 = Instant::now();
    let old = Arc::new(breaker(10, t0));
    let permits = in_flight(&old, t0);
    let cfg = BreakerConfig {
        min_requests: 1,
        open_for: Duration::from_secs(60),
        ..BreakerConfig::default()
    };
    let new = CircuitBreaker::taking_over(&cfg, &old);
    call(&new, false, t0).unwrap();
    fail(&old, permits, t0);
    // Its own 60 s from t0, not the old one's 30 s from t0 + 1 s.
    assert_eq!(new.state(t0 + Duration::from_secs(45)), Open);
}

#[test]
fn an_opening_goes_down_a_chain_of_hand_overs_even_past_a_dropped_breaker() {
    let t0 = Instant::now();
    for drop_mid in [false, true] {
        let old = Arc::new(breaker(10, t0));
        let permits = in_flight(&old, t0);
        let mid = CircuitBreaker::taking_over(&BreakerConfig::default(), &old);
        // The newest: the old calls' failures count there, past the dropped one.
        let new = CircuitBreaker::taking_over(&short_open(), &mid);
        let mid = (!drop_mid).then_some(mid);
        let opened = fail(&old, permits, t0);
        assert_eq!(new.try_acquire(opened), Err(BreakerOpen), "{drop_mid}");
        assert_eq!(new.state(opened + Duration::from_millis(4_900)), Open);
        if let Some(mid) = mid {
            assert_eq!(mid.try_acquire(opened), Err(BreakerOpen));
        }
    }
}

#[test]
fn an_opening_reaches_every_other_breaker_of_its_line() {
    let t0 = Instant::now();
    let old = Arc::new(breaker(10, t0));
    let first = CircuitBreaker::taking_over(&short_open(), &old);
    let second = CircuitBreaker::taking_over(&BreakerConfig::default(), &old);
    let permits = in_flight(&first, t0);
    let cfg = short_open();
    let at = t0 + Duration::from_secs(1);
    permits
        .into_iter()
        .take(cfg.min_requests as usize)
        .for_each(|p| first.record(p, false, at));
    assert_eq!(first.state(at), Open);
    // `second` came later in the line, `old` earlier: both refuse, for `first`'s period.
    assert_eq!(second.try_acquire(at), Err(BreakerOpen));
    assert_eq!(old.try_acquire(at), Err(BreakerOpen));
    assert_eq!(old.state(at + Duration::from_secs(5)), HalfOpen);
}

#[test]
fn a_breaker_whose_successor_is_gone_opens_as_before() {
    let t0 = Instant::now();
    let old = Arc::new(breaker(10, t0));
    let permits = in_flight(&old, t0);
    drop(CircuitBreaker::taking_over(&short_open(), &old));
    let opened = fail(&old, permits, t0);
    assert_eq!(old.try_acquire(opened), Err(BreakerOpen));
    // And it can still be taken over.
    let new = CircuitBreaker::taking_over(&short_open(), &old);
    assert_eq!(new.state(opened + Duration::from_secs(29)), Open);
}

#[test]
fn a_hand_over_racing_the_opening_of_the_old_breaker_never_misses_it() {
    let t0 = Instant::now();
    let at = t0 + Duration::from_secs(1);
    for _ in 0..200 {
        let old = Arc::new(breaker(10, t0));
        let permits = in_flight(&old, t0);
        let new = std::thread::scope(|s| {
            s.spawn(|| permits.into_iter().for_each(|p| old.record(p, false, at)));
            s.spawn(|| CircuitBreaker::taking_over(&short_open(), &old))
                .join()
                .ok()
        });
        assert_eq!(old.state(at), Open);
        assert!(new.is_some_and(|new| new.state(at) == Open));
    }
}

#[test]
fn a_success_on_a_breaker_whose_successor_is_gone_does_not_touch_the_line_mutex() {
    // Module docs: the line's mutex "is touched only when a breaker takes over or opens, never
    // on an acquire or a success". The agent's short-lived state for a call on an outgoing
    // snapshot takes over from the newest snapshot's breaker; once it is gone, every success
    // of the newest snapshot's calls still locks the line, for good.
    let t0 = Instant::now();
    let kept = Arc::new(breaker(20, t0));
    let short_lived = CircuitBreaker::taking_over(
        &BreakerConfig {
            min_requests: 5,
            ..BreakerConfig::default()
        },
        &kept,
    );
    drop(short_lived);
    // The first outcome after finds the successor gone (one look at the line); none after.
    let p = kept.try_acquire(t0).unwrap();
    kept.record(p, true, t0);
    let guard = kept.line.lock();
    let (tx, rx) = std::sync::mpsc::channel();
    let recorder = {
        let kept = kept.clone();
        std::thread::spawn(move || {
            let p = kept.try_acquire(t0).unwrap();
            kept.record(p, true, t0);
            tx.send(()).unwrap();
        })
    };
    let blocked = rx.recv_timeout(Duration::from_secs(2)).is_err();
    drop(guard);
    recorder.join().unwrap();
    assert!(!blocked, "a success waited for the line's mutex");
}

#[test]
fn a_breaker_left_half_open_with_no_call_is_idle_after_as_long_again_as_its_window_and_open_period()
{
    // Window 10 s, open for 30 s: opened at t0 + 1 s, half-open from t0 + 31 s; idle (a fresh
    // breaker may stand in for it) from t0 + 61 s, when no call came meanwhile.
    let t0 = Instant::now();
    let b = breaker(5, t0);
    let opened = trip(&b, t0);
    assert!(!b.is_idle(opened), "open");
    let half_open = opened + Duration::from_secs(30);
    assert_eq!(b.state(half_open), HalfOpen);
    assert!(!b.is_idle(half_open), "just half-open");
    assert!(!b.is_idle(half_open + Duration::from_secs(29)));
    assert!(b.is_idle(half_open + Duration::from_secs(30)));
    assert_eq!(b.state(half_open + Duration::from_secs(30)), HalfOpen);
    // A probe's outcome within the window keeps it: it is counting.
    let b = breaker(5, t0);
    let opened = trip(&b, t0);
    let probe_at = opened + Duration::from_secs(55);
    call(&b, false, probe_at).unwrap();
    assert_eq!(b.state(probe_at), Open, "the failed probe opens it again");
    assert!(
        !b.is_idle(probe_at + Duration::from_secs(31)),
        "half-open again, just"
    );
    assert!(b.is_idle(probe_at + Duration::from_secs(60)));
}
