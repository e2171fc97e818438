//! The policies an agent runs: one immutable [`PolicySnapshot`] behind the agent's `ArcSwap`.
//!
//! A snapshot is the compiled [`PolicySet`] with its version and content hash, plus the runtime
//! state of every endpoint (its [`EndpointState`]: retry budget and circuit breaker). When a new
//! snapshot replaces an old one, an endpoint keeps the state of whichever of its budget and
//! breaker kept its settings, so a push that changes `max_attempts`, or only the budget, does
//! not close a breaker that is open; a breaker whose settings changed stays open until the open
//! period it started ends (and opens when calls still on the old settings open the old one, as
//! the old one does, for the calls started before the change, when the new one opens),
//! and a budget whose settings changed takes over the calls and retries the old one counts (so
//! tightening a budget during a retry storm refuses at once). Endpoints the policies do not name run under the file's `defaults:`; their state is
//! created on first use, kept in one registry that every snapshot of the agent shares, and
//! carried over the same way.

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, RwLock};

use retryplane_policy::engine::EndpointState;
use retryplane_policy::{EndpointPolicy, PolicySet, RetryPolicy, Target};
use tokio::time::Instant;

/// Where a snapshot's policies came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// Pushed by the control plane on the stream.
    ControlPlane,
    /// Read from the cache file at start (or just after, when the disk answered late: see
    /// [`crate::AgentBuilder::cache_file`]). It stays so once the control plane is reached
    /// and finds the agent up to date (it sends nothing then): to know whether the agent is
    /// connected, ask [`crate::Agent::is_connected`], not the source.
    Cache,
    /// A policy file or a value given by the program ([`crate::Agent::from_file`],
    /// [`crate::Agent::from_policies`]).
    Static,
    /// Nothing yet: the [`fallback_policy`].
    Fallback,
}

/// The conservative policy an agent runs with neither a control plane nor a cache file: the
/// built-in values of SPEC §1 (deadline 15 s, per-try timeout 2 s, the default `retry_on`,
/// budget and circuit breaker on) except `max_attempts: 2`, so an agent that knows nothing
/// retries at most once per call. Its timeouts apply too: an attempt is cut at 2 s, so an
/// upstream slower than that fails every call until the control plane's policies (or a
/// cache file's) come; give such an agent a cache file, or a static policy.
pub fn fallback_policy() -> RetryPolicy {
    RetryPolicy {
        max_attempts: 2,
        ..RetryPolicy::default()
    }
}

/// An endpoint's shared runtime state (its budget and breaker, and the settings they were
/// built from).
#[derive(Debug)]
pub(crate) struct Runtime {
    pub(crate) state: EndpointState,
    /// Shared with the states made from this one (a push that changes the budget or breaker
    /// settings), so that the endpoint's limit on warn lines holds across pushes.
    refusals: Arc<RefusalLog>,
}

/// An endpoint's limit of one warn line per [`REFUSAL_LOG_EVERY`] for calls its open breaker
/// refuses.
#[derive(Debug)]
struct RefusalLog {
    /// When the last warn line for a call refused by the open breaker was written: 1 + ms
    /// since `created` (0: never).
    logged: AtomicU64,
    /// Refused calls logged at debug only since that line.
    quiet: AtomicU64,
    created: Instant,
}

impl RefusalLog {
    /// Whether a fresh log may stand in for it from `now` on: the last line is past its
    /// [`REFUSAL_LOG_EVERY`] and no refusal waits to be counted in the next line, or those
    /// that wait are over [`REFUSALS_UNSAID_FOR`] old (a line that came after that long would
    /// count them with another outage's; held for them, the state of an endpoint that is never
    /// called again would be kept for the agent's life).
    fn is_idle(&self, now: Instant) -> bool {
        let since = u64::try_from(now.saturating_duration_since(self.created).as_millis())
            .unwrap_or(u64::MAX - 1)
            + 1;
        let last = self.logged.load(Relaxed);
        let past = |after: std::time::Duration| {
            last == 0 || since >= last.saturating_add(after.as_millis() as u64)
        };
        if self.quiet.load(Relaxed) == 0 {
            past(REFUSAL_LOG_EVERY)
        } else {
            past(REFUSALS_UNSAID_FOR)
        }
    }
}

/// At most one warn line per endpoint per this long for calls refused by its open breaker: an
/// open breaker refuses every call at the caller's rate, and a line each would flood the log.
pub(crate) const REFUSAL_LOG_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// How long refusals logged at debug and not yet counted in a warn line keep an endpoint's
/// state that nothing holds (see `RefusalLog::is_idle`).
pub(crate) const REFUSALS_UNSAID_FOR: std::time::Duration = std::time::Duration::from_secs(60);

impl Runtime {
    /// The endpoint's breaker, if `policy` (resolved for a call, a route's included) uses it:
    /// what may refuse the call's attempts.
    pub(crate) fn breaker_for(
        &self,
        policy: &RetryPolicy,
    ) -> Option<&retryplane_policy::breaker::CircuitBreaker> {
        policy.circuit_breaker.as_ref().and(self.state.breaker())
    }

    fn new(policy: &RetryPolicy) -> Self {
        Self::with_state(EndpointState::new(policy, Instant::now()))
    }

    fn with_state(state: EndpointState) -> Self {
        Self {
            state,
            refusals: Arc::new(RefusalLog {
                logged: AtomicU64::new(0),
                quiet: AtomicU64::new(0),
                created: Instant::now(),
            }),
        }
    }

    /// A state made from `old`'s: its warn lines for refused calls go by `old`'s limit.
    fn following(old: &Runtime, state: EndpointState) -> Self {
        Self {
            state,
            refusals: old.refusals.clone(),
        }
    }

    /// For a call the open breaker refused at `now`: `Some(n)` when it gets a warn line (the
    /// first in [`REFUSAL_LOG_EVERY`]; `n` refusals since the last line were logged at debug
    /// only), `None` when it is logged at debug.
    pub(crate) fn refusal_line(&self, now: Instant) -> Option<u64> {
        let log = &*self.refusals;
        let at = u64::try_from(now.saturating_duration_since(log.created).as_millis())
            .unwrap_or(u64::MAX - 1)
            + 1;
        let last = log.logged.load(Relaxed);
        let every = REFUSAL_LOG_EVERY.as_millis() as u64;
        let due = last == 0 || at >= last.saturating_add(every);
        if due
            && log
                .logged
                .compare_exchange(last, at, Relaxed, Relaxed)
                .is_ok()
        {
            return Some(log.quiet.swap(0, Relaxed));
        }
        log.quiet.fetch_add(1, Relaxed);
        None
    }

