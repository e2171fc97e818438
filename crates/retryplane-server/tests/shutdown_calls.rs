//! `Running::shutdown` waits for the calls' tasks also when their connections are already gone
//! (the peers dropped them just before the shutdown): a call's task holds the admin API, and
//! with it the store, until it ends.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::fs;
use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use bytes::Bytes;
use retryplane_server::server::{ServeConfig, start};

const V1: &str = "version: 1\nendpoints:\n  payments:\n    max_attempts: 3\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_right_after_peers_dropped_unfinished_calls_lets_the_store_go() {
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join("policies.yaml"), V1).unwrap();
    let any = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
    let cfg = ServeConfig {
        config_file: dir.path().join("policies.yaml"),
        data_dir: dir.path().join("data"),
        listen: any,
        admin_listen: any,
        http_listen: any,
        ..ServeConfig::default()
    };
    let mut failures = Vec::new();
    for round in 0..5 {
        let running = match start(cfg.clone()).await {
            Ok(r) => r,
            Err(e) => {
                failures.push(format!("round {round}, its own start: {e}"));
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        let mut conns = Vec::new();
        for _ in 0..20 {
            let tcp = tokio::net::TcpStream::connect(running.admin_addr)
                .await
                .unwrap();
            let (send, conn) = h2::client::handshake(tcp).await.unwrap();
            let conn = tokio::spawn(conn);
            let mut send = send.ready().await.unwrap();
            let mut bodies = Vec::new();
            for _ in 0..20 {
                send = send.ready().await.unwrap();
                let (_answer, mut body) = send
                    .send_request(
                        http::Request::post("/retryplane.v1.AdminService/FleetStatus")
                            .header("content-type", "application/grpc")
                            .header("te", "trailers")
                            .body(())
                            .unwrap(),
                        false,
                    )
                    .unwrap();
                body.send_data(Bytes::from_static(&[0, 0, 0, 0, 9]), false)
                    .unwrap();
                bodies.push(body);
            }
            conns.push((conn, bodies, send));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        // The peers go away (their sockets closed), then at once the shutdown.
        for (conn, _bodies, _send) in &conns {
            conn.abort();
        }
        drop(conns);
        tokio::time::sleep(Duration::from_millis(1)).await;
        tokio::time::timeout(Duration::from_secs(10), running.shutdown())
            .await
            .unwrap()
            .unwrap();
        let began = tokio::time::Instant::now();
        match start(cfg.clone()).await {
            Ok(again) => again.shutdown().await.unwrap(),
            Err(e) => {
                failures.push(format!("round {round}: start right after shutdown: {e}"));
                // How long until it is let go.
                let mut let_go = None;
                while began.elapsed() < Duration::from_secs(5) {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    if let Ok(again) = start(cfg.clone()).await {
                        let_go = Some(began.elapsed());
                        again.shutdown().await.unwrap();
                        break;
                    }
                }
                failures.push(format!(
                    "round {round}: the store was let go after {let_go:?}"
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}
