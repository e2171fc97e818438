//! README ("Metrics delivery"): every count of a call goes under the version of the policies it
//! ran on. Checked per version against a real control plane (real time, bounded polls).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use retryplane_agent::{Agent, AttemptInfo, CallMeta};
use retryplane_proto::pb;
use support::plane::{admin, apply, builder, eventually, plane_with};
use support::{Fut, response};

/// Version `n` of the policies: the same retry policy for `ep` (pauses of 5 to 20 ms), and one
/// more endpoint so that each version is new.
fn policies(n: u64) -> String {
    format!(
        "version: 1\ndefaults:\n  backoff: {{base: 5ms, max: 20ms, jitter: none}}\n  budget: {{enabled: false}}\n  circuit_breaker: {{enabled: false}}\nendpoints:\n  ep:\n    max_attempts: 3\n  other-{n}: {{}}\n"
    )
}

/// Call `id`'s upstream: first-try success, success at the second attempt, or 503 always.
fn upstream(id: u64) -> impl FnMut(AttemptInfo) -> Fut {
    move |info| {
        let status = match (id % 3, info.number) {
            (0, _) | (1, 2..) => 200,
            _ => 503,
        };
        Box::pin(async move { Ok(response(status, None)) })
    }
}

/// `ep`'s lifetime counts, and per version, as the control plane has them.
async fn counts(
    running: &retryplane_server::server::Running,
) -> (pb::Counters, BTreeMap<u64, pb::Counters>) {
    let stats = admin(running)
        .await
        .stats(pb::StatsRequest::default())
        .await
        .unwrap()
        .into_inner();
    let Some(series) = stats
        .series
        .into_iter()
        .find(|s| s.service == "checkout" && s.endpoint == "ep")
    else {
        return Default::default();
    };
    let per_version = series
        .versions
        .into_iter()
        .map(|v| (v.policy_version, v.lifetime.unwrap_or_default()))
        .collect();
    (series.lifetime.unwrap_or_default(), per_version)
}

/// `Agent::set_policies` on an agent of a control plane: the calls made on the pushed version
/// before it ran on that version, and are reported under it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_made_on_a_pushed_version_are_reported_under_it_after_set_policies() {
    let dir = tempfile::tempdir().unwrap();
    let running = plane_with(dir.path(), &policies(1), None, |c| {
        // No report falls due in the test: the last one, at shutdown, carries the counts.
        c.metrics_interval = Duration::from_secs(60);
    })
    .await;
    let agent: Agent = builder(running.agent_addr, "a").connect().unwrap();
    eventually("the agent on v1", || async {
        agent.policies().version() == 1
    })
    .await;
    let ep = agent.endpoint("ep");
    for _ in 0..3 {
        ep.call(CallMeta::http("GET", "/"), upstream(0))
            .await
            .unwrap();
    }
    assert_eq!(ep.pending_counts().calls, 3, "not reported yet");
    let set = retryplane_policy::load(policies(9).as_bytes())
        .policies
        .unwrap();
    agent.set_policies(set);
    agent.shutdown().await;
    eventually("the three calls reported", || async {
        counts(&running).await.0.calls == 3
    })
    .await;
    let per_version: Vec<(u64, u64)> = counts(&running)
        .await
        .1
        .into_iter()
        .map(|(v, c)| (v, c.calls))
        .filter(|(_, calls)| *calls > 0)
        .collect();
    running.shutdown().await.unwrap();
    assert_eq!(
        per_version,
        [(1, 3)],
        "(version, calls): the calls ran on version 1"
    );
}

/// `ep` pausing 2 s between its two attempts; version `n`.
fn slow_policies(n: u64) -> String {
    format!(
        "version: 1\ndefaults:\n  backoff: {{base: 2s, max: 2s, jitter: none}}\n  budget: {{enabled: false}}\n  circuit_breaker: {{enabled: false}}\nendpoints:\n  ep:\n    max_attempts: 2\n  other-{n}: {{}}\n"
    )
}

/// `Agent::shutdown`'s docs: a call still in flight when shutdown begins is counted in the agent
/// (`Endpoint::pending_counts`) but never reported. A call that outlived its version is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_in_flight_at_shutdown_across_a_push_is_in_its_endpoints_pending_counts() {
    let dir = tempfile::tempdir().unwrap();
    let running = plane_with(dir.path(), &slow_policies(1), None, |c| {
        c.metrics_interval = Duration::from_millis(200);
    })
    .await;
    let agent: Agent = builder(running.agent_addr, "a").connect().unwrap();
    eventually("the agent on v1", || async {
        agent.policies().version() == 1
    })
    .await;
    let (first_sent, mut first_seen) = tokio::sync::mpsc::channel::<()>(1);
    let call = {
        let ep = agent.endpoint("ep");
        tokio::spawn(async move {
            ep.call(CallMeta::http("GET", "/"), move |_| -> Fut {
                let _ = first_sent.try_send(());
                Box::pin(async { Ok(response(503, None)) })
            })
            .await
            .map(|_| ())
            .unwrap_err()
            .attempts
        })
    };
    first_seen.recv().await.unwrap();
    // In the call's 2 s pause: version 2, then shutdown.
    assert_eq!(apply(&running, slow_policies(2)).await, 2);
    eventually("the agent on v2", || async {
        agent.policies().version() == 2
    })
    .await;
    agent.shutdown().await;
    assert!(!call.is_finished(), "shutdown took longer than the pause");
    assert_eq!(call.await.unwrap(), 2, "the call ran on v1 to its end");
    running.shutdown().await.unwrap();
    let c = agent.endpoint("ep").pending_counts();
    assert_eq!(
        (c.calls, c.attempts, c.gave_up_attempts),
        (1, 2, 1),
        "the call ended after shutdown began is in no count: {c:?}"
    );
}
