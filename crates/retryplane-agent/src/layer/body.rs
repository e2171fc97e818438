//! Request bodies the layer can send again (buffered up to a limit, or streamed once) and
//! response bodies it can share ([`ResponseBody`]).

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes};
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt as _;
use retryplane_policy::breaker::CircuitBreaker;
use tokio::time::{Instant, Sleep};

use super::BoxError;
use crate::ready::{BREAKER_RECHECK, refuses_now};

/// The request body the inner service receives: a buffered copy (sent again on every attempt)
/// or, for a body over the limit, the bytes read so far followed by the rest of the original.
pub struct ReplayBody<B> {
    inner: Inner<B>,
}

enum Inner<B> {
    Buffered {
        data: Option<Bytes>,
        trailers: Option<HeaderMap>,
    },
    Streaming {
        prefix: VecDeque<Bytes>,
        rest: Pin<Box<B>>,
    },
}

// Bodies stay out of Debug.
impl<B> std::fmt::Debug for ReplayBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.inner {
            Inner::Buffered { .. } => "buffered",
            Inner::Streaming { .. } => "streaming",
        };
        f.debug_struct("ReplayBody").field("kind", &kind).finish()
    }
}

/// A body read into memory, or found too large to be.
pub(crate) enum Buffered<B> {
    /// The whole body: every attempt gets a copy.
    Replayable(Bytes, Option<HeaderMap>),
    /// Over the limit, or not read by the deadline: sent once.
    Once(ReplayBody<B>),
    /// Not read whole because the call's breaker refuses the call (see [`Refusal`]): the call
    /// gives up with `circuit_open`, nothing sent.
    Refused(ReplayBody<B>),
}

impl<B> ReplayBody<B> {
    pub(crate) fn buffered(data: Bytes, trailers: Option<HeaderMap>) -> Self {
        let data = (!data.is_empty()).then_some(data);
        Self {
            inner: Inner::Buffered { data, trailers },
        }
    }
}

/// Reads `body` while it stays within `limit` bytes and `deadline` has not passed: a body over
/// the limit is sent once, as it comes; one still coming at the deadline (a stalled upload) is
/// handed back the same way, and the call, whose deadline it is, then gives up before sending.
pub(crate) async fn buffer<B>(
    body: B,
    limit: usize,
    deadline: Instant,
    breaker: Option<Refusal<'_>>,
) -> Result<Buffered<B>, B::Error>
where
    B: Body<Data = Bytes>,
{
    match read_up_to(Box::pin(body), limit, Some(deadline), breaker).await {
        Ok(Read::Whole(data, trailers)) => Ok(Buffered::Replayable(data, trailers)),
        Ok(Read::Over(prefix, rest) | Read::Late(prefix, rest)) => Ok(Buffered::Once(ReplayBody {
            inner: Inner::Streaming { prefix, rest },
        })),
        Ok(Read::Refused(prefix, rest)) => Ok(Buffered::Refused(ReplayBody {
            inner: Inner::Streaming { prefix, rest },
        })),
        Err((_, e)) => Err(e),
    }
}

/// The breaker of the call whose request body [`buffer`] reads, and when that call began: an
/// open circuit fails the call fast (SPEC §2), so the read does not wait for a slow or stalled
/// upload the breaker will refuse. It is asked before the first frame, then
/// [`BREAKER_RECHECK`] after the call began and every [`BREAKER_RECHECK`] after each look while
/// the read waits, as a wait for capacity does.
#[derive(Clone, Copy)]
pub(crate) struct Refusal<'a> {
    /// The breaker the call's policy uses.
    pub(crate) breaker: &'a CircuitBreaker,
    /// When the call began.
    pub(crate) began: Instant,
}

/// What [`read_up_to`] found.
pub(crate) enum Read<B> {
    /// The whole body (its data in one piece) and its trailers.
    Whole(Bytes, Option<HeaderMap>),
    /// More than the limit: the chunks read so far and the rest.
    Over(VecDeque<Bytes>, Pin<Box<B>>),
    /// The deadline passed before the end: the chunks read so far and the rest.
    Late(VecDeque<Bytes>, Pin<Box<B>>),
    /// The call's breaker refuses it (see [`Refusal`]): the chunks read so far and the rest.
    Refused(VecDeque<Bytes>, Pin<Box<B>>),
}

