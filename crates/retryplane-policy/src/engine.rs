//! The per-call retry state machine (SPEC §2).
//!
//! A [`RetryCall`] is created when a logical call starts, from the policy snapshot read once for
//! that call (one snapshot per call) and the endpoint's shared [`EndpointState`] (budget and breaker). The
//! caller runs attempts; after each it reports the classified [`Outcome`] with the current time
//! and gets a [`Decision`]: return, retry after a pause, or give up with a [`GiveUpCause`].
//! The machine never allows more than `max_attempts` (it counts them itself: a call that is
//! over starts nothing, see [`RetryCall::start_attempt`], and takes one outcome per attempt,
//! see [`RetryCall::on_outcome`]), never plans a pause that ends at or
//! past the deadline, and keeps the last failure. It sleeps on nothing and reads no clock: the caller
//! passes `now` (tokio's clock, pausable in tests) and the RNG.
//!
//! Cost: each step turns `now` into nanoseconds since the endpoint state's origin at most once,
//! and not at all when `now` is the instant the call converted last (the first attempt starts at
//! the call's instant, and the agent reports a success at its attempt's start), and the budget, the
//! breaker and the deadline all work in that unit. A call that succeeds at once does two
//! uncontended CAS (the budget's deposit, the breaker's success count) and two predictable
//! branches in `start_attempt` (the count of attempts that may start, and whether it is the
//! first, which deposits in the budget); the backoff state is
//! built on the first failure only, and the failure path is kept out of line. `new`,
//! `start_attempt` and `on_outcome` are `#[inline(always)]`: what is left of them once the
//! failure path is out of line is small, and inlining them into the caller took about a tenth
//! off the success path of the engine bench (see BENCHMARKS.md).

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use crate::backoff::Backoff;
use crate::breaker::{CircuitBreaker, Permit};
use crate::budget::{RetryBudget, Taken, Withdrawal};
use crate::codes::GrpcCode;
use crate::model::{
    BreakerConfig, BudgetConfig, ErrorClass, RetryAfterConfig, RetryOn, RetryPolicy,
};
use crate::retry_after::Pushback;
use crate::rng::Rng;

#[path = "engine_outcome.rs"]
mod outcome;

pub use outcome::{Decision, GiveUpCause, Outcome};

/// Where [`RetryCall::deadline`] saturates: 30 years, as tokio's far future.
const FAR_FUTURE: Duration = Duration::from_secs(86_400 * 365 * 30);

/// When a call that starts at `start` and must be over `within` after it ends: `start +
/// within`, or 30 years after `start` for a `within` too long for an `Instant`. What
/// [`RetryCall::deadline`] says, for callers that need it before the call is made.
#[inline]
pub fn deadline_at(start: Instant, within: Duration) -> Instant {
    start
        .checked_add(within)
        .or_else(|| start.checked_add(FAR_FUTURE))
        .unwrap_or(start)
}

/// How the call may be repeated, decided by the caller from the request.
///
/// Made with [`CallInfo::http`] or [`CallInfo::new`] (and [`CallInfo::with_replayable`]); the
/// fields can be read and set, but the struct is `#[non_exhaustive]`, so a field added later
/// does not break callers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct CallInfo {
    /// The method is listed in `idempotent_methods` (for gRPC: the caller declares it).
    pub idempotent: bool,
    /// The request carries the idempotency key header.
    pub has_idempotency_key: bool,
    /// The request can be sent again (the caller kept it). When `false` (a body streamed as
    /// it came, say) the call makes one attempt: every failure is
    /// [`GiveUpCause::NotRetryable`], a failed connect included.
    pub replayable: bool,
}

impl CallInfo {
    /// A call that is `idempotent` (or not) and carries the idempotency key (or not), and can
    /// be sent again. For gRPC the caller says whether the method is idempotent.
    #[inline]
    pub const fn new(idempotent: bool, has_idempotency_key: bool) -> Self {
        Self {
            idempotent,
            has_idempotency_key,
            replayable: true,
        }
    }

    /// The same call, sent again only when `replayable` (see [`CallInfo::replayable`]).
    #[inline]
    #[must_use]
    pub const fn with_replayable(self, replayable: bool) -> Self {
        Self { replayable, ..self }
    }

    /// An HTTP call: idempotency from the policy's method list.
    #[inline]
    pub fn http(policy: &RetryPolicy, method: &str, has_idempotency_key: bool) -> Self {
        Self {
            idempotent: policy.is_idempotent(method),
            has_idempotency_key,
            replayable: true,
        }
    }

    /// Whether a failure whose outcome is known (a status, a failed connect) may be retried,
    /// and whether an unknown outcome (timeout, reset) may: both need idempotency or the key,
    /// except a failed connect, which never reached the server. Nothing is retried when the
    /// request cannot be sent again.
    fn may_retry(&self, outcome: &Outcome) -> bool {
        self.replayable
            && match outcome {
                Outcome::Transport(ErrorClass::Connect) => true,
                _ => self.idempotent || self.has_idempotency_key,
            }
    }
}

