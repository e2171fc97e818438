//! A tower [`Layer`](tower::Layer) that runs every request of an HTTP client
//! (`Service<http::Request<B>>`: hyper-util's client, tonic's HTTP stack, …) as one logical
//! call of an [`Endpoint`](crate::Endpoint) under SPEC §2.
//!
//! - The route comes from the request's method and path (never the query string); idempotency
//!   from the policy's method list and the presence of its idempotency key header (by name,
//!   with a value that is not empty: an empty key is no key).
//!   A gRPC request (`content-type: application/grpc…`) is a gRPC call of its path
//!   (`/pkg.Service/Method`, which gRPC routes match): not idempotent unless it carries the
//!   key header or an [`Idempotent`] extension, which also overrides the method list of an
//!   HTTP request.
//! - The request body is buffered up to a limit ([`DEFAULT_BODY_LIMIT`], 64 KiB; see
//!   [`RetryLayer::with_body_limit`]) so that each attempt sends it again. A larger body is
//!   streamed as it comes, once: the call makes one attempt, whatever it fails with (a failed
//!   connect included), and returns that attempt's response or error as it is (per-try
//!   timeout, breaker and metrics still apply).
//! - The caller's own deadline and cancellation come with the request: a [`Within`] extension
//!   (and a gRPC request's `grpc-timeout`; the earlier of the two) bounds the call as the
//!   policy's `deadline` does, whichever ends first, and a
//!   [`CancellationToken`](crate::CancellationToken) extension cancels it.
//! - The call's deadline runs from when the layer's future first runs, so reading the request
//!   body counts in it: a call made through the layer ends by its deadline, body read
//!   included, as one made with [`crate::Endpoint::call`] does. A body still coming at the
//!   deadline (a stalled upload) leaves no time for an attempt: nothing is sent, and the call
//!   gives up with `deadline_exceeded` ([`RetryError::NoAnswer`]). A body that fails while
//!   it is read (its stream's own error) ends the call with that error before any attempt:
//!   nothing sent and, the caller's request being at fault and not the upstream, no call
//!   counted. An open circuit fails the
//!   call fast (SPEC §2), body or not: the breaker is asked before the body is read and every
//!   100 ms while the read waits, and a call it would refuse gives up with `circuit_open` at
//!   once, nothing sent. The call's deadline ends its attempts and pauses: an attempt is
//!   over when its answer's head comes, and the answer's body (an HTTP body, a gRPC
//!   message or stream) is then the caller's, read as it comes (the layer cannot tell a
//!   unary gRPC answer from a stream, which may well outlast the policy's deadline). A gRPC
//!   request's own deadline (`grpc-timeout`, from tonic's `Request::set_timeout`) caps it:
//!   the call, its attempts and its pauses end by the earlier of the two, since tonic
//!   enforces that header below the layer on each attempt only, and until the answer's head
//!   only; the answer's body ends by it too (a gRPC deadline bounds the whole RPC): what had
//!   come when the deadline is seen passed is still given (16 MiB at most), so a reader
//!   slower than the upstream loses nothing it sent in time and a finished answer stays
//!   whole; the rest is let go, and the client reads `DEADLINE_EXCEEDED`. The call was counted at its answer's head (a success,
//!   if that head was one), and a request still being streamed goes on being sent by the
//!   client below, as without the layer, until the upstream ends the call at the
//!   `grpc-timeout` it was sent. So a unary gRPC call
//!   whose upstream sends its head and then stalls is bounded by the caller's deadline, or,
//!   without one, by wrapping the generated client's call in
//!   [`Endpoint::call`](crate::Endpoint::call) (the crate's tonic example), whose attempts
//!   end with the decoded message. Each attempt of such a request carries, in
//!   `grpc-timeout`, what is left of the caller's deadline when it is sent, so that a retry
//!   does not tell the upstream it has the caller's whole budget again; when tonic's timer for
//!   it ends an attempt at that deadline, the call ends as the agent's deadline
//!   (`DEADLINE_EXCEEDED`), not as tonic's `CANCELLED`. A request without `grpc-timeout` is
//!   sent without one (gRPC servers hold a whole RPC to it, a server stream included), and
//!   the attempt's own `per_try_timeout` is never sent: the agent enforces it, and retries an
//!   attempt that runs out of it.
//! - The endpoint's policy is read once, when the layer's future first runs (SPEC §2): the
//!   body read's deadline, whether the request is shared and how long it waits for another
//!   call ([`RetryLayer::with_dedup`]), and the call's attempts all go by that one read. A
//!   policy update that comes meanwhile (while the body is still coming, say) applies to
//!   later calls.
//! - The inner service is called on the instance `poll_ready` readied (capacity reserved
//!   there, such as a `ConcurrencyLimit` permit or a `Buffer` slot, is what the first attempt
//!   uses). Without de-duplication the wait for that first attempt's capacity is the caller's
//!   own `poll_ready`, which neither the call's deadline nor its breaker bounds (the call has
//!   not begun). Each later send (a retry, the resend after a credential refresh) readies the
//!   service again after its pause and before its attempt's timer starts: its wait for
//!   capacity below is the call's, bounded by the deadline, not its per-try timeout, as in
//!   tower, where `poll_ready` comes before a `Timeout` layer's `call`. An error getting ready
//!   then is that send's failure, classified as an error of the send would be (a service
//!   that reports a failed connect from `poll_ready` has it retried as a connect error). The
//!   wait is bounded by the deadline only, also when it is not for capacity: a service below
//!   whose `poll_ready` itself dials and hangs holds the retry until the deadline, where a
//!   send that hangs is cut by the per-try timeout. With de-duplication,
//!   `poll_ready` reserves nothing and is always ready (a request that will share another's
//!   answer needs no capacity, and one held back for capacity could not join the call it
//!   would share): a call that sends waits for capacity below inside its future, before its
//!   first attempt, the same way, and an error getting ready ends it at once, uncounted (as
//!   the same error from `poll_ready` would reach a caller without de-duplication). So with
//!   de-duplication back-pressure from below shows as that wait, not in `poll_ready` (a
//!   `LoadShed` above the layer does not see it).
//! - A send that would wait for capacity (the first with de-duplication, a retry, a resend)
//!   first asks the endpoint's breaker, and asks again every tenth of a second while it
//!   waits: when the breaker would refuse the attempt (open, or half-open with every probe
//!   out), the service below is not asked to get ready (it may dial the upstream the breaker
//!   cut off) and the call ends as the breaker's refusal (`circuit_open`; a retry's call with
//!   the answer before it). A resend after a credential refresh belongs to its attempt and
//!   keeps that attempt's permit (a half-open probe included): it is not sent only if the
//!   breaker is open now (it opened, or reopened, since the first send); the 401 then
//!   stands. Only capacity the inner service reserves in its own `poll_ready` is waited for
//!   this way: a `Buffer` over a `ConcurrencyLimit` is ready once the buffer takes the
//!   request, and the wait for the limit then happens in the buffer's worker, inside the
//!   attempt.
//! - Responses are classified with the [`Classify`](crate::Classify) impl of `http::Response`
//!   (status, `Retry-After`; for a gRPC response with `grpc-status` in its headers, a
//!   "Trailers-Only" error such as `UNAVAILABLE`, that code and `grpc-retry-pushback-ms`, as
//!   for a `tonic::Status`; a gRPC status in trailers, after data, is not seen: that call
//!   counts as a success). The answer to a gRPC request is read as tonic's client reads it,
//!   so that it counts as through [`Endpoint::call`](crate::Endpoint::call) with a generated
//!   client: a `grpc-status` in its head whatever its content type, a proxy's HTTP status
//!   (no `grpc-status`) as the code tonic maps it to (503 `UNAVAILABLE`, 500 `UNKNOWN`, …),
//!   judged by `retry_on.grpc_status`: whatever its body, though tonic reads an error page as
//!   `INTERNAL` (that a body is empty is known only once it is read); and for a 200 head with
//!   no `grpc-status`, the first frame of its body, looked at for up to 100 ms within the
//!   attempt (longer than the delayed ACK a server with Nagle on holds its trailers behind): trailers before any message (a server that sent its head and then an error,
//!   such as a tonic server stream whose first item is an error) are the call's code, counted
//!   and retried as it says; a message first, or none yet, is a success. Errors of the inner service by their source chain:
//!   the first `hyper_util::client::legacy::Error`, `hyper::Error`, (feature `reqwest`)
//!   `reqwest::Error` or `io::Error` in it is classified by its [`Classify`](crate::Classify)
//!   impl (connect / reset / timeout, or fatal for the caller's own errors; a reqwest error
//!   made by `error_for_status` counts as its HTTP status, without `Retry-After`); the error of a
//!   timeout middleware below the layer (tower's `TimeoutLayer`, `tokio::time::timeout`) is a
//!   timeout, and so is tonic's own request timeout of a channel's `Endpoint::timeout` (the
//!   caller's `grpc-timeout`, which tonic enforces with the same error, ends the call at the
//!   agent's own timer instead, as `DEADLINE_EXCEEDED`); for a gRPC request, a `tonic::Status`
//!   the inner service returns as its error counts as that status, its pushback read;
//!   anything else counts as a reset.
//! - Retried at one layer only: what a `RetryLayer` stacked below this one gave up on (an
//!   answer marked [`GaveUp`], a [`RetryError`] or a status holding one) is fatal here, not
//!   sent again whatever this layer's policy says of hints, and returned as the layer below
//!   marked it (its cause and attempts). Each layer counts the call: the one below its
//!   attempts, this one a call given up `not_retryable` after one attempt.
//!   Timeout and reset are unknown outcomes, so only idempotent or keyed requests are
//!   retried.
//! - The client's response body becomes a [`ResponseBody`]. An answer that failed (an HTTP
//!   status of 400 or more, or a gRPC error in the headers) and may be sent again has its body
//!   read into memory within its attempt, up to 64 KiB (and the frame that crosses it) and
//!   for up to 20 ms (and never into the attempt's last 20 ms, so that its timeout does not
//!   lose the answer): one the engine may
//!   retry, as far as the answer, the call and the policy decide
//!   ([`retryplane_policy::engine::RetryRules`]: `retry_on` lists its status or code, the call
//!   is idempotent or keyed, the attempt is not the last, and no `Retry-After` past
//!   `retry_after.max` or gRPC "do not retry" pushback forbids it); and, with a
//!   credential-refresh hook that has not run yet in the call, a 401 (whatever the method or
//!   attempt). A call keeps its last failure through the pause and the next attempt, and a
//!   body left unread there would hold its connection, so that an HTTP/1 client opened a new
//!   connection for every retry to an upstream that was already failing. A body not read
//!   whole then is read on while the call waits (the pause, the wait for room below, a
//!   credential refresh; up to the same 64 KiB), and what is still unread when the next
//!   attempt starts is let go, so that the kept answer holds neither the HTTP/1
//!   connection nor the HTTP/2 stream the retry may need. The caller gets the same bytes; a
//!   larger or slower body gives the part read, then the rest as it comes, or, if it was let
//!   go, then a [`LeftUnread`] error (only a call that ends before its next attempt answers,
//!   cancelled, returns such an answer). Any other answer is passed on as it comes. (The budget, the breaker and the deadline are
//!   asked only once the answer is judged: an answer they then keep from being sent again was
//!   read all the same.)
//! - A call that gives up with a response returns that response, with a [`GaveUp`] in its
//!   extensions; one that gives up with an error returns the error; one that never got an
//!   answer returns a [`RetryError`]. For a gRPC request, that [`RetryError`] comes as the
//!   source of a `tonic::Status` whose code says what happened (`DEADLINE_EXCEEDED` when the
//!   last attempt timed out or no time was left, `UNAVAILABLE` when the circuit is open), so
//!   a generated client returns that code to its caller rather than `UNKNOWN`.
//!
//! The client below the layer is sent the layer's [`ReplayBody`] of the caller's body type:
//! with hyper-util's client, build it for `ReplayBody<B>` (a client built for `B` itself does
//! not fit, and the compiler says only that `oneshot`'s bounds are not met).
//!
//! ```no_run
//! # async fn f(agent: retryplane_agent::Agent) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! use bytes::Bytes;
//! use http_body_util::Full;
//! use hyper_util::client::legacy::Client;
//! use hyper_util::rt::TokioExecutor;
//! use retryplane_agent::layer::{ReplayBody, RetryLayer};
//! use tower::{Layer as _, ServiceExt as _};
//!
//! let client = Client::builder(TokioExecutor::new()).build_http::<ReplayBody<Full<Bytes>>>();
//! let client = RetryLayer::new(agent.endpoint("payments")).layer(client);
//! let request = http::Request::get("http://127.0.0.1:8080/v1/prices")
//!     .body(Full::new(Bytes::new()))?;
//! let response = client.oneshot(request).await?;
//! # let _ = response;
//! # Ok(())
//! # }
//! ```
//!
//! # Over a reqwest `Client`
//!
//! A `reqwest::Client` is no tower service of `http::Request`s: a `service_fn` that converts
//! each way puts it under the layer. (reqwest's errors are judged by their source chain, as
//! any inner service's are: its hyper or I/O error below decides, or, with the `reqwest`
//! feature, the reqwest error itself.)
//!
//! ```no_run
//! # async fn f(agent: retryplane_agent::Agent) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! use bytes::Bytes;
//! use http_body_util::Full;
//! use retryplane_agent::layer::{BoxError, ReplayBody, RetryLayer};
//! use tower::{Layer as _, ServiceExt as _, service_fn};
//!
//! let http = reqwest::Client::new();
//! let send = service_fn(move |request: http::Request<ReplayBody<Full<Bytes>>>| {
//!     let http = http.clone();
//!     async move {
//!         let request = reqwest::Request::try_from(request.map(reqwest::Body::wrap))?;
//!         let response = http.execute(request).await?;
//!         Ok::<_, BoxError>(http::Response::<reqwest::Body>::from(response))
//!     }
//! });
//! let client = RetryLayer::new(agent.endpoint("payments")).layer(send);
//! let request = http::Request::get("http://127.0.0.1:8080/v1/prices")
//!     .body(Full::new(Bytes::new()))?;
//! let response = client.oneshot(request).await?;
//! # let _ = response;
//! # Ok(())
//! # }
//! ```
//!
//! # gRPC over a tonic `Channel`
//!
//! The inner service gets `http::Request<ReplayBody<B>>`; a tonic `Channel` takes
//! `http::Request<tonic::body::Body>`: put [`into_tonic_request`] between them with
//! `map_request` and hand the stack to a generated client (see its example). Calls that send
//! one request message (unary and server-streaming calls): the request body is read before
//! the first send, and the answer of a server stream comes as it is sent, for as long as it
//! lasts. Not client- or bidirectional-streaming calls on the same stack: their request
//! stream would be read, within the policy's deadline, before anything is sent (a stream
//! longer than the deadline fails with nothing sent, and its messages reach the server
//! together at its end); give those a channel without the layer. Declare idempotent calls
//! with [`Idempotent`] on the `tonic::Request`.
//!
//! # Credential refresh on 401 ([`RetryLayer::with_auth_refresh`])
//!
//! With a [`RefreshCredentials`] hook, the first attempt of a logical call (whichever attempt
//! that is) to be answered `401 Unauthorized` (or, for a gRPC request, `UNAUTHENTICATED` in the
//! answer's head: a gRPC server answers an expired token so, in an HTTP 200; what is said of a
//! 401 below is said of it too) is not judged yet: the hook updates the request (its
//! `Authorization` header, say) and that attempt is sent again, once, with the updated
//! request, which every later attempt of the call also uses. The hook runs at most once per
//! logical call.
//!
//! - Counting: the second send belongs to the same attempt. It gets a fresh per-try timeout
//!   (within the deadline), but takes no pause, no retry budget and none of `max_attempts`;
//!   the attempt number, the breaker and the counters see one attempt, judged on the second
//!   answer. So a call makes at most one send more than `max_attempts`.
//! - A second 401 is judged by the policy like any answer: with the default `retry_on` (which
//!   does not list 401; `validate` warns if it does) it is returned at once, marked
//!   [`GaveUp`] `not_retryable`. The hook is not called again.
//! - The hook runs within what is left of the deadline and stops with the call's
//!   cancellation. If it fails, the 401 stands and is returned with a [`RefreshFailed`]
//!   holding the hook's error (the agent never logs it); if the deadline passes first, the
//!   401 stands.
//! - A request whose body was over the body limit (streamed, not buffered) cannot be sent
//!   again: its 401 is returned and the hook is not called. Other statuses (403 included)
//!   never call the hook.
//!
//! # De-duplication of identical reads ([`RetryLayer::with_dedup`])
//!
//! Off by default. With a [`Dedup`], identical requests in flight at the same time share one
//! logical call: the first (the leader) runs it, retries included; the others (followers)
//! wait for it and get a copy of its response (status, headers, extensions, body bytes), marked
//! [`Deduplicated`]. [`Dedup::stats`] counts what happened.
//!
//! ```no_run
//! # fn f<S>(agent: retryplane_agent::Agent, client: S) {
//! use retryplane_agent::layer::{Dedup, RetryLayer};
//! use tower::Layer as _;
//!
//! // Every request header is part of the key except tracing headers and request ids; this
//! // service's own per-request header is left out too.
//! let dedup = Dedup::default().ignore_header(http::HeaderName::from_static("x-debug-id"));
//! let client = RetryLayer::new(agent.endpoint("catalog"))
//!     .with_dedup(dedup.clone())
//!     .layer(client);
//! // dedup.stats().shared: requests answered without a call of their own.
//! # }
//! ```
//!
//! - Shared: `GET` and `HEAD` ([`Dedup::share_method`] adds others) that are idempotent
//!   under the policy in force for their route (the method is in its `idempotent_methods`,
//!   or the request carries [`Idempotent`]`(true)`; an `Idempotent(false)` is never shared),
//!   whose body was buffered (within the body limit) and that carry no trailers. Everything
//!   else makes its own call.
//! - Same request: same endpoint, method, full URI (query included; compared as written, byte
//!   for byte: `http://UP/x`, `http://up:80/x` and `/%7Eu` each differ from `http://up/x` and
//!   `/~u`, which only costs sharing), body (compared by a
//!   SHA-256 digest) and the values of every request header except those that only identify or
//!   trace the request ([`DEFAULT_IGNORED_HEADERS`]: W3C trace context, B3, request ids, …).
//!   A header the layer does not know, such as `X-Api-Key` or a tenant header, is compared: a
//!   credential left out of the key would hand one caller an answer meant for another.
//!   [`Dedup::ignore_header`] leaves out a header that differs on every request and does not
//!   change the answer; [`Dedup::vary_only_on`] keys on a fixed list instead, and
//!   [`Dedup::vary_on_all_headers`] on every header, tracing ones included. `Authorization`,
//!   `Proxy-Authorization` and `Cookie` ([`CREDENTIAL_HEADERS`]) are in the key in every mode;
//!   so are `Range` and the conditional headers (`If-None-Match`, `If-Modified-Since`,
//!   `If-Match`, `If-Unmodified-Since`, `If-Range`), whose answer (a 206, a 304 with no body)
//!   is wrong for a request that did not ask for it; and so is `Host`: with the URI's
//!   authority it names the upstream (a request whose URI is
//!   a bare path names it there only), and two upstreams never share an answer.
//!   The table keeps only the digest, never a header value. Request extensions are not
//!   compared.
//! - Same client: requests are shared only among those sent through one layered service
//!   (one `layer` call) and its clones, whatever `Dedup` clone they use. What the services
//!   below the layer add to a request (a tenant's credential, the upstream of a bare path) is
//!   not in the key, so two stacks that differ there never share.
//! - The response is shared once its body is read into memory, up to
//!   [`Dedup::with_response_limit`] ([`DEFAULT_SHARED_RESPONSE_LIMIT`]) and no later than the
//!   leader's deadline (the policy's, from the start of its call). With a larger body, or one not all there by the deadline,
//!   nothing is shared: the leader's caller gets the response with the bytes read so far
//!   followed by the rest as it comes (with no further bound from the layer, as without
//!   de-duplication), and each follower makes its own call.
//! - A leader that ends with an error (no response), or whose response body fails while it
//!   is read, shares nothing: each follower makes its
//!   own call (under the same budget and breaker), so it gets an error of its own with its
//!   real type. A response the call gave up on (a 503 after the last attempt) is shared,
//!   but not one given up on for want of time (`deadline_exceeded`: the leader's deadline,
//!   not a follower's, left no room for a retry) nor a 401 whose credential refresh failed
//!   ([`RefreshFailed`]).
//! - An answer meant for one client is not shared: one that sets a cookie (`Set-Cookie`), or
//!   whose `Cache-Control` says `private` or `no-store` (what RFC 9111 keeps a shared cache
//!   from handing on). Each follower makes its own call, so an upstream that sets a cookie on
//!   every answer (a load balancer's stickiness cookie) gains nothing from de-duplication.
//! - A leader whose caller goes away (its future dropped) leaves: its followers start over,
//!   one of them leading.
//! - Bounds: the leader's call and the reading of its response body both end by the leader's
//!   deadline, so the leader's caller gets the response head by then and followers get a copy
//!   or are sent to their own calls by then. Each follower also waits no later than its own
//!   deadline (counted from when its call began), in case the leader's future is not polled
//!   (its caller holds it without awaiting it) or a policy update gave the leader a longer
//!   deadline; then it gives up with `deadline_exceeded`, making no attempt (its call has no
//!   time left). A follower sent to its own call earlier runs it under what is left of that
//!   same deadline. So a follower's caller waits at most its deadline in all.
//! - The table holds a call only while it is in flight: the leader removes it when it ends
//!   or is dropped. Its lock is held only to look up, insert or remove.
//!
//! Followers' own calls (after an error or an oversized body) are not shared again.
//!
//! ## What the endpoint's counters see
//!
//! The endpoint's counters (SPEC §4: `calls`, `attempts`, the successes and give-ups, what the
//! agent reports to the control plane) count logical calls the agent made. A follower
//! answered with a copy of its leader's response made no call: it is **not counted** there,
//! neither as a call nor as a success, whatever the shared response was (a 200, or a 503
//! the leader gave up on). Only the leader's call is counted, once. So with de-duplication on,
//! `calls` is the number of logical calls made (the leaders'), not of requests, and the retry
//! ratio (retries / calls) is theirs. A logical call counts even when it sent nothing (an open
//! breaker refused it, or its request body was not read by the deadline): `attempts` counts
//! what was handed to the service below to send (a request that client refused to send, a
//! relative URI say, counts one). Count the answered followers with
//! [`DedupStats::shared`] (from [`Dedup::stats`]). A follower that makes its own call (after
//! a leader's error, an oversized body, or its wait's deadline) is counted as any call.

