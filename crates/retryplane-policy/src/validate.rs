//! Range and cross-field checks on a [`PolicyDocument`] (SPEC §1).
//!
//! The same checks run on every document, whether parsed from a file, sent to the admin API or
//! received by an agent. Field checks run on each layer where the field is written; cross-field
//! checks (`backoff.max < backoff.base`, `per_try_timeout > deadline`, schedules that cannot fit)
//! run on every effective policy — the defaults, each endpoint, each route — and are reported at
//! the most specific layer that wrote one of the fields involved, once.

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::time::Duration;

use crate::backoff;
use crate::codes::{GrpcCode, RETRYABLE_4XX};
use crate::diag::Diagnostic;
use crate::document::{EndpointDoc, Level, Overlay, PolicyDocument, RouteMatch, Target};
use crate::model::{Jitter, RetryPolicy};
use crate::parse::{ROUTE_ALERT, check_method};
use crate::uri_path::{push_escape, stray_percent};
use crate::yaml::Loc;

/// Highest `max_attempts` accepted.
pub const MAX_ATTEMPTS_LIMIT: u32 = 10;
/// Above this many attempts, a warning.
pub const MAX_ATTEMPTS_WARN: u32 = 5;

/// The most methods `idempotent_methods` may list: HTTP defines nine and WebDAV a few more;
/// every call looks its method up in the list.
pub const MAX_IDEMPOTENT_METHODS: usize = 64;

/// Why `found` is not a valid `max_attempts`.
pub(crate) fn max_attempts_range(found: impl std::fmt::Display) -> String {
    format!("must be from 1 (never retry) to {MAX_ATTEMPTS_LIMIT}, found {found}")
}

/// gRPC codes that do not get better by repetition (the counterpart of the 4xx warning).
const NON_RETRYABLE_GRPC: [GrpcCode; 8] = [
    GrpcCode::InvalidArgument,
    GrpcCode::NotFound,
    GrpcCode::AlreadyExists,
    GrpcCode::PermissionDenied,
    GrpcCode::FailedPrecondition,
    GrpcCode::OutOfRange,
    GrpcCode::Unimplemented,
    GrpcCode::Unauthenticated,
];

/// Checks `doc`, appending every problem to `diags`. Errors already in `diags` (the parser's)
/// mark the fields they refused: cross-field checks leave those fields alone.
pub fn check(doc: &PolicyDocument, diags: &mut Vec<Diagnostic>) {
    check_parsed(doc, diags, &[]);
}

/// [`check`], where the errors of `diags` in the `detached` ranges are about layers the parser
/// left out of `doc` ([`crate::parse::document_and_detached`]): they mark no field of `doc`
/// as refused, even when their paths are its own (a duplicate endpoint's are the first one's).
pub(crate) fn check_parsed(
    doc: &PolicyDocument,
    diags: &mut Vec<Diagnostic>,
    detached: &[Range<usize>],
) {
    let mut refused = Refused::new(diags, detached);
    let mut listed = ListedOnce::default();
    let defaults_layers = [(Level::Defaults, "defaults".to_owned(), &doc.defaults)];
    check_layer_noting(&doc.defaults, "defaults", &mut refused, diags);
    let defaults_policy = check_effective(&defaults_layers, &refused, &mut listed, diags);
    let mut multipliers = Multipliers::default();
    multipliers.note(&defaults_layers, &refused, &defaults_policy);
    // Each name's first place. A file's parser already refuses a second endpoint of the same
    // name (and leaves it out), and so does the wire conversion; a document built in code gets
    // the same error here, since a set has one policy per name.
    let mut first_named: HashMap<&str, Loc> = HashMap::with_capacity(doc.endpoints.len());
    for ep in &doc.endpoints {
        let ep_path = crate::diag::endpoint_path(&ep.name.value);
        let first_diag = diags.len();
        if let Some(first) = first_named.insert(&ep.name.value, ep.name.loc) {
            first_named.insert(&ep.name.value, first);
            diags.push(Diagnostic::error(
                ep.name.loc,
                ep_path.clone(),
                format!(
                    "duplicate endpoint `{}` (first defined at {first})",
                    ep.name.value
                ),
            ));
            crate::diag::tag_endpoint(&mut diags[first_diag..], &ep.name.value, &ep_path);
            continue;
        }
        check_endpoint_name(&ep.name.value, ep.name.loc, &ep_path, diags);
        check_layer_noting(&ep.overlay, &ep_path, &mut refused, diags);
        let mut layers = defaults_layers.to_vec();
        layers.push((Level::Endpoint, ep_path.clone(), &ep.overlay));
        let policy = check_effective(&layers, &refused, &mut listed, diags);
        multipliers.note(&layers, &refused, &policy);
        check_numbers_of_what_is_off(&layers, &policy, diags);
        // Each match's first route, so that repeats are found in linear time, and the
        // earlier routes' matches, so that one made unreachable by a broader earlier match
        // (first match wins) is found in time linear in the size of the matches.
        // Paths name a route by its place as written (`RouteDoc::index`), which counts routes
        // the parser refused, so that every message about one route names the same index.
        // Prefixes are compared in their canonical spelling, as calls are matched
        // (`/v1/ch%61rges` is `/v1/charges`).
        let canonical: Vec<_> = ep
            .routes
            .iter()
            .map(|r| r.matcher.value.canonical_prefix())
            .collect();
        let mut first_route = HashMap::with_capacity(ep.routes.len());
        let mut earlier = Coverage::default();
        for (route, canonical) in ep.routes.iter().zip(&canonical) {
            let i = route.index;
            let route_path = format!("{ep_path}.routes[{i}]");
            check_layer_noting(&route.overlay, &route_path, &mut refused, diags);
            check_route_sharing(&route.overlay, &route_path, diags);
            let j = *first_route.entry(&route.matcher.value).or_insert(i);
            if j != i {
                diags.push(Diagnostic::warning(
                    route.matcher.loc,
                    format!("{route_path}.match"),
                    format!(
                        "this route can never match: routes[{j}] has the same match and comes first"
                    ),
                ));
            } else if let Some(j) = earlier.first_covering(&route.matcher.value, canonical) {
                diags.push(Diagnostic::warning(
                    route.matcher.loc,
                    format!("{route_path}.match"),
                    format!(
                        "this route can never match: routes[{j}] comes first and matches every call it matches"
                    ),
                ));
            }
            if let RouteMatch::Http { path_prefix, .. } = &route.matcher.value
                && let Some(advice) = unsendable_in_a_path(path_prefix)
            {
                diags.push(Diagnostic::warning(
                    route.prefix_loc,
                    format!("{route_path}.match.path_prefix"),
                    format!(
                        "`{}` matches no request: {advice}",
                        crate::diag::Quoted(path_prefix)
                    ),
                ));
            }
            if let RouteMatch::Http { path_prefix, .. } = &route.matcher.value
                && stray_percent(path_prefix).is_some()
            {
                diags.push(Diagnostic::warning(
                    route.prefix_loc,
                    format!("{route_path}.match.path_prefix"),
                    format!(
                        "`{}` has a `%` that starts no escape (`%` and two hex digits): a request carries a `%` as `%25`: write `{}`",
                        crate::diag::Quoted(path_prefix),
                        crate::diag::Quoted(&escape_stray_percents(path_prefix))
                    ),
                ));
            }
            if let RouteMatch::Http { path_prefix, .. } = &route.matcher.value
                && path_prefix.contains('*')
            {
                let literal = path_prefix.split('*').next().unwrap_or_default();
                // `/v1/*`: the prefix before the `*` is what was meant. `/v1/*/items`: that
                // prefix matches more than was meant, so it is offered as the wider choice.
                let advice = if path_prefix.trim_end_matches('*').contains('*') {
                    format!(
                        "a prefix matches by its start only: write a route for each value of the \
                         `*`, or `{}`, which matches every path that starts with it",
                        crate::diag::Quoted(literal)
                    )
                } else {
                    format!(
                        "a prefix already matches every path that starts with it: write `{}`",
                        crate::diag::Quoted(literal)
                    )
                };
                diags.push(Diagnostic::warning(
                    route.prefix_loc,
                    format!("{route_path}.match.path_prefix"),
                    format!(
                        "`{}` is matched as written: `*` is no wildcard in a path prefix ({advice})",
                        crate::diag::Quoted(path_prefix),
                    ),
                ));
            }
            earlier.add(&route.matcher.value, canonical, i);
            let mut route_layers = layers.clone();
            route_layers.push((Level::Route, route_path, &route.overlay));
            let policy = check_effective(&route_layers, &refused, &mut listed, diags);
            multipliers.note(&route_layers, &refused, &policy);
        }
        // Only this endpoint and its routes take a multiplier written in them.
        multipliers.warn_unused(Level::Endpoint, diags);
        crate::diag::tag_endpoint(&mut diags[first_diag..], &ep.name.value, &ep_path);
    }
    // `defaults:`'s is taken by every endpoint that does not set its own, and by the endpoints
    // the file does not name (noted above with the defaults alone).
    multipliers.warn_unused(Level::Defaults, diags);
}

