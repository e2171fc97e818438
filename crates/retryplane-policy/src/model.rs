//! The validated policy model: plain data, no I/O (SPEC §1).
//!
//! A [`RetryPolicy`] is what one logical call runs under. It is built by layering the file's
//! `defaults:`, then the endpoint's fields, then a matching route's fields over
//! [`RetryPolicy::default`] (the built-in values of SPEC §1); see [`crate::document`] for the
//! layers and [`crate::PolicySet`] for lookup.

use std::sync::{Arc, LazyLock};
use std::time::Duration;

/// How a pause is randomised around its ceiling (SPEC §2 step 7).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Jitter {
    /// The pause is the ceiling.
    None,
    /// Uniform in `[0, ceiling]`.
    Full,
    /// `ceiling/2 + uniform[0, ceiling/2]`.
    Equal,
    /// `min(max, uniform[base, previous_pause × 3])`.
    Decorrelated,
}

impl Jitter {
    /// Every kind, in the order the docs list them.
    pub const ALL: [Jitter; 4] = [
        Jitter::None,
        Jitter::Full,
        Jitter::Equal,
        Jitter::Decorrelated,
    ];

    /// The name used in policy files.
    pub fn as_str(self) -> &'static str {
        match self {
            Jitter::None => "none",
            Jitter::Full => "full",
            Jitter::Equal => "equal",
            Jitter::Decorrelated => "decorrelated",
        }
    }

    /// Parses a policy-file name.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|j| j.as_str() == name)
    }
}

/// Exponential backoff settings.
#[derive(Clone, Debug, PartialEq)]
pub struct BackoffConfig {
    /// The first pause ceiling.
    pub base: Duration,
    /// Cap on any single pause.
    pub max: Duration,
    /// Growth factor per retry, at least 1.
    pub multiplier: f64,
    /// How the pause is randomised.
    pub jitter: Jitter,
}

impl Default for BackoffConfig {
    fn default() -> Self {
        Self {
            base: Duration::from_millis(100),
            max: Duration::from_secs(5),
            multiplier: 2.0,
            jitter: Jitter::Full,
        }
    }
}

/// A transport failure that produced no response.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ErrorClass {
    /// The connection could not be established: the request was never sent.
    Connect,
    /// The connection broke after the request may have been sent: unknown outcome.
    Reset,
    /// The attempt timed out: unknown outcome.
    Timeout,
}

impl ErrorClass {
    /// Every class.
    pub const ALL: [ErrorClass; 3] = [ErrorClass::Connect, ErrorClass::Reset, ErrorClass::Timeout];

    /// The name used in policy files and reports.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorClass::Connect => "connect",
            ErrorClass::Reset => "reset",
            ErrorClass::Timeout => "timeout",
        }
    }

    /// Parses a policy-file name.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.as_str() == name)
    }

    /// Whether the server may have acted on the request (SPEC §2 step 4): only a failed connect
    /// is known not to have reached it.
    pub fn outcome_unknown(self) -> bool {
        !matches!(self, ErrorClass::Connect)
    }
}

/// Which failures are retried.
#[derive(Clone, Debug, PartialEq)]
pub struct RetryOn {
    /// HTTP statuses, 400..=599.
    pub http_status: Arc<[u16]>,
    /// gRPC status codes (numeric, see [`crate::codes::GrpcCode`]).
    pub grpc_status: Arc<[crate::codes::GrpcCode]>,
    /// Transport failure classes.
    pub errors: Arc<[ErrorClass]>,
}

impl Default for RetryOn {
    fn default() -> Self {
        use crate::codes::GrpcCode;
        Self {
            http_status: Arc::from([408, 425, 429, 500, 502, 503, 504]),
            grpc_status: Arc::from([GrpcCode::Unavailable, GrpcCode::ResourceExhausted]),
            errors: Arc::from(ErrorClass::ALL),
        }
    }
}

impl RetryOn {
    /// Whether it lists no status, code or error class at all: no failure is retried.
    pub fn lists_nothing(&self) -> bool {
        self.http_status.is_empty() && self.grpc_status.is_empty() && self.errors.is_empty()
    }
}

/// How server hints (`Retry-After`, `grpc-retry-pushback-ms`) are used.
#[derive(Clone, Debug, PartialEq)]
pub struct RetryAfterConfig {
    /// Whether hints are used at all.
    pub honor: bool,
    /// A hint above this makes the call give up (`retry_after_too_long`) instead of waiting.
    pub max: Duration,
}

impl Default for RetryAfterConfig {
    fn default() -> Self {
        Self {
            honor: true,
            max: Duration::from_secs(30),
        }
    }
}

/// Retry budget settings (Finagle/tower semantics, see [`crate::budget`]).
#[derive(Clone, Debug, PartialEq)]
pub struct BudgetConfig {
    /// Retries allowed per logical call in the window, `0..=1`.
    pub ratio: f64,
    /// Retries per second always allowed, whatever the traffic (the reserve).
    pub min_per_second: u32,
    /// How long a call or a retry counts.
    pub window: Duration,
}

