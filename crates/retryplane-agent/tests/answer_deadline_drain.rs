//! The drain of a gRPC answer once its caller's deadline is seen passed, with an upstream body
//! whose frames sit in a tokio channel (an in-process service, `StreamBody` over a
//! `ReceiverStream`, and the like): tokio's channels take part in the task's coop budget, so
//! polls of them in one task poll see `Pending` once it is spent, frames there or not; the
//! drain runs outside it.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body::{Body, Frame};
use http_body_util::{BodyExt as _, Full};
use retryplane_agent::layer::{Idempotent, ReplayBody, RetryLayer};
use support::{agent, policy};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tower::{Layer as _, ServiceExt as _, service_fn};

fn grpc_request(timeout: &str) -> Request<Full<Bytes>> {
    let mut request = Request::post("http://up/pkg.Svc/Watch")
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("grpc-timeout", timeout)
        .body(Full::new(Bytes::from_static(b"\0\0\0\0\0")))
        .unwrap();
    request.extensions_mut().insert(Idempotent(true));
    request
}

fn ok_trailers() -> http::HeaderMap {
    let mut t = http::HeaderMap::new();
    t.insert("grpc-status", http::HeaderValue::from_static("0"));
    t
}

/// A body whose frames come through a tokio channel.
struct Channel(mpsc::Receiver<Frame<Bytes>>);

impl Body for Channel {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|f| f.map(Ok))
    }
}

type Outcome = (usize, Result<bool, String>);

async fn read_all<B>(mut body: B, yield_each: bool) -> Outcome
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: std::fmt::Display,
{
    let mut data = 0;
    let mut trailers = false;
    loop {
        match body.frame().await {
            Some(Ok(frame)) => {
                if let Some(d) = frame.data_ref() {
                    data += d.len();
                }
                if frame.is_trailers() {
                    trailers = true;
                }
            }
            Some(Err(e)) => return (data, Err(e.to_string())),
            None => return (data, Ok(trailers)),
        }
        if yield_each {
            tokio::task::yield_now().await;
        }
    }
}

/// An answer of `frames` data frames of 1 KiB and `grpc-status: 0`, all sent (and the
/// channel closed) within the caller's 100 ms deadline; read from 300 ms on.
async fn whole_answer_read_after_deadline(frames: usize, yield_each: bool) -> Outcome {
    let agent = agent(&policy("max_attempts: 3"));
    let svc = service_fn(move |_req: Request<ReplayBody<Full<Bytes>>>| async move {
        let (tx, rx) = mpsc::channel(frames + 1);
        for _ in 0..frames {
            tx.try_send(Frame::data(Bytes::from(vec![b'x'; 1024])))
                .unwrap();
        }
        tx.try_send(Frame::trailers(ok_trailers())).unwrap();
        drop(tx);
        Ok::<_, Infallible>(
            Response::builder()
                .status(200)
                .header("content-type", "application/grpc")
                .body(Channel(rx))
                .unwrap(),
        )
    });
    let client = RetryLayer::new(agent.endpoint("ep")).layer(svc);
    let start = Instant::now();
    let response = client.oneshot(grpc_request("100m")).await.unwrap();
    tokio::time::sleep_until(start + Duration::from_millis(300)).await;
    let body = response.into_body();
    let read = tokio::spawn(read_all(body, yield_each));
    tokio::time::timeout(Duration::from_secs(30), read)
        .await
        .expect("the read ends")
        .unwrap()
}

#[tokio::test]
async fn a_whole_answer_in_a_channel_read_frame_by_frame_after_the_deadline_stays_whole() {
    // 1,000 frames (1000 KiB, far under the 16 MiB / 65,536 frames caps) and the trailers,
    // all there before the deadline; the reader yields between frames.
    let (data, end) = whole_answer_read_after_deadline(1000, true).await;
    assert_eq!(
        (data, end.clone()),
        (1000 * 1024, Ok(true)),
        "an answer whose end was there when the deadline was seen passed must be whole; got \
         {data} bytes, ended {end:?}"
    );
}

