//! The simulator against figures computed by hand: each test picks a setting whose result
//! follows from the policy's numbers alone.

// clippy's allow-*-in-tests covers `#[test]` functions only; the helpers here are tests too.
#![allow(clippy::unwrap_used, clippy::panic)]

use std::time::Duration;

use retryplane_policy::{RetryPolicy, load};
use retryplane_sim::{Config, Report, Scenario, Variant, VariantReport, simulate};

/// The policy of endpoint `e` in a file whose only endpoint is `e: {BODY}`.
fn policy(body: &str) -> RetryPolicy {
    let yaml = format!("version: 1\nendpoints:\n  e: {{{body}}}\n");
    let loaded = load(yaml.as_bytes());
    let set = loaded
        .policies
        .unwrap_or_else(|| panic!("{:?}", loaded.diagnostics));
    (*set.endpoint("e").unwrap().policy).clone()
}

fn run(policy: &RetryPolicy, config: &Config) -> Report {
    simulate("e", policy, config).unwrap()
}

fn variant(report: &Report, v: Variant) -> &VariantReport {
    report.variant(v).unwrap()
}

/// A total outage from the first instant to well past the last call.
fn total_outage() -> Scenario {
    Scenario::Outage {
        start: Duration::ZERO,
        len: Duration::from_secs(3600),
    }
}

fn fleet(clients: u32, rate: f64, secs: u64, scenario: Scenario) -> Config {
    Config {
        clients,
        rate,
        duration: Duration::from_secs(secs),
        scenario,
        capacity: 1e9,
        ..Config::default()
    }
}

#[test]
fn a_naive_client_in_a_total_outage_sends_exactly_max_attempts_per_call() {
    let p = policy("max_attempts: 4");
    let report = run(&p, &fleet(50, 2.0, 20, total_outage()));
    let naive = variant(&report, Variant::Naive);
    assert!(naive.logical_calls > 1500, "{}", naive.logical_calls);
    assert_eq!(naive.upstream_attempts, 4 * naive.logical_calls);
    assert_eq!(naive.amplification.overall, 4.0);
    assert_eq!(naive.success_pct, 0.0);
    assert_eq!(naive.give_ups["attempts_exhausted"], naive.logical_calls);
    // Four attempts of 10–30ms each, no pause: well under 4 × 30ms.
    assert!(naive.latency.p99_ms <= 120.0, "{}", naive.latency.p99_ms);
}

#[test]
fn a_naive_client_in_the_default_outage_amplifies_by_max_attempts_during_it() {
    let p = policy("max_attempts: 3");
    let mut config = fleet(200, 1.0, 60, Scenario::default());
    config.capacity = Config::default_capacity(200, 1.0);
    let report = run(&p, &config);
    let naive = variant(&report, Variant::Naive);
    // Only the calls that straddle a second boundary blur the per-second figures.
    let mean = naive.amplification.incident_mean;
    assert!((2.97..=3.0).contains(&mean), "{mean}");
    assert_eq!(naive.recovery_s, Some(0.0));
}

/// Each client has its own budget, so each has its own reserve: `floor(min_per_second ×
/// window)` retries per window, whatever its traffic. Over a run whose retries all happen in
/// `[0, T)`, the reserve can add at most `clients × reserve × ceil(T / window)` retries on top
/// of the ratio's share. The ratio's share stays under 20% of the calls in steady traffic:
/// the budget counts calls over the 10 slots inside the window and retries over the 11
/// slots that cover it, so a client retries at most `0.2 × 10/11` per call in a saturated
/// window.
#[test]
fn a_20_percent_budget_keeps_amplification_within_1_2_plus_each_clients_reserve() {
    let p = policy(
        "max_attempts: 5, backoff: {base: 10ms, max: 100ms}, \
         budget: {ratio: 0.2, min_per_second: 1, window: 10s}, \
         circuit_breaker: {enabled: false}",
    );
    let (clients, secs) = (20u32, 60u64);
    let report = run(&p, &fleet(clients, 20.0, secs, total_outage()));
    let with = variant(&report, Variant::Policy);
    let calls = with.logical_calls as f64;
    // Every retry happens before the last call's deadline: T = 60s + 15s.
    let windows = ((secs as f64 + p.deadline.as_secs_f64()) / 10.0).ceil();
    let reserve = 10.0; // floor(1/s × 10s) per client
    let reserve_share = f64::from(clients) * reserve * windows / calls;
    let bound = 1.2 + reserve_share;
    let got = with.upstream_attempts as f64 / calls;
    assert!(got <= bound, "amplification {got} > {bound}");
    // The budget is what holds it: it refuses most retries, and without it every call makes
    // all five attempts.
    assert!(got > 1.1, "{got}");
    assert!(with.give_ups["budget_exhausted"] as f64 > 0.75 * calls);
    assert_eq!(
        variant(&report, Variant::NoBudget).amplification.overall,
        5.0
    );
}

/// The flip side of a per-client reserve: the built-in `min_per_second: 10` allows 100
/// retries per 10 s window per client, while a client making 1 call/s sends at most
/// `10 × (max_attempts - 1) = 20`. The budget never refuses anything.
#[test]
fn the_default_reserve_does_not_bind_for_a_client_making_one_call_per_second() {
    let p = policy("circuit_breaker: {enabled: false}");
    let report = run(&p, &fleet(100, 1.0, 30, total_outage()));
    let with = variant(&report, Variant::Policy);
    assert_eq!(with.give_ups["budget_exhausted"], 0);
    assert_eq!(with.amplification.overall, 3.0);
    // Every random stream is shared, so the two variants are the same run.
    let without = variant(&report, Variant::NoBudget);
    assert_eq!(with.attempts_per_s, without.attempts_per_s);
    assert_eq!(with.latency, without.latency);
}

