//! The agent against a control plane that misbehaves: refusals of every kind and garbage at
//! the stream's opening, a snapshot past the message limit, a control plane that takes a long
//! time to acknowledge reports, and what the agent's log says meanwhile. Against the scripted
//! control plane (`support::script`) and a bare HTTP/2 peer.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use prost::Message as _;
use retryplane_agent::{Agent, ReconnectBackoff, Source};
use retryplane_proto::pb;
use retryplane_proto::pb::agent_message::Kind;
use support::plane::{attempts_of, succeed};
use support::script::{Event, Script, send, snapshot};
use tokio::time::Instant;

/// The cache file of the agent's format holding `snap`.
fn write_cache(path: &Path, snap: &pb::Snapshot) {
    let mut bytes = b"retryplane agent policy cache 1\n".to_vec();
    bytes.extend_from_slice(&snap.encode_to_vec());
    std::fs::write(path, bytes).unwrap();
}

/// How a bare HTTP/2 peer answers every stream.
#[derive(Clone, Copy, Debug)]
enum Answer {
    /// Trailers-only, with this gRPC status.
    Status(u32),
    /// A gRPC head, then bytes that are no gRPC message, then the end of the stream.
    Garbage,
    /// A gRPC head, then a frame holding bytes that do not decode as a `ServerMessage`.
    Undecodable,
    /// The stream reset at once.
    Reset,
    /// A gRPC head and, at once, trailers saying OK: a stream that ends as it opens.
    EndsAtOnce,
    /// A gRPC head, then after this long trailers with this gRPC status: a stream that was up.
    EndsAfter(Duration, u32),
}

/// A peer on 127.0.0.1:0 that answers every stream as `answer` says; each stream's arrival
/// time goes to the returned receiver.
async fn peer(answer: Answer) -> (SocketAddr, tokio::sync::mpsc::UnboundedReceiver<Instant>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            let tx = tx.clone();
            tokio::spawn(async move {
                let Ok(mut conn) = h2::server::handshake(socket).await else {
                    return;
                };
                while let Some(Ok((_request, mut respond))) = conn.accept().await {
                    let _ = tx.send(Instant::now());
                    let grpc =
                        || http::Response::builder().header("content-type", "application/grpc");
                    match answer {
                        Answer::Status(code) => {
                            let r = grpc()
                                .header("grpc-status", code.to_string())
                                .header("grpc-message", "refused by the test")
                                .body(())
                                .unwrap();
                            let _ = respond.send_response(r, true);
                        }
                        Answer::Garbage => {
                            let r = grpc().body(()).unwrap();
                            if let Ok(mut s) = respond.send_response(r, false) {
                                let _ = s.send_data(Bytes::from_static(b"\x07garbage!"), true);
                            }
                        }
                        Answer::Undecodable => {
                            let r = grpc().body(()).unwrap();
                            if let Ok(mut s) = respond.send_response(r, false) {
                                // A frame of 2 bytes: field 1 with an unknown wire type.
                                let _ = s.send_data(
                                    Bytes::from_static(b"\x00\x00\x00\x00\x02\x0f\xff"),
                                    false,
                                );
                            }
                        }
                        Answer::Reset => respond.send_reset(h2::Reason::INTERNAL_ERROR),
                        Answer::EndsAtOnce => {
                            let r = grpc().body(()).unwrap();
                            if let Ok(mut s) = respond.send_response(r, false) {
                                let mut trailers = http::HeaderMap::new();
                                trailers.insert("grpc-status", "0".parse().unwrap());
                                let _ = s.send_trailers(trailers);
                            }
                        }
                        Answer::EndsAfter(up, code) => {
                            let r = grpc().body(()).unwrap();
                            if let Ok(mut s) = respond.send_response(r, false) {
                                // Ended from a task of its own: the connection is driven by
                                // `accept` meanwhile.
                                tokio::spawn(async move {
                                    tokio::time::sleep(up).await;
                                    let mut trailers = http::HeaderMap::new();
                                    trailers
                                        .insert("grpc-status", code.to_string().parse().unwrap());
                                    let _ = s.send_trailers(trailers);
                                });
                            }
                        }
                    }
                }
            });
        }
    });
    (addr, rx)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kind_of_refusal_or_garbage_is_tried_again_with_bounded_backoff_on_the_cached_policy()
{
    let dir = tempfile::tempdir().unwrap();
    let answers = [
        Answer::Status(14), // UNAVAILABLE
        Answer::Status(16), // UNAUTHENTICATED
        Answer::Status(7),  // PERMISSION_DENIED
        Answer::Status(8),  // RESOURCE_EXHAUSTED
        Answer::Status(2),  // UNKNOWN
        Answer::Garbage,
        Answer::Undecodable,
        Answer::Reset,
        Answer::EndsAtOnce,
    ];
    let watch = Duration::from_millis(2500);
    let mut runs = Vec::new();
    for (i, answer) in answers.into_iter().enumerate() {
        let cache = dir.path().join(format!("agent-{i}.cache"));
        let v1 = snapshot(1, 4);
        write_cache(&cache, &v1);
        let before = std::fs::read(&cache).unwrap();
        runs.push(tokio::spawn(async move {
            let (addr, mut streams) = peer(answer).await;
            let agent = support::plane::builder(addr, &format!("a{i}"))
                .token("a-token-never-logged-0123")
                .cache_file(&cache)
                .reconnect_backoff(ReconnectBackoff::new(
                    Duration::from_millis(100),
                    Duration::from_millis(400),
                    Duration::from_secs(10),
                ))
                .connect()
                .unwrap();
            let p = agent.policies();
            assert_eq!((p.source(), p.version()), (Source::Cache, 1), "{answer:?}");
            let first = tokio::time::timeout(Duration::from_secs(10), streams.recv())
                .await
                .expect("a first stream")
                .unwrap();
            let mut count = 1;
            while let Ok(Some(_)) = tokio::time::timeout_at(first + watch, streams.recv()).await {
                count += 1;
                // The last good policy applies all along.
                assert_eq!(attempts_of(&agent).await, 4, "{answer:?}");
            }
            agent.shutdown().await;
            let p = agent.policies();
            assert_eq!((p.source(), p.version()), (Source::Cache, 1), "{answer:?}");
            assert_eq!(
                std::fs::read(&cache).unwrap(),
                before,
                "{answer:?}: cache untouched"
            );
            (answer, count)
        }));
    }
    for run in runs {
        let (answer, count) = run.await.unwrap();
        // Delays of [50, 100], [100, 200], then [200, 400] ms: at most about 14 streams in
        // 2.5 s; a spin would make hundreds. And it does try again.
        assert!(
            (3..=16).contains(&count),
            "{answer:?}: {count} streams in {watch:?}"
        );
    }
}