    fn fits(&self, policy: &RetryPolicy) -> bool {
        self.state.fits(policy)
    }

    /// Whether nothing but the registry holds this state (no handle's kept entry, no call)
    /// and it counts nothing at `now`: its budget and breaker are idle, and its warn line for
    /// refused calls is over a [`REFUSAL_LOG_EVERY`] old with no refusal counted since. One
    /// made afresh on the next use is then the same.
    fn is_idle_and_unheld(self: &Arc<Self>, now: Instant) -> bool {
        Arc::strong_count(self) == 1 && self.state.is_idle(now) && self.refusals.is_idle(now)
    }

    /// `old` when its settings match `policy`; else a state for `policy` that keeps the part
    /// of `old` whose settings did not change (see [`EndpointState::carry`]); with no `old`, a
    /// fresh state.
    fn carry(old: Option<&Arc<Runtime>>, policy: &RetryPolicy) -> Arc<Runtime> {
        match old {
            Some(rt) if rt.fits(policy) => rt.clone(),
            Some(rt) => Arc::new(Runtime::following(
                rt,
                rt.state.carry(policy, Instant::now()),
            )),
            None => Arc::new(Runtime::new(policy)),
        }
    }
}

/// Endpoint names to their entries: foldhash with a fixed key, as [`PolicySet`]'s own map (the
/// names come from the policies and from the program, not from requests). SipHash cost about
/// 15 ns per call here.
type Map<V> = HashMap<Arc<str>, V, foldhash::fast::FixedState>;

/// Every endpoint's runtime state as the newest snapshot has it, shared by every snapshot of
/// one agent (each snapshot is built from the one before it and takes the same registry): the
/// states of endpoints the policies do not name, and the newest snapshot's own named entries.
///
/// Shared rather than copied into each new snapshot: a call that started on the outgoing
/// snapshot may first use an endpoint after the new snapshot was built, and a copy would miss
/// the state it creates, so the endpoint would run two budgets and breakers. Here a call on
/// any snapshot finds the newest snapshot's state of the endpoint (named there or not) as
/// long as it fits its own settings; a state that fits only an outgoing snapshot is made for
/// that call and not kept.
#[derive(Debug)]
struct States {
    inner: RwLock<StatesInner>,
}

#[derive(Debug)]
struct StatesInner {
    /// The `defaults:` of the newest snapshot: an unnamed state is kept only if it fits them.
    newest: Arc<RetryPolicy>,
    /// The states of endpoints the newest snapshot does not name.
    unnamed: Map<Arc<Runtime>>,
    /// The newest snapshot's entries of the endpoints it names (its own map, shared).
    named: Arc<Map<Arc<Entry>>>,
}

