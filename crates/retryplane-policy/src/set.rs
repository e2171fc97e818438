//! The compiled policy set: every effective policy built once, looked up per call.
//!
//! Built from a checked [`PolicyDocument`]; the agent keeps one in an `ArcSwap` and looks an
//! endpoint up by name (a hash lookup), then a route by first match in file order. The control
//! plane reads each endpoint's alert settings ([`PolicySet::alert`]), kept apart from the
//! policies calls run under.

use std::collections::HashMap;
use std::hash::BuildHasher as _;
use std::sync::Arc;

use crate::diag::{self, Diagnostic};
use crate::document::{Overlay, PolicyDocument, RouteMatch, Target};
use crate::model::{AlertConfig, RetryPolicy};

/// One route of an endpoint, compiled.
#[derive(Clone, Debug, PartialEq)]
pub struct Route {
    /// Which calls it applies to.
    pub matcher: RouteMatch,
    /// The effective policy (defaults → endpoint → this route).
    pub policy: Arc<RetryPolicy>,
}

/// One endpoint, compiled.
#[derive(Clone, Debug, PartialEq)]
pub struct EndpointPolicy {
    /// The logical upstream name.
    pub name: Arc<str>,
    /// The effective policy when no route matches (defaults → endpoint).
    pub policy: Arc<RetryPolicy>,
    /// Route overrides, first match wins.
    pub routes: Arc<[Route]>,
}

impl EndpointPolicy {
    /// The policy for `target`: the first matching route's, else the endpoint's. An HTTP
    /// path is matched as the server serves it ([`crate::uri_path::as_served`]:
    /// `/v1/search/../charges` is a call to `/v1/charges`, not one under `/v1/search`).
    ///
    /// A plain loop rather than `Iterator::find`: the compiler kept `find` as a call of its own
    /// in the caller's crate (BENCHMARKS.md, section 1).
    #[inline(always)]
    pub fn resolve(&self, target: &Target<'_>) -> &Arc<RetryPolicy> {
        if let Target::Http { method, path } = *target
            && !self.routes.is_empty()
            && crate::uri_path::may_be_served_as_another(path)
        {
            return self.resolve_as_served(method, path);
        }
        self.first_match(target)
    }

    /// The first route's policy that `target` matches, as it is, else the endpoint's.
    #[inline(always)]
    fn first_match(&self, target: &Target<'_>) -> &Arc<RetryPolicy> {
        for route in self.routes.iter() {
            if route.matcher.matches(target) {
                return &route.policy;
            }
        }
        &self.policy
    }

    /// Which of the endpoint's policies [`EndpointPolicy::resolve`] gives for `target`: a
    /// route's index, or `routes.len()` for the endpoint's own; [`EndpointPolicy::policy_at`]
    /// gives that policy back without matching again. For a caller that asks for one target's
    /// policy several times (the agent's tower layer, once per step of a call).
    pub fn resolve_index(&self, target: &Target<'_>) -> usize {
        let served;
        let target = match *target {
            Target::Http { method, path }
                if !self.routes.is_empty() && crate::uri_path::may_be_served_as_another(path) =>
            {
                served = crate::uri_path::as_served(path);
                Target::Http {
                    method,
                    path: &served,
                }
            }
            other => other,
        };
        self.routes
            .iter()
            .position(|route| route.matcher.matches(&target))
            .unwrap_or(self.routes.len())
    }

    /// The policy [`EndpointPolicy::resolve_index`] named: route `index`'s, or the endpoint's
    /// own for any index past the routes.
    #[inline]
    pub fn policy_at(&self, index: usize) -> &Arc<RetryPolicy> {
        self.routes
            .get(index)
            .map_or(&self.policy, |route| &route.policy)
    }

    /// [`EndpointPolicy::resolve`] for a path that may be served as another: out of line, as
    /// few paths are.
    #[cold]
    #[inline(never)]
    fn resolve_as_served(&self, method: &str, path: &str) -> &Arc<RetryPolicy> {
        let served = crate::uri_path::as_served(path);
        self.first_match(&Target::Http {
            method,
            path: &served,
        })
    }
}

