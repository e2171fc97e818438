//! The answers to snapshots that wait for room on the agent's stream (`stream::unsent`), against
//! a raw HTTP/2 control plane whose stream window for the agent's messages is 0 until the test
//! opens it (an uplink that drains nothing meanwhile).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::time::Duration;

use bytes::Bytes;
use prost::Message as _;
use retryplane_proto::pb::{self, ServerMessage, agent_message::Kind};
use support::script::snapshot;
use tokio::sync::mpsc;

/// The ACKs of the first pushes fill the agent's queue of 16 (its Hello went before the window
/// closed); the later ones wait for room, each superseding the one before; v21 is refused.
const N: u64 = 20;

/// `message` as one gRPC frame, as the control plane frames its own.
fn grpc_frame(message: &impl prost::Message) -> Bytes {
    retryplane_server::frame_body::encode_frame(message).unwrap()
}

/// How the control plane reads once the test opens its window.
#[derive(Clone, Copy)]
enum Reading {
    /// At once, with a window of 1 MiB.
    Fast,
    /// Slowly: a window of 16 bytes, each piece released 25 ms after it came (about 640 bytes
    /// a second).
    Slow,
}

/// A one-stream HTTP/2 control plane: the test gets the response's sending half, the agent's
/// messages (once the window opens), and a switch that opens the window.
async fn raw_plane() -> (
    std::net::SocketAddr,
    mpsc::UnboundedReceiver<h2::SendStream<Bytes>>,
    mpsc::UnboundedReceiver<pb::AgentMessage>,
    mpsc::UnboundedSender<()>,
) {
    plane_reading(Reading::Fast).await
}

/// [`raw_plane`], reading as `reading` says once opened.
async fn plane_reading(
    reading: Reading,
) -> (
    std::net::SocketAddr,
    mpsc::UnboundedReceiver<h2::SendStream<Bytes>>,
    mpsc::UnboundedReceiver<pb::AgentMessage>,
    mpsc::UnboundedSender<()>,
) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (send_tx, send_rx) = mpsc::unbounded_channel();
    let (msg_tx, msg_rx) = mpsc::unbounded_channel();
    let (open_tx, mut open_rx) = mpsc::unbounded_channel::<()>();
    tokio::spawn(async move {
        let (tcp, _) = listener.accept().await.unwrap();
        let mut conn = h2::server::Builder::new()
            .initial_window_size(0)
            .handshake::<_, Bytes>(tcp)
            .await
            .unwrap();
        loop {
            tokio::select! {
                accepted = conn.accept() => {
                    let Some(Ok((request, mut respond))) = accepted else { return };
                    let response = http::Response::builder()
                        .status(200)
                        .header("content-type", "application/grpc")
                        .header(retryplane_proto::liveness::HEARTBEAT_METADATA, "1")
                        .header(retryplane_proto::METRICS_INTERVAL_METADATA, "10000")
                        .body(())
                        .unwrap();
                    let send = respond.send_response(response, false).unwrap();
                    let _ = send_tx.send(send);
                    let mut body = request.into_body();
                    let msg_tx = msg_tx.clone();
                    tokio::spawn(async move {
                        let mut buf = Vec::new();
                        while let Some(Ok(data)) = body.data().await {
                            if let Reading::Slow = reading {
                                tokio::time::sleep(Duration::from_millis(25)).await;
                            }
                            let _ = body.flow_control().release_capacity(data.len());
                            buf.extend_from_slice(&data);
                            while buf.len() >= 5 {
                                let len = u32::from_be_bytes(buf[1..5].try_into().unwrap()) as usize;
                                if buf.len() < 5 + len {
                                    break;
                                }
                                let m = pb::AgentMessage::decode(&buf[5..5 + len]).unwrap();
                                buf.drain(..5 + len);
                                let _ = msg_tx.send(m);
                            }
                        }
                    });
                }
                Some(()) = open_rx.recv() => match reading {
                    Reading::Fast => {
                        conn.set_initial_window_size(1 << 20).unwrap();
                        conn.set_target_window_size(1 << 20);
                    }
                    Reading::Slow => conn.set_initial_window_size(16).unwrap(),
                },
            }
        }
    });
    (addr, send_rx, msg_rx, open_tx)
}

