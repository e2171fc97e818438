//! The end-to-end heartbeat of the agent stream: towards a control plane that takes heartbeats
//! (`retryplane-heartbeat: 1`), the agent reports every interval, an empty report when it
//! counted nothing, and takes a stream whose reports go unanswered for
//! `retryplane_proto::liveness_timeout` for dead: an HTTP/2 proxy between the two answers
//! keepalive pings for the other side, so only this shows the stream alive end to end.
//! Against the scripted control plane (`support::script`).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::time::Duration;

use retryplane_agent::Agent;
use retryplane_proto::pb;
use retryplane_proto::pb::agent_message::Kind;
use support::script::{Event, Script, ToAgent, send, snapshot};
use tokio::time::Instant;

const INTERVAL: Duration = Duration::from_millis(100);

/// An agent reporting every 100 ms on a stream that announces acknowledgements and
/// heartbeats, with v1 applied; its Hello.
async fn connected(script: &mut Script) -> (Agent, ToAgent, pb::Hello) {
    script.announce_acks(true);
    script.announce_heartbeats(true);
    let agent = support::plane::builder(script.addr, "a")
        .metrics_interval(INTERVAL)
        .connect()
        .unwrap();
    let (to_agent, hello) = script.reconnected().await;
    let mut v1 = snapshot(1, 1);
    v1.metrics_interval_ms = 100;
    send(&to_agent, &v1).await;
    match script.reply().await {
        Kind::Ack(ack) => assert_eq!(ack.version, 1),
        other => panic!("expected Ack v1, got {other:?}"),
    }
    (agent, to_agent, hello)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_whose_reports_go_unanswered_is_taken_for_dead_and_opened_again() {
    let mut script = Script::start().await;
    let (agent, _to_agent, hello) = connected(&mut script).await;
    assert!(
        hello.heartbeats,
        "the Hello says the agent sends heartbeats"
    );
    // An idle agent still reports: one empty, numbered report, and no second while it waits
    // for its answer.
    let heartbeat = match script.next().await {
        Event::Message(Kind::Metrics(r)) => r,
        other => panic!("expected a heartbeat, got {other:?}"),
    };
    assert!(
        heartbeat.seq > 0 && heartbeat.endpoints.is_empty(),
        "{heartbeat:?}"
    );
    let sent = Instant::now();
    // No answer comes (the script never acknowledges): the agent opens a new stream once the
    // liveness timeout has passed, and sends the unanswered report again there.
    let (_to_agent, _hello) = script.reconnected().await;
    let waited = sent.elapsed();
    let limit = retryplane_proto::liveness_timeout(INTERVAL);
    assert!(
        waited >= limit - INTERVAL && waited < limit + Duration::from_secs(5),
        "reopened after {waited:?} (limit {limit:?})"
    );
    match script.next().await {
        Event::Message(Kind::Metrics(r)) => assert_eq!(r.seq, heartbeat.seq, "{r:?}"),
        other => panic!("expected the unanswered report again, got {other:?}"),
    }
    drop(agent);
    script.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_whose_reports_are_answered_stays_open() {
    let mut script = Script::start().await;
    let (agent, to_agent, _hello) = connected(&mut script).await;
    // Every report answered, for longer than the liveness timeout: one stream throughout.
    let until = Instant::now() + retryplane_proto::liveness_timeout(INTERVAL) * 2;
    let mut answered = 0;
    while Instant::now() < until {
        match script.next().await {
            Event::Message(Kind::Metrics(r)) => {
                let ack = pb::ServerMessage::with_metrics_ack(pb::MetricsAck {
                    seq: r.seq,
                    dropped: false,
                });
                to_agent.send(Ok(ack)).await.unwrap();
                answered += 1;
            }
            other => panic!("expected only reports on the one stream, got {other:?}"),
        }
    }
    assert!(answered >= 20, "{answered} heartbeats answered");
    script.shut_down(agent, to_agent).await;
}
