//! The circuit breaker of one endpoint (SPEC §2 step 2): stop calling an upstream that fails
//! most of what it gets, and probe it before trusting it again.
//!
//! - **Closed**: every call goes through. Outcomes are counted over a sliding window; when, in
//!   the window, at least `min_requests` attempts were recorded and
//!   `failures / attempts >= failure_ratio`, the breaker opens. The check runs when a failure is
//!   recorded, so a `failure_ratio` of 0 means "open on any failure once `min_requests` is met".
//! - **Open**: every call is rejected ([`BreakerOpen`]) until `open_for` has passed.
//! - **HalfOpen**: exactly `half_open_probes` calls (at least 1) get a probe [`Permit`]; the
//!   others are rejected. When every probe succeeds the breaker closes with empty counts; any
//!   probe failure opens it again for a new `open_for`. If the probes have not all reported
//!   within another `open_for` (a caller dropped its call without recording), a fresh set of
//!   probes is let through, so a lost probe cannot wedge the breaker half-open.
//!
//! Usage: [`CircuitBreaker::try_acquire`] before an attempt, then [`CircuitBreaker::record`] the
//! attempt's outcome with the permit, or [`CircuitBreaker::release`] it when the attempt has no
//! outcome to count (it failed on the caller's side, or was abandoned). A [`Permit`] is a plain `Copy` token; it remembers which
//! closed or half-open period issued it, so an outcome reported after the breaker has changed
//! state (a call in flight when it opened, a probe of an earlier half-open period) is ignored.
//!
//! When an endpoint's breaker settings change, the new breaker takes over from the old one
//! ([`CircuitBreaker::taking_over`]); calls still in flight on the old settings keep reporting
//! to the old breaker, which counts their outcomes in the newest breaker of the line instead
//! of its own while the newest is closed, so the newest opens by its own rule on every call's
//! outcomes (while it is open or half-open, the old one counts them itself); an opening of any
//! breaker of the line opens every other one too, until the same instant (unless it is
//! already open for longer). While a newer breaker lives, an older one sends no half-open
//! probe of its own: the newest's probes decide, and its closing closes the others. A call that reads the policies just before a push gets a
//! breaker *behind* the newest ([`CircuitBreaker::behind`]), which does the same. So new calls are refused as soon as the old
//! calls learn the upstream is failing, not only once the new breaker has counted
//! `min_requests` failures of its own, and calls started before the change stop retrying as
//! soon as the new breaker opens (SPEC §2 step 2: an open breaker makes no call).
//!
//! # Implementation
//!
//! Lock-free but for a failure counted while closed, added under the line's mutex (below). The
//! state is one `AtomicU64` (open flag, a 15-bit generation bumped on every
//! transition, and in the open state the end of `open_for` in milliseconds since `origin`,
//! rounded up), changed only by CAS, so exactly one thread performs each transition. Acquiring a
//! permit while closed is one atomic load; recording an outcome is a load and one increment of
//! the window (successes and failures are separate counters and attempts are their sum, so
//! either outcome costs one CAS); a failure then sums both counters in one pass over the window.
//! Half-open probes are counted in a second word (generation, issued, succeeded). Outcomes are
//! counted in the same lock-free slotted window as the retry budget (see `window.rs`), over the
//! slots wholly inside the window, so counts older than `window` never contribute; the window is
//! cleared when the breaker opens. Time comes in as `now` values.
//!
//! The breakers of one line of hand-overs share a list of weak references, oldest first
//! (`line.rs`, as budgets do: a mutex touched when a breaker joins, opens or closes, by the
//! outcomes recorded in a breaker taken over from, and by a failure counted in a closed window,
//! so that a hand-over's copy of the window and the failures counted meanwhile cannot miss each
//! other; never on an acquire, nor on a success of the newest). They all measure time from the first one's origin, so an open
//! period's end means
//! the same instant in each. The list rather than a single successor link: a breaker in the
//! middle of a chain may be gone while the oldest still serves calls, and one breaker may be
//! taken over more than once (the agent builds a short-lived one for a call on an outgoing
//! snapshot).

