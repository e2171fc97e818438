//! The answers to snapshots that wait for room on the agent's stream (`stream::unsent`), and
//! the last report at shutdown, against a raw HTTP/2 control plane (`support::raw`) whose
//! stream window for the agent's messages is 0 until the test opens it (an uplink that drains
//! nothing meanwhile).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::time::Duration;

use bytes::Bytes;
use retryplane_agent::Agent;
use retryplane_proto::pb::ServerMessage;
use support::raw::{
    Opening, RawPlane, answers, calls, grpc_frame, push, received_until, shut_down_while,
};
use support::script::snapshot;

/// The ACKs of the first pushes fill the agent's queue of 16 (its Hello went before the window
/// closed); the later ones wait for room, each superseding the one before; v21 is refused.
const N: u64 = 20;

/// A window that takes everything at once.
const OPEN: u32 = 1 << 20;

/// A control plane as `opening` says and an agent on it that runs vN, whose ACK waits for room
/// (the ACKs of the first pushes fill its queue), and has refused v(N+1), whose NACK waits too.
async fn answers_waiting(
    opening: Opening,
) -> (
    RawPlane,
    Agent,
    h2::SendStream<Bytes>,
    tracing::subscriber::DefaultGuard,
) {
    let (logs, guard) = support::capture_logs("retryplane_agent=warn");
    let mut plane = RawPlane::start(opening).await;
    let agent = support::plane::agent(plane.addr, "a", None);
    let mut send = plane.stream().await;
    push(&agent, &mut send, 1..=N).await;
    let mut bad = snapshot(N + 1, 4);
    bad.content_hash = "not-the-hash".into();
    send.send_data(grpc_frame(&ServerMessage::with_snapshot(&bad)), false)
        .unwrap();
    tokio::time::timeout(Duration::from_secs(10), async {
        while !logs.text().contains("snapshot refused") {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the agent refuses the bad snapshot");
    assert_eq!(agent.policies().version(), N, "the agent runs vN");
    (plane, agent, send, guard)
}

/// Whether the last answers the control plane got are vN's ACK, then v(N+1)'s NACK.
fn ack_then_nack(got: &[(&str, u64)]) -> bool {
    got.ends_with(&[("ack", N), ("nack", N + 1)])
}

/// Both waiting answers reach the control plane once the uplink drains, the ACK first: a late
/// ACK of an earlier push is how the control plane learns what an agent that refuses the last
/// one runs. (The NACK once replaced the waiting ACK.)
#[tokio::test(flavor = "current_thread")]
async fn an_ack_waiting_for_room_is_not_lost_to_a_later_nack() {
    let (mut plane, agent, _send, _logs) = answers_waiting(Opening::default()).await;
    plane.set_window(OPEN);
    let got = answers(&received_until(&mut plane.msgs, |got| ack_then_nack(&answers(got))).await);
    assert!(got.len() < 20, "some answers waited for room: {got:?}");
    assert!(
        ack_then_nack(&got),
        "the ACK of the version the agent runs, then the NACK: {got:?}"
    );
    agent.shutdown().await;
}

/// Shutdown while answers wait for room on a control plane that stopped reading: it is held up
/// one close grace (2 s), as without them; the half-close's own grace is only for what found
/// room. (The answers' wait once came before a grace of the half-close's own: 4 s.)
#[tokio::test(flavor = "current_thread")]
async fn shutdown_with_answers_waiting_on_a_stuck_control_plane_takes_one_grace() {
    let (_plane, agent, _send, _logs) = answers_waiting(Opening::default()).await;
    let took = shut_down_while(&agent, async {}).await;
    assert!(
        took >= Duration::from_millis(1_900) && took < Duration::from_millis(3_000),
        "one grace of 2 s, spent waiting for room: {took:?}"
    );
}

/// Shutdown while the answers wait; the uplink drains 300 ms into the shutdown: both reach the
/// control plane, the ACK first, before the stream half-closes.
#[tokio::test(flavor = "current_thread")]
async fn answers_waiting_at_shutdown_go_when_the_uplink_drains() {
    let (mut plane, agent, _send, _logs) = answers_waiting(Opening::default()).await;
    shut_down_while(&agent, async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        plane.set_window(OPEN);
    })
    .await;
    let got = answers(&received_until(&mut plane.msgs, |got| ack_then_nack(&answers(got))).await);
    assert!(ack_then_nack(&got), "{got:?}");
}

/// The answers wait at shutdown; the control plane starts reading 1.5 s into it, slowly (about
/// 640 bytes a second; the 16 ACKs queued ahead take under a second). Once they have found
/// room, the half-close waits a grace of its own: both reach the control plane. (With one grace
/// for everything, they were cut off with 0.5 s left.)
#[tokio::test(flavor = "current_thread")]
async fn answers_that_find_room_late_in_the_grace_still_go_out_on_a_slow_uplink() {
    let slow = Opening {
        read_pause: Some(Duration::from_millis(25)),
        ..Opening::default()
    };
    let (mut plane, agent, _send, _logs) = answers_waiting(slow).await;
    shut_down_while(&agent, async {
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        plane.set_window(16);
    })
    .await;
    let got = answers(&received_until(&mut plane.msgs, |got| ack_then_nack(&answers(got))).await);
    assert!(
        ack_then_nack(&got),
        "the last answers: {:?}",
        &got[got.len().saturating_sub(3)..]
    );
}

/// 17 pushes: the 16 ACKs queued after the one HTTP/2 holds fill the queue, none waits; 7
/// calls are counted; the control plane reads from 300 ms into the shutdown. The last report
/// waits for room (within the grace) and carries the 7 calls. (It was dropped when the queue
/// was full at that moment, and nothing else waited.)
#[tokio::test(flavor = "current_thread")]
async fn the_last_report_waits_for_room_within_the_grace() {
    let mut plane = RawPlane::start(Opening::default()).await;
    let agent = support::plane::agent(plane.addr, "a", None);
    let mut send = plane.stream().await;
    push(&agent, &mut send, 1..=17).await;
    support::plane::succeed(&agent, 7).await;
    shut_down_while(&agent, async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        plane.set_window(OPEN);
    })
    .await;
    let got = received_until(&mut plane.msgs, |got| calls(got) >= 7).await;
    assert_eq!(
        answers(&got).last(),
        Some(&("ack", 17)),
        "every ACK arrived"
    );
    assert_eq!(calls(&got), 7, "the counts of the last report");
}

/// The pushes whose ACKs fill the agent's queue exactly, none waiting for room: the first ACK is
/// taken by the HTTP/2 body (its window 0 then holds it), the next 16 fill the queue.
const FULL: u64 = 17;

/// An idle agent (no call counted) that answered the pushes of `versions` (their ACKs held by
/// the uplink, which drains nothing), then shut down while the control plane opens its window
/// `opens_after` into the shutdown (never, for `None`). Returns the control plane (what it
/// read is in its `msgs`), the stream's sending side (kept open by the caller, as the control
/// plane keeps its side) and how long the shutdown took.
async fn idle_shutdown_after(
    versions: std::ops::RangeInclusive<u64>,
    opens_after: Option<Duration>,
) -> (RawPlane, h2::SendStream<Bytes>, Duration) {
    let mut plane = RawPlane::start(Opening::default()).await;
    let agent = support::plane::agent(plane.addr, "a", None);
    let mut send = plane.stream().await;
    push(&agent, &mut send, versions).await;
    let took = shut_down_while(&agent, async {
        if let Some(after) = opens_after {
            tokio::time::sleep(after).await;
            plane.set_window(OPEN);
        }
    })
    .await;
    (plane, send, took)
}

/// The answers the control plane read, once the last is the ACK of `version`.
async fn answers_through(plane: &mut RawPlane, version: u64) -> Vec<(&'static str, u64)> {
    let got = received_until(&mut plane.msgs, |got| {
        answers(got).last() == Some(&("ack", version))
    })
    .await;
    answers(&got).into_iter().collect()
}

/// A full queue of ACKs and no call counted: the close has nothing of its own to send and the
/// queue is full. It waits for room within the close grace, as for a report, then gives the
/// half-close its grace: all 17 ACKs, v17's (the policies the agent runs) among them, reach the
/// control plane that reads 300 ms into the shutdown. (It once dropped the stream at once,
/// within 2 ms, and lost them all.)
#[tokio::test(flavor = "current_thread")]
async fn a_full_queue_of_answers_reaches_a_control_plane_that_reads_after_an_idle_shutdown() {
    let (mut plane, _send, took) =
        idle_shutdown_after(1..=FULL, Some(Duration::from_millis(300))).await;
    let got = answers_through(&mut plane, FULL).await;
    assert_eq!(
        got.last(),
        Some(&("ack", FULL)),
        "the ACKs queued before the shutdown (it took {took:?}): {got:?}"
    );
}

/// The deterministic form of `report_at_swap`'s shutdown right after a swap. On an uplink that
/// drains nothing, 5 calls on v1, then v2 pushed: the report of v1's counts and v2's ACK are
/// queued; the shutdown comes with nothing of the close's own to send and room on the stream,
/// and the uplink drains 300 ms into it. Both reach the control plane.
#[tokio::test(flavor = "current_thread")]
async fn the_report_and_answer_of_a_swap_reach_a_control_plane_that_reads_after_an_idle_shutdown() {
    let mut plane = RawPlane::start(Opening::default()).await;
    let agent = support::plane::agent(plane.addr, "a", None);
    let mut send = plane.stream().await;
    push(&agent, &mut send, 1..=1).await;
    support::plane::succeed(&agent, 5).await;
    push(&agent, &mut send, 2..=2).await;
    let took = shut_down_while(&agent, async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        plane.set_window(OPEN);
    })
    .await;
    let got = received_until(&mut plane.msgs, |got| {
        calls(got) == 5 && answers(got).last() == Some(&("ack", 2))
    })
    .await;
    assert_eq!(
        (calls(&got), answers(&got).last()),
        (5, Some(&("ack", 2))),
        "shutdown took {took:?}"
    );
}

