//! Sharing one logical call among identical in-flight reads ([`Dedup`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::header::HOST;
use http::request::Parts;
use http::{HeaderMap, HeaderName, Method, Response, response};
use sha2::{Digest as _, Sha256};
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::debug;

use super::body::ResponseBody;
use super::lock;

/// The largest response body read into memory to be shared unless set otherwise: 1 MiB.
pub const DEFAULT_SHARED_RESPONSE_LIMIT: usize = 1024 * 1024;

/// Opt-in de-duplication of identical in-flight reads, for
/// [`RetryLayer::with_dedup`](super::RetryLayer::with_dedup); see the [module docs](super).
///
/// Clones share one table of calls in flight and one set of [`DedupStats`]; answers are
/// shared only among requests sent through one layered service (one `layer` call) and its
/// clones, since what the services below add to a request is not in the key. Defaults: `GET`
/// and `HEAD` are shared (when idempotent under the policy in force); the key covers the method, the full URI, the body and **every request
/// header except the ones that only identify or trace the request** ([`DEFAULT_IGNORED_HEADERS`]:
/// `traceparent`, `x-request-id`, B3, …); responses up to [`DEFAULT_SHARED_RESPONSE_LIMIT`] are
/// shared.
///
/// Why every header by default: a header that carries a credential or a tenant (`X-Api-Key`,
/// `X-Auth-Token`, `X-Tenant`, …) changes the answer, and a key that left it out would hand one
/// caller a response meant for another. A header this list does not know is therefore part of
/// the key; one that differs on every request and does not change the answer (a custom request
/// id) only costs sharing, and [`Dedup::ignore_header`] leaves it out.
/// [`Dedup::vary_only_on`] keys on a fixed list of headers instead. In every mode the
/// [`CREDENTIAL_HEADERS`] (`Authorization`, `Proxy-Authorization`, `Cookie`) are part of the key,
/// so are `Range` and the conditional headers (`If-None-Match`, `If-Modified-Since`, `If-Match`,
/// `If-Unmodified-Since`, `If-Range`), and so is the upstream host: the URI's scheme and authority and the `Host` header (a
/// request whose URI is a bare path, as HTTP/1 carries it, names its host there only), so two
/// hosts never share an answer.
/// Of the calls that choose headers, the later wins: [`Dedup::vary_only_on`] and
/// [`Dedup::vary_on_all_headers`] start from their own list.
///
/// If tracing headers this list does not know differ on every request, nothing is ever shared:
/// [`Dedup::stats`] then counts every request as `led` and none as `shared`, and
/// [`Dedup::ignore_header`] is the fix.
#[derive(Clone, Debug)]
pub struct Dedup {
    config: Arc<Config>,
    state: Arc<State>,
}

#[derive(Clone, Debug)]
struct Config {
    methods: Vec<Method>,
    vary: Vary,
    response_limit: usize,
}

/// Which request headers are part of the key.
#[derive(Clone, Debug)]
enum Vary {
    /// Every header the request carries, except these (sorted, no duplicates).
    AllExcept(Vec<HeaderName>),
    /// Only these (sorted, no duplicates).
    Listed(Vec<HeaderName>),
}

/// Request headers left out of the key by default: they identify or trace one request (so they
/// differ between otherwise identical requests) and do not change the answer. Tracing: W3C Trace
/// Context, B3, Jaeger, OpenTracing, Datadog, New Relic, AWS X-Ray, Google Cloud, Sentry,
/// Envoy, gRPC's binary trace context; request ids. W3C `baggage` is not among them: it often
/// carries a tenant or a user.
pub const DEFAULT_IGNORED_HEADERS: &[&str] = &[
    "b3",
    "grpc-trace-bin",
    "newrelic",
    "request-id",
    "sentry-trace",
    "traceparent",
    "tracestate",
    "uber-trace-id",
    "x-amzn-trace-id",
    "x-b3-flags",
    "x-b3-parentspanid",
    "x-b3-sampled",
    "x-b3-spanid",
    "x-b3-traceid",
    "x-client-trace-id",
    "x-cloud-trace-context",
    "x-correlation-id",
    "x-datadog-origin",
    "x-datadog-parent-id",
    "x-datadog-sampling-priority",
    "x-datadog-tags",
    "x-datadog-trace-id",
    "x-ms-client-request-id",
    "x-ot-span-context",
    "x-request-id",
];

