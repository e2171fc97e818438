//! The data of the engine's steps: what an attempt produced ([`Outcome`]), what comes next
//! ([`Decision`]) and why a call gave up ([`GiveUpCause`]). Re-exported from
//! [`crate::engine`].

use std::time::Duration;

use crate::codes::GrpcCode;
use crate::model::{ErrorClass, RetryOn, RetryPolicy};
use crate::retry_after::{Pushback, RetryAfterError};

/// What one attempt produced, as far as retrying is concerned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// An HTTP response.
    Http {
        /// The status code.
        status: u16,
        /// The parsed `Retry-After` header, if the response had one
        /// ([`crate::retry_after::parse_retry_after`]).
        retry_after: Option<Result<Duration, RetryAfterError>>,
    },
    /// A gRPC status.
    Grpc {
        /// The status code.
        code: GrpcCode,
        /// The parsed `grpc-retry-pushback-ms` trailer, if present.
        pushback: Option<Pushback>,
    },
    /// No response: a transport failure.
    Transport(ErrorClass),
}

impl Outcome {
    /// The pause the answer asks for, whether or not a policy honours it: a valid HTTP
    /// `Retry-After` (`false`) or gRPC pushback delay (`true`). A malformed one, and gRPC's
    /// "do not retry", are none.
    #[inline]
    pub fn hint(&self) -> Option<(Duration, bool)> {
        match self {
            Outcome::Http {
                retry_after: Some(Ok(d)),
                ..
            } => Some((*d, false)),
            Outcome::Grpc {
                pushback: Some(Pushback::After(d)),
                ..
            } => Some((*d, true)),
            _ => None,
        }
    }

    /// Whether the attempt succeeded (HTTP below 400, gRPC `OK`).
    #[inline]
    pub fn is_success(&self) -> bool {
        match self {
            Outcome::Http { status, .. } => *status < 400,
            Outcome::Grpc { code, .. } => *code == GrpcCode::Ok,
            Outcome::Transport(_) => false,
        }
    }

    /// Whether the failure says the upstream is unhealthy, which is what the circuit breaker
    /// counts: a transport failure, a server error ([`Outcome::is_server_error`]) whatever
    /// `retry_on` lists (a route that retries nothing, or a `retry_on` that lists 503 alone,
    /// must not hide a failing upstream from the endpoint's breaker), or another failure class
    /// `retry_on` lists (a 408 by default). A 404 or a 400 says nothing about health, and
    /// neither does a throttling answer ([`Outcome::is_throttled`]), listed or not. A success
    /// never is, whatever `retry_on` lists.
    pub fn is_upstream_failure(&self, policy: &RetryPolicy) -> bool {
        if self.is_success() || self.is_throttled() {
            return false;
        }
        matches!(self, Outcome::Transport(_))
            || self.is_server_error()
            || self.listed_in(&policy.retry_on)
    }

    /// Whether the upstream asked for less traffic: an HTTP `429` or a gRPC
    /// `RESOURCE_EXHAUSTED`. Such an upstream is up and pacing its callers, which the retry
    /// budget and `Retry-After` answer; a breaker that opened on it would turn a partial
    /// throttle into no calls at all for `open_for`, so the breaker takes no verdict from it
    /// (neither a failure nor a success: a half-open probe answered so goes to the next call).
    #[inline]
    pub fn is_throttled(&self) -> bool {
        matches!(
            self,
            Outcome::Http { status: 429, .. }
                | Outcome::Grpc {
                    code: GrpcCode::ResourceExhausted,
                    ..
                }
        )
    }

    /// Whether this is the upstream's own failure, whatever the policy retries: an HTTP status
    /// from 500 to 599, or the gRPC codes a failing server answers (`UNAVAILABLE`, `INTERNAL`,
    /// `DATA_LOSS`, `DEADLINE_EXCEEDED`). Not `UNKNOWN`: gRPC clients also give it for errors
    /// of their own (tonic's for a URI it refuses) and for a proxy's 4xx (a 413 to a message
    /// too large).
    #[inline]
    pub fn is_server_error(&self) -> bool {
        match self {
            Outcome::Http { status, .. } => (500..=599).contains(status),
            Outcome::Grpc { code, .. } => matches!(
                code,
                GrpcCode::Unavailable
                    | GrpcCode::Internal
                    | GrpcCode::DataLoss
                    | GrpcCode::DeadlineExceeded
            ),
            Outcome::Transport(_) => false,
        }
    }

    /// Whether `retry_on` lists this outcome: its HTTP status, gRPC code or transport class
    /// (step 4's first question; a success is never retried, whatever this says; the whole of
    /// what an outcome alone decides is [`super::RetryRules`]).
    #[inline]
    pub fn listed_in(&self, retry_on: &RetryOn) -> bool {
        match self {
            Outcome::Http { status, .. } => retry_on.http_status.contains(status),
            Outcome::Grpc { code, .. } => retry_on.grpc_status.contains(code),
            Outcome::Transport(class) => retry_on.errors.contains(class),
        }
    }
}

/// Why a logical call stopped without success.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GiveUpCause {
    /// The failure is not retryable (class not listed, non-idempotent call, pushback said no).
    NotRetryable,
    /// `max_attempts` attempts were made.
    AttemptsExhausted,
    /// The endpoint's retry budget refused a retry.
    BudgetExhausted,
    /// The next pause or attempt does not fit in what is left of the deadline.
    DeadlineExceeded,
    /// The server asked for a wait longer than `retry_after.max`.
    RetryAfterTooLong,
    /// The endpoint's circuit breaker is open.
    CircuitOpen,
}

impl GiveUpCause {
    /// Every cause.
    pub const ALL: [GiveUpCause; 6] = [
        GiveUpCause::NotRetryable,
        GiveUpCause::AttemptsExhausted,
        GiveUpCause::BudgetExhausted,
        GiveUpCause::DeadlineExceeded,
        GiveUpCause::RetryAfterTooLong,
        GiveUpCause::CircuitOpen,
    ];

    /// The snake_case name used in reports and metrics (`budget_exhausted`).
    pub fn as_str(self) -> &'static str {
        match self {
            GiveUpCause::NotRetryable => "not_retryable",
            GiveUpCause::AttemptsExhausted => "attempts_exhausted",
            GiveUpCause::BudgetExhausted => "budget_exhausted",
            GiveUpCause::DeadlineExceeded => "deadline_exceeded",
            GiveUpCause::RetryAfterTooLong => "retry_after_too_long",
            GiveUpCause::CircuitOpen => "circuit_open",
        }
    }
}

impl std::fmt::Display for GiveUpCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What to do after an attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// The attempt succeeded: return its result.
    Return,
    /// Sleep `pause`, then make the next attempt.
    Retry {
        /// How long to wait.
        pause: Duration,
        /// Whether the pause followed a valid server hint that is honored: a gRPC pushback set
        /// it, or it is at least the `Retry-After` (which may be shorter than the backoff).
        hinted: bool,
    },
    /// Return the last failure with this cause.
    GiveUp(GiveUpCause),
}