/// Each `backoff.multiplier` written, and whether some effective policy that takes it lets it
/// act: `jitter: decorrelated` draws each pause from the one before (up to three times it),
/// and never reads the multiplier. A multiplier only such policies take does nothing, while
/// its place in the file says otherwise (and `explain` shows it).
#[derive(Default)]
struct Multipliers {
    /// Where each one is written, and whether it acts somewhere; in the order first met. At
    /// most `defaults:`'s and one endpoint's with its routes at a time (see `warn_unused`).
    written: Vec<(Level, Loc, String, bool)>,
    /// Where in `written` each path is: an endpoint of 16,500 routes that each set a
    /// multiplier searched the list per route (1.5 s).
    at: HashMap<String, usize>,
}

impl Multipliers {
    /// Notes the effective policy `p` of `layers`: which layer's multiplier it takes, if one is
    /// written, and whether that multiplier acts in it. Values refused are left to their
    /// errors.
    fn note(&mut self, layers: &Layers<'_>, refused: &Refused, p: &RetryPolicy) {
        let Some((level, loc, path)) = layers.iter().rev().find_map(|(level, prefix, o)| {
            o.loc_of("backoff.multiplier")
                .map(|loc| (*level, loc, format!("{prefix}.backoff.multiplier")))
        }) else {
            return;
        };
        if refused.any(layers, &["backoff.multiplier", "backoff.jitter"]) {
            return;
        }
        let acts = p.backoff.jitter != Jitter::Decorrelated;
        match self.at.get(&path).and_then(|&i| self.written.get_mut(i)) {
            Some(w) => w.3 |= acts,
            None => {
                self.at.insert(path.clone(), self.written.len());
                self.written.push((level, loc, path, acts));
            }
        }
    }

    /// Warns of each multiplier written at `level` (a route's counts as its endpoint's) that
    /// acts in no policy noted, and forgets those of that level.
    fn warn_unused(&mut self, level: Level, diags: &mut Vec<Diagnostic>) {
        let of_level = |l: Level| match level {
            Level::Defaults => l == Level::Defaults,
            _ => l != Level::Defaults,
        };
        for (_, loc, path, acts) in self.written.iter().filter(|w| of_level(w.0)) {
            if !acts {
                diags.push(Diagnostic::warning(
                    *loc,
                    path.clone(),
                    "does nothing: every policy that takes it has `jitter: decorrelated`, \
                     which draws each pause from the one before (up to three times it) and \
                     never reads the multiplier; remove it, or choose another jitter",
                ));
            }
        }
        self.written.retain(|w| !of_level(w.0));
        self.at = (self.written.iter().enumerate())
            .map(|(i, w)| (w.2.clone(), i))
            .collect();
    }
}

