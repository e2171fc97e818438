//! One logical call under SPEC §2: the [`Endpoint`] handle and its executor.
//!
//! The endpoint's entry in the policy snapshot (its policy and shared state) is read once when
//! the call starts and that `Arc` is kept for every attempt (STYLE #4): a push mid-call does
//! not change the call. Each attempt runs under its per-try timeout,
//! `start + min(per_try_timeout, deadline left)` (`crate::per_try`, whose timer is armed only
//! when the attempt has to wait); pauses are
//! `tokio::time::sleep`, so both follow tokio's (pausable) clock. The engine ([`RetryCall`])
//! makes every decision; this file only runs attempts, sleeps, counts and logs.
//!
//! Cost on the success path (see BENCHMARKS.md, "Agent: `Endpoint::call`"): one clock read (the
//! call's start, which is also the first attempt's; a success is counted at its attempt's
//! start, and only failures read the clock again), no allocation
//! and no lock of the agent's own (except on a handle's first call after a policy swap, which
//! looks its entry up again and, for an endpoint the policies do not name, may create it); the
//! cancellation token is only polled when the call has
//! one, and the per-call RNG is only made when a pause is drawn. The endpoint's entry comes
//! from its handle (no lookup, no write to the snapshot's reference count), and a first-try
//! success is one counter increment ([`FirstCounts`]).

use std::collections::HashMap;
use std::future::Future;
use std::pin::{Pin, pin};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use arc_swap::ArcSwapOption;
use retryplane_policy::breaker::CircuitBreaker;
use retryplane_policy::diag::LogValue;
use retryplane_policy::engine::{CallInfo, Decision, GiveUpCause, Outcome, RetryCall, RetryRules};
use retryplane_policy::model::RetryPolicy;
use retryplane_policy::retry_after::RetryAfterError;
use retryplane_policy::rng::{Rng, SeededRng};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::agent::{Shared, Task};
use crate::classify::{Classification, Classify, class_name};
use crate::error::{CallError, Cause, Last, LastClass};
use crate::meta::{AttemptInfo, CallMeta};
use crate::metrics::{CounterValues, Counters, Registry};
use crate::per_try;
use crate::ready::{AlwaysReady, Readied, Ready, open_now, refuses_now, wait_ready};
use crate::snapshot::{Entry, Runtime};

/// A cheap handle on one logical upstream: clone it freely and keep it. It keeps the agent's
/// background task running, so policy pushes reach it and its counts are reported even when the
/// [`crate::Agent`] it came from is dropped; [`crate::Agent::shutdown`] stops the task anyway.
///
/// Every handle on the endpoint (clones, and handles made again by name from the same agent)
/// keeps one copy of the endpoint's entry (policy and shared state) of the snapshot in force,
/// keyed on the agent's swap count: a call checks the count and takes the entry, without a
/// lookup among the snapshot's endpoints; the first call after a swap looks it up again. So a
/// handle made for each call costs one map lookup by name, and no allocation while a handle
/// on that name is held or since the last report and swap (an endpoint no handle holds is
/// let go then, see the crate docs); keeping the handle saves that lookup. Its `Debug` names
/// the endpoint and the version of the policies in force, not the policies.
#[derive(Clone)]
pub struct Endpoint {
    shared: Arc<Shared>,
    core: Arc<EndpointCore>,
    /// The agent's background task, kept running while a handle lives (`None` for an agent
    /// with no control plane).
    _task: Option<Arc<Task>>,
}

// Written by hand: the derived form printed the agent's shared state whole (see `Agent`'s).
impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("name", &self.name())
            .field("version", &self.shared.policies.load().version())
            .finish_non_exhaustive()
    }
}

/// What every handle on one endpoint of an agent shares: its name, its counters and the entry
/// kept for the snapshot in force. Made by [`Cores`] on the first handle on the name (and again
/// after one no handle held was let go), so a handle made per call costs a map lookup and
/// reference counts, not allocations and a fresh entry lookup.
#[derive(Debug)]
pub(crate) struct EndpointCore {
    name: Arc<str>,
    /// The name its counts are reported under, and logged by
    /// ([`retryplane_proto::reported_name`]): `name`, or a cut of a name too long for the
    /// control plane's series (one of megabytes made every report too large to take).
    reported: Arc<str>,
    counters: Arc<Counters>,
    cache: ArcSwapOption<Cached>,
}

/// Every endpoint's [`EndpointCore`], made on the first handle on it and kept while a handle is
/// (see [`Cores::forget_unheld`]).
#[derive(Debug, Default)]
pub(crate) struct Cores {
    map: RwLock<HashMap<Arc<str>, Arc<EndpointCore>, foldhash::fast::RandomState>>,
}

impl Cores {
    /// The core of `name`, made (with its counters from `metrics`) on first use.
    fn get(&self, metrics: &Registry, name: &str) -> Arc<EndpointCore> {
        if let Some(core) = self.map.read().unwrap_or_else(|e| e.into_inner()).get(name) {
            return core.clone();
        }
        self.insert(metrics, name)
    }

    /// Lets go of the cores no handle holds any more, and of the entries they kept: a kept
    /// entry holds its endpoint's budget and breaker, so without this no push could drop an
    /// endpoint's state once it is idle, nor stop carrying it: an agent that called many
    /// endpoints once (named after hosts, say) kept a state for each and rebuilt them all on
    /// every push that changed `defaults:` (then: 100 ms a push after 20,000 names, against
    /// 0.6 ms). Held cores keep theirs (a handle held is an endpoint in use). A core made again
    /// later starts with the counts its endpoint still has to report
    /// ([`Registry::counters`]). Done at each swap and each report.
    pub(crate) fn forget_unheld(&self) {
        let mut map = self.map.write().unwrap_or_else(|e| e.into_inner());
        map.retain(|_, core| Arc::strong_count(core) > 1);
    }

    /// How many cores are kept.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.map.read().unwrap_or_else(|e| e.into_inner()).len()
    }

    #[cold]
    #[inline(never)]
    fn insert(&self, metrics: &Registry, name: &str) -> Arc<EndpointCore> {
        let mut map = self.map.write().unwrap_or_else(|e| e.into_inner());
        if let Some(core) = map.get(name) {
            return core.clone();
        }
        let name: Arc<str> = Arc::from(name);
        let reported = match retryplane_proto::reported_name(&name) {
            cut if cut.len() < name.len() => Arc::from(cut),
            _ => name.clone(),
        };
        let core = Arc::new(EndpointCore {
            counters: metrics.counters(&reported),
            name: name.clone(),
            reported,
            cache: ArcSwapOption::empty(),
        });
        map.insert(name, core.clone());
        core
    }
}

/// An endpoint's entry and the generation ([`Shared::generation`]) it is valid for.
#[derive(Debug)]
struct Cached {
    generation: u64,
    entry: Arc<Entry>,
}

/// A pause in progress: on drop (the pause slept, cut short by a cancellation, or its call
/// dropped) it adds the time paused, at most the pause, to the endpoint's backoff time, so the
/// figure counts pauses taken, not pauses planned.
struct Paused<'a, 'c> {
    counts: &'a mut FirstCounts<'c>,
    from: Instant,
    pause: Duration,
}

impl Drop for Paused<'_, '_> {
    fn drop(&mut self) {
        let paused = Instant::now()
            .saturating_duration_since(self.from)
            .min(self.pause);
        self.counts.to().add_backoff(paused);
    }
}