/// Reads `body` while it stays within `limit` bytes and, if there is one, until `deadline`
/// (tokio's clock; a frame already there is still taken after it, but for a read that brings
/// no bytes, ended every 64 frames), and, with a `breaker`, while it would not refuse the
/// call (see [`Refusal`]; asked only with a deadline); on an error, the chunks read before it.
/// Nothing read is lost: [`Read::Over`], [`Read::Late`] and [`Read::Refused`] hand back the
/// chunks and the body where it stopped.
pub(crate) async fn read_up_to<B>(
    mut body: Pin<Box<B>>,
    limit: usize,
    deadline: Option<Instant>,
    breaker: Option<Refusal<'_>>,
) -> Result<Read<B>, (VecDeque<Bytes>, B::Error)>
where
    B: Body,
    B::Data: Buf,
{
    let limit_u64 = u64::try_from(limit).unwrap_or(u64::MAX);
    // Only an exact size says the body is over the limit before a byte is read: a lower bound
    // past the limit on a small body (a body breaking `size_hint`'s contract) would otherwise
    // take a short request's retries away.
    let hint = body.size_hint();
    if hint.upper() == Some(hint.lower()) && hint.lower() > limit_u64 {
        return Ok(Read::Over(VecDeque::new(), body));
    }
    let refused = || breaker.is_some_and(|r| refuses_now(Some(r.breaker)));
    if deadline.is_some() && refused() {
        return Ok(Read::Refused(VecDeque::new(), body));
    }
    let mut chunks = VecDeque::new();
    let mut len = 0usize;
    let mut trailers = None;
    // Registered with the timer only if a frame is not there at once. It ends at the deadline,
    // or before it when the breaker is to be asked again.
    let next_look = |deadline: Instant, from: Instant| match breaker {
        Some(_) => deadline.min(from + BREAKER_RECHECK),
        None => deadline,
    };
    let sleep =
        deadline.map(|d| tokio::time::sleep_until(next_look(d, breaker.map_or(d, |r| r.began))));
    tokio::pin!(sleep);
    let mut frames = 0_u32;
    // Frames of the last 64 that brought no byte (empty data, trailers).
    let mut idle = 0_u32;
    // Frames taken once the deadline was seen passed, and when it was.
    let mut past = 0_usize;
    let mut seen_past: Option<Instant> = None;
    let past_frames = (limit / 64).clamp(1024, 1 << 20);
    loop {
        frames = frames.wrapping_add(1);
        // A body whose frames are always there must neither hold the thread nor outlast the
        // deadline for long: every so many frames the task gives way if its budget is spent,
        // and the deadline is looked at. Past it, a read that brought nothing in some of them
        // ends; one that brings bytes goes on for [`PAST_DEADLINE`] at most, and for a number
        // of frames that grows with `limit` (a body all there at the deadline, up to the limit
        // in frames of 64 bytes or more, is still read whole; one always ready is not read
        // for ever, even under a paused clock).
        if frames.is_multiple_of(64) {
            tokio::task::consume_budget().await;
            let now = Instant::now();
            if deadline.is_some_and(|deadline| now >= deadline) {
                let since = *seen_past.get_or_insert(now);
                if idle > 0
                    || past >= past_frames
                    || now.saturating_duration_since(since) >= PAST_DEADLINE
                {
                    return Ok(Read::Late(chunks, body));
                }
                past += 64;
            }
            idle = 0;
        }
        // The body first: a frame that is ready wins over a deadline that has passed.
        let next = tokio::select! {
            biased;
            frame = body.frame() => Some(frame),
            () = expired(sleep.as_mut()) => None,
        };
        let frame = match next {
            Some(Some(frame)) => frame,
            Some(None) => break,
            None => {
                // The timer: the deadline, or a look at the breaker before it.
                let now = Instant::now();
                match deadline {
                    Some(deadline) if now < deadline => {
                        if refused() {
                            return Ok(Read::Refused(chunks, body));
                        }
                        if let Some(sleep) = sleep.as_mut().as_pin_mut() {
                            sleep.reset(next_look(deadline, now));
                        }
                        continue;
                    }
                    _ => return Ok(Read::Late(chunks, body)),
                }
            }
        };
        let frame = match frame {
            Ok(frame) => frame,
            Err(e) => return Err((chunks, e)),
        };
        match frame.into_data() {
            Ok(mut data) => {
                let data = data.copy_to_bytes(data.remaining());
                len = len.saturating_add(data.len());
                if data.is_empty() {
                    idle += 1;
                } else {
                    chunks.push_back(data);
                }
                if len > limit {
                    return Ok(Read::Over(chunks, body));
                }
            }
            Err(frame) => {
                idle += 1;
                // Trailers are a body's last frame: the read ends with them, so that no check
                // after them (the deadline's, the limit's) can return the body without them.
                if let Ok(t) = frame.into_trailers() {
                    trailers = Some(t);
                    break;
                }
            }
        }
    }
    Ok(Read::Whole(join(&chunks, len), trailers))
}

/// How long [`read_up_to`] still takes frames that bring bytes once it has seen its deadline
/// passed: a body all there at the deadline is read whole (memory-speed), one always ready is
/// not read for ever.
const PAST_DEADLINE: std::time::Duration = std::time::Duration::from_millis(100);

/// Ends when `sleep` does; never without one.
async fn expired(sleep: Pin<&mut Option<Sleep>>) {
    match sleep.as_pin_mut() {
        Some(sleep) => sleep.await,
        None => std::future::pending().await,
    }
}

impl<B> Body for ReplayBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        // Every field is Unpin (the original body is boxed).
        match &mut self.get_mut().inner {
            Inner::Buffered { data, trailers } => Poll::Ready(
                data.take()
                    .map(Frame::data)
                    .or_else(|| trailers.take().map(Frame::trailers))
                    .map(Ok),
            ),
            Inner::Streaming { prefix, rest } => match prefix.pop_front() {
                Some(chunk) => Poll::Ready(Some(Ok(Frame::data(chunk)))),
                None => rest.as_mut().poll_frame(cx),
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.inner {
            Inner::Buffered { data, trailers } => data.is_none() && trailers.is_none(),
            Inner::Streaming { prefix, rest } => prefix.is_empty() && rest.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            Inner::Buffered { data, .. } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            Inner::Streaming { prefix, rest } => prefixed_hint(prefix, rest.size_hint()),
        }
    }
}

