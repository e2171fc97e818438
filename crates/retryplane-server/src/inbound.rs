//! What one agent stream may make the control plane hold: its messages' sizes, checked at
//! their 5-byte gRPC headers.
//!
//! tonic's decoder reserves a message's length at its header, keeps its bytes until the whole
//! message has come, and keeps that buffer, at its largest, while the stream lives; hyper hands
//! the flow-control window back as soon as it passes bytes on. So what a stream may hold is the
//! largest message it may send: one agent token that opened 1,000 streams and began a message
//! of the general 4 MiB limit on each made the server hold 4 GiB. [`Checked`] reads the headers
//! as the stream's bytes pass and refuses, before any of the message is kept:
//! - a first message (the Hello) over [`MAX_HELLO_MESSAGE_BYTES`];
//! - any later message over the route's limit (at most
//!   [`MAX_AGENT_MESSAGE_BYTES`](retryplane_proto::MAX_AGENT_MESSAGE_BYTES): an agent's
//!   largest report and its envelope).
//!
//! Hand-written: tonic takes one limit for every message of a stream; the header scan is the
//! gRPC framing (`tonic::codec` reads the same five bytes).

use std::error::Error as StdError;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tonic::Status;

/// The largest first message an agent stream takes: a Hello at the limits the control plane
/// checks (64 labels of 256 bytes, fields of 256) is about 35 KB.
pub const MAX_HELLO_MESSAGE_BYTES: u32 = 64 * 1024;

/// Length of a gRPC message header: a compressed flag and a big-endian length.
const HEADER: usize = 5;

/// `body`, the inbound body of one agent stream, whose messages after the first may be at most
/// `limit` bytes.
pub fn check_headers<B>(body: B, limit: usize) -> Checked<B> {
    Checked {
        inner: body,
        limit: u32::try_from(limit).unwrap_or(u32::MAX),
        first: true,
        header: [0; HEADER],
        filled: 0,
        body_left: 0,
    }
}

/// An agent stream's inbound body whose message sizes are checked (see the module docs).
#[derive(Debug)]
pub struct Checked<B> {
    inner: B,
    limit: u32,
    /// Whether the next header read is the stream's first message's.
    first: bool,
    header: [u8; HEADER],
    /// Bytes of `header` read so far.
    filled: usize,
    /// Bytes of the current message still to come.
    body_left: u32,
}

/// A stream error as tonic passes it on: the status is found in the error's chain.
type BoxError = Box<dyn StdError + Send + Sync>;

impl<B> Checked<B> {
    /// Scans `data`: an error for a message the stream may not send.
    fn scan(&mut self, data: &[u8]) -> Result<(), Status> {
        let mut at = 0;
        while at < data.len() {
            if self.body_left > 0 {
                let rest = u32::try_from(data.len() - at).unwrap_or(u32::MAX);
                let take = rest.min(self.body_left);
                at += take as usize;
                self.body_left -= take;
                continue;
            }
            self.header[self.filled] = data[at];
            self.filled += 1;
            at += 1;
            if self.filled < HEADER {
                continue;
            }
            self.filled = 0;
            let [_, a, b, c, d] = self.header;
            let len = u32::from_be_bytes([a, b, c, d]);
            let limit = if self.first {
                MAX_HELLO_MESSAGE_BYTES.min(self.limit)
            } else {
                self.limit
            };
            if len > limit {
                let what = if self.first {
                    "the first message (the Hello)"
                } else {
                    "a message"
                };
                return Err(Status::resource_exhausted(format!(
                    "{what} of {len} bytes is over the {limit} bytes this control plane takes"
                )));
            }
            self.first = false;
            self.body_left = len;
        }
        Ok(())
    }
}