#[tokio::test]
async fn a_whole_answer_in_a_channel_read_in_one_go_after_the_deadline_stays_whole() {
    let (data, end) = whole_answer_read_after_deadline(1000, false).await;
    assert_eq!(
        (data, end.clone()),
        (1000 * 1024, Ok(true)),
        "got {data} bytes, ended {end:?}"
    );
}

#[tokio::test]
async fn small_whole_answer_in_a_channel_after_the_deadline_holds() {
    // Under the coop budget (128): whole (what holds).
    let (data, end) = whole_answer_read_after_deadline(100, true).await;
    assert_eq!((data, end), (100 * 1024, Ok(true)));
}

/// The cost of the deadline before it: 64 MiB in 1 KiB frames, always there, read through
/// the layer with a far deadline and without one (printed; not asserted).
/// A body whose frames are all there: `data` 1 KiB frames, then an error (`fail`) or
/// `grpc-status: 0`.
struct Ready {
    data: usize,
    fail: bool,
    done: bool,
}

impl Body for Ready {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        if self.done {
            return Poll::Ready(None);
        }
        if self.data > 0 {
            self.data -= 1;
            return Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(&[b'x'; 1024])))));
        }
        self.done = true;
        if self.fail {
            return Poll::Ready(Some(Err(std::io::Error::other("upstream reset"))));
        }
        Poll::Ready(Some(Ok(Frame::trailers(ok_trailers()))))
    }
}

async fn ready_answer(data: usize, fail: bool) -> retryplane_agent::layer::ResponseBody<Ready> {
    let agent = agent(&policy("max_attempts: 3"));
    let svc = service_fn(move |_req: Request<ReplayBody<Full<Bytes>>>| async move {
        Ok::<_, Infallible>(
            Response::builder()
                .status(200)
                .header("content-type", "application/grpc")
                .body(Ready {
                    data,
                    fail,
                    done: false,
                })
                .unwrap(),
        )
    });
    let client = RetryLayer::new(agent.endpoint("ep")).layer(svc);
    let body = client
        .oneshot(grpc_request("100m"))
        .await
        .unwrap()
        .into_body();
    tokio::time::sleep(Duration::from_millis(300)).await;
    body
}

#[tokio::test(start_paused = true)]
async fn drained_edges_hold() {
    // Whole (trailers there): the data, the trailers, then the end; the body says so.
    let mut body = ready_answer(5, false).await;
    let mut data = 0;
    let mut trailers = false;
    while let Some(frame) = body.frame().await {
        let frame = frame.unwrap();
        data += frame.data_ref().map_or(0, Bytes::len);
        trailers |= frame.is_trailers();
    }
    assert_eq!((data, trailers), (5 * 1024, true));
    assert!(body.is_end_stream());
    assert!(body.frame().await.is_none());
    // An error among the frames there: the data, then that error, then the end.
    let mut body = ready_answer(3, true).await;
    let (data, end) = read_all(&mut body, false).await;
    assert_eq!(data, 3 * 1024);
    assert!(end.unwrap_err().contains("upstream reset"));
    assert!(body.frame().await.is_none());
    assert!(body.is_end_stream());
    // An empty answer: the trailers only.
    let mut body = ready_answer(0, false).await;
    assert!(body.frame().await.unwrap().unwrap().is_trailers());
    assert!(body.frame().await.is_none());
    // Past the frame cap: 65,536 frames at most, then DEADLINE_EXCEEDED, then the end.
    let mut body = ready_answer(100_000, false).await;
    let (data, end) = read_all(&mut body, false).await;
    assert!(data <= 65_536 * 1024, "{data}");
    assert!(end.unwrap_err().contains("deadline"));
    assert!(body.frame().await.is_none());
    assert!(body.is_end_stream());
    assert_eq!(body.size_hint().lower(), 0);
}
