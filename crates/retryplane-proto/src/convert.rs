//! Policy documents to and from their wire form, checked at the edge (SPEC §3).
//!
//! [`PolicyDocument`] → [`pb::PolicyDocument`] cannot fail. The way back is a `TryFrom` that
//! refuses what the wire can carry but a policy cannot hold — unknown enum numbers, gRPC codes
//! outside 1..=16, HTTP statuses outside 400..=599, durations above 24 h, endpoints without a
//! name or with the same name, routes without a match, malformed gRPC routes — reporting every
//! problem at once with its field path (`endpoints.payments.backoff.jitter`) and no line or
//! column. Range and cross-field checks are not repeated here: [`validate`] hands the document
//! to [`PolicySet::from_document`], the validator `retryplane validate` runs on files.
//!
//! Durations travel as whole milliseconds; an unset field is an absent `optional`, an unset
//! jitter is `JITTER_UNSPECIFIED`, an unset list is an absent list message (present but empty
//! means "retry none").

use std::collections::HashMap;
use std::fmt;
use std::time::Duration;

use retryplane_policy::codes::GrpcCode;
use retryplane_policy::diff::{Change, ChangeKind, Scope};
use retryplane_policy::document::{
    AlertOverlay, BackoffOverlay, BreakerOverlay, BudgetOverlay, EndpointDoc, Field, Overlay,
    RetryAfterOverlay, RetryOnOverlay, RouteDoc, RouteMatch,
};
use retryplane_policy::duration::{MAX_DURATION, format_duration};
use retryplane_policy::parse::{check_method, parse_grpc_route};
use retryplane_policy::yaml::Loc;
use retryplane_policy::{Diagnostic, ErrorClass, Jitter, PolicyDocument, PolicySet, Severity};

use crate::pb;

mod to_pb;

pub use to_pb::{content_hash, lists_as_sets, unsigned_zeros};

/// The most a document sent to the control plane may hold ([`check_items`]), counted as the
/// YAML reader counts a file's events at the
/// least (two for each endpoint and route, each at least a key or an item and its value; one
/// for each entry of a list: status codes, error classes, methods): what a policy file can hold
/// ([`retryplane_policy::yaml::MAX_EVENTS`]). A document of bare endpoints within the message
/// size limit held about 380,000, and checking it took about 440 MB.
pub const MAX_ITEMS: usize = retryplane_policy::yaml::MAX_EVENTS;

/// The error for a document sent to the control plane (`Validate`, `Apply`) that holds more
/// than a policy file can ([`MAX_ITEMS`]); checked before it is converted. Not part of the
/// conversion itself: a version stored before the limit, and a snapshot from a control plane
/// without it, are still read (a rollback does not publish such a version again, an agent
/// refuses such a snapshot, and does not use a cache file holding one).
pub fn check_items(doc: &pb::PolicyDocument) -> Result<(), Diagnostic> {
    let items = items(doc);
    if items <= MAX_ITEMS {
        return Ok(());
    }
    Err(too_many_items(items))
}

/// [`check_items`]'s error for a document of `items` items (more than [`MAX_ITEMS`]); also
/// for a request refused on its encoded bytes ([`crate::wire_items`]).
pub fn too_many_items(items: usize) -> Diagnostic {
    Diagnostic::error(
        Loc::UNKNOWN,
        "<document>",
        format!(
            "the document is too large: {items} items (2 for each endpoint and route, 1 for \
             each list entry); at most {MAX_ITEMS}, what a policy file can hold"
        ),
    )
}

/// The size of `doc` as [`MAX_ITEMS`] counts it.
fn items(doc: &pb::PolicyDocument) -> usize {
    fn overlay(o: Option<&pb::Overlay>) -> usize {
        let Some(o) = o else { return 0 };
        let retry_on = o.retry_on.as_ref().map_or(0, |r| {
            r.http_status.as_ref().map_or(0, |l| l.codes.len())
                + r.grpc_status.as_ref().map_or(0, |l| l.codes.len())
                + r.errors.as_ref().map_or(0, |l| l.classes.len())
        });
        retry_on + o.idempotent_methods.as_ref().map_or(0, |l| l.methods.len())
    }
    doc.endpoints
        .iter()
        .fold(overlay(doc.defaults.as_ref()), |n, ep| {
            ep.routes.iter().fold(
                n.saturating_add(2 + overlay(ep.overlay.as_ref())),
                |n, route| n.saturating_add(2 + overlay(route.overlay.as_ref())),
            )
        })
}

