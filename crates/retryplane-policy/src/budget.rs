//! The retry budget: how many retries an endpoint may send, shared by all its calls (SPEC §2
//! step 6).
//!
//! # Why a budget and not only a maximum number of attempts?
//!
//! `max_attempts` alone is a guessing game with a dangerous failure mode. It must be high enough
//! to ride out a blip, yet every client retries that many times precisely when the upstream is
//! already struggling: with `max_attempts: 4` a failing upstream receives four times its normal
//! load, the extra load makes it fail more, which triggers more retries — a **retry storm**. When
//! the callers' callers retry too, the factors multiply and a small error rate becomes a
//! self-inflicted denial of service.
//!
//! A budget limits retries to a fraction of the traffic instead: over a trailing window, an
//! endpoint may send at most `ratio` retries per logical call, or a small reserve
//! (`min_per_second × window`) when that is more, so that a quiet endpoint can still retry at
//! all. However badly the upstream fails, the load it receives is bounded by `1 + ratio` times
//! the calls (or the reserve), not by `max_attempts` times. This is the idea of Finagle's
//! `RetryBudget` and tower's `TpsBudget`, which add the reserve to the ratio's allowance; SPEC §2
//! takes the larger of the two instead, so the reserve never raises the bound on a busy
//! endpoint.
//!
//! # Semantics
//!
//! A retry at `now` is allowed iff
//! `retries_in_window + 1 <= max(floor(min_per_second × window_secs), floor(ratio × requests_in_window))`,
//! where requests are **logical calls**: [`RetryBudget::deposit`] once when a call's first
//! attempt starts (a call the open circuit breaker stops sends nothing and is not counted),
//! [`RetryBudget::try_withdraw`] once per retry. First attempts never consume
//! budget, and a denied retry is not counted; nor, in the end, is a retry the engine counted
//! that was never sent (its call cancelled or dropped during the pause, or stopped after it):
//! the engine hands it back.
//!
//! # Implementation
//!
//! Lock-free on a budget's own calls: two counters (requests, retries) in a `SlidingCounter`
//! ring of about ten slots per window, each slot an `AtomicU64` packing an epoch with a count
//! (see `window.rs`). A deposit is the `Instant` subtraction (which the engine does once per step
//! for the budget, the breaker and the deadline), one load, one multiplication and one
//! uncontended CAS; a withdraw adds one pass over the window's slots, reading both counters of
//! each. To make the bound sound
//! despite slotting, requests are counted over the slots wholly inside the window (a subset of
//! the true window, so up to one slot — a tenth of the window — of old calls is not credited)
//! and retries over the slots that cover the window (a superset, so up to a tenth of a window of
//! old retries is still charged).
//! Hence, for a sequence of calls, at every allowed retry at `t` the true number of retries in
//! `(t - window, t]` is at most `max(reserve, ratio × calls in (t - window, t])`.
//!
//! Under concurrency, [`RetryBudget::try_withdraw`] is strict within a slot: the check and the
//! count are one CAS on the current slot's retry word, so two threads cannot both take the last
//! unit of it. The only race left is at a slot boundary, where a thread still in the previous
//! slot may count there while a thread in the new slot checks against its earlier read of that
//! slot: at most one extra retry per concurrent thread. The engine splits a withdrawal in two so
//! that the window is read once: it reads it before computing the pause (the budget's refusal
//! comes first, SPEC §2 step 6) and takes the retry with the same single CAS once the pause fits
//! the deadline; that widens the same boundary race by the time the pause takes to compute.
//!
//! A push that changes an endpoint's budget settings makes a new budget take over the old one's
//! counts ([`RetryBudget::taking_over`]); the budgets of such a line share a list under a mutex
//! (`line.rs`), touched when one joins and by the calls of one taken over from, never by the
//! newest's own. A retry counted in a budget looks again, after a `SeqCst` fence, whether it was
//! taken over meanwhile (a hand-over marks it, then copies its window, with a fence between), so
//! a retry racing a hand-over is counted in the copy, in the new budget, or in both; a deposit
//! racing it may be in neither, which only makes the budget refuse sooner. A retry the old
//! budget allowed and the new one counts after the copy is counted there whatever the new
//! window holds: while the new budget's own calls retry too, the two together may pass the
//! allowance by at most one retry per thread racing the hand-over, as at a slot boundary.
//!
//! Time comes in as `now` values, never from the clock. Instants before `origin` count as
//! `origin`; an instant older than the newest one seen (time going backwards a little, or
//! threads passing slightly different instants) counts in the newest slot seen.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering, fence};

use tokio::time::Instant;

use crate::line::{self, Line, Member};
use crate::model::BudgetConfig;
use crate::window::{SlidingCounter, Span, nanos_since};

const REQUESTS: usize = 0;
const RETRIES: usize = 1;

