//! The aggregates and fleet gauges in `/metrics`, encoded from the live aggregates at scrape
//! time by a prometheus-client [`Collector`] (no second set of counters is kept).
//!
//! Per series, labelled `{service, endpoint}` (OpenMetrics adds `_total` to counters):
//!
//! | family | type | what |
//! |---|---|---|
//! | `retryplane_calls_total` | counter | logical calls |
//! | `retryplane_attempts_total` | counter | attempts, first ones included |
//! | `retryplane_retries_total` | counter | retries |
//! | `retryplane_success_first_try_total` | counter | calls that succeeded at once |
//! | `retryplane_success_after_retry_total` | counter | calls that succeeded after retrying |
//! | `retryplane_giveups_total{cause}` | counter | calls that failed, by SPEC §2 cause |
//! | `retryplane_backoff_seconds_total` | counter | time spent backing off, seconds |
//! | `retryplane_circuit_open_total` | counter | calls refused by an open breaker |
//! | `retryplane_cancelled_total` | counter | calls their caller cancelled or dropped before they ended |
//! | `retryplane_retry_after_honored_total` | counter | Retry-After hints honored |
//! | `retryplane_retry_ratio{window}` | gauge | retries / calls over `1m`, `5m`, `15m` (0 without calls) |
//! | `retryplane_retry_ratio_threshold` | gauge | the endpoint's alert threshold |
//! | `retryplane_retry_ratio_alert` | gauge | 1 while the 5-minute ratio alert fires |
//!
//! Besides: `retryplane_metrics_series` (series kept apart), `retryplane_metrics_max_series`,
//! `retryplane_metrics_overflowed_reports_total{reason}` (endpoint reports counted in `other`), and the
//! fleet gauges `retryplane_agents{applied_version}` (connected agents by the version they run,
//! 0 = none yet, or content the control plane does not know, as `AgentStatus.applied_version`)
//! and `retryplane_agents_nacked{version}` (connected agents whose last answer was a NACK of
//! that version), and `retryplane_agents_behind` (connected agents that do not run the version
//! published: not answered yet, refused it, or another version's content; 0 before any is).
//!
//! Each scrape reads every series once, under its own lock, into a short-lived list, so all
//! families of one series come from the same instant; alerts are re-evaluated on the way.

use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Unit;
use tokio::time::Instant;

use super::counts::{
    ATTEMPTS, BACKOFF_MS, CALLS, CANCELLED, CIRCUIT_OPEN, GIVE_UP_CAUSES, RETRIES,
    RETRY_AFTER_HONORED, SUCCESS_AFTER_RETRY, SUCCESS_FIRST_TRY,
};
use super::series::SeriesView;
use super::window::WINDOWS;
use super::{Aggregator, Filter, Overflow};
use crate::fleet::Fleet;

/// The per-series counter families: name (before `_total`), help, counter index.
const COUNTERS: [(&str, &str, usize); 8] = [
    ("retryplane_calls", "Logical calls made by agents.", CALLS),
    (
        "retryplane_attempts",
        "Attempts made by agents, first attempts included.",
        ATTEMPTS,
    ),
    ("retryplane_retries", "Retries made by agents.", RETRIES),
    (
        "retryplane_success_first_try",
        "Logical calls that succeeded on the first attempt.",
        SUCCESS_FIRST_TRY,
    ),
    (
        "retryplane_success_after_retry",
        "Logical calls that succeeded after at least one retry.",
        SUCCESS_AFTER_RETRY,
    ),
    (
        "retryplane_circuit_open",
        "Logical calls the endpoint's circuit breaker ended: refused before their first attempt, or stopped before a retry by a breaker that opened meanwhile.",
        CIRCUIT_OPEN,
    ),
    (
        "retryplane_retry_after_honored",
        "Retry-After or grpc-retry-pushback hints honored.",
        RETRY_AFTER_HONORED,
    ),
    (
        "retryplane_cancelled",
        "Logical calls their caller cancelled or dropped before they ended.",
        CANCELLED,
    ),
];

/// Encodes the aggregates and the fleet gauges at each scrape.
#[derive(Debug)]
pub struct AggregateCollector {
    aggregator: Arc<Aggregator>,
    fleet: Arc<Fleet>,
}

impl AggregateCollector {
    /// A collector over `aggregator` and `fleet`.
    pub fn new(aggregator: Arc<Aggregator>, fleet: Arc<Fleet>) -> Self {
        Self { aggregator, fleet }
    }
}

fn counter(m: &mut MetricEncoder<'_>, labels: &impl EncodeLabelSet, v: u64) -> std::fmt::Result {
    m.encode_family(labels)?
        .encode_counter::<NoLabelSet, u64, u64>(&v, None)
}

fn gauge(m: &mut MetricEncoder<'_>, labels: &impl EncodeLabelSet, v: f64) -> std::fmt::Result {
    m.encode_family(labels)?.encode_gauge(&v)
}

