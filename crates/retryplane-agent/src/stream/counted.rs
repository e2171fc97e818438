//! The agent's connection to the control plane, its bytes read counted in the stream's
//! [`Life`] (see `retryplane_proto::liveness`).
//!
//! The connection is the agent's own (one per session, to the control plane or to a proxy in
//! front of it), so every byte read on it is the other side's: counting them, rather than the
//! response body's data frames, shows a large snapshot coming on a slow link a few bytes at a
//! time, where HTTP/2 would hand the body whole DATA frames of up to 16 KiB. The control plane
//! can then send its shared snapshot frames whole (pieces cost every push a write each).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioIo;
use retryplane_proto::liveness::Life;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tower::ServiceExt as _;

/// A connector for `tonic::transport::Endpoint::connect_with_connector`: plain TCP (with
/// `TCP_NODELAY`, as the endpoint's own connector sets it), its reads counted in `life`.
pub(crate) fn connector(
    life: Life,
) -> impl tower::Service<
    http::Uri,
    Response = TokioIo<Counted<TcpStream>>,
    Error = Box<dyn std::error::Error + Send + Sync>,
    Future = impl Send,
> + Send
+ 'static {
    // As tonic's own connector: any scheme the agent's URL check lets through, and the connect
    // timeout split across a host's addresses (the whole attempt is bounded by the endpoint).
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(Some(super::CONNECT_TIMEOUT));
    tower::service_fn(move |uri: http::Uri| {
        let (http, life) = (http.clone(), life.clone());
        async move {
            let io = http.oneshot(uri).await?;
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(TokioIo::new(Counted {
                inner: io.into_inner(),
                life,
            }))
        }
    })
}

/// An IO whose reads are counted in a [`Life`].
#[derive(Debug)]
pub(crate) struct Counted<T> {
    inner: T,
    life: Life,
}

impl<T: AsyncRead + Unpin> AsyncRead for Counted<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut me.inner).poll_read(cx, buf);
        let read = buf.filled().len().saturating_sub(before);
        if read > 0 {
            me.life.received(u64::try_from(read).unwrap_or(u64::MAX));
        }
        polled
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Counted<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}