/// The response body of a client the layer wraps: the upstream's body as it comes, or the
/// bytes of it the layer read into memory: a failed attempt's answer, read before the call
/// decides to retry it so that its connection goes back to the client's pool (see
/// [`super`]), or, with de-duplication on ([`super::Dedup`]), a response read to be shared (a
/// follower's copy, or the leader's own). A body only partly read gives the bytes read first,
/// then the rest as it comes. Errors are boxed.
pub struct ResponseBody<B> {
    inner: ResponseInner<B>,
    /// When the body must have ended (see [`ResponseBody::ending_at`]).
    until: Option<Until>,
}

/// The deadline of a [`ResponseBody`], and its timer, made at the body's first poll.
struct Until {
    at: Instant,
    sleep: Option<Pin<Box<Sleep>>>,
}

/// How much of a [`ResponseBody`] with a deadline is kept once the deadline has passed: what
/// the upstream had sent by then and the reader had not read yet (an HTTP/2 stream's window
/// holds at most a few MiB of it; see [`drained`]).
const PAST_DEADLINE_BYTES: usize = 16 << 20;
/// The most frames [`drained`] takes (frames without data included).
const PAST_DEADLINE_FRAMES: usize = 1 << 16;

/// The end of a streamed answer whose deadline has passed: the frames already there are taken
/// (after the bytes read before, `prefix`), up to [`PAST_DEADLINE_BYTES`] and the frame that
/// crosses it, without waiting for any; the rest of the body is let go (an HTTP/2 stream whose
/// request was sent whole is reset). An answer whose end was there too is whole; any other
/// ends, after what was taken, with `DEADLINE_EXCEEDED` (a [`tonic::Status`], which a tonic
/// client returns as it is). So a reader slower than the upstream loses nothing the upstream
/// sent in time, and an upstream that goes on past the deadline is cut off there.
fn drained<B>(
    mut prefix: VecDeque<Bytes>,
    mut rest: Pin<&mut B>,
    cx: &mut Context<'_>,
) -> ResponseInner<B>
where
    B: Body,
    B::Data: Buf,
    B::Error: Into<BoxError>,
{
    let mut bytes: usize = prefix.iter().map(Bytes::len).sum();
    let mut frames = 0;
    let (trailers, error) = loop {
        if bytes > PAST_DEADLINE_BYTES || frames >= PAST_DEADLINE_FRAMES {
            break (None, Some(late()));
        }
        frames += 1;
        match rest.as_mut().poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                Ok(mut data) => {
                    let data = data.copy_to_bytes(data.remaining());
                    bytes = bytes.saturating_add(data.len());
                    if !data.is_empty() {
                        prefix.push_back(data);
                    }
                }
                Err(frame) => {
                    if let Ok(trailers) = frame.into_trailers() {
                        break (Some(trailers), None);
                    }
                }
            },
            Poll::Ready(Some(Err(e))) => break (None, Some(e.into())),
            Poll::Ready(None) => break (None, None),
            Poll::Pending => break (None, Some(late())),
        }
    };
    match error {
        Some(error) => ResponseInner::Failed {
            prefix,
            error: Some(error),
        },
        None => {
            let len = bytes;
            ResponseInner::Full {
                data: Some(join(&prefix, len)).filter(|d| !d.is_empty()),
                trailers,
            }
        }
    }
}

/// The error of an answer its caller's deadline ended.
fn late() -> BoxError {
    Box::new(tonic::Status::deadline_exceeded(
        "the call's deadline passed before its answer ended",
    ))
}

enum ResponseInner<B> {
    Full {
        data: Option<Bytes>,
        trailers: Option<HeaderMap>,
    },
    Streaming {
        prefix: VecDeque<Bytes>,
        rest: Pin<Box<B>>,
    },
    /// Reading failed: the bytes read, then the error.
    Failed {
        prefix: VecDeque<Bytes>,
        error: Option<BoxError>,
    },
}

// Bodies stay out of Debug.
impl<B> std::fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.inner {
            ResponseInner::Full { .. } => "full",
            ResponseInner::Streaming { .. } => "streaming",
            ResponseInner::Failed { .. } => "failed",
        };
        f.debug_struct("ResponseBody").field("kind", &kind).finish()
    }
}

impl<B> ResponseBody<B> {
    pub(crate) fn full(data: Bytes, trailers: Option<HeaderMap>) -> Self {
        let data = (!data.is_empty()).then_some(data);
        Self {
            inner: ResponseInner::Full { data, trailers },
            until: None,
        }
    }

    pub(crate) fn streaming(prefix: VecDeque<Bytes>, rest: Pin<Box<B>>) -> Self {
        Self {
            inner: ResponseInner::Streaming { prefix, rest },
            until: None,
        }
    }

    pub(crate) fn passthrough(body: B) -> Self {
        Self::streaming(VecDeque::new(), Box::pin(body))
    }

