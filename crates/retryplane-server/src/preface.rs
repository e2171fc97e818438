//! Connections that never send the HTTP/2 preface do not hold a shutdown, nor a file
//! descriptor for long.
//!
//! At shutdown tonic stops accepting and waits for every accepted connection to end, and hyper
//! ends an HTTP/2 connection gracefully (GOAWAY, open calls finish) only once the connection has
//! started. A client that connects and sends nothing, or less than the 24-byte client preface
//! (a TCP health check, a port scan, a peer that stalled before its preface), held the shutdown
//! for the whole [`crate::server::SHUTDOWN_GRACE`] and was then cut off with every other
//! connection.
//!
//! [`Preface`] wraps each accepted connection of the gRPC listeners. Once shutdown has begun and
//! [`PREFACE_GRACE`] has passed (counted from the first read after shutdown began that found
//! nothing waiting, so at least that long), a connection that has still not delivered the preface,
//! and has nothing waiting in the socket, reads as closed by its peer, so hyper drops it at once.
//! The grace lets a client that connected just as shutdown began get its first bytes in, and be
//! refused or served as hyper sees fit. A connection that has delivered the preface is left alone:
//! hyper's graceful shutdown handles it, and the wrapper passes its reads and writes through. (So a
//! peer that sent the preface and then hung, answering nothing, still holds the shutdown until
//! hyper's graceful close or the grace gives up on it: only hyper knows whether such a connection
//! has a call in flight.)
//!
//! The same happens to a connection that has not delivered the preface [`PREFACE_TIMEOUT`]
//! after it was accepted, shutdown or not: hyper's keepalive only starts once the preface is
//! in, so a peer that connects and sends nothing (or half a preface) held its socket for good,
//! and a few thousand of them used up the process's file descriptors.
//!
//! Once the preface is in, the wrapper reads as closed when the connection has carried no
//! stream for the listener's idle timeout and nothing waits in the socket (see
//! [`crate::conn_idle`], which counts the streams).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::watch;
use tokio::time::{Instant, Sleep};
use tonic::transport::server::Connected;

use crate::conn_idle::{Conn, Streams};

/// How long a connection without a stream must also have moved no byte either way before it is
/// closed for idleness: a request just read (its stream not yet counted: tonic counts it in the
/// stream's own task), or an answer still being written to a slow reader after its stream
/// ended, keeps it. Well under the shortest keepalive interval (1 s), so PINGs and their acks
/// alone leave such moments and the connection is still closed.
pub(crate) const QUIET_IO: Duration = Duration::from_millis(300);

/// How many [`QUIET_IO`] turns bytes moving may put an idle connection's close off by (3 s).
pub(crate) const MAX_QUIET_TURNS: u32 = 10;

/// The HTTP/2 client connection preface, `PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n` (RFC 9113 §3.4).
pub(crate) const PREFACE_LEN: usize = 24;

/// How long after shutdown begins a connection still short of its preface is kept.
pub(crate) const PREFACE_GRACE: Duration = Duration::from_millis(500);

/// How long after it is accepted a connection may take to deliver the preface (a client sends
/// it at once, with its first bytes).
pub(crate) const PREFACE_TIMEOUT: Duration = Duration::from_secs(10);

/// Resolves [`PREFACE_GRACE`] after shutdown begins (or after the shutdown signal is gone), or
/// [`PREFACE_TIMEOUT`] after the connection was accepted, whichever comes first.
type Closing = Pin<Box<dyn Future<Output = ()> + Send>>;

