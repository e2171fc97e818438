//! The four clients compared side by side, each a [`RetryPolicy`] the real engine runs.

use std::time::Duration;

use retryplane_policy::{BackoffConfig, Jitter, RetryAfterConfig, RetryPolicy};

/// One way of retrying.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Variant {
    /// The policy as written.
    Policy,
    /// The same with the retry budget off.
    NoBudget,
    /// The same with `jitter: none`.
    NoJitter,
    /// Immediate retries: zero pause, the same `max_attempts`, deadline and per-try timeout, no
    /// budget, no breaker, `Retry-After` ignored.
    Naive,
}

impl Variant {
    /// Every variant, in report order.
    pub const ALL: [Variant; 4] = [
        Variant::Policy,
        Variant::NoBudget,
        Variant::NoJitter,
        Variant::Naive,
    ];

    /// The short name used in reports, JSON and plot legends.
    pub fn as_str(self) -> &'static str {
        match self {
            Variant::Policy => "policy",
            Variant::NoBudget => "no-budget",
            Variant::NoJitter => "no-jitter",
            Variant::Naive => "naive",
        }
    }

    /// One line saying what the variant is.
    pub fn description(self) -> &'static str {
        match self {
            Variant::Policy => "the policy as written",
            Variant::NoBudget => "the policy without its retry budget",
            Variant::NoJitter => "the policy with jitter: none",
            Variant::Naive => {
                "immediate retries, same max_attempts, no budget, no breaker, Retry-After ignored"
            }
        }
    }

    /// The policy this variant runs, derived from `policy`.
    pub fn apply(self, policy: &RetryPolicy) -> RetryPolicy {
        let mut p = policy.clone();
        match self {
            Variant::Policy => {}
            Variant::NoBudget => p.budget = None,
            Variant::NoJitter => p.backoff.jitter = Jitter::None,
            Variant::Naive => {
                p.backoff = BackoffConfig {
                    base: Duration::ZERO,
                    max: Duration::ZERO,
                    multiplier: 1.0,
                    jitter: Jitter::None,
                };
                p.budget = None;
                p.circuit_breaker = None;
                p.retry_after = RetryAfterConfig {
                    honor: false,
                    ..p.retry_after
                };
            }
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_naive_client_keeps_attempts_and_deadlines_and_drops_the_rest() {
        let policy = RetryPolicy::default();
        let naive = Variant::Naive.apply(&policy);
        assert_eq!(naive.max_attempts, policy.max_attempts);
        assert_eq!(naive.deadline, policy.deadline);
        assert_eq!(naive.per_try_timeout, policy.per_try_timeout);
        assert_eq!(naive.backoff.max, Duration::ZERO);
        assert!(naive.budget.is_none() && naive.circuit_breaker.is_none());
        assert!(!naive.retry_after.honor);
        assert_eq!(Variant::Policy.apply(&policy), policy);
        assert!(Variant::NoBudget.apply(&policy).circuit_breaker.is_some());
    }
}