/// How the attempt loop ended.
enum End<T, E> {
    Ok(T),
    /// An error the caller's classifier called a success: a success in every count, returned in
    /// a [`CallError`] since it cannot be a `T`.
    OkErr(E),
    Fail(Cause, Option<Last<T, E>>, Option<Outcome>),
}

impl Endpoint {
    pub(crate) fn new(shared: Arc<Shared>, task: Option<Arc<Task>>, name: &str) -> Self {
        let core = shared.cores.get(&shared.metrics, name);
        Self {
            shared,
            core,
            _task: task,
        }
    }

    /// The endpoint's entry in the snapshot in force: the one this handle keeps, unless the
    /// policies were swapped since. A call holds what this returns from start to end.
    fn entry(&self) -> Arc<Entry> {
        let generation = self.shared.generation();
        if let Some(cached) = &*self.core.cache.load()
            && cached.generation == generation
        {
            return cached.entry.clone();
        }
        self.refresh_entry(generation)
    }

    /// Looks the entry up in the snapshot in force and keeps it for `generation`. The
    /// generation was read before the snapshot was loaded, so the snapshot is that one or a
    /// newer one: at worst a newer entry is kept under an older generation, and the next call
    /// looks it up again; an older entry is never kept under a newer generation. Nothing is
    /// kept under an odd generation (a swap under way), which no kept entry matches: until the
    /// swap ends every call looks its entry up, so a caller that has seen the new policies
    /// gets them.
    #[cold]
    #[inline(never)]
    fn refresh_entry(&self, generation: u64) -> Arc<Entry> {
        let entry = self.shared.policies.load().entry(&self.core.name);
        if !generation.is_multiple_of(2) {
            return entry;
        }
        self.core.cache.store(Some(Arc::new(Cached {
            generation,
            entry: entry.clone(),
        })));
        entry
    }

    /// The endpoint's name.
    pub fn name(&self) -> &str {
        &self.core.name
    }

    /// This endpoint's counts not yet sent to the control plane, whatever version they were
    /// made under (those of calls that outlived the policies they ran on included). Endpoints
    /// whose names are over 256 bytes and start alike are counted together (their counts are
    /// reported under one cut name: [`retryplane_proto::reported_name`]).
    pub fn pending_counts(&self) -> CounterValues {
        let mut counts = self.core.counters.peek();
        self.shared
            .metrics
            .add_outlived(&self.core.reported, &mut counts);
        counts
    }

    /// Begins a logical call now, reading the endpoint's entry (its policy) for it: the tower
    /// layer's calls, which read the request body (and may wait on other calls) before their
    /// first attempt, go by this one read from start to end (SPEC §2).
    pub(crate) fn begin(&self) -> Begun {
        Begun {
            at: Instant::now(),
            entry: self.entry(),
            route: AtomicUsize::new(UNRESOLVED),
        }
    }

