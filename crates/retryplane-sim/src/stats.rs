//! From a run's trace to the figures of the report.
//!
//! Definitions (seconds are the whole seconds of virtual time, `[k, k+1)`):
//!
//! - **logical calls**: calls started (arrivals in `[0, duration)`); **upstream attempts**:
//!   requests sent to the upstream, including shed ones (a call refused by an open breaker sends
//!   none).
//! - **amplification**: attempts / logical calls. *Overall* over the whole run. *Incident mean*:
//!   attempts sent in the incident seconds / calls started in them; *incident peak*: the largest
//!   per-second ratio among them. The incident seconds are the seconds lying wholly inside the
//!   outage or throttle window (every second of `[0, duration)` for `error-rate`, so that
//!   attempts sent after it, by calls still retrying, are in the overall figure only), or the seconds that
//!   overlap it when none lies wholly inside.
//! - **success**: calls that returned a success / logical calls.
//! - **latency**: start to result of every logical call, success or not; percentiles by nearest
//!   rank (the value at rank `ceil(p × n)`), read from a histogram that keeps four significant
//!   figures (within 0.01 %; see [`crate::latency`]).
//! - **time to recover**: the pre-incident success rate is that of the calls started in the
//!   seconds wholly before the incident (1 when there are none). The first second `k` starting
//!   at or after the incident's end in which calls started, at least one succeeded, and at
//!   least 95% of that rate of them succeeded is the recovery second; the time to recover is
//!   `k - end`. `None` when no such second exists before the end of the run (or the scenario
//!   has no end): an endpoint on which no call succeeds has not recovered, even when none
//!   succeeded before the incident either.

use std::collections::BTreeMap;

use retryplane_policy::engine::GiveUpCause;
use serde::Serialize;

use crate::run::Trace;
use crate::variant::Variant;

/// A success rate at least this share of the pre-incident rate counts as recovered.
pub const RECOVERED_SHARE: f64 = 0.95;

/// `x` rounded to `digits` decimals (reports show no more precision than they mean).
pub(crate) fn round(x: f64, digits: i32) -> f64 {
    let scale = 10f64.powi(digits);
    (x * scale).round() / scale
}

/// `x` rounded to `digits` significant digits (a rate of `0.0004` stays `0.0004`).
pub(crate) fn significant(x: f64, digits: i32) -> f64 {
    if x == 0.0 || !x.is_finite() {
        return x;
    }
    let rounded = round(x, digits - 1 - x.abs().log10().floor() as i32);
    // Past about 1e-300 the scale itself overflows: such a number is shown as it is.
    if rounded.is_finite() { rounded } else { x }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 { 0.0 } else { a as f64 / b as f64 }
}

/// Attempts per logical call.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Amplification {
    /// Over the whole run.
    pub overall: f64,
    /// Over the incident seconds.
    pub incident_mean: f64,
    /// The largest per-second value among the incident seconds.
    pub incident_peak: f64,
}

/// Latency of logical calls, in milliseconds.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Latency {
    /// Median.
    pub p50_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
}

/// The figures of one variant. As JSON, a variant that made no call has `null` for its
/// ratios, share and latencies (`amplification`'s, `success_pct`, `latency`'s), as the text
/// shows `n/a`: their 0 would say "every call failed at once".
#[derive(Clone, Debug, PartialEq)]
pub struct VariantReport {
    /// Short name (`policy`, `no-budget`, `no-jitter`, `naive`).
    pub variant: &'static str,
    /// What the variant is.
    pub description: &'static str,
    /// Logical calls started.
    pub logical_calls: u64,
    /// Requests sent to the upstream.
    pub upstream_attempts: u64,
    /// Attempts per logical call.
    pub amplification: Amplification,
    /// The most attempts sent in one second.
    pub peak_attempts_per_s: u64,
    /// Share of logical calls that succeeded, in percent.
    pub success_pct: f64,
    /// Latency percentiles.
    pub latency: Latency,
    /// Failed logical calls by cause (every cause, zeros included).
    pub give_ups: BTreeMap<&'static str, u64>,
    /// Seconds from the incident's end to the recovery second, if it recovered in the run.
    pub recovery_s: Option<f64>,
    /// Attempts sent in each second `[k, k+1)`.
    pub attempts_per_s: Vec<u64>,
    /// Logical calls started in each second.
    pub calls_per_s: Vec<u64>,
    /// Of those, how many succeeded.
    pub successes_per_s: Vec<u64>,
}

