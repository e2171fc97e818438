//! What changed between two policy documents, by value (SPEC §3: Apply returns the diff).
//!
//! Places ([`Loc`](crate::yaml::Loc)) are ignored: a file saved again with new comments, blank
//! lines or flow-instead-of-block style has no changes. Endpoints are matched by name and their
//! order in the file does not matter (lookup is by name, through a map, so a diff of two
//! documents of n endpoints costs O(n)); routes are matched by their `match`,
//! and their order does matter (first match wins), so a reordering is reported. Values are
//! shown as a policy file writes them ([`crate::render::leaf_values`]).

use std::collections::{HashMap, HashSet};
use std::fmt;

use crate::document::{
    AlertOverlay, BackoffOverlay, BreakerOverlay, BudgetOverlay, EndpointDoc, Field, Overlay,
    PolicyDocument, RetryAfterOverlay, RetryOnOverlay, RouteDoc,
};
use crate::render::leaf_values;

/// How one scope changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ChangeKind {
    /// The endpoint is new.
    Added,
    /// The endpoint is gone.
    Removed,
    /// The endpoint (or `defaults`) is still there with different values.
    Modified,
}

impl ChangeKind {
    /// `added`, `removed` or `modified`.
    pub fn as_str(self) -> &'static str {
        match self {
            ChangeKind::Added => "added",
            ChangeKind::Removed => "removed",
            ChangeKind::Modified => "modified",
        }
    }
}

/// Where a change is: the file's `defaults:` block, or one endpoint.
///
/// Typed rather than a name, because `defaults` is also a valid endpoint name: an endpoint
/// called `defaults` must not be counted, summarised or shown as the `defaults:` block.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Scope {
    /// The file's `defaults:` block.
    Defaults,
    /// The endpoint of this name.
    Endpoint(String),
}

impl Scope {
    /// The endpoint's name; `None` for the `defaults:` block.
    pub fn endpoint(&self) -> Option<&str> {
        match self {
            Scope::Defaults => None,
            Scope::Endpoint(name) => Some(name),
        }
    }
}

/// `defaults` for the block, the name for an endpoint, and `endpoints.defaults` (the field path
/// in the file) for an endpoint named `defaults`, so that the two never read the same.
impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Scope::Defaults => f.write_str("defaults"),
            Scope::Endpoint(name) if name == "defaults" => f.write_str("endpoints.defaults"),
            Scope::Endpoint(name) => f.write_str(name),
        }
    }
}

/// What changed in one scope: `defaults` or one endpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Change {
    /// The `defaults:` block, or an endpoint.
    pub scope: Scope,
    /// Added, removed or modified.
    pub kind: ChangeKind,
    /// One line per changed field or route, such as `max_attempts: 3 -> 4`,
    /// `backoff.jitter: full (inherited) -> none`, `routes[0] added: POST /v1/charges`. A field
    /// the layer does not set shows the value it inherits (from the built-in values for
    /// `defaults`, from `defaults:` for an endpoint, from its endpoint for a route) on that
    /// side of the change. For an added endpoint, the fields it sets (`max_attempts: 4`); none
    /// for a removed one.
    pub details: Vec<String>,
}

/// `payments modified: max_attempts: 3 -> 4; deadline: …`
impl fmt::Display for Change {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.scope, self.kind.as_str())?;
        if !self.details.is_empty() {
            write!(f, ": {}", self.details.join("; "))?;
        }
        Ok(())
    }
}

/// Follows an inherited value: `full (inherited)`.
const INHERITED: &str = "(inherited)";

/// What each side's layers inherit: `defaults:` laid over the built-in values.
struct Bases {
    built_in: Overlay,
    old: Overlay,
    new: Overlay,
}