/// The spans of one budget read: requests over the slots inside the window, retries over the
/// slots covering it, leaving out the current slot (read by the CAS that takes the retry).
const READ: [(Span, u64); 2] = [(Span::Inside, 0), (Span::Covering, 1)];

/// A product of a ratio and a count this close below an integer counts as that integer, so that
/// `0.29 × 100` allows 29 and not 28.
const EPSILON: f64 = 1e-9;

/// The retry budget of one endpoint. `Sync`: share it through `&self` or an `Arc`.
#[derive(Debug)]
pub struct RetryBudget {
    origin: Instant,
    window: SlidingCounter<2>,
    ratio: f64,
    reserve: u64,
    /// Set once another budget took over from this one ([`RetryBudget::taking_over`]): what
    /// this one's calls still deposit and withdraw goes to the newest of its line.
    superseded: AtomicBool,
    /// The budgets of this one's line of hand-overs (`line.rs`).
    line: Arc<Line<RetryBudget>>,
    /// Tells this budget from the others of its line (see [`Taken`]).
    id: u64,
}

/// The next [`RetryBudget::id`].
static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// What a budget holds at one instant, for `explain` and metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BudgetSnapshot {
    /// Logical calls counted in the window (the slots wholly inside it).
    pub requests: u64,
    /// Retries counted in the window (the slots covering it).
    pub retries: u64,
    /// Retries the window allows in total: `max(reserve, floor(ratio × requests))`.
    pub allowed: u64,
}

/// A retry the budget allowed when it was read ([`RetryBudget::check_at`]); it is counted, or
/// refused if the slot filled up since, by [`RetryBudget::take`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct Withdrawal {
    nanos: u64,
    slot: u64,
    older: u64,
    limit: u64,
    /// Read from the newest budget of the line, not this one (see [`RetryBudget::newest`]).
    newest: bool,
}

/// A retry [`RetryBudget::take`] counted: the slot it is counted in, and the budget (this
/// one, or the newest of its line then), which alone can uncount it: slots are numbered by
/// each budget's own window.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Taken {
    slot: u64,
    budget: u64,
}

/// `max(reserve, floor(ratio × requests))`.
fn allowance(reserve: u64, ratio: f64, requests: u64) -> u64 {
    // The product is never negative (`ratio >= 0`), so truncating is flooring. `as` saturates,
    // and a NaN becomes 0.
    reserve.max((ratio * requests as f64 + EPSILON) as u64)
}

/// The retries `cfg`'s reserve allows per window: `floor(min_per_second × window)`.
pub fn reserve_per_window(cfg: &BudgetConfig) -> u64 {
    let reserve = f64::from(cfg.min_per_second) * cfg.window.as_secs_f64();
    // Never negative; `as` saturates.
    (reserve + EPSILON) as u64
}

impl RetryBudget {
    /// An empty budget for `cfg`, measuring time from `origin`.
    pub fn new(cfg: &BudgetConfig, origin: Instant) -> Self {
        Self {
            origin,
            window: SlidingCounter::new(cfg.window),
            ratio: if cfg.ratio > 0.0 { cfg.ratio } else { 0.0 },
            reserve: reserve_per_window(cfg),
            superseded: AtomicBool::new(false),
            line: Arc::default(),
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
        }
    }

    /// A budget for `cfg` that takes over at `now` from `old`, the same endpoint's budget under
    /// other settings: the calls and retries `old` counts in its recent slots are counted in
    /// the new budget at their own time, as near as the slots tell: a slot's calls at the
    /// slot's start, its retries at its end (at `now` for the slot of `now`), so that calls
    /// leave the new window no later and retries no sooner than at their true time, and the
    /// bound stays sound. So a change of settings hands out no fresh allowance: a budget
    /// tightened during a retry storm refuses at once what the retries already used up (an
    /// empty one allowed its whole reserve again, on every agent), and a change never credits
    /// calls for longer than they were made for.
    ///
    /// From then on, the calls still running on `old` deposit and withdraw in the newest
    /// budget of the line (this one, or one that took over after it): their retries are
    /// allowed by, and counted in, the budget new calls use. Counted in `old` alone, they were
    /// seen by no later budget, and pushes that changed the settings more often than calls
    /// ended let a storm's retries through many fresh budgets.
    pub fn taking_over(cfg: &BudgetConfig, old: &Arc<RetryBudget>, now: Instant) -> Arc<Self> {
        let budget = Arc::new(Self {
            line: old.line.clone(),
            ..Self::new(cfg, old.origin)
        });
        let nanos = nanos_since(old.origin, now);
        // Calls at their slot's start, retries at its end.
        let mut at_end = [false; 2];
        at_end[RETRIES] = true;
        // With `old` marked taken over, and a fence between the mark and the copy: a retry
        // `old` counts meanwhile is looked at again after it is counted, with a fence between
        // (`recount_if_taken_over`), so it is in the copy or counted in this budget too. Under
        // the line's lock: a call on `old` finds this budget through the line only once the
        // copy is done. A call's deposit in `old` that races the copy may be in neither (it
        // looks once, before counting): a call too few, which only refuses sooner.
        line::join_after(old, &budget, || {
            fence(Ordering::SeqCst);
            budget.window.take_over(&old.window, nanos, at_end);
        });
        budget
    }