type Map<V> = HashMap<Arc<str>, V, foldhash::fast::FixedState>;

/// The endpoints by name: the one lookup every call makes.
///
/// Written here rather than taken from a library: a `HashMap<Arc<str>, _>` compares keys with
/// `str`'s `==`, a call into `memcmp`; hashbrown's `HashTable` (used until 2026-12-01) takes an
/// inline comparison but keeps its probe loop (`RawTable::find`) a call of its own in the
/// caller. This table needs nothing of theirs but the lookup: it is built once per policy set,
/// never grows and never removes, and its probe is inlined at the call site (BENCHMARKS.md,
/// section 1, the 2026-12-01 entry: lookup and route 13–14 ns before, 11 ns after). Linear
/// probing at a load of at most one half; each slot keeps the name's full hash, so a name is
/// compared ([`crate::document::str_eq`], inline) only on a hash match. At least one slot is
/// always empty, so a probe for a missing name ends. A slot is 16 bytes, so the table takes 32
/// to 64 bytes per endpoint (2 MiB at 60,000), about twice hashbrown's. Names come from the
/// policy file, not from callers' requests, so a fixed hasher is fine.
#[derive(Clone)]
struct Endpoints {
    /// A power of two in length, at least twice the number of endpoints (and at least 1).
    slots: Box<[Option<Slot>]>,
    /// `slots.len() - 1`.
    mask: usize,
    len: usize,
    hasher: foldhash::fast::FixedState,
}

#[derive(Clone)]
struct Slot {
    hash: u64,
    endpoint: Arc<EndpointPolicy>,
}

impl std::fmt::Debug for Endpoints {
    /// The endpoints, not the empty slots.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl Endpoints {
    /// A table of `endpoints`; of two with the same name (a checked document has none), the
    /// last is kept.
    fn new(endpoints: Vec<Arc<EndpointPolicy>>) -> Self {
        let capacity = endpoints.len().saturating_mul(2).max(1).next_power_of_two();
        let mut table = Self {
            slots: (0..capacity).map(|_| None).collect(),
            mask: capacity - 1,
            len: 0,
            hasher: foldhash::fast::FixedState::default(),
        };
        for endpoint in endpoints {
            table.insert(endpoint);
        }
        table
    }

    #[inline]
    fn hash(&self, name: &str) -> u64 {
        self.hasher.hash_one(name)
    }

    /// The slot of `name`: the one holding it, or the empty one where a probe for it ends.
    #[inline(always)]
    fn position(&self, hash: u64, name: &str) -> Option<usize> {
        // Truncating the hash to the table's size is the point of the cast.
        let mut i = hash as usize & self.mask;
        // At most `slots.len()` probes: the table is never full, so one of them is empty.
        for _ in 0..self.slots.len() {
            match self.slots.get(i)? {
                Some(slot)
                    if slot.hash != hash || !crate::document::str_eq(&slot.endpoint.name, name) =>
                {
                    i = (i + 1) & self.mask;
                }
                _ => return Some(i),
            }
        }
        None
    }

    fn insert(&mut self, endpoint: Arc<EndpointPolicy>) {
        let hash = self.hash(&endpoint.name);
        let Some(i) = self.position(hash, &endpoint.name) else {
            return; // full: cannot happen, `new` sized the table for every endpoint
        };
        if let Some(slot) = self.slots.get_mut(i) {
            if slot.is_none() {
                self.len += 1;
            }
            *slot = Some(Slot { hash, endpoint });
        }
    }

    #[inline(always)]
    fn get(&self, name: &str) -> Option<&Arc<EndpointPolicy>> {
        let hash = self.hash(name);
        let i = self.position(hash, name)?;
        self.slots.get(i)?.as_ref().map(|slot| &slot.endpoint)
    }

    fn iter(&self) -> impl Iterator<Item = &Arc<EndpointPolicy>> {
        self.slots.iter().flatten().map(|slot| &slot.endpoint)
    }
}