impl Default for BudgetConfig {
    fn default() -> Self {
        Self {
            ratio: 0.2,
            min_per_second: 10,
            window: Duration::from_secs(10),
        }
    }
}

/// Circuit breaker settings (see [`crate::breaker`]).
#[derive(Clone, Debug, PartialEq)]
pub struct BreakerConfig {
    /// Failed attempts / attempts in the window at which the breaker opens, `0..=1`. A failed
    /// attempt is one that says the upstream is failing
    /// ([`crate::engine::Outcome::is_upstream_failure`]).
    pub failure_ratio: f64,
    /// Fewer attempts than this in the window never open the breaker.
    pub min_requests: u32,
    /// How long an attempt counts.
    pub window: Duration,
    /// How long the breaker stays open before letting probes through.
    pub open_for: Duration,
    /// Probes let through while half-open; all must succeed to close.
    pub half_open_probes: u32,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        Self {
            failure_ratio: 0.5,
            min_requests: 20,
            window: Duration::from_secs(10),
            open_for: Duration::from_secs(30),
            half_open_probes: 3,
        }
    }
}

/// Alerting settings of an endpoint (SPEC §4), read by the control plane when it evaluates the
/// endpoint's metrics, never by a call: they are set per endpoint (in `defaults:` or on the
/// endpoint, not on a route) and are not part of [`RetryPolicy`].
#[derive(Clone, Debug, PartialEq)]
pub struct AlertConfig {
    /// The endpoint is flagged when its retries / logical calls over the last 5 minutes pass
    /// this ratio, `0..=1` (0 flags any retry).
    pub retry_ratio: f64,
}

impl AlertConfig {
    /// The built-in `alert.retry_ratio`: 5%.
    pub const DEFAULT_RETRY_RATIO: f64 = 0.05;
}

impl Default for AlertConfig {
    fn default() -> Self {
        Self {
            retry_ratio: Self::DEFAULT_RETRY_RATIO,
        }
    }
}

/// The effective retry policy of one logical call.
#[derive(Clone, Debug, PartialEq)]
pub struct RetryPolicy {
    /// Total attempts including the first, `1..=10`.
    pub max_attempts: u32,
    /// Pause schedule between attempts.
    pub backoff: BackoffConfig,
    /// Limit on the whole logical call: attempts and pauses.
    pub deadline: Duration,
    /// Limit on one attempt; never longer than what is left of the deadline.
    pub per_try_timeout: Duration,
    /// Retryable failures.
    pub retry_on: RetryOn,
    /// Methods retried without an idempotency key (upper case).
    pub idempotent_methods: Arc<[Arc<str>]>,
    /// A request carrying this header may be retried whatever its method.
    pub idempotency_key_header: Arc<str>,
    /// Use of server hints.
    pub retry_after: RetryAfterConfig,
    /// The retry budget, or `None` when disabled.
    pub budget: Option<BudgetConfig>,
    /// The circuit breaker, or `None` when disabled.
    pub circuit_breaker: Option<BreakerConfig>,
}

/// The built-in policy, made once: its lists and names are `Arc`s, so every
/// [`RetryPolicy::default`] after the first is reference counts, not nine allocations (a
/// validator resolves one for every endpoint and route of a document).
static BUILT_IN: LazyLock<RetryPolicy> = LazyLock::new(RetryPolicy::built_in);

impl Default for RetryPolicy {
    fn default() -> Self {
        BUILT_IN.clone()
    }
}

impl RetryPolicy {
    /// The built-in values (SPEC §1), made anew.
    fn built_in() -> Self {
        Self {
            max_attempts: 3,
            backoff: BackoffConfig::default(),
            deadline: Duration::from_secs(15),
            per_try_timeout: Duration::from_secs(2),
            retry_on: RetryOn::default(),
            idempotent_methods: ["GET", "HEAD", "OPTIONS", "PUT", "DELETE"]
                .into_iter()
                .map(Arc::from)
                .collect(),
            idempotency_key_header: Arc::from("Idempotency-Key"),
            retry_after: RetryAfterConfig::default(),
            budget: Some(BudgetConfig::default()),
            circuit_breaker: Some(BreakerConfig::default()),
        }
    }
}

impl RetryPolicy {
    /// Whether `method` is listed as idempotent. Methods are case-sensitive (RFC 9110 §9.1,
    /// and a policy lists them in upper case, as its routes match them): an extension method
    /// `get` is not `GET`. (The agent's `CallMeta::http` upper-cases a method its caller
    /// names; a request's own method, as the tower layer sees it, is compared as sent.)
    #[inline]
    pub fn is_idempotent(&self, method: &str) -> bool {
        self.idempotent_methods
            .iter()
            .any(|m| crate::document::str_eq(m, method))
    }
}

/// `v` with a zero's sign dropped: `-0.0` becomes `0.0`, every other value is returned as is.
/// `-0.0` equals `0.0` but encodes differently, so every reader of a policy number (the file
/// parser, the wire conversion) and the content hash normalise it: the same content is never
/// published under a new version for the sign of a zero (SPEC §3).
pub fn unsigned_zero(v: f64) -> f64 {
    if v == 0.0 { 0.0 } else { v }
}
