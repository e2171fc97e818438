//! What an agent stream's unfinished messages may hold: a bound on the server's memory that
//! HTTP/2's flow control does not give.
//!
//! tonic's decoder keeps a message's bytes until the whole message has come, and hyper hands the
//! flow-control window back as soon as it passes bytes on, so a client that announces large
//! messages and never finishes them makes the server hold each one, on as many streams as it may
//! open (one agent token measured 4 GiB on a single connection). [`Metered`] reads the 5-byte
//! gRPC headers of the stream as its bytes pass and, for each message:
//! - refuses a first message (the Hello) over [`MAX_HELLO_MESSAGE_BYTES`] and any message over
//!   the route's limit as soon as its header is read, before any of it is kept;
//! - takes the message's length from a budget shared by every agent stream of the process
//!   ([`InboundBudget`]) before passing its bytes on, and gives it back once the last byte has
//!   passed. While the budget is spent the stream is not read, so flow control holds the sender;
//! - ends the stream when the message is not whole within [`MESSAGE_WITHIN`] of its header.
//!
//! Hand-written: neither tonic nor tower has a per-process bound on bytes held in unfinished
//! messages; the header scan is the gRPC framing (`tonic::codec` reads the same five bytes).

use std::error::Error as StdError;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::{Buf as _, Bytes};
use http_body::{Body, Frame, SizeHint};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Sleep;
use tokio_util::sync::PollSemaphore;
use tonic::Status;

/// The largest first message an agent stream takes: a Hello at the limits the control plane
/// checks (64 labels of 256 bytes, fields of 256) is about 35 KB.
pub const MAX_HELLO_MESSAGE_BYTES: u32 = 64 * 1024;

/// How long a message may take to come whole once its header has come: 30 s, in which a slow
/// link still brings a 4 MiB report at 140 KB/s.
pub const MESSAGE_WITHIN: Duration = Duration::from_secs(30);

/// How many of the largest messages the shared budget holds at once.
pub const BUDGET_MESSAGES: usize = 16;

/// Length of a gRPC message header: a compressed flag and a big-endian length.
const HEADER: usize = 5;

/// The bytes every agent stream of the process may hold in unfinished messages, shared.
#[derive(Clone, Debug)]
pub struct InboundBudget {
    semaphore: Arc<Semaphore>,
    /// The largest message a stream takes (the route's limit).
    max_message: u32,
}

impl InboundBudget {
    /// A budget of [`BUDGET_MESSAGES`] messages of `max_message` bytes (at least one of the
    /// largest fits, so that every message that passes the limit can come).
    pub fn new(max_message: usize) -> Self {
        let max_message = u32::try_from(max_message).unwrap_or(u32::MAX);
        let total = (max_message as usize)
            .saturating_mul(BUDGET_MESSAGES)
            .min(Semaphore::MAX_PERMITS);
        Self {
            semaphore: Arc::new(Semaphore::new(total.max(max_message as usize))),
            max_message,
        }
    }

    /// Bytes not held by any unfinished message now.
    pub fn available(&self) -> usize {
        self.semaphore.available_permits()
    }

    /// `body`, the inbound body of one agent stream, metered against this budget.
    pub fn meter<B>(&self, body: B) -> Metered<B> {
        Metered {
            inner: body,
            semaphore: PollSemaphore::new(self.semaphore.clone()),
            max_message: self.max_message,
            first: true,
            header: [0; HEADER],
            filled: 0,
            body_left: 0,
            permit: None,
            held: None,
            due: None,
        }
    }
}

/// An agent stream's inbound body, metered by an [`InboundBudget`] (see the module docs).
pub struct Metered<B> {
    inner: B,
    semaphore: PollSemaphore,
    max_message: u32,
    /// Whether the next header read is the stream's first message's.
    first: bool,
    header: [u8; HEADER],
    /// Bytes of `header` read so far.
    filled: usize,
    /// Bytes of the current message still to come.
    body_left: u32,
    /// The current message's share of the budget.
    permit: Option<OwnedSemaphorePermit>,
    /// A data frame read but not yet passed on, and how far it has been scanned: it waits
    /// for the budget of a message whose header it holds.
    held: Option<(Bytes, usize)>,
    /// When the current message must be whole.
    due: Option<Pin<Box<Sleep>>>,
}

