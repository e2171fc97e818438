//! The last metrics report at shutdown, when its counts are too large for one report (over
//! 1 MiB: it goes out in several parts) and the stream's queue frees one slot at a time (the
//! messages ahead are each over tonic's 32 KiB yield threshold, so the HTTP/2 body takes one
//! per poll), against a raw HTTP/2 control plane that opens its window when the test says.
//! Every part waits for room within the close grace (room was once awaited for one message
//! only: the second part went back into the counters, with no later stream to take it), and
//! what found room gets the half-close's own grace, even when a later part found none.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use prost::Message as _;
use retryplane_agent::CallMeta;
use retryplane_proto::pb::{self, ServerMessage, agent_message::Kind};
use support::script::snapshot;
use tokio::sync::mpsc;

fn grpc_frame(message: &impl prost::Message) -> Bytes {
    retryplane_server::frame_body::encode_frame(message).unwrap()
}

/// A one-stream control plane: stream window 0 until `window` says; it releases nothing it
/// read until `release` is set (so the window it gives is all the agent may send meanwhile).
async fn plane(
    numbered: bool,
) -> (
    std::net::SocketAddr,
    mpsc::UnboundedReceiver<h2::SendStream<Bytes>>,
    mpsc::UnboundedReceiver<pb::AgentMessage>,
    mpsc::UnboundedSender<u32>,
    Arc<AtomicBool>,
) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (send_tx, send_rx) = mpsc::unbounded_channel();
    let (msg_tx, msg_rx) = mpsc::unbounded_channel();
    let (win_tx, mut win_rx) = mpsc::unbounded_channel::<u32>();
    let release = Arc::new(AtomicBool::new(false));
    let rel = release.clone();
    tokio::spawn(async move {
        let (tcp, _) = listener.accept().await.unwrap();
        let mut conn = h2::server::Builder::new()
            .initial_window_size(0)
            .initial_connection_window_size(16 << 20)
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
                        .header(retryplane_proto::METRICS_INTERVAL_METADATA, "300")
                        .header(retryplane_proto::METRICS_ACK_METADATA, if numbered { "1" } else { "0" })
                        .body(())
                        .unwrap();
                    let send = respond.send_response(response, false).unwrap();
                    let _ = send_tx.send(send);
                    let mut body = request.into_body();
                    let msg_tx = msg_tx.clone();
                    let rel = rel.clone();
                    tokio::spawn(async move {
                        let mut buf = Vec::new();
                        let mut held = 0usize;
                        while let Some(Ok(data)) = body.data().await {
                            held += data.len();
                            if rel.load(Ordering::SeqCst) {
                                let _ = body.flow_control().release_capacity(held);
                                held = 0;
                            }
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
                Some(w) = win_rx.recv() => conn.set_initial_window_size(w).unwrap(),
            }
        }
    });
    (addr, send_rx, msg_rx, win_tx, release)
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

/// One successful call on each of `names`.
async fn call_each(agent: &retryplane_agent::Agent, names: impl Iterator<Item = String>) {
    for name in names {
        agent
            .endpoint(&name)
            .call(
                CallMeta::http("GET", "/"),
                support::Upstream::new([]).attempt(),
            )
            .await
            .unwrap();
    }
}

fn name(group: char, i: usize) -> String {
    format!("{group}-{i:0>110}")
}

/// Before shutdown: two periodic reports of 400 calls and 15 ACKs queued, then 12,000
/// endpoints counted (the last report: 2 parts). 300 ms into the shutdown one slot frees (part 1
/// finds room); the next only after the close grace (part 2 does not, and goes back into the
/// counters). What found room gets the half-close's own grace: it all reaches the control plane.
async fn what_found_room_is_not_cut_off(numbered: bool) {
    let (addr, mut sends, mut msgs, window, release) = plane(numbered).await;
    let agent = support::plane::agent(addr, "a", None);
    let mut send = tokio::time::timeout(Duration::from_secs(10), sends.recv())
        .await
        .unwrap()
        .unwrap();
    call_each(&agent, (0..400).map(|i| name('a', i))).await;
    tokio::time::sleep(Duration::from_millis(700)).await;
    call_each(&agent, (0..400).map(|i| name('b', i))).await;
    tokio::time::sleep(Duration::from_millis(700)).await;
    for v in 1..=15 {
        send.send_data(
            grpc_frame(&ServerMessage::with_snapshot(&snapshot(v, 4))),
            false,
        )
        .unwrap();
        until_version(&agent, v).await;
    }
    call_each(&agent, (0..12_000).map(|i| name('c', i))).await;
    let started = tokio::time::Instant::now();
    let opener = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        window.send(70_000).unwrap();
        // Past the close grace (2 s) of the first phase, well within the half-close's own.
        tokio::time::sleep_until(started + Duration::from_millis(2_300)).await;
        release.store(true, Ordering::SeqCst);
        window.send(64 << 20).unwrap();
    };
    tokio::time::timeout(Duration::from_secs(10), async {
        tokio::join!(agent.shutdown(), opener)
    })
    .await
    .expect("shutdown ends");
    let took = started.elapsed();
    let mut by_group = std::collections::BTreeMap::<char, u64>::new();
    let mut last_ack = 0;
    let mut seqs = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        while let Some(m) = msgs.recv().await {
            match m.kind {
                Some(Kind::Metrics(r)) => {
                    seqs.push(r.seq);
                    for e in &r.endpoints {
                        *by_group
                            .entry(e.endpoint.chars().next().unwrap())
                            .or_default() += e.calls;
                    }
                }
                Some(Kind::Ack(a)) => last_ack = a.version,
                _ => {}
            }
        }
    })
    .await;
    let summary = format!(
        "calls by group {by_group:?}, report seqs {seqs:?}, last ACK v{last_ack}; shutdown took {took:?}"
    );
    assert_eq!(
        by_group.get(&'b'),
        Some(&400),
        "the report queued before shutdown: {summary}"
    );
    assert_eq!(last_ack, 15, "the ACKs queued before shutdown: {summary}");
    assert!(
        by_group.get(&'c').copied().unwrap_or(0) > 0,
        "part 1 of the last report, queued within the grace: {summary}"
    );
}