/// The part of SPEC §2 that decides from a failed attempt's outcome, the call and the policy
/// alone whether the attempt may be retried: step 4 (`retry_on`, idempotency, a gRPC "do not
/// retry" pushback), step 5 (`max_attempts`) and step 7's refusal of a server hint longer than
/// `retry_after.max`. Kept apart from the policy (what these steps read of it, and how the
/// engine sees the call) for a holder that outlives its borrow of the policy: the agent's HTTP
/// layer uses it to choose which failed answers to read.
///
/// [`RetryCall::on_outcome`] asks the same questions, through the same functions, so the two
/// cannot drift apart: when [`RetryRules::may_retry`] answers `false`, the call gives up
/// whatever the time. A `true` may still end in a give-up: the budget, the breaker and the
/// deadline are asked when the outcome is reported, and change with time.
#[derive(Clone, Debug)]
pub struct RetryRules {
    info: CallInfo,
    max_attempts: u32,
    retry_on: RetryOn,
    retry_after: RetryAfterConfig,
}

impl RetryRules {
    /// The rules of `policy` for a call described by `info`.
    pub fn new(policy: &RetryPolicy, info: CallInfo) -> Self {
        Self {
            info,
            max_attempts: policy.max_attempts,
            retry_on: policy.retry_on.clone(),
            retry_after: policy.retry_after.clone(),
        }
    }

    /// The policy's `max_attempts`.
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// Whether a failed attempt, the `attempt`-th of the call, that ended with `outcome` may
    /// be retried as far as these rules decide (see [`RetryRules`]); `false` for a success
    /// (there is nothing to retry).
    pub fn may_retry(&self, outcome: &Outcome, attempt: u32) -> bool {
        !outcome.is_success()
            && answer_refusal(
                &self.info,
                self.retry_after.honor,
                self.max_attempts,
                outcome,
                outcome.listed_in(&self.retry_on),
                attempt,
            )
            .is_none()
            && server_hint(&self.retry_after, outcome)
                .is_none_or(|(d, _)| d <= self.retry_after.max)
    }
}

/// SPEC §2 steps 4 and 5 for a failed attempt, the `attempts`-th, with `outcome` (`listed`:
/// whether `retry_on` lists it; `honor_hints`: `retry_after.honor`): the cause the call gives
/// up with, or `None` if it goes on to the budget.
#[inline]
fn answer_refusal(
    info: &CallInfo,
    honor_hints: bool,
    max_attempts: u32,
    outcome: &Outcome,
    listed: bool,
    attempts: u32,
) -> Option<GiveUpCause> {
    // Step 4: classification.
    let pushback_refuses = honor_hints
        && matches!(
            outcome,
            Outcome::Grpc {
                pushback: Some(Pushback::DoNotRetry),
                ..
            }
        );
    if !listed || !info.may_retry(outcome) || pushback_refuses {
        return Some(GiveUpCause::NotRetryable);
    }
    // Step 5: attempts.
    if attempts >= max_attempts {
        return Some(GiveUpCause::AttemptsExhausted);
    }
    None
}

/// The server's hint step 7 goes by, if the policy honours hints: a valid HTTP `Retry-After`
/// (`false`) or gRPC pushback delay (`true`). A malformed one is ignored.
#[inline]
fn server_hint(retry_after: &RetryAfterConfig, outcome: &Outcome) -> Option<(Duration, bool)> {
    if !retry_after.honor {
        return None;
    }
    outcome.hint()
}

/// An endpoint's shared runtime state: one budget and one breaker for all its calls.
///
/// The budget and the breaker are shared (`Arc`) so that a state built for new settings can
/// keep the part whose settings did not change ([`EndpointState::carry`]).
#[derive(Debug)]
pub struct EndpointState {
    origin: Instant,
    budget: Option<Arc<RetryBudget>>,
    breaker: Option<Arc<CircuitBreaker>>,
    budget_cfg: Option<BudgetConfig>,
    breaker_cfg: Option<BreakerConfig>,
    /// Where this state has no budget or breaker (a push turned it off): the one the push
    /// turned off (the calls that still run on it use it), and those of the calls behind this
    /// state ([`EndpointState::behind`]) whose settings have one, made behind it (their counts
    /// go to it), one per settings, shared by every such call of those settings, so that they
    /// are held to one budget, not each to a fresh one. They go on to the next state while it
    /// has none either ([`EndpointState::carry`]); one that turns it on again takes the one of
    /// its settings back, or takes over from the one turned off. Kept while a call holds one
    /// or it counts anything ([`EndpointState::is_idle`]).
    strays: Mutex<Strays>,
}

/// See [`EndpointState::strays`]: the budgets, and the breakers.
#[derive(Debug, Default, Clone)]
struct Strays {
    budgets: Kept<BudgetConfig, RetryBudget>,
    breakers: Kept<BreakerConfig, CircuitBreaker>,
}

impl Strays {
    /// Lets go of the budgets and breakers no call holds and that count nothing at `now` (one
    /// made afresh would be the same); whether none is left.
    fn prune(&mut self, now: Instant) -> bool {
        self.budgets.prune(|b| b.is_empty(now)) & self.breakers.prune(|b| b.is_idle(now))
    }
}

