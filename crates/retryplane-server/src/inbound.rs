//! An agent stream's inbound messages, read from its body here rather than by tonic's decoder:
//! what one stream may make the control plane hold is the bytes it has sent of the message
//! under way, and no more.
//!
//! tonic's decoder (`tonic::codec::Streaming`) reserves a message's announced length at its
//! 5-byte gRPC header, and keeps that buffer, at its largest, while the stream lives: one agent
//! token that opened 1,000 streams and announced a message of the general 4 MiB limit on each
//! made the server reserve 4 GiB, and an agent that once sent a large report kept its buffer
//! for its stream's life. [`Messages`] instead:
//! - checks each header as it comes, and refuses, before any of the message is kept, a first
//!   message (the Hello) over [`MAX_HELLO_MESSAGE_BYTES`], any later one over the route's limit
//!   (at most [`MAX_AGENT_MESSAGE_BYTES`](retryplane_proto::MAX_AGENT_MESSAGE_BYTES): an
//!   agent's largest report and its envelope), and a compressed-flag other than 0 (no
//!   compression is enabled);
//! - keeps a message's bytes as they come (a buffer that grows with what was received, at most
//!   to twice that as it doubles and never past the announced length), decodes it once whole
//!   (from the frame itself when one frame holds it all), and lets the buffer go; a frame
//!   read to its end is let go at once (it may share a larger read buffer), and so is all of
//!   it when the stream ends;
//! - keeps a message's bytes only with room for them, when the stream was given a [`Room`]:
//!   a message's buffer (after the Hello's) takes what it grows by from the room for all
//!   agents' messages under way (and from its token's share of it), and gives it back once the
//!   message is whole; a
//!   message whose next bytes find no room ends its stream with `RESOURCE_EXHAUSTED` (its agent
//!   reconnects and sends it again). This bounds what all streams together hold, where each
//!   stream's limit bounds only its own: 1,000 streams of one token that each sent most of a
//!   1 MiB message and stopped held about 1 GiB.
//!
//! Its statuses are those of the generated server, the sender's faults named as such: a
//! message over its limit `RESOURCE_EXHAUSTED`; bytes that do not decode, or a compressed-flag
//! other than 0 or 1, `INVALID_ARGUMENT`; flag 1 on a stream without `grpc-encoding`
//! `INTERNAL`, as gRPC's compression spec asks; a body that ends within a message (its header
//! included, or with trailers) `INTERNAL` (tonic ended some of these cleanly, and said
//! "Unexpected EOF decoding stream." of the others); the body's own errors as tonic reads them
//! ([`Status::from_error`]), a reset by the agent (`CANCELLED`) read as the stream's end.
//!
//! Hand-written: this is the gRPC message framing (`tonic::codec` reads the same five bytes),
//! which tonic offers only with its own buffering, and its one limit for every message.

use std::collections::HashMap;
use std::error::Error as StdError;
use std::future::poll_fn;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::{Buf as _, Bytes};
use http_body::Body;
use http_body_util::BodyExt as _;
use http_body_util::combinators::UnsyncBoxBody;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prost::Message as _;
use retryplane_proto::pb;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tonic::Status;
use tracing::{debug, warn};

/// The largest first message an agent stream takes: a Hello at the limits the control plane
/// checks (64 labels of 256 bytes, fields of 256) is about 35 KB.
pub const MAX_HELLO_MESSAGE_BYTES: u32 = 64 * 1024;

/// How the refusal of a message's 5-byte header begins (the sender's fault, logged as such).
pub(crate) const BAD_HEADER: &str = "invalid gRPC message header";

/// Length of a gRPC message header: a compressed flag and a big-endian length.
const HEADER: usize = 5;

/// A stream error as the body gives it.
type BoxError = Box<dyn StdError + Send + Sync>;

/// The default of [`crate::agent_stream::StreamLimits::max_inbound_bytes`]: 256 MiB of
/// agents' messages under way at once, over all streams (about 240 agents in the middle of
/// their largest report at the same moment; a report of 10 endpoints is about 2 KB, and most
/// messages come in one frame, holding none of it).
pub const DEFAULT_MAX_INBOUND_BYTES: usize = 256 << 20;

/// How a refusal for want of room begins (the control plane's load, not the agent's fault).
pub(crate) const NO_ROOM: &str = "no room for this message under way";

/// How often at most a refusal for want of room is logged at warn (the rest at debug, counted
/// in `retryplane_server_inbound_refused_total`).
const NO_ROOM_WARN_INTERVAL: Duration = Duration::from_secs(10);