/// Headers that carry credentials: part of the key in every mode, whatever
/// [`Dedup::ignore_header`] or [`Dedup::vary_only_on`] say, since leaving one out would hand one
/// caller an answer meant for another.
pub const CREDENTIAL_HEADERS: &[&str] = &["authorization", "cookie", "proxy-authorization"];

/// Request headers that make the answer partial or conditional (`Range`, `If-None-Match`, …):
/// part of the key in every mode, as the credential headers are, since a copy of an answer to
/// another range (a 206) or another condition (a 304 with no body) is a wrong answer.
const CONDITION_HEADERS: &[&str] = &[
    "if-match",
    "if-modified-since",
    "if-none-match",
    "if-range",
    "if-unmodified-since",
    "range",
];

/// Whether `name` stays in the key whatever the headers chosen: a credential or a condition.
fn always_keyed(name: &HeaderName) -> bool {
    CREDENTIAL_HEADERS.contains(&name.as_str()) || CONDITION_HEADERS.contains(&name.as_str())
}

/// Why a leader's answer (its `headers` and `extensions`) is not handed to others, if it is not: one that
/// sets a cookie or is marked for one client only (`Cache-Control: private` or `no-store`, which
/// RFC 9111 keeps a shared cache from handing on); one its call gave up on for want of time
/// (the leader's deadline, not the followers', ended it); one whose credential refresh failed
/// (the followers' own refresh may not). Followers then make their own calls.
pub(crate) fn not_shared(
    headers: &HeaderMap,
    extensions: &http::Extensions,
) -> Option<&'static str> {
    if headers.contains_key(http::header::SET_COOKIE) {
        return Some("it sets a cookie");
    }
    // Read as bytes: a value with a byte outside ASCII in some other directive's argument is
    // no `&str`, and must not hide its `private`.
    let per_client = headers
        .get_all(http::header::CACHE_CONTROL)
        .iter()
        .flat_map(|v| v.as_bytes().split(|&b| b == b','))
        .map(|directive| {
            directive
                .split(|&b| b == b'=')
                .next()
                .unwrap_or_default()
                .trim_ascii()
        })
        .any(|d| d.eq_ignore_ascii_case(b"private") || d.eq_ignore_ascii_case(b"no-store"));
    if per_client {
        return Some("its Cache-Control is private or no-store");
    }
    if extensions
        .get::<super::GaveUp>()
        .is_some_and(|g| g.cause == crate::Cause::GaveUp(crate::GiveUpCause::DeadlineExceeded))
    {
        return Some("the leader's deadline ended its call");
    }
    if extensions.get::<super::RefreshFailed>().is_some() {
        return Some("the leader's credential refresh failed");
    }
    None
}

#[derive(Default)]
struct State {
    /// Calls in flight by key. The lock is held only to look up, insert or remove.
    flights: Mutex<HashMap<Key, Arc<Flight>>>,
    led: AtomicU64,
    shared: AtomicU64,
    own_calls: AtomicU64,
    waiting: AtomicU64,
}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State").finish_non_exhaustive()
    }
}

/// What [`Dedup`] has done so far (counts since it was made, across its clones).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DedupStats {
    /// Shareable requests that led a call (ran it themselves for any followers); a leader
    /// whose inner service failed to get ready, or whose caller dropped it while it waited
    /// for capacity, is counted though it sent nothing.
    pub led: u64,
    /// Requests answered with a copy of a leader's response, without a call of their own.
    /// They are not in the endpoint's counters, which count calls made (see the
    /// [module docs](super), "What the endpoint's counters see").
    pub shared: u64,
    /// Requests that waited for a leader and then went on to a call of their own: the leader
    /// failed with an error, or its response body failed, was over the limit or was not read by its
    /// deadline, or its answer was not one to share (meant for one client, given up on at its
    /// deadline, a failed credential refresh); or the request's own deadline passed while it waited, and then its call
    /// gave up at once with `deadline_exceeded`, making no attempt.
    pub own_calls: u64,
    /// Requests waiting for a leader right now.
    pub waiting: u64,
    /// Calls in flight that others can join right now.
    pub in_flight: u64,
}

