//! The policies an agent runs: one immutable [`PolicySnapshot`] behind the agent's `ArcSwap`.
//!
//! A snapshot is the compiled [`PolicySet`] with its version and content hash, plus the runtime
//! state of every endpoint (its [`EndpointState`]: retry budget and circuit breaker). When a new
//! snapshot replaces an old one, an endpoint whose budget and breaker settings did not change
//! keeps its state, so a push that only changes `max_attempts` does not reset a breaker that is
//! open. Endpoints the policies do not name run under the file's `defaults:`; their state is
//! created on first use and carried over the same way.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use retryplane_policy::engine::EndpointState;
use retryplane_policy::{
    BreakerConfig, BudgetConfig, EndpointPolicy, PolicySet, RetryPolicy, Target,
};
use tokio::time::Instant;

/// Where a snapshot's policies came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// Pushed by the control plane on the stream.
    ControlPlane,
    /// Read from the cache file at start.
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
/// retries at most once per call.
pub fn fallback_policy() -> RetryPolicy {
    RetryPolicy {
        max_attempts: 2,
        ..RetryPolicy::default()
    }
}

/// An endpoint's shared runtime state and the settings it was built from.
#[derive(Debug)]
pub(crate) struct Runtime {
    pub(crate) state: EndpointState,
    budget: Option<BudgetConfig>,
    breaker: Option<BreakerConfig>,
}

impl Runtime {
    fn new(policy: &RetryPolicy) -> Self {
        Self {
            state: EndpointState::new(policy, Instant::now()),
            budget: policy.budget.clone(),
            breaker: policy.circuit_breaker.clone(),
        }
    }

    fn fits(&self, policy: &RetryPolicy) -> bool {
        self.budget == policy.budget && self.breaker == policy.circuit_breaker
    }

    /// `old` when its settings match `policy`, else a fresh state.
    fn carry(old: Option<&Arc<Runtime>>, policy: &RetryPolicy) -> Arc<Runtime> {
        match old {
            Some(rt) if rt.fits(policy) => rt.clone(),
            _ => Arc::new(Runtime::new(policy)),
        }
    }
}

/// Endpoint names to their entries: foldhash with a fixed key, as [`PolicySet`]'s own map (the
/// names come from the policies and from the program, not from requests). SipHash cost about
/// 15 ns per call here.
type Map<V> = HashMap<Arc<str>, V, foldhash::fast::FixedState>;

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
}

/// One immutable version of the agent's policies.
#[derive(Debug)]
pub struct PolicySnapshot {
    set: Option<PolicySet>,
    defaults: Arc<RetryPolicy>,
    version: u64,
    hash: String,
    source: Source,
    named: Map<Arc<Entry>>,
    /// Runtime state of endpoints the set does not name, created on first use.
    unnamed: RwLock<Map<Arc<Runtime>>>,
}

impl PolicySnapshot {
    /// The fallback snapshot: version 0, no endpoints, [`fallback_policy`] for every call.
    pub(crate) fn fallback() -> Self {
        Self {
            set: None,
            defaults: Arc::new(fallback_policy()),
            version: 0,
            hash: String::new(),
            source: Source::Fallback,
            named: Map::default(),
            unnamed: RwLock::default(),
        }
    }

    /// A snapshot of `set`, keeping the runtime state of `previous` where the settings match.
    pub(crate) fn build(
        set: PolicySet,
        version: u64,
        hash: String,
        source: Source,
        previous: Option<&PolicySnapshot>,
    ) -> Self {
        let defaults = set.defaults().clone();
        let mut named = Map::with_capacity_and_hasher(set.len(), Default::default());
        for name in set.names() {
            let Some(policy) = set.endpoint(name) else {
                continue;
            };
            let old = previous.and_then(|p| p.runtime_of(name));
            let runtime = Runtime::carry(old.as_ref(), &policy.policy);
            named.insert(
                policy.name.clone(),
                Arc::new(Entry {
                    policy: EntryPolicy::Named(policy.clone()),
                    runtime,
                }),
            );
        }
        let mut unnamed = Map::default();
        if let Some(prev) = previous {
            for (name, rt) in prev
                .unnamed
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
            {
                if !named.contains_key(name) && rt.fits(&defaults) {
                    unnamed.insert(name.clone(), rt.clone());
                }
            }
        }
        Self {
            set: Some(set),
            defaults,
            version,
            hash,
            source,
            named,
            unnamed: RwLock::new(unnamed),
        }
    }

    /// The runtime state `name` had in this snapshot, if any.
    fn runtime_of(&self, name: &str) -> Option<Arc<Runtime>> {
        if let Some(e) = self.named.get(name) {
            return Some(e.runtime.clone());
        }
        self.unnamed
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .cloned()
    }

    /// The entry of `endpoint` in this snapshot: its own, or the defaults with the state of
    /// an endpoint the set does not name (created on first use).
    pub(crate) fn entry(&self, endpoint: &str) -> Arc<Entry> {
        if let Some(e) = self.named.get(endpoint) {
            return e.clone();
        }
        let runtime = self
            .unnamed
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(endpoint)
            .cloned();
        let runtime = runtime.unwrap_or_else(|| {
            self.unnamed
                .write()
                .unwrap_or_else(|e| e.into_inner())
                .entry(Arc::from(endpoint))
                .or_insert_with(|| Arc::new(Runtime::new(&self.defaults)))
                .clone()
        });
        Arc::new(Entry {
            policy: EntryPolicy::Defaults(self.defaults.clone()),
            runtime,
        })
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

#[cfg(test)]
mod tests {
    use super::*;

    fn set(yaml: &str) -> PolicySet {
        retryplane_policy::load(yaml.as_bytes()).policies.unwrap()
    }

    fn same(a: &Entry, b: &Entry) -> bool {
        Arc::ptr_eq(&a.runtime, &b.runtime)
    }

    #[tokio::test(start_paused = true)]
    async fn unchanged_budget_and_breaker_keep_their_state_across_a_swap() {
        let v1 = PolicySnapshot::build(
            set("version: 1\nendpoints:\n  a: {}\n  b: {}\n"),
            1,
            "h1".into(),
            Source::ControlPlane,
            None,
        );
        let a1 = v1.entry("a");
        let b1 = v1.entry("b");
        let z1 = v1.entry("zzz");
        let v2 = PolicySnapshot::build(
            set(
                "version: 1\nendpoints:\n  a:\n    max_attempts: 5\n  b:\n    budget: {ratio: 0.5}\n",
            ),
            2,
            "h2".into(),
            Source::ControlPlane,
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

    #[test]
    fn the_fallback_retries_at_most_once_with_budget_and_breaker_on() {
        let p = fallback_policy();
        assert_eq!(p.max_attempts, 2);
        assert!(p.budget.is_some() && p.circuit_breaker.is_some());
        assert_eq!(PolicySnapshot::fallback().source(), Source::Fallback);
    }
}
