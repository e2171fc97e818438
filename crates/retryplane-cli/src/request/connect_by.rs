//! Each connect of `retryplane request`'s HTTP client bounded by the attempt it is made for.
//!
//! A connect that never completes (a host that drops the SYN) must fail as a connect error,
//! which it is, before the attempt's own limit cuts it as a timeout (an unknown outcome, which
//! a POST does not retry). An attempt's limit is the smaller of `per_try_timeout` and what is
//! left of the deadline, so it changes from one attempt to the next; reqwest's
//! `connect_timeout` is one duration for the client's life. So the client's connector goes
//! through [`ConnectBy`], which the call sets, for each attempt, to the instant its connect
//! must give up by.

use std::pin::Pin;
use std::sync::{Arc, Mutex};

use tokio::time::Instant;

/// The error that tower services of reqwest's connector return.
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// When the connects of the attempt under way give up (none before the first is set).
#[derive(Clone, Debug, Default)]
pub(crate) struct ConnectBy(Arc<Mutex<Option<Instant>>>);

impl ConnectBy {
    /// Connects started from now on give up at `by`.
    pub(crate) fn set(&self, by: Instant) {
        *self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(by);
    }

    fn get(&self) -> Option<Instant> {
        *self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The connect did not complete by the instant its attempt set.
#[derive(Debug)]
pub(crate) struct ConnectGaveUp;

impl std::fmt::Display for ConnectGaveUp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the connect did not complete within the attempt's time limit")
    }
}

impl std::error::Error for ConnectGaveUp {}

impl<S> tower::Layer<S> for ConnectBy {
    type Service = Bounded<S>;

    fn layer(&self, inner: S) -> Bounded<S> {
        Bounded {
            inner,
            by: self.clone(),
        }
    }
}

/// A connector whose connects give up at the instant [`ConnectBy`] holds when they start.
#[derive(Clone, Debug)]
pub(crate) struct Bounded<S> {
    inner: S,
    by: ConnectBy,
}

impl<S, R> tower::Service<R> for Bounded<S>
where
    S: tower::Service<R, Error = BoxError>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, BoxError>> + Send>>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: R) -> Self::Future {
        let by = self.by.get();
        let connect = self.inner.call(request);
        Box::pin(async move {
            match by {
                None => connect.await,
                Some(by) => tokio::time::timeout_at(by, connect)
                    .await
                    .unwrap_or_else(|_| Err(Box::new(ConnectGaveUp))),
            }
        })
    }
}