mod auth;
mod body;
mod dedup;
mod future;
mod grpc;
#[allow(clippy::module_inception)]
mod layer;

use crate::error::Cause;

/// Locks `m`, taking the value as it is if a holder panicked: the layer's mutexes (a call's
/// request head and inner service, the in-flight reads of a `Dedup`) hold plain state that is
/// never left half-written, and none is held across an await.
fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

pub use auth::{RefreshCredentials, RefreshFailed};
pub use body::{LeftUnread, ReplayBody, ResponseBody};

/// The response body of a client with de-duplication on, under its earlier name: it is the
/// [`ResponseBody`] every client the layer wraps now returns.
#[deprecated(note = "renamed `ResponseBody`: every client the layer wraps returns it")]
pub type SharedBody<B> = ResponseBody<B>;
pub use dedup::{
    CREDENTIAL_HEADERS, DEFAULT_IGNORED_HEADERS, DEFAULT_SHARED_RESPONSE_LIMIT, Dedup, DedupStats,
    Deduplicated,
};
pub use future::ResponseFuture;
pub use grpc::{Idempotent, Within, into_tonic_request};
pub use layer::{NoDedup, Retry, RetryLayer};

/// The largest request body buffered for replay unless set otherwise: 64 KiB.
pub const DEFAULT_BODY_LIMIT: usize = 64 * 1024;

