//! `retryplane simulate`: what a retry policy does to an upstream that falls over, before it is
//! pushed to a fleet.
//!
//! A discrete-event simulation in virtual time (no sleeping, no clock): `clients` clients each
//! start logical calls as a Poisson process at `rate` per second for `duration`, and each client
//! runs every call through the **real engine** of `retryplane-policy` ([`RetryCall`] on the
//! client's own [`EndpointState`], so its own budget and breaker, and its own seeded RNG for
//! jitter), exactly as an agent does. The upstream ([`upstream`]) has a capacity and a latency
//! that grows with load, and fails as the [`Scenario`] says: a total outage, a steady error rate
//! or a throttle with `Retry-After`.
//!
//! The same fleet (the same arrivals, call by call) runs four [`Variant`]s side by side: the
//! policy as written, the same without its budget, the same without jitter, and a naive client
//! (immediate retries, same `max_attempts`). The [`Report`] gives, per variant, logical calls,
//! upstream attempts, amplification (overall, and mean and peak per second during the
//! incident), success, p50/p99 latency, give-ups by cause and the time to recover after the
//! incident ([`stats`] defines each figure), as text ([`Report::to_text`]), JSON
//! ([`Report::to_json`]) or an SVG plot of attempts per second ([`plot::svg`]).
//!
//! Deterministic: the same policy, configuration and seed give the same report, byte for byte.
//! Time reaches the engine as `origin + t` for virtual nanoseconds `t` from one `origin`
//! instant, and nothing depends on which instant that is. Every collection in the output is a
//! `Vec` or a `BTreeMap`. The four variants run on their own threads, each a pure function of
//! its inputs.
//!
//! [`RetryCall`]: retryplane_policy::engine::RetryCall
//! [`EndpointState`]: retryplane_policy::engine::EndpointState

#![forbid(unsafe_code)]

pub mod config;
pub mod latency;
pub mod plot;
mod report;
pub mod run;
pub mod stats;
pub mod upstream;
pub mod variant;

use std::sync::atomic::{AtomicU64, Ordering};

use retryplane_policy::RetryPolicy;
use serde::Serialize;
use tokio::time::Instant;

pub use config::{Config, ConfigError, Scenario};
pub use stats::VariantReport;
pub use variant::Variant;

/// The incident window, in seconds of virtual time.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Incident {
    /// Start (0 for `error-rate`).
    pub start_s: f64,
    /// End (the end of the run for `error-rate`).
    pub end_s: f64,
    /// Whether it ends before the run does, so that recovery can be measured.
    pub ends_in_run: bool,
}

/// The result of one simulation: the inputs, then each variant's figures.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Report {
    /// The endpoint whose policy was simulated.
    pub endpoint: String,
    /// Clients.
    pub clients: u32,
    /// Logical calls per second per client.
    pub rate_per_client: f64,
    /// Length of the run (calls start in `[0, duration)`).
    pub duration_s: f64,
    /// The scenario, as written on the command line.
    pub scenario: String,
    /// Requests per second the upstream serves.
    pub capacity_per_s: f64,
    /// The upstream's base latency.
    pub latency_ms: f64,
    /// The seed.
    pub seed: u64,
    /// The policy's `max_attempts`.
    pub max_attempts: u32,
    /// The incident window the per-incident figures refer to.
    pub incident: Incident,
    /// Figures per variant, in [`Variant::ALL`] order.
    pub variants: Vec<VariantReport>,
}

/// Simulates `policy` (the policy of `endpoint`) under `config`, every variant, from a fresh
/// `origin` instant.
pub fn simulate(
    endpoint: &str,
    policy: &RetryPolicy,
    config: &Config,
) -> Result<Report, ConfigError> {
    simulate_from(endpoint, policy, config, Instant::now())
}

/// [`simulate`] with the instant that stands for virtual time 0 given; the report does not
/// depend on it.
pub fn simulate_from(
    endpoint: &str,
    policy: &RetryPolicy,
    config: &Config,
    origin: Instant,
) -> Result<Report, ConfigError> {
    simulate_within(
        endpoint,
        policy,
        config,
        origin,
        config::MAX_IN_FLIGHT,
        &Progress::default(),
    )
}

/// [`simulate`], telling `progress` how far the run has come as it goes, for a caller that
/// shows it from another thread.
pub fn simulate_watched(
    endpoint: &str,
    policy: &RetryPolicy,
    config: &Config,
    progress: &Progress,
) -> Result<Report, ConfigError> {
    simulate_within(
        endpoint,
        policy,
        config,
        Instant::now(),
        config::MAX_IN_FLIGHT,
        progress,
    )
}

/// How far a [`simulate_watched`] run has come, read from any thread while it runs.
#[derive(Debug, Default)]
pub struct Progress {
    /// Each variant's virtual time reached, in nanoseconds ([`run::run_watched`]).
    reached: [AtomicU64; Variant::ALL.len()],
    /// The run's length in nanoseconds of virtual time; 0 until the run starts.
    end: AtomicU64,
}