    /// A budget for `cfg` behind `newest`, for calls that still run under an outgoing
    /// policy (a call that read the policies just before a push): it joins `newest`'s line
    /// without becoming its newest, so everything its calls deposit and withdraw goes to the
    /// newest budget of the line, which new calls use; it counts nothing of its own while
    /// that one is in use.
    pub fn behind(cfg: &BudgetConfig, newest: &Arc<RetryBudget>) -> Arc<Self> {
        let budget = Arc::new(Self {
            line: newest.line.clone(),
            ..Self::new(cfg, newest.origin)
        });
        line::join_behind(newest, &budget);
        budget
    }

    /// Whether another live budget shares its line (it took over from one, one took over from
    /// it, or one runs behind it): then what the calls of one count may be in the other.
    pub fn has_line(&self) -> bool {
        line::has_other(self)
    }

    /// The newest budget of this one's line, when another budget took over from this one and
    /// is still in use: where this one's calls deposit and withdraw. When none is (they are
    /// gone), this one is the line's newest again and stops looking.
    fn newest(&self) -> Option<Arc<RetryBudget>> {
        if !self.superseded.load(Ordering::Acquire) {
            return None;
        }
        line::newest(self)
    }

    /// Whether it counts nothing at `now`: a budget made afresh then would be the same.
    pub fn is_empty(&self, now: Instant) -> bool {
        let nanos = nanos_since(self.origin, now);
        self.window.recent(self.window.peek(nanos)).is_empty()
    }

    /// Records that one logical call started at `now` (its first attempt).
    pub fn deposit(&self, now: Instant) {
        self.deposit_at(nanos_since(self.origin, now));
    }

    /// [`Self::deposit`] at `nanos` since the origin.
    #[inline]
    pub(crate) fn deposit_at(&self, nanos: u64) {
        if self.superseded.load(Ordering::Relaxed) {
            return self.deposit_in_newest(nanos);
        }
        let slot = self.window.advance(nanos);
        self.window.add(slot, REQUESTS);
    }

    /// [`Self::deposit_at`] for a budget taken over from: in the newest of the line.
    #[cold]
    #[inline(never)]
    fn deposit_in_newest(&self, nanos: u64) {
        let budget = self.newest();
        let budget = budget.as_deref().unwrap_or(self);
        let slot = budget.window.advance(nanos);
        budget.window.add(slot, REQUESTS);
    }

    /// Asks for one retry at `now`: `true` (and the retry is counted) when the budget allows it,
    /// `false` (nothing counted) when it is exhausted.
    pub fn try_withdraw(&self, now: Instant) -> bool {
        let newest = self.newest();
        let budget = newest.as_deref().unwrap_or(self);
        let nanos = nanos_since(budget.origin, now);
        let slot = budget.window.advance(nanos);
        budget.counted(budget.take_in(slot), nanos)
    }

    /// Whether a retry at `now` would be allowed, without counting it.
    pub fn can_withdraw(&self, now: Instant) -> bool {
        let newest = self.newest();
        let budget = newest.as_deref().unwrap_or(self);
        let slot = budget.window.peek(nanos_since(budget.origin, now));
        let [requests, older] = budget.window.sums(slot, READ);
        budget.fits(
            slot,
            older,
            allowance(budget.reserve, budget.ratio, requests),
        )
    }

    /// Reads the window once at `nanos` since the origin, read-only like
    /// [`Self::can_withdraw`]: the retry it would allow, or `None` when the budget is exhausted.
    /// Nothing is counted until [`Self::take`].
    pub(crate) fn check_at(&self, nanos: u64) -> Option<Withdrawal> {
        if self.superseded.load(Ordering::Relaxed)
            && let Some(newest) = self.newest()
        {
            return newest
                .check_own(nanos)
                .map(|w| Withdrawal { newest: true, ..w });
        }
        self.check_own(nanos)
    }

    /// [`Self::check_at`] in this budget's own window.
    fn check_own(&self, nanos: u64) -> Option<Withdrawal> {
        let slot = self.window.peek(nanos);
        let [requests, older] = self.window.sums(slot, READ);
        let limit = allowance(self.reserve, self.ratio, requests);
        self.fits(slot, older, limit).then_some(Withdrawal {
            nanos,
            slot,
            older,
            limit,
            newest: false,
        })
    }

