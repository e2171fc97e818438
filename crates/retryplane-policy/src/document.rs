//! The policy file as written: layers of optional fields, each with its place.
//!
//! Precedence (SPEC §1): built-in defaults ([`RetryPolicy::default`]) ← the file's `defaults:`
//! ← the endpoint's fields ← the first route whose `match` fits the call. Every layer sets only
//! what differs; a field it does not set is inherited from the layer below, field by field
//! (setting `backoff.base` on an endpoint keeps the inherited `backoff.max`). Lists
//! (`retry_on.http_status`, `idempotent_methods`, …) are replaced whole, not merged.
//!
//! A document also comes from the admin API or the wire, where places are unknown
//! ([`Loc::UNKNOWN`]); the same checks ([`crate::validate`]) run on both.

use std::sync::Arc;
use std::time::Duration;

use crate::codes::GrpcCode;
use crate::model::{AlertConfig, BreakerConfig, BudgetConfig, ErrorClass, Jitter, RetryPolicy};
use crate::yaml::Loc;

/// A value and where it is written.
#[derive(Clone, Debug, PartialEq)]
pub struct Field<T> {
    /// The value.
    pub value: T,
    /// Its place (unknown for values that came from no file).
    pub loc: Loc,
}

impl<T> Field<T> {
    /// A value with a known place.
    pub fn at(value: T, loc: Loc) -> Self {
        Self { value, loc }
    }

    /// A value from no file.
    pub fn new(value: T) -> Self {
        Self {
            value,
            loc: Loc::UNKNOWN,
        }
    }
}

/// `backoff:` fields of one layer.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BackoffOverlay {
    /// `backoff.base`
    pub base: Option<Field<Duration>>,
    /// `backoff.max`
    pub max: Option<Field<Duration>>,
    /// `backoff.multiplier`
    pub multiplier: Option<Field<f64>>,
    /// `backoff.jitter`
    pub jitter: Option<Field<Jitter>>,
}

/// `retry_on:` fields of one layer; each list replaces the inherited one.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RetryOnOverlay {
    /// `retry_on.http_status`
    pub http_status: Option<Field<Vec<Field<u16>>>>,
    /// `retry_on.grpc_status`
    pub grpc_status: Option<Field<Vec<Field<GrpcCode>>>>,
    /// `retry_on.errors`
    pub errors: Option<Field<Vec<Field<ErrorClass>>>>,
}

/// `retry_after:` fields of one layer.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RetryAfterOverlay {
    /// `retry_after.honor`
    pub honor: Option<Field<bool>>,
    /// `retry_after.max`
    pub max: Option<Field<Duration>>,
}

/// `budget:` fields of one layer.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BudgetOverlay {
    /// `budget.enabled`
    pub enabled: Option<Field<bool>>,
    /// `budget.ratio`
    pub ratio: Option<Field<f64>>,
    /// `budget.min_per_second`
    pub min_per_second: Option<Field<u32>>,
    /// `budget.window`
    pub window: Option<Field<Duration>>,
}

/// `circuit_breaker:` fields of one layer.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BreakerOverlay {
    /// `circuit_breaker.enabled`
    pub enabled: Option<Field<bool>>,
    /// `circuit_breaker.failure_ratio`
    pub failure_ratio: Option<Field<f64>>,
    /// `circuit_breaker.min_requests`
    pub min_requests: Option<Field<u32>>,
    /// `circuit_breaker.window`
    pub window: Option<Field<Duration>>,
    /// `circuit_breaker.open_for`
    pub open_for: Option<Field<Duration>>,
    /// `circuit_breaker.half_open_probes`
    pub half_open_probes: Option<Field<u32>>,
}

/// `alert:` fields of one layer. Alerting is per endpoint: only `defaults:` and endpoints may
/// set them ([`crate::validate`] refuses them on a route).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AlertOverlay {
    /// `alert.retry_ratio`
    pub retry_ratio: Option<Field<f64>>,
}