/// Budgets (or breakers) of [`EndpointState::strays`], each with its settings, at most one per
/// settings.
#[derive(Debug)]
struct Kept<C, T> {
    /// The one a push turned off, the newest of its line then: the others are made behind it
    /// ([`RetryBudget::behind`], [`CircuitBreaker::behind`]), and one turned on again with
    /// other settings takes over from it.
    off: Option<(C, Arc<T>)>,
    /// Those made for the calls behind the state.
    made: Vec<(C, Arc<T>)>,
}

impl<C: Clone, T> Clone for Kept<C, T> {
    fn clone(&self) -> Self {
        Self {
            off: self.off.clone(),
            made: self.made.clone(),
        }
    }
}

impl<C, T> Default for Kept<C, T> {
    fn default() -> Self {
        Self {
            off: None,
            made: Vec::new(),
        }
    }
}

impl<C: PartialEq + Clone, T> Kept<C, T> {
    /// The one made for `cfg`, if any.
    fn find(&self, cfg: &C) -> Option<Arc<T>> {
        self.off
            .iter()
            .chain(&self.made)
            .find(|(kept, _)| kept == cfg)
            .map(|(_, t)| t.clone())
    }

    /// The newest state's own budget (or breaker) for `cfg`, turned on again: the one turned
    /// off when it has `cfg`, taken back as it is; else one that takes over from it (`take`);
    /// with none turned off, the one made for `cfg` (made afresh, none having been turned
    /// off, see [`Kept::prune`]), or a fresh one (`fresh`). Never one made behind the one
    /// turned off: it defers to that one, which new calls would not use.
    fn turned_on(
        &self,
        cfg: &C,
        take: impl FnOnce(&Arc<T>) -> Arc<T>,
        fresh: impl FnOnce() -> T,
    ) -> Arc<T> {
        match &self.off {
            Some((kept, off)) if kept == cfg => off.clone(),
            Some((_, off)) => take(off),
            None => self.find(cfg).unwrap_or_else(|| Arc::new(fresh())),
        }
    }

    /// The one made for `cfg`; else one made by `make` from the one turned off (if any), kept.
    fn get_or_make(&mut self, cfg: &C, make: impl FnOnce(Option<&Arc<T>>) -> Arc<T>) -> Arc<T> {
        self.find(cfg).unwrap_or_else(|| {
            let made = make(self.off.as_ref().map(|(_, t)| t));
            self.made.push((cfg.clone(), made.clone()));
            made
        })
    }

    /// Lets go of those no call holds and `idle` finds idle; whether none is left. Whether
    /// they share a line with each other is not asked: the strays hold each other's lines.
    /// The one turned off goes only after every one made behind it: without it, those would
    /// defer to each other (the newest live one of their line), one of them perhaps taken
    /// back as the newest state's own.
    fn prune(&mut self, idle: impl Fn(&T) -> bool) -> bool {
        let gone = |(_, t): &(C, Arc<T>)| Arc::strong_count(t) == 1 && idle(t);
        self.made.retain(|kept| !gone(kept));
        if self.made.is_empty() && self.off.as_ref().is_some_and(gone) {
            self.off = None;
        }
        self.off.is_none() && self.made.is_empty()
    }
}

impl EndpointState {
    /// State for an endpoint whose policy is `policy` (its budget and breaker settings; routes
    /// share them and can only turn them off for their calls). Time is measured from `origin`.
    pub fn new(policy: &RetryPolicy, origin: Instant) -> Self {
        Self {
            origin,
            budget: policy
                .budget
                .as_ref()
                .map(|c| Arc::new(RetryBudget::new(c, origin))),
            breaker: policy
                .circuit_breaker
                .as_ref()
                .map(|c| Arc::new(CircuitBreaker::new(c, origin))),
            budget_cfg: policy.budget.clone(),
            breaker_cfg: policy.circuit_breaker.clone(),
            strays: Mutex::default(),
        }
    }

    /// Whether a state made afresh at `now` may stand in for it: its budget and breaker count
    /// nothing, the breaker is closed (or half-open long past, see
    /// [`CircuitBreaker::is_idle`]), and neither is shared with another state (a state
    /// carried from this one, or this one's predecessor, which calls in flight may still use)
    /// nor in a line of hand-overs with another live breaker. So one nobody else holds may be
    /// dropped without an endpoint ever running two budgets or breakers.
    ///
    /// The budgets and breakers of the calls behind it ([`EndpointState::behind`]) count too:
    /// while a call holds one or it counts anything, the state is not idle (dropped, the next
    /// such call would get a fresh allowance beside the one the others still spend); those
    /// that no call holds and that count nothing are let go here.
    pub fn is_idle(&self, now: Instant) -> bool {
        self.budget
            .as_ref()
            .is_none_or(|b| Arc::strong_count(b) == 1 && !b.has_line() && b.is_empty(now))
            && self
                .breaker
                .as_ref()
                .is_none_or(|b| Arc::strong_count(b) == 1 && !b.has_line() && b.is_idle(now))
            && self
                .strays
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .prune(now)
    }

