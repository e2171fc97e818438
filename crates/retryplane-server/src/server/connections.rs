//! The connections of both gRPC listeners, so that a shutdown closes at once those with no
//! open stream.
//!
//! tonic's own graceful shutdown waits for every connection to end on its own: one that never
//! sent the HTTP/2 preface waits for it forever (hyper defers the shutdown until the handshake
//! is done), and one that never answers the shutdown's PING is kept open until the client
//! answers, so either holds the whole shutdown for its grace period. Each accepted socket is
//! therefore wrapped in a [`TrackedIo`], and [`CountStreams`] counts the requests open on it
//! (from the call until the response body is dropped). Once [`Connections::close_idle`] runs,
//! a connection with no open request reads end of stream, which ends it at once; one with open
//! requests (an agent stream being told to reconnect, an admin call) is served until its last
//! one ends, within the grace. Before the end of stream the connection gets one more turn, in
//! which HTTP/2 writes what it has queued (the last response's trailers, its GOAWAY); a peer
//! that does not read them does not hold the connection either.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tonic::transport::server::{Connected, TcpConnectInfo};

/// Every open connection of the gRPC listeners.
#[derive(Clone, Debug, Default)]
pub(crate) struct Connections {
    shared: Arc<Shared>,
}

#[derive(Debug, Default)]
struct Shared {
    /// Set once by [`Connections::close_idle`].
    closing: AtomicBool,
    next_id: AtomicU64,
    open: Mutex<HashMap<u64, Arc<Conn>>>,
}

impl Shared {
    fn open(&self) -> MutexGuard<'_, HashMap<u64, Arc<Conn>>> {
        // Plain data behind the lock: a panic elsewhere leaves nothing half-done.
        self.open.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// One connection's requests in flight, and the task to wake when it is to be closed.
struct Conn {
    shared: Arc<Shared>,
    requests: AtomicUsize,
    waker: Mutex<Option<Waker>>,
}

impl std::fmt::Debug for Conn {
    // Not `shared`, which lists every connection, this one included.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn")
            .field("requests", &self.requests.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl Conn {
    /// Whether the connection is to end: the server is shutting down and no request is open.
    fn idle_at_shutdown(&self) -> bool {
        self.shared.closing.load(Ordering::SeqCst) && self.requests.load(Ordering::SeqCst) == 0
    }

    /// Remembers the task to wake, then tells whether the connection is to end (looked at
    /// after the waker is set, so a shutdown or a request's end just before is not missed).
    fn park(&self, cx: &Context<'_>) -> bool {
        {
            let mut waker = self.waker.lock().unwrap_or_else(PoisonError::into_inner);
            if !waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                *waker = Some(cx.waker().clone());
            }
        }
        self.idle_at_shutdown()
    }

    fn wake(&self) {
        if let Some(waker) = self
            .waker
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            waker.wake();
        }
    }
}

impl Connections {
    /// Wraps an accepted socket so it is tracked until it is dropped.
    pub(crate) fn track(&self, io: TcpStream) -> TrackedIo {
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let conn = Arc::new(Conn {
            shared: self.shared.clone(),
            requests: AtomicUsize::new(0),
            waker: Mutex::new(None),
        });
        self.shared.open().insert(id, conn.clone());
        TrackedIo {
            io,
            conn,
            id,
            ending: false,
        }
    }

    /// Starts the shutdown: every connection with no open request ends now, and every other
    /// one when its last request ends.
    pub(crate) fn close_idle(&self) {
        self.shared.closing.store(true, Ordering::SeqCst);
        let open: Vec<Arc<Conn>> = self.shared.open().values().cloned().collect();
        for conn in open {
            conn.wake();
        }
    }

    /// Connections open now.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.shared.open().len()
    }
}

/// An accepted socket of a gRPC listener, tracked by [`Connections`].
#[derive(Debug)]
pub(crate) struct TrackedIo {
    io: TcpStream,
    conn: Arc<Conn>,
    id: u64,
    /// The connection was found idle at shutdown and had its last turn: reads end.
    ending: bool,
}