/// An accepted connection that reads as closed once shutdown has begun and [`PREFACE_GRACE`]
/// has passed, or [`PREFACE_TIMEOUT`] after it was accepted, when it has not yet sent the
/// HTTP/2 preface. See the module docs.
pub(crate) struct Preface<S> {
    inner: S,
    /// Bytes read so far, up to [`PREFACE_LEN`].
    read: usize,
    /// Until the preface is in: the shutdown's signal. `None` once it is in.
    closing: Option<Closing>,
    /// The signal fired before the preface was in, or no stream was open for `idle_after`:
    /// every read from now on is end of stream.
    closed: bool,
    /// The connection's open streams, counted by [`crate::conn_idle::CountStreams`].
    streams: Arc<Streams>,
    /// How long the connection may go without an open stream (see [`crate::conn_idle`]).
    idle_after: Duration,
    /// Fires when the connection may have been without a stream for `idle_after`; made at the
    /// first read that waits after the preface.
    idle: Option<Pin<Box<Sleep>>>,
    /// Reads and writes that moved bytes, and their count when the idle timer last fired: a
    /// connection is closed only after [`QUIET_IO`] in which none did (see
    /// [`Preface::quiet_too_long`]).
    io: u64,
    io_seen: u64,
    /// The idle timer's turns since the connection was found without a stream long enough,
    /// each put off by bytes moved: past [`MAX_QUIET_TURNS`], it is closed all the same (a
    /// peer that PINGs more often than [`QUIET_IO`] must not keep it for good).
    quiet_turns: u32,
    /// Resolves when the server closes every connection left after its shutdown's grace (see
    /// [`Connections`]); `None` once it has: every read is then end of stream, every write
    /// an error.
    forced: Option<Closing>,
    /// Counted among the listener's live connections while it lives.
    live: LiveGuard,
    /// The listener's place this connection holds until it is dropped (see
    /// `crate::server::incoming`).
    _place: Option<tokio::sync::OwnedSemaphorePermit>,
}

/// The connections of the gRPC listeners that are still open, and the signal that closes them
/// all: tonic runs each connection in a task of its own that the server's shutdown cannot
/// abort, so a connection with a stream that never ends (a health Watch, a peer that never
/// acks the shutdown's GOAWAY) outlived [`crate::server::Running::shutdown`], and kept the
/// control plane, store included, with it.
#[derive(Clone, Debug)]
pub(crate) struct Connections {
    live: Arc<Live>,
    close: watch::Sender<bool>,
}

#[derive(Debug, Default)]
pub(crate) struct Live {
    count: std::sync::atomic::AtomicUsize,
    /// The calls of every connection not yet let go (their futures or answers, which run in
    /// tasks of their own and hold what the services hold: the store, for the admin API's).
    calls: std::sync::atomic::AtomicUsize,
    /// Set with the signal: read on every read and write (no lock), the signal itself only
    /// by one that waits.
    closed: std::sync::atomic::AtomicBool,
    ended: tokio::sync::Notify,
}

/// One live connection of [`Connections`].
struct LiveGuard(Arc<Live>);

impl Drop for LiveGuard {
    fn drop(&mut self) {
        self.0
            .count
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        self.0.ended.notify_waiters();
    }
}

impl Live {
    /// A call of one of the connections begins ([`crate::conn_idle::StreamGuard`]).
    pub(crate) fn call_began(&self) {
        self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }

    /// A call is let go.
    pub(crate) fn call_ended(&self) {
        self.calls.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        self.ended.notify_waiters();
    }
}

impl Default for Connections {
    fn default() -> Self {
        Self {
            live: Arc::default(),
            close: watch::Sender::new(false),
        }
    }
}

impl Connections {
    fn join(&self) -> (LiveGuard, Closing) {
        self.live
            .count
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let mut close = self.close.subscribe();
        let forced = async move {
            // An error means the sender is gone: so is the server.
            let _ = close.wait_for(|close| *close).await;
        };
        (LiveGuard(self.live.clone()), Box::pin(forced))
    }