impl<B> Body for Checked<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let me = self.get_mut();
        match Pin::new(&mut me.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref()
                    && let Err(status) = me.scan(data)
                {
                    return Poll::Ready(Some(Err(status.into())));
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e.into()))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::task::Waker;

    use http_body_util::{BodyExt as _, StreamBody};
    use tokio::sync::mpsc;
    use tokio_stream::wrappers::ReceiverStream;
    use tonic::Code;

    use super::*;

    type Inbound = StreamBody<ReceiverStream<Result<Frame<Bytes>, Infallible>>>;

    /// A body fed through the returned sender.
    fn inbound() -> (mpsc::Sender<Result<Frame<Bytes>, Infallible>>, Inbound) {
        let (tx, rx) = mpsc::channel(1024);
        (tx, StreamBody::new(ReceiverStream::new(rx)))
    }

    fn header(len: u32) -> Vec<u8> {
        let mut h = vec![0];
        h.extend_from_slice(&len.to_be_bytes());
        h
    }

    /// One poll, with a waker that does nothing.
    fn poll(body: &mut Checked<Inbound>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        Pin::new(body).poll_frame(&mut Context::from_waker(Waker::noop()))
    }

    async fn send(tx: &mpsc::Sender<Result<Frame<Bytes>, Infallible>>, bytes: &[u8]) {
        tx.send(Ok(Frame::data(Bytes::copy_from_slice(bytes))))
            .await
            .unwrap();
    }

    fn status(err: BoxError) -> Status {
        *err.downcast::<Status>().expect("a Status")
    }

    /// Every byte passes unchanged, however the frames cut the headers and the messages.
    #[tokio::test]
    async fn bytes_pass_unchanged_wherever_the_frames_cut_them() {
        let mut wire = Vec::new();
        for len in [3u32, 0, 70, 1, 200] {
            wire.extend(header(len));
            wire.extend((0..len).map(|i| i as u8));
        }
        for cut in [1, 2, 3, 5, 7, 64, wire.len()] {
            let (tx, body) = inbound();
            let mut body = check_headers(body, 1_000);
            for piece in wire.chunks(cut) {
                send(&tx, piece).await;
            }
            drop(tx);
            let mut out = Vec::new();
            while let Some(frame) = body.frame().await {
                out.extend_from_slice(&frame.unwrap().into_data().unwrap());
            }
            assert_eq!(out, wire, "cut every {cut}");
        }
    }

    /// The largest Hello the control plane takes, with every field at its limit, fits.
    #[test]
    fn the_largest_hello_fits_the_first_message_limit() {
        use prost::Message as _;
        use retryplane_proto::pb;
        let field = |c: &str| c.repeat(retryplane_proto::MAX_HELLO_FIELD_BYTES);
        let hello = pb::Hello {
            agent_id: field("a"),
            service: field("s"),
            agent_version: field("v"),
            last_applied_version: u64::MAX,
            last_applied_hash: field("h"),
            instance_id: u64::MAX,
            ephemeral: true,
            heartbeats: true,
            stream: u64::MAX,
            labels: (0..retryplane_proto::MAX_HELLO_LABELS)
                .map(|i| (format!("{i:0>255}"), field("l")))
                .collect(),
        };
        let message = pb::AgentMessage {
            kind: Some(pb::agent_message::Kind::Hello(hello)),
        };
        let len = message.encoded_len();
        assert!(len > 32 << 10, "{len}");
        assert!(len < MAX_HELLO_MESSAGE_BYTES as usize, "{len}");
    }

    /// A first message over the Hello's size, or any message over the route's limit, is
    /// refused at its header, before its bytes come.
    #[tokio::test]
    async fn a_message_over_its_limit_is_refused_at_its_header() {
        let (tx, body) = inbound();
        let mut body = check_headers(body, 4 << 20);
        send(&tx, &header(MAX_HELLO_MESSAGE_BYTES + 1)).await;
        let Poll::Ready(Some(Err(err))) = poll(&mut body) else {
            panic!("refused");
        };
        let err = status(err);
        assert_eq!(err.code(), Code::ResourceExhausted);
        assert_eq!(
            err.message(),
            "the first message (the Hello) of 65537 bytes is over the 65536 bytes this control \
             plane takes"
        );
        let (tx, body) = inbound();
        let mut body = check_headers(body, 4 << 20);
        let mut first = header(MAX_HELLO_MESSAGE_BYTES);
        first.extend(vec![0; MAX_HELLO_MESSAGE_BYTES as usize]);
        first.extend(header((4 << 20) + 1));
        send(&tx, &first).await;
        let Poll::Ready(Some(Err(err))) = poll(&mut body) else {
            panic!("refused");
        };
        assert_eq!(
            status(err).message(),
            "a message of 4194305 bytes is over the 4194304 bytes this control plane takes"
        );
    }
}