    /// Runs `attempt` under the endpoint's policy, classifying results with [`Classify`].
    ///
    /// `attempt` is called once per attempt with its [`AttemptInfo`]; its future is dropped
    /// when the attempt's timeout passes. Returns the first success, or a [`CallError`] with
    /// the cause and the last attempt's response or error.
    ///
    /// A failed answer is kept, as the attempt returned it, through the pause and the next
    /// attempt (it is returned if the call ends before a later answer). An HTTP response whose
    /// body is still unread holds its connection meanwhile, so the retry opens another: read a
    /// failed answer's body inside the attempt, or call through the tower layer
    /// ([`crate::layer::RetryLayer`]), which does.
    ///
    /// With a tonic client, bound each attempt with the policy's `per_try_timeout` (the
    /// agent's own timer: a timeout, retried for an idempotent or keyed call), not with the
    /// channel's `Endpoint::timeout` or `Request::set_timeout`. tonic raises the same
    /// `CANCELLED` status for those as for a caller's deadline, so a status of it is judged by
    /// its code, which `retry_on` does not list by default: not retried, and not counted
    /// against the breaker as a timeout. The tower layer, which writes the caller's deadline
    /// itself, tells a channel's timeout apart and retries it. Give a caller's deadline as
    /// [`CallMeta::deadline_within`](crate::CallMeta::deadline_within).
    ///
    /// (Not an `async fn`: it hands back the one future that runs the call, so the call's state
    /// is not wrapped, moved and polled through two more layers on every call.)
    pub fn call<T, E, F, Fut>(
        &self,
        meta: CallMeta<'_>,
        attempt: F,
    ) -> impl Future<Output = Result<T, CallError<T, E>>>
    where
        T: Classify,
        E: Classify,
        F: FnMut(AttemptInfo) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        self.call_reauth(
            Now,
            meta,
            classify_result::<T, E>,
            attempt,
            NoReauth,
            AlwaysReady,
            KeepAsIs,
        )
    }

    /// [`Endpoint::call`] with a classifier of your own.
    ///
    /// An `Err` your classifier calls [`Classification::Success`] ends the call as a success:
    /// the breaker, the counters (`success_first_try` or `success_after_retry`) and the log
    /// count it as one. Since it cannot be returned as a `T`, it comes back as it is in a
    /// [`CallError`] whose cause is [`Cause::Succeeded`] (`last` holds the error;
    /// [`CallError::gave_up`] is `None`).
    pub fn call_with<T, E, C, F, Fut>(
        &self,
        meta: CallMeta<'_>,
        classify: C,
        attempt: F,
    ) -> impl Future<Output = Result<T, CallError<T, E>>>
    where
        C: FnMut(&Result<T, E>) -> Classification,
        F: FnMut(AttemptInfo) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        self.call_reauth(
            Now,
            meta,
            classify,
            attempt,
            NoReauth,
            AlwaysReady,
            KeepAsIs,
        )
    }

    /// [`Endpoint::call`] with a once-only credential refresh (SPEC §2, "Agent extras"): the
    /// first answer for which `wants_refresh` is true (a 401, say) is put aside, `refresh` runs
    /// and, if it returns `true`, the same attempt is sent again: `attempt` is called once more
    /// with the same [`AttemptInfo`] (its number) and a fresh per-try timeout, and should pick
    /// up the new credentials. `refresh` runs at most once per call.
    ///
    /// - Counting: the second send belongs to the same attempt; it takes no pause, no retry
    ///   budget and none of `max_attempts`. The attempt number, the breaker and the counters see
    ///   one attempt, judged (by [`Classify`]) on the second answer. A second 401 is judged
    ///   like any answer (`retry_on` does not list 401 by default: it is returned at once).
    /// - `refresh` runs within what is left of the deadline and stops with the call's
    ///   cancellation. If it returns `false` or the deadline passes first, the first answer
    ///   stands. The agent neither logs nor keeps anything of it: keep its error yourself if
    ///   you need it.
    /// - [`Endpoint::call`] itself does none of this work: a call without a hook costs the same.
    /// - The future `refresh` returns must be `Send`, even where the attempt's need not be (a
    ///   call on a `LocalSet`): it is boxed as the tower layer's hook is, out of the call's own
    ///   future, so that a call that never refreshes does not carry it. Hold no `Rc` or
    ///   `RefCell` guard across its awaits.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// # let yaml = &b"version: 1\nendpoints:\n  users: {}\n"[..];
    /// # let agent = retryplane_agent::Agent::from_policies(
    /// #     retryplane_agent::policy::load(yaml).policies.unwrap());
    /// use std::sync::{Arc, Mutex};
    /// use retryplane_agent::CallMeta;
    ///
    /// let handle = agent.endpoint("users");
    /// let token = Arc::new(Mutex::new(String::from("expired")));
    /// let result = handle
    ///     .call_with_auth_refresh(
    ///         CallMeta::http("GET", "/v1/me"),
    ///         |_attempt| {
    ///             let token = token.lock().unwrap().clone();
    ///             async move {
    ///                 // Send the request with `Authorization: Bearer {token}` here.
    ///                 let status = if token == "expired" { 401 } else { 200 };
    ///                 http::Response::builder()
    ///                     .status(status)
    ///                     .body(())
    ///                     .map_err(std::io::Error::other)
    ///             }
    ///         },
    ///         |answer| matches!(answer, Ok(r) if r.status() == 401),
    ///         || {
    ///             let token = token.clone();
    ///             async move {
    ///                 // Fetch a new token here (an await in real code).
    ///                 *token.lock().unwrap() = String::from("fresh");
    ///                 true
    ///             }
    ///         },
    ///     )
    ///     .await;
    /// assert_eq!(result.ok().map(|r| r.status()), Some(http::StatusCode::OK));
    /// # }
    /// ```
    pub fn call_with_auth_refresh<T, E, F, Fut, W, R, RFut>(
        &self,
        meta: CallMeta<'_>,
        attempt: F,
        wants_refresh: W,
        refresh: R,
    ) -> impl Future<Output = Result<T, CallError<T, E>>>
    where
        T: Classify,
        E: Classify,
        F: FnMut(AttemptInfo) -> Fut,
        Fut: Future<Output = Result<T, E>>,
        W: Fn(&Result<T, E>) -> bool,
        R: FnMut() -> RFut,
        RFut: Future<Output = bool> + Send,
    {
        self.call_reauth(
            Now,
            meta,
            classify_result::<T, E>,
            attempt,
            FnReauth {
                wants: wants_refresh,
                refresh,
                used: false,
                _future: std::marker::PhantomData,
            },
            AlwaysReady,
            KeepAsIs,
        )
    }

    /// [`Endpoint::call_with`] with a once-only credential refresh: when `reauth` wants it,
    /// the answer of an attempt is put aside, the credentials are refreshed (within the
    /// deadline) and the attempt is sent again with a fresh per-try timeout. The engine sees
    /// one attempt (its number, breaker permit and counters), judged on the second answer;
    /// no budget is taken and no pause is slept. With [`Now`], the call begins now and reads
    /// the endpoint's entry then; with a [`Begun`] (the tower layer's, which reads the request
    /// body first), its deadline runs from when it began, it goes by the entry read then, and
    /// its first attempt starts now. [`NoReauth`] for no refresh.
    ///
    /// (An `async` block rather than an `async fn`: the arguments are kept once in the call's
    /// state, not once as arguments and again as locals.)
    #[allow(
        clippy::manual_async_fn,
        reason = "an async fn keeps its arguments twice in the call's state"
    )]
    #[allow(
        clippy::too_many_arguments,
        reason = "crate-private; each hook is a type parameter so that a call without it pays nothing"
    )]
    pub(crate) fn call_reauth<T, E, C, F, Fut, A, S, R, K>(
        &self,
        start: S,
        meta: CallMeta<'_>,
        mut classify: C,
        mut attempt: F,
        mut reauth: A,
        mut ready: R,
        mut keep: K,
    ) -> impl Future<Output = Result<T, CallError<T, E>>>
    where
        C: FnMut(&Result<T, E>) -> Classification,
        F: FnMut(AttemptInfo) -> Fut,
        Fut: Future<Output = Result<T, E>>,
        A: Reauth<T, E>,
        S: Start,
        R: Ready<E>,
        K: Keep<T>,
    {
        async move {
            // The call's start, from which its deadline runs, its first attempt's, and the one
            // read of the policies for this call.
            let (started, first_start, entry, route) = start.read(self);
            let (policy, runtime) = match route {
                // The tower layer's call, whose earlier steps matched its route.
                Some(route) => entry.resolve_at(route),
                None => entry.resolve(&meta.target()),
            };
            let (idempotent, has_idempotency_key) = meta.idempotency(policy);
            let info =
                CallInfo::new(idempotent, has_idempotency_key).with_replayable(meta.replayable());
            let mut rng = CallRng {
                shared: &self.shared,
                rng: None,
            };
            let mut first = FirstCounts {
                c: &self.core.counters,
                shared: &self.shared,
                name: &self.core.reported,
                version: entry.version,
                outlived: None,
                owed: OWE_CALL | OWE_END,
            };
            // Released on drop: a fatal result, a cancellation or a dropped call future hands
            // back the attempt's breaker permit, and, during a pause, the retry the budget
            // counted for the attempt that will not be sent.
            // Released when the call ends or its future is dropped (`RetryCall`'s `Drop`).
            let mut call = RetryCall::new(policy, &runtime.state, info, started);
            if let Some(within) = meta.within() {
                call.cap_deadline(within);
            }
            let cancel = meta.cancel_token();
            let mut last: Option<Last<T, E>> = None;
            let mut last_outcome: Option<Outcome> = None;
            let mut pause_before = None;
            // The first attempt starts when the call does (or, for a call that began earlier,
            // now); later ones after their pause.
            let mut now = first_start;

            let end = loop {
                // One attempt and its judgement, in a block: what it leaves (the answer, its
                // classification) is dead before the pause, so it takes no room in the call's
                // state while the call sleeps.
                let pause = {
                    // A token cancelled before the call began starts nothing: no attempt, no
                    // breaker permit, no request in the budget. (After a pause, the sleep
                    // below has already seen a cancellation.)
                    if let Some(cancel) = cancel
                        && cancel.is_cancelled()
                    {
                        break End::Fail(Cause::Cancelled, last, last_outcome);
                    }
                    // A retry waits for room below (the tower layer's inner service) before
                    // its attempt and its timer start, within the deadline, and not while the
                    // breaker would refuse it (see `crate::ready`). An error getting ready is
                    // the retry's failure, judged as an error of the send would be (a service
                    // that reports a failed connect from `poll_ready` has it retried).
                    let mut not_ready = None;
                    if pause_before.is_some() && ready.needed() {
                        let breaker = runtime.breaker_for(policy);
                        // The kept answer is looked after meanwhile, as in the pause: a body
                        // read to its end frees the connection the wait may be for.
                        let readied = {
                            let wait =
                                wait_ready(&mut ready, call.deadline(), || refuses_now(breaker));
                            let tended = tend(kept_response(&mut last), &mut keep);
                            match cancel {
                                None => tokio::select! {
                                    biased;
                                    r = wait => Some(r),
                                    () = tended => None,
                                },
                                Some(cancel) => tokio::select! {
                                    biased;
                                    () = cancel.cancelled() => None,
                                    r = wait => Some(r),
                                    () = tended => None,
                                },
                            }
                        };
                        // (`tended` never ends: only a cancellation gives `None`.)
                        let Some(readied) = readied else {
                            break End::Fail(Cause::Cancelled, last, last_outcome);
                        };
                        if let Readied::Failed(e) = readied {
                            not_ready = Some(e);
                        }
                        now = Instant::now();
                    }
                    // Refused already (see `CallMeta::refused`): no attempt, as when the
                    // engine refuses it.
                    if pause_before.is_none() && meta.was_refused() {
                        break End::Fail(Cause::GaveUp(GiveUpCause::CircuitOpen), last, None);
                    }
                    let plan = match call.start_attempt(now) {
                        Ok(plan) => plan,
                        Err(cause) => break End::Fail(Cause::GaveUp(cause), last, last_outcome),
                    };
                    if plan.number == 1 {
                        first.owed |= OWE_ATTEMPT;
                    } else {
                        first.settle();
                        let c = first.to();
                        Counters::inc(&c.attempts);
                        Counters::inc(&c.retries);
                        // The retry goes out: the kept answer lets go of what it holds. (Not
                        // before: a call the deadline or the breaker ends here returns it
                        // whole.)
                        if let Some(Last::Response(kept)) = &mut last {
                            keep.before_next(kept);
                        }
                    }
                    let info = AttemptInfo {
                        number: plan.number,
                        timeout: plan.timeout,
                        deadline: call.deadline(),
                        pause_before,
                    };
                    // `timeout` would read the clock again: the attempt starts at `now`.
                    let until = now
                        .checked_add(plan.timeout)
                        .unwrap_or_else(|| call.deadline());
                    // Whether the attempt waited (its per-try timer was armed): then its outcome
                    // came after `now`, and a success is counted when it came.
                    let mut waited = false;
                    let result = if let Some(e) = not_ready.take() {
                        Ok(Err(e))
                    } else {
                        let (fut, mut timer) = (pin!(attempt(info)), pin!(None));
                        let result = {
                            let run = per_try::Within::new(until, fut, timer.as_mut());
                            match cancel {
                                None => run.await,
                                Some(cancel) => tokio::select! {
                                    biased;
                                    () = cancel.cancelled() => break End::Fail(Cause::Cancelled, last, last_outcome),
                                    r = run => r,
                                },
                            }
                        };
                        waited = timer.is_some();
                        result
                    };
                    let result = match result {
                        Ok(first_answer) if reauth.wants(&first_answer) => {
                            waited = true;
                            // Boxed, the first answer with it: the refresh's state stays out of every
                            // call's future.
                            let resend = Box::pin(self.refresh_and_resend(
                                &mut reauth,
                                &mut ready,
                                &mut keep,
                                runtime.breaker_for(policy),
                                &mut attempt,
                                info,
                                call.policy().per_try_timeout,
                                cancel,
                                first_answer,
                            ))
                            .await;
                            match resend {
                                Resend::Cancelled => {
                                    break End::Fail(Cause::Cancelled, last, last_outcome);
                                }
                                Resend::Kept(r) => Ok(r),
                                Resend::Sent(r, given) => {
                                    if let Some(given) = given {
                                        call.resent_within(given);
                                    }
                                    r
                                }
                            }
                        }
                        other => other,
                    };
                    let (outcome, result) = match result {
                        Err(per_try::TimedOut) => (
                            Some(Outcome::Transport(retryplane_policy::ErrorClass::Timeout)),
                            None,
                        ),
                        Ok(r) => match (classify(&r), r) {
                            // A success, answer or error: an error classified as one cannot be
                            // returned as a value, so it comes back as it is, in the call's
                            // error, but it counts as the success it is: for the breaker (a
                            // half-open probe answered so closes it, rather than being handed
                            // back as if the attempt said nothing), the counters and the log.
                            (Classification::Success, r) => {
                                // Tell the breaker about the success through the engine, when
                                // it came: at the attempt's start when the attempt answered at
                                // its first poll (one clock read less on every such call), else
                                // now (a slow success must not leave the breaker's window
                                // early, while the failures after it are still in it).
                                // Worked out in each success arm: once before the match, for
                                // both arms and the failure path, measured 7-12 ns slower per
                                // call (BENCHMARKS.md, 2026-12-04 20:03).
                                let at = if waited { Instant::now() } else { now };
                                call.on_outcome(success(), at, &mut rng);
                                count_success(&mut first, plan.number);
                                if tracing::enabled!(tracing::Level::DEBUG) {
                                    let end = Instant::now();
                                    self.debug_attempt(plan.number, &"success", None, &call, end);
                                }
                                break match r {
                                    Ok(t) => End::Ok(t),
                                    Err(e) => End::OkErr(e),
                                };
                            }
                            // An answer whose outcome is a success (HTTP below 400, gRPC `OK`):
                            // the engine returns it at once whatever the policy, so it takes the
                            // same path, without the clock read and the moves of a failure.
                            (Classification::Outcome(o), Ok(t)) if o.is_success() => {
                                if let Outcome::Http {
                                    retry_after: Some(Err(e)),
                                    ..
                                } = &o
                                {
                                    log_bad_hint(&self.core.reported, e);
                                }
                                if tracing::enabled!(tracing::Level::DEBUG) {
                                    let end = Instant::now();
                                    let class = class_name(&o);
                                    self.debug_attempt(plan.number, &class, None, &call, end);
                                }
                                let at = if waited { Instant::now() } else { now };
                                call.on_outcome(o, at, &mut rng);
                                count_success(&mut first, plan.number);
                                break End::Ok(t);
                            }
                            (Classification::Outcome(o), r) => (Some(o), Some(r)),
                            (Classification::Fatal, r) => (None, Some(r)),
                        },
                    };
                    now = Instant::now();
                    last = Some(match result {
                        None => Last::TimedOut,
                        Some(Ok(t)) => Last::Response(t),
                        Some(Err(e)) => Last::Error(e),
                    });
                    let Some(outcome) = outcome else {
                        self.debug_attempt(plan.number, &"fatal", None, &call, now);
                        break End::Fail(Cause::GaveUp(GiveUpCause::NotRetryable), last, None);
                    };
                    if let Outcome::Http {
                        retry_after: Some(Err(e)),
                        ..
                    } = &outcome
                    {
                        log_bad_hint(&self.core.reported, e);
                    }
                    let class = class_name(&outcome);
                    match call.on_outcome(outcome.clone(), now, &mut rng) {
                        Decision::Return => {
                            self.debug_attempt(plan.number, &class, None, &call, now);
                            match last {
                                Some(Last::Response(t)) => {
                                    count_success(&mut first, plan.number);
                                    break End::Ok(t);
                                }
                                other => {
                                    break End::Fail(
                                        Cause::GaveUp(GiveUpCause::NotRetryable),
                                        other,
                                        Some(outcome),
                                    );
                                }
                            }
                        }
                        Decision::GiveUp(cause) => {
                            self.debug_attempt(plan.number, &class, None, &call, now);
                            break End::Fail(Cause::GaveUp(cause), last, Some(outcome));
                        }
                        Decision::Retry { pause, hinted } => {
                            self.debug_attempt(plan.number, &class, Some(pause), &call, now);
                            if hinted {
                                Counters::inc(&first.to().retry_after_honored);
                            }
                            last_outcome = Some(outcome);
                            pause_before = Some(pause);
                            pause
                        }
                    }
                };
                // Counts the time paused when the pause ends, is cancelled or is dropped.
                let _paused = Paused {
                    counts: &mut first,
                    from: now,
                    pause,
                };
                // The kept answer is looked after meanwhile (see `Keep`); that never ends the
                // pause.
                let cancelled = {
                    let tended = tend(kept_response(&mut last), &mut keep);
                    match cancel {
                        None => tokio::select! {
                            biased;
                            () = tokio::time::sleep(pause) => false,
                            () = tended => false,
                        },
                        Some(cancel) => tokio::select! {
                            biased;
                            () = cancel.cancelled() => true,
                            () = tokio::time::sleep(pause) => false,
                            () = tended => false,
                        },
                    }
                };
                if cancelled {
                    break End::Fail(Cause::Cancelled, last, last_outcome);
                }
                now = Instant::now();
            };

            // A call that did not succeed at its first attempt is counted in full.
            first.settle();
            let attempts = call.attempts();
            match end {
                End::Ok(t) => Ok(t),
                End::OkErr(e) => Err(CallError {
                    cause: Cause::Succeeded,
                    last: Some(Last::Error(e)),
                    attempts,
                    class: None,
                }),
                End::Fail(cause, last, outcome) => {
                    let Cause::GaveUp(g) = cause else {
                        // Counted `cancelled` as `first` drops, like a dropped call.
                        debug!(endpoint = %LogValue(&self.core.reported), attempts, "call cancelled");
                        return Err(CallError {
                            cause,
                            last,
                            attempts,
                            class: outcome.as_ref().map(LastClass::of),
                        });
                    };
                    first.ended();
                    first.to().gave_up(g);
                    let class = outcome.as_ref().map_or_else(
                        || match &last {
                            Some(Last::TimedOut) => "timeout".to_owned(),
                            Some(_) => "fatal".to_owned(),
                            None => "none".to_owned(),
                        },
                        |o| class_name(o).to_string(),
                    );
                    let end = Instant::now();
                    let duration_ms = end.duration_since(started).as_millis() as u64;
                    // An open breaker refuses calls at the callers' rate: one warn line per
                    // endpoint per second for those, the others at debug.
                    let refused = g == GiveUpCause::CircuitOpen && attempts == 0;
                    // `quiet`: refusals since the last line, for a refusal (a field left out
                    // of any other line: tracing records no `None`).
                    let quiet = match refused.then(|| runtime.refusal_line(end)) {
                        Some(None) => {
                            debug!(
                                endpoint = %LogValue(&self.core.reported),
                                method = meta.method(),
                                path = meta.path(),
                                "call refused: circuit open"
                            );
                            None
                        }
                        Some(Some(quiet)) => Some(Some(quiet)),
                        None => Some(None),
                    };
                    if let Some(quiet) = quiet {
                        warn!(
                            endpoint = %LogValue(&self.core.reported),
                            method = meta.method(),
                            path = meta.path(),
                            attempts,
                            class = %class,
                            cause = %cause,
                            duration_ms,
                            refused_since_last_line = quiet,
                            // Only on a call whose request could not be sent again (the
                            // layer's body over its limit) and was sent: why a failure the
                            // policy retries was not.
                            replayable = (!meta.replayable() && attempts > 0).then_some(false),
                            "call failed"
                        );
                    }
                    Err(CallError {
                        cause,
                        last,
                        attempts,
                        class: outcome.as_ref().map(LastClass::of),
                    })
                }
            }
        }
    }

    /// The once-only credential refresh of [`Endpoint::call_reauth`]: refreshes within what is
    /// left of the deadline, then sends the attempt `info` again with a fresh per-try timeout.
    /// A failed or late refresh keeps the first answer, and so does a breaker that is open
    /// by the time the second send is ready to go.
    #[allow(
        clippy::too_many_arguments,
        reason = "a step of `call_reauth`, which hands it its state"
    )]
    async fn refresh_and_resend<T, E, F, Fut, A, R, K>(
        &self,
        reauth: &mut A,
        ready: &mut R,
        keep: &mut K,
        breaker: Option<&CircuitBreaker>,
        attempt: &mut F,
        info: AttemptInfo,
        per_try_timeout: std::time::Duration,
        cancel: Option<&CancellationToken>,
        mut first_answer: Result<T, E>,
    ) -> Resend<T, E>
    where
        F: FnMut(AttemptInfo) -> Fut,
        Fut: Future<Output = Result<T, E>>,
        A: Reauth<T, E>,
        R: Ready<E>,
        K: Keep<T>,
    {
        // `first_answer`, kept until the second send goes out (it stands if none does), is
        // looked after meanwhile, as a kept failure is in a pause (see `Keep`).
        let cancelled = async {
            match cancel {
                Some(cancel) => cancel.cancelled().await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(cancelled);
        let left = info.deadline.saturating_duration_since(Instant::now());
        let refreshed = {
            let tended = tend(first_answer.as_mut().ok(), keep);
            tokio::select! {
                biased;
                () = &mut cancelled => None,
                r = tokio::time::timeout(left, reauth.refresh()) => Some(r.unwrap_or(false)),
                () = tended => None,
            }
        };
        let Some(refreshed) = refreshed else {
            return Resend::Cancelled;
        };
        // The second send waits for room below before its timer starts, as a retry does. It
        // keeps its attempt's breaker permit (a half-open probe: its own probe must not stop
        // it), so it is held back only while the breaker is open (it opened, or reopened,
        // since the first send): the first answer then stands. An error getting ready is the
        // second send's failure.
        if refreshed && ready.needed() {
            let readied = {
                let tended = tend(first_answer.as_mut().ok(), keep);
                tokio::select! {
                    biased;
                    () = &mut cancelled => None,
                    r = wait_ready(ready, info.deadline, || open_now(breaker)) => Some(r),
                    () = tended => None,
                }
            };
            let Some(readied) = readied else {
                return Resend::Cancelled;
            };
            match readied {
                Readied::Ready | Readied::Late => {}
                Readied::Refused => {
                    debug!(
                        endpoint = %LogValue(&self.core.reported),
                        attempt = info.number,
                        class = "refresh_wanted",
                        "credentials refreshed, not sent again: the circuit is open; the answer stands"
                    );
                    return Resend::Kept(first_answer);
                }
                Readied::Failed(e) => return Resend::Sent(Ok(Err(e)), None),
            }
        }
        let left = info.deadline.saturating_duration_since(Instant::now());
        // The first send of the attempt, logged like an attempt: its answer asked for a refresh.
        if !refreshed || left.is_zero() {
            debug!(
                endpoint = %LogValue(&self.core.reported),
                attempt = info.number,
                class = "refresh_wanted",
                deadline_left_ms = left.as_millis() as u64,
                "credentials not refreshed, the answer stands"
            );
            return Resend::Kept(first_answer);
        }
        debug!(
            endpoint = %LogValue(&self.core.reported),
            attempt = info.number,
            class = "refresh_wanted",
            deadline_left_ms = left.as_millis() as u64,
            "credentials refreshed, sending again"
        );
        let info = AttemptInfo {
            timeout: per_try_timeout.min(left),
            ..info
        };
        drop(first_answer);
        let until = Instant::now()
            .checked_add(info.timeout)
            .unwrap_or(info.deadline);
        let (fut, timer) = (pin!(attempt(info)), pin!(None));
        let run = per_try::Within::new(until, fut, timer);
        tokio::select! {
            biased;
            () = &mut cancelled => Resend::Cancelled,
            r = run => Resend::Sent(r, Some(info.timeout)),
        }
    }

    fn debug_attempt(
        &self,
        attempt: u32,
        class: &dyn std::fmt::Display,
        pause: Option<std::time::Duration>,
        call: &RetryCall<'_>,
        now: Instant,
    ) {
        debug!(
            endpoint = %LogValue(&self.core.reported),
            attempt,
            class = %class,
            pause_ms = pause.map(|p| p.as_millis() as u64),
            deadline_left_ms = call.deadline().saturating_duration_since(now).as_millis() as u64,
            "attempt"
        );
    }
}

/// A logical call begun by [`Endpoint::begin`]: when, and the endpoint's entry read then.
/// Everything the call does before its attempts (the tower layer's body read and
/// de-duplication) and the attempts themselves ([`Endpoint::call_reauth`]) go by this entry.
pub(crate) struct Begun {
    at: Instant,
    entry: Arc<Entry>,
    /// The route the call's target takes in `entry` ([`Entry::route_of`]), once a step has
    /// asked ([`UNRESOLVED`] until then): the steps of one call all ask for the same target
    /// (its method and path do not change), and matching it again at each took about 7 % of
    /// the layer's instructions (BENCHMARKS.md, "Agent: the tower layer").
    route: AtomicUsize,
}

/// [`Begun::route`] before any step asked.
const UNRESOLVED: usize = usize::MAX;

impl Begun {
    /// When a call described by `meta` must be over: what its [`AttemptInfo::deadline`] will
    /// say (the policy's deadline or the caller's shorter one, [`CallMeta::deadline_within`],
    /// computed as the engine does, [`retryplane_policy::engine::deadline_at`]).
    pub(crate) fn deadline(&self, meta: &CallMeta<'_>) -> Instant {
        let (policy, _) = self.resolve(meta);
        let within = meta
            .within()
            .map_or(policy.deadline, |w| w.min(policy.deadline));
        retryplane_policy::engine::deadline_at(self.at, within)
    }

    /// When the call began: its deadline and the caller's run from there.
    pub(crate) fn at(&self) -> Instant {
        self.at
    }

    /// The policy of the call described by `meta` and the endpoint's state, its route matched
    /// at the first ask only. Every step of a call describes it alike (see [`Begun::route`]).
    fn resolve(&self, meta: &CallMeta<'_>) -> (&RetryPolicy, &Runtime) {
        self.entry.resolve_at(self.route_of(meta))
    }

    /// [`Begun::route`], matched now if no step has asked yet.
    fn route_of(&self, meta: &CallMeta<'_>) -> usize {
        match self.route.load(Ordering::Relaxed) {
            UNRESOLVED => {
                let route = self.entry.route_of(&meta.target());
                self.route.store(route, Ordering::Relaxed);
                route
            }
            route => route,
        }
    }

    /// What decides whether an answer to a call described by `meta` (an HTTP status, a gRPC
    /// code) may be retried, if one ever may: the call is idempotent or carries the idempotency
    /// key, and can be replayed; `None` otherwise (only a failed connect is retried then).
    pub(crate) fn retry_rules(&self, meta: &CallMeta<'_>) -> Option<RetryRules> {
        let (policy, _) = self.resolve(meta);
        let (idempotent, keyed) = meta.idempotency(policy);
        let info = CallInfo::new(idempotent, keyed).with_replayable(meta.replayable());
        ((idempotent || keyed) && meta.replayable()).then(|| RetryRules::new(policy, info))
    }

    /// The endpoint's breaker, if the policy for a call described by `meta` uses it: what may
    /// refuse the call's attempts ([`CircuitBreaker::would_refuse`] asks without taking a
    /// probe).
    pub(crate) fn breaker(&self, meta: &CallMeta<'_>) -> Option<&CircuitBreaker> {
        let (policy, runtime) = self.resolve(meta);
        runtime.breaker_for(policy)
    }

    /// Whether a call described by `meta` is idempotent: its method listed for its route, or
    /// declared so (the idempotency key does not count).
    pub(crate) fn is_idempotent(&self, meta: &CallMeta<'_>) -> bool {
        let (policy, _) = self.resolve(meta);
        meta.idempotency(policy).0
    }
}

/// How [`Endpoint::call_reauth`] learns when its call began and which entry it goes by.
pub(crate) trait Start {
    /// The call's start (its deadline runs from there), its first attempt's start, the
    /// endpoint's entry the call holds from start to end, and the route its target takes in
    /// that entry when already known ([`Entry::route_of`]).
    fn read(self, endpoint: &Endpoint) -> (Instant, Instant, Arc<Entry>, Option<usize>);
}

/// A call that begins when its future first runs: one clock read for both starts, and the
/// entry read then. (A type of its own rather than an `Option<Begun>`: the calls made with
/// [`Endpoint::call`] keep nothing for it in their state and take no branch.)
pub(crate) struct Now;

impl Start for Now {
    #[inline]
    fn read(self, endpoint: &Endpoint) -> (Instant, Instant, Arc<Entry>, Option<usize>) {
        let now = Instant::now();
        (now, now, endpoint.entry(), None)
    }
}

impl Start for Begun {
    fn read(self, _: &Endpoint) -> (Instant, Instant, Arc<Entry>, Option<usize>) {
        let route = Some(self.route.into_inner()).filter(|&r| r != UNRESOLVED);
        (self.at, Instant::now().max(self.at), self.entry, route)
    }
}

/// What [`Endpoint::refresh_and_resend`] did.
enum Resend<T, E> {
    /// The call was cancelled meanwhile.
    Cancelled,
    /// Not sent again (the refresh failed, the deadline passed, or the breaker is open now):
    /// the first answer stands.
    Kept(Result<T, E>),
    /// The second answer (or the error getting ready to send it), or its per-try timeout; and
    /// the time the second send was given, when it was sent.
    Sent(Result<Result<T, E>, per_try::TimedOut>, Option<Duration>),
}

/// What a call does with the failed answer it keeps (its last result, returned if the call
/// ends before a later attempt answers) between attempts: the tower layer reads on the body
/// of an answer it could not read whole within its attempt, and lets go of what is still
/// unread when the next attempt starts, so that the kept answer does not hold a connection or
/// an HTTP/2 stream the retry needs.
pub(crate) trait Keep<T> {
    /// Polled while the call waits with `kept`: its pause, the next attempt's wait for room
    /// below, a credential refresh before the same attempt is sent again. Whatever it does,
    /// the wait runs as it would without it.
    fn poll_paused(&mut self, kept: &mut T, cx: &mut std::task::Context<'_>);
    /// Called as the next attempt starts, once the engine has started it (a call the deadline
    /// or the breaker ends first returns the answer as it is).
    fn before_next(&mut self, kept: &mut T);
}

/// Looks after `kept` (see [`Keep`]) for as long as it is polled; never ends. Nothing to do
/// without an answer.
fn tend<'a, T, K: Keep<T>>(
    mut kept: Option<&'a mut T>,
    keep: &'a mut K,
) -> impl Future<Output = ()> + 'a {
    std::future::poll_fn(move |cx| {
        if let Some(kept) = kept.as_deref_mut() {
            keep.poll_paused(kept, cx);
        }
        std::task::Poll::Pending
    })
}

