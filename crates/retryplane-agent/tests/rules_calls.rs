//! SPEC §2 around the call: cancellation, one policy read per call, routes, gRPC, counters.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use retryplane_agent::{Agent, CallError, CallMeta, CancellationToken, Cause, GiveUpCause};
use support::{Fut, Step, Upstream, agent, policy, response};

fn get() -> CallMeta<'static> {
    CallMeta::http("GET", "/")
}

/// One call of `agent`'s `ep` against an upstream that plays `step` (then answers 200), with a
/// cancellation token that is cancelled once the first attempt has started: the call's error,
/// how long after the cancellation it came, and the attempts the upstream saw.
async fn cancelled_after_the_first_attempt(
    agent: &Agent,
    step: Step,
) -> (
    CallError<http::Response<()>, std::io::Error>,
    Duration,
    usize,
) {
    let up = Upstream::new([step]);
    let token = CancellationToken::new();
    let ep = agent.endpoint("ep");
    let call = tokio::spawn({
        let (up, token) = (up.clone(), token.clone());
        async move { ep.call(get().with_cancel(token), up.attempt()).await }
    });
    up.until_attempts(1).await;
    let start = tokio::time::Instant::now();
    token.cancel();
    let err = call.await.unwrap().unwrap_err();
    (err, start.elapsed(), up.attempts())
}

#[tokio::test(start_paused = true)]
async fn a_cancellation_token_stops_a_pause_at_once() {
    let agent = agent(&policy(
        "max_attempts: 3\nbackoff: {base: 10s, max: 10s}\ndeadline: 30s",
    ));
    let (err, took, attempts) = cancelled_after_the_first_attempt(&agent, Step::Status(503)).await;
    assert_eq!(err.cause, Cause::Cancelled);
    assert_eq!(
        err.response().unwrap().status(),
        503,
        "the last failure comes back"
    );
    assert_eq!(took, Duration::ZERO);
    assert_eq!(attempts, 1);
}

#[tokio::test(start_paused = true)]
async fn a_token_cancelled_before_the_call_starts_makes_no_attempt() {
    let agent = agent(&policy("max_attempts: 3"));
    let ep = agent.endpoint("ep");
    let token = CancellationToken::new();
    token.cancel();
    let up = Upstream::new([]);
    let err = ep
        .call(get().with_cancel(token), up.attempt())
        .await
        .unwrap_err();
    assert_eq!(err.cause, Cause::Cancelled);
    assert!(err.last.is_none());
    assert_eq!((err.attempts, up.attempts()), (0, 0), "nothing was started");
    let c = ep.pending_counts();
    assert_eq!((c.calls, c.attempts, c.cancelled), (1, 0, 1), "{c:?}");
}

#[tokio::test(start_paused = true)]
async fn a_cancellation_token_stops_an_attempt_in_flight() {
    let agent = agent(&policy(
        "max_attempts: 3\nper_try_timeout: 10s\ndeadline: 30s",
    ));
    let (err, took, attempts) = cancelled_after_the_first_attempt(&agent, Step::Hang).await;
    assert_eq!(err.cause, Cause::Cancelled);
    assert!(err.last.is_none(), "the attempt never answered");
    assert_eq!(took, Duration::ZERO);
    assert_eq!(attempts, 1);
}

#[tokio::test(start_paused = true)]
async fn dropping_the_call_stops_it_during_a_pause() {
    let agent = agent(&policy(
        "max_attempts: 3\nbackoff: {base: 10s, max: 10s}\ndeadline: 30s",
    ));
    let up = Upstream::new([Step::Status(503)]);
    let ep = agent.endpoint("ep");
    let dropped = tokio::time::timeout(Duration::from_secs(1), ep.call(get(), up.attempt())).await;
    assert!(dropped.is_err());
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert_eq!(up.attempts(), 1, "no attempt after the drop");
}

/// A budget with room for one retry a second and nothing more (reserve 1, ratio 0).
const ONE_RETRY_BUDGET: &str = "max_attempts: 3\nbackoff: {base: 100ms, max: 100ms, jitter: none}\nbudget: {enabled: true, ratio: 0.0, min_per_second: 1, window: 1s}";

/// Whether the next call of `ep` that fails once may still retry: the budget has its retry.
async fn the_budget_still_has_its_retry(ep: &retryplane_agent::Endpoint) -> bool {
    let up = Upstream::new([Step::Status(503)]);
    let res = ep.call(get(), up.attempt()).await;
    res.is_ok() && up.attempts() == 2
}

