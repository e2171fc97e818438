//! Lifetime totals of the agents' retry metrics, per endpoint (SPEC §4), with a bounded number
//! of series: endpoints past the bound are summed into one `other` series.

use std::collections::HashMap;
use std::sync::Mutex;

use retryplane_proto::pb;

/// The name of the series that holds endpoints past the bound.
pub const OTHER: &str = "other";

/// Aggregated counters.
#[derive(Debug)]
pub struct Stats {
    endpoints: Mutex<HashMap<String, pb::EndpointStats>>,
    max_series: usize,
}

impl Stats {
    /// Totals for at most `max_series` endpoints (plus `other`).
    pub fn new(max_series: usize) -> Self {
        Self {
            endpoints: Mutex::new(HashMap::new()),
            max_series,
        }
    }

    /// Adds one report's deltas.
    pub fn add(&self, report: &pb::MetricsReport) {
        let mut map = self
            .endpoints
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for c in &report.endpoints {
            let name = if map.contains_key(&c.endpoint) || map.len() < self.max_series {
                c.endpoint.as_str()
            } else {
                OTHER
            };
            let s = map
                .entry(name.to_owned())
                .or_insert_with(|| pb::EndpointStats {
                    endpoint: name.to_owned(),
                    ..Default::default()
                });
            s.calls = s.calls.saturating_add(c.calls);
            s.attempts = s.attempts.saturating_add(c.attempts);
            s.retries = s.retries.saturating_add(c.retries);
            s.success_first_try = s.success_first_try.saturating_add(c.success_first_try);
            s.success_after_retry = s.success_after_retry.saturating_add(c.success_after_retry);
            s.gave_up_attempts = s.gave_up_attempts.saturating_add(c.gave_up_attempts);
            s.gave_up_budget = s.gave_up_budget.saturating_add(c.gave_up_budget);
            s.gave_up_deadline = s.gave_up_deadline.saturating_add(c.gave_up_deadline);
            s.gave_up_retry_after = s.gave_up_retry_after.saturating_add(c.gave_up_retry_after);
            s.gave_up_not_retryable = s
                .gave_up_not_retryable
                .saturating_add(c.gave_up_not_retryable);
            s.circuit_open = s.circuit_open.saturating_add(c.circuit_open);
            s.backoff_ms = s.backoff_ms.saturating_add(c.backoff_ms);
            s.retry_after_honored = s.retry_after_honored.saturating_add(c.retry_after_honored);
        }
    }

    /// Totals, sorted by endpoint; only `endpoint` when given.
    pub fn snapshot(&self, endpoint: Option<&str>) -> Vec<pb::EndpointStats> {
        let map = self
            .endpoints
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut out: Vec<_> = map
            .values()
            .filter(|s| endpoint.is_none_or(|e| s.endpoint == e))
            .cloned()
            .collect();
        out.sort_by(|a, b| a.endpoint.cmp(&b.endpoint));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(endpoints: &[(&str, u64)]) -> pb::MetricsReport {
        pb::MetricsReport {
            endpoints: endpoints
                .iter()
                .map(|(e, calls)| pb::EndpointCounters {
                    endpoint: (*e).to_owned(),
                    calls: *calls,
                    retries: 1,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn deltas_add_up_per_endpoint() {
        let stats = Stats::new(10);
        stats.add(&report(&[("a", 3), ("b", 1)]));
        stats.add(&report(&[("a", 4)]));
        let s = stats.snapshot(None);
        assert_eq!(
            (s[0].endpoint.as_str(), s[0].calls, s[0].retries),
            ("a", 7, 2)
        );
        assert_eq!(stats.snapshot(Some("b"))[0].calls, 1);
    }

    #[test]
    fn endpoints_past_the_bound_go_to_other() {
        let stats = Stats::new(1);
        stats.add(&report(&[("a", 1), ("b", 2), ("c", 3)]));
        let s = stats.snapshot(None);
        assert_eq!(s.len(), 2);
        assert_eq!((s[1].endpoint.as_str(), s[1].calls), (OTHER, 5));
    }
}