/// The answer a call keeps, when its last result is one.
fn kept_response<T, E>(last: &mut Option<Last<T, E>>) -> Option<&mut T> {
    match last {
        Some(Last::Response(t)) => Some(t),
        _ => None,
    }
}

/// Keeps an answer as it is: [`Endpoint::call`]'s answers are the caller's own values.
pub(crate) struct KeepAsIs;

impl<T> Keep<T> for KeepAsIs {
    #[inline]
    fn poll_paused(&mut self, _: &mut T, _: &mut std::task::Context<'_>) {}

    #[inline]
    fn before_next(&mut self, _: &mut T) {}
}

/// A once-only step between an attempt's answer and the policy's judgement of it: an answer
/// that asks for fresh credentials (an HTTP 401) has them refreshed and the attempt sent again.
pub(crate) trait Reauth<T, E> {
    /// Whether `result` asks for a refresh that has not been made yet in this call.
    fn wants(&self, result: &Result<T, E>) -> bool;
    /// Refreshes the credentials of the request; `true` when it may be sent again. (Boxed: an
    /// `impl Future` here defeats the `Send` proof of the layer's future; it runs once a call.)
    fn refresh(&mut self) -> Pin<Box<dyn Future<Output = bool> + Send + '_>>;
}

/// No refresh: every answer is judged as it is.
pub(crate) struct NoReauth;

impl<T, E, R: Reauth<T, E>> Reauth<T, E> for &mut R {
    fn wants(&self, result: &Result<T, E>) -> bool {
        (**self).wants(result)
    }

