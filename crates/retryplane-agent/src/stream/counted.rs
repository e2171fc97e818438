//! The agent's connection to the control plane, the data it reads counted in the stream's
//! [`Life`] (see `retryplane_proto::liveness`).
//!
//! The connection is the agent's own (one per session, to the control plane or to a proxy in
//! front of it), and carries only the agent's stream. Counting the payload of the HTTP/2 DATA
//! frames as their bytes are read, rather than the response body's frames as HTTP/2 hands them
//! over, shows a large snapshot coming on a slow link a few bytes at a time, where HTTP/2 would
//! hand the body whole DATA frames of up to 16 KiB. The control plane can then send its shared
//! snapshot frames whole (pieces cost every push a write each). Only DATA counts: the other
//! frames (PINGs and their acks, WINDOW_UPDATEs, SETTINGS) are the next hop's, and a proxy in
//! front of a dead control plane goes on sending them.

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
    // One connection per session: tonic's channel dials again, at once, when its connection
    // fails under the stream's opening (its `Reconnect` goes back to idle and connects within
    // the same request), so one try of a session made two connections with no pause between
    // them, against a control plane (or a balancer in front of it) that takes connections and
    // closes them. The session ends instead, and the next one comes after the backoff.
    let dialled = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    tower::service_fn(move |uri: http::Uri| {
        let (http, life) = (http.clone(), life.clone());
        let again = dialled.swap(true, std::sync::atomic::Ordering::Relaxed);
        async move {
            if again {
                return Err(
                    "the session's connection is gone; the next session connects again".into(),
                );
            }
            let io = http.oneshot(uri).await?;
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(TokioIo::new(Counted {
                inner: io.into_inner(),
                life,
                frames: DataBytes::default(),
            }))
        }
    })
}

/// An IO whose reads' DATA payload is counted in a [`Life`].
#[derive(Debug)]
pub(crate) struct Counted<T> {
    inner: T,
    life: Life,
    frames: DataBytes,
}

/// Finds the payload of HTTP/2 DATA frames in the bytes a client reads: from the connection's
/// first byte (the server's preface is a SETTINGS frame), a 9-byte header (24-bit payload
/// length, type, flags, stream) before each payload. Written here because h2 does not expose
/// its frame codec, and only the header's length and type are needed; h2 itself checks the
/// frames (one it refuses ends the connection, and this count with it).
#[derive(Debug, Default)]
struct DataBytes {
    /// The current frame header, as far as it has come.
    header: [u8; 9],
    /// How many of its bytes have come.
    header_len: usize,
    /// Payload bytes of the current frame still to come.
    payload_left: usize,
    /// Whether the current frame is a DATA frame.
    data: bool,
}

/// The type of a DATA frame (RFC 9113, section 6.1).
const DATA: u8 = 0x0;

impl DataBytes {
    /// Takes the next bytes read; returns how many of them are DATA payload.
    fn feed(&mut self, mut bytes: &[u8]) -> usize {
        let mut counted = 0;
        while !bytes.is_empty() {
            if self.payload_left > 0 {
                let n = self.payload_left.min(bytes.len());
                if self.data {
                    counted += n;
                }
                self.payload_left -= n;
                bytes = &bytes[n..];
                continue;
            }
            let n = (self.header.len() - self.header_len).min(bytes.len());
            self.header[self.header_len..self.header_len + n].copy_from_slice(&bytes[..n]);
            self.header_len += n;
            bytes = &bytes[n..];
            if self.header_len == self.header.len() {
                let [a, b, c, kind, ..] = self.header;
                self.payload_left = usize::from(a) << 16 | usize::from(b) << 8 | usize::from(c);
                self.data = kind == DATA;
                self.header_len = 0;
            }
        }
        counted
    }
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
        let data = buf
            .filled()
            .get(before..)
            .map_or(0, |read| me.frames.feed(read));
        if data > 0 {
            me.life.received(u64::try_from(data).unwrap_or(u64::MAX));
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A frame: header (length, type, flags 0, stream 1) and `len` payload bytes.
    fn frame(kind: u8, len: usize) -> Vec<u8> {
        let mut f = vec![0; 9 + len];
        f[..3].copy_from_slice(&u32::try_from(len).unwrap().to_be_bytes()[1..]);
        f[3] = kind;
        f[8] = 1;
        f
    }

    #[test]
    fn only_data_payload_counts_however_the_reads_split_it() {
        let settings = frame(0x4, 18);
        let ping = frame(0x6, 8);
        let headers = frame(0x1, 40);
        let data = frame(DATA, 70_000);
        let empty = frame(DATA, 0);
        let window = frame(0x8, 4);
        let bytes = [
            &settings[..],
            &ping,
            &headers,
            &data,
            &window,
            &empty,
            &data,
            &ping,
        ]
        .concat();
        for step in [1, 2, 8, 9, 10, 17, 4096, bytes.len()] {
            let mut frames = DataBytes::default();
            let counted: usize = bytes.chunks(step).map(|read| frames.feed(read)).sum();
            assert_eq!(counted, 140_000, "reads of {step} bytes");
        }
    }

    #[test]
    fn data_counts_as_it_comes() {
        let mut frames = DataBytes::default();
        let data = frame(DATA, 100);
        assert_eq!(frames.feed(&data[..9]), 0);
        assert_eq!(frames.feed(&data[9..50]), 41);
        assert_eq!(frames.feed(&data[50..]), 59);
        assert_eq!(frames.feed(&frame(0x6, 8)), 0);
    }

    #[test]
    fn the_largest_frame_length_is_read_whole() {
        let mut frames = DataBytes::default();
        let header = [0xff, 0xff, 0xff, DATA, 0, 0, 0, 0, 1];
        assert_eq!(frames.feed(&header), 0);
        assert_eq!(frames.payload_left, (1 << 24) - 1);
    }
}