/// Room for the agents' messages under way, over all agent streams: the buffers of messages
/// that come in more than one frame, charged as they grow with the bytes that came (so room is
/// held only for bytes an agent has sent; see the module docs). One agent token takes at most
/// all but a quarter of it (and at least the largest message), so that one token's streams
/// that each send most of a message and stop cannot take it all. Streams without a token (no
/// tokens file) share the whole.
///
/// A message whose next bytes find no room ends its stream at once with
/// `RESOURCE_EXHAUSTED`, and its agent reconnects and sends it again: the stream is not made
/// to wait, since a stream not read holds its HTTP/2 connection's window, which other streams
/// on the connection (agents behind one proxy) share, the stream that would give the room back
/// among them.
#[derive(Debug)]
pub struct Room {
    whole: Arc<Semaphore>,
    /// The room in bytes.
    bytes: usize,
    /// One token's most.
    share: usize,
    /// Each token's share, by the digest of its secret (one per token ever admitted: tokens are
    /// few, and each is a few words).
    by_token: Mutex<HashMap<[u8; 32], Arc<Share>>>,
    counts: RoomCounts,
    /// Refusals for want of the whole room, logged at warn at most once an interval.
    warned: Warned,
}

/// One token's share of the [`Room`].
#[derive(Debug)]
struct Share {
    room: Arc<Semaphore>,
    /// Refusals past this share, logged at warn at most once an interval.
    warned: Warned,
}

/// When a refusal was last logged at warn, and the refusals left out since.
#[derive(Debug, Default)]
struct Warned(Mutex<(Option<Instant>, u64)>);

impl Warned {
    /// A refusal at `now`: `None` when it is left out of the log (one was logged less than
    /// [`NO_ROOM_WARN_INTERVAL`] ago), else how many were left out since the last one logged,
    /// and how long ago that was.
    fn note(&self, now: Instant) -> Option<(u64, Option<Duration>)> {
        let mut warned = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        match warned.0 {
            Some(at) if now.saturating_duration_since(at) < NO_ROOM_WARN_INTERVAL => {
                warned.1 += 1;
                None
            }
            last => {
                let left_out = (warned.1, last.map(|at| now.saturating_duration_since(at)));
                *warned = (Some(now), 0);
                Some(left_out)
            }
        }
    }
}

/// What [`Room`] shows in `/metrics`.
#[derive(Clone, Debug, Default)]
pub struct RoomCounts {
    /// Bytes held for messages under way.
    pub held: Gauge,
    /// Streams ended because their message's next bytes found no room.
    pub refused: Counter,
}

impl Room {
    /// Room for `bytes` of messages under way, raised to `largest` (the largest message a
    /// stream takes, so that one always fits).
    pub fn new(bytes: usize, largest: usize, counts: RoomCounts) -> Self {
        let bytes = bytes.max(largest).min(Semaphore::MAX_PERMITS);
        let share = (bytes - bytes.div_ceil(4)).max(largest);
        Self {
            whole: Arc::new(Semaphore::new(bytes)),
            bytes,
            share,
            by_token: Mutex::default(),
            counts,
            warned: Warned::default(),
        }
    }

    /// What a stream admitted with the secret of `token` (`None`: no tokens file), of the token
    /// named `name`, charges its messages to.
    pub fn for_stream(self: &Arc<Self>, token: Option<[u8; 32]>, name: Option<String>) -> Charger {
        let token = token.map(|digest| {
            let mut by_token = self.by_token.lock().unwrap_or_else(PoisonError::into_inner);
            by_token
                .entry(digest)
                .or_insert_with(|| {
                    Arc::new(Share {
                        room: Arc::new(Semaphore::new(self.share)),
                        warned: Warned::default(),
                    })
                })
                .clone()
        });
        Charger {
            room: self.clone(),
            token,
            name,
        }
    }

    /// The refusal of `bytes` more for a message of `len` of a stream of the token `name`
    /// (past that token's `share` when given, else past the whole room), counted, and logged
    /// at warn at most once every [`NO_ROOM_WARN_INTERVAL`] for the whole room and for each
    /// token's share (with the count of those left out since the last warning and how long
    /// ago that was).
    fn refuse(&self, bytes: u32, len: usize, share: Option<&Share>, name: Option<&str>) -> Status {
        self.counts.refused.inc();
        let left_out = share
            .map_or(&self.warned, |share| &share.warned)
            .note(Instant::now());
        let token = name.unwrap_or("");
        let whose = if share.is_some() {
            format!("its token's share ({} bytes)", self.share)
        } else {
            format!("the room ({} bytes)", self.bytes)
        };
        match left_out {
            Some((left_out, since)) => warn!(
                token,
                left_out,
                since_last_warning_s = since.map(|d| d.as_secs()),
                "ending an agent stream: agents' messages under way fill {whose} \
                 (--max-inbound-mib); the agent sends it again on its next stream"
            ),
            None => debug!(
                token,
                "ending an agent stream: agents' messages under way fill {whose}"
            ),
        }
        Status::resource_exhausted(format!(
            "{NO_ROOM}: {bytes} more bytes of a message of {len} would pass {whose} that the \
             control plane holds for agents' messages under way; send it again later"
        ))
    }
}