async fn until_version(agent: &retryplane_agent::Agent, v: u64) {
    tokio::time::timeout(Duration::from_secs(10), async {
        while agent.policies().version() != v {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("the agent runs v{v} in time"));
}

/// The agent runs v20, whose ACK waits for room (the ACKs of the first pushes fill its queue),
/// and refuses v21. Both answers reach the control plane once the uplink drains, the ACK first: a
/// late ACK of an earlier push is how the control plane learns what an agent that refuses the
/// last one runs. (The NACK once replaced the waiting ACK.)
#[tokio::test(flavor = "current_thread")]
async fn an_ack_waiting_for_room_is_not_lost_to_a_later_nack() {
    let (logs, _guard) = support::capture_logs("retryplane_agent=warn");
    let (addr, mut sends, mut msgs, open) = raw_plane().await;
    let agent = support::plane::agent(addr, "a", None);
    let mut send = tokio::time::timeout(Duration::from_secs(10), sends.recv())
        .await
        .unwrap()
        .unwrap();
    push_until_answers_wait(&agent, &mut send, Some(&logs)).await;
    assert_eq!(agent.policies().version(), N, "the agent runs vN");
    open.send(()).unwrap();
    let mut answers = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), async {
        while answers.last() != Some(&("nack", N + 1)) {
            match msgs.recv().await.expect("the stream goes on").kind {
                Some(Kind::Ack(a)) => answers.push(("ack", a.version)),
                Some(Kind::Nack(n)) => answers.push(("nack", n.version)),
                _ => {}
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("answers so far: {answers:?}"));
    assert!(
        answers.len() < 20,
        "some answers waited for room: {answers:?}"
    );
    assert_eq!(
        answers[answers.len() - 2..],
        [("ack", N), ("nack", N + 1)],
        "the ACK of the version the agent runs, then the NACK: {answers:?}"
    );
    agent.shutdown().await;
}

/// Pushes v1..=vN (the agent applies each: the ACKs of the later ones wait for room) and, when
/// `refused`, a v(N+1) with a wrong hash that the agent refuses; returns once it has.
async fn push_until_answers_wait(
    agent: &retryplane_agent::Agent,
    send: &mut h2::SendStream<Bytes>,
    refused: Option<&support::LogSink>,
) {
    for v in 1..=N {
        send.send_data(
            grpc_frame(&ServerMessage::with_snapshot(&snapshot(v, 4))),
            false,
        )
        .unwrap();
        until_version(agent, v).await;
    }
    if let Some(logs) = refused {
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
    }
}

/// Shutdown while answers wait for room on a control plane that stopped reading: it is held up
/// one close grace (2 s), as without them; the half-close's own grace is only for what found
/// room. (The answers' wait once came before a grace of the half-close's own: 4 s.)
#[tokio::test(flavor = "current_thread")]
async fn shutdown_with_answers_waiting_on_a_stuck_control_plane_takes_one_grace() {
    let (logs, _guard) = support::capture_logs("retryplane_agent=warn");
    let (addr, mut sends, _msgs, _open) = raw_plane().await;
    let agent = support::plane::agent(addr, "a", None);
    let mut send = tokio::time::timeout(Duration::from_secs(10), sends.recv())
        .await
        .unwrap()
        .unwrap();
    push_until_answers_wait(&agent, &mut send, Some(&logs)).await;
    let began = tokio::time::Instant::now();
    tokio::time::timeout(Duration::from_secs(10), agent.shutdown())
        .await
        .expect("shutdown ends");
    let took = began.elapsed();
    assert!(
        took >= Duration::from_millis(1_900) && took < Duration::from_millis(3_000),
        "one grace of 2 s, spent waiting for room: {took:?}"
    );
}

/// Shutdown while vN's ACK and v(N+1)'s NACK wait for room; the uplink drains 300 ms into the
/// shutdown: both reach the control plane, the ACK first, before the stream half-closes.
#[tokio::test(flavor = "current_thread")]
async fn answers_waiting_at_shutdown_go_when_the_uplink_drains() {
    let (logs, _guard) = support::capture_logs("retryplane_agent=warn");
    let (addr, mut sends, mut msgs, open) = raw_plane().await;
    let agent = support::plane::agent(addr, "a", None);
    let mut send = tokio::time::timeout(Duration::from_secs(10), sends.recv())
        .await
        .unwrap()
        .unwrap();
    push_until_answers_wait(&agent, &mut send, Some(&logs)).await;
    let opener = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        open.send(()).unwrap();
    };
    tokio::time::timeout(Duration::from_secs(10), async {
        tokio::join!(agent.shutdown(), opener)
    })
    .await
    .expect("shutdown ends");
    let mut answers = Vec::new();
    while let Ok(m) = msgs.try_recv() {
        match m.kind {
            Some(Kind::Ack(a)) => answers.push(("ack", a.version)),
            Some(Kind::Nack(n)) => answers.push(("nack", n.version)),
            _ => {}
        }
    }
    assert!(answers.len() >= 2, "{answers:?}");
    assert_eq!(
        answers[answers.len() - 2..],
        [("ack", N), ("nack", N + 1)],
        "{answers:?}"
    );
}

/// The messages the control plane gets until `done` holds of them (10 s at most).
async fn received_until(
    msgs: &mut mpsc::UnboundedReceiver<pb::AgentMessage>,
    done: impl Fn(&[Kind]) -> bool,
) -> Vec<Kind> {
    let mut got = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), async {
        while !done(&got) {
            match msgs.recv().await {
                Some(m) => got.extend(m.kind),
                None => return,
            }
        }
    })
    .await;
    got
}

