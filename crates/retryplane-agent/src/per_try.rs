//! The per-try timeout: an attempt's future raced against its end instant, with the timer
//! armed only once the attempt has to wait.
//!
//! `tokio::time::timeout_at` creates its `Sleep` with the future: it clones the runtime's
//! handle, and dropping the unused timer takes the timer wheel's lock. An attempt that completes
//! at its first poll (an answer from a cache or an in-process service below the agent, a
//! connection pool that refuses at once) pays that for nothing (BENCHMARKS.md, "Agent:
//! `Endpoint::call`"). [`Within`] polls the
//! attempt first and arms the timer at its first `Pending`; an attempt that waits on the
//! network pays what it paid before, and its timer fires at the same instant. Written here
//! rather than taken from tokio because tokio's `Timeout` has no lazy form.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::task::coop;
use tokio::time::{Instant, Sleep};

/// The attempt did not complete before its end instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TimedOut;

/// An attempt raced against its end instant: completes with the attempt's output, or with
/// [`TimedOut`] once `until` passes; an attempt that completes at the same poll as the timer
/// fires wins, as with `timeout_at`.
///
/// Both the attempt and the timer's slot are pinned by the caller (`std::pin::pin!` in the
/// call's own state), so nothing is moved or allocated here, and no projection (and so no
/// `unsafe`) is needed.
pub(crate) struct Within<'a, F> {
    attempt: Pin<&'a mut F>,
    timer: Pin<&'a mut Option<Sleep>>,
    until: Instant,
}

impl<'a, F: Future> Within<'a, F> {
    /// Races `attempt` against `until`; `timer` is where the timer is kept once armed (pass
    /// `pin!(None)`).
    pub(crate) fn new(
        until: Instant,
        attempt: Pin<&'a mut F>,
        timer: Pin<&'a mut Option<Sleep>>,
    ) -> Self {
        Within {
            attempt,
            timer,
            until,
        }
    }
}

impl<F: Future> Future for Within<'_, F> {
    type Output = Result<F::Output, TimedOut>;

    #[inline]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let me = self.get_mut();
        let had_budget = coop::has_budget_remaining();
        if let Poll::Ready(out) = me.attempt.as_mut().poll(cx) {
            return Poll::Ready(Ok(out));
        }
        if me.timer.is_none() {
            me.timer.set(Some(tokio::time::sleep_until(me.until)));
        }
        let Some(sleep) = me.timer.as_mut().as_pin_mut() else {
            return Poll::Pending;
        };
        // As tokio's `Timeout` does: when the attempt itself used up the task's coop budget,
        // the timer is polled outside it, or an attempt that exhausts the budget on every
        // poll would never time out.
        let fired = if had_budget && !coop::has_budget_remaining() {
            Pin::new(&mut coop::unconstrained(sleep)).poll(cx)
        } else {
            sleep.poll(cx)
        };
        fired.map(|()| Err(TimedOut))
    }
}

#[cfg(test)]
mod tests {
    use std::future::{pending, poll_fn, ready};
    use std::pin::pin;
    use std::time::Duration;

    use super::*;

    async fn within<F: Future>(until: Instant, attempt: F) -> Result<F::Output, TimedOut> {
        let (attempt, timer) = (pin!(attempt), pin!(None));
        Within::new(until, attempt, timer).await
    }

    #[test]
    fn an_attempt_ready_at_its_first_poll_arms_no_timer() {
        // A runtime without a time driver: creating a `Sleep` there panics, so this shows that
        // none was created.
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        let out = rt.block_on(within(Instant::now(), ready(7)));
        assert_eq!(out, Ok(7));
    }

    #[tokio::test(start_paused = true)]
    async fn an_attempt_that_waits_times_out_at_its_end_instant() {
        let start = Instant::now();
        let until = start + Duration::from_millis(250);
        let out = within(until, pending::<()>()).await;
        assert_eq!(out, Err(TimedOut));
        assert_eq!(Instant::now(), until);
    }

    #[tokio::test(start_paused = true)]
    async fn an_attempt_that_waits_and_answers_in_time_is_returned() {
        let start = Instant::now();
        let answer = async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            "answer"
        };
        let out = within(start + Duration::from_millis(250), answer).await;
        assert_eq!(out, Ok("answer"));
        assert_eq!(Instant::now(), start + Duration::from_millis(100));
    }

    #[tokio::test(start_paused = true)]
    async fn an_end_instant_already_past_still_lets_a_ready_attempt_answer() {
        let past = Instant::now();
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(within(past, ready(1)).await, Ok(1));
        assert_eq!(within(past, pending::<()>()).await, Err(TimedOut));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_attempt_that_uses_up_the_coop_budget_on_every_poll_still_times_out() {
        // Spends the task's whole budget, then waits (its last `poll_proceed` woke the task).
        let greedy = poll_fn(|cx| {
            loop {
                match coop::poll_proceed(cx) {
                    Poll::Ready(progress) => progress.made_progress(),
                    Poll::Pending => return Poll::<()>::Pending,
                }
            }
        });
        let until = Instant::now() + Duration::from_millis(20);
        let run = tokio::spawn(within(until, greedy));
        // Bounded from another task, whose budget is its own.
        let out = tokio::time::timeout(Duration::from_secs(10), run)
            .await
            .expect("the attempt's timer fired")
            .expect("the task ran to its end");
        assert_eq!(out, Err(TimedOut));
    }
}
