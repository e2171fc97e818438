//! A policy's leaf fields as values: JSON (durations in milliseconds) and text as a policy
//! file writes it.

use std::time::Duration;

use retryplane_policy::duration::format_duration;
use retryplane_policy::{AlertConfig, RetryPolicy};
use serde_json::Value;

use crate::output::Millis;

/// The value of a [`FIELD_PATHS`](retryplane_policy::document::FIELD_PATHS) entry as JSON
/// and as a policy file writes it, from the call's policy `p` or the endpoint's `alert`
/// settings; `None` for a path this version does not know.
pub fn value(p: &RetryPolicy, alert: &AlertConfig, field: &str) -> Option<(Value, String)> {
    fn dur(d: Duration) -> (Value, String) {
        (ms_value(d), format_duration(d))
    }
    fn num(n: u32) -> (Value, String) {
        (Value::from(n), n.to_string())
    }
    fn float(f: f64) -> (Value, String) {
        (Value::from(f), format!("{f:?}"))
    }
    fn list<T: ToString>(items: impl IntoIterator<Item = T>) -> (Value, String) {
        let items: Vec<String> = items.into_iter().map(|i| i.to_string()).collect();
        let text = format!("[{}]", items.join(", "));
        (Value::from(items), text)
    }
    fn off() -> (Value, String) {
        (Value::Null, "(disabled)".to_owned())
    }
    let b = p.budget.as_ref();
    let c = p.circuit_breaker.as_ref();
    Some(match field {
        "max_attempts" => num(p.max_attempts),
        "backoff.base" => dur(p.backoff.base),
        "backoff.max" => dur(p.backoff.max),
        "backoff.multiplier" => float(p.backoff.multiplier),
        "backoff.jitter" => {
            let name = p.backoff.jitter.as_str();
            (Value::from(name), name.to_owned())
        }
        "deadline" => dur(p.deadline),
        "per_try_timeout" => dur(p.per_try_timeout),
        "retry_on.http_status" => {
            let codes = &p.retry_on.http_status;
            let text = list(codes.iter()).1;
            (Value::from(codes.to_vec()), text)
        }
        "retry_on.grpc_status" => list(p.retry_on.grpc_status.iter().map(|c| c.name())),
        "retry_on.errors" => list(p.retry_on.errors.iter().map(|e| e.as_str())),
        "idempotent_methods" => list(p.idempotent_methods.iter()),
        "idempotency_key_header" => {
            let h = p.idempotency_key_header.to_string();
            (Value::from(h.clone()), h)
        }
        "retry_after.honor" => flag(p.retry_after.honor),
        "retry_after.max" => dur(p.retry_after.max),
        "budget.enabled" => flag(b.is_some()),
        "budget.ratio" => b.map_or_else(off, |b| float(b.ratio)),
        "budget.min_per_second" => b.map_or_else(off, |b| num(b.min_per_second)),
        "budget.window" => b.map_or_else(off, |b| dur(b.window)),
        "circuit_breaker.enabled" => flag(c.is_some()),
        "circuit_breaker.failure_ratio" => c.map_or_else(off, |c| float(c.failure_ratio)),
        "circuit_breaker.min_requests" => c.map_or_else(off, |c| num(c.min_requests)),
        "circuit_breaker.window" => c.map_or_else(off, |c| dur(c.window)),
        "circuit_breaker.open_for" => c.map_or_else(off, |c| dur(c.open_for)),
        "circuit_breaker.half_open_probes" => c.map_or_else(off, |c| num(c.half_open_probes)),
        "alert.retry_ratio" => float(alert.retry_ratio),
        _ => return None,
    })
}

fn flag(b: bool) -> (Value, String) {
    (Value::from(b), b.to_string())
}

/// A duration as a JSON number of milliseconds, like [`Millis`].
fn ms_value(d: Duration) -> Value {
    serde_json::to_value(Millis(d)).unwrap_or(Value::Null)
}

#[cfg(test)]
mod tests {
    use super::*;
    use retryplane_policy::document::FIELD_PATHS;

    #[test]
    fn every_field_path_has_a_value() {
        let mut p = RetryPolicy::default();
        let a = AlertConfig::default();
        for field in FIELD_PATHS {
            assert!(value(&p, &a, field).is_some(), "{field}");
        }
        p.budget = None;
        assert_eq!(value(&p, &a, "budget.ratio").unwrap().0, Value::Null);
        assert_eq!(value(&p, &a, "budget.enabled").unwrap().1, "false");
        let a = AlertConfig { retry_ratio: 0.2 };
        assert_eq!(
            value(&p, &a, "alert.retry_ratio").unwrap(),
            (Value::from(0.2), "0.2".to_owned())
        );
    }
}