    /// How many connections are open.
    pub(crate) fn count(&self) -> usize {
        self.live.count.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Closes every connection (reads end, writes fail), and waits up to `within` for their
    /// tasks to let go of them and of their calls. Whether none is left.
    pub(crate) async fn close_all(&self, within: Duration) -> bool {
        self.live
            .closed
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.close.send_replace(true);
        let ended = async {
            loop {
                let notified = self.live.ended.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                if self.count() == 0
                    && self.live.calls.load(std::sync::atomic::Ordering::SeqCst) == 0
                {
                    return;
                }
                notified.await;
            }
        };
        tokio::time::timeout(within, ended).await.is_ok()
    }
}

impl<S> Preface<S> {
    /// Wraps `inner`, watching `shutdown` (true once shutdown has begun); closed once it has
    /// had no open stream for `idle_after` (or [`crate::conn_idle::NO_CALL_IDLE`], if
    /// `guarded` and it has carried no call yet).
    pub(crate) fn new(
        inner: S,
        mut shutdown: watch::Receiver<bool>,
        idle_after: Duration,
        guarded: bool,
        connections: &Connections,
    ) -> Self {
        let (live, forced) = connections.join();
        let accepted = Instant::now();
        let too_late = accepted + PREFACE_TIMEOUT;
        let closing = async move {
            let shutting_down = async {
                // An error means the sender is gone: the server is going away too.
                let _ = shutdown.wait_for(|stop| *stop).await;
                tokio::time::sleep(PREFACE_GRACE).await;
            };
            tokio::select! {
                () = shutting_down => {}
                () = tokio::time::sleep_until(too_late) => {}
            }
        };
        Self {
            inner,
            read: 0,
            closing: Some(Box::pin(closing)),
            closed: false,
            streams: Arc::new(
                Streams::new(accepted)
                    .counted_in(connections.live.clone())
                    .guarded(guarded),
            ),
            idle_after: idle_after.min(crate::conn_idle::LONGEST),
            idle: None,
            io: 0,
            io_seen: 0,
            quiet_turns: 0,
            forced: Some(forced),
            live,
            _place: None,
        }
    }

    /// Holds `place` (one of its listener's) until the connection is dropped.
    pub(crate) fn holding(mut self, place: Option<tokio::sync::OwnedSemaphorePermit>) -> Self {
        self._place = place;
        self
    }

    /// Listed in `evictable`, so that a full listener may close it while no token has admitted
    /// a call on it (see [`crate::places::Evictable`]).
    pub(crate) fn evictable_in(self, evictable: Option<&crate::places::Evictable>) -> Self {
        if let Some(evictable) = evictable {
            evictable.push(&self.streams);
        }
        self
    }

    /// Whether the connection was evicted: checked before each read, and, while it may still
    /// be (guarded, and no call admitted yet), its waiting read is woken by an eviction.
    fn evicted_while_waiting(&self, cx: &mut Context<'_>) -> bool {
        if self.streams.is_evicted() {
            return true;
        }
        // Only a connection a full listener may still evict waits for it.
        self.streams.is_guarded()
            && !self.streams.is_admitted()
            && self.streams.wake_on_eviction(cx.waker())
    }

    /// Whether the server has closed every connection (see [`Connections`]).
    fn forced(&self) -> bool {
        self.forced.is_none() || self.live.0.closed.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// [`Preface::forced`] for a read or write that waits: the signal is polled with it, so
    /// that it wakes the connection's task.
    fn forced_while_waiting(&mut self, cx: &mut Context<'_>) -> bool {
        let Some(forced) = &mut self.forced else {
            return true;
        };
        // Outside the task's coop budget: polled with every read or write that waits, it would
        // otherwise spend the connection task's budget and make it yield mid-flush.
        if Pin::new(&mut tokio::task::coop::unconstrained(forced.as_mut()))
            .poll(cx)
            .is_pending()
        {
            return false;
        }
        self.forced = None;
        true
    }

    /// Whether the connection has had no open stream for `idle_after`, and moved no byte for
    /// [`QUIET_IO`] (the timer's last turn); otherwise the timer is set for when it may have,
    /// and registered with `cx`.
    fn quiet_too_long(&mut self, cx: &mut Context<'_>) -> bool {
        // Read at each turn: a first admitted call lengthens it.
        let idle_after = self.streams.idle_after(self.idle_after);
        let timer = self
            .idle
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(idle_after)));
        // Bounded: each turn either ends or sets the timer later than now. (Outside the coop
        // budget, as above: polled with every read that waits.)
        while Pin::new(&mut tokio::task::coop::unconstrained(timer.as_mut()))
            .poll(cx)
            .is_ready()
        {
            let now = Instant::now();
            match self.streams.quiet_for(now) {
                Some(quiet) if quiet >= idle_after => {
                    if self.io == self.io_seen || self.quiet_turns >= MAX_QUIET_TURNS {
                        return true;
                    }
                    // Bytes moved since the last turn: one more, a moment of silence later.
                    self.io_seen = self.io;
                    self.quiet_turns += 1;
                    timer.as_mut().reset(now + QUIET_IO);
                }
                Some(quiet) => {
                    self.quiet_turns = 0;
                    timer.as_mut().reset(now + (idle_after - quiet));
                }
                None => {
                    self.quiet_turns = 0;
                    timer.as_mut().reset(now + idle_after);
                }
            }
        }
        false
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Preface<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.closed || this.forced() || this.streams.is_evicted() {
            // End of stream: nothing is put in `buf`.
            return Poll::Ready(Ok(()));
        }
        // The socket first: bytes already there are read, however late this task runs.
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.inner).poll_read(cx, buf);
        if polled.is_pending() && (this.forced_while_waiting(cx) || this.evicted_while_waiting(cx))
        {
            this.closed = true;
            return Poll::Ready(Ok(()));
        }
        if buf.filled().len() > before {
            this.io = this.io.wrapping_add(1);
        }
        let Some(closing) = &mut this.closing else {
            // The preface is in: the connection is closed once it has had no stream for
            // `idle_after` and nothing waits to be read.
            if polled.is_pending() && this.quiet_too_long(cx) {
                this.closed = true;
                return Poll::Ready(Ok(()));
            }
            return polled;
        };
        if polled.is_ready() {
            this.read = this
                .read
                .saturating_add(buf.filled().len().saturating_sub(before));
            if this.read >= PREFACE_LEN {
                this.closing = None;
            }
            return polled;
        }
        // Nothing to read: polled with the read, so the signal wakes a read that waits.
        if closing.as_mut().poll(cx).is_ready() {
            this.closing = None;
            this.closed = true;
            return Poll::Ready(Ok(()));
        }
        polled
    }
}

