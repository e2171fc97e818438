//! The control-plane side of the agent at its edges: a metrics interval or keepalive out of
//! range, a version lower than the one applied, the same version with other content, a
//! snapshot that drops a handle's endpoint or is just under the message limit, shutdown from
//! two clones, reconnect delays. Against the scripted control plane (`support::script`), a peer
//! that never answers a stream's opening, and one that refuses every stream.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::time::Duration;

use prost::Message as _;
use retryplane_agent::Source;
use retryplane_proto::pb::agent_message::Kind;
use support::plane::{attempts_of, succeed};
use support::script::{Event, Script, send, snapshot};
use tokio::time::Instant;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_metrics_interval_from_the_control_plane_does_not_stop_the_agent() {
    let mut script = Script::start().await;
    let agent = support::plane::agent(script.addr, "a", None);
    let (to_agent, _) = script.reconnected().await;
    let mut v1 = snapshot(1, 4);
    v1.metrics_interval_ms = u64::MAX;
    send(&to_agent, &v1).await;
    match script.reply().await {
        Kind::Ack(ack) => assert_eq!(ack.version, 1),
        other => panic!("expected Ack v1, got {other:?}"),
    }
    // The stream is lost: the agent reconnects and says which version it runs.
    drop(to_agent);
    let (to_agent, hello) = script.reconnected().await;
    assert_eq!(hello.last_applied_version, 1);
    send(&to_agent, &snapshot(2, 3)).await;
    match script.reply().await {
        Kind::Ack(ack) => assert_eq!(ack.version, 2),
        other => panic!("expected Ack v2, got {other:?}"),
    }
    assert_eq!(attempts_of(&agent).await, 3);
    script.shut_down(agent, to_agent).await;
}

