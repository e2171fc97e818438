//! The ends of an answer the tower layer reads: trailers taken just before a check of the
//! deadline are kept (the de-duplication leader's read, a failed answer returned), an answer of
//! small frames all there at the deadline is read whole, and a kept body of exactly the limit,
//! or of more empty frames than the allowance, is read to its end, which frees its connection.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::collections::VecDeque;
use std::future::Future as _;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, Response};
use http_body_util::{BodyExt as _, Full};
use retryplane_agent::layer::{Dedup, Deduplicated, ReplayBody, RetryLayer};
use support::{agent, policy};
use tokio::time::{Instant, Sleep};
use tower::{Layer as _, ServiceExt as _, service_fn};

/// Nothing until `sleep` ends, then `data` frames of `size` bytes and (if any) trailers, all
/// there at once.
struct AtOnce {
    sleep: Pin<Box<Sleep>>,
    due: bool,
    data: usize,
    size: usize,
    trailers: Option<HeaderMap>,
}

impl http_body::Body for AtOnce {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, io::Error>>> {
        if !self.due {
            if self.sleep.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            self.due = true;
        }
        if self.data > 0 {
            self.data -= 1;
            return Poll::Ready(Some(Ok(http_body::Frame::data(Bytes::from(vec![
                b'x';
                self.size
            ])))));
        }
        Poll::Ready(
            self.trailers
                .take()
                .map(|t| Ok(http_body::Frame::trailers(t))),
        )
    }
}

fn get() -> Request<Full<Bytes>> {
    Request::builder()
        .method("GET")
        .uri("http://up/big")
        .body(Full::new(Bytes::new()))
        .unwrap()
}

/// Leader and follower of one de-duplicated GET whose answer's body (`data` frames of `size`
/// bytes, then `trailers`) is all there at the call's deadline. Returns (leader's bytes,
/// leader's trailers, follower's result: (shared copy?, bytes)).
async fn at_deadline(
    data: usize,
    size: usize,
    trailers: Option<HeaderMap>,
) -> (usize, Option<HeaderMap>, Result<(bool, usize), String>) {
    const DEADLINE: Duration = Duration::from_secs(10);
    let t0 = Instant::now();
    let seen = Arc::new(Mutex::new(0usize));
    let count = seen.clone();
    let trailers_sent = trailers.is_some();
    let svc = service_fn(move |_req: Request<ReplayBody<Full<Bytes>>>| {
        let count = count.clone();
        let trailers = trailers.clone();
        async move {
            *count.lock().unwrap() += 1;
            Ok::<_, io::Error>(
                Response::builder()
                    .body(AtOnce {
                        sleep: Box::pin(tokio::time::sleep_until(t0 + DEADLINE)),
                        due: false,
                        data,
                        size,
                        trailers,
                    })
                    .unwrap(),
            )
        }
    });
    let agent = agent(&policy(
        "max_attempts: 3\ndeadline: 10s\nper_try_timeout: 10s",
    ));
    let client = RetryLayer::new(agent.endpoint("ep"))
        .with_dedup(Dedup::default())
        .layer(svc);
    let c = client.clone();
    let leader = tokio::spawn(async move { c.oneshot(get()).await });
    for _ in 0..10_000 {
        if *seen.lock().unwrap() == 1 {
            break;
        }
        tokio::task::yield_now().await;
    }
    let c = client.clone();
    let follower = tokio::spawn(async move {
        let trailers_sent = trailers_sent;
        let r = match c.oneshot(get()).await {
            Ok(r) => r,
            Err(e) => return Err(e.to_string()),
        };
        let copy = r.extensions().get::<Deduplicated>().is_some();
        let collected = r.into_body().collect().await.map_err(|e| e.to_string())?;
        let has_trailers = collected.trailers().is_some();
        let body = collected.to_bytes();
        // A shared copy carries the trailers the leader got.
        if copy && trailers_sent != has_trailers {
            return Err(format!(
                "the follower's copy: trailers {has_trailers}, sent {trailers_sent}"
            ));
        }
        Ok((copy, body.len()))
    });
    let leader = tokio::time::timeout(Duration::from_secs(60), leader)
        .await
        .expect("leader hung")
        .unwrap()
        .unwrap();
    let collected = leader.into_body().collect().await.unwrap();
    let trailers = collected.trailers().cloned();
    let len = collected.to_bytes().len();
    let follower = tokio::time::timeout(Duration::from_secs(60), follower)
        .await
        .expect("follower hung")
        .unwrap();
    (len, trailers, follower)
}

fn checksum() -> HeaderMap {
    let mut t = HeaderMap::new();
    t.insert("x-checksum", HeaderValue::from_static("abc"));
    t
}

