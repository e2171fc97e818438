//! Metrics towards a control plane that does not acknowledge reports (one that predates
//! `MetricsAck`): the agent numbers, keeps and resends reports only on a stream whose response
//! says they are acknowledged (`retryplane-metrics-ack: 1`). Against the scripted control plane
//! (`support::script`), which announces acknowledgements only when told to and never sends one.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::collections::BTreeSet;
use std::time::Duration;

use retryplane_agent::Agent;
use retryplane_proto::pb;
use retryplane_proto::pb::agent_message::Kind;
use support::plane::succeed;
use support::script::{Event, Script, ToAgent, send, snapshot, snapshot_of};

/// Reports every 100 ms (the shortest interval), from the first snapshot on.
async fn connected(script: &mut Script) -> (Agent, ToAgent) {
    connected_with(script, snapshot(1, 1)).await
}

/// [`connected`], with `v1` as the first snapshot.
async fn connected_with(script: &mut Script, mut v1: pb::Snapshot) -> (Agent, ToAgent) {
    let agent = support::plane::builder(script.addr, "a")
        .metrics_interval(Duration::from_millis(100))
        .connect()
        .unwrap();
    let (to_agent, _hello) = script.reconnected().await;
    v1.metrics_interval_ms = 100;
    send(&to_agent, &v1).await;
    match script.reply().await {
        Kind::Ack(ack) => assert_eq!(ack.version, 1),
        other => panic!("expected Ack v1, got {other:?}"),
    }
    (agent, to_agent)
}

/// Reports on the open stream until their calls add up to `calls`, in arrival order.
async fn reports_until(script: &mut Script, calls: u64) -> Vec<pb::MetricsReport> {
    let mut reports = Vec::new();
    let mut seen = 0;
    while seen < calls {
        match script.next().await {
            Event::Message(Kind::Metrics(r)) => {
                seen += r.endpoints.iter().map(|e| e.calls).sum::<u64>();
                reports.push(r);
            }
            other => panic!("expected a metrics report, got {other:?}"),
        }
    }
    assert_eq!(seen, calls, "no call counted twice");
    reports
}