    /// The trailers of a body read whole that brought no byte before them (a gRPC answer that
    /// sent its head and then its status).
    pub(crate) fn trailers_before_data(&self) -> Option<&HeaderMap> {
        match &self.inner {
            ResponseInner::Full {
                data: None,
                trailers: Some(trailers),
            } => Some(trailers),
            _ => None,
        }
    }

    pub(crate) fn failed(prefix: VecDeque<Bytes>, error: BoxError) -> Self {
        Self {
            inner: ResponseInner::Failed {
                prefix,
                error: Some(error),
            },
            until: None,
        }
    }

    /// Ends the body at `at` (tokio's clock) if it has not ended by then: what is unread is let
    /// go and the reader gets a `DEADLINE_EXCEEDED` [`tonic::Status`] as the body's error,
    /// which a tonic client returns as it is. What the upstream sent by then is still read
    /// (see [`drained`]). An HTTP/2 stream whose request has been sent whole is reset; one
    /// whose request is still streamed is not (the client below goes on sending it, as it does
    /// without the layer), and the upstream ends it at the `grpc-timeout` it was sent.
    pub(crate) fn ending_at(mut self, at: Instant) -> Self {
        self.until = Some(Until { at, sleep: None });
        self
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body,
    B::Data: Buf,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        // Every field is Unpin (the upstream body and the timer are boxed).
        let this = self.get_mut();
        let Some(until) = &mut this.until else {
            return this.inner.poll_frame(cx);
        };
        // An answer in memory (read whole, or up to an error) has nothing left to wait for.
        if !matches!(this.inner, ResponseInner::Streaming { .. }) {
            this.until = None;
            return this.inner.poll_frame(cx);
        }
        // The timer, made at the first read, and the clock: the timer alone says `Pending`
        // once the task's coop budget is spent, and a reader of a body whose frames are always
        // there never yields to renew it.
        let at = until.at;
        let sleep = until
            .sleep
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(at)));
        let passed = sleep.as_mut().poll(cx).is_ready() || Instant::now() >= at;
        if !passed {
            let frame = this.inner.poll_frame(cx);
            let ended = match &frame {
                Poll::Ready(Some(Ok(frame))) => frame.is_trailers() || this.inner.is_end_stream(),
                Poll::Ready(_) => true,
                Poll::Pending => false,
            };
            // Ended (its trailers, its last data, an error): no deadline after the end.
            if ended {
                this.until = None;
            }
            return frame;
        }
        this.until = None;
        if let ResponseInner::Streaming { prefix, rest } = &mut this.inner {
            // Outside the task's coop budget: a body on tokio's channels says `Pending` once
            // the budget is spent, frames there or not, and what had come would be lost. The
            // drain is bounded on its own. (An unconstrained future that is ready at once.)
            let mut prefix = Some(std::mem::take(prefix));
            let drain = tokio::task::unconstrained(std::future::poll_fn(|cx| {
                Poll::Ready(drained(
                    prefix.take().unwrap_or_default(),
                    rest.as_mut(),
                    cx,
                ))
            }));
            let taken = match std::pin::pin!(drain).poll(cx) {
                Poll::Ready(taken) => taken,
                Poll::Pending => ResponseInner::Failed {
                    prefix: VecDeque::new(),
                    error: Some(late()),
                },
            };
            this.inner = taken;
        }
        this.inner.poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            ResponseInner::Full { data, .. } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            ResponseInner::Streaming { prefix, rest } => prefixed_hint(prefix, rest.size_hint()),
            ResponseInner::Failed { .. } => SizeHint::new(),
        }
    }
}

/// A [`ResponseInner`]'s next frame (see [`ResponseBody`]'s `poll_frame`).
impl<B> ResponseInner<B>
where
    B: Body,
    B::Data: Buf,
    B::Error: Into<BoxError>,
{
    fn is_end_stream(&self) -> bool {
        match self {
            ResponseInner::Full { data, trailers } => data.is_none() && trailers.is_none(),
            ResponseInner::Streaming { prefix, rest } => prefix.is_empty() && rest.is_end_stream(),
            ResponseInner::Failed { prefix, error } => prefix.is_empty() && error.is_none(),
        }
    }

    fn poll_frame(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self {
            ResponseInner::Full { data, trailers } => Poll::Ready(
                data.take()
                    .map(Frame::data)
                    .or_else(|| trailers.take().map(Frame::trailers))
                    .map(Ok),
            ),
            ResponseInner::Streaming { prefix, rest } => match prefix.pop_front() {
                Some(chunk) => Poll::Ready(Some(Ok(Frame::data(chunk)))),
                None => rest.as_mut().poll_frame(cx).map(|frame| {
                    frame.map(|r| {
                        r.map(|f| f.map_data(|mut d| d.copy_to_bytes(d.remaining())))
                            .map_err(Into::into)
                    })
                }),
            },
            ResponseInner::Failed { prefix, error } => Poll::Ready(
                prefix
                    .pop_front()
                    .map(|c| Ok(Frame::data(c)))
                    .or_else(|| error.take().map(Err)),
            ),
        }
    }
}

