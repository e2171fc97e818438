//! What the agent is told about a call ([`CallMeta`]) and what each attempt is told
//! ([`AttemptInfo`]).

use std::borrow::Cow;
use std::time::Duration;

use http::HeaderName;
use retryplane_policy::{RetryPolicy, Target};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

#[derive(Clone, Debug, PartialEq, Eq)]
enum Route<'a> {
    Http {
        method: Cow<'static, str>,
        path: &'a str,
    },
    Grpc {
        path: &'a str,
    },
    None,
}

/// A logical call's description: what picks the route policy and decides idempotency.
///
/// Only header *names* are kept (to see whether the idempotency key is present), never values:
/// a header whose every value is empty (or blank) is not recorded, so an empty key does not
/// count as a key.
/// The path is borrowed, not copied (a copy cost about as much as the rest of the agent's
/// bookkeeping on a call that succeeds at once): build the meta where the request's path lives.
#[derive(Clone, Debug)]
pub struct CallMeta<'a> {
    route: Route<'a>,
    idempotent: Option<bool>,
    has_idempotency_key: bool,
    replayable: bool,
    refused: bool,
    header_names: Vec<HeaderName>,
    cancel: Option<CancellationToken>,
    within: Option<Duration>,
}

impl<'a> CallMeta<'a> {
    /// An HTTP call: `method` (any case) and path; a query string is cut off and never used or
    /// logged. Idempotency comes from the policy's `idempotent_methods` and the key header.
    /// Routes are matched on the path as the server serves it, its dot segments resolved and
    /// `\` read as `/` (`/v1/search/../charges` is a call to `/v1/charges`:
    /// [`retryplane_policy::uri_path::as_served`]); logs show it as given.
    pub fn http(method: &str, path: &'a str) -> Self {
        Self::http_route(upper_method(method), path)
    }

    /// The call of a request as it goes out (the tower layer's): its method as sent. Methods
    /// are case-sensitive on the wire (RFC 9110 §9.1), so an extension method `get` is not
    /// `GET`: neither idempotent by the policy's `GET` nor matched by its routes.
    pub(crate) fn http_as_sent(method: &http::Method, path: &'a str) -> Self {
        let method = match STANDARD_METHODS.iter().find(|m| **m == method.as_str()) {
            Some(m) => Cow::Borrowed(*m),
            None => Cow::Owned(method.as_str().to_owned()),
        };
        Self::http_route(method, path)
    }

    fn http_route(method: Cow<'static, str>, path: &'a str) -> Self {
        // A byte scan: `?` and `#` are ASCII, so the cut is on a character boundary.
        let path = path
            .bytes()
            .position(|b| b == b'?' || b == b'#')
            .and_then(|end| path.get(..end))
            .unwrap_or(path);
        Self::new(Route::Http { method, path })
    }

    /// A gRPC call to `/pkg.Service/Method`. Not idempotent unless declared with
    /// [`CallMeta::idempotent`] or carrying the key.
    pub fn grpc(path: &'a str) -> Self {
        let mut meta = Self::new(Route::Grpc { path });
        meta.idempotent = Some(false);
        meta
    }

    /// A call with no route information: the endpoint's own policy, treated as idempotent
    /// unless [`CallMeta::idempotent`] says otherwise.
    pub fn endpoint() -> Self {
        let mut meta = Self::new(Route::None);
        meta.idempotent = Some(true);
        meta
    }

    fn new(route: Route<'a>) -> Self {
        Self {
            route,
            idempotent: None,
            has_idempotency_key: false,
            replayable: true,
            refused: false,
            header_names: Vec::new(),
            cancel: None,
            within: None,
        }
    }

    /// Declares whether the call is idempotent, overriding the method list.
    #[must_use]
    pub fn idempotent(mut self, idempotent: bool) -> Self {
        self.idempotent = Some(idempotent);
        self
    }

    /// Says the request carries the idempotency key header.
    #[must_use]
    pub fn with_idempotency_key(mut self, present: bool) -> Self {
        self.has_idempotency_key = present;
        self
    }

    /// Says the request cannot be sent again (its body was streamed, not kept): the call
    /// makes one attempt, whatever its failure (a failed connect included).
    pub(crate) fn not_replayable(mut self) -> Self {
        self.replayable = false;
        self
    }

    /// Whether the request can be sent again.
    pub(crate) fn replayable(&self) -> bool {
        self.replayable
    }

    /// Says the endpoint's breaker already refused the call (the tower layer asks it while it
    /// reads the request body, and stops reading): the call gives up with `circuit_open`
    /// before its first attempt, whatever the breaker says by then. A body left half read
    /// is not sent once in its stead, unretried.
    pub(crate) fn refused(mut self) -> Self {
        self.refused = true;
        self
    }

    /// Whether the breaker already refused the call ([`CallMeta::refused`]).
    pub(crate) fn was_refused(&self) -> bool {
        self.refused
    }

    /// Records the request's header names (not values), so the key header named by the
    /// policy is recognised. A header counts only with a value that is not empty or blank: an
    /// empty `Idempotency-Key:` is no key, and a non-idempotent call carrying it is not
    /// retried. The values are looked at, never kept.
    #[must_use]
    pub fn with_headers(mut self, headers: &http::HeaderMap) -> Self {
        self.header_names = headers
            .keys()
            .filter(|name| {
                headers
                    .get_all(*name)
                    .iter()
                    .any(|v| !v.as_bytes().trim_ascii().is_empty())
            })
            .cloned()
            .collect();
        self
    }

    /// A token that cancels the call, even during a pause or an attempt; a call whose token is
    /// cancelled before it starts makes no attempt.
    #[must_use]
    pub fn with_cancel(mut self, token: CancellationToken) -> Self {
        self.cancel = Some(token);
        self
    }