/// Why a wire document could not become a [`PolicyDocument`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid policy document: {} error(s), first: {}", retryplane_policy::diag::counts(errors).0, errors.first().map(ToString::to_string).unwrap_or_default())]
pub struct InvalidDocument {
    /// Every problem found, in document order; places are unknown, paths are set.
    pub errors: Vec<Diagnostic>,
}

/// Converts and validates a wire document with the one validator every source goes through:
/// the compiled set and its warnings, or every error (conversion errors first, and only
/// those when the document could not be converted).
pub fn validate(doc: pb::PolicyDocument) -> Result<(PolicySet, Vec<Diagnostic>), Vec<Diagnostic>> {
    let doc = PolicyDocument::try_from(doc).map_err(|e| e.errors)?;
    PolicySet::from_document(doc).map_err(|e| e.errors)
}

/// A wire document as a compiled set, through the same validator as files and the admin API:
/// [`validate`] without the warnings.
impl TryFrom<pb::PolicyDocument> for PolicySet {
    type Error = InvalidDocument;

    fn try_from(doc: pb::PolicyDocument) -> Result<Self, InvalidDocument> {
        validate(doc)
            .map(|(set, _warnings)| set)
            .map_err(|errors| InvalidDocument { errors })
    }
}

/// The structural conversion only: every field present, of the right kind, names unique, enums
/// known. Ranges and cross-field rules are the validator's: use [`validate`] or
/// `PolicySet::try_from` for a document to run.
impl TryFrom<pb::PolicyDocument> for PolicyDocument {
    type Error = InvalidDocument;

    fn try_from(doc: pb::PolicyDocument) -> Result<Self, InvalidDocument> {
        let mut c = Checker::default();
        let defaults = c.overlay(doc.defaults.unwrap_or_default(), "defaults");
        let mut first_at: HashMap<String, usize> = HashMap::new();
        let mut endpoints = Vec::with_capacity(doc.endpoints.len());
        for (i, ep) in doc.endpoints.into_iter().enumerate() {
            let path = if ep.name.is_empty() {
                let path = format!("endpoints[{i}]");
                c.error(&path, "an endpoint needs a name");
                path
            } else {
                let path = retryplane_policy::diag::endpoint_path(&ep.name);
                if let Some(j) = first_at.get(&ep.name) {
                    let message = format!(
                        "duplicate endpoint `{}` (first defined at endpoints[{j}])",
                        ep.name
                    );
                    c.error(&path, message);
                } else {
                    first_at.insert(ep.name.clone(), i);
                }
                path
            };
            let overlay = c.overlay(ep.overlay.unwrap_or_default(), &path);
            let mut routes = Vec::with_capacity(ep.routes.len());
            for (k, route) in ep.routes.into_iter().enumerate() {
                let route_path = format!("{path}.routes[{k}]");
                let matcher = c.route_match(route.r#match, &format!("{route_path}.match"));
                let overlay = c.overlay(route.overlay.unwrap_or_default(), &route_path);
                if let Some(m) = matcher {
                    routes.push(RouteDoc {
                        matcher: Field::new(m),
                        prefix_loc: Loc::UNKNOWN,
                        overlay,
                        index: k,
                    });
                }
            }
            endpoints.push(EndpointDoc {
                name: Field::new(ep.name),
                overlay,
                routes,
            });
        }
        if c.errors.is_empty() {
            Ok(PolicyDocument {
                defaults,
                endpoints,
            })
        } else {
            let mut errors = c.errors;
            if c.more > 0 {
                errors.push(retryplane_policy::diag::more_not_listed(c.more, 0));
            }
            Err(InvalidDocument { errors })
        }
    }
}

/// Collects every problem of one conversion.
#[derive(Default)]
struct Checker {
    errors: Vec<Diagnostic>,
    /// Errors past [`retryplane_policy::diag::MAX_LISTED`], counted, not kept: a bad code
    /// takes a byte of a typed document and a few hundred to say.
    more: usize,
}

/// Where a field sits (`prefix.field`, or `prefix.field[item]` for an item of a list), written
/// out only when a problem is reported there: a pushed document is nearly always right, and
/// formatting every field's path up front was a sixth of the time an agent took to check a
/// snapshot of thousands of endpoints.
#[derive(Clone, Copy)]
struct At<'a> {
    prefix: &'a str,
    field: &'static str,
    item: Option<usize>,
}