/// In the extensions of a response a request got from another's call (a copy of that
/// response), not from a call of its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Deduplicated;

/// A SHA-256 digest of everything that makes two requests the same (see [`Dedup::key`]).
type Key = [u8; 32];

/// How a leader's call ended, for those waiting on it.
#[derive(Clone)]
pub(crate) enum Landing {
    /// A response to copy.
    Shared(Arc<SharedResponse>),
    /// Nothing to share (an error, or a body over the limit or not read by the deadline):
    /// make your own call.
    OwnCall,
}

/// A response read into memory. Its headers live only as long as some follower still has
/// to copy them.
pub(crate) struct SharedResponse {
    parts: response::Parts,
    data: Bytes,
    trailers: Option<HeaderMap>,
}

impl SharedResponse {
    pub(crate) fn new(parts: response::Parts, data: Bytes, trailers: Option<HeaderMap>) -> Self {
        Self {
            parts,
            data,
            trailers,
        }
    }

    /// A follower's copy, marked [`Deduplicated`].
    pub(crate) fn copy<B>(&self) -> Response<ResponseBody<B>> {
        let mut parts = self.parts.clone();
        parts.extensions.insert(Deduplicated);
        Response::from_parts(
            parts,
            ResponseBody::full(self.data.clone(), self.trailers.clone()),
        )
    }
}

type Flight = watch::Sender<Option<Landing>>;

/// The part a request plays.
pub(crate) enum Role {
    /// Run the call and land it.
    Lead(Leader),
    /// Wait for the leader's landing.
    Follow(Follower),
}

/// The leader of a flight. Dropped without landing (cancelled), it removes the flight and
/// its followers see the channel closed.
pub(crate) struct Leader {
    state: Arc<State>,
    key: Key,
    flight: Arc<Flight>,
}

impl Leader {
    /// Ends the flight: no one joins it any more, and those waiting get `landing`.
    pub(crate) fn land(self, landing: Landing) {
        self.remove();
        self.flight.send_replace(Some(landing));
    }

    fn remove(&self) {
        let mut flights = lock(&self.state.flights);
        if flights
            .get(&self.key)
            .is_some_and(|f| Arc::ptr_eq(f, &self.flight))
        {
            flights.remove(&self.key);
        }
    }
}

impl Drop for Leader {
    fn drop(&mut self) {
        self.remove();
    }
}

/// A request waiting for a leader.
pub(crate) struct Follower {
    state: Arc<State>,
    rx: watch::Receiver<Option<Landing>>,
}

impl Follower {
    /// The leader's landing; `None` if the leader was dropped without one. Waits no later than
    /// `deadline` (tokio's clock): then it is [`Landing::OwnCall`], whatever the leader does.
    pub(crate) async fn wait(mut self, deadline: Instant) -> Option<Landing> {
        let waiting = Waiting::enter(&self.state.waiting);
        let landing =
            match tokio::time::timeout_at(deadline, self.rx.wait_for(Option::is_some)).await {
                Ok(Ok(landing)) => landing.clone(),
                Ok(Err(_closed)) => None,
                Err(_elapsed) => {
                    debug!("deadline passed waiting for an identical call; giving up");
                    Some(Landing::OwnCall)
                }
            };
        match &landing {
            Some(Landing::Shared(_)) => self.state.shared.fetch_add(1, Relaxed),
            Some(Landing::OwnCall) => self.state.own_calls.fetch_add(1, Relaxed),
            None => 0,
        };
        drop(waiting);
        landing
    }
}