/// The problems that come from how the layers of one effective policy combine (the checks
/// that read several fields: `backoff.max` against `backoff.base`, attempts that cannot start
/// inside the deadline, no budget with many attempts), in a document that passed [`check`]:
/// of the `defaults:` alone with `None`, or of the call `target` of `endpoint`. Each is blamed
/// on the most specific layer that sets one of its fields, as [`check`] does, so a problem that
/// `check` reported at `defaults` comes back for an endpoint only if it still holds once the
/// endpoint's and the route's own values are applied.
pub fn cross_field_problems(
    doc: &PolicyDocument,
    call: Option<(&EndpointDoc, &Target<'_>)>,
) -> Vec<Diagnostic> {
    let mut named: Vec<(Level, String, &Overlay)> =
        vec![(Level::Defaults, "defaults".to_owned(), &doc.defaults)];
    if let Some((endpoint, target)) = call {
        let ep_path = crate::diag::endpoint_path(&endpoint.name.value);
        named.push((Level::Endpoint, ep_path.clone(), &endpoint.overlay));
        if let Some(route) = endpoint
            .routes
            .iter()
            .find(|r| r.matcher.value.matches(target))
        {
            let path = format!("{ep_path}.routes[{}]", route.index);
            named.push((Level::Route, path, &route.overlay));
        }
    }
    let mut diags = Vec::new();
    let mut listed = ListedOnce::default();
    check_effective(&named, &Refused::new(&[], &[]), &mut listed, &mut diags);
    diags
}

/// [`cross_field_problems`] of every call `endpoint` can take: its own policy (no route) and
/// each route's, as [`check`] finds them.
pub fn endpoint_cross_field_problems(
    doc: &PolicyDocument,
    endpoint: &EndpointDoc,
) -> Vec<Diagnostic> {
    let ep_path = crate::diag::endpoint_path(&endpoint.name.value);
    let mut layers: Vec<(Level, String, &Overlay)> = vec![
        (Level::Defaults, "defaults".to_owned(), &doc.defaults),
        (Level::Endpoint, ep_path.clone(), &endpoint.overlay),
    ];
    let none = Refused::new(&[], &[]);
    let mut diags = Vec::new();
    let mut listed = ListedOnce::default();
    check_effective(&layers, &none, &mut listed, &mut diags);
    for route in &endpoint.routes {
        let path = format!("{ep_path}.routes[{}]", route.index);
        layers.push((Level::Route, path, &route.overlay));
        check_effective(&layers, &none, &mut listed, &mut diags);
        layers.pop();
    }
    diags
}

/// The matches of an endpoint's routes so far, to find a later route that none of its calls
/// can reach: routes are tried in file order and the first match wins, so a route is dead when
/// an earlier one matches every call it does (an HTTP route with the same method or none and a
/// path prefix that starts its own; a gRPC route for every method of its service).
#[derive(Default)]
struct Coverage<'a> {
    /// The HTTP routes' path prefixes, by method (`None`: any method).
    http: HashMap<Option<&'a str>, PrefixTrie<'a>>,
    /// The first `/pkg.Service/*` route of each service.
    services: HashMap<&'a str, usize>,
}

impl<'a> Coverage<'a> {
    /// The first route added whose match fits every call `m` fits; `canonical` is `m`'s
    /// [`RouteMatch::canonical_prefix`].
    fn first_covering(&self, m: &RouteMatch, canonical: &str) -> Option<usize> {
        match m {
            RouteMatch::Http { method, .. } => {
                let path = canonical.as_bytes();
                let any = self.http.get(&None).and_then(|t| t.first_prefix_of(path));
                let same = method
                    .as_deref()
                    .and_then(|m| self.http.get(&Some(m)))
                    .and_then(|t| t.first_prefix_of(path));
                any.into_iter().chain(same).min()
            }
            RouteMatch::Grpc { service, .. } => self.services.get(service.as_str()).copied(),
        }
    }

    /// Adds route `index`'s match `m`, whose [`RouteMatch::canonical_prefix`] is `canonical`.
    fn add(&mut self, m: &'a RouteMatch, canonical: &'a str, index: usize) {
        match m {
            RouteMatch::Http { method, .. } => self
                .http
                .entry(method.as_deref())
                .or_default()
                .insert(canonical.as_bytes(), index),
            RouteMatch::Grpc {
                service,
                method: None,
            } => {
                self.services.entry(service).or_insert(index);
            }
            RouteMatch::Grpc { .. } => {}
        }
    }
}

/// Byte strings, each with the first index it was added with; finds those that start a given
/// string in time linear in its length. A radix tree whose edges borrow the strings added: its
/// size grows with the number of strings, not their length (a path prefix may be most of a
/// 1 MiB file, and a snapshot is checked by every agent).
struct PrefixTrie<'a> {
    /// The root first.
    nodes: Vec<TrieNode<'a>>,
}

impl Default for PrefixTrie<'_> {
    fn default() -> Self {
        Self {
            nodes: vec![TrieNode::default()],
        }
    }
}

#[derive(Default)]
struct TrieNode<'a> {
    /// Non-empty labels, no two starting with the same byte, sorted by that byte, each with
    /// the node it leads to.
    edges: Vec<(&'a [u8], usize)>,
    /// The first index added for the string that ends here.
    first: Option<usize>,
}

/// The first byte of an edge's label (labels are never empty; 0 stands in for none).
fn edge_byte(edge: &(&[u8], usize)) -> u8 {
    edge.0.first().copied().unwrap_or(0)
}

impl<'a> PrefixTrie<'a> {
    fn insert(&mut self, key: &'a [u8], index: usize) {
        let (mut at, mut rest) = (0, key);
        while let Some(&b) = rest.first() {
            let e = match self.nodes[at].edges.binary_search_by_key(&b, edge_byte) {
                Ok(e) => e,
                Err(e) => {
                    let leaf = self.push(TrieNode::default());
                    self.nodes[at].edges.insert(e, (rest, leaf));
                    at = leaf;
                    break;
                }
            };
            let (label, child) = self.nodes[at].edges[e];
            let common = label.iter().zip(rest).take_while(|(a, b)| a == b).count();
            if common < label.len() {
                // Split the edge where the key leaves it.
                let (head, tail) = label.split_at(common);
                let mid = self.push(TrieNode {
                    edges: vec![(tail, child)],
                    first: None,
                });
                self.nodes[at].edges[e] = (head, mid);
                at = mid;
            } else {
                at = child;
            }
            rest = &rest[common..];
        }
        self.nodes[at].first.get_or_insert(index);
    }

    fn push(&mut self, node: TrieNode<'a>) -> usize {
        self.nodes.push(node);
        self.nodes.len() - 1
    }