/// The changes from `old` to `new`: `defaults` first (when changed), then added and modified
/// endpoints in `new`'s order, then removed endpoints in `old`'s order. Empty when the two
/// documents hold the same values.
pub fn diff(old: &PolicyDocument, new: &PolicyDocument) -> Vec<Change> {
    let mut changes = Vec::new();
    let built_in = Overlay::built_in();
    let bases = Bases {
        old: old.defaults.over(&built_in),
        new: new.defaults.over(&built_in),
        built_in,
    };
    let defaults = overlay_changes(
        (&old.defaults, &bases.built_in),
        (&new.defaults, &bases.built_in),
        "",
    );
    if !defaults.is_empty() {
        changes.push(Change {
            scope: Scope::Defaults,
            kind: ChangeKind::Modified,
            details: defaults,
        });
    }
    // By name; the first of duplicate names counts, as `PolicyDocument::endpoint` finds it.
    let mut old_by_name: HashMap<&str, &EndpointDoc> = HashMap::with_capacity(old.endpoints.len());
    for ep in &old.endpoints {
        old_by_name.entry(ep.name.value.as_str()).or_insert(ep);
    }
    let new_names: HashSet<&str> = new
        .endpoints
        .iter()
        .map(|e| e.name.value.as_str())
        .collect();
    for ep in &new.endpoints {
        let name = &ep.name.value;
        let (kind, details) = match old_by_name.get(name.as_str()) {
            None => (ChangeKind::Added, added_endpoint(ep)),
            Some(before) => (ChangeKind::Modified, endpoint_changes(before, ep, &bases)),
        };
        if kind == ChangeKind::Added || !details.is_empty() {
            changes.push(Change {
                scope: Scope::Endpoint(name.clone()),
                kind,
                details,
            });
        }
    }
    for ep in &old.endpoints {
        if !new_names.contains(ep.name.value.as_str()) {
            changes.push(Change {
                scope: Scope::Endpoint(ep.name.value.clone()),
                kind: ChangeKind::Removed,
                details: Vec::new(),
            });
        }
    }
    changes
}

/// One line for a list of changes: `+1 endpoint (search), -0, 2 modified (inventory,
/// payments)` (with `, defaults modified` when the defaults changed), or `no changes`. Each
/// count names its endpoints, in the order of `changes`, up to [`SUMMARY_NAMES`] of them and
/// then how many more (`… 7 more`), so `history` says which endpoints a version changed.
pub fn summary(changes: &[Change]) -> String {
    if changes.is_empty() {
        return "no changes".to_owned();
    }
    // Named as the diff names them: an endpoint called `defaults` is `endpoints.defaults`.
    let of = |kind| -> Vec<String> {
        changes
            .iter()
            .filter(|c| c.kind == kind && c.scope != Scope::Defaults)
            .map(|c| c.scope.to_string())
            .collect()
    };
    let (added, removed, modified) = (
        of(ChangeKind::Added),
        of(ChangeKind::Removed),
        of(ChangeKind::Modified),
    );
    let mut line = format!(
        "+{} endpoint{}{}, -{}{}, {} modified{}",
        added.len(),
        if added.len() == 1 { "" } else { "s" },
        names_in_brief(&added),
        removed.len(),
        names_in_brief(&removed),
        modified.len(),
        names_in_brief(&modified),
    );
    if changes.iter().any(|c| c.scope == Scope::Defaults) {
        line.push_str(", defaults modified");
    }
    line
}

/// How many endpoint names a [`summary`] gives for each count before `… N more`: enough for the
/// usual change, and a summary of thousands of changes stays one readable line.
pub const SUMMARY_NAMES: usize = 3;

/// ` (a, b, c, … 4 more)`, or nothing for no names.
fn names_in_brief(names: &[String]) -> String {
    if names.is_empty() {
        return String::new();
    }
    let shown = names.len().min(SUMMARY_NAMES);
    let mut out = format!(" ({}", names[..shown].join(", "));
    if names.len() > shown {
        out.push_str(&format!(", … {} more", names.len() - shown));
    }
    out.push(')');
    out
}

/// Whether `a` and `b` hold the same values: equal once places are forgotten and endpoints
/// put in name order (the order of routes counts). For documents whose endpoint names are
/// unique this agrees with [`diff`] finding nothing (floating-point `-0.0`/NaN aside), but for
/// the order of lists that read as sets, which [`diff`] ignores and this does not (it is what
/// a content hash covers).
pub fn same_content(a: &PolicyDocument, b: &PolicyDocument) -> bool {
    canonical(a) == canonical(b)
}

// === value comparison ===