impl fmt::Display for At<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.prefix, self.field)?;
        match self.item {
            Some(i) => write!(f, "[{i}]"),
            None => Ok(()),
        }
    }
}

impl Checker {
    fn error(&mut self, path: &str, message: impl Into<String>) {
        if self.errors.len() < retryplane_policy::diag::MAX_LISTED {
            self.errors
                .push(Diagnostic::error(Loc::UNKNOWN, path, message));
        } else {
            self.more += 1;
        }
    }

    fn error_at(&mut self, at: At<'_>, message: impl Into<String>) {
        if self.errors.len() < retryplane_policy::diag::MAX_LISTED {
            self.error(&at.to_string(), message);
        } else {
            self.more += 1;
        }
    }

    fn overlay(&mut self, o: pb::Overlay, prefix: &str) -> Overlay {
        let p = |field| At {
            prefix,
            field,
            item: None,
        };
        let b = o.backoff.unwrap_or_default();
        let r = o.retry_on.unwrap_or_default();
        let ra = o.retry_after.unwrap_or_default();
        let bu = o.budget.unwrap_or_default();
        let cb = o.circuit_breaker.unwrap_or_default();
        let al = o.alert.unwrap_or_default();
        Overlay {
            max_attempts: o.max_attempts.map(Field::new),
            backoff: BackoffOverlay {
                base: self.duration(b.base_ms, p("backoff.base")),
                max: self.duration(b.max_ms, p("backoff.max")),
                multiplier: self.number(b.multiplier, p("backoff.multiplier")),
                jitter: self.jitter(b.jitter, p("backoff.jitter")),
            },
            deadline: self.duration(o.deadline_ms, p("deadline")),
            per_try_timeout: self.duration(o.per_try_timeout_ms, p("per_try_timeout")),
            retry_on: RetryOnOverlay {
                http_status: r
                    .http_status
                    .map(|l| self.list(l.codes, p("retry_on.http_status"), Checker::http_status)),
                grpc_status: r
                    .grpc_status
                    .map(|l| self.list(l.codes, p("retry_on.grpc_status"), Checker::grpc_code)),
                errors: r
                    .errors
                    .map(|l| self.list(l.classes, p("retry_on.errors"), Checker::error_class)),
            },
            idempotent_methods: o
                .idempotent_methods
                .map(|l| Field::new(l.methods.into_iter().map(Field::new).collect())),
            idempotency_key_header: o.idempotency_key_header.map(Field::new),
            retry_after: RetryAfterOverlay {
                honor: ra.honor.map(Field::new),
                max: self.duration(ra.max_ms, p("retry_after.max")),
            },
            budget: BudgetOverlay {
                enabled: bu.enabled.map(Field::new),
                ratio: self.number(bu.ratio, p("budget.ratio")),
                min_per_second: bu.min_per_second.map(Field::new),
                window: self.duration(bu.window_ms, p("budget.window")),
            },
            circuit_breaker: BreakerOverlay {
                enabled: cb.enabled.map(Field::new),
                failure_ratio: self.number(cb.failure_ratio, p("circuit_breaker.failure_ratio")),
                min_requests: cb.min_requests.map(Field::new),
                window: self.duration(cb.window_ms, p("circuit_breaker.window")),
                open_for: self.duration(cb.open_for_ms, p("circuit_breaker.open_for")),
                half_open_probes: cb.half_open_probes.map(Field::new),
            },
            alert: AlertOverlay {
                retry_ratio: self.number(al.retry_ratio, p("alert.retry_ratio")),
            },
        }
    }

    fn duration(&mut self, ms: Option<u64>, path: At<'_>) -> Option<Field<Duration>> {
        let d = Duration::from_millis(ms?);
        if d > MAX_DURATION {
            self.error_at(
                path,
                format!(
                    "duration {}ms is out of range: at most {} ({}ms)",
                    d.as_millis(),
                    format_duration(MAX_DURATION),
                    MAX_DURATION.as_millis()
                ),
            );
            return None;
        }
        Some(Field::new(d))
    }