impl States {
    fn new(defaults: Arc<RetryPolicy>, named: Arc<Map<Arc<Entry>>>) -> Self {
        Self {
            inner: RwLock::new(StatesInner {
                newest: defaults,
                unnamed: Map::default(),
                named,
            }),
        }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, StatesInner> {
        self.inner.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, StatesInner> {
        self.inner.write().unwrap_or_else(|e| e.into_inner())
    }

    /// The state `name` has under `defaults` for a snapshot that does not name it: the newest
    /// snapshot's state of it when that fits `defaults`, else one created on first use and
    /// kept if it fits the newest snapshot's `defaults:` and that snapshot does not name it.
    fn runtime(&self, name: &str, defaults: &RetryPolicy) -> Arc<Runtime> {
        {
            let inner = self.read();
            if let Some(rt) = inner.newest_state(name)
                && rt.fits(defaults)
            {
                return rt.clone();
            }
        }
        let mut inner = self.write();
        if let Some(rt) = inner.newest_state(name)
            && rt.fits(defaults)
        {
            return rt.clone();
        }
        // A call on the newest snapshot gets the state kept for it; one on an outgoing
        // snapshot (it read the policies just before a push) a short-lived state behind the
        // newest, which counts what its calls do there.
        let kept = inner.newest.budget == defaults.budget
            && inner.newest.circuit_breaker == defaults.circuit_breaker
            && !inner.named.contains_key(name);
        if kept {
            let rt = Runtime::carry(inner.newest_state(name), defaults);
            inner.unnamed.insert(Arc::from(name), rt.clone());
            return rt;
        }
        // The newest snapshot's state first, kept, when its calls have not made one yet: the
        // straggler's runs behind it, not beside it.
        let newest = match inner.newest_state(name) {
            Some(newest) => newest.clone(),
            None => {
                let newest_defaults = inner.newest.clone();
                let newest = Runtime::carry(None, &newest_defaults);
                inner.unnamed.insert(Arc::from(name), newest.clone());
                newest
            }
        };
        Arc::new(Runtime::following(&newest, newest.state.behind(defaults)))
    }
}

impl StatesInner {
    /// Makes a new snapshot the newest: its `defaults:` and the states of the endpoints it
    /// names (`named`, carried from this registry under the same hold of its lock, see
    /// [`PolicySnapshot::build`]). Unnamed states whose endpoints it names are dropped (the
    /// named entries carried them), and so are unnamed states nothing else holds (no handle,
    /// no call) that count nothing: one made afresh on the next use is the same, and without
    /// this every endpoint name a push ever stopped naming was kept, and carried on every
    /// later push. The others, and the states of endpoints it no longer names, are kept under
    /// the new `defaults:`, as [`Runtime::carry`] keeps them.
    fn advance(&mut self, defaults: &Arc<RetryPolicy>, named: &Arc<Map<Arc<Entry>>>) {
        let now = Instant::now();
        let before = std::mem::replace(&mut self.named, named.clone());
        self.newest = defaults.clone();
        let unnamed = &mut self.unnamed;
        unnamed.retain(|name, rt| !named.contains_key(name) && !rt.is_idle_and_unheld(now));
        for rt in unnamed.values_mut() {
            *rt = Runtime::carry(Some(rt), defaults);
        }
        for (name, entry) in before.iter() {
            if !named.contains_key(name) {
                unnamed
                    .entry(name.clone())
                    .or_insert_with(|| Runtime::carry(Some(&entry.runtime), defaults));
            }
        }
    }

    /// The newest snapshot's state of `name`, named there or not.
    fn newest_state(&self, name: &str) -> Option<&Arc<Runtime>> {
        self.named
            .get(name)
            .map(|e| &e.runtime)
            .or_else(|| self.unnamed.get(name))
    }
}

/// The entries of the endpoints `set` names, for `version`: each with the state `old` gives
/// for its name carried over where its settings match ([`Runtime::carry`]).
fn named_entries(
    set: &PolicySet,
    version: u64,
    mut old: impl FnMut(&str) -> Option<Arc<Runtime>>,
) -> Map<Arc<Entry>> {
    let mut named = Map::with_capacity_and_hasher(set.len(), Default::default());
    for name in set.names() {
        let Some(policy) = set.endpoint(name) else {
            continue;
        };
        let runtime = Runtime::carry(old(name).as_ref(), &policy.policy);
        named.insert(
            policy.name.clone(),
            Arc::new(Entry {
                policy: EntryPolicy::Named(policy.clone()),
                runtime,
                version,
            }),
        );
    }
    named
}

/// Which policy an [`Entry`] runs under.
#[derive(Debug)]
enum EntryPolicy {
    /// The endpoint's own policy (its routes included).
    Named(Arc<EndpointPolicy>),
    /// The set's `defaults:` (an endpoint the set does not name).
    Defaults(Arc<RetryPolicy>),
}

/// One endpoint's policy and shared state as one snapshot has them. A call holds one entry
/// from start to end (it reads the policies once), and an [`crate::Endpoint`] keeps the entry
/// of the snapshot in force, so a call neither looks its endpoint up among the snapshot's nor
/// touches the snapshot's reference count.
#[derive(Debug)]
pub(crate) struct Entry {
    policy: EntryPolicy,
    runtime: Arc<Runtime>,
    /// The version of the snapshot the entry is of: a call's counts are reported under it.
    pub(crate) version: u64,
}

impl Entry {
    /// The policy of a call aimed at `target`, and the endpoint's state.
    pub(crate) fn resolve(&self, target: &Target<'_>) -> (&RetryPolicy, &Runtime) {
        let policy = match &self.policy {
            EntryPolicy::Named(p) => p.resolve(target),
            EntryPolicy::Defaults(p) => p,
        };
        (policy, &self.runtime)
    }

    /// Which of the entry's policies a call aimed at `target` takes, for
    /// [`Entry::resolve_at`]: a call that asks several times matches its route once.
    pub(crate) fn route_of(&self, target: &Target<'_>) -> usize {
        match &self.policy {
            EntryPolicy::Named(p) => p.resolve_index(target),
            EntryPolicy::Defaults(_) => 0,
        }
    }

    /// [`Entry::resolve`] of the target [`Entry::route_of`] gave `route` for.
    #[inline]
    pub(crate) fn resolve_at(&self, route: usize) -> (&RetryPolicy, &Runtime) {
        let policy = match &self.policy {
            EntryPolicy::Named(p) => p.policy_at(route),
            EntryPolicy::Defaults(p) => p,
        };
        (policy, &self.runtime)
    }
}

/// One immutable version of the agent's policies. Its `Debug` names the version, hash, source
/// and endpoint count, not the policies (ask [`PolicySnapshot::set`] for those), so a log line
/// or `dbg!` of it stays one short line.
pub struct PolicySnapshot {
    set: Option<PolicySet>,
    defaults: Arc<RetryPolicy>,
    version: u64,
    hash: String,
    source: Source,
    /// The endpoints the set names (shared with [`States`] while this snapshot is the newest).
    named: Arc<Map<Arc<Entry>>>,
    /// Every endpoint's state; those the set does not name are created on first use.
    states: Arc<States>,
}

impl PolicySnapshot {
    /// The fallback snapshot: version 0, no endpoints, [`fallback_policy`] for every call.
    pub(crate) fn fallback() -> Self {
        let defaults = Arc::new(fallback_policy());
        Self {
            set: None,
            states: Arc::new(States::new(defaults.clone(), Arc::default())),
            defaults,
            version: 0,
            hash: String::new(),
            source: Source::Fallback,
            named: Arc::default(),
        }
    }

    /// A snapshot of `set`, keeping the runtime state of `previous` where the settings match.
    ///
    /// `previous` must be the snapshot in force, about to be replaced by the one built (the
    /// agent builds under its swap lock, one at a time): the new snapshot shares its registry
    /// of endpoint states ([`States`]) and becomes the newest there, so a snapshot built and
    /// then not swapped in would leave the registry describing it.
    pub(crate) fn build(
        set: PolicySet,
        version: u64,
        hash: String,
        source: Source,
        previous: Option<&PolicySnapshot>,
    ) -> Self {
        let defaults = set.defaults().clone();
        let (named, states) = match previous {
            None => {
                let named = Arc::new(named_entries(&set, version, |_| None));
                let states = States::new(defaults.clone(), named.clone());
                (named, Arc::new(states))
            }
            // The named entries are carried and the registry advanced under one hold of its
            // lock: a call still on `previous` that first uses an endpoint meanwhile (making
            // its state, or one behind the newest for older settings) does so before the
            // carry reads the registry or after the new snapshot is the newest there, never
            // between, where what it made would be missing from the new snapshot and the next
            // call would make a second. Such calls wait for the build, and so does every
            // look-up of an endpoint `previous` does not name (a new handle, a stale handle's
            // refresh): the carry of every named entry is inside the hold. Calls on a handle's
            // kept entry, and look-ups of named endpoints, do not wait.
            Some(prev) => {
                let mut inner = prev.states.write();
                let named = Arc::new(named_entries(&set, version, |name| {
                    prev.named
                        .get(name)
                        .map(|e| e.runtime.clone())
                        .or_else(|| inner.unnamed.get(name).cloned())
                }));
                #[cfg(test)]
                tests::between_carry_and_advance();
                inner.advance(&defaults, &named);
                (named, prev.states.clone())
            }
        };
        Self {
            set: Some(set),
            defaults,
            version,
            hash,
            source,
            named,
            states,
        }
    }

    /// The entry of `endpoint` in this snapshot: its own, or the defaults with the state of
    /// an endpoint the set does not name (created on first use).
    pub(crate) fn entry(&self, endpoint: &str) -> Arc<Entry> {
        if let Some(e) = self.named.get(endpoint) {
            return e.clone();
        }
        let runtime = self.states.runtime(endpoint, &self.defaults);
        Arc::new(Entry {
            policy: EntryPolicy::Defaults(self.defaults.clone()),
            runtime,
            version: self.version,
        })
    }

    /// Drops the states of endpoints the policies do not name that nothing holds and that are
    /// idle (as a push does, see `StatesInner::advance`).
    pub(crate) fn prune_idle_states(&self) {
        let now = Instant::now();
        let mut inner = self.states.write();
        inner.unnamed.retain(|_, rt| !rt.is_idle_and_unheld(now));
    }

    /// How many endpoints the policies do not name have a state kept.
    #[cfg(test)]
    pub(crate) fn unnamed_states(&self) -> usize {
        self.states.read().unnamed.len()
    }

    /// The compiled policies; `None` for the fallback.
    pub fn set(&self) -> Option<&PolicySet> {
        self.set.as_ref()
    }

    /// The policy of endpoints the set does not name.
    pub fn defaults(&self) -> &Arc<RetryPolicy> {
        &self.defaults
    }

    /// The control plane's version number; 0 for static and fallback policies.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// The content hash (hex SHA-256 of the canonical wire form); empty for the fallback.
    pub fn content_hash(&self) -> &str {
        &self.hash
    }

    /// Where the policies came from.
    pub fn source(&self) -> Source {
        self.source
    }
}

// Written by hand: the derived form printed every policy and endpoint state (2–9 KB for a
// few dozen endpoints) wherever a snapshot, an agent or a handle was logged with `?`.
impl std::fmt::Debug for PolicySnapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PolicySnapshot")
            .field("version", &self.version)
            .field("content_hash", &self.hash)
            .field("source", &self.source)
            .field("endpoints", &self.set.as_ref().map_or(0, PolicySet::len))
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(yaml: &str) -> PolicySet {
        retryplane_policy::load(yaml.as_bytes()).policies.unwrap()
    }

    fn same(a: &Entry, b: &Entry) -> bool {
        Arc::ptr_eq(&a.runtime, &b.runtime)
    }

    /// A snapshot of `yaml` pushed as `version`, built from `previous`.
    fn build(yaml: &str, version: u64, previous: Option<&PolicySnapshot>) -> PolicySnapshot {
        PolicySnapshot::build(
            set(yaml),
            version,
            format!("h{version}"),
            Source::ControlPlane,
            previous,
        )
    }

    #[tokio::test(start_paused = true)]
    async fn unchanged_budget_and_breaker_keep_their_state_across_a_swap() {
        let v1 = build("version: 1\nendpoints:\n  a: {}\n  b: {}\n", 1, None);
        let a1 = v1.entry("a");
        let b1 = v1.entry("b");
        let z1 = v1.entry("zzz");
        let v2 = build(
            "version: 1\nendpoints:\n  a:\n    max_attempts: 5\n  b:\n    budget: {ratio: 0.5}\n",
            2,
            Some(&v1),
        );
        let a2 = v2.entry("a");
        let (policy, _) = a2.resolve(&Target::Endpoint);
        let b2 = v2.entry("b");
        let z2 = v2.entry("zzz");
        assert_eq!(policy.max_attempts, 5);
        assert!(same(&a1, &a2), "only max_attempts changed: state kept");
        assert!(!same(&b1, &b2), "budget changed: fresh state");
        assert!(
            same(&z1, &z2),
            "unnamed endpoint on unchanged defaults: state kept"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn state_made_on_the_outgoing_snapshot_after_a_swap_is_the_state_of_the_new_one() {
        let v1 = build("version: 1\nendpoints:\n  a: {}\n", 1, None);
        let v2 = build(
            "version: 1\nendpoints:\n  a: {max_attempts: 5}\n",
            2,
            Some(&v1),
        );
        // A call that loaded v1 before the swap makes the first use of `zzz` after v2 was
        // built; the next call, on v2, gets the same budget and breaker.
        let late = v1.entry("zzz");
        assert!(same(&late, &v2.entry("zzz")), "one state for the endpoint");
        // New `defaults:` budget: v3 starts a fresh state and keeps it; a straggler on v2 gets
        // a state of v2's settings that is not kept.
        let v3 = build(
            "version: 1\ndefaults:\n  budget: {ratio: 0.5}\nendpoints:\n  a: {}\n",
            3,
            Some(&v2),
        );
        let fresh = v3.entry("zzz");
        assert!(!same(&late, &fresh), "budget changed: fresh state");
        let straggler = v2.entry("yyy");
        assert!(
            !same(&straggler, &v3.entry("yyy")),
            "v2's settings are not v3's"
        );
        assert!(same(&fresh, &v3.entry("zzz")), "v3's state is kept");
        // An endpoint the newest policies name takes the unnamed state over, once.
        let v4 = build(
            "version: 1\ndefaults:\n  budget: {ratio: 0.5}\nendpoints:\n  a: {}\n  zzz: {}\n",
            4,
            Some(&v3),
        );
        assert!(same(&fresh, &v4.entry("zzz")), "named now, same state");
    }

    #[tokio::test(start_paused = true)]
    async fn an_endpoint_named_by_the_new_snapshot_has_one_state_for_calls_on_either() {
        let v1 = build("version: 1\nendpoints:\n  a: {}\n", 1, None);
        let v2 = build(
            "version: 1\nendpoints:\n  a: {}\n  x: {max_attempts: 4}\n",
            2,
            Some(&v1),
        );
        // First used by a call still on v1 (which does not name it), after v2 was built.
        let straggler = v1.entry("x");
        let named = v2.entry("x");
        assert!(same(&straggler, &named), "v2's state, not a second one");
        // v3 no longer names it: the state goes on.
        let v3 = build("version: 1\nendpoints:\n  a: {}\n", 3, Some(&v2));
        assert!(same(&named, &v3.entry("x")), "unnamed again, same state");
        // v4 names it with its own budget: a fresh state, and a straggler on v3 (whose
        // defaults the new state does not fit) gets one of v3's settings, not kept.
        let v4 = build(
            "version: 1\nendpoints:\n  a: {}\n  x:\n    budget: {ratio: 0.5}\n",
            4,
            Some(&v3),
        );
        let own = v4.entry("x");
        assert!(!same(&named, &own), "budget changed: fresh state");
        let late = v3.entry("x");
        assert!(!same(&late, &own));
        assert!(same(&own, &v4.entry("x")));
    }

    #[test]
    fn the_fallback_retries_at_most_once_with_budget_and_breaker_on() {
        let p = fallback_policy();
        assert_eq!(p.max_attempts, 2);
        assert!(p.budget.is_some() && p.circuit_breaker.is_some());
        assert_eq!(PolicySnapshot::fallback().source(), Source::Fallback);
    }

    #[tokio::test(start_paused = true)]
    async fn states_of_endpoints_no_longer_named_are_dropped_once_idle_and_unheld() {
        let names = |from: usize| -> String {
            (from..from + 50)
                .map(|i| format!("  e{i}: {{}}\n"))
                .collect()
        };
        let mut snap = build(&format!("version: 1\nendpoints:\n{}", names(0)), 1, None);
        // A handle kept on one endpoint the policies stop naming; another with a call counted.
        let held = snap.entry("e0");
        snap.entry("e1")
            .runtime
            .state
            .budget()
            .unwrap()
            .deposit(Instant::now());
        for push in 1..40 {
            let yaml = format!("version: 1\nendpoints:\n{}", names(push * 50));
            snap = build(&yaml, 1 + push as u64, Some(&snap));
        }
        let unnamed = snap.states.read().unnamed.len();
        assert!(unnamed <= 52, "{unnamed} unnamed states kept");
        assert!(same(&held, &snap.entry("e0")), "a held state is kept");
        let counted = snap.entry("e1");
        assert!(
            !counted.runtime.state.is_idle(Instant::now()),
            "a state that counts is kept"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_carried_state_that_shares_a_breaker_or_its_line_is_never_dropped() {
        use retryplane_policy::breaker::BreakerState;
        let now = Instant::now();
        // `x` named, then not, under defaults with other breaker settings: the carried state's
        // breaker takes over from the one calls in flight hold.
        let v1 = build("version: 1\nendpoints:\n  x: {}\n  a: {}\n", 1, None);
        let x1 = v1.entry("x");
        let old = x1.runtime.state.breaker().unwrap();
        let permits: Vec<_> = (0..20).map(|_| old.try_acquire(now).unwrap()).collect();
        let d = "defaults:\n  circuit_breaker: {min_requests: 5}\n";
        let v2 = build(
            &format!("version: 1\n{d}endpoints:\n  a: {{}}\n"),
            2,
            Some(&v1),
        );
        let v3 = build(
            &format!("version: 1\n{d}endpoints:\n  a: {{}}\n  b: {{}}\n"),
            3,
            Some(&v2),
        );
        let x3 = v3.entry("x");
        permits.into_iter().for_each(|p| old.record(p, false, now));
        assert_eq!(old.state(now), BreakerState::Open);
        let new = x3.runtime.state.breaker().unwrap();
        assert_eq!(
            new.state(now),
            BreakerState::Open,
            "one line of breakers for x"
        );
        // A budget-only change: the carried state shares the breaker itself.
        let w1 = build("version: 1\nendpoints:\n  a: {}\n", 1, None);
        let z1 = w1.entry("zzz");
        let zold = z1.runtime.state.breaker().unwrap();
        let d = "defaults:\n  budget: {ratio: 0.5}\n";
        let w2 = build(
            &format!("version: 1\n{d}endpoints:\n  a: {{}}\n"),
            2,
            Some(&w1),
        );
        let w3 = build(
            &format!("version: 1\n{d}endpoints:\n  a: {{}}\n  b: {{}}\n"),
            3,
            Some(&w2),
        );
        let z5 = w3.entry("zzz");
        assert!(
            std::ptr::eq(zold, z5.runtime.state.breaker().unwrap()),
            "one breaker for zzz"
        );
    }

    fn withdraw_all(e: &Entry, now: Instant) -> u64 {
        let b = e.runtime.state.budget().unwrap();
        let mut n = 0;
        while b.try_withdraw(now) {
            n += 1;
            assert!(n <= 100_000, "budget never ran out");
        }
        n
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_still_on_the_outgoing_snapshot_does_not_lend_its_budget_to_the_new_one() {
        // v1's defaults allow 1000 retries per window, v2's 10. A call that loaded v1 before
        // the swap first uses `zzz` after it: it gets a short-lived state of v1's settings,
        // which takes over from v2's kept state and so becomes the newest budget of the line.
        let v1 = build(
            "version: 1\ndefaults:\n  budget: {ratio: 0.0, min_per_second: 100, window: 10s}\nendpoints:\n  a: {}\n",
            1,
            None,
        );
        let v2 = build(
            "version: 1\ndefaults:\n  budget: {ratio: 0.0, min_per_second: 1, window: 10s}\nendpoints:\n  a: {}\n",
            2,
            Some(&v1),
        );
        let kept = v2.entry("zzz");
        let _straggler = v1.entry("zzz");
        let now = Instant::now();
        let n = withdraw_all(&v2.entry("zzz"), now);
        assert!(
            n <= 10,
            "calls on v2 (reserve 10) got {n} retries while one call on v1 was running"
        );
        assert_eq!(
            kept.runtime.state.budget().unwrap().snapshot(now).retries,
            n
        );
    }

    #[tokio::test(start_paused = true)]
    async fn retries_of_the_new_snapshot_are_still_counted_after_a_straggler_on_the_old_one_ends() {
        // Same reserve (10) on both sides, only the ratio changed: while the straggler's
        // short-lived state is the newest of the line, v2's calls count their retries there,
        // and when it ends they are lost: v2's budget hands the reserve out again.
        let v1 = build(
            "version: 1\ndefaults:\n  budget: {ratio: 0.5, min_per_second: 1, window: 10s}\nendpoints:\n  a: {}\n",
            1,
            None,
        );
        let v2 = build(
            "version: 1\ndefaults:\n  budget: {ratio: 0.0, min_per_second: 1, window: 10s}\nendpoints:\n  a: {}\n",
            2,
            Some(&v1),
        );
        let kept = v2.entry("zzz");
        let now = Instant::now();
        let straggler = v1.entry("zzz");
        let during = withdraw_all(&kept, now);
        drop(straggler);
        let after = withdraw_all(&kept, now);
        assert!(
            during + after <= 10,
            "v2's calls got {during} + {after} retries against a reserve of 10"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_new_snapshot_s_breaker_opens_by_its_own_settings_while_a_straggler_runs() {
        // v2 loosens the defaults' breaker (min_requests 5 -> 100). While one call that loaded
        // v1 runs, its short-lived breaker of v1's settings is the newest of the line: every
        // outcome of v2's calls is forwarded to it, judged by v1's min_requests, and its
        // opening opens v2's breaker.
        use retryplane_policy::breaker::BreakerState;
        let v1 = build(
            "version: 1\ndefaults:\n  circuit_breaker: {min_requests: 5}\nendpoints:\n  a: {}\n",
            1,
            None,
        );
        let v2 = build(
            "version: 1\ndefaults:\n  circuit_breaker: {min_requests: 100}\nendpoints:\n  a: {}\n",
            2,
            Some(&v1),
        );
        let kept = v2.entry("zzz");
        let _straggler = v1.entry("zzz");
        let now = Instant::now();
        let breaker = kept.runtime.state.breaker().unwrap();
        for _ in 0..10 {
            if let Ok(p) = breaker.try_acquire(now) {
                breaker.record(p, false, now);
            }
        }
        assert_eq!(
            breaker.state(now),
            BreakerState::Closed,
            "10 attempts on v2's breaker, min_requests 100"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn pruning_an_idle_unnamed_state_adds_no_budget_beside_the_one_a_running_call_uses() {
        // No breaker: a carried unnamed state whose budget counts nothing is pruned by the
        // next push although a call still runs on the budget it took over from; the next call
        // gets a fresh budget outside the line, and the two hand out the reserve twice.
        let d1 = "defaults:\n  circuit_breaker: {enabled: false}\n  budget: {ratio: 0.0, min_per_second: 1, window: 10s}\n";
        let d2 = "defaults:\n  circuit_breaker: {enabled: false}\n  budget: {ratio: 0.5, min_per_second: 1, window: 10s}\n";
        let v1 = build(&format!("version: 1\n{d1}endpoints:\n  a: {{}}\n"), 1, None);
        let running = v1.entry("zzz");
        let v2 = build(
            &format!("version: 1\n{d2}endpoints:\n  a: {{}}\n"),
            2,
            Some(&v1),
        );
        let v3 = build(
            &format!("version: 1\n{d2}endpoints:\n  a: {{}}\n  b: {{}}\n"),
            3,
            Some(&v2),
        );
        let now = Instant::now();
        let old_call = withdraw_all(&running, now);
        let new_calls = withdraw_all(&v3.entry("zzz"), now);
        assert!(
            old_call + new_calls <= 10,
            "{old_call} + {new_calls} retries against a reserve of 10"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_straggler_that_uses_an_endpoint_before_the_new_snapshot_s_calls_shares_their_budget()
    {
        // The same two snapshots as `a_call_still_on_the_outgoing_snapshot_…`, but the call
        // that loaded v1 is the first to use `zzz` after the swap: no state of v2's is kept yet,
        // so it gets one made afresh outside any line, and v2's first call then makes another.
        // Two budgets for one endpoint: v2's calls get the reserve again beside the
        // straggler's (README: a change of settings "never adds a budget beside it").
        let v1 = build(
            "version: 1\ndefaults:\n  budget: {ratio: 0.0, min_per_second: 1, window: 10s}\nendpoints:\n  a: {}\n",
            1,
            None,
        );
        let v2 = build(
            "version: 1\ndefaults:\n  budget: {ratio: 0.5, min_per_second: 1, window: 10s}\nendpoints:\n  a: {}\n",
            2,
            Some(&v1),
        );
        let straggler = v1.entry("zzz");
        let kept = v2.entry("zzz");
        let now = Instant::now();
        let old_call = withdraw_all(&straggler, now);
        let new_calls = withdraw_all(&kept, now);
        assert!(
            old_call + new_calls <= 10,
            "{old_call} + {new_calls} retries against a reserve of 10 for one endpoint"
        );
    }

    /// The budget of the calls behind a newest state that has none lives in that state, which
    /// is kept while they hold it (it has no budget nor breaker of its own to count).
    #[tokio::test(start_paused = true)]
    async fn a_reports_pruning_does_not_give_calls_behind_a_budgetless_state_a_second_budget() {
        let d1 = "defaults:\n  circuit_breaker: {enabled: false}\n  budget: {ratio: 0.0, min_per_second: 1, window: 10s}\n";
        let d2 = "defaults:\n  circuit_breaker: {enabled: false}\n  budget: {enabled: false}\n";
        let v1 = build(&format!("version: 1\n{d1}endpoints:\n  a: {{}}\n"), 1, None);
        let v2 = build(
            &format!("version: 1\n{d2}endpoints:\n  a: {{}}\n"),
            2,
            Some(&v1),
        );
        let now = Instant::now();
        let first = v1.entry("zzz");
        let sent_first = withdraw_all(&first, now);
        // What each report does (`Shared::forget_unheld`).
        v2.prune_idle_states();
        let second = v1.entry("zzz");
        let sent_second = withdraw_all(&second, now);
        assert!(
            sent_first + sent_second <= 10,
            "{sent_first} + {sent_second} retries against a reserve of 10 for calls of one \
             setting, the first still running"
        );
    }

    /// The call on v1 that spent the budget has ended,
    /// but its retries are still in the window; v2 turns the budget off, a report prunes, and
    /// v3 turns it on again with the same settings: the budget is the spent one, not fresh.
    #[tokio::test(start_paused = true)]
    async fn a_budget_turned_off_and_on_again_across_a_report_is_the_spent_one() {
        let d1 = "defaults:\n  circuit_breaker: {enabled: false}\n  budget: {ratio: 0.0, min_per_second: 1, window: 10s}\n";
        let d2 = "defaults:\n  circuit_breaker: {enabled: false}\n  budget: {enabled: false}\n";
        let yaml = |d: &str| format!("version: 1\n{d}endpoints:\n  a: {{}}\n");
        let v1 = build(&yaml(d1), 1, None);
        let now = Instant::now();
        let first = v1.entry("zzz");
        assert_eq!(withdraw_all(&first, now), 10);
        drop(first);
        let v2 = build(&yaml(d2), 2, Some(&v1));
        drop(v1);
        v2.prune_idle_states();
        let v3 = build(&yaml(d1), 3, Some(&v2));
        v3.prune_idle_states();
        let again = v3.entry("zzz");
        assert_eq!(
            withdraw_all(&again, now),
            0,
            "a fresh allowance in the same window"
        );
    }

    thread_local! {
        /// What a test runs inside [`PolicySnapshot::build`], after the named entries are
        /// carried and before the registry is advanced.
        static BETWEEN_CARRY_AND_ADVANCE: std::cell::RefCell<Option<Box<dyn FnOnce()>>> =
            const { std::cell::RefCell::new(None) };
    }

    /// Runs (once) what the test set on this thread for that point of a build.
    pub(super) fn between_carry_and_advance() {
        if let Some(run) = BETWEEN_CARRY_AND_ADVANCE.with(|h| h.borrow_mut().take()) {
            run();
        }
    }

    /// `late` run on another thread while `v` is replaced by a snapshot of `yaml`, and given
    /// until the build ends to finish between the build's carry and its advance (a bounded
    /// wait: a build that holds it back until it ends never lets it finish there; the test
    /// below checks that hold itself, with no wait).
    fn replaced_while_a_late_call_runs(
        v: &PolicySnapshot,
        yaml: &str,
        late: impl FnOnce() -> Arc<Entry> + Send + 'static,
    ) -> (PolicySnapshot, Arc<Entry>) {
        let bound = std::time::Duration::from_secs(30);
        let (threads, thread) = std::sync::mpsc::channel();
        BETWEEN_CARRY_AND_ADVANCE.with(|h| {
            *h.borrow_mut() = Some(Box::new(move || {
                let (done, finished) = std::sync::mpsc::channel();
                let call = std::thread::spawn(move || {
                    let entry = late();
                    let _ = done.send(());
                    entry
                });
                let ended = finished
                    .recv_timeout(std::time::Duration::from_millis(500))
                    .is_ok();
                let _ = threads.send((call, ended.then_some(()).ok_or(finished)));
            }));
        });
        let next = build(yaml, v.version + 1, Some(v));
        let (call, ended) = thread
            .recv_timeout(bound)
            .expect("the build ran the late call");
        if let Err(finished) = ended {
            finished
                .recv_timeout(bound)
                .expect("the late call ends once the build does");
        }
        let entry = call.join().expect("the late call does not panic");
        (next, entry)
    }

    /// A call still on v1 first uses `x` while v2, which names it, is built, and shares v2's
    /// budget of `x`. When the build let go of the registry between the carry of v2's entries
    /// and its advance, the call made a state of `x` there that the advance then dropped (v2
    /// names it), and v2's calls ran on another: two budgets for one endpoint. (Real threads
    /// and the real clock: the late call runs on its own thread.)
    #[test]
    fn a_call_that_first_uses_an_endpoint_during_a_build_shares_the_new_snapshot_s_budget() {
        let d = "defaults:\n  circuit_breaker: {enabled: false}\n  budget: {ratio: 0.0, min_per_second: 1, window: 10s}\n";
        let v1 = Arc::new(build(
            &format!("version: 1\n{d}endpoints:\n  a: {{}}\n"),
            1,
            None,
        ));
        let on_v1 = v1.clone();
        let (v2, late) = replaced_while_a_late_call_runs(
            &v1,
            &format!("version: 1\n{d}endpoints:\n  a: {{}}\n  x: {{}}\n"),
            move || on_v1.entry("x"),
        );
        let now = Instant::now();
        let late_call = withdraw_all(&late, now);
        let new_calls = withdraw_all(&v2.entry("x"), now);
        assert!(
            late_call + new_calls <= 10,
            "{late_call} + {new_calls} retries against a reserve of 10 for one endpoint"
        );
    }

    /// The calls behind a state with no budget (a push turned it off) share one budget per
    /// settings, kept in that state and carried to the next, one made during a build included.
    /// When the build let go of the registry between its carry and its advance, a call on v1
    /// that first needed one during the build of v4 made it in v3's state after v4's entry had
    /// copied what v3's state kept, and the next call on v1 made a second one in v4's.
    #[test]
    fn a_budget_made_behind_during_a_build_is_the_one_the_next_call_behind_gets() {
        let yaml = |budget: &str, z: &str| {
            format!(
                "version: 1\ndefaults:\n  circuit_breaker: {{enabled: false}}\n  budget: {budget}\nendpoints:\n  a: {{}}\n{z}"
            )
        };
        let on = |ratio: f64| format!("{{ratio: {ratio}, min_per_second: 1, window: 10s}}");
        let off = "{enabled: false}";
        let v1 = Arc::new(build(&yaml(&on(0.0), ""), 1, None));
        drop(v1.entry("z"));
        let v2 = build(&yaml(&on(0.5), ""), 2, Some(&v1));
        drop(v2.entry("z"));
        let v3 = build(&yaml(off, ""), 3, Some(&v2));
        // v4 names `z` with a breaker: a state of its own, carried from v3's.
        let z = "  z:\n    circuit_breaker: {failure_ratio: 0.5, min_requests: 4, window: 10s, open_for: 1s, half_open_probes: 1}\n";
        let on_v1 = v1.clone();
        let (_v4, late) =
            replaced_while_a_late_call_runs(&v3, &yaml(off, z), move || on_v1.entry("z"));
        let next = v1.entry("z");
        assert!(
            matches!(
                (late.runtime.state.budget(), next.runtime.state.budget()),
                (Some(a), Some(b)) if std::ptr::eq(a, b)
            ),
            "two calls on v1 behind v4's state share one budget"
        );
    }

    /// At the point of a build between the carry of the named entries and the advance of the
    /// registry, the registry can be neither read nor written, so no call (on any snapshot)
    /// can make a state there. Checked with `try_read` and `try_write` at that point, with no
    /// thread and no wait: unlike the two tests above, whose bounded wait shows the race only
    /// when the late call finishes within 500 ms, this fails at once (and every time) if the
    /// build lets go of the registry between the two.
    #[test]
    fn no_call_can_reach_the_registry_between_a_build_s_carry_and_its_advance() {
        let v1 = build(
            "version: 1\ndefaults:\n  budget: {ratio: 0.1}\nendpoints:\n  a: {}\n",
            1,
            None,
        );
        drop(v1.entry("u"));
        let states = v1.states.clone();
        let seen: std::rc::Rc<std::cell::Cell<Option<(bool, bool)>>> = Default::default();
        let at_hook = seen.clone();
        BETWEEN_CARRY_AND_ADVANCE.with(|h| {
            *h.borrow_mut() = Some(Box::new(move || {
                let read_refused = matches!(
                    states.inner.try_read(),
                    Err(std::sync::TryLockError::WouldBlock)
                );
                let write_refused = matches!(
                    states.inner.try_write(),
                    Err(std::sync::TryLockError::WouldBlock)
                );
                at_hook.set(Some((read_refused, write_refused)));
            }));
        });
        let v2 = build(
            "version: 1\ndefaults:\n  budget: {ratio: 0.2}\nendpoints:\n  a: {}\n  u: {}\n",
            2,
            Some(&v1),
        );
        let Some((read_refused, write_refused)) = seen.get() else {
            panic!("the build ran no hook between its carry and its advance");
        };
        assert!(
            read_refused && write_refused,
            "the registry could be read ({}) or written ({}) between the carry and the advance",
            !read_refused,
            !write_refused
        );
        drop(v2);
    }

    /// Builds (budget and breaker settings changed, turned off and on, endpoints named and
    /// unnamed), calls on any of the last eight snapshots (the newest and older ones) that
    /// first use endpoints (states made, kept or made behind the newest, strays made), calls
    /// that count in those budgets and breakers (their lines), and the pruning a report does,
    /// all at once on real threads: the build takes each state's `strays` (and the lines)
    /// under the registry's write lock, as `States::runtime` does, and no path takes them the
    /// other way round. Bounded: the threads run a fixed number of rounds and the test waits
    /// at most 120 s for them (a deadlock fails it, it does not hang).
    #[test]
    fn builds_late_calls_and_pruning_at_once_never_deadlock() {
        use std::sync::Mutex;
        use std::sync::atomic::{AtomicBool, Ordering};
        let budgets = [
            "{ratio: 0.0, min_per_second: 1, window: 10s}",
            "{ratio: 0.5}",
            "{enabled: false}",
        ];
        let breakers = [
            "{enabled: false}",
            "{min_requests: 3, failure_ratio: 0.5}",
            "{}",
        ];
        let yaml = move |i: usize| {
            let mut y = format!(
                "version: 1\ndefaults:\n  budget: {}\n  circuit_breaker: {}\nendpoints:\n  a: {{}}\n",
                budgets[i % 3],
                breakers[(i / 3) % 3]
            );
            for (k, name) in ["x", "y", "z"].iter().enumerate() {
                if (i >> k) & 1 == 1 {
                    y.push_str(&format!(
                        "  {name}:\n    budget: {}\n",
                        budgets[(i + k) % 3]
                    ));
                }
            }
            y
        };
        let first = Arc::new(build(&yaml(0), 1, None));
        let current = Arc::new(Mutex::new(first.clone()));
        let history = Arc::new(Mutex::new(vec![first]));
        let stop = Arc::new(AtomicBool::new(false));
        let (done, finished) = std::sync::mpsc::channel::<&'static str>();
        let mut threads = Vec::new();
        {
            let (current, history, done, stop) =
                (current.clone(), history.clone(), done.clone(), stop.clone());
            threads.push(std::thread::spawn(move || {
                for push in 1..=300usize {
                    let mut cur = current.lock().unwrap();
                    let next = Arc::new(build(&yaml(push * 7 % 64), push as u64 + 1, Some(&cur)));
                    *cur = next.clone();
                    drop(cur);
                    let mut h = history.lock().unwrap();
                    h.push(next);
                    if h.len() > 8 {
                        h.remove(0);
                    }
                }
                stop.store(true, Ordering::Relaxed);
                let _ = done.send("builder");
            }));
        }
        for t in 0..3usize {
            let (history, done, stop) = (history.clone(), done.clone(), stop.clone());
            threads.push(std::thread::spawn(move || {
                let mut round = 0usize;
                while !stop.load(Ordering::Relaxed) && round < 200_000 {
                    round += 1;
                    let snap = {
                        let h = history.lock().unwrap();
                        h[(round * 31 + t) % h.len()].clone()
                    };
                    let name = ["x", "y", "z", "u", "v"][(round + t) % 5];
                    let e = snap.entry(name);
                    let now = Instant::now();
                    if let Some(b) = e.runtime.state.budget() {
                        b.deposit(now);
                        let _ = b.try_withdraw(now);
                    }
                    if let Some(br) = e.runtime.state.breaker()
                        && let Ok(p) = br.try_acquire(now)
                    {
                        br.record(p, round.is_multiple_of(3), now);
                    }
                }
                let _ = done.send("caller");
            }));
        }
        {
            let (current, done, stop) = (current.clone(), done.clone(), stop.clone());
            threads.push(std::thread::spawn(move || {
                let mut round = 0usize;
                while !stop.load(Ordering::Relaxed) && round < 200_000 {
                    round += 1;
                    let snap = current.lock().unwrap().clone();
                    snap.prune_idle_states();
                }
                let _ = done.send("pruner");
            }));
        }
        drop(done);
        let deadline = Instant::now() + std::time::Duration::from_secs(120);
        for _ in 0..threads.len() {
            let left = deadline.saturating_duration_since(Instant::now());
            match finished.recv_timeout(left) {
                Ok(_) => {}
                Err(e) => panic!(
                    "a thread did not finish within 120 s (a deadlock, or another thread \
                     panicked holding a lock): {e}"
                ),
            }
        }
        for t in threads {
            t.join().expect("no thread panicked");
        }
    }
}
