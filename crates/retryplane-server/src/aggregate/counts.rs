//! The SPEC §4 counters (and `cancelled`) as one fixed array, so adding a report is 14
//! saturating adds.

use std::time::Duration;

use retryplane_proto::pb;

/// How many counters there are.
pub const N: usize = 14;

/// Index of logical calls.
pub const CALLS: usize = 0;
/// Index of attempts.
pub const ATTEMPTS: usize = 1;
/// Index of retries.
pub const RETRIES: usize = 2;
/// Index of successes on the first attempt.
pub const SUCCESS_FIRST_TRY: usize = 3;
/// Index of successes after at least one retry.
pub const SUCCESS_AFTER_RETRY: usize = 4;
/// Index of calls that gave up with `AttemptsExhausted`.
pub const GAVE_UP_ATTEMPTS: usize = 5;
/// Index of calls that gave up with `BudgetExhausted`.
pub const GAVE_UP_BUDGET: usize = 6;
/// Index of calls that gave up with `DeadlineExceeded`.
pub const GAVE_UP_DEADLINE: usize = 7;
/// Index of calls that gave up with `RetryAfterTooLong`.
pub const GAVE_UP_RETRY_AFTER: usize = 8;
/// Index of calls that gave up because the failure was not retryable.
pub const GAVE_UP_NOT_RETRYABLE: usize = 9;
/// Index of circuit-open rejections.
pub const CIRCUIT_OPEN: usize = 10;
/// Index of total backoff, in milliseconds.
pub const BACKOFF_MS: usize = 11;
/// Index of Retry-After hints honored.
pub const RETRY_AFTER_HONORED: usize = 12;
/// Index of calls their caller cancelled or dropped before they ended.
pub const CANCELLED: usize = 13;

/// The give-up counters with their `cause` label (the SPEC §2 names, in snake case).
pub const GIVE_UP_CAUSES: [(&str, usize); 5] = [
    ("attempts_exhausted", GAVE_UP_ATTEMPTS),
    ("budget_exhausted", GAVE_UP_BUDGET),
    ("deadline_exceeded", GAVE_UP_DEADLINE),
    ("retry_after_too_long", GAVE_UP_RETRY_AFTER),
    ("not_retryable", GAVE_UP_NOT_RETRYABLE),
];

/// Most of any counter one agent is taken to count per second for one endpoint: ten million
/// calls a second from one process is far past any client's rate, and far below what would
/// saturate a `u64` total (at this rate a report over a whole day holds 8.6 × 10^11).
pub const MAX_PER_SECOND: u64 = 10_000_000;
/// The shortest span a report's counts are bounded over: agents report every few seconds,
/// and a report's own clock may be coarse.
pub const MIN_PLAUSIBLE_SPAN: Duration = Duration::from_secs(60);
/// The longest span a report's counts are bounded over: an agent cut off for longer sends
/// what it kept over a longer span, but never more than a day's worth at this rate is
/// believed.
pub const MAX_PLAUSIBLE_SPAN: Duration = Duration::from_secs(24 * 60 * 60);
/// The span a report without a start is bounded over: such a client reports every interval.
pub const UNKNOWN_PLAUSIBLE_SPAN: Duration = Duration::from_secs(60 * 60);

/// One set of counters (112 bytes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts(pub [u64; N]);

impl Counts {
    /// The counters of one endpoint's report.
    pub fn of(c: &pb::EndpointCounters) -> Self {
        Self([
            c.calls,
            c.attempts,
            c.retries,
            c.success_first_try,
            c.success_after_retry,
            c.gave_up_attempts,
            c.gave_up_budget,
            c.gave_up_deadline,
            c.gave_up_retry_after,
            c.gave_up_not_retryable,
            c.circuit_open,
            c.backoff_ms,
            c.retry_after_honored,
            c.cancelled,
        ])
    }

