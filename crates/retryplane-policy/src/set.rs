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
    /// The policy for `target`: the first matching route's, else the endpoint's.
    ///
    /// A plain loop rather than `Iterator::find`: the compiler kept `find` as a call of its own
    /// in the caller's crate (BENCHMARKS.md, section 1).
    #[inline(always)]
    pub fn resolve(&self, target: &Target<'_>) -> &Arc<RetryPolicy> {
        for route in self.routes.iter() {
            if route.matcher.matches(target) {
                return &route.policy;
            }
        }
        &self.policy
    }
}

type Map<V> = HashMap<Arc<str>, V, foldhash::fast::FixedState>;

/// The endpoints by name: the one lookup every call makes.
///
/// Why not a `HashMap<Arc<str>, _>`: its key comparison goes through `str`'s `==`, a call into
/// `memcmp`, which costs more than hashing the short name (BENCHMARKS.md, success path).
/// hashbrown's `HashTable` takes the comparison as a closure, so it is the inline
/// [`crate::document::str_eq`]. Names are unique (the document is checked first).
#[derive(Clone, Debug, Default)]
struct Endpoints {
    table: hashbrown::HashTable<Arc<EndpointPolicy>>,
    hasher: foldhash::fast::FixedState,
}

impl Endpoints {
    #[inline]
    fn hash(&self, name: &str) -> u64 {
        self.hasher.hash_one(name)
    }

    fn insert(&mut self, endpoint: Arc<EndpointPolicy>) {
        let hash = self.hash(&endpoint.name);
        let hasher = &self.hasher;
        self.table
            .insert_unique(hash, endpoint, |e| hasher.hash_one(&*e.name));
    }

    #[inline]
    fn get(&self, name: &str) -> Option<&Arc<EndpointPolicy>> {
        self.table
            .find(self.hash(name), |e| crate::document::str_eq(&e.name, name))
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
#[error("invalid policy: {} error(s), first: {}", errors.len(), errors.first().map(ToString::to_string).unwrap_or_default())]
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
            return Err(InvalidPolicy { errors: diags });
        }
        Ok((Self::compile(document), diags))
    }

    /// Compiles an already checked document.
    fn compile(document: PolicyDocument) -> Self {
        let defaults = Arc::new(Overlay::resolve([&document.defaults]));
        let default_alert = document.defaults.alert();
        let mut endpoints = Endpoints::default();
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
            endpoints.insert(Arc::new(EndpointPolicy {
                name,
                policy,
                routes,
            }));
        }
        Self {
            document: Arc::new(document),
            defaults,
            endpoints,
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
        let mut names: Vec<&str> = self.endpoints.table.iter().map(|e| &*e.name).collect();
        names.sort_unstable();
        names
    }

    /// Number of endpoints.
    pub fn len(&self) -> usize {
        self.endpoints.table.len()
    }

    /// Whether there are no endpoints.
    pub fn is_empty(&self) -> bool {
        self.endpoints.table.is_empty()
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

/// Parses, checks and compiles policy-file bytes, reporting every problem at once. Never
/// panics; bounded time and memory on any input (see [`crate::yaml`] for the limits).
pub fn load(bytes: &[u8]) -> Loaded {
    let mut diagnostics = Vec::new();
    let document = match crate::yaml::parse(bytes) {
        Ok(root) => crate::parse::document(&root, &mut diagnostics),
        Err(e) => {
            diagnostics.push(Diagnostic::error(e.loc, "<root>", e.message));
            None
        }
    };
    let Some(document) = document else {
        return Loaded {
            policies: None,
            diagnostics,
        };
    };
    crate::validate::check(&document, &mut diagnostics);
    diag::normalize(&mut diagnostics);
    let policies =
        (!diagnostics.iter().any(Diagnostic::is_error)).then(|| PolicySet::compile(document));
    Loaded {
        policies,
        diagnostics,
    }
}

#[cfg(test)]
#[path = "set_tests.rs"]
mod tests;