/// Every endpoint's compiled policies, and the document they came from.
#[derive(Clone, Debug)]
pub struct PolicySet {
    document: Arc<PolicyDocument>,
    defaults: Arc<RetryPolicy>,
    endpoints: Endpoints,
    /// `defaults:` over the built-in alert settings.
    default_alert: AlertConfig,
    /// Every endpoint's alert settings (defaults → endpoint).
    alerts: Map<AlertConfig>,
}

/// Why a document could not become a policy set.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid policy: {} error(s), first: {}", diag::counts(errors).0, errors.first().map(ToString::to_string).unwrap_or_default())]
pub struct InvalidPolicy {
    /// Every error (warnings are not errors and are not here).
    pub errors: Vec<Diagnostic>,
}

impl PolicySet {
    /// Checks `document` and compiles it. Warnings come back with the set; any error refuses it.
    pub fn from_document(
        document: PolicyDocument,
    ) -> Result<(Self, Vec<Diagnostic>), InvalidPolicy> {
        let mut diags = Vec::new();
        if document.endpoints.is_empty() {
            // A file gets this error, located, from the parser; a document from the API or
            // the wire gets it here.
            diags.push(Diagnostic::error(
                crate::yaml::Loc::UNKNOWN,
                "endpoints",
                "the policies define no endpoints",
            ));
        }
        crate::validate::check(&document, &mut diags);
        diag::normalize(&mut diags);
        if diags.iter().any(Diagnostic::is_error) {
            diags.retain(Diagnostic::is_error);
            diag::cap(&mut diags);
            return Err(InvalidPolicy { errors: diags });
        }
        diag::cap(&mut diags);
        Ok((Self::compile(document), diags))
    }

    /// Compiles an already checked document.
    fn compile(document: PolicyDocument) -> Self {
        let defaults = Arc::new(Overlay::resolve([&document.defaults]));
        let default_alert = document.defaults.alert();
        let mut endpoints = Vec::with_capacity(document.endpoints.len());
        let mut alerts = Map::default();
        for ep in &document.endpoints {
            let merged = ep.overlay.over(&document.defaults);
            let policy = Arc::new(Overlay::resolve([&merged]));
            let routes = ep
                .routes
                .iter()
                .map(|r| Route {
                    matcher: r.matcher.value.clone(),
                    policy: Arc::new(Overlay::resolve([&merged, &r.overlay])),
                })
                .collect();
            let name: Arc<str> = Arc::from(ep.name.value.as_str());
            alerts.insert(name.clone(), merged.alert());
            endpoints.push(Arc::new(EndpointPolicy {
                name,
                policy,
                routes,
            }));
        }
        Self {
            document: Arc::new(document),
            defaults,
            endpoints: Endpoints::new(endpoints),
            default_alert,
            alerts,
        }
    }

    /// The endpoint named `name`.
    #[inline]
    pub fn endpoint(&self, name: &str) -> Option<&Arc<EndpointPolicy>> {
        self.endpoints.get(name)
    }

    /// The policy for `target` on endpoint `name`, if the endpoint exists.
    #[inline]
    pub fn resolve(&self, name: &str, target: &Target<'_>) -> Option<&Arc<RetryPolicy>> {
        self.endpoint(name).map(|e| e.resolve(target))
    }

    /// The file's `defaults:` over the built-in values, for endpoints the file does not name.
    pub fn defaults(&self) -> &Arc<RetryPolicy> {
        &self.defaults
    }

    /// The alert settings of endpoint `name` (built-in ← `defaults:` ← the endpoint), if the
    /// endpoint exists. One hash lookup.
    #[inline]
    pub fn alert(&self, name: &str) -> Option<&AlertConfig> {
        self.alerts.get(name)
    }

    /// The `alert.retry_ratio` of endpoint `name`, if the endpoint exists: the endpoint is
    /// flagged when its retries / calls over 5 minutes pass it (SPEC §4).
    #[inline]
    pub fn alert_retry_ratio(&self, name: &str) -> Option<f64> {
        self.alert(name).map(|a| a.retry_ratio)
    }

