//! A tower [`Layer`](tower::Layer) that runs every request of an HTTP client
//! (`Service<http::Request<B>>`: hyper-util's client, tonic's HTTP stack, …) as one logical
//! call of an [`Endpoint`](crate::Endpoint) under SPEC §2.
//!
//! - The route comes from the request's method and path (never the query string); idempotency
//!   from the policy's method list and the presence of its idempotency key header (by name).
//! - The request body is buffered up to a limit ([`DEFAULT_BODY_LIMIT`], 64 KiB; see
//!   [`RetryLayer::with_body_limit`]) so that each attempt sends it again. A larger body is
//!   streamed as it comes, once: the call is made as not idempotent and without a key, so it
//!   is never retried (per-try timeout, breaker and metrics still apply).
//! - Responses are classified with the [`Classify`](crate::Classify) impl of `http::Response`
//!   (status, `Retry-After`); errors of the inner service by their source chain: the first
//!   `hyper_util::client::legacy::Error`, `hyper::Error` or `io::Error` in it is classified by
//!   its [`Classify`](crate::Classify) impl (connect / reset / timeout, or fatal for the
//!   caller's own errors); anything else counts as a reset: the outcome is unknown, so only
//!   idempotent or keyed requests are retried.
//! - A call that gives up with a response returns that response, with a [`GaveUp`] in its
//!   extensions; one that gives up with an error returns the error; one that never got an
//!   answer returns a [`RetryError`].
//!
//! ```no_run
//! # fn f<S>(agent: retryplane_agent::Agent, client: S) {
//! use retryplane_agent::layer::RetryLayer;
//! use tower::Layer as _;
//!
//! let client = RetryLayer::new(agent.endpoint("payments")).layer(client);
//! # }
//! ```

mod body;
mod future;
#[allow(clippy::module_inception)]
mod layer;

use crate::error::Cause;

pub use body::ReplayBody;
pub use future::ResponseFuture;
pub use layer::{Retry, RetryLayer};

/// The largest request body buffered for replay unless set otherwise: 64 KiB.
pub const DEFAULT_BODY_LIMIT: usize = 64 * 1024;

/// A type-erased error, as tower middleware returns.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// In the extensions of a response returned because the call gave up on it (a 503 after the
/// last attempt, a 404 at once): why, and after how many attempts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GaveUp {
    /// Why the call stopped.
    pub cause: Cause,
    /// Attempts made.
    pub attempts: u32,
}

/// A logical call that ended with neither a response nor an error of the inner service.
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
    /// No attempt ended: the circuit is open, or the call was cancelled.
    #[error("no answer: {cause}")]
    NoAnswer {
        /// Why the call stopped.
        cause: Cause,
    },
}