/// The policy fields one layer (defaults, endpoint or route) sets.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Overlay {
    /// `max_attempts`
    pub max_attempts: Option<Field<u32>>,
    /// `backoff`
    pub backoff: BackoffOverlay,
    /// `deadline`
    pub deadline: Option<Field<Duration>>,
    /// `per_try_timeout`
    pub per_try_timeout: Option<Field<Duration>>,
    /// `retry_on`
    pub retry_on: RetryOnOverlay,
    /// `idempotent_methods` (as written; checked by [`crate::validate`])
    pub idempotent_methods: Option<Field<Vec<Field<String>>>>,
    /// `idempotency_key_header`
    pub idempotency_key_header: Option<Field<String>>,
    /// `retry_after`
    pub retry_after: RetryAfterOverlay,
    /// `budget`
    pub budget: BudgetOverlay,
    /// `circuit_breaker`
    pub circuit_breaker: BreakerOverlay,
    /// `alert` (endpoint-level; not part of [`RetryPolicy`], see [`Overlay::resolve_alert`])
    pub alert: AlertOverlay,
}

/// Which calls a route applies to.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum RouteMatch {
    /// HTTP: an optional method (any when absent) and a path prefix (`/` when absent), which
    /// a path matches in any of its spellings ([`crate::uri_path`]: `%61` is `a`).
    Http {
        /// Upper-case method, or any.
        method: Option<String>,
        /// Path prefix, starting with `/`.
        path_prefix: String,
    },
    /// gRPC: `/pkg.Service/Method`, or every method of a service (`/pkg.Service/*`).
    Grpc {
        /// `pkg.Service`
        service: String,
        /// `Method`, or every method when absent.
        method: Option<String>,
    },
}

impl RouteMatch {
    /// Whether a call fits this match. Always inlined: it runs once per route on every call
    /// (`EndpointPolicy::resolve`), and with `#[inline]` alone the compiler kept it a call.
    #[inline(always)]
    pub fn matches(&self, target: &Target<'_>) -> bool {
        match (self, target) {
            (
                RouteMatch::Http {
                    method,
                    path_prefix,
                },
                Target::Http { method: m, path },
            ) => {
                method.as_deref().is_none_or(|want| str_eq(want, m))
                    && crate::uri_path::starts_with(path, path_prefix)
            }
            (RouteMatch::Grpc { service, method }, Target::Grpc { path }) => {
                let Some((svc, meth)) = path.strip_prefix('/').and_then(|p| p.split_once('/'))
                else {
                    return false;
                };
                str_eq(svc, service) && method.as_deref().is_none_or(|want| str_eq(want, meth))
            }
            _ => false,
        }
    }

    /// An HTTP match's path prefix in its canonical spelling ([`crate::uri_path::canonical`]);
    /// empty for a gRPC match.
    pub fn canonical_prefix(&self) -> std::borrow::Cow<'_, str> {
        match self {
            RouteMatch::Http { path_prefix, .. } => crate::uri_path::canonical(path_prefix),
            RouteMatch::Grpc { .. } => std::borrow::Cow::Borrowed(""),
        }
    }
}

/// `a == b`, inline: route matching and the endpoint lookup compare short strings on every
/// call, where a call into `memcmp` costs more than the comparison.
#[inline]
pub(crate) fn str_eq(a: &str, b: &str) -> bool {
    bytes_eq(a.as_bytes(), b.as_bytes())
}

/// `a == b` for the short strings of route matching and endpoint names, without a call: whole
/// 8-byte words, then the tail as one more word (or two halves) overlapping what was compared.
#[inline]
pub(crate) fn bytes_eq(a: &[u8], b: &[u8]) -> bool {
    let n = a.len();
    if n != b.len() {
        return false;
    }
    if n >= 8 {
        let (mut a8, mut b8) = (a.chunks_exact(8), b.chunks_exact(8));
        let words = a8
            .by_ref()
            .zip(b8.by_ref())
            .all(|(x, y)| word(x) == word(y));
        return words && (a8.remainder().is_empty() || a.last_chunk::<8>() == b.last_chunk::<8>());
    }
    if n >= 4 {
        return a.first_chunk::<4>() == b.first_chunk::<4>()
            && a.last_chunk::<4>() == b.last_chunk::<4>();
    }
    if n >= 2 {
        return a.first_chunk::<2>() == b.first_chunk::<2>()
            && a.last_chunk::<2>() == b.last_chunk::<2>();
    }
    a.first() == b.first()
}