    /// The smallest index of the strings added that start `key` (`key` itself included).
    fn first_prefix_of(&self, key: &[u8]) -> Option<usize> {
        let mut node = &self.nodes[0];
        let mut first = node.first;
        let mut rest = key;
        while let Some(&b) = rest.first() {
            let Ok(e) = node.edges.binary_search_by_key(&b, edge_byte) else {
                break;
            };
            let (label, child) = node.edges[e];
            let Some(after) = rest.strip_prefix(label) else {
                break;
            };
            node = &self.nodes[child];
            rest = after;
            first = match (first, node.first) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
        }
        first
    }
}

/// [`check_layer`], noting the fields it refuses in `refused`: the cross-field checks of the
/// effective policies that take a value from this layer leave those fields alone, as they do the
/// parser's refusals (a `deadline: 0s` is one error, not also a deadline shorter than
/// `per_try_timeout` and a schedule that cannot fit in it).
fn check_layer_noting(
    o: &Overlay,
    prefix: &str,
    refused: &mut Refused,
    diags: &mut Vec<Diagnostic>,
) {
    let first = diags.len();
    check_layer(o, prefix, diags);
    refused.note(&diags[first..]);
}

/// The checks of one layer that does not make it into the document, so that its problems are
/// still reported with the rest: a route whose `match` was refused, or a second endpoint of a
/// name already used. Cross-layer checks need the layer's place in a policy, which it has not.
pub(crate) fn check_detached(o: &Overlay, prefix: &str, route: bool, diags: &mut Vec<Diagnostic>) {
    check_layer(o, prefix, diags);
    if route {
        check_route_sharing(o, prefix, diags);
    }
}

/// The budget and the breaker are per endpoint: one of each, built from the endpoint's own
/// settings and shared by every call of the endpoint, whichever route it takes. So the one
/// thing a route can do with them is turn them off for its calls (`enabled: false`); numbers
/// or `enabled: true` on a route would be shown but never run, and are refused. Alerting is per
/// endpoint too, so a route cannot set it at all (a file gets this from the parser, a wire
/// document here).
fn check_route_sharing(o: &Overlay, prefix: &str, diags: &mut Vec<Diagnostic>) {
    for (field, loc) in o.set_fields() {
        if field.starts_with("alert.") {
            diags.push(Diagnostic::error(
                loc,
                format!("{prefix}.{field}"),
                ROUTE_ALERT,
            ));
            continue;
        }
        let section = match field.split_once('.') {
            Some((section @ ("budget" | "circuit_breaker"), _)) => section,
            _ => continue,
        };
        let turns_off = match field {
            "budget.enabled" => o.budget.enabled.as_ref().is_some_and(|f| !f.value),
            "circuit_breaker.enabled" => {
                o.circuit_breaker.enabled.as_ref().is_some_and(|f| !f.value)
            }
            _ => false,
        };
        if !turns_off {
            diags.push(Diagnostic::error(
                loc,
                format!("{prefix}.{field}"),
                route_shared_message(section),
            ));
        }
    }
}

/// Why a route cannot set `section` (`budget` or `circuit_breaker`) other than to turn it off.
fn route_shared_message(section: &str) -> String {
    format!(
        "{section} is per endpoint, shared by its routes; a route can only turn it off (enabled: false): set it on the endpoint or in `defaults:`"
    )
}

/// An endpoint name's own rule (letters, length), at `path`.
pub(crate) fn check_endpoint_name(name: &str, loc: Loc, path: &str, diags: &mut Vec<Diagnostic>) {
    let ok = !name.is_empty()
        && name.len() <= crate::diag::MAX_ENDPOINT_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
    if !ok {
        // `é` is a letter to whoever wrote it: say which letters.
        let rule = "endpoint names are 1 to 128 ASCII letters, digits, `-`, `_` or `.`";
        let message = if name.len() > crate::diag::MAX_ENDPOINT_NAME {
            format!("{rule}; this one is {} bytes long", name.len())
        } else {
            rule.to_owned()
        };
        diags.push(Diagnostic::error(loc, path, message));
    }
}

