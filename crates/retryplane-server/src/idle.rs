//! The HTTP listener's connections are closed once idle.
//!
//! `axum::serve` gives no way to set hyper's header-read timeout (it needs a timer the server
//! builder is not given), so a client that connects and sends nothing, or half a request's
//! head, held its socket for good: a few thousand of them used up the process's file
//! descriptors, and the agent and admin listeners could then accept nobody. [`IdleClosing`]
//! wraps the listener: each connection reads as closed by its peer once nothing has gone
//! either way on it for [`IDLE`] while the server waits to read. A scraper that keeps its
//! connection between scrapes (every 15 s to a minute) keeps it; a longer pause costs it a
//! reconnect.
//!
//! More bounds, since a byte every minute kept the idle timer from firing (slowloris): a new
//! connection that sends nothing for [`FIRST_BYTE`] reads as closed, and a
//! connection also reads as closed once bytes it sent have had no answer for [`UNANSWERED`]
//! (a request's head that is never finished; the listener serves small GETs, answered in well
//! under a second), and the listener holds at most [`MAX_CONNECTIONS`] at once: past them it
//! accepts the next connection all the same (one descriptor past the cap) and makes room for it
//! by closing the oldest connection with no request in flight (counted from the router's
//! taking it to its answer's body let go, [`count_in_flight`]), no write waiting for room, and
//! no byte moved for [`EVICTABLE_AFTER`] (a kept-alive scraper's between scrapes, or one that
//! sent nothing yet); with none such, the connection taken waits in the process for one to
//! close or become so, trying each second (the ones after it wait in the kernel's queue,
//! holding no descriptor of the process). Bytes alone are not the signal: an answer whose body
//! hyper has taken is still being written, and a pipelined request may be served with no byte
//! moving. Without that, a client that sent one request on each
//! of 256 connections and kept them open held every place for the idle time, and health probes
//! waited. And a write its client leaves unread for [`WRITE_STALL`] fails,
//! closing the connection: the answer it held (a `/metrics` page) is let go.
//!
//! The listener speaks HTTP/1.1 only ([`http1_only`]): axum's `serve` also serves HTTP/2 to a
//! client that opens with its preface (hyper-util's `http2` feature is on, through tonic), and an
//! HTTP/2 answer's body waits on the client's flow-control window with no socket write pending,
//! so a client that gave a window of 0 kept its request in flight: a full listener could never
//! close it for room, and it held its place until the timers above fired (30 to 90 s), or for
//! good with a PING a minute (each answered, so neither timer fires). An HTTP/2 request is
//! answered at once with no body: a gRPC call with `UNIMPLEMENTED` (what a gRPC server without
//! the service answers; the CLI's and the agent's hints name this listener from it), anything
//! else with `505`. (A client that keeps a connection busy, over either version, with a request
//! or a PING more often than every [`EVICTABLE_AFTER`], keeps its place as any busy client does.)

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use std::sync::Arc;
use std::sync::atomic::Ordering;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};

/// How long a connection of the HTTP listener may stay silent.
pub(crate) const IDLE: Duration = Duration::from_secs(90);

/// How long bytes a client sent may go without an answer before its connection reads as
/// closed: a request's head sent a byte at a time, or never finished.
pub(crate) const UNANSWERED: Duration = Duration::from_secs(30);

/// How long a new connection may stay silent before it reads as closed: one that sends
/// nothing held one of [`MAX_CONNECTIONS`] places for the whole idle time, so a few hundred of
/// them kept health probes out.
pub(crate) const FIRST_BYTE: Duration = Duration::from_secs(10);

/// How long a write may wait for its client to read before the connection is closed: a client
/// that asks for `/metrics` and never reads held a rendered copy (megabytes with thousands of
/// series) until the idle close.
pub(crate) const WRITE_STALL: Duration = Duration::from_secs(10);

/// The most connections the HTTP listener holds at once (scrapers and health probes: a few).
pub(crate) const MAX_CONNECTIONS: usize = 256;

/// How long a connection that waits for its next request must have moved no byte before a full
/// listener may close it to make room: an answer being written moves bytes (a write its client
/// does not read fails after [`WRITE_STALL`] anyway).
pub(crate) const EVICTABLE_AFTER: Duration = Duration::from_secs(1);

/// What a connection of the HTTP listener shows the listener: whether it may be closed to make
/// room, and the signal that closes it.
#[derive(Debug)]
pub(crate) struct Shown {
    /// When a byte last moved either way (the accept before any), in milliseconds since
    /// `epoch`.
    last_io_ms: std::sync::atomic::AtomicU64,
    /// Requests in flight, a write that waits for room, and whether it was closed for room:
    /// one lock, so that a request that begins and an eviction cannot both go ahead.
    state: std::sync::Mutex<ShownState>,
    /// The connection's task while a read or write waits, woken by an eviction.
    task: crate::places::WakerSlot,
    epoch: Instant,
}

#[derive(Debug, Default)]
struct ShownState {
    /// Requests handed to the router whose answers are not yet fully written (their bodies
    /// not yet dropped): counted by [`count_in_flight`].
    in_flight: usize,
    /// A write found no room and has not gone through since.
    writing: bool,
    /// Closed to make room: reads end, writes fail.
    evicted: bool,
}

