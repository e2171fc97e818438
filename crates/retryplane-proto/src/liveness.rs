//! End-to-end liveness of an agent stream, for an agent whose Hello sets `heartbeats` and a
//! control plane that says [`HEARTBEAT_METADATA`].
//!
//! HTTP/2 keepalive reaches only the next hop: an HTTP/2 proxy between an agent and the control
//! plane answers the pings of each for the other, so a vanished agent would stay listed
//! connected, and an agent whose control-plane end died would keep its dead stream, for good.
//! So each side sends a `Keepalive` message every [`keepalive_period`] when nothing waits to be
//! sent, and takes the stream for dead when for [`liveness_timeout`] it has heard nothing of
//! the other: no whole message, and fewer than [`PROGRESS_BYTES`] bytes of one. Bytes count, so
//! that a message larger than a slow link carries in that time (a large snapshot, a report
//! backlog), and whatever queues behind it, does not end a live stream; a floor on them, so
//! that a wedged peer that trickles a few bytes of a message that never ends does not keep a
//! dead one.
//!
//! The floor is [`PROGRESS_BYTES`], 4 KiB, within the liveness timeout: a link must carry that
//! for a message in progress to keep the stream (128 bytes a second at the default 10 s interval,
//! a 32 s timeout; 820 at 1 s, 5 s; about 1.8 KB a second at the shortest, 100 ms, 2.3 s). HTTP/2
//! hands a body whole DATA frames, of up to 16 KiB (the protocol's smallest allowed largest
//! frame size), which a slow link takes four times as long to carry; so the agent, whose
//! connection is its own, counts the DATA frames' payload as it is read on it (not the other
//! frames, which the next hop sends whether or not the control plane is there), and sends its
//! own messages in [`Chunked`] pieces of at most 4 KiB, one DATA frame each, for the control plane, which
//! counts the data of the stream's body ([`Life::watch`]: behind a proxy, one connection may
//! carry many agents' streams). (The control plane sends its snapshots whole: pieces would
//! cost every push to every agent a write per piece.)
//!
//! [`Life`] keeps when the other side was last heard: [`Life::watch`] wraps the body a side
//! reads the other's messages from and counts its bytes (or [`Life::received`] is told of the
//! DATA payload bytes read on a connection), the reader calls [`Life::heard`] for each whole message, and
//! [`Life::silent`] resolves once the stream has been silent too long.
//! Both run on tokio's clock.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf as _, Bytes};
use http_body::{Body, Frame, SizeHint};
use tokio::time::Instant;

/// Response metadata of `AgentService.Connect` from a control plane that takes heartbeats:
/// value `1`. The control plane sends keepalives and judges the stream's liveness only for an
/// agent whose Hello sets `heartbeats`; such an agent sends keepalives whatever the response
/// says (a control plane that predates them skips a message of a kind it does not know, and
/// one that judges the agent's silence must get them even if something on the way drops this
/// header), and judges the stream's liveness only on a stream whose response carries it.
pub const HEARTBEAT_METADATA: &str = "retryplane-heartbeat";

/// Bytes of a message in progress that count as hearing from the other side, once that many
/// have come since it was last heard, and the largest piece [`Chunked`] sends: 4 KiB (see the
/// module documentation).
pub const PROGRESS_BYTES: u64 = 4 * 1024;

/// [`PROGRESS_BYTES`] as a length.
const CHUNK: usize = 4 * 1024;

/// The shortest keepalive period.
const MIN_PERIOD: Duration = Duration::from_millis(100);
/// The longest keepalive period: a metrics interval of minutes or hours does not make a dead
/// stream take hours to notice.
const MAX_PERIOD: Duration = Duration::from_secs(10);

/// How often each side sends a `Keepalive` when nothing else waits to be sent: the control
/// plane's metrics interval (which the agent learns from the stream's response metadata or a
/// snapshot), within 100 ms and 10 s. Both sides derive it from the same interval.
pub fn keepalive_period(metrics_interval: Duration) -> Duration {
    metrics_interval.clamp(MIN_PERIOD, MAX_PERIOD)
}

/// How long either side waits to hear from the other before it takes the stream for dead: three
/// [`keepalive_period`]s and 2 s (32 s at the default 10 s interval).
pub fn liveness_timeout(metrics_interval: Duration) -> Duration {
    keepalive_period(metrics_interval)
        .saturating_mul(3)
        .saturating_add(Duration::from_secs(2))
}

