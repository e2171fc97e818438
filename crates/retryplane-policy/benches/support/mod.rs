//! What the engine benches share: the generated 1,000-endpoint policy set, the benched call
//! and the CPU-time clock. Each bench uses part of it.
#![allow(dead_code, reason = "each bench uses part of the shared set-up")]

use std::hint::black_box;
use std::time::Duration;

use retryplane_policy::engine::{CallInfo, Decision, EndpointState, Outcome, RetryCall};
use retryplane_policy::rng::SeededRng;
use retryplane_policy::{PolicySet, RetryPolicy, Target, load};
use tokio::time::Instant;

pub mod cpu_clock;

/// The endpoint of the success path (two routes; the call matches the second).
pub const HOT: &str = "svc-0042";
/// The endpoint of the failure path: same routes, a budget that never runs out and a breaker
/// that never opens.
pub const FAILING: &str = "svc-0043";
/// The call of both paths: `GET /v1/items/12345`.
pub const TARGET: Target<'static> = Target::Http {
    method: "GET",
    path: "/v1/items/12345",
};
/// Endpoints in the generated set.
pub const ENDPOINTS: usize = 1000;

/// The success path's answer.
pub const OK: Outcome = Outcome::Http {
    status: 200,
    retry_after: None,
};
/// The failure path's answer (listed in `retry_on`).
pub const UNAVAILABLE: Outcome = Outcome::Http {
    status: 503,
    retry_after: None,
};

const ROUTES: &str = "    routes:
      - match: {method: POST, path_prefix: /v1/orders}
        max_attempts: 2
      - match: {method: GET, path_prefix: /v1/items}
        per_try_timeout: 500ms
";

/// A policy file with [`ENDPOINTS`] endpoints `svc-0000` … `svc-0999`: most with defaults only
/// or a field or two, every 50th and the two benched ones with routes.
pub fn thousand_endpoints_yaml() -> String {
    let mut y = String::with_capacity(128 * 1024);
    y.push_str(
        "version: 1\ndefaults:\n  max_attempts: 3\n  deadline: 15s\n  per_try_timeout: 2s\nendpoints:\n",
    );
    for i in 0..ENDPOINTS {
        let name = format!("svc-{i:04}");
        if name == HOT {
            y.push_str(&format!("  {name}:\n    max_attempts: 4\n{ROUTES}"));
        } else if name == FAILING {
            y.push_str(&format!(
                "  {name}:\n    max_attempts: 4\n    budget: {{min_per_second: 1000000000}}\n    \
                 circuit_breaker: {{min_requests: 4000000000}}\n{ROUTES}"
            ));
        } else if i % 50 == 0 {
            y.push_str(&format!("  {name}:\n    deadline: 5s\n{ROUTES}"));
        } else if i % 3 == 0 {
            y.push_str(&format!(
                "  {name}: {{max_attempts: 2, backoff: {{base: 50ms}}}}\n"
            ));
        } else {
            y.push_str(&format!("  {name}: {{}}\n"));
        }
    }
    y
}

pub fn thousand_endpoints() -> PolicySet {
    let loaded = load(thousand_endpoints_yaml().as_bytes());
    let set = loaded
        .policies
        .expect("the generated 1,000-endpoint file is valid");
    assert_eq!(set.len(), ENDPOINTS);
    set
}

/// The resolved policy for [`TARGET`] on `name`, and a fresh state for the endpoint.
pub fn hot(set: &PolicySet, name: &str, origin: Instant) -> (RetryPolicy, EndpointState) {
    let endpoint = set.endpoint(name).expect("endpoint exists");
    let policy = RetryPolicy::clone(endpoint.resolve(&TARGET));
    assert_eq!(
        policy.per_try_timeout,
        Duration::from_millis(500),
        "route 2"
    );
    (policy, EndpointState::new(&endpoint.policy, origin))
}

/// One whole logical call: lookup, route, `RetryCall`, one attempt, its outcome.
#[inline(always)]
pub fn full_call(
    set: &PolicySet,
    name: &str,
    state: &EndpointState,
    outcome: Outcome,
    now: Instant,
    rng: &mut SeededRng,
) -> Decision {
    let endpoint = set.endpoint(black_box(name)).expect("endpoint exists");
    let policy = endpoint.resolve(black_box(&TARGET));
    let info = CallInfo::http(policy, "GET", false);
    let mut call = RetryCall::new(policy, state, info, now);
    let _ = call.start_attempt(now);
    call.on_outcome(outcome, now, rng)
}

/// One logical call on an already resolved policy.
#[inline(always)]
pub fn engine_call(
    policy: &RetryPolicy,
    state: &EndpointState,
    outcome: Outcome,
    now: Instant,
    rng: &mut SeededRng,
) -> Decision {
    let info = CallInfo::http(policy, "GET", false);
    let mut call = RetryCall::new(policy, state, info, now);
    let _ = call.start_attempt(now);
    call.on_outcome(outcome, now, rng)
}