impl Shown {
    fn new(epoch: Instant) -> Self {
        let shown = Self {
            last_io_ms: std::sync::atomic::AtomicU64::new(0),
            state: std::sync::Mutex::default(),
            task: crate::places::WakerSlot::default(),
            epoch,
        };
        shown.moved();
        shown
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ShownState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn moved(&self) {
        let ms = u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_io_ms.store(ms, Ordering::SeqCst);
    }

    fn set_writing(&self, writing: bool) {
        self.lock().writing = writing;
    }

    /// Closes the connection if it may be closed now: no request in flight, no write waiting,
    /// not closed yet, and no byte moved for [`EVICTABLE_AFTER`] (a request's head still
    /// coming moves bytes; one that trickles slower than that is fair game). Whether it was.
    fn evict_if_idle(&self, now: Instant) -> bool {
        self.evict_if_quiet_for(EVICTABLE_AFTER, now)
    }

    /// [`Shown::evict_if_idle`] with `quiet` for the time no byte may have moved (none at
    /// shutdown, when a connection between requests is closed however lately it moved).
    fn evict_if_quiet_for(&self, quiet: Duration, now: Instant) -> bool {
        let now_ms = u64::try_from(now.saturating_duration_since(self.epoch).as_millis())
            .unwrap_or(u64::MAX);
        let mut state = self.lock();
        let quiet_ms = now_ms.saturating_sub(self.last_io_ms.load(Ordering::SeqCst));
        if state.in_flight > 0
            || state.writing
            || state.evicted
            || u128::from(quiet_ms) < quiet.as_millis()
        {
            return false;
        }
        state.evicted = true;
        drop(state);
        self.task.wake();
        true
    }

    fn is_evicted(&self) -> bool {
        self.lock().evicted
    }

    /// Wakes `task` when evicted; whether it was already.
    fn wake_on_eviction(&self, task: &std::task::Waker) -> bool {
        self.task.register(task);
        self.is_evicted()
    }

    /// A request begins: counted in flight until the guard is dropped; `None` if the
    /// connection was closed for room already (the request is then not served).
    fn begin(self: &Arc<Self>) -> Option<InFlight> {
        let mut state = self.lock();
        if state.evicted {
            return None;
        }
        state.in_flight += 1;
        Some(InFlight(self.clone()))
    }
}

/// One request of a connection in flight ([`Shown::begin`]).
struct InFlight(Arc<Shown>);

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut state = self.0.lock();
        state.in_flight = state.in_flight.saturating_sub(1);
        drop(state);
        // Its answer's end is movement too: quiet counts from it.
        self.0.moved();
    }
}

/// Serves `app` on `listener` until `stop`, with the listener's own wiring: HTTP/1.1 only
/// ([`http1_only`]), and each request counted in flight on its connection ([`count_in_flight`]).
/// Once `stop` resolves, no connection is accepted, those between requests are closed (one
/// that had sent half a request's head held the shutdown for its whole grace), and the others
/// end after their answers.
pub(crate) async fn serve(
    listener: IdleClosing,
    app: axum::Router,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let app = app
        .layer(axum::middleware::from_fn(count_in_flight))
        .layer(axum::middleware::from_fn(http1_only));
    let open = listener.shown.clone();
    let stop = async move {
        stop.await;
        open.close_between_requests();
    };
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<HttpConn>(),
    )
    .with_graceful_shutdown(stop)
    .await
}

/// What a gRPC call to the HTTP listener is answered, with `UNIMPLEMENTED`: printable ASCII
/// with no `%`, so that it is its own `grpc-message` with no percent-encoding.
pub(crate) const NOT_GRPC: &str = "this is the HTTP listener of `retryplane serve` (/healthz, \
     /readyz and /metrics, over HTTP/1.1): it serves no gRPC";

/// Answers a request that came over HTTP/2 at once, with no body (a body would wait on the
/// client's flow-control window; see the module docs): a gRPC call (a POST with `content-type:
/// application/grpc…`) with gRPC's `UNIMPLEMENTED` and [`NOT_GRPC`], in the headers alone as
/// a gRPC server answers a call it does not serve, anything else with `505 HTTP Version Not
/// Supported`. HTTP/1 requests go on to the routes.
pub(crate) async fn http1_only(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::http::{HeaderValue, StatusCode, Version, header};
    use axum::response::IntoResponse as _;
    if matches!(
        request.version(),
        Version::HTTP_09 | Version::HTTP_10 | Version::HTTP_11
    ) {
        return next.run(request).await;
    }
    // gRPC's calls are POSTs; a media type's name is case-insensitive.
    let grpc = request.method() == axum::http::Method::POST
        && request
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| {
                v.get(..16)
                    .is_some_and(|t| t.eq_ignore_ascii_case("application/grpc"))
            });
    if !grpc {
        return StatusCode::HTTP_VERSION_NOT_SUPPORTED.into_response();
    }
    (
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/grpc"),
            ),
            // `UNIMPLEMENTED`.
            (
                header::HeaderName::from_static("grpc-status"),
                HeaderValue::from_static("12"),
            ),
            (
                header::HeaderName::from_static("grpc-message"),
                HeaderValue::from_static(NOT_GRPC),
            ),
        ],
        (),
    )
        .into_response()
}