impl Serialize for VariantReport {
    /// The fields in their order; the figures a variant that made no call lacks as `null`.
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct as _;
        /// [`Amplification`], each figure `None` when there is none.
        #[derive(Serialize)]
        struct Amplified {
            overall: Option<f64>,
            incident_mean: Option<f64>,
            incident_peak: Option<f64>,
        }
        /// [`Latency`], each figure `None` when there is none.
        #[derive(Serialize)]
        struct Latencies {
            p50_ms: Option<f64>,
            p99_ms: Option<f64>,
        }
        let figure = |x: f64| (self.logical_calls > 0).then_some(x);
        let a = &self.amplification;
        let mut st = s.serialize_struct("VariantReport", 13)?;
        st.serialize_field("variant", self.variant)?;
        st.serialize_field("description", self.description)?;
        st.serialize_field("logical_calls", &self.logical_calls)?;
        st.serialize_field("upstream_attempts", &self.upstream_attempts)?;
        st.serialize_field(
            "amplification",
            &Amplified {
                overall: figure(a.overall),
                incident_mean: figure(a.incident_mean),
                incident_peak: figure(a.incident_peak),
            },
        )?;
        st.serialize_field("peak_attempts_per_s", &self.peak_attempts_per_s)?;
        st.serialize_field("success_pct", &figure(self.success_pct))?;
        st.serialize_field(
            "latency",
            &Latencies {
                p50_ms: figure(self.latency.p50_ms),
                p99_ms: figure(self.latency.p99_ms),
            },
        )?;
        st.serialize_field("give_ups", &self.give_ups)?;
        st.serialize_field("recovery_s", &self.recovery_s)?;
        st.serialize_field("attempts_per_s", &self.attempts_per_s)?;
        st.serialize_field("calls_per_s", &self.calls_per_s)?;
        st.serialize_field("successes_per_s", &self.successes_per_s)?;
        st.end()
    }
}

/// The seconds `[first, last)` counted as the incident for a window `[start, end)` in seconds.
pub(crate) fn incident_seconds(start: f64, end: f64, seconds: usize) -> (usize, usize) {
    let inner = (start.ceil() as usize, (end.floor() as usize).min(seconds));
    if inner.0 < inner.1 {
        return inner;
    }
    let outer = (start.floor() as usize, (end.ceil() as usize).min(seconds));
    (outer.0.min(outer.1), outer.1)
}

/// The figures of `variant` from its trace. `window` is the incident `[start, end)` in
/// seconds (the whole run for `error-rate`), `has_end` whether the scenario has an end to
/// recover from, `run_seconds` the number of seconds in which calls start.
pub(crate) fn summarize(
    variant: Variant,
    mut trace: Trace,
    window: (f64, f64),
    has_end: bool,
    run_seconds: usize,
) -> VariantReport {
    // At least every second of the run: with few calls, the last one can end before the
    // incident does (or no call starts at all), and the figures below read up to its end.
    let seconds = trace
        .attempts
        .len()
        .max(trace.started.len())
        .max(run_seconds);
    for v in [
        &mut trace.attempts,
        &mut trace.started,
        &mut trace.succeeded,
    ] {
        v.resize(seconds, 0);
    }
    let (attempts, started, succeeded) = (&trace.attempts, &trace.started, &trace.succeeded);
    let calls: u64 = started.iter().sum();
    let sent: u64 = attempts.iter().sum();
    let successes: u64 = succeeded.iter().sum();

    let (a, b) = incident_seconds(window.0, window.1, run_seconds);
    let incident_sent: u64 = attempts[a..b].iter().sum();
    let incident_calls: u64 = started[a..b].iter().sum();
    let peak = (a..b)
        .filter(|&k| started[k] > 0)
        .map(|k| ratio(attempts[k], started[k]))
        .fold(0.0, f64::max);

    let recovery_s = has_end.then(|| recovery(started, succeeded, window, run_seconds));
    let give_ups = GiveUpCause::ALL
        .iter()
        .zip(trace.give_ups)
        .map(|(c, n)| (c.as_str(), n))
        .collect();
    let ms = |ns: u64| round(ns as f64 / 1e6, 3);
    VariantReport {
        variant: variant.as_str(),
        description: variant.description(),
        logical_calls: calls,
        upstream_attempts: sent,
        amplification: Amplification {
            overall: round(ratio(sent, calls), 4),
            incident_mean: round(ratio(incident_sent, incident_calls), 4),
            incident_peak: round(peak, 4),
        },
        peak_attempts_per_s: attempts.iter().copied().max().unwrap_or(0),
        success_pct: round(100.0 * ratio(successes, calls), 2),
        latency: Latency {
            p50_ms: ms(trace.latencies.percentile(0.50)),
            p99_ms: ms(trace.latencies.percentile(0.99)),
        },
        give_ups,
        recovery_s: recovery_s.flatten().map(|s| round(s, 3)),
        attempts_per_s: trace.attempts,
        calls_per_s: trace.started,
        successes_per_s: trace.succeeded,
    }
}