/// A control plane that ends every stream with `RESOURCE_EXHAUSTED` (one of its limits, no
/// room for a report) after it was up longer than `stable_after` is not a stable connection:
/// the backoff goes on doubling instead of starting again from the spread after each stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_ended_for_the_control_planes_load_back_off_however_long_they_were_up() {
    let (addr, mut streams) = peer(Answer::EndsAfter(Duration::from_millis(300), 8)).await;
    let agent = support::plane::builder(addr, "a")
        .reconnect_backoff(ReconnectBackoff::new(
            Duration::from_millis(100),
            Duration::from_secs(10),
            Duration::from_millis(100),
        ))
        .connect()
        .unwrap();
    let mut opened = Vec::new();
    while opened.len() < 7 {
        let at = tokio::time::timeout(Duration::from_secs(10), streams.recv())
            .await
            .expect("the agent comes back")
            .unwrap();
        opened.push(at);
    }
    agent.shutdown().await;
    let gaps: Vec<Duration> = opened.windows(2).map(|w| w[1] - w[0]).collect();
    // Each delay is spread from half the ceiling to a second, or to the ceiling once that is
    // longer: the ceiling doubles from 100 ms, so the sixth is [1.6, 3.2] s, its gap 1.9 s or
    // more. Streams taken as stable would reset it: gaps of at most 1.3 s.
    assert!(gaps[5] >= Duration::from_millis(1_700), "{gaps:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_past_the_message_limit_leaves_the_last_good_policy_and_cache_in_force() {
    use retryplane_proto::convert;
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("agent.cache");
    let mut script = Script::start().await;
    let agent = support::plane::agent(script.addr, "a", Some(&cache));
    let (to_agent, _) = script.reconnected().await;
    let v1 = snapshot(1, 4);
    send(&to_agent, &v1).await;
    assert!(matches!(script.reply().await, Kind::Ack(a) if a.version == 1));
    let cached = std::fs::read(&cache).unwrap();

    // v2: endpoints up to just past the limit.
    let mut doc = snapshot(2, 2).policies.unwrap();
    let template = doc.endpoints[0].clone();
    let mut i = 0;
    let mut big = pb::Snapshot {
        version: 2,
        nonce: "nonce-2".into(),
        metrics_interval_ms: 60_000,
        ..Default::default()
    };
    while pb::ServerMessage::with_snapshot(&big).encoded_len()
        <= retryplane_proto::MAX_MESSAGE_BYTES
    {
        for _ in 0..1000 {
            let mut e = template.clone();
            e.name = format!("{i:0>120}");
            doc.endpoints.push(e);
            i += 1;
        }
        big.content_hash = convert::content_hash(&doc);
        big.policies = Some(doc.clone());
    }
    send(&to_agent, &big).await;
    // Whatever it answers (the stream ends, or a NACK), v1 stays in force.
    let mut said = Vec::new();
    let hello = 'next: loop {
        match script.next().await {
            Event::Opened(next) => {
                // The next stream: its Hello says v1 (the old stream's end may come first).
                loop {
                    match script.next().await {
                        Event::Message(Kind::Hello(h)) => break 'next (h, next),
                        Event::Ended => said.push("Ended".into()),
                        other => panic!("expected a Hello, got {other:?}"),
                    }
                }
            }
            Event::Message(Kind::Metrics(_)) => {}
            other => said.push(format!("{other:?}")),
        }
    };
    let (hello, to_agent2) = hello;
    drop(to_agent);
    // The agent cannot read the snapshot at all (tonic refuses it by its length): the stream
    // ends, with no answer; nothing else.
    assert!(said.iter().all(|s| s == "Ended"), "{said:?}");
    assert_eq!(hello.last_applied_version, 1);
    let p = agent.policies();
    assert_eq!((p.source(), p.version()), (Source::ControlPlane, 1));
    assert_eq!(attempts_of(&agent).await, 4);
    assert_eq!(
        std::fs::read(&cache).unwrap(),
        cached,
        "the cache still holds v1"
    );
    script.shut_down(agent, to_agent2).await;
}

