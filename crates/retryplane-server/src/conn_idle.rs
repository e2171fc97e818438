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
//! A call on such a connection that never ends (a health Watch, a unary call whose request is
//! never finished) would keep it from ever being idle, so any call other than an agent's stream
//! lasts at most the same time ([`CountStreams`]).
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

/// The longest idle timeout or call bound the clock is asked to add (past it, 24 h in practice:
/// the CLI takes at most that), so that no `Instant` arithmetic can overflow.
pub(crate) const LONGEST: Duration = Duration::from_secs(365 * 24 * 3600);

/// With a tokens file, how long a connection that has carried no call yet may stay before it is
/// closed (the idle timeout, when that is shorter): an agent or an admin client calls as soon
/// as it connects, and a peer with no token held each silent connection it opened (preface
/// sent, PINGs answered) for the whole idle timeout (5 min by default). A connection with a
/// call, even one no token admitted (a health check, a refusal), keeps the idle timeout: a
/// prober that keeps its connection for health checks is not closed under them every few
/// seconds (a full listener closes such connections first, see [`crate::places`]).
pub(crate) const NO_CALL_IDLE: Duration = Duration::from_secs(10);

/// [`Streams::state`]: neither admitted nor evicted.
const OPEN: u8 = 0;
/// [`Streams::state`]: a token admitted one of the connection's calls.
const ADMITTED: u8 = 1;
/// [`Streams::state`]: closed to make room.
const EVICTED: u8 = 2;

/// The open streams of one connection, and since when none has been open.
#[derive(Debug)]
pub(crate) struct Streams {
    /// Agents' streams, which have no end set.
    open: AtomicUsize,
    /// Other calls, each cut at its bound ([`CountStreams`]).
    bounded: AtomicUsize,
    /// The times (see [`Times`]).
    times: Mutex<Times>,
    /// The listener's count of calls not yet let go, which the end of a shutdown waits for.
    live: Option<Arc<crate::preface::Live>>,
    /// A tokens file is in force: until it carries a call, the connection may stay for
    /// [`NO_CALL_IDLE`] at most.
    guarded: bool,
    /// The connection has carried a call.
    called: std::sync::atomic::AtomicBool,
    /// [`OPEN`], [`ADMITTED`] (a token has admitted one of the connection's calls) or
    /// [`EVICTED`] (closed to make room for a new connection on a full listener,
    /// [`crate::places::Evictable`]): one state, changed by compare-and-swap, so that an
    /// admitted connection is never evicted and an evicted one never taken for admitted.
    state: std::sync::atomic::AtomicU8,
    /// The connection's read that waits, woken by [`Streams::evict`].
    reader: crate::places::WakerSlot,
}

#[derive(Debug)]
struct Times {
    /// When the last stream ended (the connection's accept before any).
    quiet_since: Instant,
    /// The latest bound of the calls opened: past it, a call not yet ended (its answer held by
    /// a client that gives it no flow-control window, so the cut never goes out) no longer
    /// keeps the connection from being idle.
    latest_bound: Instant,
}

impl Streams {
    /// No stream yet, quiet since `now`.
    pub(crate) fn new(now: Instant) -> Self {
        Self {
            open: AtomicUsize::new(0),
            bounded: AtomicUsize::new(0),
            times: Mutex::new(Times {
                quiet_since: now,
                latest_bound: now,
            }),
            live: None,
            guarded: false,
            called: std::sync::atomic::AtomicBool::new(false),
            state: std::sync::atomic::AtomicU8::new(OPEN),
            reader: crate::places::WakerSlot::default(),
        }
    }

    /// Whether the connection's listener has a tokens file ([`Streams::guarded`]).
    pub(crate) fn is_guarded(&self) -> bool {
        self.guarded
    }

    /// Whether a token has admitted one of the connection's calls (never on a listener
    /// without a tokens file).
    pub(crate) fn is_admitted(&self) -> bool {
        self.state.load(Ordering::SeqCst) == ADMITTED
    }

    /// Whether the connection was closed to make room ([`Streams::evict`]).
    pub(crate) fn is_evicted(&self) -> bool {
        self.state.load(Ordering::SeqCst) == EVICTED
    }

    /// A token admitted one of the connection's calls: it is not evicted from now on. `false`
    /// when it was already (its answer could not be written).
    fn admit(&self) -> bool {
        match self
            .state
            .compare_exchange(OPEN, ADMITTED, Ordering::SeqCst, Ordering::SeqCst)
        {
            Ok(_) => true,
            Err(state) => state == ADMITTED,
        }
    }