/// What a write to a connection the server has closed gets (at the end of its shutdown, or
/// to make room on a full listener).
fn closed_by_server() -> io::Error {
    io::Error::new(
        io::ErrorKind::BrokenPipe,
        "the control plane closed the connection",
    )
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Preface<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.forced() || this.streams.is_evicted() {
            return Poll::Ready(Err(closed_by_server()));
        }
        let polled = Pin::new(&mut this.inner).poll_write(cx, buf);
        if polled.is_pending() && (this.forced_while_waiting(cx) || this.evicted_while_waiting(cx))
        {
            return Poll::Ready(Err(closed_by_server()));
        }
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            this.io = this.io.wrapping_add(1);
        }
        polled
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.forced() || this.streams.is_evicted() {
            return Poll::Ready(Err(closed_by_server()));
        }
        let polled = Pin::new(&mut this.inner).poll_flush(cx);
        if polled.is_pending() && (this.forced_while_waiting(cx) || this.evicted_while_waiting(cx))
        {
            return Poll::Ready(Err(closed_by_server()));
        }
        polled
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
        if this.forced() || this.streams.is_evicted() {
            return Poll::Ready(Err(closed_by_server()));
        }
        let polled = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        if polled.is_pending() && (this.forced_while_waiting(cx) || this.evicted_while_waiting(cx))
        {
            return Poll::Ready(Err(closed_by_server()));
        }
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            this.io = this.io.wrapping_add(1);
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

impl<S: Connected> Connected for Preface<S> {
    type ConnectInfo = Conn<S::ConnectInfo>;