/// Checks of single fields, where they are written.
fn check_layer(o: &Overlay, prefix: &str, diags: &mut Vec<Diagnostic>) {
    let path = |field: &str| format!("{prefix}.{field}");
    let mut error =
        |loc, field: &str, msg: String| diags.push(Diagnostic::error(loc, path(field), msg));
    if let Some(f) = &o.max_attempts
        && !(1..=MAX_ATTEMPTS_LIMIT).contains(&f.value)
    {
        error(f.loc, "max_attempts", max_attempts_range(f.value));
    }
    if let Some(f) = &o.idempotent_methods
        && f.value.len() > MAX_IDEMPOTENT_METHODS
    {
        error(
            f.loc,
            "idempotent_methods",
            format!(
                "lists {} methods; at most {MAX_IDEMPOTENT_METHODS} (every call on the endpoint looks its method up in this list)",
                f.value.len()
            ),
        );
    }
    for (field, value) in [
        ("backoff.base", &o.backoff.base),
        ("backoff.max", &o.backoff.max),
        ("deadline", &o.deadline),
        ("per_try_timeout", &o.per_try_timeout),
        ("retry_after.max", &o.retry_after.max),
        ("budget.window", &o.budget.window),
        ("circuit_breaker.window", &o.circuit_breaker.window),
        ("circuit_breaker.open_for", &o.circuit_breaker.open_for),
    ] {
        if let Some(f) = value
            && f.value.is_zero()
        {
            error(f.loc, field, "must be longer than zero".to_owned());
        }
    }
    if let Some(f) = &o.backoff.multiplier
        && !(f.value >= 1.0 && f.value <= 100.0)
    {
        error(
            f.loc,
            "backoff.multiplier",
            format!(
                "must be from 1.0 to 100.0, found {}",
                crate::render::float(&f.value)
            ),
        );
    }
    if let Some(f) = &o.budget.ratio
        && !(0.0..=1.0).contains(&f.value)
    {
        error(
            f.loc,
            "budget.ratio",
            format!(
                "must be from 0.0 to 1.0, found {}",
                crate::render::float(&f.value)
            ),
        );
    }
    if let Some(f) = &o.alert.retry_ratio
        && !(0.0..=1.0).contains(&f.value)
    {
        error(
            f.loc,
            "alert.retry_ratio",
            format!(
                "must be from 0.0 (flag any retry) to 1.0 (one retry per call), found {}",
                crate::render::float(&f.value)
            ),
        );
    }
    if let Some(f) = &o.circuit_breaker.failure_ratio
        && !(0.0..=1.0).contains(&f.value)
    {
        error(
            f.loc,
            "circuit_breaker.failure_ratio",
            format!(
                "must be from 0.0 (open on any failure once min_requests is met) to 1.0 (only when every attempt fails), found {}",
                crate::render::float(&f.value)
            ),
        );
    }
    for (field, value) in [
        (
            "circuit_breaker.min_requests",
            &o.circuit_breaker.min_requests,
        ),
        (
            "circuit_breaker.half_open_probes",
            &o.circuit_breaker.half_open_probes,
        ),
    ] {
        if let Some(f) = value
            && f.value == 0
        {
            error(f.loc, field, "must be at least 1".to_owned());
        }
    }
    if let Some(f) = &o.circuit_breaker.half_open_probes
        && f.value > crate::breaker::MAX_HALF_OPEN_PROBES
    {
        error(
            f.loc,
            "circuit_breaker.half_open_probes",
            format!(
                "must be from 1 to {}, found {}",
                crate::breaker::MAX_HALF_OPEN_PROBES,
                f.value
            ),
        );
    }
    if let Some(f) = &o.idempotency_key_header {
        let token = !f.value.is_empty()
            && f.value
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b));
        if !token {
            error(
                f.loc,
                "idempotency_key_header",
                format!(
                    "`{}` is not a valid HTTP header name (letters, digits and ``!#$%&'*+-.^_`|~``, no space)",
                    crate::diag::Quoted(&f.value)
                ),
            );
        }
    }
    if let Some(list) = &o.idempotent_methods {
        // Named by the list, not the item's index: the parser has already left out any item
        // of another type, so an index here would not count the list as written. The item's
        // line and column say which it is.
        for m in &list.value {
            if let Err(msg) = check_method(&m.value) {
                error(m.loc, "idempotent_methods", msg);
            }
        }
    }
    let mut warn =
        |loc, field: String, msg: String| diags.push(Diagnostic::warning(loc, path(&field), msg));
    if let Some(f) = &o.max_attempts
        && f.value > MAX_ATTEMPTS_WARN
        && f.value <= MAX_ATTEMPTS_LIMIT
    {
        warn(
            f.loc,
            "max_attempts".into(),
            format!(
                "{} attempts multiply load by up to {}x during an outage; more than {MAX_ATTEMPTS_WARN} rarely helps",
                f.value, f.value
            ),
        );
    }
    if let Some(f) = &o.idempotency_key_header
        && COMMON_HEADERS
            .iter()
            .any(|h| h.eq_ignore_ascii_case(&f.value))
    {
        warn(
            f.loc,
            "idempotency_key_header".into(),
            format!(
                "`{}` is sent with most requests, not only by clients that mean it as an idempotency key: any request carrying it, POST included, would be retried after a timeout or a reset; name a header of its own (`Idempotency-Key`)",
                f.value
            ),
        );
    }
    if let Some(list) = &o.idempotent_methods {
        // Once per method, as the repeats below.
        let (mut post, mut patch) = (false, false);
        for m in &list.value {
            let said = match m.value.as_str() {
                "POST" => &mut post,
                "PATCH" => &mut patch,
                _ => continue,
            };
            if !std::mem::replace(said, true) {
                warn(
                    m.loc,
                    "idempotent_methods".into(),
                    format!(
                        "{} is not idempotent by definition: retrying it may apply a change twice; prefer the idempotency key header",
                        m.value
                    ),
                );
            }
        }
    }
    // Repeats found through a set: a list is as long as its file makes it. Each value is
    // warned of once (at its first place, and a repeat at its second): a list that repeats a
    // value a million times gets two warnings, not two million.
    if let Some(list) = &o.retry_on.http_status {
        let mut seen = Repeats::default();
        for s in &list.value {
            match seen.note(s.value) {
                Seen::First
                    if (400..500).contains(&s.value) && !RETRYABLE_4XX.contains(&s.value) =>
                {
                    warn(
                        s.loc,
                        "retry_on.http_status".into(),
                        format!(
                            "{} is a client error that does not get better by repetition",
                            s.value
                        ),
                    );
                }
                Seen::Second => warn(
                    s.loc,
                    "retry_on.http_status".into(),
                    format!("{} is listed twice", s.value),
                ),
                _ => {}
            }
        }
    }
    if let Some(list) = &o.retry_on.grpc_status {
        let mut seen = Repeats::default();
        for c in &list.value {
            match seen.note(c.value) {
                Seen::First if NON_RETRYABLE_GRPC.contains(&c.value) => warn(
                    c.loc,
                    "retry_on.grpc_status".into(),
                    format!("{} does not get better by repetition", c.value.name()),
                ),
                Seen::Second => warn(
                    c.loc,
                    "retry_on.grpc_status".into(),
                    format!("{} is listed twice", c.value.name()),
                ),
                _ => {}
            }
        }
    }
    // The other lists say a repeat the way `http_status` does.
    if let Some(list) = &o.retry_on.errors {
        let mut seen = Repeats::default();
        for e in &list.value {
            if seen.note(e.value.as_str()) == Seen::Second {
                warn(
                    e.loc,
                    "retry_on.errors".into(),
                    format!("{} is listed twice", e.value.as_str()),
                );
            }
        }
    }
    if let Some(list) = &o.idempotent_methods {
        let mut seen = Repeats::default();
        for m in &list.value {
            if seen.note(m.value.as_str()) == Seen::Second {
                warn(
                    m.loc,
                    "idempotent_methods".into(),
                    format!("{} is listed twice", m.value),
                );
            }
        }
    }
}

/// How often a list has held a value so far: see [`Repeats::note`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Seen {
    First,
    Second,
    Again,
}

