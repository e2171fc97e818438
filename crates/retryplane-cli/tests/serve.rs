//! `retryplane serve` as a process: prints its addresses, serves, and stops cleanly on SIGTERM.

// clippy's allow-*-in-tests covers `#[test]` functions only; the helpers here are tests too.
#![allow(clippy::unwrap_used, clippy::panic)]

use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _, BufReader};
use tokio::process::Command;

const POLICY: &str = "version: 1\nendpoints:\n  payments:\n    max_attempts: 4\n";
const BOUND: Duration = Duration::from_secs(30);

async fn http_get(addr: &str, path: &str) -> String {
    let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n");
    socket.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    socket.read_to_string(&mut response).await.unwrap();
    response
}

#[cfg(unix)]
#[tokio::test]
async fn serve_prints_its_addresses_and_stops_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("policies.yaml"), POLICY).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_retryplane"))
        .current_dir(dir.path())
        .args(["serve", "--config", "policies.yaml", "--data-dir", "data"])
        .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
        .args(["--http-listen", "127.0.0.1:0"])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut addrs = Vec::new();
    while addrs.len() < 3 {
        let line = tokio::time::timeout(BOUND, lines.next_line())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        let (name, addr) = line.split_once(": ").unwrap();
        addrs.push((name.to_owned(), addr.to_owned()));
    }
    let names: Vec<&str> = addrs.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["agent", "admin", "http"]);
    let response = http_get(&addrs[2].1, "/readyz").await;
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");

    let pid = child.id().unwrap().to_string();
    let killed = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .await
        .unwrap();
    assert!(killed.success());
    let status = tokio::time::timeout(BOUND, child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "{status:?}");
    assert!(dir.path().join("data").is_dir());
}