/// An 8-byte chunk as one word.
#[inline]
fn word(chunk: &[u8]) -> u64 {
    chunk.try_into().map_or(0, u64::from_ne_bytes)
}

impl std::fmt::Display for RouteMatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RouteMatch::Http {
                method,
                path_prefix,
            } => {
                write!(f, "{} {path_prefix}", method.as_deref().unwrap_or("*"))
            }
            RouteMatch::Grpc { service, method } => {
                write!(f, "/{service}/{}", method.as_deref().unwrap_or("*"))
            }
        }
    }
}

/// The call a policy is looked up for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target<'a> {
    /// An HTTP request: method (upper case) and path (no query string).
    Http {
        /// `GET`, `POST`, …
        method: &'a str,
        /// `/v1/charges`
        path: &'a str,
    },
    /// A gRPC call: `/pkg.Service/Method`.
    Grpc {
        /// `/pkg.Service/Method`
        path: &'a str,
    },
    /// No route information: the endpoint's own policy.
    Endpoint,
}

/// One `routes:` entry.
#[derive(Clone, Debug, PartialEq)]
pub struct RouteDoc {
    /// Which calls it applies to; `loc` is the `match` value's place.
    pub matcher: Field<RouteMatch>,
    /// The `path_prefix` value's place, which diagnostics about the prefix point at: the
    /// `match` value's place when the file writes no `path_prefix`, and [`Loc::UNKNOWN`] for
    /// a route that came from no file.
    pub prefix_loc: Loc,
    /// The fields it overrides.
    pub overlay: Overlay,
    /// Its place in the endpoint's `routes:` as written (`routes[0]` is the first), which
    /// diagnostics name. A route refused before it still counts, so this can be larger than
    /// the route's place in [`EndpointDoc::routes`].
    pub index: usize,
}

/// One `endpoints:` entry.
#[derive(Clone, Debug, PartialEq)]
pub struct EndpointDoc {
    /// The logical upstream name; `loc` is the key's place.
    pub name: Field<String>,
    /// The fields it overrides.
    pub overlay: Overlay,
    /// Route overrides, first match wins.
    pub routes: Vec<RouteDoc>,
}

/// A whole policy file as written.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PolicyDocument {
    /// The `defaults:` layer.
    pub defaults: Overlay,
    /// Endpoints in file order.
    pub endpoints: Vec<EndpointDoc>,
}

/// The layer a value of an effective policy comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Level {
    /// The built-in default of SPEC §1.
    BuiltIn,
    /// The file's `defaults:`.
    Defaults,
    /// The endpoint's own fields.
    Endpoint,
    /// A route override.
    Route,
}

impl Level {
    /// `built-in`, `defaults`, `endpoint`, `route`.
    pub fn as_str(self) -> &'static str {
        match self {
            Level::BuiltIn => "built-in",
            Level::Defaults => "defaults",
            Level::Endpoint => "endpoint",
            Level::Route => "route",
        }
    }
}

fn set<T: Clone>(slot: &mut T, field: &Option<Field<T>>) {
    if let Some(f) = field {
        *slot = f.value.clone();
    }
}

/// A list as a policy holds it: each value once, in the order first written (a repeat is
/// warned of, and looked up on every failed attempt: a document of a million repeats must not
/// make a policy of a million items).
fn list<T: Clone + Eq + std::hash::Hash>(field: &Option<Field<Vec<Field<T>>>>) -> Option<Arc<[T]>> {
    field.as_ref().map(|f| {
        let mut seen = std::collections::HashSet::new();
        f.value
            .iter()
            .filter(|item| seen.insert(&item.value))
            .map(|item| item.value.clone())
            .collect()
    })
}