impl TrackedIo {
    /// The read of a connection to end: after one more turn (see the module docs), end of
    /// stream.
    fn end(&mut self, cx: &Context<'_>) -> Poll<io::Result<()>> {
        if self.ending {
            return Poll::Ready(Ok(()));
        }
        self.ending = true;
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

impl Drop for TrackedIo {
    fn drop(&mut self) {
        self.conn.shared.open().remove(&self.id);
    }
}

/// The connection info of a [`TrackedIo`]: tonic puts it in every request's extensions, where
/// [`CountStreams`] finds the connection (and puts the TCP addresses where tonic's
/// `Request::remote_addr` looks for them).
#[derive(Clone, Debug)]
pub(crate) struct TrackedInfo {
    tcp: TcpConnectInfo,
    conn: Arc<Conn>,
}

impl Connected for TrackedIo {
    type ConnectInfo = TrackedInfo;

    fn connect_info(&self) -> TrackedInfo {
        TrackedInfo {
            tcp: self.io.connect_info(),
            conn: self.conn.clone(),
        }
    }
}

/// A closed connection's writes fail rather than wait on a peer that does not read.
fn closed() -> io::Error {
    io::Error::new(
        io::ErrorKind::BrokenPipe,
        "connection closed by the shutdown",
    )
}

impl AsyncRead for TrackedIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.conn.idle_at_shutdown() {
            return this.end(cx);
        }
        match Pin::new(&mut this.io).poll_read(cx, buf) {
            Poll::Pending if this.conn.park(cx) => this.end(cx),
            other => other,
        }
    }
}

impl AsyncWrite for TrackedIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        match Pin::new(&mut this.io).poll_write(cx, buf) {
            Poll::Pending if this.conn.park(cx) => Poll::Ready(Err(closed())),
            other => other,
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        match Pin::new(&mut this.io).poll_write_vectored(cx, bufs) {
            Poll::Pending if this.conn.park(cx) => Poll::Ready(Err(closed())),
            other => other,
        }
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        match Pin::new(&mut this.io).poll_flush(cx) {
            Poll::Pending if this.conn.park(cx) => Poll::Ready(Err(closed())),
            other => other,
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        match Pin::new(&mut this.io).poll_shutdown(cx) {
            Poll::Pending if this.conn.park(cx) => Poll::Ready(Err(closed())),
            other => other,
        }
    }
}

/// Counts a connection's open requests (see the module docs); applied to both gRPC
/// listeners' services.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct CountStreamsLayer;

impl<S> tower::Layer<S> for CountStreamsLayer {
    type Service = CountStreams<S>;

    fn layer(&self, inner: S) -> CountStreams<S> {
        CountStreams { inner }
    }
}

/// The service of [`CountStreamsLayer`].
#[derive(Clone, Debug)]
pub(crate) struct CountStreams<S> {
    inner: S,
}

/// Holds one request open on its connection until dropped.
#[derive(Debug)]
struct RequestOpen(Arc<Conn>);

impl RequestOpen {
    fn new(conn: Arc<Conn>) -> Self {
        conn.requests.fetch_add(1, Ordering::SeqCst);
        Self(conn)
    }
}

impl Drop for RequestOpen {
    fn drop(&mut self) {
        let last = self.0.requests.fetch_sub(1, Ordering::SeqCst) == 1;
        if last && self.0.shared.closing.load(Ordering::SeqCst) {
            // A connection the shutdown waits on ends now.
            self.0.wake();
        }
    }
}

impl<S, B, ResBody> tower::Service<http::Request<B>> for CountStreams<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<ResBody>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<CountedBody<ResBody>>;
    type Error = S::Error;
    type Future =
        Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send + 'static>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
        let open = match request.extensions().get::<TrackedInfo>().cloned() {
            Some(info) => {
                // Where tonic's `Request::remote_addr` looks.
                request.extensions_mut().insert(info.tcp);
                Some(RequestOpen::new(info.conn))
            }
            None => None,
        };
        let response = self.inner.call(request);
        Box::pin(async move {
            let response = response.await?;
            Ok(response.map(|body| CountedBody { body, _open: open }))
        })
    }
}

/// A response body that keeps its request counted open until it is dropped.
#[derive(Debug)]
pub(crate) struct CountedBody<B> {
    body: B,
    _open: Option<RequestOpen>,
}

impl<B> http_body::Body for CountedBody<B>
where
    B: http_body::Body + Unpin,
{
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<B::Data>, B::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}
