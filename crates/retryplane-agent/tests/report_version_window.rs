//! The policy version a report's counts are credited to, when the control plane is slow to
//! acknowledge reports. `MetricsReport.policy_version` is "the policy version the counts were
//! made under", and the control plane sums counts per version (README, **Metrics**): counts
//! made under one version must not be credited to the next.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::collections::BTreeSet;
use std::time::Duration;

use retryplane_agent::{Agent, AgentBuilder};
use retryplane_proto::pb;
use retryplane_proto::pb::agent_message::Kind;
use support::plane::succeed;
use support::script::{Event, Script, ToAgent, send, snapshot};
use tokio::time::Instant;

/// A snapshot of `version` (endpoint `ep` with `max_attempts`) whose metrics interval is
/// 100 ms.
fn snapshot_every_100ms(version: u64, max_attempts: u32) -> pb::Snapshot {
    let mut snap = snapshot(version, max_attempts);
    snap.metrics_interval_ms = 100;
    snap
}

/// A scripted control plane that announces acknowledgements, and an agent on it (its builder
/// as `tune` makes it) to which `v1` was pushed and that acknowledged it.
async fn under_v1(
    tune: impl FnOnce(AgentBuilder) -> AgentBuilder,
    v1: &pb::Snapshot,
) -> (Script, Agent, ToAgent) {
    let mut script = Script::start().await;
    script.announce_acks(true);
    let agent = tune(support::plane::builder(script.addr, "a"))
        .connect()
        .unwrap();
    let (to_agent, _) = script.reconnected().await;
    send(&to_agent, v1).await;
    assert!(matches!(script.reply().await, Kind::Ack(a) if a.version == 1));
    (script, agent, to_agent)
}

/// [`under_v1`] for an agent that reports every 100 ms, as v1 says too.
async fn reporting_every_100ms() -> (Script, Agent, ToAgent) {
    under_v1(
        |b| b.metrics_interval(Duration::from_millis(100)),
        &snapshot_every_100ms(1, 1),
    )
    .await
}

/// Makes calls while the control plane acknowledges nothing, until the agent's window of
/// unacknowledged reports (8) is full; each report is handed to `check`. The reports' seqs.
async fn fill_the_window(
    script: &mut Script,
    agent: &Agent,
    mut check: impl FnMut(&pb::MetricsReport),
) -> BTreeSet<u64> {
    let mut seqs = BTreeSet::new();
    let bound = Instant::now() + Duration::from_secs(20);
    while seqs.len() < 8 {
        assert!(
            Instant::now() < bound,
            "eight reports within 20 s: {seqs:?}"
        );
        succeed(agent, 1).await;
        tokio::select! {
            e = script.next() => match e {
                Event::Message(Kind::Metrics(r)) => {
                    check(&r);
                    seqs.insert(r.seq);
                }
                other => panic!("expected metrics, got {other:?}"),
            },
            () = tokio::time::sleep(Duration::from_millis(20)) => {}
        }
    }
    seqs
}

/// The control plane's answer to report `seq`: taken, or refused (`dropped`).
async fn ack(to_agent: &ToAgent, seq: u64, dropped: bool) {
    to_agent
        .send(Ok(pb::ServerMessage::with_metrics_ack(pb::MetricsAck {
            seq,
            dropped,
        })))
        .await
        .unwrap();
}

/// The next message, a metrics report (`what` names it in the failure).
async fn next_report(script: &mut Script, what: &str) -> pb::MetricsReport {
    match script.next().await {
        Event::Message(Kind::Metrics(r)) => r,
        other => panic!("expected {what}, got {other:?}"),
    }
}

