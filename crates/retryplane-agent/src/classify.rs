//! How an attempt's result counts for retrying: the [`Classify`] trait.
//!
//! [`crate::Endpoint::call`] classifies `Ok(t)` with `t.classify()` and `Err(e)` with
//! `e.classify()`. Implemented here for HTTP responses (`http::Response`, and with the `reqwest`
//! feature `reqwest::Response`: status and `Retry-After`; a gRPC
//! "Trailers-Only" response by its `grpc-status`, as a `tonic::Status`), gRPC
//! statuses (code and `grpc-retry-pushback-ms`; a status tonic made of a transport error, such
//! as a failed connect, by that error), tonic responses (success), `std::io::Error`,
//! `hyper::Error` and `hyper_util::client::legacy::Error` (connect / reset / timeout), and
//! boxed errors (`Box<dyn Error + Send + Sync>`, what a tower stack returns: by the status or
//! transport error they hold, as the tower layer judges them). A
//! timeout middleware's error in a chain (tower's `Timeout`, `tokio::time::timeout`) counts as
//! a timeout; tonic's own request timeout is judged by its code (`CANCELLED`), since it may be
//! the caller's deadline.
//! Implement it for your own response or error types, or pass a closure to
//! [`crate::Endpoint::call_with`].
//!
//! The hyper impls are not behind a cargo feature: tonic's transport, which the agent always
//! needs for its control-plane stream, already builds hyper and hyper-util's legacy client, so
//! they cost no extra crate.

use std::error::Error as StdError;
use std::io::ErrorKind;
use std::time::SystemTime;

use retryplane_policy::ErrorClass;
use retryplane_policy::codes::GrpcCode;
use retryplane_policy::engine::Outcome;
use retryplane_policy::retry_after::{Pushback, parse_grpc_pushback, parse_retry_after};

/// What one attempt's result means to the retry rules.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Classification {
    /// The attempt succeeded: return it.
    Success,
    /// A response or transport failure; the policy decides (an `Outcome` that is a success,
    /// such as HTTP 200 or gRPC `OK`, is returned at once).
    Outcome(Outcome),
    /// A failure no policy retries (a local error: bad input, encoding); returned at once with
    /// cause `not_retryable`, without counting against the circuit breaker.
    Fatal,
}

/// Maps a response or an error to a [`Classification`].
pub trait Classify {
    /// How this value counts.
    fn classify(&self) -> Classification;
}

/// `Retry-After` is read against the wall clock (an HTTP-date is wall-clock time); a malformed
/// value is kept as an error that the call ignores and logs (without the value).
///
/// A gRPC response (`content-type: application/grpc…`) with `grpc-status` among its headers
/// (a "Trailers-Only" response: what a server sends for an error before any message) is
/// classified by that code and its `grpc-retry-pushback-ms` header exactly as a
/// [`tonic::Status`] is. A gRPC response whose status comes in trailers is judged by its HTTP
/// status, a success: its body is not read here (the tower layer looks at its first frame:
/// trailers before any message are then the call's code).
///
/// A response a [`RetryLayer`](crate::layer::RetryLayer) gave up on (marked
/// [`GaveUp`](crate::layer::GaveUp)) is judged here by its status like any other: only a
/// `RetryLayer` stacked above reads the mark. (Read here, on every answer of every call, it
/// cost about 10 ns of the bench's call: "2026-12-07, 15:25–15:51" in BENCHMARKS.md.)
impl<B> Classify for http::Response<B> {
    fn classify(&self) -> Classification {
        http_classification(self.status(), self.headers())
    }
}

/// Whether a response's `extensions` say a [`RetryLayer`](crate::layer::RetryLayer) in this
/// process gave up on it. (An extension never crosses the wire: only a layer stacked below,
/// in-process, puts it there.)
pub(crate) fn gave_up_below(extensions: &http::Extensions) -> bool {
    extensions.get::<crate::layer::GaveUp>().is_some()
}