impl<B> std::fmt::Debug for Metered<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metered")
            .field("first", &self.first)
            .field("body_left", &self.body_left)
            .field("held", &self.held.as_ref().map(|(b, at)| (b.len(), *at)))
            .finish_non_exhaustive()
    }
}

/// A stream error as tonic passes it on: the status is found in the error's chain.
type BoxError = Box<dyn StdError + Send + Sync>;

impl<B> Metered<B> {
    /// Scans `data` from `at`: `Ready(Ok(()))` once it is all scanned (and every message it
    /// starts has its budget), `Pending` while a message's budget is not there (`held` keeps
    /// the place), an error for a message the stream may not send.
    fn scan(
        &mut self,
        cx: &mut Context<'_>,
        data: &Bytes,
        at: &mut usize,
    ) -> Poll<Result<(), Status>> {
        while *at < data.len() {
            if self.body_left > 0 {
                if self.permit.is_none() {
                    match ready!(self.semaphore.poll_acquire_many(cx, self.body_left)) {
                        Some(permit) => self.permit = Some(permit),
                        // The semaphore is never closed.
                        None => return Poll::Ready(Err(Status::unavailable("shutting down"))),
                    }
                }
                let rest = u32::try_from(data.len() - *at).unwrap_or(u32::MAX);
                let take = rest.min(self.body_left);
                *at += take as usize;
                self.body_left -= take;
                if self.body_left == 0 {
                    self.permit = None;
                    self.due = None;
                }
                continue;
            }
            self.header[self.filled] = data[*at];
            self.filled += 1;
            *at += 1;
            if self.filled < HEADER {
                continue;
            }
            self.filled = 0;
            let [_, a, b, c, d] = self.header;
            let len = u32::from_be_bytes([a, b, c, d]);
            let limit = if self.first {
                MAX_HELLO_MESSAGE_BYTES.min(self.max_message)
            } else {
                self.max_message
            };
            if len > limit {
                let what = if self.first {
                    "the first message (the Hello)"
                } else {
                    "a message"
                };
                return Poll::Ready(Err(Status::resource_exhausted(format!(
                    "{what} of {len} bytes is over the {limit} bytes this control plane takes"
                ))));
            }
            self.first = false;
            self.body_left = len;
            if len > 0 {
                self.due = Some(Box::pin(tokio::time::sleep(MESSAGE_WITHIN)));
            }
        }
        Poll::Ready(Ok(()))
    }
}

impl<B> Body for Metered<B>
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
        loop {
            if let Some((data, mut at)) = me.held.take() {
                match me.scan(cx, &data, &mut at) {
                    Poll::Ready(Ok(())) => return Poll::Ready(Some(Ok(Frame::data(data)))),
                    Poll::Ready(Err(status)) => return Poll::Ready(Some(Err(status.into()))),
                    Poll::Pending => {
                        me.held = Some((data, at));
                        // Waiting for the budget is no excuse: the message's time still runs.
                        if let Some(due) = me.due.as_mut()
                            && due.as_mut().poll(cx).is_ready()
                        {
                            return Poll::Ready(Some(Err(late().into())));
                        }
                        return Poll::Pending;
                    }
                }
            }
            match Pin::new(&mut me.inner).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => me.held = Some((data, 0)),
                    Err(frame) => return Poll::Ready(Some(Ok(frame))),
                },
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e.into()))),
                Poll::Ready(None) => return Poll::Ready(None),
                Poll::Pending => {
                    if let Some(due) = me.due.as_mut()
                        && due.as_mut().poll(cx).is_ready()
                    {
                        return Poll::Ready(Some(Err(late().into())));
                    }
                    return Poll::Pending;
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.held.is_none() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let mut hint = self.inner.size_hint();
        if let Some((data, _)) = &self.held {
            let held = data.remaining() as u64;
            hint.set_lower(hint.lower().saturating_add(held));
            if let Some(upper) = hint.upper() {
                hint.set_upper(upper.saturating_add(held));
            }
        }
        hint
    }
}

