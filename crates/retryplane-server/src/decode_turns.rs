//! Admin calls that carry a policy (Validate, Apply) wait for a turn before their message is
//! decoded. The admin service checks [`MAX_CONCURRENT_CHECKS`](crate::admin::MAX_CONCURRENT_CHECKS)
//! documents at once, but tonic decodes a request before its handler runs: every call waiting
//! for a check held its decoded document (a viewer's two dozen Validate calls of a 4 MB
//! document held about 170 MB each). Past [`MAX_DECODED`], such a call waits here with its
//! message undecoded (what HTTP/2 flow control lets its client send).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::sync::Semaphore;
use tonic::body::Body;
use tonic::codegen::Service;
use tonic::server::NamedService;

/// The most calls that carry a policy decoded at once: those being checked and as many waiting
/// for a check.
pub const MAX_DECODED: usize = 2 * crate::admin::MAX_CONCURRENT_CHECKS;

/// The admin methods whose request carries a policy document.
const CARRY_A_POLICY: [&str; 2] = [
    "/retryplane.v1.AdminService/Validate",
    "/retryplane.v1.AdminService/Apply",
];

/// `S` (the admin service), with the calls that carry a policy decoded [`MAX_DECODED`] at most
/// at once.
#[derive(Clone, Debug)]
pub struct DecodeTurns<S> {
    inner: S,
    turns: Arc<Semaphore>,
}

impl<S> DecodeTurns<S> {
    /// Wraps `inner`.
    pub fn new(inner: S) -> Self {
        Self::with_turns(inner, MAX_DECODED)
    }

    fn with_turns(inner: S, turns: usize) -> Self {
        Self {
            inner,
            turns: Arc::new(Semaphore::new(turns)),
        }
    }
}

impl<S: NamedService> NamedService for DecodeTurns<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> Service<http::Request<Body>> for DecodeTurns<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let turns = CARRY_A_POLICY
            .contains(&request.uri().path())
            .then(|| self.turns.clone());
        // tonic's handler reads and decodes the message only when its future is polled.
        let answer = self.inner.call(request);
        Box::pin(async move {
            // The semaphore is never closed; should it be, the call goes on without a turn.
            let _turn = match turns {
                Some(turns) => turns.acquire_owned().await.ok(),
                None => None,
            };
            answer.await
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use tokio::sync::Notify;

    use super::*;

    /// A service whose answers wait for `release`, counting the calls it has begun.
    #[derive(Clone)]
    struct Held {
        begun: Arc<AtomicUsize>,
        release: Arc<Notify>,
    }

    impl Service<http::Request<Body>> for Held {
        type Response = http::Response<Body>;
        type Error = std::convert::Infallible;
        type Future =
            Pin<Box<dyn Future<Output = Result<http::Response<Body>, Self::Error>> + Send>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, _: http::Request<Body>) -> Self::Future {
            let (begun, release) = (self.begun.clone(), self.release.clone());
            Box::pin(async move {
                begun.fetch_add(1, Ordering::SeqCst);
                release.notified().await;
                Ok(http::Response::new(Body::empty()))
            })
        }
    }

    fn request(path: &str) -> http::Request<Body> {
        http::Request::builder()
            .uri(format!("http://localhost{path}"))
            .body(Body::empty())
            .unwrap()
    }

    /// Past its turns, a Validate or Apply call is not begun (its message not decoded) until one
    /// ends; other calls are not held.
    #[tokio::test]
    async fn calls_that_carry_a_policy_begin_only_with_a_turn() {
        let held = Held {
            begun: Arc::new(AtomicUsize::new(0)),
            release: Arc::new(Notify::new()),
        };
        let mut service = DecodeTurns::with_turns(held.clone(), 2);
        let mut calls = tokio::task::JoinSet::new();
        for path in [
            "/retryplane.v1.AdminService/Validate",
            "/retryplane.v1.AdminService/Apply",
            "/retryplane.v1.AdminService/Validate",
            "/retryplane.v1.AdminService/FleetStatus",
        ] {
            calls.spawn(service.call(request(path)));
        }
        let begun = || held.begun.load(Ordering::SeqCst);
        let wait = std::time::Duration::from_secs(10);
        tokio::time::timeout(wait, async {
            while begun() < 3 {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("two with a turn and FleetStatus begin");
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert_eq!(
            begun(),
            3,
            "a third call carrying a policy began without a turn"
        );
        held.release.notify_one();
        tokio::time::timeout(wait, async {
            while begun() < 4 {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("the third begins once one ends");
        held.release.notify_waiters();
        held.release.notify_one();
    }
}
