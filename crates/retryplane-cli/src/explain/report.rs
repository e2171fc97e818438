//! The explanation of one call as plain data, built from the policy document; [`super::text`]
//! renders it for people, serde as JSON (durations as numbers of milliseconds, `*_ms`).

use std::time::Duration;

use retryplane_policy::backoff;
use retryplane_policy::document::{EndpointDoc, FIELD_PATHS, Level, Overlay, PolicyDocument};
use retryplane_policy::yaml::Loc;
use retryplane_policy::{AlertConfig, BudgetConfig, ErrorClass, Jitter, RetryPolicy};
use serde::Serialize;
use serde_json::Value;

use super::Call;
use super::fields;
use crate::output::Millis;

/// Everything `explain` says about one call.
#[derive(Debug, Serialize)]
pub struct Explanation {
    /// The policy file as named on the command line.
    pub file: String,
    /// The endpoint and where the file defines it.
    pub endpoint: EndpointRef,
    /// The call looked up.
    pub call: Call,
    /// The route used, or `None` (no route matched, or no call given).
    pub route: Option<RouteRef>,
    /// Whether the call is retried at all.
    pub retried: Retried,
    /// The effective policy, one leaf field per entry, in [`FIELD_PATHS`] order; the
    /// endpoint's `alert` settings come last (routes cannot set them).
    pub policy: Vec<FieldRow>,
    /// The pauses, retry by retry, against the deadline.
    pub schedule: Schedule,
    /// How many upstream requests one logical call may become.
    pub load: Load,
}

/// An endpoint and its place.
#[derive(Debug, Serialize)]
pub struct EndpointRef {
    /// The logical upstream name.
    pub name: String,
    /// Line of its key, when known.
    pub line: Option<u32>,
    /// Column of its key, when known.
    pub column: Option<u32>,
}

/// The route that matched.
#[derive(Debug, Serialize)]
pub struct RouteRef {
    /// Its index in the endpoint's `routes:` (`routes[0]` is the first).
    pub index: usize,
    /// Its match, as `METHOD /prefix` (`*` for any method) or `/pkg.Service/Method`.
    #[serde(rename = "match")]
    pub matcher: String,
    /// Line of its `match`, when known.
    pub line: Option<u32>,
    /// Column of its `match`, when known.
    pub column: Option<u32>,
}

/// Whether failures of this call are retried (SPEC §2 step 4).
#[derive(Debug, Serialize)]
pub struct Retried {
    /// Whether the HTTP method is in `idempotent_methods`; `None` for gRPC (the caller declares
    /// it) and when no call is given.
    pub idempotent: Option<bool>,
    /// The header that makes any call retryable.
    pub idempotency_key_header: String,
    /// One sentence saying when the call is retried.
    pub summary: String,
}

/// One leaf field of the effective policy.
#[derive(Debug, Serialize)]
pub struct FieldRow {
    /// The path, such as `backoff.max`.
    pub field: &'static str,
    /// The value: durations in milliseconds, lists as arrays, `null` for a setting of a
    /// disabled budget or circuit breaker.
    pub value: Value,
    /// The value as a policy file writes it (`1500ms`, `[GET, PUT]`, `(disabled)`).
    pub text: String,
    /// `built-in`, `defaults`, `endpoint` or `route`.
    pub level: &'static str,
    /// Where the file sets it; `None` for built-in values.
    pub line: Option<u32>,
    /// Where the file sets it; `None` for built-in values.
    pub column: Option<u32>,
}

/// The pauses of one call, retry by retry, against the deadline.
///
/// Retry `n` follows failed attempt `n` and starts attempt `n + 1`. Its worst-case start is
/// the latest time, from the start of the call, at which attempt `n + 1` can start:
///
/// `worst_case_start(n) = n × per_try_timeout + Σ_{k=1..=n} jitter_high(k)`
///
/// — every attempt so far ran its whole per-try timeout and every pause was the longest its
/// jitter allows (server hints aside). It `fits_deadline` when it is before the deadline: the
/// attempt then gets to start, unless the attempts and pauses before it end later than their
/// timeouts say (a timer can fire a millisecond or so late), which matters only for a start
/// within a few ms of the deadline. When it does not fit, a slow enough failure ends the
/// call with `deadline_exceeded` before that attempt; the call itself never runs past the
/// deadline, since each attempt's timeout is `min(per_try_timeout, deadline left)`. The sum
/// saturates instead of overflowing.
#[derive(Debug, Serialize)]
pub struct Schedule {
    /// The whole call's limit.
    pub deadline_ms: Millis,
    /// One attempt's limit.
    pub per_try_timeout_ms: Millis,
    /// The jitter kind (`none`, `full`, `equal`, `decorrelated`).
    pub jitter: &'static str,
    /// Retries 1 to `max_attempts - 1`; none when the call is never retried.
    pub retries: Vec<ScheduleRow>,
    /// Why the call is never retried, when it is not (text output only).
    #[serde(skip)]
    pub never: Option<&'static str>,
}