use std::sync::Arc;
use std::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed};
use std::sync::atomic::{AtomicBool, AtomicU64};

use tokio::time::Instant;

use crate::line::{self, Line, Member};
use crate::model::BreakerConfig;
use crate::window::{SlidingCounter, Span, nanos_since};

const SUCCESSES: usize = 0;
const FAILURES: usize = 1;

const OPEN: u64 = 1 << 63;
const GEN_SHIFT: u32 = 48;
const GEN_MASK: u64 = 0x7FFF;
const UNTIL_MASK: u64 = (1 << GEN_SHIFT) - 1;
const PROBE_MASK: u64 = (1 << 24) - 1;

/// The most `half_open_probes` a breaker counts (probes are counted in 24 bits); the validator
/// refuses more.
pub const MAX_HALF_OPEN_PROBES: u32 = (1 << 24) - 1;
const NANOS_PER_MS: u64 = 1_000_000;

/// A ratio and a count this close together count as equal (`0.3 × 10` is a hair above 3).
const EPSILON: f64 = 1e-9;

/// The state of a breaker at one instant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BreakerState {
    /// Calls go through and outcomes are counted.
    Closed,
    /// Calls are rejected until `open_for` has passed.
    Open,
    /// A limited number of probe calls decide whether to close or open again.
    HalfOpen,
}

impl BreakerState {
    /// The name used in reports (`closed`, `open`, `half_open`).
    pub fn as_str(self) -> &'static str {
        match self {
            BreakerState::Closed => "closed",
            BreakerState::Open => "open",
            BreakerState::HalfOpen => "half_open",
        }
    }
}

/// Leave to make one attempt; hand it back to [`CircuitBreaker::record`] with the outcome.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Permit {
    generation: u16,
    probe: bool,
}

impl Permit {
    /// Whether this attempt is a half-open probe (its outcome decides the breaker's state).
    pub fn is_probe(self) -> bool {
        self.probe
    }
}

/// The breaker rejected the attempt: it is open, or half-open with every probe taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("circuit breaker open")]
pub struct BreakerOpen;

/// The circuit breaker of one endpoint. `Sync`: share it through `&self` or an `Arc`.
#[derive(Debug)]
pub struct CircuitBreaker {
    origin: Instant,
    window: SlidingCounter<2>,
    state: AtomicU64,
    probes: AtomicU64,
    failure_ratio: f64,
    min_requests: u64,
    open_for_nanos: u64,
    half_open_probes: u64,
    /// The breakers of this one's line of hand-overs, oldest first; empty for a breaker that
    /// was never taken over nor took over.
    line: Arc<Line<CircuitBreaker>>,
    /// Set once another breaker took over from this one: the outcomes its calls still record
    /// are counted in the newest breaker of the line too ([`CircuitBreaker::taking_over`]).
    superseded: AtomicBool,
}

fn generation(state: u64) -> u16 {
    ((state >> GEN_SHIFT) & GEN_MASK) as u16
}

fn next_generation(state: u64) -> u64 {
    (u64::from(generation(state)) + 1) & GEN_MASK
}

fn until_nanos(state: u64) -> u64 {
    (state & UNTIL_MASK).saturating_mul(NANOS_PER_MS)
}

/// The probes issued and succeeded in the half-open period `generation`.
fn probe_counts(probes: u64, generation: u16) -> (u64, u64) {
    if (probes >> 48) as u16 == generation {
        ((probes >> 24) & PROBE_MASK, probes & PROBE_MASK)
    } else {
        (0, 0)
    }
}

fn pack_probes(generation: u16, issued: u64, succeeded: u64) -> u64 {
    (u64::from(generation) << 48) | (issued << 24) | succeeded
}

