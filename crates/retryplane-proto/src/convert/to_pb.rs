//! Policy documents to their wire form, and the content hash of that form.

use std::time::Duration;

use retryplane_policy::document::{EndpointDoc, Field, Overlay, RouteDoc, RouteMatch};
use retryplane_policy::{ErrorClass, Jitter, PolicyDocument};
use sha2::{Digest, Sha256};

use crate::pb;

impl From<&PolicyDocument> for pb::PolicyDocument {
    /// Every layer and field, endpoints and routes in document order; empty sections are left
    /// out (`None`), so the result is already in the canonical form [`content_hash`] encodes.
    fn from(doc: &PolicyDocument) -> Self {
        pb::PolicyDocument {
            defaults: non_empty(pb::Overlay::from(&doc.defaults)),
            endpoints: doc.endpoints.iter().map(pb::Endpoint::from).collect(),
        }
    }
}

impl From<&EndpointDoc> for pb::Endpoint {
    fn from(ep: &EndpointDoc) -> Self {
        pb::Endpoint {
            name: ep.name.value.clone(),
            overlay: non_empty(pb::Overlay::from(&ep.overlay)),
            routes: ep.routes.iter().map(pb::Route::from).collect(),
        }
    }
}

impl From<&RouteDoc> for pb::Route {
    fn from(route: &RouteDoc) -> Self {
        pb::Route {
            r#match: Some(pb::RouteMatch::from(&route.matcher.value)),
            overlay: non_empty(pb::Overlay::from(&route.overlay)),
        }
    }
}

impl From<&RouteMatch> for pb::RouteMatch {
    fn from(m: &RouteMatch) -> Self {
        use pb::route_match::Kind;
        let kind = match m {
            RouteMatch::Http {
                method,
                path_prefix,
            } => Kind::Http(pb::HttpMatch {
                method: method.clone().unwrap_or_default(),
                path_prefix: path_prefix.clone(),
            }),
            RouteMatch::Grpc { service, method } => Kind::Grpc(pb::GrpcMatch {
                service: service.clone(),
                method: method.clone().unwrap_or_default(),
            }),
        };
        pb::RouteMatch { kind: Some(kind) }
    }
}

impl From<&Overlay> for pb::Overlay {
    /// Every field the layer sets; a section (`backoff`, `budget`, …) it does not touch is
    /// `None`, a list it sets is present even when empty.
    fn from(o: &Overlay) -> Self {
        let (b, r, ra, bu, cb, al) = (
            &o.backoff,
            &o.retry_on,
            &o.retry_after,
            &o.budget,
            &o.circuit_breaker,
            &o.alert,
        );
        pb::Overlay {
            max_attempts: value(&o.max_attempts),
            backoff: non_empty(pb::Backoff {
                base_ms: millis(&b.base),
                max_ms: millis(&b.max),
                multiplier: value(&b.multiplier),
                jitter: b.jitter.as_ref().map_or(0, |j| jitter(j.value) as i32),
            }),
            deadline_ms: millis(&o.deadline),
            per_try_timeout_ms: millis(&o.per_try_timeout),
            retry_on: non_empty(pb::RetryOn {
                http_status: list(&r.http_status, |s| u32::from(*s))
                    .map(|codes| pb::StatusList { codes }),
                grpc_status: list(&r.grpc_status, |c| *c as u32)
                    .map(|codes| pb::StatusList { codes }),
                errors: list(&r.errors, |e| error_class(*e) as i32)
                    .map(|classes| pb::ErrorClassList { classes }),
            }),
            idempotent_methods: list(&o.idempotent_methods, Clone::clone)
                .map(|methods| pb::MethodList { methods }),
            idempotency_key_header: value(&o.idempotency_key_header),
            retry_after: non_empty(pb::RetryAfter {
                honor: value(&ra.honor),
                max_ms: millis(&ra.max),
            }),
            budget: non_empty(pb::Budget {
                enabled: value(&bu.enabled),
                ratio: value(&bu.ratio),
                min_per_second: value(&bu.min_per_second),
                window_ms: millis(&bu.window),
            }),
            circuit_breaker: non_empty(pb::CircuitBreaker {
                enabled: value(&cb.enabled),
                failure_ratio: value(&cb.failure_ratio),
                min_requests: value(&cb.min_requests),
                window_ms: millis(&cb.window),
                open_for_ms: millis(&cb.open_for),
                half_open_probes: value(&cb.half_open_probes),
            }),
            alert: non_empty(pb::Alert {
                retry_ratio: value(&al.retry_ratio),
            }),
        }
    }
}