    /// Adds `other`, saturating.
    pub fn add(&mut self, other: &Counts) {
        for (a, b) in self.0.iter_mut().zip(other.0.iter()) {
            *a = a.saturating_add(*b);
        }
    }

    /// Whether any counter is past what one agent could count over `span` (the report's
    /// `window_end - window_start`, uncapped; `None` when the report gives no start): more
    /// than [`MAX_PER_SECOND`] per second (backoff: [`MAX_PER_SECOND`] seconds of pause per
    /// second), over at least [`MIN_PLAUSIBLE_SPAN`] and at most [`MAX_PLAUSIBLE_SPAN`]
    /// ([`UNKNOWN_PLAUSIBLE_SPAN`] when there is no start). Such counts come from a broken or hostile client; added,
    /// one report would saturate a series' lifetime totals for the server's life.
    pub fn implausible(&self, span: Option<Duration>) -> bool {
        let secs = span
            .unwrap_or(UNKNOWN_PLAUSIBLE_SPAN)
            .clamp(MIN_PLAUSIBLE_SPAN, MAX_PLAUSIBLE_SPAN)
            .as_secs();
        let max = MAX_PER_SECOND.saturating_mul(secs);
        self.0.iter().enumerate().any(|(i, &c)| {
            let bound = if i == BACKOFF_MS {
                max.saturating_mul(1_000)
            } else {
                max
            };
            c > bound
        })
    }

    /// Whether every counter is zero.
    pub fn is_zero(&self) -> bool {
        self.0.iter().all(|&c| c == 0)
    }

    /// `retries / calls`; 0 without calls.
    pub fn retry_ratio(&self) -> f64 {
        ratio(self.0[RETRIES], self.0[CALLS])
    }

    /// The wire form.
    pub fn to_pb(&self) -> pb::Counters {
        let c = &self.0;
        pb::Counters {
            calls: c[CALLS],
            attempts: c[ATTEMPTS],
            retries: c[RETRIES],
            success_first_try: c[SUCCESS_FIRST_TRY],
            success_after_retry: c[SUCCESS_AFTER_RETRY],
            gave_up_attempts: c[GAVE_UP_ATTEMPTS],
            gave_up_budget: c[GAVE_UP_BUDGET],
            gave_up_deadline: c[GAVE_UP_DEADLINE],
            gave_up_retry_after: c[GAVE_UP_RETRY_AFTER],
            gave_up_not_retryable: c[GAVE_UP_NOT_RETRYABLE],
            circuit_open: c[CIRCUIT_OPEN],
            backoff_ms: c[BACKOFF_MS],
            retry_after_honored: c[RETRY_AFTER_HONORED],
            cancelled: c[CANCELLED],
        }
    }

    /// The wire form of lifetime totals for `endpoint`.
    pub fn to_endpoint_stats(&self, endpoint: &str) -> pb::EndpointStats {
        let c = self.to_pb();
        pb::EndpointStats {
            endpoint: endpoint.to_owned(),
            calls: c.calls,
            attempts: c.attempts,
            retries: c.retries,
            success_first_try: c.success_first_try,
            success_after_retry: c.success_after_retry,
            gave_up_attempts: c.gave_up_attempts,
            gave_up_budget: c.gave_up_budget,
            gave_up_deadline: c.gave_up_deadline,
            gave_up_retry_after: c.gave_up_retry_after,
            gave_up_not_retryable: c.gave_up_not_retryable,
            circuit_open: c.circuit_open,
            backoff_ms: c.backoff_ms,
            retry_after_honored: c.retry_after_honored,
            cancelled: c.cancelled,
        }
    }
}

/// `num / den` as a float; 0 when `den` is 0.
#[allow(clippy::cast_precision_loss)] // ratios of counts; 2^53 calls is far away
pub fn ratio(num: u64, den: u64) -> f64 {
    if den == 0 {
        0.0
    } else {
        num as f64 / den as f64
    }
}
