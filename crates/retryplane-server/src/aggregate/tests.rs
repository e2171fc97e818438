use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use retryplane_proto::pb;
use tokio::time::{Instant, advance};

use super::*;
use crate::fleet::Fleet;
use crate::metrics::ServerMetrics;

/// One report of `calls` calls to `payments` under `version`, from `svc`, now.
fn payments(agg: &Aggregator, svc: &ServiceHandle, version: u64, calls: u64) {
    agg.ingest(
        svc,
        &report(version, &[("payments", calls, 0)]),
        Instant::now(),
    );
}

/// A report under `version` with `(endpoint, calls, retries)` per endpoint.
fn report(version: u64, endpoints: &[(&str, u64, u64)]) -> pb::MetricsReport {
    pb::MetricsReport {
        policy_version: version,
        endpoints: endpoints
            .iter()
            .map(|&(e, calls, retries)| pb::EndpointCounters {
                endpoint: e.to_owned(),
                calls,
                attempts: calls + retries,
                retries,
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

/// An aggregate of 10 series whose series go by the connected agents of `running`, in which
/// `fleet` gives service `checkout`'s as (version, agents running it); and that service's
/// handle.
fn checkout_fleet(fleet: &[(u64, u64)]) -> (Aggregator, ServiceHandle, Arc<AgentsRunning>) {
    let running = Arc::new(AgentsRunning::default());
    for &(version, agents) in fleet {
        for _ in 0..agents {
            running.joined("checkout", version);
        }
    }
    let agg = Aggregator::new(10, Instant::now(), running.clone());
    let svc = agg.service("checkout");
    (agg, svc, running)
}

fn all() -> Filter<'static> {
    Filter::default()
}

fn one<'a>(service: &'a str, endpoint: &'a str) -> Filter<'a> {
    Filter {
        service: Some(service),
        endpoint: Some(endpoint),
        ..Filter::default()
    }
}

/// (calls, covered seconds) of each window of the only series matching `filter`.
fn windows(agg: &Aggregator, filter: Filter<'_>) -> [(u64, f64); 3] {
    let views = agg.views(Instant::now(), filter);
    assert_eq!(views.len(), 1, "{views:?}");
    views[0]
        .windows
        .map(|(c, covered)| (c.0[counts::CALLS], covered))
}

fn calls(agg: &Aggregator, filter: Filter<'_>) -> [u64; 3] {
    windows(agg, filter).map(|(c, _)| c)
}

#[tokio::test(start_paused = true)]
async fn counts_leave_the_1_minute_window_after_60_s_and_the_5_minute_after_300_s() {
    let agg = Aggregator::new(10, Instant::now(), Arc::default());
    let svc = agg.service("checkout");
    agg.ingest(&svc, &report(1, &[("payments", 7, 0)]), Instant::now());
    let f = one("checkout", "payments");
    assert_eq!(calls(&agg, f), [7, 7, 7]);
    advance(Duration::from_secs(59)).await;
    assert_eq!(calls(&agg, f), [7, 7, 7]);
    advance(Duration::from_secs(1)).await;
    assert_eq!(
        calls(&agg, f),
        [0, 7, 7],
        "out of the 1-minute window at 60 s"
    );
    advance(Duration::from_secs(239)).await;
    assert_eq!(calls(&agg, f), [0, 7, 7], "299 s");
    advance(Duration::from_secs(1)).await;
    assert_eq!(
        calls(&agg, f),
        [0, 0, 7],
        "out of the 5-minute window at 300 s"
    );
    advance(Duration::from_secs(599)).await;
    assert_eq!(calls(&agg, f), [0, 0, 7], "899 s");
    advance(Duration::from_secs(1)).await;
    assert_eq!(calls(&agg, f), [0, 0, 0], "out of every window at 900 s");
    let view = &agg.views(Instant::now(), f)[0];
    assert_eq!(view.lifetime.0[counts::CALLS], 7, "the lifetime stays");
}

#[tokio::test(start_paused = true)]
async fn windows_sum_every_bucket_inside_them() {
    let agg = Aggregator::new(10, Instant::now(), Arc::default());
    let svc = agg.service("checkout");
    // One report every 10 s for 20 minutes, 1 call each.
    for _ in 0..120 {
        agg.ingest(&svc, &report(1, &[("payments", 1, 0)]), Instant::now());
        advance(Duration::from_secs(10)).await;
    }
    // Now 1,200 s: the current buckets are empty, 5 fine / 4 coarse / 14 coarse full ones.
    assert_eq!(calls(&agg, all()), [5, 4 * 6, 14 * 6]);
    agg.ingest(&svc, &report(1, &[("payments", 1, 0)]), Instant::now());
    assert_eq!(calls(&agg, all()), [6, 4 * 6 + 1, 14 * 6 + 1]);
}

#[tokio::test(start_paused = true)]
async fn covered_seconds_is_the_time_the_window_spans_and_less_for_a_young_series() {
    let agg = Aggregator::new(10, Instant::now(), Arc::default());
    let svc = agg.service("checkout");
    advance(Duration::from_secs(100)).await;
    agg.ingest(&svc, &report(1, &[("payments", 1, 0)]), Instant::now());
    advance(Duration::from_secs(30)).await;
    // The series is 30 s old: every window covers those 30 s.
    let covered = windows(&agg, all()).map(|(_, s)| s);
    assert_eq!(covered, [30.0, 30.0, 30.0]);
    advance(Duration::from_secs(995)).await;
    // At 1,125 s: the 1-minute window starts at bucket 112 - 5 = 107 (1,070 s): 55 s; the
    // 5-minute window at minute 18 - 4 = 14 (840 s): 285 s; the 15-minute window at minute
    // 18 - 14 = 4 (240 s) but the series began at 100 s: 885 s.
    let covered = windows(&agg, all()).map(|(_, s)| s);
    assert_eq!(covered, [55.0, 285.0, 885.0]);
}

/// `report` with the span an agent gives it: counts made from `start_ms` to `end_ms` (Unix
/// ms on the agent's clock).
fn spanning(mut report: pb::MetricsReport, start_ms: u64, end_ms: u64) -> pb::MetricsReport {
    report.window_start_unix_ms = start_ms;
    report.window_end_unix_ms = end_ms;
    report
}

#[test]
fn a_backlog_at_or_under_the_threshold_never_takes_a_window_past_it() {
    // An agent cut off for 10 or 30 minutes sends one report covering that time, at or under
    // the 5 % threshold. Spread over the buckets of its time, the windows ending now hold the
    // end of it: with calls and retries rounded each on its own, a window could hold one
    // retry more than its share, and a caller of little traffic crossed the threshold by
    // rounding (the alert fired at up to 302 of these 480 arrival times).
    let sizes = [
        (600, 30, 1_800),
        (625, 30, 1_800),
        (1_250, 60, 1_800),
        (10_000, 480, 1_800),
        (300, 14, 600),
        (1_000, 48, 900),
        (1_000, 50, 600),
    ];
    for (calls, retries, span_s) in sizes {
        for step in 0..480_u64 {
            let epoch = Instant::now();
            let agg = Aggregator::new(100, epoch, Arc::default())
                .with_unknown_span(Duration::from_secs(10));
            let svc = agg.service("checkout");
            let now = epoch + Duration::from_millis(3_600_000 + step * 250);
            let end = 1_700_000_000_000;
            let r = spanning(
                report(1, &[("payments", calls, retries)]),
                end - span_s * 1_000,
                end,
            );
            assert_eq!(agg.ingest(&svc, &r, now).count, 0);
            let view = &agg.views(now, all())[0];
            assert_eq!(view.lifetime.0[counts::CALLS], calls);
            assert_eq!(view.lifetime.0[counts::RETRIES], retries);
            for (window, _) in &view.windows {
                let (c, r) = (window.0[counts::CALLS], window.0[counts::RETRIES]);
                assert!(
                    r * calls <= retries * c,
                    "{retries}/{calls} over {span_s} s, {step}: a window holds {r}/{c}"
                );
            }
            assert!(
                !view.alert.firing,
                "{retries}/{calls} over {span_s} s, {step}"
            );
        }
    }
}

#[tokio::test(start_paused = true)]
async fn a_young_series_covers_the_span_of_its_first_report_not_only_its_own_age() {
    let agg = Aggregator::new(10, Instant::now(), Arc::default());
    let svc = agg.service("checkout");
    advance(Duration::from_secs(100)).await;
    // The first report of a new series counts 50 calls made over the agent's last 10 s.
    let first = spanning(report(1, &[("payments", 50, 0)]), 1_000_000, 1_010_000);
    agg.ingest(&svc, &first, Instant::now());
    // At once: 50 calls over 10 s (5 calls/s), not over the instant since it arrived.
    assert_eq!(windows(&agg, all()), [(50, 10.0), (50, 10.0), (50, 10.0)]);
    let version = &agg.stats(Instant::now(), all()).series[0].versions[0];
    assert_eq!(version.windows[0].covered_seconds, 10.0, "{version:?}");
    // Until more time has passed than the first report spans, that span is what is covered.
    advance(Duration::from_secs(5)).await;
    assert_eq!(windows(&agg, all()), [(50, 10.0), (50, 10.0), (50, 10.0)]);

    // An unset start (a client that does not say) or an end before the start gives no span:
    // taken as the interval agents report at (10 s unless the server says), not as the
    // instant since the counts arrived, which would read as a huge rate. A span longer than
    // the longest window counts as that window.
    let unset = spanning(report(1, &[("unset", 1, 0)]), 0, 1_010_000);
    agg.ingest(&svc, &unset, Instant::now());
    assert_eq!(windows(&agg, one("checkout", "unset"))[0], (1, 10.0));
    let backwards = spanning(report(1, &[("backwards", 1, 0)]), 1_010_000, 1_000_000);
    agg.ingest(&svc, &backwards, Instant::now());
    assert_eq!(windows(&agg, one("checkout", "backwards"))[0], (1, 10.0));
    let instant = spanning(report(1, &[("instant", 1, 0)]), 1_010_000, 1_010_000);
    agg.ingest(&svc, &instant, Instant::now());
    assert_eq!(windows(&agg, one("checkout", "instant"))[0], (1, 10.0));
    let told = Aggregator::new(10, Instant::now(), Arc::default())
        .with_unknown_span(Duration::from_secs(30));
    let told_svc = told.service("checkout");
    told.ingest(&told_svc, &unset, Instant::now());
    assert_eq!(windows(&told, all())[0], (1, 30.0));
    let long = spanning(report(1, &[("long", 1, 0)]), 1, 1_010_000);
    agg.ingest(&svc, &long, Instant::now());
    advance(Duration::from_secs(12)).await;
    assert_eq!(windows(&agg, one("checkout", "payments"))[0], (50, 17.0));
    // At 117 s: the 1-minute window reaches back to 60 s, the 5-minute one to 4 minutes
    // before the current one (3 before the epoch), the 15-minute one to 14 minutes before it:
    // as far as each reaches, at most the long report's span (counted as 15 minutes).
    let covered = windows(&agg, one("checkout", "long")).map(|(_, s)| s);
    assert_eq!(covered, [57.0, 180.0 + 117.0, 780.0 + 117.0]);
}

#[tokio::test(start_paused = true)]
async fn a_new_series_fed_by_many_agents_gets_its_rate_right_after_one_interval() {
    // 10 agents report a new endpoint every 10 s, one a second: 10 calls/s each, 100 calls/s
    // in all.
    let agg = Aggregator::new(10, Instant::now(), Arc::default());
    let svc = agg.service("checkout");
    advance(Duration::from_secs(100)).await;
    let mut start_ms = 1_000_000;
    for round in 0..30_u64 {
        if round > 0 {
            advance(Duration::from_secs(1)).await;
        }
        let r = spanning(
            report(1, &[("payments", 100, 0)]),
            start_ms,
            start_ms + 10_000,
        );
        agg.ingest(&svc, &r, Instant::now());
        start_ms += 1_000;
        if round == 9 {
            // Every agent has reported once, 9 s after the first: 1,000 calls over the first
            // report's 10 s.
            assert_eq!(windows(&agg, all())[0], (1_000, 10.0));
        }
    }
    // 3,000 calls since the first report, 29 s ago: 103 calls/s, within one report of 100.
    assert_eq!(windows(&agg, all())[0], (3_000, 29.0));
}

#[tokio::test(start_paused = true)]
async fn reports_just_after_a_restart_cover_the_time_before_it() {
    // The control plane has just started (its epoch), and an agent's first report on the new
    // stream counts the 30 s since its last report to the previous process.
    let agg = Aggregator::new(10, Instant::now(), Arc::default());
    let svc = agg.service("checkout");
    advance(Duration::from_secs(2)).await;
    let first = spanning(report(1, &[("payments", 60, 6)]), 5_000_000, 5_030_000);
    agg.ingest(&svc, &first, Instant::now());
    assert_eq!(windows(&agg, all()), [(60, 30.0), (60, 30.0), (60, 30.0)]);
}

#[tokio::test(start_paused = true)]
async fn counts_are_split_by_policy_version_and_old_versions_are_pruned_after_15_minutes() {
    let agg = Aggregator::new(10, Instant::now(), Arc::default());
    let svc = agg.service("checkout");
    agg.ingest(&svc, &report(1, &[("payments", 3, 1)]), Instant::now());
    advance(Duration::from_secs(30)).await;
    agg.ingest(&svc, &report(2, &[("payments", 5, 0)]), Instant::now());
    let stats = agg.stats(Instant::now(), all());
    let s = &stats.series[0];
    assert_eq!(s.policy_version, 2);
    assert_eq!(
        s.lifetime.as_ref().map(|c| (c.calls, c.retries)),
        Some((8, 1))
    );
    let versions: Vec<(u64, u64, u64)> = s
        .versions
        .iter()
        .map(|v| {
            let l = v.lifetime.unwrap_or_default();
            (v.policy_version, l.calls, l.retries)
        })
        .collect();
    assert_eq!(versions, [(2, 5, 0), (1, 3, 1)], "newest first");
    let v1_minute = s.versions[1].windows[0];
    assert_eq!(v1_minute.window_seconds, 60);
    assert_eq!(v1_minute.counters.map(|c| c.calls), Some(3));
    assert_eq!(
        s.versions[0].windows[0].covered_seconds, 10.0,
        "v2 has just begun: its report's span, unknown, is taken as the interval"
    );

    // Version 2 keeps reporting; version 1 has nothing after 0 s.
    for _ in 0..89 {
        advance(Duration::from_secs(10)).await;
        agg.ingest(&svc, &report(2, &[("payments", 1, 0)]), Instant::now());
    }
    // 920 s: version 1's only bucket (minute 0) left the 15-minute window at 900 s.
    let stats = agg.stats(Instant::now(), all());
    let s = &stats.series[0];
    let listed: Vec<u64> = s.versions.iter().map(|v| v.policy_version).collect();
    assert_eq!(listed, [2]);
    assert_eq!(
        s.lifetime.as_ref().map(|c| c.calls),
        Some(3 + 5 + 89),
        "a pruned version's counts stay in the series lifetime"
    );
}

#[tokio::test(start_paused = true)]
async fn a_version_is_kept_until_its_last_count_leaves_the_15_minute_window() {
    let agg = Aggregator::new(10, Instant::now(), Arc::default());
    let svc = agg.service("checkout");
    agg.ingest(&svc, &report(1, &[("payments", 1, 0)]), Instant::now());
    agg.ingest(&svc, &report(2, &[("payments", 1, 0)]), Instant::now());
    advance(Duration::from_secs(899)).await;
    agg.tick(Instant::now());
    assert_eq!(agg.stats(Instant::now(), all()).series[0].versions.len(), 2);
    advance(Duration::from_secs(1)).await;
    agg.tick(Instant::now());
    assert!(
        agg.stats(Instant::now(), all()).series[0]
            .versions
            .is_empty()
    );
}

/// One agent moves from version to version: past the version bound, of the versions no agent
/// runs any more, the one with the fewest calls per second goes (of these alike, the least
/// recently counted), and its counts stay in the series' windows.
#[tokio::test(start_paused = true)]
async fn past_the_version_bound_a_version_no_agent_runs_goes_but_its_counts_stay() {
    let (agg, svc, running) = checkout_fleet(&[(0, 1)]);
    for version in 1..=(series::MAX_VERSIONS as u64 + 1) {
        running.moved("checkout", version - 1, version);
        agg.ingest(
            &svc,
            &report(version, &[("payments", 1, 0)]),
            Instant::now(),
        );
        advance(Duration::from_secs(1)).await;
    }
    let stats = agg.stats(Instant::now(), all());
    let s = &stats.series[0];
    let listed: Vec<u64> = s.versions.iter().map(|v| v.policy_version).collect();
    assert_eq!(
        listed,
        [5, 4, 3, 2],
        "version 1, which no agent runs, has the fewest calls per second"
    );
    let five = series::MAX_VERSIONS as u64 + 1;
    let window_calls: Vec<u64> = s
        .windows
        .iter()
        .map(|w| w.counters.as_ref().map_or(0, |c| c.calls))
        .collect();
    assert_eq!(window_calls, [five, five, five]);
    // The evicted version's buckets still leave the windows on time.
    advance(Duration::from_secs(900)).await;
    assert_eq!(calls(&agg, all()), [0, 0, 0]);
}

/// A late report of a version evicted before (calls that outlived it, counted as it ended),
/// which no agent runs, is counted in the series' windows without evicting a newer version
/// for it.
#[tokio::test(start_paused = true)]
async fn a_late_report_of_an_evicted_version_evicts_no_newer_one() {
    let (agg, svc, running) = checkout_fleet(&[(0, 1)]);
    for version in 1..=(series::MAX_VERSIONS as u64 + 1) {
        running.moved("checkout", version - 1, version);
        agg.ingest(
            &svc,
            &report(version, &[("payments", 1, 0)]),
            Instant::now(),
        );
        advance(Duration::from_secs(1)).await;
    }
    agg.ingest(&svc, &report(1, &[("payments", 3, 0)]), Instant::now());
    let stats = agg.stats(Instant::now(), all());
    let s = &stats.series[0];
    let listed: Vec<u64> = s.versions.iter().map(|v| v.policy_version).collect();
    assert_eq!(listed, [5, 4, 3, 2], "the kept versions stay");
    let calls: Vec<u64> = s
        .windows
        .iter()
        .map(|w| w.counters.as_ref().map_or(0, |c| c.calls))
        .collect();
    assert_eq!(calls, [8, 8, 8], "the late counts are in the windows");
    assert_eq!(s.lifetime.as_ref().map_or(0, |c| c.calls), 8);
}

#[tokio::test(start_paused = true)]
async fn an_agent_named_like_the_overflow_series_is_counted_in_it() {
    let agg = Aggregator::new(10, Instant::now(), Arc::default());
    let svc = agg.service(OTHER);
    agg.ingest(
        &svc,
        &report(1, &[(OTHER, 4, 1), ("payments", 2, 0)]),
        Instant::now(),
    );
    let stats = agg.stats(Instant::now(), all());
    let labels: Vec<(&str, &str, u64)> = stats
        .series
        .iter()
        .map(|s| {
            let calls = s.lifetime.as_ref().map_or(0, |c| c.calls);
            (s.service.as_str(), s.endpoint.as_str(), calls)
        })
        .collect();
    assert_eq!(labels, [(OTHER, "payments", 2), (OTHER, OTHER, 4)]);
}

#[tokio::test(start_paused = true)]
async fn an_endpoint_named_other_keeps_its_own_totals_and_threshold() {
    let agg = Aggregator::new(10, Instant::now(), Arc::default());
    agg.thresholds()
        .set(HashMap::from([(OTHER.to_owned(), 0.9)]), 0.05);
    let svc = agg.service("checkout");
    agg.ingest(&svc, &report(1, &[(OTHER, 10, 0)]), Instant::now());
    // A name over the bound: counted in the overflow series.
    let long = "x".repeat(300);
    agg.ingest(
        &svc,
        &report(1, &[(long.as_str(), 100, 50)]),
        Instant::now(),
    );
    let stats = agg.stats(Instant::now(), all());
    let totals: Vec<(&str, u64)> = stats
        .endpoints
        .iter()
        .map(|e| (e.endpoint.as_str(), e.calls))
        .collect();
    assert_eq!(
        totals,
        [(OTHER, 10)],
        "the overflow series is no endpoint's"
    );
    let overflow = agg
        .views(Instant::now(), all())
        .into_iter()
        .find(|v| v.service == OTHER)
        .unwrap();
    assert_eq!(overflow.alert.threshold, 0.05, "the default threshold");
}

#[tokio::test(start_paused = true)]
async fn series_past_the_cap_are_counted_in_other() {
    let agg = Aggregator::new(2, Instant::now(), Arc::default());
    let a = agg.service("checkout");
    let now = Instant::now();
    agg.ingest(
        &a,
        &report(1, &[("e1", 1, 0), ("e2", 2, 0), ("e3", 3, 0)]),
        now,
    );
    agg.ingest(&a, &report(1, &[("e3", 4, 0), ("e1", 10, 0)]), now);
    let too_long = "x".repeat(MAX_NAME_LEN + 1);
    agg.ingest(&a, &report(1, &[(too_long.as_str(), 5, 0)]), now);
    assert_eq!(agg.series_count(), 2);
    assert_eq!(agg.overflowed_reports(), 3);
    let stats = agg.stats(now, all());
    let listed: Vec<(&str, &str, u64)> = stats
        .series
        .iter()
        .map(|s| {
            let calls = s.lifetime.as_ref().map_or(0, |c| c.calls);
            (s.service.as_str(), s.endpoint.as_str(), calls)
        })
        .collect();
    assert_eq!(
        listed,
        [
            ("checkout", "e1", 11),
            ("checkout", "e2", 2),
            (OTHER, OTHER, 12)
        ]
    );
    assert_eq!((stats.max_series, stats.overflowed_reports), (2, 3));
    // A service past the cap sends everything to `other`.
    let b = agg.service("search");
    let c = agg.service("ads");
    agg.ingest(&c, &report(1, &[("e1", 100, 0)]), now);
    assert_eq!(agg.overflowed_reports(), 4);
    agg.ingest(&b, &report(1, &[("e9", 1, 0)]), now);
    assert_eq!(
        agg.overflowed_reports(),
        5,
        "the cap is on series, not services"
    );
    // By reason: the too long name, and the rest past the cap.
    assert_eq!(agg.overflowed_by(Overflow::BadName), 1);
    assert_eq!(agg.overflowed_by(Overflow::Cap), 4);
    let stats = agg.stats(now, all());
    assert_eq!(
        (
            stats.overflowed_cap,
            stats.overflowed_bad_name,
            stats.overflowed_service_share
        ),
        (4, 1, 0)
    );
}

#[tokio::test(start_paused = true)]
async fn stats_filter_by_service_and_endpoint_and_sum_endpoints_over_services() {
    let agg = Aggregator::new(10, Instant::now(), Arc::default());
    let now = Instant::now();
    let checkout = agg.service("checkout");
    let search = agg.service("search");
    agg.ingest(
        &checkout,
        &report(1, &[("payments", 2, 1), ("inventory", 1, 0)]),
        now,
    );
    agg.ingest(&search, &report(1, &[("payments", 5, 2)]), now);
    let stats = agg.stats(now, all());
    let endpoints: Vec<(&str, u64, u64)> = stats
        .endpoints
        .iter()
        .map(|e| (e.endpoint.as_str(), e.calls, e.retries))
        .collect();
    assert_eq!(endpoints, [("inventory", 1, 0), ("payments", 7, 3)]);
    let names = |s: &pb::StatsResponse| -> Vec<(String, String)> {
        s.series
            .iter()
            .map(|s| (s.service.clone(), s.endpoint.clone()))
            .collect()
    };
    let pair = |a: &str, b: &str| (a.to_owned(), b.to_owned());
    assert_eq!(
        names(&stats),
        [
            pair("checkout", "inventory"),
            pair("checkout", "payments"),
            pair("search", "payments")
        ]
    );
    let by_endpoint = agg.stats(
        now,
        Filter {
            endpoint: Some("payments"),
            ..Filter::default()
        },
    );
    assert_eq!(
        names(&by_endpoint),
        [pair("checkout", "payments"), pair("search", "payments")]
    );
    assert_eq!(by_endpoint.endpoints.len(), 1);
    let by_service = agg.stats(
        now,
        Filter {
            service: Some("search"),
            ..Filter::default()
        },
    );
    assert_eq!(names(&by_service), [pair("search", "payments")]);
    // The per-endpoint totals cover every service whatever the service filter (the message
    // says "summed over the fleet"); only the endpoint filter narrows them.
    assert_eq!(by_service.endpoints, stats.endpoints);
    assert!(stats.now_unix_ms > 0);
}

#[tokio::test(start_paused = true)]
async fn stats_can_list_only_the_firing_series() {
    let agg = Aggregator::new(10, Instant::now(), Arc::default());
    let svc = agg.service("checkout");
    agg.ingest(
        &svc,
        &report(1, &[("payments", 20, 10), ("inventory", 20, 0)]),
        Instant::now(),
    );
    let firing = agg.stats(
        Instant::now(),
        Filter {
            firing_only: true,
            ..Filter::default()
        },
    );
    let names: Vec<&str> = firing.series.iter().map(|s| s.endpoint.as_str()).collect();
    assert_eq!(names, ["payments"]);
    assert_eq!(firing.endpoints.len(), 2, "the totals are not narrowed");
    assert_eq!(agg.stats(Instant::now(), all()).series.len(), 2);
}

#[tokio::test(start_paused = true)]
async fn a_firing_alert_goes_on_when_the_traffic_drops_but_the_ratio_stays_high() {
    let agg = Aggregator::new(10, Instant::now(), Arc::default());
    let svc = agg.service("checkout");
    let alert = |agg: &Aggregator| agg.views(Instant::now(), all())[0].alert;
    agg.ingest(&svc, &report(1, &[("payments", 20, 10)]), Instant::now());
    assert_eq!(agg.tick(Instant::now()), 1);
    let started = alert(&agg).since_unix_ms;
    // The first 20 calls leave the window; 3 new calls, all retried: below the volume needed
    // to start an alert, but still a ratio far above the threshold.
    advance(Duration::from_secs(200)).await;
    agg.ingest(&svc, &report(1, &[("payments", 3, 3)]), Instant::now());
    advance(Duration::from_secs(110)).await;
    let a = alert(&agg);
    assert!(a.firing, "{a:?}");
    assert_eq!((a.ratio, a.since_unix_ms), (1.0, started));
    // The ratio falls to the threshold: it ends.
    agg.ingest(&svc, &report(1, &[("payments", 57, 0)]), Instant::now());
    assert_eq!(agg.tick(Instant::now()), 0);
    assert!(!alert(&agg).firing);
}

#[tokio::test(start_paused = true)]
async fn an_alert_needs_the_minimum_volume_and_a_ratio_above_the_threshold() {
    let agg = Aggregator::new(10, Instant::now(), Arc::default());
    let svc = agg.service("checkout");
    let alert = |agg: &Aggregator| agg.views(Instant::now(), all())[0].alert;
    // 19 retries in 19 calls: a ratio of 1, but below the minimum volume.
    agg.ingest(&svc, &report(1, &[("payments", 19, 19)]), Instant::now());
    agg.tick(Instant::now());
    assert!(!alert(&agg).firing);
    assert_eq!(alert(&agg).ratio, 1.0);
    // 20 calls: it starts.
    agg.ingest(&svc, &report(1, &[("payments", 1, 0)]), Instant::now());
    assert_eq!(agg.tick(Instant::now()), 1);
    let a = alert(&agg);
    assert!(a.firing && a.since_unix_ms > 0, "{a:?}");
    assert_eq!((a.ratio, a.threshold), (19.0 / 20.0, 0.05));
    assert_eq!(agg.alerting_endpoints(Instant::now()), ["payments"]);
    // It stays firing with the same start while the window holds the retries.
    advance(Duration::from_secs(200)).await;
    assert_eq!(alert(&agg).since_unix_ms, a.since_unix_ms);
    // Once the retries leave the 5-minute window, it ends.
    advance(Duration::from_secs(100)).await;
    assert_eq!(agg.tick(Instant::now()), 0);
    let ended = alert(&agg);
    assert!(!ended.firing);
    assert_eq!((ended.ratio, ended.since_unix_ms), (0.0, 0));
    assert!(agg.alerting_endpoints(Instant::now()).is_empty());
}

#[tokio::test(start_paused = true)]
async fn the_threshold_is_exclusive_and_follows_the_published_thresholds() {
    let agg = Aggregator::new(10, Instant::now(), Arc::default());
    let svc = agg.service("checkout");
    let firing = |agg: &Aggregator| agg.views(Instant::now(), all())[0].alert.firing;
    agg.ingest(&svc, &report(1, &[("payments", 100, 5)]), Instant::now());
    assert!(!firing(&agg), "5 % is not above 5 %");
    agg.ingest(&svc, &report(1, &[("payments", 0, 1)]), Instant::now());
    assert!(firing(&agg), "6 %");
    agg.thresholds()
        .set(HashMap::from([("payments".to_owned(), 0.10)]), 0.05);
    assert!(!firing(&agg), "a threshold of 10 % ends it");
    assert_eq!(agg.views(Instant::now(), all())[0].alert.threshold, 0.10);
    let doc = pb::PolicyDocument {
        endpoints: vec![pb::Endpoint {
            name: "payments".to_owned(),
            ..Default::default()
        }],
        ..Default::default()
    };
    agg.thresholds().set_from(&doc);
    assert!(firing(&agg), "back to the default");
}

#[test]
fn thresholds_come_from_the_published_alert_retry_ratio() {
    let alert = |ratio: f64| pb::Overlay {
        alert: Some(pb::Alert {
            retry_ratio: Some(ratio),
        }),
        ..Default::default()
    };
    let doc = pb::PolicyDocument {
        defaults: Some(alert(0.02)),
        endpoints: vec![
            pb::Endpoint {
                name: "payments".to_owned(),
                overlay: Some(alert(0.2)),
                ..Default::default()
            },
            pb::Endpoint {
                name: "search".to_owned(),
                ..Default::default()
            },
        ],
    };
    let agg = Aggregator::new(10, Instant::now(), Arc::default());
    agg.thresholds().set_from(&doc);
    assert_eq!(agg.thresholds().get("payments"), 0.2, "the endpoint's own");
    assert_eq!(agg.thresholds().get("search"), 0.02, "from defaults");
    assert_eq!(
        agg.thresholds().get("unnamed"),
        0.02,
        "endpoints the file does not name"
    );
    agg.thresholds().set_from(&pb::PolicyDocument {
        endpoints: vec![pb::Endpoint {
            name: "payments".to_owned(),
            ..Default::default()
        }],
        ..Default::default()
    });
    assert_eq!(agg.thresholds().get("payments"), 0.05, "built-in");
}

#[test]
fn concurrent_ingestion_loses_no_count() {
    let agg = Arc::new(Aggregator::new(100, Instant::now(), Arc::default()));
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let agg = agg.clone();
            std::thread::spawn(move || {
                let svc = agg.service(if t % 2 == 0 { "a" } else { "b" });
                for i in 0..2_000u64 {
                    let e = format!("e{}", i % 7);
                    agg.ingest(&svc, &report(i % 3, &[(e.as_str(), 1, 1)]), Instant::now());
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let stats = agg.stats(Instant::now(), all());
    let total: u64 = stats.endpoints.iter().map(|e| e.calls).sum();
    assert_eq!(total, 8_000);
    assert_eq!(stats.series.len(), 14);
    assert_eq!(agg.series_count(), 14);
}

fn metrics_text(agg: &Arc<Aggregator>, fleet: &Arc<Fleet>) -> String {
    ServerMetrics::with_aggregates(agg.clone(), fleet.clone()).render()
}

#[tokio::test(start_paused = true)]
async fn prometheus_lines_are_exact() {
    let agg = Arc::new(Aggregator::new(10, Instant::now(), Arc::default()));
    let fleet = Arc::new(Fleet::new(10));
    let svc = agg.service("checkout");
    let counters = pb::EndpointCounters {
        endpoint: "payments".to_owned(),
        calls: 40,
        attempts: 52,
        retries: 12,
        success_first_try: 30,
        success_after_retry: 6,
        gave_up_attempts: 1,
        gave_up_budget: 2,
        gave_up_deadline: 3,
        gave_up_retry_after: 4,
        gave_up_not_retryable: 5,
        circuit_open: 7,
        backoff_ms: 1_500,
        retry_after_honored: 8,
        cancelled: 9,
    };
    let r = pb::MetricsReport {
        policy_version: 3,
        endpoints: vec![counters],
        ..Default::default()
    };
    agg.ingest(&svc, &r, Instant::now());
    advance(Duration::from_secs(70)).await;
    agg.ingest(&svc, &report(3, &[("payments", 10, 0)]), Instant::now());
    let hello = |id: &str, version| pb::Hello {
        agent_id: id.to_owned(),
        service: "checkout".to_owned(),
        last_applied_version: version,
        ..Default::default()
    };
    let serving = Some((3, "h3"));
    fleet.register(&hello("a", 3), None, serving).unwrap();
    let b = fleet.register(&hello("b", 2), None, serving).unwrap();
    fleet.nack("b", b.generation, 3, "h3", "bad");
    // Nothing published yet: no agent is behind.
    assert!(
        metrics_text(&agg, &fleet)
            .lines()
            .any(|l| l == "retryplane_agents_behind 0")
    );
    agg.set_published(3);
    let text = metrics_text(&agg, &fleet);
    let l = r#"{service="checkout",endpoint="payments"}"#;
    let expected = [
        "# TYPE retryplane_calls counter".to_owned(),
        format!("retryplane_calls_total{l} 50"),
        format!("retryplane_attempts_total{l} 62"),
        format!("retryplane_retries_total{l} 12"),
        format!("retryplane_success_first_try_total{l} 30"),
        format!("retryplane_success_after_retry_total{l} 6"),
        format!("retryplane_circuit_open_total{l} 7"),
        format!("retryplane_retry_after_honored_total{l} 8"),
        format!("retryplane_cancelled_total{l} 9"),
        r#"retryplane_giveups_total{service="checkout",endpoint="payments",cause="attempts_exhausted"} 1"#.to_owned(),
        r#"retryplane_giveups_total{service="checkout",endpoint="payments",cause="budget_exhausted"} 2"#.to_owned(),
        r#"retryplane_giveups_total{service="checkout",endpoint="payments",cause="deadline_exceeded"} 3"#.to_owned(),
        r#"retryplane_giveups_total{service="checkout",endpoint="payments",cause="retry_after_too_long"} 4"#.to_owned(),
        r#"retryplane_giveups_total{service="checkout",endpoint="payments",cause="not_retryable"} 5"#.to_owned(),
        "# TYPE retryplane_backoff_seconds counter".to_owned(),
        "# UNIT retryplane_backoff_seconds seconds".to_owned(),
        format!("retryplane_backoff_seconds_total{l} 1.5"),
        // 1 minute: only the second report (10 calls, no retries); 5 and 15: 12 / 50.
        r#"retryplane_retry_ratio{service="checkout",endpoint="payments",window="1m"} 0.0"#.to_owned(),
        r#"retryplane_retry_ratio{service="checkout",endpoint="payments",window="5m"} 0.24"#.to_owned(),
        r#"retryplane_retry_ratio{service="checkout",endpoint="payments",window="15m"} 0.24"#.to_owned(),
        format!("retryplane_retry_ratio_threshold{l} 0.05"),
        format!("retryplane_retry_ratio_alert{l} 1.0"),
        "retryplane_metrics_series 1".to_owned(),
        "retryplane_metrics_max_series 10".to_owned(),
        r#"retryplane_metrics_overflowed_reports_total{reason="series_cap"} 0"#.to_owned(),
        r#"retryplane_metrics_overflowed_reports_total{reason="bad_name"} 0"#.to_owned(),
        r#"retryplane_metrics_overflowed_reports_total{reason="service_share"} 0"#.to_owned(),
        r#"retryplane_agents{applied_version="2"} 1"#.to_owned(),
        r#"retryplane_agents{applied_version="3"} 1"#.to_owned(),
        r#"retryplane_agents_nacked{version="3"} 1"#.to_owned(),
        "retryplane_agents_behind 1".to_owned(),
        "retryplane_server_nacks_total 0".to_owned(),
    ];
    let lines: Vec<&str> = text.lines().collect();
    for line in &expected {
        assert!(
            lines.contains(&line.as_str()),
            "missing {line:?} in\n{text}"
        );
    }
    assert!(text.ends_with("# EOF\n"), "{text}");
}

#[tokio::test(start_paused = true)]
async fn label_values_from_agents_are_escaped() {
    let agg = Arc::new(Aggregator::new(10, Instant::now(), Arc::default()));
    let svc = agg.service("we\"ird");
    // (A name with a control character, `\n` included, is counted in `other`.)
    agg.ingest(&svc, &report(1, &[("a\\b\"c", 1, 0)]), Instant::now());
    let text = metrics_text(&agg, &Arc::new(Fleet::new(1)));
    let line = r#"retryplane_calls_total{service="we\"ird",endpoint="a\\b\"c"} 1"#;
    assert!(text.lines().any(|l| l == line), "{text}");
}

#[tokio::test(start_paused = true)]
async fn the_ticker_stops_on_shutdown() {
    let agg = Arc::new(Aggregator::new(10, Instant::now(), Arc::default()));
    let (tx, rx) = tokio::sync::watch::channel(false);
    let task = spawn_ticker(agg, TICK, rx);
    advance(TICK * 3).await;
    assert!(!task.is_finished());
    tx.send_replace(true);
    tokio::time::timeout(Duration::from_secs(1), task)
        .await
        .unwrap()
        .unwrap();
}

#[test]
fn memory_per_series_follows_the_layout() {
    let agg = Aggregator::new(1_000, Instant::now(), Arc::default());
    let empty = agg.approx_bytes();
    let svc = agg.service("checkout");
    for i in 0..100 {
        let e = format!("endpoint-{i:03}");
        agg.ingest(&svc, &report(1, &[(e.as_str(), 1, 0)]), Instant::now());
    }
    let per_series = (agg.approx_bytes() - empty) / 100;
    // One version's rings (2 × 2,520 bytes would mean a second copy) plus totals and names.
    assert!((2_400..3_400).contains(&per_series), "{per_series}");
}

#[test]
fn memory_of_a_series_is_bounded_whatever_versions_agents_report() {
    // One agent moves through a thousand versions: each evicts one no agent runs any more.
    let (agg, svc, running) = checkout_fleet(&[(0, 1)]);
    agg.ingest(&svc, &report(0, &[("payments", 1, 0)]), Instant::now());
    let one = agg.approx_bytes();
    for version in 1..1_000 {
        running.moved("checkout", version - 1, version);
        agg.ingest(
            &svc,
            &report(version, &[("payments", 1, 0)]),
            Instant::now(),
        );
    }
    let most = agg.approx_bytes();
    // MAX_VERSIONS version entries and one retired ring pair, never more.
    assert!(most - one < series::MAX_VERSIONS * 2_800, "{one} -> {most}");
    let listed = listed(&agg);
    assert_eq!(
        listed,
        [999, 998, 997, 996],
        "the newest evict the ones no agent runs"
    );
}

#[tokio::test(start_paused = true)]
async fn a_limit_keeps_the_worst_series_over_the_chosen_window() {
    let agg = Aggregator::new(10, Instant::now(), Arc::default());
    let svc = agg.service("checkout");
    agg.ingest(
        &svc,
        &report(
            1,
            &[("a", 20, 10), ("b", 10, 1), ("c", 10, 0), ("d", 20, 0)],
        ),
        Instant::now(),
    );
    advance(Duration::from_secs(61)).await;
    // Over the last minute only `b` had calls (ratio 0.9); over five minutes `a` and `b` are
    // at 0.5 (both alerts fire), `c` and `d` at 0.
    agg.ingest(&svc, &report(1, &[("b", 10, 9)]), Instant::now());
    let ranked = |count, window| {
        let stats = agg.stats_limited(Instant::now(), all(), Some(Limit { count, window }), false);
        let names: Vec<String> = stats.series.iter().map(|s| s.endpoint.clone()).collect();
        (names, stats.matched_series, stats.firing_series)
    };
    use window::Window::{FiveMinutes, OneMinute};
    // No calls in the minute: after `b`, firing `a` first, then by name.
    assert_eq!(
        ranked(10, OneMinute),
        (vec!["b".into(), "a".into(), "c".into(), "d".into()], 4, 2)
    );
    assert_eq!(ranked(2, OneMinute), (vec!["b".into(), "a".into()], 4, 2));
    // Equal ratios: by name (both fire).
    assert_eq!(
        ranked(3, FiveMinutes),
        (vec!["a".into(), "b".into(), "c".into()], 4, 2)
    );
    // Without a limit: every series, by service then endpoint, the same counts.
    let all_of = agg.stats(Instant::now(), all());
    let names: Vec<&str> = all_of.series.iter().map(|s| s.endpoint.as_str()).collect();
    assert_eq!(names, ["a", "b", "c", "d"]);
    assert_eq!((all_of.matched_series, all_of.firing_series), (4, 2));
    // The limit applies after the filters; the totals per endpoint are not narrowed.
    let firing = agg.stats_limited(
        Instant::now(),
        Filter {
            firing_only: true,
            ..Filter::default()
        },
        Some(Limit {
            count: 1,
            window: OneMinute,
        }),
        false,
    );
    assert_eq!(firing.series.len(), 1);
    assert_eq!(firing.series[0].endpoint, "b");
    assert_eq!((firing.matched_series, firing.firing_series), (2, 2));
    assert_eq!(firing.endpoints.len(), 4);
    let series_only = agg.stats_limited(Instant::now(), all(), None, true);
    assert!(series_only.endpoints.is_empty());
    assert_eq!(series_only.series.len(), 4);
}

#[tokio::test(start_paused = true)]
async fn names_with_control_characters_are_counted_in_other() {
    let agg = Aggregator::new(10, Instant::now(), Arc::default());
    let a = agg.service("checkout");
    let now = Instant::now();
    agg.ingest(
        &a,
        &report(1, &[("ep\u{1b}[31mX", 1, 0), ("ok", 2, 0), ("a\nb", 4, 0)]),
        now,
    );
    let bad = agg.service("svc\u{7}");
    agg.ingest(&bad, &report(1, &[("ok", 8, 0)]), now);
    assert_eq!(agg.overflowed_reports(), 3);
    let stats = agg.stats(now, all());
    let listed: Vec<(&str, &str, u64)> = stats
        .series
        .iter()
        .map(|s| {
            let calls = s.lifetime.as_ref().map_or(0, |c| c.calls);
            (s.service.as_str(), s.endpoint.as_str(), calls)
        })
        .collect();
    assert_eq!(listed, [("checkout", "ok", 2), (OTHER, OTHER, 13)]);
}

#[tokio::test(start_paused = true)]
async fn the_overflow_series_firing_names_no_alerting_endpoint() {
    // Retries under a name that goes to `other`, and a quiet endpoint really named `other`:
    // the overflow series fires, but no endpoint is alerting.
    let agg = Aggregator::new(10, Instant::now(), Arc::default());
    let svc = agg.service("checkout");
    agg.ingest(
        &svc,
        &report(1, &[("bad\u{7}name", 100, 100), (OTHER, 100, 0)]),
        Instant::now(),
    );
    assert_eq!(agg.tick(Instant::now()), 1);
    let views = agg.views(Instant::now(), all());
    let firing: Vec<(&str, &str)> = views
        .iter()
        .filter(|v| v.alert.firing)
        .map(|v| (v.service.as_str(), v.endpoint.as_str()))
        .collect();
    assert_eq!(firing, [(OTHER, OTHER)]);
    assert!(agg.alerting_endpoints(Instant::now()).is_empty());
    // The endpoint named `other` is listed once its own series fires.
    agg.ingest(&svc, &report(1, &[(OTHER, 0, 100)]), Instant::now());
    assert_eq!(agg.alerting_endpoints(Instant::now()), [OTHER]);
}

#[tokio::test(start_paused = true)]
async fn a_service_named_other_retrying_an_endpoint_named_other_is_alerting() {
    // That pair is counted in the overflow series (the same labels), which then stands for
    // the endpoint too.
    let agg = Aggregator::new(10, Instant::now(), Arc::default());
    let svc = agg.service(OTHER);
    agg.ingest(&svc, &report(1, &[(OTHER, 100, 100)]), Instant::now());
    assert_eq!(agg.tick(Instant::now()), 1);
    assert_eq!(agg.alerting_endpoints(Instant::now()), [OTHER]);
    // Once that pair is out of the alert's window, the overflow series firing for other
    // services' bad names lists no endpoint again.
    advance(Duration::from_secs(6 * 60)).await;
    let checkout = agg.service("checkout");
    agg.ingest(
        &checkout,
        &report(1, &[("bad\u{7}name", 100, 100)]),
        Instant::now(),
    );
    assert_eq!(agg.tick(Instant::now()), 1);
    assert!(agg.alerting_endpoints(Instant::now()).is_empty());
}

#[tokio::test(start_paused = true)]
async fn the_endpoint_other_is_no_longer_listed_once_its_bucket_left_the_window() {
    // The window is whole-minute buckets: a count leaves it 4 to 5 minutes after it came.
    let agg = Aggregator::new(10, Instant::now(), Arc::default());
    advance(Duration::from_secs(59)).await;
    let svc = agg.service(OTHER);
    agg.ingest(&svc, &report(1, &[(OTHER, 100, 100)]), Instant::now());
    agg.tick(Instant::now());
    assert_eq!(agg.alerting_endpoints(Instant::now()), [OTHER]);
    advance(Duration::from_secs(4 * 60)).await;
    assert_eq!(agg.alerting_endpoints(Instant::now()), [OTHER]);
    advance(Duration::from_secs(1)).await;
    let checkout = agg.service("checkout");
    agg.ingest(
        &checkout,
        &report(1, &[("bad\u{7}name", 100, 100)]),
        Instant::now(),
    );
    agg.tick(Instant::now());
    assert!(agg.alerting_endpoints(Instant::now()).is_empty());
}

#[test]
fn a_bad_endpoint_name_is_logged_escaped_and_does_not_hide_the_cap_warning() {
    let (log, _guard) = crate::test_logs::capture("retryplane_server=warn");
    let text = || log.text();

    let agg = Aggregator::new(1, Instant::now(), Arc::default());
    let svc = agg.service("checkout");
    let forged = "x\n2026-01-01T00:00:00Z  INFO retryplane_server: all good";
    agg.ingest(&svc, &report(1, &[(forged, 1, 0)]), Instant::now());
    agg.ingest(&svc, &report(1, &[("payments", 1, 0)]), Instant::now());
    agg.ingest(&svc, &report(1, &[("search", 1, 0)]), Instant::now());
    assert_eq!(agg.overflowed_reports(), 2);

    let text = text();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2, "{text}");
    assert!(
        lines[0].contains(" WARN ") && lines[0].contains(r"x\n2026-01-01T00:00:00Z  INFO"),
        "{text}"
    );
    assert!(
        lines[1].contains(" WARN ")
            && lines[1].contains("metrics series cap reached")
            && lines[1].contains("search"),
        "{text}"
    );
}

#[tokio::test(start_paused = true)]
async fn counts_no_agent_could_make_are_left_out_and_the_rest_of_the_report_counts() {
    let agg = Aggregator::new(10, Instant::now(), Arc::default());
    let svc = agg.service("checkout");
    // A report over 10 s of the agent's clock: an hour's worth at the bound is believed for a
    // report without a start, a minute's worth for a shorter span.
    let mut r = spanning(
        report(1, &[("payments", 7, 1), ("stock", u64::MAX, 0)]),
        1_000_000,
        1_010_000,
    );
    let refused = agg.ingest(&svc, &r, Instant::now());
    assert_eq!((refused.count, refused.first), (1, Some("stock")));
    let minute = counts::MAX_PER_SECOND * 60;
    r.endpoints[1].calls = minute;
    r.endpoints[1].attempts = minute;
    r.endpoints[1].backoff_ms = minute * 1_000;
    assert_eq!(
        agg.ingest(&svc, &r, Instant::now()).count,
        0,
        "at the bound"
    );
    r.endpoints[1].retries = minute + 1;
    assert_eq!(agg.ingest(&svc, &r, Instant::now()).count, 1, "past it");
    r.endpoints[1].retries = 0;
    r.endpoints[1].backoff_ms = minute * 1_000 + 1;
    assert_eq!(
        agg.ingest(&svc, &r, Instant::now()).count,
        1,
        "backoff past it"
    );
    // Without a start, the bound is an hour's worth.
    r.window_start_unix_ms = 0;
    r.endpoints[1].backoff_ms = 0;
    r.endpoints[1].calls = counts::MAX_PER_SECOND * 3_600;
    r.endpoints[1].attempts = r.endpoints[1].calls;
    assert_eq!(agg.ingest(&svc, &r, Instant::now()).count, 0);
    r.endpoints[1].calls += 1;
    assert_eq!(agg.ingest(&svc, &r, Instant::now()).count, 1);

    let stats = agg.stats(Instant::now(), all());
    let lifetime = |endpoint: &str| {
        stats
            .series
            .iter()
            .find(|s| s.endpoint == endpoint)
            .and_then(|s| s.lifetime)
            .map(|c| c.calls)
    };
    assert_eq!(
        lifetime("payments"),
        Some(7 * 6),
        "every report counted here"
    );
    assert_eq!(
        lifetime("stock"),
        Some(minute + counts::MAX_PER_SECOND * 3_600),
        "only the two reports at the bound"
    );
    // A name repeated in one report, to pass the bound once per copy: the repeats are out.
    let twice = report(1, &[("search", 5, 0), ("search", 7, 0), ("search", 9, 0)]);
    let refused = agg.ingest(&svc, &twice, Instant::now());
    assert_eq!(
        (refused.count, refused.repeated, refused.first),
        (2, 2, Some("search"))
    );
    let stats = agg.stats(Instant::now(), one("checkout", "search"));
    assert_eq!(stats.series[0].lifetime.map(|c| c.calls), Some(5));
    // Past the cap, counts in `other` are checked the same way.
    let far = agg.service(&"x".repeat(MAX_NAME_LEN + 1));
    let huge = report(1, &[("a", u64::MAX, 0)]);
    assert_eq!(agg.overflowed_by(Overflow::BadName), 0);
    // An empty endpoint name names nothing: counted in `other`.
    agg.ingest(&svc, &report(1, &[("", 3, 0)]), Instant::now());
    assert_eq!(agg.overflowed_by(Overflow::BadName), 1);
    assert_eq!(agg.overflowed_reports(), 1);
    assert_eq!(agg.ingest(&far, &huge, Instant::now()).count, 1);
    assert_eq!(agg.overflowed_reports(), 1, "the empty name's only");
}

#[tokio::test(start_paused = true)]
async fn a_version_number_no_longer_reported_leaves_the_series_with_its_counts() {
    let agg = Aggregator::new(10, Instant::now(), Arc::default());
    let svc = agg.service("checkout");
    agg.ingest(&svc, &report(3, &[("payments", 1, 0)]), Instant::now());
    agg.ingest(
        &svc,
        &report(u64::MAX, &[("payments", 1, 0)]),
        Instant::now(),
    );
    let version = |agg: &Aggregator| agg.stats(Instant::now(), all()).series[0].policy_version;
    assert_eq!(version(&agg), u64::MAX);
    for _ in 0..100 {
        advance(Duration::from_secs(10)).await;
        agg.ingest(&svc, &report(3, &[("payments", 1, 0)]), Instant::now());
    }
    assert_eq!(
        version(&agg),
        3,
        "the bogus version left the 15-minute window"
    );
    // With nothing reported for longer than the window, the series keeps the last newest.
    advance(Duration::from_secs(1_000)).await;
    assert_eq!(version(&agg), 3);
    agg.ingest(&svc, &report(2, &[("payments", 1, 0)]), Instant::now());
    assert_eq!(version(&agg), 2, "the only version with counts now");
}

/// Past its share, a report's further endpoints go to `other` summed: every entry counted as
/// overflowed, every call in `other`, and a bad name among them still counted as such.
#[tokio::test(start_paused = true)]
async fn the_endpoints_past_a_share_go_to_other_summed_and_counted_each() {
    let agg = Aggregator::new(100, Instant::now(), Arc::default()).with_max_per_service(2);
    let urls = agg.service("crawler");
    let now = Instant::now();
    let long = "x".repeat(MAX_NAME_LEN + 1);
    let mut paths: Vec<String> = (0..50).map(|i| format!("/items/{i}")).collect();
    paths.insert(10, long);
    let entries: Vec<(&str, u64, u64)> = paths.iter().map(|p| (p.as_str(), 3, 1)).collect();
    agg.ingest(&urls, &report(1, &entries), now);
    assert_eq!(agg.series_count(), 2);
    assert_eq!(agg.overflowed_by(Overflow::ServiceShare), 48);
    assert_eq!(agg.overflowed_by(Overflow::BadName), 1);
    let stats = agg.stats(now, all());
    let other = stats.series.iter().find(|s| s.service == OTHER);
    let lifetime = other.and_then(|s| s.lifetime);
    assert_eq!(lifetime.map(|c| (c.calls, c.retries)), Some((49 * 3, 49)));
}

#[tokio::test(start_paused = true)]
async fn one_service_takes_at_most_its_share_of_the_series() {
    let agg = Aggregator::new(10, Instant::now(), Arc::default()).with_max_per_service(3);
    let urls = agg.service("crawler");
    let now = Instant::now();
    let paths: Vec<String> = (0..6).map(|i| format!("/items/{i}")).collect();
    let entries: Vec<(&str, u64, u64)> = paths.iter().map(|p| (p.as_str(), 1, 0)).collect();
    agg.ingest(&urls, &report(1, &entries), now);
    assert_eq!(agg.series_count(), 3);
    assert_eq!(agg.overflowed_reports(), 3);
    assert_eq!(agg.overflowed_by(Overflow::ServiceShare), 3);
    assert_eq!(agg.overflowed_by(Overflow::Cap), 0);
    // Its endpoints already kept go on counting; the other services keep their room.
    agg.ingest(&urls, &report(1, &entries[..1]), now);
    let checkout = agg.service("checkout");
    agg.ingest(
        &checkout,
        &report(1, &[("payments", 5, 0), ("stock", 2, 0)]),
        now,
    );
    assert_eq!(agg.series_count(), 5);
    assert_eq!(agg.overflowed_reports(), 3);
    let stats = agg.stats(now, all());
    let other = stats.series.iter().find(|s| s.service == OTHER);
    assert_eq!(other.and_then(|s| s.lifetime).map(|c| c.calls), Some(3));
    let first = stats.series.iter().find(|s| s.endpoint == "/items/0");
    assert_eq!(first.and_then(|s| s.lifetime).map(|c| c.calls), Some(2));
}

/// An endpoint renamed now and then (`pay-v1` → `pay-v2` → …): the names no longer reported
/// give their place back, so the endpoint called today gets its own series, stats and alert
/// rather than `other`, once the service's share has been used over time.
#[tokio::test(start_paused = true)]
async fn series_not_reported_for_the_forget_time_give_their_place_to_todays_names() {
    let agg = Aggregator::new(10_000, Instant::now(), Arc::default()).with_max_per_service(3);
    let svc = agg.service("checkout");
    for name in ["pay-v1", "pay-v2", "pay-v3"] {
        agg.ingest(&svc, &report(1, &[(name, 100, 0)]), Instant::now());
        advance(Duration::from_secs(20 * 60)).await;
        agg.tick(Instant::now());
    }
    // `pay-v1` was last reported an hour ago: forgotten; the two others are kept.
    advance(Duration::from_secs(1)).await;
    agg.tick(Instant::now());
    assert_eq!(agg.series_count(), 2);
    // Today's endpoint, in a retry storm: 50 % retries over 1,000 calls.
    for _ in 0..10 {
        agg.ingest(&svc, &report(1, &[("pay-v4", 100, 50)]), Instant::now());
        advance(Duration::from_secs(10)).await;
    }
    agg.tick(Instant::now());
    let now = Instant::now();
    let series: Vec<String> = agg
        .stats(now, all())
        .series
        .iter()
        .map(|s| format!("{}/{}", s.service, s.endpoint))
        .collect();
    assert_eq!(
        series,
        ["checkout/pay-v2", "checkout/pay-v3", "checkout/pay-v4"],
        "{} reports went to `other`",
        agg.overflowed_reports()
    );
    assert_eq!(agg.overflowed_reports(), 0);
    assert_eq!(agg.alerting_endpoints(now), ["pay-v4"]);
    // A name reported again starts a new series from zero.
    agg.ingest(&svc, &report(1, &[("pay-v3", 7, 0)]), now);
    let v3 = agg.stats(now, one("checkout", "pay-v3"));
    assert_eq!(
        v3.series[0].lifetime.map(|c| c.calls),
        Some(107),
        "pay-v3 was kept"
    );
}

#[tokio::test(start_paused = true)]
async fn a_series_reported_within_the_forget_time_is_kept_and_a_service_a_stream_holds_too() {
    let agg = Aggregator::new(10, Instant::now(), Arc::default())
        .with_forget_after(Duration::from_secs(1));
    // Never less than the floor: one second is taken as 20 minutes.
    let held = agg.service("checkout");
    let gone = agg.service("batch");
    agg.ingest(&held, &report(1, &[("payments", 100, 0)]), Instant::now());
    agg.ingest(&gone, &report(1, &[("ledger", 100, 0)]), Instant::now());
    drop(gone);
    advance(MIN_FORGET_SERIES_AFTER - Duration::from_secs(1)).await;
    agg.tick(Instant::now());
    assert_eq!(agg.series_count(), 2, "kept until the floor");
    advance(Duration::from_secs(1)).await;
    agg.tick(Instant::now());
    assert_eq!(agg.series_count(), 0);
    // `batch` had no stream left: forgotten with its series; `checkout`'s stream still holds
    // its handle, whose later reports count as before.
    assert_eq!(read(&agg.services).len(), 1);
    agg.ingest(&held, &report(1, &[("payments", 3, 0)]), Instant::now());
    let stats = agg.stats(Instant::now(), one("checkout", "payments"));
    assert_eq!(stats.series[0].lifetime.map(|c| c.calls), Some(3));
}

#[tokio::test(start_paused = true)]
async fn a_series_reported_every_hour_long_metrics_interval_keeps_its_lifetime_totals() {
    // `--metrics-interval 1h`: each report arrives a little more than an hour after the last.
    let interval = Duration::from_secs(3600);
    let agg = Aggregator::new(100, Instant::now(), Arc::default()).with_unknown_span(interval);
    let svc = agg.service("batch");
    for _ in 0..3 {
        agg.ingest(&svc, &report(1, &[("ledger", 10, 0)]), Instant::now());
        let mut waited = Duration::ZERO;
        while waited < interval + Duration::from_secs(2) {
            advance(TICK).await;
            waited += TICK;
            agg.tick(Instant::now());
        }
    }
    agg.ingest(&svc, &report(1, &[("ledger", 10, 0)]), Instant::now());
    let stats = agg.stats(Instant::now(), one("batch", "ledger"));
    assert_eq!(stats.series[0].lifetime.map(|c| c.calls), Some(40));
}

#[tokio::test(start_paused = true)]
async fn a_small_callers_alert_lent_by_its_endpoint_ends_with_the_endpoints() {
    let agg = Aggregator::new(100, Instant::now(), Arc::default());
    let busy = agg.service("checkout");
    let cli = agg.service("retryplane-cli");
    // A storm: the busy caller at 50 %; a one-off call of 1 call and 2 retries meanwhile.
    agg.ingest(&busy, &report(1, &[("inventory", 100, 50)]), Instant::now());
    agg.ingest(&cli, &report(1, &[("inventory", 1, 2)]), Instant::now());
    assert_eq!(agg.tick(Instant::now()), 2);
    // Recovery: the busy caller's ratio over 5 minutes falls under the threshold; the one-off
    // series has no traffic of its own that could lower its 200 %.
    advance(Duration::from_secs(10)).await;
    agg.ingest(
        &busy,
        &report(1, &[("inventory", 2_000, 0)]),
        Instant::now(),
    );
    assert_eq!(
        agg.tick(Instant::now()),
        0,
        "{:?}",
        agg.alerting_endpoints(Instant::now())
    );
    // A series that had the volume itself goes on firing while its ratio stays high.
    let small = agg.service("small");
    agg.ingest(&small, &report(1, &[("inventory", 30, 30)]), Instant::now());
    assert_eq!(agg.tick(Instant::now()), 1);
    advance(Duration::from_secs(200)).await;
    agg.ingest(&small, &report(1, &[("inventory", 3, 3)]), Instant::now());
    advance(Duration::from_secs(110)).await;
    assert_eq!(agg.tick(Instant::now()), 1, "its own volume started it");
}

#[tokio::test(start_paused = true)]
async fn lent_alerts_go_on_while_the_endpoints_ratio_stays_high_though_its_traffic_drops() {
    let agg = Aggregator::new(100, Instant::now(), Arc::default());
    let callers: Vec<_> = (0..10)
        .map(|i| agg.service(&format!("caller{i}")))
        .collect();
    for svc in &callers {
        agg.ingest(svc, &report(1, &[("shipping", 5, 5)]), Instant::now());
    }
    assert_eq!(agg.tick(Instant::now()), 10);
    // The storm goes on and cuts the traffic: 10 calls in the window, all retried.
    advance(Duration::from_secs(200)).await;
    for svc in &callers {
        agg.ingest(svc, &report(1, &[("shipping", 1, 1)]), Instant::now());
    }
    advance(Duration::from_secs(110)).await;
    assert_eq!(agg.tick(Instant::now()), 10, "no flap");
}

#[tokio::test(start_paused = true)]
async fn a_storm_spread_over_many_small_callers_alerts_on_each_of_them() {
    let agg = Aggregator::new(100, Instant::now(), Arc::default());
    // 25 callers of one endpoint, 10 calls each at 50 % retries: no caller has the minimum
    // volume alone; the endpoint has 250 calls past its threshold.
    for i in 0..25 {
        let svc = agg.service(&format!("caller{i:02}"));
        agg.ingest(&svc, &report(1, &[("shipping", 10, 5)]), Instant::now());
    }
    // A caller of another endpoint with the same small volume, whose endpoint is calm.
    let calm = agg.service("calm");
    agg.ingest(
        &calm,
        &report(1, &[("stock", 10, 5), ("search", 1, 1)]),
        Instant::now(),
    );
    let quiet = agg.service("quiet");
    agg.ingest(&quiet, &report(1, &[("search", 400, 0)]), Instant::now());
    // A Stats call for one caller judges its series against the endpoint over every caller.
    let one_caller = agg.stats(Instant::now(), one("caller03", "shipping"));
    assert!(one_caller.series[0].alert.is_some_and(|a| a.firing));
    let calm_only = agg.stats(Instant::now(), one("calm", "search"));
    assert!(
        !calm_only.series[0].alert.is_some_and(|a| a.firing),
        "search is calm"
    );
    assert_eq!(agg.tick(Instant::now()), 25);
    assert_eq!(agg.alerting_endpoints(Instant::now()), ["shipping"]);
    let stats = agg.stats(Instant::now(), all());
    assert_eq!(stats.firing_series, 25);
    // The endpoint as a whole comes back under its threshold: each caller's alert ends with
    // it, as a firing alert does when its own ratio falls back.
    advance(Duration::from_secs(301)).await;
    for i in 0..25 {
        let svc = agg.service(&format!("caller{i:02}"));
        agg.ingest(&svc, &report(1, &[("shipping", 10, 0)]), Instant::now());
    }
    assert_eq!(agg.tick(Instant::now()), 0);
}

/// The end of an alert a small caller had from its endpoint says it ended with the endpoint's
/// ratio, not that the caller's own ratio (still above the threshold) came back under it.
#[tokio::test(start_paused = true)]
async fn the_end_of_an_alert_lent_by_the_endpoint_says_whose_ratio_ended_it() {
    let (log, _guard) = crate::test_logs::capture("retryplane_server=info");
    let agg = Aggregator::new(100, Instant::now(), Arc::default());
    let big = agg.service("big");
    let small = agg.service("small");
    // Both callers alert: the endpoint has 20 calls at 50 %, each caller 10.
    agg.ingest(&big, &report(1, &[("gamma", 10, 5)]), Instant::now());
    agg.ingest(&small, &report(1, &[("gamma", 10, 5)]), Instant::now());
    assert_eq!(agg.tick(Instant::now()), 2);
    // The big caller's 200 calls with no retry bring the endpoint down to 10 of 220.
    advance(Duration::from_secs(1)).await;
    agg.ingest(&big, &report(1, &[("gamma", 200, 0)]), Instant::now());
    assert_eq!(agg.tick(Instant::now()), 0);
    let text = log.text();
    // The alerts' ends are the only lines at info.
    let line = |service: &str| {
        text.lines()
            .find(|l| l.contains(" INFO ") && l.contains(&format!("service={service}")))
            .unwrap_or_else(|| panic!("no end of {service}'s alert: {text}"))
            .to_owned()
    };
    let small_line = line("small");
    assert!(
        small_line.contains("the endpoint's ratio over every calling service is no longer above")
            && !small_line.contains("back under"),
        "{small_line}"
    );
    let big_line = line("big");
    assert!(
        big_line.contains("retry ratio over 5 minutes is no longer above the endpoint's threshold"),
        "{big_line}"
    );
}

/// An aggregate told `interval` at `at` seconds of its life, after one agent's backlog report
/// of 1 call/s over the `span` seconds before it.
async fn after_a_backlog(interval: Duration, at: u64, span: u64) -> Aggregator {
    let agg = Aggregator::new(10, Instant::now(), Arc::default()).with_unknown_span(interval);
    let svc = agg.service("checkout");
    advance(Duration::from_secs(at)).await;
    let backlog = spanning(
        report(1, &[("payments", span, 0)]),
        1_000_000,
        1_000_000 + span * 1_000,
    );
    assert_eq!(agg.ingest(&svc, &backlog, Instant::now()).count, 0);
    agg
}

#[tokio::test(start_paused = true)]
async fn a_backlog_report_is_spread_over_the_time_it_covers() {
    // An agent cut off for 30 minutes sends what it counted meanwhile (1 call/s) in one report
    // that says it covers that time. It arrives at 2,000 s, on a bucket edge.
    let agg = after_a_backlog(DEFAULT_UNKNOWN_SPAN, 2_000, 1_800).await;
    // The last report interval (10 s) at the arrival: 10 calls; the 1,790 s before it spread
    // over their time. The 1-minute window (1,950 s on) holds 1,950..1,990 s of it, the
    // 5-minute window (1,740 s on) 1,740..1,990 s, the 15-minute one (1,140 s on)
    // 1,140..1,990 s: each 1 call/s over what it covers, not 1,800 calls in a minute.
    assert_eq!(calls(&agg, all()), [10 + 40, 10 + 250, 10 + 850]);
    let rates = windows(&agg, all()).map(|(c, covered)| c as f64 / covered);
    for rate in rates {
        assert!((rate - 1.0).abs() < 0.2, "{rates:?}");
    }
    let view = &agg.views(Instant::now(), all())[0];
    assert_eq!(
        view.lifetime.0[counts::CALLS],
        1_800,
        "the lifetime has all of it"
    );
}

/// Ticks of 5 s (the server's) over four hours of a steady 10 % retry ratio (threshold 5 %),
/// one agent reporting every `interval` s, 30 s past the minute: (ticks firing, ticks not,
/// starts and ends).
fn steady_storm(interval: u64) -> (u32, u32, u32) {
    let epoch = Instant::now();
    let agg = Aggregator::new(100, epoch, Arc::default())
        .with_unknown_span(Duration::from_secs(interval));
    let svc = agg.service("checkout");
    let (mut firing_ticks, mut quiet_ticks, mut transitions, mut was) = (0, 0, 0, false);
    for step in 1..=(4 * 3600 / 5) {
        let t = step * 5;
        let now = epoch + Duration::from_secs(t);
        if t % interval == 30 % interval {
            let end_ms = 1_700_000_000_000 + t * 1000;
            let r = spanning(
                report(1, &[("payments", 10 * interval, interval)]),
                end_ms - interval * 1000,
                end_ms,
            );
            assert_eq!(agg.ingest(&svc, &r, now).count, 0);
        }
        if t < interval + 30 {
            continue;
        }
        let firing = agg.tick(now) > 0;
        if firing {
            firing_ticks += 1;
        } else {
            quiet_ticks += 1;
        }
        if firing != was {
            transitions += 1;
            was = firing;
        }
    }
    (firing_ticks, quiet_ticks, transitions)
}

#[test]
fn a_steady_retry_storm_keeps_its_alert_firing_whatever_the_report_interval() {
    // With reports minutes apart, the 5-minute window is empty between two of them.
    for interval in [10, 60, 300, 600, 3600] {
        let (firing, quiet, transitions) = steady_storm(interval);
        assert_eq!(
            (quiet, transitions),
            (0, 1),
            "interval {interval} s: fired in {firing} ticks of 5 s, not in {quiet}"
        );
    }
}

/// An aggregate told `interval` whose `payments` alert fires (100 calls, 50 retries just
/// reported), and its `checkout` service.
fn firing(interval: Duration) -> (Aggregator, ServiceHandle) {
    let agg = Aggregator::new(10, Instant::now(), Arc::default()).with_unknown_span(interval);
    let svc = agg.service("checkout");
    agg.ingest(&svc, &report(1, &[("payments", 100, 50)]), Instant::now());
    assert_eq!(agg.tick(Instant::now()), 1);
    (agg, svc)
}

#[tokio::test(start_paused = true)]
async fn a_firing_alert_ends_once_reports_stop_and_the_window_is_empty() {
    let (agg, _svc) = firing(Duration::from_secs(600));
    // 5 minutes on the window is empty, but the next report is not due: still firing.
    advance(Duration::from_secs(400)).await;
    assert_eq!(calls(&agg, all())[1], 0);
    assert_eq!(agg.tick(Instant::now()), 1);
    // No report 10 s past the interval: the empty window ends the alert.
    advance(Duration::from_secs(210)).await;
    assert_eq!(agg.tick(Instant::now()), 0);
}

/// A backlog whose span reaches back before the ring's oldest bucket, while `now - interval`
/// falls in that oldest bucket: only the share of the time that bucket holds is in it.
/// (`--metrics-interval 45s`, 30 minutes cut off.)
#[tokio::test(start_paused = true)]
async fn a_backlog_older_than_the_ring_is_not_put_in_its_oldest_bucket() {
    let agg = after_a_backlog(Duration::from_secs(45), 2_000, 1_800).await;
    let [one_minute, five, fifteen] = calls(&agg, all());
    assert!(
        one_minute <= 60 + 45,
        "1-minute window: {one_minute} calls for 1 call/s (5 min: {five}, 15 min: {fifteen})"
    );
}

/// The same with the coarse ring: `--metrics-interval 14m`, an agent cut off for a day.
#[tokio::test(start_paused = true)]
async fn a_day_of_backlog_is_not_put_in_the_15_minute_windows_oldest_bucket() {
    let agg = after_a_backlog(Duration::from_secs(14 * 60), 100_000, 86_400).await;
    let [one_minute, five, fifteen] = calls(&agg, all());
    assert!(
        fifteen <= 900 + 60,
        "15-minute window: {fifteen} calls for 1 call/s (1 min: {one_minute}, 5 min: {five})"
    );
}

/// The control plane restarted after 30 minutes down; an agent's first report on the new
/// stream covers those 30 minutes, 1 call/s: spread over the time it covers, as far back as
/// the windows reach, not read as a burst.
#[tokio::test(start_paused = true)]
async fn a_backlog_after_a_control_plane_restart_is_not_read_as_a_burst() {
    let agg = after_a_backlog(DEFAULT_UNKNOWN_SPAN, 2, 1_800).await;
    let [one_minute, five, fifteen] = calls(&agg, all());
    assert!(
        one_minute <= 60 + 10 && five <= 300 + 10 && fifteen <= 900 + 10,
        "1/5/15-minute windows: {one_minute}/{five}/{fifteen} calls for 1 call/s"
    );
}

/// Hostile spans from the network: no panic, and no window holds more than the lifetime.
#[tokio::test(start_paused = true)]
async fn hostile_spans_neither_panic_nor_make_counts() {
    for interval in [100, 10_000, 45_000, 840_000, 3_600_000] {
        let agg = Aggregator::new(10, Instant::now(), Arc::default())
            .with_unknown_span(Duration::from_millis(interval));
        let svc = agg.service("checkout");
        for at in [0, 3, 59, 61, 899, 901, 86_399, 86_401, 200_000] {
            let now = Instant::now() + Duration::from_secs(at);
            for (start, end) in [
                (1, u64::MAX),
                (u64::MAX, 1),
                (u64::MAX - 1, u64::MAX),
                (0, u64::MAX),
                (1, 86_400_000),
                (1, 86_400_001),
                (1_000, 1_000),
                (1, 2),
                (1, interval + 1),
                (1, interval + 2),
            ] {
                let r = spanning(
                    report(1, &[("payments", 1_000_003, 7), ("b", 1, 1)]),
                    start,
                    end,
                );
                agg.ingest(&svc, &r, now);
            }
            for v in agg.views(now, all()) {
                for (w, _) in v.windows {
                    assert!(
                        w.0[counts::CALLS] <= v.lifetime.0[counts::CALLS],
                        "interval {interval} ms at {at} s: {:?} > {:?}",
                        w.0,
                        v.lifetime.0
                    );
                }
            }
        }
    }
}

/// A firing alert held through an empty window is judged against a new threshold: one raised
/// past the ratio it was held at ends it at once, as it would with calls in the window.
#[tokio::test(start_paused = true)]
async fn a_held_alert_follows_a_new_threshold() {
    let (agg, _svc) = firing(Duration::from_secs(600));
    advance(Duration::from_secs(400)).await;
    assert_eq!(calls(&agg, all())[1], 0);
    agg.thresholds()
        .set(HashMap::from([("payments".to_owned(), 0.9)]), 0.05);
    let alert = agg.views(Instant::now(), all())[0].alert;
    assert!(
        !alert.firing && alert.threshold == 0.9,
        "a threshold of 90 % over a held ratio of 50 %: {alert:?}"
    );
}

/// A client that lists its endpoints in every report, all counts zero (the proto asks for one
/// entry per endpoint that counted anything): such entries are no report of the series, so
/// they do not hold its alert through an empty window.
#[tokio::test(start_paused = true)]
async fn all_zero_entries_do_not_hold_an_alert_forever() {
    let (agg, svc) = firing(DEFAULT_UNKNOWN_SPAN);
    for _ in 0..90 {
        advance(Duration::from_secs(10)).await;
        agg.ingest(&svc, &report(1, &[("payments", 0, 0)]), Instant::now());
        agg.tick(Instant::now());
    }
    assert_eq!(calls(&agg, all()), [0, 0, 0]);
    let alert = agg.views(Instant::now(), all())[0].alert;
    assert!(!alert.firing, "15 minutes without a call: {alert:?}");
}

/// Conservation at bucket edges: a backlog that lies wholly inside the 15-minute ring's kept
/// buckets is wholly in the 15-minute window, whatever the arrival's phase and the span.
#[test]
fn a_backlog_inside_the_ring_is_conserved_at_every_phase() {
    let mut bad = Vec::new();
    for arrival_ms in (1_000_000..1_000_000 + 120_000).step_by(997) {
        for span_ms in [
            10_001, 10_999, 20_000, 59_999, 60_000, 60_001, 299_999, 600_000, 779_999,
        ] {
            for calls in [1_u64, 7, 1_000, 999_983] {
                let epoch = Instant::now();
                let agg = Aggregator::new(10, epoch, Arc::default());
                let svc = agg.service("checkout");
                let now = epoch + Duration::from_millis(arrival_ms);
                let r = spanning(report(1, &[("payments", calls, 0)]), 5_000, 5_000 + span_ms);
                agg.ingest(&svc, &r, now);
                let v = &agg.views(now, all())[0];
                let fifteen = v.windows[2].0.0[counts::CALLS];
                if fifteen != calls {
                    bad.push((arrival_ms, span_ms, calls, fifteen));
                }
            }
        }
    }
    assert!(
        bad.is_empty(),
        "{} cases, first {:?}",
        bad.len(),
        &bad[..bad.len().min(5)]
    );
}

/// An evicted version between kept ones (eviction goes by the agents running a version, not
/// its number: here version 2, while an agent stays on 1) that reports late is counted with
/// the evicted versions, not re-added in place of version 3, counted after it.
#[tokio::test(start_paused = true)]
async fn a_late_report_of_a_version_evicted_between_kept_ones_evicts_no_newer_one() {
    // One agent stays on 1; the other moves from 2 to 5.
    let (agg, svc, running) = checkout_fleet(&[(1, 1), (2, 1)]);
    for version in [1, 2, 3, 4, 1, 5] {
        if version > 2 {
            running.moved("checkout", version - 1, version);
        }
        agg.ingest(
            &svc,
            &report(version, &[("payments", 1, 0)]),
            Instant::now(),
        );
        advance(Duration::from_secs(1)).await;
    }
    assert_eq!(
        listed(&agg),
        [5, 4, 3, 1],
        "version 2, which no agent runs, has the fewest calls per second of 2, 3 and 4"
    );
    // Version 2's calls that outlived it, reported late.
    agg.ingest(&svc, &report(2, &[("payments", 3, 0)]), Instant::now());
    assert_eq!(
        calls(&agg, all()),
        [9, 9, 9],
        "every count is in the windows"
    );
    assert_eq!(
        listed(&agg),
        [5, 4, 3, 1],
        "a late report of evicted version 2 evicted version 3, counted after it"
    );
}

/// One kept version numbered above the store's (an agent started from a cache file of a
/// store that has since been reset and numbers from 1 again) does not keep the versions the
/// store publishes after it out of the versions kept apart: the version the fleet runs now
/// evicts one no agent runs any more, as any new version does.
#[tokio::test(start_paused = true)]
async fn a_kept_version_numbered_above_the_store_s_does_not_keep_new_versions_out_of_the_series() {
    // The odd agent on 1000; five agents moving from 1 to 4.
    let (agg, svc, running) = checkout_fleet(&[(1_000, 1), (1, 5)]);
    for version in [1_000, 1, 2, 3] {
        if version > 1 && version < 1_000 {
            for _ in 0..5 {
                running.moved("checkout", version - 1, version);
            }
        }
        agg.ingest(
            &svc,
            &report(version, &[("payments", 1, 0)]),
            Instant::now(),
        );
        advance(Duration::from_secs(1)).await;
    }
    // Version 4 is published and the fleet runs it; the odd agent still reports 1000.
    for _ in 0..5 {
        running.moved("checkout", 3, 4);
    }
    for _ in 0..5 {
        agg.ingest(&svc, &report(4, &[("payments", 10, 0)]), Instant::now());
        agg.ingest(&svc, &report(1_000, &[("payments", 1, 0)]), Instant::now());
        advance(Duration::from_secs(1)).await;
    }
    assert_eq!(
        calls(&agg, all()),
        [59, 59, 59],
        "every count is in the windows"
    );
    let listed = listed(&agg);
    assert!(
        listed.contains(&4),
        "version 4, the one 50 of the last 55 calls ran under, is not among the versions \
         kept apart: {listed:?}"
    );
}

/// A version evicted when no agent ran it (its late reports go with the evicted versions'
/// counts) is kept apart again at the first report once more agents run it than run a kept
/// one: two agents restarted from cache files of it, or a rollback to its content.
#[tokio::test(start_paused = true)]
async fn an_evicted_version_more_agents_run_again_is_kept_apart_again() {
    let (agg, svc, running) = checkout_fleet(&[(1, 1), (3, 1), (4, 1), (5, 1)]);
    for version in [1, 2, 3, 4, 1, 5] {
        payments(&agg, &svc, version, 1);
        advance(Duration::from_secs(1)).await;
    }
    assert_eq!(
        versions_of(&agg, "checkout", "payments"),
        [1, 3, 4, 5],
        "version 2, which no agent runs, was evicted"
    );
    payments(&agg, &svc, 2, 1);
    assert_eq!(
        versions_of(&agg, "checkout", "payments"),
        [1, 3, 4, 5],
        "a late report of 2 evicts none"
    );
    advance(Duration::from_secs(60)).await;
    running.joined("checkout", 2);
    payments(&agg, &svc, 2, 1);
    assert_eq!(
        versions_of(&agg, "checkout", "payments"),
        [1, 3, 4, 5],
        "one agent on 2, as many as on each kept one"
    );
    running.joined("checkout", 2);
    payments(&agg, &svc, 2, 1);
    assert!(
        versions_of(&agg, "checkout", "payments").contains(&2),
        "version 2, which two agents run, one more than each kept one: {:?}",
        versions_of(&agg, "checkout", "payments")
    );
    assert_eq!(calls(&agg, all())[2], 9, "every count is in the windows");
}

/// The version the fleet moves to is kept apart however the reports of a straggler version
/// numbered between two kept ones fall. Four versions are kept (1, 3, 4: an agent still on
/// each; 5: the newest, ten agents on it). An agent restarted from a cache file of version 2
/// reports once, then takes 5: one agent, no more than on each of 1, 3 and 4, it takes no
/// place, and never 5's.
#[tokio::test(start_paused = true)]
async fn the_newest_version_is_not_locked_out_by_one_report_of_an_older_version() {
    let (agg, svc, running) = checkout_fleet(&[(1, 1), (3, 1), (4, 1), (5, 10)]);
    for version in [1, 3, 4, 5, 1, 3, 4] {
        payments(&agg, &svc, version, 1);
        advance(Duration::from_secs(1)).await;
    }
    // An agent restarted from its cache file of version 2.
    running.joined("checkout", 2);
    payments(&agg, &svc, 2, 1);
    assert_eq!(listed(&agg), [5, 4, 3, 1], "2 took a place");
    running.moved("checkout", 2, 5);
    advance(Duration::from_secs(1)).await;
    // The fleet runs version 5 for ten minutes; the stragglers go on reporting.
    for _ in 0..60 {
        payments(&agg, &svc, 5, 100);
        for version in [1, 3, 4] {
            payments(&agg, &svc, version, 1);
        }
        advance(Duration::from_secs(10)).await;
    }
    let stats = agg.stats(Instant::now(), all());
    let series = &stats.series[0];
    let listed: Vec<u64> = series.versions.iter().map(|v| v.policy_version).collect();
    assert!(
        listed.contains(&5) && series.policy_version == 5,
        "version 5, which 6,000 of the last 6,180 calls ran under, is not kept apart for ten \
         minutes after one report of version 2 evicted it: versions listed {listed:?}, the \
         series' newest version {}",
        series.policy_version
    );
}

/// The same as above, with one report of a bogus high version number (a client's, which no
/// agent runs) a second before version 5 was published, while places were free. Kept: 1, 4
/// (an agent still on each), 1,000,000 (one report) and 5 (published, ten agents on it). The
/// straggler's report of version 3 (one agent) evicts the bogus number, which no agent runs,
/// never 5.
#[tokio::test(start_paused = true)]
async fn a_bogus_high_version_does_not_leave_the_newest_published_one_to_a_straggler() {
    let (agg, svc, running) = checkout_fleet(&[(1, 1), (4, 1), (5, 10)]);
    // The control plane publishes version 5 (`Fanout::publish`).
    agg.set_published(5);
    for version in [1, 4, 1_000_000, 5, 1, 4] {
        payments(&agg, &svc, version, 1);
        advance(Duration::from_secs(1)).await;
    }
    // An agent restarted from its cache file of version 3.
    running.joined("checkout", 3);
    payments(&agg, &svc, 3, 1);
    assert!(listed(&agg).contains(&3) && !listed(&agg).contains(&1_000_000));
    running.moved("checkout", 3, 5);
    advance(Duration::from_secs(1)).await;
    // The fleet runs version 5 for ten minutes; the stragglers go on reporting.
    for _ in 0..60 {
        payments(&agg, &svc, 5, 100);
        for version in [1, 4] {
            payments(&agg, &svc, version, 1);
        }
        advance(Duration::from_secs(10)).await;
    }
    let listed = listed(&agg);
    assert!(
        listed.contains(&5),
        "version 5, which 6,000 of the last 6,120 calls ran under, is not kept apart ten \
         minutes after one report of version 3 evicted it (one bogus report of 1,000,000 \
         being the newest kept): versions listed {listed:?}"
    );
}

/// One report of a bogus high number, which no agent runs, evicts no version, not even the
/// published one when that is the least recently counted (the version the fleet moves to, its
/// first agents on it).
#[tokio::test(start_paused = true)]
async fn one_bogus_high_version_takes_no_place() {
    let (agg, svc, _running) = checkout_fleet(&[(1, 1), (3, 1), (4, 1), (5, 10)]);
    // The control plane publishes version 5 (`Fanout::publish`).
    agg.set_published(5);
    for version in [1, 3, 4, 5, 1, 3, 4] {
        payments(&agg, &svc, version, 1);
        advance(Duration::from_secs(1)).await;
    }
    payments(&agg, &svc, u64::MAX / 2, 1);
    assert_eq!(listed(&agg), [5, 4, 3, 1], "the bogus number took a place");
    advance(Duration::from_secs(1)).await;
    for _ in 0..60 {
        payments(&agg, &svc, 5, 100);
        for version in [1, 3, 4] {
            payments(&agg, &svc, version, 1);
        }
        advance(Duration::from_secs(10)).await;
    }
    let listed = listed(&agg);
    assert!(
        listed.contains(&5),
        "version 5, which 6,000 of the last 6,180 calls ran under, is not kept apart ten \
         minutes after one report of a bogus version number: versions listed {listed:?}"
    );
}

/// A report of a version number not yet published, which no agent runs (a client's bogus
/// number that the next publish then takes, or an agent of a control plane whose store was
/// replaced), is evicted by a straggler's report; the control plane then publishes that
/// number, and the fleet moves to it: it is kept apart again while the fleet runs it.
#[tokio::test(start_paused = true)]
async fn the_published_version_once_evicted_before_its_publish_is_kept_apart() {
    let (agg, svc, running) = checkout_fleet(&[(2, 1), (4, 1), (5, 10)]);
    agg.set_published(5);
    // Kept: 2, 4, 5 and one report of 6 (not published yet).
    for version in [2, 4, 5, 6, 2, 4, 5] {
        payments(&agg, &svc, version, 1);
        advance(Duration::from_secs(1)).await;
    }
    // A straggler of version 3 evicts the one no agent runs: 6.
    running.joined("checkout", 3);
    payments(&agg, &svc, 3, 1);
    assert!(!listed(&agg).contains(&6), "{:?}", listed(&agg));
    advance(Duration::from_secs(1)).await;
    // Version 6 is published; the fleet runs it for ten minutes.
    agg.set_published(6);
    for _ in 0..10 {
        running.moved("checkout", 5, 6);
    }
    for _ in 0..60 {
        payments(&agg, &svc, 6, 100);
        for version in [4, 5] {
            payments(&agg, &svc, version, 1);
        }
        advance(Duration::from_secs(10)).await;
    }
    let listed = listed(&agg);
    assert!(
        listed.contains(&6),
        "version 6, published and run by the fleet for ten minutes (6,000 of the last 6,120 \
         calls), is not kept apart: its number was evicted before it was published, and \
         reports of an evicted number go with the evicted versions' counts: versions listed \
         {listed:?}"
    );
}

/// Four kept versions numbered above the published one (agents still on the versions of a
/// control plane whose data directory was replaced and which numbers from 1 again, one on
/// each): the published version, which no more agents run at its first report than run each
/// kept one, is kept apart all the same.
#[tokio::test(start_paused = true)]
async fn the_published_version_below_every_kept_one_is_kept_apart() {
    let (agg, svc, running) = checkout_fleet(&[(100, 1), (101, 1), (102, 1), (103, 1)]);
    agg.set_published(5);
    running.joined("checkout", 5);
    for version in [100, 101, 102, 103] {
        payments(&agg, &svc, version, 1);
        advance(Duration::from_secs(1)).await;
    }
    for _ in 0..60 {
        payments(&agg, &svc, 5, 100);
        advance(Duration::from_secs(10)).await;
    }
    let listed = listed(&agg);
    assert!(
        listed.contains(&5),
        "version 5, published and run by the fleet for ten minutes (6,000 of the last 6,004 \
         calls), is not kept apart behind four reports of higher numbers: versions listed \
         {listed:?}"
    );
}

/// Version 6 is published but every agent refuses it (a NACK: the agents keep running
/// version 5, the last they validated, until the next publish); no agent reports 6. The
/// version the fleet runs is kept apart: a report of straggler version 2 (one agent) takes
/// no place, least of all 5's. The same holds for the seconds of a rollout between a publish
/// and the agents' swap.
#[tokio::test(start_paused = true)]
async fn the_version_the_fleet_runs_after_refusing_the_published_one_is_kept_apart() {
    let (agg, svc, running) = checkout_fleet(&[(1, 1), (3, 1), (4, 1), (5, 10)]);
    agg.set_published(5);
    for version in [1, 3, 4, 5, 1, 3, 4] {
        payments(&agg, &svc, version, 1);
        advance(Duration::from_secs(1)).await;
    }
    // Version 6 is published (`Fanout::publish`); every agent NACKs it and stays on 5.
    agg.set_published(6);
    // An agent restarted from its cache file of version 2.
    running.joined("checkout", 2);
    payments(&agg, &svc, 2, 1);
    assert_eq!(listed(&agg), [5, 4, 3, 1], "2 took a place");
    advance(Duration::from_secs(1)).await;
    for _ in 0..60 {
        payments(&agg, &svc, 5, 100);
        for version in [1, 3, 4] {
            payments(&agg, &svc, version, 1);
        }
        advance(Duration::from_secs(10)).await;
    }
    let stats = agg.stats(Instant::now(), all());
    let series = &stats.series[0];
    let listed: Vec<u64> = series.versions.iter().map(|v| v.policy_version).collect();
    assert!(
        listed.contains(&5),
        "version 5, which the whole fleet runs (version 6 refused by every agent) and 6,000 of \
         the last 6,180 calls ran under, is not kept apart for ten minutes after one report of \
         straggler version 2 evicted it: versions listed {listed:?}, the series' newest \
         version {}",
        series.policy_version
    );
}

/// A seeded 20-minute walk: a publish every 90 s (the ten agents move to it within 20 s),
/// late reports of older versions and bogus high numbers, which no agent runs.
/// After every report: a version published and reported in the last minute is listed, the
/// windows and lifetime are those of the same reports under one version, and the memory of
/// the series stays under its bound.
#[tokio::test(start_paused = true)]
async fn a_seeded_walk_of_publishes_keeps_the_published_version_apart_and_counts_exact() {
    let (agg, svc, running) = checkout_fleet(&[(10, 10)]);
    let same = Aggregator::new(10, Instant::now(), Arc::default());
    let same_svc = same.service("checkout");
    let mut seed: u64 = 0x5eed_0089;
    let mut next = |n: u64| {
        seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (seed >> 33) % n
    };
    let mut published = 10u64;
    agg.set_published(published);
    let mut published_at = 0u64;
    let mut running_now = published;
    let mut published_seen: Option<u64> = None;
    let mut most_bytes = 0usize;
    for second in 0..1_200u64 {
        if second > 0 && second % 90 == 0 {
            published += 1;
            agg.set_published(published);
            published_at = second;
            published_seen = None;
        }
        // Within 20 s of a publish, agents are still on the previous version.
        let fleet = if second - published_at < 20 && second >= 20 {
            published - 1
        } else {
            published
        };
        if second > 0 && fleet != running_now {
            for _ in 0..10 {
                running.moved("checkout", running_now, fleet);
            }
            running_now = fleet;
        }
        let version = match next(12) {
            0 => u64::MAX - next(5),
            1..=4 => fleet.saturating_sub(1 + next(8)),
            _ => fleet,
        };
        let (calls, retries) = (1 + next(20), next(5));
        let r = |v| report(v, &[("payments", calls, retries)]);
        agg.ingest(&svc, &r(version), Instant::now());
        same.ingest(&same_svc, &r(1), Instant::now());
        if version == published {
            published_seen = Some(second);
        }
        let (a, b) = (
            &agg.views(Instant::now(), all())[0],
            &same.views(Instant::now(), all())[0],
        );
        assert_eq!(
            a.windows.map(|(c, covered)| (c.0, covered)),
            b.windows.map(|(c, covered)| (c.0, covered)),
            "windows at {second} s"
        );
        assert_eq!(a.lifetime.0, b.lifetime.0, "lifetime at {second} s");
        if published_seen.is_some_and(|s| second - s < 60) {
            let stats = agg.stats(Instant::now(), all());
            let listed: Vec<u64> = stats.series[0]
                .versions
                .iter()
                .map(|v| v.policy_version)
                .collect();
            assert!(
                listed.contains(&published),
                "published {published} reported at {published_seen:?}, not listed at \
                 {second} s: {listed:?}"
            );
            assert!(listed.len() <= series::MAX_VERSIONS, "{listed:?}");
        }
        most_bytes = most_bytes.max(agg.approx_bytes());
        advance(Duration::from_secs(1)).await;
    }
    let base = same.approx_bytes();
    assert!(
        most_bytes < base + series::MAX_VERSIONS * 2_800,
        "{base} -> {most_bytes}"
    );
}

/// A client reporting a new bogus number every few seconds (numbers above the published one,
/// which no agent runs) while the four places are taken evicts none of them, not even 8,
/// which no agent runs any more either: each bogus report goes with the evicted versions'
/// counts, and a late report of 8 is still counted as 8.
#[tokio::test(start_paused = true)]
async fn bogus_numbers_evict_no_version_not_even_one_no_agent_runs() {
    let (agg, svc, _running) = checkout_fleet(&[(7, 1), (9, 1), (10, 1)]);
    agg.set_published(10);
    let one = |agg: &Aggregator, version: u64| {
        agg.ingest(
            &svc,
            &report(version, &[("payments", 1, 0)]),
            Instant::now(),
        );
    };
    for version in [8, 7, 9, 10] {
        one(&agg, version);
        advance(Duration::from_secs(1)).await;
    }
    let bogus = 1_000_000;
    one(&agg, bogus);
    advance(Duration::from_secs(1)).await;
    for i in 1..=16 {
        for version in [9, 7, 10] {
            one(&agg, version);
            advance(Duration::from_secs(1)).await;
        }
        one(&agg, bogus + i);
        advance(Duration::from_secs(1)).await;
    }
    // A late report of version 8, 70 s after its last.
    one(&agg, 8);
    advance(Duration::from_secs(1)).await;
    let stats = agg.stats(Instant::now(), all());
    let series = &stats.series[0];
    let listed: Vec<u64> = series.versions.iter().map(|v| v.policy_version).collect();
    assert_eq!(
        listed,
        [10, 9, 8, 7],
        "bogus numbers evicted a version the agents run"
    );
    let lifetime = series.lifetime.as_ref().map_or(0, |c| c.calls);
    assert_eq!(lifetime, 4 + 17 + 16 * 3 + 1, "every report counted once");
}

/// The calls of `version` in `series`' 5-minute window; `None` when it is not kept apart.
fn five_minute_calls(series: &pb::SeriesStats, version: u64) -> Option<u64> {
    let v = series
        .versions
        .iter()
        .find(|v| v.policy_version == version)?;
    Some(
        v.windows
            .iter()
            .find(|w| w.window_seconds == 300)
            .and_then(|w| w.counters.as_ref())
            .map_or(0, |c| c.calls),
    )
}

/// The lifetime calls of the first series (the only one, in these tests).
fn lifetime_calls(agg: &Aggregator) -> u64 {
    agg.stats(Instant::now(), all()).series[0]
        .lifetime
        .as_ref()
        .map_or(0, |c| c.calls)
}

/// The versions a series keeps apart, newest first.
fn listed(agg: &Aggregator) -> Vec<u64> {
    agg.stats(Instant::now(), all()).series[0]
        .versions
        .iter()
        .map(|v| v.policy_version)
        .collect()
}

/// A control plane restarted on a reset store (a volume not mounted: the store numbers from 1
/// again) while its agents ran the lost store's version 9; agents held reports of 9 while it
/// was down. The store publishes 1 to 4; ten agents refusing 4 stay on 3, two take 4, one
/// straggler each still runs 1 and 2. Version 9, which no connected agent runs any more, is
/// evicted by 4's first report. A second agent's held report of 9, sent as it reconnects
/// (its Hello named 9: one agent on it), is not kept apart again in place of version 3, which
/// ten agents run, nor of 1 or 2, which as many run.
#[tokio::test(start_paused = true)]
async fn a_late_report_of_an_evicted_number_above_the_published_one_evicts_no_newer_version() {
    let (agg, svc, running) = checkout_fleet(&[(1, 1), (2, 1), (3, 10), (4, 2)]);
    agg.set_published(1);
    // An agent's report held from before the restart.
    payments(&agg, &svc, 9, 5);
    advance(Duration::from_secs(1)).await;
    for version in 1..=3 {
        agg.set_published(version);
        payments(&agg, &svc, version, 5);
        advance(Duration::from_secs(1)).await;
    }
    agg.set_published(4);
    payments(&agg, &svc, 4, 5);
    advance(Duration::from_secs(1)).await;
    assert_eq!(
        listed(&agg),
        [4, 3, 2, 1],
        "9, which no agent runs, was evicted"
    );
    // Agents refusing 4 report 3 first this interval, then stragglers and agents on 4.
    for version in [3, 2, 1, 4] {
        payments(&agg, &svc, version, 5);
        advance(Duration::from_secs(1)).await;
    }
    // A second agent's report of 9, held from before the restart.
    running.joined("checkout", 9);
    payments(&agg, &svc, 9, 5);
    running.moved("checkout", 9, 4);
    advance(Duration::from_secs(1)).await;
    let after_late = listed(&agg);
    // The agents refusing 4 report 3 again.
    payments(&agg, &svc, 3, 100);
    advance(Duration::from_secs(1)).await;
    assert_eq!(
        calls(&agg, all()),
        [150, 150, 150],
        "every count is in the windows"
    );
    let now = listed(&agg);
    assert!(
        !after_late.contains(&9) && now.contains(&3),
        "a late report of version 9 (evicted before; above the published 4) evicted version \
         3, counted after 9 was evicted and run by the agents refusing 4: versions listed \
         after the late report {after_late:?}, after 3's next report {now:?}"
    );
}

/// Version 5 is published; one agent takes it, nine refuse it (a NACK) and stay on 4, all
/// reporting every 10 s. A client that numbers its reports itself reports three bogus
/// numbers above the published one in a burst, then every 10 s. 4, which most of the fleet
/// runs, stays kept apart all along.
#[tokio::test(start_paused = true)]
async fn the_version_agents_refusing_a_publish_run_is_not_kept_out_by_numbers_above_the_published_one()
 {
    let (agg, svc, _running) = checkout_fleet(&[(5, 1), (4, 9)]);
    agg.set_published(5);
    // The same reports under one version: what the windows and lifetime should be.
    let same = Aggregator::new(10, Instant::now(), Arc::default());
    let same_svc = same.service("checkout");
    let both = |version: u64, calls: u64| {
        payments(&agg, &svc, version, calls);
        payments(&same, &same_svc, 1, calls);
    };
    let mut missing = Vec::new();
    for round in 0..120u64 {
        both(5, 10);
        both(4, 90);
        if !listed(&agg).contains(&4) {
            missing.push(round * 10);
        }
        for bogus in 1_000_000..1_000_003 {
            advance(Duration::from_secs(1)).await;
            both(bogus, 1);
        }
        advance(Duration::from_secs(7)).await;
    }
    let (a, b) = (
        &agg.views(Instant::now(), all())[0],
        &same.views(Instant::now(), all())[0],
    );
    assert_eq!(
        a.windows.map(|(c, covered)| (c.0, covered)),
        b.windows.map(|(c, covered)| (c.0, covered)),
        "windows"
    );
    assert_eq!(a.lifetime.0, b.lifetime.0, "lifetime");
    let listed = listed(&agg);
    assert!(
        missing.is_empty(),
        "version 4, which 90 of every 103 calls run under (agents refusing the published 5), \
         was not kept apart after its report at {} of 120 reports (first at {:?} s); \
         versions listed at the end {listed:?}",
        missing.len(),
        missing.first()
    );
}

/// As `the_version_the_fleet_runs_after_refusing_the_published_one_is_kept_apart`, but one
/// agent takes version 6 (a NACK from most of the fleet, not all: agents of another build, or
/// with another validation, accept it). Both 6 and 5, which the rest of the fleet runs, stay
/// kept apart when a straggler version reports (an agent restarted from its cache file).
#[tokio::test(start_paused = true)]
async fn the_version_most_agents_run_after_some_refuse_the_published_one_is_kept_apart() {
    let (agg, svc, running) = checkout_fleet(&[(1, 1), (3, 1), (5, 10)]);
    agg.set_published(5);
    for version in [1, 3, 5] {
        payments(&agg, &svc, version, 1);
        advance(Duration::from_secs(1)).await;
    }
    // Version 6 is published; one agent takes it, the rest refuse it and stay on 5.
    agg.set_published(6);
    running.moved("checkout", 5, 6);
    for version in [6, 5, 1, 3, 6] {
        payments(&agg, &svc, version, 1);
        advance(Duration::from_secs(1)).await;
    }
    // An agent restarted from its cache file of version 2.
    running.joined("checkout", 2);
    payments(&agg, &svc, 2, 1);
    assert_eq!(listed(&agg), [6, 5, 3, 1], "2 took a place");
    advance(Duration::from_secs(1)).await;
    let mut missing = 0;
    for _ in 0..60 {
        payments(&agg, &svc, 5, 100);
        if !listed(&agg).contains(&5) {
            missing += 1;
        }
        for version in [1, 3, 6] {
            payments(&agg, &svc, version, 1);
        }
        advance(Duration::from_secs(10)).await;
    }
    let stats = agg.stats(Instant::now(), all());
    let series = &stats.series[0];
    let listed: Vec<u64> = series.versions.iter().map(|v| v.policy_version).collect();
    assert!(
        missing == 0,
        "version 5, which every agent but one runs (6,000 of the last 6,180 calls), was not \
         kept apart after {missing} of its 60 reports in ten minutes, after one report of \
         straggler version 2: versions listed {listed:?}"
    );
}

/// A seeded 30-minute walk of a small fleet (four agents, each reporting every 10 s at its
/// own phase): a publish every 2 minutes, which the agents take (within 20 s), or all but one
/// refuse (a NACK: they stay on the version before), or all refuse; now and then a straggler
/// of an older version (a late report; or a short-lived process started from a cache file,
/// connected for one report) and, in the second run, a client's
/// bogus number above the published one. After every report of the
/// version most agents run, it is kept apart; after every report the windows and lifetime are
/// those of the same reports under one version, and the memory stays under its bound.
async fn seeded_walk_of_refused_publishes(
    seed: u64,
    bogus: bool,
) -> (u32, u32, Option<(u64, u64, Vec<u64>)>) {
    let (agg, svc, running) = checkout_fleet(&[(10, 4)]);
    let same = Aggregator::new(10, Instant::now(), Arc::default());
    let same_svc = same.service("checkout");
    let mut seed: u64 = 0x5eed_0092 ^ seed;
    let mut next = |n: u64| {
        seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (seed >> 33) % n
    };
    let mut published = 10u64;
    agg.set_published(published);
    // The version most agents run, and the one agent 0 runs.
    let (mut most, mut first) = (published, published);
    let mut running_first = first;
    let mut moving_at: Option<u64> = None;
    let phases = [0u64, 3, 5, 8];
    let (mut reports, mut missing, mut first_missing) = (0u32, 0u32, None);
    let mut most_bytes = 0usize;
    for second in 0..1_800u64 {
        if second > 0 && second % 120 == 0 {
            published += 1;
            agg.set_published(published);
            match next(3) {
                // Taken: the agents move within 20 s.
                0 => moving_at = Some(second + 5 + next(15)),
                // All but agent 0 refuse it.
                1 => first = published,
                // Every agent refuses it.
                _ => {}
            }
        }
        if moving_at == Some(second) {
            for _ in 1..phases.len() {
                running.moved("checkout", most, published);
            }
            running.moved("checkout", first, published);
            (most, first, moving_at) = (published, published, None);
        } else if first == published && first != running_first {
            running.moved("checkout", running_first, first);
        }
        running_first = first;
        let mut batch = Vec::new();
        for (agent, &phase) in phases.iter().enumerate() {
            if second % 10 == phase {
                let version = if agent == 0 { first } else { most };
                batch.push((version, 20 + next(20), false));
            }
        }
        match next(20) {
            0 => batch.push((most.saturating_sub(1 + next(6)), 1, next(2) == 0)),
            1 if bogus => batch.push((1_000_000 + next(3), 1, false)),
            _ => {}
        }
        for (version, calls, restarted) in batch {
            let r = report(version, &[("payments", calls, next(3))]);
            if restarted {
                running.joined("checkout", version);
            }
            agg.ingest(&svc, &r, Instant::now());
            if restarted {
                running.left("checkout", version);
            }
            let mut r = r;
            r.policy_version = 1;
            same.ingest(&same_svc, &r, Instant::now());
            if version == most {
                reports += 1;
                if !listed(&agg).contains(&most) {
                    missing += 1;
                    first_missing.get_or_insert((second, most, listed(&agg)));
                }
            }
            let (a, b) = (
                &agg.views(Instant::now(), all())[0],
                &same.views(Instant::now(), all())[0],
            );
            assert_eq!(
                a.windows.map(|(c, covered)| (c.0, covered)),
                b.windows.map(|(c, covered)| (c.0, covered)),
                "windows at {second} s"
            );
            assert_eq!(a.lifetime.0, b.lifetime.0, "lifetime at {second} s");
            most_bytes = most_bytes.max(agg.approx_bytes());
        }
        advance(Duration::from_secs(1)).await;
    }
    let base = same.approx_bytes();
    assert!(
        most_bytes < base + series::MAX_VERSIONS * 2_800,
        "{base} -> {most_bytes}"
    );
    (missing, reports, first_missing)
}

/// [`seeded_walk_of_refused_publishes`] with stragglers only.
#[tokio::test(start_paused = true)]
async fn a_seeded_walk_of_refused_publishes_keeps_the_version_most_agents_run_apart() {
    let (mut missing, mut reports, mut first) = (0, 0, None);
    for seed in 0..20 {
        let (m, r, f) = seeded_walk_of_refused_publishes(seed, false).await;
        (missing, reports) = (missing + m, reports + r);
        first = first.or(f.map(|f| (seed, f)));
    }
    assert!(
        missing == 0,
        "the version three of four agents run was not kept apart after {missing} of its \
         {reports} reports over 20 seeds; the first at (seed, (second, version, versions \
         listed)) {first:?}"
    );
}

/// [`seeded_walk_of_refused_publishes`] with stragglers and a client's bogus numbers.
#[tokio::test(start_paused = true)]
async fn a_seeded_walk_of_refused_publishes_and_bogus_numbers_keeps_the_version_most_agents_run_apart()
 {
    let (mut missing, mut reports, mut first) = (0, 0, None);
    for seed in 0..20 {
        let (m, r, f) = seeded_walk_of_refused_publishes(seed, true).await;
        (missing, reports) = (missing + m, reports + r);
        first = first.or(f.map(|f| (seed, f)));
    }
    assert!(
        missing == 0,
        "the version three of four agents run was not kept apart after {missing} of its \
         {reports} reports over 20 seeds; the first at (seed, (second, version, versions \
         listed)) {first:?}"
    );
}

/// A fleet of several builds, each refusing policies newer than it can read (a NACK: it stays
/// on the version it runs). Versions 8, 9 and 10 are published; most agents (three, 90 of
/// every 93 calls) refuse 9 and 10 and stay on 8; one agent takes 10, one takes 9 and refuses
/// 10, one restarted from its cache file of 6 refuses everything newer and stays on 6. All
/// report every 10 s, the fleet first in each interval. Then one more agent, restarted from
/// its cache file of 7, reports once (a straggler) and takes 10. 8, which the fleet runs,
/// stays kept apart: 7's one agent is no more than 6's or 9's.
#[tokio::test(start_paused = true)]
async fn one_straggler_report_does_not_evict_the_version_most_of_a_split_fleet_runs() {
    let (agg, svc, running) = checkout_fleet(&[(8, 3), (6, 1), (10, 1), (9, 1)]);
    agg.set_published(8);
    payments(&agg, &svc, 8, 90);
    advance(Duration::from_secs(1)).await;
    agg.set_published(9);
    agg.set_published(10);
    // One interval: the fleet on 8, the agent on 6, the one on 10, the one on 9.
    let interval = |agg: &Aggregator, svc: &ServiceHandle| {
        payments(agg, svc, 8, 90);
        payments(agg, svc, 6, 1);
        payments(agg, svc, 10, 1);
        payments(agg, svc, 9, 1);
    };
    for _ in 0..6 {
        interval(&agg, &svc);
        advance(Duration::from_secs(10)).await;
    }
    assert_eq!(listed(&agg), [10, 9, 8, 6]);
    // The straggler's one report, after the fleet's and the agent on 6's this interval.
    payments(&agg, &svc, 8, 90);
    advance(Duration::from_secs(1)).await;
    payments(&agg, &svc, 6, 1);
    advance(Duration::from_secs(1)).await;
    running.joined("checkout", 7);
    payments(&agg, &svc, 7, 1);
    assert_eq!(listed(&agg), [10, 9, 8, 6], "7 took a place");
    running.moved("checkout", 7, 10);
    advance(Duration::from_secs(8)).await;
    let mut missing = Vec::new();
    for round in 0..90u64 {
        interval(&agg, &svc);
        if !listed(&agg).contains(&8) {
            missing.push(round * 10);
        }
        advance(Duration::from_secs(10)).await;
    }
    assert!(
        missing.is_empty(),
        "version 8, which 90 of every 93 calls run under, was not kept apart after {} of its \
         90 reports over 15 minutes following one report of straggler version 7 (first at \
         {:?} s after it); versions listed at the end {:?}",
        missing.len(),
        missing.first(),
        listed(&agg)
    );
}

/// A control plane restarted on a reset store (it numbers from 1 again) publishes 1 to 3; the
/// agents ran the lost store's version 9 and refuse 3 (a NACK: it is not a policy their build
/// reads), so they stay on 9; one agent takes 3, two stragglers restarted from cache files of
/// 1 and 2 reported once and took 3. A client that numbers its reports itself sends a bogus
/// number after the fleet's report every 10 s. Version 9, which the fleet runs, stays kept
/// apart with its counts: the bogus number, which no agent runs, evicts nothing.
#[tokio::test(start_paused = true)]
async fn a_bogus_number_does_not_evict_the_version_a_fleet_runs_above_the_published_one() {
    let (agg, svc, _running) = checkout_fleet(&[(9, 5), (3, 3)]);
    for version in 1..=3 {
        agg.set_published(version);
    }
    for version in [9, 1, 2, 3] {
        payments(&agg, &svc, version, 1);
        advance(Duration::from_secs(1)).await;
    }
    advance(Duration::from_secs(6)).await;
    for _ in 0..30 {
        payments(&agg, &svc, 9, 100);
        advance(Duration::from_secs(1)).await;
        payments(&agg, &svc, 3, 1);
        advance(Duration::from_secs(1)).await;
        payments(&agg, &svc, 1_000_000, 1);
        advance(Duration::from_secs(8)).await;
    }
    let stats = agg.stats(Instant::now(), all());
    let series = &stats.series[0];
    let nine = five_minute_calls(series, 9);
    let listed: Vec<u64> = series.versions.iter().map(|v| v.policy_version).collect();
    assert!(
        // The 5-minute window's coarse buckets cover 4 to 5 minutes: at least 24 reports.
        nine.is_some_and(|calls| calls >= 2_400),
        "version 9, which the fleet runs (100 calls every 10 s for 5 minutes), listed with \
         {nine:?} calls in its 5-minute window (None: not kept apart); versions listed \
         {listed:?}"
    );
}

/// A control plane restarted (its aggregates start empty) serves version 10. The agent that
/// took 10 reports first; then a client that numbers its reports itself sends three bogus
/// numbers above 10; then the nine agents that refused 10 (a NACK) and stay on 9, most of the
/// fleet. All report every 10 s. 9, which most calls run under, is kept apart at its first
/// report, in place of a bogus number, which no agent runs.
#[tokio::test(start_paused = true)]
async fn numbers_above_the_published_one_do_not_keep_the_version_before_it_out() {
    let (agg, svc, _running) = checkout_fleet(&[(10, 1), (9, 9)]);
    agg.set_published(10);
    let mut missing = Vec::new();
    for round in 0..30u64 {
        payments(&agg, &svc, 10, 10);
        for bogus in 1_000_000..1_000_003 {
            payments(&agg, &svc, bogus, 1);
        }
        advance(Duration::from_secs(1)).await;
        payments(&agg, &svc, 9, 90);
        if !listed(&agg).contains(&9) {
            missing.push(round * 10);
        }
        advance(Duration::from_secs(9)).await;
    }
    assert_eq!(
        calls(&agg, all())[2],
        30 * 103,
        "every count is in the windows"
    );
    assert!(
        missing.is_empty(),
        "version 9, which 90 of every 103 calls run under (agents refusing the published 10), \
         was not kept apart after {} of its 30 reports (first at {:?} s) while three numbers \
         above the published one were; versions listed at the end {:?}",
        missing.len(),
        missing.first(),
        listed(&agg)
    );
}

/// A seeded 30-minute walk of a fleet of three builds (five agents, each reporting every 10 s
/// at its own phase): a publish every 2 minutes; agent 0 (the newest build) takes every one,
/// agent 1 (a build between) takes one in two, the three others (most of the fleet, the oldest
/// build) one in three (a NACK otherwise: an agent stays on the version it runs); now and then
/// a straggler of one of the six versions before the published one (a short-lived process
/// started from a cache file, connected for one report).
/// After every report of the version most agents run, it is kept apart; the windows are those
/// of the same reports under one version. Returns (reports of it not kept apart, its reports,
/// the first such (second, version, versions listed)).
async fn seeded_walk_of_a_fleet_of_three_builds(
    seed: u64,
) -> (u32, u32, Option<(u64, u64, Vec<u64>)>) {
    seeded_walk_of_a_fleet_of_three_builds_every(seed, 10).await
}

/// [`seeded_walk_of_a_fleet_of_three_builds`] over 20 seeds.
#[tokio::test(start_paused = true)]
async fn a_seeded_walk_of_a_fleet_of_three_builds_keeps_the_version_most_agents_run_apart() {
    let (mut missing, mut reports, mut first, mut seeds) = (0, 0, None, 0);
    for seed in 0..20 {
        let (m, r, f) = seeded_walk_of_a_fleet_of_three_builds(seed).await;
        (missing, reports) = (missing + m, reports + r);
        seeds += u32::from(m > 0);
        first = first.or(f.map(|f| (seed, f)));
    }
    assert!(
        missing == 0,
        "the version three of five agents run was not kept apart after {missing} of its \
         {reports} reports, in {seeds} of 20 seeds; the first at (seed, (second, version, \
         versions listed)) {first:?}"
    );
}

/// Agents told to report every 10 minutes (the report interval may be up to an hour). A fleet
/// of three builds: one agent takes every publish (12), one a build between (11), most agents
/// (nine) the oldest build, which refused 11 and 12 and stays on 10 (900 calls a report). Two
/// stragglers, short-lived processes started from cache files of 8 and 9, report once each,
/// minutes after the fleet's report. Version 10, which 900 of every 920 calls run under, stays
/// kept apart: however long ago its last report, its nine agents still run it.
#[tokio::test(start_paused = true)]
async fn with_a_report_interval_past_five_minutes_a_straggler_does_not_evict_the_version_the_fleet_runs()
 {
    let (agg, _, running) = checkout_fleet(&[(10, 9), (11, 1), (12, 1)]);
    let agg = agg.with_unknown_span(Duration::from_secs(600));
    let svc = agg.service("checkout");
    for version in 10..=12 {
        agg.set_published(version);
    }
    let straggler = |version: u64| {
        running.joined("checkout", version);
        payments(&agg, &svc, version, 1);
        running.left("checkout", version);
    };
    let mut missing = Vec::new();
    let mut listed_then = Vec::new();
    for round in 0..4u64 {
        // The fleet on 10, then the agents on 12 and 11, at their phases.
        payments(&agg, &svc, 10, 900);
        if !listed(&agg).contains(&10) {
            missing.push(round * 600);
            listed_then.push(listed(&agg));
        }
        advance(Duration::from_secs(60)).await;
        payments(&agg, &svc, 12, 10);
        advance(Duration::from_secs(60)).await;
        payments(&agg, &svc, 11, 10);
        advance(Duration::from_secs(180)).await;
        if round == 0 {
            // The stragglers, once each.
            straggler(8);
            advance(Duration::from_secs(60)).await;
            straggler(9);
            advance(Duration::from_secs(240)).await;
        } else {
            advance(Duration::from_secs(300)).await;
        }
    }
    assert_eq!(
        agg.stats(Instant::now(), all()).series[0]
            .lifetime
            .as_ref()
            .map_or(0, |c| c.calls),
        4 * 920 + 2,
        "every report counted once"
    );
    assert!(
        missing.is_empty(),
        "version 10, which 900 of every 920 calls run under (report interval 10 minutes), was \
         not kept apart after its reports at {missing:?} s, following one report each of \
         stragglers 8 and 9; versions listed then {listed_then:?}"
    );
}

/// A control plane restarted (its aggregates start empty; its store serves version 14). A
/// fleet of three builds: one agent took every publish (14), one a build between took 13,
/// most agents (nine of the oldest build, 90 calls a report) refused every publish since 10
/// and stay on 10; two agents restarted from cache files of 12 and 11 report once, then take
/// 14. In the first interval after the restart the agents on 14 and 13 and the two
/// stragglers happen to report before the fleet, taking the four places. Version 10 is kept
/// apart from the fleet's first report on, in place of 11 or 12, which no agent runs by then.
#[tokio::test(start_paused = true)]
async fn after_a_restart_the_version_the_fleet_runs_is_kept_apart_though_newer_ones_reported_first()
{
    let (agg, svc, running) = checkout_fleet(&[(14, 1), (13, 1), (10, 9)]);
    agg.set_published(14);
    for version in [14, 13, 12, 11] {
        if version < 13 {
            running.joined("checkout", version);
        }
        payments(&agg, &svc, version, 1);
        advance(Duration::from_secs(1)).await;
    }
    for version in [12, 11] {
        running.moved("checkout", version, 14);
    }
    let mut missing = Vec::new();
    for round in 0..90u64 {
        payments(&agg, &svc, 10, 90);
        if !listed(&agg).contains(&10) {
            missing.push(round * 10);
        }
        advance(Duration::from_secs(1)).await;
        payments(&agg, &svc, 14, 5);
        payments(&agg, &svc, 13, 5);
        advance(Duration::from_secs(9)).await;
    }
    assert_eq!(
        agg.stats(Instant::now(), all()).series[0]
            .lifetime
            .as_ref()
            .map_or(0, |c| c.calls),
        4 + 90 * 100,
        "every report counted once"
    );
    assert!(
        missing.is_empty(),
        "version 10, which 90 of every 100 calls run under, was not kept apart after {} of \
         its 90 reports in the 15 minutes after a restart (first at {:?} s, last at {:?} s); \
         versions listed at the end {:?}",
        missing.len(),
        missing.first(),
        missing.last(),
        listed(&agg)
    );
}

/// [`seeded_walk_of_a_fleet_of_three_builds`] with agents told to report every `interval`
/// (the walk's time scaled by `interval / 10 s`: a publish every 12 intervals, the agents'
/// phases and the stragglers' rate as many intervals apart). Returns the same.
async fn seeded_walk_of_a_fleet_of_three_builds_every(
    seed: u64,
    interval: u64,
) -> (u32, u32, Option<(u64, u64, Vec<u64>)>) {
    let step = interval / 10;
    let (agg, _, running) = checkout_fleet(&[(10, 5)]);
    let agg = agg.with_unknown_span(Duration::from_secs(interval));
    let svc = agg.service("checkout");
    let same = Aggregator::new(10, Instant::now(), Arc::default())
        .with_unknown_span(Duration::from_secs(interval));
    let same_svc = same.service("checkout");
    let mut seed: u64 = 0x5eed_0093 ^ seed;
    let mut next = |n: u64| {
        seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (seed >> 33) % n
    };
    let mut published = 10u64;
    agg.set_published(published);
    // The version each agent runs; agents 2 to 4 are most of the fleet and move together.
    let (mut newest, mut between, mut most) = (published, published, published);
    let phases = [0u64, 2, 4, 6, 8];
    let (mut reports, mut missing, mut first_missing) = (0u32, 0u32, None);
    for k in 0..1_800u64 {
        if k > 0 && k % 120 == 0 {
            published += 1;
            agg.set_published(published);
            running.moved("checkout", newest, published);
            newest = published;
            if next(2) == 0 {
                running.moved("checkout", between, published);
                between = published;
            }
            if next(3) == 0 {
                for _ in 2..phases.len() {
                    running.moved("checkout", most, published);
                }
                most = published;
            }
        }
        let mut batch = Vec::new();
        for (agent, &phase) in phases.iter().enumerate() {
            if k % 10 == phase {
                let version = match agent {
                    0 => newest,
                    1 => between,
                    _ => most,
                };
                let calls = if agent >= 2 {
                    30 + next(20)
                } else {
                    1 + next(5)
                };
                batch.push((version, calls));
            }
        }
        if next(30) == 0 {
            batch.push((published.saturating_sub(1 + next(6)).max(10), 0));
        }
        for (version, calls) in batch {
            // A straggler (no calls given): a short-lived process started from a cache file,
            // connected for one report of one call.
            let straggler = calls == 0;
            let r = report(version, &[("payments", calls.max(1), next(3))]);
            if straggler {
                running.joined("checkout", version);
            }
            agg.ingest(&svc, &r, Instant::now());
            if straggler {
                running.left("checkout", version);
            }
            let mut r = r;
            r.policy_version = 1;
            same.ingest(&same_svc, &r, Instant::now());
            if version == most {
                reports += 1;
                if !listed(&agg).contains(&most) {
                    missing += 1;
                    first_missing.get_or_insert((k * step, most, listed(&agg)));
                }
            }
            let (a, b) = (
                &agg.views(Instant::now(), all())[0],
                &same.views(Instant::now(), all())[0],
            );
            assert_eq!(
                a.windows.map(|(c, covered)| (c.0, covered)),
                b.windows.map(|(c, covered)| (c.0, covered)),
                "windows at {} s",
                k * step
            );
            assert_eq!(a.lifetime.0, b.lifetime.0, "lifetime at {} s", k * step);
        }
        advance(Duration::from_secs(step)).await;
    }
    (missing, reports, first_missing)
}

/// [`seeded_walk_of_a_fleet_of_three_builds_every`] 10 minutes (a report interval past the
/// 5-minute window; agents may be told up to an hour), over 20 seeds.
#[tokio::test(start_paused = true)]
async fn a_seeded_walk_of_a_fleet_of_three_builds_reporting_every_ten_minutes_keeps_the_version_most_agents_run_apart()
 {
    let (mut missing, mut reports, mut first, mut seeds) = (0, 0, None, 0);
    for seed in 0..20 {
        let (m, r, f) = seeded_walk_of_a_fleet_of_three_builds_every(seed, 600).await;
        (missing, reports) = (missing + m, reports + r);
        seeds += u32::from(m > 0);
        first = first.or(f.map(|f| (seed, f)));
    }
    assert!(
        missing == 0,
        "the version three of five agents run (reporting every 10 minutes) was not kept apart \
         after {missing} of its {reports} reports, in {seeds} of 20 seeds; the first at (seed, \
         (second, version, versions listed)) {first:?}"
    );
}

/// A control plane restarted on a reset store (it numbers from 1 again) publishes 1 to 3; its
/// fleet of three builds ran the lost store's versions and refuses 3 (a NACK): most agents stay
/// on 9 (90 calls a report), another build on 8 (20), a third, one agent, on 7 (10); one agent
/// takes 3 (1). A client that numbers its reports itself sends a bogus number after the
/// fleet's report every 10 s. Version 7, which a build of the fleet runs, stays kept apart
/// with its counts: the bogus number, which no agent runs, does not evict it.
#[tokio::test(start_paused = true)]
async fn a_bogus_number_does_not_evict_the_low_volume_build_of_a_fleet_above_the_published_one() {
    let (agg, svc, _running) = checkout_fleet(&[(9, 9), (8, 2), (7, 1), (3, 1)]);
    for version in 1..=3 {
        agg.set_published(version);
    }
    for _ in 0..30 {
        payments(&agg, &svc, 9, 90);
        payments(&agg, &svc, 8, 20);
        payments(&agg, &svc, 7, 10);
        payments(&agg, &svc, 3, 1);
        advance(Duration::from_secs(1)).await;
        payments(&agg, &svc, 1_000_000, 1);
        advance(Duration::from_secs(9)).await;
    }
    let stats = agg.stats(Instant::now(), all());
    let series = &stats.series[0];
    let seven = five_minute_calls(series, 7);
    let listed: Vec<u64> = series.versions.iter().map(|v| v.policy_version).collect();
    assert_eq!(
        series.lifetime.as_ref().map_or(0, |c| c.calls),
        30 * 122,
        "every report counted once"
    );
    assert!(
        // The 5-minute window's coarse buckets cover 4 to 5 minutes: at least 24 reports.
        seven.is_some_and(|calls| calls >= 240),
        "version 7, which a build of the fleet runs (10 calls every 10 s for 5 minutes), \
         listed with {seven:?} calls in its 5-minute window (None: not kept apart); versions \
         listed {listed:?}"
    );
}

/// A control plane restarted (its aggregates start empty; its store serves 14).
/// Most of the fleet (30 agents, 10 calls each every 10 s: 300 of every 350 calls) refused
/// every publish since 10 and stays on 10; one agent took 14, one 13, and two other builds run
/// 12 and 11, one busier agent each (20 calls every 10 s). In the first interval after the
/// restart the agents on 14, 13, 12 and 11 happen to report before the fleet's, taking the four
/// places. Each report of 10 is one agent's, fewer calls than 12's or 11's, but 10 is run by
/// 30 agents: it is kept apart at the first of them, in place of 11 or 12.
#[tokio::test(start_paused = true)]
async fn after_a_restart_the_version_many_small_agents_run_is_kept_apart_though_each_reports_little()
 {
    let (agg, svc, _running) = checkout_fleet(&[(14, 1), (13, 1), (12, 1), (11, 1), (10, 30)]);
    agg.set_published(14);
    let mut missing = Vec::new();
    for round in 0..90u64 {
        payments(&agg, &svc, 14, 5);
        payments(&agg, &svc, 13, 5);
        payments(&agg, &svc, 12, 20);
        payments(&agg, &svc, 11, 20);
        advance(Duration::from_secs(1)).await;
        for _ in 0..30 {
            payments(&agg, &svc, 10, 10);
        }
        if !listed(&agg).contains(&10) {
            missing.push(round * 10);
        }
        advance(Duration::from_secs(9)).await;
    }
    assert_eq!(
        agg.stats(Instant::now(), all()).series[0]
            .lifetime
            .as_ref()
            .map_or(0, |c| c.calls),
        90 * 350,
        "every report counted once"
    );
    assert!(
        missing.is_empty(),
        "version 10, which 30 of 34 agents run (300 of every 350 calls), was not kept apart \
         after {} of its 90 intervals in the 15 minutes after a restart (first at {:?} s); \
         versions listed at the end {:?}",
        missing.len(),
        missing.first(),
        listed(&agg)
    );
}

/// Published 12: one agent on 12, one on 11; most of the fleet (ten agents) on 10 (50
/// calls/s); a build of five agents on 9 (10 calls each every 10 s: 5 calls/s together). One
/// straggler restarted from a cache file of 7, busier than the rest, reports once: 60 calls
/// over 10 s (6 calls/s, more than 9's 5), then takes 12. Its one agent is no more than 11's:
/// it takes no place, and 9 stays kept apart.
#[tokio::test(start_paused = true)]
async fn one_busy_straggler_report_does_not_evict_a_live_build() {
    let missing =
        a_build_of_five_after_a_straggler(&report(7, &[("payments", 60, 0)]), Some(12)).await;
    assert!(
        missing.is_empty(),
        "version 9, which a build of five agents runs (50 calls every 10 s), was not kept \
         apart after the intervals at {missing:?} s of the 15 minutes after one report of \
         straggler 7"
    );
}

/// As [`one_busy_straggler_report_does_not_evict_a_live_build`], with a
/// straggler that is gone: an agent on 7, shut down, flushes its last report, 20 calls made
/// over the last 200 ms before it stopped. 9, which five agents run, stays kept apart.
#[tokio::test(start_paused = true)]
async fn a_short_last_report_of_a_stopped_straggler_does_not_evict_a_live_build() {
    let flush = spanning(
        report(7, &[("payments", 20, 0)]),
        1_700_000_000_000,
        1_700_000_000_200,
    );
    let missing = a_build_of_five_after_a_straggler(&flush, None).await;
    assert!(
        missing.is_empty(),
        "version 9, which a build of five agents runs (50 calls every 10 s), was not kept \
         apart after the intervals at {missing:?} s after a stopped straggler's last report \
         of 20 calls over 200 ms under 7"
    );
}

/// Published 12, reported every 10 s for 5 minutes by one agent on 12, one on 11, most of the
/// fleet (ten agents) on 10 (500 calls) and a build of five agents on 9 (10 calls each); then
/// `straggler` once, a second into an interval (one agent on its version while it reports,
/// which then takes version `then`, or disconnects), and 90 more intervals. Returns the
/// offsets (s) of the intervals after which 9 was not kept apart.
async fn a_build_of_five_after_a_straggler(
    straggler: &pb::MetricsReport,
    then: Option<u64>,
) -> Vec<u64> {
    let (agg, svc, running) = checkout_fleet(&[(12, 1), (11, 1), (10, 10), (9, 5)]);
    for version in 9..=12 {
        agg.set_published(version);
    }
    let interval = |agg: &Aggregator, svc: &ServiceHandle| {
        payments(agg, svc, 12, 5);
        payments(agg, svc, 11, 5);
        payments(agg, svc, 10, 500);
        for _ in 0..5 {
            payments(agg, svc, 9, 10);
        }
    };
    for _ in 0..30 {
        interval(&agg, &svc);
        advance(Duration::from_secs(10)).await;
    }
    assert_eq!(listed(&agg), [12, 11, 10, 9]);
    advance(Duration::from_secs(1)).await;
    running.joined("checkout", straggler.policy_version);
    agg.ingest(&svc, straggler, Instant::now());
    assert_eq!(listed(&agg), [12, 11, 10, 9], "the straggler took a place");
    match then {
        Some(version) => running.moved("checkout", straggler.policy_version, version),
        None => running.left("checkout", straggler.policy_version),
    }
    advance(Duration::from_secs(9)).await;
    let mut missing = Vec::new();
    for round in 0..90u64 {
        interval(&agg, &svc);
        if !listed(&agg).contains(&9) {
            missing.push(round * 10);
        }
        advance(Duration::from_secs(10)).await;
    }
    missing
}

/// Runs 90 intervals of 10 s after a restart of the control plane (aggregates empty, the store
/// publishes 4): each interval, one agent on each of `few` (with the calls given for it)
/// reports first, then, a second later, 30 agents on `fleet` (10 calls each). Returns the
/// offsets (s) of the intervals after which `fleet` was not kept apart, and the series'
/// lifetime calls.
async fn after_a_restart_a_fleet_of_small_agents(
    fleet: u64,
    few: &[(u64, u64)],
) -> (Vec<u64>, u64) {
    let mut agents: Vec<(u64, u64)> = few.iter().map(|&(version, _)| (version, 1)).collect();
    agents.push((fleet, 30));
    let (agg, svc, _running) = checkout_fleet(&agents);
    agg.set_published(4);
    let mut missing = Vec::new();
    for round in 0..90u64 {
        for &(version, calls) in few {
            payments(&agg, &svc, version, calls);
        }
        advance(Duration::from_secs(1)).await;
        for _ in 0..30 {
            payments(&agg, &svc, fleet, 10);
        }
        if !listed(&agg).contains(&fleet) {
            missing.push(round * 10);
        }
        advance(Duration::from_secs(9)).await;
    }
    let lifetime = lifetime_calls(&agg);
    (missing, lifetime)
}

/// A control plane restarted on a reset store (it publishes 4) while two builds of the lost
/// store still run: 20 (one agent, 100 calls every 10 s) and 21 (one agent, 50 calls every
/// 10 s), both numbered above 4; one agent on 4 and one on 3 (5 calls each). Most of the fleet
/// (30 agents, 10 calls each every 10 s: 300 of every 460 calls) stays on 2, and reports
/// last. 2 is kept apart at its first report, in place of one of the builds one agent runs,
/// however few calls each of its reports carries.
#[tokio::test(start_paused = true)]
async fn while_a_number_above_the_published_one_is_kept_the_version_many_agents_run_gets_a_place() {
    let (missing, lifetime) =
        after_a_restart_a_fleet_of_small_agents(2, &[(20, 100), (4, 5), (3, 5), (21, 50)]).await;
    assert_eq!(lifetime, 90 * 460, "every report counted once");
    assert!(
        missing.is_empty(),
        "version 2, which 30 of 34 agents run (300 of every 460 calls), was not kept apart \
         after {} of its 90 intervals (first at {:?} s, last at {:?} s) while 21 (one agent, \
         50 calls) was",
        missing.len(),
        missing.first(),
        missing.last()
    );
}

/// As [`while_a_number_above_the_published_one_is_kept_the_version_many_agents_run_gets_a_place`],
/// with most of the fleet on a build of the lost store: 30 agents (10 calls each every 10 s)
/// on 20, above the published 4, while one agent each on 4 and 3 (5 calls) and on 2 and on
/// another number above 4, or on 2 and 1 (50 calls every 10 s each), report first. 20, which
/// 300 of every 410 calls run under, is kept apart at its first report, whether or not another
/// number above the published one is kept.
#[tokio::test(start_paused = true)]
async fn after_a_restart_a_lost_store_build_many_small_agents_run_is_kept_apart() {
    for other in [21, 1] {
        let (missing, lifetime) =
            after_a_restart_a_fleet_of_small_agents(20, &[(4, 5), (3, 5), (2, 50), (other, 50)])
                .await;
        assert_eq!(lifetime, 90 * 410, "every report counted once");
        assert!(
            missing.is_empty(),
            "version 20, which 30 of 34 agents run (300 of every 410 calls), was not kept apart \
             after {} of its 90 intervals (first at {:?} s, last at {:?} s), beside {other}",
            missing.len(),
            missing.first(),
            missing.last()
        );
    }
}

/// After a restart on a reset store (it publishes 4), most of the fleet runs the lost store's
/// 20 (30 agents, 10 calls each every 10 s), kept apart with 4 and 3 (one agent each, 5
/// calls) and a busy build on 2 (five agents, 500 calls every 10 s). One client reports a
/// bogus 999 once: 400 calls, more than any of 20's reports. No agent runs 999: it takes no
/// place, and 20 stays kept apart.
#[tokio::test(start_paused = true)]
async fn one_bogus_report_does_not_take_the_place_of_a_lost_store_build_most_of_the_fleet_runs() {
    let (agg, svc, _running) = checkout_fleet(&[(4, 1), (3, 1), (2, 5), (20, 30)]);
    agg.set_published(4);
    let interval = |agg: &Aggregator, svc: &ServiceHandle| {
        payments(agg, svc, 4, 5);
        payments(agg, svc, 3, 5);
        payments(agg, svc, 2, 500);
        for _ in 0..30 {
            payments(agg, svc, 20, 10);
        }
    };
    for _ in 0..30 {
        interval(&agg, &svc);
        advance(Duration::from_secs(10)).await;
    }
    assert_eq!(listed(&agg), [20, 4, 3, 2]);
    advance(Duration::from_secs(1)).await;
    payments(&agg, &svc, 999, 400);
    advance(Duration::from_secs(9)).await;
    let mut missing = Vec::new();
    for round in 0..90u64 {
        interval(&agg, &svc);
        if !listed(&agg).contains(&20) {
            missing.push(round * 10);
        }
        advance(Duration::from_secs(10)).await;
    }
    let lifetime = lifetime_calls(&agg);
    assert_eq!(lifetime, 120 * 810 + 400, "every report counted once");
    assert!(
        missing.is_empty(),
        "version 20, which 30 of 37 agents run, was not kept apart after {} of the 90 \
         intervals after one bogus report of 999 (first at {:?} s, last at {:?} s); listed \
         at the end {:?}",
        missing.len(),
        missing.first(),
        missing.last(),
        listed(&agg)
    );
}

/// Published 100: one agent each on 100 and 99 (5 calls every 10 s), and two old builds of
/// five agents each on 9 and 8 (10 calls each every 10 s). One misbehaving client reports a
/// different old number below the published one every second (10 to 49, 40 calls each). After
/// 30 s, 30 agents of a new deployment on 50 connect, 10 calls each every 10 s, their reports
/// spread over the interval (three a second). 50 is kept apart from its first report on: the
/// client's numbers, which no agent runs, never take a place, however many they are.
#[tokio::test(start_paused = true)]
async fn a_run_of_bogus_numbers_does_not_keep_the_version_most_of_the_fleet_moves_to_out() {
    let (agg, svc, running) = checkout_fleet(&[(100, 1), (99, 1), (9, 5), (8, 5)]);
    agg.set_published(100);
    let mut bogus = (10..50u64).cycle();
    let mut missing = Vec::new();
    let mut total = 0u64;
    for second in 0..120u64 {
        if second % 10 == 0 {
            payments(&agg, &svc, 100, 5);
            payments(&agg, &svc, 99, 5);
            for _ in 0..5 {
                payments(&agg, &svc, 9, 10);
                payments(&agg, &svc, 8, 10);
            }
            total += 110;
        }
        if second == 30 {
            for _ in 0..30 {
                running.joined("checkout", 50);
            }
        }
        if second >= 30 {
            for _ in 0..3 {
                payments(&agg, &svc, 50, 10);
            }
            total += 30;
            if !listed(&agg).contains(&50) {
                missing.push(second);
            }
        }
        payments(&agg, &svc, bogus.next().unwrap_or(10), 40);
        total += 40;
        advance(Duration::from_secs(1)).await;
    }
    let lifetime = lifetime_calls(&agg);
    assert_eq!(lifetime, total, "every report counted once");
    assert!(
        missing.is_empty(),
        "version 50, which 30 of 42 agents run, was not kept apart after its reports at {} \
         of 90 seconds (first at {:?} s, last at {:?} s); listed at the end {:?}",
        missing.len(),
        missing.first(),
        missing.last(),
        listed(&agg)
    );
}

/// After a restart of the control plane (aggregates empty, published 12): one agent each on 12
/// and 11 (5 calls every 10 s), and two builds of five agents on 9 and 8 (50 calls every 10 s
/// each) report first and take the four places. Most of the fleet runs 10: 30 agents, 10 calls
/// each every 10 s. The first of them to report was cut off for 30 minutes and sends what it
/// counted meanwhile in one report spanning 1,800 s. 10 is kept apart at that first report:
/// its agents, not its calls per second, decide.
#[tokio::test(start_paused = true)]
async fn one_agents_backlog_does_not_keep_the_version_the_fleet_runs_out() {
    let (agg, svc, _running) = checkout_fleet(&[(12, 1), (11, 1), (9, 5), (8, 5), (10, 30)]);
    agg.set_published(12);
    let mut missing = Vec::new();
    for round in 0..90u64 {
        payments(&agg, &svc, 12, 5);
        payments(&agg, &svc, 11, 5);
        payments(&agg, &svc, 9, 50);
        payments(&agg, &svc, 8, 50);
        advance(Duration::from_secs(1)).await;
        if round == 0 {
            // Its first report on the new stream: 30 minutes, 1 call/s.
            let backlog = spanning(
                report(10, &[("payments", 1_800, 0)]),
                1_700_000_000_000,
                1_700_000_000_000 + 1_800_000,
            );
            agg.ingest(&svc, &backlog, Instant::now());
        } else {
            payments(&agg, &svc, 10, 10);
        }
        if !listed(&agg).contains(&10) {
            missing.push(round * 10);
        }
        for _ in 0..29 {
            payments(&agg, &svc, 10, 10);
        }
        advance(Duration::from_secs(9)).await;
    }
    let lifetime = lifetime_calls(&agg);
    assert_eq!(lifetime, 90 * 410 + 1_800 - 10, "every report counted once");
    assert!(
        missing.is_empty(),
        "version 10, which 30 of 42 agents run, was not kept apart after {} of its 90 \
         intervals (first at {:?} s, last at {:?} s) because one of its agents' first report \
         was a 30-minute backlog",
        missing.len(),
        missing.first(),
        missing.last()
    );
}

/// After a restart of the control plane (published 12): one agent each on 12 and 11 (5 calls
/// every 10 s), and two builds of five agents on 9 and 8 (50 calls every 10 s each) report
/// first each interval and take the four places. From 30 s on, a third build, 11 agents on 7,
/// reports a second after them, 5 calls each (55 every 10 s: about as busy as 9 or 8). 7 is
/// kept apart from its first report on, in place of 11 (one agent), however alike the calls
/// per second: the agents decide, the calls only between versions as many agents run.
#[tokio::test(start_paused = true)]
async fn a_build_more_agents_run_is_kept_apart_at_its_first_report_though_no_busier() {
    let (agg, svc, running) = checkout_fleet(&[(12, 1), (11, 1), (9, 5), (8, 5)]);
    agg.set_published(12);
    let mut missing = Vec::new();
    for round in 0..30u64 {
        payments(&agg, &svc, 12, 5);
        payments(&agg, &svc, 11, 5);
        payments(&agg, &svc, 9, 50);
        payments(&agg, &svc, 8, 50);
        advance(Duration::from_secs(1)).await;
        if round == 3 {
            for _ in 0..11 {
                running.joined("checkout", 7);
            }
        }
        if round >= 3 {
            for _ in 0..11 {
                payments(&agg, &svc, 7, 5);
            }
            if !listed(&agg).contains(&7) {
                missing.push(round * 10);
            }
        }
        advance(Duration::from_secs(9)).await;
    }
    assert_eq!(
        listed(&agg),
        [12, 9, 8, 7],
        "11, which one agent runs, made room"
    );
    assert!(
        missing.is_empty(),
        "version 7 (11 agents) was not kept apart after {} of 27 intervals (first at {:?} s, \
         last at {:?} s) while 9 and 8 (five agents each) were",
        missing.len(),
        missing.first(),
        missing.last()
    );
}

/// The versions the series of `service`/`endpoint` keeps apart, in ascending order.
fn versions_of(agg: &Aggregator, service: &str, endpoint: &str) -> Vec<u64> {
    let stats = agg.stats(Instant::now(), all());
    let mut v: Vec<u64> = stats
        .series
        .iter()
        .find(|s| s.service == service && s.endpoint == endpoint)
        .map(|s| s.versions.iter().map(|v| v.policy_version).collect())
        .unwrap_or_default();
    v.sort_unstable();
    v
}

/// Of the kept versions, the one the fewest agents run goes, though it is the busiest; not the
/// quietest, which more agents run. Published 5 (ten agents); 4: one agent, 100 calls every
/// 10 s; 3 and 2: five agents each, one call every 10 s. Three agents start on 1 (a build
/// refusing everything newer): 1 evicts 4. (Choosing the victim by calls per second first
/// would pick 3 or 2, which more agents run than 1, and turn 1 away.)
#[tokio::test(start_paused = true)]
async fn the_kept_version_fewest_agents_run_goes_though_it_is_the_busiest() {
    let (agg, svc, running) = checkout_fleet(&[(5, 10), (4, 1), (3, 5), (2, 5)]);
    agg.set_published(5);
    for _ in 0..6 {
        payments(&agg, &svc, 5, 50);
        payments(&agg, &svc, 4, 100);
        payments(&agg, &svc, 3, 1);
        payments(&agg, &svc, 2, 1);
        advance(Duration::from_secs(10)).await;
    }
    assert_eq!(versions_of(&agg, "checkout", "payments"), [2, 3, 4, 5]);
    for _ in 0..3 {
        running.joined("checkout", 1);
    }
    payments(&agg, &svc, 1, 1);
    assert_eq!(
        versions_of(&agg, "checkout", "payments"),
        [1, 2, 3, 5],
        "4, which one agent runs, made room for 1 (three agents), though 4 is the busiest"
    );
}

/// The published version is never evicted: published 5, which one agent has taken so far (the
/// first ACK of a rollout); 4, 3 and 2 run by ten agents each. Two agents start on 1: 1 is
/// turned away, as it would evict a version more agents run than it; never 5, which fewer run
/// than 1.
#[tokio::test(start_paused = true)]
async fn the_published_version_is_not_evicted_though_the_fewest_agents_run_it() {
    let (agg, svc, running) = checkout_fleet(&[(5, 1), (4, 10), (3, 10), (2, 10)]);
    agg.set_published(5);
    for version in [4, 3, 2, 5] {
        payments(&agg, &svc, version, 10);
        advance(Duration::from_secs(1)).await;
    }
    assert_eq!(versions_of(&agg, "checkout", "payments"), [2, 3, 4, 5]);
    running.joined("checkout", 1);
    running.joined("checkout", 1);
    payments(&agg, &svc, 1, 1_000);
    assert_eq!(
        versions_of(&agg, "checkout", "payments"),
        [2, 3, 4, 5],
        "5 is published: never evicted, though one agent runs it and two run 1"
    );
}

/// A series goes by the agents of its own service: `search` has fifty agents on 1,
/// `checkout` none. Both series are full with 5 (published), 4, 3 and 2 (two agents each, of
/// `checkout`). A late report of 1 from a `checkout` agent takes no place in `checkout`'s: no
/// agent of `checkout` runs 1. `search`'s report of 1 takes a place in `search`'s, though
/// `checkout` runs none of it.
#[tokio::test(start_paused = true)]
async fn a_series_goes_by_the_agents_of_its_own_service() {
    let (agg, checkout, running) = checkout_fleet(&[(5, 2), (4, 2), (3, 2), (2, 2)]);
    for _ in 0..50 {
        running.joined("search", 1);
    }
    agg.set_published(5);
    let search = agg.service("search");
    for version in [5, 4, 3, 2] {
        payments(&agg, &checkout, version, 10);
        payments(&agg, &search, version, 10);
        advance(Duration::from_secs(1)).await;
    }
    payments(&agg, &checkout, 1, 10);
    assert_eq!(
        versions_of(&agg, "checkout", "payments"),
        [2, 3, 4, 5],
        "no agent of checkout runs 1"
    );
    payments(&agg, &search, 1, 10);
    assert!(
        versions_of(&agg, "search", "payments").contains(&1),
        "fifty agents of search run 1: {:?}",
        versions_of(&agg, "search", "payments")
    );
}

/// The `other` series' reports come from every service, so it goes by the agents of every
/// service. Its four places are taken by one report each of 2, 3, 4 and 5 from an agent whose
/// service name is too long; 1, which agents of `checkout` (not the long name's) run, takes a
/// place there; 7, which none runs, takes none.
#[tokio::test(start_paused = true)]
async fn the_other_series_goes_by_the_agents_of_every_service() {
    let (agg, _checkout, running) = checkout_fleet(&[(1, 3)]);
    let long = "s".repeat(MAX_NAME_LEN + 1);
    for version in [2, 3, 4, 5] {
        running.joined(&long, version);
    }
    let svc = agg.service(&long);
    for version in [2, 3, 4, 5] {
        payments(&agg, &svc, version, 10);
        advance(Duration::from_secs(1)).await;
    }
    assert_eq!(versions_of(&agg, OTHER, OTHER), [2, 3, 4, 5]);
    payments(&agg, &svc, 7, 10);
    assert_eq!(versions_of(&agg, OTHER, OTHER), [2, 3, 4, 5]);
    payments(&agg, &svc, 1, 10);
    assert!(
        versions_of(&agg, OTHER, OTHER).contains(&1),
        "three agents run 1, one each of the kept: {:?}",
        versions_of(&agg, OTHER, OTHER)
    );
}

/// After a restart of the control plane (aggregates empty, published 12) its agents
/// reconnect one by one, each sending the reports it held while the control plane was down
/// right after its Hello. The agents on 12 and 11 (one each) and on 9 and 8 (one each:
/// short-lived processes started from cache files) happen to reconnect first and take the
/// four places. Then the fleet's 30 agents on 10 reconnect, one a second, each with its held
/// report (60 calls). At its first agent's report one agent runs 10, as many as each of 11, 9
/// and 8: a tie, and the kept version stays (the series module docs say so), so that agent's
/// report is in the series' totals but not 10's own; from the second agent on 10 is kept
/// apart, and every later report is 10's.
#[tokio::test(start_paused = true)]
async fn after_a_restart_the_fleets_version_is_kept_apart_from_its_second_reconnecting_agent() {
    let (agg, svc, running) = checkout_fleet(&[]);
    agg.set_published(12);
    for version in [12, 11, 9, 8] {
        running.joined("checkout", version);
        payments(&agg, &svc, version, 5);
        advance(Duration::from_millis(200)).await;
    }
    assert_eq!(versions_of(&agg, "checkout", "payments"), [8, 9, 11, 12]);
    let mut missing = Vec::new();
    for agent in 0..30u64 {
        running.joined("checkout", 10);
        payments(&agg, &svc, 10, 60);
        if !versions_of(&agg, "checkout", "payments").contains(&10) {
            missing.push(agent);
        }
        advance(Duration::from_secs(1)).await;
    }
    let stats = agg.stats(Instant::now(), all());
    let ten = stats.series[0]
        .versions
        .iter()
        .find(|v| v.policy_version == 10)
        .and_then(|v| v.lifetime.as_ref())
        .map_or(0, |c| c.calls);
    assert_eq!(missing, [0], "10 kept apart from its second agent on");
    assert_eq!(
        ten,
        29 * 60,
        "10's own calls: all but its first agent's report"
    );
    assert_eq!(
        lifetime_calls(&agg),
        4 * 5 + 30 * 60,
        "every report in the series' totals"
    );
}

/// Of kept versions run by as many agents, the one with the fewer calls per second goes, though it
/// is the most recently counted: 1, 2, 3 and 4 (one agent each) first counted together, 1 with 1
/// call, the others 10; 10 s on, one more call of 1 (now counted last). 5, which two agents run,
/// evicts 1, not 2 (the least recently counted of the busier ones).
#[tokio::test(start_paused = true)]
async fn of_kept_versions_alike_in_agents_the_quietest_goes_though_counted_last() {
    let (agg, svc, _running) = checkout_fleet(&[(1, 1), (2, 1), (3, 1), (4, 1), (5, 2)]);
    payments(&agg, &svc, 1, 1);
    for version in [2, 3, 4] {
        payments(&agg, &svc, version, 10);
    }
    advance(Duration::from_secs(10)).await;
    payments(&agg, &svc, 1, 1);
    assert_eq!(versions_of(&agg, "checkout", "payments"), [1, 2, 3, 4]);
    payments(&agg, &svc, 5, 1);
    assert_eq!(versions_of(&agg, "checkout", "payments"), [2, 3, 4, 5]);
}

/// Nothing published (published 0) and a kept version 0 (agents on their fallback): 0 is a kept
/// version like any other, evicted when it is the one fewest agents run and more run the newcomer;
/// a report of 0 once evicted takes no place back while it is run by no more agents than the kept
/// ones fewest run.
#[tokio::test(start_paused = true)]
async fn with_nothing_published_a_kept_version_0_goes_as_any_other() {
    let (agg, svc, running) = checkout_fleet(&[(0, 1), (1, 2), (2, 2), (3, 2)]);
    for version in [0, 1, 2, 3] {
        payments(&agg, &svc, version, 10);
        advance(Duration::from_secs(1)).await;
    }
    assert_eq!(versions_of(&agg, "checkout", "payments"), [0, 1, 2, 3]);
    for _ in 0..2 {
        running.joined("checkout", 4);
    }
    payments(&agg, &svc, 4, 10);
    assert_eq!(
        versions_of(&agg, "checkout", "payments"),
        [1, 2, 3, 4],
        "0 (one agent) made room for 4 (two)"
    );
    running.joined("checkout", 0);
    payments(&agg, &svc, 0, 10);
    assert_eq!(
        versions_of(&agg, "checkout", "payments"),
        [1, 2, 3, 4],
        "two agents on 0, as many as on each kept one: a tie keeps the kept"
    );
    running.joined("checkout", 0);
    payments(&agg, &svc, 0, 10);
    assert_eq!(
        versions_of(&agg, "checkout", "payments").len(),
        4,
        "{:?}",
        versions_of(&agg, "checkout", "payments")
    );
    assert!(
        versions_of(&agg, "checkout", "payments").contains(&0),
        "three agents on 0: it takes a place"
    );
}

/// Published 0 is no version: a report of 0 with no agent on it takes no place, though 0 ==
/// published (no place is given to "the published version" when nothing is published).
#[tokio::test(start_paused = true)]
async fn with_nothing_published_a_report_of_0_no_agent_runs_takes_no_place() {
    let (agg, svc, _running) = checkout_fleet(&[(1, 1), (2, 1), (3, 1), (4, 1)]);
    for version in [1, 2, 3, 4] {
        payments(&agg, &svc, version, 10);
        advance(Duration::from_secs(1)).await;
    }
    payments(&agg, &svc, 0, 10);
    assert_eq!(versions_of(&agg, "checkout", "payments"), [1, 2, 3, 4]);
}

/// A report under a number above the published version (a client's bogus one) is kept apart,
/// but does not head the series while a published version has counts in it; a series with
/// counts under that number alone is shown under it.
#[tokio::test(start_paused = true)]
async fn a_version_above_the_published_one_does_not_head_a_series_with_a_published_ones_counts() {
    let (agg, svc, _running) = checkout_fleet(&[(1, 1)]);
    agg.set_published(1);
    payments(&agg, &svc, 999, 1);
    payments(&agg, &svc, 1, 1);
    let other = agg.service("billing");
    payments(&agg, &other, 999, 1);
    let stats = agg.stats(Instant::now(), all());
    let shown = |service: &str| {
        stats
            .series
            .iter()
            .find(|s| s.service == service)
            .map(|s| s.policy_version)
    };
    assert_eq!(shown("checkout"), Some(1));
    assert_eq!(versions_of(&agg, "checkout", "payments"), [1, 999]);
    assert_eq!(shown("billing"), Some(999));
}