/// The calls of endpoint `ep` in `report`.
fn ep_calls(report: &pb::MetricsReport) -> u64 {
    report
        .endpoints
        .iter()
        .filter(|e| e.endpoint == "ep")
        .map(|e| e.calls)
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reports_a_control_plane_leaves_unacknowledged_are_bounded_and_count_once_when_it_acks() {
    let mut script = Script::start().await;
    script.announce_acks(true);
    let agent = support::plane::builder(script.addr, "a")
        .metrics_interval(Duration::from_millis(100))
        .connect()
        .unwrap();
    let (to_agent, _) = script.reconnected().await;
    let made = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let busy = agent.clone();
    let (counted, stopped) = (made.clone(), stop.clone());
    // Stopped between two calls (not aborted in one), so that every call it counted ended.
    let calls = tokio::spawn(async move {
        while !stopped.load(Ordering::SeqCst) {
            succeed(&busy, 1).await;
            counted.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(3)).await;
        }
    });
    // Every report seen, by seq: a seq seen again must carry the same counts.
    let mut by_seq: BTreeMap<u64, pb::MetricsReport> = BTreeMap::new();
    let note = |r: pb::MetricsReport, by_seq: &mut BTreeMap<u64, pb::MetricsReport>| {
        assert!(r.seq > 0, "numbered");
        if let Some(before) = by_seq.get(&r.seq) {
            assert_eq!(
                before.endpoints, r.endpoints,
                "seq {} resent with other counts",
                r.seq
            );
        }
        by_seq.insert(r.seq, r);
    };
    // 1.5 s (15 intervals) without an ack: at most the window's 8 reports go out.
    let until = Instant::now() + Duration::from_millis(1500);
    loop {
        tokio::select! {
            e = script.next() => match e {
                Event::Message(Kind::Metrics(r)) => note(r, &mut by_seq),
                other => panic!("expected metrics, got {other:?}"),
            },
            () = tokio::time::sleep_until(until) => break,
        }
    }
    let unacked: Vec<u64> = by_seq.keys().copied().collect();
    assert!(
        !unacked.is_empty() && unacked.len() <= 8,
        "reports waiting for an ack: {unacked:?}"
    );
    // The stream is lost: the next one carries them again, same seqs, same counts.
    drop(to_agent);
    let to_agent = loop {
        match script.next().await {
            Event::Opened(tx) => break tx,
            Event::Ended => {}
            Event::Message(Kind::Metrics(r)) => note(r, &mut by_seq),
            other => panic!("expected a new stream, got {other:?}"),
        }
    };
    let mut resent = Vec::new();
    while resent.len() < unacked.len() {
        match script.next().await {
            Event::Message(Kind::Hello(_)) | Event::Ended => {}
            Event::Message(Kind::Metrics(r)) => {
                resent.push(r.seq);
                note(r, &mut by_seq);
            }
            other => panic!("expected the resent reports, got {other:?}"),
        }
    }
    assert_eq!(
        resent, unacked,
        "resent in seq order, before any new report"
    );
    // Now every report is acknowledged as it comes, those waiting first.
    for seq in by_seq.keys() {
        to_agent
            .send(Ok(pb::ServerMessage::with_metrics_ack(pb::MetricsAck {
                seq: *seq,
                dropped: false,
            })))
            .await
            .unwrap();
    }
    let until = Instant::now() + Duration::from_millis(1000);
    loop {
        tokio::select! {
            e = script.next() => match e {
                Event::Message(Kind::Metrics(r)) => {
                    let seq = r.seq;
                    note(r, &mut by_seq);
                    to_agent
                        .send(Ok(pb::ServerMessage::with_metrics_ack(pb::MetricsAck { seq, dropped: false })))
                        .await
                        .unwrap();
                }
                other => panic!("expected metrics, got {other:?}"),
            },
            () = tokio::time::sleep_until(until) => break,
        }
    }
    stop.store(true, Ordering::SeqCst);
    calls.await.unwrap();
    let total = made.load(Ordering::SeqCst);
    // The last report goes at shutdown.
    let drain = async {
        loop {
            match script.next().await {
                Event::Message(Kind::Metrics(r)) => note(r, &mut by_seq),
                Event::Ended => break,
                other => panic!("expected metrics, got {other:?}"),
            }
        }
        drop(to_agent);
    };
    tokio::join!(agent.shutdown(), drain);
    let reported: u64 = by_seq.values().map(ep_calls).sum();
    assert_eq!(
        reported,
        total,
        "every call counted once over {} seqs",
        by_seq.len()
    );
    script.stop().await;
}

