//! The retryplane agent: the library a service embeds to make its outbound calls under retry
//! policies pushed by the control plane (SPEC §2–§4).
//!
//! - [`Agent`] holds the current policies in an `ArcSwap`. [`Agent::builder`] connects it to a
//!   control plane: [`AgentBuilder::connect`] does not wait for the control plane (it reads the
//!   cache file first, waiting at most 1 s for the disk, on the calling thread) and one
//!   background task owns the policy stream — it validates and swaps in every snapshot, ACKs or NACKs it, writes the cache
//!   file, reconnects with jittered exponential backoff and streams metrics back. HTTP/2
//!   keepalive pings ([`AgentBuilder::keepalive`]) find a control plane that vanished without
//!   closing the connection; the stream's own heartbeat (a `Keepalive` message each way every
//!   metrics interval, at most 10 s apart; see "Heartbeats" in `proto/retryplane/v1/agent.proto`)
//!   finds one that vanished behind an HTTP/2 proxy, which answers those pings itself.
//!   [`Agent::from_file`] and [`Agent::from_policies`] run on static policies. The task's
//!   timers run on tokio's clock: under a paused clock (`tokio::time::pause`) they fire as soon
//!   as the runtime is idle, a connected agent's included (it would report, time out and
//!   reconnect at once), so tests that pause time use static policies. Calls need tokio's timer
//!   too (per-try timeouts, pauses), so run them on a runtime built with `enable_time` (or
//!   `enable_all`, as `#[tokio::main]` does): on one without it, the first attempt that has to
//!   wait panics in tokio ("timers are disabled").
//! - [`Agent::endpoint`] gives a cheap [`Endpoint`] handle; [`Endpoint::call`] runs one logical
//!   call under SPEC §2: the policy is read once per call, each attempt gets
//!   `min(per_try_timeout, deadline left)`, failures are classified through [`Classify`], pauses
//!   honour `Retry-After` and gRPC pushback, and the endpoint's budget and circuit breaker are
//!   shared by every call. A failed call returns a [`CallError`] with the cause and the real last
//!   response or error. [`Endpoint::call_with_auth_refresh`] adds the once-only credential
//!   refresh on a 401 (or whatever answer you say wants one).
//! - [`layer::RetryLayer`] puts an endpoint's policy around a tower HTTP client, buffering
//!   request bodies (up to a limit) so that they can be sent again. Opt-in:
//!   [`with_auth_refresh`](layer::RetryLayer::with_auth_refresh) calls a
//!   [`RefreshCredentials`](layer::RefreshCredentials) hook at most once per call on a 401
//!   and sends the request again once with the new credentials;
//!   [`with_dedup`](layer::RetryLayer::with_dedup) lets identical in-flight reads (same
//!   method, URI, body and request headers, tracing headers and request ids aside) share one
//!   call and its response.
//! - Per-endpoint counters (SPEC §4) are plain atomics on the call path and leave as deltas in
//!   numbered `MetricsReport`s, each kept until the control plane acknowledges it and sent again
//!   on the next stream if the connection drops first, so none is lost or counted twice; counts
//!   made while disconnected wait (bounded: one set of counters per endpoint) for the next
//!   stream. Needs a control plane that acknowledges reports (this version or later). They
//!   count logical calls made: a request answered by de-duplication with a copy of another's
//!   response made none and is not counted (see [`layer`], "What the endpoint's counters see").
//!
//! The types a [`Classify`] implementation builds an [`Outcome`] from ([`ErrorClass`],
//! [`GrpcCode`], [`Pushback`], [`RetryAfterError`]) are re-exported here, and the policy crate
//! itself as [`policy`] (for [`policy::load`], which makes the [`PolicySet`] of
//! [`Agent::from_policies`]): no separate dependency on it is needed.
//!
//! Without a control plane and without a cache file the agent runs the [`fallback_policy`].
//! Nothing here logs header values, tokens or bodies. Each attempt is logged at debug; a call
//! that fails is logged once at warn, except calls an open circuit breaker refuses without an
//! attempt: one warn line per endpoint per second for those (with how many were refused since
//! the last line), the others at debug, so an open breaker does not flood the log. The stream
//! to the control plane: a stream that was up and is lost is logged at info each time; a
//! control plane that refuses the agent, once at warn until the reason changes; one that
//! cannot be reached, once at info until the reason changes and once at warn when that has
//! lasted a minute (each try after at debug); text from the peer escaped to one line.
//!
//! With the `reqwest` feature, `reqwest::Error` implements [`Classify`] too (connect, reset and
//! timeout errors, and `error_for_status` errors by their status). An endpoint given to
//! [`Agent::endpoint`] is kept while a handle on it is held. One no handle holds is let go at
//! the next report or push: its counters once their counts are reported, and the budget and
//! breaker of one the policies do not name once they are idle (used again, it starts afresh,
//! as an idle one would; a breaker left half-open, waiting for a call that never comes, counts
//! as idle once no call came for as long again as its window and open period). An agent with
//! no control plane reports nothing and lets go only at [`Agent::set_policies`], and one cut
//! off from its control plane not until it reports again: until then it keeps every name it
//! called. Names are meant to be the service's upstreams, not made per request:
//! each one in use has its own budget, breaker and counters, and the control plane keeps at
//! most 1,000 series per service.
//!
//! # In a service's `Cargo.toml`
//!
//! The crate is not on crates.io: depend on it by path (or by git) from the retryplane
//! repository, with the crates its API speaks in, at the versions it is built with:
//!
//! ```toml
//! [dependencies]
//! retryplane-agent = { path = "../retryplane/crates/retryplane-agent" }  # features = ["reqwest"] needs reqwest 0.13
//! tokio = { version = "1.50", features = ["rt-multi-thread", "macros", "time"] }
//! http = "1"                 # CallMeta and the layer's requests and responses
//! tower = "0.5"              # the layer: ServiceBuilder, ServiceExt
//! tonic = "0.14"             # gRPC: tonic::Status, a Channel under the layer
//! ```
//!
//! Only what a service uses is needed: `tokio` with its timer always (calls wait on it: see
//! the first point above), `tower` for the layer, `tonic` (0.14, as the agent's own) for gRPC.
//! The examples in these docs also use the HTTP client and body crates a service brings
//! itself: `hyper-util` (`client-legacy`, `http1`, `tokio`), `http-body-util` and `bytes` under
//! the layer, and `reqwest` (0.13) for the reqwest ones. The `reqwest` feature
//! makes `reqwest::Response` and `reqwest::Error` [`Classify`] for [`Endpoint::call`]; the
//! layer works over a reqwest client without it (see [`layer`], "Over a reqwest `Client`").

