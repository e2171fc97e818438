//! gRPC connections that carry no stream for a while are closed.
//!
//! hyper has no idle close for HTTP/2 servers, and keepalive PINGs do not help: a peer that
//! opens a connection, sends the preface and answers every PING, but opens no stream, kept its
//! socket for good (a few thousand of them used up the process's file descriptors). So each
//! connection of the gRPC listeners counts its open streams ([`Streams`]: [`CountStreams`]
//! takes a count for each request and gives it back when the response's body is dropped, that
//! is when the stream has ended or was reset), and the connection's reader
//! ([`crate::preface::Preface`]) reads as closed by the peer once no stream has been open for
//! [`crate::server::ServeConfig::connection_idle_timeout`] while it waits to read. An agent's
//! connection always carries its stream, and an admin client's its calls; only a connection
//! left without any is closed, which its client reopens for its next call. (tonic's
//! `max_connection_age` closes every connection at an age instead, with a GOAWAY that tonic's
//! and hyper's clients race with their next call on the same channel: spurious `CANCELLED`
//! errors for a client that keeps its channel.)
//!
//! The count comes to the layer through the connection's `ConnectInfo` ([`Conn`]), the one
//! thing tonic hands from a connection to its requests. The layer also puts the TCP
//! connection's own info in each request, so `Request::remote_addr` works as before.

use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::Instant;
use tonic::transport::server::TcpConnectInfo;

/// The open streams of one connection, and since when none has been open.
#[derive(Debug)]
pub(crate) struct Streams {
    open: AtomicUsize,
    /// When the last stream ended (the connection's accept before any).
    quiet_since: Mutex<Instant>,
}

impl Streams {
    /// No stream yet, quiet since `now`.
    pub(crate) fn new(now: Instant) -> Self {
        Self {
            open: AtomicUsize::new(0),
            quiet_since: Mutex::new(now),
        }
    }

    /// Counts a stream open until the guard is dropped.
    pub(crate) fn opened(self: &Arc<Self>) -> StreamGuard {
        self.open.fetch_add(1, Ordering::SeqCst);
        StreamGuard(self.clone())
    }

    /// How long no stream has been open at `now`; `None` while one is.
    pub(crate) fn quiet_for(&self, now: Instant) -> Option<Duration> {
        if self.open.load(Ordering::SeqCst) > 0 {
            return None;
        }
        let since = *self.quiet_since.lock().unwrap_or_else(|e| e.into_inner());
        // A stream that opened and ended between the two reads moved `since` on: still quiet,
        // for less time.
        Some(now.saturating_duration_since(since))
    }
}

/// One open stream of a connection ([`Streams::opened`]).
#[derive(Debug)]
pub(crate) struct StreamGuard(Arc<Streams>);

impl Drop for StreamGuard {
    fn drop(&mut self) {
        // The time first: a reader that sees no stream open sees the latest end.
        *self.0.quiet_since.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
        self.0.open.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A gRPC connection's `ConnectInfo`: its TCP info and its [`Streams`].
#[derive(Clone, Debug)]
pub(crate) struct Conn<T> {
    pub(crate) inner: T,
    pub(crate) streams: Arc<Streams>,
}

/// The layer of [`CountStreams`].
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct CountStreamsLayer;

impl<S> tower::Layer<S> for CountStreamsLayer {
    type Service = CountStreams<S>;

    fn layer(&self, inner: S) -> Self::Service {
        CountStreams { inner }
    }
}

/// Counts each request in its connection's [`Streams`] until its response body is dropped.
#[derive(Clone, Debug)]
pub(crate) struct CountStreams<S> {
    inner: S,
}

impl<S, B, R> tower::Service<http::Request<B>> for CountStreams<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<R>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<Counted<R>>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
        let conn = request
            .extensions()
            .get::<Conn<TcpConnectInfo>>()
            .map(|c| (c.inner.clone(), c.streams.opened()));
        let guard = conn.map(|(tcp, guard)| {
            request.extensions_mut().insert(tcp);
            guard
        });
        let future = self.inner.call(request);
        Box::pin(async move {
            let response = future.await?;
            Ok(response.map(|body| Counted {
                inner: body,
                _guard: guard,
            }))
        })
    }
}

/// A response body that holds its stream's count.
#[derive(Debug)]
pub(crate) struct Counted<B> {
    inner: B,
    _guard: Option<StreamGuard>,
}

impl<B: http_body::Body + Unpin> http_body::Body for Counted<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_connection_is_quiet_from_its_accept_and_from_its_last_streams_end() {
        let streams = Arc::new(Streams::new(Instant::now()));
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert_eq!(
            streams.quiet_for(Instant::now()),
            Some(Duration::from_secs(3))
        );
        let a = streams.opened();
        let b = streams.opened();
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(streams.quiet_for(Instant::now()), None);
        drop(a);
        assert_eq!(streams.quiet_for(Instant::now()), None, "one still open");
        tokio::time::sleep(Duration::from_secs(1)).await;
        drop(b);
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(
            streams.quiet_for(Instant::now()),
            Some(Duration::from_secs(2))
        );
    }
}