    /// Whether this state was built for `policy`'s budget and breaker settings, so that calls
    /// under `policy` can use it as it is.
    pub fn fits(&self, policy: &RetryPolicy) -> bool {
        self.budget_cfg == policy.budget && self.breaker_cfg == policy.circuit_breaker
    }

    /// The state of the same endpoint under `policy`, whose budget or breaker settings differ
    /// from this state's: the part whose settings are unchanged is shared with this state (a
    /// new budget window does not let a retry storm start again because a breaker number
    /// changed, and a budget change does not close an open breaker); a breaker whose settings
    /// changed takes over from this one ([`CircuitBreaker::taking_over`]: an open breaker
    /// stays open until its open period ends, one that the calls still on this state open
    /// later opens the new one too, and the new one opening opens it; a closed one's counts
    /// are taken over); a budget whose settings changed takes over the calls and retries this
    /// one counts, each at its own time as of `now` ([`RetryBudget::taking_over`]: tightening
    /// a budget during a retry storm must not hand out a fresh allowance). From then on the
    /// calls still on this state deposit and withdraw in the newest budget of the line, and
    /// the outcomes they record in this breaker are counted in the newest breaker too.
    ///
    /// A budget or breaker turned on where a push turned it off before (see [`Self::behind`])
    /// is the one turned off, taken back as it is when it has the same settings (a budget
    /// turned off and on again by two pushes goes on with the one its calls still spend);
    /// with other settings, one that takes over from it as a change of settings in one push
    /// does (an open breaker stays open, a spent budget stays spent). Where none was turned
    /// off, or it was let go (no call held it and it counted nothing), the one of its
    /// settings the calls behind this state use, or a fresh one. One turned off goes to the
    /// calls behind the new state, with the others they use, while it has none.
    #[must_use]
    pub fn carry(&self, policy: &RetryPolicy, now: Instant) -> Self {
        let strays = {
            let mut strays = self.strays.lock().unwrap_or_else(PoisonError::into_inner);
            strays.prune(now);
            strays.clone()
        };
        let mut next = self.next(
            policy,
            (
                |cfg, old| RetryBudget::taking_over(cfg, old, now),
                |cfg| {
                    strays.budgets.turned_on(
                        cfg,
                        |off| RetryBudget::taking_over(cfg, off, now),
                        || RetryBudget::new(cfg, self.origin),
                    )
                },
            ),
            (CircuitBreaker::taking_over, |cfg| {
                strays.breakers.turned_on(
                    cfg,
                    |off| CircuitBreaker::taking_over(cfg, off),
                    || CircuitBreaker::new(cfg, self.origin),
                )
            }),
        );
        let carried = next
            .strays
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        if next.budget.is_none() {
            carried.budgets = strays.budgets;
            if let (Some(cfg), Some(b)) = (&self.budget_cfg, &self.budget) {
                carried.budgets.off = Some((cfg.clone(), b.clone()));
            }
        }
        if next.breaker.is_none() {
            carried.breakers = strays.breakers;
            if let (Some(cfg), Some(b)) = (&self.breaker_cfg, &self.breaker) {
                carried.breakers.off = Some((cfg.clone(), b.clone()));
            }
        }
        next
    }

    /// A state for calls under `policy` that run behind this one, the newest state of the
    /// endpoint: a call that read the policies just before a push and reaches the endpoint
    /// after it. Its budget and breaker, where their settings differ from this one's, join
    /// this one's lines without becoming their newest ([`RetryBudget::behind`],
    /// [`CircuitBreaker::behind`]): what its calls count goes to this state's budget and
    /// breaker, which new calls use; built with [`Self::carry`] instead, it became the newest
    /// and took the new calls' counts while it lasted, under the old settings.
    ///
    /// Where this state has no budget or breaker (a push turned it off) and `policy` has one,
    /// the calls behind it share one per settings, made behind the one the push turned off.
    #[must_use]
    pub fn behind(&self, policy: &RetryPolicy) -> Self {
        self.next(
            policy,
            (RetryBudget::behind, |cfg| {
                let mut strays = self.strays.lock().unwrap_or_else(PoisonError::into_inner);
                strays.budgets.get_or_make(cfg, |off| match off {
                    Some(off) => RetryBudget::behind(cfg, off),
                    None => Arc::new(RetryBudget::new(cfg, self.origin)),
                })
            }),
            (CircuitBreaker::behind, |cfg| {
                let mut strays = self.strays.lock().unwrap_or_else(PoisonError::into_inner);
                strays.breakers.get_or_make(cfg, |off| match off {
                    Some(off) => CircuitBreaker::behind(cfg, off),
                    None => Arc::new(CircuitBreaker::new(cfg, self.origin)),
                })
            }),
        )
    }