#[tokio::test(start_paused = true)]
async fn a_call_cancelled_during_its_pause_hands_its_retry_back_to_the_budget() {
    let agent = agent(&policy(ONE_RETRY_BUDGET));
    let (err, _, attempts) = cancelled_after_the_first_attempt(&agent, Step::Status(503)).await;
    assert_eq!((err.cause, attempts), (Cause::Cancelled, 1));
    let ep = agent.endpoint("ep");
    assert_eq!(ep.pending_counts().retries, 0, "no retry was sent");
    assert!(
        the_budget_still_has_its_retry(&ep).await,
        "a retry never sent does not count against the budget"
    );
}

#[tokio::test(start_paused = true)]
async fn a_call_dropped_during_its_pause_hands_its_retry_back_to_the_budget() {
    let agent = agent(&policy(ONE_RETRY_BUDGET));
    let up = Upstream::new([Step::Status(503)]);
    let ep = agent.endpoint("ep");
    let dropped =
        tokio::time::timeout(Duration::from_millis(50), ep.call(get(), up.attempt())).await;
    assert!(dropped.is_err(), "dropped during its 100 ms pause");
    assert_eq!(up.attempts(), 1);
    assert!(the_budget_still_has_its_retry(&ep).await);
}

#[tokio::test(start_paused = true)]
async fn the_policy_is_read_once_per_call_even_if_swapped_mid_call() {
    let agent = agent(&policy("max_attempts: 2"));
    let five = retryplane_policy::load(policy("max_attempts: 5").as_bytes())
        .policies
        .unwrap();
    let swap = Mutex::new(Some((agent.clone(), five)));
    let attempts = Arc::new(Mutex::new(0));
    let counter = attempts.clone();
    let err = agent
        .endpoint("ep")
        .call(get(), |_| {
            *counter.lock().unwrap() += 1;
            if let Some((agent, set)) = swap.lock().unwrap().take() {
                agent.set_policies(set);
            }
            let f: Fut = Box::pin(async { Ok(response(503, None)) });
            f
        })
        .await
        .unwrap_err();
    assert_eq!(err.cause, Cause::GaveUp(GiveUpCause::AttemptsExhausted));
    assert_eq!(*attempts.lock().unwrap(), 2, "the call kept max_attempts 2");
    let up = Upstream::new([Step::Status(503), Step::Status(503), Step::Status(503)]);
    up.call(&agent, get()).await.unwrap();
    assert_eq!(up.attempts(), 4, "the next call runs under max_attempts 5");
}

#[tokio::test(start_paused = true)]
async fn a_route_override_applies_to_matching_calls_only() {
    let agent = agent(&policy(
        "max_attempts: 4\nroutes:\n  - match: {method: GET, path_prefix: /slow}\n    max_attempts: 2",
    ));
    let up = Upstream::new(vec![Step::Status(503); 5]);
    let err = up
        .call(&agent, CallMeta::http("GET", "/slow/x?q=1"))
        .await
        .unwrap_err();
    assert_eq!(err.attempts, 2);
    let up = Upstream::new(vec![Step::Status(503); 5]);
    let err = up.call(&agent, get()).await.unwrap_err();
    assert_eq!(err.attempts, 4);
}

#[tokio::test(start_paused = true)]
async fn an_endpoint_the_policies_do_not_name_runs_under_the_defaults() {
    let agent = agent(&policy("max_attempts: 5"));
    let up = Upstream::new(vec![Step::Status(503); 5]);
    let err = agent
        .endpoint("other")
        .call(get(), up.attempt())
        .await
        .unwrap_err();
    assert_eq!(err.attempts, 3, "the built-in default max_attempts");
}

fn grpc_status(code: tonic::Code, pushback: Option<&str>) -> tonic::Status {
    let mut s = tonic::Status::new(code, "upstream says no");
    if let Some(p) = pushback {
        s.metadata_mut()
            .insert("grpc-retry-pushback-ms", p.parse().unwrap());
    }
    s
}

type GrpcFut = std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<tonic::Response<u32>, tonic::Status>> + Send>,
>;

/// A gRPC upstream that fails with `script` then answers.
fn grpc(
    script: Vec<tonic::Status>,
    starts: Arc<Mutex<Vec<u64>>>,
) -> impl FnMut(retryplane_agent::AttemptInfo) -> GrpcFut {
    let origin = tokio::time::Instant::now();
    let mut script = script.into_iter();
    move |_| {
        starts
            .lock()
            .unwrap()
            .push(origin.elapsed().as_millis() as u64);
        let next = script.next();
        Box::pin(async move {
            match next {
                Some(s) => Err(s),
                None => Ok(tonic::Response::new(7)),
            }
        })
    }
}

type GrpcAnswer = Result<tonic::Response<u32>, CallError<tonic::Response<u32>, tonic::Status>>;