/// Counts a follower in [`DedupStats::waiting`] while it exists (a dropped wait included).
struct Waiting<'a>(&'a AtomicU64);

impl<'a> Waiting<'a> {
    fn enter(gauge: &'a AtomicU64) -> Self {
        gauge.fetch_add(1, Relaxed);
        Self(gauge)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

impl Default for Dedup {
    fn default() -> Self {
        Self::new()
    }
}

impl Dedup {
    /// The defaults (see [`Dedup`]).
    pub fn new() -> Self {
        let mut ignored: Vec<HeaderName> = DEFAULT_IGNORED_HEADERS
            .iter()
            .map(|n| HeaderName::from_static(n))
            .collect();
        sort(&mut ignored);
        Self {
            config: Arc::new(Config {
                methods: vec![Method::GET, Method::HEAD],
                vary: Vary::AllExcept(ignored),
                response_limit: DEFAULT_SHARED_RESPONSE_LIMIT,
            }),
            state: Arc::default(),
        }
    }

    /// Shares requests of `method` too (say `OPTIONS`, or a `POST` that only reads). Only do
    /// this for methods that do not change anything upstream. As for `GET` and `HEAD`, a
    /// request is shared only when it is idempotent under the policy in force (its method in
    /// the route's `idempotent_methods`, or [`Idempotent`](super::Idempotent)`(true)` on it):
    /// declare such a `POST` with that extension.
    #[must_use]
    pub fn share_method(mut self, method: Method) -> Self {
        let config = Arc::make_mut(&mut self.config);
        if !config.methods.contains(&method) {
            config.methods.push(method);
        }
        self
    }

    /// Makes sure the values of `name` are part of the key: requests that differ in it are not
    /// shared. By default every header is, except [`DEFAULT_IGNORED_HEADERS`] and those
    /// [`Dedup::ignore_header`] names; this takes `name` back out of that list. After
    /// [`Dedup::vary_only_on`], it adds `name` to the listed headers.
    #[must_use]
    pub fn vary_on(mut self, name: HeaderName) -> Self {
        match &mut Arc::make_mut(&mut self.config).vary {
            Vary::AllExcept(ignored) => ignored.retain(|n| *n != name),
            Vary::Listed(names) => {
                names.push(name);
                sort(names);
            }
        }
        self
    }

    /// Leaves `name` out of the key: requests that differ only in it are shared. For a header
    /// that differs on every request and never changes the answer (a request id of your own).
    /// Never for one that carries a credential or a tenant; the [`CREDENTIAL_HEADERS`], `Range`
    /// and the conditional headers, and `Host` stay in the key whatever this says. After [`Dedup::vary_only_on`], it removes `name` from the
    /// listed headers.
    #[must_use]
    pub fn ignore_header(mut self, name: HeaderName) -> Self {
        if always_keyed(&name) {
            return self;
        }
        match &mut Arc::make_mut(&mut self.config).vary {
            Vary::AllExcept(ignored) => {
                ignored.push(name);
                sort(ignored);
            }
            Vary::Listed(names) => names.retain(|n| *n != name),
        }
        self
    }

    /// Makes every request header part of the key, the tracing headers of
    /// [`DEFAULT_IGNORED_HEADERS`] included: only requests with the same headers and values (in
    /// any order of names) are shared.
    #[must_use]
    pub fn vary_on_all_headers(mut self) -> Self {
        Arc::make_mut(&mut self.config).vary = Vary::AllExcept(Vec::new());
        self
    }

    /// Keys on these headers, the [`CREDENTIAL_HEADERS`], `Range` and the conditional headers,
    /// and `Host` only (say `Accept` and
    /// `X-Tenant`): requests that differ only in other headers are shared. Every other header
    /// that carries a credential or a tenant, or otherwise changes the answer, must be listed,
    /// or one caller gets a response meant for another.
    #[must_use]
    pub fn vary_only_on(mut self, names: impl IntoIterator<Item = HeaderName>) -> Self {
        let mut names: Vec<HeaderName> = names
            .into_iter()
            .chain(
                CREDENTIAL_HEADERS
                    .iter()
                    .chain(CONDITION_HEADERS)
                    .map(|n| HeaderName::from_static(n)),
            )
            .collect();
        sort(&mut names);
        Arc::make_mut(&mut self.config).vary = Vary::Listed(names);
        self
    }

    /// The largest response body read into memory to be shared; with a larger one, the leader
    /// gets it as it comes (the bytes read so far first) and those waiting make their own
    /// calls.
    #[must_use]
    pub fn with_response_limit(mut self, limit: usize) -> Self {
        Arc::make_mut(&mut self.config).response_limit = limit;
        self
    }

    /// Counts so far.
    pub fn stats(&self) -> DedupStats {
        let s = &self.state;
        DedupStats {
            led: s.led.load(Relaxed),
            shared: s.shared.load(Relaxed),
            own_calls: s.own_calls.load(Relaxed),
            waiting: s.waiting.load(Relaxed),
            in_flight: lock(&s.flights).len() as u64,
        }
    }

    pub(crate) fn response_limit(&self) -> usize {
        self.config.response_limit
    }

    /// Whether requests of `method` may be shared (if idempotent: the layer checks that).
    pub(crate) fn shares(&self, method: &Method) -> bool {
        self.config.methods.contains(method)
    }

    /// The key of a request to `endpoint` with head `head` and body `body`, sent through the
    /// layered service `stack` (see `Retry::stack`).
    ///
    /// SHA-256, not a fast 64-bit hash: two requests with the same key get the same answer,
    /// so a collision between two `Authorization` values would hand one caller's response to
    /// another. The digest also means no header value is kept in the table. Every field is
    /// length-prefixed, so no two different requests feed the same bytes.
    ///
    /// The upstream host is always in it, whatever the headers chosen: the URI's authority
    /// and the `Host` header (where a request whose URI is a bare path, as HTTP/1 carries it,
    /// names its host; a server behind one address may also serve several hosts by it).
    pub(crate) fn key(&self, stack: u64, endpoint: &str, head: &Parts, body: &[u8]) -> Key {
        let mut h = Sha256::new();
        field(&mut h, &stack.to_le_bytes());
        field(&mut h, endpoint.as_bytes());
        field(&mut h, head.method.as_str().as_bytes());
        let uri = &head.uri;
        field(&mut h, uri.scheme_str().unwrap_or_default().as_bytes());
        field(
            &mut h,
            uri.authority().map_or("", |a| a.as_str()).as_bytes(),
        );
        field(
            &mut h,
            uri.path_and_query().map_or("", |p| p.as_str()).as_bytes(),
        );
        header(&mut h, &head.headers, &HOST);
        let names: Vec<&HeaderName> = match &self.config.vary {
            Vary::Listed(names) => names.iter().collect(),
            Vary::AllExcept(ignored) => {
                // `keys` yields each name once; sorted, the key does not depend on the order
                // the headers were added in.
                let mut present: Vec<&HeaderName> = head
                    .headers
                    .keys()
                    .filter(|n| {
                        ignored
                            .binary_search_by(|i| i.as_str().cmp(n.as_str()))
                            .is_err()
                    })
                    .collect();
                present.sort_by(|a, b| a.as_str().cmp(b.as_str()));
                present
            }
        };
        // `Host` is in already.
        for name in names.into_iter().filter(|n| **n != HOST) {
            header(&mut h, &head.headers, name);
        }
        field(&mut h, body);
        h.finalize().into()
    }

    /// Joins the flight of `key`, or starts it.
    pub(crate) fn join(&self, key: Key) -> Role {
        let mut flights = lock(&self.state.flights);
        if let Some(flight) = flights.get(&key) {
            return Role::Follow(Follower {
                state: self.state.clone(),
                rx: flight.subscribe(),
            });
        }
        let flight = Arc::new(watch::Sender::new(None));
        flights.insert(key, flight.clone());
        drop(flights);
        self.state.led.fetch_add(1, Relaxed);
        Role::Lead(Leader {
            state: self.state.clone(),
            key,
            flight,
        })
    }
}

fn sort(names: &mut Vec<HeaderName>) {
    names.sort_by(|a, b| a.as_str().cmp(b.as_str()));
    names.dedup();
}

fn field(h: &mut Sha256, bytes: &[u8]) {
    h.update((bytes.len() as u64).to_le_bytes());
    h.update(bytes);
}

/// Feeds `name` and every value of it in `headers` (how many, then each), so that a header
/// missing, present once and present twice all differ.
fn header(h: &mut Sha256, headers: &HeaderMap, name: &HeaderName) {
    field(h, name.as_str().as_bytes());
    let values = headers.get_all(name);
    h.update((values.iter().count() as u64).to_le_bytes());
    for v in values {
        field(h, v.as_bytes());
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn head(method: &str, uri: &str, headers: &[(&str, &str)]) -> Parts {
        let mut b = http::Request::builder().method(method).uri(uri);
        for (n, v) in headers {
            b = b.header(*n, *v);
        }
        b.body(()).unwrap().into_parts().0
    }

    #[test]
    fn the_key_covers_endpoint_method_uri_listed_headers_and_body() {
        let d = Dedup::default();
        let base = head("GET", "http://h/p?q=1", &[("authorization", "a")]);
        let k = d.key(0, "ep", &base, b"body");
        assert_eq!(k, d.key(0, "ep", &base.clone(), b"body"));
        assert_ne!(k, d.key(0, "other", &base, b"body"));
        assert_ne!(k, d.key(1, "ep", &base, b"body"), "another layered service");
        assert_ne!(k, d.key(0, "ep", &base, b"bodY"));
        assert_ne!(
            k,
            d.key(
                0,
                "ep",
                &head("HEAD", "http://h/p?q=1", &[("authorization", "a")]),
                b"body"
            )
        );
        assert_ne!(
            k,
            d.key(
                0,
                "ep",
                &head("GET", "http://h/p?q=2", &[("authorization", "a")]),
                b"body"
            )
        );
        assert_ne!(
            k,
            d.key(
                0,
                "ep",
                &head("GET", "https://h/p?q=1", &[("authorization", "a")]),
                b"body"
            )
        );
        assert_ne!(
            k,
            d.key(
                0,
                "ep",
                &head("GET", "http://h/p?q=1", &[("authorization", "b")]),
                b"body"
            )
        );
        assert_ne!(
            k,
            d.key(0, "ep", &head("GET", "http://h/p?q=1", &[]), b"body")
        );
        // A second value of a listed header counts.
        let two = head(
            "GET",
            "http://h/p?q=1",
            &[("authorization", "a"), ("authorization", "a")],
        );
        assert_ne!(k, d.key(0, "ep", &two, b"body"));
        // A tracing header or a request id does not count.
        for ignored in ["x-request-id", "traceparent", "x-b3-traceid"] {
            let extra = head(
                "GET",
                "http://h/p?q=1",
                &[("authorization", "a"), (ignored, "1")],
            );
            assert_eq!(k, d.key(0, "ep", &extra, b"body"), "{ignored}");
        }
        // Any other header does, one the layer has never heard of included.
        for counted in ["x-api-key", "x-tenant", "accept-language", "cookie"] {
            let extra = head(
                "GET",
                "http://h/p?q=1",
                &[("authorization", "a"), (counted, "1")],
            );
            assert_ne!(k, d.key(0, "ep", &extra, b"body"), "{counted}");
        }
    }

    #[test]
    fn the_ignored_list_can_be_changed_and_a_fixed_list_used_instead() {
        let name = |n: &'static str| HeaderName::from_static(n);
        let with = |n: &str, v: &str| head("GET", "http://h/p", &[(n, v)]);
        let differ = |d: &Dedup, n: &str| {
            d.key(0, "ep", &with(n, "1"), b"") != d.key(0, "ep", &with(n, "2"), b"")
        };
        let d = Dedup::default().ignore_header(name("x-debug-id"));
        assert!(!differ(&d, "x-debug-id"));
        assert!(differ(&d, "x-api-key"));
        let d = d.vary_on(name("x-debug-id")).vary_on(name("x-request-id"));
        assert!(differ(&d, "x-debug-id"));
        assert!(differ(&d, "x-request-id"));
        assert!(!differ(&d, "traceparent"));
        assert!(differ(
            &Dedup::default().vary_on_all_headers(),
            "traceparent"
        ));
        let fixed = Dedup::default().vary_only_on([name("accept")]);
        assert!(differ(&fixed, "accept"));
        assert!(!differ(&fixed, "x-api-key"));
        assert!(differ(
            &fixed.clone().vary_on(name("x-api-key")),
            "x-api-key"
        ));
        assert!(!differ(
            &fixed.clone().ignore_header(name("accept")),
            "accept"
        ));
        // Credentials count in every mode, whatever is asked.
        for credential in CREDENTIAL_HEADERS {
            let c = HeaderName::from_static(credential);
            assert!(differ(&fixed, credential), "{credential}");
            assert!(differ(&fixed.clone().ignore_header(c.clone()), credential));
            assert!(differ(&Dedup::default().ignore_header(c), credential));
        }
        // W3C baggage often names the tenant: it counts by default.
        assert!(differ(&Dedup::default(), "baggage"));
    }

    #[test]
    fn the_default_ignored_names_are_valid_lower_case_header_names() {
        for n in DEFAULT_IGNORED_HEADERS.iter().chain(CREDENTIAL_HEADERS) {
            assert_eq!(HeaderName::from_static(n).as_str(), *n);
        }
        assert!(
            !DEFAULT_IGNORED_HEADERS
                .iter()
                .any(|n| CREDENTIAL_HEADERS.contains(n))
        );
    }

    #[test]
    fn proxy_authorization_is_in_the_default_key() {
        let d = Dedup::default();
        let with = |v: &str| head("GET", "http://h/p", &[("proxy-authorization", v)]);
        let k = d.key(0, "ep", &with("Basic a"), b"");
        assert_eq!(k, d.key(0, "ep", &with("Basic a"), b""));
        assert_ne!(k, d.key(0, "ep", &with("Basic b"), b""));
        assert_ne!(k, d.key(0, "ep", &head("GET", "http://h/p", &[]), b""));
    }

    #[test]
    fn fields_are_length_prefixed() {
        let d = Dedup::default();
        // "ab" + "" and "a" + "b" must not meet.
        let h1 = head(
            "GET",
            "http://h/",
            &[("accept", "ab"), ("accept-language", "")],
        );
        let h2 = head(
            "GET",
            "http://h/",
            &[("accept", "a"), ("accept-language", "b")],
        );
        assert_ne!(d.key(0, "ep", &h1, b""), d.key(0, "ep", &h2, b""));
    }

    #[test]
    fn every_header_mode_ignores_the_order_of_names() {
        let d = Dedup::default().vary_on_all_headers();
        let h1 = head("GET", "http://h/", &[("x-a", "1"), ("x-b", "2")]);
        let h2 = head("GET", "http://h/", &[("x-b", "2"), ("x-a", "1")]);
        let h3 = head("GET", "http://h/", &[("x-b", "2"), ("x-a", "3")]);
        assert_eq!(d.key(0, "ep", &h1, b""), d.key(0, "ep", &h2, b""));
        assert_ne!(d.key(0, "ep", &h1, b""), d.key(0, "ep", &h3, b""));
    }

    #[test]
    fn a_leader_dropped_without_landing_leaves_the_table_and_closes_the_flight() {
        let d = Dedup::default();
        let Role::Lead(leader) = d.join([1; 32]) else {
            panic!("the first request leads");
        };
        let Role::Follow(follower) = d.join([1; 32]) else {
            panic!("the second follows");
        };
        assert_eq!(d.stats().in_flight, 1);
        drop(leader);
        assert_eq!(d.stats().in_flight, 0);
        assert!(follower.rx.has_changed().is_err());
        assert!(matches!(d.join([1; 32]), Role::Lead(_)));
    }
}