    /// The state for `policy` after this one: a budget or breaker whose settings are unchanged
    /// is shared, one whose settings changed is made from this one's by the first of
    /// `budget` or `breaker`, one turned on is made by the second, one turned off is dropped.
    fn next(
        &self,
        policy: &RetryPolicy,
        budget: (
            impl FnOnce(&BudgetConfig, &Arc<RetryBudget>) -> Arc<RetryBudget>,
            impl FnOnce(&BudgetConfig) -> Arc<RetryBudget>,
        ),
        breaker: (
            impl FnOnce(&BreakerConfig, &Arc<CircuitBreaker>) -> Arc<CircuitBreaker>,
            impl FnOnce(&BreakerConfig) -> Arc<CircuitBreaker>,
        ),
    ) -> Self {
        Self {
            origin: self.origin,
            budget: next_part(
                &policy.budget,
                &self.budget_cfg,
                &self.budget,
                budget.0,
                budget.1,
            ),
            breaker: next_part(
                &policy.circuit_breaker,
                &self.breaker_cfg,
                &self.breaker,
                breaker.0,
                breaker.1,
            ),
            budget_cfg: policy.budget.clone(),
            breaker_cfg: policy.circuit_breaker.clone(),
            strays: Mutex::default(),
        }
    }

    /// The budget, when enabled.
    pub fn budget(&self) -> Option<&RetryBudget> {
        self.budget.as_deref()
    }

    /// The breaker, when enabled.
    pub fn breaker(&self) -> Option<&CircuitBreaker> {
        self.breaker.as_deref()
    }

    /// `now` in signed nanoseconds since the origin (exact: an `i128` holds any `Duration`).
    /// The one `Instant` subtraction of an engine step, done on the `std` instants that tokio's
    /// wrap (see [`crate::window::since`]).
    #[inline]
    fn offset(&self, now: Instant) -> i128 {
        match crate::window::since(self.origin, now) {
            Some(d) => nanos(d),
            None => before_origin(self.origin, now),
        }
    }
}

/// One part (budget or breaker) of [`EndpointState::next`]: `old` when its settings `old_cfg`
/// are `cfg`, else made from `old` by `changed`, or afresh by `fresh` when there is none.
fn next_part<C: PartialEq, T>(
    cfg: &Option<C>,
    old_cfg: &Option<C>,
    old: &Option<Arc<T>>,
    changed: impl FnOnce(&C, &Arc<T>) -> Arc<T>,
    fresh: impl FnOnce(&C) -> Arc<T>,
) -> Option<Arc<T>> {
    let cfg = cfg.as_ref()?;
    Some(match old {
        Some(old) if old_cfg.as_ref() == Some(cfg) => old.clone(),
        Some(old) => changed(cfg, old),
        None => fresh(cfg),
    })
}

/// [`EndpointState::offset`] of an instant before the origin (negative; out of line, as it
/// only happens to instants taken before the state was built).
#[cold]
#[inline(never)]
fn before_origin(origin: Instant, now: Instant) -> i128 {
    -nanos(origin.saturating_duration_since(now))
}

#[inline]
fn nanos(d: Duration) -> i128 {
    // `as_nanos` is below 2^94, so the cast is exact.
    d.as_nanos() as i128
}

/// `nanos` (at least 0) as a `Duration`, saturating.
fn from_nanos(nanos: i128) -> Duration {
    match u64::try_from(nanos) {
        Ok(n) => Duration::from_nanos(n),
        Err(_) if nanos < 0 => Duration::ZERO,
        // More than 584 years.
        Err(_) => {
            let secs = u64::try_from(nanos / 1_000_000_000).unwrap_or(u64::MAX);
            Duration::new(secs, (nanos % 1_000_000_000) as u32)
        }
    }
}

/// The window time of an offset: the budget and breaker count instants before the origin at
/// the origin (and saturate 584 years after it).
#[inline]
fn window_nanos(offset: i128) -> u64 {
    u64::try_from(offset.max(0)).unwrap_or(u64::MAX)
}

/// One logical call in progress.
#[derive(Debug)]
pub struct RetryCall<'a> {
    policy: &'a RetryPolicy,
    state: &'a EndpointState,
    info: CallInfo,
    start: Instant,
    /// The last instant this call turned into an offset, and that offset (see
    /// [`EndpointState::offset`]): a call that succeeds at once is told the same instant three
    /// times and converts it once.
    seen: Instant,
    seen_offset: i128,
    /// The deadline as an offset from the state's origin.
    deadline: i128,
    /// How long after `start` the deadline falls: the policy's, or a shorter one the caller
    /// set ([`RetryCall::cap_deadline`]).
    within: Duration,
    attempts: u32,
    /// Outcomes reported so far: an outcome is taken only while `answered < attempts`, so a
    /// second report for one attempt, or one after the call is over, changes nothing.
    answered: u32,
    /// How many attempts may have been started by now: one at the start (none when
    /// `max_attempts` is 0), one more for each [`Decision::Retry`], never more than
    /// `max_attempts`. A call that returned or gave up has `attempts == allowed`, so it starts
    /// nothing more, with no flag to set on the success path.
    allowed: u32,
    /// Built on the first failure.
    backoff: Option<Backoff>,
    permit: Option<Permit>,
    /// The retry the budget counted for the attempt [`Decision::Retry`] let start, until that
    /// attempt starts: a call that ends before (cancelled or dropped during the pause, or
    /// refused by the breaker or the deadline after it) hands it back.
    unsent_retry: Option<Taken>,
    last_failure: Option<Outcome>,
    /// Whether an attempt was given less than half its `per_try_timeout`, what was left of the
    /// deadline (set once: every later attempt is cut shorter still).
    cut_short: bool,
}