    /// Counts the retry `w` allowed, unless the current slot filled up since the check (one CAS,
    /// no second read of the window): `None` then, and nothing is counted. `Some` holds the
    /// retry counted, for [`Self::give_back`] should it never be sent.
    pub(crate) fn take(&self, w: Withdrawal) -> Option<Taken> {
        // Also when a push took this budget over between the check and now.
        if w.newest || self.superseded.load(Ordering::Relaxed) {
            // Read again in the newest budget now (it may not be the one checked).
            let newest = self.newest();
            let budget = newest.as_deref().unwrap_or(self);
            let slot = budget.window.advance(w.nanos);
            return budget
                .counted(budget.take_in(slot), w.nanos)
                .then_some(Taken {
                    slot,
                    budget: budget.id,
                });
        }
        let slot = self.window.advance(w.nanos);
        let taken = if slot != w.slot {
            // Another thread moved the window on since the check: read it again.
            self.take_in(slot)
        } else {
            self.window.try_add(slot, RETRIES, w.older, w.limit)
        };
        self.counted(taken, w.nanos).then_some(Taken {
            slot,
            budget: self.id,
        })
    }

    /// `taken`, after [`Self::recount_if_taken_over`] when it is `true` (a retry at `nanos` was
    /// counted in this budget's own window): every retry counted goes through here.
    fn counted(&self, taken: bool, nanos: u64) -> bool {
        if taken {
            self.recount_if_taken_over(nanos);
        }
        taken
    }

    /// Looks again, after a retry at `nanos` was counted in this budget's own window, whether
    /// another budget took this one over meanwhile: then the retry is counted in the newest
    /// too. A hand-over marks this budget taken over, then copies its window, with a fence
    /// between ([`Self::taking_over`]); the fence here comes between the count and the look.
    /// Of two fences one comes first, so the copy has the retry or this look sees the mark
    /// (or both: then it is counted twice, a retry too many and never one too few). Lock-free
    /// but for a retry that raced a hand-over.
    fn recount_if_taken_over(&self, nanos: u64) {
        fence(Ordering::SeqCst);
        if self.superseded.load(Ordering::Relaxed) {
            self.recount_in_newest(nanos);
        }
    }

    /// [`Self::recount_if_taken_over`] once it saw the mark: in the newest budget of the line
    /// (found under the line's lock, so after the hand-over's copy), and looking again there.
    #[cold]
    #[inline(never)]
    fn recount_in_newest(&self, nanos: u64) {
        if let Some(newest) = self.newest() {
            let slot = newest.window.advance(nanos);
            newest.window.add(slot, RETRIES);
            newest.recount_if_taken_over(nanos);
        }
    }

    /// Uncounts a retry [`Self::take`] counted that was never sent (its call was cancelled or
    /// dropped during the pause, or the breaker or the deadline stopped it after the pause): a
    /// retry the upstream never saw leaves the window's retries as they were. A retry whose
    /// slot has left the window since is no longer counted there, and nothing changes.
    pub(crate) fn give_back(&self, taken: Taken) {
        if taken.budget == self.id {
            self.window.remove(taken.slot, RETRIES);
        } else if let Some(newest) = self.newest()
            && newest.id == taken.budget
        {
            newest.window.remove(taken.slot, RETRIES);
        }
        // Else the budget it was counted in is no longer the newest: one that took over
        // since took the retry over with its slot's counts, in slots of its own; it stays
        // counted (a retry too many, never one too few). So does a retry counted in the
        // newest too, by a look after a hand-over ([`Self::recount_if_taken_over`]): only
        // the budget `taken` names is uncounted.
    }

    /// Reads the window and takes one retry in `slot` (from `advance`) if it allows one.
    fn take_in(&self, slot: u64) -> bool {
        let [requests, older] = self.window.sums(slot, READ);
        let limit = allowance(self.reserve, self.ratio, requests);
        self.window.try_add(slot, RETRIES, older, limit)
    }

    /// Whether one more retry in `slot` stays within `limit`.
    fn fits(&self, slot: u64, older: u64, limit: u64) -> bool {
        older + self.window.current(slot, RETRIES) < limit
    }

    /// The counts at `now`, without changing them.
    pub fn snapshot(&self, now: Instant) -> BudgetSnapshot {
        let slot = self.window.peek(nanos_since(self.origin, now));
        let [requests, retries] = self
            .window
            .sums(slot, [(Span::Inside, 0), (Span::Covering, 0)]);
        BudgetSnapshot {
            requests,
            retries,
            allowed: allowance(self.reserve, self.ratio, requests),
        }
    }
}

impl Member for RetryBudget {
    fn line(&self) -> &Line<Self> {
        &self.line
    }

    fn superseded(&self) -> &AtomicBool {
        &self.superseded
    }
}

#[cfg(test)]
#[path = "budget_tests.rs"]
mod tests;
