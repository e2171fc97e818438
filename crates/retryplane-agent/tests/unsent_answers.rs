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