/// The plan for the next attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Attempt {
    /// 1 for the first attempt.
    pub number: u32,
    /// `min(per_try_timeout, deadline remaining)`.
    pub timeout: Duration,
}

/// A call dropped before it ended (its future dropped during an attempt or a pause) is
/// [released](RetryCall::release): its unreported breaker permit and the retry the budget
/// counted for an attempt it will not send are handed back. After an outcome the permit is
/// spent and no retry is pending, so the drop (inline) touches no atomic.
impl Drop for RetryCall<'_> {
    #[inline]
    fn drop(&mut self) {
        self.release();
    }
}

impl<'a> RetryCall<'a> {
    /// Starts a logical call at `now`. Policy and state are held for the whole call. The call
    /// counts as a request in the budget when its first attempt starts
    /// ([`RetryCall::start_attempt`]): a call the open breaker (or a spent deadline) stops sends
    /// nothing, so it adds nothing to the requests retries are measured against.
    #[inline(always)]
    pub fn new(
        policy: &'a RetryPolicy,
        state: &'a EndpointState,
        info: CallInfo,
        now: Instant,
    ) -> Self {
        let offset = state.offset(now);
        Self {
            policy,
            state,
            info,
            start: now,
            seen: now,
            seen_offset: offset,
            deadline: offset + nanos(policy.deadline),
            within: policy.deadline,
            attempts: 0,
            answered: 0,
            allowed: policy.max_attempts.min(1),
            backoff: None,
            permit: None,
            unsent_retry: None,
            last_failure: None,
            cut_short: false,
        }
    }

    /// Asks to start the next attempt at `now`: refused when the breaker is open or the deadline
    /// has passed. On `Ok`, run the attempt with the given timeout, then call
    /// [`RetryCall::on_outcome`].
    ///
    /// The machine itself keeps the count: only the first attempt, and one attempt after each
    /// [`Decision::Retry`], may start. Once the call is over — it returned, gave up (by a
    /// [`Decision::GiveUp`] or a refusal here), or made `max_attempts` attempts — every further
    /// request is refused with [`GiveUpCause::AttemptsExhausted`]: it starts no attempt and
    /// leaves the budget, the breaker and the count alone.
    #[inline(always)]
    pub fn start_attempt(&mut self, now: Instant) -> Result<Attempt, GiveUpCause> {
        if self.attempts >= self.allowed {
            return Err(GiveUpCause::AttemptsExhausted);
        }
        let offset = self.offset(now);
        let left = self.left(offset);
        if left <= 0 {
            return Err(self.refuse(GiveUpCause::DeadlineExceeded));
        }
        if self.policy.circuit_breaker.is_some()
            && let Some(breaker) = &self.state.breaker
        {
            match breaker.try_acquire_at(window_nanos(offset)) {
                Ok(permit) => self.permit = Some(permit),
                Err(_) => return Err(self.refuse(GiveUpCause::CircuitOpen)),
            }
        }
        // SPEC §2 step 6 measures retries against the requests in the window: the call is one
        // once its first attempt is let through.
        if self.attempts == 0
            && self.policy.budget.is_some()
            && let Some(budget) = &self.state.budget
        {
            budget.deposit_at(window_nanos(offset));
        }
        self.attempts += 1;
        // The retry the budget counted is sent now.
        self.unsent_retry = None;
        Ok(Attempt {
            number: self.attempts,
            timeout: if nanos(self.policy.per_try_timeout) <= left {
                self.policy.per_try_timeout
            } else {
                if left.saturating_mul(2) < nanos(self.policy.per_try_timeout) {
                    self.cut_short = true;
                }
                from_nanos(left)
            },
        })
    }

    /// Ends the call from [`Self::start_attempt`] with `cause`: nothing more may start, and a
    /// retry the budget counted for the attempt refused is handed back.
    #[cold]
    fn refuse(&mut self, cause: GiveUpCause) -> GiveUpCause {
        self.allowed = self.attempts;
        self.give_back_retry();
        cause
    }

    /// Hands back to the budget the retry it counted for an attempt that will never start.
    #[inline]
    fn give_back_retry(&mut self) {
        if let Some(taken) = self.unsent_retry.take() {
            self.give_back_retry_out_of_line(taken);
        }
    }

    #[cold]
    #[inline(never)]
    fn give_back_retry_out_of_line(&self, taken: Taken) {
        if let Some(budget) = &self.state.budget {
            budget.give_back(taken);
        }
    }

    /// Reports the outcome of the attempt started last and decides what comes next.
    ///
    /// One outcome per started attempt: a report with no attempt waiting for one (a second
    /// report for the same attempt, or one after the call returned or gave up) is refused with
    /// [`GiveUpCause::AttemptsExhausted`] and changes nothing: no budget, breaker or backoff
    /// step, and no further attempt may start.
    #[inline(always)]
    pub fn on_outcome(
        &mut self,
        outcome: Outcome,
        now: Instant,
        rng: &mut (impl Rng + ?Sized),
    ) -> Decision {
        if self.answered >= self.attempts {
            return Decision::GiveUp(GiveUpCause::AttemptsExhausted);
        }
        self.answered += 1;
        let success = outcome.is_success();
        let permit = self.permit.take();
        if success {
            if let (Some(permit), Some(breaker)) = (permit, &self.state.breaker) {
                let offset = self.offset(now);
                breaker.record_at(permit, true, window_nanos(offset));
            }
            return Decision::Return;
        }
        self.on_failure(outcome, permit, now, rng)
    }