/// The values of one list seen so far, and which of them were seen twice.
struct Repeats<T> {
    seen: HashSet<T>,
    repeated: HashSet<T>,
}

impl<T> Default for Repeats<T> {
    fn default() -> Self {
        Self {
            seen: HashSet::new(),
            repeated: HashSet::new(),
        }
    }
}

impl<T: Eq + std::hash::Hash + Copy> Repeats<T> {
    /// Notes one more item of the list: whether it is the value's first, second or a later
    /// place.
    fn note(&mut self, value: T) -> Seen {
        if self.seen.insert(value) {
            Seen::First
        } else if self.repeated.insert(value) {
            Seen::Second
        } else {
            Seen::Again
        }
    }
}

type Layers<'a> = [(Level, String, &'a Overlay)];

/// An endpoint that sets the budget's or the breaker's numbers while its effective policy has
/// that part turned off (by `defaults:`, or by the endpoint itself): the numbers do nothing.
/// Not said of `defaults:`, whose numbers an endpoint that turns the part on gets. `p` is the
/// effective policy of `layers`.
fn check_numbers_of_what_is_off(layers: &Layers<'_>, p: &RetryPolicy, diags: &mut Vec<Diagnostic>) {
    let Some((_, prefix, endpoint)) = layers.last() else {
        return;
    };
    let parts: [(&str, bool, &[&str]); 2] = [
        (
            "budget",
            p.budget.is_none(),
            &["budget.ratio", "budget.min_per_second", "budget.window"],
        ),
        (
            "circuit_breaker",
            p.circuit_breaker.is_none(),
            &[
                "circuit_breaker.failure_ratio",
                "circuit_breaker.min_requests",
                "circuit_breaker.window",
                "circuit_breaker.open_for",
                "circuit_breaker.half_open_probes",
            ],
        ),
    ];
    for (part, off, fields) in parts {
        if !off {
            continue;
        }
        let enabled = format!("{part}.enabled");
        let (_, turned_off) = blame(layers, &[enabled.as_str()]);
        let name = part.replace('_', " ");
        let why = if turned_off.starts_with(&format!("{prefix}.")) {
            format!("has no effect: this endpoint turns the {name} off (`{enabled}: false`)")
        } else {
            format!(
                "has no effect: the {name} is off ({turned_off} is false); set `{enabled}: true` on this endpoint to use it"
            )
        };
        for field in fields {
            if let Some(loc) = endpoint.loc_of(field) {
                diags.push(Diagnostic::warning(
                    loc,
                    format!("{prefix}.{field}"),
                    why.clone(),
                ));
            }
        }
    }
}

/// [`blame`] for a cross-field problem of `fields`, or `None` when one of them is refused
/// already (that error is reported, and the value is not what the author wrote).
fn blame_unrefused(
    layers: &Layers<'_>,
    refused: &Refused,
    fields: &[&str],
) -> Option<(Loc, String)> {
    (!refused.any(layers, fields)).then(|| blame(layers, fields))
}

/// The place and path of the most specific layer that writes one of `fields`; the top layer's
/// own path when none does.
fn blame(layers: &Layers<'_>, fields: &[&str]) -> (Loc, String) {
    for (_, prefix, overlay) in layers.iter().rev() {
        for field in fields {
            if let Some(loc) = overlay.loc_of(field) {
                return (loc, format!("{prefix}.{field}"));
            }
        }
    }
    let (_, prefix, _) = &layers[layers.len() - 1];
    (Loc::UNKNOWN, prefix.clone())
}

/// The paths of the values refused: by the parser, before [`check`] ran (the field is then
/// absent from its layer, and the effective policy holds a lower layer's value, often the
/// built-in one, in its place), or by [`check_layer`]'s range checks (the field holds the
/// refused value). Either way the effective value is not one the file may hold.
///
/// Kept apart, because a parser error's path may also be that of a field its layer does set:
/// a key written twice (the first value is kept, and is checked). So a parser refusal counts
/// only where its layer does not set the field, and a range refusal wherever it is written.
/// The errors of layers left out of the document (an endpoint written twice, whose paths are
/// the first one's; a route whose `match` was refused) are not refusals of its fields at all:
/// the parser says which they are, and they are not counted.
struct Refused {
    parsed: HashSet<String>,
    ranges: HashSet<String>,
}

/// The paths of the errors among `diags`.
fn error_paths(diags: &[Diagnostic]) -> impl Iterator<Item = String> + '_ {
    diags
        .iter()
        .filter(|d| d.is_error())
        .map(|d| d.path.clone())
}

impl Refused {
    /// The parser's refusals: the errors among `diags`, except those in the `detached` ranges.
    fn new(diags: &[Diagnostic], detached: &[Range<usize>]) -> Self {
        let mut attached = vec![true; diags.len()];
        for range in detached {
            if let Some(flags) = attached.get_mut(range.clone()) {
                flags.fill(false);
            }
        }
        let kept = diags
            .iter()
            .zip(attached)
            .filter_map(|(d, attached)| attached.then_some(d));
        Self {
            parsed: kept
                .filter(|d| d.is_error())
                .map(|d| d.path.clone())
                .collect(),
            ranges: HashSet::new(),
        }
    }

    /// Adds the paths of the errors among `diags`, [`check_layer`]'s range checks.
    fn note(&mut self, diags: &[Diagnostic]) {
        self.ranges.extend(error_paths(diags));
    }

    /// Whether the effective value of one of `fields` is, or stands in for, a value the file
    /// wrote but that was refused: the most specific layer that says anything about the field
    /// had it refused (the field itself, or its whole section, such as `backoff: 5`).
    fn any(&self, layers: &Layers<'_>, fields: &[&str]) -> bool {
        !(self.parsed.is_empty() && self.ranges.is_empty())
            && fields.iter().any(|f| self.field(layers, f))
    }

