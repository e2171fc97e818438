//! Per-endpoint retry-ratio alert thresholds, replaced whole whenever a version is published.
//!
//! Read only when alerts are evaluated (a tick, Stats, a scrape), never on ingestion.

use std::collections::HashMap;
use std::sync::Arc;

use arc_swap::ArcSwap;
use retryplane_proto::pb;

/// The threshold of an endpoint that sets none, and of the `other` series (SPEC §4: 5 %).
pub const DEFAULT_RETRY_RATIO_THRESHOLD: f64 = 0.05;

/// The thresholds of the policy being served.
#[derive(Debug)]
pub struct Thresholds {
    per_endpoint: ArcSwap<HashMap<String, f64>>,
}

impl Default for Thresholds {
    fn default() -> Self {
        Self {
            per_endpoint: ArcSwap::from_pointee(HashMap::new()),
        }
    }
}

impl Thresholds {
    /// The threshold of `endpoint`: its own, or the default.
    pub fn get(&self, endpoint: &str) -> f64 {
        self.per_endpoint
            .load()
            .get(endpoint)
            .copied()
            .unwrap_or(DEFAULT_RETRY_RATIO_THRESHOLD)
    }

    /// Replaces every threshold.
    pub fn set(&self, per_endpoint: HashMap<String, f64>) {
        self.per_endpoint.store(Arc::new(per_endpoint));
    }

    /// Replaces every threshold with those of `document` (a published version).
    pub fn set_from(&self, document: &pb::PolicyDocument) {
        self.set(of_document(document));
    }
}

/// Each endpoint's `alert.retry_ratio` in `document`.
pub fn of_document(document: &pb::PolicyDocument) -> HashMap<String, f64> {
    document
        .endpoints
        .iter()
        .map(|e| {
            // SEAM(alert.retry_ratio): once the policy model has it, this one line becomes the
            // endpoint's effective value, `PolicySet::alert_retry_ratio(&e.name)` (the caller,
            // `ControlPlane::publish`, can pass the compiled set) or its overlay's field here.
            let threshold = DEFAULT_RETRY_RATIO_THRESHOLD;
            (e.name.clone(), threshold)
        })
        .collect()
}