    fn refresh(&mut self) -> Pin<Box<dyn Future<Output = bool> + Send + '_>> {
        (**self).refresh()
    }
}

impl<T, E> Reauth<T, E> for NoReauth {
    fn wants(&self, _: &Result<T, E>) -> bool {
        false
    }

    fn refresh(&mut self) -> Pin<Box<dyn Future<Output = bool> + Send + '_>> {
        Box::pin(std::future::ready(false))
    }
}

/// The refresh of [`Endpoint::call_with_auth_refresh`]: two closures, used once. (`RFut` is a
/// parameter so that a borrow of this outlives the future it boxes.)
struct FnReauth<W, R, RFut> {
    wants: W,
    refresh: R,
    used: bool,
    _future: std::marker::PhantomData<fn() -> RFut>,
}

impl<T, E, W, R, RFut> Reauth<T, E> for FnReauth<W, R, RFut>
where
    W: Fn(&Result<T, E>) -> bool,
    R: FnMut() -> RFut,
    RFut: Future<Output = bool> + Send,
{
    fn wants(&self, result: &Result<T, E>) -> bool {
        !self.used && (self.wants)(result)
    }

    fn refresh(&mut self) -> Pin<Box<dyn Future<Output = bool> + Send + '_>> {
        self.used = true;
        Box::pin((self.refresh)())
    }
}