/// The changed leaves of one layer, each prefixed with `prefix` (`routes[0].`): the layer as
/// it was and is, each with what it inherits (every field set).
fn overlay_changes(
    (old, old_base): (&Overlay, &Overlay),
    (new, new_base): (&Overlay, &Overlay),
    prefix: &str,
) -> Vec<String> {
    // Compared with the lists as sets; shown as written.
    let (old_sets, new_sets) = (
        leaf_values(&lists_as_sets(old)),
        leaf_values(&lists_as_sets(new)),
    );
    let (old, new) = (leaf_values(old), leaf_values(new));
    let (old_base, new_base) = (leaf_values(old_base), leaf_values(new_base));
    let value = |leaves: &[(&str, String)], path: &str| {
        leaves
            .iter()
            .find(|(p, _)| *p == path)
            .map(|(_, v)| v.clone())
    };
    let shown = |set: Option<String>, base: &[(&str, String)], path: &str| match set {
        Some(value) => value,
        None => match value(base, path) {
            Some(inherited) => format!("{inherited} {INHERITED}"),
            None => INHERITED.to_owned(),
        },
    };
    // Fields that went from inherited to set at the value they inherited, or back: each is a
    // change of the document, not of what a call gets. A `defaults:` block that restates the
    // built-in values listed each of its 23 fields on every diff of it; two or more of a kind
    // are folded into one line, at the place of the first.
    let mut lines = Vec::new();
    // Per kind: where its first line goes, and each field with the line it would have.
    let mut kinds: [(usize, Vec<(String, String)>); 2] = [(0, Vec::new()), (0, Vec::new())];
    for path in crate::document::FIELD_PATHS
        .iter()
        .filter(|path| value(&old_sets, path) != value(&new_sets, path))
    {
        let (was, is) = (value(&old, path), value(&new, path));
        let kind = match (&was, &is) {
            (None, Some(v)) if value(&old_base, path).as_ref() == Some(v) => Some(0),
            (Some(v), None) if value(&new_base, path).as_ref() == Some(v) => Some(1),
            _ => None,
        };
        let line = format!(
            "{prefix}{path}: {} -> {}",
            shown(was, &old_base, path),
            shown(is, &new_base, path)
        );
        match kind {
            Some(k) => {
                if kinds[k].1.is_empty() {
                    kinds[k].0 = lines.len();
                }
                kinds[k].1.push((format!("{prefix}{path}"), line));
            }
            None => lines.push(line),
        }
    }
    // The later place first, so that the earlier one still counts from the start.
    let [(set_at, set), (unset_at, unset)] = kinds;
    let mut folds = [
        (set_at, set, "set to the values they inherited"),
        (unset_at, unset, "no longer set, inheriting the same values"),
    ];
    folds.sort_by_key(|(at, ..)| std::cmp::Reverse(*at));
    for (at, mut fields, what) in folds {
        let line = match fields.len() {
            0 => continue,
            1 => fields.remove(0).1,
            n => {
                // Every name: one line all the same (25 fields at most, about 450 bytes).
                let paths: Vec<String> = fields.into_iter().map(|(path, _)| path).collect();
                format!("{n} fields {what} ({})", paths.join(", "))
            }
        };
        lines.insert(at, line);
    }
    lines
}

/// `o` with the lists that read as sets (`retry_on`'s statuses, codes and error classes,
/// `idempotent_methods`) sorted, each value once: another order is no change.
fn lists_as_sets(o: &Overlay) -> Overlay {
    fn sorted<T: Ord + Clone>(list: &mut Option<Field<Vec<Field<T>>>>) {
        if let Some(l) = list {
            l.value.sort_by(|a, b| a.value.cmp(&b.value));
            l.value.dedup_by(|a, b| a.value == b.value);
        }
    }
    let mut o = o.clone();
    sorted(&mut o.retry_on.http_status);
    sorted(&mut o.retry_on.grpc_status);
    sorted(&mut o.retry_on.errors);
    sorted(&mut o.idempotent_methods);
    o
}

/// The fields a layer sets, as `prefix + path: value` lines.
fn set_lines(o: &Overlay, prefix: &str) -> Vec<String> {
    leaf_values(o)
        .into_iter()
        .map(|(path, value)| format!("{prefix}{path}: {value}"))
        .collect()
}

fn added_endpoint(ep: &EndpointDoc) -> Vec<String> {
    let mut lines = set_lines(&ep.overlay, "");
    for (i, route) in ep.routes.iter().enumerate() {
        lines.extend(added_route(i, route));
    }
    lines
}

fn added_route(i: usize, route: &RouteDoc) -> Vec<String> {
    let mut lines = vec![format!("routes[{i}] added: {}", route.matcher.value)];
    lines.extend(set_lines(&route.overlay, &format!("routes[{i}].")));
    lines
}