    /// Ends the call without an outcome for the attempt started last: for an attempt whose
    /// result says nothing about the upstream (an error on the caller's side, which the caller
    /// returns as is) or that was abandoned (the call cancelled, or its future dropped). Its
    /// circuit-breaker permit, if it has not been reported, is handed back without counting a
    /// success or a failure, so a half-open probe goes to the next call instead of staying
    /// taken. The backoff is left alone, and so is the budget but for the retry below; no
    /// further attempt may start and no outcome is taken. Does nothing to the breaker after [`Self::on_outcome`] (the permit is
    /// spent) or when no attempt was started.
    ///
    /// Called during a pause (after a [`Decision::Retry`], before the next attempt starts),
    /// it also hands back the retry the budget counted for that attempt: a retry never sent
    /// does not count against the endpoint's other calls.
    ///
    /// Inline: after an outcome (every success) it is two branches and two stores; handing a
    /// permit or a retry back is out of line.
    #[inline]
    pub fn release(&mut self) {
        if let Some(permit) = self.permit.take() {
            self.release_permit(permit);
        }
        self.give_back_retry();
        self.allowed = self.attempts;
        self.answered = self.attempts;
    }

    /// [`Self::release`]'s hand-back of an unreported permit.
    #[cold]
    #[inline(never)]
    fn release_permit(&self, permit: Permit) {
        if let Some(breaker) = &self.state.breaker {
            breaker.release(permit);
        }
    }

    /// [`Self::on_outcome`] for a failed attempt (kept out of line: the success path stays
    /// small).
    #[inline(never)]
    fn on_failure(
        &mut self,
        outcome: Outcome,
        permit: Option<Permit>,
        now: Instant,
        rng: &mut (impl Rng + ?Sized),
    ) -> Decision {
        let offset = self.offset(now);
        let p = self.policy;
        // Whether `retry_on` lists the failure: step 4's first question, and (with transport
        // failures and server errors, which always count) whether the breaker counts it.
        let listed = outcome.listed_in(&p.retry_on);
        if let (Some(permit), Some(breaker)) = (permit, &self.state.breaker) {
            // No verdict either way: the permit goes back (a half-open probe to the next call).
            if outcome.is_throttled() || self.ended_by_the_deadline(&outcome, offset) {
                breaker.release(permit);
            } else {
                // `!outcome.is_upstream_failure(p)`, without a second scan of `retry_on`.
                let healthy = !listed
                    && !matches!(outcome, Outcome::Transport(_))
                    && !outcome.is_server_error();
                breaker.record_at(permit, healthy, window_nanos(offset));
            }
        }
        let decision = self.decide(&outcome, listed, offset, rng);
        self.last_failure = Some(outcome);
        decision
    }

    /// The attempt started last was sent again (after a credential refresh) with `timeout`,
    /// what was left of the deadline or its `per_try_timeout`: its timeout is judged as that of
    /// an attempt given `timeout`: one of less than half its `per_try_timeout` that runs out
    /// with the deadline gives the breaker no verdict.
    pub fn resent_within(&mut self, timeout: Duration) {
        if timeout.saturating_mul(2) < self.policy.per_try_timeout {
            self.cut_short = true;
        }
    }

    /// Whether `outcome`, reported at `offset`, is a timeout of an attempt that was given less
    /// than half its `per_try_timeout` and ran out with the call's deadline: the attempt's own timer (the
    /// deadline's remainder) or the upstream's (a gRPC `DEADLINE_EXCEEDED` to the
    /// `grpc-timeout` the attempt carried). Such a timeout says the call's time was up, not that
    /// the upstream is failing: a caller with a deadline shorter than the upstream's usual
    /// answer must not open the breaker for every caller of the endpoint. The breaker takes no
    /// verdict from it (its permit is handed back). A timeout with time left, or of an attempt
    /// given half its `per_try_timeout` or more, counts as a failure as before: callers with a
    /// common 1 s deadline under the default 2 s still open the breaker on a hung upstream.
    #[inline]
    fn ended_by_the_deadline(&self, outcome: &Outcome, offset: i128) -> bool {
        self.cut_short
            && self.left(offset) <= 0
            && matches!(
                outcome,
                Outcome::Transport(ErrorClass::Timeout)
                    | Outcome::Grpc {
                        code: GrpcCode::DeadlineExceeded,
                        ..
                    }
            )
    }

    /// `now` as an offset from the state's origin; no conversion when `now` is the instant
    /// converted last (the first attempt starts at the call's instant, and the agent reports a
    /// success at its attempt's start).
    #[inline(always)]
    fn offset(&mut self, now: Instant) -> i128 {
        if now != self.seen {
            self.seen = now;
            self.seen_offset = self.state.offset(now);
        }
        self.seen_offset
    }