/// Whether `e` is, or holds in its source chain, the error of a
/// [`RetryLayer`](crate::layer::RetryLayer) that gave up with no answer (its circuit open,
/// its attempts timed out).
fn retry_error_in_chain(e: &(dyn StdError + 'static)) -> bool {
    chain(e).any(|err| err.is::<crate::layer::RetryError>())
}

/// (feature `reqwest`) As [`http::Response`]: the status, `Retry-After`, and a
/// "Trailers-Only" gRPC response by its `grpc-status`; the body is not read. So
/// `endpoint.call(meta, |_| client.get(url).send())` classifies both the response and the
/// [`reqwest::Error`].
#[cfg(feature = "reqwest")]
impl Classify for reqwest::Response {
    fn classify(&self) -> Classification {
        http_classification(self.status(), self.headers())
    }
}

/// The one reading of an HTTP response head, shared by the response types above.
fn http_classification(status: http::StatusCode, headers: &http::HeaderMap) -> Classification {
    if let Some(code) = trailers_only_grpc_code(headers) {
        return grpc_classification(code, headers);
    }
    let retry_after = retry_after(headers);
    Classification::Outcome(Outcome::Http {
        status: status.as_u16(),
        retry_after,
    })
}

/// A status that tonic made of a transport error (it keeps that error as the status's
/// `source()`) is classified by that error, as the layer classifies a client error: a failed
/// connect → connect, whatever failed (refused, DNS, the channel's `connect_timeout`; tonic
/// says `UNAVAILABLE`, but the request never left, so any method may be retried, and
/// `retry_on.errors: [connect]` applies), and so is a stream the server refused (HTTP/2
/// `REFUSED_STREAM`: not processed); a connection that broke → reset, a keep-alive or I/O
/// timeout → timeout, and so is a timeout middleware's error (tower's `Timeout` under the
/// channel): no answer came in time. tonic's own request timeout (`CANCELLED`) is judged by its
/// code: it may be the caller's deadline, which a retry must not run past (tonic raises the
/// same error for both). A status that holds a [`RetryError`](crate::layer::RetryError) (a
/// `RetryLayer` under the channel gave up with no answer) is fatal: retried at that layer
/// only, whatever the policy says of its pushback. Any other status (one the server sent, or
/// one with no transport error below it): `Code::Ok` is a success; any other code is an
/// outcome the policy judges, with the `grpc-retry-pushback-ms` trailer (non-ASCII counts as
/// unparseable: do not retry).
impl Classify for tonic::Status {
    fn classify(&self) -> Classification {
        if let Some(source) = self.source() {
            // A `RetryLayer` below gave up with no answer (its status holds its `RetryError`):
            // retried at one layer only, whatever this policy makes of the pushback it wrote.
            if retry_error_in_chain(source) {
                return Classification::Fatal;
            }
            // The caller's own errors that tonic hands back as a status: the channel's URI
            // (or a URL its connector refuses). Any other fatal error below a status is judged
            // by the status's code, as tonic's clients read it.
            if chain(source).any(|err| tonic_invalid_uri(err) || url_refused(err)) {
                return Classification::Fatal;
            }
            if let Some(transport @ Classification::Outcome(Outcome::Transport(_))) =
                transport_in_chain(source)
            {
                return transport;
            }
        }
        grpc_classification(self.code(), self.metadata().as_ref())
    }
}

/// How the tower layer judges the answer to a gRPC request: as tonic's client reads it, so that
/// a call counts the same through the layer as through [`Endpoint::call`](crate::Endpoint::call)
/// with a generated client. A `grpc-status` in the head is the call's code whatever the
/// content type (tonic reads it so); without one, an HTTP status other than 200 (a proxy's
/// answer) is the code tonic maps it to (gRPC's HTTP-to-status mapping: 400 `INTERNAL`, 401
/// `UNAUTHENTICATED`, 403 `PERMISSION_DENIED`, 404 `UNIMPLEMENTED`, 429, 502, 503 and 504
/// `UNAVAILABLE`, any other `UNKNOWN`), judged by `retry_on.grpc_status`, not `http_status`.
/// That is what tonic reads of an answer with an empty body; of one with an error page it
/// reads `INTERNAL` (the page is no gRPC message), but whether a body is empty is known only
/// once it is read, and many proxies send their head first: the status's code is counted.
/// A 200 without one has its status in trailers: judged a success, as
/// [`Classify for http::Response`](Classify) does, unless those trailers came before any
/// message (the layer looks at the first frame of such an answer and passes them here in place
/// of the head).
pub(crate) fn grpc_answer_classification(
    status: http::StatusCode,
    headers: &http::HeaderMap,
) -> Classification {
    use http::StatusCode as S;
    if let Some(code) = headers.get(GRPC_STATUS) {
        return grpc_classification(tonic::Code::from_bytes(code.as_bytes()), headers);
    }
    let code = match status {
        S::OK => return http_classification(status, headers),
        S::BAD_REQUEST => tonic::Code::Internal,
        S::UNAUTHORIZED => tonic::Code::Unauthenticated,
        S::FORBIDDEN => tonic::Code::PermissionDenied,
        S::NOT_FOUND => tonic::Code::Unimplemented,
        S::TOO_MANY_REQUESTS | S::BAD_GATEWAY | S::SERVICE_UNAVAILABLE | S::GATEWAY_TIMEOUT => {
            tonic::Code::Unavailable
        }
        _ => tonic::Code::Unknown,
    };
    grpc_classification(code, headers)
}

/// `grpc-status`, as tonic names it.
pub(crate) const GRPC_STATUS: http::HeaderName = http::HeaderName::from_static("grpc-status");
/// gRPC's retry pushback (gRFC A6), as a metadata key.
pub(crate) const GRPC_PUSHBACK_KEY: &str = "grpc-retry-pushback-ms";
/// The gRPC pushback header (gRFC A6).
pub(crate) const GRPC_PUSHBACK: http::HeaderName = http::HeaderName::from_static(GRPC_PUSHBACK_KEY);

/// The gRPC code of a "Trailers-Only" response: `grpc-status` in the headers of a response
/// whose content type is `application/grpc` (or `application/grpc+proto`, …). `None` for any
/// other response (an HTTP response, or a gRPC one whose status comes in trailers). An
/// unparseable code is `UNKNOWN`, as tonic reads it.
fn trailers_only_grpc_code(headers: &http::HeaderMap) -> Option<tonic::Code> {
    // `grpc-status` first: an HTTP response (the common case) stops at one lookup.
    let status = headers.get(GRPC_STATUS)?;
    let content_type = headers.get(http::header::CONTENT_TYPE)?;
    content_type
        .as_bytes()
        .starts_with(b"application/grpc")
        .then(|| tonic::Code::from_bytes(status.as_bytes()))
}

/// The one reading of a gRPC status, shared by [`tonic::Status`] and Trailers-Only HTTP
/// responses: `OK` is a success; any other code is an outcome the policy judges, with the
/// `grpc-retry-pushback-ms` value of `headers` (non-ASCII counts as unparseable: do not retry).
fn grpc_classification(code: tonic::Code, headers: &http::HeaderMap) -> Classification {
    if code == tonic::Code::Ok {
        return Classification::Success;
    }
    let code = GrpcCode::from_i32(code as i32).unwrap_or(GrpcCode::Unknown);
    let pushback = sole_value(headers, GRPC_PUSHBACK).map(|v| {
        v.and_then(|v| v.to_str().ok())
            .map_or(Pushback::DoNotRetry, parse_grpc_pushback)
    });
    Classification::Outcome(Outcome::Grpc { code, pushback })
}

/// An HTTP answer's `Retry-After` at `now`: `None` without one. It holds one value, but a proxy
/// or a middleware may add a line the upstream already sent: several lines that all read as
/// one delay are that delay (as RFC 9110 §8.6 reads repeated `Content-Length` lines), and lines
/// that differ give the longest delay among those that read, so that the server's answer is
/// not picked by the order of its lines and the call errs on the side of waiting (a delay over
/// `retry_after.max` then gives up). Lines of which none reads are malformed (ignored), and so
/// is one line of several values joined by commas (`120, 120`): not split up here.
fn retry_after(
    headers: &http::HeaderMap,
) -> Option<Result<std::time::Duration, retryplane_policy::retry_after::RetryAfterError>> {
    let mut lines = headers.get_all(http::header::RETRY_AFTER).into_iter();
    let line = lines.next()?;
    // An HTTP date is read against the answer's own `Date` (the upstream's clock when it
    // answered), so that the skew between its clock and this host's is not added to (or taken
    // from) the delay it asks for; without one `Date` that reads, against this host's wall
    // clock, read only for an answer that has the header (a clock read costs about as much as
    // the rest of the classification).
    let now = answered_at(headers).unwrap_or_else(SystemTime::now);
    let read = |v: &http::HeaderValue| {
        v.to_str()
            .map_err(|_| retryplane_policy::retry_after::RetryAfterError::Malformed)
            .and_then(|s| parse_retry_after(s, now))
    };
    let first = read(line);
    Some(
        lines.fold(first, |longest, line| match (longest, read(line)) {
            (Ok(a), Ok(b)) => Ok(a.max(b)),
            (Ok(a), Err(_)) | (Err(_), Ok(a)) => Ok(a),
            (Err(e), Err(_)) => Err(e),
        }),
    )
}

/// When the answer was current on its server's clock: its `Date` (when it has exactly one that
/// reads as an HTTP date), plus its `Age` when a cache kept it that long (RFC 9111 §4.2.3: the
/// `Retry-After` of a kept answer counts from when it was made, and it has aged since). An
/// `Age` that is no whole number of seconds (or comes on several lines) is left out, and the
/// `Date` still counts: at worst the answer is older than it says, and the pause comes out
/// longer, never shorter. One past 2^31 seconds counts as 2^31 (RFC 9111 §1.2.2).
fn answered_at(headers: &http::HeaderMap) -> Option<SystemTime> {
    const MOST_AGE: u64 = 1 << 31;
    let date = sole_value(headers, http::header::DATE)??;
    let date = retryplane_policy::retry_after::parse_date(date.to_str().ok()?)?;
    let age = sole_value(headers, http::header::AGE)
        .flatten()
        .and_then(|age| age.to_str().ok())
        .map(str::trim_ascii)
        .filter(|age| !age.is_empty() && age.bytes().all(|b| b.is_ascii_digit()))
        .map_or(0, |age| {
            age.parse::<u64>().map_or(MOST_AGE, |a| a.min(MOST_AGE))
        });
    date.checked_add(std::time::Duration::from_secs(age))
}

/// The value of a header that holds one value (`grpc-retry-pushback-ms`): `None` when it is
/// absent, `Some(None)` when it comes on several field lines. Those mean the same as one line
/// of the values joined by commas, which the header cannot parse: so a hint reads the same
/// whether or not a proxy joined the lines, and the server's answer is not picked by the order
/// of its lines (an unparseable pushback means "do not retry", as gRPC-Go reads several).
fn sole_value(
    headers: &http::HeaderMap,
    name: http::HeaderName,
) -> Option<Option<&http::HeaderValue>> {
    let mut values = headers.get_all(name).into_iter();
    let first = values.next()?;
    Some(values.next().is_none().then_some(first))
}

/// A gRPC response is a success.
impl<M> Classify for tonic::Response<M> {
    fn classify(&self) -> Classification {
        Classification::Success
    }
}

/// Refused or unreachable → connect (never reached the server); reset, aborted, broken pipe or
/// early EOF → reset (unknown outcome); timed out → timeout. An error of another kind that
/// wraps a client error (`io::Error::other(e)`, a common way to fit a client's error into an
/// `io::Error`) counts as that error does under the tower layer (see
/// `Classify for Box<dyn Error + Send + Sync>`); anything else is fatal.
impl Classify for std::io::Error {
    fn classify(&self) -> Classification {
        match io_class(self.kind()) {
            Some(class) => Classification::Outcome(Outcome::Transport(class)),
            None => transport_in_chain(self).unwrap_or(Classification::Fatal),
        }
    }
}

/// A type-erased error, what a tower stack's services return (`tower::BoxError`) and what
/// `?` makes of any error: a boxed [`tonic::Status`] counts as that status; a
/// [`RetryError`](crate::layer::RetryError) in its chain (a `RetryLayer` gave up with no
/// answer) is fatal, retried at that layer only; anything else by
/// its source chain, as the tower layer judges its inner service's errors (the first tonic
/// connect error, hyper-util or hyper error, (feature `reqwest`) reqwest error, timeout of a
/// middleware or classifiable `io::Error` decides), and as a reset (an unknown outcome: only
/// idempotent or keyed calls are retried) with none of them. (Such a box is no
/// `std::error::Error` itself, so neither is a call's `CallError` with it: `?` takes it once
/// [`CallError::boxed`](crate::CallError::boxed) has made it one.)
impl Classify for Box<dyn StdError + Send + Sync> {
    fn classify(&self) -> Classification {
        classify_dyn(&**self)
    }
}

/// As for `Box<dyn Error + Send + Sync>`.
impl Classify for Box<dyn StdError> {
    fn classify(&self) -> Classification {
        classify_dyn(&**self)
    }
}

/// What a boxed error counts as (see `Classify for Box<dyn Error + Send + Sync>`).
fn classify_dyn(e: &(dyn StdError + 'static)) -> Classification {
    match e.downcast_ref::<tonic::Status>() {
        Some(status) => status.classify(),
        None => classify_boxed(e),
    }
}

/// (feature `reqwest`) The error `Response::error_for_status` makes of a 4xx or 5xx answer →
/// that HTTP status, as the response itself would count (its `Retry-After` is not kept in the
/// error, so none is honored); a failure to connect → connect (a connect timeout included: the
/// request never left), and so is a stream the server refused (HTTP/2 `REFUSED_STREAM`, which
/// reqwest sends again itself twice at most before it reports it: not processed); a timeout →
/// timeout; a request or body that failed on the way → reset
/// (unknown outcome). Any other error is judged by the transport error below it, if there is one:
/// reqwest reports a connection that broke while the response body was read (`chunk()`,
/// `bytes()`, `text()`) as a decoding error over the `hyper::Error` or `io::Error` that says
/// what happened, so that one decides (a reset mid-body is a reset). Without a transport
/// error below it (a bad URL or builder, a redirect loop, a body that is not valid JSON or
/// gzip) the error is fatal.
#[cfg(feature = "reqwest")]
impl Classify for reqwest::Error {
    fn classify(&self) -> Classification {
        if let Some(status) = self.status() {
            return Classification::Outcome(Outcome::Http {
                status: status.as_u16(),
                retry_after: None,
            });
        }
        // A stream the server refused (HTTP/2 `REFUSED_STREAM`) was not processed: reqwest sends
        // it again itself, twice at most, and reports it as a request error once a server
        // keeps refusing. Not once the answer's head came (an error reading the body): the
        // request was processed, whatever the reset says.
        let refused = !self.is_body() && !self.is_decode() && refused_stream_in_chain(self);
        let class = if self.is_connect() || refused {
            ErrorClass::Connect
        } else if self.is_timeout() {
            ErrorClass::Timeout
        } else if self.is_request() || self.is_body() {
            ErrorClass::Reset
        } else if let Some(class) = reqwest_transport_class(self) {
            class
        } else {
            return Classification::Fatal;
        };
        Classification::Outcome(Outcome::Transport(class))
    }
}

/// The transport class of the first reqwest body error, hyper error or classifiable
/// `io::Error` in `e`'s source chain (`e` excluded), on a connection that was up (a
/// "never connected" kind there is a reset); `None` when there is none, or when the hyper
/// error is the caller's own.
#[cfg(feature = "reqwest")]
fn reqwest_transport_class(e: &reqwest::Error) -> Option<ErrorClass> {
    // `Some(None)`: a hyper error of the caller's own, which ends the walk.
    let found = e.source().map(chain)?.find_map(|err| {
        if let Some(r) = err.downcast_ref::<reqwest::Error>() {
            if r.is_timeout() {
                return Some(Some(ErrorClass::Timeout));
            }
            if r.is_request() || r.is_body() {
                return Some(Some(ErrorClass::Reset));
            }
        }
        if let Some(h) = err.downcast_ref::<hyper::Error>() {
            return Some(hyper_class(h));
        }
        io_error_class(err).map(|class| Some(on_connection(class)))
    });
    found.flatten()
}

/// hyper never dials, so every error it reports happened on a connection that was up: the
/// request may have been sent. A timeout (hyper's own timers, such as the HTTP/2 keep-alive)
/// → timeout; an `io::Error` in the source chain → its class, except that the "never
/// connected" kinds count as reset here; a closed channel, a canceled request or a message cut
/// short by EOF → reset; an error of the caller's own making (`is_user`: its request body
/// failed, the runtime dropped the connection task, …) is fatal; anything else (a malformed
/// response, an HTTP/2 protocol error) → reset. Reset and timeout are unknown outcomes: only
/// idempotent or keyed requests are retried.
impl Classify for hyper::Error {
    fn classify(&self) -> Classification {
        match hyper_class(self) {
            Some(class) => Classification::Outcome(Outcome::Transport(class)),
            None => Classification::Fatal,
        }
    }
}

/// The caller's own errors are fatal, sent to no upstream and held against none (its breaker):
/// a request the client refuses (a relative URI, an unsupported method or version), and a URL
/// the connector refuses (`https://` through the plain HTTP connector, no host). Otherwise
/// `is_connect()` → connect, whatever the cause below it (refused, unreachable, DNS, or the
/// connector's `connect_timeout`): the request never left, so any method may be retried.
/// Otherwise the `hyper::Error` in the source chain decides (see its impl); without one, an
/// `io::Error` in the chain (the connection was up: "never connected" kinds count as reset);
/// failing both → reset.
impl Classify for hyper_util::client::legacy::Error {
    fn classify(&self) -> Classification {
        if refused_by_the_client(self) {
            return Classification::Fatal;
        }
        if self.is_connect() {
            return Classification::Outcome(Outcome::Transport(ErrorClass::Connect));
        }
        let hyper = self
            .source()
            .map(chain)
            .and_then(|mut c| c.find_map(|err| err.downcast_ref::<hyper::Error>()));
        if let Some(h) = hyper {
            return h.classify();
        }
        let class = connected_io_class(self).unwrap_or(ErrorClass::Reset);
        Classification::Outcome(Outcome::Transport(class))
    }
}

/// Whether hyper-util's client refused the request itself, before any byte left: its own
/// `User…` kinds (a relative URI, an unsupported method or version), or its HTTP connector's
/// refusal of the URL (`invalid URL, scheme is not http`, `… scheme is missing`, `… host is
/// missing`), or hyper-rustls's (`unsupported scheme http` from an `https_only` connector,
/// `missing scheme`). hyper-util exposes neither as a kind (`is_connect` is all it has, and its
/// connector's error type is private), so its messages are read: `client error (KIND)` is
/// its `Display`, and the connectors' are fixed strings. A version that words them otherwise
/// makes such a request a connect failure or a reset again, as before this check (the tests
/// `real_upstream.rs` pin both).
fn refused_by_the_client(e: &hyper_util::client::legacy::Error) -> bool {
    if e.to_string().starts_with("client error (User") {
        return true;
    }
    e.is_connect()
        && e.source()
            .is_some_and(|source| chain(source).any(url_refused))
}

/// Whether `err` is a connector's refusal of a URL, by its fixed message: hyper-util's plain
/// connector (`invalid URL, …`), hyper-rustls's (`unsupported scheme …` from an `https_only`
/// connector, `missing scheme`). Neither crate exposes its connector errors' kinds.
fn url_refused(err: &(dyn StdError + 'static)) -> bool {
    const REFUSALS: [&str; 3] = ["invalid URL", "unsupported scheme", "missing scheme"];
    let message = err.to_string();
    REFUSALS.iter().any(|r| message.starts_with(r))
}

/// Whether `err` is tonic's refusal of its channel's URI (`invalid URI`: `host:port` without a
/// scheme, a URI it cannot send to). tonic exposes no kind; its message for this one is fixed.
fn tonic_invalid_uri(err: &(dyn StdError + 'static)) -> bool {
    err.downcast_ref::<tonic::transport::Error>()
        .is_some_and(|e| e.to_string() == "invalid URI")
}

/// Whether an HTTP/2 `REFUSED_STREAM` is in `e`'s source chain (`e` included): the server
/// refused the stream before processing it (RFC 9113 §8.7), so the request was certainly not
/// acted on, as with a refused connection, and any method may be sent again. gRPC clients
/// retry it transparently for the same reason.
fn refused_stream_in_chain(e: &(dyn StdError + 'static)) -> bool {
    chain(e).any(refused_stream)
}

/// Whether tonic's own request timeout ([`tonic::TimeoutExpired`]) is in `e`'s source chain
/// (`e` included).
pub(crate) fn tonic_timeout_in_chain(e: &(dyn StdError + 'static)) -> bool {
    chain(e).any(|err| err.is::<tonic::TimeoutExpired>())
}

/// `e`, then its sources in turn.
fn chain<'a>(
    e: &'a (dyn StdError + 'static),
) -> impl Iterator<Item = &'a (dyn StdError + 'static)> {
    std::iter::successors(Some(e), |&err| match err.downcast_ref::<std::io::Error>() {
        // An `io::Error` that wraps an error (`io::Error::other(e)`, `io::Error::new(kind, e)`)
        // gives that error's source as its own, skipping the error itself: step into it.
        Some(io) => match io.get_ref() {
            Some(inner) => Some(inner as &(dyn StdError + 'static)),
            None => err.source(),
        },
        None => err.source(),
    })
}

/// Whether `e` failed reading an answer's body (hyper's `Kind::Body`): the head had come.
/// hyper exposes no kind for it; its message is fixed.
fn reading_a_body(e: &hyper::Error) -> bool {
    e.to_string()
        .starts_with("error reading a body from connection")
}

/// Whether `e` itself is the peer's reset of the stream with `REFUSED_STREAM` (see
/// [`refused_stream_in_chain`]). Only that says "not processed": the same code in an h2 error
/// made by a layer does not, and neither does the peer's `GOAWAY`. h2 gives a `GOAWAY` to the
/// streams above its last stream id, which were not processed, but hyper also hands it to a
/// request whose stream h2 had just opened when the connection's first, graceful `GOAWAY`
/// came (its `poll_ready` after `send_request` returns the connection's error), and that
/// request's HEADERS still go out, inside the server's last stream id: it may be processed.
/// The error does not tell the two apart, so it is a reset (an unknown outcome).
fn refused_stream(e: &(dyn StdError + 'static)) -> bool {
    e.downcast_ref::<h2::Error>().is_some_and(|h2| {
        h2.is_reset() && h2.is_remote() && h2.reason() == Some(h2::Reason::REFUSED_STREAM)
    })
}

/// The class of a `hyper::Error`, `None` when it is the caller's own error. A stream the server
/// refused (HTTP/2 `REFUSED_STREAM`) is connect: the request was not processed; unless the
/// refusal cut the answer's body, whose head proves it was (a reset then).
fn hyper_class(e: &hyper::Error) -> Option<ErrorClass> {
    if refused_stream_in_chain(e) && !reading_a_body(e) {
        return Some(ErrorClass::Connect);
    }
    if e.is_timeout() {
        return Some(ErrorClass::Timeout);
    }
    if let Some(class) = connected_io_class(e) {
        return Some(class);
    }
    if e.is_closed() || e.is_canceled() || e.is_incomplete_message() {
        return Some(ErrorClass::Reset);
    }
    // hyper files "dispatch task is gone" under the caller's errors, but it comes when the
    // connection's task ended under a request still waiting to be sent (the server's
    // connection lost while the request waited for a stream slot): a lost connection.
    // hyper exposes no kind for it; its message is fixed.
    if e.is_user() && !e.to_string().starts_with("dispatch task is gone") {
        return None;
    }
    Some(ErrorClass::Reset)
}

/// The class of the first `io::Error` with one in `e`'s source chain (`e` included), on a
/// connection that was established: a "never connected" kind there means it broke (reset).
fn connected_io_class(e: &(dyn StdError + 'static)) -> Option<ErrorClass> {
    io_class_in_chain(e).map(on_connection)
}

/// `class` of an I/O error on a connection that was established: a "never connected" kind
/// there means it broke (reset).
fn on_connection(class: ErrorClass) -> ErrorClass {
    match class {
        ErrorClass::Connect => ErrorClass::Reset,
        other => other,
    }
}

/// The class of the first `io::Error` with one in `e`'s source chain, `e` included.
fn io_class_in_chain(e: &(dyn StdError + 'static)) -> Option<ErrorClass> {
    chain(e).find_map(io_error_class)
}

/// The class of `e` if it is an `io::Error` of a kind with one.
fn io_error_class(e: &(dyn StdError + 'static)) -> Option<ErrorClass> {
    e.downcast_ref::<std::io::Error>()
        .and_then(|io| io_class(io.kind()))
}

/// The classification of a type-erased client error (what a tower stack returns): the first
/// hyper-util client error, hyper error, timeout of a middleware (see [`timed_out`]) or
/// classifiable `io::Error` in its source chain decides, by the impls above; with none of them
/// → reset (unknown outcome).
pub(crate) fn classify_boxed(e: &(dyn StdError + 'static)) -> Classification {
    transport_in_chain(e).unwrap_or(Classification::Outcome(Outcome::Transport(
        ErrorClass::Reset,
    )))
}

/// The classification of the first tonic connect error, hyper-util client error, hyper error,
/// (feature `reqwest`) reqwest transport or status error, timeout of a middleware or classifiable
/// `io::Error` in `e`'s source chain (`e` included), by the impls above; `None` without one. A
/// [`tonic::ConnectError`] (what a tonic `Channel` makes of a failed dial: a refused
/// connection, a DNS failure, its `connect_timeout`) is connect whatever is below it, as
/// hyper-util's `is_connect()` is: the request never left. A timeout of a middleware (see
/// [`timed_out`]) is timeout: it has no source, so a connect error can only be above it in the
/// chain, and is found first.
fn transport_in_chain(e: &(dyn StdError + 'static)) -> Option<Classification> {
    chain(e).find_map(transport_of)
}

/// What `err` itself says, if it is one of the errors [`transport_in_chain`] looks for.
fn transport_of(err: &(dyn StdError + 'static)) -> Option<Classification> {
    let transport = |class| Some(Classification::Outcome(Outcome::Transport(class)));
    // A `RetryLayer` below gave up with no answer: what it retried (or refused) is not sent
    // again by a layer or call above it.
    if err.is::<crate::layer::RetryError>() {
        return Some(Classification::Fatal);
    }
    // tonic's refusal of its channel's URI (`invalid URI`: `host:port` without a scheme, a
    // URI it cannot send to): the caller's own, sent nowhere. tonic exposes no error kind;
    // its message for this one is fixed.
    if tonic_invalid_uri(err) {
        return Some(Classification::Fatal);
    }
    // A stream the server refused: tonic puts the h2 error itself under its status (under
    // a hyper error, the hyper arm below says the same).
    // A connector's refusal of the URL under tonic's connect error (hyper-rustls's
    // `https_only`, with an `http://` channel) is the caller's own, as under hyper-util.
    if err.is::<tonic::ConnectError>() {
        if chain(err).any(url_refused) {
            return Some(Classification::Fatal);
        }
        return transport(ErrorClass::Connect);
    }
    if refused_stream(err) {
        return transport(ErrorClass::Connect);
    }
    if let Some(e) = err.downcast_ref::<hyper_util::client::legacy::Error>() {
        return Some(e.classify());
    }
    if let Some(e) = err.downcast_ref::<hyper::Error>() {
        return Some(e.classify());
    }
    // A reqwest error that says connect, timeout or reset, or the HTTP status of an
    // answer `error_for_status` turned into an error, as `Endpoint::call` counts it (a bad
    // URL is neither: the walk goes on below it).
    #[cfg(feature = "reqwest")]
    if let Some(e) = err.downcast_ref::<reqwest::Error>()
        && let outcome @ Classification::Outcome(Outcome::Transport(_) | Outcome::Http { .. }) =
            e.classify()
    {
        return Some(outcome);
    }
    if timed_out(err) {
        return transport(ErrorClass::Timeout);
    }
    // tonic's own request timeout, as the `CANCELLED` status tonic makes of it (see
    // [`timed_out`]): under the layer it comes as a bare error, not yet a status.
    if err.is::<tonic::TimeoutExpired>() {
        return Some(Classification::Outcome(Outcome::Grpc {
            code: GrpcCode::Cancelled,
            pushback: None,
        }));
    }
    io_error_class(err).and_then(transport)
}

/// Whether `e` is the error of a timeout middleware that gave up waiting for the service below
/// it: tower's `Timeout` ([`tower::timeout::error::Elapsed`]) or `tokio::time::timeout`
/// ([`tokio::time::error::Elapsed`]). Under the agent, each attempt passes through it, so it is
/// a per-attempt limit: no answer came in time, a timeout, an unknown outcome (the request may
/// have been sent and acted on).
///
/// tonic's own request timeout ([`tonic::TimeoutExpired`], status `CANCELLED`) is not one:
/// tonic raises it for a channel's `Endpoint::timeout` and for the caller's deadline
/// (`Request::set_timeout`, the `grpc-timeout` header) alike, and the caller's deadline is the
/// whole call's. Taken as a timeout, an idempotent call would be sent again with the same
/// `grpc-timeout` and run past it. So that status is judged by its code, as the server's would
/// be. (The tower layer, which writes the caller's `grpc-timeout` itself and ends the call at
/// that deadline with its own timer, counts the one it sees as a timeout.)
fn timed_out(e: &(dyn StdError + 'static)) -> bool {
    e.is::<tower::timeout::error::Elapsed>() || e.is::<tokio::time::error::Elapsed>()
}

/// The transport class of an I/O error kind, if it is one.
pub(crate) fn io_class(kind: ErrorKind) -> Option<ErrorClass> {
    match kind {
        ErrorKind::ConnectionRefused
        | ErrorKind::NotConnected
        | ErrorKind::AddrNotAvailable
        | ErrorKind::HostUnreachable
        | ErrorKind::NetworkUnreachable
        | ErrorKind::NetworkDown => Some(ErrorClass::Connect),
        ErrorKind::ConnectionReset
        | ErrorKind::ConnectionAborted
        | ErrorKind::BrokenPipe
        | ErrorKind::UnexpectedEof => Some(ErrorClass::Reset),
        ErrorKind::TimedOut => Some(ErrorClass::Timeout),
        _ => None,
    }
}

/// A short, value-free name of an outcome for logs: `503`, `UNAVAILABLE`, `reset`. Formatted
/// only when a log line is written: the call path does not allocate it.
pub(crate) fn class_name(outcome: &Outcome) -> ClassName<'_> {
    ClassName(outcome)
}

/// See [`class_name`].
pub(crate) struct ClassName<'a>(&'a Outcome);

impl std::fmt::Display for ClassName<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Outcome::Http { status, .. } => write!(f, "{status}"),
            Outcome::Grpc { code, .. } => f.write_str(code.name()),
            Outcome::Transport(class) => f.write_str(class.as_str()),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use retryplane_policy::retry_after::{RetryAfterError, format_http_date};

    fn http(status: u16, retry_after: Option<&str>) -> Classification {
        let mut b = http::Response::builder().status(status);
        if let Some(v) = retry_after {
            b = b.header("retry-after", v);
        }
        b.body(()).unwrap().classify()
    }

    #[test]
    fn http_response_carries_status_and_parsed_retry_after() {
        assert_eq!(
            http(503, Some("3")),
            Classification::Outcome(Outcome::Http {
                status: 503,
                retry_after: Some(Ok(Duration::from_secs(3)))
            })
        );
        assert_eq!(
            http(429, Some("soon")),
            Classification::Outcome(Outcome::Http {
                status: 429,
                retry_after: Some(Err(RetryAfterError::Malformed))
            })
        );
        assert_eq!(
            http(200, None),
            Classification::Outcome(Outcome::Http {
                status: 200,
                retry_after: None
            })
        );
    }

    #[test]
    fn a_boxed_error_counts_as_the_status_or_transport_error_it_holds() {
        type BoxError = Box<dyn StdError + Send + Sync>;
        let transport = |class| Classification::Outcome(Outcome::Transport(class));
        let boxed = |e: BoxError| e.classify();
        let refused = std::io::Error::from(ErrorKind::ConnectionRefused);
        assert_eq!(boxed(Box::new(refused)), transport(ErrorClass::Connect));
        assert_eq!(
            boxed(Box::new(tower::timeout::error::Elapsed::new())),
            transport(ErrorClass::Timeout)
        );
        // A status with its pushback, as the status itself counts.
        let mut status = tonic::Status::unavailable("down");
        status
            .metadata_mut()
            .insert("grpc-retry-pushback-ms", "250".parse().unwrap());
        let expected = status.classify();
        assert_eq!(
            expected,
            Classification::Outcome(Outcome::Grpc {
                code: GrpcCode::Unavailable,
                pushback: Some(Pushback::After(Duration::from_millis(250)))
            })
        );
        assert_eq!(boxed(Box::new(status)), expected);
        // Nothing the agent knows: an unknown outcome.
        assert_eq!(boxed("no idea".into()), transport(ErrorClass::Reset));
        // Without Send + Sync too.
        let local: Box<dyn StdError> = Box::new(std::io::Error::from(ErrorKind::TimedOut));
        assert_eq!(local.classify(), transport(ErrorClass::Timeout));
    }

    /// The `Retry-After` delay of a 503 with these headers.
    fn date_hint(headers: &[(http::header::HeaderName, String)]) -> Duration {
        let mut builder = http::Response::builder().status(503);
        for (name, value) in headers {
            builder = builder.header(name, value);
        }
        let Classification::Outcome(Outcome::Http {
            retry_after: Some(Ok(d)),
            ..
        }) = builder.body(()).unwrap().classify()
        else {
            panic!("a date parses");
        };
        d
    }

    #[test]
    fn http_date_retry_after_counts_from_the_answers_own_date() {
        use http::header::{AGE, DATE, RETRY_AFTER};
        let at = |t: SystemTime| format_http_date(t);
        let secs = Duration::from_secs;
        // The upstream's clock is a minute off this host's, either way: it asks for 5 s.
        for upstream_now in [SystemTime::now() + secs(60), SystemTime::now() - secs(60)] {
            let d = date_hint(&[
                (DATE, at(upstream_now)),
                (RETRY_AFTER, at(upstream_now + secs(5))),
            ]);
            assert_eq!(d, secs(5));
        }
        // A cached answer, made an hour ago (`Date`) and kept since (`Age`), asked for a retry
        // 61 minutes after it was made: a minute from now.
        let made = SystemTime::now() - secs(3600);
        let d = date_hint(&[
            (DATE, at(made)),
            (AGE, "3600".to_owned()),
            (RETRY_AFTER, at(made + secs(3660))),
        ]);
        assert_eq!(d, secs(60));
        // Two `Date` lines, or one that does not read: this host's clock.
        let ahead = SystemTime::now() + secs(3600);
        let asked = (RETRY_AFTER, at(ahead + secs(5)));
        for dates in [vec![at(ahead), at(ahead)], vec!["soon".to_owned()]] {
            let mut headers: Vec<_> = dates.into_iter().map(|d| (DATE, d)).collect();
            headers.push(asked.clone());
            let d = date_hint(&headers);
            assert!(d > secs(3600), "{d:?}");
        }
    }

    #[test]
    fn http_date_retry_after_without_a_date_counts_from_the_wall_clock() {
        let date = format_http_date(SystemTime::now() + Duration::from_secs(120));
        let Classification::Outcome(Outcome::Http {
            retry_after: Some(Ok(d)),
            ..
        }) = http(503, Some(&date))
        else {
            panic!("a date parses");
        };
        assert!(d > Duration::from_secs(110) && d <= Duration::from_secs(120));
    }

    #[test]
    fn grpc_status_carries_code_and_pushback_and_ok_is_success() {
        let mut s = tonic::Status::unavailable("down");
        s.metadata_mut()
            .insert("grpc-retry-pushback-ms", "250".parse().unwrap());
        assert_eq!(
            s.classify(),
            Classification::Outcome(Outcome::Grpc {
                code: GrpcCode::Unavailable,
                pushback: Some(Pushback::After(Duration::from_millis(250)))
            })
        );
        let mut s = tonic::Status::resource_exhausted("busy");
        s.metadata_mut()
            .insert("grpc-retry-pushback-ms", "-1".parse().unwrap());
        assert_eq!(
            s.classify(),
            Classification::Outcome(Outcome::Grpc {
                code: GrpcCode::ResourceExhausted,
                pushback: Some(Pushback::DoNotRetry)
            })
        );
        assert_eq!(
            tonic::Status::new(tonic::Code::Ok, "").classify(),
            Classification::Success
        );
    }

    #[test]
    fn a_hint_on_several_lines_is_read_whatever_their_order() {
        // A line added again by a proxy is the same delay; lines that differ give the longest
        // that reads, whichever comes first; none that reads is malformed, as one joined line
        // is.
        let twice = |a: &str, b: &str| {
            http::Response::builder()
                .status(503)
                .header("retry-after", a)
                .header("retry-after", b)
                .body(())
                .unwrap()
                .classify()
        };
        let after = |secs| {
            Classification::Outcome(Outcome::Http {
                status: 503,
                retry_after: Some(Ok(std::time::Duration::from_secs(secs))),
            })
        };
        let malformed = Classification::Outcome(Outcome::Http {
            status: 503,
            retry_after: Some(Err(RetryAfterError::Malformed)),
        });
        assert_eq!(twice("120", "120"), after(120));
        assert_eq!(twice("1", "120"), after(120));
        assert_eq!(twice("120", "1"), after(120));
        assert_eq!(twice("soon", "7"), after(7));
        assert_eq!(twice("7", "soon"), after(7));
        assert_eq!(twice("soon", "later"), malformed);
        assert_eq!(http(503, Some("1, 120")), malformed);
        // Several pushback values are unparseable: do not retry (as one joined line is).
        let do_not_retry = Classification::Outcome(Outcome::Grpc {
            code: GrpcCode::Unavailable,
            pushback: Some(Pushback::DoNotRetry),
        });
        let mut s = tonic::Status::unavailable("down");
        s.metadata_mut()
            .append("grpc-retry-pushback-ms", "10".parse().unwrap());
        s.metadata_mut()
            .append("grpc-retry-pushback-ms", "60000".parse().unwrap());
        assert_eq!(s.classify(), do_not_retry);
        assert_eq!(
            grpc_response(
                "application/grpc",
                &[
                    ("grpc-status", "14"),
                    ("grpc-retry-pushback-ms", "10"),
                    ("grpc-retry-pushback-ms", "60000")
                ]
            ),
            do_not_retry
        );
        let mut s = tonic::Status::unavailable("down");
        s.metadata_mut()
            .insert("grpc-retry-pushback-ms", "10, 60000".parse().unwrap());
        assert_eq!(s.classify(), do_not_retry);
    }

    fn grpc_response(content_type: &str, headers: &[(&str, &str)]) -> Classification {
        let mut b = http::Response::builder()
            .status(200)
            .header("content-type", content_type);
        for (name, value) in headers {
            b = b.header(*name, *value);
        }
        b.body(()).unwrap().classify()
    }

    #[test]
    fn a_trailers_only_grpc_response_is_classified_by_its_grpc_status_and_pushback() {
        let status = [("grpc-status", "14"), ("grpc-retry-pushback-ms", "250")];
        let expected = Classification::Outcome(Outcome::Grpc {
            code: GrpcCode::Unavailable,
            pushback: Some(Pushback::After(Duration::from_millis(250))),
        });
        assert_eq!(grpc_response("application/grpc", &status), expected);
        assert_eq!(grpc_response("application/grpc+proto", &status), expected);
        // The same as the status tonic makes of those headers.
        let mut headers = http::HeaderMap::new();
        headers.insert("grpc-status", "14".parse().unwrap());
        headers.insert("grpc-retry-pushback-ms", "250".parse().unwrap());
        let from_headers = tonic::Status::from_header_map(&headers).unwrap();
        assert_eq!(from_headers.classify(), expected);

        assert_eq!(
            grpc_response("application/grpc", &[("grpc-status", "3")]),
            Classification::Outcome(Outcome::Grpc {
                code: GrpcCode::InvalidArgument,
                pushback: None
            })
        );
        assert_eq!(
            grpc_response(
                "application/grpc",
                &[("grpc-status", "8"), ("grpc-retry-pushback-ms", "-1")]
            ),
            Classification::Outcome(Outcome::Grpc {
                code: GrpcCode::ResourceExhausted,
                pushback: Some(Pushback::DoNotRetry)
            })
        );
        assert_eq!(
            grpc_response("application/grpc", &[("grpc-status", "0")]),
            Classification::Success
        );
        assert_eq!(
            grpc_response("application/grpc", &[("grpc-status", "x")]),
            Classification::Outcome(Outcome::Grpc {
                code: GrpcCode::Unknown,
                pushback: None
            })
        );
    }

    #[test]
    fn a_grpc_response_without_grpc_status_or_an_http_one_with_it_is_judged_by_http_status() {
        let http_200 = Classification::Outcome(Outcome::Http {
            status: 200,
            retry_after: None,
        });
        // Status in trailers, after data: the head is all the layer sees.
        assert_eq!(grpc_response("application/grpc", &[]), http_200);
        // Not gRPC: the header means nothing.
        assert_eq!(
            grpc_response("application/json", &[("grpc-status", "14")]),
            http_200
        );
    }

    #[cfg(feature = "reqwest")]
    #[test]
    fn a_reqwest_status_error_counts_as_its_http_status() {
        for status in [503, 429, 404] {
            let response = http::Response::builder()
                .status(status)
                .header("retry-after", "7")
                .body("")
                .unwrap();
            let err = reqwest::Response::from(response)
                .error_for_status()
                .unwrap_err();
            let expected = Classification::Outcome(Outcome::Http {
                status,
                retry_after: None,
            });
            assert_eq!(err.classify(), expected, "{status}");
            // Under a tower stack (the layer's boxed error), wrapped or not.
            assert_eq!(classify_boxed(&err), expected, "{status}");
            let wrapped = Wrapped(Box::new(err));
            assert_eq!(classify_boxed(&wrapped), expected, "{status}");
        }
    }

    #[test]
    fn io_errors_map_to_connect_reset_timeout_or_fatal() {
        let c = |k| std::io::Error::from(k).classify();
        let t = |class| Classification::Outcome(Outcome::Transport(class));
        assert_eq!(c(ErrorKind::ConnectionRefused), t(ErrorClass::Connect));
        assert_eq!(c(ErrorKind::ConnectionReset), t(ErrorClass::Reset));
        assert_eq!(c(ErrorKind::ConnectionAborted), t(ErrorClass::Reset));
        assert_eq!(c(ErrorKind::BrokenPipe), t(ErrorClass::Reset));
        assert_eq!(c(ErrorKind::UnexpectedEof), t(ErrorClass::Reset));
        assert_eq!(c(ErrorKind::TimedOut), t(ErrorClass::Timeout));
        assert_eq!(c(ErrorKind::InvalidData), Classification::Fatal);
    }

    #[test]
    fn an_io_error_wrapping_a_client_error_counts_as_that_error_boxed_or_not() {
        let t = |class| Classification::Outcome(Outcome::Transport(class));
        // A middleware's timeout fitted into an `io::Error`, as an `io::Error::other` in a
        // `map_err` does.
        let wrapped = || std::io::Error::other(tower::timeout::error::Elapsed::new());
        assert_eq!(wrapped().classify(), t(ErrorClass::Timeout));
        let boxed: Box<dyn StdError + Send + Sync> = Box::new(wrapped());
        assert_eq!(boxed.classify(), t(ErrorClass::Timeout));
        // Under a wrapper of its own, the same.
        let deeper = std::io::Error::other(Wrapped(Box::new(wrapped())));
        assert_eq!(deeper.classify(), t(ErrorClass::Timeout));
        // Nothing known inside: still fatal.
        assert_eq!(
            std::io::Error::other("no such file").classify(),
            Classification::Fatal
        );
    }

    /// An error that wraps another, as middleware does.
    #[derive(Debug, thiserror::Error)]
    #[error("wrapped")]
    struct Wrapped(#[source] Box<dyn StdError + Send + Sync>);

    #[test]
    fn a_boxed_error_is_classified_by_the_first_known_error_in_its_chain() {
        let t = |class| Classification::Outcome(Outcome::Transport(class));
        let io = |k| Box::new(std::io::Error::from(k)) as Box<dyn StdError + Send + Sync>;
        let wrapped = Wrapped(Box::new(Wrapped(io(ErrorKind::TimedOut))));
        assert_eq!(classify_boxed(&wrapped), t(ErrorClass::Timeout));
        assert_eq!(
            classify_boxed(&*io(ErrorKind::ConnectionRefused)),
            t(ErrorClass::Connect)
        );
        // An I/O error of no transport class is passed over, as is an unknown error.
        let other = Wrapped(Box::new(Wrapped(io(ErrorKind::InvalidData))));
        assert_eq!(classify_boxed(&other), t(ErrorClass::Reset));
        let unknown = Wrapped(Box::<dyn StdError + Send + Sync>::from("no cause"));
        assert_eq!(classify_boxed(&unknown), t(ErrorClass::Reset));
    }

    #[tokio::test]
    async fn a_timeout_of_a_middleware_anywhere_in_the_chain_is_a_timeout() {
        let t = |class| Classification::Outcome(Outcome::Transport(class));
        let tokio_elapsed = tokio::time::timeout(Duration::ZERO, std::future::pending::<()>())
            .await
            .unwrap_err();
        let timeouts: [Box<dyn StdError + Send + Sync>; 2] = [
            Box::new(tower::timeout::error::Elapsed::new()),
            Box::new(tokio_elapsed),
        ];
        for e in timeouts {
            let name = e.to_string();
            assert_eq!(classify_boxed(&*e), t(ErrorClass::Timeout), "{name}");
            let wrapped = Wrapped(Box::new(Wrapped(e)));
            assert_eq!(classify_boxed(&wrapped), t(ErrorClass::Timeout), "{name}");
            // tonic keeps the error under the status it makes of it (UNKNOWN).
            let status = tonic::Status::from_error(Box::new(wrapped));
            assert_eq!(status.classify(), t(ErrorClass::Timeout), "{name}");
        }
        // tonic's own request timeout may be the caller's deadline: judged by its code, also
        // as the bare error the layer sees.
        let cancelled = Classification::Outcome(Outcome::Grpc {
            code: GrpcCode::Cancelled,
            pushback: None,
        });
        let bare = Wrapped(Box::new(tonic::TimeoutExpired(())));
        assert_eq!(classify_boxed(&bare), cancelled);
        let status = tonic::Status::from_error(Box::new(tonic::TimeoutExpired(())));
        assert_eq!(status.code(), tonic::Code::Cancelled);
        assert_eq!(
            status.classify(),
            Classification::Outcome(Outcome::Grpc {
                code: GrpcCode::Cancelled,
                pushback: None
            })
        );
        // A failed connect above it still says connect.
        let connect = tonic::ConnectError(Box::new(tower::timeout::error::Elapsed::new()));
        assert_eq!(classify_boxed(&connect), t(ErrorClass::Connect));
    }

    #[test]
    fn never_connected_kinds_on_an_established_connection_are_resets() {
        let e = Wrapped(Box::new(std::io::Error::from(ErrorKind::NotConnected)));
        assert_eq!(io_class_in_chain(&e), Some(ErrorClass::Connect));
        assert_eq!(connected_io_class(&e), Some(ErrorClass::Reset));
        let e = Wrapped(Box::new(std::io::Error::from(ErrorKind::TimedOut)));
        assert_eq!(connected_io_class(&e), Some(ErrorClass::Timeout));
        assert_eq!(connected_io_class(&Wrapped("x".into())), None);
    }

    #[test]
    fn class_names_are_the_status_the_code_name_or_the_transport_class() {
        let name = |o: Outcome| class_name(&o).to_string();
        assert_eq!(
            name(Outcome::Http {
                status: 503,
                retry_after: None
            }),
            "503"
        );
        assert_eq!(
            name(Outcome::Grpc {
                code: GrpcCode::Unavailable,
                pushback: None
            }),
            "UNAVAILABLE"
        );
        assert_eq!(name(Outcome::Transport(ErrorClass::Reset)), "reset");
    }
}