/// An idempotent gRPC call on `ep` whose upstream answers UNAVAILABLE once per `pushbacks`
/// entry, with that `grpc-retry-pushback-ms`, then OK: the result, and when each attempt
/// started (ms).
async fn pushed_back(agent: &Agent, pushbacks: &[&str]) -> (GrpcAnswer, Vec<u64>) {
    let starts = Arc::new(Mutex::new(Vec::new()));
    let script = pushbacks
        .iter()
        .map(|p| grpc_status(tonic::Code::Unavailable, Some(p)))
        .collect();
    let result = agent
        .endpoint("ep")
        .call(
            CallMeta::grpc("/shop.Payments/Get").idempotent(true),
            grpc(script, starts.clone()),
        )
        .await;
    let starts = starts.lock().unwrap().clone();
    (result, starts)
}

#[tokio::test(start_paused = true)]
async fn grpc_pushback_replaces_the_computed_pause() {
    let agent = agent(&policy("max_attempts: 3"));
    let (result, starts) = pushed_back(&agent, &["40"]).await;
    assert_eq!(*result.unwrap().get_ref(), 7);
    assert_eq!(starts, [0, 40]);
}

#[tokio::test(start_paused = true)]
async fn a_negative_grpc_pushback_means_do_not_retry() {
    let agent = agent(&policy("max_attempts: 3"));
    let (result, starts) = pushed_back(&agent, &["-1"]).await;
    let err = result.unwrap_err();
    assert_eq!(err.cause, Cause::GaveUp(GiveUpCause::NotRetryable));
    assert_eq!(starts, [0]);
    assert_eq!(err.error().unwrap().code(), tonic::Code::Unavailable);
}

#[tokio::test(start_paused = true)]
async fn grpc_calls_are_retried_only_when_declared_idempotent_or_keyed() {
    let agent = agent(&policy("max_attempts: 3"));
    let starts = Arc::new(Mutex::new(Vec::new()));
    let unavailable = || vec![grpc_status(tonic::Code::Unavailable, None)];
    let err = agent
        .endpoint("ep")
        .call(
            CallMeta::grpc("/a.B/C"),
            grpc(unavailable(), starts.clone()),
        )
        .await
        .unwrap_err();
    assert_eq!(err.cause, Cause::GaveUp(GiveUpCause::NotRetryable));
    agent
        .endpoint("ep")
        .call(
            CallMeta::grpc("/a.B/C").with_idempotency_key(true),
            grpc(unavailable(), starts.clone()),
        )
        .await
        .unwrap();
    let err = agent
        .endpoint("ep")
        .call(
            CallMeta::grpc("/a.B/C").idempotent(true),
            grpc(vec![grpc_status(tonic::Code::NotFound, None)], starts),
        )
        .await
        .unwrap_err();
    assert_eq!(err.cause, Cause::GaveUp(GiveUpCause::NotRetryable));
}

#[tokio::test(start_paused = true)]
async fn every_call_is_counted_under_spec_section_4() {
    let agent = agent(&policy("max_attempts: 2"));
    let ep = agent.endpoint("ep");
    let up = Upstream::new([]);
    ep.call(get(), up.attempt()).await.unwrap();
    let up = Upstream::new([Step::RetryAfter(503, "1".into())]);
    ep.call(get(), up.attempt()).await.unwrap();
    let up = Upstream::new([Step::Status(503), Step::Status(503)]);
    ep.call(get(), up.attempt()).await.unwrap_err();
    let up = Upstream::new([Step::Status(404)]);
    ep.call(get(), up.attempt()).await.unwrap_err();
    let c = ep.pending_counts();
    assert_eq!((c.calls, c.attempts, c.retries), (4, 6, 2));
    assert_eq!((c.success_first_try, c.success_after_retry), (1, 1));
    assert_eq!((c.gave_up_attempts, c.gave_up_not_retryable), (1, 1));
    assert_eq!((c.backoff_ms, c.retry_after_honored), (1100, 1));
}

#[tokio::test(start_paused = true)]
async fn the_same_seed_gives_the_same_jittered_pauses() {
    let yaml = "version: 1\ndefaults:\n  backoff: {base: 100ms, max: 2s, jitter: full}\nendpoints:\n  ep: {max_attempts: 4}\n";
    let run = || async {
        let agent = support::agent(yaml);
        let up = Upstream::new([Step::Status(503), Step::Status(503), Step::Status(503)]);
        up.call(&agent, get()).await.unwrap();
        up.starts_ms()
    };
    assert_eq!(run().await, run().await);
}

fn set(yaml: &str) -> retryplane_agent::PolicySet {
    retryplane_policy::load(yaml.as_bytes()).policies.unwrap()
}

/// Both `ep` (named) and `other` (under the defaults) get `max_attempts: n` and a per-try
/// timeout of `n` seconds.
fn both(n: u32) -> String {
    format!(
        "version: 1\ndefaults:\n  max_attempts: {n}\n  per_try_timeout: {n}s\n  backoff: {{base: 100ms, max: 2s, multiplier: 2.0, jitter: none}}\n  budget: {{enabled: false}}\n  circuit_breaker: {{enabled: false}}\nendpoints:\n  ep:\n    max_attempts: {n}\n    per_try_timeout: {n}s\n"
    )
}