/// The call's generator, made on first use: a call that never draws a pause does not touch
/// the agent's call counter (shared by every thread).
struct CallRng<'a> {
    shared: &'a Shared,
    rng: Option<SeededRng>,
}

impl Rng for CallRng<'_> {
    fn next_u64(&mut self) -> u64 {
        self.rng
            .get_or_insert_with(|| self.shared.call_rng())
            .next_u64()
    }
}

/// An outcome the engine reads as a success (for the breaker's count).
fn success() -> Outcome {
    Outcome::Grpc {
        code: retryplane_policy::codes::GrpcCode::Ok,
        pushback: None,
    }
}

/// `calls` is owed.
const OWE_CALL: u8 = 1;
/// `attempts` (for the first attempt) is owed.
const OWE_ATTEMPT: u8 = 2;
/// The call has no outcome yet: dropped so, it is counted `cancelled`.
const OWE_END: u8 = 4;

/// Where a call counts ([`FirstCounts::to`]), and the counts of its start (`calls`, and
/// `attempts` once its first attempt starts), held back until its second attempt starts or it
/// ends: a call that succeeds at once is counted by [`Counters::first_try_success`] alone (one
/// atomic add instead of three; the registry adds it back into `calls` and `attempts`). Any
/// other call pays what it owes with [`FirstCounts::settle`], or when it is dropped (a call
/// future dropped mid-call is counted). A call is counted in one outcome; one whose future is
/// dropped before it has one (its caller gave up on it) is counted `cancelled` then, as is one
/// its cancellation token ended.
struct FirstCounts<'a> {
    /// The endpoint's counters.
    c: &'a Counters,
    shared: &'a Shared,
    name: &'a Arc<str>,
    /// The version of the policies the call runs on.
    version: u64,
    /// Once those are no longer in force: their counters for calls that outlived them.
    outlived: Option<Arc<Counters>>,
    owed: u8,
}

