//! End-to-end liveness of an agent stream, for an agent whose Hello sets `heartbeats` and a
//! control plane that says [`HEARTBEAT_METADATA`].
//!
//! HTTP/2 keepalive reaches only the next hop: an HTTP/2 proxy between an agent and the control
//! plane answers the pings of each for the other, so a vanished agent would stay listed
//! connected, and an agent whose control-plane end died would keep its dead stream, for good.
//! So each side sends a `Keepalive` message every [`keepalive_period`] when nothing waits to be
//! sent, and takes the stream for dead when for [`liveness_timeout`] it has heard nothing of
//! the other: no whole message, and in no keepalive period bytes of one at
//! [`MIN_BYTES_PER_SECOND`] or more. Bytes count, so that a message larger than a slow link
//! carries in that time (a large snapshot, a report backlog), and whatever queues behind it,
//! does not end a live stream; a floor on their rate, so that a wedged peer that trickles a few
//! bytes of a message that never ends does not keep a dead one.
//!
//! [`Life`] keeps when the other side was last heard: [`Life::watch`] wraps the body a side
//! reads the other's messages from and counts its bytes, the reader calls [`Life::heard`] for
//! each whole message, and [`Life::silent`] resolves once the stream has been silent too long.
//! Both run on tokio's clock.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Buf as _;
use http_body::{Body, Frame, SizeHint};
use tokio::time::Instant;

/// Response metadata of `AgentService.Connect` from a control plane that takes heartbeats:
/// value `1`. An agent sends keepalives and judges the stream's liveness only on a stream whose
/// response carries it; the control plane does both only for an agent whose Hello sets
/// `heartbeats`. Either side that predates heartbeats is left alone.
pub const HEARTBEAT_METADATA: &str = "retryplane-heartbeat";

/// The rate at which bytes of a message in progress count as hearing from the other side, when
/// that many come within one keepalive period (see the module documentation): 100 bytes a
/// second (1,000 bytes in the default 10 s period), far below what a working link carries and
/// above what a wedged peer's stray bytes amount to.
pub const MIN_BYTES_PER_SECOND: u64 = 100;

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
    /// The keepalive period, in milliseconds: the window within which bytes add up.
    period_ms: u64,
    /// Bytes within one window that count as hearing: [`MIN_BYTES_PER_SECOND`] for the period.
    floor: u64,
    /// Milliseconds from `base` to when the other side was last heard.
    last_ms: AtomicU64,
    /// Milliseconds from `base` to the start of the window `bytes` counts in.
    window_ms: AtomicU64,
    /// Bytes received in the window, not yet counted as hearing.
    bytes: AtomicU64,
}

impl Life {
    /// A stream that opened `now`, heard from then, whose keepalive period is `period`.
    pub fn new(now: Instant, period: Duration) -> Self {
        let period_ms = u64::try_from(period.as_millis()).unwrap_or(u64::MAX);
        Self {
            inner: Arc::new(Inner {
                base: now,
                period_ms,
                floor: (MIN_BYTES_PER_SECOND.saturating_mul(period_ms) / 1000).max(1),
                last_ms: AtomicU64::new(0),
                window_ms: AtomicU64::new(0),
                bytes: AtomicU64::new(0),
            }),
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.inner.base.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// A whole message came now.
    pub fn heard(&self) {
        let now = self.now_ms();
        self.heard_at(now);
    }

    fn heard_at(&self, now_ms: u64) {
        self.inner.last_ms.fetch_max(now_ms, Relaxed);
        self.inner.window_ms.store(now_ms, Relaxed);
        self.inner.bytes.store(0, Relaxed);
    }

    /// `n` bytes came now: hearing, once the floor's worth of them ([`MIN_BYTES_PER_SECOND`])
    /// have come within one keepalive period. (One body feeds a `Life`, so the window's updates do not race.)
    fn received(&self, n: u64) {
        let now = self.now_ms();
        let window = self.inner.window_ms.load(Relaxed);
        let total = if now.saturating_sub(window) > self.inner.period_ms {
            self.inner.window_ms.store(now, Relaxed);
            self.inner.bytes.store(n, Relaxed);
            n
        } else {
            self.inner.bytes.fetch_add(n, Relaxed).saturating_add(n)
        };
        if total >= self.inner.floor {
            self.heard_at(now);
        }
    }

    /// When the other side was last heard (the stream's opening, if never).
    pub fn last_heard(&self) -> Instant {
        self.inner.base + Duration::from_millis(self.inner.last_ms.load(Relaxed))
    }

    /// Resolves once `limit` has passed with nothing heard; waits again while the other side
    /// is heard meanwhile.
    pub async fn silent(&self, limit: Duration) {
        loop {
            let at = self.last_heard() + limit;
            if Instant::now() >= at {
                return;
            }
            tokio::time::sleep_until(at).await;
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

/// An empty body counted by nobody (tonic's generated client asks its response bodies for a
/// default).
impl<B: Default> Default for Watched<B> {
    fn default() -> Self {
        Life::new(Instant::now(), MAX_PERIOD).watch(B::default())
    }
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

#[cfg(test)]
mod tests {
    use std::convert::Infallible;

    use bytes::Bytes;
    use http_body_util::{BodyExt as _, StreamBody};
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
    async fn bytes_at_the_floor_rate_within_a_period_count_as_hearing_and_a_trickle_does_not() {
        let base = Instant::now();
        let life = Life::new(base, Duration::from_secs(10));
        let (tx, mut body) = watched(&life);
        assert_eq!(life.last_heard(), base);
        // 900 bytes over 5 s: not yet (the floor is 1,000 bytes in a 10 s period).
        for _ in 0..10 {
            tokio::time::advance(Duration::from_millis(500)).await;
            data(&tx, 90).await;
            assert!(body.frame().await.is_some());
        }
        assert_eq!(life.last_heard(), base);
        // The 1,000th byte within the period.
        tokio::time::advance(Duration::from_millis(500)).await;
        data(&tx, 100).await;
        assert!(body.frame().await.is_some());
        assert_eq!(life.last_heard(), base + Duration::from_millis(5_500));
        // The count starts again from there; trailers are no bytes of a message.
        tokio::time::advance(Duration::from_secs(1)).await;
        data(&tx, 999).await;
        tx.send(Ok(Frame::trailers(http::HeaderMap::new())))
            .await
            .unwrap();
        assert!(body.frame().await.is_some());
        assert!(body.frame().await.is_some());
        assert_eq!(life.last_heard(), base + Duration::from_millis(5_500));
        // A whole message is heard at once, and the bytes before it are forgotten.
        tokio::time::advance(Duration::from_secs(1)).await;
        life.heard();
        let heard = base + Duration::from_millis(7_500);
        assert_eq!(life.last_heard(), heard);
        // A trickle: 90 bytes a second, never 1,000 within a period, for a minute.
        for _ in 0..60 {
            tokio::time::advance(Duration::from_millis(1_001)).await;
            data(&tx, 90).await;
            assert!(body.frame().await.is_some());
        }
        assert_eq!(life.last_heard(), heard);
    }

    #[tokio::test(start_paused = true)]
    async fn silent_waits_again_while_the_other_side_is_heard() {
        let base = Instant::now();
        let life = Life::new(base, Duration::from_secs(1));
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
}
