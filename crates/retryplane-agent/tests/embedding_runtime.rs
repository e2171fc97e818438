//! How the agent behaves under the runtimes a service embeds it in: a current-thread runtime,
//! and a runtime dropped without `shutdown` (real time, bounded polls).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::time::Duration;

use support::plane::{apply, builder, eventually, plane, yaml};

/// A service's own runtime, on which it starts the agent, and which it later drops (its
/// shutdown path did not call `Agent::shutdown`, or the runtime was a temporary one).
fn own_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_whose_runtime_was_dropped_does_not_say_it_is_connected() {
    let dir = tempfile::tempdir().unwrap();
    let running = plane(dir.path(), &yaml(2), None).await;
    let service_runtime = own_runtime();
    let agent = {
        let _in = service_runtime.enter();
        builder(running.agent_addr, "a").connect().unwrap()
    };
    eventually("the agent connected", || async { agent.is_connected() }).await;
    // The runtime that ran the agent's stream task is gone: no stream is left.
    service_runtime.shutdown_background();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while agent.is_connected() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        !agent.is_connected(),
        "the stream task was dropped with its runtime, yet the agent still says it is connected \
         (stream_error: {:?})",
        agent.stream_error()
    );
    // Shutdown afterwards returns (nothing left to stop) and is bounded.
    tokio::time::timeout(Duration::from_secs(5), agent.shutdown())
        .await
        .expect("shutdown returns once the task is gone");
    running.shutdown().await.unwrap();
}

/// The default `#[tokio::main]` of a small service is multi-threaded, but `flavor =
/// "current_thread"` is common: the agent, the control plane and the calls share one thread.
#[tokio::test(flavor = "current_thread")]
async fn an_agent_on_a_current_thread_runtime_follows_the_control_plane_and_shuts_down() {
    let dir = tempfile::tempdir().unwrap();
    let running = plane(dir.path(), &yaml(2), None).await;
    let agent = builder(running.agent_addr, "a").connect().unwrap();
    eventually("the agent is on version 1", || async {
        agent.policies().version() == 1
    })
    .await;
    assert_eq!(apply(&running, yaml(4)).await, 2);
    eventually("the agent is on version 2", || async {
        agent.policies().version() == 2
    })
    .await;
    let twice = agent.clone();
    tokio::time::timeout(Duration::from_secs(10), async {
        tokio::join!(agent.shutdown(), twice.shutdown());
    })
    .await
    .expect("shutdown is bounded");
    assert!(!agent.is_connected());
    tokio::time::timeout(Duration::from_secs(1), agent.shutdown())
        .await
        .expect("a shutdown after shutdown returns at once");
    running.shutdown().await.unwrap();
}

/// A runtime built with `tokio::runtime::Builder` and no `enable_all` (or `enable_time` and
/// `enable_io`) has no timers and no sockets: the agent's stream task cannot run on it (tokio
/// offers no way to ask a runtime whether it has them, so `connect` cannot refuse it). The
/// task fails on its first timer; the agent then says why in `stream_error`, rather than
/// `None` for good ("before the first try ends").
#[test]
fn on_a_runtime_without_timers_or_sockets_the_agent_says_why_it_never_connects() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let nothing = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = nothing.local_addr().unwrap();
    runtime.block_on(async {
        let agent = retryplane_agent::Agent::builder()
            .url(format!("http://{addr}"))
            .service("checkout")
            .connect()
            .unwrap();
        // Give the stream task its turns (no timer can run here).
        let mut said = None;
        for _ in 0..1_000 {
            tokio::task::yield_now().await;
            said = agent.stream_error();
            if said.is_some() {
                break;
            }
        }
        assert!(!agent.is_connected());
        let said = said.expect("the agent says why it cannot connect");
        assert!(said.message.contains("enable_all"), "{said:?}");
        agent.shutdown().await;
    });
}