impl CircuitBreaker {
    /// A closed breaker for `cfg`, measuring time from `origin`.
    pub fn new(cfg: &BreakerConfig, origin: Instant) -> Self {
        Self {
            origin,
            window: SlidingCounter::new(cfg.window),
            state: AtomicU64::new(0),
            probes: AtomicU64::new(0),
            failure_ratio: cfg.failure_ratio,
            min_requests: u64::from(cfg.min_requests),
            open_for_nanos: u64::try_from(cfg.open_for.as_nanos()).unwrap_or(u64::MAX),
            half_open_probes: u64::from(cfg.half_open_probes).clamp(1, PROBE_MASK),
            line: Arc::default(),
            superseded: AtomicBool::new(false),
        }
    }

    /// A breaker for `cfg` that takes over from `old`, a breaker of the same endpoint built
    /// under other settings, measuring time from `old`'s origin. An `old` that is open stays
    /// open in the new breaker until the end of the open period it started (`old`'s
    /// `open_for`), and then probes under `cfg`; an `old` that is half-open is half-open here
    /// with no probe out. So a settings change never lets full traffic through to an upstream
    /// the breaker had cut off. The counts of a closed `old` are taken over, each slot's at
    /// the slot's start (so they leave the new window no later than at their true time):
    /// successes and failures do not depend on the thresholds, and a breaker tightened during
    /// a storm must not forget the failures already seen.
    ///
    /// Permits `old` issued stay `old`'s: report them to `old`, which the calls holding them
    /// keep. What they teach `old` is passed on: each outcome they record in `old` while it
    /// is closed is counted in the newest breaker of the line too, if that one is closed;
    /// and whenever `old` opens later (or opens again),
    /// the new breaker opens until the same instant, unless it is already open for longer;
    /// so does every breaker that takes over after it in the same line (from the new one, or
    /// from `old` again), even when a breaker between them is gone. And the other way: when the
    /// new breaker opens, `old` (and every breaker of the line) opens too, so the calls still
    /// on `old` stop retrying.
    pub fn taking_over(cfg: &BreakerConfig, old: &Arc<CircuitBreaker>) -> Arc<Self> {
        let breaker = Arc::new(Self {
            line: old.line.clone(),
            ..Self::new(cfg, old.origin)
        });
        // Under the line's lock, with `old` marked taken over: a failure `old` counts itself
        // is added under the same lock after it saw it was not taken over (`count`), so it is
        // in `old`'s window before the copy or passed on to the new breaker after it. (Copied
        // before the join, the failures `old` counted between the two were in neither window,
        // and a run of failures racing the hand-over opened neither breaker.) An opening of
        // `old` after the copy clears the new breaker's window with its own (`open_until`).
        line::join_after(old, &breaker, || {
            if old.state.load(Acquire) & OPEN == 0 {
                breaker.take_counts(old);
            }
        });
        // Read after joining the line: an opening of `old` either is seen here or, coming
        // after the join (the lock orders them), is passed on to the new breaker.
        let state = old.state.load(Acquire);
        if state & OPEN != 0 {
            breaker.open_until(state & UNTIL_MASK);
        }
        breaker
    }

    /// A breaker for `cfg` behind `newest`, for calls that still run under an outgoing policy
    /// (a call that read the policies just before a push): it joins `newest`'s line without
    /// becoming its newest, so the outcomes its calls record count in the newest breaker of
    /// the line, which decides when to open (and opens this one with it); an open `newest`
    /// makes it open as long.
    pub fn behind(cfg: &BreakerConfig, newest: &Arc<CircuitBreaker>) -> Arc<Self> {
        let breaker = Arc::new(Self {
            line: newest.line.clone(),
            ..Self::new(cfg, newest.origin)
        });
        line::join_behind(newest, &breaker);
        // Read after joining the line: a later opening of `newest` is passed on to it.
        let state = newest.state.load(Acquire);
        if state & OPEN != 0 {
            breaker.open_until(state & UNTIL_MASK);
        }
        breaker
    }