/// Unnumbered stream (a control plane that does not acknowledge reports).
#[tokio::test(flavor = "current_thread")]
async fn a_last_report_part_that_found_room_is_not_cut_off_unnumbered() {
    what_found_room_is_not_cut_off(false).await;
}

/// Numbered stream (reports kept until acknowledged).
#[tokio::test(flavor = "current_thread")]
async fn a_last_report_part_that_found_room_is_not_cut_off_numbered() {
    what_found_room_is_not_cut_off(true).await;
}

/// The last report's counts are all taken at once, as shutdown begins, under v15; its parts are
/// filled in one at a time, each as it finds room. Policies set meanwhile (`Agent::set_policies`,
/// version 0) do not label the second part: its counts were made under v15. (They once did.)
#[tokio::test(flavor = "current_thread")]
async fn every_part_of_the_last_report_carries_the_version_its_counts_were_made_under() {
    let (addr, mut sends, mut msgs, window, release) = plane(true).await;
    let agent = support::plane::agent(addr, "a", None);
    let mut send = tokio::time::timeout(Duration::from_secs(10), sends.recv())
        .await
        .unwrap()
        .unwrap();
    call_each(&agent, (0..400).map(|i| name('a', i))).await;
    tokio::time::sleep(Duration::from_millis(700)).await;
    call_each(&agent, (0..400).map(|i| name('b', i))).await;
    tokio::time::sleep(Duration::from_millis(700)).await;
    for v in 1..=15 {
        send.send_data(
            grpc_frame(&ServerMessage::with_snapshot(&snapshot(v, 4))),
            false,
        )
        .unwrap();
        until_version(&agent, v).await;
    }
    call_each(&agent, (0..12_000).map(|i| name('c', i))).await;
    let opener = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        window.send(70_000).unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        // Part 1 is queued, part 2 waits for room.
        let set = retryplane_policy::load(b"version: 1\nendpoints:\n  z: {}\n")
            .policies
            .unwrap();
        agent.set_policies(set);
        tokio::time::sleep(Duration::from_millis(300)).await;
        release.store(true, Ordering::SeqCst);
        window.send(64 << 20).unwrap();
    };
    tokio::time::timeout(Duration::from_secs(10), async {
        tokio::join!(agent.shutdown(), opener)
    })
    .await
    .expect("shutdown ends");
    let mut last = Vec::new();
    let mut calls = 0u64;
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        while let Some(m) = msgs.recv().await {
            if let Some(Kind::Metrics(r)) = m.kind {
                calls += r.endpoints.iter().map(|e| e.calls).sum::<u64>();
                if r.endpoints.iter().any(|e| e.endpoint.starts_with('c')) {
                    last.push((r.seq, r.policy_version));
                }
                if calls >= 12_800 {
                    return;
                }
            }
        }
    })
    .await;
    assert_eq!(calls, 12_800, "every call arrives (parts {last:?})");
    assert!(last.len() >= 2, "in parts: {last:?}");
    assert!(
        last.iter().all(|&(_, v)| v == 15),
        "(seq, policy_version) of the last report's parts: {last:?}"
    );
}

/// A control plane that takes nothing: the last report in two parts, the queue full
/// of ACKs: shutdown is held up one grace (2 s), not more.
#[tokio::test(flavor = "current_thread")]
async fn a_stuck_control_plane_holds_a_split_last_report_one_grace() {
    let (addr, mut sends, _msgs, _window, _release) = plane(true).await;
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
    call_each(&agent, (0..12_000).map(|i| name('c', i))).await;
    let started = tokio::time::Instant::now();
    tokio::time::timeout(Duration::from_secs(10), agent.shutdown())
        .await
        .expect("shutdown ends");
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(1_900) && took < Duration::from_millis(2_500),
        "{took:?}"
    );
}