    fn field(&self, layers: &Layers<'_>, field: &str) -> bool {
        let section = field.split_once('.').map(|(s, _)| s);
        for (_, prefix, overlay) in layers.iter().rev() {
            let path = format!("{prefix}.{field}");
            // Refused for its range where it is written.
            if self.ranges.contains(&path) {
                return true;
            }
            let set = overlay.set_fields();
            if set.iter().any(|(p, _)| *p == field) {
                return false;
            }
            // Left out of its layer by the parser.
            if self.parsed.contains(&path) {
                return true;
            }
            if let Some(section) = section
                && !set
                    .iter()
                    .any(|(p, _)| p.strip_prefix(section).is_some_and(|r| r.starts_with('.')))
                && {
                    let path = format!("{prefix}.{section}");
                    self.parsed.contains(&path) || self.ranges.contains(&path)
                }
            {
                return true;
            }
        }
        false
    }
}

/// The cross-field problems blamed on `defaults:` listed so far. Every endpoint and route
/// that takes the fields from there finds the same problem again; each is kept once, not once
/// for each of them (four problems in `defaults:` beside 65,000 endpoints built 260,000
/// diagnostics, sorted before the repeats were dropped, to keep 4).
#[derive(Default)]
struct ListedOnce(HashSet<Diagnostic>);

impl ListedOnce {
    /// Appends `d` to `diags`, unless it is about `defaults:` and listed already.
    fn push(&mut self, diags: &mut Vec<Diagnostic>, d: Diagnostic) {
        if crate::diag::is_within(&d.path, "defaults") && !self.0.insert(d.clone()) {
            return;
        }
        diags.push(d);
    }
}

/// Cross-field checks on the effective policy the layers make. A check that involves a refused
/// field is skipped: that error is reported already, and the value in the policy is either out
/// of range or, for a value the parser refused, not what the author wrote. A problem blamed on
/// `defaults:` that `listed` holds already is not listed again.
/// Returns that effective policy.
fn check_effective(
    layers: &Layers<'_>,
    refused: &Refused,
    listed: &mut ListedOnce,
    diags: &mut Vec<Diagnostic>,
) -> RetryPolicy {
    let p: RetryPolicy = Overlay::resolve(layers.iter().map(|(_, _, o)| *o));
    let mut push = |d: Diagnostic| listed.push(diags, d);
    if p.backoff.max < p.backoff.base
        && let Some((loc, path)) =
            blame_unrefused(layers, refused, &["backoff.max", "backoff.base"])
    {
        push(Diagnostic::error(
            loc,
            path,
            format!(
                "backoff.max ({}) is shorter than backoff.base ({})",
                fmt(p.backoff.max),
                fmt(p.backoff.base)
            ),
        ));
    }
    // A zero deadline is refused where it is written; every per_try_timeout is longer.
    if p.per_try_timeout > p.deadline
        && !p.deadline.is_zero()
        && let Some((loc, path)) =
            blame_unrefused(layers, refused, &["per_try_timeout", "deadline"])
    {
        push(Diagnostic::error(
            loc,
            path,
            format!(
                "per_try_timeout ({}) is longer than the deadline ({})",
                fmt(p.per_try_timeout),
                fmt(p.deadline)
            ),
        ));
    }
    // Values already refused field by field would only make noise here.
    let schedule_valid = p.max_attempts <= MAX_ATTEMPTS_LIMIT
        && p.backoff.multiplier >= 1.0
        && !p.backoff.base.is_zero()
        && !p.deadline.is_zero()
        && p.backoff.max >= p.backoff.base;
    // Every field the schedule depends on: a layer that only changes the jitter (or the cap)
    // can be what makes attempts unreachable.
    const SCHEDULE: [&str; 6] = [
        "max_attempts",
        "deadline",
        "backoff.base",
        "backoff.max",
        "backoff.multiplier",
        "backoff.jitter",
    ];
    if p.max_attempts > 1
        && schedule_valid
        && let Some(first) =
            backoff::first_unreachable_attempt(&p.backoff, p.max_attempts, p.deadline)
        && let Some((loc, path)) = blame_unrefused(layers, refused, &SCHEDULE)
    {
        let (attempts, them) = if first == p.max_attempts {
            (format!("attempt {first}"), "it")
        } else {
            (format!("attempts {first} to {}", p.max_attempts), "them")
        };
        push(Diagnostic::warning(
            loc,
            path,
            format!(
                "{attempts} can never start inside the deadline ({}): the shortest possible pauses before {them} add up to the deadline or more",
                fmt(p.deadline)
            ),
        ));
    }
    if let Some(b) = &p.budget
        && b.min_per_second > 0
        && crate::budget::reserve_per_window(b) == 0
        && let Some((loc, path)) =
            blame_unrefused(layers, refused, &["budget.min_per_second", "budget.window"])
    {
        push(Diagnostic::warning(
            loc,
            path,
            format!(
                "the reserve allows no retry: {} retries/s over a {} window is less than one, and the reserve is counted per window, rounded down; lengthen budget.window or raise budget.min_per_second",
                b.min_per_second,
                fmt(b.window)
            ),
        ));
    }
    // No ratio and no reserve: the budget refuses every retry, whatever the traffic.
    if let Some(b) = &p.budget
        && b.min_per_second == 0
        && b.ratio == 0.0
        && p.max_attempts > 1
        && let Some((loc, path)) =
            blame_unrefused(layers, refused, &["budget.ratio", "budget.min_per_second"])
    {
        let never = if p.max_attempts == 2 {
            "attempt 2 never starts".to_owned()
        } else {
            format!("attempts 2 to {} never start", p.max_attempts)
        };
        push(Diagnostic::warning(
            loc,
            path,
            format!(
                "the budget allows no retry: with ratio 0 and min_per_second 0, {never}; set max_attempts: 1 to say so, or raise budget.ratio or budget.min_per_second"
            ),
        ));
    }
    if p.budget.is_none()
        && p.max_attempts > 3
        && let Some((loc, path)) =
            blame_unrefused(layers, refused, &["budget.enabled", "max_attempts"])
    {
        push(Diagnostic::warning(
            loc,
            path,
            format!(
                "budget disabled with max_attempts {}: nothing bounds retry load in an outage",
                p.max_attempts
            ),
        ));
    }
    p
}