/// `response` with its body read into memory, if it comes within `limit` bytes and by `until`;
/// otherwise with the bytes read so far followed by the rest as it comes (or, if reading it
/// failed, by that error). A body read to its end lets an HTTP/1 client put the connection
/// back into its pool (and ends an HTTP/2 stream): the layer does this for a failed attempt's
/// answer, which a call keeps through its pause.
///
/// The read's state is boxed: an attempt's future holds this one, and inline it made every
/// attempt's future, and each future holding one, larger by its size, held by every request
/// in flight whether it reads or not (BENCHMARKS.md, "the tower layer").
pub(crate) fn read_failed<B>(
    response: http::Response<B>,
    limit: usize,
    until: Instant,
) -> Pin<Box<impl Future<Output = http::Response<ResponseBody<B>>>>>
where
    B: Body,
    B::Data: Buf,
    B::Error: Into<BoxError>,
{
    Box::pin(async move {
        let (parts, body) = response.into_parts();
        let body = match read_up_to(Box::pin(body), limit, Some(until), None).await {
            Ok(Read::Whole(data, trailers)) => ResponseBody::full(data, trailers),
            Ok(
                Read::Over(prefix, rest) | Read::Late(prefix, rest) | Read::Refused(prefix, rest),
            ) => ResponseBody::streaming(prefix, rest),
            Err((prefix, e)) => ResponseBody::failed(prefix, e.into()),
        };
        http::Response::from_parts(parts, body)
    })
}

/// The most frames [`ResponseBody::poll_read_on`] takes in one poll.
const READ_ON_FRAMES_PER_POLL: usize = 64;

/// How many frames that bring no byte (empty data) the layer's reading on of a kept answer
/// takes at full speed: a few are ordinary, a body always ready with nothing would keep a core
/// busy through the call's waits. Past them, an empty frame ends a poll without asking for the
/// next (the layer then reads a few more every 10 ms: a body whose end comes after many empty
/// frames is still read to it).
pub(crate) const READ_ON_IDLE_FRAMES: u32 = 4096;

/// What the body of a kept failed answer ends with, after the bytes read, when the call let go
/// of its unread rest to send its next attempt.
#[derive(Debug, thiserror::Error)]
#[error(
    "the rest of this answer's body was not read: the call sent its next attempt, and let the \
     connection go"
)]
pub struct LeftUnread;

impl<B> ResponseBody<B>
where
    B: Body,
    B::Data: Buf,
    B::Error: Into<BoxError>,
{
    /// Reads on into memory what has come of a body read in part, up to `limit` bytes in all
    /// (the part read counts): each frame as it comes, so that the read may stop between any
    /// two polls and lose nothing. The whole body read becomes one in memory (the upstream's
    /// body, and with it its connection, let go). Registers for a wake-up only while there is
    /// more to read within the limit. Frames that bring no byte spend `idle_left` (kept by the
    /// caller for each kept answer); once it is spent, the read stops at the next such frame,
    /// until something else wakes the call.
    pub(crate) fn poll_read_on(&mut self, limit: usize, idle_left: &mut u32, cx: &mut Context<'_>) {
        let mut read: usize = match &self.inner {
            ResponseInner::Streaming { prefix, .. } => prefix.iter().map(Bytes::len).sum(),
            _ => return,
        };
        // A body whose frames are always there (one byte each, or empty) must not hold the
        // thread: after this many in one poll, the rest waits for the next poll (woken at
        // once). One always ready with nothing would keep a core busy: its empty frames are
        // bounded by `idle_left`, after which it is read no more.
        for _ in 0..READ_ON_FRAMES_PER_POLL {
            let ResponseInner::Streaming { prefix, rest } = &mut self.inner else {
                return;
            };
            // At the limit, one frame more is read: the body's end, already there, frees its
            // connection (as `read_failed` reads a body of exactly the limit whole).
            if read > limit {
                return;
            }
            let frame = match rest.as_mut().poll_frame(cx) {
                Poll::Pending => return,
                Poll::Ready(frame) => frame,
            };
            match frame {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(mut data) => {
                        let chunk = data.copy_to_bytes(data.remaining());
                        read = read.saturating_add(chunk.len());
                        if chunk.is_empty() {
                            // Past the allowance, an empty frame stops the read (not woken
                            // again): the call's next wake reads on.
                            if *idle_left == 0 {
                                return;
                            }
                            *idle_left -= 1;
                        } else {
                            prefix.push_back(chunk);
                        }
                    }
                    // Trailers end a body.
                    Err(frame) => {
                        let data = concat(std::mem::take(prefix));
                        *self = Self::full(data, frame.into_trailers().ok());
                    }
                },
                Some(Err(e)) => {
                    let prefix = std::mem::take(prefix);
                    *self = Self::failed(prefix, e.into());
                }
                None => {
                    let data = concat(std::mem::take(prefix));
                    *self = Self::full(data, None);
                }
            }
        }
        cx.waker().wake_by_ref();
    }

    /// Lets go of what is left unread of a body read in part (and with it the upstream's
    /// connection or stream): the bytes read stay, followed by [`LeftUnread`]. A body read
    /// whole is left as it is.
    pub(crate) fn cut_unread(&mut self) {
        if let ResponseInner::Streaming { prefix, rest } = &mut self.inner
            && !rest.is_end_stream()
        {
            let prefix = std::mem::take(prefix);
            *self = Self::failed(prefix, Box::new(LeftUnread));
        }
    }
}