#![forbid(unsafe_code)]

mod agent;
mod cache;
mod call;
mod classify;
mod error;
mod judge;
pub mod layer;
mod meta;
mod metrics;
mod per_try;
mod ready;
mod snapshot;
mod stream;
#[cfg(test)]
mod test_logs;
mod url;

pub use agent::{Agent, AgentBuilder, DEFAULT_METRICS_INTERVAL, PolicyWatch};
pub use call::Endpoint;
pub use classify::{Classification, Classify};
pub use error::{AgentError, BoxedError, CallError, Cause, Last, Refusal, StreamError};
pub use meta::{AttemptInfo, CallMeta};
pub use metrics::CounterValues;
pub use snapshot::{PolicySnapshot, Source, fallback_policy};
pub use stream::reconnect::ReconnectBackoff;
pub use stream::token::MAX_TOKEN_FILE_BYTES;
// For the retryplane CLI, which reads and shows control-plane URLs as the agent does: not part
// of the agent's API, so kept off its documentation's front page.
#[doc(hidden)]
pub use url::{
    names_no_host, shown_url, shown_url_without_query, unused_url_parts, url_scheme, written_port,
};

pub use retryplane_policy::engine::{GiveUpCause, Outcome};
pub use retryplane_policy::{ErrorClass, PolicySet, RetryPolicy};
pub use tokio_util::sync::CancellationToken;

// What a `Classify` implementation builds an `Outcome` from, with `ErrorClass` above.
pub use retryplane_policy::codes::GrpcCode;
pub use retryplane_policy::retry_after::{Pushback, RetryAfterError};

/// The policy crate, for the rest of the policy model (the fields of [`RetryPolicy`], the
/// document and diagnostics of a policy file, the engine), at the version this agent uses: no
/// separate dependency to keep in step. [`policy::load`] parses a policy file into the
/// [`PolicySet`] that [`Agent::from_policies`] runs.
pub use retryplane_policy as policy;
/// Why a Hello would be refused ([`AgentError::InvalidHello`]): its `Display` names the field.
pub use retryplane_proto::BadHello;