/// Headers most requests carry whatever the client means, and those clients, proxies and
/// tracing set on every request they send (a gRPC deadline, which the agent's tower layer itself
/// writes on each attempt; request and trace ids): not an idempotency key.
const COMMON_HEADERS: [&str; 20] = [
    "accept",
    "accept-encoding",
    "accept-language",
    "authorization",
    "connection",
    "content-length",
    "content-type",
    "cookie",
    "grpc-accept-encoding",
    "grpc-encoding",
    "grpc-timeout",
    "host",
    "te",
    "traceparent",
    "tracestate",
    "user-agent",
    "x-amzn-trace-id",
    "x-b3-traceid",
    "x-forwarded-for",
    "x-request-id",
];

/// What to write instead of `prefix`, if it holds what no request path carries as written:
/// `?` or `#` (routes match the path alone: a query or a fragment is never part of it), or a
/// space or a control character (a request line or URI holds none raw; a request carries it
/// percent-encoded). Other characters are left alone: whether a client sends a non-ASCII
/// letter, `|` or `[` raw or encoded depends on the client. The encoding is written here: it
/// covers a space and the control characters only, and the policy crate has no URL dependency.
fn unsendable_in_a_path(prefix: &str) -> Option<String> {
    let unsendable = |b: u8| b.is_ascii_control() || b == b' ';
    // A space or a control character, percent-encoded as a request carries it.
    let encoded = |path: &str| {
        let mut out = String::with_capacity(path.len() + 8);
        for c in path.chars() {
            match u8::try_from(c) {
                Ok(b) if unsendable(b) => push_escape(&mut out, b),
                _ => out.push(c),
            }
        }
        out
    };
    if let Some(at) = prefix.find(['?', '#']) {
        return Some(format!(
            "routes match a request's path alone, without its query or fragment: write `{}`",
            crate::diag::Quoted(&encoded(&prefix[..at]))
        ));
    }
    prefix.bytes().any(unsendable).then(|| {
        format!(
            "a request carries a space or a control character in its path percent-encoded: write `{}`",
            crate::diag::Quoted(&encoded(prefix))
        )
    })
}

/// `prefix` with each `%` that starts no escape written `%25`.
fn escape_stray_percents(prefix: &str) -> String {
    let mut out = String::with_capacity(prefix.len() + 4);
    let mut rest = prefix;
    while let Some(at) = stray_percent(rest) {
        out.push_str(&rest[..at]);
        push_escape(&mut out, b'%');
        rest = &rest[at + 1..];
    }
    out.push_str(rest);
    out
}

fn fmt(d: Duration) -> String {
    crate::duration::format_duration(d)
}

#[cfg(test)]
mod prefix_trie_tests {
    use proptest::prelude::*;

    use super::PrefixTrie;

    proptest! {
        /// The first index among the strings added that start a key, as a scan of them all
        /// finds it; over a small alphabet, so that prefixes share and split edges often.
        #[test]
        fn finds_what_a_scan_finds(
            added in prop::collection::vec("[ab/]{0,6}", 0..12),
            keys in prop::collection::vec("[ab/]{0,8}", 1..12),
        ) {
            let mut trie = PrefixTrie::default();
            for (i, s) in added.iter().enumerate() {
                trie.insert(s.as_bytes(), i);
            }
            for key in &keys {
                let scan = added.iter().position(|s| key.starts_with(s.as_str()));
                prop_assert_eq!(trie.first_prefix_of(key.as_bytes()), scan, "{:?} in {:?}", key, added);
            }
        }
    }

    #[test]
    fn its_size_grows_with_the_strings_not_their_length() {
        let long = "/v".repeat(100_000);
        let mut trie = PrefixTrie::default();
        trie.insert(long.as_bytes(), 0);
        trie.insert(&long.as_bytes()[..1_000], 1);
        trie.insert(b"/x", 2);
        assert!(trie.nodes.len() <= 6, "{}", trie.nodes.len());
        assert_eq!(trie.first_prefix_of(long.as_bytes()), Some(0));
        assert_eq!(trie.first_prefix_of(&long.as_bytes()[..5_000]), Some(1));
        assert_eq!(trie.first_prefix_of(b"/v"), None);
    }
}

#[cfg(test)]
mod listed_once_tests {
    #![allow(clippy::unwrap_used)]

    use crate::diag::Diagnostic;

    /// [`super::check`]'s problems of `yaml`, as it lists them (before they are sorted and
    /// their repeats dropped).
    fn checked(yaml: &str) -> Vec<Diagnostic> {
        let root = crate::yaml::parse_noting(yaml.as_bytes()).unwrap().0;
        let mut diags = Vec::new();
        let doc = crate::parse::document(&root, &mut diags).unwrap();
        assert!(diags.is_empty(), "{diags:?}");
        super::check(&doc, &mut diags);
        diags
    }

    /// A cross-field problem of `defaults:` is listed once, not once more for each endpoint
    /// and route that takes the fields from there; one an endpoint's own field makes is listed
    /// for that endpoint, and one that first shows where an endpoint turns a part on (the
    /// budget's reserve, here) is listed once too.
    #[test]
    fn a_problem_of_the_defaults_is_listed_once_whatever_the_endpoints() {
        let mut yaml = "version: 1\ndefaults:\n  deadline: 1s\n  per_try_timeout: 2s\n  backoff: {base: 200ms, max: 100ms}\n  budget: {enabled: false, min_per_second: 1, window: 100ms}\nendpoints:\n".to_owned();
        for i in 0..50 {
            yaml.push_str(&format!(
                "  e{i}:\n    budget: {{enabled: true}}\n    routes:\n      - match: {{path_prefix: /a}}\n      - match: {{path_prefix: /b}}\n"
            ));
        }
        yaml.push_str("  own:\n    per_try_timeout: 3s\n");
        let diags = checked(&yaml);
        let paths: Vec<&str> = diags.iter().map(|d| d.path.as_str()).collect();
        let count = |path: &str| paths.iter().filter(|p| **p == path).count();
        assert_eq!(count("defaults.per_try_timeout"), 1, "{paths:?}");
        assert_eq!(count("defaults.backoff.max"), 1, "{paths:?}");
        assert_eq!(count("defaults.budget.min_per_second"), 1, "{paths:?}");
        assert_eq!(count("endpoints.own.per_try_timeout"), 1, "{paths:?}");
        assert_eq!(diags.len(), 4, "{diags:?}");
    }
}