#[test]
fn an_error_rate_is_retried_away_as_the_product_of_independent_failures() {
    // p = 0.5, 3 attempts: a call fails with 0.5³ = 12.5% and sends 1 + 0.5 + 0.25 = 1.75.
    let p = policy("max_attempts: 3, circuit_breaker: {enabled: false}, budget: {enabled: false}");
    let report = run(&p, &fleet(100, 5.0, 20, Scenario::ErrorRate { p: 0.5 }));
    let naive = variant(&report, Variant::Naive);
    assert!(
        (naive.success_pct - 87.5).abs() < 1.0,
        "{}",
        naive.success_pct
    );
    let amp = naive.amplification.overall;
    assert!((amp - 1.75).abs() < 0.02, "{amp}");
    // No incident end, so no time to recover.
    assert!(!report.incident.ends_in_run);
    assert!(report.variants.iter().all(|v| v.recovery_s.is_none()));
}

#[test]
fn an_upstream_at_half_the_offered_load_serves_about_half_the_calls() {
    let p = policy("max_attempts: 1");
    let mut config = fleet(100, 10.0, 20, Scenario::ErrorRate { p: 0.0 });
    config.capacity = 500.0;
    let report = run(&p, &config);
    let policy = variant(&report, Variant::Policy);
    assert!(
        (policy.success_pct - 50.0).abs() < 2.0,
        "{}",
        policy.success_pct
    );
}

#[test]
fn a_throttle_spaces_retries_by_its_retry_after_and_the_naive_client_ignores_it() {
    // Two attempts, both 429 with Retry-After: 2s: the pause is max(jittered ≤ 100ms, 2s).
    let p = policy("max_attempts: 2, circuit_breaker: {enabled: false}");
    let scenario = Scenario::Throttle {
        start: Duration::ZERO,
        len: Duration::from_secs(3600),
        retry_after: Duration::from_secs(2),
    };
    let report = run(&p, &fleet(50, 1.0, 20, scenario));
    let with = variant(&report, Variant::Policy);
    // Two answers of 10–30ms around a 2s pause.
    assert!(
        (2020.0..=2060.0).contains(&with.latency.p50_ms),
        "{}",
        with.latency.p50_ms
    );
    assert_eq!(with.give_ups["attempts_exhausted"], with.logical_calls);
    let naive = variant(&report, Variant::Naive);
    assert!(naive.latency.p99_ms <= 60.0, "{}", naive.latency.p99_ms);
}

/// Pauses of 1, 2, 4 and 8 s (`base: 1s`, five attempts) in a 20 s outage at 10 s, 1,000
/// calls per second. Without jitter, the calls that failed in the same second come back in
/// the same second: attempts per call step up to 2 one second into the outage, to 3 at 3 s,
/// 4 at 7 s and 5 at 15 s, so the per-second attempts during the outage average
/// `(1×1 + 2×2 + 3×4 + 4×8 + 5×5) / 20 = 3.7` calls' worth against a peak of 5: peak/mean
/// 5 / 3.7 ≈ 1.35. Full jitter spreads each retry over `[0, ceiling]`, so the load climbs
/// smoothly and sooner, and peak/mean stays lower.
#[test]
fn without_jitter_calls_failed_together_come_back_together_in_spikes() {
    let p = policy(
        "max_attempts: 5, deadline: 30s, backoff: {base: 1s, max: 10s}, \
         circuit_breaker: {enabled: false}, budget: {enabled: false}",
    );
    let outage = Scenario::Outage {
        start: Duration::from_secs(10),
        len: Duration::from_secs(20),
    };
    let report = run(&p, &fleet(200, 5.0, 40, outage));
    let per_call =
        |v: &VariantReport, k: usize| v.attempts_per_s[k] as f64 / v.calls_per_s[k] as f64;
    let peak_to_mean = |v: &VariantReport| {
        let s = &v.attempts_per_s[10..30];
        let mean = s.iter().sum::<u64>() as f64 / s.len() as f64;
        *s.iter().max().unwrap() as f64 / mean
    };
    let none = variant(&report, Variant::NoJitter);
    for (k, level) in [
        (10, 1.0),
        (11, 2.0),
        (12, 2.0),
        (13, 3.0),
        (17, 4.0),
        (25, 5.0),
    ] {
        let got = per_call(none, k);
        assert!(
            (got - level).abs() < 0.15,
            "second {k}: {got} attempts per call, not {level}"
        );
    }
    let full = variant(&report, Variant::Policy);
    // With jitter, half of the first retries already come back in the outage's first second.
    assert!(per_call(full, 10) > 1.3, "{}", per_call(full, 10));
    let (none_ratio, full_ratio) = (peak_to_mean(none), peak_to_mean(full));
    assert!(none_ratio > 1.3, "{none_ratio}");
    assert!(
        none_ratio > full_ratio + 0.1,
        "{none_ratio} vs {full_ratio}"
    );
}

#[test]
fn a_small_fleet_under_its_default_capacity_with_no_errors_succeeds() {
    // The default capacity is 1.5 × the offered load: two thirds busy, no failure asked for.
    for clients in [1, 10] {
        let config = Config {
            clients,
            rate: 1.0,
            duration: Duration::from_secs(600),
            scenario: Scenario::ErrorRate { p: 0.0 },
            capacity: Config::default_capacity(clients, 1.0),
            ..Config::default()
        };
        let report = run(&policy("max_attempts: 3"), &config);
        for v in [Variant::Policy, Variant::Naive] {
            let success = variant(&report, v).success_pct;
            assert!(
                success >= 99.0,
                "{clients} clients, {v:?}: {success}% succeeded"
            );
        }
    }
}