    /// Counts the recent outcomes of `old` (closed) in this breaker's window, each slot's at
    /// the slot's start, up to `old`'s newest slot.
    fn take_counts(&self, old: &CircuitBreaker) {
        // As of the start of `old`'s newest slot (no `now` here; it is at or before it).
        self.window
            .take_over(&old.window, old.window.newest_start(), [false; 2]);
    }

    fn nanos(&self, now: Instant) -> u64 {
        nanos_since(self.origin, now)
    }

    /// Whether another live breaker shares its line of hand-overs (it took over from one, or
    /// one took over from it): then its openings reach that one, and the other way round.
    pub fn has_line(&self) -> bool {
        line::has_other(self)
    }

    /// Whether a breaker made afresh at `now` may stand in for it: it counts nothing, and it
    /// is closed (the fresh one is then the same), or half-open with no call for as long again
    /// as its window and its open period since it became so. Half-open, it waits for a probe,
    /// which for an endpoint never called again (a host gone) never comes; after that long the
    /// failures that opened it are old, and a caller coming back starts afresh, as one new to
    /// the endpoint does.
    pub fn is_idle(&self, now: Instant) -> bool {
        let nanos = self.nanos(now);
        if !self.window.recent(self.window.peek(nanos)).is_empty() {
            return false;
        }
        let state = self.state.load(Acquire);
        state & OPEN == 0
            || nanos
                >= until_nanos(state)
                    .saturating_add(self.open_for_nanos.max(self.window.span_nanos()))
    }

    /// The state at `now`.
    pub fn state(&self, now: Instant) -> BreakerState {
        let state = self.state.load(Acquire);
        if state & OPEN == 0 {
            BreakerState::Closed
        } else if self.nanos(now) < until_nanos(state) {
            BreakerState::Open
        } else {
            BreakerState::HalfOpen
        }
    }

    /// Whether an attempt asked for at `nanos` since the origin will be refused whatever
    /// happens meanwhile: the breaker is open and its open period lasts past `nanos`. Only a
    /// half-open period ends an open one, and it starts when the open period ends, so until
    /// then the answer cannot change. Read-only; half-open (a probe may be free by then) is
    /// not counted as refused.
    #[inline]
    pub(crate) fn open_past(&self, nanos: u64) -> bool {
        let state = self.state.load(Acquire);
        state & OPEN != 0 && nanos < until_nanos(state)
    }

    /// Whether the breaker is closed: every attempt is allowed, whatever the time. One atomic
    /// load; a caller that needs the time only when it is not closed asks this first.
    #[inline]
    pub fn is_closed(&self) -> bool {
        self.state.load(Acquire) & OPEN == 0
    }

    /// Whether an attempt asked for at `now` would be refused: what [`Self::try_acquire`] would
    /// answer, read-only (no probe is taken, no lost probes are replaced). Open, or half-open
    /// with every probe out (until the probes count as lost, another `open_for` on), is
    /// refused. A caller about to wait for something before its attempt asks this first, and
    /// again while it waits, so that it fails fast rather than wait for an attempt the breaker
    /// will refuse.
    pub fn would_refuse(&self, now: Instant) -> bool {
        let state = self.state.load(Acquire);
        if state & OPEN == 0 {
            return false;
        }
        let now_nanos = self.nanos(now);
        let until = until_nanos(state);
        if now_nanos < until {
            return true;
        }
        let (issued, _) = probe_counts(self.probes.load(Acquire), generation(state));
        issued >= self.half_open_probes && now_nanos < until.saturating_add(self.open_for_nanos)
    }

    /// Asks to make one attempt at `now`: always granted while closed; while half-open, granted
    /// as a probe until `half_open_probes` have been taken; rejected otherwise.
    pub fn try_acquire(&self, now: Instant) -> Result<Permit, BreakerOpen> {
        let state = self.state.load(Acquire);
        if state & OPEN == 0 {
            // Closed: no need for the time.
            return Ok(Permit {
                generation: generation(state),
                probe: false,
            });
        }
        self.try_acquire_at(self.nanos(now))
    }