/// The connect info of the HTTP listener's connections: what each shows the listener, for
/// [`count_in_flight`].
#[derive(Clone, Debug)]
pub(crate) struct HttpConn(Option<Arc<Shown>>);

impl axum::extract::connect_info::Connected<axum::serve::IncomingStream<'_, IdleClosing>>
    for HttpConn
{
    fn connect_info(stream: axum::serve::IncomingStream<'_, IdleClosing>) -> Self {
        Self(stream.io().shown.clone())
    }
}

/// Counts each request in flight on its connection until its answer's body is dropped (fully
/// written, or given up), so that a full listener never closes a connection whose answer is
/// still going out, or whose pipelined request is still being served. A request on a
/// connection closed for room meanwhile gets `503` and the connection's close. Requests with
/// no connect info (tests that drive the router without a socket) pass as they are.
pub(crate) async fn count_in_flight(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse as _;
    let shown = request
        .extensions()
        .get::<axum::extract::ConnectInfo<HttpConn>>()
        .and_then(|info| info.0.0.clone());
    let Some(shown) = shown else {
        return next.run(request).await;
    };
    let Some(in_flight) = shown.begin() else {
        return (
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            [(axum::http::header::CONNECTION, "close")],
            "the connection was closed (to make room for another, or at shutdown); ask again",
        )
            .into_response();
    };
    next.run(request).await.map(|body| {
        axum::body::Body::new(Counted {
            body,
            _in_flight: in_flight,
        })
    })
}

/// An answer's body that holds its request's count in flight until dropped.
struct Counted {
    body: axum::body::Body,
    _in_flight: InFlight,
}

impl http_body::Body for Counted {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// The listener's open connections, oldest first, for the eviction that makes room.
#[derive(Debug, Default)]
struct Open {
    shown: std::sync::Mutex<std::collections::VecDeque<std::sync::Weak<Shown>>>,
}

impl Open {
    fn push(&self, shown: &Arc<Shown>) {
        let mut list = self.shown.lock().unwrap_or_else(|e| e.into_inner());
        // At most `MAX_CONNECTIONS` live ones: past twice that, the ended ones are let go.
        if list.len() >= MAX_CONNECTIONS * 2 {
            list.retain(|w| w.strong_count() > 0);
        }
        list.push_back(Arc::downgrade(shown));
    }

    /// Closes the oldest connection that may be ([`Shown::evict_if_idle`]); whether there was
    /// one.
    fn evict_oldest(&self, now: Instant) -> bool {
        let mut list = self.shown.lock().unwrap_or_else(|e| e.into_inner());
        list.retain(|w| w.strong_count() > 0);
        let evicted = list
            .iter()
            .position(|w| w.upgrade().is_some_and(|s| s.evict_if_idle(now)));
        if let Some(i) = evicted {
            list.remove(i);
        }
        evicted.is_some()
    }

    /// At shutdown: closes every connection with no request in flight and no write waiting,
    /// however recently a byte moved.
    fn close_between_requests(&self) {
        let list = self.shown.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        for shown in list.iter().filter_map(std::sync::Weak::upgrade) {
            shown.evict_if_quiet_for(Duration::ZERO, now);
        }
    }
}

/// The HTTP listener: axum's accept (which waits a second after an error such as too many
/// open files), each connection wrapped in [`Idle`]; at most [`MAX_CONNECTIONS`] at once (see
/// the module docs for what a full listener does with the next).
pub(crate) struct IdleClosing {
    listener: TcpListener,
    open: Arc<Semaphore>,
    /// The open connections, for the eviction that makes room.
    shown: Arc<Open>,
    epoch: Instant,
}

impl IdleClosing {
    /// The listener on `listener`, holding at most `max` connections ([`MAX_CONNECTIONS`]
    /// unless the open-file limit is low: `crate::places::listener_caps`).
    pub(crate) fn with_limit(listener: TcpListener, max: usize) -> Self {
        Self {
            listener,
            open: Arc::new(Semaphore::new(max)),
            shown: Arc::default(),
            epoch: Instant::now(),
        }
    }

    /// A place for a connection accepted while every one was held: the oldest connection that
    /// may be closed is, and its place taken once it lets go; with none such, the first place
    /// that frees, trying again every [`EVICTABLE_AFTER`].
    async fn room(&self) -> Option<OwnedSemaphorePermit> {
        // Bounded by the connections that close: each turn evicts one or waits a second.
        loop {
            if let Ok(place) = self.open.clone().try_acquire_owned() {
                return Some(place);
            }
            self.shown.evict_oldest(Instant::now());
            tokio::select! {
                // The semaphore is never closed; should it be, the connection goes uncounted.
                place = self.open.clone().acquire_owned() => return place.ok(),
                () = tokio::time::sleep(EVICTABLE_AFTER) => {}
            }
        }
    }
}

impl axum::serve::Listener for IdleClosing {
    type Io = Idle<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        let (io, addr, permit) = match self.open.clone().try_acquire_owned() {
            Ok(place) => {
                let (io, addr) = axum::serve::Listener::accept(&mut self.listener).await;
                (io, addr, Some(place))
            }
            // Full: the next connection is taken, and room made for it.
            Err(_) => {
                let (io, addr) = axum::serve::Listener::accept(&mut self.listener).await;
                let place = self.room().await;
                (io, addr, place)
            }
        };
        let mut io = Idle::new(io);
        io.permit = permit;
        let shown = Arc::new(Shown::new(self.epoch));
        self.shown.push(&shown);
        io.shown = Some(shown);
        (io, addr)
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.listener.local_addr()
    }
}

