//! Waiting for the service below the tower layer to have room, before an attempt.
//!
//! An attempt's per-try timeout starts when the attempt is sent (SPEC §2). The wait for
//! capacity below the layer (a concurrency limit, a buffer's slot) comes before that, as it
//! does in tower, where `poll_ready` runs before a `Timeout` layer's `call` starts its timer:
//! a slow queue below the client is the caller's wait, bounded by the call's deadline, not an
//! upstream that did not answer in time. [`Endpoint::call`](crate::Endpoint::call) has nothing
//! to wait for ([`AlwaysReady`]); the layer readies its inner service this way before each
//! retry and, with de-duplication, before the first attempt.

use std::future::Future as _;
use std::pin::pin;
use std::task::{Context, Poll};
use std::time::Duration;

use retryplane_policy::breaker::{BreakerState, CircuitBreaker};
use tokio::time::Instant;

/// Something an attempt needs to be ready before it is sent.
pub(crate) trait Ready<E> {
    /// Whether there is anything to wait for at all (`false`: the step is skipped).
    fn needed(&self) -> bool;
    /// Readies it, as `tower::Service::poll_ready` does; an error means nothing can be sent.
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), E>>;
}

/// Nothing to wait for: [`crate::Endpoint::call`]'s attempts are the caller's own futures.
pub(crate) struct AlwaysReady;

impl<E> Ready<E> for AlwaysReady {
    #[inline]
    fn needed(&self) -> bool {
        false
    }

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), E>> {
        Poll::Ready(Ok(()))
    }
}

/// How a [`wait_ready`] ended.
#[derive(Debug)]
pub(crate) enum Readied<E> {
    /// Ready: the attempt may be sent.
    Ready,
    /// The deadline came first; the attempt will not be sent (the engine gives up with
    /// `deadline_exceeded`).
    Late,
    /// The breaker refuses the attempt now; waiting on would be for nothing (the engine gives
    /// up with `circuit_open`).
    Refused,
    /// Readying failed (the caller decides what that error means for its attempt).
    Failed(E),
}

/// How often a call waiting for capacity asks the breaker again whether it would be refused:
/// the breaker may open meanwhile (other calls failing), and a call it will refuse should
/// fail fast, not wait out its deadline. A tenth of a second is well under any `open_for`
/// and costs a waiting call ten timer wake-ups a second.
pub(crate) const BREAKER_RECHECK: Duration = Duration::from_millis(100);

/// Waits until `ready` is ready, at most until `deadline`, and not while `refused` says the
/// attempt would be refused: asked first, before the service is polled at all (a service
/// below may dial the upstream to get ready, which the breaker has cut off), and every
/// [`BREAKER_RECHECK`] during the wait. A service ready at once takes no clock read.
pub(crate) async fn wait_ready<E, R, F>(ready: &mut R, deadline: Instant, refused: F) -> Readied<E>
where
    R: Ready<E> + ?Sized,
    F: Fn() -> bool,
{
    if refused() {
        return Readied::Refused;
    }
    let mut readiness = pin!(std::future::poll_fn(|cx| ready.poll_ready(cx)));
    // Ready at once (or failed): no wait, no clock read.
    let once = std::future::poll_fn(|cx| Poll::Ready(readiness.as_mut().poll(cx))).await;
    if let Poll::Ready(r) = once {
        return r.map_or_else(Readied::Failed, |()| Readied::Ready);
    }
    loop {
        let now = Instant::now();
        if now >= deadline {
            return Readied::Late;
        }
        let until = deadline.min(now + BREAKER_RECHECK);
        tokio::select! {
            biased;
            r = readiness.as_mut() => return r.map_or_else(Readied::Failed, |()| Readied::Ready),
            () = tokio::time::sleep_until(until) => {}
        }
        if refused() {
            return Readied::Refused;
        }
    }
}

/// Whether `breaker` (the one a call's policy uses, if any) would refuse an attempt now. The
/// clock is read only when the breaker is not closed.
pub(crate) fn refuses_now(breaker: Option<&CircuitBreaker>) -> bool {
    breaker.is_some_and(|b| !b.is_closed() && b.would_refuse(Instant::now()))
}