/// A control plane that takes nothing, an idle agent whose queue has room (its one ACK went to
/// the HTTP/2 body): the close has nothing of its own to send, yet waits for the control plane
/// to close its side since the stream has room: shutdown is held one grace (2 s), within the
/// documented bound, not more.
#[tokio::test(flavor = "current_thread")]
async fn an_idle_shutdown_on_a_stuck_control_plane_is_held_one_grace_at_most() {
    let (_plane, _send, took) = idle_shutdown_after(1..=1, None).await;
    assert!(
        took >= Duration::from_millis(1_900) && took < Duration::from_millis(3_500),
        "{took:?}"
    );
}

/// A control plane that takes nothing, an idle agent whose queue is full of ACKs: the close has
/// nothing of its own, waits for room until the grace's end, finds none and drops the stream:
/// shutdown is held one grace (2 s), not two.
#[tokio::test(flavor = "current_thread")]
async fn an_idle_shutdown_on_a_full_queue_and_a_stuck_control_plane_is_held_one_grace() {
    let (_plane, _send, took) = idle_shutdown_after(1..=FULL, None).await;
    assert!(
        took >= Duration::from_millis(1_900) && took < Duration::from_millis(3_500),
        "{took:?}"
    );
}

/// Slow but reading: an idle agent whose queue is full of ACKs, a control plane that reads from
/// 1.5 s into the shutdown (late in the grace) and never closes its side: every ACK arrives, and
/// shutdown is held a grace from that room (3.5 s), under two graces (4 s).
#[tokio::test(flavor = "current_thread")]
async fn an_idle_shutdown_on_a_full_queue_read_late_in_the_grace_is_held_two_graces_at_most() {
    let (mut plane, _send, took) =
        idle_shutdown_after(1..=FULL, Some(Duration::from_millis(1_500))).await;
    let got = answers_through(&mut plane, FULL).await;
    assert_eq!(got.last(), Some(&("ack", FULL)), "took {took:?}");
    assert!(took < Duration::from_millis(4_000), "{took:?}");
}