/// A type-erased error, as tower middleware returns.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// In the extensions of a response returned because the call gave up on it (a 503 after the
/// last attempt, a 404 at once): why, and after how many attempts.
///
/// A gRPC client never sees a response's extensions (tonic drops them), so the answer to a
/// gRPC request also carries both in its head, which tonic makes the status's metadata for an
/// error answered before any message: `retryplane-gave-up` (the cause, as SPEC §5 names it:
/// `attempts_exhausted`, `not_retryable`, …) and `retryplane-attempts`. Such an answer (a
/// status before any message) also carries `grpc-retry-pushback-ms: -1` in place of the
/// upstream's (gRPC's "do not retry"): a service that hands the status on to its own caller
/// does not invite it to retry what was retried already. (A status sent in trailers, after a
/// message, keeps the upstream's.) A `RetryLayer` stacked above this one reads the extension
/// and does not send the request again; an [`Endpoint::call`](crate::Endpoint::call) whose
/// attempts go through a layer judges the answer by its status, as any answer, so give such a
/// call `max_attempts: 1`, or the layer alone the retries.
///
/// ```
/// # let status = tonic::Status::unavailable("down");
/// let why = status.metadata().get("retryplane-gave-up").and_then(|v| v.to_str().ok());
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GaveUp {
    /// Why the call stopped.
    pub cause: Cause,
    /// Attempts made.
    pub attempts: u32,
}

