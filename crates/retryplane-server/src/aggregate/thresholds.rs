//! Per-endpoint retry-ratio alert thresholds, replaced whole whenever a version is published.
//!
//! Read only when alerts are evaluated (a tick, Stats, a scrape), never on ingestion.

use std::collections::HashMap;
use std::sync::Arc;

use arc_swap::ArcSwap;
use retryplane_policy::document::{Overlay, PolicyDocument};
use retryplane_proto::pb;
use tracing::warn;

/// The threshold of an endpoint that sets none, and of the `other` series (SPEC §4: 5 %).
pub const DEFAULT_RETRY_RATIO_THRESHOLD: f64 = 0.05;

/// The thresholds of the policy being served: each endpoint's `alert.retry_ratio`, and the one
/// of endpoints the file does not name (its `defaults:` over the built-in 5 %).
#[derive(Debug)]
pub struct Thresholds {
    current: ArcSwap<Current>,
}

#[derive(Debug)]
struct Current {
    per_endpoint: HashMap<String, f64>,
    default: f64,
}

impl Default for Thresholds {
    fn default() -> Self {
        Self {
            current: ArcSwap::from_pointee(Current {
                per_endpoint: HashMap::new(),
                default: DEFAULT_RETRY_RATIO_THRESHOLD,
            }),
        }
    }
}

impl Thresholds {
    /// The threshold of `endpoint`: its own, or the default.
    pub fn get(&self, endpoint: &str) -> f64 {
        let current = self.current.load();
        current
            .per_endpoint
            .get(endpoint)
            .copied()
            .unwrap_or(current.default)
    }

    /// The threshold of an endpoint the policies do not name.
    pub fn default_threshold(&self) -> f64 {
        self.current.load().default
    }

    /// Replaces every threshold; endpoints not in `per_endpoint` get `default`.
    pub fn set(&self, per_endpoint: HashMap<String, f64>, default: f64) {
        self.current.store(Arc::new(Current {
            per_endpoint,
            default,
        }));
    }

    /// Replaces every threshold with those of `document` (a published version, so valid; a
    /// document that cannot be read keeps the thresholds in force and says so).
    pub fn set_from(&self, document: &pb::PolicyDocument) {
        match PolicyDocument::try_from(document.clone()) {
            Ok(doc) => {
                let per_endpoint = doc
                    .endpoints
                    .iter()
                    .map(|e| (e.name.value.clone(), doc.effective_alert(e).retry_ratio))
                    .collect();
                let default = Overlay::resolve_alert([&doc.defaults]).retry_ratio;
                self.set(per_endpoint, default);
            }
            Err(error) => {
                warn!(%error, "alert thresholds kept: the published document could not be read");
            }
        }
    }
}
