//! What the circuit breaker's window counts, in time: an outcome counts for `window` from when
//! it came.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::time::Duration;

use retryplane_agent::{Agent, CallMeta, Last};
use support::response;

fn get() -> CallMeta<'static> {
    CallMeta::http("GET", "/")
}

/// One call of `agent`'s `ep` whose one attempt answers `status` after `after`: the status
/// returned (given up on or not), or why no answer was.
async fn call(agent: &Agent, status: u16, after: Duration) -> Result<u16, String> {
    agent
        .endpoint("ep")
        .call(get(), move |_| async move {
            tokio::time::sleep(after).await;
            Ok::<_, std::io::Error>(response(status, None))
        })
        .await
        .map(|r| r.status().as_u16())
        .or_else(|e| match e.last {
            Some(Last::Response(r)) => Ok(r.status().as_u16()),
            _ => Err(e.cause.to_string()),
        })
}

#[tokio::test(start_paused = true)]
async fn a_slow_success_counts_in_the_breakers_window_from_when_it_came_not_from_when_it_started() {
    // Window 10 s; ten calls start at 0 s and succeed at 1.9 s, inside the per-try timeout;
    // ten fail at 10.5 s. The window then (0.5 s to 10.5 s) holds all twenty: half failed,
    // below the 0.6 that opens the breaker. Counted from their start (0 s), the successes
    // have left the window and the breaker sees ten failures out of ten.
    let agent = support::agent(
        "version: 1\ndefaults:\n  per_try_timeout: 2s\n  budget: {enabled: false}\n  circuit_breaker: {failure_ratio: 0.6, min_requests: 10, window: 10s, open_for: 30s, half_open_probes: 1}\nendpoints:\n  ep:\n    max_attempts: 1\n",
    );
    let slow: Vec<_> = (0..10)
        .map(|_| call(&agent, 200, Duration::from_millis(1900)))
        .collect();
    for r in futures_join(slow).await {
        assert_eq!(r, Ok(200));
    }
    tokio::time::sleep(Duration::from_millis(10_500 - 1900)).await;
    for _ in 0..10 {
        assert_eq!(call(&agent, 503, Duration::ZERO).await, Ok(503));
    }
    assert_eq!(
        call(&agent, 200, Duration::ZERO).await,
        Ok(200),
        "half of the last 10 s failed, below failure_ratio 0.6: the breaker should be closed"
    );
}

/// Runs `futs` together, in order of their results' positions.
async fn futures_join<F: std::future::Future>(futs: Vec<F>) -> Vec<F::Output> {
    let mut pinned: Vec<_> = futs.into_iter().map(Box::pin).collect();
    let mut out: Vec<Option<F::Output>> = (0..pinned.len()).map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (i, f) in pinned.iter_mut().enumerate() {
            if out[i].is_none() {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => out[i] = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    out.into_iter().map(Option::unwrap).collect()
}