/// One stream's way to [`Room`].
#[derive(Debug)]
pub struct Charger {
    room: Arc<Room>,
    token: Option<Arc<Share>>,
    /// The token's name, for the log.
    name: Option<String>,
}

/// Room held for one message's buffer; given back when dropped.
#[derive(Debug)]
struct Held {
    token: Option<OwnedSemaphorePermit>,
    whole: OwnedSemaphorePermit,
    bytes: u32,
    gauge: Gauge,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.gauge.dec_by(i64::from(self.bytes));
    }
}

impl Charger {
    /// `bytes` more for the message of `len` whose buffer `held` is: added to it, or the
    /// refusal that ends the stream.
    fn charge(&self, held: &mut Option<Held>, bytes: u32, len: usize) -> Result<(), Status> {
        let token = match &self.token {
            Some(share) => Some(share.room.clone().try_acquire_many_owned(bytes).map_err(
                |_| {
                    self.room
                        .refuse(bytes, len, Some(share), self.name.as_deref())
                },
            )?),
            None => None,
        };
        let whole = self
            .room
            .whole
            .clone()
            .try_acquire_many_owned(bytes)
            .map_err(|_| self.room.refuse(bytes, len, None, self.name.as_deref()))?;
        self.room.counts.held.inc_by(i64::from(bytes));
        match held {
            Some(held) => {
                if let (Some(mine), Some(more)) = (&mut held.token, token) {
                    mine.merge(more);
                }
                held.whole.merge(whole);
                held.bytes = held.bytes.saturating_add(bytes);
            }
            None => {
                *held = Some(Held {
                    token,
                    whole,
                    bytes,
                    gauge: self.room.counts.held.clone(),
                });
            }
        }
        Ok(())
    }
}

/// The messages of one agent stream's inbound body, whose messages after the first may be at
/// most `limit` bytes (see the module docs).
pub struct Messages {
    body: UnsyncBoxBody<Bytes, BoxError>,
    limit: u32,
    /// Whether the next header read is the stream's first message's.
    first: bool,
    /// Whether the message under way is the first (the Hello): it takes no room, bounded as it
    /// is by [`MAX_HELLO_MESSAGE_BYTES`] and the streams that may wait for their Hello.
    hello_under_way: bool,
    header: [u8; HEADER],
    /// Bytes of `header` read so far.
    filled: usize,
    /// The message under way: its length, and its bytes so far (none while it is read from one
    /// frame at a time and none has come yet).
    current: Option<(usize, Vec<u8>)>,
    /// What the last data frame holds that is not read yet.
    pending: Bytes,
    /// The stream has ended, or failed: nothing more is read.
    done: bool,
    /// Where its messages' bytes are charged (none: held without a bound but their limit).
    charger: Option<Charger>,
    /// The room the buffer of the message under way holds.
    held: Option<Held>,
}

impl std::fmt::Debug for Messages {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Messages")
            .field("limit", &self.limit)
            .field("first", &self.first)
            .field(
                "under_way",
                &self.current.as_ref().map(|(len, b)| (*len, b.len())),
            )
            .field("done", &self.done)
            .field("held", &self.held.as_ref().map(|h| h.bytes))
            .finish_non_exhaustive()
    }
}