/// A logical call that ended with neither a response nor an error of the inner service.
///
/// For a gRPC request the layer returns it inside a `tonic::Status` (as its source): the
/// status's code is `DEADLINE_EXCEEDED` for [`RetryError::TimedOut`] and for a call with no
/// time left, `UNAVAILABLE` for an open circuit, `CANCELLED` for a cancelled call; reach it
/// with `status.source()` and `downcast_ref::<RetryError>()`. The status carries the metadata
/// of an answer the call gave up on ([`GaveUp`]): `retryplane-gave-up`, `retryplane-attempts`
/// and, but for a cancelled call, `grpc-retry-pushback-ms: -1`. A `RetryLayer` stacked above
/// this one, or an [`Endpoint::call`](crate::Endpoint::call) through it, does not send again
/// a request that ended in this error, nor in a status that holds it.
#[derive(Debug, thiserror::Error)]
pub enum RetryError {
    /// The last attempt ran out of time.
    #[error("the last of {attempts} attempt(s) timed out ({cause})")]
    TimedOut {
        /// Why the call stopped.
        cause: Cause,
        /// Attempts made.
        attempts: u32,
    },
    /// No attempt ended: the circuit is open, the call was cancelled, or its deadline passed
    /// before an attempt could start (a request body still coming).
    #[error("no answer: {cause}")]
    NoAnswer {
        /// Why the call stopped.
        cause: Cause,
    },
}