#[tokio::test(start_paused = true)]
async fn kept_handles_their_clones_and_handles_made_per_call_follow_every_swap() {
    let agent = agent(&both(2));
    let named = agent.endpoint("ep");
    let unnamed = agent.endpoint("other");
    // Clones, and handles made again by name, which share what the first ones keep.
    let handles = [
        named.clone(),
        named.clone(),
        agent.endpoint("ep"),
        unnamed.clone(),
        unnamed.clone(),
        agent.clone().endpoint("other"),
    ];
    for n in [2, 4, 3, 5, 2] {
        agent.set_policies(set(&both(n)));
        // And handles made for this call only.
        let per_call = [agent.endpoint("ep"), agent.endpoint("other")];
        for (i, ep) in handles.iter().chain(&per_call).enumerate() {
            let up = Upstream::new(vec![Step::Status(503); 6]);
            let err = ep.call(get(), up.attempt()).await.unwrap_err();
            assert_eq!(err.attempts, n, "handle {i} under max_attempts {n}");
            let timeouts: Vec<_> = up.infos().iter().map(|i| i.timeout).collect();
            assert_eq!(
                timeouts,
                vec![Duration::from_secs(u64::from(n)); n as usize],
                "handle {i}: every attempt under the set of max_attempts {n}"
            );
        }
    }
}

#[tokio::test(start_paused = true)]
async fn a_kept_handle_holds_one_set_for_a_call_that_spans_a_swap() {
    let agent = agent(&both(2));
    let ep = agent.endpoint("ep");
    // The handle keeps the entry of the first set.
    ep.call(get(), Upstream::new([]).attempt()).await.unwrap();
    let swap = Mutex::new(Some((agent.clone(), set(&both(4)))));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = seen.clone();
    let err = ep
        .call(get(), |info| {
            record.lock().unwrap().push(info);
            if let Some((agent, set)) = swap.lock().unwrap().take() {
                agent.set_policies(set);
            }
            let f: Fut = Box::pin(async { Ok(response(503, None)) });
            f
        })
        .await
        .unwrap_err();
    assert_eq!(err.attempts, 2, "the call kept max_attempts 2");
    let infos = seen.lock().unwrap().clone();
    assert_eq!(infos.len(), 2);
    assert!(
        infos.iter().all(|i| i.timeout == Duration::from_secs(2)),
        "every attempt under the first set: {infos:?}"
    );
    // The same handle, the next call: the second set, in full.
    let up = Upstream::new(vec![Step::Status(503); 6]);
    let err = ep.call(get(), up.attempt()).await.unwrap_err();
    assert_eq!(err.attempts, 4);
    assert!(
        up.infos()
            .iter()
            .all(|i| i.timeout == Duration::from_secs(4))
    );
}

#[tokio::test(start_paused = true)]
async fn a_call_dropped_during_its_first_attempt_is_counted_in_full() {
    let agent = agent(&policy("max_attempts: 3\nper_try_timeout: 10s"));
    let ep = agent.endpoint("ep");
    let up = Upstream::new([Step::Hang]);
    let dropped = tokio::time::timeout(Duration::from_secs(1), ep.call(get(), up.attempt())).await;
    assert!(dropped.is_err());
    assert_eq!(up.attempts(), 1);
    ep.call(get(), Upstream::new([]).attempt()).await.unwrap();
    let c = ep.pending_counts();
    assert_eq!((c.calls, c.attempts, c.retries), (2, 2, 0));
    assert_eq!((c.success_first_try, c.success_after_retry), (1, 0));
    assert_eq!(c.cancelled, 1, "the dropped call has no other outcome");
}

/// The outcome counters: every call that has ended is in exactly one.
fn outcomes(c: &retryplane_agent::CounterValues) -> u64 {
    c.success_first_try
        + c.success_after_retry
        + c.gave_up_attempts
        + c.gave_up_budget
        + c.gave_up_deadline
        + c.gave_up_retry_after
        + c.gave_up_not_retryable
        + c.circuit_open
        + c.cancelled
}