/// A connection that reads as closed (end of stream) once nothing has been read from it or
/// written to it for [`IDLE`], or bytes read from it have had no answer (nothing written) for
/// [`UNANSWERED`], while a read waits.
pub(crate) struct Idle<S> {
    inner: S,
    /// Fires [`IDLE`] after the last byte read or written.
    quiet: Pin<Box<Sleep>>,
    /// Fires [`UNANSWERED`] after the first byte read since the last one written, and
    /// [`FIRST_BYTE`] after the accept until a first byte is read; none while nothing read
    /// waits for an answer.
    unanswered: Option<Pin<Box<Sleep>>>,
    /// No byte has been read yet.
    silent: bool,
    /// Fires [`WRITE_STALL`] after a write first found no room; none while writes go through.
    stalled: Option<Pin<Box<Sleep>>>,
    /// It fired: every read from now on is end of stream.
    closed: bool,
    /// The listener's count of open connections, given back when this one is dropped.
    permit: Option<OwnedSemaphorePermit>,
    /// What the listener sees of it, to close it for room (see the module docs).
    shown: Option<Arc<Shown>>,
}

impl<S> Idle<S> {
    pub(crate) fn new(inner: S) -> Self {
        Self {
            inner,
            quiet: Box::pin(tokio::time::sleep(IDLE)),
            unanswered: Some(Box::pin(tokio::time::sleep(FIRST_BYTE))),
            silent: true,
            stalled: None,
            closed: false,
            permit: None,
            shown: None,
        }
    }

    fn active(&mut self) {
        self.quiet.as_mut().reset(Instant::now() + IDLE);
        if let Some(shown) = &self.shown {
            shown.moved();
        }
    }

    /// Bytes were read: activity, and an answer now awaited if none was.
    fn bytes_read(&mut self) {
        self.active();
        if self.unanswered.is_none() || std::mem::take(&mut self.silent) {
            self.unanswered = Some(Box::pin(tokio::time::sleep(UNANSWERED)));
        }
    }

    /// Whether the listener closed it to make room (a read that waits is woken by it).
    fn evicted(&self, cx: Option<&mut Context<'_>>) -> bool {
        self.shown.as_ref().is_some_and(|shown| match cx {
            Some(cx) => shown.wake_on_eviction(cx.waker()),
            None => shown.is_evicted(),
        })
    }

    /// `polled`, a write's result, after counting bytes written as activity and as the answer
    /// to what was read; a write that has found no room for [`WRITE_STALL`] fails.
    fn wrote(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<io::Result<usize>>,
    ) -> Poll<io::Result<usize>> {
        match polled {
            Poll::Pending => {
                if self.stalled.is_none()
                    && let Some(shown) = &self.shown
                {
                    shown.set_writing(true);
                }
                let stalled = self
                    .stalled
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(WRITE_STALL)));
                if stalled.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the client read nothing of the answer for 10 s",
                    )));
                }
                // A write that waits is woken by an eviction too.
                if self.evicted(Some(cx)) {
                    return Poll::Ready(Err(evicted()));
                }
            }
            Poll::Ready(Ok(n)) if n > 0 => {
                self.active();
                self.unanswered = None;
                if self.stalled.take().is_some()
                    && let Some(shown) = &self.shown
                {
                    shown.set_writing(false);
                }
            }
            Poll::Ready(_) => {}
        }
        polled
    }

    /// Whether a timer fired (polled with a read that waits, so that it wakes it).
    fn timed_out(&mut self, cx: &mut Context<'_>) -> bool {
        self.quiet.as_mut().poll(cx).is_ready()
            || self
                .unanswered
                .as_mut()
                .is_some_and(|sleep| sleep.as_mut().poll(cx).is_ready())
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Idle<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.closed || this.evicted(None) {
            return Poll::Ready(Ok(()));
        }
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.inner).poll_read(cx, buf);
        match polled {
            Poll::Ready(Ok(())) if buf.filled().len() > before => {
                // Bytes that came as the connection was closed for room: end of stream, the
                // bytes dropped (a request's head then meets a closed connection, which a
                // client retries, not a 503).
                if this.evicted(None) {
                    buf.set_filled(before);
                    this.closed = true;
                    return Poll::Ready(Ok(()));
                }
                this.bytes_read();
            }
            Poll::Ready(_) => {}
            // Nothing to read: polled with the read, so the timers (and an eviction) wake a
            // read that waits.
            Poll::Pending => {
                if this.timed_out(cx) || this.evicted(Some(cx)) {
                    this.closed = true;
                    return Poll::Ready(Ok(()));
                }
            }
        }
        polled
    }
}