    /// Closes the connection unless a token has admitted a call on it: its reader
    /// ([`crate::preface::Preface`]) reads end of stream from now on, and its writes fail, and
    /// it is woken if it waits. Whether it was evicted now.
    pub(crate) fn evict(&self) -> bool {
        if self
            .state
            .compare_exchange(OPEN, EVICTED, Ordering::SeqCst, Ordering::SeqCst)
            .is_err()
        {
            return false;
        }
        self.reader.wake();
        true
    }

    /// Wakes `reader` when the connection is evicted; whether it was already (then the caller
    /// reads end of stream rather than wait).
    pub(crate) fn wake_on_eviction(&self, reader: &std::task::Waker) -> bool {
        self.reader.register(reader);
        self.is_evicted()
    }

    /// A tokens file is in force on the connection's listener (see [`NO_CALL_IDLE`]).
    pub(crate) fn guarded(mut self, guarded: bool) -> Self {
        self.guarded = guarded;
        self
    }

    /// How long the connection may go without a stream: `idle_after`, the listener's idle
    /// timeout, or [`NO_CALL_IDLE`] if shorter while it has carried no call on a guarded
    /// listener.
    pub(crate) fn idle_after(&self, idle_after: Duration) -> Duration {
        if self.guarded && !self.called.load(Ordering::SeqCst) {
            idle_after.min(NO_CALL_IDLE)
        } else {
            idle_after
        }
    }

    /// Counts this connection's calls in `live` too.
    pub(crate) fn counted_in(mut self, live: Arc<crate::preface::Live>) -> Self {
        self.live = Some(live);
        self
    }

    /// Counts a stream open until the guard is dropped: an agent's (`bound` `None`), or
    /// another call, cut at `bound`.
    pub(crate) fn opened(self: &Arc<Self>, bound: Option<Instant>) -> StreamGuard {
        self.called.store(true, Ordering::SeqCst);
        match bound {
            None => {
                self.open.fetch_add(1, Ordering::SeqCst);
            }
            Some(bound) => {
                let mut times = self.times.lock().unwrap_or_else(|e| e.into_inner());
                times.latest_bound = times.latest_bound.max(bound);
                self.bounded.fetch_add(1, Ordering::SeqCst);
            }
        }
        if let Some(live) = &self.live {
            live.call_began();
        }
        StreamGuard {
            streams: self.clone(),
            bounded: bound.is_some(),
            released: false,
        }
    }

    /// How long no stream has been open at `now` (calls past their bound not counted); `None`
    /// while one is.
    pub(crate) fn quiet_for(&self, now: Instant) -> Option<Duration> {
        if self.open.load(Ordering::SeqCst) > 0 {
            return None;
        }
        let times = self.times.lock().unwrap_or_else(|e| e.into_inner());
        let since = if self.bounded.load(Ordering::SeqCst) > 0 {
            if now < times.latest_bound {
                return None;
            }
            times.quiet_since.max(times.latest_bound)
        } else {
            times.quiet_since
        };
        Some(now.saturating_duration_since(since))
    }
}

/// One open stream of a connection ([`Streams::opened`]).
#[derive(Debug)]
pub(crate) struct StreamGuard {
    streams: Arc<Streams>,
    bounded: bool,
    /// The call is out of the counts already ([`StreamGuard::not_a_token_holders`]).
    released: bool,
}

impl StreamGuard {
    /// The call was admitted by no token (with a tokens file: refused for its token, or one
    /// that no token guards, such as a health check or an unknown method): it leaves the
    /// counts now, open or not, and its end is no sign that the connection is in use. A peer
    /// with no token kept a connection for good with such a call every few seconds, or with
    /// health Watches that overlap.
    pub(crate) fn not_a_token_holders(&mut self) {
        if std::mem::replace(&mut self.released, true) {
            return;
        }
        // Under the lock that `quiet_for` reads the counts under.
        let times = self.streams.times.lock().unwrap_or_else(|e| e.into_inner());
        self.count().fetch_sub(1, Ordering::SeqCst);
        drop(times);
    }

    fn count(&self) -> &AtomicUsize {
        if self.bounded {
            &self.streams.bounded
        } else {
            &self.streams.open
        }
    }
}

