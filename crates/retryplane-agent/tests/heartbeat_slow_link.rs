//! The end-to-end heartbeat against a real control plane, behind a slow link: a live agent
//! whose answers queue behind a large snapshot is not cut off.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use retryplane_agent::{Agent, ReconnectBackoff};
use support::plane::{apply, plane_with, yaml};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

/// A loopback proxy whose control-plane-to-agent direction carries at most `bytes_per_sec`
/// (a slow link: a mobile or satellite link, a busy VPN); the other direction is free.
/// Counts the connections it accepts.
async fn slow_link(target: SocketAddr, bytes_per_sec: u64) -> (SocketAddr, Arc<AtomicU64>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accepts = Arc::new(AtomicU64::new(0));
    let count = accepts.clone();
    tokio::spawn(async move {
        while let Ok((agent, _)) = listener.accept().await {
            count.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let Ok(server) = TcpStream::connect(target).await else {
                    return;
                };
                let _ = agent.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let (mut ar, mut aw) = agent.into_split();
                let (mut sr, mut sw) = server.into_split();
                let up = tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut ar, &mut sw).await;
                    let _ = sw.shutdown().await;
                });
                let down = tokio::spawn(async move {
                    let chunk = 4096usize;
                    let mut buf = vec![0u8; chunk];
                    loop {
                        let n = match sr.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        if aw.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                        let pause = Duration::from_secs_f64(n as f64 / bytes_per_sec as f64);
                        tokio::time::sleep(pause).await;
                    }
                    let _ = aw.shutdown().await;
                });
                let _ = up.await;
                down.abort();
            });
        }
    });
    (addr, accepts)
}

/// A policy file of `n` endpoints with two routes each (about 860 KB for 4,000).
fn big_yaml(n: usize) -> String {
    let mut y = String::from(
        "version: 1\ndefaults:\n  backoff: {base: 5ms, max: 20ms, jitter: none}\n  budget: {enabled: false}\n  circuit_breaker: {enabled: false}\nendpoints:\n  ep:\n    max_attempts: 3\n",
    );
    for i in 0..n {
        y.push_str(&format!(
            "  ep{i}:\n    max_attempts: {}\n    routes:\n      - match: {{method: POST, path_prefix: /v1/things/{i}}}\n        max_attempts: 2\n      - match: {{method: GET, path_prefix: /v1/other/{i}}}\n        per_try_timeout: 500ms\n",
            2 + i % 3
        ));
    }
    y
}

/// A control plane with `--metrics-interval 1s` (liveness timeout 5 s) and an agent behind a
/// 24 KiB/s link: a policy change whose snapshot takes longer than the liveness timeout to
/// cross the link (about 340 KB, some 14 s) still arrives on the first stream. The answer to
/// the agent's heartbeat queues behind the snapshot, but the snapshot's bytes show the stream
/// alive to the agent, and the agent's unnumbered heartbeats show it alive to the control
/// plane.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_slower_to_cross_the_link_than_the_liveness_timeout_still_arrives() {
    let dir = tempfile::tempdir().unwrap();
    let running = plane_with(dir.path(), &yaml(3), None, |c| {
        c.metrics_interval = Duration::from_secs(1);
    })
    .await;
    let (via, accepts) = slow_link(running.agent_addr, 24 * 1024).await;
    let agent = Agent::builder()
        .url(format!("http://{via}"))
        .service("checkout")
        .agent_id("slow-link")
        .reconnect_backoff(ReconnectBackoff::new(
            Duration::from_millis(20),
            Duration::from_millis(300),
            Duration::from_secs(10),
        ))
        // Keepalive out of the way: only the heartbeat can end the stream here.
        .keepalive(Duration::from_secs(600), Duration::from_secs(600))
        .connect()
        .unwrap();
    let t0 = Instant::now();
    while agent.policies().version() != 1 {
        assert!(t0.elapsed() < Duration::from_secs(15), "never on v1");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Idle a moment: a heartbeat goes and is answered.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let before = accepts.load(Ordering::SeqCst);
    let big = big_yaml(4000);
    eprintln!("pushing a policy file of {} bytes", big.len());
    let v2 = apply(&running, big).await;
    let start = Instant::now();
    let deadline = Duration::from_secs(60);
    while agent.policies().version() != v2 {
        if start.elapsed() > deadline {
            panic!(
                "after {:?} the agent still runs v{} (not v{v2}); it opened {} new connections \
                 meanwhile; last stream error: {:?}",
                start.elapsed(),
                agent.policies().version(),
                accepts.load(Ordering::SeqCst) - before,
                agent.stream_error()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        accepts.load(Ordering::SeqCst) - before,
        0,
        "v{v2} arrived after {:?}, on a new stream",
        start.elapsed()
    );
    agent.shutdown().await;
    let _ = running.shutdown().await;
}