/// Slow but reading: one slot at 300 ms, everything read from 1.9 s into the shutdown
/// (part 2 finds room late in the grace); the plane never closes its side. Every call arrives,
/// and shutdown is held up two graces at most (4 s).
#[tokio::test(flavor = "current_thread")]
async fn a_split_last_report_that_finds_room_late_holds_shutdown_two_graces_at_most() {
    let (addr, mut sends, mut msgs, window, release) = plane(true).await;
    let agent = support::plane::agent(addr, "a", None);
    let mut send = tokio::time::timeout(Duration::from_secs(10), sends.recv())
        .await
        .unwrap()
        .unwrap();
    call_each(&agent, (0..400).map(|i| name('a', i))).await;
    tokio::time::sleep(Duration::from_millis(700)).await;
    call_each(&agent, (0..400).map(|i| name('b', i))).await;
    tokio::time::sleep(Duration::from_millis(700)).await;
    for v in 1..=15 {
        send.send_data(
            grpc_frame(&ServerMessage::with_snapshot(&snapshot(v, 4))),
            false,
        )
        .unwrap();
        until_version(&agent, v).await;
    }
    call_each(&agent, (0..12_000).map(|i| name('c', i))).await;
    let started = tokio::time::Instant::now();
    let opener = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        window.send(70_000).unwrap();
        tokio::time::sleep_until(started + Duration::from_millis(1_900)).await;
        release.store(true, Ordering::SeqCst);
        window.send(64 << 20).unwrap();
    };
    let shutdown = async {
        agent.shutdown().await;
        started.elapsed()
    };
    let (took, ()) = tokio::time::timeout(Duration::from_secs(10), async {
        tokio::join!(shutdown, opener)
    })
    .await
    .expect("shutdown ends");
    let mut calls = 0u64;
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        while let Some(m) = msgs.recv().await {
            if let Some(Kind::Metrics(r)) = m.kind {
                calls += r.endpoints.iter().map(|e| e.calls).sum::<u64>();
                if calls >= 12_800 {
                    return;
                }
            }
        }
    })
    .await;
    assert_eq!(calls, 12_800);
    assert!(took < Duration::from_millis(4_100), "{took:?}");
}

/// Two periodic reports of 400 endpoints each (over 32 KiB) are queued ahead (one held by
/// HTTP/2, one at the head of the queue), 15 ACKs fill the rest; 12,000 endpoints are then
/// counted (the last report: 2 parts). At shutdown the control plane opens a window for
/// about 1.5 of those reports (one slot frees), then, 500 ms later, reads everything. Every
/// call must reach it: 12,800.
#[tokio::test(flavor = "current_thread")]
async fn a_last_report_in_two_parts_is_not_cut_in_half_at_shutdown() {
    let (addr, mut sends, mut msgs, window, release) = plane(false).await;
    let agent = support::plane::agent(addr, "a", None);
    let mut send = tokio::time::timeout(Duration::from_secs(10), sends.recv())
        .await
        .unwrap()
        .unwrap();
    call_each(&agent, (0..400).map(|i| name('a', i))).await;
    tokio::time::sleep(Duration::from_millis(700)).await;
    call_each(&agent, (0..400).map(|i| name('b', i))).await;
    tokio::time::sleep(Duration::from_millis(700)).await;
    for v in 1..=15 {
        send.send_data(
            grpc_frame(&ServerMessage::with_snapshot(&snapshot(v, 4))),
            false,
        )
        .unwrap();
        until_version(&agent, v).await;
    }
    call_each(&agent, (0..12_000).map(|i| name('c', i))).await;
    let opener = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        window.send(70_000).unwrap();
        tokio::time::sleep(Duration::from_millis(500)).await;
        release.store(true, Ordering::SeqCst);
        window.send(64 << 20).unwrap();
    };
    let started = tokio::time::Instant::now();
    tokio::time::timeout(Duration::from_secs(10), async {
        tokio::join!(agent.shutdown(), opener)
    })
    .await
    .expect("shutdown ends");
    let took = started.elapsed();
    let mut calls = 0u64;
    let mut reports = 0;
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        while let Some(m) = msgs.recv().await {
            if let Some(Kind::Metrics(r)) = m.kind {
                reports += 1;
                calls += r.endpoints.iter().map(|e| e.calls).sum::<u64>();
                if calls >= 12_800 {
                    return;
                }
            }
        }
    })
    .await;
    assert_eq!(
        calls, 12_800,
        "calls the control plane got ({reports} reports; shutdown took {took:?})"
    );
}