/// Whether `breaker` is open now (not half-open): what holds back the second send of an
/// attempt that already has its permit. The clock is read only when it is not closed.
pub(crate) fn open_now(breaker: Option<&CircuitBreaker>) -> bool {
    breaker.is_some_and(|b| !b.is_closed() && b.state(Instant::now()) == BreakerState::Open)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use tokio::sync::{OwnedSemaphorePermit, Semaphore};

    use super::*;

    /// Ready once a permit of `room` is free (a concurrency limit of its size).
    struct Limit {
        room: Arc<Semaphore>,
        acquire: Option<tokio_util::sync::PollSemaphore>,
        held: Option<OwnedSemaphorePermit>,
        fail: bool,
    }

    impl Limit {
        fn new(room: &Arc<Semaphore>) -> Self {
            Self {
                room: Arc::clone(room),
                acquire: None,
                held: None,
                fail: false,
            }
        }
    }

    impl Ready<&'static str> for Limit {
        fn needed(&self) -> bool {
            true
        }

        fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), &'static str>> {
            if self.fail {
                return Poll::Ready(Err("closed"));
            }
            if self.held.is_some() {
                return Poll::Ready(Ok(()));
            }
            let room = &self.room;
            let acquire = self
                .acquire
                .get_or_insert_with(|| tokio_util::sync::PollSemaphore::new(Arc::clone(room)));
            match acquire.poll_acquire(cx) {
                Poll::Ready(Some(permit)) => {
                    self.held = Some(permit);
                    Poll::Ready(Ok(()))
                }
                Poll::Ready(None) => Poll::Ready(Err("closed")),
                Poll::Pending => Poll::Pending,
            }
        }
    }

    fn never() -> bool {
        false
    }

    #[tokio::test(start_paused = true)]
    async fn ready_at_once_does_not_wait() {
        let room = Arc::new(Semaphore::new(1));
        let mut limit = Limit::new(&room);
        let start = Instant::now();
        let r = wait_ready(&mut limit, start, never).await;
        assert!(matches!(r, Readied::Ready), "{r:?}");
        assert_eq!(Instant::now(), start);
        assert_eq!(room.available_permits(), 0, "the permit is held");
    }

    #[tokio::test(start_paused = true)]
    async fn waits_for_room_and_is_ready_when_it_comes() {
        let room = Arc::new(Semaphore::new(1));
        let busy = Arc::clone(&room).acquire_owned().await.unwrap();
        let start = Instant::now();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(750)).await;
            drop(busy);
        });
        let mut limit = Limit::new(&room);
        let r = wait_ready(&mut limit, start + Duration::from_secs(5), never).await;
        assert!(matches!(r, Readied::Ready), "{r:?}");
        assert_eq!(Instant::now() - start, Duration::from_millis(750));
    }

    #[tokio::test(start_paused = true)]
    async fn gives_up_at_the_deadline_without_room() {
        let room = Arc::new(Semaphore::new(0));
        let start = Instant::now();
        let mut limit = Limit::new(&room);
        let deadline = start + Duration::from_millis(1234);
        let r = wait_ready(&mut limit, deadline, never).await;
        assert!(matches!(r, Readied::Late), "{r:?}");
        assert_eq!(Instant::now(), deadline);
        // A deadline already past is late at once.
        let r = wait_ready(&mut Limit::new(&room), start, never).await;
        assert!(matches!(r, Readied::Late), "{r:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_breaker_that_opens_during_the_wait_ends_it_within_a_recheck() {
        let room = Arc::new(Semaphore::new(0));
        let start = Instant::now();
        let open = Arc::new(AtomicBool::new(false));
        let opener = Arc::clone(&open);
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(250)).await;
            opener.store(true, Ordering::Relaxed);
        });
        let mut limit = Limit::new(&room);
        let r = wait_ready(&mut limit, start + Duration::from_secs(5), || {
            open.load(Ordering::Relaxed)
        })
        .await;
        assert!(matches!(r, Readied::Refused), "{r:?}");
        let waited = Instant::now() - start;
        assert!(
            waited >= Duration::from_millis(250)
                && waited <= Duration::from_millis(250) + BREAKER_RECHECK,
            "{waited:?}"
        );
        // Already refusing: no wait at all, and the service is not even polled (it may dial
        // an upstream to get ready); polled, this one would fail.
        let before = Instant::now();
        let room = Arc::new(Semaphore::new(1));
        let mut limit = Limit::new(&room);
        limit.fail = true;
        let r = wait_ready(&mut limit, before + Duration::from_secs(5), || true).await;
        assert!(matches!(r, Readied::Refused), "{r:?}");
        assert_eq!(Instant::now(), before);
    }

    #[tokio::test(start_paused = true)]
    async fn a_readiness_error_is_handed_back() {
        let room = Arc::new(Semaphore::new(1));
        let mut limit = Limit::new(&room);
        limit.fail = true;
        let r = wait_ready(&mut limit, Instant::now() + Duration::from_secs(1), never).await;
        assert!(matches!(r, Readied::Failed("closed")), "{r:?}");
        // Closed while waiting.
        let room = Arc::new(Semaphore::new(0));
        let closer = Arc::clone(&room);
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(10)).await;
            closer.close();
        });
        let r = wait_ready(
            &mut Limit::new(&room),
            Instant::now() + Duration::from_secs(1),
            never,
        )
        .await;
        assert!(matches!(r, Readied::Failed("closed")), "{r:?}");
    }
}
