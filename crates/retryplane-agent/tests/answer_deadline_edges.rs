//! How far past the caller's deadline (`grpc-timeout`) a gRPC answer's body is still given to
//! its reader, through the layer over in-process services: what was there when the deadline
//! was seen passed (16 MiB at most), whatever the reader's pace or its task's coop budget (a
//! body on tokio's channels says `Pending` once the budget is spent), and nothing the upstream
//! sends after it.

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
use tokio::time::{Instant, Sleep};
use tower::{Layer as _, ServiceExt as _, service_fn};

const KIB: usize = 1024;
const MIB: usize = 1024 * KIB;

/// A gRPC request with the caller's deadline `timeout` (a `grpc-timeout` value).
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

/// A body whose frames are always there (an answer all buffered already): `left` data frames
/// of `size` bytes, then (if `trailers`) `grpc-status: 0`, or an error if `fail`.
struct AlwaysReady {
    left: usize,
    size: usize,
    trailers: bool,
    fail: bool,
}

impl Body for AlwaysReady {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        if self.left == 0 {
            if self.trailers {
                self.trailers = false;
                if self.fail {
                    return Poll::Ready(Some(Err(std::io::Error::other("upstream reset"))));
                }
                return Poll::Ready(Some(Ok(Frame::trailers(ok_trailers()))));
            }
            return Poll::Ready(None);
        }
        self.left -= 1;
        Poll::Ready(Some(Ok(Frame::data(Bytes::from(vec![b'x'; self.size])))))
    }
}

/// An upstream that produces a `size`-byte frame every `every` (a server stream that goes on
/// past the deadline, as a server that does not honour `grpc-timeout` does); a reader slower
/// than it always finds a frame there.
struct Paced {
    next: Instant,
    every: Duration,
    size: usize,
    sleep: Pin<Box<Sleep>>,
}