/// Put in each request when a tokens file is in force; the token guard marks it when it
/// admits the call ([`Admitted::admit`]), and so the call's connection.
#[derive(Clone, Debug, Default)]
pub(crate) struct Admitted(Arc<std::sync::atomic::AtomicBool>, Option<Arc<Streams>>);

impl Admitted {
    /// For a call on the connection whose streams are `streams`.
    fn on(streams: Option<Arc<Streams>>) -> Self {
        Self(Arc::default(), streams)
    }

    /// [`Admitted::on`] a connection's streams, for tests of the connection.
    #[cfg(test)]
    pub(crate) fn on_streams(streams: Arc<Streams>) -> Self {
        Self::on(Some(streams))
    }

    /// A token guard admitted the call.
    /// `false` when the call's connection was closed to make room before the token admitted
    /// it: the call is not to run (its answer could not be written; an Apply would be stored
    /// with no one told).
    pub(crate) fn admit(&self) -> bool {
        let admitted = self.1.as_ref().is_none_or(|streams| streams.admit());
        if admitted {
            self.0.store(true, Ordering::SeqCst);
        }
        admitted
    }

    fn admitted(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        if !self.released {
            self.end();
        }
        if let Some(live) = &self.streams.live {
            live.call_ended();
        }
    }
}

impl StreamGuard {
    /// The call ended: out of the counts, and the connection quiet from now.
    fn end(&self) {
        // The time first, under the lock that `quiet_for` reads the counts under.
        let mut times = self.streams.times.lock().unwrap_or_else(|e| e.into_inner());
        times.quiet_since = Instant::now();
        self.count().fetch_sub(1, Ordering::SeqCst);
        drop(times);
    }
}

/// A gRPC connection's `ConnectInfo`: its TCP info and its [`Streams`].
#[derive(Clone, Debug)]
pub(crate) struct Conn<T> {
    pub(crate) inner: T,
    pub(crate) streams: Arc<Streams>,
}

/// The layer of [`CountStreams`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct CountStreamsLayer {
    /// How long a call other than an agent's stream may last.
    pub(crate) max_call: Duration,
    /// A tokens file is in force: only calls a token admitted count as use of a connection.
    pub(crate) guarded: bool,
}

impl<S> tower::Layer<S> for CountStreamsLayer {
    type Service = CountStreams<S>;

    fn layer(&self, inner: S) -> Self::Service {
        CountStreams {
            inner,
            max_call: self.max_call,
            guarded: self.guarded,
        }
    }
}

/// Counts each request in its connection's [`Streams`] until its response body is dropped,
/// and ends a call other than an agent's stream (`AgentService/Connect`) that lasts longer
/// than `max_call`, with `UNAVAILABLE` ("call again"): without a bound, a peer with no token
/// held a connection for good with one call that never ends (a health Watch, a reflection
/// stream, a unary call whose request it never finishes), and the idle close could not reach
/// it. The admin API's calls are unary and short, and a Watch or reflection client calls again.
#[derive(Clone, Debug)]
pub(crate) struct CountStreams<S> {
    inner: S,
    max_call: Duration,
    guarded: bool,
}

/// What a call cut at the bound gets.
fn cut(max_call: Duration) -> tonic::Status {
    tonic::Status::unavailable(format!(
        "calls other than an agent's stream last at most {} s here; call again",
        max_call.as_secs_f64()
    ))
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
        let max_call = self.max_call.min(LONGEST);
        let bounded = request.uri().path() != crate::agent_route::CONNECT_PATH;
        let until = Instant::now() + max_call;
        let conn = request.extensions().get::<Conn<TcpConnectInfo>>().map(|c| {
            (
                c.inner.clone(),
                c.streams.opened(bounded.then_some(until)),
                c.streams.clone(),
            )
        });
        let streams = conn.as_ref().map(|(_, _, streams)| streams.clone());
        let guard = conn.map(|(tcp, guard, _)| {
            request.extensions_mut().insert(tcp);
            guard
        });
        let admitted = self.guarded.then(|| {
            let admitted = Admitted::on(streams);
            request.extensions_mut().insert(admitted.clone());
            admitted
        });
        let future = self.inner.call(request);
        Box::pin(async move {
            let answered = if bounded {
                tokio::time::timeout_at(until, future).await.ok()
            } else {
                Some(future.await)
            };
            let mut guard = guard;
            // A call no token admitted leaves the counts once it has an answer (or is cut).
            if let Some(guard) = &mut guard
                && admitted.is_some_and(|a| !a.admitted())
            {
                guard.not_a_token_holders();
            }
            let Some(response) = answered else {
                // No answer by the bound: a Trailers-Only answer, and the call's request (its
                // body, perhaps never finished) is let go.
                let (parts, _) = cut(max_call).into_http::<()>().into_parts();
                return Ok(http::Response::from_parts(
                    parts,
                    Counted {
                        inner: None,
                        until: None,
                        cut: None,
                        _guard: guard,
                    },
                ));
            };
            let response = response?;
            Ok(response.map(|body| Counted {
                inner: Some(body),
                until: bounded.then(|| Box::pin(tokio::time::sleep_until(until))),
                cut: bounded.then_some(max_call),
                _guard: guard,
            }))
        })
    }
}