    /// [`Self::try_acquire`] at `now_nanos` since the origin.
    #[inline]
    pub(crate) fn try_acquire_at(&self, now_nanos: u64) -> Result<Permit, BreakerOpen> {
        let mut state = self.state.load(Acquire);
        loop {
            let generation = generation(state);
            let probe = state & OPEN != 0;
            if !probe {
                return Ok(Permit { generation, probe });
            }
            let until = until_nanos(state);
            if now_nanos < until {
                return Err(BreakerOpen);
            }
            // Half-open: the probes are the newest breaker's of the line, which closes the
            // others when they succeed (each breaker of a line sending its own sent many
            // times the probes the newest allows).
            if self.superseded.load(Relaxed) && self.newest().is_some() {
                return Err(BreakerOpen);
            }
            let probes = self.probes.load(Acquire);
            let (issued, succeeded) = probe_counts(probes, generation);
            if issued < self.half_open_probes {
                let taken = pack_probes(generation, issued + 1, succeeded);
                if self
                    .probes
                    .compare_exchange(probes, taken, AcqRel, Acquire)
                    .is_ok()
                {
                    // A probe of a period that ended while it was taken must not go out.
                    let same = self.state.load(Acquire) == state;
                    return same
                        .then_some(Permit { generation, probe })
                        .ok_or(BreakerOpen);
                }
            } else if now_nanos < until.saturating_add(self.open_for_nanos) {
                return Err(BreakerOpen);
            } else {
                // The probes have been out for another `open_for`: some were lost. Start a new
                // half-open period (a new generation) right now.
                let since = (now_nanos / NANOS_PER_MS).min(UNTIL_MASK);
                let rearmed = OPEN | next_generation(state) << GEN_SHIFT | since;
                let _ = self.state.compare_exchange(state, rearmed, AcqRel, Acquire);
            }
            state = self.state.load(Acquire);
        }
    }

    /// Records the outcome of the attempt `permit` allowed, at `now`.
    pub fn record(&self, permit: Permit, success: bool, now: Instant) {
        self.record_at(permit, success, self.nanos(now));
    }

    /// [`Self::record`] at `nanos` since the origin. The common case, a success while closed,
    /// is inline (one load and one CAS); everything else is out of line.
    #[inline(always)]
    pub(crate) fn record_at(&self, permit: Permit, success: bool, nanos: u64) {
        if success && !permit.probe {
            let state = self.state.load(Acquire);
            if state & OPEN == 0 && generation(state) == permit.generation {
                let slot = self.window.advance(nanos);
                self.window.add(slot, SUCCESSES);
                if self.superseded.load(Relaxed) {
                    self.pass_outcome_on(true, nanos);
                }
            }
            return;
        }
        self.record_other(permit, success, nanos);
    }

    /// [`Self::record_at`] for a failure or a probe's outcome.
    #[inline(never)]
    fn record_other(&self, permit: Permit, success: bool, nanos: u64) {
        let state = self.state.load(Acquire);
        let open = state & OPEN != 0;
        if generation(state) != permit.generation || open != permit.probe {
            return; // issued by an earlier period
        }
        // Taken over: the newest breaker of the line counts the outcome and decides; this one
        // opens when it does (an opening is passed on along the line). Opening here by its
        // own rule as well, on outcomes the newest has counted already, opened the newest
        // against its own.
        let forwarded = self.superseded.load(Relaxed) && self.pass_outcome_on(success, nanos);
        if permit.probe {
            if forwarded {
                // A probe sent before a newer breaker took over, whose outcome that one, closed,
                // has counted: this one follows it (closed), rather than opening alone or
                // closing on its own probes.
                self.close_here(state);
            } else if success {
                self.probe_succeeded(state, permit.generation);
            } else {
                self.open(state, nanos);
            }
            return;
        }
        if !forwarded {
            self.count(state, success, nanos);
        }
    }

