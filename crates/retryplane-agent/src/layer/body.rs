//! Request bodies the layer can send again: buffered up to a limit, or streamed once.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt as _;

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
    /// Over the limit: sent once.
    Once(ReplayBody<B>),
}

impl<B> ReplayBody<B> {
    pub(crate) fn buffered(data: Bytes, trailers: Option<HeaderMap>) -> Self {
        let data = (!data.is_empty()).then_some(data);
        Self {
            inner: Inner::Buffered { data, trailers },
        }
    }
}

/// Reads `body` while it stays within `limit` bytes.
pub(crate) async fn buffer<B>(body: B, limit: usize) -> Result<Buffered<B>, B::Error>
where
    B: Body<Data = Bytes>,
{
    let once = |prefix, rest| {
        Buffered::Once(ReplayBody {
            inner: Inner::Streaming { prefix, rest },
        })
    };
    let limit_u64 = u64::try_from(limit).unwrap_or(u64::MAX);
    let mut body = Box::pin(body);
    if body.size_hint().lower() > limit_u64 {
        return Ok(once(VecDeque::new(), body));
    }
    let mut chunks = VecDeque::new();
    let mut len = 0usize;
    let mut trailers = None;
    while let Some(frame) = body.frame().await {
        match frame?.into_data() {
            Ok(data) => {
                len = len.saturating_add(data.len());
                chunks.push_back(data);
                if len > limit {
                    return Ok(once(chunks, body));
                }
            }
            Err(frame) => {
                if let Ok(t) = frame.into_trailers() {
                    trailers = Some(t);
                }
            }
        }
    }
    let data = match chunks.len() {
        0 => Bytes::new(),
        1 => chunks.pop_front().unwrap_or_default(),
        _ => {
            let mut all = Vec::with_capacity(len);
            for c in &chunks {
                all.extend_from_slice(c);
            }
            Bytes::from(all)
        }
    };
    Ok(Buffered::Replayable(data, trailers))
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
            Inner::Streaming { prefix, rest } => {
                let read: u64 = prefix.iter().map(|c| c.len() as u64).sum();
                let hint = rest.size_hint();
                let mut out = SizeHint::new();
                out.set_lower(hint.lower().saturating_add(read));
                if let Some(upper) = hint.upper() {
                    out.set_upper(upper.saturating_add(read));
                }
                out
            }
        }
    }
}