/// The status of a message not whole within [`MESSAGE_WITHIN`].
fn late() -> Status {
    Status::resource_exhausted(format!(
        "a message did not come whole within {}s of its header",
        MESSAGE_WITHIN.as_secs()
    ))
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
    fn poll(body: &mut Metered<Inbound>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
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

    /// Every byte passes unchanged, however the frames cut the headers and the messages, and
    /// the budget is whole again once the messages are.
    #[tokio::test]
    async fn bytes_pass_unchanged_wherever_the_frames_cut_them() {
        let mut wire = Vec::new();
        for len in [3u32, 0, 70, 1, 200] {
            wire.extend(header(len));
            wire.extend((0..len).map(|i| i as u8));
        }
        let budget = InboundBudget::new(1_000);
        let whole = budget.available();
        for cut in [1, 2, 3, 5, 7, 64, wire.len()] {
            let (tx, body) = inbound();
            let mut body = budget.meter(body);
            for piece in wire.chunks(cut) {
                send(&tx, piece).await;
            }
            drop(tx);
            let mut out = Vec::new();
            while let Some(frame) = body.frame().await {
                out.extend_from_slice(&frame.unwrap().into_data().unwrap());
            }
            assert_eq!(out, wire, "cut every {cut}");
            assert_eq!(budget.available(), whole, "cut every {cut}");
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
        let budget = InboundBudget::new(4 << 20);
        let (tx, body) = inbound();
        let mut body = budget.meter(body);
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
        let mut body = budget.meter(body);
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

    /// Streams that hold the whole budget in unfinished messages keep the next stream's
    /// message from being read until one of theirs is whole.
    #[tokio::test]
    async fn unfinished_messages_past_the_budget_wait_for_it() {
        let budget = InboundBudget::new(100);
        assert_eq!(budget.available(), 100 * BUDGET_MESSAGES);
        let mut holders = Vec::new();
        for _ in 0..BUDGET_MESSAGES {
            let (tx, body) = inbound();
            let mut body = budget.meter(body);
            let mut start = header(100);
            start.push(1);
            send(&tx, &start).await;
            assert!(matches!(poll(&mut body), Poll::Ready(Some(Ok(_)))));
            holders.push((tx, body));
        }
        assert_eq!(budget.available(), 0);
        let (tx, body) = inbound();
        let mut waiting = budget.meter(body);
        let mut start = header(10);
        start.push(7);
        send(&tx, &start).await;
        assert!(poll(&mut waiting).is_pending(), "no budget left");
        assert!(poll(&mut waiting).is_pending());
        // One holder's message comes whole: its 100 bytes go back, 10 of them to the stream
        // that waits.
        let (tx0, body0) = &mut holders[0];
        send(tx0, &[0; 99]).await;
        assert!(matches!(poll(body0), Poll::Ready(Some(Ok(_)))));
        assert_eq!(budget.available(), 90);
        let Poll::Ready(Some(Ok(frame))) = poll(&mut waiting) else {
            panic!("read once the budget is back");
        };
        assert_eq!(frame.into_data().unwrap(), Bytes::from(start));
        assert_eq!(budget.available(), 90);
    }

    /// A message not whole within `MESSAGE_WITHIN` of its header ends the stream, whether the
    /// sender went quiet or the stream waited for the budget.
    #[tokio::test(start_paused = true)]
    async fn a_message_not_whole_in_time_ends_the_stream() {
        let budget = InboundBudget::new(100);
        let (tx, body) = inbound();
        let mut body = budget.meter(body);
        let mut start = header(50);
        start.extend([0; 10]);
        send(&tx, &start).await;
        assert!(matches!(poll(&mut body), Poll::Ready(Some(Ok(_)))));
        assert!(poll(&mut body).is_pending());
        tokio::time::advance(MESSAGE_WITHIN - Duration::from_millis(1)).await;
        send(&tx, &[0; 10]).await;
        assert!(matches!(poll(&mut body), Poll::Ready(Some(Ok(_)))));
        assert!(poll(&mut body).is_pending());
        tokio::time::advance(Duration::from_millis(1)).await;
        let Poll::Ready(Some(Err(err))) = poll(&mut body) else {
            panic!("ended");
        };
        let err = status(err);
        assert_eq!(err.code(), Code::ResourceExhausted);
        assert_eq!(
            err.message(),
            "a message did not come whole within 30s of its header"
        );
        // A whole message in time: the next one's clock starts at its own header.
        let (tx, body) = inbound();
        let mut body = budget.meter(body);
        send(&tx, &header(1)).await;
        send(&tx, &[9]).await;
        assert!(matches!(poll(&mut body), Poll::Ready(Some(Ok(_)))));
        assert!(matches!(poll(&mut body), Poll::Ready(Some(Ok(_)))));
        tokio::time::advance(MESSAGE_WITHIN * 2).await;
        assert!(
            poll(&mut body).is_pending(),
            "between messages, no clock runs"
        );
    }
}