impl Messages {
    /// The messages of `body`; after the first, each may be at most `limit` bytes.
    pub fn new<B>(body: B, limit: usize) -> Self
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        Self {
            body: body.map_err(Into::into).boxed_unsync(),
            limit: u32::try_from(limit).unwrap_or(u32::MAX),
            first: true,
            hello_under_way: false,
            header: [0; HEADER],
            filled: 0,
            current: None,
            pending: Bytes::new(),
            done: false,
            charger: None,
            held: None,
        }
    }

    /// These messages, each holding its bytes under way only with room from `charger` (see
    /// [`Room`]).
    #[must_use]
    pub fn charging(mut self, charger: Charger) -> Self {
        self.charger = Some(charger);
        self
    }

    /// The next message; `Ok(None)` once the agent has ended its side of the stream (or reset
    /// it). An error ends the stream: it is given once, and `Ok(None)` after it. Cancel-safe:
    /// what was read stays here.
    pub async fn message(&mut self) -> Result<Option<pb::AgentMessage>, Status> {
        poll_fn(|cx| self.poll_message(cx)).await
    }

    fn poll_message(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Option<pb::AgentMessage>, Status>> {
        loop {
            if self.done {
                return Poll::Ready(Ok(None));
            }
            match self.take_from_pending() {
                Ok(Some(message)) => return Poll::Ready(Ok(Some(message))),
                Ok(None) => {}
                Err(status) => {
                    self.end();
                    return Poll::Ready(Err(status));
                }
            }
            match ready!(Pin::new(&mut self.body).poll_frame(cx)) {
                Some(Ok(frame)) => {
                    // Trailers (a client's, which gRPC does not send) are passed over.
                    if let Ok(data) = frame.into_data() {
                        self.pending = data;
                    }
                }
                Some(Err(error)) => {
                    self.end();
                    let status = Status::from_error(error);
                    // The agent reset its stream: its end, as tonic reads a request's.
                    if status.code() == tonic::Code::Cancelled {
                        return Poll::Ready(Ok(None));
                    }
                    return Poll::Ready(Err(status));
                }
                None => {
                    let within = self.filled > 0 || self.current.is_some();
                    self.end();
                    if within {
                        return Poll::Ready(Err(Status::internal(
                            "the stream ended within a message",
                        )));
                    }
                    return Poll::Ready(Ok(None));
                }
            }
        }
    }

    /// Whether the stream has ended (the agent's end, a reset, or an error given already):
    /// nothing more is read.
    pub fn ended(&self) -> bool {
        self.done
    }

    /// Marks the stream ended, letting go of what it held.
    fn end(&mut self) {
        self.done = true;
        self.current = None;
        self.pending = Bytes::new();
        self.filled = 0;
        self.held = None;
    }

    /// Reads `pending` on: a message once one is whole, `None` when more bytes are needed.
    /// A frame read to its end is let go (it may share the connection's read buffer).
    fn take_from_pending(&mut self) -> Result<Option<pb::AgentMessage>, Status> {
        let found = self.read_pending();
        if self.pending.is_empty() {
            self.pending = Bytes::new();
        }
        found
    }

    fn read_pending(&mut self) -> Result<Option<pb::AgentMessage>, Status> {
        while !self.pending.is_empty() {
            let Some((len, buf)) = &mut self.current else {
                self.read_header()?;
                if let Some((0, _)) = self.current {
                    self.current = None;
                    return decode(&[]).map(Some);
                }
                continue;
            };
            let len = *len;
            let take = self.pending.len().min(len - buf.len());
            if buf.is_empty() && take == len {
                // The whole message in this frame: decoded where it is.
                let message = self.pending.split_to(len);
                self.current = None;
                return decode(&message).map(Some);
            }
            // Grown with what came, never past the announced length, and only with room for
            // what it grows by.
            if buf.capacity() - buf.len() < take {
                let more = buf.len().max(take).min(len - buf.len());
                let growth = buf.len() + more - buf.capacity();
                if let Some(charger) = self.charger.as_ref().filter(|_| !self.hello_under_way) {
                    let bytes = u32::try_from(growth).unwrap_or(u32::MAX);
                    charger.charge(&mut self.held, bytes, len)?;
                }
                buf.reserve_exact(more);
            }
            buf.extend_from_slice(&self.pending[..take]);
            self.pending.advance(take);
            if buf.len() == len {
                let whole = std::mem::take(buf);
                self.current = None;
                self.held = None;
                return decode(&whole).map(Some);
            }
        }
        Ok(None)
    }

    /// Reads header bytes from `pending`; once the header is whole, checks it and begins its
    /// message.
    fn read_header(&mut self) -> Result<(), Status> {
        let take = self.pending.len().min(HEADER - self.filled);
        self.header[self.filled..self.filled + take].copy_from_slice(&self.pending[..take]);
        self.pending.advance(take);
        self.filled += take;
        if self.filled < HEADER {
            return Ok(());
        }
        self.filled = 0;
        let [flag, a, b, c, d] = self.header;
        let len = u32::from_be_bytes([a, b, c, d]);
        // The flag first, as tonic's decoder checks it: a compressed message is refused for
        // that, whatever its length.
        match flag {
            0 => {}
            // gRPC's compression spec: INTERNAL for a compressed message on a stream whose
            // `grpc-encoding` names none (the route refuses every other encoding).
            1 => {
                return Err(Status::internal(format!(
                    "{BAD_HEADER}: compressed-flag 1 on a stream without compression \
                     (grpc-encoding absent or identity)"
                )));
            }
            other => {
                return Err(Status::invalid_argument(format!(
                    "{BAD_HEADER}: compressed-flag {other}; it must be 0 or 1"
                )));
            }
        }
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
        self.hello_under_way = self.first;
        self.first = false;
        self.current = Some((len as usize, Vec::new()));
        Ok(())
    }
}

