//! SPEC §2 around the call: cancellation, one policy read per call, routes, gRPC, counters.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use retryplane_agent::{CallMeta, CancellationToken, Cause, GiveUpCause};
use support::{Fut, Step, Upstream, agent, policy, response};

fn get() -> CallMeta<'static> {
    CallMeta::http("GET", "/")
}

#[tokio::test(start_paused = true)]
async fn a_cancellation_token_stops_a_pause_at_once() {
    let agent = agent(&policy(
        "max_attempts: 3\nbackoff: {base: 10s, max: 10s}\ndeadline: 30s",
    ));
    let up = Upstream::new([Step::Status(503)]);
    let token = CancellationToken::new();
    let ep = agent.endpoint("ep");
    let call = tokio::spawn({
        let (up, token) = (up.clone(), token.clone());
        async move { ep.call(get().with_cancel(token), up.attempt()).await }
    });
    // Wait for the attempt to start (a bounded poll, no time passes).
    for _ in 0..10_000 {
        if up.attempts() == 1 {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert_eq!(up.attempts(), 1, "the attempt started");
    let start = tokio::time::Instant::now();
    token.cancel();
    let err = call.await.unwrap().unwrap_err();
    assert_eq!(err.cause, Cause::Cancelled);
    assert_eq!(
        err.response().unwrap().status(),
        503,
        "the last failure comes back"
    );
    assert_eq!(start.elapsed(), Duration::ZERO);
    assert_eq!(up.attempts(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_cancellation_token_stops_an_attempt_in_flight() {
    let agent = agent(&policy(
        "max_attempts: 3\nper_try_timeout: 10s\ndeadline: 30s",
    ));
    let up = Upstream::new([Step::Hang]);
    let token = CancellationToken::new();
    let ep = agent.endpoint("ep");
    let call = tokio::spawn({
        let (up, token) = (up.clone(), token.clone());
        async move { ep.call(get().with_cancel(token), up.attempt()).await }
    });
    // Wait for the attempt to start (a bounded poll, no time passes).
    for _ in 0..10_000 {
        if up.attempts() == 1 {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert_eq!(up.attempts(), 1, "the attempt started");
    let start = tokio::time::Instant::now();
    token.cancel();
    let err = call.await.unwrap().unwrap_err();
    assert_eq!(err.cause, Cause::Cancelled);
    assert!(err.last.is_none(), "the attempt never answered");
    assert_eq!(start.elapsed(), Duration::ZERO);
    assert_eq!(up.attempts(), 1);
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
    agent
        .endpoint("ep")
        .call(get(), up.attempt())
        .await
        .unwrap();
    assert_eq!(up.attempts(), 4, "the next call runs under max_attempts 5");
}

#[tokio::test(start_paused = true)]
async fn a_route_override_applies_to_matching_calls_only() {
    let agent = agent(&policy(
        "max_attempts: 4\nroutes:\n  - match: {method: GET, path_prefix: /slow}\n    max_attempts: 2",
    ));
    let up = Upstream::new(vec![Step::Status(503); 5]);
    let err = agent
        .endpoint("ep")
        .call(CallMeta::http("GET", "/slow/x?q=1"), up.attempt())
        .await
        .unwrap_err();
    assert_eq!(err.attempts, 2);
    let up = Upstream::new(vec![Step::Status(503); 5]);
    let err = agent
        .endpoint("ep")
        .call(get(), up.attempt())
        .await
        .unwrap_err();
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

#[tokio::test(start_paused = true)]
async fn grpc_pushback_replaces_the_computed_pause() {
    let agent = agent(&policy("max_attempts: 3"));
    let starts = Arc::new(Mutex::new(Vec::new()));
    let meta = CallMeta::grpc("/shop.Payments/Get").idempotent(true);
    let ok = agent
        .endpoint("ep")
        .call(
            meta,
            grpc(
                vec![grpc_status(tonic::Code::Unavailable, Some("40"))],
                starts.clone(),
            ),
        )
        .await
        .unwrap();
    assert_eq!(*ok.get_ref(), 7);
    assert_eq!(*starts.lock().unwrap(), [0, 40]);
}

#[tokio::test(start_paused = true)]
async fn a_negative_grpc_pushback_means_do_not_retry() {
    let agent = agent(&policy("max_attempts: 3"));
    let starts = Arc::new(Mutex::new(Vec::new()));
    let meta = CallMeta::grpc("/shop.Payments/Get").idempotent(true);
    let err = agent
        .endpoint("ep")
        .call(
            meta,
            grpc(
                vec![grpc_status(tonic::Code::Unavailable, Some("-1"))],
                starts.clone(),
            ),
        )
        .await
        .unwrap_err();
    assert_eq!(err.cause, Cause::GaveUp(GiveUpCause::NotRetryable));
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
        agent
            .endpoint("ep")
            .call(get(), up.attempt())
            .await
            .unwrap();
        up.starts_ms()
    };
    assert_eq!(run().await, run().await);
}
