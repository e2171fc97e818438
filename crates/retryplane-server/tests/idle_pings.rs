//! The idle close waits for a moment in which no byte moved, but bytes that move for no call
//! (the server's own keepalive PINGs and their acks, or a peer's PINGs) do not keep a
//! connection without any stream open for good.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::fs;
use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use bytes::Bytes;
use retryplane_server::server::{ServeConfig, start};

const V1: &str = "version: 1\nendpoints:\n  payments:\n    max_attempts: 3\n";

fn cfg(dir: &std::path::Path) -> ServeConfig {
    fs::write(dir.join("policies.yaml"), V1).unwrap();
    let any = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
    ServeConfig {
        config_file: dir.join("policies.yaml"),
        data_dir: dir.join("data"),
        listen: any,
        admin_listen: any,
        http_listen: any,
        ..ServeConfig::default()
    }
}

/// `--keepalive-interval 1s` (the smallest the CLI takes) and `--connection-idle-timeout 2s`:
/// a connection that never opens a stream is still closed for idleness. The server's own PING
/// every second, answered by the client's h2 stack, moves bytes every second.
#[tokio::test]
async fn server_keepalive_of_one_second_does_not_keep_an_idle_connection_open_for_good() {
    let dir = tempfile::tempdir().unwrap();
    let idle = Duration::from_secs(2);
    let running = start(ServeConfig {
        connection_idle_timeout: idle,
        keepalive_interval: Duration::from_secs(1),
        ..cfg(dir.path())
    })
    .await
    .unwrap();
    let mut kept = Vec::new();
    for addr in [running.agent_addr, running.admin_addr] {
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (_send, conn) = h2::client::Builder::new()
            .handshake::<_, Bytes>(tcp)
            .await
            .unwrap();
        let started = tokio::time::Instant::now();
        let ended = tokio::time::timeout(Duration::from_secs(12), conn).await;
        if ended.is_err() {
            kept.push(format!(
                "{addr}: still open {:?} after the handshake (idle timeout {idle:?}, no stream ever)",
                started.elapsed()
            ));
        }
    }
    let _ = tokio::time::timeout(Duration::from_secs(10), running.shutdown()).await;
    assert!(kept.is_empty(), "{kept:#?}");
}

/// A peer with no stream that sends an HTTP/2 PING every 100 ms (needs no token, no call) is
/// closed for idleness all the same: bytes moving put the close off a few seconds at most.
#[tokio::test]
async fn a_peer_pinging_ten_times_a_second_is_still_closed_for_idleness() {
    let dir = tempfile::tempdir().unwrap();
    let idle = Duration::from_secs(1);
    let running = start(ServeConfig {
        connection_idle_timeout: idle,
        ..cfg(dir.path())
    })
    .await
    .unwrap();
    let addr = running.admin_addr;
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (_send, mut conn) = h2::client::Builder::new()
        .handshake::<_, Bytes>(tcp)
        .await
        .unwrap();
    let mut pings = conn.ping_pong().unwrap();
    let mut conn = tokio::spawn(conn);
    let started = tokio::time::Instant::now();
    let mut closed = false;
    while started.elapsed() < Duration::from_secs(10) {
        tokio::select! {
            _ = &mut conn => { closed = true; break; }
            () = tokio::time::sleep(Duration::from_millis(100)) => {
                if tokio::time::timeout(Duration::from_secs(2), pings.ping(h2::Ping::opaque()))
                    .await
                    .map(|r| r.is_err())
                    .unwrap_or(true)
                {
                    closed = true;
                    break;
                }
            }
        }
    }
    conn.abort();
    let _ = tokio::time::timeout(Duration::from_secs(10), running.shutdown()).await;
    assert!(
        closed,
        "{addr}: a connection that never opened a stream, only PINGing, was still open after \
         {:?} (idle timeout {idle:?})",
        started.elapsed()
    );
}