/// What a write to a connection closed to make room gets.
fn evicted() -> io::Error {
    io::Error::new(
        io::ErrorKind::BrokenPipe,
        "the connection was closed to make room for another",
    )
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Idle<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.evicted(None) {
            return Poll::Ready(Err(evicted()));
        }
        let polled = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.wrote(cx, polled)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.evicted(None) {
            return Poll::Ready(Err(evicted()));
        }
        let polled = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.wrote(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    use super::*;

    /// A new connection that sends nothing is closed [`FIRST_BYTE`] after its accept; one
    /// silent after an answer, the idle time after it.
    #[tokio::test(start_paused = true)]
    async fn a_silent_connection_reads_closed_after_the_idle_time() {
        let (server, _client) = tokio::io::duplex(1024);
        let mut server = Idle::new(server);
        let began = Instant::now();
        let mut buf = [0u8; 16];
        assert_eq!(server.read(&mut buf).await.unwrap(), 0, "end of stream");
        assert_eq!(began.elapsed(), FIRST_BYTE);
        assert_eq!(server.read(&mut buf).await.unwrap(), 0, "still closed");
        let (server, mut client) = tokio::io::duplex(1024);
        let mut server = Idle::new(server);
        client.write_all(b"GET /healthz").await.unwrap();
        assert_eq!(server.read(&mut buf).await.unwrap(), 12);
        server.write_all(b"200").await.unwrap();
        let answered = Instant::now();
        assert_eq!(server.read(&mut buf).await.unwrap(), 0, "end of stream");
        assert_eq!(answered.elapsed(), IDLE);
    }

    #[tokio::test(start_paused = true)]
    async fn bytes_either_way_keep_a_connection_open() {
        let (server, mut client) = tokio::io::duplex(1024);
        let mut server = Idle::new(server);
        let mut buf = [0u8; 16];
        // A whole request's head, answered; the next one in two halves, the second just before
        // the idle time.
        client.write_all(b"GET /metrics").await.unwrap();
        assert_eq!(server.read(&mut buf).await.unwrap(), 12);
        server.write_all(b"200").await.unwrap();
        tokio::time::sleep(IDLE - Duration::from_secs(1)).await;
        client.write_all(b"GET /met").await.unwrap();
        assert_eq!(server.read(&mut buf).await.unwrap(), 8);
        tokio::time::sleep(UNANSWERED - Duration::from_secs(1)).await;
        client.write_all(b"rics").await.unwrap();
        assert_eq!(server.read(&mut buf).await.unwrap(), 4);
        // An answer being written counts too.
        server.write_all(b"200").await.unwrap();
        tokio::time::sleep(IDLE - Duration::from_secs(1)).await;
        server.write_all(b"200").await.unwrap();
        let began = Instant::now();
        assert_eq!(server.read(&mut buf).await.unwrap(), 0);
        assert_eq!(began.elapsed(), IDLE);
        let mut answer = [0u8; 9];
        client.read_exact(&mut answer).await.unwrap();
    }

    /// A request's head sent a byte at a time, each well within the idle time, is cut
    /// [`UNANSWERED`] after its first byte.
    #[tokio::test(start_paused = true)]
    async fn bytes_with_no_answer_read_closed_after_the_unanswered_time() {
        let (server, mut client) = tokio::io::duplex(1024);
        let mut server = Idle::new(server);
        let mut buf = [0u8; 16];
        let began = Instant::now();
        // A byte every 10 s, for as long as the connection takes them.
        let writer = tokio::spawn(async move {
            for _ in 0..20 {
                if client.write_all(b"G").await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_secs(10)).await;
            }
        });
        let mut read = 0;
        loop {
            let n = server.read(&mut buf).await.unwrap();
            if n == 0 {
                break;
            }
            read += n;
            assert!(read <= 10, "still open after {read} bytes");
        }
        assert_eq!(began.elapsed(), UNANSWERED);
        assert_eq!(read, 3, "bytes at 0, 10 and 20 s");
        writer.abort();
        assert_eq!(server.read(&mut buf).await.unwrap(), 0, "still closed");
    }

    /// An answer its client does not read fails its write [`WRITE_STALL`] after the write first
    /// found no room, and the connection goes with it; one read slowly goes on.
    #[tokio::test(start_paused = true)]
    async fn a_write_its_client_does_not_read_fails_after_the_stall_time() {
        // The client end is kept, never read.
        let (server, _client) = tokio::io::duplex(64);
        let mut server = Idle::new(server);
        let answer = vec![b'x'; 4096];
        let began = Instant::now();
        let err = tokio::time::timeout(WRITE_STALL * 3, server.write_all(&answer))
            .await
            .expect("the write still waits")
            .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert_eq!(began.elapsed(), WRITE_STALL);
        // Read a little every 5 s: never stalled for the whole time.
        let (server, mut client) = tokio::io::duplex(64);
        let mut server = Idle::new(server);
        let reader = tokio::spawn(async move {
            let mut buf = [0u8; 64];
            let mut read = 0;
            while read < 4096 {
                tokio::time::sleep(Duration::from_secs(5)).await;
                read += client.read(&mut buf).await.unwrap();
            }
        });
        server.write_all(&answer).await.unwrap();
        reader.await.unwrap();
    }

    /// Past its limit the listener hands out the next connection only once one is closed.
    #[tokio::test]
    async fn the_listener_holds_at_most_its_limit_of_connections() {
        use axum::serve::Listener as _;
        let socket = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = socket.local_addr().unwrap();
        let mut listener = IdleClosing::with_limit(socket, 2);
        let mut clients = Vec::new();
        for _ in 0..3 {
            clients.push(TcpStream::connect(addr).await.unwrap());
        }
        let first = listener.accept().await.0;
        let _second = listener.accept().await.0;
        let third = listener.accept();
        tokio::pin!(third);
        let wait = Duration::from_millis(200);
        assert!(
            tokio::time::timeout(wait, &mut third).await.is_err(),
            "a third connection was handed out"
        );
        drop(first);
        tokio::time::timeout(Duration::from_secs(10), third)
            .await
            .expect("handed out once one closed");
    }

    /// The production wiring of the HTTP listener around `app` and a `/healthz` that answers
    /// `ok`, on a free loopback port: `limit` connections, each request counted on its
    /// connection until its answer is out. Its address.
    async fn serving(limit: usize, app: axum::Router) -> SocketAddr {
        let socket = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = socket.local_addr().unwrap();
        let app = app.route("/healthz", axum::routing::get(|| async { "ok" }));
        tokio::spawn(super::serve(
            IdleClosing::with_limit(socket, limit),
            app,
            std::future::pending(),
        ));
        addr
    }

    /// A probe on a new connection to `addr` is served within the time a full listener takes to
    /// make room for it (a stalled write's end, then the eviction's turns).
    async fn probe_is_served(addr: SocketAddr) {
        let mut probe = TcpStream::connect(addr).await.unwrap();
        let answered = tokio::time::timeout(
            WRITE_STALL + EVICTABLE_AFTER * 3,
            get(&mut probe, "/healthz"),
        )
        .await
        .expect("the probe was not served: another connection holds the only place");
        assert_eq!(answered, "ok");
    }

    /// An HTTP/2 connection to `addr` with the client's window set to `window`, driven on a
    /// task of its own.
    async fn h2_client(addr: SocketAddr, window: u32) -> h2::client::SendRequest<bytes::Bytes> {
        let tcp = TcpStream::connect(addr).await.unwrap();
        let (h2, conn) = h2::client::Builder::new()
            .initial_window_size(window)
            .handshake::<_, bytes::Bytes>(tcp)
            .await
            .unwrap();
        tokio::spawn(async move {
            let _ = conn.await;
        });
        h2
    }

    /// An HTTP/2 answer would wait on the client's window with no socket write pending: a
    /// client with a window of 0 kept its request in flight and its place for good, and a
    /// full listener never served a probe. Every HTTP/2 request is answered at once with no
    /// body, so its connection holds no request and is closed for room like any quiet one.
    #[tokio::test]
    async fn an_http2_client_with_a_window_of_0_does_not_keep_a_probe_out() {
        let addr = serving(1, axum::Router::new()).await;
        let mut h2 = h2_client(addr, 0).await;
        let request = axum::http::Request::get(format!("http://{addr}/healthz"))
            .body(())
            .unwrap();
        let (response, _) = h2.send_request(request, true).unwrap();
        let response = response.await.unwrap();
        assert_eq!(response.status(), 505);
        assert!(response.body().is_end_stream(), "no body to wait on");
        probe_is_served(addr).await;
    }

    /// A gRPC call over HTTP/2 (a CLI or an agent given this listener's address) is answered
    /// as a gRPC server answers a call it does not serve: `UNIMPLEMENTED`, in the headers
    /// alone, saying what listens here.
    #[tokio::test]
    async fn a_grpc_call_is_answered_unimplemented_in_the_headers_alone() {
        let addr = serving(4, axum::Router::new()).await;
        let mut h2 = h2_client(addr, 65_535).await;
        let request =
            axum::http::Request::post(format!("http://{addr}/retryplane.v1.AdminService/History"))
                .header("content-type", "application/grpc")
                .header("te", "trailers")
                .body(())
                .unwrap();
        let (response, _) = h2.send_request(request, true).unwrap();
        let response = response.await.unwrap();
        let headers = response.headers();
        assert_eq!(response.status(), 200);
        assert_eq!(headers["content-type"], "application/grpc");
        assert_eq!(headers["grpc-status"], "12");
        assert_eq!(headers["grpc-message"], NOT_GRPC);
        assert!(response.body().is_end_stream());
        // The media type in capitals is the same; a GET is not a gRPC call.
        for (method, content_type, status) in [
            (axum::http::Method::POST, "Application/GRPC+proto", 200),
            (axum::http::Method::GET, "application/grpc", 505),
        ] {
            let request = axum::http::Request::builder()
                .method(method)
                .uri(format!("http://{addr}/retryplane.v1.AdminService/History"))
                .header("content-type", content_type)
                .body(())
                .unwrap();
            let (response, _) = h2.send_request(request, true).unwrap();
            let response = response.await.unwrap();
            assert_eq!(response.status(), status, "{content_type}");
            assert!(response.body().is_end_stream());
        }
        // Its own grpc-message: nothing gRPC would percent-decode.
        assert!(
            NOT_GRPC
                .bytes()
                .all(|b| (0x20..0x7f).contains(&b) && b != b'%')
        );
        // HTTP/1.1 on the same listener is served.
        let mut client = TcpStream::connect(addr).await.unwrap();
        assert_eq!(get(&mut client, "/healthz").await, "ok");
    }

    /// An HTTP/2 request whose body never ends (its client at window 0): answered at once, the
    /// stream reset, and the connection closed for room once quiet.
    #[tokio::test]
    async fn an_http2_request_whose_body_never_ends_does_not_keep_a_probe_out() {
        let addr = serving(1, axum::Router::new()).await;
        let mut h2 = h2_client(addr, 0).await;
        let request = axum::http::Request::post(format!("http://{addr}/healthz"))
            .header("content-type", "application/grpc")
            .body(())
            .unwrap();
        let (response, mut body_tx) = h2.send_request(request, false).unwrap();
        let response = response.await.unwrap();
        assert_eq!(response.status(), 200);
        assert!(response.body().is_end_stream());
        let reset = tokio::time::timeout(
            Duration::from_secs(5),
            std::future::poll_fn(|cx| body_tx.poll_reset(cx)),
        )
        .await
        .expect("the stream was not reset")
        .unwrap();
        assert_eq!(reset, h2::Reason::NO_ERROR);
        probe_is_served(addr).await;
    }

    /// A connection that has sent half a request's head does not hold the shutdown (it held
    /// it for the server's whole grace), and one whose answer is being written is let finish.
    #[tokio::test]
    async fn a_shutdown_closes_the_connections_between_requests_and_lets_answers_finish() {
        const BODY: usize = 4 << 20;
        let socket = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = socket.local_addr().unwrap();
        let app = axum::Router::new()
            .route("/big", axum::routing::get(|| async { vec![b'x'; BODY] }))
            .route("/healthz", axum::routing::get(|| async { "ok" }));
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let served = tokio::spawn(super::serve(
            IdleClosing::with_limit(socket, 8),
            app,
            async move {
                let _ = rx.await;
            },
        ));
        let mut half = TcpStream::connect(addr).await.unwrap();
        half.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n")
            .await
            .unwrap();
        let mut kept = TcpStream::connect(addr).await.unwrap();
        assert_eq!(get(&mut kept, "/healthz").await, "ok");
        // A large answer, its first bytes read, the rest still to go.
        let mut big = TcpStream::connect(addr).await.unwrap();
        big.write_all(b"GET /big HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let mut buf = vec![0u8; 64 << 10];
        let mut got = big.read(&mut buf).await.unwrap();
        tx.send(()).unwrap();
        // The half-sent head and the kept-alive connection are closed at once.
        for client in [&mut half, &mut kept] {
            let read = tokio::time::timeout(Duration::from_secs(2), client.read(&mut buf)).await;
            assert!(matches!(read, Ok(Ok(0))), "not closed: {read:?}");
        }
        // The answer being written goes out whole, and then the server ends.
        while let Ok(n) = big.read(&mut buf).await {
            if n == 0 {
                break;
            }
            got += n;
        }
        assert!(got > BODY, "the answer was cut at {got}");
        tokio::time::timeout(Duration::from_secs(2), served)
            .await
            .expect("serve did not end")
            .unwrap()
            .unwrap();
    }

    /// What tonic makes of the answer to a gRPC call: `UNIMPLEMENTED`, with the message.
    #[tokio::test]
    async fn tonic_sees_unimplemented_with_what_listens_here() {
        let addr = serving(4, axum::Router::new()).await;
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut grpc = tonic::client::Grpc::new(channel);
        grpc.ready().await.unwrap();
        let status = grpc
            .unary::<(), (), _>(
                tonic::Request::new(()),
                axum::http::uri::PathAndQuery::from_static("/retryplane.v1.AdminService/History"),
                tonic_prost::ProstCodec::default(),
            )
            .await
            .unwrap_err();
        assert_eq!(status.code(), tonic::Code::Unimplemented, "{status:?}");
        assert_eq!(status.message(), NOT_GRPC);
    }

    /// `GET path` on `client`, keeping the connection, and the answer's body once it is all in.
    async fn get(client: &mut TcpStream, path: &str) -> String {
        client
            .write_all(format!("GET {path} HTTP/1.1\r\nhost: x\r\n\r\n").as_bytes())
            .await
            .unwrap();
        read_answers(client, 1).await
    }

    /// Reads `count` answers (each with a `content-length`) from `client`; their bodies.
    async fn read_answers(client: &mut TcpStream, count: usize) -> String {
        let mut all = Vec::new();
        let mut bodies = String::new();
        let mut buf = [0u8; 4096];
        let mut done = 0;
        while done < count {
            let n = client.read(&mut buf).await.unwrap();
            assert!(n > 0, "closed after {bodies:?}");
            all.extend_from_slice(&buf[..n]);
            // Every answer complete so far: head, then `content-length` bytes.
            while let Some(head_end) = all.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&all[..head_end]).to_lowercase();
                let length: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length: "))
                    .and_then(|v| v.trim().parse().ok())
                    .unwrap_or(0);
                if all.len() < head_end + 4 + length {
                    break;
                }
                bodies.push_str(&String::from_utf8_lossy(
                    &all[head_end + 4..head_end + 4 + length],
                ));
                all.drain(..head_end + 4 + length);
                done += 1;
            }
        }
        bodies
    }

    /// A full listener takes the next connection and makes room for it by closing the oldest
    /// connection that waits for its next request and has moved nothing for `EVICTABLE_AFTER`
    /// (a kept-alive client's between requests): the next is served, the one closed reads its
    /// end.
    #[tokio::test]
    async fn a_full_listener_closes_an_idle_kept_alive_connection_for_the_next() {
        let addr = serving(1, axum::Router::new()).await;
        let mut kept = TcpStream::connect(addr).await.unwrap();
        assert_eq!(get(&mut kept, "/healthz").await, "ok");
        let mut probe = TcpStream::connect(addr).await.unwrap();
        // Well before the kept connection's idle close (90 s).
        let answered = tokio::time::timeout(Duration::from_secs(10), get(&mut probe, "/healthz"))
            .await
            .expect("the probe was not served");
        assert_eq!(answered, "ok");
        let mut buf = [0u8; 16];
        assert_eq!(
            kept.read(&mut buf).await.unwrap(),
            0,
            "the kept connection was closed"
        );
    }

    /// A large answer whose client pauses past `EVICTABLE_AFTER` (its socket full, the write
    /// waiting) is not cut when a probe comes to a full listener: its request is in flight.
    #[tokio::test]
    async fn an_answer_being_written_is_not_closed_for_room() {
        const BODY: usize = 16 << 20;
        let app =
            axum::Router::new().route("/big", axum::routing::get(|| async { vec![b'x'; BODY] }));
        let addr = serving(1, app).await;
        let client = tokio::net::TcpSocket::new_v4().unwrap();
        client.set_recv_buffer_size(4096).unwrap();
        let mut client = client.connect(addr).await.unwrap();
        client
            .write_all(b"GET /big HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let mut buf = vec![0u8; 64 * 1024];
        let mut got = client.read(&mut buf).await.unwrap();
        // The client pauses past the time that makes a quiet connection one to close.
        tokio::time::sleep(EVICTABLE_AFTER + Duration::from_millis(500)).await;
        let mut probe = TcpStream::connect(addr).await.unwrap();
        probe
            .write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        // Past the eviction's next try.
        tokio::time::sleep(EVICTABLE_AFTER + Duration::from_millis(300)).await;
        while got < BODY {
            match tokio::time::timeout(Duration::from_secs(20), client.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => break,
                Ok(Ok(n)) => got += n,
                Err(_) => panic!("stuck at {got}"),
            }
        }
        assert!(
            got >= BODY,
            "the answer was cut after {got} of {BODY} bytes"
        );
    }

    /// A pipelined request whose answer takes longer than `EVICTABLE_AFTER` to make is not
    /// cut when a probe comes to a full listener: it is in flight though no byte moves.
    #[tokio::test]
    async fn a_pipelined_request_being_answered_is_not_closed_for_room() {
        let app = axum::Router::new().route(
            "/slow",
            axum::routing::get(|| async {
                tokio::time::sleep(EVICTABLE_AFTER * 3).await;
                "slow"
            }),
        );
        let addr = serving(1, app).await;
        let mut client = TcpStream::connect(addr).await.unwrap();
        client
            .write_all(
                b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\nGET /slow HTTP/1.1\r\nhost: x\r\n\r\n",
            )
            .await
            .unwrap();
        tokio::time::sleep(EVICTABLE_AFTER + Duration::from_millis(300)).await;
        let _probe = TcpStream::connect(addr).await.unwrap();
        let answers = tokio::time::timeout(Duration::from_secs(10), read_answers(&mut client, 2))
            .await
            .expect("no answers");
        assert_eq!(answers, "okslow");
    }

    /// What makes a connection one a full listener may close: no request in flight, no write
    /// waiting, and quiet for `EVICTABLE_AFTER`; a request that begins on one closed is not
    /// served.
    #[tokio::test(start_paused = true)]
    async fn a_connection_is_closed_for_room_only_with_nothing_in_flight_and_quiet() {
        let shown = Arc::new(Shown::new(Instant::now()));
        assert!(!shown.evict_if_idle(Instant::now()), "just accepted");
        let in_flight = shown.begin().unwrap();
        tokio::time::advance(EVICTABLE_AFTER).await;
        assert!(!shown.evict_if_idle(Instant::now()), "a request in flight");
        drop(in_flight);
        assert!(
            !shown.evict_if_idle(Instant::now()),
            "its answer just ended"
        );
        shown.set_writing(true);
        tokio::time::advance(EVICTABLE_AFTER).await;
        assert!(!shown.evict_if_idle(Instant::now()), "a write waits");
        shown.set_writing(false);
        assert!(shown.evict_if_idle(Instant::now()));
        assert!(shown.is_evicted() && !shown.evict_if_idle(Instant::now()));
        assert!(
            shown.begin().is_none(),
            "no request begins on a closed connection"
        );
    }
}
