//! The per-call retry state machine (SPEC §2).
//!
//! A [`RetryCall`] is created when a logical call starts, from the policy snapshot read once for
//! that call (STYLE.md #4) and the endpoint's shared [`EndpointState`] (budget and breaker). The
//! caller runs attempts; after each it reports the classified [`Outcome`] with the current time
//! and gets a [`Decision`]: return, retry after a pause, or give up with a [`GiveUpCause`].
//! The machine never allows more than `max_attempts`, never plans a pause that ends at or past
//! the deadline, and keeps the last failure. It sleeps on nothing and reads no clock: the caller
//! passes `now` (tokio's clock, pausable in tests) and the RNG.

use std::time::Duration;

use tokio::time::Instant;

use crate::backoff::Backoff;
use crate::breaker::{CircuitBreaker, Permit};
use crate::budget::RetryBudget;
use crate::codes::GrpcCode;
use crate::model::{ErrorClass, RetryPolicy};
use crate::retry_after::{Pushback, RetryAfterError};
use crate::rng::Rng;

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
    /// Whether the attempt succeeded (HTTP below 400, gRPC `OK`).
    pub fn is_success(&self) -> bool {
        match self {
            Outcome::Http { status, .. } => *status < 400,
            Outcome::Grpc { code, .. } => *code == GrpcCode::Ok,
            Outcome::Transport(_) => false,
        }
    }

    /// Whether the failure says the upstream is unhealthy, which is what the circuit breaker
    /// counts: a failure class listed in `retry_on` (a 404 or a 400 says nothing about health).
    pub fn is_upstream_failure(&self, policy: &RetryPolicy) -> bool {
        match self {
            Outcome::Http { status, .. } => policy.retry_on.http_status.contains(status),
            Outcome::Grpc { code, .. } => policy.retry_on.grpc_status.contains(code),
            Outcome::Transport(_) => true,
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
        /// Whether a server hint set or lengthened the pause.
        hinted: bool,
    },
    /// Return the last failure with this cause.
    GiveUp(GiveUpCause),
}

/// How the call may be repeated, decided by the caller from the request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallInfo {
    /// The method is listed in `idempotent_methods` (for gRPC: the caller declares it).
    pub idempotent: bool,
    /// The request carries the idempotency key header.
    pub has_idempotency_key: bool,
}

impl CallInfo {
    /// An HTTP call: idempotency from the policy's method list.
    pub fn http(policy: &RetryPolicy, method: &str, has_idempotency_key: bool) -> Self {
        Self {
            idempotent: policy.is_idempotent(method),
            has_idempotency_key,
        }
    }

    /// Whether a failure whose outcome is known (a status, a failed connect) may be retried,
    /// and whether an unknown outcome (timeout, reset) may: both need idempotency or the key,
    /// except a failed connect, which never reached the server.
    fn may_retry(&self, outcome: &Outcome) -> bool {
        match outcome {
            Outcome::Transport(ErrorClass::Connect) => true,
            _ => self.idempotent || self.has_idempotency_key,
        }
    }
}

/// An endpoint's shared runtime state: one budget and one breaker for all its calls.
#[derive(Debug)]
pub struct EndpointState {
    budget: Option<RetryBudget>,
    breaker: Option<CircuitBreaker>,
}

impl EndpointState {
    /// State for an endpoint whose policy is `policy` (its budget and breaker settings; routes
    /// share them and can only turn them off for their calls).
    pub fn new(policy: &RetryPolicy, origin: Instant) -> Self {
        Self {
            budget: policy.budget.as_ref().map(|c| RetryBudget::new(c, origin)),
            breaker: policy
                .circuit_breaker
                .as_ref()
                .map(|c| CircuitBreaker::new(c, origin)),
        }
    }

    /// The budget, when enabled.
    pub fn budget(&self) -> Option<&RetryBudget> {
        self.budget.as_ref()
    }

    /// The breaker, when enabled.
    pub fn breaker(&self) -> Option<&CircuitBreaker> {
        self.breaker.as_ref()
    }
}

/// One logical call in progress.
#[derive(Debug)]
pub struct RetryCall<'a> {
    policy: &'a RetryPolicy,
    state: &'a EndpointState,
    info: CallInfo,
    deadline: Instant,
    attempts: u32,
    backoff: Backoff,
    permit: Option<Permit>,
    last_failure: Option<Outcome>,
}

/// The plan for the next attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Attempt {
    /// 1 for the first attempt.
    pub number: u32,
    /// `min(per_try_timeout, deadline remaining)`.
    pub timeout: Duration,
}