/// See the module docs: seconds from `window.1` to the first recovered second.
fn recovery(started: &[u64], succeeded: &[u64], window: (f64, f64), run: usize) -> Option<f64> {
    let before = (window.0.floor() as usize).min(run);
    let base_calls: u64 = started[..before].iter().sum();
    let baseline = if base_calls == 0 {
        1.0
    } else {
        ratio(succeeded[..before].iter().sum(), base_calls)
    };
    let first = window.1.ceil() as usize;
    (first..run.min(started.len()))
        .find(|&k| {
            succeeded[k] > 0 && ratio(succeeded[k], started[k]) >= RECOVERED_SHARE * baseline
        })
        .map(|k| k as f64 - window.1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn incident_seconds_are_the_whole_seconds_inside_the_window() {
        assert_eq!(incident_seconds(30.0, 50.0, 120), (30, 50));
        assert_eq!(incident_seconds(30.5, 50.5, 120), (31, 50));
        // No whole second inside: the overlapping ones.
        assert_eq!(incident_seconds(30.2, 30.7, 120), (30, 31));
        // Clipped to the run.
        assert_eq!(incident_seconds(100.0, 200.0, 120), (100, 120));
    }

    #[test]
    fn significant_digits_keep_small_and_large_numbers() {
        assert_eq!(significant(0.0004, 6), 0.0004);
        assert_eq!(significant(450.000_000_000_000_06, 6), 450.0);
        assert_eq!(significant(1_234_567_891.0, 6), 1_234_570_000.0);
        assert_eq!(significant(0.0, 6), 0.0);
        assert_eq!(significant(1e-305, 6), 1e-305);
    }

    #[test]
    fn recovery_is_the_first_second_back_at_95_percent_of_the_baseline() {
        // Baseline over seconds 0..2: 18 of 20 = 90%; 95% of it is 85.5%.
        let started = [10, 10, 10, 10, 10, 10];
        let succeeded = [9, 9, 0, 8, 9, 10];
        assert_eq!(recovery(&started, &succeeded, (2.0, 3.0), 6), Some(1.0));
        assert_eq!(recovery(&started, &succeeded, (2.0, 2.5), 6), Some(1.5));
        assert_eq!(recovery(&started, &[9, 9, 0, 0, 0, 0], (2.0, 3.0), 6), None);
        // Never healthy, before or after: not recovered (95% of a 0% baseline is no success).
        assert_eq!(recovery(&started, &[0; 6], (2.0, 3.0), 6), None);
        assert_eq!(
            recovery(&started, &[0, 0, 0, 0, 1, 0], (2.0, 3.0), 6),
            Some(1.0)
        );
    }

    #[test]
    fn a_run_with_few_or_no_calls_is_summarized_over_the_whole_run() {
        // No call at all, and one call that ended before the incident did (30 s to 50 s of a
        // 120 s run): every figure still reads the incident's seconds.
        let one_early = Trace {
            attempts: vec![0, 1],
            started: vec![0, 1],
            succeeded: vec![0, 1],
            latencies: std::iter::once(20_000_000).collect(),
            give_ups: [0; 6],
        };
        for trace in [Trace::default(), one_early] {
            let calls: u64 = trace.started.iter().sum();
            let r = summarize(Variant::Policy, trace, (30.0, 50.0), true, 120);
            assert_eq!(r.logical_calls, calls);
            assert_eq!(r.calls_per_s.len(), 120);
            assert_eq!(r.amplification.incident_mean, 0.0);
            assert_eq!(r.recovery_s, None);
        }
    }
}
