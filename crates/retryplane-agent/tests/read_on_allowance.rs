//! Reading on a kept answer after an earlier kept answer of the same call spent its allowance
//! of empty frames: each kept answer has its own, and only empty frames spend it, so the later
//! one's body is read to its end and frees the one connection the retry waits for.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::collections::VecDeque;
use std::future::Future as _;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use retryplane_agent::layer::{ReplayBody, RetryLayer};
use tokio::time::Sleep;
use tower::{Layer as _, ServiceExt as _};

enum Step {
    Wait(Duration),
    Empty(usize),
    Data(&'static str),
}

struct Scripted {
    steps: VecDeque<Step>,
    sleep: Option<Pin<Box<Sleep>>>,
    /// Set when the body has been read to its end (the connection is free again).
    conn: Option<Arc<Conn>>,
}

/// One HTTP/1-like connection: ready again only once the last answer's body has ended.
#[derive(Default)]
struct Conn {
    busy: std::sync::Mutex<(bool, Option<std::task::Waker>)>,
}

impl Conn {
    fn free(&self) {
        let mut b = self.busy.lock().unwrap();
        b.0 = false;
        if let Some(w) = b.1.take() {
            w.wake();
        }
    }
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
                        c.free();
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

#[tokio::test(start_paused = true)]
async fn a_later_kept_answer_is_read_on_after_an_earlier_spent_the_allowance() {
    let n = Arc::new(AtomicUsize::new(0));
    let conn = Arc::new(Conn::default());
    let svc = OneConn {
        n: n.clone(),
        conn: conn.clone(),
    };
    let agent = support::agent(&support::policy(
        "max_attempts: 3\ndeadline: 1s\nper_try_timeout: 1s\nbackoff: {base: 100ms, max: 100ms, jitter: none}",
    ));
    let client = RetryLayer::new(agent.endpoint("ep")).layer(svc);
    let request = Request::builder()
        .uri("http://up/v1/items")
        .body(Full::<Bytes>::default())
        .unwrap();
    let response = tokio::time::timeout(Duration::from_secs(60), client.oneshot(request))
        .await
        .expect("the call ends")
        .expect("an answer");
    assert_eq!(
        (response.status().as_u16(), n.load(Ordering::SeqCst)),
        (200, 3),
        "the second kept answer was not read on while the call waited for the one connection \
         (the first answer spent the call's allowance of empty frames): the retry never went out"
    );
}

#[derive(Clone)]
struct OneConn {
    n: Arc<AtomicUsize>,
    conn: Arc<Conn>,
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
            // Nothing within the attempt's read (20 ms), then 4,095 empty frames (all but one
            // of the call's allowance, read on in the pause), then `first` and its end.
            0 => (
                503,
                vec![
                    Step::Wait(Duration::from_millis(30)),
                    Step::Empty(4_095),
                    Step::Data("first"),
                ],
            ),
            // `x` at once; 40 ms later (inside the pause) one empty frame, `yz` and the end.
            1 => (
                503,
                vec![
                    Step::Data("x"),
                    Step::Wait(Duration::from_millis(40)),
                    Step::Empty(1),
                    Step::Data("yz"),
                ],
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