impl Overlay {
    /// `base` with this layer's fields laid over it. To stack layers, merge them first with
    /// [`Overlay::over`] (or use [`Overlay::resolve`]). `alert` is not a call's setting and is
    /// left out: see [`Overlay::alert`].
    pub fn apply(&self, base: &RetryPolicy) -> RetryPolicy {
        self.apply_to(base.clone())
    }

    /// [`Overlay::apply`] over a policy taken by value.
    fn apply_to(&self, mut p: RetryPolicy) -> RetryPolicy {
        set(&mut p.max_attempts, &self.max_attempts);
        set(&mut p.backoff.base, &self.backoff.base);
        set(&mut p.backoff.max, &self.backoff.max);
        set(&mut p.backoff.multiplier, &self.backoff.multiplier);
        set(&mut p.backoff.jitter, &self.backoff.jitter);
        set(&mut p.deadline, &self.deadline);
        set(&mut p.per_try_timeout, &self.per_try_timeout);
        if let Some(l) = list(&self.retry_on.http_status) {
            p.retry_on.http_status = l;
        }
        if let Some(l) = list(&self.retry_on.grpc_status) {
            p.retry_on.grpc_status = l;
        }
        if let Some(l) = list(&self.retry_on.errors) {
            p.retry_on.errors = l;
        }
        if let Some(f) = &self.idempotent_methods {
            let mut seen = std::collections::HashSet::new();
            p.idempotent_methods = f
                .value
                .iter()
                .filter(|m| seen.insert(m.value.as_str()))
                .map(|m| Arc::from(m.value.as_str()))
                .collect();
        }
        if let Some(f) = &self.idempotency_key_header {
            p.idempotency_key_header = Arc::from(f.value.as_str());
        }
        set(&mut p.retry_after.honor, &self.retry_after.honor);
        set(&mut p.retry_after.max, &self.retry_after.max);
        p.budget = apply_budget(&self.budget, p.budget.take());
        p.circuit_breaker = apply_breaker(&self.circuit_breaker, p.circuit_breaker.take());
        p
    }

    /// The built-in values ([`RetryPolicy::default`], [`AlertConfig::default`]) as a layer that
    /// sets every field: what a layer that sets nothing inherits at the bottom, as a file
    /// would write it (shown by [`crate::diff`] for a field that goes from set to inherited).
    pub fn built_in() -> Overlay {
        fn f<T>(value: T) -> Option<Field<T>> {
            Some(Field::new(value))
        }
        fn list<T: Clone>(items: &[T]) -> Option<Field<Vec<Field<T>>>> {
            f(items.iter().cloned().map(Field::new).collect())
        }
        let p = RetryPolicy::default();
        let budget = p.budget.clone().unwrap_or_default();
        let breaker = p.circuit_breaker.clone().unwrap_or_default();
        Overlay {
            max_attempts: f(p.max_attempts),
            backoff: BackoffOverlay {
                base: f(p.backoff.base),
                max: f(p.backoff.max),
                multiplier: f(p.backoff.multiplier),
                jitter: f(p.backoff.jitter),
            },
            deadline: f(p.deadline),
            per_try_timeout: f(p.per_try_timeout),
            retry_on: RetryOnOverlay {
                http_status: list(&p.retry_on.http_status),
                grpc_status: list(&p.retry_on.grpc_status),
                errors: list(&p.retry_on.errors),
            },
            idempotent_methods: f(p
                .idempotent_methods
                .iter()
                .map(|m| Field::new(m.to_string()))
                .collect()),
            idempotency_key_header: f(p.idempotency_key_header.to_string()),
            retry_after: RetryAfterOverlay {
                honor: f(p.retry_after.honor),
                max: f(p.retry_after.max),
            },
            budget: BudgetOverlay {
                enabled: f(p.budget.is_some()),
                ratio: f(budget.ratio),
                min_per_second: f(budget.min_per_second),
                window: f(budget.window),
            },
            circuit_breaker: BreakerOverlay {
                enabled: f(p.circuit_breaker.is_some()),
                failure_ratio: f(breaker.failure_ratio),
                min_requests: f(breaker.min_requests),
                window: f(breaker.window),
                open_for: f(breaker.open_for),
                half_open_probes: f(breaker.half_open_probes),
            },
            alert: AlertOverlay {
                retry_ratio: f(AlertConfig::default().retry_ratio),
            },
        }
    }

