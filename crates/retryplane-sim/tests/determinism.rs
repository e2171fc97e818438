//! The same inputs give the same output, byte for byte, whatever instant stands for time 0.

// clippy's allow-*-in-tests covers `#[test]` functions only; the helpers here are tests too.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use retryplane_policy::RetryPolicy;
use retryplane_sim::{Config, Scenario, plot, simulate, simulate_from};
use tokio::time::Instant;

fn small(seed: u64, scenario: Scenario) -> Config {
    Config {
        clients: 100,
        rate: 2.0,
        duration: Duration::from_secs(30),
        scenario,
        capacity: 250.0,
        seed,
        ..Config::default()
    }
}

fn outage() -> Scenario {
    Scenario::Outage {
        start: Duration::from_secs(10),
        len: Duration::from_secs(5),
    }
}

#[test]
fn the_same_seed_gives_the_same_json_and_svg() {
    let p = RetryPolicy::default();
    let scenarios = [
        outage(),
        Scenario::ErrorRate { p: 0.3 },
        Scenario::Throttle {
            start: Duration::from_secs(5),
            len: Duration::from_secs(5),
            retry_after: Duration::from_secs(2),
        },
    ];
    for scenario in scenarios {
        let a = simulate("e", &p, &small(7, scenario)).unwrap();
        let b = simulate("e", &p, &small(7, scenario)).unwrap();
        assert_eq!(a.to_json().unwrap(), b.to_json().unwrap());
        assert_eq!(a.to_text(), b.to_text());
        assert_eq!(plot::svg(&a).unwrap(), plot::svg(&b).unwrap());
    }
}

#[test]
fn the_instant_standing_for_time_zero_changes_nothing() {
    let p = RetryPolicy::default();
    let now = Instant::now();
    let a = simulate_from("e", &p, &small(7, outage()), now).unwrap();
    let b = simulate_from(
        "e",
        &p,
        &small(7, outage()),
        now + Duration::from_secs(86_400),
    )
    .unwrap();
    assert_eq!(a.to_json().unwrap(), b.to_json().unwrap());
}

#[test]
fn another_seed_gives_other_arrivals() {
    let p = RetryPolicy::default();
    let a = simulate("e", &p, &small(7, outage())).unwrap();
    let b = simulate("e", &p, &small(8, outage())).unwrap();
    assert_ne!(a.to_json().unwrap(), b.to_json().unwrap());
}

#[test]
fn every_variant_sees_the_same_calls_arrive() {
    let p = RetryPolicy::default();
    let report = simulate("e", &p, &small(7, outage())).unwrap();
    let first = &report.variants[0].calls_per_s;
    assert!(report.variants.iter().all(|v| &v.calls_per_s == first));
}

#[test]
fn the_plot_has_a_line_per_variant_a_legend_and_axis_labels() {
    let p = RetryPolicy::default();
    let report = simulate("e", &p, &small(7, outage())).unwrap();
    let svg = plot::svg(&report).unwrap();
    assert!(svg.starts_with("<svg"));
    for text in [
        "policy",
        "no-budget",
        "no-jitter",
        "naive",
        "outage",
        "upstream capacity",
        "virtual time (s)",
        "upstream attempts per second",
    ] {
        assert!(svg.contains(&format!("\n{text}\n")), "no label {text:?}");
    }
    // Each variant's colour strokes its line and its legend sample.
    for colour in ["#1F77B4", "#FF7F0E", "#2CA02C", "#D62728"] {
        let strokes = svg.matches(&format!("stroke=\"{colour}\"")).count();
        assert!(strokes >= 2, "{colour}: {strokes}");
    }
}