#[tokio::test(flavor = "current_thread")]
async fn no_log_line_at_any_level_holds_the_token() {
    const SECRET: &str = "agent-secret-must-not-show-4711";
    let (sink, _guard) = support::capture_logs("trace");
    // Refused, with garbage, reset: every path that logs a reason.
    for answer in [Answer::Status(16), Answer::Garbage, Answer::Reset] {
        let (addr, mut streams) = peer(answer).await;
        let agent = support::plane::builder(addr, "a")
            .token(SECRET)
            .connect()
            .unwrap();
        for _ in 0..2 {
            tokio::time::timeout(Duration::from_secs(10), streams.recv())
                .await
                .unwrap()
                .unwrap();
        }
        agent.shutdown().await;
    }
    // A scripted session: a snapshot, a NACK, reports.
    let mut script = Script::start().await;
    let agent: Agent = support::plane::builder(script.addr, "a")
        .token(SECRET)
        .metrics_interval(Duration::from_millis(100))
        .connect()
        .unwrap();
    let (to_agent, _) = script.reconnected().await;
    send(&to_agent, &snapshot(1, 3)).await;
    assert!(matches!(script.reply().await, Kind::Ack(_)));
    let mut bad = snapshot(2, 3);
    bad.content_hash = "0".repeat(64);
    send(&to_agent, &bad).await;
    assert!(matches!(script.reply().await, Kind::Nack(_)));
    succeed(&agent, 3).await;
    drop(to_agent);
    let (to_agent, _) = script.reconnected().await;
    script.shut_down(agent, to_agent).await;
    let text = sink.text();
    assert!(!text.is_empty());
    assert!(!text.contains(SECRET), "the token is in the log");
    // Nor in any encoding of it that a header dump would show.
    let b64 = "YWdlbnQtc2VjcmV0"; // base64 of "agent-secret"
    assert!(!text.contains(b64));
}

#[tokio::test(start_paused = true)]
async fn a_peer_that_takes_the_connection_and_never_speaks_http2_is_left_and_tried_again() {
    // Accepts every connection and holds it: never reads, never writes a byte.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicU64::new(0));
    let counted = accepted.clone();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            counted.fetch_add(1, Ordering::SeqCst);
            held.push(socket);
        }
    });
    let agent = support::plane::builder(addr, "a").connect().unwrap();
    let started = Instant::now();
    while accepted.load(Ordering::SeqCst) < 3 {
        assert!(
            started.elapsed() < Duration::from_secs(600),
            "the agent stays on a connection that never speaks: {} connection(s)",
            accepted.load(Ordering::SeqCst)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Each is given up at the opening's time limit (30 s), or the ping's.
    assert!(
        started.elapsed() >= Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
    agent.shutdown().await;
}