/// Reports that reach `script` in `watch` while `agent` makes calls all the time (so every
/// interval has counts to report).
async fn reports_in(
    script: &mut Script,
    agent: &retryplane_agent::Agent,
    watch: Duration,
) -> usize {
    let busy = agent.clone();
    let calls = tokio::spawn(async move {
        loop {
            succeed(&busy, 1).await;
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    });
    let mut reports = 0;
    let until = Instant::now() + watch;
    while Instant::now() < until {
        tokio::select! {
            e = script.next() => match e {
                Event::Message(Kind::Metrics(_)) => reports += 1,
                other => panic!("expected metrics, got {other:?}"),
            },
            () = tokio::time::sleep_until(until) => {}
        }
    }
    calls.abort();
    let _ = calls.await;
    reports
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zero_or_tiny_metrics_interval_is_raised_to_the_shortest_the_control_plane_allows() {
    let watch = Duration::from_millis(600);
    // The agent's own interval, zero; then the control plane's, 1 ms.
    let mut script = Script::start().await;
    let agent = support::plane::builder(script.addr, "a")
        .metrics_interval(Duration::ZERO)
        .connect()
        .unwrap();
    let (to_agent, _) = script.reconnected().await;
    let reports = reports_in(&mut script, &agent, watch).await;
    // One report per 100 ms at most (and one more for the phase).
    assert!(
        reports <= 7,
        "{reports} reports in {watch:?} on the agent's own zero"
    );
    let mut v1 = snapshot(1, 1);
    v1.metrics_interval_ms = 1;
    send(&to_agent, &v1).await;
    loop {
        match script.next().await {
            Event::Message(Kind::Ack(ack)) => break assert_eq!(ack.version, 1),
            Event::Message(Kind::Metrics(_)) => {}
            other => panic!("expected Ack v1, got {other:?}"),
        }
    }
    let reports = reports_in(&mut script, &agent, watch).await;
    assert!(
        reports <= 7,
        "{reports} reports in {watch:?} on the control plane's 1 ms"
    );
    script.shut_down(agent, to_agent).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lower_version_or_other_content_under_the_same_version_is_applied_and_acked() {
    let mut script = Script::start().await;
    let agent = support::plane::agent(script.addr, "a", None);
    let (to_agent, _) = script.reconnected().await;
    for (snap, attempts) in [
        (snapshot(5, 4), 4),
        // A control plane restored from an older store: its version is the truth.
        (snapshot(3, 2), 2),
        // The same version with other content.
        (snapshot(3, 5), 5),
        // The version the agent runs, again.
        (snapshot(3, 5), 5),
    ] {
        send(&to_agent, &snap).await;
        match script.reply().await {
            Kind::Ack(ack) => {
                assert_eq!(
                    (ack.version, ack.nonce.as_str()),
                    (snap.version, snap.nonce.as_str())
                )
            }
            other => panic!("expected Ack, got {other:?}"),
        }
        let p = agent.policies();
        assert_eq!(
            (p.version(), p.content_hash()),
            (snap.version, snap.content_hash.as_str())
        );
        assert_eq!(p.source(), Source::ControlPlane);
        assert_eq!(attempts_of(&agent).await, attempts);
    }
    drop(to_agent);
    let (to_agent, hello) = script.reconnected().await;
    assert_eq!(hello.last_applied_version, 3);
    script.shut_down(agent, to_agent).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keepalive_out_of_range_is_bounded_and_the_stream_stays_up() {
    for (interval, timeout) in [
        (Duration::ZERO, Duration::ZERO),
        (Duration::ZERO, Duration::from_secs(10)),
        (Duration::MAX, Duration::MAX),
    ] {
        let what = format!("keepalive({interval:?}, {timeout:?})");
        let mut script = Script::start().await;
        let agent = support::plane::builder(script.addr, "a")
            .keepalive(interval, timeout)
            .connect()
            .unwrap();
        let (to_agent, _) = script.reconnected().await;
        send(&to_agent, &snapshot(1, 4)).await;
        match script.reply().await {
            Kind::Ack(ack) => assert_eq!(ack.version, 1, "{what}"),
            other => panic!("{what}: expected Ack v1, got {other:?}"),
        }
        // The stream stays up.
        let until = Instant::now() + Duration::from_millis(1500);
        while Instant::now() < until {
            tokio::select! {
                e = script.next() => match e {
                    Event::Message(Kind::Metrics(_)) => {}
                    other => panic!("{what}: the stream did not stay up: {other:?}"),
                },
                () = tokio::time::sleep_until(until) => {}
            }
        }
        assert!(agent.is_connected(), "{what}");
        script.shut_down(agent, to_agent).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handle_on_an_endpoint_a_snapshot_removes_runs_under_the_defaults() {
    use retryplane_proto::{convert, pb};
    let mut script = Script::start().await;
    let agent = support::plane::agent(script.addr, "a", None);
    let ep = agent.endpoint("ep");
    let (to_agent, _) = script.reconnected().await;
    send(&to_agent, &snapshot(1, 5)).await;
    assert!(matches!(script.reply().await, Kind::Ack(a) if a.version == 1));
    assert_eq!(attempts_of(&agent).await, 5);
    // v2 names only `other`, with `defaults:` of 2 attempts.
    let yaml = "version: 1\ndefaults:\n  max_attempts: 2\n  backoff: {base: 5ms, max: 20ms, jitter: none}\n  budget: {enabled: false}\n  circuit_breaker: {enabled: false}\nendpoints:\n  other: {max_attempts: 4}\n";
    let doc = pb::PolicyDocument::from(
        retryplane_policy::load(yaml.as_bytes())
            .policies
            .unwrap()
            .document()
            .as_ref(),
    );
    let v2 = pb::Snapshot {
        version: 2,
        content_hash: convert::content_hash(&doc),
        policies: Some(doc),
        nonce: "nonce-2".into(),
        metrics_interval_ms: 60_000,
    };
    send(&to_agent, &v2).await;
    assert!(matches!(script.reply().await, Kind::Ack(a) if a.version == 2));
    let count = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let err = ep
        .call(
            retryplane_agent::CallMeta::http("GET", "/"),
            support::plane::failing(count),
        )
        .await
        .unwrap_err();
    assert_eq!(
        err.attempts, 2,
        "the held handle runs under the new defaults"
    );
    script.shut_down(agent, to_agent).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_shutdown_call_returns_once_the_background_task_has_stopped() {
    let mut script = Script::start().await;
    let agent = support::plane::agent(script.addr, "a", None);
    let (to_agent, _) = script.reconnected().await;
    send(&to_agent, &snapshot(1, 2)).await;
    assert!(matches!(script.reply().await, Kind::Ack(a) if a.version == 1));
    // Counts for the last report: with something sent at shutdown, the task waits for the
    // control plane to read it (with nothing, it does not wait at all).
    support::plane::succeed(&agent, 1).await;
    let first = {
        let agent = agent.clone();
        tokio::spawn(async move { agent.shutdown().await })
    };
    // The agent has half-closed its side; the control plane has not closed its own, so the
    // task waits (bounded) for it.
    script.until_ended().await;
    assert!(agent.is_connected());
    // A second call, from another clone, while the first waits.
    agent.clone().shutdown().await;
    assert!(!agent.is_connected(), "returned before the task stopped");
    first.await.unwrap();
    drop(to_agent);
    script.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_just_under_the_message_limit_is_applied_cached_and_read_back() {
    use retryplane_proto::{convert, pb};
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("agent.cache");
    let mut script = Script::start().await;
    let agent = support::plane::agent(script.addr, "a", Some(&cache));
    let (to_agent, _) = script.reconnected().await;
    let mut doc = snapshot(1, 3).policies.unwrap();
    let template = doc.endpoints[0].clone();
    let mut big = pb::Snapshot {
        version: 9,
        nonce: "nonce-9".into(),
        metrics_interval_ms: 60_000,
        ..Default::default()
    };
    // Endpoints with 120-byte names up to 200 kB under the limit.
    let mut e = template.clone();
    e.name = "0".repeat(120);
    let each = prost::encoding::message::encoded_len(2, &e);
    let n = (retryplane_proto::MAX_MESSAGE_BYTES - 200_000) / each;
    doc.endpoints.extend((0..n).map(|i| {
        let mut e = template.clone();
        e.name = format!("{i:0>120}");
        e
    }));
    big.content_hash = convert::content_hash(&doc);
    big.policies = Some(doc);
    let len = pb::ServerMessage::with_snapshot(&big).encoded_len();
    let limit = retryplane_proto::MAX_MESSAGE_BYTES;
    assert!(len <= limit && len > limit - 400_000, "{len}");
    send(&to_agent, &big).await;
    match script.reply().await {
        Kind::Ack(ack) => assert_eq!(ack.version, 9),
        other => panic!("expected Ack v9, got {other:?}"),
    }
    assert_eq!(attempts_of(&agent).await, 3);
    script.shut_down(agent, to_agent).await;
    // A restart with no control plane starts on it.
    let nothing = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = nothing.local_addr().unwrap();
    drop(nothing);
    let restarted = support::plane::agent(addr, "a", Some(&cache));
    let p = restarted.policies();
    assert_eq!((p.source(), p.version()), (Source::Cache, 9));
    restarted.shutdown().await;
}

/// A URL whose peer takes the connection and never answers (a black hole) is said within
/// seconds: `stream_error()` says the opening waits, instead of `None` for the whole 30 s.
#[tokio::test(start_paused = true)]
async fn a_stream_opening_with_no_answer_is_said_after_five_seconds() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (got, mut request_came) = tokio::sync::mpsc::channel::<()>(8);
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            let got = got.clone();
            held.push(tokio::spawn(async move {
                let Ok(mut conn) = h2::server::handshake(socket).await else {
                    return;
                };
                let mut requests = Vec::new();
                while let Some(Ok(request)) = conn.accept().await {
                    let _ = got.send(()).await;
                    requests.push(request);
                }
            }));
        }
    });
    let agent = support::plane::builder(addr, "a")
        .keepalive(Duration::from_secs(3600), Duration::from_secs(3600))
        .connect()
        .unwrap();
    tokio::time::timeout(Duration::from_secs(60), request_came.recv())
        .await
        .expect("the stream's opening reaches the peer");
    let started = Instant::now();
    assert_eq!(agent.stream_error(), None, "nothing to say yet");
    let error = loop {
        if let Some(error) = agent.stream_error() {
            break error;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "nothing said within the opening's time limit"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let waited = started.elapsed();
    assert!(
        (Duration::from_secs(4)..Duration::from_secs(6)).contains(&waited),
        "{waited:?}"
    );
    assert_eq!(error.code, None);
    assert!(
        error
            .message
            .starts_with("no answer yet: the control plane accepted the connection but has not answered the stream's opening in 5 s"),
        "{error:?}"
    );
    assert!(!agent.is_connected());
    // Nothing waits once the agent is shut down: the note goes with it.
    agent.shutdown().await;
    assert_eq!(agent.stream_error(), None);
}

#[tokio::test(start_paused = true)]
async fn a_control_plane_that_never_answers_the_streams_opening_is_left_and_tried_again() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};

    // A peer that takes each stream's request and never answers it, but keeps its HTTP/2
    // connection served (pings included). Before, the agent waited on the first one for good.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let opened = Arc::new(AtomicU32::new(0));
    let counted = opened.clone();
    tokio::spawn(async move {
        loop {
            let Ok((socket, _)) = listener.accept().await else {
                return;
            };
            let counted = counted.clone();
            tokio::spawn(async move {
                let Ok(mut conn) = h2::server::handshake(socket).await else {
                    return;
                };
                let mut held = Vec::new();
                while let Some(Ok(request)) = conn.accept().await {
                    counted.fetch_add(1, Ordering::SeqCst);
                    held.push(request);
                }
            });
        }
    });
    let agent = support::plane::builder(addr, "a")
        // No ping before the opening's time limit: only that limit can end the wait.
        .keepalive(Duration::from_secs(3600), Duration::from_secs(3600))
        .connect()
        .unwrap();
    let started = Instant::now();
    while opened.load(Ordering::SeqCst) < 2 {
        assert!(
            started.elapsed() < Duration::from_secs(300),
            "the agent never left the stream that was not answered"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Left at the time limit, not before.
    assert!(
        started.elapsed() >= Duration::from_secs(30),
        "{:?}",
        started.elapsed()
    );
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnects_to_a_control_plane_that_refuses_every_stream_back_off_up_to_the_cap() {
    // A peer that answers every stream's opening at once with `UNAVAILABLE`: every session
    // ends at once, so the time between two streams is the agent's reconnect delay, whose
    // ceiling doubles from 50 ms to the 800 ms cap, each delay in [ceiling / 2, ceiling]
    // (equal jitter). (Spread this wide, each bound below is hundreds of milliseconds from
    // both the right delays and the wrong ones, for a loaded machine.)
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            let tx = tx.clone();
            tokio::spawn(async move {
                let Ok(mut conn) = h2::server::handshake(socket).await else {
                    return;
                };
                while let Some(Ok((_request, mut respond))) = conn.accept().await {
                    let _ = tx.send(Instant::now());
                    let refused = http::Response::builder()
                        .header("content-type", "application/grpc")
                        .header("grpc-status", "14")
                        .body(())
                        .unwrap();
                    let _ = respond.send_response(refused, true);
                }
            });
        }
    });
    let agent = support::plane::builder(addr, "backoff")
        .reconnect_backoff(retryplane_agent::ReconnectBackoff::new(
            Duration::from_millis(50),
            Duration::from_millis(800),
            Duration::from_secs(10),
        ))
        .connect()
        .unwrap();
    let mut streams = Vec::new();
    while streams.len() < 9 {
        let at = tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .expect("the agent tries again")
            .unwrap();
        streams.push(at);
    }
    agent.shutdown().await;
    assert_eq!(agent.policies().source(), Source::Fallback);
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let gaps: Vec<f64> = streams.windows(2).map(|w| ms(w[1] - w[0])).collect();
    // A gap is the delay plus the time a try takes, so only its lower bound is exact.
    for (n, gap) in gaps.iter().enumerate() {
        let ceiling = (50u64 << n.min(4)) as f64;
        assert!(
            *gap >= ceiling / 2.0 - 5.0,
            "delay {} was {gap:.0} ms, under {} ms: {gaps:?}",
            n + 1,
            ceiling / 2.0
        );
    }
    // The cap: from the fifth delay on, each is at most 800 ms. A try takes a little time of
    // its own and a loaded machine wakes late now and then, so the middle one of the four is
    // held to the cap with a margin, and none may take more than 2.5 s (without the cap the
    // sixth delay would be at least 0.8 s, the seventh 1.6 s, the eighth 3.2 s: the middle one
    // of the four at least 1.6 s). The first starts below the cap: at most 50 ms, where one
    // started at the cap would be at least 400 ms.
    assert!(gaps[0] < 300.0, "{gaps:?}");
    let mut capped = gaps[4..].to_vec();
    capped.sort_by(f64::total_cmp);
    assert!(capped[capped.len() / 2] <= 1_100.0, "{gaps:?}");
    assert!(capped.iter().all(|gap| *gap <= 2_500.0), "{gaps:?}");
}
