//! The counts made under the policies in force go out under their version when a pushed
//! snapshot replaces them: reported as the new policies are swapped in, not before they are
//! checked and built (4,001 endpoints take tens of milliseconds, while calls go on). Against
//! the scripted control plane (`support::script`), which records the reports.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::fmt::Write as _;

use retryplane_proto::pb::agent_message::Kind;
use support::plane::{self, WAIT};
use support::script::{Event, Script, send, snapshot};
use tokio::time::Instant;

/// Pushes a 4,001-endpoint v2 over v1 while calling `ep` in a loop until v2 is in force.
/// Returns the calls made, the calls that ended while v1 was still in force, and the calls
/// reported under v1 and under v2.
async fn calls_across_a_large_push() -> (u64, u64, u64, u64) {
    let mut script = Script::start().await;
    let agent = plane::agent(script.addr, "a", None);
    let (to_agent, _hello) = script.reconnected().await;
    send(&to_agent, &snapshot(1, 4)).await;
    match script.reply().await {
        Kind::Ack(ack) => assert_eq!(ack.version, 1),
        other => panic!("expected Ack v1, got {other:?}"),
    }
    let mut yaml = plane::yaml(3);
    for i in 0..4_000 {
        let _ = writeln!(yaml, "  endpoint-{i:05}: {{max_attempts: 3}}");
    }
    let large = support::script::snapshot_of(2, &yaml);
    let sender = to_agent.clone();
    let pushed = tokio::spawn(async move { send(&sender, &large).await });
    let deadline = Instant::now() + WAIT;
    let (mut total, mut under_v1) = (0, 0);
    while agent.policies().version() == 1 {
        assert!(Instant::now() < deadline, "v2 applied in time");
        plane::succeed(&agent, 1).await;
        total += 1;
        if agent.policies().version() == 1 {
            under_v1 += 1;
        }
        // Lets the agent's task run (on a current-thread runtime, only then).
        tokio::task::yield_now().await;
    }
    pushed.await.unwrap();
    let shutdown = agent.clone();
    let shutting = tokio::spawn(async move { shutdown.shutdown().await });
    let mut reports = Vec::new();
    loop {
        match script.next().await {
            Event::Message(Kind::Metrics(m)) => reports.push(m),
            Event::Message(Kind::Ack(ack)) => assert_eq!(ack.version, 2),
            Event::Ended => {
                drop(to_agent);
                break;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    tokio::time::timeout(WAIT, shutting).await.unwrap().unwrap();
    let reported = |version: u64| -> u64 {
        reports
            .iter()
            .filter(|r| r.policy_version == version)
            .flat_map(|r| r.endpoints.iter())
            .filter(|e| e.endpoint == "ep")
            .map(|e| e.calls)
            .sum()
    };
    (total, under_v1, reported(1), reported(2))
}

/// On a current-thread runtime, the push is handled while no call runs: exact.
#[tokio::test(flavor = "current_thread")]
async fn on_one_thread_the_calls_before_a_push_are_reported_under_the_old_version() {
    let (total, under_v1, v1, v2) = calls_across_a_large_push().await;
    assert_eq!(v1 + v2, total, "every call reported once");
    assert_eq!(
        v1, under_v1,
        "{under_v1} of {total} calls ended under v1; reported: {v1} / {v2}"
    );
}

/// On two threads, calls go on while the large snapshot is checked and built. Only those that
/// end in the instant between the last report of v1's counts and the swap can be counted under
/// v2 (in-flight calls at a push: a documented limit), not the calls of the whole build (they
/// were: 45,000 to 58,000 of 47,000 to 80,000 calls, in the runs of its review and of this
/// test on the code before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_two_threads_the_calls_made_while_a_push_is_built_are_reported_under_the_old_version() {
    let (total, under_v1, v1, v2) = calls_across_a_large_push().await;
    assert_eq!(v1 + v2, total, "every call reported once");
    let misreported = under_v1.saturating_sub(v1);
    assert!(
        misreported <= (total / 100).max(50),
        "{under_v1} of {total} calls ended under v1; reported: {v1} / {v2}"
    );
}

/// The real control plane (`retryplane serve`), an agent idle since a push (no call counted:
/// the close has nothing of its own to send, and the stream has room), then its shutdown, direct
/// or through a proxy that holds back what the control plane sends from then on (one that reads
/// but never passes on its close). Returns how long the shutdown took.
async fn idle_shutdown_after_a_swap(held: bool) -> std::time::Duration {
    let dir = tempfile::tempdir().unwrap();
    let running = plane::plane(dir.path(), &plane::yaml(2), None).await;
    let proxy = support::proxy::Proxy::start(running.agent_addr).await;
    let agent = plane::agent(proxy.addr, "a", None);
    plane::eventually("the agent on v1", || async {
        agent.policies().version() == 1
    })
    .await;
    assert_eq!(plane::apply(&running, plane::yaml(4)).await, 2);
    plane::eventually("the agent on v2", || async {
        agent.policies().version() == 2
    })
    .await;
    if held {
        proxy.hold_down(true);
    }
    let began = Instant::now();
    tokio::time::timeout(WAIT, agent.shutdown())
        .await
        .expect("shutdown ends");
    let took = began.elapsed();
    drop(proxy);
    running.shutdown().await.unwrap();
    took
}

/// Against the real control plane, which closes its side at the agent's half-close, an idle
/// agent's wait for that close ends at once: its shutdown is not held the close grace (2 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_shutdown_after_a_swap_is_not_held_by_the_real_control_plane() {
    let took = idle_shutdown_after_a_swap(false).await;
    assert!(took < std::time::Duration::from_millis(1_500), "{took:?}");
}

/// A control plane that reads but never closes its side (here a proxy that holds back its
/// close) holds an idle agent's shutdown one close grace (2 s), not more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_shutdown_behind_a_plane_that_never_closes_is_held_one_grace_at_most() {
    let took = idle_shutdown_after_a_swap(true).await;
    assert!(
        took >= std::time::Duration::from_millis(1_900)
            && took < std::time::Duration::from_millis(3_500),
        "{took:?}"
    );
}