    /// The caller's own deadline, counted from the call's start: the call ends by the earlier
    /// of it and the policy's `deadline` (every attempt's timeout and every pause keep to it),
    /// and gives up with `deadline_exceeded` when it passes. A gRPC caller's `grpc-timeout` is
    /// one; the [`RetryLayer`](crate::layer::RetryLayer) reads it from the request itself.
    #[must_use]
    pub fn deadline_within(mut self, within: Duration) -> Self {
        self.within = Some(within);
        self
    }

    pub(crate) fn cancel_token(&self) -> Option<&CancellationToken> {
        self.cancel.as_ref()
    }

    /// The caller's own deadline ([`CallMeta::deadline_within`]).
    pub(crate) fn within(&self) -> Option<Duration> {
        self.within
    }

    /// The policy lookup target.
    pub(crate) fn target(&self) -> Target<'_> {
        match &self.route {
            Route::Http { method, path } => Target::Http { method, path },
            Route::Grpc { path } => Target::Grpc { path },
            Route::None => Target::Endpoint,
        }
    }

    /// The method for logs: the HTTP method, `grpc`, or `-`.
    pub(crate) fn method(&self) -> &str {
        match &self.route {
            Route::Http { method, .. } => method,
            Route::Grpc { .. } => "grpc",
            Route::None => "-",
        }
    }

    /// The path for logs (no query string), or `-`.
    pub(crate) fn path(&self) -> &str {
        match &self.route {
            Route::Http { path, .. } | Route::Grpc { path } => path,
            Route::None => "-",
        }
    }

    /// Whether the call may be repeated under `policy`: (idempotent, has the key).
    pub(crate) fn idempotency(&self, policy: &RetryPolicy) -> (bool, bool) {
        let idempotent = match (&self.idempotent, &self.route) {
            (Some(i), _) => *i,
            (None, Route::Http { method, .. }) => policy.is_idempotent(method),
            (None, _) => false,
        };
        let key = &*policy.idempotency_key_header;
        let has_key = self.has_idempotency_key
            || self
                .header_names
                .iter()
                .any(|n| n.as_str().eq_ignore_ascii_case(key));
        (idempotent, has_key)
    }
}

/// The methods of RFC 9110 and PATCH, kept without an allocation.
const STANDARD_METHODS: [&str; 9] = [
    "GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH", "CONNECT", "TRACE",
];

/// `method` in upper case: one of the standard methods without an allocation, any other
/// upper-cased into a new string.
fn upper_method(method: &str) -> Cow<'static, str> {
    // Most callers pass the method as `http::Method::as_str` gives it: upper case already.
    if let Some(m) = STANDARD_METHODS.iter().find(|m| **m == method) {
        return Cow::Borrowed(m);
    }
    match STANDARD_METHODS
        .iter()
        .find(|m| m.eq_ignore_ascii_case(method))
    {
        Some(m) => Cow::Borrowed(m),
        None => Cow::Owned(method.to_ascii_uppercase()),
    }
}

/// What one attempt is told.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttemptInfo {
    /// 1 for the first attempt.
    pub number: u32,
    /// This attempt's time limit: `min(per_try_timeout, deadline left)`; the agent enforces it.
    pub timeout: Duration,
    /// When the whole logical call must be over (tokio's clock).
    pub deadline: Instant,
    /// The pause slept before this attempt (`None` for the first): what the policy computed,
    /// Retry-After or pushback included.
    pub pause_before: Option<Duration>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_meta_drops_the_query_and_upper_cases_the_method() {
        let m = CallMeta::http("post", "/v1/charges?card=4242#x");
        assert_eq!(
            m.target(),
            Target::Http {
                method: "POST",
                path: "/v1/charges"
            }
        );
        assert_eq!(m.path(), "/v1/charges");
        assert_eq!(CallMeta::http("Get", "/").method(), "GET");
        assert_eq!(CallMeta::http("purge", "/").method(), "PURGE");
        assert_eq!(CallMeta::http("GET", "/a#b?c").path(), "/a");
        assert_eq!(CallMeta::http("GET", "?q=1").path(), "");
        assert_eq!(CallMeta::http("GET", "/é/ü?x").path(), "/é/ü");
    }

    #[test]
    fn an_empty_or_blank_key_header_is_no_key() {
        let policy = RetryPolicy::default();
        for empty in [&[""][..], &[" "], &["", "\t"]] {
            let mut headers = http::HeaderMap::new();
            for v in empty {
                headers.append("idempotency-key", v.parse().unwrap());
            }
            let m = CallMeta::http("POST", "/").with_headers(&headers);
            assert_eq!(m.idempotency(&policy), (false, false), "{empty:?}");
        }
        // One value that is not empty is enough.
        let mut headers = http::HeaderMap::new();
        headers.append("idempotency-key", "".parse().unwrap());
        headers.append("idempotency-key", "k-1".parse().unwrap());
        let m = CallMeta::http("POST", "/").with_headers(&headers);
        assert_eq!(m.idempotency(&policy), (false, true));
    }

    #[test]
    fn the_key_header_is_found_by_name_in_any_case() {
        let policy = RetryPolicy::default();
        let mut headers = http::HeaderMap::new();
        headers.insert("idempotency-key", "secret".parse().unwrap());
        let m = CallMeta::http("POST", "/").with_headers(&headers);
        assert_eq!(m.idempotency(&policy), (false, true));
        assert_eq!(
            CallMeta::http("GET", "/").idempotency(&policy),
            (true, false)
        );
        assert_eq!(
            CallMeta::grpc("/a.B/C").idempotency(&policy),
            (false, false)
        );
    }
}