fn endpoint_changes(old: &EndpointDoc, new: &EndpointDoc, bases: &Bases) -> Vec<String> {
    let mut lines = overlay_changes((&old.overlay, &bases.old), (&new.overlay, &bases.new), "");
    // A route inherits from its endpoint.
    let (old_endpoint, new_endpoint) = (old.overlay.over(&bases.old), new.overlay.over(&bases.new));
    // Pair routes by their match, first unused occurrence, so that inserting a route does
    // not show every later one as changed.
    let mut used = vec![false; old.routes.len()];
    let mut pairs: Vec<(usize, usize)> = Vec::new();
    let mut route_lines = Vec::new();
    for (j, route) in new.routes.iter().enumerate() {
        let found = old
            .routes
            .iter()
            .enumerate()
            .position(|(i, r)| !used[i] && r.matcher.value == route.matcher.value);
        match found {
            Some(i) => {
                used[i] = true;
                pairs.push((i, j));
                route_lines.push((
                    j,
                    overlay_changes(
                        (&old.routes[i].overlay, &old_endpoint),
                        (&route.overlay, &new_endpoint),
                        &format!("routes[{j}]."),
                    ),
                ));
            }
            None => route_lines.push((j, added_route(j, route))),
        }
    }
    // Kept routes whose order among themselves changed now win different calls.
    let mut by_old = pairs.clone();
    by_old.sort_unstable();
    for (rank, &(i, j)) in pairs.iter().enumerate() {
        if by_old[rank] != (i, j) {
            let line = format!(
                "routes[{j}] moved from routes[{i}]: {}",
                new.routes[j].matcher.value
            );
            if let Some((_, l)) = route_lines.iter_mut().find(|(k, _)| *k == j) {
                l.insert(0, line);
            }
        }
    }
    lines.extend(route_lines.into_iter().flat_map(|(_, l)| l));
    for (i, route) in old.routes.iter().enumerate() {
        if !used[i] {
            lines.push(format!("routes[{i}] removed: {}", route.matcher.value));
        }
    }
    lines
}

// === canonical form ===

fn canonical(doc: &PolicyDocument) -> PolicyDocument {
    let mut endpoints: Vec<EndpointDoc> = doc
        .endpoints
        .iter()
        .map(|ep| EndpointDoc {
            name: unplace(&ep.name),
            overlay: unplace_overlay(&ep.overlay),
            routes: ep
                .routes
                .iter()
                .map(|r| RouteDoc {
                    matcher: unplace(&r.matcher),
                    prefix_loc: crate::yaml::Loc::UNKNOWN,
                    overlay: unplace_overlay(&r.overlay),
                    index: r.index,
                })
                .collect(),
        })
        .collect();
    endpoints.sort_by(|a, b| a.name.value.cmp(&b.name.value));
    PolicyDocument {
        defaults: unplace_overlay(&doc.defaults),
        endpoints,
    }
}

fn unplace<T: Clone>(f: &Field<T>) -> Field<T> {
    Field::new(f.value.clone())
}

fn opt<T: Clone>(f: &Option<Field<T>>) -> Option<Field<T>> {
    f.as_ref().map(unplace)
}

fn list<T: Clone>(f: &Option<Field<Vec<Field<T>>>>) -> Option<Field<Vec<Field<T>>>> {
    f.as_ref()
        .map(|l| Field::new(l.value.iter().map(unplace).collect()))
}

/// `o` with every place forgotten. Built field by field, without `..`, so that a new field
/// does not compile until it is handled here.
fn unplace_overlay(o: &Overlay) -> Overlay {
    let (b, r, ra, bu, cb) = (
        &o.backoff,
        &o.retry_on,
        &o.retry_after,
        &o.budget,
        &o.circuit_breaker,
    );
    Overlay {
        max_attempts: opt(&o.max_attempts),
        backoff: BackoffOverlay {
            base: opt(&b.base),
            max: opt(&b.max),
            multiplier: opt(&b.multiplier),
            jitter: opt(&b.jitter),
        },
        deadline: opt(&o.deadline),
        per_try_timeout: opt(&o.per_try_timeout),
        retry_on: RetryOnOverlay {
            http_status: list(&r.http_status),
            grpc_status: list(&r.grpc_status),
            errors: list(&r.errors),
        },
        idempotent_methods: list(&o.idempotent_methods),
        idempotency_key_header: opt(&o.idempotency_key_header),
        retry_after: RetryAfterOverlay {
            honor: opt(&ra.honor),
            max: opt(&ra.max),
        },
        budget: BudgetOverlay {
            enabled: opt(&bu.enabled),
            ratio: opt(&bu.ratio),
            min_per_second: opt(&bu.min_per_second),
            window: opt(&bu.window),
        },
        circuit_breaker: BreakerOverlay {
            enabled: opt(&cb.enabled),
            failure_ratio: opt(&cb.failure_ratio),
            min_requests: opt(&cb.min_requests),
            window: opt(&cb.window),
            open_for: opt(&cb.open_for),
            half_open_probes: opt(&cb.half_open_probes),
        },
        alert: AlertOverlay {
            retry_ratio: opt(&o.alert.retry_ratio),
        },
    }
}

#[cfg(test)]
#[path = "diff_tests.rs"]
mod tests;