    /// A finite number, `-0.0` read as `0.0` as a file's is.
    fn number(&mut self, v: Option<f64>, path: At<'_>) -> Option<Field<f64>> {
        let v = v?;
        if !v.is_finite() {
            self.error_at(path, "must be a finite number");
            return None;
        }
        Some(Field::new(retryplane_policy::unsigned_zero(v)))
    }

    fn jitter(&mut self, v: i32, path: At<'_>) -> Option<Field<Jitter>> {
        let jitter = match pb::Jitter::try_from(v) {
            Ok(pb::Jitter::Unspecified) => return None,
            Ok(pb::Jitter::None) => Jitter::None,
            Ok(pb::Jitter::Full) => Jitter::Full,
            Ok(pb::Jitter::Equal) => Jitter::Equal,
            Ok(pb::Jitter::Decorrelated) => Jitter::Decorrelated,
            Err(_) => {
                self.error_at(
                    path,
                    format!("unknown jitter {v}: use JITTER_NONE (1) to JITTER_DECORRELATED (4)"),
                );
                return None;
            }
        };
        Some(Field::new(jitter))
    }

    /// A list with every bad item reported (at `path[i]`) and left out.
    fn list<I, T>(
        &mut self,
        items: Vec<I>,
        path: At<'_>,
        mut item: impl FnMut(&mut Self, I, At<'_>) -> Option<T>,
    ) -> Field<Vec<Field<T>>> {
        let mut out = Vec::with_capacity(items.len());
        for (i, v) in items.into_iter().enumerate() {
            let at = At {
                item: Some(i),
                ..path
            };
            if let Some(v) = item(self, v, at) {
                out.push(Field::new(v));
            }
        }
        Field::new(out)
    }

    fn http_status(&mut self, code: u32, path: At<'_>) -> Option<u16> {
        match u16::try_from(code) {
            Ok(c) if (400..=599).contains(&c) => Some(c),
            Ok(c) if (100..400).contains(&c) => {
                let message =
                    format!("status {c} is not a failure: only 4xx and 5xx can be retried");
                self.error_at(path, message);
                None
            }
            _ => {
                self.error_at(
                    path,
                    format!("unknown HTTP status {code}: status codes are 100 to 599"),
                );
                None
            }
        }
    }

    fn grpc_code(&mut self, code: u32, path: At<'_>) -> Option<GrpcCode> {
        match i32::try_from(code).ok().and_then(GrpcCode::from_i32) {
            Some(GrpcCode::Ok) => {
                self.error_at(path, "OK (0) is success and cannot be retried");
                None
            }
            Some(c) => Some(c),
            None => {
                self.error_at(
                    path,
                    format!("unknown gRPC status code {code}: codes are 1 to 16"),
                );
                None
            }
        }
    }

    fn error_class(&mut self, class: i32, path: At<'_>) -> Option<ErrorClass> {
        let class = match pb::ErrorClass::try_from(class) {
            Ok(pb::ErrorClass::Connect) => ErrorClass::Connect,
            Ok(pb::ErrorClass::Reset) => ErrorClass::Reset,
            Ok(pb::ErrorClass::Timeout) => ErrorClass::Timeout,
            Ok(pb::ErrorClass::Unspecified) | Err(_) => {
                let message = format!(
                    "unknown error class {class}: use ERROR_CLASS_CONNECT (1), ERROR_CLASS_RESET (2) or ERROR_CLASS_TIMEOUT (3)"
                );
                self.error_at(path, message);
                return None;
            }
        };
        Some(class)
    }

    fn route_match(&mut self, m: Option<pb::RouteMatch>, path: &str) -> Option<RouteMatch> {
        use pb::route_match::Kind;
        let Some(m) = m else {
            self.error(path, "a route needs a `match`");
            return None;
        };
        match m.kind {
            None => {
                self.error(
                    path,
                    "set `http` (method and/or path prefix) or `grpc` (service and method)",
                );
                None
            }
            Some(Kind::Http(h)) => {
                let path = format!("{path}.http");
                if h.method.is_empty() && h.path_prefix.is_empty() {
                    self.error(&path, "set `method` and/or `path_prefix`");
                    return None;
                }
                let mut ok = true;
                if !h.method.is_empty()
                    && let Err(message) = check_method(&h.method)
                {
                    self.error(&format!("{path}.method"), message);
                    ok = false;
                }
                if !h.path_prefix.is_empty() && !h.path_prefix.starts_with('/') {
                    let message =
                        format!("a path prefix starts with `/`, found `{}`", h.path_prefix);
                    self.error(&format!("{path}.path_prefix"), message);
                    ok = false;
                }
                ok.then(|| RouteMatch::Http {
                    method: (!h.method.is_empty()).then_some(h.method),
                    path_prefix: if h.path_prefix.is_empty() {
                        "/".to_owned()
                    } else {
                        h.path_prefix
                    },
                })
            }
            Some(Kind::Grpc(g)) => {
                let path = format!("{path}.grpc");
                if g.method == "*" {
                    self.error(
                        &format!("{path}.method"),
                        "leave `method` empty to match every method of the service",
                    );
                    return None;
                }
                let method = if g.method.is_empty() { "*" } else { &g.method };
                match parse_grpc_route(&format!("/{}/{method}", g.service)) {
                    Ok((service, method)) => Some(RouteMatch::Grpc { service, method }),
                    Err(message) => {
                        self.error(&path, message);
                        None
                    }
                }
            }
        }
    }
}

// === diagnostics and diffs ===

impl From<&Diagnostic> for pb::Diagnostic {
    fn from(d: &Diagnostic) -> Self {
        let severity = match d.severity {
            Severity::Error => pb::diagnostic::Severity::Error,
            Severity::Warning => pb::diagnostic::Severity::Warning,
        };
        pb::Diagnostic {
            severity: severity as i32,
            line: d.loc.line,
            column: d.loc.column,
            path: d.path.clone(),
            message: d.message.clone(),
        }
    }
}

/// An unspecified or unknown severity is taken as an error: a problem of unknown weight
/// stops a change rather than slipping through.
impl From<&pb::Diagnostic> for Diagnostic {
    fn from(d: &pb::Diagnostic) -> Self {
        let severity = match pb::diagnostic::Severity::try_from(d.severity) {
            Ok(pb::diagnostic::Severity::Warning) => Severity::Warning,
            _ => Severity::Error,
        };
        Diagnostic {
            severity,
            loc: Loc {
                line: d.line,
                column: d.column,
            },
            path: d.path.clone(),
            message: d.message.clone(),
            endpoint: None,
        }
    }
}

impl From<&Change> for pb::DiffEntry {
    fn from(c: &Change) -> Self {
        let change = match c.kind {
            ChangeKind::Added => pb::diff_entry::Change::Added,
            ChangeKind::Removed => pb::diff_entry::Change::Removed,
            ChangeKind::Modified => pb::diff_entry::Change::Modified,
        };
        let (endpoint, defaults) = match &c.scope {
            Scope::Defaults => ("defaults".to_owned(), true),
            Scope::Endpoint(name) => (name.clone(), false),
        };
        pb::DiffEntry {
            endpoint,
            change: change as i32,
            details: c.details.clone(),
            defaults: Some(defaults),
        }
    }
}

/// A change as the wire carries it; an unspecified kind reads as modified, and an entry
/// without `defaults` (from a control plane that predates it) is the `defaults:` block when it
/// is named `defaults`, as such a control plane meant it.
impl From<&pb::DiffEntry> for Change {
    fn from(e: &pb::DiffEntry) -> Self {
        let kind = match e.change() {
            pb::diff_entry::Change::Added => ChangeKind::Added,
            pb::diff_entry::Change::Removed => ChangeKind::Removed,
            pb::diff_entry::Change::Modified | pb::diff_entry::Change::Unspecified => {
                ChangeKind::Modified
            }
        };
        Change {
            scope: if e.defaults.unwrap_or(e.endpoint == "defaults") {
                Scope::Defaults
            } else {
                Scope::Endpoint(e.endpoint.clone())
            },
            kind,
            details: e.details.clone(),
        }
    }
}

#[cfg(test)]
#[path = "convert_tests.rs"]
mod tests;