/// An answer whose trailers come as the 63rd frame, all there at the deadline: the read's
/// look at the deadline (every 64 frames) sees the trailers as a frame that "brought nothing"
/// and ends the read as late, dropping the trailers it has already taken from the body. The
/// leader's caller gets the bytes and no trailers.
#[tokio::test(start_paused = true)]
async fn trailers_taken_just_before_the_deadline_check_are_not_lost() {
    let (len, trailers, _follower) = at_deadline(62, 100, Some(checksum())).await;
    assert_eq!(len, 6200);
    assert_eq!(
        trailers.as_ref().and_then(|t| t.get("x-checksum")),
        Some(&HeaderValue::from_static("abc")),
        "the leader's answer lost its trailers"
    );
}

/// The same answer with its trailers as the 62nd frame (control: passes).
#[tokio::test(start_paused = true)]
async fn trailers_at_another_frame_are_kept_and_shared() {
    let (len, trailers, follower) = at_deadline(61, 100, Some(checksum())).await;
    assert_eq!(len, 6100);
    assert!(trailers.is_some_and(|t| t.contains_key("x-checksum")));
    assert_eq!(follower, Ok((true, 6100)));
}

#[tokio::test(start_paused = true)]
async fn small_frames_all_there_at_the_deadline_are_read_whole_and_shared() {
    // 3,000 frames of 256 bytes (750 KiB, within the 1 MiB limit) all there at the deadline.
    let (len, _, follower) = at_deadline(3000, 256, None).await;
    assert_eq!(len, 3000 * 256);
    assert_eq!(
        follower,
        Ok((true, 3000 * 256)),
        "the follower did not get the leader's answer"
    );
}

// ---- the kept answer's empty frames, with one connection below ----

enum Step {
    Wait(Duration),
    Empty(usize),
    Data(&'static str),
}

struct Scripted {
    steps: VecDeque<Step>,
    sleep: Option<Pin<Box<Sleep>>>,
    conn: Option<Arc<Conn>>,
}

#[derive(Default)]
struct Conn {
    busy: Mutex<(bool, Option<std::task::Waker>)>,
}

impl http_body::Body for Scripted {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, io::Error>>> {
        loop {
            if let Some(s) = self.sleep.as_mut() {
                if s.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                self.sleep = None;
            }
            match self.steps.pop_front() {
                None => {
                    if let Some(c) = self.conn.take() {
                        let mut b = c.busy.lock().unwrap();
                        b.0 = false;
                        if let Some(w) = b.1.take() {
                            w.wake();
                        }
                    }
                    return Poll::Ready(None);
                }
                Some(Step::Wait(d)) => self.sleep = Some(Box::pin(tokio::time::sleep(d))),
                Some(Step::Empty(n)) => {
                    if n > 1 {
                        self.steps.push_front(Step::Empty(n - 1));
                    }
                    return Poll::Ready(Some(Ok(http_body::Frame::data(Bytes::new()))));
                }
                Some(Step::Data(s)) => {
                    return Poll::Ready(Some(Ok(http_body::Frame::data(Bytes::from_static(
                        s.as_bytes(),
                    )))));
                }
            }
        }
    }
}

#[derive(Clone)]
struct OneConn {
    n: Arc<AtomicUsize>,
    conn: Arc<Conn>,
    /// The first answer's body after its first 30 ms (the default: 4,200 empty frames).
    first: Option<Vec<&'static str>>,
}

impl tower::Service<Request<ReplayBody<Full<Bytes>>>> for OneConn {
    type Response = Response<Scripted>;
    type Error = io::Error;
    type Future = std::future::Ready<Result<Response<Scripted>, io::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), io::Error>> {
        let mut b = self.conn.busy.lock().unwrap();
        if b.0 {
            b.1 = Some(cx.waker().clone());
            Poll::Pending
        } else {
            Poll::Ready(Ok(()))
        }
    }

    fn call(&mut self, _req: Request<ReplayBody<Full<Bytes>>>) -> Self::Future {
        let i = self.n.fetch_add(1, Ordering::SeqCst);
        self.conn.busy.lock().unwrap().0 = true;
        let (status, steps) = match i {
            // Nothing within the attempt's read (20 ms), then 4,200 empty frames (all there)
            // and the end: a few more than the allowance.
            0 => (
                503,
                match &self.first {
                    None => vec![
                        Step::Wait(Duration::from_millis(30)),
                        Step::Empty(4_200),
                        Step::Data("end"),
                    ],
                    Some(parts) => std::iter::once(Step::Wait(Duration::from_millis(30)))
                        .chain(parts.iter().map(|p| Step::Data(p)))
                        .collect(),
                },
            ),
            _ => (200, vec![Step::Data("ok")]),
        };
        std::future::ready(Ok(Response::builder()
            .status(status)
            .body(Scripted {
                steps: steps.into(),
                sleep: None,
                conn: Some(self.conn.clone()),
            })
            .unwrap()))
    }
}