/// Lowercase hex SHA-256 of the canonical encoding of `doc` (SPEC §3: a version is a number
/// plus this hash, and content equal to the current version's is never published under a new
/// version; content equal to an older version's is, as a rollback is).
///
/// Canonical: endpoints sorted by name (lookup is by name, so their order carries no meaning;
/// routes keep theirs, the first match wins), empty sections left out, an empty HTTP path
/// prefix written as the `/` it means. Protobuf encoding is deterministic for these messages:
/// prost writes fields in tag order and the policy messages hold no `map` fields, whose order
/// would not be. Two documents with the same content
/// ([`retryplane_policy::diff::same_content`]) have the same hash, once a document from a wire
/// client has been through [`unsigned_zeros`] (as the control plane does on Apply; a file's
/// numbers are read so).
///
/// The hash is of the numbers' bits as they are: a version stored, and an agent's cache file
/// written, before `-0.0` was read as `0.0` still match the hash they were stored with.
pub fn content_hash(doc: &pb::PolicyDocument) -> String {
    use prost::Message as _;
    let bytes = canonical(doc).encode_to_vec();
    Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Writes every `-0.0` of `doc`'s numbers as `0.0`, the value a policy file reads it as: a
/// document sent by a wire client that only writes a zero's sign differently from the current
/// version then has its content hash, and is not published again. Converting a document
/// (`PolicyDocument::try_from`) reads them so already; this is for the
/// wire document itself, which the control plane hashes and stores. Returns whether it
/// changed anything.
pub fn unsigned_zeros(doc: &mut pb::PolicyDocument) -> bool {
    let mut changed = false;
    let overlay = |o: &mut pb::Overlay| {
        let mut zero = |v: &mut Option<f64>| {
            if let Some(x) = v
                && *x == 0.0
                && x.is_sign_negative()
            {
                *x = 0.0;
                changed = true;
            }
        };
        if let Some(b) = &mut o.backoff {
            zero(&mut b.multiplier);
        }
        if let Some(b) = &mut o.budget {
            zero(&mut b.ratio);
        }
        if let Some(c) = &mut o.circuit_breaker {
            zero(&mut c.failure_ratio);
        }
        if let Some(a) = &mut o.alert {
            zero(&mut a.retry_ratio);
        }
    };
    each_overlay(doc, overlay);
    changed
}

/// Writes every list of `doc` that reads as a set (`retry_on`'s statuses, codes and error
/// classes, `idempotent_methods`: a value is in them or not) sorted, each value once. Two
/// documents that differ only in such lists' order or repeats then hash alike. Not part of
/// [`content_hash`], which hashes the lists as written: agents check a snapshot's hash, and
/// versions already stored keep theirs.
pub fn lists_as_sets(doc: &mut pb::PolicyDocument) {
    fn set_order<T: Ord>(list: &mut Vec<T>) {
        list.sort_unstable();
        list.dedup();
    }
    let overlay = |o: &mut pb::Overlay| {
        if let Some(r) = &mut o.retry_on {
            for l in [&mut r.http_status, &mut r.grpc_status]
                .into_iter()
                .flatten()
            {
                set_order(&mut l.codes);
            }
            if let Some(l) = &mut r.errors {
                set_order(&mut l.classes);
            }
        }
        if let Some(l) = &mut o.idempotent_methods {
            set_order(&mut l.methods);
        }
    };
    each_overlay(doc, overlay);
}

/// Runs `f` on every overlay of `doc`: the defaults', each endpoint's and each route's.
fn each_overlay(doc: &mut pb::PolicyDocument, mut f: impl FnMut(&mut pb::Overlay)) {
    doc.defaults.iter_mut().for_each(&mut f);
    for ep in &mut doc.endpoints {
        ep.overlay.iter_mut().for_each(&mut f);
        for route in &mut ep.routes {
            route.overlay.iter_mut().for_each(&mut f);
        }
    }
}

fn canonical(doc: &pb::PolicyDocument) -> pb::PolicyDocument {
    let mut doc = doc.clone();
    doc.defaults = doc.defaults.and_then(canonical_overlay);
    for ep in &mut doc.endpoints {
        ep.overlay = ep.overlay.take().and_then(canonical_overlay);
        for route in &mut ep.routes {
            route.overlay = route.overlay.take().and_then(canonical_overlay);
            if let Some(pb::RouteMatch {
                kind: Some(pb::route_match::Kind::Http(h)),
            }) = &mut route.r#match
                && h.path_prefix.is_empty()
                && !h.method.is_empty()
            {
                h.path_prefix = "/".to_owned();
            }
        }
    }
    doc.endpoints.sort_by(|a, b| a.name.cmp(&b.name));
    doc
}

fn canonical_overlay(mut o: pb::Overlay) -> Option<pb::Overlay> {
    o.backoff = o.backoff.and_then(non_empty);
    o.retry_on = o.retry_on.and_then(non_empty);
    o.retry_after = o.retry_after.and_then(non_empty);
    o.budget = o.budget.and_then(non_empty);
    o.circuit_breaker = o.circuit_breaker.and_then(non_empty);
    // An empty `alert` is left out like the other sections: a document without alert settings
    // hashes exactly as it did before `alert` existed.
    o.alert = o.alert.and_then(non_empty);
    non_empty(o)
}

/// `None` for a message with nothing set.
fn non_empty<T: Default + PartialEq>(m: T) -> Option<T> {
    (m != T::default()).then_some(m)
}

fn value<T: Clone>(f: &Option<Field<T>>) -> Option<T> {
    f.as_ref().map(|f| f.value.clone())
}

/// Whole milliseconds (policy durations have no finer part).
fn millis(f: &Option<Field<Duration>>) -> Option<u64> {
    f.as_ref()
        .map(|f| u64::try_from(f.value.as_millis()).unwrap_or(u64::MAX))
}

fn list<T, U>(f: &Option<Field<Vec<Field<T>>>>, item: impl Fn(&T) -> U) -> Option<Vec<U>> {
    f.as_ref()
        .map(|l| l.value.iter().map(|i| item(&i.value)).collect())
}

fn jitter(j: Jitter) -> pb::Jitter {
    match j {
        Jitter::None => pb::Jitter::None,
        Jitter::Full => pb::Jitter::Full,
        Jitter::Equal => pb::Jitter::Equal,
        Jitter::Decorrelated => pb::Jitter::Decorrelated,
    }
}

fn error_class(e: ErrorClass) -> pb::ErrorClass {
    match e {
        ErrorClass::Connect => pb::ErrorClass::Connect,
        ErrorClass::Reset => pb::ErrorClass::Reset,
        ErrorClass::Timeout => pb::ErrorClass::Timeout,
    }
}