#[tokio::test(start_paused = true)]
async fn every_call_that_ended_is_counted_in_one_outcome_cancelled_ones_too() {
    let agent = agent(&policy(
        "max_attempts: 2\nper_try_timeout: 10s\nbackoff: {base: 2s, max: 2s, jitter: none}",
    ));
    let ep = agent.endpoint("ep");
    // A success at once, one after a retry, one that gave up.
    ep.call(get(), Upstream::new([]).attempt()).await.unwrap();
    let up = Upstream::new([Step::Status(503)]);
    ep.call(get(), up.attempt()).await.unwrap();
    let up = Upstream::new([Step::Status(503), Step::Status(503)]);
    ep.call(get(), up.attempt()).await.unwrap_err();
    // Cancelled by a token: before the call, during an attempt, during the pause.
    let token = CancellationToken::new();
    token.cancel();
    let err = ep
        .call(get().with_cancel(token), Upstream::new([]).attempt())
        .await
        .unwrap_err();
    assert_eq!(err.cause, Cause::Cancelled);
    let (err, _, _) = cancelled_after_the_first_attempt(&agent, Step::Hang).await;
    assert_eq!(err.cause, Cause::Cancelled);
    let (err, _, _) = cancelled_after_the_first_attempt(&agent, Step::Status(503)).await;
    assert_eq!(err.cause, Cause::Cancelled);
    // Dropped: during its first attempt, during its 2 s pause, during its second attempt.
    for (steps, after) in [
        (vec![Step::Hang], 1),
        (vec![Step::Status(503)], 1),
        (vec![Step::Status(503), Step::Hang], 3),
    ] {
        let up = Upstream::new(steps);
        let call = ep.call(get(), up.attempt());
        let dropped = tokio::time::timeout(Duration::from_secs(after), call).await;
        assert!(dropped.is_err());
    }
    let c = ep.pending_counts();
    assert_eq!(c.calls, 9, "{c:?}");
    assert_eq!(c.cancelled, 6, "{c:?}");
    assert_eq!(outcomes(&c), c.calls, "{c:?}");
    // A call still under way is in no outcome yet.
    let up = Upstream::new([Step::Status(503), Step::Hang]);
    let running = tokio::spawn({
        let (ep, up) = (ep.clone(), up.clone());
        async move { ep.call(get(), up.attempt()).await }
    });
    // Paused time: the 2 s pause passes as soon as every task waits.
    tokio::time::sleep(Duration::from_secs(3)).await;
    up.until_attempts(2).await;
    let c = ep.pending_counts();
    assert_eq!((c.calls, outcomes(&c)), (10, 9), "{c:?}");
    running.abort();
    let _ = running.await;
    let c = ep.pending_counts();
    assert_eq!((c.calls, c.cancelled, outcomes(&c)), (10, 7, 10), "{c:?}");
}

#[tokio::test(start_paused = true)]
async fn a_call_refused_by_an_open_circuit_counts_a_call_and_no_attempt() {
    let agent = agent(&policy(
        "max_attempts: 1\ncircuit_breaker: {enabled: true, failure_ratio: 0.5, min_requests: 2, window: 10s, open_for: 30s}",
    ));
    let ep = agent.endpoint("ep");
    let mut refused = None;
    for _ in 0..20 {
        let up = Upstream::new([Step::Status(503)]);
        let err = ep.call(get(), up.attempt()).await.unwrap_err();
        if err.cause == Cause::GaveUp(GiveUpCause::CircuitOpen) {
            refused = Some(err);
            break;
        }
    }
    let refused = refused.expect("the circuit opened");
    assert_eq!(refused.attempts, 0);
    let c = ep.pending_counts();
    assert_eq!(c.calls, c.attempts + 1, "{c:?}");
    assert_eq!(c.circuit_open, 1);
    assert_eq!(c.success_first_try, 0);
}

#[tokio::test(start_paused = true)]
async fn an_http_answer_below_400_is_returned_at_once_as_a_success() {
    let agent = agent(&policy("max_attempts: 3"));
    let ep = agent.endpoint("ep");
    for status in [200, 204, 304] {
        let up = Upstream::new([Step::Status(status), Step::Status(503)]);
        let r = ep.call(get(), up.attempt()).await.unwrap();
        assert_eq!(r.status(), status);
        assert_eq!(up.attempts(), 1);
    }
    // A malformed Retry-After on a success changes nothing.
    let up = Upstream::new([Step::RetryAfter(200, "soon".into())]);
    assert_eq!(ep.call(get(), up.attempt()).await.unwrap().status(), 200);
    let c = ep.pending_counts();
    assert_eq!((c.calls, c.attempts, c.success_first_try), (4, 4, 4));
    assert_eq!((c.retries, c.success_after_retry), (0, 0));
}