    /// The file's `defaults:` over the built-in alert settings, for endpoints the file does not
    /// name (agents run those calls on [`PolicySet::defaults`] and report them too).
    pub fn default_alert(&self) -> &AlertConfig {
        &self.default_alert
    }

    /// Endpoint names, sorted.
    pub fn names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.endpoints.iter().map(|e| &*e.name).collect();
        names.sort_unstable();
        names
    }

    /// Number of endpoints.
    pub fn len(&self) -> usize {
        self.endpoints.len
    }

    /// Whether there are no endpoints.
    pub fn is_empty(&self) -> bool {
        self.endpoints.len == 0
    }

    /// The document the set was compiled from.
    pub fn document(&self) -> &Arc<PolicyDocument> {
        &self.document
    }
}

/// The result of loading a policy file.
#[derive(Clone, Debug)]
pub struct Loaded {
    /// The compiled set, when the file has no errors.
    pub policies: Option<PolicySet>,
    /// Every error and warning, sorted by position.
    pub diagnostics: Vec<Diagnostic>,
}

impl Loaded {
    /// Whether any diagnostic is an error.
    pub fn has_errors(&self) -> bool {
        self.diagnostics.iter().any(Diagnostic::is_error)
    }
}

/// Parses, checks and compiles policy-file bytes, reporting every problem at once (the first
/// [`diag::MAX_LISTED`], errors first, then a line saying how many more: [`diag::counts`]).
/// Never panics; bounded time and memory on any input (see [`crate::yaml`] for the limits).
pub fn load(bytes: &[u8]) -> Loaded {
    let mut loaded = load_all(bytes);
    diag::cap(&mut loaded.diagnostics);
    loaded
}

/// [`load`] with every diagnostic, uncut: for a caller that picks some of them (those of one
/// endpoint) and must not miss one past the first [`diag::MAX_LISTED`].
pub fn load_all(bytes: &[u8]) -> Loaded {
    let mut diagnostics = Vec::new();
    let parsed = match crate::yaml::parse_noting(bytes) {
        Ok((root, merges_again)) => {
            // Reported as any duplicate key is, beside the file's other problems.
            let places: Vec<_> = merges_again.iter().map(|m| m.mapping).collect();
            let paths = crate::parse::paths_of_mappings(&root, &places);
            for again in merges_again {
                let path = match paths.get(&again.mapping) {
                    Some(p) if !p.is_empty() => format!("{p}.<<"),
                    _ => "<<".to_owned(),
                };
                diagnostics.push(Diagnostic::error(
                    again.at,
                    path,
                    crate::yaml::merge_again_message(again.first),
                ));
            }
            crate::parse::document_and_detached(&root, &mut diagnostics)
        }
        Err(e) => {
            diagnostics.push(Diagnostic::error(e.loc, "<root>", e.message));
            None
        }
    };
    let Some((document, detached)) = parsed else {
        // Sorted by place as documented (a merge key's problem goes in before the walk's).
        diag::normalize(&mut diagnostics);
        return Loaded {
            policies: None,
            diagnostics,
        };
    };
    crate::validate::check_parsed(&document, &mut diagnostics, &detached);
    diag::normalize(&mut diagnostics);
    let policies =
        (!diagnostics.iter().any(Diagnostic::is_error)).then(|| PolicySet::compile(document));
    Loaded {
        policies,
        diagnostics,
    }
}

/// What [`load`] gives a file over [`crate::yaml::MAX_FILE_BYTES`], for a reader that stops
/// reading at the limit: `size` in bytes, when known (the file's metadata), else "more than
/// the limit".
pub fn too_large(size: Option<u64>) -> Loaded {
    Loaded {
        policies: None,
        diagnostics: vec![Diagnostic::error(
            crate::yaml::Loc { line: 1, column: 1 },
            "<root>",
            crate::yaml::too_large_message(size),
        )],
    }
}

#[cfg(test)]
#[path = "set_tests.rs"]
mod tests;