fn series_labels(v: &SeriesView) -> [(&'static str, &str); 2] {
    [("service", &v.service), ("endpoint", &v.endpoint)]
}

impl Collector for AggregateCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let views = self.aggregator.views(Instant::now(), Filter::default());
        for (name, help, index) in COUNTERS {
            let mut m = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for v in &views {
                counter(&mut m, &series_labels(v), v.lifetime.0[index])?;
            }
        }
        {
            let mut m = encoder.encode_descriptor(
                "retryplane_giveups",
                "Logical calls that finally failed, by cause.",
                None,
                MetricType::Counter,
            )?;
            for v in &views {
                for (cause, index) in GIVE_UP_CAUSES {
                    let labels = [
                        ("service", v.service.as_str()),
                        ("endpoint", v.endpoint.as_str()),
                        ("cause", cause),
                    ];
                    counter(&mut m, &labels, v.lifetime.0[index])?;
                }
            }
        }
        {
            let mut m = encoder.encode_descriptor(
                "retryplane_backoff",
                "Time agents spent in backoff pauses.",
                Some(&Unit::Seconds),
                MetricType::Counter,
            )?;
            for v in &views {
                #[allow(clippy::cast_precision_loss)] // milliseconds below 2^53
                let seconds = v.lifetime.0[BACKOFF_MS] as f64 / 1000.0;
                m.encode_family(&series_labels(v))?
                    .encode_counter::<NoLabelSet, f64, f64>(&seconds, None)?;
            }
        }
        {
            let mut m = encoder.encode_descriptor(
                "retryplane_retry_ratio",
                "Retries / logical calls over a trailing window (0 without calls).",
                None,
                MetricType::Gauge,
            )?;
            for v in &views {
                for (w, (counts, _)) in WINDOWS.iter().zip(v.windows.iter()) {
                    let labels = [
                        ("service", v.service.as_str()),
                        ("endpoint", v.endpoint.as_str()),
                        ("window", w.label()),
                    ];
                    gauge(&mut m, &labels, counts.retry_ratio())?;
                }
            }
        }
        {
            let mut m = encoder.encode_descriptor(
                "retryplane_retry_ratio_threshold",
                "The endpoint's retry-ratio alert threshold.",
                None,
                MetricType::Gauge,
            )?;
            for v in &views {
                gauge(&mut m, &series_labels(v), v.alert.threshold)?;
            }
        }
        {
            let mut m = encoder.encode_descriptor(
                "retryplane_retry_ratio_alert",
                "1 while the retry ratio over 5 minutes is above the threshold.",
                None,
                MetricType::Gauge,
            )?;
            for v in &views {
                gauge(
                    &mut m,
                    &series_labels(v),
                    f64::from(u8::from(v.alert.firing)),
                )?;
            }
        }
        let series = u64::try_from(self.aggregator.series_count()).unwrap_or(u64::MAX);
        encoder
            .encode_descriptor(
                "retryplane_metrics_series",
                "(service, endpoint) series kept apart, not counting `other`.",
                None,
                MetricType::Gauge,
            )?
            .encode_gauge(&series)?;
        let max = u64::try_from(self.aggregator.max_series()).unwrap_or(u64::MAX);
        encoder
            .encode_descriptor(
                "retryplane_metrics_max_series",
                "The cap on series; reports past it count in the `other` series.",
                None,
                MetricType::Gauge,
            )?
            .encode_gauge(&max)?;
        {
            let mut m = encoder.encode_descriptor(
                "retryplane_metrics_overflowed_reports",
                "Endpoint reports counted in the `other` series, by reason: series_cap (the cap on series was reached), bad_name (a name too long, with a control character, or `other`'s own, or an empty endpoint name), service_share (the service holds its share of series).",
                None,
                MetricType::Counter,
            )?;
            for why in Overflow::ALL {
                counter(
                    &mut m,
                    &[("reason", why.label())],
                    self.aggregator.overflowed_by(why),
                )?;
            }
        }
        let fleet = self.fleet.versions();
        {
            let mut m = encoder.encode_descriptor(
                "retryplane_agents",
                "Connected agents by the policy version they run (0 = none yet, or unknown content).",
                None,
                MetricType::Gauge,
            )?;
            for (version, agents) in &fleet.applied {
                let labels = [("applied_version", version.to_string())];
                m.encode_family(&labels)?.encode_gauge(agents)?;
            }
        }
        {
            let mut m = encoder.encode_descriptor(
                "retryplane_agents_nacked",
                "Connected agents whose last answer was a NACK, by the version refused.",
                None,
                MetricType::Gauge,
            )?;
            for (version, agents) in &fleet.nacked {
                let labels = [("version", version.to_string())];
                m.encode_family(&labels)?.encode_gauge(agents)?;
            }
        }
        let published = self.aggregator.published();
        let behind: u64 = if published == 0 {
            0
        } else {
            fleet
                .applied
                .iter()
                .filter(|(version, _)| **version != published)
                .map(|(_, agents)| *agents)
                .sum()
        };
        encoder
            .encode_descriptor(
                "retryplane_agents_behind",
                "Connected agents that do not run the version published (not answered yet, refused it, or another version); alert on it staying above 0.",
                None,
                MetricType::Gauge,
            )?
            .encode_gauge(&behind)?;
        Ok(())
    }
}