impl Body for Paced {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if Instant::now() >= self.next {
            let every = self.every;
            self.next += every;
            return Poll::Ready(Some(Ok(Frame::data(Bytes::from(vec![b'x'; self.size])))));
        }
        let next = self.next;
        self.sleep.as_mut().reset(next);
        match self.sleep.as_mut().poll(cx) {
            Poll::Ready(()) => {
                cx.waker().wake_by_ref();
                Poll::Pending
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

/// How a read of an answer's body ended: data bytes read, and the end (`Ok(true)`: trailers,
/// `Ok(false)`: the end without trailers, `Err`: the error's text).
type Outcome = (usize, Result<bool, String>);

/// Reads `body` frame by frame (`yield_each`: the task yields after every frame, else it reads
/// on in one poll while frames are there).
async fn read_all<B>(body: B, yield_each: bool) -> Outcome
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: std::fmt::Display,
{
    let mut body = body;
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

/// The answer through the layer (caller's deadline 100 ms) of an upstream whose 64 MiB body is
/// all there, read only after the deadline, in its own task.
async fn read_after_deadline(yield_each: bool) -> Outcome {
    read_after_deadline_with(yield_each, false).await
}

/// As [`read_after_deadline`]; `unconstrained`: the read runs outside tokio's coop budget.
async fn read_after_deadline_with(yield_each: bool, unconstrained: bool) -> Outcome {
    let agent = agent(&policy("max_attempts: 3"));
    let svc = service_fn(move |_req: Request<ReplayBody<Full<Bytes>>>| async move {
        Ok::<_, Infallible>(
            Response::builder()
                .status(200)
                .header("content-type", "application/grpc")
                .body(AlwaysReady {
                    left: 64 * MIB / KIB,
                    size: KIB,
                    trailers: true,
                    fail: false,
                })
                .unwrap(),
        )
    });
    let client = RetryLayer::new(agent.endpoint("ep")).layer(svc);
    let start = Instant::now();
    let response = client.oneshot(grpc_request("100m")).await.unwrap();
    tokio::time::sleep_until(start + Duration::from_millis(300)).await;
    let body = response.into_body();
    let read = if unconstrained {
        tokio::spawn(tokio::task::unconstrained(read_all(body, yield_each)))
    } else {
        tokio::spawn(read_all(body, yield_each))
    };
    tokio::time::timeout(Duration::from_secs(60), read)
        .await
        .expect("the read ends")
        .unwrap()
}

#[tokio::test]
async fn a_reader_that_yields_gets_16_mib_past_the_deadline_then_deadline_exceeded() {
    // What holds: read frame by frame with a yield between frames, the cap of 16 MiB of data
    // past the deadline ends the answer.
    let (data, end) = read_after_deadline(true).await;
    let error = end.expect_err("ended by the deadline");
    assert!(error.contains("deadline"), "{error}");
    assert!(
        data <= 16 * MIB + KIB,
        "{data} bytes read past the deadline"
    );
}

#[tokio::test]
async fn a_reader_in_one_task_poll_is_not_held_to_16_mib_past_the_deadline() {
    // The same answer read in one go (`frame().await` in a loop, or `collect()`, on frames
    // that are there): once the task's coop budget is spent, the deadline's timer answers
    // Pending whatever the time; the cap still holds (the clock is read too).
    let (data, end) = read_after_deadline(false).await;
    assert!(
        data <= 16 * MIB + KIB && end.is_err(),
        "read {} MiB past the caller's deadline (cap: 16 MiB), ended {end:?}",
        data / MIB
    );
}

#[tokio::test]
async fn the_same_read_outside_the_coop_budget_is_held_to_16_mib() {
    // The same read with the coop budget off.
    let (data, end) = read_after_deadline_with(false, true).await;
    assert!(end.is_err(), "{end:?}");
    assert!(
        data <= 16 * MIB + KIB,
        "{data} bytes read past the deadline"
    );
}

#[tokio::test(start_paused = true)]
async fn a_reader_slower_than_a_stream_that_goes_on_is_not_ended_by_the_deadline() {
    // An upstream stream of 64-byte messages every 2 ms that goes on past the caller's 100 ms
    // deadline; the caller reads one every 4 ms. Frames are always there when it reads; what
    // came after the deadline is not given (at 16 KB/s, the 16 MiB cap alone would take some
    // 17 minutes).
    let agent = agent(&policy("max_attempts: 3"));
    let svc = service_fn(move |_req: Request<ReplayBody<Full<Bytes>>>| async move {
        Ok::<_, Infallible>(
            Response::builder()
                .status(200)
                .header("content-type", "application/grpc")
                .body(Paced {
                    next: Instant::now(),
                    every: Duration::from_millis(2),
                    size: 64,
                    sleep: Box::pin(tokio::time::sleep(Duration::ZERO)),
                })
                .unwrap(),
        )
    });
    let client = RetryLayer::new(agent.endpoint("ep")).layer(svc);
    let start = Instant::now();
    let deadline = start + Duration::from_millis(100);
    let mut body = client
        .oneshot(grpc_request("100m"))
        .await
        .unwrap()
        .into_body();
    let mut past = 0_usize;
    let ended_at = loop {
        match body.frame().await {
            Some(Ok(frame)) => {
                if Instant::now() > deadline {
                    past += frame.data_ref().map_or(0, Bytes::len);
                }
            }
            Some(Err(_)) | None => break Some(start.elapsed()),
        }
        if start.elapsed() > Duration::from_secs(60) {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(4)).await;
    };
    assert!(
        ended_at.is_some_and(|t| t < Duration::from_secs(5)),
        "the caller's deadline was 100 ms; the answer had not ended {:?} after the call began \
         ({past} bytes read past the deadline)",
        start.elapsed()
    );
}

/// A body that gives nothing until `at`, then its trailers (`grpc-status: 0`).
struct TrailersAt {
    at: Instant,
    sleep: Pin<Box<Sleep>>,
    done: bool,
}

impl Body for TrailersAt {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.done {
            return Poll::Ready(None);
        }
        if Instant::now() < self.at {
            let _ = self.sleep.as_mut().poll(cx);
            return Poll::Pending;
        }
        self.done = true;
        Poll::Ready(Some(Ok(Frame::trailers(ok_trailers()))))
    }
}

/// The layer's answer (caller's deadline `timeout` ms) of a body that gives trailers only
/// `trailers_after` after the call.
async fn trailers_answer(
    timeout_ms: u64,
    trailers_after: Duration,
) -> retryplane_agent::layer::ResponseBody<TrailersAt> {
    let agent = agent(&policy("max_attempts: 3"));
    let svc = service_fn(move |_req: Request<ReplayBody<Full<Bytes>>>| async move {
        let at = Instant::now() + trailers_after;
        Ok::<_, Infallible>(
            Response::builder()
                .status(200)
                .header("content-type", "application/grpc")
                .body(TrailersAt {
                    at,
                    sleep: Box::pin(tokio::time::sleep_until(at)),
                    done: false,
                })
                .unwrap(),
        )
    });
    let client = RetryLayer::new(agent.endpoint("ep")).layer(svc);
    client
        .oneshot(grpc_request(&format!("{timeout_ms}m")))
        .await
        .unwrap()
        .into_body()
}

#[tokio::test(start_paused = true)]
async fn edges_that_hold_waker_after_error_first_poll_late_trailers_at_deadline() {
    // A reader waiting on a body that sends nothing is woken at the deadline.
    let start = Instant::now();
    let mut body = trailers_answer(100, Duration::from_secs(3600)).await;
    let first = tokio::time::timeout(Duration::from_secs(10), body.frame())
        .await
        .expect("woken at the deadline");
    let error = first.unwrap().unwrap_err().to_string();
    assert!(error.contains("deadline"), "{error}");
    let took = start.elapsed();
    assert!(
        (Duration::from_millis(100)..Duration::from_millis(110)).contains(&took),
        "{took:?}"
    );
    // Polled after its error: the end, and the body says so.
    assert!(body.frame().await.is_none());
    assert!(body.is_end_stream());
    assert_eq!(body.size_hint().lower(), 0);

    // First polled long after its deadline, nothing there: the error at once.
    let mut body = trailers_answer(100, Duration::from_secs(3600)).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let start = Instant::now();
    let first = tokio::time::timeout(Duration::from_secs(10), body.frame())
        .await
        .unwrap();
    assert!(first.unwrap().is_err());
    assert_eq!(start.elapsed(), Duration::ZERO);

    // Trailers that come at the deadline's very instant: the answer ends with them.
    let mut body = trailers_answer(100, Duration::from_millis(100)).await;
    let frame = tokio::time::timeout(Duration::from_secs(10), body.frame())
        .await
        .unwrap()
        .unwrap()
        .expect("the trailers, not the deadline's error");
    assert!(frame.is_trailers());
    assert!(body.frame().await.is_none());
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

/// The answer through the layer (caller's deadline 100 ms) of an upstream whose `data` 1 KiB
/// frames and end (trailers, or an error if `fail`) are all there, after the deadline.
async fn ready_answer(
    data: usize,
    fail: bool,
) -> retryplane_agent::layer::ResponseBody<AlwaysReady> {
    let agent = agent(&policy("max_attempts: 3"));
    let svc = service_fn(move |_req: Request<ReplayBody<Full<Bytes>>>| async move {
        Ok::<_, Infallible>(
            Response::builder()
                .status(200)
                .header("content-type", "application/grpc")
                .body(AlwaysReady {
                    left: data,
                    size: KIB,
                    trailers: true,
                    fail,
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