impl<'a> RetryCall<'a> {
    /// Starts a logical call at `now`: counts it in the budget. Policy and state are held for
    /// the whole call.
    pub fn new(
        policy: &'a RetryPolicy,
        state: &'a EndpointState,
        info: CallInfo,
        now: Instant,
    ) -> Self {
        if policy.budget.is_some()
            && let Some(budget) = &state.budget
        {
            budget.deposit(now);
        }
        Self {
            policy,
            state,
            info,
            deadline: now + policy.deadline,
            attempts: 0,
            backoff: Backoff::new(&policy.backoff),
            permit: None,
            last_failure: None,
        }
    }

    /// Asks to start the next attempt at `now`: refused when the breaker is open or the deadline
    /// has passed. On `Ok`, run the attempt with the given timeout, then call
    /// [`RetryCall::on_outcome`].
    pub fn start_attempt(&mut self, now: Instant) -> Result<Attempt, GiveUpCause> {
        let left = self.deadline.saturating_duration_since(now);
        if left.is_zero() {
            return Err(GiveUpCause::DeadlineExceeded);
        }
        if self.policy.circuit_breaker.is_some()
            && let Some(breaker) = &self.state.breaker
        {
            self.permit = Some(
                breaker
                    .try_acquire(now)
                    .map_err(|_| GiveUpCause::CircuitOpen)?,
            );
        }
        self.attempts += 1;
        Ok(Attempt {
            number: self.attempts,
            timeout: self.policy.per_try_timeout.min(left),
        })
    }

    /// Reports the outcome of the attempt started last and decides what comes next.
    pub fn on_outcome(
        &mut self,
        outcome: Outcome,
        now: Instant,
        rng: &mut (impl Rng + ?Sized),
    ) -> Decision {
        if let (Some(permit), Some(breaker)) = (self.permit.take(), &self.state.breaker) {
            breaker.record(permit, !outcome.is_upstream_failure(self.policy), now);
        }
        if outcome.is_success() {
            return Decision::Return;
        }
        let decision = self.decide(&outcome, now, rng);
        self.last_failure = Some(outcome);
        decision
    }

    fn decide(
        &mut self,
        outcome: &Outcome,
        now: Instant,
        rng: &mut (impl Rng + ?Sized),
    ) -> Decision {
        let p = self.policy;
        // Step 4: classification.
        let listed = match outcome {
            Outcome::Http { status, .. } => p.retry_on.http_status.contains(status),
            Outcome::Grpc { code, .. } => p.retry_on.grpc_status.contains(code),
            Outcome::Transport(class) => p.retry_on.errors.contains(class),
        };
        let pushback_refuses = p.retry_after.honor
            && matches!(
                outcome,
                Outcome::Grpc {
                    pushback: Some(Pushback::DoNotRetry),
                    ..
                }
            );
        if !listed || !self.info.may_retry(outcome) || pushback_refuses {
            return Decision::GiveUp(GiveUpCause::NotRetryable);
        }
        // Step 5: attempts.
        if self.attempts >= p.max_attempts {
            return Decision::GiveUp(GiveUpCause::AttemptsExhausted);
        }
        // Step 6: budget (checked here, spent only once the retry is certain).
        let budget = p.budget.as_ref().and(self.state.budget.as_ref());
        if budget.is_some_and(|b| !b.can_withdraw(now)) {
            return Decision::GiveUp(GiveUpCause::BudgetExhausted);
        }
        // Step 7: pause, server hints, deadline.
        let computed = self.backoff.next_pause(rng);
        let hint = if p.retry_after.honor {
            match outcome {
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
        } else {
            None
        };
        let (pause, hinted) = match hint {
            Some((d, _)) if d > p.retry_after.max => {
                return Decision::GiveUp(GiveUpCause::RetryAfterTooLong);
            }
            Some((d, true)) => (d, true),
            Some((d, false)) => (computed.max(d), d > computed),
            None => (computed, false),
        };
        if pause >= self.deadline.saturating_duration_since(now) {
            return Decision::GiveUp(GiveUpCause::DeadlineExceeded);
        }
        if budget.is_some_and(|b| !b.try_withdraw(now)) {
            return Decision::GiveUp(GiveUpCause::BudgetExhausted);
        }
        Decision::Retry { pause, hinted }
    }

    /// Attempts started so far.
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// The outcome of the last failed attempt.
    pub fn last_failure(&self) -> Option<&Outcome> {
        self.last_failure.as_ref()
    }

    /// When the whole call must be over.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// The policy this call runs under.
    pub fn policy(&self) -> &RetryPolicy {
        self.policy
    }
}

#[cfg(test)]
#[path = "engine_tests.rs"]
mod tests;