    /// This layer laid over `lower`: every field this layer sets, else `lower`'s. Layers are
    /// merged before they are applied so that a setting survives a lower layer turning its
    /// section off (`budget: {enabled: false, ratio: 0.5}` in `defaults:`, `enabled: true` on
    /// an endpoint brings back the ratio of `defaults:`, not the built-in one). A route cannot
    /// turn a section back on: the budget and the breaker are the endpoint's
    /// ([`crate::validate`]).
    #[must_use]
    pub fn over(&self, lower: &Overlay) -> Overlay {
        self.over_owned(lower.clone())
    }

    /// [`Overlay::over`], taking `lower` by value: what this layer does not set is moved
    /// from it, not copied (layers stacked one over the other copy each value once).
    fn over_owned(&self, lower: Overlay) -> Overlay {
        fn pick<T: Clone>(upper: &Option<T>, lower: Option<T>) -> Option<T> {
            match upper {
                Some(u) => Some(u.clone()),
                None => lower,
            }
        }
        let (u, l) = (self, lower);
        Overlay {
            max_attempts: pick(&u.max_attempts, l.max_attempts),
            backoff: BackoffOverlay {
                base: pick(&u.backoff.base, l.backoff.base),
                max: pick(&u.backoff.max, l.backoff.max),
                multiplier: pick(&u.backoff.multiplier, l.backoff.multiplier),
                jitter: pick(&u.backoff.jitter, l.backoff.jitter),
            },
            deadline: pick(&u.deadline, l.deadline),
            per_try_timeout: pick(&u.per_try_timeout, l.per_try_timeout),
            retry_on: RetryOnOverlay {
                http_status: pick(&u.retry_on.http_status, l.retry_on.http_status),
                grpc_status: pick(&u.retry_on.grpc_status, l.retry_on.grpc_status),
                errors: pick(&u.retry_on.errors, l.retry_on.errors),
            },
            idempotent_methods: pick(&u.idempotent_methods, l.idempotent_methods),
            idempotency_key_header: pick(&u.idempotency_key_header, l.idempotency_key_header),
            retry_after: RetryAfterOverlay {
                honor: pick(&u.retry_after.honor, l.retry_after.honor),
                max: pick(&u.retry_after.max, l.retry_after.max),
            },
            budget: BudgetOverlay {
                enabled: pick(&u.budget.enabled, l.budget.enabled),
                ratio: pick(&u.budget.ratio, l.budget.ratio),
                min_per_second: pick(&u.budget.min_per_second, l.budget.min_per_second),
                window: pick(&u.budget.window, l.budget.window),
            },
            circuit_breaker: BreakerOverlay {
                enabled: pick(&u.circuit_breaker.enabled, l.circuit_breaker.enabled),
                failure_ratio: pick(
                    &u.circuit_breaker.failure_ratio,
                    l.circuit_breaker.failure_ratio,
                ),
                min_requests: pick(
                    &u.circuit_breaker.min_requests,
                    l.circuit_breaker.min_requests,
                ),
                window: pick(&u.circuit_breaker.window, l.circuit_breaker.window),
                open_for: pick(&u.circuit_breaker.open_for, l.circuit_breaker.open_for),
                half_open_probes: pick(
                    &u.circuit_breaker.half_open_probes,
                    l.circuit_breaker.half_open_probes,
                ),
            },
            alert: AlertOverlay {
                retry_ratio: pick(&u.alert.retry_ratio, l.alert.retry_ratio),
            },
        }
    }

