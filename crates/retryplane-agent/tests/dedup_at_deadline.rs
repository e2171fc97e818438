//! A de-duplicated answer whose body is all there at the leader's deadline (paused clock), in
//! many frames (small chunks, or a large answer under a large response limit): read whole and
//! shared with the waiting follower.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt as _, Full};
use retryplane_agent::layer::{Dedup, Deduplicated, ReplayBody, RetryLayer};
use support::{agent, policy};
use tokio::time::{Instant, Sleep};
use tower::{Layer as _, ServiceExt as _, service_fn};

const SHORT: &str = "max_attempts: 3\ndeadline: 10s\nper_try_timeout: 10s";
const DEADLINE: Duration = Duration::from_secs(10);

/// A body with nothing until `at`, then `frames` frames of `size` bytes, all there at once.
struct AtOnce {
    sleep: Pin<Box<Sleep>>,
    left: usize,
    size: usize,
    n: u8,
    due: bool,
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
        if self.left == 0 {
            return Poll::Ready(None);
        }
        self.left -= 1;
        self.n = self.n.wrapping_add(1);
        let frame = Bytes::from(vec![self.n; self.size]);
        Poll::Ready(Some(Ok(http_body::Frame::data(frame))))
    }
}

use std::future::Future as _;

async fn shared_at_deadline(frames: usize, size: usize, limit: Option<usize>) {
    let t0 = Instant::now();
    let seen = Arc::new(Mutex::new(0usize));
    let count = seen.clone();
    let svc = service_fn(move |_req: Request<ReplayBody<Full<Bytes>>>| {
        let count = count.clone();
        async move {
            *count.lock().unwrap() += 1;
            Ok::<_, io::Error>(
                Response::builder()
                    .body(AtOnce {
                        sleep: Box::pin(tokio::time::sleep_until(t0 + DEADLINE)),
                        left: frames,
                        size,
                        n: 0,
                        due: false,
                    })
                    .unwrap(),
            )
        }
    });
    let mut dedup = Dedup::default();
    if let Some(limit) = limit {
        dedup = dedup.with_response_limit(limit);
    }
    let agent = agent(&policy(SHORT));
    let client = RetryLayer::new(agent.endpoint("ep"))
        .with_dedup(dedup.clone())
        .layer(svc);
    let get = || {
        Request::builder()
            .method("GET")
            .uri("http://up/big")
            .body(Full::new(Bytes::new()))
            .unwrap()
    };
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
        let r = match c.oneshot(get()).await {
            Ok(r) => r,
            Err(e) => return Err(e.to_string()),
        };
        let copy = r.extensions().get::<Deduplicated>().is_some();
        let body = r.into_body().collect().await.unwrap().to_bytes();
        Ok((copy, body.len()))
    });
    let leader = tokio::time::timeout(Duration::from_secs(60), leader)
        .await
        .expect("leader hung")
        .unwrap()
        .unwrap();
    let leader_len = leader.into_body().collect().await.unwrap().to_bytes().len();
    assert_eq!(leader_len, frames * size);
    let follower = tokio::time::timeout(Duration::from_secs(60), follower)
        .await
        .expect("follower hung")
        .unwrap();
    let (copy, len) = follower.unwrap_or_else(|e| {
        panic!(
            "{frames} frames of {size} B ({} KiB in all, limit {limit:?}) all there at the \
             deadline: not shared, the follower's own call failed: {e} ({:?})",
            frames * size / 1024,
            dedup.stats()
        )
    });
    assert_eq!(len, frames * size);
    assert!(
        copy,
        "{frames} frames of {size} B ({} KiB in all, limit {limit:?}) all there at the \
         deadline: not shared ({:?}, upstream calls {})",
        frames * size / 1024,
        dedup.stats(),
        seen.lock().unwrap()
    );
}

/// HTTP/2-sized frames (16 KiB), 24 MiB in all under a 32 MiB response limit.
#[tokio::test(start_paused = true)]
async fn large_answer_at_deadline_in_16k_frames_is_shared() {
    shared_at_deadline(1500, 16 * 1024, Some(32 * 1024 * 1024)).await;
}

/// 8 KiB frames, 12 MiB under a 16 MiB limit.
#[tokio::test(start_paused = true)]
async fn large_answer_at_deadline_in_8k_frames_is_shared() {
    shared_at_deadline(1500, 8 * 1024, Some(16 * 1024 * 1024)).await;
}

/// The default limit (1 MiB) with 8 KiB frames: 128 frames, within the allowance.
#[tokio::test(start_paused = true)]
async fn default_limit_8k_frames_is_shared() {
    shared_at_deadline(120, 8 * 1024, None).await;
}

/// The default limit (1 MiB) with small chunks (700 B, as a server flushing per line may send).
#[tokio::test(start_paused = true)]
async fn default_limit_small_chunks_is_shared() {
    shared_at_deadline(1400, 700, None).await;
}