#[tokio::test(start_paused = true)]
async fn an_unparseable_grpc_pushback_means_do_not_retry() {
    // SPEC §2 step 7 and gRFC A6: a pushback that is not a plain decimal number of
    // milliseconds is read as "do not retry", not ignored.
    let agent = agent(&policy("max_attempts: 3"));
    for bad in ["abc", "1.5", "+40", "", "4O"] {
        let (result, starts) = pushed_back(&agent, &[bad]).await;
        let err = result.unwrap_err();
        assert_eq!(
            err.cause,
            Cause::GaveUp(GiveUpCause::NotRetryable),
            "{bad:?}"
        );
        assert_eq!(err.error().unwrap().code(), tonic::Code::Unavailable);
        assert_eq!(starts, [0], "{bad:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn a_grpc_pushback_is_ignored_when_hints_are_not_honored() {
    // With `retry_after.honor: false` neither a garbage pushback stops the call nor a valid one
    // paces it: the computed backoff (100 ms, then 200 ms) applies.
    let agent = agent(&policy("max_attempts: 3\nretry_after: {honor: false}"));
    let (result, starts) = pushed_back(&agent, &["abc", "5000"]).await;
    result.unwrap();
    assert_eq!(starts, [0, 100, 300]);
}

#[tokio::test(start_paused = true)]
async fn a_grpc_pushback_above_the_max_gives_up_and_one_at_the_max_is_waited() {
    let agent = agent(&policy(
        "max_attempts: 3\ndeadline: 10s\nretry_after: {honor: true, max: 2s}",
    ));
    let (result, starts) = pushed_back(&agent, &["2001"]).await;
    let err = result.unwrap_err();
    assert_eq!(err.cause, Cause::GaveUp(GiveUpCause::RetryAfterTooLong));
    assert_eq!(err.error().unwrap().code(), tonic::Code::Unavailable);
    assert_eq!(starts, [0], "no retry, no wait");
    let (result, starts) = pushed_back(&agent, &["2000"]).await;
    result.unwrap();
    assert_eq!(starts, [0, 2000]);
}

/// An agent whose `ep` makes one attempt a call, with a breaker that one failure opens for
/// 30 s and one half-open probe; the breaker is opened, and the time moved to half-open.
async fn half_open_with_one_probe() -> Agent {
    let agent = agent(&policy(
        "max_attempts: 1\ncircuit_breaker: {enabled: true, failure_ratio: 0.5, min_requests: 1, window: 10s, open_for: 30s, half_open_probes: 1}",
    ));
    let ep = agent.endpoint("ep");
    let up = Upstream::new([Step::Status(503)]);
    ep.call(get(), up.attempt()).await.unwrap_err();
    let up = Upstream::new([]);
    let err = ep.call(get(), up.attempt()).await.unwrap_err();
    assert_eq!(err.cause, Cause::GaveUp(GiveUpCause::CircuitOpen));
    tokio::time::advance(Duration::from_secs(30)).await;
    agent
}

/// The next call of `agent`'s `ep` gets the probe and, answered 200, closes the breaker.
async fn the_next_call_gets_the_probe(agent: &Agent) {
    let ep = agent.endpoint("ep");
    let up = Upstream::new([]);
    let r = ep.call(get(), up.attempt()).await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(up.attempts(), 1);
    // The probe succeeded: closed, every call goes through.
    for _ in 0..3 {
        ep.call(get(), Upstream::new([]).attempt()).await.unwrap();
    }
}

#[tokio::test(start_paused = true)]
async fn a_cancelled_half_open_probe_is_handed_to_the_next_call() {
    let agent = half_open_with_one_probe().await;
    let (err, _, attempts) = cancelled_after_the_first_attempt(&agent, Step::Hang).await;
    assert_eq!((err.cause, attempts), (Cause::Cancelled, 1));
    the_next_call_gets_the_probe(&agent).await;
}

#[tokio::test(start_paused = true)]
async fn a_half_open_probe_that_fails_on_the_callers_side_is_handed_to_the_next_call() {
    let agent = half_open_with_one_probe().await;
    let ep = agent.endpoint("ep");
    let up = Upstream::new([Step::Io(std::io::ErrorKind::InvalidData)]);
    let err = ep.call(get(), up.attempt()).await.unwrap_err();
    assert_eq!(err.cause, Cause::GaveUp(GiveUpCause::NotRetryable));
    the_next_call_gets_the_probe(&agent).await;
}

#[tokio::test(start_paused = true)]
async fn a_half_open_probe_whose_error_the_caller_calls_a_success_closes_the_breaker() {
    let agent = half_open_with_one_probe().await;
    let ep = agent.endpoint("ep");
    let up = Upstream::new([Step::Io(std::io::ErrorKind::InvalidData)]);
    let err = ep
        .call_with(
            get(),
            |_| retryplane_agent::Classification::Success,
            up.attempt(),
        )
        .await
        .unwrap_err();
    // Not a give-up: the error comes back, marked as the success it was counted as.
    assert_eq!(err.cause, Cause::Succeeded);
    assert_eq!(err.gave_up(), None);
    assert!(err.error().is_some());
    assert_eq!(
        err.to_string(),
        "call succeeded after 1 attempt(s): the classifier took the last attempt's error for a \
         success"
    );
    // Closed: a call whose attempt hangs takes no probe, and another call goes through beside it.
    let hanging = ep.call(get(), Upstream::new([Step::Hang]).attempt());
    tokio::pin!(hanging);
    tokio::select! {
        biased;
        _ = &mut hanging => panic!("the hanging call ended"),
        () = std::future::ready(()) => {}
    }
    let r = ep.call(get(), Upstream::new([]).attempt()).await.unwrap();
    assert_eq!(r.status(), 200);
}

#[tokio::test(start_paused = true)]
async fn a_dropped_call_hands_its_half_open_probe_to_the_next_call() {
    let agent = half_open_with_one_probe().await;
    let ep = agent.endpoint("ep");
    let up = Upstream::new([Step::Hang]);
    // The caller stops waiting (its own timeout) while the probe attempt hangs.
    let call = ep.call(get(), up.attempt());
    tokio::time::timeout(Duration::from_millis(100), call)
        .await
        .unwrap_err();
    assert_eq!(up.attempts(), 1);
    the_next_call_gets_the_probe(&agent).await;
}

/// `ep` (named) and `other` (under the defaults) make one attempt a call, with a breaker that
/// two failures open for 30 s; `budget` and `min_requests` are set in `defaults:`.
fn breaker_set(budget: &str, min_requests: u32) -> String {
    format!(
        "version: 1\ndefaults:\n  max_attempts: 1\n  budget: {budget}\n  circuit_breaker: {{failure_ratio: 0.5, min_requests: {min_requests}, window: 10s, open_for: 30s, half_open_probes: 1}}\nendpoints:\n  ep: {{}}\n"
    )
}

#[tokio::test(start_paused = true)]
async fn an_open_breaker_stays_open_across_a_swap_that_changes_the_budget_or_the_breaker() {
    let agent = agent(&breaker_set("{ratio: 0.2}", 2));
    let handles = [agent.endpoint("ep"), agent.endpoint("other")];
    for ep in &handles {
        for _ in 0..2 {
            let up = Upstream::new([Step::Status(503)]);
            ep.call(get(), up.attempt()).await.unwrap_err();
        }
    }
    let refused = |err: CallError<http::Response<()>, std::io::Error>| {
        err.cause == Cause::GaveUp(GiveUpCause::CircuitOpen)
    };
    for (budget, min_requests) in [
        ("{ratio: 0.1}", 2),
        ("{ratio: 0.1}", 5),
        ("{enabled: false}", 5),
    ] {
        agent.set_policies(set(&breaker_set(budget, min_requests)));
        for ep in &handles {
            let up = Upstream::new([]);
            let err = ep.call(get(), up.attempt()).await.unwrap_err();
            assert!(
                refused(err),
                "budget {budget}, min_requests {min_requests}: the upstream was called"
            );
            assert_eq!(up.attempts(), 0);
        }
    }
    // The open period the breakers started under ends: each lets a probe through.
    tokio::time::advance(Duration::from_secs(30)).await;
    for ep in &handles {
        let up = Upstream::new([Step::Status(200)]);
        ep.call(get(), up.attempt()).await.unwrap();
        assert_eq!(up.attempts(), 1);
    }
}

#[tokio::test(start_paused = true)]
async fn backoff_time_counts_the_part_of_a_pause_taken_when_the_call_ends_during_it() {
    let agent = agent(&policy(
        "max_attempts: 3\nbackoff: {base: 10s, max: 10s}\ndeadline: 60s",
    ));
    let ep = agent.endpoint("ep");
    // Cancelled by its token 4 s into the 10 s pause.
    let up = Upstream::new([Step::Status(503)]);
    let token = CancellationToken::new();
    let call = tokio::spawn({
        let (ep, up, token) = (ep.clone(), up.clone(), token.clone());
        async move { ep.call(get().with_cancel(token), up.attempt()).await }
    });
    up.until_attempts(1).await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    token.cancel();
    assert_eq!(call.await.unwrap().unwrap_err().cause, Cause::Cancelled);
    assert_eq!(ep.pending_counts().backoff_ms, 4_000);
    // Dropped 3 s into the pause.
    let up = Upstream::new([Step::Status(503)]);
    let call = tokio::spawn({
        let (ep, up) = (ep.clone(), up.clone());
        async move { ep.call(get(), up.attempt()).await }
    });
    up.until_attempts(1).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    call.abort();
    assert!(call.await.unwrap_err().is_cancelled());
    assert_eq!(ep.pending_counts().backoff_ms, 7_000);
    // Slept in full.
    let up = Upstream::new([Step::Status(503)]);
    ep.call(get(), up.attempt()).await.unwrap();
    assert_eq!(ep.pending_counts().backoff_ms, 17_000);
}

#[tokio::test(start_paused = true)]
async fn an_error_the_caller_calls_a_success_is_counted_as_a_success_not_a_give_up() {
    use retryplane_agent::{Classification, Classify as _, CounterValues};
    // An error is a success to this caller; a response counts as usual.
    let classify = |r: &support::Reply| match r {
        Ok(response) => response.classify(),
        Err(_) => Classification::Success,
    };
    let ok = std::io::ErrorKind::InvalidData;
    for (steps, attempts, expected) in [
        (
            vec![Step::Io(ok)],
            1,
            CounterValues {
                calls: 1,
                attempts: 1,
                success_first_try: 1,
                ..CounterValues::default()
            },
        ),
        (
            vec![Step::Status(503), Step::Io(ok)],
            2,
            CounterValues {
                calls: 1,
                attempts: 2,
                retries: 1,
                success_after_retry: 1,
                backoff_ms: 100,
                ..CounterValues::default()
            },
        ),
    ] {
        let agent = agent(&policy("max_attempts: 3"));
        let ep = agent.endpoint("ep");
        let up = Upstream::new(steps);
        let err = ep
            .call_with(get(), classify, up.attempt())
            .await
            .unwrap_err();
        // The error cannot be returned as a response: it comes back as it is, in the error.
        assert!(matches!(&err.last, Some(retryplane_agent::Last::Error(e)) if e.kind() == ok));
        assert_eq!(err.attempts, attempts);
        assert_eq!(ep.pending_counts(), expected, "after {attempts} attempt(s)");
    }
}

/// A call made after its caller has seen new policies (`Agent::policies`) runs on them, even
/// through a handle made for that call while the swap is still under way: all handles on an
/// endpoint share what they keep, so a kept entry must never be taken for the new policies.
#[test]
fn a_call_made_after_the_new_policies_are_seen_runs_on_them() {
    const SWAPS: u64 = 5_000;
    let timeout_set = |ms: u64| {
        set(&format!(
            "version: 1\nendpoints:\n  ep:\n    deadline: 600s\n    per_try_timeout: {ms}ms\n"
        ))
    };
    let agent = Agent::from_policies_seeded(timeout_set(100), 1);
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let swapper = std::thread::spawn({
        let (agent, done) = (agent.clone(), done.clone());
        move || {
            for i in 1..=SWAPS {
                agent.set_policies(timeout_set(100 + i));
            }
            done.store(true, std::sync::atomic::Ordering::Release);
        }
    });
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let (mut calls, mut stale) = (0_u64, Vec::new());
    // Bounded by the swapper, which makes a fixed number of swaps.
    while !done.load(std::sync::atomic::Ordering::Acquire) {
        let seen = agent
            .policies()
            .set()
            .unwrap()
            .endpoint("ep")
            .unwrap()
            .policy
            .per_try_timeout;
        let used = Arc::new(Mutex::new(None));
        let record = used.clone();
        rt.block_on(agent.endpoint("ep").call(CallMeta::endpoint(), |info| {
            *record.lock().unwrap() = Some(info.timeout);
            async { Ok::<_, std::io::Error>(response(200, None)) }
        }))
        .unwrap();
        calls += 1;
        let used = used.lock().unwrap().unwrap();
        if used < seen && stale.len() < 5 {
            stale.push((seen, used));
        }
    }
    swapper.join().unwrap();
    assert!(calls > 0);
    assert!(
        stale.is_empty(),
        "{calls} calls; calls on policies older than those seen before them: {stale:?}"
    );
}

/// A caller's deadline shorter than the upstream's answer (and than half the per-try timeout)
/// ends each call (`attempts_exhausted`, its one attempt spent), yet tells the endpoint's breaker nothing: the call's time was up, the upstream did not
/// fail. The same hang given the whole per-try timeout opens the breaker.
#[tokio::test(start_paused = true)]
async fn a_callers_short_deadline_does_not_open_the_breaker_for_every_caller() {
    let agent = agent(&policy(
        "max_attempts: 1\nper_try_timeout: 2s\ncircuit_breaker: {enabled: true, failure_ratio: 0.5, min_requests: 3, window: 10s, open_for: 30s}",
    ));
    let ep = agent.endpoint("ep");
    for _ in 0..5 {
        let up = Upstream::new([Step::Hang]);
        let meta = get().deadline_within(Duration::from_millis(100));
        let err = ep.call(meta, up.attempt()).await.unwrap_err();
        assert_eq!(err.cause, Cause::GaveUp(GiveUpCause::AttemptsExhausted));
        assert_eq!(up.attempts(), 1);
    }
    // Another caller, with no deadline of its own, is let through.
    let up = Upstream::new([]);
    ep.call(get(), up.attempt()).await.unwrap();
    for _ in 0..3 {
        let up = Upstream::new([Step::Hang]);
        ep.call(get(), up.attempt()).await.unwrap_err();
    }
    let up = Upstream::new([]);
    let err = ep.call(get(), up.attempt()).await.unwrap_err();
    assert_eq!(err.cause, Cause::GaveUp(GiveUpCause::CircuitOpen));
    assert_eq!(up.attempts(), 0);
}