    /// Nanoseconds left of the deadline at `offset` (negative once past it).
    #[inline]
    fn left(&self, offset: i128) -> i128 {
        self.deadline - offset
    }

    /// Steps 4 to 7 for a failed attempt; `listed`: whether `retry_on` lists it.
    #[inline]
    fn decide(
        &mut self,
        outcome: &Outcome,
        listed: bool,
        offset: i128,
        rng: &mut (impl Rng + ?Sized),
    ) -> Decision {
        let p = self.policy;
        // Steps 4 and 5: classification, attempts.
        let refusal = answer_refusal(
            &self.info,
            p.retry_after.honor,
            p.max_attempts,
            outcome,
            listed,
            self.attempts,
        );
        if let Some(cause) = refusal {
            return Decision::GiveUp(cause);
        }
        // Step 6: budget. The window is read once here; the retry is counted (one CAS, which can
        // still refuse if the current slot filled up meanwhile) only once it is certain.
        let withdrawal: Option<(&RetryBudget, Withdrawal)> =
            match p.budget.as_ref().and(self.state.budget.as_ref()) {
                Some(b) => match b.check_at(window_nanos(offset)) {
                    Some(w) => Some((b, w)),
                    None => return Decision::GiveUp(GiveUpCause::BudgetExhausted),
                },
                None => None,
            };
        // Step 7: pause, server hints, deadline.
        let hint = server_hint(&p.retry_after, outcome);
        let (pause, hinted) = match hint {
            Some((d, _)) if d > p.retry_after.max => {
                return Decision::GiveUp(GiveUpCause::RetryAfterTooLong);
            }
            // gRFC A6: a valid pushback replaces the computed pause, and the retries after the
            // one it paces start over from the initial backoff (retry 1's ceiling; for
            // `decorrelated`, a previous pause of `base`).
            Some((d, true)) => {
                self.backoff = None;
                (d, true)
            }
            // HTTP `Retry-After` only lengthens the computed pause (SPEC §2 step 7); the
            // schedule goes on, and `decorrelated` goes on from the pause taken. The hint is
            // honored whether or not it lengthened the pause: the pause is never shorter than
            // it, and whether a hint lengthens a jittered pause is the draw's doing.
            Some((d, false)) => {
                let computed = self.next_pause(rng);
                if d > computed
                    && let Some(backoff) = self.backoff.as_mut()
                {
                    backoff.paused(d);
                }
                (computed.max(d), true)
            }
            None => (self.next_pause(rng), false),
        };
        if nanos(pause) >= self.left(offset) {
            return Decision::GiveUp(GiveUpCause::DeadlineExceeded);
        }
        // Step 2 of the next attempt, asked now: a breaker that will still be open when the
        // pause ends will refuse that attempt, so the call gives up at once instead of sleeping
        // first, and spends no budget on a retry that cannot be sent. A breaker that opens
        // during the pause is still found by `start_attempt`.
        if p.circuit_breaker.is_some()
            && let Some(breaker) = &self.state.breaker
            && breaker.open_past(window_nanos(offset + nanos(pause)))
        {
            return Decision::GiveUp(GiveUpCause::CircuitOpen);
        }
        if let Some((budget, w)) = withdrawal {
            match budget.take(w) {
                Some(taken) => self.unsent_retry = Some(taken),
                None => return Decision::GiveUp(GiveUpCause::BudgetExhausted),
            }
        }
        // Step 5 made sure `attempts < max_attempts`: one more attempt may start.
        self.allowed = self.attempts + 1;
        Decision::Retry { pause, hinted }
    }

    /// The computed pause of the next retry; the backoff state is built on the first use.
    fn next_pause(&mut self, rng: &mut (impl Rng + ?Sized)) -> Duration {
        let p = self.policy;
        self.backoff
            .get_or_insert_with(|| Backoff::new(&p.backoff))
            .next_pause(rng)
    }

    /// Attempts started so far.
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// The outcome of the last failed attempt.
    pub fn last_failure(&self) -> Option<&Outcome> {
        self.last_failure.as_ref()
    }

    /// Ends the call by `within` after its start at the latest: the caller's own deadline (a
    /// gRPC caller's `grpc-timeout`), when it is shorter than the policy's. Every attempt's
    /// timeout, every pause and [`RetryCall::deadline`] then keep to it. A longer `within`
    /// changes nothing: the policy's deadline stays the limit.
    pub fn cap_deadline(&mut self, within: Duration) {
        if within < self.within {
            self.deadline -= nanos(self.within) - nanos(within);
            self.within = within;
        }
    }

    /// When the whole call must be over: its start plus the policy's deadline, or the shorter
    /// one of [`RetryCall::cap_deadline`] (30 years after the start for a deadline too long for
    /// an `Instant`).
    pub fn deadline(&self) -> Instant {
        deadline_at(self.start, self.within)
    }

    /// The policy this call runs under.
    pub fn policy(&self) -> &RetryPolicy {
        self.policy
    }
}

#[cfg(test)]
#[path = "engine_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "engine_step_tests.rs"]
mod step_tests;