    /// The alert settings this layer makes over the built-in values ([`AlertConfig::default`]).
    /// To stack layers, merge them first with [`Overlay::over`] (or use
    /// [`Overlay::resolve_alert`]).
    pub fn alert(&self) -> AlertConfig {
        let mut a = AlertConfig::default();
        set(&mut a.retry_ratio, &self.alert.retry_ratio);
        a
    }

    /// The alert settings of a stack of layers, lowest first, over the built-in values.
    pub fn resolve_alert<'a>(layers: impl IntoIterator<Item = &'a Overlay>) -> AlertConfig {
        layers
            .into_iter()
            .fold(Overlay::default(), |acc, layer| layer.over_owned(acc))
            .alert()
    }

    /// The effective policy of a stack of layers, lowest first, over the built-in values.
    pub fn resolve<'a>(layers: impl IntoIterator<Item = &'a Overlay>) -> RetryPolicy {
        let merged = layers
            .into_iter()
            .fold(Overlay::default(), |acc, layer| layer.over_owned(acc));
        merged.apply_to(RetryPolicy::default())
    }

    /// The leaf fields this layer sets, as `(path, place)`; `path` is relative
    /// (`backoff.max`), in the order [`FIELD_PATHS`] lists them.
    pub fn set_fields(&self) -> Vec<(&'static str, Loc)> {
        let o = self;
        let candidates: [(&'static str, Option<Loc>); 25] = [
            ("max_attempts", o.max_attempts.as_ref().map(|f| f.loc)),
            ("backoff.base", o.backoff.base.as_ref().map(|f| f.loc)),
            ("backoff.max", o.backoff.max.as_ref().map(|f| f.loc)),
            (
                "backoff.multiplier",
                o.backoff.multiplier.as_ref().map(|f| f.loc),
            ),
            ("backoff.jitter", o.backoff.jitter.as_ref().map(|f| f.loc)),
            ("deadline", o.deadline.as_ref().map(|f| f.loc)),
            ("per_try_timeout", o.per_try_timeout.as_ref().map(|f| f.loc)),
            (
                "retry_on.http_status",
                o.retry_on.http_status.as_ref().map(|f| f.loc),
            ),
            (
                "retry_on.grpc_status",
                o.retry_on.grpc_status.as_ref().map(|f| f.loc),
            ),
            ("retry_on.errors", o.retry_on.errors.as_ref().map(|f| f.loc)),
            (
                "idempotent_methods",
                o.idempotent_methods.as_ref().map(|f| f.loc),
            ),
            (
                "idempotency_key_header",
                o.idempotency_key_header.as_ref().map(|f| f.loc),
            ),
            (
                "retry_after.honor",
                o.retry_after.honor.as_ref().map(|f| f.loc),
            ),
            ("retry_after.max", o.retry_after.max.as_ref().map(|f| f.loc)),
            ("budget.enabled", o.budget.enabled.as_ref().map(|f| f.loc)),
            ("budget.ratio", o.budget.ratio.as_ref().map(|f| f.loc)),
            (
                "budget.min_per_second",
                o.budget.min_per_second.as_ref().map(|f| f.loc),
            ),
            ("budget.window", o.budget.window.as_ref().map(|f| f.loc)),
            (
                "circuit_breaker.enabled",
                o.circuit_breaker.enabled.as_ref().map(|f| f.loc),
            ),
            (
                "circuit_breaker.failure_ratio",
                o.circuit_breaker.failure_ratio.as_ref().map(|f| f.loc),
            ),
            (
                "circuit_breaker.min_requests",
                o.circuit_breaker.min_requests.as_ref().map(|f| f.loc),
            ),
            (
                "circuit_breaker.window",
                o.circuit_breaker.window.as_ref().map(|f| f.loc),
            ),
            (
                "circuit_breaker.open_for",
                o.circuit_breaker.open_for.as_ref().map(|f| f.loc),
            ),
            (
                "circuit_breaker.half_open_probes",
                o.circuit_breaker.half_open_probes.as_ref().map(|f| f.loc),
            ),
            (
                "alert.retry_ratio",
                o.alert.retry_ratio.as_ref().map(|f| f.loc),
            ),
        ];
        candidates
            .into_iter()
            .filter_map(|(path, loc)| loc.map(|l| (path, l)))
            .collect()
    }

    /// Where this layer sets `path` (a [`FIELD_PATHS`] entry), if it does.
    pub fn loc_of(&self, path: &str) -> Option<Loc> {
        self.set_fields()
            .into_iter()
            .find(|(p, _)| *p == path)
            .map(|(_, l)| l)
    }
}