/// One retry of the [`Schedule`].
#[derive(Debug, Serialize)]
pub struct ScheduleRow {
    /// `n`, from 1.
    pub retry: u32,
    /// The attempt it starts, `n + 1`.
    pub attempt: u32,
    /// `min(backoff.max, base × multiplier^(n-1))`; `None` for `decorrelated` jitter, whose
    /// pauses do not follow it (each is drawn from `[base, 3 × the previous pause]`; the jitter
    /// range is their bound).
    pub ceiling_ms: Option<Millis>,
    /// The shortest pause the jitter allows.
    pub jitter_low_ms: Millis,
    /// The longest pause the jitter allows.
    pub jitter_high_ms: Millis,
    /// See [`Schedule`].
    pub worst_case_start_ms: Millis,
    /// `worst_case_start < deadline`.
    pub fits_deadline: bool,
}

/// Upstream requests per logical call in the worst case (every attempt fails).
#[derive(Debug, Serialize)]
pub struct Load {
    /// The most times one call may be sent without a budget: `max_attempts`, less the attempts
    /// that can never start inside the deadline ([`Load::first_unreachable_attempt`]); 1 when
    /// the call is never retried.
    pub multiplier: u32,
    /// The first attempt that can never start inside the deadline on the policy's own pauses,
    /// even when every attempt before it fails at once and every pause is the shortest its
    /// jitter allows; `None` when every attempt can. [`Load::multiplier`] leaves it and the
    /// later ones out unless a gRPC server's pushback can replace those pauses by shorter
    /// ones (a gRPC call, or no call given, with `retry_after.honor`).
    pub first_unreachable_attempt: Option<u32>,
    /// The bound the retry budget adds, when it is enabled.
    pub budget: Option<BudgetLoad>,
}

/// The retry budget's bound on load (SPEC §2 step 6): retries in any window are at most
/// `max(min_per_second × window, ratio × calls in the window)`.
#[derive(Debug, Serialize)]
pub struct BudgetLoad {
    /// Retries allowed per logical call.
    pub ratio: f64,
    /// `min(1 + ratio, max_attempts)`: upstream requests per logical call once traffic is high
    /// enough for the ratio, not the reserve, to bound retries.
    pub multiplier: f64,
    /// Retries per second always allowed (the reserve).
    pub min_per_second: u32,
    /// The budget's window.
    pub window_ms: Millis,
    /// `floor(min_per_second × window)`: retries allowed per window whatever the traffic.
    pub reserve_per_window: u64,
    /// `min_per_second / ratio`: at fewer calls per second than this, the reserve allows more
    /// retries than the ratio; `None` when the ratio is 0 (only the reserve).
    pub ratio_applies_from_calls_per_second: Option<f64>,
}

/// Explains `call` on `endpoint` of a checked document.
pub fn explain(
    file: &str,
    doc: &PolicyDocument,
    endpoint: &EndpointDoc,
    call: &Call,
) -> Explanation {
    let target = call.target();
    let (layers, route_index) = doc.layers(endpoint, &target);
    let policy = doc.effective(endpoint, &target);
    let alert = doc.effective_alert(endpoint);
    let route = route_index.and_then(|i| endpoint.routes.get(i));
    Explanation {
        file: file.to_owned(),
        endpoint: EndpointRef {
            name: endpoint.name.value.clone(),
            line: known(endpoint.name.loc).map(|l| l.line),
            column: known(endpoint.name.loc).map(|l| l.column),
        },
        call: call.clone(),
        route: route.map(|r| RouteRef {
            index: r.index,
            matcher: r.matcher.value.to_string(),
            line: known(r.matcher.loc).map(|l| l.line),
            column: known(r.matcher.loc).map(|l| l.column),
        }),
        retried: retried(&policy, call),
        policy: FIELD_PATHS
            .iter()
            .map(|&field| field_row(&policy, &alert, &layers, field))
            .collect(),
        schedule: schedule(&policy),
        load: Load {
            multiplier: sends(&policy, call),
            first_unreachable_attempt: backoff::first_unreachable_attempt(
                &policy.backoff,
                attempts(&policy),
                policy.deadline,
            ),
            budget: policy
                .budget
                .as_ref()
                .map(|b| budget_load(b, sends(&policy, call))),
        },
    }
}

/// The attempts the schedule shows: `max_attempts`, or 1 when the call is never retried.
fn attempts(p: &RetryPolicy) -> u32 {
    if never_retried(p).is_some() {
        1
    } else {
        p.max_attempts
    }
}