impl Progress {
    /// The share of the run done, from 0 to 1: the virtual time the variants have reached, on
    /// average, over the run's length (0 before the run starts; 1 once every variant's calls
    /// have started, though the last ones may still be in flight).
    pub fn done(&self) -> f64 {
        let end = self.end.load(Ordering::Relaxed);
        if end == 0 {
            return 0.0;
        }
        let sum: f64 = self
            .reached
            .iter()
            .map(|r| (r.load(Ordering::Relaxed).min(end) as f64) / end as f64)
            .sum();
        sum / self.reached.len() as f64
    }
}

/// [`simulate_from`] with at most `limit` calls in flight at once in each variant.
fn simulate_within(
    endpoint: &str,
    policy: &RetryPolicy,
    config: &Config,
    origin: Instant,
    limit: usize,
    progress: &Progress,
) -> Result<Report, ConfigError> {
    config.validate()?;
    let duration = config.duration.as_secs_f64();
    let (window, has_end) = match config.scenario.window() {
        Some((a, b)) => ((a.as_secs_f64(), b.as_secs_f64()), b < config.duration),
        None => ((0.0, duration), false),
    };
    let run_seconds = config.duration.as_nanos().div_ceil(1_000_000_000) as usize;
    progress
        .end
        .store(upstream::nanos(config.duration).max(1), Ordering::Relaxed);
    let variants = std::thread::scope(|scope| {
        let handles: Vec<_> =
            Variant::ALL
                .iter()
                .zip(&progress.reached)
                .map(|(&variant, reached)| {
                    scope.spawn(move || {
                        let policy = variant.apply(policy);
                        let trace = run::run_watched(&policy, config, origin, limit, reached)
                            .map_err(|e| ConfigError::TooManyInFlight {
                                variant: variant.as_str(),
                                limit: e.limit,
                                at_s: e.at_s,
                            })?;
                        Ok(stats::summarize(
                            variant,
                            trace,
                            window,
                            has_end,
                            run_seconds,
                        ))
                    })
                })
                .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect::<Result<Vec<_>, ConfigError>>()
    })?;
    Ok(Report {
        endpoint: endpoint.to_owned(),
        clients: config.clients,
        rate_per_client: config.rate,
        duration_s: duration,
        scenario: config.scenario.to_string(),
        capacity_per_s: stats::significant(config.capacity, 6),
        latency_ms: config.latency.as_secs_f64() * 1e3,
        seed: config.seed,
        max_attempts: policy.max_attempts,
        incident: Incident {
            start_s: window.0,
            end_s: window.1,
            ends_in_run: has_end,
        },
        variants,
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// Calls that pause 10 s between attempts for up to a minute, in a total outage: every
    /// call stays in flight for most of its deadline while new ones arrive.
    fn slow_policy() -> RetryPolicy {
        let yaml = "version: 1\nendpoints:\n  e:\n    max_attempts: 6\n    deadline: 60s\n    \
                    backoff: {base: 10s, max: 10s, jitter: none}\n    budget: {enabled: false}\n    \
                    circuit_breaker: {enabled: false}\n";
        let set = retryplane_policy::load(yaml.as_bytes()).policies.unwrap();
        (*set.endpoint("e").unwrap().policy).clone()
    }

    fn fleet() -> Config {
        Config {
            clients: 20,
            rate: 5.0,
            duration: Duration::from_secs(30),
            scenario: Scenario::Outage {
                start: Duration::ZERO,
                len: Duration::from_secs(3600),
            },
            ..Config::default()
        }
    }

    /// A run that would hold more calls in flight than its limit stops with an error naming
    /// the variant, the limit and when, rather than growing without bound; the same run under
    /// a limit it stays within reports the same as under the default limit.
    #[test]
    fn a_run_past_its_limit_of_calls_in_flight_stops_with_an_error() {
        let (policy, config) = (slow_policy(), fleet());
        let origin = Instant::now();
        // 100 calls a second for 30 s, each in flight for up to a minute: about 3,000 at once.
        let progress = Progress::default();
        assert_eq!(progress.done(), 0.0);
        let err = simulate_within("e", &policy, &config, origin, 1_000, &progress).unwrap_err();
        let ConfigError::TooManyInFlight {
            variant,
            limit,
            at_s,
        } = err.clone()
        else {
            panic!("{err}");
        };
        assert_eq!((variant, limit), ("policy", 1_000));
        assert!((5.0..15.0).contains(&at_s), "{at_s}");
        assert!(
            err.to_string()
                .contains("limit of 1000 calls in flight at once"),
            "{err}"
        );
        // Each variant stops where it runs out of room (most near at_s; `naive`, whose calls
        // end at once, not at all): the progress shows a run cut short.
        let done = progress.done();
        assert!(done > 0.2 && done < 1.0, "{done}");
        let progress = Progress::default();
        let report = simulate_within("e", &policy, &config, origin, 10_000, &progress).unwrap();
        assert_eq!(progress.done(), 1.0, "a whole run is done");
        assert_eq!(
            report,
            simulate_from("e", &policy, &config, origin).unwrap(),
            "the limit changes nothing below it"
        );
    }
}