/// `bytes` decoded as an `AgentMessage`; `INVALID_ARGUMENT` saying what failed.
fn decode(bytes: &[u8]) -> Result<pb::AgentMessage, Status> {
    pb::AgentMessage::decode(bytes).map_err(|e| {
        Status::invalid_argument(format!("cannot decode the message as an AgentMessage: {e}"))
    })
}

#[cfg(test)]
mod tests {
    use http_body::Frame;
    use http_body_util::StreamBody;
    use retryplane_proto::pb::agent_message::Kind;
    use tokio::sync::mpsc;
    use tokio_stream::wrappers::ReceiverStream;
    use tonic::Code;

    use super::*;

    type Sent = Result<Frame<Bytes>, BoxError>;

    /// A body fed through the returned sender, read as messages after the first of at most
    /// `limit` bytes.
    fn stream_of(limit: usize) -> (mpsc::Sender<Sent>, Messages) {
        let (tx, rx) = mpsc::channel(1024);
        (
            tx,
            Messages::new(StreamBody::new(ReceiverStream::new(rx)), limit),
        )
    }

    fn header(flag: u8, len: u32) -> Vec<u8> {
        let mut h = vec![flag];
        h.extend_from_slice(&len.to_be_bytes());
        h
    }

    fn framed(message: &pb::AgentMessage) -> Vec<u8> {
        let bytes = message.encode_to_vec();
        let mut out = header(0, u32::try_from(bytes.len()).unwrap());
        out.extend(bytes);
        out
    }

    async fn send(tx: &mpsc::Sender<Sent>, bytes: &[u8]) {
        tx.send(Ok(Frame::data(Bytes::copy_from_slice(bytes))))
            .await
            .unwrap();
    }

    fn hello(id: &str) -> pb::AgentMessage {
        pb::AgentMessage {
            kind: Some(Kind::Hello(pb::Hello {
                agent_id: id.into(),
                ..Default::default()
            })),
        }
    }

    fn ack(version: u64, nonce_len: usize) -> pb::AgentMessage {
        pb::AgentMessage {
            kind: Some(Kind::Ack(pb::Ack {
                version,
                nonce: "n".repeat(nonce_len),
            })),
        }
    }

    /// Every message comes out whole, in order, wherever the frames cut the headers and the
    /// messages; an empty message too.
    #[tokio::test]
    async fn messages_come_whole_wherever_the_frames_cut_them() {
        let messages = [
            hello("a"),
            ack(1, 3),
            pb::AgentMessage::default(),
            ack(2, 70),
            ack(3, 0),
        ];
        let wire: Vec<u8> = messages.iter().flat_map(framed).collect();
        for cut in [1, 2, 3, 5, 7, 64, wire.len()] {
            let (tx, mut inbound) = stream_of(1_000);
            for piece in wire.chunks(cut) {
                send(&tx, piece).await;
                // An empty data frame changes nothing.
                send(&tx, &[]).await;
            }
            drop(tx);
            let mut out = Vec::new();
            while let Some(m) = inbound.message().await.unwrap() {
                out.push(m);
            }
            assert_eq!(out, messages, "cut every {cut}");
        }
    }