/// A kept answer whose body is exactly 64 KiB (the layer's limit for failed answers, which
/// `read_failed` itself reads whole: it stops only past the limit), all there 30 ms after its
/// head: the read on stops as the bytes reach the limit, before the end it would find at the
/// next poll, so the one connection below is not freed and the retry waits to the deadline.
/// (One byte less: read to its end, the retry goes out at once.)
async fn kept_body_of(len: usize) -> (u16, usize, Duration) {
    let chunk: &'static str = Box::leak("b".repeat(4096).into_boxed_str());
    let mut parts = vec![chunk; len / 4096];
    if !len.is_multiple_of(4096) {
        parts.push(&chunk[..len % 4096]);
    }
    let n = Arc::new(AtomicUsize::new(0));
    let svc = OneConn {
        n: n.clone(),
        conn: Arc::new(Conn::default()),
        first: Some(parts),
    };
    let agent = agent(&policy(
        "max_attempts: 3\ndeadline: 1s\nper_try_timeout: 1s\nbackoff: {base: 100ms, max: 100ms, jitter: none}",
    ));
    let client = RetryLayer::new(agent.endpoint("ep")).layer(svc);
    let t0 = Instant::now();
    let response = tokio::time::timeout(Duration::from_secs(60), client.oneshot(get()))
        .await
        .expect("the call ends")
        .expect("an answer");
    (
        response.status().as_u16(),
        n.load(Ordering::SeqCst),
        t0.elapsed(),
    )
}

/// A kept answer with a few more empty frames than the allowance (4,096), all there, then its
/// end, with one connection below: past the allowance the layer reads on more slowly, so the
/// body still ends and frees the connection for the retry long before the deadline (1 s).
#[tokio::test(start_paused = true)]
async fn empty_frames_past_the_allowance_do_not_hold_the_retry_to_the_deadline() {
    let n = Arc::new(AtomicUsize::new(0));
    let svc = OneConn {
        n: n.clone(),
        conn: Arc::new(Conn::default()),
        first: None,
    };
    let agent = agent(&policy(
        "max_attempts: 3\ndeadline: 1s\nper_try_timeout: 1s\nbackoff: {base: 100ms, max: 100ms, jitter: none}",
    ));
    let client = RetryLayer::new(agent.endpoint("ep")).layer(svc);
    let t0 = Instant::now();
    let response = tokio::time::timeout(Duration::from_secs(60), client.oneshot(get()))
        .await
        .expect("the call ends")
        .expect("an answer");
    let took = t0.elapsed();
    assert_eq!(
        (response.status().as_u16(), n.load(Ordering::SeqCst)),
        (200, 2),
        "after {took:?}: the retry did not go out"
    );
    assert!(
        took < Duration::from_millis(500),
        "the retry waited {took:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_kept_body_one_byte_under_the_limit_frees_the_one_connection() {
    let (status, n, took) = kept_body_of(64 * 1024 - 1).await;
    assert_eq!((status, n), (200, 2), "after {took:?}");
}

#[tokio::test(start_paused = true)]
async fn a_kept_body_of_exactly_the_limit_frees_the_one_connection() {
    let (status, n, took) = kept_body_of(64 * 1024).await;
    assert_eq!(
        (status, n),
        (200, 2),
        "after {took:?}: the body (all there, ended) was not read to its end: the retry never went out"
    );
}

/// Without de-duplication: a failed answer (503) whose body, 62 data frames then trailers,
/// is all there just as the attempt's read of it (20 ms) ends. The read is cut at its look at
/// the deadline after taking the trailers; the call then gives up (no retry fits the deadline)
/// and returns that answer, its trailers gone.
/// The trailers of the failed answer the call returns, its body `data` frames of 100 bytes
/// then trailers.
async fn returned_failed(data: usize) -> Option<HeaderMap> {
    let t0 = Instant::now();
    let svc = service_fn(move |_req: Request<ReplayBody<Full<Bytes>>>| async move {
        Ok::<_, io::Error>(
            Response::builder()
                .status(503)
                .body(AtOnce {
                    sleep: Box::pin(tokio::time::sleep_until(t0 + Duration::from_millis(20))),
                    due: false,
                    data,
                    size: 100,
                    trailers: Some(checksum()),
                })
                .unwrap(),
        )
    });
    let agent = agent(&policy(
        "max_attempts: 2\ndeadline: 300ms\nper_try_timeout: 300ms\nbackoff: {base: 1s, max: 1s, jitter: none}",
    ));
    let client = RetryLayer::new(agent.endpoint("ep")).layer(svc);
    let response = tokio::time::timeout(Duration::from_secs(60), client.oneshot(get()))
        .await
        .expect("the call ends")
        .expect("an answer");
    assert_eq!(response.status(), 503);
    let collected = response.into_body().collect().await.unwrap();
    let trailers = collected.trailers().cloned();
    assert_eq!(collected.to_bytes().len(), data * 100);
    trailers
}

#[tokio::test(start_paused = true)]
async fn a_returned_failed_answer_keeps_its_trailers() {
    assert!(
        returned_failed(62)
            .await
            .is_some_and(|t| t.contains_key("x-checksum")),
        "the answer returned lost its trailers"
    );
}

#[tokio::test(start_paused = true)]
async fn a_returned_failed_answer_with_trailers_at_another_frame_keeps_them() {
    assert!(
        returned_failed(61)
            .await
            .is_some_and(|t| t.contains_key("x-checksum"))
    );
}
