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
//! accepts the next once one closes (the rest wait in the kernel's queue, holding no
//! descriptor of the process). And a write its client leaves unread for [`WRITE_STALL`] fails,
//! closing the connection: the answer it held (a `/metrics` page) is let go.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use std::sync::Arc;

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

/// The HTTP listener: axum's accept (which waits a second after an error such as too many
/// open files) once fewer than [`MAX_CONNECTIONS`] are open, each connection wrapped in
/// [`Idle`].
pub(crate) struct IdleClosing {
    listener: TcpListener,
    open: Arc<Semaphore>,
}

impl IdleClosing {
    pub(crate) fn new(listener: TcpListener) -> Self {
        Self::with_limit(listener, MAX_CONNECTIONS)
    }

    fn with_limit(listener: TcpListener, max: usize) -> Self {
        Self {
            listener,
            open: Arc::new(Semaphore::new(max)),
        }
    }
}

impl axum::serve::Listener for IdleClosing {
    type Io = Idle<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        // The semaphore is never closed; should it be, the connection goes uncounted.
        let permit = self.open.clone().acquire_owned().await.ok();
        let (io, addr) = axum::serve::Listener::accept(&mut self.listener).await;
        let mut io = Idle::new(io);
        io.permit = permit;
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
        }
    }

    fn active(&mut self) {
        self.quiet.as_mut().reset(Instant::now() + IDLE);
    }

    /// Bytes were read: activity, and an answer now awaited if none was.
    fn bytes_read(&mut self) {
        self.active();
        if self.unanswered.is_none() || std::mem::take(&mut self.silent) {
            self.unanswered = Some(Box::pin(tokio::time::sleep(UNANSWERED)));
        }
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
                let stalled = self
                    .stalled
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(WRITE_STALL)));
                if stalled.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the client read nothing of the answer for 10 s",
                    )));
                }
            }
            Poll::Ready(Ok(n)) if n > 0 => {
                self.active();
                self.unanswered = None;
                self.stalled = None;
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
        if this.closed {
            return Poll::Ready(Ok(()));
        }
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.inner).poll_read(cx, buf);
        match polled {
            Poll::Ready(Ok(())) if buf.filled().len() > before => this.bytes_read(),
            Poll::Ready(_) => {}
            // Nothing to read: polled with the read, so the timers wake a read that waits.
            Poll::Pending => {
                if this.timed_out(cx) {
                    this.closed = true;
                    return Poll::Ready(Ok(()));
                }
            }
        }
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Idle<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
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

    /// Past its limit the listener accepts the next connection once one is closed.
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
        let wait = Duration::from_millis(200);
        assert!(
            tokio::time::timeout(wait, listener.accept()).await.is_err(),
            "a third connection was accepted"
        );
        drop(first);
        tokio::time::timeout(Duration::from_secs(10), listener.accept())
            .await
            .expect("accepted once one closed");
    }
}
