//! End-to-end liveness of the agent stream through a loopback TCP proxy
//! (`retryplane_proto::liveness`): HTTP/2 keepalive cannot tell that the other side has gone
//! when something between the two answers it, so each side sends keepalives and takes a stream
//! silent for three periods and 2 s for dead. Here the proxy holds one direction: the agent's
//! connection stays open, and nothing of the other side comes through.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::time::Duration;

use support::plane::{agent, eventually, listed_connected, plane};
use support::proxy::Proxy;
use tokio::time::Instant;

const SEED: &str = "version: 1\nendpoints:\n  ep: {}\n";

/// The plane's metrics interval in these tests (`support::plane`): 200 ms.
fn limit() -> Duration {
    retryplane_proto::liveness::liveness_timeout(Duration::from_millis(200))
}

/// What the control plane sends stops coming (its end died behind a proxy that keeps the
/// agent's connection): the agent takes the stream for dead after the liveness timeout, long
/// before HTTP/2 keepalive would, and says why.
#[tokio::test]
async fn an_agent_whose_control_plane_falls_silent_takes_the_stream_for_dead() {
    let dir = tempfile::tempdir().unwrap();
    let running = plane(dir.path(), SEED, None).await;
    let proxy = Proxy::start(running.agent_addr).await;
    let agent = agent(proxy.addr, "a", None);
    eventually("the agent is connected", || async { agent.is_connected() }).await;
    // The keepalives keep a quiet stream up past the limit.
    tokio::time::sleep(limit() + Duration::from_millis(500)).await;
    assert!(agent.is_connected());
    assert_eq!(listed_connected(&running, "a").await, Some(true));
    proxy.hold_down(true);
    let held = Instant::now();
    eventually("the agent takes the stream for dead", || async {
        !agent.is_connected()
    })
    .await;
    let waited = held.elapsed();
    assert!(waited >= limit() - Duration::from_millis(300), "{waited:?}");
    assert!(waited < limit() + Duration::from_secs(3), "{waited:?}");
    let error = agent
        .stream_error()
        .expect("why the stream ended")
        .to_string();
    assert!(
        error.contains("nothing came from the control plane"),
        "{error}"
    );
    // Back once the proxy forwards again.
    proxy.hold_down(false);
    eventually("the agent reconnects", || async { agent.is_connected() }).await;
    agent.shutdown().await;
    running.shutdown().await.unwrap();
}

/// What the agent sends stops coming (it vanished behind a proxy that keeps the control plane's
/// connection): the control plane ends its stream after the liveness timeout and lists it
/// disconnected.
#[tokio::test]
async fn a_vanished_agent_is_listed_disconnected() {
    let dir = tempfile::tempdir().unwrap();
    let running = plane(dir.path(), SEED, None).await;
    let proxy = Proxy::start(running.agent_addr).await;
    let agent = agent(proxy.addr, "a", None);
    eventually("the agent is listed connected", || async {
        listed_connected(&running, "a").await == Some(true)
    })
    .await;
    proxy.hold_up(true);
    let held = Instant::now();
    eventually("the control plane lists the agent disconnected", || async {
        listed_connected(&running, "a").await == Some(false)
    })
    .await;
    let waited = held.elapsed();
    assert!(waited >= limit() - Duration::from_millis(300), "{waited:?}");
    assert!(waited < limit() + Duration::from_secs(3), "{waited:?}");
    proxy.hold_up(false);
    eventually("the agent is back", || async {
        listed_connected(&running, "a").await == Some(true)
    })
    .await;
    agent.shutdown().await;
    running.shutdown().await.unwrap();
}
