//! The once-only credential refresh on a 401 ([`RefreshCredentials`]).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use http::request::Parts;
use http::{HeaderMap, Response, StatusCode};

use super::body::ResponseBody;
use super::layer::grpc_status_carrier;
use super::{BoxError, lock};
use crate::call::Reauth;

/// Fresh credentials for a request an upstream answered `401 Unauthorized` (or, for a gRPC
/// request, `UNAUTHENTICATED`).
///
/// Set with [`RetryLayer::with_auth_refresh`](super::RetryLayer::with_auth_refresh). The
/// layer calls [`refresh`](Self::refresh) at most once per logical call, on the first 401,
/// and then sends the request again once; see the [module docs](super) for how that counts.
/// Calls made through an endpoint handle have the same hook in
/// [`Endpoint::call_with_auth_refresh`](crate::Endpoint::call_with_auth_refresh).
///
/// Once per call, not once per expired credential: when a token expires under load, every
/// call in flight that gets its 401 runs the hook, at the same time. A hook that fetches a
/// token from a service should share one fetch among them (a `tokio::sync::Mutex` around a
/// cached token, fetched again only when the token it holds is the one that was refused), or
/// the token service gets one request per call in flight. A hook that panics panics its
/// caller.
///
/// ```
/// use http::header::{AUTHORIZATION, HeaderValue};
/// use http::request::Parts;
/// use retryplane_agent::layer::{BoxError, RefreshCredentials};
///
/// struct Tokens;
///
/// impl RefreshCredentials for Tokens {
///     async fn refresh(&self, parts: &mut Parts) -> Result<(), BoxError> {
///         let token = "fetched from the token service"; // an await in real code
///         let mut value = HeaderValue::from_str(&format!("Bearer {token}"))?;
///         // Kept out of `Debug` output (and HPACK's table over HTTP/2), as a secret should be.
///         value.set_sensitive(true);
///         parts.headers.insert(AUTHORIZATION, value);
///         Ok(())
///     }
/// }
/// ```
pub trait RefreshCredentials: Send + Sync + 'static {
    /// Updates the credentials of the request about to be sent again (usually its
    /// `Authorization` header; any part may change). An error leaves the request as it was:
    /// the 401 is returned with a [`RefreshFailed`] holding the error.
    fn refresh(&self, parts: &mut Parts) -> impl Future<Output = Result<(), BoxError>> + Send;
}

/// In the extensions of a 401 returned because the refresh hook failed: its error (never
/// logged by the agent).
#[derive(Clone, Debug)]
pub struct RefreshFailed(pub Arc<dyn std::error::Error + Send + Sync>);

type RefreshFuture<'a> = Pin<Box<dyn Future<Output = Result<(), BoxError>> + Send + 'a>>;

/// [`RefreshCredentials`] behind a pointer.
pub(crate) trait DynRefresh: Send + Sync {
    fn refresh_dyn<'a>(&'a self, parts: &'a mut Parts) -> RefreshFuture<'a>;
}

impl<T: RefreshCredentials> DynRefresh for T {
    fn refresh_dyn<'a>(&'a self, parts: &'a mut Parts) -> RefreshFuture<'a> {
        Box::pin(self.refresh(parts))
    }
}

/// The refresh of one HTTP call: on its first 401 (or gRPC `UNAUTHENTICATED`, see
/// [`wants_credentials`]), the hook updates the shared head.
pub(crate) struct HttpReauth<'a> {
    hook: &'a dyn DynRefresh,
    head: &'a Mutex<Parts>,
    /// Whether the hook has run for this call (shared with the attempts, which then no longer
    /// read a 401's body for a resend that will not come).
    used: &'a AtomicBool,
    /// The hook's error, if it failed.
    pub(crate) error: Option<BoxError>,
    /// The call is a gRPC one ([`wants_credentials`]).
    grpc: bool,
}

impl<'a> HttpReauth<'a> {
    pub(crate) fn new(
        hook: &'a dyn DynRefresh,
        head: &'a Mutex<Parts>,
        used: &'a AtomicBool,
        grpc: bool,
    ) -> Self {
        Self {
            hook,
            head,
            used,
            error: None,
            grpc,
        }
    }
}

/// Whether an answer asks for fresh credentials: `401 Unauthorized`, or, to a gRPC request
/// (`grpc`), `UNAUTHENTICATED` (16) in its head, which is how a gRPC server answers an expired
/// token (HTTP 200, "Trailers-Only").
pub(crate) fn wants_credentials(status: StatusCode, headers: &HeaderMap, grpc: bool) -> bool {
    status == StatusCode::UNAUTHORIZED
        || (grpc
            && headers
                .get("grpc-status")
                .is_some_and(|c| c.as_bytes() == b"16"))
}

impl<RB> Reauth<Response<ResponseBody<RB>>, BoxError> for HttpReauth<'_> {
    fn wants(&self, result: &Result<Response<ResponseBody<RB>>, BoxError>) -> bool {
        // A gRPC status in trailers right after the head counts as in the head.
        !self.used.load(Ordering::Relaxed)
            && matches!(result, Ok(r) if wants_credentials(r.status(), grpc_status_carrier(r), self.grpc))
    }

    fn refresh(&mut self) -> Pin<Box<dyn Future<Output = bool> + Send + '_>> {
        self.used.store(true, Ordering::Relaxed);
        Box::pin(async move {
            // The hook works on a copy: one dropped half-way (the deadline passed) changes
            // nothing.
            let mut parts = lock(self.head).clone();
            match self.hook.refresh_dyn(&mut parts).await {
                Ok(()) => {
                    *lock(self.head) = parts;
                    true
                }
                Err(e) => {
                    self.error = Some(e);
                    false
                }
            }
        })
    }
}