/// The most times one call is sent: [`attempts`], less those that can never start (see
/// [`Load::first_unreachable_attempt`]).
fn sends(p: &RetryPolicy, call: &Call) -> u32 {
    let all = attempts(p);
    // gRFC A6: a pushback replaces the computed pause, and may be shorter than any of them.
    if p.retry_after.honor && !matches!(call, Call::Http { .. }) {
        return all;
    }
    backoff::first_unreachable_attempt(&p.backoff, all, p.deadline).map_or(all, |first| first - 1)
}

/// Why a call is never retried, if it is not: `max_attempts` is 1, or `retry_on` lists no
/// failure at all. Every list counts for every call: an HTTP call's answer may be a
/// "Trailers-Only" gRPC one (`grpc-status` in its head), judged by its code, and a gRPC call's
/// may be a proxy's plain HTTP status; the worst case counts them.
fn never_retried(p: &RetryPolicy) -> Option<&'static str> {
    if p.max_attempts <= 1 {
        Some("max_attempts is 1")
    } else if p.retry_on.lists_nothing() {
        Some("retry_on lists no failure this call can have")
    } else {
        None
    }
}

fn known(loc: Loc) -> Option<Loc> {
    loc.is_known().then_some(loc)
}

fn retried(p: &RetryPolicy, call: &Call) -> Retried {
    let key = p.idempotency_key_header.to_string();
    // The engine retries a failed connect of any call, but only when `connect` is in
    // retry_on.errors; otherwise nothing is retried without the key.
    let connect = if p.retry_on.errors.contains(&ErrorClass::Connect) {
        " (a failed connect, which never reached the server, is retried anyway)"
    } else {
        ""
    };
    let idempotent = match call {
        Call::Http { method, .. } => Some(p.is_idempotent(method)),
        _ => None,
    };
    let summary = match call {
        _ if let Some(why) = never_retried(p) => format!("never: {why}"),
        Call::Http { method, .. } if p.is_idempotent(method) => {
            format!("yes, on the failures in retry_on: {method} is in idempotent_methods")
        }
        Call::Http { method, .. } => format!(
            "only when the request carries the `{key}` header: {method} is not in idempotent_methods{connect}"
        ),
        Call::Grpc { .. } => format!(
            "when the caller declares the method idempotent or sends `{key}` metadata{connect}"
        ),
        Call::Endpoint => format!(
            "HTTP: for methods in idempotent_methods, or requests carrying the `{key}` header; \
             gRPC: when the caller declares the method idempotent or sends `{key}` metadata; \
             a call the agent makes with `CallMeta::endpoint()` (no method): on every failure in retry_on{connect}"
        ),
    };
    Retried {
        idempotent,
        idempotency_key_header: key,
        summary,
    }
}

/// The most specific layer that sets `field`, and where; built-in when none does.
fn field_row(
    p: &RetryPolicy,
    alert: &AlertConfig,
    layers: &[(Level, &Overlay)],
    field: &'static str,
) -> FieldRow {
    let (level, loc) = layers
        .iter()
        .rev()
        .find_map(|(level, overlay)| overlay.loc_of(field).map(|loc| (*level, known(loc))))
        .unwrap_or((Level::BuiltIn, None));
    let (value, text) =
        fields::value(p, alert, field).unwrap_or_else(|| (Value::Null, "(not shown)".to_owned()));
    FieldRow {
        field,
        value,
        text,
        level: level.as_str(),
        line: loc.map(|l| l.line),
        column: loc.map(|l| l.column),
    }
}

/// See [`Schedule`] for the definitions.
fn schedule(p: &RetryPolicy) -> Schedule {
    let mut worst = Duration::ZERO;
    // No rows for a call that is never retried (see `attempts`).
    let never = never_retried(p);
    let retries = (1..attempts(p))
        .map(|n| {
            let (low, high) = backoff::jitter_range(&p.backoff, n);
            worst = worst.saturating_add(p.per_try_timeout).saturating_add(high);
            ScheduleRow {
                retry: n,
                attempt: n + 1,
                ceiling_ms: (p.backoff.jitter != Jitter::Decorrelated)
                    .then(|| Millis(backoff::ceiling(&p.backoff, n))),
                jitter_low_ms: Millis(low),
                jitter_high_ms: Millis(high),
                worst_case_start_ms: Millis(worst),
                fits_deadline: worst < p.deadline,
            }
        })
        .collect();
    Schedule {
        deadline_ms: Millis(p.deadline),
        per_try_timeout_ms: Millis(p.per_try_timeout),
        jitter: p.backoff.jitter.as_str(),
        retries,
        never,
    }
}