/// `chunks` as one buffer.
fn concat(chunks: VecDeque<Bytes>) -> Bytes {
    match chunks.len() {
        0 => Bytes::new(),
        1 => chunks.into_iter().next().unwrap_or_default(),
        _ => {
            let mut all = bytes::BytesMut::with_capacity(chunks.iter().map(Bytes::len).sum());
            for chunk in chunks {
                all.extend_from_slice(&chunk);
            }
            all.freeze()
        }
    }
}

/// What [`ResponseBody::read_whole`] found: the whole body, or the body to hand back as it is.
pub(crate) type Whole<B> = Result<(Bytes, Option<HeaderMap>), ResponseBody<B>>;

impl<B> ResponseBody<B>
where
    B: Body,
    B::Data: Buf,
    B::Error: Into<BoxError>,
{
    /// The whole body in memory, if it is within `limit` bytes and all there by `deadline`
    /// (its part read already counts); otherwise the body as it now stands (what was read
    /// first, then the rest as it comes, or the error reading stopped at), so that nothing
    /// read is lost.
    pub(crate) async fn read_whole(self, limit: usize, deadline: Instant) -> Whole<B> {
        let Self { inner, until } = self;
        // A body handed back keeps its own deadline.
        Self::read_whole_of(inner, limit, deadline)
            .await
            .map_err(|body| Self { until, ..body })
    }

    async fn read_whole_of(inner: ResponseInner<B>, limit: usize, deadline: Instant) -> Whole<B> {
        match inner {
            ResponseInner::Full { data, trailers } => {
                let data = data.unwrap_or_default();
                if data.len() <= limit {
                    Ok((data, trailers))
                } else {
                    Err(Self::full(data, trailers))
                }
            }
            inner @ ResponseInner::Failed { .. } => Err(Self { inner, until: None }),
            ResponseInner::Streaming { mut prefix, rest } => {
                let read: usize = prefix.iter().map(Bytes::len).sum();
                let Some(left) = limit.checked_sub(read) else {
                    return Err(Self::streaming(prefix, rest));
                };
                match read_up_to(rest, left, Some(deadline), None).await {
                    Ok(Read::Whole(data, trailers)) => {
                        let data = if prefix.is_empty() {
                            data
                        } else {
                            let len = read.saturating_add(data.len());
                            prefix.push_back(data);
                            join(&prefix, len)
                        };
                        Ok((data, trailers))
                    }
                    Ok(
                        Read::Over(more, rest) | Read::Late(more, rest) | Read::Refused(more, rest),
                    ) => {
                        prefix.extend(more);
                        Err(Self::streaming(prefix, rest))
                    }
                    Err((more, e)) => {
                        prefix.extend(more);
                        Err(Self::failed(prefix, e.into()))
                    }
                }
            }
        }
    }
}

/// `chunks` in one piece (`capacity`: about their length).
fn join(chunks: &VecDeque<Bytes>, capacity: usize) -> Bytes {
    match chunks.len() {
        0 => Bytes::new(),
        1 => chunks.front().cloned().unwrap_or_default(),
        _ => {
            let mut all = Vec::with_capacity(capacity);
            for c in chunks {
                all.extend_from_slice(c);
            }
            Bytes::from(all)
        }
    }
}