    fn connect_info(&self) -> Self::ConnectInfo {
        Conn {
            inner: self.inner.connect_info(),
            streams: self.streams.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    use super::*;

    /// The shutdown signal of [`pair`], with the listener's connections (their signal is
    /// gone, so they would read as closed, once these are dropped).
    struct Stop {
        shutdown: watch::Sender<bool>,
        connections: Connections,
    }

    impl Stop {
        fn send_replace(&self, stop: bool) {
            self.shutdown.send_replace(stop);
        }
    }

    /// A wrapped in-memory connection, its client end, and the shutdown signal.
    fn pair() -> (
        Preface<tokio::io::DuplexStream>,
        tokio::io::DuplexStream,
        Stop,
    ) {
        pair_guarded(false)
    }

    /// [`pair`], on a listener with a tokens file (`guarded`) or not, idle after a day.
    fn pair_guarded(
        guarded: bool,
    ) -> (
        Preface<tokio::io::DuplexStream>,
        tokio::io::DuplexStream,
        Stop,
    ) {
        let (server, client) = tokio::io::duplex(1024);
        let (stop, shutdown) = watch::channel(false);
        let connections = Connections::default();
        (
            Preface::new(
                server,
                shutdown,
                Duration::from_secs(3600 * 24),
                guarded,
                &connections,
            ),
            client,
            Stop {
                shutdown: stop,
                connections,
            },
        )
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_connection_reads_closed_once_the_grace_after_shutdown_has_passed() {
        let (mut server, _client, stop) = pair();
        let mut buf = [0u8; 64];
        let began = tokio::time::Instant::now();
        let read = tokio::spawn(async move { server.read(&mut buf).await });
        tokio::task::yield_now().await;
        stop.send_replace(true);
        assert_eq!(read.await.unwrap().unwrap(), 0, "end of stream");
        assert_eq!(began.elapsed(), PREFACE_GRACE);
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_without_its_preface_is_closed_after_the_timeout_without_a_shutdown() {
        for sent in [0, PREFACE_LEN - 1] {
            let (mut server, mut client, _stop) = pair();
            let accepted = tokio::time::Instant::now();
            client.write_all(&vec![b'P'; sent]).await.unwrap();
            let mut buf = [0u8; 64];
            let mut read = 0;
            loop {
                let n = server.read(&mut buf).await.unwrap();
                if n == 0 {
                    break;
                }
                read += n;
            }
            assert_eq!(read, sent);
            assert_eq!(accepted.elapsed(), PREFACE_TIMEOUT, "sent {sent}");
        }
        // One that sent its preface in time is kept past it.
        let (mut server, mut client, _stop) = pair();
        client.write_all(&[b'P'; PREFACE_LEN]).await.unwrap();
        let mut buf = [0u8; 64];
        assert_eq!(server.read(&mut buf).await.unwrap(), PREFACE_LEN);
        tokio::time::sleep(PREFACE_TIMEOUT * 2).await;
        client.write_all(b"frames").await.unwrap();
        assert_eq!(server.read(&mut buf).await.unwrap(), 6);
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_short_of_its_preface_is_closed_and_stays_closed() {
        let (mut server, mut client, stop) = pair();
        client.write_all(&[b'P'; PREFACE_LEN - 1]).await.unwrap();
        let mut buf = [0u8; 64];
        assert_eq!(server.read(&mut buf).await.unwrap(), PREFACE_LEN - 1);
        // Waiting for the rest, as hyper does, when shutdown begins.
        let read = tokio::spawn(async move {
            let n = server.read(&mut buf).await.unwrap();
            (server, n)
        });
        tokio::task::yield_now().await;
        stop.send_replace(true);
        let (mut server, n) = read.await.unwrap();
        assert_eq!(n, 0, "end of stream");
        client.write_all(b"more").await.unwrap();
        assert_eq!(server.read(&mut buf).await.unwrap(), 0, "still closed");
    }

    #[tokio::test(start_paused = true)]
    async fn bytes_sent_within_the_grace_are_read() {
        let (mut server, mut client, stop) = pair();
        stop.send_replace(true);
        tokio::time::sleep(PREFACE_GRACE / 2).await;
        client.write_all(&[b'P'; PREFACE_LEN]).await.unwrap();
        let mut buf = [0u8; 64];
        assert_eq!(server.read(&mut buf).await.unwrap(), PREFACE_LEN);
        tokio::time::sleep(PREFACE_GRACE).await;
        client.write_all(b"frames").await.unwrap();
        assert_eq!(server.read(&mut buf).await.unwrap(), 6, "the preface is in");
    }

    #[tokio::test(start_paused = true)]
    async fn bytes_that_came_within_the_grace_are_read_even_when_the_read_runs_after_it() {
        let (mut server, mut client, stop) = pair();
        let mut buf = [0u8; 64];
        stop.send_replace(true);
        let mut read = Box::pin(server.read(&mut buf));
        // Polled once as shutdown begins (the grace starts), then not again until after it,
        // as on a runtime too busy to run the connection's task in time.
        std::future::poll_fn(|cx| {
            assert!(read.as_mut().poll(cx).is_pending());
            Poll::Ready(())
        })
        .await;
        tokio::time::sleep(PREFACE_GRACE / 2).await;
        client.write_all(&[b'P'; PREFACE_LEN]).await.unwrap();
        tokio::time::sleep(PREFACE_GRACE).await;
        assert_eq!(read.await.unwrap(), PREFACE_LEN);
    }

    #[tokio::test(start_paused = true)]
    async fn closing_every_connection_ends_reads_and_fails_writes_and_waits_for_them() {
        let (mut server, mut client, stop) = pair();
        client.write_all(&[b'P'; PREFACE_LEN]).await.unwrap();
        let mut buf = [0u8; 64];
        assert_eq!(server.read(&mut buf).await.unwrap(), PREFACE_LEN);
        let connections = stop.connections.clone();
        assert_eq!(connections.count(), 1);
        // Its task still holds it: not let go within the wait.
        let waited = tokio::time::Instant::now();
        assert!(!connections.close_all(Duration::from_secs(1)).await);
        assert_eq!(waited.elapsed(), Duration::from_secs(1));
        client.write_all(b"frames").await.unwrap();
        assert_eq!(server.read(&mut buf).await.unwrap(), 0, "end of stream");
        let refused = server.write_all(b"answer").await.unwrap_err();
        assert_eq!(refused.kind(), io::ErrorKind::BrokenPipe);
        let let_go =
            tokio::spawn(async move { connections.close_all(Duration::from_secs(1)).await });
        tokio::task::yield_now().await;
        drop(server);
        assert!(let_go.await.unwrap(), "the last connection let go");
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_that_sent_its_preface_is_never_closed_by_the_wrapper() {
        let (mut server, mut client, stop) = pair();
        client.write_all(&[b'P'; PREFACE_LEN + 3]).await.unwrap();
        let mut buf = [0u8; 64];
        assert_eq!(server.read(&mut buf).await.unwrap(), PREFACE_LEN + 3);
        stop.send_replace(true);
        tokio::time::sleep(PREFACE_GRACE * 4).await;
        client.write_all(b"frames").await.unwrap();
        assert_eq!(server.read(&mut buf).await.unwrap(), 6);
        server.write_all(b"answer").await.unwrap();
        let mut back = [0u8; 6];
        client.read_exact(&mut back).await.unwrap();
        assert_eq!(&back, b"answer");
    }

    /// On a guarded listener, a connection that has carried no call reads as closed
    /// `NO_CALL_IDLE` after its accept; one with a call (admitted by a token or not: a health
    /// check) is kept past it (to its idle timeout, a day here); on a listener without tokens,
    /// the idle timeout alone counts.
    #[tokio::test(start_paused = true)]
    async fn a_guarded_connection_that_carried_no_call_is_closed_early() {
        use crate::conn_idle::NO_CALL_IDLE;
        for (guarded, call, admitted, closed_early) in [
            (true, false, false, true),
            (true, true, false, false),
            (true, true, true, false),
            (false, false, false, false),
        ] {
            let (mut server, mut client, _stop) = pair_guarded(guarded);
            let accepted = tokio::time::Instant::now();
            client.write_all(&[b'P'; PREFACE_LEN]).await.unwrap();
            let mut buf = [0u8; 64];
            assert_eq!(server.read(&mut buf).await.unwrap(), PREFACE_LEN);
            if call {
                // A call, ended at once: the connection is quiet since then.
                let admission = crate::conn_idle::Admitted::on_streams(server.streams.clone());
                let guard = server
                    .streams
                    .opened(Some(accepted + Duration::from_secs(1)));
                if admitted {
                    admission.admit();
                }
                drop(guard);
            }
            let read = tokio::time::timeout(NO_CALL_IDLE * 2, server.read(&mut buf)).await;
            if closed_early {
                assert_eq!(read.unwrap().unwrap(), 0, "end of stream");
                // One moment of silence more: the preface's bytes moved since the accept.
                assert_eq!(accepted.elapsed(), NO_CALL_IDLE + QUIET_IO);
            } else {
                assert!(
                    read.is_err(),
                    "guarded {guarded}, call {call}, admitted {admitted}: {read:?}"
                );
            }
        }
    }
}
