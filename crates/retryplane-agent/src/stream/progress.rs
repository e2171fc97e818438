//! When the control plane's side of the stream last delivered bytes: a snapshot of a large
//! policy set over a slow link takes longer to arrive whole than the liveness timeout
//! (`retryplane_proto::liveness_timeout`), and the answers to the agent's reports queue behind
//! it; bytes arriving show the stream alive all the same.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::task::{Context, Poll};

use http_body::{Body, Frame, SizeHint};
use tokio::time::Instant;

/// The time of the last bytes received, as milliseconds since `base`; shared between the
/// response body and the stream's loop.
#[derive(Clone, Debug)]
pub(crate) struct Progress {
    base: Instant,
    last_ms: Arc<AtomicU64>,
}

impl Progress {
    /// No bytes yet: the last progress is `base` itself.
    pub(crate) fn new(base: Instant) -> Self {
        Self {
            base,
            last_ms: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Notes bytes received now.
    fn saw_bytes(&self) {
        let ms = u64::try_from(self.base.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_ms.fetch_max(ms, Relaxed);
    }

    /// When bytes were last received (or `base`, if none were).
    pub(crate) fn last(&self) -> Instant {
        self.base + std::time::Duration::from_millis(self.last_ms.load(Relaxed))
    }

    /// `body`, noting here each data frame it yields.
    pub(crate) fn watch<B>(&self, body: B) -> Watched<B> {
        Watched {
            inner: body,
            progress: self.clone(),
        }
    }
}

/// A response body that notes in its [`Progress`] each data frame it yields.
#[derive(Debug)]
pub(crate) struct Watched<B> {
    inner: B,
    progress: Progress,
}

/// An empty body watched by nobody (the generated client asks bodies for a default).
impl<B: Default> Default for Watched<B> {
    fn default() -> Self {
        Progress::new(Instant::now()).watch(B::default())
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
            && frame.is_data()
        {
            me.progress.saw_bytes();
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
    use std::time::Duration;

    use bytes::Bytes;
    use http_body_util::{BodyExt as _, StreamBody};

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn each_data_frame_moves_the_last_progress_on() {
        let base = Instant::now();
        let progress = Progress::new(base);
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, std::io::Error>>(4);
        let mut body = progress.watch(StreamBody::new(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        ));
        assert_eq!(progress.last(), base);
        tokio::time::advance(Duration::from_secs(5)).await;
        tx.send(Ok(Frame::data(Bytes::from_static(b"part"))))
            .await
            .unwrap();
        assert!(body.frame().await.is_some());
        assert_eq!(progress.last(), base + Duration::from_secs(5));
        // Trailers are not bytes of a message.
        tokio::time::advance(Duration::from_secs(5)).await;
        tx.send(Ok(Frame::trailers(http::HeaderMap::new())))
            .await
            .unwrap();
        assert!(body.frame().await.is_some());
        assert_eq!(progress.last(), base + Duration::from_secs(5));
    }
}
