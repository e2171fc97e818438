//! Counts held under their version when a new one replaces it while the report window is full
//! (README, "Metrics delivery"): calls that outlived the version go on counting under it at
//! every report, and those counts join the report held at the swap, so one swap never pushes
//! the held counts out (at most 16 held reports; past that the oldest one's go out with the
//! next version's) and none of them is credited to the version that replaced theirs.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use retryplane_agent::CallMeta;
use retryplane_proto::pb;
use retryplane_proto::pb::agent_message::Kind;
use support::plane::succeed;
use support::script::{Event, Script, send, snapshot_of};
use support::{Fut, response};
use tokio::time::Instant;

/// `ep`: ten attempts, 5 ms apart; `n` makes each version new.
fn policies(n: u64) -> String {
    format!(
        "version: 1\ndefaults:\n  per_try_timeout: 2s\n  deadline: 10s\n  backoff: {{base: 5ms, max: 5ms, jitter: none}}\n  budget: {{enabled: false}}\n  circuit_breaker: {{enabled: false}}\nendpoints:\n  ep:\n    max_attempts: 10\n  other-{n}: {{}}\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_swap_with_the_window_full_and_calls_that_outlive_it_credits_none_of_its_counts_to_the_next()
 {
    let mut script = Script::start().await;
    script.announce_acks(true);
    let agent = support::plane::builder(script.addr, "a")
        .metrics_interval(Duration::from_millis(100))
        .connect()
        .unwrap();
    let (to_agent, _) = script.reconnected().await;
    let mut v1 = snapshot_of(1, &policies(1));
    v1.metrics_interval_ms = 100;
    send(&to_agent, &v1).await;
    assert!(matches!(script.reply().await, Kind::Ack(a) if a.version == 1));

    // Calls under v1 while the control plane acknowledges nothing, until the window (8) is full.
    let mut seqs = BTreeSet::new();
    let bound = Instant::now() + Duration::from_secs(20);
    while seqs.len() < 8 {
        assert!(Instant::now() < bound, "eight reports within 20 s");
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
    succeed(&agent, 5).await;

    // Twelve calls on v1 whose attempts take 150 ms each (503): they outlive v1 by about 1.5 s,
    // counting an attempt and a retry in most reports' intervals.
    let started = Arc::new(AtomicU64::new(0));
    let mut slow = Vec::new();
    for _ in 0..12 {
        let ep = agent.endpoint("ep");
        let started = started.clone();
        slow.push(tokio::spawn(async move {
            ep.call(CallMeta::http("GET", "/"), move |_| -> Fut {
                started.fetch_add(1, Ordering::SeqCst);
                Box::pin(async {
                    tokio::time::sleep(Duration::from_millis(150)).await;
                    Ok(response(503, None))
                })
            })
            .await
            .map(|_| ())
            .unwrap_err()
            .attempts
        }));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let bound = Instant::now() + Duration::from_secs(10);
    while started.load(Ordering::SeqCst) < 12 {
        assert!(Instant::now() < bound, "the slow calls start");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let pending = agent.endpoint("ep").pending_counts().calls;

    // v2; no call is made on it.
    let mut v2 = snapshot_of(2, &policies(2));
    v2.metrics_interval_ms = 100;
    send(&to_agent, &v2).await;
    assert!(matches!(script.reply().await, Kind::Ack(a) if a.version == 2));
    for s in slow {
        let attempts = tokio::time::timeout(Duration::from_secs(10), s)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(attempts, 10, "each ran on v1 to its end");
    }
    // Twenty more intervals with the window still full.
    tokio::time::sleep(Duration::from_secs(2)).await;

    // The control plane catches up, acknowledging every report from now on.
    let ack = |seq: u64| {
        Ok(pb::ServerMessage::with_metrics_ack(pb::MetricsAck {
            seq,
            dropped: false,
        }))
    };
    for seq in &seqs {
        to_agent.send(ack(*seq)).await.unwrap();
    }
    // (version -> calls) of the reports from here on: the 12 slow calls and what was pending.
    let expected = pending + 12;
    let mut by_version: BTreeMap<u64, u64> = BTreeMap::new();
    let bound = Instant::now() + Duration::from_secs(10);
    while by_version.values().sum::<u64>() < expected {
        assert!(
            Instant::now() < bound,
            "{expected} calls reported within 10 s: {by_version:?}"
        );
        tokio::select! {
            e = script.next() => match e {
                Event::Message(Kind::Metrics(r)) => {
                    *by_version.entry(r.policy_version).or_default() +=
                        r.endpoints.iter().map(|e| e.calls).sum::<u64>();
                    to_agent.send(ack(r.seq)).await.unwrap();
                }
                other => panic!("expected metrics, got {other:?}"),
            },
            () = tokio::time::sleep(Duration::from_millis(50)) => {}
        }
    }
    assert_eq!(
        by_version.get(&2).copied().unwrap_or(0),
        0,
        "(version -> calls) {by_version:?}: no call ran on version 2"
    );
    script.shut_down(agent, to_agent).await;
}