/// Shuts the agent down and returns the calls of every report it still sends.
async fn shut_down(mut script: Script, agent: Agent, to_agent: ToAgent) -> u64 {
    let mut late = 0;
    let drain = async {
        loop {
            match script.next().await {
                Event::Message(Kind::Metrics(r)) => {
                    late += r.endpoints.iter().map(|e| e.calls).sum::<u64>();
                }
                Event::Ended => break,
                other => panic!("expected the stream to end, got {other:?}"),
            }
        }
        drop(to_agent);
    };
    tokio::time::timeout(support::plane::WAIT, async {
        tokio::join!(agent.shutdown(), drain)
    })
    .await
    .expect("the agent shuts down in time");
    script.stop().await;
    late
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_control_plane_that_never_acknowledges_gets_every_report_unnumbered() {
    let mut script = Script::start().await;
    let (agent, to_agent) = connected(&mut script).await;
    // More reports than an agent keeps unacknowledged: a numbering agent would stop here.
    let mut reports = Vec::new();
    for _ in 0..12 {
        succeed(&agent, 2).await;
        reports.extend(reports_until(&mut script, 2).await);
    }
    assert!(reports.len() >= 12, "{} reports", reports.len());
    assert!(
        reports.iter().all(|r| r.seq == 0),
        "seqs {:?}",
        reports.iter().map(|r| r.seq).collect::<Vec<_>>()
    );
    assert_eq!(shut_down(script, agent, to_agent).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reports_kept_for_an_acknowledging_control_plane_go_once_to_one_that_does_not() {
    let mut script = Script::start().await;
    script.announce_acks(true);
    let (agent, to_agent) = connected(&mut script).await;
    succeed(&agent, 3).await;
    // Numbered and kept: the script never acknowledges.
    let first = reports_until(&mut script, 3).await;
    assert!(first.iter().all(|r| r.seq > 0), "numbered: {first:?}");

    // The stream is lost; the next one comes from a control plane without acknowledgements.
    script.announce_acks(false);
    drop(to_agent);
    let (to_agent, _hello) = script.reconnected().await;
    // The kept counts come back once, unnumbered, with no new call made.
    let again = reports_until(&mut script, 3).await;
    assert!(again.iter().all(|r| r.seq == 0), "unnumbered: {again:?}");
    succeed(&agent, 2).await;
    let next = reports_until(&mut script, 2).await;
    assert!(next.iter().all(|r| r.seq == 0), "unnumbered: {next:?}");
    assert_eq!(
        shut_down(script, agent, to_agent).await,
        0,
        "nothing sent twice"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_shutdown_counts_held_back_by_a_full_window_still_go_out() {
    let mut script = Script::start().await;
    script.announce_acks(true);
    let (agent, to_agent) = connected(&mut script).await;
    // Eight reports, none acknowledged: the window is full and new counts are held back.
    let mut numbered = 0;
    while numbered < 8 {
        succeed(&agent, 1).await;
        numbered += reports_until(&mut script, 1).await.len();
    }
    succeed(&agent, 5).await;
    // The held-back counts go out in the last report.
    let handle = agent.clone();
    assert_eq!(handle.unacknowledged_reports(), 0, "not stopped yet");
    assert_eq!(shut_down(script, agent, to_agent).await, 5);
    // None was acknowledged: the eight, and the last one.
    assert_eq!(handle.unacknowledged_reports(), 9);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counts_made_before_a_new_version_are_reported_under_the_old_one() {
    let mut script = Script::start().await;
    script.announce_acks(true);
    // The default interval (10 s): no periodic report comes during the test.
    let agent = support::plane::builder(script.addr, "a").connect().unwrap();
    let (to_agent, _hello) = script.reconnected().await;
    send(&to_agent, &snapshot(1, 1)).await;
    match script.reply().await {
        Kind::Ack(ack) => assert_eq!(ack.version, 1),
        other => panic!("expected Ack v1, got {other:?}"),
    }
    succeed(&agent, 3).await;
    send(&to_agent, &snapshot(2, 1)).await;
    // Before the new version is acknowledged, a report of the three calls under version 1.
    match script.next().await {
        Event::Message(Kind::Metrics(r)) => {
            assert_eq!(r.policy_version, 1);
            assert_eq!(r.endpoints.iter().map(|e| e.calls).sum::<u64>(), 3);
        }
        other => panic!("expected a metrics report first, got {other:?}"),
    }
    match script.next().await {
        Event::Message(Kind::Ack(ack)) => assert_eq!(ack.version, 2),
        other => panic!("expected Ack v2, got {other:?}"),
    }
    script.shut_down(agent, to_agent).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reports_still_go_out_when_every_stream_is_shorter_than_the_interval() {
    let mut script = Script::start().await;
    script.announce_acks(true);
    let agent = support::plane::builder(script.addr, "a").connect().unwrap();
    let (to_agent, _hello) = script.reconnected().await;
    let mut v1 = snapshot(1, 1);
    v1.metrics_interval_ms = 400;
    send(&to_agent, &v1).await;
    match script.reply().await {
        Kind::Ack(ack) => assert_eq!(ack.version, 1),
        other => panic!("expected Ack v1, got {other:?}"),
    }
    succeed(&agent, 3).await;
    drop(to_agent);
    // From now on every stream is cut within 200 ms of the last cut: none lives as long as
    // the interval. The script never acknowledges, so a report comes again on every stream:
    // each seq counts once.
    let deadline = tokio::time::Instant::now() + support::plane::WAIT;
    let mut cut = tokio::time::interval(Duration::from_millis(200));
    let mut open = None;
    let mut seqs = BTreeSet::new();
    let mut calls = 0;
    while calls < 3 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no report while streams kept being cut before the interval ended"
        );
        tokio::select! {
            event = script.next() => match event {
                Event::Opened(tx) => open = Some(tx),
                Event::Message(Kind::Metrics(r)) if seqs.insert(r.seq) => {
                    calls += r.endpoints.iter().map(|e| e.calls).sum::<u64>();
                }
                _ => {}
            },
            _ = cut.tick() => open = None,
        }
    }
    assert_eq!(calls, 3);
    drop(open);
    agent.shutdown().await;
    script.stop().await;
}

/// The sum of every report's counters for `ep`.
fn totals(reports: &[pb::MetricsReport]) -> pb::EndpointCounters {
    let mut t = pb::EndpointCounters::default();
    for e in reports.iter().flat_map(|r| &r.endpoints) {
        t.calls += e.calls;
        t.attempts += e.attempts;
        t.retries += e.retries;
        t.success_first_try += e.success_first_try;
        t.success_after_retry += e.success_after_retry;
        t.gave_up_attempts += e.gave_up_attempts;
    }
    t
}

/// Reports on the open stream until `done` holds for the sum of them all.
async fn reports_while(
    script: &mut Script,
    reports: &mut Vec<pb::MetricsReport>,
    done: impl Fn(&pb::EndpointCounters) -> bool,
) {
    while !done(&totals(reports)) {
        match script.next().await {
            Event::Message(Kind::Metrics(r)) => reports.push(r),
            other => panic!("expected a metrics report, got {other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_still_running_when_reports_are_cut_adds_up_exactly_once_it_ends() {
    let mut script = Script::start().await;
    // Attempts that wait for the test as long as it takes (a loaded machine may take seconds).
    let policies = "version: 1\ndefaults:\n  backoff: {base: 5ms, max: 20ms, jitter: none}\n  budget: {enabled: false}\n  circuit_breaker: {enabled: false}\nendpoints:\n  ep:\n    max_attempts: 3\n    per_try_timeout: 60s\n    deadline: 120s\n";
    let (agent, to_agent) = connected_with(&mut script, snapshot_of(1, policies)).await;
    // The first attempt fails at once; the second is answered only when the test says so.
    let gate = std::sync::Arc::new(tokio::sync::Notify::new());
    let call = tokio::spawn({
        let (ep, gate) = (agent.endpoint("ep"), gate.clone());
        async move {
            ep.call(retryplane_agent::CallMeta::http("GET", "/"), move |info| {
                let gate = gate.clone();
                async move {
                    if info.number > 1 {
                        gate.notified().await;
                    }
                    let status = if info.number == 1 { 503 } else { 200 };
                    Ok::<_, std::io::Error>(support::response(status, None))
                }
            })
            .await
        }
    });
    // Reports go out while the second attempt runs: the call, both attempts and the retry,
    // and no outcome yet.
    let mut reports = Vec::new();
    // (A report may be cut between the counters of one attempt's start: wait for all three.)
    reports_while(&mut script, &mut reports, |t| {
        (t.calls, t.attempts, t.retries) == (1, 2, 1)
    })
    .await;
    let so_far = totals(&reports);
    assert_eq!(so_far.success_after_retry, 0, "{so_far:?}");
    gate.notify_one();
    call.await.unwrap().unwrap();
    reports_while(&mut script, &mut reports, |t| t.success_after_retry == 1).await;
    let t = totals(&reports);
    assert_eq!(
        (
            t.calls,
            t.attempts,
            t.retries,
            t.success_first_try,
            t.success_after_retry
        ),
        (1, 2, 1, 0, 1),
        "every count once: {t:?}"
    );
    assert_eq!(
        shut_down(script, agent, to_agent).await,
        0,
        "nothing sent twice"
    );
}

/// An agent with nothing to report sends nothing, but its next report still spans only the
/// time since: the control plane spreads the counts of a report spanning more than two
/// intervals over that time, as a backlog, and calls made after an idle spell are no backlog.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_after_an_idle_spell_spans_only_the_time_since_the_last_report_was_due() {
    let mut script = Script::start().await;
    let (agent, to_agent) = connected(&mut script).await;
    succeed(&agent, 2).await;
    reports_until(&mut script, 2).await;
    // Twenty intervals without a call, then 2 calls: the report spans about one interval
    // (a loaded machine may wake late), never the idle spell.
    tokio::time::sleep(Duration::from_secs(2)).await;
    succeed(&agent, 2).await;
    let after = reports_until(&mut script, 2).await;
    let span = after[0].window_end_unix_ms - after[0].window_start_unix_ms;
    assert!(
        span < 1_000,
        "the report after the idle spell spans {span} ms"
    );
    assert_eq!(shut_down(script, agent, to_agent).await, 0);
}