impl FirstCounts<'_> {
    /// The counters the call counts in now: the endpoint's while the policies it runs on are
    /// in force (or about to be replaced: see [`Shared::announce`]), else, from then to its
    /// end, their version's counters for calls that outlived them
    /// ([`crate::metrics::Registry::outlived`]), so that every count of the call is reported
    /// under the version it ran (SPEC §2: a call reads the policy once). One relaxed load on
    /// the call path.
    #[inline]
    fn to(&mut self) -> &Counters {
        if self.outlived.is_none() && self.shared.version_in_force() == self.version {
            return self.c;
        }
        self.outlived_counters()
    }

    #[cold]
    #[inline(never)]
    fn outlived_counters(&mut self) -> &Counters {
        self.outlived
            .get_or_insert_with(|| self.shared.metrics.outlived(self.version, self.name))
    }

    /// Counts the start that is owed (`calls`, the first attempt), once; the outcome stays
    /// owed.
    fn settle(&mut self) {
        if self.owed & (OWE_CALL | OWE_ATTEMPT) != 0 {
            let owed = self.owed;
            let c = self.to();
            if owed & OWE_CALL != 0 {
                Counters::inc(&c.calls);
            }
            if owed & OWE_ATTEMPT != 0 {
                Counters::inc(&c.attempts);
            }
        }
        self.owed &= OWE_END;
    }

    /// The call ended with an outcome counted elsewhere (a success, a give-up, a refusal).
    fn ended(&mut self) {
        self.owed &= !OWE_END;
    }
}

impl Drop for FirstCounts<'_> {
    fn drop(&mut self) {
        let cancelled = self.owed & OWE_END != 0;
        self.settle();
        if cancelled {
            Counters::inc(&self.to().cancelled);
        }
    }
}

fn count_success(first: &mut FirstCounts<'_>, attempt: u32) {
    if attempt == 1 {
        // Nothing was settled yet (that happens when a second attempt starts or the call
        // fails): the call and its attempt are counted by `success_first_try`.
        debug_assert_eq!(first.owed, OWE_CALL | OWE_ATTEMPT | OWE_END);
        first.owed = 0;
        first.to().first_try_success();
    } else {
        first.ended();
        Counters::inc(&first.to().success_after_retry);
    }
}

fn log_bad_hint(endpoint: &str, e: &RetryAfterError) {
    // The error never carries the header value.
    debug!(endpoint = %LogValue(endpoint), error = %e, "malformed Retry-After ignored");
}