/// The size hint of a body made of `prefix` (chunks already read) followed by a body whose
/// hint is `rest`.
fn prefixed_hint(prefix: &VecDeque<Bytes>, rest: SizeHint) -> SizeHint {
    let read: u64 = prefix.iter().map(|c| c.len() as u64).sum();
    let mut out = SizeHint::new();
    out.set_lower(rest.lower().saturating_add(read));
    if let Some(upper) = rest.upper() {
        out.set_upper(upper.saturating_add(read));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{Full, StreamBody};

    type Chunks =
        StreamBody<tokio_stream::Iter<std::vec::IntoIter<Result<Frame<Bytes>, BoxError>>>>;

    /// A body of `chunks`, one frame each.
    fn chunks(parts: &[&'static str]) -> Chunks {
        let frames: Vec<Result<Frame<Bytes>, BoxError>> = parts
            .iter()
            .map(|p| Ok(Frame::data(Bytes::from_static(p.as_bytes()))))
            .collect();
        StreamBody::new(tokio_stream::iter(frames))
    }

    async fn all<B>(body: ResponseBody<B>) -> Bytes
    where
        B: Body,
        B::Data: Buf,
        B::Error: Into<BoxError>,
    {
        body.collect().await.unwrap().to_bytes()
    }

    fn later() -> Instant {
        Instant::now() + std::time::Duration::from_secs(60)
    }

    #[tokio::test]
    async fn a_failed_answer_read_in_part_still_gives_every_byte_and_reads_whole_later() {
        // Over the limit of the first read (4 bytes): the first chunks, then the rest.
        let response = http::Response::new(chunks(&["abc", "de", "fgh"]));
        let read = read_failed(response, 4, later()).await.into_body();
        let ResponseBody {
            inner: ResponseInner::Streaming { prefix, .. },
            ..
        } = &read
        else {
            panic!("over the limit, streamed");
        };
        assert_eq!(prefix.len(), 2);
        // Shared later under a larger limit: the part read and the rest, in one piece.
        let (data, trailers) = read.read_whole(100, later()).await.ok().unwrap();
        assert_eq!((&data[..], trailers), (&b"abcdefgh"[..], None));

        // Under a limit the part read alone passes: handed back whole, nothing lost.
        let response = http::Response::new(chunks(&["abc", "de", "fgh"]));
        let read = read_failed(response, 4, later()).await.into_body();
        let kept = read.read_whole(3, later()).await.err().unwrap();
        assert_eq!(all(kept).await, "abcdefgh");
        // Past the limit only once the rest is read: handed back with every byte.
        let response = http::Response::new(chunks(&["abc", "de", "fgh"]));
        let read = read_failed(response, 4, later()).await.into_body();
        let kept = read.read_whole(7, later()).await.err().unwrap();
        assert_eq!(all(kept).await, "abcdefgh");
    }

    #[tokio::test]
    async fn a_body_read_whole_is_shared_within_the_limit_and_kept_past_it() {
        let response = http::Response::new(Full::new(Bytes::from_static(b"busy")));
        let read = read_failed(response, 64, later()).await.into_body();
        assert!(matches!(read.inner, ResponseInner::Full { .. }));
        let kept = read.read_whole(3, later()).await.err().unwrap();
        assert_eq!(all(kept).await, "busy");
        let response = http::Response::new(Full::new(Bytes::from_static(b"busy")));
        let read = read_failed(response, 64, later()).await.into_body();
        assert_eq!(read.read_whole(4, later()).await.ok().unwrap().0, "busy");
    }

    /// `body` read on in one poll, as a pause does.
    fn read_on<B>(body: &mut ResponseBody<B>, limit: usize)
    where
        B: Body,
        B::Data: Buf,
        B::Error: Into<BoxError>,
    {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let mut idle_left = u32::MAX;
        body.poll_read_on(limit, &mut idle_left, &mut cx);
    }

    #[tokio::test]
    async fn a_body_read_in_part_is_read_on_to_its_end_and_let_go() {
        let response = http::Response::new(chunks(&["abc", "de", "fgh"]));
        let mut read = read_failed(response, 4, later()).await.into_body();
        read_on(&mut read, 64);
        assert!(matches!(read.inner, ResponseInner::Full { .. }), "{read:?}");
        // Nothing left to let go of: the whole body stays.
        read.cut_unread();
        assert_eq!(all(read).await, "abcdefgh");
    }

    #[tokio::test]
    async fn reading_on_stops_past_the_limit_and_the_unread_rest_is_cut_after_the_bytes_read() {
        // As `read_failed`, the read stops with the frame that takes it past the limit (at
        // the limit, it reads on: the next frame may be the end).
        let response = http::Response::new(chunks(&["abc", "de", "fgh", "ij"]));
        let mut read = read_failed(response, 2, later()).await.into_body();
        read_on(&mut read, 5);
        let ResponseInner::Streaming { prefix, .. } = &read.inner else {
            panic!("the limit stops the read: {read:?}");
        };
        assert_eq!(prefix.len(), 3);
        read.cut_unread();
        let mut read = std::pin::pin!(read);
        let mut got = Vec::new();
        let error = loop {
            match read.frame().await {
                Some(Ok(frame)) => got.extend_from_slice(&frame.into_data().unwrap()),
                Some(Err(e)) => break e,
                None => panic!("a cut body ends with an error"),
            }
        };
        assert_eq!(got, b"abcdefgh");
        assert!(error.is::<LeftUnread>(), "{error}");
    }

    #[tokio::test]
    async fn trailers_and_errors_read_on_end_the_body_as_they_would() {
        let frames: Vec<Result<Frame<Bytes>, BoxError>> = vec![
            Ok(Frame::data(Bytes::from_static(b"ab"))),
            Ok(Frame::data(Bytes::from_static(b"cd"))),
            Ok(Frame::trailers(HeaderMap::new())),
        ];
        let response = http::Response::new(StreamBody::new(tokio_stream::iter(frames)));
        let mut read = read_failed(response, 1, later()).await.into_body();
        read_on(&mut read, 64);
        let collected = read.collect().await.unwrap();
        assert!(collected.trailers().is_some());
        assert_eq!(collected.to_bytes(), "abcd");

        let frames: Vec<Result<Frame<Bytes>, BoxError>> = vec![
            Ok(Frame::data(Bytes::from_static(b"ab"))),
            Ok(Frame::data(Bytes::from_static(b"cd"))),
            Err("reset".into()),
        ];
        let response = http::Response::new(StreamBody::new(tokio_stream::iter(frames)));
        let mut read = read_failed(response, 1, later()).await.into_body();
        read_on(&mut read, 64);
        assert!(
            matches!(read.inner, ResponseInner::Failed { .. }),
            "{read:?}"
        );
        let mut read = std::pin::pin!(read);
        let mut got = Vec::new();
        while let Some(Ok(frame)) = read.frame().await {
            got.extend_from_slice(&frame.into_data().unwrap());
        }
        assert_eq!(got, b"abcd");
    }

    /// A body always ready with a data frame of `data` (empty: `b""`), `left` times, then its
    /// end; counts its polls.
    struct ReadyFrames {
        left: u32,
        data: &'static [u8],
        polls: std::sync::Arc<std::sync::atomic::AtomicU32>,
    }

    impl Body for ReadyFrames {
        type Data = Bytes;
        type Error = BoxError;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
            self.polls
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if self.left == 0 {
                return Poll::Ready(None);
            }
            self.left -= 1;
            Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(self.data)))))
        }
    }

    fn ready_frames(
        left: u32,
        data: &'static [u8],
    ) -> (ReadyFrames, std::sync::Arc<std::sync::atomic::AtomicU32>) {
        let polls = std::sync::Arc::default();
        (
            ReadyFrames {
                left,
                data,
                polls: std::sync::Arc::clone(&polls),
            },
            polls,
        )
    }

    #[tokio::test]
    async fn a_read_of_endless_ready_frames_ends_at_its_deadline_and_keeps_no_empty_chunk() {
        // Before, a frame that was there always won over the deadline: the read took every
        // frame (for ever, for a body that never ends), each empty chunk kept.
        let (body, polls) = ready_frames(1_000_000, b"");
        let read = read_up_to(Box::pin(body), 64, Some(Instant::now()), None).await;
        let Ok(Read::Late(chunks, _)) = read else {
            panic!("the deadline ends the read");
        };
        assert!(chunks.is_empty());
        assert!(polls.load(std::sync::atomic::Ordering::Relaxed) <= 64);
    }

    #[test]
    fn reading_on_takes_a_bounded_number_of_frames_a_poll() {
        // Before, one poll took every frame there was: a body always ready held the thread.
        // Frames that bring bytes: polled again at once for the rest.
        let (body, polls) = ready_frames(1_000, b"x");
        let mut read = ResponseBody::passthrough(body);
        let woken = std::sync::Arc::new(Woken::default());
        let waker = std::task::Waker::from(std::sync::Arc::clone(&woken));
        let mut idle_left = READ_ON_IDLE_FRAMES;
        read.poll_read_on(64 * 1024, &mut idle_left, &mut Context::from_waker(&waker));
        let ResponseInner::Streaming { prefix, .. } = &read.inner else {
            panic!("one poll reads a bounded number of frames: {read:?}");
        };
        assert_eq!(prefix.len(), READ_ON_FRAMES_PER_POLL);
        assert_eq!(
            polls.load(std::sync::atomic::Ordering::Relaxed),
            READ_ON_FRAMES_PER_POLL as u32
        );
        assert!(woken.0.load(std::sync::atomic::Ordering::Relaxed));
        // Frames that bring nothing: taken as fast (a run of them is ordinary) until the
        // call's allowance is spent, then read no more (a body always ready with nothing kept
        // a core busy for the whole pause).
        let (body, polls) = ready_frames(1_000_000, b"");
        let mut read = ResponseBody::passthrough(body);
        let mut idle_left = READ_ON_IDLE_FRAMES;
        let mut woken_polls = 0;
        for _ in 0..1_000 {
            let woken = std::sync::Arc::new(Woken::default());
            let waker = std::task::Waker::from(std::sync::Arc::clone(&woken));
            read.poll_read_on(64, &mut idle_left, &mut Context::from_waker(&waker));
            if !woken.0.load(std::sync::atomic::Ordering::Relaxed) {
                break;
            }
            woken_polls += 1;
        }
        // (The allowance, and the empty frame that found it spent.)
        assert_eq!(
            polls.load(std::sync::atomic::Ordering::Relaxed),
            READ_ON_IDLE_FRAMES + 1
        );
        assert_eq!(
            woken_polls,
            READ_ON_IDLE_FRAMES as usize / READ_ON_FRAMES_PER_POLL
        );
    }

    #[tokio::test]
    async fn a_body_always_ready_with_bytes_is_not_read_for_ever_past_the_deadline() {
        // Bounded by the limit alone, a body always ready was read far past its deadline
        // (for ever, under a limit of `usize::MAX`).
        let (body, polls) = ready_frames(u32::MAX, b"x");
        let read = read_up_to(Box::pin(body), usize::MAX, Some(Instant::now()), None).await;
        assert!(matches!(read, Ok(Read::Late(..))));
        let polls = polls.load(std::sync::atomic::Ordering::Relaxed);
        // Ended by the grace past the deadline (100 ms) or its frames (2^20 at most).
        assert!(polls <= (1 << 20) + 128, "{polls} frames read");
    }

    // Paused, and a body that never yields of its own accord: `tokio_stream::iter` gives way
    // every 32 items, and a deadline timer that had fired by then (on a loaded machine, a stall
    // of a millisecond) ended the read as late, which is not what this test is about.
    #[tokio::test(start_paused = true)]
    async fn a_body_of_many_frames_all_there_at_the_deadline_is_still_read_whole() {
        // Many frames, each with bytes: bounded by the limit, so read to the end even past the
        // deadline (a de-duplicated answer that came at its deadline is shared).
        let (body, _) = ready_frames(200, b"x");
        let read = read_up_to(Box::pin(body), 1024, Some(Instant::now()), None).await;
        let Ok(Read::Whole(data, None)) = read else {
            panic!("read whole");
        };
        assert_eq!(data.len(), 200);
    }

    /// A waker that records being woken.
    #[derive(Default)]
    struct Woken(std::sync::atomic::AtomicBool);

    impl std::task::Wake for Woken {
        fn wake(self: std::sync::Arc<Self>) {
            self.0.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }
}
