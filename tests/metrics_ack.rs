//! End-to-end, raw protocol: numbered metrics reports are acknowledged and counted once per
//! (agent id, instance, seq), across streams; reports without a seq are counted as before.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use std::time::Duration;

use retryplane_e2e::*;

const EP: &str = "ep-0";

async fn calls(plane: &Plane) -> u64 {
    endpoint_stats(plane, EP).await.map_or(0, |s| s.calls)
}

/// The value of the server figure `name` in `/metrics`.
async fn server_figure(plane: &Plane, name: &str) -> Option<u64> {
    let text = metrics_text(plane.running.http_addr).await;
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// A stream of `id` from process `instance`, past its first snapshot.
async fn stream(plane: &Plane, id: &str, instance: u64) -> RawAgent {
    let mut agent = RawAgent::connect(plane.agent_channel().await, hello_instance(id, instance))
        .await
        .unwrap();
    agent.next_snapshot().await.unwrap();
    agent
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_sent_again_on_a_new_stream_is_acknowledged_and_counted_once() {
    let plane = Plane::file_mode(&policy_yaml(1, 3)).await;
    let mut first = stream(&plane, "a1", 7).await;
    first.send(report(1, EP, 5)).await;
    assert_eq!(first.next_ack().await, (1, false));
    assert_eq!(calls(&plane).await, 5);

    // The agent did not hear the ack (say) and sends seq 1 again on its next stream.
    let mut second = stream(&plane, "a1", 7).await;
    second.send(report(1, EP, 5)).await;
    second.send(report(2, EP, 3)).await;
    assert_eq!(second.next_ack().await, (1, false), "acknowledged again");
    assert_eq!(second.next_ack().await, (2, false));
    assert_eq!(calls(&plane).await, 8, "seq 1 counted once");
    assert_eq!(
        server_figure(&plane, "retryplane_server_reports_duplicate_total").await,
        Some(1)
    );

    // A restarted process (new instance id) numbers from 1 again and is counted.
    let mut restarted = stream(&plane, "a1", 8).await;
    restarted.send(report(1, EP, 4)).await;
    assert_eq!(restarted.next_ack().await, (1, false));
    assert_eq!(calls(&plane).await, 12);
    restarted.send(report(2, EP, 1)).await;
    assert_eq!(restarted.next_ack().await, (2, false));
    assert_eq!(calls(&plane).await, 13);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_without_a_seq_is_counted_every_time_and_never_acknowledged() {
    let plane = Plane::file_mode(&policy_yaml(1, 3)).await;
    let mut agent = stream(&plane, "old", 9).await;
    agent.send(report(0, EP, 2)).await;
    agent.send(report(0, EP, 2)).await;
    // The next message answers the numbered report: nothing was sent for the two before it.
    agent.send(report(1, EP, 1)).await;
    assert_eq!(agent.next_ack().await, (1, false));
    assert_eq!(calls(&plane).await, 5);
    let mut again = stream(&plane, "old", 9).await;
    again.send(report(0, EP, 2)).await;
    again.send(report(2, EP, 1)).await;
    assert_eq!(again.next_ack().await, (2, false));
    assert_eq!(calls(&plane).await, 8);
    assert_eq!(
        server_figure(&plane, "retryplane_server_reports_duplicate_total").await,
        Some(0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seq_from_a_client_with_no_instance_id_is_taken_as_unnumbered() {
    let plane = Plane::file_mode(&policy_yaml(1, 3)).await;
    // Without an instance id a restarted client's seq 1 looks like its previous process's:
    // every report is counted as it comes, as an unnumbered one would be.
    let first = stream(&plane, "no-instance", 0).await;
    first.send(report(1, EP, 2)).await;
    // Counted before the next stream replaces this one (there is no ack to wait for).
    eventually("the first report counted", || async {
        calls(&plane).await == 2
    })
    .await;
    let restarted = stream(&plane, "no-instance", 0).await;
    restarted.send(report(1, EP, 3)).await;
    eventually("the same seq counted again", || async {
        calls(&plane).await == 5
    })
    .await;
    assert_eq!(
        server_figure(&plane, "retryplane_server_reports_duplicate_total").await,
        Some(0)
    );
    // A numbered client on the same server is answered, and only it.
    let mut numbered = stream(&plane, "numbered", 4).await;
    numbered.send(report(1, EP, 1)).await;
    assert_eq!(numbered.next_ack().await, (1, false));
    assert_eq!(calls(&plane).await, 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_limited_report_is_acknowledged_as_dropped_and_not_counted() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("policies.yaml"), policy_yaml(1, 3)).unwrap();
    // One report, then none for the rest of the test (a token every 30 minutes).
    let plane = Plane::start_with(dir, false, None, |cfg| {
        cfg.metrics_interval = Duration::from_secs(3600);
        cfg.stream_limits.report_burst = 1.0;
        cfg.stream_limits.reports_per_second = 0.0;
    })
    .await;
    let mut agent = stream(&plane, "fast", 9).await;
    agent.send(report(1, EP, 5)).await;
    agent.send(report(2, EP, 3)).await;
    assert_eq!(agent.next_ack().await, (1, false));
    assert_eq!(agent.next_ack().await, (2, true), "refused");
    assert_eq!(calls(&plane).await, 5);
    assert_eq!(
        server_figure(&plane, "retryplane_server_reports_dropped_total").await,
        Some(1)
    );
    // A refused seq stays refused (the agent sends its counts again under a new seq, so a
    // late or repeated copy of seq 2 must not count as well), and a new stream of the same
    // agent id has no new burst: the rate limit is the agent id's, across its streams.
    let mut next = stream(&plane, "fast", 9).await;
    next.send(report(2, EP, 3)).await;
    assert_eq!(next.next_ack().await, (2, true), "refused again");
    next.send(report(3, EP, 3)).await;
    assert_eq!(
        next.next_ack().await,
        (3, true),
        "no fresh burst on reconnect"
    );
    assert_eq!(calls(&plane).await, 5);
    assert_eq!(
        server_figure(&plane, "retryplane_server_reports_dropped_total").await,
        Some(2),
        "seqs 2 and 3: seq 2 sent again was not dropped again"
    );
    // Another agent id has its own.
    let mut other = stream(&plane, "other", 10).await;
    other.send(report(1, EP, 2)).await;
    assert_eq!(other.next_ack().await, (1, false));
    assert_eq!(calls(&plane).await, 7);
    assert_eq!(
        server_figure(&plane, "retryplane_server_reports_duplicate_total").await,
        Some(0)
    );
}

/// A seq more than 63 below the highest of its process cannot be told counted or not: it is
/// acknowledged, not counted, and shows in its own figure, not among duplicates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_far_below_the_highest_is_acknowledged_not_counted_and_counted_apart() {
    let plane = Plane::file_mode(&policy_yaml(1, 3)).await;
    let mut agent = stream(&plane, "a1", 7).await;
    agent.send(report(100, EP, 5)).await;
    assert_eq!(agent.next_ack().await, (100, false));
    agent.send(report(20, EP, 3)).await;
    assert_eq!(agent.next_ack().await, (20, false));
    agent.send(report(37, EP, 2)).await;
    assert_eq!(
        agent.next_ack().await,
        (37, false),
        "63 below: still tracked"
    );
    assert_eq!(calls(&plane).await, 7, "seq 20 not counted");
    assert_eq!(
        server_figure(&plane, "retryplane_server_reports_out_of_window_total").await,
        Some(1)
    );
    assert_eq!(
        server_figure(&plane, "retryplane_server_reports_duplicate_total").await,
        Some(0)
    );
}

/// An agent that half-closes its stream right after its last reports (a shutdown) still gets
/// every ack the control plane owes it: acks held while others waited for room are sent
/// before the stream ends, not dropped with it (the agent would take those reports for
/// unacknowledged).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reports_sent_just_before_a_half_close_are_all_acknowledged() {
    let plane = Plane::file_mode(&policy_yaml(1, 3)).await;
    for round in 0..5u64 {
        let agent = stream(&plane, &format!("a{round}"), 7).await;
        for seq in 1..=5 {
            agent.send(report(seq, EP, 1)).await;
        }
        let RawAgent { tx, mut rx } = agent;
        drop(tx);
        let mut acked = Vec::new();
        while let Ok(Some(m)) = tokio::time::timeout(WAIT, rx.message()).await.unwrap() {
            acked.extend(m.metrics_ack.map(|a| (a.seq, a.dropped)));
        }
        let all: Vec<(u64, bool)> = (1..=5).map(|seq| (seq, false)).collect();
        assert_eq!(acked, all, "round {round}");
    }
    assert_eq!(calls(&plane).await, 5 * 5);
}