/// When one side of a stream last heard the other; cheap to clone (shared by the body that
/// counts the bytes and the task that reads the messages).
#[derive(Clone, Debug)]
pub struct Life {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    base: Instant,
    /// Milliseconds from `base` to when the other side was last heard.
    last_ms: AtomicU64,
    /// Bytes received since then, not yet counted as hearing.
    bytes: AtomicU64,
}

/// How late a wake of [`Life::silent`] may be before it says the process stalled.
pub const STALL: Duration = Duration::from_secs(1);

/// How long [`Life::silent`] waits after a stall for what the other side sent meanwhile to be
/// read.
pub const AFTER_STALL: Duration = Duration::from_secs(2);

impl Life {
    /// A stream that opened `now`: heard from then.
    pub fn new(now: Instant) -> Self {
        Self {
            inner: Arc::new(Inner {
                base: now,
                last_ms: AtomicU64::new(0),
                bytes: AtomicU64::new(0),
            }),
        }
    }

    /// A whole message came now.
    pub fn heard(&self) {
        let now_ms = u64::try_from(self.inner.base.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.inner.last_ms.fetch_max(now_ms, Relaxed);
        self.inner.bytes.store(0, Relaxed);
    }

    /// `n` bytes came now: hearing, once [`PROGRESS_BYTES`] have come since the last. (One
    /// body or connection feeds a `Life`; a whole message heard meanwhile by another task may
    /// reset the count a few bytes late, which only delays hearing by those bytes.)
    pub fn received(&self, n: u64) {
        let total = self.inner.bytes.fetch_add(n, Relaxed).saturating_add(n);
        if total >= PROGRESS_BYTES {
            self.heard();
        }
    }

    /// When the other side was last heard (the stream's opening, if never).
    pub fn last_heard(&self) -> Instant {
        self.inner.base + Duration::from_millis(self.inner.last_ms.load(Relaxed))
    }

    /// Resolves once `limit` has passed with nothing heard; waits again while the other side
    /// is heard meanwhile. A wake more than [`STALL`] late says this process stalled (stopped,
    /// starved of CPU, a frozen container): what the other side sent meanwhile may still wait
    /// unread in the socket, so it is given [`AFTER_STALL`] to be read before the stream is
    /// judged silent. (A control plane resumed after a pause ended three in four of its healthy
    /// streams at once, and a whole fleet reconnected.) Once per silence: a process stalled
    /// again and again still ends a stream whose peer says nothing.
    pub async fn silent(&self, limit: Duration) {
        let mut not_before: Option<Instant> = None;
        // When the other side was last heard as the grace was given.
        let mut graced: Option<Instant> = None;
        loop {
            let heard = self.last_heard();
            let due = heard + limit;
            let at = not_before.map_or(due, |t| due.max(t));
            if Instant::now() >= at {
                return;
            }
            tokio::time::sleep_until(at).await;
            let woke = Instant::now();
            if woke.saturating_duration_since(at) > STALL && graced != Some(self.last_heard()) {
                graced = Some(self.last_heard());
                not_before = Some(woke + AFTER_STALL);
            }
        }
    }

    /// `body`, counting here the bytes of each data frame it yields.
    pub fn watch<B>(&self, body: B) -> Watched<B> {
        Watched {
            inner: body,
            life: self.clone(),
        }
    }
}

/// A body that counts the bytes of its data frames in a [`Life`].
#[derive(Debug)]
pub struct Watched<B> {
    inner: B,
    life: Life,
}

impl<B: Body + Unpin> Body for Watched<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let me = self.get_mut();
        let polled = Pin::new(&mut me.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled
            && let Some(data) = frame.data_ref()
        {
            me.life
                .received(u64::try_from(data.remaining()).unwrap_or(u64::MAX));
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A body whose data frames are at most [`PROGRESS_BYTES`] long: a longer one is sent in
/// pieces (slices of the same buffer, nothing copied), each of which HTTP/2 sends as a DATA
/// frame of its own, so that the other side sees a large message's bytes come on a slow link
/// (see the module documentation).
#[derive(Debug)]
pub struct Chunked<B> {
    inner: B,
    /// What is left of the last data frame.
    rest: Bytes,
}

impl<B> Chunked<B> {
    /// `body`, sent in pieces.
    pub fn new(body: B) -> Self {
        Self {
            inner: body,
            rest: Bytes::new(),
        }
    }
}

impl<B: Body<Data = Bytes> + Unpin> Body for Chunked<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let me = self.get_mut();
        if !me.rest.is_empty() {
            let piece = me.rest.split_to(me.rest.len().min(CHUNK));
            return Poll::Ready(Some(Ok(Frame::data(piece))));
        }
        let frame = match Pin::new(&mut me.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => frame,
            other => return other,
        };
        match frame.into_data() {
            Ok(mut data) => {
                if data.len() > CHUNK {
                    me.rest = data.split_off(CHUNK);
                }
                Poll::Ready(Some(Ok(Frame::data(data))))
            }
            Err(frame) => Poll::Ready(Some(Ok(frame))),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.rest.is_empty() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let inner = self.inner.size_hint();
        let rest = u64::try_from(self.rest.len()).unwrap_or(u64::MAX);
        // Built anew: raising an exact hint's lower bound first would pass its upper one.
        let mut hint = SizeHint::new();
        hint.set_lower(inner.lower().saturating_add(rest));
        if let Some(upper) = inner.upper() {
            hint.set_upper(upper.saturating_add(rest));
        }
        hint
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;

    use bytes::Bytes;
    use http_body_util::{BodyExt as _, Full, StreamBody};
    use tokio::sync::mpsc;
    use tokio_stream::wrappers::ReceiverStream;

    use super::*;

    type Frames = mpsc::Sender<Result<Frame<Bytes>, Infallible>>;
    type Inbound = StreamBody<ReceiverStream<Result<Frame<Bytes>, Infallible>>>;

    fn watched(life: &Life) -> (Frames, Watched<Inbound>) {
        let (tx, rx) = mpsc::channel(4);
        (tx, life.watch(StreamBody::new(ReceiverStream::new(rx))))
    }

    async fn data(tx: &Frames, len: usize) {
        tx.send(Ok(Frame::data(Bytes::from(vec![0; len]))))
            .await
            .unwrap();
    }

    #[test]
    fn the_period_follows_the_metrics_interval_within_bounds() {
        let ms = Duration::from_millis;
        assert_eq!(keepalive_period(ms(10)), ms(100));
        assert_eq!(keepalive_period(ms(2_500)), ms(2_500));
        assert_eq!(keepalive_period(Duration::from_secs(3_600)), ms(10_000));
        assert_eq!(liveness_timeout(ms(10_000)), ms(32_000));
        assert_eq!(liveness_timeout(ms(100)), ms(2_300));
    }

    #[tokio::test(start_paused = true)]
    async fn a_piece_s_worth_of_bytes_counts_as_hearing_and_fewer_do_not() {
        let base = Instant::now();
        let life = Life::new(base);
        let (tx, mut body) = watched(&life);
        assert_eq!(life.last_heard(), base);
        // 3 KiB over 3 s: not yet.
        for _ in 0..3 {
            tokio::time::advance(Duration::from_secs(1)).await;
            data(&tx, 1024).await;
            assert!(body.frame().await.is_some());
        }
        assert_eq!(life.last_heard(), base);
        // The 4th KiB.
        tokio::time::advance(Duration::from_secs(1)).await;
        data(&tx, 1024).await;
        assert!(body.frame().await.is_some());
        let heard = base + Duration::from_secs(4);
        assert_eq!(life.last_heard(), heard);
        // The count starts again from there; trailers are no bytes of a message.
        tokio::time::advance(Duration::from_secs(1)).await;
        data(&tx, 4 * 1024 - 1).await;
        tx.send(Ok(Frame::trailers(http::HeaderMap::new())))
            .await
            .unwrap();
        assert!(body.frame().await.is_some());
        assert!(body.frame().await.is_some());
        assert_eq!(life.last_heard(), heard);
        // A whole message is heard at once, and the bytes before it are forgotten.
        tokio::time::advance(Duration::from_secs(1)).await;
        life.heard();
        let heard = heard + Duration::from_secs(2);
        assert_eq!(life.last_heard(), heard);
        tokio::time::advance(Duration::from_secs(1)).await;
        data(&tx, 1).await;
        assert!(body.frame().await.is_some());
        assert_eq!(life.last_heard(), heard);
    }

    #[tokio::test]
    async fn a_chunked_body_sends_pieces_of_at_most_4_kib_and_its_trailers() {
        let (tx, rx) = mpsc::channel(4);
        let mut body = Chunked::new(StreamBody::new(ReceiverStream::new(rx)));
        let message: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        data(&tx, 10).await;
        tx.send(Ok(Frame::data(Bytes::from(message.clone()))))
            .await
            .unwrap();
        tx.send(Ok(Frame::trailers(http::HeaderMap::new())))
            .await
            .unwrap();
        drop(tx);
        let mut lens = Vec::new();
        let mut got = Vec::new();
        let mut trailers = 0;
        while let Some(frame) = body.frame().await {
            match frame.unwrap().into_data() {
                Ok(data) => {
                    lens.push(data.len());
                    got.extend_from_slice(&data);
                }
                Err(frame) => {
                    assert!(frame.is_trailers());
                    trailers += 1;
                }
            }
        }
        assert_eq!(lens, [10, 4096, 4096, 1808]);
        assert_eq!(&got[10..], &message[..]);
        assert_eq!(trailers, 1);
    }

    /// A body of exactly known size (a `Full`, as a unary request's) longer than a piece: the
    /// hint is what is still to come, and the body ends after its last piece. (Raising the
    /// hint's lower bound before its upper one once panicked here.)
    #[tokio::test]
    async fn a_chunked_exact_body_hints_what_is_left_and_ends_after_its_last_piece() {
        let mut body = Chunked::new(Full::new(Bytes::from(vec![7u8; 10 * 1024])));
        assert_eq!(body.size_hint().exact(), Some(10 * 1024));
        let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(first.len(), 4096);
        assert_eq!(body.size_hint().exact(), Some(6 * 1024));
        assert!(!body.is_end_stream());
        let _ = body.frame().await.unwrap().unwrap();
        let last = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(last.len(), 2 * 1024);
        assert!(body.is_end_stream());
        assert!(body.frame().await.is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn silent_waits_again_while_the_other_side_is_heard() {
        let base = Instant::now();
        let life = Life::new(base);
        let limit = Duration::from_secs(3);
        let waiter = tokio::spawn({
            let life = life.clone();
            async move {
                life.silent(limit).await;
                Instant::now()
            }
        });
        tokio::time::sleep(Duration::from_secs(2)).await;
        life.heard();
        let silent_at = waiter.await.unwrap();
        assert_eq!(silent_at, base + Duration::from_secs(5));
    }

    /// The process stalls past the limit (the clock jumps while nothing runs): the stream is
    /// not judged at once, but given [`AFTER_STALL`] for what came meanwhile to be read; heard
    /// then, it lives on; heard from no more, it is silent once that has passed.
    #[tokio::test(start_paused = true)]
    async fn after_a_stall_what_came_meanwhile_is_given_time_to_be_read() {
        let life = Life::new(Instant::now());
        let limit = Duration::from_secs(5);
        let waiter = |life: &Life| {
            let life = life.clone();
            tokio::spawn(async move {
                life.silent(limit).await;
                Instant::now()
            })
        };
        let first = waiter(&life);
        tokio::task::yield_now().await;
        // Nothing runs for 15 s, then everything at once.
        tokio::time::advance(Duration::from_secs(15)).await;
        let resumed = Instant::now();
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert!(!first.is_finished(), "judged silent as the process resumed");
        // What the other side sent during the stall is read.
        life.heard();
        tokio::time::sleep(AFTER_STALL).await;
        assert!(!first.is_finished(), "heard after the stall");
        assert_eq!(first.await.unwrap(), resumed + limit);
        // With nothing heard after a stall, it is silent once the wait after it has passed.
        let life = Life::new(Instant::now());
        let second = waiter(&life);
        tokio::task::yield_now().await;
        tokio::time::advance(Duration::from_secs(15)).await;
        let resumed = Instant::now();
        assert_eq!(second.await.unwrap(), resumed + AFTER_STALL);
        // Stalled again during the grace, with nothing heard: no second grace.
        let life = Life::new(Instant::now());
        let third = waiter(&life);
        tokio::task::yield_now().await;
        tokio::time::advance(Duration::from_secs(15)).await;
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert!(!third.is_finished());
        tokio::time::advance(Duration::from_secs(15)).await;
        let resumed = Instant::now();
        assert_eq!(third.await.unwrap(), resumed, "graced once per silence");
    }
}