    /// The largest Hello the control plane takes, with every field at its limit, fits.
    #[test]
    fn the_largest_hello_fits_the_first_message_limit() {
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
            kind: Some(Kind::Hello(hello)),
        };
        let len = message.encoded_len();
        assert!(len > 32 << 10, "{len}");
        assert!(len < MAX_HELLO_MESSAGE_BYTES as usize, "{len}");
    }

    /// A first message over the Hello's size, or any message over the route's limit, is
    /// refused at its header, before its bytes come; the stream then ends.
    #[tokio::test]
    async fn a_message_over_its_limit_is_refused_at_its_header() {
        let (tx, mut inbound) = stream_of(4 << 20);
        send(&tx, &header(0, MAX_HELLO_MESSAGE_BYTES + 1)).await;
        let err = inbound.message().await.unwrap_err();
        assert_eq!(err.code(), Code::ResourceExhausted);
        assert_eq!(
            err.message(),
            "the first message (the Hello) of 65537 bytes is over the 65536 bytes this control \
             plane takes"
        );
        assert_eq!(inbound.message().await.unwrap(), None, "ended");
        let (tx, mut inbound) = stream_of(4 << 20);
        let mut first = framed(&hello("a"));
        first.extend(header(0, (4 << 20) + 1));
        send(&tx, &first).await;
        assert_eq!(inbound.message().await.unwrap(), Some(hello("a")));
        assert_eq!(
            inbound.message().await.unwrap_err().message(),
            "a message of 4194305 bytes is over the 4194304 bytes this control plane takes"
        );
    }

    /// What a message holds while it comes is what came of it, not its announced length; once
    /// whole, nothing of it is kept.
    #[tokio::test]
    async fn a_message_under_way_holds_what_came_not_what_was_announced() {
        let (tx, mut inbound) = stream_of(4 << 20);
        let big = ack(1, 1 << 20);
        let wire = [framed(&hello("a")), framed(&big)].concat();
        let (head, rest) = wire.split_at(framed(&hello("a")).len() + HEADER + 10);
        send(&tx, head).await;
        assert_eq!(inbound.message().await.unwrap(), Some(hello("a")));
        let pending =
            tokio::time::timeout(std::time::Duration::from_millis(50), inbound.message()).await;
        assert!(pending.is_err(), "the message is not whole yet");
        let (len, kept) = inbound.current.as_ref().unwrap();
        assert!(*len > 1 << 20);
        assert!(kept.capacity() <= 64, "{}", kept.capacity());
        for piece in rest.chunks(16 << 10) {
            send(&tx, piece).await;
        }
        assert_eq!(inbound.message().await.unwrap(), Some(big));
        assert!(inbound.current.is_none());
    }

    /// A frame read to its end is let go at once, though the message it began goes on (it may
    /// share a larger read buffer).
    #[tokio::test]
    async fn a_frame_read_to_its_end_is_let_go() {
        let (tx, mut inbound) = stream_of(1_000);
        let wire = [framed(&hello("a")), framed(&ack(1, 100))].concat();
        let cut = framed(&hello("a")).len() + HEADER + 1;
        let head = Bytes::copy_from_slice(&wire[..cut]);
        tx.send(Ok(Frame::data(head.clone()))).await.unwrap();
        assert_eq!(inbound.message().await.unwrap(), Some(hello("a")));
        let pending =
            tokio::time::timeout(std::time::Duration::from_millis(50), inbound.message()).await;
        assert!(pending.is_err(), "the ack is not whole yet");
        assert!(head.is_unique(), "the first frame is still held");
        send(&tx, &wire[cut..]).await;
        assert_eq!(inbound.message().await.unwrap(), Some(ack(1, 100)));
    }

    /// A room of 100 bytes for messages of at most 80 (a token's share: 80, not 75, so that
    /// the largest fits).
    fn room() -> Arc<Room> {
        Arc::new(Room::new(100, 80, RoomCounts::default()))
    }

    /// A stream charging `room` as a stream of `token`'s, its Hello read.
    async fn charged(room: &Arc<Room>, token: Option<u8>) -> (mpsc::Sender<Sent>, Messages) {
        let (tx, inbound) = stream_of(80);
        let mut inbound = inbound.charging(room.for_stream(token.map(|t| [t; 32]), None));
        send(&tx, &framed(&hello("a"))).await;
        assert_eq!(inbound.message().await.unwrap(), Some(hello("a")));
        (tx, inbound)
    }

    /// An ack of `len` bytes in all, framed.
    fn ack_of(len: usize) -> Vec<u8> {
        let message = ack(1, len - 6);
        assert_eq!(message.encoded_len(), len);
        framed(&message)
    }

    /// Whether `inbound` gives no message yet (its bytes so far read).
    async fn under_way(inbound: &mut Messages) -> bool {
        tokio::time::timeout(Duration::from_millis(50), inbound.message())
            .await
            .is_err()
    }

    /// A message that comes in parts holds room for what its buffer grew to with the bytes
    /// that came (never for what it announced), and gives it back once whole; one that comes
    /// whole in a frame holds none.
    #[tokio::test]
    async fn a_message_in_parts_holds_room_for_what_came() {
        let room = room();
        let (a, mut first) = charged(&room, None).await;
        let wire = ack_of(80);
        send(&a, &wire[..20]).await;
        assert!(under_way(&mut first).await);
        assert_eq!(room.counts.held.get(), 15, "the 15 bytes that came");
        send(&a, &wire[20..50]).await;
        assert!(under_way(&mut first).await);
        assert_eq!(room.counts.held.get(), 45);
        // Another's message whole in its frame needs no room, though little is left.
        let (b, mut second) = charged(&room, None).await;
        send(&b, &ack_of(80)).await;
        assert_eq!(second.message().await.unwrap(), Some(ack(1, 74)));
        send(&a, &wire[50..]).await;
        assert_eq!(first.message().await.unwrap(), Some(ack(1, 74)));
        assert_eq!(room.counts.held.get(), 0, "given back once whole");
        assert_eq!(room.counts.refused.get(), 0);
    }

    /// The Hello takes no room, though it comes in parts (it has its own bound).
    #[tokio::test]
    async fn the_hello_takes_no_room() {
        let room = room();
        let (tx, inbound) = stream_of(80);
        let mut inbound = inbound.charging(room.for_stream(None, None));
        let wire = framed(&hello("a-long-agent-id-of-some-length"));
        send(&tx, &wire[..8]).await;
        assert!(under_way(&mut inbound).await);
        assert_eq!(room.counts.held.get(), 0);
        send(&tx, &wire[8..]).await;
        assert_eq!(
            inbound.message().await.unwrap(),
            Some(hello("a-long-agent-id-of-some-length"))
        );
        // The next message in parts does.
        send(&tx, &ack_of(30)[..20]).await;
        assert!(under_way(&mut inbound).await);
        assert_eq!(room.counts.held.get(), 15);
    }

    /// A message whose next bytes find no room ends its stream at once with
    /// `RESOURCE_EXHAUSTED`, holding nothing; a stream that ends gives its room back.
    #[tokio::test]
    async fn a_message_whose_bytes_find_no_room_ends_its_stream() {
        let room = room();
        let (a, mut first) = charged(&room, None).await;
        send(&a, &ack_of(80)[..60]).await;
        assert!(under_way(&mut first).await);
        let (b, mut second) = charged(&room, None).await;
        let of_fifty = ack_of(50);
        send(&b, &of_fifty[..20]).await;
        send(&b, &of_fifty[20..40]).await;
        assert!(under_way(&mut second).await);
        assert_eq!(room.counts.held.get(), 90);
        let (c, mut third) = charged(&room, None).await;
        send(&c, &ack_of(50)[..20]).await;
        let err = third.message().await.unwrap_err();
        assert_eq!(err.code(), Code::ResourceExhausted);
        assert_eq!(
            err.message(),
            "no room for this message under way: 15 more bytes of a message of 50 would pass \
             the room (100 bytes) that the control plane holds for agents' messages under way; \
             send it again later"
        );
        assert_eq!(third.message().await.unwrap(), None, "ended");
        assert_eq!(room.counts.refused.get(), 1);
        assert_eq!(
            room.counts.held.get(),
            90,
            "the refused message held nothing"
        );

        drop(a);
        assert!(first.message().await.is_err(), "ended within a message");
        assert_eq!(room.counts.held.get(), 35);
        send(&b, &of_fifty[40..]).await;
        assert_eq!(second.message().await.unwrap(), Some(ack(1, 44)));
        assert_eq!(room.counts.held.get(), 0);
    }

    /// One token takes at most all but a quarter of the room: another's message finds the
    /// rest.
    #[tokio::test]
    async fn one_token_leaves_a_quarter_of_the_room_to_the_others() {
        let room = room();
        let (a, mut first) = charged(&room, Some(1)).await;
        send(&a, &ack_of(80)[..60]).await;
        assert!(under_way(&mut first).await);
        let (b, mut second) = charged(&room, Some(1)).await;
        send(&b, &ack_of(50)[..35]).await;
        let err = second.message().await.unwrap_err();
        assert_eq!(
            err.message(),
            "no room for this message under way: 30 more bytes of a message of 50 would pass \
             its token's share (80 bytes) that the control plane holds for agents' messages \
             under way; send it again later"
        );
        let (c, mut third) = charged(&room, Some(2)).await;
        let of_forty = ack_of(40);
        send(&c, &of_forty[..25]).await;
        assert!(under_way(&mut third).await);
        assert_eq!(room.counts.held.get(), 75);
        send(&c, &of_forty[25..]).await;
        assert_eq!(third.message().await.unwrap(), Some(ack(1, 34)));
    }

    /// Refusals are warned of at most once an interval for the whole room and for each
    /// token's share, each warning naming its token: a second token past its share is not
    /// left out for the first's.
    #[tokio::test]
    async fn each_tokens_refusals_are_warned_of_apart() {
        let (log, _guard) = crate::test_logs::capture("retryplane_server=warn");
        let room = room();
        let a = room.for_stream(Some([1; 32]), Some("team-a".to_owned()));
        let b = room.for_stream(Some([2; 32]), Some("team-b".to_owned()));
        for charger in [&a, &b, &b, &a, &b] {
            room.refuse(10, 50, charger.token.as_deref(), charger.name.as_deref());
        }
        room.refuse(10, 50, None, Some("team-b"));
        room.refuse(10, 50, None, Some("team-a"));
        assert_eq!(room.counts.refused.get(), 7);
        let text = log.text();
        let warned: Vec<_> = text.lines().filter(|l| l.contains("WARN")).collect();
        assert_eq!(warned.len(), 3, "{text}");
        for (line, token, whose) in [
            (warned[0], "team-a", "its token's share"),
            (warned[1], "team-b", "its token's share"),
            (warned[2], "team-b", "the room"),
        ] {
            assert!(
                line.contains(&format!("token=\"{token}\""))
                    && line.contains(whose)
                    && line.contains("left_out=0")
                    && !line.contains("since_last_warning_s"),
                "{line}"
            );
        }
    }

    /// A compressed-flag other than 0 is refused with the sender's fault named.
    #[tokio::test]
    async fn a_compressed_flag_other_than_zero_is_refused() {
        for (flag, code, says) in [
            (
                1,
                Code::Internal,
                "invalid gRPC message header: compressed-flag 1 on a stream without \
                 compression (grpc-encoding absent or identity)",
            ),
            (
                2,
                Code::InvalidArgument,
                "invalid gRPC message header: compressed-flag 2; it must be 0 or 1",
            ),
        ] {
            // Whatever the length: the flag is read first.
            for len in [0, 1_001] {
                let (tx, mut inbound) = stream_of(1_000);
                send(&tx, &header(flag, len)).await;
                let err = inbound.message().await.unwrap_err();
                assert_eq!((err.code(), err.message()), (code, says), "{len}");
            }
        }
    }

    /// Bytes that do not decode, a body that ends within a message, a body's error, and the
    /// agent's reset (its end).
    #[tokio::test]
    async fn how_a_stream_ends() {
        let (tx, mut inbound) = stream_of(1_000);
        let mut bad = header(0, 2);
        bad.extend([0xff, 0xff]);
        send(&tx, &bad).await;
        let err = inbound.message().await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        assert!(
            err.message()
                .starts_with("cannot decode the message as an AgentMessage: "),
            "{err:?}"
        );

        // Ended within a header, within a message's bytes, or with trailers within a message.
        let hello_bytes = framed(&hello("a"));
        for (cut, trailers) in [
            (4, false),
            (HEADER, false),
            (HEADER + 2, false),
            (HEADER + 2, true),
        ] {
            let (tx, mut inbound) = stream_of(1_000);
            send(&tx, &hello_bytes[..cut]).await;
            if trailers {
                tx.send(Ok(Frame::trailers(http::HeaderMap::new())))
                    .await
                    .unwrap();
            }
            drop(tx);
            let err = inbound.message().await.unwrap_err();
            assert_eq!(
                (err.code(), err.message()),
                (Code::Internal, "the stream ended within a message"),
                "cut at {cut}"
            );
            assert_eq!(inbound.message().await.unwrap(), None);
            assert!(inbound.current.is_none() && inbound.pending.is_empty());
        }
        // After a message that does not decode, the stream has ended.
        let (tx, mut inbound) = stream_of(1_000);
        let mut then = header(0, 2);
        then.extend([0xff, 0xff]);
        then.extend(framed(&hello("a")));
        send(&tx, &then).await;
        assert!(inbound.message().await.is_err());
        assert_eq!(inbound.message().await.unwrap(), None);

        let (tx, mut inbound) = stream_of(1_000);
        tx.send(Err(Box::new(Status::unavailable("gone"))))
            .await
            .unwrap();
        assert_eq!(
            inbound.message().await.unwrap_err().code(),
            Code::Unavailable
        );
        assert_eq!(inbound.message().await.unwrap(), None);

        let (tx, mut inbound) = stream_of(1_000);
        send(&tx, &framed(&hello("a"))).await;
        tx.send(Err(Box::new(Status::cancelled("reset"))))
            .await
            .unwrap();
        assert_eq!(inbound.message().await.unwrap(), Some(hello("a")));
        assert_eq!(inbound.message().await.unwrap(), None);
    }
}