fn budget_load(b: &BudgetConfig, max_attempts: u32) -> BudgetLoad {
    BudgetLoad {
        ratio: b.ratio,
        multiplier: (1.0 + b.ratio).min(f64::from(max_attempts)),
        min_per_second: b.min_per_second,
        window_ms: Millis(b.window),
        // What the engine's budget allows, rounded as it rounds.
        reserve_per_window: retryplane_policy::budget::reserve_per_window(b),
        ratio_applies_from_calls_per_second: (b.ratio > 0.0)
            .then(|| f64::from(b.min_per_second) / b.ratio),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use retryplane_policy::Jitter;

    fn policy(max_attempts: u32, jitter: Jitter) -> RetryPolicy {
        let mut p = RetryPolicy {
            max_attempts,
            ..RetryPolicy::default()
        };
        p.backoff.base = Duration::from_millis(100);
        p.backoff.max = Duration::from_secs(2);
        p.backoff.jitter = jitter;
        p.per_try_timeout = Duration::from_secs(1);
        p.deadline = Duration::from_secs(10);
        p
    }

    #[test]
    fn worst_case_start_adds_timeouts_and_longest_pauses() {
        let s = schedule(&policy(7, Jitter::None));
        let ceilings: Vec<_> = s
            .retries
            .iter()
            .filter_map(|r| r.ceiling_ms.map(|c| c.to_string()))
            .collect();
        assert_eq!(
            ceilings,
            ["100ms", "200ms", "400ms", "800ms", "1600ms", "2000ms"]
        );
        let starts: Vec<_> = s
            .retries
            .iter()
            .map(|r| r.worst_case_start_ms.0.as_millis())
            .collect();
        assert_eq!(starts, [1100, 2300, 3700, 5500, 8100, 11100]);
        let fits: Vec<_> = s.retries.iter().map(|r| r.fits_deadline).collect();
        assert_eq!(fits, [true, true, true, true, true, false]);
    }

    #[test]
    fn decorrelated_pauses_have_no_ceiling() {
        let s = schedule(&policy(3, Jitter::Decorrelated));
        assert!(s.retries.iter().all(|r| r.ceiling_ms.is_none()));
        let s = schedule(&policy(3, Jitter::Equal));
        assert!(s.retries.iter().all(|r| r.ceiling_ms.is_some()));
    }

    #[test]
    fn attempts_that_can_never_start_are_not_sent() {
        // Pauses of 400ms and 800ms: attempt 3 would start at 1200ms at the earliest.
        let mut p = policy(4, Jitter::None);
        p.backoff.base = Duration::from_millis(400);
        p.deadline = Duration::from_secs(1);
        p.per_try_timeout = Duration::from_millis(600);
        let http = Call::Http {
            method: "GET".into(),
            path: "/".into(),
        };
        let grpc = Call::Grpc {
            path: "/a.B/C".into(),
        };
        assert_eq!(sends(&p, &http), 2);
        // A gRPC server's pushback can replace the pauses by shorter ones.
        assert_eq!(sends(&p, &grpc), 4);
        assert_eq!(sends(&p, &Call::Endpoint), 4);
        p.retry_after.honor = false;
        assert_eq!(sends(&p, &grpc), 2);
        assert_eq!(sends(&p, &Call::Endpoint), 2);
        // The schedule still shows every retry the policy asks for.
        assert_eq!(schedule(&p).retries.len(), 3);
        p.deadline = Duration::from_secs(10);
        assert_eq!(sends(&p, &http), 4);
    }

    #[test]
    fn an_endpoint_alone_says_when_each_kind_of_call_is_retried() {
        let summary = retried(&policy(3, Jitter::Full), &Call::Endpoint).summary;
        assert!(
            summary.contains("HTTP: for methods in idempotent_methods"),
            "{summary}"
        );
        assert!(
            summary.contains("gRPC: when the caller declares"),
            "{summary}"
        );
        assert!(
            summary.contains("`CallMeta::endpoint()` (no method): on every failure in retry_on"),
            "{summary}"
        );
    }

    #[test]
    fn one_attempt_has_no_retries() {
        assert!(schedule(&policy(1, Jitter::Full)).retries.is_empty());
    }

    #[test]
    fn budget_bounds_load_by_one_plus_ratio_above_the_reserve() {
        let b = BudgetConfig::default();
        let load = budget_load(&b, 4);
        assert!((load.multiplier - 1.2).abs() < 1e-12);
        assert_eq!(load.reserve_per_window, 100);
        assert_eq!(load.ratio_applies_from_calls_per_second, Some(50.0));
        assert!((budget_load(&b, 1).multiplier - 1.0).abs() < 1e-12);
        let zero = BudgetConfig { ratio: 0.0, ..b };
        assert_eq!(
            budget_load(&zero, 3).ratio_applies_from_calls_per_second,
            None
        );
    }
}
