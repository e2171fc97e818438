//! The policy version a report's counts are credited to, when the control plane is slow to
//! acknowledge reports. `MetricsReport.policy_version` is "the policy version the counts were
//! made under", and the control plane sums counts per version (README, **Metrics**): counts
//! made under one version must not be credited to the next.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::collections::BTreeSet;
use std::time::Duration;

use retryplane_proto::pb;
use retryplane_proto::pb::agent_message::Kind;
use support::plane::succeed;
use support::script::{Event, Script, send, snapshot};
use tokio::time::Instant;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_made_under_a_version_are_credited_to_it_when_the_report_window_is_full_at_a_swap() {
    let mut script = Script::start().await;
    script.announce_acks(true);
    let agent = support::plane::builder(script.addr, "a")
        .metrics_interval(Duration::from_millis(100))
        .connect()
        .unwrap();
    let (to_agent, _) = script.reconnected().await;
    let mut v1 = snapshot(1, 1);
    v1.metrics_interval_ms = 100;
    send(&to_agent, &v1).await;
    assert!(matches!(script.reply().await, Kind::Ack(a) if a.version == 1));

    // Calls under v1 while the control plane acknowledges nothing, until the agent's window of
    // unacknowledged reports (8) is full.
    let mut seqs = BTreeSet::new();
    let bound = Instant::now() + Duration::from_secs(20);
    while seqs.len() < 8 {
        assert!(
            Instant::now() < bound,
            "eight reports within 20 s: {seqs:?}"
        );
        succeed(&agent, 1).await;
        tokio::select! {
            e = script.next() => match e {
                Event::Message(Kind::Metrics(r)) => {
                    assert_eq!(r.policy_version, 1);
                    seqs.insert(r.seq);
                }
                other => panic!("expected metrics, got {other:?}"),
            },
            () = tokio::time::sleep(Duration::from_millis(20)) => {}
        }
    }

    // Five more calls under v1, then v2 is pushed.
    let before = agent.endpoint("ep").pending_counts().calls;
    succeed(&agent, 5).await;
    let mut v2 = snapshot(2, 2);
    v2.metrics_interval_ms = 100;
    send(&to_agent, &v2).await;
    assert!(matches!(script.reply().await, Kind::Ack(a) if a.version == 2));
    assert_eq!(agent.policies().version(), 2);

    // The control plane catches up: every waiting report is acknowledged. No call is made
    // under v2, so every count still to come was made under v1.
    for seq in &seqs {
        to_agent
            .send(Ok(pb::ServerMessage::with_metrics_ack(pb::MetricsAck {
                seq: *seq,
                dropped: false,
            })))
            .await
            .unwrap();
    }
    let report = loop {
        match script.next().await {
            Event::Message(Kind::Metrics(r)) if r.endpoints.iter().any(|e| e.calls > 0) => {
                break r;
            }
            Event::Message(Kind::Metrics(_)) => {}
            other => panic!("expected metrics, got {other:?}"),
        }
    };
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
    let mut script = Script::start().await;
    script.announce_acks(true);
    // The default interval (10 s): no periodic report comes during the test.
    let agent = support::plane::builder(script.addr, "a").connect().unwrap();
    let (to_agent, _) = script.reconnected().await;
    send(&to_agent, &snapshot(1, 1)).await;
    assert!(matches!(script.reply().await, Kind::Ack(a) if a.version == 1));
    succeed(&agent, 3).await;
    // v2: the three calls made under v1 go out first, under v1.
    let mut v2 = snapshot(2, 2);
    v2.metrics_interval_ms = 100;
    send(&to_agent, &v2).await;
    let refused = match script.next().await {
        Event::Message(Kind::Metrics(r)) => r,
        other => panic!("expected a report first, got {other:?}"),
    };
    assert_eq!((refused.policy_version, refused.endpoints[0].calls), (1, 3));
    assert!(matches!(script.reply().await, Kind::Ack(a) if a.version == 2));
    // The control plane refuses that report (its rate limit): the agent sends the counts
    // again in a later report. Nothing is called under v2.
    to_agent
        .send(Ok(pb::ServerMessage::with_metrics_ack(pb::MetricsAck {
            seq: refused.seq,
            dropped: true,
        })))
        .await
        .unwrap();
    let again = match script.next().await {
        Event::Message(Kind::Metrics(r)) => r,
        other => panic!("expected the counts again, got {other:?}"),
    };
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
    let mut script = Script::start().await;
    script.announce_acks(true);
    let agent = support::plane::builder(script.addr, "a")
        .metrics_interval(Duration::from_millis(100))
        .connect()
        .unwrap();
    let (to_agent, _) = script.reconnected().await;
    let mut v1 = snapshot(1, 1);
    v1.metrics_interval_ms = 100;
    send(&to_agent, &v1).await;
    assert!(matches!(script.reply().await, Kind::Ack(a) if a.version == 1));

    // The control plane acknowledges nothing until the agent's window of unacknowledged
    // reports (8) is full.
    let mut seqs = BTreeSet::new();
    let bound = Instant::now() + Duration::from_secs(20);
    while seqs.len() < 8 {
        assert!(
            Instant::now() < bound,
            "eight reports within 20 s: {seqs:?}"
        );
        succeed(&agent, 1).await;
        tokio::select! {
            e = script.next() => match e {
                Event::Message(Kind::Metrics(r)) => {
                    seqs.insert(r.seq);
                }
                other => panic!("expected metrics, got {other:?}"),
            },
            () = tokio::time::sleep(Duration::from_millis(20)) => {}
        }
    }
    // Calls go on for 2 s (20 intervals) with the window full: a backlog builds up.
    let backlog_from = Instant::now();
    while backlog_from.elapsed() < Duration::from_secs(2) {
        succeed(&agent, 1).await;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for seq in &seqs {
        to_agent
            .send(Ok(pb::ServerMessage::with_metrics_ack(pb::MetricsAck {
                seq: *seq,
                dropped: false,
            })))
            .await
            .unwrap();
    }
    let span = |r: &pb::MetricsReport| r.window_end_unix_ms.saturating_sub(r.window_start_unix_ms);
    let calls = |r: &pb::MetricsReport| r.endpoints.iter().map(|e| e.calls).sum::<u64>();
    let backlog = loop {
        match script.next().await {
            Event::Message(Kind::Metrics(r)) if calls(&r) > 0 => break r,
            Event::Message(Kind::Metrics(_)) => {}
            other => panic!("expected metrics, got {other:?}"),
        }
    };
    assert!(
        span(&backlog) >= 2_000,
        "the backlog's report spans the time it was made over: {} ms",
        span(&backlog)
    );
    // The control plane refuses it (its rate limit). No call is made from here on.
    to_agent
        .send(Ok(pb::ServerMessage::with_metrics_ack(pb::MetricsAck {
            seq: backlog.seq,
            dropped: true,
        })))
        .await
        .unwrap();
    let again = loop {
        match script.next().await {
            Event::Message(Kind::Metrics(r)) if calls(&r) > 0 => break r,
            Event::Message(Kind::Metrics(_)) => {}
            other => panic!("expected the counts again, got {other:?}"),
        }
    };
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
