//! The future of one logical call made through [`super::Retry`].

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use super::BoxError;

type Inner<R> = Pin<Box<dyn Future<Output = Result<R, BoxError>> + Send>>;

/// The response of a logical call (every attempt and pause included).
#[must_use = "futures do nothing unless you `.await` or poll them"]
pub struct ResponseFuture<R> {
    inner: Inner<R>,
}

impl<R> ResponseFuture<R> {
    pub(crate) fn new(inner: Inner<R>) -> Self {
        Self { inner }
    }
}

impl<R> fmt::Debug for ResponseFuture<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl<R> Future for ResponseFuture<R> {
    type Output = Result<R, BoxError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}