/// The answers among `kinds`, as (kind, version).
fn answers(kinds: &[Kind]) -> Vec<(&'static str, u64)> {
    kinds
        .iter()
        .filter_map(|k| match k {
            Kind::Ack(a) => Some(("ack", a.version)),
            Kind::Nack(n) => Some(("nack", n.version)),
            _ => None,
        })
        .collect()
}

/// vN's ACK and v(N+1)'s NACK wait for room at shutdown; the control plane starts reading
/// 1.5 s into it, slowly (about 640 bytes a second; the 16 ACKs queued ahead take under a
/// second). Once they have found room, the half-close waits a grace of its own: both reach the
/// control plane. (With one grace for everything, they were cut off with 0.5 s left.)
#[tokio::test(flavor = "current_thread")]
async fn answers_that_find_room_late_in_the_grace_still_go_out_on_a_slow_uplink() {
    let (logs, _guard) = support::capture_logs("retryplane_agent=warn");
    let (addr, mut sends, mut msgs, open) = plane_reading(Reading::Slow).await;
    let agent = support::plane::agent(addr, "a", None);
    let mut send = tokio::time::timeout(Duration::from_secs(10), sends.recv())
        .await
        .unwrap()
        .unwrap();
    push_until_answers_wait(&agent, &mut send, Some(&logs)).await;
    let opener = async {
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        open.send(()).unwrap();
    };
    tokio::time::timeout(Duration::from_secs(10), async {
        tokio::join!(agent.shutdown(), opener)
    })
    .await
    .expect("shutdown ends");
    let got = received_until(&mut msgs, |got| {
        answers(got).last() == Some(&("nack", N + 1))
    })
    .await;
    let got = answers(&got);
    assert!(
        got.ends_with(&[("ack", N), ("nack", N + 1)]),
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
    let (addr, mut sends, mut msgs, open) = raw_plane().await;
    let agent = support::plane::agent(addr, "a", None);
    let mut send = tokio::time::timeout(Duration::from_secs(10), sends.recv())
        .await
        .unwrap()
        .unwrap();
    for v in 1..=17 {
        send.send_data(
            grpc_frame(&ServerMessage::with_snapshot(&snapshot(v, 4))),
            false,
        )
        .unwrap();
        until_version(&agent, v).await;
    }
    support::plane::succeed(&agent, 7).await;
    let opener = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        open.send(()).unwrap();
    };
    tokio::time::timeout(Duration::from_secs(10), async {
        tokio::join!(agent.shutdown(), opener)
    })
    .await
    .expect("shutdown ends");
    let calls = |got: &[Kind]| -> u64 {
        got.iter()
            .map(|k| match k {
                Kind::Metrics(r) => r.endpoints.iter().map(|e| e.calls).sum(),
                _ => 0,
            })
            .sum()
    };
    let got = received_until(&mut msgs, |got| calls(got) >= 7).await;
    assert_eq!(
        answers(&got).last(),
        Some(&("ack", 17)),
        "every ACK arrived"
    );
    assert_eq!(calls(&got), 7, "the counts of the last report");
}