/// How a call's answer or error counts: each side by its own [`Classify`].
fn classify_result<T: Classify, E: Classify>(r: &Result<T, E>) -> Classification {
    match r {
        Ok(t) => t.classify(),
        Err(e) => e.classify(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Agent;
    use retryplane_policy::Target;

    fn set(max_attempts: u32) -> retryplane_policy::PolicySet {
        let yaml = format!("version: 1\nendpoints:\n  a: {{max_attempts: {max_attempts}}}\n");
        retryplane_policy::load(yaml.as_bytes()).policies.unwrap()
    }

    fn max_attempts(entry: &Entry) -> u32 {
        entry.resolve(&Target::Endpoint).0.max_attempts
    }

    #[test]
    fn the_kept_entry_is_reused_until_a_swap_then_looked_up_again() {
        let agent = Agent::from_policies_seeded(set(2), 1);
        let ep = agent.endpoint("a");
        let first = ep.entry();
        assert!(
            Arc::ptr_eq(&first, &ep.entry()),
            "kept, not looked up again"
        );
        assert!(
            Arc::ptr_eq(&first, &ep.clone().entry()),
            "clones share what is kept"
        );
        agent.set_policies(set(3));
        let second = ep.entry();
        assert_eq!((max_attempts(&first), max_attempts(&second)), (2, 3));
        assert!(Arc::ptr_eq(&second, &agent.policies().entry("a")));
        assert!(Arc::ptr_eq(&second, &ep.entry()));
    }

    #[test]
    fn handles_made_again_by_name_share_one_kept_entry() {
        let agent = Agent::from_policies_seeded(set(2), 1);
        // `b` is not in the set: each lookup of it builds a new entry on the defaults, so
        // only a kept one is the same `Arc`.
        let mut held = Vec::new();
        for name in ["a", "b"] {
            let first = agent.endpoint(name).entry();
            let again = agent.endpoint(name);
            assert!(
                Arc::ptr_eq(&first, &again.entry()),
                "{name}: a new handle takes the entry an earlier one kept"
            );
            assert!(
                Arc::ptr_eq(&first, &agent.clone().endpoint(name).entry()),
                "{name}: so does one made from a clone of the agent"
            );
            agent.set_policies(set(3));
            let second = agent.endpoint(name).entry();
            assert!(!Arc::ptr_eq(&first, &second), "{name}: looked up again");
            assert!(Arc::ptr_eq(&second, &again.entry()), "{name}: and kept");
            held.push(again);
        }
        assert_eq!(
            agent.shared().cores.map.read().unwrap().len(),
            2,
            "one core per name held"
        );
        let other = Agent::from_policies_seeded(set(2), 1);
        assert!(
            !Arc::ptr_eq(&agent.endpoint("a").core, &other.endpoint("a").core),
            "another agent has cores of its own"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_the_breaker_refused_already_makes_no_attempt_whatever_it_says_later() {
        let yaml = "version: 1\nendpoints:\n  a:\n    max_attempts: 3\n    circuit_breaker: {}\n";
        let set = retryplane_policy::load(yaml.as_bytes()).policies.unwrap();
        let agent = Agent::from_policies_seeded(set, 1);
        let ep = agent.endpoint("a");
        let begun = ep.begin();
        let meta = CallMeta::http("POST", "/upload").not_replayable();
        // The breaker is closed now: only the refusal already made stops the call.
        assert!(begun.breaker(&meta).is_some_and(CircuitBreaker::is_closed));
        let sent = std::sync::atomic::AtomicU32::new(0);
        let result: Result<(), CallError<(), &str>> = ep
            .call_reauth(
                begun,
                meta.refused(),
                |_: &Result<(), &str>| Classification::Outcome(success()),
                |_| {
                    sent.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    std::future::ready(Ok(()))
                },
                NoReauth,
                crate::ready::AlwaysReady,
                KeepAsIs,
            )
            .await;
        let err = result.unwrap_err();
        assert_eq!(err.cause, Cause::GaveUp(GiveUpCause::CircuitOpen));
        assert!(err.last.is_none());
        assert_eq!(err.attempts, 0);
        assert_eq!(sent.into_inner(), 0);
        let counts = ep.pending_counts();
        assert_eq!((counts.circuit_open, counts.attempts), (1, 0));
    }

    /// A call begun by the tower layer matches its route at its first step and keeps it: its
    /// later steps and its attempts run under that route's policy, as they would matching it
    /// again.
    #[tokio::test(start_paused = true)]
    async fn a_begun_call_keeps_the_route_its_first_step_matched() {
        let yaml = "version: 1\nendpoints:\n  a:\n    max_attempts: 2\n    routes:\n      - match: {path_prefix: /v1/other}\n        max_attempts: 5\n      - match: {path_prefix: /v1/charges}\n        max_attempts: 4\n        deadline: 3s\n";
        let set = retryplane_policy::load(yaml.as_bytes()).policies.unwrap();
        let agent = Agent::from_policies_seeded(set, 1);
        let ep = agent.endpoint("a");
        for (path, route, attempts) in [("/v1/charges/9", 1, 4), ("/v2/x", 2, 2)] {
            let begun = ep.begin();
            let meta = CallMeta::http("GET", path);
            assert_eq!(begun.route.load(Ordering::Relaxed), UNRESOLVED);
            let deadline = begun.deadline(&meta);
            assert_eq!(begun.route.load(Ordering::Relaxed), route, "{path}");
            let (policy, _) = begun.entry.resolve(&meta.target());
            assert_eq!(deadline, begun.at() + policy.deadline, "{path}");
            assert_eq!(begun.resolve(&meta).0.max_attempts, attempts, "{path}");
            let sent = std::sync::atomic::AtomicU32::new(0);
            let result: Result<(), CallError<(), &str>> = ep
                .call_reauth(
                    begun,
                    meta,
                    |_: &Result<(), &str>| {
                        Classification::Outcome(Outcome::Http {
                            status: 503,
                            retry_after: None,
                        })
                    },
                    |_| {
                        sent.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        std::future::ready(Err("503"))
                    },
                    NoReauth,
                    crate::ready::AlwaysReady,
                    KeepAsIs,
                )
                .await;
            assert!(result.is_err());
            assert_eq!(sent.into_inner(), attempts, "{path}");
        }
    }

    /// Puts `set` in force as version `version` of the control plane's policies, as a push
    /// does (`crate::stream::apply`).
    fn push(agent: &Agent, version: u64, set: retryplane_policy::PolicySet) {
        agent.shared().update_policies(|current| {
            crate::snapshot::PolicySnapshot::build(
                set,
                version,
                String::new(),
                crate::snapshot::Source::ControlPlane,
                Some(current),
            )
        });
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_that_outlived_the_policies_it_ran_on_is_in_its_endpoints_pending_counts() {
        let agent = Agent::from_policies_seeded(set(2), 1);
        push(&agent, 1, set(2));
        let ep = agent.endpoint("a");
        let mut sent = 0;
        // Version 2 comes while the call's first attempt is out: the call runs on version 1
        // to its end (two attempts, both 503).
        let result: Result<(), CallError<(), ()>> = ep
            .call_with(
                CallMeta::http("GET", "/"),
                |_: &Result<(), ()>| {
                    Classification::Outcome(Outcome::Http {
                        status: 503,
                        retry_after: None,
                    })
                },
                |_| {
                    sent += 1;
                    if sent == 1 {
                        push(&agent, 2, set(2));
                    }
                    std::future::ready(Ok(()))
                },
            )
            .await;
        assert_eq!(result.unwrap_err().attempts, 2);
        assert_eq!(agent.policies().version(), 2);
        // Not reported yet (this agent has no control plane): the endpoint's counts not yet
        // sent to the control plane hold the call, as they hold every other call.
        let c = ep.pending_counts();
        assert_eq!(
            (c.calls, c.attempts, c.retries, c.gave_up_attempts),
            (1, 2, 1, 1),
            "the call is missing from `pending_counts`: {c:?}"
        );
    }

    #[test]
    fn an_entry_looked_up_during_a_swap_is_looked_up_again_after_it() {
        let agent = Agent::from_policies_seeded(set(2), 1);
        let ep = agent.endpoint("a");
        // A call read the generation, then the swap happened, then it loaded the snapshot:
        // the newer entry is kept under the older generation.
        let before = agent.shared().generation();
        agent.set_policies(set(3));
        let looked_up = ep.refresh_entry(before);
        assert_eq!(max_attempts(&looked_up), 3);
        // The next call does not trust it, and ends up with the same (current) entry.
        assert_ne!(agent.shared().generation(), before);
        let next = ep.entry();
        assert_eq!(max_attempts(&next), 3);
        assert!(Arc::ptr_eq(&next, &agent.policies().entry("a")));
        let kept = ep.core.cache.load();
        assert_eq!(
            kept.as_ref().map(|c| c.generation),
            Some(agent.shared().generation()),
            "kept under the generation it belongs to"
        );
    }
}
