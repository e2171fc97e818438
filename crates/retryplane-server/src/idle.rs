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

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::{Instant, Sleep};

/// How long a connection of the HTTP listener may stay silent.
pub(crate) const IDLE: Duration = Duration::from_secs(90);

/// The HTTP listener: axum's accept (which waits a second after an error such as too many
/// open files), each connection wrapped in [`Idle`].
pub(crate) struct IdleClosing(pub(crate) TcpListener);

impl axum::serve::Listener for IdleClosing {
    type Io = Idle<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        let (io, addr) = axum::serve::Listener::accept(&mut self.0).await;
        (Idle::new(io), addr)
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.0.local_addr()
    }
}

/// A connection that reads as closed (end of stream) once nothing has been read from it or
/// written to it for [`IDLE`] while a read waits.
pub(crate) struct Idle<S> {
    inner: S,
    /// Fires [`IDLE`] after the last byte read or written.
    quiet: Pin<Box<Sleep>>,
    /// It fired: every read from now on is end of stream.
    closed: bool,
}

impl<S> Idle<S> {
    pub(crate) fn new(inner: S) -> Self {
        Self {
            inner,
            quiet: Box::pin(tokio::time::sleep(IDLE)),
            closed: false,
        }
    }

    fn active(&mut self) {
        self.quiet.as_mut().reset(Instant::now() + IDLE);
    }

    /// `polled`, a write's result, after counting bytes written as activity.
    fn wrote(&mut self, polled: Poll<io::Result<usize>>) -> Poll<io::Result<usize>> {
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.active();
        }
        polled
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
            Poll::Ready(Ok(())) if buf.filled().len() > before => this.active(),
            Poll::Ready(_) => {}
            // Nothing to read: polled with the read, so the timer wakes a read that waits.
            Poll::Pending => {
                if this.quiet.as_mut().poll(cx).is_ready() {
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
        this.wrote(polled)
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
        this.wrote(polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_silent_connection_reads_closed_after_the_idle_time() {
        let (server, _client) = tokio::io::duplex(1024);
        let mut server = Idle::new(server);
        let began = Instant::now();
        let mut buf = [0u8; 16];
        assert_eq!(server.read(&mut buf).await.unwrap(), 0, "end of stream");
        assert_eq!(began.elapsed(), IDLE);
        assert_eq!(server.read(&mut buf).await.unwrap(), 0, "still closed");
    }

    #[tokio::test(start_paused = true)]
    async fn bytes_either_way_keep_a_connection_open() {
        let (server, mut client) = tokio::io::duplex(1024);
        let mut server = Idle::new(server);
        let mut buf = [0u8; 16];
        // Half a request's head, then the rest just before the idle time.
        client.write_all(b"GET /met").await.unwrap();
        assert_eq!(server.read(&mut buf).await.unwrap(), 8);
        tokio::time::sleep(IDLE - Duration::from_secs(1)).await;
        client.write_all(b"rics").await.unwrap();
        assert_eq!(server.read(&mut buf).await.unwrap(), 4);
        // An answer being written counts too.
        tokio::time::sleep(IDLE - Duration::from_secs(1)).await;
        server.write_all(b"200").await.unwrap();
        let began = Instant::now();
        assert_eq!(server.read(&mut buf).await.unwrap(), 0);
        assert_eq!(began.elapsed(), IDLE);
        let mut answer = [0u8; 3];
        client.read_exact(&mut answer).await.unwrap();
    }
}