    /// Counts an outcome at `nanos` while closed in `state`, and opens if a failure makes the
    /// opening rule hold. A failure is added under the line's lock, after looking again
    /// whether another breaker took over meanwhile (it copies this window under the same
    /// lock, [`CircuitBreaker::taking_over`]): then it is passed on to the newest. A success
    /// is added without the lock (one missed by a hand-over errs toward opening).
    fn count(&self, state: u64, success: bool, nanos: u64) {
        let slot = self.window.advance(nanos);
        if success {
            self.window.add(slot, SUCCESSES);
            return;
        }
        {
            let line = self.line.lock();
            if !self.superseded.load(Relaxed) {
                self.window.add(slot, FAILURES);
            } else {
                drop(line);
                if self.pass_outcome_on(false, nanos) {
                    return;
                }
                // The newest is open or half-open: this one counts it, by its own rule.
                self.window.add(slot, FAILURES);
            }
        }
        let [successes, failures] = self
            .window
            .sums(slot, [(Span::Inside, 0), (Span::Inside, 0)]);
        let attempts = successes + failures;
        if attempts >= self.min_requests
            && failures as f64 + EPSILON >= self.failure_ratio * attempts as f64
            && self.open(state, nanos)
        {
            self.window.clear();
        }
    }

    /// Counts an outcome a call recorded in this breaker, taken over from since, in the newest
    /// breaker of the line, if it is closed (`true`; `false` when there is none, or it is open
    /// or half-open, and this one counts it): the calls started before a change of settings
    /// tell the breaker new calls use what they learn (before, only this one counted them,
    /// and pushes that changed the settings more often than calls ended kept every breaker
    /// under its `min_requests`).
    #[cold]
    #[inline(never)]
    fn pass_outcome_on(&self, success: bool, nanos: u64) -> bool {
        let Some(newest) = self.newest() else {
            return false;
        };
        // An open or half-open newest counts no outcome of a closed period: this one counts
        // it then, by its own rule (a breaker behind a half-open newest that closed on its own
        // probes must still open when its calls fail, and opens the newest with it).
        let state = newest.state.load(Acquire);
        if state & OPEN != 0 {
            return false;
        }
        newest.count(state, success, nanos);
        true
    }

    /// The newest breaker of this one's line, when another took over from this one (or this
    /// one runs behind it) and is still in use. When none is, this one is the line's newest
    /// again and stops looking (no lock on its later outcomes).
    fn newest(&self) -> Option<Arc<CircuitBreaker>> {
        line::newest(self)
    }

    /// Hands back `permit` without an outcome: its attempt says nothing about the upstream (it
    /// failed on the caller's side, or was cancelled or dropped). A half-open probe is returned
    /// to the pool, so another call may take it at once, without counting a success or a
    /// failure; any other permit needs nothing (a closed period counts outcomes only). A probe
    /// of an earlier period is ignored, as its outcome would be.
    ///
    /// Each permit ends once: [`CircuitBreaker::record`] it or release it, never both and never
    /// twice ([`Permit`] is `Copy`, so this is the caller's to keep). A probe handed back twice
    /// would let more than `half_open_probes` probes out at once. [`crate::engine::RetryCall`] keeps
    /// this rule for its attempts.
    pub fn release(&self, permit: Permit) {
        if !permit.probe {
            return;
        }
        let state = self.state.load(Acquire);
        if state & OPEN == 0 || generation(state) != permit.generation {
            return; // issued by an earlier period
        }
        let mut probes = self.probes.load(Acquire);
        loop {
            let (issued, succeeded) = probe_counts(probes, permit.generation);
            if issued == 0 {
                return; // a later period
            }
            let back = pack_probes(permit.generation, issued - 1, succeeded);
            match self
                .probes
                .compare_exchange_weak(probes, back, AcqRel, Acquire)
            {
                Ok(_) => return,
                Err(current) => probes = current,
            }
        }
    }