/// Every leaf field path of a policy, in display order.
pub const FIELD_PATHS: [&str; 25] = [
    "max_attempts",
    "backoff.base",
    "backoff.max",
    "backoff.multiplier",
    "backoff.jitter",
    "deadline",
    "per_try_timeout",
    "retry_on.http_status",
    "retry_on.grpc_status",
    "retry_on.errors",
    "idempotent_methods",
    "idempotency_key_header",
    "retry_after.honor",
    "retry_after.max",
    "budget.enabled",
    "budget.ratio",
    "budget.min_per_second",
    "budget.window",
    "circuit_breaker.enabled",
    "circuit_breaker.failure_ratio",
    "circuit_breaker.min_requests",
    "circuit_breaker.window",
    "circuit_breaker.open_for",
    "circuit_breaker.half_open_probes",
    "alert.retry_ratio",
];

/// Budget settings survive `enabled: false` in a lower layer, so a higher layer that turns the
/// budget back on gets the inherited numbers, not the built-in ones.
fn apply_budget(o: &BudgetOverlay, inherited: Option<BudgetConfig>) -> Option<BudgetConfig> {
    let enabled = o.enabled.as_ref().map_or(inherited.is_some(), |f| f.value);
    let mut cfg = inherited.unwrap_or_default();
    set(&mut cfg.ratio, &o.ratio);
    set(&mut cfg.min_per_second, &o.min_per_second);
    set(&mut cfg.window, &o.window);
    enabled.then_some(cfg)
}

fn apply_breaker(o: &BreakerOverlay, inherited: Option<BreakerConfig>) -> Option<BreakerConfig> {
    let enabled = o.enabled.as_ref().map_or(inherited.is_some(), |f| f.value);
    let mut cfg = inherited.unwrap_or_default();
    set(&mut cfg.failure_ratio, &o.failure_ratio);
    set(&mut cfg.min_requests, &o.min_requests);
    set(&mut cfg.window, &o.window);
    set(&mut cfg.open_for, &o.open_for);
    set(&mut cfg.half_open_probes, &o.half_open_probes);
    enabled.then_some(cfg)
}

impl PolicyDocument {
    /// The endpoint named `name`.
    pub fn endpoint(&self, name: &str) -> Option<&EndpointDoc> {
        self.endpoints.iter().find(|e| e.name.value == name)
    }

    /// The layers that make the effective policy of `endpoint` for `target`, lowest first,
    /// with the index of the route used (if any).
    pub fn layers<'a>(
        &'a self,
        endpoint: &'a EndpointDoc,
        target: &Target<'_>,
    ) -> (Vec<(Level, &'a Overlay)>, Option<usize>) {
        let mut layers = vec![
            (Level::Defaults, &self.defaults),
            (Level::Endpoint, &endpoint.overlay),
        ];
        let route = endpoint
            .routes
            .iter()
            .position(|r| r.matcher.value.matches(target));
        if let Some(i) = route {
            layers.push((Level::Route, &endpoint.routes[i].overlay));
        }
        (layers, route)
    }

    /// The effective policy of `endpoint` for `target`.
    pub fn effective(&self, endpoint: &EndpointDoc, target: &Target<'_>) -> RetryPolicy {
        let (layers, _) = self.layers(endpoint, target);
        Overlay::resolve(layers.iter().map(|(_, o)| *o))
    }

    /// The alert settings of `endpoint`: built-in ← `defaults:` ← the endpoint (routes have
    /// none).
    pub fn effective_alert(&self, endpoint: &EndpointDoc) -> AlertConfig {
        Overlay::resolve_alert([&self.defaults, &endpoint.overlay])
    }
}