/// A response body that holds its stream's count, and ends with `UNAVAILABLE` at `until`
/// (see [`CountStreams`]).
#[derive(Debug)]
pub(crate) struct Counted<B> {
    /// `None` for a call cut before its answer (its head says why), or once cut.
    inner: Option<B>,
    until: Option<Pin<Box<tokio::time::Sleep>>>,
    cut: Option<Duration>,
    _guard: Option<StreamGuard>,
}

impl<B: http_body::Body + Unpin> http_body::Body for Counted<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let this = self.get_mut();
        let Some(inner) = &mut this.inner else {
            return Poll::Ready(None);
        };
        let polled = Pin::new(inner).poll_frame(cx);
        if polled.is_ready() {
            return polled;
        }
        let (Some(until), Some(max_call)) = (&mut this.until, this.cut) else {
            return polled;
        };
        if until.as_mut().poll(cx).is_pending() {
            return polled;
        }
        // The bound: the body ends here, its status in trailers.
        this.inner = None;
        let mut trailers = http::HeaderMap::new();
        if cut(max_call).add_header(&mut trailers).is_err() {
            trailers.insert("grpc-status", http::HeaderValue::from_static("14"));
        }
        Poll::Ready(Some(Ok(http_body::Frame::trailers(trailers))))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(B::is_end_stream)
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner
            .as_ref()
            .map_or_else(|| http_body::SizeHint::with_exact(0), B::size_hint)
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
        let a = streams.opened(None);
        let b = streams.opened(None);
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

    /// A call no token admitted leaves the connection quiet since its last call that one did
    /// (or its accept).
    #[tokio::test(start_paused = true)]
    async fn a_call_no_token_admitted_does_not_end_the_quiet() {
        let streams = Arc::new(Streams::new(Instant::now()));
        tokio::time::sleep(Duration::from_secs(3)).await;
        let mut refused = streams.opened(Some(Instant::now() + Duration::from_secs(10)));
        refused.not_a_token_holders();
        drop(refused);
        assert_eq!(
            streams.quiet_for(Instant::now()),
            Some(Duration::from_secs(3))
        );
        // Still open (a health Watch), it does not keep the connection busy either.
        let mut watch = streams.opened(Some(Instant::now() + Duration::from_secs(10)));
        watch.not_a_token_holders();
        assert_eq!(
            streams.quiet_for(Instant::now()),
            Some(Duration::from_secs(3))
        );
        drop(watch);
        let answered = streams.opened(Some(Instant::now() + Duration::from_secs(10)));
        tokio::time::sleep(Duration::from_secs(1)).await;
        drop(answered);
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(
            streams.quiet_for(Instant::now()),
            Some(Duration::from_secs(2))
        );
    }

    /// A call past its bound that has not ended (its cut held back by a client that gives its
    /// answer no window) no longer keeps the connection busy: quiet from the bound on.
    #[tokio::test(start_paused = true)]
    async fn a_call_past_its_bound_no_longer_keeps_the_connection_busy() {
        let streams = Arc::new(Streams::new(Instant::now()));
        let stuck = streams.opened(Some(Instant::now() + Duration::from_secs(10)));
        tokio::time::sleep(Duration::from_secs(9)).await;
        assert_eq!(streams.quiet_for(Instant::now()), None);
        tokio::time::sleep(Duration::from_secs(4)).await;
        assert_eq!(
            streams.quiet_for(Instant::now()),
            Some(Duration::from_secs(3))
        );
        // An agent's stream keeps it busy whatever the calls' bounds.
        let agent = streams.opened(None);
        assert_eq!(streams.quiet_for(Instant::now()), None);
        drop(agent);
        drop(stuck);
        assert_eq!(streams.quiet_for(Instant::now()), Some(Duration::ZERO));
    }
}