    fn probe_succeeded(&self, state: u64, generation: u16) {
        let mut probes = self.probes.load(Acquire);
        loop {
            let (issued, succeeded) = probe_counts(probes, generation);
            if issued == 0 {
                return; // a later period
            }
            let counted = pack_probes(generation, issued, succeeded + 1);
            match self
                .probes
                .compare_exchange_weak(probes, counted, AcqRel, Acquire)
            {
                Ok(_) if succeeded + 1 >= self.half_open_probes => break,
                Ok(_) => return,
                Err(current) => probes = current,
            }
        }
        if self.close_here(state) {
            self.pass_close_on();
        }
    }

    /// Moves from `state` (open or half-open) to closed with a new generation and empty counts;
    /// `false` if another thread changed the state first.
    fn close_here(&self, state: u64) -> bool {
        let closed = next_generation(state) << GEN_SHIFT;
        let won = self
            .state
            .compare_exchange(state, closed, AcqRel, Acquire)
            .is_ok();
        if won {
            self.window.clear();
        }
        won
    }

    /// Closes every other breaker of its line that is open or half-open: their calls follow
    /// the breaker whose probes found the upstream healthy again (the others send none while
    /// it lives).
    #[cold]
    #[inline(never)]
    fn pass_close_on(&self) {
        for other in line::others(self) {
            let state = other.state.load(Acquire);
            if state & OPEN != 0 {
                other.close_here(state);
            }
        }
    }

    /// Moves from `state` to open for `open_for` from `nanos`, and passes the opening on to
    /// the other breakers of its line; `false` if another thread changed the state first.
    fn open(&self, state: u64, nanos: u64) -> bool {
        match self.open_here(state, nanos) {
            Some(until) => {
                self.pass_on(until);
                true
            }
            None => false,
        }
    }

    /// [`Self::open`] without passing the opening on: the end of the open period, or `None`
    /// if another thread changed the state first.
    fn open_here(&self, state: u64, nanos: u64) -> Option<u64> {
        let until = nanos
            .saturating_add(self.open_for_nanos)
            .div_ceil(NANOS_PER_MS)
            .min(UNTIL_MASK);
        let opened = OPEN | next_generation(state) << GEN_SHIFT | until;
        self.state
            .compare_exchange(state, opened, AcqRel, Acquire)
            .is_ok()
            .then_some(until)
    }

    /// Opens every other breaker of its line until `until` (ms since the origin they share):
    /// those that took over after it, which serve the calls that start now, and those it took
    /// over from, which serve calls started before a change of settings.
    #[cold]
    #[inline(never)]
    fn pass_on(&self, until: u64) {
        // Outside the lock: an upgraded breaker whose last owner is gone is dropped here.
        line::others(self).iter().for_each(|b| b.open_until(until));
    }

    /// Opens until `until` (ms since the origin) unless already open at least that long, with
    /// a new generation (permits out are stale) and empty counts. Passes nothing on: the
    /// opener reaches every other breaker of the line itself.
    fn open_until(&self, until: u64) {
        let mut state = self.state.load(Acquire);
        loop {
            if state & OPEN != 0 && state & UNTIL_MASK >= until {
                return;
            }
            let opened = OPEN | next_generation(state) << GEN_SHIFT | until;
            match self.state.compare_exchange(state, opened, AcqRel, Acquire) {
                Ok(_) => break,
                Err(current) => state = current,
            }
        }
        self.window.clear();
    }
}

impl Member for CircuitBreaker {
    fn line(&self) -> &Line<Self> {
        &self.line
    }

    fn superseded(&self) -> &AtomicBool {
        &self.superseded
    }
}

#[cfg(test)]
#[path = "breaker_tests.rs"]
mod tests;