/// The next metrics report with a call in it, past any without (`what` names it in the
/// failure).
async fn next_report_with_calls(script: &mut Script, what: &str) -> pb::MetricsReport {
    loop {
        let r = next_report(script, what).await;
        if r.endpoints.iter().any(|e| e.calls > 0) {
            return r;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_made_under_a_version_are_credited_to_it_when_the_report_window_is_full_at_a_swap() {
    let (mut script, agent, to_agent) = reporting_every_100ms().await;

    // Calls under v1 while the control plane acknowledges nothing, until the agent's window of
    // unacknowledged reports (8) is full.
    let seqs = fill_the_window(&mut script, &agent, |r| assert_eq!(r.policy_version, 1)).await;

    // Five more calls under v1, then v2 is pushed.
    let before = agent.endpoint("ep").pending_counts().calls;
    succeed(&agent, 5).await;
    send(&to_agent, &snapshot_every_100ms(2, 2)).await;
    assert!(matches!(script.reply().await, Kind::Ack(a) if a.version == 2));
    assert_eq!(agent.policies().version(), 2);

    // The control plane catches up: every waiting report is acknowledged. No call is made
    // under v2, so every count still to come was made under v1.
    for seq in &seqs {
        ack(&to_agent, *seq, false).await;
    }
    let report = next_report_with_calls(&mut script, "metrics").await;
    let calls: u64 = report.endpoints.iter().map(|e| e.calls).sum();
    assert_eq!(calls, before + 5, "every call held back is in it");
    assert_eq!(
        report.policy_version, 1,
        "{calls} calls made under version 1 are reported under version {}",
        report.policy_version
    );
    script.shut_down(agent, to_agent).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counts_of_a_report_refused_after_a_swap_go_out_again_under_the_version_they_were_made_under()
 {
    // The default interval (10 s): no periodic report comes during the test.
    let (mut script, agent, to_agent) = under_v1(|b| b, &snapshot(1, 1)).await;
    succeed(&agent, 3).await;
    // v2: the three calls made under v1 go out first, under v1.
    send(&to_agent, &snapshot_every_100ms(2, 2)).await;
    let refused = next_report(&mut script, "a report first").await;
    assert_eq!((refused.policy_version, refused.endpoints[0].calls), (1, 3));
    assert!(matches!(script.reply().await, Kind::Ack(a) if a.version == 2));
    // The control plane refuses that report (its rate limit): the agent sends the counts
    // again in a later report. Nothing is called under v2.
    ack(&to_agent, refused.seq, true).await;
    let again = next_report(&mut script, "the counts again").await;
    assert_ne!(again.seq, refused.seq);
    assert_eq!(again.endpoints[0].calls, 3);
    assert_eq!(
        again.policy_version, 1,
        "3 calls made under version 1 are sent again under version {}",
        again.policy_version
    );
    script.shut_down(agent, to_agent).await;
}

/// A report's span (`window_end - window_start`) is what the control plane spreads its counts
/// over when it covers more than two intervals (README, **Metrics**: an agent's backlog is not
/// read as a burst). A backlog report refused by the control plane's rate limit has its counts
/// sent again "later" (README, **Metrics delivery**): the report that carries them again must
/// still cover the time they were made over, or the backlog lands in the 1-minute window as a
/// burst (and past ten million a second over the minute a short span is taken for, is left out
/// as implausible).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counts_of_a_refused_backlog_report_go_out_again_over_the_time_they_were_made_in() {
    let (mut script, agent, to_agent) = reporting_every_100ms().await;

    // The control plane acknowledges nothing until the agent's window of unacknowledged
    // reports (8) is full.
    let seqs = fill_the_window(&mut script, &agent, |_| {}).await;
    // Calls go on for 2 s (20 intervals) with the window full: a backlog builds up.
    let backlog_from = Instant::now();
    while backlog_from.elapsed() < Duration::from_secs(2) {
        succeed(&agent, 1).await;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for seq in &seqs {
        ack(&to_agent, *seq, false).await;
    }
    let span = |r: &pb::MetricsReport| r.window_end_unix_ms.saturating_sub(r.window_start_unix_ms);
    let calls = |r: &pb::MetricsReport| r.endpoints.iter().map(|e| e.calls).sum::<u64>();
    let backlog = next_report_with_calls(&mut script, "metrics").await;
    assert!(
        span(&backlog) >= 2_000,
        "the backlog's report spans the time it was made over: {} ms",
        span(&backlog)
    );
    // The control plane refuses it (its rate limit). No call is made from here on.
    ack(&to_agent, backlog.seq, true).await;
    let again = next_report_with_calls(&mut script, "the counts again").await;
    assert_eq!(
        calls(&again),
        calls(&backlog),
        "the refused counts go out again"
    );
    assert!(
        span(&again) >= span(&backlog),
        "{} calls made over {} ms go out again in a report that says they were made over {} ms: \
         the control plane reads them as a burst",
        calls(&again),
        span(&backlog),
        span(&again)
    );
    script.shut_down(agent, to_agent).await;
}
